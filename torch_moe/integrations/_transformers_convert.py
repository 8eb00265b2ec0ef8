"""``to_torch_moe`` / ``from_torch_moe``: HF sparse-MoE blocks <-> ``torch_moe.nn.MoE``.

Legend: D model dim, F expert hidden dim, Fs shared-expert hidden dim, E experts, K top-k.

Design
------
``to_torch_moe(model)`` swaps every supported HF sparse-MoE block for a
:class:`TorchMoEBlock`, whose ``moe`` is a :class:`torch_moe.nn.MoE` computing the same
function: the block's router (softmax / sigmoid, top-k renormalization, scaling, expert
groups and a selection bias such as DeepSeek-V3's ``e_score_correction_bias`` as
``router.expert_bias``), its routed SwiGLU experts and its shared expert(s) and their
sigmoid gate. The router weight and the routed experts' ``gate_up_proj`` [E, 2F, D] /
``down_proj`` [E, D, F] are the very same ``Parameter`` objects in the MoE (an optimizer
built before the conversion keeps them; experts stored transposed, ``is_transposed`` as
Aria's [E, D, 2F] / [E, F, D], become new ``Parameter`` objects viewing the same storage
in ``MoE``'s layout: build the optimizer after converting those); the shared expert's ``gate_proj`` / ``up_proj``
[Fs, D] are concatenated into ``shared_experts.w13`` [2Fs, D] (a copy); a correction bias
stored in another dtype is kept in fp32 (exact for bf16/fp16). ``from_torch_moe`` rebuilds
the HF blocks from the block class and config recorded at conversion (built on the meta
device, then the tensors assigned), so ``from_torch_moe(to_torch_moe(m))`` has a bitwise
identical state dict and the same forward.

What is supported is an explicit list, each entry checked against the original by
``benchmarks/hf_coverage.py`` (whole tiny models) and test_hf_integration (one block per
rule: output and every gradient): a block class whose forward is one of three patterns
(routed experts only; plus a sigmoid-gated shared expert, Qwen2-MoE; plus an ungated
shared expert, DeepSeek-V3), optionally followed by a norm of the output (A.X-K1: the HF
norm module kept in the converted block), a router class whose routing ``torch_moe.ops.topk_route``
reproduces (``_routing``: softmax over all experts, over the top-k logits, or sigmoid;
renormalized or not; scaled by the router or by the block; expert groups; a selection
bias on the router, on the block or in Ernie's ``moe_statics``, added to the scores or
(Kolibri: ``score_func="sigmoid_topk"``) to the logits; GPT-OSS's linear router
with a bias, ``router_bias=True``), and a gated experts module without a post-expert norm
whose activation is transformers' default SiLU gate on [gate; up] halves or GPT-OSS's
swigluoai (``activation="swigluoai"`` with the module's ``alpha`` / ``limit`` as
``swiglu_alpha`` / ``swiglu_limit``; its interleaved gate / up columns as
``gate_up_interleaved=True``), a clamped SwiGLU (HY-V4: ``swiglu_limit``) or
Beam's SwiGLU in fp32 (``MoE``'s own numerics), or an ungated one with a squared ReLU
(Nemotron-H's ``up_proj`` [E, F, D], ``activation="relu2"``; its shared ``up_proj`` /
``down_proj`` MLP likewise, sharing the ``up_proj`` Parameter), with or without
biases (``has_bias``: ``experts_bias=True``, the very ``gate_up_proj_bias`` /
``down_proj_bias`` Parameters), stored either way round. GPT-OSS's block returns
``(hidden_states, router_scores)``; the converted block returns ``(hidden_states, None)``
(its decoder layer discards the scores). Where each family keeps these tensors (``gate.weight``,
``router.gate.weight``, ``gate.wg.weight``; ``shared_experts``, ``shared_expert``,
``shared_mlp``) is recorded per converted block (``_HFKeys``) for ``from_torch_moe``.
Anything else raises ``NotImplementedError`` naming the block, router, flag or the part of
the block's function ``MoE`` does not compute, before any block is replaced.

NB (precision): ``MoE`` routes in fp32 (logits, scores, bias). Several HF routers compute
in the model dtype instead (Mixtral, Jamba, Granite, LFM2, MiniMax-M2: ``F.linear`` on bf16
weights, LFM2's sigmoid and bias in bf16), so a bf16 model converted can choose other
experts where the bf16 scores tie or round across each other (a tiny random LFM2 in bf16:
1 token in 8; the fp32 models are equal, which is what the tests compare). The converted
routing is the more precise one.

The converted block records its HF block class and the MoE config in its ``_extra_state``;
loading a state dict whose ``_extra_state`` names another block class or config is refused
with an error that names the key (the usual missing / unexpected key errors cover the rest).
Converted models do not produce transformers' ``router_logits`` outputs: use the MoE's own
``aux_loss=`` / ``z_loss_coeff=`` options (``to_torch_moe(model, aux_loss="switch",
aux_loss_coeff=...)``) instead of ``output_router_logits``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import Tensor, nn

from torch_moe._ops.glu import gated
from torch_moe.integrations._transformers_experts import (
    RECIPE_ATTR,
    experts_layout,
    gate_constants,
)
from torch_moe.nn import MoE
from torch_moe.quantization import RECIPES, Recipe

__all__ = [
    "SUPPORTED_BLOCKS",
    "TorchMoEBlock",
    "from_torch_moe",
    "to_torch_moe",
    "torch_moe_blocks",
]

# router classes by routing rule (identical forward code within each set); see _routing
_SOFTMAX_ALWAYS_NORM = frozenset(
    {
        "MixtralTopKRouter",
        "MiniMaxTopKRouter",
        "Qwen3VLMoeTextTopKRouter",
        "Qwen3_5MoeTopKRouter",
        "Qwen3OmniMoeTextTopKRouter",
        "HunYuanMoEV1Gate",  # its weight is gate.wg.weight
    }
)
_SOFTMAX_NORM_FLAG = frozenset(
    {
        "Qwen2MoeTopKRouter",
        "Qwen3MoeTopKRouter",
        "OlmoeTopKRouter",
        "FlexOlmoTopKRouter",
        "MellumTopKRouter",
        "Qwen3NextTopKRouter",
        "Qwen3OmniMoeThinkerTextTopKRouter",
        "Qwen3OmniMoeTalkerTextTopKRouter",
        "Qwen4ExpTextTopKRouter",
    }
)
_SOFTMAX_NO_NORM = frozenset({"JambaTopKRouter"})
# DeepSeek-V2: softmax, top-k, times routed_scaling_factor; "greedy" over all experts or
# "group_limited_greedy" (groups scored by their best expert, masked to 0: as -inf here)
_SOFTMAX_DSV2 = frozenset(
    {"DeepseekV2TopkRouter", "DeepseekOcr2TextTopkRouter", "UnlimitedOcrTextTopkRouter"}
)
# softmax, DeepSeek-V3's groups (masked to 0, which picks what -inf picks: scores > 0)
_SOFTMAX_GROUPED = frozenset({"Mistral4TopkRouter", "MistralLarge4TextTopkRouter"})
# softmax over the top-k logits
_SOFTMAX_TOPK = frozenset(
    {
        "GraniteMoeTopKRouter",
        "GraniteMoeSWATopKRouter",
        "GraniteMoeHybridTopKRouter",
        "GraniteMoeSharedTopKRouter",
        "AriaTextTopKRouter",
    }
)
# sigmoid + e_score_correction_bias, DeepSeek-V3's groups, norm flag, routed_scaling_factor
_SIGMOID_GROUPED = frozenset(
    {
        "DeepseekV3TopkRouter",
        "AXK1TopkRouter",
        "AXK2TopkRouter",
        "BailingHybridTopkRouter",
        "Dots1TopkRouter",
        "ExaoneMoeTopkRouter",
        "Glm5NextTextTopkRouter",
        "KimiLinearTopkRouter",
        "MiMoV2FlashTopkRouter",
        "Glm4MoeTopkRouter",
        "Glm4MoeLiteTopkRouter",
        "Glm4vMoeTextTopkRouter",
        "GlmMoeDsaTopkRouter",
        "DeepseekV32TopkRouter",
        "Dots3NoteTextTopkRouter",
        "HYV4TopkRouter",
        "NemotronHTopkRouter",
        "SolarOpenTopkRouter",
    }
)

# block classes by forward pattern
_ROUTED_ONLY = (
    "MixtralSparseMoeBlock",
    "MiniMaxSparseMoeBlock",
    "Qwen3MoeSparseMoeBlock",
    "Qwen3VLMoeTextSparseMoeBlock",
    "Qwen3OmniMoeThinkerTextSparseMoeBlock",
    "MellumSparseMoeBlock",
    "OlmoeSparseMoeBlock",
    "FlexOlmoSparseMoeBlock",
    "Cohere2MoeSparseMoeBlock",  # with num_shared_experts=0 (see _shared_mlp)
    "GraniteMoeMoE",
    "GraniteMoeSWAMoE",
    "GraniteMoeHybridMoE",
    "GraniteMoeSharedMoE",  # its shared MLP sits outside the block
    "JambaSparseMoeBlock",
    "MiMoV2FlashMoE",
    "MiniMaxM2SparseMoeBlock",
    "Lfm2MoeSparseMoeBlock",
    "GptOssMLP",  # returns (hidden_states, router_scores): _TUPLE_OUTPUT
    "OpenAIPrivacyFilterMLP",  # the same; its scores / K and output * K cancel
    "BeamMoE",  # the block scales the routed output: route_scale
)
# blocks whose forward returns (hidden_states, router_scores); the converted block returns
# (hidden_states, None): their decoder layers discard the second element
_TUPLE_OUTPUT = frozenset({"GptOssMLP", "OpenAIPrivacyFilterMLP"})
_GATED_SHARED = (  # + sigmoid(shared_expert_gate(x)) * shared_expert(x)
    "Qwen2MoeSparseMoeBlock",
    "Qwen3_5MoeSparseMoeBlock",
    "Qwen3NextSparseMoeBlock",
    "Qwen4ExpTextSparseMoeBlock",
)
_SHARED = (  # + shared_experts(x) (another attribute name: _SHARED_ATTR)
    "AriaTextMoELayer",  # experts stored transposed
    "DeepseekV3MoE",
    "DeepseekV32MoE",
    "DeepseekV2Moe",
    "DeepseekOcr2TextMoe",
    "UnlimitedOcrTextMoe",
    "AXK1MoE",  # normalizes its output: _POST_NORM
    "AXK2MoE",
    "AfmoeSparseMoeBlock",
    "BailingHybridMoE",
    "Dots1MoE",
    "Ernie4_5_MoeSparseMoeBlock",  # shared_experts may be None: then routed only
    "ExaoneMoeSparseMoEBlock",
    "FlintSparseMoeBlock",
    "Glm4MoeMoE",
    "Glm4MoeLiteMoE",
    "Glm4vMoeTextMoE",
    "Glm5NextTextMoE",
    "GlmMoeDsaMoE",
    "HunYuanMoEV1Moe",
    "HYV3MoE",
    "HYV4MoE",
    "KimiLinearMoE",
    "Kolibri1SparseMoeBlock",  # the selection bias on the logits: "sigmoid_topk"
    "LagunaSparseMoeBlock",
    "MiniMaxM3VLSparseMoeBlock",  # scales the routed output: route_scale
    "Mistral4MoE",
    "MistralLarge4TextMoE",
    "NemotronHMoE",  # ungated relu2 experts and shared MLP; no latent projection
    "SolarOpenMoE",
)
_SHARED_ATTR = {
    "FlintSparseMoeBlock": "shared_expert",
    "HunYuanMoEV1Moe": "shared_mlp",
    "Qwen2MoeSparseMoeBlock": "shared_expert",
    "Qwen3_5MoeSparseMoeBlock": "shared_expert",
    "Qwen3NextSparseMoeBlock": "shared_expert",
    "Qwen4ExpTextSparseMoeBlock": "shared_expert",
}
# blocks that normalize their output: the norm module's attribute. The converted block
# keeps that HF module (the same Parameters) and applies it to the MoE's output.
_POST_NORM = {"AXK1MoE": "post_mlp_layernorm"}
# sparse-MoE blocks whose function torch_moe.nn.MoE does not compute, and why
_UNSUPPORTED_BLOCKS = {
    "PhimoeSparseMoeBlock": "routes with sparsemixer",
    "ZayaSparseMoeBlock": "routes with an MLP and a skip expert",
    "InklingMoE": "weights its shared experts by router scores",
}
SUPPORTED_BLOCKS: dict[str, str] = {
    **dict.fromkeys(_ROUTED_ONLY, "routed"),
    **dict.fromkeys(_GATED_SHARED, "gated_shared"),
    **dict.fromkeys(_SHARED, "shared"),
}
_MOE_OPTIONS = ("precision", "aux_loss", "aux_loss_coeff", "z_loss_coeff", "expert_bias")
_CONFIG_DEFAULTS = {
    "group_score": "top2_sum",
    "route_norm_eps": 1e-20,
    "activation": "swiglu",
    "swiglu_alpha": 1.702,
    "swiglu_limit": None,
    "experts_bias": False,
    "gate_up_interleaved": False,
    "shared_activation": "swiglu",
    "shared_swiglu_limit": None,
}  # MoE arguments added after the first release


@dataclasses.dataclass(frozen=True)
class _HFKeys:
    """Where an HF block keeps what the MoE shares with it (keys relative to the block)."""

    router_weight: str  # "gate.weight", "router.gate.weight", "gate.wg.weight", ...
    expert_bias: str | None = None  # the selection bias, if any
    bias_shape: tuple[int, ...] = ()  # its HF shape and dtype (the MoE holds [E] fp32)
    bias_dtype: torch.dtype | None = None
    shared: str | None = None  # the shared SwiGLU MLP's attribute
    shared_gate: str | None = None  # its sigmoid gate's weight
    layer_idx: int | None = None  # for block classes built as cls(config, layer_idx=...)
    transposed: bool = False  # experts stored [E, D, 2F] / [E, F, D] (``is_transposed``)
    router_bias: str | None = None  # the router linear's bias (GPT-OSS: "router.bias")
    tuple_output: bool = False  # the block returns (hidden_states, router_scores)
    shared_fused: bool = False  # the shared MLP's gate and up are one gate_up_proj Linear
    post_norm: str | None = None  # the norm of the block's output (A.X-K1), kept as is


def _is_experts(module: nn.Module) -> bool:
    return hasattr(module, "has_gate") and hasattr(module, "down_proj")


# shared MLP classes whose own forward MoE's shared expert computes: (activation, the
# attribute holding swiglu_alpha (swigluoai only), the one holding swiglu_limit)
_SHARED_GATES: dict[str, tuple[str, str | None, str]] = {
    "Glm5NextTextMLP": ("swiglu", None, "swiglu_limit"),  # clamps, then SiLU
    "MiniMaxM3VLDenseMLP": ("swigluoai", "swiglu_alpha", "swiglu_limit"),  # gate_up_proj
}


def _shared_mlp_plan(mlp: Any, where: str, cfg: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(``MoE``'s shared-expert arguments, whether gate and up are one ``gate_up_proj``
    Linear) for a shared MLP: a bias-free SiLU gate_proj / up_proj / down_proj MLP, one of
    ``_SHARED_GATES``, or an ungated up_proj / down_proj MLP with a squared ReLU (relu2);
    raises naming what ``SharedExperts`` does not compute."""
    from torch_moe.integrations._transformers_experts import _is_silu

    name = type(mlp).__name__
    fused = isinstance(getattr(mlp, "gate_up_proj", None), nn.Linear)
    ungated = not fused and getattr(mlp, "gate_proj", None) is None
    parts = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
    parts = ("up_proj", "down_proj") if ungated else parts
    lins = [getattr(mlp, n, None) for n in parts]
    if not all(isinstance(lin, nn.Linear) and lin.bias is None for lin in lins):
        raise NotImplementedError(
            f"to_torch_moe: {where} ({name}) is not a bias-free gate_proj / up_proj (or "
            "gate_up_proj) / down_proj gated MLP, nor an up_proj / down_proj relu2 MLP"
        )
    if ungated:
        act = type(getattr(mlp, "act_fn", None)).__name__
        if act != "ReLUSquaredActivation":
            raise NotImplementedError(
                f"to_torch_moe: {where} ({name}) is ungated with act_fn {act}; torch_moe's "
                "ungated shared expert computes relu(x) ** 2 only"
            )
        return dict(shared_activation="relu2"), False
    known = _SHARED_GATES.get(name)
    if known is not None:
        activation, alpha_attr, limit_attr = known
        alpha, limit = gate_constants(mlp, alpha_attr, limit_attr)
        out: dict[str, Any] = dict(shared_activation=activation)
        if limit is not None:
            out.update(shared_swiglu_limit=limit)
        if alpha is not None:  # MoE has one swiglu_alpha: the routed experts' must agree
            if cfg.get("activation") == "swigluoai" and cfg.get("swiglu_alpha") != alpha:
                raise NotImplementedError(
                    f"to_torch_moe: {where} ({name}) has swiglu_alpha={alpha}, the routed "
                    f"experts {cfg.get('swiglu_alpha')}; torch_moe.nn.MoE has one"
                )
            cfg.setdefault("swiglu_alpha", alpha)
        return out, fused
    clamp = getattr(mlp, "swiglu_limit", None)
    if clamp is not None or fused:  # a forward this converter does not know
        raise NotImplementedError(
            f"to_torch_moe: {where} ({name}) has its own gated forward (swiglu_limit={clamp}, "
            f"gate_up_proj={fused}); torch_moe's shared expert computes SiLU(gate) * up, "
            "clamped or swigluoai only for the MLP classes it knows"
        )
    if not _is_silu(getattr(mlp, "act_fn", None)):
        raise NotImplementedError(
            f"to_torch_moe: {where} ({name}) has act_fn "
            f"{type(getattr(mlp, 'act_fn', None)).__name__}; torch_moe's shared expert is SiLU"
        )
    return {}, False


