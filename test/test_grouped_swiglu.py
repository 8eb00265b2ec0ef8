# Owner(s): ["module: moe"]
"""Tests for torch_moe.nn.functional.grouped_swiglu against a naive per-token loop."""

import unittest.mock

import naive
import torch
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe
from torch_moe._ops.grouped_swiglu import swiglu_reference
from torch_moe.nn.functional import grouped_swiglu

TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=6e-2, rtol=3e-2),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
}


def _offs(sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def _naive(x, w13, w2, offs):
    """Token by token, float64; rows past offs[-1] are zero."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        for r in range(start, end):
            out[r] = naive.expert_swiglu(x[r], w13[e], w2[e])
        start = end
    return out


def _inputs(sizes, dim, hidden, dtype, tail=0, scale=0.5):
    offs = _offs(sizes)
    m = int(offs[-1]) + tail
    x = (torch.randn(dim, m, dtype=dtype) * scale).t().requires_grad_()  # non-contiguous
    w13 = (torch.randn(len(sizes), 2 * hidden, dim, dtype=dtype) * scale).requires_grad_()
    w2 = (torch.randn(len(sizes), dim, hidden, dtype=dtype) * scale).requires_grad_()
    return x, w13, w2, offs


class TestGroupedSwiGLU(TestCase):
    @parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
    @parametrize("sizes", [[4, 0, 6, 1], [0, 0, 9], [5], [0, 0]])
    @parametrize("dim_hidden", [(8, 6), (7, 5)])
    def test_matches_naive(self, dtype, sizes, dim_hidden):
        dim, hidden = dim_hidden
        x, w13, w2, offs = _inputs(sizes, dim, hidden, dtype, tail=2)
        y = grouped_swiglu(x, w13, w2, offs)
        self.assertEqual(y.dtype, dtype)
        self.assertEqual(
            y.double(), _naive(x.detach(), w13.detach(), w2.detach(), offs), **TOL[dtype]
        )
        self.assertTrue((y[int(offs[-1]) :] == 0).all())

    @parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_backward_matches_float64_autograd(self, dtype):
        x, w13, w2, offs = _inputs([3, 0, 5, 2], 9, 5, dtype, tail=3)
        y = grouped_swiglu(x, w13, w2, offs)
        grad = torch.randn_like(y)
        y.backward(grad)
        ref_inputs = [t.detach().double().requires_grad_() for t in (x, w13, w2)]
        swiglu_reference(*ref_inputs, offs).backward(grad.double())
        for ours, ref in zip((x.grad, w13.grad, w2.grad), ref_inputs):
            self.assertEqual(ours.double(), ref.grad, **TOL[dtype])
        self.assertTrue((x.grad[10:] == 0).all())

    def test_cpu_backward_row_chunks(self):
        # the CPU backward runs its elementwise part in row chunks: make them tiny
        x, w13, w2, offs = _inputs([7, 0, 11, 4], 6, 5, torch.float64, tail=2)
        rw = torch.rand(x.shape[0], dtype=torch.float64, requires_grad=True)
        grad = torch.randn(x.shape, dtype=torch.float64)
        inputs = (x, w13, w2, rw)
        with unittest.mock.patch.object(torch_moe._ops.grouped_swiglu, "_ACT_CHUNK_ELEMS", 10):
            got = torch.autograd.grad(grouped_swiglu(x, w13, w2, offs, rw), inputs, grad)
        want = torch.autograd.grad(swiglu_reference(x, w13, w2, offs, rw), inputs, grad)
        self.assertEqual(got, want)

    def test_zero_stride_grad(self):
        x, w13, w2, offs = _inputs([3, 4], 8, 4, torch.float32)
        grouped_swiglu(x, w13, w2, offs).sum().backward()
        ref_inputs = [t.detach().double().requires_grad_() for t in (x, w13, w2)]
        swiglu_reference(*ref_inputs, offs).sum().backward()
        self.assertEqual(x.grad.double(), ref_inputs[0].grad, **TOL[torch.float32])

    def test_gradcheck(self):
        x, w13, w2, offs = _inputs([2, 0, 3], 4, 3, torch.float64, tail=1)
        self.assertTrue(torch.autograd.gradcheck(grouped_swiglu, (x, w13, w2, offs)))

    def test_row_weights(self):
        x, w13, w2, offs = _inputs([2, 0, 3], 4, 3, torch.float64, tail=1)
        rw = torch.rand(x.shape[0], dtype=torch.float64, requires_grad=True)
        y = grouped_swiglu(x, w13, w2, offs, row_weights=rw)
        ref = _naive(x.detach(), w13.detach(), w2.detach(), offs) * rw.detach().unsqueeze(1)
        self.assertEqual(y, ref)
        self.assertTrue(torch.autograd.gradcheck(grouped_swiglu, (x, w13, w2, offs, rw)))
        grad = torch.randn_like(y)
        got = torch.autograd.grad(grouped_swiglu(x, w13, w2, offs, rw), (x, w13, w2, rw), grad)
        want = torch.autograd.grad(swiglu_reference(x, w13, w2, offs, rw), (x, w13, w2, rw), grad)
        self.assertEqual(got, want)

    def test_row_weights_low_precision(self):
        x, w13, w2, offs = _inputs([5, 0, 7], 8, 6, torch.bfloat16, tail=2)
        rw = torch.rand(x.shape[0], requires_grad=True)
        y = grouped_swiglu(x, w13, w2, offs, row_weights=rw)
        y.backward(torch.ones_like(y))
        ref_in = [t.detach().double().requires_grad_() for t in (x, w13, w2, rw)]
        swiglu_reference(*ref_in[:3], offs, ref_in[3]).backward(
            torch.ones(y.shape, dtype=torch.float64)
        )
        self.assertEqual(
            y.double(),
            swiglu_reference(*[t.detach() for t in ref_in[:3]], offs, ref_in[3].detach()),
            **TOL[torch.bfloat16],
        )
        self.assertEqual(rw.grad.dtype, torch.float32)
        self.assertEqual(rw.grad.double(), ref_in[3].grad, atol=0.1, rtol=0.03)

    def test_generic_path_matches_cpu_kernel(self):
        # The composed (non-CPU) implementation is what CUDA runs: check it here too.
        x, w13, w2, offs = _inputs([3, 0, 5], 8, 6, torch.float32, tail=2)
        grad = torch.randn(x.shape)
        fused = torch.ops.torch_moe.grouped_swiglu.default(x, w13, w2, offs)
        composed = torch_moe._ops.grouped_swiglu.grouped_swiglu._init_fn(x, w13, w2, offs)
        self.assertEqual(fused, composed)
        bwd_args = (grad, None, x.detach(), fused[1].detach(), w13.detach(), w2.detach(), offs)
        fused_bwd = torch.ops.torch_moe.grouped_swiglu_backward.default(*bwd_args)
        composed_bwd = torch_moe._ops.grouped_swiglu.grouped_swiglu_backward._init_fn(*bwd_args)
        self.assertEqual(fused_bwd, composed_bwd)
        rw = torch.rand(x.shape[0])
        fused = torch.ops.torch_moe.grouped_swiglu.default(x, w13, w2, offs, rw)
        composed = torch_moe._ops.grouped_swiglu.grouped_swiglu._init_fn(x, w13, w2, offs, rw)
        self.assertEqual(fused, composed)
        bwd_args = (*bwd_args, rw)
        fused_bwd = torch.ops.torch_moe.grouped_swiglu_backward.default(*bwd_args)
        composed_bwd = torch_moe._ops.grouped_swiglu.grouped_swiglu_backward._init_fn(*bwd_args)
        self.assertEqual(fused_bwd, composed_bwd)

    def test_saves_only_input_and_preactivation(self):
        x, w13, w2, offs = _inputs([6, 0, 10], 16, 12, torch.float32)
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            grouped_swiglu(x, w13, w2, offs)
        activations = sorted(tuple(t.shape) for t in saved if t.dim() == 2)
        self.assertEqual(activations, [(16, 16), (16, 24)])  # x [M, D] and h [M, 2F]
        weights = [t for t in saved if t.dim() == 3]
        self.assertTrue(
            all(any(w is p or w.data_ptr() == p.data_ptr() for p in (w13, w2)) for w in weights)
        )

    def test_opcheck(self):
        x, w13, w2, offs = _inputs([3, 0, 4], 8, 4, torch.float32, tail=1)
        torch.library.opcheck(torch.ops.torch_moe.grouped_swiglu.default, (x, w13, w2, offs))
        rw = torch.rand(x.shape[0], requires_grad=True)
        torch.library.opcheck(torch.ops.torch_moe.grouped_swiglu.default, (x, w13, w2, offs, rw))
        y, h = torch.ops.torch_moe.grouped_swiglu.default(x, w13, w2, offs)
        torch.library.opcheck(
            torch.ops.torch_moe.grouped_swiglu_backward.default,
            (torch.randn_like(y), None, x.detach(), h.detach(), w13.detach(), w2.detach(), offs),
        )

    def test_compile_fullgraph(self):
        x, w13, w2, offs = _inputs([3, 0, 4], 8, 4, torch.float32)
        compiled = torch.compile(grouped_swiglu, fullgraph=True, backend="aot_eager")
        self.assertEqual(compiled(x, w13, w2, offs), grouped_swiglu(x, w13, w2, offs))

    def test_bad_inputs(self):
        x, w13, w2, offs = _inputs([2, 3], 8, 4, torch.float32)
        with self.assertRaisesRegex(
            ValueError,
            r"w2 must be \[E, D, F\] = \[2, 8, 4\] to match w13 \[2, 8, 8\], got \[2, 8, 5\]",
        ):
            grouped_swiglu(x, w13, torch.randn(2, 8, 5), offs)
        with self.assertRaisesRegex(ValueError, r"x is \[M, D=7\] but w13 is \[E, 2F, D=8\]"):
            grouped_swiglu(torch.randn(5, 7), w13, w2, offs)
        with self.assertRaisesRegex(ValueError, r"even 2F, got \[2, 7, 8\]"):
            grouped_swiglu(x, torch.randn(2, 7, 8), w2, offs)
        with self.assertRaisesRegex(
            ValueError, r"share a dtype .* got torch.float32, torch.bfloat16, torch.float32"
        ):
            grouped_swiglu(x, w13.bfloat16(), w2, offs)
        with self.assertRaisesRegex(
            ValueError, r"offs to be 1D int32 with E=2 entries, got 1D torch.int64 with 2"
        ):
            grouped_swiglu(x, w13, w2, offs.long())
        with self.assertRaisesRegex(
            ValueError, r"offs must be non-decreasing .* got offs=\[3, 2\]"
        ):
            grouped_swiglu(x, w13, w2, torch.tensor([3, 2], dtype=torch.int32))


instantiate_parametrized_tests(TestGroupedSwiGLU)

if __name__ == "__main__":
    run_tests()
