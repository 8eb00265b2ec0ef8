# Owner(s): ["module: moe"]
"""Tests for the Triton FP8 / MXFP8 kernels: quantize (torch_moe._triton.quantize) and scaled
grouped GEMMs (torch_moe._triton.scaled_grouped_mm), against the plain-PyTorch references.

On CPU the kernels run in Triton's interpreter (small shapes); the CUDA class runs them
compiled; the static checks compile them for sm_90a without a GPU (wgmma, registers, spills).
"""

import importlib
from unittest import mock

import naive
import tolerances
import torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe  # noqa: F401
from torch_moe._triton import quantize as TQ
from torch_moe._triton import scaled_grouped_mm as TK
from torch_moe.quantization import RECIPES, scaled_grouped_mm
from torch_moe.quantization import quantize as Q

S = importlib.import_module("torch_moe.quantization.scaled_grouped_mm")
FP8 = torch.float8_e4m3fn
F32 = torch.float32
# CUDA kernels vs the CPU emulation; the emulation's own error vs fp32 is ~28 dB.
MIN_KERNEL_VS_EMULATION_DB = 40.0


def sqnr(ref, out):
    ref, out = ref.double().cpu(), out.double().cpu()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum())).item()


def _bits(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


def make_offs(sizes, device="cpu"):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def hard_input(m, n, device="cpu", dtype=torch.float32, seed=0):
    """Gaussian rows over six decades, plus an all-zero row, a subnormal-amax block and
    exact e4m3 boundary values (round-half-even ties at 448 / 2^k scale)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g) * torch.logspace(-3, 3, n)
    x[1] = 0
    if n >= 32 and (device != "cpu" or dtype == torch.float32):
        # (Triton's interpreter flushes bf16 subnormals to zero when it loads them)
        x[2, :32] = 2.0**-130
        x[3, :8] = torch.tensor([448.0, -448.0, 464.0, 240.0, 17.0, 0.5, 2.0**-9, 3 * 2.0**-10])
    return x.to(dtype).to(device)


class _QuantizeChecks:
    device = "cpu"

    def _assert_same(self, got, ref):
        for a, b in zip(got, ref):
            self.assertEqual(a.shape, b.shape)
            self.assertTrue(torch.equal(_bits(a).cpu(), _bits(b).cpu()))

    def check_blocks(self, m, n, dtype):
        x = hard_input(m, n, self.device, dtype)
        for block in [(1, 128), (128, 128), (1, -1), (-1, 1), (16, 16)]:
            with self.subTest(block=block):
                self._assert_same(TQ.quantize_blocks(x, block), Q.quantize_fp8_reference(x, block))
        for rule in ["floor", "rceil"]:
            for sd in [torch.uint8, torch.float32]:
                with self.subTest(rule=rule, scale_dtype=str(sd)):
                    got = TQ.quantize_blocks(x, (1, 32), fmt="mx", scale_rule=rule, scale_dtype=sd)
                    ref = Q.quantize_mx_reference(x, dim=-1, scale_rule=rule, scale_dtype=sd)
                    self._assert_same(got, ref)
                    xr = x[: m // 32 * 32]  # MX along rows: whole 32-row blocks
                    got = TQ.quantize_blocks(xr, (32, 1), fmt="mx", scale_rule=rule, scale_dtype=sd)
                    ref = Q.quantize_mx_reference(xr, dim=-2, scale_rule=rule, scale_dtype=sd)
                    self._assert_same(got, ref)

    def check_weights_kmajor(self, e, k, n):
        w = hard_input(e * k, n, self.device, torch.bfloat16).reshape(e, k, n)
        for block in [(128, 128), (-1, 1)]:
            out = torch.empty(e, n, k, dtype=FP8, device=self.device).transpose(1, 2)
            got = TQ.quantize_blocks(w, block, out=out)
            self.assertIs(got[0], out)
            self._assert_same(got, Q.quantize_fp8_reference(w, block))

    def check_jagged(self, sizes, n):
        offs = make_offs(sizes, self.device)
        m = int(offs[-1]) + 7  # rows past offs[-1]: one more segment
        x = hard_input(m, n, self.device)
        for block in [128, 32, -1]:
            for fmt in ["fp8", "mx"]:
                with self.subTest(block=block, fmt=fmt):
                    out = torch.empty(n, m, dtype=FP8, device=self.device).t()
                    got = TQ.quantize_jagged(x, offs, block=block, fmt=fmt, out=out)
                    ref = Q.quantize_jagged_reference(x, offs, block=block, fmt=fmt)
                    self._assert_same(got, ref)
                    if block == -1:
                        continue
                    # slot layout: block j's rows at [j * block, ...), zero-padded
                    q, s = TQ.quantize_jagged(x, offs, block=block, fmt=fmt, slots=True)
                    self.assertTrue(torch.equal(s.cpu(), ref[1].cpu()))
                    rows, _ = Q.jagged_block_index(offs.cpu(), m, block)
                    first = torch.full((s.shape[0],), m, dtype=torch.long)
                    first.scatter_reduce_(0, rows, torch.arange(m), "amin")
                    slot_row = rows * block + (torch.arange(m) - first[rows])
                    self.assertTrue(torch.equal(_bits(q.cpu())[slot_row], _bits(ref[0].cpu())))
                    pad = torch.ones(q.shape[0], dtype=torch.bool)
                    pad[slot_row] = False
                    self.assertTrue(
                        torch.equal(q.cpu()[pad].float(), torch.zeros(int(pad.sum()), n))
                    )

    def _assert_close(self, got, ref, tol):
        if self.device == "cuda":
            # Hopper's FP8 tensor cores accumulate with fewer bits than fp32 (DeepSeek-V3
            # measured ~14 for long K; blockwise recipes promote every 128): against the exact
            # emulation, ask for an error 10x below the FP8 quantization noise (~28 dB).
            self.assertGreater(sqnr(ref, got), MIN_KERNEL_VS_EMULATION_DB)
        else:
            self.assertEqual(got, ref, atol=tol, rtol=tol)

    def check_gemms(self, sizes, k, n, tol, recipes=tuple(RECIPES)):
        g = torch.Generator().manual_seed(1)
        offs = make_offs(sizes, self.device)
        m = int(offs[-1]) + 5
        x = torch.randn(m, k, generator=g).to(self.device)
        w = torch.randn(len(sizes), n, k, generator=g).to(self.device).transpose(1, 2)
        dy = torch.randn(m, n, generator=g).to(self.device)
        for name in recipes:
            r = RECIPES[name]
            with self.subTest(recipe=name):
                for gq in (r.forward, r.dgrad, r.wgrad):
                    self.assertTrue(S._triton_takes(gq))
                out = S._kernel_gemm(x, w, offs, r.forward, torch.float32)
                self._assert_close(out, S._emulate_gemm(x, w, offs, r.forward, torch.float32), tol)
                self.assertTrue(torch.equal(out[int(offs[-1]) :].cpu(), torch.zeros(5, n)))
                dx = S._kernel_gemm(dy, w.transpose(-2, -1), offs, r.dgrad, torch.float32)
                self._assert_close(
                    dx, S._emulate_gemm(dy, w.transpose(-2, -1), offs, r.dgrad, torch.float32), tol
                )
                dw = S._kernel_wgrad(x, dy, offs, r.wgrad, torch.float32)
                self._assert_close(
                    dw, S._emulate_wgrad(x, dy, offs, r.wgrad, torch.float32), tol * 10
                )

    def check_wgrad_outside_groups(self):
        """The per-group / per-tensor wgrad steps on 16-row boundaries, so its steps read rows
        of the neighbouring groups and past the last group (never written by the quantizer):
        e4m3 NaN bytes there change nothing, bit for bit (each operand is zeroed outside
        the group in registers). Groups start off the 16-row grid, one is empty, one shorter
        than a step. Triton's interpreter reads a NaN byte as 480 (it catches a kernel that
        keeps those rows in one operand); on CUDA they are NaN (a kernel that zeroes only
        one operand gives 0 * NaN = NaN)."""
        g = torch.Generator().manual_seed(3)
        offs = make_offs([21, 0, 5, 40], self.device)
        m = int(offs[-1]) + 11
        x = torch.randn(m, 48, generator=g).to(self.device)
        dy = torch.randn(m, 32, generator=g).to(self.device)
        for name in ("fp8_rowwise", "fp8_tensorwise"):
            wg = RECIPES[name].wgrad
            qx, qdy, sx, sdy, gfb, block = S.kernel_wgrad_operands(x, dy, offs, wg)
            outs = []
            for fill in (0x00, 0x7F):  # zero, an e4m3 NaN
                for q in (qx, qdy):
                    q.view(torch.uint8)[int(offs[-1]) :] = fill
                outs.append(TK.scaled_grouped_mm_wgrad(qx, qdy, sx, sdy, offs, gfb, block))
            self.assertFalse(outs[1].isnan().any(), msg=name)
            self.assertEqual(outs[1], outs[0], atol=0, rtol=0, msg=name)
            self._assert_close(outs[0], S._emulate_wgrad(x, dy, offs, wg, torch.float32), 1e-4)


def emulate_torch_scaled_grouped_mm(qa, qb, sa, sb, offs):
    """What ``torch._scaled_grouped_mm`` computes, exactly (float64, test/naive.py's loop):
    per group g, (qa * sa[:, None])[rows of g] @ (qb[g] * sb[g][None, :]); with the float64
    products of the magnitudes, for the fp32 accumulation bound."""
    a64 = qa.double() * sa.double()[:, None]
    b64 = qb.double() * sb.double()[:, None, :]
    return naive.grouped_mm64(a64, b64, offs), naive.grouped_mm64(a64.abs(), b64.abs(), offs)


def fake_scaled_grouped_mm(qa, qb, sa, sb, offs, out_dtype):
    """torch._scaled_grouped_mm on CPU for the test: the fp32 grouped GEMM of the dequantized
    operands, rounded to ``out_dtype``, rows past the last group left NaN (unwritten)."""
    exact, _ = emulate_torch_scaled_grouped_mm(qa, qb, sa, sb, offs)
    out = exact.to(out_dtype)
    out[int(offs[-1]) :] = float("nan")
    return out


class TestTritonQuantizeInterpreted(_QuantizeChecks, TestCase):
    """Interpreted kernels, bit for bit against the references (fp32 and bf16 inputs)."""

    def test_torch_scaled_grouped_mm_operands(self):
        """The rowwise / tensorwise path through ``torch._scaled_grouped_mm`` (Hopper): its
        operands, built here by the interpreted kernels, pass torch's meta kernel (dtypes,
        row-/column-major strides, scale shapes), and what that op computes with them
        (emulated) equals the recipe's emulation."""
        g = torch.Generator().manual_seed(4)
        offs = make_offs([40, 0, 71, 17])
        x = torch.randn(130, 64, generator=g).bfloat16()
        w = (torch.randn(4, 48, 64, generator=g) / 8).bfloat16().transpose(1, 2)  # [E, K, N]
        for name in ("fp8_rowwise", "fp8_tensorwise"):
            r = RECIPES[name]
            for gq, a, b in (
                (r.forward, x, w),
                (r.dgrad, torch.randn(130, 48).bfloat16(), w.transpose(1, 2)),
            ):
                with self.subTest(recipe=name, k=a.shape[1]):
                    k, n = a.shape[1], b.shape[2]
                    self.assertEqual(
                        S.gemm_kernel(gq, k, n, torch.bfloat16, "cuda", (9, 0)), "torch"
                    )
                    self.assertEqual(S.gemm_kernel(gq, k, n, torch.bfloat16, "cpu"), "emulate")
                    qa, qb, sa, sb = S.torch_scaled_operands(a, b, gq)
                    meta = [t.to("meta") for t in (qa, qb, sa, sb)]
                    self.assertEqual(meta[1].stride(), qb.stride())  # column-major kept
                    out = torch._scaled_grouped_mm(
                        *meta, offs=offs.to("meta"), out_dtype=torch.bfloat16
                    )
                    self.assertEqual((out.shape, out.dtype), ((130, b.shape[2]), torch.bfloat16))
                    # the recipe's emulation (the CPU kernel) equals what torch's op computes
                    # from these operands, within the fp32 accumulation bound
                    exact, products = emulate_torch_scaled_grouped_mm(qa, qb, sa, sb, offs)
                    ref = S._emulate_gemm(a.float(), b.float(), offs, gq, torch.float32)
                    bound = tolerances.gemm_bound(products, k, exact, torch.float32, F32)
                    tolerances.assert_within(self, ref, exact, bound, name)
                    # the launch itself (S._torch_gemm) with torch's op replaced by its
                    # emulation, leaving the rows past offs[-1] NaN (torch does not write them)
                    with mock.patch.object(torch, "_scaled_grouped_mm", fake_scaled_grouped_mm):
                        got = S._torch_gemm(a, b, offs, gq)
                    self.assertEqual(got.dtype, torch.bfloat16)
                    end = int(offs[-1])
                    self.assertTrue(torch.equal(got[end:], torch.zeros_like(got[end:])))
                    bf16_bound = tolerances.gemm_bound(products, k, exact, F32, torch.bfloat16)
                    tolerances.assert_within(self, got, exact, bf16_bound, f"{name} launch")
        # not for: other recipes, fp32 outputs, K or N not a multiple of 16
        bw = RECIPES["fp8_blockwise"].forward
        rw = RECIPES["fp8_rowwise"].forward
        hopper = ("cuda", (9, 0))
        self.assertEqual(S.gemm_kernel(bw, 64, 48, torch.bfloat16, *hopper), "triton")
        self.assertEqual(S.gemm_kernel(rw, 64, 48, torch.float32, *hopper), "triton")
        self.assertEqual(S.gemm_kernel(rw, 40, 48, torch.bfloat16, *hopper), "triton")
        self.assertEqual(S.gemm_kernel(rw, 64, 40, torch.bfloat16, *hopper), "triton")
        self.assertEqual(S.gemm_kernel(rw, 64, 48, torch.bfloat16, "cuda", (10, 0)), "triton")
        self.assertEqual(
            S.gemm_kernel(rw, 64, 48, torch.bfloat16, *hopper, has_torch_scaled_grouped_mm=False),
            "triton",
        )

    def test_kernel_operands_equal_references(self):
        """The operands the Triton GEMMs get (quantized K-major by the interpreted quantize
        kernels: S._kernel_operands for forward / dgrad, S._quantize_jagged_mmajor for
        wgrad) are bit for bit the reference quantizers' (S.quantize_lhs / quantize_rhs /
        quantize_wgrad_operand), for every recipe; the wgrad slot layout maps back through
        S.jagged_slot_index. Fast: no GEMM runs in the interpreter."""
        g = torch.Generator().manual_seed(9)
        offs = make_offs([40, 0, 1, 29])
        m, k, n = 73, 160, 64
        a = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)
        b = torch.randn(4, k, n, generator=g)
        fp32_scales = lambda s: Q.e8m0_to_float(s) if s.dtype == torch.uint8 else s  # noqa: E731
        for name, r in RECIPES.items():
            kk = k if r.forward.lhs.fmt == "fp8" else 128  # MX: K a multiple of 32
            for gemm, (lhs_t, rhs_t) in (
                ("forward", (a[:, :kk], b[:, :kk])),
                ("dgrad", (a[:, :n], b[:, :kk].transpose(1, 2))),
            ):
                gq = getattr(r, gemm)
                with self.subTest(recipe=name, gemm=gemm):
                    qa, qb, sa, sb = S._kernel_operands(lhs_t, rhs_t, gq.lhs, gq.rhs)
                    rqa, rsa = S.quantize_lhs(lhs_t, gq.lhs)
                    rqb, rsb = S.quantize_rhs(rhs_t, gq.rhs)
                    self.assertEqual(qb.stride(-2), 1, msg="B K-major")
                    self.assertTrue(torch.equal(_bits(qa), _bits(rqa)))
                    self.assertTrue(torch.equal(_bits(qb), _bits(rqb)))
                    self.assertTrue(torch.equal(sa, fp32_scales(rsa).reshape(sa.shape)))
                    self.assertTrue(torch.equal(sb, fp32_scales(rsb).reshape(sb.shape)))
            for t in (a[:, :64],):
                op = r.wgrad.lhs
                with self.subTest(recipe=name, gemm="wgrad"):
                    q, sc = S._quantize_jagged_mmajor(t, offs, op)
                    rq, rs = S.quantize_wgrad_operand(t, offs, op)
                    self.assertTrue(torch.equal(sc, fp32_scales(rs).reshape(sc.shape)))
                    if op.inner == -1:  # token order
                        self.assertTrue(torch.equal(_bits(q), _bits(rq)))
                        continue
                    first, last, _ = TQ.jagged_block_table(offs, m, op.inner)
                    index = S.jagged_slot_index(first, last, op.inner)
                    rows = index >= 0
                    self.assertTrue(torch.equal(_bits(q)[rows], _bits(rq)[index[rows]]))
                    self.assertTrue(torch.equal(_bits(q)[~rows], torch.zeros_like(_bits(q)[~rows])))

    def test_kernel_operands_long_blocks(self):
        """Blocks too long for one program (here: made so) go through the torch quantize op
        into the same K-major buffers: still the reference quantizers' operands."""
        g = torch.Generator().manual_seed(10)
        a, b = torch.randn(9, 64, generator=g), torch.randn(2, 64, 16, generator=g)
        r = RECIPES["fp8_rowwise"].forward
        with mock.patch.object(TQ, "supports", return_value=False):
            qa, qb, sa, sb = S._kernel_operands(a, b, r.lhs, r.rhs)
        rqa, rsa = S.quantize_lhs(a, r.lhs)
        rqb, rsb = S.quantize_rhs(b, r.rhs)
        self.assertEqual(qb.stride(-2), 1, msg="B K-major")
        for got, want in ((qa, rqa), (qb, rqb), (sa, rsa), (sb, rsb)):
            self.assertTrue(torch.equal(_bits(got), _bits(want.reshape(got.shape))))

    def test_blocks(self):
        self.check_blocks(37, 160, torch.float32)

    def test_blocks_bf16(self):
        self.check_blocks(33, 64, torch.bfloat16)

    def test_weights_kmajor(self):
        self.check_weights_kmajor(2, 256, 48)

    def test_jagged(self):
        self.check_jagged([0, 50, 0, 80, 170], 24)

    def test_gemms_match_emulation(self):
        # every GEMM kernel (mxfp8_rceil runs mxfp8's kernels: its rule is the quantizer's,
        # bitwise-tested in test_blocks; the interpreter costs ~4 s a recipe), partial K
        # blocks (K=160), an empty group, rows past offs[-1]
        recipes = [name for name in RECIPES if name != "mxfp8_rceil"]
        self.check_gemms([20, 0, 37, 9], 160, 64, tol=2e-5, recipes=recipes)

    def test_wgrad_ignores_rows_outside_groups(self):
        self.check_wgrad_outside_groups()

    def test_tensorwise_given_scale(self):
        # whole-matrix blocks larger than one program: torch amax, then the kernel's one pass
        from unittest import mock

        with mock.patch.object(TQ, "MAX_BLOCK_ELEMS", 64):
            for shape in [(37, 300), (3, 40, 50)]:
                x = hard_input(shape[-2] * (shape[0] if len(shape) == 3 else 1), shape[-1])
                x = x.reshape(shape)
                self._assert_same(TQ.quantize_blocks(x, (-1, -1)), Q.quantize_fp8_reference(x))

    def test_bad_input(self):
        x = torch.randn(8, 64)
        with self.assertRaisesRegex(ValueError, "MX blocks must tile x exactly"):
            TQ.quantize_blocks(x[:, :40], (1, 32), fmt="mx")
        with self.assertRaisesRegex(ValueError, "fmt must be 'fp8' or 'mx'"):
            TQ.quantize_blocks(x, (1, 32), fmt="nvfp4")
        with self.assertRaisesRegex(ValueError, "too large for one program"):
            TQ.quantize_blocks(torch.randn(20000, 2), (-1, 1))  # columnwise over 20000 rows
        with self.assertRaisesRegex(ValueError, "expected x to be 2D or 3D"):
            TQ.quantize_blocks(torch.randn(2, 2, 2, 2), (1, 1))
        with self.assertRaisesRegex(ValueError, "slots=True needs block 32 or 128"):
            TQ.quantize_jagged(x, make_offs([8]), block=-1, slots=True)
        q = torch.zeros(8, 64, dtype=FP8)
        offs = make_offs([8])
        with self.assertRaisesRegex(ValueError, r"need sa \[8 or 1, 1\]"):
            TK.scaled_grouped_mm(q, q.reshape(1, 64, 8), torch.ones(8, 2), torch.ones(1, 1, 1),
                                 offs, block_k=128, block_n=128)  # fmt: skip
        with self.assertRaisesRegex(ValueError, "expected float8_e4m3fn operands"):
            TK.scaled_grouped_mm(x, q.reshape(1, 64, 8), torch.ones(8, 1), torch.ones(1, 1, 1),
                                 offs, block_k=-1, block_n=-1)  # fmt: skip