def _router_of(block: Any) -> tuple[str, Any]:
    """The block's router module and its attribute ("gate", or "router" as in Granite)."""
    for attr in ("gate", "router"):
        module = getattr(block, attr, None)
        if isinstance(module, nn.Module):
            return attr, module
    raise NotImplementedError(f"to_torch_moe: {type(block).__name__} has no gate / router module")


def _linear_weight(owner: str, lin: Any, where: str) -> str:
    """The key of a router held as a bias-free ``nn.Linear`` (``owner.<lin>``)."""
    if not isinstance(lin, nn.Linear) or lin.bias is not None:
        raise NotImplementedError(f"to_torch_moe: {where} is not a bias-free nn.Linear")
    return owner + ".weight"


def _groups(gate: Any) -> dict[str, Any]:
    groups = int(getattr(gate, "num_group", None) or 1)
    return dict(
        num_expert_groups=groups if groups > 1 else None,
        num_limited_groups=int(gate.topk_group) if groups > 1 else None,
    )


def _routing(block: Any, attr: str, gate: Any) -> tuple[dict[str, Any], str, str | None]:
    """(``MoE`` routing arguments, router weight key, selection bias key) reproducing the
    block's router; raises naming the router if ``topk_route`` cannot.

    Renormalizations that divide by the plain sum, or clamp it at 1e-12, equal
    ``route_norm``'s default (sum + 1e-20) for every sum above 1e-12 (K sigmoid or softmax
    scores); LFM2's (sum + 1e-6) is ``route_norm_eps=1e-6``.
    """
    name, rname = type(block).__name__, type(gate).__name__
    weight, bias = f"{attr}.weight", None
    if rname in _SOFTMAX_ALWAYS_NORM | _SOFTMAX_NORM_FLAG | _SOFTMAX_NO_NORM:
        norm = rname in _SOFTMAX_ALWAYS_NORM or (
            rname in _SOFTMAX_NORM_FLAG and bool(gate.norm_topk_prob)
        )
        cfg: dict[str, Any] = dict(score_func="softmax", route_norm=norm)
        if rname == "HunYuanMoEV1Gate":
            weight = _linear_weight(f"{attr}.wg", gate.wg, f"{name}.{attr}.wg")
    elif rname in _SOFTMAX_DSV2:
        cfg = dict(score_func="softmax", route_scale=float(gate.routed_scaling_factor))
        if gate.topk_method == "group_limited_greedy":
            cfg.update(group_score="max", **_groups(gate))
        elif gate.topk_method != "greedy":
            raise NotImplementedError(
                f"to_torch_moe: {name}.{attr} ({rname}) has topk_method={gate.topk_method!r}"
            )
    elif rname in _SOFTMAX_GROUPED:
        norm = rname == "MistralLarge4TextTopkRouter" or bool(gate.norm_topk_prob)
        cfg = dict(score_func="softmax", route_norm=norm, **_groups(gate))
        cfg.update(route_scale=float(gate.routed_scaling_factor))
    elif rname == "Ernie4_5_MoeTopKRouter":  # softmax + bias for the choice, clamped norm
        cfg = dict(score_func="softmax", route_norm=True, expert_bias=True)
        bias = f"{attr}.moe_statics.e_score_correction_bias"
    elif rname in _SOFTMAX_TOPK:
        cfg = dict(score_func="softmax_topk")
    elif rname == "Cohere2MoeTopKRouter":  # top-k logits, then softmax or sigmoid of them
        if gate.expert_selection_fn == "softmax":
            cfg = dict(score_func="softmax_topk")
        else:  # sigmoid is monotone: the top-k logits are the top-k sigmoid scores
            cfg = dict(score_func="sigmoid", route_norm=bool(gate.norm_topk_prob))
    elif rname in _SIGMOID_GROUPED or rname == "BeamTopKRouter":
        # Beam's block, not its router, scales the routed output: the same factor
        scaler = block if rname == "BeamTopKRouter" else gate
        cfg = dict(
            score_func="sigmoid",
            route_norm=bool(gate.norm_topk_prob),
            route_scale=float(scaler.routed_scaling_factor),
            expert_bias=True,
            **_groups(gate),
        )
        bias = f"{attr}.e_score_correction_bias"
    elif rname == "Kolibri1TopKRouter":  # top-k on logits + bias, sigmoid of the chosen
        cfg = dict(score_func="sigmoid_topk", route_norm=bool(gate.norm_topk_prob))
        cfg.update(expert_bias=True)
        bias = f"{attr}.e_score_correction_bias"
    elif rname == "FlintTopKRouter":  # sigmoid, no selection bias
        cfg = dict(score_func="sigmoid", route_norm=bool(gate.norm_topk_prob))
    elif rname == "MiniMaxM3VLTopKRouter":  # M2's rule, the bias on the router, the
        # block scaling the routed output
        cfg = dict(score_func="sigmoid", route_norm=True, expert_bias=True)
        cfg.update(route_scale=float(block.routed_scaling_factor))
        bias = f"{attr}.e_score_correction_bias"
    elif rname in ("MiniMaxM2TopKRouter", "HYV3TopKRouter"):  # the bias on the block
        scale = float(getattr(gate, "router_scaling_factor", 1.0))
        cfg = dict(score_func="sigmoid", route_norm=True, route_scale=scale, expert_bias=True)
        bias = "e_score_correction_bias"
    elif rname == "LagunaTopKRouter":  # the block scales the routed output instead
        if gate.router_logit_softcapping > 0:
            raise NotImplementedError(
                f"to_torch_moe: {name}.{attr} ({rname}) has router_logit_softcapping="
                f"{gate.router_logit_softcapping}; torch_moe's router has no softcapping"
            )
        cfg = dict(score_func="sigmoid", route_norm=True, expert_bias=True)
        cfg.update(route_scale=float(block.routed_scaling_factor))
        bias = f"{attr}.e_score_correction_bias"
    elif rname == "Lfm2MoeTopKRouter":  # the bias on the block, if used; norm + 1e-6
        cfg = dict(score_func="sigmoid", route_scale=float(gate.routed_scaling_factor))
        if gate.norm_topk_prob:
            cfg.update(route_norm=True, route_norm_eps=1e-6)
        if gate.use_expert_bias:
            cfg.update(expert_bias=True)
            bias = "expert_bias"
    elif rname in ("GptOssTopKRouter", "OpenAIPrivacyFilterTopKRouter"):
        # a linear router with a bias, softmax over the top-k logits (the privacy filter
        # divides the scores by K and its block multiplies the output by K: they cancel,
        # exactly for K a power of two, to fp32 rounding otherwise)
        cfg = dict(score_func="softmax_topk", router_bias=True)
    elif rname == "AfmoeTokenChoiceRouter":  # router.gate linear, the bias on the block
        weight = _linear_weight(f"{attr}.gate", gate.gate, f"{name}.{attr}.gate")
        cfg = dict(score_func="sigmoid", route_norm=True, route_scale=float(gate.route_scale))
        cfg.update(expert_bias=True)
        bias = "expert_bias"
    else:
        raise NotImplementedError(f"to_torch_moe: {name}.{attr} is an unsupported router {rname}")
    if getattr(gate, "bias", None) is not None and not cfg.get("router_bias"):
        raise NotImplementedError(f"to_torch_moe: {name}.{attr} ({rname}) has a bias")
    return cfg, weight, bias


