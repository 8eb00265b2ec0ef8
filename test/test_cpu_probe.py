# Owner(s): ["module: moe"]
"""Tests for torch_moe._ops._cpu_probe, the measured CPU decisions: forcing, caching, the
disk cache, the choice rule, that each probe returns one of its choices, and that every
outcome of every decision (forced) gives the CPU kernels' specified results against the
float64 oracles (naive.py) within bounds derived from the dtype's rounding
(tolerances.py). No timing is asserted.
"""

import contextlib
import json
import os
import platform
import tempfile
import unittest.mock
from collections.abc import Callable, Iterator

import naive
import tolerances
import torch
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from torch_moe._ops import _cpu_probe as P
from torch_moe._ops import _native
from torch_moe._ops import grouped_mm as grouped_mm_module
from torch_moe._ops import grouped_swiglu as grouped_swiglu_module
from torch_moe._ops import router as router_module
from torch_moe._ops.grouped_mm import cpu_compute_dtype, grouped_mm_wgrad, mm_into
from torch_moe._ops.grouped_swiglu import swiglu_reference
from torch_moe.nn.functional import grouped_swiglu
from torch_moe.ops import grouped_mm


def native_gemm_available():
    """Whether the native bf16 GEMM runs here (an AVX-512 build, a CPU with AVX512-BF16)."""
    return _native.available() and _native.kernels().bf16_mm_available()


