# Owner(s): ["module: moe"]
"""Tests for ``MoE(precision=...)``: the routed experts in FP8 / MXFP8 (CPU emulation) against
the fp32 layer on the same weights, per-GEMM overrides, configuration and bad input, and (CUDA only) the GPU kernels against the
emulation. The training example's ``--precision`` is tested in test_train.py.

Legend: T tokens, D dim, F expert hidden dim, E experts, K top-k.
"""

from unittest import mock

import naive
import torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe  # noqa: F401
from torch_moe.nn import GroupedExperts, MoE
from torch_moe.nn.modules import moe as moe_module
from torch_moe.quantization import RECIPES, Recipe, get_recipe

EXACT = dict(atol=0, rtol=0)
# D and F multiples of 128: full 1x128 / 128x128 blocks and 32-element MX blocks
T, D, F, E, K = 128, 128, 128, 4, 2

# Minimum SQNR (dB) of the whole layer against the fp32 layer, measured on the data of
# test_sqnr_vs_fp32 (2026-11, CPU emulation) and rounded down by 0.4-1 dB. Two quantized
# GEMMs with SwiGLU in between compound: each scaled_grouped_mm alone is ~28 dB on Gaussian
# data (test_quantization.py), the layer's output and gradients measured 23.5-24.3 dB (FP8)
# and 22.4-23.6 dB (MXFP8, power-of-two scales). The router weight's gradient, a row sum of
# dY W2 * a (both carrying quantization error), measured 21.0-23.0 dB.
#                   out, dX, dW13, dW2 | d router.weight
SQNR_MIN_DB = {
    "fp8_tensorwise": (23.0, 22.5),
    "fp8_rowwise": (23.0, 21.5),
    "fp8_blockwise": (23.0, 20.5),
    "mxfp8": (22.0, 21.5),
    "mxfp8_rceil": (22.5, 22.0),
}


