"""Persistent Triton grouped GEMM for MoE experts: forward (``x @ w[g]``) and weight gradient.

Legend: M rows (token-expert pairs, sorted by expert), K in-features, N out-features,
E experts (groups).

Layout (the same contract as ``torch._grouped_mm`` with group *ends*)::

    x_MK      rows of group g are x_MK[offs[g-1]:offs[g]]  (offs[-1] := 0), any strides
    w_EKN     w_EKN[g] is group g's [K, N] matrix, any strides; a transposed view
              ``w_ENK.transpose(-2, -1)`` of nn.Linear-style weights works as is
    offs_E    int32 group ends, non-decreasing; offs[-1] may be < M (padding rows)

    grouped_mm(x_MK, w_EKN, offs_E)        -> out_MN,  out[rows of g] = x[rows of g] @ w[g],
                                              rows at or past offs[-1] are zero
    grouped_mm_wgrad(x_MK, dy_MN, offs_E)  -> dw_EKN,  dw[g] = x[rows of g]^T @ dy[rows of g],
                                              zero for empty groups

Accumulation is fp32 for fp16 / bf16 / fp32 inputs. fp32 operands use IEEE products unless
``torch.backends.cuda.matmul.allow_tf32`` is set. K and N need no alignment: every load is
masked.

Why persistent: the group sizes live on the device (``offs`` comes out of the router's
histogram), so the host cannot know how many output tiles there are without a sync. Instead
the launcher starts one program per SM (fewer when the shapes bound the tile count lower) and
every program walks the same flat tile space: group 0's tiles, then group 1's, ..., then the
tiles of the padding rows past ``offs[-1]``, which are written with zeros. Program ``pid``
takes tiles ``pid, pid + P, pid + 2P, ...``; each group's tile count is computed on the device
from ``offs``, so launching never reads ``offs`` on the host (no ``.item()``, no
``.tolist()``), and the launch is CUDA-graph and ``torch.compile`` friendly. Empty groups
cost one scalar load per program.

The wgrad tile space is static (E x K-tiles x N-tiles, a host-known count); only each tile's
reduction length (the rows of its group) is read from ``offs`` on the device.

NB: ``offs`` is not validated on the device. Out-of-order or out-of-range ends are clamped
(group g is ``[clamp(offs[g-1]), clamp(offs[g])]`` inside ``[0, M]``) so a bad ``offs`` gives
wrong numbers but never an out-of-bounds access. The ops layer checks ``offs`` where it can.

On CPU tensors (and under ``TRITON_INTERPRET=1``) the launchers run the kernels in Triton's
interpreter with small blocks; that is how the kernels are tested without a GPU. The
interpreter's bf16 ``tl.dot`` is broken in triton 3.9, so interpreted bf16 upcasts operands
to fp32 before the dot. ``compile_for_sm90`` builds the kernels for Hopper without a GPU
(PTX, cubin, registers, spills) for static checks.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import tempfile
import types
from typing import Any, Literal

import torch
import triton
import triton.language as tl

from torch_moe._ops._dtypes import KERNEL_DTYPES

__all__ = [
    "Sm90Kernel",
    "compile_for_sm90",
    "compile_jit_for_sm90",
    "grouped_mm",
    "grouped_mm_wgrad",
]


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------

# NB: the kernels avoid triton.language helpers that are themselves @triton.jit functions
# (tl.cdiv, tl.zeros, tl.sum, ...: see [n for n in dir(tl) if isinstance(getattr(tl, n),
# triton.JITFunction)]). The launchers run these kernels in the interpreter for CPU tensors
# even when triton was imported without TRITON_INTERPRET=1 (_interpreted), and such helpers
# then raise "Cannot call @triton.jit'd outside of the scope of a kernel".


# Pieces shared with the scaled (FP8) kernels in torch_moe/_triton/scaled_grouped_mm.py.


@triton.jit
def _group_bounds(offs_ptr, g, M):
    """Rows ``[start, end)`` of group g, clamped into [0, M] (see NB in the module docstring)."""
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    start = tl.minimum(tl.maximum(start, 0), M)
    end = tl.minimum(tl.maximum(tl.load(offs_ptr + g), start), M)
    return start, end


@triton.jit
def _wgrad_tile(tile, tiles_per_group, tiles_n, arange_k, arange_n, K, N,
                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """A wgrad kernel's flat tile index = (g, tile_k, tile_n), tile_n fastest (programs
    running at the same time share group g's rows in L2) -> g, the tile's K rows and N
    columns of the output, and their masks."""
    g = tile // tiles_per_group
    tile_kn = tile % tiles_per_group
    ks = (tile_kn // tiles_n) * BLOCK_K + arange_k
    ns = (tile_kn % tiles_n) * BLOCK_N + arange_n
    return g, ks, ns, ks < K, ns < N


@triton.jit
def _zero_tail(
    out_ptr, start, M, N, tile_base, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Zeros in the padding rows [start, M) of a persistent forward's output, continuing its
    flat tile numbering after the ``tile_base`` tiles of the groups."""
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    tiles_tail = ((M - start + BLOCK_M - 1) // BLOCK_M) * tiles_n
    first = (pid + num_progs - tile_base % num_progs) % num_progs
    zeros = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=out_ptr.dtype.element_ty)
    for t in tl.range(first, tiles_tail, num_progs):
        rows = start + (t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(o_ptrs, zeros, mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _grouped_mm_fwd_kernel(
    x_ptr,  # *T [M, K]: rows sorted by group
    w_ptr,  # *T [E, K, N]: one [K, N] matrix per group
    out_ptr,  # *T [M, N]: written everywhere (rows past offs[E-1] get zeros)
    offs_ptr,  # *i32 [E]: group ends
    M,  # rows of x and out
    N,  # columns of w and out
    K,  # reduction length
    E,  # number of groups
    stride_xm,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    stride_om,
    stride_on,
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32"; read only for fp32 operands
    DOT_FP32: tl.constexpr,  # upcast operands to fp32 before tl.dot (interpreter bf16)
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

    # Walk the groups in order. `tile_base` counts the tiles of all earlier groups, so the
    # flat index of local tile t of group g is tile_base + t, owned by program
    # (tile_base + t) % num_progs: this program's first local tile is `first`.
    tile_base = 0
    start = 0  # first row of group g (the clamped end of group g - 1)
    w_g_ptr = w_ptr  # w[g]
    for g in tl.range(0, E):
        end = tl.load(offs_ptr + g)
        end = tl.minimum(tl.maximum(end, start), M)
        tiles_g = ((end - start + BLOCK_M - 1) // BLOCK_M) * tiles_n
        first = (pid + num_progs - tile_base % num_progs) % num_progs
        for t in tl.range(first, tiles_g, num_progs):
            tile_m = t // tiles_n
            tile_n = t % tiles_n
            rows = start + tile_m * BLOCK_M + arange_m
            cols = tile_n * BLOCK_N + arange_n
            row_mask = rows < end
            col_mask = cols < N
            # int64 row offsets: M * K can pass 2**31 for long sequences.
            a_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + arange_k[None, :] * stride_xk
            b_ptrs = w_g_ptr + arange_k[:, None] * stride_wk + cols[None, :] * stride_wn
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
            for k0 in tl.range(0, K, BLOCK_K):
                k_mask = arange_k < K - k0
                a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                if DOT_FP32:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
                a_ptrs += BLOCK_K * stride_xk
                b_ptrs += BLOCK_K * stride_wk
            o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
            o_mask = row_mask[:, None] & col_mask[None, :]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
        tile_base += tiles_g
        start = end
        w_g_ptr += stride_we

    # Padding rows [start, M): zeros, continuing the same flat tile numbering.
    _zero_tail(out_ptr, start, M, N, tile_base, stride_om, stride_on, BLOCK_M, BLOCK_N)


@triton.jit
def _grouped_mm_wgrad_kernel(
    x_ptr,  # *T [M, K]: rows sorted by group
    dy_ptr,  # *T [M, N]: same row order as x
    out_ptr,  # *T_out [E, K, N]: dw, written everywhere (zeros for empty groups)
    offs_ptr,  # *i32 [E]: group ends
    M,  # rows of x and dy (the reduction dimension)
    N,  # columns of dy
    K,  # columns of x
    E,  # number of groups
    stride_xm,
    stride_xk,
    stride_dym,
    stride_dyn,
    stride_oe,
    stride_ok,
    stride_on,
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32"; read only for fp32 operands
    DOT_FP32: tl.constexpr,  # upcast operands to fp32 before tl.dot (interpreter bf16)
    BLOCK_M: tl.constexpr,  # reduction step (rows per iteration)
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
        # x is read transposed: a [BLOCK_K, BLOCK_M] tile of x^T.
        rows0 = start.to(tl.int64) + arange_m
        a_ptrs = x_ptr + ks[:, None] * stride_xk + rows0[None, :] * stride_xm
        b_ptrs = dy_ptr + rows0[:, None] * stride_dym + ns[None, :] * stride_dyn
        acc = tl.full((BLOCK_K, BLOCK_N), 0.0, dtype=tl.float32)
        for m0 in tl.range(start, end, BLOCK_M):
            m_mask = arange_m < end - m0
            a = tl.load(a_ptrs, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=m_mask[:, None] & n_mask[None, :], other=0.0)
            if DOT_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_M * stride_xm
            b_ptrs += BLOCK_M * stride_dym
        o_ptrs = (
            out_ptr + g.to(tl.int64) * stride_oe + ks[:, None] * stride_ok + ns[None, :] * stride_on
        )
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])


# --------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Autotune-free defaults for sm_90 (H100 / H200), keyed by (operands, vectorized):
# operands is "16bit" (fp16 / bf16), "tf32" or "ieee" (fp32); vectorized says every loaded
# operand has a contiguous, 16-element-multiple, 16-byte-aligned last dim (_vectorized),
# so that Triton streams tiles through shared memory with cp.async. Otherwise each element
# is its own masked load staged in registers, and the big tiles spill: those shapes get
# smaller K steps or no pipelining. Every entry is checked spill-free for both w layouts by
# compile_for_sm90 in test/test_triton_grouped_mm.py (triton 3.9, ptxas for sm_90a).
# - 16-bit forward: two warpgroups of wgmma on a 128 x 128 fp32 accumulator, 3-stage
#   pipeline in 96 KiB of shared memory (~140-190 registers). 128 x 256 spills (192 bytes)
#   when w is a contiguous [E, K, N], and wastes more rows on small groups.
# - fp32 IEEE runs on FMA units, not tensor cores: 64 x 64 tiles stay under 255 registers.
_FWD_CONFIGS = {
    ("16bit", True): _Config(128, 128, 64, num_warps=8, num_stages=3),
    ("tf32", True): _Config(128, 128, 32, num_warps=8, num_stages=3),
    ("ieee", True): _Config(64, 64, 32, num_warps=4, num_stages=3),
    ("16bit", False): _Config(128, 128, 16, num_warps=8, num_stages=3),
    ("tf32", False): _Config(128, 128, 32, num_warps=8, num_stages=1),
    ("ieee", False): _Config(128, 128, 32, num_warps=8, num_stages=1),
}
# wgrad: a BLOCK_K x BLOCK_N tile of dw, BLOCK_M rows reduced per step.
_WGRAD_CONFIGS = {
    ("16bit", True): _Config(64, 128, 128, num_warps=8, num_stages=3),
    ("tf32", True): _Config(32, 128, 128, num_warps=8, num_stages=3),
    ("ieee", True): _Config(32, 128, 128, num_warps=8, num_stages=3),
    ("16bit", False): _Config(32, 64, 64, num_warps=4, num_stages=3),
    ("tf32", False): _Config(32, 64, 64, num_warps=4, num_stages=3),
    ("ieee", False): _Config(32, 64, 64, num_warps=4, num_stages=3),
}
# The interpreter runs programs one after the other in numpy: small blocks keep tests fast,
# and a few programs (3: not a divisor of typical tile counts) exercise the persistent walk.
_INTERPRET_CONFIG = _Config(16, 16, 16, num_warps=1, num_stages=1)
_INTERPRET_PROGRAMS = 3

_DTYPES = KERNEL_DTYPES
_TL_DTYPE = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
}


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------


def _interpret_env() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _use_interpreter(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" or _interpret_env()


@functools.cache
def _interpreted(kernel: Any) -> Any:
    # Triton picks interpreter vs compiler when @triton.jit runs (at import), so a module
    # imported without TRITON_INTERPRET=1 holds JITFunctions. Wrap the same Python function
    # for the interpreter on demand: CPU tensors then work whatever the import order was.
    # @triton.jit helpers the kernel calls are looked up in its globals: rebind them to
    # interpreted copies too (one level: helpers call only triton.language).
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    fn = kernel.fn
    helpers = {
        name: InterpretedFunction(value.fn)
        for name, value in fn.__globals__.items()
        if isinstance(value, triton.runtime.JITFunction) and value is not kernel
    }
    if helpers:
        rebound = types.FunctionType(
            fn.__code__, {**fn.__globals__, **helpers}, fn.__name__, fn.__defaults__
        )
        rebound.__module__, rebound.__qualname__ = fn.__module__, fn.__qualname__
        fn = rebound
    return InterpretedFunction(fn)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _max_programs(t: torch.Tensor, interpret: bool) -> int:
    if interpret:
        return _INTERPRET_PROGRAMS
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


def _input_precision(dtype: torch.dtype, allow_tf32: bool | None = None) -> str:
    # tl.dot reads input_precision only for fp32 operands; 16-bit ones get "tf32" (default).
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    return "ieee" if dtype == torch.float32 and not allow_tf32 else "tf32"


def _vectorized(t: torch.Tensor) -> bool:
    # Last dim contiguous with a 16-multiple extent (its load mask is then constant over 16
    # elements), other strides 16-multiples, base 16-byte aligned. Meta tensors (used by
    # compile_for_sm90) count as aligned. A False only picks a slower config.
    return (
        t.stride(-1) == 1
        and t.shape[-1] % 16 == 0
        and all(s % 16 == 0 for s in t.stride()[:-1])
        and (t.device.type == "meta" or t.data_ptr() % 16 == 0)
    )


def _fwd_config(x: torch.Tensor, w: torch.Tensor, precision: str) -> _Config:
    operands = precision if x.dtype == torch.float32 else "16bit"
    w_ok = _vectorized(w) or _vectorized(w.transpose(-2, -1))  # [E, K, N] or [E, N, K]
    return _FWD_CONFIGS[(operands, _vectorized(x) and w_ok)]


def _wgrad_config(x: torch.Tensor, dy: torch.Tensor, precision: str) -> _Config:
    operands = precision if x.dtype == torch.float32 else "16bit"
    return _WGRAD_CONFIGS[(operands, _vectorized(x) and _vectorized(dy))]


def _fmt(t: torch.Tensor) -> str:
    return f"{t.dim()}D {t.dtype}"


def _check_device(fn: str, name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{fn}: expected {name} on {ref.device} (like x), got {t.device}")


def _check_common(fn: str, x: torch.Tensor, offs: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"{fn}: expected x to be 2D float16, bfloat16 or float32, got {_fmt(x)}")
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{fn}: expected x on a cuda device (or cpu: interpreter), got {x.device}")
    if offs.dim() != 1 or offs.dtype != torch.int32:
        raise ValueError(f"{fn}: expected offs to be 1D int32, got {_fmt(offs)}")
    if offs.numel() == 0:
        raise ValueError(
            f"{fn}: expected at least one group, got offs of shape {tuple(offs.shape)}"
        )
    _check_device(fn, "offs", offs, x)


def _check_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out: torch.Tensor | None
) -> None:
    fn = "grouped_mm"
    _check_common(fn, x, offs)
    if w.dim() != 3 or w.dtype != x.dtype:
        raise ValueError(f"{fn}: expected w to be 3D {x.dtype} (like x), got {_fmt(w)}")
    _check_device(fn, "w", w, x)
    if w.shape[1] != x.shape[1]:
        raise ValueError(
            f"{fn}: expected w.shape[1] == x.shape[1] (K), got w {tuple(w.shape)} "
            f"and x {tuple(x.shape)}"
        )
    if offs.shape[0] != w.shape[0]:
        raise ValueError(
            f"{fn}: expected offs to have one end per group (w.shape[0] = {w.shape[0]}), "
            f"got {offs.shape[0]}"
        )
    if out is not None:
        shape = (x.shape[0], w.shape[2])
        if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(
                f"{fn}: expected out of shape {shape}, dtype {x.dtype} on {x.device}, got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )


def _fwd_args(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, offs: torch.Tensor) -> list:
    # Runtime arguments of _grouped_mm_fwd_kernel in order (shared with compile_for_sm90).
    M, K = x.shape
    E, _, N = w.shape
    return [
        x, w, out, offs, M, N, K, E,
        x.stride(0), x.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
    ]  # fmt: skip


def grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[rows of g] = x[rows of g] @ w[g]``; rows at or past ``offs[-1]`` are zero.

    x: [M, K]; w: [E, K, N] (any strides); offs: int32 [E] group ends. Returns [M, N] in
    x.dtype (written into ``out`` when given). Never syncs with the host.
    """
    _check_grouped_mm(x, w, offs, out)
    M = x.shape[0]
    E, _, N = w.shape
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    interpret = _use_interpreter(x)
    precision = _input_precision(x.dtype)
    cfg = _INTERPRET_CONFIG if interpret else _fwd_config(x, w, precision)
    # Each of the E groups and the padding rows add at most one partial row-block.
    max_tiles = (triton.cdiv(M, cfg.block_m) + E + 1) * triton.cdiv(N, cfg.block_n)
    grid = (min(_max_programs(x, interpret), max_tiles),)
    kernel = _interpreted(_grouped_mm_fwd_kernel) if interpret else _grouped_mm_fwd_kernel
    kernel[grid](
        *_fwd_args(x, w, out, offs),
        INPUT_PRECISION=precision,
        DOT_FP32=interpret and x.dtype == torch.bfloat16,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def _check_grouped_mm_wgrad(
    x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype
) -> None:
    fn = "grouped_mm_wgrad"
    _check_common(fn, x, offs)
    if dy.dim() != 2 or dy.dtype != x.dtype:
        raise ValueError(f"{fn}: expected dy to be 2D {x.dtype} (like x), got {_fmt(dy)}")
    _check_device(fn, "dy", dy, x)
    if dy.shape[0] != x.shape[0]:
        raise ValueError(
            f"{fn}: expected dy.shape[0] == x.shape[0] (M), got dy {tuple(dy.shape)} "
            f"and x {tuple(x.shape)}"
        )
    if out_dtype not in _DTYPES:
        raise ValueError(
            f"{fn}: expected out_dtype to be float16, bfloat16 or float32, got {out_dtype}"
        )


def _wgrad_args(x: torch.Tensor, dy: torch.Tensor, out: torch.Tensor, offs: torch.Tensor) -> list:
    # Runtime arguments of _grouped_mm_wgrad_kernel in order (shared with compile_for_sm90).
    M, K = x.shape
    E, _, N = out.shape
    return [
        x, dy, out, offs, M, N, K, E,
        x.stride(0), x.stride(1),
        dy.stride(0), dy.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
    ]  # fmt: skip


def grouped_mm_wgrad(
    x: torch.Tensor,
    dy: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``out[g] = x[rows of g]^T @ dy[rows of g]`` (fp32 accumulation; zero for empty groups).

    x: [M, K]; dy: [M, N] (any strides); offs: int32 [E] group ends. Returns [E, K, N] in
    ``out_dtype`` (default x.dtype). Never syncs with the host.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _check_grouped_mm_wgrad(x, dy, offs, out_dtype)
    K = x.shape[1]
    N = dy.shape[1]
    E = offs.shape[0]
    out = torch.empty((E, K, N), dtype=out_dtype, device=x.device)
    if K == 0 or N == 0:
        return out
    interpret = _use_interpreter(x)
    precision = _input_precision(x.dtype)
    cfg = _INTERPRET_CONFIG if interpret else _wgrad_config(x, dy, precision)
    tiles = E * triton.cdiv(K, cfg.block_k) * triton.cdiv(N, cfg.block_n)
    grid = (min(_max_programs(x, interpret), tiles),)
    kernel = _interpreted(_grouped_mm_wgrad_kernel) if interpret else _grouped_mm_wgrad_kernel
    kernel[grid](
        *_wgrad_args(x, dy, out, offs),
        INPUT_PRECISION=precision,
        DOT_FP32=interpret and x.dtype == torch.bfloat16,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


# --------------------------------------------------------------------------------------
# Static checks: build for sm_90 without a GPU
# --------------------------------------------------------------------------------------


# shared memory one sm_90 (H100 / H200) thread block may opt in to: 227 KiB; a kernel
# compiled for more fails at launch (Triton's OutOfResources)
SM90_MAX_SHARED = 232448


@dataclasses.dataclass
class Sm90Kernel:
    """A kernel compiled for sm_90a, with ptxas's resource report."""

    name: str
    config: _Config  # the launcher's config for these arguments
    compiled: Any  # triton.compiler.CompiledKernel
    n_regs: int  # registers per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    shared: int  # bytes of shared memory (static + dynamic, from Triton's metadata)
    ptxas_log: str

    @property
    def asm(self) -> dict[str, Any]:
        return self.compiled.asm

    @property
    def n_spills(self) -> int:
        return self.spill_stores + self.spill_loads


def _specialize(value: Any) -> tuple[str, Any, bool]:
    # Mirrors the JIT launcher's argument specialization: tensors become pointers, ints
    # equal to 1 become constexprs, pointers and ints divisible by 16 get tt.divisibility.
    # Returns (signature type, constexpr value or None, divisible by 16).
    if isinstance(value, torch.Tensor):
        ty = "*" + _TL_DTYPE[value.dtype]
        return ty, None, True  # fresh allocations are 16-byte aligned
    if isinstance(value, int):
        if value == 1:
            return "constexpr", 1, False
        ty = "i32" if -(2**31) <= value < 2**31 else "i64"
        return ty, None, value % 16 == 0
    raise TypeError(f"cannot specialize {type(value)}")


def _ptxas_path() -> str | None:
    """The ptxas Triton uses for sm_90 (bundled with its nvidia backend), or None."""
    candidates = []
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        candidates.append(get_ptxas(90).path)
    except Exception:  # private API: fall back to the knobs' paths
        pass
    for name in ("ptxas_blackwell", "ptxas"):
        try:
            candidates.append(getattr(triton.knobs.nvidia, name).path)
        except Exception:
            pass
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def _ptxas_report(ptx: str, arch: str) -> str:
    path = _ptxas_path()
    if path is None:
        raise RuntimeError("compile_for_sm90: ptxas not found (triton's nvidia backend ships it)")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        # The flags Triton 3.9's nvidia backend passes (make_cubin), plus -v; older ptxas
        # may not know --regAllocOptLevel.
        cmd = [path, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(tmp, "kernel.cubin")]
        proc = subprocess.run([*cmd, "--regAllocOptLevel=2"], capture_output=True, text=True)
        if proc.returncode != 0:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return proc.stdout + proc.stderr


def compile_for_sm90(
    kernel: Literal["grouped_mm", "grouped_mm_wgrad"],
    dtype: torch.dtype,
    *,
    transposed_w: bool = True,
    allow_tf32: bool | None = None,
    M: int = 16384,
    K: int = 2048,
    N: int = 1536,
    E: int = 8,
) -> Sm90Kernel:
    """AOT-compile ``"grouped_mm"`` or ``"grouped_mm_wgrad"`` for sm_90a (no GPU needed).

    Uses the launcher's default config for ``dtype`` and specializes the arguments as the JIT
    would for contiguous inputs of the given sizes (``transposed_w``: forward w is
    ``w_ENK.transpose(-2, -1)``, the nn.Linear layout; else a contiguous [E, K, N]). fp32
    compiles as tf32 or IEEE after ``allow_tf32`` (default:
    ``torch.backends.cuda.matmul.allow_tf32``). Returns the compiled kernel
    (``.asm["ptx"]``, ``.asm["cubin"]``) with the register and spill counts ptxas reports.
    """
    fn_name = "compile_for_sm90"
    if dtype not in _DTYPES:
        raise ValueError(f"{fn_name}: expected dtype float16, bfloat16 or float32, got {dtype}")

    precision = _input_precision(dtype, allow_tf32)
    meta = functools.partial(torch.empty, device="meta")
    offs = meta(E, dtype=torch.int32)
    x = meta(M, K, dtype=dtype)
    if kernel == "grouped_mm":
        fn: Any = _grouped_mm_fwd_kernel
        if transposed_w:
            w = meta(E, N, K, dtype=dtype).transpose(-2, -1)
        else:
            w = meta(E, K, N, dtype=dtype)
        cfg = _fwd_config(x, w, precision)
        args = _fwd_args(x, w, meta(M, N, dtype=dtype), offs)
    elif kernel == "grouped_mm_wgrad":
        fn = _grouped_mm_wgrad_kernel
        dy = meta(M, N, dtype=dtype)
        cfg = _wgrad_config(x, dy, precision)
        args = _wgrad_args(x, dy, meta(E, K, N, dtype=dtype), offs)
    else:
        raise ValueError(
            f"{fn_name}: expected kernel 'grouped_mm' or 'grouped_mm_wgrad', got {kernel!r}"
        )
    meta_params = {
        "INPUT_PRECISION": precision,
        "DOT_FP32": False,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
    }
    return compile_jit_for_sm90(kernel, fn, args, meta_params, cfg)


def compile_jit_for_sm90(
    name: str, fn: Any, args: list, meta_params: dict[str, Any], cfg: Any, cc: int = 90
) -> Sm90Kernel:
    """AOT-compile the @triton.jit ``fn`` for ``args`` (meta tensors and ints, specialized as
    the JIT would) and constexprs ``meta_params`` with ``cfg.num_warps`` / ``num_stages`` for
    compute capability ``cc`` (90: sm_90a, 100: sm_100a), and read ptxas's resource report."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(fn, triton.runtime.JITFunction):  # imported under TRITON_INTERPRET=1
        fn = triton.runtime.JITFunction(fn.fn)
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, (arg_name, value) in enumerate(zip(fn.arg_names, args)):
        ty, const, div16 = _specialize(value)
        signature[arg_name] = ty
        if ty == "constexpr":
            constexprs[arg_name] = const
        elif div16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for arg_name, value in meta_params.items():
        signature[arg_name] = "constexpr"
        constexprs[arg_name] = value
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", cc, 32),
        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    )
    log = _ptxas_report(compiled.asm["ptx"], f"sm_{cc}a")
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"compile_jit_for_sm90: could not parse the ptxas report:\n{log}")
    return Sm90Kernel(
        name=name,
        config=cfg,
        compiled=compiled,
        n_regs=int(regs.group(1)),
        spill_stores=int(spills.group(1)),
        spill_loads=int(spills.group(2)),
        shared=int(getattr(compiled.metadata, "shared", 0)),
        ptxas_log=log,
    )
