"""One HF experts block, forward + backward, by implementation: where does the "torch_moe"
backend's time go against transformers' "grouped_mm" at a few hundred tokens?

``bench_hf.py`` times whole training steps; at T=256 the experts are a third of those and
a few percent of a step is within one run's noise. This times the first MoE layer's
experts module alone (the same tiny-but-not-toy configs as ``bench_hf.py``, bf16, random
routing of the model's top-k, fp32 routing weights): "grouped_mm"; "torch_moe" (the
activation by the native row kernels, the ops' eager calls direct); "torch_moe (ATen
activation)" (the CPU probe's ``act_kernel`` forced to ATen, the glu op's native kernels
off); "torch_moe (op layers)" (every op call through the custom op's Python layers,
``_eager.ENABLED = False``), in a shuffled order in every round (a variant that always
runs right after another torch_moe one finds its caches warm), on one thread, in the
thread's CPU time; medians, and the median over rounds of each torch_moe variant's
difference to grouped_mm in the same round.

    python benchmarks/bench_hf_block.py                          # mixtral, T=16..1024
    python benchmarks/bench_hf_block.py --models qwen3_moe --tokens 256 --rounds 31
    python benchmarks/bench_hf_block.py --variants "torch_moe,torch_moe (op layers)"
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from contextlib import nullcontext
from typing import Any
from unittest import mock

import torch
from bench_hf import MODELS, build, cpu_info, experts_of

from torch_moe._ops import _cpu_probe, _eager, _native
from torch_moe._ops import glu as _glu

VARIANTS = ("grouped_mm", "torch_moe", "torch_moe (ATen activation)", "torch_moe (op layers)")


def block_step(model: Any, experts: Any, variant: str, inputs: tuple[torch.Tensor, ...]) -> None:
    x, ids, weights, grad = inputs
    impl = "grouped_mm" if variant == "grouped_mm" else "torch_moe"
    model.set_experts_implementation(impl)
    for t in (x, weights, *experts.parameters()):
        t.grad = None
    kernel = "aten" if "ATen" in variant else "native"
    # the ATen variant: SwiGLU (grouped_swiglu) and the glu op's activations by ATen ops
    no_glu = mock.patch.object(_glu, "_native_kernels", return_value=None)
    layers = mock.patch.object(_eager, "ENABLED", False) if "op layers" in variant else None
    with _cpu_probe.force(act_kernel=kernel), no_glu if kernel == "aten" else nullcontext():
        with layers or nullcontext():
            experts(x, ids, weights).backward(grad)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="mixtral", help=f"comma-separated subset of {list(MODELS)}")
    p.add_argument("--tokens", default="16,64,256,1024", help="comma-separated token counts")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated torch_moe variants (grouped_mm always runs)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    chosen = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    variants = [v for v in VARIANTS if v == "grouped_mm" or v in chosen]
    if not _native.available():  # the ATen column would be the native one
        variants = [v for v in variants if "ATen" not in v]
    rng = random.Random(0)
    alloc = os.environ.get("LD_PRELOAD", "").rsplit("/", 1)[-1] or "glibc"
    print(
        f"# torch {torch.__version__}, {cpu_info()}, threads=1, allocator {alloc}, native "
        f"activation kernel {'built' if _native.available() else 'not built'}; bf16, "
        f"median of {args.rounds} interleaved rounds (thread CPU time)\n"
    )
    print(
        "| model | T | "
        + " | ".join(f"{v} ms" for v in variants)
        + " | "
        + " | ".join(f"{v} - grouped_mm (paired)" for v in variants[1:])
        + " |"
    )
    print("|---" * (2 + 2 * len(variants) - 1) + "|")
    for family in args.models.split(","):
        model = build(family, torch.bfloat16, "cpu")
        experts = experts_of(model)[0]
        num_experts, top_k = int(experts.num_experts), model.config.num_experts_per_tok
        dim = model.config.hidden_size
        for tokens in (int(t) for t in args.tokens.split(",")):
            g = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, dim, generator=g).to(torch.bfloat16).requires_grad_()
            probs = torch.randn(tokens, num_experts, generator=g).softmax(-1)
            weights, ids = probs.topk(top_k, dim=-1)
            weights.requires_grad_()
            grad = torch.randn(tokens, dim, generator=g).to(torch.bfloat16)
            inputs = (x, ids, weights, grad)
            for v in variants:  # warm-up: probes, the kernel's load, caches
                block_step(model, experts, v, inputs)
                block_step(model, experts, v, inputs)
            times: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for v in rng.sample(variants, len(variants)):
                    t0 = time.thread_time()
                    block_step(model, experts, v, inputs)
                    times[v].append(1e3 * (time.thread_time() - t0))
            med = {v: statistics.median(t) for v, t in times.items()}
            cells = [f"{med[v]:.2f}" for v in variants]
            # the median of the per-round differences: both ran in the same round, so a
            # slow stretch of a shared host shifts both (steadier than a difference of medians)
            ref = times["grouped_mm"]
            cells += [
                f"{statistics.median(a - b for a, b in zip(times[v], ref, strict=True)):+.2f}"
                for v in variants[1:]
            ]
            print(f"| {family} | {tokens} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
