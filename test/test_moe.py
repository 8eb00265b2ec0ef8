# Owner(s): ["module: moe"]
"""Tests for torch_moe.nn.MoE: HF transformers equivalence, the naive per-token oracle,
load-balancing losses, aux-loss-free bias, autocast, torch.compile, saved activations.

Legend: T tokens, D dim, F expert hidden dim, E experts, K top-k.
"""

import copy
import importlib.metadata
import math
import unittest

import naive
import tolerances
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)
from torch.utils.checkpoint import checkpoint

import torch_moe
from torch_moe import ops
from torch_moe.nn import PRESETS, MoE, hf_state_dict_to_moe
from torch_moe.nn.functional import router_z_loss, sequence_aux_loss, switch_aux_loss

try:  # imported lazily in the HF tests: importing the model code takes seconds
    HAS_TRANSFORMERS = importlib.metadata.version("transformers").split(".")[0] == "5"
except importlib.metadata.PackageNotFoundError:
    HAS_TRANSFORMERS = False

F64 = torch.float64
EXACT = dict(atol=0, rtol=0)
# float64 vs the float64 oracles: only summation order differs
TIGHT = dict(atol=1e-12, rtol=1e-10)

BASE = dict(dim=8, hidden_dim=6, num_experts=4, top_k=2)


