"""The MoE layer: ``TopKRouter`` -> permute -> ``GroupedExperts`` -> unpermute (+ ``SharedExperts``).

Legend: T tokens, D dim, F expert hidden dim, Fs shared hidden dim, E experts, K top-k,
M permuted rows (T*K when dropless).

Parameter names and shapes are a public contract, stacked like HF transformers 5.x so
that state dicts interoperate (see ``hf_state_dict_to_moe``):

=============================  ============  =========================================
torch_moe                      shape         HF transformers 5.x
=============================  ============  =========================================
``router.weight``              [E, D]        ``gate.weight``
``router.bias``                [E]           (router_bias=True only)
``router.expert_bias``         [E] buffer    ``gate.e_score_correction_bias`` (DS-V3)
``experts.w13``                [E, 2F, D]    ``experts.gate_up_proj`` (gate rows first)
``experts.w2``                 [E, D, F]     ``experts.down_proj``
``experts.b13``                [E, 2F]       ``experts.gate_up_proj_bias`` (GPT-OSS)
``experts.b2``                 [E, D]        ``experts.down_proj_bias`` (GPT-OSS)
``shared_experts.w13``         [2Fs, D]      cat(``shared_expert(s).gate_proj.weight``,
                                             ``shared_expert(s).up_proj.weight``)
``shared_experts.w2``          [D, Fs]       ``shared_expert(s).down_proj.weight``
``shared_experts.gate``        [1, D]        ``shared_expert_gate.weight`` (Qwen2-MoE)
=============================  ============  =========================================

What the forward saves for the backward (per token, expert dtype b bytes, the router in
fp32): the layer input [D] (b bytes each, for the router and shared-expert weight
gradients, and which the experts gather their rows from again), the router logits
[E] (fp32) and ids [K], and, per routed copy, the gate/up pre-activation [2F], one
fp32 routing weight and the two int64 dispatch maps (row_to_slot, slot_to_row):
``D*b + E*4 + K*(8 + 4 + 16 + 2F*b)`` bytes, plus E*4 bytes of group offsets per call
(and one more int64 index per routed copy with a capacity). The permute's gather is
fused into the expert op (``grouped_swiglu``'s permutation form: the permuted input [K,
D] is neither materialized nor saved) and the combine weights are folded into it
(``row_weights``), so neither the expert outputs [K, D] nor the activation [K, F] are
kept; a torchtitan-style layer keeps the gathered input and both GEMM outputs, and HF's
per-expert loop more (see benchmarks/bench_moe_layer.py). Under expert parallelism the
permuted rows are what the exchange sends, and the experts save the received rows
[D] per routed copy as well.

Load balancing (all optional, all in fp32):

* ``aux_loss="switch"``: Switch/GShard ``E * sum_e f_e * P_e`` (f: fraction of routed
  assignments, P: mean router probability), ``aux_loss="sequence"``: DeepSeek-V3's
  sequence-wise version (per sequence of a [B, S, D] input, then averaged over B);
  ``z_loss_coeff``: router z-loss ``mean(logsumexp(logits)^2)``. Their gradients
  (times the coefficient and ``aux_loss_scale``) are injected in the backward through
  the layer output, so nothing has to be added to the training loss: that works
  unchanged with activation checkpointing (the recomputed forward re-attaches them)
  and with gradient accumulation (set ``aux_loss_scale`` to the factor the main loss
  is scaled by, e.g. 1/num_microbatches). Detached values for logging are in
  ``last_losses`` after each forward.
* Aux-loss-free balancing (``expert_bias=True``): call ``update_expert_bias(rate)``
  after ``optimizer.step()``; it moves the bias by ``rate * sign(mean_load - load)``
  (mean-centred), loads summed over the process group passed as ``group`` (the ranks
  whose tokens the layer routes; none by default).
* ``tokens_per_expert`` / ``dropped_assignments``: routed assignments per expert
  (before any capacity drop) and the assignments the capacity dropped, accumulated since the last
  ``update_expert_bias`` / ``reset_load_stats`` (not counted again when activation
  checkpointing recomputes a forward); ``load_stats()`` summarizes it for logging.

Low precision (``precision=``, see :mod:`torch_moe.quantization`): ``"bf16"`` (the default)
runs the experts in the parameter or autocast dtype through ``grouped_swiglu``. A recipe
runs them as ``scaled_grouped_mm(x, w13^T)`` -> SwiGLU (fp32 math, the routing weight
folded into the activation, as ``grouped_swiglu`` does) -> ``scaled_grouped_mm(a, w2^T)``:
every GEMM of the forward and the backward quantized per the recipe (on CPU an exact
emulation). The router, the combine and the shared experts are unchanged. That path saves
the permuted input x, the pre-activation h [M, 2F] and the weighted activation a [M, F]
per routed row (``grouped_swiglu`` recomputes a).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torch_moe import ops
from torch_moe._ops import _eager
from torch_moe._ops import grouped_mm as _gmm
from torch_moe._ops import grouped_swiglu as _swiglu_ops
from torch_moe._ops import permute as _perm
from torch_moe._ops import routing as _routing
from torch_moe._ops._dtypes import acc_dtype
from torch_moe._ops.fused_experts import DECODE_MAX_ROWS, decode_block_m
from torch_moe._ops.glu import gated
from torch_moe._ops.grouped_swiglu import (
    few_moe_step,
    grouped_swiglu_combine,
    routed_swiglu,
    swiglu,
    traced_routed_step,
)
from torch_moe.nn.functional import (
    check_activation,
    glu_activation,
    grouped_swiglu,
    router_z_loss,
    sequence_aux_loss,
    switch_aux_loss,
)
from torch_moe.quantization import RECIPES, Recipe, get_recipe, scaled_grouped_mm
from torch_moe.quantization.scaled_grouped_mm import codes_rows_major, decomposable, quantize_lhs

__all__ = [
    "PRESETS",
    "GroupedExperts",
    "MoE",
    "SharedExperts",
    "TopKRouter",
    "hf_state_dict_to_moe",
]


# Published configurations (HF transformers configs of the named checkpoints).
PRESETS: dict[str, dict[str, Any]] = {
    # Mixtral-8x7B: softmax over 8, top-2, renormalized.
    "mixtral": dict(
        dim=4096, hidden_dim=14336, num_experts=8, top_k=2, score_func="softmax", route_norm=True
    ),
    # Qwen1.5-MoE-A2.7B: softmax over 60, top-4, not renormalized, sigmoid-gated shared expert.
    "qwen2-moe": dict(
        dim=2048,
        hidden_dim=1408,
        num_experts=60,
        top_k=4,
        score_func="softmax",
        route_norm=False,
        shared_hidden_dim=5632,
        shared_gate=True,
    ),
    # Qwen3-30B-A3B: softmax over 128, top-8, renormalized (norm_topk_prob=True).
    "qwen3-moe": dict(
        dim=2048, hidden_dim=768, num_experts=128, top_k=8, score_func="softmax", route_norm=True
    ),
    # DeepSeek-V2: softmax over 160, 8 groups scored by their best expert / 3 kept
    # (group_limited_greedy), top-6, not renormalized, x16, two shared experts.
    "deepseek-v2": dict(
        dim=5120,
        hidden_dim=1536,
        num_experts=160,
        top_k=6,
        score_func="softmax",
        num_expert_groups=8,
        num_limited_groups=3,
        group_score="max",
        route_norm=False,
        route_scale=16.0,
        shared_hidden_dim=3072,
    ),
    # DeepSeek-V3: sigmoid, 8 groups / 4 kept, correction bias, x2.5, one shared expert.
    "deepseek-v3": dict(
        dim=7168,
        hidden_dim=2048,
        num_experts=256,
        top_k=8,
        score_func="sigmoid",
        num_expert_groups=8,
        num_limited_groups=4,
        route_norm=True,
        route_scale=2.5,
        expert_bias=True,
        shared_hidden_dim=2048,
    ),
}

_AUX_LOSSES = (None, "switch", "sequence")
# rows per expert group on CUDA with a recipe: torch._scaled_grouped_mm wants 16-row groups
_SCALED_GROUP_ALIGN = 16


def _resolve_precision(precision: str | Recipe) -> Recipe | None:
    """``"bf16"`` -> None (``grouped_swiglu``); a recipe name or :class:`Recipe` -> the recipe."""
    if isinstance(precision, str) and precision == "bf16":
        return None
    try:
        return get_recipe(precision)
    except (ValueError, TypeError) as e:
        raise ValueError(f"MoE: precision must be 'bf16' or a low-precision recipe: {e}") from e


def _check_recipe_dims(recipe: Recipe | None, dim: int, hidden_dim: int) -> None:
    """A recipe's MX operands are quantized in 1 x block blocks along the forward's and
    dgrad's reductions (``dim`` and ``hidden_dim``): both must be multiples of the block,
    an error here rather than at the first non-empty forward."""
    if recipe is None:
        return
    blocks = {
        op.inner
        for g in (recipe.forward, recipe.dgrad)
        for op in (g.lhs, g.rhs)
        if op is not None and op.fmt == "mx"
    }
    for block in sorted(blocks):
        for arg, v in (("dim", dim), ("hidden_dim", hidden_dim)):
            if v % block:
                raise ValueError(
                    f"MoE: precision {recipe.name!r} quantizes MX blocks of {block} elements "
                    f"along dim and hidden_dim: {arg} must be a multiple of {block}, got {v}"
                )


def _group_align(recipe: Recipe | None, device: torch.device) -> int:
    """Rows per expert group that the experts' GEMMs need (``permute_indices(align=)``)."""
    return _SCALED_GROUP_ALIGN if recipe is not None and device.type == "cuda" else 1


