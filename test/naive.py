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
    group_score: str = "top2_sum",
    route_norm_eps: float = 1e-20,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token routing in float64 (docs/design.md §4). Returns weights, ids, counts."""
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
                group_scores.append(members[0] if group_score == "max" else sum(members[:2]))
            keep = sorted(range(num_expert_groups), key=lambda g: -group_scores[g])
            keep = keep[:num_limited_groups]
            sel = [s if e // size in keep else -math.inf for e, s in enumerate(sel)]
        chosen = sorted(range(num_experts), key=lambda e: -sel[e])[:k]
        if score_func == "sigmoid_topk":  # the selection on the (biased) logits
            w = [1.0 / (1.0 + math.exp(-row[e])) for e in chosen]
        elif score_func == "softmax_topk":
            mx = max(row[e] for e in chosen)
            ex = [math.exp(row[e] - mx) for e in chosen]
            w = [v / sum(ex) for v in ex]
        else:
            w = [scores[e] for e in chosen]
        if route_norm:
            total = sum(w) + route_norm_eps
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


# Nemotron-H's routed experts as MoE arguments: ungated relu2 (with biases, which
# Nemotron-H has not, so that the ungated bias path is covered too)
NEMOTRON_H = dict(activation="relu2", experts_bias=True)

# GPT-OSS's block as MoE arguments (router with a bias, softmax over the top-k logits,
# swigluoai experts with biases on interleaved gate / up), clamped at 0.5 instead of 7 so
# that the clamps act at the tests' sizes
GPT_OSS = dict(
    score_func="softmax_topk",
    router_bias=True,
    activation="swigluoai",
    swiglu_limit=0.5,
    experts_bias=True,
    gate_up_interleaved=True,
)


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def expert_swiglu(
    x_row: Tensor,
    w13_e: Tensor,
    w2_e: Tensor,
    b13_e: Tensor | None = None,
    b2_e: Tensor | None = None,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float | None = None,
    interleaved: bool = False,
) -> Tensor:
    """One token through one expert, float64, one hidden unit at a time.

    ``swiglu``: silu(gate) * up; ``swigluoai`` (GPT-OSS): gate * sigmoid(alpha * gate) *
    (up + 1); with a ``limit`` first gate = min(gate, limit), up = clamp(up, -limit, limit). Gate unit f
    is row f of w13 and up unit f row F + f, or rows 2f and 2f + 1 when ``interleaved``;
    the biases add to those rows and to the output. ``relu2`` (Nemotron-H) is ungated:
    unit f is max(row f of w13 . x, 0) ** 2.
    """
    x64 = x_row.double()
    hidden = w2_e.shape[1]
    out = torch.zeros(w2_e.shape[0], dtype=torch.float64)
    if b2_e is not None:
        out += b2_e.double()
    for f in range(hidden):
        if activation == "relu2":
            up = float(w13_e[f].double() @ x64) + (0.0 if b13_e is None else float(b13_e[f]))
            out += max(up, 0.0) ** 2 * w2_e[:, f].double()
            continue
        gi, ui = (2 * f, 2 * f + 1) if interleaved else (f, hidden + f)
        gate = float(w13_e[gi].double() @ x64)
        up = float(w13_e[ui].double() @ x64)
        if b13_e is not None:
            gate, up = gate + float(b13_e[gi]), up + float(b13_e[ui])
        if limit is not None:
            gate, up = min(gate, limit), min(max(up, -limit), limit)
        if activation == "swiglu":
            act = gate * _sigmoid(gate) * up
        else:
            act = gate * _sigmoid(alpha * gate) * (up + 1.0)
        out += act * w2_e[:, f].double()
    return out


def expert_options(config: dict, shared: bool = False) -> dict:
    """:func:`expert_swiglu`'s activation keywords from ``MoE.config``, for the routed
    experts or (``shared``) the shared expert."""
    prefix = "shared_" if shared else ""
    return dict(
        activation=config.get(f"{prefix}activation", "swiglu"),
        alpha=config.get("swiglu_alpha", 1.702),
        limit=config.get(f"{prefix}swiglu_limit"),
        interleaved=False if shared else config.get("gate_up_interleaved", False),
    )


def moe(
    x: Tensor,
    weights: Tensor,
    expert_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    capacity: int | None = None,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
    options: dict | None = None,
) -> Tensor:
    """out[t] = sum_k w[t,k] * expert_{e[t,k]}(x[t]), dropping past capacity in token order
    (experts with biases ``b13`` / ``b2`` and :func:`expert_swiglu`'s ``options``)."""
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
                b13_e = None if b13 is None else b13[e]
                b2_e = None if b2 is None else b2[e]
                y = expert_swiglu(x[t], w13[e], w2[e], b13_e, b2_e, **(options or {}))
                out[t] += float(weights[t, j]) * y
    return out


def _capacity(config: dict, num_tokens: int) -> int | None:
    """ceil(capacity_factor * T * K / E) assignments per expert (docs/design.md §4), None: dropless."""
    factor = config.get("capacity_factor")
    if factor is None:
        return None
    return math.ceil(factor * num_tokens * config["top_k"] / config["num_experts"])


def _route_kwargs(config: dict) -> dict:
    return {
        key: config.get(key, default)
        for key, default in [
            ("score_func", "softmax"),
            ("num_expert_groups", None),
            ("num_limited_groups", None),
            ("route_norm", False),
            ("route_scale", 1.0),
            ("group_score", "top2_sum"),
            ("route_norm_eps", 1e-20),
        ]
    }


def moe_layer(x: Tensor, state: dict[str, Tensor], config: dict) -> tuple[Tensor, Tensor, int]:
    """The whole MoE layer, token by token, in float64.

    ``state`` holds the layer's parameters and buffers under ``torch_moe.nn.MoE``'s names
    (``moe.state_dict()``), ``config`` its constructor arguments (``moe.config``). Router
    logits one dot product at a time, routing by :func:`route`, experts by
    :func:`expert_swiglu` with assignments past the capacity dropped in token order
    (:func:`moe`), plus the shared expert, optionally scaled by ``sigmoid(x . gate)``.
    Returns ``(out [..., D], expert_ids [T, K], number of dropped assignments)``.
    """
    dim, num_experts, top_k = config["dim"], config["num_experts"], config["top_k"]
    x_TD = x.reshape(-1, dim).double()
    num_tokens = x_TD.shape[0]
    weight, bias = state["router.weight"].double(), state.get("router.bias")
    logits = torch.zeros(num_tokens, num_experts, dtype=torch.float64)
    for t in range(num_tokens):
        for e in range(num_experts):
            logits[t, e] = float(weight[e] @ x_TD[t]) + (0.0 if bias is None else float(bias[e]))
    weights, ids, _ = route(
        logits, top_k, expert_bias=state.get("router.expert_bias"), **_route_kwargs(config)
    )
    capacity = _capacity(config, num_tokens)
    out = moe(
        x_TD,
        weights,
        ids,
        state["experts.w13"],
        state["experts.w2"],
        capacity,
        state.get("experts.b13"),
        state.get("experts.b2"),
        expert_options(config),
    )
    _, _, dropped = dispatch(ids, num_experts, capacity=capacity)
    if "shared_experts.w13" in state:
        for t in range(num_tokens):
            shared = expert_swiglu(
                x_TD[t],
                state["shared_experts.w13"],
                state["shared_experts.w2"],
                **expert_options(config, shared=True),
            )
            if "shared_experts.gate" in state:
                g = float(state["shared_experts.gate"][0].double() @ x_TD[t])
                shared = shared / (1.0 + math.exp(-g))
            out[t] += shared
    return out.reshape(*x.shape[:-1], dim), ids, dropped


def moe_layer_autograd(
    x: Tensor, params: dict[str, Tensor], config: dict, lowp: torch.dtype | None = None
) -> Tensor:
    """:func:`moe_layer` in plain differentiable torch ops, one token at a time.

    For gradients: autograd through this loop is the reference for the layer's backward.
    The experts are chosen by :func:`route` on the detached logits (selection has no
    gradient); the weights are recomputed from the logits with torch ops. ``params`` as
    in :func:`moe_layer` (may require grad; all float64).

    ``lowp`` (e.g. bf16) emulates the routed experts under autocast: the expert's input and
    weights, its pre-activation, activation and output are rounded to ``lowp`` (casts, so
    that autograd rounds their gradients too), the weighted sum stays in float64 and the
    layer's output is rounded to ``lowp``; the router stays in float64.
    """
    dim, num_experts, top_k = config["dim"], config["num_experts"], config["top_k"]
    kw = _route_kwargs(config)
    x_TD = x.reshape(-1, dim)
    num_tokens = x_TD.shape[0]
    capacity = _capacity(config, num_tokens)
    used = [0] * num_experts
    rows = []
    for t in range(num_tokens):
        x_t = x_TD[t]
        logits = params["router.weight"] @ x_t
        if "router.bias" in params:
            logits = logits + params["router.bias"]
        _, ids, _ = route(
            logits.detach()[None], top_k, expert_bias=params.get("router.expert_bias"), **kw
        )
        chosen = ids[0].tolist()
        if kw["score_func"] == "softmax":
            w = torch.softmax(logits, 0)[chosen]
        elif kw["score_func"] in ("sigmoid", "sigmoid_topk"):
            w = torch.sigmoid(logits[chosen])
        else:
            w = torch.softmax(logits[chosen], 0)
        if kw["route_norm"]:
            w = w / (w.sum() + kw["route_norm_eps"])
        w = w * kw["route_scale"]
        y = torch.zeros_like(x_t)
        for j, e in enumerate(chosen):
            used[e] += 1
            if capacity is not None and used[e] > capacity:
                continue
            biases = [params[n][e] if n in params else None for n in ("experts.b13", "experts.b2")]
            y = y + w[j] * _swiglu_autograd(
                x_t, params["experts.w13"][e], params["experts.w2"][e], lowp, *biases, config
            )
        if "shared_experts.w13" in params:
            shared = _swiglu_autograd(
                x_t,
                params["shared_experts.w13"],
                params["shared_experts.w2"],
                shared_config=config,
            )
            if "shared_experts.gate" in params:
                shared = shared * torch.sigmoid(params["shared_experts.gate"][0] @ x_t)
            y = y + shared
        rows.append(y)
    out = torch.stack(rows) if rows else x_TD * 0
    if lowp is not None:
        out = out.to(lowp).double()
    return out.reshape(x.shape)


def _swiglu_autograd(
    x_row: Tensor,
    w13_e: Tensor,
    w2_e: Tensor,
    lowp: torch.dtype | None = None,
    b13_e: Tensor | None = None,
    b2_e: Tensor | None = None,
    config: dict | None = None,
    shared_config: dict | None = None,
) -> Tensor:
    def rnd(t: Tensor) -> Tensor:
        return t if lowp is None else t.to(lowp).to(torch.float64)

    if shared_config is not None:
        opt = expert_options(shared_config, shared=True)
    else:
        opt = expert_options(config or {})
    hidden = w2_e.shape[1]
    h = rnd(rnd(w13_e) @ rnd(x_row))
    if b13_e is not None:
        h = rnd(h + b13_e)
    if opt["activation"] == "relu2":  # ungated
        y = rnd(w2_e) @ rnd(torch.relu(h).square())
        return rnd(y if b2_e is None else y + b2_e)
    gate, up = (h[0::2], h[1::2]) if opt["interleaved"] else (h[:hidden], h[hidden:])
    if opt["limit"] is not None:
        gate = gate.clamp(max=opt["limit"])
        up = up.clamp(min=-opt["limit"], max=opt["limit"])
    if opt["activation"] == "swiglu":
        act = torch.nn.functional.silu(gate) * up
    else:
        act = gate * torch.sigmoid(opt["alpha"] * gate) * (up + 1)
    y = rnd(w2_e) @ rnd(act)
    return rnd(y if b2_e is None else y + b2_e)


# --------------------------------------------------------------------------------------
# quantized operands: dequantization and grouped GEMMs written from the format's definition
# (element (i, j) times the scale of its block, found by integer division), in float64


def scale_value(scale: Tensor) -> Tensor:
    """Scales as float64: uint8 E8M0 biased exponents are 2**(e - 127)."""
    if scale.dtype == torch.uint8:
        return torch.pow(2.0, scale.double() - 127)
    return scale.double()


def dequantize_blocks(q: Tensor, scale: Tensor, block_rows: int, block_cols: int) -> Tensor:
    """q [R, C] e4m3 with one scale per block_rows x block_cols block (-1: the whole dim)."""
    rows, cols = q.shape
    br = rows if block_rows == -1 else block_rows
    bc = cols if block_cols == -1 else block_cols
    row_block = torch.arange(rows) // max(br, 1)  # the block of every row and column
    col_block = torch.arange(cols) // max(bc, 1)
    return q.double() * scale_value(scale)[row_block][:, col_block]


def jagged_scale_rows(offs: Tensor, num_rows: int, block: int) -> list[int]:
    """The scale row of every row of a jagged (per-group, blocks of ``block`` rows along M)
    quantization: groups in order, each group's blocks numbered on from the previous
    group's; rows past the last group form one more group."""
    ends = [int(e) for e in offs] + [num_rows]
    out, start, first = [], 0, 0
    for end in ends:
        size = end - start
        for r in range(size):
            out.append(first + (0 if block == -1 else r // block))
        if size:
            first += 1 if block == -1 else -(-size // block)
        start = end
    return out


def dequantize_jagged(q: Tensor, scale: Tensor, offs: Tensor, block: int) -> Tensor:
    """q [M, C] with jagged per-column scales [NB, C], or one scale [1, 1]."""
    s = scale_value(scale)
    if list(scale.shape) == [1, 1]:
        return q.double() * float(s[0, 0])
    rows = jagged_scale_rows(offs, q.shape[0], block)
    if not rows:
        return q.double()
    return torch.stack([q[r].double() * s[rows[r]] for r in range(q.shape[0])])


def grouped_mm64(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """out[rows of g] = a[rows of g] @ b[g] in float64; rows past the last group zero."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    start = 0
    for g, end in enumerate(int(e) for e in offs):
        out[start:end] = a[start:end].double() @ b[g].double()
        start = end
    return out


def grouped_mm_wgrad64(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """out[g] = a[rows of g]^T @ b[rows of g] in float64."""
    out = torch.zeros(offs.shape[0], a.shape[1], b.shape[1], dtype=torch.float64)
    start = 0
    for g, end in enumerate(int(e) for e in offs):
        out[g] = a[start:end].double().t() @ b[start:end].double()
        start = end
    return out


# --------------------------------------------------------------------------------------
# low-precision emulation: float64 math, rounded to the working dtype at the points an
# op's contract allows (for tolerances.assert_rounding_level)


def _rnd(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.to(dtype).double()


def swiglu_rounded(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    dtype: torch.dtype,
    grad_y: Tensor | None = None,
    row_weights: Tensor | None = None,
) -> dict[str, Tensor]:
    """Grouped SwiGLU, group by group, in float64 with the pre-activation h, the activation
    a and every result rounded to ``dtype``; with ``grad_y`` also the backward (dA, the
    pre-activation gradient dH and the results rounded likewise). Returns float64
    ``{"y", "x", "w13", "w2"[, "row_weights"]}`` (gradients under the inputs' names)."""
    hidden = w13.shape[1] // 2
    x64, w13_64, w2_64 = x.double(), w13.double(), w2.double()
    rw = None if row_weights is None else row_weights.double()
    out = {"y": torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)}
    if grad_y is not None:
        out["x"] = torch.zeros_like(x64)
        out["w13"] = torch.zeros_like(w13_64)
        out["w2"] = torch.zeros_like(w2_64)
        if rw is not None:
            out["row_weights"] = torch.zeros_like(rw)
    start = 0
    for e, end in enumerate(int(v) for v in offs):
        if end == start:
            continue
        xs = x64[start:end]
        h = _rnd(xs @ w13_64[e].t(), dtype)
        g, up = h[:, :hidden], h[:, hidden:]
        s = torch.sigmoid(g)
        act = g * s * up
        r = None if rw is None else rw[start:end].unsqueeze(1)
        a = _rnd(act if r is None else act * r, dtype)
        out["y"][start:end] = _rnd(a @ w2_64[e].t(), dtype)
        if grad_y is None:
            start = end
            continue
        gy = grad_y[start:end].double()
        da = _rnd(gy @ w2_64[e], dtype)
        out["w2"][e] = _rnd(gy.t() @ a, dtype)
        if r is not None:
            out["row_weights"][start:end] = _rnd((da * act).sum(1), row_weights.dtype)
            da = da * r
        dgate = da * up * s * (1 + g * (1 - s))
        dh = _rnd(torch.cat([dgate, da * g * s], 1), dtype)
        out["x"][start:end] = _rnd(dh @ w13_64[e], dtype)
        out["w13"][e] = _rnd(dh.t() @ xs, dtype)
        start = end
    return out


def pipeline_autograd(
    logits: Tensor,
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    k: int,
    capacity: int | None = None,
    **route_kw,
) -> Tensor:
    """route -> dispatch with capacity -> SwiGLU experts -> weighted combine, one token at
    a time in differentiable torch ops (float64). The experts are chosen by :func:`route` on
    the detached logits; assignments past ``capacity`` (per expert, in token order) are
    dropped; the weights are recomputed from the logits so that gradients reach them."""
    score_func = route_kw.get("score_func", "softmax")
    _, ids, _ = route(logits.detach(), k, **route_kw)
    used = [0] * logits.shape[1]
    rows = []
    for t in range(x.shape[0]):
        chosen = ids[t].tolist()
        lg = logits[t]
        if score_func == "softmax":
            w = torch.softmax(lg, 0)[chosen]
        elif score_func in ("sigmoid", "sigmoid_topk"):
            w = torch.sigmoid(lg[chosen])
        else:
            w = torch.softmax(lg[chosen], 0)
        if route_kw.get("route_norm", False):
            w = w / (w.sum() + route_kw.get("route_norm_eps", 1e-20))
        w = w * route_kw.get("route_scale", 1.0)
        y = x[t] * 0
        for j, e in enumerate(chosen):
            used[e] += 1
            if capacity is not None and used[e] > capacity:
                continue
            y = y + w[j] * _swiglu_autograd(x[t], w13[e], w2[e])
        rows.append(y)
    return torch.stack(rows) if rows else x * 0


# --------------------------------------------------------------------------------------
# FP8 / MX quantization from the recipe's definition (for the quantized GEMM ops): every
# element's block found by integer division, the block's amax by a scatter, then the
# format's rule; returns the dequantized values in float64


E4M3_MAX = 448.0


def block_ids(rows: int, cols: int, block_rows: int, block_cols: int) -> Tensor:
    """[rows, cols] id of every element's (block_rows x block_cols) block (-1: whole dim)."""
    br = rows if block_rows == -1 else block_rows
    bc = cols if block_cols == -1 else block_cols
    col_blocks = -(-cols // max(bc, 1))
    row_block = torch.arange(rows) // max(br, 1)
    col_block = torch.arange(cols) // max(bc, 1)
    return row_block[:, None] * col_blocks + col_block[None, :]


def jagged_block_ids(offs: Tensor, rows: int, cols: int, block: int) -> Tensor:
    """[rows, cols] block ids of a wgrad operand: ``block`` rows (-1: the whole group) of
    one column, never crossing a group end (rows past the last group: one more group)."""
    scale_row = torch.tensor(jagged_scale_rows(offs, rows, block), dtype=torch.int64)
    return scale_row[:, None] * cols + torch.arange(cols)[None, :]


def fake_quantize(x: Tensor, ids: Tensor, fmt: str, scale_rule: str = "floor") -> Tensor:
    """Quantize x [R, C] to e4m3 with one scale per block (``ids``), dequantize, float64.

    fp8: scale = amax / 448 in fp32 (1 for an all-zero block), q = e4m3(x / scale) saturated
    at +-448. mx: scale = 2^e with e = floor(log2 amax) - 8 ("floor") or ceil(log2(amax /
    448)) ("rceil"), clamped to [-127, 127] (-127 for amax = 0), q = e4m3(x / scale)
    saturated."""
    xf = x.float()
    if x.numel() == 0:
        return xf.double()
    nb = int(ids.max()) + 1
    amax = torch.zeros(nb).scatter_reduce(
        0, ids.flatten(), xf.abs().flatten(), "amax", include_self=True
    )
    if fmt == "fp8":
        scale = amax / torch.tensor(E4M3_MAX)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    else:
        a = amax.double()
        _, ex = torch.frexp(a)  # a = m 2^ex, m in [0.5, 1): floor(log2 a) = ex - 1
        e = ex.long() - 1 - 8
        if scale_rule == "rceil":
            e = e + (a / torch.pow(2.0, e.double()) > E4M3_MAX).long()
        e = torch.where(a > 0, e, torch.full_like(e, -127)).clamp(-127, 127)
        scale = torch.pow(2.0, e.double()).float()
    s = scale[ids]
    q = (xf / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.double() * s.double()
