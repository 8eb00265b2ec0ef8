"""FP8 / MXFP8 quantize and dequantize as custom ops (``torch.ops.torch_moe.quantize_fp8``,
``quantize_mx``, ``quantize_jagged``, ``dequantize_fp8``, ``dequantize_mx``,
``dequantize_jagged``) and the public functions that call them.

Each op's default kernel is the plain-PyTorch reference in
:mod:`torch_moe.quantization.quantize` (``*_reference``). On CPU the quantize ops run that
module's ``quantize_*_cpu`` kernels: the reference's per-element operations in cache-sized
chunks (no fp32 copy of the operand), bit for bit its results. CUDA runs the Triton kernels of
:mod:`torch_moe._triton.quantize` (bit for bit the same results), falling back to the
reference for the layouts they do not cover (blocks over more than ``MAX_BLOCK_ELEMS``
elements, MX along a dim other than the last two, inputs of more than three dims). Fake
kernels repeat every input check of the reference (all but the values of ``offs``), so the
ops trace under ``torch.compile`` and bad input raises the same message eager and compiled.

The public functions here (re-exported by :mod:`torch_moe.quantization`) are what library
code calls: a public name always dispatches to the fastest kernel of the device, never to
the reference. In eager mode on plain CPU tensors the quantize ops' CPU kernels are called
directly, without the custom ops' Python layers (:mod:`torch_moe._ops._eager`: the same
kernels, so the same bits; compile, fake tensors, subclasses and other devices take the
ops). Triton is imported only when a CUDA kernel runs, so ``import torch_moe``
works without it.

The ops carry no autograd: quantization is not differentiated through (the scaled GEMMs
are, see :mod:`torch_moe.quantization.scaled_grouped_mm`). Scales are fp32 for FP8 and
uint8 E8M0 exponents for MX; jagged scales have the static row bound of
:func:`torch_moe.quantization.quantize.jagged_num_blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from torch_moe._ops._dtypes import FP8
from torch_moe._ops._eager import direct_calls
from torch_moe.quantization import quantize as Q

__all__ = [
    "dequantize_fp8",
    "dequantize_jagged",
    "dequantize_mx",
    "quantize_fp8",
    "quantize_jagged",
    "quantize_mx",
]


# --------------------------------------------------------------------------------------
# quantize_fp8


@torch.library.custom_op("torch_moe::quantize_fp8", mutates_args=())
def _quantize_fp8(x: Tensor, block: list[int]) -> tuple[Tensor, Tensor]:
    Q.check_quantize_fp8(x, block)
    q, scale = Q.quantize_fp8_reference(x, (block[0], block[1]))
    return q.contiguous(), scale.contiguous()  # the fake kernel's layout, for any input


@_quantize_fp8.register_kernel("cpu")
def _quantize_fp8_cpu(x: Tensor, block: list[int]) -> tuple[Tensor, Tensor]:
    return Q.quantize_fp8_cpu(x, (block[0], block[1]))


@_quantize_fp8.register_kernel("cuda")
def _(x: Tensor, block: list[int]) -> tuple[Tensor, Tensor]:
    from torch_moe._triton import quantize as TQ

    Q.check_quantize_fp8(x, block)
    blk = (block[0], block[1])
    if TQ.supports(x, blk):
        return TQ.quantize_blocks(x, blk)
    q, scale = Q.quantize_fp8_reference(x, blk)
    return q.contiguous(), scale.contiguous()


@_quantize_fp8.register_fake
def _(x: Tensor, block: list[int]) -> tuple[Tensor, Tensor]:
    scale_shape = Q.check_quantize_fp8(x, block)
    return x.new_empty(x.shape, dtype=FP8), x.new_empty(scale_shape, dtype=torch.float32)


def quantize_fp8(x: Tensor, block: Sequence[int] = (-1, -1)) -> tuple[Tensor, Tensor]:
    r"""FP8 e4m3 with one fp32 scale per ``block`` of x's last two dims (``-1``: whole dim).

    ``(q [..., R, C] float8_e4m3fn, scale [..., ceil(R/br), ceil(C/bc)] fp32)`` with
    ``x ~= q * scale``; see :func:`torch_moe.quantization.quantize.quantize_fp8_reference`
    for the numerics. Runs ``torch.ops.torch_moe.quantize_fp8``.
    """
    return _quantize_fp8(x, list(block))


# --------------------------------------------------------------------------------------
# quantize_mx


@torch.library.custom_op("torch_moe::quantize_mx", mutates_args=())
def _quantize_mx(x: Tensor, dim: int, block: int, scale_rule: str) -> tuple[Tensor, Tensor]:
    q, scale = Q.quantize_mx_reference(x, dim=dim, block=block, scale_rule=scale_rule)
    return q.contiguous(), scale.contiguous()


@_quantize_mx.register_kernel("cpu")
def _quantize_mx_cpu(x: Tensor, dim: int, block: int, scale_rule: str) -> tuple[Tensor, Tensor]:
    return Q.quantize_mx_cpu(x, dim, block, scale_rule)


@_quantize_mx.register_kernel("cuda")
def _(x: Tensor, dim: int, block: int, scale_rule: str) -> tuple[Tensor, Tensor]:
    from torch_moe._triton import quantize as TQ

    d, _ = Q.check_quantize_mx(x, dim, block, scale_rule)
    blk = (1, block) if d == x.dim() - 1 else (block, 1)
    if d >= x.dim() - 2 and TQ.supports(x, blk, "mx"):
        return TQ.quantize_blocks(x, blk, fmt="mx", scale_rule=scale_rule, scale_dtype=torch.uint8)
    q, scale = Q.quantize_mx_reference(x, dim=dim, block=block, scale_rule=scale_rule)
    return q.contiguous(), scale.contiguous()


@_quantize_mx.register_fake
def _(x: Tensor, dim: int, block: int, scale_rule: str) -> tuple[Tensor, Tensor]:
    _, scale_shape = Q.check_quantize_mx(x, dim, block, scale_rule)
    return x.new_empty(x.shape, dtype=FP8), x.new_empty(scale_shape, dtype=torch.uint8)


def quantize_mx(
    x: Tensor,
    *,
    dim: int = -1,
    block: int = Q.MX_BLOCK,
    scale_rule: str = "floor",
    scale_dtype: torch.dtype = torch.uint8,
) -> tuple[Tensor, Tensor]:
    r"""MXFP8: ``block`` consecutive elements along ``dim`` share an E8M0 scale.

    ``(q like x float8_e4m3fn, scale)`` with scale like x with ``dim`` divided by ``block``,
    as uint8 biased exponents (``scale_dtype=torch.uint8``) or exact fp32 powers of two
    (``torch.float32``); numerics in
    :func:`torch_moe.quantization.quantize.quantize_mx_reference`. Runs
    ``torch.ops.torch_moe.quantize_mx``.
    """
    if scale_dtype not in (torch.uint8, torch.float32):
        raise ValueError(
            f"quantize_mx: scale_dtype must be torch.uint8 or torch.float32, got {scale_dtype}"
        )
    q, scale = _quantize_mx(x, dim, block, scale_rule)
    return q, scale if scale_dtype == torch.uint8 else Q.e8m0_to_float(scale)


# --------------------------------------------------------------------------------------
# quantize_jagged


def _jagged_scale_dtype(fmt: str) -> torch.dtype:
    return torch.float32 if fmt == "fp8" else torch.uint8


@torch.library.custom_op("torch_moe::quantize_jagged", mutates_args=())
def _quantize_jagged(
    x: Tensor, offs: Tensor, block: int, fmt: str, scale_rule: str
) -> tuple[Tensor, Tensor]:
    q, scale = Q.quantize_jagged_reference(
        x, offs, block=block, fmt=fmt, scale_rule=scale_rule, scale_dtype=_jagged_scale_dtype(fmt)
    )
    return q.contiguous(), scale.contiguous()


@_quantize_jagged.register_kernel("cpu")
def _quantize_jagged_cpu(
    x: Tensor, offs: Tensor, block: int, fmt: str, scale_rule: str
) -> tuple[Tensor, Tensor]:
    return Q.quantize_jagged_cpu(x, offs, block, fmt, scale_rule)


@_quantize_jagged.register_kernel("cuda")
def _(x: Tensor, offs: Tensor, block: int, fmt: str, scale_rule: str) -> tuple[Tensor, Tensor]:
    from torch_moe._triton import quantize as TQ

    Q.check_quantize_jagged(x, offs, block, fmt, scale_rule)
    return TQ.quantize_jagged(
        x, offs, block=block, fmt=fmt, scale_rule=scale_rule, scale_dtype=_jagged_scale_dtype(fmt)
    )


@_quantize_jagged.register_fake
def _(x: Tensor, offs: Tensor, block: int, fmt: str, scale_rule: str) -> tuple[Tensor, Tensor]:
    nb = Q.check_quantize_jagged(x, offs, block, fmt, scale_rule)
    return x.new_empty(x.shape, dtype=FP8), x.new_empty(
        (nb, x.shape[1]), dtype=_jagged_scale_dtype(fmt)
    )


def quantize_jagged(
    x: Tensor,
    offs: Tensor,
    *,
    block: int = 128,
    fmt: str = "fp8",
    scale_rule: str = "floor",
    scale_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Per-column quantization of x [M, N] in blocks of ``block`` rows that restart at every
    group end of ``offs`` (the wgrad operands; ``block=-1``: one block per group).

    ``(q [M, N] float8_e4m3fn, scale [NB, N])``: fp32 scales for ``fmt="fp8"``; for ``"mx"``
    uint8 E8M0 exponents, or exact fp32 powers of two with ``scale_dtype=torch.float32``;
    layout in :mod:`torch_moe.quantization.quantize`. Runs
    ``torch.ops.torch_moe.quantize_jagged``.
    """
    if scale_dtype not in (None, torch.uint8, torch.float32):
        raise ValueError(
            f"quantize_jagged: scale_dtype must be torch.uint8 or torch.float32, got {scale_dtype}"
        )
    q, scale = _quantize_jagged(x, offs, block, fmt, scale_rule)
    if scale_dtype == torch.float32 and scale.dtype == torch.uint8:
        scale = Q.e8m0_to_float(scale)
    return q, scale


