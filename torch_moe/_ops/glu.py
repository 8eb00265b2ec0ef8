"""The composed experts' activations: ``torch_moe::glu`` and its backward.

Legend: M rows, F hidden dim; h [M, 2F] is the up projection of a gated activation (gate
and up), h [M, F] that of an ungated one; a [M, F].

    gate, up = h's halves (gate columns first), or its even / odd columns (interleaved)
    gate, up = min(gate, L), clamp(up, -L, L)      with a limit L (GPT-OSS, HY-V4, GLM-5)
    "swiglu":    a = silu(gate) * up
    "swigluoai": a = gate * sigmoid(alpha * gate) * (up + 1)     (GPT-OSS, MiniMax-M3)
    "relu2":     a = relu(h) ** 2, ungated: no gate, no limit       (Nemotron-H)
    a = a * row_weights                             (the routing weight, when given)

Math in fp32 (fp64 for fp64 h), one rounding into h's dtype, as ``grouped_swiglu``'s
activation. The op saves h and the row weights and recomputes a in the backward, whose
derivatives are written out (s = sigmoid(gate), sa = sigmoid(alpha * gate)):

    swiglu:    dGate = dA * up * s * (1 + gate * (1 - s))     dUp = dA * silu(gate)
    swigluoai: dGate = dA * (up + 1) * sa * (1 + alpha * gate * (1 - sa))
               dUp   = dA * gate * sa
    relu2:     dH = dA * 2 * relu(h)
    a clamped input passes no gradient (torch.clamp's rule: the bounds themselves pass)
    d row_weights = sum_f dA * a_unweighted,   dA -> dA * row_weights

so that no fp32 temporary outlives the op. On CPU both directions run in row chunks
(the measured elementwise chunk of ``grouped_swiglu``), so the fp32 temporaries hold one
chunk; elsewhere the whole tensor at once. ``glu_reference`` (plain differentiable torch
ops) is the oracle and the formula's definition.

Every activation has a native CPU kernel (``torch_moe/csrc/swiglu_cpu.cpp``:
``glu_swiglu_*``, ``glu_oai_*``, ``relu2_*``): the same operations element by element in
one pass, each chunk cut into the same vector and scalar parts as ATen's loops cut it for
the operations whose two forms differ (sigmoid, silu: one flat range for a contiguous
operand, row by row for a view of h's halves, all scalar for a view of its even
columns), so the same bits; swigluoai about 2 ns per element forward + backward against
8-14 for the ATen chunks (Zen 5, one thread, [1024, 2 x 512] bf16), swiglu 5-6x faster
(an interleaved unclamped gate, all scalar in ATen too, 1.6x). They run wherever they
built and, on first use per activation and dtype, matched the ATen chunks bit for bit;
elsewhere the ATen chunks run (``TORCH_MOE_NATIVE=0``, no compiler).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.autograd.profiler as _profiler
from torch import Tensor

from torch_moe._ops import _cpu_probe, _native
from torch_moe._ops._dtypes import acc_dtype, no_cpu_autocast
from torch_moe._ops._eager import direct, direct_calls
from torch_moe._ops.grouped_mm import (
    _check_gather,
    _check_mm_inputs,
    _nonzero_strides,
    _whole_grouped_mm,
    _whole_grouped_mm_wgrad,
    check_offs_values,
    experts_transposed,
    gather_grouped_mm,
    gathered_grouped_mm,
    gathered_grouped_mm_wgrad,
    grouped_mm,
    reads_gathered,
)
from torch_moe._ops.grouped_swiglu import (
    _NATIVE_DTYPES,
    _act_chunk_rows,
    _act_table,
    _all_gates,
    _check_act,
    _grad_rw_or_empty,
    _int_views,
    _lean_gemms,
    _lean_key,
    _native_weights,
    _token_index,
)
from torch_moe._ops.permute import _negative_positions, gather_rows, unpermute

__all__ = [
    "ACTIVATIONS",
    "GATED",
    "check_activation",
    "gated",
    "glu",
    "glu_backward",
    "glu_reference",
]

# the experts' activations (``MoE(activation=...)``): gated ones read gate and up
# columns from h [M, 2F], ungated ones h [M, F]
GATED = ("swiglu", "swigluoai")
ACTIVATIONS = (*GATED, "relu2")


def gated(activation: str) -> bool:
    """Whether ``activation`` is gated (its up projection has 2F columns, else F)."""
    return activation in GATED


def check_activation(where: str, activation: str, alpha: float, limit: float | None) -> None:
    """Raise ``ValueError`` naming the argument of a bad activation choice."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if activation == "swigluoai" and not alpha > 0:
        raise ValueError(f"{where}: swigluoai needs swiglu_alpha > 0, got {alpha!r}")
    if limit is not None and not limit > 0:
        raise ValueError(f"{where}: swiglu_limit must be > 0 or None, got {limit!r}")
    if limit is not None and not gated(activation):
        raise ValueError(
            f"{where}: swiglu_limit clamps a gated activation's gate and up; {activation!r} "
            f"is ungated, got swiglu_limit={limit!r}"
        )


