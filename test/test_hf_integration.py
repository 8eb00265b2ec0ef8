# Owner(s): ["module: moe"]
"""Tests for torch_moe.integrations.transformers: the "torch_moe" experts implementation of
HF transformers, set_precision, and the to_torch_moe / from_torch_moe converters.

Every model is a tiny random-weight config built in code (never downloaded). The oracles:
transformers' own "eager" experts (its per-expert loop) in fp32 and its "grouped_mm"
experts in bf16 for whole models; a float64 per-assignment loop (``_ToyExperts.forward``)
for each layout flag; the unconverted HF model for ``to_torch_moe``; one process for EP=2.
"""

import contextlib
import copy
import importlib.metadata
import io
import os
import unittest
import unittest.mock
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_export import torch_moe_ops
from torch._dynamo.testing import EagerAndRecordGraphs
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    HAS_TRANSFORMERS = importlib.metadata.version("transformers").split(".")[0] == "5"
except importlib.metadata.PackageNotFoundError:
    HAS_TRANSFORMERS = False

F32_EPS = torch.finfo(torch.float32).eps
BF16_EPS = torch.finfo(torch.bfloat16).eps

# --------------------------------------------------------------------------------------
# tiny models

_COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
TINY = {
    "mixtral": dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(
        moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
    ),
    "deepseek_v3": dict(
        head_dim=4,
        moe_intermediate_size=24,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        intermediate_size=48,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        n_shared_experts=1,
    ),
    "gpt_oss": dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=24, num_experts=8, num_experts_per_tok=2),
}
FAMILIES = list(TINY)
CONVERTIBLE = ["mixtral", "qwen3_moe", "deepseek_v3", "olmoe", "gpt_oss"]


def _quiet_hf():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def tiny_model(family, dtype=torch.float32, impl="eager", seed=0):
    """A 2-layer random model of ``family``. Every parameter is redrawn (HF zero-inits the
    routers, which would make routing ties), routers with a large spread so that bf16
    rounding does not flip a top-k choice."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _quiet_hf()
    cfg = AutoConfig.for_model(family, **{**_COMMON, **TINY[family]})
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation=impl)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * r if "norm" in name else 0.5 * r)
            else:  # fan-in scaling; routers 3x wider so that top-k margins are large
                wide = name.endswith(("mlp.gate.weight", "mlp.router.weight"))
                p.copy_(r * (3.0 if wide else 1.0) * min(p.shape[-2:]) ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return model.to(dtype).eval()


def _ids(seed=1, shape=(2, 8)):
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))


def _run(model, ids, impl=None):
    """(logits, {name: grad}) of ``sum(logits * g)`` for a fixed random g."""
    if impl is not None:
        model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    g = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))
    g = g.to(logits.device, logits.dtype)
    (logits.float() * g.float()).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().clone(), grads


def _rel_close(test, actual, expected, ulps, eps, msg=""):
    """|actual - expected| <= ulps * eps * max|expected|: errors of reordered fp sums scale
    with the tensor's magnitude, not each element's."""
    scale = expected.abs().max().float().item()
    test.assertEqual(
        actual.float(), expected.float(), atol=ulps * eps * max(scale, 1e-30), rtol=0, msg=msg
    )


class _OneThread:
    """Ops this small are dominated by waking intra-op threads (2-5x slower on a busy
    2-core machine): run the class on one thread, restoring the setting after it."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._threads = torch.get_num_threads()
        torch.set_num_threads(1)

    @classmethod
    def tearDownClass(cls):
        torch.set_num_threads(cls._threads)
        super().tearDownClass()


# --------------------------------------------------------------------------------------
# a configurable experts module: every layout flag, with a float64 per-assignment oracle


def _toy_experts_class(flags, activation):
    from transformers.integrations.moe import use_experts_implementation

    class _ToyExperts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            E, D, Fh = config.num_experts, config.hidden_size, config.intermediate_size
            self.num_experts = E
            n = 2 * Fh if flags.get("has_gate", True) else Fh
            up = "gate_up_proj" if flags.get("has_gate", True) else "up_proj"
            t = flags.get("is_transposed", False)
            setattr(self, up, torch.nn.Parameter(torch.randn((E, D, n) if t else (E, n, D))))
            self.down_proj = torch.nn.Parameter(torch.randn((E, Fh, D) if t else (E, D, Fh)))
            if flags.get("has_bias", False):
                setattr(self, up + "_bias", torch.nn.Parameter(torch.randn(E, n)))
                self.down_proj_bias = torch.nn.Parameter(torch.randn(E, D))
            if flags.get("has_post_expert_norm", False):
                self.post_expert_norm = torch.nn.RMSNorm(D, eps=1e-6)
                with torch.no_grad():
                    self.post_expert_norm.weight.uniform_(0.5, 1.5)
            self.act_fn = {"silu": F.silu, "gelu": F.gelu, "relu2": lambda h: F.relu(h) ** 2,
                           "clamped": F.silu}.get(activation)  # fmt: skip
            if activation == "relu2_hf":  # transformers' own (Nemotron-H): the glu op's
                from transformers.activations import ReLUSquaredActivation

                self.act_fn = ReLUSquaredActivation()

        if activation == "clamped":  # GPT-OSS: interleaved, clamped, (up + 1) * glu

            def _apply_gate(self, gate_up):
                if flags.get("is_concatenated", True):
                    gate, up = gate_up.chunk(2, dim=-1)
                else:
                    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
                gate = gate.clamp(max=1.5)
                up = up.clamp(min=-1.5, max=1.5)
                return (up + 1) * (gate * torch.sigmoid(gate * 1.702))

        def forward(self, x, ids, w):
            # the oracle: one assignment at a time (sentinel ids >= E are skipped)
            gated = flags.get("has_gate", True)
            up_w = self.gate_up_proj if gated else self.up_proj
            out = torch.zeros_like(x)
            for t in range(x.shape[0]):
                for k in range(ids.shape[1]):
                    e = int(ids[t, k])
                    if e >= self.num_experts:
                        continue
                    W1 = up_w[e] if flags.get("is_transposed", False) else up_w[e].t()
                    h = x[t] @ W1
                    if flags.get("has_bias", False):
                        h = h + (self.gate_up_proj_bias if gated else self.up_proj_bias)[e]
                    a = self._apply_gate(h) if gated else self.act_fn(h)
                    W2 = (
                        self.down_proj[e]
                        if flags.get("is_transposed", False)
                        else self.down_proj[e].t()
                    )
                    y = a @ W2
                    if flags.get("has_bias", False):
                        y = y + self.down_proj_bias[e]
                    if flags.get("has_post_expert_norm", False):
                        y = self.post_expert_norm(y)
                    out[t] = out[t] + y * w[t, k]
            return out

    return use_experts_implementation(_ToyExperts, **flags)


class _ToyConfig:
    def __init__(self):
        self.num_experts, self.hidden_size, self.intermediate_size = 4, 8, 6
        self._experts_implementation = "eager"


