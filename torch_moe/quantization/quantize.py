"""Reference FP8 / MXFP8 quantize and dequantize (plain PyTorch, the oracle for kernels).

The ``*_reference`` functions here are the oracles; the ``quantize_*_cpu`` functions are
the custom ops' (:mod:`torch_moe.quantization.ops`) CPU kernels: the same per-element
operations in chunks of ``_QUANT_CHUNK`` elements, bit for bit the references' results.
Library code calls the ops (the public ``torch_moe.quantization.quantize_fp8`` and
friends), which dispatch to these on CPU and to the Triton kernels on CUDA; only tests and
the ops' kernels call this module directly.

Legend: M rows (tokens), K / N columns, E experts (groups), B block extent.

Every quantizer returns ``(q, scale)`` with ``x ~= q.float() * scale`` (scale broadcast over
its block); elements are ``torch.float8_e4m3fn`` (max 448). The math runs in fp32 and is the
same that a GPU kernel implements:

- FP8 (``quantize_fp8``): ``scale = amax / 448`` in fp32 per block, ``q = fp8(clamp(x /
  scale, -448, 448))`` (round to nearest even, saturating). Blocks tile the last two dims;
  ``-1`` means the whole dim: ``(-1, -1)`` tensorwise (per matrix: a 3D input has one scale
  per leading index, e.g. per expert), ``(1, -1)`` rowwise, ``(-1, 1)`` columnwise,
  ``(1, 128)`` / ``(128, 128)`` DeepSeek-V3 blocks. Dims that are not a multiple of the
  block are padded internally with zeros: the last block is partial and the scale has
  ``ceil(dim / block)`` entries along that dim.
- MX (``quantize_mx``, OCP Microscaling v1.0): 32 consecutive elements along ``dim`` share an
  E8M0 scale ``2^e``. ``scale_rule="floor"`` is the spec's rule, ``e = floor(log2(amax)) -
  8`` (8 = emax of e4m3), so ``amax / 2^e`` lies in [256, 512) and values above 448 saturate;
  ``"rceil"`` rounds the scale up, ``e = ceil(log2(amax / 448))``, so nothing clips. The two
  differ exactly when the mantissa of amax is above 1.75 (``amax / 2^floor(log2 amax) >
  1.75``). ``e`` is clamped to [-127, 127]. Scales come back as ``uint8`` biased exponents
  (``e + 127``; 255, the E8M0 NaN, is never produced) or as fp32 powers of two
  (``scale_dtype=torch.float32``; 2^-127 is an fp32 subnormal, exact). The blocked dim must
  be a multiple of the block (rejected otherwise: pad the groups, e.g. ``permute(align=32)``).
- Jagged (``quantize_jagged``, for wgrad where the reduction dim is the token dim): per
  column, blocks of ``block`` rows along M restart at every group boundary given by
  ``offs`` (group ends), so no block mixes rows of two experts; ``block=-1`` is one block
  per group. Rows at or past ``offs[-1]`` form one more segment. Scales are [NB, N] with the
  static bound ``NB = (M + (E + 1) * (B - 1)) // B`` (``E + 1`` for ``block=-1``); segment
  ``s`` owns scale rows ``sum_{j<s} ceil(size_j / B)`` onwards; unused rows hold the
  all-zero-block scale.

NB: all-zero blocks get a finite scale: 1.0 for FP8 (an amax whose ``amax / 448`` underflows
to 0 in fp32 also gets 1.0, so such values quantize to 0) and ``2^-127`` (uint8 0) for MX.
Inputs must be finite (``inf`` / NaN are not checked: their blocks become NaN).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from torch_moe._ops import _native
from torch_moe._ops._dtypes import FLOAT_DTYPES
from torch_moe._ops.grouped_mm import check_offs_values

__all__ = [
    "E4M3_EMAX",
    "E8M0_BIAS",
    "FP8_E4M3_MAX",
    "MX_BLOCK",
    "check_dequantize_fp8",
    "check_dequantize_jagged",
    "check_dequantize_mx",
    "check_quantize_fp8",
    "check_quantize_jagged",
    "check_quantize_mx",
    "dequantize_fp8_reference",
    "dequantize_jagged_reference",
    "dequantize_mx_reference",
    "e8m0_to_float",
    "jagged_block_index",
    "jagged_num_blocks",
    "mx_scale_exponent",
    "quantize_fp8_reference",
    "quantize_jagged_reference",
    "quantize_mx_reference",
]

FP8_E4M3_MAX = 448.0
E4M3_EMAX = 8  # floor(log2(448))
MX_BLOCK = 32
E8M0_BIAS = 127
_FP8 = torch.float8_e4m3fn
_IN_DTYPES = FLOAT_DTYPES
_SCALE_RULES = ("floor", "rceil")


# --------------------------------------------------------------------------------------
# shared pieces


def _check_input(name: str, x: Tensor, min_dim: int = 2) -> None:
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"{name}: expected x to be one of {_IN_DTYPES}, got {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(f"{name}: expected x to have at least {min_dim} dims, got {x.dim()}D")


def _check_q(name: str, q: Tensor) -> None:
    if q.dtype != _FP8:
        raise TypeError(f"{name}: expected q to be {_FP8}, got {q.dtype}")


def _fp8_scale(amax: Tensor) -> Tensor:
    """fp32 scale ``amax / 448``; 1.0 where that is 0 (all-zero block or underflow)."""
    # NB: divide by a tensor, not a Python scalar: CUDA multiplies by the reciprocal of a
    # scalar divisor, which is not the IEEE quotient the kernels and the CPU compute.
    scale = amax.float() / amax.new_full((), FP8_E4M3_MAX, dtype=torch.float32)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _fp8_kernels(t: Tensor) -> Any:
    """The native CPU kernels' ops for the e4m3 conversions of CPU tensor ``t`` (their
    bits are ATen's: torch_moe/csrc/fp8_cpu.cpp), or None (another device, no build)."""
    if t.device.type != "cpu":
        return None
    mod = _native.kernels()
    return mod if mod is not None and hasattr(mod, "fp8_from_float") else None


