# Owner(s): ["module: moe"]
"""Tests for torch_moe::router_logits and its backward against float64 and the reference.

The CPU kernels for bf16 / fp16 operands (csrc/router_cpu.cpp) sum exact products in fp32
in an order of their own, so they are checked against float64 within Higham's bound for
a sum of D + 1 terms in any order (test/tolerances.py), not bit for bit against ATen's
fp32 GEMM; fp32 / fp64 inputs take the reference, which is ``F.linear`` bit for bit (the
HF routers that compute in fp32).
"""

import os
import re
import unittest
from unittest import mock

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from tolerances import UNIT_ROUNDOFF, assert_within, gemm_bound
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe  # noqa: F401
from torch_moe import ops
from torch_moe._ops import _cpu_probe, _native, grouped_mm
from torch_moe._ops import router as _router

HALF = (torch.bfloat16, torch.float16)
# (T, D, E): tails of every tile (tokens 4 / 2, experts 4 / 8, 16 / 32 columns), one
# expert, one column, T = 0, and sums over more than one block of 64 steps / tokens
# (and a D tail in the second block: D = 2079)
SHAPES = [(37, 100, 5), (2, 33, 1), (0, 64, 8), (5, 1, 3), (129, 2112, 9), (70, 64, 70)]
SHAPES += [(3, 2079, 5)]


def _native_runs():
    """Whether the native kernels run here: built, and for this build's ATen CPU
    capability (AVX2 / AVX-512; a DEFAULT build has them refuse every call)."""
    if not (_native.available() and hasattr(_native.kernels(), "router_logits")):
        return False
    x = torch.ones(1, 2, dtype=torch.bfloat16)
    return bool(_native.kernels().router_logits(x, x, None, torch.empty(1, 1)))


