"""Inductor lowerings of torch_moe's grouped GEMM ops.

On CPU (and wherever no template applies) the lowering of ``torch_moe::grouped_mm``,
``grouped_mm_wgrad`` and ``scaled_grouped_mm`` is an extern call of the op's own kernel:
the compiled graph calls exactly what eager calls, so a compiled path is never slower than
eager for these ops. Registering the lowering explicitly (instead of relying on Inductor's
implicit fallback for custom ops) keeps its source in :class:`~torch_moe._inductor.passes.
MoEGraphPass`'s ``uuid()``, so the FX graph cache never serves code lowered by an older
version.

The expert-parallel exchanges (``torch_moe::ep_dispatch``, ``ep_combine``, their backwards,
``ep_start`` and ``ep_wait``) lower to :class:`ExchangeKernel`, the same extern call marked as
having side effects. Inductor's scheduler drops an extern kernel none of whose outputs is
read, and on a rank that holds no tokens every output of an exchange back to the tokens is
empty: the zero-size gradient of the input is computed without reading anything, so the
exchange that would produce it (``dispatch backward``) looked dead and was dropped, and the
peers waited for it forever. A collective is never dead code on one rank only. Each
exchange also runs after the graph's previous exchange and after the collectives lowered
before it (a plan's all-to-all): ordering edges, ``V.graph.additional_buffer_deps``. The
scheduler otherwise orders independent extern kernels by its own heuristics, whose
choices differ between ranks whose graphs differ (each rank's token count is its own
static shape), and a blocking wait on one rank then faced a peer that had issued its
exchanges in another order: two micro-batches in inference hung with 7 and 0 tokens
(rank 0 waited in a combine its peer would issue only after a dispatch rank 0 had not
issued yet) and with 5 and 6 (one rank's plan all-to-all after its first dispatch's
wait, the other's before), and with ``exchange="all_to_all"`` (7 and 1 tokens) one rank
issued the second micro-batch's plan all-to-all before the first one's dispatch and the
other after it: a collective lowered between two exchanges also runs after the first.
(Collectives lowered after a graph's last exchange get no edge: none in the MoE layer's
graphs.) (Marking
the ops side-effectful for every FX pass instead, ``torch.fx.node.has_side_effect``, makes
AOTAutograd's partitioner treat them as impure and keep the forward's exchanges in the
backward graph too.) These lowerings are registered with the grouped GEMMs' and, for a
``torch.compile`` that does not use :func:`torch_moe._inductor.options`, by the exchanges'
fake kernels as soon as Inductor's lowering module is loaded (that is, before the graph
they trace for an Inductor compile is lowered).

The FX graph cache keys a compiled graph by the graph, Inductor's config and torch's own
sources, not by the lowerings registered for custom ops: code lowered by an older
torch_moe (one whose exchange a rank could drop) would be served again after an upgrade.
With :func:`torch_moe._inductor.options` the passes' ``uuid()`` covers this file; a plain
``torch.compile`` gets it through ``torch.compiler.config.cache_key_tag``, to which
registering the exchanges' lowerings appends ``torch_moe.lowering=<hash of this file>``
(a tag the user set is kept), until the cache keys on out-of-tree lowerings itself
(``upstream_patches/0006-inductor-fx-graph-cache-lowerings``).

NB (CUDA templates): Triton templates of the persistent grouped GEMM, offered next to
torch's ``tuned_grouped_mm`` and the extern kernel through ``autotune_select_algorithm``,
need a CUDA device to render and benchmark; they are not part of this module yet (see
RFC-0003 for where they plug into ``_tuned_grouped_mm_common``).
"""

from __future__ import annotations

import hashlib
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._inductor import ir
from torch._inductor import lowering as L
from torch._inductor.virtualized import V
from torch._library.utils import get_layout_constraint_tag

import torch_moe.distributed.dispatch  # noqa: F401  (defines the exchange ops)