def _op_cases(device="cpu"):
    """(op, args, reference result) for every quantize / dequantize custom op."""
    x = hard_input(64, 96, device)
    offs = make_offs([0, 17, 23], device)
    q, s = Q.quantize_fp8_reference(x, (1, 32))
    qm, sm = Q.quantize_mx_reference(x, dim=-2)
    qj, sj = Q.quantize_jagged_reference(x, offs, block=32, fmt="mx", scale_dtype=torch.uint8)
    ops = torch.ops.torch_moe
    return [
        (ops.quantize_fp8.default, (x, [1, 32]), (q, s)),
        (ops.quantize_fp8.default, (x.reshape(2, 32, 96), [-1, -1]),
         Q.quantize_fp8_reference(x.reshape(2, 32, 96))),
        (ops.quantize_mx.default, (x, -2, 32, "floor"), (qm, sm)),
        (ops.quantize_mx.default, (x, -1, 32, "rceil"), Q.quantize_mx_reference(x, scale_rule="rceil")),
        (ops.quantize_jagged.default, (x, offs, 32, "mx", "floor"), (qj, sj)),
        (ops.quantize_jagged.default, (x, offs, -1, "fp8", "floor"),
         Q.quantize_jagged_reference(x, offs, block=-1)),
        (ops.dequantize_fp8.default, (q, s, [1, 32], torch.bfloat16),
         Q.dequantize_fp8_reference(q, s, (1, 32), torch.bfloat16)),
        (ops.dequantize_mx.default, (qm, sm, -2, 32, torch.float32), Q.dequantize_mx_reference(qm, sm, dim=-2)),
        (ops.dequantize_jagged.default, (qj, sj, offs, 32, torch.float32),
         Q.dequantize_jagged_reference(qj, sj, offs, block=32)),
    ]  # fmt: skip


