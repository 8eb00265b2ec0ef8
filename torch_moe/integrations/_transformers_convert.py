"""``to_torch_moe`` / ``from_torch_moe``: HF sparse-MoE blocks <-> ``torch_moe.nn.MoE``.

Legend: D model dim, F expert hidden dim, Fs shared-expert hidden dim, E experts, K top-k.

Design
------
``to_torch_moe(model)`` swaps every supported HF sparse-MoE block for a
:class:`TorchMoEBlock`, whose ``moe`` is a :class:`torch_moe.nn.MoE` computing the same
function: the block's router (softmax / sigmoid, top-k renormalization, scaling, expert
groups and DeepSeek-V3's ``e_score_correction_bias`` as ``router.expert_bias``), its routed
SwiGLU experts and its shared expert(s) and their sigmoid gate. The router weight and the
routed experts' ``gate_up_proj`` [E, 2F, D] / ``down_proj`` [E, D, F] are the very same
``Parameter`` objects in the MoE (an optimizer built before the conversion keeps them);
the shared expert's ``gate_proj`` / ``up_proj`` [Fs, D] are concatenated into
``shared_experts.w13`` [2Fs, D] (a copy); a correction bias stored in another dtype is
kept in fp32 (exact for bf16/fp16). ``from_torch_moe`` rebuilds the HF blocks from the
block class and config recorded at conversion (built on the meta device, then the
tensors assigned), so ``from_torch_moe(to_torch_moe(m))`` has a bitwise identical state
dict and the same forward.

What is supported is an explicit list, each entry checked against the original by
``benchmarks/hf_coverage.py``: a block class whose forward is one of three patterns
(routed experts only; plus a sigmoid-gated shared expert, Qwen2-MoE; plus an ungated
shared expert, DeepSeek-V3), a router class whose routing ``torch_moe.ops.topk_route``
reproduces, and an experts module in the fused layout (transformers' default SiLU gate on
concatenated [gate; up] rows, no biases, no post-expert norm). Anything else raises
``NotImplementedError`` naming the block, router or layout flag, before any block is
replaced.

The converted block records its HF block class and the MoE config in its ``_extra_state``;
loading a state dict whose ``_extra_state`` names another block class or config is refused
with an error that names the key (the usual missing / unexpected key errors cover the rest).
Converted models do not produce transformers' ``router_logits`` outputs: use the MoE's own
``aux_loss=`` / ``z_loss_coeff=`` options (``to_torch_moe(model, aux_loss="switch",
aux_loss_coeff=...)``) instead of ``output_router_logits``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from torch_moe.integrations._transformers_experts import RECIPE_ATTR, experts_layout
from torch_moe.nn import MoE
from torch_moe.quantization import RECIPES, Recipe

__all__ = [
    "SUPPORTED_BLOCKS",
    "TorchMoEBlock",
    "from_torch_moe",
    "to_torch_moe",
    "torch_moe_blocks",
]

# router classes by routing rule (identical forward code within each set)
_SOFTMAX_ALWAYS_NORM = frozenset(
    {
        "MixtralTopKRouter",
        "MiniMaxTopKRouter",
        "Qwen3VLMoeTextTopKRouter",
        "Qwen3_5MoeTopKRouter",
        "Qwen3OmniMoeTextTopKRouter",
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
_SIGMOID_GROUPED = frozenset(
    {
        "DeepseekV3TopkRouter",
        "AXK1TopkRouter",
        "BailingHybridTopkRouter",
        "Dots1TopkRouter",
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
)
_GATED_SHARED = (  # + sigmoid(shared_expert_gate(x)) * shared_expert(x)
    "Qwen2MoeSparseMoeBlock",
    "Qwen3_5MoeSparseMoeBlock",
    "Qwen3NextSparseMoeBlock",
    "Qwen4ExpTextSparseMoeBlock",
)
_SHARED = (  # + shared_experts(x)
    "DeepseekV3MoE",
    "DeepseekV32MoE",
    "AXK2MoE",
    "BailingHybridMoE",
    "Dots1MoE",
    "Glm4MoeMoE",
    "Glm4MoeLiteMoE",
    "Glm4vMoeTextMoE",
    "Glm5NextTextMoE",
    "GlmMoeDsaMoE",
    "HYV4MoE",
    "KimiLinearMoE",
    "Mistral4MoE",
    "MistralLarge4TextMoE",
    "SolarOpenMoE",
)
SUPPORTED_BLOCKS: dict[str, str] = {
    **dict.fromkeys(_ROUTED_ONLY, "routed"),
    **dict.fromkeys(_GATED_SHARED, "gated_shared"),
    **dict.fromkeys(_SHARED, "shared"),
}
_MOE_OPTIONS = ("precision", "aux_loss", "aux_loss_coeff", "z_loss_coeff")


def _is_experts(module: nn.Module) -> bool:
    return hasattr(module, "has_gate") and hasattr(module, "down_proj")


def _check_swiglu_mlp(mlp: Any, where: str) -> None:
    from torch_moe.integrations._transformers_experts import _is_silu

    lins = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(lin, nn.Linear) and lin.bias is None for lin in lins):
        raise NotImplementedError(
            f"to_torch_moe: {where} ({type(mlp).__name__}) is not a bias-free gate_proj / "
            "up_proj / down_proj SwiGLU MLP"
        )
    if not _is_silu(getattr(mlp, "act_fn", None)):
        raise NotImplementedError(
            f"to_torch_moe: {where} ({type(mlp).__name__}) has act_fn "
            f"{type(getattr(mlp, 'act_fn', None)).__name__}; torch_moe's shared expert is SiLU"
        )


def _moe_config(block: Any) -> dict[str, Any]:
    """The ``MoE`` constructor arguments reproducing ``block``; raises if unsupported."""
    name = type(block).__name__
    experts = getattr(block, "experts", None)
    if experts is not None and _is_experts(experts):
        layout = experts_layout(experts)
        for flag, bad in (
            ("has_gate", False),
            ("is_concatenated", False),
            ("is_transposed", True),
            ("has_bias", True),
            ("has_post_expert_norm", True),
        ):
            if getattr(layout, flag) == bad:
                raise NotImplementedError(
                    f"to_torch_moe: {name}.experts ({type(experts).__name__}) has {flag}={bad}; "
                    "torch_moe.nn.MoE holds bias-free SwiGLU experts as w13 [E, 2F, D] "
                    "(gate rows, then up rows) and w2 [E, D, F]. Use the 'torch_moe' experts "
                    "implementation for this model instead"
                )
        if not layout.default_gate or not layout.silu:
            raise NotImplementedError(
                f"to_torch_moe: {name}.experts ({type(experts).__name__}) has a custom "
                "activation (_apply_gate / act_fn other than SiLU(gate) * up); torch_moe.nn.MoE "
                "experts are SwiGLU. Use the 'torch_moe' experts implementation instead"
            )
    kind = SUPPORTED_BLOCKS.get(name)
    if kind is None or experts is None:
        raise NotImplementedError(
            f"to_torch_moe: {name} is not a supported sparse-MoE block; supported: "
            f"{sorted(SUPPORTED_BLOCKS)}. The 'torch_moe' experts implementation runs any "
            "transformers MoE model's experts without conversion"
        )
    gate = block.gate
    rname = type(gate).__name__
    num_experts, two_f, dim = experts.gate_up_proj.shape
    cfg: dict[str, Any] = dict(
        dim=dim, hidden_dim=two_f // 2, num_experts=num_experts, top_k=int(gate.top_k)
    )
    if rname in _SOFTMAX_ALWAYS_NORM or rname in _SOFTMAX_NORM_FLAG:
        norm = True if rname in _SOFTMAX_ALWAYS_NORM else bool(gate.norm_topk_prob)
        cfg.update(score_func="softmax", route_norm=norm)
    elif rname in _SIGMOID_GROUPED:
        groups = int(gate.num_group)
        cfg.update(
            score_func="sigmoid",
            route_norm=bool(gate.norm_topk_prob),
            route_scale=float(gate.routed_scaling_factor),
            num_expert_groups=groups if groups > 1 else None,
            num_limited_groups=int(gate.topk_group) if groups > 1 else None,
            expert_bias=True,
        )
    else:
        raise NotImplementedError(f"to_torch_moe: {name}.gate is an unsupported router {rname}")
    if getattr(gate, "bias", None) is not None:
        raise NotImplementedError(f"to_torch_moe: {name}.gate ({rname}) has a bias")
    jitter = float(getattr(block, "jitter_noise", 0.0) or 0.0)
    if jitter > 0:
        raise NotImplementedError(
            f"to_torch_moe: {name} has router_jitter_noise={jitter}; torch_moe's router has no "
            "input jitter"
        )
    if kind == "gated_shared":
        _check_swiglu_mlp(block.shared_expert, f"{name}.shared_expert")
        cfg.update(shared_hidden_dim=block.shared_expert.down_proj.in_features, shared_gate=True)
    elif kind == "shared":
        _check_swiglu_mlp(block.shared_experts, f"{name}.shared_experts")
        cfg.update(shared_hidden_dim=block.shared_experts.down_proj.in_features)
    return cfg


class TorchMoEBlock(nn.Module):
    """An HF sparse-MoE block replaced by ``torch_moe.nn.MoE`` (``self.moe``).

    ``forward(hidden_states [B, S, D]) -> [B, S, D]`` as the HF block. The HF block class
    and config it came from are kept (not in the state dict) for :func:`from_torch_moe`.
    """

    def __init__(
        self, moe: MoE, hf_block_class: type[nn.Module], hf_config: Any, kind: str, bias_dtype: Any
    ) -> None:
        super().__init__()
        self.moe = moe
        self.hf_block_class = hf_block_class
        self.hf_config = hf_config
        self.kind = kind
        self.bias_dtype = bias_dtype

    @property
    def family(self) -> str:
        return self.hf_block_class.__name__

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.moe(hidden_states)

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
            elif theirs.get("moe_config") != mine["moe_config"]:
                diff = {
                    k: (theirs["moe_config"].get(k), v)
                    for k, v in mine["moe_config"].items()
                    if theirs["moe_config"].get(k) != v
                }
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


def _convert_block(block: Any, cfg: dict[str, Any], options: dict[str, Any]) -> TorchMoEBlock:
    kind = SUPPORTED_BLOCKS[type(block).__name__]
    experts, gate = block.experts, block.gate
    recipe = _experts_recipe(experts)
    if "precision" not in options and recipe is not None:
        options = {**options, "precision": recipe}  # keep what set_precision chose
    w13, w2 = experts.gate_up_proj, experts.down_proj
    device, dtype = w13.device, w13.dtype
    moe = MoE(**cfg, **options, device="meta", dtype=dtype)
    moe.router.weight = gate.weight
    moe.experts.w13 = w13
    moe.experts.w2 = w2
    bias_dtype = None
    if cfg.get("expert_bias"):
        bias = gate.e_score_correction_bias
        bias_dtype = bias.dtype
        moe.router.expert_bias = bias.detach().to(torch.float32)
    if moe.shared_experts is not None:
        mlp = block.shared_expert if kind == "gated_shared" else block.shared_experts
        with torch.no_grad():
            shared_w13 = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0)
        moe.shared_experts.w13 = nn.Parameter(
            shared_w13, requires_grad=mlp.gate_proj.weight.requires_grad
        )
        moe.shared_experts.w2 = mlp.down_proj.weight
        if kind == "gated_shared":
            moe.shared_experts.gate = block.shared_expert_gate.weight
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
    return TorchMoEBlock(moe, type(block), experts.config, kind, bias_dtype)


def to_torch_moe(model: nn.Module, **moe_options: Any) -> nn.Module:
    """Replace every HF sparse-MoE block of ``model`` by a :class:`TorchMoEBlock` (in place).

    ``moe_options``: ``precision``, ``aux_loss``, ``aux_loss_coeff``, ``z_loss_coeff`` of
    :class:`torch_moe.nn.MoE` (the defaults compute what the HF blocks compute; the
    precision defaults to the recipe ``set_precision`` / a ``"torch_moe_<recipe>"``
    implementation gave the experts, and ``from_torch_moe`` gives it back). Every block
    is checked before any is replaced; an unsupported one raises ``NotImplementedError``
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
    plans = [(name, block, _moe_config(block)) for name, block in blocks]
    for name, block, cfg in plans:
        _set_submodule(model, name, _convert_block(block, cfg, moe_options))
    return model