def _randomize(moe: MoE, seed: int = 0, bias_scale: float = 0.1) -> MoE:
    """Random values for every parameter and a random (fp32-exact) expert_bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            std = 1.0 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.5
            if name == "router.weight":
                std = 1.5 / math.sqrt(p.shape[-1])  # logits ~ N(0, 1.5^2): routing far from uniform
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * std)
        if moe.router.expert_bias is not None:
            b = torch.randn(moe.num_experts, generator=g) * bias_scale
            moe.router.expert_bias.copy_(b)
    return moe


def _x(shape, dtype=F64, seed=1, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64).to(dtype).requires_grad_(requires_grad)


def _grads(module):
    return {n: p.grad for n, p in module.named_parameters()}


# --------------------------------------------------------------------------------------
# 1. equivalence with HF transformers 5.x MoE blocks

D_HF, F_HF = 16, 12


def _hf_case(name):
    """(HF block, preset name, from_preset overrides) for one published architecture."""
    common = dict(hidden_size=D_HF, experts_implementation="eager")
    if name == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import (
            MixtralConfig,
            MixtralSparseMoeBlock,
        )

        cfg = MixtralConfig(
            intermediate_size=F_HF, num_local_experts=6, num_experts_per_tok=2, **common
        )
        return MixtralSparseMoeBlock(cfg), "mixtral", dict(num_experts=6, top_k=2)
    if name == "qwen2-moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import (
            Qwen2MoeConfig,
            Qwen2MoeSparseMoeBlock,
        )

        cfg = Qwen2MoeConfig(
            moe_intermediate_size=F_HF,
            shared_expert_intermediate_size=20,
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            **common,
        )
        overrides = dict(num_experts=6, top_k=3, shared_hidden_dim=20)
        return Qwen2MoeSparseMoeBlock(cfg), "qwen2-moe", overrides
    if name in ("qwen3-moe", "qwen3-moe-no-norm"):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeConfig,
            Qwen3MoeSparseMoeBlock,
        )

        norm = name == "qwen3-moe"
        cfg = Qwen3MoeConfig(
            moe_intermediate_size=F_HF,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=norm,
            **common,
        )
        return (
            Qwen3MoeSparseMoeBlock(cfg),
            "qwen3-moe",
            dict(num_experts=8, top_k=3, route_norm=norm),
        )
    assert name in ("deepseek-v2", "deepseek-v3")
    # both: 16 experts in 4 groups, 2 kept, top-3, two shared experts' width
    sizes = dict(
        moe_intermediate_size=F_HF,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        **common,
    )
    overrides = dict(
        num_experts=16,
        top_k=3,
        num_expert_groups=4,
        num_limited_groups=2,
        shared_hidden_dim=2 * F_HF,
    )
    if name == "deepseek-v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
            DeepseekV2Config,
            DeepseekV2Moe,
        )

        cfg = DeepseekV2Config(
            topk_method="group_limited_greedy",
            routed_scaling_factor=16.0,
            num_attention_heads=4,
            num_key_value_heads=4,
            **sizes,
        )
        return DeepseekV2Moe(cfg), name, overrides
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Config,
        DeepseekV3MoE,
    )

    cfg = DeepseekV3Config(routed_scaling_factor=2.5, norm_topk_prob=True, **sizes)
    return DeepseekV3MoE(cfg), name, overrides


HF_CASES = ["mixtral", "qwen2-moe", "qwen3-moe", "qwen3-moe-no-norm", "deepseek-v2", "deepseek-v3"]


@unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers 5.x")
@instantiate_parametrized_tests
class TestMoEHuggingFace(TestCase):
    # NB (tolerances): the HF blocks run their routers in fp32 even in a float64 model
    # (Mixtral: softmax(logits.float()); Qwen2/3: softmax(dtype=float); DeepSeek-V3: the
    # whole gate on x.float() and W.float()), so their routing weights carry fp32
    # rounding (~6e-8 relative) while torch_moe routes a float64 layer in float64. The
    # experts are float64 on both sides. Outputs are O(1): atol/rtol 1e-6 is ~10x the
    # fp32 rounding; gradients through the fp32 softmax/sigmoid backward get 1e-5.
    FWD_TOL = dict(atol=1e-6, rtol=1e-6)
    GRAD_TOL = dict(atol=1e-5, rtol=1e-5)

    def _pair(self, name):
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        block, preset, overrides = _hf_case(name)
        # the eager per-expert loop (the reference), not grouped_mm / batched_mm kernels
        self.assertEqual(block.experts.config._experts_implementation, "eager")
        sentinel = object()
        self.assertIs(ALL_EXPERTS_FUNCTIONS.get_interface("eager", sentinel), sentinel)
        block = block.to(F64).eval()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            # HF inits some of these to zeros or leaves them uninitialized
            for n, p in block.named_parameters():
                std = 0.4 if n == "gate.weight" else 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * std)
            if name == "deepseek-v3":
                # fp32-exact values: torch_moe keeps expert_bias in fp32
                # large enough to move >= 20% of the choices (test_deepseek_bias_and_groups_matter)
                bias = (torch.randn(16, generator=g) * BIAS_SCALE).double()
                block.gate.e_score_correction_bias.copy_(bias)
        moe = MoE.from_preset(preset, dim=D_HF, hidden_dim=F_HF, dtype=F64, **overrides)
        moe.load_state_dict(hf_state_dict_to_moe(block.state_dict()), strict=True)
        return block, moe.eval()

    @parametrize("name", HF_CASES)
    def test_matches_hf_forward_backward(self, name):
        block, moe = self._pair(name)
        x_hf = _x((2, 5, D_HF), seed=3)
        x = x_hf.detach().clone().requires_grad_()
        out_hf, out = block(x_hf), moe(x)
        self.assertEqual(out.shape, out_hf.shape)
        self.assertEqual(out, out_hf, **self.FWD_TOL)
        grad_out = _x(out.shape, seed=4, requires_grad=False)
        out_hf.backward(grad_out)
        out.backward(grad_out)
        self.assertEqual(x.grad, x_hf.grad, **self.GRAD_TOL)
        hf_grads = hf_state_dict_to_moe(_grads(block))
        grads = _grads(moe)
        self.assertEqual(sorted(hf_grads), sorted(grads))  # every parameter has a match
        for n in grads:
            # the shared expert does not depend on the routing: float64 on both sides
            tol = TIGHT if n.startswith("shared_experts.") else self.GRAD_TOL
            self.assertEqual(grads[n], hf_grads[n], **tol, msg=n)

    def test_deepseek_bias_and_groups_matter(self):
        # otherwise the DeepSeek-V3 comparison would not exercise them
        block, moe = self._pair("deepseek-v3")
        x = _x((10, D_HF), requires_grad=False, seed=3)
        with torch.no_grad():
            _, ids, _, logits = moe.router(x)
            _, ids_no_bias, _ = ops.topk_route(
                logits,
                3,
                score_func="sigmoid",
                num_expert_groups=4,
                num_limited_groups=2,
                route_norm=True,
                route_scale=2.5,
            )
            _, ids_no_groups, _ = ops.topk_route(
                logits, 3, score_func="sigmoid", expert_bias=moe.router.expert_bias
            )
            _, _, hf_ids = block.gate(x)
        self.assertGreaterEqual(_choice_change(ids, ids_no_bias), MIN_BIAS_CHANGE)
        self.assertGreater(_choice_change(ids, ids_no_groups), 0.0)
        self.assertEqual(ids.sort(-1).values, hf_ids.sort(-1).values)  # HF: topk(sorted=False)


# --------------------------------------------------------------------------------------
# 2. the naive per-token float64 oracle (test/naive.py)

TINY_PRESETS = {
    "mixtral": dict(dim=8, hidden_dim=6, num_experts=4),
    "qwen2-moe": dict(dim=8, hidden_dim=6, num_experts=6, top_k=3, shared_hidden_dim=10),
    "qwen3-moe": dict(dim=8, hidden_dim=6, num_experts=8, top_k=3),
    # 8 groups of 2 experts scored by their best one, 2 kept (of 3: see deepseek-v3)
    "deepseek-v2": dict(
        dim=8, hidden_dim=6, num_experts=16, top_k=3, shared_hidden_dim=6, num_limited_groups=2
    ),
    # the preset's 8 groups of 2 experts, 2 kept (not 4: with 4 of 8 kept the top 3 experts
    # of these 11 tokens all lie in kept groups, and the group limit would change nothing)
    "deepseek-v3": dict(
        dim=8, hidden_dim=6, num_experts=16, top_k=3, shared_hidden_dim=6, num_limited_groups=2
    ),
}

OPTIONS = {
    "plain": dict(),
    "route_norm": dict(route_norm=True),
    "router_bias": dict(router_bias=True),
    "expert_bias": dict(expert_bias=True),
    "capacity_drops": dict(capacity_factor=0.5),
    "capacity_1.25": dict(capacity_factor=1.25, router_bias=True),
    "shared": dict(shared_hidden_dim=5),
    "shared_gate": dict(shared_hidden_dim=5, shared_gate=True),
    "softmax_topk": dict(score_func="softmax_topk"),
    "sigmoid_topk": dict(score_func="sigmoid_topk", expert_bias=True, route_norm=True),
    "sigmoid_groups": dict(
        score_func="sigmoid",
        num_expert_groups=2,
        num_limited_groups=1,
        route_norm=True,
        route_scale=2.5,
    ),
    "route_norm_eps": dict(score_func="sigmoid", route_norm=True, route_norm_eps=1e-6),
    "softmax_groups_max": dict(
        num_expert_groups=2, num_limited_groups=1, group_score="max", route_scale=16.0
    ),
    "k_equals_e": dict(top_k=4),
    "one_expert": dict(num_experts=1, top_k=1),
    "everything": dict(
        score_func="sigmoid",
        num_expert_groups=2,
        num_limited_groups=1,
        route_norm=True,
        expert_bias=True,
        router_bias=True,
        capacity_factor=0.6,
        shared_hidden_dim=5,
        shared_gate=True,
    ),
    # the composed experts: swiglu_limit=0.5 so that the clamps bite (checked in _check)
    "experts_bias": dict(experts_bias=True),
    "gate_up_interleaved": dict(gate_up_interleaved=True),
    "swiglu_limit": dict(swiglu_limit=0.5),  # HY-V4's clamped SwiGLU
    "swigluoai": dict(activation="swigluoai", swiglu_alpha=1.5),
    "gpt_oss": naive.GPT_OSS,
    # Nemotron-H: ungated relu2 experts (with biases here) and shared expert
    "relu2": dict(**naive.NEMOTRON_H, shared_hidden_dim=5, shared_activation="relu2"),
    "composed_capacity": dict(experts_bias=True, capacity_factor=0.5, shared_hidden_dim=5),
    # GLM-5-Next: both clamped; MiniMax-M3: swigluoai in both, clamped; the shared expert alone
    "shared_clamped": dict(swiglu_limit=0.5, shared_hidden_dim=5, shared_swiglu_limit=0.5),
    "shared_swigluoai": dict(
        activation="swigluoai",
        swiglu_limit=0.5,
        shared_hidden_dim=5,
        shared_activation="swigluoai",
        shared_swiglu_limit=0.5,
        shared_gate=True,
    ),
    "shared_only_clamped": dict(shared_hidden_dim=5, shared_swiglu_limit=0.5),
}

SHAPES = {"2d": (11, 8), "3d": (2, 5, 8)}


# NB (parameters that bite): a case named after an option must exercise it. _check asserts
# it on its own inputs with the naive router (never the implementation's decisions):
# capacity cases drop >= 10% of the assignments, expert-bias cases change >= 20% of the
# chosen (token, expert) pairs, group-limited cases choose differently from plain top-k.
MIN_DROP_FRACTION, MIN_BIAS_CHANGE = 0.10, 0.20
BIAS_SCALE = 0.5  # expert_bias ~ N(0, 0.5^2): enough to move >= 20% of the choices
LOGIT_BIAS_SCALE = 3.0  # the same on the logits' scale, N(0, 1.5^2) ("sigmoid_topk" biases them)


def _choice_change(ids, other):
    """Fraction of the (token, expert) assignments of ``ids`` absent from ``other``."""
    changed = sum(len(set(a) - set(b)) for a, b in zip(ids.tolist(), other.tolist()))
    return changed / max(ids.numel(), 1)


@instantiate_parametrized_tests
class TestMoENaive(TestCase):
    def _assert_options_bite(self, moe, x):
        cfg, state = moe.config, moe.state_dict()
        x_TD = x.detach().reshape(-1, cfg["dim"]).double()
        logits = x_TD @ state["router.weight"].double().t()
        if "router.bias" in state:
            logits = logits + state["router.bias"].double()
        kw = naive._route_kwargs(cfg)
        bias = state.get("router.expert_bias")
        _, ids, _ = naive.route(logits, cfg["top_k"], expert_bias=bias, **kw)
        if bias is not None:
            _, ids_no_bias, _ = naive.route(logits, cfg["top_k"], **kw)
            self.assertGreaterEqual(_choice_change(ids, ids_no_bias), MIN_BIAS_CHANGE, "bias")
        if (
            kw["num_expert_groups"] is not None
            and kw["num_limited_groups"] < kw["num_expert_groups"]
        ):
            plain = {**kw, "num_expert_groups": None, "num_limited_groups": None}
            _, ids_plain, _ = naive.route(logits, cfg["top_k"], expert_bias=bias, **plain)
            self.assertGreater(_choice_change(ids, ids_plain), 0.0, "group-limited routing")
        if cfg["swiglu_limit"] is not None and x_TD.shape[0] > 0:
            h = torch.einsum("efd,td->tef", state["experts.w13"].double(), x_TD)
            if "experts.b13" in state:
                h = h + state["experts.b13"].double()
            clamped = (h.abs() > cfg["swiglu_limit"]).double().mean()
            self.assertGreaterEqual(float(clamped), MIN_DROP_FRACTION, "clamps")
        if cfg["shared_swiglu_limit"] is not None and x_TD.shape[0] > 0:
            h = x_TD @ state["shared_experts.w13"].double().t()
            clamped = (h.abs() > cfg["shared_swiglu_limit"]).double().mean()
            self.assertGreaterEqual(float(clamped), MIN_DROP_FRACTION, "shared clamps")
        capacity = naive._capacity(cfg, x_TD.shape[0])
        if capacity is not None and x_TD.shape[0] > 0:
            _, _, dropped = naive.dispatch(ids, cfg["num_experts"], capacity=capacity)
            self.assertGreaterEqual(dropped / ids.numel(), MIN_DROP_FRACTION, "capacity")

    def _check(self, moe, x, expect_drops=None):
        """Forward vs naive.moe_layer, and input/param grads vs autograd of the naive loop."""
        self._assert_options_bite(moe, x)
        out = moe(x)
        ref, _, dropped = naive.moe_layer(x.detach(), moe.state_dict(), moe.config)
        self.assertEqual(out.shape, x.shape)
        self.assertEqual(out, ref, **TIGHT)
        if expect_drops is not None:
            self.assertEqual(dropped > 0, expect_drops)
        grad_out = _x(out.shape, seed=7, requires_grad=False)
        out.backward(grad_out)
        params = {n: p.detach().clone().requires_grad_() for n, p in moe.named_parameters()}
        state = {**params, **{n: b for n, b in moe.named_buffers() if n == "router.expert_bias"}}
        x_ref = x.detach().clone().requires_grad_()
        out_ref = naive.moe_layer_autograd(x_ref, state, moe.config)
        self.assertEqual(out_ref, ref, **TIGHT)  # the two oracles agree
        out_ref.backward(grad_out)
        self.assertEqual(x.grad, x_ref.grad, **TIGHT)
        for n, p in moe.named_parameters():
            self.assertEqual(p.grad, params[n].grad, **TIGHT, msg=n)

    @parametrize("preset", list(TINY_PRESETS))
    @parametrize("shape", list(SHAPES))
    def test_preset_matches_naive(self, preset, shape):
        self.assertEqual(set(TINY_PRESETS), set(PRESETS))  # a new preset needs a line here
        moe = _randomize(
            MoE.from_preset(preset, dtype=F64, **TINY_PRESETS[preset]), bias_scale=BIAS_SCALE
        )
        self._check(moe, _x(SHAPES[shape]))

    @parametrize("option", list(OPTIONS))
    @parametrize("shape", list(SHAPES))
    def test_option_matches_naive(self, option, shape):
        on_logits = OPTIONS[option].get("score_func") == "sigmoid_topk"
        scale = LOGIT_BIAS_SCALE if on_logits else BIAS_SCALE
        moe = _randomize(MoE(**{**BASE, **OPTIONS[option]}, dtype=F64), bias_scale=scale)
        if option == "capacity_1.25":  # a hot expert, so that a factor above 1 still drops
            with torch.no_grad():
                moe.router.bias.copy_(torch.tensor([6.0, 0.0, 0.0, 0.0]))
        factor = OPTIONS[option].get("capacity_factor")
        self._check(moe, _x(SHAPES[shape]), expect_drops=True if (factor or 1) < 1 else None)

    def test_training_mode_matches_naive(self):
        # train() only adds counting; values are the same
        moe = _randomize(MoE(**BASE, capacity_factor=0.75, shared_hidden_dim=5, dtype=F64))
        self._check(moe.train(), _x((2, 5, 8)), expect_drops=True)

    @parametrize("option", list(OPTIONS))
    def test_empty_input_every_option(self, option):
        # no tokens, every option's layer: zeros, in training (and a backward) and at
        # inference; a shared expert with another activation than plain SwiGLU once
        # failed here (its activation's output viewed as [0, -1])
        moe = _randomize(MoE(**{**BASE, **OPTIONS[option]}, dtype=F64))
        for shape in ((0, 8), (2, 0, 8)):
            x = _x(shape)
            out = moe.train()(x)
            self.assertEqual(out, torch.zeros(shape, dtype=F64), msg=str(shape))
            out.sum().backward()
            self.assertEqual(x.grad, torch.zeros(shape, dtype=F64), msg=str(shape))
            with torch.inference_mode():
                out = moe.eval()(x.detach())
            self.assertEqual(out, torch.zeros(shape, dtype=F64), msg=str(shape))

    @parametrize("shape", [(0, 8), (2, 0, 8)])
    @parametrize("aux_loss", ["switch", "sequence"])
    def test_empty_input(self, shape, aux_loss):
        moe = _randomize(
            MoE(
                **BASE,
                shared_hidden_dim=5,
                shared_gate=True,
                capacity_factor=1.0,
                aux_loss=aux_loss,
                aux_loss_coeff=0.1,
                z_loss_coeff=0.1,
                dtype=F64,
            )
        ).train()
        x = _x(shape)
        out = moe(x)
        self.assertEqual(out, torch.zeros(shape, dtype=F64))
        out.sum().backward()
        self.assertEqual(x.grad, torch.zeros(shape, dtype=F64))
        for n, p in moe.named_parameters():
            self.assertTrue(p.grad is None or not p.grad.any(), msg=n)
        self.assertEqual(moe.tokens_per_expert, torch.zeros(4, dtype=torch.int64))
        self.assertEqual(
            moe.last_losses,
            {"aux_loss": torch.tensor(0.0, dtype=F64), "z_loss": torch.tensor(0.0, dtype=F64)},
        )

    def test_composed_inference_matches_training(self):
        """eval + no_grad (the inference path: rows gathered, then the composed experts)
        equals the training forward bit for bit, capacity drops included."""
        for opt in ("gpt_oss", "composed_capacity", "relu2"):
            moe = _randomize(MoE(**{**BASE, **OPTIONS[opt]}, dtype=F64))
            x = _x((2, 5, 8), requires_grad=False)
            ref = moe(x)
            with torch.inference_mode():
                got = moe.eval()(x)
            self.assertEqual(got, ref, **EXACT, msg=opt)

    def test_gradcheck_composed(self):
        moe = _randomize(
            MoE(dim=3, hidden_dim=2, num_experts=3, top_k=2, **OPTIONS["gpt_oss"], dtype=F64)
        )
        names = [n for n, _ in moe.named_parameters()]
        self.assertIn("experts.b2", names)
        x = _x((5, 3))
        inputs = (x, *(p.detach().clone().requires_grad_() for p in moe.parameters()))

        def fn(x, *params):
            return torch.func.functional_call(moe, dict(zip(names, params)), (x,))

        self.assertTrue(torch.autograd.gradcheck(fn, inputs))

    def test_gradcheck(self):
        moe = _randomize(
            MoE(
                dim=3,
                hidden_dim=2,
                num_experts=3,
                top_k=2,
                route_norm=True,
                router_bias=True,
                expert_bias=True,
                capacity_factor=0.75,
                shared_hidden_dim=2,
                shared_gate=True,
                dtype=F64,
            )
        )
        names = [n for n, _ in moe.named_parameters()]
        x = _x((5, 3))
        self.assertGreater(naive.moe_layer(x.detach(), moe.state_dict(), moe.config)[2], 0)
        inputs = (x, *(p.detach().clone().requires_grad_() for p in moe.parameters()))

        def fn(x, *params):
            return torch.func.functional_call(moe, dict(zip(names, params)), (x,))

        self.assertTrue(torch.autograd.gradcheck(fn, inputs))


# --------------------------------------------------------------------------------------
# 3. load-balancing losses

LN2, LN3 = math.log(2.0), math.log(3.0)


@instantiate_parametrized_tests
class TestMoELosses(TestCase):
    def test_switch_aux_loss_by_hand(self):
        # probs: token 0 [1/2, 1/2], token 1 [3/4, 1/4] -> P = [5/8, 3/8]
        logits = torch.tensor([[0.0, 0.0], [LN3, 0.0]])
        # f = [1, 0]: E * f . P = 2 * 5/8
        self.assertEqual(switch_aux_loss(logits, torch.tensor([2, 0]), 1), torch.tensor(1.25))
        # f = [0, 1]: 2 * 3/8
        self.assertEqual(switch_aux_loss(logits, torch.tensor([0, 2]), 1), torch.tensor(0.75))
        # E=4, K=2: probs [1/2, 1/4, 1/8, 1/8] and [1/4] * 4 -> P = [3/8, 1/4, 3/16, 3/16];
        # counts [2, 1, 1, 0] -> f = [1/2, 1/4, 1/4, 0]; 4 * (3/16 + 1/16 + 3/64) = 19/16
        logits = torch.tensor([[2 * LN2, LN2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
        loss = switch_aux_loss(logits, torch.tensor([2, 1, 1, 0]), 2)
        self.assertEqual(loss, torch.tensor(19 / 16))
        # sigmoid scores are normalized per token: [3/4, 1/2] -> [3/5, 2/5]; [1/2, 1/2]
        logits = torch.tensor([[LN3, 0.0], [0.0, 0.0]])
        loss = switch_aux_loss(logits, torch.tensor([2, 0]), 1, score_func="sigmoid")
        self.assertEqual(loss, torch.tensor(2 * (3 / 5 + 1 / 2) / 2))

    def test_sequence_aux_loss_by_hand(self):
        # B=2, S=2, E=2, K=1, sigmoid scores normalized per token
        logits = torch.tensor(
            [
                [LN3, 0.0],  # s' = [3/5, 2/5]
                [0.0, 0.0],  # s' = [1/2, 1/2]
                [0.0, LN3],  # s' = [2/5, 3/5]
                [-LN3, LN3],  # s' = [1/4, 3/4]
            ]
        )
        ids = torch.tensor([[0], [0], [1], [0]])
        # seq 0: f = E/(K*S) * [2, 0] = [2, 0], P = [11/20, 9/20] -> 11/10
        # seq 1: f = [1, 1], P = [13/40, 27/40] -> 1
        loss = sequence_aux_loss(logits, ids, 1, 2)
        self.assertEqual(loss, torch.tensor((1.1 + 1.0) / 2))
        # one sequence of 4: f = 2/4 * [3, 1] = [3/2, 1/2], P = [7/4, 9/4] / 4
        loss = sequence_aux_loss(logits, ids, 1, 4)
        self.assertEqual(loss, torch.tensor((1.5 * 1.75 + 0.5 * 2.25) / 4))

    def test_router_z_loss_by_hand(self):
        # logsumexp: [0, 0] -> ln 2; [ln 3, 0] -> ln 4
        logits = torch.tensor([[0.0, 0.0], [LN3, 0.0]])
        self.assertEqual(router_z_loss(logits), torch.tensor((LN2**2 + (2 * LN2) ** 2) / 2))

    def test_losses_refuse_bad_arguments(self):
        logits, counts, ids = torch.zeros(4, 3), torch.tensor([2, 1, 1]), torch.zeros(4, 1).long()
        cases = [
            (
                lambda: switch_aux_loss(logits, counts, 0),
                r"switch_aux_loss: top_k must be a positive integer, got 0",
            ),
            (
                lambda: switch_aux_loss(logits, counts, 1.5),
                r"top_k must be a positive integer, got 1.5",
            ),
            (
                lambda: switch_aux_loss(logits, counts, 1, score_func="softplus"),
                r"switch_aux_loss: unknown score_func 'softplus'; expected one of",
            ),
            (
                lambda: switch_aux_loss(logits, counts[:2], 1),
                r"expected tokens_per_expert of shape \[3\] \(E of the logits\), got \[2\]",
            ),
            (
                lambda: sequence_aux_loss(logits, ids, 1, 2, score_func="tanh"),
                r"sequence_aux_loss: unknown score_func 'tanh'",
            ),
            (
                lambda: sequence_aux_loss(logits, ids, 2, 2),
                r"sequence_aux_loss: expected expert_ids of shape \[4, 2\] \(\[T, top_k\]\), got \[4, 1\]",
            ),
            (
                lambda: router_z_loss(torch.zeros(4)),
                r"router_z_loss: expected logits to be a 2D floating-point tensor \[T, E\], got 1D",
            ),
            (
                lambda: router_z_loss(torch.zeros(4, 3, dtype=torch.int64)),
                r"got 2D torch.int64",
            ),
        ]
        for i, (call, message) in enumerate(cases):
            with self.subTest(i), self.assertRaisesRegex(ValueError, message):
                call()
        # the op's schema says it first where the call goes through the op
        # (TORCH_MOE_DIRECT_OPS=0)
        with self.assertRaisesRegex(
            (ValueError, RuntimeError),
            r"topk_route: k must be an integer, got 2.0|Expected a value of type 'int' for argument 'k'",
        ):
            ops.topk_route(logits, 2.0)

    def test_balanced_is_one(self):
        logits = torch.zeros(8, 4)
        ids = torch.arange(16).remainder(4).view(8, 2)
        counts = torch.full((4,), 4)
        self.assertEqual(switch_aux_loss(logits, counts, 2), torch.tensor(1.0))
        self.assertEqual(
            switch_aux_loss(logits, counts, 2, score_func="sigmoid"), torch.tensor(1.0)
        )
        self.assertEqual(sequence_aux_loss(logits, ids, 2, 4), torch.tensor(1.0))
        # balanced counts give 1 whatever the probabilities (sum_e P_e = 1)
        self.assertEqual(switch_aux_loss(torch.randn(8, 4), counts, 2), torch.tensor(1.0))

    @parametrize("aux_loss", ["switch", "sequence"])
    @parametrize("scale", [1.0, 0.25])
    def test_injected_gradient(self, aux_loss, scale):
        c, z = 0.3, 0.05
        kw = dict(**BASE, score_func="sigmoid", route_norm=True, shared_hidden_dim=5, dtype=F64)
        moe = _randomize(MoE(**kw, aux_loss=aux_loss, aux_loss_coeff=c, z_loss_coeff=z))
        moe.aux_loss_scale = scale
        plain = copy.deepcopy(moe)
        plain.aux_loss_coeff = plain.z_loss_coeff = 0.0
        x = _x((2, 6, 8))
        x_plain = x.detach().clone().requires_grad_()
        grad_out = _x((2, 6, 8), seed=5, requires_grad=False)
        out, out_plain = moe(x), plain(x_plain)
        self.assertEqual(out, out_plain, **EXACT)  # the losses do not change the output
        out.backward(grad_out)
        out_plain.backward(grad_out)
        self.assertEqual(plain.last_losses, {})

        # the losses computed separately from the same logits
        w = moe.router.weight.detach().clone().requires_grad_()
        x_sep = x.detach().clone().requires_grad_()
        logits = x_sep.reshape(-1, 8) @ w.t()
        _, ids, counts = ops.topk_route(logits.detach(), 2, score_func="sigmoid", route_norm=True)
        if aux_loss == "switch":
            aux = switch_aux_loss(logits, counts, 2, score_func="sigmoid")
        else:
            aux = sequence_aux_loss(logits, ids, 2, 6, score_func="sigmoid")
        zl = router_z_loss(logits)
        self.assertEqual(moe.last_losses["aux_loss"], aux.detach(), **TIGHT)
        self.assertEqual(moe.last_losses["z_loss"], zl.detach(), **TIGHT)
        d_w, d_x = torch.autograd.grad(c * aux + z * zl, [w, x_sep])

        grads, grads_plain = _grads(moe), _grads(plain)
        self.assertEqual(
            grads["router.weight"] - grads_plain["router.weight"], scale * d_w, **TIGHT
        )
        self.assertEqual(x.grad - x_plain.grad, scale * d_x, **TIGHT)
        for n in grads:
            if n != "router.weight":
                self.assertEqual(grads[n], grads_plain[n], **EXACT, msg=n)

    def test_last_losses(self):
        moe = _randomize(MoE(**BASE, aux_loss="switch", aux_loss_coeff=0.1, dtype=F64))
        x = _x((6, 8))
        moe(x)
        self.assertEqual(sorted(moe.last_losses), ["aux_loss"])
        self.assertFalse(moe.last_losses["aux_loss"].requires_grad)
        moe.z_loss_coeff = 0.01
        with torch.no_grad():
            moe(x)  # computed for logging without grad too
        self.assertEqual(sorted(moe.last_losses), ["aux_loss", "z_loss"])
        logits = x.detach() @ moe.router.weight.detach().t()
        self.assertEqual(moe.last_losses["z_loss"], router_z_loss(logits), **TIGHT)


# --------------------------------------------------------------------------------------
# 4. aux-loss-free balancing: expert_bias, tokens_per_expert, load_stats


def _one_hot_router(moe: MoE) -> MoE:
    """Router weight 10*I: the one-hot input e_i picks expert i first."""
    with torch.no_grad():
        moe.router.weight.copy_(10 * torch.eye(moe.num_experts, moe.dim))
    return moe


class TestMoEExpertBias(TestCase):
    def test_update_expert_bias_by_hand(self):
        moe = MoE(**BASE, expert_bias=True)
        moe.router.expert_bias.copy_(torch.tensor([0.3, 0.0, 0.0, 0.0]))
        moe.tokens_per_expert.copy_(torch.tensor([4, 2, 2, 0]))
        load = moe.update_expert_bias(0.1)
        self.assertEqual(load, torch.tensor([4.0, 2.0, 2.0, 0.0]))
        # mean load 2: sign(mean - load) = [-1, 0, 0, 1] -> [0.2, 0, 0, 0.1], minus its mean 0.075
        self.assertEqual(moe.router.expert_bias, torch.tensor([0.125, -0.075, -0.075, 0.025]))
        self.assertEqual(moe.tokens_per_expert, torch.zeros(4, dtype=torch.int64))

    def test_update_after_training_forwards(self):
        moe = _randomize(MoE(**BASE, expert_bias=True, dtype=torch.float32)).train()
        x = _x((16, 8), dtype=torch.float32, requires_grad=False)
        bias0 = moe.router.expert_bias.clone()
        _, _, counts, _ = moe.router(x)
        moe(x)
        moe(x)
        self.assertEqual(moe.tokens_per_expert, 2 * counts)
        with torch.no_grad():
            moe.eval()(x)  # eval forwards are not counted
        self.assertEqual(moe.tokens_per_expert, 2 * counts)
        load = (2 * counts).float()
        expected = bias0 + 0.01 * torch.sign(load.mean() - load)
        moe.update_expert_bias(0.01)
        self.assertEqual(moe.router.expert_bias, expected - expected.mean())
        self.assertEqual(moe.tokens_per_expert.sum(), 0)

    def test_bias_changes_choice_not_weights(self):
        moe = _randomize(MoE(**BASE, expert_bias=True, dtype=F64))
        x = _x((12, 8), requires_grad=False)
        with torch.no_grad():
            w0, ids0, _, logits = moe.router(x)
            moe.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
            w1, ids1, counts1, logits1 = moe.router(x)
        self.assertEqual(logits1, logits, **EXACT)
        self.assertNotEqual(ids1, ids0)
        self.assertEqual(ids1[:, 0], torch.full((12,), 3))  # always chosen first
        self.assertEqual(counts1[3], 12)
        # the weights are the unbiased softmax scores of the chosen experts
        self.assertEqual(w1, torch.softmax(logits, -1).gather(1, ids1), **TIGHT)
        self.assertEqual(w0, torch.softmax(logits, -1).gather(1, ids0), **TIGHT)

    def test_update_without_bias_raises(self):
        with self.assertRaisesRegex(RuntimeError, "built with expert_bias=False"):
            MoE(**BASE).update_expert_bias(0.1)

    def test_load_stats(self):
        moe = _one_hot_router(MoE(dim=4, hidden_dim=3, num_experts=4, top_k=1)).train()
        x = torch.eye(4)[[0, 0, 0, 3]]
        moe(x)
        stats = moe.load_stats()
        self.assertEqual(stats["tokens_per_expert"], [3, 0, 0, 1])
        self.assertEqual(stats["imbalance"], 3.0)  # max 3 / mean 1
        moe.reset_load_stats()
        self.assertTrue(math.isnan(moe.load_stats()["imbalance"]))

    def test_checkpoint_counts_once_and_matches(self):
        kw = dict(**BASE, expert_bias=True, shared_hidden_dim=5, shared_gate=True)
        kw.update(aux_loss="switch", aux_loss_coeff=0.1, z_loss_coeff=0.01)
        moe = _randomize(MoE(**kw, dtype=torch.float32)).train()
        x = _x((2, 6, 8), dtype=torch.float32)
        grad_out = _x((2, 6, 8), dtype=torch.float32, seed=5, requires_grad=False)
        out = moe(x)
        out.backward(grad_out)
        counts, grads, x_grad = moe.tokens_per_expert.clone(), _grads(moe), x.grad
        self.assertEqual(counts.sum(), 2 * 6 * 2)

        moe.zero_grad(set_to_none=True)
        moe.reset_load_stats()
        x_ckpt = x.detach().clone().requires_grad_()
        out_ckpt = checkpoint(moe, x_ckpt, use_reentrant=False)
        out_ckpt.backward(grad_out)
        self.assertEqual(moe.tokens_per_expert, counts)  # the recompute is not counted again
        self.assertEqual(out_ckpt, out, **EXACT)
        self.assertEqual(x_ckpt.grad, x_grad, **EXACT)
        for n, g in _grads(moe).items():
            self.assertEqual(g, grads[n], **EXACT, msg=n)  # incl. the re-attached aux losses

    def test_dropped_assignments_counted(self):
        moe = MoE(8, 6, 4, 2, capacity_factor=0.5)
        x = _x((10, 8), dtype=torch.float32)
        _, ids, _, _ = moe.router(x)
        capacity = math.ceil(0.5 * 10 * 2 / 4)
        expected = int(ops.permute_indices(ids, 4, capacity=capacity).num_dropped)
        self.assertGreater(expected, 0)
        moe(x)
        moe(x)
        stats = moe.load_stats()
        self.assertEqual(stats["dropped_assignments"], 2 * expected)
        self.assertEqual(sum(stats["tokens_per_expert"]), 2 * 10 * 2)  # routed, before drops
        moe.eval()
        moe(x)  # eval forwards are not counted
        self.assertEqual(moe.load_stats()["dropped_assignments"], 2 * expected)


# --------------------------------------------------------------------------------------
# 5. autocast


def assert_autocast_grads_close(test, got, moe, x, grad_out):
    """The output and every gradient of a bf16-autocast forward/backward (``got``: "out",
    "x" and the parameter names) at the rounding level of naive.moe_layer_autograd with the
    experts emulated in bf16 (their casts rounded, so are their gradients), against the
    float64 loop (tolerances.assert_rounding_level: measured ratio 0.4-1.2 over 6 seeds)."""
    res = {}
    for lowp in (None, torch.bfloat16):
        params = {n: p.detach().double().requires_grad_() for n, p in moe.named_parameters()}
        x64 = x.detach().double().requires_grad_()
        out = naive.moe_layer_autograd(x64, params, moe.config, lowp=lowp)
        out.backward(grad_out.double())
        res[lowp] = {"out": out.detach(), "x": x64.grad, **{n: p.grad for n, p in params.items()}}
    test.assertEqual(sorted(got), sorted(res[None]))
    for key, value in got.items():
        tolerances.assert_rounding_level(
            test, value, res[None][key], res[torch.bfloat16][key], multiple=2.0, msg=key
        )


@instantiate_parametrized_tests
class TestMoEAutocast(TestCase):
    @parametrize("experts", ["swiglu", "gpt_oss"])
    def test_bf16_autocast_gradient_values(self, experts):
        kw = {} if experts == "swiglu" else OPTIONS["gpt_oss"]
        moe = _randomize(MoE(**{**BASE, "route_norm": True, **kw}, dtype=torch.float32))
        x = _x((3, 7, 8), dtype=torch.float32)
        grad_out = _x((3, 7, 8), dtype=torch.float32, seed=5, requires_grad=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = moe(x)
        out.float().backward(grad_out)
        got = {"out": out.detach(), "x": x.grad, **_grads(moe)}
        assert_autocast_grads_close(self, got, moe, x, grad_out)

    def test_bf16_autocast(self):
        kw = dict(**BASE, shared_hidden_dim=5, shared_gate=True, route_norm=True)
        moe = _randomize(MoE(**kw, dtype=torch.float32))
        x = _x((3, 7, 8), dtype=torch.float32)
        seen = {}
        moe.router.register_forward_hook(lambda m, i, o: seen.__setitem__("router", o))
        moe.experts.register_forward_hook(lambda m, i, o: seen.__setitem__("experts", o))
        with torch.no_grad():
            ref = moe(x)
            ref_w, ref_ids, _, ref_logits = seen["router"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = moe(x)
        weights, ids, _, logits = seen["router"]
        self.assertEqual(logits.dtype, torch.float32)
        self.assertEqual(weights.dtype, torch.float32)
        # the router saw the fp32 input: bitwise the fp32 routing
        self.assertEqual(logits, ref_logits, **EXACT)
        self.assertEqual(weights, ref_w, **EXACT)
        self.assertEqual(ids, ref_ids)
        self.assertEqual(seen["experts"].dtype, torch.bfloat16)
        self.assertEqual(out.dtype, torch.bfloat16)
        self.assertEqual(out.float(), ref, atol=2e-2, rtol=2e-2)
        out.float().square().sum().backward()
        for n, p in moe.named_parameters():
            self.assertEqual(p.grad.dtype, torch.float32, msg=n)
            self.assertTrue(p.grad.isfinite().all(), msg=n)
        self.assertEqual(x.grad.dtype, torch.float32)


# --------------------------------------------------------------------------------------
# 6. torch.compile, 7. determinism


def _fwd_bwd(module, x, grad_out):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = module(x)
    out.backward(grad_out)
    return out.detach(), x.grad, _grads(getattr(module, "_orig_mod", module))


COMPILE_KW = dict(
    **BASE,
    route_norm=True,
    shared_hidden_dim=5,
    shared_gate=True,
    aux_loss="switch",
    aux_loss_coeff=0.1,
    z_loss_coeff=0.01,
)


@instantiate_parametrized_tests
class TestMoECompile(TestCase):
    def _compare(self, backend, tol, **kw):
        """Forward + backward of torch.compile(fullgraph=True) vs eager; returns the code."""
        torch._dynamo.reset()
        moe = _randomize(MoE(**{**COMPILE_KW, **kw}, dtype=torch.float32)).train()
        x = _x((2, 6, 8), dtype=torch.float32)
        grad_out = _x((2, 6, 8), dtype=torch.float32, seed=5, requires_grad=False)
        out, x_grad, grads = _fwd_bwd(moe, x, grad_out)
        counts = moe.tokens_per_expert.clone()
        compiled = torch.compile(moe, fullgraph=True, backend=backend)
        (c_out, c_x_grad, c_grads), code = run_and_get_code(lambda: _fwd_bwd(compiled, x, grad_out))
        self.assertEqual(c_out, out, **tol)
        self.assertEqual(c_x_grad, x_grad, **tol)
        for n in grads:
            self.assertEqual(c_grads[n], grads[n], **tol, msg=n)
        self.assertEqual(moe.tokens_per_expert, 2 * counts)  # the buffer update is traced
        self.assertEqual(sorted(moe.last_losses), ["aux_loss", "z_loss"])
        return code

    def test_compile_aot_eager(self):
        self._compare("aot_eager", EXACT)  # the same kernels: bitwise

    def test_compile_inductor(self):  # ~45 s with a cold inductor cache on 2 CPU cores
        # inductor fuses the elementwise math around the ops (fp32 reassociation)
        fwd, bwd = self._compare("inductor", dict(atol=1e-5, rtol=1e-5))
        # the custom ops are called as they are (opaque to inductor), in this order; the
        # experts gather their rows from the tokens (no permute op, no [M, D] rows saved)
        FileCheck().check("torch.ops.torch_moe.topk_route.default(").check_not(
            "torch.ops.torch_moe.permute.default("
        ).check("torch.ops.torch_moe.grouped_swiglu.default(").check(
            "torch.ops.torch_moe.unpermute.default("
        ).run(fwd)
        FileCheck().check("torch.ops.torch_moe.grouped_swiglu_backward.default(").check(
            "torch.ops.torch_moe.topk_route_backward.default("
        ).run(bwd)

    @parametrize("experts", ["gpt_oss", "relu2"])
    def test_compile_composed(self, experts):
        """GPT-OSS-like experts (biases, interleaved gate / up, clamped activation) and
        Nemotron-H-like ones (ungated relu2, biases, a relu2 shared expert): bitwise under
        aot_eager; under Inductor the two grouped GEMMs around the glu op forward, their
        two weight gradients and the glu backward."""
        self._compare("aot_eager", EXACT, **OPTIONS[experts])
        fwd, bwd = self._compare("inductor", dict(atol=1e-5, rtol=1e-5), **OPTIONS[experts])
        FileCheck().check("torch.ops.torch_moe.gather_grouped_mm.default(").check(
            "torch.ops.torch_moe.glu.default("
        ).check("torch.ops.torch_moe.grouped_mm.default(").check_not(
            "torch.ops.torch_moe.grouped_swiglu"
        ).run(fwd)
        FileCheck().check_count("torch.ops.torch_moe.grouped_mm_wgrad.default(", 2).run(bwd)
        FileCheck().check("torch.ops.torch_moe.glu_backward.default(").check_not(
            "grouped_swiglu_backward"
        ).run(bwd)


class TestSharedExpertsDense(TestCase):
    """The shared expert's two GEMMs (``moe._dense``): where the CPU multiplies a half dtype
    by its fp32 upcast, by the grouped GEMM op as one group (the routed experts' math: fp32
    sums, one rounding), not oneDNN's emulated half GEMM; elsewhere ``F.linear`` itself."""

    def _case(self, shape, n, dtype=torch.bfloat16, seed=0):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(*shape, generator=g).to(dtype).requires_grad_()
        w = (torch.randn(n, shape[-1], generator=g) / 8).to(dtype).requires_grad_()
        dy = torch.randn(*shape[:-1], n, generator=g).to(dtype)
        return x, w, dy

    def _bound_check(self, got, a, b, msg):
        # got = a @ b (2-D) within the fp32-accumulated GEMM's rounding bound into got's dtype
        exact = a.double() @ b.double()
        products = a.double().abs() @ b.double().abs()
        bound = tolerances.gemm_bound(products, a.shape[1], exact, torch.float32, got.dtype)
        tolerances.assert_within(self, got, exact, bound, msg)

    def test_upcast_runs_the_grouped_gemm_within_the_fp32_bound(self):
        from torch_moe._ops import _cpu_probe
        from torch_moe.nn.modules import moe as moe_module

        for shape, n in (((37, 24), 40), ((2, 5, 24), 16), ((0, 24), 8)):
            x, w, dy = self._case(shape, n)
            with self.subTest(shape=shape), _cpu_probe.force(half_gemm="fp32"):
                spy = unittest.mock.patch.object(moe_module.ops, "grouped_mm", wraps=ops.grouped_mm)
                with spy as grouped:
                    y = moe_module._dense(x, w)
                self.assertEqual(grouped.call_count, 1)
                self.assertEqual(y.shape, (*shape[:-1], n))
                self.assertEqual(y.dtype, torch.bfloat16)
                y.backward(dy)
                rows, dy2 = x.detach().reshape(-1, shape[-1]), dy.reshape(-1, n)
                self._bound_check(y.detach().reshape(-1, n), rows, w.detach().t(), "y")
                self._bound_check(x.grad.reshape(-1, shape[-1]), dy2, w.detach(), "dx")
                self._bound_check(w.grad, dy2.t(), rows, "dw")

    def test_elsewhere_f_linear_itself(self):
        # a CPU with native half GEMMs, fp32, autocast's mixed dtypes: F.linear's bits and
        # no grouped GEMM
        from torch_moe._ops import _cpu_probe
        from torch_moe.nn.modules import moe as moe_module

        x, w, _ = self._case((9, 24), 16)
        cases = [
            ("native", x, w),
            ("fp32", x.float(), w.float()),
            ("fp32", x, w.float()),
        ]
        for half_gemm, a, b in cases:
            with self.subTest(half_gemm=half_gemm, x=str(a.dtype), w=str(b.dtype)):
                with _cpu_probe.force(half_gemm=half_gemm):
                    spy = unittest.mock.patch.object(moe_module.ops, "grouped_mm")
                    with spy as grouped:
                        if a.dtype != b.dtype:
                            with torch.autocast("cpu", torch.bfloat16):
                                got, want = moe_module._dense(a, b), F.linear(a, b)
                        else:
                            got, want = moe_module._dense(a, b), F.linear(a, b)
                    grouped.assert_not_called()
                    self.assertEqual(got, want, atol=0, rtol=0)

    def test_layer_with_shared_expert_where_half_gemms_upcast(self):
        # the layer's shared expert through _dense (both GEMMs, forward): its output within
        # the bound of the fp32 upcast's per GEMM, so the layers agree to bf16's rounding
        # of the two GEMMs and the activation
        from torch_moe._ops import _cpu_probe

        torch.manual_seed(0)
        moe = MoE(24, 16, 4, 2, shared_hidden_dim=32, dtype=torch.bfloat16)
        x = torch.randn(19, 24, dtype=torch.bfloat16)
        shared = moe.shared_experts
        calls = []
        real = ops.grouped_mm

        def counting(*args):
            calls.append(args[1].shape)
            return real(*args)

        with _cpu_probe.force(half_gemm="fp32"), torch.no_grad():
            with unittest.mock.patch.object(torch_moe.nn.modules.moe.ops, "grouped_mm", counting):
                got = shared(x)
            h = (x.float() @ shared.w13.float().t()).bfloat16()
            gate, up = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
            want = (a.float() @ shared.w2.float().t()).bfloat16()
        self.assertEqual(calls, [(1, 24, 64), (1, 32, 24)])
        # (each GEMM's fp32 sums in another order than torch.mm's: one bf16 ulp at most)
        self.assertEqual(got, want, atol=0, rtol=2**-7)