def native_fp8_conversions() -> bool:
    """Whether the native kernels convert CPU e4m3 tensors here (built, with AVX2)."""
    mod = _fp8_kernels(torch.empty(0))
    return mod is not None and bool(
        mod.fp8_to_float(torch.zeros(8, dtype=_FP8), torch.empty(8, dtype=torch.float32))
    )


def _native_rule(fmt: str, scale_rule: str) -> int:
    """The native quantizer's ``rule``: 0 FP8 (fp32 scales), 1 / 2 MX "floor" / "rceil"."""
    return 0 if fmt == "fp8" else _SCALE_RULES.index(scale_rule) + 1


def _to_fp8(x_scaled: Tensor) -> Tensor:
    """Saturating cast: torch's float8_e4m3fn cast turns out-of-range values into NaN.
    Clamps ``x_scaled`` in place: callers pass a temporary. (ATen's cast: the references'.)"""
    return x_scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(_FP8)


def _to_fp8_into(out: Tensor, x_scaled: Tensor) -> None:
    """:func:`_to_fp8` into an existing e4m3 tensor (the CPU kernels' chunks): the native
    kernel's cast where it applies (ATen's bits, 8 elements a step; ``x_scaled`` then
    unchanged), else ATen's."""
    mod = _fp8_kernels(x_scaled)
    if mod is not None and mod.fp8_from_float(x_scaled, out):
        return
    out.copy_(x_scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX))


_FP8_VALUES: dict[torch.device, Tensor] = {}


