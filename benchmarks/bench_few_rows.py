"""The few-rows grouped GEMM on cold expert weights, in both weight layouts, against the
weight-read floor.

``torch_moe_cpu::few_rows_mm`` (``torch_moe/csrc/grouped_mm_cpu.cpp``) multiplies a few
rows per expert: a decode step's two expert GEMMs, and at a few tokens per expert the
backward's input gradients. It has two forms by the weight's layout: column-major per
expert (``GroupedExperts``' stored weights read as x @ w^T: each output column one
contiguous dot product) and row-major (the backward's dX = dY @ W on the same weights, and
weights kept [E, D, 2F], as GPT-OSS's). Each round routes T tokens to their top-k of E
experts at random (seeded), empties the caches by reading ``--flush-mib`` MiB, and times
both GEMMs of the busy experts (x @ w13, then a @ w2) in each layout, and the read floor
over the same bytes (``bench_decode.ReadFloor``: the faster of a bf16 and an fp32 GEMV);
ratios are medians of the rounds' ratios.

    python benchmarks/bench_few_rows.py                         # Qwen3-30B-A3B-sized experts
    python benchmarks/bench_few_rows.py --library OLD.so        # another build of the kernels

``--library`` loads a built ``torch_moe_cpu`` library (a ``torch_moe_cpu_*.so`` from another
revision's ``TORCH_EXTENSIONS_DIR``) instead of this checkout's, for before / after runs
in separate processes (both libraries register the same ops: one per process).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import bench_decode  # (this script's directory is on sys.path: run it as a script)
import torch
from bench_decode import ReadFloor, cache_flusher, routing

from torch_moe._ops import _native
from torch_moe._ops._cpu_probe import cpu_isa


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--flush-mib", type=int, default=256)
    p.add_argument("--library", type=Path, help="a built torch_moe_cpu library to time instead")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bench_decode.CLOCK = time.process_time if args.threads == 1 else time.perf_counter
    if args.library is not None:
        torch.ops.load_library(str(args.library))
        mod, lib = torch.ops.torch_moe_cpu, str(args.library)
    else:
        mod, lib = _native.kernels(), "this checkout's"
    if mod is None:
        raise SystemExit("bench_few_rows: the native kernels did not build")

    E, D, F, K = args.experts, args.dim, args.hidden, args.top_k
    gen = torch.Generator().manual_seed(0)
    stored = {  # GroupedExperts' layout: [E, 2F, D] / [E, D, F], read transposed
        "w13": torch.randn(E, 2 * F, D, generator=gen).bfloat16().transpose(1, 2),
        "w2": torch.randn(E, D, F, generator=gen).bfloat16().transpose(1, 2),
    }
    layouts = {
        "column-major": stored,
        "row-major": {name: w.contiguous() for name, w in stored.items()},
    }
    expert_bytes = 3 * D * F * 2
    floor = ReadFloor(E * expert_bytes, gen)
    flush = cache_flusher(args.flush_mib)
    clock = "CPU time, one thread" if args.threads == 1 else f"wall time, {args.threads} threads"
    print(
        f"# torch {torch.__version__}, {cpu_isa()}, {lib} library; {clock}; medians of "
        f"{args.rounds} rounds, {args.flush_mib} MiB read before each timed call"
    )
    print(f"## D={D} F={F} E={E} top-{K}, bf16 weights\n")
    head = ["T", "experts hit", "rows per busy expert", "floor ms"]
    head += [f"{name} ms (x floor)" for name in layouts]
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    for T in args.tokens:
        ids, _ = routing(T, E, K, gen)  # (bench_decode's: uniform top-k)
        counts = torch.bincount(ids.flatten(), minlength=E)
        offs = counts.cumsum(0).to(torch.int32)
        busy = int((counts > 0).sum())
        M = T * K
        x, a = torch.randn(M, D).bfloat16(), torch.randn(M, F).bfloat16()
        h, y = x.new_empty(M, 2 * F), x.new_empty(M, D)
        times: dict[str, list[float]] = {"floor": [], **{name: [] for name in layouts}}
        for _ in range(args.rounds):
            times["floor"].append(floor.time(busy * expert_bytes, flush))
            for name, w in layouts.items():
                flush()
                t0 = bench_decode.CLOCK()
                mod.few_rows_mm(x, w["w13"], offs, h, 0)
                mod.few_rows_mm(a, w["w2"], offs, y, 0)
                times[name].append(bench_decode.CLOCK() - t0)
        fl = times["floor"]
        cells = []
        for name in layouts:
            ratio = statistics.median(t / f for t, f in zip(times[name], fl, strict=True))
            cells.append(f"{statistics.median(times[name]) * 1e3:.2f} ({ratio:.2f})")
        print(
            f"| {T} | {busy} | {M / busy:.1f} | {statistics.median(fl) * 1e3:.2f} | "
            + " | ".join(cells)
            + " |"
        )


if __name__ == "__main__":
    main()