__all__ = [
    "EXCHANGE_OPS",
    "LOWERED_OPS",
    "ExchangeKernel",
    "register_exchange_lowerings",
    "register_lowerings",
]

_ops = torch.ops.torch_moe

LOWERED_OPS = (
    _ops.grouped_mm.default,
    _ops.grouped_mm_wgrad.default,
    _ops.scaled_grouped_mm.default,
    _ops.scaled_grouped_mm_wgrad.default,
)

EXCHANGE_OPS = (
    _ops.ep_dispatch.default,
    _ops.ep_dispatch_backward.default,
    _ops.ep_combine.default,
    _ops.ep_combine_backward.default,
    _ops.ep_start.default,
    _ops.ep_wait.default,
)

_registered = False
_exchanges_registered = False


class ExchangeKernel(ir.FallbackKernel):
    """The extern call of an expert-parallel exchange, kept by the scheduler even where no
    output is read, and run after the graph's previous exchange (module doc): every rank
    of the group must take part, in the same order."""

    def has_side_effects(self) -> bool:
        return True


# per graph being lowered: its last exchange so far and how far its operations were read
_order: weakref.WeakKeyDictionary[Any, tuple[ExchangeKernel | None, int]] = (
    weakref.WeakKeyDictionary()
)


def _exchange_handler(op: torch._ops.OpOverload) -> Any:
    def handler(*args: Any, **kwargs: Any) -> Any:
        prev, read = _order.get(V.graph, (None, 0))
        # the collectives lowered since the previous exchange (a plan's all-to-all): after
        # it, and before this one
        before: list[ir.Buffer] = [
            o for o in V.graph.operations[read:] if isinstance(o, ir._CollectiveKernel)
        ]
        if prev is not None:
            for o in before:
                V.graph.additional_buffer_deps[o.get_operation_name()].add(prev.get_name())
        first = len(V.graph.operations)
        out = ExchangeKernel.create(op, *args, **kwargs)
        for new in V.graph.operations[first:]:
            if isinstance(new, ExchangeKernel):  # ordering edges only (nothing kept alive)
                deps = V.graph.additional_buffer_deps[new.get_operation_name()]
                deps.update(o.get_name() for o in ([prev] if prev is not None else []) + before)
                prev, before = new, []
        _order[V.graph] = (prev, len(V.graph.operations))
        return pytree.tree_map(
            lambda x: x.wrap_for_lowering() if isinstance(x, ir.IRNode) else x, out
        )

    return handler


LOWERING_TAG = "torch_moe.lowering=" + hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _tag_cache_key() -> None:
    """Add :data:`LOWERING_TAG` to ``torch.compiler.config.cache_key_tag`` (module doc), after
    any tag already there."""
    current = torch.compiler.config.cache_key_tag
    if LOWERING_TAG not in current.split(";"):
        torch.compiler.config.cache_key_tag = (
            f"{current};{LOWERING_TAG}" if current else LOWERING_TAG
        )


def register_exchange_lowerings() -> None:
    """Lower the expert-parallel exchanges to :class:`ExchangeKernel` (idempotent), and key
    the FX graph cache by this file (:func:`_tag_cache_key`)."""
    global _exchanges_registered
    _tag_cache_key()
    if _exchanges_registered:
        return
    for op in EXCHANGE_OPS:
        # as Inductor's implicit fallback would: inputs realized, the op's (default) layout
        # constraint kept
        L.add_needs_realized_inputs(op)
        constraint = L.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        if constraint is not None:
            L.add_layout_constraint(op, constraint)
        L.register_lowering(op, type_promotion_kind=None)(_exchange_handler(op))
    _exchanges_registered = True


def register_lowerings() -> None:
    """Register the lowerings (idempotent)."""
    global _registered
    register_exchange_lowerings()
    if _registered:
        return
    for op in LOWERED_OPS:
        # the op's own kernel as an extern call (Inductor's fallback handler)
        L.register_lowering(op, type_promotion_kind=None)(L.fallback_handler(op))
    _registered = True