def _precision_name(recipe: Recipe | None) -> str:
    return "bf16" if recipe is None else recipe.name


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MoE: {name} must be a positive integer, got {value!r}")


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; in the backward, d(aux)/d(aux) = ``scale`` flows into ``aux``."""

    @staticmethod
    def forward(ctx, out: Tensor, aux: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class TopKRouter(nn.Module):
    """Linear router + top-k selection (``torch_moe.ops.topk_route``), math in fp32.

    ``forward(x [T, D]) -> (weights [T, K] fp32, expert_ids [T, K], tokens_per_expert [E],
    logits [T, E] fp32)``.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        group_score: str = "top2_sum",
        route_norm_eps: float = 1e-20,
        expert_bias: bool = False,
        router_bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        # the routing op's own checks, on a meta tensor: fail at construction, not at step 1
        _routing._check_inputs(
            torch.empty(0, num_experts, device="meta"),
            top_k,
            score_func,
            torch.empty(num_experts, device="meta") if expert_bias else None,
            num_expert_groups,
            num_limited_groups,
            route_scale,
            group_score,
            route_norm_eps,
        )
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.num_expert_groups, self.num_limited_groups = num_expert_groups, num_limited_groups
        self.group_score, self.route_norm_eps = group_score, route_norm_eps
        self.weight = nn.Parameter(torch.empty(num_experts, dim, device=device, dtype=dtype))
        self.bias = (
            nn.Parameter(torch.empty(num_experts, device=device, dtype=dtype))
            if router_bias
            else None
        )
        self.expert_bias: Tensor | None
        if expert_bias:
            self.register_buffer(
                "expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32)
            )
        else:
            self.expert_bias = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.weight.shape[1] ** -0.5)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        logits = ops.router_logits(x, self.weight, self.bias)
        weights, ids, counts = ops.topk_route(
            logits,
            self.top_k,
            score_func=self.score_func,
            expert_bias=self.expert_bias,
            num_expert_groups=self.num_expert_groups,
            num_limited_groups=self.num_limited_groups,
            route_norm=self.route_norm,
            route_scale=self.route_scale,
            group_score=self.group_score,
            route_norm_eps=self.route_norm_eps,
        )
        return weights, ids, counts, logits


