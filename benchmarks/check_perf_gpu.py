"""Does torch_moe.perf predict a MoE layer step on a CUDA GPU?

Measures on the device, for a sweep of 16 ``torch_moe.nn.MoE`` layers (D 2048-7168, F 768-2048, E 8-128, K 2-8, T 2048-8192: coarse
and fine-grained experts, 64 to 4096 tokens per expert, bf16 with uniform and Zipf-skewed
routing, ``fp8_rowwise`` and ``fp8_blockwise``) the time of one forward + backward step and
its peak memory. Then compares each step with ``torch_moe.perf.predict`` on:

(a) ``Hardware.preset("h200")`` as it is (this repository's H200 measurements of 2026-11);
(b) ``torch_moe.perf.calibrate(device="cuda")``: this GPU measured with the library's own
    calls (grouped GEMMs in bf16 / fp32, each recipe's scaled GEMMs, every elementwise and
    quantize kernel, copy bandwidth, launch cost; ~10 s, longer where its Triton kernels
    compile), tile rows and links from the GPU's preset.

Time: the median of ``triton.testing.do_bench`` (CUDA events, the L2 flushed before each
call, a window of at least ``--reps`` steps and 100 ms). Peak: the caching allocator's
``max_memory_allocated`` during one step above what was allocated before it (the last step's
gradients freed), plus the parameters, the input and the output gradient, as the model's
``Prediction.memory["peak"]`` counts them (``bench_perf_model.resident_bytes``). Routing as
``bench_perf_model.py``: a token's router logits are ``log p_e`` plus Gumbel noise, so top-K
samples K distinct experts in proportion to p, the distribution ``routing_skew`` describes.
Errors: predicted / measured - 1; targets: median |error| <= 10% and p90 <= 25% for time,
every configuration within 5% for peak memory (``bench_perf_model.py``'s).

Each configuration that fails prints its error and the sweep goes on; configurations
left when ``--budget-s`` has passed are skipped (the report is still written). One layer
of each FP8 recipe runs early (a cut run still has both), the rest after the bf16 ones.

    python benchmarks/check_perf_gpu.py --out perf_gpu.md     # CUDA: ~60-90 s on an H200
    python benchmarks/check_perf_gpu.py --only 'E128|fp8'     # a subset (regex on the label)
    python benchmarks/check_perf_gpu.py --profile 6           # + the top kernels of 6 steps
    python benchmarks/check_perf_gpu.py --device cpu --quick  # smoke test, seconds

On a CPU (a smoke test of the script; ``--quick`` implied: three tiny layers), (a) is
``torch_moe.perf.calibrate(quick=True)`` of this CPU and (b) the GPU calibration's code run
on the CPU device (its numbers mean nothing there: it runs the code path); times are
medians of ``--reps`` wall-clock steps, the peak from the profiler's allocator events.
"""

from __future__ import annotations

import argparse
import gc
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_ops import interleaved
from bench_perf_model import (
    Config,
    build,
    err,
    peak_memory,
    quantile,
    resident_bytes,
    step_fn,
    summary_rows,
    workload_of,
)

from torch_moe.nn import MoE
from torch_moe.perf import Hardware, MoEWorkload, Prediction, _calibrate_gpu, calibrate, predict

TIME_TARGET = (0.10, 0.25)  # median, p90 of |error|
MEMORY_TARGET = 0.05  # every configuration


def gpu_configs() -> list[Config]:
    """16 layers at GPU scale: bf16 (coarse to fine experts), Zipf routing, FP8 recipes."""
    bf16, skew, fp8 = "bf16", "bf16 zipf", "fp8"
    return [
        # coarse experts: 1024-4096 tokens per expert
        Config("coarse-E8K4", 8192, 4096, 2048, 8, 4, regime=bf16),
        Config("coarse-E8K2", 8192, 4096, 2048, 8, 2, regime=bf16),
        Config("mid-E32K4", 8192, 2048, 1408, 32, 4, regime=bf16),
        Config("mid-E32K2", 2048, 7168, 2048, 32, 2, regime=bf16),
        # one layer of each FP8 recipe early, so that a cut run still has them
        Config("row-E8K2", 8192, 4096, 2048, 8, 2, precision="fp8_rowwise", regime=fp8),
        Config("block-E128K8", 4096, 7168, 2048, 128, 8, precision="fp8_blockwise", regime=fp8),
        # fine-grained experts: 64-1024 tokens per expert
        Config("dsv3-E64K8", 8192, 7168, 2048, 64, 8, regime=bf16),
        Config("dsv3-E128K8", 4096, 7168, 2048, 128, 8, regime=bf16),
        Config("qwen-E128K8-T4096", 4096, 2048, 768, 128, 8, regime=bf16),
        Config("qwen-E128K8-T2048", 2048, 2048, 768, 128, 8, regime=bf16),
        Config("fine-E128K4", 2048, 4096, 1408, 128, 4, regime=bf16),
        Config("fine-E64K8", 4096, 2048, 1408, 64, 8, regime=bf16),
        # skewed routing (Zipf popularity)
        Config("zipf-E64K4", 4096, 2048, 768, 64, 4, skew=1.0, regime=skew),
        Config("zipf-E32K4", 8192, 4096, 1408, 32, 4, skew=1.2, regime=skew),
        # more FP8 layers on shapes of the bf16 rows above
        Config("row-E128K8", 4096, 2048, 768, 128, 8, precision="fp8_rowwise", regime=fp8),
        Config("block-E32K4", 8192, 2048, 1408, 32, 4, precision="fp8_blockwise", regime=fp8),
    ]


