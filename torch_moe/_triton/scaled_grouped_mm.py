"""Persistent Triton grouped GEMMs on FP8 operands with block scales (FP8 blockwise, MXFP8).

Legend: M rows (sorted by group), K in features, N out features, E groups (experts).

Same layout and group contract as :mod:`torch_moe._triton.grouped_mm` (``offs`` = int32
group ends read on the device; rows past ``offs[-1]`` of the output are zero), on operands
quantized by :mod:`torch_moe._triton.quantize`:

    scaled_grouped_mm(a_MK, b_EKN, sa, sb, offs)     -> out_MN
        a = qa * sa with sa [M or 1, KS]: one scale per row and K block (or per tensor)
        b = qb * sb with sb [E, KS, NS]: one scale per K block and N block (or per matrix)
    scaled_grouped_mm_wgrad(a_MK, b_MN, sa, sb, offs) -> out_EKN = a_g^T b_g per group
        sa [NB, K], sb [NB, N]: per column, jagged blocks of rows inside each group
        (:func:`torch_moe._triton.quantize.jagged_block_table`)

How scales enter (``SCALE_K`` / ``SCALE_M``, the extent of a scale block along the reduction):
when 128-wide blocks split the reduction (DeepSeek-style blocks), the kernel steps
one scale block per iteration, takes the FP8 product of that block on the tensor cores
(fp32 result) and adds it to the fp32 accumulator multiplied by the row and column scales:
the "promotion" DeepGEMM does, so the dequantization costs [BLOCK_M, BLOCK_N] FMAs per
block instead of touching the operands. When one scale covers the whole reduction (rowwise,
tensorwise, per-group wgrad) the scales multiply the accumulator once, in the epilogue.
Per-tensor scales are read through zero strides. MX blocks (32 along the reduction, E8M0
scales) are too short to promote per block (the tensor cores would wait on every 32-wide
product: benchmarks/results/quant_h200_202611.md), so the kernel dequantizes them in the loop:
``q * 2^e`` is exact in bf16 (8 exponent bits, e4m3's 3 mantissa bits), and the tile runs on
the bf16 tensor cores, the path Hopper has for MX (no native MX MMA before sm_100).

Operand layout: Hopper's FP8 ``wgmma`` reads both operands K-major (the reduction dim
contiguous), so the launchers in :mod:`torch_moe.quantization.scaled_grouped_mm` have the
quantize kernels write q in that layout (w as [E, N, K], dY and X transposed for wgrad).
Any strides work; other layouts only run slower.

On CPU tensors (and under ``TRITON_INTERPRET=1``) the kernels run in Triton's interpreter,
with fp32 operands upcast before ``tl.dot`` and an fp32 output.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import triton
import triton.language as tl

from torch_moe._triton.grouped_mm import (
    _group_bounds,
    _interpreted,
    _max_programs,
    _use_interpreter,
    _wgrad_tile,
    _zero_tail,
)

__all__ = ["compile_for_sm90", "scaled_grouped_mm", "scaled_grouped_mm_wgrad"]


@triton.jit
def _chain_dot(a, b, acc, DOT_FP32: tl.constexpr):
    """acc + a @ b on the tensor cores (the interpreter: fp32 operands)."""
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _promote_dot(a, b, sa, sb, acc, DOT_FP32: tl.constexpr):
    """acc + (a @ b) * sa[:, None] * sb[None, :]: one scale block's product, promoted."""
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return acc + tl.dot(a, b, input_precision="ieee") * sa[:, None] * sb[None, :]