class GroupedExperts(nn.Module):
    """E SwiGLU experts stacked as ``w13`` [E, 2F, D] and ``w2`` [E, D, F].

    ``forward(x_perm [M, D], offs [E], row_weights [M] | None) -> [M, D]`` runs every
    expert in one ``grouped_swiglu`` call, in the parameter dtype or the autocast dtype;
    with a low-precision ``precision`` (see :class:`MoE`) as two ``scaled_grouped_mm``
    calls around the SwiGLU, their operands in that dtype before quantization.
    ``activation`` / ``swiglu_alpha`` / ``swiglu_limit``, ``bias`` (``b13`` [E, 2F], ``b2``
    [E, D]) and ``gate_up_interleaved`` as :class:`MoE`'s ``activation``, ...,
    ``experts_bias``, ``gate_up_interleaved``: any of them makes the experts
    :attr:`composed` (grouped GEMMs around :func:`glu_activation`). An ungated activation
    (``"relu2"``) has no gate rows: ``w13`` is the up projection [E, F, D] (``b13`` [E, F]).

    ``fused_decode=True`` (an attribute too): in inference (``MoE`` in eval mode without
    autograd, no expert parallelism, no recipe), batches of at most
    ``DECODE_MAX_ROWS`` = 1024 routed rows run ``torch_moe::fused_experts``, on CUDA two
    fused Triton kernels (the gather, SwiGLU and routing weight inside the GEMMs; see
    ``torch_moe/_triton/moe_decode.py``), elsewhere the same ``grouped_swiglu``. Off by
    default until GPU measurements (``benchmarks/bench_moe_decode.py``) pick the bound.
    """

    activation: str
    swiglu_alpha: float
    swiglu_limit: float | None

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        *,
        precision: str | Recipe = "bf16",
        fused_decode: bool = False,
        activation: str = "swiglu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float | None = None,
        bias: bool = False,
        gate_up_interleaved: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _init_activation(self, "GroupedExperts", activation, swiglu_alpha, swiglu_limit)
        _check_interleaved("GroupedExperts", activation, gate_up_interleaved)
        self.recipe = _resolve_precision(precision)
        _check_recipe_dims(self.recipe, dim, hidden_dim)
        self.fused_decode = fused_decode
        self.gate_up_interleaved = gate_up_interleaved
        up_rows = _up_rows(activation, hidden_dim)
        self.w13 = nn.Parameter(torch.empty(num_experts, up_rows, dim, device=device, dtype=dtype))
        self.w2 = nn.Parameter(
            torch.empty(num_experts, dim, hidden_dim, device=device, dtype=dtype)
        )
        self.b13: nn.Parameter | None
        self.b2: nn.Parameter | None
        for name, size in (("b13", up_rows), ("b2", dim)):
            b = torch.empty(num_experts, size, device=device, dtype=dtype) if bias else None
            self.register_parameter(name, None if b is None else nn.Parameter(b))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default bound 1/sqrt(fan_in), per expert, for weights and biases
        for w, b in ((self.w13, self.b13), (self.w2, self.b2)):
            bound = w.shape[2] ** -0.5
            nn.init.uniform_(w, -bound, bound)
            if b is not None:
                nn.init.uniform_(b, -bound, bound)

    @property
    def composed(self) -> bool:
        """Whether the experts run as grouped GEMMs around :func:`glu_activation` (swigluoai,
        relu2, a clamp, biases or interleaved gate / up rows) instead of ``grouped_swiglu``."""
        return (
            self.activation != "swiglu"
            or self.swiglu_limit is not None
            or self.b13 is not None
            or self.gate_up_interleaved
        )

    @property
    def precision(self) -> str:
        """``"bf16"`` or the recipe's name."""
        return _precision_name(self.recipe)

    def _local_weights(self) -> tuple[Tensor, Tensor]:
        w13: Tensor = self.w13
        w2: Tensor = self.w2
        if isinstance(w13, DTensor):  # expert-parallel: this rank's experts (differentiable)
            w13, w2 = w13.to_local(), cast(DTensor, w2).to_local()
        return w13, w2

    def _local_biases(self) -> tuple[Tensor | None, Tensor | None]:
        """This rank's (b13, b2) (sharded over experts as the weights are), or Nones."""
        return cast(
            tuple[Tensor | None, Tensor | None],
            tuple(b.to_local() if isinstance(b, DTensor) else b for b in (self.b13, self.b2)),
        )

    def split_weights(self, chunks: list[tuple[int, int]]) -> list[tuple[Tensor, ...]]:
        """This rank's (w13, w2) (and (b13, b2) when the experts have biases) split once
        into ``chunks``, contiguous ranges (l0, l1) of local experts that cover them in
        order (``ExpertParallel(num_chunks=C)``'s), for ``forward(..., weights=...)``.
        One split of each weight per step: its backward
        concatenates the chunks' weight gradients once, where a slice per chunk gives every
        chunk a zero-filled gradient of all local experts to add (C zero fills and adds of
        the full gradients, two of them live in the last chunk's backward)."""
        w13, w2 = self._local_weights()
        ends = [0] + [l1 for _, l1 in chunks]
        if (
            [l0 for l0, _ in chunks] != ends[:-1]
            or ends[-1] != w13.shape[0]
            or any(l1 <= l0 for l0, l1 in chunks)
        ):
            raise ValueError(
                f"GroupedExperts.split_weights: chunks must be non-empty contiguous ranges "
                f"covering the {w13.shape[0]} local experts in order, got {chunks}"
            )
        sizes = [l1 - l0 for l0, l1 in chunks]
        parts = [w13.split(sizes), w2.split(sizes)]
        parts += [b.split(sizes) for b in self._local_biases() if b is not None]
        return list(zip(*parts, strict=True))

    def forward(
        self,
        x: Tensor,
        offs: Tensor,
        row_weights: Tensor | None = None,
        expert_range: tuple[int, int] | None = None,
        weights: tuple[Tensor, ...] | None = None,
        permutation: tuple[Tensor, Tensor] | None = None,
        combine: bool = False,
    ) -> Tensor:
        """``x`` [M, D] rows sorted by expert with group ends ``offs``; ``expert_range``
        (l0, l1): the rows are for experts l0..l1-1 of the weights this rank holds (the
        local shard when the weights are expert-parallel DTensors); or ``weights``: one
        chunk's (w13, w2) from :meth:`split_weights`. With ``permutation`` =
        (row_to_slot, slot_to_row) x is the tokens [T, D] and the rows are
        ``permute(x, *permutation)``: ``grouped_swiglu`` gathers them itself (the [M, D]
        permuted input is neither materialized nor saved, x is converted row by row to
        the dtype the experts run in), and so does the composed experts' first GEMM
        (``gather_grouped_mm``, on x in that dtype; the rows are not saved); a recipe
        permutes first. ``combine`` (with ``permutation``): the rows' outputs summed back
        to their tokens, [T, D] (``unpermute`` without weights: the routing weights are the
        rows', folded in); for SwiGLU experts without a recipe by
        ``grouped_swiglu_combine``, which in eager on CPU tensors runs both ops as one
        autograd node (the same values, gradients and saved tensors)."""
        if combine and permutation is None:
            raise ValueError("GroupedExperts.forward: combine=True needs the permutation")
        combine_maps = permutation if combine else None  # (row_to_slot, slot_to_row)
        b13: Tensor | None
        b2: Tensor | None
        if weights is not None:
            if expert_range is not None:
                raise ValueError(
                    "GroupedExperts.forward: pass expert_range or weights, not both "
                    f"(got expert_range={expert_range})"
                )
            w13, w2 = weights[0], weights[1]
            b13, b2 = (weights[2], weights[3]) if len(weights) == 4 else (None, None)
        else:
            w13, w2 = self._local_weights()
            b13, b2 = self._local_biases()
            if expert_range is not None:
                l0, l1 = expert_range
                w13, w2 = w13[l0:l1], w2[l0:l1]
                if b13 is not None and b2 is not None:
                    b13, b2 = b13[l0:l1], b2[l0:l1]
        dt = _expert_dtype(x, w13)
        if permutation is not None and self.recipe is not None:
            x = _perm.permute(x, *permutation)  # a recipe runs on permuted rows
            permutation = None
        # grouped_swiglu converts the rows it gathers itself (under autocast x stays the
        # caller's fp32 tokens: no [T, D] copy in dt saved, the token gradient summed in
        # fp32); the composed experts' first GEMM gathers rows of x in dt
        x = x.to(dt) if permutation is None or self.composed else x
        w13, w2 = w13.to(dt), w2.to(dt)
        # inference (eval mode, no autograd: e.g. the expert-parallel layer's training
        # exchange at inference, per chunk of local experts) on the parameters' experts: a
        # recipe's weights are quantized once per version, as forward_tokens quantizes them
        owners = None
        if (
            self.recipe is not None
            and not self.training
            and not torch.is_grad_enabled()
            and decomposable(self.recipe.forward)
        ):
            o13, o2 = _storage_owner(self.w13), _storage_owner(self.w2)
            # the cache names a weight by its parameter and its view's geometry: all local
            # experts (a converted copy too), or views of the parameters (slices, chunks;
            # in eager only: a traced graph has no storage to compare)
            whole = weights is None and expert_range is None
            views = not torch.compiler.is_compiling() and _views_of(w13, o13)
            if whole or (views and _views_of(w2, o2)):
                owners = (o13, o2)
        # the operands are in dt now and the op (or the recipe) decides every GEMM's
        # numerics: autocast must not recast inside (eager would otherwise differ from
        # compiled code, whose kernels run outside autocast)
        with torch.autocast(x.device.type, enabled=False):
            if self.composed:
                y = self._composed(
                    x, w13, w2, b13, b2, offs, row_weights, permutation, weight_owners=owners
                )
            elif owners is not None:
                g = cast(Recipe, self.recipe).forward
                h_M2F = _scaled_gemm_cached(x, w13, offs, g, owners[0])
                a_MF = swiglu(h_M2F, row_weights)
                del h_M2F
                y = _scaled_gemm_cached(a_MF, w2, offs, g, owners[1])
            elif self.recipe is None:
                if combine_maps is not None:
                    return grouped_swiglu_combine(x, w13, w2, offs, row_weights, *combine_maps)
                rts, s2r = (None, None) if permutation is None else permutation
                y = grouped_swiglu(x, w13, w2, offs, row_weights, row_to_slot=rts, slot_to_row=s2r)
            else:
                h_M2F = scaled_grouped_mm(x, w13.transpose(-2, -1), offs, self.recipe)
                a_MF = swiglu(h_M2F, row_weights)
                y = scaled_grouped_mm(a_MF, w2.transpose(-2, -1), offs, self.recipe)
        if combine_maps is not None:
            return _perm.unpermute(y, combine_maps[1], combine_maps[0])
        return y

    def _composed(
        self,
        x: Tensor,
        w13: Tensor,
        w2: Tensor,
        b13: Tensor | None,
        b2: Tensor | None,
        offs: Tensor,
        row_weights: Tensor | None,
        permutation: tuple[Tensor, Tensor] | None = None,
        weight_owners: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """The experts as ``grouped_mm`` (or the recipe's ``scaled_grouped_mm``) -> + b13 ->
        :func:`glu_activation` x row weight -> ``grouped_mm`` -> + row weight x b2, on the
        permuted rows x [M, D] in x's dtype (biases converted to it), or with
        ``permutation`` on the rows of the tokens x [T, D] that ``gather_grouped_mm``
        gathers itself. The backward keeps the tokens (or x), the [M, N] pre-activation
        (the activation op recomputes the rest) and the [M, F] weighted activation (the
        down GEMM's weight-gradient operand); the down bias's term saves no [M, D] tensor
        (``_row_bias``). ``weight_owners`` (inference, no autograd): the parameters of w13
        and w2, whose quantization a recipe's GEMMs then cache per version (the same ops and
        values as the training forward's, the weights not quantized again every call)."""
        recipe = self.recipe
        g = recipe.forward if recipe is not None and weight_owners is not None else None
        if g is not None and not decomposable(g):
            g = None

        def gemm(a: Tensor, w: Tensor, owner: int) -> Tensor:
            if recipe is None:
                return ops.grouped_mm(a, w.transpose(-2, -1), offs)
            if g is not None and weight_owners is not None:
                return _scaled_gemm_cached(a, w, offs, g, weight_owners[owner])
            return scaled_grouped_mm(a, w.transpose(-2, -1), offs, recipe)

        if permutation is None:
            h = gemm(x, w13, 0)
        else:  # no recipe here (a recipe permutes first)
            h = _gmm.gather_grouped_mm(x, w13.transpose(-2, -1), offs, *permutation)
        num_rows = h.shape[0]
        interleaved = self.gate_up_interleaved
        if b13 is None or b2 is None:  # GroupedExperts(bias=True) has both
            return gemm(_activate(self, h, row_weights, interleaved), w2, 1)
        # each row's expert; rows at or past offs[-1] (padding) read the last expert's up
        # bias, and their zero GEMM rows stay zero: they get no down bias (weight 0)
        rows = torch.arange(num_rows, device=x.device, dtype=offs.dtype)
        row_expert = torch.searchsorted(offs, rows, right=True)
        bias_w = (row_expert < w13.shape[0]).to(acc_dtype(x.dtype))
        if row_weights is not None:
            bias_w = bias_w * row_weights
        row_expert = row_expert.clamp(max=w13.shape[0] - 1)
        h = h + b13.to(h.dtype).index_select(0, row_expert)
        a = _activate(self, h, row_weights, interleaved)
        return _row_bias(gemm(a, w2, 1), b2, row_expert, bias_w)

    def decode_block_m(self, rows: int, device: torch.device) -> int | None:
        """The group alignment the fused decode kernels need for ``rows`` = T*K routed rows
        when this module takes that path (``fused_decode``, no recipe, SwiGLU experts
        without biases), else None."""
        if (
            not self.fused_decode
            or self.recipe is not None
            or self.composed
            or rows > DECODE_MAX_ROWS
        ):
            return None
        return decode_block_m(rows, device)

    def routed_one_call(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor | None:
        """Inference at a few tokens (no autograd): ``forward_tokens(x, ..., combine=True)``
        on ``permute_indices(expert_ids, E)``'s rows with their routing weights, the
        permutation, the weights' gather and the experts in one native call
        (``grouped_swiglu.few_moe_step``: the same values), where it runs: SwiGLU experts
        without a recipe, plain CPU tensors in eager, a decode-sized call whose count of
        busy experts this module's earlier calls have decided; else None (the caller then
        takes the Python path, which decides it). Traced (``torch.compile``, export) on CPU
        tensors of no subclass: the op ``torch_moe::routed_swiglu``, whose kernel makes
        that choice when the graph runs (a graph cannot without guarding on its token
        count), so a compiled decode step runs as eager's does."""
        if self.recipe is not None or self.composed:
            return None
        w13, w2 = self._local_weights()
        args = (x, w13, w2, expert_ids, weights)
        if _eager.direct(args):
            x, w13, w2 = _in_expert_dtype(x, w13, w2)
            if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w13, w2, weights)):
                return None
            return few_moe_step(x, w13, w2, expert_ids, weights)
        if not traced_routed_step(args):
            return None
        x, w13, w2 = _in_expert_dtype(x, w13, w2)
        return routed_swiglu(x, w13, w2, expert_ids, weights)

    def forward_tokens(
        self,
        x: Tensor,
        row_to_slot: Tensor,
        slot_to_row: Tensor,
        offs: Tensor,
        row_weights: Tensor,
        block_m: int | None = None,
        combine: bool = False,
    ) -> Tensor:
        """Inference (no autograd): the experts on the expert-sorted rows of the tokens
        ``x`` [T, D] that ``row_to_slot`` / ``slot_to_row`` (``permute_indices``) describe,
        without materializing the permuted input: the row gather happens inside
        ``grouped_swiglu`` (``gather_index``), or with a recipe inside the activation's
        quantization (``permute_quantize``: the T tokens quantized once, e4m3 rows gathered;
        a recipe with one scale per tensor quantizes the permuted rows), the weights'
        quantization cached until they change, the SwiGLU quantized in one op.
        The same values as ``forward`` on ``permute(x)`` (bit for bit on CPU). With
        ``block_m`` (from :meth:`decode_block_m`, the rows permuted with that alignment)
        the fused decode kernels (``torch_moe::fused_experts``). ``combine``: the rows'
        outputs summed back to their tokens, [T, D] (``unpermute`` without weights); SwiGLU
        experts without a recipe or ``block_m`` take ``grouped_swiglu_combine``'s eager
        form there (the same kernels, one call) where its direct path holds."""
        if combine:
            if self.recipe is None and block_m is None and not self.composed:
                w13, w2 = self._local_weights()
                maps = (row_to_slot, slot_to_row)
                if _eager.direct((x, w13, w2, offs, row_weights, *maps)):
                    x, w13, w2 = _in_expert_dtype(x, w13, w2)
                    return grouped_swiglu_combine(x, w13, w2, offs, row_weights, *maps)
            y = self.forward_tokens(x, row_to_slot, slot_to_row, offs, row_weights, block_m)
            return _perm.unpermute(y, slot_to_row, row_to_slot)
        if self.composed:  # the training forward's GEMMs on the gathered rows
            x_perm = _perm.permute(x, row_to_slot, slot_to_row)
            if self.recipe is None:
                return self.forward(x_perm, offs, row_weights)
            w13, w2 = self._local_weights()
            b13, b2 = self._local_biases()
            dt = _expert_dtype(x, w13)
            owners = (_storage_owner(self.w13), _storage_owner(self.w2))
            with torch.autocast(x.device.type, enabled=False):
                return self._composed(
                    x_perm.to(dt), w13.to(dt), w2.to(dt), b13, b2, offs, row_weights,
                    weight_owners=owners,
                )  # fmt: skip
        w13, w2 = self._local_weights()
        dt = _expert_dtype(x, w13)
        x = x.to(dt)
        recipe = self.recipe
        if recipe is None and block_m is not None:
            return torch.ops.torch_moe.fused_experts(
                x,
                w13.to(dt),
                w2.to(dt),
                row_to_slot,
                offs,
                row_weights,
                slot_to_row.shape[1],
                block_m,
            )
        if recipe is None:
            tokens = torch.div(row_to_slot, slot_to_row.shape[1], rounding_mode="floor")
            y, _h = _swiglu_ops.grouped_swiglu(x, w13.to(dt), w2.to(dt), offs, row_weights, tokens)
            return y
        g = recipe.forward
        lhs, rhs = g.lhs, g.rhs
        if lhs is None or rhs is None or not decomposable(g):  # the training path
            x_perm = _perm.permute(x, row_to_slot, slot_to_row)
            return self.forward(x_perm, offs, row_weights)
        rows = _row_local_quantization(g)
        ops_ = torch.ops.torch_moe
        # each intermediate is dropped once its consumer has run: the peak is one GEMM's
        # operands and output (the codes and h lived to the end: 13-25% higher)
        with torch.autocast(x.device.type, enabled=False):
            if rows is not None:  # each token quantized once, its codes gathered
                qx, sx = ops_.permute_quantize(x, row_to_slot, slot_to_row, *rows)
            else:  # one scale over the permuted rows, as the training forward takes it
                qx, sx = quantize_lhs(_perm.permute(x, row_to_slot, slot_to_row), lhs)
            q13, s13 = _quantize_weight_cached(_storage_owner(self.w13), w13.to(dt), g)
            h = ops_.scaled_grouped_mm(qx, q13, sx, s13, offs, lhs.inner, rhs.outer, dt)
            del qx, sx
            if rows is not None:
                qa, sa = ops_.swiglu_quantize(h, row_weights, *rows)
            else:
                qa, sa = quantize_lhs(swiglu(h, row_weights), lhs)
            del h
            q2, s2 = _quantize_weight_cached(_storage_owner(self.w2), w2.to(dt), g)
            return ops_.scaled_grouped_mm(qa, q2, sa, s2, offs, lhs.inner, rhs.outer, dt)

    def extra_repr(self) -> str:
        e, d, f = self.w2.shape
        out = f"dim={d}, hidden_dim={f}, num_experts={e}, precision={self.precision}"
        if self.activation != "swiglu":
            out += f", activation={self.activation}"
        if self.activation == "swigluoai":
            out += f", swiglu_alpha={self.swiglu_alpha}"
        if self.swiglu_limit is not None:
            out += f", swiglu_limit={self.swiglu_limit}"
        if self.b13 is not None:
            out += ", bias=True"
        if self.gate_up_interleaved:
            out += ", gate_up_interleaved=True"
        return out


