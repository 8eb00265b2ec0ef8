"""The MoE layer's inference step compiled and exported, against the same layer in eager mode.

A decode server runs the layer under ``torch.compile`` or ahead of time (``torch.export``
then AOTInductor), not in eager mode. For a batch of T tokens each of these runs the same
``torch_moe.nn.MoE`` (bf16, eval mode, under ``torch.inference_mode()``) on the same input:

* ``eager``: the layer as it is (at a few tokens the routed experts in one native call);
* ``compile``: ``torch.compile(fullgraph=True, dynamic=True)``, Inductor;
* ``compile+passes``: the same with ``torch_moe._inductor.options()``;
* ``aoti``: ``torch.export`` (the token dim a ``Dim``) and
  ``aoti_compile_and_package`` with the passes, loaded by ``aoti_load_package``.

Each compiled way is compiled once for every T (dynamic token count) and warmed at each T.
Reported per T: the median time of each way and its ratio to eager's in the same rounds
(the ways interleaved in every round, the caches emptied before each timed call by reading
``--flush-mib`` MiB, as a layer's weights come from memory in a model's decode step), and
whether the traced graph holds ``torch_moe::routed_swiglu`` (the step's experts as one
call whose kernel chooses eager's path at run time).

Shape: Qwen3-30B-A3B-like experts (D=2048, F=768, K=8) with ``--experts`` experts (default
32: AOTInductor keeps the weights in its package; 128 are 1.2 GB of bf16).

    python benchmarks/bench_compiled_decode.py --tokens 1 4 16 64 256 --rounds 15
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_decode import cache_flusher

import torch_moe._inductor as TI
from torch_moe._ops._cpu_probe import cpu_isa
from torch_moe.nn import MoE

WAYS = ("eager", "compile", "compile+passes", "aoti")


def _graph_ops(gm: torch.fx.GraphModule) -> set[str]:
    return {
        str(n.target)
        for m in gm.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
        if n.op == "call_function"
    }


def build(moe: MoE, dim: int, package: Path) -> tuple[dict[str, Any], bool]:
    """The ways (name -> callable) and whether the exported graph holds routed_swiglu."""
    x = torch.randn(1, 8, dim, dtype=torch.bfloat16)
    tokens = torch.export.Dim("tokens", min=1, max=1 << 16)
    with torch.no_grad():
        ep = torch.export.export(moe, (x,), dynamic_shapes=({1: tokens},))
    one_op = "torch_moe.routed_swiglu.default" in _graph_ops(ep.graph_module)
    with TI.enabled():
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(package))
    ways = {
        "eager": moe,
        "compile": torch.compile(moe, fullgraph=True, dynamic=True),
        "compile+passes": torch.compile(moe, fullgraph=True, dynamic=True, options=TI.options()),
        "aoti": torch._inductor.aoti_load_package(path),
    }
    return ways, one_op


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    p.add_argument("--flush-mib", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    flush = cache_flusher(args.flush_mib)
    dim, hidden, top_k = 2048, 768, 8
    torch.manual_seed(0)
    moe = MoE.from_preset(
        "qwen3-moe", dim=dim, hidden_dim=hidden, num_experts=args.experts, top_k=top_k
    )
    moe = moe.to(torch.bfloat16).eval()
    print(
        f"# torch {torch.__version__}, {platform.machine()} {cpu_isa()}, {os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} threads, {args.clock} clock; D={dim} F={hidden} "
        f"E={args.experts} K={top_k} bf16; medians of {args.rounds} rounds, caches "
        + (f"emptied by reading {args.flush_mib} MiB" if args.flush_mib > 0 else "warm")
        + " before each timed call"
    )
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ways, one_op = build(moe, dim, Path(tmp) / "moe.pt2")
        print(
            f"# exported graph holds torch_moe::routed_swiglu: {one_op}; AOTInductor "
            f"package built in {time.perf_counter() - t0:.1f} s"
        )
        print("| T | " + " | ".join(f"{w} ms (x eager)" for w in WAYS) + " |")
        print("|---" * (len(WAYS) + 1) + "|")
        gen = torch.Generator().manual_seed(1)
        with torch.inference_mode():
            for T in args.tokens:
                x = torch.randn(1, T, dim, generator=gen).to(torch.bfloat16)
                want = moe(x)
                for name, fn in ways.items():  # compile / warm at this T; same values
                    for _ in range(2):
                        got = fn(x)
                    if not torch.equal(got, want):
                        print(f"# {name} differs from eager at T={T}")
                times: dict[str, list[float]] = {w: [] for w in WAYS}
                for _ in range(args.rounds):
                    for name, fn in ways.items():
                        flush()
                        t1 = clock()
                        fn(x)
                        times[name].append(clock() - t1)
                ratio = {
                    w: statistics.median(a / e for a, e in zip(times[w], times["eager"]))
                    for w in WAYS
                }
                cells = " | ".join(
                    f"{statistics.median(times[w]) * 1e3:.3f} ({ratio[w]:.2f})" for w in WAYS
                )
                print(f"| {T} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