def _shared_mlp(block: Any, kind: str) -> tuple[str | None, Any]:
    """(attribute, module) of the block's shared SwiGLU MLP, (None, None) without one."""
    name = type(block).__name__
    if name == "Cohere2MoeSparseMoeBlock" and block.num_shared_experts > 0:
        if block.shared_expert_combination_strategy != "sum":
            raise NotImplementedError(
                f"to_torch_moe: {name} has shared_expert_combination_strategy="
                f"{block.shared_expert_combination_strategy!r}; torch_moe adds its shared "
                "expert ('sum')"
            )
        return "shared_experts", block.shared_experts
    if kind == "routed":
        return None, None
    attr = _SHARED_ATTR.get(name, "shared_experts")
    mlp = getattr(block, attr, None)
    return (attr, mlp) if mlp is not None else (None, None)


def _plan(block: Any) -> tuple[dict[str, Any], _HFKeys]:
    """The ``MoE`` constructor arguments reproducing ``block`` and where the block keeps
    the shared tensors; raises if unsupported."""
    name = type(block).__name__
    experts = getattr(block, "experts", None)
    transposed = experts_bias = False
    activation: dict[str, Any] = {}
    if experts is not None and _is_experts(experts):
        layout = experts_layout(experts)
        transposed, experts_bias = bool(layout.is_transposed), bool(layout.has_bias)
        if layout.has_post_expert_norm:
            raise NotImplementedError(
                f"to_torch_moe: {name}.experts ({type(experts).__name__}) has "
                "has_post_expert_norm=True; torch_moe.nn.MoE has no norm after its experts. "
                "Use the 'torch_moe' experts implementation for this model instead"
            )
        activation = _activation(experts, layout, name)
    for proj in ("fc1_latent_proj", "fc2_latent_proj"):  # Nemotron-H's moe_latent_size
        if not isinstance(getattr(block, proj, None), (nn.Identity, type(None))):
            raise NotImplementedError(
                f"to_torch_moe: {name}.{proj} projects the experts' input / output to a latent "
                "size (moe_latent_size); torch_moe.nn.MoE runs its experts at the model dim"
            )
    kind = SUPPORTED_BLOCKS.get(name)
    if name in _UNSUPPORTED_BLOCKS:
        raise NotImplementedError(
            f"to_torch_moe: {name} {_UNSUPPORTED_BLOCKS[name]}, which torch_moe.nn.MoE does not. "
            "The 'torch_moe' experts implementation runs its experts without conversion"
        )
    if kind is None or experts is None:
        raise NotImplementedError(
            f"to_torch_moe: {name} is not a supported sparse-MoE block; supported: "
            f"{sorted(SUPPORTED_BLOCKS)}. The 'torch_moe' experts implementation runs any "
            "transformers MoE model's experts without conversion"
        )
    attr, gate = _router_of(block)
    routing, weight_key, bias_key = _routing(block, attr, gate)
    num_experts, dim, hidden = experts.down_proj.shape
    if transposed:  # [E, F, D]
        dim, hidden = hidden, dim
    cfg: dict[str, Any] = dict(
        dim=dim,
        hidden_dim=hidden,
        num_experts=num_experts,
        top_k=int(gate.top_k),
        **routing,
        **activation,
    )
    if experts_bias:
        cfg.update(experts_bias=True)
    jitter = float(getattr(block, "jitter_noise", 0.0) or 0.0)
    jitter = jitter or float(getattr(block, "input_jitter_noise", 0.0) or 0.0)
    if jitter > 0:
        raise NotImplementedError(
            f"to_torch_moe: {name} has router_jitter_noise={jitter}; torch_moe's router has no "
            "input jitter"
        )
    bias_shape: tuple[int, ...] = ()
    bias_dtype: torch.dtype | None = None
    if bias_key is not None:
        bias = _tensor(block, bias_key)
        if bias.numel() != num_experts:
            raise NotImplementedError(
                f"to_torch_moe: {name}.{bias_key} has shape {list(bias.shape)}, not [{num_experts}]"
            )
        bias_shape, bias_dtype = tuple(bias.shape), bias.dtype
    shared_attr, mlp = _shared_mlp(block, kind)
    shared_gate = None
    shared_fused = False
    if mlp is not None:
        shared_cfg, shared_fused = _shared_mlp_plan(mlp, f"{name}.{shared_attr}", cfg)
        cfg.update(shared_hidden_dim=mlp.down_proj.in_features, **shared_cfg)
        if kind == "gated_shared":
            cfg.update(shared_gate=True)
            shared_gate = "shared_expert_gate.weight"
    layer_idx = None
    if "layer_idx" in inspect.signature(type(block).__init__).parameters:
        layer_idx = getattr(block, "layer_idx", getattr(gate, "layer_idx", None))
    keys = _HFKeys(
        weight_key,
        bias_key,
        bias_shape,
        bias_dtype,
        shared_attr,
        shared_gate,
        layer_idx,
        transposed,
        router_bias=f"{attr}.bias" if routing.get("router_bias") else None,
        tuple_output=name in _TUPLE_OUTPUT,
        shared_fused=shared_fused,
        post_norm=_POST_NORM.get(name),
    )
    return cfg, keys


