# Owner(s): ["module: moe"]
"""``torch_moe::glu`` (``torch_moe.nn.functional.glu_activation``): the composed experts'
activation (gated, or Nemotron-H's ungated relu2). The forward against its formula in fp32 rounded once, the backward's
written-out derivatives against autograd through ``glu_reference``, the CPU kernels' row
chunks against one chunk, the registrations (``opcheck``) and the argument checks."""

import itertools
from unittest import mock

import torch
import torch.nn.functional as F
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe
from torch_moe._ops import glu as glu_ops

F64 = torch.float64
CASES = [  # (activation, limit, interleaved, row weights)
    ("swiglu", None, False, False),
    ("swiglu", 1.0, False, True),
    ("swigluoai", None, True, True),
    ("swigluoai", 1.0, True, False),
    ("swigluoai", 1.0, False, True),
    ("relu2", None, False, True),  # ungated: h [M, F]
    ("relu2", None, False, False),
]


def _width(activation, h):
    """The activation's output columns F for h."""
    return h.shape[1] // 2 if glu_ops.gated(activation) else h.shape[1]


def _inputs(dtype, rows=37, hidden=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (3 * torch.randn(rows, 2 * hidden, generator=g, dtype=F64)).to(dtype)  # clamps act
    rw = torch.rand(rows, generator=g, dtype=F64).to(torch.float32 if dtype != F64 else F64)
    return h, rw


@instantiate_parametrized_tests
class TestGlu(TestCase):
    @staticmethod
    def _formula(h, rw, activation, alpha, limit, interleaved):
        h = h.float()
        gate, up = (h[:, 0::2], h[:, 1::2]) if interleaved else (h[:, :6], h[:, 6:])
        if limit is not None:
            gate, up = torch.minimum(gate, torch.tensor(limit)), up.clamp(-limit, limit)
        if activation == "swiglu":
            a = F.silu(gate) * up
        else:
            a = gate * torch.sigmoid(alpha * gate) * (up + 1)
        return a if rw is None else a * rw.float()[:, None]

    @parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    @parametrize("activation", ["swiglu", "swigluoai"])
    def test_formula_in_fp32_rounded_once(self, dtype, activation):
        g = torch.Generator().manual_seed(0)
        h = (3 * torch.randn(37, 12, generator=g)).to(dtype)  # |h| > 1 often: clamps act
        rw = torch.rand(37, generator=g)
        for limit, interleaved, weights in [
            (None, False, None),
            (1.0, False, rw),
            (1.0, True, None),
            (None, True, rw.to(dtype)),
        ]:
            kw = dict(activation=activation, limit=limit, interleaved=interleaved)
            got = torch_moe.nn.functional.glu_activation(h, weights, **kw)  # default alpha
            want = self._formula(h, weights, activation, 1.702, limit, interleaved).to(dtype)
            self.assertEqual(got.dtype, dtype)
            self.assertEqual(got, want, atol=0, rtol=0, msg=str(kw))
        a = torch_moe.nn.functional.glu_activation(h, activation=activation, alpha=0.5)
        self.assertEqual(
            a, self._formula(h, None, activation, 0.5, None, False).to(dtype), atol=0, rtol=0
        )

    @parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    def test_relu2_in_fp32_rounded_once(self, dtype):
        g = torch.Generator().manual_seed(0)
        h = (3 * torch.randn(37, 5, generator=g)).to(dtype)  # ungated: any width
        rw = torch.rand(37, generator=g)
        for weights in (None, rw, rw.to(dtype)):
            got = torch_moe.nn.functional.glu_activation(h, weights, activation="relu2")
            want = torch.relu(h.float()).square()
            want = (want if weights is None else want * weights.float()[:, None]).to(dtype)
            self.assertEqual(got.dtype, dtype)
            self.assertEqual(got, want, atol=0, rtol=0)
        self.assertTrue((got == 0).any() and (got > 0).any())  # both sides of the kink

    def test_bad_arguments(self):
        glu = torch_moe.nn.functional.glu_activation
        h = torch.zeros(3, 4)
        with self.assertRaisesRegex(ValueError, r"glu: activation must be one of"):
            glu(h, activation="gelu")
        with self.assertRaisesRegex(ValueError, r"glu: swigluoai needs swiglu_alpha > 0, got -1.0"):
            glu(h, activation="swigluoai", alpha=-1.0)
        with self.assertRaisesRegex(ValueError, r"glu: swiglu_limit must be > 0 or None, got 0.0"):
            glu(h, limit=0.0)
        self.assertEqual(glu(h, activation="swigluoai", alpha=0.5).shape, (3, 2))
        bad_rw = r"glu: expected row_weights to be a floating-point tensor \[M=3\] on cpu, got "
        for rw, got in [
            (torch.ones(4), r"\[4\] torch.float32"),
            (torch.ones(3, dtype=torch.int64), r"\[3\] torch.int64"),
        ]:
            with self.assertRaisesRegex(ValueError, bad_rw + got):
                glu(h, rw)
            # the reference (the op's kernel on other devices) checks alike
            with self.assertRaisesRegex(ValueError, bad_rw + got):
                glu_ops.glu_reference(h, rw, "swiglu", 1.702, None, False)
        with self.assertRaisesRegex(ValueError, r"glu: swiglu_limit must be > 0 or None, got -1"):
            glu_ops.glu_reference(h, None, "swiglu", 1.702, -1, False)
        with self.assertRaisesRegex(
            ValueError,
            r"glu: swiglu_limit clamps a gated .*'relu2' is ungated, got swiglu_limit=1.0",
        ):
            glu(h, activation="relu2", limit=1.0)
        with self.assertRaisesRegex(
            ValueError, r"glu: interleaved gate / up columns need a gated activation, got 'relu2'"
        ):
            glu(h, activation="relu2", interleaved=True)
        odd = torch.zeros(3, 5)
        self.assertEqual(glu(odd, activation="relu2").shape, (3, 5))  # ungated: h is [M, F]
        with self.assertRaisesRegex(ValueError, r"^glu: expected h \[M, 2F\] \(gate and up"):
            glu(odd)

    def test_row_weight_gradient_in_their_dtype(self):
        h, _ = _inputs(torch.bfloat16, rows=5)
        for dtype in (torch.bfloat16, F64):
            rw = torch.rand(5, dtype=dtype, requires_grad=True)
            torch_moe.nn.functional.glu_activation(h, rw, activation="swigluoai").sum().backward()
            self.assertEqual(rw.grad.dtype, dtype)

    @parametrize("dtype", [F64, torch.float32, torch.bfloat16])
    @parametrize("case", range(len(CASES)))
    def test_backward_matches_autograd_of_the_reference(self, dtype, case):
        activation, limit, interleaved, weighted = CASES[case]
        h, rw = _inputs(dtype)
        args = (activation, 1.702, limit, interleaved)
        grad = torch.randn(
            h.shape[0], _width(activation, h), generator=torch.Generator().manual_seed(5)
        )
        grad = grad.to(dtype)
        got_h, want_h = h.clone().requires_grad_(), h.clone().requires_grad_()
        got_rw = rw.clone().requires_grad_() if weighted else None
        want_rw = rw.clone().requires_grad_() if weighted else None
        got = torch_moe.nn.functional.glu_activation(
            got_h, got_rw, activation=activation, limit=limit, interleaved=interleaved
        )
        want = glu_ops.glu_reference(want_h, want_rw, *args)
        self.assertEqual(got, want, atol=0, rtol=0)  # the same forward, bit for bit
        got.backward(grad)
        want.backward(grad)
        # fp64: the written-out derivatives equal autograd's chain to rounding; low
        # precision: both computed in fp32 and rounded once into dh, at most one step apart
        tol = dict(atol=1e-12, rtol=1e-10) if dtype == F64 else None
        self.assertEqual(got_h.grad, want_h.grad, **(tol or {}))
        if weighted:
            self.assertEqual(got_rw.grad, want_rw.grad, **(tol or {}))

    @parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_backward_of_a_broadcast_or_overlapping_h(self, dtype):
        # h with unit column stride but not dense: a row broadcast (strides (0, 1)) and
        # overlapping rows (strides (1, 1)); dH once took the overlapping h's layout
        # (column-major), which the native kernels refused with an internal error
        g = torch.Generator().manual_seed(6)
        rows, f = 7, 20
        cases = {
            "broadcast": torch.randn(1, 2 * f, generator=g).to(dtype).expand(rows, 2 * f),
            "overlapping": torch.randn(rows + 2 * f, generator=g)
            .to(dtype)
            .as_strided((rows, 2 * f), (1, 1)),
        }
        grad = torch.randn(rows, f, generator=g).to(dtype)
        for (name, h), activation in itertools.product(cases.items(), ("swiglu", "swigluoai")):
            with self.subTest(name, activation=activation):
                got_h, want_h = h.detach().requires_grad_(), h.detach().requires_grad_()
                got = torch_moe.nn.functional.glu_activation(got_h, activation=activation)
                want = glu_ops.glu_reference(want_h, None, activation, 1.702, None, False)
                self.assertEqual(got, want)
                got.backward(grad)
                want.backward(grad)
                self.assertEqual(got_h.grad, want_h.grad)

    def test_clamp_bounds_pass_the_gradient(self):
        # torch.clamp's rule, which the written-out backward follows: inputs equal to a
        # bound pass the gradient, inputs beyond it do not
        h = torch.tensor([[1.0, -2.0, 1.0, 1.0], [3.0, 0.5, -1.0, 2.0]], dtype=F64)
        for activation in glu_ops.GATED:  # relu2 takes no limit
            got_h, want_h = h.clone().requires_grad_(), h.clone().requires_grad_()
            torch_moe.nn.functional.glu_activation(
                got_h, activation=activation, limit=1.0
            ).sum().backward()
            glu_ops.glu_reference(want_h, None, activation, 1.702, 1.0, False).sum().backward()
            self.assertEqual(got_h.grad, want_h.grad, atol=1e-15, rtol=0, msg=activation)
            self.assertEqual(got_h.grad[1, 0], torch.tensor(0.0, dtype=F64))  # gate 3 > 1
            self.assertNotEqual(got_h.grad[0, 0], torch.tensor(0.0, dtype=F64))  # gate = 1

    @parametrize("case", range(len(CASES)))
    def test_cpu_row_chunks_equal_one_chunk(self, case):
        activation, limit, interleaved, weighted = CASES[case]
        h, rw = _inputs(torch.bfloat16, rows=29)
        rw = rw if weighted else None
        args = (activation, 1.702, limit, interleaved)
        grad = torch.randn(29, _width(activation, h), generator=torch.Generator().manual_seed(2))
        grad = grad.to(torch.bfloat16)
        whole = torch.ops.torch_moe.glu(h, rw, *args)
        whole_b = torch.ops.torch_moe.glu_backward(grad, h, rw, *args)
        with mock.patch.object(glu_ops, "_rows_per_chunk", return_value=4):  # 8 chunks
            chunked = torch.ops.torch_moe.glu(h, rw, *args)
            chunked_b = torch.ops.torch_moe.glu_backward(grad, h, rw, *args)
        self.assertEqual(chunked, whole, atol=0, rtol=0)
        self.assertEqual(chunked, glu_ops.glu_reference(h, rw, *args), atol=0, rtol=0)
        self.assertEqual(chunked_b[0], whole_b[0], atol=0, rtol=0)  # dh: elementwise
        # d row_weights sums over F: ATen's row reduction may vectorize differently for
        # another number of rows (measured: 5e-6 relative), so fp32 rounding, not bits
        self.assertEqual(chunked_b[1], whole_b[1], atol=1e-6, rtol=1e-5)
        self.assertEqual(chunked_b[1].numel(), 0 if rw is None else 29)

    def test_opcheck(self):
        h, rw = _inputs(torch.float32, rows=9)
        for activation, limit, interleaved, weighted in CASES:
            args = (activation, 1.702, limit, interleaved)
            w = rw.clone().requires_grad_() if weighted else None
            hh = h.clone().requires_grad_()
            torch.library.opcheck(torch.ops.torch_moe.glu.default, (hh, w, *args))
            grad = torch.randn(9, _width(activation, h))
            torch.library.opcheck(torch.ops.torch_moe.glu_backward.default, (grad, h, rw, *args))

    def test_empty_rows(self):
        h = torch.empty(0, 8, requires_grad=True)
        a = torch_moe.nn.functional.glu_activation(h, activation="swigluoai", limit=7.0)
        self.assertEqual(a.shape, (0, 4))
        a.sum().backward()
        self.assertEqual(h.grad.shape, (0, 8))


if __name__ == "__main__":
    run_tests()
