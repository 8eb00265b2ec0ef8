"""``advise()``: rank execution strategies for one MoE layer by predicted step time.

Legend: W world size (ranks available), R EP degree, DP = W / R data-parallel replicas
of the experts, L ranks per node, E experts, El local experts, T tokens per rank.

A strategy fixes what the layer's user can choose (``ExpertParallel`` and ``MoE``
arguments): the EP degree R (a divisor of W and of E; the EP group packed into
``ceil(R / L)`` nodes), ``num_chunks``, ``exchange``, the hierarchical all-to-all, FP8
dispatch, the precision recipe, a capacity factor (only with ``allow_drop``: dropping
tokens changes the model), and redundant expert replicas placed by
``torch_moe.distributed.placement.plan_placement`` (only under skewed routing).

Step time of a candidate: :func:`~torch_moe.perf.predict` of the layer on the busiest rank,
plus the gradient all-reduce of the experts that are replicated over DP > 1 ranks (a ring
over the link the replicas share, not overlapped with the backward: a conservative bound).
Candidates whose ``peak_step`` memory (peak + Adam states) exceeds the limit are ranked
after every fitting one. ``split_tokens=True`` models a fixed global batch instead (one
host, or a fixed inference batch): R ranks split ``tokens`` and there is no DP.

The winner is explained by the components (``Prediction.breakdown``) where it differs most
from the runner-up and from the simplest strategy (EP = 1 or the smallest, bf16, one chunk).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from torch_moe.perf._hardware import Hardware
from torch_moe.perf._model import Prediction, predict
from torch_moe.perf._workload import _EXCHANGES, MoEWorkload

__all__ = ["Advice", "Candidate", "Strategy", "advise"]

_FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Strategy:
    """One way to run the layer (see the module docstring)."""

    ep: int = 1
    num_chunks: int = 1
    exchange: str = "p2p"
    hierarchical: bool = False
    dispatch_dtype: torch.dtype | None = None
    precision: str = "bf16"
    capacity_factor: float | None = None
    num_redundant: int = 0

    def describe(self) -> str:
        parts = [f"EP={self.ep}"]
        if self.ep > 1:
            parts.append(self.exchange + (" hier" if self.hierarchical else ""))
            parts.append(f"C={self.num_chunks}")
            if self.dispatch_dtype is not None:
                parts.append("fp8-dispatch")
            if self.num_redundant:
                parts.append(f"+{self.num_redundant} replicas")
        parts.append(self.precision)
        parts.append("dropless" if self.capacity_factor is None else f"cf={self.capacity_factor:g}")
        return ", ".join(parts)

    def workload(self, base: MoEWorkload, nodes: int, tokens: int) -> MoEWorkload:
        return base.replace(
            tokens=tokens,
            ep=self.ep,
            nodes=nodes,
            num_chunks=self.num_chunks,
            exchange=self.exchange,
            hierarchical=self.hierarchical,
            dispatch_dtype=self.dispatch_dtype,
            precision=self.precision,
            capacity_factor=self.capacity_factor,
            num_redundant=self.num_redundant,
        )


@dataclass
class Candidate:
    strategy: Strategy
    prediction: Prediction
    grad_sync: float
    memory: float
    fits: bool

    @property
    def step_time(self) -> float:
        return self.prediction.time + self.grad_sync


@dataclass
class Advice:
    """Ranked candidates (fitting ones first, by step time) and why the first wins."""

    candidates: list[Candidate]
    reasons: list[str]
    memory_limit: float

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def table(self, n: int = 10) -> str:
        rows = [
            "| rank | strategy | step ms | layer ms | grad sync ms | peak+Adam GiB | fits |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, c in enumerate(self.candidates[:n]):
            rows.append(
                f"| {i + 1} | {c.strategy.describe()} | {c.step_time * 1e3:.3f} | "
                f"{c.prediction.time * 1e3:.3f} | {c.grad_sync * 1e3:.3f} | "
                f"{c.memory / 2**30:.2f} | {'yes' if c.fits else 'no'} |"
            )
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table() + "\n\n" + "\n".join(f"- {r}" for r in self.reasons)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _grad_sync(w: MoEWorkload, hw: Hardware, world: int, gpus_per_node: int) -> float:
    """Ring all-reduce of the expert gradients over the DP = world / R replicas."""
    dp = world // w.ep
    if dp <= 1:
        return 0.0
    nbytes = w.local_experts * 3 * w.hidden_dim * w.dim * w.element_size
    # a rank's replicas are R ranks apart: on other nodes once the world spans nodes
    link = hw.link(world > gpus_per_node, ranks_on_host=min(world, gpus_per_node))
    return 2 * (dp - 1) / dp * nbytes / link.bandwidth + 2 * (dp - 1) * link.latency


def _strategies(
    w: MoEWorkload,
    world: int,
    gpus_per_node: int,
    precisions: list[str],
    allow_drop: bool,
    space: dict[str, list[Any]],
) -> list[tuple[Strategy, int]]:
    skewed = isinstance(w.routing_skew, tuple) or float(w.routing_skew) > 0  # type: ignore[arg-type]
    eps = space.get("ep") or [r for r in _divisors(world) if w.num_experts % r == 0]
    out = []
    for ep in eps:
        if ep > gpus_per_node and ep % gpus_per_node != 0:
            continue
        nodes = max(1, ep // gpus_per_node) if ep > gpus_per_node else 1
        el = w.num_experts // ep
        chunks = space.get("num_chunks") or (
            [c for c in (1, 2, 4) if el % c == 0] if ep > 1 else [1]
        )
        exchanges = space.get("exchange") or (["p2p", "all_to_all"] if ep > 1 else ["p2p"])
        hier = space.get("hierarchical") or ([False, True] if nodes > 1 else [False])
        dispatch = space.get("dispatch_dtype") or ([None, _FP8] if ep > 1 else [None])
        cfs = space.get("capacity_factor") or ([None, 1.0, 1.25] if allow_drop else [None])
        redundant = space.get("num_redundant") or ([0, ep] if ep > 1 and skewed else [0])
        precs = space.get("precision") or precisions
        for c, ex, h, dd, p, cf, r in itertools.product(
            chunks, exchanges, hier, dispatch, precs, cfs, redundant
        ):
            if h and ex != "all_to_all":
                continue
            if (w.num_experts + r) % ep or ((w.num_experts + r) // ep) % c:
                continue
            if cf is not None and ep > 1:
                continue  # ExpertParallel is dropless
            out.append((Strategy(ep, c, ex, h, dd, p, cf, r), nodes))
    return out


def _explain(best: Candidate, others: list[Candidate], simplest: Candidate | None) -> list[str]:
    reasons = [
        f"{best.strategy.describe()}: {best.step_time * 1e3:.3f} ms per step predicted "
        f"(layer {best.prediction.time * 1e3:.3f} ms + gradient sync "
        f"{best.grad_sync * 1e3:.3f} ms), peak + Adam {best.memory / 2**30:.2f} GiB."
    ]
    for label, other in (("runner-up", others[0] if others else None), ("baseline", simplest)):
        if other is None or other is best:
            continue
        delta = {
            k: other.prediction.breakdown.get(k, 0.0) - best.prediction.breakdown.get(k, 0.0)
            for k in set(other.prediction.breakdown) | set(best.prediction.breakdown)
        }
        delta["grad_sync"] = other.grad_sync - best.grad_sync
        top = sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:3]
        what = ", ".join(f"{k} {v * 1e3:+.3f} ms" for k, v in top if abs(v) > 0)
        state = "" if other.fits else " (does not fit the memory limit)"
        reasons.append(
            f"vs {label} {other.strategy.describe()}{state}: {other.step_time * 1e3:.3f} ms; "
            f"it spends more on {what}."
        )
    return reasons


def _check_space(space: dict[str, list[Any]], precisions: list[str]) -> None:
    """Each key of ``advise``'s ``space`` a strategy field, each value a non-empty list of
    values that field takes (a key unknown, an empty list or a value the workload would
    refuse was once dropped in silence, and the advice then blamed the expert count)."""
    fields = [f.name for f in dataclasses.fields(Strategy)]
    for key, values in space.items():
        if key not in fields:
            raise ValueError(f"advise: space has an unknown field {key!r}; valid: {fields}")
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"advise: space[{key!r}] must be a non-empty list, got {values!r}")
        for v in values:
            if key in ("ep", "num_chunks"):
                ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
            elif key == "num_redundant":
                ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
            elif key == "exchange":
                ok = v in _EXCHANGES
            elif key == "hierarchical":
                ok = isinstance(v, bool)
            elif key == "dispatch_dtype":
                ok = v is None or v == _FP8
            elif key == "precision":
                ok = v in precisions
            else:  # capacity_factor
                ok = v is None or (isinstance(v, (int, float)) and 0 < v < math.inf)
            if not ok:
                raise ValueError(
                    f"advise: space[{key!r}] holds a value the field does not take: {v!r}"
                )


def advise(
    workload: MoEWorkload,
    hardware: Hardware,
    world_size: int = 1,
    gpus_per_node: int | None = None,
    *,
    memory_limit: float | None = None,
    precisions: list[str] | None = None,
    allow_drop: bool = False,
    split_tokens: bool = False,
    space: dict[str, list[Any]] | None = None,
) -> Advice:
    """Rank the strategies for ``workload`` on ``world_size`` ranks of ``hardware``.

    Args:
        workload: the layer and its tokens per rank (its own strategy fields are ignored).
        world_size: ranks available (the EP degree ranges over its divisors).
        gpus_per_node: ranks per node (default: the hardware's).
        memory_limit: bytes per rank (default: the hardware's memory capacity; none where
            that is 0, unknown); ``math.inf``: no limit.
        precisions: the recipes to consider (default: bf16 and every recipe).
        allow_drop: also consider capacity factors 1.0 and 1.25 (drops tokens).
        split_tokens: ``workload.tokens`` is a global batch split over the R ranks of each
            candidate (no data parallelism), instead of the tokens of every rank.
        space: restrict any strategy field to the listed values, e.g.
            ``{"exchange": ["p2p"], "num_chunks": [1, 2]}``.
    """
    from torch_moe.quantization import RECIPES

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"advise: world_size must be a positive integer, got {world_size!r}")
    gpn = gpus_per_node if gpus_per_node is not None else hardware.gpus_per_node
    if not isinstance(gpn, int) or gpn < 1:
        raise ValueError(f"advise: gpus_per_node must be a positive integer, got {gpn!r}")
    if memory_limit is not None and not memory_limit > 0:  # (NaN too)
        raise ValueError(
            "advise: memory_limit must be > 0 bytes (math.inf: no limit) or None, got "
            f"{memory_limit}"
        )
    limit = memory_limit if memory_limit is not None else hardware.memory_capacity or math.inf
    valid = ["bf16", *sorted(RECIPES)]
    precs = precisions if precisions is not None else valid
    for p in precs:
        if p not in valid:
            raise ValueError(f"advise: unknown precision {p!r}; valid: {valid}")
    space = dict(space or {})
    _check_space(space, precisions=valid)
    candidates: list[Candidate] = []
    for strategy, nodes in _strategies(workload, world_size, gpn, precs, allow_drop, space):
        tokens = workload.tokens
        if split_tokens:
            tokens = max(1, workload.tokens // strategy.ep)
        try:
            w = strategy.workload(workload, nodes, tokens)
        except ValueError:
            continue
        pred = predict(w, hardware)
        sync = 0.0 if split_tokens else _grad_sync(w, hardware, world_size, gpn)
        mem = pred.memory["peak_step"]
        candidates.append(Candidate(strategy, pred, sync, mem, mem <= limit))
    if not candidates:
        raise ValueError(
            f"advise: no strategy applies to {workload} on world_size={world_size} "
            f"(num_experts={workload.num_experts} must be divisible by an EP degree)"
        )
    candidates.sort(key=lambda c: (not c.fits, c.step_time))
    best = candidates[0]
    simplest = min(
        candidates,
        key=lambda c: (
            c.strategy.ep,
            c.strategy.precision != "bf16",
            c.strategy.num_chunks,
            c.strategy.exchange != "p2p",
            c.strategy.dispatch_dtype is not None,
            c.strategy.capacity_factor is not None,
            c.strategy.num_redundant,
        ),
    )
    reasons = _explain(best, candidates[1:], simplest)
    if not best.fits:
        reasons.insert(
            0,
            f"No strategy fits {limit / 2**30:.2f} GiB per rank; the fastest is shown.",
        )
    return Advice(candidates, reasons, limit)
