"""The expert-parallel chunk pass: split a layer's one exchange into C, before autograd.

An expert-parallel MoE layer traced with one chunk (``ExpertParallel()``, the default) runs

    x_recv, w_recv = ep_dispatch(x_perm, row_w, counts, ..., 0, El)       # every rank's rows
    offs = ep_chunk_offsets(counts, E, R, 0, El)                        # their group ends
    w13, w2 = w13_local[0:El], w2_local[0:El]                           # expert_range
    y = <the experts: grouped GEMMs of x_recv, w13, w2 by offs>
    part = ep_combine(y, counts, ..., 0, El, ..., M)                     # back to the senders

With ``config.ep_chunks = C`` this pass rewrites that region into what
``ExpertParallel(num_chunks=C)`` traces: for each chunk [l0, l1) of the local experts
(``chunk_bounds``: the dispatcher's own split) a copy of every node from the dispatch to
the combine, with the chunk's bounds in ``ep_dispatch``, ``ep_chunk_offsets``, the
weights' ``expert_range`` slices and ``ep_combine``, and the C combines added in chunk
order (``part_0 + part_1 + ...``). The graph then runs what eager chunking runs: the same
ops on the same rows, so compiled equals eager chunking bit for bit. (Eager
``ExpertParallel(num_chunks=C)`` takes each chunk's weights from one split of the local
weights, ``GroupedExperts.split_weights``, where the pass keeps a slice per chunk: the same
values; the slices' backward scatters each chunk's weight gradient into a zero-filled
gradient of all local experts, which the split avoids in eager.)

The plan's mode word (the ranks' modes, compared by every exchange) says the chunks too:
the pass writes C into the word the layer's plan sends (the ``new_full`` fill of the plan's
all-to-all input), so that ranks compiled with different ``ep_chunks`` raise at their
first exchange, naming each rank's chunks, instead of waiting for rows of another chunk
until the group's timeout. (A plan it cannot find is left as traced, and counted in
``counters()["ep_chunk_word_missing"]``.)

It runs on the pre-grad graph (Inductor's ``pre_grad_custom_pass``, Dynamo's Torch IR)
because there the region is forward code only: AOTAutograd then derives the chunked
backward (each chunk's ``ep_combine_backward`` -> experts' backward ->
``ep_dispatch_backward``) exactly as it does for a layer traced with C chunks, and the
post-grad overlap pass (:mod:`torch_moe._inductor.ep_overlap`) issues chunk c+1's exchange
while chunk c's experts compute, in the forward and the backward.

What the pass relies on, and checks (a layer that does not match is left whole, and counted
in ``torch_moe._inductor.counters()["ep_chunk_skipped"]``):

* the layer was traced with one chunk: ``ep_dispatch`` over all local experts, with its
  ``ep_chunk_offsets`` and one ``ep_combine`` of the same plan and bounds downstream;
* the region between them is a function of the dispatched rows, the group ends and the
  expert weights (and biases) sliced to the chunk (``w[l0:l1]`` on a tensor of El experts,
  >= 2-D; at least one such slice, else the experts would read every local expert's
  weights), as
  ``GroupedExperts.forward`` is: every node the dispatch, the offsets or those slices reach
  before the combine is used only inside the region (nothing escapes around the combine),
  and none of them mutates or has another side effect than a runtime assert.
"""

from __future__ import annotations

import hashlib
import operator
import os
from typing import Any, cast

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from torch_moe._inductor import config
from torch_moe._inductor._fx import is_op
from torch_moe._inductor.passes import _COUNTERS
from torch_moe.distributed import dispatch as _dispatch  # (registers the ep ops)
from torch_moe.distributed.dispatch import chunk_bounds, with_chunks

__all__ = ["EPChunkPass", "split_layers"]

