# Owner(s): ["module: moe"]
"""Tests for the persistent Triton grouped GEMM (torch_moe._triton.grouped_mm).

Without a GPU the launchers run the kernels in Triton's interpreter (CPU tensors select it,
whatever TRITON_INTERPRET was at import), so the numerics are checked here against a plain
float64 loop, on small shapes: the interpreter is slow. fp16 and fp32 only (plus one bf16
check of the upcast workaround): the interpreter's bf16 tl.dot is broken in triton 3.9.

Kernel quality is checked statically: both kernels are compiled for sm_90a without a GPU and
must use wgmma and not spill registers. Run with ``-s`` to see the register table.

Legend: M rows, K in-features, N out-features, E groups.
"""

import unittest
from unittest import mock

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
from torch.utils._python_dispatch import TorchDispatchMode

from torch_moe._triton import grouped_mm as gm
from torch_moe._triton.grouped_mm import compile_for_sm90, grouped_mm, grouped_mm_wgrad


def assert_within_bound(test, got, x, w, offs, wgrad=False, truncating=False):
    """``got`` within tolerances.gemm_bound of the float64 loop: fp32 accumulation of the
    exact products and one rounding into ``got``'s dtype (``truncating``: the interpreter's
    bf16 store truncates, an error of up to 2u instead of u)."""
    ref = ref_grouped_mm_wgrad if wgrad else ref_grouped_mm
    exact = ref(x, w, offs)
    products = ref(x.abs(), w.abs(), offs)
    sizes = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    n = int(sizes.max()) if wgrad and offs.numel() else x.shape[1]
    bound = tolerances.gemm_bound(products, max(n, 1), exact, torch.float32, got.dtype)
    if truncating:
        bound = bound + tolerances.UNIT_ROUNDOFF[got.dtype] * (exact.abs() + bound)
    tolerances.assert_within(test, got.cpu(), exact, bound)


def ref_grouped_mm(x_MK, w_EKN, offs_E):
    """out[rows of g] = x[rows of g] @ w[g] in float64, group by group; zeros past offs[-1]."""
    out_MN = torch.zeros(x_MK.shape[0], w_EKN.shape[2], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs_E.tolist()):
        out_MN[start:end] = x_MK[start:end].double() @ w_EKN[g].double()
        start = end
    return out_MN


def ref_grouped_mm_wgrad(x_MK, dy_MN, offs_E):
    """dw[g] = x[rows of g]^T @ dy[rows of g] in float64; zeros for empty groups."""
    dw_EKN = torch.zeros(offs_E.numel(), x_MK.shape[1], dy_MN.shape[1], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs_E.tolist()):
        dw_EKN[g] = x_MK[start:end].double().T @ dy_MN[start:end].double()
        start = end
    return dw_EKN


def ends(*sizes):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def randn(*shape, dtype):
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


