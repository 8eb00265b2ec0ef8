"""Deliberately naive per-token float64 loops: the oracles the tests compare against.

Nothing here is vectorized beyond a single row and nothing is shared with torch_moe's
implementation, so a bug in one is unlikely to be repeated in the other.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def route(
    logits: Tensor,
    k: int,
    score_func: str = "softmax",
    expert_bias: Tensor | None = None,
    num_expert_groups: int | None = None,
    num_limited_groups: int | None = None,
    route_norm: bool = False,
    route_scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token routing in float64 (DESIGN.md §3). Returns weights, ids, counts."""
    num_tokens, num_experts = logits.shape
    weights = torch.zeros(num_tokens, k, dtype=torch.float64)
    ids = torch.zeros(num_tokens, k, dtype=torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64)
    for t in range(num_tokens):
        row = [float(v) for v in logits[t].double()]
        if score_func == "softmax":
            mx = max(row)
            ex = [math.exp(v - mx) for v in row]
            scores = [v / sum(ex) for v in ex]
        elif score_func == "sigmoid":
            scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        else:
            scores = list(row)
        sel = list(scores)
        if expert_bias is not None:
            sel = [s + float(b) for s, b in zip(sel, expert_bias.double())]
        if num_expert_groups is not None:
            size = num_experts // num_expert_groups
            group_scores = []
            for g in range(num_expert_groups):
                members = sorted(sel[g * size : (g + 1) * size], reverse=True)
                group_scores.append(sum(members[:2]))
            keep = sorted(range(num_expert_groups), key=lambda g: -group_scores[g])
            keep = keep[:num_limited_groups]
            sel = [s if e // size in keep else -math.inf for e, s in enumerate(sel)]
        chosen = sorted(range(num_experts), key=lambda e: -sel[e])[:k]
        if score_func == "softmax_topk":
            mx = max(row[e] for e in chosen)
            ex = [math.exp(row[e] - mx) for e in chosen]
            w = [v / sum(ex) for v in ex]
        else:
            w = [scores[e] for e in chosen]
        if route_norm:
            total = sum(w) + 1e-20
            w = [v / total for v in w]
        for j, e in enumerate(chosen):
            weights[t, j] = w[j] * route_scale
            ids[t, j] = e
            counts[e] += 1
    return weights, ids, counts


def dispatch(
    expert_ids: Tensor, num_experts: int, align: int = 1, capacity: int | None = None
) -> tuple[list[tuple[int, int] | None], list[int], int]:
    """Rows of the permuted buffer as (token, k) or None (padding), group ends, dropped."""
    num_tokens, top_k = expert_ids.shape
    rows: list[tuple[int, int] | None] = []
    ends = []
    dropped = 0
    for e in range(num_experts):
        mine = [(t, j) for t in range(num_tokens) for j in range(top_k) if expert_ids[t, j] == e]
        if capacity is not None:
            dropped += max(0, len(mine) - capacity)
            mine = mine[:capacity]
        start = len(rows)
        rows.extend(mine)
        while (len(rows) - start) % align != 0:
            rows.append(None)
        ends.append(len(rows))
    return rows, ends, dropped


def expert_swiglu(x_row: Tensor, w13_e: Tensor, w2_e: Tensor) -> Tensor:
    """One token through one SwiGLU expert, float64."""
    x64 = x_row.double()
    hidden = w13_e.shape[0] // 2
    out = torch.zeros(w2_e.shape[0], dtype=torch.float64)
    for f in range(hidden):
        gate = float(w13_e[f].double() @ x64)
        up = float(w13_e[hidden + f].double() @ x64)
        act = gate / (1.0 + math.exp(-gate)) * up
        out += act * w2_e[:, f].double()
    return out


def moe(
    x: Tensor,
    weights: Tensor,
    expert_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    capacity: int | None = None,
) -> Tensor:
    """out[t] = sum_k w[t,k] * expert_{e[t,k]}(x[t]), dropping past capacity in token order."""
    num_tokens, top_k = expert_ids.shape
    used = [0] * w13.shape[0]
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float64)
    kept = {}
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(expert_ids[t, j])
            kept[(t, j)] = capacity is None or used[e] < capacity
            used[e] += 1
    for t in range(num_tokens):
        for j in range(top_k):
            if kept[(t, j)]:
                e = int(expert_ids[t, j])
                out[t] += float(weights[t, j]) * expert_swiglu(x[t], w13[e], w2[e])
    return out
