"""``calibrate()``: measure this machine's rates for the performance model (CPU hosts; an
accelerator: :mod:`torch_moe.perf._calibrate_gpu`).

Legend: m, k, n GEMM dims (see :mod:`torch_moe.perf._hardware`); T tokens, D dim,
F hidden dim, E experts, K top-k.

What is measured, per thread count (this process's by default), every figure a statistic
of interleaved repetitions and passes of the thread's CPU time (with one thread; the wall
clock with more):

* ``statistic="median"`` (the default): the median, the state a job sustains on this
  machine, noise included; what a step of a real job is measured at;
* ``statistic="min"``: the minimum, each batch started through a gate that waits for an
  undisturbed core and scaled by the gate probe's best over its value before the batch
  (``_Samples``): the machine's own cost, without its neighbours. On a shared host this is
  faster than any sustained step (measured here: 15-55% below the steps' medians).

What:

* GEMMs: ``torch_moe._ops.grouped_mm.mm_into`` (the per-group primitive of the CPU grouped
  GEMMs and of the SwiGLU kernels, including its fp32 upcast on CPUs without native bf16)
  on a grid of m (rows: 1..4096) x k x n (16..4096) for bf16 and fp32 operands and the
  three layouts (NT forward, NN dgrad, TN wgrad, whose k is the rows), each point a small
  grouped loop as the layer runs it (group sizes around m, activation rows sliced from one
  buffer, weights rotating out of cache; see ``_gemm_call``). Grid points above
  ``_FLOP_CAP`` are extrapolated from their smaller neighbour at a constant rate.
* Where the recipes' scaled GEMMs run their fp32 form by the native kernels' pieces (a CPU
  that upcasts bf16 GEMMs: ``fp8_pieces_here``), those kernels on the same grid and
  layouts, e4m3 codes in, bf16 out (the ``e4m3`` tables, ``_fp8_pieces_call``).
* The grouped SwiGLU expert op itself (``torch_moe.nn.functional.grouped_swiglu``, bf16,
  forward + backward) on a grid of rows per group (1..4096) x D x F
  (64..4096), measured like the GEMMs (four groups, weights out of cache): the library's
  bf16 experts as the black box they are, whatever their CPU kernel does inside.
* Elementwise kernels, each at four log-spaced sizes: the library's own routing
  (``ops.topk_route`` forward / backward), sort (``ops.permute_indices``), permute and
  unpermute (forward / backward), the SwiGLU activation of the grouped kernels (forward /
  backward, ``torch_moe._ops.grouped_swiglu._act`` / ``_act_backward``), the dense SwiGLU of
  the shared expert, casts, adds, copies, and quantize + dequantize of every operand kind
  the recipes use (``torch_moe.quantization.quantize_*`` / ``dequantize_*``; where the
  ``e4m3`` tables are measured, each quantizer alone too: ``"<kind>:alone"``).
* Overheads: the layer itself (``torch_moe.nn.MoE``, D = F = 32, two rows per expert,
  deterministic routing) forward and forward + backward with 1 and 16 experts, per
  precision, plus the extra of a shared expert and of a capacity: fixed seconds and
  seconds per expert group, the host-side cost no rate above captures. Where the
  ``e4m3`` tables are measured, each recipe also at ``FEW_ROWS + 1`` rows per expert
  (``"<recipe>:pieces"``): at two rows its scaled GEMMs loop over the groups in Python
  (the chunks' form), above ``FEW_ROWS`` they run the native pieces, whose per-group host
  cost the two-row probe overstated 2-3x (109-119 against 34-50 us a group forward +
  backward on the Zen 3 EPYC: 7.6 ms of a 64-expert FP8 step's 40).
* Memory bandwidth: a 64 MB copy.
* Links, when ``torch.distributed`` is initialized with more than one rank (collective:
  every rank must call ``calibrate``): the per-message latency (1 MB to every peer in 64
  point-to-point messages against one, paired per round), the all-to-all bandwidth
  (``all_to_all_single`` of 1-32 MB per rank) and the latency of a small all-to-all, each
  the slowest rank's time.
  Then the EP layer's host work beyond alpha-beta (``Link.exchange_overhead``): the layer
  at the overhead probes' sizes under ``ExpertParallel`` (2 and 16 local experts, 1 and 2
  chunks, p2p and all_to_all; with four ranks or more also the two-stage all_to_all over
  "nodes" of two ranks; forward and forward + backward), less the model's
  prediction of the same step: the exchange ops' Python, dispatcher, autograd and
  DTensor work, and each rank waiting for the others at every exchange, which on CPU
  ranks sharing a host's cores outweighs the bytes (measured figures:
  ``benchmarks/results/perf_model_ephost_cpu_202612.md``).

Cached per process and on disk under ``$XDG_CACHE_HOME/torch_moe/perf`` (default
``~/.cache``), keyed by the CPU model and ISA, the core count, the thread counts, the
torch version and a hash of the library sources whose speed is measured; links are
measured per call (they belong to the process group, not the machine).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import inspect
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from torch_moe._ops._cpu_probe import FEW_ROWS, _cpuinfo, package_sources, sources_digest
from torch_moe.perf._hardware import LAYOUTS, GemmTable, Hardware, Link, RateTable

__all__ = ["calibrate", "cpu_isa", "machine_fingerprint"]

_ROWS = (1, 4, 16, 64, 256, 1024, 4096)
_COLS = (16, 64, 256, 1024, 4096)
_ROWS_QUICK = (1, 64)
_COLS_QUICK = (16, 256)
# larger grid calls are extrapolated from a smaller neighbour at its rate. A neighbour
# with fewer rows per group runs slower than the point it stands for (measured: the step
# of D=512-1024 layers with 256 rows per expert over-predicted by 27-38% while the
# grouped SwiGLU's cap was 1.5e9), so the caps let the grid reach those points; the larger
# calls add ~30 s to a full calibration on 2 cores
_FLOP_CAP = 4e9
_PROBE_DIM = 32  # D = F of the overhead probes (MX needs multiples of 32)
_PROBE_EXPERTS = 16
_PROCESS_CACHE: dict[str, Hardware] = {}
_LINK_CACHE: dict[tuple[int, str, bool, str], Link] = {}


# --------------------------------------------------------------------------------------
# machine identity


def cpu_isa() -> str:
    """The GEMM-relevant ISA of this CPU from /proc/cpuinfo flags: e.g. ``AVX512-BF16+AMX``."""
    flags = _cpuinfo()[1]
    parts = []
    if "avx512f" in flags:
        parts.append("AVX512")
    elif "avx2" in flags:
        parts.append("AVX2")
    if "avx512_bf16" in flags:
        parts.append("AVX512-BF16")
    if "amx_bf16" in flags:
        parts.append("AMX")
    return "+".join(parts) or platform.machine()


def _cpu_model() -> str:
    return _cpuinfo()[0]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _calibrated_sources() -> list[Path]:
    """The library files whose speed the calibration measures (relative to the package):
    the ops, the quantizers, the layer, the calibration itself, and the native kernels'
    sources (a changed kernel invalidates what was measured of the old one)."""
    return package_sources(
        "_ops/*.py",
        "quantization/*.py",
        "csrc/*.cpp",
        "csrc/*.h",
        "nn/modules/moe.py",
        "perf/_calibrate.py",
        "perf/_calibrate_gpu.py",
    )


def _sources_hash() -> str:
    """Hash of the library files whose speed the calibration measures."""
    return sources_digest(_calibrated_sources())


def machine_fingerprint() -> dict[str, str]:
    """What the measurements belong to (the on-disk cache key)."""
    return {
        "cpu": _cpu_model(),
        "isa": cpu_isa(),
        "cores": str(_cores()),
        "torch": torch.__version__,
        "sources": _sources_hash(),
    }


# --------------------------------------------------------------------------------------
# timing


def _clock() -> Callable[[], float]:
    """The thread's CPU clock with one torch thread (it excludes the time other processes
    hold the core), else the wall clock."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