class TestQuantizeOps(TestCase):
    """torch.ops.torch_moe.(de)quantize_*: schema, fake kernels (opcheck), torch.compile."""

    def test_ops_equal_references(self):
        for op, args, ref in _op_cases():
            with self.subTest(op=str(op)):
                got = op(*args)
                for a, b in zip(got if isinstance(got, tuple) else (got,),
                                ref if isinstance(ref, tuple) else (ref,)):  # fmt: skip
                    self.assertTrue(torch.equal(_bits(a), _bits(b)))

    def test_opcheck(self):
        for op, args, _ in _op_cases():
            with self.subTest(op=str(op)):
                utils = (
                    "test_faketensor",
                    "test_autograd_registration",
                    "test_aot_dispatch_dynamic",
                )
                if not any(isinstance(a, torch.Tensor) and a.dtype == FP8 for a in args):
                    utils += ("test_schema",)  # (its input check multiplies: no fp8 kernel)
                torch.library.opcheck(op, args, test_utils=utils)

    def test_bad_input(self):
        ops = torch.ops.torch_moe
        x = torch.randn(8, 40)
        with self.assertRaisesRegex(ValueError, r"dim 1 has size 40, not a multiple of the block"):
            ops.quantize_mx(x, -1, 32, "floor")
        with self.assertRaisesRegex(ValueError, "fmt must be 'fp8' or 'mx', got 'nvfp4'"):
            ops.quantize_jagged(x, make_offs([8]), 32, "nvfp4", "floor")
        with self.assertRaisesRegex(TypeError, "expected x to be one of"):
            ops.quantize_fp8(x.int(), [1, 32])
        with self.assertRaisesRegex(ValueError, r"needs scale of shape \[8, 2\], got \[8, 3\]"):
            q, _ = ops.quantize_fp8(x, [1, 32])
            ops.dequantize_fp8(q, torch.ones(8, 3), [1, 32], torch.float32)
        with torch._subclasses.fake_tensor.FakeTensorMode():  # the fake kernels check too
            with self.assertRaisesRegex(ValueError, "block must be \\(rows, cols\\)"):
                ops.quantize_fp8(torch.empty(8, 40), [1, 32, 1])

    def test_compile_fullgraph(self):
        def f(x):
            q, s = torch.ops.torch_moe.quantize_fp8(x, [1, 128])
            return torch.ops.torch_moe.dequantize_fp8(q, s, [1, 128], torch.float32)

        x = torch.randn(8, 256)
        torch._dynamo.reset()
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
        self.assertTrue(torch.equal(got, f(x)))


