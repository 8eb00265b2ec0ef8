"""Triton kernels of the permute family on CUDA: ``permute_indices`` for decode-sized
batches, and the row gather (``permute``) and the fp32 combine (``unpermute``) each as one
kernel where the ATen references launch a few kernels per row pass (the combine some five
per k: 40 for K = 8, which an eager GPU step pays in launch time).

The row kernels: ``permute`` reads row ``row_to_slot[r] // K`` of x (scaled in fp32 by the
slot's weight and rounded once, where weights are given) into row r, zero where the slot
is -1; ``unpermute`` sums, for each token, its K rows in fp32 in the order k = 0..K-1
(weighted: each product rounded to fp32 before its add, as the reference's separate
kernels round it; the launch turns off FMA contraction), zero for a -1 row. Both equal the
references bit for bit (tested in Triton's interpreter). ``weighted_row_dot`` (the combine
weights' gradient) is one kernel too: each slot's dot over D in fp32, in the kernel's own
summation order (the reference's is ATen's: within fp32 rounding of each other).

The sort:

``permute_indices`` (dropless) sorts the T*K assignments by expert and pads every group to
a multiple of ``align`` rows. Written in ATen ops it is some twenty small kernels (a range
check, a radix sort, a histogram, cumsums, gathers and scatters), which at decode sizes
cost more than the expert GEMMs themselves: on an H200 at T=1, K=8, E=128 the permutation
and the fused experts took 118 us in a CUDA graph, the fused experts alone 50 us. Here one
program does it all for up to :data:`PLAN_MAX_ROWS` assignments:

1. every row of ``row_to_slot`` set to -1 (padding);
2. per chunk of experts, the assignments' counts (a compare-and-sum over the slots), padded
   to ``align``, and their running sum: the group ends ``offs`` and starts;
3. per slot, its rank among the earlier slots of its expert (compare-and-sum over chunks
   of slots: a stable sort), so its row is its group's start + its rank; then
   ``slot_to_row[slot] = row`` and ``row_to_slot[row] = slot``.

The outputs equal :func:`torch_moe._ops.permute.permute_indices_reference` bit for bit
(tested in Triton's interpreter). A range error in ``expert_ids`` is reported the
reference's way, by ``torch._assert_async`` on a flag the kernel writes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from torch_moe._triton.grouped_mm import _interpreted, _use_interpreter

__all__ = [
    "PLAN_MAX_ROWS",
    "compile_for_sm90",
    "permute_plan",
    "permute_rows",
    "plan_takes",
    "row_dot",
    "rows_take",
    "unpermute_rows",
]

# The most assignments (T*K) one program sorts: the fused decode kernels' bound
# (torch_moe._ops.fused_experts.DECODE_MAX_ROWS). Its compare-and-sum work grows as
# T*K * (T*K + E), about a million compares here: a few microseconds on one SM.
PLAN_MAX_ROWS = 1024
_FILL_CHUNK = 1024  # rows per -1 fill step


def _launch(n: int) -> tuple[int, int, int]:
    """(NB, chunk, num_warps) for n assignments: NB x chunk compares per counting / ranking
    step, at most 8192, at most 64 per thread (sm_90: 1024 assignments in 4 warps with
    32-wide chunks spilled 6 KB; 8-wide chunks in 8 warps spill nothing)."""
    nb = max(16, triton.next_power_of_2(n))
    warps = 4 if nb <= 256 else 8
    return nb, max(4, min(32, 8192 // nb)), warps


# NB: builtins only (tl.reduce, tl.associative_scan with the standard combine function, no
# tl.sum / tl.cumsum / tl.zeros, which are @triton.jit helpers): the launcher runs the
# kernel in the interpreter for CPU tensors whatever TRITON_INTERPRET said at import (see
# torch_moe/_triton/grouped_mm.py).
_add = tl.standard._sum_combine


@triton.jit
def _permute_plan_kernel(
    ids_ptr,  # *i32 or *i64 [N]: the flattened expert_ids
    r2s_ptr,  # *i64 [M]: row -> slot (-1: padding)
    s2r_ptr,  # *i64 [N]: slot -> row
    offs_ptr,  # *i32 [E]: group ends
    starts_ptr,  # *i32 [E]: group starts (scratch)
    ok_ptr,  # *i32 [1]: 1 when every id lies in [0, E)
    dropped_ptr,  # *i64 []: 0 (dropless)
    N,
    E,
    M,
    ALIGN: tl.constexpr,
    NB: tl.constexpr,  # a power of two >= N
    EC: tl.constexpr,
    JC: tl.constexpr,
    MC: tl.constexpr,
):
    i = tl.arange(0, NB)
    valid = i < N
    e = tl.load(ids_ptr + i, mask=valid, other=0)
    in_range = valid & (e >= 0) & (e < E)  # in the ids' own dtype: no int32 wrap first
    e = e.to(tl.int32)
    bad = tl.reduce((valid & ~in_range).to(tl.int32), 0, _add)
    tl.store(ok_ptr, (bad == 0).to(tl.int32))
    tl.store(dropped_ptr, tl.full((), 0, tl.int64))
    e = tl.where(in_range, e, -1)  # an out-of-range id matches no expert
    for m0 in range(0, M, MC):
        rows = m0 + tl.arange(0, MC)
        tl.store(r2s_ptr + rows, tl.full((MC,), -1, tl.int64), mask=rows < M)
    end = tl.full((), 0, tl.int32)
    for e0 in range(0, E, EC):
        ex = e0 + tl.arange(0, EC)
        count = tl.reduce((e[:, None] == ex[None, :]).to(tl.int32), 0, _add)
        padded = (count + ALIGN - 1) // ALIGN * ALIGN
        ends = end + tl.associative_scan(padded, 0, _add)
        tl.store(offs_ptr + ex, ends, mask=ex < E)
        tl.store(starts_ptr + ex, ends - padded, mask=ex < E)
        end += tl.reduce(padded, 0, _add)
    tl.debug_barrier()  # the starts (and the -1 rows) before any thread reads them
    rank = tl.full((NB,), 0, dtype=tl.int32)
    for j0 in range(0, N, JC):
        j = j0 + tl.arange(0, JC)
        ej = tl.load(ids_ptr + j, mask=j < N, other=-1).to(tl.int32)
        earlier = (ej[None, :] == e[:, None]) & (j[None, :] < i[:, None])
        rank += tl.reduce(earlier.to(tl.int32), 1, _add)
    row = tl.load(starts_ptr + e, mask=in_range, other=0) + rank
    tl.store(s2r_ptr + i, row.to(tl.int64), mask=in_range)
    tl.store(r2s_ptr + row, i.to(tl.int64), mask=in_range)


def plan_takes(num_assignments: int, capacity: int | None) -> bool:
    """Whether :func:`permute_plan` runs ``permute_indices`` on CUDA: dropless, and
    1 to :data:`PLAN_MAX_ROWS` assignments (T*K)."""
    return capacity is None and 0 < num_assignments <= PLAN_MAX_ROWS


def permute_plan(
    expert_ids: torch.Tensor, num_experts: int, align: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``permute_indices(expert_ids, num_experts, align)`` (dropless) in one program:
    ``(row_to_slot [M], slot_to_row [T, K], offs [E] int32, num_dropped)``, M = T*K +
    E*(align - 1). CPU tensors run in Triton's interpreter (the tests)."""
    T, K = expert_ids.shape
    n = T * K
    if not plan_takes(n, None):
        raise ValueError(
            f"permute_plan: takes 1 to {PLAN_MAX_ROWS} assignments, got T*K = {n} "
            "(permute_indices runs the ATen reference there)"
        )
    if num_experts < 1 or align < 1:
        raise ValueError(
            f"permute_plan: num_experts and align must be >= 1, got {num_experts}, {align}"
        )
    dev = expert_ids.device
    m = n + num_experts * (align - 1)
    ids = expert_ids.reshape(-1).contiguous()
    row_to_slot = torch.empty(m, dtype=torch.int64, device=dev)
    slot_to_row = torch.empty(n, dtype=torch.int64, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    starts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    ok = torch.empty(1, dtype=torch.int32, device=dev)
    dropped = torch.empty((), dtype=torch.int64, device=dev)
    kernel = _interpreted(_permute_plan_kernel) if _use_interpreter(ids) else _permute_plan_kernel
    nb, chunk, warps = _launch(n)
    kernel[(1,)](
        ids, row_to_slot, slot_to_row, offs, starts, ok, dropped, n, num_experts, m,
        ALIGN=align, NB=nb, EC=chunk, JC=chunk, MC=_FILL_CHUNK, num_warps=warps,
    )  # fmt: skip
    torch._assert_async(
        ok, f"permute_indices: expert_ids must lie in [0, num_experts={num_experts})"
    )
    return row_to_slot, slot_to_row.view(T, K), offs, dropped


@triton.jit
def _row_tile(n, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's BLOCK_R rows (of n) and BLOCK_D columns (of D), and their masks; the
    rows in int64 (a row times its stride passes 2^31 elements at large batches)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    return rows, ds, rows < n, ds < D


@triton.jit
def _permute_rows_kernel(
    x_ptr, r2s_ptr, w_ptr, out_ptr, M, D, TOP_K,
    stride_x, stride_o,
    HAS_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows, ds, r_mask, d_mask = _row_tile(M, D, BLOCK_R, BLOCK_D)
    slot = tl.load(r2s_ptr + rows, mask=r_mask, other=-1)
    ok = slot >= 0
    tok = tl.where(ok, slot // TOP_K, 0)
    mask = ok[:, None] & d_mask[None, :]
    v = tl.load(x_ptr + tok[:, None] * stride_x + ds[None, :], mask=mask, other=0.0)
    if HAS_W:
        w = tl.load(w_ptr + tl.where(ok, slot, 0), mask=ok, other=0.0).to(tl.float32)
        v = tl.where(mask, v.to(tl.float32) * w[:, None], 0.0)
    out_ptrs = out_ptr + rows[:, None] * stride_o + ds[None, :]
    tl.store(out_ptrs, v.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


@triton.jit
def _unpermute_rows_kernel(
    y_ptr, s2r_ptr, w_ptr, out_ptr, T, D, TOP_K,
    stride_y, stride_o,
    HAS_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    ts, ds, t_mask, d_mask = _row_tile(T, D, BLOCK_R, BLOCK_D)
    acc = tl.full((BLOCK_R, BLOCK_D), 0.0, dtype=tl.float32)
    for k in range(TOP_K):
        row = tl.load(s2r_ptr + ts * TOP_K + k, mask=t_mask, other=-1)
        ok = row >= 0
        mask = ok[:, None] & d_mask[None, :]
        v = tl.load(
            y_ptr + tl.where(ok, row, 0)[:, None] * stride_y + ds[None, :], mask=mask, other=0.0
        )
        v = v.to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + ts * TOP_K + k, mask=t_mask, other=0.0).to(tl.float32)
            v = tl.where(mask, v * w[:, None], 0.0)
        acc = acc + v
    out_ptrs = out_ptr + ts[:, None] * stride_o + ds[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & d_mask[None, :])


@triton.jit
def _row_dot_kernel(
    rows_ptr, tok_ptr, s2r_ptr, out_ptr, T, D, TOP_K,
    stride_r, stride_t,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out[t, k] = <rows[slot_to_row[t, k]], tokens[t]> in fp32 (0 for a dropped slot),
    k = program_id(1)."""
    ts = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1)
    t_mask = ts < T
    row = tl.load(s2r_ptr + ts * TOP_K + k, mask=t_mask, other=-1)
    ok = row >= 0
    acc = tl.full((BLOCK_R,), 0.0, dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        mask = ok[:, None] & (ds < D)[None, :]
        r = tl.load(
            rows_ptr + tl.where(ok, row, 0)[:, None] * stride_r + ds[None, :], mask=mask, other=0.0
        )
        x = tl.load(tok_ptr + ts[:, None] * stride_t + ds[None, :], mask=mask, other=0.0)
        acc += tl.reduce(r.to(tl.float32) * x.to(tl.float32), 1, _add)
    tl.store(out_ptr + ts * TOP_K + k, acc, mask=t_mask)


_ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK_ROWS, _BLOCK_D = 16, 128


def rows_take(t: torch.Tensor, weights: torch.Tensor | None) -> bool:
    """Whether the row kernels run ``permute`` / ``unpermute`` of t (its rows unit-stride,
    bf16 / fp16 / fp32, weights of those dtypes): else the references."""
    return (
        t.dtype in _ROW_DTYPES
        and (t.shape[1] <= 1 or t.stride(1) == 1)
        and (weights is None or weights.dtype in _ROW_DTYPES)
    )


def _out_dtype(t: torch.Tensor) -> torch.dtype:
    # the interpreter's fp32 -> bf16 store truncates (the GPU's rounds to nearest): it
    # writes fp32, which torch then rounds
    return torch.float32 if t.dtype == torch.bfloat16 and _use_interpreter(t) else t.dtype


def _launch_rows(
    kernel: Any, grid: tuple[int, int], args: list, has_w: bool, t: torch.Tensor
) -> None:
    interpret = _use_interpreter(t)
    fn = _interpreted(kernel) if interpret else kernel
    options = {} if interpret else {"enable_fp_fusion": False}  # products rounded first
    fn[grid](*args, HAS_W=has_w, BLOCK_R=_BLOCK_ROWS, BLOCK_D=_BLOCK_D, num_warps=4, **options)


def permute_rows(
    x: torch.Tensor,
    row_to_slot: torch.Tensor,
    slot_to_row: torch.Tensor,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """``torch_moe::permute`` in one kernel (the maps and x checked by the caller)."""
    M, D, K = row_to_slot.shape[0], x.shape[1], slot_to_row.shape[1]
    if M == 0 or D == 0 or x.shape[0] == 0:  # (T == 0: only padding rows)
        return x.new_zeros((M, D))
    out = torch.empty((M, D), dtype=_out_dtype(x), device=x.device)
    w = weights.reshape(-1).contiguous() if weights is not None else x
    grid = (triton.cdiv(M, _BLOCK_ROWS), triton.cdiv(D, _BLOCK_D))
    args = [x, row_to_slot.contiguous(), w, out, M, D, K, x.stride(0), out.stride(0)]
    _launch_rows(_permute_rows_kernel, grid, args, weights is not None, x)
    return out.to(x.dtype)


def unpermute_rows(
    y: torch.Tensor,
    slot_to_row: torch.Tensor,
    row_to_slot: torch.Tensor,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """``torch_moe::unpermute`` in one kernel (the maps and y checked by the caller)."""
    (T, K), D = slot_to_row.shape, y.shape[1]
    if T == 0 or D == 0 or y.shape[0] == 0:  # (no rows: every slot was dropped)
        return y.new_zeros((T, D))
    out = torch.empty((T, D), dtype=_out_dtype(y), device=y.device)
    w = weights.contiguous() if weights is not None else y
    grid = (triton.cdiv(T, _BLOCK_ROWS), triton.cdiv(D, _BLOCK_D))
    args = [y, slot_to_row.contiguous(), w, out, T, D, K, y.stride(0), out.stride(0)]
    _launch_rows(_unpermute_rows_kernel, grid, args, weights is not None, y)
    return out.to(y.dtype)


def row_dot(rows: torch.Tensor, tokens: torch.Tensor, slot_to_row: torch.Tensor) -> torch.Tensor:
    """``torch_moe::weighted_row_dot`` in one kernel (its arguments checked by the caller):
    fp32 [T, K]; each dot summed over D in the kernel's own order (within fp32 rounding of
    the reference's, which sums in ATen's)."""
    (T, K), D = slot_to_row.shape, rows.shape[1]
    out = torch.zeros((T, K), dtype=torch.float32, device=rows.device)
    if T == 0 or K == 0 or rows.shape[0] == 0:
        return out
    grid = (triton.cdiv(T, _BLOCK_ROWS), K)
    fn = _interpreted(_row_dot_kernel) if _use_interpreter(rows) else _row_dot_kernel
    fn[grid](
        rows, tokens, slot_to_row.contiguous(), out, T, D, K, rows.stride(0), tokens.stride(0),
        BLOCK_R=_BLOCK_ROWS, BLOCK_D=_BLOCK_D, num_warps=4,
    )  # fmt: skip
    return out


def compile_for_sm90(
    kernel: str = "plan",
    num_assignments: int = PLAN_MAX_ROWS,
    num_experts: int = 256,
    align: int = 64,
    dim: int = 7168,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """AOT-compile ``"plan"`` (the sort, at ``num_assignments``), ``"permute"``,
    ``"unpermute"`` or ``"row_dot"`` (the row kernels, weighted, rows of ``dim`` in
    ``dtype``, top-8) for sm_90a (no GPU needed); returns
    :class:`torch_moe._triton.grouped_mm.Sm90Kernel` (PTX, registers, spills)."""
    from torch_moe._triton.grouped_mm import _Config, compile_jit_for_sm90

    meta = functools.partial(torch.empty, device="meta")
    n, m = num_assignments, num_assignments + num_experts * (align - 1)
    i64, i32 = torch.int64, torch.int32
    if kernel == "plan":
        args = [meta(n, dtype=i64), meta(m, dtype=i64), meta(n, dtype=i64), meta(num_experts, dtype=i32),
                meta(num_experts, dtype=i32), meta(1, dtype=i32), meta((), dtype=i64), n, num_experts, m]  # fmt: skip
        nb, chunk, warps = _launch(n)
        params = dict(ALIGN=align, NB=nb, EC=chunk, JC=chunk, MC=_FILL_CHUNK)
        fn = _permute_plan_kernel
    elif kernel == "row_dot":
        T, K = 4096, 8
        args = [meta(T * K, dim, dtype=dtype), meta(T, dim, dtype=dtype), meta(T * K, dtype=i64),
                meta(T * K, dtype=torch.float32), T, dim, K, dim, dim]  # fmt: skip
        params = dict(BLOCK_R=_BLOCK_ROWS, BLOCK_D=_BLOCK_D)
        fn, warps = _row_dot_kernel, 4
    elif kernel in ("permute", "unpermute"):
        T, K = 4096, 8
        rows = meta(T * K, dim, dtype=dtype)
        tokens = meta(T, dim, dtype=dtype)
        w = meta(T * K, dtype=torch.float32)
        if kernel == "permute":
            args = [tokens, meta(T * K, dtype=i64), w, rows, T * K, dim, K, dim, dim]
            fn = _permute_rows_kernel
        else:
            args = [rows, meta(T * K, dtype=i64), w, tokens, T, dim, K, dim, dim]
            fn = _unpermute_rows_kernel
        params = dict(HAS_W=True, BLOCK_R=_BLOCK_ROWS, BLOCK_D=_BLOCK_D)
        warps = 4
    else:
        raise ValueError(
            f"compile_for_sm90: kernel must be plan, permute, unpermute or row_dot, got {kernel!r}"
        )
    return compile_jit_for_sm90(f"permute_{kernel}", fn, args, params, _Config(0, 0, 0, warps, 1))
