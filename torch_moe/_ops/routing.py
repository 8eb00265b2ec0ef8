"""Top-k token routing: ``torch_moe::topk_route`` and its backward.

Legend: T tokens, E experts, K top-k, G expert groups, L limited (kept) groups.

Semantics (docs/design.md §4), all math in fp32 (fp64 when the logits are fp64):

* ``score_func="softmax"``: scores = softmax(logits) over all E experts, then top-k
  (Mixtral, Qwen2/3-MoE).
* ``score_func="sigmoid"``: scores = sigmoid(logits), then top-k (DeepSeek-V3).
* ``score_func="softmax_topk"``: top-k on the logits, then softmax over the K chosen
  logits (GPT-OSS).
* ``score_func="sigmoid_topk"``: top-k on the logits, then the sigmoid of the K chosen
  logits (Kolibri). Without a selection bias it chooses what ``"sigmoid"`` chooses
  (sigmoid is monotone) with the same weights; with one, the bias is added to the logits
  rather than to the sigmoid scores.
* ``expert_bias`` [E] is added to the selection scores only: it changes which experts
  are chosen, never the weights (aux-loss-free balancing, DeepSeek-V3).
* Group-limited routing: experts form G contiguous groups of E/G; a group's score is
  the sum of its top-2 selection scores (``group_score="top2_sum"``, DeepSeek-V3; top-1
  when a group holds one expert) or its best selection score (``"max"``, DeepSeek-V2's
  ``group_limited_greedy``); the best L groups are kept and every other expert is masked
  to -inf before the top-k.
* weights = unbiased scores of the chosen experts; ``route_norm`` divides them by
  their sum + ``route_norm_eps`` (1e-20 by default, as DeepSeek-V3; LFM2 adds 1e-6);
  finally they are multiplied by ``route_scale``.

NB: expert ids come from ``torch.topk`` (sorted, descending), so ties break exactly
as in the HF transformers / DeepSeek reference implementations that also call topk.

NaN/Inf rule: logits may hold ``-inf`` (an expert that may not be chosen) but no NaN
and no ``+inf``, and every row needs at least one finite logit; ``expert_bias`` must be
finite; otherwise the op raises a RuntimeError. The check is ``torch._assert_async``:
immediate on CPU, without a host sync on CUDA (where it surfaces as a device-side
assert). A row with fewer than ``k`` experts to choose from (a finite logit and, with
group-limited routing, in a kept group) takes its last picks among the others, tied at
``-inf``, in ``torch.topk``'s order (not specified), each with its own weight (an expert
of a dropped group its full score, as HF's DeepSeek-V3 code gives it, which masks to 0
instead): a router that needs defined results gives every row ``k`` eligible experts.

Gradients flow to ``logits`` through the weights only (ids and counts are integer
outputs); the backward is analytic (``torch_moe::topk_route_backward``), so it needs
only the logits and the chosen ids.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torch_moe._ops._dtypes import acc_dtype
from torch_moe._ops._eager import direct_calls

__all__ = ["GROUP_SCORES", "SCORE_FUNCS", "SIGMOID_SCORES", "topk_route", "topk_route_reference"]

SCORE_FUNCS = ("softmax", "sigmoid", "softmax_topk", "sigmoid_topk")
SIGMOID_SCORES = ("sigmoid", "sigmoid_topk")  # the weights are the chosen logits' sigmoids
GROUP_SCORES = ("top2_sum", "max")


def check_logits(where: str, logits: Tensor) -> None:
    """Router logits [T, E] of a floating dtype (``topk_route`` and the layer's losses)."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"{where}: expected logits to be a 2D floating-point tensor [T, E], "
            f"got {logits.dim()}D {logits.dtype}"
        )


