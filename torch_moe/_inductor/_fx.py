"""FX helpers for the passes: insert a traced replacement into a graph with fake values.

The passes run on Inductor's joint and post-grad graphs, whose nodes carry FakeTensor
values (``node.meta["val"]``) that the partitioner and the lowering read. A replacement is
written as a plain Python function of tensors that calls ``torch.ops``; :func:`insert_traced`
traces it with ``make_fx`` on those fake values (under the graph's own fake mode, so
symbolic sizes stay symbolic) and copies the traced nodes, with their values, into the
graph before a given node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["insert_traced", "is_op", "val"]


def is_op(node: Any, op: Any) -> bool:
    """Whether ``node`` is a call of ``op`` (an OpOverload or an OpOverloadPacket)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    target = node.target
    return target is op or getattr(target, "overloadpacket", None) is op


def val(node: Any) -> Any:
    """The fake value of a node (or the argument itself when it is not a node)."""
    return node.meta["val"] if isinstance(node, fx.Node) else node


def _positional(fn: Callable[..., Any], n: int) -> Callable[..., Any]:
    """``fn`` as a function of exactly n positional parameters (make_fx traces one
    placeholder per parameter of the signature, defaults included)."""
    names = ", ".join(f"a{i}" for i in range(n))
    return eval(f"lambda {names}: fn({names})", {"fn": fn})


def insert_traced(
    graph: fx.Graph, before: fx.Node, fn: Callable[..., Any], inputs: Sequence[fx.Node]
) -> Any:
    """Trace ``fn(*inputs' values)`` (decomposed as Inductor decomposes) and insert its
    nodes before ``before``.

    Returns the structure ``fn`` returned, with nodes in place of tensors. Non-tensor
    arguments go into ``fn`` by closure; ``inputs`` are graph nodes.
    """
    vals = [val(n) for n in inputs]
    mode = detect_fake_mode(vals)
    if mode is None:
        raise RuntimeError("torch_moe._inductor: the graph carries no fake values to trace with")
    # Inductor's decompositions: the graph it lowers holds only ops it has lowerings for
    # (aten.permute, not aten.transpose)
    from torch._inductor.decomposition import select_decomp_table

    with mode, enable_python_dispatcher():
        traced = make_fx(_positional(fn, len(vals)), select_decomp_table(), tracing_mode="real")(
            *vals
        )
    env: dict[fx.Node, Any] = {}
    placeholders = iter(inputs)
    result: Any = None
    with graph.inserting_before(before):
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(placeholders)
            elif n.op == "output":
                result = fx.node.map_arg(n.args[0], lambda a: env[a])
            elif n.op == "get_attr":
                raise RuntimeError(f"torch_moe._inductor: a replacement made a constant ({n})")
            else:
                env[n] = graph.node_copy(n, lambda a: env[a])
    return result