def _up_rows(activation: str, hidden_dim: int) -> int:
    """Rows of the up projection: gate and up (2F) for a gated activation, else F."""
    return 2 * hidden_dim if gated(activation) else hidden_dim


def _check_interleaved(where: str, activation: str, interleaved: bool) -> None:
    if interleaved and not gated(activation):
        raise ValueError(
            f"{where}: gate_up_interleaved=True needs a gated activation, got activation="
            f"{activation!r}"
        )


def _init_activation(
    owner: GroupedExperts | SharedExperts,
    where: str,
    activation: str,
    alpha: float,
    limit: float | None,
) -> None:
    """Check and keep an experts module's ``activation``, ``swiglu_alpha``, ``swiglu_limit``."""
    check_activation(where, activation, alpha, limit)
    owner.activation, owner.swiglu_alpha, owner.swiglu_limit = activation, alpha, limit


def _activate(
    owner: GroupedExperts | SharedExperts,
    h: Tensor,
    row_weights: Tensor | None = None,
    interleaved: bool = False,
) -> Tensor:
    """:func:`glu_activation` of h [M, 2F] (or [M, F], ungated) with the activation
    ``owner`` keeps."""
    return glu_activation(
        h,
        row_weights,
        activation=owner.activation,
        alpha=owner.swiglu_alpha,
        limit=owner.swiglu_limit,
        interleaved=interleaved,
    )


def _row_bias(y: Tensor, b: Tensor, experts: Tensor, w: Tensor) -> Tensor:
    """``y + w[:, None] * b[experts]`` for rows y [M, D] of ``experts`` [M] with row weights
    w [M], summed in fp32 (fp64 for fp64) and rounded once into y's dtype.

    The weighted gather is ``embedding_bag`` with one index per bag and ``w`` as
    per-sample weights: its backward reads b again (b's gradient an index-add, w's the
    rows' dot products with their bias), so no [M, D] tensor is saved, and it is an aten
    op that every backend, the compiler and the chunk pass see into.
    """
    acc = acc_dtype(y.dtype)
    per_row = w.to(acc).unsqueeze(1)
    term = F.embedding_bag(experts.unsqueeze(1), b.to(acc), mode="sum", per_sample_weights=per_row)
    return (y.to(acc) + term).to(y.dtype)


def _check_not_fully_sharded(experts: nn.Module, what: str) -> None:
    """These expert-parallel paths read the experts' weights outside the experts' own
    forward (split into chunks before it; ``forward_tokens``), where FSDP2's hooks do not
    gather them: a clear error instead of the shard's shapes failing further in."""
    if isinstance(experts, FSDPModule):
        raise NotImplementedError(
            f"MoE: ExpertParallel({what}) with fully_shard on the experts is not supported "
            "(FSDP2 gathers their weights in their forward, which this path does not call); "
            "use num_chunks=1 and mode='training' there"
        )


def _storage_owner(p: Tensor) -> Tensor:
    """The tensor whose identity and version counter key a cached weight quantization: the
    parameter, or for a DTensor parameter its local shard (the same object every call)."""
    return cast(Tensor, p._local_tensor) if isinstance(p, DTensor) else p


def _views_of(t: Tensor, owner: Tensor) -> bool:
    """Whether ``t`` is a view of ``owner``'s memory (its values then follow from owner's
    version and its geometry: what the weight cache keys on), not a converted copy."""
    return t.untyped_storage().data_ptr() == owner.untyped_storage().data_ptr()


def _scaled_gemm_cached(a: Tensor, w: Tensor, offs: Tensor, g: Any, owner: Tensor) -> Tensor:
    """a [M, K] @ w^T per group (w [E, N, K]) by decomposable GEMM ``g`` as the training
    forward computes it (A quantized by ``quantize_lhs``, then ``scaled_grouped_mm``), w's
    quantization cached until ``owner`` changes (inference)."""
    lhs, rhs = g.lhs, g.rhs
    if lhs is None or rhs is None:
        raise ValueError(f"_scaled_gemm_cached: {g} runs in bf16, not scaled")
    qa, sa = quantize_lhs(a, lhs)
    qw, sw = _quantize_weight_cached(owner, w, g)
    ops_ = torch.ops.torch_moe
    return ops_.scaled_grouped_mm(qa, qw, sa, sw, offs, lhs.inner, rhs.outer, a.dtype)


