"""How fast are torch_moe's core ops next to their floors and plain-torch peers?

Times routing, permute, unpermute, grouped_mm and grouped_swiglu (forward + backward)
in one process, interleaved round by round (median of ``--reps`` rounds), and prints:

* the machine: CPU model, ISA (AVX2 / AVX512 / AVX512-BF16 / AMX, from the CPU flags and
  an ``ONEDNN_MAX_CPU_ISA`` cap),
  threads, load average before and after (the machine may be shared);
* the floor of each op, measured in the same run: bytes moved over the measured copy
  bandwidth for data movement, FLOPs over the large-GEMM rate for GEMMs. Two GEMM rates
  are measured, a large ``torch.mm`` in the benchmark dtype and in fp32, and the floor is
  the one of the math torch_moe does on this machine (docs/design.md §8): the native
  half-precision rate where the CPU multiplies bf16 natively, the fp32 rate where it
  upcasts. For the GEMM ops the large mm runs inside the same rounds as the op;
* which path each measured CPU decision took (``torch_moe._ops._cpu_probe``);
* a plain-torch peer: ``torch._grouped_mm`` with autograd, ``index_select`` /
  ``index_add_`` dispatch and combine, softmax + topk routing;
* with ``--baseline REV``: the CPU grouped_mm / grouped_swiglu ops of git revision REV,
  loaded next to the current ones under another op namespace and timed in the same
  rounds (before / after in one run);
* peak memory of grouped_swiglu forward + backward above the inputs and weights (from
  the process's peak RSS, reset through /proc/self/clear_refs), next to the budget of
  gradients + output + the saved pre-activation, and next to the peer.

    python benchmarks/bench_ops.py                      # the issue's shapes, bf16
    python benchmarks/bench_ops.py --m 1024 --reps 3    # quicker
    python benchmarks/bench_ops.py --baseline HEAD~3    # before / after
    TORCH_MOE_CPU_PROBE=half_gemm=fp32 python benchmarks/bench_ops.py   # force a decision
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

import torch_moe  # noqa: F401
from torch_moe import ops
from torch_moe._ops import _cpu_probe, _native
from torch_moe._ops import grouped_mm as gmm
from torch_moe._ops.grouped_mm import cpu_compute_dtype
from torch_moe._ops.permute import permute as permute_rows
from torch_moe.nn.functional import grouped_swiglu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROOT = Path(__file__).resolve().parents[1]


STAT: Callable[[list[float]], float] = statistics.median  # --stat min: the best round
CLOCK: Callable[[], float] = time.perf_counter  # --clock cpu: time.process_time


def interleaved(
    fns: dict[str, Callable[[], object]], reps: int, warmup: bool = True
) -> dict[str, float]:
    """Median (``STAT``) seconds per call, running each candidate once per round."""
    for fn in fns.values() if warmup else ():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = CLOCK()
            fn()
            times[name].append(CLOCK() - t0)
    return {name: STAT(ts) for name, ts in times.items()}


def set_stat(name: str, clock: str = "wall") -> None:
    """``median`` (default) or ``min`` over rounds: on a shared machine the best round is
    the one least disturbed by other processes' load. ``clock="cpu"``: the process's CPU
    time instead of wall time, which on one thread leaves out the time other processes
    hold the core (with several threads it would count their spin-waits: refused)."""
    global STAT, CLOCK
    STAT = min if name == "min" else statistics.median
    if clock == "cpu" and torch.get_num_threads() != 1:
        raise SystemExit("--clock cpu needs --threads 1 (CPU time sums every thread's spin-waits)")
    CLOCK = time.process_time if clock == "cpu" else time.perf_counter


def add_timing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--stat", choices=["median", "min"], default="median", help="over rounds")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: process CPU time (with --threads 1: robust to other processes' load)",
    )


def apply_timing_args(args: argparse.Namespace) -> str:
    """Set threads, statistic and clock; returns their description for the header."""
    if args.threads:
        torch.set_num_threads(args.threads)
    set_stat(args.stat, args.clock)
    return f"{args.stat} of {args.reps} rounds, {args.clock} clock"


def square_mm(dtype: torch.dtype, n: int) -> Callable[[], object]:
    """A large square mm in the fastest operand layout (A @ B^T): ``2 n^3`` FLOPs a call."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype).t()
    return lambda: torch.mm(a, b)


