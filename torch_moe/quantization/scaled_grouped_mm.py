"""Scaled (FP8 / MXFP8) grouped GEMM: CPU reference, an exact emulation of the GPU kernels.

Legend: M rows (tokens, sorted by expert), K in features, N out features, E experts.

Each GEMM quantizes its operands per the recipe, dequantizes them (exact in fp32) and runs
an fp32 grouped GEMM, which is what a scaled GPU kernel computes up to fp32 accumulation
order. GEMMs a recipe keeps in bf16 cast the operands to bf16 and use the bf16 grouped GEMM.

On CUDA the same function runs on FP8 tensor cores: the Triton quantize kernels
(:mod:`torch_moe._triton.quantize`) write each operand K-major with its scales, and the
Triton scaled grouped GEMMs (:mod:`torch_moe._triton.scaled_grouped_mm`) apply the scales
per K block inside the main loop (blockwise, MX) or once in the epilogue (rowwise,
tensorwise, per-group wgrad). They equal the emulation up to fp32 summation order.
Rowwise and tensorwise forward / dgrad with bf16 operands on Hopper go to torch's own
``torch._scaled_grouped_mm`` instead (``_torch_supports``: the hardware and the torch
version support that recipe there); its call is checked against torch's meta kernel on
CPU (dtypes, strides, scale shapes).

NB: the weight is quantized twice (along K for forward, along N for dgrad) and the
activations twice (along K for forward, along M in per-expert jagged blocks for wgrad), as
the transposed reductions need scales along a different dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torch_moe._ops.grouped_mm import grouped_mm_wgrad
from torch_moe._triton import quantize as TQ
from torch_moe._triton import scaled_grouped_mm as TK
from torch_moe.ops import grouped_mm
from torch_moe.quantization import quantize as Q
from torch_moe.quantization.recipes import GemmQuant, OperandQuant, Recipe, get_recipe

__all__ = ["scaled_grouped_mm"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fq_lhs(a_mk: Tensor, op: OperandQuant) -> Tensor:
    """Quantize-dequantize A [m, k] (reduction along the last dim) to fp32."""
    if op.fmt == "mx":
        q, s = Q.quantize_mx(a_mk, dim=-1, block=op.inner, scale_rule=op.scale_rule)
        return Q.dequantize_mx(q, s, dim=-1, block=op.inner)
    block = (op.outer, op.inner)
    return Q.dequantize_fp8(*Q.quantize_fp8(a_mk, block), block)


def _fq_rhs(b_ekn: Tensor, op: OperandQuant) -> Tensor:
    """Quantize-dequantize B [E, k, n] (reduction along dim -2, per expert) to fp32."""
    if op.fmt == "mx":
        q, s = Q.quantize_mx(b_ekn, dim=-2, block=op.inner, scale_rule=op.scale_rule)
        return Q.dequantize_mx(q, s, dim=-2, block=op.inner)
    block = (op.inner, op.outer)
    return Q.dequantize_fp8(*Q.quantize_fp8(b_ekn, block), block)


def _fq_jagged(t_mc: Tensor, offs: Tensor, op: OperandQuant) -> Tensor:
    """Quantize-dequantize a wgrad operand t [M, C] with blocks along M inside each group."""
    if (op.outer, op.inner) == (-1, -1):  # one scale for the tensor: uniform across groups
        return Q.dequantize_fp8(*Q.quantize_fp8(t_mc))
    q, s = Q.quantize_jagged(t_mc, offs, block=op.inner, fmt=op.fmt, scale_rule=op.scale_rule)
    return Q.dequantize_jagged(q, s, offs, block=op.inner)


def _bf16(t: Tensor) -> Tensor:
    return t.to(torch.bfloat16).contiguous()


def _forward(x: Tensor, w: Tensor, offs: Tensor, g: GemmQuant) -> Tensor:
    if g.lhs is None or g.rhs is None:
        return grouped_mm(_bf16(x), _bf16(w), offs).to(x.dtype)
    return grouped_mm(_fq_lhs(x, g.lhs), _fq_rhs(w, g.rhs), offs).to(x.dtype)


def _dgrad(dy: Tensor, w: Tensor, offs: Tensor, g: GemmQuant) -> Tensor:
    w_enk = w.transpose(-2, -1)
    if g.lhs is None or g.rhs is None:
        return grouped_mm(_bf16(dy), _bf16(w_enk), offs)
    return grouped_mm(_fq_lhs(dy, g.lhs), _fq_rhs(w_enk, g.rhs), offs)


def _wgrad(x: Tensor, dy: Tensor, offs: Tensor, g: GemmQuant) -> Tensor:
    if g.lhs is None or g.rhs is None:
        return grouped_mm_wgrad(_bf16(x), _bf16(dy), offs)
    return grouped_mm_wgrad(_fq_jagged(x, offs, g.lhs), _fq_jagged(dy, offs, g.rhs), offs)


# --------------------------------------------------------------------------------------
# kernel path (CUDA; the same functions run on CPU tensors in Triton's interpreter)


def _quantize_kmajor(t: Tensor, op: OperandQuant, out: Tensor, along_rows: bool) -> Tensor:
    """Quantize t [..., R, C] into ``out`` (any layout); reduction along rows or columns."""
    block = (op.inner, op.outer) if along_rows else (op.outer, op.inner)
    if op.fmt == "mx":
        mx_block = (op.inner, 1) if along_rows else (1, op.inner)
        _, scale = TQ.quantize_blocks(t, mx_block, fmt="mx", scale_rule=op.scale_rule, out=out)
        return scale
    if TQ.supports(t, block):
        _, scale = TQ.quantize_blocks(t, block, out=out)
        return scale
    q, scale = Q.quantize_fp8(t, block)  # blocks too long for one program: torch ops
    out.copy_(q)
    return scale


def _kernel_gemm(
    a: Tensor, b: Tensor, offs: Tensor, g: GemmQuant, out_dtype: torch.dtype
) -> Tensor:
    """FP8 forward / dgrad: a [M, k] @ b [E, k, n] per group, both quantized K-major."""
    assert g.lhs is not None and g.rhs is not None
    M, k = a.shape
    E, _, n = b.shape
    qa = torch.empty((M, k), dtype=torch.float8_e4m3fn, device=a.device)
    sa = _quantize_kmajor(a, g.lhs, qa, along_rows=False)
    qb = torch.empty((E, n, k), dtype=torch.float8_e4m3fn, device=a.device).transpose(-2, -1)
    sb = _quantize_kmajor(b, g.rhs, qb, along_rows=True)  # fp32, [E, KS, NS]
    return TK.scaled_grouped_mm(
        qa, qb, sa, sb, offs, block_k=g.lhs.inner, block_n=g.rhs.outer, out_dtype=out_dtype
    )


_PER_ROW = ((1, -1), (-1, -1))  # (outer, inner) of a rowwise / tensorwise FP8 operand


def _torch_supports(g: GemmQuant, a: Tensor, b: Tensor, out_dtype: torch.dtype) -> bool:
    """Whether forward / dgrad GEMM ``g`` of a [M, k] @ b [E, k, n] runs on
    ``torch._scaled_grouped_mm`` (CUTLASS, Hopper): FP8 with one scale per row of a and per
    column of b (a tensorwise scale is that scale repeated), bf16 output, k and n multiples
    of 16 (its TMA needs 16-byte strides). Groups need no alignment: a is row-major."""
    lhs, rhs = g.lhs, g.rhs
    return (
        lhs is not None
        and rhs is not None
        and lhs.fmt == rhs.fmt == "fp8"
        and (lhs.outer, lhs.inner) in _PER_ROW
        and (rhs.outer, rhs.inner) in _PER_ROW
        and out_dtype == torch.bfloat16
        and a.shape[1] % 16 == 0
        and b.shape[2] % 16 == 0
        and a.is_cuda
        and hasattr(torch, "_scaled_grouped_mm")
        and torch.cuda.get_device_capability(a.device) == (9, 0)
    )


def _torch_operands(a: Tensor, b: Tensor, g: GemmQuant) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``torch._scaled_grouped_mm``'s operands: a [M, k] e4m3 row-major with fp32 scales
    [M], b [E, k, n] e4m3 column-major with fp32 scales [E, n] (dequantized = q * scale)."""
    assert g.lhs is not None and g.rhs is not None
    M, k = a.shape
    E, _, n = b.shape
    qa = torch.empty((M, k), dtype=torch.float8_e4m3fn, device=a.device)
    sa = _quantize_kmajor(a, g.lhs, qa, along_rows=False).reshape(-1).expand(M).contiguous()
    qb = torch.empty((E, n, k), dtype=torch.float8_e4m3fn, device=a.device).transpose(-2, -1)
    sb = _quantize_kmajor(b, g.rhs, qb, along_rows=True).reshape(E, -1).expand(E, n).contiguous()
    return qa, qb, sa, sb