def _check(
    where: str,
    h: Tensor,
    row_weights: Tensor | None,
    activation: str,
    alpha: float,
    limit: float | None,
    interleaved: bool,
) -> None:
    check_activation(where, activation, alpha, limit)
    _check_act(h, row_weights, where, gated=gated(activation))
    if interleaved and not gated(activation):
        raise ValueError(
            f"{where}: interleaved gate / up columns need a gated activation, got {activation!r}"
        )


def _width(h: Tensor, activation: str) -> int:
    """F: the activation's output columns."""
    return h.shape[1] // 2 if gated(activation) else h.shape[1]


def _halves(h: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
    if interleaved:
        return h[:, 0::2], h[:, 1::2]
    gate, up = h.chunk(2, dim=-1)
    return gate, up


def glu_reference(
    h: Tensor,
    row_weights: Tensor | None,
    activation: str,
    alpha: float,
    limit: float | None,
    interleaved: bool,
) -> Tensor:
    """The activation in plain differentiable torch ops: the oracle."""
    _check("glu", h, row_weights, activation, alpha, limit, interleaved)
    return _forward(h, row_weights, activation, alpha, limit, interleaved)


def _forward(
    h: Tensor,
    row_weights: Tensor | None,
    activation: str,
    alpha: float,
    limit: float | None,
    interleaved: bool,
) -> Tensor:
    """``glu_reference`` without the argument checks (the CPU kernel's chunks)."""
    dtype, acc = h.dtype, acc_dtype(h.dtype)
    if not gated(activation):  # relu2
        a = torch.relu(h.to(acc)).square()
        if row_weights is not None:
            a = a * row_weights.to(acc).unsqueeze(-1)
        return a.to(dtype)
    gate, up = _halves(h.to(acc), interleaved)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    if activation == "swiglu":
        a = torch.nn.functional.silu(gate) * up
    else:
        a = gate * torch.sigmoid(gate * alpha) * (up + 1)
    if row_weights is not None:
        a = a * row_weights.to(acc).unsqueeze(-1)
    return a.to(dtype)


def _backward_parts(
    grad_a: Tensor,
    h: Tensor,
    row_weights: Tensor | None,
    activation: str,
    alpha: float,
    limit: float | None,
    interleaved: bool,
) -> tuple[tuple[Tensor, ...], Tensor | None]:
    """((dH,) ungated or (dGate, dUp) gated, in fp32 / fp64; d row_weights or None) by the
    written-out derivatives, out of place (the compiler's ``inline_glu`` pass traces it
    too); the caller puts dGate and dUp into h's halves or interleaved columns."""
    acc = acc_dtype(h.dtype)
    if not gated(activation):  # relu2
        ga, r = grad_a.to(acc), torch.relu(h.to(acc))
        grad_rw = None
        if row_weights is not None:
            grad_rw = (ga * r.square()).sum(-1)
            ga = ga * row_weights.to(acc).unsqueeze(-1)
        return (ga * (2 * r),), grad_rw
    gate, up = _halves(h.to(acc), interleaved)
    if limit is not None:
        gate_in = gate <= limit
        up_in = (up >= -limit) & (up <= limit)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    ga = grad_a.to(acc)
    if activation == "swiglu":
        s = torch.sigmoid(gate)
        act = torch.nn.functional.silu(gate)  # the forward's unweighted a is act * up
        unweighted = act * up
        slope = s * (1 + gate * (1 - s))
    else:
        s = torch.sigmoid(gate * alpha)
        act = gate * s
        up = up + 1
        unweighted = act * up
        slope = s * (1 + alpha * gate * (1 - s))
    grad_rw = None
    if row_weights is not None:
        grad_rw = (ga * unweighted).sum(-1)
        ga = ga * row_weights.to(acc).unsqueeze(-1)
    d_gate = ga * up * slope
    d_up = ga * act
    if limit is not None:
        d_gate = torch.where(gate_in, d_gate, 0)
        d_up = torch.where(up_in, d_up, 0)
    return (d_gate, d_up), grad_rw


def _backward_into(
    grad_a: Tensor,
    h: Tensor,
    row_weights: Tensor | None,
    activation: str,
    alpha: float,
    limit: float | None,
    interleaved: bool,
    dh: Tensor,
) -> Tensor | None:
    """Write dH for rows h into ``dh`` (rounded once); return d row_weights (fp32 / fp64)
    or None."""
    parts, grad_rw = _backward_parts(grad_a, h, row_weights, activation, alpha, limit, interleaved)
    for out, part in zip(
        _halves(dh, interleaved) if len(parts) == 2 else (dh,), parts, strict=True
    ):
        out.copy_(part)
    return grad_rw


def _rows_per_chunk(h: Tensor, activation: str) -> int:
    return _act_chunk_rows(h.dtype, _width(h, activation))


# --------------------------------------------------------------------------------------
# the native kernels (the dtypes of h they take: grouped_swiglu's, one library)

_NATIVE_ACTIVATIONS = ("swiglu", "swigluoai", "relu2")
_GluArgs = tuple[str, float, float | None, bool]  # (activation, alpha, limit, interleaved)
# (native ops, act row chunk, w_down / w_up column-major, the GEMMs' ways: h, y, dA, dX
# rows, dW_down, dW_up, as grouped_swiglu's ``_lean_gemms``)
_GluPlan = tuple[Any, int, bool, bool, tuple[str, ...]]
# (kernels, activation, dtype): whether they gave the ATen chunks' bits
_NATIVE_CHECKED: dict[tuple[Any, str, torch.dtype], bool] = {}
_TABLE_CHECKED: dict[tuple[Any, torch.dtype], bool] = {}  # (kernels, h dtype): tables' bits


def _native_kernels(activation: str, h: Tensor, *others: Tensor) -> Any:
    """The compiled kernels where they take this call: h on the CPU in a dtype they have,
    h and the other operands (dA) in one dtype with unit column stride, built and checked
    for this activation and dtype."""
    if activation not in _NATIVE_ACTIVATIONS or h.dtype not in _NATIVE_DTYPES:
        return None
    if h.device.type != "cpu" or not _native.enabled():
        return None
    if any(t.dtype != h.dtype or t.stride(-1) != 1 for t in (h, *others)):
        return None
    mod = _native.kernels()
    if mod is None:
        return None
    key = (mod, activation, h.dtype)
    if key not in _NATIVE_CHECKED:
        _NATIVE_CHECKED[key] = _native_matches_aten(mod, activation, h.dtype)
    return mod if _NATIVE_CHECKED[key] else None


def _uses_table(mod: Any, args: _GluArgs, dtype: torch.dtype) -> bool:
    """Whether the swiglu kernels read the gates' silu and sigmoid from their tables
    (``swiglu_cpu.cpp``'s gate_tables): the unclamped swiglu of a half-precision h, the
    probe's ``act_table`` choice (``grouped_swiglu._act_table``: the same tables, measured
    there) and these kernels' own check on every gate value (``_table_matches``)."""
    activation, _, limit, _ = args
    if activation != "swiglu" or limit is not None or not _act_table(dtype):
        return False
    key = (mod, dtype)
    if key not in _TABLE_CHECKED:
        _TABLE_CHECKED[key] = _table_matches(mod, dtype)
    return _TABLE_CHECKED[key]


def _table_matches(mod: Any, dtype: torch.dtype) -> bool:
    """The unclamped swiglu kernels give the same bits reading the tables as computing,
    forward and backward, both column orders, with and without row weights, on gates of
    every 16-bit pattern; else False, with a warning."""
    h, grad_a, rw = _all_gates(dtype)
    rows = grad_a.shape[0]
    for interleaved in (False, True):
        for weights in (None, rw):
            outs = []
            for table in (False, True):
                a, dh = torch.empty_like(grad_a), torch.empty_like(h)
                grad_rw = None if weights is None else weights.new_empty(rows)
                mod.glu_swiglu_forward(h, weights, a, 1.0, None, interleaved, rows, table)
                mod.glu_swiglu_backward(
                    h, grad_a, weights, dh, grad_rw, 1.0, None, interleaved, rows, table
                )
                outs.append(_int_views(a, dh, grad_rw))
            if not all(torch.equal(x, y) for x, y in zip(*outs, strict=True)):
                warnings.warn(
                    "torch_moe: the native CPU glu kernel's gate tables give other bits "
                    f"than its computed silu / sigmoid ({dtype}); computing them",
                    stacklevel=2,
                )
                return False
    return True


def _native_forward(
    mod: Any,
    h: Tensor,
    row_weights: Tensor | None,
    args: _GluArgs,
    step: int,
    out: Tensor,
    table: bool | None = None,
) -> None:
    """The activation of h into ``out``; ``args``: (activation, alpha, limit, interleaved);
    ``table``: the swiglu's gate tables (None: ``_uses_table``)."""
    activation, alpha, limit, interleaved = args
    rw = _native_weights(row_weights)
    if activation == "relu2":
        mod.relu2_forward(h, rw, out)
        return
    if activation == "swigluoai":
        mod.glu_oai_forward(h, rw, out, alpha, limit, interleaved, step)
        return
    if table is None:
        table = _uses_table(mod, args, h.dtype)
    mod.glu_swiglu_forward(h, rw, out, alpha, limit, interleaved, step, table)


def _native_backward(
    mod: Any,
    grad_a: Tensor,
    h: Tensor,
    row_weights: Tensor | None,
    args: _GluArgs,
    step: int,
    dh: Tensor,
    table: bool | None = None,
) -> Tensor | None:
    """dH into ``dh``; returns d row_weights (fp32) or None. One call: the kernel runs
    the rows in chunks of ``step`` (ATen's cuts), and sums each row's products dA * a
    for d row_weights in the order of ATen's sum (aten_sum.h's aten_order_sum), as
    the ATen chunks sum theirs. ``table`` as ``_native_forward``'s."""
    activation, alpha, limit, interleaved = args
    rw = _native_weights(row_weights)
    grad_rw = None if rw is None else rw.new_empty(rw.shape)
    if activation == "relu2":
        mod.relu2_backward(h, grad_a, rw, dh, grad_rw)
        return grad_rw
    if activation == "swigluoai":
        mod.glu_oai_backward(h, grad_a, rw, dh, grad_rw, alpha, limit, interleaved, step)
        return grad_rw
    if table is None:
        table = _uses_table(mod, args, h.dtype)
    mod.glu_swiglu_backward(h, grad_a, rw, dh, grad_rw, alpha, limit, interleaved, step, table)
    return grad_rw


def _native_matches_aten(mod: Any, activation: str, dtype: torch.dtype) -> bool:
    """The native kernels give the ATen chunks' bits: ragged rows and chunks, both column
    orders, with and without a limit and row weights, and one chunk long enough for ATen
    to cut it into a piece per thread. A build that contracts or reorders fails here,
    with a warning."""
    g = torch.Generator().manual_seed(2)
    gated_act = gated(activation)
    # (interleaved, limit, weighted): every cut ATen makes (flat, by row, all scalar)
    variants = [(True, 1.5, True), (False, None, False), (True, None, True)]
    if not gated_act:
        variants = [(False, None, True), (False, None, False)]
    # the last chunk but one is long enough for ATen to cut it into a piece per thread,
    # mid-row; the last one's rows end with a part in every level of the cascade by which
    # the kernel sums d row_weights as ATen's sum does (_native.CASCADE_ROW)
    long_row = _native.CASCADE_ROW
    for rows, hidden, step in (
        (3, 5, 2),
        (9, 47, 4),
        (17, 100, 17),
        (37, 999, 37),
        (2, long_row, 2),
    ):
        h = (3 * torch.randn(rows, (2 if gated_act else 1) * hidden, generator=g)).to(dtype)
        grad_a = torch.randn(rows, hidden, generator=g).to(dtype)
        weights = torch.rand(rows, generator=g)
        for interleaved, limit, weighted in variants:
            rw = weights if weighted else None
            args = (activation, 1.702, limit, interleaved)
            want_a, got_a = torch.empty_like(grad_a), torch.empty_like(grad_a)
            want_dh, got_dh = torch.empty_like(h), torch.empty_like(h)
            want_rw: list[Tensor] = []
            for r0 in range(0, rows, step):
                r = slice(r0, r0 + step)
                rw_r = None if rw is None else rw[r]
                want_a[r] = _forward(h[r], rw_r, *args)
                part = _backward_into(grad_a[r], h[r], rw_r, *args, want_dh[r])
                if part is not None:
                    want_rw.append(part)
            _native_forward(mod, h, rw, args, step, got_a, table=False)
            got_rw = _native_backward(mod, grad_a, h, rw, args, step, got_dh, table=False)
            same = torch.equal(want_a, got_a) and torch.equal(want_dh, got_dh)
            if got_rw is not None:
                same = same and torch.equal(torch.cat(want_rw), got_rw)
            if not same:
                warnings.warn(
                    f"torch_moe: the native CPU {activation} kernel built but its results "
                    f"differ from the ATen ops' ({dtype}, {rows}x{hidden}); using the ATen ops",
                    stacklevel=2,
                )
                return False
    return True


@torch.library.custom_op("torch_moe::glu", mutates_args=())
def glu(
    h: Tensor,
    row_weights: Tensor | None,
    activation: str,
    alpha: float,
    limit: float | None,
    interleaved: bool,
) -> Tensor:
    """The activation of h [M, 2F] (gated) or [M, F] (ungated) -> a [M, F] (module
    docstring), any device."""
    return glu_reference(h, row_weights, activation, alpha, limit, interleaved)


@glu.register_kernel("cpu")
def _glu_cpu(
    h: Tensor,
    row_weights: Tensor | None,
    activation: str,
    alpha: float,
    limit: float | None,
    interleaved: bool,
) -> Tensor:
    """Row chunks whose fp32 temporaries stay in cache: the same operations as
    ``glu_reference`` row by row. Not always its bits: ATen's sigmoid and exp round some
    fp32 results an ulp apart in a loop's vector body and its scalar tail, and the chunks
    move the tails (an fp32 swigluoai of F = 8 in chunks of one row: 15 of 512 values an
    ulp off), so fp32 results can depend on the measured chunk; in the half dtypes the
    one rounding into h's dtype mostly hides it."""
    _check("glu", h, row_weights, activation, alpha, limit, interleaved)
    out = h.new_empty((h.shape[0], _width(h, activation)))
    step = _rows_per_chunk(h, activation)
    mod = _native_kernels(activation, h)
    if mod is not None:
        _native_forward(mod, h, row_weights, (activation, alpha, limit, interleaved), step, out)
        return out
    for r0 in range(0, h.shape[0], step):
        r = slice(r0, r0 + step)
        rw = None if row_weights is None else row_weights[r]
        out[r] = _forward(h[r], rw, activation, alpha, limit, interleaved)
    return out


@glu.register_fake
def _(
    h: Tensor,
    row_weights: Tensor | None,
    activation: str,
    alpha: float,
    limit: float | None,
    interleaved: bool,
) -> Tensor:
    _check("glu", h, row_weights, activation, alpha, limit, interleaved)
    return h.new_empty((h.shape[0], _width(h, activation)))


@torch.library.custom_op("torch_moe::glu_backward", mutates_args=())
def glu_backward(
    grad_a: Tensor,
    h: Tensor,
    row_weights: Tensor | None,
    activation: str,
    alpha: float,
    limit: float | None,
    interleaved: bool,
) -> tuple[Tensor, Tensor]:
    """(dH (h's shape), d row_weights [M], empty without row weights), any device."""
    _check("glu_backward", h, row_weights, activation, alpha, limit, interleaved)
    dh = torch.empty_like(h)
    grad_rw = _backward_into(grad_a, h, row_weights, activation, alpha, limit, interleaved, dh)
    return dh, _grad_rw_or_empty(grad_rw, row_weights, h)


@glu_backward.register_kernel("cpu")
def _glu_backward_cpu(
    grad_a: Tensor,
    h: Tensor,
    row_weights: Tensor | None,
    activation: str,
    alpha: float,
    limit: float | None,
    interleaved: bool,
) -> tuple[Tensor, Tensor]:
    """The same formulas in row chunks: the same values row by row."""
    _check("glu_backward", h, row_weights, activation, alpha, limit, interleaved)
    # row-major whatever h's strides (the native kernels write rows; empty_like would give
    # an overlapping h's layout another order)
    dh = torch.empty_like(h, memory_format=torch.contiguous_format)
    step = _rows_per_chunk(h, activation)
    mod = _native_kernels(activation, h, grad_a)
    if mod is not None:
        args = (activation, alpha, limit, interleaved)
        grad_rw = _native_backward(mod, grad_a, h, row_weights, args, step, dh)
        return dh, _grad_rw_or_empty(grad_rw, row_weights, h)
    grad_rw = None if row_weights is None else h.new_empty((h.shape[0],), dtype=acc_dtype(h.dtype))
    for r0 in range(0, h.shape[0], step):
        r = slice(r0, r0 + step)
        rw = None if row_weights is None else row_weights[r]
        part = _backward_into(grad_a[r], h[r], rw, activation, alpha, limit, interleaved, dh[r])
        if grad_rw is not None and part is not None:
            grad_rw[r] = part
    return dh, _grad_rw_or_empty(grad_rw, row_weights, h)


@glu_backward.register_fake
def _(
    grad_a: Tensor,
    h: Tensor,
    row_weights: Tensor | None,
    activation: str,
    alpha: float,
    limit: float | None,
    interleaved: bool,
) -> tuple[Tensor, Tensor]:
    _check("glu_backward", h, row_weights, activation, alpha, limit, interleaved)
    grad_rw = h.new_empty((0,)) if row_weights is None else torch.empty_like(row_weights)
    return torch.empty_like(h), grad_rw


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    h, row_weights, activation, alpha, limit, interleaved = inputs
    ctx.save_for_backward(h, row_weights)
    ctx.args = (activation, alpha, limit, interleaved)


def _backward(ctx, grad_a):  # type: ignore[no-untyped-def]
    h, row_weights = ctx.saved_tensors
    dh, grad_rw = glu_backward(_nonzero_strides(grad_a), h, row_weights, *ctx.args)
    grad_rw = grad_rw if row_weights is not None and ctx.needs_input_grad[1] else None
    return dh, grad_rw, None, None, None, None


glu.register_autograd(_backward, setup_context=_setup)

# Eager calls on plain CPU tensors skip the ops' Python layers (``_eager.py``).
glu = direct_calls(glu, _glu_cpu, _setup, _backward)
glu_backward = direct_calls(glu_backward, _glu_backward_cpu)


# --------------------------------------------------------------------------------------
# the composed experts from the tokens back to the tokens, as one eager step


def grouped_glu_combine(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offs: Tensor,
    row_weights: Tensor | None,
    row_to_slot: Tensor,
    slot_to_row: Tensor,
    activation: str,
    alpha: float,
    limit: float | None,
    interleaved: bool,
    up_bias: Tensor | None = None,
    bias_rows: Tensor | None = None,
) -> Tensor:
    """The composed experts (``glu`` between two grouped GEMMs) from the tokens x [T, D]
    back to the tokens, the combine unweighted (the routing weights are the rows', folded
    into the activation)::

        h = gather_grouped_mm(x, w_up, offs, row_to_slot, slot_to_row)   # [M, N]
        h = h + up_bias.index_select(0, bias_rows)                       # with a bias
        a = glu(h, row_weights, activation, alpha, limit, interleaved)
        return unpermute(grouped_mm(a, w_down, offs), slot_to_row, row_to_slot)

    ``w_up`` [E, D, N] and ``w_down`` [E, F, D] take any strides (an HF module's
    transposed weights as they are); ``up_bias`` [E, N] and ``bias_rows`` [M] (each row's
    expert) go together. Design note: as ``grouped_swiglu_combine``, in eager with
    autograd on plain CPU tensors (``_eager.direct``), where every decision the ops'
    CPU kernels take for the call is the common one (``_glu_lean_plan``), this is one
    autograd node running those kernels on the same operands in the order the ops' own
    backward formulas run them (and the bias's as autograd computes it), so the values
    and the gradients are the ops' bit for bit; what goes is five Python autograd nodes,
    two ATen ones and the decisions asked again after every GEMM. Everywhere else it is
    the ops themselves.
    """
    if (up_bias is None) != (bias_rows is None):
        raise ValueError("grouped_glu_combine: up_bias and bias_rows go together")
    glu_args = (activation, alpha, limit, interleaved)
    args = (x, w_up, w_down, offs, row_weights, row_to_slot, slot_to_row, up_bias, bias_rows)
    # the lean node saves what the ops save where the up projection's inputs need a
    # gradient (as in training, where the tokens do); otherwise the ops save less
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, w_up, up_bias)
    )
    if (
        grad
        and x.shape[0]
        and not (_profiler._is_profiler_enabled or torch.is_autocast_enabled("cpu"))
        and direct(args)
    ):
        ends = _checked_ends(x, w_up, w_down, offs, row_weights, row_to_slot, slot_to_row, glu_args)
        plan = _glu_lean_plan(x, w_up, w_down, row_weights, ends, row_to_slot.shape[0], glu_args)
        if plan is not None:
            return _GLUCombine.apply(*args, glu_args, plan, ends[-1])
    return _glu_ops(*args, glu_args)


