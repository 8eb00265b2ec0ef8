"""Grouped SwiGLU expert MLP: ``torch_moe::grouped_swiglu`` and its backward.

Legend: M permuted rows, D model dim, F expert hidden dim, E experts.

    h_M2F = x_MD @ w13[g]^T            one GEMM for gate and up (w13 [E, 2F, D],
                                       gate rows first, then up: HF ``gate_up_proj``)
    a_MF  = silu(h[:, :F]) * h[:, F:]  in fp32, rounded to the input dtype
    y_MD  = a_MF @ w2[g]^T             (w2 [E, D, F]: HF ``down_proj``)

Memory: forward saves only the input ``x`` and the pre-activation ``h`` [M, 2F]
(returned as the op's second output so autograd can keep it); ``a`` is recomputed in
the backward. Given the tokens [T, D] and the permutation (``row_to_slot`` /
``slot_to_row``) instead of the permuted rows, the op gathers each group's rows itself
in both directions, so the [M, D] permuted input is neither materialized nor saved. On
CPU both passes run group by group, so the [*, F] and [*, 2F] temporaries (a, dA, dH)
only ever hold one expert's rows, and on CPUs that upcast half-precision GEMMs to fp32
(see grouped_mm.py) those temporaries stay in fp32 between the GEMMs: fewer conversions
and one rounding less than the composed path, which rounds ``a`` to the input dtype as
a GPU does. On other
devices the backward is composed from ``grouped_mm`` / ``grouped_mm_wgrad`` over all
rows at once (fewer, larger launches).

Backward (s = sigmoid(gate)):
    dA    = dY @ w2[g]                 dW2[g]  = dY[g]^T @ a[g]
    dGate = dA * up * s * (1 + gate * (1 - s))
    dUp   = dA * silu(gate)
    dX    = dH @ w13[g]                dW13[g] = dH[g]^T @ x[g]
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

import torch
import torch.autograd.profiler as _profiler
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torch_moe._ops import _cpu_probe, _native
from torch_moe._ops._dtypes import FLOAT_DTYPES, acc_dtype, no_cpu_autocast
from torch_moe._ops._eager import direct, direct_calls
from torch_moe._ops.grouped_mm import (
    _busy_groups,
    _grouped_mm_cpu,
    _grouped_mm_wgrad_cpu,
    _nonzero_strides,
    _offs_tensor,
    _whole_grouped_mm,
    _whole_grouped_mm_wgrad,
    amx_rows,
    check_offs_values,
    cpu_compute_dtype,
    few_gemm_class,
    gather_way,
    gathered_grouped_mm,
    gathered_grouped_mm_wgrad,
    group_sizes,
    grouped_mm,
    grouped_mm_wgrad,
    mm_cpu,
    mm_into,
    reads_gathered,
    rows_per_busy_group,
    shares_upcast_groups,
    splits_rows,
    streams_outputs,
    threads_read_rows,
    weight_col_major,
    wgrad_operand,
    wgrad_way,
    whole_way,
)
from torch_moe._ops.permute import (
    _native_combine,
    _negative_positions,
    _permute_rows,
    _unpermute_rows,
    check_map_values,
    gather_rows,
    permute,
    permute_indices,
    token_of_rows,
    unpermute,
)

__all__ = [
    "grouped_swiglu",
    "grouped_swiglu_backward",
    "grouped_swiglu_combine",
    "routed_swiglu",
    "swiglu",
    "swiglu_backward",
    "swiglu_reference",
]

_DTYPES = FLOAT_DTYPES
# CPU kernels: elements (rows x F) per thread of one elementwise row chunk; None: measured
# on this machine (``_cpu_probe`` act_chunk), an int forces it (tests)
_ACT_CHUNK_ELEMS: int | None = None
# the dtypes of h the native row kernels take (fp32 math; fp64 h stays on the ATen ops)
_NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_NATIVE_CHECKED: dict[tuple[Any, torch.dtype], bool] = {}  # (kernels, h dtype): ATen's bits
_TABLE_CHECKED: dict[tuple[Any, torch.dtype], bool] = {}  # (kernels, h dtype): tables' bits
_TABLE_DTYPES = (torch.bfloat16, torch.float16)
_MISSING: Any = object()


def _check_inputs(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    row_weights: Tensor | None = None,
    gather_index: Tensor | None = None,
    row_to_slot: Tensor | None = None,
    slot_to_row: Tensor | None = None,
) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            "grouped_swiglu: expected x [M, D], w13 [E, 2F, D], w2 [E, D, F], got "
            f"{x.dim()}D, {w13.dim()}D, {w2.dim()}D"
        )
    num_experts, two_f, dim = w13.shape
    if two_f % 2 != 0:
        raise ValueError(
            f"grouped_swiglu: w13 must be [E, 2F, D] with an even 2F, got {list(w13.shape)}"
        )
    if dim != x.shape[1]:
        raise ValueError(f"grouped_swiglu: x is [M, D={x.shape[1]}] but w13 is [E, 2F, D={dim}]")
    expected = [num_experts, dim, two_f // 2]
    if list(w2.shape) != expected:
        raise ValueError(
            f"grouped_swiglu: w2 must be [E, D, F] = {expected} to match w13 {list(w13.shape)}, "
            f"got {list(w2.shape)}"
        )
    gathers = gather_index is not None or row_to_slot is not None or slot_to_row is not None
    if (
        x.dtype not in _DTYPES
        or w13.dtype not in _DTYPES
        or w2.dtype != w13.dtype
        or (w13.dtype != x.dtype and not gathers)
    ):
        raise ValueError(
            f"grouped_swiglu: expected x, w13, w2 to share a dtype in {_DTYPES} (x may differ "
            f"where the op gathers its rows), got {x.dtype}, {w13.dtype}, {w2.dtype}"
        )
    if w13.device != x.device or w2.device != x.device:
        raise ValueError(
            f"grouped_swiglu: x, w13, w2 must be on one device, got {x.device}, {w13.device}, {w2.device}"
        )
    if offs.dim() != 1 or offs.dtype != torch.int32 or offs.shape[0] != num_experts:
        raise ValueError(
            f"grouped_swiglu: expected offs to be 1D int32 with E={num_experts} entries, got "
            f"{offs.dim()}D {offs.dtype} with {offs.numel()}"
        )
    if offs.device != x.device:
        raise ValueError(f"grouped_swiglu: offs is on {offs.device} but x is on {x.device}")
    rows = x.shape[0]
    if gather_index is not None:
        if gather_index.dim() != 1 or gather_index.dtype != torch.int64:
            raise ValueError(
                "grouped_swiglu: expected gather_index to be a 1D int64 tensor [M], got "
                f"{gather_index.dim()}D {gather_index.dtype}"
            )
        if gather_index.device != x.device:
            raise ValueError(
                f"grouped_swiglu: gather_index is on {gather_index.device} but x is on {x.device}"
            )
        rows = gather_index.shape[0]
    if row_to_slot is not None or slot_to_row is not None:
        rows = _check_maps(x, gather_index, row_to_slot, slot_to_row)
    if row_weights is not None and (
        row_weights.shape != (rows,)
        or not row_weights.is_floating_point()
        or row_weights.device != x.device
    ):
        raise ValueError(
            f"grouped_swiglu: expected row_weights to be a floating-point tensor [M={rows}] "
            f"on {x.device}, got {list(row_weights.shape)} {row_weights.dtype} on {row_weights.device}"
        )


def _check_grad_index(grad_y: Tensor, grad_index: Tensor | None, rows: int, dim: int) -> None:
    """``grouped_swiglu_backward``'s grad_y: [rows, dim], or with ``grad_index`` (int64
    [rows], on grad_y's device) the tokens' gradient [*, dim] it picks rows of."""
    if grad_y.dim() != 2 or grad_y.shape[1] != dim:
        raise ValueError(
            f"grouped_swiglu_backward: expected grad_y to be 2D [*, D={dim}], got "
            f"{list(grad_y.shape)}"
        )
    if grad_index is None:
        return
    if (
        grad_index.dim() != 1
        or grad_index.dtype != torch.int64
        or grad_index.shape[0] != rows
        or grad_index.device != grad_y.device
    ):
        raise ValueError(
            f"grouped_swiglu_backward: expected grad_index to be a 1D int64 tensor [M={rows}] "
            f"on {grad_y.device}, got {grad_index.dim()}D {grad_index.dtype} "
            f"{list(grad_index.shape)} on {grad_index.device}"
        )


def _grad_rows(grad_y: Tensor, grad_index: Tensor | None) -> Tensor:
    """The rows' gradient: grad_y itself, or the rows of grad_y that ``grad_index`` picks,
    zero where -1 (``permute``'s values)."""
    return grad_y if grad_index is None else gather_rows(grad_y, grad_index)


def _check_maps(
    x: Tensor, gather_index: Tensor | None, row_to_slot: Tensor | None, slot_to_row: Tensor | None
) -> int:
    """Validates the permutation maps (``permute_indices``'s row_to_slot [M], slot_to_row
    [T, K]) that describe the rows gathered from the tokens x [T, D]; returns M."""
    if gather_index is not None:
        raise ValueError(
            "grouped_swiglu: pass gather_index or row_to_slot and slot_to_row, not both"
        )
    if row_to_slot is None or slot_to_row is None:
        missing = "row_to_slot" if row_to_slot is None else "slot_to_row"
        raise ValueError(
            f"grouped_swiglu: row_to_slot and slot_to_row go together; {missing} is None"
        )
    if row_to_slot.dim() != 1 or row_to_slot.dtype != torch.int64:
        raise ValueError(
            "grouped_swiglu: expected row_to_slot to be a 1D int64 tensor [M], got "
            f"{row_to_slot.dim()}D {row_to_slot.dtype}"
        )
    if (
        slot_to_row.dim() != 2
        or slot_to_row.dtype != torch.int64
        or slot_to_row.shape[0] != x.shape[0]
        or slot_to_row.shape[1] == 0
    ):
        raise ValueError(
            f"grouped_swiglu: expected slot_to_row to be a 2D int64 tensor [T={x.shape[0]}, K>=1] "
            f"(x's tokens), got {list(slot_to_row.shape)} {slot_to_row.dtype}"
        )
    for name, t in (("row_to_slot", row_to_slot), ("slot_to_row", slot_to_row)):
        if t.device != x.device:
            raise ValueError(f"grouped_swiglu: {name} is on {t.device} but x is on {x.device}")
    check_map_values("grouped_swiglu", "row_to_slot", row_to_slot, slot_to_row.numel())
    check_map_values("grouped_swiglu", "slot_to_row", slot_to_row, row_to_slot.shape[0])
    return row_to_slot.shape[0]


def _token_index(
    gather_index: Tensor | None, row_to_slot: Tensor | None, slot_to_row: Tensor | None
) -> Tensor | None:
    """The token each expert-sorted row reads (-1: a zero row), from either form: the
    gather index itself, or row_to_slot // K (an assignment t*K + k belongs to token t;
    floor division keeps -1 at -1)."""
    if row_to_slot is None or slot_to_row is None:
        return gather_index
    return token_of_rows(row_to_slot, slot_to_row)


def _act(h: Tensor, out_dtype: torch.dtype, row_weights: Tensor | None = None) -> Tensor:
    """silu(gate) * up (* row_weights) in fp32 (fp64 for fp64), returned in ``out_dtype``."""
    acc = acc_dtype(h.dtype)
    gate, up = h.to(acc).chunk(2, dim=-1)
    a = torch.nn.functional.silu(gate).mul_(up)
    if row_weights is not None:
        a.mul_(row_weights.to(acc).unsqueeze(1))
    return a.to(out_dtype)


def _act_backward(
    h: Tensor, grad_a: Tensor, row_weights: Tensor | None, out_a: Tensor, out_dh: Tensor
) -> Tensor | None:
    """Recompute a from h; write a * row_weights into ``out_a`` and dH into ``out_dh``.

    Returns d row_weights. ``grad_a`` is the gradient of the unweighted activation ``a``
    when ``row_weights`` is given (dY @ W2), so that d row_weights = <grad_a, a> needs
    no saved expert output. Math in fp32 (fp64), one rounding into the outputs;
    d silu(g)/dg = silu + sigmoid * (1 - silu).
    """
    acc = acc_dtype(h.dtype)
    gate, up = h.to(acc).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    ga = grad_a.to(acc)
    grad_rw = None
    if row_weights is not None:
        rw = row_weights.to(acc).unsqueeze(1)
        a = silu * up
        grad_rw = (ga * a).sum(-1)
        torch.mul(a, rw, out=out_a)
        ga = ga * rw
    else:
        torch.mul(silu, up, out=out_a)
    grad_gate, grad_up = out_dh.chunk(2, dim=-1)
    torch.mul(ga, silu, out=grad_up)
    dsilu = torch.rsub(silu, 1).mul_(sig).add_(silu)
    torch.mul(ga * up, dsilu, out=grad_gate)
    return grad_rw


def swiglu_reference(
    x: Tensor, w13: Tensor, w2: Tensor, offs: Tensor, row_weights: Tensor | None = None
) -> Tensor:
    """Per-expert loop in plain PyTorch: the oracle."""
    _check_inputs(x, w13, w2, offs, row_weights)
    check_offs_values("grouped_swiglu", offs, x.shape[0])
    y = x.new_zeros(x.shape)
    start = 0
    for g, end in enumerate(offs.tolist()):
        y_g = _act(x[start:end] @ w13[g].t(), x.dtype) @ w2[g].t()
        if row_weights is not None:
            y_g = y_g * row_weights[start:end].unsqueeze(1).to(x.dtype)
        y[start:end] = y_g
        start = end
    return y


def _num_rows(x: Tensor, gather_index: Tensor | None) -> int:
    return x.shape[0] if gather_index is None else gather_index.shape[0]


def _rows(
    x: Tensor, gather_index: Tensor | None, start: int, end: int, dtype: torch.dtype
) -> Tensor:
    """Rows [start, end) of the expert-sorted input: x's own, or gathered from the tokens
    and converted to the weights' ``dtype`` (as ``permute(x).to(dtype)``)."""
    if gather_index is None:
        return x[start:end]
    return gather_rows(x, gather_index[start:end]).to(dtype)


def _all_rows(x: Tensor, gather_index: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The whole expert-sorted input [M, D] in ``dtype`` (``_rows`` over every row)."""
    return x if gather_index is None else gather_rows(x, gather_index).to(dtype)


def _reads_rows(x: Tensor, ends: list[int], dt: torch.dtype) -> bool:
    """Whether x's rows gathered by a token index can be read by the threaded kernel in
    place of a gathered copy (``reads_gathered``), there being groups."""
    return bool(ends) and reads_gathered(x, "threads", dt)


def _rows_mm(
    x: Tensor, gather_index: Tensor | None, w: Tensor, ends: list[int], offs: Tensor
) -> Tensor:
    """``_grouped_mm_cpu(_all_rows(x, gather_index), w)``, the rows read through the token
    index where that GEMM's way is the threaded kernel's (``gather_way``: the same bits, no
    [M, D] copy), as the lean forward reads them."""
    if gather_index is not None and threads_read_rows(x, w, gather_index.shape[0], ends):
        return gathered_grouped_mm(x, gather_index, w, _offs_tensor(ends, offs))
    return _grouped_mm_cpu(_all_rows(x, gather_index, w.dtype), w, ends, offs)


def _gathered_wgrad_way(
    src: Tensor, num_rows: int, other: Tensor, ends: list[int], first: bool
) -> str | None:
    """The way by which the threaded kernel reads ``num_rows`` rows gathered from ``src``
    in place as a weight gradient's first operand (``first``: x of x^T @ dy) or second
    (dy), ``other`` the other operand: that gradient's way (``wgrad_way`` of the gathered
    rows' shapes, then ``gather_way``) where it reads gathered rows (``reads_gathered``),
    else None (the caller gathers a copy)."""
    dt = other.dtype
    if src.dtype != dt or not _reads_rows(src, ends, dt):
        return None
    rows = other.new_empty((num_rows, src.shape[1]))  # the gathered rows' metadata
    way = gather_way(wgrad_way(rows, other, ends) if first else wgrad_way(other, rows, ends), dt)
    return way if way is not None and reads_gathered(src, way, dt) else None


def _rows_wgrad(
    dh: Tensor, x: Tensor, gather_index: Tensor | None, ends: list[int], offs: Tensor
) -> Tensor:
    """``_grouped_mm_wgrad_cpu(dh, _all_rows(x, gather_index))``, the rows read through the
    token index where that weight gradient's way is the threaded kernel's (as ``_rows_mm``;
    the lean backward's dW13)."""
    if gather_index is not None:
        way = _gathered_wgrad_way(x, gather_index.shape[0], dh, ends, first=False)
        if way is not None:
            offs_i = _offs_tensor(ends, offs)
            return gathered_grouped_mm_wgrad(dh.t(), x, offs_i, None, gather_index, way)
    return _grouped_mm_wgrad_cpu(dh, _all_rows(x, gather_index, dh.dtype), ends, offs)


def _grad_rows_wgrad(
    g: Tensor, grad_index: Tensor | None, a: Tensor, ends: list[int], offs: Tensor
) -> Tensor:
    """``_grouped_mm_wgrad_cpu(_grad_rows(g, grad_index), a)`` (dW2 = dY^T A), the output
    gradient's rows read through ``grad_index`` as ``_rows_wgrad`` reads x's (the lean
    backward's dW2)."""
    if grad_index is not None:
        way = _gathered_wgrad_way(g, grad_index.shape[0], a, ends, first=True)
        if way is not None:
            offs_i = _offs_tensor(ends, offs)
            return gathered_grouped_mm_wgrad(g.t(), a, offs_i, grad_index, None, way)
    return _grouped_mm_wgrad_cpu(_grad_rows(g, grad_index), a, ends, offs)


@torch.library.custom_op("torch_moe::grouped_swiglu", mutates_args=())
def grouped_swiglu(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    row_weights: Tensor | None = None,
    gather_index: Tensor | None = None,
    row_to_slot: Tensor | None = None,
    slot_to_row: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Returns (y [M, D], h [M, 2F]); h is the pre-activation saved for the backward.

    With ``gather_index`` [M] int64, x is [T, D] (tokens) and row r of the expert-sorted
    input is ``x[gather_index[r]]`` (zero for -1): the permute's gather fused into the
    GEMM's loads (on CPU one group's rows at a time), so the [M, D] permuted input is
    never materialized, in the forward nor for the backward (which gathers again).
    Autograd through x needs the permutation itself instead: with ``row_to_slot`` [M] and
    ``slot_to_row`` [T, K] (``permute_indices``) the rows are ``permute(x, row_to_slot,
    slot_to_row)`` and x's gradient is that permute's backward (each token's K row
    gradients summed in fp32 in k order, ``unpermute``); bit for bit the unfused
    ``grouped_swiglu(permute(x, ...))`` in both directions, where the GEMMs' bits do not
    depend on where the rows lie in memory: bf16 / fp16 on every path, fp32 / fp64 on the
    whole-operand path (ATen's fp32 / fp64 GEMM can round a row by its address: the loop
    path's gathered rows are a fresh buffer, the unfused ones a slice at another offset,
    within one GEMM rounding of each other). Where the op gathers, x may
    be in another dtype than the weights (fp32 tokens under bf16 autocast): the rows are
    converted to the weights' dtype as gathered, and x's gradient is summed in x's dtype,
    bit for bit ``grouped_swiglu(permute(x, ...).to(w13.dtype))``, so that x itself (the
    caller's tensor, which the router saves anyway) is what the backward keeps.
    """
    _check_inputs(x, w13, w2, offs, row_weights, gather_index, row_to_slot, slot_to_row)
    gather_index = _token_index(gather_index, row_to_slot, slot_to_row)
    check_offs_values("grouped_swiglu", offs, _num_rows(x, gather_index))
    x = _all_rows(x, gather_index, w13.dtype)
    h = grouped_mm(x, w13.transpose(-2, -1), offs)
    return grouped_mm(_act(h, h.dtype, row_weights), w2.transpose(-2, -1), offs), h


# --------------------------------------------------------------------------------------
# CPU kernels: group by group, so that an expert's [rows, F] operands and the elementwise
# work's fp32 temporaries (one row chunk) stay small; GEMMs in cpu_compute_dtype (bf16 where
# the CPU multiplies it natively: then no conversion at all), layouts as measured.


def _act_chunk_rows(dtype: torch.dtype, hidden: int, threads: int | None = None) -> int:
    """Rows per elementwise chunk: the measured per-thread chunk (elements) times the
    threads (this process's by default), so that each thread's share of an op stays as
    large as measured."""
    threads = torch.get_num_threads() if threads is None else threads
    per_thread = _ACT_CHUNK_ELEMS
    if per_thread is None:
        per_thread = _cpu_probe.memo(
            ("act_chunk", dtype),
            lambda: _cpu_probe.act_chunk(dtype, lambda: _measure_act_chunk(dtype)),
        )
    return max(1, per_thread * threads // max(1, hidden))


def _measure_act_chunk(dtype: torch.dtype) -> dict[str, float]:
    """Seconds of the elementwise backward over 2^19 elements per candidate chunk size."""
    hidden, rows = 512, 1024
    h = torch.randn(rows, 2 * hidden).to(dtype)
    grad_a = torch.randn(rows, hidden).to(dtype)
    rw = torch.rand(rows)
    a, dh = torch.empty_like(grad_a), torch.empty_like(h)

    def run(elems: int) -> None:
        step = max(1, elems // hidden)
        for r0 in range(0, rows, step):
            r = slice(r0, r0 + step)
            _act_backward_into(h[r], grad_a[r], rw[r], a[r], dh[r])

    sizes = [2**15, 2**16, 2**17, 2**18]
    return _cpu_probe.time_candidates({str(n): functools.partial(run, n) for n in sizes})


def _uses_native(dtype: torch.dtype) -> bool:
    """Whether the CPU kernels run the activation of h in ``dtype`` by the compiled row
    kernels (``_native.py``): built here, and the probe's ``act_kernel`` choice."""
    if dtype not in _NATIVE_DTYPES or not _native.enabled():
        return False

    def decide() -> bool:
        choice = _cpu_probe.act_kernel(dtype, functools.partial(_measure_act_kernel, dtype))
        if choice != "native":
            return False
        mod = _native.kernels()  # a choice read from the disk cache or forced: checked too
        return mod is not None and _native_checked(mod, dtype)

    return _cpu_probe.memo(("uses_native_act", dtype), decide)


def _native_kernels(h: Tensor, *others: Tensor) -> Any:
    """The compiled row kernels where ``_uses_native`` and they take these operands: rows
    with unit column stride, the outputs and dA in one dtype (h's, or fp32 where the
    GEMMs upcast)."""
    if h.device.type != "cpu" or h.stride(-1) != 1:
        return None
    if any(t.dtype != others[0].dtype or t.stride(-1) != 1 for t in others):
        return None
    if others[0].dtype not in (h.dtype, torch.float32) or not _uses_native(h.dtype):
        return None
    return _native.kernels()


def _act_table(dtype: torch.dtype) -> bool:
    """Whether the native kernels read the gates' silu and sigmoid from their tables
    (``swiglu_cpu.cpp``'s gate_tables) for h in ``dtype``: a half dtype, the tables' bits
    checked against the computing kernel on every gate value, and the probe's
    ``act_table`` choice. Memoized."""
    if dtype not in _TABLE_DTYPES or not _native.enabled():
        return False

    def decide() -> bool:
        choice = _cpu_probe.act_table(dtype, functools.partial(_measure_act_table, dtype))
        mod = _native.kernels()
        return choice == "table" and mod is not None and _table_checked(mod, dtype)

    return _cpu_probe.memo(("act_table", dtype), decide)


def _measure_act_table(dtype: torch.dtype) -> dict[str, float]:
    """Seconds of the native kernels' forward + backward computing the gates' silu and
    sigmoid and reading them from the tables (where their check passes), on gates of a
    GEMM's spread (standard normal)."""
    mod = _native.kernels()
    if mod is None or not _table_checked(mod, dtype):
        return {"compute": 0.0}
    h, grad_a, _ = _probe_operands(dtype)
    a, dh = torch.empty_like(grad_a), torch.empty_like(h)

    def run(table: bool) -> None:
        mod.swiglu_forward(h, None, a, False, table)
        mod.swiglu_backward(h, grad_a, None, a, dh, None, False, table)

    return _cpu_probe.time_candidates(
        {"compute": functools.partial(run, False), "table": functools.partial(run, True)}
    )


def _table_checked(mod: Any, dtype: torch.dtype) -> bool:
    """``_table_matches``, once per process, kernels and dtype."""
    key = (mod, dtype)
    if key not in _TABLE_CHECKED:
        _TABLE_CHECKED[key] = _table_matches(mod, dtype)
    return _TABLE_CHECKED[key]


def _all_gates(dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(h, dA, row weights) whose gates take every 16-bit pattern of ``dtype`` (NaNs,
    infinities, subnormals and signed zeros included), in rows of vector blocks and a
    scalar tail (1031 columns), the rest random: the gate tables' checks."""
    hidden = 1024 + 7
    gates = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    rows = -(-gates.numel() // hidden)
    gen = torch.Generator().manual_seed(2)
    gate = torch.randn(rows * hidden, generator=gen).to(dtype)
    gate[: gates.numel()] = gates
    up = torch.randn(rows, hidden, generator=gen).to(dtype)
    h = torch.cat([gate.view(rows, hidden), up], dim=1)
    return h, torch.randn(rows, hidden, generator=gen).to(dtype), torch.rand(rows, generator=gen)


def _int_views(*tensors: Tensor | None) -> list[Tensor]:
    """The tensors (None left out) viewed as integers of their width: the gate tables'
    checks compare bits, NaNs' included (a NaN is unequal to itself as a float)."""
    ints = {2: torch.int16, 4: torch.int32}
    return [t.view(ints[t.element_size()]) for t in tensors if t is not None]


def _table_matches(mod: Any, dtype: torch.dtype) -> bool:
    """The native kernels give the same bits reading the tables as computing, forward
    and backward, with and without row weights, on gates of every 16-bit pattern (NaNs,
    infinities and subnormals included) in rows long enough for vector blocks and a
    scalar tail; a compiler that built the tables' functions differently from the
    kernels' fails here, with a warning."""
    h, grad_a, weights = _all_gates(dtype)
    rows = h.shape[0]
    for rw in (None, weights):
        outs = []
        for table in (False, True):
            a, a2, dh = torch.empty_like(grad_a), torch.empty_like(grad_a), torch.empty_like(h)
            grad_rw = None if rw is None else rw.new_empty(rows)
            mod.swiglu_forward(h, rw, a, False, table)
            mod.swiglu_backward(h, grad_a, rw, a2, dh, grad_rw, False, table)
            outs.append(_int_views(a, a2, dh, grad_rw))
        same = all(torch.equal(x, y) for x, y in zip(outs[0], outs[1], strict=True))
        if not same:
            warnings.warn(
                "torch_moe: the native CPU SwiGLU kernel's gate tables give other bits than "
                f"its computed silu / sigmoid ({dtype}); computing them",
                stacklevel=2,
            )
            return False
    return True


def _act_temporary_bytes(dtype: torch.dtype, rows: float, hidden: int, backward: bool) -> float:
    """The fp32 temporaries of the activation over ``rows`` rows (one chunk) at their
    largest. ATen ops: forward h [r, 2F]; backward h [r, 2F] and silu, dA, A and their
    product [r, F]. Native kernels: a few rows of F per thread (none that grows with the
    rows: d row_weights is summed row by row)."""
    if _uses_native(dtype):
        return 0.0
    return rows * 2 * hidden * 4 + (4 * rows * hidden * 4 if backward else 0.0)


def _probe_operands(dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The activation probes' h [256, 1024], dA [256, 512] (standard normal: a GEMM's
    spread of gates) and row weights in (0, 1)."""
    hidden, rows = 512, 256
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, 2 * hidden, generator=g).to(dtype)
    grad_a = torch.randn(rows, hidden, generator=g).to(dtype)
    return h, grad_a, torch.rand(rows, generator=g)


def _measure_act_kernel(dtype: torch.dtype) -> dict[str, float]:
    """Seconds of the activation's forward + backward by the ATen ops and, where the
    native kernels built and give the ATen ops' bits on a check with ragged rows, by
    them."""
    mod = _native.kernels()
    if mod is None or not _native_checked(mod, dtype):
        return {"aten": 0.0}
    h, grad_a, rw = _probe_operands(dtype)
    a, dh, grad_rw = torch.empty_like(grad_a), torch.empty_like(h), rw.new_empty(rw.shape)

    def aten() -> None:
        _act_into_aten(h, rw, a)
        _act_backward_into_aten(h, grad_a, rw, a, dh)

    def native() -> None:
        mod.swiglu_forward(h, rw, a)
        mod.swiglu_backward(h, grad_a, rw, a, dh, grad_rw)

    return _cpu_probe.time_candidates({"aten": aten, "native": native})


def _native_checked(mod: Any, dtype: torch.dtype) -> bool:
    """``_native_matches_aten``, once per process, kernels and dtype (for the measurement
    and for a choice from the disk cache or forced alike; forcing a decision clears the
    probe's memo, not this)."""
    key = (mod, dtype)
    if key not in _NATIVE_CHECKED:
        _NATIVE_CHECKED[key] = _native_matches_aten(mod, dtype)
    return _NATIVE_CHECKED[key]


def _native_matches_aten(mod: Any, dtype: torch.dtype) -> bool:
    """The native kernels' outputs equal the ATen ops' bit for bit (rows shorter than,
    equal to and longer than a vector block, with and without row weights, outputs in h's
    dtype and in fp32), d row_weights too: the kernels sum each row's products in the
    order of ATen's sum (aten_sum.h's aten_order_sum), checked on rows long enough for
    every level of its cascade (and vectors and elements past its last group); a compiler
    that fuses or reorders differently from ATen's build, or a torch whose sum adds in
    another order, fails here, with a warning."""
    g = torch.Generator().manual_seed(1)
    cases = [
        (r, f, o)
        for r, f in ((3, 5), (5, 32), (9, 47), (17, 100))
        for o in dict.fromkeys((dtype, torch.float32))
    ]
    cases += [(2, 4100, dtype), (2, _native.CASCADE_ROW, dtype)]
    for rows, hidden, out_dtype in cases:
        h = (3 * torch.randn(rows, 2 * hidden, generator=g)).to(dtype)
        grad_a = torch.randn(rows, hidden, generator=g).to(out_dtype)
        for rw in (None, torch.rand(rows, generator=g)):
            want = [torch.empty_like(grad_a), torch.empty_like(grad_a), grad_a.new_empty(h.shape)]
            got = [torch.empty_like(t) for t in want]
            got_rw = None if rw is None else rw.new_empty(rows)
            _act_into_aten(h, rw, want[0])
            want_rw = _act_backward_into_aten(h, grad_a, rw, want[1], want[2])
            mod.swiglu_forward(h, rw, got[0])
            mod.swiglu_backward(h, grad_a, rw, got[1], got[2], got_rw)
            same = all(torch.equal(x, y) for x, y in zip(want, got, strict=True))
            if want_rw is not None and got_rw is not None:
                same = same and torch.equal(want_rw, got_rw)
            if not same:
                warnings.warn(
                    "torch_moe: the native CPU SwiGLU kernel built but its results differ from "
                    f"the ATen ops' ({dtype}, {rows}x{hidden}); using the ATen ops",
                    stacklevel=2,
                )
                return False
    return True


def _act_into(h: Tensor, row_weights: Tensor | None, out: Tensor) -> None:
    """``out = silu(gate) * up (* row_weights)``: ``_act``'s function (fp32 math, one
    rounding into ``out``), by the native row kernel or the ATen ops (the same bits)."""
    mod = _native_kernels(h, out)
    if mod is None:
        _act_into_aten(h, row_weights, out)
        return
    mod.swiglu_forward(h, _native_weights(row_weights), out, False, _act_table(h.dtype))


def _native_weights(row_weights: Tensor | None) -> Tensor | None:
    return None if row_weights is None else row_weights.to(torch.float32).contiguous()


def _act_into_aten(h: Tensor, row_weights: Tensor | None, out: Tensor) -> None:
    """``_act_into`` in ATen ops. Every op has operands of one dtype: a mixed-dtype CPU op
    converts inside its loop, several times slower than one conversion pass."""
    acc = acc_dtype(h.dtype)
    gate, up = h.to(acc, copy=True).chunk(2, dim=-1)
    a = torch.nn.functional.silu(gate, inplace=True).mul_(up)
    if row_weights is not None:
        a.mul_(row_weights.to(acc).unsqueeze(1))
    out.copy_(a)


def _act_backward_into(
    h: Tensor,
    grad_a: Tensor,
    row_weights: Tensor | None,
    out_a: Tensor,
    out_dh: Tensor,
    mod: Any = _MISSING,
    stream: bool = False,
) -> Tensor | None:
    """``_act_backward``'s function for one row chunk by the native row kernel or the ATen
    ops (the same bits; d row_weights is the same fp32 sum of the same products). Returns
    d row_weights. ``mod``: ``_native_kernels`` of these operands where the caller has it
    (None: the ATen ops); ``stream``: the native kernel's outputs past the L2 streamed."""
    if mod is _MISSING:
        mod = _native_kernels(h, grad_a, out_a, out_dh)
    if mod is None:
        return _act_backward_into_aten(h, grad_a, row_weights, out_a, out_dh)
    rw = _native_weights(row_weights)
    grad_rw = None if rw is None else rw.new_empty(rw.shape)  # sum dA * a, unweighted
    mod.swiglu_backward(h, grad_a, rw, out_a, out_dh, grad_rw, stream, _act_table(h.dtype))
    return grad_rw


def _act_backward_rows(
    h: Tensor,
    grad_a: Tensor,
    row_weights: Tensor | None,
    a: Tensor,
    dh: Tensor,
    mod: Any,
    step: int | None = None,
) -> Tensor | None:
    """``_act_backward_into`` over all rows of h: by the native kernels (``mod``) in one
    call (row by row, no temporaries: each row's products for d row_weights summed as
    they are made), else by the ATen ops in row chunks of ``step`` (default: the measured
    chunk), whose fp32 temporaries hold one chunk. Returns d row_weights (fp32 / fp64)
    or None."""
    if mod is not None:  # all rows: outputs past the L2 streamed
        return _act_backward_into(h, grad_a, row_weights, a, dh, mod, streams_outputs(dh.dtype))
    if step is None:
        step = _act_chunk_rows(h.dtype, a.shape[1])
    grad_rw = None
    if row_weights is not None:
        grad_rw = row_weights.new_empty(row_weights.shape, dtype=acc_dtype(h.dtype))
    for r0 in range(0, h.shape[0], step):
        r = slice(r0, r0 + step)
        rw = None if row_weights is None else row_weights[r]
        grad_rw_r = _act_backward_into(h[r], grad_a[r], rw, a[r], dh[r], mod)
        if grad_rw is not None and grad_rw_r is not None:
            grad_rw[r] = grad_rw_r
    return grad_rw


def _act_backward_into_aten(
    h: Tensor, grad_a: Tensor, row_weights: Tensor | None, out_a: Tensor, out_dh: Tensor
) -> Tensor | None:
    """``_act_backward_into`` in ATen ops, in fewer passes than ``_act_backward``: dGate
    through ``silu_backward`` (dA * up * s * (1 + gate * (1 - s)) in one fused op),
    operands of one dtype per op."""
    acc = acc_dtype(h.dtype)
    gate, up = h.to(acc).chunk(2, dim=-1)
    silu = gate * torch.sigmoid(gate)
    ga = grad_a.to(acc, copy=True)
    a = silu * up
    grad_rw = None
    if row_weights is not None:
        rw = row_weights.to(acc).unsqueeze(1)
        grad_rw = (ga * a).sum(-1)
        a.mul_(rw)
        ga.mul_(rw)
    out_a.copy_(a)
    del a
    grad_gate, grad_up = out_dh.chunk(2, dim=-1)
    grad_up.copy_(silu.mul_(ga))
    grad_gate.copy_(torch.ops.aten.silu_backward(ga.mul_(up), gate))
    return grad_rw


# whether the weights of a direction's two GEMMs of x @ w are column-major per group, for
# MoE's own [E, 2F, D] / [E, D, F] experts: forward x @ w13^T and a @ w2^T, backward
# dY @ w2 and dH @ w13
MOE_FORWARD, MOE_BACKWARD = (True, True), (False, False)


def _whole_path(
    dtype: torch.dtype,
    busy_groups: int,
    rows: int,
    col_major: tuple[bool | None, ...],
    threads: int | None = None,
) -> bool:
    """Whether a direction of the CPU kernels takes the whole-tensor path for
    ``busy_groups`` non-empty groups of about ``rows`` rows, the weights of its two GEMMs
    of x @ w column-major per group where ``col_major`` says True, row-major where False,
    neither where None (``MOE_FORWARD``, ``MOE_BACKWARD``), on ``threads`` intra-op threads
    (None: the caller's; the memory model asks of others). Where the CPU multiplies the
    dtype natively: both directions for two or more groups, as ``_cpu_probe.swiglu_path``
    measured. Where it upcasts half GEMMs to fp32: two or more groups whose grouped GEMMs
    share the groups out over the threads, each piece converted in its thread's scratch
    (``shares_upcast_groups``), where the loop splits each group's fp32 GEMM over all
    threads and converts each group's operands into new tensors; or where both GEMMs
    take the native few-rows kernel (``few_gemm_class``), which converts the weights in
    registers, where the loop would convert each group's whole weights to fp32 (each
    direction on its own: an inference forward needs only its own GEMMs' kernel). The
    whole path keeps the activation and its gradient in the storage dtype, as where the
    CPU multiplies it natively; the loop keeps one group's in fp32."""
    if cpu_compute_dtype(dtype) != dtype:
        if busy_groups > 1 and shares_upcast_groups(dtype, rows, threads):
            return True
        return (
            busy_groups > 0
            and None not in col_major
            and all(few_gemm_class(dtype, bool(cm), rows, busy_groups) for cm in set(col_major))
        )
    if busy_groups < 2:
        return False
    return _cpu_probe.swiglu_path(dtype, rows, functools.partial(_measure_path, dtype)) == "whole"


def _whole_path_for(w13: Tensor, w2: Tensor, ends: list[int], backward: bool) -> bool:
    """``_whole_path`` of the forward or the backward for these weights and group ends
    (validated), at the mean rows of the non-empty groups; memoized (the kernels ask per
    call)."""
    busy, rows = rows_per_busy_group(ends)
    if backward:
        col_major = (weight_col_major(w2), weight_col_major(w13))
    else:
        col_major = (weight_col_major(w13.mT), weight_col_major(w2.mT))
    return _cpu_probe.memo(
        ("swiglu_whole", w13.dtype, busy, rows, col_major, torch.get_num_threads()),
        lambda: _whole_path(w13.dtype, busy, rows, col_major),
    )


def _measure_path(dtype: torch.dtype, rows: int) -> dict[str, float]:
    """Seconds of forward + backward by the loop and by the whole-tensor path: 8 groups of
    ``rows`` rows (at most 1024) at D = F = 128 with routing weights."""
    rows, groups, dim, hidden = min(rows, 1024), 8, 128, 128
    ends = [rows * (g + 1) for g in range(groups)]
    offs = torch.tensor(ends, dtype=torch.int32)
    x = torch.randn(ends[-1], dim).to(dtype)
    w13 = (torch.randn(groups, 2 * hidden, dim) * 0.1).to(dtype)
    w2 = (torch.randn(groups, dim, hidden) * 0.1).to(dtype)
    rw = torch.rand(ends[-1])
    grad_y = torch.randn(ends[-1], dim).to(dtype)

    def run(forward: Any, backward: Any) -> None:
        _, h = forward(x, w13, w2, offs, ends, rw, None)
        backward(grad_y, None, x, h, w13, w2, offs, ends, rw, None)

    return _cpu_probe.time_candidates(
        {
            "loop": lambda: run(_forward_loop, _backward_loop),
            "whole": lambda: run(_forward_whole, _backward_whole),
        }
    )


def _forward_loop(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    ends: list[int],
    row_weights: Tensor | None,
    gather_index: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Group by group: one expert's activation buffer, reused by every group."""
    rows = _num_rows(x, gather_index)
    dt = w13.dtype
    cdt = cpu_compute_dtype(dt)
    hidden = w2.shape[2]
    h = w13.new_empty((rows, 2 * hidden))
    y = w13.new_empty((rows, x.shape[1]))
    step = _act_chunk_rows(dt, hidden)
    a_buf = torch.empty((max(group_sizes(ends), default=0), hidden), dtype=cdt)
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            h_g = h[start:end]
            mm_into(_rows(x, gather_index, start, end, dt), w13[g].t(), h_g)
            a = a_buf[: end - start]
            for r0 in range(0, end - start, step):
                r = slice(r0, r0 + step)
                rw = None if row_weights is None else row_weights[start:end][r]
                _act_into(h_g[r], rw, a[r])
            mm_into(a, w2[g].t(), y[start:end])
        start = end
    h[start:].zero_()
    y[start:].zero_()
    return y, h


def _forward_whole(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    ends: list[int],
    row_weights: Tensor | None,
    gather_index: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Whole tensors: the two grouped GEMMs by ``grouped_mm``'s CPU kernel (each with its
    own measured kernel choice; rows past the last group zero), called directly: the
    operands and ``ends`` are this op's, validated once, and an op call per GEMM would add
    the dispatcher's and the op's Python layers (tens of microseconds each: six of them
    were ~0.2 ms of an HF Mixtral experts block's forward + backward at 4-64 rows per
    expert); the activation in row chunks over all rows (the same math as the loop's,
    into one [M, F] buffer)."""
    rows = _num_rows(x, gather_index)
    h = _rows_mm(x, gather_index, w13.transpose(-2, -1), ends, offs)  # (a gathered copy: freed)
    a = w13.new_empty((rows, w2.shape[2]))
    mod = _native_kernels(h, a)
    if mod is not None:  # row by row, no temporaries: all rows in one call
        stream = streams_outputs(a.dtype)
        mod.swiglu_forward(h, _native_weights(row_weights), a, stream, _act_table(h.dtype))
    else:
        step = _act_chunk_rows(w13.dtype, w2.shape[2])
        for r0 in range(0, rows, step):
            r = slice(r0, r0 + step)
            _act_into_aten(h[r], None if row_weights is None else row_weights[r], a[r])
    return _grouped_mm_cpu(a, w2.transpose(-2, -1), ends, offs), h


@grouped_swiglu.register_kernel("cpu")
def _grouped_swiglu_cpu(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    row_weights: Tensor | None = None,
    gather_index: Tensor | None = None,
    row_to_slot: Tensor | None = None,
    slot_to_row: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    _check_inputs(x, w13, w2, offs, row_weights, gather_index, row_to_slot, slot_to_row)
    gather_index = _token_index(gather_index, row_to_slot, slot_to_row)
    ends = check_offs_values("grouped_swiglu", offs, _num_rows(x, gather_index)) or []
    return _grouped_swiglu_checked(x, w13, w2, offs, ends, row_weights, gather_index)


def _grouped_swiglu_checked(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    ends: list[int],
    row_weights: Tensor | None,
    gather_index: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """``_grouped_swiglu_cpu`` past its checks (the group ends read)."""
    forward = _forward_whole if _whole_path_for(w13, w2, ends, False) else _forward_loop
    with no_cpu_autocast():  # the kernel decides its GEMMs' dtypes
        return forward(x, w13, w2, offs, ends, row_weights, gather_index)


@grouped_swiglu.register_fake
def _(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    row_weights: Tensor | None = None,
    gather_index: Tensor | None = None,
    row_to_slot: Tensor | None = None,
    slot_to_row: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    _check_inputs(x, w13, w2, offs, row_weights, gather_index, row_to_slot, slot_to_row)
    rows = _num_rows(x, gather_index if row_to_slot is None else row_to_slot)
    return w13.new_empty((rows, x.shape[1])), w13.new_empty((rows, w13.shape[1]))


@torch.library.custom_op("torch_moe::grouped_swiglu_backward", mutates_args=())
def grouped_swiglu_backward(
    grad_y: Tensor,
    grad_h: Tensor | None,
    x: Tensor,
    h: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    row_weights: Tensor | None = None,
    gather_index: Tensor | None = None,
    grad_index: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (dX, dW13, dW2, d row_weights); ``grad_h`` is an optional gradient into h.

    d row_weights is an empty tensor when ``row_weights`` is None. With ``gather_index``
    (x holds the tokens, see ``grouped_swiglu``) dX is the [M, D] gradient of the gathered
    rows (in the weights' dtype, as the rows were), which the caller sums per token
    (``unpermute``). With ``grad_index`` (int64 [M]) grad_y holds the tokens' gradient
    [T, D] and the rows' gradient is its rows ``grad_y[grad_index]`` (zero where -1:
    ``permute``'s gather), which the CPU kernels read in place where the GEMMs can (the
    compiler's ``fuse_gather`` pass; the same values and bits as the gathered copy).
    """
    _check_grad_index(grad_y, grad_index, h.shape[0], x.shape[1])
    grad_y = _grad_rows(grad_y, grad_index)
    x = _all_rows(x, gather_index, w13.dtype)
    grad_a = grouped_mm(grad_y, w2, offs)
    a = h.new_empty((h.shape[0], h.shape[1] // 2))
    dh = torch.empty_like(h)
    grad_rw = _act_backward(h, grad_a, row_weights, a, dh)
    if grad_h is not None:
        dh = dh + grad_h
    dw2 = grouped_mm_wgrad(grad_y, a, offs)
    dx = grouped_mm(dh, w13, offs)
    dw13 = grouped_mm_wgrad(dh, x, offs)
    return dx, dw13, dw2, _grad_rw_or_empty(grad_rw, row_weights, x)


@grouped_swiglu_backward.register_kernel("cpu")
def _grouped_swiglu_backward_cpu(
    grad_y: Tensor,
    grad_h: Tensor | None,
    x: Tensor,
    h: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    row_weights: Tensor | None = None,
    gather_index: Tensor | None = None,
    grad_index: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_grad_index(grad_y, grad_index, h.shape[0], x.shape[1])
    ends = offs.tolist()
    whole = _whole_path_for(w13, w2, ends, True)
    if grad_index is not None and not whole:  # (the loop reads a copy of the rows)
        grad_y, grad_index = _grad_rows(grad_y, grad_index), None
    with no_cpu_autocast():  # the kernel decides its GEMMs' dtypes
        if whole:
            return _backward_whole(
                grad_y, grad_h, x, h, w13, w2, offs, ends, row_weights, gather_index, grad_index
            )
        return _backward_loop(grad_y, grad_h, x, h, w13, w2, offs, ends, row_weights, gather_index)


def _backward_whole(
    grad_y: Tensor,
    grad_h: Tensor | None,
    x: Tensor,
    h: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    ends: list[int],
    row_weights: Tensor | None,
    gather_index: Tensor | None,
    grad_index: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Whole tensors (see ``_forward_whole``): dA, dW2, dX and dW13 by ``grouped_mm`` /
    ``grouped_mm_wgrad``'s CPU kernels, the activation's backward in row chunks over all
    rows; with ``grad_index`` the output gradient's rows read through it by dA and dW2
    where the threaded kernel runs dA (as ``_rows_mm`` reads x's; ``_grad_rows_wgrad``),
    else gathered once for both."""
    rows, hidden = h.shape[0], w2.shape[2]
    grad_y = _nonzero_strides(grad_y)
    if grad_index is not None and threads_read_rows(grad_y, w2, rows, ends):
        grad_a = gathered_grouped_mm(grad_y, grad_index, w2, _offs_tensor(ends, offs))
    else:  # the rows gathered once, for dA and dW2
        grad_y, grad_index = _grad_rows(grad_y, grad_index), None
        grad_a = _grouped_mm_cpu(grad_y, w2, ends, offs)
    a = w13.new_empty((rows, hidden))
    dh = w13.new_empty((rows, 2 * hidden))
    mod = _native_kernels(h, grad_a, a, dh)
    grad_rw = _act_backward_rows(h, grad_a, row_weights, a, dh, mod)
    del grad_a
    if grad_h is not None:
        dh += grad_h
    end = ends[-1] if ends else 0
    if grad_rw is not None:
        grad_rw[end:] = 0  # rows past the last group belong to no expert
    # one [M, *] buffer at a time next to dH: A freed after dW2, the input rows (gathered
    # again where the op gathers and the threaded kernel does not read them in place)
    # after dW13, before dX is allocated
    dw2 = _grad_rows_wgrad(grad_y, grad_index, a, ends, offs)
    del a
    dw13 = _rows_wgrad(dh, x, gather_index, ends, offs)
    dx = _grouped_mm_cpu(dh, w13, ends, offs)
    return dx, dw13, dw2, _grad_rw_or_empty(grad_rw, row_weights, x)


def _backward_loop(
    grad_y: Tensor,
    grad_h: Tensor | None,
    x: Tensor,
    h: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    ends: list[int],
    row_weights: Tensor | None,
    gather_index: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Group by group: one expert's [rows, F] / [rows, 2F] buffers, reused."""
    dt = w13.dtype
    cdt = cpu_compute_dtype(dt)
    native = cdt == dt  # GEMMs in the storage dtype: no conversion, whole-w13 GEMMs
    dx = w13.new_empty((h.shape[0], x.shape[1]))
    dw13 = w13.new_empty(w13.shape)
    dw2 = w2.new_empty(w2.shape)
    acc = acc_dtype(dt)  # as _act_backward
    grad_rw = None if row_weights is None else torch.zeros_like(row_weights, dtype=acc)
    hidden = w2.shape[2]
    step = _act_chunk_rows(dt, hidden)
    # one expert's [rows, F] / [rows, 2F] operands, reused by every group
    most = max(group_sizes(ends), default=0)
    a_buf = torch.empty((most, hidden), dtype=cdt)
    dh_buf = torch.empty((most, 2 * hidden), dtype=cdt)
    ga_buf = torch.empty((most, hidden), dtype=cdt) if native else None
    start = 0
    for g, end in enumerate(ends):
        if end == start:
            dw13[g].zero_()
            dw2[g].zero_()
            continue
        rows = end - start
        gy = grad_y[start:end].to(cdt)  # converted once, used twice (a no-op when native)
        if ga_buf is not None:
            grad_a = ga_buf[:rows]
            mm_into(gy, w2[g], grad_a)
        else:
            grad_a = mm_cpu(gy, w2[g])
        a, dh = a_buf[:rows], dh_buf[:rows]
        # the elementwise part in row chunks: its fp32 temporaries stay small
        for r0 in range(0, rows, step):
            r = slice(r0, r0 + step)
            g_r = slice(start + r0, min(start + r0 + step, end))  # the same rows, from 0
            rw = None if row_weights is None else row_weights[g_r]
            grad_rw_r = _act_backward_into(h[g_r], grad_a[r], rw, a[r], dh[r])
            if grad_rw is not None and grad_rw_r is not None:
                grad_rw[g_r] = grad_rw_r
        del grad_a
        if grad_h is not None:
            dh += grad_h[start:end]
        mm_into(wgrad_operand(gy, hidden, [rows]), a, dw2[g])
        x_g = _rows(x, gather_index, start, end, dt).to(cdt)  # once for both GEMMs
        if native:
            mm_into(dh, w13[g], dx[start:end])
            mm_into(wgrad_operand(dh, x_g.shape[1], [rows]), x_g, dw13[g])
        else:
            # upcast: gate and up halves of w13 one at a time, half-size fp32 temporaries
            dx_g = mm_cpu(dh[:, :hidden], w13[g][:hidden])
            dx_g += mm_cpu(dh[:, hidden:], w13[g][hidden:])
            dx[start:end] = dx_g
            del dx_g
            mm_into(dh[:, :hidden].t(), x_g, dw13[g][:hidden])
            mm_into(dh[:, hidden:].t(), x_g, dw13[g][hidden:])
        start = end
    dx[start:].zero_()
    return dx, dw13, dw2, _grad_rw_or_empty(grad_rw, row_weights, x)


@grouped_swiglu_backward.register_fake
def _(
    grad_y: Tensor,
    grad_h: Tensor | None,
    x: Tensor,
    h: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    row_weights: Tensor | None = None,
    gather_index: Tensor | None = None,
    grad_index: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_inputs(x, w13, w2, offs, row_weights, gather_index)
    _check_grad_index(grad_y, grad_index, h.shape[0], x.shape[1])
    grad_rw = x.new_empty((0,)) if row_weights is None else torch.empty_like(row_weights)
    dx = w13.new_empty((h.shape[0], x.shape[1]))
    return dx, w13.new_empty(w13.shape), w2.new_empty(w2.shape), grad_rw


def _grad_rw_or_empty(grad_rw: Tensor | None, row_weights: Tensor | None, like: Tensor) -> Tensor:
    if grad_rw is None or row_weights is None:
        return like.new_empty((0,), dtype=torch.float32)
    return grad_rw.to(row_weights.dtype)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, w13, w2, offs, row_weights, gather_index, row_to_slot, slot_to_row = inputs
    _y, h = output
    ctx.save_for_backward(x, h, w13, w2, offs, row_weights, gather_index, row_to_slot, slot_to_row)
    # NB: an unused output's gradient arrives as None, not as materialized zeros: those
    # would be plain tensors even when the outputs are DTensors (mixed-type backward).
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_y, grad_h):  # type: ignore[no-untyped-def]
    x, h, w13, w2, offs, row_weights, gather_index, row_to_slot, slot_to_row = ctx.saved_tensors
    if gather_index is not None and ctx.needs_input_grad[0]:
        raise NotImplementedError(
            "grouped_swiglu: autograd through x with gather_index is not supported (a token's "
            "row gradients are summed in the permutation's k order); pass row_to_slot and "
            "slot_to_row instead"
        )
    if grad_y is None:
        grad_y = h.new_zeros((h.shape[0], x.shape[1]))
    tokens = _token_index(gather_index, row_to_slot, slot_to_row)
    dx, dw13, dw2, grad_rw = grouped_swiglu_backward(
        _nonzero_strides(grad_y), grad_h, x, h, w13, w2, offs, row_weights, tokens
    )
    if tokens is not None:  # dx holds the rows' gradients: the cast's and the permute's
        # backward, in this order (the rows were gathered, then converted)
        if ctx.needs_input_grad[0]:
            dx = unpermute(dx.to(x.dtype), slot_to_row, row_to_slot)
        else:
            dx = None
    grad_rw = grad_rw if row_weights is not None else None
    return dx, dw13, dw2, None, grad_rw, None, None, None


# --------------------------------------------------------------------------------------
# grouped_swiglu and the combine as one eager step


def grouped_swiglu_combine(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    row_weights: Tensor | None,
    row_to_slot: Tensor,
    slot_to_row: Tensor,
) -> Tensor:
    """``unpermute(grouped_swiglu(x, w13, w2, offs, row_weights, row_to_slot=row_to_slot,
    slot_to_row=slot_to_row)[0], slot_to_row, row_to_slot)``: the SwiGLU experts from the
    tokens x [T, D] back to the tokens (the combine unweighted: the routing weights are
    the rows', folded into the activation). Returns [T, D] in the weights' dtype.

    Design note. On plain CPU tensors in eager mode (``_eager.direct``) the two ops run as
    one autograd node: their own CPU kernels and backward formulas, called in the order
    the two ops call them, so the values, the gradients and the tensors saved are theirs
    bit for bit (tests compare both ways); what goes is one op's wrapper, its autograd
    node and the unpermute's checks of maps grouped_swiglu has checked. After each expert
    GEMM the interpreter runs from cold caches, and on a 2-core EPYC (Zen 4) a transformers
    Mixtral / Qwen3-MoE training step at 16 tokens spent ~0.4-0.9 ms per experts block in
    those layers (benchmarks/results/hf_train_step_cpu_202612.md). Without a gradient, at
    a few tokens per expert, it is one native call (:func:`_few_step`). Everywhere else
    (compiling, modes, subclasses, DTensor, other devices, ``TORCH_MOE_DIRECT_OPS=0``) and
    under a double backward this is the two ops, which the compiler and its passes see.
    """
    args = (x, w13, w2, offs, row_weights, row_to_slot, slot_to_row)
    if not direct(args):
        y = grouped_swiglu(x, w13, w2, offs, row_weights, None, row_to_slot, slot_to_row)[0]
        return unpermute(y, slot_to_row, row_to_slot)  # h freed before the combine
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, w13, w2, row_weights)
    )
    if grad:
        return _SwiGLUCombine.apply(*args)
    out = _few_step(*args)
    if out is not None:
        return out
    # h freed before the combine, as the two ops free it (the same peak)
    return _swiglu_combine_forward(*args, keep_h=False)[0]


# the most rows (T*K) of an inference call that tries the one-call decode step
_FEW_STEP_ROWS = 64
# refusals in a row after which a plan stops trying it (its calls' busy groups all take
# other ways: decode classes for which the probe chose ATen's GEMMs, say)
_FEW_STEP_REFUSALS = 64


class _FewStep:
    """The one-call decode step's state for calls of one metadata (``_few_step_plan``):
    the native ops, ``plan`` (int32 [rows + 1, 2]: per count of busy groups, the two
    GEMMs' ``amx_rows`` where the lean plan runs both by the few-rows kernel, else -1,
    filled in as the Python path decides each count: ``_learn_few_step``), the SwiGLU
    kernel's output streaming and gate table choices, and the refusals in a row."""

    __slots__ = ("mod", "plan", "refused", "stream", "table")

    def __init__(self, mod: Any, rows: int, stream: bool, table: bool) -> None:
        self.mod, self.stream, self.table = mod, stream, table
        with torch.inference_mode(False):  # (a normal tensor: learned into in any mode)
            self.plan = torch.full((rows + 1, 2), -1, dtype=torch.int32)
        self.refused = 0


def _few_step_plan(
    x: Tensor, w13: Tensor, w2: Tensor, row_weights: Tensor | None, rows: int
) -> _FewStep | None:
    """The one-call decode step's state for this call's metadata (what ``_lean_key``
    reads but the groups: the busy groups index its plan, and the rows are all in
    groups where it runs), or None where it never runs: x in another dtype than the
    weights, the kernels missing, or on one thread a row count that the threaded
    kernel's row split would cut (``splits_rows``, which the lean plans' keys read).
    Its callers ask it for at most ``_FEW_STEP_ROWS`` rows. Memoized."""
    key = (
        "swiglu_combine_few",
        *_operands_key(x, w13, w2, row_weights),
        rows,
        torch.get_num_threads(),
        _native.enabled(),
    )
    return _cpu_probe.memo(key, lambda: _new_few_step(x.dtype, w13.dtype, rows))


def _new_few_step(dtype: torch.dtype, w_dtype: torch.dtype, rows: int) -> _FewStep | None:
    mod = _native.kernels()
    if mod is None or not hasattr(mod, "swiglu_combine_few") or dtype != w_dtype:
        return None
    if torch.get_num_threads() < 2 and any(splits_rows(dtype, [r]) for r in range(1, rows + 1)):
        return None
    return _FewStep(mod, rows, streams_outputs(dtype), _act_table(dtype))


def _few_step(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    row_weights: Tensor | None,
    row_to_slot: Tensor,
    slot_to_row: Tensor,
) -> Tensor | None:
    """``grouped_swiglu_combine``'s inference values in one native call
    (``torch_moe_cpu::swiglu_combine_few``, csrc/experts_cpu.cpp) where the lean plan
    runs both GEMMs by the few-rows kernel (a decode step): the kernels the Python path
    calls, on the same operands in the same order (the same bits), without its glue,
    which at a few tokens runs from cold caches after the experts' weights have passed
    through them (on a Zen 4 core: 0.3-0.6 ms a Qwen3-sized step, T = 1-8:
    benchmarks/results/cpu_floor_cpu_202612.md). None where it does not run (the kernel
    checks the call and its busy groups' entry in the plan, which the Python path fills
    in: ``_learn_few_step``); not under the profiler or CPU autocast, as the lean plans."""
    maps = (row_to_slot, slot_to_row)
    return _one_call(
        x,
        w13,
        w2,
        row_weights,
        row_to_slot.shape[0],
        "swiglu_combine_few",
        offs,
        row_weights,
        *maps,
    )


def few_moe_step(
    x: Tensor, w13: Tensor, w2: Tensor, expert_ids: Tensor, weights: Tensor
) -> Tensor | None:
    """:func:`_few_step` from the routing itself: ``permute_indices(expert_ids, E)`` (no
    padding, no capacity), the rows' routing weights ``weights.reshape(-1)[row_to_slot]``
    and ``grouped_swiglu_combine``'s inference, in one native call (``moe_few``: the
    index sort's kernel, then ``swiglu_combine_few``'s), the values of those three; None
    where it does not run (as :func:`_few_step`, or expert ids out of range: the Python
    path then raises). For a layer's decode step (``MoE`` in eval mode without autograd),
    whose own calls of the Python path decide the plan."""
    return _one_call(x, w13, w2, weights, expert_ids.numel(), "moe_few", expert_ids, weights)


def _check_routed(x: Tensor, w13: Tensor, w2: Tensor, expert_ids: Tensor, weights: Tensor) -> None:
    where = "routed_swiglu"
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"{where}: x must be [T, D], w13 [E, 2F, D] and w2 [E, D, F], got x "
            f"{list(x.shape)}, w13 {list(w13.shape)}, w2 {list(w2.shape)}"
        )
    E, two_f, D = w13.shape
    if w2.shape[0] != E or x.shape[1] != D or w2.shape[1] != D or two_f != 2 * w2.shape[2]:
        raise ValueError(
            f"{where}: x [T, D], w13 [E, 2F, D] and w2 [E, D, F] disagree: x "
            f"{list(x.shape)}, w13 {list(w13.shape)}, w2 {list(w2.shape)}"
        )
    if not (x.dtype == w13.dtype == w2.dtype):
        raise ValueError(
            f"{where}: x, w13 and w2 must share a dtype (the experts' dtype), got "
            f"{x.dtype}, {w13.dtype}, {w2.dtype}"
        )
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"{where}: expert_ids must be [T, K] with T = x.shape[0] = {x.shape[0]}, got "
            f"{list(expert_ids.shape)}"
        )
    if weights.shape != expert_ids.shape or not weights.is_floating_point():
        raise ValueError(
            f"{where}: weights must be floating [T, K] like expert_ids "
            f"{list(expert_ids.shape)}, got {weights.dtype} {list(weights.shape)}"
        )


def _routed_swiglu_ops(
    x: Tensor, w13: Tensor, w2: Tensor, expert_ids: Tensor, weights: Tensor
) -> Tensor:
    row_to_slot, slot_to_row, offs, _ = permute_indices(expert_ids, w13.shape[0])
    row_weights = weights.reshape(-1).index_select(0, row_to_slot)
    return grouped_swiglu_combine(x, w13, w2, offs, row_weights, row_to_slot, slot_to_row)


@torch.library.custom_op("torch_moe::routed_swiglu", mutates_args=())
def routed_swiglu(
    x: Tensor, w13: Tensor, w2: Tensor, expert_ids: Tensor, weights: Tensor
) -> Tensor:
    """Inference (no autograd formula): the SwiGLU experts of tokens x [T, D] routed to
    ``expert_ids`` [T, K] with ``weights`` [T, K], summed back to the tokens: [T, D] in
    x's dtype, which the weights share. The values of ``permute_indices(expert_ids, E)``
    (no padding, no capacity), the rows' weights ``weights.reshape(-1)[row_to_slot]`` and
    :func:`grouped_swiglu_combine` on them, which is what this reference runs.

    Design note. A layer's decode step in eager mode runs those as one native call
    (:func:`few_moe_step`) or as their eager forms, chosen per call by the rows and by
    what earlier calls learned (``_FEW_STEP_ROWS``, the plan). A traced graph cannot make
    that choice without guarding on its token count, and its two ops (``grouped_swiglu``,
    ``unpermute``) and their glue run from cold caches after each expert GEMM has streamed
    the weights through them (a compiled one-token step's cost over eager's:
    benchmarks/results/compiled_decode_cpu_202612.md). This op is the eager step as one
    extern call of a graph (``MoE``'s and the HF backend's inference on plain CPU tensors
    when traced: :func:`traced_routed_step`): its CPU kernel makes the choice at run time,
    as eager does, with eager's kernels (the same bits)."""
    _check_routed(x, w13, w2, expert_ids, weights)
    return _routed_swiglu_ops(x, w13, w2, expert_ids, weights)


def traced_routed_step(tensors: tuple[Tensor, ...]) -> bool:
    """Whether a SwiGLU step on ``tensors`` (x, w13, w2, expert_ids, weights) should call
    :func:`routed_swiglu`: not a direct eager call (:func:`direct`, which takes
    :func:`few_moe_step` or the Python path itself) but a graph being traced, a mode or
    ``TORCH_MOE_DIRECT_OPS=0``; every tensor on the CPU and of no wrapper subclass (a
    DTensor's ops have their sharding rules); no gradient to record (the op has no
    autograd formula)."""
    if direct(tensors):
        return False
    if not all(t.device.type == "cpu" and not is_traceable_wrapper_subclass(t) for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


@routed_swiglu.register_kernel("cpu")
def _routed_swiglu_cpu(
    x: Tensor, w13: Tensor, w2: Tensor, expert_ids: Tensor, weights: Tensor
) -> Tensor:
    _check_routed(x, w13, w2, expert_ids, weights)
    out = few_moe_step(x, w13, w2, expert_ids, weights)
    return out if out is not None else _routed_swiglu_ops(x, w13, w2, expert_ids, weights)


@routed_swiglu.register_fake
def _(x: Tensor, w13: Tensor, w2: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
    _check_routed(x, w13, w2, expert_ids, weights)
    return x.new_empty((x.shape[0], w2.shape[1]))


def _one_call(
    x: Tensor, w13: Tensor, w2: Tensor, row_weights: Tensor | None, rows: int, op: str, *args: Any
) -> Tensor | None:
    """The one-call decode step by native op ``op`` on (x, w13, w2, ``*args``) and the
    plan for ``rows`` rows, into a fresh [T, D] output; None where it does not run."""
    if (
        rows > _FEW_STEP_ROWS
        or x.shape[0] == 0
        or _profiler._is_profiler_enabled
        or torch.is_autocast_enabled("cpu")
    ):
        return None
    step = _few_step_plan(x, w13, w2, row_weights, rows)
    if step is None or step.refused >= _FEW_STEP_REFUSALS:
        return None
    out = x.new_empty((x.shape[0], x.shape[1]))
    if getattr(step.mod, op)(x, w13, w2, *args, step.plan, out, step.stream, step.table):
        step.refused = 0
        return out
    step.refused += 1
    return None


def _learn_few_step(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    row_weights: Tensor | None,
    ends: list[int],
    rows: int,
    ways: tuple[str, ...],
) -> None:
    """Records in the one-call decode step's plan (``_few_step_plan``) how the lean plan
    ``ways`` runs this inference call's two GEMMs for its count of busy groups: their
    ``amx_rows`` where both are the few-rows kernel's ways and the groups end at the
    last row (what ``_lean_forward`` passes it), else nothing (-1 stays)."""
    if rows > _FEW_STEP_ROWS or not ends or ends[-1] != rows:
        return
    if ways[0] not in ("few", "few_amx") or ways[1] not in ("few", "few_amx"):
        return
    step = _few_step_plan(x, w13, w2, row_weights, rows)
    if step is None:
        return
    busy = _busy_groups(ends)
    least = amx_rows(w13.dtype, busy)
    step.plan[busy, 0] = least if ways[0] == "few_amx" else 0
    step.plan[busy, 1] = least if ways[1] == "few_amx" else 0


def _swiglu_combine_forward(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    row_weights: Tensor | None,
    row_to_slot: Tensor,
    slot_to_row: Tensor,
    keep_h: bool = True,
) -> tuple[Tensor, Tensor | None, tuple[Any, ...] | None]:
    """(out [T, D], h, what the lean backward needs or None): grouped_swiglu's CPU kernel,
    then unpermute's past its checks; by ``_lean_forward`` where ``_lean_plan`` holds.
    Without ``keep_h`` (no backward) h is freed before the combine and None returned."""
    _check_inputs(x, w13, w2, offs, row_weights, None, row_to_slot, slot_to_row)
    rows = row_to_slot.shape[0]
    ends = check_offs_values("grouped_swiglu", offs, rows) or []
    # the lean kernels where the plan holds, unprofiled and outside autocast (elsewhere the
    # kernels below, each under its op's profiler record and out of autocast)
    plan = None
    if x.shape[0] and not (_profiler._is_profiler_enabled or torch.is_autocast_enabled("cpu")):
        plan = _lean_plan(x, w13, w2, row_weights, ends, rows)
    if plan is not None:
        mod, step, ways = plan
        if not keep_h:  # inference: the one-call decode step's plan learns this count
            _learn_few_step(x, w13, w2, row_weights, ends, rows, ways)
        tokens = _token_index(None, row_to_slot, slot_to_row)
        assert tokens is not None
        empty = _negative_positions(tokens)  # read once, for the three gathers
        out, h = _lean_forward(
            mod, x, w13, w2, offs, row_weights, tokens, empty, slot_to_row, ends[-1], ways, keep_h
        )
        return out, h, (mod, step, tokens, empty, ends[-1], ways)
    with _recorded("torch_moe::grouped_swiglu"):
        tokens = _token_index(None, row_to_slot, slot_to_row)
        y, kept = _grouped_swiglu_checked(x, w13, w2, offs, ends, row_weights, tokens)
    h = kept if keep_h else None
    del kept
    if y.shape[0] == 0:  # the op's own edge (no tokens)
        return unpermute(y, slot_to_row, row_to_slot), h, None
    with _recorded("torch_moe::unpermute"):
        return _unpermute_rows(y, slot_to_row, row_to_slot), h, None


_LeanPlan = tuple[Any, int, tuple[str, ...]]  # (native ops, act row chunk, the GEMMs' ways)


def _lean_plan(
    x: Tensor, w13: Tensor, w2: Tensor, row_weights: Tensor | None, ends: list[int], rows: int
) -> _LeanPlan | None:
    """Whether every decision the two ops' CPU kernels take for this call, forward and
    backward, is the common one: the whole-tensor path, all six GEMMs by one call each
    (``torch._grouped_mm``, the native threaded kernel where ``threads_mm`` says so, or
    for the four of x @ w the native few-rows kernel where ``few_gemm`` says so; the
    weight gradients' operand as the transposed view, not a copy), the activation and
    both combines by the native kernels: then (the native kernels' ops, the activation's
    row chunk, each GEMM's way: h, y, dA, dX, dW2, dW13), with which ``_lean_*`` run the
    same kernels on the same operands without asking each decision again (each ask is a
    few Python calls, run from cold caches after every GEMM); else None. Memoized per
    force() state on everything the decisions read: the operands' dtypes, shapes, strides and
    alignment, the rows, the groups and the busy groups (the intermediate operands are
    fresh, contiguous allocations of known shapes), the threads (on one, whether a group's
    rows are split: ``splits_rows``) and whether the native kernels are enabled."""
    key = _lean_key("swiglu_combine_lean", x, w13, w2, row_weights, ends, rows)
    return _cpu_probe.memo(key, lambda: _decide_lean(x, w13, w2, ends, rows))


def _lean_key(
    kind: str,
    x: Tensor,
    w_a: Tensor,
    w_b: Tensor,
    row_weights: Tensor | None,
    ends: list[int],
    rows: int,
    *extra: object,
) -> tuple[object, ...]:
    """What a lean plan's decisions read (``_lean_plan``, ``glu._glu_lean_plan``): the
    tokens' and both weights' dtypes and shapes, the weights' strides and alignment, the
    rows, the groups, the busy groups, the threads (on one, ``splits_rows``) and whether
    the native kernels are enabled (the tokens are gathered into fresh rows: their strides
    are not read)."""
    return (
        kind,
        *extra,
        *_operands_key(x, w_a, w_b, row_weights),
        rows,
        ends[-1] if ends else 0,
        len(ends),
        _busy_groups(ends),
        torch.get_num_threads(),
        torch.get_num_threads() < 2 and splits_rows(w_a.dtype, ends),  # (threaded GEMMs)
        _native.enabled(),
    )


def _operands_key(
    x: Tensor, w_a: Tensor, w_b: Tensor, row_weights: Tensor | None
) -> tuple[object, ...]:
    """The operands' metadata that the lean plans' decisions read (``_lean_key``): the
    dtypes, x's shape, both weights' shapes and strides and their alignment."""
    return (
        x.dtype,
        w_a.dtype,
        w_b.dtype,
        None if row_weights is None else row_weights.dtype,
        *x.shape,
        *w_a.shape,
        *w_a.stride(),
        *w_b.shape,
        *w_b.stride(),
        w_a.data_ptr() % 16 == 0 and w_b.data_ptr() % 16 == 0,
    )


def _decide_lean(
    x: Tensor, w13: Tensor, w2: Tensor, ends: list[int], rows: int
) -> _LeanPlan | None:
    dt = w13.dtype
    if not ends or ends[-1] == 0:
        return None
    # one decision for both directions where half GEMMs run natively, which the plan's
    # weight gradients by torch._grouped_mm require (where they upcast, they refuse below)
    if not _whole_path_for(w13, w2, ends, False):
        return None
    if _native_combine(dt) is None or _native_combine(x.dtype) is None:
        return None
    dim, hidden = w13.shape[2], w2.shape[2]
    # stand-ins for the fresh intermediates (the decisions read their metadata only)
    x_rows, y_rows = w13.new_empty((rows, dim)), w13.new_empty((rows, dim))
    h, dh = w13.new_empty((rows, 2 * hidden)), w13.new_empty((rows, 2 * hidden))
    a = w13.new_empty((rows, hidden))
    mod = _native_kernels(h, a)  # dA and dH are fresh [M, F] / [M, 2F] in h's dtype too
    if mod is None:
        return None
    gemms = [(x_rows, w13.transpose(-2, -1)), (a, w2.transpose(-2, -1)), (y_rows, w2), (dh, w13)]
    ways = _lean_gemms(ends, gemms, wgrads=[(y_rows, a), (dh, x_rows)])
    if ways is None:
        return None
    return mod, _act_chunk_rows(dt, hidden), ways


def _lean_gemms(
    ends: list[int], gemms: list[tuple[Tensor, Tensor]], wgrads: list[tuple[Tensor, Tensor]]
) -> tuple[str, ...] | None:
    """The lean plans' GEMM decisions, asked of stand-ins with the operands' metadata: the
    way (``whole_way``: ``"few"``, ``"threads"``, ``"torch"``) ``grouped_mm``'s CPU kernel
    runs each ``(x, w)`` of ``gemms`` by, then ``grouped_mm_wgrad``'s each ``(x, dy)`` of
    ``wgrads`` (``"threads"``, ``"torch"``, or ``"transpose"`` where it copies ``x^T``
    piece by piece: ``transposes_wgrad``); None where one takes the per-group loop, or
    where a weight gradient's operand ``wgrad_operand(x)`` is a whole copy. Both plans
    put the GEMMs that read a gather of the tokens' rows first and third (x's, the
    output gradient's) and the weight gradients (each has one): their ways are
    ``gather_way``'s."""
    ways = [whole_way(x, w, ends, False) for x, w in gemms]
    ways += [wgrad_way(x, dy, ends) for x, dy in wgrads]
    dtype = gemms[0][1].dtype
    ways = [gather_way(way, dtype) if i in (0, 2, 4, 5) else way for i, way in enumerate(ways)]
    return None if None in ways else tuple(way for way in ways if way is not None)


def _lean_forward(
    mod: Any,
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    row_weights: Tensor | None,
    tokens: Tensor,
    empty: Tensor | None,
    slot_to_row: Tensor,
    end: int,
    ways: tuple[str, ...],
    keep_h: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """``_forward_whole`` then the combine where ``_lean_plan`` holds: (out, h), h None
    (freed before the combine) without ``keep_h``."""
    if reads_gathered(x, ways[0], w13.dtype):  # the GEMM reads the tokens' rows itself
        h = gathered_grouped_mm(x, tokens, w13.transpose(-2, -1), offs)
    else:
        x_rows = gather_rows(x, tokens, empty).to(w13.dtype)
        h = _whole_grouped_mm(x_rows, w13.transpose(-2, -1), offs, end, ways[0])
        del x_rows
    a = w13.new_empty((h.shape[0], w2.shape[2]))
    stream = streams_outputs(a.dtype)
    mod.swiglu_forward(h, _native_weights(row_weights), a, stream, _act_table(h.dtype))
    y = _whole_grouped_mm(a, w2.transpose(-2, -1), offs, end, ways[1])
    del a
    kept = h if keep_h else None  # a second name: h stays a Tensor for the type checker
    del h  # without keep_h, freed before the combine
    out = y.new_empty((slot_to_row.shape[0], y.shape[1]))
    mod.combine(y, slot_to_row, out)
    return out, kept


def _lean_backward(
    mod: Any,
    step: int,
    grad_out: Tensor,
    x: Tensor,
    h: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    row_weights: Tensor | None,
    tokens: Tensor,
    empty: Tensor | None,
    slot_to_row: Tensor,
    end: int,
    ways: tuple[str, ...],
    need_x: bool,
) -> tuple[Tensor | None, Tensor, Tensor, Tensor | None]:
    """The permute of ``grad_out``, ``_backward_whole`` and the combine of dX where
    ``_lean_plan`` holds: (dx, dw13, dw2, d row_weights)."""
    dt = w13.dtype
    # the GEMMs read the gathered rows of grad_out (dA, dW2) and x (dW13) themselves where
    # they can (same bits)
    fuse_gy = reads_gathered(grad_out, ways[2], dt) and reads_gathered(grad_out, ways[4], dt)
    grad_y = None if fuse_gy else gather_rows(grad_out, tokens, empty)
    if grad_y is None:
        grad_a = gathered_grouped_mm(grad_out, tokens, w2, offs)
    else:
        grad_a = _whole_grouped_mm(grad_y, w2, offs, end, ways[2])
    rows, hidden = h.shape[0], w2.shape[2]
    a = w13.new_empty((rows, hidden))
    dh = w13.new_empty((rows, 2 * hidden))
    grad_rw = _act_backward_rows(h, grad_a, row_weights, a, dh, mod, step)
    if grad_rw is not None:
        grad_rw[end:] = 0  # rows past the last group belong to no expert
    del grad_a
    if grad_y is None:
        dw2 = gathered_grouped_mm_wgrad(grad_out.t(), a, offs, tokens, None, ways[4])
    else:
        dw2 = _whole_grouped_mm_wgrad(grad_y.t(), a, offs, ways[4])
    del a, grad_y
    if reads_gathered(x, ways[5], dt):
        dw13 = gathered_grouped_mm_wgrad(dh.t(), x, offs, None, tokens, ways[5])
    else:
        x_rows = gather_rows(x, tokens, empty).to(dt)
        dw13 = _whole_grouped_mm_wgrad(dh.t(), x_rows, offs, ways[5])
        del x_rows
    dx = None
    if need_x:
        dx_rows = _whole_grouped_mm(dh, w13, offs, end, ways[3]).to(x.dtype)
        dx = dx_rows.new_empty((slot_to_row.shape[0], dx_rows.shape[1]))
        mod.combine(dx_rows, slot_to_row, dx)
    grad_rw = None if grad_rw is None or row_weights is None else grad_rw.to(row_weights.dtype)
    return dx, dw13, dw2, grad_rw


class _SwiGLUCombine(torch.autograd.Function):
    """``grouped_swiglu_combine`` as one node: the forward of both ops, grouped_swiglu's
    saved tensors, and the backward of both (unpermute's: the permute of the gradient)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        w13: Tensor,
        w2: Tensor,
        offs: Tensor,
        row_weights: Tensor | None,
        row_to_slot: Tensor,
        slot_to_row: Tensor,
    ) -> Tensor:
        out, h, lean = _swiglu_combine_forward(
            x, w13, w2, offs, row_weights, row_to_slot, slot_to_row
        )
        ctx.save_for_backward(x, h, w13, w2, offs, row_weights, row_to_slot, slot_to_row)
        ctx.lean = lean
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, h, w13, w2, offs, row_weights, row_to_slot, slot_to_row = ctx.saved_tensors
        none = (None,) * 7
        if grad_out is None:
            return none
        if torch.is_grad_enabled() or x.shape[0] == 0:  # a double backward: the ops
            grad_y = permute(grad_out, row_to_slot, slot_to_row)
            saved = (x, h, w13, w2, offs, row_weights, None, row_to_slot, slot_to_row)
            grads = _backward(_Saved(saved, ctx.needs_input_grad), grad_y, None)
            return (*grads[:5], None, None)
        lean = ctx.lean
        if lean is not None and not (
            _profiler._is_profiler_enabled or torch.is_autocast_enabled("cpu")
        ):
            mod, step, tokens, empty, end, ways = lean
            dx, dw13, dw2, grad_rw = _lean_backward(
                mod, step, grad_out, x, h, w13, w2, offs, row_weights, tokens, empty,
                slot_to_row, end, ways, ctx.needs_input_grad[0],
            )  # fmt: skip
            return dx, dw13, dw2, None, grad_rw, None, None
        with _recorded("torch_moe::permute"):
            grad_y = _permute_rows(grad_out, row_to_slot, slot_to_row)
        tokens = _token_index(None, row_to_slot, slot_to_row)
        with _recorded("torch_moe::grouped_swiglu_backward"):
            dx, dw13, dw2, grad_rw = _grouped_swiglu_backward_cpu(
                grad_y, None, x, h, w13, w2, offs, row_weights, tokens
            )
        if ctx.needs_input_grad[0]:
            with _recorded("torch_moe::unpermute"):
                dx = _unpermute_rows(dx.to(x.dtype), slot_to_row, row_to_slot)
        else:
            dx = None
        return dx, dw13, dw2, None, grad_rw if row_weights is not None else None, None, None


class _Saved:
    """What ``_backward`` reads of its ctx."""

    def __init__(self, saved_tensors: tuple[Any, ...], needs_input_grad: tuple[bool, ...]):
        self.saved_tensors = saved_tensors
        self.needs_input_grad = needs_input_grad


def _recorded(name: str) -> Any:
    """A profiler record named as the op whose kernel runs (as ``DirectOp``'s)."""
    if _profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


grouped_swiglu.register_autograd(_backward, setup_context=_setup)


# --------------------------------------------------------------------------------------
# the activation alone: torch_moe::swiglu (the FP8 / MX experts run it between two scaled
# GEMMs; grouped_swiglu fuses it between its two GEMMs)


def _check_act(
    h: Tensor, row_weights: Tensor | None, where: str = "swiglu", gated: bool = True
) -> None:
    """h [M, 2F] (gate and up; [M, F] when not ``gated``) in a float dtype and optional row
    weights [M] on its device (``where``: the op named in the message; ``torch_moe::glu``
    checks alike)."""
    if h.dim() != 2 or (gated and h.shape[1] % 2 != 0) or h.dtype not in _DTYPES:
        want = "[M, 2F] (gate and up columns)" if gated else "[M, F]"
        raise ValueError(
            f"{where}: expected h {want} in one of {_DTYPES}, got {list(h.shape)} {h.dtype}"
        )
    if row_weights is not None and (
        row_weights.shape != (h.shape[0],)
        or not row_weights.is_floating_point()
        or row_weights.device != h.device
    ):
        raise ValueError(
            f"{where}: expected row_weights to be a floating-point tensor [M={h.shape[0]}] on "
            f"{h.device}, got {list(row_weights.shape)} {row_weights.dtype} on {row_weights.device}"
        )


@torch.library.custom_op("torch_moe::swiglu", mutates_args=())
def swiglu(h: Tensor, row_weights: Tensor | None = None) -> Tensor:
    """``a = silu(h[:, :F]) * h[:, F:] (* row_weights)`` [M, F] in fp32, in h's dtype.

    Differentiable in h and row_weights; the backward saves only h (and the weights) and
    recomputes the activation, as grouped_swiglu's does.
    """
    _check_act(h, row_weights)
    return _act(h, h.dtype, row_weights)


@swiglu.register_kernel("cpu")
def _swiglu_cpu(h: Tensor, row_weights: Tensor | None = None) -> Tensor:
    """grouped_swiglu's CPU activation: row chunks whose fp32 temporaries stay in cache
    (the same operations as ``_act``, hence the same bits)."""
    _check_act(h, row_weights)
    rows, hidden = h.shape[0], h.shape[1] // 2
    out = h.new_empty((rows, hidden))
    step = _act_chunk_rows(h.dtype, hidden)
    for r0 in range(0, rows, step):
        r = slice(r0, r0 + step)
        _act_into(h[r], None if row_weights is None else row_weights[r], out[r])
    return out


@swiglu.register_fake
def _(h: Tensor, row_weights: Tensor | None = None) -> Tensor:
    _check_act(h, row_weights)
    return h.new_empty((h.shape[0], h.shape[1] // 2))


@torch.library.custom_op("torch_moe::swiglu_backward", mutates_args=())
def swiglu_backward(
    grad_a: Tensor, h: Tensor, row_weights: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Returns (dH [M, 2F], d row_weights [M], empty when ``row_weights`` is None)."""
    _check_act(h, row_weights)
    dh = torch.empty_like(h)
    a = h.new_empty((h.shape[0], h.shape[1] // 2))  # written by _act_backward, unused
    grad_rw = _act_backward(h, grad_a, row_weights, a, dh)
    return dh, _grad_rw_or_empty(grad_rw, row_weights, h)


@swiglu_backward.register_kernel("cpu")
def _swiglu_backward_cpu(
    grad_a: Tensor, h: Tensor, row_weights: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """grouped_swiglu's CPU activation backward (``_act_backward_into``) in row chunks: the
    same values as grouped_swiglu's CPU kernels give for the same rows; the recomputed
    activation goes to one chunk's scratch buffer."""
    _check_act(h, row_weights)
    rows, hidden = h.shape[0], h.shape[1] // 2
    dh = torch.empty_like(h)
    step = _act_chunk_rows(h.dtype, hidden)
    scratch = h.new_empty((min(rows, step), hidden))
    grad_rw = None if row_weights is None else h.new_empty((rows,), dtype=acc_dtype(h.dtype))
    for r0 in range(0, rows, step):
        r = slice(r0, r0 + step)
        n = min(rows, r0 + step) - r0
        rw = None if row_weights is None else row_weights[r]
        grad_rw_r = _act_backward_into(h[r], grad_a[r], rw, scratch[:n], dh[r])
        if grad_rw is not None and grad_rw_r is not None:
            grad_rw[r] = grad_rw_r
    return dh, _grad_rw_or_empty(grad_rw, row_weights, h)


@swiglu_backward.register_fake
def _(grad_a: Tensor, h: Tensor, row_weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    _check_act(h, row_weights)
    grad_rw = h.new_empty((0,)) if row_weights is None else torch.empty_like(row_weights)
    return torch.empty_like(h), grad_rw


def _setup_act(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    h, row_weights = inputs
    ctx.save_for_backward(h, row_weights)


def _act_backward_op(ctx, grad_a):  # type: ignore[no-untyped-def]
    h, row_weights = ctx.saved_tensors
    dh, grad_rw = swiglu_backward(_nonzero_strides(grad_a), h, row_weights)
    return dh, grad_rw if row_weights is not None and ctx.needs_input_grad[1] else None


swiglu.register_autograd(_act_backward_op, setup_context=_setup_act)

# Eager calls on plain CPU tensors skip the ops' Python layers (``_eager.py``).
grouped_swiglu = direct_calls(grouped_swiglu, _grouped_swiglu_cpu, _setup, _backward)
grouped_swiglu_backward = direct_calls(grouped_swiglu_backward, _grouped_swiglu_backward_cpu)
swiglu = direct_calls(swiglu, _swiglu_cpu, _setup_act, _act_backward_op)
swiglu_backward = direct_calls(swiglu_backward, _swiglu_backward_cpu)