class TestTritonQuantizeDevice(_QuantizeChecks, TestCase):
    """Compiled kernels on the GPU: the same checks at sizes that fill several programs.
    Device-generic (instantiate_device_type_tests): .ci/gpu runs it on cuda."""

    @property
    def device(self):
        return self.device_type

    @onlyCUDA
    def test_blocks_cuda(self, device):
        self.check_blocks(515, 1024, torch.bfloat16)
        self.check_blocks(300, 448, torch.float32)

    @onlyCUDA
    def test_weights_kmajor_cuda(self, device):
        self.check_weights_kmajor(4, 512, 384)

    @onlyCUDA
    def test_jagged_cuda(self, device):
        self.check_jagged([0, 500, 0, 129, 1700, 3], 200)

    @onlyCUDA
    def test_wgrad_ignores_rows_outside_groups_cuda(self, device):
        self.check_wgrad_outside_groups()

    @onlyCUDA
    def test_gemms_match_emulation_cuda(self, device):
        self.check_gemms([300, 0, 517, 129, 1], 704, 384, tol=1e-4)

    @onlyCUDA
    def test_torch_scaled_grouped_mm_cuda(self, device):
        """bf16 rowwise / tensorwise forward and dgrad run on torch._scaled_grouped_mm on
        Hopper: against the emulation, rows past the last group zero."""
        if torch.cuda.get_device_capability() != (9, 0):
            self.skipTest("torch._scaled_grouped_mm path: sm_90 only")
        g = torch.Generator().manual_seed(5)
        offs = make_offs([300, 0, 517, 129, 1], "cuda")
        m = int(offs[-1]) + 5
        x = torch.randn(m, 704, generator=g).bfloat16().cuda()
        w = (torch.randn(5, 384, 704, generator=g) / 16).bfloat16().cuda().transpose(1, 2)
        dy = torch.randn(m, 384, generator=g).bfloat16().cuda()
        for name in ("fp8_rowwise", "fp8_tensorwise"):
            r = RECIPES[name]
            with self.subTest(recipe=name):
                self.assertEqual(S._select(r.forward, x, w, torch.bfloat16), "torch")
                out = S._torch_gemm(x, w, offs, r.forward)
                self._assert_close(
                    out.float(),
                    S._emulate_gemm(x.float(), w.float(), offs, r.forward, torch.float32),
                    0,
                )
                self.assertTrue(
                    torch.equal(out[int(offs[-1]) :].cpu(), torch.zeros(5, 384).bfloat16())
                )
                w_t = w.transpose(1, 2)
                dx = S._torch_gemm(dy, w_t, offs, r.dgrad)
                ref = S._emulate_gemm(
                    dy.float(), w.float().transpose(-2, -1), offs, r.dgrad, torch.float32
                )
                self._assert_close(dx.float(), ref, 0)

    @onlyCUDA
    def test_ops_cuda_equal_cpu(self, device):
        for (op, args, _), (_, args_cuda, _) in zip(_op_cases(), _op_cases("cuda")):
            with self.subTest(op=str(op)):
                got, ref = op(*args_cuda), op(*args)
                for a, b in zip(got if isinstance(got, tuple) else (got,),
                                ref if isinstance(ref, tuple) else (ref,)):  # fmt: skip
                    self.assertTrue(torch.equal(_bits(a).cpu(), _bits(b)))

    @onlyCUDA
    def test_autograd_cuda_vs_cpu(self, device):
        g = torch.Generator().manual_seed(3)
        offs = make_offs([96, 0, 160, 256])
        x = torch.randn(520, 512, generator=g)
        w = torch.randn(4, 256, 512, generator=g).transpose(1, 2) / 16
        dy = torch.randn(520, 256, generator=g)
        for name in RECIPES:
            with self.subTest(recipe=name):
                outs = []
                for dev in ("cpu", "cuda"):
                    xd = x.detach().to(dev).requires_grad_()
                    wd = w.detach().to(dev).requires_grad_()
                    out = scaled_grouped_mm(xd, wd, offs.to(dev), name)
                    out.backward(dy.to(dev))
                    outs.append([out.detach().cpu(), xd.grad.cpu(), wd.grad.cpu()])
                for a, b in zip(*outs):
                    self.assertGreater(sqnr(a, b), MIN_KERNEL_VS_EMULATION_DB)