_ops = torch.ops.torch_moe
# positional layouts (the dispatcher calls the ops positionally)
_DISPATCH_ARGS, _DISPATCH_L0 = 10, 5  # (x, w, counts, group, E, l0, l1, exchange, node, fp8)
_COMBINE_ARGS, _COMBINE_L0 = 9, 4  # (y, counts, group, E, l0, l1, exchange, node, rows)
_OFFSETS_ARGS, _OFFSETS_L0 = 5, 3  # (counts, E, world, l0, l1)
_ASSERTS = (torch.ops.aten._assert_scalar.default, torch._check, torch._check_is_size)


def _ints(node: fx.Node, *positions: int) -> tuple[int, ...] | None:
    """The node's positional arguments at ``positions`` when all are Python ints."""
    values = tuple(node.args[i] if i < len(node.args) else None for i in positions)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return values  # type: ignore[return-value]
    return None


def _example(node: Any) -> Any:
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def _slice_of_experts(node: fx.Node, l0: int, l1: int) -> bool:
    """Whether ``node`` is ``w[l0:l1]`` (dim 0) of a >= 2-D tensor of l1 - l0 experts (an
    expert weight, or an expert bias [El, N])."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem and len(node.args) == 2:
        index = node.args[1]
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        if not isinstance(index, slice) or index.step not in (None, 1):
            return False
        bounds = (index.start or 0, index.stop)
    elif is_op(node, torch.ops.aten.slice) and len(node.args) >= 4 and node.args[1] == 0:
        if len(node.args) > 4 and node.args[4] != 1:
            return False
        bounds = (node.args[2], node.args[3])
    else:
        return False
    src = _example(node.args[0])
    return (
        bounds == (l0, l1)
        and isinstance(src, torch.Tensor)
        and src.dim() >= 2  # weights [El, N, K] and biases [El, N]
        and src.shape[0] == l1 - l0
    )


def _rebound(node: fx.Node, kind: str, bounds: tuple[int, int]) -> None:
    """Put the chunk's bounds into a copied seed node."""
    a, b = bounds
    args = list(node.args)
    if kind == "dispatch":
        args[_DISPATCH_L0 : _DISPATCH_L0 + 2] = [a, b]
    elif kind == "combine":
        args[_COMBINE_L0 : _COMBINE_L0 + 2] = [a, b]
    elif kind == "offsets":
        args[_OFFSETS_L0 : _OFFSETS_L0 + 2] = [a, b]
    elif node.target is operator.getitem:
        args[1] = slice(a, b, None)
    else:  # aten.slice.Tensor(w, 0, start, end[, step])
        args[2:4] = [a, b]
    node.args = tuple(args)


def _closure(starts: list[fx.Node], downward: bool) -> set[fx.Node]:
    """``starts`` and every node reachable from them through users (``downward``) or
    through inputs."""
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.users if downward else n.all_input_nodes)
    return seen


def _reach(starts: list[fx.Node]) -> set[fx.Node]:
    return _closure(starts, downward=True)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    return _closure([node], downward=False)