def _glu_ops(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offs: Tensor,
    row_weights: Tensor | None,
    row_to_slot: Tensor,
    slot_to_row: Tensor,
    up_bias: Tensor | None,
    bias_rows: Tensor | None,
    glu_args: _GluArgs,
) -> Tensor:
    """``grouped_glu_combine`` by the ops themselves."""
    h = gather_grouped_mm(x, w_up, offs, row_to_slot, slot_to_row)
    if up_bias is not None:
        h = h + up_bias.index_select(0, bias_rows)  # type: ignore[arg-type]
    a = glu(h, row_weights, *glu_args)
    return unpermute(grouped_mm(a, w_down, offs), slot_to_row, row_to_slot)


def _checked_ends(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offs: Tensor,
    row_weights: Tensor | None,
    row_to_slot: Tensor,
    slot_to_row: Tensor,
    glu_args: _GluArgs,
) -> list[int]:
    """The checks the four ops make of these operands (the same errors), and the group
    ends."""
    _check_gather(x, row_to_slot, slot_to_row)
    rows = row_to_slot.shape[0]
    _check_mm_inputs(x.new_empty((rows, x.shape[1])), w_up, offs)
    h = w_up.new_empty((rows, w_up.shape[2]))
    _check("glu", h, row_weights, *glu_args)
    _check_mm_inputs(w_up.new_empty((rows, _width(h, glu_args[0]))), w_down, offs)
    return check_offs_values("grouped_mm", offs, rows) or []