class TestStaticSm90(TestCase):
    """Every FP8 kernel AOT-compiles for sm_90a without a GPU: the GEMMs issue FP8 wgmma
    (e4m3 operands) and nothing spills. Registers are reported (printed with -v)."""

    def _report(self, k):
        print(f"\n{k.name}: {k.n_regs} registers, {k.n_spills} spill bytes, {k.shared} B smem")

    @parametrize("kind", ["blockwise", "mx", "rowwise", "tensorwise"])
    @parametrize("kernel", ["forward", "wgrad"])
    def test_scaled_gemm_sm90(self, kernel, kind):
        k = TK.compile_for_sm90(kernel, kind)
        self._report(k)
        ptx = k.asm["ptx"]
        # MX dequantizes to bf16 in the loop (exact); the FP8 recipes run FP8 wgmma
        ops = r"k16\.f32\.bf16\.bf16" if kind == "mx" else r"k32\.f32\.e4m3\.e4m3"
        self.assertRegex(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n\d+" + ops)
        self.assertEqual(k.n_spills, 0)

    @parametrize(
        "kw",
        [
            dict(kernel="blocks", block=(1, 128)),
            dict(kernel="blocks", block=(128, 128)),
            dict(kernel="blocks", block=(1, 32), fmt="mx"),
            dict(kernel="blocks", block=(1, -1)),
            dict(kernel="jagged", block=128, slots=True),
            dict(kernel="jagged", block=32, fmt="mx", slots=True),
            dict(kernel="jagged", block=-1),
        ],
        name_fn=lambda kw: "_".join(str(v) for v in kw.values()).replace(" ", ""),
    )
    def test_quantize_sm90(self, kw):
        k = TQ.compile_for_sm90(**kw)
        self._report(k)
        self.assertIn("cvt.rn.satfinite.e4m3x2.f32", k.asm["ptx"])
        self.assertEqual(k.n_spills, 0)


instantiate_parametrized_tests(TestStaticSm90)
instantiate_device_type_tests(TestTritonQuantizeDevice, globals())

if __name__ == "__main__":
    run_tests()
