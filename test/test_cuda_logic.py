# Owner(s): ["module: moe"]
"""The decisions of the CUDA paths, tested on CPU: which kernel a grouped GEMM takes
(torch._grouped_mm's conditions, the FP8 recipe's kernel per GEMM), the tail zeroing that
follows torch._grouped_mm / torch._scaled_grouped_mm, and that each GEMM of the backward
is quantized with its own recipe entry. The CUDA branches only launch what these choose.
"""

import importlib
from types import SimpleNamespace
from unittest import mock

import torch
from test_grouped_mm import assert_gemm_close
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe  # noqa: F401
from torch_moe._ops import grouped_mm as G
from torch_moe.quantization import RECIPES, get_recipe
from torch_moe.quantization.recipes import GemmQuant, OperandQuant

S = importlib.import_module("torch_moe.quantization.scaled_grouped_mm")


def _offs(sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


class TestCudaLogicOnCPU(TestCase):
    def test_zero_tail(self):
        out = torch.arange(1.0, 25.0).reshape(8, 3)
        want = out.clone()
        want[5:] = 0
        self.assertIs(G.zero_tail_(out, _offs([2, 0, 3])), out)
        self.assertEqual(out, want, atol=0, rtol=0)
        # no group at all: every row is past the last group end
        self.assertEqual(G.zero_tail_(torch.ones(4, 2), _offs([])), torch.zeros(4, 2))
        # every row in a group: nothing zeroed
        full = torch.ones(5, 2)
        self.assertEqual(G.zero_tail_(full, _offs([5])), torch.ones(5, 2))

    def test_torch_grouped_mm_conditions(self):
        """torch._grouped_mm takes bf16 on sm_90+ with 16-byte aligned K and N and row- or
        column-major operands; anything else goes to Triton."""

        def ok(x, w, capability=(9, 0)):
            with mock.patch.object(torch.cuda, "get_device_capability", return_value=capability):
                return G._torch_grouped_mm_ok(x, w)

        bf = torch.bfloat16
        x, w = torch.zeros(8, 64, dtype=bf), torch.zeros(2, 64, 32, dtype=bf)
        self.assertTrue(ok(x, w))
        self.assertTrue(ok(x, torch.zeros(2, 32, 64, dtype=bf).transpose(1, 2)))  # [E, N, K]^T
        self.assertTrue(ok(x, w, capability=(10, 0)))
        self.assertFalse(ok(x, w, capability=(8, 0)))
        self.assertFalse(ok(x.half(), w.half()))
        self.assertFalse(ok(x.float(), w.float()))
        self.assertFalse(ok(torch.zeros(8, 60, dtype=bf), torch.zeros(2, 60, 32, dtype=bf)))  # K
        self.assertFalse(ok(x, torch.zeros(2, 64, 36, dtype=bf)))  # N*2 bytes not 16-aligned
        self.assertTrue(ok(x, torch.zeros(2, 64, 40, dtype=bf)))  # N=40: 80 bytes
        self.assertFalse(ok(torch.zeros(64, 8, dtype=bf).t()[:, :], w))  # x column-major
        strided = torch.zeros(2, 64, 64, dtype=bf)[:, :, ::2]  # no unit stride in w
        self.assertFalse(ok(x, strided))

    @parametrize("recipe", list(RECIPES))
    def test_kernel_per_gemm(self, recipe):
        """The kernel of each GEMM follows that GEMM's own recipe entry (forward, dgrad,
        wgrad), on Hopper and elsewhere; the CPU always emulates."""
        r = RECIPES[recipe]
        hopper = ("cuda", (9, 0))
        for g in (r.forward, r.dgrad):
            rowwise = all(
                (op.fmt, op.outer, op.inner) in {("fp8", 1, -1), ("fp8", -1, -1)}
                for op in (g.lhs, g.rhs)
            )
            want = "torch" if rowwise else "triton"
            self.assertEqual(S.gemm_kernel(g, 128, 256, torch.bfloat16, *hopper), want)
            self.assertEqual(S.gemm_kernel(g, 128, 256, torch.bfloat16, "cpu"), "emulate")
            self.assertEqual(S.gemm_kernel(g, 128, 256, torch.float32, *hopper), "triton")
        self.assertEqual(S.wgrad_kernel(r.wgrad, "cuda"), "triton")
        self.assertEqual(S.wgrad_kernel(r.wgrad, "cpu"), "emulate")
        bf16 = r.with_overrides(forward="bf16", dgrad="bf16", wgrad="bf16")
        for g in (bf16.forward, bf16.dgrad):
            self.assertEqual(S.gemm_kernel(g, 128, 256, torch.bfloat16, *hopper), "emulate")
        self.assertEqual(S.wgrad_kernel(bf16.wgrad, "cuda"), "emulate")

    @parametrize("gemm", ["dgrad", "wgrad"])
    def test_backward_gemm_uses_its_own_recipe(self, gemm):
        """A recipe whose dgrad (or wgrad) is bf16 and forward FP8: the backward GEMM is the
        bf16 GEMM (bf16-representable values within its rounding bound), not the forward's
        FP8 recipe, and the forward stays FP8."""
        recipe = get_recipe("fp8_blockwise").with_overrides(**{gemm: "bf16"}).op_arg()
        g = torch.Generator().manual_seed(0)
        offs = _offs([7, 0, 12])
        x = torch.randn(19, 128, generator=g)
        w = torch.randn(3, 128, 64, generator=g) / 11
        dy = torch.randn(19, 64, generator=g)
        ops = torch.ops.torch_moe
        bf = torch.bfloat16
        if gemm == "dgrad":
            got = ops.quantized_grouped_mm_dgrad(dy, w, offs, recipe)
            assert_gemm_close(self, got.to(bf), dy.to(bf), w.to(bf).transpose(1, 2), offs, gemm)
        else:
            got = ops.quantized_grouped_mm_wgrad(x, dy, offs, recipe)
            assert_gemm_close(self, got.to(bf), x.to(bf), dy.to(bf), offs, gemm, wgrad=True)
        self.assertEqual(got, got.to(bf).float(), atol=0, rtol=0)  # bf16 values
        fwd = ops.quantized_grouped_mm(x, w, offs, recipe)
        with self.assertRaises(AssertionError):  # FP8: beyond the bf16 GEMM's bound
            assert_gemm_close(self, fwd.to(bf), x.to(bf), w.to(bf), offs, "forward")

    def test_triton_takes(self):
        """The Triton scaled GEMMs take both operands in one format with the same K blocks
        of 32, 128 or all of K, B's N blocks of 1, 128 or all of N, and a per-tensor A only
        with a per-tensor B; the table is that rule written out."""
        fp8 = lambda outer, inner: OperandQuant("fp8", outer, inner)  # noqa: E731
        mx = OperandQuant("mx", 1, 32)
        cases = [
            (fp8(1, 128), fp8(128, 128), True),  # blockwise
            (fp8(1, -1), fp8(1, -1), True),  # rowwise
            (fp8(-1, -1), fp8(-1, -1), True),  # tensorwise
            (mx, mx, True),
            (fp8(1, 32), fp8(1, 32), True),
            (fp8(1, 128), fp8(-1, 128), True),  # B: all of N in one block
            (fp8(1, 128), fp8(128, 32), False),  # K blocks differ
            (fp8(1, 32), mx, False),  # formats differ
            (mx, fp8(1, 32), False),
            (fp8(-1, -1), fp8(1, -1), False),  # per-tensor A needs a per-tensor B
            (fp8(1, -1), fp8(-1, -1), True),  # (B per tensor with A per row: fine)
            (fp8(1, 64), fp8(1, 64), False),  # K block 64
            (fp8(1, 128), fp8(64, 128), False),  # N block 64
            (fp8(1, 128), fp8(32, 128), False),  # N block 32
            (fp8(128, 128), fp8(1, 128), True),  # A's row blocks are per row anyway
        ]
        for lhs, rhs, want in cases:
            with self.subTest(lhs=lhs, rhs=rhs):
                g = GemmQuant(lhs, rhs)
                self.assertEqual(S._triton_takes(g), want)
                self.assertEqual(S.gemm_kernel(g, 128, 256, torch.float32, "cuda", (9, 0)),
                                 "triton" if want else "emulate")  # fmt: skip
                self.assertEqual(S.wgrad_kernel(g, "cuda"), "triton" if want else "emulate")
        self.assertFalse(S._triton_takes(GemmQuant()))

    def test_jagged_slot_index(self):
        """Slot row j * block + i holds row first[j] + i while that is before last[j], else
        -1 (padding): written out row by row."""
        first = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
        last = torch.tensor([4, 4, 7, 13], dtype=torch.int32)  # block 1 empty
        block = 4
        want = []
        for f, end in zip(first.tolist(), last.tolist()):
            want += [f + i if f + i < end else -1 for i in range(block)]
        got = S.jagged_slot_index(first, last, block)
        self.assertEqual(got.tolist(), want)
        self.assertEqual(got.dtype, torch.int64)

    def test_select_reads_the_operands(self):
        """_select hands gemm_kernel the device, k = a's columns, n = b's last dim and the
        capability of a's device (CUDA tensors stood in for by their device and shape)."""
        g = RECIPES["fp8_rowwise"].forward
        cuda = torch.device("cuda", 0)
        a = SimpleNamespace(device=cuda, shape=(64, 128))
        for n, capability in ((256, (9, 0)), (40, (9, 0)), (256, (10, 0))):
            b = SimpleNamespace(device=cuda, shape=(4, 128, n))
            with mock.patch.object(torch.cuda, "get_device_capability", return_value=capability):
                got = S._select(g, a, b, torch.bfloat16)
            self.assertEqual(got, S.gemm_kernel(g, 128, n, torch.bfloat16, "cuda", capability))
        self.assertEqual(
            S._select(g, torch.zeros(4, 128), torch.zeros(2, 128, 256), torch.bfloat16), "emulate"
        )

    def test_decomposed_op_runs_eager_kernel(self):
        """torch_moe::scaled_grouped_mm (a compiled graph's decomposition) takes
        torch._scaled_grouped_mm exactly where the high-precision op does for the same
        GEMM, and Triton where that op takes Triton: compiled == eager bit for bit on the
        device (the first H200 run found the decomposed dgrad on Triton, eager on torch)."""
        seen = set()
        for name, recipe in RECIPES.items():
            for g in (recipe.forward, recipe.dgrad):
                if not S.decomposable(g):
                    continue
                scale_dtype = torch.uint8 if g.lhs.fmt == "mx" else torch.float32
                for k, n in ((128, 256), (120, 256), (128, 40)):
                    for out in (torch.bfloat16, torch.float32):
                        for cap, has in (((9, 0), True), ((10, 0), True), ((9, 0), False)):
                            eager = S.gemm_kernel(g, k, n, out, "cuda", cap, has)
                            op = S.scaled_op_kernel(
                                scale_dtype, g.lhs.inner, g.rhs.outer, k, n, out, cap, has
                            )
                            self.assertIn(eager, ("torch", "triton"), msg=name)
                            self.assertEqual(op, eager, msg=(name, g, k, n, out, cap, has))
                            seen.add(eager)
        self.assertEqual(seen, {"torch", "triton"})  # both branches were compared

    def test_torch_scales(self):
        """Rowwise / tensorwise scales in torch._scaled_grouped_mm's shapes: [M] and [E, n]."""
        sa, sb = S._torch_scales(torch.arange(3.0)[:, None], torch.ones(2, 1, 4), 3, 2, 4)
        self.assertEqual(sa, torch.arange(3.0))
        self.assertEqual(list(sb.shape), [2, 4])
        sa, sb = S._torch_scales(
            torch.full((1, 1), 2.0), torch.tensor([3.0, 4.0])[:, None, None], 5, 2, 4
        )
        self.assertEqual(sa, torch.full((5,), 2.0))
        self.assertEqual(sb, torch.tensor([[3.0] * 4, [4.0] * 4]))

    def test_dispatch_passes_the_operands_through(self):
        """Whichever kernel is chosen, the GEMM runner calls it with the operands, offs, the
        GEMM's recipe entry and the output dtype unchanged (the CUDA branches only launch)."""
        x, w, offs = torch.randn(6, 32), torch.randn(2, 32, 16), _offs([2, 4])
        dy = torch.randn(6, 16)
        g = RECIPES["fp8_rowwise"].forward
        for kernel, fn in (("torch", "_torch_gemm"), ("triton", "_kernel_gemm")):
            with (
                mock.patch.object(S, "_select", return_value=kernel),
                mock.patch.object(S, fn, return_value="sentinel") as called,
            ):
                self.assertEqual(S._run_gemm(x, w, offs, g, torch.float32), "sentinel")
            args = called.call_args.args
            self.assertIs(args[0], x)
            self.assertIs(args[1], w)
            self.assertIs(args[2], offs)
            self.assertIs(args[3], g)
            if kernel == "triton":
                self.assertIs(args[4], torch.float32)
        gw = RECIPES["fp8_blockwise"].wgrad
        with (
            mock.patch.object(S, "wgrad_kernel", return_value="triton") as choose,
            mock.patch.object(S, "_kernel_wgrad", return_value="sentinel") as called,
        ):
            self.assertEqual(S._run_wgrad(x, dy, offs, gw, torch.float32), "sentinel")
        self.assertEqual(choose.call_args.args, (gw, "cpu"))
        self.assertEqual(len(called.call_args.args), 5)
        for got, want in zip(called.call_args.args, (x, dy, offs, gw, torch.float32)):
            self.assertIs(got, want)


instantiate_parametrized_tests(TestCudaLogicOnCPU)

if __name__ == "__main__":
    run_tests()
