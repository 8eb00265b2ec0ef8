"""FP8 / MXFP8 quantize and dequantize as custom ops: ``torch.ops.torch_moe.quantize_fp8``,
``quantize_mx``, ``quantize_jagged``, ``dequantize_fp8``, ``dequantize_mx``, ``dequantize_jagged``.

Each op's default kernel (CPU and any device) is the plain-PyTorch reference in
:mod:`torch_moe.quantization.quantize`; CUDA runs the Triton kernels of
:mod:`torch_moe._triton.quantize` (bit for bit the same results), falling back to the
reference for the layouts they do not cover (blocks over more than
``MAX_BLOCK_ELEMS`` elements, MX along a dim other than the last two, inputs of more than
three dims). Fake kernels give the shapes, so the ops trace under ``torch.compile``.

The ops carry no autograd: quantization is not differentiated through (the scaled GEMM
is, see :func:`torch_moe.quantization.scaled_grouped_mm`). Arguments and results are
those of the reference functions: scales are fp32 for FP8 and uint8 E8M0 exponents for
MX; jagged scales have the static row bound of
:func:`torch_moe.quantization.quantize.jagged_block_index`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torch_moe._triton import quantize as TQ
from torch_moe.quantization import quantize as Q

__all__: list[str] = []

_FP8 = torch.float8_e4m3fn


# --------------------------------------------------------------------------------------
# quantize_fp8


@torch.library.custom_op("torch_moe::quantize_fp8", mutates_args=())
def quantize_fp8(x: Tensor, block: list[int]) -> tuple[Tensor, Tensor]:
    return Q.quantize_fp8(x, (block[0], block[1]))


@quantize_fp8.register_kernel("cuda")
def _(x: Tensor, block: list[int]) -> tuple[Tensor, Tensor]:
    blk = (block[0], block[1])
    if TQ.supports(x, blk):
        return TQ.quantize_blocks(x, blk)
    return Q.quantize_fp8(x, blk)


@quantize_fp8.register_fake
def _(x: Tensor, block: list[int]) -> tuple[Tensor, Tensor]:
    Q._check_input("quantize_fp8", x)
    if len(block) != 2:
        raise ValueError(f"quantize_fp8: block must be (rows, cols), got {block}")
    *lead, r, c = x.shape
    br, bc = Q._extent(block[0], r), Q._extent(block[1], c)
    return x.new_empty(x.shape, dtype=_FP8), x.new_empty(
        (*lead, -(-r // br), -(-c // bc)), dtype=torch.float32
    )


# --------------------------------------------------------------------------------------
# quantize_mx


@torch.library.custom_op("torch_moe::quantize_mx", mutates_args=())
def quantize_mx(x: Tensor, dim: int, block: int, scale_rule: str) -> tuple[Tensor, Tensor]:
    q, scale = Q.quantize_mx(x, dim=dim, block=block, scale_rule=scale_rule)
    return q.contiguous(), scale.contiguous()


@quantize_mx.register_kernel("cuda")
def _(x: Tensor, dim: int, block: int, scale_rule: str) -> tuple[Tensor, Tensor]:
    d = dim % x.dim() if x.dim() else dim
    blk = (1, block) if d == x.dim() - 1 else (block, 1)
    if d >= x.dim() - 2 and TQ.supports(x, blk, "mx") and x.shape[d] % block == 0:
        return TQ.quantize_blocks(x, blk, fmt="mx", scale_rule=scale_rule, scale_dtype=torch.uint8)
    return Q.quantize_mx(x, dim=dim, block=block, scale_rule=scale_rule)


@quantize_mx.register_fake
def _(x: Tensor, dim: int, block: int, scale_rule: str) -> tuple[Tensor, Tensor]:
    Q._check_input("quantize_mx", x, min_dim=1)
    d = dim % x.dim()
    if block < 1 or x.shape[d] % block:
        raise ValueError(
            f"quantize_mx: dim {d} has size {x.shape[d]}, not a multiple of the block ({block})"
        )
    shape = list(x.shape)
    shape[d] //= block
    return x.new_empty(x.shape, dtype=_FP8), x.new_empty(shape, dtype=torch.uint8)


# --------------------------------------------------------------------------------------
# quantize_jagged


def _jagged_scale_dtype(fmt: str) -> torch.dtype:
    return torch.float32 if fmt == "fp8" else torch.uint8


@torch.library.custom_op("torch_moe::quantize_jagged", mutates_args=())
def quantize_jagged(
    x: Tensor, offs: Tensor, block: int, fmt: str, scale_rule: str
) -> tuple[Tensor, Tensor]:
    return Q.quantize_jagged(
        x, offs, block=block, fmt=fmt, scale_rule=scale_rule, scale_dtype=_jagged_scale_dtype(fmt)
    )


@quantize_jagged.register_kernel("cuda")
def _(x: Tensor, offs: Tensor, block: int, fmt: str, scale_rule: str) -> tuple[Tensor, Tensor]:
    return TQ.quantize_jagged(
        x, offs, block=block, fmt=fmt, scale_rule=scale_rule, scale_dtype=_jagged_scale_dtype(fmt)
    )


@quantize_jagged.register_fake
def _(x: Tensor, offs: Tensor, block: int, fmt: str, scale_rule: str) -> tuple[Tensor, Tensor]:
    Q._check_input("quantize_jagged", x)
    if fmt not in ("fp8", "mx"):
        raise ValueError(f"quantize_jagged: fmt must be 'fp8' or 'mx', got {fmt!r}")
    nb = TQ.jagged_num_blocks(x.shape[0], offs.shape[0], block)
    return x.new_empty(x.shape, dtype=_FP8), x.new_empty(
        (nb, x.shape[1]), dtype=_jagged_scale_dtype(fmt)
    )


# --------------------------------------------------------------------------------------
# dequantize (the reference on every device: one elementwise pass)


@torch.library.custom_op("torch_moe::dequantize_fp8", mutates_args=())
def dequantize_fp8(q: Tensor, scale: Tensor, block: list[int], dtype: torch.dtype) -> Tensor:
    return Q.dequantize_fp8(q, scale, (block[0], block[1]), dtype)


@dequantize_fp8.register_fake
def _(q: Tensor, scale: Tensor, block: list[int], dtype: torch.dtype) -> Tensor:
    return q.new_empty(q.shape, dtype=dtype)


@torch.library.custom_op("torch_moe::dequantize_mx", mutates_args=())
def dequantize_mx(q: Tensor, scale: Tensor, dim: int, block: int, dtype: torch.dtype) -> Tensor:
    return Q.dequantize_mx(q, scale, dim=dim, block=block, dtype=dtype)


@dequantize_mx.register_fake
def _(q: Tensor, scale: Tensor, dim: int, block: int, dtype: torch.dtype) -> Tensor:
    return q.new_empty(q.shape, dtype=dtype)


@torch.library.custom_op("torch_moe::dequantize_jagged", mutates_args=())
def dequantize_jagged(
    q: Tensor, scale: Tensor, offs: Tensor, block: int, dtype: torch.dtype
) -> Tensor:
    return Q.dequantize_jagged(q, scale, offs, block=block, dtype=dtype)


@dequantize_jagged.register_fake
def _(q: Tensor, scale: Tensor, offs: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    return q.new_empty(q.shape, dtype=dtype)
