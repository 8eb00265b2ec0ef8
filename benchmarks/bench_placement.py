"""How much does load-aware expert placement balance ranks under Zipf-skewed routing?

Samples T tokens that each pick K distinct experts from a Zipf(alpha) popularity over E
experts (randomly permuted, so the hot experts are not all on one rank of the identity
layout), then compares, per (E, R, num_redundant):

* ``identity``: expert e on rank e // (E/R), no replicas (the static layout);
* ``plan``: :func:`torch_moe.distributed.plan_placement` planned on that batch's loads;
* ``plan (held-out)``: the same placement scored on a fresh batch from the same
  distribution, which is what a placement planned from past statistics sees.

Balancedness is mean rank load / max rank load (1.0 is perfect; the step time of an
expert-parallel layer follows the max). Planning time is the median of ``--reps`` calls.

    python benchmarks/bench_placement.py
    python benchmarks/bench_placement.py --tokens 16384 --alpha 1.0
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from torch_moe.distributed import balancedness, identity_placement, plan_placement


def zipf_load(num_experts: int, alpha: float, tokens: int, k: int, seed: int) -> torch.Tensor:
    """Tokens per expert: T tokens pick K distinct experts from a Zipf(alpha) popularity."""
    g = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** alpha
    popularity = popularity[torch.randperm(num_experts, generator=torch.Generator().manual_seed(0))]
    ids = torch.multinomial(popularity.expand(tokens, -1), k, generator=g)
    return torch.bincount(ids.flatten(), minlength=num_experts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per batch")
    parser.add_argument("--k", type=int, default=8, help="experts per token")
    parser.add_argument("--reps", type=int, default=5, help="planning-time repetitions")
    args = parser.parse_args()

    print(
        f"# torch {torch.__version__}, {platform.machine()}, python {platform.python_version()}, "
        f"threads={torch.get_num_threads()}"
    )
    print(f"# Zipf({args.alpha}) popularity, T={args.tokens} tokens, K={args.k}")
    print()
    print("| E | R | redundant | S | identity | plan | plan (held-out) | max replicas | plan ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for num_experts in (64, 256):
        for num_ranks in (8, 32):
            ident = identity_placement(num_experts, num_ranks)
            load = zipf_load(num_experts, args.alpha, args.tokens, args.k, seed=1)
            held_out = zipf_load(num_experts, args.alpha, args.tokens, args.k, seed=2)
            for num_redundant in (0, num_ranks, 2 * num_ranks):
                times = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    pl = plan_placement(load, num_ranks, num_redundant=num_redundant)
                    times.append(time.perf_counter() - t0)
                print(
                    f"| {num_experts} | {num_ranks} | {num_redundant} | {pl.slots_per_rank} "
                    f"| {balancedness(load, ident):.3f} | {balancedness(load, pl):.3f} "
                    f"| {balancedness(held_out, pl):.3f} | {int(pl.replica_count.max())} "
                    f"| {statistics.median(times) * 1e3:.2f} |"
                )


if __name__ == "__main__":
    main()
