"""How well does torch_moe.perf predict a MoE layer step on this machine, and does its
advisor pick the fastest strategy?

Measures a sweep of ``torch_moe.nn.MoE`` forward + backward steps across sparsity regimes
(E 4..256, K 1..8, tokens per expert 2..4096, fine- and coarse-grained experts at equal
active parameters, bf16, fp32 and four FP8 recipes in their exact CPU emulation, shared
experts, capacity factors, Zipf-skewed routing) in one process, and expert-parallel steps
(``ExpertParallel`` over gloo, EP 2 and 4, p2p and all_to_all exchange, 1 and 2 chunks,
FP8 dispatch, hierarchical) in spawned process groups; calibrates ``torch_moe.perf`` on
this machine first (``calibrate(threads=(1,))``, the link inside each process group);
then compares every measured step with ``predict`` and prints the errors per regime,
the peak memory (from the profiler's allocator events) and saved activations against the
model, and the advisor's pick in each group of strategies measured on the same workload.

Timing protocol (a shared 2-vCPU VM whose CPU time moves by up to 2x for seconds at a
time when another tenant shares the core): every rank runs one torch thread; one process:
the thread's CPU time of a step, rounds interleaved over all configurations; process
groups: the slowest rank's wall time after a barrier, rounds interleaved. The
calibration's passes run between the single-process rounds (``calibrate(interleave=...)``,
one pass before each round; ``--no-interleave``: calibrate first, then sweep): the host's
speed drifts over minutes (the same GEMM grid measured 161 and 199 GFLOP/s in the
calibrations of two back-to-back runs), and a calibration taken before a 15-minute sweep
predicts the host it saw, not the one the sweep ran on. With
``--statistic median`` (the default) the predictions of a median calibration are compared
with each configuration's raw median step, the state a job sustains on this host; with
``--statistic min`` the calibration and the steps are minima, each round started through
the calibration's quiet-core gate and scaled to its reference state. The raw minimum and
median are printed for both.

The EP predictions use the parent's compute calibration and the link measured inside each
spawned group, including the EP layer's host work beyond alpha-beta
(``Link.exchange_overhead``, charged as ``ep_host``). The CPU kernels' measured decisions
(``torch_moe._ops._cpu_probe``) go through a decisions file
(``TORCH_MOE_CPU_PROBE_CACHE``, a temporary one unless set) that the parent fills before
spawning, so every rank runs the kernels the model assumed; ``--save`` keeps it beside the
measurements and ``--replay`` predicts with it (the peak model reads those decisions).

Routing: when D >= E the router is set so that a token's logits are ``log p_e`` plus Gumbel
noise: top-K then samples K distinct experts in proportion to p (uniform or Zipf), the
distribution the model's ``routing_skew`` describes; otherwise the random router's
measured loads are passed to the model.

    python benchmarks/bench_perf_model.py                       # everything (~25 min)
    python benchmarks/bench_perf_model.py --rounds 3 --skip-ep  # quicker
    python benchmarks/bench_perf_model.py --out benchmarks/results/perf_model_cpu_202612.md \\
        --png benchmarks/results/perf_model_cpu_202612
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_moe  # noqa: F401
from torch_moe.nn import MoE
from torch_moe.perf import Hardware, MoEWorkload, advise, calibrate, cpu_isa, predict

FP8 = torch.float8_e4m3fn
# one torch thread per rank; three passes (the statistic of each figure over them), more
# than the 60-s default allows: the sweep runs for many minutes anyway. Interleaved with
# the sweep (the default), one pass before each of its rounds instead.
CALIBRATION: dict[str, Any] = dict(threads=(1,), passes=3, budget_s=600.0)


@dataclass
class Config:
    name: str
    tokens: int
    dim: int
    hidden: int
    experts: int
    top_k: int
    precision: str = "bf16"
    shared: int = 0
    capacity: float | None = None
    skew: float = 0.0
    dtype: str = "bf16"
    regime: str = ""
    # expert parallelism (world > 1)
    world: int = 1
    num_chunks: int = 1
    exchange: str = "p2p"
    fp8_dispatch: bool = False
    node_size: int = 0
    # results
    measured: dict[str, float] = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float32 if self.dtype == "fp32" else torch.bfloat16

    @property
    def tokens_per_expert(self) -> float:
        return self.tokens * self.top_k * self.world / self.experts

    def label(self) -> str:
        parts = [f"T={self.tokens} D={self.dim} F={self.hidden} E={self.experts} K={self.top_k}"]
        if self.precision != "bf16" or self.dtype != "bf16":
            parts.append(self.precision if self.dtype == "bf16" else self.dtype)
        if self.shared:
            parts.append(f"Fs={self.shared}")
        if self.capacity is not None:
            parts.append(f"cf={self.capacity:g}")
        if self.skew:
            parts.append(f"zipf{self.skew:g}")
        if self.world > 1:
            ep = f"EP{self.world} {self.exchange} C={self.num_chunks}"
            ep += " fp8-disp" if self.fp8_dispatch else ""
            ep += f" hier{self.node_size}" if self.node_size else ""
            parts.append(ep)
        return " ".join(parts)


def single_process_configs() -> list[Config]:
    c: list[Config] = []
    # granularity at equal active parameters (K*F = 1024, D = 512, T = 2048)
    for e, k, f in [
        (8, 1, 1024),
        (16, 2, 512),
        (32, 4, 256),
        (64, 8, 128),
        (128, 8, 128),
        (256, 8, 128),
    ]:
        c.append(Config(f"gran-E{e}K{k}", 2048, 512, f, e, k, regime="granularity"))
    # tokens per expert 2 .. 4096
    for t in (16, 128, 512, 2048, 8192):
        c.append(Config(f"tpe-T{t}", t, 256, 256, 16, 2, regime="tokens/expert"))
    c.append(Config("tpe-E4T8192", 8192, 256, 256, 4, 2, regime="tokens/expert"))
    c.append(Config("tpe-E256K1", 512, 256, 64, 256, 1, regime="tokens/expert"))
    c.append(Config("tpe-E128K8", 2048, 256, 64, 128, 8, regime="tokens/expert"))
    # K and D
    for k in (1, 4, 8):
        c.append(Config(f"k-K{k}", 1024, 256, 256, 32, k, regime="top-k"))
    for d in (128, 512, 1024):
        c.append(Config(f"d-D{d}", 1024, d, 512, 16, 2, regime="dim"))
    # precision (cases: the same workload in bf16 and the recipes)
    for p in ("fp8_rowwise", "fp8_blockwise", "mxfp8", "fp8_tensorwise"):
        c.append(Config(f"prec1-{p}", 2048, 256, 256, 16, 2, precision=p, regime="fp8"))
    for p in ("bf16", "fp8_rowwise", "fp8_blockwise", "mxfp8"):
        c.append(
            Config(
                f"prec2-{p}",
                1024,
                512,
                512,
                8,
                2,
                precision=p,
                regime="fp8" if p != "bf16" else "bf16",
            )
        )
    for p in ("bf16", "fp8_rowwise", "fp8_blockwise", "mxfp8"):
        c.append(
            Config(
                f"prec3-{p}",
                512,
                256,
                128,
                64,
                4,
                precision=p,
                regime="fp8" if p != "bf16" else "bf16",
            )
        )
    # shared experts, fp32
    c.append(Config("shared-1", 2048, 256, 256, 16, 2, shared=512, regime="shared"))
    c.append(Config("shared-2", 1024, 512, 128, 64, 6, shared=256, regime="shared"))
    c.append(Config("fp32-1", 1024, 256, 256, 16, 2, dtype="fp32", precision="bf16", regime="fp32"))
    # skewed routing, capacity vs dropless
    for cf in (None, 1.0, 1.25):
        tag = "dropless" if cf is None else f"cf{cf:g}"
        c.append(
            Config(
                f"cap1-{tag}", 2048, 256, 256, 16, 2, capacity=cf, skew=1.2, regime="skew/capacity"
            )
        )
    for cf in (None, 1.0, 1.25):
        tag = "dropless" if cf is None else f"cf{cf:g}"
        c.append(
            Config(
                f"cap2-{tag}", 1024, 256, 512, 32, 4, capacity=cf, skew=1.0, regime="skew/capacity"
            )
        )
    c.append(Config("zipf-1.5", 2048, 256, 128, 64, 4, skew=1.5, regime="skew/capacity"))
    return c


def ep_configs(world: int) -> list[Config]:
    c: list[Config] = []
    if world == 2:
        shapes = {
            "a": (1024, 256, 256, 16, 2),
            "b": (512, 256, 128, 64, 4),
            "c": (2048, 512, 512, 8, 2),
        }
    else:
        shapes = {"a": (512, 256, 256, 16, 2), "b": (256, 256, 128, 64, 4)}
    for s, (t, d, f, e, k) in shapes.items():
        for ex in ("p2p", "all_to_all"):
            for ch in (1, 2):
                c.append(
                    Config(
                        f"ep{world}{s}-{ex}-C{ch}",
                        t,
                        d,
                        f,
                        e,
                        k,
                        world=world,
                        exchange=ex,
                        num_chunks=ch,
                        regime=f"EP{world}",
                    )
                )
    t, d, f, e, k = shapes["a"]
    if world == 2:
        c.append(
            Config(
                f"ep{world}a-p2p-fp8",
                t,
                d,
                f,
                e,
                k,
                world=world,
                fp8_dispatch=True,
                regime=f"EP{world}",
            )
        )
    else:
        c.append(
            Config(
                f"ep{world}a-hier",
                t,
                d,
                f,
                e,
                k,
                world=world,
                exchange="all_to_all",
                node_size=2,
                regime=f"EP{world}",
            )
        )
    return c


# advisor cases: (name, config names, advise() keyword arguments)
def advisor_cases() -> list[tuple[str, list[str], dict[str, Any]]]:
    precs = ["bf16", "fp8_rowwise", "fp8_blockwise", "mxfp8"]
    cases = [
        (
            "precision T=2048 E=16",
            ["tpe-T2048", *[f"prec1-{p}" for p in precs[1:]], "prec1-fp8_tensorwise"],
            dict(precisions=[*precs, "fp8_tensorwise"]),
        ),
        ("precision T=1024 E=8", [f"prec2-{p}" for p in precs], dict(precisions=precs)),
        ("precision T=512 E=64", [f"prec3-{p}" for p in precs], dict(precisions=precs)),
        (
            "capacity zipf1.2",
            ["cap1-dropless", "cap1-cf1", "cap1-cf1.25"],
            dict(allow_drop=True, precisions=["bf16"]),
        ),
        (
            "capacity zipf1.0",
            ["cap2-dropless", "cap2-cf1", "cap2-cf1.25"],
            dict(allow_drop=True, precisions=["bf16"]),
        ),
    ]
    for world, shapes in ((2, "abc"), (4, "ab")):
        for s in shapes:
            names = [f"ep{world}{s}-{ex}-C{ch}" for ex in ("p2p", "all_to_all") for ch in (1, 2)]
            cases.append((f"EP{world} shape {s}", names, dict(precisions=["bf16"])))
    cases.append(
        (
            "EP degree, global T=2048 E=16",
            ["tpe-T2048", "ep2a-p2p-C1", "ep4a-p2p-C1"],
            dict(precisions=["bf16"], split_tokens=True),
        )
    )
    cases.append(
        (
            "EP degree, global T=1024 E=64",
            ["prec3-bf16", "ep2b-p2p-C1", "ep4b-p2p-C1"],
            dict(precisions=["bf16"], split_tokens=True),
        )
    )
    return cases


# --------------------------------------------------------------------------------------
# building and timing one layer


def zipf(e: int, s: float) -> torch.Tensor:
    return torch.arange(1, e + 1, dtype=torch.float64) ** (-s)


def build(
    cfg: Config, seed: int, device: torch.device | str = "cpu"
) -> tuple[MoE, torch.Tensor, torch.Tensor, bool]:
    """The layer, its input and output gradient; Gumbel-controlled routing when D >= E. On
    another ``device`` the input and the gradient are the CPU's draws, moved there."""
    torch.manual_seed(seed)
    dtype = cfg.torch_dtype
    moe = MoE(
        cfg.dim,
        cfg.hidden,
        cfg.experts,
        cfg.top_k,
        route_norm=True,
        shared_hidden_dim=cfg.shared,
        capacity_factor=cfg.capacity,
        precision=cfg.precision,
        dtype=dtype,
        device=device,
    )
    x = torch.randn(cfg.tokens, cfg.dim, dtype=dtype) * 0.5
    controlled = cfg.dim >= cfg.experts
    if controlled:
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[:, : cfg.experts] = torch.eye(cfg.experts, dtype=dtype)
        g = torch.Generator().manual_seed(seed + 1)
        gumbel = -torch.log(
            -torch.log(torch.rand(cfg.tokens, cfg.experts, generator=g, dtype=torch.float64))
        )
        x[:, : cfg.experts] = (zipf(cfg.experts, cfg.skew).log() + gumbel).to(dtype)
    x = x.to(device).requires_grad_(True)
    grad = torch.randn(cfg.tokens, cfg.dim, dtype=dtype).to(device)
    return moe, x, grad, controlled


