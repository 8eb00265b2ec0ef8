# Owner(s): ["module: moe"]
"""Tests for the fused small-batch MoE expert kernels (torch_moe._triton.moe_decode).

Without a GPU the kernels run in Triton's interpreter (CPU tensors select it) with fp32
dots, so the numerics are checked here against a float64 per-expert SwiGLU with the
first-order error bound of ``tolerances.swiglu_bound`` (fp32 accumulation, fp32
intermediates). FP8 weights are checked against the same oracle over the dequantized
weights (the kernel dequantizes in registers, so only the fp32 rounding of ``q * scale``
adds). Kernel quality is checked statically: the tables' configs compile for sm_90a
without a GPU, with wgmma from 64-row tiles on and no register spills (every config in
every weight mode with PYTORCH_TEST_WITH_SLOW=1; a cover of them by default).

Legend: T tokens, K top-k, E experts, D dim, F expert hidden dim, M padded rows.
"""

import dataclasses
import unittest

import torch
import triton
import triton.language as tl
from tolerances import assert_within, swiglu_bound
from torch.testing._internal.common_utils import (
    TEST_WITH_SLOW,
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from torch_moe import ops
from torch_moe._triton import moe_decode as MD
from torch_moe._triton.grouped_mm import SM90_MAX_SHARED, _interpreted, _ptxas_path
from torch_moe._triton.moe_decode import _block_expert
from torch_moe.quantization import dequantize_fp8, quantize_fp8


def inputs(T, K, E, D, F, *, skew=False, empty=(), seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * F, D, generator=gen) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, F, generator=gen) / F**0.5).to(dtype)
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    if skew:  # most assignments on the first allowed expert
        ids = torch.where(
            torch.rand(T, K, generator=gen) < 0.8,
            allowed[0],
            allowed[torch.randint(0, allowed.numel(), (T, K), generator=gen)],
        )
    else:
        ids = allowed[torch.randint(0, allowed.numel(), (T, K), generator=gen)]
    weights = torch.rand(T, K, generator=gen)
    return x, w13, w2, ids, weights


def layout(ids, weights, E, block_m):
    perm = ops.permute_indices(ids, E, align=block_m)
    padded = torch.cat([weights.reshape(-1), weights.new_zeros(1)])  # row -1 reads the 0
    return perm, padded[perm.row_to_slot]


