"""torch_moe's graph passes over Inductor's joint (forward + backward) and post-grad graphs.

Legend: T tokens, K top-k, D dim, F expert hidden dim, M expert-sorted rows, E experts.

The MoE layer's graph is a chain of ``torch_moe::`` ops: ``permute`` gathers token rows
into expert order, the experts run (``grouped_swiglu``, or two ``quantized_grouped_mm``
around ``swiglu`` with a low-precision recipe), ``unpermute`` combines. Each op is opaque
to Inductor, so by default every intermediate is materialized and the ones the backward
reads are saved. The passes rewrite that chain, in this order, each one but the last
exact (bit for bit the unfused graph on CPU, where the rewritten ops' kernels are
compositions of the originals):

1. ``decompose_scaled_gemms``: ``quantized_grouped_mm(x, w, offs, recipe)`` (and its dgrad
   and wgrad ops in the backward) become the quantize ops and ``scaled_grouped_mm``
   (``_wgrad``) over quantized operands, for the GEMMs ``decomposable`` accepts (see
   :mod:`torch_moe.quantization.scaled_grouped_mm`; others stay whole: never a wrong
   result), and where the decomposition's shapes would depend on data (tensorwise's one
   scale row, or none, over an expert-parallel layer's received rows, whose count is an
   unbacked SymInt): those stay whole too (counter ``data_dependent_skipped``).
2. ``cache_weight_quantization``: a quantization of an expert weight (a 3D graph input,
   through views and casts) becomes ``quantize_*_cached(weight, ...)``, recomputed only when
   the weight's version counter moves, i.e. once per optimizer step.
3. ``fuse_quantize``: ``quantize(permute(x))`` -> ``permute_quantize(x)`` (row-local blocks
   commute with the row gather: the T token rows are quantized once, e4m3 rows gathered),
   ``quantize_jagged(permute(x))`` -> ``permute_quantize_jagged(x)``, and
   ``quantize(swiglu(h))`` -> ``swiglu_quantize(h)`` (+ ``_jagged``). This covers the
   activations into both expert GEMMs and, in the backward, the output gradient the
   combine's backward permutes (dgrad and wgrad of the second GEMM). The high-precision
   [M, D] and [M, F] tensors then have no users: they are neither materialized in the
   forward nor saved.
4. ``fuse_gather``: ``grouped_swiglu(permute(x), ...)`` -> ``grouped_swiglu(x, ...,
   gather_index=row_to_slot // K)`` and the same for ``grouped_swiglu_backward``: the
   permuted [M, D] input is no longer saved for the backward (x, which the router's
   backward saves anyway, and an int64 index [M] are). The MoE layer already calls the
   op this way in eager (its permutation form, ``row_to_slot`` / ``slot_to_row``); this
   pass is for graphs that permute first (user code, HF's experts backend). And
   ``grouped_swiglu_backward(permute(g), ...)`` -> ``grouped_swiglu_backward(g, ...,
   grad_index=row_to_slot // K)``: the combine's backward gathers the tokens' gradient
   into expert order, a [M, D] copy, which the op's GEMMs (dA, dW2) then read through the
   index instead, as the eager layer's backward does (bit for bit; the compiled layer's
   step on the AMX Xeon measured went from 1.04 to 1.00x eager's at E = 64).

5. ``inline_combine`` (CPU): ``unpermute(y, slot_to_row, row_to_slot)`` without weights
   (the layer's combine, and the permute's backward) becomes its gather-and-sum in aten
   ops: each token's K rows gathered, converted to the accumulation dtype and added in
   k order, rounded once; the same operations in the same order as the op's CPU kernel,
   which Inductor fuses into one loop over [T, D] (no gathered [T, D] row per k
   materialized, converted and added in passes of their own). Bit for bit where the
   result is stored; a consumer Inductor fuses with it may read the fp32 sum before its
   rounding, as Inductor does with any low-precision intermediate (the router's input
   gradient added to it is such a case with or without this pass). A weighted combine stays
   an op (a product and a sum that a C++ compiler may contract into an FMA would round
   differently), and so does every combine off the CPU (the CUDA kernel is one pass).

6. ``inline_swiglu`` (CPU): ``grouped_swiglu`` and ``grouped_swiglu_backward`` become
   the grouped GEMM ops around the activation and its backward in aten ops (the kernels'
   fp32 math, rounded once), which Inductor fuses into one loop per direction instead of
   the op's ~5 / ~12 passes per row chunk, and whose intermediates it frees after their
   last use (the op holds them until it returns). Not bit for bit: Inductor's exp and
   sigmoid and the sum order of the routing weights' gradient differ from ATen's kernels
   in the last fp32 bits (outputs within one bf16 rounding step); ``config.inline_swiglu
   = False`` keeps the op where compiled and eager must agree bit for bit. Not where this
   CPU multiplies half precision in fp32 (no native bf16 GEMMs): the op's kernels then
   keep the activation in fp32 between the GEMMs, which the inlined graph would round.
   Not where the op's native activation kernels run (built, and the CPU probe's
   ``act_kernel`` measured them faster): one pass per direction and the op's measured GEMM
   ways run the layer faster than the inlined loops (compiled 1.01-1.06x eager's step
   against 1.09-1.25x inlined on the AMX Xeon measured), with eager's bits.

7. ``inline_glu`` (CPU): the composed experts' activation, ``glu`` and ``glu_backward``
   (swiglu / swigluoai, clamped or not, halves or interleaved, the ungated relu2), become
   the op's own formulas in aten ops (``torch_moe._ops.glu``'s ``_forward`` and
   ``_backward_parts``: fp32 math, one rounding), which Inductor fuses into one loop per
   direction instead of the op's passes per row chunk; the forward's nodes are tagged for
   recompute, so the backward keeps h (and the row weights) as the op does, and the
   activation itself, which the down GEMM saves for its weight gradient, is recomputed
   from h instead (one [M, F] fewer saved per routed row). Not bit for
   bit where the activation has an exp (Inductor's exp / sigmoid against ATen's; relu2 has
   none), within one rounding step of h's dtype; ``config.inline_glu = False`` keeps the
   op. The op rounds its output to h's dtype whatever the GEMMs' compute dtype, so the
   rewrite holds where this CPU upcasts half-precision GEMMs too. Not swigluoai where the
   op's native CPU kernel built (one pass per direction: GPT-OSS's compiled training step
   took 1.10x eager's time inlined, 0.90x with the op kept, the same peak).

``MoEGraphPass`` runs them as one ``CustomGraphPass`` whose ``uuid()`` hashes this
package's sources and its config, so Inductor's FX graph cache misses whenever a pass or
a lowering changes (a plain callable would make the cache bypass, a pass without its
source in the key would be served stale code).
"""