class TestMoEDeterminism(TestCase):
    def test_bitwise_repeatable(self):
        for dtype in (torch.float32, torch.bfloat16):
            kw = dict(**COMPILE_KW, capacity_factor=0.75, expert_bias=True)
            moe = _randomize(MoE(**kw, dtype=dtype)).train()
            x = _x((3, 8, 8), dtype=dtype)
            grad_out = _x((3, 8, 8), dtype=dtype, seed=5, requires_grad=False)
            out1, x_grad1, grads1 = _fwd_bwd(moe, x, grad_out)
            out2, x_grad2, grads2 = _fwd_bwd(moe, x, grad_out)
            self.assertEqual(out2, out1, **EXACT)
            self.assertEqual(x_grad2, x_grad1, **EXACT)
            for n in grads1:
                self.assertEqual(grads2[n], grads1[n], **EXACT, msg=n)


# --------------------------------------------------------------------------------------
# 8. bad input


class TestMoEErrors(TestCase):
    def test_bad_sizes(self):
        for name in ("dim", "hidden_dim", "num_experts"):
            for bad in (0, -3):
                with self.assertRaisesRegex(
                    ValueError, rf"MoE: {name} must be a positive integer, got {bad}"
                ):
                    MoE(**{**BASE, name: bad})

    def test_bad_top_k(self):
        for bad in (0, 5):
            with self.assertRaisesRegex(
                ValueError, rf"top_k must be in \[1, num_experts=4\], got {bad}"
            ):
                MoE(**{**BASE, "top_k": bad})

    def test_bad_activation(self):
        with self.assertRaisesRegex(
            ValueError,
            r"MoE: activation must be one of \('swiglu', 'swigluoai', 'relu2'\), got 'gelu'",
        ):
            MoE(**BASE, activation="gelu")
        with self.assertRaisesRegex(ValueError, r"MoE: swigluoai needs swiglu_alpha > 0, got 0.0"):
            MoE(**BASE, activation="swigluoai", swiglu_alpha=0.0)
        MoE(**BASE, swiglu_alpha=0.0)  # only swigluoai reads it
        with self.assertRaisesRegex(ValueError, r"MoE: swiglu_limit must be > 0 or None, got -1.0"):
            MoE(**BASE, swiglu_limit=-1.0)
        with self.assertRaisesRegex(
            ValueError,
            r"glu: expected h \[M, 2F\] \(gate and up columns\) in one of .*, got \[3, 5\]",
        ):
            torch_moe.nn.functional.glu_activation(torch.zeros(3, 5))

    def test_hf_state_dict_bad_keys(self):
        w = torch.zeros(4, 8)
        sd = hf_state_dict_to_moe(
            {
                "router.bias": torch.ones(4),
                "experts.gate_up_proj_bias": torch.ones(4, 12),
                "experts.down_proj_bias": torch.ones(4, 8),
            }
        )
        self.assertEqual(sorted(sd), ["experts.b13", "experts.b2", "router.bias"])
        with self.assertRaisesRegex(KeyError, r"unexpected key 'gate.scale'"):
            hf_state_dict_to_moe({"gate.weight": w, "gate.scale": torch.zeros(4)})
        with self.assertRaisesRegex(
            KeyError, r"two keys map to 'router.weight', the second 'router.weight'"
        ):
            hf_state_dict_to_moe({"gate.weight": w, "router.weight": w})

    def test_unknown_preset(self):
        valid = r"\['deepseek-v2', 'deepseek-v3', 'mixtral', 'qwen2-moe', 'qwen3-moe'\]"
        with self.assertRaisesRegex(ValueError, rf"unknown preset 'gpt-5'; valid presets: {valid}"):
            MoE.from_preset("gpt-5", dim=8)

    def test_bad_capacity_factor(self):
        for bad in (0, -1.5, math.inf, math.nan):  # inf once failed in the forward
            with self.assertRaisesRegex(
                ValueError, rf"capacity_factor must be finite and > 0, or None, got {bad}"
            ):
                MoE(**BASE, capacity_factor=bad)

    def test_bad_sizes_and_coefficients(self):
        cases = [
            (dict(dim=True), r"MoE: dim must be a positive integer, got True"),
            (dict(top_k=True), r"MoE: top_k must be in \[1, num_experts=4\], got True"),
            (dict(shared_hidden_dim=2.5), r"shared_hidden_dim must be an integer >= 0, got 2.5"),
            (
                dict(aux_loss_coeff=math.nan),
                r"loss coefficients must be finite and >= 0, got aux_loss_coeff=nan",
            ),
            (
                dict(z_loss_coeff=math.inf),
                r"must be finite and >= 0, got aux_loss_coeff=0.0, z_loss_coeff=inf",
            ),
        ]
        for kw, message in cases:
            with self.subTest(**kw), self.assertRaisesRegex(ValueError, message):
                MoE(**{**BASE, **kw})

    def test_bad_bias_rate(self):
        # a NaN or inf rate made the bias NaN, after which every forward refused it
        moe = MoE(**BASE, expert_bias=True)
        for bad in (math.nan, math.inf, -1e-3, "1e-3", True):
            with (
                self.subTest(rate=bad),
                self.assertRaisesRegex(
                    ValueError, rf"update_expert_bias: rate must be finite and >= 0, got {bad!r}"
                ),
            ):
                moe.update_expert_bias(bad)
        self.assertTrue(torch.isfinite(moe.router.expert_bias).all())

    def test_bad_input_dim(self):
        moe = MoE(**BASE)
        with self.assertRaisesRegex(ValueError, r"input's last dim to be dim=8, got \[2, 3, 5\]"):
            moe(torch.randn(2, 3, 5))

    def test_shared_gate_without_shared_expert(self):
        with self.assertRaisesRegex(ValueError, "shared_gate=True needs shared_hidden_dim > 0"):
            MoE(**BASE, shared_gate=True)

    def test_unknown_aux_loss(self):
        with self.assertRaisesRegex(
            ValueError, r"aux_loss must be one of \(None, 'switch', 'sequence'\), got 'gshard'"
        ):
            MoE(**BASE, aux_loss="gshard")

    def test_bad_groups(self):
        kw = dict(dim=8, hidden_dim=6, top_k=2)
        with self.assertRaisesRegex(
            ValueError, r"num_experts \(6\) must be divisible by num_expert_groups \(4\)"
        ):
            MoE(**kw, num_experts=6, num_expert_groups=4, num_limited_groups=2)
        with self.assertRaisesRegex(
            ValueError, r"num_limited_groups \(5\) must be in \[1, num_expert_groups=4\]"
        ):
            MoE(**kw, num_experts=8, num_expert_groups=4, num_limited_groups=5)
        with self.assertRaisesRegex(ValueError, r"leaves 2 experts, fewer than k \(3\)"):
            MoE(**{**kw, "top_k": 3}, num_experts=8, num_expert_groups=4, num_limited_groups=1)