def _glu_lean_plan(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    row_weights: Tensor | None,
    ends: list[int],
    rows: int,
    glu_args: _GluArgs,
) -> _GluPlan | None:
    """(the native kernels' ops, the activation's row chunk, whether w_down and w_up are
    column-major per expert, each GEMM's way) where every decision the four ops' CPU
    kernels take for this call is the common one: all six GEMMs by one call each
    (``torch._grouped_mm``, the native threaded kernel where ``threads_mm`` says so, or
    the native few-rows kernel for the four of x @ w where ``few_gemm`` says so) with the
    weight gradients' operand as the transposed view, the activation's native kernels,
    the native combines; else None. Memoized per force() state on what the decisions
    read (as ``grouped_swiglu``'s ``_lean_plan``)."""
    key = _lean_key("glu_combine_lean", x, w_up, w_down, row_weights, ends, rows, *glu_args)
    return _cpu_probe.memo(key, lambda: _decide_glu_lean(x, w_up, w_down, ends, rows, glu_args[0]))


def _decide_glu_lean(
    x: Tensor, w_up: Tensor, w_down: Tensor, ends: list[int], rows: int, activation: str
) -> _GluPlan | None:
    dt = w_up.dtype
    # (the native combine takes every dtype the native activations take)
    if not ends or ends[-1] == 0 or x.dtype != dt or w_down.dtype != dt:
        return None
    dim, width = x.shape[1], w_up.shape[2]
    # stand-ins for the fresh intermediates (the decisions read their metadata only)
    x_rows, grad_y = x.new_empty((rows, dim)), w_up.new_empty((rows, dim))
    h, dh = w_up.new_empty((rows, width)), w_up.new_empty((rows, width))
    a = w_up.new_empty((rows, _width(h, activation)))
    mod = _native_kernels(activation, h, a)  # forward (out) and backward (dA) alike
    if mod is None:
        return None
    down_t, up_t = experts_transposed(w_down), experts_transposed(w_up)
    gemms = [(x_rows, w_up), (a, w_down), (grad_y, w_down.transpose(-2, -1))]
    gemms.append((dh, w_up.transpose(-2, -1)))
    # the weight gradients (grouped_mm's / gather_grouped_mm's backward) in each weight's
    # own layout: grouped_mm_wgrad(dY, A)^T for a column-major weight, (A, dY) otherwise
    wgrads = [(grad_y, a) if down_t else (a, grad_y), (dh, x_rows) if up_t else (x_rows, dh)]
    ways = _lean_gemms(ends, gemms, wgrads)
    if ways is None:
        return None
    return mod, _act_chunk_rows(dt, a.shape[1]), down_t, up_t, ways