def non_contiguous(t):
    """The same values with every stride doubled (a strided view of a bigger buffer)."""
    big = torch.full([2 * s for s in t.shape], float("nan"), dtype=t.dtype)
    view = big[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


# (name, M, K, N, group sizes, padding rows past offs[-1])
FWD_CASES = [
    ("odd_kn_empty_groups_tail", 40, 17, 33, (5, 0, 15, 11), 9),
    ("all_rows_one_group", 37, 24, 20, (0, 37, 0), 0),
    ("one_group", 21, 40, 16, (21,), 0),
    ("all_groups_empty", 10, 16, 18, (0, 0), 10),
    ("no_rows", 0, 16, 18, (0, 0, 0), 0),
]


class TestTritonGroupedMM(TestCase):
    # --- forward, interpreter -------------------------------------------------------

    @parametrize("dtype", [torch.float16, torch.float32])
    @parametrize("w_layout", ["ENK_transposed", "EKN"])
    @parametrize("case", FWD_CASES, name_fn=lambda c: c[0])
    def test_grouped_mm(self, case, w_layout, dtype):
        _, M, K, N, sizes, tail = case
        torch.manual_seed(0)
        offs = ends(*sizes)
        self.assertEqual(int(offs[-1]) + tail, M)
        x = randn(M, K, dtype=dtype)
        if w_layout == "EKN":
            w = randn(len(sizes), K, N, dtype=dtype)
        else:  # nn.Linear-style weights used as is
            w = randn(len(sizes), N, K, dtype=dtype).transpose(-2, -1)
        out = grouped_mm(x, w, offs)
        self.assertEqual(out.shape, (M, N))
        self.assertEqual(out.dtype, dtype)
        assert_within_bound(self, out, x, w, offs)
        self.assertTrue(bool((out[int(offs[-1]) :] == 0).all()))

    @parametrize("dtype", [torch.float16, torch.float32])
    def test_grouped_mm_strided_inputs_and_out(self, dtype):
        # Non-contiguous x, w and out; out starts as NaN so every element must be written
        # (the padding rows with exact zeros).
        torch.manual_seed(1)
        M, K, N = 30, 19, 17
        offs = ends(7, 0, 13)
        x = non_contiguous(randn(M, K, dtype=dtype))
        w = non_contiguous(randn(3, K, N, dtype=dtype))
        out = non_contiguous(torch.zeros(M, N, dtype=dtype)).fill_(float("nan"))
        result = grouped_mm(x, w, offs, out=out)
        self.assertIs(result, out)
        assert_within_bound(self, out, x, w, offs)
        self.assertTrue(bool((out[20:] == 0).all()))

    def test_grouped_mm_column_major_x(self):
        torch.manual_seed(2)
        M, K, N = 33, 18, 16
        offs = ends(16, 17)
        x = randn(K, M, dtype=torch.float16).t()  # stride (1, M)
        w = randn(2, K, N, dtype=torch.float16)
        out = grouped_mm(x, w, offs)
        assert_within_bound(self, out, x, w, offs)

    def test_grouped_mm_bf16_interpreter_upcast(self):
        torch.manual_seed(3)
        x = randn(20, 17, dtype=torch.bfloat16)
        w = randn(2, 17, 18, dtype=torch.bfloat16)
        offs = ends(9, 6)
        out = grouped_mm(x, w, offs)
        assert_within_bound(self, out, x, w, offs, truncating=True)
        self.assertTrue(bool((out[15:] == 0).all()))

    # --- wgrad, interpreter ---------------------------------------------------------

    @parametrize("dtype", [torch.float16, torch.float32])
    @parametrize("case", FWD_CASES, name_fn=lambda c: c[0])
    def test_grouped_mm_wgrad(self, case, dtype):
        _, M, K, N, sizes, _ = case
        torch.manual_seed(4)
        offs = ends(*sizes)
        x = randn(M, K, dtype=dtype)
        dy = randn(M, N, dtype=dtype)
        dw = grouped_mm_wgrad(x, dy, offs)
        self.assertEqual(dw.shape, (len(sizes), K, N))
        self.assertEqual(dw.dtype, dtype)
        assert_within_bound(self, dw, x, dy, offs, wgrad=True)
        for g, size in enumerate(sizes):
            if size == 0:
                self.assertTrue(bool((dw[g] == 0).all()))

    def test_grouped_mm_wgrad_strided_out_dtype(self):
        torch.manual_seed(5)
        M, K, N = 35, 17, 20
        offs = ends(3, 0, 20, 12)
        x = non_contiguous(randn(M, K, dtype=torch.float16))
        dy = randn(N, M, dtype=torch.float16).t()  # column-major
        dw = grouped_mm_wgrad(x, dy, offs, out_dtype=torch.float32)
        self.assertEqual(dw.dtype, torch.float32)
        self.assertEqual(dw.double(), ref_grouped_mm_wgrad(x, dy, offs), atol=1e-4, rtol=1e-5)

    # --- contract: no host sync -----------------------------------------------------

    def test_no_host_sync(self):
        # .item(), bool(t), int(t) reach aten::_local_scalar_dense (seen by a dispatch mode);
        # .tolist() reads memory directly, so it is patched to fail.
        class RecordOps(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.ops = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.ops.append(str(func))
                return func(*args, **(kwargs or {}))

        x = randn(20, 16, dtype=torch.float16)
        w = randn(2, 16, 16, dtype=torch.float16)
        offs = ends(5, 10)
        no_tolist = mock.patch.object(
            torch.Tensor, "tolist", side_effect=AssertionError("host sync: Tensor.tolist")
        )
        with RecordOps() as mode, no_tolist:
            grouped_mm(x, w, offs)
            grouped_mm_wgrad(x, x, offs)
        self.assertIn("aten.empty.memory_format", mode.ops)  # the mode saw the launchers
        self.assertFalse([op for op in mode.ops if "_local_scalar_dense" in op], mode.ops)

    # --- bad inputs -----------------------------------------------------------------

    def test_bad_inputs(self):
        x = torch.zeros(8, 16, dtype=torch.float16)
        w = torch.zeros(2, 16, 4, dtype=torch.float16)
        offs = torch.tensor([4, 8], dtype=torch.int32)
        cases = [
            ((x, w, offs.long().view(1, 2)), r"^grouped_mm: expected offs to be 1D int32, got 2D torch.int64$"),
            ((x, w, offs[:1]), r"expected offs to have one end per group \(w.shape\[0\] = 2\), got 1"),
            ((x, w[:0], offs[:0]), r"expected at least one group, got offs of shape \(0,\)"),
            ((x[None], w, offs), r"expected x to be 2D float16, bfloat16 or float32, got 3D torch.float16"),
            ((x.long(), w, offs), r"expected x to be 2D .*, got 2D torch.int64"),
            ((x, w.float(), offs), r"expected w to be 3D torch.float16 \(like x\), got 3D torch.float32"),
            ((x, w[:, :15], offs), r"expected w.shape\[1\] == x.shape\[1\] \(K\), got w \(2, 15, 4\) and x \(8, 16\)"),
        ]  # fmt: skip
        for args, msg in cases:
            with self.assertRaisesRegex(ValueError, msg):
                grouped_mm(*args)
        with self.assertRaisesRegex(
            ValueError, r"expected out of shape \(8, 4\), dtype torch.float16"
        ):
            grouped_mm(x, w, offs, out=torch.empty(8, 5, dtype=torch.float16))
        with self.assertRaisesRegex(ValueError, r"^grouped_mm_wgrad: expected offs to be 1D int32"):
            grouped_mm_wgrad(x, x, offs.long())
        with self.assertRaisesRegex(
            ValueError, r"expected dy.shape\[0\] == x.shape\[0\] \(M\), got dy \(7, 16\)"
        ):
            grouped_mm_wgrad(x, x[:7], offs)
        with self.assertRaisesRegex(ValueError, r"expected dy to be 2D torch.float16 \(like x\)"):
            grouped_mm_wgrad(x, x.float(), offs)
        with self.assertRaisesRegex(ValueError, r"expected out_dtype to be .*, got torch.int32"):
            grouped_mm_wgrad(x, x, offs, out_dtype=torch.int32)
        with self.assertRaisesRegex(
            ValueError, r"expected kernel 'grouped_mm' or 'grouped_mm_wgrad'"
        ):
            compile_for_sm90("grouped_gemm", torch.bfloat16)  # type: ignore[arg-type]
        with self.assertRaisesRegex(ValueError, r"expected dtype float16, .*, got torch.int8"):
            compile_for_sm90("grouped_mm", torch.int8)

    # --- static: compiled for sm_90a without a GPU ----------------------------------

    # (kernel, dtype, allow_tf32, transposed_w, sizes). Sizes: a typical aligned MoE shape
    # (the fast config) and odd K / N (every load masked per element: the fallback config).
    SM90_CASES = [
        ("grouped_mm", torch.bfloat16, False, True, "aligned"),
        ("grouped_mm", torch.bfloat16, False, False, "aligned"),
        ("grouped_mm", torch.float16, False, True, "aligned"),
        ("grouped_mm", torch.float16, False, False, "aligned"),
        ("grouped_mm", torch.bfloat16, False, True, "odd"),
        ("grouped_mm", torch.bfloat16, False, False, "odd"),
        ("grouped_mm", torch.float32, True, False, "aligned"),
        ("grouped_mm", torch.float32, False, False, "aligned"),
        ("grouped_mm_wgrad", torch.bfloat16, False, False, "aligned"),
        ("grouped_mm_wgrad", torch.float16, False, False, "aligned"),
        ("grouped_mm_wgrad", torch.bfloat16, False, False, "odd"),
        ("grouped_mm_wgrad", torch.float32, True, False, "aligned"),
    ]
    SIZES = {
        "aligned": dict(M=16384, K=2048, N=1536, E=8),
        "odd": dict(M=1000, K=17, N=33, E=3),
    }

    @parametrize(
        "case",
        SM90_CASES,
        name_fn=lambda c: "_".join(
            [c[0], str(c[1]).split(".")[-1] + ("_tf32" if c[2] else ""), c[4]]
            + (["ENK_transposed"] if c[0] == "grouped_mm" and c[3] else [])
        ),
    )
    def test_compile_sm90(self, case):
        kernel, dtype, allow_tf32, transposed_w, sizes = case
        if gm._ptxas_path() is None:
            raise unittest.SkipTest(
                "ptxas for sm_90a not found (shipped in triton's nvidia backend)"
            )
        k = compile_for_sm90(
            kernel, dtype, allow_tf32=allow_tf32, transposed_w=transposed_w, **self.SIZES[sizes]
        )
        ptx = k.asm["ptx"]
        cfg = k.config
        print(
            f"\n[sm_90a] {kernel:<16} {dtype!s:<14} tf32={allow_tf32!s:<5} "
            f"w={'ENK^T' if transposed_w else 'EKN':<5} {sizes:<7} "
            f"block {cfg.block_m}x{cfg.block_n}x{cfg.block_k} warps={cfg.num_warps} "
            f"stages={cfg.num_stages}: {k.n_regs} regs, {k.spill_stores} B spill stores, "
            f"{k.spill_loads} B spill loads, {k.shared} B shared, "
            f"wgmma={'wgmma.mma_async' in ptx}"
        )
        self.assertIn(
            f".entry _{'grouped_mm_fwd' if kernel == 'grouped_mm' else kernel}_kernel", ptx
        )
        self.assertIn(".target sm_90a", ptx)
        if dtype != torch.float32 or allow_tf32:  # IEEE fp32 runs on FMA units by design
            self.assertIn("wgmma.mma_async", ptx)
        self.assertEqual(k.n_spills, 0, msg=k.ptxas_log)
        self.assertLessEqual(k.n_regs, 255)


class TestTritonGroupedMMDevice(TestCase):
    """Device-generic (instantiate_device_type_tests): .ci/gpu runs it on cuda."""

    @onlyCUDA
    @dtypes(torch.bfloat16, torch.float16, torch.float32)
    @parametrize("shape", ["aligned", "odd"])
    def test_compiled_kernels(self, device, dtype, shape):
        # The compiled kernels with their sm_90 configs, with CUDA's sync checker on.
        torch.manual_seed(6)
        if shape == "aligned":
            M, K, N, sizes = 1100, 256, 384, (0, 300, 17, 0, 500, 200)
        else:
            M, K, N, sizes = 300, 17, 33, (40, 0, 129, 100)
        offs = ends(*sizes).to(device)
        x = randn(M, K, dtype=dtype).to(device)
        w = randn(len(sizes), N, K, dtype=dtype).to(device).transpose(-2, -1)
        dy = randn(M, N, dtype=dtype).to(device)
        out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            grouped_mm(x, w, offs, out=out)
            dw = grouped_mm_wgrad(x, dy, offs)
            dw_f32 = grouped_mm_wgrad(x, dy, offs, out_dtype=torch.float32)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        x, w, dy, offs = x.cpu(), w.cpu(), dy.cpu(), offs.cpu()
        assert_within_bound(self, out, x, w, offs)
        assert_within_bound(self, dw, x, dy, offs, wgrad=True)
        assert_within_bound(self, dw_f32, x, dy, offs, wgrad=True)


instantiate_parametrized_tests(TestTritonGroupedMM)
instantiate_device_type_tests(TestTritonGroupedMMDevice, globals())

if __name__ == "__main__":
    run_tests()
