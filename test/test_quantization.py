# Owner(s): ["module: moe"]
"""Tests for torch_moe.quantization: FP8 / MXFP8 reference quantizers and scaled_grouped_mm."""

import contextlib
import importlib
import itertools
import math
import unittest
from collections.abc import Iterator

import naive
import tolerances
import torch
from test_grouped_mm import assert_gemm_close
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe  # noqa: F401
from torch_moe.ops import grouped_mm
from torch_moe.quantization import (
    RECIPES,
    dequantize_fp8,
    dequantize_jagged,
    dequantize_mx,
    e8m0_to_float,
    get_recipe,
    jagged_block_index,
    mx_scale_exponent,
    quantize_fp8,
    quantize_jagged,
    quantize_jagged_reference,
    quantize_mx,
    scaled_grouped_mm,
)
from torch_moe.quantization.recipes import GemmQuant, OperandQuant

S = importlib.import_module("torch_moe.quantization.scaled_grouped_mm")

# Accuracy figures, not the correctness test: correctness is exactness against the naive
# dequantization (test_scaled_grouped_mm: the ops over quantized operands within the fp32
# accumulation bound, and quantized_grouped_mm == its decomposition bit for bit; the
# quantizers bit for bit against their definitions here and in test_triton_quant). The
# floor below is derived, not measured: e4m3 keeps 4 significant bits, so quantizing one
# operand has a relative RMS error of at most 2^-4 / sqrt(3) (uniform rounding error within
# +-half an ulp of a 4-bit mantissa), two operands sqrt(2) times that, which is an SQNR of
# at least 20 log10(sqrt(3) * 16 / sqrt(2)) = 25.8 dB; 26.0 would be above it, so 25.5.
# Measured on Gaussian data (M=173 in 4 groups one empty, K=256, N=192, seed 0), dB:
#                  out    dX     dW
# fp8_tensorwise   28.5   28.5   28.6
# fp8_rowwise      28.6   28.7   29.1
# fp8_blockwise    28.6   28.6   29.1
# mxfp8 (floor)    27.7   27.6   27.4   (floor clips blocks whose amax mantissa > 1.75)
# mxfp8_rceil      28.5   28.5   28.6
MIN_SQNR_DB = 25.5

SIZES = [40, 0, 77, 51]  # not multiples of 32 or 128, one empty group


def sqnr(ref, out):
    ref, out = ref.double(), out.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum())).item()


