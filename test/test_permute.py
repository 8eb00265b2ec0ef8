# Owner(s): ["module: moe"]
"""Tests for permute_indices / permute / unpermute against naive per-token loops."""

import unittest
from unittest import mock

import naive
import tolerances
import torch
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe  # noqa: F401
from torch_moe import ops
from torch_moe._ops.permute import gather_rows


def _ids(num_tokens, num_experts, k, skew="uniform", seed=0):
    """Distinct expert ids per token: uniform, or skewed onto expert 0, or leaving experts empty."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    if skew == "one_expert":  # every token's first choice is expert 0
        scores[:, 0] = 2
    elif skew == "empty_experts":  # only the first max(k, E/2) experts ever get a token
        scores[:, max(k, num_experts // 2) :] = -1
    return scores.argsort(dim=1, descending=True)[:, :k]


CASES = [
    # (T, E, K, skew)
    (0, 4, 2, "uniform"),
    (9, 1, 1, "uniform"),
    (13, 4, 4, "uniform"),  # K == E
    (31, 8, 2, "empty_experts"),
    (17, 6, 3, "one_expert"),
    (40, 8, 1, "one_expert"),
]


class TestPermute(TestCase):
    @parametrize("case", CASES)
    @parametrize("align_capacity", [(1, None), (4, None), (1, 3), (8, 5), (1, 0)])
    def test_matches_naive(self, case, align_capacity):
        num_tokens, num_experts, k, skew = case
        align, capacity = align_capacity
        dim = 7  # odd
        ids = _ids(num_tokens, num_experts, k, skew)
        x = torch.randn(dim, num_tokens, dtype=torch.float64).t()  # non-contiguous
        x_perm, perm = ops.permute(x, ids, num_experts, align=align, capacity=capacity)
        rows, ends, dropped = naive.dispatch(ids, num_experts, align, capacity)

        self.assertEqual(perm.offs.tolist(), ends)
        self.assertEqual(perm.offs.dtype, torch.int32)
        self.assertEqual(int(perm.num_dropped), dropped)
        self.assertGreaterEqual(x_perm.shape[0], len(rows))
        expected = torch.zeros(x_perm.shape, dtype=torch.float64)
        for r, src in enumerate(rows):
            if src is not None:
                expected[r] = x[src[0]]
        self.assertEqual(x_perm, expected, atol=0, rtol=0)  # a gather is exact

        # combine: sum_k w * y[row], dropped slots contribute nothing
        y = torch.randn(x_perm.shape[0], 5, dtype=torch.float64)
        w = torch.rand(num_tokens, k, dtype=torch.float64)
        out = ops.unpermute(y, w, perm)
        ref = torch.zeros(num_tokens, 5, dtype=torch.float64)
        for r, src in enumerate(rows):
            if src is not None:
                ref[src[0]] += w[src] * y[r]
        self.assertEqual(out, ref)

    def test_no_padding_rows_when_dropless(self):
        ids = _ids(50, 8, 2)
        x_perm, perm = ops.permute(torch.randn(50, 3), ids, 8)
        self.assertEqual(x_perm.shape[0], 100)
        self.assertEqual(int(perm.offs[-1]), 100)
        self.assertTrue((perm.row_to_slot >= 0).all())

    def test_static_row_bound(self):
        ids = _ids(10, 4, 2)
        self.assertEqual(ops.permute_indices(ids, 4, align=16).row_to_slot.shape[0], 20 + 4 * 15)
        self.assertEqual(ops.permute_indices(ids, 4, capacity=3).row_to_slot.shape[0], 12)
        self.assertEqual(ops.permute_indices(ids, 4, capacity=30).row_to_slot.shape[0], 20)

    def test_round_trip_is_identity_with_unit_weights(self):
        ids = _ids(23, 5, 2, "one_expert")
        x = torch.randn(23, 6)
        x_perm, perm = ops.permute(x, ids, 5, align=4)
        out = ops.unpermute(x_perm, torch.full((23, 2), 0.5), perm)
        self.assertEqual(out, x)

    @parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_low_precision_combine_accumulates_in_fp32(self, dtype):
        ids = _ids(64, 8, 4)
        y = torch.randn(256, 33).to(dtype)
        w = torch.rand(64, 4)
        perm = ops.permute_indices(ids, 8)
        out = ops.unpermute(y, w, perm)
        self.assertEqual(out.dtype, dtype)
        # fp32 accumulation and one rounding at the end: bitwise the fp32 result, rounded
        self.assertEqual(out, ops.unpermute(y.float(), w, perm).to(dtype), atol=0, rtol=0)
        self.assertEqual(out, ops.unpermute(y.double(), w.double(), perm).to(dtype))

    @parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
    def test_cpu_kernels_equal_references_bitwise(self, dtype):
        from torch_moe._ops import permute as P

        # one row chunk, then chunks of 5 rows (33 tokens: a short last chunk); padding
        # rows and a capacity's dropped slots (-1) in one chunk and across chunks
        for align, cap, chunk in [
            (1, None, 2**30),
            (1, None, 5 * 17),
            (4, None, 5 * 17),
            (1, 2, 2**30),
            (1, 2, 5 * 17),
            (4, 3, 5 * 17),
        ]:
            ids = _ids(33, 6, 3, "one_expert")
            perm = ops.permute_indices(ids, 6, align=align, capacity=cap)
            x = torch.randn(33, 17).to(dtype)
            w = torch.rand(33, 3)
            y = torch.randn(perm.row_to_slot.shape[0], 17).to(dtype)
            if cap is not None:  # a dropped slot adds exactly 0, whatever the row it misses
                y[0] = float("inf")
            maps = (perm.row_to_slot, perm.slot_to_row)
            with mock.patch.object(P, "_CHUNK_ELEMS", chunk // torch.get_num_threads()):
                self._check_cpu_kernels(P, perm, maps, x, w, y)
                if chunk < 2**30:  # the weights' gradient: chunking changes no bit
                    got = P.weighted_row_dot(y, x, perm.slot_to_row)
            if chunk < 2**30:
                self.assertEqual(got, P.weighted_row_dot(y, x, perm.slot_to_row), atol=0, rtol=0)
                rows = y.double()[perm.slot_to_row.clamp(min=0)]
                exact = (rows * x.double().unsqueeze(1)).sum(-1)
                exact = torch.where(perm.slot_to_row >= 0, exact, 0)
                self.assertEqual(got, exact.to(got.dtype))  # got's dtype's tolerance

    def _check_cpu_kernels(self, P, perm, maps, x, w, y):
        for weights in (None, w):
            self.assertEqual(
                torch.ops.torch_moe.permute(x, *maps, weights),
                P.permute_rows_reference(x, *maps, weights),
                atol=0,
                rtol=0,
            )
            self.assertEqual(
                ops.unpermute(y, weights, perm),
                P.unpermute_rows_reference(y, perm.slot_to_row, perm.row_to_slot, weights),
                atol=0,
                rtol=0,
            )

    def test_gather_rows(self):
        # x[index] with zero rows where index == -1, float8 included (written out row by row)
        x = torch.arange(1.0, 13.0).reshape(4, 3)
        index = torch.tensor([2, -1, 0, 2, -1, 3])
        for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
            got = gather_rows(x.to(dtype), index)
            self.assertEqual(got.dtype, dtype)
            want = torch.stack([x[i] if i >= 0 else torch.zeros(3) for i in index.tolist()])
            self.assertEqual(got.float(), want, atol=0, rtol=0)
        self.assertEqual(gather_rows(x, torch.empty(0, dtype=torch.int64)).shape, (0, 3))

    def test_deterministic(self):
        ids = _ids(300, 8, 4, "one_expert")
        x = torch.randn(300, 64, dtype=torch.bfloat16, requires_grad=True)
        w = torch.rand(300, 4, requires_grad=True)
        results = []
        for _ in range(2):
            x.grad = w.grad = None
            x_perm, perm = ops.permute(x, ids, 8, align=16)
            out = ops.unpermute(x_perm * 3, w, perm)
            out.float().square().sum().backward()
            results.append((out, x.grad, w.grad))
        for a, b in zip(*results):
            self.assertEqual(a, b, atol=0, rtol=0)

    @parametrize("capacity", [None, 2])
    def test_gradcheck(self, capacity):
        ids = _ids(7, 4, 2, "one_expert")
        x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
        w = torch.rand(7, 2, dtype=torch.float64, requires_grad=True)
        perm = ops.permute_indices(ids, 4, align=2, capacity=capacity)

        def fn(x, w):
            x_perm = torch.ops.torch_moe.permute(x, perm.row_to_slot, perm.slot_to_row, w)
            y = x_perm.sin()
            return ops.unpermute(y, w, perm)

        self.assertTrue(torch.autograd.gradcheck(fn, (x, w)))
        self.assertTrue(torch.autograd.gradgradcheck(lambda x: fn(x, w.detach()), (x,)))

    def test_zero_stride_grad(self):
        ids = _ids(9, 3, 2)
        x = torch.randn(9, 4, requires_grad=True)
        x_perm, perm = ops.permute(x, ids, 3, align=4)
        ops.unpermute(x_perm, None, perm).sum().backward()
        self.assertEqual(x.grad, torch.full((9, 4), 2.0))

    def test_opcheck(self):
        """The four ops' schemas, fake kernels and autograd formulas on every device here:
        on CUDA that is the Triton kernels (plan, rows, row dot) where they take the inputs
        (dropless decode-sized plans; bf16 rows), the references where they do not."""
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        for device, dtype in [(d, t) for d in devices for t in (torch.float32, torch.bfloat16)]:
            ids = _ids(12, 4, 2, "one_expert").to(device)
            for align, cap in [(1, None), (4, 2)]:
                with self.subTest(device=device, dtype=str(dtype), align=align, cap=cap):
                    self._opcheck(ids, align, cap, dtype)

    def _opcheck(self, ids, align, cap, dtype):
        device = ids.device
        torch.library.opcheck(torch.ops.torch_moe.permute_indices.default, (ids, 4, align, cap))
        perm = ops.permute_indices(ids, 4, align=align, capacity=cap)
        s2r, r2s = perm.slot_to_row, perm.row_to_slot

        def leaf(*shape, rand=torch.randn):
            return rand(*shape, device=device).to(dtype).requires_grad_()

        x, w, y = leaf(12, 5), leaf(12, 2, rand=torch.rand), leaf(r2s.shape[0], 5)
        torch.library.opcheck(torch.ops.torch_moe.permute.default, (x, r2s, s2r, w))
        torch.library.opcheck(torch.ops.torch_moe.unpermute.default, (y, s2r, r2s, w))
        torch.library.opcheck(torch.ops.torch_moe.unpermute.default, (y, s2r, r2s, None))
        rows, tokens = y.detach(), x.detach()
        torch.library.opcheck(torch.ops.torch_moe.weighted_row_dot.default, (rows, tokens, s2r))

    def test_compile_fullgraph(self):
        ids = _ids(16, 4, 2)
        x = torch.randn(16, 8)
        w = torch.rand(16, 2)

        def fn(x, ids, w):
            x_perm, perm = ops.permute(x, ids, 4, align=4)
            return ops.unpermute(x_perm * 2, w, perm)

        self.assertEqual(
            torch.compile(fn, fullgraph=True, backend="aot_eager")(x, ids, w), fn(x, ids, w)
        )

    def test_bad_inputs(self):
        ids = _ids(4, 4, 2)
        with self.assertRaisesRegex(ValueError, r"align must be >= 1, got -2"):
            ops.permute_indices(ids, 4, align=-2)
        with self.assertRaisesRegex(ValueError, r"align must be >= 1, got 0"):
            ops.permute_indices(ids, 4, align=0)
        with self.assertRaisesRegex(ValueError, r"capacity must be >= 0 or None, got -1"):
            ops.permute_indices(ids, 4, capacity=-1)
        with self.assertRaisesRegex(
            ValueError, r"expert_ids to be a 2D int32/int64 tensor \[T, K\], got 2D torch.float32"
        ):
            ops.permute_indices(ids.float(), 4)
        with self.assertRaisesRegex(ValueError, r"num_experts must be >= 1, got 0"):
            ops.permute_indices(ids, 0)
        with self.assertRaisesRegex(RuntimeError, r"expert_ids must lie in \[0, num_experts=3\)"):
            ops.permute_indices(ids, 3)
        # an align past the int32 group ends: once silently wrong maps (int64 overflow of
        # the row count), now refused; a huge capacity is no capacity (it once crashed)
        msg = r"4 x 2 assignments over num_experts=4 with align=4611686018427387904 and "
        msg += r"capacity=None make \d+ permuted rows, past the int32 group ends' 2147483647"
        with self.assertRaisesRegex(ValueError, msg):
            ops.permute_indices(ids, 4, align=2**62)
        with self.assertRaisesRegex(ValueError, r"align=536870912 and capacity=2 make"):
            ops.permute_indices(ids, 4, align=2**29, capacity=2)
        for align in (1, 3):
            with self.subTest(align=align):
                huge = ops.permute_indices(ids, 4, align=align, capacity=2**62)
                for got, want in zip(huge, ops.permute_indices(ids, 4, align=align), strict=True):
                    self.assertEqual(got, want, atol=0, rtol=0)
        with self.assertRaisesRegex(ValueError, r"permute: expected x to have 4 rows, got 5"):
            ops.permute(torch.randn(5, 3), ids, 4)
        perm = ops.permute_indices(ids, 4)
        with self.assertRaisesRegex(ValueError, r"unpermute: expected y to have 8 rows, got 7"):
            ops.unpermute(torch.randn(7, 3), None, perm)
        with self.assertRaisesRegex(
            ValueError, r"weights to be a floating-point tensor of shape \[4, 2\], got \[4, 3\]"
        ):
            ops.unpermute(torch.randn(8, 3), torch.rand(4, 3), perm)

    def test_maps_past_their_ranges(self):
        # a permutation whose maps point past the rows (built by hand): a clear error on
        # every CPU path, where the native combine read (and crashed on) memory past y and
        # the ATen paths raised a bare IndexError
        from torch_moe._ops import _native
        from torch_moe.nn.functional import grouped_swiglu

        perm = ops.permute_indices(_ids(4, 2, 4), 4)
        x, y = torch.randn(4, 8), torch.randn(8, 8)
        w13, w2 = torch.randn(4, 6, 8), torch.randn(4, 8, 3)
        r2s = perm.row_to_slot.clone()
        r2s[3] = 8
        for dtype in (torch.float32, torch.bfloat16):
            for bad in (8, -2):
                s2r = perm.slot_to_row.clone()
                s2r[1, 1] = bad
                msg = rf"^unpermute: slot_to_row must hold values in \[-1, 8\), got {bad}$"
                with (
                    self.subTest(dtype=str(dtype), bad=bad),
                    self.assertRaisesRegex(ValueError, msg),
                ):
                    ops.unpermute(y.to(dtype), None, perm._replace(slot_to_row=s2r))
            with self.assertRaisesRegex(
                ValueError, r"^permute: row_to_slot must hold values in \[-1, 8\), got 8$"
            ):
                torch.ops.torch_moe.permute(x.to(dtype), r2s, perm.slot_to_row)
            with self.assertRaisesRegex(
                ValueError, r"^grouped_swiglu: row_to_slot must hold values in \[-1, 8\), got 8$"
            ):
                grouped_swiglu(
                    x.to(dtype), w13.to(dtype), w2.to(dtype), perm.offs,
                    row_to_slot=r2s, slot_to_row=perm.slot_to_row,
                )  # fmt: skip
        if _native.available():  # the kernel checks too (its callers past the op's checks)
            s2r = perm.slot_to_row.clone()
            s2r[1, 1] = 8
            with self.assertRaisesRegex(
                RuntimeError,
                r"combine_cpu: slot_to_row must hold rows of y in \[-1, 8\), got 8 at 3",
            ):
                _native.kernels().combine(y, s2r, torch.empty(4, 8), None)


class TestPermutePlan(TestCase):
    """The CUDA kernel of permute_indices for decode-sized batches (one Triton program, run
    here in Triton's interpreter on CPU tensors) equals the ATen reference bit for bit."""

    def _check(self, ids, num_experts, align):
        from torch_moe._ops.permute import _permute_indices_cuda, permute_indices_reference
        from torch_moe._triton import permute as TP

        want = permute_indices_reference(ids, num_experts, align)
        with mock.patch.object(TP, "permute_plan", wraps=TP.permute_plan) as plan:
            got = _permute_indices_cuda(ids, num_experts, align)
        plan.assert_called_once()  # the CUDA kernel took the one-program path
        for name, g, w in zip(("row_to_slot", "slot_to_row", "offs", "num_dropped"), got, want):
            self.assertEqual(g.dtype, w.dtype, msg=name)
            self.assertEqual(g, w, atol=0, rtol=0, msg=(name, tuple(ids.shape), num_experts, align))

    def test_matches_reference(self):
        # single token (decode), K == E, skew onto one expert, empty experts, E past one
        # counting chunk (33, 100), T*K past one ranking chunk and not a power of two, int32
        for (T, E, K, skew), align in (
            ((1, 128, 8, "uniform"), 16),
            ((1, 1, 1, "uniform"), 1),
            ((3, 4, 4, "uniform"), 1),
            ((17, 6, 3, "one_expert"), 16),
            ((31, 33, 2, "empty_experts"), 4),
            ((40, 100, 1, "one_expert"), 64),
            ((9, 8, 2, "uniform"), 3),  # align not a power of two
        ):
            ids = _ids(T, E, K, skew, seed=T)
            self._check(ids.int() if T == 3 else ids, E, align)
        # every assignment to one expert (the ranking's longest run)
        self._check(torch.zeros(48, 1, dtype=torch.long), 5, 16)

    def test_range_and_limits(self):
        from torch_moe._ops.permute import _permute_indices_cuda, permute_indices_reference
        from torch_moe._triton import permute as TP

        ids = _ids(4, 4, 2)
        with self.assertRaisesRegex(RuntimeError, r"expert_ids must lie in \[0, num_experts=3\)"):
            TP.permute_plan(ids, 3, 16)
        with self.assertRaisesRegex(RuntimeError, r"expert_ids must lie in \[0, num_experts=4\)"):
            TP.permute_plan(ids - 1, 4, 1)
        with self.assertRaisesRegex(RuntimeError, r"expert_ids must lie in \[0, num_experts=4\)"):
            TP.permute_plan(ids + 2**32, 4, 1)  # not wrapped into range by an int32 cast
        with self.assertRaisesRegex(ValueError, r"takes 1 to 1024 assignments, got T\*K = 1025"):
            TP.permute_plan(torch.zeros(1025, 1, dtype=torch.long), 2, 1)
        with self.assertRaisesRegex(ValueError, r"takes 1 to 1024 assignments, got T\*K = 0"):
            TP.permute_plan(torch.zeros(0, 2, dtype=torch.long), 2, 1)
        self.assertTrue(TP.plan_takes(1024, None))
        self.assertFalse(TP.plan_takes(1025, None))
        self.assertFalse(TP.plan_takes(0, None))
        self.assertFalse(TP.plan_takes(8, 4))  # capacity: the reference
        # the CUDA kernel hands the rest to the reference (mocked: the reference's own run)
        with mock.patch.object(TP, "permute_plan", side_effect=AssertionError("no plan")):
            for ids, cap in (
                (torch.zeros(0, 2, dtype=torch.long), None),
                (_ids(600, 8, 2), None),
                (_ids(5, 4, 2), 1),
            ):
                got = _permute_indices_cuda(ids, 8 if ids.shape[0] == 600 else 4, 16, cap)
                want = permute_indices_reference(ids, 8 if ids.shape[0] == 600 else 4, 16, cap)
                for g, w in zip(got, want):
                    self.assertEqual(g, w, atol=0, rtol=0)

    @unittest.skipIf(not torch.cuda.is_available(), "needs a CUDA GPU")
    def test_plan_cuda(self):
        """On the GPU (compiled kernel): the reference's integers, and in a CUDA graph (the
        decode path captures it) the replay follows new ids in the same buffers."""
        cases = [((1, 128, 8), 16), ((64, 128, 8), 16), ((128, 256, 8), 64), ((5, 3, 3), 1)]
        for (T, E, K), align in cases:
            ids = _ids(T, E, K, seed=T)
            got = ops.permute_indices(ids.cuda(), E, align=align)
            want = ops.permute_indices(ids, E, align=align)
            for g, w in zip(
                (got.row_to_slot, got.slot_to_row, got.offs),
                (want.row_to_slot, want.slot_to_row, want.offs),
            ):
                self.assertEqual(g.cpu(), w, atol=0, rtol=0, msg=(T, E, K, align))
        ids = _ids(16, 128, 8, seed=1).cuda()
        static = ids.clone()
        torch.ops.torch_moe.permute_indices(static, 128, 16, None)  # compile off the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.torch_moe.permute_indices(static, 128, 16, None)
        static.copy_(ids.flip(0))
        graph.replay()
        want = ops.permute_indices(ids.flip(0).cpu(), 128, align=16)
        self.assertEqual(out[0].cpu(), want.row_to_slot, atol=0, rtol=0)
        self.assertEqual(out[2].cpu(), want.offs, atol=0, rtol=0)

    def test_static_sm90(self):
        """Compiles for sm_90a without spills at every launch shape (no GPU needed)."""
        from torch_moe._triton import permute as TP

        for n in (8, 256, 1024):
            k = TP.compile_for_sm90("plan", n)
            self.assertEqual(k.n_spills, 0, msg=f"{n} assignments: {k.ptxas_log}")
        for kernel in ("permute", "unpermute", "row_dot"):
            k = TP.compile_for_sm90(kernel)
            self.assertEqual(k.n_spills, 0, msg=f"{kernel}: {k.ptxas_log}")
            self.assertIn("ld.global.v", k.asm["ptx"])  # rows read in vectors
        with self.assertRaisesRegex(
            ValueError, r"kernel must be plan, permute, unpermute or row_dot, got 'rows'"
        ):
            TP.compile_for_sm90("rows")


class TestPermuteRowKernels(TestCase):
    """The CUDA kernels of permute / unpermute (one Triton kernel each, here in Triton's
    interpreter on CPU tensors) equal the references bit for bit: padding rows, dropped
    slots (with NaN weights, which the reference masks), D past one block, T = 0."""

    def _cases(self):
        g = torch.Generator().manual_seed(7)
        for (T, E, K, skew), align, cap, D in (
            ((13, 4, 2, "uniform"), 1, None, 40),
            ((9, 8, 3, "one_expert"), 16, None, 130),
            ((20, 4, 2, "one_expert"), 1, 3, 17),
            ((0, 4, 2, "uniform"), 4, None, 8),
        ):
            perm = ops.permute_indices(_ids(T, E, K, skew, seed=T), E, align=align, capacity=cap)
            w = torch.rand(T, K, generator=g)
            w[perm.slot_to_row < 0] = float("nan")  # dropped: masked, never multiplied
            yield perm, D, w, g

    def test_match_references(self):
        from torch_moe._ops.permute import (
            _permute_cuda,
            _unpermute_cuda,
            permute_rows_reference,
            unpermute_rows_reference,
        )
        from torch_moe._triton import permute as TP

        checked = 0
        for perm, D, w, g in self._cases():
            T = perm.slot_to_row.shape[0]
            r2s, s2r = perm.row_to_slot, perm.slot_to_row
            for dt in (torch.bfloat16, torch.float16, torch.float32):
                x = torch.randn(T, D, generator=g).to(dt)
                y = torch.randn(r2s.shape[0], D, generator=g).to(dt)
                for weights in (None, w, w.to(dt)):
                    with mock.patch.object(TP, "unpermute_rows", wraps=TP.unpermute_rows) as spy:
                        got = _unpermute_cuda(y, s2r, r2s, weights)
                    spy.assert_called_once()
                    want = unpermute_rows_reference(y, s2r, r2s, weights)
                    self.assertEqual(got, want, atol=0, rtol=0, exact_dtype=True)
                    got = _permute_cuda(x, r2s, s2r, weights)
                    want = permute_rows_reference(x, r2s, s2r, weights)
                    self.assertEqual(got, want, atol=0, rtol=0, exact_dtype=True)
                    checked += 1
        self.assertEqual(checked, 36)
        # what the kernels do not take goes to the references: fp64, rows not unit-stride
        perm, D, w, g = next(iter(self._cases()))
        y = torch.randn(perm.row_to_slot.shape[0], 2 * D, generator=g)[:, ::2]
        self.assertFalse(TP.rows_take(y, None))
        self.assertFalse(TP.rows_take(y.double().contiguous(), None))
        self.assertFalse(TP.rows_take(y.contiguous(), w.double()))
        with mock.patch.object(TP, "unpermute_rows", side_effect=AssertionError("kernel")):
            got = _unpermute_cuda(y, perm.slot_to_row, perm.row_to_slot, w)
        self.assertEqual(
            got, unpermute_rows_reference(y, perm.slot_to_row, perm.row_to_slot, w), atol=0, rtol=0
        )

    def test_row_dot(self):
        """weighted_row_dot's kernel (the combine weights' gradient): each dot within the
        fp32 accumulation bound of the exact one (its sum order is the kernel's own, as
        the reference's is ATen's), dropped slots exactly 0, D past one block."""
        from torch_moe._ops.permute import _weighted_row_dot_cuda
        from torch_moe._triton import permute as TP

        calls = 0
        for perm, D, _w, g in self._cases():
            T = perm.slot_to_row.shape[0]
            for dt in (torch.bfloat16, torch.float32):
                rows = torch.randn(perm.row_to_slot.shape[0], D, generator=g).to(dt)
                tokens = torch.randn(T, D, generator=g).to(dt)
                with mock.patch.object(TP, "row_dot", wraps=TP.row_dot) as spy:
                    got = _weighted_row_dot_cuda(rows, tokens, perm.slot_to_row)
                calls += spy.call_count
                self.assertEqual(got.dtype, torch.float32)
                valid = perm.slot_to_row >= 0
                gathered = rows.double()[perm.slot_to_row.clamp(min=0)]  # [T, K, D]
                exact = (gathered * tokens.double()[:, None, :]).sum(-1) * valid
                products = (gathered.abs() * tokens.double().abs()[:, None, :]).sum(-1)
                bound = tolerances.gemm_bound(
                    products, max(D, 1), exact, torch.float32, torch.float32
                )
                tolerances.assert_within(self, got, exact, bound, msg=f"{dt} D={D}")
                self.assertTrue(torch.equal(got[~valid], torch.zeros_like(got[~valid])))
        self.assertEqual(calls, 8)
        with self.assertRaisesRegex(
            ValueError, r"weighted_row_dot: rows, tokens and slot_to_row disagree"
        ):
            _weighted_row_dot_cuda(
                torch.zeros(4, 3), torch.zeros(2, 5), torch.zeros(2, 2, dtype=torch.long)
            )

    @unittest.skipIf(not torch.cuda.is_available(), "needs a CUDA GPU")
    def test_rows_cuda(self):
        """On the GPU the ops (and so their autograd formulas) run the kernels: the CPU
        references' values bit for bit (bf16 rounds to nearest on both)."""
        for perm, D, w, g in self._cases():
            T = perm.slot_to_row.shape[0]
            dev = [t.cuda() for t in (perm.row_to_slot, perm.slot_to_row)]
            x = torch.randn(T, D, generator=g).bfloat16()
            y = torch.randn(perm.row_to_slot.shape[0], D, generator=g).bfloat16()
            for weights in (None, w):
                wd = None if weights is None else weights.cuda()
                got = torch.ops.torch_moe.unpermute(y.cuda(), dev[1], dev[0], wd)
                want = torch.ops.torch_moe.unpermute(y, perm.slot_to_row, perm.row_to_slot, weights)
                self.assertEqual(got.cpu(), want, atol=0, rtol=0)
                got = torch.ops.torch_moe.permute(x.cuda(), dev[0], dev[1], wd)
                want = torch.ops.torch_moe.permute(x, perm.row_to_slot, perm.slot_to_row, weights)
                self.assertEqual(got.cpu(), want, atol=0, rtol=0)


class TestPermuteChecks(TestCase):
    def test_reference_checks_y_and_weights(self):
        from torch_moe._ops import permute as m

        row_to_slot, slot_to_row = torch.arange(6), torch.arange(6).view(3, 2)
        with self.assertRaisesRegex(ValueError, r"^unpermute: expected y"):
            m.unpermute_rows_reference(torch.randn(6), slot_to_row, row_to_slot)
        bad = torch.rand(2, 3)
        with self.assertRaisesRegex(ValueError, r"^permute: expected weights"):
            m.permute_rows_reference(torch.randn(3, 4), row_to_slot, slot_to_row, bad)
        with self.assertRaisesRegex(ValueError, r"^unpermute: expected weights"):
            m.unpermute_rows_reference(torch.randn(6, 4), slot_to_row, row_to_slot, bad)

    def test_reference_messages_name_the_op(self):
        from torch_moe._ops import permute as m

        x = torch.randn(3, 4)
        row_to_slot, slot_to_row = torch.arange(6), torch.arange(6).view(3, 2)
        with self.assertRaisesRegex(ValueError, r"^permute: expected x"):
            m.permute_rows_reference(torch.randn(3), row_to_slot, slot_to_row)
        with self.assertRaisesRegex(ValueError, r"^unpermute: expected row_to_slot"):
            m.unpermute_rows_reference(x, slot_to_row, row_to_slot.view(2, 3))

    def test_reference_marks_dropped_slots_minus_one(self):
        # capacity 1 of 2 experts, 4 tokens top-1 all to expert 0: three dropped slots
        ids = torch.zeros(4, 1, dtype=torch.int64)
        from torch_moe._ops.permute import permute_indices_reference

        out = permute_indices_reference(ids, 2, capacity=1)
        slot_to_row = out[1] if isinstance(out, tuple) else out.slot_to_row
        self.assertEqual(slot_to_row.view(-1).tolist(), [0, -1, -1, -1])


instantiate_parametrized_tests(TestPermute)

if __name__ == "__main__":
    run_tests()
