# Owner(s): ["module: moe"]
"""Tests of the tests: every low-precision comparison helper of the suite accepts the op's
real result and rejects the same result with a 1% scale error or with one row replaced by
its neighbour, in every dtype it is used with. A helper whose tolerance grew loose enough
to let such a bug through fails here.

Helpers covered: test_grouped_mm.assert_gemm_close (forward, dX, dW), test_grouped_swiglu
assert_swiglu_close / assert_swiglu_grads_close, test_property's pipeline bound,
test_scaled_grouped_mm's fp32 accumulation bound over dequantized FP8 / MX operands, and
test_moe's autocast gradient check (a 2% scale error there: bf16 autocast's own rounding
level is 0.4-0.6% of the gradient norms, so 1% sits within the stated 2x of it).
"""

import naive
import tolerances
import torch
from test_grouped_mm import assert_gemm_close
from test_grouped_swiglu import assert_swiglu_close, assert_swiglu_grads_close
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe  # noqa: F401
from torch_moe import ops
from torch_moe.nn.functional import grouped_swiglu

HALF_AND_FLOAT = [torch.bfloat16, torch.float16, torch.float32]


def scaled(t, factor=1.01):
    """A scale error (1% by default)."""
    return (t.detach().double() * factor).to(t.dtype)


def row_shifted(t, row=1):
    """Row ``row`` replaced by row ``row + 1`` (an off-by-one in a row index); of the first
    matrix for a stacked [E, R, C] tensor."""
    out = t.detach().clone()
    view, src = (out[0], t.detach()[0]) if t.dim() == 3 else (out, t.detach())
    view[row] = src[row + 1]
    return out


def perturbations(t, factor=1.01):
    return {f"{factor - 1:.0%} scale": scaled(t, factor), "row shift": row_shifted(t)}


