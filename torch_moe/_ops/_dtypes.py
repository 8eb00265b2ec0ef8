"""Dtype policy shared by every torch_moe op, kernel and quantizer: the one home of the
dtype lists (no module keeps its own copy).

* ``FLOAT_DTYPES``: what the reference ops (and so the CPU kernels) take: fp16, bf16, fp32
  and fp64 (fp64 for ``gradcheck``).
* ``KERNEL_DTYPES``: what the Triton kernels take (no fp64 on tensor cores); also the
  high-precision inputs of the FP8 / MX grouped GEMMs.
* ``FP8``: the element type of every FP8 / MX quantized operand (e4m3).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["FLOAT_DTYPES", "FP8", "KERNEL_DTYPES", "acc_dtype", "no_autocast", "no_cpu_autocast"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype routing math, reductions and combines run in: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def no_autocast(device_type: str) -> contextlib.AbstractContextManager[object]:
    """``torch.autocast(device_type, enabled=False)`` where that autocast is on, else a
    no-op: a kernel that decides its GEMMs' dtypes must not be recast by a caller's autocast
    (a custom op's kernel runs with the caller's autocast state; compiled code, whose
    kernels run outside autocast, does not), and entering an autocast context costs
    microseconds per kernel call where there is none to leave."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def no_cpu_autocast() -> contextlib.AbstractContextManager[object]:
    """:func:`no_autocast` for the CPU kernels."""
    return no_autocast("cpu")