def _torch_gemm(a: Tensor, b: Tensor, offs: Tensor, g: GemmQuant) -> Tensor:
    """FP8 rowwise / tensorwise forward or dgrad on ``torch._scaled_grouped_mm``; bf16 out."""
    qa, qb, sa, sb = _torch_operands(a, b, g)
    out = torch._scaled_grouped_mm(qa, qb, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    M = a.shape[0]
    # rows past the last group are not written: zero them as the other paths do
    past_end = torch.arange(M, device=a.device) >= offs[-1]
    return out.masked_fill_(past_end[:, None], 0)


def _quantize_jagged_mmajor(t: Tensor, offs: Tensor, op: OperandQuant) -> tuple[Tensor, Tensor]:
    """Wgrad operand, M-major: per-tensor or per-group scales in token order; 32 / 128-row
    blocks in the slot layout (every block on an aligned row, see quantize_jagged)."""
    if op.inner == -1:  # token order
        out = torch.empty(t.shape[::-1], dtype=torch.float8_e4m3fn, device=t.device).t()
        if op.outer == -1:  # one scale for the tensor
            return TQ.quantize_blocks(t, (-1, -1), out=out)
        return TQ.quantize_jagged(t, offs, block=-1, fmt=op.fmt, scale_rule=op.scale_rule, out=out)
    nb = TQ.jagged_num_blocks(t.shape[0], offs.shape[0], op.inner)
    out = torch.empty((t.shape[1], nb * op.inner), dtype=torch.float8_e4m3fn, device=t.device).t()
    return TQ.quantize_jagged(
        t, offs, block=op.inner, fmt=op.fmt, scale_rule=op.scale_rule, out=out, slots=True
    )


def _kernel_wgrad(
    x: Tensor, dy: Tensor, offs: Tensor, g: GemmQuant, out_dtype: torch.dtype
) -> Tensor:
    """FP8 wgrad: x_g^T dy_g per group, both quantized M-major in jagged per-group blocks."""
    assert g.lhs is not None and g.rhs is not None
    qx, sx = _quantize_jagged_mmajor(x, offs, g.lhs)
    qdy, sdy = _quantize_jagged_mmajor(dy, offs, g.rhs)
    tensorwise = (g.lhs.outer, g.lhs.inner) == (-1, -1)
    block = -1 if tensorwise else g.lhs.inner
    gfb = (
        torch.zeros(offs.shape[0] + 1, dtype=torch.int32, device=x.device)
        if tensorwise
        else TQ.jagged_block_table(offs, x.shape[0], block)[2]
    )
    return TK.scaled_grouped_mm_wgrad(qx, qdy, sx, sdy, offs, gfb, block, out_dtype=out_dtype)


def _kernels_support(g: GemmQuant) -> bool:
    """Whether the Triton kernels run GEMM ``g`` (else: the emulation, on any device)."""
    lhs, rhs = g.lhs, g.rhs
    if lhs is None or rhs is None:
        return False
    if lhs.inner != rhs.inner or lhs.fmt != rhs.fmt:  # both operands' K blocks must agree
        return False
    if (lhs.outer, lhs.inner) == (-1, -1) != (rhs.outer, rhs.inner):
        return False
    return lhs.inner in (-1, 32, 128) and rhs.outer in (-1, 1, 128)


class _ScaledGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, offs: Tensor, recipe: Recipe) -> Tensor:
        ctx.save_for_backward(x, w, offs)
        ctx.recipe = recipe
        g = recipe.forward
        if _torch_supports(g, x, w, x.dtype):
            return _torch_gemm(x, w, offs, g)
        if x.is_cuda and _kernels_support(g):
            return _kernel_gemm(x, w, offs, g, x.dtype)
        return _forward(x, w, offs, g)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, w, offs = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
        dx = dw = None
        if ctx.needs_input_grad[0]:
            g = recipe.dgrad
            w_t = w.transpose(-2, -1)
            if _torch_supports(g, dy, w_t, x.dtype):
                dx = _torch_gemm(dy, w_t, offs, g)
            elif dy.is_cuda and _kernels_support(g):
                dx = _kernel_gemm(dy, w_t, offs, g, x.dtype)
            else:
                dx = _dgrad(dy, w, offs, g).to(x.dtype)
        if ctx.needs_input_grad[1]:
            g = recipe.wgrad
            if dy.is_cuda and _kernels_support(g):
                dw = _kernel_wgrad(x, dy, offs, g, w.dtype)
            else:
                dw = _wgrad(x, dy, offs, g).to(w.dtype)
        return dx, dw, None, None


