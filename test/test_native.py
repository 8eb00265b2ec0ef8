# Owner(s): ["module: moe"]
"""The native CPU kernels (``torch_moe/csrc/``, built by ``torch_moe/_ops/_native.py``).

The SwiGLU row kernels: bit for bit the ATen ops they replace (forward, backward, d
row_weights), on ragged rows, strided rows and every dtype pair the kernels take, through
the ops too; the probe's ``act_kernel`` decision in both outcomes; and every way out:
disabled by the environment, a failed build, a build whose results differ, operands the
kernels do not take. The permutation kernels: ``permute_indices``' counting sort gives the
reference's integers (capacity, alignment, skew, empty experts, T=0), the combine the ATen
kernel's bits (signed zeros included), through the ops too. The glu op's swigluoai
kernels (GPT-OSS's clamped SwiGLU): the ATen chunks' bits, both column orders, with and
without a limit and row weights, a chunk that ATen cuts into a piece per thread, through
the op and its backward; where they apply, and a build with other bits refused."""

import contextlib
import itertools
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import time
import unittest
import warnings
from pathlib import Path
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cpu_probe import assert_gemm_within, intra_op_threads, native_gemm_available
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    slowTest,
)

from torch_moe import ops
from torch_moe._ops import _cpu_probe as P
from torch_moe._ops import _native
from torch_moe._ops import glu as glu_mod
from torch_moe._ops import grouped_swiglu as gs
from torch_moe._ops import permute as perm_mod
from torch_moe._ops.permute import (
    permute_indices_reference,
    permute_rows_reference,
    unpermute,
    unpermute_rows_reference,
)

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
PAIRS = [(BF16, BF16), (BF16, F32), (F16, F16), (F16, F32), (F32, F32)]  # (h, outputs)
needs_native = unittest.skipUnless(
    _native.available(), "the native CPU kernels did not build here (no C++ compiler?)"
)


def _operands(rows, hidden, h_dtype, out_dtype, seed=0, pad=0):
    """h [rows, 2F] and dA [rows, F], as row views of wider tensors when ``pad`` (row
    stride past the row), |h| up to ~10 (sigmoid saturates), row weights in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    h = (3 * torch.randn(rows, 2 * hidden + pad, generator=g)).to(h_dtype)[:, : 2 * hidden]
    grad_a = torch.randn(rows, hidden + pad, generator=g).to(out_dtype)[:, :hidden]
    return h, grad_a, torch.rand(rows, generator=g)


def _tables_off(kernel, out):
    """A native activation kernel (its last argument ``table``) run without the gate
    tables, and, where the caller asks for them, its output argument ``out`` returned with
    its last row one ulp off: a build whose tables give other bits, for the checks that
    must refuse it."""

    def call(*args):
        *rest, table = args
        kernel(*rest, False)
        if table:
            args[out].view(torch.int16)[-1].add_(1)

    return staticmethod(call)


def _bits(t):
    """t's bits as integers (NaNs compare by their bit patterns), or None."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return None if t is None else t.view(ints[t.element_size()])


def _both(h, grad_a, rw):
    """(ATen ops, native kernels): the forward a, and the backward's a, dH, d rw. The
    native kernels run twice, the gates' silu and sigmoid computed and read from the
    tables (the probe's ``act_table`` forced both ways): both must give the same bits,
    checked here; the tables' run is returned."""
    out = {}
    for kind, table in (("aten", "compute"), ("native", "compute"), ("native", "table")):
        with P.force(act_kernel=kind, act_table=table):
            a = grad_a.new_empty(grad_a.shape)
            gs._act_into(h, rw, a)
            a2, dh = torch.empty_like(a), grad_a.new_empty(h.shape)
            grad_rw = gs._act_backward_into(h, grad_a, rw, a2, dh)
        out[kind, table] = (a, a2, dh, grad_rw)
    for name, x, y in zip(
        ("a", "a (backward)", "dh", "d rw"), out["native", "compute"], out["native", "table"]
    ):
        if not ((x is None and y is None) or torch.equal(_bits(x), _bits(y))):
            raise AssertionError(f"{name}: the gate tables' bits differ from the computed ones")
    return out["aten", "compute"], out["native", "table"]


def _per_capability(src: Path) -> bool:
    """Whether a native source, or a local header it includes, has code under a
    ``CPU_CAPABILITY`` #if."""
    text = src.read_text()
    headers = re.findall(r'^#include "([^"]+)"', text, re.M)
    return any(
        "CPU_CAPABILITY" in t for t in [text, *((src.parent / h).read_text() for h in headers)]
    )


