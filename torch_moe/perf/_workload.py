"""``MoEWorkload``: one MoE layer's step on one rank, and the routing statistics it implies.

Legend: T tokens of one rank, D dim, F expert hidden dim, Fs shared hidden dim, E experts,
K top-k, R = ``ep`` expert-parallel ranks, El = E / R local experts, N = ``nodes`` nodes
the EP group spans, L = R / N ranks per node.

Routing statistics:

* Expert popularity: ``routing_skew = s`` gives Zipf weights ``p_e ~ (e + 1)^-s`` (expert
  0 the hottest); an explicit [E] load vector is taken as is (e.g. ``moe.tokens_per_expert``).
* Inclusion probability of expert e in a token's top-K (K distinct experts drawn in
  proportion to p, i.e. Gumbel-top-K): ``K / E`` for uniform p; for skewed p a seeded
  Monte Carlo of 8192 Gumbel-top-K draws (deterministic, ~0.5% sampling error; the
  closed-form Poisson approximation ``1 - exp(-lam * p_e)`` was off by up to 0.05 against
  Monte Carlo at E=16, K=2, Zipf 1.2). Expected rows of expert e: ``T * pi_e``.
* Distinct ranks (nodes) a token reaches with experts placed contiguously, uniform routing:
  ``R * (1 - C(E - El, K) / C(E, K))`` (hypergeometric: the chance that none of a rank's El
  experts is among the K; exact). Skewed or node-limited routing (at most M nodes per
  token, the M groups with the best two scores, DeepSeek-V3 / ``topk_route``): the same
  Monte Carlo (the hypergeometric formula over the M chosen nodes would undercount: the
  group selection favours spreading, measured 3.98 nodes at E=64, K=8, N=8, M=4 against
  its 3.72).
* Rows on the busiest EP rank: ``E[max_r rows_r]`` over a random assignment of the
  popularity to experts and the multinomial noise of T*R assignments (128 seeded draws,
  deterministic); with redundant replicas (``num_redundant``) the rank loads of
  ``torch_moe.distributed.placement.plan_placement`` on the expected loads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "MoEWorkload",
    "distinct_ranks_per_token",
    "inclusion_probabilities",
    "recipe_operands",
]

_EXCHANGES = ("p2p", "all_to_all")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MC_DRAWS = 128


def _precisions() -> tuple[str, ...]:
    from torch_moe.quantization import RECIPES

    return ("bf16", *sorted(RECIPES))


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"MoEWorkload: {name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class MoEWorkload:
    """One MoE layer's forward (+ backward) on one rank of an expert-parallel group.

    Args:
        tokens: T, tokens routed by this rank per step (a rank's micro-batch).
        dim, hidden_dim, num_experts, top_k: D, F, E, K as in :class:`torch_moe.nn.MoE`.
        shared_hidden_dim: Fs of the always-on shared expert (0: none).
        dtype: the parameter / activation dtype of the layer (bf16, fp16 or fp32).
        precision: ``"bf16"`` (experts in ``dtype``) or a recipe name of
            :data:`torch_moe.quantization.RECIPES` for the routed experts' GEMMs.
        ep: R, the expert-parallel degree (``num_experts % ep == 0``).
        nodes: N, nodes the EP group spans (``ep % nodes == 0``).
        num_chunks: ``ExpertParallel(num_chunks=)``: pipeline dispatch / experts / combine
            over this many groups of local experts (``El % num_chunks == 0``).
        exchange: ``"p2p"`` (segment exchange, R*El messages per direction) or
            ``"all_to_all"`` (one collective per direction plus row reorders).
        capacity_factor: keep at most ``ceil(cf * T * K / E)`` rows per expert; None: dropless.
        routing_skew: Zipf exponent of expert popularity (0: uniform), or an explicit [E]
            list / tensor of per-expert loads (any scale; normalized to T*K assignments).
        backward: model forward + backward (True) or the forward only.
        dispatch_dtype: ``torch.float8_e4m3fn``: FP8 dispatch (1x128 scales); None: ``dtype``.
        hierarchical: two-stage (intra-node, then inter-node) all-to-all
            (``ExpertParallel(node_size=ep // nodes)``; an all_to_all exchange).
        node_limit: M, node-limited routing (at most M nodes per token); None: unlimited.
        num_redundant: redundant expert replicas placed by ``plan_placement``
            (``(num_experts + num_redundant) % ep == 0``).
        dedup: send each token once per destination node over the inter-node link and fan
            it out inside the node (DeepEP's normal mode). A what-if: torch_moe's
            ``ExpertParallel`` sends one row per (token, expert).
    """

    tokens: int
    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int
    shared_hidden_dim: int = 0
    dtype: torch.dtype = torch.bfloat16
    precision: str = "bf16"
    ep: int = 1
    nodes: int = 1
    num_chunks: int = 1
    exchange: str = "p2p"
    capacity_factor: float | None = None
    routing_skew: float | Sequence[float] | torch.Tensor = 0.0
    backward: bool = True
    dispatch_dtype: torch.dtype | None = None
    hierarchical: bool = False
    node_limit: int | None = None
    num_redundant: int = 0
    dedup: bool = False

    def __post_init__(self) -> None:
        _check_int("tokens", self.tokens, 1)
        for name in ("dim", "hidden_dim", "num_experts", "top_k", "ep", "nodes", "num_chunks"):
            _check_int(name, getattr(self, name), 1)
        _check_int("shared_hidden_dim", self.shared_hidden_dim, 0)
        _check_int("num_redundant", self.num_redundant, 0)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEWorkload: top_k must be in [1, num_experts={self.num_experts}], "
                f"got top_k={self.top_k}"
            )
        if self.num_experts % self.ep != 0:
            raise ValueError(
                f"MoEWorkload: num_experts ({self.num_experts}) must be divisible by ep ({self.ep})"
            )
        if self.ep % self.nodes != 0:
            raise ValueError(
                f"MoEWorkload: ep ({self.ep}) must be divisible by nodes ({self.nodes})"
            )
        if (self.num_experts // self.ep) % self.num_chunks != 0:
            raise ValueError(
                f"MoEWorkload: num_chunks ({self.num_chunks}) must divide the local experts "
                f"num_experts / ep = {self.num_experts // self.ep}"
            )
        if (self.num_experts + self.num_redundant) % self.ep != 0:
            raise ValueError(
                f"MoEWorkload: num_experts + num_redundant ({self.num_experts} + "
                f"{self.num_redundant}) must be divisible by ep ({self.ep})"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"MoEWorkload: dtype must be one of {_DTYPES}, got {self.dtype}")
        if self.precision not in _precisions():
            raise ValueError(
                f"MoEWorkload: precision must be one of {list(_precisions())}, "
                f"got {self.precision!r}"
            )
        if self.exchange not in _EXCHANGES:
            raise ValueError(
                f"MoEWorkload: exchange must be one of {_EXCHANGES}, got {self.exchange!r}"
            )
        if self.hierarchical and self.exchange != "all_to_all":
            raise ValueError(
                "MoEWorkload: hierarchical=True is an all_to_all exchange, got "
                f"exchange={self.exchange!r}"
            )
        if self.capacity_factor is not None and not 0 < self.capacity_factor < math.inf:
            raise ValueError(
                "MoEWorkload: capacity_factor must be finite and > 0, or None, got "
                f"{self.capacity_factor!r}"
            )
        if self.dispatch_dtype not in (None, torch.float8_e4m3fn):
            raise ValueError(
                "MoEWorkload: dispatch_dtype must be None or torch.float8_e4m3fn, got "
                f"{self.dispatch_dtype}"
            )
        if self.node_limit is not None:
            _check_int("node_limit", self.node_limit, 1)
        skew = self.routing_skew
        if isinstance(skew, (int, float)) and not isinstance(skew, bool):
            if not math.isfinite(skew) or skew < 0:
                raise ValueError(f"MoEWorkload: routing_skew must be >= 0, got {skew!r}")
        else:
            load = torch.as_tensor(skew, dtype=torch.float64)
            if load.shape != (self.num_experts,):
                raise ValueError(
                    f"MoEWorkload: routing_skew as a load vector must have num_experts="
                    f"{self.num_experts} entries, got shape {list(load.shape)}"
                )
            if not bool(torch.isfinite(load).all()) or bool((load < 0).any()) or load.sum() <= 0:
                raise ValueError(
                    "MoEWorkload: routing_skew as a load vector must be finite, >= 0 and "
                    "not all zero"
                )
            object.__setattr__(self, "routing_skew", tuple(load.tolist()))

    # ----------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_moe(cls, moe: Any, tokens: int, **overrides: Any) -> MoEWorkload:
        """The workload of a :class:`torch_moe.nn.MoE` routing ``tokens`` tokens per rank.

        Reads D, F, E, K, Fs, the capacity factor, the precision and the parameter dtype
        from the module; when the module is parallelized with ``ExpertParallel`` (its expert
        weights are DTensors), ``ep`` is the mesh size. ``overrides`` set any other field
        (e.g. ``routing_skew=moe.tokens_per_expert``).
        """
        config = moe.config
        precision = moe.experts.precision
        if getattr(moe.experts, "composed", False):
            raise ValueError(
                "MoEWorkload.from_moe: composed experts (activation="
                f"{config['activation']!r}, experts_bias={config['experts_bias']}, "
                f"gate_up_interleaved={config['gate_up_interleaved']}) are not modelled; the "
                "model covers grouped_swiglu's SwiGLU experts"
            )
        if config["shared_activation"] != "swiglu" or config["shared_swiglu_limit"] is not None:
            raise ValueError(
                "MoEWorkload.from_moe: a shared expert with shared_activation="
                f"{config['shared_activation']!r}, shared_swiglu_limit="
                f"{config['shared_swiglu_limit']} is not modelled; the model covers a SwiGLU "
                "shared expert"
            )
        if precision not in _precisions():
            raise ValueError(
                f"MoEWorkload.from_moe: precision {precision!r} (a recipe with overrides) is "
                f"not modelled; pass precision= one of {list(_precisions())}"
            )
        fields: dict[str, Any] = dict(
            tokens=tokens,
            dim=config["dim"],
            hidden_dim=config["hidden_dim"],
            num_experts=config["num_experts"],
            top_k=config["top_k"],
            shared_hidden_dim=config["shared_hidden_dim"],
            capacity_factor=config["capacity_factor"],
            precision=precision,
            dtype=moe.experts.w13.dtype,
        )
        mesh = getattr(moe.experts.w13, "device_mesh", None)
        if mesh is not None:
            fields["ep"] = mesh.size()
        fields.update(overrides)
        return cls(**fields)

    def replace(self, **changes: Any) -> MoEWorkload:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------------
    # sizes

    @property
    def local_experts(self) -> int:
        """El: experts held by one rank (physical slots with redundant replicas)."""
        return (self.num_experts + self.num_redundant) // self.ep

    @property
    def ranks_per_node(self) -> int:
        return self.ep // self.nodes

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def capacity(self) -> int | None:
        """Rows kept per expert with a capacity factor (the layer's formula)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * self.tokens * self.top_k / self.num_experts)

    @property
    def skew_label(self) -> str:
        if isinstance(self.routing_skew, tuple):
            return "loads"
        return f"zipf{self.routing_skew:g}"

    # ----------------------------------------------------------------------------------
    # routing statistics

    def popularity(self) -> torch.Tensor:
        """[E] float64 popularity p_e (sums to 1)."""
        if isinstance(self.routing_skew, tuple):
            p = torch.tensor(self.routing_skew, dtype=torch.float64)
        else:
            ranks = torch.arange(1, self.num_experts + 1, dtype=torch.float64)
            p = ranks ** (-float(self.routing_skew))  # type: ignore[arg-type]
        return p / p.sum()

    def expected_loads(self) -> torch.Tensor:
        """[E] float64 expected rows per expert from this rank's T tokens (sum = T*K)."""
        if isinstance(self.routing_skew, tuple):
            # an observed load: taken as the popularity, capped at one row per token
            pi = _capped_share(self.popularity(), self.top_k)
        else:
            pi = inclusion_probabilities(self.popularity(), self.top_k)
        return pi * self.tokens

    def distinct_ranks(self) -> float:
        """Expected distinct EP ranks one token's K experts live on (contiguous placement)."""
        return distinct_ranks_per_token(self.popularity(), self.top_k, self.ep)

    def distinct_nodes(self) -> float:
        """Expected distinct nodes per token (node-limited when ``node_limit`` is set)."""
        return distinct_ranks_per_token(
            self.popularity(), self.top_k, self.nodes, node_limit=self.node_limit
        )

    def rank_rows(self) -> tuple[float, float, torch.Tensor]:
        """(mean, expected max) rows received per rank, and the busiest rank's [El] rows.

        Every rank routes T tokens, so expert e receives ``R * T * pi_e`` rows in total.
        Dropless; with a capacity each expert keeps at most ``R * capacity`` of them.
        """
        return _rank_rows(self)


def recipe_operands(precision: str) -> dict[str, tuple[str, str]]:
    """Per GEMM (forward, dgrad, wgrad) of a recipe: how its (lhs, rhs) operands are
    quantized, as the kernel names of :mod:`torch_moe.perf._calibrate` (``q.*`` along the
    reduction dim of A [m, k] or B [E, k, n], ``qj.*`` jagged along the rows of a group)."""
    if precision == "fp8_tensorwise":
        return {g: ("q.fp8_tensor", "q.fp8_tensor") for g in ("forward", "dgrad", "wgrad")}
    if precision == "fp8_rowwise":
        fwd = ("q.fp8_row", "q.fp8_col")
        return {"forward": fwd, "dgrad": fwd, "wgrad": ("qj.fp8_group", "qj.fp8_group")}
    if precision == "fp8_blockwise":
        fwd = ("q.fp8_1x128", "q.fp8_128x128")
        return {"forward": fwd, "dgrad": fwd, "wgrad": ("qj.fp8_128", "qj.fp8_128")}
    if precision in ("mxfp8", "mxfp8_rceil"):
        fwd = ("q.mx_row", "q.mx_col")
        return {"forward": fwd, "dgrad": fwd, "wgrad": ("qj.mx_32", "qj.mx_32")}
    raise ValueError(f"no quantize model for precision {precision!r}")


# --------------------------------------------------------------------------------------
# routing statistics (module level so tests can check them against Monte Carlo)


_MC_TOKENS = 8192  # Gumbel-top-K draws of the skewed / node-limited statistics


@functools.lru_cache(maxsize=64)
def _gumbel_topk(
    popularity: tuple[float, ...], k: int, groups: int, node_limit: int | None
) -> tuple[tuple[float, ...], float]:
    """Seeded Monte Carlo of Gumbel-top-K routing: (inclusion probabilities, mean distinct
    groups per token) with experts contiguous in ``groups`` groups and, with
    ``node_limit=M``, group-limited selection (the M groups with the largest sum of their
    two best scores, as ``torch_moe.ops.topk_route``)."""
    p = torch.tensor(popularity, dtype=torch.float64)
    num_experts = p.numel()
    per = num_experts // groups
    g = torch.Generator().manual_seed(0)
    u = torch.rand(_MC_TOKENS, num_experts, generator=g, dtype=torch.float64)
    scores = p.log() - torch.log(-torch.log(u.clamp_min(1e-300)))
    if node_limit is not None and node_limit < groups:
        by_group = scores.view(_MC_TOKENS, groups, per)
        group_score = by_group.topk(min(2, per), dim=-1).values.sum(-1)
        keep = group_score.topk(node_limit, dim=-1).indices
        drop = torch.ones(_MC_TOKENS, groups, dtype=torch.bool).scatter(1, keep, False)
        scores = by_group.masked_fill(drop.unsqueeze(-1), -math.inf).view(_MC_TOKENS, -1)
    ids = scores.topk(k, dim=-1).indices
    incl = torch.bincount(ids.flatten(), minlength=num_experts).double() / _MC_TOKENS
    owner = (ids // per).sort(dim=-1).values
    distinct = (1 + (owner.diff(dim=-1) != 0).sum(-1)).double().mean()
    return tuple(incl.tolist()), float(distinct)


def inclusion_probabilities(popularity: torch.Tensor, k: int) -> torch.Tensor:
    """[E] chance that expert e is among a token's K distinct picks (module docstring)."""
    p = popularity.to(torch.float64)
    p = p / p.sum()
    if bool((p == p[0]).all()):
        return torch.full_like(p, k / p.numel())
    if k >= int((p > 0).sum()):
        return (p > 0).to(torch.float64)
    incl, _ = _gumbel_topk(tuple(p.tolist()), k, 1, None)
    return torch.tensor(incl, dtype=torch.float64)


def _capped_share(load: torch.Tensor, k: int) -> torch.Tensor:
    """Shares ``k * load / sum(load)`` with any share above 1 capped and the excess
    redistributed over the others in proportion (water filling)."""
    share = load / load.sum() * k
    for _ in range(load.numel()):
        over = share > 1
        if not bool(over.any()):
            break
        excess = float((share[over] - 1).sum())
        share = torch.where(over, torch.ones_like(share), share)
        free = ~over & (share < 1)
        share[free] += excess * share[free] / share[free].sum()
    return share


def _log_comb(n: int, k: int) -> float:
    if k < 0 or k > n:
        return -math.inf
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def distinct_ranks_per_token(
    popularity: torch.Tensor, k: int, num_ranks: int, *, node_limit: int | None = None
) -> float:
    """Expected distinct ranks (or nodes) among a token's K experts, experts contiguous.

    Uniform popularity without a node limit: the hypergeometric formula of the module
    docstring (exact); otherwise the seeded Gumbel-top-K Monte Carlo (8192 tokens).
    ``node_limit=M``: group-limited routing over the ``num_ranks`` groups.
    """
    p = popularity.to(torch.float64)
    p = p / p.sum()
    num_experts = p.numel()
    if num_experts % num_ranks:
        raise ValueError(
            f"distinct_ranks_per_token: num_experts ({num_experts}) must be divisible by "
            f"num_ranks ({num_ranks})"
        )
    per = num_experts // num_ranks
    limited = node_limit is not None and node_limit < num_ranks
    if bool((p == p[0]).all()) and not limited:
        miss = math.exp(_log_comb(num_experts - per, k) - _log_comb(num_experts, k))
        return num_ranks * (1 - miss)
    _, distinct = _gumbel_topk(tuple(p.tolist()), k, num_ranks, node_limit if limited else None)
    return distinct


@functools.lru_cache(maxsize=256)
def _rank_rows_cached(
    loads: tuple[float, ...], ep: int, tokens_total: int, num_redundant: int, cap: float
) -> tuple[float, float, tuple[float, ...]]:
    load_E = torch.tensor(loads, dtype=torch.float64)
    num_experts = load_E.numel()
    mean = float(load_E.clamp(max=cap).sum()) / ep
    if ep == 1:
        rows = load_E.clamp(max=cap)
        return mean, float(rows.sum()), tuple(rows.tolist())
    if num_redundant > 0:
        from torch_moe.distributed.placement import plan_placement

        placement = plan_placement(load_E, ep, num_redundant=num_redundant)
        share = load_E / placement.replica_count.to(torch.float64)
        phys = share[placement.phys_to_logical].view(ep, -1).clamp(max=cap)
        busiest = int(phys.sum(1).argmax())
        return mean, float(phys.sum(1).max()), tuple(phys[busiest].tolist())
    per = num_experts // ep
    g = torch.Generator().manual_seed(0)
    # multinomial noise of the per-expert counts (normal approximation)
    pi = (load_E / max(tokens_total, 1)).clamp(0, 1)
    std = (tokens_total * pi * (1 - pi)).sqrt()
    uniform = bool((load_E == load_E[0]).all())
    best_rows = torch.zeros(per, dtype=torch.float64)
    maxes = []
    for _ in range(_MC_DRAWS):
        order = torch.arange(num_experts) if uniform else torch.randperm(num_experts, generator=g)
        noise = torch.randn(num_experts, generator=g, dtype=torch.float64)
        draw = (load_E[order] + std[order] * noise).clamp(min=0).clamp(max=cap).view(ep, per)
        totals = draw.sum(1)
        r = int(totals.argmax())
        maxes.append(float(totals[r]))
        best_rows += draw[r].sort(descending=True).values
    return mean, sum(maxes) / len(maxes), tuple((best_rows / _MC_DRAWS).tolist())


def _rank_rows(w: MoEWorkload) -> tuple[float, float, torch.Tensor]:
    load_E = w.expected_loads() * w.ep  # every rank routes T tokens
    cap = math.inf if w.capacity is None else float(w.capacity * w.ep)
    mean, mx, rows = _rank_rows_cached(
        tuple(load_E.tolist()), w.ep, w.tokens * w.ep, w.num_redundant, cap
    )
    return mean, mx, torch.tensor(rows, dtype=torch.float64)