def quick_configs() -> list[Config]:
    """Three tiny layers (dims multiples of 128, as the FP8 recipes need)."""
    return [
        Config("quick-bf16", 256, 128, 128, 8, 2, regime="bf16"),
        Config("quick-zipf", 256, 128, 128, 16, 4, skew=1.0, regime="bf16 zipf"),
        Config("quick-fp8", 256, 128, 128, 8, 2, precision="fp8_rowwise", regime="fp8"),
    ]


# --------------------------------------------------------------------------------------
# measuring


def seconds_per_call(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of one call of ``fn`` (already warm): ``triton.testing.do_bench`` on
    CUDA over a window of at least ``reps`` calls and 100 ms; ``reps`` wall-clock calls
    on a CPU."""
    if device.type != "cuda":
        return interleaved({"fn": fn}, reps)["fn"]
    import triton.testing

    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    window_ms = max(100.0, reps * (time.perf_counter() - t0) * 1e3)
    ms = triton.testing.do_bench(fn, warmup=25, rep=window_ms, return_mode="median")
    return float(ms) / 1e3


def cuda_step_peak(moe: MoE, x: torch.Tensor, step: Callable[[], None]) -> float:
    """Bytes allocated at the peak of one step above what was allocated before it (the last
    step's gradients freed first)."""
    device = x.device
    moe.zero_grad(set_to_none=True)
    x.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return float(torch.cuda.max_memory_allocated(device) - before)


def measure(
    cfg: Config, seed: int, device: torch.device, reps: int, profile: bool = False
) -> tuple[float, float, MoEWorkload, list[tuple[str, float]]]:
    """(seconds of a forward + backward step, its peak bytes, the workload, its top kernels
    when ``profile``) of ``cfg``."""
    if cfg.dim < cfg.experts:
        raise ValueError(f"{cfg.name}: the controlled routing needs D >= E")
    moe, x, grad, _ = build(cfg, seed, device)
    moe.train()
    step = step_fn(moe, x, grad)
    step()  # Triton compiles, the allocator's blocks
    step()
    if device.type == "cuda":
        dynamic = cuda_step_peak(moe, x, step)
    else:
        dynamic = peak_memory(moe, x, grad)
    peak = resident_bytes(moe, x) + dynamic
    seconds = seconds_per_call(step, device, reps)
    kernels = profile_step(step, device) if profile else []
    return seconds, peak, workload_of(cfg, moe, True, None), kernels


def profile_step(
    step: Callable[[], None], device: torch.device, top: int = 12
) -> list[tuple[str, float]]:
    """The ``top`` kernels of one step by their own time (seconds), from torch.profiler: CUDA
    kernels on a GPU, CPU ops on a CPU (a smoke test)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    times = [(e.key, getattr(e, attr, 0.0) / 1e6) for e in prof.key_averages()]
    return sorted((t for t in times if t[1] > 0), key=lambda t: -t[1])[:top]


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------
# reporting


def report(
    head: list[str], hws: dict[str, Hardware], rows: list[dict[str, Any]], failed: list[str]
) -> list[str]:
    keys = list(hws)
    lines = [*head, ""]
    lines.append("## Step time (forward + backward)\n")
    lines.append(
        "| config | tok/expert | measured ms | routed TFLOP/s | "
        + " | ".join(f"({k}) ms | ({k}) error" for k in keys)
        + " |"
    )
    lines.append("|---|---|---|---|" + "---|---|" * len(keys))
    for r in rows:
        cells = " | ".join(f"{r['pred'][k].time * 1e3:.3f} | {r['err'][k]:+.1%}" for k in keys)
        flops = r["pred"][keys[0]].details["routed_flops"]
        lines.append(
            f"| {r['label']} | {r['tpe']:.0f} | {r['time'] * 1e3:.3f} | "
            f"{flops / r['time'] / 1e12:.1f} | {cells} |"
        )
    lines.append("\n## Peak memory of a step (parameters, input and output gradient included)\n")
    lines.append(
        "| config | measured MiB | " + " | ".join(f"({k}) MiB | ({k}) error" for k in keys) + " |"
    )
    lines.append("|---|---|" + "---|---|" * len(keys))
    for r in rows:
        cells = " | ".join(
            f"{r['pred'][k].memory['peak'] / 2**20:.1f} | {r['mem_err'][k]:+.1%}" for k in keys
        )
        lines.append(f"| {r['label']} | {r['peak'] / 2**20:.1f} | {cells} |")
    if rows:
        last = keys[-1]
        comps = list(dict.fromkeys(c for r in rows for c in r["pred"][last].breakdown))
        lines.append(f"\n## Predicted breakdown on ({last}), ms\n")
        lines.append("| config | " + " | ".join(comps) + " |")
        lines.append("|---|" + "---|" * len(comps))
        for r in rows:
            parts = r["pred"][last].breakdown
            cells = " | ".join(f"{parts.get(c, 0.0) * 1e3:.3f}" for c in comps)
            lines.append(f"| {r['label']} | {cells} |")
    lines.append(f"\n## Calibrated rates of ({keys[-1]})\n")
    hw = hws[keys[-1]]
    lines.append("| kernel | GB/s | x copy bandwidth |")
    lines.append("|---|---|---|")
    for name, rate in sorted(hw.kernel_rates.items()):
        lines.append(f"| {name} | {rate / 1e9:.0f} | {rate / hw.mem_bandwidth:.2f} |")
    lines.append("\n| GEMM | TFLOP/s |\n|---|---|")
    lines += [f"| {k} | {v / 1e12:.3g} |" for k, v in sorted(hw.gemm_rate.items())]
    for r in rows:
        if r["kernels"]:
            lines.append(f"\n## Measured kernels of one step: {r['label']} (own time)\n")
            lines.append("| kernel | ms | share of the step |\n|---|---|---|")
            lines += [
                f"| {name[:90]} | {sec * 1e3:.3f} | {sec / r['time']:.1%} |"
                for name, sec in r["kernels"]
            ]
    lines.append(
        f"\n## Summary over {len(rows)} configurations (targets: time median |error| <= "
        f"{TIME_TARGET[0]:.0%} and p90 <= {TIME_TARGET[1]:.0%}; memory every configuration "
        f"within {MEMORY_TARGET:.0%})\n"
    )
    lines.append(
        "| hardware | time median signed | time median abs | time p90 abs | time max abs | "
        "time | memory median abs | memory p90 abs | memory max abs | memory |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for k in keys:
        t = [abs(r["err"][k]) for r in rows]
        m = [abs(r["mem_err"][k]) for r in rows]
        if not t:
            lines.append(f"| ({k}) | - | - | - | - | no data | - | - | - | no data |")
            continue
        t_med, t_p90 = statistics.median(t), quantile(t, 0.9)
        t_ok = t_med <= TIME_TARGET[0] and t_p90 <= TIME_TARGET[1]
        m_ok = max(m) <= MEMORY_TARGET
        lines.append(
            f"| ({k}) | {statistics.median(r['err'][k] for r in rows):+.1%} | {t_med:.1%} | "
            f"{t_p90:.1%} | {max(t):.1%} | target {'met' if t_ok else 'missed'} | "
            f"{statistics.median(m):.1%} | {quantile(m, 0.9):.1%} | {max(m):.1%} | "
            f"target {'met' if m_ok else 'missed'} |"
        )
    for k in keys:
        if rows:
            lines.append(f"\nTime |error| per regime on ({k}):\n")
            lines += summary_rows([dict(regime=r["regime"], e=r["err"][k]) for r in rows], "e")
    if failed:
        lines.append("\n## Not measured\n")
        lines += [f"- {f}" for f in failed]
    return lines


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda (default where available) or cpu (a smoke test: --quick implied)",
    )
    p.add_argument("--quick", action="store_true", help="three tiny layers, small rate probes")
    p.add_argument("--out", help="write the report here too (markdown)")
    p.add_argument("--only", help="only the configurations whose label or name matches (regex)")
    p.add_argument("--reps", type=int, default=20, help="timed steps per configuration (least)")
    p.add_argument("--preset", default="h200", help="the hardware preset of (a)")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        help="profile one step of the first N configurations: their top kernels' own time",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=100.0,
        help="skip the configurations left after this many seconds (default 100)",
    )
    args = p.parse_args()
    start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    if device.type not in ("cuda", "cpu"):
        p.error(f"--device must be cuda or cpu, got {args.device!r}")
    quick = args.quick or device.type == "cpu"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = (
            f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
        )
    head = [
        f"# torch {torch.__version__}, triton {triton_version}, python "
        f"{platform.python_version()}; {name}"
    ]
    print(head[0], file=sys.stderr, flush=True)  # progress; the report comes at the end

    hws: dict[str, Hardware] = {}
    if device.type == "cuda":
        hws["a"] = Hardware.preset(args.preset)
        desc_a = f"`Hardware.preset({args.preset!r})` as it is"
        hws["b"] = calibrate(device=device)
    else:  # this CPU's quick calibration, and the accelerator calibration's code on it
        hws["a"] = calibrate(quick=True)
        desc_a = "`torch_moe.perf.calibrate(quick=True)` of this CPU"
        hws["b"] = _calibrate_gpu.measure(device, quick=True)
    b = hws["b"]
    head += [
        f"# calibrated in {time.perf_counter() - start:.1f} s",
        f"# (a) {desc_a}: bf16 {hws['a'].gemm_rate['bf16'] / 1e12:.3g} TFLOP/s, memory "
        f"{hws['a'].mem_bandwidth / 1e9:.0f} GB/s",
        f"# (b) torch_moe.perf.calibrate(device={str(device)!r}): {b.name}: bf16 "
        f"{b.gemm_rate['bf16'] / 1e12:.3g}, fp32 {b.gemm_rate['fp32'] / 1e12:.3g}, "
        + ", ".join(
            f"{r} {b.gemm_rate[r + ':forward'] / 1e12:.3g}"
            for r in ("fp8_rowwise", "fp8_blockwise")
            if r + ":forward" in b.gemm_rate
        )
        + f" TFLOP/s forward; memory {b.mem_bandwidth / 1e9:.0f} GB/s, launch "
        f"{b.launch_overhead * 1e6:.1f} us",
    ]
    if device.type == "cpu":
        head.append(
            "# CPU: a smoke test of the script. (b)'s GPU model means nothing here, and "
            "(a)'s quick calibration extrapolates its kernel tables (measured up to 1024 "
            "elements): neither time error says how good the model is"
        )
    for line in head[1:]:
        print(line, file=sys.stderr, flush=True)

    configs = quick_configs() if quick else gpu_configs()
    if args.only:
        configs = [c for c in configs if re.search(args.only, f"{c.name} {c.label()}")]
    rows: list[dict[str, Any]] = []
    failed: list[str] = []  # errors
    skipped: list[str] = []  # past --budget-s
    for i, cfg in enumerate(configs):
        label = cfg.label()
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            skipped.append(f"{label}: skipped, {elapsed:.0f} s > --budget-s {args.budget_s:g}")
            print(f"  {skipped[-1]}", file=sys.stderr, flush=True)
            continue
        t0 = time.perf_counter()
        try:
            seconds, peak, w, kernels = measure(
                cfg, i, device, args.reps, profile=len(rows) < args.profile
            )
            preds: dict[str, Prediction] = {k: predict(w, hw) for k, hw in hws.items()}
        except Exception as e:  # one failing configuration does not end the sweep
            failed.append(f"{label}: failed: {type(e).__name__}: {e}")
            print(f"  FAILED {failed[-1]}", file=sys.stderr, flush=True)
            continue
        finally:
            free(device)
        rows.append(
            dict(
                label=label,
                regime=cfg.regime,
                tpe=cfg.tokens_per_expert,
                time=seconds,
                peak=peak,
                pred=preds,
                err={k: err(pr.time, seconds) for k, pr in preds.items()},
                mem_err={k: err(pr.memory["peak"], peak) for k, pr in preds.items()},
                kernels=kernels,
            )
        )
        errs = " ".join(f"({k}) {v:+.1%}" for k, v in rows[-1]["err"].items())
        print(
            f"  {label}: {seconds * 1e3:.3f} ms [{errs}], peak {peak / 2**20:.1f} MiB "
            f"[(a) {rows[-1]['mem_err']['a']:+.1%}]; {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    head.append(f"# sweep done in {time.perf_counter() - start:.1f} s")
    text = "\n".join(report(head, hws, rows, failed + skipped))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
