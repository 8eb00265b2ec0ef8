"""Public MoE ops: routing, local dispatch/combine and grouped GEMMs.

Legend: T tokens, D model dim, E experts, K top-k, M rows of the permuted buffer.

A dropless MoE layer is::

    logits = router_logits(x, router_weight)
    weights, expert_ids, counts = topk_route(logits, k)
    x_perm, perm = permute(x, expert_ids, num_experts)
    y_perm = torch_moe.nn.functional.grouped_swiglu(x_perm, w13, w2, perm.offs)
    out = unpermute(y_perm, weights, perm)

Every function here is a thin wrapper over a ``torch.ops.torch_moe`` custom op, so it
works under autograd, ``torch.compile`` and FakeTensor.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from torch_moe._ops import grouped_mm as _gmm
from torch_moe._ops import permute as _perm
from torch_moe._ops import router as _router
from torch_moe._ops import routing as _routing

__all__ = [
    "MoEPermutation",
    "grouped_mm",
    "permute",
    "permute_indices",
    "router_logits",
    "topk_route",
    "unpermute",
]


def router_logits(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    r"""A linear router's logits in fp32: ``x @ weight^T (+ bias)``.

    Args:
        x: [T, D] tokens (any float dtype).
        weight: [E, D] router weight (any float dtype).
        bias: optional [E] router bias.

    Returns:
        logits [T, E] in fp32 (fp64 for fp64 ``x``): the inputs converted to that dtype
        and the products summed in it, whatever the inputs' dtypes (a bf16 rounding of
        the logits would reorder near ties before :func:`topk_route`). For fp32 inputs
        this is ``F.linear(x, weight, bias)``; for bf16 / fp16 inputs on the CPU native
        kernels sum the same exact products in another order (deterministic, and the
        same for any thread count). Differentiable in all three; the gradients are
        rounded to the inputs' dtypes.
    """
    return _router.router_logits(x, weight, bias)


def topk_route(
    logits: Tensor,
    k: int,
    *,
    score_func: str = "softmax",
    expert_bias: Tensor | None = None,
    num_expert_groups: int | None = None,
    num_limited_groups: int | None = None,
    route_norm: bool = False,
    route_scale: float = 1.0,
    group_score: str = "top2_sum",
    route_norm_eps: float = 1e-20,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Choose K experts per token.

    Args:
        logits: [T, E] router logits (any float dtype; the math runs in fp32).
        k: experts per token, ``1 <= k <= E``.
        score_func: ``"softmax"`` (softmax over E, then top-k: Mixtral, Qwen-MoE),
            ``"sigmoid"`` (DeepSeek-V3), ``"softmax_topk"`` (top-k on the logits,
            softmax over the K chosen: GPT-OSS) or ``"sigmoid_topk"`` (top-k on the
            logits, the sigmoid of the K chosen: Kolibri, whose selection bias is added
            to the logits).
        expert_bias: optional [E] bias added to the selection scores only: it changes
            which experts are chosen, never the weights (aux-loss-free balancing).
        num_expert_groups, num_limited_groups: group-limited routing: E experts form
            ``num_expert_groups`` contiguous groups; only the best ``num_limited_groups``
            groups are eligible.
        group_score: how a group is scored: ``"top2_sum"`` (the sum of its top-2
            selection scores, DeepSeek-V3) or ``"max"`` (its best one, DeepSeek-V2's
            ``group_limited_greedy``).
        route_norm: divide the K weights of a token by their sum + ``route_norm_eps``.
        route_scale: multiply the weights by this factor (after ``route_norm``).
        route_norm_eps: added to the sum ``route_norm`` divides by (1e-20 by default, as
            DeepSeek-V3; LFM2 adds 1e-6).

    Returns:
        ``(weights, expert_ids, tokens_per_expert)``: weights [T, K] fp32 (fp64 for fp64
        logits), expert_ids [T, K] int64 sorted by descending selection score,
        tokens_per_expert [E] int64. Differentiable in ``logits`` through ``weights``.

    Logits may contain ``-inf`` (an expert that cannot be chosen) but not NaN or
    ``+inf``, and each row needs one finite value; otherwise a RuntimeError is raised
    (on CUDA asynchronously, as a device-side assert, so that routing never syncs).
    """
    return _routing.topk_route(
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


class MoEPermutation(NamedTuple):
    """How assignments were laid out by :func:`permute_indices`.

    Attributes:
        row_to_slot: [M] int64, the assignment ``t*K + k`` held by each permuted row,
            -1 for padding rows.
        slot_to_row: [T, K] int64, the permuted row of each assignment, -1 if dropped.
        offs: [E] int32 group ends for :func:`grouped_mm` (expert e owns rows
            ``offs[e-1]:offs[e]``, padding included).
        num_dropped: [] int64, assignments dropped by the capacity limit.
    """

    row_to_slot: Tensor
    slot_to_row: Tensor
    offs: Tensor
    num_dropped: Tensor


def permute_indices(
    expert_ids: Tensor, num_experts: int, *, align: int = 1, capacity: int | None = None
) -> MoEPermutation:
    r"""Sort the T*K assignments by expert (stable: token order inside an expert).

    Args:
        expert_ids: [T, K] int32/int64 expert of each assignment.
        num_experts: E.
        align: pad each expert's rows with zero rows to a multiple of ``align``.
        capacity: keep at most ``capacity`` assignments per expert, the first ones in
            token order; the rest are dropped and counted in ``num_dropped``.

    The number of rows M is a static bound (T*K without padding or capacity,
    T*K + E*(align-1) with padding, at most E*round_up(capacity, align) with a
    capacity), so this never synchronizes with the device. Rows at or past
    ``offs[-1]`` are padding.
    """
    return MoEPermutation(*_perm.permute_indices(expert_ids, num_experts, align, capacity))


def permute(
    x: Tensor,
    expert_ids: Tensor,
    num_experts: int,
    *,
    align: int = 1,
    capacity: int | None = None,
) -> tuple[Tensor, MoEPermutation]:
    r"""Dispatch tokens to expert-sorted rows: ``x_perm[r] = x[token of row r]``.

    Args:
        x: [T, D] tokens.
        expert_ids, num_experts, align, capacity: as in :func:`permute_indices`.

    Returns:
        ``(x_perm [M, D], perm)``; padding rows of ``x_perm`` are zero. Differentiable
        in ``x`` (the backward sums each token's K row gradients in fp32). No host sync.
    """
    perm = permute_indices(expert_ids, num_experts, align=align, capacity=capacity)
    return _perm.permute(x, perm.row_to_slot, perm.slot_to_row), perm


def unpermute(y: Tensor, weights: Tensor | None, perm: MoEPermutation) -> Tensor:
    r"""Combine expert outputs: ``out[t] = sum_k weights[t, k] * y[row of (t, k)]``.

    The K terms are accumulated in fp32 in the order k = 0..K-1 (deterministic, no
    atomics); dropped assignments contribute 0; padding rows are never read.
    ``weights=None`` means all ones. Differentiable in ``y`` and ``weights``. Returns
    [T, D] in ``y``'s dtype.
    """
    return _perm.unpermute(y, perm.slot_to_row, perm.row_to_slot, weights)


def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    r"""Grouped matrix multiply: ``out[rows of g] = x[rows of g] @ w[g]``.

    Args:
        x: [M, K] rows sorted by group.
        w: [E, K, N] (any strides, e.g. ``w_ENK.transpose(-2, -1)``).
        offs: [E] int32 group ENDS (group g owns rows ``offs[g-1]:offs[g]``),
            non-decreasing with ``offs[-1] <= M``; validated (on CPU the error shows
            the values; on CUDA it is an asynchronous device assert).

    Returns [M, N] in x's dtype; rows at or past ``offs[-1]`` are zero. fp16, bf16,
    fp32 and fp64 (CPU), any K and N, empty groups. Differentiable in x (dX rows past
    ``offs[-1]`` are zero) and w (a 2D x 2D grouped GEMM per group). Computes in the
    operands' dtype under autocast too (cast them first for autocast's dtype), the same in
    eager and compiled code.
    """
    return _gmm.grouped_mm(x, w, offs)
