"""``python -m torch_moe.perf``: predict one MoE layer step and rank execution strategies.

    python -m torch_moe.perf --preset deepseek-v3 --hardware h200 --gpus 64 \\
        --gpus-per-node 8 --tokens 4096
    python -m torch_moe.perf --dim 1024 --hidden-dim 512 --experts 64 --top-k 8 \\
        --hardware cpu --tokens 2048 --plot regimes.png

Prints the workload, the hardware's sources, the breakdown and memory of the best
strategy, and the ranked strategies with why the winner wins. ``--hardware cpu``
calibrates this machine (cached); ``--plot`` draws the sparsity-regime chart
(:mod:`torch_moe.perf._plot`).
"""

from __future__ import annotations

import argparse
import sys

import torch

from torch_moe.perf._advisor import advise
from torch_moe.perf._hardware import Hardware
from torch_moe.perf._plot import regime_chart, regime_series
from torch_moe.perf._presets import HARDWARE_PRESETS, MODEL_PRESETS, model_preset
from torch_moe.perf._workload import MoEWorkload

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_moe.perf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", choices=sorted(MODEL_PRESETS), help="a published MoE block")
    p.add_argument("--dim", type=int)
    p.add_argument("--hidden-dim", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--top-k", type=int)
    p.add_argument("--shared-hidden-dim", type=int)
    p.add_argument("--node-limit", type=int, help="node-limited routing: at most M nodes per token")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank per step")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of expert popularity")
    p.add_argument("--hardware", default="h200", help=f"{sorted(HARDWARE_PRESETS)} or cpu")
    p.add_argument("--gpus", type=int, default=8, help="world size (ranks)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--precisions", nargs="+", help="recipes to consider (default: all)")
    p.add_argument("--allow-drop", action="store_true", help="also rank capacity factors")
    p.add_argument("--memory-limit-gib", type=float, help="per-rank limit (default: device memory)")
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--top", type=int, default=10, help="strategies to print")
    p.add_argument("--plot", help="write the sparsity-regime chart to this PNG")
    return p


def _workload(args: argparse.Namespace) -> MoEWorkload:
    fields: dict = {}
    if args.preset:
        fields.update(model_preset(args.preset))
        if args.preset == "deepseek-v3":
            fields["node_limit"] = 4  # 8 expert groups, 4 kept: at most 4 nodes per token
    for name, key in (
        ("dim", "dim"),
        ("hidden_dim", "hidden_dim"),
        ("experts", "num_experts"),
        ("top_k", "top_k"),
        ("shared_hidden_dim", "shared_hidden_dim"),
        ("node_limit", "node_limit"),
    ):
        value = getattr(args, name)
        if value is not None:
            fields[key] = value
    missing = [k for k in ("dim", "hidden_dim", "num_experts", "top_k") if k not in fields]
    if missing:
        raise SystemExit(
            f"error: give --preset or all of --dim --hidden-dim --experts --top-k (missing {missing})"
        )
    return MoEWorkload(
        args.tokens,
        fields.pop("dim"),
        fields.pop("hidden_dim"),
        fields.pop("num_experts"),
        fields.pop("top_k"),
        dtype=_DTYPES[args.dtype],
        routing_skew=args.skew,
        backward=not args.forward_only,
        **fields,
    )


def _hardware(name: str) -> Hardware:
    if name == "cpu":
        return Hardware.calibrate()
    return Hardware.preset(name)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    limit = args.memory_limit_gib * 2**30 if args.memory_limit_gib else None
    try:  # (every argument's error as one line and exit code 2, the advice's too)
        w = _workload(args)
        hw = _hardware(args.hardware)
        advice = advise(
            w,
            hw,
            world_size=args.gpus,
            gpus_per_node=args.gpus_per_node,
            memory_limit=limit,
            precisions=args.precisions,
            allow_drop=args.allow_drop,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    best = advice.best
    print(f"# workload: {w}")
    print(f"# hardware: {hw.summary()}")
    print(f"\n## Breakdown of the best strategy ({best.strategy.describe()})\n")
    print(best.prediction.table())
    print()
    print(best.prediction.memory_table())
    d = best.prediction.details
    print(
        f"\nrows per rank: mean {d['rows_mean']:.0f}, busiest {d['rows_max']:.0f} "
        f"(imbalance {d['imbalance']:.3f}); distinct ranks per token "
        f"{d['distinct_ranks_per_token']:.2f}, nodes {d['distinct_nodes_per_token']:.2f}"
    )
    print(f"\n## Strategies ({len(advice.candidates)} ranked, top {args.top})\n")
    print(advice.table(args.top))
    print()
    for r in advice.reasons:
        print(f"- {r}")
    if args.plot:
        series = regime_series(w, hw, world_size=args.gpus, gpus_per_node=args.gpus_per_node)
        regime_chart(series, args.plot, f"{args.preset or 'MoE'} on {hw.name}: sparsity regimes")
        print(f"\nwrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