@instantiate_parametrized_tests
class TestNativeSwiGLU(TestCase):
    @needs_native
    @parametrize("pair", PAIRS, name_fn=lambda p: f"{str(p[0])[6:]}_{str(p[1])[6:]}")
    @parametrize("weighted", [False, True])
    def test_bitwise_aten(self, pair, weighted):
        # F below, at and past a block of two vectors (32 fp32 lanes on AVX512), odd F:
        # ATen runs a row's tail with the scalar formula, the kernel must too; and with
        # stream_out, half outputs past the L2 cache (the last two: 4.9 MB) written by
        # non-temporal stores where a vector starts one (F = 1000: every other row's
        # vectors do not), the same bits
        for rows, hidden, pad in [
            (1, 5, 0),
            (3, 31, 2),
            (7, 32, 0),
            (33, 47, 1),
            (64, 1024, 0),
            (130, 200, 3),
            (2400, 1024, 0),
            (2450, 1000, 1),
        ]:
            h, grad_a, rw = _operands(rows, hidden, *pair, seed=rows, pad=pad)
            aten, native = _both(h, grad_a, rw if weighted else None)
            for name, want, got in zip(
                ("a", "a (backward)", "dh", "d rw"), aten, native, strict=True
            ):
                self.assertEqual(got, want, atol=0, rtol=0, msg=f"{name} {rows}x{hidden}")
            self.assertEqual(native[3] is None, not weighted)
            mod = _native.kernels()
            streamed = [torch.empty_like(t) for t in native[:3]]
            w = rw if weighted else None
            grad_w = rw.new_empty(rows) if weighted else None
            mod.swiglu_forward(h, w, streamed[0], True)
            mod.swiglu_backward(h, grad_a, w, streamed[1], streamed[2], grad_w, True)
            if weighted:
                streamed.append(grad_w)
            for got, want in zip(streamed, native, strict=False):
                self.assertTrue(torch.equal(got, want), msg=f"streamed {rows}x{hidden}")

    @needs_native
    @parametrize("threads", [1, 2])
    def test_row_weight_sums_at_every_cascade_level(self, threads):
        # the kernels sum d row_weights row by row in the order of ATen's sum
        # (aten_sum.h's aten_order_sum): rows around each length where that order
        # changes (a vector of 8 floats, a group of four vectors, the 16, 256 and 4096
        # groups after which its accumulators cascade a level), vectors and elements
        # past the last group
        # (the kernel called directly: through the ops a wrong sum would only make the
        # first-use check fall back to the ATen ops, whose results these would then be)
        mod = _native.kernels()
        lengths = [7, 8, 9, 31, 32, 33, 44, 511, 512, 513, 8191, 8192, 8233, 131071, 131072]
        for n in [*lengths, 131072 + 8 * 3 + 5, _native.CASCADE_ROW]:  # (the last: every level)
            h, grad_a, rw = _operands(2, n, BF16, BF16, seed=n)
            a, dh, grad_w = torch.empty_like(grad_a), torch.empty_like(h), torch.empty(2)
            with intra_op_threads(threads):
                want = gs._act_backward_into_aten(h, grad_a, rw, a, dh)
                mod.swiglu_backward(h, grad_a, rw, a, dh, grad_w)
            self.assertEqual(grad_w, want, atol=0, rtol=0, msg=f"F={n}")

    @needs_native
    @parametrize("dtype", [BF16, F16])
    def test_built_kernels_pass_the_bit_check(self, dtype):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a refusal warns
            self.assertTrue(gs._native_matches_aten(_native.kernels(), dtype))

    @needs_native
    @parametrize("dtype", [BF16, F16])
    @parametrize("weighted", [False, True])
    def test_every_gate_bitwise_aten(self, dtype, weighted):
        # every 16-bit gate (signed zeros, subnormals, infinities, NaNs), in rows with
        # vector blocks and a scalar tail: the kernels with the gate tables give the bits
        # of the kernels computing them (NaNs' too: _both) and the ATen ops' bits
        # (NaN where ATen's is NaN: an fp16 backward's NaN of a negative NaN gate has
        # another sign, which IEEE leaves open)
        hidden = 1024 + 5
        gates = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        rows = -(-gates.numel() // hidden)
        h, grad_a, rw = _operands(rows, hidden, dtype, dtype, seed=7)
        h[:, :hidden] = torch.cat([gates, h[:, :hidden].flatten()[gates.numel() :]]).view(
            rows, hidden
        )
        aten, native = _both(h, grad_a, rw if weighted else None)
        for name, want, got in zip(("a", "a (backward)", "dh", "d rw"), aten, native, strict=True):
            self.assertEqual(got, want, atol=0, rtol=0, equal_nan=True, msg=name)
        self.assertTrue(native[0][:, :-5].isnan().any() and native[0].isinf().any())

    @needs_native
    @parametrize("dtype", [BF16, F16])
    def test_gate_tables_pass_their_bit_check(self, dtype):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a refusal warns
            self.assertTrue(gs._table_matches(_native.kernels(), dtype))

    @needs_native
    def test_gate_tables_refused_where_their_bits_differ(self):
        # a build whose tables give other bits (here: every call with the tables computes
        # the forward's last row one ulp off) is refused, measured or forced, with a warning
        mod = _native.kernels()

        class OffByOne:
            swiglu_forward = _tables_off(mod.swiglu_forward, out=2)
            swiglu_backward = mod.swiglu_backward

        with self.assertWarnsRegex(UserWarning, r"gate tables give other bits .*bfloat16"):
            self.assertFalse(gs._table_matches(OffByOne, BF16))

        class BackwardOff:  # the tables' backward alone off: dH's last bit
            swiglu_forward = mod.swiglu_forward
            swiglu_backward = _tables_off(mod.swiglu_backward, out=4)

        with self.assertWarnsRegex(UserWarning, r"gate tables give other bits .*bfloat16"):
            self.assertFalse(gs._table_matches(BackwardOff, BF16))
        with mock.patch.dict(gs._TABLE_CHECKED, clear=True):
            with mock.patch.object(_native, "kernels", return_value=OffByOne):
                with self.assertWarnsRegex(UserWarning, "gate tables give other bits"):
                    self.assertEqual(gs._measure_act_table(BF16), {"compute": 0.0})
            P.reset(env=False)
            with mock.patch.object(gs, "_table_matches", return_value=False) as check:
                with P.force(act_table="table"):
                    self.assertFalse(gs._act_table(BF16))
            check.assert_called_once()
        P.reset(env=False)
        with P.force(act_table="table"):
            self.assertTrue(gs._act_table(BF16))
            self.assertFalse(gs._act_table(F32))  # fp32 gates: no tables
        with P.force(act_table="compute"):
            self.assertFalse(gs._act_table(BF16))

    @needs_native
    def test_act_table_candidates(self):
        seen = {}

        def spy(candidates):
            seen.update(candidates)
            return {name: 1.0 for name in candidates}

        mod = _native.kernels()
        calls = []

        class Spy:
            @staticmethod
            def swiglu_forward(*args):
                calls.append(("forward", args[-1]))
                mod.swiglu_forward(*args)

            @staticmethod
            def swiglu_backward(*args):
                calls.append(("backward", args[-1]))
                mod.swiglu_backward(*args)

        with mock.patch.object(_native, "kernels", return_value=Spy):
            with mock.patch.object(P, "time_candidates", spy):
                with mock.patch.object(gs, "_table_checked", return_value=True):
                    gs._measure_act_table(BF16)
            self.assertEqual(set(seen), {"compute", "table"})
            seen["compute"]()
            seen["table"]()
        want = [("forward", False), ("backward", False), ("forward", True), ("backward", True)]
        self.assertEqual(calls, want)

    @needs_native
    @parametrize("threads", [1, 2])
    def test_bitwise_aten_threads(self, threads):
        # ATen splits an op over threads at element ranges; the kernel at rows: the same
        # values either way, where the rows are whole multiples of a vector block
        h, grad_a, rw = _operands(257, 96, BF16, BF16, seed=3)
        with intra_op_threads(threads):
            aten, native = _both(h, grad_a, rw)
        for want, got in zip(aten, native, strict=True):
            self.assertEqual(got, want, atol=0, rtol=0)

    @needs_native
    @given(
        rows=st.integers(0, 40),
        hidden=st.integers(1, 80),
        pair=st.sampled_from(PAIRS),
        weighted=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def test_bitwise_aten_fuzz(self, rows, hidden, pair, weighted, seed):
        h, grad_a, rw = _operands(rows, hidden, *pair, seed=seed, pad=seed % 3)
        aten, native = _both(h, grad_a, rw if weighted else None)
        for want, got in zip(aten, native, strict=True):
            self.assertEqual(got, want, atol=0, rtol=0)

    @needs_native
    @parametrize("dtype", [BF16, F32])
    def test_ops_bitwise_aten(self, dtype):
        """grouped_swiglu (both CPU paths) and swiglu, forward and backward, with the
        native kernels give the ATen ops' bits."""
        g = torch.Generator().manual_seed(0)
        offs = torch.tensor([5, 5, 24, 28], dtype=torch.int32)  # an empty group, rows past
        x = torch.randn(30, 16, generator=g).to(dtype).requires_grad_()
        w13 = (0.5 * torch.randn(4, 2 * 40, 16, generator=g)).to(dtype).requires_grad_()
        w2 = (0.5 * torch.randn(4, 16, 40, generator=g)).to(dtype).requires_grad_()
        rw = torch.rand(30, generator=g).requires_grad_()
        grad_y = torch.randn(30, 16, generator=g).to(dtype)
        h_act = torch.randn(9, 2 * 40, generator=g).to(dtype).requires_grad_()
        for path in ("loop", "whole"):
            results = {}
            for kind in ("aten", "native"):
                leaves = (x, w13, w2, rw, h_act)
                for t in leaves:
                    t.grad = None
                with P.force(act_kernel=kind, swiglu_path=path):
                    y, _h = torch.ops.torch_moe.grouped_swiglu(x, w13, w2, offs, rw)
                    y.backward(grad_y)
                    a = torch.ops.torch_moe.swiglu(h_act, rw[:9])
                    a.backward(torch.ones_like(a))
                results[kind] = [y.detach(), a.detach()] + [t.grad.clone() for t in leaves]
            for want, got in zip(results["aten"], results["native"], strict=True):
                self.assertEqual(got, want, atol=0, rtol=0, msg=path)

    def test_native_kernels_only_where_they_apply(self):
        h, grad_a, _ = _operands(4, 8, BF16, BF16)
        with P.force(act_kernel="native"):
            # fp64 math, strided columns, outputs of two dtypes, fp16 outputs of bf16 h
            self.assertIsNone(gs._native_kernels(h.double(), grad_a.double()))
            self.assertIsNone(gs._native_kernels(h, grad_a[:, ::2]))
            self.assertIsNone(gs._native_kernels(h, grad_a, grad_a.float()))
            self.assertIsNone(gs._native_kernels(h, grad_a.half()))
            self.assertIs(gs._native_kernels(h, grad_a), _native.kernels())
        with P.force(act_kernel="aten"):
            self.assertIsNone(gs._native_kernels(h, grad_a))

    @needs_native
    def test_kernel_argument_errors(self):
        mod = _native.kernels()
        h, grad_a, rw = _operands(4, 8, BF16, BF16)
        out = torch.empty(4, 8, dtype=BF16)
        with self.assertRaisesRegex(
            RuntimeError, r"swiglu_cpu: out must be \[4, 8\] with contiguous rows"
        ):
            mod.swiglu_forward(h, None, torch.empty(8, 4, dtype=BF16).t())
        with self.assertRaisesRegex(RuntimeError, r"swiglu_cpu: h must be \[4, 16\]"):
            mod.swiglu_forward(h[:, :10], None, out)
        with self.assertRaisesRegex(
            RuntimeError, r"swiglu_cpu: row_weights must be a contiguous fp32 \[4\]"
        ):
            mod.swiglu_forward(h, rw.double(), out)
        with self.assertRaisesRegex(RuntimeError, r"swiglu_cpu: unsupported dtypes h Double"):
            mod.swiglu_forward(h.double(), None, out.double())
        for grad_w in (None, rw.new_empty(5), rw.double(), torch.empty(8)[::2]):
            with self.assertRaisesRegex(
                RuntimeError, r"row weights need a contiguous fp32 grad_weights \[4\]"
            ):
                mod.swiglu_backward(h, grad_a, rw, out, torch.empty_like(h), grad_w)
        with self.assertRaisesRegex(RuntimeError, r"grad_a, out_a and out_dh must share a dtype"):
            mod.swiglu_backward(h, grad_a, None, out.float(), torch.empty_like(h), None)

    def test_disabled_by_environment(self):
        with mock.patch.dict("os.environ", {_native.ENV: "0"}):
            self.assertIsNone(_native.kernels())
            self.assertEqual(gs._measure_act_kernel(BF16), {"aten": 0.0})
            h, grad_a, rw = _operands(3, 8, BF16, BF16)
            with P.force(act_kernel="native"):  # forced, but not built: the ATen ops
                aten = mock.patch.object(gs, "_act_into_aten", wraps=gs._act_into_aten)
                with aten as spy:
                    gs._act_into(h, rw, torch.empty_like(grad_a))
                self.assertEqual(spy.call_count, 1)

    @parametrize("cap", ["AVX512", "AVX2", "DEFAULT", "SVE256"])
    def test_build_targets_atens_capability(self, cap):
        # the kernel's vectors must have the width of the ATen kernels it reproduces
        with (
            mock.patch("torch.utils.cpp_extension.load") as load,
            mock.patch("torch.backends.cpu.get_cpu_capability", return_value=cap),
            mock.patch.dict(_native._built, clear=True),
            mock.patch.dict("os.environ", {_native.ENV: "1"}),
        ):
            self.assertIs(_native.kernels(), torch.ops.torch_moe_cpu)
            self.assertTrue(_native.available())
        known = cap if cap in ("AVX512", "AVX2") else "DEFAULT"  # unknown: the generic vectors
        (call,) = load.call_args_list
        self.assertEqual(call.kwargs["name"], f"torch_moe_cpu_{known.lower()}")
        self.assertEqual(call.kwargs["sources"], [str(src) for src in _native._SOURCES])
        self.assertTrue(all(src.is_file() for src in _native._SOURCES))
        self.assertFalse(call.kwargs["is_python_module"])  # a TORCH_LIBRARY, no pybind11
        flags = call.kwargs["extra_cflags"]
        self.assertIn("-O3", flags)
        isa = {
            "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma"],
            "AVX2": ["-mavx2", "-mfma"],
        }
        for flag in isa.get(known, []):
            self.assertIn(flag, flags)
        if known == "DEFAULT":
            self.assertFalse([f for f in flags if f.startswith(("-m", "-DCPU_CAPABILITY"))])
        else:
            self.assertIn(f"-DCPU_CAPABILITY_{known}", flags)
            self.assertIn(f"-DCPU_CAPABILITY={known}", flags)
        self.assertNotIn("-ffp-contract=off", flags)  # ATen's build contracts; so must this
        # at::parallel_for is an omp region compiled into the kernels: without -fopenmp
        # each runs on one thread whatever torch.get_num_threads() says
        omp = _native._openmp()
        self.assertEqual("-fopenmp" in flags, omp)
        self.assertEqual("-fopenmp" in call.kwargs["extra_ldflags"], omp)

    @unittest.skipUnless(shutil.which("c++"), "no C++ compiler here")
    def test_sources_compile_for_the_other_vector_capability(self):
        # every capability's library compiles (only this machine's is built and tested
        # here): code for one ISA outside its #if broke the AVX2 build once, unnoticed, as
        # every native test skips where the kernels do not build. AVX2's where this
        # machine builds AVX-512's, else AVX-512's (syntax only: ~35 s; the generic
        # capability's with PYTORCH_TEST_WITH_SLOW=1)
        self._compile_sources("AVX512" if _native._capability() == "AVX2" else "AVX2")

    @slowTest
    @unittest.skipUnless(shutil.which("c++"), "no C++ compiler here")
    def test_sources_compile_for_the_generic_capability(self):
        self._compile_sources("DEFAULT")

    def _compile_sources(self, cap):
        from torch.utils import cpp_extension

        flags, _ = _native.compile_flags(cap)
        includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
        cmd = ["c++", "-fsyntax-only", "-std=c++20", *flags]  # (torch 2.13's extensions' std)
        cmd += [arg for path in includes for arg in ("-isystem", path)]
        # the sources with code per capability (theirs or their local headers' #ifs): the
        # others compile the same on every capability
        sources = [src for src in _native._SOURCES if _per_capability(src)]
        self.assertIn("fp8_cpu.cpp", [src.name for src in sources])
        procs = [
            subprocess.Popen([*cmd, str(src)], stderr=subprocess.PIPE, text=True) for src in sources
        ]
        for src, proc in zip(sources, procs, strict=True):
            _, err = proc.communicate(timeout=600)
            self.assertEqual(proc.returncode, 0, f"{src.name} for {cap}:\n{err[-3000:]}")

    @parametrize("openmp", [True, False])
    def test_openmp_where_torch_runs_openmp(self, openmp):
        info = (
            "ATen parallel backend: OpenMP"
            if openmp
            else "ATen parallel backend: native thread pool"
        )
        with (
            mock.patch("torch.__config__.parallel_info", return_value=info),
            mock.patch("sys.platform", "linux"),
        ):
            self.assertEqual(_native._openmp(), openmp)
        with mock.patch("sys.platform", "darwin"):
            self.assertFalse(_native._openmp())

    @needs_native
    @unittest.skipUnless(_native._openmp(), "torch's parallel backend is not OpenMP here")
    def test_kernels_run_on_torchs_threads(self):
        # the kernels' at::parallel_for regions fan out over torch's intra-op threads (a
        # build without -fopenmp ran every kernel on the calling thread)
        mod = _native.kernels()
        for n in (1, 2, 3):
            with intra_op_threads(n):
                self.assertEqual(mod.parallel_threads(64), n)
                self.assertEqual(mod.parallel_threads(1), 1)  # one task: one thread
        with self.assertRaisesRegex(RuntimeError, "tasks must be >= 1, got 0"):
            mod.parallel_threads(0)

    def test_stale_build_lock(self):
        """A lock left by a killed build is removed (load would wait for it forever); a
        fresh one (a build running elsewhere) is waited for and left alone."""
        from torch.utils import cpp_extension

        name = "torch_moe_cpu_locktest"
        with (
            tempfile.TemporaryDirectory() as d,
            mock.patch.dict("os.environ", {"TORCH_EXTENSIONS_DIR": d}),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
            lock.touch()
            old = time.time() - 2 * _native._STALE_LOCK_S
            os.utime(lock, (old, old))
            _native._clear_stale_lock(name)
            self.assertFalse(lock.exists())
            (w,) = caught
            self.assertRegex(str(w.message), r"removing a stale build lock .*lock \(\d+ s old")
            lock.touch()  # another process building: its lock goes when it is done
            done = threading.Timer(0.3, lock.unlink)
            done.start()
            t0 = time.monotonic()
            _native._clear_stale_lock(name)
            self.assertGreaterEqual(time.monotonic() - t0, 0.25)
            done.join()
            self.assertEqual(len(caught), 1)  # no second warning
            _native._clear_stale_lock(name)  # no lock: returns at once

    def test_failed_build_warns_once_and_falls_back(self):
        with (
            mock.patch.dict("os.environ", {_native.ENV: "1"}),
            mock.patch.dict(_native._built, clear=True),
            mock.patch.object(_native, "_build", side_effect=OSError("no compiler: c++")) as build,
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            self.assertIsNone(_native.kernels())
            self.assertIsNone(_native.kernels())  # remembered: not built again
        self.assertEqual(build.call_count, 1)
        with mock.patch.dict(_native._built, {_native._capability(): None}):
            self.assertFalse(_native.available())
        (w,) = caught
        self.assertRegex(
            str(w.message),
            r"native CPU kernels did not build \(OSError: no compiler: c\+\+\); using "
            r"ATen ops .* Set TORCH_MOE_NATIVE=0",
        )

    @needs_native
    def test_bit_check_catches_each_way_to_differ(self):
        """A build that differs in one output only, or only for one column order, with a
        limit, in one dtype or for one activation, is refused for what it differs in."""
        real = _native.kernels()

        def flip(t):
            t.view(torch.int16 if t.element_size() == 2 else torch.int32)[..., 0] ^= 1

        def wrong(where):
            class Wrong:
                @staticmethod
                def glu_oai_forward(h, rw, out, alpha, limit, interleaved, step):
                    real.glu_oai_forward(h, rw, out, alpha, limit, interleaved, step)
                    if where(out=True, h=h, limit=limit, interleaved=interleaved):
                        flip(out)

                @staticmethod
                def glu_oai_backward(h, grad_a, rw, dh, grad_w, alpha, limit, interleaved, step):
                    real.glu_oai_backward(
                        h, grad_a, rw, dh, grad_w, alpha, limit, interleaved, step
                    )
                    if where(out=False, h=h, limit=limit, interleaved=interleaved):
                        if not where.prod:
                            flip(dh)
                        elif grad_w is not None:  # d row_weights
                            flip(grad_w)

                relu2_forward = staticmethod(real.relu2_forward)
                relu2_backward = staticmethod(real.relu2_backward)

            return Wrong

        def only(out=None, interleaved=None, limit=None, dtype=None, prod=False):
            def where(**call):
                return (
                    (out is None or call["out"] == out)
                    and (interleaved is None or call["interleaved"] == interleaved)
                    and (limit is None or (call["limit"] is not None) == limit)
                    and (dtype is None or call["h"].dtype == dtype)
                    and (not prod or call["out"] is False)
                )

            where.prod = prod
            return where

        cases = {
            "the output only": only(out=True),
            "dH only": only(out=False),
            "d row_weights only": only(out=False, prod=True),
            "halves only": only(interleaved=False),
            "interleaved only": only(interleaved=True),
            "with a limit only": only(limit=True),
            "without a limit only": only(limit=False),
        }
        for name, where in cases.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                refused = not glu_mod._native_matches_aten(wrong(where), "swigluoai", BF16)
            self.assertTrue(refused, msg=name)
        # per dtype and per activation: a build wrong for bf16 swigluoai only is refused
        # there and used for fp32 and for relu2
        h, grad_a, _ = _operands(3, 5, BF16, BF16, seed=0)
        bad = wrong(only(dtype=BF16))
        with (
            mock.patch.dict("os.environ", {_native.ENV: "1"}),
            mock.patch.object(_native, "kernels", return_value=bad),
            mock.patch.dict(glu_mod._NATIVE_CHECKED, clear=True),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            self.assertIsNone(glu_mod._native_kernels("swigluoai", h, grad_a))
            self.assertIs(glu_mod._native_kernels("swigluoai", h.float(), grad_a.float()), bad)
            self.assertIs(glu_mod._native_kernels("relu2", h[:, :5].contiguous(), grad_a), bad)
            # a tensor off the CPU never takes the CPU kernels
            self.assertIsNone(glu_mod._native_kernels("relu2", grad_a.to("meta"), grad_a))

    def test_kernel_with_other_bits_is_refused(self):
        class Wrong:  # a build whose compiler reassociated: the last bit differs
            @staticmethod
            def swiglu_forward(h, rw, out):
                gs._act_into_aten(h, rw, out)
                out.view(torch.int16)[..., 0] ^= 1

            @staticmethod
            def swiglu_backward(h, grad_a, rw, out_a, out_dh, grad_w):
                got = gs._act_backward_into_aten(h, grad_a, rw, out_a, out_dh)
                if grad_w is not None:
                    grad_w.copy_(got)

        with self.assertWarnsRegex(
            UserWarning, r"results differ from the ATen ops' \(torch.bfloat16, 3x5\)"
        ):
            self.assertFalse(gs._native_matches_aten(Wrong, BF16))

        class OtherSumOrder:  # right everywhere but d row_weights of long rows
            @staticmethod
            def swiglu_forward(h, rw, out):
                gs._act_into_aten(h, rw, out)

            @staticmethod
            def swiglu_backward(h, grad_a, rw, out_a, out_dh, grad_w):
                got = gs._act_backward_into_aten(h, grad_a, rw, out_a, out_dh)
                if grad_w is None:
                    return
                grad_w.copy_(got)
                if grad_a.shape[1] > 8192:  # one long row summed in halves
                    prod = grad_a.float() * (out_a.float() / rw.unsqueeze(1))
                    grad_w[0] = prod[0, ::2].sum() + prod[0, 1::2].sum()

        with self.assertWarnsRegex(UserWarning, rf"results differ .* 2x{_native.CASCADE_ROW}\)"):
            self.assertFalse(gs._native_matches_aten(OtherSumOrder, BF16))
        with mock.patch.object(_native, "kernels", return_value=Wrong):
            with self.assertWarnsRegex(UserWarning, "results differ"):
                self.assertEqual(gs._measure_act_kernel(BF16), {"aten": 0.0})

    @needs_native
    def test_a_chosen_kernel_is_checked_first(self):
        # a choice from the disk cache or forced skips the measurement: the bit check runs
        # anyway before the kernels do
        with P.force(act_kernel="native"), mock.patch.dict(gs._NATIVE_CHECKED, clear=True):
            with mock.patch.object(gs, "_native_matches_aten", return_value=False) as check:
                self.assertFalse(gs._uses_native(BF16))
                h, grad_a, _ = _operands(3, 8, BF16, BF16)
                self.assertIsNone(gs._native_kernels(h, grad_a))
            check.assert_called_once()
        P.reset(env=False)  # memoized answers are kept per forced state until a reset
        with P.force(act_kernel="native"):
            self.assertTrue(gs._uses_native(BF16))

    @needs_native
    def test_bit_check_runs_once_for_measurement_and_choice(self):
        P.reset(env=False)  # the decision measured again (unless the environment forces it)
        spy = mock.patch.object(gs, "_native_matches_aten", wraps=gs._native_matches_aten)
        with mock.patch.dict(gs._NATIVE_CHECKED, clear=True), spy as check:
            gs._uses_native(BF16)
            with P.force(act_kernel="native"):
                self.assertTrue(gs._uses_native(BF16))
        check.assert_called_once()

    @needs_native
    def test_act_kernel_candidates(self):
        seen = {}

        def spy(candidates):
            seen.update(candidates)
            return {name: 1.0 for name in candidates}

        with mock.patch.object(P, "time_candidates", spy):
            gs._measure_act_kernel(BF16)
        self.assertEqual(set(seen), {"aten", "native"})
        aten = mock.patch.object(gs, "_act_backward_into_aten", wraps=gs._act_backward_into_aten)
        with aten as spy_aten:
            seen["aten"]()
            seen["native"]()
        self.assertEqual(spy_aten.call_count, 1)  # the ATen candidate only
        # the decision: native where faster by the margin, the ATen ops otherwise
        self.assertEqual(P.pick({"aten": 1.0, "native": 0.5}, "aten", 0.1), "native")
        self.assertEqual(P.pick({"aten": 1.0, "native": 0.95}, "aten", 0.1), "aten")


def _glu_op(h, grad_a, rw, limit, interleaved, native, activation="swigluoai"):
    """torch_moe::glu(activation) forward and backward through autograd, with the native
    kernels or the ATen chunks: (a, dH, d rw)."""
    off = mock.patch.object(glu_mod, "_native_kernels", return_value=None)
    hh = h.detach().clone().requires_grad_()
    rr = None if rw is None else rw.detach().clone().requires_grad_()
    with off if not native else contextlib.nullcontext():
        a = torch.ops.torch_moe.glu(hh, rr, activation, 1.702, limit, interleaved)
        a.backward(grad_a)
    return a.detach(), hh.grad, None if rr is None else rr.grad


@instantiate_parametrized_tests
class TestNativeGluOai(TestCase):
    @needs_native
    @parametrize("activation", ["swigluoai", "swiglu"])
    @parametrize("dtype", [BF16, F16, F32])
    @parametrize("interleaved", [True, False])
    @parametrize("limit", [None, 7.0, 0.5])
    @parametrize("weighted", [False, True])
    def test_op_bitwise_aten(self, activation, dtype, interleaved, limit, weighted):
        # F below, at and past a block of two vectors; rows that span chunks raggedly
        # (the chunk is the probe's, the same for both); swiglu's three cuts (a clamped
        # gate flat, an unclamped one by row or, interleaved, all scalar)
        for rows, hidden, pad in [(1, 5, 0), (7, 31, 2), (33, 32, 0), (70, 100, 1)]:
            h, grad_a, rw = _operands(rows, hidden, dtype, dtype, seed=rows, pad=pad)
            rw = rw if weighted else None
            args = (h, grad_a, rw, limit, interleaved)
            want = _glu_op(*args, native=False, activation=activation)
            for table in ("compute", "table"):  # (the unclamped swiglu's gate tables)
                with P.force(act_table=table):
                    got = _glu_op(*args, native=True, activation=activation)
                for name, w, g in zip(("a", "dh", "d rw"), want, got, strict=True):
                    msg = f"{name} {rows}x{hidden} {table}"
                    self.assertEqual(g, w, atol=0, rtol=0, msg=msg)

    @needs_native
    @parametrize("dtype", [BF16, F16])
    @parametrize("weighted", [False, True])
    def test_swiglu_every_gate(self, dtype, weighted):
        # the unclamped swiglu with its gates at every 16-bit pattern: the kernels with the
        # gate tables give the computing kernels' bits (NaNs' too) and ATen's values (NaN
        # where ATen's is NaN)
        h, grad_a, rw = gs._all_gates(dtype)
        rw = rw if weighted else None
        want = _glu_op(h, grad_a, rw, None, False, native=False, activation="swiglu")
        got = {}
        for table in ("compute", "table"):
            with P.force(act_table=table):
                got[table] = _glu_op(h, grad_a, rw, None, False, native=True, activation="swiglu")
        for name, w, c, t in zip(("a", "dh", "d rw"), want, got["compute"], got["table"]):
            if w is None:
                continue
            self.assertTrue(torch.equal(_bits(t), _bits(c)), msg=name)
            self.assertEqual(t, w, atol=0, rtol=0, equal_nan=True, msg=name)

    @needs_native
    @parametrize("dtype", [BF16, F16])
    def test_glu_gate_tables_pass_their_bit_check(self, dtype):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a refusal warns
            self.assertTrue(glu_mod._table_matches(_native.kernels(), dtype))

    @needs_native
    def test_glu_gate_tables_where_they_apply(self):
        mod = _native.kernels()
        swiglu = ("swiglu", 1.702, None, False)
        with P.force(act_table="table"):
            self.assertTrue(glu_mod._uses_table(mod, swiglu, BF16))
            self.assertTrue(glu_mod._uses_table(mod, swiglu, F16))
            self.assertFalse(glu_mod._uses_table(mod, swiglu, F32))  # no tables of fp32
            self.assertFalse(glu_mod._uses_table(mod, ("swiglu", 1.702, 7.0, False), BF16))
            self.assertFalse(glu_mod._uses_table(mod, ("swigluoai", 1.702, None, False), BF16))
            with mock.patch.dict(glu_mod._TABLE_CHECKED, clear=True):
                with mock.patch.object(glu_mod, "_table_matches", return_value=False) as check:
                    self.assertFalse(glu_mod._uses_table(mod, swiglu, BF16))
                    self.assertFalse(glu_mod._uses_table(mod, swiglu, BF16))
                check.assert_called_once()
        with P.force(act_table="compute"):
            self.assertFalse(glu_mod._uses_table(mod, swiglu, BF16))
        # the kernels themselves ignore `table` where the gate is clamped (to a limit that
        # is no bf16 value: a table of bf16 gates has no entry for it) and for swigluoai
        h, grad_a, _ = _operands(8, 64, BF16, BF16)
        for fwd, bwd, limit in (
            (mod.glu_swiglu_forward, mod.glu_swiglu_backward, 0.3),
            (mod.glu_oai_forward, mod.glu_oai_backward, None),
        ):
            outs = []
            for table in (False, True):
                a, dh = torch.empty_like(grad_a), torch.empty_like(h)
                fwd(h, None, a, 1.702, limit, False, 8, table)
                bwd(h, grad_a, None, dh, None, 1.702, limit, False, 8, table)
                outs.append((a, dh))
            for x, y in zip(*outs, strict=True):
                self.assertTrue(torch.equal(x, y), msg=str(limit))

        class OffByOne:  # a build whose tables give other bits: refused, with a warning
            glu_swiglu_forward = _tables_off(mod.glu_swiglu_forward, out=2)
            glu_swiglu_backward = mod.glu_swiglu_backward

        with self.assertWarnsRegex(UserWarning, r"glu kernel's gate tables give other bits"):
            self.assertFalse(glu_mod._table_matches(OffByOne, BF16))

        class BackwardOff:  # the tables' backward alone off: dH's last bit
            glu_swiglu_forward = mod.glu_swiglu_forward
            glu_swiglu_backward = _tables_off(mod.glu_swiglu_backward, out=3)

        with self.assertWarnsRegex(UserWarning, r"glu kernel's gate tables give other bits"):
            self.assertFalse(glu_mod._table_matches(BackwardOff, BF16))

    @needs_native
    @parametrize("dtype", [BF16, F16, F32])
    @parametrize("weighted", [False, True])
    def test_relu2_op_bitwise_aten(self, dtype, weighted):
        # ungated h [rows, F]; zeros of both signs and a NaN: ATen's relu passes -0 and NaN
        for rows, hidden, pad in [(1, 5, 0), (7, 31, 2), (70, 100, 1)]:
            h, grad_a, rw = _operands(rows, hidden, dtype, dtype, seed=rows, pad=pad)
            h = h[:, :hidden]
            h[0, :3] = torch.tensor([0.0, -0.0, float("nan")], dtype=dtype)
            rw = rw if weighted else None
            want = _glu_op(h, grad_a, rw, None, False, native=False, activation="relu2")
            got = _glu_op(h, grad_a, rw, None, False, native=True, activation="relu2")
            for name, w, g in zip(("a", "dh", "d rw"), want, got, strict=True):
                if w is None:
                    continue
                # NaN in the same places (its payload is the conversion's: not compared),
                # every other value bit for bit, signed zeros included
                nan = torch.isnan(w)
                msg = f"{name} {rows}x{hidden}"
                self.assertTrue(torch.equal(torch.isnan(g), nan), msg=msg)
                self.assertTrue(torch.equal(_bits(g[~nan]), _bits(w[~nan])), msg=msg)

    @needs_native
    @parametrize("threads", [1, 2])
    def test_kernel_bitwise_aten_pieces(self, threads):
        # a chunk of 40 x 1001 > ATen's grain (32768) elements: with two threads ATen cuts
        # it into two pieces of 20020, each with its own scalar tail; the kernel must too
        # (and a 37 x 999 chunk's two pieces split a row: by-row cuts restart there)
        with intra_op_threads(threads):
            for rows, hidden in ((40, 1001), (37, 999)):
                h, grad_a, rw = _operands(rows, hidden, F32, F32, seed=5)
                for activation, limit, interleaved in (
                    ("swigluoai", 0.5, True),
                    ("swiglu", None, False),
                    ("swiglu", 0.5, True),
                ):
                    for step in (rows, 17):
                        want, got = self._kernel_and_chunks(
                            h, grad_a, rw, limit, interleaved, step, activation
                        )
                        for w, g in zip(want, got, strict=True):
                            self.assertEqual(g, w, atol=0, rtol=0, msg=f"{activation} {step}")

    @needs_native
    @given(
        rows=st.integers(0, 40),
        hidden=st.integers(1, 80),
        step=st.integers(1, 48),
        dtype=st.sampled_from([BF16, F16, F32]),
        activation=st.sampled_from(["swigluoai", "swiglu"]),
        limit=st.sampled_from([None, 7.0, 0.25]),
        interleaved=st.booleans(),
        weighted=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def test_kernel_bitwise_aten_fuzz(
        self, rows, hidden, step, dtype, activation, limit, interleaved, weighted, seed
    ):
        h, grad_a, rw = _operands(rows, hidden, dtype, dtype, seed=seed, pad=seed % 3)
        rw = rw if weighted else None
        want, got = self._kernel_and_chunks(h, grad_a, rw, limit, interleaved, step, activation)
        for w, g in zip(want, got, strict=True):
            self.assertEqual(g, w, atol=0, rtol=0)

    @staticmethod
    def _kernel_and_chunks(h, grad_a, rw, limit, interleaved, step, activation="swigluoai"):
        """(ATen chunks of ``step`` rows, the kernels with that chunk): a, dH, d rw."""
        args = (activation, 1.702, limit, interleaved)
        rows = grad_a.shape[0]
        a, dh = torch.empty_like(grad_a), torch.empty_like(h)
        parts = []
        for r0 in range(0, rows, step):
            r = slice(r0, r0 + step)
            rw_r = None if rw is None else rw[r]
            a[r] = glu_mod._forward(h[r], rw_r, *args)
            parts.append(glu_mod._backward_into(grad_a[r], h[r], rw_r, *args, dh[r]))
        want = (a, dh, None if rw is None or not rows else torch.cat(parts))
        mod = _native.kernels()
        a2, dh2 = torch.empty_like(grad_a), torch.empty_like(h)
        grad_w = None if rw is None else torch.empty(rows)
        fwd, bwd = (
            (mod.glu_oai_forward, mod.glu_oai_backward)
            if activation == "swigluoai"
            else (mod.glu_swiglu_forward, mod.glu_swiglu_backward)
        )
        fwd(h, rw, a2, 1.702, limit, interleaved, step)
        bwd(h, grad_a, rw, dh2, grad_w, 1.702, limit, interleaved, step)
        got = (a2, dh2, None if grad_w is None or not rows else grad_w)
        return want, got

    @needs_native
    def test_op_runs_the_kernel(self):
        h, grad_a, rw = _operands(9, 40, BF16, BF16, seed=0)
        # the kernels' one-time check against the ATen chunks first (run alone, this test
        # would otherwise count the check's ATen calls)
        _glu_op(h, grad_a, rw, 7.0, True, native=True)
        spy = mock.patch.object(glu_mod, "_forward", wraps=glu_mod._forward)
        with spy as aten:
            _glu_op(h, grad_a, rw, 7.0, True, native=True)
        self.assertEqual(aten.call_count, 0)  # neither direction ran the ATen chunks
        with spy as aten:
            _glu_op(h, grad_a, rw, 7.0, True, native=False)
        self.assertGreater(aten.call_count, 0)

    @needs_native
    def test_kernels_only_where_they_apply(self):
        h, grad_a, _ = _operands(4, 8, BF16, BF16, seed=0)
        k = glu_mod._native_kernels
        self.assertIs(k("swigluoai", h, grad_a), _native.kernels())
        self.assertIs(k("swigluoai", h.float(), grad_a.float()), _native.kernels())
        self.assertIs(k("relu2", h[:, :8].contiguous(), grad_a), _native.kernels())
        self.assertIs(k("swiglu", h, grad_a), _native.kernels())
        self.assertIsNone(k("swigluoai", h.double(), grad_a.double()))  # fp64 math
        self.assertIsNone(k("swigluoai", h, grad_a.float()))  # dA in another dtype
        self.assertIsNone(k("swigluoai", h[:, ::2], grad_a))  # strided columns
        with mock.patch.dict("os.environ", {_native.ENV: "0"}):
            self.assertIsNone(k("swigluoai", h, grad_a))

    @needs_native
    def test_kernel_argument_errors(self):
        mod = _native.kernels()
        h, grad_a, rw = _operands(4, 8, BF16, BF16, seed=0)
        out, dh = torch.empty(4, 8, dtype=BF16), torch.empty_like(h)
        with self.assertRaisesRegex(RuntimeError, r"glu_cpu: chunk_rows must be >= 1, got 0"):
            mod.glu_oai_forward(h, None, out, 1.702, None, True, 0)
        with self.assertRaisesRegex(RuntimeError, r"glu_cpu: out must have h's dtype"):
            mod.glu_oai_forward(h, None, out.float(), 1.702, None, True, 4)
        with self.assertRaisesRegex(RuntimeError, r"glu_cpu: unsupported dtype of h Double"):
            mod.glu_oai_forward(h.double(), None, out.double(), 1.702, None, True, 4)
        with self.assertRaisesRegex(RuntimeError, r"out must be \[4, 8\] with contiguous rows"):
            mod.glu_oai_forward(h, None, torch.empty(8, 4, dtype=BF16).t(), 1.702, None, True, 4)
        for grad_w in (None, rw.new_empty(5), rw.double()):
            with self.assertRaisesRegex(
                RuntimeError, r"glu_cpu: row weights need a contiguous fp32 grad_weights \[4\]"
            ):
                mod.glu_oai_backward(h, grad_a, rw, dh, grad_w, 1.702, None, True, 4)
        with self.assertRaisesRegex(RuntimeError, r"grad_a and out_dh must have h's dtype"):
            mod.glu_oai_backward(h, grad_a.float(), None, dh, None, 1.702, None, True, 4)
        h8 = h[:, :8].contiguous()
        with self.assertRaisesRegex(RuntimeError, r"glu_cpu: out must have h's dtype"):
            mod.relu2_forward(h8, None, out.float())
        with self.assertRaisesRegex(RuntimeError, r"out_dh must be \[4, 8\] with contiguous rows"):
            mod.relu2_backward(h8, grad_a, None, dh, None)
        with self.assertRaisesRegex(RuntimeError, r"need a contiguous fp32 grad_weights \[4\]"):
            mod.relu2_backward(h8, grad_a, rw, torch.empty_like(h8), torch.empty(8)[::2])

    def test_kernel_with_other_bits_is_refused(self):
        class Wrong:  # a build that contracted (alpha * g) * (1 - s) + 1: the last bit
            @staticmethod
            def glu_oai_forward(h, rw, out, alpha, limit, interleaved, step):
                out.copy_(glu_mod._forward(h, rw, "swigluoai", alpha, limit, interleaved))

            @staticmethod
            def glu_oai_backward(h, grad_a, rw, dh, grad_w, alpha, limit, interleaved, step):
                args = ("swigluoai", alpha, limit, interleaved)
                glu_mod._backward_into(grad_a, h, rw, *args, dh)
                dh.view(torch.int16)[..., 0] ^= 1
                if grad_w is not None:
                    grad_w.zero_()

        with self.assertWarnsRegex(
            UserWarning, r"swigluoai kernel built but its results differ .*\(torch.bfloat16, 3x5\)"
        ):
            self.assertFalse(glu_mod._native_matches_aten(Wrong, "swigluoai", BF16))
        h, grad_a, _ = _operands(3, 5, BF16, BF16, seed=0)
        with (
            mock.patch.dict("os.environ", {_native.ENV: "1"}),
            mock.patch.object(_native, "kernels", return_value=Wrong),
            mock.patch.dict(glu_mod._NATIVE_CHECKED, clear=True),
            self.assertWarnsRegex(UserWarning, "results differ"),
        ):
            self.assertIsNone(glu_mod._native_kernels("swigluoai", h, grad_a))
            self.assertIsNone(glu_mod._native_kernels("swigluoai", h, grad_a))  # checked once
        if _native.available():
            for act in glu_mod._NATIVE_ACTIVATIONS:
                self.assertTrue(glu_mod._native_matches_aten(_native.kernels(), act, BF16))


def _ids(tokens, top_k, experts, seed, skew=False, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    if skew:  # most assignments on expert 0, some experts empty
        ids = torch.where(torch.rand(tokens, top_k, generator=g) < 0.8, 0, -1)
        ids = torch.where(ids < 0, torch.randint(0, experts, (tokens, top_k), generator=g), ids)
    else:
        ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    return ids.to(dtype)


def _unpermute_aten(y, perm, weights=None):
    """``unpermute``'s CPU kernel with the native kernels off (its ATen ops)."""
    with mock.patch.object(_native, "kernels", return_value=None):
        return unpermute(y, perm.slot_to_row, perm.row_to_slot, weights)


def _bits(t):
    return t.view(
        torch.int16 if t.element_size() == 2 else {4: torch.int32, 8: torch.int64}[t.element_size()]
    )


@instantiate_parametrized_tests
class TestNativePermute(TestCase):
    @needs_native
    @settings(max_examples=60, deadline=None)
    @given(
        tokens=st.integers(0, 40),
        top_k=st.integers(1, 4),
        experts=st.integers(1, 9),
        align=st.sampled_from([1, 2, 16]),
        capacity=st.sampled_from([None, 0, 1, 3, 100]),
        skew=st.booleans(),
        int32=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def test_permute_indices_equals_reference(
        self, tokens, top_k, experts, align, capacity, skew, int32, seed
    ):
        dtype = torch.int32 if int32 else torch.int64
        ids = _ids(tokens, top_k, experts, seed, skew, dtype)
        want = permute_indices_reference(ids, experts, align, capacity)
        got = _native.kernels().permute_indices(ids, experts, align, capacity)
        for w, g in zip(want, got, strict=True):
            self.assertEqual(g.dtype, w.dtype)
            self.assertTrue(torch.equal(g, w), (w, g))
        via_op = ops.permute_indices(ids, experts, align=align, capacity=capacity)
        for w, g in zip(want, via_op, strict=True):
            self.assertTrue(torch.equal(g, w))

    @needs_native
    def test_permute_indices_calls_native(self):
        ids = _ids(12, 2, 4, 0)
        spy = mock.MagicMock(wraps=_native.kernels())
        with mock.patch.object(_native, "kernels", return_value=spy):
            ops.permute_indices(ids, 4)
        spy.permute_indices.assert_called_once()
        with mock.patch.object(_native, "kernels", return_value=None):  # not built: the reference
            got = ops.permute_indices(ids, 4)
        self.assertTrue(torch.equal(got.row_to_slot, permute_indices_reference(ids, 4)[0]))

    @needs_native
    def test_permute_indices_errors(self):
        ids = torch.tensor([[0, 4]])
        with self.assertRaisesRegex(RuntimeError, r"expert_ids must lie in \[0, num_experts=4\)"):
            _native.kernels().permute_indices(ids, 4, 1, None)
        with self.assertRaisesRegex(RuntimeError, r"expert_ids must lie in \[0, num_experts=4\)"):
            ops.permute_indices(ids - 1 - 4, 4)  # negative
        for kwargs, msg in (
            (dict(num_experts=0), "num_experts must be >= 1, got 0"),
            (dict(num_experts=4, align=0), "align must be >= 1, got 0"),
            (dict(num_experts=4, capacity=-1), "capacity must be >= 0 or None, got -1"),
        ):
            with self.assertRaisesRegex(ValueError, msg):  # checked before the kernel
                ops.permute_indices(torch.zeros(2, 1, dtype=torch.long), **kwargs)
        with self.assertRaisesRegex(RuntimeError, "expected expert_ids to be a 2D int32/int64"):
            _native.kernels().permute_indices(torch.zeros(3, dtype=torch.long), 4, 1, None)

    @needs_native
    @parametrize("dtype", [BF16, F16, F32, torch.float64])
    @parametrize("threads", [1, 2])
    @parametrize("weighted", [False, True])
    def test_combine_bitwise_aten(self, dtype, threads, weighted):
        # dropped slots (capacity), padded rows, K = 1..4, rows of odd width; the rows hold
        # +-0 and values that cancel, so that the order and the signed zeros show; weighted:
        # random weights (a product fused with its add, one rounding, would change many
        # sums), NaN on the dropped slots (the reference's where() leaves them +0)
        for seed, (tokens, top_k, experts, capacity, dim) in enumerate(
            [(37, 2, 5, None, 33), (40, 4, 6, 5, 64), (9, 1, 3, 2, 7), (0, 2, 3, None, 8)]
        ):
            ids = _ids(tokens, top_k, experts, seed)
            perm = ops.permute_indices(ids, experts, align=2, capacity=capacity)
            g = torch.Generator().manual_seed(seed)
            y = torch.randn(perm.row_to_slot.shape[0], dim, generator=g) * 1e3
            y[::3, ::2] = -0.0
            y[1::3, 1::2] = 1e-3
            y[:, -1] = -0.0  # a column of -0: each token's sum from +0, as the reference's
            y = y.to(dtype)
            w = None
            if weighted:
                w = torch.rand(tokens, top_k, generator=g, dtype=torch.float64).to(
                    torch.float64 if dtype == torch.float64 else F32
                )
                w[perm.slot_to_row < 0] = float("nan")
            with mock.patch("torch.get_num_threads", return_value=threads):
                torch.set_num_threads(threads)
                try:
                    got = unpermute(y, perm.slot_to_row, perm.row_to_slot, w)
                finally:
                    torch.set_num_threads(1)
            want = _unpermute_aten(y, perm, w)
            self.assertTrue(torch.equal(_bits(got), _bits(want)))
            ref = unpermute_rows_reference(y, perm.slot_to_row, perm.row_to_slot, w)
            self.assertTrue(torch.equal(_bits(got), _bits(ref)))  # (NaN-free: the bits)
            if tokens:
                self.assertFalse(bool(got[:, -1].signbit().any()))

    @needs_native
    @parametrize("dtype", [BF16, F16, F32, torch.float64])
    @parametrize("threads", [1, 2])
    def test_weighted_permute_bitwise_aten(self, dtype, threads):
        # permute with weights (the weighted combine's gradient) by the native gather: rows
        # of dropped slots (capacity) and padding (align) zero, K = 1..4, odd widths; bit
        # for bit the ATen ops (gather, then the rows scaled in fp32 / fp64, rounded once)
        for seed, (tokens, top_k, experts, capacity, dim) in enumerate(
            [(37, 2, 5, None, 33), (40, 4, 6, 5, 64), (9, 1, 3, 2, 7), (0, 2, 3, None, 8)]
        ):
            ids = _ids(tokens, top_k, experts, seed)
            perm = ops.permute_indices(ids, experts, align=2, capacity=capacity)
            g = torch.Generator().manual_seed(seed)
            x = (torch.randn(tokens, dim, generator=g) * 1e3).to(dtype)
            w = torch.rand(tokens, top_k, generator=g, dtype=torch.float64)
            maps = (perm.row_to_slot, perm.slot_to_row)
            spy = mock.MagicMock(wraps=_native.kernels())
            with mock.patch("torch.get_num_threads", return_value=threads):
                torch.set_num_threads(threads)
                try:
                    with mock.patch.object(_native, "kernels", return_value=spy):
                        got = torch.ops.torch_moe.permute(x, *maps, w)
                finally:
                    torch.set_num_threads(1)
            self.assertEqual(spy.gather_scaled.call_count, int(tokens > 0))
            with mock.patch.object(_native, "kernels", return_value=None):
                want = torch.ops.torch_moe.permute(x, *maps, w)
            self.assertTrue(torch.equal(_bits(got), _bits(want)))
            self.assertTrue(torch.equal(got, permute_rows_reference(x, *maps, w)))

    @needs_native
    def test_gather_scaled_argument_errors(self):
        x, index, scales = torch.randn(4, 8), torch.tensor([0, 3, -1]), torch.ones(3)
        out = torch.empty(3, 8)
        for args in (
            (x, index.int(), scales, out),  # int32 index
            (x, index, scales.double(), out),  # scales not in the accumulation dtype
            (x, index, scales[:2], out),  # one scale short
            (x, index, scales, torch.empty(3, 8, dtype=torch.float64)),  # other dtype
        ):
            with self.assertRaisesRegex(RuntimeError, "gather_scaled_cpu: expected x"):
                _native.kernels().gather_scaled(*args)
        with self.assertRaisesRegex(
            RuntimeError, r"gather_scaled_cpu: index must hold rows in \[-1, 4\), got 4 at 1"
        ):
            _native.kernels().gather_scaled(x, torch.tensor([0, 4, -1]), scales, out)

    @needs_native
    def test_combine_rounds_each_product(self):
        # a bf16 sum that a fused multiply-add would round otherwise: 1 * 1 + y1 * w1, whose
        # product rounded to fp32 puts the fp32 sum on a bf16 tie (1 + 2^-8: to even, 1.0)
        # while the exact product lands above it (1 + 2^-7); 67 columns: the vector loop and
        # the scalar tail
        perm = ops.permute_indices(torch.tensor([[0, 1]]), 2)
        y = torch.empty(2, 67, dtype=BF16)
        y[perm.slot_to_row[0, 0]] = 1.0
        y[perm.slot_to_row[0, 1]] = 1.0078125
        w = torch.tensor([[1.0, 0.003876028349623084]])
        got = unpermute(y, perm.slot_to_row, perm.row_to_slot, w)
        self.assertTrue(torch.equal(got, torch.ones(1, 67, dtype=BF16)))
        ref = unpermute_rows_reference(y, perm.slot_to_row, perm.row_to_slot, w)
        self.assertTrue(torch.equal(got, ref))

    @needs_native
    def test_combine_weighted_or_not(self):
        ids = _ids(10, 2, 4, 1)
        perm = ops.permute_indices(ids, 4)
        y = torch.randn(20, 16)
        spy = mock.MagicMock(wraps=_native.kernels())
        with mock.patch.object(_native, "kernels", return_value=spy):
            unpermute(y, perm.slot_to_row, perm.row_to_slot)
            self.assertEqual(spy.combine.call_count, 1)
            w = torch.rand(10, 2, dtype=torch.float64)  # converted to the accumulation dtype
            got = unpermute(y, perm.slot_to_row, perm.row_to_slot, w)
            self.assertEqual(spy.combine.call_count, 2)  # weighted: the native kernel too
            y8 = y.to(torch.float8_e4m3fn)  # a dtype the kernel does not take
            got8 = unpermute(y8, perm.slot_to_row, perm.row_to_slot)
            self.assertEqual(spy.combine.call_count, 2)
        want = unpermute_rows_reference(y, perm.slot_to_row, perm.row_to_slot, w)
        self.assertTrue(torch.equal(got, want))
        want8 = unpermute_rows_reference(y8, perm.slot_to_row, perm.row_to_slot)
        self.assertTrue(torch.equal(got8.float(), want8.float()))

    @needs_native
    def test_combine_argument_errors(self):
        y, rows = torch.randn(4, 8), torch.zeros(2, 2, dtype=torch.long)
        for args in (
            (y, rows.int(), torch.empty(2, 8)),  # int32 map
            (y, rows, torch.empty(3, 8)),  # wrong token count
            (y, rows, torch.empty(2, 8, dtype=torch.float64)),  # other dtype
            (y.t(), rows, torch.empty(2, 4)),  # column-major rows
        ):
            with self.assertRaisesRegex(RuntimeError, "combine_cpu: expected y"):
                _native.kernels().combine(*args)
        out = torch.empty(2, 8)
        for w in (torch.ones(2, 2, dtype=torch.float64), torch.ones(2, 3)):  # dtype, shape
            with self.assertRaisesRegex(
                RuntimeError, r"combine_cpu: expected weights of slot_to_row's shape \[2, 2\]"
            ):
                _native.kernels().combine(y, rows, out, w)

    @needs_native
    @parametrize("dtype", [BF16, F16, F32, torch.float64])
    @parametrize("threads", [1, 2])
    def test_weighted_row_dot_bitwise_aten(self, dtype, threads):
        # the combine weights' gradient by the native row_dot: dropped slots (capacity: 0,
        # whatever their row holds), K = 1..4, widths under, around and past a vector block
        # and one with every level of ATen's sum cascade; bit for bit the reference (fp32
        # gathers, products and ATen's sum); fp64 (fp64 sums) is the reference's alone
        cases = [(37, 2, 5, None, 33), (40, 4, 6, 5, 64), (9, 1, 3, 2, 7), (0, 2, 3, None, 8)]
        if dtype != torch.float64:  # (the reference's row chunks cut such rows by thread)
            cases.append((3, 2, 2, None, _native.CASCADE_ROW))
        for seed, (tokens, top_k, experts, capacity, dim) in enumerate(cases):
            ids = _ids(tokens, top_k, experts, seed)
            perm = ops.permute_indices(ids, experts, align=2, capacity=capacity)
            g = torch.Generator().manual_seed(seed)
            rows = (torch.randn(perm.row_to_slot.shape[0], dim, generator=g) * 30).to(dtype)
            x = torch.randn(tokens, dim, generator=g).to(dtype)
            rows[perm.row_to_slot < 0] = float("nan")  # padding rows: no slot reads them
            spy = mock.MagicMock(wraps=_native.kernels())
            checked = {(spy, dtype): perm_mod._native_row_dot(rows, x) is not None}
            with (
                intra_op_threads(threads),
                mock.patch.object(_native, "kernels", return_value=spy),
                mock.patch.dict(perm_mod._ROW_DOT_CHECKED, checked),  # (checked for the kernels)
            ):
                got = perm_mod.weighted_row_dot(rows, x, perm.slot_to_row)
            native = dtype != torch.float64 and tokens > 0
            self.assertEqual(spy.row_dot.call_count, int(native))
            want = perm_mod.weighted_row_dot_reference(rows, x, perm.slot_to_row)
            self.assertTrue(torch.equal(_bits(got), _bits(want)), msg=f"{dtype} D={dim}")
            self.assertTrue(bool((got[perm.slot_to_row < 0] == 0).all()))

    @needs_native
    def test_weighted_row_dot_falls_back(self):
        # operands the kernel does not take (strided rows, mixed dtypes, a subclass) and a
        # build whose sums differ from ATen's: the reference's results, the latter warned
        rows, x = torch.randn(6, 40), torch.randn(3, 40)
        s2r = torch.tensor([[0, 5], [-1, 2], [3, 3]])
        want = perm_mod.weighted_row_dot_reference(rows, x, s2r)
        spy = mock.MagicMock(wraps=_native.kernels())
        with mock.patch.object(_native, "kernels", return_value=spy):
            for r, t in (
                (torch.randn(40, 6).t(), x),
                (rows.bfloat16(), x),
                (rows.as_subclass(_Sub), x),
            ):
                got = perm_mod.weighted_row_dot(r, t, s2r)
                self.assertTrue(torch.equal(got, perm_mod.weighted_row_dot_reference(r, t, s2r)))
            self.assertEqual(spy.row_dot.call_count, 0)

        class Skewed:
            @staticmethod
            def row_dot(rows, tokens, slot_to_row, out):
                out.copy_(perm_mod._weighted_row_dot(rows, tokens, slot_to_row, 1))
                out[0, 0] += 1

        key = (Skewed, F32)
        try:
            with mock.patch.object(_native, "kernels", return_value=Skewed):
                with self.assertWarnsRegex(
                    UserWarning, r"row_dot kernel built but its results differ .*float32, D=5\)"
                ):
                    got = perm_mod.weighted_row_dot(rows, x, s2r)
        finally:
            perm_mod._ROW_DOT_CHECKED.pop(key, None)
        self.assertTrue(torch.equal(got, want))

    @needs_native
    def test_row_dot_argument_errors(self):
        rows, x, s2r = torch.randn(4, 8), torch.randn(2, 8), torch.zeros(2, 2, dtype=torch.long)
        out = torch.empty(2, 2)
        for args in (
            (rows, x, s2r.int(), out),  # int32 map
            (rows, x.double(), s2r, out),  # mixed dtypes
            (rows.double(), x.double(), s2r, out),  # fp64: the reference's
            (rows, x, s2r, torch.empty(2, 3)),  # out not [T, K]
            (rows, torch.randn(3, 8), s2r, out),  # tokens not slot_to_row's T
        ):
            with self.assertRaisesRegex(RuntimeError, "row_dot_cpu: expected rows"):
                _native.kernels().row_dot(*args)
        with self.assertRaisesRegex(
            RuntimeError, r"row_dot_cpu: slot_to_row must hold rows in \[-1, 4\), got 4 at 2"
        ):
            _native.kernels().row_dot(rows, x, torch.tensor([[0, 1], [4, -1]]), out)


class _Sub(torch.Tensor):
    pass


def _few_mm(x, w, offs, amx_rows=0):
    out = torch.full((x.shape[0], w.shape[2]), float("nan"), dtype=x.dtype)  # every element written
    _native.kernels().few_rows_mm(x, w, offs, out, amx_rows)
    return out


def _few_weight(groups, k, n, dtype, layout, g):
    """[groups, k, n] in a layout: row-major, column-major, or either as a slice of a
    wider weight (a row / column stride larger than the width)."""
    if layout == "row":
        return torch.randn(groups, k, n, generator=g).to(dtype)
    if layout == "col":
        return torch.randn(groups, n, k, generator=g).to(dtype).transpose(-2, -1)
    if layout == "row_slice":
        return torch.randn(groups, k, n + 24, generator=g).to(dtype)[:, :, 3 : 3 + n]
    return torch.randn(groups, n + 24, k, generator=g).to(dtype)[:, 5 : 5 + n].transpose(-2, -1)


@instantiate_parametrized_tests
@needs_native
class TestNativeFewRowsMM(TestCase):
    """``few_rows_mm`` (the grouped GEMM of a few rows per group): within the GEMM
    rounding bound of the float64 product in every dtype and weight layout, with ragged
    K and N (vector tails), empty groups and rows past the groups (zero); the same bits
    on any thread count; bad operands refused by message."""

    @parametrize("dtype", [BF16, F16, F32])
    @parametrize("layout", ["row", "col", "row_slice", "col_slice"])
    def test_within_the_gemm_bound(self, dtype, layout):
        g = torch.Generator().manual_seed(11)
        cases = (([2, 0, 5, 1], 37, 70), ([9, 4], 64, 128), ([1, 1, 0, 3], 8, 5))
        # one- and two-row groups over whole vectors and a tail (the row tiles of 1-2 rows,
        # a one-row group's own form of a row-major weight)
        cases += (([1, 2, 0, 3], 200, 70),)
        # an odd K across panels of the row-major form (64 weight rows each: the sums kept
        # between panels, the last k paired with zero in the last one only); a K whose
        # columns make several column-major panels (~192 KiB each: 44 columns here, the
        # last block partial) with a tail past the last 32-k step, in groups of 1-4 rows
        cases += (([1, 5, 0, 2], 131, 70), ([3, 0, 4, 1], 2050, 100))
        for sizes, k, n in cases:
            offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
            x = torch.randn(int(offs[-1]) + 2, k, generator=g).to(dtype)  # 2 rows past
            w = _few_weight(len(sizes), k, n, dtype, layout, g)
            got = _few_mm(x, w, offs)
            assert_gemm_within(self, got, x, w, offs, f"{sizes} k={k} n={n}")
            self.assertTrue((got[int(offs[-1]) :] == 0).all())

    @parametrize("layout", ["row", "col"])
    def test_same_bits_on_any_thread_count(self, layout):
        g = torch.Generator().manual_seed(2)
        offs = torch.tensor([3, 3, 7, 12, 16], dtype=torch.int32)
        x = torch.randn(16, 96, generator=g).to(BF16)
        w = _few_weight(5, 96, 300, BF16, layout, g)
        with intra_op_threads(1):
            one = _few_mm(x, w, offs)
        with intra_op_threads(2):
            two = _few_mm(x, w, offs)
        self.assertTrue(torch.equal(one.view(torch.int16), two.view(torch.int16)))

    @parametrize("dtype", [BF16, F32])
    @parametrize("layout", ["row", "col"])
    def test_columns_by_themselves(self, dtype, layout):
        # the columns are read in blocks that depend on the width (a column-major weight's
        # drawn from runs of columns, a row-major one's of 64 or 256 columns by group
        # size, the last one partial): any slice of the columns gives the same bits
        g = torch.Generator().manual_seed(5)
        offs = torch.tensor([1, 3, 3, 7], dtype=torch.int32)
        x = torch.randn(7, 80, generator=g).to(dtype)
        w = _few_weight(4, 80, 203, dtype, layout, g)
        whole = _few_mm(x, w, offs)
        for a, b in ((0, 203), (1, 200), (7, 9), (50, 203), (3, 4)):
            part = _few_mm(x, w[:, :, a:b], offs)
            with self.subTest(columns=(a, b)):
                self.assertTrue(torch.equal(part, whole[:, a:b]))

    @parametrize("dtype", [BF16, F32])
    @parametrize("layout", ["row", "col"])
    def test_a_row_whatever_its_group(self, dtype, layout):
        # groups of 1-4 rows and larger ones take different loops (row tiles, the row-major
        # form's stream of weight rows): a row's sums run in one order all the same, so
        # the same row against the same weight gives the same bits in a group of any size
        # (bf16 column-major: runs of columns under 3 rows, panels of whole columns from
        # 3; 2050 x 100: several panels and a k tail)
        g = torch.Generator().manual_seed(8)
        for k, n in ((150, 90), (2050, 100)):
            if layout == "row":
                w = torch.randn(1, k, n, generator=g).to(dtype).expand(2, k, n).contiguous()
            else:
                w = torch.randn(1, n, k, generator=g).to(dtype).expand(2, n, k).contiguous()
                w = w.transpose(-2, -1)
            big = torch.randn(9, k, generator=g).to(dtype)
            for rows in (1, 2, 3, 4, 5, 8):
                x = torch.cat([big[:rows], big])
                offs = torch.tensor([rows, rows + 9], dtype=torch.int32)
                got = _few_mm(x, w, offs)
                with self.subTest(rows=rows, k=k):
                    self.assertTrue(torch.equal(got[:rows], got[rows : 2 * rows]))

    @parametrize("layout", ["row", "col"])
    def test_odd_k_reads_nothing_past_a_row(self, layout):
        # an odd K's last product pairs with zero (the row-major vdpbf16ps form) or runs
        # in a scalar tail: x[r, K] (the next row's first element, here inf) must not be
        # read, or 0 * inf makes the row NaN
        g = torch.Generator().manual_seed(9)
        k, n = 37, 70
        x = torch.randn(5, k, generator=g).to(BF16)
        x[1:, 0] = float("inf")
        w = _few_weight(1, k, n, BF16, layout, g)
        got = _few_mm(x, w, torch.tensor([5], dtype=torch.int32))
        assert_gemm_within(self, got[:1], x[:1], w, torch.tensor([1], dtype=torch.int32), "row 0")

    def test_no_rows(self):
        offs = torch.zeros(3, dtype=torch.int32)
        got = _few_mm(torch.randn(0, 16).to(BF16), torch.randn(3, 16, 8).to(BF16), offs)
        self.assertEqual(got.shape, (0, 8))

    def test_no_columns(self):
        # N = 0 in either layout (a row-major weight's column tasks once divided by zero)
        offs = torch.tensor([2, 5], dtype=torch.int32)
        g = torch.Generator().manual_seed(14)
        for dtype in (BF16, F16):
            for layout in ("row", "col"):
                got = _few_mm(
                    torch.randn(5, 16).to(dtype), _few_weight(2, 16, 0, dtype, layout, g), offs
                )
                self.assertEqual(got.shape, (5, 0))

    def test_bad_operands(self):
        x, w = torch.randn(6, 16).to(BF16), torch.randn(3, 16, 8).to(BF16)
        offs = torch.tensor([2, 4, 6], dtype=torch.int32)
        out = x.new_empty((6, 8))
        cases = [
            ((x.t().contiguous().t(), w, offs, out), r"x must be contiguous"),
            ((x, w[:, :, ::2], offs, x.new_empty((6, 4))), r"row- or column-major"),
            ((x.float(), w, offs, out), r"out must be a contiguous \[M, N\] tensor"),
            ((x, w, offs.long(), out), r"offs must be a contiguous int32 tensor of 3"),
            ((x, w, offs[:2], out), r"offs must be a contiguous int32 tensor of 3"),
            ((x, w, torch.tensor([4, 2, 6], dtype=torch.int32), out), r"got 2 at group 1"),
            ((x, w, torch.tensor([2, 4, 7], dtype=torch.int32), out), r"x's 6 rows, got 7"),
            ((x, torch.randn(3, 12, 8).to(BF16), offs, out), r"x \[M, K\] and w \[E, K, N\]"),
        ]
        for args, msg in cases:
            with self.subTest(msg=msg), self.assertRaisesRegex(RuntimeError, msg):
                _native.kernels().few_rows_mm(*args)


def _threaded_mm(x, w, offs, split_rows=False):
    out = torch.full((x.shape[0], w.shape[2]), float("nan"), dtype=x.dtype)  # all written
    _native.kernels().threaded_grouped_mm(x, w, offs, out, split_rows)
    return out


def _threaded_wgrad(a, dy, offs, transpose_a=False):
    out = torch.full((offs.shape[0], a.shape[0], dy.shape[1]), float("nan"), dtype=a.dtype)
    _native.kernels().threaded_grouped_mm_wgrad(a, dy, offs, out, False, None, None, transpose_a)
    return out


def _offs_of(sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


# group sizes: empty groups, groups under the 16-row cut unit, a group that holds more
# than one thread's share, and groups that two or three threads' shares cut through
_THREADED_SIZES = ([20, 0, 17, 3, 40], [5, 0, 0, 2], [300], [0, 130, 1, 1, 70, 0], [0, 0])


@instantiate_parametrized_tests
@needs_native
class TestNativeThreadedGroupedMM(TestCase):
    """``threaded_grouped_mm`` / ``threaded_grouped_mm_wgrad`` (the groups' work shared
    out over the threads, groups on a share's edge split by output rows): within the
    GEMM rounding bound of the float64 product in every dtype and operand layout, on 1-3
    threads, with empty groups (zero weight gradients), rows past the groups (zero) and
    every element written; the caller's grad mode in the pool's threads; bad operands
    refused by message."""

    @parametrize("dtype", [BF16, F16, F32])
    @parametrize("layout", ["row", "col", "row_slice", "col_slice"])
    def test_forward_within_the_gemm_bound(self, dtype, layout):
        g = torch.Generator().manual_seed(3)
        for sizes in _THREADED_SIZES:
            offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
            end = int(offs[-1])
            x = torch.randn(end + 3, 40, generator=g).to(dtype)  # 3 rows past the groups
            w = _few_weight(len(sizes), 40, 24, dtype, layout, g)
            for threads in (1, 2, 3):
                with self.subTest(sizes=sizes, threads=threads), intra_op_threads(threads):
                    got = _threaded_mm(x, w, offs)
                    assert_gemm_within(self, got, x, w, offs, f"{sizes} on {threads}")
                    self.assertTrue((got[end:] == 0).all())

    @parametrize("dtype", [BF16, F16, F32])
    @parametrize("a_layout", ["view", "copy"])
    def test_wgrad_within_the_gemm_bound(self, dtype, a_layout):
        # a [K, M]: x^T as the column-major view, or a row-major copy of it; its K (the
        # output rows that the shares are cut by) over several 16-row units and a tail
        g = torch.Generator().manual_seed(4)
        for sizes in _THREADED_SIZES:
            offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
            x = torch.randn(int(offs[-1]) + 3, 37, generator=g).to(dtype)
            dy = torch.randn(x.shape[0], 20, generator=g).to(dtype)
            a = x.t() if a_layout == "view" else x.t().contiguous()
            for threads in (1, 2, 3):
                with self.subTest(sizes=sizes, threads=threads), intra_op_threads(threads):
                    got = _threaded_wgrad(a, dy, offs)
                    assert_gemm_within(self, got, x, dy, offs, f"{sizes}", wgrad=True)
                    for g_, size in enumerate(sizes):
                        if size == 0:
                            self.assertTrue((got[g_] == 0).all())

    @parametrize("dtype", [BF16, F16])
    @parametrize("k", [37, 64, 512])
    def test_wgrad_transposing_a_piece_by_piece(self, dtype, k):
        # transpose_a: each piece's block of x^T copied row-major into the thread's
        # scratch before its GEMM: within the bound, and the bits of the GEMMs on one
        # row-major copy of all of x^T (the pieces' products are the same GEMMs); group
        # sizes odd and even (the copy's padded leading dim, zero past an odd count), x
        # a slice of a wider tensor (its rows strided), K past and under a 32-block
        g = torch.Generator().manual_seed(7)
        for sizes in (*_THREADED_SIZES, [255, 1, 64, 0, 33]):
            offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
            src = torch.randn(int(offs[-1]) + 3, k + 5, generator=g).to(dtype)
            x = src[:, 2 : 2 + k]
            dy = torch.randn(x.shape[0], 24, generator=g).to(dtype)
            want = _threaded_wgrad(x.t().contiguous(), dy, offs)
            for threads in (1, 2, 3):
                with self.subTest(sizes=sizes, threads=threads), intra_op_threads(threads):
                    got = _threaded_wgrad(x.t(), dy, offs, transpose_a=True)
                    assert_gemm_within(self, got, x, dy, offs, f"{sizes}", wgrad=True)
                    self.assertEqual(got, want, atol=0, rtol=0)

    @parametrize("dtype", [BF16, F16])
    @parametrize("layout", ["row", "col", "row_slice", "col_slice"])
    def test_upcast_pieces_within_the_fp32_bound(self, dtype, layout):
        # upcast (CPUs that multiply half dtypes by their fp32 upcast): each piece's
        # operands converted to fp32 on its thread (a weight block of 512 columns at a
        # time: N 600 crosses one), one fp32 GEMM, rounded once into out, half or fp32 (an
        # operand may be fp32 already): within the bound of the product rounded to out's
        # dtype from fp32 sums, on 1-3 threads, rows past the groups zero, empty groups'
        # weight gradients zero
        g = torch.Generator().manual_seed(9)
        mod = _native.kernels()
        self.assertLess(mod.upcast_cols(), 600)  # (N 600 crosses a block)
        for sizes, n in ((_THREADED_SIZES[0], 24), (_THREADED_SIZES[3], 600), ([300], 40)):
            offs = _offs_of(sizes)
            end = int(offs[-1])
            x = torch.randn(end + 3, 40, generator=g).to(dtype)
            w = _few_weight(len(sizes), 40, n, dtype, layout, g)
            dy = torch.randn(end + 3, n, generator=g).to(dtype)
            for threads, out_dtype, x_ in itertools.product(
                (1, 2, 3), (dtype, F32), (x, x.float())
            ):
                with (
                    self.subTest(sizes=sizes, threads=threads, out=str(out_dtype), x=str(x_.dtype)),
                    intra_op_threads(threads),
                ):
                    got = torch.full((end + 3, n), float("nan"), dtype=out_dtype)
                    mod.threaded_grouped_mm(x_, w, offs, got, False, False, None, False, True)
                    assert_gemm_within(self, got, x_, w, offs, f"{sizes} on {threads}")
                    self.assertTrue((got[end:] == 0).all())
                    dw = torch.full((len(sizes), 40, n), float("nan"), dtype=out_dtype)
                    args = (False, None, None, False, False, True)
                    mod.threaded_grouped_mm_wgrad(x_.t(), dy, offs, dw, *args)
                    assert_gemm_within(self, dw, x_, dy, offs, f"{sizes}", wgrad=True)
                    for g_, size in enumerate(sizes):
                        if size == 0:
                            self.assertTrue((dw[g_] == 0).all())

    def test_upcast_blas_route_equals_atens(self):
        # the upcast pieces' fp32 GEMMs by BLAS's sgemm_ on the thread's buffers (where
        # ATen's fp32 matmuls are IEEE), else ATen's GEMM on fp32 copies (here forced by the
        # "high" matmul precision): within the fp32 bound either way, the same bits where
        # "high" leaves ATen's CPU GEMM IEEE (no AMX-FP16); row- and column-major weights,
        # N past a 512-column block with a tail, half and fp32 outputs, 1-2 threads
        exact = "amx_fp16" not in P._cpuinfo()[1]
        g = torch.Generator().manual_seed(10)
        mod = _native.kernels()
        sizes, n = _THREADED_SIZES[3], 603
        offs = _offs_of(sizes)
        end = int(offs[-1])
        x = torch.randn(end + 3, 40, generator=g).to(BF16)
        dy = torch.randn(end + 3, n, generator=g).to(BF16)
        before = torch.get_float32_matmul_precision()
        for layout, threads, out_dtype in itertools.product(("row", "col"), (1, 2), (BF16, F32)):
            w = _few_weight(len(sizes), 40, n, BF16, layout, g)
            outs = []
            for precision in ("highest", "high"):
                got = torch.full((end + 3, n), float("nan"), dtype=out_dtype)
                dw = torch.full((len(sizes), 40, n), float("nan"), dtype=out_dtype)
                try:
                    torch.set_float32_matmul_precision(precision)
                    with intra_op_threads(threads):
                        mod.threaded_grouped_mm(x, w, offs, got, False, False, None, False, True)
                        args = (False, None, None, False, False, True)
                        mod.threaded_grouped_mm_wgrad(x.t(), dy, offs, dw, *args)
                finally:
                    torch.set_float32_matmul_precision(before)
                msg = f"{layout} {threads} {out_dtype} {precision}"
                assert_gemm_within(self, got, x, w, offs, msg)
                assert_gemm_within(self, dw, x, dy, offs, msg, wgrad=True)
                outs.append((got, dw))
            if exact:
                self.assertEqual(outs[0], outs[1], atol=0, rtol=0, msg=f"{layout} {threads}")

    def test_upcast_route_follows_the_fp32_precision(self):
        # the sgemm_ route (upcast_in_scratch) where ATen's CPU fp32 matmuls are IEEE as
        # ATen resolves them (the new API at each of its levels, the legacy setter), the
        # at::mm one where tf32 or bf16; no setting makes the kernels raise (the legacy
        # getter, which raises once the two APIs were mixed, is not asked)
        mod = _native.kernels()
        g = torch.Generator().manual_seed(11)
        offs = _offs_of([30, 0, 40])
        x = torch.randn(72, 40, generator=g).to(BF16)
        w = _few_weight(3, 40, 24, BF16, "row", g)
        levels = [torch.backends, torch.backends.mkldnn, torch.backends.mkldnn.matmul]
        before = [level.fp32_precision for level in levels]
        legacy = torch.get_float32_matmul_precision()
        cases = [(0, "tf32", False), (1, "bf16", False), (2, "tf32", False), (2, "ieee", True)]
        cases += [(None, "high", False), (None, "medium", False), (None, "highest", True)]
        # (the test harness locks torch.backends' flags outside its context manager)
        mutable = getattr(torch.backends, "__allow_nonbracketed_mutation")
        for level, value, direct in cases:
            try:
                if level is None:
                    torch.set_float32_matmul_precision(value)
                else:  # (the levels below it inheriting: a level's own setting wins)
                    with mutable():
                        for lv in levels:
                            lv.fp32_precision = "none"
                        levels[level].fp32_precision = value
                in_scratch = mod.upcast_in_scratch()
                got = torch.full((72, 24), float("nan"), dtype=BF16)
                with intra_op_threads(2):
                    mod.threaded_grouped_mm(x, w, offs, got, False, False, None, False, True)
            finally:
                torch.set_float32_matmul_precision(legacy)
                with mutable():
                    for lv, b in zip(levels, before):
                        lv.fp32_precision = b
            self.assertEqual(in_scratch, direct, msg=f"{level} {value}")
            assert_gemm_within(self, got, x, w, offs, f"{level} {value}")

    def test_wgrad_transposing_pads_with_zeros(self):
        # the thread's scratch is reused: a piece with an odd row count after one whose
        # values were NaN must not read them past its rows (oneDNN's AMX GEMM reads the
        # element past an odd count, its k pairs); one thread, so one scratch
        g = torch.Generator().manual_seed(8)
        with intra_op_threads(1):
            nan = torch.full((33, 64), float("nan"), dtype=BF16)
            _threaded_wgrad(nan.t(), torch.ones(33, 16, dtype=BF16), _offs_of([33]), True)
            x = torch.randn(31, 64, generator=g).to(BF16)
            dy = torch.randn(31, 16, generator=g).to(BF16)
            offs = _offs_of([31])
            got = _threaded_wgrad(x.t(), dy, offs, transpose_a=True)
        self.assertFalse(got.isnan().any())
        assert_gemm_within(self, got, x, dy, offs, "dW", wgrad=True)

    @parametrize("dtype", [BF16, F16, F32])
    def test_row_split_within_the_gemm_bound(self, dtype):
        # groups whose rows oneDNN would cut into blocks under 64 rows (481 = 13 x 37, 259
        # = 7 x 37, 578 = 17 x 34) run split, next to ones it blocks well (480, 257) and
        # short ones; on 1-3 threads (shares cut the long groups by columns); the half
        # dtypes' bits as unsplit (the kernel's claim, which test_eager's bitwise
        # comparisons rest on)
        g = torch.Generator().manual_seed(6)
        sizes = [481, 0, 259, 30, 578, 480, 257]
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
        end = int(offs[-1])
        x = torch.randn(end + 2, 24, generator=g).to(dtype)
        for layout in ("row", "col"):
            w = _few_weight(len(sizes), 24, 40, dtype, layout, g)
            for threads in (1, 2, 3):
                with self.subTest(layout=layout, threads=threads), intra_op_threads(threads):
                    got = _threaded_mm(x, w, offs, split_rows=True)
                    assert_gemm_within(self, got, x, w, offs, f"{layout} on {threads}")
                    self.assertTrue((got[end:] == 0).all())
                    if dtype != F32:
                        self.assertTrue(torch.equal(got, _threaded_mm(x, w, offs)))

    def test_row_split_where_onednn_blocks_small(self):
        # one GEMM per group unless oneDNN's AVX-512 blocking (the largest of 32-256 rows
        # with the least padding) leaves blocks under 64 rows: then ceil(rows / 256) GEMMs
        x, w = torch.randn(600, 16).to(BF16), torch.randn(1, 16, 8).to(BF16)
        want = {481: 2, 480: 1, 482: 1, 256: 1, 259: 2, 578: 3, 577: 3, 545: 1, 300: 1}
        parts = {rows: _native.kernels().row_split_parts(rows) for rows in want}
        self.assertEqual(parts, want)
        for rows, gemms in want.items():
            offs = torch.tensor([rows], dtype=torch.int32)
            for split, n in ((True, gemms), (False, 1)):
                with self.subTest(rows=rows, split=split), intra_op_threads(1):
                    with torch.profiler.profile(record_shapes=True) as prof:
                        _threaded_mm(x[:rows], w, offs, split_rows=split)
                    pieces = [e.input_shapes[0][0] for e in prof.events() if e.name == "aten::mm"]
                    # near-equal pieces (no small last one), all the rows
                    self.assertEqual(len(pieces), n)
                    self.assertEqual(sum(pieces), rows)
                    self.assertLessEqual(max(pieces) - min(pieces), 1)

    def test_deterministic(self):
        g = torch.Generator().manual_seed(5)
        offs = torch.tensor([70, 70, 171, 260], dtype=torch.int32)
        x, w = torch.randn(260, 64, generator=g).to(BF16), torch.randn(4, 64, 48).to(BF16)
        with intra_op_threads(2):
            first = _threaded_mm(x, w, offs)
            for _ in range(3):
                self.assertTrue(torch.equal(_threaded_mm(x, w, offs), first))

    def test_callers_grad_mode_in_the_pool(self):
        # a parameter as an operand under no_grad (the experts' backward passes its
        # weights so): the pool's threads must multiply under the caller's grad mode, not
        # their own (grad enabled, and ATen's out= GEMMs refuse tensors that need grad)
        x = torch.randn(256, 32)
        w = torch.randn(2, 32, 16, requires_grad=True)
        dy = torch.randn(256, 16, requires_grad=True)
        offs = torch.tensor([100, 256], dtype=torch.int32)
        with intra_op_threads(2), torch.no_grad():
            got = _threaded_mm(x, w, offs)
            dw = _threaded_wgrad(x.t(), dy, offs)
        self.assertEqual(got, torch.cat([x[:100] @ w[0], x[100:] @ w[1]]).detach())
        self.assertEqual(dw[1], (x[100:].t() @ dy[100:]).detach())

    def test_bad_operands(self):
        mod = _native.kernels()
        x, w = torch.randn(6, 16).to(BF16), torch.randn(3, 16, 8).to(BF16)
        offs = torch.tensor([2, 4, 6], dtype=torch.int32)
        out = x.new_empty((6, 8))
        cases = [
            ((x, w, offs, out.float()), r"x, w and out must share a dtype \(upcast: .*Float"),
            ((x, w, offs, out.float(), False, True, None, False, True), r"no native_gemm\), got"),
            ((x.int(), w, offs, out, False, False, None, False, True), r"got Int, BFloat16"),
            ((x, w, offs, out.t().contiguous().t()), r"out must be a contiguous"),
            ((x, w, offs.long(), out), r"offs must be a contiguous int32 tensor of 3"),
            ((x, w, torch.tensor([4, 2, 6], dtype=torch.int32), out), r"got 2 at group 1"),
            ((x, w, torch.tensor([2, 4, 7], dtype=torch.int32), out), r"the 6 rows, got 7"),
            ((x, torch.randn(3, 12, 8).to(BF16), offs, out), r"x \[M, K\] and w \[E, K, N\]"),
        ]
        for args, msg in cases:
            with self.subTest(msg=msg), self.assertRaisesRegex(RuntimeError, msg):
                mod.threaded_grouped_mm(*args)
        dy, dw = torch.randn(6, 8).to(BF16), torch.empty(3, 16, 8).to(BF16)
        cases = [
            ((x.t(), dy, offs, dw[:2]), r"out must be a contiguous \[E, K, N\] tensor"),
            ((x.t(), dy.float(), offs, dw), r"a, dy and out must share a dtype \(upcast: "),
            ((x.t(), dy, offs, dw, False, None, None, True, False, True), r"or transpose_a\)"),
            ((x, dy, offs, dw), r"a \[K, M\] and dy \[M, N\]"),
            ((x.t(), dy, torch.tensor([2, 7, 7], dtype=torch.int32), dw), r"got 7 at group 1"),
        ]
        transposing = r"transpose_a takes a column-major a of a 16-bit dtype, got strides"
        cases += [  # transpose_a: a must be x^T (the column-major view) of a half dtype
            ((x.t().contiguous(), dy, offs, dw, False, None, None, True), transposing),
            ((x.float().t(), dy.float(), offs, dw.float(), False, None, None, True), transposing),
        ]
        for args, msg in cases:
            with self.subTest(msg=msg), self.assertRaisesRegex(RuntimeError, msg):
                mod.threaded_grouped_mm_wgrad(*args)


needs_bf16_gemm = unittest.skipUnless(
    native_gemm_available(), "the native bf16 GEMM needs an AVX-512 build on a CPU with AVX512-BF16"
)


def _operand(rows, cols, layout, g):
    """A bf16 [rows, cols] matrix: row- or column-major, or either as a slice of a wider one
    (a row / column stride past the width)."""
    if layout == "row":
        return torch.randn(rows, cols, generator=g).to(BF16)
    if layout == "col":
        return torch.randn(cols, rows, generator=g).to(BF16).t()
    if layout == "row_slice":
        return torch.randn(rows, cols + 9, generator=g).to(BF16)[:, 3 : 3 + cols]
    return torch.randn(cols + 9, rows, generator=g).to(BF16)[5 : 5 + cols].t()


@contextlib.contextmanager
def micro_kernel(amx):
    """The native bf16 GEMM's micro-kernel for the block: AMX tiles (``amx``; where the CPU
    and the OS allow them, else the test skips) or AVX512-BF16 dot products."""
    mod = _native.kernels()
    before = mod.bf16_mm_amx()
    try:
        if mod.bf16_mm_use_amx(amx) != amx:
            raise unittest.SkipTest("no AMX here")
        yield
    finally:
        mod.bf16_mm_use_amx(before)


def _bf16_mm(a, b):
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=BF16)  # every element written
    ran = _native.kernels().bf16_mm(a, b, out)
    return ran, out


@instantiate_parametrized_tests
@needs_native
class TestNativeFewRowsMMAMX(TestCase):
    """``few_rows_mm(..., amx_rows)``: a column-major bf16 weight's groups of at least
    ``amx_rows`` rows by the native GEMM's AMX micro-kernel (each such group's bits those
    of ``bf16_mm`` on it, the others' those of the vdpbf16ps form, within the GEMM bound,
    the same on any thread count, rows past the groups zero); elsewhere (a row-major
    weight, fp16, AMX off) it changes no bit."""

    @parametrize("layout", ["col", "col_slice"])
    def test_the_amx_gemm_per_group(self, layout):
        g = torch.Generator().manual_seed(12)
        # groups of 1-40 rows (one b tile up to 16, two past), empty ones; K whole 32-k
        # steps and not, odd; N past and under a 32-row weight block and a 256-column task
        cases = (([3, 0, 16, 17, 1], 64, 300), ([32, 5, 40], 77, 70), ([8, 0, 0, 2], 768, 33))
        with micro_kernel(True):
            for sizes, k, n in cases:
                offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
                end = int(offs[-1])
                x = torch.randn(end + 2, k, generator=g).to(BF16)  # 2 rows past
                w = _few_weight(len(sizes), k, n, BF16, layout, g)
                plain = _few_mm(x, w, offs)
                for least in (1, 5, 17):  # every group, and those of 5 / 17 rows or more
                    with intra_op_threads(1):
                        got = _few_mm(x, w, offs, amx_rows=least)
                    msg = f"{sizes} k={k} n={n} from {least} rows"
                    assert_gemm_within(self, got, x, w, offs, msg)
                    self.assertTrue((got[end:] == 0).all())
                    start = 0
                    for e, stop in enumerate(offs.tolist()):
                        if stop - start >= least:
                            ran, want = _bf16_mm(x[start:stop], w[e])
                            self.assertTrue(ran)
                        else:
                            want = plain[start:stop]
                        self.assertTrue(torch.equal(got[start:stop], want), msg=f"{msg} {e}")
                        start = stop
                    for threads in (2, 3):
                        with intra_op_threads(threads):
                            self.assertTrue(torch.equal(_few_mm(x, w, offs, least), got))

    def test_each_group_by_its_form(self):
        # random operands round both forms' sums alike almost everywhere; here they part
        # in every element (2^25 and -2^25 at a row's two ends absorb different ones of
        # the 1022 ones between: the two forms add them in different orders), so a group
        # either side of a threshold shows which form ran
        k, sizes = 1024, [4, 5, 16, 17]
        offs = _offs_of(sizes)
        x = torch.ones(sum(sizes), k)
        x[:, 0], x[:, -1] = 2.0**25, -(2.0**25)
        x = x.to(BF16)
        w = torch.ones(len(sizes), 64, k, dtype=BF16).transpose(-2, -1)
        with micro_kernel(True):
            plain = _few_mm(x, w, offs)
            tiles = torch.cat(
                [
                    _bf16_mm(x[a:b], w[e])[1]
                    for e, (a, b) in enumerate(zip([0, 4, 9, 25], offs.tolist()))
                ]
            )
            self.assertTrue((plain != tiles).all())
            for least in (1, 5, 17):
                got = _few_mm(x, w, offs, amx_rows=least)
                for e, (a, b) in enumerate(zip([0, 4, 9, 25], offs.tolist())):
                    want = tiles if sizes[e] >= least else plain
                    self.assertTrue(torch.equal(got[a:b], want[a:b]), msg=f"{least} {e}")

    @parametrize("case", ["row_major", "fp16", "amx_off"])
    def test_the_flag_elsewhere_changes_nothing(self, case):
        g = torch.Generator().manual_seed(13)
        offs = torch.tensor([3, 3, 12, 14], dtype=torch.int32)
        dtype = F16 if case == "fp16" else BF16
        x = torch.randn(14, 96, generator=g).to(dtype)
        w = _few_weight(4, 96, 80, dtype, "row" if case == "row_major" else "col", g)
        with micro_kernel(case != "amx_off"):  # tiles on, but for amx_off (else skipped)
            want = _few_mm(x, w, offs)
            self.assertTrue(torch.equal(_few_mm(x, w, offs, amx_rows=1), want))


_LAYOUTS = ["row", "col", "row_slice", "col_slice"]


@instantiate_parametrized_tests
@needs_bf16_gemm
class TestNativeBF16GEMM(TestCase):
    """``bf16_mm`` (the packed bf16 GEMM the threaded kernel's pieces run where the
    probe's ``gemm_kernel`` says so), by its AVX512-BF16 micro-kernel here and by its AMX
    one in the subclass below: within the GEMM rounding bound of the float64 product
    for every layout of both operands, with tails of the 6-row (AMX: 32-row) tiles and
    64-column panels, one and several K blocks, one and several passes over the rows;
    bits that depend on K only (any row or column slice, either layout, the same bits),
    K's blocks summed from zero (AVX512-BF16); where it does not apply it runs nothing and
    says so."""

    AMX = False

    def setUp(self):
        super().setUp()
        self._kernel = micro_kernel(self.AMX)
        self._kernel.__enter__()
        self.addCleanup(self._kernel.__exit__, None, None, None)

    @parametrize("a_layout", _LAYOUTS)
    @parametrize("b_layout", _LAYOUTS)
    def test_within_the_gemm_bound(self, a_layout, b_layout):
        g = torch.Generator().manual_seed(21)
        # (M, K, N): tails of the 6-row tile and the 64-column panel, K under one 16-pair
        # transpose, over a 512-element K block, and K large enough for several passes
        # odd K too (its last element paired with zero)
        cases = ((1, 2, 1), (7, 30, 65), (13, 64, 64), (6, 1026, 130), (300, 2048, 70))
        cases += ((5, 1, 3), (9, 37, 64), (4, 1025, 17))
        for m, k, n in cases:
            a, b = _operand(m, k, a_layout, g), _operand(k, n, b_layout, g)
            ran, got = _bf16_mm(a, b)
            self.assertTrue(ran)
            one = torch.tensor([m], dtype=torch.int32)
            assert_gemm_within(self, got, a, b.unsqueeze(0), one, f"{m}x{k}x{n}")

    @parametrize("a_layout", ["row", "col"])
    @parametrize("b_layout", ["row", "col"])
    def test_fp32_out_takes_the_sums_unrounded(self, a_layout, b_layout):
        # an fp32 out: the AVX512-BF16 micro-kernel's fp32 sums, also where AMX is on (its
        # bits do not depend on the CPU's AMX), within the fp32 bound; rounded to bf16,
        # that micro-kernel's bf16 output bit for bit
        g = torch.Generator().manual_seed(25)
        for m, k, n in ((1, 2, 1), (7, 30, 65), (13, 1026, 130), (300, 2048, 70), (4, 1025, 17)):
            a, b = _operand(m, k, a_layout, g), _operand(k, n, b_layout, g)
            out = torch.full((m, n), float("nan"))
            self.assertTrue(_native.kernels().bf16_mm(a, b, out))
            one = torch.tensor([m], dtype=torch.int32)
            assert_gemm_within(self, out, a, b.unsqueeze(0), one, f"{m}x{k}x{n}")
            with micro_kernel(False):
                rounded = _bf16_mm(a, b)[1]
                again = torch.empty(m, n)
                self.assertTrue(_native.kernels().bf16_mm(a, b, again))
            self.assertEqual(out.bfloat16(), rounded, atol=0, rtol=0)
            self.assertEqual(out.view(torch.int32), again.view(torch.int32), atol=0, rtol=0)

    def test_bits_depend_on_k_only(self):
        # a row's products in a tile of 1-6 rows, a column in a full or a tail panel, the
        # rows in one pass or several, a and b in either layout: the same bits
        g = torch.Generator().manual_seed(22)
        m, k, n = 301, 1100, 150
        a, b = torch.randn(m, k, generator=g).to(BF16), torch.randn(k, n, generator=g).to(BF16)
        whole = _bf16_mm(a, b)[1]
        for a_, b_ in ((a.t().contiguous().t(), b), (a, b.t().contiguous().t())):
            self.assertTrue(torch.equal(_bf16_mm(a_, b_)[1], whole))
        for (r0, r1), (c0, c1) in (
            ((0, 1), (0, 150)),
            ((5, 12), (64, 129)),
            ((300, 301), (149, 150)),
        ):
            with self.subTest(rows=(r0, r1), cols=(c0, c1)):
                part = _bf16_mm(a[r0:r1], b[:, c0:c1])[1]
                self.assertTrue(torch.equal(part, whole[r0:r1, c0:c1]))

    def test_padding_pairs_ignore_the_scratch(self):
        # the panels past K's pairs (up to a whole 32-k step) are zero whatever a previous
        # call left in the thread's scratch: a call whose b is all infinities (K a multiple
        # of 32), then K = 33, whose padded pairs meet zeros of a (inf * 0 would be NaN)
        g = torch.Generator().manual_seed(23)
        inf_b = torch.full((64, 130), float("inf"), dtype=BF16)
        self.assertTrue(_bf16_mm(torch.ones(3, 64, dtype=BF16), inf_b)[0])
        a, b = torch.randn(5, 33, generator=g).to(BF16), torch.randn(33, 130, generator=g).to(BF16)
        ran, got = _bf16_mm(a, b)
        self.assertTrue(ran)
        self.assertFalse(bool(got.isnan().any()))
        assert_gemm_within(
            self, got, a, b.unsqueeze(0), torch.tensor([5], dtype=torch.int32), "K=33"
        )

    def test_k_blocks_summed_from_zero(self):
        # K = 1024: two blocks of 512 products, each summed from zero, then added. Block one
        # is 2^25 then 511 ones (each below half an fp32 ulp of 2^25: lost), block two -2^25
        # then 511 ones: the blocks give 2^25 and -2^25, the product 0. One running sum
        # would lose the first 511 ones and keep the last: 511.
        # (the AMX micro-kernel has no such blocks: test_threaded_kernel_runs_it)
        if self.AMX:
            self.skipTest("the AMX micro-kernel sums K in one sequence of 32-k steps")
        a = torch.ones(1, 1024, dtype=BF16)
        a[0, 0], a[0, 512] = 2.0**25, -(2.0**25)
        b = torch.ones(1024, 1, dtype=BF16)
        self.assertEqual(_bf16_mm(a, b)[1].item(), 0.0)
        self.assertEqual(_bf16_mm(a[:, :512], b[:512])[1].item(), 2.0**25)

    def test_threaded_kernel_runs_it(self):
        # native_gemm: the pieces are this GEMM's, not ATen's (whose bits can agree with
        # it): K = 2048 whose four 512-blocks sum to 2^25 (+511 ones lost), 512, -2^25
        # and 512, so 1024; one running sum gives 1023, 1024-blocks 0. The AMX
        # micro-kernel adds 32 products per instruction (the hardware's sum of them, then
        # the running sum): at K = 1024 its sum and oneDNN's differ on the Xeon measured
        # (992 and 896); where they agree the check cannot tell them apart and skips
        k = 1024 if self.AMX else 2048
        x = torch.ones(3, k, dtype=BF16)
        x[:, 0], x[:, k // 2] = 2.0**25, -(2.0**25)
        w = torch.ones(1, k, 20, dtype=BF16)
        want = _bf16_mm(x, w[0])[1][0, 0].item() if self.AMX else 1024
        if self.AMX and want == (x @ w[0])[0, 0].item():
            self.skipTest("the AMX micro-kernel and ATen round these sums alike here")
        for threads in (1, 2):
            with intra_op_threads(threads):
                out = x.new_empty((3, 20))
                offs = torch.tensor([3], dtype=torch.int32)
                _native.kernels().threaded_grouped_mm(x, w, offs, out, False, True)
                self.assertTrue((out == want).all(), msg=str(out[0]))
                dw = x.new_empty((1, 20, 20))
                a = torch.ones(k, 20, dtype=BF16)
                a[0], a[k // 2] = 2.0**25, -(2.0**25)
                offs = torch.tensor([k], dtype=torch.int32)
                _native.kernels().threaded_grouped_mm_wgrad(a.t(), w[0], offs, dw, True)
                self.assertTrue((dw == want).all(), msg=str(dw[0, 0]))

    def test_only_where_it_applies(self):
        a, b = torch.randn(8, 6).to(BF16), torch.randn(6, 4).to(BF16)
        out = torch.empty(8, 4, dtype=BF16)
        cases = {
            "fp16": (a.half(), b.half(), out.half()),
            "fp32": (a.float(), b.float(), out.float()),
            "fp16 out": (a, b, out.half()),
            "a strided both ways": (torch.randn(8, 12).to(BF16)[::2, ::2], b, out[:4]),
            "b strided both ways": (a, torch.randn(12, 8).to(BF16)[::2, ::2], out),
            "out column-major": (a, b, torch.empty(4, 8, dtype=BF16).t()),
            "shapes": (a, b[:4], out),
        }
        for name, (x, y, o) in cases.items():
            o.fill_(7)
            with self.subTest(name):
                self.assertFalse(_native.kernels().bf16_mm(x, y, o))
                self.assertTrue((o == 7).all())

    def test_block_scaled_ops_refuse_what_they_do_not_take(self):
        # fp8_block_scaled_mm(_wgrad) (the FP8 emulation's blockwise GEMMs, values in
        # test_scaled_grouped_mm): false without touching out for operands they do not take
        mod = _native.kernels()
        a, b = torch.ones(6, 10, dtype=BF16), torch.ones(2, 10, 70, dtype=BF16)
        rs, cs = torch.ones(6, 3), torch.ones(2, 3, 128)
        offs, out = torch.tensor([2, 6], dtype=torch.int32), torch.full((6, 70), 7.0, dtype=BF16)
        cases = {
            "fp16 a": (a.half(), b, rs, cs, offs, 4, out),
            "odd block": (a, b, torch.ones(6, 4), cs, offs, 3, out),
            "row scales of 2 blocks": (a, b, rs[:, :2], cs, offs, 4, out),
            "columns' scales not padded to 128": (a, b, rs, cs[:, :, :70], offs, 4, out),
            "a column-major": (a.t().contiguous().t(), b, rs, cs, offs, 4, out),
            "offs past the rows": (a, b, rs, cs, torch.tensor([2, 7], dtype=torch.int32), 4, out),
            "offs int64": (a, b, rs, cs, offs.long(), 4, out),
            "out fp16": (a, b, rs, cs, offs, 4, out.half()),
        }
        for name, args in cases.items():
            before = args[-1].clone()
            with self.subTest(name):
                self.assertFalse(mod.fp8_block_scaled_mm(*args))
                self.assertTrue(torch.equal(args[-1], before))
        dy, out_w = torch.ones(6, 70, dtype=BF16), torch.full((2, 10, 70), 7.0, dtype=BF16)
        rs_w, cs_w = torch.ones(2, 10), torch.ones(2, 128)
        cases = {
            "jagged blocks past the scale rows": (a, dy, rs_w, cs_w, offs, 2, out_w),
            "b column-major": (a, dy.t().contiguous().t(), torch.ones(3, 10), cs_w, offs, 6, out_w),
            "columns' scales not padded": (a, dy, rs_w, cs_w[:, :70], offs, 6, out_w),
            "out of another shape": (a, dy, rs_w, cs_w, offs, 6, out_w[:, :9]),
        }
        for name, args in cases.items():
            before = args[-1].clone()
            with self.subTest(name):
                self.assertFalse(mod.fp8_block_scaled_mm_wgrad(*args))
                self.assertTrue(torch.equal(args[-1], before))
        self.assertTrue(mod.fp8_block_scaled_mm_wgrad(a, dy, rs_w, cs_w, offs, 6, out_w))
        e4m3 = torch.float8_e4m3fn  # codes with bf16: refused
        for name, (x, y, z) in {
            "a codes, b bf16": (a.to(e4m3), b, dy),
            "a bf16, b codes": (a, b.to(e4m3), dy.to(e4m3)),
        }.items():
            with self.subTest(name):
                self.assertFalse(mod.fp8_block_scaled_mm(x, y, rs, cs, offs, 4, out))
                self.assertFalse(mod.fp8_block_scaled_mm_wgrad(x, z, rs_w, cs_w, offs, 6, out_w))

    def test_block_scaled_ops_take_codes(self):
        # e4m3 codes as operands, each piece converted to bf16 in the thread's scratch: the
        # bits of the same call on the codes' bf16 values, on one and two threads, either
        # layout of b, empty groups, NaN codes (the first case only: one NaN in a row's K
        # makes its outputs NaN, whatever the rest), and at K = 16384 a group past one
        # piece of rows (128 a piece: its b converted again for each)
        mod = _native.kernels()
        g = torch.Generator().manual_seed(26)

        def codes(*shape, nan=False):
            q = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
            if not nan:
                q[(q & 0x7F) == 0x7F] = 0  # no NaN codes
            return q.view(torch.float8_e4m3fn)

        def same(x, y):  # bit for bit, NaN where NaN (ATen's cast of a NaN code: 0x7FC0)
            nan = x.isnan()
            bits = x[~nan].view(torch.int16), y[~nan].view(torch.int16)
            return torch.equal(nan, y.isnan()) and torch.equal(*bits)

        def agree(op, args, shape, **where):  # on codes, the bits of the call on bf16
            want = torch.empty(shape, dtype=BF16)
            bf16 = [
                t.to(BF16) if getattr(t, "dtype", None) == torch.float8_e4m3fn else t for t in args
            ]
            self.assertTrue(op(*bf16, want))
            for threads in (1, 2):
                with intra_op_threads(threads), self.subTest(threads=threads, **where):
                    got = torch.full(shape, 7.0, dtype=BF16)
                    self.assertTrue(op(*args, got))
                    self.assertTrue(same(got, want))

        bk = 128
        cases = (([3, 0, 17], 300, 70, True), ([300, 1], 16384, 65, False))
        for sizes, k, n, nan in (*cases, ([0, 40, 9], 128, 300, False)):
            offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
            m, e, ks = sum(sizes) + 2, len(sizes), -(-k // bk)
            a = codes(m, k, nan=nan)
            rs = torch.rand(m, ks, generator=g) + 0.5
            cs = torch.rand(e, ks, -(-n // 64) * 64, generator=g) + 0.5
            for layout in ("row", "col"):
                b = codes(e, k, n) if layout == "row" else codes(e, n, k).transpose(1, 2)
                args = (a, b, rs, cs, offs, bk)
                agree(mod.fp8_block_scaled_mm, args, (m, n), sizes=sizes, k=k, b=layout)
            # the weight gradient: out[g] = a[g's rows]^T @ dy[g's rows] in jagged blocks
            if k > 1024:
                continue
            nb = sum(-(-s // bk) for s in sizes)
            rs_w = torch.rand(nb, k, generator=g)
            cs_w = torch.rand(nb, -(-n // 64) * 64, generator=g)
            args = (a, codes(m, n), rs_w, cs_w, offs, bk)
            agree(mod.fp8_block_scaled_mm_wgrad, args, (e, k, n), sizes=sizes, k=k, wgrad=True)

    def test_mx_few_rows_mm_gives_the_few_rows_kernels_bits(self):
        # fp8_mx_few_rows_mm: each code times its E8M0 scale in registers, then the
        # few-rows kernel's column-major form; the bits of few_rows_mm on the weight
        # dequantized by the native dequantizer (the route it replaces): every code (NaN,
        # zero, subnormal), the scales' range ends (2^-117 and 2^119), groups of 1-9
        # rows (tiles of 4), N not a multiple of 4 or 64, one and two threads; refused
        # (out untouched) for a scale past the range, K not a multiple of 32, a
        # row-major weight
        mod = _native.kernels()
        g = torch.Generator().manual_seed(541)
        e4m3 = torch.float8_e4m3fn
        for sizes, k, n in (([1, 0, 2, 3, 4, 5, 9], 256, 70), ([1, 1], 64, 300), ([3], 32, 17)):
            e, m = len(sizes), sum(sizes) + 1
            offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
            x = torch.randn(m, k, generator=g).to(BF16)
            q = torch.randint(0, 256, (e, n, k), generator=g, dtype=torch.uint8)
            e8 = torch.randint(118, 137, (e, n, k // 32), generator=g, dtype=torch.uint8)
            e8[0, 0, 0], e8[-1, -1, -1] = 10, 246  # 2^-117, 2^119
            b, scale = q.view(e4m3).transpose(1, 2), e8.transpose(1, 2)  # [e, k, n] column-major
            deq = torch.empty(e, n, k, dtype=BF16)
            for i in range(e):  # the dequantizer's bits: rows of k codes, a scale per 32
                sf = torch.exp2(e8[i].float() - 127)
                self.assertTrue(mod.fp8_dequantize_scaled(q[i].view(e4m3), sf, None, 1, 32, deq[i]))
            want = torch.empty(m, n, dtype=BF16)
            mod.few_rows_mm(x, deq.transpose(1, 2), offs, want, 0)
            nan = want.isnan()
            for threads in (1, 2):
                with intra_op_threads(threads), self.subTest(sizes=sizes, threads=threads):
                    got = torch.full((m, n), 7.0, dtype=BF16)
                    self.assertTrue(mod.fp8_mx_few_rows_mm(x, b, scale, offs, got))
                    self.assertTrue(torch.equal(got.isnan(), nan))
                    self.assertTrue(
                        torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
                    )
        x, offs = torch.ones(2, 64, dtype=BF16), torch.tensor([2], dtype=torch.int32)
        b = torch.ones(1, 64, 8).to(e4m3)  # row-major
        scale = torch.full((1, 2, 8), 127, dtype=torch.uint8)
        cases = {
            "a scale under 2^-117": (
                x,
                b.transpose(1, 2).contiguous().transpose(1, 2),
                scale.clone().fill_(9),
            ),
            "a scale over 2^119": (
                x,
                b.transpose(1, 2).contiguous().transpose(1, 2),
                scale.clone().fill_(247),
            ),
            "k not a multiple of 32": (  # (the scales of its one whole block)
                x[:, :48].contiguous(),
                b[:, :48].transpose(1, 2).contiguous().transpose(1, 2),
                scale[:, :1],
            ),
            "a row-major weight": (x, b, scale),
        }
        for name, (xx, bb, ss) in cases.items():
            out = torch.full((2, 8), 7.0, dtype=BF16)
            with self.subTest(name):
                self.assertFalse(mod.fp8_mx_few_rows_mm(xx, bb, ss, offs, out))
                self.assertTrue((out == 7).all())

    @parametrize("layout", ["row", "col"])
    def test_block_scaled_mm_few_rows_form_gives_the_pieces_bits(self, layout):
        # few_rows=r: a group of codes of at most r rows by the few-rows form (the codes
        # converted once per chunk into a panel that the group's rows take), the same
        # sequence of operations per element as the pieces' GEMM, so the bits of the call
        # on the codes' bf16 values (which never takes the form): groups of 1-5 rows
        # (register tiles of 4), 9-17 (strips of 64 columns, the sums in L1 between
        # chunks), one past r (the pieces); every code (NaN included: one NaN in a row's
        # K makes that output NaN, whatever the rest; subnormals, -0), K odd and under
        # 32 (masked loads, the last pair (a[K - 1], 0)), k blocks of a number of pairs
        # that is not a multiple of 16, N not a multiple of 16 or 64, an fp32 out, one
        # and two threads; b a slice of a larger tensor whose codes past it are NaN, which
        # must never be read (0 * NaN would make sums NaN)
        mod = _native.kernels()
        g = torch.Generator().manual_seed(54)
        e4m3 = torch.float8_e4m3fn

        def same(x, y):  # bit for bit, NaN where NaN
            nan = x.isnan()
            view = torch.int16 if x.dtype == BF16 else torch.int32
            return torch.equal(nan, y.isnan()) and torch.equal(
                x[~nan].view(view), y[~nan].view(view)
            )

        nan_code = torch.tensor([0x7F], dtype=torch.uint8).view(e4m3)
        cases = (  # sizes, k, n, block_k, NaN codes, out dtype
            ([1, 0, 2, 3, 4, 5, 17, 18], 1024, 70, 512, False, BF16),
            ([1, 9, 4, 0], 300, 300, 128, True, BF16),
            ([2, 1, 6], 37, 17, 34, False, BF16),
            ([3, 5], 33, 130, 34, True, torch.float32),
            ([1, 16], 256, 64, 256, False, BF16),
        )
        for sizes, k, n, bk, nan, out_dtype in cases:
            offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
            m, e, ks = sum(sizes) + 1, len(sizes), -(-k // bk)
            q = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8)
            if not nan:
                q[(q & 0x7F) == 0x7F] = 0
            a = q.view(e4m3)
            wq = torch.randint(0, 256, (e, k + 3, n + 5), generator=g, dtype=torch.uint8)
            if not nan:
                wq[(wq & 0x7F) == 0x7F] = 0
            big = wq.view(e4m3)
            if layout == "row":  # rows of n codes, each followed by NaN codes, NaN rows past k
                big[:, k:] = nan_code
                big[:, :, n:] = nan_code
                b = big[:, :k, :n]
            else:  # columns of k codes, each followed by NaN codes
                big = big.transpose(1, 2).contiguous()[:, : n + 5, : k + 3]
                big[:, :, k:] = nan_code
                b = big[:, :n, :k].transpose(1, 2)
            rs = torch.rand(m, ks, generator=g) + 0.5
            cs = torch.rand(e, ks, -(-n // 64) * 64, generator=g) + 0.5
            want = torch.empty(m, n, dtype=out_dtype)
            self.assertTrue(mod.fp8_block_scaled_mm(a.to(BF16), b.to(BF16), rs, cs, offs, bk, want))
            for few, threads in itertools.product((4, 17), (1, 2)):
                where = dict(sizes=sizes, k=k, n=n, few=few, threads=threads)
                with intra_op_threads(threads), self.subTest(**where):
                    got = torch.full((m, n), 7.0, dtype=out_dtype)
                    self.assertTrue(
                        mod.fp8_block_scaled_mm(a, b, rs, cs, offs, bk, got, False, few)
                    )
                    self.assertTrue(same(got, want))

    @parametrize("a_layout", ["row", "col"])
    @parametrize("b_layout", ["row", "col"])
    def test_odd_k_reads_nothing_past_a_row(self, a_layout, b_layout):
        # an odd K's last element pairs with zero: the element after it (the next row's or
        # column's first, here inf) must not be read, or 0 * inf makes the sums NaN; 40
        # rows: the AMX micro-kernel reads whole 32-row blocks of a row-major a in place
        g = torch.Generator().manual_seed(24)
        k = 37
        for m in (5, 40):
            a = torch.randn(m, k + 1, generator=g).to(BF16)
            b = torch.randn(k + 1, 70, generator=g).to(BF16)
            a[:, k], b[k] = float("inf"), float("inf")
            a = a if a_layout == "row" else a.t().contiguous().t()
            b = b if b_layout == "row" else b.t().contiguous().t()
            a_, b_ = a[:, :k], b[:k]  # each row / column followed by an inf
            ran, got = _bf16_mm(a_, b_)
            self.assertTrue(ran)
            one = torch.tensor([m], dtype=torch.int32)
            assert_gemm_within(self, got, a_, b_.unsqueeze(0), one, f"{m} rows")

    def test_empty(self):
        ran, got = _bf16_mm(torch.empty(5, 0, dtype=BF16), torch.empty(0, 3, dtype=BF16))
        self.assertTrue(ran)
        self.assertTrue((got == 0).all())
        self.assertTrue(_bf16_mm(torch.empty(0, 4, dtype=BF16), torch.randn(4, 3).to(BF16))[0])
        # K = 0 into rows strided past the output's columns: those columns zero, the rest
        # of each row untouched
        wide = torch.full((5, 8), float("nan"), dtype=BF16)
        out = wide[:, :3]
        empty_a, empty_b = torch.empty(5, 0, dtype=BF16), torch.empty(0, 3, dtype=BF16)
        self.assertTrue(_native.kernels().bf16_mm(empty_a, empty_b, out))
        self.assertTrue((wide[:, :3] == 0).all())
        self.assertTrue(wide[:, 3:].isnan().all())

    @parametrize("layout", ["row", "col"])
    @parametrize("dims", [(64, 90), (1040, 1600)])
    def test_threaded_kernel_pieces(self, layout, dims):
        # the threaded kernel with native_gemm: within the bound, the same bits on 1-3
        # threads, each group's rows the bits of bf16_mm on that group alone. Narrow
        # outputs share the groups' end-to-end rows out (a group on a share's edge split
        # by columns / output rows); with the native GEMM, every group
        # is cut into one share per thread where the groups are large (448 rows or more
        # on average) and each share is 512 or more (N = 1600 on 2 and 3 threads, K =
        # 1040 rows of dW on 2)
        g = torch.Generator().manual_seed(23)
        k, n = dims
        sizes = [300, 0, 37, 130, 1] if k < 512 else [600, 0, 500, 450]
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
        end = int(offs[-1])
        x = torch.randn(end + 2, k, generator=g).to(BF16)
        w = _few_weight(len(sizes), k, n, BF16, layout, g)
        dy = torch.randn(end + 2, 70, generator=g).to(BF16)
        got, dws = {}, {}
        for threads in (1, 2, 3):
            with intra_op_threads(threads):
                out = torch.full((end + 2, n), float("nan"), dtype=BF16)
                _native.kernels().threaded_grouped_mm(x, w, offs, out, False, True)
                dw = torch.full((len(sizes), k, 70), float("nan"), dtype=BF16)
                _native.kernels().threaded_grouped_mm_wgrad(x.t(), dy, offs, dw, True)
            got[threads], dws[threads] = out, dw
            assert_gemm_within(self, out, x, w, offs, f"on {threads}")
            assert_gemm_within(self, dw, x, dy, offs, f"wgrad on {threads}", wgrad=True)
            self.assertTrue((out[end:] == 0).all() and (dw[1] == 0).all())
        for threads in (2, 3):
            self.assertTrue(torch.equal(got[threads], got[1]))
            self.assertTrue(torch.equal(dws[threads], dws[1]))
        start = 0
        for e, stop in enumerate(offs.tolist()):
            if stop > start:
                want = _bf16_mm(x[start:stop], w[e])[1]
                self.assertTrue(torch.equal(got[1][start:stop], want))
                self.assertTrue(
                    torch.equal(dws[1][e], _bf16_mm(x[start:stop].t(), dy[start:stop])[1])
                )
            start = stop


@needs_native
class TestNativeTranspose16(TestCase):
    """``transpose16`` (the weight gradients' row-major copy of their operand,
    ``grouped_mm.transposed_copy``): x^T bit for bit for 16-bit dtypes, 32 x 32 blocks and
    their tails, strided rows on both sides, the same on 1-3 threads; where it does not
    apply it copies nothing and says so."""

    def test_bits(self):
        g = torch.Generator().manual_seed(41)
        for dtype in (BF16, torch.float16):
            for m, k in ((1, 1), (31, 33), (32, 32), (33, 64), (64, 31), (100, 97), (517, 300)):
                x = torch.randn(m, k + 5, generator=g).to(dtype)[:, 2 : 2 + k]
                want = x.t().contiguous()
                for threads in (1, 2, 3):
                    with self.subTest(dtype=str(dtype), m=m, k=k, threads=threads):
                        out = torch.full((k, m + 3), float("nan"), dtype=dtype)[:, :m]
                        with intra_op_threads(threads):
                            ran = _native.kernels().transpose16(x, out)
                        if not ran:  # a build without AVX-512 refuses
                            self.skipTest("transpose16 does not run in this build")
                        self.assertTrue(torch.equal(out.view(torch.int16), want.view(torch.int16)))
                        self.assertTrue(
                            out.as_strided((k, m + 3), out.stride())[:, m:].isnan().all()
                        )

    def test_only_where_it_applies(self):
        x = torch.randn(8, 6).to(BF16)
        cases = {
            "fp32": (x.float(), torch.zeros(6, 8)),
            "x strided columns": (
                torch.randn(8, 12).to(BF16)[:, ::2],
                torch.zeros(6, 8, dtype=BF16),
            ),
            "out column-major": (x, torch.zeros(8, 6, dtype=BF16).t()),
            "shapes": (x, torch.zeros(6, 7, dtype=BF16)),
            "dtypes": (x, torch.zeros(6, 8, dtype=torch.float16)),
        }
        for name, (a, out) in cases.items():
            out.fill_(7)
            with self.subTest(name):
                self.assertFalse(_native.kernels().transpose16(a, out))
                self.assertTrue((out == 7).all())


class TestNativeBF16GEMMAMX(TestNativeBF16GEMM):
    """The same by the AMX micro-kernel (skipped where the CPU or the OS has no AMX)."""

    AMX = True


def _gather(src, index):
    """src's rows ``index`` (zero rows where -1): what a gathered operand stands for."""
    out = src[index.clamp(min=0)]
    out[index < 0] = 0
    return out


@instantiate_parametrized_tests
@needs_native
class TestNativeGatheredOperands(TestCase):
    """The threaded kernels with gathered operands (``x_index`` forward; ``a_index`` /
    ``dy_index`` weight gradient: the permutation's gather read by the GEMM instead of
    materialized): the bits of the same call on the gathered tensors, with the native GEMM
    and without (the ATen fallback gathers), on 1-3 threads, rows of index -1 zero,
    repeated and unused source rows; bad indices refused by message."""

    def _case(self, seed):
        g = torch.Generator().manual_seed(seed)
        sizes = [70, 0, 3, 131, 1]
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
        m = int(offs[-1])
        index = torch.randint(-1, 50, (m,), generator=g)  # -1 rows, repeats; 50 of 60 used
        index[:4] = -1
        x = torch.randn(60, 40, generator=g).to(BF16)
        dy = torch.randn(60, 24, generator=g).to(BF16)
        return offs, index, x, dy, g

    @parametrize("native", [True, False])
    def test_forward_bits_of_the_gathered_rows(self, native):
        if native and not native_gemm_available():
            self.skipTest("no native bf16 GEMM here")
        offs, index, x, _, g = self._case(31)
        m = index.shape[0]
        for layout in ("row", "col"):
            w = _few_weight(5, 40, 90, BF16, layout, g)
            want = torch.full((m + 2, 90), float("nan"), dtype=BF16)
            rows = torch.cat([_gather(x, index), torch.randn(2, 40).to(BF16)])
            for threads in (1, 2, 3):
                with self.subTest(layout=layout, threads=threads), intra_op_threads(threads):
                    _native.kernels().threaded_grouped_mm(
                        rows[:m], w, offs, want[:m], False, native
                    )
                    got = torch.full((m, 90), float("nan"), dtype=BF16)
                    _native.kernels().threaded_grouped_mm(x, w, offs, got, False, native, index)
                    self.assertTrue(torch.equal(got, want[:m]))

    @parametrize("native", [True, False])
    def test_wgrad_bits_of_the_gathered_rows(self, native):
        if native and not native_gemm_available():
            self.skipTest("no native bf16 GEMM here")
        offs, index, x, dy, _ = self._case(32)
        self._wgrad_cases(offs, index, x, dy, native)
        # a one-token source: x.t() is [K, 1], whose strides alone do not say its layout
        self._wgrad_cases(offs, index.clamp(max=0), x[:1], dy[:1], native)

    def _wgrad_cases(self, offs, index, x, dy, native):
        # transpose_a: the piece's gathered a copied row-major (ATen's GEMM then reads it;
        # the native GEMM reads a itself): the bits of the same call on the gathered tensors
        xg, dyg = _gather(x, index), _gather(dy, index)
        mod = _native.kernels()
        for a_gathered, dy_gathered in ((True, False), (False, True), (True, True)):
            a = x.t() if a_gathered else xg.t()
            d = dy if dy_gathered else dyg
            for threads, transpose in itertools.product((1, 2, 3), (False, True)):
                with (
                    self.subTest(a=a_gathered, dy=dy_gathered, threads=threads, t=transpose),
                    intra_op_threads(threads),
                ):
                    want = torch.full((5, 40, 24), float("nan"), dtype=BF16)
                    mod.threaded_grouped_mm_wgrad(xg.t(), dyg, offs, want, native)
                    got = torch.full((5, 40, 24), float("nan"), dtype=BF16)
                    a_index = index if a_gathered else None
                    dy_index = index if dy_gathered else None
                    mod.threaded_grouped_mm_wgrad(
                        a, d, offs, got, native, a_index, dy_index, transpose
                    )
                    self.assertTrue(torch.equal(got, want))

    def test_upcast_bits_of_the_gathered_rows(self):
        # upcast pieces (each operand converted to fp32 on its thread) read the rows through
        # the index: the bits of the same call on the gathered tensors, forward and weight
        # gradient, on 1-3 threads
        offs, index, x, dy, g = self._case(34)
        m, mod = index.shape[0], _native.kernels()
        xg, dyg = _gather(x, index), _gather(dy, index)
        w = _few_weight(5, 40, 24, BF16, "col", g)
        for threads in (1, 2, 3):
            with self.subTest(threads=threads), intra_op_threads(threads):
                want, got = (torch.full((m, 24), float("nan")) for _ in range(2))
                mod.threaded_grouped_mm(xg, w, offs, want, False, False, None, False, True)
                mod.threaded_grouped_mm(x, w, offs, got, False, False, index, False, True)
                self.assertTrue(torch.equal(got, want))
                want, got = (torch.full((5, 40, 24), float("nan"), dtype=BF16) for _ in range(2))
                args = (False, None, None, False, False, True)
                mod.threaded_grouped_mm_wgrad(xg.t(), dyg, offs, want, *args)
                mod.threaded_grouped_mm_wgrad(
                    x.t(), dy, offs, got, False, index, index, False, False, True
                )
                self.assertTrue(torch.equal(got, want))

    def test_bad_indices(self):
        mod = _native.kernels()
        offs, index, x, dy, _ = self._case(33)
        m = index.shape[0]
        w = torch.randn(5, 40, 8).to(BF16)
        out = x.new_empty((m, 8))
        cases = [
            (index.int(), r"x_index must be a contiguous int64 tensor of 205 rows"),
            (index[:-1], r"out must be a contiguous \[M, N\] tensor"),  # M: the index's
            (torch.full((m,), 60), r"x_index must hold rows in \[-1, 60\), got 60 at 0"),
            (torch.full((m,), -2), r"x_index must hold rows in \[-1, 60\), got -2 at 0"),
        ]
        for bad, msg in cases:
            with self.subTest(msg=msg), self.assertRaisesRegex(RuntimeError, msg):
                mod.threaded_grouped_mm(x, w, offs, out, False, True, bad)
        dw = torch.empty(5, 40, 24).to(BF16)
        with self.assertRaisesRegex(RuntimeError, r"dy_index must hold rows in \[-1, 60\), got 60"):
            mod.threaded_grouped_mm_wgrad(x.t(), dy, offs, dw, True, index, torch.full((m,), 60))
        with self.assertRaisesRegex(RuntimeError, r"a \[K, M\] and dy \[M, N\] expected"):
            mod.threaded_grouped_mm_wgrad(x.t(), dy, offs, dw, True, index[:-1], index)


class TestNativeGatheredOperandsAMX(TestNativeGatheredOperands):
    """The same with the native GEMM's AMX micro-kernel (skipped where there is none)."""

    def setUp(self):
        super().setUp()
        kernel = micro_kernel(True)
        kernel.__enter__()
        self.addCleanup(kernel.__exit__, None, None, None)


def _stream_bytes():
    """The least power of two of output bytes that the threaded kernel's native GEMM
    streams (past this core's L2; half of it is not streamed)."""
    streams, size = _native.kernels().bf16_mm_streams, 64 << 10
    while not streams(size):
        size *= 2
    return size


@instantiate_parametrized_tests
@needs_bf16_gemm
class TestNativeStreamedOutput(TestCase):
    """With stream_out, the threaded kernel's native GEMM writes an output past the L2
    cache by non-temporal stores (whole 64-byte lines where they start a line; the rest
    by plain stores): the bits of the same GEMMs into small outputs, written by plain stores, in
    every kind (x @ w^T, x @ w, the weight gradient), with an output that starts on a
    line, one that does not (no line streamed), widths that leave partial lines, on 1-2
    threads, by either micro-kernel."""

    @parametrize("amx", [False, True])
    def test_bits_of_unstreamed_pieces(self, amx):
        mod = _native.kernels()
        g = torch.Generator().manual_seed(41)
        groups, k = 3, 96
        for n, shift in ((1024, 0), (1000, 0), (1024, 1)):
            rows = _stream_bytes() // (2 * n * groups) + 37  # all groups' outputs past the L2
            offs = torch.tensor([rows, 2 * rows + 5, 3 * rows - 2], dtype=torch.int32)
            m = int(offs[-1])
            x = torch.randn(m, k, generator=g).to(BF16)
            dy = torch.randn(m, n, generator=g).to(BF16)
            ends = [0, *offs.tolist()]
            for layout, threads in itertools.product(("row", "col"), (1, 2)):
                w = _few_weight(groups, k, n, BF16, layout, g)
                with (
                    self.subTest(n=n, shift=shift, layout=layout, threads=threads),
                    micro_kernel(amx),
                    intra_op_threads(threads),
                ):
                    flat = torch.full((m * n + shift,), float("nan"), dtype=BF16)
                    got = flat[shift:].view(m, n)  # shift: no row starts a cache line
                    self.assertTrue(mod.bf16_mm_streams(got.nbytes))
                    mod.threaded_grouped_mm(x, w, offs, got, False, True, None, True)
                    for e, (r0, r1) in enumerate(itertools.pairwise(ends)):
                        want = torch.full((r1 - r0, n), float("nan"), dtype=BF16)
                        self.assertFalse(mod.bf16_mm_streams(want.nbytes))
                        one = torch.tensor([r1 - r0], dtype=torch.int32)
                        mod.threaded_grouped_mm(
                            x[r0:r1], w[e : e + 1], one, want, False, True, None, True
                        )
                        self.assertTrue(torch.equal(got[r0:r1], want), msg=f"group {e}")
            # the weight gradient: [groups, k, width] outputs past the L2
            width = max(n, -(-_stream_bytes() // (2 * k * groups)) + 7 + n % 32)
            dy = torch.randn(m, width, generator=g).to(BF16)
            with self.subTest(n=n, wgrad=True), micro_kernel(amx):
                got = torch.full((groups, k, dy.shape[1]), float("nan"), dtype=BF16)
                self.assertTrue(mod.bf16_mm_streams(got.nbytes))
                mod.threaded_grouped_mm_wgrad(x.t(), dy, offs, got, True, None, None, False, True)
                for e, (r0, r1) in enumerate(itertools.pairwise(ends)):
                    want = torch.full((1, k, dy.shape[1]), float("nan"), dtype=BF16)
                    self.assertFalse(mod.bf16_mm_streams(want.nbytes))
                    one = torch.tensor([r1 - r0], dtype=torch.int32)
                    mod.threaded_grouped_mm_wgrad(
                        x[r0:r1].t(), dy[r0:r1], one, want, True, None, None, False, True
                    )
                    self.assertTrue(torch.equal(got[e], want[0]), msg=f"group {e}")


if __name__ == "__main__":
    run_tests()