class _Gate:
    """Waits, briefly, for an undisturbed core before a batch of measurements.

    On a shared VM the CPU time of the same call moves by up to 2x for seconds at a time
    (measured here: a bf16 mm loop 1.05 ms or 2.0 ms, a copy 0.60 or 0.75 ms, as another
    tenant's thread shares the physical core), and by 3-5x while other processes keep
    more threads runnable than there are cores. The gate's probe is a small MoE layer step
    (D = F = 64, E = 4, K = 2, 256 tokens: GEMMs, elementwise kernels and Python, the mix
    it guards); it waits while the probe is more than ``slack`` above its best so far or
    the kernel reports more runnable threads than cores (``procs_running`` of /proc/stat,
    this one included), sleeping 0.2 s at a time, for at most ``max_wait`` seconds per
    batch and ``total_wait`` in all; the minimum over repetitions and passes removes what
    is left.
    """

    def __init__(self, max_wait: float = 0.5, total_wait: float = 8.0, slack: float = 1.12) -> None:
        self.best = math.inf
        self.last = math.inf  # the probe before the latest batch (see _Samples)
        self.max_wait = max_wait
        self.left = total_wait
        self.slack = slack
        self._step: Callable[[], None] | None = None

    def _build(self) -> Callable[[], None]:
        from torch_moe.nn import MoE

        g = torch.Generator().manual_seed(0)
        moe = MoE(64, 64, 4, 2, dtype=torch.bfloat16)
        x = torch.randn(256, 64, generator=g).to(torch.bfloat16).requires_grad_(True)
        grad = torch.randn(256, 64, generator=g).to(torch.bfloat16)

        def step() -> None:
            moe.zero_grad(set_to_none=True)
            x.grad = None
            moe(x).backward(grad)

        with torch.enable_grad():
            for _ in range(3):
                step()
        return step

    def probe(self) -> float:
        if self._step is None:
            self._step = self._build()
        clock = _clock()
        with torch.enable_grad():
            t0 = clock()
            self._step()
            t = clock() - t0
        self.best = min(self.best, t)
        return t

    def settle(self, seconds: float) -> None:
        """Probe for up to ``seconds`` (sleeping between probes) to learn a good best."""
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.probe()
            time.sleep(0.05)

    def ok(self) -> bool:
        """The core looks undisturbed right now (one probe)."""
        return self.probe() <= self.slack * self.best and _runnable() <= _cores()

    def wait(self) -> bool:
        """Wait for :meth:`ok` (bounded); True if it was reached."""
        start = time.perf_counter()
        deadline = start + min(self.max_wait, self.left)
        good = False
        while True:
            self.last = min(self.probe(), self.probe())
            good = self.last <= self.slack * self.best and _runnable() <= _cores()
            if good or time.perf_counter() > deadline:
                break
            time.sleep(0.2)
        self.left = max(0.0, self.left - (time.perf_counter() - start))
        return good


_GATE = _Gate()


def _runnable() -> int:
    """Threads the kernel reports runnable right now (0 where /proc/stat is missing)."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


Statistic = Literal["median", "min"]
# the statistic of the calibration in progress (set by _measure_compute for its duration; a
# context variable, so a calibration in another thread or task keeps its own)
_STATISTIC: contextvars.ContextVar[Statistic] = contextvars.ContextVar(
    "torch_moe_perf_statistic", default="median"
)


@contextlib.contextmanager
def _using_statistic(statistic: Statistic) -> Iterator[None]:
    """The calibration's statistic for the samples taken inside."""
    token = _STATISTIC.set(statistic)
    try:
        yield
    finally:
        _STATISTIC.reset(token)


def _sample_times(fns: list[Callable[[], object]], reps: int, warm: bool = True) -> list[float]:
    """Seconds per call of each fn over ``reps`` interleaved rounds after a warm-up: the
    median (``statistic="median"``), or the minimum with the batch started through the
    gate (``"min"``: noise on a shared machine only ever adds time, so the minimum
    estimates the machine's own cost)."""
    clock = _clock()
    for fn in fns if warm else ():
        fn()
    median = _STATISTIC.get() == "median"
    if not median:
        _GATE.wait()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            times[i].append(clock() - t0)
    return [statistics.median(ts) if median else min(ts) for ts in times]


def _reps_for(seconds: float, budget: float = 0.01, lo: int = 2, hi: int = 8) -> int:
    return int(min(hi, max(lo, budget / max(seconds, 1e-7))))


class _Samples(dict):
    """key -> the (seconds, probe seconds before the batch) samples over the passes.

    :meth:`value` is, with ``statistic="median"``, the median of the passes' figures as
    measured; with ``"min"``, the minimum of ``seconds * best / probe``: each sample scaled
    to the probe's best state (``best``: the gate probe's minimum over the whole
    calibration), which removes the part of a slow phase that the gate did not wait out, as
    far as the probe (a small MoE layer step: GEMMs, elementwise ops, Python) slows like
    the figure.
    """

    def put(self, key: tuple, value: float) -> None:
        self.setdefault(key, []).append((value, _GATE.last))

    def value(self, key: tuple) -> float:
        if _STATISTIC.get() == "median":  # the passes' medians, as measured
            return statistics.median(t for t, _ in self[key])
        best = _GATE.best
        return min(
            t * min(1.0, best / p) if math.isfinite(p) and p > 0 else t for t, p in self[key]
        )

    def values_where(self, prefix: tuple) -> dict[tuple, float]:
        n = len(prefix)
        return {k[n:]: self.value(k) for k in self if k[:n] == prefix}


# --------------------------------------------------------------------------------------
# GEMMs


_COLD_BYTES = 16 * 2**20  # weights rotate through this many bytes: out of L2, as in a layer


