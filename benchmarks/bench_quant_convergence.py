"""Does MoE training in FP8 / MXFP8 (CPU emulation) converge like bf16?

Runs ``examples/train_moe_lm.py``'s ``main()`` once per precision with the same seed,
data order and model: ``bf16`` (fp32 master weights, bf16 autocast) and each recipe of
:data:`torch_moe.quantization.RECIPES` (the same, with the MoE experts' forward, dgrad and
wgrad GEMMs quantized per the recipe: ``MoE(precision=recipe)``). Prints a table of final
losses (train: mean of the last 10 steps; held-out) and their relative difference to bf16,
writes one PNG with every loss curve, and a markdown report with the exact command,
versions and the table. Exits with status 1 when a recipe ends more than ``--tolerance``
away from bf16.

    python benchmarks/bench_quant_convergence.py                    # ~10 min on 2 CPU cores
    python benchmarks/bench_quant_convergence.py --steps 40 --precisions bf16 mxfp8
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import train_moe_lm  # noqa: E402

from torch_moe.quantization import RECIPES  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SMOOTH = 10  # steps in the final-loss mean and the curves' moving average


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--precisions",
        nargs="+",
        default=["bf16", *RECIPES, "fp32"],
        choices=["bf16", *RECIPES, "fp32"],
        help="bf16 first: the reference; fp32 (no autocast) shows how far a same-seed run "
        "moves when only the rounding changes, and is not held to --tolerance",
    )
    p.add_argument("--steps", type=int, default=400, help="optimizer steps per run")
    p.add_argument("--dim", type=int, default=64, help="model dim D")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--hidden-dim", type=int, default=64, help="expert hidden dim F")
    p.add_argument("--experts", type=int, default=8, help="routed experts E")
    p.add_argument("--top-k", type=int, default=2, help="experts per token K")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--warmup", type=int, default=20, help="warmup steps")
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0, 1],
        help="init and data-order seeds: every precision runs each; losses are averaged",
    )
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    p.add_argument("--tolerance", type=float, default=0.02, help="max |loss / bf16 loss - 1|")
    p.add_argument("--runs-dir", default="", help="per-run --out dirs (default: a temp dir)")
    p.add_argument(
        "--name",
        default="quant_convergence_cpu_202611",
        help="writes benchmarks/results/<name>.png and <name>.md ('' : no files)",
    )
    args = p.parse_args(argv)
    if args.precisions[0] != "bf16":
        p.error(f"--precisions must start with bf16 (the reference), got {args.precisions}")
    if args.steps < 2 * SMOOTH:
        p.error(f"--steps must be >= {2 * SMOOTH}, got {args.steps}")
    return args


def train_argv(args: argparse.Namespace, precision: str, seed: int, out: Path) -> list[str]:
    return [
        "--precision", precision, "--steps", str(args.steps), "--dim", str(args.dim),
        "--layers", str(args.layers), "--hidden-dim", str(args.hidden_dim),
        "--experts", str(args.experts), "--top-k", str(args.top_k),
        "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
        "--warmup", str(args.warmup), "--seed", str(seed), "--threads", str(args.threads),
        "--device", "cpu", "--ckpt-every", "0", "--sample-bytes", "0", "--no-progress",
        "--out", str(out),
    ]  # fmt: skip


def run_one(args: argparse.Namespace, precision: str, seed: int, runs: Path) -> dict[str, Any]:
    out = runs / f"{precision}_seed{seed}"
    argv = train_argv(args, precision, seed, out)
    log = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(log):
        result = train_moe_lm.main(argv)
    result["wall_s"] = time.perf_counter() - t0
    result["log"] = log.getvalue()
    result["argv"] = argv
    with open(out / "metrics.jsonl") as f:
        result["curve"] = [json.loads(line)["loss"] for line in f]
    return result


def aggregate(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over seeds of the losses and the curves; times summed."""
    n = len(per_seed)
    agg: dict[str, Any] = {
        k: sum(r[k] for r in per_seed) / n for k in ("first_loss", "last_loss", "val_loss")
    }
    agg.update({k: sum(r[k] for r in per_seed) for k in ("train_s", "wall_s")})
    agg["curve"] = [sum(c) / n for c in zip(*(r["curve"] for r in per_seed))]
    agg["per_seed"], agg["log"] = per_seed, per_seed[0]["log"]
    return agg


def smooth(values: list[float], w: int = SMOOTH) -> list[float]:
    return [
        sum(values[max(0, i - w + 1) : i + 1]) / (i + 1 - max(0, i - w + 1))
        for i in range(len(values))
    ]


