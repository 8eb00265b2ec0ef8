# Owner(s): ["module: moe"]
"""Tests for torch_moe.nn.functional.grouped_swiglu against a naive per-token loop."""

import unittest.mock

import naive
import tolerances
import torch
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe
from torch_moe import ops
from torch_moe._ops import _cpu_probe, _native
from torch_moe._ops.grouped_swiglu import swiglu_reference
from torch_moe.nn.functional import grouped_swiglu


def assert_swiglu_close(test, y, x, w13, w2, offs, row_weights=None):
    """``y`` within the elementwise rounding bound of grouped SwiGLU in its dtype
    (tolerances.swiglu_bound, row by row against the float64 oracle), and for half
    precision also at the rounding level of an emulation that rounds h, a and y to the
    dtype (naive.swiglu_rounded): a 1% scale error or a shifted row fails either."""
    dtype = y.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    exact = torch.zeros(y.shape, dtype=torch.float64)
    bound = torch.zeros(y.shape, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        rw = None if row_weights is None else row_weights.detach()[start:end]
        exact[start:end], bound[start:end] = tolerances.swiglu_bound(
            x.detach()[start:end], w13.detach()[e], w2.detach()[e], dtype, acc, rw
        )
        start = end
    bound[start:] = 0
    tolerances.assert_within(test, y, exact, bound, f"grouped_swiglu {dtype}")
    if dtype in (torch.bfloat16, torch.float16):
        rw = None if row_weights is None else row_weights.detach()
        emulated = naive.swiglu_rounded(
            x.detach(), w13.detach(), w2.detach(), offs, dtype, row_weights=rw
        )["y"]
        tolerances.assert_rounding_level(test, y, exact, emulated, msg=f"grouped_swiglu {dtype}")


def assert_swiglu_grads_close(test, grads, x, w13, w2, offs, grad_y, row_weights=None):
    """Gradients ``{"x", "w13", "w2"[, "row_weights"]}`` at the rounding level of the
    emulated backward (naive.swiglu_rounded) in their dtype, against its float64 twin."""
    args = (x.detach(), w13.detach(), w2.detach(), offs)
    rw = None if row_weights is None else row_weights.detach()
    exact = naive.swiglu_rounded(*args, torch.float64, grad_y, None if rw is None else rw.double())
    emulated = naive.swiglu_rounded(*args, x.dtype, grad_y, rw)
    for name, got in grads.items():
        tolerances.assert_rounding_level(test, got, exact[name], emulated[name], msg=name)


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


def _both_forms(x, w13, w2, rw, perm, path, grads):
    """[(y, h, dx, dw13, dw2, drw)] of grouped_swiglu on ``permute(x)`` (converted to the
    weights' dtype), then in its permutation form, on the forced CPU ``path``; ``grads``:
    the incoming gradients of (y,) or (y, h)."""
    op = torch.ops.torch_moe.grouped_swiglu
    maps = (perm.row_to_slot, perm.slot_to_row)
    results = []
    for fused in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, w13, w2, rw)]
        xl, w13l, w2l, rwl = leaves
        with _cpu_probe.force(swiglu_path=path):
            if fused:
                y, h = op(xl, w13l, w2l, perm.offs, rwl, None, *maps)
            else:
                rows = torch.ops.torch_moe.permute(xl, *maps).to(w13.dtype)
                y, h = op(rows, w13l, w2l, perm.offs, rwl)
            torch.autograd.backward((y, h)[: len(grads)], grads)
        results.append((y, h, *(t.grad for t in leaves)))
    return results