def step_fn(moe: MoE, x: torch.Tensor, grad: torch.Tensor):
    def step() -> None:
        moe.zero_grad(set_to_none=True)
        x.grad = None
        moe(x).backward(grad)

    return step


def peak_memory(moe: MoE, x: torch.Tensor, grad: torch.Tensor, steps: int = 5) -> float:
    """Peak bytes allocated above the start of a forward + backward (profiler allocator
    events), the last step's gradients freed before it starts: the least over ``steps``
    profiled steps.

    The profiler records the main thread's frees only. Under gloo's all_to_all the last
    reference to a collective's buffers is sometimes dropped on gloo's worker thread, and
    that free is in no event: the replay keeps the buffer live to the end of the step.
    Measured on EP=2 (T=2048, D=512, E=8): alternate steps of one rank peak at 38.2 MiB,
    with 8.0 MiB net at the step's end (the weight gradients), and at 46.2 / 54.2 MiB, with
    16.0 / 24.0 MiB net and two to four free events fewer; the p2p exchange and every
    single-process step give the same peak in every step (37.9 MiB here). A missing free
    only ever adds, so the least of a few steps is the step's peak."""
    peaks = []
    for _ in range(steps):
        moe.zero_grad(set_to_none=True)
        x.grad = None
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            moe(x).backward(grad)
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        total = peak = 0
        for e in events:
            total += e.nbytes()
            peak = max(peak, total)
        peaks.append(peak)
    return float(min(peaks))


