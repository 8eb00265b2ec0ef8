"""The expert-parallel overlap pass: issue exchanges early, wait for them late.

An expert-parallel MoE layer with ``ExpertParallel(num_chunks=C)`` runs, per chunk c of
local experts, ``ep_dispatch(c)`` -> the experts -> ``ep_combine(c)``; the backward runs the
reverse exchanges ``ep_combine_backward(c)`` -> the experts' backward ->
``ep_dispatch_backward(c)``. Each of those ops is synchronous: in eager mode the exchanges
and the expert compute alternate. On the post-grad forward and backward graphs this pass

1. splits every exchange into ``ep_start`` (issues it: point-to-point segments go to the
   transport's threads on gloo, to an NCCL group on GPU) and ``ep_wait`` (waits and
   finishes it), both custom ops (:mod:`torch_moe.distributed.dispatch`);
2. moves every ``ep_start`` as early as its inputs allow (starts that meet at one place
   keep their original order; every rank compiles the same graph with the same pass, so
   every rank issues the exchanges in the same order), and every ``ep_wait`` as late as
   its first use allows.

So chunk c+1's dispatch is in flight while chunk c's experts compute, chunk c's combine
while chunk c+1's experts compute, and in the backward likewise. The values are those of
the synchronous ops (the same exchanges, the same kernels): compiled + pass equals eager
chunking bit for bit. Exchanges with ``exchange="all_to_all"`` complete inside
``ep_start`` (one collective; only p2p is split into issue and wait), so for them the pass
changes nothing but the placement.

``EPOverlapPass`` is the ``CustomGraphPass`` (``post_grad_custom_post_pass``: the graphs
after the partitioner, which is where the final order is decided);
``torch_moe._inductor.enable()`` installs it when ``config.ep_overlap`` is set.
"""

from __future__ import annotations

import hashlib
import operator
import os
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from torch_moe._inductor import config
from torch_moe._inductor._fx import is_op, val
from torch_moe.distributed import dispatch as _dispatch  # noqa: F401  (registers the ep ops)

__all__ = ["EPOverlapPass", "overlap_exchanges", "split_exchanges"]

_ops = torch.ops.torch_moe


def _fake_handle(counts: fx.Node) -> Any:
    counts_val = val(counts)
    with counts_val.fake_mode:
        return counts_val.new_empty((1,))


def _split(graph: fx.Graph, node: fx.Node, tensors: list[Any], common: tuple, direction: str,
           fp8: bool, num_rows: Any, wait_rows: Any) -> None:  # fmt: skip
    """Replace the synchronous exchange ``node`` by ep_start + ep_wait (+ getitems)."""
    counts = common[0]
    with graph.inserting_before(node):
        start = graph.call_function(
            _ops.ep_start.default, (tensors, *common, direction, fp8, num_rows)
        )
        start.meta["val"] = _fake_handle(counts)
        wait = graph.call_function(_ops.ep_wait.default, (start, tensors, direction, wait_rows))
    outputs = node.meta["val"]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    wait.meta["val"] = outputs[: len(tensors)]
    if "unbacked_bindings" in node.meta:  # the received rows' SymInt now comes from ep_wait
        wait.meta["unbacked_bindings"] = node.meta["unbacked_bindings"]
    multi = isinstance(node.meta["val"], (tuple, list))
    if not multi:
        with graph.inserting_after(wait):
            item = graph.call_function(operator.getitem, (wait, 0))
        item.meta["val"] = outputs[0]
        node.replace_all_uses_with(item)
    else:
        for user in list(node.users):
            index = user.args[1]
            user.args = (wait, index)
    graph.erase_node(node)