class TestGroupedSwiGLU(TestCase):
    @parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
    @parametrize("sizes", [[4, 0, 6, 1], [0, 0, 9], [5], [0, 0]])
    @parametrize("dim_hidden", [(8, 6), (7, 5)])
    def test_matches_naive(self, dtype, sizes, dim_hidden):
        dim, hidden = dim_hidden
        x, w13, w2, offs = _inputs(sizes, dim, hidden, dtype, tail=2)
        y = grouped_swiglu(x, w13, w2, offs)
        self.assertEqual(y.dtype, dtype)
        assert_swiglu_close(self, y, x, w13, w2, offs)
        self.assertTrue((y[int(offs[-1]) :] == 0).all())

    @parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_backward_matches_float64_autograd(self, dtype):
        x, w13, w2, offs = _inputs([3, 0, 5, 2], 9, 5, dtype, tail=3)
        y = grouped_swiglu(x, w13, w2, offs)
        grad = torch.randn_like(y)
        y.backward(grad)
        grads = {"x": x.grad, "w13": w13.grad, "w2": w2.grad}
        assert_swiglu_grads_close(self, grads, x, w13, w2, offs, grad)
        self.assertTrue((x.grad[10:] == 0).all())

    @parametrize("dtype", [torch.float64, torch.float32])
    def test_reference_matches_naive(self, dtype):
        # swiglu_reference is the oracle other tests compare kernels with: itself against
        # the per-token float64 loop, with and without row weights, rows past offs[-1] zero
        x, w13, w2, offs = _inputs([4, 0, 6, 1], 8, 6, dtype, tail=2)
        rw = torch.rand(x.shape[0], dtype=dtype)
        for row_weights in (None, rw):
            y = swiglu_reference(x.detach(), w13.detach(), w2.detach(), offs, row_weights)
            self.assertEqual(y.dtype, dtype)
            assert_swiglu_close(self, y, x, w13, w2, offs, row_weights)
            self.assertTrue((y[int(offs[-1]) :] == 0).all())

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
        ones = torch.ones(x.shape, dtype=torch.float32)
        assert_swiglu_grads_close(self, {"x": x.grad}, x, w13, w2, offs, ones)

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
        grad = torch.randn_like(y)
        y.backward(grad)
        assert_swiglu_close(self, y, x, w13, w2, offs, rw)
        self.assertEqual(rw.grad.dtype, torch.float32)
        grads = {"x": x.grad, "w13": w13.grad, "w2": w2.grad}
        assert_swiglu_grads_close(self, grads, x, w13, w2, offs, grad, rw)
        # the row weights' gradient is fp32: the emulation rounds it to fp32 from bf16 dA
        exact = naive.swiglu_rounded(
            x.detach(), w13.detach(), w2.detach(), offs, torch.float64, grad, rw.detach().double()
        )["row_weights"]
        emulated = naive.swiglu_rounded(
            x.detach(), w13.detach(), w2.detach(), offs, torch.bfloat16, grad, rw.detach()
        )["row_weights"]
        tolerances.assert_rounding_level(
            self, rw.grad, exact, emulated, tolerances.ROUNDING_MULTIPLE[torch.bfloat16]
        )

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
            ValueError, r"expected x \[M, D\], w13 \[E, 2F, D\], w2 \[E, D, F\], got 3D, 3D, 3D"
        ):
            grouped_swiglu(x.detach().unsqueeze(0), w13, w2, offs)
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


