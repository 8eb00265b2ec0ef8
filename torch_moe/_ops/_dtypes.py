"""Dtype policy shared by the torch_moe ops."""

from __future__ import annotations

import torch

__all__ = ["acc_dtype"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype routing math, reductions and combines run in: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
