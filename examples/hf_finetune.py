"""Fine-tune an HF transformers MoE model with torch_moe as its experts implementation.

    python examples/hf_finetune.py                                   # torch_moe, bf16, 200 steps
    python examples/hf_finetune.py --experts-implementation eager    # transformers' own loop
    python examples/hf_finetune.py --precision fp8_rowwise           # FP8 experts (torch_moe)
    python examples/hf_finetune.py --compare                         # eager, grouped_mm, torch_moe

The model is a small random Qwen3-MoE (the architecture, built from a config in code:
byte vocabulary, 4 layers, dim 128, 8 experts top-2; nothing is downloaded) trained as a
byte-level language model on the synthetic English-like corpus of ``moe_lm.py`` (a seeded
grammar, no data download). The experts run through the implementation named by
``--experts-implementation``: transformers' ``"eager"`` per-expert loop, its
``"grouped_mm"``, or ``"torch_moe"`` (``import torch_moe.integrations.transformers``
registers it); the routing, attention and everything else is transformers' own.

``--precision``: ``fp32``; ``bf16`` (default: fp32 master weights, bf16 autocast);
or an FP8/MX recipe of ``torch_moe.quantization.RECIPES`` (bf16 autocast, the experts'
GEMMs quantized by ``torch_moe.integrations.transformers.set_precision``; torch_moe only).

``--out`` receives ``metrics.jsonl`` (one line per step: loss, learning rate, tokens/s and
the tokens routed to each expert of every layer) and ``train.png`` (loss and expert-load
imbalance over steps). ``--compare`` trains the three implementations from the same seed
one after the other and writes each run's metrics under ``--out/<implementation>`` and one
``compare.png``; it prints the largest loss difference to eager over the run: the three
curves agree to bf16 rounding (see ``benchmarks/results/hf_finetune_cpu_202612.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_lm import ByteLoader, make_corpus  # the example's own corpus

IMPLEMENTATIONS = ("eager", "grouped_mm", "torch_moe")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from torch_moe.quantization import RECIPES

    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--experts-implementation", choices=IMPLEMENTATIONS, default="torch_moe")
    p.add_argument("--precision", choices=["fp32", "bf16", *RECIPES], default="bf16")
    p.add_argument("--compare", action="store_true", help="train all three implementations")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden-dim", type=int, default=128, help="expert hidden dim")
    p.add_argument("--corpus-bytes", type=int, default=400_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--out", default="runs/hf_finetune")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = p.parse_args(argv)
    if (
        args.precision in RECIPES
        and not args.compare
        and args.experts_implementation != "torch_moe"
    ):
        p.error(f"--precision {args.precision} quantizes the experts' GEMMs with torch_moe: "
                "use --experts-implementation torch_moe")  # fmt: skip
    return args


def build_model(args: argparse.Namespace, implementation: str) -> nn.Module:
    """A random Qwen3-MoE from a config; the same weights for every implementation."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import torch_moe.integrations.transformers  # noqa: F401  (registers "torch_moe")

    hf_logging.set_verbosity_error()
    cfg = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=256,
        hidden_size=args.dim,
        intermediate_size=2 * args.dim,
        moe_intermediate_size=args.hidden_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.dim // 4,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation=implementation)
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():  # HF zero-inits the routers: give every weight a fan-in init
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * min(p.shape[-2:]) ** -0.5)
    return model


