"""The scaled grouped GEMM ops (torch_moe::scaled_grouped_mm, scaled_grouped_mm_wgrad,
quantized_grouped_mm and its dgrad / wgrad), the SwiGLU activation op, recipe specs, and
``import torch_moe`` without Triton.

Oracles: test/naive.py dequantizes every operand from the format's definition (element
times the scale of its block, found by integer division) and multiplies in float64; the
tolerance is the fp32 accumulation bound of test/tolerances.py, so a wrong block, a
shifted row or a 1% scale error fails.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import subprocess
import sys
import textwrap
from unittest import mock

import naive
import tolerances
import torch
from test_cpu_probe import assert_gemm_within, intra_op_threads
from torch.library import opcheck
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe  # noqa: F401
from torch_moe._ops import _cpu_probe as P
from torch_moe._ops import _native
from torch_moe.quantization import (
    RECIPES,
    get_recipe,
    quantize_fp8_reference,
    quantize_jagged_reference,
    quantize_mx_reference,
)
from torch_moe.quantization import quantize as Q

S = importlib.import_module("torch_moe.quantization.scaled_grouped_mm")
ops = torch.ops.torch_moe
F32 = torch.float32

# groups with an empty one, a one-row one and one spanning three 128-row blocks
SIZES = [300, 0, 1, 77, 45]


def make_offs(sizes):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def _wgrad_operands(g, offs, k, n, gen):
    """A weight gradient's operands for recipe GEMM ``g`` (x [M, k] with rows of varied
    magnitude, dy [M, n]; M = offs' last end + 2): their codes and scales, and the
    dequantized fp32 values (qx, sx, qdy, sdy, x_f, dy_f)."""
    m = int(offs[-1]) + 2
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen).mul(3).exp()
    dy = torch.randn(m, n, generator=gen)
    qx, sx = S.quantize_wgrad_operand(x, offs, g.lhs)
    qdy, sdy = S.quantize_wgrad_operand(dy, offs, g.rhs)
    x_f = S._dequantize_wgrad_operand(qx, sx, offs, g.lhs.inner)
    dy_f = S._dequantize_wgrad_operand(qdy, sdy, offs, g.lhs.inner)
    return qx, sx, qdy, sdy, x_f, dy_f


def _quantize_ref(t, op, along_rows):
    """Reference quantization of t's last two dims, blocks along rows (B) or columns (A)."""
    if op.fmt == "mx":
        dim = -2 if along_rows else -1
        return quantize_mx_reference(t, dim=dim, block=op.inner, scale_rule=op.scale_rule)
    block = (op.inner, op.outer) if along_rows else (op.outer, op.inner)
    return quantize_fp8_reference(t, block)


def _operands(gemm, m, k, n, e, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).mul(4).exp()
    b = torch.randn(e, k, n, generator=g) / k**0.5
    qa, sa = _quantize_ref(a, gemm.lhs, along_rows=False)
    qb, sb = _quantize_ref(b, gemm.rhs, along_rows=True)
    return a, b, qa, sa, qb, sb


def _exact_and_bound(qa, sa, qb, sb, offs, gemm, out_dtype):
    lhs, rhs = gemm.lhs, gemm.rhs
    a64 = naive.dequantize_blocks(qa, sa, lhs.outer, lhs.inner)
    b64 = torch.stack(
        [naive.dequantize_blocks(qb[i], sb[i], rhs.inner, rhs.outer) for i in range(qb.shape[0])]
    )
    exact = naive.grouped_mm64(a64, b64, offs)
    products = naive.grouped_mm64(a64.abs(), b64.abs(), offs)
    return exact, tolerances.gemm_bound(products, qa.shape[1], exact, F32, out_dtype)


class TestRecipeSpec(TestCase):
    def test_round_trip(self):
        for name, r in RECIPES.items():
            self.assertIs(get_recipe(r.spec), r)
            self.assertEqual(r.op_arg(), name)
        custom = RECIPES["fp8_blockwise"].with_overrides(wgrad="bf16")
        self.assertEqual(
            custom.op_arg(),
            "forward=fp8:1x128*fp8:128x128;dgrad=fp8:1x128*fp8:128x128;wgrad=bf16",
        )
        back = get_recipe(custom.op_arg())
        self.assertEqual(
            (back.forward, back.dgrad, back.wgrad), (custom.forward, custom.dgrad, custom.wgrad)
        )
        self.assertEqual(
            RECIPES["mxfp8_rceil"].spec.split(";")[0], "forward=mx:1x32:rceil*mx:1x32:rceil"
        )

    def test_bad_specs(self):
        for spec, msg in [
            ("forward=fp8:1x-1*fp8:1x-1", "needs forward, dgrad and wgrad"),
            ("forward=bf16;dgrad=bf16;wgrad=fp8:1*fp8:1x1", "bad operand 'fp8:1'"),
            ("forward=bf16;dgrad=bf16;wgrad=fp8:1x1", "must be bf16 or <lhs>\\*<rhs>"),
            ("fwd=bf16;dgrad=bf16;wgrad=bf16", "expected forward=...;dgrad=...;wgrad=..."),
            ("forward=bf16;dgrad=bf16;wgrad=int4:1x32*int4:1x32", "bad operand 'int4:1x32'"),
        ]:
            with self.assertRaisesRegex(ValueError, msg):
                get_recipe(spec)
        with self.assertRaisesRegex(ValueError, "unknown low-precision recipe 'fp4'"):
            get_recipe("fp4")