def scaled_grouped_mm(x: Tensor, w: Tensor, offs: Tensor, recipe: str | Recipe) -> Tensor:
    r"""Grouped GEMM ``out[rows of g] = x[rows of g] @ w[g]`` in FP8 / MXFP8 per ``recipe``.

    Args:
        x: [M, K] rows sorted by group (fp32, bf16 or fp16).
        w: [E, K, N] in x's dtype.
        offs: [E] int32 group ENDS, as in :func:`torch_moe.ops.grouped_mm`.
        recipe: a name from :data:`torch_moe.quantization.RECIPES` or a :class:`Recipe`.

    Returns [M, N] in x's dtype (rows past ``offs[-1]`` zero). Differentiable in x (dgrad:
    dY quantized along N, W along N) and w (wgrad: X and dY quantized along M in per-expert
    jagged blocks). MX recipes need K and N multiples of 32; FP8 blocks pad partial blocks.
    """
    recipe = get_recipe(recipe)
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(
            f"scaled_grouped_mm: expected x [M, K] and w [E, K, N], got {list(x.shape)} and "
            f"{list(w.shape)}"
        )
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise TypeError(
            f"scaled_grouped_mm: expected x and w to share a dtype in {_DTYPES}, got {x.dtype} "
            f"and {w.dtype}"
        )
    if w.shape[1] != x.shape[1]:
        raise ValueError(
            f"scaled_grouped_mm: x is [M, K={x.shape[1]}] but w is [E, K={w.shape[1]}, N={w.shape[2]}]"
        )
    if offs.dim() != 1 or offs.dtype != torch.int32 or offs.shape[0] != w.shape[0]:
        raise ValueError(
            f"scaled_grouped_mm: expected offs to be [E={w.shape[0]}] int32, got "
            f"{list(offs.shape)} {offs.dtype}"
        )
    out = _ScaledGroupedMM.apply(x, w, offs, recipe)
    return out