class ExpertLoad:
    """Tokens routed to each expert of every layer (forward pre-hooks on the experts)."""

    def __init__(self, model: nn.Module) -> None:
        from torch_moe.integrations.transformers import experts_modules

        self.modules = [m for _, m in experts_modules(model)]
        self.counts = [torch.zeros(m.num_experts, dtype=torch.int64) for m in self.modules]
        for m, c in zip(self.modules, self.counts):
            m.register_forward_pre_hook(self._hook(c))

    @staticmethod
    def _hook(counts: torch.Tensor) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if torch.is_grad_enabled():
                counts.add_(torch.bincount(args[1].flatten(), minlength=counts.numel()).cpu())

        return hook

    def pop(self) -> tuple[list[list[int]], float]:
        """(tokens per expert per layer, max/mean load averaged over layers); resets."""
        loads = [c.tolist() for c in self.counts]
        imb = [max(c) / (sum(c) / len(c)) for c in loads if sum(c) > 0]
        for c in self.counts:
            c.zero_()
        return loads, sum(imb) / max(len(imb), 1)


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step <= args.warmup:
        return args.lr * step / max(args.warmup, 1)
    frac = (step - args.warmup) / max(args.steps - args.warmup, 1)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(args: argparse.Namespace, implementation: str, out: Path) -> list[dict[str, Any]]:
    from torch_moe.integrations.transformers import set_precision

    out.mkdir(parents=True, exist_ok=True)
    model = build_model(args, implementation).train()
    if args.precision not in ("fp32", "bf16"):
        if implementation != "torch_moe":
            raise ValueError(f"--precision {args.precision} needs the torch_moe implementation")
        set_precision(model, args.precision)
    load = ExpertLoad(model)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision != "fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=False)
    loader = ByteLoader(
        make_corpus(args.seed, args.corpus_bytes), args.seq_len, args.batch_size, args.seed
    )
    records: list[dict[str, Any]] = []
    bar = tqdm(range(1, args.steps + 1), desc=implementation, disable=args.no_progress, leave=False)
    with open(out / "metrics.jsonl", "w") as f:
        for step in bar:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args)
            x, y = loader.next_batch()
            t0 = time.perf_counter()
            with autocast:
                logits = model(x).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            loads, imbalance = load.pop()
            rec = dict(step=step, loss=loss.item(), lr=lr_at(step, args), tokens_per_s=x.numel() / dt,
                       imbalance=imbalance, tokens_per_expert=loads)  # fmt: skip
            records.append(rec)
            f.write(json.dumps(rec) + "\n")
            bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                            imb=f"{imbalance:.2f}")  # fmt: skip
    write_plot({implementation: records}, out / "train.png", f"{implementation}, {args.precision}")
    return records


def write_plot(runs: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    for name, recs in runs.items():
        steps = [r["step"] for r in recs]
        ax0.plot(steps, [r["loss"] for r in recs], lw=0.9, label=name)
        ax1.plot(steps, [r["imbalance"] for r in recs], lw=0.9, label=name)
    ax0.set_ylabel("train loss (nats/byte)")
    ax0.set_title(title, fontsize=9)
    ax0.legend()
    ax1.set_ylabel("max/mean expert load")
    ax1.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare_summary(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each implementation's losses against eager's: the largest relative difference over
    the first 20 steps and over the run, and the final loss (mean of the last 10 steps)."""
    ref = [r["loss"] for r in runs["eager"]]
    lines = []
    for impl, recs in runs.items():
        loss = [r["loss"] for r in recs]
        rel = [abs(a - b) / b for a, b in zip(loss, ref)]
        final = sum(loss[-10:]) / len(loss[-10:])
        line = f"{impl}: final loss {final:.4f}"
        if impl != "eager":
            line += (
                f", vs eager: max relative loss difference {max(rel[:20]):.1e} over the first "
                f"{min(20, len(rel))} steps, {max(rel):.1e} over all {len(rel)}"
            )
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    impls = IMPLEMENTATIONS if args.compare else (args.experts_implementation,)
    runs: dict[str, list[dict[str, Any]]] = {}
    for impl in impls:
        t0 = time.perf_counter()
        runs[impl] = train(args, impl, out / impl if args.compare else out)
        recs = runs[impl]
        first = sum(r["loss"] for r in recs[:10]) / len(recs[:10])
        last = sum(r["loss"] for r in recs[-10:]) / len(recs[-10:])
        tok_s = sorted(r["tokens_per_s"] for r in recs)[len(recs) // 2]
        print(f"{impl}: loss {first:.3f} -> {last:.3f} (mean of first/last 10 steps), "
              f"median {tok_s:.0f} tokens/s, {time.perf_counter() - t0:.0f} s")  # fmt: skip
    if args.compare:
        for line in compare_summary(runs):
            print(line)
        write_plot(runs, out / "compare.png", f"Qwen3-MoE (random, tiny), {args.precision}")
        print(f"wrote {out}/<implementation>/metrics.jsonl, train.png and {out}/compare.png")
    else:
        print(f"wrote {out}/metrics.jsonl and {out}/train.png")
    return runs


if __name__ == "__main__":
    main()