def oracle(x, w13, w2, perm, rw, K):
    """(exact, bound) of every padded row's output in float64, expert by expert."""
    M, D = perm.row_to_slot.shape[0], x.shape[1]
    exact = torch.zeros(M, D, dtype=torch.float64)
    bound = torch.zeros(M, D, dtype=torch.float64)
    start = 0
    for e, end in enumerate(perm.offs.tolist()):
        rows = torch.arange(start, end)
        slots = perm.row_to_slot[rows]
        rows = rows[slots >= 0]
        if rows.numel():
            y, b = swiglu_bound(
                x[perm.row_to_slot[rows] // K], w13[e], w2[e], torch.float32, torch.float32,
                row_weights=rw[rows],
            )  # fmt: skip
            exact[rows], bound[rows] = y, b
        start = end
    return exact, bound


@triton.jit
def _block_expert_kernel(offs_ptr, E, out_ptr, BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr):
    """out[b] = the expert of block b, by the decode kernels' own lookup."""
    b = tl.program_id(0)
    e, _ends = _block_expert(offs_ptr, E, b * BLOCK_M, E_BLOCK)
    tl.store(out_ptr + b, e)


@instantiate_parametrized_tests
class TestMoEDecode(TestCase):
    @parametrize(
        "T,K,E,D,F,kw",
        [
            (1, 1, 4, 32, 48, {}),  # one token
            (5, 2, 4, 32, 48, {}),
            (7, 3, 6, 40, 24, {"empty": (1, 4)}),  # empty experts, odd-ish sizes
            (13, 2, 4, 16, 16, {"skew": True}),  # one expert takes most rows
            (3, 8, 16, 32, 16, {}),  # K = 8 of 16 experts (DeepSeek-like ratio)
        ],
    )
    def test_matches_oracle(self, T, K, E, D, F, kw):
        x, w13, w2, ids, weights = inputs(T, K, E, D, F, **kw)
        cfg = MD.config_for(T * K, interpret=True)
        perm, rw = layout(ids, weights, E, cfg.block_m)
        y = MD.moe_decode(x, w13, w2, perm.row_to_slot, perm.offs, rw, K)
        exact, bound = oracle(x, w13, w2, perm, rw, K)
        self.assertEqual(y.shape, (perm.row_to_slot.shape[0], D))
        assert_within(self, y, exact, bound)
        # padding rows are zeros, as the unfused path leaves them
        self.assertEqual(y[perm.row_to_slot < 0].abs().sum().item(), 0.0)
        # and the combined output equals the unfused layer's within the same bounds
        ref, _ = torch.ops.torch_moe.grouped_swiglu(
            x, w13, w2, perm.offs, rw, torch.where(perm.row_to_slot >= 0, perm.row_to_slot // K, -1)
        )
        out = ops.unpermute(y, None, perm)
        out_ref = ops.unpermute(ref, None, perm)
        self.assertEqual(out, out_ref, atol=1e-5, rtol=1e-5)

    def test_fp16_inputs(self):
        x, w13, w2, ids, weights = inputs(6, 2, 4, 32, 32, dtype=torch.float16)
        cfg = MD.config_for(12, interpret=True)
        perm, rw = layout(ids, weights, 4, cfg.block_m)
        y = MD.moe_decode(x, w13, w2, perm.row_to_slot, perm.offs, rw, 2)
        self.assertEqual(y.dtype, torch.float16)
        exact, bound = oracle(x.float(), w13.float(), w2.float(), perm, rw, 2)
        # fp32 compute, one rounding of the output to fp16
        bound = bound + exact.abs() * 2.0**-11 + 2.0**-24
        assert_within(self, y, exact, bound)

    def test_zero_tokens(self):
        x, w13, w2, ids, weights = inputs(0, 2, 4, 16, 16)
        perm, rw = layout(ids, weights, 4, 16)
        y = MD.moe_decode(x, w13, w2, perm.row_to_slot, perm.offs, rw, 2)
        self.assertEqual(y.shape, (perm.row_to_slot.shape[0], 16))
        self.assertEqual(y.abs().sum().item(), 0.0)

    @parametrize("scale_mode", ["rowwise", "blockwise"])
    def test_fp8_weights(self, scale_mode):
        T, K, E, D, F = 6, 2, 4, 128, 128
        x, w13, w2, ids, weights = inputs(T, K, E, D, F, empty=(2,))
        block = [1, -1] if scale_mode == "rowwise" else [128, 128]
        q13, s13 = quantize_fp8(w13, block)
        q2, s2 = quantize_fp8(w2, block)
        if scale_mode == "rowwise":
            self.assertEqual(s13.shape, (E, 2 * F, 1))
        cfg = MD.config_for(T * K, interpret=True)
        perm, rw = layout(ids, weights, E, cfg.block_m)
        y = MD.moe_decode(
            x, q13, q2, perm.row_to_slot, perm.offs, rw, K,
            w13_scale=s13, w2_scale=s2, scale_mode=scale_mode,
        )  # fmt: skip
        d13 = dequantize_fp8(q13, s13, block, torch.float32)
        d2 = dequantize_fp8(q2, s2, block, torch.float32)
        exact, bound = oracle(x, d13, d2, perm, rw, K)
        assert_within(self, y, exact, bound)

    def test_block_expert(self):
        # each program's lookup (the kernels' _block_expert, run by a kernel of the test in
        # Triton's interpreter): groups of 16, 0, 32 and 16 rows over 80 padded rows give
        # blocks 0 | 2 2 | 3 | past the end (-1); the empty group 1 owns no block
        offs = torch.tensor([16, 16, 48, 64], dtype=torch.int32)
        table = torch.full((5,), -9, dtype=torch.int32)
        _interpreted(_block_expert_kernel)[(5,)](offs, 4, table, BLOCK_M=16, E_BLOCK=4)
        self.assertEqual(table.tolist(), [0, 2, 2, 3, -1])
        # the same by the plain-PyTorch rule (the number of group ends at or before each
        # block's first row), over uneven groups with E not a power of two
        ends = torch.tensor([0, 32, 32, 96, 128, 128, 160], dtype=torch.int32)
        table = torch.empty(12, dtype=torch.int32)
        _interpreted(_block_expert_kernel)[(12,)](ends, 7, table, BLOCK_M=16, E_BLOCK=8)
        want = torch.searchsorted(ends, torch.arange(0, 192, 16, dtype=torch.int32), right=True)
        self.assertEqual(table, torch.where(want < 7, want, -1).int(), atol=0, rtol=0)

    def test_config_tables(self):
        # every table in the data file: bounds increasing, configs well formed; an
        # untuned GPU gets the default table
        for name in MD._read_config_file():
            table = MD.load_configs(name)
            for cfg in table.values():
                self.assertIn(cfg.block_m, (16, 32, 64, 128))
                self.assertEqual(cfg.block_n % 16 + cfg.block_k % 16, 0)
        self.assertEqual(MD.load_configs("no such GPU"), MD.CONFIGS)

    def test_config_for(self):
        bounds = sorted(MD.CONFIGS)
        self.assertEqual(MD.config_for(1), MD.CONFIGS[bounds[0]])
        self.assertEqual(MD.config_for(bounds[0] + 1), MD.CONFIGS[bounds[1]])
        self.assertEqual(MD.config_for(1 << 40), MD.CONFIGS[bounds[-1]])
        self.assertEqual(MD.config_for(10**6, interpret=True).block_m, 16)

    def test_errors(self):
        x, w13, w2, ids, weights = inputs(4, 2, 4, 32, 48)
        perm, rw = layout(ids, weights, 4, 16)
        args = (perm.row_to_slot, perm.offs, rw, 2)
        with self.assertRaisesRegex(
            ValueError, "scale_mode must be None, 'rowwise' or 'blockwise', got 'tensorwise'"
        ):
            MD.moe_decode(x, w13, w2, *args, scale_mode="tensorwise")
        with self.assertRaisesRegex(ValueError, r"moe_decode: shapes disagree: x \(4, 32\)"):
            MD.moe_decode(x, w13, w2[:, :16], *args)
        with self.assertRaisesRegex(ValueError, r"offs must be int32 \[E=4\], got torch.int64"):
            MD.moe_decode(x, w13, w2, perm.row_to_slot, perm.offs.long(), rw, 2)
        with self.assertRaisesRegex(ValueError, r"row_weights must be \[M="):
            MD.moe_decode(x, w13, w2, perm.row_to_slot, perm.offs, rw[1:], 2)
        with self.assertRaisesRegex(ValueError, "top_k must be >= 1, got 0"):
            MD.moe_decode(x, w13, w2, perm.row_to_slot, perm.offs, rw, 0)
        with self.assertRaisesRegex(ValueError, "got x torch.float64, w13 torch.float64"):
            MD.moe_decode(x.double(), w13.double(), w2.double(), *args)
        with self.assertRaisesRegex(ValueError, "got x torch.float32, w13 torch.float16"):
            MD.moe_decode(x, w13.half(), w2.half(), *args)
        with self.assertRaisesRegex(RuntimeError, "must end on a multiple of BLOCK_M=16"):
            unaligned = ops.permute_indices(ids, 4)
            MD.moe_decode(
                x, w13, w2, unaligned.row_to_slot, unaligned.offs, unaligned.row_to_slot.float(), 2
            )
        with self.assertRaisesRegex(ValueError, "FP8 .* need a scale_mode .* scale_mode='rowwise'"):
            MD.moe_decode(x, w13, w2, *args, scale_mode="rowwise")


@unittest.skipIf(not torch.cuda.is_available(), "needs a CUDA GPU")
class TestMoEDecodeCUDA(TestCase):
    """The compiled kernels on the GPU, bf16 tokens and weights (bf16 intermediate and
    output, fp32 accumulation: the bound's dtype / acc), and FP8 rowwise weights."""

    def test_bf16(self):
        for T, K, E, D, F in [
            (1, 8, 128, 2048, 768),
            (16, 8, 128, 2048, 768),
            (300, 2, 8, 512, 1024),
        ]:
            x, w13, w2, ids, weights = inputs(T, K, E, D, F, dtype=torch.bfloat16)
            cfg = MD.config_for(T * K)
            perm, rw = layout(ids, weights, E, cfg.block_m)
            dev = [t.cuda() for t in (x, w13, w2, perm.row_to_slot, perm.offs, rw)]
            y = MD.moe_decode(*dev, K).cpu()
            exact, _ = oracle(x.float(), w13.float(), w2.float(), perm, rw, K)
            bound = torch.zeros_like(exact)
            start = 0
            for e, end in enumerate(perm.offs.tolist()):
                rows = torch.arange(start, end)
                rows = rows[perm.row_to_slot[rows] >= 0]
                if rows.numel():
                    _, bound[rows] = swiglu_bound(
                        x[perm.row_to_slot[rows] // K], w13[e], w2[e], torch.bfloat16,
                        torch.float32, row_weights=rw[rows],
                    )  # fmt: skip
                start = end
            assert_within(self, y, exact, bound, msg=f"T={T}")

    def test_fp8_rowwise(self):
        T, K, E, D, F = 16, 8, 64, 1024, 512
        x, w13, w2, ids, weights = inputs(T, K, E, D, F)
        q13, s13 = quantize_fp8(w13, [1, -1])
        q2, s2 = quantize_fp8(w2, [1, -1])
        perm, rw = layout(ids, weights, E, MD.config_for(T * K).block_m)
        y = MD.moe_decode(
            *[t.cuda() for t in (x, q13, q2, perm.row_to_slot, perm.offs, rw)], K,
            w13_scale=s13.cuda(), w2_scale=s2.cuda(), scale_mode="rowwise",
        ).cpu()  # fmt: skip
        d13 = dequantize_fp8(q13, s13, [1, -1], torch.float32)
        d2 = dequantize_fp8(q2, s2, [1, -1], torch.float32)
        exact, bound = oracle(x, d13, d2, perm, rw, K)
        assert_within(self, y, exact, bound)


SCALE_MODES = (None, "rowwise", "blockwise")


def sm90_cover(
    kernel: str, scale_mode: str | None, configs: list, full: bool = TEST_WITH_SLOW
) -> list:
    """The configs that ``(kernel, scale_mode)`` compiles in the default suite: a cover in
    which each kernel compiles every config and every weight mode at least once (3 configs:
    6 compiles instead of 18, each 0.5-5 s of ptxas on a cold cache). With
    ``PYTORCH_TEST_WITH_SLOW=1`` (``full``): every config in every mode."""
    if full:
        return configs
    k, m = ("w13", "w2").index(kernel), SCALE_MODES.index(scale_mode)
    n = max(len(configs), len(SCALE_MODES))
    return [configs[(i + k) % len(configs)] for i in range(n) if i % len(SCALE_MODES) == m]


@unittest.skipIf(_ptxas_path() is None, "no ptxas for sm_90a in this triton install")
@instantiate_parametrized_tests
class TestMoEDecodeSm90(TestCase):
    """The tables' configs of both kernels AOT-compile for sm_90a in every weight mode: no
    spills, wgmma for the 64-row tiles (16-row tiles are below wgmma's M=64: mma.sync)."""

    def test_cover(self):
        configs = ["c0", "c1", "c2", "c3"]
        for kernel in ("w13", "w2"):
            cover = [sm90_cover(kernel, m, configs, full=False) for m in SCALE_MODES]
            self.assertTrue(all(cover), msg=kernel)  # every mode compiles something
            self.assertEqual(sorted(c for cs in cover for c in cs), configs)  # every config

    @parametrize("kernel", ["w13", "w2"])
    @parametrize("scale_mode", SCALE_MODES)
    def test_compiles_without_spills(self, kernel, scale_mode):
        configs = {c for name in MD._read_config_file() for c in MD.load_configs(name).values()}
        for cfg in sm90_cover(kernel, scale_mode, sorted(configs, key=dataclasses.astuple)):
            k = MD.compile_for_sm90(kernel, 64, scale_mode=scale_mode, config=cfg)
            ptx = k.compiled.asm["ptx"]
            self.assertEqual(k.n_spills, 0, msg=f"{cfg}: {k.ptxas_log}")
            self.assertLessEqual(k.shared, SM90_MAX_SHARED, msg=str(cfg))  # or no launch
            if cfg.block_m >= 64:
                self.assertIn("wgmma.mma_async", ptx, msg=str(cfg))
            else:
                self.assertIn("mma.sync", ptx, msg=str(cfg))


if __name__ == "__main__":
    run_tests()
