"""Which HF transformers MoE families run on torch_moe? Try every family's tiny config.

A "family" is a transformers model folder whose modeling file decorates an experts class
with ``@use_experts_implementation`` (64 in transformers 5.23). For each one:

1. experts: every decorated experts class, built from the family's config with tiny sizes
   (D=32, F=24, E=8, K=2) and random weights, runs 32 tokens (one expert left empty)
   forward and backward with transformers' ``"eager"`` experts and with ``"torch_moe"``
   in fp32: output, input, routing-weight and every weight gradient compared, error in
   fp32 ulps of each tensor's max (pass: <= 64, as test/test_hf_integration.py); the
   layout flags and the backend path (fused grouped SwiGLU or composed) are recorded.
2. model: the family's ``AutoModelForCausalLM`` (or its text model) from a tiny config
   (2 layers, every layer MoE where the config allows) with random weights: logits and
   every parameter gradient with ``"torch_moe"`` against ``"eager"`` (fp32, <= 64 ulp),
   greedy ``generate`` (4 new tokens) equal, and in bf16 against ``"grouped_mm"`` with
   the fp32 model of the same weights as the reference: per tensor ``|torch_moe -
   fp32|`` (relative L2) ``<= max(4 |grouped_mm - fp32|, 10%) + 2 bf16 eps`` and, over
   all tensors, torch_moe's summed relative L2 error at most 1.5x grouped_mm's (the ratio
   is printed: "x0.9" means torch_moe's bf16 result is 10% closer to fp32 than
   grouped_mm's); tensors on which grouped_mm itself is over 50% off are not judged
   (``bf16_close``). The two backends must route the input alike: where a router's
   top-k is a near tie, one backend's bf16 rounding may pick another expert for a token
   (an O(1) change to that token, a draw of the rounding, not a defect); such an input
   is replaced by the next seed's (``check_bf16``; the cell says so).
3. convert: ``to_torch_moe`` on the fp32 model: equal logits and every parameter gradient
   (<= 64 ulp), and ``from_torch_moe`` restoring a bitwise identical state dict; or the
   error it raises.

Everything is built in code (HF_HUB_OFFLINE=1); nothing is downloaded. A family whose
tiny model cannot be built generically is reported with the build error and keeps its
experts-level result.

    python benchmarks/hf_coverage.py                       # all families, ~2 min
    python benchmarks/hf_coverage.py --families mixtral,gpt_oss
    python benchmarks/hf_coverage.py --out benchmarks/results/hf_coverage_cpu_202612.md
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import glob
import importlib
import inspect
import os
import platform
import re
import sys
import time
import traceback
import warnings
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

import torch_moe.integrations.transformers as tmt

F32_EPS = torch.finfo(torch.float32).eps
BF16_EPS = torch.finfo(torch.bfloat16).eps
ULP_LIMIT = 64
BF16_NOISE = 0.10  # relative L2 error either backend reaches in bf16 on these tiny models
ILL_CONDITIONED = 0.5  # grouped_mm off by more than this: the tensor is not judged

# ---------------------------------------------------------------------------- families


def families() -> list[str]:
    root = os.path.dirname(transformers.__file__)
    found = set()
    for path in glob.glob(os.path.join(root, "models", "*", "modeling_*.py")):
        with open(path) as f:
            if "@use_experts_implementation" in f.read():
                found.add(path.split(os.sep)[-2])
    return sorted(found)


def experts_classes(family: str) -> list[type]:
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    names = re.findall(r"@use_experts_implementation[^\n]*\nclass (\w+)", inspect.getsource(mod))
    return [getattr(mod, n) for n in names]


def config_classes(family: str) -> list[type]:
    mod = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    return [
        v
        for k, v in vars(mod).items()
        if k.endswith("Config") and isinstance(v, type) and v.__module__ == mod.__name__
    ]


# ---------------------------------------------------------------------------- tiny configs

D, FH, E, K = 32, 24, 8, 2
# sizes set on whichever of these a config has
EXPERT_SIZES: dict[str, Any] = dict(
    hidden_size=D,
    moe_hidden_size=D,
    intermediate_size=FH,
    moe_intermediate_size=FH,
    num_experts=E,
    num_local_experts=E,
    n_routed_experts=E,
    moe_num_experts=E,
    num_experts_per_tok=K,
    moe_k=K,
    top_k=K,
)
MODEL_SIZES: dict[str, Any] = dict(
    EXPERT_SIZES,
    intermediate_size=48,
    shared_expert_intermediate_size=FH,
    moe_shared_expert_intermediate_size=FH,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=96,
    max_position_embeddings=128,
    first_k_dense_replace=0,
    moe_layer_start_index=0,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    qk_head_dim=8,
    v_head_dim=8,
    sliding_window=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
VISION_SIZES: dict[str, Any] = dict(text_hidden_size=D, out_hidden_size=D)


MAX_NUMEL = 4_000_000  # a "tiny" module above this is a config the sizes did not reach


def _guarded(build: Any) -> Any:
    """``build()`` on the meta device first: refuse it if it is not tiny (a shared machine
    must not be swapped out by a config whose sizes this script did not reach)."""
    with torch.device("meta"):
        probe = build()
    numel = sum(t.numel() for t in [*probe.parameters(), *probe.buffers()])
    if numel > MAX_NUMEL:
        raise RuntimeError(f"tiny config still has {numel / 1e6:.0f}M elements")
    return build()


def _set_sizes(cfg: Any, sizes: dict[str, Any]) -> None:
    for k, v in sizes.items():
        with contextlib.suppress(Exception):
            if not hasattr(cfg, k):
                continue
            cur = getattr(cfg, k)
            setattr(cfg, k, [v] * len(cur) if isinstance(cur, list) and k.endswith("_size") else v)


def _make_experts(cls: type, cfg: Any) -> nn.Module:
    if "intermediate_size" in inspect.signature(cls.__init__).parameters:  # Ernie-4.5-VL
        return cls(cfg, intermediate_size=FH)
    return cls(cfg)


def experts_config(family: str, cls: type) -> Any:
    """A config that ``cls(config)`` accepts, with tiny expert sizes."""
    errors = []
    for cc in config_classes(family):
        try:
            cfg = cc()
            _set_sizes(cfg, EXPERT_SIZES)
            _guarded(lambda: _make_experts(cls, cfg))  # noqa: B023 - called right here
            return cfg
        except Exception as e:  # try the next config class
            errors.append(f"{cc.__name__}: {type(e).__name__}: {e}")
    raise RuntimeError("; ".join(errors))


def _kwargs_for(cfg_cls: type, sizes: dict[str, Any]) -> dict[str, Any]:
    default = cfg_cls()
    out = {}
    for k, v in sizes.items():
        try:
            cur = getattr(default, k)
        except Exception:  # per-layer attributes raise on access
            continue
        out[k] = [v] * len(cur) if isinstance(cur, list) and k.endswith("_size") else v
    return out


# per-family constraints the generic sizes break (validators of the family's config)
FIXES: dict[str, dict[str, Any]] = {
    "glm5_next": dict(
        qk_rope_head_dim=0, qk_nope_head_dim=8, qk_head_dim=8, index_head_dim=8,
        index_n_heads=2, index_topk=16, linear_head_dim=8, linear_num_heads=4,
    ),
    "dots3_note": dict(per_layer_config=None, head_dim=16),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=0),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    "mistral4": dict(head_dim=16),
    "gemma4": dict(
        vocab_size_per_layer_input=96, hidden_size_per_layer_input=8, global_head_dim=8,
        enable_moe_block=True, num_experts=E, top_k_experts=K,
    ),
    "diffusion_gemma": dict(num_experts=E, top_k_experts=K),
    "glm4v_moe": dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [0, 1, 1]},
    ),
    "granitemoehybrid": dict(
        mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8,
        layer_types=["mamba", "attention"],
    ),
    "deepseek_ocr2": dict(mlp_layer_types=["sparse", "sparse"]),
    "zaya": dict(num_experts_per_tok=1),
}  # fmt: skip


def _two_layer_types(types: list[str], attention: bool) -> list[str]:
    """Two layers out of a family's layer pattern: two distinct kinds if it has them, the
    second an attention layer (a cache needs one) for ``layer_types``."""
    distinct = list(dict.fromkeys(types))
    if len(distinct) == 1:
        return distinct * 2
    if attention:
        full = [t for t in distinct if "full" in t] or [t for t in distinct if "attention" in t]
        last = full[0] if full else distinct[-1]
        return [next(t for t in distinct if t != last), last]
    return distinct[:2]


def _init_params(cfg_cls: type) -> set[str]:
    names = set(inspect.signature(cfg_cls.__init__).parameters)
    if dataclasses.is_dataclass(cfg_cls):
        names |= {f.name for f in dataclasses.fields(cfg_cls)}
    return names


def _text_kwargs(cfg_cls: type) -> dict[str, Any]:
    kwargs = _kwargs_for(cfg_cls, MODEL_SIZES)
    default = cfg_cls()
    if hasattr(default, "kv_lora_rank"):  # multi-head latent attention: kv heads == heads
        kwargs["num_key_value_heads"] = MODEL_SIZES["num_attention_heads"]
    params = _init_params(cfg_cls)
    for name in dir(default):
        if not name.endswith("layer_types") or name not in params:
            continue
        with contextlib.suppress(Exception):
            types = getattr(default, name)
            if isinstance(types, list) and types and all(isinstance(t, str) for t in types):
                kwargs[name] = _two_layer_types(types, attention=name == "layer_types")
    return kwargs


def main_config_class(family: str) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family in CONFIG_MAPPING:
        return CONFIG_MAPPING[family]
    cands = [
        c
        for c in config_classes(family)
        if not re.search(r"(Text|Vision|Audio)Config$", c.__name__)
    ]
    return (cands or config_classes(family))[0]


def model_config(family: str) -> Any:
    """The family's config with tiny text (and vision) sizes, built through its constructor
    so that derived fields (layer types, head dims) follow."""
    cfg_cls = main_config_class(family)
    default = cfg_cls()
    subs = dict(getattr(default, "sub_configs", {}) or {})
    fixes = FIXES.get(family, {})
    if not subs:
        cfg = cfg_cls(**{**_text_kwargs(cfg_cls), **fixes})
    else:
        kwargs: dict[str, Any] = {}
        for name in subs:
            sub_cls = type(getattr(default, name))  # the concrete class (not AutoConfig)
            with contextlib.suppress(Exception):
                if getattr(sub_cls(), "sub_configs", None):
                    continue  # nested composites (Qwen3-Omni): keep their defaults
                if "vision" in name or "audio" in name:
                    # only the width the text model sees: the vision tower is not built
                    kwargs[name] = _kwargs_for(sub_cls, VISION_SIZES)
                else:
                    kwargs[name] = {**_text_kwargs(sub_cls), **fixes}
        cfg = cfg_cls(**kwargs, **_kwargs_for(cfg_cls, dict(vocab_size=MODEL_SIZES["vocab_size"])))
    # every layer sparse where a config says which layers are dense
    text = cfg.get_text_config()
    for attr, value in (("mlp_only_layers", []), ("decoder_sparse_step", 1)):
        if hasattr(text, attr):
            setattr(text, attr, value)
    return cfg


# ---------------------------------------------------------------------------- checks


def _randomize(module: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not p.is_floating_point():
                continue
            r = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * r if "norm" in name else 0.2 * r)
            else:
                router = name.endswith(("gate.weight", "router.weight", "router.proj.weight"))
                p.copy_(r * (3.0 if router else 1.0) * min(p.shape[-2:]) ** -0.5)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
            elif name.endswith("tid2eid"):  # DeepSeek-V4's hash routing table: K distinct
                rows = [torch.randperm(E, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows))


def _ulps(actual: torch.Tensor, expected: torch.Tensor, eps: float) -> float:
    scale = expected.abs().max().float().item()
    if scale == 0:
        return 0.0 if actual.abs().max().item() == 0 else float("inf")
    return (actual.float() - expected.float()).abs().max().item() / (eps * scale)


def check_experts(family: str, cls: type) -> dict[str, Any]:
    cfg = experts_config(family, cls)
    torch.manual_seed(0)
    experts = _guarded(lambda: _make_experts(cls, cfg))
    _randomize(experts)
    layout = tmt.experts_layout(experts)
    T = 32
    g = torch.Generator().manual_seed(1)
    dim = (getattr(experts, "gate_up_proj", None) if layout.has_gate else experts.up_proj).shape
    d_in = dim[1] if layout.is_transposed else dim[2]
    x = torch.randn(T, d_in, generator=g)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    w = w / w.sum(-1, keepdim=True)
    res = {}
    for impl in ("eager", "torch_moe"):
        cfg._experts_implementation = impl
        experts.zero_grad(set_to_none=True)
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = experts(xi, ids, wi)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
        res[impl] = [out.detach(), xi.grad, wi.grad] + [
            p.grad for _, p in sorted(experts.named_parameters())
        ]
    err = max(_ulps(a, b, F32_EPS) for a, b in zip(res["torch_moe"], res["eager"]))
    flags = [
        f"{f}={getattr(layout, f)}"
        for f in tmt.LAYOUT_FLAGS
        if getattr(layout, f) != (f in ("has_gate", "is_concatenated"))
    ]
    act_name = type(getattr(experts, "act_fn", None)).__name__
    if not layout.has_gate:
        act = act_name
    elif layout.default_gate:
        act = f"{'SiLU' if layout.silu else act_name}(gate) * up"
    else:
        act = f"own `_apply_gate` ({'SiLU' if layout.silu else act_name})"
    return dict(
        cls=cls.__name__,
        flags=flags,
        act=act,
        path=layout.path,
        ulps=err,
        ok=err <= ULP_LIMIT,
    )


def _model_classes(family: str, cfg: Any) -> list[Any]:
    """Constructors for ``cfg``: the Auto classes, then the family's own model classes whose
    ``config_class`` is the config's class (causal LM heads first)."""
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    own = [
        v
        for v in vars(mod).values()
        if isinstance(v, type)
        and issubclass(v, transformers.PreTrainedModel)
        and getattr(v, "config_class", None) is type(cfg)
    ]
    rank = ("ForCausalLM", "ForConditionalGeneration", "Model")
    own.sort(key=lambda c: next((i for i, r in enumerate(rank) if c.__name__.endswith(r)), 9))
    autos = [AutoModelForCausalLM.from_config, transformers.AutoModel.from_config]
    return autos + [c._from_config for c in own]