def _activation(experts: Any, layout: Any, name: str) -> dict[str, Any]:
    """``MoE``'s activation arguments for the experts' gate, the one the experts backend
    runs by ``torch_moe::glu`` (``layout.glu``): transformers' default (``act_fn(gate) *
    up`` on the halves) with SiLU, one of ``OWN_GATES`` (clamped SwiGLU, GPT-OSS's
    swigluoai), or ungated experts with a squared ReLU (relu2); raises naming the experts
    class for any other."""
    cls = type(experts)
    if layout.glu is None and not layout.has_gate:
        act = type(getattr(experts, "act_fn", None)).__name__
        raise NotImplementedError(
            f"to_torch_moe: {name}.experts ({cls.__name__}) has has_gate=False and act_fn "
            f"{act}; torch_moe.nn.MoE's ungated experts compute relu(x) ** 2 only. Use the "
            "'torch_moe' experts implementation instead"
        )
    if layout.glu is None:
        raise NotImplementedError(
            f"to_torch_moe: {name}.experts ({cls.__name__}) has a custom activation "
            "(_apply_gate / act_fn other than SiLU(gate) * up, a clamped SwiGLU or GPT-OSS's "
            "swigluoai); torch_moe.nn.MoE does not compute it. Use the 'torch_moe' experts "
            "implementation instead"
        )
    activation, alpha, limit, interleaved = layout.glu
    if activation == "relu2":  # Nemotron-H
        return dict(activation="relu2")
    if layout.default_gate:
        return {}  # SwiGLU on [gate; up] (the default gate splits halves whatever the flag)
    out: dict[str, Any] = dict(activation=activation, gate_up_interleaved=interleaved)
    if activation == "swigluoai":
        out.update(swiglu_alpha=alpha)
    if limit is not None:
        out.update(swiglu_limit=limit)
    return out