# --------------------------------------------------------------------------------------
# 9. saved activations


def _saved_bytes(module, x):
    """Bytes of the distinct storages saved for backward by one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = (s.nbytes(), t.dtype, tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(n for n, _, _ in seen.values()), sorted(seen.values(), key=str)


class _PerExpertLoop(torch.nn.Module):
    """The HF transformers (Mixtral) eager-experts pattern, sharing ``moe``'s weights."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return _per_expert_loop(self.moe, x)


def _per_expert_loop(moe, x):
    logits = F.linear(x, moe.router.weight)
    probs = torch.softmax(logits.float(), dim=-1)
    top_w, top_i = torch.topk(probs, moe.top_k, dim=-1)
    top_w = (top_w / top_w.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(top_i, num_classes=moe.num_experts).permute(2, 1, 0)
    for e in range(moe.num_experts):
        pos, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], moe.experts.w13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, moe.experts.w2[e]) * top_w[tok, pos, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out


class TestMoESavedActivations(TestCase):
    def test_saved_bytes_match_docstring(self):
        T, D, Fh, E, K, b = 32, 16, 12, 4, 2, 2
        moe = _randomize(
            MoE(dim=D, hidden_dim=Fh, num_experts=E, top_k=K, route_norm=True, dtype=torch.bfloat16)
        )
        x = _x((T, D), dtype=torch.bfloat16)
        nbytes, saved = _saved_bytes(moe, x)
        # moe.py's docstring: D*b + E*4 + K*(8 + 4 + 16 + 2F*b) bytes per token, plus
        # the experts' offs (E int32) per call: no permuted input [K, D] (gathered by
        # the experts from the saved tokens)
        documented = T * (D * b + E * 4 + K * (8 + 4 + 16 + 2 * Fh * b)) + E * 4
        self.assertEqual(nbytes, documented, msg=f"saved: {saved}")
        loop_bytes, _ = _saved_bytes(_PerExpertLoop(moe), x)
        self.assertLess(nbytes, loop_bytes)

    def test_autocast_saves_the_tokens_not_rows(self):
        # fp32 parameters under bf16 autocast: the experts gather their rows from the fp32
        # tokens (the router's saved input) and convert them; no [T*K, D] rows and no
        # bf16 copy of the tokens are saved
        T, D, Fh, E, K = 32, 16, 12, 4, 2
        f32 = torch.float32
        moe = _randomize(MoE(dim=D, hidden_dim=Fh, num_experts=E, top_k=K, dtype=f32))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, saved = _saved_bytes(moe, _x((T, D), dtype=f32))
        shapes = [(dtype, shape) for _, dtype, shape in saved]
        self.assertIn((torch.float32, (T, D)), shapes)
        self.assertIn((torch.bfloat16, (T * K, 2 * Fh)), shapes)  # h
        for dtype in (torch.float32, torch.bfloat16):
            self.assertNotIn((dtype, (T * K, D)), shapes)
        self.assertNotIn((torch.bfloat16, (T, D)), shapes)

    def test_composed_saves_h_and_a(self):
        # GPT-OSS-like experts (moe.py's MoE docstring): the pre-activation with its bias
        # [M, 2F] and the weighted activation [M, F]; the first GEMM gathers its rows from
        # the tokens (gather_grouped_mm: no permuted [M, D] rows saved), the
        # routing-weighted down bias (_row_bias) saves no [M, D] tensor, and neither does
        # the up bias
        T, D, Fh, E, K = 32, 16, 12, 4, 2
        bf16 = torch.bfloat16
        moe = _randomize(
            MoE(dim=D, hidden_dim=Fh, num_experts=E, top_k=K, **OPTIONS["gpt_oss"], dtype=bf16)
        )
        seen = []
        moe.experts.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        _, saved = _saved_bytes(moe, _x((T, D), dtype=bf16))
        self.assertEqual(seen, [bf16])  # the biased rows rounded back to the experts' dtype
        shapes = [(dtype, shape) for _, dtype, shape in saved]
        for want in ((T * K, 2 * Fh), (T * K, Fh)):
            self.assertEqual(shapes.count((bf16, want)), 1, msg=f"{want}: {shapes}")
        for dtype in (bf16, torch.float32):  # the permuted rows; e.g. w[:, None] * b2[e]
            self.assertNotIn((dtype, (T * K, D)), shapes)


class TestGroupedExpertsChunks(TestCase):
    """``GroupedExperts.split_weights``: the chunked expert-parallel layer runs each chunk of
    local experts on one split of the weights instead of a slice per chunk."""

    def _chunked(self, experts, x, offs, rw, chunks, split):
        weights = experts.split_weights(chunks) if split else None
        y = []
        for c, (l0, l1) in enumerate(chunks):
            rows = slice(int(offs[l0 - 1]) if l0 else 0, int(offs[l1 - 1]))
            offs_c = offs[l0:l1] - rows.start
            if split:
                y.append(experts(x[rows], offs_c, rw[rows], weights=weights[c]))
            else:
                y.append(experts(x[rows], offs_c, rw[rows], expert_range=(l0, l1)))
        return torch.cat(y)

    def test_composed_rows_past_the_groups_are_zero(self):
        """Biased experts without row weights: rows at or past offs[-1] (padding) give
        zero rows and no gradient, as grouped_mm's; the rows in the groups are each
        expert's biased MLP (float64 oracle)."""
        from torch_moe.nn.modules.moe import GroupedExperts

        experts = GroupedExperts(8, 6, 3, bias=True, swiglu_limit=1.0, dtype=F64)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in experts.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64))
        offs = torch.tensor([2, 2, 5], dtype=torch.int32)
        x = _x((8, 8))  # rows 5..7 past the groups
        y = experts(x, offs)
        self.assertEqual(y[5:], torch.zeros(3, 8, dtype=F64), **EXACT)
        for r, e in enumerate([0, 0, 2, 2, 2]):
            p = {n: t.detach() for n, t in experts.named_parameters()}
            ref = naive.expert_swiglu(
                x[r].detach(), p["w13"][e], p["w2"][e], p["b13"][e], p["b2"][e], limit=1.0
            )
            self.assertEqual(y[r], ref, **TIGHT)
        y.sum().backward()
        self.assertEqual(x.grad[5:], torch.zeros(3, 8, dtype=F64), **EXACT)
        self.assertEqual(experts.b2.grad[1], torch.zeros(8, dtype=F64), **EXACT)  # idle

    def test_split_equals_slices_and_allocates_no_full_zero_gradients(self):
        from torch_moe.nn.modules.moe import GroupedExperts

        g = torch.Generator().manual_seed(0)
        experts = GroupedExperts(16, 24, 6, dtype=torch.bfloat16)
        sizes = torch.tensor([3, 0, 5, 2, 7, 1])
        offs = sizes.cumsum(0).to(torch.int32)
        x = torch.randn(int(sizes.sum()), 16, generator=g).to(torch.bfloat16)
        rw = torch.rand(x.shape[0], generator=g)
        gy = torch.randn(x.shape[0], 16, generator=g).to(torch.bfloat16)
        chunks = [(0, 2), (2, 5), (5, 6)]
        grads, zeros = [], []
        for split in (False, True):
            experts.zero_grad(set_to_none=True)
            y = self._chunked(experts, x, offs, rw, chunks, split)
            with torch.profiler.profile() as prof:
                y.backward(gy)
            grads.append((y, experts.w13.grad, experts.w2.grad))
            zeros.append(
                sum(e.count for e in prof.key_averages() if e.key == "aten::slice_backward")
            )
        for a, b in zip(*grads, strict=True):
            self.assertEqual(a, b, atol=0, rtol=0)  # bitwise: the same GEMMs, exact sums
        # a slice per chunk: each chunk's backward fills a zero gradient of every local
        # expert (3 chunks x 2 weights); the split: none
        self.assertEqual(zeros, [6, 0])
        y = self._chunked(experts, x, offs, rw, [(0, 6)], split=False)
        self.assertEqual(self._chunked(experts, x, offs, rw, [(0, 6)], split=True), y)

    def test_bad_chunks(self):
        from torch_moe.nn.modules.moe import GroupedExperts

        experts = GroupedExperts(8, 8, 4)
        for chunks in ([(0, 2), (3, 4)], [(0, 2)], [(0, 0), (0, 4)], [(1, 4)]):
            with self.assertRaisesRegex(
                ValueError, r"chunks must be non-empty contiguous ranges covering the 4 local"
            ):
                experts.split_weights(chunks)
        w = experts.split_weights([(0, 4)])[0]
        with self.assertRaisesRegex(ValueError, r"expert_range or weights, not both .*\(0, 4\)"):
            experts(torch.zeros(0, 8), torch.zeros(4, dtype=torch.int32), None, (0, 4), w)


if __name__ == "__main__":
    run_tests()