def torch_moe_blocks(model: nn.Module) -> list[tuple[str, TorchMoEBlock]]:
    """(name, block) of every :class:`TorchMoEBlock` in ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, TorchMoEBlock)]


def from_torch_moe(model: nn.Module) -> nn.Module:
    """Put the HF blocks back (in place); the inverse of :func:`to_torch_moe`, bitwise.

    Expert-parallel (DTensor) weights are refused: gather them first.
    """
    blocks = torch_moe_blocks(model)
    if not blocks:
        raise ValueError(f"from_torch_moe: {type(model).__name__} has no TorchMoEBlock")
    for name, tb in blocks:
        moe = tb.moe
        for pname, p in moe.named_parameters():
            if hasattr(p, "device_mesh"):
                raise ValueError(
                    f"from_torch_moe: {name}.moe.{pname} is a DTensor (expert parallel); "
                    "gather the full weights before converting back"
                )
        with torch.device("meta"):
            block = tb.hf_block_class(tb.hf_config)
        sd: dict[str, Tensor] = {
            "gate.weight": moe.router.weight,
            "experts.gate_up_proj": moe.experts.w13,
            "experts.down_proj": moe.experts.w2,
        }
        if moe.router.expert_bias is not None:
            sd["gate.e_score_correction_bias"] = moe.router.expert_bias.to(tb.bias_dtype)
        shared = moe.shared_experts
        if shared is not None:
            prefix = "shared_expert." if tb.kind == "gated_shared" else "shared_experts."
            fs = shared.w2.shape[1]
            rg = shared.w13.requires_grad
            sd[prefix + "gate_proj.weight"] = nn.Parameter(shared.w13.detach()[:fs], rg)
            sd[prefix + "up_proj.weight"] = nn.Parameter(shared.w13.detach()[fs:], rg)
            sd[prefix + "down_proj.weight"] = shared.w2
            if shared.gate is not None:
                sd["shared_expert_gate.weight"] = shared.gate
        block.load_state_dict(sd, strict=True, assign=True)
        if moe.experts.recipe is not None:  # the "torch_moe" backend keeps running it
            setattr(block.experts, RECIPE_ATTR, moe.experts.recipe)
        leftover = [n for n, t in [*block.named_parameters(), *block.named_buffers()] if t.is_meta]
        if leftover:
            raise RuntimeError(f"from_torch_moe: {tb.family} has tensors with no value: {leftover}")
        block.train(tb.training)
        _set_submodule(model, name, block)
    return model
