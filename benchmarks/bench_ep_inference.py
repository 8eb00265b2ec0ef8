"""Expert-parallel inference on gloo: the low-latency exchange against the training exchange.

Spawns 2 and 4 gloo processes on this machine (one thread each) and times an eval-mode
``torch_moe.nn.MoE`` forward under ``torch.inference_mode()`` at 1 ... 128 tokens per rank,
for three ``ExpertParallel`` styles of the same layer, interleaved round by round (a barrier
before each call; a round's time is the slowest rank's; medians over ``--reps`` rounds):

* ``training``: ``ExpertParallel()`` (counts all-to-all, split lists on the host, then the
  rows; the exchange the training forward runs);
* ``low-latency``: ``ExpertParallel(mode="low_latency", max_tokens_per_rank=T)`` (one
  all-to-all per direction of fixed-size buffers, no counts exchange, no host sync);
* ``low-latency fp8``: the same with ``dispatch_dtype=torch.float8_e4m3fn``.

The experts are small (``--hidden 16``) so the time is routing + dispatch + combine, the
part the exchange changes; the outputs of the three are checked equal (FP8 within its
rounding) before timing.

    python benchmarks/bench_ep_inference.py
    python benchmarks/bench_ep_inference.py --worlds 2 --tokens 1 8 --reps 9
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import torch_moe  # noqa: F401
from torch_moe._ops._cpu_probe import cpu_isa
from torch_moe.distributed import ExpertParallel
from torch_moe.nn import MoE


def timed(fns: dict[str, Any], reps: int) -> dict[str, float]:
    for fn in fns.values():
        fn()
    times = torch.zeros(len(fns), reps, dtype=torch.float64)
    for r in range(reps):
        for i, fn in enumerate(fns.values()):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[i, r] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {name: statistics.median(times[i].tolist()) for i, name in enumerate(fns)}


def worker(rank: int, world: int, init_file: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{init_file}")
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        base = MoE(args.dim, args.hidden, args.experts, args.k).eval()
        styles = {
            "training": lambda T: ExpertParallel(),
            "low-latency": lambda T: ExpertParallel(mode="low_latency", max_tokens_per_rank=T),
            "low-latency fp8": lambda T: ExpertParallel(
                mode="low_latency", max_tokens_per_rank=T, dispatch_dtype=torch.float8_e4m3fn
            ),
        }
        rows = []
        for T in args.tokens:
            layers = {}
            for name, style in styles.items():
                layers[name] = parallelize_module(copy.deepcopy(base), mesh, style(T))
            x = torch.randn(T, args.dim, generator=torch.Generator().manual_seed(rank + 10 * T))
            with torch.inference_mode():
                outs = {name: layer(x) for name, layer in layers.items()}
                exact = torch.equal(outs["low-latency"], outs["training"])
                fp8_err = (
                    (outs["low-latency fp8"] - outs["training"]).norm() / outs["training"].norm()
                ).item()
                fns = {name: (lambda layer=layer, x=x: layer(x)) for name, layer in layers.items()}
                t = timed(fns, args.reps)
            ok = torch.tensor([exact and fp8_err < 0.1], dtype=torch.int32)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            rows.append((T, t, bool(ok.item()), fp8_err))
        if rank == 0:
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    print(
        f"# torch {torch.__version__}, {platform.machine()} {cpu_isa()}, {os.cpu_count()} CPUs; "
        f"gloo, 1 thread per rank; D={args.dim} E={args.experts} K={args.k} F={args.hidden}; "
        f"medians of {args.reps} rounds (slowest rank)"
    )
    print(
        "| world | tokens/rank | training ms | low-latency ms | low-latency fp8 ms | LL / training | LL == training (bitwise) | fp8 rel. err |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world in args.worlds:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=(world, os.path.join(tmp, "init"), args, queue), nprocs=world)
        for T, t, ok, err in queue.get():
            tr, ll, l8 = t["training"] * 1e3, t["low-latency"] * 1e3, t["low-latency fp8"] * 1e3
            print(
                f"| {world} | {T} | {tr:.2f} | {ll:.2f} | {l8:.2f} | {ll / tr:.2f} | {ok} | {err:.2e} |"
            )


if __name__ == "__main__":
    main()
