"""DTensor sharding rules for the ``torch_moe::`` ops.

Registered with ``torch.distributed.tensor.experimental.register_sharding`` when
``torch_moe.distributed`` is imported, so DTensors propagate through the ops (and
through their autograd, whose backward calls the ``*_backward`` / ``*_wgrad`` /
``weighted_row_dot`` ops listed here too). Each rule lists, for ONE mesh dim, the
placements it accepts: ``(output placements, input placements)`` with ``None`` for
non-tensor and absent (None) arguments; DTensor expands the list over every mesh dim,
prices the redistributions each candidate needs and runs the cheapest. A placement
that no listed strategy accepts is redistributed first (the collective is then
DTensor's, e.g. an all-gather to Replicate). Every strategy's docstring line says
which communication it implies.

Legend: T tokens, E experts, K top-k, D model dim, F expert hidden dim, M rows of a
permuted (expert-sorted) buffer, N = T*K slots. ``S(d)`` = ``Shard(d)``, ``R`` =
``Replicate()``, ``P`` = ``Partial()`` (sum).

NB (why no expert-dim or row-dim sharding of the grouped ops): ``offs`` holds global
group ENDS, and a group's start is the previous group's end (0 for the first). A rank
holding experts ``[e0, e1)`` of ``w`` (``Shard(0)``) would need the start row of group
``e0``, which its slice of ``offs`` does not carry: run on local shards, its first
group would swallow every earlier row. Likewise a row shard of the permuted buffer
cuts groups at arbitrary rows while ``offs`` still counts global rows. Expert
parallelism therefore does not go through these rules: ``ExpertParallel`` moves the
tokens to the ranks owning their experts (``all_to_all_single``) and calls the ops on
plain local tensors with local ``offs``. What these rules offer is token (data)
parallelism for routing and combine, tensor parallelism (feature-dim sharding) for
the grouped GEMMs, and ``Partial`` through the ops that are linear in an input.

NB (permute_indices is Replicate only): its outputs describe ONE global expert-sorted
layout. Per-rank token shards sorted locally give each rank its own layout (the
``row_to_slot`` of rank r is not a slice of the global one, and with ``align > 1`` or a
capacity neither ``offs`` nor ``num_dropped`` add up across ranks), so a token-sharded
``expert_ids`` is all-gathered first. The same holds for ``permute``'s index maps:
``row_to_slot`` and ``slot_to_row`` index global rows and slots, so permute and
unpermute accept a sharded feature dim (``Shard(1)``) or ``Partial`` data, never a
sharded token dim on the gather side.

NB (grouped_swiglu is Replicate only): ``w13`` stacks gate rows then up rows
([E, 2F, D]), so ``Shard(1)`` hands rank 0 the gate rows and rank 1 the up rows, not
matching halves of both; a feature-parallel SwiGLU would need gate and up sharded
alike. Its output is not linear in x either (so no ``Partial`` input). Its backward is
linear in the incoming gradients, which may therefore stay ``Partial``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

__all__ = ["SHARDED_OPS"]

_ops = torch.ops.torch_moe

R = Replicate()
P = Partial()

_Strategy = tuple[Sequence[Placement | None], Sequence[Placement | None]]


def _opt(arg: object, placement: Placement) -> Placement | None:
    """The placement for an optional tensor argument: None when the argument is None."""
    return None if arg is None else placement


@register_sharding(_ops.topk_route.default)
def _topk_route_sharding(
    logits: object,
    k: int,
    score_func: str = "softmax",
    expert_bias: object = None,
    num_expert_groups: int | None = None,
    num_limited_groups: int | None = None,
    route_norm: bool = False,
    route_scale: float = 1.0,
    group_score: str = "top2_sum",
    route_norm_eps: float = 1e-20,
) -> list[_Strategy]:
    """(weights, ids, counts) <- logits [T, E], expert_bias [E].

    * R -> R: no communication.
    * logits S(0) (token / data parallel), bias R -> weights S(0), ids S(0), counts P:
      no communication; each rank routes its own tokens, and the per-expert counts are
      per-rank partial sums (one all-reduce if the global counts are read).

    Not E-sharded: the softmax, the group scores and the top-k run over all experts.
    """
    bias = _opt(expert_bias, R)
    tail = [None, None, bias, None, None, None, None, None, None]
    return [
        ([R, R, R], [R, *tail]),
        ([Shard(0), Shard(0), P], [Shard(0), *tail]),
    ]


@register_sharding(_ops.topk_route_backward.default)
def _topk_route_backward_sharding(
    grad_weights: object,
    logits: object,
    expert_ids: object,
    score_func: str,
    route_norm: bool,
    route_scale: float,
    route_norm_eps: float = 1e-20,
) -> list[_Strategy]:
    """grad_logits [T, E] <- grad_weights [T, K], logits [T, E], expert_ids [T, K].

    * all R -> R; all S(0) -> S(0) (per token): no communication.
    * grad_weights P, logits R, ids R -> P: linear in grad_weights; no communication.
    """
    tail = [None, None, None, None]
    return [
        ([R], [R, R, R, *tail]),
        ([Shard(0)], [Shard(0), Shard(0), Shard(0), *tail]),
        ([P], [P, R, R, *tail]),
    ]


@register_sharding(_ops.router_logits.default)
def _router_logits_sharding(x: object, weight: object, bias: object = None) -> list[_Strategy]:
    """logits [T, E] <- x [T, D], weight [E, D], bias [E].

    * all R -> R; x S(0) (token / data parallel), weight R, bias R -> S(0): no
      communication.
    * x R, weight S(0), bias S(0) (experts split) -> S(1): no communication.
    * without a bias: x S(1), weight S(1) (D split) -> P (one all-reduce when read
      replicated); x P, weight R -> P (linear in x). No communication.
    """
    b = _opt(bias, R)
    strategies: list[_Strategy] = [
        ([R], [R, R, b]),
        ([Shard(0)], [Shard(0), R, b]),
        ([Shard(1)], [R, Shard(0), _opt(bias, Shard(0))]),
    ]
    if bias is None:
        strategies += [([P], [Shard(1), Shard(1), None]), ([P], [P, R, None])]
    return strategies


@register_sharding(_ops.router_logits_backward.default)
def _router_logits_backward_sharding(
    grad: object, x: object, weight: object, need_x: bool, need_weight: bool
) -> list[_Strategy]:
    """(grad_x [T, D], grad_weight [E, D]) <- grad [T, E], x [T, D], weight [E, D]: the
    strategies of router_logits, backwards; no communication in any.

    * all R -> (R, R); grad S(0), x S(0), weight R -> (S(0), P): each rank's token
      share of the weight's gradient.
    * grad S(1), x R, weight S(0) -> (P, S(0)); grad R, x S(1), weight S(1) ->
      (S(1), S(1)); grad P, x R, weight R -> (P, P).
    """
    return [
        ([R, R], [R, R, R, None, None]),
        ([Shard(0), P], [Shard(0), Shard(0), R, None, None]),
        ([P, Shard(0)], [Shard(1), R, Shard(0), None, None]),
        ([Shard(1), Shard(1)], [R, Shard(1), Shard(1), None, None]),
        ([P, P], [P, R, R, None, None]),
    ]


@register_sharding(_ops.permute_indices.default)
def _permute_indices_sharding(
    expert_ids: object, num_experts: int, align: int = 1, capacity: int | None = None
) -> list[_Strategy]:
    """(row_to_slot, slot_to_row, offs, num_dropped) <- expert_ids [T, K]: R only.

    A token-sharded ``expert_ids`` is all-gathered (one all_gather) to build the global
    layout; see the module note.
    """
    return [([R, R, R, R], [R, None, None, None])]


@register_sharding(_ops.permute.default)
def _permute_sharding(
    x: object, row_to_slot: object, slot_to_row: object, weights: object = None
) -> list[_Strategy]:
    """out [M, D] <- x [T, D], row_to_slot [M], slot_to_row [T, K], weights [T, K].

    * all R -> R: no communication.
    * x S(1) (feature parallel), maps and weights R -> S(1): a row gather per column;
      no communication.
    * x P, maps and weights R -> P: linear in x; no communication.
    """
    w = _opt(weights, R)
    return [
        ([R], [R, R, R, w]),
        ([Shard(1)], [Shard(1), R, R, w]),
        ([P], [P, R, R, w]),
    ]


@register_sharding(_ops.unpermute.default)
def _unpermute_sharding(
    y: object, slot_to_row: object, row_to_slot: object, weights: object = None
) -> list[_Strategy]:
    """out [T, D] <- y [M, D], slot_to_row [T, K], row_to_slot [M], weights [T, K].

    * all R -> R: no communication.
    * y S(1), maps and weights R -> S(1): no communication.
    * y P, maps and weights R -> P: linear in y; no communication.
    * y R, slot_to_row S(0), weights S(0), row_to_slot R -> S(0) (combine into
      token-sharded outputs): each rank gathers the rows of its own tokens from the
      replicated expert outputs; no communication.
    """
    return [
        ([R], [R, R, R, _opt(weights, R)]),
        ([Shard(1)], [Shard(1), R, R, _opt(weights, R)]),
        ([P], [P, R, R, _opt(weights, R)]),
        ([Shard(0)], [R, Shard(0), R, _opt(weights, Shard(0))]),
    ]


@register_sharding(_ops.weighted_row_dot.default)
def _weighted_row_dot_sharding(
    rows: object, tokens: object, slot_to_row: object
) -> list[_Strategy]:
    """out [T, K] <- rows [M, D], tokens [T, D], slot_to_row [T, K] (dot over D).

    * all R -> R: no communication.
    * rows S(1), tokens S(1), slot_to_row R -> P: each rank dots its slice of D; the
      sum over ranks is the dot (one all-reduce when read).
    * rows R, tokens S(0), slot_to_row S(0) -> S(0): per token; no communication.
    * rows P, tokens R (or rows R, tokens P), slot_to_row R -> P: bilinear, one
      partial factor; no communication.
    """
    return [
        ([R], [R, R, R]),
        ([P], [Shard(1), Shard(1), R]),
        ([Shard(0)], [R, Shard(0), Shard(0)]),
        ([P], [P, R, R]),
        ([P], [R, P, R]),
    ]


@register_sharding(_ops.grouped_mm.default)
def _grouped_mm_sharding(x: object, w: object, offs: object) -> list[_Strategy]:
    """out [M, N] <- x [M, K], w [E, K, N], offs [E] (R always; see the module note).

    * all R -> R: no communication.
    * x R, w S(2) (column parallel, N split) -> S(1): no communication.
    * x S(1), w S(1) (row parallel, K split) -> P: each rank's product is a partial sum
      over its slice of K (one all-reduce when the output is read replicated).
    * x P, w R (or x R, w P) -> P: bilinear, one partial factor; no communication.
    """
    return [
        ([R], [R, R, R]),
        ([Shard(1)], [R, Shard(2), R]),
        ([P], [Shard(1), Shard(1), R]),
        ([P], [P, R, R]),
        ([P], [R, P, R]),
    ]


@register_sharding(_ops.grouped_mm_wgrad.default)
def _grouped_mm_wgrad_sharding(x: object, dy: object, offs: object) -> list[_Strategy]:
    """dw [E, K, N] <- x [M, K], dy [M, N], offs [E]: the weight gradient of grouped_mm.

    * all R -> R: no communication.
    * x R, dy S(1) -> S(2): the gradient of a column-parallel w; no communication.
    * x S(1), dy R -> S(1): the gradient of a row-parallel w; no communication.
    * x P, dy R (or x R, dy P) -> P: bilinear, one partial factor; no communication.
    """
    return [
        ([R], [R, R, R]),
        ([Shard(2)], [R, Shard(1), R]),
        ([Shard(1)], [Shard(1), R, R]),
        ([P], [P, R, R]),
        ([P], [R, P, R]),
    ]


@register_sharding(_ops.grouped_swiglu.default)
def _grouped_swiglu_sharding(
    x: object,
    w13: object,
    w2: object,
    offs: object,
    row_weights: object = None,
    gather_index: object = None,
    row_to_slot: object = None,
    slot_to_row: object = None,
) -> list[_Strategy]:
    """(y [M, D], h [M, 2F]) <- x [M, D] (or the tokens [T, D] with gather_index or the
    permutation maps), w13 [E, 2F, D], w2 [E, D, F], offs, row_weights.

    * all R -> R: no communication; anything else is made Replicate first (see the
      module note for why there is no feature-parallel strategy; the gathering forms
      index global tokens, so token-sharded x is all-gathered, as permute's input is).
    """
    maps = [_opt(t, R) for t in (gather_index, row_to_slot, slot_to_row)]
    return [([R, R], [R, R, R, R, _opt(row_weights, R), *maps])]


@register_sharding(_ops.grouped_swiglu_backward.default)
def _grouped_swiglu_backward_sharding(
    grad_y: object,
    grad_h: object,
    x: object,
    h: object,
    w13: object,
    w2: object,
    offs: object,
    row_weights: object = None,
    gather_index: object = None,
) -> list[_Strategy]:
    """(dx, dw13, dw2, d row_weights) <- grad_y, grad_h, x, h, w13, w2, offs, row_weights,
    gather_index (dx: the rows' gradients, [M, D], either way).

    * all R -> R: no communication.
    * grad_y P and grad_h P (or absent), the rest R -> all four P: the backward is linear
      in the incoming gradients; no communication.
    """
    rw, gi = _opt(row_weights, R), _opt(gather_index, R)
    return [
        ([R, R, R, R], [R, _opt(grad_h, R), R, R, R, R, R, rw, gi]),
        ([P, P, P, P], [P, _opt(grad_h, P), R, R, R, R, R, rw, gi]),
    ]


SHARDED_OPS = (
    _ops.router_logits.default,
    _ops.router_logits_backward.default,
    _ops.topk_route.default,
    _ops.topk_route_backward.default,
    _ops.permute_indices.default,
    _ops.permute.default,
    _ops.unpermute.default,
    _ops.weighted_row_dot.default,
    _ops.grouped_mm.default,
    _ops.grouped_mm_wgrad.default,
    _ops.grouped_swiglu.default,
    _ops.grouped_swiglu_backward.default,
)
"""The op overloads that have a DTensor sharding rule (registered on import)."""