def build_model(family: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The family's tiny causal LM: the text model's config first (no vision tower), then
    the full config; an Auto class if one maps the config, else the family's own class."""
    cfg = model_config(family)
    errors = []
    text = cfg.get_text_config()
    for c in [text] if text is cfg else [text, cfg]:
        for ctor in _model_classes(family, c):
            try:
                model = _guarded(lambda: ctor(c, experts_implementation="eager"))  # noqa: B023
            except Exception as e:  # try the next candidate
                errors.append(e)
                continue
            if not tmt.experts_modules(model):
                errors.append(RuntimeError(f"{type(model).__name__} has no experts module"))
                continue
            _randomize(model)
            return model.to(dtype).eval()
    raise errors[0] if errors else RuntimeError("no model class")


def _vocab(model: nn.Module) -> int:
    emb = model.get_input_embeddings()
    return min(int(emb.weight.shape[0]), 96)


def _forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids)
    return (
        out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state
    )


def _run(model: nn.Module, ids: torch.Tensor, impl: str) -> list[torch.Tensor]:
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = _forward(model, ids)
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out.float() * gout).sum().backward()
    return [out.detach().float()] + [
        p.grad.float() for _, p in sorted(model.named_parameters()) if p.grad is not None
    ]


def bf16_close(
    tm: list[torch.Tensor], gm: list[torch.Tensor], truth: list[torch.Tensor]
) -> tuple[bool, float, float]:
    """torch_moe's bf16 tensors against grouped_mm's, both judged against the fp32 model:
    per tensor, relative L2 error <= max(4x grouped_mm's, 10%) + 2 bf16 eps (2^-6); over
    all tensors, the summed relative L2 error <= 1.5x grouped_mm's. A wrong gradient (O(1)
    error) fails; bf16 noise (2-20% on these tiny random models, either backend: one
    backend's 1.3% and the other's 6.9% on the same tensor is a draw of the noise, not a
    defect) does not. A tensor on which grouped_mm itself is off by over 50% (an
    ill-conditioned result, e.g. DeepSeek-V4's hyper-connection gradients: 350% for
    grouped_mm, 1480% for torch_moe at one seed) says nothing about either backend and is
    left out of both sums. Returns (ok, aggregate ratio, worst per-tensor ratio)."""
    ok = len(gm) == len(tm) == len(truth)
    err_tm = err_gm = worst = 0.0
    for a, r, t in zip(tm, gm, truth):
        norm = max(t.norm().item(), 1e-30)
        e_tm, e_gm = (a - t).norm().item() / norm, (r - t).norm().item() / norm
        if e_gm > ILL_CONDITIONED:
            continue
        ok &= e_tm <= max(4 * e_gm, BF16_NOISE) + 2 * BF16_EPS
        worst = max(worst, e_tm / max(e_gm, BF16_EPS))
        err_tm, err_gm = err_tm + e_tm, err_gm + e_gm
    ratio = err_tm / max(err_gm, 1e-30)
    return ok and ratio <= 1.5, ratio, worst