# GPT-OSS's experts and router (MoE's "composed" experts) at GPT-OSS's own clamp
GPT_OSS = {**naive.GPT_OSS, "swiglu_limit": 7.0}


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |ref - out|^2) in dB (inf when equal)."""
    ref, out = ref.double(), out.double()
    return float(10 * torch.log10(ref.square().sum() / (ref - out).square().sum()))


def _layers(*precisions, dtype=torch.float32, seed=0, **kw):
    """One MoE per precision, all with the same (seeded) weights."""
    torch.manual_seed(seed)
    ref = MoE(D, F, E, K, route_norm=True, dtype=dtype, **kw)
    with torch.no_grad():
        ref.router.weight.mul_(1.5)  # routing far from uniform
    out = []
    for p in precisions:
        m = MoE(D, F, E, K, route_norm=True, dtype=dtype, precision=p, **kw)
        m.load_state_dict(ref.state_dict())
        out.append(m)
    return out


def _data(dtype=torch.float32, seed=1, num_tokens=T):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, D, generator=g).to(dtype)
    grad_out = torch.randn(num_tokens, D, generator=g).to(dtype)
    return x, grad_out


def _fwd_bwd(moe, x, grad_out):
    """{"out", "x", <param name>: grad}."""
    moe.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = moe(x)
    out.backward(grad_out)
    return {"out": out.detach(), "x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}


@instantiate_parametrized_tests
class TestMoEPrecision(TestCase):
    @parametrize("name", list(RECIPES))
    def test_sqnr_vs_fp32(self, name):
        ref, low = _layers("bf16", name)
        x, grad_out = _data()
        want, got = _fwd_bwd(ref, x, grad_out), _fwd_bwd(low, x, grad_out)
        self.assertEqual(sorted(got), ["experts.w13", "experts.w2", "out", "router.weight", "x"])
        min_db, router_db = SQNR_MIN_DB[name]
        for key in got:
            db = sqnr(want[key], got[key])
            floor = router_db if key == "router.weight" else min_db
            self.assertGreaterEqual(db, floor, f"{name} {key}: {db:.2f} dB")
            self.assertLess(db, 40.0, f"{name} {key}: {db:.2f} dB, not quantized?")

    @parametrize("name", list(RECIPES))
    @parametrize("experts", ["gpt_oss", "relu2"])
    def test_composed_experts_sqnr(self, name, experts):
        """GPT-OSS-like experts (biases, clamped activation on interleaved gate / up) and
        ungated relu2 ones ([E, F, D] up projections, biases) under a recipe: the SwiGLU
        layer's floors hold (measured 2026-12 on CPU: 23.3-27.0 dB, the router bias
        26.7-34.0; relu2 22.7-25.7); b2's gradient (the routing-weighted dY summed per
        expert) takes no quantized operand: exact."""
        kw = GPT_OSS if experts == "gpt_oss" else naive.NEMOTRON_H
        ref, low = _layers("bf16", name, **kw)
        x, grad_out = _data()
        want, got = _fwd_bwd(ref, x, grad_out), _fwd_bwd(low, x, grad_out)
        self.assertEqual(got["experts.b2"], want["experts.b2"], **EXACT)
        min_db, router_db = SQNR_MIN_DB[name]
        for key in sorted(set(got) - {"experts.b2"}):
            floor = router_db if key.startswith("router.") else min_db
            db = sqnr(want[key], got[key])
            self.assertGreaterEqual(db, floor, f"{name} {key}: {db:.2f} dB")
            self.assertLess(db, 40.0, f"{name} {key}: {db:.2f} dB, not quantized?")

    def test_composed_bf16_override_is_bf16(self):
        """Every GEMM of a recipe overridden to bf16: the composed experts' recipe path is
        their bf16 path bit for bit (the same grouped GEMMs, the same activation)."""
        recipe = get_recipe("fp8_blockwise").with_overrides(
            forward="bf16", dgrad="bf16", wgrad="bf16"
        )
        ref, low = _layers("bf16", recipe, dtype=torch.bfloat16, **GPT_OSS)
        x, grad_out = _data(torch.bfloat16)
        want, got = _fwd_bwd(ref, x, grad_out), _fwd_bwd(low, x, grad_out)
        for key in want:
            self.assertEqual(got[key], want[key], **EXACT, msg=key)

    def test_router_and_shared_experts_untouched(self):
        kw = dict(shared_hidden_dim=64, shared_gate=True)
        ref, low = _layers("bf16", "fp8_blockwise", **kw)
        seen = []
        for m in (ref, low):
            m.router.register_forward_hook(lambda mod, i, o: seen.append(o))
        x, grad_out = _data()
        want, got = _fwd_bwd(ref, x, grad_out), _fwd_bwd(low, x, grad_out)
        for a, b in zip(seen[0], seen[1]):  # weights, ids, counts, logits: the same routing
            self.assertEqual(a, b, **EXACT)
        # the shared expert's gradients depend only on x and dY: bitwise those of fp32
        for key in ("shared_experts.w13", "shared_experts.w2", "shared_experts.gate"):
            self.assertEqual(got[key], want[key], **EXACT, msg=key)
        self.assertNotEqual(got["experts.w13"], want["experts.w13"])

    def test_bf16_override_matches_bf16(self):
        """All three GEMMs overridden to bf16 == the ``"bf16"`` path up to rounding order."""
        recipe = get_recipe("fp8_blockwise").with_overrides(
            forward="bf16", dgrad="bf16", wgrad="bf16"
        )
        ref, low = _layers("bf16", recipe, dtype=torch.bfloat16)
        x, grad_out = _data(torch.bfloat16)
        want, got = _fwd_bwd(ref, x, grad_out), _fwd_bwd(low, x, grad_out)
        for key in want:
            # measured 48.5-52.3 dB: grouped_swiglu keeps the activation in fp32 on CPU
            self.assertGreaterEqual(sqnr(want[key], got[key]), 45.0, key)

    @parametrize("name", list(RECIPES))
    def test_wgrad_override_changes_only_weight_grads(self, name):
        recipe = get_recipe(name)
        ref, low, mixed = _layers("bf16", recipe, recipe.with_overrides(wgrad="bf16"))
        x, grad_out = _data()
        want, q, m = (_fwd_bwd(layer, x, grad_out) for layer in (ref, low, mixed))
        # forward and dgrad are the same GEMMs; the router's gradient uses dgrad only
        for key in ("out", "x", "router.weight"):
            self.assertEqual(m[key], q[key], **EXACT, msg=key)
        for key in ("experts.w13", "experts.w2"):
            self.assertNotEqual(m[key], q[key])
            # a bf16 wgrad is closer to fp32 than a quantized one
            self.assertGreater(sqnr(want[key], m[key]), sqnr(want[key], q[key]) + 1.0, key)

    def test_default_is_grouped_swiglu(self):
        (explicit,) = _layers("bf16")
        default = MoE(D, F, E, K, route_norm=True)
        default.load_state_dict(explicit.state_dict())
        self.assertIsNone(default.experts.recipe)
        x, grad_out = _data()
        with mock.patch.object(moe_module, "scaled_grouped_mm", side_effect=AssertionError):
            got = _fwd_bwd(default, x, grad_out)
        for key, value in _fwd_bwd(explicit, x, grad_out).items():
            self.assertEqual(got[key], value, **EXACT, msg=key)

    @parametrize("name", ["fp8_blockwise", "mxfp8"])
    def test_aligned_groups(self, name):
        """The 16-row groups used on CUDA give the unpadded result (zero padding rows)."""
        (moe,) = _layers(name)
        x, grad_out = _data(num_tokens=37)
        want = _fwd_bwd(moe, x, grad_out)
        offs = []
        moe.experts.register_forward_hook(lambda mod, i, o: offs.append(i[1]))
        with mock.patch.object(moe_module, "_group_align", return_value=16):
            got = _fwd_bwd(moe, x, grad_out)
        self.assertEqual(offs[-1].remainder(16), torch.zeros(E, dtype=torch.int32))
        self.assertGreater(int(offs[-1][-1]), 37 * K)  # padding rows were added
        for key in want:
            self.assertEqual(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)

    def test_bf16_autocast(self):
        """fp32 master weights under bf16 autocast: the recipe quantizes bf16 operands."""
        ref, low = _layers("bf16", "fp8_blockwise")
        x, grad_out = _data()
        want = _fwd_bwd(ref, x, grad_out)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = _fwd_bwd(low, x, grad_out)
        self.assertEqual(got["out"].dtype, torch.bfloat16)
        for key in got:
            if key != "out":
                self.assertEqual(got[key].dtype, torch.float32, msg=key)
            floor = 20.0 if key == "router.weight" else 22.5  # bf16 rounding on top
            self.assertGreaterEqual(sqnr(want[key], got[key]), floor, key)

    def test_config_and_repr(self):
        moe = MoE(D, F, E, K, precision="mxfp8")
        self.assertEqual(moe.config["precision"], "mxfp8")
        self.assertEqual(moe.experts.precision, "mxfp8")
        self.assertIn("precision=mxfp8", repr(moe))
        self.assertIs(MoE(**moe.config).experts.recipe, RECIPES["mxfp8"])
        default = MoE(D, F, E, K)
        self.assertEqual(default.config["precision"], "bf16")
        self.assertNotIn("precision", default.extra_repr())
        # a recipe with overrides has no registered name: config keeps the object
        recipe = get_recipe("fp8_blockwise").with_overrides(wgrad="bf16")
        moe = MoE(D, F, E, K, precision=recipe)
        self.assertIsInstance(moe.config["precision"], Recipe)
        self.assertEqual(MoE(**moe.config).experts.recipe, recipe)
        self.assertIn("precision=fp8_blockwise[wgrad=bf16]", moe.extra_repr())
        experts = GroupedExperts(D, F, E, precision="fp8_rowwise")
        self.assertIs(experts.recipe, RECIPES["fp8_rowwise"])
        self.assertIn("precision=fp8_rowwise", repr(experts))

    def test_bad_precision(self):
        supported = r"supported: \['fp8_blockwise', 'fp8_rowwise', 'fp8_tensorwise', 'mxfp8'"
        for bad in ("fp4", "BF16", torch.bfloat16):
            with self.assertRaisesRegex(
                ValueError,
                rf"MoE: precision must be 'bf16' or a low-precision recipe: unknown "
                rf"low-precision recipe {bad!r}; {supported}",
            ):
                MoE(D, F, E, K, precision=bad)
        with self.assertRaisesRegex(ValueError, "unknown low-precision recipe 'fp4'"):
            GroupedExperts(D, F, E, precision="fp4")

    def test_mx_dims_not_a_multiple_of_the_block(self):
        # refused at construction (the first non-empty forward's quantizer would refuse
        # them; an empty batch took the training forward and failed the inference one)
        for dim, hidden, arg, bad in ((15, 32, "dim", 15), (32, 40, "hidden_dim", 40)):
            with self.assertRaisesRegex(
                ValueError,
                rf"MoE: precision 'mxfp8' quantizes MX blocks of 32 elements along dim and "
                rf"hidden_dim: {arg} must be a multiple of 32, got {bad}",
            ):
                MoE(dim, hidden, E, K, precision="mxfp8")
        GroupedExperts(15, 40, E, precision="fp8_rowwise")  # (FP8 blocks take any size)
        mixed = get_recipe("mxfp8").with_overrides(forward="bf16", dgrad="bf16")
        GroupedExperts(15, 40, E, precision=mixed)  # (MX only in the weight gradient)
        dgrad_only = get_recipe("mxfp8").with_overrides(forward="bf16", wgrad="bf16")
        with self.assertRaisesRegex(ValueError, r"dim must be a multiple of 32, got 15"):
            GroupedExperts(15, 32, E, precision=dgrad_only)


class TestMoEPrecisionDevice(TestCase):
    """Device-generic (instantiate_device_type_tests): .ci/gpu runs it on cuda."""

    @onlyCUDA
    @parametrize("name", list(RECIPES))
    def test_matches_cpu_emulation(self, device, name):
        """The GPU kernels compute the emulated function: bf16 layer, CUDA vs CPU."""
        (cpu,) = _layers(name, dtype=torch.bfloat16)
        gpu = MoE(**cpu.config, dtype=torch.bfloat16, device=device)
        gpu.load_state_dict(cpu.state_dict())
        offs = []
        gpu.experts.register_forward_hook(lambda mod, i, o: offs.append(i[1]))
        x, grad_out = _data(torch.bfloat16, num_tokens=256)
        want = _fwd_bwd(cpu, x, grad_out)
        got = _fwd_bwd(gpu, x.to(device), grad_out.to(device))
        self.assertEqual(offs[0].remainder(16).cpu(), torch.zeros(E, dtype=torch.int32))
        for key in want:
            self.assertEqual(got[key].device.type, "cuda", msg=key)
            db = sqnr(want[key], got[key].cpu())
            self.assertGreaterEqual(db, 30.0, f"{name} {key}: {db:.2f} dB")

    @onlyCUDA
    @parametrize("autocast", [False, True])
    @parametrize("experts", ["swiglu", "gpt_oss", "relu2"])
    def test_bf16_layer_matches_cpu(self, device, autocast, experts):
        """The default experts (``grouped_swiglu`` gathering its rows from the tokens; on
        CUDA its device-generic composition), GPT-OSS's composed experts (biases, each
        row's expert found on the device) and ungated relu2 ones against the CPU kernels: bf16 parameters, or
        fp32 ones under bf16 autocast (fp32 tokens, rows converted as gathered)."""
        dtype = torch.float32 if autocast else torch.bfloat16
        kw = dict(swiglu={}, gpt_oss=GPT_OSS, relu2=naive.NEMOTRON_H)
        (cpu,) = _layers("bf16", dtype=dtype, **kw[experts])
        gpu = MoE(**cpu.config, dtype=dtype, device=device)
        gpu.load_state_dict(cpu.state_dict())
        x, grad_out = _data(dtype, num_tokens=256)
        results = []
        for moe, dev in ((cpu, "cpu"), (gpu, device)):
            with torch.autocast(dev if dev == "cpu" else "cuda", torch.bfloat16, enabled=autocast):
                results.append(_fwd_bwd(moe, x.to(dev), grad_out.to(dev)))
        want, got = results
        for key in want:
            self.assertEqual(got[key].device.type, "cuda", msg=key)
            db = sqnr(want[key].float(), got[key].cpu().float())
            self.assertGreaterEqual(db, 30.0, f"{key}: {db:.2f} dB")  # bf16 rounding: ~45


instantiate_device_type_tests(TestMoEPrecisionDevice, globals())

if __name__ == "__main__":
    run_tests()