def _check_inputs(
    logits: Tensor,
    k: int,
    score_func: str,
    expert_bias: Tensor | None,
    num_expert_groups: int | None,
    num_limited_groups: int | None,
    route_scale: float,
    group_score: str,
    route_norm_eps: float,
) -> None:
    """Shape/dtype/config checks shared by the real and the fake kernel."""
    check_logits("topk_route", logits)
    num_experts = logits.shape[1]
    if num_experts < 1:
        raise ValueError(
            f"topk_route: logits must have at least one expert column, got E={num_experts}"
        )
    if isinstance(k, bool) or not isinstance(k, (int, torch.SymInt)):
        raise ValueError(f"topk_route: k must be an integer, got {k!r}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"topk_route: k ({k}) must be in [1, num_experts={num_experts}]")
    if score_func not in SCORE_FUNCS:
        raise ValueError(
            f"topk_route: unknown score_func {score_func!r}; expected one of {SCORE_FUNCS}"
        )
    if not math.isfinite(route_scale):
        raise ValueError(f"topk_route: route_scale must be finite, got {route_scale}")
    if not (math.isfinite(route_norm_eps) and route_norm_eps >= 0):
        raise ValueError(
            f"topk_route: route_norm_eps must be finite and >= 0, got {route_norm_eps}"
        )
    if group_score not in GROUP_SCORES:
        raise ValueError(
            f"topk_route: unknown group_score {group_score!r}; expected one of {GROUP_SCORES}"
        )
    if expert_bias is not None:
        if expert_bias.shape != (num_experts,) or not expert_bias.is_floating_point():
            raise ValueError(
                f"topk_route: expected expert_bias to be a floating-point tensor of shape "
                f"[{num_experts}], got {list(expert_bias.shape)} {expert_bias.dtype}"
            )
        if expert_bias.device != logits.device:
            raise ValueError(
                f"topk_route: expert_bias is on {expert_bias.device} but logits are on {logits.device}"
            )
    if num_expert_groups is None:
        if num_limited_groups is not None:
            raise ValueError(
                f"topk_route: num_limited_groups ({num_limited_groups}) needs num_expert_groups"
            )
        return
    if num_expert_groups < 1 or num_experts % num_expert_groups != 0:
        raise ValueError(
            f"topk_route: num_experts ({num_experts}) must be divisible by "
            f"num_expert_groups ({num_expert_groups})"
        )
    if num_limited_groups is None or not 1 <= num_limited_groups <= num_expert_groups:
        raise ValueError(
            f"topk_route: num_limited_groups ({num_limited_groups}) must be in "
            f"[1, num_expert_groups={num_expert_groups}]"
        )
    left = num_limited_groups * (num_experts // num_expert_groups)
    if left < k:
        raise ValueError(
            f"topk_route: num_limited_groups ({num_limited_groups}) x experts per group "
            f"({num_experts // num_expert_groups}) leaves {left} experts, fewer than k ({k})"
        )


def _check_values(logits: Tensor, expert_bias: Tensor | None) -> None:
    # a row's max is finite exactly when the row holds no NaN (amax propagates it), no
    # +inf and some finite value: one reduction, not three passes over [T, E]
    ok = torch.isfinite(logits.amax(dim=-1)).all()
    torch._assert_async(
        ok,
        "topk_route: logits contain NaN or +inf, or a row with no finite logit "
        "(-inf is allowed to exclude an expert)",
    )
    if expert_bias is not None:  # a NaN or inf bias would pin (or bar) its expert everywhere
        torch._assert_async(
            torch.isfinite(expert_bias).all(), "topk_route: expert_bias must be finite"
        )


def _chosen_scores(
    lf: Tensor, expert_ids: Tensor, score_func: str, probs: Tensor | None = None
) -> Tensor:
    """Unbiased scores [T, K] of the chosen experts (before norm and scale); ``probs``:
    ``softmax(lf)`` where the caller has it (the softmax of E columns costs more than the
    rest of the routing at E = 8 on CPU: ATen's last-dimension kernel, 100-200 us at
    T = 2048)."""
    if score_func == "softmax":
        return (torch.softmax(lf, dim=-1) if probs is None else probs).gather(1, expert_ids)
    if score_func in SIGMOID_SCORES:
        return torch.sigmoid(lf.gather(1, expert_ids))
    return torch.softmax(lf.gather(1, expert_ids), dim=-1)


def topk_route_reference(
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
    """Plain-PyTorch routing: the oracle and the kernel on every device."""
    _check_inputs(
        logits,
        k,
        score_func,
        expert_bias,
        num_expert_groups,
        num_limited_groups,
        route_scale,
        group_score,
        route_norm_eps,
    )
    _check_values(logits, expert_bias)
    num_tokens, num_experts = logits.shape
    lf = logits.to(acc_dtype(logits.dtype))
    probs_TE: Tensor | None = None
    if score_func == "softmax":
        sel_TE = probs_TE = torch.softmax(lf, dim=-1)
    elif score_func == "sigmoid":
        sel_TE = torch.sigmoid(lf)
    else:
        sel_TE = lf
    if expert_bias is not None:
        sel_TE = sel_TE + expert_bias.to(sel_TE.dtype)
    if num_expert_groups is not None and num_limited_groups is not None:
        per_group = num_experts // num_expert_groups
        sel_TGS = sel_TE.view(num_tokens, num_expert_groups, per_group)
        if group_score == "max":
            group_score_TG = sel_TGS.amax(dim=-1)
        else:
            group_score_TG = sel_TGS.topk(min(2, per_group), dim=-1).values.sum(-1)
        keep_TL = group_score_TG.topk(num_limited_groups, dim=-1).indices
        drop_TG = torch.ones_like(group_score_TG, dtype=torch.bool).scatter(1, keep_TL, False)
        sel_TE = sel_TGS.masked_fill(drop_TG.unsqueeze(-1), -math.inf).view(num_tokens, num_experts)
    expert_ids_TK = sel_TE.topk(k, dim=-1).indices
    weights_TK = _chosen_scores(lf, expert_ids_TK, score_func, probs_TE)
    if route_norm:
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + route_norm_eps)
    if route_scale != 1.0:
        weights_TK = weights_TK * route_scale
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=logits.device)
    counts_E.scatter_add_(0, expert_ids_TK.flatten(), torch.ones_like(expert_ids_TK.flatten()))
    return weights_TK, expert_ids_TK, counts_E


@torch.library.custom_op("torch_moe::topk_route", mutates_args=())
def topk_route(
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
    weights, ids, counts = topk_route_reference(
        logits,
        k,
        score_func,
        expert_bias,
        num_expert_groups,
        num_limited_groups,
        route_norm,
        route_scale,
        group_score,
        route_norm_eps,
    )
    return weights, ids, counts


@topk_route.register_fake
def _(
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
    _check_inputs(
        logits,
        k,
        score_func,
        expert_bias,
        num_expert_groups,
        num_limited_groups,
        route_scale,
        group_score,
        route_norm_eps,
    )
    num_tokens, num_experts = logits.shape
    weights = logits.new_empty((num_tokens, k), dtype=acc_dtype(logits.dtype))
    ids = logits.new_empty((num_tokens, k), dtype=torch.int64)
    counts = logits.new_empty((num_experts,), dtype=torch.int64)
    return weights, ids, counts


def _topk_route_backward_impl(
    grad_weights: Tensor,
    logits: Tensor,
    expert_ids: Tensor,
    score_func: str,
    route_norm: bool,
    route_scale: float,
    route_norm_eps: float = 1e-20,
) -> Tensor:
    """d(weights)/d(logits)^T applied to ``grad_weights`` [T, K] -> [T, E]."""
    lf = logits.to(acc_dtype(logits.dtype))
    g_TK = grad_weights.to(lf.dtype) * route_scale
    probs_TE = torch.softmax(lf, dim=-1) if score_func == "softmax" else None
    chosen_TK = _chosen_scores(lf, expert_ids, score_func, probs_TE)
    if route_norm:
        # w_i = s_i / D with D = sum(s) + eps:  dL/ds_j = g_j / D - sum_i(g_i s_i) / D^2
        denom = chosen_TK.sum(-1, keepdim=True) + route_norm_eps
        g_TK = (g_TK - (g_TK * chosen_TK).sum(-1, keepdim=True) / denom) / denom
    grad_TE = torch.zeros_like(lf)
    if probs_TE is not None:  # softmax
        grad_TE.scatter_(1, expert_ids, g_TK)  # ids are distinct within a row
        grad_TE = probs_TE * (grad_TE - (grad_TE * probs_TE).sum(-1, keepdim=True))
    elif score_func in SIGMOID_SCORES:
        grad_TE.scatter_(1, expert_ids, g_TK * chosen_TK * (1 - chosen_TK))
    else:
        g_TK = chosen_TK * (g_TK - (g_TK * chosen_TK).sum(-1, keepdim=True))
        grad_TE.scatter_(1, expert_ids, g_TK)
    return grad_TE.to(logits.dtype)


# the op's schema is the function's: one signature for the op and its direct calls
topk_route_backward = torch.library.custom_op(
    "torch_moe::topk_route_backward", _topk_route_backward_impl, mutates_args=()
)


@topk_route_backward.register_fake
def _(
    grad_weights: Tensor,
    logits: Tensor,
    expert_ids: Tensor,
    score_func: str,
    route_norm: bool,
    route_scale: float,
    route_norm_eps: float = 1e-20,
) -> Tensor:
    if grad_weights.shape != expert_ids.shape or expert_ids.shape[0] != logits.shape[0]:
        raise ValueError(
            "topk_route_backward: grad_weights, expert_ids and logits disagree: "
            f"{list(grad_weights.shape)}, {list(expert_ids.shape)}, {list(logits.shape)}"
        )
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    logits, _k, score_func, _bias, _g, _l, route_norm, route_scale, _gs, norm_eps = inputs
    _w, ids, _counts = output
    ctx.save_for_backward(logits, ids)
    ctx.cfg = (score_func, route_norm, route_scale, norm_eps)


def _backward(ctx, grad_weights, _grad_ids, _grad_counts):  # type: ignore[no-untyped-def]
    logits, ids = ctx.saved_tensors
    grad_logits = None
    if ctx.needs_input_grad[0]:
        if grad_weights is None:
            grad_logits = torch.zeros_like(logits)
        else:
            grad_logits = topk_route_backward(grad_weights.contiguous(), logits, ids, *ctx.cfg)
    return grad_logits, None, None, None, None, None, None, None, None, None


topk_route.register_autograd(_backward, setup_context=_setup_context)

# eager calls on plain CPU tensors skip the ops' Python layers (torch_moe/_ops/_eager.py):
# routing is one call per layer, but at a few tokens its layers cost more than its math
topk_route = direct_calls(topk_route, topk_route_reference, _setup_context, _backward)
topk_route_backward = direct_calls(topk_route_backward, _topk_route_backward_impl)


# --------------------------------------------------------------------------------------
# the layer's load statistics


def _add_load_counts_impl(
    tokens_per_expert: Tensor, dropped: Tensor, counts: Tensor, num_dropped: Tensor
) -> None:
    if torch._C._current_graph_task_id() != -1:  # a backward: checkpointing recomputes
        return
    with torch.no_grad():
        tokens_per_expert.add_(counts)
        dropped.add_(num_dropped)


@torch.library.custom_op(
    "torch_moe::add_load_counts", mutates_args=("tokens_per_expert", "dropped")
)
def add_load_counts(
    tokens_per_expert: Tensor, dropped: Tensor, counts: Tensor, num_dropped: Tensor
) -> None:
    """Adds a forward's routed assignments per expert (``counts`` [E]) and its dropped
    assignments (``num_dropped`` []) to the running statistics ``tokens_per_expert`` and
    ``dropped`` in place, except inside a backward pass, where activation checkpointing
    recomputes the forward (the same routing, counted once already). An op rather than a
    Python check in the layer so that compiled code asks at run time: a graph traced with
    the update (``torch.compile`` of the layer, then checkpointed) would otherwise repeat
    it in the recomputation, and a graph traced without it would never count."""
    _add_load_counts_impl(tokens_per_expert, dropped, counts, num_dropped)


@add_load_counts.register_fake
def _(tokens_per_expert: Tensor, dropped: Tensor, counts: Tensor, num_dropped: Tensor) -> None:
    return None


# (eager calls skip the op's layers where nothing traces them: _eager.py)
add_load_counts = direct_calls(add_load_counts, _add_load_counts_impl)