def _fp8_to_float(q: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``q.to(dtype)`` (same values, same strides) for e4m3 ``q`` and ``dtype`` fp32 or bf16
    (e4m3's values are bf16 values: exact either way); on CPU through a table of the 256
    codes' fp32 values (the native kernel's where it applies, else an ``index_select``),
    several times faster than the CPU cast."""
    if q.device.type != "cpu" or q.numel() == 0:
        return q.to(dtype)
    strides, sizes = q.stride(), q.shape
    order = sorted(range(q.dim()), key=lambda d: (-strides[d], -sizes[d]))
    dense = q.permute(order)
    if not dense.is_contiguous():
        return q.to(dtype)
    mod = _fp8_kernels(q)
    if mod is not None:
        out = torch.empty(dense.shape, dtype=dtype, device=q.device)
        if mod.fp8_to_float(dense.reshape(-1), out.view(-1)):
            return out.permute([order.index(d) for d in range(q.dim())])
    if dtype != torch.float32:
        return _fp8_to_float(q).to(dtype)
    table = _FP8_VALUES.get(q.device)
    if table is None:
        codes = torch.arange(256, dtype=torch.uint8, device=q.device).view(_FP8)
        table = _FP8_VALUES.setdefault(q.device, codes.float())
    codes = dense.view(torch.uint8).reshape(-1).to(torch.int32)
    out = table.index_select(0, codes).view(dense.shape)
    return out.permute([order.index(d) for d in range(q.dim())])


def _abs_max(t: Tensor, dims: tuple[int, ...]) -> Tensor:
    """``t.abs().amax(dims)`` without the ``|t|`` temporary (for finite ``t``)."""
    return torch.maximum(t.amax(dim=dims), t.amin(dim=dims).neg_())


def _check_block(name: str, block: int, what: str = "block") -> None:
    if not isinstance(block, int) or (block < 1 and block != -1):
        raise ValueError(f"{name}: {what} must be a positive int or -1 (whole dim), got {block}")


def _extent(block: int, size: int) -> int:
    return max(size, 1) if block == -1 else block


# --------------------------------------------------------------------------------------
# FP8 with fp32 scales over 2D blocks


def check_quantize_fp8(x: Tensor, block: Sequence[int]) -> list[int]:
    """quantize_fp8's input checks (shared with the fake kernel); returns the scale shape."""
    _check_input("quantize_fp8", x)
    if len(block) != 2:
        raise ValueError(f"quantize_fp8: block must be (rows, cols), got {tuple(block)}")
    _check_block("quantize_fp8", block[0], "block[0]")
    _check_block("quantize_fp8", block[1], "block[1]")
    *lead, r, c = x.shape
    br, bc = _extent(block[0], r), _extent(block[1], c)
    return [*lead, -(-r // br), -(-c // bc)]


def quantize_fp8_reference(x: Tensor, block: tuple[int, int] = (-1, -1)) -> tuple[Tensor, Tensor]:
    r"""FP8 e4m3 with one fp32 scale per ``block`` of the last two dims (see module doc).

    Args:
        x: [..., R, C] float tensor (leading dims are batch dims, e.g. experts).
        block: ``(rows, cols)`` of a block, ``-1`` = the whole dim. Non-multiples are padded.

    Returns:
        ``(q [..., R, C] float8_e4m3fn, scale [..., ceil(R/br), ceil(C/bc)] fp32)``.
    """
    *_, nr, nc = check_quantize_fp8(x, block)
    r, c = x.shape[-2:]
    br, bc = _extent(block[0], r), _extent(block[1], c)
    xf = x.float()
    if r > 1 and c > 1 and xf.stride(-2) == 1 and xf.stride(-1) != 1:
        # column-major: quantize the row-major transpose (the same blocks, transposed), so
        # that q comes back in x's layout, as the elementwise form gives it
        q, scale = _quantize_fp8_blocks(xf.transpose(-2, -1), bc, br, nc, nr)
        return q.transpose(-2, -1), scale.transpose(-2, -1).clone(
            memory_format=torch.contiguous_format
        )
    return _quantize_fp8_blocks(xf, br, bc, nr, nc)


# elements of x converted, scaled and cast per chunk by quantize_fp8_cpu: 2 MiB of fp32,
# in the last-level cache; smaller chunks cost more in per-op overhead than they save
# (measured on a [4096, 256] bf16 x: 2^16 elements 2.6 ms, 2^19 1.3 ms, whole 1.3-1.6 ms;
# on 2^21 elements 2^19 takes 2.7-5.2 ms against 12-21 ms whole)
_QUANT_CHUNK = 2**19


def quantize_fp8_cpu(x: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """The CPU kernel of ``quantize_fp8`` (contiguous q and scale, as the op returns them):
    x converted to fp32, its blocks' absolute maxima taken, divided by its block's scale,
    clamped and cast in row chunks of ~``_QUANT_CHUNK`` elements, so that no fp32 copy of
    x is made. The same per-element operations as :func:`quantize_fp8_reference`, hence
    the same bits. Blocks that do not tile x (a dim that is not a multiple of its block,
    e.g. GPT-OSS's 2880 columns in 128-wide blocks, or a dim smaller than the block) are
    padded with zeros per chunk, which changes no block's absolute maximum, where the
    reference pads a whole fp32 copy; inputs in neither row- nor column-major layout take
    the reference."""
    *_, nr, nc = check_quantize_fp8(x, block)
    r, c = x.shape[-2:]
    br, bc = _extent(block[0], r), _extent(block[1], c)
    if x.numel():
        if x.is_contiguous():
            return _quantize_fp8_rows(x, br, bc, nr, nc)
        xt = x.transpose(-2, -1)
        if xt.is_contiguous():  # column-major: the row-major transpose's blocks, transposed
            q, scale = _quantize_fp8_rows(xt, bc, br, nc, nr)
            return q.transpose(-2, -1).contiguous(), scale.transpose(-2, -1).contiguous()
    q, scale = quantize_fp8_reference(x, block)
    return q.contiguous(), scale.contiguous()


def _quantize_fp8_rows(x: Tensor, br: int, bc: int, nr: int, nc: int) -> tuple[Tensor, Tensor]:
    """quantize_fp8_cpu on a contiguous x [..., R, C]: all matrices' rows as one where
    ``br`` divides R or exceeds it (no block straddles two matrices), matrix by matrix
    otherwise."""
    *lead, r, c = x.shape
    q = torch.empty(x.shape, dtype=_FP8, device=x.device)
    scale = torch.empty((*lead, nr, nc), dtype=torch.float32, device=x.device)
    br, bc = min(br, r), min(bc, c)  # a block past the dim holds the dim's elements alone
    if r % br == 0:
        _quantize_fp8_matrix(x.reshape(-1, c), br, bc, nc, q.view(-1, c), scale.view(-1, nc))
    else:
        for xm, qm, sm in zip(x.reshape(-1, r, c), q.view(-1, r, c), scale.view(-1, nr, nc)):
            _quantize_fp8_matrix(xm, br, bc, nc, qm, sm)
    return q, scale


def _quantize_fp8_matrix(x: Tensor, br: int, bc: int, nc: int, q: Tensor, scale: Tensor) -> None:
    """quantize_fp8_cpu on a contiguous [rows, C] x into q [rows, C] and scale
    [ceil(rows / br), nc]. The native kernel (csrc/fp8_cpu.cpp) where it applies: per block
    row, its blocks' maxima, then its codes, in registers (the same operations on each
    element, so the same bits; ~6x fewer passes over memory). Else ATen's ops: blocks of a
    chunk's rows take one pass (convert, block maxima,
    divide, clamp, cast); taller blocks (per tensor, or 128 rows past a chunk) get their
    maxima from a first pass over the chunks (a maximum of partial maxima is the maximum).
    A chunk's fp32 rows are padded with zeros to whole blocks where the blocks do not tile
    x (the last block row, the last block column)."""
    rows, c = x.shape
    mod = _fp8_kernels(x)  # the native kernel: each block row's maxima, then its codes
    if mod is not None and mod.fp8_quantize_rows(x, br, bc, q, scale):
        return
    step = max(1, _QUANT_CHUNK // c)
    pad_c = nc * bc - c

    def chunk_f32(r0: int, r1: int, whole_blocks: bool) -> Tensor:
        pad_r = -(r1 - r0) % br if whole_blocks else 0
        if pad_c or pad_r:
            return torch.nn.functional.pad(x[r0:r1].to(torch.float32), (0, pad_c, 0, pad_r))
        return x[r0:r1].to(torch.float32, copy=True)

    if br <= step:
        rc = step // br * br
        for r0 in range(0, rows, rc):
            r1 = min(rows, r0 + rc)
            xf = chunk_f32(r0, r1, True)
            blocks = xf.view(-1, br, nc, bc)
            sc = _fp8_scale(_abs_max(blocks, (1, 3)))
            scale[r0 // br : r0 // br + sc.shape[0]] = sc
            blocks.div_(sc[:, None, :, None])
            _to_fp8_into(q[r0:r1], xf[: r1 - r0, :c])
        return
    # chunks inside one block row each (step < br)
    bounds = []
    r0 = 0
    while r0 < rows:
        r1 = min(rows, r0 + step, (r0 // br + 1) * br)
        bounds.append((r0, r1))
        r0 = r1
    amax = torch.zeros(scale.shape, dtype=torch.float32, device=x.device)
    for r0, r1 in bounds:
        part = _abs_max(chunk_f32(r0, r1, False).view(r1 - r0, nc, bc), (0, 2))
        torch.maximum(amax[r0 // br], part, out=amax[r0 // br])
    scale.copy_(_fp8_scale(amax))
    for r0, r1 in bounds:
        xf = chunk_f32(r0, r1, False)
        xf.view(r1 - r0, nc, bc).div_(scale[r0 // br, None, :, None])
        _to_fp8_into(q[r0:r1], xf[:, :c])


def _quantize_fp8_blocks(xf: Tensor, br: int, bc: int, nr: int, nc: int) -> tuple[Tensor, Tensor]:
    """quantize_fp8_reference on fp32 ``xf`` [..., R, C] with ``nr x nc`` blocks of
    ``br x bc``; the scale is broadcast over each block, never repeated to full size."""
    *lead, r, c = xf.shape
    padded = xf
    if nr * br != r or nc * bc != c:
        padded = torch.nn.functional.pad(xf, (0, nc * bc - c, 0, nr * br - r))
    blocks = padded.reshape(*lead, nr, br, nc, bc)
    scale = _fp8_scale(_abs_max(blocks, (-3, -1)))
    scaled = (blocks / scale.unsqueeze(-1).unsqueeze(-3)).reshape(padded.shape)
    return _to_fp8(scaled[..., :r, :c]), scale


def _expand(scale: Tensor, br: int, bc: int, r: int, c: int) -> Tensor:
    return scale.repeat_interleave(br, dim=-2)[..., :r, :].repeat_interleave(bc, dim=-1)[..., :c]


def check_dequantize_fp8(q: Tensor, scale: Tensor, block: Sequence[int]) -> None:
    """dequantize_fp8's input checks (shared with the fake kernel)."""
    _check_q("dequantize_fp8", q)
    if q.dim() < 2:
        raise ValueError(f"dequantize_fp8: expected q to have at least 2 dims, got {q.dim()}D")
    if scale.dtype != torch.float32:
        raise TypeError(f"dequantize_fp8: expected scale to be torch.float32, got {scale.dtype}")
    if len(block) != 2:
        raise ValueError(f"dequantize_fp8: block must be (rows, cols), got {tuple(block)}")
    *lead, r, c = q.shape
    br, bc = _extent(block[0], r), _extent(block[1], c)
    want = [*lead, -(-r // br), -(-c // bc)]
    if list(scale.shape) != want:
        raise ValueError(
            f"dequantize_fp8: q {list(q.shape)} with block {tuple(block)} needs scale of shape "
            f"{want}, got {list(scale.shape)}"
        )


def dequantize_fp8_reference(
    q: Tensor, scale: Tensor, block: tuple[int, int] = (-1, -1), dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`quantize_fp8_reference`: ``q * scale`` (rounded once to fp32),
    cast to ``dtype``."""
    check_dequantize_fp8(q, scale, block)
    r, c = q.shape[-2:]
    br, bc = _extent(block[0], r), _extent(block[1], c)
    qf = _fp8_to_float(q)
    if r % br == 0 and c % bc == 0 and qf.is_contiguous():  # whole blocks: broadcast the scale
        *lead, nr, nc = scale.shape
        blocks = qf.view(*lead, nr, br, nc, bc)
        return blocks.mul_(scale.unsqueeze(-1).unsqueeze(-3)).view(qf.shape).to(dtype)
    return qf.mul_(_expand(scale, br, bc, r, c)).to(dtype)


# --------------------------------------------------------------------------------------
# MX (E8M0 power-of-two scales over 1 x 32 blocks)


def mx_scale_exponent(amax: Tensor, scale_rule: str = "floor") -> Tensor:
    """Unbiased E8M0 exponent ``e`` (int32) of the MX scale ``2^e`` for a block's ``amax``.

    ``"floor"``: ``floor(log2(amax)) - 8``; ``"rceil"``: ``ceil(log2(amax / 448))``; both
    computed exactly from the fp32 bits (``frexp``), clamped to [-127, 127]; ``amax = 0``
    gives -127.
    """
    if scale_rule not in _SCALE_RULES:
        raise ValueError(
            f"mx_scale_exponent: scale_rule must be one of {_SCALE_RULES}, got {scale_rule!r}"
        )
    a = amax.float()
    mant, exp = torch.frexp(a)  # a = mant * 2^exp, mant in [0.5, 1)
    e = exp.to(torch.int32) - 1 - E4M3_EMAX  # floor(log2 a) - 8
    if scale_rule == "rceil":
        # a / 2^e = 2 * mant * 256 > 448  <=>  mant > 0.875
        e = e + (mant > 0.875).to(torch.int32)
    e = torch.where(a > 0, e, torch.full_like(e, -E8M0_BIAS))
    return e.clamp(-E8M0_BIAS, E8M0_BIAS)


def e8m0_to_float(scale: Tensor) -> Tensor:
    """uint8 E8M0 biased exponents -> exact fp32 powers of two (255 -> NaN). On the CPU
    (real tensors, eager) by a lookup in the 256 values' table (two ops where the formula
    takes ten: a [16384, 8] scale 0.44 -> 0.09 ms on one Zen 4 core), elsewhere by the
    formula that built the table (the same bits)."""
    if scale.dtype != torch.uint8:
        raise TypeError(f"e8m0_to_float: expected uint8 biased exponents, got {scale.dtype}")
    if (
        scale.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not torch._subclasses.fake_tensor.is_fake(scale)
    ):
        codes = scale.reshape(-1).to(torch.int32)
        return _e8m0_table().index_select(0, codes).view(scale.shape)
    return _exp2_exact(scale.to(torch.int32) - E8M0_BIAS, nan=scale == 255)


_E8M0_TABLE: list[Tensor] = []


def _e8m0_table() -> Tensor:
    """The fp32 value of each of the 256 E8M0 codes (CPU), built once by the formula."""
    if not _E8M0_TABLE:
        codes = torch.arange(256, dtype=torch.int32)
        _E8M0_TABLE.append(_exp2_exact(codes - E8M0_BIAS, nan=codes == 255))
    return _E8M0_TABLE[0]


def _exp2_exact(e: Tensor, nan: Tensor | None = None) -> Tensor:
    """2^e for integer e in [-127, 127] built from fp32 bits (2^-127 is subnormal)."""
    bits = torch.where(e >= -126, (e + 127) << 23, torch.full_like(e, 1 << 22))
    out = bits.to(torch.int32).view(torch.float32)
    return out if nan is None else out.masked_fill(nan, math.nan)


def _mx_scale(amax: Tensor, scale_rule: str) -> tuple[Tensor, Tensor]:
    """(unbiased exponent int32, fp32 power-of-two scale)."""
    e = mx_scale_exponent(amax, scale_rule)
    return e, _exp2_exact(e)


def _encode_scale(e: Tensor, scale_f: Tensor, scale_dtype: torch.dtype) -> Tensor:
    return (e + E8M0_BIAS).to(torch.uint8) if scale_dtype == torch.uint8 else scale_f


def _decode_scale(name: str, scale: Tensor) -> Tensor:
    if scale.dtype == torch.uint8:
        return e8m0_to_float(scale)
    if scale.dtype == torch.float32:
        return scale
    raise TypeError(
        f"{name}: expected scale as uint8 E8M0 exponents or float32 powers of two, got {scale.dtype}"
    )


def _check_scale_dtype(name: str, scale_dtype: torch.dtype) -> None:
    if scale_dtype not in (torch.uint8, torch.float32):
        raise ValueError(
            f"{name}: scale_dtype must be torch.uint8 or torch.float32, got {scale_dtype}"
        )


def check_quantize_mx(x: Tensor, dim: int, block: int, scale_rule: str) -> tuple[int, list[int]]:
    """quantize_mx's input checks (shared with the fake kernel): (dim >= 0, scale shape)."""
    _check_input("quantize_mx", x, min_dim=1)
    if scale_rule not in _SCALE_RULES:
        raise ValueError(
            f"quantize_mx: scale_rule must be one of {_SCALE_RULES}, got {scale_rule!r}"
        )
    if block < 1:
        raise ValueError(f"quantize_mx: block must be positive, got {block}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"quantize_mx: dim {dim} is out of range for a {x.dim()}D x")
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % block:
        raise ValueError(
            f"quantize_mx: dim {dim} has size {size}, not a multiple of the block ({block}); "
            f"pad it (e.g. permute(align={block}))"
        )
    shape = list(x.shape)
    shape[dim] //= block
    return dim, shape


def quantize_mx_reference(
    x: Tensor,
    *,
    dim: int = -1,
    block: int = MX_BLOCK,
    scale_rule: str = "floor",
    scale_dtype: torch.dtype = torch.uint8,
) -> tuple[Tensor, Tensor]:
    r"""MXFP8 (e4m3 elements, E8M0 scales) with ``block`` consecutive elements along ``dim``.

    Args:
        x: float tensor, any rank >= 1; ``x.shape[dim]`` must be a multiple of ``block``.
        scale_rule: ``"floor"`` (OCP spec) or ``"rceil"`` (no clipping), see module doc.
        scale_dtype: ``torch.uint8`` (biased exponents) or ``torch.float32`` (powers of two).

    Returns:
        ``(q, scale)``: q like x in float8_e4m3fn; scale like x with ``dim`` divided by block.
    """
    _check_scale_dtype("quantize_mx", scale_dtype)
    dim, _ = check_quantize_mx(x, dim, block, scale_rule)
    size = x.shape[dim]
    xf = x.float().movedim(dim, -1)
    blocks = xf.reshape(*xf.shape[:-1], size // block, block)
    e, scale_f = _mx_scale(_abs_max(blocks, (-1,)), scale_rule)
    q = _to_fp8(blocks / scale_f.unsqueeze(-1)).reshape(xf.shape).movedim(-1, dim)
    return q, _encode_scale(e, scale_f, scale_dtype).movedim(-1, dim)


def quantize_mx_cpu(x: Tensor, dim: int, block: int, scale_rule: str) -> tuple[Tensor, Tensor]:
    """The CPU kernel of ``quantize_mx`` (contiguous q and uint8 scale, as the op returns
    them): x converted to fp32, its blocks' absolute maxima taken, divided by its block's
    scale, clamped and cast in chunks of ~``_QUANT_CHUNK`` elements, so that neither an
    fp32 copy of x nor a moved-dim view of it is made. The same per-element operations as
    :func:`quantize_mx_reference`, hence the same bits. A contiguous x, or one whose last
    two dims are transposed (an expert weight read K-major) with the blocks along one of
    them, takes the chunks; any other layout takes the reference."""
    d, _ = check_quantize_mx(x, dim, block, scale_rule)
    if x.numel():
        if x.is_contiguous():
            return _quantize_mx_dense(x, d, block, scale_rule)
        last = x.dim() - 1
        if last >= 1 and d >= last - 1 and x.transpose(-2, -1).is_contiguous():
            # quantize the row-major transpose along the same dim, transposed
            q, scale = _quantize_mx_dense(x.transpose(-2, -1), 2 * last - 1 - d, block, scale_rule)
            return q.transpose(-2, -1).contiguous(), scale.transpose(-2, -1).contiguous()
    q, scale = quantize_mx_reference(x, dim=d, block=block, scale_rule=scale_rule)
    return q.contiguous(), scale.contiguous()


def _quantize_mx_dense(x: Tensor, d: int, block: int, scale_rule: str) -> tuple[Tensor, Tensor]:
    """quantize_mx_cpu on a contiguous x, viewed as [A, S, B] around the blocked dim d
    (S = x.shape[d]): with B == 1 the blocks are runs of a row of [A, S] (chunks of whole
    rows); otherwise they are ``block`` consecutive rows of [A * S, B] (S is a multiple of
    the block, so no block crosses from one index of A to the next: ``_quantize_row_blocks``)."""
    size = x.shape[d]
    inner = math.prod(x.shape[d + 1 :])
    rows = x.numel() // inner  # A * S, or A when inner == 1
    q = torch.empty(x.shape, dtype=_FP8, device=x.device)
    scale_shape = list(x.shape)
    scale_shape[d] //= block
    scale = torch.empty(scale_shape, dtype=torch.uint8, device=x.device)
    scales = _block_scales("mx", scale_rule)
    mod = _fp8_kernels(x)  # the native kernel (csrc/fp8_cpu.cpp): the same bits
    rule = _native_rule("mx", scale_rule)
    if inner > 1:
        x2, q2 = x.reshape(rows, inner), q.view(rows, inner)
        s2 = scale.view(rows // block, inner)
        if mod is None or not mod.fp8_quantize_rows(x2, block, 1, q2, s2, rule):
            _quantize_row_blocks(x2, q2, s2, 0, rows, 0, block, scales)
        return q, scale
    rows //= size
    x2, q2, s2 = x.reshape(rows, size), q.view(rows, size), scale.view(rows, size // block)
    if mod is not None and mod.fp8_quantize_rows(x2, 1, block, q2, s2, rule):
        return q, scale
    step = max(1, _QUANT_CHUNK // size)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        xf = x2[r0:r1].to(torch.float32, copy=True)
        blocks = xf.view(-1, size // block, block)
        div, stored = scales(_abs_max(blocks, (2,)))
        s2[r0:r1] = stored
        blocks.div_(div.unsqueeze(2))
        _to_fp8_into(q2[r0:r1], xf)
    return q, scale


def _block_scales(fmt: str, scale_rule: str) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """The blocks' ``amax`` -> (fp32 divisor, stored scale) of the CPU kernels: fp32
    ``amax / 448`` for FP8, the E8M0 power of two (stored as uint8 exponents) for MX."""

    def fp8(amax: Tensor) -> tuple[Tensor, Tensor]:
        scale_f = _fp8_scale(amax)
        return scale_f, scale_f

    def mx(amax: Tensor) -> tuple[Tensor, Tensor]:
        e, scale_f = _mx_scale(amax, scale_rule)
        return scale_f, _encode_scale(e, scale_f, torch.uint8)

    return fp8 if fmt == "fp8" else mx


def _quantize_row_blocks(
    x2: Tensor,
    q2: Tensor,
    scale2: Tensor,
    start: int,
    end: int,
    first: int,
    extent: int,
    scales: Callable[[Tensor], tuple[Tensor, Tensor]],
) -> None:
    """Rows ``start:end`` of a 2D x2 quantized per column in blocks of ``extent``
    consecutive rows (the last one may be partial) into q2, block j's scale row into
    ``scale2[first + j]``: in pieces of whole blocks of about ``_QUANT_CHUNK`` elements
    (at least one block), each converted to fp32, its blocks' column maxima taken over a
    view, divided by their scales broadcast over the rows, clamped and cast."""
    cols = x2.shape[1]
    if cols == 0:  # no elements (and no view of the rows' blocks)
        return
    piece = max(1, _QUANT_CHUNK // cols // extent) * extent
    for r0 in range(start, end, piece):
        r1 = min(end, r0 + piece)
        xf = x2[r0:r1].to(torch.float32, copy=True)
        full = (r1 - r0) // extent * extent
        j = first + (r0 - start) // extent
        if full:
            blocks = xf[:full].view(-1, extent, cols)
            div, stored = scales(_abs_max(blocks, (1,)))
            scale2[j : j + full // extent] = stored
            blocks.div_(div.unsqueeze(1))
            j += full // extent
        if full < r1 - r0:  # the partial last block
            div, stored = scales(_abs_max(xf[full:], (0,)).unsqueeze(0))
            scale2[j : j + 1] = stored
            xf[full:].div_(div)
        _to_fp8_into(q2[r0:r1], xf)


def check_dequantize_mx(q: Tensor, scale: Tensor, dim: int, block: int) -> int:
    """dequantize_mx's input checks (shared with the fake kernel); returns dim >= 0."""
    _check_q("dequantize_mx", q)
    if scale.dtype not in (torch.uint8, torch.float32):
        raise TypeError(
            "dequantize_mx: expected scale as uint8 E8M0 exponents or float32 powers of two, "
            f"got {scale.dtype}"
        )
    if block < 1:
        raise ValueError(f"dequantize_mx: block must be positive, got {block}")
    if not -q.dim() <= dim < q.dim():
        raise ValueError(f"dequantize_mx: dim {dim} is out of range for a {q.dim()}D q")
    dim = dim % q.dim()
    want = list(q.shape)
    if want[dim] % block:
        raise ValueError(
            f"dequantize_mx: dim {dim} has size {want[dim]}, not a multiple of the block ({block})"
        )
    want[dim] //= block
    if list(scale.shape) != want:
        raise ValueError(
            f"dequantize_mx: q {list(q.shape)} with block {block} along dim {dim} needs scale of "
            f"shape {want}, got {list(scale.shape)}"
        )
    return dim


def dequantize_mx_reference(
    q: Tensor,
    scale: Tensor,
    *,
    dim: int = -1,
    block: int = MX_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Inverse of :func:`quantize_mx_reference`; ``scale`` may be uint8 (E8M0) or fp32 powers of two."""
    dim = check_dequantize_mx(q, scale, dim, block)
    scale_f = _decode_scale("dequantize_mx", scale)
    qf = _fp8_to_float(q)
    if qf.is_contiguous():  # the scale broadcast over each block of ``block`` elements
        shape = list(q.shape)
        blocks = qf.view(*shape[:dim], shape[dim] // block, block, *shape[dim + 1 :])
        return blocks.mul_(scale_f.unsqueeze(dim + 1)).view(shape).to(dtype)
    return qf.mul_(scale_f.repeat_interleave(block, dim=dim)).to(dtype)


# --------------------------------------------------------------------------------------
# jagged per-expert column quantization (wgrad: blocks along M never cross a group end)


def jagged_num_blocks(num_rows: int, num_groups: int, block: int) -> int:
    """Static bound NB on the scale rows of a jagged quantization (see the module doc)."""
    if block == -1:
        return num_groups + 1
    return (num_rows + (num_groups + 1) * (block - 1)) // block


def _check_jagged_offs(name: str, offs: Tensor, block: int) -> None:
    _check_block(name, block)
    if offs.dim() != 1 or offs.dtype != torch.int32:
        raise ValueError(f"{name}: expected offs to be 1D int32, got {offs.dim()}D {offs.dtype}")


def jagged_block_index(offs: Tensor, num_rows: int, block: int) -> tuple[Tensor, int]:
    """Scale row of every input row: ``(row_block [M] int64, NB)`` (layout in module doc)."""
    _check_jagged_offs("jagged_block_index", offs, block)
    check_offs_values("quantize_jagged", offs, num_rows)
    num_groups = offs.shape[0]
    ends = torch.cat([offs.long(), offs.new_tensor([num_rows], dtype=torch.long)])
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    sizes = ends - starts
    bound = jagged_num_blocks(num_rows, num_groups, block)
    if block == -1:
        nblocks = (sizes > 0).long()
    else:
        nblocks = (sizes + block - 1) // block
    first = torch.cumsum(nblocks, 0) - nblocks
    rows = torch.arange(num_rows, device=offs.device)
    seg = torch.searchsorted(ends[:-1], rows, right=True)
    within = rows - starts[seg]
    row_block = first[seg] + (torch.zeros_like(within) if block == -1 else within // block)
    return row_block, bound


def check_quantize_jagged(x: Tensor, offs: Tensor, block: int, fmt: str, scale_rule: str) -> int:
    """quantize_jagged's input checks but the offs values (shared with the fake kernel);
    returns the scale rows NB."""
    _check_input("quantize_jagged", x)
    if x.dim() != 2:
        raise ValueError(f"quantize_jagged: expected x to be 2D [M, N], got {x.dim()}D")
    if fmt not in ("fp8", "mx"):
        raise ValueError(f"quantize_jagged: fmt must be 'fp8' or 'mx', got {fmt!r}")
    if fmt == "mx" and scale_rule not in _SCALE_RULES:
        raise ValueError(
            f"quantize_jagged: scale_rule must be one of {_SCALE_RULES}, got {scale_rule!r}"
        )
    _check_jagged_offs("quantize_jagged", offs, block)
    if offs.device != x.device:
        raise ValueError(f"quantize_jagged: offs is on {offs.device} but x is on {x.device}")
    return jagged_num_blocks(x.shape[0], offs.shape[0], block)


def quantize_jagged_reference(
    x: Tensor,
    offs: Tensor,
    *,
    block: int = 128,
    fmt: str = "fp8",
    scale_rule: str = "floor",
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    r"""Per-column quantization of x [M, N] with blocks along M restarting at group ends.

    Args:
        x: [M, N] float (rows sorted by group, as for ``grouped_mm``).
        offs: [E] int32 group ends.
        block: rows per block (partial blocks at group ends), -1 = one block per group.
        fmt: ``"fp8"`` (fp32 scale amax/448) or ``"mx"`` (E8M0, ``scale_rule``).
        scale_dtype: for ``"mx"``: uint8 or float32 (fp8 scales are always float32).

    Returns ``(q [M, N] float8_e4m3fn, scale [NB, N])``, NB the static bound in the module doc.
    """
    check_quantize_jagged(x, offs, block, fmt, scale_rule)
    if fmt == "mx":
        _check_scale_dtype("quantize_jagged", scale_dtype)
    row_block, bound = jagged_block_index(offs, x.shape[0], block)
    xf = x.float()
    amax = xf.new_zeros(bound, x.shape[1])
    index = row_block.unsqueeze(1).expand(-1, x.shape[1])
    amax.scatter_reduce_(0, index, xf.abs(), "amax", include_self=True)
    if fmt == "fp8":
        scale_f = _fp8_scale(amax)
        scale = scale_f
    else:
        e, scale_f = _mx_scale(amax, scale_rule)
        scale = _encode_scale(e, scale_f, scale_dtype)
    return _to_fp8(xf / scale_f.index_select(0, row_block)), scale


def quantize_jagged_cpu(
    x: Tensor, offs: Tensor, block: int, fmt: str, scale_rule: str
) -> tuple[Tensor, Tensor]:
    """The CPU kernel of ``quantize_jagged`` (contiguous q; the op's scale dtype: fp32 for
    FP8, uint8 for MX). The segments (the groups, then the rows past the last) go in
    chunks of ~``_QUANT_CHUNK`` elements, each converted to fp32, divided by its blocks'
    scales, clamped and cast, so that no fp32 copy of x is made:

    * a segment of one chunk or more: pieces of whole blocks, each block's column maxima
      over a view of the piece and the scales broadcast over the block's rows (a block
      taller than a piece, e.g. ``block=-1``, takes its maxima from a first pass of
      partial maxima);
    * consecutive smaller segments together: the reference's scatter of the maxima and
      gather of the scales, on the chunk's rows (a fixed number of ops per chunk, however
      many small groups it holds).

    The same per-element operations as :func:`quantize_jagged_reference`, hence the same
    bits."""
    bound = check_quantize_jagged(x, offs, block, fmt, scale_rule)
    ends = check_offs_values("quantize_jagged", offs, x.shape[0])
    if ends is None:  # pragma: no cover (CPU offs)
        ends = offs.tolist()
    rows, cols = x.shape
    x2 = x.contiguous()
    q = torch.empty((rows, cols), dtype=_FP8, device=x.device)
    scales = _block_scales(fmt, scale_rule)
    # unused scale rows hold the all-zero block's scale
    scale = scales(x2.new_zeros((1, cols), dtype=torch.float32))[1].expand(bound, cols).clone()
    step = max(1, _QUANT_CHUNK // max(cols, 1))

    def convert(r0: int, r1: int) -> Tensor:
        return x2[r0:r1].to(torch.float32, copy=True)

    def large(start: int, end: int, first: int) -> None:
        extent = end - start if block == -1 else block
        if extent <= step:  # pieces of whole blocks: one pass
            _quantize_row_blocks(x2, q, scale, start, end, first, extent, scales)
            return
        for b0 in range(start, end, extent):  # maxima of partial maxima, then divide
            b1 = min(end, b0 + extent)
            amax = _abs_max(convert(b0, min(b1, b0 + step)), (0,))
            for r0 in range(b0 + step, b1, step):
                torch.maximum(amax, _abs_max(convert(r0, min(b1, r0 + step)), (0,)), out=amax)
            div, stored = scales(amax.unsqueeze(0))
            scale[first + (b0 - start) // extent] = stored[0]
            for r0 in range(b0, b1, step):
                r1 = min(b1, r0 + step)
                _to_fp8_into(q[r0:r1], convert(r0, r1).div_(div))

    row_block: Tensor | None = None

    def small(c0: int, c1: int, j0: int, j1: int) -> None:
        nonlocal row_block
        if row_block is None:
            row_block = jagged_block_index(offs, rows, block)[0]
        local = row_block[c0:c1] - j0
        xf = convert(c0, c1)
        amax = xf.new_zeros((j1 - j0, cols))
        amax.scatter_reduce_(0, local.unsqueeze(1).expand(-1, cols), xf.abs(), "amax")
        div, stored = scales(amax)
        scale[j0:j1] = stored
        _to_fp8_into(q[c0:c1], xf.div_(div.index_select(0, local)))

    if _jagged_native(x2, q, scale, ends, block, fmt, scale_rule):
        return q, scale
    pending: list[tuple[int, int, int]] = []  # small segments: (start, end, first)

    def flush() -> None:
        if len(pending) == 1:
            large(*pending[0])
        elif pending:
            last = pending[-1]
            blocks_last = 1 if block == -1 else -(-(last[1] - last[0]) // block)
            small(pending[0][0], last[1], pending[0][2], last[2] + blocks_last)
        pending.clear()

    first = 0  # the segment's first scale row
    for start, end in zip([0, *ends], [*ends, rows]):
        size = end - start
        if size == 0:
            continue
        if size >= step:
            flush()
            large(start, end, first)
        else:
            if pending and end - pending[0][0] > step:
                flush()
            pending.append((start, end, first))
        first += 1 if block == -1 else -(-size // block)
    flush()
    return q, scale


def _jagged_native(
    x2: Tensor,
    q: Tensor,
    scale: Tensor,
    ends: list[int],
    block: int,
    fmt: str,
    scale_rule: str,
) -> bool:
    """quantize_jagged_cpu by the native kernel (csrc/fp8_cpu.cpp ``fp8_quantize_jagged``:
    each segment's blocks of rows, the groups' and the rows' past the last, their column
    maxima, then their codes; the same bits), all segments in one call; False, having
    written nothing, where it does not apply."""
    mod = _fp8_kernels(x2)
    if mod is None:
        return False
    offs = torch.tensor(ends, dtype=torch.int32)
    return bool(mod.fp8_quantize_jagged(x2, offs, block, q, scale, _native_rule(fmt, scale_rule)))


def check_dequantize_jagged(q: Tensor, scale: Tensor, offs: Tensor, block: int) -> None:
    """dequantize_jagged's input checks but the offs values (shared with the fake kernel)."""
    _check_q("dequantize_jagged", q)
    if q.dim() != 2:
        raise ValueError(f"dequantize_jagged: expected q to be 2D [M, N], got {q.dim()}D")
    if scale.dtype not in (torch.uint8, torch.float32):
        raise TypeError(
            "dequantize_jagged: expected scale as uint8 E8M0 exponents or float32 powers of two, "
            f"got {scale.dtype}"
        )
    _check_jagged_offs("dequantize_jagged", offs, block)
    want = [jagged_num_blocks(q.shape[0], offs.shape[0], block), q.shape[1]]
    if list(scale.shape) != want:
        raise ValueError(
            f"dequantize_jagged: q {list(q.shape)} with block {block} and {offs.shape[0]} groups "
            f"needs scale of shape {want}, got {list(scale.shape)}"
        )


def dequantize_jagged_reference(
    q: Tensor, scale: Tensor, offs: Tensor, *, block: int = 128, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`quantize_jagged_reference` (uint8 scales are read as E8M0)."""
    check_dequantize_jagged(q, scale, offs, block)
    scale_f = _decode_scale("dequantize_jagged", scale)
    row_block, _ = jagged_block_index(offs, q.shape[0], block)
    return _fp8_to_float(q).mul_(scale_f.index_select(0, row_block)).to(dtype)