LAYOUTS = {
    "default": ({}, "silu"),
    "transposed": ({"is_transposed": True}, "silu"),
    "bias": ({"has_bias": True}, "silu"),
    "gelu": ({}, "gelu"),
    "gpt_oss": ({"is_concatenated": False, "is_transposed": True, "has_bias": True}, "clamped"),
    "no_gate_relu2": ({"has_gate": False}, "relu2"),
    "no_gate_relu2_hf": ({"has_gate": False}, "relu2_hf"),
    "post_norm": ({"has_post_expert_norm": True}, "silu"),
    "post_norm_bias": ({"has_post_expert_norm": True, "has_bias": True}, "silu"),
}


def _check_bf16_against_grouped_mm(test, family, device):
    """The bf16 model on ``device`` with the torch_moe backend against transformers'
    grouped_mm backend, both judged against the fp32 model with the same weights."""
    model = tiny_model(family, dtype=torch.bfloat16).to(device)
    ids = _ids().to(device)
    truth, truth_g = _run(copy.deepcopy(model).float(), ids, "eager")
    ref, ref_g = _run(model, ids, "grouped_mm")
    out, out_g = _run(model, ids, "torch_moe")
    # NB (tolerance): bf16 rounding through attention, norms and two MoE layers moves
    # grouped_mm's logits and gradients by 2-17% (relative L2) from the fp32 model with
    # the same weights, and torch_moe rounds differently (SwiGLU in fp32 with the
    # routing weight folded in, one rounding per expert op; fp32 combine). Stated
    # tolerance, judged against the fp32 model: per tensor, torch_moe's relative L2
    # error <= 4x grouped_mm's + 2 bf16 eps (a wrong gradient is O(1) off), and summed
    # over all tensors <= 1.5x grouped_mm's (measured 0.31-1.04x on the CPU).
    test.assertEqual(sorted(out_g), sorted(ref_g))
    tensors = [("logits", out, ref, truth)] + [(n, out_g[n], ref_g[n], truth_g[n]) for n in ref_g]
    err_tm = err_gm = 0.0
    for n, a, r, t in tensors:
        a, r, t = a.float(), r.float(), t.float()
        e_tm, e_gm = ((a - t).norm() / t.norm()).item(), ((r - t).norm() / t.norm()).item()
        test.assertLessEqual(e_tm, 4 * e_gm + 2 * BF16_EPS, msg=n)
        err_tm, err_gm = err_tm + e_tm, err_gm + e_gm
    test.assertLessEqual(err_tm, 1.5 * err_gm)


@unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers 5.x")
@instantiate_parametrized_tests
class TestExpertsBackend(_OneThread, TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        import torch_moe.integrations.transformers  # noqa: F401  (registers "torch_moe")

    def test_registered(self):
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        import torch_moe.integrations.transformers as tmt
        from torch_moe.quantization import RECIPES

        self.assertIs(ALL_EXPERTS_FUNCTIONS["torch_moe"], tmt.experts_forward)
        for name in RECIPES:
            self.assertIn(f"torch_moe_{name}", ALL_EXPERTS_FUNCTIONS)
        model = tiny_model("mixtral", impl="torch_moe")
        self.assertEqual(model.config._experts_implementation, "torch_moe")

    @parametrize("layout", list(LAYOUTS))
    def test_layout_flags_match_float64_loop(self, layout):
        """Every flag combination the decorator declares, against a per-assignment loop."""
        import torch_moe.integrations.transformers as tmt

        flags, act = LAYOUTS[layout]
        torch.manual_seed(0)
        experts = _toy_experts_class(flags, act)(_ToyConfig()).double()
        expected_path = "fused" if layout in ("default", "transposed") else "composed"
        self.assertEqual(tmt.experts_layout(experts).path, expected_path)
        T, K = 12, 2
        x = torch.randn(T, 8, dtype=torch.float64)
        # expert 3 gets no token (an empty group); each token has K distinct experts
        ids = torch.stack([torch.randperm(3)[:K] for _ in range(T)])
        w = torch.rand(T, K, dtype=torch.float64)
        results = {}
        for impl in ("eager", "torch_moe"):
            experts.config._experts_implementation = impl
            experts.zero_grad(set_to_none=True)
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = experts(xi, ids, wi)
            out.backward(torch.cos(torch.arange(out.numel(), dtype=torch.float64)).view_as(out))
            grads = {n: p.grad for n, p in experts.named_parameters()}
            results[impl] = (out.detach(), xi.grad, wi.grad, grads)
        (o0, x0, w0, g0), (o1, x1, w1, g1) = results["eager"], results["torch_moe"]
        # float64 on both sides, sums reordered: 1e-12 is ~5000 ulp at these O(10) values
        tol = dict(atol=1e-12, rtol=1e-12)
        self.assertEqual(o1, o0, **tol)
        self.assertEqual(x1, x0, **tol)
        self.assertEqual(w1, w0, **tol)
        self.assertEqual(sorted(g1), sorted(g0))
        for n in g0:
            self.assertEqual(g1[n], g0[n], **tol, msg=n)

    def test_composed_path_saves_no_permuted_rows(self):
        """The composed path's up projection gathers its rows from the tokens
        (``gather_grouped_mm``): its backward keeps no [T*K, D] permuted input."""
        T, K, D = 12, 2, 8
        for layout in ("bias", "gpt_oss", "no_gate_relu2"):
            flags, act = LAYOUTS[layout]
            torch.manual_seed(0)
            experts = _toy_experts_class(flags, act)(_ToyConfig())
            experts.config._experts_implementation = "torch_moe"
            ids = torch.stack([torch.randperm(4)[:K] for _ in range(T)])
            shapes = []

            def pack(t, shapes=shapes):
                shapes.append(tuple(t.shape))
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                experts(torch.randn(T, D, requires_grad=True), ids, torch.rand(T, K))
            self.assertNotIn((T * K, D), shapes, msg=f"{layout}: {shapes}")
            self.assertIn((T, D), shapes, msg=layout)  # the tokens instead

    def test_known_gates_run_the_glu_op(self):
        """transformers' default gate with SiLU and the gates of OWN_GATES' classes
        (GPT-OSS's clamped swigluoai) run by torch_moe::glu (fp32 math, one rounding, its
        native CPU kernel for swigluoai); any other gate or act_fn is the module's own,
        recomputed by checkpoint."""
        import torch_moe.integrations.transformers as tmt

        model = tiny_model("gpt_oss", impl="torch_moe")
        cfg = model.config
        for _, m in tmt.experts_modules(model):
            layout = tmt.experts_layout(m)
            self.assertEqual(layout.glu, ("swigluoai", cfg.swiglu_alpha, cfg.swiglu_limit, True))
        want = {
            "default": ("swiglu", 1.0, None, False),  # the fused path: grouped_swiglu
            "bias": ("swiglu", 1.0, None, False),
            "post_norm": ("swiglu", 1.0, None, False),
            "gelu": None,
            "gpt_oss": None,  # the toy's own clamped gate: not a class transformers has
            "no_gate_relu2": None,  # a lambda: the module's own
            "no_gate_relu2_hf": ("relu2", 1.0, None, False),
        }

        def glu_nodes(out):
            seen, todo, names = set(), [out.grad_fn], []
            while todo:
                fn = todo.pop()
                if fn is None or fn in seen:
                    continue
                seen.add(fn)
                names.append(fn.name())
                todo.extend(f for f, _ in fn.next_functions)
            # the glu op's node, or in eager on the CPU the composed experts' one node
            # (grouped_glu_combine: the ops' kernels, glu's among them)
            return [n for n in names if "torch_moe_glu" in n or n.startswith("_GLUCombine")]

        for layout, glu in want.items():
            flags, act = LAYOUTS[layout]
            torch.manual_seed(0)
            experts = _toy_experts_class(flags, act)(_ToyConfig())
            experts.config._experts_implementation = "torch_moe"
            self.assertEqual(tmt.experts_layout(experts).glu, glu, msg=layout)
            ids = torch.stack([torch.randperm(4)[:2] for _ in range(6)])
            out = experts(torch.randn(6, 8, requires_grad=True), ids, torch.rand(6, 2))
            composed_glu = glu is not None and layout != "default"
            self.assertEqual(len(glu_nodes(out)), int(composed_glu), msg=layout)
        out = model.model.layers[0].mlp(torch.randn(1, 5, 32, requires_grad=True))[0]
        self.assertEqual(len(glu_nodes(out)), 1)

    def test_expert_parallel_sentinels(self):
        """transformers' EP marks non-local assignments with ids >= E and weight 0."""
        torch.manual_seed(0)
        experts = _toy_experts_class({"has_bias": True}, "silu")(_ToyConfig()).double()
        experts._is_expert_parallel = True
        T, K = 10, 2
        x = torch.randn(T, 8, dtype=torch.float64)
        ids = torch.stack([torch.randperm(4)[:K] for _ in range(T)])
        ids[::3, 1] = 4  # sentinel
        w = torch.rand(T, K, dtype=torch.float64).masked_fill(ids >= 4, 0.0)
        outs = {}
        for impl in ("eager", "torch_moe"):
            experts.config._experts_implementation = impl
            experts.zero_grad(set_to_none=True)
            wi = w.clone().requires_grad_()
            out = experts(x, ids, wi)
            out.sum().backward()
            outs[impl] = (out.detach(), wi.grad, experts.down_proj_bias.grad.clone())
        for a, b in zip(outs["torch_moe"], outs["eager"]):
            self.assertEqual(a, b, atol=1e-12, rtol=1e-12)
        self.assertEqual(
            outs["torch_moe"][1][ids >= 4], torch.zeros(int((ids >= 4).sum()), dtype=torch.float64)
        )

    def test_bias_combine(self):
        """The down bias combine: the sum over k in fp64, gradcheck, sentinels, T=0."""
        from torch_moe.integrations._transformers_experts import _ExpertBiasCombine

        torch.manual_seed(0)
        E, T, K, D = 5, 7, 3, 6
        b = torch.randn(E, D, dtype=torch.float64, requires_grad=True)
        ids = torch.stack([torch.randperm(E + 1)[:K] for _ in range(T)])  # E: a sentinel
        ids[1] = torch.tensor([2, 2, E])  # one expert twice: its weights add
        w = torch.rand(T, K, dtype=torch.float64)
        w[0, ids[0] < E] = 0.0  # a routed slot of weight 0 still has a weight gradient
        w.requires_grad_()
        out = _ExpertBiasCombine.apply(b, ids, w)
        valid = ids < E
        b_ref, w_ref = b.detach().requires_grad_(), w.detach().requires_grad_()
        expected = (torch.where(valid, w_ref, 0)[..., None] * b_ref[ids.clamp(max=E - 1)]).sum(1)
        self.assertEqual(out, expected, atol=1e-14, rtol=1e-14)
        g = torch.randn(T, D, dtype=torch.float64)  # signed: not the one-hot gradcheck probes
        out.backward(g)
        gb, gw = torch.autograd.grad(expected, (b_ref, w_ref), g)
        self.assertEqual(b.grad, gb, atol=1e-14, rtol=1e-14)
        self.assertEqual(w.grad, gw, atol=1e-14, rtol=1e-14)
        self.assertTrue((w.grad[0][valid[0]] != 0).all())
        self.assertEqual(w.grad[~valid], torch.zeros(int((~valid).sum()), dtype=torch.float64))
        torch.autograd.gradcheck(lambda b_, w_: _ExpertBiasCombine.apply(b_, ids, w_), (b, w))
        # bf16 bias, fp32 weights: fp32 out and weight gradient, the bias's dtype for its own
        b16 = b.detach().to(torch.bfloat16).requires_grad_()
        w32 = w.detach().float().requires_grad_()
        out32 = _ExpertBiasCombine.apply(b16, ids, w32)
        self.assertEqual(out32.dtype, torch.float32)
        out32.sum().backward()
        self.assertEqual((b16.grad.dtype, w32.grad.dtype), (torch.bfloat16, torch.float32))
        empty = _ExpertBiasCombine.apply(b, ids[:0], w[:0])  # T=0
        self.assertEqual(empty.shape, (0, D))

    @parametrize("family", FAMILIES)
    def test_model_matches_eager_fp32(self, family):
        """Logits and every parameter gradient of the whole model, fp32."""
        import torch_moe.integrations.transformers as tmt

        model = tiny_model(family)
        ids = _ids()
        ref, ref_g = _run(model, ids, "eager")
        out, out_g = _run(model, ids, "torch_moe")
        paths = {tmt.experts_layout(m).path for _, m in tmt.experts_modules(model)}
        self.assertEqual(paths, {"composed" if family == "gpt_oss" else "fused"})
        # NB (tolerance): the same fp32 math with reordered sums (grouped GEMMs, the fp32
        # combine, the routing weight folded before the down GEMM instead of after) through
        # two layers: measured <= 11 ulp of each tensor's max; 64 ulp bound
        _rel_close(self, out, ref, 64, F32_EPS)
        self.assertEqual(sorted(out_g), sorted(ref_g))
        for n in ref_g:
            _rel_close(self, out_g[n], ref_g[n], 64, F32_EPS, msg=n)

    @parametrize("family", FAMILIES)
    def test_model_matches_grouped_mm_bf16(self, family):
        _check_bf16_against_grouped_mm(self, family, "cpu")

    @parametrize("family", ["mixtral", "gpt_oss"])
    def test_generate_greedy(self, family):
        model = tiny_model(family)
        prompt = _ids(seed=3, shape=(2, 5))
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        model.set_experts_implementation("eager")
        ref = model.generate(prompt, **kw)
        model.set_experts_implementation("torch_moe")
        out = model.generate(prompt, **kw)
        self.assertEqual(out, ref)
        self.assertEqual(out.shape, (2, 11))

    @parametrize("family", ["mixtral", "gpt_oss"])
    def test_compile_fullgraph(self, family):
        """The sparse-MoE block (fused path: Mixtral; composed with the glu op: GPT-OSS)
        under torch.compile(fullgraph=True), forward and backward."""
        model = tiny_model(family, impl="torch_moe")
        block = model.model.layers[0].mlp
        x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))

        def run(fn):
            block.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            out = fn(xi)
            out = out[0] if isinstance(out, tuple) else out
            out.square().sum().backward()
            return out.detach(), xi.grad, {n: p.grad for n, p in block.named_parameters()}

        torch._dynamo.reset()
        ref = run(block)
        got = run(torch.compile(block, fullgraph=True, backend="aot_eager"))
        self.assertEqual(got[0], ref[0], atol=0, rtol=0)
        self.assertEqual(got[1], ref[1], atol=0, rtol=0)
        for n in ref[2]:
            self.assertEqual(got[2][n], ref[2][n], atol=0, rtol=0, msg=n)

    @parametrize("family", ["qwen3_moe", "gpt_oss"])
    def test_compiled_inference(self, family):
        """Compiled without autograd, a fused-layout block's experts are one op
        (``torch_moe::routed_swiglu``: the eager step when the graph runs) and a composed
        one's keep their ops; both equal eager bit for bit, a one-token step included."""
        model = tiny_model(family, dtype=torch.bfloat16, impl="torch_moe")
        block = model.model.layers[0].mlp
        backend = EagerAndRecordGraphs()
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        compiled = torch.compile(block, fullgraph=True, backend=backend)
        gen = torch.Generator().manual_seed(0)
        for tokens in (1, 1, 6):
            x = torch.randn(2, tokens, 32, generator=gen).to(torch.bfloat16)
            with torch.inference_mode():
                want, got = block(x), compiled(x)
            want, got = (o[0] if isinstance(o, tuple) else o for o in (want, got))
            self.assertEqual(got, want, atol=0, rtol=0, msg=f"{tokens} tokens")
        targets = {n.target for gm in backend.graphs for n in gm.graph.nodes}
        routed = torch.ops.torch_moe.routed_swiglu.default
        self.assertEqual(routed in targets, family == "qwen3_moe")

    @parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
    def test_export(self, family):
        """A whole model on the backend exports (``torch.export``, the sequence length a
        ``Dim``; transformers' own ``eager`` experts loop over the experts a token count
        chose, which export cannot trace) and its program equals the model bit for bit at
        another length; the fused layout's experts are one op there (no autograd)."""

        class Logits(torch.nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, ids):
                return self.model(ids, use_cache=False).logits

        model = Logits(tiny_model(family, impl="torch_moe"))
        seq = torch.export.Dim("seq", min=2, max=64)
        with torch.no_grad():
            ep = torch.export.export(model, (_ids(),), dynamic_shapes=({1: seq},))
            ids = _ids(seed=2, shape=(2, 13))
            self.assertEqual(ep.module()(ids), model(ids), atol=0, rtol=0)
        ops = torch_moe_ops(ep.graph_module)
        self.assertEqual("torch_moe.routed_swiglu.default" in ops, family != "gpt_oss")
        self.assertEqual("torch_moe.glu.default" in ops, family == "gpt_oss")

    def test_precision(self):
        """set_precision runs the experts' GEMMs through scaled_grouped_mm per recipe."""
        import torch_moe.integrations.transformers as tmt

        model = tiny_model("qwen3_moe")
        ids = _ids()
        full, _ = _run(model, ids, "torch_moe")
        self.assertEqual(tmt.set_precision(model, "fp8_rowwise"), 2)
        fp8, fp8_g = _run(model, ids)
        self.assertEqual(model.config._experts_implementation, "torch_moe")
        # the registered implementation of the recipe computes the same, bitwise
        tmt.set_precision(model, "bf16")
        named, named_g = _run(model, ids, tmt.implementation_name("fp8_rowwise"))
        self.assertEqual(named, fp8, atol=0, rtol=0)
        for n in fp8_g:
            self.assertEqual(named_g[n], fp8_g[n], atol=0, rtol=0, msg=n)
        # FP8 e4m3 (3 mantissa bits, 2^-4 relative rounding) on both GEMMs: not the fp32
        # result, but within a few e4m3 roundings of it
        self.assertNotEqual(fp8, full)
        _rel_close(self, fp8, full, 4, 2.0**-4)
        # the same recipe inside torch_moe.nn.MoE (to_torch_moe carries it over) agrees
        tmt.set_precision(model, "fp8_rowwise")
        conv = tmt.to_torch_moe(copy.deepcopy(model))
        self.assertEqual(tmt.torch_moe_blocks(conv)[0][1].moe.experts.precision, "fp8_rowwise")
        _rel_close(self, _run(conv, ids)[0], fp8, 64, F32_EPS)
        tmt.from_torch_moe(conv)  # and back: the HF experts keep the recipe
        self.assertEqual(_run(conv, ids, "torch_moe")[0], fp8, atol=0, rtol=0)

    def test_bad_input(self):
        import torch_moe.integrations.transformers as tmt

        with self.assertRaisesRegex(TypeError, r"Linear has no layout flag\(s\) \['has_gate'"):
            tmt.experts_forward(torch.nn.Linear(2, 2), torch.zeros(1, 2), None, None)
        # transformers before has_post_expert_norm (5.17, on the H200 image): absent is False
        experts = _toy_experts_class({}, "silu")(_ToyConfig())
        del experts.has_post_expert_norm
        self.assertFalse(tmt.experts_layout(experts).has_post_expert_norm)
        self.assertTrue(tmt.experts_layout(experts).fused)
        del experts.has_bias
        with self.assertRaisesRegex(
            TypeError, r"_ToyExperts has no layout flag\(s\) \['has_bias'\]"
        ):
            tmt.experts_layout(experts)
        experts = _toy_experts_class({}, "silu")(_ToyConfig())
        experts.gate_up_proj.data = experts.gate_up_proj.data.to(torch.float8_e4m3fn)
        with self.assertRaisesRegex(ValueError, r"gate_up_proj has dtype torch.float8_e4m3fn"):
            tmt.experts_layout(experts)
        experts = _toy_experts_class({"has_bias": True}, "silu")(_ToyConfig())
        del experts.down_proj_bias
        with self.assertRaisesRegex(ValueError, r"has_bias=True but 'down_proj_bias'"):
            tmt.experts_layout(experts)
        experts = _toy_experts_class({}, "silu")(_ToyConfig())
        ids, w = torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
        with self.assertRaisesRegex(
            ValueError, r"expected hidden_states \[T, D\] .* got \[1, 3, 8\]"
        ):
            tmt.experts_forward(experts, torch.zeros(1, 3, 8), ids, w)
        with self.assertRaisesRegex(ValueError, r"top_k_weights \[3, 1\] must have top_k_index's"):
            tmt.experts_forward(experts, torch.zeros(3, 8), ids, w[:, :1])
        # a layout flag of a newer transformers that this backend does not implement
        from torch_moe.integrations import _transformers_experts as backend

        experts = _toy_experts_class({}, "silu")(_ToyConfig())
        self.assertEqual(backend.UNKNOWN_FLAGS, {})  # none in the tested version
        experts.has_shared_experts = True
        with unittest.mock.patch.dict(backend.UNKNOWN_FLAGS, {"has_shared_experts": False}):
            with self.assertRaisesRegex(
                NotImplementedError, r"_ToyExperts has the layout flag has_shared_experts=True"
            ):
                tmt.experts_forward(experts, torch.zeros(1, 8), None, None)
        with self.assertRaisesRegex(ValueError, r"unknown low-precision recipe 'fp7'"):
            tmt.set_precision(tiny_model("mixtral"), "fp7")
        with self.assertRaisesRegex(ValueError, r"set_precision: Linear has no transformers"):
            tmt.set_precision(torch.nn.Linear(2, 2), "fp8_rowwise")

    def test_version_warning_once(self):
        import torch_moe.integrations.transformers as tmt

        self.assertTrue(tmt.check_transformers_version())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertFalse(tmt.check_transformers_version("4.57.1"))
            self.assertFalse(tmt.check_transformers_version("4.57.1"))
            self.assertFalse(tmt.check_transformers_version("5.24.0"))
        msgs = [str(w.message) for w in caught]
        self.assertEqual(len(msgs), 2, msg=msgs)
        self.assertRegex(msgs[0], r"tested with transformers >=5\.23\.0,<5\.24\.0; found 4\.57\.1")


@unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers 5.x")
@instantiate_parametrized_tests
class TestConvert(_OneThread, TestCase):
    @parametrize("family", CONVERTIBLE)
    def test_to_torch_moe_matches(self, family):
        import torch_moe.integrations.transformers as tmt
        from torch_moe.nn import MoE

        model = tiny_model(family)
        ids = _ids()
        ref, ref_g = _run(model, ids, "eager")
        router = "router" if family == "gpt_oss" else "gate"  # GPT-OSS: a router with a bias
        gate = getattr(model.model.layers[1].mlp, router).weight
        tmt.to_torch_moe(model)
        blocks = tmt.torch_moe_blocks(model)
        self.assertEqual(len(blocks), 1 if family == "deepseek_v3" else 2)
        self.assertIs(blocks[-1][1].moe.router.weight, gate)  # shared, not copied
        out, out_g = _run(model, ids)
        _rel_close(self, out, ref, 64, F32_EPS)

        def hf_name(n):  # torch_moe names back to HF's, for the comparison
            n = n.replace("mlp.moe.router.", f"mlp.{router}.")
            n = n.replace("mlp.moe.experts.w13", "mlp.experts.gate_up_proj")
            n = n.replace("mlp.moe.experts.w2", "mlp.experts.down_proj")
            n = n.replace("mlp.moe.experts.b13", "mlp.experts.gate_up_proj_bias")
            n = n.replace("mlp.moe.experts.b2", "mlp.experts.down_proj_bias")
            return n.replace("mlp.moe.shared_experts.w2", "mlp.shared_experts.down_proj.weight")

        got = {hf_name(n): g for n, g in out_g.items()}
        for n, g in got.items():
            if family == "gpt_oss" and n.endswith(("gate_up_proj", "down_proj")):
                # stored transposed ([E, D, 2F] / [E, F, D]): the MoE's views' gradients
                _rel_close(self, g.transpose(1, 2), ref_g[n], 64, F32_EPS, msg=n)
            elif n.endswith("shared_experts.w13"):
                ref_w13 = torch.cat(
                    [ref_g[n.replace("moe.shared_experts.w13", f"shared_experts.{p}_proj.weight")]
                     for p in ("gate", "up")]
                )  # fmt: skip
                _rel_close(self, g, ref_w13, 64, F32_EPS, msg=n)
            else:
                _rel_close(self, g, ref_g[n], 64, F32_EPS, msg=n)
        self.assertEqual(len(got), len(ref_g) - (1 if family == "deepseek_v3" else 0))
        # the MoE's own buffers (load counters, last losses) start as a freshly built MoE's
        moe = blocks[0][1].moe
        fresh = dict(MoE(**moe.config).named_buffers())
        for n, b in moe.named_buffers():
            if n != "router.expert_bias":
                self.assertEqual(b, fresh[n], atol=0, rtol=0, msg=n)

    @parametrize("family", CONVERTIBLE)
    def test_round_trip_bitwise(self, family):
        import torch_moe.integrations.transformers as tmt

        model = tiny_model(family)
        ids = _ids()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        ref = model(ids).logits
        tmt.from_torch_moe(tmt.to_torch_moe(model))
        self.assertEqual(tmt.torch_moe_blocks(model), [])
        after = model.state_dict()
        self.assertEqual(sorted(after), sorted(before))
        for k in before:
            self.assertEqual(after[k].dtype, before[k].dtype, msg=k)
            self.assertTrue(torch.equal(after[k], before[k]), msg=k)
        self.assertEqual(model(ids).logits, ref, atol=0, rtol=0)

    def test_training_stats_and_expert_bias(self):
        import torch_moe.integrations.transformers as tmt

        model = tiny_model("deepseek_v3").train()
        tmt.to_torch_moe(model)
        moe = tmt.torch_moe_blocks(model)[0][1].moe
        model(_ids()).logits.sum().backward()
        self.assertEqual(sum(moe.load_stats()["tokens_per_expert"]), 16 * 2)
        bias = moe.router.expert_bias.clone()
        moe.update_expert_bias(1e-2)
        self.assertNotEqual(moe.router.expert_bias, bias)

    def test_added_expert_bias_balances_and_guards_the_way_back(self):
        """``expert_bias=True`` gives a router without a selection bias (Mixtral) a zero one:
        the same logits, aux-loss-free balancing through ``update_expert_bias``, and a way
        back that refuses to drop a nonzero bias (before touching any block)."""
        import torch_moe.integrations.transformers as tmt

        model = tiny_model("mixtral")
        ids = _ids()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        ref = tmt.to_torch_moe(copy.deepcopy(model))(ids).logits  # converted, no bias
        tmt.to_torch_moe(model, expert_bias=True)
        moes = [b.moe for _, b in tmt.torch_moe_blocks(model)]
        self.assertTrue(all(m.router.expert_bias is not None for m in moes))
        self.assertEqual(model(ids).logits, ref, atol=0, rtol=0)  # a zero bias: same choices
        model.train()
        model(ids).logits.sum().backward()
        moes[1].update_expert_bias(1e-2)
        self.assertTrue(bool(moes[1].router.expert_bias.any()))
        with self.assertRaisesRegex(
            ValueError,
            r"model.layers.1.mlp.moe.router.expert_bias \(added by to_torch_moe\(expert_bias="
            r"True\)\) is nonzero, and MixtralSparseMoeBlock has no selection bias",
        ):
            tmt.from_torch_moe(model)
        self.assertEqual(len(tmt.torch_moe_blocks(model)), 2)  # nothing converted back
        with torch.no_grad():
            moes[1].router.expert_bias.zero_()
        tmt.from_torch_moe(model.eval())
        after = model.state_dict()
        self.assertEqual(sorted(after), sorted(before))
        for k in before:
            self.assertTrue(torch.equal(after[k], before[k]), msg=k)

    def test_refused(self):
        import torch_moe.integrations.transformers as tmt

        model = tiny_model("mixtral")
        experts = model.model.layers[1].mlp.experts
        experts.act_fn = torch.nn.GELU()
        with self.assertRaisesRegex(
            NotImplementedError,
            r"MixtralSparseMoeBlock.experts \(MixtralExperts\) has a custom activation",
        ):
            tmt.to_torch_moe(model)
        self.assertEqual(tmt.torch_moe_blocks(model), [])  # layer 0 was not replaced either
        experts.has_post_expert_norm = True
        experts.post_expert_norm = torch.nn.Identity()
        with self.assertRaisesRegex(NotImplementedError, r"has has_post_expert_norm=True"):
            tmt.to_torch_moe(model)
        model = tiny_model("mixtral")
        with self.assertRaisesRegex(TypeError, r"unexpected option\(s\) \['capacity'\]"):
            tmt.to_torch_moe(model, capacity=2)
        model.config.output_router_logits = True
        with self.assertRaisesRegex(NotImplementedError, r"output_router_logits=True"):
            tmt.to_torch_moe(model)
        model.config.output_router_logits = False
        model.model.layers[0].mlp.jitter_noise = 0.1
        with self.assertRaisesRegex(NotImplementedError, r"router_jitter_noise=0.1"):
            tmt.to_torch_moe(model)
        # nothing was replaced by the failed calls
        self.assertEqual(tmt.torch_moe_blocks(model), [])

    def test_wrong_family_checkpoint_refused(self):
        import torch_moe.integrations.transformers as tmt

        mixtral = tmt.to_torch_moe(tiny_model("mixtral"))
        buf = io.BytesIO()
        torch.save(mixtral.state_dict(), buf)
        buf.seek(0)
        sd = torch.load(buf, weights_only=False)
        # an OLMoE with Mixtral's sizes: same tensor names and shapes, other block
        olmoe = tiny_model("olmoe")
        olmoe.model.embed_tokens, olmoe.lm_head = mixtral.model.embed_tokens, mixtral.lm_head
        tmt.to_torch_moe(olmoe)
        with self.assertRaisesRegex(
            RuntimeError,
            r"model.layers.0.mlp._extra_state: the checkpoint holds a torch_moe-converted "
            r"'MixtralSparseMoeBlock' block, this model's block is a converted "
            r"'OlmoeSparseMoeBlock'",
        ):
            olmoe.load_state_dict(sd, strict=False)
        # the right family loads, also from a checkpoint older than an MoE argument (its
        # config lacks the key, which then holds the default)
        again = tmt.to_torch_moe(tiny_model("mixtral", seed=5))
        for key in [k for k in sd if k.endswith("_extra_state")]:
            del sd[key]["moe_config"]["group_score"]
        again.load_state_dict(sd)
        self.assertEqual(again(_ids()).logits, mixtral(_ids()).logits, atol=0, rtol=0)
        sd[key]["moe_config"]["top_k"] = 1
        with self.assertRaisesRegex(
            RuntimeError, r"MoE config mismatch \(checkpoint, model\): \{'top_k': \(1, 2\)\}"
        ):
            again.load_state_dict(sd)


