"""Functional MoE API (mirrors ``torch.nn.functional``).

Legend: M permuted rows, D model dim, F expert hidden dim, E experts.
"""

from __future__ import annotations

from torch import Tensor

from torch_moe._ops import grouped_swiglu as _swiglu

__all__ = ["grouped_swiglu"]


def grouped_swiglu(x: Tensor, w13: Tensor, w2: Tensor, offs: Tensor) -> Tensor:
    r"""SwiGLU expert MLP over expert-sorted rows.

    ``y[rows of e] = (silu(x W_gate^T) * (x W_up^T)) W_down^T`` with the weights of expert e.

    Args:
        x: [M, D] permuted tokens (rows of expert e are ``offs[e-1]:offs[e]``).
        w13: [E, 2F, D] gate rows first, then up rows (HF ``gate_up_proj``).
        w2: [E, D, F] down projection (HF ``down_proj``).
        offs: [E] int32 group ends; rows at or past ``offs[-1]`` give zero.

    Gate and up are one GEMM. The backward keeps only ``x`` and the [M, 2F]
    pre-activation and recomputes the activation. Differentiable in x, w13 and w2.
    """
    y, _h = _swiglu.grouped_swiglu(x, w13, w2, offs)
    return y
