"""Triton FP8 / MXFP8 quantize kernels (the GPU side of :mod:`torch_moe.quantization.quantize`).

Legend: B batch (experts), R rows, C columns, M tokens, N columns, G block extent.

Two kernels, each the same function as its plain-PyTorch reference, bit for bit:

- ``quantize_blocks(x [B, R, C] or [R, C], block=(SR, SC), fmt)``: one scale per SR x SC
  block of the last two dims (zero-padded partial blocks). FP8 rowwise is ``(1, C)``,
  columnwise ``(R, 1)``, activations ``(1, 128)``, weights ``(128, 128)``; MX is ``(1, 32)``
  along the last dim or ``(32, 1)`` along the rows, with E8M0 scales (``"floor"`` or
  ``"rceil"``). The output ``q`` is written into any layout the caller allocates (``out=``):
  the scaled GEMMs want their operands K-major (the reduction dim contiguous), the layout
  Hopper's FP8 ``wgmma`` reads.
- ``quantize_jagged(x [M, N], offs, block=G)``: per column, blocks of G rows restarting at
  every group end (the wgrad operands), G = -1 one block per group; same scale layout as
  the reference (:func:`torch_moe.quantization.quantize.jagged_block_index`). The block
  table (first and last row of every scale row) is built with a few tiny device ops, no
  host sync.

Each program owns whole blocks: it reduces |x| over its blocks (two passes over the rows
for jagged blocks longer than one tile), computes the scale exactly as the reference
(``amax / 448`` with IEEE division, or the E8M0 exponent from the fp32 bits) and writes q.

Rounding to e4m3: compiled kernels use the hardware's round-to-nearest-even conversion.
Triton 3.9's interpreter rounds fp32 -> e4m3 wrongly when the mantissa carries into the
exponent (31.5 -> 16), so interpreted kernels (``EMULATE_CVT``) first round to the e4m3 grid
in fp32 (exact: the grid spacing is a power of two) and the conversion is then exact.

NB: like the reference, inputs must be finite.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton
import triton.language as tl

from torch_moe._ops._dtypes import KERNEL_DTYPES
from torch_moe._triton.grouped_mm import _interpreted, _use_interpreter
from torch_moe.quantization.quantize import jagged_num_blocks

__all__ = [
    "MAX_BLOCK_ELEMS",
    "compile_for_sm90",
    "jagged_block_table",
    "quantize_blocks",
    "quantize_jagged",
    "supports",
]

_FMT_CODES = {"fp8": 0, "mx_floor": 1, "mx_rceil": 2}
_FP8 = torch.float8_e4m3fn
_IN_DTYPES = KERNEL_DTYPES
# One program reduces a whole block in registers; whole-tensor and long columnwise blocks
# (tensorwise scales, columnwise over many rows) go through the reference's torch ops.
MAX_BLOCK_ELEMS = 16384
# Elements per program and warps of the blocks kernel on the GPU (H200: see bench_quant.py).
BLOCKS_BUDGET = 4096
BLOCKS_WARPS = 4
# (block rows, block cols) -> (tile rows, tile cols) measured faster than the budget's tile
BLOCKS_TILES: dict[tuple[int, int], tuple[int, int]] = {}
JAGGED_TILE_N = 64
JAGGED_WARPS = 4


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------
# NB: no calls to triton.language's own @triton.jit helpers (tl.max, tl.cdiv, ...): see the
# note in torch_moe/_triton/grouped_mm.py (this module's helpers are rebound by _interpreted).
# Reductions call the builtin tl.reduce with the standard combine function, which the
# interpreter maps to numpy.


@triton.jit
def _block_scale(amax, FMT: tl.constexpr, SCALE_U8: tl.constexpr):
    """(fp32 scale, stored scale) of blocks with max |x| ``amax`` (see the references)."""
    if FMT == 0:
        scale = tl.math.div_rn(amax, 448.0)
        scale = tl.where(scale > 0.0, scale, 1.0)
        s_out = scale
    else:
        bits = amax.to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        e = biased - 135  # floor(log2(amax)) - 8
        if FMT == 2:
            e += ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        e = tl.where(biased == 0, -127, e)
        e = tl.minimum(tl.maximum(e, -127), 127)
        scale = tl.where(e >= -126, (e + 127) << 23, 1 << 22).to(tl.float32, bitcast=True)
        if SCALE_U8:
            s_out = (e + 127).to(tl.uint8)
        else:
            s_out = scale
    return scale, s_out


@triton.jit
def _to_e4m3(y, EMULATE_CVT: tl.constexpr):
    """Saturating round-to-nearest-even fp32 -> e4m3 (see the module docstring)."""
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if EMULATE_CVT:  # round to the e4m3 grid in fp32 first: the conversion is then exact
        ybits = y.to(tl.int32, bitcast=True)
        ulp_e = tl.maximum(((ybits >> 23) & 0xFF) - 127, -6) - 3
        ulp = ((ulp_e + 127) << 23).to(tl.float32, bitcast=True)
        t = y / ulp
        rt = (t + 12582912.0) - 12582912.0  # round half to even for |t| < 2^22
        y = tl.where(rt == 0.0, t * 0.0, rt) * ulp  # keep the sign of zero
    return y.to(tl.float8e4nv)


@triton.jit
def _quantize_blocks_kernel(
    x_ptr,  # *T [B, R, C]
    q_ptr,  # *fp8 [B, R, C], any strides
    s_ptr,  # *fp32 or *u8 [B, ceil(R/SR), ceil(C/SC)], any strides
    R,
    C,
    stride_xb,
    stride_xr,
    stride_xc,
    stride_qb,
    stride_qr,
    stride_qc,
    stride_sb,
    stride_sr,
    stride_sc,
    SR: tl.constexpr,  # block rows
    SC: tl.constexpr,  # block cols
    TILE_R: tl.constexpr,  # multiple of SR
    TILE_C: tl.constexpr,  # multiple of SC
    FMT: tl.constexpr,  # 0 fp8 (fp32 scale), 1 MX floor, 2 MX rceil
    SCALE_U8: tl.constexpr,  # MX: store biased exponents instead of fp32 powers of two
    EMULATE_CVT: tl.constexpr,
    GIVEN_SCALE: tl.constexpr,  # read one fp32 scale per batch from s_ptr (tensorwise)
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    tiles_c = (C + TILE_C - 1) // TILE_C
    r0 = (pid // tiles_c) * TILE_R
    c0 = (pid % tiles_c) * TILE_C
    rows = r0 + tl.arange(0, TILE_R)
    cols = c0 + tl.arange(0, TILE_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x_ptrs = (
        x_ptr + b * stride_xb + rows.to(tl.int64)[:, None] * stride_xr + cols[None, :] * stride_xc
    )
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)

    if GIVEN_SCALE:
        y = tl.math.div_rn(x, tl.load(s_ptr + b * stride_sb))
    else:
        # amax of every SR x SC block of the tile: [TILE_R // SR, TILE_C // SC]
        x4 = tl.reshape(tl.abs(x), (TILE_R // SR, SR, TILE_C // SC, SC))
        amax = tl.reduce(x4, 3, tl.standard._elementwise_max)
        amax = tl.reduce(amax, 1, tl.standard._elementwise_max)
        scale, s_out = _block_scale(amax, FMT, SCALE_U8)
        br = r0 // SR + tl.arange(0, TILE_R // SR)
        bc = c0 // SC + tl.arange(0, TILE_C // SC)
        s_mask = (br < (R + SR - 1) // SR)[:, None] & (bc < (C + SC - 1) // SC)[None, :]
        s_ptrs = s_ptr + b * stride_sb + br[:, None] * stride_sr + bc[None, :] * stride_sc
        tl.store(s_ptrs, s_out, mask=s_mask)

        scale4 = tl.reshape(scale, (TILE_R // SR, 1, TILE_C // SC, 1))
        y4 = tl.reshape(x, (TILE_R // SR, SR, TILE_C // SC, SC))
        y = tl.reshape(tl.math.div_rn(y4, scale4), (TILE_R, TILE_C))
    y = _to_e4m3(y, EMULATE_CVT)
    q_ptrs = (
        q_ptr + b * stride_qb + rows.to(tl.int64)[:, None] * stride_qr + cols[None, :] * stride_qc
    )
    tl.store(q_ptrs, y, mask=mask)


@triton.jit
def _quantize_jagged_kernel(
    x_ptr,  # *T [M, N]
    q_ptr,  # *fp8 [M, N], any strides
    s_ptr,  # *fp32 or *u8 [NB, N]
    first_ptr,  # *i32 [NB]: first row of every scale row (block)
    last_ptr,  # *i32 [NB]: one past its last row (== first for unused scale rows)
    N,
    stride_xm,
    stride_xn,
    stride_qm,
    stride_qn,
    stride_sb,
    stride_sn,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    FMT: tl.constexpr,
    SCALE_U8: tl.constexpr,
    EMULATE_CVT: tl.constexpr,
    SLOTS: tl.constexpr,  # write block j to rows [j * TILE_M, (j + 1) * TILE_M), zero-padded
):
    blk = tl.program_id(0)
    cols = tl.program_id(1) * TILE_N + tl.arange(0, TILE_N)
    col_mask = cols < N
    start = tl.load(first_ptr + blk)
    end = tl.load(last_ptr + blk)
    arange_m = tl.arange(0, TILE_M)

    amax = tl.full((TILE_N,), 0.0, dtype=tl.float32)
    for m0 in tl.range(start, end, TILE_M):
        rows = m0 + arange_m
        mask = (rows < end)[:, None] & col_mask[None, :]
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xn
        x = tl.abs(tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32))
        amax = tl.maximum(amax, tl.reduce(x, 0, tl.standard._elementwise_max))
    scale, s_out = _block_scale(amax, FMT, SCALE_U8)
    tl.store(s_ptr + blk.to(tl.int64) * stride_sb + cols * stride_sn, s_out, mask=col_mask)

    # SLOTS: one tile per block (TILE_M == block rows); rows past the block's end are zeros.
    for m0 in tl.range(start, start + TILE_M if SLOTS else end, TILE_M):
        rows = m0 + arange_m
        mask = (rows < end)[:, None] & col_mask[None, :]
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xn
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        y = tl.math.div_rn(x, scale[None, :])
        y = _to_e4m3(y, EMULATE_CVT)
        if SLOTS:
            q_rows = blk.to(tl.int64) * TILE_M + arange_m
            q_ptrs = q_ptr + q_rows[:, None] * stride_qm + cols[None, :] * stride_qn
            tl.store(q_ptrs, y, mask=col_mask[None, :])
        else:
            q_ptrs = q_ptr + rows.to(tl.int64)[:, None] * stride_qm + cols[None, :] * stride_qn
            tl.store(q_ptrs, y, mask=mask)


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------


def _fmt_code(fmt: str, scale_rule: str) -> int:
    key = "fp8" if fmt == "fp8" else f"mx_{scale_rule}"
    if fmt not in ("fp8", "mx") or key not in _FMT_CODES:
        raise ValueError(
            f"quantize: fmt must be 'fp8' or 'mx' and scale_rule 'floor' or 'rceil', got "
            f"fmt={fmt!r}, scale_rule={scale_rule!r}"
        )
    return _FMT_CODES[key]


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def supports(x: torch.Tensor, block: tuple[int, int], fmt: str = "fp8") -> bool:
    """Whether :func:`quantize_blocks` takes x with ``block`` (else use the reference's ops):
    2D / 3D float input, and a block that fits one program (power-of-two extents, or the
    whole dim), or an FP8 block spanning the whole matrix (per-tensor scale)."""
    if x.dim() not in (2, 3) or x.dtype not in _IN_DTYPES:
        return False
    r, c = x.shape[-2:]
    sr = max(r, 1) if block[0] == -1 else block[0]
    sc = max(c, 1) if block[1] == -1 else block[1]
    if sr >= r and sc >= c and fmt == "fp8":
        return True
    shape_ok = (_pow2(sr) == sr or sr >= r) and (_pow2(sc) == sc or sc >= c)
    return shape_ok and _pow2(sr) * _pow2(sc) <= MAX_BLOCK_ELEMS


def _tile(extent: int, block: int, budget: int) -> int:
    """A power-of-two tile extent that holds whole blocks: ``block`` times a power of two."""
    if block >= extent:
        return block
    return block * max(1, min(_pow2(-(-extent // block)), budget // block))


@dataclasses.dataclass
class _Launch:
    """One kernel launch as a launcher plans it: run it, or AOT-compile it (compile_for_sm90)."""

    kernel: Any  # the @triton.jit kernel
    grid: tuple[int, ...]
    args: list
    meta: dict[str, Any]
    num_warps: int
    interpret: bool

    def run(self) -> None:
        kernel = _interpreted(self.kernel) if self.interpret else self.kernel
        kernel[self.grid](*self.args, **self.meta, num_warps=self.num_warps)


def _check_x(fn: str, x: torch.Tensor, dims: tuple[int, ...]) -> None:
    if x.dtype not in _IN_DTYPES or x.dim() not in dims:
        raise ValueError(
            f"{fn}: expected x to be {' or '.join(f'{d}D' for d in dims)} float32, bfloat16 or "
            f"float16, got {x.dim()}D {x.dtype}"
        )


def quantize_blocks(
    x: torch.Tensor,
    block: tuple[int, int],
    *,
    fmt: str = "fp8",
    scale_rule: str = "floor",
    scale_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with one scale per ``block = (rows, cols)`` of x's last two dims.

    Equals :func:`torch_moe.quantization.quantize.quantize_fp8` (``fmt="fp8"``, block dims
    may be -1 = whole dim) and :func:`~torch_moe.quantization.quantize.quantize_mx` with
    ``dim=-1`` (block ``(1, G)``) or ``dim=-2`` (block ``(G, 1)``), bit for bit. ``out``
    (float8_e4m3fn, x's shape, any strides) receives q, e.g. a K-major layout for a GEMM.
    """
    out, scale, launch = _plan_blocks(x, block, fmt, scale_rule, scale_dtype, out)
    if launch is not None:
        launch.run()
    return out, scale


def _plan_blocks(
    x: torch.Tensor,
    block: tuple[int, int],
    fmt: str,
    scale_rule: str,
    scale_dtype: torch.dtype,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, _Launch | None]:
    """quantize_blocks' checks, outputs and launch (None: nothing to launch)."""
    fn = "quantize_blocks"
    _check_x(fn, x, (2, 3))
    code = _fmt_code(fmt, scale_rule)
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    nb, r, c = x3.shape
    sr = max(r, 1) if block[0] == -1 else block[0]
    sc = max(c, 1) if block[1] == -1 else block[1]
    if sr < 1 or sc < 1:
        raise ValueError(f"{fn}: block must be positive or -1, got {block}")
    if code and (r % sr or c % sc):
        raise ValueError(
            f"{fn}: MX blocks must tile x exactly, got x {list(x.shape)} and block {block}"
        )
    # Partial blocks are zero-padded: a block extent rounds up to a power of two.
    psr, psc = _pow2(sr), _pow2(sc)
    given_scale = psr * psc > MAX_BLOCK_ELEMS and sr >= r and sc >= c and not code
    if given_scale:  # one scale per matrix: amax with torch, then one pass of the kernel
        amax = x3.abs().amax(dim=(-2, -1), keepdim=True).float()
        given = amax / amax.new_full((), 448.0)
        given = torch.where(given > 0, given, torch.ones_like(given))
        psr, psc = 1, 1
    elif psr * psc > MAX_BLOCK_ELEMS:
        raise ValueError(
            f"{fn}: a block of {sr} x {sc} elements is too large for one program (at most "
            f"{MAX_BLOCK_ELEMS}); quantize it with the reference (torch ops)"
        )
    if (psr != sr and -(-r // sr) > 1) or (psc != sc and -(-c // sc) > 1):
        raise ValueError(
            f"{fn}: blocks that are not powers of two must span the whole dim, got block "
            f"{block} for x {list(x.shape)}"
        )
    if out is None:
        out = torch.empty(x.shape, dtype=_FP8, device=x.device)
    if out.shape != x.shape or out.dtype != _FP8 or out.device != x.device:
        raise ValueError(
            f"{fn}: expected out to be float8_e4m3fn of shape {list(x.shape)} on {x.device}, "
            f"got {out.dtype} {list(out.shape)} on {out.device}"
        )
    s_dtype = torch.uint8 if code and scale_dtype == torch.uint8 else torch.float32
    if given_scale:
        scale = given
    else:
        scale = torch.empty((nb, -(-r // sr), -(-c // sc)), dtype=s_dtype, device=x.device)
    q3 = out if out.dim() == 3 else out.unsqueeze(0)
    scale_ret = scale if x.dim() == 3 else scale.squeeze(0)
    if x.numel() == 0:
        return out, scale_ret, None
    interpret = _use_interpreter(x) and x.device.type != "meta"
    budget = 1024 if interpret else BLOCKS_BUDGET  # elements per program
    tile_c = _tile(c, psc, max(budget // psr, psc))
    tile_r = _tile(r, psr, max(budget // tile_c, psr))
    if given_scale:
        tile_c = min(_pow2(c), 128 if interpret else 256)
        tile_r = max(1, budget // tile_c)
    elif not interpret and (psr, psc) in BLOCKS_TILES:
        tile_r, tile_c = BLOCKS_TILES[(psr, psc)]
    grid = (triton.cdiv(r, tile_r) * triton.cdiv(c, tile_c), nb)
    args = [x3, q3, scale, r, c, *x3.stride(), *q3.stride(), *scale.stride()]
    meta = dict(
        SR=psr, SC=psc, TILE_R=tile_r, TILE_C=tile_c, FMT=code,
        SCALE_U8=s_dtype == torch.uint8, EMULATE_CVT=interpret, GIVEN_SCALE=given_scale,
    )  # fmt: skip
    launch = _Launch(_quantize_blocks_kernel, grid, args, meta, BLOCKS_WARPS, interpret)
    return out, scale_ret, launch


def jagged_block_table(
    offs: torch.Tensor, num_rows: int, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(first [NB], last [NB], group_first_block [E + 1])`` int32, on offs's device.

    Scale row j covers rows ``[first[j], last[j])`` (empty for unused rows); group g's blocks
    are scale rows ``group_first_block[g]`` onwards (g = E: the rows past ``offs[-1]``). NB is
    the static bound of :func:`torch_moe.quantization.quantize.jagged_block_index`.
    """
    num_groups = offs.shape[0]
    ends = torch.cat([offs.long().clamp(0, num_rows), offs.new_full((1,), num_rows).long()])
    ends = torch.cummax(ends, 0).values
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    sizes = ends - starts
    bound = jagged_num_blocks(num_rows, num_groups, block)
    if block == -1:
        nblocks = (sizes > 0).long()
        step = num_rows + 1
    else:
        nblocks = (sizes + block - 1) // block
        step = block
    first_block = torch.cumsum(nblocks, 0) - nblocks
    j = torch.arange(bound, device=offs.device)
    seg = torch.searchsorted(first_block + nblocks, j, right=True).clamp(max=num_groups)
    first = starts[seg] + (j - first_block[seg]) * step
    used = j < (first_block + nblocks)[-1]
    first = torch.where(used, first, 0)
    last = torch.where(used, torch.minimum(first + step, ends[seg]), 0)
    return first.int(), last.int(), first_block.int()


def quantize_jagged(
    x: torch.Tensor,
    offs: torch.Tensor,
    *,
    block: int = 128,
    fmt: str = "fp8",
    scale_rule: str = "floor",
    scale_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    slots: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-column quantization of x [M, N] in blocks of ``block`` rows inside each group.

    Equals :func:`torch_moe.quantization.quantize.quantize_jagged` bit for bit. ``out``
    (float8_e4m3fn [M, N], any strides) receives q, e.g. ``empty(N, M).t()`` (M-major).

    ``slots=True`` (block 32 or 128) writes block j of the scale layout to rows
    ``[j * block, (j + 1) * block)`` of ``out`` [NB * block, N] instead, zero-padded: every
    block then starts on an aligned row, which the wgrad GEMM needs for wide loads along M.
    """
    out, scale, launch = _plan_jagged(x, offs, block, fmt, scale_rule, scale_dtype, out, slots)
    if launch is not None:
        launch.run()
    return out, scale


def _plan_jagged(
    x: torch.Tensor,
    offs: torch.Tensor,
    block: int,
    fmt: str,
    scale_rule: str,
    scale_dtype: torch.dtype,
    out: torch.Tensor | None,
    slots: bool,
) -> tuple[torch.Tensor, torch.Tensor, _Launch | None]:
    """quantize_jagged's checks, outputs and launch (None: nothing to launch)."""
    fn = "quantize_jagged"
    _check_x(fn, x, (2,))
    code = _fmt_code(fmt, scale_rule)
    if not isinstance(block, int) or (block < 1 and block != -1):
        raise ValueError(f"{fn}: block must be a positive int or -1, got {block!r}")
    if slots and block not in (32, 128):
        raise ValueError(f"{fn}: slots=True needs block 32 or 128, got {block}")
    m, n = x.shape
    first, last, _ = jagged_block_table(offs, m, block)
    q_shape = (first.shape[0] * block, n) if slots else (m, n)
    if out is None:
        out = torch.empty(q_shape, dtype=_FP8, device=x.device)
    if tuple(out.shape) != q_shape or out.dtype != _FP8:
        raise ValueError(
            f"{fn}: expected out to be float8_e4m3fn {list(q_shape)}, got {out.dtype} "
            f"{list(out.shape)}"
        )
    s_dtype = torch.uint8 if code and scale_dtype == torch.uint8 else torch.float32
    scale = torch.empty((first.shape[0], n), dtype=s_dtype, device=x.device)
    if scale.numel() == 0:
        return out, scale, None
    interpret = _use_interpreter(x) and x.device.type != "meta"
    tile_n = 16 if interpret else JAGGED_TILE_N
    tile_m = 32 if interpret else 128
    if block != -1:
        tile_m = min(tile_m, _pow2(block)) if interpret and not slots else _pow2(block)
    grid = (first.shape[0], triton.cdiv(n, tile_n))
    args = [x, out, scale, first, last, n, *x.stride(), *out.stride(), *scale.stride()]
    meta = dict(
        TILE_M=tile_m, TILE_N=tile_n, FMT=code,
        SCALE_U8=s_dtype == torch.uint8, EMULATE_CVT=interpret, SLOTS=slots,
    )  # fmt: skip
    return out, scale, _Launch(_quantize_jagged_kernel, grid, args, meta, JAGGED_WARPS, interpret)


@dataclasses.dataclass(frozen=True)
class _LaunchConfig:
    num_warps: int = 4
    num_stages: int = 3


def compile_for_sm90(kernel: str, *, fmt: str = "fp8", block: Any = (1, 128), M: int = 16384,
                     N: int = 7168, E: int = 32, slots: bool = False, cc: int = 90) -> Any:  # fmt: skip
    """AOT-compile the ``"blocks"`` or ``"jagged"`` quantize kernel as the launcher would run it
    on a bf16 [M, N] input (``block``: a pair for blocks, an int for jagged), without a GPU.
    Returns :class:`torch_moe._triton.grouped_mm.Sm90Kernel` (PTX, registers, spills)."""
    from torch_moe._triton.grouped_mm import compile_jit_for_sm90

    x = torch.empty(M, N, dtype=torch.bfloat16, device="meta")
    if kernel == "blocks":
        _, _, launch = _plan_blocks(x, block, fmt, "floor", torch.float32, None)
    elif kernel == "jagged":
        offs = torch.empty(E, dtype=torch.int32, device="meta")
        nb = jagged_block_table(offs, M, block)[0].shape[0]
        q_rows = nb * block if slots else M
        out = torch.empty(N, q_rows, dtype=_FP8, device="meta").t()  # M-major, as the GEMM's
        _, _, launch = _plan_jagged(x, offs, block, fmt, "floor", torch.float32, out, slots)
    else:
        raise ValueError(f"compile_for_sm90: kernel must be 'blocks' or 'jagged', got {kernel!r}")
    assert launch is not None
    cfg = _LaunchConfig(num_warps=launch.num_warps)
    return compile_jit_for_sm90(
        f"quantize_{kernel}", launch.kernel, launch.args, launch.meta, cfg, cc=cc
    )
