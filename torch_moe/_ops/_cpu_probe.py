"""Measured CPU decisions: which dtype, operand layout and kernel the CPU paths use.

Design note. How fast a CPU multiplies half-precision matrices differs by orders of
magnitude between x86 machine classes (rates: benchmarks/results/ops_cpu_202612.md).
Without native bf16/fp16 GEMMs (AVX2) oneDNN emulates them, several times slower than
fp32 and slowest with both operands row-major, so an fp32 upcast wins; with AVX512-BF16
or AMX, bf16 runs several times faster than fp32 in about every layout, and an upcast or
a per-call copy of a weight into "the fast layout" only adds work. So no constant
measured on one machine decides: each choice is timed on the running machine the first
time a kernel needs it.

A probe times every candidate on small operands of the shape class at hand, on one
thread and in that thread's CPU time (candidates interleaved within a round, the minimum
over a few rounds: on a shared machine a multi-threaded wall-clock timing swings with
other processes' load, one thread's CPU time hardly does), and keeps the default unless an alternative is faster by a margin, so
that near-ties do not flip between runs. A probe takes a few to a few tens of
milliseconds (``_PROBE_BUDGET_S`` bounds its rounds); its result is cached per process
and, when ``TORCH_MOE_CPU_PROBE_CACHE`` names a JSON file, on disk keyed by the machine
(CPU model and flags, torch version, thread count), which also makes it reproducible.
The exceptions are ``few_gemm`` and ``threads_mm``, whose candidates scale differently
with threads (the native kernels share all groups' work out in one parallel region;
oneDNN splits each small GEMM by itself, and gains little from a second thread at a few
rows): they are timed on the caller's threads, in wall time (the minimum over rounds),
so that a two-thread process does not take a one-thread ranking (at 16 rows per expert
they differ); ``threads_mm`` is asked on one thread only where the threaded kernel splits
rows (``row_split``, below), runs the native GEMM (``gemm_kernel``) or upcasts a half
dtype in its threads' scratch (``half_gemm`` ``fp32``: the loop converts each group's
operands into new tensors), and its key names the threads (and ends in ``:gemm`` with
the native GEMM).

``row_split`` is the one decision about a library's internals: whether the threaded
kernel runs a group's forward GEMM as several GEMMs of at most 256 rows where oneDNN would
cut its rows into blocks of under 64 (``csrc/grouped_mm_threads_cpu.cpp``: oneDNN 3's
AVX-512 matmul picks the block of 32-256 rows with the least padding, so 481 = 13 x 37
rows run as 13 blocks of 37, 15-40% slower than 480). It is timed, not assumed: on 481
rows, split against not, so that a oneDNN that blocks otherwise (AMX, another version)
keeps its one GEMM.

Decisions. ``<dt>``: bf16 / fp16 / fp32; ``<ab>``: the layouts of ``a @ b`` (n
row-major, t column-major; nt, the one every BLAS takes fastest, is never probed);
``<cls>``: which of m, k, n (a [m, k], b [k, n]) is smallest and whether it is under 128
(``m_small``, ``k_large``...; ``r<r>`` for ``grouped_mm`` at up to 16 rows per group);
``<r>``: the rows (per group for ``swiglu_path``, ``wgrad_a``, ``few_gemm`` and
``grouped_mm``; the tokens for ``router_kernel``, capped at 256) rounded up to a power of
two; ``<e>``: the experts, rounded up to a power of two; ``<k>``, ``<n>``: the weight
gradient's output rows and columns, rounded up to powers of two and capped (``wgrad_a``,
half dtypes multiplied natively only; for ``gemm_kernel`` the rows per group, K and N,
each rounded up to a power of two or 1.5 times one and capped, ``<kind>`` bt / nn / tn:
x @ w^T, x @ w, a weight gradient); ``<b>``: the weight's layout (n / t); ``<g>``: the
busy groups, rounded up to a power of two and clamped to 8-32; ``<t>``: the intra-op threads.

==============================  ====================  ======  ==============================
key                             choices               margin  used by
==============================  ====================  ======  ==============================
``half_gemm:<dt>``              **fp32**, native      10%     ``cpu_compute_dtype``
``layout:<dt>:<ab>:<cls>``      **as_is**, copy_a/b   10%     ``mm_into``, ``mm_cpu``
``few_rows:<dt>:<ab>:m<r>``     **mm**, mv, swap      10%     ``mm_into``, m <= 16 rows
``grouped_mm:<dt>:<ab>:<cls>``  **loop**, torch       5%      ``grouped_mm`` (CPU kernels)
``few_gemm:<dt>:<b>:r<r>:g<g>`` **aten**, native/amx  10%     ``grouped_mm`` (CPU kernels,
                                                              <= 32 rows per group);
                                                              ``grouped_swiglu``'s path
                                                              where half GEMMs upcast
``threads_mm:<dt>:<ab>:<cls>``  aten, **native**      10%     ``grouped_mm``,
                                                              ``grouped_mm_wgrad`` (CPU
                                                              kernels, >= 2 threads, or
                                                              one where ``row_split``
                                                              splits, the native GEMM
                                                              or the upcast runs; the
                                                              key ends in ``:t<t>``)
``row_split:<dt>``              **one**, split        10%     the threaded kernel's
                                                              forward GEMMs (CPU)
``gemm_kernel:<dt>:<kind>:``     aten, **native**      5%      the threaded kernel's
``r<r>:k<k>:n<n>``                                            GEMMs of that kind and
                                                              size (CPU, bf16 on
                                                              AVX512-BF16 or AMX)
``out_stream:<dt>``             **cache**, stream     5%      the native kernels'
                                                              outputs past the L2
                                                              (CPU, where the native
                                                              bf16 GEMM runs)
``router_kernel:<dt>:r<r>:e<e>`` **native**, amx     10%     ``router_logits`` and its
                                                              backward's grad_x (CPU,
                                                              bf16 where AMX is on)
``few_codes:<b>:r<r>``          **pieces**, few       5%      ``scaled_grouped_mm``'s
                                                              FP8 codes in bf16 (CPU,
                                                              groups of <= 256 rows;
                                                              the same bits either way)
``wgrad_a:<dt>:r<r>:k<k>:n<n>`` **as_is**, transpose  5%     ``grouped_mm_wgrad`` (CPU),
                                                              ``grouped_swiglu`` (CPU)
``act_chunk:<dt>``              elements per thread   -       ``grouped_swiglu`` (CPU)
``swiglu_path:<dt>:r<r>``       **loop**, whole       5%      ``grouped_swiglu`` (CPU,
                                                              native half GEMMs)
``act_kernel:<dt>``             **aten**, native      10%     ``grouped_swiglu``, ``swiglu``
                                                              (CPU; native where it built)
``act_table:<dt>``              **compute**, table    10%     the native SwiGLU kernels
                                                              (CPU, half h: silu and
                                                              sigmoid of the gate looked
                                                              up, the same bits)
==============================  ====================  ======  ==============================

(default in bold: kept unless the other is faster by the margin; the act chunk is the
largest candidate within 10% of the fastest.)

Forcing (tests, experiments): :func:`force` (a context manager) or the environment
variable ``TORCH_MOE_CPU_PROBE``, e.g. ``half_gemm=fp32,layout=copy_b``. A name without
``:`` forces every key of that kind, a full key forces that key only; a forced choice is
never measured. :func:`decisions` lists what was decided and how (measured, forced, disk).

Another machine class on this one: oneDNN, MKL and ATen honour ISA caps, e.g.
``ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2`` makes an
AVX512-BF16 CPU multiply bf16 at an AVX2 machine's rate. :func:`cpu_isa` reports the capped
class and :func:`machine_key` (the disk cache's key) carries it, so the probe measures and
caches the capped machine as a machine of its own. The key also carries a digest of the
candidates' sources (the ops and the native kernels): a disk cache written before a kernel
changed is not read as the changed kernel's.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

__all__ = [
    "ENV_CACHE",
    "ENV_FORCE",
    "ISA_CAP_ENV",
    "KINDS",
    "cpu_isa",
    "decide",
    "decisions",
    "force",
    "isa_cap",
    "machine_key",
    "reset",
]

ENV_FORCE = "TORCH_MOE_CPU_PROBE"
ENV_CACHE = "TORCH_MOE_CPU_PROBE_CACHE"
KINDS = (
    "half_gemm",
    "layout",
    "few_rows",
    "grouped_mm",
    "wgrad_a",
    "act_chunk",
    "swiglu_path",
    "act_kernel",
    "act_table",
    "few_gemm",
    "threads_mm",
    "row_split",
    "gemm_kernel",
    "out_stream",
    "router_kernel",
    "few_codes",
)
_PROBE_BUDGET_S = 0.1  # rounds stop once a probe has run this long (after two rounds)
_MAX_ROUNDS = 7
T = TypeVar("T")
_MISSING = object()
_MEMO_MAX = 4096

_lock = threading.RLock()
_cache: dict[str, tuple[str, str]] = {}  # key -> (choice, how)
_forced: list[dict[str, str]] = []  # force() stack, innermost last
_env_forced: dict[str, str] | None = None
# hot-path lookups, one table per force() state (a benchmark or test that enters the same
# force() every step finds its answers again); reset() clears them all
_MEMO_STATES_MAX = 64
_memos: dict[tuple[object, ...], dict[tuple[object, ...], Any]] = {}
_memo: dict[tuple[object, ...], Any] = _memos.setdefault((), {})


def _select_memo() -> None:
    """Point ``_memo`` at the table of the current force() stack (under ``_lock``)."""
    global _memo
    state = tuple(tuple(sorted(table.items())) for table in _forced)
    if state not in _memos and len(_memos) >= _MEMO_STATES_MAX:
        _memos.clear()
    _memo = _memos.setdefault(state, {})


# --------------------------------------------------------------------------------------
# the machine


def _cpuinfo() -> tuple[str, set[str]]:
    """(CPU model name, ISA flags) from /proc/cpuinfo, else platform's processor string."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