def _row_local_quantization(g: Any) -> tuple[str, int, str] | None:
    """(fmt, block, scale_rule) when decomposable GEMM ``g`` quantizes A along its rows
    (each token's codes the same in every row it is routed to: quantized before the
    gather), else None (one scale per tensor: the permuted rows quantized together)."""
    lhs = g.lhs
    if lhs is None or lhs.outer != 1:
        return None
    return lhs.fmt, lhs.inner, lhs.scale_rule


def _quantize_weight_cached(source: Tensor, w: Tensor, g: Any) -> tuple[Tensor, Tensor]:
    """The expert weight w [E, N, K] (nn.Linear layout) as GEMM ``g``'s B = w^T [E, K, N],
    quantized along K, cached until ``source`` (the parameter) changes. K-major (each
    column of B contiguous, w's own layout) as the GPU kernels read it; an FP8 recipe's B
    row-major where the CPU's GEMMs on the codes take it faster (``codes_rows_major``:
    the same codes and scales, quantized as the view w^T with the transposed block)."""
    rhs = g.rhs
    ops_ = torch.ops.torch_moe
    if rhs.fmt == "mx":
        q, s = ops_.quantize_mx_cached(source, w, -1, rhs.inner, rhs.scale_rule)
    elif w.device.type == "cpu" and codes_rows_major(w.dtype):
        return cast(
            tuple[Tensor, Tensor],
            ops_.quantize_fp8_cached(source, w.transpose(-2, -1), [rhs.inner, rhs.outer]),
        )
    else:
        q, s = ops_.quantize_fp8_cached(source, w, [rhs.outer, rhs.inner])
    return q.transpose(-2, -1), s.transpose(-2, -1)


class SharedExperts(nn.Module):
    """A dense MLP every token goes through, optionally scaled by sigmoid(x @ gate^T).

    SwiGLU in x's dtype by default; with ``activation="swigluoai"`` or a ``swiglu_limit``
    (GLM-5-Next's and MiniMax-M3's shared MLPs) or the ungated ``"relu2"`` (Nemotron-H's,
    ``w13`` the up projection [Fs, D]) the activation is :func:`glu_activation`'s, in fp32
    with one rounding.
    """

    activation: str
    swiglu_alpha: float
    swiglu_limit: float | None

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        *,
        gate: bool = False,
        activation: str = "swiglu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _init_activation(self, "SharedExperts", activation, swiglu_alpha, swiglu_limit)
        up_rows = _up_rows(activation, hidden_dim)
        self.w13 = nn.Parameter(torch.empty(up_rows, dim, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(dim, hidden_dim, device=device, dtype=dtype))
        self.gate = nn.Parameter(torch.empty(1, dim, device=device, dtype=dtype)) if gate else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.w13, -(self.w13.shape[1] ** -0.5), self.w13.shape[1] ** -0.5)
        nn.init.uniform_(self.w2, -(self.w2.shape[1] ** -0.5), self.w2.shape[1] ** -0.5)
        if self.gate is not None:
            nn.init.uniform_(self.gate, -(self.gate.shape[1] ** -0.5), self.gate.shape[1] ** -0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = _dense(x, self.w13)
        if self.activation == "swiglu" and self.swiglu_limit is None:
            gate, up = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            # (the activation's width from w2: a view of no rows cannot infer it)
            a = _activate(self, h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], self.w2.shape[1])
        out = _dense(a, self.w2)
        if self.gate is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate))
        return out


def _dense(x: Tensor, w: Tensor) -> Tensor:
    """``F.linear(x, w)``; where the CPU multiplies x's half dtype by its fp32 upcast
    (:func:`_cpu_upcasts`), the same product by torch_moe's grouped GEMM as one group of
    all rows (x @ w^T, the weight read as the column-major [D, N] it is), which runs it as
    the routed experts' GEMMs run there: fp32 sums, one rounding, on the threads' pieces or
    ATen's fp32 GEMM (``torch_moe._ops.grouped_mm``), where ``F.linear`` would take
    oneDNN's emulated half GEMM (~10 GFLOP/s on the AVX2-only Zen 3 measured against its
    fp32 GEMM's 60-90: a 16-expert layer's step with a shared expert 25x the one without,
    benchmarks/results/perf_model_cpu_202612.md). Elsewhere (a GPU, a CPU with native half
    GEMMs, fp32 / fp64, autocast's mixed dtypes, a DTensor weight) ``F.linear`` itself."""
    if (
        x.device.type != "cpu"
        or x.dtype != w.dtype
        or isinstance(w, DTensor)
        or not _cpu_upcasts(x.dtype)
    ):
        return F.linear(x, w)
    rows = x.reshape(-1, x.shape[-1])
    offs = torch.full((1,), rows.shape[0], dtype=torch.int32)
    return ops.grouped_mm(rows, w.t().unsqueeze(0), offs).view(*x.shape[:-1], w.shape[0])


@torch.compiler.assume_constant_result
def _cpu_upcasts(dtype: torch.dtype) -> bool:
    """Whether this CPU runs ``dtype``'s GEMMs on its fp32 upcast (a half dtype it does not
    multiply natively: ``grouped_mm.cpu_compute_dtype``, measured). A constant for the
    compiler."""
    return _gmm.cpu_compute_dtype(dtype) != dtype


def _row_weights(weights_TK: Tensor, row_to_slot: Tensor, no_padding: bool) -> Tensor:
    """The routing weight of each permuted row, folded into the experts; with a capacity or
    an alignment, padding rows (row_to_slot == -1) get weight 0."""
    if no_padding:
        return weights_TK.reshape(-1).index_select(0, row_to_slot)
    row_w = weights_TK.reshape(-1).index_select(0, row_to_slot.clamp(min=0))
    return torch.where(row_to_slot >= 0, row_w, 0)


def _records_grad(x_perm: Tensor, row_w: Tensor, experts: nn.Module) -> bool:
    """Whether autograd records this forward's exchanges (so that their backwards run): the
    expert-parallel plan carries it, and every rank must agree."""
    if not torch.is_grad_enabled():
        return False
    return (
        x_perm.requires_grad
        or row_w.requires_grad
        or any(p.requires_grad for p in experts.parameters())
    )