def _offs(sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


class TestToleranceHelpers(TestCase):
    def _assert_catches(self, check, good, msg, factor=1.01):
        """``check(good)`` passes and ``check(bad)`` fails for each perturbation of good."""
        check(good)
        for name, bad in perturbations(good, factor).items():
            self.assertFalse(torch.equal(bad, good), msg=f"{msg}: {name} changes nothing")
            with self.assertRaises(AssertionError, msg=f"{msg}: {name} passes"):
                check(bad)

    @parametrize("dtype", HALF_AND_FLOAT)
    def test_grouped_mm_bound(self, dtype):
        offs = _offs([5, 0, 7, 4])
        x = torch.randn(18, 24).to(dtype)
        w = torch.randn(4, 24, 16).to(dtype)
        dy = torch.randn(18, 16).to(dtype)
        out = ops.grouped_mm(x, w, offs)
        self._assert_catches(lambda o: assert_gemm_close(self, o, x, w, offs), out, "forward")
        dw = torch.ops.torch_moe.grouped_mm_wgrad(x, dy, offs)
        # row shift of dW: a K-row of expert 0
        self._assert_catches(
            lambda o: assert_gemm_close(self, o, x, dy, offs, wgrad=True), dw, "dW"
        )

    @parametrize("dtype", HALF_AND_FLOAT)
    def test_swiglu_bounds(self, dtype):
        offs = _offs([6, 0, 9, 5])
        x = (torch.randn(22, 16) * 0.5).to(dtype)
        w13 = (torch.randn(4, 24, 16) * 0.5).to(dtype)
        w2 = (torch.randn(4, 16, 12) * 0.5).to(dtype)
        y = grouped_swiglu(x, w13, w2, offs)
        self._assert_catches(
            lambda o: assert_swiglu_close(self, o, x, w13, w2, offs), y, f"swiglu {dtype}"
        )
        xg, w13g, w2g = (t.clone().requires_grad_() for t in (x, w13, w2))
        grad = torch.randn(y.shape).to(dtype)
        grouped_swiglu(xg, w13g, w2g, offs).backward(grad)
        for name, g in (("x", xg.grad), ("w13", w13g.grad), ("w2", w2g.grad)):

            def check(o, name=name):
                assert_swiglu_grads_close(self, {name: o}, x, w13, w2, offs, grad)

            self._assert_catches(check, g, f"swiglu d{name} {dtype}")

    @parametrize("dtype", [torch.bfloat16, torch.float32])
    def test_pipeline_bound(self, dtype):
        from test_property import _naive_out_and_bound, _problem, _route_kw

        p = _problem(num_tokens=12, num_experts=4, k=2, dim=8, hidden=6, dtype="bf16")
        p["dtype"] = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(12, 4, generator=g).to(dtype)
        x = torch.randn(12, 8, generator=g).to(dtype)
        w13 = (torch.randn(4, 12, 8, generator=g) / 3).to(dtype)
        w2 = (torch.randn(4, 8, 6, generator=g) / 3).to(dtype)
        weights, ids, _ = ops.topk_route(logits, 2, **_route_kw(p, None))
        x_perm, perm = ops.permute(x, ids, 4)
        out = ops.unpermute(grouped_swiglu(x_perm, w13, w2, perm.offs), weights, perm)
        *_, ref_out, bound = _naive_out_and_bound(p, logits, x, w13, w2, None)
        if dtype == torch.bfloat16:
            # the elementwise bound alone allows ~4 bf16 ulps of a composite: the 1% scale
            # error (2.5 ulps) is caught by the rounding level; the row shift by both
            emulated = torch.zeros_like(ref_out)
            w64, ids64, _ = naive.route(logits.double(), 2, **_route_kw(p, None))
            for t in range(12):
                for j in range(2):
                    e = int(ids64[t, j])
                    y = naive.swiglu_rounded(
                        x[t : t + 1], w13[e : e + 1], w2[e : e + 1], _offs([1]), dtype
                    )["y"][0]
                    emulated[t] += float(w64[t, j]) * y
            emulated = emulated.to(dtype).double()

            def check(o):
                tolerances.assert_within(self, o, ref_out, bound, "pipeline")
                tolerances.assert_rounding_level(self, o, ref_out, emulated, msg="pipeline")

        else:

            def check(o):
                tolerances.assert_within(self, o, ref_out, bound, "pipeline")

        self._assert_catches(check, out, f"pipeline {dtype}")

    def test_scaled_gemm_bound(self):
        from test_scaled_grouped_mm import _exact_and_bound, _operands

        from torch_moe.quantization import RECIPES

        offs = _offs([9, 0, 1, 6])
        for name in ("fp8_blockwise", "mxfp8"):
            g = RECIPES[name].forward
            _, _, qa, sa, qb, sb = _operands(g, 18, 64, 32, 4, seed=0)
            got = torch.ops.torch_moe.scaled_grouped_mm(
                qa, qb, sa, sb, offs, g.lhs.inner, g.rhs.outer, torch.float32
            )
            exact, bound = _exact_and_bound(qa, sa, qb, sb, offs, g, torch.float32)
            self._assert_catches(
                lambda o, e=exact, b=bound, n=name: tolerances.assert_within(self, o, e, b, n),
                got,
                name,
            )

    def test_autocast_gradient_check(self):
        from test_moe import BASE, _grads, _randomize, _x, assert_autocast_grads_close

        from torch_moe.nn import MoE

        moe = _randomize(MoE(**BASE, route_norm=True, dtype=torch.float32))
        x = _x((3, 7, 8), dtype=torch.float32)
        grad_out = _x((3, 7, 8), dtype=torch.float32, seed=5, requires_grad=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = moe(x)
        out.float().backward(grad_out)
        got = {"out": out.detach(), "x": x.grad, **_grads(moe)}
        for key in got:

            def check(o, key=key):
                assert_autocast_grads_close(self, {**got, key: o}, moe, x, grad_out)

            # NB: bf16 autocast's own rounding level is 0.4-0.6% of these norms (five bf16
            # roundings on each path, measured), so 1% is within 2x of it: 2% must fail
            self._assert_catches(check, got[key], f"autocast {key}", factor=1.02)


instantiate_parametrized_tests(TestToleranceHelpers)

if __name__ == "__main__":
    run_tests()