class TestScaledGroupedMMCPUKernels(TestCase):
    """The CPU kernels' fp32 form dequantizes in chunks of whole groups and multiplies group
    by group; it must equal the whole-operand form (dequantize all of a and b, then the
    grouped GEMM) bit for bit, across chunk boundaries, empty groups, a group larger than a
    chunk and rows past the last group. (Where this CPU multiplies bf16 natively, bf16
    outputs take the codes' bf16 GEMMs instead; where it does not, the fp32 form's native
    pieces: each tested on its own.)"""

    CASES = ([7, 0, 33, 1, 0, 50], [0, 0, 0], [120], [1, 1, 1, 1, 1, 1, 1, 1, 90])

    @parametrize("recipe", [r for r in RECIPES if RECIPES[r].forward.lhs is not None])
    def test_forward_and_dgrad_equal_whole_operands(self, recipe):

        gen = torch.Generator().manual_seed(5)
        for sizes in self.CASES:
            offs = make_offs(sizes)
            m, k, n = int(offs[-1]) + 3, 64, 96
            x = torch.randn(m, k, generator=gen)
            w = torch.randn(len(sizes), k, n, generator=gen) / 8
            for name, g in (("forward", RECIPES[recipe].forward), ("dgrad", RECIPES[recipe].dgrad)):
                b = w if name == "forward" else torch.randn(len(sizes), k, n, generator=gen)
                qa, sa = S.quantize_lhs(x, g.lhs)
                qb, sb = S.quantize_rhs(b, g.rhs)
                a_f, b_f = S._dequantize_operands(qa, qb, sa, sb, g.lhs.inner, g.rhs.outer)
                for out_dtype in (F32, torch.bfloat16):
                    want = S.grouped_mm(a_f, b_f, offs).to(out_dtype)
                    for chunk in (1, 64 * 96, 2**18):  # one group per chunk .. all in one
                        with (
                            mock.patch.object(S, "_CPU_CHUNK_ELEMS", chunk),
                            mock.patch.object(S, "_codes_in_bf16", lambda *a: False),
                            mock.patch.object(S, "_blocks_in_bf16", lambda *a: False),
                            mock.patch.object(S, "dequantizes_pieces", lambda *a: False),
                        ):
                            got = ops.scaled_grouped_mm(
                                qa, qb, sa, sb, offs, g.lhs.inner, g.rhs.outer, out_dtype
                            )
                        msg = f"{recipe} {name} {sizes} {out_dtype} chunk {chunk}"
                        self.assertEqual(got, want, atol=0, rtol=0, msg=msg)

    @parametrize("recipe", [r for r in RECIPES if RECIPES[r].wgrad.lhs is not None])
    def test_wgrad_equals_whole_operands(self, recipe):

        g = RECIPES[recipe].wgrad
        gen = torch.Generator().manual_seed(6)
        for sizes in self.CASES:
            offs = make_offs(sizes)
            qx, sx, qdy, sdy, a_f, b_f = _wgrad_operands(g, offs, 32, 64, gen)
            for out_dtype in (F32, torch.bfloat16):
                want = S.grouped_mm_wgrad(a_f, b_f, offs).to(out_dtype)
                for chunk in (1, 64 * 64, 2**18):
                    with (
                        mock.patch.object(S, "_CPU_CHUNK_ELEMS", chunk),
                        mock.patch.object(S, "_wgrad_codes_in_bf16", lambda *a: False),
                        mock.patch.object(S, "_blocks_in_bf16", lambda *a: False),
                        mock.patch.object(S, "dequantizes_pieces", lambda *a: False),
                    ):
                        got = ops.scaled_grouped_mm_wgrad(
                            qx, qdy, sx, sdy, offs, g.lhs.inner, out_dtype
                        )
                    msg = f"{recipe} {sizes} {out_dtype} chunk {chunk}"
                    self.assertEqual(got, want, atol=0, rtol=0, msg=msg)

    def test_native_dequantization_equals_aten(self):
        """The dequantizers' native form (one pass: the table's value times its block's
        scale) gives ATen's table-and-``mul_`` bits for every recipe's operands: per-row,
        per-tensor and 1 x 128 activations, row- and column-major weights in 128 x 128 or
        per-column blocks, MX's powers of two, and the jagged wgrad operands through the
        ops, where the kernel runs (spied)."""

        Qm = importlib.import_module("torch_moe.quantization.quantize")
        mod = Qm._fp8_kernels(torch.empty(0))
        if mod is None or not Qm.native_fp8_conversions():
            self.skipTest("the native e4m3 kernels do not run here")
        gen = torch.Generator().manual_seed(4)
        offs = make_offs([7, 0, 150, 1, 33])
        m, k, n = int(offs[-1]) + 3, 256, 160
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen).mul(8).exp()
        w = torch.randn(5, k, n, generator=gen) / 8
        dy = torch.randn(m, n, generator=gen)
        for recipe in ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8"):
            r = RECIPES[recipe]
            qx, sx = S.quantize_wgrad_operand(x, offs, r.wgrad.lhs)
            qdy, sdy = S.quantize_wgrad_operand(dy, offs, r.wgrad.rhs)
            wg = (qx, qdy, sx, sdy)
            for name, g, b in (("forward", r.forward, w), ("dgrad", r.dgrad, w.transpose(-2, -1))):
                qa, sa = S.quantize_lhs(x if name == "forward" else dy, g.lhs)
                qb, sb = S.quantize_rhs(b, g.rhs)
                # the kernel takes every operand (a refusal would fall back to ATen unseen)
                msg = f"{recipe} {name}"
                self.assertIsNotNone(
                    S._dequantize_native(qa, S._fp32_scales(sa), 1, g.lhs.inner), msg=msg
                )
                sbf = S._fp32_scales(sb)
                for e in range(qb.shape[0]):
                    self.assertIsNotNone(
                        S._dequantize_native(qb[e], sbf[e], g.lhs.inner, g.rhs.outer), msg=msg
                    )
                got = []
                for native in (True, False):
                    spy = mock.MagicMock(wraps=mod)
                    kernels = (lambda t, spy=spy: spy) if native else (lambda t: None)
                    with mock.patch.object(Qm, "_fp8_kernels", kernels):
                        got.append(S._dequantize_operands(qa, qb, sa, sb, g.lhs.inner, g.rhs.outer))
                        got.append(ops.scaled_grouped_mm_wgrad(*wg, offs, r.wgrad.lhs.inner, F32))
                    if native:
                        self.assertTrue(spy.fp8_dequantize_scaled.called, msg=f"{recipe} {name}")
                (a1, b1), wg1, (a0, b0), wg0 = got
                msg = f"{recipe} {name}"
                self.assertEqual(b1.stride(), b0.stride(), msg=msg)
                for u, v in ((a1, a0), (b1, b0), (wg1, wg0)):
                    self.assertEqual(
                        u.view(torch.int32), v.view(torch.int32), atol=0, rtol=0, msg=msg
                    )

    def test_stacked_experts_dequantize_in_one_call(self):
        """Every recipe's weights (row- and column-major experts, 128 x 128 and per-column
        blocks, MX's along k) dequantize in one native call for all experts, into fp32 and
        bf16, with the per-expert calls' bits; other layouts (a strided slice of experts)
        take the per-expert calls."""

        Qm = importlib.import_module("torch_moe.quantization.quantize")
        mod = Qm._fp8_kernels(torch.empty(0))
        if mod is None or not Qm.native_fp8_conversions():
            self.skipTest("the native e4m3 kernels do not run here")
        gen = torch.Generator().manual_seed(6)
        w = torch.randn(5, 256, 160, generator=gen) / 8
        for recipe, name, dtype in itertools.product(
            ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8"),
            ("forward", "dgrad", "sliced"),
            (torch.float32, torch.bfloat16),
        ):
            g = RECIPES[recipe].forward if name == "forward" else RECIPES[recipe].dgrad
            b = w if name == "forward" else w.transpose(-2, -1)
            qb, sb = S.quantize_rhs(b, g.rhs)
            sbf = S._fp32_scales(sb)
            if name == "sliced":  # every other expert: neither layout stacks
                qb, sbf = qb[::2], sbf[::2]
            want = torch.empty_like(qb, dtype=dtype)
            for e in range(qb.shape[0]):
                S._dequantize_native(qb[e], sbf[e], g.lhs.inner, g.rhs.outer, out=want[e])
            spy = mock.MagicMock(wraps=mod)
            with mock.patch.object(Qm, "_fp8_kernels", lambda t, spy=spy: spy):
                got = S._dequantize_rhs_native(qb, sbf, g.lhs.inner, g.rhs.outer, dtype)
            msg = f"{recipe} {name} {dtype}"
            self.assertIsNotNone(got, msg=msg)
            calls = spy.fp8_dequantize_scaled.call_count
            self.assertEqual(calls, qb.shape[0] if name == "sliced" else 1, msg=msg)
            if name != "sliced":  # (a dense copy of a slice: empty_like's strides)
                self.assertEqual(got.stride(), qb.stride(), msg=msg)
            bits = torch.int32 if dtype == torch.float32 else torch.int16
            self.assertEqual(got.view(bits), want.view(bits), atol=0, rtol=0, msg=msg)

    def test_mx_multiplies_in_bf16_where_native(self):
        """MX operands with a bf16 output: every dequantized element is a bf16 value, and
        the CPU kernels run the bf16 grouped GEMMs on them (the whole-operand form in bf16,
        bit for bit), where this CPU multiplies bf16 natively; the fp32 form otherwise and
        for an fp32 output. (Here by bf16 copies of the operands: the pieces that the
        native GEMM's route converts in cache instead are the next test's.)"""

        r = RECIPES["mxfp8"]
        gen = torch.Generator().manual_seed(9)
        offs = make_offs([7, 0, 90, 1, 33])
        m, k, n = int(offs[-1]) + 3, 256, 96
        # columns over many binades: the blocks' scales differ by up to 2^24 along a row,
        # so that the fp32 sums round, and in another order differently
        x = torch.randn(m, k, generator=gen) * torch.rand(1, k, generator=gen).mul(24).exp2()
        w = torch.randn(5, k, n, generator=gen) / 8
        dy = torch.randn(m, n, generator=gen)
        qa, sa = S.quantize_lhs(x, r.forward.lhs)
        qb, sb = S.quantize_rhs(w, r.forward.rhs)
        a_f, b_f = S._dequantize_operands(qa, qb, sa, sb, r.forward.lhs.inner, r.forward.rhs.outer)
        for t in (a_f, b_f):
            self.assertEqual(t.bfloat16().float(), t, atol=0, rtol=0)  # exact in bf16
        qx, sx = S.quantize_wgrad_operand(x, offs, r.wgrad.lhs)
        qdy, sdy = S.quantize_wgrad_operand(dy, offs, r.wgrad.rhs)
        x_f = S._dequantize_wgrad_operand(qx, sx, offs, r.wgrad.lhs.inner)
        dy_f = S._dequantize_wgrad_operand(qdy, sdy, offs, r.wgrad.lhs.inner)
        bf = torch.bfloat16
        native = S.cpu_compute_dtype(bf) == bf
        for native_here in (native, False):
            with mock.patch.object(
                S, "cpu_compute_dtype", lambda dt, n=native_here: dt if n else F32
            ):
                self.assertEqual(S._mx_in_bf16(sa, sb, bf), native_here)
                self.assertFalse(S._mx_in_bf16(sa, sb, F32))
                kernels = S.Q._fp8_kernels
                # the dequantization straight into bf16 by the native kernel, or by ATen's
                # ops by rows / experts, or at once
                for chunk, kern in ((1, kernels), (1, lambda t: None), (2**18, lambda t: None)):
                    # (the bits rarely tell bf16 sums from fp32 ones once rounded to bf16:
                    # the GEMMs' operand dtypes say which form ran)
                    with (
                        mock.patch.object(S, "_mx_pieces", lambda *args: False),
                        mock.patch.object(S.Q, "_fp8_kernels", kern),
                        mock.patch.object(S, "_CPU_CHUNK_ELEMS", chunk),
                        mock.patch.object(S, "grouped_mm", wraps=S.grouped_mm) as mm,
                        mock.patch.object(S, "grouped_mm_wgrad", wraps=S.grouped_mm_wgrad) as wg,
                    ):
                        got = ops.scaled_grouped_mm(qa, qb, sa, sb, offs, 32, 1, bf)
                        got_w = ops.scaled_grouped_mm_wgrad(qx, qdy, sx, sdy, offs, 32, bf)
                    ran = [c.args[0].dtype for c in mm.call_args_list + wg.call_args_list]
                    self.assertEqual(ran, [bf, bf] if native_here else [])
                    if native_here:
                        want = S.grouped_mm(a_f.to(bf), b_f.to(bf), offs)
                        want_w = S.grouped_mm_wgrad(x_f.to(bf), dy_f.to(bf), offs)
                    else:
                        want = S.grouped_mm(a_f, b_f, offs).to(bf)
                        want_w = S.grouped_mm_wgrad(x_f, dy_f, offs).to(bf)
                    msg = f"native={native_here} chunk={chunk} kernels={kern is kernels}"
                    self.assertEqual(got, want, atol=0, rtol=0, msg=msg)
                    self.assertEqual(got_w, want_w, atol=0, rtol=0, msg=msg)
        mod = S.Q._fp8_kernels(qa)
        if native and mod is not None and S.Q.native_fp8_conversions():  # the kernel wrote
            # the bf16 operands itself
            spy = mock.MagicMock(wraps=mod)
            with (
                mock.patch.object(S, "_mx_pieces", lambda *args: False),
                mock.patch.object(S.Q, "_fp8_kernels", lambda t: spy),
            ):
                ops.scaled_grouped_mm(qa, qb, sa, sb, offs, 32, 1, bf)
                ops.scaled_grouped_mm_wgrad(qx, qdy, sx, sdy, offs, 32, bf)
            outs = [c.args[-1].dtype for c in spy.fp8_dequantize_scaled.call_args_list]
            self.assertEqual(set(outs), {bf})
        # the per-tensor fp8 scales are not powers of two: the fp32 form
        g = RECIPES["fp8_tensorwise"].forward
        _, sa8 = S.quantize_lhs(x, g.lhs)
        _, sb8 = S.quantize_rhs(w, g.rhs)
        self.assertFalse(S._mx_in_bf16(sa8, sb8, bf))
        self.assertFalse(S._mx_in_bf16(sa, sb8, bf))  # one operand MX: the other is not exact
        self.assertFalse(S._mx_in_bf16(sa8, sb, bf))

    def test_mx_copies_dequantize_only_busy_experts(self):
        """The MX copies route (a few rows per expert: decode) dequantizes only the experts
        that have rows, their scales included (the whole stack was 100x a T=1 step's
        GEMMs), and no grouped GEMM kernel reads the others' memory: with every new
        buffer filled with NaN first, bit for bit the whole stack's product."""

        bf = torch.bfloat16
        if S.cpu_compute_dtype(bf) != bf or not S.Q.native_fp8_conversions():
            self.skipTest("no native bf16 GEMM or e4m3 kernels here")
        r = RECIPES["mxfp8"]
        gen = torch.Generator().manual_seed(12)
        offs = make_offs([0, 5, 0, 0, 7, 0])  # busy experts 1 and 4
        m, k, n = int(offs[-1]) + 2, 64, 96
        x = torch.randn(m, k, generator=gen)
        w = torch.randn(6, n, k, generator=gen).transpose(-2, -1)  # nn.Linear's layout
        qa, sa = S.quantize_lhs(x, r.forward.lhs)
        qb, sb = S.quantize_rhs(w, r.forward.rhs)
        a_f, b_f = S._dequantize_operands(qa, qb, sa, sb, r.forward.lhs.inner, r.forward.rhs.outer)
        want = S.grouped_mm(a_f.to(bf), b_f.to(bf), offs)
        mod = S.Q._fp8_kernels(qa)
        spy = mock.MagicMock(wraps=mod)
        empty_like = torch.empty_like

        def poisoned(t, *args, **kwargs):
            return empty_like(t, *args, **kwargs).fill_(float("nan"))

        with (
            mock.patch.object(S, "_mx_pieces", lambda *args: False),
            mock.patch.object(S, "_mx_few_rows", lambda *args: None),  # (the copies' route)
            mock.patch.object(S.Q, "_fp8_kernels", lambda t: spy),
            mock.patch.object(S.torch, "empty_like", poisoned),
        ):
            got = ops.scaled_grouped_mm(qa, qb, sa, sb, offs, 32, 1, bf)
        calls = spy.fp8_dequantize_scaled.call_args_list
        self.assertEqual(len(calls), 3)  # a, then experts 1 and 4
        self.assertEqual(got, want, atol=0, rtol=0)
        # where the few-rows kernel's plain form multiplies the copies, the codes times
        # their scales in registers instead (fp8_mx_few_rows_mm), no expert dequantized:
        # the copies' bits
        # (the threaded kernel's way, on two threads: its own bits, not the few-rows form's)
        ends = S.check_offs_values("scaled_grouped_mm", offs, m)
        for few_gemm, threads_mm in (("native", "aten"), ("aten", "aten"), ("aten", "native")):
            spy.reset_mock()
            with (
                P.force(few_gemm=few_gemm, threads_mm=threads_mm, row_split="one"),
                intra_op_threads(2),
                mock.patch.object(S._native, "kernels", return_value=spy),
                mock.patch.object(S.Q, "_fp8_kernels", lambda t: spy),
            ):
                way = S.whole_way(qa.to(bf), qb.to(bf), ends, False)
                got = ops.scaled_grouped_mm(qa, qb, sa, sb, offs, 32, 1, bf)
                want_here = S.grouped_mm(a_f.to(bf), b_f.to(bf), offs)
            self.assertEqual(got, want_here, atol=0, rtol=0)
            ran = spy.fp8_mx_few_rows_mm.called  # (its kernel: AVX512-BF16's)
            self.assertEqual(ran, way == "few" and S.native_gemm_ready(bf), msg=few_gemm)
            self.assertEqual(way == "few", few_gemm == "native" and mod is not None)
            if ran:
                self.assertEqual(len(spy.fp8_dequantize_scaled.call_args_list), 1)  # a only
        # groups of 40 rows the threaded kernel's way (forced): not the few-rows form
        offs40 = make_offs([40, 0, 40])
        x40, w40 = torch.randn(80, 256, generator=gen), torch.randn(3, 256, 256, generator=gen)
        qa40, sa40 = S.quantize_lhs(x40, r.forward.lhs)
        qb40, sb40 = S.quantize_rhs(w40.transpose(-2, -1), r.forward.rhs)
        a40, b40 = S._dequantize_operands(qa40, qb40, sa40, sb40, 32, 1)
        spy.reset_mock()
        forced = dict(few_gemm="aten", threads_mm="native", row_split="one", gemm_kernel="native")
        with (
            P.force(**forced, grouped_mm="loop"),
            intra_op_threads(2),
            mock.patch.object(S._native, "kernels", return_value=spy),
        ):
            way = S.whole_way(qa40.to(bf), qb40.to(bf), [40, 40, 80], False)
            got = ops.scaled_grouped_mm(qa40, qb40, sa40, sb40, offs40, 32, 1, bf)
            self.assertEqual(got, S.grouped_mm(a40.to(bf), b40.to(bf), offs40), atol=0, rtol=0)
        self.assertFalse(spy.fp8_mx_few_rows_mm.called, msg=way)
        # the busy experts' scales gathered in the kernel's layout: the native kernel takes
        # each (no fallback to the chunked fp32 form), bit for bit
        part = S._dequantize_rhs_native(qb, sb, 32, 1, bf, [1, 4])
        self.assertIsNotNone(part)
        for e in (1, 4):
            self.assertEqual(part[e], b_f[e].to(bf), atol=0, rtol=0)

    def test_mx_pieces_in_the_native_gemm(self):
        """Where ``grouped_mm`` multiplies the dequantized bf16 operands by the threaded
        kernel's native GEMM (the probe forced so), MX's GEMMs convert each piece of the
        codes times its scales as the GEMM takes it (``fp8_mx_mm`` / ``_wgrad``: no bf16
        copies of the operands): bit for bit the copies' ``grouped_mm`` /
        ``grouped_mm_wgrad``, with experts row- and column-major, empty groups, rows past
        the last group, two column pieces, a group over the kernel's piece of rows (1100
        at K = 2048), a NaN scale (E8M0 255) and scales whose products overflow, on one
        and two threads; where
        ``grouped_mm`` takes another route (``threads_mm=aten``), the copies and its bits.
        The kernels refuse operands they do not take, leaving the output as it was."""

        from torch_moe._ops import _cpu_probe, _native

        bf = torch.bfloat16
        if not S.bf16_gemms_native() or not S.native_gemm_ready(bf):
            self.skipTest("no native bf16 GEMM here")
        mod = _native.kernels()
        r = RECIPES["mxfp8"]
        gen = torch.Generator().manual_seed(21)
        # (N = 300: two of the kernel's column pieces)
        cases = ((make_offs([7, 0, 90, 1, 33]), 256, 300), (make_offs([3, 1100, 0]), 2048, 40))
        for offs, k, n in cases:
            E, m = offs.shape[0], int(offs[-1]) + 3
            x = torch.randn(m, k, generator=gen) * torch.rand(1, k, generator=gen).mul(20).exp2()
            dy = torch.randn(m, n, generator=gen)
            qx, sx = S.quantize_wgrad_operand(x, offs, r.wgrad.lhs)
            qdy, sdy = S.quantize_wgrad_operand(dy, offs, r.wgrad.rhs)
            sx[1, 5], sdy[0, 3] = 255, 254  # a NaN scale; 2^127: products past fp32
            for cols in (False, True):
                w = torch.randn(E, k, n, generator=gen)
                if cols:
                    w = w.transpose(1, 2).contiguous().transpose(1, 2)
                qa, sa = S.quantize_lhs(x, r.forward.lhs)
                qb, sb = S.quantize_rhs(w, r.forward.rhs)
                sa[2, 1], sb[0, 1, 2] = 255, 254
                a_h, b_h = (S._dequantize_operands(qa, qb, sa, sb, 32, 1)[i].to(bf) for i in (0, 1))
                x_h = S._dequantize_wgrad_operand(qx, sx, offs, 32).to(bf)
                dy_h = S._dequantize_wgrad_operand(qdy, sdy, offs, 32).to(bf)
                ways = (("native", "as_is"), ("native", "transpose"), ("aten", "as_is"))
                for threads, (kernel, wgrad_a) in itertools.product((1, 2), ways):
                    msg = f"k={k} cols={cols} threads={threads} {kernel} {wgrad_a}"
                    spy = mock.MagicMock(wraps=mod)
                    # the threaded kernel's native GEMM (its operands as they are, more
                    # rows than the few-rows kernel's), the weight gradient's x^T read or
                    # copied by pieces; aten: torch._grouped_mm where aligned, else the loop
                    probe = dict(threads_mm=kernel, gemm_kernel="native", grouped_mm="torch")
                    probe.update(layout="as_is", few_gemm="aten", wgrad_a=wgrad_a)
                    with intra_op_threads(threads), _cpu_probe.force(probe):
                        want = S.grouped_mm(a_h, b_h, offs)
                        want_w = S.grouped_mm_wgrad(x_h, dy_h, offs)
                        with mock.patch.object(S._native, "kernels", lambda s=spy: s):
                            got = ops.scaled_grouped_mm(qa, qb, sa, sb, offs, 32, 1, bf)
                            got_w = ops.scaled_grouped_mm_wgrad(qx, qdy, sx, sdy, offs, 32, bf)
                    pieces = kernel == "native"  # (else grouped_mm's own route: the copies)
                    self.assertEqual(spy.fp8_mx_mm.called, pieces, msg)
                    self.assertEqual(spy.fp8_mx_mm_wgrad.called, pieces, msg)
                    self.assertTrue(got.isnan().any() and got_w.isnan().any(), msg)
                    self.assertEqual(got, want, atol=0, rtol=0, equal_nan=True, msg=msg)
                    self.assertEqual(got_w, want_w, atol=0, rtol=0, equal_nan=True, msg=msg)
        # what the kernels refuse: another dtype, scales of other sizes, an fp32 output
        offs = make_offs([4, 4])
        qa, qb = (
            torch.zeros(8, 64, dtype=torch.float8_e4m3fn),
            torch.zeros(2, 64, 16, dtype=torch.float8_e4m3fn),
        )
        sa, sb = torch.ones(8, 2), torch.ones(2, 2, 16)
        for args in (
            (qa.to(bf), qb, sa, sb, torch.empty(8, 16, dtype=bf)),
            (qa, qb, sa[:, :1].contiguous(), sb, torch.empty(8, 16, dtype=bf)),
            (qa, qb, sa, sb[:, :, :8].contiguous(), torch.empty(8, 16, dtype=bf)),
            (qa, qb, sa, sb, torch.empty(8, 16)),
        ):
            out = args[-1].fill_(7)
            self.assertFalse(mod.fp8_mx_mm(*args[:4], offs, 32, out))
            self.assertTrue(bool((out == 7).all()))
        w_out = torch.full((2, 64, 16), 7.0, dtype=bf)
        qy = torch.zeros(8, 16, dtype=torch.float8_e4m3fn)
        self.assertFalse(
            mod.fp8_mx_mm_wgrad(qa, qy, torch.ones(1, 64), torch.ones(1, 16), offs, 4, w_out)
        )
        self.assertFalse(
            mod.fp8_mx_mm_wgrad(qa, qy, torch.ones(2, 64), torch.ones(2, 32), offs, 4, w_out)
        )
        self.assertTrue(bool((w_out == 7).all()))

    def test_streamed_outputs_are_the_cached_ones(self):
        """The kernels on the codes (``fp8_block_scaled_mm`` / ``_wgrad``, ``fp8_mx_mm`` /
        ``_wgrad``) write a bf16 output past this core's L2 by non-temporal stores where
        asked (``stream_out``, the probe's ``out_stream``): the same bits as plain stores,
        a ragged last line and rows past the last group included."""

        mod = _native.kernels()
        bf = torch.bfloat16
        if mod is None or not S.native_gemm_ready(bf) or not mod.bf16_mm_streams(4 << 20):
            self.skipTest("no native bf16 GEMM here, or 4 MiB outputs fit its L2")
        gen = torch.Generator().manual_seed(5)

        def codes(*shape):
            return torch.randn(*shape, generator=gen).mul(8).to(torch.float8_e4m3fn)

        def scales(*shape):
            return torch.rand(*shape, generator=gen).add(0.5)

        offs = make_offs([700, 0, 900, 437])  # 2037 rows: a ragged last line (N odd)
        M, K, N, E = 2048 + 5, 256, 1027, 4
        qa, qb, qy = codes(M, K), codes(E, K, N), codes(M, N)
        calls = {
            "fp8_block_scaled_mm": lambda out, st: mod.fp8_block_scaled_mm(
                qa, qb, scales(M, 2), S._panel_padded(scales(E, 2, N), N), offs, 128, out, st
            ),
            "fp8_mx_mm": lambda out, st: mod.fp8_mx_mm(
                qa, qb, scales(M, 8), scales(E, 8, N), offs, 32, out, st
            ),
        }
        nb = -(-700 // 128) + -(-900 // 128) + -(-437 // 128)
        wcalls = {
            "fp8_block_scaled_mm_wgrad": lambda out, st: mod.fp8_block_scaled_mm_wgrad(
                qa, qy, scales(nb, K), S._panel_padded(scales(nb, N), N), offs, 128, out, st
            ),
            "fp8_mx_mm_wgrad": lambda out, st: mod.fp8_mx_mm_wgrad(
                qa, qy, scales(nb * 4, K), scales(nb * 4, N), offs, 32, out, st
            ),
        }
        for name, call in (*calls.items(), *wcalls.items()):
            shape = (E, K, N) if name.endswith("wgrad") else (M, N)
            outs = []
            for stream in (False, True):
                gen.manual_seed(17)  # the same scales both times
                out = torch.full(shape, 3.0, dtype=bf)
                self.assertTrue(call(out, stream), name)
                outs.append(out)
            self.assertEqual(outs[1], outs[0], atol=0, rtol=0, msg=name)
            self.assertFalse(bool((outs[0] == 3.0).all()), name)

    def test_codes_multiply_in_bf16_where_native(self):
        """Scales constant along the reduction (one K block: rowwise, tensorwise, blockwise
        with K <= 128; a weight gradient's per-expert or per-tensor scales) and a bf16
        output: where torch_moe's native bf16 GEMM runs here, the e4m3 codes themselves are
        multiplied in bf16 by the block-scaled kernel, each of the GEMM's 512-k blocks of
        fp32 sums times the product of its row's and its column's scale: with one block
        bit for bit ``(sums * (row scale * column scale)).to(bf16)`` over the groups (empty
        ones, a ragged column block, rows past the last group zero) on one and two
        threads; exact on exact sums over several blocks (K and a group past 512); the fp32
        form elsewhere (no native GEMM, an fp32 output, scales along K, MX)."""

        bf = torch.bfloat16
        gen = torch.Generator().manual_seed(13)
        sizes = [7, 0, 90, 1, 33]
        offs = make_offs(sizes)
        E, m, n = len(sizes), int(offs[-1]) + 3, 200  # 200: a 128-column block and 72
        native = S.native_gemm_ready(bf)
        spy = mock.MagicMock(wraps=_native.kernels())
        for recipe, k in (("fp8_rowwise", 96), ("fp8_tensorwise", 64), ("fp8_blockwise", 128)):
            g = RECIPES[recipe].forward
            x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen).mul(8).exp2()
            w = torch.randn(E, k, n, generator=gen) * torch.rand(1, 1, n, generator=gen)
            qa, sa = S.quantize_lhs(x, g.lhs)
            qb, sb = S.quantize_rhs(w, g.rhs)
            self.assertEqual(S._codes_in_bf16(sa, sb, bf), native, msg=recipe)
            self.assertFalse(S._codes_in_bf16(sa, sb, F32))
            if not native:  # (the fp32 form: the tests above)
                continue
            sb_n = S._expand(sb.expand(E, 1, sb.shape[2])[:, 0, :], 1, g.rhs.outer, n)
            want = torch.zeros(m, n, dtype=bf)
            start = 0
            for e, end in enumerate(offs.tolist()):
                sums = torch.empty(end - start, n)
                if end > start:
                    a_e, b_e = qa[start:end].to(bf), qb[e].to(bf)
                    self.assertTrue(_native.kernels().bf16_mm(a_e, b_e, sums))
                    row_s = sa[start:end] if sa.shape[0] == m else sa.reshape(1, 1)
                    want[start:end] = (sums * (row_s * sb_n[e])).to(bf)
                start = end
            for threads in (1, 2):
                with (
                    intra_op_threads(threads),
                    mock.patch.object(S._native, "kernels", lambda: spy),
                ):
                    got = ops.scaled_grouped_mm(qa, qb, sa, sb, offs, g.lhs.inner, g.rhs.outer, bf)
                self.assertEqual(got, want, atol=0, rtol=0, msg=f"{recipe} on {threads}")
        if native:
            self.assertTrue(spy.fp8_block_scaled_mm.called)

        def codes(*shape):  # small integers: exact products and block sums
            return torch.randint(-8, 9, shape, generator=gen).float().to(torch.float8_e4m3fn)

        def pow2(*shape):  # scales 2^-2 .. 2^2: the scaled sums exact in fp32 too
            return torch.randint(-2, 3, shape, generator=gen).float().exp2()

        if native:  # K = 1100: three of the GEMM's k blocks, the scales repeated per block
            qa, qb = codes(m, 1100), codes(E, 1100, n)
            sa, sb = pow2(m, 1), pow2(E, 1, n)
            want = torch.zeros(m, n, dtype=torch.float64)
            start = 0
            for e, end in enumerate(offs.tolist()):
                a64 = qa[start:end].double() * sa[start:end].double()
                want[start:end] = a64 @ (qb[e].double() * sb[e].double())
                start = end
            spy.reset_mock()
            with (
                mock.patch.object(S._native, "kernels", lambda: spy),
                mock.patch.object(S, "mm_into", side_effect=AssertionError("the fp32 form ran")),
            ):
                got = ops.scaled_grouped_mm(qa, qb, sa, sb, offs, -1, 1, bf)
            self.assertEqual(got, want.to(bf), atol=0, rtol=0)
            self.assertTrue(spy.fp8_block_scaled_mm.called)
        # the weight gradient: per-expert (rowwise: jagged blocks of whole groups) or per
        # tensor scales; blockwise's 128-row blocks are not constant over a group
        x = torch.randn(m, 48, generator=gen) * torch.rand(m, 1, generator=gen).mul(3).exp()
        dy = torch.randn(m, 40, generator=gen)
        for recipe in ("fp8_rowwise", "fp8_tensorwise", "fp8_blockwise"):
            g = RECIPES[recipe].wgrad
            qx, sx = S.quantize_wgrad_operand(x, offs, g.lhs)
            qdy, sdy = S.quantize_wgrad_operand(dy, offs, g.rhs)
            takes = native and recipe != "fp8_blockwise"
            self.assertEqual(S._wgrad_codes_in_bf16(sx, sdy, g.lhs.inner, bf), takes, msg=recipe)
            if not takes:
                continue
            per_tensor = list(sx.shape) == [1, 1]
            want = torch.zeros(E, 48, 40, dtype=bf)
            start, row = 0, 0
            for e, end in enumerate(offs.tolist()):
                if end > start:
                    sums = torch.empty(48, 40)
                    a_e, b_e = qx[start:end].to(bf).t(), qdy[start:end].to(bf)
                    self.assertTrue(_native.kernels().bf16_mm(a_e, b_e, sums))
                    s_x = sx.reshape(1, 1) if per_tensor else sx[row][:, None]
                    s_dy = sdy.reshape(1, 1) if per_tensor else sdy[row][None, :]
                    want[e] = (sums * (s_x * s_dy)).to(bf)
                    row += 1
                start = end
            for threads in (1, 2):
                with intra_op_threads(threads):
                    got = ops.scaled_grouped_mm_wgrad(qx, qdy, sx, sdy, offs, g.lhs.inner, bf)
                self.assertEqual(got, want, atol=0, rtol=0, msg=f"{recipe} wgrad on {threads}")
        if not native:
            return
        # a group of 1100 rows: three jagged blocks of 512 with its scales (exact sums)
        big = make_offs([3, 1100, 0, 20])
        rows = int(big[-1])
        x, dy = codes(rows, 24), codes(rows, 36)
        for per_tensor in (True, False):
            sx, sdy = (pow2(1, 1), pow2(1, 1)) if per_tensor else (pow2(5, 24), pow2(5, 36))
            want_w = torch.zeros(4, 24, 36, dtype=torch.float64)
            start, row = 0, 0
            for e, end in enumerate(big.tolist()):
                if end > start:
                    s_x = sx[0] if per_tensor else sx[row]
                    s_dy = sdy[0] if per_tensor else sdy[row]
                    xs = x[start:end].double() * s_x.double()
                    want_w[e] = xs.t() @ (dy[start:end].double() * s_dy.double())
                    row += 1
                start = end
            with (  # (the kernel took it: the fp32 form would give these exact bits too)
                mock.patch.object(S._native, "kernels", lambda: spy),
                mock.patch.object(S, "mm_into", side_effect=AssertionError("the fp32 form ran")),
            ):
                got_w = ops.scaled_grouped_mm_wgrad(x, dy, sx, sdy, big, -1, bf)
            self.assertEqual(got_w, want_w.to(bf), atol=0, rtol=0, msg=f"{per_tensor}")
        self.assertTrue(spy.fp8_block_scaled_mm_wgrad.called)

    def test_blocks_multiply_in_bf16_where_native(self):
        """Blockwise scales (per 128 elements of K; a weight gradient's jagged blocks of
        128 rows) and a bf16 output: where torch_moe's native bf16 GEMM runs here, the codes
        are multiplied in bf16 and each k block's fp32 sums times its row's and its
        column's scale inside the GEMM's tiles (``fp8_block_scaled_mm``, ``_wgrad``). Exact
        where every sum is (small integer codes, power-of-two scales): each block's own
        scales, K's last block shorter, ragged column blocks, groups over several row
        blocks, empty groups, rows past the last group zero; the same bits on one and two
        threads; within the GEMM bound of the float64 product on random operands."""

        bf = torch.bfloat16
        gen = torch.Generator().manual_seed(14)
        native = S.native_gemm_ready(bf)
        sizes = [7, 0, 290, 1, 33]
        offs = make_offs(sizes)
        E, m, k, n = len(sizes), int(offs[-1]) + 3, 300, 200  # 300: 128 + 128 + 44

        def codes(*shape):  # small integers: exact products and block sums
            return torch.randint(-8, 9, shape, generator=gen).float().to(torch.float8_e4m3fn)

        def pow2(*shape):  # scales 2^-2 .. 2^2: the scaled sums exact in fp32 too
            return torch.randint(-2, 3, shape, generator=gen).float().exp2()

        self.assertEqual(S._blocks_in_bf16(pow2(1, 1), pow2(1, 1, 1), 128, bf), native)
        self.assertFalse(S._blocks_in_bf16(pow2(1, 1), pow2(1, 1, 1), 128, F32))
        if not native:  # (the fp32 form: the tests above)
            return
        qa, qb = codes(m, k), codes(E, n, k).transpose(1, 2)  # b K-major, as quantize_rhs
        sa, sb = pow2(m, 3), pow2(E, 3, 2)
        a64 = qa.double() * S._expand(sa.double(), 1, 128, k)
        want = torch.zeros(m, n, dtype=torch.float64)
        start = 0
        for e, end in enumerate(offs.tolist()):
            b64 = qb[e].double() * S._expand(S._expand(sb[e].double(), 0, 128, k), 1, 128, n)
            want[start:end] = a64[start:end] @ b64
            start = end
        spy = mock.MagicMock(wraps=_native.kernels())
        got = []
        for threads in (1, 2):
            with intra_op_threads(threads), mock.patch.object(S._native, "kernels", lambda: spy):
                got.append(ops.scaled_grouped_mm(qa, qb, sa, sb, offs, 128, 128, bf))
        self.assertTrue(spy.fp8_block_scaled_mm.called)
        self.assertEqual(got[0], want.to(bf), atol=0, rtol=0)
        self.assertEqual(got[1], got[0], atol=0, rtol=0)
        # the weight gradient: jagged blocks of 128 rows from each group's start
        x, dy = codes(m, 48), codes(m, 70)
        first = torch.tensor([0] + [-(-s // 128) for s in sizes]).cumsum(0)[:-1]
        nb = S.Q.jagged_block_index(offs, m, 128)[1]  # (the op's bound: rows past unused)
        sx, sdy = pow2(nb, 48), pow2(nb, 70)
        want_w = torch.zeros(E, 48, 70, dtype=torch.float64)
        start = 0
        for e, end in enumerate(offs.tolist()):
            for j, r0 in enumerate(range(start, end, 128)):
                r1, row = min(end, r0 + 128), int(first[e]) + j
                xs = x[r0:r1].double() * sx[row].double()
                want_w[e] += xs.t() @ (dy[r0:r1].double() * sdy[row].double())
            start = end
        got_w = []
        for threads in (1, 2):
            with intra_op_threads(threads), mock.patch.object(S._native, "kernels", lambda: spy):
                got_w.append(ops.scaled_grouped_mm_wgrad(x, dy, sx, sdy, offs, 128, bf))
        self.assertTrue(spy.fp8_block_scaled_mm_wgrad.called)
        self.assertEqual(got_w[0], want_w.to(bf), atol=0, rtol=0)
        self.assertEqual(got_w[1], got_w[0], atol=0, rtol=0)
        # random operands of the recipe: within the GEMM bound of the exact product
        g = RECIPES["fp8_blockwise"].forward
        _, _, qa, sa, qb, sb = _operands(g, m, k, n, E, seed=15)
        got = ops.scaled_grouped_mm(qa, qb, sa, sb, offs, g.lhs.inner, g.rhs.outer, bf)
        exact, bound = _exact_and_bound(qa, sa, qb, sb, offs, g, bf)
        tolerances.assert_within(self, got, exact, bound, "blockwise, random")

    def test_scale_products_past_fp32_take_the_fp32_form(self):
        # the routes on the codes scale each block's sums by a row's scale times a column's:
        # past fp32's range that product is inf, and a block summing to zero would be NaN
        # where the fp32 form (operands scaled first) gives 0; such scales take the fp32 form
        bf = torch.bfloat16
        offs = make_offs([3, 2])
        x = torch.zeros(5, 128)
        x[:, 0], x[:, 1] = 1e30, -1e30  # row scales ~2.2e27
        w = torch.zeros(2, 128, 16)
        w[:, 2] = 1e20  # column scales ~2.2e17 (the products ~5e44); met by x's zeros
        for name in ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise"):
            g = RECIPES[name].forward
            qa, sa = _quantize_ref(x, g.lhs, along_rows=False)
            qb, sb = _quantize_ref(w, g.rhs, along_rows=True)
            self.assertFalse(S._scale_products_finite(sa, sb))
            got = ops.scaled_grouped_mm(qa, qb, sa, sb, offs, g.lhs.inner, g.rhs.outer, bf)
            want = S.scaled_grouped_mm_reference(qa, qb, sa, sb, offs, g.lhs.inner, g.rhs.outer, bf)
            self.assertEqual(got, want, atol=0, rtol=0, msg=name)
            self.assertTrue((got == 0).all(), msg=name)
            # within fp32's range: the route on the codes where it runs
            self.assertTrue(S._scale_products_finite(sa / 1e10, sb))
        xw, dy = torch.zeros(5, 128), torch.zeros(5, 16)
        xw[:3, 0], dy[3:, 3] = 1e30, 1e20  # large in other rows: every product zero
        qa, sa = quantize_fp8_reference(xw)
        qb, sb = quantize_fp8_reference(dy)
        got = ops.scaled_grouped_mm_wgrad(qa, qb, sa, sb, offs, -1, bf)
        self.assertEqual(got, S.scaled_grouped_mm_wgrad_reference(qa, qb, sa, sb, offs, -1, bf))
        self.assertTrue((got == 0).all())
        self.assertFalse(S._scale_products_finite(torch.tensor([[float("nan")]]), sb))

    def test_chunks_of_groups(self):
        # whole groups, about chunk_rows rows each; a larger group alone; empty ones ride along
        self.assertEqual(
            S._chunks_of_groups([3, 3, 5, 20, 21, 22], 4),
            [(0, 3, [0, 1]), (3, 5, [2]), (5, 20, [3]), (20, 22, [4, 5])],
        )
        self.assertEqual(S._chunks_of_groups([0, 0], 8), [(0, 0, [0, 1])])
        self.assertEqual(S._chunks_of_groups([], 8), [])


class TestDequantizedPieces(TestCase):
    """The fp32 form by the native kernels' pieces (``fp8_dequantized_mm`` / ``_wgrad``,
    which CPUs without native bf16 GEMMs take: ``dequantizes_pieces``): each piece's
    operands dequantized on its thread, its fp32 GEMM on that thread. Their values are the
    dequantized operands' grouped GEMM within the fp32 GEMM's rounding bound (not the
    per-group loop's bits: a GEMM library may sum another split of the rows or columns in
    another order, and the loop sends groups of a few rows to the few-rows kernel), on 1-3
    threads, for every recipe, both weight layouts, fp32 and bf16 outputs, empty and
    one-row groups, rows past the last group, N past the pieces' 256 columns; repeated
    calls give the same bits."""

    CASES = ([7, 0, 33, 1, 0, 50], [0, 0, 0], [300], [40, 280, 0, 5])

    def setUp(self):
        if not Q.native_fp8_conversions():
            self.skipTest("the native e4m3 kernels did not build here")
        self.mod = _native.kernels()

    @parametrize("recipe", [r for r in RECIPES if RECIPES[r].forward.lhs is not None])
    def test_forward_and_dgrad_within_the_fp32_bound(self, recipe):
        gen = torch.Generator().manual_seed(11)
        k, n = 96, 288  # N: a 256-column piece and 32 (MX's and blockwise's blocks tile both)
        for sizes in self.CASES:
            offs = make_offs(sizes)
            m = int(offs[-1]) + 3
            x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen).mul(4).exp()
            for name in ("forward", "dgrad"):
                g = getattr(RECIPES[recipe], name)
                w = torch.randn(len(sizes), k, n, generator=gen)
                for w_l in (w, w.transpose(1, 2).contiguous().transpose(1, 2)):
                    qa, sa = S.quantize_lhs(x, g.lhs)
                    qb, sb = S.quantize_rhs(w_l, g.rhs)
                    a_f, b_f = S._dequantize_operands(qa, qb, sa, sb, g.lhs.inner, g.rhs.outer)
                    args = (qa, qb, S._fp32_scales(sa).contiguous())
                    args += (S._fp32_scales(sb).contiguous(), offs, g.lhs.inner, g.rhs.outer)
                    for threads, out_dtype in itertools.product((1, 2, 3), (F32, torch.bfloat16)):
                        msg = f"{recipe} {name} {sizes} {w_l.stride()} {threads} {out_dtype}"
                        out = torch.full((m, n), float("nan"), dtype=out_dtype)
                        with intra_op_threads(threads):
                            self.assertTrue(self.mod.fp8_dequantized_mm(*args, out), msg=msg)
                            again = torch.empty_like(out)
                            self.assertTrue(self.mod.fp8_dequantized_mm(*args, again))
                        assert_gemm_within(self, out, a_f, b_f, offs, msg)
                        self.assertEqual(again, out, atol=0, rtol=0, msg=msg)

    @parametrize("recipe", [r for r in RECIPES if RECIPES[r].wgrad.lhs is not None])
    def test_wgrad_within_the_fp32_bound(self, recipe):
        g = RECIPES[recipe].wgrad
        gen = torch.Generator().manual_seed(12)
        k, n = 288, 64
        for sizes in self.CASES:
            offs = make_offs(sizes)
            m = int(offs[-1]) + 2
            qx, sx, qdy, sdy, a_f, b_f = _wgrad_operands(g, offs, k, n, gen)
            per_tensor = list(sx.shape) == [1, 1]
            index = None if per_tensor else Q.jagged_block_index(offs, m, g.lhs.inner)[0]
            args = (qx, qdy, S._fp32_scales(sx).contiguous(), S._fp32_scales(sdy).contiguous())
            for threads, out_dtype in itertools.product((1, 2, 3), (F32, torch.bfloat16)):
                msg = f"{recipe} {sizes} {threads} {out_dtype}"
                out = torch.full((len(sizes), k, n), float("nan"), dtype=out_dtype)
                with intra_op_threads(threads):
                    self.assertTrue(self.mod.fp8_dequantized_mm_wgrad(*args, index, offs, out))
                assert_gemm_within(self, out, a_f, b_f, offs, msg, wgrad=True)

    def test_refusals_leave_out_untouched(self):
        # what the kernels do not take: they return False, out as it was, the caller's
        # Python form runs
        g = RECIPES["fp8_rowwise"].forward
        offs = make_offs([5, 0, 7])
        x, w = torch.randn(12, 64), torch.randn(3, 64, 96)
        qa, sa = S.quantize_lhs(x, g.lhs)
        qb, sb = S.quantize_rhs(w, g.rhs)
        sa, sb = sa.contiguous(), sb.contiguous()
        blocks = (g.lhs.inner, g.rhs.outer)
        out = torch.full((12, 96), 7.0)
        bad = {
            "bf16 a": (qa.to(torch.bfloat16), qb, sa, sb, offs, *blocks, out),
            "fp16 out": (qa, qb, sa, sb, offs, *blocks, out.half()),
            "int64 offs": (qa, qb, sa, sb, offs.long(), *blocks, out),
            "offs past M": (qa, qb, sa, sb, offs + 1, *blocks, out),
            "scale_a rows": (qa, qb, sa[:5], sb, offs, *blocks, out),
            "scale_b blocks": (qa, qb, sa, sb.expand(3, 2, 96).contiguous(), offs, *blocks, out),
            "strided a": (qa.t().contiguous().t(), qb, sa, sb, offs, *blocks, out),
            "block_n of 96": (qa, qb, sa, torch.ones(3, 1, 2), offs, -1, 48, out),
        }
        for name, args in bad.items():
            self.assertFalse(self.mod.fp8_dequantized_mm(*args), msg=name)
            self.assertTrue(bool((args[-1] == 7.0).all()), msg=name)
        gw = RECIPES["fp8_rowwise"].wgrad
        dy = torch.randn(12, 40)
        qx, sx = S.quantize_wgrad_operand(x, offs, gw.lhs)
        qdy, sdy = S.quantize_wgrad_operand(dy, offs, gw.rhs)
        index = Q.jagged_block_index(offs, 12, gw.lhs.inner)[0]
        dw = torch.full((3, 64, 40), 7.0)
        bad_w = {
            "no index": (qx, qdy, sx, sdy, None, offs, dw),
            "index past the scales": (qx, qdy, sx, sdy, index + 5, offs, dw),
            "index one past": (qx, qdy, sx, sdy, index.clamp_min(sx.shape[0] - 1) + 1, offs, dw),
            "out [E, N, K]": (qx, qdy, sx, sdy, index, offs, dw.transpose(1, 2)),
            "int64 offs": (qx, qdy, sx, sdy, index, offs.long(), dw),
        }
        for name, args in bad_w.items():
            self.assertFalse(self.mod.fp8_dequantized_mm_wgrad(*args), msg=name)
            self.assertTrue(bool((dw == 7.0).all()), msg=name)

    def test_blas_route_equals_atens(self):
        # each piece's fp32 GEMM by BLAS's sgemm_ on the thread's buffers (csrc/sgemm_cpu.h)
        # where ATen's fp32 matmuls are IEEE, else ATen's GEMM on views of them (here forced
        # by the "high" matmul precision): within the fp32 bound either way, and the same
        # bits where "high" leaves ATen's CPU GEMM IEEE (no AMX-FP16, whose tf32 it takes)
        exact = "amx_fp16" not in P._cpuinfo()[1]
        gen = torch.Generator().manual_seed(14)
        offs = make_offs([37, 0, 300, 5])
        m, k = int(offs[-1]) + 2, 96
        x = torch.randn(m, k, generator=gen)
        before = torch.get_float32_matmul_precision()
        # N past a 256-column piece: rowwise by 35 (a bf16 row's 3-value tail), the others
        # by whole 32-column blocks
        for recipe, n in (("fp8_rowwise", 291), ("fp8_blockwise", 288), ("mxfp8", 288)):
            g, gw = RECIPES[recipe].forward, RECIPES[recipe].wgrad
            w = torch.randn(4, k, n, generator=gen)
            qx, sx, qdy, sdy, x_f, dy_f = _wgrad_operands(gw, offs, k, n, gen)
            per_tensor = list(sx.shape) == [1, 1]
            index = None if per_tensor else Q.jagged_block_index(offs, m, gw.lhs.inner)[0]
            wargs = (qx, qdy, S._fp32_scales(sx).contiguous(), S._fp32_scales(sdy).contiguous())
            for w_l in (w, w.transpose(1, 2).contiguous().transpose(1, 2)):
                qa, sa = S.quantize_lhs(x, g.lhs)
                qb, sb = S.quantize_rhs(w_l, g.rhs)
                a_f, b_f = S._dequantize_operands(qa, qb, sa, sb, g.lhs.inner, g.rhs.outer)
                args = (qa, qb, S._fp32_scales(sa).contiguous(), S._fp32_scales(sb).contiguous())
                args += (offs, g.lhs.inner, g.rhs.outer)
                for threads, dt in itertools.product((1, 2), (F32, torch.bfloat16)):
                    msg = f"{recipe} {w_l.stride()} {threads} {dt}"
                    outs = []
                    for precision in ("highest", "high"):
                        out = torch.full((m, n), float("nan"), dtype=dt)
                        dw = torch.full((4, k, n), float("nan"), dtype=dt)
                        try:
                            torch.set_float32_matmul_precision(precision)
                            with intra_op_threads(threads):
                                self.assertTrue(self.mod.fp8_dequantized_mm(*args, out))
                                self.assertTrue(
                                    self.mod.fp8_dequantized_mm_wgrad(*wargs, index, offs, dw)
                                )
                        finally:
                            torch.set_float32_matmul_precision(before)
                        assert_gemm_within(self, out, a_f, b_f, offs, f"{msg} {precision}")
                        assert_gemm_within(
                            self, dw, x_f, dy_f, offs, f"{msg} {precision}", wgrad=True
                        )
                        outs.append((out, dw))
                    if exact:
                        self.assertEqual(outs[0], outs[1], atol=0, rtol=0, msg=msg)

    def test_the_ops_take_the_pieces_where_decided(self):
        # decided where bf16 GEMMs upcast, over FEW_ROWS rows (fewer: the loop), on one
        # thread or with the threads_mm decision at the rows' class; the ops then return
        # the kernels' outputs, else the loop's
        bf = torch.bfloat16
        with P.force(half_gemm="fp32", threads_mm="native"):
            with intra_op_threads(2):
                self.assertTrue(S.dequantizes_pieces(64))
                self.assertFalse(S.dequantizes_pieces(P.FEW_ROWS))
                self.assertTrue(S.dequantizes_pieces(64, threads=1))
            with intra_op_threads(1):
                self.assertTrue(S.dequantizes_pieces(64))
                self.assertFalse(S.dequantizes_pieces(P.FEW_ROWS))
                self.assertTrue(S.dequantizes_pieces(64, threads=3))
        with P.force(half_gemm="fp32", threads_mm="aten"):
            with intra_op_threads(2):
                self.assertFalse(S.dequantizes_pieces(64))
            with intra_op_threads(1):
                self.assertTrue(S.dequantizes_pieces(64))
        for threads in (1, 2):
            with P.force(half_gemm="native", threads_mm="native"), intra_op_threads(threads):
                self.assertFalse(S.dequantizes_pieces(64))
        gen = torch.Generator().manual_seed(13)
        offs = make_offs([40, 0, 70])
        x, w, dy = torch.randn(113, 64, generator=gen), torch.randn(3, 64, 96), torch.randn(113, 32)
        for recipe in ("fp8_tensorwise", "fp8_blockwise", "mxfp8"):
            g, gw = RECIPES[recipe].forward, RECIPES[recipe].wgrad
            qa, sa = S.quantize_lhs(x, g.lhs)
            qb, sb = S.quantize_rhs(w, g.rhs)
            qx, sx = S.quantize_wgrad_operand(x, offs, gw.lhs)
            qdy, sdy = S.quantize_wgrad_operand(dy, offs, gw.rhs)
            per_tensor = list(sx.shape) == [1, 1]
            index = None if per_tensor else Q.jagged_block_index(offs, 113, gw.lhs.inner)[0]
            want = torch.empty(113, 96, dtype=bf)
            want_w = torch.empty(3, 64, 32, dtype=bf)
            args = (qa, qb, S._fp32_scales(sa).contiguous(), S._fp32_scales(sb).contiguous(), offs)
            wargs = (qx, qdy, S._fp32_scales(sx).contiguous(), S._fp32_scales(sdy).contiguous())
            routes = [
                mock.patch.object(S, r, lambda *a: False)
                for r in (
                    "_codes_in_bf16",
                    "_blocks_in_bf16",
                    "_mx_in_bf16",
                    "_wgrad_codes_in_bf16",
                )
            ]
            with intra_op_threads(2), contextlib.ExitStack() as stack:
                for r in routes:
                    stack.enter_context(r)
                self.assertTrue(self.mod.fp8_dequantized_mm(*args, g.lhs.inner, g.rhs.outer, want))
                self.assertTrue(self.mod.fp8_dequantized_mm_wgrad(*wargs, index, offs, want_w))
                for pieces in (True, False):
                    with mock.patch.object(S, "dequantizes_pieces", lambda *a, p=pieces: p):
                        got = ops.scaled_grouped_mm(
                            qa, qb, sa, sb, offs, g.lhs.inner, g.rhs.outer, bf
                        )
                        got_w = ops.scaled_grouped_mm_wgrad(
                            qx, qdy, sx, sdy, offs, gw.lhs.inner, bf
                        )
                    if pieces:
                        self.assertEqual(got, want, atol=0, rtol=0, msg=recipe)
                        self.assertEqual(got_w, want_w, atol=0, rtol=0, msg=recipe)
                    else:  # the loop: the same values within bf16's rounding
                        self.assertEqual(
                            got.float(), want.float(), atol=1e-5, rtol=2**-7, msg=recipe
                        )
                        self.assertEqual(got_w.float(), want_w.float(), atol=1e-5, rtol=2**-7)


class TestScaledGroupedMM(TestCase):
    @parametrize("recipe", list(RECIPES))
    @parametrize("gemm", ["forward", "dgrad"])
    def test_matches_naive_dequantization(self, recipe, gemm):
        g = getattr(RECIPES[recipe], gemm)
        offs = make_offs(SIZES)
        m, k, n = int(offs[-1]) + 3, 64, 96
        _, _, qa, sa, qb, sb = _operands(g, m, k, n, len(SIZES), seed=1)
        for out_dtype in (F32, torch.bfloat16):
            got = ops.scaled_grouped_mm(qa, qb, sa, sb, offs, g.lhs.inner, g.rhs.outer, out_dtype)
            self.assertEqual(got.dtype, out_dtype)
            exact, bound = _exact_and_bound(qa, sa, qb, sb, offs, g, out_dtype)
            tolerances.assert_within(self, got, exact, bound, f"{recipe} {gemm} {out_dtype}")
            self.assertTrue(torch.equal(got[-3:], torch.zeros(3, n, dtype=out_dtype)))

    @parametrize("recipe", list(RECIPES))
    def test_wgrad_matches_naive_dequantization(self, recipe):
        g = RECIPES[recipe].wgrad
        offs = make_offs(SIZES)
        m, k, n = int(offs[-1]) + 5, 32, 64
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen).mul(3).exp()
        dy = torch.randn(m, n, generator=gen)
        ops_ = []
        for t in (x, dy):
            if (g.lhs.outer, g.lhs.inner) == (-1, -1):
                ops_.append(quantize_fp8_reference(t))
            else:
                ops_.append(
                    quantize_jagged_reference(
                        t, offs, block=g.lhs.inner, fmt=g.lhs.fmt, scale_rule=g.lhs.scale_rule,
                        scale_dtype=torch.uint8 if g.lhs.fmt == "mx" else F32,
                    )
                )  # fmt: skip
        (qx, sx), (qdy, sdy) = ops_
        if g.lhs.inner not in (-1,) and (g.lhs.outer, g.lhs.inner) != (-1, -1):
            # the property the test needs: a group over three blocks, an empty and a one-row one
            self.assertGreaterEqual(max(SIZES) // g.lhs.inner, 2)
        self.assertIn(0, SIZES)
        self.assertIn(1, SIZES)
        got = ops.scaled_grouped_mm_wgrad(qx, qdy, sx, sdy, offs, g.lhs.inner, F32)
        x64 = naive.dequantize_jagged(qx, sx, offs, g.lhs.inner)
        dy64 = naive.dequantize_jagged(qdy, sdy, offs, g.lhs.inner)
        exact = naive.grouped_mm_wgrad64(x64, dy64, offs)
        products = naive.grouped_mm_wgrad64(x64.abs(), dy64.abs(), offs)
        bound = tolerances.gemm_bound(products, max(SIZES), exact, F32, F32)
        tolerances.assert_within(self, got, exact, bound, recipe)

    @parametrize("recipe", list(RECIPES))
    def test_wgrad_of_no_rows(self, recipe):
        # M = 0: each operand's scales as the wgrad op takes them ([1, 1] per tensor: the
        # scale of no elements; else the jagged blocks' count for no rows), zero weight
        # gradients, as the undecomposed op gives them
        g = RECIPES[recipe].wgrad
        offs = torch.zeros(3, dtype=torch.int32)
        x, dy = torch.randn(0, 32), torch.randn(0, 64)
        (qx, sx), (qdy, sdy) = (
            S.quantize_wgrad_operand(t, offs, op) for t, op in ((x, g.lhs), (dy, g.rhs))
        )
        self.assertEqual((qx.shape, qdy.shape), ((0, 32), (0, 64)))
        if (g.lhs.outer, g.lhs.inner) == (-1, -1):
            self.assertEqual((list(sx.shape), list(sdy.shape)), ([1, 1], [1, 1]))
        else:
            nb = Q.jagged_num_blocks(0, 3, g.lhs.inner)
            self.assertEqual((list(sx.shape), list(sdy.shape)), ([nb, 32], [nb, 64]))
        got = ops.scaled_grouped_mm_wgrad(qx, qdy, sx, sdy, offs, g.lhs.inner, F32)
        self.assertTrue(torch.equal(got, torch.zeros(3, 32, 64)))
        undecomposed = torch.ops.torch_moe.quantized_grouped_mm_wgrad(x, dy, offs, recipe)
        self.assertTrue(torch.equal(undecomposed.float(), got))

    @parametrize("recipe", list(RECIPES))
    def test_quantized_ops_equal_their_decomposition(self, recipe):
        """quantized_grouped_mm (+ dgrad, wgrad) == the quantize ops + scaled_grouped_mm
        (_wgrad), bit for bit on CPU: the decomposition the compiler passes rewrite is exact."""
        r = RECIPES[recipe]
        offs = make_offs([7, 0, 33, 1])
        gen = torch.Generator().manual_seed(3)
        m, k, n = int(offs[-1]) + 2, 64, 96
        x = torch.randn(m, k, generator=gen)
        w = torch.randn(4, k, n, generator=gen) / 8
        dy = torch.randn(m, n, generator=gen)
        for name, g, a, b in (
            ("forward", r.forward, x, w),
            ("dgrad", r.dgrad, dy, w.transpose(-2, -1)),
        ):
            self.assertTrue(S.decomposable(g), msg=name)
            qa, sa = S.quantize_lhs(a, g.lhs)
            qb, sb = S.quantize_rhs(b, g.rhs)
            # K-major, or on the CPU b's own row-major layout (the forward's w here): the
            # same codes and scales as the K-major form, without its transposing copy
            k_major = b.stride(-2) == 1
            self.assertEqual(qb.stride(-2 if k_major else -1), 1, msg=name)
            qk, sk = S.quantize_rhs(b.transpose(-2, -1).contiguous().transpose(-2, -1), g.rhs)
            self.assertEqual(qk.stride(-2), 1, msg=name)
            self.assertEqual(qb.view(torch.uint8), qk.view(torch.uint8), atol=0, rtol=0)
            self.assertEqual(sb, sk, atol=0, rtol=0, msg=name)
            ref = ops.scaled_grouped_mm(qa, qb, sa, sb, offs, g.lhs.inner, g.rhs.outer, F32)
            if name == "forward":
                got = ops.quantized_grouped_mm(x, w, offs, recipe)
            else:
                got = ops.quantized_grouped_mm_dgrad(dy, w, offs, recipe)
            self.assertEqual(got, ref, atol=0, rtol=0, msg=name)
        self.assertTrue(S.decomposable_wgrad(r.wgrad))
        qx, sx = S.quantize_wgrad_operand(x, offs, r.wgrad.lhs)
        qdy, sdy = S.quantize_wgrad_operand(dy, offs, r.wgrad.rhs)
        ref = ops.scaled_grouped_mm_wgrad(qx, qdy, sx, sdy, offs, r.wgrad.lhs.inner, F32)
        got = ops.quantized_grouped_mm_wgrad(x, dy, offs, recipe)
        self.assertEqual(got, ref, atol=0, rtol=0)

    def test_cuda_kernels_interpreted(self):
        """The CUDA kernels of the two ops over quantized operands (Triton's interpreter on
        CPU tensors; the wgrad one re-lays token-order operands into aligned slots) equal
        the naive dequantization within the fp32 accumulation bound."""
        offs = make_offs([20, 0, 1, 9])
        m = int(offs[-1]) + 2
        for name in ("fp8_blockwise", "fp8_rowwise", "mxfp8"):
            g = RECIPES[name].forward
            _, _, qa, sa, qb, sb = _operands(g, m, 128, 32, 4, seed=4)
            with self.subTest(recipe=name, op="scaled_grouped_mm"):
                got = S._scaled_grouped_mm_cuda(qa, qb, sa, sb, offs, g.lhs.inner, g.rhs.outer, F32)
                exact, bound = _exact_and_bound(qa, sa, qb, sb, offs, g, F32)
                tolerances.assert_within(self, got, exact, bound, name)
        offs = make_offs([70, 0, 1, 40])  # 70 rows: three 32-row blocks
        m = int(offs[-1]) + 3
        gen = torch.Generator().manual_seed(5)
        x, dy = torch.randn(m, 16, generator=gen), torch.randn(m, 16, generator=gen)
        for name in ("fp8_rowwise", "mxfp8", "fp8_tensorwise"):
            g = RECIPES[name].wgrad
            with self.subTest(recipe=name, op="scaled_grouped_mm_wgrad"):
                (qx, sx), (qdy, sdy) = (S.quantize_wgrad_operand(t, offs, g.lhs) for t in (x, dy))
                got = S._scaled_grouped_mm_wgrad_cuda(qx, qdy, sx, sdy, offs, g.lhs.inner, F32)
                x64 = naive.dequantize_jagged(qx, sx, offs, g.lhs.inner)
                dy64 = naive.dequantize_jagged(qdy, sdy, offs, g.lhs.inner)
                exact = naive.grouped_mm_wgrad64(x64, dy64, offs)
                products = naive.grouped_mm_wgrad64(x64.abs(), dy64.abs(), offs)
                bound = tolerances.gemm_bound(products, 70, exact, F32, F32)
                tolerances.assert_within(self, got, exact, bound, name)

    def test_autograd_calls_dgrad_and_wgrad(self):
        r = "fp8_blockwise"
        offs = make_offs([5, 0, 12])
        x = torch.randn(19, 128, requires_grad=True)
        w = (torch.randn(3, 128, 64) / 11).requires_grad_()
        dy = torch.randn(19, 64)
        ops.quantized_grouped_mm(x, w, offs, r).backward(dy)
        self.assertEqual(
            x.grad, ops.quantized_grouped_mm_dgrad(dy, w.detach(), offs, r), atol=0, rtol=0
        )
        self.assertEqual(
            w.grad, ops.quantized_grouped_mm_wgrad(x.detach(), dy, offs, r), atol=0, rtol=0
        )

    @parametrize("recipe", list(RECIPES))
    def test_empty_dims(self, recipe):
        # M, K, N or E zero, and every group empty: the three GEMMs' zeros (or empty
        # outputs), as the bf16 GEMM gives; an empty dim has no quantization blocks, which
        # the scaled ops' one scale per whole dim would not take
        dt = torch.bfloat16
        for m, k, n, sizes in (
            (4, 0, 32, [3]), (4, 32, 0, [3]), (0, 32, 32, [0]), (4, 32, 32, []),
            (4, 32, 32, [0, 0]),
        ):  # fmt: skip
            offs = make_offs(sizes)
            x = torch.randn(m, k, dtype=dt, requires_grad=True)
            w = torch.randn(len(sizes), k, n, dtype=dt, requires_grad=True)
            with self.subTest(m=m, k=k, n=n, sizes=sizes):
                out = ops.quantized_grouped_mm(x, w, offs, recipe)
                self.assertEqual(out, torch.zeros(m, n, dtype=dt), atol=0, rtol=0)
                out.backward(torch.ones_like(out))
                self.assertEqual(x.grad, torch.zeros_like(x), atol=0, rtol=0)
                self.assertEqual(w.grad, torch.zeros_like(w), atol=0, rtol=0)

    def test_opcheck(self):
        offs = make_offs([6, 0, 9])
        x = torch.randn(17, 64)
        w = torch.randn(3, 64, 32) / 8
        dy = torch.randn(17, 32)
        for name in ("fp8_rowwise", "mxfp8"):
            r = RECIPES[name]
            qa, sa = S.quantize_lhs(x, r.forward.lhs)
            qb, sb = S.quantize_rhs(w, r.forward.rhs)
            qx, sx = S.quantize_wgrad_operand(x, offs, r.wgrad.lhs)
            qdy, sdy = S.quantize_wgrad_operand(dy, offs, r.wgrad.rhs)
            blk = r.forward.lhs.inner
            cases = [
                (ops.scaled_grouped_mm.default, (qa, qb, sa, sb, offs, blk, r.forward.rhs.outer, F32)),
                (ops.scaled_grouped_mm_wgrad.default, (qx, qdy, sx, sdy, offs, r.wgrad.lhs.inner, F32)),
                (ops.quantized_grouped_mm.default, (x.requires_grad_(), w.requires_grad_(), offs, name)),
                (ops.quantized_grouped_mm_dgrad.default, (dy, w.detach(), offs, name)),
                (ops.quantized_grouped_mm_wgrad.default, (x.detach(), dy, offs, name)),
            ]  # fmt: skip
            for op, args in cases:
                fp8_args = any(
                    isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args
                )
                # SchemaCheckMode compares inputs by arithmetic that CPU float8 lacks; the
                # quantization rounds, so the gradient is checked against the dgrad / wgrad
                # ops (test_autograd_calls_dgrad_and_wgrad), not by finite differences
                utils = ["test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic"]
                if not fp8_args:
                    utils.append("test_schema")
                with self.subTest(recipe=name, op=str(op)):
                    opcheck(op, args, test_utils=utils)
                x, w = x.detach(), w.detach()

    def test_schemas(self):
        self.assertExpectedInline(
            str(ops.scaled_grouped_mm.default._schema),
            """torch_moe::scaled_grouped_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor offs, SymInt block_k, SymInt block_n, ScalarType out_dtype) -> Tensor""",
        )
        self.assertExpectedInline(
            str(ops.scaled_grouped_mm_wgrad.default._schema),
            """torch_moe::scaled_grouped_mm_wgrad(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor offs, SymInt block, ScalarType out_dtype) -> Tensor""",
        )
        self.assertExpectedInline(
            str(ops.quantized_grouped_mm.default._schema),
            """torch_moe::quantized_grouped_mm(Tensor x, Tensor w, Tensor offs, str recipe) -> Tensor""",
        )
        self.assertExpectedInline(
            str(ops.quantized_grouped_mm_dgrad.default._schema),
            """torch_moe::quantized_grouped_mm_dgrad(Tensor dy, Tensor w, Tensor offs, str recipe) -> Tensor""",
        )
        self.assertExpectedInline(
            str(ops.quantized_grouped_mm_wgrad.default._schema),
            """torch_moe::quantized_grouped_mm_wgrad(Tensor x, Tensor dy, Tensor offs, str recipe) -> Tensor""",
        )


def _raises_same_eager_and_compiled(test, fn, args, exc, msg):
    """``fn(*args)`` raises ``exc`` matching ``msg`` eagerly, and the compiled (fullgraph)
    function raises an error with the same message (at trace time from a fake kernel, or at
    run time from the kernel)."""
    with test.assertRaisesRegex(exc, msg):
        fn(*args)
    torch._dynamo.reset()
    with test.assertRaisesRegex(Exception, msg):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)


class TestScaledGroupedMMErrors(TestCase):
    def test_bad_quantized_operands(self):
        offs = make_offs([3, 5])
        qa, sa = quantize_fp8_reference(torch.randn(8, 32), (1, -1))
        qb, sb = quantize_fp8_reference(torch.randn(2, 32, 16), (-1, 1))
        f = ops.scaled_grouped_mm
        for args, msg in [
            ((qa.float(), qb, sa, sb, offs, -1, 1, F32), r"expected a \[M, K\] and b \[E, K, N\] in torch.float8_e4m3fn, got 2D torch.float32"),
            ((qa, qb[:, :16], sa, sb, offs, -1, 1, F32), r"a is \[M, K=32\] but b is \[E, K=16, N=16\]"),
            ((qa, qb, sa[:5], sb, offs, -1, 1, F32), r"block_k=-1 needs scale_a \[M=8 or 1, 1\], got \[5, 1\]"),
            ((qa, qb, sa, sb, offs, -1, -1, F32), r"blocks \(-1, -1\) need scale_b \[2, 1, 1\], got \[2, 1, 16\]"),
            ((qa, qb, sa, sb, offs, 0, 1, F32), "block_k must be a positive int or -1"),
            ((qa, qb, sa, sb, offs[:1], -1, 1, F32), r"expected offs to have one entry per group \(2\), got 1"),
            ((qa, qb, sa, sb, offs, -1, 1, torch.int32), "out_dtype must be one of"),
        ]:  # fmt: skip
            with self.subTest(msg=msg):
                _raises_same_eager_and_compiled(self, f, args, ValueError, msg)

    def test_bad_high_precision_operands(self):
        offs = make_offs([3, 5])
        x, w = torch.randn(8, 32), torch.randn(2, 32, 16)
        f = ops.quantized_grouped_mm
        for args, exc, msg in [
            ((x, w, offs, "fp4"), ValueError, "quantized_grouped_mm: unknown low-precision recipe 'fp4'"),
            ((x, w[:, :8], offs, "fp8_rowwise"), ValueError, r"x is \[M, K=32\] but w is \[E, K=8, N=16\]"),
            ((x.double(), w.double(), offs, "fp8_rowwise"), TypeError, "expected x and w to share a dtype in"),
            ((x, w, offs.long(), "fp8_rowwise"), ValueError, "expected offs to be 1D int32, got 1D torch.int64"),
        ]:  # fmt: skip
            with self.subTest(msg=msg):
                _raises_same_eager_and_compiled(self, f, args, exc, msg)

    def test_bad_offs_values_same_message_compiled(self):
        """Data-dependent: the kernel checks the values at run time, eager and compiled."""
        x, w = torch.randn(8, 32), torch.randn(2, 32, 16)
        msg = r"offs must be non-decreasing group ends with 0 <= offs\[0\] and offs\[-1\] <= M \(8\), got offs=\[6, 3\]"
        bad = torch.tensor([6, 3], dtype=torch.int32)
        _raises_same_eager_and_compiled(
            self, ops.quantized_grouped_mm, (x, w, bad, "fp8_rowwise"), ValueError, msg
        )
        too_far = torch.tensor([6, 9], dtype=torch.int32)
        _raises_same_eager_and_compiled(
            self,
            ops.quantized_grouped_mm,
            (x, w, too_far, "mxfp8"),
            ValueError,
            r"got offs=\[6, 9\]",
        )


class TestSwiGLU(TestCase):
    def test_matches_formula_and_gradcheck(self):
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(9, 10, dtype=torch.float64, generator=gen, requires_grad=True)
        rw = torch.rand(9, dtype=torch.float64, generator=gen, requires_grad=True)
        gate, up = h.detach()[:, :5], h.detach()[:, 5:]
        expected = gate / (1 + torch.exp(-gate)) * up * rw.detach()[:, None]
        self.assertEqual(ops.swiglu(h, rw), expected, atol=1e-15, rtol=1e-14)
        self.assertTrue(torch.autograd.gradcheck(lambda h, rw: ops.swiglu(h, rw), (h, rw)))
        self.assertTrue(torch.autograd.gradcheck(lambda h: ops.swiglu(h), (h,)))
        opcheck(ops.swiglu.default, (h, rw))
        opcheck(
            ops.swiglu_backward.default,
            (torch.randn(9, 5, dtype=torch.float64), h.detach(), rw.detach()),
        )

    def test_schemas_and_errors(self):
        self.assertExpectedInline(
            str(ops.swiglu.default._schema),
            """torch_moe::swiglu(Tensor h, Tensor? row_weights=None) -> Tensor""",
        )
        self.assertExpectedInline(
            str(ops.swiglu_backward.default._schema),
            """torch_moe::swiglu_backward(Tensor grad_a, Tensor h, Tensor? row_weights=None) -> (Tensor, Tensor)""",
        )
        with self.assertRaisesRegex(ValueError, r"swiglu: expected h \[M, 2F\]"):
            ops.swiglu(torch.randn(4, 5))
        with self.assertRaisesRegex(
            ValueError, r"expected row_weights to be a floating-point tensor \[M=4\]"
        ):
            ops.swiglu(torch.randn(4, 6), torch.ones(3))


class TestImportWithoutTriton(TestCase):
    def test_import_and_run_without_triton(self):
        """With triton unimportable, torch_moe imports and the CPU paths (every precision)
        run: Triton is imported only inside CUDA kernels."""
        code = textwrap.dedent(
            """
            import sys
            sys.modules["triton"] = None  # import triton -> ImportError
            import torch, torch_moe, torch_moe.distributed
            from torch_moe.nn import MoE
            for p in ("bf16", "fp8_blockwise", "mxfp8"):
                moe = MoE(32, 32, 4, 2, precision=p)
                x = torch.randn(6, 32, requires_grad=True)
                moe(x).sum().backward()
                assert x.grad.isfinite().all(), p
            assert not any(m.startswith("torch_moe._triton") for m in sys.modules)
            print("ok")
            """
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        self.assertEqual(out.returncode, 0, msg=out.stderr[-3000:])
        self.assertEqual(out.stdout.strip(), "ok")


class TestScaledChecks(TestCase):
    def test_messages_name_the_argument(self):
        sgm = importlib.import_module("torch_moe.quantization.scaled_grouped_mm")
        fp8 = torch.float8_e4m3fn
        a, b = torch.zeros(4, 32, dtype=fp8), torch.zeros(1, 32, 16, dtype=fp8)
        sa, sb = torch.ones(4, 1), torch.ones(1, 1, 16)
        offs = torch.tensor([4], dtype=torch.int32)
        with self.assertRaisesRegex(ValueError, r"scale_b is on meta but a is on cpu"):
            sgm._check_scaled(a, b, sa, sb.to("meta"), offs, -1, 1, torch.bfloat16)
        # wgrad: one operand's scales of the wrong shape is enough to refuse
        x, dy = torch.zeros(4, 8, dtype=fp8), torch.zeros(4, 16, dtype=fp8)
        with self.assertRaisesRegex(ValueError, r"^scaled_grouped_mm_wgrad: "):
            sgm._check_scaled_wgrad(
                x, dy, torch.ones(1, 8), torch.ones(2, 16), offs, 4, torch.bfloat16
            )
        with self.assertRaisesRegex(ValueError, r"^torch_scaled_operands: .* runs in bf16$"):
            sgm.torch_scaled_operands(a, b, sgm.GemmQuant())


instantiate_parametrized_tests(TestScaledGroupedMM)
instantiate_parametrized_tests(TestScaledGroupedMMCPUKernels)
instantiate_parametrized_tests(TestDequantizedPieces)

if __name__ == "__main__":
    run_tests()