class _GLUCombine(torch.autograd.Function):
    """``grouped_glu_combine``'s lean node: the ops' CPU kernels where ``_glu_lean_plan``
    holds, forward, and backward in the order of the ops' formulas (unpermute's, then
    grouped_mm's, glu's, the bias's and gather_grouped_mm's)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        w_up: Tensor,
        w_down: Tensor,
        offs: Tensor,
        row_weights: Tensor | None,
        row_to_slot: Tensor,
        slot_to_row: Tensor,
        up_bias: Tensor | None,
        bias_rows: Tensor | None,
        glu_args: _GluArgs,
        plan: _GluPlan,
        end: int,
    ) -> Tensor:
        mod, step, ways = plan[0], plan[1], plan[4]
        tokens = _token_index(None, row_to_slot, slot_to_row)
        assert tokens is not None
        empty = _negative_positions(tokens)  # read once, for the three gathers
        if reads_gathered(x, ways[0], w_up.dtype):  # the GEMM reads the tokens' rows itself
            h = gathered_grouped_mm(x, tokens, w_up, offs)
        else:
            h = _whole_grouped_mm(gather_rows(x, tokens, empty), w_up, offs, end, ways[0])
        if up_bias is not None:
            h = h + up_bias.index_select(0, bias_rows)  # type: ignore[arg-type]
        a = h.new_empty((h.shape[0], _width(h, glu_args[0])))
        _native_forward(mod, h, row_weights, glu_args, step, a)
        y = _whole_grouped_mm(a, w_down, offs, end, ways[1])
        out = y.new_empty((slot_to_row.shape[0], y.shape[1]))
        mod.combine(y, slot_to_row, out)
        ctx.save_for_backward(
            x, w_up, w_down, offs, row_weights, row_to_slot, slot_to_row, h, a, bias_rows
        )
        # the bias (a parameter, not an activation) for its shape and a double backward
        ctx.lean = (glu_args, plan, end, tokens, empty, up_bias)
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        x, w_up, w_down, offs, row_weights, row_to_slot, slot_to_row, h, a, bias_rows = saved
        glu_args, plan, end, tokens, empty, up_bias = ctx.lean
        needs = ctx.needs_input_grad
        grads: list[Tensor | None] = [None] * 12
        if grad_out is None:
            return tuple(grads)
        if torch.is_grad_enabled():  # a double backward: the ops' graph, recomputed
            inputs = (x, w_up, w_down, offs, row_weights, row_to_slot, slot_to_row, up_bias)
            wanted = [i for i in (0, 1, 2, 4, 7) if needs[i]]
            out = _glu_ops(*inputs, bias_rows, glu_args)
            got = torch.autograd.grad(
                out, [inputs[i] for i in wanted], grad_out, create_graph=True, allow_unused=True
            )
            for i, g in zip(wanted, got, strict=True):
                grads[i] = g
            return tuple(grads)
        with no_cpu_autocast():
            _lean_backward_into(
                grads, grad_out, x, w_up, w_down, offs, row_weights, slot_to_row, h, a,
                bias_rows, up_bias, glu_args, plan, end, tokens, empty, needs,
            )  # fmt: skip
        return tuple(grads)


def _lean_backward_into(
    grads: list[Tensor | None],
    grad_out: Tensor,
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    offs: Tensor,
    row_weights: Tensor | None,
    slot_to_row: Tensor,
    h: Tensor,
    a: Tensor,
    bias_rows: Tensor | None,
    up_bias: Tensor | None,
    glu_args: _GluArgs,
    plan: _GluPlan,
    end: int,
    tokens: Tensor,
    empty: Tensor | None,
    needs: tuple[bool, ...],
) -> None:
    """``_GLUCombine``'s gradients into ``grads`` (its inputs' order)."""
    mod, step, down_t, up_t, ways = plan
    dt = w_up.dtype
    # unpermute's gather of grad_out, read by the GEMMs themselves where they can (as x's
    # below; the same bits)
    need_a = needs[0] or needs[1] or needs[4] or needs[7]
    fuse_gy = all(
        reads_gathered(grad_out, ways[i], dt) for i, need in ((2, need_a), (4, needs[2])) if need
    )
    grad_y = None if fuse_gy else gather_rows(grad_out, tokens, empty)
    # grouped_mm's: dA (what is upstream of a needs it), then dW_down in its own layout
    grad_a = None
    if need_a:
        if grad_y is None:
            grad_a = gathered_grouped_mm(grad_out, tokens, w_down.transpose(-2, -1), offs)
        else:
            grad_a = _whole_grouped_mm(grad_y, w_down.transpose(-2, -1), offs, end, ways[2])
    if needs[2]:
        if grad_y is None and down_t:
            dw_down = gathered_grouped_mm_wgrad(grad_out.t(), a, offs, tokens, None, ways[4])
            grads[2] = dw_down.transpose(-2, -1)
        elif grad_y is None:
            grads[2] = gathered_grouped_mm_wgrad(a.t(), grad_out, offs, None, tokens, ways[4])
        elif down_t:
            grads[2] = _whole_grouped_mm_wgrad(grad_y.t(), a, offs, ways[4]).transpose(-2, -1)
        else:
            grads[2] = _whole_grouped_mm_wgrad(a.t(), grad_y, offs, ways[4])
    del grad_y
    if grad_a is None:
        return
    # glu's
    dh = torch.empty_like(h)
    grad_rw = _native_backward(mod, grad_a, h, row_weights, glu_args, step, dh)
    del grad_a
    if needs[4] and row_weights is not None:
        grads[4] = _grad_rw_or_empty(grad_rw, row_weights, h)
    if needs[7] and up_bias is not None:  # the bias's, as autograd's IndexSelectBackward
        grads[7] = torch.ops.aten.index_select_backward(dh, up_bias.shape, 0, bias_rows)
    # gather_grouped_mm's: dX (the rows' gradients combined), then dW_up
    if needs[0]:
        grad_rows = _whole_grouped_mm(dh, w_up.transpose(-2, -1), offs, end, ways[3])
        grads[0] = grad_rows.new_empty((slot_to_row.shape[0], grad_rows.shape[1]))
        mod.combine(grad_rows, slot_to_row, grads[0])
        del grad_rows
    if needs[1] and reads_gathered(x, ways[5], dt):
        if up_t:
            grads[1] = gathered_grouped_mm_wgrad(dh.t(), x, offs, None, tokens, ways[5]).transpose(
                -2, -1
            )
        else:
            grads[1] = gathered_grouped_mm_wgrad(x.t(), dh, offs, tokens, None, ways[5])
    elif needs[1]:
        rows = gather_rows(x, tokens, empty)
        if up_t:
            grads[1] = _whole_grouped_mm_wgrad(dh.t(), rows, offs, ways[5]).transpose(-2, -1)
        else:
            grads[1] = _whole_grouped_mm_wgrad(rows.t(), dh, offs, ways[5])
