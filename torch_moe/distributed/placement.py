"""Load-aware expert placement with redundant experts (in the spirit of DeepSeek's EPLB).

Legend: L layers, E logical experts, R ranks, S physical slots per rank, P = R*S physical
experts (``P = E + num_redundant``), T tokens, K top-k, C max replicas of one expert.

Given per-expert loads (e.g. ``MoE.tokens_per_expert`` summed over steps), place the E
logical experts on R ranks of S slots each so that the most-loaded rank carries as
little as possible:

1. Replicas: start with one replica per expert and hand out the ``num_redundant`` extra
   ones one at a time, each to the expert with the highest load per replica (a
   replica carries an equal share of its expert's load; ties go to the lower expert
   id). An expert gets at most R replicas while any other expert can still take one
   (a second replica on the same rank never lowers a rank's load).
2. Packing: the P replicas, heaviest first, go one by one to the least-loaded rank
   that still has a free slot and does not hold that expert yet (longest processing
   time first with a capacity of S slots; ties go to the lower rank). Only when every
   rank with a free slot already holds the expert does a rank get a second copy; a
   swap pass then trades such a copy with a slot of another rank where that removes
   the duplicate. Without the slot limit, LPT is within 4/3 of the optimal makespan;
   the tests check that bound against brute force on small cases.

Node-aware (hierarchical) placement is not implemented: every rank is treated alike.

Typical use::

    placement = plan_placement(moe.tokens_per_expert, num_ranks, num_redundant=num_ranks)
    w13_P = remap_expert_weights(w13_P, old_placement, placement)     # move the weights
    phys_ids = route_to_replicas(expert_ids, placement)               # [T, K] -> [T, K]
    x_perm, perm = torch_moe.ops.permute(x, phys_ids, placement.num_physical)

Planning runs on the CPU in float64 with plain Python loops (P*R steps); it is meant to
run every few hundred steps, not per batch. ``route_to_replicas`` stays on the device
of its input and does not synchronize except for the range check on CPU.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ExpertPlacement",
    "balancedness",
    "identity_placement",
    "plan_placement",
    "remap_expert_weights",
    "remap_indices",
    "route_to_replicas",
]


@dataclass(frozen=True)
class ExpertPlacement:
    """Where the physical copies of each logical expert live.

    One layer (1D fields below) or L layers planned at once (every tensor gains a
    leading [L] dim; take one layer with :meth:`layer`).

    Attributes:
        phys_to_logical: [P] int64, the logical expert held by each physical slot; the
            slots of rank r are ``r*S .. r*S + S - 1``.
        logical_to_phys: [E, C] int64, the physical slots of each logical expert in
            increasing order, padded with -1.
        replica_count: [E] int64, replicas of each logical expert (>= 1, sums to P).
        num_ranks: R.
        slots_per_rank: S.
    """

    phys_to_logical: Tensor
    logical_to_phys: Tensor
    replica_count: Tensor
    num_ranks: int
    slots_per_rank: int

    @property
    def num_experts(self) -> int:
        """E, the number of logical experts."""
        return self.replica_count.shape[-1]

    @property
    def num_physical(self) -> int:
        """P = R*S, the number of physical expert slots."""
        return self.num_ranks * self.slots_per_rank

    @property
    def num_layers(self) -> int | None:
        """L for a stacked multi-layer placement, None for a single layer."""
        return self.replica_count.shape[0] if self.replica_count.dim() == 2 else None

    def layer(self, index: int) -> ExpertPlacement:
        """The single-layer placement of layer ``index`` of a stacked placement."""
        if self.num_layers is None:
            raise ValueError("ExpertPlacement.layer: this placement has no layer dim")
        counts_E = self.replica_count[index]
        max_replicas = int(counts_E.max())
        return ExpertPlacement(
            self.phys_to_logical[index],
            self.logical_to_phys[index, :, :max_replicas],
            counts_E,
            self.num_ranks,
            self.slots_per_rank,
        )

    def rank_loads(self, load: Tensor) -> Tensor:
        """Load of each rank, float64: [E] -> [R] (or [L, E] -> [L, R] when stacked).

        Each replica carries ``load[e] / replica_count[e]``, which is what
        :func:`route_to_replicas` achieves up to one assignment per replica.
        """
        load = load.detach().to(device="cpu", dtype=torch.float64)
        if load.shape != self.replica_count.shape:
            raise ValueError(
                f"rank_loads: expected load of shape {tuple(self.replica_count.shape)}, "
                f"got {tuple(load.shape)}"
            )
        per_replica = load / self.replica_count.to(torch.float64)
        slot_load = per_replica.gather(-1, self.phys_to_logical)
        return slot_load.unflatten(-1, (self.num_ranks, self.slots_per_rank)).sum(-1)


def _check_load(load: Tensor, fn: str) -> Tensor:
    if load.dim() not in (1, 2):
        raise ValueError(f"{fn}: expected load to be 1D [E] or 2D [L, E], got {load.dim()}D")
    if load.is_complex() or load.dtype == torch.bool:
        raise ValueError(f"{fn}: expected a real-valued load, got {load.dtype}")
    if load.shape[-1] < 1:
        raise ValueError(
            f"{fn}: expected at least one expert, got load of shape {tuple(load.shape)}"
        )
    load = load.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(load).all()):
        raise ValueError(f"{fn}: load must be finite, got {load[~torch.isfinite(load)][0].item()}")
    if load.numel() > 0 and bool((load < 0).any()):
        raise ValueError(f"{fn}: load must be non-negative, got min {load.min().item()}")
    return load


def _check_sizes(num_experts: int, num_ranks: int, num_redundant: int, fn: str) -> int:
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"{fn}: num_ranks must be a positive integer, got {num_ranks!r}")
    if not isinstance(num_redundant, int) or num_redundant < 0:
        raise ValueError(
            f"{fn}: num_redundant must be a non-negative integer, got {num_redundant!r}"
        )
    num_physical = num_experts + num_redundant
    if num_physical % num_ranks != 0:
        raise ValueError(
            f"{fn}: num_experts + num_redundant ({num_experts} + {num_redundant} = "
            f"{num_physical}) must be divisible by num_ranks ({num_ranks}); change "
            f"num_redundant to a multiple of num_ranks minus {num_experts % num_ranks}"
        )
    return num_physical // num_ranks


def _logical_to_phys(phys_to_logical_P: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """[P] -> ([E, C] slots of each expert padded with -1, [E] replica counts)."""
    counts_E = torch.bincount(phys_to_logical_P, minlength=num_experts)
    order_P = torch.argsort(phys_to_logical_P, stable=True)  # slots grouped by expert
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    sorted_experts_P = phys_to_logical_P[order_P]
    rank_P = torch.arange(order_P.numel()) - starts_E[sorted_experts_P]
    max_replicas = int(counts_E.max()) if num_experts > 0 else 0
    l2p_EC = torch.full((num_experts, max_replicas), -1, dtype=torch.int64)
    l2p_EC[sorted_experts_P, rank_P] = order_P
    return l2p_EC, counts_E


def _choose_replicas(load: list[float], num_redundant: int, max_per_expert: int) -> list[int]:
    """Step 1: give each extra replica to the expert with the highest load per replica."""
    counts = [1] * len(load)
    # max-heap on (load per replica, -expert): ties go to the lower expert id
    heap = [(-w, e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    capped: list[tuple[float, int]] = []
    for _ in range(num_redundant):
        if not heap:  # every expert is on every rank: S > E, duplicates are unavoidable
            heap, capped, max_per_expert = capped, [], num_redundant + 1
            heapq.heapify(heap)
        _, e = heapq.heappop(heap)
        counts[e] += 1
        entry = (-load[e] / counts[e], e)
        if counts[e] >= max_per_expert:
            capped.append(entry)
        else:
            heapq.heappush(heap, entry)
    return counts


def _pack(load: list[float], counts: list[int], num_ranks: int, slots: int) -> list[int]:
    """Step 2: LPT packing of the replicas into ranks of ``slots`` slots; [P] experts."""
    items = sorted(
        ((load[e] / counts[e], e) for e in range(len(load)) for _ in range(counts[e])),
        key=lambda item: (-item[0], item[1]),
    )
    rank_load = [0.0] * num_ranks
    rank_items: list[list[tuple[float, int]]] = [[] for _ in range(num_ranks)]
    for w, e in items:
        best, best_dup = -1, -1
        for r in range(num_ranks):
            if len(rank_items[r]) == slots:
                continue
            holds = any(f == e for _, f in rank_items[r])
            if not holds and (best < 0 or rank_load[r] < rank_load[best]):
                best = r
            if holds and (best_dup < 0 or rank_load[r] < rank_load[best_dup]):
                best_dup = r
        r = best if best >= 0 else best_dup
        rank_items[r].append((w, e))
        rank_load[r] += w
    _remove_duplicates(rank_items)
    return [e for items_r in rank_items for _, e in items_r]


def _remove_duplicates(rank_items: list[list[tuple[float, int]]]) -> None:
    """Swap a duplicated replica with a slot of another rank when that fixes it.

    Picks, among valid swaps, the one whose two replicas have the closest loads, so the
    rank loads move as little as possible.
    """
    num_ranks = len(rank_items)
    for r in range(num_ranks):
        i = 0
        while i < len(rank_items[r]):
            w, e = rank_items[r][i]
            experts_r = [f for _, f in rank_items[r]]
            if experts_r.count(e) < 2:
                i += 1
                continue
            best: tuple[float, int, int] | None = None
            for r2 in range(num_ranks):
                experts_r2 = [f for _, f in rank_items[r2]]
                if r2 == r or e in experts_r2:
                    continue
                for j, (w2, f) in enumerate(rank_items[r2]):
                    if f in experts_r:
                        continue
                    if best is None or abs(w2 - w) < best[0]:
                        best = (abs(w2 - w), r2, j)
            if best is not None:
                _, r2, j = best
                rank_items[r][i], rank_items[r2][j] = rank_items[r2][j], rank_items[r][i]
            i += 1


def _plan_one(load_E: Tensor, num_ranks: int, num_redundant: int, slots: int) -> Tensor:
    load = load_E.tolist()
    counts = _choose_replicas(load, num_redundant, max_per_expert=num_ranks)
    return torch.tensor(_pack(load, counts, num_ranks, slots), dtype=torch.int64)


def _stack(
    phys_to_logical_LP: Tensor, num_experts: int, num_ranks: int, slots: int
) -> ExpertPlacement:
    if phys_to_logical_LP.dim() == 1:
        l2p_EC, counts_E = _logical_to_phys(phys_to_logical_LP, num_experts)
        return ExpertPlacement(phys_to_logical_LP, l2p_EC, counts_E, num_ranks, slots)
    per_layer = [_logical_to_phys(p2l_P, num_experts) for p2l_P in phys_to_logical_LP]
    max_replicas = max(l2p_EC.shape[1] for l2p_EC, _ in per_layer)
    l2p_LEC = torch.full((len(per_layer), num_experts, max_replicas), -1, dtype=torch.int64)
    for i, (l2p_EC, _) in enumerate(per_layer):
        l2p_LEC[i, :, : l2p_EC.shape[1]] = l2p_EC
    counts_LE = torch.stack([counts_E for _, counts_E in per_layer])
    return ExpertPlacement(phys_to_logical_LP, l2p_LEC, counts_LE, num_ranks, slots)


def plan_placement(load: Tensor, num_ranks: int, *, num_redundant: int = 0) -> ExpertPlacement:
    r"""Place E logical experts (plus ``num_redundant`` replicas) on ``num_ranks`` ranks.

    Args:
        load: [E] non-negative load per expert (e.g. tokens routed to it), or [L, E] to
            plan L layers independently at once (the result is stacked, see
            :class:`ExpertPlacement`). Any real dtype, any device (planning is on CPU).
        num_ranks: R, the expert-parallel degree.
        num_redundant: extra replicas for the hottest experts; ``E + num_redundant``
            must be divisible by R, each rank then holds ``S = (E + num_redundant) / R``.

    Returns:
        An :class:`ExpertPlacement` on the CPU. Deterministic: the same load gives the
        same placement. Every logical expert has at least one replica.
    """
    load = _check_load(load, "plan_placement")
    num_experts = load.shape[-1]
    slots = _check_sizes(num_experts, num_ranks, num_redundant, "plan_placement")
    if load.dim() == 1:
        p2l = _plan_one(load, num_ranks, num_redundant, slots)
    else:
        p2l = torch.stack([_plan_one(load_E, num_ranks, num_redundant, slots) for load_E in load])
        p2l = p2l.reshape(load.shape[0], num_ranks * slots)
    return _stack(p2l, num_experts, num_ranks, slots)


def identity_placement(num_experts: int, num_ranks: int) -> ExpertPlacement:
    """The static layout: expert e on rank ``e // (E / R)``, no replicas.

    With ``num_ranks=1`` the physical layout is the logical one, so
    ``remap_expert_weights(w_E, identity_placement(E, 1), placement)`` builds the
    physical weights of ``placement`` from logical [E, ...] weights, and the reverse
    call gathers them back.
    """
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(
            f"identity_placement: num_experts must be a positive integer, got {num_experts!r}"
        )
    slots = _check_sizes(num_experts, num_ranks, 0, "identity_placement")
    return _stack(torch.arange(num_experts), num_experts, num_ranks, slots)


def _check_placement(placement: ExpertPlacement, fn: str, name: str = "placement") -> None:
    if placement.num_layers is not None:
        raise ValueError(
            f"{fn}: expected a single-layer {name}, got one stacked over "
            f"{placement.num_layers} layers (use placement.layer(i))"
        )
    p2l_P = placement.phys_to_logical
    if p2l_P.shape != (placement.num_physical,):
        raise ValueError(
            f"{fn}: {name}.phys_to_logical must have shape [R*S] = [{placement.num_physical}], "
            f"got {tuple(p2l_P.shape)}"
        )
    missing = (placement.replica_count < 1).nonzero().flatten()
    if missing.numel() > 0:
        raise ValueError(
            f"{fn}: every logical expert needs at least one replica, but {name} has none "
            f"of expert(s) {missing.tolist()}"
        )


def balancedness(load: Tensor, placement: ExpertPlacement) -> float:
    """Mean rank load over max rank load: 1.0 is perfect, 1/R is everything on one rank.

    ``load`` is [E] for a single-layer placement, or [L, E] for a stacked one (then the
    mean over layers of each layer's balancedness). An all-zero load gives 1.0.
    """
    load = _check_load(load, "balancedness")
    rank_loads = placement.rank_loads(load)
    max_load = rank_loads.amax(-1)
    ratio = torch.where(max_load > 0, rank_loads.mean(-1) / max_load.clamp_min(1e-300), 1.0)
    return float(ratio.mean())


def route_to_replicas(expert_ids: Tensor, placement: ExpertPlacement) -> Tensor:
    r"""Map each assignment's logical expert to one of its physical replicas.

    The n-th assignment (in flattened ``[T, K]`` order) of logical expert e goes to
    replica ``n mod replica_count[e]``, so the replicas of an expert receive counts that
    differ by at most one; deterministic and without host syncs (except the range check
    on CPU).

    Args:
        expert_ids: [T, K] (any shape) int32/int64 logical expert ids in ``[0, E)``.
        placement: a single-layer :class:`ExpertPlacement`.

    Returns:
        int64 physical ids of the same shape, ready for
        ``torch_moe.ops.permute_indices(phys_ids, placement.num_physical)``.
    """
    _check_placement(placement, "route_to_replicas")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"route_to_replicas: expected int32/int64 expert_ids, got {expert_ids.dtype}"
        )
    num_experts = placement.num_experts
    if expert_ids.device.type == "cpu" and expert_ids.numel() > 0:
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(
                f"route_to_replicas: expert_ids must be in [0, {num_experts}), got values in [{lo}, {hi}]"
            )
    device = expert_ids.device
    ids_N = expert_ids.reshape(-1).long()
    counts_E = placement.replica_count.to(device)
    l2p_EC = placement.logical_to_phys.to(device)
    # occurrence index of each assignment among those of its expert (stable sort)
    order_N = torch.argsort(ids_N, stable=True)
    seen_E = torch.bincount(ids_N, minlength=num_experts)
    starts_E = torch.cumsum(seen_E, 0) - seen_E
    occ_N = torch.empty_like(ids_N)
    occ_N[order_N] = torch.arange(ids_N.numel(), device=device) - starts_E[ids_N[order_N]]
    replica_N = occ_N % counts_E[ids_N]
    return l2p_EC[ids_N, replica_N].reshape(expert_ids.shape)


def remap_indices(old: ExpertPlacement, new: ExpertPlacement) -> Tensor:
    """[P_new] int64: the old physical slot to copy into each new physical slot.

    Each new slot reads the first (lowest-numbered) old replica of its logical expert.
    Both placements must cover the same E logical experts, each with >= 1 replica, so
    every expert the new layout needs is present in the old one.
    """
    _check_placement(old, "remap_indices", "old")
    _check_placement(new, "remap_indices", "new")
    if old.num_experts != new.num_experts:
        raise ValueError(
            f"remap_indices: old and new placements must have the same number of experts, "
            f"got {old.num_experts} and {new.num_experts}"
        )
    return old.logical_to_phys[new.phys_to_logical, 0]


def remap_expert_weights(w: Tensor, old: ExpertPlacement, new: ExpertPlacement) -> Tensor:
    """Re-lay physical expert weights [P_old, ...] laid out by ``old`` as [P_new, ...] for ``new``.

    Single-process helper (the distributed version moves the same rows between ranks).
    Exact: every row is a copy of a row of ``w`` (an ``index_select``, so any dtype and
    device, and differentiable).
    """
    src_P = remap_indices(old, new)
    if w.dim() < 1 or w.shape[0] != old.num_physical:
        raise ValueError(
            f"remap_expert_weights: expected w of shape [{old.num_physical}, ...] "
            f"(the physical slots of old), got {tuple(w.shape)}"
        )
    return w.index_select(0, src_P.to(w.device))