def write_plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(
        2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    ref = results["bf16"]["curve"]
    for i, (name, r) in enumerate(results.items()):
        steps = range(1, len(r["curve"]) + 1)
        color = f"C{i}"  # the same color in both panels
        ax0.plot(steps, smooth(r["curve"]), color=color, lw=1.8 if i == 0 else 1.0, label=name)
        if name != "bf16":
            rel = [100 * (a / b - 1) for a, b in zip(r["curve"], ref)]
            ax1.plot(steps, smooth(rel), color=color, lw=1.0, label=name)
    ax0.set_yscale("log")
    ax0.set_ylabel(f"train loss (nats/byte), mean of {SMOOTH}")
    ax0.legend()
    ax0.set_title(title, fontsize=9)
    ax1.axhline(0, color="k", lw=0.6)
    ax1.set_ylabel(f"loss vs bf16 (%), mean of {SMOOTH}")
    ax1.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: dict[str, dict[str, Any]], tol: float) -> tuple[list[str], bool]:
    ref = results["bf16"]
    lines = [
        f"| precision | train loss, first {SMOOTH} steps | train loss, last {SMOOTH} steps "
        "| vs bf16 | vs bf16, per seed | held-out loss | vs bf16 | within tolerance "
        "| train loops | wall |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ok = True
    for name, r in results.items():
        d_train = r["last_loss"] / ref["last_loss"] - 1
        d_val = r["val_loss"] / ref["val_loss"] - 1
        good = abs(d_train) <= tol and abs(d_val) <= tol
        if name in RECIPES:
            ok &= good
            verdict = "yes" if good else "**NO**"
        else:
            verdict = "(reference)" if name == "bf16" else f"({'yes' if good else 'no'})"
        per_seed = " / ".join(
            f"{100 * (a['last_loss'] / b['last_loss'] - 1):+.1f}%"
            for a, b in zip(r["per_seed"], ref["per_seed"])
        )
        lines.append(
            f"| {name} | {r['first_loss']:.4f} | {r['last_loss']:.4f} | {100 * d_train:+.2f}% "
            f"| {per_seed} | {r['val_loss']:.4f} | {100 * d_val:+.2f}% | {verdict} "
            f"| {r['train_s']:.0f} s | {r['wall_s']:.0f} s |"
        )
    return lines, ok


def versions() -> str:
    import matplotlib

    return (
        f"Python {platform.python_version()}, torch {torch.__version__}, matplotlib "
        f"{matplotlib.__version__}, {platform.machine()} with {os.cpu_count()} logical CPUs "
        f"({platform.processor() or 'unknown'})"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/bench_quant_convergence.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    tmp = None
    if args.runs_dir:
        runs = Path(args.runs_dir)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="quant_convergence_")
        runs = Path(tmp.name)
    print(f"# {versions()}")
    print(f"# {command.strip()}")
    load0 = os.getloadavg()[0]
    results: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    for name in args.precisions:
        per_seed = []
        for seed in args.seeds:
            per_seed.append(r := run_one(args, name, seed, runs))
            print(
                f"{name:>15} seed {seed}: loss {r['first_loss']:.3f} -> {r['last_loss']:.4f}, "
                f"held-out {r['val_loss']:.4f}, {r['tokens_per_s']:.0f} tokens/s, "
                f"{r['wall_s']:.0f} s",
                flush=True,
            )
        results[name] = aggregate(per_seed)
    total_s = time.perf_counter() - t0
    lines, ok = table(results, args.tolerance)
    print()
    print("\n".join(lines))
    print(f"\ntotal {total_s:.0f} s; all within {100 * args.tolerance:g}% of bf16: {ok}")

    if args.name:
        png, md = RESULTS / f"{args.name}.png", RESULTS / f"{args.name}.md"
        model_line = results["bf16"]["log"].splitlines()[0]
        title = (
            f"{args.layers}x MoE E={args.experts} K={args.top_k} D={args.dim} F={args.hidden_dim}, "
            f"{args.batch_size}x{args.seq_len} bytes/step, mean of seeds {args.seeds} (CPU emulation)"
        )
        write_plot(results, png, title)
        report = [
            "# FP8 / MXFP8 MoE training converges like bf16 (CPU emulation, 2026-11)",
            "",
            "Question: does the training example end within "
            f"{100 * args.tolerance:g}% of the bf16 loss when the MoE experts' GEMMs "
            "(forward, dgrad, wgrad of w13 and w2) run in each low-precision recipe?",
            "",
            "Setup: `examples/train_moe_lm.py`'s `main()` once per precision and seed "
            f"(seeds {args.seeds}); for a seed every precision starts from the same weights "
            "and sees the same batches; losses are averaged over the seeds. `bf16`: fp32 master weights under bf16 "
            "autocast. A recipe: the same, plus `MoE(precision=<recipe>)` in every block, "
            "run by the exact CPU emulation of `scaled_grouped_mm` (quantize -> dequantize "
            "-> fp32 GEMM; the numerics the GPU kernels compute up to accumulation order). "
            "Router, attention, norms, embeddings and the combine are not quantized.",
            "",
            f"Machine: {versions()}. Shared with other jobs: 1-minute load average "
            f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; each run used "
            f"{args.threads} thread(s). Total {total_s:.0f} s.",
            "",
            "```bash",
            command.strip(),
            "```",
            "",
            f"Model: `{model_line}`",
            "",
            f"{args.steps} steps of {args.batch_size} x {args.seq_len} bytes, AdamW, peak LR "
            f"3e-3 (the example's default), {args.warmup} warmup steps, cosine to 10%. Loss "
            f"in nats per byte (uniform: ln 256 = 5.55). Train loss: mean of the first / "
            f"last {SMOOTH} steps (the same batches for every precision); held-out: the "
            "example's evaluation on the held-out 5% of the corpus; both averaged over the "
            "seeds. `fp32` (no autocast, grouped_swiglu) is a calibration row: how far a "
            "same-seed run moves when only the rounding changes.",
            "",
            *lines,
            "",
            f"All recipes within {100 * args.tolerance:g}% of bf16 (train and held-out): "
            f"**{'yes' if ok else 'no'}**.",
            "",
            f"![loss curves]({png.name})",
            "",
            f"`{png.name}`: train loss per step (mean over the seeds, moving mean of {SMOOTH}) "
            "for every precision, and each one's loss relative to bf16 at the same step.",
            "",
        ]
        md.write_text("\n".join(report))
        print(f"wrote {png}, {md}")
    if tmp is not None:
        tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