from __future__ import annotations

import functools
import hashlib
import operator
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from torch_moe._inductor import config
from torch_moe._inductor._fx import insert_traced, is_op, val
from torch_moe._ops import _native
from torch_moe._ops._dtypes import acc_dtype
from torch_moe._ops.glu import _NATIVE_DTYPES as _GLU_NATIVE_DTYPES
from torch_moe._ops.glu import _backward_parts, _forward
from torch_moe.quantization import get_recipe
from torch_moe.quantization.scaled_grouped_mm import (
    _scaled_gemm,
    _scaled_wgrad,
    decomposable,
    decomposable_wgrad,
)

__all__ = [
    "MoEGraphPass",
    "cache_weight_quantization",
    "decompose_scaled_gemms",
    "fuse_gather",
    "fuse_quantize",
    "inline_combine",
    "inline_glu",
    "inline_swiglu",
    "run_passes",
]

_ops = torch.ops.torch_moe
aten = torch.ops.aten


def _call(op: Any, *tensors: Any, tail: Any) -> Any:
    """``op(*tensors, *tail)``: a replacement with its non-tensor arguments bound."""
    return op(*tensors, *tail)


def _arg(node: fx.Node, index: int, name: str) -> Any:
    """The op argument at ``index`` (or passed as ``name``), None when left out."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name)


def _replace(graph: fx.Graph, node: fx.Node, fn: Callable[..., Any], inputs: list[fx.Node]) -> None:
    """Replace ``node`` by the traced ``fn(*inputs)`` (same output structure)."""
    new = insert_traced(graph, node, fn, inputs)
    if isinstance(new, (tuple, list)):  # a multi-output op: its users are getitems
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise RuntimeError(f"torch_moe._inductor: unexpected user {user} of {node}")
            index: Any = user.args[1]
            user.replace_all_uses_with(new[index])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(new)
    graph.erase_node(node)


def _try_replace(
    graph: fx.Graph, node: fx.Node, fn: Callable[..., Any], inputs: list[fx.Node]
) -> bool:
    """:func:`_replace`, or False (the graph untouched: the trace comes before any insert)
    where tracing ``fn`` needs a data-dependent decision, e.g. the scale count of a
    whole-dim quantization block over an expert-parallel layer's received rows (an unbacked
    SymInt: one scale row, or none for no rows). The op then stays an extern call."""
    try:
        _replace(graph, node, fn, inputs)
    except GuardOnDataDependentSymNode:
        _COUNTERS["data_dependent_skipped"] += 1
        return False
    return True


# --------------------------------------------------------------------------------------
# 1. decompose the high-precision scaled GEMM ops


def decompose_scaled_gemms(graph: fx.Graph) -> int:
    count = 0
    for node in list(graph.nodes):
        if is_op(node, _ops.quantized_grouped_mm):
            x, w, offs, recipe = node.args
            g = get_recipe(recipe).forward
            if decomposable(g):
                dt = val(x).dtype
                fn = functools.partial(_gemm, g=g, out_dtype=dt, transpose_b=False)
                count += _try_replace(graph, node, fn, [x, w, offs])
        elif is_op(node, _ops.quantized_grouped_mm_dgrad):
            dy, w, offs, recipe = node.args
            g = get_recipe(recipe).dgrad
            if decomposable(g):
                dt = val(dy).dtype
                fn = functools.partial(_gemm, g=g, out_dtype=dt, transpose_b=True)
                count += _try_replace(graph, node, fn, [dy, w, offs])
        elif is_op(node, _ops.quantized_grouped_mm_wgrad):
            x, dy, offs, recipe = node.args
            g = get_recipe(recipe).wgrad
            if decomposable_wgrad(g):
                dt = val(x).dtype
                fn = functools.partial(_wgrad, g=g, out_dtype=dt)
                count += _try_replace(graph, node, fn, [x, dy, offs])
    return count


def _gemm(a, b, offs, *, g, out_dtype, transpose_b):  # type: ignore[no-untyped-def]
    return _scaled_gemm(a, b.transpose(-2, -1) if transpose_b else b, offs, g, out_dtype)


def _wgrad(x, dy, offs, *, g, out_dtype):  # type: ignore[no-untyped-def]
    return _scaled_wgrad(x, dy, offs, g, out_dtype)


# --------------------------------------------------------------------------------------
# 2. the weights' quantization, cached per version of the weight

_PASS_THROUGH = (
    aten.transpose.int,
    aten.permute.default,
    aten.t.default,
    aten.view.default,
    aten.clone.default,
    aten._to_copy.default,
    torch.ops.prims.convert_element_type.default,
)


def _graph_input_source(node: Any) -> fx.Node | None:
    """The graph input ``node`` is a view or cast of (through ``_PASS_THROUGH``), or None."""
    while isinstance(node, fx.Node):
        if node.op == "placeholder":
            return node
        if node.op != "call_function" or node.target not in _PASS_THROUGH:
            return None
        node = node.args[0]
    return None


def cache_weight_quantization(graph: fx.Graph) -> int:
    count = 0
    for node in list(graph.nodes):
        if not (is_op(node, _ops.quantize_fp8) or is_op(node, _ops.quantize_mx)):
            continue
        x = node.args[0]
        source = _graph_input_source(x)
        if source is None or val(x).dim() != 3:  # expert weights are [E, *, *] inputs
            continue
        if is_op(node, _ops.quantize_fp8):
            fn = functools.partial(_call, _ops.quantize_fp8_cached, tail=node.args[1:2])
        else:
            fn = functools.partial(_call, _ops.quantize_mx_cached, tail=node.args[1:4])
        _replace(graph, node, fn, [source, x])
        count += 1
    return count


# --------------------------------------------------------------------------------------
# 3. quantization fused into its producer (permute, swiglu)


def _no_weights(permute: fx.Node) -> bool:
    return _arg(permute, 3, "weights") is None


def _row_local(node: fx.Node) -> tuple[Any, ...] | None:
    """(fmt, block, scale_rule) when ``node`` quantizes blocks along rows, else None."""
    if is_op(node, _ops.quantize_fp8):
        block: Any = node.args[1]
        return ("fp8", block[1], "floor") if block[0] == 1 else None
    if is_op(node, _ops.quantize_mx):
        _, dim, mx_block, rule = node.args
        return ("mx", mx_block, rule) if dim in (-1, 1) else None
    return None


def fuse_quantize(graph: fx.Graph) -> int:
    count = 0
    for node in list(graph.nodes):
        if not (
            is_op(node, _ops.quantize_fp8)
            or is_op(node, _ops.quantize_mx)
            or is_op(node, _ops.quantize_jagged)
        ):
            continue
        src = node.args[0]
        if is_op(src, _ops.permute) and _no_weights(src):
            x, r2s, s2r = src.args[:3]
            if is_op(node, _ops.quantize_jagged):
                _, offs, block, fmt, rule = node.args
                fn = functools.partial(_call, _ops.permute_quantize_jagged, tail=(block, fmt, rule))
                _replace(graph, node, fn, [x, r2s, s2r, offs])
                count += 1
            elif (spec := _row_local(node)) is not None:
                fn = functools.partial(_call, _ops.permute_quantize, tail=spec)
                _replace(graph, node, fn, [x, r2s, s2r])
                count += 1
        elif is_op(src, _ops.swiglu):
            h = src.args[0]
            rw = _arg(src, 1, "row_weights")
            if not isinstance(rw, fx.Node):  # no routing weights: bind None
                rw = None
            inputs = [h] if rw is None else [h, rw]
            if is_op(node, _ops.quantize_jagged):
                _, offs, block, fmt, rule = node.args
                fn = functools.partial(
                    _swiglu_jagged, with_weights=rw is not None, tail=(block, fmt, rule)
                )
                _replace(graph, node, fn, [*inputs, offs])
                count += 1
            elif (spec := _row_local(node)) is not None:
                fn = functools.partial(_swiglu_rows, with_weights=rw is not None, tail=spec)
                _replace(graph, node, fn, inputs)
                count += 1
    return count


def _swiglu_rows(h: Any, *rest: Any, with_weights: bool, tail: Any) -> Any:
    rw = rest[0] if with_weights else None
    return _ops.swiglu_quantize(h, rw, *tail)


def _swiglu_jagged(h: Any, *rest: Any, with_weights: bool, tail: Any) -> Any:
    rw, offs = (rest[0], rest[1]) if with_weights else (None, rest[0])
    return _ops.swiglu_quantize_jagged(h, rw, offs, *tail)


# --------------------------------------------------------------------------------------
# 4. the permute's gather fused into grouped_swiglu (forward and backward)


def _set_args(node: fx.Node, args: tuple[Any, ...]) -> None:
    """New arguments for a node, and the eager input values Inductor checks strides against
    (recorded at tracing, they would describe the old arguments)."""
    node.args = args
    if "eager_input_vals" in node.meta:
        node.meta["eager_input_vals"] = (tuple(val(a) for a in args), {})


def _token_of_row(row_to_slot: Any, *, top_k: int) -> Any:
    return torch.div(row_to_slot, top_k, rounding_mode="floor")  # -1 (padding) stays -1


def _fuse_grad_gather(graph: fx.Graph, node: fx.Node) -> bool:
    """``grouped_swiglu_backward(permute(g), ...)`` -> ``grouped_swiglu_backward(g, ...,
    grad_index=row_to_slot // K)``: the combine's backward gathers the tokens' gradient into
    expert order, which the op's GEMMs (dA, dW2) then read through the index."""
    args = list(node.args) + [None] * (10 - len(node.args))
    grad_perm = args[0]
    if node.kwargs or args[9] is not None or not isinstance(grad_perm, fx.Node):
        return False
    if not (is_op(grad_perm, _ops.permute) and _no_weights(grad_perm)):
        return False
    g, r2s, s2r = grad_perm.args[:3]
    if not isinstance(r2s, fx.Node):
        return False
    top_k = val(s2r).shape[1]
    index = insert_traced(graph, node, functools.partial(_token_of_row, top_k=top_k), [r2s])
    _set_args(node, (g, *args[1:9], index))
    return True


def fuse_gather(graph: fx.Graph) -> int:
    count = 0
    for node in list(graph.nodes):
        if is_op(node, _ops.grouped_swiglu_backward):
            count += _fuse_grad_gather(graph, node)
            continue
        if not is_op(node, _ops.grouped_swiglu) or node.kwargs:
            continue
        if any(a is not None for a in node.args[5:]):  # gathers already
            continue
        x_perm = node.args[0]
        if not (is_op(x_perm, _ops.permute) and _no_weights(x_perm)):
            continue
        x, r2s, s2r = x_perm.args[:3]
        top_k = val(s2r).shape[1]
        index = insert_traced(graph, node, functools.partial(_token_of_row, top_k=top_k), [r2s])
        args = list(node.args) + [None] * (5 - len(node.args))
        _set_args(node, (x, *args[1:5], index))
        # the backward reads the saved permuted input: it gathers from x too
        for user in list(x_perm.users):
            if is_op(user, _ops.grouped_swiglu_backward) and user.args[2] is x_perm:
                bargs = list(user.args) + [None] * (8 - len(user.args))
                bargs[2] = x
                _set_args(user, (*bargs[:8], index))
        count += 1
    return count


# --------------------------------------------------------------------------------------
# 5. the unweighted combine as Inductor code (CPU)


def _combine_rows(y: Any, slot_to_row: Any, *, top_k: int, acc: torch.dtype) -> Any:
    """``unpermute(y, slot_to_row, row_to_slot)`` as its CPU kernel computes it: token t's
    rows ``slot_to_row[t, k]`` gathered, in ``acc``, a dropped slot's (-1) row exactly 0,
    summed in k order, rounded once to y's dtype."""
    dropped = slot_to_row < 0
    rows = slot_to_row.clamp(min=0)
    out: Any = None
    for k in range(top_k):
        y_k = y.index_select(0, rows[:, k]).to(acc).masked_fill(dropped[:, k, None], 0)
        out = y_k if out is None else out + y_k
    return out.to(y.dtype)


def inline_combine(graph: fx.Graph) -> int:
    count = 0
    for node in list(graph.nodes):
        if not is_op(node, _ops.unpermute) or _arg(node, 3, "weights") is not None:
            continue
        y, slot_to_row = node.args[:2]
        y_val, top_k = val(y), val(slot_to_row).shape[1]
        rows = y_val.shape[0]
        if y_val.device.type != "cpu" or not isinstance(top_k, int) or top_k < 1:
            continue
        if isinstance(rows, int) and rows == 0:  # nothing to gather from: the op's own path
            continue
        fn = functools.partial(_combine_rows, top_k=top_k, acc=acc_dtype(y_val.dtype))
        _replace(graph, node, fn, [y, slot_to_row])
        count += 1
    return count


# --------------------------------------------------------------------------------------
# 6. grouped SwiGLU's activation as Inductor code (CPU)


def _gathered(x: Any, gather_index: Any) -> Any:
    """``gather_rows(x, gather_index)``'s values in out-of-place ops (the graphs these
    passes rewrite are functional; ``gather_rows`` fills its -1 rows in place)."""
    rows = x.index_select(0, gather_index.clamp(min=0))
    return rows.masked_fill((gather_index < 0).unsqueeze(1), 0)


def _swiglu_forward(
    x: Any,
    w13: Any,
    w2: Any,
    offs: Any,
    *rest: Any,
    weighted: bool,
    gathered: bool,
    top_k: int | None = None,
) -> Any:
    """``grouped_swiglu``: the two grouped GEMMs as the op, the activation between them as
    its CPU kernel computes it (fp32, silu(g) = g / (1 + exp(-g)), ATen's formula, one
    rounding), in aten ops that Inductor fuses into one loop. ``gathered``: the last input
    is the gather index, or with ``top_k`` the row_to_slot map (the op's permutation form,
    whose backward node in the joint graph already has its own gather index)."""
    rw = rest[0] if weighted else None
    x_rows = x
    if gathered:
        index = rest[-1] if top_k is None else _token_of_row(rest[-1], top_k=top_k)
        x_rows = _gathered(x, index).to(w13.dtype)  # the op converts gathered rows
    h = _ops.grouped_mm(x_rows, w13.transpose(-2, -1), offs)
    acc = acc_dtype(h.dtype)
    hidden = w2.shape[2]
    hf = h.to(acc)
    gate, up = hf[:, :hidden], hf[:, hidden:]
    a = gate / (1 + torch.exp(-gate)) * up
    if rw is not None:
        a = a * rw.to(acc).unsqueeze(1)
    return _ops.grouped_mm(a.to(h.dtype), w2.transpose(-2, -1), offs), h


def _swiglu_backward(
    grad_y: Any,
    *rest: Any,
    has_grad_h: bool,
    weighted: bool,
    gathered: bool,
    grad_gathered: bool = False,
) -> Any:
    """``grouped_swiglu_backward``: the four grouped GEMMs as the op, the activation's
    backward as its CPU kernel computes it (``_act_backward_into``: silu_backward's
    dy * s * (1 + g * (1 - s))), in aten ops. ``grad_gathered``: the last input is the
    op's grad_index, whose rows of grad_y are the rows' gradient."""
    args = list(rest)
    if grad_gathered:
        grad_y = _gathered(grad_y, args.pop())
    grad_h = args.pop(0) if has_grad_h else None
    x, h, w13, w2, offs = args[:5]
    rw = args[5] if weighted else None
    acc = acc_dtype(h.dtype)
    hidden = w2.shape[2]
    grad_a = _ops.grouped_mm(grad_y, w2, offs)
    hf = h.to(acc)
    gate, up = hf[:, :hidden], hf[:, hidden:]
    sig = 1 / (1 + torch.exp(-gate))  # ATen's CPU formula, not its bits (its own exp)
    silu = gate * sig
    ga = grad_a.to(acc)
    a = silu * up
    grad_rw: Any = None
    if rw is not None:
        rw_acc = rw.to(acc).unsqueeze(1)
        grad_rw = (ga * a).sum(-1)
        a = a * rw_acc
        ga = ga * rw_acc
    a_out = a.to(h.dtype)
    grad_up = silu * ga
    grad_gate = ga * up * sig * (1 + gate * (1 - sig))  # silu_backward's formula
    dh = torch.cat([grad_gate, grad_up], dim=-1).to(h.dtype)
    if grad_h is not None:
        dh = dh + grad_h
    dw2 = _ops.grouped_mm_wgrad(grad_y, a_out, offs)
    # the input rows gathered here, and dW13 before dX, as the op: one [M, D] at a time
    x_rows = _gathered(x, args[-1]).to(w13.dtype) if gathered else x
    dw13 = _ops.grouped_mm_wgrad(dh, x_rows, offs)
    dx = _ops.grouped_mm(dh, w13, offs)
    if rw is None:
        return dx, dw13, dw2, torch.empty((0,), dtype=torch.float32, device=x.device)
    return dx, dw13, dw2, grad_rw.to(rw.dtype)


def _prefer_recompute(nodes: Any) -> None:
    """Tag the forward's activation (and gather) nodes for the partitioner to recompute in
    the backward, as the op's backward does, instead of saving their [M, *] outputs: only
    h, the first GEMM's output, stays saved. The GEMMs themselves are not tagged."""
    from torch.utils.checkpoint import CheckpointPolicy

    for n in nodes:
        if n.op == "call_function" and not is_op(n, _ops.grouped_mm):
            n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE


def _upcasts(dtype: torch.dtype) -> bool:
    """Whether this CPU's kernels multiply ``dtype`` in fp32 (``cpu_compute_dtype``): then
    the op keeps the activation in fp32 between its GEMMs (one rounding less than a graph
    that rounds it to ``dtype``), and ``inline_swiglu`` leaves the op alone."""
    from torch_moe._ops.grouped_mm import cpu_compute_dtype

    return dtype in (torch.bfloat16, torch.float16) and cpu_compute_dtype(dtype) != dtype


def _native_act(dtype: torch.dtype) -> bool:
    """Whether the op runs the activation in ``dtype`` by its native row kernels here
    (built, and the CPU probe's ``act_kernel`` choice: ``grouped_swiglu._uses_native``):
    one pass over h per direction and the op's own measured GEMM ways, which run the layer
    faster than Inductor's inlined loops around the grouped GEMM ops, so ``inline_swiglu``
    leaves the op (on the AMX Xeon measured, one thread, the compiled layer's step took
    1.01-1.06x eager's with the op kept, 1.09-1.20x inlined; two threads 1.06x and 1.25x:
    benchmarks/results/compile_cpu_202612.md)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from torch_moe._ops.grouped_swiglu import _uses_native

    with _disable_current_modes():  # (its first call checks the kernels on real tensors)
        return _uses_native(dtype)


def _keeps_swiglu(dtype: torch.dtype) -> bool:
    """Whether ``inline_swiglu`` leaves grouped_swiglu (and its backward) in ``dtype`` an
    op on this CPU: ``_upcasts`` or ``_native_act``."""
    return _upcasts(dtype) or _native_act(dtype)


def inline_swiglu(graph: fx.Graph) -> int:
    count = 0
    for node in list(graph.nodes):
        if is_op(node, _ops.grouped_swiglu):
            x, w13, w2, offs = node.args[:4]
            rw, gi = _arg(node, 4, "row_weights"), _arg(node, 5, "gather_index")
            r2s, s2r = _arg(node, 6, "row_to_slot"), _arg(node, 7, "slot_to_row")
            if val(x).device.type != "cpu" or _keeps_swiglu(val(w13).dtype):
                continue
            top_k = None
            if r2s is not None:
                gi, top_k = r2s, val(s2r).shape[1]
            extra = [n for n in (rw, gi) if n is not None]
            fn = functools.partial(
                _swiglu_forward, weighted=rw is not None, gathered=gi is not None, top_k=top_k
            )
            before = set(graph.nodes)
            _replace(graph, node, fn, [x, w13, w2, offs, *extra])
            _prefer_recompute(n for n in graph.nodes if n not in before)
            count += 1
        elif is_op(node, _ops.grouped_swiglu_backward):
            grad_y, grad_h, x, h, w13, w2, offs = node.args[:7]
            rw, gi = _arg(node, 7, "row_weights"), _arg(node, 8, "gather_index")
            grad_index = _arg(node, 9, "grad_index")
            if val(x).device.type != "cpu" or _keeps_swiglu(val(w13).dtype):
                continue
            inputs = [grad_y, *([grad_h] if grad_h is not None else []), x, h, w13, w2, offs]
            inputs += [n for n in (rw, gi, grad_index) if n is not None]
            fn = functools.partial(
                _swiglu_backward,
                has_grad_h=grad_h is not None,
                weighted=rw is not None,
                gathered=gi is not None,
                grad_gathered=grad_index is not None,
            )
            _replace(graph, node, fn, inputs)
            count += 1
    return count


def _glu_forward(h: Any, *rest: Any, weighted: bool, args: tuple[Any, ...]) -> Any:
    return _forward(h, rest[0] if weighted else None, *args)


def _glu_backward(grad_a: Any, h: Any, *rest: Any, weighted: bool, args: tuple[Any, ...]) -> Any:
    rw = rest[0] if weighted else None
    parts, grad_rw = _backward_parts(grad_a, h, rw, *args)
    if len(parts) == 1:  # ungated
        dh = parts[0]
    elif args[-1]:  # interleaved: gate column 2f, up column 2f + 1
        dh = torch.stack(list(parts), dim=-1).flatten(1)
    else:
        dh = torch.cat(list(parts), dim=-1)
    dh = dh.to(h.dtype)
    if rw is None or grad_rw is None:
        return dh, torch.empty((0,), dtype=torch.float32, device=h.device)
    return dh, grad_rw.to(rw.dtype)


def _glu_native(dtype: torch.dtype, activation: Any) -> bool:
    """Whether the glu op runs swigluoai in ``dtype`` by its native CPU kernel here (built;
    the op checks its bits on first use and otherwise falls back): one pass per direction,
    faster than Inductor's inlined loops (GPT-OSS's training step: 0.90x eager with the op
    kept, 1.10x inlined), and eager's bits."""
    return activation == "swigluoai" and dtype in _GLU_NATIVE_DTYPES and _native.available()