ISA_CAP_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
_ISA_ORDER = ("other", "AVX2", "AVX512", "AVX512-BF16", "AMX")


def _hardware_isa() -> str:
    _, flags = _cpuinfo()
    if not flags:
        cpu = torch.backends.cpu.get_cpu_capability()
        return {"AVX512": "AVX512", "AVX2": "AVX2"}.get(cpu, "other")
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    if "avx512f" in flags:
        return "AVX512"
    if "avx2" in flags:
        return "AVX2"
    return "other"


def isa_cap() -> tuple[str, str] | None:
    """``(variable, ISA class)`` where the environment caps the ISA that oneDNN (the half
    GEMMs) uses, e.g. ``ONEDNN_MAX_CPU_ISA=AVX2``; None where it does not."""
    for name in ISA_CAP_ENV:
        value = os.environ.get(name, "").strip().upper()
        if not value or value in ("ALL", "DEFAULT"):
            continue
        if value.startswith(("AVX512_CORE_AMX", "AVX10")):
            return name, "AMX"
        if value.startswith(("AVX512_CORE_BF16", "AVX512_CORE_FP16")):
            return name, "AVX512-BF16"
        if value.startswith("AVX512"):
            return name, "AVX512"
        if value.startswith("AVX2"):
            return name, "AVX2"
        return name, "other"
    return None