def _inputs(T, D, E, dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    w = (torch.randn(E, D, generator=g) * D**-0.5).to(dtype)
    b = torch.randn(E, generator=g).to(dtype) if bias else None
    return x, w, b


def _on_1_2_3_threads(fn):
    """``fn()``'s results on 1, 2 and 3 intra-op threads (the thread count restored)."""
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(fn())
        return results
    finally:
        torch.set_num_threads(threads)


def _exact(x, w, b):
    out = x.double() @ w.double().t()
    return out if b is None else out + b.double()


def _assert_grads_within(test, x, w, grad, dtype):
    """x.grad and w.grad against float64: E-term sums (grad_x) and T-term sums (grad_W) in
    fp32, rounded once to ``dtype``."""
    g, xd, wd = grad.double(), x.detach().double(), w.detach().double()
    exact_x, exact_w = g @ wd, g.t() @ xd
    bound_x = gemm_bound(g.abs() @ wd.abs(), w.shape[0], exact_x, torch.float32, dtype)
    bound_w = gemm_bound(g.abs().t() @ xd.abs(), max(x.shape[0], 1), exact_w, torch.float32, dtype)
    assert_within(test, x.grad, exact_x, bound_x, msg="grad_x")
    assert_within(test, w.grad, exact_w, bound_w, msg="grad_w")


def _logits_bound(x, w, b, exact):
    abs_products = x.double().abs() @ w.double().abs().t()
    if b is not None:
        abs_products = abs_products + b.double().abs()
    return gemm_bound(abs_products, x.shape[1] + 1, exact, torch.float32, torch.float32)


class TestRouterLogits(TestCase):
    @parametrize("dtype", HALF)
    @parametrize("shape", SHAPES)
    @parametrize("bias", [True, False])
    def test_half_within_fp32_bound(self, dtype, shape, bias):
        x, w, b = _inputs(*shape, dtype, bias=bias)
        got = ops.router_logits(x, w, b)
        self.assertEqual(got.dtype, torch.float32)
        exact = _exact(x, w, b)
        bound = _logits_bound(x, w, b, exact)
        assert_within(self, got, exact, bound, msg=f"{dtype} {shape}")
        # the reference (ATen's fp32 GEMM) is within the same bound: two orders of one sum
        assert_within(self, _router.router_logits_reference(x, w, b), exact, bound)

    @parametrize("dtype", [torch.float32, torch.float64])
    def test_full_precision_is_f_linear(self, dtype):
        x, w, b = _inputs(33, 70, 6, dtype)
        self.assertEqual(ops.router_logits(x, w, b), F.linear(x, w, b), atol=0, rtol=0)
        self.assertEqual(ops.router_logits(x, w), F.linear(x, w), atol=0, rtol=0)
        self.assertEqual(ops.router_logits(x, w).dtype, dtype)

    def test_mixed_dtypes_take_the_reference(self):
        x, w, b = _inputs(9, 40, 3, torch.bfloat16)
        for xx, ww in [(x, w.float()), (x.float(), w), (x, w.half())]:
            self.assertEqual(
                ops.router_logits(xx, ww, b),
                _router.router_logits_reference(xx, ww, b),
                atol=0,
                rtol=0,
            )

    @unittest.skipUnless(_native_runs(), "the native CPU kernels are not built here")
    @parametrize("dtype", HALF)
    def test_native_kernel_runs_and_differs_from_nothing_else(self, dtype):
        # the kernels run (the op's results are theirs), in their own deterministic order:
        # a second call, strided operands (rows apart in place, or column-major: copied)
        # and any thread count give the same bits; without the native library, the
        # reference's
        x, w, b = _inputs(45, 96, 7, dtype, seed=3)
        out = torch.empty(45, 7)
        tiles = _router._tiles(x, w)  # the kernels' form the op takes here (router_kernel)
        self.assertTrue(_native.kernels().router_logits(x, w, b.float(), out, tiles))
        want = ops.router_logits(x, w, b)
        self.assertEqual(want, out, atol=0, rtol=0)
        self.assertEqual(ops.router_logits(x, w, b), want, atol=0, rtol=0)
        grad = torch.randn(45, 7, generator=torch.Generator().manual_seed(4))
        gx, gw = torch.empty_like(x), torch.empty_like(w)
        self.assertTrue(_native.kernels().router_logits_backward(grad, x, w, gx, gw, tiles))
        got_x, got_w = _router.router_logits_backward(grad, x, w, True, True)
        self.assertEqual((got_x, got_w), (gx, gw), atol=0, rtol=0)
        wide = torch.zeros(45, 110, dtype=dtype)
        wide[:, 5:101] = x  # rows 110 apart: read in place
        wide_w = torch.zeros(7, 100, dtype=dtype)
        wide_w[:, 2:98] = w
        rows_apart = (wide[:, 5:101], wide_w[:, 2:98])
        col_major = (torch.empty(96, 45, dtype=dtype).copy_(x.t()).t(), w)
        for xs, ws in (rows_apart, col_major):
            self.assertEqual(ops.router_logits(xs, ws, b), want, atol=0, rtol=0)
            back = _router.router_logits_backward(grad, xs, ws, True, True)
            self.assertEqual(back, (gx, gw), atol=0, rtol=0)
            self.assertTrue(back[0].is_contiguous() and back[1].is_contiguous())
        threads = torch.get_num_threads()
        try:
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                self.assertEqual(ops.router_logits(x, w, b), want, atol=0, rtol=0, msg=n)
        finally:
            torch.set_num_threads(threads)
        with mock.patch.dict(os.environ, {_native.ENV: "0"}):
            ref = ops.router_logits(x, w, b)
        self.assertEqual(ref, _router.router_logits_reference(x, w, b), atol=0, rtol=0)

    def test_autocast_does_not_change_the_math(self):
        x, w, b = _inputs(17, 48, 5, torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = ops.router_logits(x, w, b)
        self.assertEqual(got.dtype, torch.float32)
        self.assertEqual(got, F.linear(x, w, b), atol=0, rtol=0)

    def test_bad_inputs(self):
        x, w, b = _inputs(4, 8, 3, torch.float32)
        cases = [
            ((x[0], w, b), r"expected x \[T, D\] .* got \[8\]"),
            ((x, w[:, :5], b), r"expected weight \[E, D=8\] .* got \[3, 5\]"),
            ((x, w, b[:2]), r"expected bias \[E=3\] .* got \[2\]"),
            ((x.int(), w, b), r"expected x \[T, D\] .* torch.int32"),
            ((x, w.to(torch.int64), b), r"expected weight \[E, D=8\] .* torch.int64"),
        ]
        for args, msg in cases:
            with self.assertRaisesRegex(ValueError, msg):
                ops.router_logits(*args)
        with self.assertRaisesRegex(
            ValueError, re.escape("expected grad [T=4, E=3] in torch.float32")
        ):
            _router.router_logits_backward(torch.zeros(4, 2), x, w, True, True)
        with self.assertRaisesRegex(ValueError, r"got \[4, 3\] torch.bfloat16"):
            _router.router_logits_backward(torch.zeros(4, 3).bfloat16(), x, w, True, True)
        with self.assertRaisesRegex(ValueError, r"expected weight \[E, D=7\] .* got \[3, 8\]"):
            _router.router_logits_backward(torch.zeros(4, 3), x[:, :7], w, True, True)
        with self.assertRaisesRegex(ValueError, r"expected x \[T, D\] .* got \[4\]"):
            _router.router_logits_backward(torch.zeros(4, 3), x[:, 0], w, True, True)


class TestRouterLogitsBackward(TestCase):
    @parametrize("dtype", HALF)
    @parametrize("shape", SHAPES)
    def test_grads_within_bound(self, dtype, shape):
        T, _, E = shape
        x, w, b = _inputs(*shape, dtype, seed=1)
        x.requires_grad_()
        w.requires_grad_()
        b.requires_grad_()
        grad = torch.randn(T, E, generator=torch.Generator().manual_seed(2))
        ops.router_logits(x, w, b).backward(grad)
        _assert_grads_within(self, x, w, grad, dtype)
        g = grad.double()
        exact_b = g.sum(0)
        bound_b = UNIT_ROUNDOFF[dtype] * (exact_b.abs() + 1) * 2 + max(T, 1) * 2**-24 * g.abs().sum(
            0
        )
        assert_within(self, b.grad, exact_b, bound_b, msg="grad_b")
        self.assertEqual((x.grad.dtype, w.grad.dtype, b.grad.dtype), (dtype,) * 3)

    @parametrize("need", [(True, False), (False, True), (True, True)])
    def test_only_the_needed_gradients(self, need):
        x, w, _ = _inputs(12, 40, 6, torch.bfloat16, seed=4)
        x.requires_grad_(need[0])
        w.requires_grad_(need[1])
        grad = torch.randn(12, 6)
        ops.router_logits(x, w).backward(grad)
        full_x, full_w = _router.router_logits_backward(grad, x.detach(), w.detach(), True, True)
        if need[0]:
            self.assertEqual(x.grad, full_x, atol=0, rtol=0)
        if need[1]:
            self.assertEqual(w.grad, full_w, atol=0, rtol=0)
        gx, gw = _router.router_logits_backward(grad, x.detach(), w.detach(), *need)
        self.assertEqual(gx.shape, (12, 40) if need[0] else (0, 40))
        self.assertEqual(gw.shape, (6, 40) if need[1] else (0, 40))

    @unittest.skipUnless(_native_runs(), "the native CPU kernels are not built here")
    def test_bits_do_not_depend_on_threads(self):
        x, w, _ = _inputs(131, 200, 11, torch.bfloat16, seed=5)
        grad = torch.randn(131, 11, generator=torch.Generator().manual_seed(6))
        results = _on_1_2_3_threads(lambda: _router.router_logits_backward(grad, x, w, True, True))
        for got in results[1:]:
            self.assertEqual(got, results[0], atol=0, rtol=0)

    def test_gradcheck_and_double_backward(self):
        x, w, b = (t.requires_grad_() for t in _inputs(5, 7, 3, torch.float64, seed=7))
        self.assertTrue(torch.autograd.gradcheck(ops.router_logits, (x, w, b)))
        self.assertTrue(torch.autograd.gradgradcheck(ops.router_logits, (x, w, b)))

    def test_opcheck(self):
        for dtype in (torch.bfloat16, torch.float32):
            x, w, b = _inputs(6, 40, 5, dtype, seed=8)
            torch.library.opcheck(torch.ops.torch_moe.router_logits.default, (x, w, b))
            x_cm = torch.empty(40, 6, dtype=dtype).copy_(x.t()).t()  # column-major
            torch.library.opcheck(torch.ops.torch_moe.router_logits.default, (x_cm, w, b))
            torch.library.opcheck(
                torch.ops.torch_moe.router_logits_backward.default,
                (torch.randn(6, 5), x_cm, w, True, True),
            )
            torch.library.opcheck(
                torch.ops.torch_moe.router_logits.default,
                (x.requires_grad_(), w.requires_grad_(), None),
            )
            grad = torch.randn(6, 5)
            for need in [(True, True), (True, False), (False, True)]:
                torch.library.opcheck(
                    torch.ops.torch_moe.router_logits_backward.default,
                    (grad, x.detach(), w.detach(), *need),
                )

    def test_compiled_is_eager(self):
        x, w, b = _inputs(20, 64, 6, torch.bfloat16, seed=9)
        grad = torch.randn(20, 6)

        def step(x, w, b):
            x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
            out = ops.router_logits(x, w, b)
            out.backward(grad)
            return out, x.grad, w.grad, b.grad

        compiled = torch.compile(step, fullgraph=False, backend="aot_eager")
        for got, want in zip(compiled(x, w, b), step(x, w, b)):
            self.assertEqual(got, want, atol=0, rtol=0)
        fwd = torch.compile(ops.router_logits, fullgraph=True, backend="aot_eager")
        self.assertEqual(fwd(x, w, b), ops.router_logits(x, w, b), atol=0, rtol=0)


def _amx_runs():
    """Whether the native kernels can take the expert GEMMs' AMX tiles here."""
    return _native_runs() and grouped_mm.amx_tiles(torch.bfloat16)


class TestRouterTiles(TestCase):
    """The bf16 kernels' two forms, each forced (the probe's ``router_kernel``): the row
    kernels' dot products and fp32 FMAs, and the expert GEMMs' AMX tiles (logits x @ w^T
    with fp32 sums; grad_x from the gradient's three bf16 parts): within the float64
    bounds on every tail shape, the op's results the forced form's own (so a test of
    one form never runs the other), the same bits on any thread count, and a non-finite
    gradient's infinities and NaNs where the reference has them."""

    @parametrize("kernel", ["native", "amx"])
    @parametrize("shape", [*SHAPES, (300, 1024, 64), (33, 96, 130)])
    def test_within_bounds(self, kernel, shape):
        if kernel == "amx" and not _amx_runs():
            self.skipTest("no AMX tiles here")
        T, _, E = shape
        x, w, b = _inputs(*shape, torch.bfloat16, seed=11)
        grad = torch.randn(T, E, generator=torch.Generator().manual_seed(12))
        with _cpu_probe.force(router_kernel=kernel):
            self.assertEqual(_router._tiles(x, w), kernel == "amx" and _native_runs())
            x.requires_grad_()
            w.requires_grad_()
            out = ops.router_logits(x, w, b)
            out.backward(grad)
        exact = _exact(x.detach(), w.detach(), b)
        bound = _logits_bound(x.detach(), w.detach(), b, exact)
        assert_within(self, out, exact, bound, msg=f"{kernel} {shape}")
        _assert_grads_within(self, x, w, grad, torch.bfloat16)
        if not _native_runs():
            return
        direct = torch.empty(T, E)
        tiles = kernel == "amx"
        mod = _native.kernels()
        self.assertTrue(mod.router_logits(x.detach(), w.detach(), b.float(), direct, tiles))
        self.assertEqual(out.detach(), direct, atol=0, rtol=0)
        gx, gw = torch.empty_like(x), torch.empty_like(w)
        self.assertTrue(mod.router_logits_backward(grad, x.detach(), w.detach(), gx, None, tiles))
        self.assertEqual(x.grad, gx, atol=0, rtol=0)
        self.assertTrue(mod.router_logits_backward(grad, x.detach(), w.detach(), None, gw, tiles))
        self.assertEqual(w.grad, gw, atol=0, rtol=0)

    @unittest.skipUnless(_amx_runs(), "no AMX tiles here")
    def test_tiles_bits_do_not_depend_on_threads(self):
        x, w, b = _inputs(389, 200, 40, torch.bfloat16, seed=13)
        grad = torch.randn(389, 40, generator=torch.Generator().manual_seed(14))
        with _cpu_probe.force(router_kernel="amx"):
            results = _on_1_2_3_threads(
                lambda: (
                    ops.router_logits(x, w, b),
                    *_router.router_logits_backward(grad, x, w, True, True),
                )
            )
        for got in results[1:]:
            self.assertEqual(got, results[0], atol=0, rtol=0)

    @parametrize("kernel", ["native", "amx"])
    def test_non_finite_gradient(self, kernel):
        if kernel == "amx" and not _amx_runs():
            self.skipTest("no AMX tiles here")
        x, w, _ = _inputs(40, 64, 20, torch.bfloat16, seed=15)
        grad = torch.randn(40, 20, generator=torch.Generator().manual_seed(16))
        grad[3, 5] = float("inf")
        grad[7, 0] = float("-inf")
        grad[9, 19] = float("nan")
        grad[11, 2], grad[11, 3] = float("inf"), float("-inf")
        x[3, 7] = 0.0  # a zero meeting an infinite gradient (grad[3, 5]): NaN in grad_w
        with _cpu_probe.force(router_kernel=kernel):
            gx, gw = _router.router_logits_backward(grad, x, w, True, True)
        for got, want in (
            (gx, (grad.double() @ w.double()).to(torch.bfloat16)),
            (gw, (grad.double().t() @ x.double()).to(torch.bfloat16)),
        ):
            self.assertTrue(torch.equal(got.isnan(), want.isnan()))
            self.assertTrue(torch.equal(got.isinf(), want.isinf()))
            self.assertTrue(torch.equal(got.isinf() & (got > 0), want.isinf() & (want > 0)))


class TestRouterLogitsProperty(TestCase):
    """Random sizes (tails of every tile and block), dtypes, biases, operand layouts and
    thread counts: the logits and both gradients within their float64 bounds (the
    number of examples is test/conftest.py's hypothesis profile)."""

    @given(
        T=st.integers(0, 70),
        D=st.integers(1, 300),
        E=st.integers(1, 40),
        dtype=st.sampled_from((*HALF, torch.float32)),
        bias=st.booleans(),
        layout=st.sampled_from(["contiguous", "rows_apart", "column_major"]),
        threads=st.integers(1, 3),
        seed=st.integers(0, 2**16),
    )
    def test_within_bounds(self, T, D, E, dtype, bias, layout, threads, seed):
        x, w, b = _inputs(T, D, E, dtype, seed=seed, bias=bias)
        if layout == "rows_apart":
            x = torch.cat([x, torch.zeros(T, 3, dtype=dtype)], 1)[:, :D]
        elif layout == "column_major":
            x = torch.empty(D, T, dtype=dtype).copy_(x.t()).t()
        x.requires_grad_()
        w.requires_grad_()
        grad = torch.randn(T, E, generator=torch.Generator().manual_seed(seed + 1))
        saved = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            out = ops.router_logits(x, w, b)
            out.backward(grad)
        finally:
            torch.set_num_threads(saved)
        exact = _exact(x.detach(), w.detach(), b)
        assert_within(self, out, exact, _logits_bound(x.detach(), w.detach(), b, exact), "logits")
        _assert_grads_within(self, x, w, grad, dtype)


instantiate_parametrized_tests(TestRouterLogits)
instantiate_parametrized_tests(TestRouterLogitsBackward)
instantiate_parametrized_tests(TestRouterTiles)

if __name__ == "__main__":
    run_tests()
