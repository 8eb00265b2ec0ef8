"""torch_moe as an HF transformers ``ExpertsInterface`` backend: the experts forward.

Legend: T tokens, D model dim (the experts' input and output), F expert hidden dim,
N = 2F (gated) or F (ungated) up-projection width, E experts, K top-k, M permuted rows
(T*K when dropless, plus per-expert padding on CUDA with a recipe).

Design
------
transformers 5.x calls ``experts_forward(experts, hidden_states_TD, top_k_index_TK,
top_k_weights_TK)`` for every module decorated with ``@use_experts_implementation``; the
routing is the model's own and arrives in ``top_k_index`` / ``top_k_weights``. The layout
flags the decorator sets on the module (``has_gate``, ``is_concatenated``,
``is_transposed``, ``has_bias``, ``has_post_expert_norm``) say how the weights are stored;
this backend reads them on every call (cheap, and under ``torch.compile`` they are
constants) and picks one of two paths:

* fused: a gated experts module with transformers' default gate
  (``act_fn(gate) * up`` on concatenated ``[gate; up]`` rows) and a SiLU ``act_fn``, no
  biases and no post-expert norm (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, OLMoE and most of
  the 64 families). ``torch_moe.ops.permute_indices`` -> ``grouped_swiglu(x, w13, w2,
  offs, row_weights, row_to_slot=, slot_to_row=)`` (the permute's gather inside the op)
  -> ``torch_moe.ops.unpermute`` (fp32 combine; in eager on CPU tensors the two ops' kernels
  as one autograd node, ``grouped_swiglu_combine``). The routing weight of each row is folded
  into the op, whose backward keeps only the tokens [T, D] and the pre-activation [M,
  2F]: neither a permuted input, nor the [M, D] expert output, nor the [M, F]
  activation is saved.
* composed: everything else. ``torch_moe::gather_grouped_mm`` for the up projection
  (the rows gathered from the tokens inside the GEMM; either weight orientation), the
  per-row up bias, then the gate times the routing weight: by ``torch_moe::glu`` where
  the gate is one it computes (transformers' default with SiLU, and the classes of
  ``OWN_GATES``: GPT-OSS's clamped ``(up + 1) * glu`` on interleaved columns, clamped
  SwiGLU; ungated: Nemotron-H's squared ReLU; fp32 math and one rounding as in the fused
  path, each with a native CPU kernel), otherwise by the module's OWN ``_apply_gate``
  (soft-capped SwiGLU, GELU gates, ...) or ``act_fn`` (ungated) under
  ``torch.utils.checkpoint``; either way only the [M, N] pre-activation is kept and the
  activation is recomputed in the backward; ``grouped_mm`` for the down projection; the
  down bias enters as ``sum_k w[t, k] * b[e(t, k)]`` per token (``_ExpertBiasCombine``,
  which saves no [T*K, D] tensor either). A post-expert norm is nonlinear, so there the
  routing weights go into the combine (``unpermute(y, weights)``) instead. Saved per row:
  h [N] and the weighted activation [F] (the down GEMM's wgrad input); the tokens once
  (x [D] per row as well with a recipe, which permutes first). With the glu op and no
  recipe, in eager on CPU tensors the up GEMM, up bias, glu, down GEMM and combine run as
  one autograd node (``grouped_glu_combine``: the ops' kernels, bit for bit).

Both paths run in the autocast dtype under autocast, otherwise in the weights' dtype (as
transformers' ``grouped_mm`` casts the input to the weights' dtype), and return the input
dtype. With a low-precision recipe (``set_precision`` / the ``"torch_moe_<recipe>"``
implementations) the composed path runs both GEMMs through
``torch_moe.quantization.scaled_grouped_mm`` (forward, dgrad and wgrad quantized per the
recipe; an exact emulation on CPU); biases, the activation and the combine stay in the
compute dtype.

Expert-parallel sentinels: when transformers' own expert parallelism marks the module
(``_is_expert_parallel``), ids >= E are routed to a virtual expert E whose rows lie past
``offs[E-1]``: the grouped GEMMs skip them (zero rows) and their weights are masked to 0,
so they cost no GEMM and receive no gradient, as in transformers' ``grouped_mm``.

Nothing here synchronizes with the device and everything traces under
``torch.compile(fullgraph=True)``. HF modules are typed ``Any``: their attributes (flags,
weights, ``act_fn``) come from the model's config, not from a class torch_moe knows.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from torch_moe import ops
from torch_moe._ops import glu as _glu
from torch_moe._ops import grouped_mm as _gmm
from torch_moe._ops import permute as _perm
from torch_moe._ops._dtypes import acc_dtype
from torch_moe._ops.grouped_swiglu import (
    grouped_swiglu_combine,
    routed_swiglu,
    traced_routed_step,
)
from torch_moe.quantization import Recipe, scaled_grouped_mm

# transformers' symbols the layout checks compare against, imported once (an import
# statement in the check cost microseconds on every experts call); this module serves
# ``torch_moe.integrations.transformers``, which needs transformers
_HF_SYMBOLS: tuple[Any, Any, Any]
try:
    from transformers.activations import ReLUSquaredActivation, SiLUActivation
    from transformers.integrations.moe import _default_apply_gate as _default_gate_fn

    _HF_SYMBOLS = (ReLUSquaredActivation, SiLUActivation, _default_gate_fn)
except ImportError:  # pragma: no cover - an older transformers: the integration refuses it
    _HF_SYMBOLS = (None, None, None)
_ReLUSquaredActivation, _SiLUActivation, _default_apply_gate = _HF_SYMBOLS

__all__ = ["RECIPE_ATTR", "ExpertsLayout", "experts_forward", "experts_layout"]

# attribute of an experts module holding its low-precision Recipe (None: compute dtype)
RECIPE_ATTR = "_torch_moe_recipe"
LAYOUT_FLAGS = ("has_gate", "is_concatenated", "is_transposed", "has_bias", "has_post_expert_norm")
# flags added after the decorator's first release: absent means False (transformers 5.17,
# on the H200 image, has no has_post_expert_norm); the others every experts module has
_LATER_FLAGS = ("has_post_expert_norm",)
REQUIRED_FLAGS = tuple(f for f in LAYOUT_FLAGS if f not in _LATER_FLAGS)
# torch._scaled_grouped_mm on CUDA wants every group's rows padded to a multiple of 16
_SCALED_GROUP_ALIGN = 16
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class ExpertsLayout:
    """How one HF experts module stores its weights, and which path this backend takes."""

    has_gate: bool
    is_concatenated: bool
    is_transposed: bool
    has_bias: bool
    has_post_expert_norm: bool
    up_name: str  # "gate_up_proj" (gated) or "up_proj"
    default_gate: bool  # transformers' _default_apply_gate: act_fn(gate) * up on [gate; up]
    silu: bool  # act_fn is SiLU
    fused: bool  # grouped_swiglu applies
    # torch_moe::glu's (activation, alpha, limit, interleaved) for the gate: transformers'
    # default with SiLU, an OWN_GATES entry or (ungated) a squared ReLU; None: the module's
    # own gate (or act_fn) runs
    glu: tuple[str, float, float | None, bool] | None = None

    @property
    def path(self) -> str:
        return "fused" if self.fused else "composed"


def _is_silu(act: Any) -> bool:
    if act is F.silu:
        return True
    if not isinstance(act, nn.Module):
        return False
    if isinstance(act, nn.SiLU):
        return True
    return _SiLUActivation is not None and type(act) is _SiLUActivation


# experts classes whose own _apply_gate is one of torch_moe::glu's activations: (its
# activation, the attribute holding swiglu_alpha (swigluoai only), the one holding
# swiglu_limit, gate / up interleaved). The experts backend runs their gate by that op
# and ``to_torch_moe`` converts them to ``MoE(activation=...)``.
OWN_GATES: dict[str, tuple[str, str | None, str | None, bool]] = {
    "GptOssExperts": ("swigluoai", "alpha", "limit", True),
    "OpenAIPrivacyFilterExperts": ("swigluoai", "alpha", "limit", False),
    "Glm5NextTextExperts": ("swiglu", None, "swiglu_limit", False),
    "HYV4Experts": ("swiglu", None, "swiglu_limit", False),
    "BeamExperts": ("swiglu", None, None, False),  # act_fn(gate) * up in fp32: SiLU checked
    "MiniMaxM3VLExperts": ("swigluoai", "swiglu_alpha", "swiglu_limit", False),
}


def gate_constants(
    module: Any, alpha_attr: str | None, limit_attr: str | None
) -> tuple[float | None, float | None]:
    """(swiglu_alpha, swiglu_limit) a module holds in the attributes an ``OWN_GATES``
    entry names; None where it names none or the module holds None."""
    alpha = None if alpha_attr is None else float(getattr(module, alpha_attr))
    limit = None if limit_attr is None else getattr(module, limit_attr, None)
    return alpha, None if limit is None else float(limit)


@torch.compiler.assume_constant_result  # the class's, fixed: a constant when traced
def _gate_owner(cls: type) -> str:
    """The name of the class that defines ``cls._apply_gate`` ("" without one)."""
    return getattr(getattr(cls, "_apply_gate", None), "__qualname__", "").split(".")[0]


def own_gate(experts: Any) -> tuple[str, float | None, float | None, bool] | None:
    """(activation, swiglu_alpha, swiglu_limit, interleaved) of a gated experts module
    whose ``_apply_gate`` is an ``OWN_GATES`` entry ("swiglu" ones with a SiLU ``act_fn``
    or none), else None."""
    known = OWN_GATES.get(_gate_owner(type(experts)))
    if known is None:
        return None
    activation, alpha_attr, limit_attr, interleaved = known
    act_fn = getattr(experts, "act_fn", None)
    if activation == "swiglu" and act_fn is not None and not _is_silu(act_fn):
        return None
    return (activation, *gate_constants(experts, alpha_attr, limit_attr), interleaved)


def _is_relu2(act: Any) -> bool:
    """Whether ``act`` is transformers' squared ReLU (Nemotron-H's ungated experts)."""
    return _ReLUSquaredActivation is not None and type(act) is _ReLUSquaredActivation


def _default_gate(experts: Any) -> bool:
    apply_gate = getattr(type(experts), "_apply_gate", None)
    return _default_apply_gate is not None and apply_gate is _default_apply_gate


def _unknown_flags() -> dict[str, Any]:
    """Layout flags of the installed ``use_experts_implementation`` that this backend does
    not implement, with their defaults (empty for the tested transformers versions)."""
    try:
        from transformers.integrations.moe import use_experts_implementation
    except ImportError:  # pragma: no cover - transformers is what calls this backend
        return {}
    params = inspect.signature(use_experts_implementation).parameters
    return {
        n: p.default
        for n, p in params.items()
        if n not in (*LAYOUT_FLAGS, "experts_class", "experts_interface")
    }


UNKNOWN_FLAGS = _unknown_flags()


def experts_layout(experts: Any) -> ExpertsLayout:
    """Read and check an HF experts module's layout flags and weights.

    Raises ``TypeError`` / ``ValueError`` naming the flag or weight that this backend
    cannot run (a module without the ``@use_experts_implementation`` flags, a missing
    weight or bias, quantized (non-float) weights, inconsistent shapes), and
    ``NotImplementedError`` naming a layout flag newer than this backend set to a
    non-default value.
    """
    name = type(experts).__name__
    missing = [f for f in REQUIRED_FLAGS if not hasattr(experts, f)]
    if missing:
        raise TypeError(
            f"torch_moe experts backend: {name} has no layout flag(s) {missing}; it is not a "
            "transformers experts module decorated with @use_experts_implementation"
        )
    for flag, default in UNKNOWN_FLAGS.items():
        value = getattr(experts, flag, default)
        if value != default:
            raise NotImplementedError(
                f"torch_moe experts backend: {name} has the layout flag {flag}={value!r}, which "
                f"this backend does not implement (it knows {list(LAYOUT_FLAGS)})"
            )
    flags = {f: bool(getattr(experts, f, False)) for f in LAYOUT_FLAGS}
    up_name = "gate_up_proj" if flags["has_gate"] else "up_proj"
    shapes: dict[str, tuple[int, int, int]] = {}  # [E, in, out] of each weight
    for wname in (up_name, "down_proj"):
        w = getattr(experts, wname, None)
        if not isinstance(w, Tensor) or w.dim() != 3:
            raise ValueError(
                f"torch_moe experts backend: {name} (has_gate={flags['has_gate']}) needs a 3D "
                f"expert weight {wname!r} [E, out, in] (or [E, in, out] with is_transposed=True), "
                f"got {type(w).__name__ if not isinstance(w, Tensor) else list(w.shape)}"
            )
        if w.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"torch_moe experts backend: {name}.{wname} has dtype {w.dtype}; quantized "
                f"expert weights are not supported (expected one of {_FLOAT_DTYPES}); use "
                "set_precision() to run the experts' GEMMs in FP8/MX instead"
            )
        e, rows, cols = w.shape
        shapes[wname] = (e, rows, cols) if flags["is_transposed"] else (e, cols, rows)
    up, down = shapes[up_name], shapes["down_proj"]
    num_experts, dim, width = up
    if down[0] != num_experts or down[2] != dim:
        raise ValueError(
            f"torch_moe experts backend: {name} (is_transposed={flags['is_transposed']}): "
            f"{up_name} {list(getattr(experts, up_name).shape)} and down_proj "
            f"{list(experts.down_proj.shape)} do not describe E experts of D -> N -> D"
        )
    if flags["has_bias"]:
        for wname, size in ((f"{up_name}_bias", width), ("down_proj_bias", dim)):
            b = getattr(experts, wname, None)
            if not isinstance(b, Tensor) or list(b.shape) != [num_experts, size]:
                raise ValueError(
                    f"torch_moe experts backend: {name} has has_bias=True but {wname!r} is not "
                    f"an [E={num_experts}, {size}] tensor"
                )
    if flags["has_post_expert_norm"] and not callable(getattr(experts, "post_expert_norm", None)):
        raise ValueError(
            f"torch_moe experts backend: {name} has has_post_expert_norm=True but no "
            "post_expert_norm module"
        )
    default_gate = flags["has_gate"] and _default_gate(experts)
    silu = _is_silu(getattr(experts, "act_fn", None))
    fused = (
        default_gate
        and silu
        and flags["is_concatenated"]
        and not flags["has_bias"]
        and not flags["has_post_expert_norm"]
        and width == 2 * down[1]
    )
    glu: tuple[str, float, float | None, bool] | None = None
    if default_gate and silu:
        glu = ("swiglu", 1.0, None, False)  # the default gate splits halves whatever the flag
    elif flags["has_gate"] and (known := own_gate(experts)) is not None:
        activation, alpha, limit, interleaved = known
        glu = (activation, 1.0 if alpha is None else alpha, limit, interleaved)
    elif not flags["has_gate"] and _is_relu2(getattr(experts, "act_fn", None)):
        glu = ("relu2", 1.0, None, False)
    return ExpertsLayout(
        **flags, up_name=up_name, default_gate=default_gate, silu=silu, fused=fused, glu=glu
    )


def _compute_dtype(x: Tensor, weight: Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.dtype


def _gemm(x: Tensor, w_EKN: Tensor, offs: Tensor, recipe: Recipe | None) -> Tensor:
    if recipe is None:
        return ops.grouped_mm(x, w_EKN, offs)
    with torch.autocast(x.device.type, enabled=False):  # the recipe decides the numerics
        return scaled_grouped_mm(x, w_EKN, offs, recipe)


def _gate_times_weight(experts: Any, has_gate: bool, h: Tensor, rw_M: Tensor) -> Tensor:
    """The module's own activation (``_apply_gate`` or ``act_fn``) times the row weight."""
    a = experts._apply_gate(h) if has_gate else experts.act_fn(h)
    return (a * rw_M.unsqueeze(-1)).to(h.dtype)