def make_offs(sizes):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def e4m3_grid():
    """All finite float8_e4m3fn values as fp32."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return vals[torch.isfinite(vals)]


class TestScaledGroupedMM(TestCase):
    def _problem(self, seed=0, tail=5, k=256, n=192):
        g = torch.Generator().manual_seed(seed)
        offs = make_offs(SIZES)
        m = int(offs[-1]) + tail
        x = torch.randn(m, k, generator=g)
        w = torch.randn(len(SIZES), k, n, generator=g) / k**0.5
        dy = torch.randn(m, n, generator=g)
        return x, w, offs, dy

    @parametrize("name", list(RECIPES))
    def test_sqnr_vs_fp32(self, name):
        x, w, offs, dy = self._problem()
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref = grouped_mm(xr, wr, offs)
        ref.backward(dy)
        xq, wq = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = scaled_grouped_mm(xq, wq, offs, name)
        out.backward(dy)
        self.assertEqual(out.dtype, x.dtype)
        # rows past offs[-1] are zero, like grouped_mm
        self.assertEqual(out[int(offs[-1]) :].abs().max().item(), 0.0)
        for what, r, o in (("out", ref, out), ("dX", xr.grad, xq.grad), ("dW", wr.grad, wq.grad)):
            db = sqnr(r.detach(), o.detach())
            self.assertGreaterEqual(db, MIN_SQNR_DB, f"{name} {what}: {db:.2f} dB")

    @parametrize("name", ["fp8_rowwise", "mxfp8", "asymmetric"])
    def test_weight_gradient_in_the_weights_layout(self, name):
        # a weight used as x @ w^T (a column-major view of a row-major [E, N, K]) gets its
        # gradient as dY^T x per group, in its own layout (AccumulateGrad then copies
        # nothing), where the recipe quantizes both wgrad operands alike; the same numbers
        x, w, offs, dy = self._problem(k=128, n=96)
        recipe = get_recipe("fp8_rowwise")
        if name == "asymmetric":  # x per column, dY per tensor: the operands stay in place
            rhs = OperandQuant("fp8", -1, -1)
            recipe = recipe.with_overrides(wgrad=GemmQuant(recipe.wgrad.lhs, rhs))
        else:
            recipe = get_recipe(name)
        leaf = w.transpose(-2, -1).contiguous().requires_grad_()
        view = leaf.transpose(-2, -1)
        (dw,) = torch.autograd.grad(scaled_grouped_mm(x, view, offs, recipe), view, dy)
        want = torch.ops.torch_moe.quantized_grouped_mm_wgrad(x, dy, offs, recipe.op_arg())
        if name == "asymmetric":
            self.assertTrue(dw.is_contiguous())
            self.assertEqual(dw, want, atol=0, rtol=0)
        else:
            self.assertEqual(dw.stride(), view.stride())
            # the same dequantized operands summed in the other GEMM's order
            self.assertEqual(dw, want, atol=1e-5, rtol=1e-5)

    def test_bf16_inputs(self):
        x, w, offs, dy = self._problem()
        xb, wb = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        out = scaled_grouped_mm(xb, wb, offs, "fp8_blockwise")
        out.backward(dy.bfloat16())
        self.assertEqual(out.dtype, torch.bfloat16)
        self.assertEqual(xb.grad.dtype, torch.bfloat16)
        self.assertEqual(wb.grad.dtype, torch.bfloat16)
        self.assertGreaterEqual(sqnr(grouped_mm(x, w, offs), out), MIN_SQNR_DB)

    def test_outlier_rows(self):
        # NB: at x1000 tensorwise still measures 28.5 dB (e4m3 spans ~18 binades, the small
        # rows stay normal); it collapses from ~x1e4 (26.4 dB) to x1e5 (7.9 dB).
        x, w, offs, _ = self._problem(tail=0)
        rows = torch.tensor([3, 50, 100])
        x[rows] *= 1e5
        keep = torch.ones(x.shape[0], dtype=torch.bool)
        keep[rows] = False
        ref = grouped_mm(x, w, offs)[keep]
        db = {n: sqnr(ref, scaled_grouped_mm(x, w, offs, n)[keep]) for n in RECIPES}
        for n in ("fp8_rowwise", "fp8_blockwise", "mxfp8", "mxfp8_rceil"):
            self.assertGreaterEqual(db[n], MIN_SQNR_DB, f"{n}: {db}")
            self.assertGreaterEqual(db[n] - db["fp8_tensorwise"], 15.0, f"{n}: {db}")

    @parametrize("gemm", ["forward", "dgrad", "wgrad"])
    def test_bf16_override(self, gemm):
        x, w, offs, dy = self._problem(k=64, n=96)
        base = get_recipe("mxfp8")
        recipe = base.with_overrides(**{gemm: "bf16"})
        self.assertTrue(getattr(recipe, gemm).is_bf16)
        grads = {}
        for r in (base, recipe):
            xq, wq = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = scaled_grouped_mm(xq, wq, offs, r)
            out.backward(dy)
            grads[r.name] = (out.detach(), xq.grad, wq.grad)
        bf = lambda t: t.bfloat16()  # noqa: E731
        # the overridden GEMM is a bf16 GEMM of the bf16-rounded operands: bf16 values,
        # within the bf16 GEMM's rounding bound of the float64 loop (test_grouped_mm)
        operands = {
            "forward": (bf(x), bf(w), False),
            "dgrad": (bf(dy), bf(w).transpose(1, 2), False),
            "wgrad": (bf(x), bf(dy), True),
        }
        idx = {"forward": 0, "dgrad": 1, "wgrad": 2}
        for g, i in idx.items():
            got = grads[recipe.name][i]
            if g == gemm:
                a, b, wgrad = operands[g]
                self.assertEqual(got, got.bfloat16().float(), atol=0, rtol=0)
                assert_gemm_close(self, got.bfloat16(), a, b, offs, g, wgrad=wgrad)
            else:  # the other two GEMMs are untouched
                self.assertEqual(got, grads[base.name][i], atol=0, rtol=0)

    def test_bad_inputs(self):
        x, w, offs, _ = self._problem(k=64, n=96)
        with self.assertRaisesRegex(ValueError, r"unknown .*'fp4'.*fp8_blockwise.*mxfp8"):
            scaled_grouped_mm(x, w, offs, "fp4")
        with self.assertRaisesRegex(TypeError, "share a dtype"):
            scaled_grouped_mm(x, w.bfloat16(), offs, "fp8_rowwise")
        with self.assertRaisesRegex(ValueError, "int32"):
            scaled_grouped_mm(x, w, offs.long(), "fp8_rowwise")
        with self.assertRaisesRegex(ValueError, r"K=64.*K=48"):
            scaled_grouped_mm(x, w[:, :48], offs, "fp8_rowwise")
        with self.assertRaisesRegex(
            ValueError, r"dim 1 has size 48, not a multiple of the block \(32\)"
        ):
            scaled_grouped_mm(x[:, :48], w[:, :48], offs, "mxfp8")
        with self.assertRaisesRegex(ValueError, "unknown GEMM 'fwd'"):
            get_recipe("mxfp8").with_overrides(fwd="bf16")


class TestQuantize(TestCase):
    @parametrize("block", [(-1, -1), (1, -1), (-1, 1), (1, 128), (128, 128)])
    def test_fp8_blocks_padded(self, block):
        x = torch.randn(2, 130, 300)  # neither dim a multiple of 128
        q, s = quantize_fp8(x, block)
        br, bc = (130 if block[0] == -1 else block[0]), (300 if block[1] == -1 else block[1])
        self.assertEqual(q.dtype, torch.float8_e4m3fn)
        self.assertEqual(list(s.shape), [2, math.ceil(130 / br), math.ceil(300 / bc)])
        # each scale is its block's amax / 448
        blk = x[1, :br, :bc] if block != (-1, -1) else x[1]
        self.assertEqual(s[1, 0, 0], blk.abs().max() / 448, atol=0, rtol=0)
        self.assertGreater(sqnr(x, dequantize_fp8(q, s, block)), 28.0)

    @parametrize("block", [(-1, -1), (1, -1), (1, 128), (128, 128)])
    def test_round_trip_fp8_exact(self, block):
        # rows of e4m3 grid values, each 128-block holding +-448, times a power of two 2^k:
        # the scale amax / 448 = 2^k is exact, so q * scale gives x back bit for bit
        grid = e4m3_grid()
        g = torch.Generator().manual_seed(0)
        x = grid[torch.randint(grid.numel(), (6, 256), generator=g)]
        x[:, ::128] = 448.0
        per_row = block in ((1, -1), (1, 128))
        k = torch.arange(-3, 3) if per_row else torch.full((6,), -3)
        x = x * torch.pow(2.0, k.float()).unsqueeze(1)
        q, s = quantize_fp8(x, block)
        self.assertEqual(s.flatten().unique(), torch.pow(2.0, k.float()).unique())
        self.assertEqual(dequantize_fp8(q, s, block), x, atol=0, rtol=0)

    @parametrize("rule", ["floor", "rceil"])
    def test_round_trip_mx_exact(self, rule):
        grid = e4m3_grid()
        grid = grid[grid.abs() <= 448]
        n = grid.numel() - grid.numel() % 32
        blocks = grid[:n].reshape(-1, 32).clone()
        # give each block an amax of exactly 448 * 2^k (k varies), so its scale is 2^k
        ks = torch.arange(blocks.shape[0]) - 5
        blocks[:, 0] = 448.0
        x = blocks * torch.pow(2.0, ks.float()).unsqueeze(1)
        q, s = quantize_mx(x, scale_rule=rule)
        self.assertEqual(s.squeeze(1).long() - 127, ks)
        self.assertEqual(dequantize_mx(q, s), x, atol=0, rtol=0)
        # powers of two within e4m3's 17 binades of the block amax: exact too (fp32 scales)
        p = torch.pow(2.0, torch.randint(-8, 9, (4, 64)).float()) * torch.sign(torch.randn(4, 64))
        q, s = quantize_mx(p, scale_rule=rule, scale_dtype=torch.float32)
        self.assertEqual(dequantize_mx(q, s), p, atol=0, rtol=0)

    def test_e8m0_boundaries(self):
        fmax = torch.finfo(torch.float32).max
        amax = torch.tensor([1.0, 2.0**20, 2.0**-30, 448.0, 448.0 * 2**-10, 448.0 * 2**7,
                             fmax, 2.0**-140, 0.0])  # fmt: skip
        floor = mx_scale_exponent(amax, "floor").tolist()
        rceil = mx_scale_exponent(amax, "rceil").tolist()
        self.assertEqual(floor, [-8, 12, -38, 0, -10, 7, 119, -127, -127])
        self.assertEqual(rceil, [-8, 12, -38, 0, -10, 7, 120, -127, -127])
        # uint8 biased exponents and exact fp32 powers of two (2^-127 is subnormal)
        e = torch.tensor([-127, -126, -1, 0, 1, 127], dtype=torch.int32)
        f = e8m0_to_float((e + 127).to(torch.uint8))
        self.assertEqual(f, torch.ldexp(torch.ones(6, dtype=torch.float64), e.double()).float())
        self.assertTrue(math.isnan(e8m0_to_float(torch.tensor([255], dtype=torch.uint8)).item()))

    def test_e8m0_table_equals_the_formula(self):
        # the CPU's lookup (eager, real tensors) and the formula (fake / meta tensors,
        # compiled graphs, other devices): every code's bits, any shape and layout
        Qm = importlib.import_module("torch_moe.quantization.quantize")
        codes = torch.arange(256, dtype=torch.uint8)
        want = Qm._exp2_exact(codes.to(torch.int32) - 127, nan=codes == 255)
        got = e8m0_to_float(codes)
        self.assertEqual(got.view(torch.int32), want.view(torch.int32), atol=0, rtol=0)
        grid = codes[torch.randperm(256, generator=torch.Generator().manual_seed(2))]
        grid = grid.view(16, 16).t()  # a transposed view
        self.assertEqual(e8m0_to_float(grid).view(torch.int32), want[grid.long()].view(torch.int32))
        self.assertEqual(e8m0_to_float(grid.to("meta")).shape, grid.shape)
        compiled = torch.compile(e8m0_to_float, backend="aot_eager", fullgraph=True)
        self.assertEqual(compiled(grid).view(torch.int32), want[grid.long()].view(torch.int32))

    def test_floor_vs_rceil_exactly_above_mantissa_1_75(self):
        # every fp32 mantissa step of 2^-10 in [1, 2), at several binades
        m = 1.0 + torch.arange(1024, dtype=torch.float32) / 1024
        for p in (-100, -3, 0, 9, 100):
            amax = m * 2.0**p
            diff = mx_scale_exponent(amax, "rceil") - mx_scale_exponent(amax, "floor")
            self.assertEqual(diff, (m > 1.75).int())
        # one ulp either side of 1.75
        a = torch.tensor([1.75, 1.75, 1.75])
        amax = torch.nextafter(a, torch.tensor([1.75, 2.0, 1.0]))  # fp32 ulps
        diff = mx_scale_exponent(amax, "rceil") - mx_scale_exponent(amax, "floor")
        self.assertEqual(diff.tolist(), [0, 1, 0])

    def test_mx_saturation_and_zero_blocks(self):
        x = torch.zeros(3, 32)
        x[0, 0], x[0, 1] = 1.9, -1.9  # floor: scale 2^-8, 1.9 * 256 = 486 -> saturates to 448
        x[1, 0] = torch.finfo(torch.float32).max
        # row 2 all zero
        q, s = quantize_mx(x, scale_rule="floor")
        self.assertEqual(q[0, :2].float().tolist(), [448.0, -448.0])
        self.assertFalse(q.float().isnan().any())
        self.assertEqual(s[2].item(), 0)  # 2^-127
        d = dequantize_mx(q, s)
        self.assertTrue(torch.isfinite(d).all())
        self.assertEqual(d[2], torch.zeros(32), atol=0, rtol=0)
        q, s = quantize_mx(x, scale_rule="rceil")  # rceil: no clipping
        self.assertEqual(dequantize_mx(q, s)[0, :2].tolist(), [1.875, -1.875])  # nearest e4m3
        # FP8 fp32 scales: all-zero block gets scale 1, subnormal amax finite
        z = torch.zeros(2, 4)
        z[1, 0] = 2.0**-140
        q, s = quantize_fp8(z, (1, -1))
        self.assertEqual(s[0].item(), 1.0)
        self.assertTrue(torch.isfinite(dequantize_fp8(q, s, (1, -1))).all())
        big = torch.full((1, 4), torch.finfo(torch.float32).max)
        q, s = quantize_fp8(big)
        self.assertEqual(q.float().abs().max().item(), 448.0)

    @parametrize("block", [32, 128, -1])
    @parametrize("fmt", ["fp8", "mx"])
    def test_jagged_blocks_stay_in_group(self, block, fmt):
        if fmt == "mx" and block == -1:
            block = 32
        sizes = [37, 0, 100, 5, 61]
        offs = make_offs(sizes)
        m = int(offs[-1]) + 3
        x = torch.randn(m, 6)
        # each group has a very different magnitude, so a mixed block would show in its scale
        starts = [0, *offs.tolist()]
        for gi in range(len(sizes)):
            x[starts[gi] : starts[gi + 1]] *= 4.0 ** (3 * gi - 6)
        q, s = quantize_jagged(x, offs, block=block, fmt=fmt, scale_dtype=torch.float32)
        row_block, bound = jagged_block_index(offs, m, block)
        self.assertEqual(s.shape[0], bound)
        # naive: walk each segment (groups, then the tail) block by block
        expect = torch.ones_like(s) if fmt == "fp8" else torch.full_like(s, 2.0**-127)
        nb = 0
        for a, b in itertools.pairwise([0, *offs.tolist(), m]):
            step = (b - a) if block == -1 else block
            for r0 in range(a, b, max(step, 1)):
                rows = slice(r0, min(r0 + step, b))
                self.assertTrue((row_block[rows] == nb).all())
                amax = x[rows].abs().amax(0)
                if fmt == "fp8":
                    expect[nb] = torch.where(amax > 0, amax / 448, 1.0)
                else:
                    expect[nb] = torch.pow(2.0, mx_scale_exponent(amax).double()).float()
                nb += 1
        self.assertEqual(s, expect, atol=0, rtol=0)
        self.assertGreater(sqnr(x, dequantize_jagged(q, s, offs, block=block)), 27.0)

    @parametrize("fmt", ["fp8", "mx"])
    def test_jagged_zero_columns(self, fmt):
        # x [M, 0]: codes [M, 0] and scales [NB, 0], as the reference gives (one segment at
        # least a block long once took the ATen path's view of its rows and failed)
        dtype = torch.uint8 if fmt == "mx" else torch.float32
        for sizes, tail, block in (([2], 0, 1), ([40], 0, 32), ([], 5, 128), ([3, 4], 1, -1)):
            offs, m = make_offs(sizes), sum(sizes) + tail
            block = 32 if fmt == "mx" and block == -1 else block
            x = torch.randn(m, 0)
            want = quantize_jagged_reference(x, offs, block=block, fmt=fmt, scale_dtype=dtype)
            with self.subTest(sizes=sizes, tail=tail, block=block):
                got = quantize_jagged(x, offs, block=block, fmt=fmt, scale_dtype=dtype)
                self.assertEqual([t.shape for t in got], [t.shape for t in want])

    def test_bad_inputs(self):
        x = torch.randn(4, 64)
        with self.assertRaisesRegex(TypeError, "expected x to be one of"):
            quantize_fp8(x.long())
        with self.assertRaisesRegex(TypeError, "expected q to be torch.float8_e4m3fn"):
            dequantize_fp8(x, torch.ones(1, 1))
        with self.assertRaisesRegex(
            ValueError, r"dim 1 has size 48, not a multiple of the block \(32\)"
        ):
            quantize_mx(x[:, :48])
        with self.assertRaisesRegex(ValueError, "scale_rule must be one of"):
            quantize_mx(x, scale_rule="round")
        with self.assertRaisesRegex(ValueError, "block.* must be a positive int or -1"):
            quantize_fp8(x, (0, 32))
        q, s = quantize_fp8(x, (1, 32))
        with self.assertRaisesRegex(ValueError, r"needs scale of shape \[4, 2\], got \[4, 1\]"):
            dequantize_fp8(q, s[:, :1], (1, 32))
        with self.assertRaisesRegex(TypeError, "expected scale to be torch.float32"):
            dequantize_fp8(q, s.half(), (1, 32))
        q, s = quantize_mx(x)
        with self.assertRaisesRegex(ValueError, r"needs scale of shape \[4, 2\], got \[2, 4\]"):
            dequantize_mx(q, s.t())
        with self.assertRaisesRegex(TypeError, "uint8 E8M0 exponents or float32"):
            dequantize_mx(q, s.long())
        offs = make_offs([1, 3])
        q, s = quantize_jagged(x, offs, block=2)
        with self.assertRaisesRegex(ValueError, "needs scale of shape"):
            dequantize_jagged(q, s[:-1], offs, block=2)
        with self.assertRaisesRegex(ValueError, "offs must be non-decreasing"):
            quantize_jagged(x, make_offs([3, -2]), block=2)
        with self.assertRaisesRegex(ValueError, "1D int32"):
            quantize_jagged(x, offs.long(), block=2)


# groups spanning >= 3 blocks of 128 rows (300) and of 32 rows (77), an empty and a one-row one
JAGGED_SIZES = [300, 0, 1, 77, 45]


def _operand64(t, op, along_rows, offs=None):
    """An operand quantized from the recipe's definition (naive.fake_quantize): a [M, k]
    (blocks outer x inner), b [k, n] of one expert (inner x outer), or a wgrad operand
    [M, C] (per tensor, or ``inner`` rows of a column inside each group)."""
    rows, cols = t.shape
    if offs is not None:
        if (op.outer, op.inner) == (-1, -1):
            ids = torch.zeros(rows, cols, dtype=torch.int64)
        else:
            ids = naive.jagged_block_ids(offs, rows, cols, op.inner)
    elif along_rows:
        ids = naive.block_ids(rows, cols, op.inner, op.outer)
    else:
        ids = naive.block_ids(rows, cols, op.outer, op.inner)
    return naive.fake_quantize(t, ids, op.fmt, op.scale_rule)


# recipes no registered one is: operands in different formats, blocks or granularities, so
# that none of their GEMMs decomposes into quantize ops + scaled_grouped_mm
CUSTOM_RECIPES = {
    "mixed_blocks": "forward=fp8:128x128*fp8:128x128;dgrad=fp8:1x-1*fp8:1x128;"
    "wgrad=fp8:-1x-1*fp8:1x-1",
    "mixed_formats": "forward=mx:1x32:rceil*fp8:1x32;dgrad=fp8:1x32*mx:1x32:floor;"
    "wgrad=fp8:1x128*fp8:1x32",
}
# and one that does decompose, with MX blocks of 64 (not the default 32)
MX64 = "forward=mx:1x64:floor*mx:1x64:floor;dgrad=mx:1x32:rceil*mx:1x32:rceil;wgrad=mx:1x64:floor*mx:1x64:floor"


class TestQuantizeFP8CPUKernel(TestCase):
    """``quantize_fp8``'s CPU kernel (block maxima in x's dtype, then chunked convert /
    divide / clamp / cast) equals the reference bit for bit: row- and column-major x,
    batched, every block kind, chunks inside one block row and across many, bf16 and fp32,
    zeros, and shapes the blocks do not tile (the last block row or column padded per
    chunk, matrix by matrix where a batch's row blocks would straddle two matrices; dims
    smaller than their block), without calling the reference."""

    def test_equals_reference(self):
        from unittest import mock

        Qm = importlib.import_module("torch_moe.quantization.quantize")
        gen = torch.Generator().manual_seed(7)
        blocks = [(-1, -1), (1, -1), (1, 32), (128, 128), (-1, 1), (2, 3)]
        calls = []
        reference = Qm.quantize_fp8_reference
        native, none = Qm._fp8_kernels, lambda t: None

        def counted(*args, **kwargs):
            calls.append(args[0].shape)
            return reference(*args, **kwargs)

        for shape, block, dtype, col in itertools.product(
            [(256, 96), (2, 128, 64), (130, 96), (5, 7), (2, 130, 300), (3, 64, 40)],
            blocks,
            (torch.bfloat16, torch.float32),
            (False, True),
        ):
            x = (
                torch.randn(*shape, generator=gen)
                * torch.rand(*shape[:-1], 1, generator=gen).mul(4).exp()
            )
            x[..., 0, 1] = 0
            x = x.to(dtype)
            if col:
                x = x.transpose(-2, -1).contiguous().transpose(-2, -1)
            want_q, want_s = Qm.quantize_fp8_reference(x, block)
            want_q = want_q.contiguous()
            # ATen's chunks of 1 row, 5-7 rows (crossing 128-row blocks), all; None: the
            # native kernel
            for chunk in (5, 480, 2**16, None):
                with (
                    mock.patch.object(Qm, "_QUANT_CHUNK", chunk or 2**16),
                    mock.patch.object(Qm, "quantize_fp8_reference", counted),
                    mock.patch.object(Qm, "_fp8_kernels", native if chunk is None else none),
                ):
                    q, scale = torch.ops.torch_moe.quantize_fp8(x, list(block))
                msg = f"{shape} {block} {dtype} col={col} chunk={chunk}"
                self.assertTrue(q.is_contiguous() and scale.is_contiguous(), msg=msg)
                self.assertEqual(
                    q.view(torch.uint8), want_q.view(torch.uint8), atol=0, rtol=0, msg=msg
                )
                self.assertEqual(scale, want_s, atol=0, rtol=0, msg=msg)
        self.assertEqual(calls, [], msg="the kernel fell back to the reference")

    def test_every_bf16_value(self):
        # bf16 x takes its own form (AVX-512: 32 values a step, unpacked and permuted back;
        # AVX2: 16, unpacked and packed back; an MX block's exact reciprocal): every finite
        # bf16 value, rows of neighbouring magnitudes (their codes across the top binades,
        # subnormal codes and divisors) shuffled within each row, rows of 100 (a 4-value
        # tail past 96) and of 61 (13 past 48); rows with an inf (FP8: an inf divisor,
        # ATen's default NaN), a NaN, -0, all zeros
        Qm = importlib.import_module("torch_moe.quantization.quantize")
        gen = torch.Generator().manual_seed(17)
        bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
        values = bits.view(torch.bfloat16)
        finite = values[values.float().isfinite()]
        finite = finite[finite.float().abs().argsort(stable=True)]
        # specials: infinities, NaNs (quiet and signalling payloads, either sign), zeros, a
        # denormal; rows without NaN (a block's largest magnitude inf), rows whose only
        # NaN is the smallest signalling one
        special = (
            torch.tensor(
                [0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x8000, 0, 0x4040, 0x8001, 0x43E0],
                dtype=torch.int32,
            )
            .to(torch.int16)
            .view(torch.bfloat16)
        )
        no_nan, small_nan = special[[0, 1, 5, 6, 7, 8, 9]], special[[3, 5, 6, 7, 8, 9]]
        # (flush-to-zero: a divisor that is an fp32 denormal reads as zero, 0 / 0 is
        # ATen's negative NaN; an MX divisor of 2^-127 has no reciprocal there)
        fp8_cases = itertools.product(
            (100, 61), [(1, -1), (1, 32), (1, 48), (2, 3), (128, 128), (-1, 1)], (False, True)
        )
        for cols, block, flush in fp8_cases:
            rows = finite.numel() // cols
            x = finite[: rows * cols].view(rows, cols)
            x = x.gather(1, torch.rand(rows, cols, generator=gen).argsort(dim=1))
            extra = special[torch.randint(0, special.numel(), (6, cols), generator=gen)]
            extra[2:4] = small_nan[torch.randint(0, small_nan.numel(), (2, cols), generator=gen)]
            extra[4:] = no_nan[torch.randint(0, no_nan.numel(), (2, cols), generator=gen)]
            extra[4] = 0
            x = torch.cat([x, extra, x[:3].neg()])
            with flush_denormals(flush):
                want_q, want_s = Qm.quantize_fp8_reference(x, block)
                q, scale = torch.ops.torch_moe.quantize_fp8(x, list(block))
            msg = f"fp8 cols={cols} {block} flush={flush}"
            self.assertEqual(
                q.view(torch.uint8), want_q.contiguous().view(torch.uint8), atol=0, rtol=0, msg=msg
            )
            self.assertEqual(scale, want_s, atol=0, rtol=0, msg=msg)
        cases = itertools.product((0, 1), (32, 16, 1), ("floor", "rceil"), (False, True))
        for dim, mx_block, rule, flush in cases:
            cols = 96
            rows = finite.numel() // cols // 32 * 32
            x = finite[: rows * cols].view(rows, cols)
            x = x.gather(1, torch.rand(rows, cols, generator=gen).argsort(dim=1))
            extra = special[torch.randint(0, special.numel(), (96, cols), generator=gen)]
            extra[32:64] = no_nan[torch.randint(0, no_nan.numel(), (32, cols), generator=gen)]
            extra[64:] = small_nan[torch.randint(0, small_nan.numel(), (32, cols), generator=gen)]
            x = torch.cat([x, extra])
            with flush_denormals(flush):
                want_q, want_s = Qm.quantize_mx_reference(
                    x, dim=dim, block=mx_block, scale_rule=rule
                )
                q, scale = torch.ops.torch_moe.quantize_mx(x, dim, mx_block, rule)
            msg = f"mx dim={dim} block={mx_block} {rule} flush={flush}"
            self.assertEqual(q.view(torch.uint8), want_q.view(torch.uint8), atol=0, rtol=0, msg=msg)
            self.assertEqual(scale, want_s, atol=0, rtol=0, msg=msg)

    def test_tall_block_row_on_threads(self):
        # one block row taller than a task (a tensorwise scale's single block, a scale per
        # column over every row): its rows' maxima by torch's threads, merged, then its
        # codes; the largest magnitude in the last rows, one thread and two, in each dtype
        # (bf16 has its own quantizer on AVX-512)
        Qm = importlib.import_module("torch_moe.quantization.quantize")
        gen = torch.Generator().manual_seed(29)
        for (rows, cols), block, threads, dtype in itertools.product(
            [(5000, 40), (3001, 100)],
            [(-1, -1), (-1, 1), (-1, 32)],
            (1, 2),
            (torch.bfloat16, torch.float32, torch.float16),
        ):
            x = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen)
            x[-1, cols // 2] = 300.0
            x = x.to(dtype)
            want_q, want_s = Qm.quantize_fp8_reference(x, block)
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                q, scale = torch.ops.torch_moe.quantize_fp8(x, list(block))
            finally:
                torch.set_num_threads(before)
            msg = f"{rows}x{cols} {block} threads={threads} {dtype}"
            self.assertEqual(
                q.view(torch.uint8), want_q.contiguous().view(torch.uint8), atol=0, rtol=0, msg=msg
            )
            self.assertEqual(scale, want_s, atol=0, rtol=0, msg=msg)


@contextlib.contextmanager
def flush_denormals(flush: bool) -> Iterator[None]:
    """With ``flush``: fp32 denormals flushed to zero (``torch.set_flush_denormal``) on one
    intra-op thread (the mode is the calling thread's: on torch's other threads, ATen's
    ops and ours alike would run without it), both restored after."""
    if not flush:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if not torch.set_flush_denormal(True):
            raise unittest.SkipTest("no flush-to-zero mode on this CPU")
        yield
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


def _fp32_probes():
    """fp32 values for the e4m3 cast: every high half (sign, exponent, top 7 mantissa
    bits: NaNs, infinities, zeros, subnormals) with low halves 0, 0x7FFF, 0x8000, 0xFFFF
    and a random one; and every 97th fp32 from 2^-12 to 512 either sign (all of e4m3's
    rounding boundaries, normal and subnormal, and the clamp's)."""
    hi = torch.arange(65536, dtype=torch.int64) << 16
    lows = [
        0,
        0x7FFF,
        0x8000,
        0xFFFF,
        torch.randint(0, 65536, (65536,), generator=torch.Generator().manual_seed(3)),
    ]
    parts = [hi | low for low in lows]
    dense = torch.arange(0x39800000, 0x44000000, 97, dtype=torch.int64)
    parts += [dense, dense | (1 << 31)]
    return (
        torch.cat(parts).to(torch.int64).bitwise_and(0xFFFFFFFF).to(torch.int32).view(torch.float32)
    )


def _fp8_ops():
    from torch_moe._ops import _native

    mod = _native.kernels()
    return mod if mod is not None and hasattr(mod, "fp8_from_float") else None


class TestFP8NativeConversions(TestCase):
    """The native e4m3 conversions (csrc/fp8_cpu.cpp) give ATen's bits: the saturating
    cast (clamp to +-448, then ``.to(float8_e4m3fn)``) on every fp32 class and every
    rounding boundary, and ``q.float()`` on every code; on strided rows, tails of a
    vector, batched and permuted layouts; they refuse what they do not take, and the
    quantizers' helpers give ATen's results through them."""

    def setUp(self):
        self.mod = _fp8_ops()
        if self.mod is None:
            self.skipTest("the native CPU kernels are not built here")
        if not self.mod.fp8_from_float(torch.zeros(8), torch.empty(8, dtype=torch.float8_e4m3fn)):
            self.skipTest("this build has no AVX2 vectors (the kernels refuse; ATen casts)")

    def test_cast_equals_aten_on_every_class(self):
        x = _fp32_probes()
        want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        for n in (x.numel(), x.numel() - 3):  # whole vectors, then a 5-element tail
            q = torch.empty(n, dtype=torch.float8_e4m3fn)
            self.assertTrue(self.mod.fp8_from_float(x[:n], q))
            self.assertEqual(q.view(torch.uint8), want[:n], atol=0, rtol=0)
        self.assertTrue(torch.isnan(x).any() and torch.isinf(x).any())  # the probes' reach

    def test_cast_does_not_depend_on_flush_to_zero(self):
        # torch.set_flush_denormal sets FTZ and DAZ on the calling thread: the cast and the
        # quantizer (one thread, so they run on it) give the bits they give without them
        # (a cast that read subnormal codes from fp32 denormals would give 0 here)
        x = _fp32_probes()
        want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        tiny = torch.arange(1, 8).float() * 2.0**-9  # every subnormal code, in 8-lane rows
        rows = torch.cat([torch.tensor([448.0]), tiny, -tiny, torch.zeros(1)]).repeat(8, 1)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for flush in (True, False):
                self.assertTrue(torch.set_flush_denormal(flush) or not flush)
                q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
                self.assertTrue(self.mod.fp8_from_float(x, q))
                self.assertEqual(q.view(torch.uint8), want, atol=0, rtol=0, msg=f"{flush}")
                q = torch.empty(rows.shape, dtype=torch.float8_e4m3fn)
                s = torch.empty(8, 1)
                self.assertTrue(self.mod.fp8_quantize_rows(rows, 1, 16, q, s, 0))
                self.assertEqual(s, torch.ones(8, 1))  # 448 / 448: the codes of x itself
                codes = q.view(torch.uint8)[0].tolist()
                self.assertEqual(codes, [0x7E, *range(1, 8), *range(0x81, 0x88), 0], msg=f"{flush}")
        finally:
            torch.set_flush_denormal(False)
            torch.set_num_threads(threads)

    def test_dequantize_equals_aten_on_every_code(self):
        q = torch.arange(256, dtype=torch.uint8).repeat(37).view(torch.float8_e4m3fn)
        out = torch.empty(q.shape)
        self.assertTrue(self.mod.fp8_to_float(q, out))
        self.assertEqual(out.view(torch.int32), q.float().view(torch.int32), atol=0, rtol=0)

    def test_dequantize_scaled_equals_aten(self):
        # every code (NaN ones included) times its block's scale, ATen's product's bits
        # (fp32; bf16: that product rounded as ATen's cast rounds it, ties and NaN):
        # rows of 37 and 80 columns (vector tails of 5 and 16 past 32-code steps), a scale
        # per column, blocks of 7, 16 and 128 (one short block), scale rows by index
        codes = torch.arange(256, dtype=torch.uint8).repeat(12)
        for cols, bc in itertools.product((37, 80), (1, 7, 16, 128)):
            rows = codes.numel() // cols
            q = codes[: rows * cols].view(rows, cols).view(torch.float8_e4m3fn)
            nc = -(-cols // bc)
            scale = torch.rand(rows, nc, generator=torch.Generator().manual_seed(cols)) + 0.5
            scale[:2] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8])[:, None]  # bf16 ties
            want = q.float() * scale.repeat_interleave(bc, 1)[:, :cols]
            for index, dtype in itertools.product(
                (None, torch.arange(rows).flip(0)), (torch.float32, torch.bfloat16)
            ):
                out = torch.full(q.shape, 7.0, dtype=dtype)
                sc = scale if index is None else scale.flip(0)
                self.assertTrue(self.mod.fp8_dequantize_scaled(q, sc, index, 1, bc, out))
                bits = torch.int32 if dtype == torch.float32 else torch.int16
                # (bf16 NaN: 0xFFFF, as ATen's vectorized cast; its scalar tail gives 0x7FC0)
                expect = want.to(dtype).view(bits)
                if dtype == torch.bfloat16:
                    expect = expect.masked_fill(want.isnan(), -1)
                self.assertEqual(out.view(bits), expect, atol=0, rtol=0)

    def test_dequantize_by_powers_of_two_equals_aten(self):
        # MX's scales, powers of two, into bf16 (the exponent added to the values' bits
        # where every product stays normal, 2^-117 to 2^119): every code times every power
        # of two from 2^-149 to 2^127 (products under- and overflowing, bf16 denormals), of
        # either sign, and scales that are not such powers mixed into a step's 32 (NaN, inf,
        # 0, 1.5, 3 * 2^-120): a scale per column, and per block of 32 and of 7
        gen = torch.Generator().manual_seed(23)
        powers = torch.tensor([2.0**e for e in range(-149, 128)])
        # (1 + 2^-7 - 2^-23: a high half that of 1.0, a low half not zero)
        others = torch.tensor(
            [float("nan"), float("inf"), 0, 1.5, 3 * 2.0**-120, 1 + 2.0**-7 - 2.0**-23]
        )
        codes = torch.arange(256, dtype=torch.uint8)
        # (rows of 70 columns: a last step of 6)
        for bc, mixed, cols in itertools.product((1, 32, 7), (False, True), (96, 70)):
            rows = powers.numel() * 2
            q = codes[torch.randint(0, 256, (rows, cols), generator=gen)].view(torch.float8_e4m3fn)
            nc = -(-cols // bc)
            scale = powers.repeat(2)[torch.randperm(rows, generator=gen)][:, None].repeat(1, nc)
            scale[rows // 2 :] = scale[rows // 2 :].neg()
            if bc == 1:  # each row's scales: its power, and others drawn from all of them
                # (every other row: from those the exponent addition takes)
                pick = torch.randint(0, powers.numel(), (rows, nc), generator=gen)
                pick[::2] = pick[::2] % (119 + 118) + (149 - 117)
                keep = torch.rand(rows, nc, generator=gen) < 0.5
                keep[::2] = False
                scale = torch.where(keep, scale, powers[pick]) * scale.sign()
            if mixed:
                at = torch.randint(0, nc, (rows,), generator=gen)
                extra = others[torch.randint(0, others.numel(), (rows,), generator=gen)]
                scale[torch.arange(rows), at] = extra
            want = q.float() * scale.repeat_interleave(bc, 1)[:, :cols]
            out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
            self.assertTrue(self.mod.fp8_dequantize_scaled(q, scale, None, 1, bc, out))
            expect = want.bfloat16().view(torch.int16).masked_fill(want.isnan(), -1)
            msg = f"bc={bc} mixed={mixed} cols={cols}"
            self.assertEqual(out.view(torch.int16), expect, atol=0, rtol=0, msg=msg)

    def test_layouts(self):
        gen = torch.Generator().manual_seed(5)
        base = torch.randn(6, 9, 37, generator=gen) * 300
        views = {
            "strided rows": base[:, 1:8, :29],
            "batched, leading dims permuted": base.permute(1, 0, 2)[:, :, 3:30],
            "one row": base[0, 0],
        }
        for name, x in views.items():
            q = torch.full(x.shape, 7.0).to(torch.float8_e4m3fn)
            q = q.transpose(0, -2).contiguous().transpose(0, -2) if q.dim() == 3 else q
            self.assertTrue(self.mod.fp8_from_float(x, q), msg=name)
            want = x.clamp(-448, 448).to(torch.float8_e4m3fn)
            self.assertEqual(q.view(torch.uint8), want.view(torch.uint8), atol=0, rtol=0, msg=name)
            back = torch.empty(x.shape)
            self.assertTrue(self.mod.fp8_to_float(q, back), msg=name)
            self.assertEqual(back, q.float(), atol=0, rtol=0, msg=name)
        for x, q in (
            (torch.empty(0, 5), torch.empty(0, 5, dtype=torch.float8_e4m3fn)),
            (torch.empty(4, 0), torch.empty(4, 0, dtype=torch.float8_e4m3fn)),
        ):
            self.assertTrue(self.mod.fp8_from_float(x, q))
            self.assertTrue(self.mod.fp8_to_float(q, x))

    def test_refuses_what_it_does_not_take(self):
        x = torch.randn(8, 16)
        cases = [
            (x.t(), torch.empty(16, 8, dtype=torch.float8_e4m3fn)),  # a strided last dim
            (x.bfloat16(), torch.empty(8, 16, dtype=torch.float8_e4m3fn)),  # not fp32
            (x, torch.empty(8, 15, dtype=torch.float8_e4m3fn)),  # another shape
            (x, torch.empty(8, 16, dtype=torch.uint8)),  # not e4m3
            (torch.tensor(1.0), torch.tensor(1.0).to(torch.float8_e4m3fn)),  # 0-d
        ]
        for src, out in cases:
            before = out.view(torch.uint8).clone() if out.dtype != torch.uint8 else out.clone()
            self.assertFalse(self.mod.fp8_from_float(src, out))
            after = out.view(torch.uint8) if out.dtype != torch.uint8 else out
            self.assertEqual(after, before, atol=0, rtol=0)
        q = torch.zeros(8, 16, dtype=torch.float8_e4m3fn)
        self.assertFalse(self.mod.fp8_to_float(q.t(), torch.empty(16, 8)))
        self.assertFalse(self.mod.fp8_to_float(q, torch.empty(8, 16, dtype=torch.float16)))
        self.assertFalse(self.mod.fp8_to_float(q, torch.empty(8, 15, dtype=torch.bfloat16)))

    def test_codes_to_bf16_exactly(self):
        # e4m3's values are bf16 values: every code's ATen value, in bf16 (NaN codes NaN),
        # whole vectors and a tail, strided rows; through _fp8_to_float with q's strides
        Qm = importlib.import_module("torch_moe.quantization.quantize")
        q = torch.arange(256, dtype=torch.uint8).repeat(37).view(torch.float8_e4m3fn)
        for n in (q.numel(), q.numel() - 5):
            out = torch.empty(n, dtype=torch.bfloat16)
            self.assertTrue(self.mod.fp8_to_float(q[:n], out))
            self.assertEqual(out, q[:n].float().bfloat16(), atol=0, rtol=0)
            self.assertEqual(out.float(), q[:n].float(), atol=0, rtol=0)  # exact
        rows = q[:2000].view(40, 50)[::3, 7:]
        out = torch.empty(rows.shape, dtype=torch.bfloat16)
        self.assertTrue(self.mod.fp8_to_float(rows, out))
        self.assertEqual(out, rows.float().bfloat16(), atol=0, rtol=0)
        cols = q[:1200].view(30, 40).t()  # column-major: its dense permutation converted
        got = Qm._fp8_to_float(cols, torch.bfloat16)
        self.assertEqual(got.stride(), cols.stride())
        self.assertEqual(got, cols.float().bfloat16(), atol=0, rtol=0)

    def test_block_quantizer_equals_reference_on_special_values(self):
        """quantize_fp8's CPU kernel in its native form (each block row's maxima, then its
        codes) equals the reference bit for bit where blocks hold NaN, infinities, only zeros,
        only negative values, denormal maxima (a denormal scale) and values past 448
        times their scale's rounding; every input dtype, blocks that do not tile a row."""
        from unittest import mock

        Qm = importlib.import_module("torch_moe.quantization.quantize")
        gen = torch.Generator().manual_seed(11)
        x = torch.randn(9, 100, generator=gen) * 3
        x[0, 3] = float("nan")
        x[1, 40] = float("inf")
        x[2, 0:32] = -x[2, 0:32].abs()  # a block of negative values only
        x[3] = 0.0
        x[3, 50] = -0.0
        x[4, :] *= 1e-39  # denormal values, a denormal scale
        x[5, 7] = float("-inf")
        x[5, 8] = float("inf")
        x[6, 1] = 448.0 * 1e20  # one huge value: the others round to small codes
        for dtype, block in itertools.product(
            (torch.float32, torch.bfloat16, torch.float16),
            [(1, -1), (1, 32), (1, 7), (1, 128), (2, 3), (4, 32), (-1, -1), (-1, 1), (128, 128)],
        ):
            xd = x.to(dtype)
            want_q, want_s = Qm.quantize_fp8_reference(xd, block)
            spy = mock.MagicMock(wraps=self.mod)
            with mock.patch.object(Qm, "_fp8_kernels", lambda t, spy=spy: spy):
                q, s = torch.ops.torch_moe.quantize_fp8(xd, list(block))
            msg = f"{dtype} {block}"
            self.assertTrue(spy.fp8_quantize_rows.called, msg=msg)
            self.assertEqual(q.view(torch.uint8), want_q.view(torch.uint8), atol=0, rtol=0, msg=msg)
            self.assertEqual(s, want_s, atol=0, rtol=0, equal_nan=True, msg=msg)

    def test_mx_quantizer_equals_reference_on_special_values(self):
        """quantize_mx's CPU kernel in its native form equals the reference bit for bit
        (codes and E8M0 exponents) on blocks with NaN, infinities (frexp's exponent 0),
        zeros, denormal maxima (exponent -127), maxima whose mantissa is just over and at
        0.875 (rceil's step) and maxima past 448 * 2^127; both rules, blocks along the
        last dim and along rows, every input dtype."""
        from unittest import mock

        Qm = importlib.import_module("torch_moe.quantization.quantize")
        gen = torch.Generator().manual_seed(12)
        x = torch.randn(64, 96, generator=gen) * 3
        x[0, 3] = float("nan")
        x[1, 40] = float("inf")
        x[2, 64:96] = float("-inf")
        x[3] = 0.0
        x[4, :] *= 1e-39
        x[5, 0:32] = 0.875 * 2.0**3  # mantissa exactly 0.875: rceil keeps floor's exponent
        x[6, 0:32] = torch.nextafter(torch.tensor(0.875 * 2.0**3), torch.tensor(10.0))
        x[7, 5] = 3e38
        for dtype, dim, rule in itertools.product(
            (torch.float32, torch.bfloat16, torch.float16), (-1, 0), ("floor", "rceil")
        ):
            xd = x.to(dtype)
            want_q, want_s = Qm.quantize_mx_reference(xd, dim=dim, block=32, scale_rule=rule)
            spy = mock.MagicMock(wraps=self.mod)
            with mock.patch.object(Qm, "_fp8_kernels", lambda t, spy=spy: spy):
                q, s = torch.ops.torch_moe.quantize_mx(xd, dim, 32, rule)
            msg = f"{dtype} dim={dim} {rule}"
            self.assertTrue(spy.fp8_quantize_rows.called, msg=msg)
            self.assertEqual(q.view(torch.uint8), want_q.view(torch.uint8), atol=0, rtol=0, msg=msg)
            self.assertEqual(s, want_s, atol=0, rtol=0, msg=msg)

    def test_quantizer_helpers(self):
        from unittest import mock

        Qm = importlib.import_module("torch_moe.quantization.quantize")
        x = _fp32_probes()[::41][:96576].reshape(-1, 16)
        for native in (True, False):
            with mock.patch.object(
                Qm, "_fp8_kernels", Qm._fp8_kernels if native else lambda t: None
            ):
                src = x.clone()
                q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
                Qm._to_fp8_into(q, src)
                want = x.clamp(-448, 448).to(torch.float8_e4m3fn)
                self.assertEqual(q.view(torch.uint8), want.view(torch.uint8), atol=0, rtol=0)
                if native:  # the native cast leaves its input as it was
                    self.assertEqual(src.view(torch.int32), x.view(torch.int32), atol=0, rtol=0)
                codes = torch.arange(256, dtype=torch.uint8).repeat(6).view(torch.float8_e4m3fn)
                for qv in (
                    codes.view(48, 32),
                    codes.view(48, 32).t(),
                    codes.view(4, 12, 32).permute(2, 0, 1),
                ):
                    got = Qm._fp8_to_float(qv)
                    self.assertEqual(got.stride(), qv.stride())
                    self.assertEqual(
                        got.view(torch.int32), qv.float().view(torch.int32), atol=0, rtol=0
                    )


class TestQuantizeMXCPUKernel(TestCase):
    """``quantize_mx``'s CPU kernel (chunked convert / block maxima / divide / clamp / cast
    of a contiguous x viewed around the blocked dim) equals the reference bit for bit:
    contiguous and K-major (last two dims transposed) x, blocks along every dim, both
    scale rules, blocks of 1 / 16 / 32, chunks of one row or block row, a few, and all,
    bf16 and fp32, zero blocks and rows over 16 binades; layouts the chunks do not cover
    (a strided slice) take the reference."""

    def test_equals_reference(self):
        from unittest import mock

        Qm = importlib.import_module("torch_moe.quantization.quantize")
        native, none = Qm._fp8_kernels, lambda t: None
        gen = torch.Generator().manual_seed(11)
        cases = 0
        for shape, dim, block, dtype, layout, rule in itertools.product(
            [(64, 96), (2, 64, 32), (3, 2, 32, 5), (96,), (0, 64)],
            (0, 1, -2, -1),
            (32, 16, 1),
            (torch.bfloat16, torch.float32),
            ("contiguous", "k_major", "sliced"),
            ("floor", "rceil"),
        ):
            if len(shape) == 1 and layout != "contiguous":
                continue
            x = (
                torch.randn(*shape, generator=gen)
                * torch.rand(*shape[:-1], 1, generator=gen).mul(11).exp()
            )
            x.view(-1)[: 2 * block] = 0  # a zero block along the last dim
            x = x.to(dtype)
            if layout == "k_major":
                x = x.transpose(-2, -1).contiguous().transpose(-2, -1)
            elif layout == "sliced":
                x = torch.cat([x, x], dim=-1)[..., ::2]
            try:
                d, _ = Qm.check_quantize_mx(x, dim, block, rule)
            except ValueError:  # the blocked dim is not a multiple of the block
                continue
            want_q, want_s = Qm.quantize_mx_reference(x, dim=d, block=block, scale_rule=rule)
            for chunk in (7, 300, 2**19, None):  # ATen's chunks; None: the native kernel
                with (
                    mock.patch.object(Qm, "_QUANT_CHUNK", chunk or 2**19),
                    mock.patch.object(Qm, "_fp8_kernels", native if chunk is None else none),
                ):
                    q, scale = torch.ops.torch_moe.quantize_mx(x, dim, block, rule)
                msg = f"{shape} dim={dim} block={block} {dtype} {layout} {rule} chunk={chunk}"
                self.assertTrue(q.is_contiguous() and scale.is_contiguous(), msg=msg)
                self.assertEqual(
                    q.view(torch.uint8), want_q.view(torch.uint8), atol=0, rtol=0, msg=msg
                )
                self.assertEqual(scale, want_s, atol=0, rtol=0, msg=msg)
                cases += 1
        self.assertGreater(cases, 500)

    def test_k_major_weight_keeps_no_fp32_copy(self):
        # an expert weight read K-major ([E, N, K] view of a contiguous [E, K, N]), four
        # chunks large: no allocation the size of a bf16 (or fp32) copy of x, only e4m3
        # tensors and one chunk's fp32
        from torch.profiler import ProfilerActivity, profile

        Qm = importlib.import_module("torch_moe.quantization.quantize")
        x = torch.randn(8, 512, Qm._QUANT_CHUNK // 1024).bfloat16().transpose(-2, -1)
        torch.ops.torch_moe.quantize_mx(x, -1, 32, "floor")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            torch.ops.torch_moe.quantize_mx(x, -1, 32, "floor")
        largest = max(e.cpu_memory_usage for e in prof.events())
        self.assertLess(largest, 2 * x.numel())
        self.assertGreaterEqual(largest, x.numel())  # the e4m3 output


class TestQuantizeJaggedCPUKernel(TestCase):
    """``quantize_jagged``'s CPU kernel, native and by ATen's chunks, equals the reference
    bit for bit: both formats and
    scale rules, blocks of 128 / 32 / 5 / 1 rows and one per group (-1), empty groups,
    one-row groups, rows past the last group, zero rows, bf16 and fp32, and chunks that
    take every path: pieces of a large segment (one pass, and the two-pass maxima of a
    block taller than a chunk) and chunks of several small segments (the scatter)."""

    def test_equals_reference(self):
        from unittest import mock

        Qm = importlib.import_module("torch_moe.quantization.quantize")
        kernels, none = Qm._fp8_kernels, lambda t: None
        ran: list[bool] = []  # the native kernel's answers (False: ATen's chunks ran)

        class Spy:
            def __init__(self, mod):
                self.mod = mod

            def __getattr__(self, name):
                return getattr(self.mod, name)

            def fp8_quantize_jagged(self, *args):
                ran.append(bool(self.mod.fp8_quantize_jagged(*args)))
                return ran[-1]

        def native(t):
            mod = kernels(t)
            return None if mod is None else Spy(mod)

        gen = torch.Generator().manual_seed(13)
        cases = 0
        for sizes, block, (fmt, rule), dtype, tail in itertools.product(
            ([7, 0, 33, 1, 0, 50], [0, 0, 0], [120], [1, 1, 1, 1, 90]),
            (128, 32, 5, 1, -1),
            (("fp8", "floor"), ("mx", "floor"), ("mx", "rceil")),
            (torch.bfloat16, torch.float32),
            (0, 3),
        ):
            offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
            rows, cols = int(offs[-1]) + tail, 16
            x = (
                torch.randn(rows, cols, generator=gen)
                * torch.rand(rows, 1, generator=gen).mul(10).exp()
            )
            x[2:4] = 0
            x = x.to(dtype)
            want_q, want_s = Qm.quantize_jagged_reference(
                x,
                offs,
                block=block,
                fmt=fmt,
                scale_rule=rule,
                scale_dtype=torch.float32 if fmt == "fp8" else torch.uint8,
            )
            # ATen's chunks of 3 rows, 40 rows, everything; None: the native kernel
            for chunk in (3 * cols, 40 * cols, 2**19, None):
                with (
                    mock.patch.object(Qm, "_QUANT_CHUNK", chunk or 2**19),
                    mock.patch.object(Qm, "_fp8_kernels", native if chunk is None else none),
                ):
                    q, scale = torch.ops.torch_moe.quantize_jagged(x, offs, block, fmt, rule)
                msg = f"{sizes} tail={tail} block={block} {fmt} {rule} {dtype} chunk={chunk}"
                self.assertEqual(
                    q.view(torch.uint8), want_q.view(torch.uint8), atol=0, rtol=0, msg=msg
                )
                self.assertEqual(scale, want_s, atol=0, rtol=0, msg=msg)
                cases += 1
        self.assertEqual(cases, 4 * 5 * 3 * 2 * 2 * 4)
        if Qm.native_fp8_conversions():  # one call per case, each taken
            self.assertEqual(ran, [True] * (cases // 4))

    def test_native_kernel_refuses_what_it_does_not_take(self):
        Qm = importlib.import_module("torch_moe.quantization.quantize")
        mod = Qm._fp8_kernels(torch.empty(0))
        if mod is None or not Qm.native_fp8_conversions():
            self.skipTest("the native e4m3 kernels do not run here (not built, or no AVX2)")
        x = torch.randn(10, 8)
        offs = torch.tensor([3, 3, 9], dtype=torch.int32)

        def call(x=x, offs=offs, block=4, scale_rows=5, q=None, rule=0):
            q = torch.zeros(x.shape, dtype=torch.float8_e4m3fn) if q is None else q
            scale = torch.full((scale_rows, x.shape[1]), 7.0)
            before = (q.view(torch.uint8).clone(), scale.clone())
            done = mod.fp8_quantize_jagged(x, offs, block, q, scale, rule)
            untouched = torch.equal(q.view(torch.uint8), before[0]) and torch.equal(
                scale, before[1]
            )
            return done, untouched

        # blocks of 4: [0, 3) one, [3, 3) none, [3, 9) two, the row past the groups one
        self.assertEqual(call(), (True, False))
        cases = {
            "scale rows too few": dict(scale_rows=3),
            "offs decreasing": dict(offs=torch.tensor([3, 2, 9], dtype=torch.int32)),
            "offs past the rows": dict(offs=torch.tensor([3, 3, 11], dtype=torch.int32)),
            "offs int64": dict(offs=offs.long()),
            "offs 2-D": dict(offs=offs.view(1, 3)),
            "block 0": dict(block=0),
            "x transposed": dict(x=x.t(), q=torch.zeros(8, 10, dtype=torch.float8_e4m3fn)),
            "MX rule with fp32 scales": dict(rule=1),
        }
        for name, kwargs in cases.items():
            self.assertEqual(call(**kwargs), (False, True), msg=name)


class TestRecipeEmulation(TestCase):
    """quantized_grouped_mm, _dgrad and _wgrad (the CPU emulation every kernel must equal)
    against the recipe written out in the test: quantize per block (naive.fake_quantize),
    dequantize, float64 GEMM per group; within the fp32 accumulation bound (tolerances.py),
    so a wrong block, a block crossing a group end or a 1% scale error fails."""

    @parametrize("recipe", [*RECIPES, *CUSTOM_RECIPES, "mx64"])
    def test_ops_equal_the_recipe_definition(self, recipe):
        r = get_recipe(CUSTOM_RECIPES.get(recipe, MX64 if recipe == "mx64" else recipe))
        if recipe in CUSTOM_RECIPES:  # these take the non-decomposed emulation
            self.assertFalse(any(S.decomposable(g) for g in (r.forward, r.dgrad)))
            self.assertFalse(S.decomposable_wgrad(r.wgrad))
        offs = make_offs(JAGGED_SIZES)
        self.assertGreaterEqual(max(JAGGED_SIZES), 2 * 128 + 1)  # three 128-row blocks
        self.assertGreaterEqual(77, 2 * 32 + 1)  # three 32-row blocks
        self.assertIn(0, JAGGED_SIZES)
        self.assertIn(1, JAGGED_SIZES)
        g = torch.Generator().manual_seed(7)
        recipe = r.op_arg()
        m, k, n, e = int(offs[-1]) + 3, 64, 128, len(JAGGED_SIZES)
        # rows over six binades: per-row and per-block scales differ from per-tensor ones
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).mul(4).exp()
        w = torch.randn(e, k, n, generator=g) / 8
        dy = torch.randn(m, n, generator=g)
        ops = torch.ops.torch_moe
        f32 = torch.float32
        cases = {
            "forward": (
                ops.quantized_grouped_mm(x, w, offs, recipe),
                _operand64(x, r.forward.lhs, False),
                torch.stack([_operand64(w[i], r.forward.rhs, True) for i in range(e)]),
                k,
            ),
            "dgrad": (
                ops.quantized_grouped_mm_dgrad(dy, w, offs, recipe),
                _operand64(dy, r.dgrad.lhs, False),
                torch.stack([_operand64(w[i].t(), r.dgrad.rhs, True) for i in range(e)]),
                n,
            ),
        }
        for name, (got, a64, b64, red) in cases.items():
            exact = naive.grouped_mm64(a64, b64, offs)
            products = naive.grouped_mm64(a64.abs(), b64.abs(), offs)
            bound = tolerances.gemm_bound(products, red, exact, f32, f32)
            tolerances.assert_within(self, got, exact, bound, f"{recipe} {name}")
        got = ops.quantized_grouped_mm_wgrad(x, dy, offs, recipe)
        x64 = _operand64(x, r.wgrad.lhs, False, offs)
        dy64 = _operand64(dy, r.wgrad.rhs, False, offs)
        exact = naive.grouped_mm_wgrad64(x64, dy64, offs)
        products = naive.grouped_mm_wgrad64(x64.abs(), dy64.abs(), offs)
        bound = tolerances.gemm_bound(products, max(JAGGED_SIZES), exact, f32, f32)
        tolerances.assert_within(self, got, exact, bound, f"{recipe} wgrad")

    @parametrize("recipe", ["fp8_blockwise", "mxfp8", "fp8_tensorwise"])
    def test_references_equal_the_definition(self, recipe):
        """The plain-PyTorch references of the two ops over quantized operands (the oracles
        of the CUDA kernels) against naive.py's dequantization and float64 GEMM."""
        r = RECIPES[recipe]
        offs = make_offs([9, 0, 1, 40])
        g = torch.Generator().manual_seed(2)
        x = torch.randn(53, 64, generator=g)
        w = torch.randn(4, 64, 32, generator=g) / 8
        dy = torch.randn(53, 32, generator=g)
        qa, sa = S.quantize_lhs(x, r.forward.lhs)
        qb, sb = S.quantize_rhs(w, r.forward.rhs)
        blocks = (r.forward.lhs.inner, r.forward.rhs.outer)
        got = S.scaled_grouped_mm_reference(qa, qb, sa, sb, offs, *blocks, torch.bfloat16)
        self.assertEqual(got.dtype, torch.bfloat16)
        a64 = naive.dequantize_blocks(qa, sa, r.forward.lhs.outer, r.forward.lhs.inner)
        b64 = torch.stack(
            [naive.dequantize_blocks(qb[i], sb[i], r.forward.rhs.inner, r.forward.rhs.outer)
             for i in range(4)]
        )  # fmt: skip
        exact = naive.grouped_mm64(a64, b64, offs)
        products = naive.grouped_mm64(a64.abs(), b64.abs(), offs)
        bound = tolerances.gemm_bound(products, 64, exact, torch.float32, torch.bfloat16)
        tolerances.assert_within(self, got, exact, bound, f"{recipe} reference")
        op = r.wgrad.lhs
        (qx, sx), (qdy, sdy) = (S.quantize_wgrad_operand(t, offs, op) for t in (x, dy))
        got = S.scaled_grouped_mm_wgrad_reference(qx, qdy, sx, sdy, offs, op.inner, torch.float32)
        x64 = naive.dequantize_jagged(qx, sx, offs, op.inner)
        dy64 = naive.dequantize_jagged(qdy, sdy, offs, op.inner)
        exact = naive.grouped_mm_wgrad64(x64, dy64, offs)
        products = naive.grouped_mm_wgrad64(x64.abs(), dy64.abs(), offs)
        bound = tolerances.gemm_bound(products, 40, exact, torch.float32, torch.float32)
        tolerances.assert_within(self, got, exact, bound, f"{recipe} wgrad reference")

    def test_jagged_and_wgrad_errors(self):
        """The messages name the function, the argument and its value."""
        from torch_moe.quantization import quantize as Q

        x = torch.randn(40, 64)
        offs = make_offs([10, 30])
        with self.assertRaisesRegex(
            ValueError, r"^quantize_jagged: scale_dtype must be .*, got torch.float16"
        ):
            Q.quantize_jagged_reference(x, offs, block=32, fmt="mx", scale_dtype=torch.float16)
        # fp8 scales are float32 whatever scale_dtype says (documented)
        _, s = Q.quantize_jagged_reference(x, offs, block=32, fmt="fp8", scale_dtype=torch.uint8)
        self.assertEqual(s.dtype, torch.float32)
        with self.assertRaisesRegex(
            TypeError,
            r"^dequantize_jagged: expected q to be torch.float8_e4m3fn, got torch.float32",
        ):
            Q.dequantize_jagged_reference(x, s, offs, block=32)
        q, s = Q.quantize_jagged_reference(x, offs, block=32)
        wgrad = torch.ops.torch_moe.scaled_grouped_mm_wgrad
        with self.assertRaisesRegex(
            ValueError,
            r"^scaled_grouped_mm_wgrad: expected a \[M, K\] and b \[M, N\] .* with the same M, "
            r"got \[40, 64\] torch.float8_e4m3fn and \[39, 32\]",
        ):
            wgrad(q, q[:39, :32], s, s[:, :32], offs, 32, torch.float32)
        with self.assertRaisesRegex(
            ValueError,
            r"^scaled_grouped_mm_wgrad: expected fp32 \(or uint8 E8M0\) scales of one dtype, "
            r"got torch.float32 and torch.uint8",
        ):
            wgrad(q, q, s, s.to(torch.uint8), offs, 32, torch.float32)

    def test_backward_of_one_input(self):
        """Only x, or only w, requires grad: that one gradient, equal to the dgrad / wgrad
        op's, and none for the other."""
        offs = make_offs([5, 0, 12])
        x, w, dy = torch.randn(19, 64), torch.randn(3, 64, 32) / 8, torch.randn(19, 32)
        ops = torch.ops.torch_moe
        for needs in ("x", "w"):
            xs, ws = x.clone().requires_grad_(needs == "x"), w.clone().requires_grad_(needs == "w")
            ops.quantized_grouped_mm(xs, ws, offs, "mxfp8").backward(dy)
            if needs == "x":
                self.assertIsNone(ws.grad)
                want = ops.quantized_grouped_mm_dgrad(dy, w, offs, "mxfp8")
                self.assertEqual(xs.grad, want, atol=0, rtol=0)
            else:
                self.assertIsNone(xs.grad)
                want = ops.quantized_grouped_mm_wgrad(x, dy, offs, "mxfp8")
                self.assertEqual(ws.grad, want, atol=0, rtol=0)

    def test_dgrad_and_wgrad_errors(self):
        ops = torch.ops.torch_moe
        offs = make_offs([3, 5])
        x, w, dy = torch.randn(8, 32), torch.randn(2, 32, 16), torch.randn(8, 16)
        with self.assertRaisesRegex(
            ValueError, r"^quantized_grouped_mm_dgrad: dy is \[M, N=12\] but w is \[E, K=32, N=16\]"
        ):
            ops.quantized_grouped_mm_dgrad(dy[:, :12], w, offs, "fp8_rowwise")
        with self.assertRaisesRegex(ValueError, "^quantized_grouped_mm_dgrad: unknown"):
            ops.quantized_grouped_mm_dgrad(dy, w, offs, "fp4")
        with self.assertRaisesRegex(
            ValueError,
            r"^quantized_grouped_mm_wgrad: expected x \[M, K\] and dy \[M, N\] with the same M, "
            r"got \[8, 32\] and \[7, 16\]",
        ):
            ops.quantized_grouped_mm_wgrad(x, dy[:7], offs, "fp8_rowwise")
        with self.assertRaisesRegex(TypeError, "^quantized_grouped_mm_wgrad: expected x and dy"):
            ops.quantized_grouped_mm_wgrad(x, dy.double(), offs, "fp8_rowwise")
        with self.assertRaisesRegex(ValueError, "^quantized_grouped_mm_wgrad: unknown"):
            ops.quantized_grouped_mm_wgrad(x, dy, offs, "fp4")


class TestQuantizeChecks(TestCase):
    def test_scale_dtype_messages(self):
        from torch_moe.quantization import quantize as Q

        q = torch.zeros(4, 32, dtype=torch.float8_e4m3fn)
        offs = torch.tensor([4], dtype=torch.int32)
        with self.assertRaisesRegex(
            TypeError, r"^dequantize_jagged: expected scale as uint8 E8M0 exponents"
        ):
            Q.check_dequantize_jagged(q, torch.zeros(1, 32, dtype=torch.float16), offs, 128)
        with self.assertRaisesRegex(
            TypeError, r"^dequantize_mx: expected scale as uint8 E8M0 exponents"
        ):
            Q.check_dequantize_mx(q, torch.zeros(4, 1, dtype=torch.float16), -1, 32)
        with self.assertRaisesRegex(TypeError, r"^dequantize_mx: expected q"):
            Q.check_dequantize_mx(q.float(), torch.zeros(4, 1), -1, 32)

    def test_jagged_messages(self):
        from torch_moe.quantization import quantize as Q

        x = torch.randn(4, 8)
        with self.assertRaisesRegex(ValueError, r"^quantize_jagged: scale_rule must be one of"):
            Q.check_quantize_jagged(x, torch.tensor([4], dtype=torch.int32), 2, "mx", "bogus")
        with self.assertRaisesRegex(
            ValueError, r"^jagged_block_index: expected offs to be 1D int32"
        ):
            Q.jagged_block_index(torch.tensor([4]), 4, 2)
        with self.assertRaisesRegex(ValueError, r"^quantize_jagged: "):
            Q.jagged_block_index(torch.tensor([5], dtype=torch.int32), 4, 2)

    def test_mx_block_of_one_is_valid(self):
        from torch_moe.quantization import quantize as Q

        self.assertEqual(Q.check_quantize_mx(torch.randn(2, 3), -1, 1, "floor"), (1, [2, 3]))

    def test_exp2_exact_at_the_normal_boundary(self):
        from torch_moe.quantization import quantize as Q

        e = torch.tensor([-127, -126, -125, 0, 127], dtype=torch.int32)
        want = torch.tensor([2.0**-127, 2.0**-126, 2.0**-125, 1.0, 2.0**127])
        self.assertEqual(Q._exp2_exact(e), want, atol=0, rtol=0)

    def test_fp8_table_built_afresh(self):
        # the e4m3 -> fp32 table is built once per device: build it again here
        from torch_moe.quantization import quantize as Q

        q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
        saved = dict(Q._FP8_VALUES)
        Q._FP8_VALUES.clear()
        try:
            got = Q._fp8_to_float(q)
        finally:
            Q._FP8_VALUES.clear()
            Q._FP8_VALUES.update(saved)
        self.assertEqual(got, q.float(), atol=0, rtol=0, equal_nan=True)

    def test_jagged_default_block_is_128(self):
        from torch_moe.quantization import quantize as Q

        x, offs = torch.randn(300, 4), torch.tensor([300], dtype=torch.int32)
        q, s = Q.quantize_jagged_reference(x, offs)
        q128, s128 = Q.quantize_jagged_reference(x, offs, block=128)
        self.assertEqual(s.shape, s128.shape)
        self.assertEqual(s, s128, atol=0, rtol=0)
        self.assertEqual(q.view(torch.uint8), q128.view(torch.uint8))


instantiate_parametrized_tests(TestScaledGroupedMM)
instantiate_parametrized_tests(TestQuantize)
instantiate_parametrized_tests(TestRecipeEmulation)

if __name__ == "__main__":
    run_tests()