def gemm_rate(dtype: torch.dtype, n: int, reps: int) -> float:
    """FLOP/s of a large square mm, the fastest operand layout (A @ B^T)."""
    return 2 * n**3 / interleaved({"mm": square_mm(dtype, n)}, reps)["mm"]


def native_mm_rate(dtype: torch.dtype, n: int, reps: int) -> float | None:
    """FLOP/s of torch_moe's packed bf16 GEMM (``csrc/gemm_bf16_cpu.cpp``, what the threaded
    grouped kernel runs where the probe's ``gemm_kernel`` chose it) on the floor's square
    ``A @ B^T``, on all intra-op threads as that kernel shares one group out (by
    columns), or None where it does not run (not bf16, no AVX512-BF16, not built)."""
    mod = _native.kernels()
    if dtype != torch.bfloat16 or mod is None or not mod.bf16_mm_available():
        return None
    gmm.native_gemm_ready(dtype)  # its micro-kernel (AMX or not) as the probe sets it up
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype).t().unsqueeze(0)
    out, offs = a.new_empty((n, n)), torch.tensor([n], dtype=torch.int32)

    def run() -> None:
        mod.threaded_grouped_mm(a, b, offs, out, False, True)

    return 2 * n**3 / interleaved({"mm": run}, reps)["mm"]


def floor_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the math torch_moe's CPU GEMMs do for ``dtype`` inputs on this machine."""
    return cpu_compute_dtype(dtype)


def floor_size(dtype: torch.dtype) -> int:
    return 4096 if dtype == torch.float32 else 2048


