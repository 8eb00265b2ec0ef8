# Owner(s): ["module: moe"]
"""Tests for torch_moe::grouped_mm and grouped_mm_wgrad against a naive per-row loop."""

import itertools

import tolerances
import torch
from torch.testing._internal.common_device_type import (
    dtypes,
    instantiate_device_type_tests,
    onlyCUDA,
)
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe  # noqa: F401
from torch_moe._ops.grouped_mm import grouped_mm_reference, grouped_mm_wgrad
from torch_moe.ops import grouped_mm


def assert_gemm_close(test, got, a, b, offs, msg="", wgrad=False):
    """``got`` within the rounding bound of the grouped GEMM ``a @ b[g]`` (or, ``wgrad``,
    ``a[g]^T @ b[g]``) in ``got``'s dtype: fp32 accumulation (fp64 for fp64) of exact
    products, one rounding into the output (tolerances.gemm_bound). The bound is computed
    from the float64 row loop, so a 1% scale error or a shifted row fails it."""
    dtype = got.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    ref = naive_grouped_mm_wgrad if wgrad else naive_grouped_mm
    exact = ref(a.detach(), b.detach(), offs)
    products = ref(a.detach().abs(), b.detach().abs(), offs)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)) if offs.numel() else offs
    n = int(sizes.max()) if wgrad and offs.numel() else a.shape[1]
    bound = tolerances.gemm_bound(products, max(n, 1), exact, acc, dtype)
    tolerances.assert_within(test, got, exact, bound, msg)


def naive_grouped_mm_wgrad(x, dy, offs):
    """out[g] = sum over the rows r of group g of outer(x[r], dy[r]), float64."""
    out = torch.zeros(offs.shape[0], x.shape[1], dy.shape[1], dtype=torch.float64)
    ends = offs.tolist()
    for r in range(x.shape[0]):
        g = next((i for i, e in enumerate(ends) if r < e), None)
        if g is not None:
            out[g] += torch.outer(x[r].double(), dy[r].double())
    return out


def naive_grouped_mm(x, w, offs):
    """Row by row in float64: out[r] = x[r] @ w[group of r]; zero past offs[-1]."""
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    ends = offs.tolist()
    for r in range(x.shape[0]):
        g = next((i for i, e in enumerate(ends) if r < e), None)
        if g is not None:
            out[r] = x[r].double() @ w[g].double()
    return out


def make_offs(sizes, tail=0):
    """Group ends from group sizes; ``tail`` extra rows past the last group."""
    ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    return ends, int(ends[-1]) + tail if len(sizes) else tail


GROUPS = {
    "even": [5, 5, 5, 5],
    "empty_groups": [0, 7, 0, 0, 3, 0],
    "one_group_all": [0, 0, 12, 0],
    "single": [9],
    "no_rows": [0, 0, 0],
}