class TestGroupedSwiGLUChecks(TestCase):
    def test_whole_and_loop_paths_with_grad_h(self):
        # fp32 (native on every CPU): both CPU paths, a gradient into h too, agree closely
        g = torch.Generator().manual_seed(0)
        offs = torch.tensor([5, 5, 17, 30], dtype=torch.int32)  # an empty group, 2 tail rows
        x = torch.randn(32, 16, generator=g)
        w13 = torch.randn(4, 12, 16, generator=g) * 0.3
        w2 = torch.randn(4, 16, 6, generator=g) * 0.3
        rw = torch.rand(32, generator=g)
        grad_y, grad_h = torch.randn(32, 16, generator=g), torch.randn(32, 12, generator=g)
        op, bwd = torch.ops.torch_moe.grouped_swiglu, torch.ops.torch_moe.grouped_swiglu_backward
        got = {}
        for path in ("loop", "whole"):
            with _cpu_probe.force(swiglu_path=path):
                y, h = op(x, w13, w2, offs, rw)
                got[path] = (y, h, *bwd(grad_y, grad_h, x, h, w13, w2, offs, rw))
        for a, b in zip(got["loop"], got["whole"], strict=True):
            self.assertEqual(a, b, atol=1e-5, rtol=1e-5)
        # and grad_h reaches dX as dH does: dX(grad_h) - dX(None) = grad_h @ W13 per group
        with _cpu_probe.force(swiglu_path="whole"):
            dx0 = bwd(grad_y, None, x, got["whole"][1], w13, w2, offs, rw)[0]
        extra = torch.cat([grad_h[0:5] @ w13[0], grad_h[5:17] @ w13[2], grad_h[17:30] @ w13[3]])
        self.assertEqual(got["whole"][2][:30] - dx0[:30], extra, atol=1e-4, rtol=1e-4)

    def test_grad_row_weights_dtype(self):
        bf16 = torch.bfloat16
        x, w13, w2 = torch.randn(4, 8), torch.randn(2, 6, 8), torch.randn(2, 8, 3)
        offs, grad_y = torch.tensor([2, 4], dtype=torch.int32), torch.randn(4, 8)
        op, bwd = torch.ops.torch_moe.grouped_swiglu, torch.ops.torch_moe.grouped_swiglu_backward
        # no row weights: an empty fp32 tensor, whatever the input dtype
        args = (x.to(bf16), w13.to(bf16), w2.to(bf16))
        _, h16 = op(*args, offs, None)
        drw = bwd(grad_y.to(bf16), None, args[0], h16, *args[1:], offs, None)[3]
        self.assertEqual((drw.shape, drw.dtype), (torch.Size([0]), torch.float32))
        _, h = op(x, w13, w2, offs, None)
        drw = bwd(grad_y, None, x, h, w13, w2, offs, None)[3]
        self.assertEqual((drw.shape, drw.dtype), (torch.Size([0]), torch.float32))
        rw = torch.rand(4).to(torch.bfloat16)
        _, h = op(x, w13, w2, offs, rw)
        self.assertEqual(bwd(grad_y, None, x, h, w13, w2, offs, rw)[3].dtype, torch.bfloat16)

    def test_autograd_with_gather_index(self):
        tokens = torch.randn(6, 8)
        index = torch.tensor([0, 3, 5, 1, 1, 2])
        w13 = torch.randn(2, 6, 8, requires_grad=True)
        w2 = torch.randn(2, 8, 3, requires_grad=True)
        offs = torch.tensor([2, 6], dtype=torch.int32)
        op = torch.ops.torch_moe.grouped_swiglu
        y, _ = op(tokens, w13, w2, offs, None, index)
        y.sum().backward()
        grads = (w13.grad.clone(), w2.grad.clone())
        w13.grad = w2.grad = None
        y_ref, _ = op(tokens[index], w13, w2, offs, None)
        y_ref.sum().backward()
        self.assertEqual(y, y_ref, atol=0, rtol=0)
        self.assertEqual(grads, (w13.grad, w2.grad), atol=1e-6, rtol=1e-6)
        x = tokens.clone().requires_grad_()
        y, _ = op(x, w13, w2, offs, None, index)
        with self.assertRaisesRegex(
            NotImplementedError,
            r"^grouped_swiglu: autograd through x with gather_index is not supported \(a "
            r"token's row gradients are summed in the permutation's k order\); pass "
            r"row_to_slot and slot_to_row instead$",
        ):
            y.sum().backward()
        # without x's gradient the gather_index form takes tokens in another dtype too
        # (the inference path): the rows converted as gathered
        w13_16, w2_16 = w13.detach().bfloat16(), w2.detach().bfloat16()
        got = op(tokens, w13_16, w2_16, offs, None, index)
        want = op(tokens[index].bfloat16(), w13_16, w2_16, offs)
        self.assertEqual(got, want, atol=0, rtol=0)

    @parametrize("dtype", [torch.float32, torch.bfloat16])
    @parametrize("path", ["loop", "whole"])
    @parametrize(
        "case",
        ["dropless", "aligned", "capacity", "top1", "no_tokens", "idle_expert"],
    )
    def test_permutation_form_equals_permute_first(self, dtype, path, case):
        """grouped_swiglu(x, ..., row_to_slot=, slot_to_row=) == grouped_swiglu(permute(x))
        bit for bit: y, h and the gradients of x (the permute's backward: each token's row
        gradients summed in k order), w13, w2 and the routing weights, on both CPU paths,
        with padding rows (align), dropped slots (capacity), K = 1, T = 0, an idle expert.
        (fp32's loop path: within fp32 rounding, ATen's fp32 GEMM can round a row by its
        address, and its gathered rows lie elsewhere than the permuted ones.)"""
        g = torch.Generator().manual_seed(7)
        T, D, F, E, K = {"top1": (11, 8, 6, 3, 1), "no_tokens": (0, 8, 6, 3, 2)}.get(
            case, (13, 8, 6, 4, 3)
        )
        kw = {"aligned": dict(align=4), "capacity": dict(capacity=5)}.get(case, {})
        ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
        if case == "idle_expert":  # expert E-1 gets no rows
            ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
        perm = ops.permute_indices(ids, E, **kw)
        M = perm.row_to_slot.shape[0]
        x = torch.randn(T, D, generator=g).to(dtype)
        w13 = (torch.randn(E, 2 * F, D, generator=g) * 0.5).to(dtype)
        w2 = (torch.randn(E, D, F, generator=g) * 0.5).to(dtype)
        rw = torch.rand(M, generator=g)
        gy = torch.randn(M, D, generator=g).to(dtype)
        gh = torch.randn(M, 2 * F, generator=g).to(dtype)
        results = _both_forms(x, w13, w2, rw, perm, path, (gy, gh))
        names = ("y", "h", "dx", "dw13", "dw2", "drw")
        exact = dict(atol=0, rtol=0) if dtype != torch.float32 or path == "whole" else {}
        for name, a, b in zip(names, *results, strict=True):
            self.assertEqual(b, a, msg=name, **exact)
        self.assertEqual(results[1][2].shape, (T, D))
        if case == "idle_expert":
            self.assertTrue((results[1][3][E - 1] == 0).all())

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_permutation_form_reads_the_gathered_rows(self):
        """The op's whole path (the profiler's, autocast's, a compiled graph's) reads the
        tokens' rows of h's GEMM and of dW13 through the token index where the threaded
        kernel runs them (on one thread where torch._grouped_mm's way was decided, on two
        where threads_mm chose the kernel; oneDNN's pieces and, where it runs, the native
        GEMM), gathering no [M, D] copy: bit for bit the op on permute(x); with the
        kernel's way not taken (two threads, threads_mm aten) it gathers copies."""
        from test_cpu_probe import intra_op_threads
        from test_eager import LEAN, THREADS

        import torch_moe._ops.grouped_swiglu as gs

        g = torch.Generator().manual_seed(13)
        T, D, F, E, K = 48, 32, 24, 4, 2  # 24 rows per expert: past FEW_ROWS
        perm = ops.permute_indices(torch.rand(T, E, generator=g).argsort(1)[:, :K], E, align=4)
        M = perm.row_to_slot.shape[0]
        bf16 = torch.bfloat16
        x = torch.randn(T, D, generator=g).to(bf16)
        w13 = (torch.randn(E, 2 * F, D, generator=g) * 0.5).to(bf16)
        w2 = (torch.randn(E, D, F, generator=g) * 0.5).to(bf16)
        rw = torch.rand(M, generator=g)
        gy = torch.randn(M, D, generator=g).to(bf16)
        one = {**LEAN, "row_split": "one", "gemm_kernel": "aten"}
        runs = [
            (1, one, True),
            (1, {**one, "gemm_kernel": "native", "wgrad_a": "transpose"}, True),
            (2, {**THREADS, "row_split": "one", "gemm_kernel": "aten"}, True),
            (2, {**LEAN, "gemm_kernel": "aten"}, False),
        ]
        for threads, decisions, reads in runs:
            spy = unittest.mock.patch.object(
                gs, "gathered_grouped_mm", wraps=gs.gathered_grouped_mm
            )
            spy_w = unittest.mock.patch.object(
                gs, "gathered_grouped_mm_wgrad", wraps=gs.gathered_grouped_mm_wgrad
            )
            with (
                self.subTest(threads=threads, decisions=decisions),
                intra_op_threads(threads),
                _cpu_probe.force(decisions),
                spy as fwd,
                spy_w as wgrad,
            ):
                results = _both_forms(x, w13, w2, rw, perm, "whole", (gy,))
                self.assertEqual((fwd.call_count, wgrad.call_count), (int(reads), int(reads)))
            for name, a, b in zip(("y", "h", "dx", "dw13", "dw2", "drw"), *results, strict=True):
                self.assertEqual(b, a, atol=0, rtol=0, msg=name)

    @parametrize("path", ["loop", "whole"])
    @parametrize("case", ["dropless", "aligned", "capacity"])
    def test_permutation_form_converts_the_rows(self, path, case):
        """fp32 tokens, bf16 weights (the layer under bf16 autocast): bit for bit
        grouped_swiglu(permute(x).to(bf16)), x's gradient in fp32 (the cast's backward,
        then the permute's: the K rows' gradients summed in fp32, not rounded to bf16)."""
        g = torch.Generator().manual_seed(11)
        T, D, F, E, K = 9, 16, 8, 4, 3
        kw = {"aligned": dict(align=4), "capacity": dict(capacity=4)}.get(case, {})
        perm = ops.permute_indices(torch.rand(T, E, generator=g).argsort(1)[:, :K], E, **kw)
        M = perm.row_to_slot.shape[0]
        bf16 = torch.bfloat16
        x = torch.randn(T, D, generator=g)
        w13 = (torch.randn(E, 2 * F, D, generator=g) * 0.5).to(bf16)
        w2 = (torch.randn(E, D, F, generator=g) * 0.5).to(bf16)
        rw = torch.rand(M, generator=g)
        gy = torch.randn(M, D, generator=g).to(bf16)
        results = _both_forms(x, w13, w2, rw, perm, path, (gy,))
        op = torch.ops.torch_moe.grouped_swiglu
        maps = (perm.row_to_slot, perm.slot_to_row)
        for name, a, b in zip(("y", "h", "dx", "dw13", "dw2", "drw"), *results, strict=True):
            self.assertEqual(b, a, atol=0, rtol=0, msg=name)
            self.assertEqual(b.dtype, a.dtype, msg=name)
        self.assertEqual((results[1][0].dtype, results[1][2].dtype), (bf16, torch.float32))
        # the weights still share one dtype, and x's may differ only where the op gathers
        with self.assertRaisesRegex(
            ValueError, r"got torch.float32, torch.bfloat16, torch.float32$"
        ):
            op(x, w13, w2.float(), perm.offs, None, None, *maps)
        with self.assertRaisesRegex(
            ValueError, r"got torch.float32, torch.bfloat16, torch.bfloat16$"
        ):
            op(x[:1].expand(M, D), w13, w2, perm.offs)
        with self.assertRaisesRegex(
            ValueError, r"got torch.int32, torch.bfloat16, torch.bfloat16$"
        ):
            op(x.int(), w13, w2, perm.offs, None, None, *maps)

    def test_autograd_through_both_outputs(self):
        """The op's autograd against plain PyTorch ops (float64): a loss on y and h, and
        one on h alone (y unused: its gradient arrives as None), in both forms."""
        g = torch.Generator().manual_seed(3)
        T, D, F, E, K = 7, 6, 4, 3, 2
        perm = ops.permute_indices(torch.rand(T, E, generator=g).argsort(1)[:, :K], E)
        M = perm.row_to_slot.shape[0]
        f64 = torch.float64
        x, rw = torch.randn(T, D, generator=g, dtype=f64), torch.rand(M, generator=g)
        w13 = torch.randn(E, 2 * F, D, generator=g, dtype=f64)
        w2 = torch.randn(E, D, F, generator=g, dtype=f64)
        gy = torch.randn(M, D, generator=g, dtype=f64)
        gh = torch.randn(M, 2 * F, generator=g, dtype=f64)
        maps = (perm.row_to_slot, perm.slot_to_row)
        op = torch.ops.torch_moe.grouped_swiglu

        def reference(x, w13, w2, rw):
            rows = x[perm.row_to_slot // K]
            hs, ys, start = [], [], 0
            for e, end in enumerate(perm.offs.tolist()):
                h_e = rows[start:end] @ w13[e].t()
                gate, up = h_e.chunk(2, dim=-1)
                a_e = torch.nn.functional.silu(gate) * up * rw[start:end, None].to(f64)
                hs.append(h_e)
                ys.append(a_e @ w2[e].t())
                start = end
            return torch.cat(ys), torch.cat(hs)

        for fused in (False, True):
            for on_y in (True, False):
                grads = []
                for fn in ("op", "reference"):
                    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, rw)]
                    if fn == "reference":
                        y, h = reference(*leaves)
                    elif fused:
                        y, h = op(leaves[0], *leaves[1:3], perm.offs, leaves[3], None, *maps)
                    else:
                        rows = torch.ops.torch_moe.permute(leaves[0], *maps)
                        y, h = op(rows, *leaves[1:3], perm.offs, leaves[3])
                    loss = (h * gh).sum() + ((y * gy).sum() if on_y else 0)
                    grads.append(torch.autograd.grad(loss, leaves, allow_unused=True))
                for name, got, want in zip(("x", "w13", "w2", "rw"), *grads, strict=True):
                    msg = f"{name}, fused={fused}, loss on y={on_y}"
                    if want is None:  # no loss on y: nothing reaches w2 and rw
                        self.assertTrue(got is None or not got.any(), msg=msg)
                    else:
                        self.assertEqual(got, want, atol=1e-10, rtol=1e-10, msg=msg)

    def test_permutation_form_saves_no_rows(self):
        # x [T, D] itself (not a gathered [M, D]) and h [M, 2F] are the saved activations
        x = torch.randn(5, 8, requires_grad=True)
        w13, w2 = torch.randn(3, 12, 8), torch.randn(3, 8, 6)
        perm = ops.permute_indices(torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]]), 3)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = grouped_swiglu(
                x, w13, w2, perm.offs, row_to_slot=perm.row_to_slot, slot_to_row=perm.slot_to_row
            )
        shapes = sorted(tuple(t.shape) for t in saved if t.is_floating_point())
        self.assertEqual(shapes, [(3, 8, 6), (3, 12, 8), (5, 8), (10, 12)])  # w2, w13, x, h
        self.assertTrue(any(t is x for t in saved))
        y.sum().backward()
        self.assertEqual(x.grad.shape, (5, 8))

    def test_permutation_form_opcheck(self):
        x, w13, w2 = torch.randn(6, 8), torch.randn(3, 12, 8), torch.randn(3, 8, 6)
        ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0], [1, 2]])
        perm = ops.permute_indices(ids, 3, capacity=3)  # dropped slots: -1 in both maps
        rw = torch.rand(perm.row_to_slot.shape[0])
        for t in (x, w13, w2, rw):
            t.requires_grad_()
        torch.library.opcheck(
            torch.ops.torch_moe.grouped_swiglu.default,
            (x, w13, w2, perm.offs, rw, None, perm.row_to_slot, perm.slot_to_row),
        )

    def test_permutation_form_messages(self):
        x, w13, w2 = torch.randn(4, 8), torch.randn(1, 6, 8), torch.randn(1, 8, 3)
        offs = torch.tensor([4], dtype=torch.int32)
        rts = torch.arange(4)
        s2r = torch.arange(4).unsqueeze(1)
        op = torch.ops.torch_moe.grouped_swiglu
        cases = [
            ((rts, rts, s2r), r"pass gather_index or row_to_slot and slot_to_row, not both$"),
            ((None, rts, None), r"row_to_slot and slot_to_row go together; slot_to_row is None$"),
            ((None, None, s2r), r"row_to_slot and slot_to_row go together; row_to_slot is None$"),
            (
                (None, rts.int(), s2r),
                r"expected row_to_slot to be a 1D int64 tensor \[M\], got "
                r"1D torch.int32$",
            ),
            (
                (None, rts, s2r[:3]),
                r"expected slot_to_row to be a 2D int64 tensor \[T=4, K>=1\] "
                r"\(x's tokens\), got \[3, 1\] torch.int64$",
            ),
            ((None, rts, s2r[:, :0]), r"expected slot_to_row .*, got \[4, 0\] torch.int64$"),
            ((None, rts, s2r.int()), r"expected slot_to_row .*, got \[4, 1\] torch.int32$"),
            ((None, rts, s2r[:, 0]), r"expected slot_to_row .*, got \[4\] torch.int64$"),
            ((None, rts.to("meta"), s2r), r"row_to_slot is on meta but x is on cpu$"),
            ((None, rts, s2r.to("meta")), r"slot_to_row is on meta but x is on cpu$"),
        ]
        for (gi, r, s), msg in cases:
            with self.assertRaisesRegex(ValueError, r"^grouped_swiglu: " + msg):
                op(x, w13, w2, offs, None, gi, r, s)

    def test_gather_index_messages(self):
        x, w13, w2 = torch.randn(4, 8), torch.randn(1, 6, 8), torch.randn(1, 8, 3)
        offs = torch.tensor([4], dtype=torch.int32)
        for bad in (torch.zeros(2, 2, dtype=torch.int64), torch.zeros(4, dtype=torch.int32)):
            with self.assertRaisesRegex(
                ValueError, r"^grouped_swiglu: expected gather_index to be a 1D int64 tensor"
            ):
                torch.ops.torch_moe.grouped_swiglu(x, w13, w2, offs, None, bad)
        with self.assertRaisesRegex(
            ValueError, r"^grouped_swiglu: gather_index is on meta but x is on cpu$"
        ):
            torch.ops.torch_moe.grouped_swiglu(
                x, w13, w2, offs, None, torch.zeros(4, dtype=torch.int64, device="meta")
            )

    @parametrize("dtype", [torch.float32, torch.bfloat16])
    @parametrize("path", ["loop", "whole"])
    @parametrize("case", ["dropless", "aligned", "capacity", "zero_stride"])
    def test_backward_grad_index_equals_permuted_grad(self, dtype, path, case):
        """grouped_swiglu_backward(g, ..., grad_index=row_to_slot // K) ==
        grouped_swiglu_backward(permute(g), ...) bit for bit (dX, dW13, dW2, d row_weights)
        on both CPU paths: padding rows (align: index -1, zero rows), dropped slots
        (capacity), a zero-stride tokens' gradient (``sum().backward()``); with grad_h and
        the permutation form's gather_index too."""
        g = torch.Generator().manual_seed(17)
        T, D, F, E, K = 13, 8, 6, 4, 3
        kw = {"aligned": dict(align=4), "capacity": dict(capacity=5)}.get(case, {})
        perm = ops.permute_indices(torch.rand(T, E, generator=g).argsort(1)[:, :K], E, **kw)
        M = perm.row_to_slot.shape[0]
        tokens = torch.div(perm.row_to_slot, K, rounding_mode="floor")  # -1 stays -1
        x = torch.randn(T, D, generator=g).to(dtype)
        w13 = (torch.randn(E, 2 * F, D, generator=g) * 0.5).to(dtype)
        w2 = (torch.randn(E, D, F, generator=g) * 0.5).to(dtype)
        rw = torch.rand(M, generator=g)
        h = torch.ops.torch_moe.grouped_swiglu(x, w13, w2, perm.offs, rw, tokens)[1]
        gt = torch.randn(T, D, generator=g).to(dtype)
        if case == "zero_stride":
            gt = gt[:1].expand(T, D)
        gh = torch.randn(M, 2 * F, generator=g).to(dtype)
        op = torch.ops.torch_moe.grouped_swiglu_backward
        maps = (perm.row_to_slot, perm.slot_to_row)
        for grad_h in (None, gh):
            with self.subTest(grad_h=grad_h is not None), _cpu_probe.force(swiglu_path=path):
                want = op(
                    torch.ops.torch_moe.permute(gt, *maps),
                    grad_h,
                    x,
                    h,
                    w13,
                    w2,
                    perm.offs,
                    rw,
                    tokens,
                )
                got = op(gt, grad_h, x, h, w13, w2, perm.offs, rw, tokens, tokens)
            for name, a, b in zip(("dx", "dw13", "dw2", "drw"), want, got, strict=True):
                self.assertEqual(b, a, atol=0, rtol=0, msg=name)

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_backward_grad_index_read_in_place(self):
        """Where the threaded kernel runs dA and dW2 (test_permutation_form_reads_the_
        gathered_rows' decisions), the op's whole path reads the tokens' gradient through
        grad_index (no [M, D] copy): bit for bit the op on the gathered gradient."""
        from test_cpu_probe import intra_op_threads
        from test_eager import LEAN

        import torch_moe._ops.grouped_swiglu as gs

        g = torch.Generator().manual_seed(19)
        T, D, F, E, K = 48, 32, 24, 4, 2
        perm = ops.permute_indices(torch.rand(T, E, generator=g).argsort(1)[:, :K], E, align=4)
        tokens = torch.div(perm.row_to_slot, K, rounding_mode="floor")
        M, bf16 = tokens.shape[0], torch.bfloat16
        x = torch.randn(T, D, generator=g).to(bf16)
        w13 = (torch.randn(E, 2 * F, D, generator=g) * 0.5).to(bf16)
        w2 = (torch.randn(E, D, F, generator=g) * 0.5).to(bf16)
        rw = torch.rand(M, generator=g)
        gt = torch.randn(T, D, generator=g).to(bf16)
        op = torch.ops.torch_moe.grouped_swiglu_backward
        for kernel in ("aten", "native"):
            decisions = {**LEAN, "row_split": "one", "gemm_kernel": kernel}
            spy = unittest.mock.patch.object(
                gs, "gathered_grouped_mm", wraps=gs.gathered_grouped_mm
            )
            spy_w = unittest.mock.patch.object(
                gs, "gathered_grouped_mm_wgrad", wraps=gs.gathered_grouped_mm_wgrad
            )
            with self.subTest(kernel=kernel), intra_op_threads(1), _cpu_probe.force(decisions):
                h = torch.ops.torch_moe.grouped_swiglu(x, w13, w2, perm.offs, rw, tokens)[1]
                gathered = torch.ops.torch_moe.permute(gt, perm.row_to_slot, perm.slot_to_row)
                want = op(gathered, None, x, h, w13, w2, perm.offs, rw, tokens)
                with spy as mm, spy_w as wgrad:
                    got = op(gt, None, x, h, w13, w2, perm.offs, rw, tokens, tokens)
                # dA and dW2 read the gradient's rows, dW13 x's rows: all through an index
                self.assertEqual((mm.call_count, wgrad.call_count), (1, 2))
                for name, a, b in zip(("dx", "dw13", "dw2", "drw"), want, got, strict=True):
                    self.assertEqual(b, a, atol=0, rtol=0, msg=name)

    def test_backward_grad_index_messages_and_opcheck(self):
        g = torch.Generator().manual_seed(23)
        x, w13, w2 = torch.randn(4, 8, generator=g), torch.randn(2, 6, 8), torch.randn(2, 8, 3)
        offs = torch.tensor([3, 6], dtype=torch.int32)
        index = torch.tensor([0, 1, 2, 3, -1, 1])
        xr = x[index.clamp(min=0)]
        h = torch.ops.torch_moe.grouped_swiglu(xr, w13, w2, offs)[1]
        op = torch.ops.torch_moe.grouped_swiglu_backward
        gt = torch.randn(4, 8, generator=g)
        for bad, msg in (
            (
                index[:5],
                r"grad_index to be a 1D int64 tensor \[M=6\] on cpu, got 1D torch.int64 \[5\]",
            ),
            (index.int(), r"grad_index .*, got 1D torch.int32 \[6\] on cpu$"),
            (index.to("meta"), r"grad_index .*, got 1D torch.int64 \[6\] on meta$"),
        ):
            with self.assertRaisesRegex(ValueError, r"^grouped_swiglu_backward: expected " + msg):
                op(gt, None, xr, h, w13, w2, offs, None, None, bad)
        with self.assertRaisesRegex(
            ValueError,
            r"^grouped_swiglu_backward: expected grad_y to be 2D \[\*, D=8\], got \[4, 7\]$",
        ):
            op(gt[:, :7], None, xr, h, w13, w2, offs, None, None, index)
        torch.library.opcheck(op.default, (gt, None, xr, h, w13, w2, offs, None, None, index))

    def test_reference_offs_message(self):
        x, w13, w2 = torch.randn(4, 8), torch.randn(1, 6, 8), torch.randn(1, 8, 3)
        with self.assertRaisesRegex(ValueError, r"^grouped_swiglu: "):
            swiglu_reference(x, w13, w2, torch.tensor([5], dtype=torch.int32))

    def test_swiglu_op_keeps_the_dtype(self):
        h = torch.randn(8, 16).to(torch.bfloat16)
        out = torch.ops.torch_moe.swiglu(h, None)
        self.assertEqual(out.dtype, torch.bfloat16)
        gate, up = h.float().chunk(2, dim=-1)
        self.assertEqual(out, (torch.nn.functional.silu(gate) * up).to(torch.bfloat16))

    @parametrize("weights", [False, True])
    def test_swiglu_op_cpu_kernels_in_row_chunks(self, weights):
        # the activation op the recipes run between their scaled GEMMs: row chunks (here
        # of one and three rows, and all) give the whole-tensor forward's bits, the
        # backward grouped_swiglu's CPU bits for the same rows, and both the float64
        # derivative of silu(gate) * up (* w) to fp32 rounding
        from torch_moe._ops import grouped_swiglu as m

        g = torch.Generator().manual_seed(3)
        h = (torch.randn(37, 48, generator=g) * 3).to(torch.bfloat16)
        ga = torch.randn(37, 24, generator=g).to(torch.bfloat16)
        rw = torch.rand(37, generator=g) if weights else None
        want_a = m._act(h, h.dtype, rw)
        want_dh = torch.empty_like(h)
        want_rw = m._act_backward_into(h, ga, rw, torch.empty_like(want_a), want_dh)
        h64 = h.double().requires_grad_(True)
        rw64 = None if rw is None else rw.double().requires_grad_(True)
        gate, up = h64.chunk(2, dim=-1)
        a64 = torch.nn.functional.silu(gate) * up * (1 if rw64 is None else rw64[:, None])
        a64.backward(ga.double())
        for elems in (24, 72, 2**16):
            with unittest.mock.patch.object(m, "_ACT_CHUNK_ELEMS", elems):
                a = torch.ops.torch_moe.swiglu(h, rw)
                dh, grad_rw = torch.ops.torch_moe.swiglu_backward(ga, h, rw)
            self.assertEqual(a, want_a, atol=0, rtol=0)
            self.assertEqual(dh, want_dh, atol=0, rtol=0)
            self.assertEqual(dh.double(), h64.grad, atol=0.02, rtol=1e-2)
            if rw is None:
                self.assertEqual(grad_rw.numel(), 0)
            else:
                self.assertEqual(grad_rw, want_rw.to(rw.dtype), atol=0, rtol=0)
                self.assertEqual(grad_rw.double(), rw64.grad, atol=1e-5, rtol=1e-5)

    @parametrize("weights", [False, True])
    def test_chunk_math_in_fp32(self, weights):
        # the CPU kernels' elementwise parts compute in fp32 and round once into bf16:
        # bitwise what the same fp32 expressions give (bf16 math would differ in ulps)
        from torch_moe._ops import grouped_swiglu as m

        g = torch.Generator().manual_seed(0)
        h = (torch.randn(64, 32, generator=g) * 3).to(torch.bfloat16)
        ga = torch.randn(64, 16, generator=g).to(torch.bfloat16)
        rw = torch.rand(64, generator=g) if weights else None
        gate, up = h.float().chunk(2, dim=-1)
        s = torch.sigmoid(gate)
        a32 = gate * s * up
        if rw is not None:
            a32 = a32 * rw[:, None]
        out = torch.empty(64, 16, dtype=torch.bfloat16)
        m._act_into(h, rw, out)
        self.assertEqual(out, a32.to(torch.bfloat16), atol=0, rtol=0)
        out_a, out_dh = torch.empty(64, 16, dtype=torch.bfloat16), torch.empty_like(h)
        m._act_backward_into(h, ga, rw, out_a, out_dh)
        gaw = ga.float() * (rw[:, None] if rw is not None else 1)
        d_up = gate * s * gaw
        d_gate = gaw * up * s * (1 + gate * (1 - s))
        want = torch.cat([d_gate, d_up], -1).to(torch.bfloat16)
        # the fp32 results may differ from this expression by an fp32 ulp or two (fused
        # silu_backward): at most one bf16 ulp after rounding, never bf16-level error
        self.assertEqual(out_dh, want, atol=0, rtol=2**-8)
        self.assertEqual(out_a, a32.to(torch.bfloat16), atol=0, rtol=2**-8)


instantiate_parametrized_tests(TestGroupedSwiGLUChecks)
instantiate_parametrized_tests(TestGroupedSwiGLU)

if __name__ == "__main__":
    run_tests()