# --------------------------------------------------------------------------------------
# dequantize (the reference on every device: one elementwise pass)


@torch.library.custom_op("torch_moe::dequantize_fp8", mutates_args=())
def _dequantize_fp8(q: Tensor, scale: Tensor, block: list[int], dtype: torch.dtype) -> Tensor:
    return Q.dequantize_fp8_reference(q, scale, (block[0], block[1]), dtype)


@_dequantize_fp8.register_fake
def _(q: Tensor, scale: Tensor, block: list[int], dtype: torch.dtype) -> Tensor:
    Q.check_dequantize_fp8(q, scale, block)
    return q.new_empty(q.shape, dtype=dtype)


def dequantize_fp8(
    q: Tensor,
    scale: Tensor,
    block: Sequence[int] = (-1, -1),
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Inverse of :func:`quantize_fp8`: ``q * scale`` (rounded once to fp32), cast to ``dtype``."""
    return torch.ops.torch_moe.dequantize_fp8(q, scale, list(block), dtype)


@torch.library.custom_op("torch_moe::dequantize_mx", mutates_args=())
def _dequantize_mx(q: Tensor, scale: Tensor, dim: int, block: int, dtype: torch.dtype) -> Tensor:
    return Q.dequantize_mx_reference(q, scale, dim=dim, block=block, dtype=dtype)


@_dequantize_mx.register_fake
def _(q: Tensor, scale: Tensor, dim: int, block: int, dtype: torch.dtype) -> Tensor:
    Q.check_dequantize_mx(q, scale, dim, block)
    return q.new_empty(q.shape, dtype=dtype)


def dequantize_mx(
    q: Tensor,
    scale: Tensor,
    *,
    dim: int = -1,
    block: int = Q.MX_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Inverse of :func:`quantize_mx`; ``scale`` may be uint8 (E8M0) or fp32 powers of two."""
    return torch.ops.torch_moe.dequantize_mx(q, scale, dim, block, dtype)


@torch.library.custom_op("torch_moe::dequantize_jagged", mutates_args=())
def _dequantize_jagged(
    q: Tensor, scale: Tensor, offs: Tensor, block: int, dtype: torch.dtype
) -> Tensor:
    return Q.dequantize_jagged_reference(q, scale, offs, block=block, dtype=dtype)


@_dequantize_jagged.register_fake
def _(q: Tensor, scale: Tensor, offs: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    Q.check_dequantize_jagged(q, scale, offs, block)
    return q.new_empty(q.shape, dtype=dtype)


def dequantize_jagged(
    q: Tensor, scale: Tensor, offs: Tensor, *, block: int = 128, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`quantize_jagged` (uint8 scales are read as E8M0)."""
    return torch.ops.torch_moe.dequantize_jagged(q, scale, offs, block, dtype)


# eager calls on plain CPU tensors run the CPU kernels without the ops' Python layers
# (torch_moe._ops._eager); everything else (compile, fake tensors, other devices) the ops
_quantize_fp8 = direct_calls(_quantize_fp8, _quantize_fp8_cpu)
_quantize_mx = direct_calls(_quantize_mx, _quantize_mx_cpu)
_quantize_jagged = direct_calls(_quantize_jagged, _quantize_jagged_cpu)