# one HF sparse-MoE block per routing rule and tensor location that to_torch_moe maps
# (_transformers_convert._routing): key -> (family, block class, extra config)
_BLOCK_SIZES = dict(
    hidden_size=32,
    intermediate_size=24,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=24,
    num_experts=8,
    num_local_experts=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_topk=2,
    moe_num_experts=8,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    num_shared_experts=1,
    routed_scaling_factor=2.5,
    moe_routed_scaling_factor=2.5,
    norm_topk_prob=True,
)
BLOCKS = {
    "deepseek_v2": ("deepseek_v2", "DeepseekV2Moe", {}),  # softmax, no norm, scale
    "deepseek_v2_grouped": (  # groups scored by their best expert
        "deepseek_v2",
        "DeepseekV2Moe",
        dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
    ),
    "ernie4_5_moe": (
        "ernie4_5_moe",
        "Ernie4_5_MoeSparseMoeBlock",
        {},
    ),  # softmax + [1, E] bias param
    "hunyuan_v1_moe": ("hunyuan_v1_moe", "HunYuanMoEV1Moe", {}),  # gate.wg, shared_mlp, layer_idx
    "granitemoe": ("granitemoe", "GraniteMoeMoE", {}),  # .router, softmax over the top-k logits
    "jamba": ("jamba", "JambaSparseMoeBlock", {}),  # .router, softmax, no norm
    "cohere2_moe": (
        "cohere2_moe",
        "Cohere2MoeSparseMoeBlock",
        dict(shared_expert_combination_strategy="sum"),
    ),
    "cohere2_moe_sigmoid": (
        "cohere2_moe",
        "Cohere2MoeSparseMoeBlock",
        dict(expert_selection_fn="sigmoid", num_shared_experts=0),
    ),
    "flint": ("flint", "FlintSparseMoeBlock", {}),  # sigmoid without bias, shared_expert
    "minimax_m2": ("minimax_m2", "MiniMaxM2SparseMoeBlock", {}),  # bias buffer on the block
    "hy_v3": ("hy_v3", "HYV3MoE", {}),  # bias on the block, router_scaling_factor
    "laguna": ("laguna", "LagunaSparseMoeBlock", {}),  # the block scales the routed output
    "afmoe": ("afmoe", "AfmoeSparseMoeBlock", {}),  # router.gate, expert_bias parameter
    "lfm2_moe": ("lfm2_moe", "Lfm2MoeSparseMoeBlock", {}),  # norm by (sum + 1e-6)
    # router bias, experts' biases, clamped SwiGLU on interleaved gate / up, transposed;
    # swiglu_limit 1 so that the clamps act at these sizes
    "gpt_oss": ("gpt_oss", "GptOssMLP", dict(swiglu_limit=1.0)),
    # the same on [gate; up] halves, scores / K and output * K
    "openai_privacy_filter": (
        "openai_privacy_filter",
        "OpenAIPrivacyFilterMLP",
        dict(swiglu_limit=1.0),
    ),
    "lfm2_moe_no_norm": ("lfm2_moe", "Lfm2MoeSparseMoeBlock", dict(norm_topk_prob=False)),
    "mistral4": ("mistral4", "Mistral4MoE", {}),  # softmax with expert groups
    "exaone_moe": ("exaone_moe", "ExaoneMoeSparseMoEBlock", {}),  # DeepSeek-V3's router
    "aria": ("aria_text", "AriaTextMoELayer", {}),  # experts stored transposed, shared MLP
    # SwiGLU clamped at swiglu_limit (1 here, so that the clamps act at these sizes)
    "hy_v4": ("hy_v4", "HYV4MoE", dict(swiglu_limit=1.0)),
    "glm5_next": ("glm5_next_text", "Glm5NextTextMoE", dict(swiglu_limit=1.0)),  # shared too
    # swigluoai experts and shared MLP (one gate_up_proj Linear), sigmoid + bias routing
    "minimax_m3_vl": (
        "minimax_m3_vl_text",
        "MiniMaxM3VLSparseMoeBlock",
        dict(swiglu_limit=1.0, shared_intermediate_size=24, routed_scaling_factor=2.0),
    ),
    # DeepSeek-V3's routing with the scale on the block; its own fp32 SwiGLU gate
    "beam": ("beam", "BeamMoE", dict(routed_scaling_factor=2.5, norm_topk_prob=True)),
    # ungated relu2 experts and shared MLP, DeepSeek-V3's router
    "nemotron_h": ("nemotron_h", "NemotronHMoE", dict(moe_shared_expert_intermediate_size=16)),
    "axk1": ("axk1", "AXK1MoE", {}),  # DeepSeek-V3's block, then an RMSNorm of the output
    # the selection bias added to the logits (top-k), the weights their sigmoids
    "kolibri1": ("kolibri1", "Kolibri1SparseMoeBlock", dict(shared_expert_intermediate_size=24)),
}
# families whose modeling module has another name
_BLOCK_MODULES = {
    "aria_text": "aria",
    "glm5_next_text": "glm5_next",
    "minimax_m3_vl_text": "minimax_m3_vl",
}