def _cold_pool(nbytes: int, most: int = 64) -> int:
    """How many copies of an operand of ``nbytes`` to rotate through so that they span
    ``_COLD_BYTES`` (2 to ``most``)."""
    return int(min(most, max(2, -(-_COLD_BYTES // max(1, nbytes)))))


_GROUPS = 4  # groups per measured call of the grouped loop


def _group_rows(m: int) -> list[int]:
    """Rows of the measured groups: m with the spread of a Poisson count (+-sqrt(m))."""
    return [max(1, round(m + z * math.sqrt(m))) for z in (-1.2, -0.4, 0.4, 1.2)][:_GROUPS]


def _gemm_call(layout: str, m: int, k: int, n: int, dtype: torch.dtype) -> Callable[[], object]:
    """``_GROUPS`` ``mm_into`` calls per invocation, as the CPU grouped GEMM runs them:
    group sizes spread around m, the activation operand sliced from one buffer of all
    groups' rows, and the expert-weight side rotating through a pool larger than L2 (B for
    NT / NN, the weight gradient written by TN). Measured here against a single repeated
    call of the same shape, each of these made the grouped loop slower: varying m by 26%,
    the cold activation rows by another 17%, cold weights by up to 60% at small m."""
    from torch_moe._ops.grouped_mm import mm_into, wgrad_operand

    def full(*shape: int) -> torch.Tensor:  # values do not matter; randn would cost more
        return torch.full(shape, 0.01, dtype=dtype)

    elem = torch.empty((), dtype=dtype).element_size()
    rows = _group_rows(k if layout == "TN" else m)  # TN reduces over the group's rows
    starts = [sum(rows[:i]) for i in range(len(rows))]
    pool = _cold_pool(k * n * elem)
    if layout == "NT":  # x [m, k] @ w[n, k]^T
        a, bs = full(sum(rows), k), [full(n, k).t() for _ in range(pool)]
        outs = [torch.empty(sum(rows), n, dtype=dtype)]
    elif layout == "NN":  # dy [m, k] @ w [k, n]
        a, bs = full(sum(rows), k), [full(k, n) for _ in range(pool)]
        outs = [torch.empty(sum(rows), n, dtype=dtype)]
    else:  # TN: x [k, m] (k = rows of the group) transposed @ dy [k, n] -> dW [m, n]
        a, bs = full(sum(rows), m), [full(sum(rows), n)]
        pool = _cold_pool(m * n * elem)
        outs = [torch.empty(m, n, dtype=dtype) for _ in range(pool)]
    state = [0]

    def call() -> None:
        for s, r in zip(starts, rows):
            i = state[0] = state[0] + 1
            b, out = bs[i % len(bs)], outs[i % len(outs)]
            if layout == "TN":  # the kernels' first operand: as is or copied row-major
                mm_into(wgrad_operand(a[s : s + r], n, [r]), b[s : s + r], out)
            else:
                mm_into(a[s : s + r], b, out[s : s + r])

    return call


def fp8_pieces_here() -> bool:
    """Whether this CPU's recipes run the fp32 form of their scaled GEMMs by the native
    kernels' pieces (``scaled_grouped_mm.dequantizes_pieces`` at more than ``FEW_ROWS``
    rows a group on one thread: a CPU that upcasts bf16 GEMMs, the native e4m3 kernels
    built): the ``e4m3`` GEMM tables (:func:`_fp8_pieces_call`) are measured only here."""
    from torch_moe.quantization.scaled_grouped_mm import dequantizes_pieces

    return dequantizes_pieces(FEW_ROWS + 1, 1)


def _fp8_pieces_call(layout: str, m: int, k: int, n: int) -> Callable[[], object]:
    """The recipes' scaled GEMM kernels where :func:`fp8_pieces_here` holds (``e4m3``
    tables): one call of ``fp8_dequantized_mm`` (NT: the forward's weight codes K-major;
    NN: the dgrad's row-major) or ``fp8_dequantized_mm_wgrad`` (TN) on ``_GROUPS`` groups
    of e4m3 codes, the group sizes, cold weights and layouts of :func:`_gemm_call`, a bf16
    output: each piece's operands dequantized on its thread and multiplied in fp32 there,
    the product rounded once, which ``mm_into``'s tables price as a loop of fp32 GEMMs
    with the operands and the cast outside (37-48% over the measured steps of a 64-expert
    layer on the Zen 3 EPYC). The scales of ``fp8_blockwise``: 1x128 along A's rows and
    128x128 blocks of B, and for the weight gradient a row of scales per group (each
    row's looked up by its index)."""
    from torch_moe._ops import _native

    kernels = _native.kernels()
    fp8 = torch.float8_e4m3fn

    def codes(*shape: int) -> torch.Tensor:
        return torch.full(shape, 0.01).to(fp8)

    rows = _group_rows(k if layout == "TN" else m)
    offs = torch.tensor(rows, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if layout == "TN":  # x [k, m] (k = rows of the group) transposed @ dy [k, n] -> [m, n]
        a, b = codes(sum(rows), m), codes(sum(rows), n)
        index = torch.repeat_interleave(torch.arange(_GROUPS), torch.tensor(rows))
        a_scale, b_scale = torch.ones(_GROUPS, m), torch.ones(_GROUPS, n)
        pool = _cold_pool(_GROUPS * m * n * 2)
        outs = [torch.empty(_GROUPS, m, n, dtype=torch.bfloat16) for _ in range(pool)]
    else:
        a = codes(sum(rows), k)
        pool = _cold_pool(_GROUPS * k * n)
        if layout == "NT":  # the forward's weight codes: each column's K contiguous
            bs = [codes(_GROUPS, n, k).transpose(1, 2) for _ in range(pool)]
        else:
            bs = [codes(_GROUPS, k, n) for _ in range(pool)]
        out = torch.empty(sum(rows), n, dtype=torch.bfloat16)
        kb, nb = -(-k // 128), -(-n // 128)
        a_scale, b_scale = torch.ones(sum(rows), kb), torch.ones(_GROUPS, kb, nb)
    state = [0]

    def call() -> None:
        i = state[0] = state[0] + 1
        if layout == "TN":
            ok = kernels.fp8_dequantized_mm_wgrad(
                a, b, a_scale, b_scale, index, offs, outs[i % pool]
            )
        else:
            ok = kernels.fp8_dequantized_mm(a, bs[i % pool], a_scale, b_scale, offs, 128, 128, out)
        if not ok:
            raise RuntimeError(f"calibrate: the e4m3 pieces refused {layout} {m}x{k}x{n}")

    return call


_SW_ROWS = (1, 4, 16, 64, 256, 1024, 4096)
_SW_DIMS = (64, 256, 1024, 4096)
_SW_ROWS_QUICK = (1, 64)
_SW_DIMS_QUICK = (64, 256)
_SW_FLOP_CAP = 2e10  # fwd + bwd FLOPs of one measured call (all its groups); see _FLOP_CAP


def _swiglu_call(m: int, d: int, f: int, backward: bool) -> Callable[[], object]:
    """The library's grouped SwiGLU op (``torch_moe.nn.functional.grouped_swiglu``) on
    ``_GROUPS`` groups of about m rows (bf16, routing weights folded in), forward only under
    ``no_grad`` or forward + backward, the expert weights rotating out of cache."""
    from torch_moe.nn.functional import grouped_swiglu

    dtype = torch.bfloat16
    rows = _group_rows(m)
    offs = torch.tensor([sum(rows[: i + 1]) for i in range(len(rows))], dtype=torch.int32)
    n = sum(rows)
    x = torch.full((n, d), 0.01, dtype=dtype, requires_grad=backward)
    rw = torch.full((n,), 0.5, requires_grad=backward)
    stack = len(rows) * 3 * f * d * 2
    pool = _cold_pool(stack, 16)
    w13s = [
        torch.full((len(rows), 2 * f, d), 0.01, dtype=dtype, requires_grad=backward)
        for _ in range(pool)
    ]
    w2s = [
        torch.full((len(rows), d, f), 0.01, dtype=dtype, requires_grad=backward)
        for _ in range(pool)
    ]
    gy = torch.full((n, d), 0.01, dtype=dtype)
    state = [0]

    def call() -> None:
        i = state[0] = (state[0] + 1) % pool
        if not backward:
            with torch.no_grad():
                grouped_swiglu(x, w13s[i], w2s[i], offs, rw)
            return
        w13s[i].grad = w2s[i].grad = x.grad = rw.grad = None
        with torch.enable_grad():
            grouped_swiglu(x, w13s[i], w2s[i], offs, rw).backward(gy)

    return call


def _swiglu_axes(quick: bool) -> tuple[tuple[int, ...], ...]:
    return (
        (_SW_ROWS_QUICK, _SW_DIMS_QUICK, _SW_DIMS_QUICK)
        if quick
        else (_SW_ROWS, _SW_DIMS, _SW_DIMS)
    )


def _measure_swiglu(mins: _Samples, t: int, quick: bool) -> None:
    ms, ds, fs = _swiglu_axes(quick)
    for mode in ("fwdbwd",):  # forward-only steps use the per-GEMM model
        todo = [
            (i, j, kk)
            for i, m in enumerate(ms)
            for j, d in enumerate(ds)
            for kk, f in enumerate(fs)
            if 18.0 * m * d * f * _GROUPS <= _SW_FLOP_CAP
        ]
        for idx in range(0, len(todo), 6):
            batch = todo[idx : idx + 6]
            fns = [_swiglu_call(ms[i], ds[j], fs[kk], mode == "fwdbwd") for i, j, kk in batch]
            first = _sample_times(fns, 1)
            for ijk, sec in zip(batch, _sample_times(fns, _reps_for(max(first)), warm=False)):
                mins.put(("swiglu", t, mode, *ijk), sec / _GROUPS)


def _swiglu_table(mins: _Samples, t: int, mode: str, quick: bool) -> GemmTable:
    axes = _swiglu_axes(quick)
    grid = mins.values_where(("swiglu", t, mode))
    seconds = [
        _capped(grid, (i, j, kk), axes)
        for i in range(len(axes[0]))
        for j in range(len(axes[1]))
        for kk in range(len(axes[2]))
    ]
    ms, ds, fs = (tuple(float(v) for v in a) for a in axes)
    return GemmTable(ms, ds, fs, tuple(seconds))


def _gemm_axes(layout: str, quick: bool) -> tuple[tuple[int, ...], ...]:
    rows, cols = (_ROWS_QUICK, _COLS_QUICK) if quick else (_ROWS, _COLS)
    return (cols, rows, cols) if layout == "TN" else (rows, cols, cols)


def _measure_gemms(
    mins: _Samples, t: int, layout: str, key: str, dtype: torch.dtype | None, quick: bool
) -> None:
    """``key``'s table at ``layout`` on ``t`` threads: ``mm_into`` of ``dtype``, or (``dtype``
    None, key ``e4m3``) the recipes' scaled GEMM pieces."""
    ms, ks, ns = _gemm_axes(layout, quick)
    todo = [
        (i, j, kk)
        for i, m in enumerate(ms)
        for j, k in enumerate(ks)
        for kk, n in enumerate(ns)
        if 2.0 * m * k * n * _GROUPS <= _FLOP_CAP
    ]
    for idx in range(0, len(todo), 8):
        batch = todo[idx : idx + 8]
        fns = [
            _gemm_call(layout, ms[i], ks[j], ns[kk], dtype)
            if dtype is not None
            else _fp8_pieces_call(layout, ms[i], ks[j], ns[kk])
            for i, j, kk in batch
        ]
        first = _sample_times(fns, 1)
        for ijk, sec in zip(batch, _sample_times(fns, _reps_for(max(first)), warm=False)):
            mins.put(("gemm", t, key, layout, *ijk), sec / _GROUPS)


def _gemm_table(mins: _Samples, t: int, layout: str, key: str, quick: bool) -> GemmTable:
    axes = _gemm_axes(layout, quick)
    grid = mins.values_where(("gemm", t, key, layout))
    seconds = [
        _capped(grid, (i, j, kk), axes)
        for i in range(len(axes[0]))
        for j in range(len(axes[1]))
        for kk in range(len(axes[2]))
    ]
    ms, ks, ns = axes
    return GemmTable(
        tuple(float(x) for x in ms),
        tuple(float(x) for x in ks),
        tuple(float(x) for x in ns),
        tuple(seconds),
    )


def _capped(
    grid: dict[tuple, float],
    key: tuple[int, int, int],
    axes: tuple[tuple[int, ...], ...],
) -> float:
    if key in grid:
        return grid[key]
    # step down the largest dim until a measured point, scale by the FLOP ratio
    idx = list(key)
    scale = 1.0
    while tuple(idx) not in grid:
        d = max(range(3), key=lambda a: axes[a][idx[a]] if idx[a] > 0 else -1)
        scale *= axes[d][idx[d]] / axes[d][idx[d] - 1]
        idx[d] -= 1
    return grid[tuple(idx)] * scale


# --------------------------------------------------------------------------------------
# elementwise kernels


def _call_permute(
    make: Callable[[int, str, bool], Callable[[], object]], which: str, backward: bool, n: int
) -> Callable[[], object]:
    return make(n, which, backward)


# a quantize kernel and its dequantize: (() -> (q, scale), (q, scale) -> tensor)
_QuantPair = tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], Callable[..., object]]


def _kernel_factories(
    cdt: torch.dtype, device: torch.device | str = "cpu"
) -> dict[str, Callable[[int], Callable[[], object]]]:
    """kernel name -> (element count -> a closure running one call) on ``device``.

    On a CPU each kernel is the one the layer's CPU path runs; on an accelerator the
    activation is the dense SwiGLU formula (what the device-generic experts compute) and a
    quantize kernel quantizes only (its GEMM dequantizes in the kernel), where the CPU's
    emulation also dequantizes; a CPU whose scaled GEMMs dequantize in their native
    pieces (:func:`fp8_pieces_here`) also measures each quantizer alone
    (``"<kind>:alone"``)."""
    import torch.nn.functional as F

    from torch_moe import ops
    from torch_moe import quantization as Q
    from torch_moe._ops.grouped_swiglu import _act, _act_backward

    bf16 = torch.bfloat16
    on_cpu = torch.device(device).type == "cpu"
    f: dict[str, Callable[[int], Callable[[], object]]] = {}

    def cast(src: torch.dtype, dst: torch.dtype) -> Callable[[int], Callable[[], object]]:
        def make(n: int) -> Callable[[], object]:
            x = torch.randn(n, dtype=src, device=device)
            return lambda: x.to(dst)

        return make

    f["cast.bf16_fp32"] = cast(bf16, torch.float32)
    f["cast.fp32_bf16"] = cast(torch.float32, bf16)

    def add(n: int) -> Callable[[], object]:
        a = torch.randn(n, dtype=bf16, device=device)
        b = torch.randn(n, dtype=bf16, device=device)
        return lambda: a + b

    f["add"] = add

    def copy(n: int) -> Callable[[], object]:  # n bytes
        src = torch.ones(n, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)

    f["copy"] = copy

    num_experts, k = 64, 4

    def route(n: int, backward: bool) -> Callable[[], object]:
        t = max(1, n // num_experts)
        logits = torch.randn(t, num_experts, device=device, requires_grad=True)
        if not backward:
            return lambda: ops.topk_route(logits.detach(), k)
        w, _, _ = ops.topk_route(logits, k)
        g = torch.randn_like(w)
        return lambda: torch.autograd.grad(w, logits, g, retain_graph=True)

    f["route.fwd"] = lambda n: route(n, False)
    f["route.bwd"] = lambda n: route(n, True)

    def sort(n: int) -> Callable[[], object]:
        t = max(1, n // k)
        ids = torch.randint(0, num_experts, (t, k), device=device)
        return lambda: ops.permute_indices(ids, num_experts)

    f["sort"] = sort

    dim = 256

    def permute(n: int, which: str, backward: bool) -> Callable[[], object]:
        t = max(1, n // (2 * dim))
        ids = torch.randint(0, num_experts, (t, 2), device=device)
        perm = ops.permute_indices(ids, num_experts)
        if which == "permute":
            x = torch.randn(t, dim, dtype=bf16, device=device, requires_grad=True)

            def fwd() -> torch.Tensor:
                return torch.ops.torch_moe.permute(x, perm.row_to_slot, perm.slot_to_row)

        else:
            x = torch.randn(t * 2, dim, dtype=bf16, device=device, requires_grad=True)

            def fwd() -> torch.Tensor:
                return ops.unpermute(x, None, perm)

        if not backward:
            return lambda: fwd().detach()
        y = fwd()
        g = torch.randn_like(y)
        return lambda: torch.autograd.grad(y, x, g, retain_graph=True)

    for which in ("permute", "unpermute"):
        f[f"{which}.fwd"] = functools.partial(_call_permute, permute, which, False)
        f[f"{which}.bwd"] = functools.partial(_call_permute, permute, which, True)

    hidden = 256

    def act(n: int, backward: bool) -> Callable[[], object]:
        # as the grouped kernels call it: on one group's rows of a larger buffer, the
        # groups taken in turn (so the rows are not the ones the last call left in cache)
        rows = max(1, n // hidden)
        h = torch.randn(_GROUPS * rows, 2 * hidden, dtype=bf16)
        rw = torch.rand(_GROUPS * rows)
        state = [0]

        def rng() -> slice:
            i = state[0] = (state[0] + 1) % _GROUPS
            return slice(i * rows, (i + 1) * rows)

        if not backward:
            return lambda: _act(h[(r := rng())], cdt, rw[r])
        ga = torch.randn(_GROUPS * rows, hidden, dtype=cdt)
        out_a = torch.empty(_GROUPS * rows, hidden, dtype=cdt)
        out_dh = torch.empty(_GROUPS * rows, 2 * hidden, dtype=cdt)
        return lambda: _act_backward(h[(r := rng())], ga[r], rw[r], out_a[r], out_dh[r])

    if on_cpu:
        f["act.fwd"] = lambda n: act(n, False)
        f["act.bwd"] = lambda n: act(n, True)

    def dense_act(n: int, backward: bool) -> Callable[[], object]:
        rows = max(1, n // hidden)
        h = torch.randn(rows, 2 * hidden, dtype=bf16, device=device, requires_grad=True)

        def fwd() -> torch.Tensor:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up

        if not backward:
            return lambda: fwd().detach()
        y = fwd()
        g = torch.randn_like(y)
        return lambda: torch.autograd.grad(y, h, g, retain_graph=True)

    f["dense_act.fwd"] = lambda n: dense_act(n, False)
    f["dense_act.bwd"] = lambda n: dense_act(n, True)
    if not on_cpu:  # the device-generic experts' activation is the dense formula
        f["act.fwd"], f["act.bwd"] = f["dense_act.fwd"], f["dense_act.bwd"]

    cols = 256

    def quant(kind: str, alone: bool = False) -> Callable[[int], Callable[[], object]]:
        def make(n: int) -> Callable[[], object]:
            rows = max(128, (n // cols) // 128 * 128)
            x = torch.randn(rows, cols, dtype=bf16, device=device)
            offs = torch.linspace(0, rows, 9, device=device)[1:].round().to(torch.int32)

            def fp8(block: tuple[int, int]) -> _QuantPair:
                return (
                    lambda: Q.quantize_fp8(x, block),
                    lambda q, s: Q.dequantize_fp8(q, s, block),
                )

            def mx(dim: int) -> _QuantPair:
                return (
                    lambda: Q.quantize_mx(x, dim=dim, block=32),
                    lambda q, s: Q.dequantize_mx(q, s, dim=dim, block=32),
                )

            def jagged(block: int, fmt: str) -> _QuantPair:
                return (
                    lambda: Q.quantize_jagged(x, offs, block=block, fmt=fmt),
                    lambda q, s: Q.dequantize_jagged(q, s, offs, block=block),
                )

            pairs = {
                "q.fp8_tensor": lambda: fp8((-1, -1)),
                "q.fp8_row": lambda: fp8((1, -1)),
                "q.fp8_col": lambda: fp8((-1, 1)),
                "q.fp8_1x128": lambda: fp8((1, 128)),
                "q.fp8_128x128": lambda: fp8((128, 128)),
                "q.mx_row": lambda: mx(-1),
                "q.mx_col": lambda: mx(-2),
                "qj.fp8_group": lambda: jagged(-1, "fp8"),
                "qj.fp8_128": lambda: jagged(128, "fp8"),
                "qj.mx_32": lambda: jagged(32, "mx"),
            }
            if kind not in pairs:
                raise ValueError(f"unknown quantize kind {kind!r}")
            quantize, dequantize = pairs[kind]()
            if not on_cpu or alone:
                return quantize
            return lambda: dequantize(*quantize())

        return make

    pieces = on_cpu and fp8_pieces_here()

    for kind in (
        "q.fp8_tensor",
        "q.fp8_row",
        "q.fp8_col",
        "q.fp8_1x128",
        "q.fp8_128x128",
        "q.mx_row",
        "q.mx_col",
        "qj.fp8_group",
        "qj.fp8_128",
        "qj.mx_32",
    ):
        f[kind] = quant(kind)
        if pieces:  # the scaled GEMM's native pieces dequantize: the quantizer alone
            f[f"{kind}:alone"] = quant(kind, alone=True)
    return f


_KERNEL_SIZES = (2**6, 2**10, 2**14, 2**18, 2**20)
_COPY_SIZES = (2**10, 2**16, 2**20, 2**24)


def _kernel_sizes(name: str, quick: bool) -> tuple[int, ...]:
    sizes = _COPY_SIZES if name == "copy" else _KERNEL_SIZES
    return (sizes[0], sizes[1]) if quick else sizes


def _measure_kernels(mins: _Samples, t: int, cdt: torch.dtype, quick: bool) -> None:
    with torch.enable_grad():
        for name, make in _kernel_factories(cdt).items():
            sizes = _kernel_sizes(name, quick)
            fns = [make(n) for n in sizes]
            first = _sample_times(fns, 1)
            reps = _reps_for(max(first), budget=0.02)
            for n, sec in zip(sizes, _sample_times(fns, reps, warm=False)):
                mins.put(("kernel", t, name, n), sec)


def _kernel_tables(mins: _Samples, t: int, quick: bool) -> dict[str, RateTable]:
    names = sorted({k[2] for k in mins if k[:2] == ("kernel", t)})
    return {
        f"{t}/{name}": RateTable(
            tuple(float(n) for n in _kernel_sizes(name, quick)),
            tuple(mins.value(("kernel", t, name, n)) for n in _kernel_sizes(name, quick)),
        )
        for name in names
    }


# --------------------------------------------------------------------------------------
# overheads: the layer at negligible sizes


def _probe_shape(num_experts: int, rows: int = 2) -> tuple[int, int]:
    """(tokens, D = F) of a probe layer (top-1): ``rows`` rows per expert, D =
    ``_PROBE_DIM`` or more when the identity router needs D >= E."""
    d = max(_PROBE_DIM, _PROBE_DIM * math.ceil(num_experts / _PROBE_DIM))
    return rows * num_experts, d


def _probe_layer(
    precision: str,
    num_experts: int,
    *,
    shared: bool,
    capacity: bool,
    parallelize: Any = None,
    rows: int = 2,
) -> Any:
    """The layer's forward and forward + backward closures at negligible sizes (``rows``
    rows per expert); ``parallelize(moe)`` (e.g. ``ExpertParallel``) is applied before
    the first call."""
    from torch_moe.nn import MoE

    tokens, d = _probe_shape(num_experts, rows)
    moe = MoE(
        d,
        d,
        num_experts,
        1,
        shared_hidden_dim=d if shared else 0,
        capacity_factor=1.0 if capacity else None,
        precision=precision,
        dtype=torch.bfloat16,
    )
    with torch.no_grad():  # token t -> expert t % E: ``rows`` rows per expert
        moe.router.weight.zero_()
        moe.router.weight[:, :num_experts] = 8 * torch.eye(num_experts)
    if parallelize is not None:
        parallelize(moe)
    x = torch.zeros(tokens, d, dtype=torch.bfloat16)
    x[torch.arange(tokens), torch.arange(tokens) % num_experts] = 1
    x.requires_grad_(True)
    grad = torch.randn(tokens, d, dtype=torch.bfloat16)

    def fwd() -> None:
        with torch.no_grad():
            moe(x)

    def fwdbwd() -> None:
        moe.zero_grad(set_to_none=True)
        x.grad = None
        moe(x).backward(grad)

    return fwd, fwdbwd


def _probe_variants(quick: bool) -> list[tuple[str, int, bool, bool]]:
    from torch_moe.quantization import RECIPES

    precisions = ["bf16"] if quick else ["bf16", *sorted(RECIPES)]
    if not quick and fp8_pieces_here():  # the recipes where their GEMMs run the pieces
        precisions += [f"{p}:pieces" for p in sorted(RECIPES)]
    out = [(p, e, False, False) for p in precisions for e in (1, _PROBE_EXPERTS)]
    out += [
        ("bf16", 1, True, False),
        ("bf16", 1, False, True),
        ("bf16", _PROBE_EXPERTS, False, True),
    ]
    return out


def _measure_overheads(mins: _Samples, t: int, quick: bool) -> None:
    with torch.enable_grad():
        variants = _probe_variants(quick)
        for idx in range(0, len(variants), 4):
            batch = variants[idx : idx + 4]
            fns = []
            for p, e, shared, cap in batch:
                precision, _, form = p.partition(":")
                rows = FEW_ROWS + 1 if form == "pieces" else 2
                fns.extend(_probe_layer(precision, e, shared=shared, capacity=cap, rows=rows))
            secs = _sample_times(fns, 3)
            for j, v in enumerate(batch):
                for i, mode in enumerate(("fwd", "fwdbwd")):
                    mins.put(("probe", t, *v, mode), secs[2 * j + i])


def _overheads(mins: _Samples, t: int, quick: bool) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    precisions = sorted({k[2] for k in mins if k[:2] == ("probe", t)})
    g = _PROBE_EXPERTS - 1
    for mode in ("fwd", "fwdbwd"):

        def probe(
            p: str, e: int, shared: bool = False, cap: bool = False, mode: str = mode
        ) -> float:
            return mins.value(("probe", t, p, e, shared, cap, mode))

        for p in precisions:
            per_group = max(0.0, (probe(p, _PROBE_EXPERTS) - probe(p, 1)) / g)
            out[f"{t}/{p}.{mode}"] = (max(0.0, probe(p, 1) - per_group), per_group)
        base1, base_e = probe("bf16", 1), probe("bf16", _PROBE_EXPERTS)
        out[f"{t}/shared.{mode}"] = (max(0.0, probe("bf16", 1, shared=True) - base1), 0.0)
        cap1, cap_e = probe("bf16", 1, cap=True), probe("bf16", _PROBE_EXPERTS, cap=True)
        out[f"{t}/capacity.{mode}"] = (
            max(0.0, cap1 - base1),
            max(0.0, ((cap_e - cap1) - (base_e - base1)) / g),
        )
    return out


# --------------------------------------------------------------------------------------
# links (inside a process group)


def _group_samples(
    fns: list[Callable[[], object]], reps: int, group: Any, device: torch.device | None = None
) -> torch.Tensor:
    """[len(fns), reps] float64: the slowest rank's seconds of each fn in ``reps``
    interleaved rounds (one warm-up call each, a barrier before every call). On a CUDA
    ``device`` (an NCCL group) each call is timed to the end of its work on the device."""
    import torch.distributed as dist

    cuda = device is not None and device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for fn in fns:
        fn()
    times = torch.zeros(len(fns), reps, dtype=torch.float64)
    for r in range(reps):
        for i, fn in enumerate(fns):
            dist.barrier(group=group)
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[i, r] = time.perf_counter() - t0
    times = times.to(device) if cuda else times
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return times.cpu()


def _group_times(
    fns: list[Callable[[], object]], reps: int, group: Any, device: torch.device | None = None
) -> list[float]:
    """Per fn, the median of :func:`_group_samples`."""
    return _group_samples(fns, reps, group, device).median(dim=1).values.tolist()


def _group_time(
    fn: Callable[[], object], reps: int, group: Any, device: torch.device | None = None
) -> float:
    return _group_times([fn], reps, group, device)[0]


_LATENCY_MESSAGES = 64  # messages per peer of the per-message latency probe


def _measure_link(group: Any, quick: bool = False, device: torch.device | None = None) -> Link:
    """The group's alpha-beta (module docstring), on tensors of ``device`` (default: the
    CPU, for gloo; a CUDA device for NCCL)."""
    import torch.distributed as dist

    dev = device or torch.device("cpu")

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    peers = [p for p in range(world) if p != rank]
    granks = [dist.get_global_rank(group, p) if group is not None else p for p in peers]

    def messages(n: int, nbytes: int) -> Callable[[], object]:
        """``nbytes`` to and from every peer, in ``n`` point-to-point messages each way."""
        per = max(1, nbytes // 4 // n)
        send = {g: [torch.ones(per, device=dev) for _ in range(n)] for g in granks}
        recv = {g: [torch.empty(per, device=dev) for _ in range(n)] for g in granks}

        def run() -> None:
            ops_ = []
            for g in granks:
                for s, r in zip(send[g], recv[g]):
                    ops_.append(dist.P2POp(dist.irecv, r, g, group=group))
                    ops_.append(dist.P2POp(dist.isend, s, g, group=group))
            for w in dist.batch_isend_irecv(ops_):
                w.wait()

        return run

    # the cost of a message: the same 1 MB per peer in 64 messages instead of one (the
    # segment exchange sends one message per (rank, expert) block), the median of the
    # rounds' paired differences (the two calls run back to back in each round, so a slow
    # spell of the host moves both: 1 vs 16 messages and a difference of medians varied
    # 0-185 us between calibrations on a 2-vCPU VM, 1 vs 64 paired 32-90 us)
    reps = 3 if quick else 9
    fns = [messages(1, 2**20), messages(_LATENCY_MESSAGES, 2**20)]
    pair = _group_samples(fns, reps, group, dev)
    extra = (pair[1] - pair[0]).median().item()
    latency = max(0.0, extra / ((_LATENCY_MESSAGES - 1) * len(peers)))

    def a2a(nbytes: int) -> Callable[[], object]:
        per = max(1, nbytes // 4 // world)
        x = torch.randn(per * world, device=dev)
        y = torch.empty_like(x)
        return lambda: dist.all_to_all_single(y, x, group=group)

    coll = _group_time(a2a(world * 8 * 4), reps, group, dev)
    rates = []
    for nbytes in (2**20, 2**22) if quick else (2**20, 2**23, 2**25):
        t = _group_time(a2a(nbytes), 3 if quick else 5, group, dev)
        rates.append(nbytes * (world - 1) / world / max(t - coll, 1e-9))
    bandwidth = statistics.median(rates)
    backend = dist.get_backend(group)
    return Link(
        bandwidth,
        latency,
        coll,
        f"measured: {backend}, world {world} (all_to_all_single 1-{4 if quick else 32} MB; "
        f"1 MB per peer in 1 vs {_LATENCY_MESSAGES} point-to-point messages)",
    )


_EXCHANGE_EXPERTS = (2, _PROBE_EXPERTS)  # local experts of the EP probes
_HIER_NODE_SIZE = 2  # ranks per "node" of the hierarchical exchange's probe


def _measure_exchange_overhead(
    group: Any, hw: Hardware, rounds: int = 9
) -> dict[str, tuple[float, float, float]]:
    """The EP layer's host seconds beyond the model (``Link.exchange_overhead``).

    The layer at the overhead probes' negligible sizes under ``ExpertParallel`` with 2
    and 16 local experts, 1 and 2 chunks, both exchanges (and, in a group of four ranks
    or more, the two-stage all_to_all over "nodes" of two ranks, one chunk), forward and
    forward + backward (the slowest rank's median of interleaved rounds), less
    :func:`predict` of the same workload without this term; fitted as ``fixed +
    per_expert * El + (C - 1) * per_chunk`` (``_fit_exchange_overhead``). Collective.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from torch_moe.distributed import ExpertParallel
    from torch_moe.perf._model import predict
    from torch_moe.perf._workload import MoEWorkload

    world = dist.get_world_size(group)
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None  # initialized: calibrate checked
    mesh = DeviceMesh.from_group(pg, "cpu")
    variants: list[tuple[str, int, int]] = [
        (ex, el, c) for ex in ("p2p", "all_to_all") for el in _EXCHANGE_EXPERTS for c in (1, 2)
    ]
    if world >= 2 * _HIER_NODE_SIZE and world % _HIER_NODE_SIZE == 0:
        # the two-stage exchange: its own collectives, subgroups and split-matrix gather
        variants += [("hierarchical", el, 1) for el in _EXCHANGE_EXPERTS]
    fns: list[Callable[[], object]] = []
    with torch.enable_grad():
        for ex, el, c in variants:
            hier = ex == "hierarchical"
            style = ExpertParallel(
                num_chunks=c,
                exchange="p2p" if ex == "p2p" else "all_to_all",
                node_size=_HIER_NODE_SIZE if hier else None,
            )
            fns.extend(
                _probe_layer(
                    "bf16",
                    el * world,
                    shared=False,
                    capacity=False,
                    parallelize=lambda m, style=style: parallelize_module(m, mesh, style),
                )
            )
        med = _group_times(fns, rounds, group)  # the warm-up builds the exchange plans
    residual: dict[tuple[str, int, int, str], float] = {}
    for j, (ex, el, c) in enumerate(variants):
        for i, mode in enumerate(("fwd", "fwdbwd")):
            tokens, d = _probe_shape(el * world)  # _probe_layer's geometry
            hier = ex == "hierarchical"
            w = MoEWorkload(
                tokens,
                d,
                d,
                el * world,
                1,
                ep=world,
                nodes=world // _HIER_NODE_SIZE if hier else 1,
                num_chunks=c,
                exchange="p2p" if ex == "p2p" else "all_to_all",
                hierarchical=hier,
                backward=mode == "fwdbwd",
            )
            model = predict(w, hw, ranks_on_host=world).time
            residual[(ex, el, c, mode)] = med[2 * j + i] - model
    return _fit_exchange_overhead(residual)


def _fit_exchange_overhead(
    residual: dict[tuple[str, int, int, str], float],
) -> dict[str, tuple[float, float, float]]:
    """``fixed + per_expert * El + (C - 1) * per_chunk`` through the residuals at El in
    ``_EXCHANGE_EXPERTS`` and C in (1, 2), per exchange and mode (keys ``(exchange, El, C,
    mode)``): the line through the two one-chunk points, and the mean extra of a second
    chunk (chunks split the local experts, so a chunk adds exchange calls, not messages);
    a negative coefficient (noise) is clamped to 0."""
    out: dict[str, tuple[float, float, float]] = {}
    lo, hi = _EXCHANGE_EXPERTS
    # the hierarchical exchange is probed with one chunk only: its extra chunk costs what
    # the flat all_to_all's does (each chunk one more exchange of either kind)
    for ex, mode in sorted({(k[0], k[3]) for k in residual}, key=lambda k: k[0] == "hierarchical"):
        r = {(el, c): v for (e, el, c, m), v in residual.items() if (e, m) == (ex, mode)}
        per_expert = max(0.0, (r[hi, 1] - r[lo, 1]) / (hi - lo))
        fixed = max(0.0, r[lo, 1] - lo * per_expert)
        if (lo, 2) in r:
            chunk = max(0.0, 0.5 * ((r[lo, 2] - r[lo, 1]) + (r[hi, 2] - r[hi, 1])))
        else:
            chunk = out.get(f"all_to_all.{mode}", (0.0, 0.0, 0.0))[2]
        out[f"{ex}.{mode}"] = (fixed, per_expert, chunk)
    return out


# --------------------------------------------------------------------------------------
# entry point


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torch_moe" / "perf"


def _copy_bandwidth() -> float:
    src = torch.ones(64 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = _sample_times([lambda: dst.copy_(src)], 5)[0]
    return 2 * src.numel() / t


def _memory_capacity() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 0.0


def _measure_compute(
    threads: tuple[int, ...],
    quick: bool,
    passes: int,
    budget: float,
    statistic: Statistic,
    interleave: Callable[[int], object] | None = None,
) -> Hardware:
    with _using_statistic(statistic):
        return _measure_compute_with(threads, quick, passes, budget, statistic, interleave)


def _measure_compute_with(
    threads: tuple[int, ...],
    quick: bool,
    passes: int,
    budget: float,
    statistic: Statistic,
    interleave: Callable[[int], object] | None = None,
) -> Hardware:
    from torch_moe._ops.grouped_mm import cpu_compute_dtype

    cores = _cores()
    old = torch.get_num_threads()
    cdt = cpu_compute_dtype(torch.bfloat16)
    gemm_keys: list[tuple[str, torch.dtype | None]] = [
        ("bf16", torch.bfloat16),
        ("fp32", torch.float32),
    ]
    if fp8_pieces_here():
        gemm_keys.append(("e4m3", None))
    mins = _Samples()
    start = time.perf_counter()
    away = 0.0  # seconds spent in ``interleave``: not the calibration's budget
    _GATE.left = 0.15 * budget
    _GATE.settle(min(3.0, 0.03 * budget))
    try:
        for done in range(passes):
            for t in threads:
                torch.set_num_threads(t)
                # the overhead probes are short and noise-sensitive: sampled after every
                # table, so their minimum spans the whole pass
                for key, dtype in gemm_keys:
                    for layout in LAYOUTS:
                        _measure_gemms(mins, t, layout, key, dtype, quick)
                        if not quick:
                            _measure_overheads(mins, t, quick)
                _measure_swiglu(mins, t, quick)
                _measure_overheads(mins, t, quick)
                _measure_kernels(mins, t, cdt, quick)
                _measure_overheads(mins, t, quick)
            if interleave is not None:
                torch.set_num_threads(old)
                saved_gate = (_GATE.max_wait, _GATE.left)
                t0 = time.perf_counter()
                interleave(done)
                away += time.perf_counter() - t0
                _GATE.max_wait, _GATE.left = saved_gate
            elapsed = time.perf_counter() - start - away
            if elapsed / (done + 1) * (done + 2) > budget:
                break  # another pass would not fit the budget
        torch.set_num_threads(max(threads))
        bandwidth = _copy_bandwidth()
    finally:
        torch.set_num_threads(old)
    gemm_tables = {
        f"{t}/{key}/{layout}": _gemm_table(mins, t, layout, key, quick)
        for t in threads
        for key, _ in gemm_keys
        for layout in LAYOUTS
    }
    for t in threads:
        gemm_tables[f"{t}/bf16/swiglu.fwdbwd"] = _swiglu_table(mins, t, "fwdbwd", quick)
    kernel_tables: dict[str, RateTable] = {}
    overheads: dict[str, tuple[float, float]] = {}
    for t in threads:
        kernel_tables.update(_kernel_tables(mins, t, quick))
        overheads.update(_overheads(mins, t, quick))
    top = max(threads)
    gemm_rate = {key: gemm_tables[f"{top}/{key}/NT"].rate() for key in ("bf16", "fp32")}
    local = Link(
        bandwidth / 2,
        0.0,
        0.0,
        "default: half the copy bandwidth, no latency (no process group was measured)",
    )
    return Hardware(
        name=f"cpu:{_cpu_model()} [{cpu_isa()}]",
        kind="cpu",
        gemm_rate=gemm_rate,
        mem_bandwidth=bandwidth,
        memory_capacity=_memory_capacity(),
        intra_link=local,
        inter_link=local,
        gemm_tables=gemm_tables,
        kernel_tables=kernel_tables,
        overheads=overheads,
        gpus_per_node=cores,
        host_cores=cores,
        threads=tuple(threads),
        comm_compute_share=1.0,
        reference_probe=_GATE.best,
        sources={
            "gemm": f"measured: mm_into grid, threads {list(threads)}"
            + (", the e4m3 pieces' grid" if len(gemm_keys) > 2 else "")
            + (" (quick)" if quick else "")
            + f", {statistic} over {done + 1} pass(es)"
            + (" interleaved with the caller's work" if interleave is not None else ""),
            "kernels": "measured: the library's elementwise kernels",
            "overheads": "measured: MoE layer at D=F=32, 1 and 16 experts, 2 rows each",
            "mem_bandwidth": "measured: 64 MB copy",
            "comm_compute_share": "default: gloo copies on the compute cores (1.0)",
        },
        fingerprint=machine_fingerprint(),
    )


def calibrate(
    *,
    threads: tuple[int, ...] | None = None,
    quick: bool = False,
    passes: int = 2,
    budget_s: float = 55.0,
    cache: bool = True,
    refresh: bool = False,
    group: Any = None,
    statistic: Statistic = "median",
    interleave: Callable[[int], object] | None = None,
    device: torch.device | str | None = None,
) -> Hardware:
    """Measure this machine (see the module docstring) and return its :class:`Hardware`.

    Args:
        threads: torch thread counts to measure (default: this process's
            ``torch.get_num_threads()``). A rank of an R-rank job on this host runs with
            ``cores // R`` threads: to predict EP on this host from one process, measure
            those too, e.g. ``threads=(1, 2)`` on 2 cores (twice the time).
        quick: a coarse grid, fewer kernels, a shorter link and EP probe (a few seconds;
            for tests and smoke runs).
        passes: measure everything this many times (seconds apart) and keep each
            figure's statistic over them, as long as the next pass fits ``budget_s``.
        budget_s: wall-clock budget of the compute measurements (the link adds ~3 s).
        cache: reuse a measurement of this machine (per process, then on disk).
        refresh: measure again even when cached (the link too).
        group: the process group whose link to measure (default: the world group when
            ``torch.distributed`` is initialized with more than one rank; collective).
        statistic: ``"median"`` (the sustained state: predicts the steps a job on this
            machine measures, neighbours included) or ``"min"`` (the undisturbed machine:
            for a quiet host or to compare machines); module docstring.
        interleave: called as ``interleave(i)`` after pass ``i`` of the compute
            measurements (and before the next): run a share of the work whose time the
            calibration is to predict there, so that the passes and that work sample the
            same stretch of a host whose speed drifts (a shared VM: the same GEMM measured
            161 and 199 GFLOP/s in the calibrations of two back-to-back runs; that it
            narrows the model's error there is not shown). Its time does not
            count against ``budget_s``. Implies a fresh measurement (the result is
            still cached for later calls); with ``passes=N`` it is called up to N times.

        device: an accelerator to measure instead of the CPU (``"cuda"``, ``"cuda:1"``):
            its GEMM, elementwise-kernel, copy and launch rates
            (:mod:`torch_moe.perf._calibrate_gpu`; a ``Hardware(kind="gpu")`` whose tile
            rows and links come from the GPU's datasheet preset). ``threads``, ``passes``,
            ``budget_s``, ``statistic`` and ``interleave`` are CPU options and must keep
            their defaults then; inside a process group (NCCL) the link is measured on
            tensors of ``device``, its alpha-beta alone (the EP host term is a CPU one).

    Takes up to ``budget_s`` (55 s) the first time on 2 cores (``quick``: a few seconds);
    later calls in the process or on the machine read the cache. An accelerator takes
    about 10 s (most of it compiling the Triton kernels of the recipes).
    """
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"calibrate: device must name a torch device, got {device!r}") from e
        if dev.type != "cpu":
            given = dict(threads=threads, passes=passes, budget_s=budget_s,
                         statistic=statistic, interleave=interleave)  # fmt: skip
            defaults = inspect.signature(calibrate).parameters
            changed = [k for k, v in given.items() if v != defaults[k].default]
            if changed:
                raise ValueError(
                    f"calibrate: {', '.join(changed)} apply to the CPU only, not to "
                    f"device={device!r}"
                )
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise RuntimeError(
                    f"calibrate: device={device!r} but torch.cuda.is_available() is False"
                )
            from torch_moe.perf._calibrate_gpu import calibrate_device

            measured = calibrate_device(dev, quick=quick, cache=cache, refresh=refresh)
            fp_key = repr(sorted(measured.fingerprint.items()))
            return _with_group_link(measured, group, quick, fp_key, refresh or not cache, dev)
    if threads is None:
        threads = (torch.get_num_threads(),)
    if not threads or any(not isinstance(t, int) or t < 1 for t in threads):
        raise ValueError(f"calibrate: threads must be positive integers, got {threads!r}")
    if statistic not in ("median", "min"):
        raise ValueError(f"calibrate: statistic must be 'median' or 'min', got {statistic!r}")
    threads = tuple(sorted(set(threads)))
    fp = machine_fingerprint()
    spec = (sorted(fp.items()), threads, quick, passes, statistic)
    key = hashlib.sha256(repr(spec).encode()).hexdigest()[:20]
    if interleave is not None and not callable(interleave):
        raise TypeError(f"calibrate: interleave must be callable, got {interleave!r}")
    refresh = refresh or interleave is not None
    hw = _cached(
        key,
        lambda: _measure_compute(threads, quick, passes, budget_s, statistic, interleave),
        cache,
        refresh,
    )
    return _with_group_link(hw, group, quick, key, refresh or not cache)


def _cached(key: str, measure: Callable[[], Hardware], cache: bool, refresh: bool) -> Hardware:
    """The :class:`Hardware` stored under ``key`` (in this process, else on disk), or
    ``measure()``'s on a miss, on ``refresh`` or without ``cache``; stored (the file
    replaced whole) unless ``cache`` is off."""
    hw = None if refresh or not cache else _PROCESS_CACHE.get(key)
    path = _cache_dir() / f"{key}.json"
    if hw is None and cache and not refresh and path.exists():
        try:
            hw = Hardware.from_json(path.read_text())
        except (ValueError, KeyError, TypeError):
            hw = None
    if hw is None:
        hw = measure()
        if cache:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(hw.to_json())
                tmp.replace(path)
            except OSError:
                pass
    if cache:
        _PROCESS_CACHE[key] = hw
    return hw


def _with_group_link(
    hw: Hardware,
    group: Any,
    quick: bool,
    hw_key: str,
    refresh: bool,
    device: torch.device | None = None,
) -> Hardware:
    """``hw`` with the process group's measured link, where there is a group of 2+ ranks."""
    link = _group_link(group, hw, quick, hw_key, refresh, device)
    if link is None:
        return hw
    return dataclasses.replace(
        hw, intra_link=link, inter_link=link, sources={**hw.sources, "links": link.source}
    )


def _group_link(
    group: Any,
    hw: Hardware,
    quick: bool = False,
    hw_key: str = "",
    refresh: bool = False,
    device: torch.device | None = None,
) -> Link | None:
    """The group's link, measured once per process for each (world size, backend, quick,
    compute calibration), or again on ``refresh``: its EP host term is a residual of that
    calibration's model (CPU hosts; an accelerator's link is its alpha-beta alone,
    measured on tensors of ``device``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(group) < 2:
        return None
    world = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    cached = None if refresh else _LINK_CACHE.get((world, backend, quick, hw_key))
    if cached is None:
        cached = _measure_link(group, quick, device)
        if hw.kind == "cpu":  # the rest of the EP step, given this link
            probe_hw = dataclasses.replace(hw, intra_link=cached, inter_link=cached)
            overhead = _measure_exchange_overhead(group, probe_hw, rounds=3 if quick else 9)
            cached = dataclasses.replace(
                cached,
                exchange_overhead=overhead,
                source=cached.source + "; EP host work: the EP layer at D=F=max(32, E), 2/16 "
                "local experts, 1/2 chunks, less the model",
            )
        _LINK_CACHE[(world, backend, quick, hw_key)] = cached
    return cached