def cpu_isa() -> str:
    """The widest GEMM-relevant x86 ISA the GEMMs may use here: AMX, AVX512-BF16, AVX512,
    AVX2 or other (from the kernel's CPU flags, or torch's CPU capability on other
    systems), capped by ``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA`` where set (see
    :func:`isa_cap`)."""
    isa, cap = _hardware_isa(), isa_cap()
    if cap is not None and _ISA_ORDER.index(cap[1]) < _ISA_ORDER.index(isa):
        return cap[1]
    return isa


def package_sources(*patterns: str) -> list[Path]:
    """The package's files matching the glob ``patterns`` (relative to the package root:
    ``"csrc/*.cpp"``, ``"nn/modules/moe.py"``), as relative paths, sorted."""
    root = Path(__file__).parents[1]
    return sorted({p.relative_to(root) for pattern in patterns for p in root.glob(pattern)})


def sources_digest(files: Iterable[Path]) -> str:
    """A digest of package files (paths relative to the package root): their names and
    bytes, an unreadable one skipped. What a measurement of the code keys on (a decision
    or a rate measured of a kernel since rewritten is not the rewritten one's)."""
    root = Path(__file__).parents[1]
    h = hashlib.sha256()
    for rel in files:
        try:
            h.update(str(rel).encode() + (root / rel).read_bytes())
        except OSError:
            continue
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _sources_digest() -> str:
    """The probe's candidates' code: the ops' Python and the native kernels' sources."""
    return sources_digest(package_sources("_ops/*.py", "csrc/*.cpp", "csrc/*.h"))


def machine_key() -> str:
    """What a measured decision depends on besides the shapes: CPU, the ISA caps, torch,
    threads, the candidates' sources."""
    model, flags = _cpuinfo()
    digest = hashlib.sha1(" ".join(sorted(flags)).encode()).hexdigest()[:12]
    caps = f"{cpu_isa()}/aten {torch.backends.cpu.get_cpu_capability()}"
    threads = torch.get_num_threads()
    return (
        f"{model}|{digest}|{caps}|torch {torch.__version__}|threads {threads}"
        f"|sources {_sources_digest()}"
    )


# --------------------------------------------------------------------------------------
# forcing