@triton.jit
def _mx_dot(a, b, sa, sb, acc, R: tl.constexpr, RED: tl.constexpr, C: tl.constexpr,
            DOT_FP32: tl.constexpr):  # fmt: skip
    """acc + dequant(a) @ dequant(b) for MX operands: a [R, RED] with scales sa [R, RED // 32],
    b [RED, C] with sb [RED // 32, C]. ``q * 2^e`` is exact in bf16, so the product runs on the
    bf16 tensor cores (the interpreter: fp32)."""
    a3 = tl.reshape(a.to(tl.float32), (R, RED // 32, 32))
    b3 = tl.reshape(b.to(tl.float32), (RED // 32, 32, C))
    a_f = tl.reshape(a3 * sa[:, :, None], (R, RED))
    b_f = tl.reshape(b3 * sb[:, None, :], (RED, C))
    if DOT_FP32:
        return tl.dot(a_f, b_f, acc, input_precision="ieee")
    return tl.dot(a_f.to(tl.bfloat16), b_f.to(tl.bfloat16), acc)


@triton.jit
def _mx_scales(sa_ptrs, sb_ptrs, blocks, block_mask, a_mask, b_mask, stride_sa, stride_sb):
    """The MX scales of one step: sa [len(sa_ptrs), len(blocks)] and sb [len(blocks),
    len(sb_ptrs)] for the reduction-dim scale blocks ``blocks`` (masked loads, 0 outside)."""
    sa = tl.load(
        sa_ptrs[:, None] + blocks[None, :] * stride_sa,
        mask=a_mask[:, None] & block_mask[None, :],
        other=0.0,
    )
    sb = tl.load(
        sb_ptrs[None, :] + blocks[:, None] * stride_sb,
        mask=block_mask[:, None] & b_mask[None, :],
        other=0.0,
    )
    return sa, sb


@triton.jit
def _scaled_gmm_fwd_kernel(
    a_ptr,  # *fp8 [M, K]
    b_ptr,  # *fp8 [E, K, N]
    sa_ptr,  # *f32 [M, KS] (row stride 0: one scale for all rows)
    sb_ptr,  # *f32 [E, KS, NS] (stride 0 where a scale spans the dim)
    out_ptr,  # *T [M, N]
    offs_ptr,  # *i32 [E] group ends
    M,
    N,
    K,
    E,
    stride_am,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_sam,
    stride_sak,
    stride_sbe,
    stride_sbk,
    stride_sbn,
    stride_om,
    stride_on,
    SCALE_K: tl.constexpr,  # K extent of a scale block (== BLOCK_K), 0: one over all of K
    SCALE_N: tl.constexpr,  # N extent of b's scale block
    MX: tl.constexpr,  # 32-element power-of-two scales: dequantize to bf16 in the loop
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    arange_k = tl.arange(0, BLOCK_K)

    # The persistent walk over groups of torch_moe/_triton/grouped_mm.py's forward kernel.
    tile_base = 0
    start = 0
    b_g_ptr = b_ptr  # b[g]
    sb_g_ptr = sb_ptr  # sb[g]
    for g in tl.range(0, E):
        end = tl.load(offs_ptr + g)
        end = tl.minimum(tl.maximum(end, start), M)
        tiles_g = ((end - start + BLOCK_M - 1) // BLOCK_M) * tiles_n
        first = (pid + num_progs - tile_base % num_progs) % num_progs
        for t in tl.range(first, tiles_g, num_progs):
            rows = start + (t // tiles_n) * BLOCK_M + arange_m
            cols = (t % tiles_n) * BLOCK_N + arange_n
            row_mask = rows < end
            col_mask = cols < N
            rows64 = rows.to(tl.int64)
            a_ptrs = a_ptr + rows64[:, None] * stride_am + arange_k[None, :] * stride_ak
            b_ptrs = b_g_ptr + arange_k[:, None] * stride_bk + cols[None, :] * stride_bn
            sa_ptrs = sa_ptr + rows64 * stride_sam
            sb_ptrs = sb_g_ptr + (cols // SCALE_N) * stride_sbn
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
            for k0 in tl.range(0, K, BLOCK_K):
                k_mask = arange_k < K - k0
                a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                if MX:
                    kbs = k0 // 32 + tl.arange(0, BLOCK_K // 32)
                    kb_mask = kbs < (K + 31) // 32
                    sa, sb = _mx_scales(
                        sa_ptrs, sb_ptrs, kbs, kb_mask, row_mask, col_mask, stride_sak, stride_sbk
                    )
                    acc = _mx_dot(a, b, sa, sb, acc, BLOCK_M, BLOCK_K, BLOCK_N, DOT_FP32)
                elif SCALE_K > 0:
                    kb = k0 // SCALE_K
                    sa = tl.load(sa_ptrs + kb * stride_sak, mask=row_mask, other=0.0)
                    sb = tl.load(sb_ptrs + kb * stride_sbk, mask=col_mask, other=0.0)
                    acc = _promote_dot(a, b, sa, sb, acc, DOT_FP32)
                else:
                    acc = _chain_dot(a, b, acc, DOT_FP32)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            if SCALE_K == 0:
                sa = tl.load(sa_ptrs, mask=row_mask, other=0.0)
                sb = tl.load(sb_ptrs, mask=col_mask, other=0.0)
                acc = acc * sa[:, None] * sb[None, :]
            o_ptrs = out_ptr + rows64[:, None] * stride_om + cols[None, :] * stride_on
            tl.store(
                o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :]
            )
        tile_base += tiles_g
        start = end
        b_g_ptr += stride_be
        sb_g_ptr += stride_sbe

    _zero_tail(out_ptr, start, M, N, tile_base, stride_om, stride_on, BLOCK_M, BLOCK_N)


@triton.jit
def _scaled_gmm_wgrad_kernel(
    a_ptr,  # *fp8 [M, K]: read as a^T (M-major storage is the fast layout)
    b_ptr,  # *fp8 [M, N]
    sa_ptr,  # *f32 [NB, K]
    sb_ptr,  # *f32 [NB, N]
    out_ptr,  # *T [E, K, N]
    offs_ptr,  # *i32 [E] group ends
    gfb_ptr,  # *i32 [E + 1]: first scale row (block) of every group
    M,
    N,
    K,
    E,
    stride_am,
    stride_ak,
    stride_bm,
    stride_bn,
    stride_sab,
    stride_sak,
    stride_sbb,
    stride_sbn,
    stride_oe,
    stride_ok,
    stride_on,
    SCALE_M: tl.constexpr,  # rows per scale block (== BLOCK_M), 0: one block per group
    MX: tl.constexpr,  # 32-row power-of-two scales: dequantize to bf16 in the loop
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    tiles_per_group = ((K + BLOCK_K - 1) // BLOCK_K) * tiles_n
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    arange_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(pid, E * tiles_per_group, num_progs):
        g, ks, ns, k_mask, n_mask = _wgrad_tile(
            tile, tiles_per_group, tiles_n, arange_k, arange_n, K, N, BLOCK_K, BLOCK_N
        )
        start, end = _group_bounds(offs_ptr, g, M)
        blk = tl.load(gfb_ptr + g).to(tl.int64)
        sa_ptrs = sa_ptr + ks * stride_sak
        sb_ptrs = sb_ptr + ns * stride_sbn
        acc = tl.full((BLOCK_K, BLOCK_N), 0.0, dtype=tl.float32)
        if MX:
            # BLOCK_M // 32 slots per step; slots past the group's last are masked by a zero
            # scale (their rows hold the next group's finite values, or are past M).
            blk_end = tl.load(gfb_ptr + g + 1)
            arange_s = tl.arange(0, BLOCK_M // 32)
            for j in tl.range(blk, blk_end, BLOCK_M // 32):
                rows = j * 32 + arange_m
                in_m = rows < M
                slot = j + arange_s
                s_mask = slot < blk_end
                a = tl.load(
                    a_ptr + ks[:, None] * stride_ak + rows[None, :] * stride_am,
                    mask=k_mask[:, None] & in_m[None, :],
                    other=0.0,
                )
                b = tl.load(
                    b_ptr + rows[:, None] * stride_bm + ns[None, :] * stride_bn,
                    mask=in_m[:, None] & n_mask[None, :],
                    other=0.0,
                )
                sa, sb = _mx_scales(
                    sa_ptrs, sb_ptrs, slot, s_mask, k_mask, n_mask, stride_sab, stride_sbb
                )
                acc = _mx_dot(a, b, sa, sb, acc, BLOCK_K, BLOCK_M, BLOCK_N, DOT_FP32)
        elif SCALE_M > 0:
            # Slot layout (quantize_jagged(slots=True)): scale block j is rows
            # [j * SCALE_M, (j + 1) * SCALE_M) of a and b, zero-padded, so every step is an
            # aligned, unmasked tile along M.
            blk_end = tl.load(gfb_ptr + g + 1)
            rows0 = blk * SCALE_M + arange_m
            a_ptrs = a_ptr + ks[:, None] * stride_ak + rows0[None, :] * stride_am
            b_ptrs = b_ptr + rows0[:, None] * stride_bm + ns[None, :] * stride_bn
            for j in tl.range(blk, blk_end):
                a = tl.load(a_ptrs, mask=k_mask[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
                sa = tl.load(sa_ptrs + j * stride_sab, mask=k_mask, other=0.0)
                sb = tl.load(sb_ptrs + j * stride_sbb, mask=n_mask, other=0.0)
                acc = _promote_dot(a, b, sa, sb, acc, DOT_FP32)
                a_ptrs += SCALE_M * stride_am
                b_ptrs += SCALE_M * stride_bm
        else:
            # Steps start on a multiple of 16 rows at or before the group's first, and the
            # loads are masked along M by M alone: the compiler then knows every step's
            # M-major tile is 16-byte aligned with masks constant over 16 rows, loads it in
            # vectors and pipelines it (cp.async). Masked by the group's own bounds, it
            # loaded single bytes, unpipelined (sm_90 PTX: 128 ld.global.b8, no cp.async).
            first = start // 16 * 16
            rows0 = first.to(tl.int64) + arange_m
            a_ptrs = a_ptr + ks[:, None] * stride_ak + rows0[None, :] * stride_am
            b_ptrs = b_ptr + rows0[:, None] * stride_bm + ns[None, :] * stride_bn
            for m0 in tl.range(first, end, BLOCK_M):
                m = m0 + arange_m
                in_m = m < M
                a = tl.load(a_ptrs, mask=k_mask[:, None] & in_m[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=in_m[:, None] & n_mask[None, :], other=0.0)
                # the rows of the neighbouring groups (or past the last group: never written)
                # zeroed in registers, in both operands (0 * a NaN byte is NaN)
                mine = (m >= start) & (m < end)
                a = tl.where(mine[None, :], a, 0.0)
                b = tl.where(mine[:, None], b, 0.0)
                acc = _chain_dot(a, b, acc, DOT_FP32)
                a_ptrs += BLOCK_M * stride_am
                b_ptrs += BLOCK_M * stride_bm
            sa = tl.load(sa_ptrs + blk * stride_sab, mask=k_mask, other=0.0)
            sb = tl.load(sb_ptrs + blk * stride_sbb, mask=n_mask, other=0.0)
            acc = acc * sa[:, None] * sb[None, :]
        o_ptrs = out_ptr + g.to(tl.int64) * stride_oe + ks[:, None] * stride_ok
        o_ptrs += ns[None, :] * stride_on
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])


# --------------------------------------------------------------------------------------
# Configs and launchers
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _fwd_config(scale_k: int, interpret: bool) -> _Config:
    """Forward / dgrad tiles. sm_90: 128 x 128 fp32 accumulator over two warpgroups and a
    K step of one 128-wide scale block per stage; MX: see below."""
    if scale_k == 32:  # MX: 64-wide K steps of two scale blocks, dequantized to bf16
        # H200 sweep (bench_quant.py --tune, DeepSeek-V3 w13): 128x256 tiles 307 TFLOP/s,
        # 128x128 218 (K step 64) / 273 (K step 128)
        return _Config(16, 16, 64, 1, 1) if interpret else _Config(128, 256, 64, 8, 3)
    if interpret:
        return _Config(16, 16, scale_k or 32, num_warps=1, num_stages=1)
    return _Config(128, 128, scale_k or 128, num_warps=8, num_stages=4)


def _wgrad_config(scale_m: int, interpret: bool) -> _Config:
    if scale_m == 32:  # MX: two 32-row slots per step, dequantized to bf16
        return _Config(64, 16, 16, 1, 1) if interpret else _Config(64, 128, 128, 8, 3)
    if interpret:
        return _Config(scale_m or 16, 16, 16, num_warps=1, num_stages=1)
    if scale_m == 0:  # token order, rows outside the group zeroed in registers: 64-row
        return _Config(64, 128, 128, num_warps=8, num_stages=3)  # steps (128 spill)
    return _Config(128, 128, 128, num_warps=8, num_stages=3)


def _block_extent(fn: str, name: str, value: int, size: int) -> int:
    """A scale block's extent along a dim: 0 for one scale over the whole dim."""
    if value == -1 or value >= size:
        return 0
    if value < 1:
        raise ValueError(f"{fn}: {name} must be a positive block extent or -1, got {value}")
    return value


def _out_buffer(interpret: bool, shape: tuple[int, ...], dtype: torch.dtype, device: Any):
    # The interpreter's f32 -> bf16 store truncates: interpreted kernels write fp32.
    return torch.empty(shape, dtype=torch.float32 if interpret else dtype, device=device)


def scaled_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    sa: torch.Tensor,
    sb: torch.Tensor,
    offs: torch.Tensor,
    *,
    block_k: int,
    block_n: int,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``out[rows of g] = (qa * sa)[rows of g] @ (qb * sb)[g]`` with FP8 a [M, K], b [E, K, N].

    A scale block spans ``block_k`` elements of K in both operands (-1: all of K) and
    ``block_n`` columns of b (-1: all of N). sa: fp32 [M, ceil(K / block_k)] or [1, 1] (per
    tensor); sb: fp32 [E, ceil(K / block_k), ceil(N / block_n)]. Rows past ``offs[-1]`` are
    zero.
    """
    fn = "scaled_grouped_mm"
    M, K = a.shape
    E, _, N = b.shape
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{fn}: expected float8_e4m3fn operands, got {a.dtype} and {b.dtype}")
    scale_k = _block_extent(fn, "block_k", block_k, K)
    scale_n = _block_extent(fn, "block_n", block_n, N)
    ks = triton.cdiv(K, scale_k) if scale_k else 1
    ns = triton.cdiv(N, scale_n) if scale_n else 1
    if sa.shape[1] != ks or sa.shape[0] not in (1, M) or list(sb.shape) != [E, ks, ns]:
        raise ValueError(
            f"{fn}: blocks ({block_k}, {block_n}) need sa [{M} or 1, {ks}] and sb [{E}, {ks}, "
            f"{ns}], got {list(sa.shape)} and {list(sb.shape)}"
        )
    interpret = _use_interpreter(a)
    out = _out_buffer(interpret, (M, N), out_dtype, a.device)
    if M == 0 or N == 0:
        return out.to(out_dtype)
    cfg = _fwd_config(scale_k, interpret)
    if scale_k not in (0, 32, cfg.block_k):
        raise ValueError(f"{fn}: K scale blocks of {scale_k} are not supported (32 or 128)")
    max_tiles = (triton.cdiv(M, cfg.block_m) + E + 1) * triton.cdiv(N, cfg.block_n)
    grid = (min(_max_programs(a, interpret), max_tiles),)
    kernel = _interpreted(_scaled_gmm_fwd_kernel) if interpret else _scaled_gmm_fwd_kernel
    args, meta = _fwd_args(a, b, sa, sb, out, offs, scale_k, scale_n, cfg, interpret)
    kernel[grid](*args, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.to(out_dtype)


def _fwd_args(a, b, sa, sb, out, offs, scale_k, scale_n, cfg, interpret) -> tuple[list, dict]:  # type: ignore[no-untyped-def]
    # Runtime arguments and constexprs of _scaled_gmm_fwd_kernel (shared with compile_for_sm90).
    M, K = a.shape
    E, _, N = b.shape
    args = [
        a, b, sa, sb, out, offs, M, N, K, E,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        0 if sa.shape[0] == 1 else sa.stride(0), sa.stride(1),
        sb.stride(0), sb.stride(1), 0 if sb.shape[2] == 1 else sb.stride(2),
        out.stride(0), out.stride(1),
    ]  # fmt: skip
    meta = dict(
        SCALE_K=scale_k, SCALE_N=scale_n or 1, MX=scale_k == 32, DOT_FP32=interpret,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
    )  # fmt: skip
    return args, meta


def scaled_grouped_mm_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    sa: torch.Tensor,
    sb: torch.Tensor,
    offs: torch.Tensor,
    group_first_block: torch.Tensor,
    block: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``out[g] = (qa * sa)[rows of g]^T @ (qb * sb)[rows of g]``, FP8 a [M, K], b [M, N].

    sa [NB, K], sb [NB, N]: jagged scales of ``block`` rows (-1: one block per group; a
    [1, 1] scale is per tensor), laid out by ``jagged_block_table`` (``group_first_block``).
    For block 32 / 128, a and b are in the slot layout of ``quantize_jagged(slots=True)``
    ([NB * block, K] and [NB * block, N]); otherwise in token order [M, K] and [M, N].
    """
    fn = "scaled_grouped_mm_wgrad"
    K = a.shape[1]
    N = b.shape[1]
    E = offs.shape[0]
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{fn}: expected float8_e4m3fn operands, got {a.dtype} and {b.dtype}")
    if block not in (-1, 32, 128):
        raise ValueError(f"{fn}: block must be 32, 128 or -1 (per group), got {block}")
    interpret = _use_interpreter(a)
    scale_m = 0 if block == -1 else block
    out = _out_buffer(interpret, (E, K, N), out_dtype, a.device)
    if K == 0 or N == 0:
        return out.to(out_dtype)
    cfg = _wgrad_config(scale_m, interpret)
    tiles = E * triton.cdiv(K, cfg.block_k) * triton.cdiv(N, cfg.block_n)
    grid = (min(_max_programs(a, interpret), tiles),)
    kernel = _interpreted(_scaled_gmm_wgrad_kernel) if interpret else _scaled_gmm_wgrad_kernel
    args, meta = _wgrad_args(a, b, sa, sb, out, offs, group_first_block, scale_m, cfg, interpret)
    kernel[grid](*args, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.to(out_dtype)


def _wgrad_args(a, b, sa, sb, out, offs, gfb, scale_m, cfg, interpret) -> tuple[list, dict]:  # type: ignore[no-untyped-def]
    # Runtime arguments and constexprs of _scaled_gmm_wgrad_kernel (shared with
    # compile_for_sm90).
    M, K = a.shape
    N = b.shape[1]
    E = offs.shape[0]
    per_tensor = sa.shape[0] == 1 and sa.shape[1] == 1
    args = [
        a, b, sa, sb, out, offs, gfb, M, N, K, E,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        *((0, 0) if per_tensor else sa.stride()), *((0, 0) if per_tensor else sb.stride()),
        out.stride(0), out.stride(1), out.stride(2),
    ]  # fmt: skip
    meta = dict(
        SCALE_M=scale_m, MX=scale_m == 32, DOT_FP32=interpret,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
    )  # fmt: skip
    return args, meta


# Scale layouts of each recipe kind, as (block_k, block_n) of the forward GEMM.
_KINDS = {"blockwise": (128, 128), "mx": (32, 1), "rowwise": (-1, 1), "tensorwise": (-1, -1)}


def compile_for_sm90(
    kernel: str,
    kind: str,
    *,
    M: int = 16384,
    K: int = 7168,
    N: int = 4096,
    E: int = 32,
    cc: int = 90,
) -> Any:
    """AOT-compile the ``"forward"`` or ``"wgrad"`` kernel for recipe ``kind`` (``"blockwise"``,
    ``"mx"``, ``"rowwise"``, ``"tensorwise"``) at the given sizes with the launcher's config,
    K-major operands as the launchers lay them out; no GPU needed. Returns
    :class:`torch_moe._triton.grouped_mm.Sm90Kernel` (PTX, registers, spills)."""
    from torch_moe._triton.grouped_mm import compile_jit_for_sm90

    if kind not in _KINDS:
        raise ValueError(f"compile_for_sm90: kind must be one of {sorted(_KINDS)}, got {kind!r}")
    meta_t = functools.partial(torch.empty, device="meta")
    fp8 = torch.float8_e4m3fn
    block_k, block_n = _KINDS[kind]
    offs = meta_t(E, dtype=torch.int32)
    if kernel == "forward":
        scale_k = _block_extent("compile", "block_k", block_k, K)
        scale_n = _block_extent("compile", "block_n", block_n, N)
        ks = triton.cdiv(K, scale_k) if scale_k else 1
        ns = triton.cdiv(N, scale_n) if scale_n else 1
        a = meta_t(M, K, dtype=fp8)
        b = meta_t(E, N, K, dtype=fp8).transpose(-2, -1)
        sa = meta_t(1 if kind == "tensorwise" else M, ks)
        sb = meta_t(E, ks, ns)
        cfg = _fwd_config(scale_k, interpret=False)
        args, meta = _fwd_args(a, b, sa, sb, meta_t(M, N, dtype=torch.bfloat16), offs,
                               scale_k, scale_n, cfg, False)  # fmt: skip
        fn = _scaled_gmm_fwd_kernel
    elif kernel == "wgrad":
        scale_m = 0 if block_k == -1 else block_k
        nb = 1 if kind == "tensorwise" else (M + (E + 1) * max(scale_m - 1, 1)) // max(scale_m, 1)
        a = meta_t(K, M, dtype=fp8).t()
        b = meta_t(N, M, dtype=fp8).t()
        cfg = _wgrad_config(scale_m, interpret=False)
        args, meta = _wgrad_args(a, b, meta_t(nb, K), meta_t(nb, N), meta_t(E, K, N), offs,
                                 meta_t(E + 1, dtype=torch.int32), scale_m, cfg, False)  # fmt: skip
        fn = _scaled_gmm_wgrad_kernel
    else:
        raise ValueError(f"compile_for_sm90: kernel must be 'forward' or 'wgrad', got {kernel!r}")
    return compile_jit_for_sm90(f"scaled_{kernel}_{kind}", fn, args, meta, cfg, cc=cc)