def tiny_block(key, seed=0, **overrides):
    """A random HF sparse-MoE block (D=32, F=24, E=8, K=2, one shared expert where the
    family has one); selection biases N(0, 0.5) so that they change choices."""
    import importlib
    import inspect

    from transformers import AutoConfig

    _quiet_hf()
    family, block_name, extra = BLOCKS[key]
    cfg = AutoConfig.for_model(family, **{**_BLOCK_SIZES, **extra, **overrides})
    module = _BLOCK_MODULES.get(family, family)
    cls = getattr(
        importlib.import_module(f"transformers.models.{module}.modeling_{module}"), block_name
    )
    init = inspect.signature(cls.__init__).parameters
    block = cls(cfg, layer_idx=0) if "layer_idx" in init else cls(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*block.named_parameters(), *block.named_buffers()]:
            r = torch.randn(t.shape, generator=g)
            if name.endswith(("e_score_correction_bias", "expert_bias", "router.bias")):
                t.copy_(0.5 * r)
            elif t.dim() >= 2:
                t.copy_(r * min(t.shape[-2:]) ** -0.5)
    return block.eval()


def _block_run(block, x):
    """(output, {id(param): grad}, dx) of sum(block(x) * g) for a fixed random g."""
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * g).sum().backward()
    grads = {id(p): p.grad.clone() for p in block.parameters() if p.grad is not None}
    return out.detach(), grads, x.grad


@unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers 5.x")
@instantiate_parametrized_tests
class TestConvertBlocks(_OneThread, TestCase):
    """Each routing rule of ``to_torch_moe`` on its HF block: output, input gradient and every
    parameter gradient equal the block's own (fp32), and the round trip is bitwise."""

    @parametrize("key", list(BLOCKS))
    def test_block_matches_and_round_trips(self, key):
        import torch_moe.integrations.transformers as tmt
        from torch_moe.nn import MoE, hf_state_dict_to_moe

        holder = torch.nn.Module()
        holder.mlp = block = tiny_block(key)
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))
        ref, ref_g, ref_dx = _block_run(block, x)
        before = {k: v.clone() for k, v in holder.state_dict().items()}
        hf_params = dict(block.named_parameters())
        tmt.to_torch_moe(holder)
        moe = holder.mlp.moe
        transposed = holder.mlp.hf_keys.transposed
        moved = {}  # HF experts stored transposed: their MoE views, by HF name
        if transposed:
            for name, mine in (("gate_up_proj", moe.experts.w13), ("down_proj", moe.experts.w2)):
                theirs = getattr(block.experts, name)
                self.assertEqual(mine.data_ptr(), theirs.data_ptr(), msg=name)  # same storage
                self.assertTrue(torch.equal(mine, theirs.transpose(1, 2)), msg=name)
                moved[f"experts.{name}"] = mine
        else:  # the very Parameter (Nemotron-H's ungated experts: the up projection)
            up = block.experts.gate_up_proj if block.experts.has_gate else block.experts.up_proj
            self.assertIs(moe.experts.w13, up)
        out, got_g, dx = _block_run(holder.mlp, x)
        _rel_close(self, out, ref, 64, F32_EPS)
        _rel_close(self, dx, ref_dx, 64, F32_EPS)
        shared = holder.mlp.hf_keys.shared
        # an ungated shared MLP's up_proj is the MoE's shared w13 itself
        ungated = shared is not None and moe.shared_experts.activation == "relu2"
        for name, p in hf_params.items():
            if (
                shared
                and not ungated
                and name.startswith(f"{shared}.")
                and name.endswith(("gate_proj.weight", "up_proj.weight"))
            ):
                continue  # concatenated into shared_experts.w13: below
            if name in moved:
                got = moved[name].grad.transpose(1, 2)
                _rel_close(self, got, ref_g[id(p)], 64, F32_EPS, msg=name)
            elif id(p) in ref_g:
                self.assertIn(id(p), got_g, msg=f"{name} is not shared with the MoE")
                _rel_close(self, got_g[id(p)], ref_g[id(p)], 64, F32_EPS, msg=name)
        if shared and holder.mlp.hf_keys.shared_fused:  # one gate_up_proj: shared as is
            self.assertIs(moe.shared_experts.w13, hf_params[f"{shared}.gate_up_proj.weight"])
        elif ungated:
            self.assertIs(moe.shared_experts.w13, hf_params[f"{shared}.up_proj.weight"])
        elif shared:
            w13 = torch.cat(
                [ref_g[id(hf_params[f"{shared}.{n}_proj.weight"])] for n in ("gate", "up")]
            )
            _rel_close(self, moe.shared_experts.w13.grad, w13, 64, F32_EPS)
        self.assertEqual(moe.shared_experts is not None, shared is not None)
        if holder.mlp.hf_keys.expert_bias is not None:  # the bias changes choices here
            self.assertTrue(moe.router.expert_bias.abs().max() > 0)
            with torch.no_grad():
                kept = moe.router.expert_bias.clone()
                moe.router.expert_bias.zero_()
                self.assertNotEqual(holder.mlp(x), out)
                moe.router.expert_bias.copy_(kept)
        # the block's state dict loads into a fresh MoE of the same config
        fresh = MoE(**moe.config)
        post_norm = holder.mlp.hf_keys.post_norm  # the HF norm module, not the MoE's
        if post_norm is not None:
            self.assertIs(holder.mlp.post_norm, getattr(block, post_norm))
        hf_sd = {k: v for k, v in block.state_dict().items() if not k.startswith(f"{post_norm}.")}
        mapped = hf_state_dict_to_moe(hf_sd, experts_transposed=transposed)
        fresh.load_state_dict(mapped, strict=True)
        for n, t in moe.state_dict().items():
            self.assertEqual(fresh.state_dict()[n], t, atol=0, rtol=0, msg=n)
        tmt.from_torch_moe(holder)
        self.assertIsInstance(holder.mlp, type(block))
        after = holder.state_dict()
        self.assertEqual(sorted(after), sorted(before))
        for k in before:
            self.assertEqual(after[k].dtype, before[k].dtype, msg=k)
            self.assertTrue(torch.equal(after[k], before[k]), msg=k)
        with torch.no_grad():
            back = holder.mlp(x)
            self.assertEqual(back[0] if isinstance(back, tuple) else back, ref, atol=0, rtol=0)

    def test_refused_with_reason(self):
        import torch_moe.integrations.transformers as tmt

        cases = [
            ("deepseek_v2", dict(topk_method="noaux_tc"), r"topk_method='noaux_tc'"),
            ("laguna", dict(moe_router_logit_softcapping=30.0), r"router_logit_softcapping=30.0"),
            ("cohere2_moe", dict(shared_expert_combination_strategy="average"), r"'average'"),
            ("nemotron_h", dict(moe_latent_size=16), r"fc1_latent_proj projects the experts'"),
            ("nemotron_h", dict(mlp_hidden_act="silu"), r"has_gate=False and act_fn SiLU"),
        ]
        for key, overrides, pattern in cases:
            holder = torch.nn.Module()
            holder.mlp = tiny_block(key, **overrides)
            with self.assertRaisesRegex(NotImplementedError, pattern, msg=key):
                tmt.to_torch_moe(holder)
            self.assertIsNot(type(holder.mlp), tmt.TorchMoEBlock)
        # a shared MLP whose forward this converter does not know (here: one that would
        # clamp, in a class without a rule) is refused, not converted as plain SwiGLU
        holder = torch.nn.Module()
        holder.mlp = tiny_block("hy_v4")
        holder.mlp.shared_experts.swiglu_limit = 1.0
        with self.assertRaisesRegex(
            NotImplementedError, r"shared_experts \(HYV4MLP\) has its own gated forward"
        ):
            tmt.to_torch_moe(holder)


@unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers 5.x")
class TestConvertedExpertParallel(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        # fork, not spawn: the children inherit torch and the imported model code (a
        # spawned child spends seconds importing them); each child runs one thread
        tiny_model("qwen3_moe")
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    def test_ep2_matches_one_process(self):
        """EP=2 on gloo over a converted Qwen3-MoE: each rank's logits and gradients equal
        one process running both ranks' sequences."""
        self._check_ep2("qwen3_moe")

    def test_ep2_gpt_oss(self):
        """The same over a converted GPT-OSS (the experts' biases sharded with the
        weights; its router's bias replicated)."""
        self._check_ep2("gpt_oss")

    def _check_ep2(self, family):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        import torch_moe.integrations.transformers as tmt
        from torch_moe.distributed import ExpertParallel

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(self.file_name, self.world_size),
            rank=self.rank,
            world_size=self.world_size,
        )
        mesh = init_device_mesh("cpu", (self.world_size,))
        model = tmt.to_torch_moe(tiny_model(family))
        ref = copy.deepcopy(model)
        for _, block in tmt.torch_moe_blocks(model):
            parallelize_module(block.moe, mesh, ExpertParallel())
        ids = _ids(shape=(4, 8))
        mine = slice(2 * self.rank, 2 * self.rank + 2)
        g = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(7))
        out_ref = ref(ids).logits
        (out_ref * g).sum().backward()
        out = model(ids[mine]).logits
        (out * g[mine]).sum().backward()
        # gloo EP reorders no sums within a token: same fp32 math as one process
        _rel_close(self, out, out_ref[mine].detach(), 64, F32_EPS)
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            grad = p.grad
            if hasattr(grad, "to_local"):  # expert weights: this rank's shard
                E = ref_params[n].shape[0]
                rows = slice(self.rank * E // 2, (self.rank + 1) * E // 2)
                _rel_close(self, grad.to_local(), ref_params[n].grad[rows], 64, F32_EPS, msg=n)
            else:  # replicated: this rank's partial sum
                dist.all_reduce(grad)
                _rel_close(self, grad, ref_params[n].grad, 64, F32_EPS, msg=n)
        dist.destroy_process_group()


@unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers 5.x")
class TestFinetuneExample(_OneThread, TestCase):
    def test_three_implementations_one_curve(self):
        """examples/hf_finetune.py --compare: eager, grouped_mm and torch_moe train the same
        random Qwen3-MoE on the same bytes to the same losses (bf16 autocast)."""
        import sys
        import tempfile
        from pathlib import Path

        examples = Path(__file__).resolve().parents[1] / "examples"
        sys.path.insert(0, str(examples))
        try:
            import hf_finetune
        finally:
            sys.path.remove(str(examples))
        with tempfile.TemporaryDirectory() as out:
            argv = ["--compare", "--steps", "4", "--warmup", "2", "--dim", "32", "--layers", "1",
                    "--hidden-dim", "16", "--batch-size", "2", "--seq-len", "16",
                    "--corpus-bytes", "4000", "--out", out, "--no-progress"]  # fmt: skip
            with contextlib.redirect_stdout(io.StringIO()):
                runs = hf_finetune.main(argv)
            for impl in ("eager", "grouped_mm", "torch_moe"):
                self.assertTrue((Path(out) / impl / "metrics.jsonl").is_file())
                self.assertTrue((Path(out) / impl / "train.png").is_file())
            self.assertTrue((Path(out) / "compare.png").is_file())
        eager = torch.tensor([r["loss"] for r in runs["eager"]])
        self.assertEqual(len(eager), 4)
        self.assertLess(eager[-1].item(), eager[0].item())  # it trains
        # NB (tolerance): bf16 autocast, where each implementation rounds differently
        # (grouped_mm even runs its GEMMs in the fp32 weights' dtype): the losses agree to
        # a bf16 ulp, not bitwise
        for impl in ("grouped_mm", "torch_moe"):
            loss = torch.tensor([r["loss"] for r in runs[impl]])
            self.assertEqual(loss, eager, atol=0, rtol=BF16_EPS, msg=impl)


@unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers 5.x")
class TestExpertsBackendDevice(TestCase):
    """Device-generic (instantiate_device_type_tests): .ci/gpu runs it on cuda (the CUDA
    paths of the torch_moe backend against transformers' grouped_mm there)."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        import torch_moe.integrations.transformers  # noqa: F401  (registers "torch_moe")

    @onlyCUDA
    @parametrize("family", FAMILIES)
    def test_model_matches_grouped_mm_bf16(self, device, family):
        _check_bf16_against_grouped_mm(self, family, device)


instantiate_device_type_tests(TestExpertsBackendDevice, globals())

if __name__ == "__main__":
    run_tests()