def _transposed(p: Tensor) -> nn.Parameter:
    """An expert weight [E, a, b] as a new ``Parameter`` [E, b, a] viewing its storage."""
    return nn.Parameter(p.detach().transpose(1, 2), requires_grad=p.requires_grad)


def _tensor(module: nn.Module, key: str) -> Tensor:
    """``module``'s parameter or buffer at the dotted ``key``."""
    owner, _, leaf = key.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, leaf)


class TorchMoEBlock(nn.Module):
    """An HF sparse-MoE block replaced by ``torch_moe.nn.MoE`` (``self.moe``).

    ``forward(hidden_states [B, S, D]) -> [B, S, D]`` as the HF block (``([B, S, D],
    None)`` where the HF block returns its router scores too, as GPT-OSS's). A block that
    normalizes its output (A.X-K1's ``post_mlp_layernorm``) keeps that HF norm module as
    ``post_norm``, applied to the MoE's output. The HF block class and config it came from
    are kept (not in the state dict) for :func:`from_torch_moe`.
    """

    def __init__(
        self,
        moe: MoE,
        hf_block_class: type[nn.Module],
        hf_config: Any,
        hf_keys: _HFKeys,
        post_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.moe = moe
        self.post_norm = post_norm
        self.hf_block_class = hf_block_class
        self.hf_config = hf_config
        self.hf_keys = hf_keys

    @property
    def family(self) -> str:
        return self.hf_block_class.__name__

    def forward(self, hidden_states: Tensor) -> Tensor | tuple[Tensor, None]:
        out = self.moe(hidden_states)
        if self.post_norm is not None:
            out = self.post_norm(out)
        # GPT-OSS's blocks return (hidden_states, router_scores); their callers discard the
        # scores, which the MoE does not return
        return (out, None) if self.hf_keys.tuple_output else out

    def get_extra_state(self) -> dict[str, Any]:
        cfg = {k: v for k, v in self.moe.config.items() if k != "precision"}
        return {"hf_block": self.family, "moe_config": cfg}

    def set_extra_state(self, state: Any) -> None:
        pass  # checked in _load_from_state_dict, where the key is known

    def _load_from_state_dict(  # type: ignore[no-untyped-def]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        key = prefix + "_extra_state"
        if key in state_dict:
            theirs, mine = state_dict[key], self.get_extra_state()
            if not isinstance(theirs, dict) or theirs.get("hf_block") != mine["hf_block"]:
                found = theirs.get("hf_block") if isinstance(theirs, dict) else theirs
                error_msgs.append(
                    f"{key}: the checkpoint holds a torch_moe-converted {found!r} block, this "
                    f"model's block is a converted {mine['hf_block']!r}"
                )
            else:
                # a key an older checkpoint lacks holds its default (e.g. group_score)
                theirs_cfg = {**_CONFIG_DEFAULTS, **theirs.get("moe_config", {})}
                diff = {
                    k: (theirs_cfg.get(k), v)
                    for k, v in mine["moe_config"].items()
                    if theirs_cfg.get(k) != v
                }
                if diff:
                    error_msgs.append(f"{key}: MoE config mismatch (checkpoint, model): {diff}")
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        return f"from={self.family}"


def _named_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module holding an HF experts module as ``.experts``."""
    out = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.Module) and _is_experts(experts) and name:
            out.append((name, module))
    return out


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _experts_recipe(experts: Any) -> Recipe | None:
    """The low-precision recipe the "torch_moe" backend runs ``experts`` in, if any."""
    recipe = getattr(experts, RECIPE_ATTR, None)
    impl = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if isinstance(impl, str) and impl.startswith("torch_moe_") and impl[10:] in RECIPES:
        recipe = RECIPES[impl[10:]]
    return recipe


def _convert_block(
    block: Any, cfg: dict[str, Any], keys: _HFKeys, options: dict[str, Any]
) -> TorchMoEBlock:
    experts = block.experts
    recipe = _experts_recipe(experts)
    if "precision" not in options and recipe is not None:
        options = {**options, "precision": recipe}  # keep what set_precision chose
    up = "gate_up_proj" if gated(cfg.get("activation", "swiglu")) else "up_proj"
    w13, w2 = getattr(experts, up), experts.down_proj
    if keys.transposed:  # views of the same storage, as new Parameters in MoE's layout
        w13, w2 = _transposed(w13), _transposed(w2)
    device, dtype = w13.device, w13.dtype
    moe = MoE(**cfg, **options, device="meta", dtype=dtype)
    moe.router.weight = block.get_parameter(keys.router_weight)
    if keys.router_bias is not None:
        moe.router.bias = block.get_parameter(keys.router_bias)
    moe.experts.w13 = w13
    moe.experts.w2 = w2
    if moe.experts.b13 is not None:  # [E, 2F] / [E, D] either way round: shared as they are
        moe.experts.b13 = getattr(experts, f"{up}_bias")
        moe.experts.b2 = experts.down_proj_bias
    if keys.expert_bias is not None:
        bias = _tensor(block, keys.expert_bias)
        moe.router.expert_bias = bias.detach().reshape(-1).to(torch.float32)
    if keys.shared is not None:
        assert moe.shared_experts is not None
        mlp = getattr(block, keys.shared)
        if keys.shared_fused:  # [gate; up] already: the same Parameter
            moe.shared_experts.w13 = mlp.gate_up_proj.weight
        elif not gated(moe.shared_experts.activation):  # the up projection alone
            moe.shared_experts.w13 = mlp.up_proj.weight
        else:
            with torch.no_grad():
                shared_w13 = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0)
            moe.shared_experts.w13 = nn.Parameter(
                shared_w13, requires_grad=mlp.gate_proj.weight.requires_grad
            )
        moe.shared_experts.w2 = mlp.down_proj.weight
        if keys.shared_gate is not None:
            moe.shared_experts.gate = block.get_parameter(keys.shared_gate)
    # the MoE's own state (load counters, last losses) starts at zero, as in MoE.__init__
    # (test_hf_integration checks the converted buffers against a freshly built MoE)
    for bname, buf in list(moe.named_buffers()):
        if buf.is_meta:
            owner_name, _, leaf = bname.rpartition(".")
            owner = moe.get_submodule(owner_name) if owner_name else moe
            setattr(owner, leaf, torch.zeros_like(buf, device=device))
    leftover = [n for n, t in moe.named_parameters() if t.is_meta]
    if leftover:  # pragma: no cover - a new MoE parameter this converter does not know
        raise RuntimeError(f"to_torch_moe: no HF tensor for {leftover}")
    moe.train(block.training)
    post_norm = None if keys.post_norm is None else getattr(block, keys.post_norm)
    return TorchMoEBlock(moe, type(block), experts.config, keys, post_norm)


def to_torch_moe(model: nn.Module, **moe_options: Any) -> nn.Module:
    """Replace every HF sparse-MoE block of ``model`` by a :class:`TorchMoEBlock` (in place).

    ``moe_options``: ``precision``, ``aux_loss``, ``aux_loss_coeff``, ``z_loss_coeff`` of
    :class:`torch_moe.nn.MoE` (the defaults compute what the HF blocks compute; the
    precision defaults to the recipe ``set_precision`` / a ``"torch_moe_<recipe>"``
    implementation gave the experts, and ``from_torch_moe`` gives it back), and
    ``expert_bias=True``: give the routers that have no selection bias (Mixtral, Qwen, ...)
    a zero one, for aux-loss-free balancing (``MoE.update_expert_bias``); it changes no
    choice until it is updated, and ``from_torch_moe`` refuses to drop it once it is
    nonzero (the HF block could not route as the converted one does). Every block is
    checked before any is replaced; an unsupported one raises ``NotImplementedError``
    naming its class, router or layout flag. Returns ``model``.
    """
    bad = sorted(set(moe_options) - set(_MOE_OPTIONS))
    if bad:
        raise TypeError(f"to_torch_moe: unexpected option(s) {bad}; allowed: {list(_MOE_OPTIONS)}")
    configs = [getattr(model, "config", None)]
    if configs[0] is not None and hasattr(configs[0], "get_text_config"):
        configs.append(configs[0].get_text_config())
    for c in configs:
        if c is not None and getattr(c, "output_router_logits", False):
            raise NotImplementedError(
                "to_torch_moe: config.output_router_logits=True; converted blocks do not return "
                "router logits. Set it to False and pass aux_loss= / aux_loss_coeff= instead"
            )
    blocks = _named_blocks(model)
    if not blocks:
        raise ValueError(f"to_torch_moe: {type(model).__name__} has no transformers experts module")
    add_bias = bool(moe_options.pop("expert_bias", False))
    plans = [(name, block, *_plan(block)) for name, block in blocks]
    for name, block, cfg, keys in plans:
        if add_bias and not cfg.get("expert_bias"):
            cfg = {**cfg, "expert_bias": True}  # zero-initialized by _convert_block
        _set_submodule(model, name, _convert_block(block, cfg, keys, moe_options))
    return model


def torch_moe_blocks(model: nn.Module) -> list[tuple[str, TorchMoEBlock]]:
    """(name, block) of every :class:`TorchMoEBlock` in ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, TorchMoEBlock)]