def saved_bytes(moe: MoE, x: torch.Tensor) -> float:
    params = {
        (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
        for p in moe.parameters()
    }
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe(x)
    return float(sum(seen.values()))


def resident_bytes(moe: MoE, x: torch.Tensor) -> float:
    n = 0
    for p in moe.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        n += t.numel() * t.element_size()
    return float(n + 2 * x.numel() * x.element_size())  # + input and output gradient


def workload_of(
    cfg: Config, moe: MoE, controlled: bool, tokens_per_expert: torch.Tensor | None
) -> MoEWorkload:
    skew: Any = cfg.skew
    if not controlled and tokens_per_expert is not None:
        skew = tokens_per_expert.double().clamp_min(1e-3)
    return MoEWorkload(
        cfg.tokens,
        cfg.dim,
        cfg.hidden,
        cfg.experts,
        cfg.top_k,
        shared_hidden_dim=cfg.shared,
        dtype=cfg.torch_dtype,
        precision=cfg.precision,
        ep=cfg.world,
        nodes=max(1, cfg.world // cfg.node_size) if cfg.node_size else 1,
        num_chunks=cfg.num_chunks,
        exchange=cfg.exchange,
        capacity_factor=cfg.capacity,
        routing_skew=skew,
        dispatch_dtype=FP8 if cfg.fp8_dispatch else None,
        hierarchical=bool(cfg.node_size),
    )


def _normalized(times: list[float], probes: list[float], reference: float) -> float:
    """The median over samples of ``t * min(1, reference / probe)``: each sample scaled to
    the calibration's reference state of the host (see ``torch_moe.perf._calibrate._Samples``)."""
    if not reference > 0:
        return statistics.median(times)
    return statistics.median(t * min(1.0, reference / p) for t, p in zip(times, probes))


class SingleSweep:
    """The single-process configurations' steps, measured one round at a time (so that the
    calibration's passes can run between the rounds: ``calibrate(interleave=...)``).

    Every config's step: one sample of the thread's CPU time per round, the configs in a
    shuffled order per round, each sample the second of two back-to-back steps (warm: the
    first re-creates the oneDNN primitives the other configs evicted; its time is kept as
    ``cold``) and started through the calibration's gate (up to 3 s of waiting for an
    undisturbed core), the gate's probe (a small MoE layer step) timed right before and
    after it. :meth:`finish` reports the minimum and the median of the raw samples, and the
    median of the samples scaled to the calibration's reference state (``reference /
    probe``)."""

    def __init__(self, configs: list[Config]) -> None:
        self.configs = configs
        self.steps: dict[str, Any] = {}
        self.workloads: dict[str, MoEWorkload] = {}
        for i, cfg in enumerate(configs):
            moe, x, grad, controlled = build(cfg, seed=i)
            moe.train()
            step = step_fn(moe, x, grad)
            moe.reset_load_stats()
            step()
            loads = moe.tokens_per_expert.clone()
            step()
            self.workloads[cfg.name] = workload_of(cfg, moe, controlled, loads)
            cfg.measured["saved"] = saved_bytes(moe, x)
            cfg.measured["peak"] = resident_bytes(moe, x) + peak_memory(moe, x, grad)
            self.steps[cfg.name] = step
        self.times: dict[str, list[float]] = {c.name: [] for c in configs}
        self.probes: dict[str, list[float]] = {c.name: [] for c in configs}
        self.cold: dict[str, list[float]] = {c.name: [] for c in configs}
        self.rounds = 0
        self.start = time.perf_counter()

    def round(self, _pass: int = -1) -> None:
        """One sample of every config (the argument: the calibration pass it follows)."""
        from torch_moe.perf._calibrate import _GATE as gate  # the calibration's gate

        gate.max_wait, gate.left = 3.0, math.inf
        torch.set_num_threads(1)
        order = list(self.configs)
        random.Random(self.rounds).shuffle(order)
        for cfg in order:
            gate.wait()
            before = gate.last
            t0 = time.thread_time()
            self.steps[cfg.name]()
            self.cold[cfg.name].append(time.thread_time() - t0)
            t0 = time.thread_time()
            self.steps[cfg.name]()
            self.times[cfg.name].append(time.thread_time() - t0)
            self.probes[cfg.name].append(0.5 * (before + gate.probe()))
        self.rounds += 1
        print(
            f"  round {self.rounds}: {time.perf_counter() - self.start:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    def finish(self, reference: float) -> dict[str, MoEWorkload]:
        for cfg in self.configs:
            t, p = self.times[cfg.name], self.probes[cfg.name]
            cfg.measured["min"] = min(t)
            cfg.measured["median"] = statistics.median(t)
            cfg.measured["time"] = _normalized(t, p, reference)
            cfg.measured["clean"] = sum(q <= 1.12 * reference for q in p)
            cfg.measured["cold"] = min(self.cold[cfg.name])
            cfg.measured["samples"] = len(t)
        return self.workloads


# --------------------------------------------------------------------------------------
# expert parallelism (spawned process groups)


def _ep_worker(
    rank: int, world: int, port: int, rounds: int, out_path: str, statistic: str, calib: dict
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from torch_moe.distributed import ExpertParallel

    # the compute part from the cache (the parent's statistic); the link measured here
    hw = calibrate(**calib, statistic=statistic)
    mesh = init_device_mesh("cpu", (world,))
    configs = ep_configs(world)
    steps, info = {}, {}
    for i, cfg in enumerate(configs):
        moe, x, grad, controlled = build(cfg, seed=100 * i + rank)
        style = ExpertParallel(
            num_chunks=cfg.num_chunks,
            exchange=cfg.exchange,
            dispatch_dtype=FP8 if cfg.fp8_dispatch else None,
            node_size=cfg.node_size or None,
        )
        parallelize_module(moe, mesh, style)
        step = step_fn(moe, x, grad)
        step()
        step()
        saved = saved_bytes(moe, x)
        peak = resident_bytes(moe, x) + peak_memory(moe, x, grad)
        stats = torch.tensor([saved, peak], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        info[cfg.name] = dict(saved=float(stats[0]), peak=float(stats[1]), controlled=controlled)
        steps[cfg.name] = step
    from torch_moe.perf._calibrate import _Gate

    gate = _Gate(max_wait=3.0, total_wait=math.inf)
    if rank == 0:
        gate.settle(3.0)
    dist.barrier()
    times = torch.zeros(len(configs), rounds, dtype=torch.float64)
    probes = torch.zeros(len(configs), rounds, dtype=torch.float64)
    flag = torch.zeros(1)
    for r in range(rounds):
        for i, cfg in enumerate(configs):
            if rank == 0:  # wait for a quiet host (the other ranks wait in the broadcast)
                gate.wait()
            dist.broadcast(flag, 0)
            steps[cfg.name]()  # warm: see measure_single
            dist.barrier()
            t0 = time.perf_counter()
            steps[cfg.name]()
            times[i, r] = time.perf_counter() - t0
            dist.barrier()
            if rank == 0:
                probes[i, r] = 0.5 * (gate.last + gate.probe())
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if rank == 0:
        res = {}
        ref = hw.reference_probe
        for i, cfg in enumerate(configs):
            t, p = times[i].tolist(), probes[i].tolist()
            res[cfg.name] = dict(
                time=_normalized(t, p, ref),
                min=min(t),
                median=statistics.median(t),
                clean=sum(q <= 1.12 * ref for q in p),
                **info[cfg.name],
            )
        link = dataclasses.asdict(hw.intra_link)
        with open(out_path, "w") as f:
            json.dump(dict(results=res, link=link), f)
    dist.barrier()
    dist.destroy_process_group()


def measure_ep(
    world: int, rounds: int, statistic: str = "median", calib: dict | None = None
) -> tuple[list[Config], dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ep.json")
        port = 29600 + world + random.randint(0, 300)
        args = (world, port, rounds, out, statistic, calib or CALIBRATION)
        mp.spawn(_ep_worker, args=args, nprocs=world, join=True)
        with open(out) as f:
            data = json.load(f)
    configs = ep_configs(world)
    for cfg in configs:
        r = data["results"][cfg.name]
        cfg.measured.update(
            time=r["time"],
            min=r["min"],
            median=r["median"],
            saved=r["saved"],
            peak=r["peak"],
            clean=r["clean"],
        )
    return configs, data["link"]


# --------------------------------------------------------------------------------------
# reporting


def err(pred: float, meas: float) -> float:
    return pred / meas - 1


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return math.nan
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary_rows(rows: list[dict[str, Any]], key: str) -> list[str]:
    groups: dict[str, list[float]] = {}
    for r in rows:
        groups.setdefault(r["regime"], []).append(abs(r[key]))
    groups["all"] = [abs(r[key]) for r in rows]
    out = ["| regime | n | median abs err | p90 abs err | max abs err |", "|---|---|---|---|---|"]
    for g, v in groups.items():
        out.append(
            f"| {g} | {len(v)} | {statistics.median(v):.1%} | {quantile(v, 0.9):.1%} | {max(v):.1%} |"
        )
    return out


def scatter_png(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2))
    regimes = sorted({r["regime"] for r in rows})
    cmap = plt.get_cmap("tab10")
    for i, g in enumerate(regimes):
        pts = [r for r in rows if r["regime"] == g]
        axes[0].scatter(
            [r["meas"] * 1e3 for r in pts],
            [r["pred"] * 1e3 for r in pts],
            label=g,
            color=cmap(i % 10),
            s=28,
        )
        axes[1].scatter(
            [r["meas_mem"] / 2**20 for r in pts],
            [r["pred_mem"] / 2**20 for r in pts],
            label=g,
            color=cmap(i % 10),
            s=28,
        )
    for ax, what in ((axes[0], "step time (ms)"), (axes[1], "peak memory (MiB)")):
        lo = min(min(ax.get_xlim()), min(ax.get_ylim()))
        hi = max(max(ax.get_xlim()), max(ax.get_ylim()))
        xs = [lo, hi]
        ax.plot(xs, xs, "k-", lw=0.8)
        ax.plot(xs, [v * 1.1 for v in xs], "k:", lw=0.6)
        ax.plot(xs, [v / 1.1 for v in xs], "k:", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {what}")
        ax.set_ylabel(f"predicted {what}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_title("torch_moe.perf: predicted vs measured step (fwd+bwd)")
    axes[1].set_title("peak memory (dotted: +-10%)")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# the sparsity-regime study and the DeepSeek-V3 sanity check (predictions)


def deepseek_sanity() -> list[str]:
    """Predicted DeepSeek-V3 dispatch / combine at EP=64, 8 GPUs per node, next to DeepEP's
    published normal-mode bandwidths (H800 + CX7) and the V3 report's ~1:1 ratio."""
    from torch_moe.perf import Link

    # H800: H100 compute, NVLink ~160 GB/s per direction (DeepEP: "~160 GB/s NVLink maximum")
    nvlink = Link(0.96 * 160e9, 3e-6, 15e-6, "assumed: 0.96 x 160 GB/s (DeepEP intranode 153-158)")
    ib = Link(0.9 * 50e9, 10e-6, 30e-6, "assumed: 0.9 x 50 GB/s (CX7 400 Gb/s)")
    hw = Hardware.preset("h100", intra_link=nvlink, inter_link=ib)
    base = MoEWorkload(
        4096,
        7168,
        2048,
        256,
        8,
        shared_hidden_dim=2048,
        ep=64,
        nodes=8,
        node_limit=4,
        dispatch_dtype=FP8,
        backward=False,
        precision="fp8_blockwise",
    )
    out = [
        "| dispatch (torch_moe / DeepEP-style) | rows or tokens sent per rank | cross-node MB per rank | dispatch ms | combine ms | implied RDMA GB/s (dispatch) | MoE compute ms (fwd) | compute : comm |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dedup in (False, True):
        w = base.replace(dedup=dedup)
        p = predict(w, hw)
        comm = p.breakdown["dispatch"] + p.breakdown["combine"]
        compute = sum(
            v for k, v in p.breakdown.items() if k not in ("dispatch", "combine", "overlap")
        )
        nodes = w.distinct_nodes()
        if dedup:
            sent = 4096 * nodes * 7 / 8
            cross = sent * (7168 + 4 * 56) / 1e6
            label = f"DeepEP-style: token once per node ({nodes:.2f} nodes / token)"
        else:
            sent = 4096 * 8 * 7 / 8
            cross = sent * (7168 + 4 * 56) / 1e6
            label = "torch_moe: one row per (token, expert)"
        disp = p.breakdown["dispatch"]
        out.append(
            f"| {label} | {sent:.0f} | {cross:.1f} | {disp * 1e3:.2f} | {p.breakdown['combine'] * 1e3:.2f} | "
            f"{cross / 1e3 / disp:.1f} | {compute * 1e3:.2f} | {compute / comm:.2f} |"
        )
    return out


def study(rows: list[dict[str, Any]], hw_cpu: Hardware, png_prefix: str) -> list[str]:
    from torch_moe.perf._plot import regime_chart, regime_series

    lines = []
    # this CPU: the measured granularity and tokens-per-expert series with the model's
    base = MoEWorkload(2048, 512, 1024, 8, 1)
    series = regime_series(
        base, hw_cpu, precisions=("bf16", "fp8_blockwise"), tokens=(16, 128, 512, 2048, 8192)
    )
    by = {r["name"]: r for r in rows}
    gran = []
    for g, name in ((1, "gran-E8K1"), (2, "gran-E16K2"), (4, "gran-E32K4"), (8, "gran-E64K8")):
        if name in by:
            r = by[name]
            flops = 18 * 2048 * (g) * 512 * (1024 // g)
            gran.append(
                dict(
                    g=g,
                    per_token=r["meas"] / 2048,
                    roofline=flops / r["meas"] / hw_cpu.rate("bf16"),
                )
            )
    tok = []
    for t in (16, 128, 512, 2048, 8192):
        r = by.get(f"tpe-T{t}")
        if r:
            flops = 18 * t * 2 * 256 * 256
            tok.append(
                dict(tokens_per_expert=t * 2 / 16, roofline=flops / r["meas"] / hw_cpu.rate("bf16"))
            )
    measured = {
        "granularity": {"bf16, one device": gran},
        "tokens": {"bf16 (D=F=256, E=16, K=2)": tok},
    }
    base_tok = MoEWorkload(2048, 256, 256, 16, 2)
    series["tokens"] = regime_series(
        base_tok, hw_cpu, precisions=("bf16", "fp8_blockwise"), tokens=(16, 128, 512, 2048, 8192)
    )["tokens"]
    regime_chart(
        series,
        f"{png_prefix}_regimes_cpu.png",
        f"this CPU ({cpu_isa()}, 1 thread): predicted lines, measured crosses",
        measured,
    )
    lines.append(_series_table("CPU, D=512, T=2048, E0=8, K0=1, F0=1024 (predicted)", series))
    # H200: one GPU and a 64-GPU cluster, 8 per node
    h200 = Hardware.preset("h200")
    base = MoEWorkload(4096, 4096, 14336, 8, 1)
    one = regime_series(
        base, h200, precisions=("bf16", "fp8_blockwise"), tokens=(512, 2048, 8192, 32768)
    )
    regime_chart(
        one,
        f"{png_prefix}_regimes_h200.png",
        "H200 (predicted): D=4096, T=4096, E0=8, K0=1, F0=14336",
    )
    lines.append(_series_table("H200, one GPU (predicted)", one))
    cluster = regime_series(
        base,
        h200,
        world_size=64,
        gpus_per_node=8,
        precisions=("bf16", "fp8_blockwise"),
        tokens=(512, 2048, 8192, 32768),
    )
    regime_chart(
        cluster,
        f"{png_prefix}_regimes_h200x64.png",
        "64 x H200, 8 per node (predicted; best strategy per point)",
    )
    lines.append(
        _series_table("64 x H200, 8 per node (predicted, advisor's best per point)", cluster)
    )
    return lines


def _series_table(title: str, series: dict[str, Any]) -> str:
    rows = [
        f"### {title}\n",
        "| line | g | E | K | F | us per token | roofline fraction | peak+Adam GiB | strategy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, pts in series["granularity"].items():
        for p in pts:
            rows.append(
                f"| {label} | {p['g']} | {p['experts']} | {p['top_k']} | {p['hidden']} | "
                f"{p['per_token'] * 1e6:.3f} | {p['roofline']:.3f} | {p['memory'] / 2**30:.2f} | {p['strategy']} |"
            )
    rows.append("\n| line | tokens | tokens per expert | ms | roofline fraction |")
    rows.append("|---|---|---|---|---|")
    for label, pts in series["tokens"].items():
        for p in pts:
            rows.append(
                f"| {label} | {p['tokens']} | {p['tokens_per_expert']:.0f} | {p['time'] * 1e3:.3f} | {p['roofline']:.3f} |"
            )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (samples)")
    p.add_argument("--ep-rounds", type=int, default=7)
    p.add_argument("--skip-ep", action="store_true")
    p.add_argument("--recalibrate", action="store_true", help="ignore the calibration cache")
    p.add_argument(
        "--statistic",
        choices=["median", "min"],
        default="median",
        help="calibrate(statistic=...): median (the sustained state; predictions compared with "
        "the steps' raw medians) or min (the quiet machine; compared with the steps scaled to "
        "the calibration's reference state)",
    )
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--png", help="prefix of the PNG files (scatter, regime charts)")
    p.add_argument("--save", help="save the raw measurements (JSON) here")
    p.add_argument(
        "--replay", help="report from saved raw measurements instead of measuring (no timing)"
    )
    p.add_argument("--study", action="store_true", help="add the sparsity-regime study")
    p.add_argument("--only", help="measure only the configurations whose name matches (regex)")
    p.add_argument(
        "--no-interleave",
        action="store_true",
        help="calibrate first, then sweep (default: one calibration pass before each round)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    from torch_moe._ops import _cpu_probe

    # the CPU kernels' measured decisions (GEMM paths, the SwiGLU's activation chunk, whole
    # or loop) on disk, so that the spawned EP ranks take the ones this process (and the
    # model's predictions) took: decided in each rank anew, a near-tie flips between runs
    # and ranks, and the activation chunk alone moves a rank's peak by megabytes
    probe_dir = None
    if not os.environ.get(_cpu_probe.ENV_CACHE):
        probe_dir = tempfile.TemporaryDirectory(prefix="torch_moe_probe_")
        os.environ[_cpu_probe.ENV_CACHE] = os.path.join(probe_dir.name, "decisions.json")
        # a replay predicts with the decisions its run took (saved beside the measurements)
        if args.replay and os.path.exists(args.replay + ".decisions.json"):
            shutil.copyfile(args.replay + ".decisions.json", os.environ[_cpu_probe.ENV_CACHE])
    head = (
        f"# torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
        f"CPU {_cpu_name()} [{cpu_isa()}], {os.cpu_count()} CPUs, 1 torch thread per process"
    )
    print(head, flush=True)
    from torch_moe.perf import Link, _calibrate

    configs = single_process_configs()
    if args.only:
        import re

        configs = [c for c in configs if re.search(args.only, c.name)]
    all_configs = list(configs)
    loads: dict[str, list[float] | None] = {}
    links: dict[int, Link] = {}
    interleave = not (args.replay or args.no_interleave)
    # interleaved: one calibration pass before each round of the sweep, the statistic of
    # both over the same stretch of the host's drift; the EP ranks read that calibration
    calib = dict(CALIBRATION, passes=args.rounds) if interleave else dict(CALIBRATION)
    sweep = None
    if interleave:
        print(f"# building {len(configs)} single-process configurations", flush=True)
        sweep = SingleSweep(configs)
    t0 = time.time()
    _calibrate._GATE.max_wait = 10.0  # patient: wait up to 10 s per batch for a quiet core
    hw = calibrate(
        **calib,
        statistic=args.statistic,
        refresh=args.recalibrate and not args.replay,
        interleave=sweep.round if sweep is not None else None,
    )
    print(
        f"# calibrate: {time.time() - t0:.1f} s ({hw.sources['gemm']}); bf16 NT mm "
        f"{hw.gemm_rate['bf16'] / 1e9:.0f} GFLOP/s, fp32 {hw.gemm_rate['fp32'] / 1e9:.0f}; "
        f"copy {hw.mem_bandwidth / 1e9:.1f} GB/s; overhead bf16 fwd+bwd "
        f"{hw.overhead(1, 'bf16.fwdbwd')[0] * 1e3:.2f} ms + "
        f"{hw.overhead(1, 'bf16.fwdbwd')[1] * 1e6:.0f} us per group",
        flush=True,
    )
    if args.replay:
        with open(args.replay) as f:
            raw = json.load(f)
        ep_all = [c for world in (2, 4) for c in ep_configs(world)]
        by = {c.name: c for c in configs + ep_all}
        all_configs = [by[n] for n in raw["measured"] if n in by]
        for c in all_configs:
            c.measured.update(raw["measured"][c.name])
        loads = raw["loads"]
        links = {int(k): Link(**v) for k, v in raw["links"].items()}
        head = raw["head"]
        if os.path.exists(args.replay + ".hardware.json"):
            with open(args.replay + ".hardware.json") as f:
                hw = Hardware.from_json(f.read())
    else:
        if sweep is None:
            print(f"# measuring {len(configs)} single-process configurations", flush=True)
            sweep = SingleSweep(configs)
        while sweep.rounds < args.rounds:  # all of them, or those the budget cut short
            sweep.round()
        for name, w in sweep.finish(hw.reference_probe).items():
            loads[name] = list(w.routing_skew) if isinstance(w.routing_skew, tuple) else None
        if not args.skip_ep:
            for world in (2, 4):
                for cfg in ep_configs(world):  # their decisions made here, read by the ranks
                    w = workload_of(cfg, None, cfg.dim >= cfg.experts, None)
                    predict(w, hw, ranks_on_host=world)
                t1 = time.time()
                eps, link = measure_ep(world, args.ep_rounds, args.statistic, calib)
                print(f"# EP world {world}: {time.time() - t1:.0f} s; link {link}", flush=True)
                links[world] = Link(**link)
                all_configs += eps
                for cfg in eps:
                    loads[cfg.name] = None
        # with the min statistic, calibrate again after the sweep and keep each figure's
        # minimum: the calibration then spans the same hour of a shared host as the
        # measurements it predicts (a median calibration already describes that state)
        if args.recalibrate and args.statistic == "min" and not interleave:
            again = calibrate(**CALIBRATION, statistic="min", refresh=True)
            hw = merge_min(hw, again)
            print(f"# second calibration merged: {hw.sources['gemm']}", flush=True)
        if args.save:
            hw_path = args.save + ".hardware.json"
            with open(hw_path, "w") as f:
                f.write(hw.to_json())
            if os.path.exists(os.environ[_cpu_probe.ENV_CACHE]):
                shutil.copyfile(os.environ[_cpu_probe.ENV_CACHE], args.save + ".decisions.json")
            with open(args.save, "w") as f:
                json.dump(
                    dict(
                        head=head,
                        measured={c.name: c.measured for c in all_configs},
                        loads=loads,
                        links={k: dataclasses.asdict(v) for k, v in links.items()},
                    ),
                    f,
                    indent=1,
                )
    hws: dict[int, Hardware] = {1: hw}
    for world, link in links.items():
        hws[world] = hw.replace(intra_link=link, inter_link=link)
    workloads = {}
    for cfg in all_configs:
        controlled = cfg.dim >= cfg.experts
        ld = loads.get(cfg.name)
        workloads[cfg.name] = workload_of(
            cfg, None, controlled, None if ld is None else torch.tensor(ld)
        )

    if args.statistic == "median":  # what the median calibration predicts: the raw median
        for cfg in all_configs:
            cfg.measured["scaled"] = cfg.measured["time"]
            cfg.measured["time"] = cfg.measured["median"]
    rows = []
    for cfg in all_configs:
        w = workloads[cfg.name]
        pr = predict(w, hws[cfg.world], ranks_on_host=cfg.world)
        rows.append(
            dict(
                name=cfg.name,
                label=cfg.label(),
                regime=cfg.regime,
                world=cfg.world,
                tpe=cfg.tokens_per_expert,
                meas=cfg.measured["time"],
                raw_min=cfg.measured.get("min", cfg.measured["time"]),
                median=cfg.measured["median"],
                clean=cfg.measured.get("clean", 0),
                cold=cfg.measured.get("cold", math.nan),
                pred=pr.time,
                err=err(pr.time, cfg.measured["time"]),
                err_min=err(pr.time, cfg.measured.get("min", cfg.measured["time"])),
                err_median=err(pr.time, cfg.measured["median"]),
                meas_mem=cfg.measured["peak"],
                pred_mem=pr.memory["peak"],
                mem_err=err(pr.memory["peak"], cfg.measured["peak"]),
                meas_saved=cfg.measured["saved"],
                pred_saved=pr.memory["activations"],
                breakdown=dict(pr.breakdown),
            )
        )
    lines = report(rows, all_configs, workloads, hws, head, args.statistic)
    if args.png:
        scatter_png(rows, args.png + "_scatter.png")
    if args.study:
        lines.append(
            "\n## Sparsity-regime study (predicted; CPU lines against the measured points)\n"
        )
        lines += study(rows, hw, args.png or "perf_model")
        lines.append("\n## DeepSeek-V3 sanity check (predicted, EP=64, 8 per node, forward)\n")
        lines += deepseek_sanity()
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


def report(
    rows: list[dict[str, Any]],
    all_configs: list[Config],
    workloads: dict[str, MoEWorkload],
    hws: dict[int, Hardware],
    head: str,
    statistic: str = "min",
) -> list[str]:
    lines = [head, ""]
    lines.append("## Every configuration\n")
    measured = (
        "the raw median of the samples (the calibration's statistic: median)"
        if statistic == "median"
        else "the median of the samples scaled to the calibration's reference state"
    )
    lines.append(
        f"measured: {measured}; raw min / raw median: unscaled; clean: samples whose probe "
        "was within 12% of the reference; cold / warm: the first step after other configs "
        "over the measured one.\n"
    )
    lines.append(
        "| config | tok/expert | clean | measured ms | raw min | raw median | cold / warm | "
        "predicted ms | error | error vs raw min | error vs raw median | peak MiB meas | "
        "pred | error | saved KiB meas | pred |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['tpe']:.0f} | {r['clean']} | {r['meas'] * 1e3:.2f} | "
            f"{r['raw_min'] * 1e3:.2f} | {r['median'] * 1e3:.2f} | "
            f"{r['cold'] / r['raw_min']:.2f} | {r['pred'] * 1e3:.2f} | {r['err']:+.1%} | "
            f"{r['err_min']:+.1%} | {r['err_median']:+.1%} | {r['meas_mem'] / 2**20:.1f} | {r['pred_mem'] / 2**20:.1f} | "
            f"{r['mem_err']:+.1%} | {r['meas_saved'] / 1024:.0f} | {r['pred_saved'] / 1024:.0f} |"
        )
    lines.append("\n## Advisor: pick vs the best measured strategy\n")
    lines.append("| case | measured best | advisor pick | pick's measured / best | within 5% |")
    lines.append("|---|---|---|---|---|")
    by_name = {c.name: c for c in all_configs}
    hits = total = 0
    for case, names, kw in advisor_cases():
        if any(n not in by_name for n in names):
            continue
        cands = [by_name[n] for n in names]
        best = min(cands, key=lambda c: c.measured["time"])
        pick = _advisor_pick(cands, workloads, hws, kw)
        ratio = pick.measured["time"] / best.measured["time"]
        ok = ratio <= 1.05
        hits += ok
        total += 1
        lines.append(
            f"| {case} | {best.label()} | {pick.label()} | {ratio:.3f} | {'yes' if ok else 'no'} |"
        )
    lines.append(f"\nAdvisor within 5% of the measured best: {hits} of {total} cases.")
    lines.append(
        "\n## Errors per regime: step time against 'measured' (target: median <= 10%, p90 <= 25%)\n"
    )
    lines += summary_rows(rows, "err")
    lines.append("\nThe same against the raw minimum (no scaling):\n")
    lines += summary_rows(rows, "err_min")
    lines.append("\nThe same against the raw median (no scaling; the host's noise included):\n")
    lines += summary_rows(rows, "err_median")
    lines.append("\n## Errors per regime: peak memory (target: within 5%)\n")
    lines += summary_rows(rows, "mem_err")
    return lines


def _advisor_pick(
    cands: list[Config],
    workloads: dict[str, MoEWorkload],
    hws: dict[int, Hardware],
    kw: dict[str, Any],
) -> Config:
    """Run advise() over exactly the measured strategies of one case; map its pick back."""
    base = workloads[cands[0].name]
    split = kw.get("split_tokens", False)
    worlds = sorted({c.world for c in cands})
    hw = hws[max(worlds)]
    if split:
        hw = hw.replace(host_links={w: hws[w].intra_link for w in worlds if w > 1})
        base = base.replace(
            tokens=cands[0].tokens * cands[0].world, ep=1, num_chunks=1, exchange="p2p"
        )
    space: dict[str, list[Any]] = {
        "ep": sorted({c.world for c in cands}),
        "num_chunks": sorted({c.num_chunks for c in cands}),
        "exchange": sorted({c.exchange for c in cands}),
        "precision": sorted({c.precision for c in cands}),
        "dispatch_dtype": [None],
        "hierarchical": [False],
        "num_redundant": [0],
    }
    caps = sorted({c.capacity for c in cands}, key=lambda v: -1 if v is None else v)
    if any(c is not None for c in caps):
        space["capacity_factor"] = caps
    advice = advise(
        base,
        hw,
        world_size=max(worlds),
        gpus_per_node=max(worlds),
        space=space,
        memory_limit=math.inf,
        **kw,
    )
    for cand in advice.candidates:
        s = cand.strategy
        for c in cands:
            if (
                (s.ep, s.num_chunks, s.exchange, s.precision, s.capacity_factor)
                == (c.world, c.num_chunks, c.exchange, c.precision, c.capacity)
                and s.dispatch_dtype is None
                and not s.hierarchical
                and s.num_redundant == 0
            ):
                return c
    raise RuntimeError("advisor picked nothing among the measured strategies")


def merge_min(a: Hardware, b: Hardware) -> Hardware:
    """Every measured figure's minimum over two calibrations of the same machine."""
    from torch_moe.perf import GemmTable, RateTable

    gemm = {
        k: GemmTable(t.ms, t.ks, t.ns, tuple(map(min, t.seconds, b.gemm_tables[k].seconds)))
        for k, t in a.gemm_tables.items()
    }
    kern = {
        k: RateTable(t.sizes, tuple(map(min, t.seconds, b.kernel_tables[k].seconds)))
        for k, t in a.kernel_tables.items()
    }
    ovh = {
        k: (min(v[0], b.overheads[k][0]), min(v[1], b.overheads[k][1]))
        for k, v in a.overheads.items()
    }
    sources = dict(a.sources, gemm=a.sources["gemm"] + "; min with a second calibration")
    return a.replace(
        gemm_tables=gemm,
        kernel_tables=kern,
        overheads=ovh,
        mem_bandwidth=max(a.mem_bandwidth, b.mem_bandwidth),
        gemm_rate={k: max(v, b.gemm_rate[k]) for k, v in a.gemm_rate.items()},
        sources=sources,
    )


def _cpu_name() -> str:
    from torch_moe.perf._calibrate import _cpu_model

    return _cpu_model()


if __name__ == "__main__":
    main()