def fp32_close(
    got: list[torch.Tensor], ref: list[torch.Tensor], f64: list[torch.Tensor] | None
) -> tuple[bool, float]:
    """torch_moe against eager in fp32: per tensor within 64 ulp of the tensor's max, or,
    for an ill-conditioned tensor (a small result of large cancelling terms, e.g.
    DeepSeek-V4's hyper-connection scales), within 4x eager's own error against the
    float64 model. Returns (ok, worst ulps)."""
    ok, worst = len(got) == len(ref), 0.0
    for i, (a, b) in enumerate(zip(got, ref)):
        u = _ulps(a, b, F32_EPS)
        worst = max(worst, u)
        if u > ULP_LIMIT:
            own = (b - f64[i]).abs().max().item() if f64 is not None else 0.0
            ok &= (a - b).abs().max().item() <= 4 * own
    return ok, worst


def _stage(fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # reported in the table
        return "error: " + _short(e)


def check_model(family: str) -> dict[str, Any]:
    model = build_model(family)
    if not tmt.experts_modules(model):
        raise RuntimeError("the tiny model has no experts module")
    ids = torch.randint(3, _vocab(model), (2, 8), generator=torch.Generator().manual_seed(1))
    ref = _run(model, ids, "eager")
    got = _run(model, ids, "torch_moe")
    f64 = _stage(lambda: _run(copy.deepcopy(model).double(), ids, "eager"))
    ok, ulps = fp32_close(got, ref, f64 if isinstance(f64, list) else None)
    result: dict[str, Any] = dict(fp32_ulps=ulps, fp32_ok=ok)
    result["generate"] = _stage(lambda: check_generate(model, ids))
    result["bf16"] = _stage(lambda: check_bf16(model, ids))
    result["convert"] = _stage(lambda: check_convert(model, ids))
    return result


def check_generate(model: nn.Module, ids: torch.Tensor) -> str:
    if not hasattr(model, "generate") or getattr(_call_quiet(model, ids), "logits", None) is None:
        return "n/a (no LM head)"
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.set_experts_implementation("eager")
        a = model.generate(ids[:, :5], **kw)
        model.set_experts_implementation("torch_moe")
        b = model.generate(ids[:, :5], **kw)
    return "equal" if torch.equal(a, b) else "DIFFERENT"


def check_bf16(model: nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """bf16 against grouped_mm, both judged against the fp32 model with the same weights,
    on tokens that the two backends route alike: where a router's top-k is a near tie,
    one backend's bf16 rounding may pick another expert for a token than the other's (an
    O(1) change to that token, a draw of the rounding, not a defect, which would judge one
    backend on another routing); such an input is replaced by the next seed's (up to
    ``ROUTING_SEEDS``), and the cell says so."""
    bf = copy.deepcopy(model).to(torch.bfloat16)
    f32 = copy.deepcopy(bf).float()
    for seed in range(ROUTING_SEEDS):
        if seed:
            gen = torch.Generator().manual_seed(1 + seed)
            ids = torch.randint(3, _vocab(model), tuple(ids.shape), generator=gen)
        gm, r_gm = _routed(bf, ids, "grouped_mm")
        tm, r_tm = _routed(bf, ids, "torch_moe")
        if _same_routes(r_gm, r_tm):
            break
    truth = _run(f32, ids, "eager")
    ok, ratio, worst = bf16_close(tm, gm, truth)
    tie = seed if _same_routes(r_gm, r_tm) else -1
    return dict(ok=ok, ratio=ratio, worst=worst, reseeded=tie)


ROUTING_SEEDS = 4  # inputs tried for one the two backends route alike


def _routed(model: nn.Module, ids: torch.Tensor, impl: str) -> tuple[list[Any], list[Any]]:
    """``_run`` and every experts module's ``top_k_index`` during its forward."""
    routes: list[Any] = []

    def record(_module: Any, args: Any, kwargs: Any) -> None:
        routes.append((args[1] if len(args) > 1 else kwargs.get("top_k_index")).clone())

    hooks = [
        m.register_forward_pre_hook(record, with_kwargs=True) for _, m in tmt.experts_modules(model)
    ]
    try:
        return _run(model, ids, impl), routes
    finally:
        for h in hooks:
            h.remove()


def _same_routes(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _call_quiet(model: nn.Module, ids: torch.Tensor) -> Any:
    with torch.no_grad():
        return model(input_ids=ids)


def _grads_by_param(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, Any]]:
    """Output and {id(parameter): gradient} of ``sum(output * g)`` for a fixed random g."""
    model.zero_grad(set_to_none=True)
    out = _forward(model, ids)
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out.float() * gout).sum().backward()
    grads = {id(p): p.grad.clone() for p in model.parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def check_convert(model: nn.Module, ids: torch.Tensor) -> str:
    """``to_torch_moe``: the output and every parameter gradient against the original model
    (the converted blocks share the router, expert and shared-expert down weights, so
    their gradients compare by parameter; the shared expert's gate / up rows, copied into
    one ``w13``, against the concatenation of the originals'; experts stored transposed,
    viewed by new ``Parameter`` objects, transposed back), within 64 ulp or, for an
    ill-conditioned gradient, within 4x the original's own error against its float64 copy
    (``fp32_close``'s rule: e.g. GraniteMoE-SWA's attention sinks, 70 ulp off float64 in
    the original itself); then ``from_torch_moe``'s state dict against the original,
    bitwise."""
    from torch_moe.integrations._transformers_convert import _named_blocks

    model.set_experts_implementation("eager")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref, ref_g = _grads_by_param(model, ids)
    # the float64 copy's gradients, by the fp32 model's parameter ids (same names); a
    # model that does not run in float64 (Inkling2's fp32 constants) gets no
    # ill-conditioning allowance: every gradient then has to pass the ulp limit
    m64 = copy.deepcopy(model).double()
    try:
        _, grads64 = _grads_by_param(m64, ids)
    except RuntimeError:
        grads64 = {}
    by_name = {n: grads64[id(p)] for n, p in m64.named_parameters() if id(p) in grads64}
    g64 = {id(p): by_name[n] for n, p in model.named_parameters() if n in by_name}
    ill = 0

    def close(got: torch.Tensor, want: torch.Tensor, pid: int | None) -> float:
        nonlocal ill
        u = _ulps(got, want, F32_EPS)
        if u > ULP_LIMIT and pid in g64:
            own = (want.double() - g64[pid]).abs().max().item()
            if (got - want).abs().max().item() <= 4 * own:
                ill += 1  # as far from float64 as the original itself
                return 0.0
        return u

    blocks = dict(_named_blocks(model))
    try:
        tmt.to_torch_moe(model)
    except NotImplementedError as e:
        return "no: " + str(e).split(";")[0].split(". ")[0].replace("to_torch_moe: ", "")
    out, got_g = _grads_by_param(model, ids)
    errs = [_ulps(out, ref, F32_EPS)]
    matched = set()
    for name, tb in tmt.torch_moe_blocks(model):
        if tb.hf_keys.transposed:  # new Parameters viewing the HF experts' storage
            experts = blocks[name].experts
            for hf_p, mine in (
                (experts.gate_up_proj, tb.moe.experts.w13),
                (experts.down_proj, tb.moe.experts.w2),
            ):
                errs.append(close(got_g[id(mine)].transpose(1, 2), ref_g[id(hf_p)], id(hf_p)))
                matched.add(id(hf_p))
        shared = tb.moe.shared_experts
        # gate / up concatenated: a copy (a fused gate_up_proj or an ungated up_proj is
        # the MoE's w13 itself, compared with the other shared tensors)
        if shared is not None and not tb.hf_keys.shared_fused and shared.activation != "relu2":
            mlp = getattr(blocks[name], tb.hf_keys.shared)
            halves = [mlp.gate_proj.weight, mlp.up_proj.weight]
            w13 = tb.moe.shared_experts.w13
            expect = torch.cat([ref_g[id(p)] for p in halves])
            errs.append(close(got_g[id(w13)], expect, None))
            matched |= {id(p) for p in halves}
    missing = 0
    for pid, g in ref_g.items():
        if pid in matched:
            continue
        if pid in got_g:
            errs.append(close(got_g[pid], g, pid))
        elif pid not in matched:
            missing += 1
    tmt.from_torch_moe(model)
    after = model.state_dict()
    bitwise = sorted(after) == sorted(before) and all(
        torch.equal(after[k], before[k]) for k in before
    )
    err, n = max(errs), len(before)
    if err <= ULP_LIMIT and bitwise and not missing:
        cond = f", {ill} ill-conditioned within 4x the original's float64 error" if ill else ""
        return (
            f"yes ({err:.0f} ulp over the output and {len(errs) - 1} gradients{cond}, round "
            f"trip bitwise over {n} tensors)"
        )
    return f"MISMATCH ({err:.0f} ulp, {missing} gradients missing, round trip bitwise: {bitwise})"


# ---------------------------------------------------------------------------- report


def _short(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".split("\n")[0]
    return msg[:110] + ("..." if len(msg) > 110 else "")


def run(fams: list[str]) -> list[dict[str, Any]]:
    rows = []
    for fam in fams:
        t0 = time.perf_counter()
        row: dict[str, Any] = dict(family=fam, experts=[])
        for cls in experts_classes(fam):
            try:
                row["experts"].append(check_experts(fam, cls))
            except Exception as e:  # reported in the table
                row["experts"].append(dict(cls=cls.__name__, error=_short(e), ok=False))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row["model"] = check_model(fam)
        except Exception as e:  # reported in the table
            row["model"] = dict(error=_short(e))
            if os.environ.get("HF_COVERAGE_TRACE"):
                traceback.print_exc()
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    ex = "; ".join(
        f"{x['cls']} {x['path']} {x['ulps']:.0f}ulp"
        if "path" in x
        else f"{x['cls']} ERROR {x['error']}"
        for x in row["experts"]
    )
    m = row["model"]
    mod = (
        m.get("error")
        or f"fp32 {m['fp32_ulps']:.0f}ulp ok={m['fp32_ok']} bf16 {_bf16_cell(m['bf16'])} gen {m['generate']} | {m['convert']}"
    )
    return f"{row['family']:24s} {ex} || {mod} ({row['seconds']:.1f}s)"


def _bf16_cell(b: Any) -> str:
    if isinstance(b, str):
        return b
    tie = {0: "", -1: f"; the backends route {ROUTING_SEEDS} inputs differently"}.get(
        b["reseeded"], f"; input {b['reseeded'] + 1}: the first routed differently"
    )
    verdict = "ok" if b["ok"] else "FAIL"
    return f"{verdict} (x{b['ratio']:.2f}, worst tensor x{b['worst']:.1f}{tie})"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| family | experts class | layout flags | activation | path | experts fp32 | model fp32 "
        "| model bf16 vs grouped_mm | generate | to_torch_moe |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row in rows:
        m = row["model"]
        for i, x in enumerate(row["experts"]):
            if "error" in x:
                cells = [x["cls"], "", "", "error", x["error"]]
            else:
                cells = [
                    f"`{x['cls']}`",
                    ", ".join(x["flags"]) or "-",
                    x["act"],
                    x["path"],
                    f"{'ok' if x['ok'] else 'FAIL'} ({x['ulps']:.0f} ulp)",
                ]
            if i == 0 and "error" not in m:
                mcells = [
                    f"{'ok' if m['fp32_ok'] else 'FAIL'} ({m['fp32_ulps']:.0f} ulp)",
                    _bf16_cell(m["bf16"]),
                    m["generate"],
                    m["convert"],
                ]
            elif i == 0:
                mcells = [f"not built: {m['error']}", "", "", ""]
            else:
                mcells = ["", "", "", ""]
            lines.append(
                f"| {row['family'] if i == 0 else ''} | " + " | ".join(cells + mcells) + " |"
            )
    return head + "\n".join(lines) + "\n"


def readme_table(rows: list[dict[str, Any]]) -> str:
    """The compact table of the README's "HF transformers" section."""
    out = [
        "| family | experts: path (flags) | tiny model vs eager / grouped_mm | to_torch_moe |",
        "|---|---|---|---|",
    ]
    for row in rows:
        ex = row["experts"]
        if not all(x.get("ok") for x in ex):
            exp = "FAIL"
        else:
            exp = "; ".join(
                x["path"] + (f" ({', '.join(x['flags'])})" if x["flags"] else "") for x in ex
            )
            exp = exp if len({x["path"] for x in ex}) > 1 or len(ex) == 1 else ex[0]["path"]
        m = row["model"]
        if "error" in m:
            mod, conv = "not built generically (experts checked alone)", ""
        else:
            b = m["bf16"]
            parts = ["fp32 ok" if m["fp32_ok"] else "fp32 FAIL"]
            if isinstance(b, dict):
                parts.append("bf16 ok" if b["ok"] else "bf16 FAIL")
            else:
                parts.append("bf16: HF model fails on CPU")
            if m["generate"] == "equal":
                parts.append("generate equal")
            elif not m["generate"].startswith("n/a"):
                parts.append("generate " + m["generate"])
            mod = ", ".join(parts)
            conv = "yes" if m["convert"].startswith("yes") else "no"
        out.append(f"| {row['family']} | {exp} | {mod} | {conv} |")
    return "\n".join(out) + "\n"


def summary(rows: list[dict[str, Any]]) -> str:
    n = len(rows)
    experts_ok = sum(all(x.get("ok") for x in r["experts"]) for r in rows)
    built = [r for r in rows if "error" not in r["model"]]
    model_ok = sum(
        r["model"]["fp32_ok"] and isinstance(r["model"]["bf16"], dict) and r["model"]["bf16"]["ok"]
        for r in built
    )
    bf16_err = sum(isinstance(r["model"]["bf16"], str) for r in built)
    gen_ok = sum(r["model"]["generate"] == "equal" for r in built)
    conv = sum(r["model"]["convert"].startswith("yes") for r in built)
    gen_na = sum(r["model"]["generate"].startswith("n/a") for r in built)
    paths = [x["path"] for r in rows for x in r["experts"] if "path" in x]
    return (
        f"{n} families, {sum(len(r['experts']) for r in rows)} experts classes: experts equal eager "
        f"(fp32) in {experts_ok}/{n} families ({paths.count('fused')} classes on the fused grouped "
        f"SwiGLU path, {paths.count('composed')} composed); tiny model built for {len(built)}/{n}, "
        f"of which {model_ok} match eager (fp32) and grouped_mm (bf16) in logits and every gradient "
        f"({bf16_err} whose HF model does not run in bf16 on CPU: fp32 only), "
        f"{gen_ok} generate the same greedy tokens ({gen_na} base models without an LM head); "
        f"to_torch_moe converts {conv}."
    )


def cpu_info() -> str:
    """CPU model and the ISA features that decide CPU GEMM paths (from /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    isa = [n for f, n in (("avx2", "AVX2"), ("avx512f", "AVX512"), ("avx512_bf16", "AVX512-BF16"),
                          ("amx_bf16", "AMX-BF16")) if f in flags]  # fmt: skip
    return f"{model} ({', '.join(isa) or 'no AVX2'})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--out", default="", help="write the markdown report here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny ops)")
    parser.add_argument("--readme", default="", help="write the README's compact table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    fams = families()
    if args.families:
        want = args.families.split(",")
        unknown = sorted(set(want) - set(fams))
        if unknown:
            raise SystemExit(f"--families: unknown {unknown}; known: {fams}")
        fams = want
    t0 = time.perf_counter()
    rows = run(fams)
    header = (
        f"# torch {torch.__version__}, transformers {transformers.__version__}, {cpu_info()}, "
        f"{os.cpu_count()} CPUs, threads={torch.get_num_threads()}, {time.perf_counter() - t0:.0f} s\n"
    )
    text = header + "\n" + table(rows) + "\n" + summary(rows) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            cmd = ["python benchmarks/hf_coverage.py", *(sys.argv[1:] if argv is None else argv)]
            f.write(REPORT_HEAD.format(cmd=" ".join(cmd)))
            f.write(text + REPORT_NOTES)
    if args.readme:
        with open(args.readme, "w") as f:
            f.write(readme_table(rows))
    print()
    print(text)


REPORT_HEAD = """# HF transformers MoE families on torch_moe ({date})

Question: which of transformers' MoE families run their experts through the "torch_moe"
experts implementation with the results of transformers' own implementations, and which
convert to `torch_moe.nn.MoE` (`to_torch_moe`)? Every model is a tiny random config built
in code (nothing downloaded); see the docstring of `benchmarks/hf_coverage.py` for the
exact checks and tolerances.

```bash
{{cmd}}
```

""".format(date=time.strftime("%Y-%m"))
REPORT_NOTES = """
Columns: *layout flags* are the `@use_experts_implementation` flags that differ from the
defaults; *path* is the backend's: `fused` = `grouped_swiglu` gathering the rows (routing weight
folded in) -> fp32 combine, `composed` = `grouped_mm` -> the gate (by `torch_moe::glu`
where it is one the op computes: transformers' default with SiLU, GPT-OSS's and the other
`OWN_GATES`, the squared ReLU; otherwise the module's own `_apply_gate` / `act_fn`; either
recomputed in the backward) -> `grouped_mm`, biases and post-expert norm as the flags say. *experts fp32*: the experts module alone against transformers' "eager" (ulp of
each tensor's max, output and every gradient). *model fp32*: logits and every parameter
gradient of the whole tiny model against "eager" (an entry above 64 ulp passes only where
eager's own fp32 error against the float64 model is at least a quarter of the difference:
ill-conditioned gradients such as DeepSeek-V4's hyper-connection scales). *model bf16*:
against "grouped_mm", both judged against the fp32 model with the same weights; "x0.96"
is torch_moe's summed relative L2 error over grouped_mm's (below 1: closer to fp32).
*generate*: 4 greedy tokens, "eager" vs "torch_moe". *to_torch_moe*: logits of the
converted model against the original, and the round trip's state dict, or the reason the
block is refused (the experts implementation still covers those families).
"""


if __name__ == "__main__":
    main()