def copy_bandwidth(reps: int) -> float:
    """Bytes/s of a large copy (read + write)."""
    src = torch.empty(64 * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    sec = interleaved({"copy": lambda: dst.copy_(src)}, reps)["copy"]
    return 2 * src.numel() / sec


def machine_line() -> str:
    """torch version, CPU model and ISA, threads and the load average, for every result."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = "/".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    cap = _cpu_probe.isa_cap()
    isa = _cpu_probe.cpu_isa() + (f" (capped by {cap[0]}={os.environ[cap[0]]})" if cap else "")
    return (
        f"# torch {torch.__version__}, {model}, ISA {isa}, {os.cpu_count()} "
        f"CPUs, threads={torch.get_num_threads()}, load average {load} (1/5/15 min), "
        f"{large_pages()}, {allocator()}"
    )


def large_pages() -> str:
    """How the CPU allocator's large blocks are paged. Each fresh large block costs a page
    fault per page on first touch (glibc maps blocks of 32 MiB and more anew on every
    allocation); ``THP_MEM_ALLOC_ENABLE=1`` makes PyTorch ask for 2 MiB pages instead."""
    mode = "?"
    with contextlib.suppress(OSError):
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = next((w[1:-1] for w in f.read().split() if w.startswith("[")), "?")
    asked = os.environ.get("THP_MEM_ALLOC_ENABLE", "0") == "1"
    return f"THP_MEM_ALLOC_ENABLE={int(asked)} (transparent huge pages: {mode})"


def allocator() -> str:
    """Which ``malloc`` serves the CPU allocator, and how it keeps freed blocks. glibc by
    default unmaps blocks of 32 MiB and more when they are freed and trims its heap, so
    a training step's fresh activations and gradients fault in page by page every step;
    tcmalloc, jemalloc with decay off, or glibc with ``GLIBC_TUNABLES`` raising
    ``mmap_threshold`` / ``trim_threshold`` keep them mapped (README)."""
    loaded = "glibc"
    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as f:
            maps = f.read()
        loaded = next(
            (name for name in ("tcmalloc", "jemalloc", "mimalloc") if name in maps), loaded
        )
    knobs = {
        "glibc": os.environ.get("GLIBC_TUNABLES", ""),
        "jemalloc": os.environ.get("MALLOC_CONF", ""),
    }.get(loaded, "")
    return f"malloc: {loaded}" + (f" ({knobs})" if knobs else "")


def page_faults(fn: Callable[[], object], reps: int = 3) -> tuple[float, float]:
    """(minor page faults, system CPU seconds) per call of ``fn``: the kernel's share of a
    step, which the allocator decides (``allocator``)."""
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(reps):
        fn()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (after.ru_minflt - before.ru_minflt) / reps, (after.ru_stime - before.ru_stime) / reps


def floor_line(
    name: str, dtype: torch.dtype, rate: float, rate32: float, native_rate: float | None = None
) -> str:
    native = floor_dtype(dtype) == dtype
    which = f"{name} (native)" if native else "fp32 (this CPU upcasts " + name + ")"
    line = (
        f"# large mm: {rate / 1e9:.1f} GFLOP/s in {name}, {rate32 / 1e9:.1f} GFLOP/s in fp32; "
        f"the floor is the {which} rate"
    )
    if native_rate is not None:
        line += (
            f"; torch_moe's own bf16 GEMM (csrc/gemm_bf16_cpu.cpp) {native_rate / 1e9:.1f} "
            "GFLOP/s on the same mm (x native mm: against that rate)"
        )
    return line


def print_decisions() -> None:
    """Which path every measured CPU decision of this process took, and why."""
    print("# CPU decisions (torch_moe._ops._cpu_probe):")
    for key, how in _cpu_probe.decisions().items():
        print(f"#   {key}: {how}")
    forced = os.environ.get(_cpu_probe.ENV_FORCE)
    if forced:
        print(f"#   forced by {_cpu_probe.ENV_FORCE}={forced}")


def load_baseline(rev: str) -> types.SimpleNamespace:
    """The CPU ops ``grouped_mm`` / ``grouped_swiglu`` of git revision ``rev``, registered
    under the op namespace ``torch_moe_base`` next to the current ones (their Python
    modules taken from ``git show``; everything else they import is today's). A revision
    that decided the half-precision dtype by a CPU-flag rule is made to decide as this
    process does (so that ``TORCH_MOE_CPU_PROBE=half_gemm=fp32`` times both on the fp32
    upcast path, the one CPUs without native bf16 take)."""
    package = "_torch_moe_base_ops"
    sys.modules.setdefault(package, types.ModuleType(package))
    mods: dict[str, types.ModuleType] = {}
    for name in ("_cpu_probe", "grouped_mm", "grouped_swiglu"):
        path = f"torch_moe/_ops/{name}.py"
        show = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True
        )
        if show.returncode != 0:
            if name == "_cpu_probe":  # older revisions have none
                continue
            raise RuntimeError(f"--baseline {rev}: cannot read {path}: {show.stderr.strip()}")
        src = show.stdout.replace('"torch_moe::', '"torch_moe_base::')
        for other in ("_cpu_probe", "grouped_mm"):
            src = src.replace(f"torch_moe._ops.{other} import", f"{package}.{other} import")
            src = src.replace(
                f"from torch_moe._ops import {other}\n", f"from {package} import {other}\n"
            )
        mod = types.ModuleType(f"{package}.{name}")
        sys.modules[mod.__name__] = mod
        setattr(sys.modules[package], name, mod)
        exec(compile(src, f"{rev}:{path}", "exec"), mod.__dict__)
        mods[name] = mod
        if name == "grouped_mm" and "_cpu_probe" not in mods:
            mod._cpu_native_half = lambda dtype: cpu_compute_dtype(dtype) == dtype
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True
    ).stdout.strip()
    swiglu = mods["grouped_swiglu"].grouped_swiglu
    gathers = "row_to_slot" in inspect.signature(swiglu).parameters

    def grouped_swiglu_base(  # type: ignore[no-untyped-def]
        x, w13, w2, offs, row_weights=None, row_to_slot=None, slot_to_row=None
    ):
        """The revision's op; the layer's permutation form (rows gathered from the tokens)
        by the op where the revision has it, else by today's permute first."""
        if row_to_slot is None:
            return swiglu(x, w13, w2, offs, row_weights)[0]
        if gathers:
            return swiglu(
                x, w13, w2, offs, row_weights, row_to_slot=row_to_slot, slot_to_row=slot_to_row
            )[0]
        x = permute_rows(x.to(w13.dtype), row_to_slot, slot_to_row)
        return swiglu(x, w13, w2, offs, row_weights)[0]

    return types.SimpleNamespace(
        rev=f"{rev} ({commit})",
        grouped_mm=mods["grouped_mm"].grouped_mm,
        grouped_swiglu=grouped_swiglu_base,
    )


def _rss(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_extra_bytes(fn: Callable[[], object]) -> int | None:
    """Peak resident bytes above the current RSS while ``fn`` runs (Linux only)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return None
    base = _rss("VmRSS")
    fn()
    peak = _rss("VmHWM")
    return None if base is None or peak is None else peak - base


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--m", type=int, default=4096, help="permuted rows M (= T*K)")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1792)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-peer-swiglu", action="store_true", help="skip the bf16 swiglu peer")
    p.add_argument(
        "--peer-reps",
        type=int,
        help="where this CPU only emulates the dtype: calls of the torch._grouped_mm peers, "
        "timed apart without warm-up (their backward takes oneDNN's emulated row-major x "
        "row-major path: minutes a call; default 1); with native support they run in the "
        "same --reps rounds as torch_moe",
    )
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="also time the grouped_mm / grouped_swiglu ops of this git revision, same rounds",
    )
    add_timing_args(p)
    p.add_argument("--measure-peak", choices=["ours", "peer"], help=argparse.SUPPRESS)
    args = p.parse_args()
    timing = apply_timing_args(args)
    if args.measure_peak:
        measure_peak(args)
        return
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    m, d, f, e, k = args.m, args.dim, args.hidden, args.experts, args.top_k
    t = m // k
    print(machine_line())
    base = load_baseline(args.baseline) if args.baseline else None

    cdt = floor_dtype(dtype)  # the math torch_moe's GEMMs do here (probes this machine)
    native = cdt == dtype
    peer_reps = args.peer_reps or 1
    rate = gemm_rate(dtype, floor_size(dtype), 3)
    rate32 = gemm_rate(torch.float32, floor_size(torch.float32), 3)
    bw = copy_bandwidth(args.reps)
    esize = torch.empty((), dtype=dtype).element_size()
    native_rate = native_mm_rate(dtype, floor_size(dtype), 3)
    print(floor_line(args.dtype, dtype, rate, rate32, native_rate) + f"; copy: {bw / 1e9:.2f} GB/s")
    print(f"# M={m} (T={t}, K={k}), D={d}, F={f}, E={e}, {args.dtype}, {timing}")
    if base is not None:
        print(f"# baseline: grouped_mm / grouped_swiglu of {base.rev}")
    print()

    # name, ours s, floor s, x bf16-mm, x fp32-mm, peer name, peer s, base s
    Row = tuple[str, float, float, float | None, float | None, str, float | None, float | None]
    rows: list[Row] = []
    floor_mm = {"floor": square_mm(cdt, floor_size(cdt))}
    mm_flops = 2 * floor_size(cdt) ** 3
    other = torch.float32 if native and dtype != torch.float32 else None
    if other is not None:
        floor_mm["other"] = square_mm(other, floor_size(other))

    def gemm_row(name: str, flops: int, fns: dict[str, Callable[[], object]], peer: str) -> Row:
        """Ours (and the baseline) with the floor mm in the same rounds; the peer after."""
        slow_peer = not native and "peer" in fns  # emulated bf16: timed apart, fewer calls
        timed = {key: fn for key, fn in fns.items() if not (slow_peer and key == "peer")}
        r = interleaved({**timed, **floor_mm}, args.reps)
        if slow_peer:
            r.update(interleaved({"peer": fns["peer"]}, peer_reps, warmup=peer_reps > 1))
        floor_s = flops / (mm_flops / r["floor"])
        x_dt = x_32 = None
        if native:
            x_dt = r["ours"] / floor_s
            if other is not None:
                x_32 = r["ours"] / (flops / (2 * floor_size(other) ** 3 / r["other"]))
        else:  # upcast: the floor is the fp32 rate; the bf16 rate is the emulated one
            x_32 = r["ours"] / floor_s
            x_dt = r["ours"] / (flops / rate)
        return (name, r["ours"], floor_s, x_dt, x_32, peer, r.get("peer"), r.get("base"))

    # ---------------- routing (fp32 logits [T, E]) ----------------
    logits = torch.randn(t, e, requires_grad=True)
    g_w = torch.randn(t, k)

    def route_ours():
        w, _, _ = ops.topk_route(logits, k, route_norm=True)
        w.backward(g_w)

    def route_peer():
        probs = torch.softmax(logits, -1)
        w, ids = probs.topk(k, -1)
        w = w / w.sum(-1, keepdim=True)
        torch.bincount(ids.flatten(), minlength=e)
        w.backward(g_w)

    r = interleaved({"ours": route_ours, "peer": route_peer}, args.reps)
    route_bytes = 2 * (t * e * 4 + t * k * (4 + 8))  # fwd + bwd
    rows.append(
        (
            "topk_route fwd+bwd",
            r["ours"],
            route_bytes / bw,
            None,
            None,
            "softmax+topk",
            r["peer"],
            None,
        )
    )

    # ---------------- router logits (fp32 [T, E] from x [T, D], W [E, D]) ----------------
    x_r = torch.randn(t, d, dtype=dtype, requires_grad=True)
    w_r = (torch.randn(e, d) * d**-0.5).to(dtype).requires_grad_()
    g_r = torch.randn(t, e)

    def router_ours():
        ops.router_logits(x_r, w_r).backward(g_r)

    def router_peer():  # the fp32 reference: F.linear on converted operands (autograd)
        torch.nn.functional.linear(x_r.float(), w_r.float()).backward(g_r)

    rows.append(
        gemm_row(
            "router_logits fwd+bwd",
            6 * t * d * e,
            {"ours": router_ours, "peer": router_peer},
            "F.linear fp32",
        )
    )

    # ---------------- permute / unpermute ----------------
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    x_tok = torch.randn(t, d, dtype=dtype, requires_grad=True)
    weights = torch.rand(t, k, requires_grad=True)
    perm = ops.permute_indices(ids, e)
    y_perm = torch.randn(m, d, dtype=dtype, requires_grad=True)
    g_perm = torch.randn(m, d, dtype=dtype)
    g_tok = torch.randn(t, d, dtype=dtype)
    tok_of_row = perm.row_to_slot // k
    w_of_row = weights.detach().flatten()[perm.row_to_slot]

    def permute_ours():
        x_perm, _ = ops.permute(x_tok, ids, e)
        x_perm.backward(g_perm)

    def permute_peer():  # index_select forward, index_add backward (autograd)
        order = torch.argsort(ids.flatten(), stable=True)
        x_tok.index_select(0, order // k).backward(g_perm)

    def unpermute_ours():
        ops.unpermute(y_perm, weights, perm).backward(g_tok)

    def unpermute_peer():  # scale rows then index_add into tokens (autograd)
        out = torch.zeros(t, d, dtype=dtype)
        out = out.index_add(0, tok_of_row, y_perm * w_of_row.to(dtype).unsqueeze(1))
        out.backward(g_tok)

    r = interleaved(
        {"p": permute_ours, "pp": permute_peer, "u": unpermute_ours, "up": unpermute_peer},
        args.reps,
    )
    move = 2 * m * d * esize  # read + write the [M, D] buffer once
    rows.append(
        ("permute fwd+bwd", r["p"], 2 * move / bw, None, None, "index_select", r["pp"], None)
    )
    rows.append(
        ("unpermute fwd+bwd", r["u"], 2 * move / bw, None, None, "index_add", r["up"], None)
    )
    perm_time = r["p"] + r["u"]

    # ---------------- grouped_mm ----------------
    offs = (torch.arange(1, e + 1) * (m // e)).to(torch.int32)
    x = torch.randn(m, d, dtype=dtype, requires_grad=True)
    w = (torch.randn(e, f, d, dtype=dtype) * 0.02).requires_grad_()
    g_mm = torch.randn(m, f, dtype=dtype)

    def fresh(fn: Callable[[], object], *leaves: torch.Tensor) -> Callable[[], object]:
        """``fn`` after dropping the leaves' .grad: no gradient accumulation is timed."""

        def run() -> object:
            for leaf in leaves:
                leaf.grad = None
            return fn()

        return run

    fns: dict[str, Callable[[], object]] = {
        "ours": fresh(lambda: ops.grouped_mm(x, w.transpose(-2, -1), offs).backward(g_mm), x, w),
        "peer": fresh(
            lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs).backward(g_mm), x, w
        ),
    }
    if base is not None:
        fns["base"] = fresh(
            lambda: base.grouped_mm(x, w.transpose(-2, -1), offs).backward(g_mm), x, w
        )
    rows.append(gemm_row("grouped_mm fwd+bwd", 6 * m * d * f, fns, "torch._grouped_mm"))

    # ---------------- grouped_swiglu ----------------
    w13 = (torch.randn(e, 2 * f, d, dtype=dtype) * 0.02).requires_grad_()
    w2 = (torch.randn(e, d, f, dtype=dtype) * 0.02).requires_grad_()
    g_y = torch.randn(m, d, dtype=dtype)

    def swiglu_peer():  # the composition users write with torch._grouped_mm
        h = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
        torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs).backward(g_y)

    fns = {"ours": fresh(lambda: grouped_swiglu(x, w13, w2, offs).backward(g_y), x, w13, w2)}
    if not args.skip_peer_swiglu:
        fns["peer"] = fresh(swiglu_peer, x, w13, w2)
    if base is not None:
        fns["base"] = fresh(lambda: base.grouped_swiglu(x, w13, w2, offs).backward(g_y), x, w13, w2)
    rows.append(gemm_row("grouped_swiglu fwd+bwd", 18 * m * d * f, fns, "_grouped_mm+silu"))

    # ---------------- table ----------------
    print_decisions()
    print(machine_line())
    print()
    floor_dt = args.dtype if native else "fp32"
    head = (
        f"| op | torch_moe ms | floor ms | x floor | x {args.dtype} mm | x fp32 mm | peer | "
        "peer ms | peer/ours |"
    )
    if base is not None:
        head += " baseline ms | baseline/ours |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for name, ours, floor, x_dt, x_32, peer_name, peer, base_s in rows:
        cells = [
            name,
            f"{ours * 1e3:.1f}",
            f"{floor * 1e3:.2f}",
            f"{ours / floor:.2f}",
            f"{x_dt:.2f}" if x_dt is not None else "-",
            f"{x_32:.2f}" if x_32 is not None else "-",
            peer_name,
            f"{peer * 1e3:.1f}" if peer else "-",
            f"{peer / ours:.2f}" if peer else "-",
        ]
        if base is not None:
            cells += [f"{base_s * 1e3:.1f}", f"{base_s / ours:.2f}"] if base_s else ["-", "-"]
        print("| " + " | ".join(cells) + " |")
    print(
        f"\nfloor of the GEMM rows: the {floor_dt} mm rate (the math torch_moe does on this "
        f"CPU); permute + unpermute (fwd+bwd) / grouped_swiglu (fwd+bwd): "
        f"{perm_time / rows[-1][1]:.3f}"
    )

    # ---------------- memory (each candidate in a fresh process) ----------------
    mib = 2**20
    grads = (x.numel() + w13.numel() + w2.numel()) * esize
    saved_h = m * 2 * f * esize
    out_y = m * d * esize
    budget = grads + saved_h + out_y
    peaks = {}
    for who in ["ours"] + ([] if args.skip_peer_swiglu else ["peer"]):
        cmd = [sys.executable, __file__, "--measure-peak", who, "--m", str(m), "--dim", str(d)]
        cmd += ["--hidden", str(f), "--experts", str(e), "--dtype", args.dtype]
        cmd += ["--threads", str(torch.get_num_threads())]
        # mmap every block >= 64 KiB so that a free returns it and RSS tracks live tensors
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        out = subprocess.run(
            cmd, capture_output=True, text=True, check=True, env=env
        ).stdout.split()
        peaks[who] = f"{int(out[-1]) / mib:.1f} MiB" if out and out[-1] != "None" else "n/a"
    print(
        f"\ngrouped_swiglu fwd+bwd peak RSS above inputs+weights: ours {peaks['ours']}, "
        f"peer {peaks.get('peer', '-')}; budget (gradients {grads / mib:.1f} + saved h "
        f"{saved_h / mib:.1f} + output {out_y / mib:.1f}) = {budget / mib:.1f} MiB"
    )


def measure_peak(args: argparse.Namespace) -> None:
    """Child process: peak RSS of one grouped_swiglu fwd+bwd above its inputs and weights."""
    dtype = DTYPES[args.dtype]
    m, d, f, e = args.m, args.dim, args.hidden, args.experts
    offs = (torch.arange(1, e + 1) * (m // e)).to(torch.int32)
    x = torch.randn(m, d, dtype=dtype, requires_grad=True)
    w13 = (torch.randn(e, 2 * f, d, dtype=dtype) * 0.02).requires_grad_()
    w2 = (torch.randn(e, d, f, dtype=dtype) * 0.02).requires_grad_()
    g_y = torch.randn(m, d, dtype=dtype)

    def run():
        if args.measure_peak == "ours":
            grouped_swiglu(x, w13, w2, offs).backward(g_y)
        else:
            h = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
            gate, up = h.chunk(2, dim=-1)
            a = torch.nn.functional.silu(gate) * up
            torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs).backward(g_y)

    run()  # warm up: library buffers and lazy initialisation are not the op's memory
    for t in (x, w13, w2):
        t.grad = None
    print(peak_extra_bytes(run))


if __name__ == "__main__":
    main()