class TestCpuProbe(TestCase):
    def setUp(self):
        super().setUp()
        self._env = {k: os.environ.pop(k) for k in (P.ENV_FORCE, P.ENV_CACHE) if k in os.environ}
        P.reset()

    def tearDown(self):
        os.environ.pop(P.ENV_FORCE, None)
        os.environ.pop(P.ENV_CACHE, None)
        os.environ.update(self._env)
        P.reset()
        super().tearDown()

    def test_force_kind_and_key(self):
        with P.force(half_gemm="fp32"):
            self.assertEqual(cpu_compute_dtype(torch.bfloat16), torch.float32)
            self.assertEqual(cpu_compute_dtype(torch.float16), torch.float32)
            with P.force({"half_gemm:bf16": "native"}):  # a full key beats a kind, inner wins
                self.assertEqual(cpu_compute_dtype(torch.bfloat16), torch.bfloat16)
                self.assertEqual(cpu_compute_dtype(torch.float16), torch.float32)
            self.assertEqual(cpu_compute_dtype(torch.bfloat16), torch.float32)
        with P.force(half_gemm="native"):
            self.assertEqual(cpu_compute_dtype(torch.float16), torch.float16)
        self.assertEqual(cpu_compute_dtype(torch.float32), torch.float32)  # never probed
        self.assertEqual(P.decisions(), {})  # forced choices are not measured

    def test_env_var(self):
        os.environ[P.ENV_FORCE] = "half_gemm=fp32, layout:bf16:nn:m_small=copy_b"
        P.reset()
        self.assertEqual(cpu_compute_dtype(torch.bfloat16), torch.float32)
        a, b = torch.randn(4, 256), torch.randn(256, 256)
        self.assertEqual(P.layout(torch.bfloat16, a, b), "copy_b")
        with P.force(half_gemm="native"):  # force() beats the environment
            self.assertEqual(cpu_compute_dtype(torch.bfloat16), torch.bfloat16)

    def test_bad_names(self):
        os.environ[P.ENV_FORCE] = "half_gemm"
        P.reset()
        with self.assertRaisesRegex(
            ValueError, r"TORCH_MOE_CPU_PROBE: expected .* got 'half_gemm'"
        ):
            cpu_compute_dtype(torch.bfloat16)
        os.environ[P.ENV_FORCE] = "halfgemm=fp32"
        P.reset()
        with self.assertRaisesRegex(ValueError, r"unknown decision 'halfgemm'; kinds are"):
            cpu_compute_dtype(torch.bfloat16)
        os.environ.pop(P.ENV_FORCE)
        P.reset()
        with self.assertRaisesRegex(ValueError, r"force: unknown decision 'layuot'"):
            with P.force(layuot="as_is"):
                pass
        with self.assertRaisesRegex(
            ValueError, r"force: layout='copy' is not a choice of layout: \('as_is', "
        ):
            with P.force(layout="copy"):
                pass
        with self.assertRaisesRegex(
            ValueError, r"force: wgrad_a='copy_a' is not a choice of wgrad_a: \('as_is', "
        ):
            with P.force(wgrad_a="copy_a"):
                pass
        with self.assertRaisesRegex(ValueError, r"act_chunk='-4' .* a positive int"):
            with P.force(act_chunk=-4):
                pass
        os.environ[P.ENV_FORCE] = "half_gemm:bf16=bf16"
        P.reset()
        with self.assertRaisesRegex(
            ValueError, r"TORCH_MOE_CPU_PROBE: half_gemm:bf16='bf16' is not a choice"
        ):
            cpu_compute_dtype(torch.bfloat16)

    def test_measured_once_then_cached(self):
        calls = []

        def measure():
            calls.append(1)
            return {"as_is": 1.0, "copy_b": 0.5}

        for _ in range(3):
            self.assertEqual(P.decide("layout:test", measure, default="as_is"), "copy_b")
        self.assertEqual(len(calls), 1)
        self.assertRegex(P.decisions()["layout:test"], r"copy_b \(measured: as_is 1000.00 ms")
        with P.force(layout="as_is"):
            self.assertEqual(P.decide("layout:test", measure, default="as_is"), "as_is")
        P.reset()
        P.decide("layout:test", measure, default="as_is")
        self.assertEqual(len(calls), 2)

    def test_threads_and_clock_of_a_probe(self):
        # probes time one thread in its CPU time; few_gemm's (threads=True) the caller's
        # threads in wall time (the native kernel and oneDNN scale differently)
        seen = {}

        def measure(name):
            def run():
                clock = P._clock
                with unittest.mock.patch.object(P.time, "thread_time", return_value=-1.0):
                    seen[name] = (torch.get_num_threads(), clock() != -1.0)
                return {"aten": 1.0, "native": 2.0}

            return run

        with intra_op_threads(2):
            P.decide("few_gemm:test:one", measure("one"), default="aten")
            P.decide("few_gemm:test:all", measure("all"), default="aten", threads=True)
            self.assertEqual(torch.get_num_threads(), 2)
        with intra_op_threads(1):  # one thread: no other thread to count
            P.decide("few_gemm:test:all1", measure("all1"), default="aten", threads=True)
        thread_clock = P._THREAD_CLOCK  # without one (other OSes) every probe is wall time
        self.assertEqual(seen["one"], (1, not thread_clock))
        self.assertEqual(seen["all"], (2, True))
        self.assertEqual(seen["all1"], (1, not thread_clock))
        self.assertFalse(P._wall_clock)  # restored after the probe
        calls = []
        with unittest.mock.patch.object(P, "decide", side_effect=lambda *a, **k: calls.append(k)):
            P.few_gemm(torch.bfloat16, True, 16, 8, lambda: {})
            P.act_kernel(torch.bfloat16, lambda: {})
        self.assertEqual([c.get("threads", False) for c in calls], [True, False])

    def test_memo_until_decisions_change(self):
        calls = []

        def compute():
            calls.append(1)
            return len(calls)

        self.assertEqual([P.memo(("test", 1), compute) for _ in range(3)], [1, 1, 1])
        with P.force(layout="as_is"):  # forcing may change what the answer derives from
            self.assertEqual(P.memo(("test", 1), compute), 2)
            with P.force(layout="copy_a"):  # innermost wins: another state
                self.assertEqual(P.memo(("test", 1), compute), 3)
            self.assertEqual(P.memo(("test", 1), compute), 2)
        self.assertEqual(P.memo(("test", 1), compute), 1)  # the unforced answers again
        with P.force(layout="as_is"):  # the same forced state: its answers again
            self.assertEqual(P.memo(("test", 1), compute), 2)
        with P.force(layout="copy_b"):
            self.assertEqual(P.memo(("test", 1), compute), 4)
        P.reset()
        self.assertEqual(P.memo(("test", 1), compute), 5)
        with P.force(layout="as_is"):  # reset forgot every state's answers
            self.assertEqual(P.memo(("test", 1), compute), 6)
        with unittest.mock.patch.object(P, "_MEMO_MAX", 2):  # bounded: full, it starts over
            P.memo(("test", 2), compute)
            self.assertEqual(P.memo(("test", 3), compute), 8)
            self.assertEqual(len(P._memo), 1)
        with unittest.mock.patch.object(P, "_MEMO_STATES_MAX", 2):  # states bounded too
            for layout in ("as_is", "copy_a", "copy_b"):
                with P.force(layout=layout):
                    P.memo(("test", 1), compute)
            self.assertLessEqual(len(P._memos), 2)

    def test_grouped_mm_choice_follows_forced_decisions(self):
        # the memoized "torch._grouped_mm or the loop" answer for the same operands
        a = torch.randn(64, 32, dtype=torch.bfloat16)
        b = torch.randn(4, 32, 48, dtype=torch.bfloat16)
        ends = [16, 32, 48, 64]
        use = grouped_mm_module._use_torch_grouped_mm
        with P.force(half_gemm="native", few_rows="mm"):
            for choice in ("torch", "loop", "torch"):
                with P.force(grouped_mm=choice):
                    self.assertEqual(use(a, b, ends, False), choice == "torch")
            with P.force(grouped_mm="torch"):  # not where torch._grouped_mm is wrong
                self.assertFalse(use(a[:, :30], b[:, :30], ends, False))  # 60-byte rows

    def test_pick_keeps_default_on_near_ties(self):
        self.assertEqual(P.pick({"as_is": 1.0, "copy_b": 0.95}, "as_is", 0.1), "as_is")
        self.assertEqual(P.pick({"as_is": 1.0, "copy_b": 0.85}, "as_is", 0.1), "copy_b")
        self.assertEqual(
            P.pick({"as_is": 1.0, "copy_a": 0.8, "copy_b": 0.7}, "as_is", 0.1), "copy_b"
        )
        self.assertEqual(P.pick({"fp32": 1.0, "native": 1.0}, "fp32", 0.0), "fp32")
        self.assertEqual(P.pick({"fp32": 1.0, "native": 0.99}, "fp32", 0.0), "native")

    def test_disk_cache(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "probe.json")
            os.environ[P.ENV_CACHE] = path
            P.decide("grouped_mm:test", lambda: {"loop": 1.0, "torch": 0.1}, default="loop")
            with open(path) as f:
                self.assertEqual(json.load(f), {P.machine_key(): {"grouped_mm:test": "torch"}})
            P.reset()

            def fail():
                raise AssertionError("measured although the disk cache has the key")

            self.assertEqual(P.decide("grouped_mm:test", fail, default="loop"), "torch")
            self.assertEqual(P.decisions(), {"grouped_mm:test": "torch (disk)"})
            with open(path, "w") as f:
                f.write("not json")
            P.reset()
            self.assertEqual(
                P.decide("grouped_mm:test", lambda: {"loop": 0.1, "torch": 1.0}, default="loop"),
                "loop",
            )

    def test_disk_cache_key_carries_the_sources(self):
        # a decision cached before the ops or kernels changed is not read back after
        key = P.machine_key()
        self.assertIn(f"|sources {P._sources_digest()}", key)
        P._sources_digest.cache_clear()
        try:
            with unittest.mock.patch.object(P.Path, "read_bytes", lambda self: b"rewritten"):
                self.assertNotEqual(P.machine_key(), key)
        finally:
            P._sources_digest.cache_clear()
        self.assertEqual(P.machine_key(), key)

    def test_wgrad_a_keys_round_up_and_cap(self):
        # rows, output rows k and columns n rounded up to powers of two and capped; one
        # measurement per key, at the key's sizes
        seen = []

        def measure(r, k, n):
            seen.append((r, k, n))
            return {"as_is": 1.0, "transpose": 0.9 if k >= 1024 else 0.97}

        for rows, k, n in [(300, 3584, 1024), (512, 3000, 700), (40, 100, 5000), (9000, 9000, 9)]:
            P.wgrad_a(torch.bfloat16, rows, k, n, measure)
        # the second call has the first one's key: decided once
        self.assertEqual(seen, [(512, 4096, 1024), (64, 128, 2048), (512, 4096, 16)])
        self.assertEqual(
            {k: v.split()[0] for k, v in P.decisions().items()},
            {
                "wgrad_a:bf16:r512:k4096:n1024": "transpose",  # 10% faster: over the margin
                "wgrad_a:bf16:r64:k128:n2048": "as_is",  # 3%: within it
                "wgrad_a:bf16:r512:k4096:n16": "transpose",
            },
        )

    def test_wgrad_a_keyed_by_rows_per_busy_group(self):
        # one busy group of 300 rows among four: the r512 class, not 300 / 4 rows'
        fake = unittest.mock.patch.object(
            grouped_mm_module,
            "_measure_wgrad_a",
            lambda dtype, r, k, n: {"as_is": 1.0, "transpose": 0.5},
        )
        x, dy = (
            torch.randn(300, 24, dtype=torch.bfloat16),
            torch.randn(300, 40, dtype=torch.bfloat16),
        )
        with fake, P.force(half_gemm="native"):
            grouped_mm_wgrad(x, dy, _offs([0, 0, 0, 300]))
        keys = [k for k in P.decisions() if k.startswith("wgrad_a:")]
        self.assertEqual(keys, ["wgrad_a:bf16:r512:k32:n64"])

    def test_cycled_candidates_share_one_cycle(self):
        # every call of any candidate takes the next operand set of one shared cycle, so
        # each finds its operands as long out of use as the others (cycles of their own,
        # in step, handed all but a round's first the operands it had just loaded)
        seen = []
        runs = {name: (lambda s, name=name: seen.append(s)) for name in ("a", "b", "c")}
        candidates = P.cycled([0, 1], runs)
        self.assertEqual(list(candidates), ["a", "b", "c"])
        for _ in range(3):
            for call in candidates.values():
                self.assertIsNone(call())
        self.assertEqual(seen, [0, 1, 0, 1, 0, 1, 0, 1, 0])

    def test_cycled_evicts_the_next_set_untimed(self):
        # with evict, time_candidates calls each candidate's prepare before the call, out
        # of the timed region, on the set that call then takes
        events = []
        runs = {name: (lambda s, name=name: events.append(("run", name, s))) for name in "ab"}
        candidates = P.cycled([0, 1, 2], runs, evict=lambda s: events.append(("evict", s)))
        clock = unittest.mock.patch.object(
            P, "_clock", side_effect=lambda: events.append("t") or 0.0
        )
        with unittest.mock.patch.object(P, "_MAX_ROUNDS", 2), clock:
            P.time_candidates(candidates)
        calls = [e for e in events if e != "t"]
        self.assertEqual(calls[0::2], [("evict", i % 3) for i in range(6)])
        self.assertEqual(calls[1::2], [("run", "ab"[i % 2], i % 3) for i in range(6)])
        timed = events[events.index("t") - 1 :]  # after the warm-ups: evict, t, run, t
        for i in range(0, len(timed), 4):
            self.assertEqual((timed[i][0], timed[i + 1], timed[i + 2][0], timed[i + 3]),
                             ("evict", "t", "run", "t"))  # fmt: skip
        self.assertFalse(hasattr(P.cycled([0], runs)["a"], "prepare"))

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_evict_from_cache_keeps_the_values(self):
        mod = _native.kernels()
        for t in (
            torch.randn(1000, 37),
            torch.randn(64, 64).t(),
            torch.randn(3, 0),
            torch.randn(50)[::3],
        ):
            want = t.clone()
            ran = mod.evict_from_cache(t)
            self.assertEqual(ran, platform.machine() in ("x86_64", "AMD64"))
            self.assertTrue(torch.equal(t, want))

    def test_act_chunk_picks_largest_near_fastest(self):
        times = {"32768": 1.05, "65536": 1.0, "131072": 0.98, "262144": 1.3}
        self.assertEqual(P.act_chunk(torch.bfloat16, lambda: times), 131072)

    def test_grouped_mm_decision_measured_in_a_fresh_process_state(self):
        # a decision measured from scratch (reset above), through the op: its key names
        # the dtype, the layout pair and the shape class, and the result is the product
        x, w = torch.randn(64, 32), torch.randn(2, 32, 48)
        offs = torch.tensor([32, 64], dtype=torch.int32)
        with P.force(threads_mm="aten"):  # (on 2+ threads asked first)
            out = grouped_mm(x, w, offs)
        self.assertEqual(out, torch.cat([x[:32] @ w[0], x[32:] @ w[1]]), atol=1e-5, rtol=1e-5)
        keys = [k for k in P.decisions() if k.startswith("grouped_mm:")]
        self.assertTrue(keys, msg=f"no grouped_mm decision in {P.decisions()}")
        self.assertTrue(all(k.startswith("grouped_mm:fp32:") for k in keys), msg=str(keys))

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_threads_mm_decision_measured_on_two_threads_only(self):
        # measured from scratch through the op on two threads: its key names the dtype,
        # the layout pair, the shape class and the threads, the result is the product;
        # on one thread it is not asked
        x, w = torch.randn(64, 32).bfloat16(), torch.randn(2, 32, 48).bfloat16()
        offs = torch.tensor([32, 64], dtype=torch.int32)
        want = torch.cat([x[:32] @ w[0], x[32:] @ w[1]])
        # (oneDNN's GEMMs: with the native GEMM it is asked on one thread too, below; not
        # the few-rows kernel, which may measure faster at 32 rows and then runs alone; and
        # the operands as given, which an AVX2 CPU's bf16 GEMMs measure slower)
        with P.force(half_gemm="native", gemm_kernel="aten", few_gemm="aten", layout="as_is"):
            with intra_op_threads(1):
                self.assertEqual(grouped_mm(x, w, offs), want, atol=1e-2, rtol=1e-2)
                self.assertFalse([k for k in P.decisions() if k.startswith("threads_mm:")])
            with intra_op_threads(2):
                self.assertEqual(grouped_mm(x, w, offs), want, atol=1e-2, rtol=1e-2)
        keys = [k for k in P.decisions() if k.startswith("threads_mm:")]
        self.assertEqual(keys, ["threads_mm:bf16:nn:m_small:t2"])
        self.assertRegex(P.decisions()[keys[0]], r"^(aten|native) \(measured: aten .* native ")

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_gemm_kernel_takes_the_threaded_kernel_on_one_thread(self):
        # with the native GEMM the threaded kernel is a candidate on one thread, forward
        # and weight gradient: threads_mm measured there under its own key (":gemm"), the
        # product either way; without it, not asked (no row split here: 100 rows)
        x, w = torch.randn(160, 32).bfloat16(), torch.randn(2, 32, 48).bfloat16()
        dy = torch.randn(160, 24).bfloat16()
        offs = _offs([100, 60])
        for kernel in ("native", "aten"):
            P.reset()
            with self.subTest(kernel=kernel), intra_op_threads(1):
                with P.force(half_gemm="native", layout="as_is", gemm_kernel=kernel):
                    out = grouped_mm(x, w, offs)
                    dw = grouped_mm_wgrad(x, dy, offs)
                keys = sorted(k for k in P.decisions() if k.startswith("threads_mm:"))
                if kernel == "native" and native_gemm_available():
                    self.assertEqual(len(keys), 2)
                    self.assertTrue(all(k.endswith(":t1:gemm") for k in keys), keys)
                else:
                    self.assertEqual(keys, [])
                assert_gemm_within(self, out, x, w, offs, kernel)
                assert_gemm_within(self, dw, x, dy, offs, kernel, wgrad=True)

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_upcast_takes_the_threaded_kernel_on_one_thread(self):
        # where half GEMMs upcast, the threaded kernel's upcast pieces are a candidate on
        # one thread too, forward and weight gradient: threads_mm measured there under
        # the one thread's key; forced either way, the products within the fp32 bound
        # (each piece a group's GEMM on one thread: not always the loop's bits, MKL's sums
        # depend on a call's columns); over FEW_ROWS rows per group only
        x, w = torch.randn(160, 32).bfloat16(), torch.randn(2, 32, 48).bfloat16()
        dy = torch.randn(160, 24).bfloat16()
        offs = _offs([100, 60])
        with P.force(half_gemm="fp32", layout="as_is"), intra_op_threads(1):
            grouped_mm(x, w, offs)
            grouped_mm_wgrad(x, dy, offs)
            keys = sorted(k for k in P.decisions() if k.startswith("threads_mm:"))
            self.assertEqual(len(keys), 2, msg=str(P.decisions()))
            self.assertTrue(all(k.startswith("threads_mm:bf16:") for k in keys), keys)
            self.assertTrue(all(k.endswith(":t1") for k in keys), keys)
            for way in ("native", "aten"):
                with self.subTest(way=way), P.force(threads_mm=way):
                    assert_gemm_within(self, grouped_mm(x, w, offs), x, w, offs, way)
                    dw = grouped_mm_wgrad(x, dy, offs)
                    assert_gemm_within(self, dw, x, dy, offs, way, wgrad=True)
            P.reset(env=False)
            few = _offs([P.FEW_ROWS, P.FEW_ROWS])
            grouped_mm(x[: 2 * P.FEW_ROWS], w, few)  # (the few-rows ways: not asked)
            self.assertFalse([k for k in P.decisions() if k.startswith("threads_mm:")])

    def test_gemm_kernel_near_ties_go_native(self):
        # oneDNN's GEMM only where it measures over 5% faster: a near-tie (which the probe
        # ranks either way from one measurement to the next) takes the native GEMM, which
        # ran such GEMMs faster inside the layer
        for aten, want in ((0.97, "native"), (1.0, "native"), (0.96, "native"), (0.94, "aten")):
            P.reset(env=False)
            times = {"aten": aten, "native": 1.0}
            got = P.gemm_kernel(torch.bfloat16, "nn", 384, 768, 1024, lambda *_, t=times: t)
            self.assertEqual(got, want, msg=str(aten))
        P.reset(env=False)

    @unittest.skipUnless(native_gemm_available(), "no native bf16 GEMM here")
    def test_gemm_kernel_only_where_the_isa_allows(self):
        # an ISA cap below AVX512-BF16 (another machine class on this one) keeps oneDNN's
        # GEMMs whatever the decision says
        x, w, ends = torch.randn(100, 32).bfloat16(), torch.randn(2, 32, 48).bfloat16(), [60, 100]
        with P.force(half_gemm="native", gemm_kernel="native"):
            self.assertTrue(grouped_mm_module.native_gemm_ready(torch.bfloat16))
            self.assertTrue(grouped_mm_module.native_gemm_for(x, w, ends, False))
            for cap in ("AVX512_CORE", "AVX2"):
                with self.subTest(cap=cap):
                    with unittest.mock.patch.dict(os.environ, {"ONEDNN_MAX_CPU_ISA": cap}):
                        P.reset(env=False)
                        self.assertFalse(grouped_mm_module.native_gemm_ready(torch.bfloat16))
                        self.assertFalse(grouped_mm_module.native_gemm_for(x, w, ends, False))
        P.reset(env=False)

    @unittest.skipUnless(native_gemm_available(), "no native bf16 GEMM here")
    def test_gemm_kernel_amx_only_where_the_isa_allows(self):
        # the native GEMM multiplies by AMX tiles where the ISA is AMX, and by AVX512-BF16
        # dot products under an AVX512-BF16 cap (the other machine class on this one)
        mod = _native.kernels()
        before = mod.bf16_mm_amx()
        try:
            for isa in ("AMX", "AVX512-BF16"):
                with (
                    self.subTest(isa=isa),
                    unittest.mock.patch.object(P, "cpu_isa", return_value=isa),
                    P.force(half_gemm="native", gemm_kernel="native"),
                ):
                    P.reset(env=False)
                    self.assertTrue(grouped_mm_module.native_gemm_ready(torch.bfloat16))
                    usable = mod.bf16_mm_use_amx(True)
                    P.reset(env=False)
                    grouped_mm_module.native_gemm_ready(torch.bfloat16)
                    self.assertEqual(mod.bf16_mm_amx(), isa == "AMX" and usable)
        finally:
            mod.bf16_mm_use_amx(before)
            P.reset(env=False)

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_gemm_kernel_decision_measured(self):
        # measured per kind and size class (rows per busy group, K, N, each rounded up to a
        # power of two or 1.5 times one, up to GEMM_MAX), for bf16 only, where the kernel
        # runs here; fp16 and fp32 never ask; groups of 50 and 60 rows share the class
        # r64, 100 rows do not (r128), 40 rows neither (r48)
        x, dy = torch.randn(200, 32).bfloat16(), torch.randn(200, 40).bfloat16()
        w = torch.randn(2, 32, 48).bfloat16()
        w_t = torch.randn(2, 48, 32).bfloat16().transpose(-2, -1)
        calls = [
            ("nn", (x, w, [50, 100], False)),
            ("nn", (x, w, [60, 120], False)),
            ("bt", (x, w_t, [50, 100], False)),
            ("tn", (x.t(), dy, [50, 100], True)),
            ("nn r128", (x, w, [100, 200], False)),
            ("nn r48", (x, w, [40, 80], False)),
            ("big", (x, w, [5000, 10000], False)),
        ]
        got = {name: grouped_mm_module.native_gemm_for(*args) for name, args in calls}
        for dt in (torch.float16, torch.float32):
            a, b = x.to(dt), w.to(dt)
            self.assertFalse(grouped_mm_module.native_gemm_for(a, b, [50, 100], False))
        keys = sorted(k for k in P.decisions() if k.startswith("gemm_kernel:"))
        if not native_gemm_available():
            self.assertEqual((set(got.values()), keys), ({False}, []))
            return
        want = {
            "nn": "gemm_kernel:bf16:nn:r64:k32:n48",
            "bt": "gemm_kernel:bf16:bt:r64:k32:n48",
            "tn": "gemm_kernel:bf16:tn:r64:k32:n48",
            "nn r128": "gemm_kernel:bf16:nn:r128:k32:n48",
            "nn r48": "gemm_kernel:bf16:nn:r48:k32:n48",
            "big": "gemm_kernel:bf16:nn:r512:k32:n48",  # rows capped
        }
        self.assertEqual(keys, sorted(want.values()))
        for name, key in want.items():
            self.assertRegex(P.decisions()[key], r"^(aten|native) \(measured: aten .* native ")
            self.assertEqual(got[name], P.decisions()[key].startswith("native"), msg=name)

    @unittest.skipUnless(native_gemm_available(), "no native bf16 GEMM here")
    def test_gemm_kernel_per_kind(self):
        # one kind forced native, the others oneDNN's: only that kind's GEMM runs by the
        # threaded kernel with the native GEMM (its one-thread gain; the others take
        # torch's way on one thread), the product either way
        x, w = torch.randn(100, 32).bfloat16(), torch.randn(2, 32, 48).bfloat16()
        w_t = w.transpose(-2, -1).contiguous().transpose(-2, -1)
        dy, offs = torch.randn(100, 24).bfloat16(), _offs([60, 40])
        real = grouped_mm_module._threaded_kernels()
        calls = []

        class Recording:  # the threaded kernels' calls, with their native_gemm flag
            def __getattr__(self, name):
                fn = getattr(real, name)
                flag = {"threaded_grouped_mm": 5, "threaded_grouped_mm_wgrad": 4}.get(name)
                if flag is None:
                    return fn

                def call(*args):
                    calls.append((name, args[flag]))
                    return fn(*args)

                return call

        fwd, wgrad = "threaded_grouped_mm", "threaded_grouped_mm_wgrad"
        want = {"nn": [(fwd, True)], "bt": [(fwd, True)], "tn": [(wgrad, True)]}
        for kind in ("nn", "bt", "tn"):
            forced = {"half_gemm": "native", "layout": "as_is", "threads_mm": "native"}
            forced.update(wgrad_a="as_is", row_split="one", gemm_kernel="aten", out_stream="cache")
            forced[f"gemm_kernel:bf16:{kind}:r64:k32:n{24 if kind == 'tn' else 48}"] = "native"
            calls.clear()
            with (
                self.subTest(kind=kind),
                intra_op_threads(1),
                P.force(forced),
                unittest.mock.patch.object(grouped_mm_module, "_threaded_kernels", Recording),
            ):
                out = grouped_mm(x, w, offs)
                out_t = grouped_mm(x, w_t, offs)
                dw = grouped_mm_wgrad(x, dy, offs)
            self.assertEqual(calls, want[kind])
            assert_gemm_within(self, out, x, w, offs, kind)
            assert_gemm_within(self, out_t, x, w_t, offs, kind)
            assert_gemm_within(self, dw, x, dy, offs, kind, wgrad=True)

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_out_stream_decision(self):
        # measured once per half dtype where the native bf16 GEMM runs (else plain stores,
        # nothing measured); fp32 never asks; forced either way, the threaded kernel's
        # native GEMM gets the flag (and the product is the same)
        got = grouped_mm_module.streams_outputs(torch.bfloat16)
        self.assertFalse(grouped_mm_module.streams_outputs(torch.float32))
        keys = [k for k in P.decisions() if k.startswith("out_stream:")]
        if not native_gemm_available():
            self.assertEqual((got, keys), (False, []))
            return
        self.assertEqual(keys, ["out_stream:bf16"])
        self.assertRegex(P.decisions()[keys[0]], r"^(cache|stream) \(measured: cache .* stream ")
        self.assertEqual(got, P.decisions()[keys[0]].startswith("stream"))
        real = grouped_mm_module._threaded_kernels()
        flags = []

        class Recording:  # threaded_grouped_mm's stream_out flag
            def __getattr__(self, name):
                fn = getattr(real, name)
                if name != "threaded_grouped_mm":
                    return fn

                def call(*args):
                    flags.append(args[7])
                    return fn(*args)

                return call

        x, w, offs = (
            torch.randn(100, 32).bfloat16(),
            torch.randn(2, 32, 48).bfloat16(),
            _offs([60, 40]),
        )
        outs = []
        for choice in ("cache", "stream"):
            forced = dict(half_gemm="native", layout="as_is", gemm_kernel="native")
            forced.update(threads_mm="native", row_split="one")  # (nothing measured)
            flags.clear()
            with (
                self.subTest(choice=choice),
                intra_op_threads(1),
                P.force(**forced, out_stream=choice),
                unittest.mock.patch.object(grouped_mm_module, "_threaded_kernels", Recording),
            ):
                outs.append(grouped_mm(x, w, offs))
                self.assertEqual(flags, [choice == "stream"])
        self.assertTrue(torch.equal(*outs))

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_router_kernel_decision(self):
        # measured per class of tokens (capped at 256) and experts where the AMX tiles run
        # (else the row kernels, nothing measured); never for fp16 / fp32; forced either
        # way, the kernels get the flag in both directions
        x, w = torch.randn(300, 64).bfloat16(), torch.randn(20, 64).bfloat16()
        got = router_module._tiles(x, w)
        self.assertFalse(router_module._tiles(x.half(), w.half()))
        self.assertFalse(router_module._tiles(x.float(), w.float()))
        keys = [k for k in P.decisions() if k.startswith("router_kernel:")]
        if not grouped_mm_module.amx_tiles(torch.bfloat16):
            self.assertEqual((got, keys), (False, []))
            return
        self.assertEqual(keys, ["router_kernel:bf16:r256:e32"])
        self.assertRegex(P.decisions()[keys[0]], r"^(native|amx) \(measured: native .* amx ")
        self.assertEqual(got, P.decisions()[keys[0]].startswith("amx"))
        self.assertEqual(router_module._tiles(x[:5], w[:3]), router_module._tiles(x[:8], w[:4]))
        real = router_module._native.kernels()
        flags = []

        class Recording:  # the last argument: the tiles
            def __getattr__(self, name):
                fn = getattr(real, name)
                if not name.startswith("router_logits"):
                    return fn

                def call(*args):
                    flags.append((name, args[-1]))
                    return fn(*args)

                return call

        outs = []
        for choice in ("native", "amx"):
            flags.clear()
            with (
                self.subTest(choice=choice),
                P.force(router_kernel=choice),
                unittest.mock.patch.object(router_module._native, "kernels", Recording),
            ):
                xg = x.detach().requires_grad_()
                out = router_module.router_logits(xg, w)
                out.backward(torch.ones_like(out))
                outs.append((out.detach(), xg.grad))
                tiles = choice == "amx"
                want = [("router_logits", tiles), ("router_logits_backward", tiles)]
                self.assertEqual(flags, want)
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_row_split_takes_the_threaded_kernel_on_one_thread(self):
        # on one thread the threaded kernel runs a forward only for its row split: where
        # row_split splits and a group's rows would be split (481 = 13 x 37: oneDNN's
        # blocks of 37 rows; 480 and 100 are not), then as threads_mm measured it on one
        # thread; the product either way, the split's bits as the other way's
        x, w = torch.randn(600, 32).bfloat16(), torch.randn(3, 32, 48).bfloat16()
        spy = unittest.mock.patch.object(
            grouped_mm_module, "_threaded_mm", wraps=grouped_mm_module._threaded_mm
        )
        outs = {}
        for split in ("split", "one"):
            for sizes in ([481, 0, 100], [480, 0, 100]):
                P.reset()
                offs = _offs(sizes)
                n = int(offs[-1])
                with self.subTest(split=split, sizes=sizes), intra_op_threads(1), spy as threaded:
                    # (oneDNN's GEMMs: the native GEMM has a one-thread gain of its own)
                    with P.force(
                        half_gemm="native", layout="as_is", row_split=split, gemm_kernel="aten"
                    ):
                        outs[split, sizes[0]] = grouped_mm(x[:n], w, offs)
                    want = split == "split" and sizes[0] == 481
                    keys = [k for k in P.decisions() if k.startswith("threads_mm:")]
                    self.assertEqual(keys, ["threads_mm:bf16:nn:k_small:t1"] if want else [])
                    self.assertEqual(
                        threaded.called, want and P.decisions()[keys[0]].startswith("native")
                    )
                    assert_gemm_within(self, outs[split, sizes[0]], x[:n], w, offs, f"{split}")
        self.assertTrue(torch.equal(outs["split", 481], outs["one", 481]))

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_upcast_pieces_take_the_swiglu_whole_path(self):
        # where half GEMMs upcast: the whole-tensor path on any number of threads where the
        # threads_mm decision keeps the threaded kernel (its upcast pieces) at the rows'
        # class, over FEW_ROWS rows and two busy groups; the loop otherwise. Asked about
        # other threads than the caller's (the memory model), the decision as forced or
        # made, else its default, nothing timed
        whole = grouped_swiglu_module._whole_path
        layout = grouped_swiglu_module.MOE_BACKWARD
        bf16 = torch.bfloat16
        with P.force(half_gemm="fp32", threads_mm="native"):
            for threads in (1, 2):
                with intra_op_threads(threads):
                    self.assertTrue(whole(bf16, 8, 200, layout))
                    self.assertFalse(whole(bf16, 1, 200, layout))  # one busy group
                    self.assertTrue(whole(bf16, 8, 200, layout, threads=3 - threads))
        for threads in (1, 2):
            with P.force(half_gemm="fp32", threads_mm="aten"), intra_op_threads(threads):
                self.assertFalse(whole(bf16, 8, 200, layout))
        # each thread count its own decision (its key names the threads)
        cls = P.shape_class(200, 201, 201)
        t1, t2 = (P.threads_mm_key(bf16, "nt", cls, t) for t in (1, 2))
        with P.force({t1: "aten", t2: "native"}, half_gemm="fp32"):
            with intra_op_threads(1):
                self.assertFalse(whole(bf16, 8, 200, layout))
                self.assertTrue(whole(bf16, 8, 200, layout, threads=2))
            with intra_op_threads(2):
                self.assertTrue(whole(bf16, 8, 200, layout))
                self.assertFalse(whole(bf16, 8, 200, layout, threads=1))
        with P.force(half_gemm="fp32", few_gemm="aten"), intra_op_threads(2):
            self.assertFalse(whole(bf16, 8, P.FEW_ROWS, layout))  # the few-rows ways
        P.reset()
        with P.force(half_gemm="fp32"), intra_op_threads(1):
            self.assertTrue(whole(bf16, 8, 200, layout, threads=3))  # the default, untimed
        self.assertEqual([k for k in P.decisions() if k.startswith("threads_mm:")], [])

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_row_split_decision_measured(self):
        # measured from scratch, once per dtype, on one thread: the key names the dtype;
        # only where the dtype is multiplied as such (an upcast runs MKL's fp32 GEMMs)
        with P.force(half_gemm="fp32"):
            self.assertFalse(grouped_mm_module._row_split_on(torch.bfloat16))
        self.assertEqual([k for k in P.decisions() if k.startswith("row_split:")], [])
        with intra_op_threads(2), P.force(half_gemm="native"):
            self.assertIn(grouped_mm_module._row_split_on(torch.bfloat16), (True, False))
        self.assertFalse(grouped_mm_module._row_split_on(torch.float32))  # not the kernel's
        got = P.decisions()
        self.assertEqual([k for k in got if k.startswith("row_split:")], ["row_split:bf16"])
        self.assertRegex(got["row_split:bf16"], r"^(one|split) \(measured: one .* split ")

    def test_probes_return_a_choice(self):
        # the real probes on this machine (no timing asserted): what they return is valid
        self.assertIn(P.half_gemm(torch.bfloat16), ("native", "fp32"))
        a, b = torch.randn(32, 256), torch.randn(256, 256)
        self.assertIn(P.layout(torch.float32, a, b), ("as_is", "copy_a", "copy_b"))
        self.assertEqual(P.layout(torch.float32, a, b.t().contiguous().t()), "as_is")  # NT
        decided = P.decisions()
        self.assertIn("half_gemm:bf16", decided)
        self.assertIn("layout:fp32:nn:m_small", decided)
        self.assertTrue(all("measured" in how for how in decided.values()))

    def test_probe_restores_threads_and_dispatch_modes(self):
        from torch.utils.flop_counter import FlopCounterMode

        threads = torch.get_num_threads()
        a, b = torch.randn(200, 256), torch.randn(256, 256)
        with FlopCounterMode(display=False) as counter:
            P.layout(torch.float32, a, b)  # runs the probe: its GEMMs are not counted
            torch.mm(a, b)
        self.assertEqual(counter.get_total_flops(), 2 * 200 * 256 * 256)
        self.assertEqual(torch.get_num_threads(), threads)

    @parametrize(
        "shape, cls",
        [((64, 512, 512), "m_small"), ((512, 64, 512), "k_small"), ((512, 512, 200), "n_large")],
    )
    def test_shape_class(self, shape, cls):
        self.assertEqual(P.shape_class(*shape), cls)

    def test_layout_of(self):
        a = torch.randn(8, 16)
        self.assertEqual(P.layout_of(a, torch.randn(16, 4)), "nn")
        self.assertEqual(P.layout_of(a.t(), torch.randn(4, 8).t()), "tt")
        self.assertEqual(P.layout_of(a, torch.randn(4, 16).t()), "nt")

    def test_cpu_isa(self):
        self.assertIn(P.cpu_isa(), ("AMX", "AVX512-BF16", "AVX512", "AVX2", "other"))
        with unittest.mock.patch.object(P, "_cpuinfo", return_value=("x", {"avx2", "fma"})):
            self.assertEqual(P.cpu_isa(), "AVX2")
        with unittest.mock.patch.object(
            P, "_cpuinfo", return_value=("x", {"avx2", "avx512f", "avx512_bf16"})
        ):
            self.assertEqual(P.cpu_isa(), "AVX512-BF16")

    def test_cpuinfo(self):
        # the first processor's model name and flags; without /proc/cpuinfo, platform's
        # strings and no flags (where platform.processor() is empty, as on Linux)
        text = (
            "processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: fpu avx2 avx512f\n\n"
            "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n"
        )
        with unittest.mock.patch("builtins.open", unittest.mock.mock_open(read_data=text)):
            self.assertEqual(P._cpuinfo(), ("Some CPU 9000", {"fpu", "avx2", "avx512f"}))
        with (
            unittest.mock.patch("builtins.open", side_effect=OSError("no /proc")),
            unittest.mock.patch.object(P.platform, "processor", return_value=""),
            unittest.mock.patch.object(P.platform, "machine", return_value="x86_64"),
        ):
            self.assertEqual(P._cpuinfo(), ("x86_64", set()))

    def test_isa_cap(self):
        """ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) caps the reported ISA, never raises it,
        and separates the decisions' disk-cache key."""
        wide = ("x", {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
        narrow = ("x", {"avx2", "fma"})
        env = {name: "" for name in P.ISA_CAP_ENV}
        cases = [
            (wide, "AVX2", "AVX2"),
            (wide, "avx512_core", "AVX512"),
            (wide, "AVX512_CORE_BF16", "AVX512-BF16"),
            (wide, "AVX512_CORE_AMX", "AMX"),
            (wide, "ALL", "AMX"),
            (wide, "SSE41", "other"),
            (narrow, "AVX512_CORE_AMX", "AVX2"),  # a cap does not widen the CPU
        ]
        for cpuinfo, cap, isa in cases:
            with (
                self.subTest(cap=cap),
                unittest.mock.patch.object(P, "_cpuinfo", return_value=cpuinfo),
                unittest.mock.patch.dict(os.environ, {**env, "ONEDNN_MAX_CPU_ISA": cap}),
            ):
                self.assertEqual(P.cpu_isa(), isa)
        with (
            unittest.mock.patch.object(P, "_cpuinfo", return_value=wide),
            unittest.mock.patch.dict(os.environ, env),
        ):
            self.assertIsNone(P.isa_cap())
            uncapped = P.machine_key()
            with unittest.mock.patch.dict(os.environ, {"DNNL_MAX_CPU_ISA": "AVX2"}):
                self.assertEqual(P.isa_cap(), ("DNNL_MAX_CPU_ISA", "AVX2"))
                self.assertNotEqual(P.machine_key(), uncapped)


@contextlib.contextmanager
def intra_op_threads(n):
    """torch's intra-op threads set to ``n`` inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def assert_gemm_within(test, got, a, b, offs, msg, wgrad=False):
    """``got`` within the rounding bound (tolerances.gemm_bound) of the grouped GEMM
    ``a[g] @ b[g]`` (``wgrad``: ``a[g]^T @ b[g]``) in ``got``'s dtype, fp32 accumulation."""
    ref = naive.grouped_mm_wgrad64 if wgrad else naive.grouped_mm64
    exact = ref(a.detach(), b.detach(), offs)
    products = ref(a.detach().abs(), b.detach().abs(), offs)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    n = int(sizes.max()) if wgrad else a.shape[1]
    bound = tolerances.gemm_bound(products, max(n, 1), exact, torch.float32, got.dtype)
    tolerances.assert_within(test, got, exact, bound, msg)


def _offs(sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def _whole_path_spies():
    """Spies on grouped_swiglu's whole-tensor forward and backward (which path ran)."""
    return [
        unittest.mock.patch.object(
            grouped_swiglu_module, f, wraps=getattr(grouped_swiglu_module, f)
        )
        for f in ("_forward_whole", "_backward_whole")
    ]


@contextlib.contextmanager
def _wgrad_copy_spies() -> Iterator[Callable[[], tuple[int, int]]]:
    """Counts the weight gradients' operand copies: (whole copies ``transposed_copy``,
    calls of the threaded kernel that copies ``x^T`` piece by piece, its rows read
    gathered or not)."""
    whole = unittest.mock.patch.object(
        grouped_mm_module, "transposed_copy", wraps=grouped_mm_module.transposed_copy
    )
    kernel = unittest.mock.patch.object(
        grouped_mm_module,
        "_whole_grouped_mm_wgrad",
        wraps=grouped_mm_module._whole_grouped_mm_wgrad,
    )
    gathered = unittest.mock.patch.object(
        grouped_swiglu_module,
        "gathered_grouped_mm_wgrad",
        wraps=grouped_swiglu_module.gathered_grouped_mm_wgrad,
    )
    with whole as copies, kernel as wgrads, gathered as reads:
        yield lambda: (
            copies.call_count,
            sum(c.args[-1] == "transpose" for c in wgrads.call_args_list)
            + sum(c.args[5] == "transpose" for c in reads.call_args_list),
        )


class TestForcedDecisions(TestCase):
    """Both (all) outcomes of every decision, forced, against the float64 oracles: the
    kernels' results are specified, whichever path this machine measures faster."""

    def setUp(self):
        super().setUp()
        torch.manual_seed(0)
        # the per-group kernels below; the threaded ones (2+ threads) by their own test
        self.enterContext(P.force(threads_mm="aten"))

    @parametrize("dtype", [torch.bfloat16, torch.float32])
    @parametrize("half_gemm", ["native", "fp32"])
    # every layout and every few-rows way once (groups of more and of fewer rows than
    # FEW_ROWS take one and the other)
    @parametrize("paths", [("as_is", "mm"), ("copy_a", "mv"), ("copy_b", "swap")])
    @parametrize("kernel", ["loop", "torch"])
    @parametrize("kn", [(32, 48), (7, 13)])
    def test_grouped_mm(self, dtype, half_gemm, paths, kernel, kn):
        (layout, few_rows), (k, n) = paths, kn
        offs = _offs([20, 0, 17, 3])  # groups over and under FEW_ROWS rows
        m = 43  # 3 rows past the last group
        x = torch.randn(m, k, dtype=dtype, requires_grad=True)
        w_leaf = torch.randn(4, n, k, dtype=dtype, requires_grad=True)
        w = w_leaf.transpose(-2, -1)  # backward: dX row-major x row-major, dW col x row
        grad = torch.randn(m, n, dtype=dtype)
        spy = unittest.mock.patch.object(torch, "_grouped_mm", wraps=torch._grouped_mm)
        # (few_gemm forced too: measured inside the spy, its probe calls torch._grouped_mm)
        forced = dict(
            half_gemm=half_gemm,
            layout=layout,
            few_rows=few_rows,
            grouped_mm=kernel,
            few_gemm="aten",
        )
        with P.force(**forced), spy as gmm:
            out = grouped_mm(x, w, offs)
            out.backward(grad)
        # torch._grouped_mm runs where forced and allowed: K and N 16-byte aligned, the
        # dtype multiplied natively (fp32 always is)
        native = dtype == torch.float32 or half_gemm == "native"
        self.assertEqual(gmm.called, kernel == "torch" and k == 32 and native)
        assert_gemm_within(self, out, x, w, offs, "forward")
        assert_gemm_within(self, x.grad, grad, w.detach().transpose(-2, -1), offs, "dX")
        dw = w_leaf.grad.transpose(-2, -1)
        assert_gemm_within(self, dw, x, grad, offs, "dW", wgrad=True)
        self.assertTrue((out[40:] == 0).all())
        self.assertTrue((x.grad[40:] == 0).all())  # torch._grouped_mm leaves these unset
        self.assertTrue((w_leaf.grad[1] == 0).all())  # the empty group

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    @parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    @parametrize("half_gemm", ["native", "fp32"])
    @parametrize("layout", ["as_is", "copy_b"])
    @parametrize("col_major", [False, True])
    def test_grouped_mm_threaded(self, dtype, half_gemm, layout, col_major):
        # forced on two threads: forward, dX and dW by the threaded kernels where they
        # compute what the loop does (the dtype multiplied as it is, the operands in their
        # own layouts, forward over FEW_ROWS rows per busy group), within the GEMM bound
        offs = _offs([37, 0, 61, 18, 90])  # 4 busy groups of 52 rows on average
        m = 210  # 4 rows past the last group
        x = torch.randn(m, 24, dtype=dtype, requires_grad=True)
        shape = (5, 40, 24) if col_major else (5, 24, 40)
        w_leaf = torch.randn(*shape, dtype=dtype, requires_grad=True)
        w = w_leaf.transpose(-2, -1) if col_major else w_leaf
        grad = torch.randn(m, 40, dtype=dtype)
        spies = [
            unittest.mock.patch.object(grouped_mm_module, f, wraps=getattr(grouped_mm_module, f))
            for f in ("_threaded_mm", "_threaded_wgrad")
        ]
        forced = dict(half_gemm=half_gemm, threads_mm="native", layout=layout, wgrad_a="as_is")
        with intra_op_threads(2), P.force(**forced), spies[0] as fwd, spies[1] as wgrad:
            out = grouped_mm(x, w, offs)
            out.backward(grad)
        # forward and dX: one row-major x column-major (never copied), the other
        # row-major x row-major; dW column-major x row-major. Half dtypes only: multiplied
        # as such, or upcast (half_gemm=fp32) piece by piece on the threads
        native = dtype != torch.float32
        self.assertEqual(fwd.call_count, (2 if layout == "as_is" else 1) if native else 0)
        self.assertEqual(wgrad.call_count, 1 if native and layout == "as_is" else 0)
        assert_gemm_within(self, out, x, w, offs, "forward")
        assert_gemm_within(self, x.grad, grad, w.detach().transpose(-2, -1), offs, "dX")
        dw = w_leaf.grad.transpose(-2, -1) if col_major else w_leaf.grad
        assert_gemm_within(self, dw, x, grad, offs, "dW", wgrad=True)
        self.assertTrue((out[206:] == 0).all())
        self.assertTrue((x.grad[206:] == 0).all())
        self.assertTrue((w_leaf.grad[1] == 0).all())  # the empty group

    @parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    @parametrize("half_gemm", ["native", "fp32"])
    @parametrize("wgrad_a", ["as_is", "transpose"])
    @parametrize("kernel", ["loop", "torch"])
    @parametrize("kn", [(32, 48), (7, 13)])
    @parametrize("built", [True, False])  # the native (threaded) kernels
    def test_grouped_mm_wgrad_a(self, dtype, half_gemm, wgrad_a, kernel, kn, built):
        k, n = kn
        offs = _offs([20, 0, 17, 3])
        m = 43  # 3 rows past the last group: in the copy, in no group
        x = torch.randn(m, k, dtype=dtype)
        dy = torch.randn(m, n, dtype=dtype)
        forced = dict(half_gemm=half_gemm, wgrad_a=wgrad_a, grouped_mm=kernel, layout="as_is")
        kernels = grouped_mm_module._threaded_kernels() if built else None
        if built and kernels is None:
            self.skipTest("the native kernels are not built here")
        none = unittest.mock.patch.object(grouped_mm_module, "_threaded_kernels", lambda: kernels)
        with P.force(**forced), none, _wgrad_copy_spies() as copies:
            dw = grouped_mm_wgrad(x, dy, offs)
        # the copy runs where forced and the GEMMs run in the half dtype itself: piece by
        # piece by the threaded kernel where it is built, else whole
        native = dtype != torch.float32 and half_gemm == "native"
        copied = wgrad_a == "transpose" and native
        self.assertEqual(copies(), (int(copied and not built), int(copied and built)))
        assert_gemm_within(self, dw, x, dy, offs, "dW", wgrad=True)
        self.assertTrue((dw[1] == 0).all())  # the empty group
        if copied:  # the same bits either way
            want = grouped_mm_module._wgrad_loop(
                grouped_mm_module.transposed_copy(x), dy, [20, 20, 37, 40]
            )
            self.assertEqual(dw, want, atol=0, rtol=0)

    def test_wgrad_a_of_a_column_major_x(self):
        # x column-major (its x^T row-major, no view the threaded kernel copies from): the
        # whole copy where forced, within the bound
        offs = _offs([20, 0, 17, 3])
        x = torch.randn(12, 43).to(torch.bfloat16).t()
        dy = torch.randn(43, 40).to(torch.bfloat16)
        forced = dict(half_gemm="native", wgrad_a="transpose", layout="as_is")
        with P.force(**forced), _wgrad_copy_spies() as copies:
            dw = grouped_mm_wgrad(x, dy, offs)
        self.assertEqual(copies(), (1, 0))
        assert_gemm_within(self, dw, x, dy, offs, "dW", wgrad=True)

    @parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    @parametrize("shape", [(0, 5), (1, 1), (7, 13), (130, 67), (64, 256)])
    @parametrize("strided", [False, True])
    def test_transposed_copy(self, dtype, shape, strided):
        # x^T bit for bit, row-major with its leading dim padded to 64 bytes, not a
        # multiple of 1 KiB (rows an L1 set apart)
        src = torch.randn(shape[0], 2 * shape[1]).to(dtype)
        x = src[:, ::2] if strided else src[:, : shape[1]].contiguous()
        got = grouped_mm_module.transposed_copy(x)
        self.assertEqual(got.shape, (shape[1], shape[0]))
        if got.numel():
            self.assertEqual(got.stride(1), 1)
            self.assertEqual(got.stride(0) * got.element_size() % 64, 0)
            self.assertNotEqual(got.stride(0) * got.element_size() % 1024, 0)
            self.assertGreaterEqual(got.stride(0), shape[0])
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        self.assertEqual(got.view(bits), x.t().contiguous().view(bits))
        if got.numel():  # the padding past the last column is zero (GEMMs may read it)
            padded = got.as_strided((shape[1], got.stride(0)), got.stride())
            self.assertTrue((padded[:, shape[0] :] == 0).all())

    def test_wgrad_of_the_transposed_copy_reads_finite_padding(self):
        # the weight gradient through the copy with an odd last group: the GEMM may read
        # the element past each row's last column (AMX bf16 k pairs); NaN garbage in the
        # padding must not reach the gradient (it did, flakily, on an AMX Xeon)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(38, 32, generator=g).to(torch.bfloat16)
        dy = torch.randn(38, 32, generator=g).to(torch.bfloat16)
        offs = torch.tensor([14, 17, 23, 28, 33, 38], dtype=torch.int32)
        nan_pool = [torch.full((32, 40), float("nan"), dtype=torch.bfloat16) for _ in range(4)]
        del nan_pool  # freed NaN blocks the copy's allocation may reuse
        with P.force(half_gemm="native", wgrad_a="transpose"), intra_op_threads(2):
            a = grouped_mm_module.transposed_copy(x)
            dw = torch._grouped_mm(a, dy, offs=offs)
        self.assertFalse(dw.isnan().any())
        assert_gemm_within(self, dw, x, dy, offs, "dW", wgrad=True)

    @parametrize("few_rows", ["mm", "mv", "swap"])
    @parametrize("kernel", ["torch", "loop"])
    def test_grouped_mm_few_rows_per_group(self, few_rows, kernel):
        # decode: a row or two per expert. torch._grouped_mm runs one GEMM per group, the
        # loop applies the few-rows decision's way; which of them runs is the grouped_mm
        # decision of the rows' own class (r2 here), measured with the ways in the loop
        offs = _offs([1, 0, 2, 1])
        x = torch.randn(5, 32, dtype=torch.bfloat16)  # a row past the last group
        w = torch.randn(4, 48, 32, dtype=torch.bfloat16).transpose(-2, -1)  # x @ w^T
        gmm = unittest.mock.patch.object(torch, "_grouped_mm", wraps=torch._grouped_mm)
        few = unittest.mock.patch.object(P, "few_rows_mm", wraps=P.few_rows_mm)
        forced = {"half_gemm": "native", "few_rows": few_rows, "few_gemm": "aten"}
        forced["grouped_mm:bf16:nt:r2"] = kernel
        with P.force(forced), gmm as fused, few as way:
            out = grouped_mm(x, w, offs)
        looped = kernel == "loop"
        self.assertEqual((fused.called, way.called), (not looped, looped and few_rows != "mm"))
        assert_gemm_within(self, out, x, w, offs, "forward")
        self.assertTrue((out[4:] == 0).all())

    @parametrize("dtype", [torch.bfloat16, torch.float16])
    @parametrize("col_major", [False, True])
    @parametrize("few_gemm", ["aten", "native", "amx"])
    def test_grouped_mm_few_gemm(self, dtype, col_major, few_gemm):
        # a few rows per group: the native few-rows kernel where forced (and built; amx:
        # its AMX form, which runs as the other where the CPU has no tiles or the weight
        # is row-major), else ATen's; all within the GEMM rounding bound, the rows past
        # the groups zero, and through the op's backward too (dX by the same decision, dW
        # by ATen's)
        offs = _offs([2, 0, 3, 1, 4])
        g = torch.Generator().manual_seed(3)
        x = torch.randn(12, 40, generator=g).to(dtype).requires_grad_()  # 2 rows past
        if col_major:
            w = torch.randn(5, 72, 40, generator=g).to(dtype).transpose(-2, -1)
        else:
            w = torch.randn(5, 40, 72, generator=g).to(dtype)
        w.requires_grad_()
        native = unittest.mock.patch.object(
            grouped_mm_module, "_few_rows_mm", wraps=grouped_mm_module._few_rows_mm
        )
        with P.force(half_gemm="native", few_gemm=few_gemm), native as called:
            out = grouped_mm(x, w, offs)
            gy = torch.randn(out.shape, generator=g).to(dtype)
            dx, dw = torch.autograd.grad(out, (x, w), gy)
        used = few_gemm != "aten" and _native.available()
        self.assertEqual(called.call_count, 2 if used else 0)  # forward and dX
        # the AMX form where forced, the weight column-major (the forward; dX multiplies
        # by its transpose) and the CPU has tiles for the dtype
        tiles = few_gemm == "amx" and grouped_mm_module.amx_tiles(dtype)
        ways = [c.args[-1] for c in called.call_args_list]
        want = [
            "few_amx" if tiles and col_major else "few",
            "few_amx" if tiles and not col_major else "few",
        ]
        self.assertEqual(ways, want if used else [])
        assert_gemm_within(self, out, x, w, offs, "forward")
        assert_gemm_within(self, dx, gy, w.transpose(-2, -1), offs, "dX")
        assert_gemm_within(self, dw, x, gy, offs, "dW", wgrad=True)
        self.assertTrue((out[10:] == 0).all() and (dx[10:] == 0).all())

    def test_few_gemm_never_without_the_kernel(self):
        # forced "native" where the native library is disabled: ATen's GEMMs, no error
        x, w = torch.randn(6, 32).to(torch.bfloat16), torch.randn(3, 32, 48).to(torch.bfloat16)
        with unittest.mock.patch.dict(os.environ, {_native.ENV: "0"}), P.force(few_gemm="native"):
            self.assertFalse(grouped_mm_module._few_gemm(x, w, [2, 4, 6]))

    @unittest.skipUnless(_native.available(), "the native kernels are not built here")
    def test_few_gemm_times_the_amx_form_where_it_runs(self):
        # the AMX form is a candidate for column-major bf16 weights where the CPU has
        # tiles, and nowhere else (a forced "amx" runs as "native" there)
        mod = _native.kernels()
        tiles = grouped_mm_module.amx_tiles(torch.bfloat16)
        self.assertFalse(grouped_mm_module.amx_tiles(torch.float16))
        for dtype, col_major in (
            (torch.bfloat16, True),
            (torch.bfloat16, False),
            (torch.float16, True),
        ):
            with self.subTest(dtype=str(dtype), col_major=col_major):
                times = grouped_mm_module._measure_few_gemm(mod, dtype, col_major, 4, 8)
                amx = tiles and dtype == torch.bfloat16 and col_major
                want = {"aten", "native"} | ({"amx"} if amx else set())
                self.assertEqual(set(times), want)
                self.assertTrue(all(t > 0 for t in times.values()))

    def test_amx_rows_from_the_classes(self):
        # the groups from the smallest of a run of "amx" classes down from 32 rows take
        # tiles (a class r holds r // 2 + 1 to r rows); none where the top class is not
        # "amx" or the CPU has no tiles
        tiles = grouped_mm_module.amx_tiles(torch.bfloat16)
        key = "few_gemm:bf16:t:r{}:g32"
        cases = [
            ({32: "amx", 16: "amx", 8: "amx", 4: "native"}, 5),
            ({r: "amx" for r in (32, 16, 8, 4, 2, 1)}, 1),
            ({32: "native", 16: "amx", 8: "amx"}, 0),
            ({32: "amx", 16: "aten", 8: "amx"}, 17),
        ]
        for classes, least in cases:
            forced = {key.format(r): choice for r, choice in classes.items()}
            forced.setdefault("few_gemm", "native")
            with self.subTest(classes=str(classes)), P.force(forced):
                got = grouped_mm_module.amx_rows(torch.bfloat16, 40)  # 40 busy: the g32 class
                self.assertEqual(got, least if tiles else 0)
        with P.force(few_gemm="amx"):
            self.assertEqual(grouped_mm_module.amx_rows(torch.float16, 40), 0)

    def test_few_gemm_only_where_it_applies(self):
        bf = torch.bfloat16
        w = torch.randn(3, 32, 48).to(bf)
        few = grouped_mm_module._few_gemm
        tiles = grouped_mm_module.amx_tiles(bf)
        for choice in ("native", "amx"):
            with self.subTest(choice=choice), P.force(few_gemm=choice):
                want = "few" if _native.available() else None  # w row-major: no tiles
                wt = w.transpose(-2, -1).contiguous().transpose(-2, -1)  # column-major
                col = "few_amx" if tiles and choice == "amx" else want
                self.assertEqual(few(torch.randn(6, 32).to(bf), wt, [2, 4, 6]), col)
                self.assertEqual(few(torch.randn(6, 32).to(bf), w, [2, 4, 6]), want)
                self.assertIsNone(few(torch.randn(6, 32), w.float(), [2, 4, 6]))  # fp32
                self.assertIsNone(few(torch.randn(32, 6).to(bf).t(), w, [2, 4, 6]))  # strided x
                self.assertIsNone(few(torch.randn(6, 32).to(bf), w[:, :, ::2], [2, 4, 6]))
                many = torch.randn(99, 32).to(bf)  # 33 rows per group
                self.assertIsNone(few(many, w, [33, 66, 99]))
                self.assertIsNone(few(many, w, [0, 0, 0]))  # no rows
        with P.force(few_gemm="aten"):
            self.assertIsNone(few(torch.randn(6, 32).to(bf), w, [2, 4, 6]))

    def test_grouped_mm_torch_kernel_keeps_checks(self):
        x = torch.randn(10, 16, requires_grad=True)
        w = torch.randn(3, 16, 8)
        with P.force(grouped_mm="torch"):
            with self.assertRaisesRegex(
                ValueError, r"offs must be non-decreasing .* got offs=\[4, 2, 9\]"
            ):
                grouped_mm(x, w, torch.tensor([4, 2, 9], dtype=torch.int32))
            with self.assertRaisesRegex(
                ValueError, r"offs\[-1\] <= M \(10\), got offs=\[4, 6, 11\]"
            ):
                grouped_mm(x, w, torch.tensor([4, 6, 11], dtype=torch.int32))
            with self.assertRaisesRegex(ValueError, r"offs must be non-decreasing"):
                grouped_mm_wgrad(x, torch.randn(10, 8), torch.tensor([4, 2, 9], dtype=torch.int32))
            # a zero-stride incoming gradient (torch._grouped_mm's own backward rejects it)
            offs = torch.tensor([3, 3, 7], dtype=torch.int32)
            grouped_mm(x, w, offs).sum().backward()
        ones = torch.ones(10, 8)
        assert_gemm_within(self, x.grad, ones, w.transpose(1, 2), offs, "dX")

    @parametrize("layout", ["as_is", "copy_a", "copy_b"])
    @parametrize("ab", ["nn", "tn", "tt", "nt"])
    def test_mm_into_layouts(self, layout, ab):
        a = torch.randn(20, 5) if ab[0] == "n" else torch.randn(5, 20).t()
        b = torch.randn(5, 7) if ab[1] == "n" else torch.randn(7, 5).t()
        out = torch.empty(20, 7)
        spy = unittest.mock.patch.object(
            grouped_mm_module, "_operand", wraps=grouped_mm_module._operand
        )
        with P.force(layout=layout), spy as operand:
            mm_into(a, b, out)
        # the copy happens where forced; row-major x column-major is never copied
        copied = [call.args[2] for call in operand.call_args_list]
        self.assertEqual(any(copied), layout != "as_is" and ab != "nt")
        offs = torch.tensor([20], dtype=torch.int32)
        assert_gemm_within(self, out, a, b.unsqueeze(0), offs, "mm_into")

    @parametrize("dtype", [torch.bfloat16, torch.float32])
    @parametrize("how", ["mm", "mv", "swap"])
    @parametrize("ab", ["nn", "nt"])
    @parametrize("rows", [1, 5])
    @parametrize("half_gemm", ["native", "fp32"])  # mv / swap run in bf16 either way
    def test_mm_into_few_rows(self, dtype, how, ab, rows, half_gemm):
        a = torch.randn(rows, 40, dtype=dtype)
        b = (
            torch.randn(40, 24, dtype=dtype)
            if ab[1] == "n"
            else torch.randn(24, 40, dtype=dtype).t()
        )
        out = torch.empty(rows, 24, dtype=dtype)
        spy = unittest.mock.patch.object(P, "few_rows_mm", wraps=P.few_rows_mm)
        with P.force(few_rows=how, half_gemm=half_gemm), spy as few:
            mm_into(a, b, out)
        self.assertEqual(few.call_args.args[3] if few.called else "mm", how)
        offs = torch.tensor([rows], dtype=torch.int32)
        assert_gemm_within(self, out, a, b.unsqueeze(0), offs, "mm_into")

    @parametrize("half_gemm", ["native", "fp32"])
    # act_chunk elements per thread: many chunks, or one; every few-rows way; both
    # weight-gradient operands
    @parametrize(
        "paths", [("8", "mm", "as_is"), ("1048576", "mv", "transpose"), ("8", "swap", "transpose")]
    )
    @parametrize("gather", [False, True])
    @parametrize("path", ["loop", "whole"])  # whole: taken where half_gemm is native
    # native: the few-rows kernel, which also takes an upcasting CPU to the whole path
    @parametrize("few_gemm", ["aten", "native"])
    def test_grouped_swiglu(self, half_gemm, paths, gather, path, few_gemm):
        act_chunk, few_rows, wgrad_a = paths
        dtype = torch.bfloat16
        offs = _offs([5, 0, 19, 4])  # groups under and over FEW_ROWS rows
        m, dim, hidden = 30, 16, 6  # 2 rows past the last group
        tokens = torch.randn(15, dim, dtype=dtype)
        index = torch.randint(-1, 15, (m,))  # -1: a zero row
        x = naive_rows(tokens, index)
        w13 = torch.randn(4, 2 * hidden, dim, dtype=dtype) * 0.5
        w2 = torch.randn(4, dim, hidden, dtype=dtype) * 0.5
        rw = torch.rand(m)
        grad_y = torch.randn(m, dim, dtype=dtype)
        op, bwd = torch.ops.torch_moe.grouped_swiglu, torch.ops.torch_moe.grouped_swiglu_backward
        forced = dict(half_gemm=half_gemm, act_chunk=act_chunk, few_rows=few_rows, layout="as_is")
        forced.update(swiglu_path=path, wgrad_a=wgrad_a, few_gemm=few_gemm)
        whole = _whole_path_spies()
        few_kernel = unittest.mock.patch.object(
            grouped_mm_module, "_few_rows_mm", wraps=grouped_mm_module._few_rows_mm
        )
        with (
            P.force(**forced),
            whole[0] as fwd_whole,
            whole[1] as bwd_whole,
            _wgrad_copy_spies() as copies,
            few_kernel as few,
        ):
            if gather:
                y, h = op(tokens, w13, w2, offs, rw, index)
                dx, dw13, dw2, drw = bwd(grad_y, None, tokens, h, w13, w2, offs, rw, index)
            else:
                y, h = op(x, w13, w2, offs, rw)
                dx, dw13, dw2, drw = bwd(grad_y, None, x, h, w13, w2, offs, rw)
        # forward: h is one GEMM, y within the SwiGLU rounding bound, both zero past the end
        assert_gemm_within(self, h, x, w13.transpose(-2, -1), offs, "h")
        exact = torch.zeros(m, dim, dtype=torch.float64)
        bound = torch.zeros(m, dim, dtype=torch.float64)
        start = 0
        for e, end in enumerate(offs.tolist()):
            exact[start:end], bound[start:end] = tolerances.swiglu_bound(
                x[start:end], w13[e], w2[e], dtype, torch.float32, rw[start:end]
            )
            start = end
        tolerances.assert_within(self, y, exact, bound, "y")
        self.assertTrue((y[28:] == 0).all() and (h[28:] == 0).all())
        # backward: at the rounding level of the emulation that rounds where the spec allows
        args = (x, w13, w2, offs)
        want = naive.swiglu_rounded(*args, torch.float64, grad_y, rw.double())
        emulated = naive.swiglu_rounded(*args, dtype, grad_y, rw)
        for name, got in {"x": dx, "w13": dw13, "w2": dw2, "row_weights": drw}.items():
            tolerances.assert_rounding_level(self, got, want[name], emulated[name], msg=name)
        self.assertTrue((dx[28:] == 0).all())
        self.assertEqual(drw.dtype, torch.float32)
        # the whole-tensor path runs exactly where forced and the GEMMs are native, or
        # where they upcast and the few-rows kernel takes every GEMM of x @ w; there the
        # kernel runs
        kernel = few_gemm == "native" and _native.available()
        taken = path == "whole" if half_gemm == "native" else kernel
        self.assertEqual((fwd_whole.called, bwd_whole.called), (taken, taken))
        self.assertEqual(few.called, taken and kernel)
        # the weight gradients' operands are copied exactly where forced and native: both
        # (dY for dW2, dH for dW13) on either path, the whole path's piece by piece by the
        # threaded kernel where it is built, the loop's per group
        copied = half_gemm == "native" and wgrad_a == "transpose"
        pieces = taken and grouped_mm_module._threaded_kernels() is not None
        want = (0 if pieces else 2 if taken else 2 * 3, 2 if pieces else 0)
        self.assertEqual(copies(), want if copied else (0, 0))

    @parametrize("forward_few", [False, True])
    @parametrize("backward_few", [False, True])
    def test_grouped_swiglu_upcast_paths_per_direction(self, forward_few, backward_few):
        # where half GEMMs upcast, each direction takes the whole path where the few-rows
        # kernel takes both of its GEMMs of x @ w: the forward's weights column-major
        # (w13^T, w2^T), the backward's row-major (w2, w13); 3 busy groups of 28 rows: the
        # keys' 16 rows and 8 groups
        offs = _offs([5, 0, 19, 4])
        x = torch.randn(28, 16, dtype=torch.bfloat16)
        w13 = torch.randn(4, 12, 16, dtype=torch.bfloat16) * 0.5
        w2 = torch.randn(4, 16, 6, dtype=torch.bfloat16) * 0.5
        few = {True: "native", False: "aten"}
        forced = {
            "half_gemm": "fp32",
            "few_gemm:bf16:t:r16:g8": few[forward_few],
            "few_gemm:bf16:n:r16:g8": few[backward_few],
        }
        spies = _whole_path_spies()
        op, bwd = torch.ops.torch_moe.grouped_swiglu, torch.ops.torch_moe.grouped_swiglu_backward
        grad_y = torch.randn(28, 16, dtype=torch.bfloat16)
        with P.force(forced), spies[0] as fwd_whole, spies[1] as bwd_whole:
            y, h = op(x, w13, w2, offs)
            dx, dw13, dw2, _ = bwd(grad_y, None, x, h, w13, w2, offs)
        native = _native.available()
        self.assertEqual(fwd_whole.called, forward_few and native)
        self.assertEqual(bwd_whole.called, backward_few and native)
        # every path at the rounding level of the emulation that rounds where the spec allows
        args = (x, w13, w2, offs)
        want = naive.swiglu_rounded(*args, torch.float64, grad_y)
        emulated = naive.swiglu_rounded(*args, torch.bfloat16, grad_y)
        for name, got in {"y": y, "x": dx, "w13": dw13, "w2": dw2}.items():
            tolerances.assert_rounding_level(self, got, want[name], emulated[name], msg=name)

    @parametrize("act_chunk", ["4", "1048576"])
    def test_grouped_swiglu_act_chunk_float64(self, act_chunk):
        # float64: every outcome agrees with the reference's autograd up to summation order
        offs = _offs([7, 0, 11, 4])
        x = torch.randn(24, 6, dtype=torch.float64, requires_grad=True)
        w13 = torch.randn(4, 10, 6, dtype=torch.float64, requires_grad=True)
        w2 = torch.randn(4, 6, 5, dtype=torch.float64, requires_grad=True)
        rw = torch.rand(24, dtype=torch.float64, requires_grad=True)
        grad = torch.randn(24, 6, dtype=torch.float64)
        inputs = (x, w13, w2, rw)
        with P.force(act_chunk=act_chunk):
            got = torch.autograd.grad(grouped_swiglu(x, w13, w2, offs, rw), inputs, grad)
        want = torch.autograd.grad(swiglu_reference(x, w13, w2, offs, rw), inputs, grad)
        self.assertEqual(got, want, atol=1e-12, rtol=1e-10)


def naive_rows(tokens, index):
    """Row r is tokens[index[r]], zero where index is -1 (the permute's gather)."""
    return torch.stack(
        [tokens[i] if i >= 0 else torch.zeros_like(tokens[0]) for i in index.tolist()]
    )


class TestProbeMeasurements(TestCase):
    """What each measurement times: the candidates it hands to ``time_candidates``, run
    here directly (no timing). A measurement is only run once per process (decisions are
    memoized), so nothing else in the suite checks that it times the intended work."""

    def _candidates(self, measure):
        seen = {}

        def capture(candidates, budget_s=None):
            seen.update(candidates)
            return dict.fromkeys(candidates, 1.0)

        with unittest.mock.patch.object(P, "time_candidates", capture):
            measure()
        return seen

    @parametrize("wgrad", [False, True])
    @parametrize("ab", ["nn", "nt", "tn", "tt"])
    @parametrize("cls", ["m_small", "k_small", "n_small", "m_large"])
    def test_grouped_mm_candidates(self, wgrad, ab, cls):
        seen = self._candidates(
            lambda: grouped_mm_module._measure_grouped_mm(torch.float32, ab, cls, wgrad)
        )
        self.assertEqual(set(seen), {"loop", "torch"})
        calls = []
        real = torch._grouped_mm

        def spy(a, b, offs=None, **kw):
            calls.append((a, b, offs))
            return real(a, b, offs=offs, **kw)

        with unittest.mock.patch.object(torch, "_grouped_mm", spy):
            fused = seen["torch"]()
        loop = seen["loop"]()
        ((a, b, offs),) = calls
        # the operands have the layout pair and shape class the decision is keyed by
        rows = int(offs[0])
        self.assertEqual(offs.tolist(), [rows * (g + 1) for g in range(8)])
        if wgrad:  # a [K, M_total] @ b [M_total, N]: groups along M
            self.assertEqual(P.layout_of(a, b), ab)
            self.assertEqual(P.shape_class(a.shape[0], rows, b.shape[1]), cls)
        else:  # a [M_total, K] @ b [E, K, N]
            self.assertEqual(P.layout_of(a, b[0]), ab)
            self.assertEqual(P.shape_class(rows, a.shape[1], b.shape[2]), cls)
        # both candidates compute the same product (fp32 GEMMs, sums of 64-256 products)
        self.assertEqual(loop, fused, atol=1e-4, rtol=1e-4)

    def test_swiglu_path_candidates(self):
        seen = self._candidates(lambda: grouped_swiglu_module._measure_path(torch.bfloat16, 24))
        self.assertEqual(set(seen), {"loop", "whole"})
        outs = {}
        for name, run in seen.items():
            calls = []
            real_bwd = getattr(grouped_swiglu_module, f"_backward_{name}")

            def spy(*args, real_bwd=real_bwd, calls=calls, name=name):
                calls.append(args)
                out = real_bwd(*args)
                outs[name] = out
                return out

            with unittest.mock.patch.object(grouped_swiglu_module, f"_backward_{name}", spy):
                run()
            (args,) = calls
            self.assertEqual(args[6].tolist(), [24 * (g + 1) for g in range(8)])  # offs
        # the two paths compute the same gradients up to bf16 rounding: each rounds its GEMM
        # outputs (and under half_gemm=fp32 its operands) to bf16 at its own points, so
        # they may differ by a few roundings per element; rounding errors add in
        # quadrature, so the difference's norm stays within 2u of the gradient's (0.4-0.8u
        # measured under half_gemm=fp32, 0 with the native GEMMs), where a 1% scale error
        # is 2.56u. (An elementwise 2e-2 failed under half_gemm=fp32 on large entries.)
        u = tolerances.UNIT_ROUNDOFF[torch.bfloat16]
        names = ("dx", "dw13", "dw2", "drow_weights")
        for name, got, want in zip(names, outs["whole"], outs["loop"], strict=True):
            err = float((got.double() - want.double()).norm())
            self.assertLessEqual(err, 2 * u * float(want.double().norm()), msg=name)

    def test_wgrad_a_candidates(self):
        seen = self._candidates(
            lambda: grouped_mm_module._measure_wgrad_a(torch.bfloat16, 64, 96, 48)
        )
        self.assertEqual(set(seen), {"as_is", "transpose"})
        calls = []
        real = torch.mm

        def spy(a, b, *, out):
            calls.append((P.layout_of(a, b), tuple(a.shape), tuple(b.shape)))
            return real(a, b, out=out)

        with unittest.mock.patch.object(torch, "mm", spy):
            seen["as_is"]()
            seen["transpose"]()
        # one group's [k, rows] x [rows, n] at the key's sizes: a as the column-major view,
        # then as the row-major copy
        self.assertEqual(calls, [("tn", (96, 64), (64, 48)), ("nn", (96, 64), (64, 48))])

    def test_act_chunk_candidates(self):
        seen = self._candidates(lambda: grouped_swiglu_module._measure_act_chunk(torch.bfloat16))
        self.assertEqual(set(seen), {str(2**n) for n in (15, 16, 17, 18)})
        real = grouped_swiglu_module._act_backward_into
        for name, run in seen.items():
            rows_seen = []

            def spy(h, grad_a, rw, out_a, out_dh, real=real, rows_seen=rows_seen):
                self.assertEqual(
                    {h.shape[0], grad_a.shape[0], rw.shape[0], out_a.shape[0], out_dh.shape[0]},
                    {h.shape[0]},
                )
                rows_seen.append(h.shape[0])
                return real(h, grad_a, rw, out_a, out_dh)

            with unittest.mock.patch.object(grouped_swiglu_module, "_act_backward_into", spy):
                run()
            # every one of the 1024 rows once, in chunks of the candidate's elements / 512
            chunk = int(name) // 512
            self.assertEqual(sum(rows_seen), 1024)
            self.assertEqual(rows_seen, [chunk] * (1024 // chunk))


instantiate_parametrized_tests(TestCpuProbe)
instantiate_parametrized_tests(TestProbeMeasurements)
instantiate_parametrized_tests(TestForcedDecisions)

if __name__ == "__main__":
    run_tests()
