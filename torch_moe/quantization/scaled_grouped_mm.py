"""Scaled (FP8 / MXFP8) grouped GEMMs as custom ops.

Legend: M rows (tokens, sorted by expert), K in features, N out features, E experts,
KS / NS scale blocks along K / N, NB jagged scale rows (wgrad).

Two layers of ops, so that the compiler can see as much as it can use:

* Over quantized operands (no autograd: quantization is not differentiated through):

  - ``torch_moe::scaled_grouped_mm(a, b, scale_a, scale_b, offs, block_k, block_n,
    out_dtype)``: ``out[rows of g] = (a * scale_a)[rows of g] @ (b * scale_b)[g]`` with a
    [M, K] and b [E, K, N] in e4m3 (any strides), scale_a [M or 1, KS] (per row and K block,
    or per tensor), scale_b [E, KS, NS]; a scale block spans ``block_k`` elements of K in
    both operands and ``block_n`` columns of b (-1: the whole dim). Scales are fp32, or
    uint8 E8M0 exponents for MX (``block_k=32``, ``block_n=1``). This is the shape of
    ``torch._scaled_grouped_mm`` with block scales.
  - ``torch_moe::scaled_grouped_mm_wgrad(a, b, scale_a, scale_b, offs, block, out_dtype)``:
    ``out[g] = (a * scale_a)[rows of g]^T @ (b * scale_b)[rows of g]`` [E, K, N] with a [M, K]
    and b [M, N] in token order and jagged per-column scales [NB, K] / [NB, N]
    (:func:`~torch_moe.quantization.quantize_jagged` with ``block``) or [1, 1] per tensor.

* Over high-precision operands, one op per GEMM of a linear layer, the recipe passed by
  name or spec (:meth:`Recipe.op_arg`):

  - ``torch_moe::quantized_grouped_mm(x, w, offs, recipe)`` (forward, with autograd),
  - ``torch_moe::quantized_grouped_mm_dgrad(dy, w, offs, recipe)``,
  - ``torch_moe::quantized_grouped_mm_wgrad(x, dy, offs, recipe)``,

  each quantizing its operands per the recipe's GEMM and multiplying. The backward of
  ``quantized_grouped_mm`` calls the other two. :func:`scaled_grouped_mm` is the public
  entry point. In eager mode on plain CPU tensors these five ops (and the quantize ops
  they call) run their CPU kernels and autograd formula directly, without the custom ops'
  Python layers (:mod:`torch_moe._ops._eager`; the same functions, so the same bits).

Numerics. Each GEMM quantizes its operands per the recipe, then multiplies the dequantized
values (each ``q * scale`` rounded once to fp32: exact for MX's power-of-two scales, not
for an FP8 scale of amax / 448) with fp32 accumulation. The CPU kernels are that emulation,
literally (quantize ops -> dequantize -> fp32 ``grouped_mm``), except where the CPU
multiplies bf16 natively and the output is bf16: MX operands go through the bf16 grouped
GEMM (their dequantized elements are bf16 values: the same math in another summation
order, :func:`_mx_in_bf16`; where its route is the native GEMM's pieces, each piece
dequantized as the GEMM takes it, :func:`_mx_pieces`), and the FP8 recipes multiply the
codes in bf16, each k block's fp32 sums times the product of its row's and its column's
scale inside the GEMM's tiles (blockwise, :func:`_blocks_in_bf16`, as the GPU kernels'
main loop; scales constant along the reduction, :func:`_codes_in_bf16`, repeated per
block of the GEMM's own); GEMMs a recipe keeps in bf16 cast the operands to bf16. On CUDA
the same function runs on FP8 tensor cores: Triton quantize kernels write each operand K-major
with its scales and the Triton scaled grouped GEMMs
(:mod:`torch_moe._triton.scaled_grouped_mm`) apply the scales per K block in the main loop
(blockwise, MX) or once in the epilogue (rowwise, tensorwise, per-group wgrad); rowwise and
tensorwise forward / dgrad with bf16 operands on Hopper go to ``torch._scaled_grouped_mm``.
Which kernel runs is decided by :func:`gemm_kernel`, a plain function of the recipe, the
shapes and the device (tested on CPU); ``torch_moe::scaled_grouped_mm`` (what a compiled
graph decomposes these ops into) picks by the same rule (:func:`scaled_op_kernel`), so the
compiled layer runs eager's kernels. All equal the emulation up to fp32 summation order.

NB: the weight is quantized twice (along K for forward, along N for dgrad) and the
activations twice (along K for forward, along M in per-expert jagged blocks for wgrad), as
the transposed reductions need scales along a different dim.

With :func:`torch_moe._inductor.enable`, ``quantized_grouped_mm`` decomposes into the
quantize ops and ``scaled_grouped_mm`` (for the GEMMs :func:`decomposable` accepts), so the
compiler's passes can fuse the quantization into its producers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false

from torch_moe._ops import _cpu_probe, _native
from torch_moe._ops._dtypes import FP8, KERNEL_DTYPES
from torch_moe._ops._eager import direct_calls
from torch_moe._ops.grouped_mm import (
    check_offs,
    check_offs_values,
    cpu_compute_dtype,
    experts_transposed,
    group_sizes,
    grouped_mm,
    grouped_mm_reference,
    grouped_mm_wgrad,
    mm_into,
    native_gemm_for,
    native_gemm_ready,
    rows_per_busy_group,
    shares_upcast_groups,
    streams_outputs,
    upcasts_pieces,
    wgrad_way,
    whole_way,
    zero_tail_,
)
from torch_moe._ops.permute import gather_rows
from torch_moe.quantization import quantize as Q
from torch_moe.quantization.ops import (
    dequantize_fp8,
    dequantize_jagged,
    dequantize_mx,
    quantize_fp8,
    quantize_jagged,
    quantize_mx,
)
from torch_moe.quantization.recipes import GemmQuant, OperandQuant, Recipe, get_recipe

__all__ = [
    "decomposable",
    "gemm_kernel",
    "quantize_lhs",
    "quantize_rhs",
    "quantize_wgrad_operand",
    "scaled_grouped_mm",
    "scaled_grouped_mm_reference",
    "scaled_grouped_mm_wgrad_reference",
    "scaled_op_kernel",
    "wgrad_kernel",
]

_SCALE_DTYPES = (torch.float32, torch.uint8)


# --------------------------------------------------------------------------------------
# checks shared by the real and the fake kernels


def _block_count(fn: str, name: str, block: int, size: int) -> int:
    if not isinstance(block, int) or (block < 1 and block != -1):
        raise ValueError(f"{fn}: {name} must be a positive int or -1 (whole dim), got {block}")
    return 1 if block == -1 else -(-size // block)


def _check_scaled(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    block_k: int,
    block_n: int,
    out_dtype: torch.dtype,
) -> None:
    fn = "scaled_grouped_mm"
    if a.dim() != 2 or b.dim() != 3 or a.dtype != FP8 or b.dtype != FP8:
        raise ValueError(
            f"{fn}: expected a [M, K] and b [E, K, N] in {FP8}, got {a.dim()}D {a.dtype} and "
            f"{b.dim()}D {b.dtype}"
        )
    (M, K), (E, Kb, N) = a.shape, b.shape
    if Kb != K:
        raise ValueError(f"{fn}: a is [M, K={K}] but b is [E, K={Kb}, N={N}]")
    if scale_a.dtype not in _SCALE_DTYPES or scale_b.dtype != scale_a.dtype:
        raise ValueError(
            f"{fn}: expected fp32 (or uint8 E8M0) scales of one dtype, got {scale_a.dtype} and "
            f"{scale_b.dtype}"
        )
    ks = _block_count(fn, "block_k", block_k, K)
    ns = _block_count(fn, "block_n", block_n, N)
    # M may be an unbacked SymInt (expert-parallel rows): ask "== M" first, which a shared
    # symbol answers without a guard (``in (1, M)`` asks "== 1" of it first)
    if (
        scale_a.dim() != 2
        or scale_a.shape[1] != ks
        or not (guard_or_false(scale_a.shape[0] == M) or guard_or_false(scale_a.shape[0] == 1))
    ):
        raise ValueError(
            f"{fn}: block_k={block_k} needs scale_a [M={M} or 1, {ks}], got {list(scale_a.shape)}"
        )
    if list(scale_b.shape) != [E, ks, ns]:
        raise ValueError(
            f"{fn}: blocks ({block_k}, {block_n}) need scale_b [{E}, {ks}, {ns}], got "
            f"{list(scale_b.shape)}"
        )
    if out_dtype not in KERNEL_DTYPES:
        raise ValueError(f"{fn}: out_dtype must be one of {KERNEL_DTYPES}, got {out_dtype}")
    for name, t in (("b", b), ("scale_a", scale_a), ("scale_b", scale_b)):
        if t.device != a.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but a is on {a.device}")
    check_offs(fn, offs, E, a.device)


def _check_scaled_wgrad(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    block: int,
    out_dtype: torch.dtype,
) -> None:
    fn = "scaled_grouped_mm_wgrad"
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0] or a.dtype != FP8:
        raise ValueError(
            f"{fn}: expected a [M, K] and b [M, N] in {FP8} with the same M, got "
            f"{list(a.shape)} {a.dtype} and {list(b.shape)} {b.dtype}"
        )
    if b.dtype != FP8:
        raise ValueError(f"{fn}: expected b in {FP8}, got {b.dtype}")
    if scale_a.dtype not in _SCALE_DTYPES or scale_b.dtype != scale_a.dtype:
        raise ValueError(
            f"{fn}: expected fp32 (or uint8 E8M0) scales of one dtype, got {scale_a.dtype} and "
            f"{scale_b.dtype}"
        )
    check_offs(fn, offs, None, a.device)
    if not isinstance(block, int) or (block < 1 and block != -1):
        raise ValueError(f"{fn}: block must be a positive int or -1 (per group), got {block}")
    (M, K), N = a.shape, b.shape[1]
    per_tensor = list(scale_a.shape) == [1, 1] and list(scale_b.shape) == [1, 1]
    nb = Q.jagged_num_blocks(M, offs.shape[0], block)
    if not per_tensor and (list(scale_a.shape) != [nb, K] or list(scale_b.shape) != [nb, N]):
        raise ValueError(
            f"{fn}: block {block} over M={M} rows in {offs.shape[0]} groups needs scales "
            f"[{nb}, {K}] and [{nb}, {N}] (or [1, 1] per tensor), got {list(scale_a.shape)} "
            f"and {list(scale_b.shape)}"
        )
    if out_dtype not in KERNEL_DTYPES:
        raise ValueError(f"{fn}: out_dtype must be one of {KERNEL_DTYPES}, got {out_dtype}")


# --------------------------------------------------------------------------------------
# scaled_grouped_mm: the op over quantized operands


def _fp32_scales(scale: Tensor) -> Tensor:
    return Q.e8m0_to_float(scale) if scale.dtype == torch.uint8 else scale


def _expand(scale: Tensor, dim: int, block: int, size: int) -> Tensor:
    """Repeat ``scale`` along ``dim`` so that each entry covers its block of ``size``
    (blocks of one element, or the whole dim: ``scale`` itself, not copied)."""
    if block in (-1, 1):
        return scale
    return scale.repeat_interleave(block, dim=dim).narrow(dim, 0, size)


def _scale_blocks_(t: Tensor, scale: Tensor, block_r: int, block_c: int) -> Tensor:
    """``t *= scale`` over the last two dims of t [..., R, C], scale [..., RS, CS] covering
    blocks of ``block_r x block_c`` (-1: the whole dim): broadcast over each block where
    the blocks tile t's memory (a block larger than its dim covers the dim), repeated to
    full size otherwise."""
    *lead, r, c = t.shape
    # a block past the dim (or -1) covers the dim: one scale row / column, broadcast
    br, bc = min(r, r if block_r == -1 else block_r), min(c, c if block_c == -1 else block_c)
    if r and c and r % br == 0 and c % bc == 0:
        scale = scale.expand(*lead, r // br, c // bc)
        if t.is_contiguous():
            t.view(*lead, r // br, br, c // bc, bc).mul_(scale[..., :, None, :, None])
            return t
        tt = t.transpose(-2, -1)
        if tt.is_contiguous():  # column-major: the same blocks, transposed
            tt.view(*lead, c // bc, bc, r // br, br).mul_(
                scale.transpose(-2, -1)[..., :, None, :, None]
            )
            return t
    if block_r not in (1, -1):
        scale = _expand(scale, t.dim() - 2, block_r, r)
    if block_c not in (1, -1):
        scale = _expand(scale, t.dim() - 1, block_c, c)
    return t.mul_(scale)


def _dequantize_native(
    q: Tensor,
    scale: Tensor,
    block_r: int,
    block_c: int,
    index: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor | None:
    """``q.float()`` times its blocks' fp32 scales (``scale`` [ceil(R / block_r), ceil(C /
    block_c)], one row or column broadcast; row r's scale row ``index[r]`` where given) for
    a 2D q by the native kernel in one pass (csrc/fp8_cpu.cpp: the same products as
    :func:`_scale_blocks_`, so the same bits), into ``out`` (q's shape) or a new tensor;
    None where it does not apply (no kernels, another layout)."""
    mod = Q._fp8_kernels(q)
    if mod is None or q.dim() != 2 or scale.dim() != 2 or scale.dtype != torch.float32:
        return None
    r, c = q.shape
    if c > 1 and q.stride(1) != 1:  # column-major: the row-major transpose's blocks
        if index is not None or (r > 1 and q.stride(0) != 1):
            return None
        res = _dequantize_native(
            q.t(), scale.t(), block_c, block_r, None, None if out is None else out.t()
        )
        return None if res is None else res.t()
    br = r if block_r == -1 or (scale.shape[0] == 1 and index is None) else block_r
    bc = c if block_c == -1 or scale.shape[1] == 1 else block_c
    dst = torch.empty((r, c), dtype=torch.float32) if out is None else out
    ok = mod.fp8_dequantize_scaled(q, scale.contiguous(), index, max(br, 1), max(bc, 1), dst)
    return dst if ok else None


def _dequantize_lhs(a: Tensor, scale_a: Tensor, block_k: int) -> Tensor:
    # fp8 -> fp32 values exactly (Q._fp8_to_float: a table, not the slow CPU cast), then
    # the scales in place: the same products as with a repeated scale, in a's layout; in
    # one pass by the native kernel where it applies
    sf = _fp32_scales(scale_a)
    native = _dequantize_native(a, sf, 1, block_k) if a.dim() == 2 else None
    return native if native is not None else _scale_blocks_(Q._fp8_to_float(a), sf, 1, block_k)


def _dequantize_rhs_native(
    b: Tensor,
    scale: Tensor,
    block_k: int,
    block_n: int,
    dtype: torch.dtype,
    experts: list[int] | None = None,
) -> Tensor | None:
    """B [E, k, n] times its scales (fp32, or E8M0 exponents: converted here) by the native
    kernel, expert by expert in b's layout, into ``dtype`` (fp32, or bf16 rounded as
    ATen's cast rounds); None where it does not apply. With ``experts``, only those
    experts' values (and scales) are converted and written, the others' memory left as
    allocated: for a GEMM whose other groups have no rows, which no grouped GEMM kernel
    reads."""
    if b.dim() != 3 or Q._fp8_kernels(b) is None:
        return None
    out = torch.empty_like(b, dtype=dtype)
    ids: list[int] | range = range(b.shape[0])
    if experts is not None and len(experts) < b.shape[0]:
        # the busy experts' scales gathered and converted by one call (a call each, on a
        # strided slice, cost two copies of it), in their own layout: the column-major
        # experts' (a weight's transposed codes) as the kernel reads them, without a copy
        ids, busy = experts, torch.tensor(experts, dtype=torch.long)
        if scale.dim() == 3 and scale.stride(1) == 1 and scale.stride(2) != 1:
            sf = _fp32_scales(scale.transpose(1, 2).index_select(0, busy)).transpose(1, 2)
        else:
            sf = _fp32_scales(scale.index_select(0, busy))
    else:
        sf = _fp32_scales(scale)
        if _dequantize_stacked(b, sf, block_k, block_n, out):
            return out
    for i, e in enumerate(ids):  # sf[i]: expert e's scales
        if _dequantize_native(b[e], sf[i], block_k, block_n, out=out[e]) is None:
            return None
    return out


def _dequantize_stacked(b: Tensor, sf: Tensor, block_k: int, block_n: int, out: Tensor) -> bool:
    """B [E, k, n] times its fp32 block scales ``sf`` [E, ceil(k / block_k), ceil(n /
    block_n)] into ``out`` (``empty_like(b)``: b's strides) by one native call: the
    experts stacked as one matrix in their layout ([E k, n] row-major experts, [E n, k]
    column-major), each stacked row's scale row by index (blocks never cross experts).
    The per-expert calls' products; one call instead of E (0.76 against 1.34 ms for an MX
    [64, 256, 256] on a Zen 4 core). False where b or ``sf`` is not so laid out."""
    E, K, N = b.shape
    bk, bn = (K if block_k == -1 else block_k), (N if block_n == -1 else block_n)
    KS, NS = -(-K // max(bk, 1)), -(-N // max(bn, 1))
    if b.numel() == 0 or tuple(sf.shape) != (E, KS, NS):
        return False
    if b.is_contiguous():  # [E K, N]: row (e, k) under scale row e KS + k // bk
        rows = torch.arange(K) // bk
        index = (torch.arange(E)[:, None] * KS + rows).reshape(-1)
        q2, s2, o2, bc = b.view(E * K, N), sf.reshape(E * KS, NS), out.view(E * K, N), bn
    elif b.transpose(1, 2).is_contiguous():  # [E N, K]: row (e, n) under e NS + n // bn
        rows = torch.arange(N) // bn
        index = (torch.arange(E)[:, None] * NS + rows).reshape(-1)
        q2 = b.transpose(1, 2).reshape(E * N, K)
        s2 = sf.transpose(1, 2).reshape(E * NS, KS)
        o2, bc = out.transpose(1, 2).view(E * N, K), bk
    else:
        return False
    return _dequantize_native(q2, s2, 1, bc, index, out=o2) is not None


def _dequantize_rhs(b: Tensor, scale_b: Tensor, block_k: int, block_n: int) -> Tensor:
    sf = _fp32_scales(scale_b)
    native = _dequantize_rhs_native(b, sf, block_k, block_n, torch.float32)
    return (
        native if native is not None else _scale_blocks_(Q._fp8_to_float(b), sf, block_k, block_n)
    )


def _dequantize_operands(
    a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, block_k: int, block_n: int
) -> tuple[Tensor, Tensor]:
    return _dequantize_lhs(a, scale_a, block_k), _dequantize_rhs(b, scale_b, block_k, block_n)


def scaled_grouped_mm_reference(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    block_k: int,
    block_n: int,
    out_dtype: torch.dtype,
) -> Tensor:
    """The oracle: dequantize both operands to fp32, per-group loop of fp32 mm."""
    _check_scaled(a, b, scale_a, scale_b, offs, block_k, block_n, out_dtype)
    a_f, b_f = _dequantize_operands(a, b, scale_a, scale_b, block_k, block_n)
    return grouped_mm_reference(a_f, b_f, offs).to(out_dtype)


@torch.library.custom_op("torch_moe::scaled_grouped_mm", mutates_args=())
def _scaled_grouped_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    block_k: int,
    block_n: int,
    out_dtype: torch.dtype,
) -> Tensor:
    _check_scaled(a, b, scale_a, scale_b, offs, block_k, block_n, out_dtype)
    a_f, b_f = _dequantize_operands(a, b, scale_a, scale_b, block_k, block_n)
    return grouped_mm(a_f, b_f, offs).to(out_dtype)


# rows dequantized per chunk by the CPU kernels: fp32 [rows, K] and [rows, N] blocks of
# ~1 MiB, which stay in a core's cache (whole groups; a larger group is its own chunk)
_CPU_CHUNK_ELEMS = 2**18


def _chunks_of_groups(
    ends: list[int], chunk_rows: int, max_groups: int | None = None
) -> list[tuple[int, int, list[int]]]:
    """Consecutive groups gathered into chunks of about ``chunk_rows`` rows and at most
    ``max_groups`` groups (a larger group is a chunk of its own): ``(first row, end row,
    group indices)`` per chunk."""
    chunks: list[tuple[int, int, list[int]]] = []
    start = 0
    for g, end in enumerate(ends):
        fits = max_groups is None or (chunks and len(chunks[-1][2]) < max_groups)
        if chunks and fits and end - chunks[-1][0] <= chunk_rows:
            c0, _, gs = chunks[-1]
            chunks[-1] = (c0, end, [*gs, g])
        else:
            chunks.append((start, end, [g]))
        start = end
    return chunks


def _mx_in_bf16(scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the CPU kernels multiply in bf16: both operands MX (E8M0 scales, powers of
    two), a bf16 output, and bf16 GEMMs native on this CPU. Every dequantized element is
    then an e4m3 value (4 significant bits) times a power of two, a bf16 value as exactly
    as an fp32 one, and the bf16 GEMM (fp32 sums of the exact products, one rounding to
    bf16) is the fp32 emulation's math in another summation order, at the native bf16
    rate instead of the fp32 GEMM's (on the AMX Xeon measured about 1000 against 190
    GFLOP/s). Elements under bf16's normal range (2^-126: blocks whose largest element is
    under about 2^-117) read as zero there, as the bf16 GEMMs read every denormal."""
    return (
        scale_a.dtype == torch.uint8
        and scale_b.dtype == torch.uint8
        and out_dtype == torch.bfloat16
        and bf16_gemms_native()
    )


def _native_codes(scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> bool:
    """What the three routes that multiply the FP8 codes in bf16 share: fp32 scales whose
    products are finite (:func:`_scale_products_finite`), a bf16 output and torch_moe's
    native bf16 GEMM here."""
    return (
        scale_a.dtype == torch.float32
        and scale_b.dtype == torch.float32
        and out_dtype == torch.bfloat16
        and native_gemm_ready(torch.bfloat16)
        and _scale_products_finite(scale_a, scale_b)
    )


def _scale_products_finite(scale_a: Tensor, scale_b: Tensor) -> bool:
    """Whether every product of one of A's scales and one of B's is a finite fp32 value.
    The routes on the codes multiply each block's sums by that product; the fp32 form
    multiplies operands already scaled. Where the operands' largest elements multiply past
    about 6.9e43 (448^2 times fp32's largest value) the product is inf, and a block whose
    codes sum to zero would give NaN where the fp32 form gives 0: those take the fp32 form
    (NaN scales too)."""
    if scale_a.numel() == 0 or scale_b.numel() == 0:
        return True
    return float(scale_a.max()) * float(scale_b.max()) <= torch.finfo(torch.float32).max


def _codes_in_bf16(scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the CPU kernels multiply the e4m3 codes themselves in bf16 and scale the
    sums: fp32 scales constant along the reduction (one K block per row of A and column
    of B: rowwise, tensorwise, a blockwise GEMM with K <= 128), a bf16 output, and
    torch_moe's native bf16 GEMM here. Then ``out[i, j] = (sum_k qa[i, k] qb[k, j]) *
    (sa[i] * sb[j])`` inside the GEMM's tiles, each of its 512-k blocks of sums scaled by
    one fused multiply-add (``fp8_block_scaled_mm`` with the scales repeated per block,
    :func:`_k_blocks`): the e4m3 values are bf16 values, their products exact in fp32, so
    the GEMM runs at the bf16 rate (2.2x the fp32 GEMM's on the Zen 4 EPYC measured) on
    operands of 2 bytes instead of 4, and no fp32 sums are written. The fp32 form
    multiplies ``qa * sa`` by ``qb * sb``, each rounded to fp32 first: the two differ in
    fp32's last bits (the scales' products rounded, the sums in another order), which the
    one rounding to bf16 hides but for rare ties of one bf16 ulp."""
    return (
        scale_a.shape[-1] == 1
        and scale_b.shape[-2] == 1
        and _native_codes(scale_a, scale_b, out_dtype)
    )


# the native GEMM's blocks of k whose sums it adds (gemm_bf16_cpu.cpp's kKBlock pairs)
_GEMM_K_BLOCK = 512


def _k_blocks(k: int) -> tuple[int, int]:
    """(block, blocks): a reduction of k constant-scale elements as the block-scaled
    kernel takes it, in the native GEMM's own blocks of sums (a shorter k: one block, k
    rounded up to even; k = 0: no block, of the kernel's least size)."""
    block = max(2, min(_GEMM_K_BLOCK, k + k % 2))
    return block, -(-k // block)


def _blocks_in_bf16(scale_a: Tensor, scale_b: Tensor, block_k: int, out_dtype: torch.dtype) -> bool:
    """Whether the CPU kernels multiply the e4m3 codes in bf16 with scales along the
    reduction (blockwise: fp32 scales per ``block_k`` elements of K, an even block): each
    k block's fp32 sums times its row's and its column's scale inside the native GEMM's
    tiles, added in order (``fp8_block_scaled_mm``, csrc/fp8_cpu.cpp; as the GPU's
    blockwise kernels apply the scales per K block in their main loop); a bf16 output and
    torch_moe's native bf16 GEMM here, as :func:`_codes_in_bf16`."""
    return block_k > 0 and block_k % 2 == 0 and _native_codes(scale_a, scale_b, out_dtype)


def _panel_padded(cols: Tensor, n: int) -> Tensor:
    """fp32 column scales [..., n] (or [..., 1], broadcast) padded with zeros to whole
    panels of 64 columns, as the block-scaled kernels read them (16-lane vectors up to the
    panel's end)."""
    out = torch.zeros((*cols.shape[:-1], -(-n // 64) * 64), dtype=torch.float32)
    out[..., :n] = cols
    return out


# the most rows per group for which the probe measures fp8_block_scaled_mm's few-rows form
_FEW_CODE_ROWS = 256


def few_code_rows(col_major: bool) -> int:
    """Groups of at most this many rows run by ``fp8_block_scaled_mm``'s few-rows form
    (csrc/fp8_cpu.cpp: a weight's e4m3 codes, ``col_major`` or row-major, converted once
    per chunk into a panel that all of the group's rows take, instead of the pieces' bf16
    copy and packed panel; the same bits): the largest rows class ``r`` (powers of two up
    to ``_FEW_CODE_ROWS``) of a run up from 1 row in which every class's probe decision
    ``few_codes:<b>:r<r>`` is ``"few"``, else 0. Which wins up to how many rows depends on
    the core and the layout (on the Zen 4 measured, 4 groups of [1024, 1024] on one
    thread: the row-major form 2.7-3.4x the pieces' speed at 1-4 rows, 1.05-1.2x at
    64-256; the column-major one, bound by its transposes, 1.2-1.4x at 1-4 rows, even at
    16). Memoized."""

    def decide() -> int:
        rows, r = 0, 1
        while r <= _FEW_CODE_ROWS and _few_codes_choice(col_major, r) == "few":
            rows, r = r, 2 * r
        return rows

    return _cpu_probe.memo(("few_code_rows", col_major, _native.enabled()), decide)


def _few_codes_choice(col_major: bool, rows: int) -> str:
    return _cpu_probe.decide(
        f"few_codes:{'t' if col_major else 'n'}:r{rows}",
        lambda: _measure_few_codes(col_major, rows),
        default="pieces",
        margin=0.05,
    )


def _measure_few_codes(col_major: bool, rows: int) -> dict[str, float]:
    """Seconds of ``fp8_block_scaled_mm`` on 8 groups of ``rows`` rows of codes (K = N =
    512, one scale along K) by its pieces and by its few-rows form, each operand set evicted
    from the caches before its call (a decode step's weights come from memory)."""
    k = n = 512
    groups = 8
    mod = _native.kernels()
    offs = torch.arange(1, groups + 1, dtype=torch.int32) * rows
    row_scale = torch.ones(groups * rows, 1)
    col_scale = torch.ones(groups, 1, n)
    sets = []
    for _ in range(_cpu_probe._OPERAND_SETS):  # constant codes: the rates do not depend on them
        w = torch.full((groups, n, k) if col_major else (groups, k, n), 0.5).to(FP8)
        sets.append(
            (torch.full((groups * rows, k), 0.25).to(FP8), w.transpose(-2, -1) if col_major else w)
        )

    def run(few: int) -> Callable[[tuple[Tensor, Tensor]], object]:
        def fn(s: tuple[Tensor, Tensor]) -> None:
            out = torch.empty((groups * rows, n), dtype=torch.bfloat16)
            mod.fp8_block_scaled_mm(*s, row_scale, col_scale, offs, k, out, False, few)

        return fn

    def evict(s: tuple[Tensor, Tensor]) -> None:
        for t in s:
            mod.evict_from_cache(t)

    ways = {"pieces": run(0), "few": run(rows)}
    return _cpu_probe.time_candidates(_cpu_probe.cycled(sets, ways, evict))


@torch.compiler.assume_constant_result
def codes_rows_major(dtype: torch.dtype) -> bool:
    """Whether a weight of ``dtype`` quantized for the CPU's FP8 GEMMs on the codes is best
    laid out as a row-major B [K, N] per expert (the layout the inference cache keeps):
    where those GEMMs run (bf16, torch_moe's native bf16 GEMM here), whose few-rows form
    reads a row-major B's codes without transposing them (:func:`few_code_rows`; the same
    bits in either layout). Elsewhere K-major, the GPU kernels' layout and the fp32
    emulation's (whose sums' order follows the layout). A constant for the compiler."""
    return native_gemm_ready(dtype)


def _scaled_blocks_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    block_k: int,
    block_n: int,
    ends: list[int],
) -> Tensor | None:
    """Forward / dgrad by :func:`_blocks_in_bf16`: the codes (the kernel converts each
    piece to bf16 as its GEMM takes it, or a group of a few rows takes its few-rows form:
    :func:`few_code_rows`) and the scales laid out as the kernel reads them (a row's per k
    block, a column's per k block padded to whole panels of 64), or None where the kernel
    refuses them."""
    M, N, E = a.shape[0], b.shape[2], b.shape[0]
    ks = scale_a.shape[1]
    row_scale = scale_a.expand(M, ks).contiguous()
    cols = _expand(scale_b.expand(E, ks, scale_b.shape[2]), 2, block_n, N)
    col_scale = _panel_padded(cols, N)
    out = torch.empty((M, N), dtype=torch.bfloat16)
    mod = _native.kernels()
    few = 0
    if a.dtype == FP8 and min((n for n in group_sizes(ends) if n), default=0) <= _FEW_CODE_ROWS:
        few = few_code_rows(b.stride(2) != 1)
    if mod.fp8_block_scaled_mm(
        a, b, row_scale, col_scale, offs, block_k, out, streams_outputs(torch.bfloat16), few
    ):
        return out
    return None


def _scaled_blocks_wgrad(
    a: Tensor, b: Tensor, sa: Tensor, sb: Tensor, offs: Tensor, block: int
) -> Tensor | None:
    """The weight gradient by :func:`_blocks_in_bf16` (jagged blocks of ``block`` rows,
    fp32 scales [NB, K] / [NB, N]): the codes, ``fp8_block_scaled_mm_wgrad``; None where the
    kernel refuses them."""
    K, N, E = a.shape[1], b.shape[1], offs.shape[0]
    col_scale = _panel_padded(sb, N)
    out = torch.empty((E, K, N), dtype=torch.bfloat16)
    mod = _native.kernels()
    stream = streams_outputs(torch.bfloat16)
    if mod.fp8_block_scaled_mm_wgrad(a, b, sa.contiguous(), col_scale, offs, block, out, stream):
        return out
    return None


def _wgrad_codes_in_bf16(
    scale_a: Tensor, scale_b: Tensor, block: int, out_dtype: torch.dtype
) -> bool:
    """:func:`_codes_in_bf16` for the weight gradient: each operand's scales constant over
    an expert's rows (per tensor, or jagged blocks of a whole group: ``block=-1``)."""
    whole = all(list(s.shape) == [1, 1] or block == -1 for s in (scale_a, scale_b))
    return whole and _native_codes(scale_a, scale_b, out_dtype)


def bf16_gemms_native() -> bool:
    """Whether this CPU multiplies bf16 natively (:func:`_mx_in_bf16`'s last condition,
    which the performance model asks too)."""
    return cpu_compute_dtype(torch.bfloat16) == torch.bfloat16


def _mx_pieces(a: Tensor, b: Tensor, ends: list[int], wgrad: bool) -> bool:
    """Whether an MX GEMM in bf16 (:func:`_mx_in_bf16`; ``a``, ``b`` its e4m3 operands:
    ``wgrad``, the token-order [M, K] and [M, N], else [M, K] and [E, K, N]) runs by the
    native kernels' pieces, each converted to bf16 as the GEMM takes it
    (``fp8_mx_mm`` / ``fp8_mx_mm_wgrad``): where ``grouped_mm`` / ``grouped_mm_wgrad``
    would multiply the dequantized bf16 operands by the threaded kernel's native GEMM
    (asked of meta stand-ins with the operands' layouts), whose bits the pieces give,
    without bf16 copies of both operands. Reads only metadata (the memory model asks it
    of meta stand-ins)."""
    if not ends or ends[-1] == 0 or _native.kernels() is None:
        return False
    a_h = torch.empty_strided(a.shape, a.stride(), dtype=torch.bfloat16, device="meta")
    b_h = torch.empty_strided(b.shape, b.stride(), dtype=torch.bfloat16, device="meta")
    if wgrad:
        return wgrad_way(a_h, b_h, ends) in ("threads", "transpose") and native_gemm_for(
            a_h.t(), b_h, ends, True
        )
    return whole_way(a_h, b_h, ends, False) == "threads" and native_gemm_for(a_h, b_h, ends, False)


def _mx_few_rows(
    a_h: Tensor,
    b: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    ends: list[int],
    block_k: int,
    block_n: int,
) -> Tensor | None:
    """An MX GEMM's output at a few rows per group (decode) by ``fp8_mx_few_rows_mm``
    (csrc/fp8_cpu.cpp: each weight code times its scale in registers, the busy experts'
    bf16 copy never written), where :func:`grouped_mm` would multiply ``a_h`` (A's rows in
    bf16) by that copy with the few-rows kernel's plain column-major form, whose bits the
    op gives; None elsewhere (the copy then, as before)."""
    if block_k != 32 or block_n != 1 or scale_b.dtype != torch.uint8 or b.stride(1) != 1:
        return None
    if not native_gemm_ready(torch.bfloat16):  # (the op's own AVX512-BF16 kernel)
        return None
    b_h = torch.empty_strided(b.shape, b.stride(), dtype=torch.bfloat16, device="meta")
    if whole_way(a_h, b_h, ends, False) != "few":
        return None
    out = torch.empty((a_h.shape[0], b.shape[2]), dtype=torch.bfloat16)
    return out if _native.kernels().fp8_mx_few_rows_mm(a_h, b, scale_b, offs, out) else None


def _dequantized_bf16(q: Tensor, rows: int, dequantize: Callable[[int, int], Tensor]) -> Tensor:
    """bf16 of ``dequantize(r0, r1)`` (q's rows [r0, r1) in fp32) for all q's rows, taken
    ``rows`` at a time (no fp32 copy of all of q), in q's layout."""
    out = torch.empty_like(q, dtype=torch.bfloat16)
    for r0 in range(0, q.shape[0], rows):
        r1 = min(q.shape[0], r0 + rows)
        out[r0:r1].copy_(dequantize(r0, r1))
    return out


def dequantizes_pieces(rows: int, threads: int | None = None) -> bool:
    """Whether the scaled GEMMs' fp32 form (the CPU kernels' where no bf16 route applies:
    every recipe on a CPU without native bf16 GEMMs) runs by the native kernels' pieces
    (``fp8_dequantized_mm`` / ``fp8_dequantized_mm_wgrad``, csrc/fp8_cpu.cpp: each piece's
    rows and block of the weight dequantized on its thread, its fp32 GEMM on that thread
    alone) instead of chunks of dequantized groups, each group's GEMM split by ATen over
    all threads: on a CPU that upcasts bf16 GEMMs, where the native e4m3 kernels run, at
    more than ``FEW_ROWS`` rows per busy group (fewer: the loop's few-rows kernel), on one
    thread (the same GEMMs without the loop's Python and its chunks' passes over memory:
    1.7-2.1x faster at 32 rows a group on the Zen 3 EPYC measured) or where the bf16
    layer's grouped GEMMs share their groups out as upcast pieces
    (``grouped_mm.shares_upcast_groups``: the probe's ``threads_mm``; the same fp32 GEMMs
    on the threads). ``threads``: the intra-op threads', or others (the memory model's
    question)."""
    mod = _native.kernels()
    if mod is None or not hasattr(mod, "fp8_dequantized_mm") or not Q.native_fp8_conversions():
        return False
    threads = torch.get_num_threads() if threads is None else threads
    if rows <= _cpu_probe.FEW_ROWS or not upcasts_pieces(torch.bfloat16):
        return False
    return threads == 1 or shares_upcast_groups(torch.bfloat16, rows, threads)


@_scaled_grouped_mm.register_kernel("cpu")
def _scaled_grouped_mm_cpu(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    block_k: int,
    block_n: int,
    out_dtype: torch.dtype,
) -> Tensor:
    """a in chunks of whole groups (about ``_CPU_CHUNK_ELEMS`` rows' worth, and as many
    experts' weights): its rows and the chunk's experts of b dequantized, one fp32 GEMM per
    group into a chunk-sized buffer, one rounding into the output.
    Dequantizing all of a first allocates [M, K] and [M, N] fp32 tensors and rounds [M,
    N] in a pass of its own over memory that has left the cache; dequantizing all of b
    allocates an fp32 [E, K, N] (and its int32 codes) that a large layer's weights fault
    in page by page. The values are the whole-operand form's: the same dequantized
    operands, the same per-group GEMM primitive as the CPU grouped GEMM's loop
    (``mm_into``). Where :func:`dequantizes_pieces` holds, the native kernel runs this form
    piece by piece instead, each piece's GEMM on one thread (the values within the fp32
    GEMM's rounding of these)."""
    _check_scaled(a, b, scale_a, scale_b, offs, block_k, block_n, out_dtype)
    ends = check_offs_values("scaled_grouped_mm", offs, a.shape[0])
    if ends is None:  # pragma: no cover (CPU offs)
        ends = offs.tolist()
    (M, K), N = a.shape, b.shape[2]
    row_scales = scale_a.shape[0] == M
    if K > 0 and _codes_in_bf16(scale_a, scale_b, out_dtype):  # one scale along K, per block
        kb, ks = _k_blocks(K)
        sa_k = scale_a.expand(scale_a.shape[0], ks)
        sb_k = scale_b.expand(scale_b.shape[0], ks, scale_b.shape[2])
        out = _scaled_blocks_mm(a, b, sa_k, sb_k, offs, kb, block_n, ends)
        if out is not None:
            return out
    if _blocks_in_bf16(scale_a, scale_b, block_k, out_dtype):
        out = _scaled_blocks_mm(a, b, scale_a, scale_b, offs, block_k, block_n, ends)
        if out is not None:
            return out
    if _mx_in_bf16(scale_a, scale_b, out_dtype):
        bf = torch.bfloat16
        sa_f = _fp32_scales(scale_a)
        if block_n == 1 and _mx_pieces(a, b, ends, False):  # each piece dequantized in cache
            out = torch.empty((M, N), dtype=bf)
            sb_f = _fp32_scales(scale_b)
            sa_k = sa_f.expand(M, sa_f.shape[1]).contiguous()
            sb_k = sb_f.expand(b.shape[0], sb_f.shape[1], N).contiguous()
            stream = streams_outputs(bf)
            if _native.kernels().fp8_mx_mm(a, b, sa_k, sb_k, offs, block_k, out, stream):
                return out
        # the operands straight into bf16 by the native kernel, else by chunks of fp32
        a_h = _dequantize_native(a, sa_f, 1, block_k, out=torch.empty_like(a, dtype=bf))
        if a_h is None:
            a_h = _dequantized_bf16(
                a,
                max(1, _CPU_CHUNK_ELEMS // max(K, 1)),
                lambda r0, r1: _dequantize_lhs(
                    a[r0:r1], scale_a[r0:r1] if row_scales else scale_a, block_k
                ),
            )
        out = _mx_few_rows(a_h, b, scale_b, offs, ends, block_k, block_n)
        if out is not None:
            return out
        # only the experts with rows: at a few tokens (decode) most have none, and the
        # whole stack's dequantization cost 100x the GEMMs (157 ms a T=1 step of 64
        # experts of [1024, 1024] on a Zen 4 core, the bf16 layer's 1.6 ms)
        busy = [g for g, n in enumerate(group_sizes(ends)) if n > 0]
        b_h = _dequantize_rhs_native(b, scale_b, block_k, block_n, bf, busy)
        if b_h is None:
            b_h = _dequantized_bf16(
                b,
                max(1, _CPU_CHUNK_ELEMS // max(K * N, 1)),
                lambda g0, g1: _dequantize_rhs(b[g0:g1], scale_b[g0:g1], block_k, block_n),
            )
        return grouped_mm(a_h, b_h, offs)
    out = torch.empty((M, N), dtype=out_dtype)
    if dequantizes_pieces(rows_per_busy_group(ends)[1]) and _native.kernels().fp8_dequantized_mm(
        a, b, _fp32_scales(scale_a).contiguous(), _fp32_scales(scale_b).contiguous(), offs,
        block_k, block_n, out,
    ):  # fmt: skip
        return out
    direct = out_dtype == torch.float32
    # a chunk's rows of a and its experts of b each within about _CPU_CHUNK_ELEMS
    experts = max(1, _CPU_CHUNK_ELEMS // max(K * N, 1))
    for c0, c1, gs in _chunks_of_groups(ends, max(1, _CPU_CHUNK_ELEMS // max(K, N, 1)), experts):
        if c1 == c0:
            continue
        sa = scale_a[c0:c1] if row_scales else scale_a
        a_f = _dequantize_lhs(a[c0:c1], sa, block_k)
        g0, g1 = gs[0], gs[-1] + 1
        b_f = _dequantize_rhs(b[g0:g1], scale_b[g0:g1], block_k, block_n)
        prod = out[c0:c1] if direct else a_f.new_empty((c1 - c0, N))
        start = c0
        for g in gs:
            end = ends[g]
            if end > start:
                mm_into(a_f[start - c0 : end - c0], b_f[g - g0], prod[start - c0 : end - c0])
            start = end
        del b_f
        if not direct:
            out[c0:c1].copy_(prod)
        del a_f, prod  # (freed before the next chunk's values exist)
    out[ends[-1] if ends else 0 :].zero_()
    return out


@_scaled_grouped_mm.register_kernel("cuda")
def _scaled_grouped_mm_cuda(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    block_k: int,
    block_n: int,
    out_dtype: torch.dtype,
) -> Tensor:
    from torch_moe._triton import scaled_grouped_mm as TK

    _check_scaled(a, b, scale_a, scale_b, offs, block_k, block_n, out_dtype)
    check_offs_values("scaled_grouped_mm", offs, a.shape[0])
    (M, k), (E, _, n) = a.shape, b.shape
    # (CPU tensors: the Triton kernel in the interpreter, as the tests run it)
    env = _torch_scaled_env(a.device)
    if scaled_op_kernel(scale_a.dtype, block_k, block_n, k, n, out_dtype, *env) == "torch":
        # what the high-precision op runs for this GEMM: a decomposed graph equals eager
        return _torch_scaled(a, b, *_torch_scales(scale_a, scale_b, M, E, n), offs)
    sa, sb = _fp32_scales(scale_a), _fp32_scales(scale_b)
    return TK.scaled_grouped_mm(
        a, b, sa, sb, offs, block_k=block_k, block_n=block_n, out_dtype=out_dtype
    )


@_scaled_grouped_mm.register_fake
def _(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    block_k: int,
    block_n: int,
    out_dtype: torch.dtype,
) -> Tensor:
    _check_scaled(a, b, scale_a, scale_b, offs, block_k, block_n, out_dtype)
    return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype)


# --------------------------------------------------------------------------------------
# scaled_grouped_mm_wgrad: the op over quantized wgrad operands


def _dequantize_wgrad_operand(q: Tensor, scale: Tensor, offs: Tensor, block: int) -> Tensor:
    if list(scale.shape) == [1, 1]:  # per tensor
        return q.float() * _fp32_scales(scale)
    return dequantize_jagged(q, scale, offs, block=block)


def scaled_grouped_mm_wgrad_reference(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    block: int,
    out_dtype: torch.dtype,
) -> Tensor:
    """The oracle: dequantize both jagged operands, per-group loop of fp32 mm."""
    _check_scaled_wgrad(a, b, scale_a, scale_b, offs, block, out_dtype)
    a_f = _dequantize_wgrad_operand(a, scale_a, offs, block)
    b_f = _dequantize_wgrad_operand(b, scale_b, offs, block)
    out = a_f.new_zeros((offs.shape[0], a.shape[1], b.shape[1]))
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[g] = a_f[start:end].t() @ b_f[start:end]
        start = end
    return out.to(out_dtype)


@torch.library.custom_op("torch_moe::scaled_grouped_mm_wgrad", mutates_args=())
def _scaled_grouped_mm_wgrad(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    block: int,
    out_dtype: torch.dtype,
) -> Tensor:
    _check_scaled_wgrad(a, b, scale_a, scale_b, offs, block, out_dtype)
    a_f = _dequantize_wgrad_operand(a, scale_a, offs, block)
    b_f = _dequantize_wgrad_operand(b, scale_b, offs, block)
    return grouped_mm_wgrad(a_f, b_f, offs).to(out_dtype)


@_scaled_grouped_mm_wgrad.register_kernel("cpu")
def _scaled_grouped_mm_wgrad_cpu(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    block: int,
    out_dtype: torch.dtype,
) -> Tensor:
    """Both token-order operands dequantized in chunks of whole groups (each row times its
    jagged block's scale, or the tensor's), one fp32 GEMM per group rounded into the
    output: as the whole-operand form computes it (the same products, ``mm_into`` per
    group), without its [M, K] and [M, N] fp32 operands and full-size scale tensors; by
    the native kernel's pieces where :func:`dequantizes_pieces` holds."""
    _check_scaled_wgrad(a, b, scale_a, scale_b, offs, block, out_dtype)
    ends = check_offs_values("scaled_grouped_mm_wgrad", offs, a.shape[0])
    if ends is None:  # pragma: no cover (CPU offs)
        ends = offs.tolist()
    (M, K), N = a.shape, b.shape[1]
    sa, sb = _fp32_scales(scale_a), _fp32_scales(scale_b)
    if _wgrad_codes_in_bf16(scale_a, scale_b, block, out_dtype):
        out = _scaled_codes_wgrad(a, b, sa, sb, offs, ends)
        if out is not None:
            return out
    jagged = list(scale_a.shape) != [1, 1] and list(scale_b.shape) != [1, 1]
    if jagged and _blocks_in_bf16(scale_a, scale_b, block, out_dtype):
        out = _scaled_blocks_wgrad(a, b, sa, sb, offs, block)
        if out is not None:
            return out
    mx = _mx_in_bf16(scale_a, scale_b, out_dtype)
    if mx and jagged and _mx_pieces(a, b, ends, True):  # each piece dequantized in cache
        out = torch.empty((len(ends), K, N), dtype=torch.bfloat16)
        stream = streams_outputs(torch.bfloat16)
        if _native.kernels().fp8_mx_mm_wgrad(
            a, b, sa.contiguous(), sb.contiguous(), offs, block, out, stream
        ):
            return out
    per_tensor = list(scale_a.shape) == [1, 1]
    row_block = None if per_tensor else Q.jagged_block_index(offs, M, block)[0]

    def rows_f(q: Tensor, scale: Tensor, c0: int, c1: int) -> Tensor:
        index = None if row_block is None else row_block[c0:c1]
        native = _dequantize_native(q[c0:c1], scale, 1, 1, index)  # (the same products)
        if native is not None:
            return native
        if row_block is None:
            return Q._fp8_to_float(q[c0:c1]).mul_(scale)
        return Q._fp8_to_float(q[c0:c1]).mul_(scale.index_select(0, row_block[c0:c1]))

    if mx:
        # straight into bf16 by the native kernel, else by chunks of fp32 rows
        chunk = max(1, _CPU_CHUNK_ELEMS // max(K, N, 1))
        bf16 = []
        for q, sc in ((a, sa), (b, sb)):
            h = _dequantize_native(
                q, sc, 1, 1, row_block, torch.empty_like(q, dtype=torch.bfloat16)
            )
            if h is None:
                h = _dequantized_bf16(q, chunk, functools.partial(rows_f, q, sc))
            bf16.append(h)
        return grouped_mm_wgrad(bf16[0], bf16[1], offs)
    out = torch.empty((len(ends), K, N), dtype=out_dtype)
    if dequantizes_pieces(rows_per_busy_group(ends)[1]) and _native.kernels().fp8_dequantized_mm_wgrad(
        a, b, sa.contiguous(), sb.contiguous(), row_block, offs, out
    ):  # fmt: skip
        return out
    direct = out_dtype == torch.float32
    prod = None if direct else torch.empty((K, N), dtype=torch.float32)

    for c0, c1, gs in _chunks_of_groups(ends, max(1, _CPU_CHUNK_ELEMS // max(K, N, 1))):
        a_f = rows_f(a, sa, c0, c1) if c1 > c0 else None
        b_f = rows_f(b, sb, c0, c1) if c1 > c0 else None
        start = c0
        for g in gs:
            end = ends[g]
            if end == start or a_f is None or b_f is None:
                out[g].zero_()
            else:
                dst = out[g] if direct else prod
                assert dst is not None
                mm_into(a_f[start - c0 : end - c0].t(), b_f[start - c0 : end - c0], dst)
                if not direct:
                    out[g].copy_(dst)
            start = end
        a_f = b_f = None  # (freed before the next chunk's values exist)
    return out


def _scaled_codes_wgrad(
    a: Tensor, b: Tensor, sa: Tensor, sb: Tensor, offs: Tensor, ends: list[int]
) -> Tensor | None:
    """The weight gradient by :func:`_wgrad_codes_in_bf16` (sa / sb fp32: [1, 1] per
    tensor, or a row per non-empty segment): each expert's reduction over its rows in the
    block-scaled kernel's jagged blocks of the native GEMM's 512 rows (:func:`_k_blocks`),
    each block with its expert's scales (:func:`_scaled_blocks_wgrad`); None where the
    kernel refuses them."""
    K, N = a.shape[1], b.shape[1]
    sizes = group_sizes(ends)
    block, _ = _k_blocks(max(sizes, default=0))
    counts = torch.tensor([-(-size // block) for size in sizes if size > 0], dtype=torch.int64)

    def per_block(s: Tensor, cols: int) -> Tensor:  # each block row: its group's scales
        rows = s.expand(counts.shape[0], cols) if list(s.shape) == [1, 1] else s[: counts.shape[0]]
        return rows.repeat_interleave(counts, dim=0) if counts.numel() else rows

    return _scaled_blocks_wgrad(a, b, per_block(sa, K), per_block(sb, N), offs, block)


@_scaled_grouped_mm_wgrad.register_kernel("cuda")
def _scaled_grouped_mm_wgrad_cuda(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    block: int,
    out_dtype: torch.dtype,
) -> Tensor:
    from torch_moe._triton import quantize as TQ
    from torch_moe._triton import scaled_grouped_mm as TK

    _check_scaled_wgrad(a, b, scale_a, scale_b, offs, block, out_dtype)
    check_offs_values("scaled_grouped_mm_wgrad", offs, a.shape[0])
    sa, sb = _fp32_scales(scale_a), _fp32_scales(scale_b)
    per_tensor = list(sa.shape) == [1, 1]
    if per_tensor or block == -1:
        gfb = (
            torch.zeros(offs.shape[0] + 1, dtype=torch.int32, device=a.device)
            if per_tensor
            else TQ.jagged_block_table(offs, a.shape[0], block)[2]
        )
        return TK.scaled_grouped_mm_wgrad(a, b, sa, sb, offs, gfb, -1, out_dtype=out_dtype)
    # the kernel reads 32 / 128-row blocks from aligned slots (quantize_jagged(slots=True))
    first, last, gfb = TQ.jagged_block_table(offs, a.shape[0], block)
    index = jagged_slot_index(first, last, block)
    a_s, b_s = gather_rows(a, index), gather_rows(b, index)
    return TK.scaled_grouped_mm_wgrad(a_s, b_s, sa, sb, offs, gfb, block, out_dtype=out_dtype)


@_scaled_grouped_mm_wgrad.register_fake
def _(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    block: int,
    out_dtype: torch.dtype,
) -> Tensor:
    _check_scaled_wgrad(a, b, scale_a, scale_b, offs, block, out_dtype)
    return a.new_empty((offs.shape[0], a.shape[1], b.shape[1]), dtype=out_dtype)


def jagged_slot_index(first: Tensor, last: Tensor, block: int) -> Tensor:
    """Row of the token-order operand held by each row of the slot layout (-1: padding):
    slot row ``j * block + i`` holds row ``first[j] + i`` when that is before ``last[j]``."""
    rows = first.long()[:, None] + torch.arange(block, device=first.device)
    return torch.where(rows < last.long()[:, None], rows, -1).reshape(-1)


# --------------------------------------------------------------------------------------
# operand quantization per the recipe (the ops above take what these return)


def quantize_lhs(a: Tensor, op: OperandQuant) -> tuple[Tensor, Tensor]:
    """A [M, k] quantized along k (its rows): ``(q [M, k], scale [M or 1, KS])``."""
    if op.fmt == "mx":
        return quantize_mx(a, dim=-1, block=op.inner, scale_rule=op.scale_rule)
    return quantize_fp8(a, (op.outer, op.inner))


def quantize_rhs(b: Tensor, op: OperandQuant) -> tuple[Tensor, Tensor]:
    """B [E, k, n] quantized along k: ``(q [E, k, n], scale [E, KS, NS])``, q laid out
    K-major (unit stride along k: what FP8 tensor cores read), or, on the CPU where b is
    row-major (n-major: a dgrad's transposed weight), in b's own layout: the CPU kernels read
    either, and the K-major codes would cost a transposing copy (the same codes and
    scales, the same blocks)."""
    if b.device.type == "cpu" and b.dim() == 3 and b.stride(-1) == 1 and b.stride(-2) != 1:
        if op.fmt == "mx":
            return quantize_mx(b, dim=-2, block=op.inner, scale_rule=op.scale_rule)
        return quantize_fp8(b, (op.inner, op.outer))
    b_t = b.transpose(-2, -1)  # [E, n, k]: quantizing its rows is quantizing b's columns
    if op.fmt == "mx":
        q, s = quantize_mx(b_t, dim=-1, block=op.inner, scale_rule=op.scale_rule)
    else:
        q, s = quantize_fp8(b_t, (op.outer, op.inner))
    return q.transpose(-2, -1), s.transpose(-2, -1)


def quantize_wgrad_operand(t: Tensor, offs: Tensor, op: OperandQuant) -> tuple[Tensor, Tensor]:
    """A wgrad operand t [M, C] quantized along M in per-expert jagged blocks (a [1, 1]
    scale for a per-tensor operand): ``(q [M, C], scale [NB, C] or [1, 1])``."""
    if (op.outer, op.inner) == (-1, -1):  # one scale for the tensor: uniform across groups
        if t.shape[0] == 0:
            # no rows: quantize_fp8 gives a [0, 1] scale (no blocks of rows), the wgrad op
            # wants the tensor's [1, 1]: the scale of no elements, an amax of 0
            q, scale = quantize_fp8(t.new_zeros((1, max(t.shape[1], 1))))
            return q[:0, : t.shape[1]], scale
        return quantize_fp8(t)
    return quantize_jagged(t, offs, block=op.inner, fmt=op.fmt, scale_rule=op.scale_rule)


def decomposable(g: GemmQuant) -> bool:
    """Whether GEMM ``g`` is expressible as quantize ops + ``scaled_grouped_mm``: both
    operands quantized in one format with the same K blocks, and A's scales per row (or
    per tensor)."""
    lhs, rhs = g.lhs, g.rhs
    if lhs is None or rhs is None or lhs.fmt != rhs.fmt or lhs.inner != rhs.inner:
        return False
    return lhs.outer == 1 or (lhs.outer, lhs.inner) == (-1, -1)


def decomposable_wgrad(g: GemmQuant) -> bool:
    """Whether wgrad GEMM ``g`` is expressible as quantize ops + ``scaled_grouped_mm_wgrad``."""
    lhs, rhs = g.lhs, g.rhs
    if lhs is None or rhs is None or lhs.fmt != rhs.fmt:
        return False
    tensorwise = (-1, -1)
    if (lhs.outer, lhs.inner) == tensorwise or (rhs.outer, rhs.inner) == tensorwise:
        return (lhs.outer, lhs.inner) == (rhs.outer, rhs.inner) and lhs.fmt == "fp8"
    return lhs.inner == rhs.inner


def _scaled_gemm(
    a: Tensor, b: Tensor, offs: Tensor, g: GemmQuant, out_dtype: torch.dtype
) -> Tensor:
    """a [M, k] @ b [E, k, n] per group through quantize ops + ``scaled_grouped_mm``."""
    lhs, rhs = g.lhs, g.rhs
    if lhs is None or rhs is None:
        raise ValueError(f"quantized_grouped_mm: {g} runs in bf16, not scaled")
    qa, sa = quantize_lhs(a, lhs)
    qb, sb = quantize_rhs(b, rhs)
    return _scaled_grouped_mm(qa, qb, sa, sb, offs, lhs.inner, rhs.outer, out_dtype)


def _scaled_wgrad(
    x: Tensor, dy: Tensor, offs: Tensor, g: GemmQuant, out_dtype: torch.dtype
) -> Tensor:
    lhs, rhs = g.lhs, g.rhs
    if lhs is None or rhs is None:
        raise ValueError(f"quantized_grouped_mm_wgrad: {g} runs in bf16, not scaled")
    qx, sx = quantize_wgrad_operand(x, offs, lhs)
    qdy, sdy = quantize_wgrad_operand(dy, offs, rhs)
    return _scaled_grouped_mm_wgrad(qx, qdy, sx, sdy, offs, lhs.inner, out_dtype)


# --------------------------------------------------------------------------------------
# the emulation (CPU kernels of the high-precision ops)


def _fq_lhs(a: Tensor, op: OperandQuant) -> Tensor:
    """Quantize-dequantize A [m, k] (reduction along the last dim) to fp32."""
    if op.fmt == "mx":
        q, s = quantize_mx(a, dim=-1, block=op.inner, scale_rule=op.scale_rule)
        return dequantize_mx(q, s, dim=-1, block=op.inner)
    block = (op.outer, op.inner)
    return dequantize_fp8(*quantize_fp8(a, block), block)


def _fq_rhs(b: Tensor, op: OperandQuant) -> Tensor:
    """Quantize-dequantize B [E, k, n] (reduction along dim -2, per expert) to fp32."""
    if op.fmt == "mx":
        q, s = quantize_mx(b, dim=-2, block=op.inner, scale_rule=op.scale_rule)
        return dequantize_mx(q, s, dim=-2, block=op.inner)
    block = (op.inner, op.outer)
    return dequantize_fp8(*quantize_fp8(b, block), block)


def _fq_wgrad(t: Tensor, offs: Tensor, op: OperandQuant) -> Tensor:
    """Quantize-dequantize a wgrad operand t [M, C] (blocks along M inside each group)."""
    q, s = quantize_wgrad_operand(t, offs, op)
    return _dequantize_wgrad_operand(q, s, offs, op.inner)


def _bf16(t: Tensor) -> Tensor:
    return t.to(torch.bfloat16).contiguous()


def _emulate_gemm(
    a: Tensor, b: Tensor, offs: Tensor, g: GemmQuant, out_dtype: torch.dtype
) -> Tensor:
    if g.lhs is None or g.rhs is None:
        return grouped_mm(_bf16(a), _bf16(b), offs).to(out_dtype)
    if decomposable(g):  # literally the decomposition: compiled == eager, bit for bit
        return _scaled_gemm(a, b, offs, g, out_dtype)
    return grouped_mm(_fq_lhs(a, g.lhs), _fq_rhs(b, g.rhs), offs).to(out_dtype)


def _emulate_wgrad(
    x: Tensor, dy: Tensor, offs: Tensor, g: GemmQuant, out_dtype: torch.dtype
) -> Tensor:
    if g.lhs is None or g.rhs is None:
        return grouped_mm_wgrad(_bf16(x), _bf16(dy), offs).to(out_dtype)
    if decomposable_wgrad(g):
        return _scaled_wgrad(x, dy, offs, g, out_dtype)
    return grouped_mm_wgrad(_fq_wgrad(x, offs, g.lhs), _fq_wgrad(dy, offs, g.rhs), offs).to(
        out_dtype
    )


# --------------------------------------------------------------------------------------
# kernel selection (device-agnostic, tested on CPU) and the CUDA paths

Kernel = Literal["torch", "triton", "emulate"]
_PER_ROW = ((1, -1), (-1, -1))  # (outer, inner) of a rowwise / tensorwise FP8 operand


def gemm_kernel(
    g: GemmQuant,
    k: int,
    n: int,
    out_dtype: torch.dtype,
    device_type: str,
    capability: tuple[int, int] | None = None,
    has_torch_scaled_grouped_mm: bool = True,
) -> Kernel:
    """Which kernel runs forward / dgrad GEMM ``g`` of a [M, k] @ b [E, k, n] on a device:

    * ``"torch"``: ``torch._scaled_grouped_mm`` (CUTLASS, Hopper only): FP8 with one scale
      per row of a and per column of b (a tensorwise scale is that scale repeated), bf16
      output, k and n multiples of 16 (its TMA needs 16-byte strides);
    * ``"triton"``: the Triton scaled grouped GEMM (CUDA): both operands in one format with
      the same K blocks of 32, 128 or all of K, B's N blocks of 1, 128 or all of N;
    * ``"emulate"``: quantize -> dequantize -> grouped GEMM (CPU, bf16 GEMMs of a recipe,
      and any layout the kernels do not take).
    """
    lhs, rhs = g.lhs, g.rhs
    if device_type != "cuda" or lhs is None or rhs is None:
        return "emulate"
    if lhs.fmt == rhs.fmt and torch_scaled_takes(
        lhs.fmt, (lhs.outer, lhs.inner), (rhs.outer, rhs.inner), k, n, out_dtype,
        capability, has_torch_scaled_grouped_mm,
    ):  # fmt: skip
        return "torch"
    return "triton" if _triton_takes(g) else "emulate"


def torch_scaled_takes(
    fmt: str,
    lhs_block: tuple[int, int],
    rhs_block: tuple[int, int],
    k: int,
    n: int,
    out_dtype: torch.dtype,
    capability: tuple[int, int] | None,
    has_torch_scaled_grouped_mm: bool,
) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs a [M, k] @ [E, k, n] FP8 GEMM whose operands
    are quantized in (outer, inner) blocks ``lhs_block`` / ``rhs_block``: rowwise or
    tensorwise e4m3 on both, bf16 out, k and n multiples of 16, sm_90. The one rule for the
    high-precision ops (:func:`gemm_kernel`) and ``torch_moe::scaled_grouped_mm`` on CUDA,
    so that a compiled graph's decomposition runs the kernel eager runs (bit for bit)."""
    return (
        fmt == "fp8"
        and lhs_block in _PER_ROW
        and rhs_block in _PER_ROW
        and out_dtype == torch.bfloat16
        and k % 16 == 0
        and n % 16 == 0
        and has_torch_scaled_grouped_mm
        and capability == (9, 0)
    )


def scaled_op_kernel(
    scale_dtype: torch.dtype,
    block_k: int,
    block_n: int,
    k: int,
    n: int,
    out_dtype: torch.dtype,
    capability: tuple[int, int] | None,
    has_torch_scaled_grouped_mm: bool,
) -> Kernel:
    """Which kernel ``torch_moe::scaled_grouped_mm`` runs on CUDA for operands quantized in
    K blocks ``block_k`` and (B's) N blocks ``block_n`` with scales of ``scale_dtype``:
    ``"torch"`` where :func:`torch_scaled_takes` (A's rowwise or tensorwise scales both
    qualify), else ``"triton"``."""
    fmt = "mx" if scale_dtype == torch.uint8 else "fp8"
    if torch_scaled_takes(
        fmt, (1, block_k), (block_n, block_k), k, n, out_dtype, capability,
        has_torch_scaled_grouped_mm,
    ):  # fmt: skip
        return "torch"
    return "triton"


def wgrad_kernel(g: GemmQuant, device_type: str) -> Kernel:
    """Which kernel runs wgrad GEMM ``g``: the Triton scaled wgrad on CUDA for the operand
    rules of :func:`gemm_kernel` along M (jagged blocks of 32, 128 or a whole group, or per
    tensor), else the emulation."""
    return "triton" if device_type == "cuda" and _triton_takes(g) else "emulate"


def _triton_takes(g: GemmQuant) -> bool:
    lhs, rhs = g.lhs, g.rhs
    if lhs is None or rhs is None:
        return False
    if lhs.inner != rhs.inner or lhs.fmt != rhs.fmt:  # both operands' K blocks must agree
        return False
    if (lhs.outer, lhs.inner) == (-1, -1) != (rhs.outer, rhs.inner):
        return False
    return lhs.inner in (-1, 32, 128) and rhs.outer in (-1, 1, 128)


def _torch_scaled_env(device: torch.device) -> tuple[tuple[int, int] | None, bool]:
    """(the device's capability, None off CUDA; whether torch has ``_scaled_grouped_mm``):
    what :func:`torch_scaled_takes` reads of the machine."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return capability, hasattr(torch, "_scaled_grouped_mm")


def _select(g: GemmQuant, a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Kernel:
    return gemm_kernel(
        g, a.shape[1], b.shape[2], out_dtype, a.device.type, *_torch_scaled_env(a.device)
    )


def _quantize_kmajor(t: Tensor, op: OperandQuant, out: Tensor, along_rows: bool) -> Tensor:
    """Quantize t [..., R, C] into ``out`` (any layout) with the Triton kernel; reduction
    along rows or columns. Returns the fp32 scales."""
    from torch_moe._triton import quantize as TQ

    block = (op.inner, op.outer) if along_rows else (op.outer, op.inner)
    if op.fmt == "mx":
        mx_block = (op.inner, 1) if along_rows else (1, op.inner)
        _, scale = TQ.quantize_blocks(t, mx_block, fmt="mx", scale_rule=op.scale_rule, out=out)
        return scale
    if TQ.supports(t, block):
        _, scale = TQ.quantize_blocks(t, block, out=out)
        return scale
    q, scale = quantize_fp8(t, block)  # blocks too long for one program: torch ops
    out.copy_(q)
    return scale


def _kernel_operands(
    a: Tensor, b: Tensor, lhs: OperandQuant, rhs: OperandQuant
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Both operands quantized K-major by the Triton kernels: (qa, qb, sa, sb)."""
    M, k = a.shape
    E, _, n = b.shape
    qa = torch.empty((M, k), dtype=FP8, device=a.device)
    sa = _quantize_kmajor(a, lhs, qa, along_rows=False)
    qb = torch.empty((E, n, k), dtype=FP8, device=a.device).transpose(-2, -1)
    sb = _quantize_kmajor(b, rhs, qb, along_rows=True)  # fp32, [E, KS, NS]
    return qa, qb, sa, sb


def _kernel_gemm(
    a: Tensor, b: Tensor, offs: Tensor, g: GemmQuant, out_dtype: torch.dtype
) -> Tensor:
    """FP8 forward / dgrad on the Triton scaled grouped GEMM."""
    from torch_moe._triton import scaled_grouped_mm as TK

    lhs, rhs = g.lhs, g.rhs
    if lhs is None or rhs is None:
        raise ValueError(f"quantized_grouped_mm: {g} runs in bf16, not on the FP8 kernels")
    qa, qb, sa, sb = _kernel_operands(a, b, lhs, rhs)
    return TK.scaled_grouped_mm(
        qa, qb, sa, sb, offs, block_k=lhs.inner, block_n=rhs.outer, out_dtype=out_dtype
    )


def torch_scaled_operands(
    a: Tensor, b: Tensor, g: GemmQuant
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``torch._scaled_grouped_mm``'s operands: a [M, k] e4m3 row-major with fp32 scales
    [M], b [E, k, n] e4m3 column-major with fp32 scales [E, n] (dequantized = q * scale);
    rowwise and tensorwise scales alike."""
    lhs, rhs = g.lhs, g.rhs
    if lhs is None or rhs is None:
        raise ValueError(f"torch_scaled_operands: {g} runs in bf16")
    qa, qb, sa, sb = _kernel_operands(a, b, lhs, rhs)  # (interpreted on CPU tensors)
    return qa, qb, *_torch_scales(sa, sb, a.shape[0], b.shape[0], b.shape[2])


def _torch_scales(sa: Tensor, sb: Tensor, M: int, E: int, n: int) -> tuple[Tensor, Tensor]:
    """Rowwise or tensorwise scales ([M or 1, 1], [E, 1, n or 1]) as torch takes them."""
    return sa.reshape(-1).expand(M).contiguous(), sb.reshape(E, -1).expand(E, n).contiguous()


def _torch_scaled(qa: Tensor, qb: Tensor, sa: Tensor, sb: Tensor, offs: Tensor) -> Tensor:
    """``torch._scaled_grouped_mm`` on e4m3 operands and torch's scales; bf16 out."""
    if qb.stride(-2) != 1:  # torch wants b column-major (K-major)
        qb = qb.transpose(-2, -1).contiguous().transpose(-2, -1)
    out = torch._scaled_grouped_mm(qa.contiguous(), qb, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    return zero_tail_(out, offs)  # rows past the last group are not written


def _torch_gemm(a: Tensor, b: Tensor, offs: Tensor, g: GemmQuant) -> Tensor:
    """FP8 rowwise / tensorwise forward or dgrad on ``torch._scaled_grouped_mm``; bf16 out."""
    return _torch_scaled(*torch_scaled_operands(a, b, g), offs)


def _quantize_jagged_mmajor(t: Tensor, offs: Tensor, op: OperandQuant) -> tuple[Tensor, Tensor]:
    """Wgrad operand, M-major, by the Triton kernels: per-tensor or per-group scales in
    token order; 32 / 128-row blocks in the slot layout (every block on an aligned row)."""
    from torch_moe._triton import quantize as TQ

    if op.inner == -1:  # token order
        out = torch.empty(t.shape[::-1], dtype=FP8, device=t.device).t()
        if op.outer == -1:  # one scale for the tensor
            return TQ.quantize_blocks(t, (-1, -1), out=out)
        return TQ.quantize_jagged(t, offs, block=-1, fmt=op.fmt, scale_rule=op.scale_rule, out=out)
    nb = Q.jagged_num_blocks(t.shape[0], offs.shape[0], op.inner)
    out = torch.empty((t.shape[1], nb * op.inner), dtype=FP8, device=t.device).t()
    return TQ.quantize_jagged(
        t, offs, block=op.inner, fmt=op.fmt, scale_rule=op.scale_rule, out=out, slots=True
    )


def _kernel_wgrad(
    x: Tensor, dy: Tensor, offs: Tensor, g: GemmQuant, out_dtype: torch.dtype
) -> Tensor:
    """FP8 wgrad: x_g^T dy_g per group, both quantized M-major in jagged per-group blocks."""
    from torch_moe._triton import scaled_grouped_mm as TK

    qx, qdy, sx, sdy, gfb, block = kernel_wgrad_operands(x, dy, offs, g)
    return TK.scaled_grouped_mm_wgrad(qx, qdy, sx, sdy, offs, gfb, block, out_dtype=out_dtype)


def kernel_wgrad_operands(
    x: Tensor, dy: Tensor, offs: Tensor, g: GemmQuant
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """The Triton scaled wgrad's arguments: both operands quantized M-major by the Triton
    kernels, ``(qx, qdy, sx, sdy, group_first_block, block)``."""
    from torch_moe._triton import quantize as TQ

    lhs, rhs = g.lhs, g.rhs
    if lhs is None or rhs is None:
        raise ValueError(f"quantized_grouped_mm_wgrad: {g} runs in bf16, not on the FP8 kernels")
    qx, sx = _quantize_jagged_mmajor(x, offs, lhs)
    qdy, sdy = _quantize_jagged_mmajor(dy, offs, rhs)
    tensorwise = (lhs.outer, lhs.inner) == (-1, -1)
    block = -1 if tensorwise else lhs.inner
    gfb = (
        torch.zeros(offs.shape[0] + 1, dtype=torch.int32, device=x.device)
        if tensorwise
        else TQ.jagged_block_table(offs, x.shape[0], block)[2]
    )
    return qx, qdy, sx, sdy, gfb, block


def _run_gemm(a: Tensor, b: Tensor, offs: Tensor, g: GemmQuant, out_dtype: torch.dtype) -> Tensor:
    if a.numel() == 0 or b.numel() == 0:  # no products (M, K, N or E zero): zeros, as the
        # reference gives (an empty dim has no quantization blocks, the scaled op one)
        return a.new_zeros((a.shape[0], b.shape[2]), dtype=out_dtype)
    kernel = _select(g, a, b, out_dtype)
    if kernel == "torch":
        return _torch_gemm(a, b, offs, g)
    if kernel == "triton":
        return _kernel_gemm(a, b, offs, g, out_dtype)
    return _emulate_gemm(a, b, offs, g, out_dtype)


def _run_wgrad(x: Tensor, dy: Tensor, offs: Tensor, g: GemmQuant, out_dtype: torch.dtype) -> Tensor:
    if x.numel() == 0 or dy.numel() == 0:  # no products: zeros (as _run_gemm)
        return x.new_zeros((offs.shape[0], x.shape[1], dy.shape[1]), dtype=out_dtype)
    if wgrad_kernel(g, x.device.type) == "triton":
        return _kernel_wgrad(x, dy, offs, g, out_dtype)
    return _emulate_wgrad(x, dy, offs, g, out_dtype)


# --------------------------------------------------------------------------------------
# the high-precision ops: forward (with autograd), dgrad, wgrad


def _check_inputs(fn: str, x: Tensor, w: Tensor, offs: Tensor, recipe: str) -> Recipe:
    """Shared by the real and the fake kernels of the three ops (w [E, K, N] for forward and
    wgrad's output, [E, K, N] for dgrad, whose x is dy [M, N])."""
    try:
        r = get_recipe(recipe)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{fn}: {e}") from e
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(
            f"{fn}: expected x [M, K] and w [E, K, N], got {list(x.shape)} and {list(w.shape)}"
        )
    if x.dtype not in KERNEL_DTYPES or w.dtype != x.dtype:
        raise TypeError(
            f"{fn}: expected x and w to share a dtype in {KERNEL_DTYPES}, got {x.dtype} and "
            f"{w.dtype}"
        )
    if w.device != x.device:
        raise ValueError(f"{fn}: w is on {w.device} but x is on {x.device}")
    check_offs(fn, offs, w.shape[0], x.device)
    return r


def _check_gemm(fn: str, x: Tensor, w: Tensor, offs: Tensor, recipe: str) -> Recipe:
    r = _check_inputs(fn, x, w, offs, recipe)
    if w.shape[1] != x.shape[1]:
        raise ValueError(
            f"{fn}: x is [M, K={x.shape[1]}] but w is [E, K={w.shape[1]}, N={w.shape[2]}]"
        )
    return r


def _check_dgrad(fn: str, dy: Tensor, w: Tensor, offs: Tensor, recipe: str) -> Recipe:
    r = _check_inputs(fn, dy, w, offs, recipe)
    if w.shape[2] != dy.shape[1]:
        raise ValueError(
            f"{fn}: dy is [M, N={dy.shape[1]}] but w is [E, K={w.shape[1]}, N={w.shape[2]}]"
        )
    return r


def _check_wgrad(fn: str, x: Tensor, dy: Tensor, offs: Tensor, recipe: str) -> Recipe:
    try:
        r = get_recipe(recipe)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{fn}: {e}") from e
    if x.dim() != 2 or dy.dim() != 2 or x.shape[0] != dy.shape[0]:
        raise ValueError(
            f"{fn}: expected x [M, K] and dy [M, N] with the same M, got {list(x.shape)} and "
            f"{list(dy.shape)}"
        )
    if x.dtype not in KERNEL_DTYPES or dy.dtype != x.dtype:
        raise TypeError(
            f"{fn}: expected x and dy to share a dtype in {KERNEL_DTYPES}, got {x.dtype} and "
            f"{dy.dtype}"
        )
    if dy.device != x.device:
        raise ValueError(f"{fn}: dy is on {dy.device} but x is on {x.device}")
    check_offs(fn, offs, None, x.device)
    return r


def _quantized_grouped_mm_default(x: Tensor, w: Tensor, offs: Tensor, recipe: str) -> Tensor:
    r = _check_gemm("quantized_grouped_mm", x, w, offs, recipe)
    check_offs_values("quantized_grouped_mm", offs, x.shape[0])
    return _run_gemm(x, w, offs, r.forward, x.dtype)


@torch.library.custom_op("torch_moe::quantized_grouped_mm", mutates_args=())
def quantized_grouped_mm(x: Tensor, w: Tensor, offs: Tensor, recipe: str) -> Tensor:
    """Forward GEMM of ``recipe``: ``x [M, K] @ w[g] [K, N]`` per group, in x's dtype."""
    return _quantized_grouped_mm_default(x, w, offs, recipe)


@quantized_grouped_mm.register_fake
def _(x: Tensor, w: Tensor, offs: Tensor, recipe: str) -> Tensor:
    _check_gemm("quantized_grouped_mm", x, w, offs, recipe)
    return x.new_empty((x.shape[0], w.shape[2]))


def _quantized_grouped_mm_dgrad_default(dy: Tensor, w: Tensor, offs: Tensor, recipe: str) -> Tensor:
    r = _check_dgrad("quantized_grouped_mm_dgrad", dy, w, offs, recipe)
    check_offs_values("quantized_grouped_mm_dgrad", offs, dy.shape[0])
    return _run_gemm(dy, w.transpose(-2, -1), offs, r.dgrad, dy.dtype)


@torch.library.custom_op("torch_moe::quantized_grouped_mm_dgrad", mutates_args=())
def quantized_grouped_mm_dgrad(dy: Tensor, w: Tensor, offs: Tensor, recipe: str) -> Tensor:
    """Dgrad GEMM of ``recipe``: ``dy [M, N] @ w[g]^T [N, K]`` per group, in dy's dtype."""
    return _quantized_grouped_mm_dgrad_default(dy, w, offs, recipe)


@quantized_grouped_mm_dgrad.register_fake
def _(dy: Tensor, w: Tensor, offs: Tensor, recipe: str) -> Tensor:
    _check_dgrad("quantized_grouped_mm_dgrad", dy, w, offs, recipe)
    return dy.new_empty((dy.shape[0], w.shape[1]))


def _quantized_grouped_mm_wgrad_default(x: Tensor, dy: Tensor, offs: Tensor, recipe: str) -> Tensor:
    r = _check_wgrad("quantized_grouped_mm_wgrad", x, dy, offs, recipe)
    check_offs_values("quantized_grouped_mm_wgrad", offs, x.shape[0])
    return _run_wgrad(x, dy, offs, r.wgrad, x.dtype)


@torch.library.custom_op("torch_moe::quantized_grouped_mm_wgrad", mutates_args=())
def quantized_grouped_mm_wgrad(x: Tensor, dy: Tensor, offs: Tensor, recipe: str) -> Tensor:
    """Wgrad GEMM of ``recipe``: ``x[g]^T @ dy[g]`` per group [E, K, N], in x's dtype."""
    return _quantized_grouped_mm_wgrad_default(x, dy, offs, recipe)


@quantized_grouped_mm_wgrad.register_fake
def _(x: Tensor, dy: Tensor, offs: Tensor, recipe: str) -> Tensor:
    _check_wgrad("quantized_grouped_mm_wgrad", x, dy, offs, recipe)
    return x.new_empty((offs.shape[0], x.shape[1], dy.shape[1]))


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, w, offs, recipe = inputs
    ctx.save_for_backward(x, w, offs)
    ctx.recipe = recipe


def _backward(ctx, dy):  # type: ignore[no-untyped-def]
    x, w, offs = ctx.saved_tensors
    dy = dy if all(s != 0 for s in dy.stride()) else dy.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = quantized_grouped_mm_dgrad(dy.to(x.dtype), w, offs, ctx.recipe)
    if ctx.needs_input_grad[1]:
        if experts_transposed(w) and _symmetric_wgrad(ctx.recipe):
            # w [E, K, N] viewed from a row-major [E, N, K] (a weight used as x @ w^T): its
            # gradient in that layout, dW^T = dY^T x per group (both operands quantized
            # alike, so the same function), which AccumulateGrad stores as it is instead
            # of copying every expert transposed
            dw = quantized_grouped_mm_wgrad(dy.to(x.dtype), x, offs, ctx.recipe)
            dw = dw.transpose(-2, -1)
        else:
            dw = quantized_grouped_mm_wgrad(x, dy.to(x.dtype), offs, ctx.recipe)
    return dx, dw, None, None


def _symmetric_wgrad(recipe: str) -> bool:
    """Whether the recipe's wgrad quantizes x and dY alike (every built-in recipe does), so
    that swapping them transposes the product and changes nothing else."""
    g = get_recipe(recipe).wgrad
    return g.lhs == g.rhs


quantized_grouped_mm.register_autograd(_backward, setup_context=_setup)

# eager calls on plain CPU tensors run the CPU kernels (and the autograd formula above)
# without the ops' Python layers (torch_moe._ops._eager); everything else the ops. The
# same functions run either way (the same bits: the decomposition's "compiled == eager").
_scaled_grouped_mm = direct_calls(_scaled_grouped_mm, _scaled_grouped_mm_cpu)
_scaled_grouped_mm_wgrad = direct_calls(_scaled_grouped_mm_wgrad, _scaled_grouped_mm_wgrad_cpu)
quantized_grouped_mm = direct_calls(
    quantized_grouped_mm, _quantized_grouped_mm_default, _setup, _backward
)
quantized_grouped_mm_dgrad = direct_calls(
    quantized_grouped_mm_dgrad, _quantized_grouped_mm_dgrad_default
)
quantized_grouped_mm_wgrad = direct_calls(
    quantized_grouped_mm_wgrad, _quantized_grouped_mm_wgrad_default
)


def scaled_grouped_mm(x: Tensor, w: Tensor, offs: Tensor, recipe: str | Recipe) -> Tensor:
    r"""Grouped GEMM ``out[rows of g] = x[rows of g] @ w[g]`` in FP8 / MXFP8 per ``recipe``.

    Args:
        x: [M, K] rows sorted by group (fp32, bf16 or fp16).
        w: [E, K, N] in x's dtype.
        offs: [E] int32 group ENDS, as in :func:`torch_moe.ops.grouped_mm`.
        recipe: a name from :data:`torch_moe.quantization.RECIPES`, a recipe spec or a
            :class:`Recipe`.

    Returns [M, N] in x's dtype (rows past ``offs[-1]`` zero). Differentiable in x (dgrad:
    dY quantized along N, W along N) and w (wgrad: X and dY quantized along M in per-expert
    jagged blocks). MX recipes need K and N multiples of 32; FP8 blocks pad partial blocks.
    Runs ``torch.ops.torch_moe.quantized_grouped_mm`` (and its dgrad / wgrad ops).
    """
    return quantized_grouped_mm(x, w, offs, get_recipe(recipe).op_arg())