def split_exchanges(graph: fx.Graph) -> int:
    """Step 1 of the module docstring; returns the exchanges split."""
    count = 0
    for node in list(graph.nodes):
        if is_op(node, _ops.ep_dispatch):
            x, w, counts, group, E, l0, l1, exchange, node_size, fp8 = node.args
            if w is None and any(u.args[1] == 1 for u in node.users):
                continue  # the empty weights output is used: leave this one whole
            tensors = [x] if w is None else [x, w]
            common = (counts, group, E, l0, l1, exchange, node_size)
            _split(graph, node, tensors, common, "dispatch", fp8, -1, -1)
        elif is_op(node, _ops.ep_combine):
            y, counts, group, E, l0, l1, exchange, node_size, num_rows = node.args
            common = (counts, group, E, l0, l1, exchange, node_size)
            _split(graph, node, [y], common, "combine", False, num_rows, num_rows)
        elif is_op(node, _ops.ep_combine_backward):
            g, counts, group, E, l0, l1, exchange, node_size, num_recv = node.args
            common = (counts, group, E, l0, l1, exchange, node_size)
            _split(graph, node, [g], common, "combine backward", False, num_recv, num_recv)
        elif is_op(node, _ops.ep_dispatch_backward):
            gx, gw, counts, group, E, l0, l1, exchange, node_size, num_rows = node.args
            if gw is None and any(u.args[1] == 1 for u in node.users):
                continue
            tensors = [gx] if gw is None else [gx, gw]
            common = (counts, group, E, l0, l1, exchange, node_size)
            _split(graph, node, tensors, common, "dispatch backward", False, num_rows, num_rows)
        else:
            continue
        count += 1
    return count


def _inputs(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []

    def note(a: fx.Node) -> fx.Node:
        found.append(a)
        return a

    fx.node.map_arg((node.args, node.kwargs), note)
    return found


_SCALARS = (torch.SymInt, torch.SymBool, int, bool)


def _size_check(user: fx.Node, item: fx.Node) -> set[fx.Node] | None:
    """``user`` and everything downstream of it when they only check ``item``'s size (the
    runtime asserts AOTAutograd adds for an unbacked row count: ``sym_size`` ->
    comparisons -> ``_assert_scalar``) and read nothing else, else None."""
    chain: set[fx.Node] = set()
    stack = [user]
    while stack:
        n = stack.pop()
        if n in chain or n.op == "output":  # (a forward returns the size to its backward)
            continue
        asserts = n.target is torch.ops.aten._assert_scalar.default
        if not asserts and not isinstance(n.meta.get("val"), _SCALARS):
            return None
        chain.add(n)
        stack.extend(n.users)
    if any(a is not item and a not in chain for n in chain for a in n.all_input_nodes):
        return None
    return chain


def overlap_exchanges(graph: fx.Graph) -> int:
    """Step 2 of the module docstring: starts early (in their original order), waits late.
    Returns the nodes moved."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved = 0
    for start in [n for n in graph.nodes if is_op(n, _ops.ep_start)]:
        after = max(_inputs(start), key=lambda n: order[n])
        # behind the starts already placed there: starts keep their original order
        while after.next is not start and is_op(after.next, _ops.ep_start):
            after = after.next
        if after.next is not start:
            after.append(start)
            moved += 1
        order = {n: i for i, n in enumerate(graph.nodes)}
    for wait in reversed([n for n in graph.nodes if is_op(n, _ops.ep_wait)]):
        items = list(wait.users)
        for item in items:  # each getitem right before its first use of the rows
            if not item.users:
                continue
            checks = {u: _size_check(u, item) for u in item.users}
            uses = [u for u, chain in checks.items() if chain is None]
            first = min(uses or item.users, key=lambda n: order[n])
            first.prepend(item)
            if uses:  # a runtime assert on the received row count is not a use of the
                # rows: it moves with them (else the wait would have to come before it)
                size_checks = set().union(*(c for c in checks.values() if c is not None))
                for n in sorted(size_checks, key=lambda n: order[n]):
                    first.prepend(n)
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(items, key=lambda n: order[n]) if items else None
        if first is not None and wait.next is not first:
            first.prepend(wait)
            moved += 1
        order = {n: i for i, n in enumerate(graph.nodes)}
    return moved


def run(graph: fx.Graph) -> tuple[int, int]:
    split = split_exchanges(graph)
    moved = overlap_exchanges(graph) if split else 0
    if split:
        graph.lint()
    return split, moved


class EPOverlapPass(CustomGraphPass):
    """The pass as an Inductor ``CustomGraphPass`` (``uuid()`` hashes this file and the
    shared FX helpers)."""

    def __call__(self, graph: fx.Graph) -> None:
        if config.ep_overlap:
            run(graph)

    def uuid(self) -> bytes:
        here = os.path.dirname(__file__)
        digest = get_hash_for_files((__file__, os.path.join(here, "_fx.py")))
        return hashlib.sha256(digest + repr(config.ep_overlap).encode()).digest()
