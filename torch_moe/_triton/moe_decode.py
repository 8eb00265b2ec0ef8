"""Fused small-batch MoE expert kernels (decode / short prefill), Triton.

Legend: T tokens, K top-k, D dim, F expert hidden dim, E experts, M padded expert-sorted
rows (each expert's rows padded to a multiple of BLOCK_M), BM / BN / BK tile sizes.

Two kernels, one per projection, the layout of vLLM's fused MoE:

    a[r] = silu(x[tok(r)] @ w13[e(r), :F]^T) * (x[tok(r)] @ w13[e(r), F:]^T) * rw[r]
    y[r] = a[r] @ w2[e(r)]^T

* the row gather is in the first GEMM's A loads: row r of block b reads token
  ``row_to_slot[r] // K`` of x (padding rows, ``row_to_slot == -1``, read zeros), so the
  permuted [M, D] input is never written;
* the first GEMM computes the gate and the up tile of the same columns together and applies
  SwiGLU and the routing weight in its epilogue, writing only a [M, F];
* each row block belongs to one expert (``permute_indices(align=BLOCK_M)``), which each
  program finds itself from the group ends (the number of ends at or before its first
  row, ``_block_expert``): no host sync, no table kernels, and every shape depends only on T (the kernels can be captured
  in a CUDA graph). Blocks past the last expert's rows exit early. The first program of
  the first kernel also checks that every group ends on a multiple of BLOCK_M (a flag the
  launcher asserts on, ``torch._assert_async``).

The K rows of a token are then summed in fp32 in a fixed order by ``torch_moe::unpermute``
(deterministic). FP8 weights (inference): ``w13`` / ``w2`` in e4m3 with fp32 scales per
output row (rowwise, [E, N, 1]) or per 128 x 128 block ([E, N/128, D/128]), computed once;
tiles are dequantized in registers before the dot (weight-only FP8: half the bytes read).

Tile sizes depend on the batch: a table maps a bound on T*K to (BM, BN, BK, warps, stages),
and the smallest bound at or above the batch is used (``config_for``). The tables are data,
``moe_decode_configs.json``, one per GPU name plus a default; ``benchmarks/tune_moe_decode.py``
measures one on a GPU and writes it there.

On CPU tensors (and under ``TRITON_INTERPRET=1``) the kernels run in Triton's interpreter
with fp32 dots (its bf16 ``tl.dot`` is wrong; test with fp32 / fp16 inputs).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Any

import torch
import triton
import triton.language as tl

from torch_moe._triton.grouped_mm import _input_precision, _interpreted, _use_interpreter

__all__ = [
    "CONFIGS",
    "DecodeConfig",
    "compile_for_sm90",
    "config_for",
    "load_configs",
    "moe_decode",
]


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


_CONFIG_FILE = pathlib.Path(__file__).with_name("moe_decode_configs.json")


def load_configs(device_name: str | None = None) -> dict[int, DecodeConfig]:
    """The tile table (bound on T*K -> config) for GPU ``device_name`` from
    ``moe_decode_configs.json`` (written by ``benchmarks/tune_moe_decode.py``), or its
    ``"default"`` entry when that GPU was not tuned."""
    table = _read_config_file()
    entry = table.get(device_name or "", table["default"])
    return {int(bound): DecodeConfig(*cfg) for bound, cfg in entry.items()}


@functools.cache
def _read_config_file() -> dict[str, dict[str, list[int]]]:
    return {k: v for k, v in json.loads(_CONFIG_FILE.read_text()).items() if not k.startswith("_")}


CONFIGS: dict[int, DecodeConfig] = load_configs()
_INTERPRET_CONFIG = DecodeConfig(16, 16, 16, 1, 1)

_SCALE_MODES = {None: 0, "rowwise": 1, "blockwise": 2}


def config_for(
    rows: int, interpret: bool = False, configs: dict[int, DecodeConfig] | None = None
) -> DecodeConfig:
    """The tile config for T*K = ``rows`` routed rows: the entry of ``configs`` (default:
    the current GPU's table, else ``CONFIGS``) with the smallest bound >= rows."""
    if interpret:
        return _INTERPRET_CONFIG
    if configs is None:
        configs = _device_configs()
    for bound in sorted(configs):
        if rows <= bound:
            return configs[bound]
    return configs[max(configs)]


def _device_configs() -> dict[int, DecodeConfig]:
    if not torch.cuda.is_available():
        return CONFIGS
    return _configs_for_name(torch.cuda.get_device_name())


@functools.cache
def _configs_for_name(name: str) -> dict[int, DecodeConfig]:
    return load_configs(name)


@triton.jit
def _load_w(w_ptr, e, ns, ks, n_mask, k_mask, stride_we, stride_wn, stride_wk, s_ptr,
            stride_se, stride_sn, stride_sk, SCALE_MODE: tl.constexpr):  # fmt: skip
    """A weight tile [BK, BN] = w[e, ns, ks]^T, dequantized when FP8 (SCALE_MODE 1: one
    scale per output row n; 2: per 128 x 128 block)."""
    mask = k_mask[:, None] & n_mask[None, :]
    ptrs = w_ptr + e * stride_we + ns[None, :] * stride_wn + ks[:, None] * stride_wk
    w = tl.load(ptrs, mask=mask, other=0.0)
    if SCALE_MODE == 1:
        s = tl.load(s_ptr + e * stride_se + ns * stride_sn, mask=n_mask, other=0.0)
        w = w.to(tl.float32) * s[None, :]
    elif SCALE_MODE == 2:
        s_ptrs = s_ptr + e * stride_se + (ns // 128)[None, :] * stride_sn
        s = tl.load(s_ptrs + (ks // 128)[:, None] * stride_sk, mask=mask, other=0.0)
        w = w.to(tl.float32) * s
    return w


@triton.jit
def _block_expert(offs_ptr, E, row0, E_BLOCK: tl.constexpr):
    """(expert whose group holds row ``row0`` or -1 past the last group, the group ends
    [E_BLOCK] with 0 past E): the count of group ends at or before row0."""
    g = tl.arange(0, E_BLOCK)
    ends = tl.load(offs_ptr + g, mask=g < E, other=0)
    count = tl.reduce(((ends <= row0) & (g < E)).to(tl.int32), 0, tl.standard._sum_combine)
    return tl.where(count < E, count, -1), ends


@triton.jit
def _w13_kernel(
    x_ptr, w_ptr, s_ptr, a_ptr, rw_ptr, r2s_ptr, offs_ptr, ok_ptr,
    M, D, F, TOP_K, E,
    stride_xm, stride_xd, stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk, stride_am, stride_af,
    SCALE_MODE: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    E_BLOCK: tl.constexpr,
):  # fmt: skip
    """a[rows of block m, columns of block n] = silu(gate) * up * rw (module docstring)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, ends = _block_expert(offs_ptr, E, pid_m * BLOCK_M, E_BLOCK)
    if (pid_m == 0) & (pid_n == 0):  # every group a whole number of blocks
        bad = tl.reduce((ends % BLOCK_M != 0).to(tl.int32), 0, tl.standard._sum_combine)
        tl.store(ok_ptr, (bad == 0).to(tl.int32))
    if e < 0:  # a block past the last expert's rows
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(r2s_ptr + rows, mask=rows < M, other=-1)
    valid = slot >= 0
    tok = tl.where(valid, slot // TOP_K, 0)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = ns < F
    acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < D
        a_ptrs = x_ptr + tok[:, None] * stride_xm + ks[None, :] * stride_xd
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        wg = _load_w(w_ptr, e, ns, ks, n_mask, k_mask, stride_we, stride_wn, stride_wk,
                     s_ptr, stride_se, stride_sn, stride_sk, SCALE_MODE)  # fmt: skip
        wu = _load_w(w_ptr, e, ns + F, ks, n_mask, k_mask, stride_we, stride_wn, stride_wk,
                     s_ptr, stride_se, stride_sn, stride_sk, SCALE_MODE)  # fmt: skip
        if DOT_FP32:
            a = a.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        else:
            wg = wg.to(a.dtype)
            wu = wu.to(a.dtype)
        acc_g = tl.dot(a, wg, acc_g, input_precision=INPUT_PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=INPUT_PRECISION)
    rw = tl.load(rw_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    act = (
        acc_g / (1.0 + tl.exp(-acc_g)) * acc_u * rw[:, None]
    )  # silu; tl.sigmoid is a @jit helper (see grouped_mm.py)
    out_ptrs = a_ptr + rows[:, None] * stride_am + ns[None, :] * stride_af
    tl.store(out_ptrs, act.to(a_ptr.dtype.element_ty), mask=(rows < M)[:, None] & n_mask[None, :])


@triton.jit
def _w2_kernel(
    a_ptr, w_ptr, s_ptr, y_ptr, offs_ptr,
    M, F, D, E,
    stride_am, stride_af, stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk, stride_ym, stride_yd,
    SCALE_MODE: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    E_BLOCK: tl.constexpr,
):  # fmt: skip
    """y[rows of block m, columns of block n] = a[rows] @ w2[e]^T."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = ns < D
    out_ptrs = y_ptr + rows[:, None] * stride_ym + ns[None, :] * stride_yd
    out_mask = (rows < M)[:, None] & n_mask[None, :]
    e, _ends = _block_expert(offs_ptr, E, pid_m * BLOCK_M, E_BLOCK)
    if e < 0:  # no expert's rows: zeros, as the unfused path leaves them
        tl.store(
            out_ptrs, tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=y_ptr.dtype.element_ty), mask=out_mask
        )
        return
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < F
        a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_af
        a = tl.load(a_ptrs, mask=(rows < M)[:, None] & k_mask[None, :], other=0.0)
        w = _load_w(w_ptr, e, ns, ks, n_mask, k_mask, stride_we, stride_wn, stride_wk,
                    s_ptr, stride_se, stride_sn, stride_sk, SCALE_MODE)  # fmt: skip
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        else:
            w = w.to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
    tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def _scale_args(scale: torch.Tensor | None) -> tuple[Any, int, int, int]:
    if scale is None:
        return None, 0, 0, 0
    return scale, scale.stride(0), scale.stride(1), scale.stride(2)


def _check(x, w13, w2, row_to_slot, offs, row_weights, top_k, w13_scale, w2_scale, scale_mode):
    fn = "moe_decode"
    if scale_mode not in _SCALE_MODES:
        raise ValueError(
            f"{fn}: scale_mode must be None, 'rowwise' or 'blockwise', got {scale_mode!r}"
        )
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"{fn}: expected x [T, D], w13 [E, 2F, D], w2 [E, D, F], got x {tuple(x.shape)}, "
            f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )
    E, two_f, D = w13.shape
    if two_f % 2 or D != x.shape[1] or tuple(w2.shape) != (E, D, two_f // 2):
        raise ValueError(
            f"{fn}: shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)} (2F rows), "
            f"w2 {tuple(w2.shape)} (expected {(E, D, two_f // 2)})"
        )
    if tuple(offs.shape) != (E,) or offs.dtype != torch.int32:
        raise ValueError(f"{fn}: offs must be int32 [E={E}], got {offs.dtype} {tuple(offs.shape)}")
    if row_to_slot.dim() != 1 or row_to_slot.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{fn}: row_to_slot must be a 1-D int tensor, got {row_to_slot.dtype} {tuple(row_to_slot.shape)}"
        )
    if tuple(row_weights.shape) != tuple(row_to_slot.shape):
        raise ValueError(
            f"{fn}: row_weights must be [M={row_to_slot.shape[0]}], got {tuple(row_weights.shape)}"
        )
    if top_k < 1:
        raise ValueError(f"{fn}: top_k must be >= 1, got {top_k}")
    fp8 = w13.dtype == torch.float8_e4m3fn
    if fp8 != (scale_mode is not None) or (w2.dtype == torch.float8_e4m3fn) != fp8:
        raise ValueError(
            f"{fn}: FP8 (e4m3) weights need a scale_mode and a scale_mode needs FP8 weights, got "
            f"w13 {w13.dtype}, w2 {w2.dtype}, scale_mode={scale_mode!r}"
        )
    dense = (torch.float16, torch.bfloat16, torch.float32)
    if x.dtype not in dense or not (fp8 or w13.dtype == w2.dtype == x.dtype):
        raise ValueError(
            f"{fn}: the fused path takes x in {dense} with weights of x's dtype or float8_e4m3fn, "
            f"got x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
        )
    if fp8 and (w13_scale is None or w2_scale is None):
        raise ValueError(f"{fn}: scale_mode={scale_mode!r} needs w13_scale and w2_scale")
    if scale_mode == "blockwise" and (D % 128 or (two_f // 2) % 128):
        raise ValueError(
            f"{fn}: blockwise scales need D and F multiples of 128, got D={D}, F={two_f // 2}"
        )


def moe_decode(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    row_to_slot: torch.Tensor,
    offs: torch.Tensor,
    row_weights: torch.Tensor,
    top_k: int,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    scale_mode: str | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Expert outputs y [M, D] of the expert-sorted rows (``permute_indices(align=BLOCK_M)``
    maps ``row_to_slot`` and ``offs``; every group must start on a multiple of BLOCK_M, which
    that alignment guarantees) of tokens x [T, D], w13 [E, 2F, D], w2 [E, D, F],
    ``row_weights`` [M] folded in; padding rows zero. FP8 weights with ``scale_mode``
    ``"rowwise"`` ([E, N, 1] scales) or ``"blockwise"`` ([E, N/128, K/128]).
    """
    _check(x, w13, w2, row_to_slot, offs, row_weights, top_k, w13_scale, w2_scale, scale_mode)
    interpret = _use_interpreter(x)
    cfg = config or config_for(x.shape[0] * top_k, interpret)
    M = row_to_slot.shape[0]
    D = x.shape[1]
    E = w13.shape[0]
    F = w13.shape[1] // 2
    ok = torch.empty(1, dtype=torch.int32, device=x.device)  # the groups' alignment
    compute = torch.float32 if interpret else x.dtype
    a = torch.empty((M, F), dtype=compute, device=x.device)
    y = torch.empty((M, D), dtype=compute, device=x.device)
    mode = _SCALE_MODES[scale_mode]
    precision = _input_precision(compute)
    s13, se13, sn13, sk13 = _scale_args(w13_scale)
    s2, se2, sn2, sk2 = _scale_args(w2_scale)
    grid_m = triton.cdiv(M, cfg.block_m)
    k13 = _interpreted(_w13_kernel) if interpret else _w13_kernel
    k2 = _interpreted(_w2_kernel) if interpret else _w2_kernel
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    e_block = triton.next_power_of_2(E)
    if M == 0:
        return y.to(x.dtype)
    k13[(grid_m, triton.cdiv(F, cfg.block_n))](
        x, w13, s13, a, row_weights, row_to_slot, offs, ok,
        M, D, F, top_k, E,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        se13, sn13, sk13, a.stride(0), a.stride(1),
        SCALE_MODE=mode, DOT_FP32=interpret, INPUT_PRECISION=precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, E_BLOCK=e_block,
        **launch,
    )  # fmt: skip
    torch._assert_async(
        ok,
        f"moe_decode: every group must end on a multiple of BLOCK_M={cfg.block_m} "
        f"(permute_indices(align=config_for(T*K).block_m))",
    )
    k2[(grid_m, triton.cdiv(D, cfg.block_n))](
        a, w2, s2, y, offs,
        M, F, D, E,
        a.stride(0), a.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        se2, sn2, sk2, y.stride(0), y.stride(1),
        SCALE_MODE=mode, DOT_FP32=interpret, INPUT_PRECISION=precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, E_BLOCK=e_block,
        **launch,
    )  # fmt: skip
    return y.to(x.dtype)


def compile_for_sm90(
    kernel: str, rows: int, *, D: int = 2048, F: int = 768, E: int = 128, T: int = 16,
    dtype: torch.dtype = torch.bfloat16, scale_mode: str | None = None,
    config: DecodeConfig | None = None,
) -> Any:  # fmt: skip
    """AOT-compile ``"w13"`` or ``"w2"`` for sm_90a with the config for ``rows`` routed rows
    (no GPU needed); returns the Sm90Kernel (PTX, registers, spills)."""
    from torch_moe._triton.grouped_mm import compile_jit_for_sm90

    cfg = config or config_for(rows, configs=CONFIGS)
    meta = functools.partial(torch.empty, device="meta")
    M = -(-rows // cfg.block_m) * cfg.block_m + E * (cfg.block_m - 1)
    M = -(-M // cfg.block_m) * cfg.block_m
    wdt = torch.float8_e4m3fn if scale_mode else dtype
    mode = _SCALE_MODES[scale_mode]
    s13 = meta(E, 2 * F, 1) if scale_mode == "rowwise" else meta(E, 2 * F // 128, D // 128)
    s2 = meta(E, D, 1) if scale_mode == "rowwise" else meta(E, D // 128, F // 128)
    offs = meta(E, dtype=torch.int32)
    common = dict(SCALE_MODE=mode, DOT_FP32=False, INPUT_PRECISION=_input_precision(dtype), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, E_BLOCK=triton.next_power_of_2(E))  # fmt: skip
    if kernel == "w13":
        x, w, a = meta(T, D, dtype=dtype), meta(E, 2 * F, D, dtype=wdt), meta(M, F, dtype=dtype)
        s = s13 if scale_mode else meta(1, dtype=torch.float32)
        args = [x, w, s, a, meta(M), meta(M, dtype=torch.int64), offs, meta(1, dtype=torch.int32),
                M, D, F, 8, E, D, 1, 2 * F * D, D, 1, *(s.stride() if scale_mode else (0, 0, 0)),
                F, 1]  # fmt: skip
        fn = _w13_kernel
    elif kernel == "w2":
        a, w, y = meta(M, F, dtype=dtype), meta(E, D, F, dtype=wdt), meta(M, D, dtype=dtype)
        s = s2 if scale_mode else meta(1, dtype=torch.float32)
        args = [a, w, s, y, offs, M, F, D, E, F, 1, D * F, F, 1,
                *(s.stride() if scale_mode else (0, 0, 0)), D, 1]  # fmt: skip
        fn = _w2_kernel
    else:
        raise ValueError(f"compile_for_sm90: kernel must be 'w13' or 'w2', got {kernel!r}")
    return compile_jit_for_sm90(f"moe_decode_{kernel}", fn, args, common, cfg)
