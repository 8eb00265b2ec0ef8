"""Tune the tile configs of the fused decode kernels (torch_moe._triton.moe_decode) on this
GPU and write them to ``torch_moe/_triton/moe_decode_configs.json`` under the GPU's name.

For every batch (T = 1, 2, 4 ... --max-tokens tokens, T*K routed rows) each candidate
config that compiles for sm_90a without register spills, and within the shared memory an
sm_90 block may take, is timed on both kernels (replayed from a CUDA graph, CUDA events,
median of interleaved rounds, bf16 weights, the expert shape given); the fastest that
also compiles cleanly for FP8 weights (rowwise and blockwise scales: the table serves them)
wins, and consecutive batches with the same winner merge into one bound of the table.

    python benchmarks/tune_moe_decode.py                       # Qwen3-30B-A3B-like experts
    python benchmarks/tune_moe_decode.py --dim 7168 --hidden 2048 --experts 256
    python benchmarks/tune_moe_decode.py --dry-run             # candidates and their spills (no GPU)

The static check compiles the candidates in --jobs processes (one per CPU by default).

Without --write the table is printed only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import multiprocessing
import os
import statistics
import sys
from pathlib import Path

import torch
from bench_moe_decode import _time, graphed  # us per call, by CUDA events; CUDA graph
from triton.runtime.errors import OutOfResources

import torch_moe  # noqa: F401
from torch_moe import ops
from torch_moe._triton.grouped_mm import SM90_MAX_SHARED

CANDIDATES = [
    (bm, bn, bk, warps, stages)
    for bm, bn, bk, warps, stages in itertools.product(
        (16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (2, 3, 4)
    )
    if not (bm == 16 and warps == 8)  # 16-row tiles: mma.sync, 4 warps fill them
    # 32-column tiles for the fewest rows only: at T = 1 (8 experts of 16 rows, F = 768)
    # 128 columns give the w13 kernel 48 programs on the H200's 132 SMs, 32 give 192
    and (bn > 32 or (bm == 16 and warps == 4))
]


def _spills(c, scale_mode=None):
    """Register spills of both kernels (w13, w2) for candidate ``c``, compiled for sm_90a,
    plus the bytes of shared memory over what an sm_90 block may take."""
    from torch_moe._triton import moe_decode as MD

    cfg = MD.DecodeConfig(*c)
    kernels = [MD.compile_for_sm90(k, 64, scale_mode=scale_mode, config=cfg) for k in ("w13", "w2")]
    # more shared memory than an sm_90 block may take fails at launch: count it as a spill
    return [k.n_spills + max(0, k.shared - SM90_MAX_SHARED) for k in kernels]


def spill_free(configs, scale_mode=None, jobs=1):
    """The candidates whose both kernels compile for sm_90a without spills (``jobs``
    processes compile them; the check needs no GPU and runs before CUDA is initialized)."""
    if jobs > 1:
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            spills = list(pool.map(functools.partial(_spills, scale_mode=scale_mode), configs))
    else:
        spills = [_spills(c, scale_mode) for c in configs]
    ok = []
    for c, s in zip(configs, spills):
        print(f"  {c}: spills w13/w2 = {s}")
        if not any(s):
            ok.append(c)
    return ok


def tune_batch(T, w13, w2, K, candidates, rounds, reps):
    """The fastest candidate (and its us) for T tokens that also compiles without spills
    for FP8 weights (rowwise and blockwise scales)."""
    from torch_moe._triton import moe_decode as MD

    E, _, D = w13.shape
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
    ids = torch.randint(0, E, (T, K), device="cuda", generator=gen)
    weights = torch.rand(T, K, device="cuda", generator=gen)
    runs = {}
    for c in candidates:
        cfg = MD.DecodeConfig(*c)
        perm = ops.permute_indices(ids, E, align=cfg.block_m)
        rw = torch.cat([weights.reshape(-1), weights.new_zeros(1)])[perm.row_to_slot]
        args = (x, w13, w2, perm.row_to_slot, perm.offs, rw, K)
        try:
            MD.moe_decode(*args, config=cfg)  # compile
        except OutOfResources as e:  # more shared memory than this GPU has: not a candidate
            print(f"  {c}: {e}")
            continue
        # the kernels' device time: reps calls replayed from one CUDA graph (launched from
        # Python, decode-sized calls time the host, not the tiles)
        graph, why = graphed(lambda a=args, g=cfg: MD.moe_decode(*a, config=g), reps)
        if graph is None:
            raise RuntimeError(f"tune_moe_decode: moe_decode did not capture: {why}")
        runs[c] = (graph, args)  # the graph reads args' memory: keep them alive with it
    times: dict[tuple, list[float]] = {c: [] for c in runs}
    for _ in range(rounds):
        for c, (graph, _args) in runs.items():
            times[c].append(_time(graph.replay, 1) / reps)
    med = {c: statistics.median(v) for c, v in times.items()}
    for c in sorted(med, key=med.__getitem__):
        # the table serves FP8 weights too: the fastest config spill-free in every mode
        # (the first H200 run's T = 1, 2 winners spilled 104 bytes with blockwise scales)
        if all(not any(_spills_cached(c, mode)) for mode in ("rowwise", "blockwise")):
            return c, med[c]
        print(f"  {c}: {med[c]:.1f} us, spills with FP8 weights")
    raise RuntimeError(f"tune_moe_decode: no candidate is spill-free with FP8 weights at T={T}")


@functools.cache
def _spills_cached(c, scale_mode):  # type: ignore[no-untyped-def]
    return tuple(_spills(c, scale_mode))


def merged_table(table: dict[int, list[int]]) -> dict[str, list[int]]:
    """Routed-row bound -> config, keeping a bound only where the winner changes after it
    (the last bound stands for every larger batch)."""
    merged: dict[str, list[int]] = {}
    bounds = sorted(table)
    for i, bound in enumerate(bounds):
        last = i == len(bounds) - 1
        if last or table[bounds[i + 1]] != table[bound]:
            merged[str(1 << 30 if last else bound)] = table[bound]
    return merged


def write_table(path: Path, name: str, merged: dict[str, list[int]]) -> None:
    """Set ``name``'s entry of the JSON table at ``path``."""
    data = json.loads(path.read_text())
    data[name] = merged
    tmp = path.with_suffix(".tmp")  # replaced whole: a kill mid-write leaves the old table
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--dry-run", action="store_true", help="list spill-free candidates only")
    p.add_argument("--write", action="store_true", help="write the table to the JSON file")
    p.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1,
        help="processes for the static check (default: one per CPU)",
    )  # fmt: skip
    args = p.parse_args()
    print(f"# {len(CANDIDATES)} candidates; sm_90a static check:")
    try:
        candidates = spill_free(CANDIDATES, jobs=args.jobs)
        print(f"# {len(candidates)} compile without spills")
    except Exception as e:  # the AOT path follows Triton's compiler API, which moves
        if args.dry_run:
            raise
        print(f"# static check failed ({type(e).__name__}: {e}); timing every candidate")
        candidates = list(CANDIDATES)
    if args.dry_run:
        return 0
    if not torch.cuda.is_available():
        print("tune_moe_decode: needs a CUDA GPU (use --dry-run for the static check)")
        return 0
    from torch_moe._triton import moe_decode as MD

    E, D, F, K = args.experts, args.dim, args.hidden, args.top_k
    w13 = (torch.randn(E, 2 * F, D, device="cuda") / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, device="cuda") / F**0.5).bfloat16()
    name = torch.cuda.get_device_name()
    print(f"# {name}; E={E} D={D} F={F} K={K}")
    table: dict[int, list[int]] = {}
    T = 1
    while T <= args.max_tokens:
        best, us = tune_batch(T, w13, w2, K, candidates, args.rounds, args.reps)
        default = dataclasses.astuple(MD.config_for(T * K, configs=MD.CONFIGS))
        print(f"T={T:5d} rows={T * K:6d}: {best} {us:8.1f} us (default {default})", flush=True)
        table[T * K] = list(best)
        if args.write:  # after every batch: a run cut short still leaves the batches it timed
            write_table(MD._CONFIG_FILE, name, merged_table(table))
        T *= 2
    print(json.dumps({name: merged_table(table)}))
    if args.write:
        print(f"wrote {name!r} to {MD._CONFIG_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