def from_torch_moe(model: nn.Module) -> nn.Module:
    """Put the HF blocks back (in place); the inverse of :func:`to_torch_moe`, bitwise.

    Expert-parallel (DTensor) weights are refused: gather them first. So is a nonzero
    selection bias that ``to_torch_moe(expert_bias=True)`` added to a block whose HF class
    has none. Every block is checked before any is replaced.
    """
    blocks = torch_moe_blocks(model)
    if not blocks:
        raise ValueError(f"from_torch_moe: {type(model).__name__} has no TorchMoEBlock")
    for name, tb in blocks:
        for pname, p in tb.moe.named_parameters():
            if hasattr(p, "device_mesh"):
                raise ValueError(
                    f"from_torch_moe: {name}.moe.{pname} is a DTensor (expert parallel); "
                    "gather the full weights before converting back"
                )
        added = tb.moe.router.expert_bias if tb.hf_keys.expert_bias is None else None
        if added is not None and bool(added.any()):
            raise ValueError(
                f"from_torch_moe: {name}.moe.router.expert_bias (added by "
                f"to_torch_moe(expert_bias=True)) is nonzero, and {tb.family} has no "
                "selection bias: converting back would change its routing. Zero it first "
                "to drop it"
            )
    for name, tb in blocks:
        moe = tb.moe
        keys = tb.hf_keys
        extra = {} if keys.layer_idx is None else {"layer_idx": keys.layer_idx}
        with torch.device("meta"):
            block = tb.hf_block_class(tb.hf_config, **extra)
        w13, w2 = moe.experts.w13, moe.experts.w2
        if keys.transposed:  # back to the block's layout: views of the same storage
            w13, w2 = _transposed(w13), _transposed(w2)
        up = "gate_up_proj" if gated(moe.experts.activation) else "up_proj"
        sd: dict[str, Tensor] = {
            keys.router_weight: moe.router.weight,
            f"experts.{up}": w13,
            "experts.down_proj": w2,
        }
        if keys.router_bias is not None:
            assert moe.router.bias is not None
            sd[keys.router_bias] = moe.router.bias
        if moe.experts.b13 is not None and moe.experts.b2 is not None:
            sd[f"experts.{up}_bias"] = moe.experts.b13
            sd["experts.down_proj_bias"] = moe.experts.b2
        if keys.expert_bias is not None:
            assert moe.router.expert_bias is not None
            bias = moe.router.expert_bias.to(keys.bias_dtype).reshape(keys.bias_shape)
            sd[keys.expert_bias] = bias
        if keys.post_norm is not None and tb.post_norm is not None:
            for k, t in tb.post_norm.state_dict(keep_vars=True).items():
                sd[f"{keys.post_norm}.{k}"] = t
        shared = moe.shared_experts
        if shared is not None:
            prefix = f"{keys.shared}."
            fs = shared.w2.shape[1]
            rg = shared.w13.requires_grad
            if keys.shared_fused:
                sd[prefix + "gate_up_proj.weight"] = shared.w13
            elif not gated(shared.activation):
                sd[prefix + "up_proj.weight"] = shared.w13
            else:
                sd[prefix + "gate_proj.weight"] = nn.Parameter(shared.w13.detach()[:fs], rg)
                sd[prefix + "up_proj.weight"] = nn.Parameter(shared.w13.detach()[fs:], rg)
            sd[prefix + "down_proj.weight"] = shared.w2
            if keys.shared_gate is not None:
                assert shared.gate is not None
                sd[keys.shared_gate] = shared.gate
        block.load_state_dict(sd, strict=True, assign=True)
        if moe.experts.recipe is not None:  # the "torch_moe" backend keeps running it
            setattr(block.experts, RECIPE_ATTR, moe.experts.recipe)
        leftover = [n for n, t in [*block.named_parameters(), *block.named_buffers()] if t.is_meta]
        if leftover:
            raise RuntimeError(f"from_torch_moe: {tb.family} has tensors with no value: {leftover}")
        block.train(tb.training)
        _set_submodule(model, name, block)
    return model
