"""Patch 0005: the backward of _grouped_mm accepts a zero-stride incoming gradient.

``torch._grouped_mm(x, w, offs=offs).sum().backward()`` hands the backward an
expanded gradient with strides [0, 0]; on stock torch 2.13.0 the derivative
helpers pass it straight to _grouped_mm, which raises "Invalid strides/sizes,
got [0, 0]". The fix is C++ (torch/csrc/autograd/FunctionsManual.cpp), so with
a wheel this test can only show the failure; it passes on a torch built with
the patch. Checked against a float64 per-group loop.
"""

import torch
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


def _inputs(w_col_major):
    torch.manual_seed(0)
    x = torch.randn(32, 16, requires_grad=True)
    w = torch.randn(2, 16, 16)
    if w_col_major:
        w = w.mT.contiguous().mT
    w.requires_grad_(True)
    offs = torch.tensor([10, 32], dtype=torch.int32)
    return x, w, offs


def _reference_grads(x, w, offs):
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    start, outs = 0, []
    for g, end in enumerate(offs.tolist()):
        outs.append(x64[start:end] @ w64[g])
        start = end
    torch.cat(outs).sum().backward()
    return x64.grad, w64.grad


class TestGroupedMMZeroStrideGrad(TestCase):
    @parametrize("w_col_major", [False, True])
    def test_sum_backward(self, w_col_major):
        x, w, offs = _inputs(w_col_major)
        torch._grouped_mm(x, w, offs=offs).sum().backward()
        gx, gw = _reference_grads(x, w, offs)
        self.assertEqual(x.grad, gx.float(), atol=1e-4, rtol=1e-4)
        self.assertEqual(w.grad, gw.float(), atol=1e-4, rtol=1e-4)

    def test_expanded_grad_explicit(self):
        x, w, offs = _inputs(False)
        out = torch._grouped_mm(x, w, offs=offs)
        grad = torch.ones(()).expand(out.shape)  # strides (0, 0)
        out.backward(grad)
        gx, gw = _reference_grads(x, w, offs)
        self.assertEqual(x.grad, gx.float(), atol=1e-4, rtol=1e-4)
        self.assertEqual(w.grad, gw.float(), atol=1e-4, rtol=1e-4)


instantiate_parametrized_tests(TestGroupedMMZeroStrideGrad)

if __name__ == "__main__":
    run_tests()