def inline_glu(graph: fx.Graph) -> int:
    count = 0
    for node in list(graph.nodes):
        forward = is_op(node, _ops.glu)
        if not forward and not is_op(node, _ops.glu_backward):
            continue
        tensors = 1 if forward else 2  # (h) or (grad_a, h), then row_weights
        h = node.args[tensors - 1]
        rw = _arg(node, tensors, "row_weights")
        names = ("activation", "alpha", "limit", "interleaved")
        args = tuple(_arg(node, tensors + 1 + i, n) for i, n in enumerate(names))
        if val(h).device.type != "cpu" or _glu_native(val(h).dtype, args[0]):
            continue
        inputs = [*node.args[:tensors], *([rw] if rw is not None else [])]
        fn = functools.partial(
            _glu_forward if forward else _glu_backward, weighted=rw is not None, args=args
        )
        before = set(graph.nodes)
        _replace(graph, node, fn, inputs)
        if forward:
            _prefer_recompute(n for n in graph.nodes if n not in before)
        count += 1
    return count


# --------------------------------------------------------------------------------------
# all passes as one CustomGraphPass


def run_passes(graph: fx.Graph) -> dict[str, int]:
    """Run the enabled passes in order on ``graph``; returns the rewrites per pass."""
    counts = {}
    for name, fn in (
        ("decompose_scaled_gemms", decompose_scaled_gemms),
        ("cache_weight_quantization", cache_weight_quantization),
        ("fuse_quantize", fuse_quantize),
        ("fuse_gather", fuse_gather),
        ("inline_combine", inline_combine),
        ("inline_swiglu", inline_swiglu),
        ("inline_glu", inline_glu),
    ):
        if getattr(config, name):
            counts[name] = fn(graph)
    if any(counts.values()):
        graph.eliminate_dead_code()
        graph.lint()
    for name, n in counts.items():
        _COUNTERS[name] += n
    return counts