def _parse(spec: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, choice = item.partition("=")
        if not sep or not name.strip() or not choice.strip():
            raise ValueError(
                f"{ENV_FORCE}: expected comma-separated name=choice items, got {item!r} in {spec!r}"
            )
        _check_name(name.strip(), ENV_FORCE, choice.strip())
        out[name.strip()] = choice.strip()
    return out


_CHOICES = {
    "half_gemm": ("fp32", "native"),
    "layout": ("as_is", "copy_a", "copy_b"),
    "few_rows": ("mm", "mv", "swap"),
    "grouped_mm": ("loop", "torch"),
    "wgrad_a": ("as_is", "transpose"),
    "swiglu_path": ("loop", "whole"),
    "act_kernel": ("aten", "native"),
    "act_table": ("compute", "table"),
    "few_gemm": ("aten", "native", "amx"),
    "threads_mm": ("aten", "native"),
    "row_split": ("one", "split"),
    "gemm_kernel": ("aten", "native"),
    "out_stream": ("cache", "stream"),
    "router_kernel": ("native", "amx"),
    "few_codes": ("pieces", "few"),
}


def _check_name(name: str, where: str, choice: str | None = None) -> None:
    kind = name.split(":")[0]
    if kind not in KINDS:
        raise ValueError(f"{where}: unknown decision {name!r}; kinds are {KINDS}")
    if choice is None:
        return
    valid = choice in _CHOICES[kind] if kind in _CHOICES else choice.isdigit() and int(choice) > 0
    if not valid:
        expected = _CHOICES.get(kind, "a positive int (elements)")
        raise ValueError(f"{where}: {name}={choice!r} is not a choice of {kind}: {expected}")


def _forced_choice(key: str) -> str | None:
    global _env_forced
    if _env_forced is None:
        _env_forced = _parse(os.environ.get(ENV_FORCE, ""))
    kind = key.split(":")[0]
    for table in (*reversed(_forced), _env_forced):
        for name in (key, kind):
            if name in table:
                return table[name]
    return None


@contextlib.contextmanager
def force(choices: Mapping[str, str] | None = None, /, **kinds: str) -> Iterator[None]:
    """Force decisions inside the block: ``force(half_gemm="fp32", layout="as_is")`` or
    ``force({"layout:bf16:nn:m_small": "copy_b"})``; innermost wins, nothing is measured."""
    table = {name: str(choice) for name, choice in {**(choices or {}), **kinds}.items()}
    for name, choice in table.items():
        _check_name(name, "force", choice)
    with _lock:
        _forced.append(table)
        _select_memo()
    try:
        yield
    finally:
        with _lock:
            del _forced[next(i for i, t in enumerate(_forced) if t is table)]
            _select_memo()


def memo(key: tuple[object, ...], compute: Callable[[], T]) -> T:
    """A hot path's answer derived from decisions (``key`` names it and everything it
    depends on besides them), computed once per :func:`force` state (measured decisions
    never change until :func:`reset`): a kernel asks per call, a lookup costs a dict
    access."""
    hit = _memo.get(key, _MISSING)
    if hit is _MISSING:
        if len(_memo) >= _MEMO_MAX:  # keys carry shapes: bounded under varying batches
            _memo.clear()
        hit = _memo[key] = compute()
    return hit


def reset(env: bool = True) -> None:
    """Forget the measured decisions of this process (and re-read ``TORCH_MOE_CPU_PROBE``)."""
    global _env_forced
    with _lock:
        _cache.clear()
        _memos.clear()
        _select_memo()
        if env:
            _env_forced = None


# --------------------------------------------------------------------------------------
# measuring


def _disk_load(key: str) -> str | None:
    path = os.environ.get(ENV_CACHE)
    if not path:
        return None
    try:
        with open(path) as f:
            entry = json.load(f).get(machine_key(), {}).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return entry if isinstance(entry, str) else None


def _disk_store(key: str, choice: str) -> None:
    path = os.environ.get(ENV_CACHE)
    if not path:
        return
    try:
        with open(path) as f:
            table = json.load(f)
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    table.setdefault(machine_key(), {})[key] = choice
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Probes time one thread: on a shared machine a parallel region waits for its slowest
    thread, so a multi-threaded timing swings with other processes' load (every call of a
    round can stall for a scheduler slice), while a single thread's minimum over rounds
    is stable; the ratios between candidates are what a decision needs."""
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


@contextlib.contextmanager
def _all_threads() -> Iterator[None]:
    """Probes of :func:`decide` with ``threads``: the caller's threads, timed in wall time
    (a thread's CPU time would leave out the others' share)."""
    global _wall_clock
    _wall_clock = torch.get_num_threads() > 1
    try:
        yield
    finally:
        _wall_clock = False


def cycled(
    sets: Sequence[T],
    runs: Mapping[str, Callable[[T], object]],
    evict: Callable[[T], object] | None = None,
) -> dict[str, Callable[[], None]]:
    """Candidates for :func:`time_candidates`: each calls its function of ``runs`` on the
    next of ``sets`` in one cycle that all of them share, so that every call finds its
    operands as long out of use as any other's (``len(sets)`` calls earlier) and not all in
    cache. Cycles of their own, in step, would hand every candidate but the first of a
    round the operands that the first had just loaded: timed warm against a cold one
    (15% at the threaded kernel's 256-row probe). ``evict``: called on the next set
    before each call, untimed (a candidate's ``prepare``), where the operands must come
    from memory whatever the cache's size (a last-level cache of hundreds of MiB holds
    every set)."""
    state = {"next": 0}

    def prepare(ev: Callable[[T], object]) -> Callable[[], object]:
        return lambda: ev(sets[state["next"] % len(sets)])

    def candidate(run: Callable[[T], object]) -> Callable[[], None]:
        def call() -> None:
            s = sets[state["next"] % len(sets)]
            state["next"] += 1
            run(s)

        if evict is not None:
            call.prepare = prepare(evict)  # type: ignore[attr-defined]
        return call

    return {name: candidate(run) for name, run in runs.items()}


def time_candidates(
    candidates: Mapping[str, Callable[[], object]], budget_s: float = _PROBE_BUDGET_S
) -> dict[str, float]:
    """Min seconds per call of each candidate: one warm-up call each, then rounds (each
    candidate once per round) until ``_MAX_ROUNDS`` or ``budget_s`` of wall time (at
    least two rounds); a candidate's ``prepare`` (if any) runs untimed before each call.
    Timed in the calling thread's CPU time (probes run on one thread): the time other
    processes hold the core is not counted; in wall time inside :func:`_all_threads`."""
    for fn in candidates.values():
        _prepare(fn)
        fn()
    best = dict.fromkeys(candidates, float("inf"))
    start = time.perf_counter()
    for rnd in range(_MAX_ROUNDS):
        for name, fn in candidates.items():
            _prepare(fn)
            t0 = _clock()
            fn()
            best[name] = min(best[name], _clock() - t0)
        if rnd >= 1 and time.perf_counter() - start > budget_s:
            break
    return best


def _prepare(fn: Callable[[], object]) -> None:
    """A candidate's untimed setup before a call (:func:`cycled`'s ``evict``), if any."""
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:
        prepare()


def _clock() -> float:
    return time.thread_time() if _THREAD_CLOCK and not _wall_clock else time.perf_counter()


_wall_clock = False  # set by _all_threads while a probe times several threads


try:  # the thread's CPU time where the OS has a per-thread clock
    time.thread_time()
    _THREAD_CLOCK = torch.get_num_threads() > 0
except (AttributeError, OSError):  # pragma: no cover
    _THREAD_CLOCK = False


def pick(times: Mapping[str, float], default: str, margin: float) -> str:
    """The fastest candidate if it beats ``default`` by more than ``margin`` (a fraction),
    else ``default``."""
    best = min(times, key=lambda name: (times[name], name != default))
    return best if times[best] < times[default] * (1 - margin) else default


def decide(
    key: str,
    measure: Callable[[], Mapping[str, float]],
    default: str,
    margin: float = 0.1,
    choose: Callable[[Mapping[str, float]], str] | None = None,
    threads: bool = False,
) -> str:
    """The choice for ``key``: forced, cached (process, then disk), or measured now.

    ``measure()`` returns seconds per candidate (see :func:`time_candidates`); the choice
    is ``choose(times)`` if given, else :func:`pick` with ``default`` and ``margin``.
    ``threads``: measured on the caller's threads in wall time, not on one thread.
    """
    forced = _forced_choice(key)
    if forced is not None:
        return forced
    hit = _cache.get(key)
    if hit is not None:
        return hit[0]
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit[0]
        choice = _disk_load(key)
        how = "disk"
        if choice is None:
            from torch.utils._python_dispatch import _disable_current_modes

            # plain tensors, timed as they run: no dispatch mode or autograd; one thread
            # unless the candidates' ranking depends on the threads
            how_timed = _all_threads() if threads else _one_thread()
            with _disable_current_modes(), torch.no_grad(), how_timed:
                times = measure()
            choice = choose(times) if choose is not None else pick(times, default, margin)
            how = "measured: " + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in times.items())
            _disk_store(key, choice)
        _cache[key] = (choice, how)
        return choice


def known(key: str) -> str | None:
    """The choice for ``key`` where it is forced or already made (this process, or the disk
    cache), else None: nothing measured (a question about other threads than the
    caller's, which a measurement here could not answer)."""
    forced = _forced_choice(key)
    if forced is not None:
        return forced
    hit = _cache.get(key)
    return hit[0] if hit is not None else _disk_load(key)


def decisions() -> dict[str, str]:
    """Every decision this process made so far: ``{key: "choice (how)"}``."""
    return {key: f"{choice} ({how})" for key, (choice, how) in sorted(_cache.items())}


# --------------------------------------------------------------------------------------
# the GEMM probes


def _dt(dtype: torch.dtype) -> str:
    return {
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float32: "fp32",
        torch.float64: "fp64",
    }.get(dtype, str(dtype).removeprefix("torch."))


_SMALL = 128  # a GEMM dim under this is "small" (one expert's few rows)
_PROBE_DIM = 512  # the other dims of a probe GEMM
_PROBE_SMALL = {True: 64, False: 256}  # the smallest dim of a probe GEMM, per class
_OPERAND_SETS = 3  # distinct operands cycled through, so that not every call hits in cache


def transposed(t: torch.Tensor) -> bool:
    """Column-major (unit stride down the rows) operand, in its last two dims."""
    return t.stride(-2) == 1 and t.stride(-1) >= max(1, t.shape[-2])


def layout_of(a: torch.Tensor, b: torch.Tensor) -> str:
    """``"nt"`` etc.: n for a row-major operand of ``a @ b``, t for a column-major one."""
    return ("t" if transposed(a) else "n") + ("t" if transposed(b) else "n")


def shape_class(m: int, k: int, n: int) -> str:
    """Which of m, k, n is smallest and whether it is under ``_SMALL`` (128): ``"k_small"``,
    ``"m_large"``..."""
    dim, size = min(zip("mkn", (m, k, n)), key=lambda p: p[1])
    return f"{dim}_small" if size < _SMALL else f"{dim}_large"


def _probe_shape(cls: str) -> tuple[int, int, int]:
    small = _PROBE_SMALL[cls.endswith("_small")]
    return tuple(small if d == cls[0] else _PROBE_DIM for d in "mkn")  # type: ignore[return-value]


def _operand(rows: int, cols: int, col_major: bool, dtype: torch.dtype) -> torch.Tensor:
    if col_major:
        return torch.randn(cols, rows).to(dtype).t()
    return torch.randn(rows, cols).to(dtype)


_Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a, b, out of a probe's mm


def _other_layout(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous() if transposed(t) else t.t().contiguous().t()


def _measure_half_gemm(dtype: torch.dtype) -> dict[str, float]:
    m, k, n = 128, _PROBE_DIM, _PROBE_DIM
    sets = [
        (_operand(m, k, False, dtype), _operand(k, n, True, dtype), torch.empty(m, n, dtype=dtype))
        for _ in range(_OPERAND_SETS)
    ]
    return time_candidates(
        cycled(
            sets,
            {
                "native": lambda s: torch.mm(s[0], s[1], out=s[2]),
                "fp32": lambda s: s[2].copy_(torch.mm(s[0].float(), s[1].float())),
            },
        )
    )


def half_gemm(dtype: torch.dtype) -> str:
    return memo((dtype,), lambda: _half_gemm(dtype))


def _half_gemm(dtype: torch.dtype) -> str:
    """``"native"`` if this CPU multiplies ``dtype`` (bf16 / fp16) over 10% faster than the
    fp32 upcast (conversions included), else ``"fp32"`` (also on a near-tie: a CPU whose
    fp16 GEMMs are no faster than fp32 ones may not accumulate them in fp32)."""
    return decide(
        f"half_gemm:{_dt(dtype)}",
        lambda: _measure_half_gemm(dtype),
        default="fp32",
        margin=0.1,
    )


def _measure_layout(dtype: torch.dtype, ab: str, cls: str) -> dict[str, float]:
    m, k, n = _probe_shape(cls)
    sets = [
        (
            _operand(m, k, ab[0] == "t", dtype),
            _operand(k, n, ab[1] == "t", dtype),
            torch.empty(m, n, dtype=dtype),
        )
        for _ in range(_OPERAND_SETS)
    ]

    def run(copy_a: bool, copy_b: bool) -> Callable[[_Operands], None]:
        def fn(s: _Operands) -> None:
            a, b, out = s
            torch.mm(_other_layout(a) if copy_a else a, _other_layout(b) if copy_b else b, out=out)

        return fn

    return time_candidates(
        cycled(
            sets,
            {"as_is": run(False, False), "copy_a": run(True, False), "copy_b": run(False, True)},
        )
    )


def layout(dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor) -> str:
    """For ``a @ b`` in ``dtype``: ``"as_is"``, or ``"copy_a"`` / ``"copy_b"`` to copy that
    operand into the other layout first, if the copy and the multiply together are faster
    by over 10% (measured per layout pair and shape class). Row-major x column-major, the
    layout every BLAS takes fastest, is never copied."""
    (m, k), n = a.shape, b.shape[1]
    ta, tb = transposed(a), transposed(b)
    if not ta and tb:
        return "as_is"
    if m <= k and m <= n:
        memo_key: tuple[object, ...] = (dtype, ta, tb, 0, m < _SMALL)
    elif k <= n:
        memo_key = (dtype, ta, tb, 1, k < _SMALL)
    else:
        memo_key = (dtype, ta, tb, 2, n < _SMALL)
    return memo(memo_key, lambda: _layout(dtype, layout_of(a, b), shape_class(m, k, n)))


def _layout(dtype: torch.dtype, ab: str, cls: str) -> str:
    return decide(
        f"layout:{_dt(dtype)}:{ab}:{cls}",
        lambda: _measure_layout(dtype, ab, cls),
        default="as_is",
        margin=0.1,
    )


FEW_ROWS = 16  # up to this many rows (decode: a few tokens per expert) few_rows decides


MatMulInto = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def _measure_few_rows(
    dtype: torch.dtype, ab: str, rows: int, general: MatMulInto
) -> dict[str, float]:
    k = n = 1024
    sets = [
        (
            _operand(rows, k, ab[0] == "t", dtype),
            _operand(k, n, ab[1] == "t", dtype),
            torch.empty(rows, n, dtype=dtype),
        )
        for _ in range(_OPERAND_SETS)
    ]

    def run(how: str) -> Callable[[_Operands], None]:
        def fn(s: _Operands) -> None:
            a, b, out = s
            if how == "mm":
                general(a, b, out)
            else:
                few_rows_mm(a, b, out, how)

        return fn

    return time_candidates(cycled(sets, {how: run(how) for how in ("mm", "mv", "swap")}))


def few_rows_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, how: str) -> None:
    """``out = a @ b`` for a few rows of ``a``, in their dtype: one matrix-vector product
    per row over ``b``'s transpose (``"mv"``: the weight read as it lies, no packing), or
    ``(b^T @ a^T)^T`` (``"swap"``: the few rows as the GEMM's narrow side)."""
    if how == "mv":
        bt = b.t()
        for r in range(a.shape[0]):
            torch.mv(bt, a[r], out=out[r])
    elif how == "swap":
        out.copy_(torch.mm(b.t(), a.t()).t())
    else:
        raise ValueError(f"few_rows_mm: how must be 'mv' or 'swap', got {how!r}")


def _pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the row classes of the decision keys."""
    return 1 << max(0, n - 1).bit_length()


def _half_pow2_at_least(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, ... (powers of two and 1.5 times them) >= n:
    ``gemm_kernel``'s size classes, whose rankings turn within a factor of two (a
    32-expert layer's 384-row groups and 768-wide weights ranked unlike 512's)."""
    p = _pow2_at_least(n)
    return p * 3 // 4 if p >= 4 and p * 3 // 4 >= n else p


def few_rows(dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor, general: MatMulInto) -> str:
    """How to multiply ``a`` [m <= FEW_ROWS, k] by ``b``, both in ``dtype``: ``"mm"``,
    the ``general`` way (one GEMM in the compute dtype: native, or the fp32 upcast, which
    for a few rows converts a whole weight per call), unless :func:`few_rows_mm`'s ``"mv"``
    or ``"swap"`` in ``dtype`` itself is over 10% faster; measured per layout pair and row
    count (rounded up to a power of two)."""
    rows = _pow2_at_least(a.shape[0])
    ta, tb = transposed(a), transposed(b)

    def choose() -> str:
        ab = layout_of(a, b)
        return decide(
            f"few_rows:{_dt(dtype)}:{ab}:m{rows}",
            lambda: _measure_few_rows(dtype, ab, rows, general),
            default="mm",
            margin=0.1,
        )

    return memo(("few_rows", dtype, ta, tb, rows), choose)


def grouped_mm(
    dtype: torch.dtype, ab: str, cls: str, measure: Callable[[], Mapping[str, float]]
) -> str:
    """``"torch"`` if ``torch._grouped_mm`` beats torch_moe's per-group loop by over 5% for
    this dtype, layout pair and shape class (``measure`` times both), else ``"loop"``."""
    return decide(f"grouped_mm:{_dt(dtype)}:{ab}:{cls}", measure, default="loop", margin=0.05)


WGRAD_MAX = {"r": 512, "k": 4096, "n": 2048}  # wgrad_a's classes stop here: larger
# problems amortize the copy at least as well, and the probe stays within tens of ms


def wgrad_a(
    dtype: torch.dtype,
    rows: int,
    k: int,
    n: int,
    measure: Callable[[int, int, int], Mapping[str, float]],
) -> str:
    """``"transpose"`` if a weight gradient ``out[g] = x[g]^T @ dy[g]`` (``x`` [M, k],
    ``dy`` [M, n], groups of about ``rows`` rows) runs over 5% faster with ``x`` copied
    once into a row-major ``x^T`` than with ``x^T`` as the column-major view it is, else
    ``"as_is"``; ``measure(rows, k, n)`` times both, each size rounded up to a power of
    two and capped (``WGRAD_MAX``). The copy is one pass over ``x``; on AMX oneDNN
    multiplies a column-major ``a`` read from memory at about half the rate of a
    row-major one, so the copy pays off on large outputs (large ``k`` and ``n``) and
    loses on small ones (benchmarks/results/cpu_floor_cpu_202612.md). The ``layout``
    probe's small, cache-resident operands cannot see this, hence a decision of its own
    at the weight gradient's sizes."""
    r, kk, c = (min(_pow2_at_least(v), WGRAD_MAX[d]) for v, d in ((rows, "r"), (k, "k"), (n, "n")))
    return memo(
        ("wgrad_a", dtype, r, kk, c),
        lambda: decide(
            f"wgrad_a:{_dt(dtype)}:r{r}:k{kk}:n{c}",
            lambda: measure(r, kk, c),
            default="as_is",
            margin=0.05,
        ),
    )


def swiglu_path(
    dtype: torch.dtype, rows: int, measure: Callable[[int], Mapping[str, float]]
) -> str:
    """``"whole"`` if ``grouped_swiglu``'s CPU kernels run faster as whole-tensor grouped
    GEMMs (the ``grouped_mm`` ops) with the activation chunked over all rows than as a
    loop over the groups, at about ``rows`` rows per group (rounded up to a power of
    two), by over 5%; else ``"loop"``. Many small groups favour the whole-tensor path (a
    few calls instead of six per group), large ones the loop (one expert's activation
    buffers, reused)."""
    r = _pow2_at_least(rows)
    return decide(f"swiglu_path:{_dt(dtype)}:r{r}", lambda: measure(r), default="loop", margin=0.05)


def few_gemm(
    dtype: torch.dtype,
    col_major: bool,
    rows: int,
    groups: int,
    measure: Callable[[], Mapping[str, float]],
) -> str:
    """``"native"`` if the compiled few-rows grouped GEMM (``_native.py``: each expert's
    weight read once for all of its rows, converted in registers, one call for all
    groups) beats the better ATen way (``torch._grouped_mm`` or the per-group loop) by
    over 10% at about ``rows`` rows per group over ``groups`` busy groups (powers of
    two) with the weight row- or column-major (``<b>``: n / t), ``"amx"`` if its AMX
    form (bf16, column-major weights, where the CPU allows tiles: the measure times it
    there only) is the fastest by that margin, else ``"aten"``. Timed on the caller's
    threads (module note). The kernel then takes tiles for the groups of the classes
    down to the smallest ``"amx"`` one (``grouped_mm.amx_rows``), whatever the call's own
    class; forced where the CPU has no tiles, ``"amx"`` runs as ``"native"``."""
    b = "t" if col_major else "n"
    key = f"few_gemm:{_dt(dtype)}:{b}:r{_pow2_at_least(rows)}:g{_pow2_at_least(groups)}"
    return decide(key, measure, default="aten", threads=True)


def threads_mm(
    dtype: torch.dtype,
    ab: str,
    cls: str,
    threads: int,
    measure: Callable[[], Mapping[str, float]],
    native_gemm: bool = False,
) -> str:
    """``"aten"`` if the better ATen way (``torch._grouped_mm`` or the per-group loop, each
    group's GEMM split over all threads) beats the compiled threaded grouped GEMM
    (``_native.py``: each thread runs its equal share of the groups' work as one-thread
    GEMMs) by over 10% for this dtype, layout pair and shape class on ``threads``
    threads, else ``"native"``. Timed on the caller's threads (module note).

    The threaded kernel is the default, unlike the other kernels here: its one barrier
    per call, against one per group, is what its gain mostly is on a shared machine (a
    bf16 layer step on two threads 9-20% faster while another process loaded the
    machine, -2% / +4% / +5% at E8 / E32 / E64 of benchmarks/bench_moe_layer.py while it
    was quiet: benchmarks/results/cpu_floor_cpu_202612.md), and a probe's minimum over
    a few rounds on small operands sees the quiet case only, within about 10% either
    way; so the probe keeps it unless the ATen way is clearly faster."""
    key = threads_mm_key(dtype, ab, cls, threads, native_gemm)
    return decide(key, measure, default="native", margin=0.1, threads=True)


def threads_mm_key(
    dtype: torch.dtype, ab: str, cls: str, threads: int, native_gemm: bool = False
) -> str:
    """:func:`threads_mm`'s key: its default, ``"native"``, holds where none is
    :func:`known`."""
    return f"threads_mm:{_dt(dtype)}:{ab}:{cls}:t{threads}" + (":gemm" if native_gemm else "")


GEMM_MAX = {"r": 512, "k": 4096, "n": 4096}  # gemm_kernel's classes stop here (an E8 expert)


def gemm_kernel(
    dtype: torch.dtype,
    kind: str,
    rows: int,
    k: int,
    n: int,
    measure: Callable[[str, int, int, int], Mapping[str, float]],
) -> str:
    """``"native"`` if the threaded grouped GEMM's pieces of this ``kind`` (``"bt"``: x @
    w^T, each expert's weight column-major; ``"nn"``: x @ w, row-major; ``"tn"``: a weight
    gradient x^T @ dy) at groups of about ``rows`` rows of ``k`` x ``n`` run faster by the
    compiled packed bf16 GEMM (``csrc/gemm_bf16_cpu.cpp``: AMX tiles or AVX512-BF16 dot
    products, each operand packed once per call or read in place) than by ATen's (oneDNN's)
    on one thread, unless ATen's runs faster by over 5%: then ``"aten"``;
    ``measure(kind, rows, k, n)`` times both, each size rounded up to a power of two or
    1.5 times one and capped (``GEMM_MAX``). Near-ties go to the native GEMM: the probe's
    calls rank a pair within a few percent either way from one measurement to the next,
    while inside the layer the native GEMM ran those GEMMs faster (on the AMX Xeon, one
    thread, with the two tied keys of each shape forced native: the 32-expert layer's
    step 3.5% faster, 4.2% on two threads, the 8-expert one's 1.8%; before, ties kept
    oneDNN's). Which wins depends
    on both: on the AMX Xeon measured the native GEMM was 10-30% faster at a 64-expert
    layer's GEMMs and up to 30% slower at an 8-expert layer's row-major weights and
    weight gradients, where oneDNN overlaps its copy of a large weight with its products
    better (benchmarks/results/cpu_floor_cpu_202612.md). Where it is ``"native"`` the
    threaded kernel is a candidate on one thread too (``threads_mm`` then measures it
    there, key ending in ``:gemm``)."""
    r, kk, c = (
        min(_half_pow2_at_least(v), GEMM_MAX[d]) for v, d in ((rows, "r"), (k, "k"), (n, "n"))
    )
    return memo(
        ("gemm_kernel", dtype, kind, r, kk, c),
        lambda: decide(
            f"gemm_kernel:{_dt(dtype)}:{kind}:r{r}:k{kk}:n{c}",
            lambda: measure(kind, r, kk, c),
            default="native",
            margin=0.05,
        ),
    )


def out_stream(dtype: torch.dtype, measure: Callable[[], Mapping[str, float]]) -> str:
    """``"stream"`` if the native kernels run over 5% faster writing an output that is past
    the L2 cache by non-temporal stores (whole 64-byte lines, no read for ownership of
    each) than by plain ones, timed on the native GEMM with a short K and a wide output
    (the shape where writing the output costs the most), else ``"cache"``. On the AMX
    Xeon measured the 64-expert layer's a @ w2^T (K = 256) ran 1.5x faster streamed;
    the kernels stream only outputs past the L2 (``past_l2`` in csrc/vec_convert.h)."""
    return decide(f"out_stream:{_dt(dtype)}", measure, default="cache", margin=0.05)


def router_kernel(
    dtype: torch.dtype, rows: int, experts: int, measure: Callable[[], Mapping[str, float]]
) -> str:
    """``"amx"`` if the router's logits and their gradient grad_x (``csrc/router_cpu.cpp``)
    run over 10% faster by the expert GEMMs' AMX tiles than by the row kernels' dot
    products and fp32 FMAs, timed at ``rows`` tokens and ``experts`` experts (both powers
    of two), else ``"native"``. On the AMX Xeon measured the tiles ran a 2048-token,
    1024-wide router of 64 experts' logits 3.1 -> 0.7 ms and grad_x 2.4 -> 1.2, and at 8
    experts (one tile of 32 rows mostly padding) level."""
    return decide(f"router_kernel:{_dt(dtype)}:r{rows}:e{experts}", measure, default="native")


def row_split(dtype: torch.dtype, measure: Callable[[], Mapping[str, float]]) -> str:
    """``"split"`` if the threaded grouped GEMM's forward runs faster with a group whose
    rows oneDNN would cut into blocks of under 64 rows split into GEMMs of at most 256
    rows (module note) by over 10% on one thread, else ``"one"``."""
    return decide(f"row_split:{_dt(dtype)}", measure, default="one")


def act_kernel(dtype: torch.dtype, measure: Callable[[], Mapping[str, float]]) -> str:
    """``"native"`` if the compiled SwiGLU row kernels (``_native.py``; the same bits as
    the ATen ops) run the activation's forward + backward faster than the ATen ops by
    over 10%, else ``"aten"``; ``measure`` returns only ``"aten"`` where they did not
    build."""
    return decide(f"act_kernel:{_dt(dtype)}", measure, default="aten")


def act_table(dtype: torch.dtype, measure: Callable[[], Mapping[str, float]]) -> str:
    """``"table"`` if the native SwiGLU kernels run the activation's forward + backward of
    a half-precision h faster by over 10% reading each gate's silu and sigmoid from
    tables of all 65536 values of ``dtype`` (one gather for an exp and a division; the
    same bits) than computing them, else ``"compute"``; ``measure`` returns only
    ``"compute"`` where the tables' check failed. On the AMX Xeon measured, one thread,
    E8's activation (4096 x 1792) forward 4.6 -> 3.2 ms, backward 7.7 -> 5.9 ms; a gather
    costs more on CPUs with the Downfall (GDS) microcode mitigation."""
    return decide(f"act_table:{_dt(dtype)}", measure, default="compute")


def act_chunk(dtype: torch.dtype, measure: Callable[[], Mapping[str, float]]) -> int:
    """Elements per thread of one row chunk of the elementwise SwiGLU work: the largest
    candidate within 10% of the fastest (``measure`` times candidates named by their
    size). Small chunks keep the fp32 temporaries in cache; past that, fewer and larger
    ops cost less per call and wait less on a shared machine (every op is a parallel
    region that waits for its slowest thread)."""

    def choose(times: Mapping[str, float]) -> str:
        fastest = min(times.values())
        return max((name for name, t in times.items() if t <= fastest * 1.1), key=int)

    return int(decide(f"act_chunk:{_dt(dtype)}", measure, default=str(2**16), choose=choose))