def _expert_dtype(x: Tensor, param: Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return param.dtype


def _in_expert_dtype(x: Tensor, w13: Tensor, w2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(x, w13, w2) in the experts' dtype (``_expert_dtype``), each converted only where it
    is not already: a ``.to`` that converts nothing is still a dispatcher call, and a
    decode step's calls run from cold caches."""
    dt = _expert_dtype(x, w13)

    def as_dt(t: Tensor) -> Tensor:
        return t if t.dtype == dt else t.to(dt)

    return as_dt(x), as_dt(w13), as_dt(w2)


class MoE(nn.Module):
    r"""Mixture-of-Experts feed-forward layer (dropless by default).

    Args:
        dim: model dim D.  hidden_dim: expert hidden dim F.
        num_experts: E.  top_k: experts per token K.
        score_func, route_norm, route_scale, num_expert_groups, num_limited_groups,
            group_score, route_norm_eps: routing, see :func:`torch_moe.ops.topk_route`.
        expert_bias: keep an [E] selection bias buffer for aux-loss-free balancing.
        router_bias: give the router linear a bias.
        shared_hidden_dim: hidden dim of an always-on shared expert (0: none).
        shared_gate: scale the shared expert by ``sigmoid(x @ gate^T)`` (Qwen2-MoE).
        shared_activation, shared_swiglu_limit: the shared expert's activation and clamp,
            as ``activation`` / ``swiglu_limit`` for the routed experts (GLM-5-Next clamps
            both, HY-V4 only the routed ones, MiniMax-M3 runs swigluoai in both).
        capacity_factor: keep at most ``ceil(capacity_factor * T * K / E)`` assignments
            per expert (earliest tokens first), dropping the rest; None: dropless.
        aux_loss: ``"switch"``, ``"sequence"`` (DeepSeek-V3) or None.
        aux_loss_coeff, z_loss_coeff: loss coefficients (see the module docstring).
        precision: how the routed experts' GEMMs run. ``"bf16"`` (default): in the
            parameter dtype, or the autocast dtype under autocast (``grouped_swiglu``).
            A recipe name (``"fp8_tensorwise"``, ``"fp8_rowwise"``, ``"fp8_blockwise"``,
            ``"mxfp8"``, ``"mxfp8_rceil"``; :data:`torch_moe.quantization.RECIPES`) or a
            :class:`~torch_moe.quantization.Recipe`: forward, dgrad and wgrad of both expert
            GEMMs in FP8/MXFP8 via ``scaled_grouped_mm``, operands quantized from the
            parameter/autocast dtype. Per-GEMM override: keep some GEMMs in bf16 with e.g.
            ``precision=get_recipe("fp8_blockwise").with_overrides(wgrad="bf16")``. The
            router (fp32), the combine (fp32) and the shared experts (module or autocast
            dtype) never quantize. On CUDA a recipe pads each expert's rows to a multiple
            of 16 (``torch._scaled_grouped_mm``'s group alignment).
        activation: the routed experts' activation, ``"swiglu"`` (default:
            ``silu(gate) * up``), ``"swigluoai"`` (GPT-OSS: ``gate * sigmoid(swiglu_alpha
            * gate) * (up + 1)``) or the ungated ``"relu2"`` (Nemotron-H: ``relu(up) ** 2``,
            ``experts.w13`` the up projection [E, F, D]); see
            :func:`torch_moe.nn.functional.glu_activation`.
        swiglu_alpha: swigluoai's constant (GPT-OSS: 1.702), for the shared expert too.
        swiglu_limit: clamp gate above at it and up to +-it before the activation (GPT-OSS:
            7; DeepSeek-V4 / GLM-5 / HY-V4 clamp their SwiGLU too); None: no clamp.
        experts_bias: give the routed experts' projections biases, ``experts.b13`` [E, 2F]
            and ``experts.b2`` [E, D] (GPT-OSS); the down bias is weighted by the routing
            weight with the rest of the expert's output.
        gate_up_interleaved: ``experts.w13`` (and ``b13``) hold gate and up rows
            alternating (row 2f: gate f, row 2f + 1: up f; GPT-OSS's ``gate_up_proj``)
            instead of all gate rows first. A state dict does not say which (the shapes
            are the same): load one only into a layer of its layout (``config``).
            Experts with any of these (beyond plain SwiGLU) run as grouped GEMMs around
            the activation (``GroupedExperts.composed``; the first GEMM gathers its rows
            from the tokens, ``gather_grouped_mm``): they also save the weighted
            activation [M, F] per routed row, and never take the fused decode kernels.

    ``forward(x [..., D]) -> [..., D]``.
    """

    tokens_per_expert: Tensor
    dropped_assignments: Tensor
    last_aux_loss: Tensor
    last_z_loss: Tensor

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        group_score: str = "top2_sum",
        route_norm_eps: float = 1e-20,
        expert_bias: bool = False,
        router_bias: bool = False,
        shared_hidden_dim: int = 0,
        shared_gate: bool = False,
        shared_activation: str = "swiglu",
        shared_swiglu_limit: float | None = None,
        capacity_factor: float | None = None,
        aux_loss: str | None = None,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        precision: str | Recipe = "bf16",
        activation: str = "swiglu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float | None = None,
        experts_bias: bool = False,
        gate_up_interleaved: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_activation("MoE", activation, swiglu_alpha, swiglu_limit)
        check_activation(
            "MoE (shared expert)", shared_activation, swiglu_alpha, shared_swiglu_limit
        )
        _check_interleaved("MoE", activation, gate_up_interleaved)
        for name, value in [("dim", dim), ("hidden_dim", hidden_dim), ("num_experts", num_experts)]:
            _check_positive(name, value)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k must be in [1, num_experts={num_experts}], got {top_k!r}")
        if capacity_factor is not None and not 0 < capacity_factor < math.inf:
            raise ValueError(
                f"MoE: capacity_factor must be finite and > 0, or None, got {capacity_factor}"
            )
        if (
            isinstance(shared_hidden_dim, bool)
            or not isinstance(shared_hidden_dim, int)
            or shared_hidden_dim < 0
        ):
            raise ValueError(
                f"MoE: shared_hidden_dim must be an integer >= 0, got {shared_hidden_dim!r}"
            )
        if shared_gate and shared_hidden_dim == 0:
            raise ValueError("MoE: shared_gate=True needs shared_hidden_dim > 0")
        if aux_loss not in _AUX_LOSSES:
            raise ValueError(f"MoE: aux_loss must be one of {_AUX_LOSSES}, got {aux_loss!r}")
        if not (0 <= aux_loss_coeff < math.inf and 0 <= z_loss_coeff < math.inf):
            raise ValueError(
                "MoE: loss coefficients must be finite and >= 0, got "
                f"aux_loss_coeff={aux_loss_coeff}, z_loss_coeff={z_loss_coeff}"
            )
        self.dim, self.hidden_dim, self.num_experts, self.top_k = (
            dim,
            hidden_dim,
            num_experts,
            top_k,
        )
        self.capacity_factor = capacity_factor
        self.aux_loss, self.aux_loss_coeff, self.z_loss_coeff = (
            aux_loss,
            aux_loss_coeff,
            z_loss_coeff,
        )
        self.aux_loss_scale = 1.0
        self.router = TopKRouter(
            dim,
            num_experts,
            top_k,
            score_func=score_func,
            route_norm=route_norm,
            route_scale=route_scale,
            num_expert_groups=num_expert_groups,
            num_limited_groups=num_limited_groups,
            group_score=group_score,
            route_norm_eps=route_norm_eps,
            expert_bias=expert_bias,
            router_bias=router_bias,
            device=device,
            dtype=dtype,
        )
        self.experts = GroupedExperts(
            dim,
            hidden_dim,
            num_experts,
            precision=precision,
            activation=activation,
            swiglu_alpha=swiglu_alpha,
            swiglu_limit=swiglu_limit,
            bias=experts_bias,
            gate_up_interleaved=gate_up_interleaved,
            device=device,
            dtype=dtype,
        )
        self.shared_experts = (
            SharedExperts(
                dim,
                shared_hidden_dim,
                gate=shared_gate,
                activation=shared_activation,
                swiglu_alpha=swiglu_alpha,
                swiglu_limit=shared_swiglu_limit,
                device=device,
                dtype=dtype,
            )
            if shared_hidden_dim > 0
            else None
        )
        # expert parallelism installs a dispatcher (torch_moe.distributed.ExpertParallel):
        # it moves the permuted rows to the experts' ranks and back, chunk by chunk
        self.dispatcher: nn.Module | None
        self.register_module("dispatcher", None)
        self.register_buffer(
            "dropped_assignments",
            torch.zeros((), dtype=torch.int64, device=device),
            persistent=False,
        )
        self.register_buffer(
            "tokens_per_expert",
            torch.zeros(num_experts, dtype=torch.int64, device=device),
            persistent=False,
        )
        # the detached loss values of the last forward, for logging (``last_losses``);
        # updated in place, so that the forward has no Python side effects (it runs under
        # activation checkpointing inside torch.compile)
        loss_dtype = acc_dtype(dtype or torch.get_default_dtype())
        for name in ("last_aux_loss", "last_z_loss"):
            self.register_buffer(
                name, torch.zeros((), dtype=loss_dtype, device=device), persistent=False
            )

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> MoE:
        """The MoE block of a published model (``PRESETS``), with any argument overridden.

        Default sizes are the published ones (DeepSeek-V3's experts are 3.8G parameters:
        pass ``device="meta"`` to inspect, or smaller ``dim``/``hidden_dim``/``num_experts``).
        """
        if name not in PRESETS:
            raise ValueError(
                f"MoE.from_preset: unknown preset {name!r}; valid presets: {sorted(PRESETS)}"
            )
        return cls(**{**PRESETS[name], **overrides})

    def reset_parameters(self) -> None:
        self.router.reset_parameters()
        self.experts.reset_parameters()
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()
        self.reset_load_stats()

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(
                f"MoE: expected the input's last dim to be dim={self.dim}, got {list(x.shape)}"
            )
        if not self.training and not torch.is_grad_enabled():
            return self._forward_inference(x)
        shape = x.shape
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.experts.w13.dtype)
        x_TD = x.reshape(-1, self.dim)
        num_tokens = x_TD.shape[0]
        weights_TK, ids_TK, counts_E, logits_TE = self.router(x_TD)
        capacity = None
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)
        align = _group_align(self.experts.recipe, x_TD.device)
        perm = ops.permute_indices(ids_TK, self.num_experts, align=align, capacity=capacity)
        row_w = _row_weights(weights_TK, perm.row_to_slot, capacity is None and align == 1)
        y, shared = self._experts(x_TD, perm, row_w)
        out = y if self.dispatcher is None else ops.unpermute(y, None, perm)
        if shared is not None:
            out = out + shared

        if self.training:  # (not again where checkpointing recomputes: the op asks)
            _routing.add_load_counts(
                self.tokens_per_expert, self.dropped_assignments, counts_E, perm.num_dropped
            )
        out = self._attach_losses(out, logits_TE, ids_TK, counts_E, shape)
        return out.view(*shape[:-1], self.dim)

    def _forward_inference(self, x: Tensor) -> Tensor:
        """Eval mode without autograd (``torch.inference_mode()`` / ``no_grad``): the same
        values as the training forward, but nothing is saved and nothing is computed for a
        backward or for statistics (no aux losses, no load counts), the permute's gather is
        fused into the experts, and with a low-precision recipe the weights are quantized
        once per version. Every shape depends only on the input's shape (the permuted
        buffer has its static bound, padding rows are -1 routes) and no op reads a device
        value on the host, so the step can be captured in a CUDA graph. An expert-parallel
        layer in ``mode="low_latency"`` exchanges fixed-size buffers (no counts round trip,
        no host sync); in the default mode it runs the training exchange."""
        shape = x.shape
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.experts.w13.dtype)
        x_TD = x.reshape(-1, self.dim)
        r = self.router
        # the training forward's logits (its op: the native kernels' sums in half dtypes)
        logits = ops.router_logits(x_TD, r.weight, r.bias)
        weights_TK, ids_TK, _ = ops.topk_route(
            logits,
            self.top_k,
            score_func=r.score_func,
            expert_bias=r.expert_bias,
            num_expert_groups=r.num_expert_groups,
            num_limited_groups=r.num_limited_groups,
            route_norm=r.route_norm,
            route_scale=r.route_scale,
            group_score=r.group_score,
            route_norm_eps=r.route_norm_eps,
        )
        capacity = None
        if self.capacity_factor is not None:
            capacity = math.ceil(
                self.capacity_factor * x_TD.shape[0] * self.top_k / self.num_experts
            )
        align = _group_align(self.experts.recipe, x_TD.device)
        block_m = None
        if self.dispatcher is None and capacity is None:
            block_m = self.experts.decode_block_m(ids_TK.numel(), x_TD.device)
            align = align if block_m is None else block_m
        if self.dispatcher is None and capacity is None and block_m is None and align == 1:
            # a decode step's experts in one native call, where it runs (else None)
            out = self.experts.routed_one_call(x_TD, ids_TK, weights_TK)
            if out is not None:
                shared = self._shared_output(x_TD)
                if shared is not None:
                    out = out + shared
                return out.view(*shape[:-1], self.dim)
        perm = ops.permute_indices(ids_TK, self.num_experts, align=align, capacity=capacity)
        row_w = _row_weights(weights_TK, perm.row_to_slot, capacity is None and align == 1)
        shared = self._shared_output(x_TD)
        dispatcher = self.dispatcher
        if dispatcher is None:
            out = self.experts.forward_tokens(
                x_TD, perm.row_to_slot, perm.slot_to_row, perm.offs, row_w, block_m, combine=True
            )
            if shared is not None:
                out = out + shared
            return out.view(*shape[:-1], self.dim)
        if getattr(dispatcher, "mode", "training") == "low_latency":
            _check_not_fully_sharded(self.experts, "mode='low_latency'")
            y_perm = dispatcher.run_low_latency(  # type: ignore[operator]
                self.experts, x_TD, ids_TK, perm, row_w
            )
        elif getattr(dispatcher, "microbatches", 1) == 2:  # (on every rank: any T, 0 too)
            out = self._two_microbatches(x_TD, weights_TK, ids_TK, align)
            if shared is not None:
                out = out + shared
            return out.view(*shape[:-1], self.dim)
        else:
            y_perm, _ = self._experts(x_TD, perm, row_w, with_shared=False)
        out = ops.unpermute(y_perm, None, perm)
        if shared is not None:
            out = out + shared
        return out.view(*shape[:-1], self.dim)

    def _shared_output(self, x_TD: Tensor) -> Tensor | None:
        """The shared experts' output (their input in the autocast dtype under autocast),
        or None without shared experts."""
        if self.shared_experts is None:
            return None
        shared_dtype = x_TD.dtype
        if torch.is_autocast_enabled(x_TD.device.type):
            shared_dtype = torch.get_autocast_dtype(x_TD.device.type)
        return self.shared_experts(x_TD.to(shared_dtype))

    def _two_microbatches(
        self, x_TD: Tensor, weights_TK: Tensor, ids_TK: Tensor, align: int
    ) -> Tensor:
        """Expert-parallel prefill as two micro-batches (``ExpertParallel(microbatches=2)``,
        dropless): both dispatches are issued first, then micro-batch A's experts run while
        B's rows travel, A's combine is issued before B's experts run, and both combines are
        waited last (on every rank whatever its tokens: a rank of 0 or 1 tokens has an empty
        micro-batch, whose exchanges its peers wait on). Every token's rows meet the same
        experts as in one batch; each expert GEMM sees half the rows, which a CPU BLAS may
        round differently (measured: at most 1 fp32 ulp)."""
        d = cast(Any, self.dispatcher)
        T = x_TD.shape[0]
        chunk = (0, d.num_local)
        parts = []
        for rows in (slice(0, T // 2), slice(T // 2, T)):
            perm = ops.permute_indices(ids_TK[rows], self.num_experts, align=align)
            x_perm = _perm.permute(x_TD[rows], perm.row_to_slot, perm.slot_to_row)
            row_w = _row_weights(weights_TK[rows], perm.row_to_slot, align == 1)
            records = _records_grad(x_perm, row_w, self.experts)
            counts = d.plan(perm.offs, x_perm, records, microbatches=True)
            handle = d.dispatch_start(x_perm, row_w, counts, chunk)
            parts.append((perm, x_perm, row_w, counts, handle))
        combines = []
        for _, x_perm, row_w, counts, handle in parts:
            x_c, w_c, offs_c = d.dispatch_wait(handle, x_perm, row_w, counts, chunk)
            y_c = self.experts(x_c, offs_c, w_c, expert_range=chunk)
            combines.append((d.combine_start(y_c, counts, chunk, x_perm.shape[0]), y_c))
        outs = []
        for (perm, x_perm, *_), (handle, y_c) in zip(parts, combines, strict=True):
            y_perm = d.combine_wait(handle, y_c, x_perm.shape[0])
            outs.append(ops.unpermute(y_perm, None, perm))
        return torch.cat(outs)

    def _experts(
        self, x_TD: Tensor, perm: ops.MoEPermutation, row_w: Tensor, with_shared: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """The routed experts' output and the shared experts' output [T, D] (or None).

        Without expert parallelism the experts gather their rows from the tokens and sum
        them back (``GroupedExperts.forward(permutation=..., combine=True)``: no [M, D]
        permuted input saved; the output is the tokens' [T, D]); with it the output is
        the permuted rows [M, D], which the exchange sends and returns.

        Expert-parallel schedule (``self.dispatcher``): the counts exchange, then per chunk
        of local experts dispatch -> experts -> combine; the shared experts run after the
        first chunk's dispatch, where a compiled graph overlaps them with the exchanges
        still in flight (``torch_moe._inductor``). Every expert sees the same rows in the
        same order as without chunks, so the result does not depend on the chunking
        beyond rounding (``ExpertParallel``'s notes say where a row can round otherwise).
        """
        dispatcher = self.dispatcher
        if dispatcher is None:  # the same order as below: the same backward accumulation
            shared = self._shared_output(x_TD) if with_shared else None
            maps = (perm.row_to_slot, perm.slot_to_row)
            return self.experts(x_TD, perm.offs, row_w, permutation=maps, combine=True), shared
        x_perm = _perm.permute(x_TD, perm.row_to_slot, perm.slot_to_row)
        records = _records_grad(x_perm, row_w, self.experts)
        counts = dispatcher.plan(perm.offs, x_perm, records)  # type: ignore[operator]
        y_perm: Tensor | None = None  # type: ignore[no-redef]
        shared = None
        chunks: list[tuple[int, int]] = list(dispatcher.chunks)  # type: ignore[arg-type]
        # several chunks: the local weights split once (``split_weights``); one chunk keeps
        # its expert_range slice, which the compiler's chunk pass re-bounds per chunk
        split = None
        if len(chunks) > 1:
            _check_not_fully_sharded(self.experts, f"num_chunks={len(chunks)}")
            split = self.experts.split_weights(chunks)
        for c, chunk in enumerate(chunks):
            x_c, w_c, offs_c = dispatcher.dispatch(x_perm, row_w, counts, chunk)  # type: ignore[operator]
            if c == 0 and with_shared:
                shared = self._shared_output(x_TD)
            if split is None:
                y_c = self.experts(x_c, offs_c, w_c, expert_range=chunk)
            else:
                y_c = self.experts(x_c, offs_c, w_c, weights=split[c])
            part = dispatcher.combine(y_c, counts, chunk, x_perm.shape[0])  # type: ignore[operator]
            y_perm = part if y_perm is None else y_perm + part
        return cast(Tensor, y_perm), shared

    def _attach_losses(
        self, out: Tensor, logits: Tensor, ids: Tensor, counts: Tensor, shape: torch.Size
    ) -> Tensor:
        total = None
        score_func = self.router.score_func
        if self.aux_loss is not None and self.aux_loss_coeff > 0:
            if self.aux_loss == "switch":
                loss = switch_aux_loss(logits, counts, self.top_k, score_func=score_func)
            else:
                seq_len = shape[-2] if len(shape) >= 3 else logits.shape[0]
                loss = sequence_aux_loss(logits, ids, self.top_k, seq_len, score_func=score_func)
            # (a detached copy, not a no_grad block: torch.export keeps such a block as a
            # subgraph of no outputs, which its serializer cannot load back)
            self.last_aux_loss.copy_(loss.detach())
            total = self.aux_loss_coeff * loss
        if self.z_loss_coeff > 0:
            z = router_z_loss(logits)
            self.last_z_loss.copy_(z.detach())
            total = self.z_loss_coeff * z if total is None else total + self.z_loss_coeff * z
        if total is None or not torch.is_grad_enabled():
            return out
        return _AttachAuxLoss.apply(out, total, self.aux_loss_scale)

    @property
    def last_losses(self) -> dict[str, Tensor]:
        """The aux / z losses of the last forward (detached copies, for logging), by name;
        only the losses this layer computes (a coefficient > 0)."""
        losses = {}
        if self.aux_loss is not None and self.aux_loss_coeff > 0:
            losses["aux_loss"] = self.last_aux_loss.clone()
        if self.z_loss_coeff > 0:
            losses["z_loss"] = self.last_z_loss.clone()
        return losses

    @torch.no_grad()
    def update_expert_bias(self, rate: float = 1e-3, group: Any = None) -> Tensor:
        """Aux-loss-free balancing step; call after ``optimizer.step()``.

        ``bias += rate * sign(mean_load - load)``, then mean-centred; the load is
        ``tokens_per_expert`` summed over ``group``: pass the process group of every rank
        whose tokens this layer routes (data-parallel x expert-parallel ranks of this
        layer; under pipeline parallelism, not the other stages), so that the bias stays
        identical on those ranks. ``group=None``: this rank's own load (no collective;
        never the default world group implicitly). Resets the counts and returns the
        load used.
        """
        if self.router.expert_bias is None:
            raise RuntimeError(
                "MoE.update_expert_bias: this layer was built with expert_bias=False"
            )
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < math.inf:
            # (a NaN or inf rate made the bias NaN, and every later forward refuse it)
            raise ValueError(f"MoE.update_expert_bias: rate must be finite and >= 0, got {rate!r}")
        load = self.tokens_per_expert.to(torch.float32)
        if group is not None:
            # (not a member: torch's all_reduce only warns, and the bias would move by
            # this rank's own load, apart from the group's)
            if torch.distributed.get_rank(group) < 0:
                raise ValueError(
                    f"MoE.update_expert_bias: this rank ({torch.distributed.get_rank()}) is "
                    f"not in group {group}"
                )
            torch.distributed.all_reduce(load, group=group)
        bias = self.router.expert_bias
        bias += rate * torch.sign(load.mean() - load)
        bias -= bias.mean()
        self.reset_load_stats()
        return load

    def reset_load_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.dropped_assignments.zero_()

    def load_stats(self) -> dict[str, Any]:
        """Tokens per expert (routed, before any capacity drop) since the last reset, the
        max/mean load imbalance, and the assignments dropped by the capacity limit."""
        load = self.tokens_per_expert.to(torch.float32)
        mean = load.mean()
        return {
            "tokens_per_expert": self.tokens_per_expert.tolist(),
            "dropped_assignments": int(self.dropped_assignments),
            "imbalance": float(load.max() / mean) if mean > 0 else float("nan"),
        }

    @property
    def config(self) -> dict[str, Any]:
        """The constructor arguments that define the parameters' meaning (for checkpoints)."""
        r = self.router
        return dict(
            dim=self.dim,
            hidden_dim=self.hidden_dim,
            num_experts=self.num_experts,
            top_k=self.top_k,
            score_func=r.score_func,
            route_norm=r.route_norm,
            route_scale=r.route_scale,
            num_expert_groups=r.num_expert_groups,
            num_limited_groups=r.num_limited_groups,
            group_score=r.group_score,
            route_norm_eps=r.route_norm_eps,
            expert_bias=r.expert_bias is not None,
            router_bias=r.bias is not None,
            shared_hidden_dim=0 if self.shared_experts is None else self.shared_experts.w2.shape[1],
            shared_gate=self.shared_experts is not None and self.shared_experts.gate is not None,
            shared_activation=self._shared("activation", "swiglu"),
            shared_swiglu_limit=self._shared("swiglu_limit", None),
            capacity_factor=self.capacity_factor,
            precision=self._precision_arg(),
            activation=self.experts.activation,
            swiglu_alpha=self.experts.swiglu_alpha,
            swiglu_limit=self.experts.swiglu_limit,
            experts_bias=self.experts.b13 is not None,
            gate_up_interleaved=self.experts.gate_up_interleaved,
        )

    def _shared(self, name: str, default: Any) -> Any:
        return default if self.shared_experts is None else getattr(self.shared_experts, name)

    def _precision_arg(self) -> str | Recipe:
        """The ``precision`` argument that rebuilds this layer: a name when it is one."""
        recipe = self.experts.recipe
        if recipe is None or RECIPES.get(recipe.name) == recipe:
            return _precision_name(recipe)
        return recipe  # e.g. a recipe with per-GEMM overrides

    def extra_repr(self) -> str:
        c = {**self.config, "precision": self.experts.precision}
        return ", ".join(
            f"{k}={v}"
            for k, v in c.items()
            if (v not in (None, False, 0) or k == "top_k")
            and (k, v)
            not in (
                ("precision", "bf16"),
                ("activation", "swiglu"),
                ("shared_activation", "swiglu"),
            )
            and not (
                k == "swiglu_alpha" and "swigluoai" not in (c["activation"], c["shared_activation"])
            )
        )


# where HF sparse-MoE blocks keep the router weight and the selection bias (keys relative
# to the block), as torch_moe.integrations.transformers.to_torch_moe finds them
_HF_ROUTER_WEIGHT = ("gate.weight", "router.weight", "router.gate.weight", "gate.wg.weight")
# the routed experts' up projection (gated, or ungated as Nemotron-H's) and down projection
_HF_PROJ_WEIGHTS = ("experts.gate_up_proj", "experts.up_proj", "experts.down_proj")
_HF_PROJ_BIASES = ("experts.gate_up_proj_bias", "experts.up_proj_bias", "experts.down_proj_bias")
_HF_EXPERT_BIAS = (
    "gate.e_score_correction_bias",  # DeepSeek-V3 and its kin, Laguna
    "e_score_correction_bias",  # on the block: MiniMax-M2, HY-V3
    "expert_bias",  # on the block: AFMoE, LFM2
    "gate.moe_statics.e_score_correction_bias",  # Ernie 4.5, [1, E]
)


def hf_state_dict_to_moe(
    state_dict: dict[str, Tensor], *, experts_transposed: bool = False
) -> dict[str, Tensor]:
    """Map the state dict of an HF transformers 5.x MoE block onto ``MoE``'s names.

    Handles the router weight as ``gate.weight`` (Mixtral, Qwen, DeepSeek), ``router.weight``
    (Granite, Jamba), ``router.gate.weight`` (AFMoE) or ``gate.wg.weight`` (HunYuan); the
    selection bias on the router, on the block or in Ernie's ``moe_statics``; the routed
    experts (``experts.gate_up_proj`` / ``down_proj``; ``experts_transposed=True`` for the
    families that store them as [E, D, 2F] / [E, F, D], the experts' ``is_transposed``
    flag, e.g. Aria and GPT-OSS: mapped as transposed views) and their biases
    (``gate_up_proj_bias`` / ``down_proj_bias``: ``MoE(experts_bias=True)``; GPT-OSS's
    interleaved gate / up rows are ``gate_up_interleaved=True``), a router bias
    (``router_bias=True``); a shared expert as ``shared_expert`` /
    ``shared_experts`` / ``shared_mlp`` and its ``shared_expert_gate``. Ungated experts
    (Nemotron-H: ``experts.up_proj``, a shared ``up_proj`` without ``gate_proj``) map to
    ``MoE(activation="relu2")``'s up projections. Keys are relative
    to the block (strip the layer prefix first). The routing rule itself is the caller's
    (``MoE``'s arguments; ``to_torch_moe`` derives them from the block).
    """
    out: dict[str, Tensor] = {}
    shared: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        if key in _HF_ROUTER_WEIGHT:
            name = "router.weight"
        elif key in ("gate.bias", "router.bias"):  # MoE(router_bias=True)
            name = "router.bias"
        elif key in _HF_PROJ_BIASES:
            name = "experts.b2" if key == "experts.down_proj_bias" else "experts.b13"
        elif key in _HF_EXPERT_BIAS:
            name, value = "router.expert_bias", value.reshape(-1)
        elif key in _HF_PROJ_WEIGHTS:
            name = "experts.w2" if key == "experts.down_proj" else "experts.w13"
            value = value.transpose(-2, -1) if experts_transposed else value
        elif key == "shared_expert_gate.weight":
            name = "shared_experts.gate"
        elif key.startswith(("shared_expert.", "shared_experts.", "shared_mlp.")):
            shared[key.split(".", 1)[1]] = value
            continue
        else:
            raise KeyError(f"hf_state_dict_to_moe: unexpected key {key!r}")
        if name in out:
            raise KeyError(f"hf_state_dict_to_moe: two keys map to {name!r}, the second {key!r}")
        out[name] = value
    if shared:
        if "gate_up_proj.weight" in shared:  # MiniMax-M3: [gate; up] in one Linear
            out["shared_experts.w13"] = shared["gate_up_proj.weight"]
        elif "gate_proj.weight" not in shared:  # ungated (Nemotron-H): the up projection
            out["shared_experts.w13"] = shared["up_proj.weight"]
        else:
            out["shared_experts.w13"] = torch.cat(
                [shared["gate_proj.weight"], shared["up_proj.weight"]], 0
            )
        out["shared_experts.w2"] = shared["down_proj.weight"]
    return out