_COUNTERS: dict[str, int] = {
    "decompose_scaled_gemms": 0,
    "cache_weight_quantization": 0,
    "fuse_quantize": 0,
    "fuse_gather": 0,
    "inline_combine": 0,
    "inline_swiglu": 0,
    "inline_glu": 0,
    "ep_chunks": 0,  # expert-parallel layers split into chunks (ep_chunk.py)
    "ep_chunk_skipped": 0,  # one-chunk layers that pass could not split
    "ep_chunk_word_missing": 0,  # layers it split whose plan's mode word it did not find
    "data_dependent_skipped": 0,  # scaled GEMMs left whole (_try_replace)
}


def counters() -> dict[str, int]:
    """Rewrites made by each pass since the process started (or :func:`reset_counters`)."""
    return dict(_COUNTERS)


def reset_counters() -> None:
    for name in _COUNTERS:
        _COUNTERS[name] = 0


_SOURCES = (
    *(
        os.path.join(os.path.dirname(__file__), name)
        for name in ("passes.py", "_fx.py", "config.py", "lowering.py", "ep_overlap.py")
    ),
    # inline_glu traces the op's own formulas
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "_ops", "glu.py"),
)


class MoEGraphPass(CustomGraphPass):
    """torch_moe's passes (module docstring) as an Inductor ``CustomGraphPass``.

    ``uuid()`` hashes the sources of the passes and of the lowerings and the config values,
    so a change to any of them changes Inductor's FX graph cache key.
    """

    def __call__(self, graph: fx.Graph) -> None:
        run_passes(graph)

    def uuid(self) -> bytes:
        settings = repr(sorted(config.get_config_copy().items()))  # type: ignore[attr-defined]
        # what inline_swiglu does depends on this process's half-precision GEMM decision
        # and its activation kernel's
        settings += repr([_upcasts(dt) for dt in (torch.bfloat16, torch.float16)])
        settings += repr([_native_act(dt) for dt in (torch.bfloat16, torch.float16, torch.float32)])
        # and inline_glu's on whether the glu op's native kernel built
        settings += repr(_native.available())
        digest = get_hash_for_files(_SOURCES)
        return hashlib.sha256(digest + settings.encode()).digest()