class _ExpertBiasCombine(torch.autograd.Function):
    """``out[t] = sum_k w[t, k] * b[ids[t, k]]`` in fp32 (fp64 for fp64), saving no [T, K, D].

    ids >= E (expert-parallel sentinels) contribute 0 and get a 0 weight gradient. The
    weights are scattered into a dense [T, E] matrix (zero where a token does not route),
    so the forward and both gradients are one GEMM each over E (the zero terms add
    exact zeros): ``out = W @ b``, ``grad_b = W^T @ g``, ``grad_w[t, k] = (g @ b^T)[t,
    ids[t, k]]``. A loop over k of row gathers and ``index_add_`` took 2.8-11x longer
    (T = 16-1024, E = 16-128, D = 512-2880, one thread; ``index_add_`` dominates).
    """

    @staticmethod
    def forward(ctx: Any, bias_ED: Tensor, ids_TK: Tensor, w_TK: Tensor) -> Tensor:  # type: ignore[override]
        acc = acc_dtype(bias_ED.dtype)
        num_experts = bias_ED.shape[0]
        ids = ids_TK.clamp(max=num_experts)  # sentinels: column E, cut off below
        w_TE = torch.zeros(ids.shape[0], num_experts + 1, dtype=acc, device=bias_ED.device)
        w_TE = w_TE.scatter_add_(1, ids, w_TK.to(acc))[:, :num_experts]
        ctx.save_for_backward(bias_ED, ids, w_TE)
        ctx.w_dtype = w_TK.dtype
        return torch.mm(w_TE, bias_ED.to(acc))

    @staticmethod
    def backward(ctx: Any, grad_TD: Tensor) -> tuple[Tensor | None, None, Tensor | None]:  # type: ignore[override]
        bias_ED, ids, w_TE = ctx.saved_tensors
        g = grad_TD.to(w_TE.dtype)
        grad_b = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_b = torch.mm(w_TE.t(), g).to(bias_ED.dtype)
        if ctx.needs_input_grad[2]:
            g_TE = torch.nn.functional.pad(torch.mm(g, bias_ED.to(g.dtype).t()), (0, 1))
            grad_w = g_TE.gather(1, ids).to(ctx.w_dtype)  # column E (sentinels): 0
        return grad_b, None, grad_w