def _layer(graph: fx.Graph, dispatch: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(offsets, combine, weight slices) of a one-chunk layer whose dispatch is given, or
    None when the layer is not one the pass can split."""
    if dispatch.kwargs or not _covers_all_local_experts(dispatch):
        return None
    args = dispatch.args
    counts = cast(fx.Node, args[2])
    E, l0, l1 = cast(tuple[int, int, int], _ints(dispatch, 4, 5, 6))
    group, exchange, node_size = args[3], args[7], args[8]
    offsets = [
        u
        for u in counts.users
        if is_op(u, _ops.ep_chunk_offsets)
        and len(u.args) == _OFFSETS_ARGS
        and _ints(u, 1, 3, 4) == (E, l0, l1)
    ]
    if len(offsets) != 1:
        return None
    downstream = _reach([dispatch])
    combines = [
        u
        for u in counts.users
        if is_op(u, _ops.ep_combine)
        and u in downstream
        and len(u.args) == _COMBINE_ARGS
        and not u.kwargs
        and u.args[2:8] == (group, E, l0, l1, exchange, node_size)
    ]
    if len(combines) != 1:
        return None
    combine = combines[0]
    slices = [n for n in _ancestors(combine) if _slice_of_experts(n, l0, l1)]
    slices = [n for n in slices if n not in downstream]  # weights, not dispatched rows
    if not slices:
        return None
    return offsets[0], combine, slices


def _region(seeds: list[fx.Node], combine: fx.Node) -> list[fx.Node] | None:
    """The nodes to copy per chunk (graph order), or None when the region is not closed."""
    after = _reach(list(combine.users))
    region = _reach(seeds) - after - {combine}
    for n in region:
        if any(u not in region and u is not combine for u in n.users):
            return None  # a value escapes around the combine
        method = n.target if n.op == "call_method" and isinstance(n.target, str) else ""
        if method.endswith("_") and not method.startswith("__"):
            return None  # an in-place method
        if not n.users and not (n.op == "call_function" and n.target in _ASSERTS):
            return None  # a side effect
        if n.op not in ("call_function", "call_method"):
            return None
    if not _ancestors(combine) >= set(seeds):
        return None
    order = {n: i for i, n in enumerate(combine.graph.nodes)}
    return sorted(region, key=order.__getitem__)


def _copy(graph: fx.Graph, node: fx.Node, env: dict[fx.Node, fx.Node]) -> fx.Node:
    with graph.inserting_before(node):
        new = graph.node_copy(node, lambda a: env.get(a, a))
    # the original's fake value has the whole layer's sizes; AOTAutograd re-traces the
    # graph and makes each chunk's own (a fresh unbacked SymInt per dispatch)
    for key in ("example_value", "val", "unbacked_bindings", "tensor_meta"):
        new.meta.pop(key, None)
    return new


def _split(graph: fx.Graph, dispatch: fx.Node, num_chunks: int) -> str:
    """Split one layer: "split", "chunked" (traced with several chunks already, or one
    local expert: nothing to do) or "skipped" (a one-chunk layer the pass cannot prove
    splittable; module doc)."""
    found = _layer(graph, dispatch)
    if found is None:
        return "skipped" if _covers_all_local_experts(dispatch) else "chunked"
    offsets, combine, slices = found
    l0, l1 = cast(tuple[int, int], _ints(dispatch, _DISPATCH_L0, _DISPATCH_L0 + 1))
    C = min(num_chunks, l1 - l0)
    if C < 2:
        return "chunked"
    region = _region([dispatch, offsets, *slices], combine)
    if region is None:
        return "skipped"
    kinds = {dispatch: "dispatch", offsets: "offsets", **dict.fromkeys(slices, "slice")}
    chunks = chunk_bounds(l0, l1, C)
    envs: list[dict[fx.Node, fx.Node]] = [{} for _ in chunks]
    for node in region:
        for env, bounds in zip(envs, chunks, strict=True):
            env[node] = _copy(graph, node, env)
            if node in kinds:
                _rebound(env[node], kinds[node], bounds)
    total: fx.Node | None = None
    for env, bounds in zip(envs, chunks, strict=True):
        part = _copy(graph, combine, env)
        _rebound(part, "combine", bounds)
        if total is not None:  # the dispatcher's order: ((part_0 + part_1) + part_2) ...
            with graph.inserting_before(combine):
                total = graph.call_function(operator.add, (total, part))
        else:
            total = part
    counts = dispatch.args[2]  # (before the dispatch is erased)
    combine.replace_all_uses_with(total)  # type: ignore[arg-type]
    graph.erase_node(combine)
    for node in reversed(region):
        graph.erase_node(node)
    if not _mark_plan(counts, C):
        _COUNTERS["ep_chunk_word_missing"] += 1
    return "split"


_SEARCH = 64  # nodes visited upstream, per search


def _upstream(node: Any, match: Any) -> fx.Node | None:
    """The nearest node at or above ``node`` (breadth first, at most ``_SEARCH``) that
    ``match``es, else None."""
    seen: set[fx.Node] = set()
    queue = [node] if isinstance(node, fx.Node) else []
    while queue and len(seen) < _SEARCH:
        n = queue.pop(0)
        if n in seen:
            continue
        seen.add(n)
        if match(n):
            return n
        queue.extend(n.all_input_nodes)
    return None


def _mark_plan(counts: Any, num_chunks: int) -> bool:
    """Write ``num_chunks`` into the mode word of the plan ``counts`` (the dispatcher's
    ``plan``: ``cat([counts_RL, counts_RL.new_full((R, 1), word)], 1)`` through one
    ``all_to_all_single``); whether it was found."""
    a2a = _upstream(counts, lambda n: is_op(n, torch.ops._c10d_functional.all_to_all_single))
    if a2a is None or not a2a.args:
        return False
    word = _upstream(a2a.args[0], lambda n: n.op == "call_method" and n.target == "new_full")
    if word is None:
        return False
    if len(word.args) > 2 and isinstance(word.args[2], int):
        word.args = (*word.args[:2], with_chunks(word.args[2], num_chunks), *word.args[3:])
        return True
    fill = word.kwargs.get("fill_value")
    if isinstance(fill, int):
        word.kwargs = {**word.kwargs, "fill_value": with_chunks(fill, num_chunks)}
        return True
    return False


def _covers_all_local_experts(dispatch: fx.Node) -> bool:
    """Whether the dispatch is over [0, El) (a one-chunk layer): El from the plan's
    ``ep_chunk_offsets`` (num_experts // world)."""
    args = dispatch.args
    bounds = _ints(dispatch, 4, 5, 6)
    if len(args) != _DISPATCH_ARGS or not isinstance(args[2], fx.Node) or bounds is None:
        return False
    E, l0, l1 = bounds
    worlds = [_ints(u, 1, 2) for u in args[2].users if is_op(u, _ops.ep_chunk_offsets)]
    return l0 == 0 and any(w is not None and w[0] == E == l1 * w[1] for w in worlds)


def split_layers(graph: fx.Graph, num_chunks: int) -> int:
    """Split every one-chunk expert-parallel layer of ``graph`` into ``num_chunks`` chunks
    (at most its local experts); returns the layers split."""
    if num_chunks < 2:
        return 0
    split = 0
    for node in [n for n in graph.nodes if is_op(n, _ops.ep_dispatch)]:
        outcome = _split(graph, node, num_chunks)
        split += outcome == "split"
        if outcome == "skipped":
            _COUNTERS["ep_chunk_skipped"] += 1
    if split:
        graph.lint()
        _COUNTERS["ep_chunks"] += split
    return split


class EPChunkPass(CustomGraphPass):
    """The pass as Inductor's ``pre_grad_custom_pass`` (``uuid()`` hashes this file, the
    FX helpers, the exchanges' module and the chunk count).

    ``num_chunks``: None reads ``config.ep_chunks`` when a graph compiles; an int fixes it
    for the compiles this instance is passed to (``torch_moe._inductor.options(
    ep_chunks=C)``). NB: Dynamo reuses a frame it compiled for an equal module, so changing
    ``config.ep_chunks`` between two ``torch.compile`` calls in one process does not
    recompile the second; per-compile ``options(ep_chunks=C)`` does (a different backend).
    """

    def __init__(self, num_chunks: int | None = None) -> None:
        if num_chunks is not None and (
            isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1
        ):
            raise ValueError(f"EPChunkPass: num_chunks must be a positive int, got {num_chunks!r}")
        self.num_chunks = num_chunks

    def chunks(self) -> int:
        return config.ep_chunks if self.num_chunks is None else self.num_chunks

    def __call__(self, graph: fx.Graph) -> None:
        split_layers(graph, self.chunks())

    def uuid(self) -> bytes:
        here = os.path.dirname(__file__)
        # (dispatch.py: the mode word's layout, which the pass writes into the plan)
        files = (__file__, os.path.join(here, "_fx.py"), _dispatch.__file__)
        digest = get_hash_for_files(files)
        return hashlib.sha256(digest + repr(self.chunks()).encode()).digest()