class TestGroupedMM(TestCase):
    @parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
    @parametrize("groups", list(GROUPS))
    @parametrize("kn", [(16, 32), (7, 13)])
    @parametrize("w_layout", ["EKN", "ENK_transposed"])
    def test_forward_backward_matches_naive(self, dtype, groups, kn, w_layout):
        k, n = kn
        offs, m = make_offs(GROUPS[groups], tail=3)
        num_groups = offs.shape[0]
        x = torch.randn(k, m, dtype=dtype).t().requires_grad_()  # non-contiguous
        if w_layout == "EKN":
            w = torch.randn(num_groups, k, n, dtype=dtype, requires_grad=True)
            w_leaf = w
        else:
            w_leaf = torch.randn(num_groups, n, k, dtype=dtype, requires_grad=True)
            w = w_leaf.transpose(-2, -1)
        out = grouped_mm(x, w, offs)
        self.assertEqual(out.dtype, dtype)
        self.assertEqual(out.shape, (m, n))
        assert_gemm_close(self, out, x, w, offs, "forward")
        self.assertTrue((out[int(offs[-1]) if num_groups else 0 :] == 0).all())

        grad = torch.randn(m, n, dtype=dtype)
        out.backward(grad)
        # dX = dY @ w[g]^T and dW[g] = x[g]^T @ dY[g], each one GEMM rounded once
        assert_gemm_close(self, x.grad, grad, w.detach().transpose(-2, -1), offs, "dX")
        self.assertEqual(w_leaf.grad.shape, w_leaf.shape)
        w_grad = w_leaf.grad if w_layout == "EKN" else w_leaf.grad.transpose(-2, -1)
        assert_gemm_close(self, w_grad, x, grad, offs, "dW", wgrad=True)
        self.assertTrue((x.grad[int(offs[-1]) if num_groups else 0 :] == 0).all())

    @parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_zero_stride_grad(self, dtype):
        # torch._grouped_mm's backward fails here: "Invalid strides/sizes, got [0, 0]".
        offs, m = make_offs([3, 0, 4], tail=2)
        x = torch.randn(m, 16, dtype=dtype, requires_grad=True)
        w = torch.randn(3, 16, 8, dtype=dtype, requires_grad=True)
        grouped_mm(x, w, offs).sum().backward()
        ones = torch.ones(m, 8, dtype=dtype)
        assert_gemm_close(self, x.grad, ones, w.detach().transpose(1, 2), offs, "dX")
        assert_gemm_close(self, w.grad, x, ones, offs, "dW", wgrad=True)
        self.assertEqual(w.grad[1], torch.zeros(16, 8, dtype=dtype))

    @parametrize("dtype", [torch.float32, torch.bfloat16])
    @parametrize("way", ["torch", "loop"])
    def test_broadcast_operands(self, dtype, way):
        # an x broadcast over its rows (strides (0, 1)) and a weight broadcast over its K
        # rows: torch._grouped_mm refuses both ("Invalid strides/sizes"), so its way
        # (forced here, measured on some machines) must not be given them
        from torch_moe._ops import _cpu_probe

        offs, m = make_offs([8, 0, 8])
        x = torch.randn(1, 32, dtype=dtype).expand(m, 32)
        w = torch.randn(3, 1, 16, dtype=dtype).expand(3, 32, 16)
        for xx, ww in ((x, w.contiguous()), (x.contiguous(), w)):
            xl, wl = xx.detach().requires_grad_(), ww.detach().requires_grad_()
            with _cpu_probe.force(grouped_mm=way, half_gemm="native"):
                y = grouped_mm(xl, wl, offs)
                y.backward(torch.ones_like(y))
            assert_gemm_close(self, y, xx, ww, offs, "y")
            ones = torch.ones(m, 16, dtype=dtype)
            assert_gemm_close(self, xl.grad, ones, ww.transpose(1, 2), offs, "dX")
            assert_gemm_close(self, wl.grad, xx, ones, offs, "dW", wgrad=True)

    @parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    @parametrize("w_layout", ["EKN", "ENK_transposed"])
    def test_empty_dims(self, dtype, w_layout):
        # N = 0, K = 0 and E = 0 through every kernel's row counts (a few rows: the few-rows
        # kernel, whose column tasks once divided by N = 0 and crashed the process; many:
        # the grouped GEMM); the results are those of the naive loop: zeros or empty
        for rows in (3, 300):
            for e, k, n in ((2, 16, 0), (2, 0, 8), (0, 16, 8)):
                offs = make_offs([rows // 2, rows - rows // 2][:e])[0]
                x = torch.randn(rows, k, dtype=dtype, requires_grad=True)
                if w_layout == "EKN":
                    w = torch.randn(e, k, n, dtype=dtype, requires_grad=True)
                else:
                    w = torch.randn(e, n, k, dtype=dtype).transpose(-2, -1).requires_grad_()
                with self.subTest(rows=rows, e=e, k=k, n=n):
                    out = grouped_mm(x, w, offs)
                    want = naive_grouped_mm(x.detach(), w.detach(), offs).to(dtype)
                    self.assertEqual(out, want, atol=0, rtol=0)
                    out.backward(torch.ones_like(out))
                    self.assertEqual(x.grad, torch.zeros_like(x), atol=0, rtol=0)
                    ones = torch.ones(rows, n, dtype=dtype)
                    want = naive_grouped_mm_wgrad(x.detach(), ones, offs).to(dtype)
                    self.assertEqual(w.grad, want, atol=0, rtol=0)

    def test_matches_torch_grouped_mm_where_it_works(self):
        offs, m = make_offs([4, 12, 0, 8])
        x = torch.randn(m, 32, dtype=torch.bfloat16)
        w = torch.randn(4, 64, 32, dtype=torch.bfloat16).transpose(-2, -1)
        ours = grouped_mm(x, w, offs)
        theirs = torch._grouped_mm(x, w, offs=offs)
        # both are bf16 GEMMs with fp32 accumulation: each within the rounding bound
        assert_gemm_close(self, ours, x, w, offs, "torch_moe")
        assert_gemm_close(self, theirs, x, w, offs, "torch._grouped_mm")

    def test_wgrad_matches_naive(self):
        offs, m = make_offs([3, 0, 6, 2], tail=4)
        x = torch.randn(m, 5, dtype=torch.float64)
        dy = torch.randn(m, 9, dtype=torch.float64)
        out = grouped_mm_wgrad(x, dy, offs)
        start = 0
        for g, end in enumerate(offs.tolist()):
            ref = sum(
                (torch.outer(x[r], dy[r]) for r in range(start, end)),
                torch.zeros(5, 9, dtype=torch.float64),
            )
            self.assertEqual(out[g], ref)
            start = end

    @parametrize("transposed", [False, True])
    def test_weight_gradient_in_the_weights_layout(self, transposed):
        # the op's weight gradient comes in w's own layout: a weight used as x @ w^T (a
        # column-major view of a row-major [E, N, K]) gets its gradient computed as dY^T x
        # per group, so AccumulateGrad stores it without copying every expert transposed
        offs, m = make_offs([5, 0, 9, 4], tail=2)
        x = torch.randn(m, 6, dtype=torch.float64, requires_grad=True)
        leaf = (
            torch.randn(4, 7, 6, dtype=torch.float64)
            if transposed
            else torch.randn(4, 6, 7, dtype=torch.float64)
        )
        leaf.requires_grad_()
        w = leaf.transpose(-2, -1) if transposed else leaf * 1  # a view, or a fresh tensor
        grad = torch.randn(m, 7, dtype=torch.float64)
        (dw,) = torch.autograd.grad(grouped_mm(x, w, offs), w, grad)
        self.assertEqual(dw.stride(), w.stride())
        want = [x[s:e].t() @ grad[s:e] for s, e in zip([0, 5, 5, 14], [5, 5, 14, 18])]
        self.assertEqual(dw, torch.stack(want))

    def test_gradcheck(self):
        offs, m = make_offs([2, 0, 3], tail=1)
        x = torch.randn(m, 3, dtype=torch.float64, requires_grad=True)
        w = torch.randn(3, 3, 4, dtype=torch.float64, requires_grad=True)
        self.assertTrue(torch.autograd.gradcheck(grouped_mm, (x, w, offs)))

    def test_reference_agrees(self):
        offs, m = make_offs([4, 0, 5], tail=2)
        x = torch.randn(m, 6)
        w = torch.randn(3, 6, 5)
        self.assertEqual(grouped_mm(x, w, offs), grouped_mm_reference(x, w, offs))

    def test_opcheck(self):
        offs, m = make_offs([4, 0, 5], tail=2)
        for dtype in [torch.float32, torch.bfloat16]:
            x = torch.randn(m, 24, dtype=dtype, requires_grad=True)
            w = torch.randn(3, 24, 8, dtype=dtype, requires_grad=True)
            torch.library.opcheck(torch.ops.torch_moe.grouped_mm.default, (x, w, offs))
            torch.library.opcheck(
                torch.ops.torch_moe.grouped_mm_wgrad.default,
                (x.detach(), torch.randn(m, 8, dtype=dtype), offs),
            )

    def test_compile_fp32(self):
        # torch._grouped_mm's meta kernel rejects fp32; ours traces in any dtype.
        offs, m = make_offs([4, 0, 5], tail=2)
        x = torch.randn(m, 6, requires_grad=True)
        w = torch.randn(3, 6, 5, requires_grad=True)
        compiled = torch.compile(grouped_mm, fullgraph=True, backend="aot_eager")
        self.assertEqual(compiled(x, w, offs), grouped_mm(x, w, offs))

    def test_autocast_does_not_recast(self):
        """Under a caller's autocast the ops compute in their operands' dtype, with the
        half-precision path the CPU probe chose (bf16 upcast to fp32, or native): the bits
        of a call without autocast, in eager and compiled code alike. (With the upcast,
        autocast recast the kernel's fp32 GEMM to bf16 in eager only; before the fix this
        test failed on the K=2048 wgrad, 2 of 327680 elements, and other draws differed in
        the K=512 forward.)"""
        from torch_moe._ops import _cpu_probe

        offs = torch.tensor([37, 37, 101, 110], dtype=torch.int32)
        compiled = torch.compile(
            lambda x, w, dy: (grouped_mm(x, w, offs), grouped_mm_wgrad(x, dy, offs)),
            fullgraph=True,
            backend="aot_eager",
            dynamic=False,
        )
        gen = torch.Generator().manual_seed(0)
        for half_gemm, dtype, k in (
            ("fp32", torch.bfloat16, 512),
            ("fp32", torch.bfloat16, 2048),
            ("native", torch.bfloat16, 512),
            ("fp32", torch.float32, 512),
        ):
            with _cpu_probe.force(half_gemm=half_gemm):
                x = torch.randn(113, k, generator=gen).to(dtype)
                w = torch.randn(4, k, 40, generator=gen).to(dtype)
                dy = torch.randn(113, 40, generator=gen).to(dtype)
                ref = (grouped_mm(x, w, offs), grouped_mm_wgrad(x, dy, offs))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    eager = (grouped_mm(x, w, offs), grouped_mm_wgrad(x, dy, offs))
                    torch._dynamo.reset()
                    got = compiled(x, w, dy)
            for a, b, c in zip(ref, eager, got, strict=True):
                msg = f"{half_gemm}, {dtype}, K={k}"
                self.assertEqual(b.dtype, dtype, msg=msg)
                self.assertEqual(b, a, atol=0, rtol=0, msg=msg)
                self.assertEqual(c, a, atol=0, rtol=0, msg=msg)

    def test_bad_offs(self):
        x = torch.randn(10, 4)
        w = torch.randn(3, 4, 5)
        with self.assertRaisesRegex(
            ValueError, r"offs must be non-decreasing .* got offs=\[4, 2, 9\]"
        ):
            grouped_mm(x, w, torch.tensor([4, 2, 9], dtype=torch.int32))
        with self.assertRaisesRegex(ValueError, r"offs\[-1\] <= M \(10\), got offs=\[4, 6, 11\]"):
            grouped_mm(x, w, torch.tensor([4, 6, 11], dtype=torch.int32))
        with self.assertRaisesRegex(ValueError, r"got offs=\[-1, 6, 7\]"):
            grouped_mm(x, w, torch.tensor([-1, 6, 7], dtype=torch.int32))
        with self.assertRaisesRegex(
            ValueError, r"expected offs to be 1D int32, got 1D torch.int64"
        ):
            grouped_mm(x, w, torch.tensor([4, 6, 7]))
        with self.assertRaisesRegex(
            ValueError, r"expected offs to have one entry per group \(3\), got 2"
        ):
            grouped_mm(x, w, torch.tensor([4, 6], dtype=torch.int32))
        with self.assertRaisesRegex(ValueError, r"offs must be non-decreasing"):
            grouped_mm_wgrad(x, torch.randn(10, 2), torch.tensor([4, 2, 9], dtype=torch.int32))
        with self.assertRaisesRegex(
            ValueError, r"^grouped_mm_wgrad: expected offs to be 1D int32, got 1D torch.int64"
        ):
            grouped_mm_wgrad(x, torch.randn(10, 2), torch.tensor([4, 6, 7]))

    def test_bad_operands(self):
        offs = torch.tensor([2, 4], dtype=torch.int32)
        with self.assertRaisesRegex(ValueError, r"x is \[M, K=4\] but w is \[E, K=5, N=3\]"):
            grouped_mm(torch.randn(4, 4), torch.randn(2, 5, 3), offs)
        with self.assertRaisesRegex(
            ValueError, r"share a dtype .* got torch.float32 and torch.bfloat16"
        ):
            grouped_mm(torch.randn(4, 4), torch.randn(2, 4, 3, dtype=torch.bfloat16), offs)
        with self.assertRaisesRegex(ValueError, r"expected x to be 2D \[M, K\], got 3D"):
            grouped_mm(torch.randn(1, 4, 4), torch.randn(2, 4, 3), offs)
        with self.assertRaisesRegex(ValueError, r"expected w to be 3D \[E, K, N\], got 2D"):
            grouped_mm(torch.randn(4, 4), torch.randn(4, 3), offs)
        with self.assertRaisesRegex(ValueError, r"share a dtype .* got torch.int64"):
            grouped_mm(
                torch.ones(4, 4, dtype=torch.int64), torch.ones(2, 4, 3, dtype=torch.int64), offs
            )
        with self.assertRaisesRegex(
            ValueError, r"x \[M, K\] and dy \[M, N\] with the same M, got \[4, 4\] and \[5, 3\]"
        ):
            grouped_mm_wgrad(torch.randn(4, 4), torch.randn(5, 3), offs)


class TestGroupedMMDevice(TestCase):
    """Device-generic (instantiate_device_type_tests): the CUDA dispatch (torch._grouped_mm
    for aligned bf16, Triton otherwise) within the same rounding bounds as the CPU path.
    .ci/gpu runs this class on cuda (PYTORCH_TESTING_DEVICE_ONLY_FOR=cuda)."""

    @onlyCUDA
    @dtypes(torch.bfloat16, torch.float16, torch.float32)
    @parametrize("kn", [(64, 128), (17, 33)])
    def test_forward_backward_within_bound(self, device, dtype, kn):
        k, n = kn
        offs, m = make_offs([40, 0, 130, 7], tail=5)
        x = torch.randn(m, k, dtype=dtype)
        w = torch.randn(4, n, k, dtype=dtype).transpose(-2, -1)
        grad = torch.randn(m, n, dtype=dtype)
        xc, wc = x.to(device).requires_grad_(), w.to(device).requires_grad_()
        out = grouped_mm(xc, wc, offs.to(device))
        out.backward(grad.to(device))
        assert_gemm_close(self, out.cpu(), x, w, offs, "forward")
        assert_gemm_close(self, xc.grad.cpu(), grad, w.transpose(-2, -1), offs, "dX")
        assert_gemm_close(self, wc.grad.cpu(), x, grad, offs, "dW", wgrad=True)
        self.assertTrue((out[int(offs[-1]) :] == 0).all())
        self.assertTrue((xc.grad[int(offs[-1]) :] == 0).all())

    @onlyCUDA
    def test_swiglu_within_bound(self, device):
        from test_grouped_swiglu import assert_swiglu_close, assert_swiglu_grads_close

        from torch_moe.nn.functional import grouped_swiglu

        offs, m = make_offs([64, 0, 128, 16], tail=3)
        x = torch.randn(m, 64, dtype=torch.bfloat16)
        w13 = torch.randn(4, 96, 64, dtype=torch.bfloat16) * 0.1
        w2 = torch.randn(4, 64, 48, dtype=torch.bfloat16) * 0.1
        rw = torch.rand(m)
        grad = torch.randn(m, 64, dtype=torch.bfloat16)
        args = [t.to(device).requires_grad_() for t in (x, w13, w2, rw)]
        y = grouped_swiglu(args[0], args[1], args[2], offs.to(device), args[3])
        y.backward(grad.to(device))
        assert_swiglu_close(self, y.cpu(), x, w13, w2, offs, rw)
        grads = {name: a.grad.cpu() for name, a in zip(("x", "w13", "w2"), args)}
        assert_swiglu_grads_close(self, grads, x, w13, w2, offs, grad, rw)


class TestGroupedMMChecks(TestCase):
    def test_wgrad_rank_and_reference_messages(self):
        from torch_moe._ops import grouped_mm as m

        x, offs = torch.randn(4, 8), torch.tensor([4], dtype=torch.int32)
        with self.assertRaisesRegex(ValueError, r"^grouped_mm_wgrad: expected x \[M, K\] and dy"):
            m._check_wgrad_inputs(x, torch.randn(4, 3, 2), offs)
        with self.assertRaisesRegex(ValueError, r"^grouped_mm: offs must be non-decreasing"):
            grouped_mm_reference(x, torch.randn(1, 8, 3), torch.tensor([5], dtype=torch.int32))

    def test_offs_message_shows_first_and_last_eight(self):
        offs = torch.arange(20, dtype=torch.int32)
        offs[10] = 0  # decreasing
        with self.assertRaisesRegex(
            ValueError,
            r"offs=\[0, 1, 2, 3, 4, 5, 6, 7, '\.\.\.', 12, 13, 14, 15, 16, 17, 18, 19\]$",
        ):
            grouped_mm(torch.randn(20, 4), torch.randn(20, 4, 3), offs)

    def test_nonzero_strides(self):
        from torch_moe._ops.grouped_mm import _nonzero_strides

        t = torch.randn(3, 4)
        self.assertIs(_nonzero_strides(t), t)  # nothing to fix: the same tensor
        for z in (torch.ones(()).expand(3, 4), torch.ones(4).expand(3, 4)):
            fixed = _nonzero_strides(z)
            self.assertTrue(all(s != 0 for s in fixed.stride()), msg=str(fixed.stride()))
            self.assertEqual(fixed, z)

    # device mismatches, with a meta tensor standing in for another device (CPU-only CI)
    def test_device_messages(self):
        from torch_moe._ops import grouped_mm as m

        x, offs = torch.randn(4, 8), torch.tensor([4], dtype=torch.int32)
        with self.assertRaisesRegex(ValueError, r"^grouped_mm: w is on meta but x is on cpu$"):
            m._check_mm_inputs(x, torch.empty(1, 8, 3, device="meta"), offs)
        with self.assertRaisesRegex(
            ValueError, r"^grouped_mm_wgrad: dy is on meta but x is on cpu$"
        ):
            m._check_wgrad_inputs(x, torch.empty(4, 3, device="meta"), offs)


class TestGatherGroupedMM(TestCase):
    """``torch_moe::gather_grouped_mm``: ``grouped_mm`` of the rows it gathers from the
    tokens, bit for bit the permute + grouped_mm composition in the output and both
    gradients (the same ops in the same order), padding and dropped slots included."""

    def _case(self, dtype, align, capacity, transposed, seed=0):
        from torch_moe import ops

        g = torch.Generator().manual_seed(seed)
        T, D, N, E, K = 23, 16, 24, 4, 3
        ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
        perm = ops.permute_indices(ids, E, align=align, capacity=capacity)
        x = torch.randn(T, D, generator=g).to(dtype)
        w = torch.randn(E, N, D, generator=g).to(dtype)
        w = w.transpose(1, 2) if transposed else w.transpose(1, 2).contiguous()
        grad = torch.randn(perm.row_to_slot.shape[0], N, generator=g).to(dtype)
        return perm, x, w, grad

    def _assert_same_as_two_ops(self, perm, x, w, grad, msg=""):
        """gather_grouped_mm and grouped_mm(permute(...)): the same output and gradients."""
        maps = (perm.row_to_slot, perm.slot_to_row)
        results = []
        for fused in (True, False):
            xx, ww = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
            if fused:
                y = torch.ops.torch_moe.gather_grouped_mm(xx, ww, perm.offs, *maps)
            else:
                y = grouped_mm(torch.ops.torch_moe.permute(xx, *maps), ww, perm.offs)
            y.backward(grad)
            results.append((y, xx.grad, ww.grad))
        for got, want in zip(*results, strict=True):
            self.assertEqual(got, want, atol=0, rtol=0, msg=msg)

    def test_equals_permute_then_grouped_mm(self):
        for dtype, align, capacity, transposed in [
            (torch.float32, 1, None, False),
            (torch.bfloat16, 1, None, True),  # x @ w^T views, the gradient in w's layout
            (torch.float32, 8, None, True),  # padding rows (row_to_slot == -1)
            (torch.bfloat16, 1, 4, False),  # dropped slots (slot_to_row == -1)
        ]:
            perm, x, w, grad = self._case(dtype, align, capacity, transposed)
            msg = f"{dtype} align={align} capacity={capacity}"
            self._assert_same_as_two_ops(perm, x, w, grad, msg)

    def test_gemms_read_the_gathered_rows(self):
        # with the threaded kernel (forced) the op's GEMMs read x's rows through the token
        # index (forward, dW in either weight layout) instead of a gathered copy, bit for
        # bit the two ops': the native bf16 GEMM (forced, where it runs) itself, oneDNN's
        # from each piece's rows gathered into scratch; on one thread where
        # torch._grouped_mm's way was decided too (gather_way); on two threads where it
        # was, the op gathers a copy
        from unittest import mock

        from test_cpu_probe import intra_op_threads
        from test_eager import (
            LEAN,
            THREADS,  # every decision the CPU kernels read here, so
        )

        # that a forced profile (CONTRIBUTING) cannot take the threaded kernel away
        from torch_moe._ops import _cpu_probe
        from torch_moe._ops import grouped_mm as gmm

        threaded = {**THREADS, "row_split": "one"}
        one_thread = {**LEAN, "row_split": "one", "gemm_kernel": "aten"}
        for kernel, transposed, align, threads, decisions, reads in [
            ("native", False, 1, 2, threaded, True),
            ("native", True, 8, 2, threaded, True),  # x @ w^T views; padding rows
            ("aten", False, 1, 2, threaded, True),
            ("aten", True, 8, 1, one_thread, True),
            ("aten", False, 1, 2, LEAN, False),  # threads_mm: torch._grouped_mm's way
        ]:
            perm, x, w, grad = self._case(torch.bfloat16, align, None, transposed, seed=7)
            spy = mock.patch.object(gmm, "gathered_grouped_mm", wraps=gmm.gathered_grouped_mm)
            spy_w = mock.patch.object(
                gmm, "gathered_grouped_mm_wgrad", wraps=gmm.gathered_grouped_mm_wgrad
            )
            with (
                self.subTest(kernel=kernel, transposed=transposed, threads=threads),
                _cpu_probe.force(**{**decisions, "gemm_kernel": kernel}),
                intra_op_threads(threads),
                spy as fwd,
                spy_w as wgrad,
            ):
                self._assert_same_as_two_ops(perm, x, w, grad)
                reads = reads and gmm._threaded_kernels() is not None  # (the kernels built)
                self.assertEqual((fwd.call_count, wgrad.call_count), (int(reads), int(reads)))

    def test_no_tokens_only_padding_rows(self):
        # no tokens routed with align > 1: every group empty, yet the permuted buffer has
        # its padding rows (row_to_slot == -1); the weight gradient through the token
        # index divided the rows by the busy groups (none: ZeroDivisionError) before
        from test_eager import THREADS

        from torch_moe import ops
        from torch_moe._ops import _cpu_probe

        g = torch.Generator().manual_seed(3)
        perm = ops.permute_indices(torch.zeros(0, 2, dtype=torch.int64), 4, align=2)
        self.assertEqual((perm.row_to_slot.shape[0], perm.offs.tolist()), (4, [0, 0, 0, 0]))
        for dtype, transposed, decisions in itertools.product(
            (torch.bfloat16, torch.float16, torch.float32),
            (False, True),
            ({}, {**THREADS, "row_split": "one"}),
        ):
            x = torch.randn(0, 16, generator=g).to(dtype)
            w = torch.randn(4, 8, 16, generator=g).to(dtype).transpose(1, 2)
            w = w if transposed else w.contiguous()
            grad = torch.randn(4, 8, generator=g).to(dtype)
            with self.subTest(dtype=str(dtype), transposed=transposed, forced=bool(decisions)):
                with _cpu_probe.force(**decisions):
                    self._assert_same_as_two_ops(perm, x, w, grad)
                ww = w.detach().clone().requires_grad_()
                torch.ops.torch_moe.gather_grouped_mm(
                    x, ww, perm.offs, perm.row_to_slot, perm.slot_to_row
                ).backward(grad)
                self.assertTrue((ww.grad == 0).all())

    def test_saves_tokens_not_rows(self):
        perm, x, w, _ = self._case(torch.float32, 1, None, False)
        xx = x.clone().requires_grad_()
        saved = []

        def pack(t):
            saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.ops.torch_moe.gather_grouped_mm(
                xx, w.requires_grad_(), perm.offs, perm.row_to_slot, perm.slot_to_row
            )
        self.assertIn(tuple(x.shape), saved)
        self.assertNotIn((perm.row_to_slot.shape[0], x.shape[1]), saved)

    def test_opcheck_and_messages(self):
        perm, x, w, _ = self._case(torch.float32, 8, None, False)
        maps = (perm.row_to_slot, perm.slot_to_row)
        torch.library.opcheck(
            torch.ops.torch_moe.gather_grouped_mm.default,
            (x.requires_grad_(), w.requires_grad_(), perm.offs, *maps),
        )
        op = torch.ops.torch_moe.gather_grouped_mm
        for maps, message in [
            (
                (perm.row_to_slot.int(), perm.slot_to_row),
                r"expected row_to_slot to be a 1D int64 tensor, got 1D torch.int32$",
            ),
            (
                (perm.row_to_slot, perm.slot_to_row.int()),
                r"expected slot_to_row to be a 2D int64 tensor \[T, K\], got 2D torch.int32$",
            ),
            ((perm.row_to_slot, perm.slot_to_row[:22]), r"expected x to have 22 rows, got 23$"),
        ]:
            with self.assertRaisesRegex(ValueError, r"^gather_grouped_mm: " + message):
                op(x, w, perm.offs, *maps)

    def test_gradient_of_x_alone(self):
        # x needs a gradient, the weights do not (frozen experts): dX is still computed
        perm, x, w, grad = self._case(torch.float32, 1, None, False)
        maps = (perm.row_to_slot, perm.slot_to_row)
        got, want = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.ops.torch_moe.gather_grouped_mm(got, w, perm.offs, *maps).backward(grad)
        grouped_mm(torch.ops.torch_moe.permute(want, *maps), w, perm.offs).backward(grad)
        self.assertEqual(got.grad, want.grad, atol=0, rtol=0)


instantiate_parametrized_tests(TestGroupedMM)
instantiate_device_type_tests(TestGroupedMMDevice, globals())

if __name__ == "__main__":
    run_tests()