def _row_experts(ids_TK: Tensor, row_to_slot: Tensor, num_experts: int) -> Tensor:
    """The expert of each permuted row; padding / sentinel rows read expert E-1's bias
    (their GEMM rows are zero and their weight is 0, so they contribute nothing)."""
    ids_flat = ids_TK.reshape(-1)
    return ids_flat.index_select(0, row_to_slot.clamp(min=0)).clamp(max=num_experts - 1)


def experts_forward(
    self: Any,
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    recipe: Recipe | None = None,
) -> Tensor:
    """The ``"torch_moe"`` experts implementation: ``[T, D], [T, K], [T, K] -> [T, D]``.

    ``recipe`` (the ``"torch_moe_<recipe>"`` implementations) overrides the module's own
    ``_torch_moe_recipe`` attribute (set by ``set_precision``).
    """
    layout = experts_layout(self)
    if recipe is None:
        recipe = getattr(self, RECIPE_ATTR, None)
    if hidden_states.dim() != 2 or top_k_index.dim() != 2:
        raise ValueError(
            "torch_moe experts backend: expected hidden_states [T, D] and top_k_index [T, K], "
            f"got {list(hidden_states.shape)} and {list(top_k_index.shape)}"
        )
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"torch_moe experts backend: top_k_weights {list(top_k_weights.shape)} must have "
            f"top_k_index's shape {list(top_k_index.shape)}"
        )
    num_experts = int(self.num_experts)
    w_up = getattr(self, layout.up_name)
    w_down = self.down_proj
    dt = _compute_dtype(hidden_states, w_up)
    # [E, in, out] views: grouped_mm takes any strides
    up_EDN = (w_up if layout.is_transposed else w_up.transpose(-2, -1)).to(dt)
    down_EFD = (w_down if layout.is_transposed else w_down.transpose(-2, -1)).to(dt)

    sentinel = bool(getattr(self, "_is_expert_parallel", False))
    ids_TK = top_k_index.clamp(max=num_experts) if sentinel else top_k_index
    groups = num_experts + 1 if sentinel else num_experts
    align = _SCALED_GROUP_ALIGN if recipe is not None and hidden_states.is_cuda else 1
    x_TD = hidden_states.to(dt)
    if layout.fused and recipe is None and not sentinel:
        # traced on CPU without a gradient: the step as one op, which takes the eager
        # step's path when the graph runs (the one native call at a few tokens)
        w13, w2 = up_EDN.transpose(-2, -1), down_EFD.transpose(-2, -1)
        routed = (x_TD, w13, w2, ids_TK, top_k_weights)
        if traced_routed_step(routed):
            return routed_swiglu(*routed).to(hidden_states.dtype)
    perm = ops.permute_indices(ids_TK, groups, align=align)
    offs = perm.offs[:num_experts] if sentinel else perm.offs
    weights_TK = top_k_weights
    if sentinel:
        weights_TK = torch.where(ids_TK < num_experts, weights_TK, 0)

    # the routing weight of every permuted row (0 for padding rows)
    w_flat = weights_TK.reshape(-1)
    if align == 1:
        rw_M = w_flat.index_select(0, perm.row_to_slot)
    else:
        rw_M = w_flat.index_select(0, perm.row_to_slot.clamp(min=0))
        rw_M = torch.where(perm.row_to_slot >= 0, rw_M, 0)

    if layout.fused and recipe is None:
        # the op gathers each group's rows from the tokens itself (no [M, D] permuted input),
        # then the unweighted combine (in eager on the CPU one autograd node for both)
        out = grouped_swiglu_combine(
            x_TD,
            up_EDN.transpose(-2, -1),
            down_EFD.transpose(-2, -1),
            offs,
            rw_M,
            perm.row_to_slot,
            perm.slot_to_row,
        )
        return out.to(hidden_states.dtype)

    fold = not layout.has_post_expert_norm
    if recipe is None and layout.glu is not None and fold:
        # the gate by torch_moe::glu between the two GEMMs, the weight folded in; in eager
        # on the CPU the four ops (and the up bias) as one autograd node
        row_expert_M = up_bias = None
        if layout.has_bias:
            row_expert_M = _row_experts(ids_TK, perm.row_to_slot, num_experts)
            up_bias = getattr(self, f"{layout.up_name}_bias").to(dt)
        out = _glu.grouped_glu_combine(
            x_TD, up_EDN, down_EFD, offs, rw_M, perm.row_to_slot, perm.slot_to_row,
            *layout.glu, up_bias=up_bias, bias_rows=row_expert_M,
        )  # fmt: skip
        if layout.has_bias:
            bias = _ExpertBiasCombine.apply(self.down_proj_bias, ids_TK, weights_TK)
            out = (out.to(bias.dtype) + bias).to(dt)
        return out.to(hidden_states.dtype)

    if recipe is None:  # the rows gathered inside the GEMM: no [M, D] permuted input saved
        maps = (perm.row_to_slot, perm.slot_to_row)
        h_MN = _gmm.gather_grouped_mm(x_TD, up_EDN, offs, *maps)
    else:
        x_perm = _perm.permute(x_TD, perm.row_to_slot, perm.slot_to_row)
        h_MN = _gemm(x_perm, up_EDN, offs, recipe)
    row_expert_M = None
    if layout.has_bias:
        row_expert_M = _row_experts(ids_TK, perm.row_to_slot, num_experts)
        up_bias = getattr(self, f"{layout.up_name}_bias").to(dt)
        h_MN = h_MN + up_bias.index_select(0, row_expert_M)
    # the weight goes after a nonlinear post-expert norm, otherwise into the activation
    if layout.glu is not None:  # saves h (and the weights) and recomputes in its backward
        activation, alpha, limit, interleaved = layout.glu
        rw_glu = rw_M if fold else None
        a_MF = _glu.glu(h_MN, rw_glu, activation, alpha, limit, interleaved)
    else:
        rw_act = rw_M if fold else torch.ones_like(rw_M)
        if torch.is_grad_enabled() and (h_MN.requires_grad or rw_act.requires_grad):
            a_MF = checkpoint(
                _gate_times_weight, self, layout.has_gate, h_MN, rw_act, use_reentrant=False
            )
        else:
            a_MF = _gate_times_weight(self, layout.has_gate, h_MN, rw_act)
    y_MD = _gemm(a_MF.to(dt), down_EFD, offs, recipe)
    if fold:
        out = ops.unpermute(y_MD, None, perm)
        if layout.has_bias:
            bias = _ExpertBiasCombine.apply(self.down_proj_bias, ids_TK, weights_TK)
            out = (out.to(bias.dtype) + bias).to(dt)
        return out.to(hidden_states.dtype)
    if layout.has_bias and row_expert_M is not None:
        y_MD = y_MD + self.down_proj_bias.to(dt).index_select(0, row_expert_M)
    y_MD = self.post_expert_norm(y_MD)
    out = ops.unpermute(y_MD, weights_TK, perm)
    return out.to(hidden_states.dtype)
