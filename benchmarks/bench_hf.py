"""Is the "torch_moe" experts implementation the fastest and leanest way to train an HF
transformers MoE model?

One training step (forward, cross-entropy, backward; no optimizer) of three
tiny-but-not-toy models built from config (Mixtral: 8 large experts top-2, fused path;
Qwen3-MoE: 32 small experts top-4, fused path; GPT-OSS: 16 experts top-4 with biases,
interleaved clamped SwiGLU, composed path), in bf16, with each of transformers' experts
implementations ("eager": its per-expert loop, "grouped_mm", "batched_mm") and "torch_moe",
in one process on the same weights and tokens. Per model and implementation:

* step ms: median over ``--rounds`` rounds, the implementations interleaved in a shuffled
  order in each round (after one warm-up step each), and "x torch_moe": the median over
  rounds of the step over torch_moe's in the same round. On CPU this is the
  process's CPU time (``time.process_time``) on ``--threads 1`` (the default): on a shared,
  loaded 2-core machine wall time and multi-threaded runs (OpenMP spin-waits) swing by
  several x between identical runs; one thread's CPU time is what an idle core's wall
  time would be;
* experts saved: bytes the experts keep for the backward, measured as the live bytes that
  the first experts module's forward leaves allocated beyond its output (the CPU
  allocator's events through the PyTorch memory profiler, so tensors kept alive by
  activation checkpointing or views count too), times the number of MoE layers, and the
  ratio to the best other implementation (target <= 0.6);
* step peak: the peak live bytes above the pre-step baseline during the whole step
  (model activations, logits and gradients included), from the same profiler.

``--convert`` adds "to_torch_moe": a copy of the model whose sparse-MoE blocks
``to_torch_moe`` replaced by ``torch_moe.nn.MoE`` (router, experts and shared experts in
torch_moe's layer; the form that takes expert parallelism and FP8 recipes), timed in the
same interleaved rounds; its "experts saved" cell is empty (the whole layer is one module).

``--compile`` adds grouped_mm and torch_moe under ``torch.compile(fullgraph=True)``
(inductor; torch_moe with its default compiler passes, ``torch_moe._inductor.options()``;
"x torch_moe" still against torch_moe without compile). transformers' eager loop does
not compile with ``fullgraph=True`` (data-dependent expert loop).

"batched_mm" gathers one [N, D] weight matrix per (token, expert) pair: where that gather
alone would exceed ``--batched-mm-gib`` it is skipped and the row says how much it needs.
On CUDA (``--device cuda``) times use CUDA events and memory ``max_memory_allocated``, and
"sonicmoe" / "deepgemm" run where they import.

    python benchmarks/bench_hf.py                      # three models, T=1024, ~3 min
    python benchmarks/bench_hf.py --tokens 256 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
import transformers
from bench_ops import print_decisions
from torch import nn
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

import torch_moe._inductor as TI
import torch_moe.integrations.transformers as tmt

COMMON = dict(
    vocab_size=4096,
    hidden_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
)
MODELS: dict[str, dict[str, Any]] = {
    "mixtral": dict(intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(
        moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4, norm_topk_prob=True
    ),
    "gpt_oss": dict(intermediate_size=512, num_local_experts=16, num_experts_per_tok=4),
}
IMPLS = ["eager", "grouped_mm", "batched_mm", "torch_moe"]
GPU_ONLY = ["sonicmoe", "deepgemm"]
CONVERTED = "to_torch_moe"  # --convert: the model with its blocks replaced by torch_moe.nn.MoE


def cpu_info() -> str:
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    isa = [n for f, n in (("avx2", "AVX2"), ("avx512f", "AVX512"), ("avx512_bf16", "AVX512-BF16"),
                          ("amx_bf16", "AMX-BF16")) if f in flags]  # fmt: skip
    return f"{model} ({', '.join(isa) or 'no AVX2'})"


def build(family: str, dtype: torch.dtype, device: str) -> nn.Module:
    cfg = AutoConfig.for_model(family, **{**COMMON, **MODELS[family]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # HF zero-inits routers: draw every weight (fan-in scaled)
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * r if "norm" in name else 0.1 * r)
            else:
                p.copy_(r * min(p.shape[-2:]) ** -0.5)
    return model.to(device=device, dtype=dtype).train()


def experts_of(model: nn.Module) -> list[Any]:
    return [m for _, m in tmt.experts_modules(model)]


def batched_mm_gib(model: nn.Module, tokens: int) -> float:
    """GiB of the weights batched_mm gathers per layer (up and down, one per pair)."""
    e = experts_of(model)[0]
    k = model.config.num_experts_per_tok
    up = e.gate_up_proj if e.has_gate else e.up_proj
    per_pair = up[0].numel() + e.down_proj[0].numel()
    return tokens * k * per_pair * up.element_size() / 2**30


def step(model: nn.Module, ids: torch.Tensor, call: Any = None) -> None:
    """Forward, loss, backward; ``call``: a compiled ``model`` (or the converted copy) to run
    instead, whose gradients are the ones reset."""
    (call if isinstance(call, nn.Module) else model).zero_grad(set_to_none=True)
    logits = (model if call is None else call)(ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    loss.backward()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def live_bytes_timeline(fn: Any) -> tuple[int, int]:
    """(peak, final) live bytes allocated while ``fn()`` runs, relative to its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:  # fmt: skip
        fn()
    from torch.profiler._memory_profiler import Action

    cur = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            cur += size
        elif action == Action.DESTROY:
            cur -= size
        peak = max(peak, cur)
    return peak, cur


def experts_saved_bytes(model: nn.Module, ids: torch.Tensor, device: str) -> int:
    """Bytes the first experts module keeps for its backward, beyond its output."""
    experts = experts_of(model)[0]
    captured: dict[str, Any] = {}

    def grab(mod: nn.Module, args: tuple[Any, ...]) -> None:
        captured["args"] = tuple(a.detach().clone() for a in args)

    handle = experts.register_forward_pre_hook(grab)  # the batch's real routing
    with torch.no_grad():
        model(ids)
    handle.remove()
    x, idx, w = captured["args"]
    x.requires_grad_(True)
    w.requires_grad_(True)
    keep: list[torch.Tensor] = []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        keep.append(experts(x, idx, w))
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - base - keep[0].numel() * keep[0].element_size()
    _, final = live_bytes_timeline(lambda: keep.append(experts(x, idx, w)))
    return final - keep[0].numel() * keep[0].element_size()


def step_peak_bytes(model: nn.Module, ids: torch.Tensor, device: str, call: Any = None) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(model, ids, call)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    model.zero_grad(set_to_none=True)
    peak, _ = live_bytes_timeline(lambda: step(model, ids, call))
    return peak


def available(
    impls: list[str], model: nn.Module, ids: torch.Tensor, args: argparse.Namespace
) -> dict[str, str]:
    """impl -> "" if it runs here, else why not."""
    out = {}
    for impl in impls:
        if impl == "batched_mm" and batched_mm_gib(model, ids.numel()) > args.batched_mm_gib:
            out[impl] = (
                f"skipped: gathers {batched_mm_gib(model, ids.numel()):.1f} GiB of weights per layer"
            )
            continue
        try:
            model.set_experts_implementation(impl)
            with torch.no_grad():
                model(ids[:, :4])
            out[impl] = ""
        except Exception as e:  # reported in the table
            out[impl] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return out


def time_steps(
    model: nn.Module,
    ids: torch.Tensor,
    impls: list[str],
    rounds: int,
    device: str,
    calls: dict[str, Any] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Median step time per implementation, interleaved in a shuffled order per round (an
    implementation always run right after another finds its caches in that one's state),
    and the median over rounds of each one's step over torch_moe's in the same round
    (steadier on a shared host than a ratio of medians; empty without torch_moe);
    ``calls``: a compiled model per implementation (its first call compiles: the
    warm-up)."""
    calls = calls or {}
    clock = time.perf_counter if device == "cuda" else time.process_time
    for impl in impls:  # warm-up
        if impl != CONVERTED:
            model.set_experts_implementation(impl)
        step(model, ids, calls.get(impl))
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    order = random.Random(0)
    for _ in range(rounds):
        for impl in order.sample(impls, len(impls)):
            if impl != CONVERTED:
                model.set_experts_implementation(impl)
            _sync(device)
            t0 = clock()
            step(model, ids, calls.get(impl))
            _sync(device)
            times[impl].append(clock() - t0)
    ratios = {}
    if "torch_moe" in times:
        ref = times["torch_moe"]
        ratios = {
            impl: statistics.median(a / b for a, b in zip(ts, ref, strict=True))
            for impl, ts in times.items()
        }
    return {impl: statistics.median(ts) for impl, ts in times.items()}, ratios


def compiled_rows(
    model: nn.Module,
    ids: torch.Tensor,
    label: str,
    eager_torch_moe: float,
    args: argparse.Namespace,
) -> list[str]:
    """grouped_mm and torch_moe under torch.compile(fullgraph=True) (inductor), torch_moe with
    its compiler passes (``torch_moe._inductor.options()``: the default ones)."""
    impls = ["grouped_mm", "torch_moe"]
    torch._dynamo.reset()
    calls = {
        impl: torch.compile(
            model, fullgraph=True, options=TI.options() if impl == "torch_moe" else None
        )
        for impl in impls
    }
    t0 = time.perf_counter()
    times, _ = time_steps(model, ids, impls, args.rounds, args.device, calls)
    wall = time.perf_counter() - t0
    rows = []
    for impl in impls:
        model.set_experts_implementation(impl)
        peak = step_peak_bytes(model, ids, args.device, calls[impl])
        t = times[impl]
        rows.append(
            f"| {label} | {impl} + inductor{' + passes' if impl == 'torch_moe' else ''} | "
            f"{t * 1e3:.0f} | {t / eager_torch_moe:.2f} | "
            f"{ids.numel() / t:.0f} | | | {peak / 2**20:.0f} |"
        )
    print(f"# {label}: compiling and timing took {wall:.0f} s", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default=",".join(MODELS), help=f"subset of {list(MODELS)}")
    p.add_argument(
        "--tokens", type=int, default=1024, help="tokens per step (batch of 512-token rows)"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--convert",
        action="store_true",
        help="also time a to_torch_moe copy of the model (torch_moe.nn.MoE blocks)",
    )
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batched-mm-gib", type=float, default=2.0,
                   help="skip batched_mm where its per-layer weight gather exceeds this")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time grouped_mm and torch_moe under torch.compile(fullgraph=True) (inductor)",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    impls = IMPLS + (GPU_ONLY if args.device == "cuda" else [])
    seq = min(512, args.tokens)
    batch = max(1, args.tokens // seq)
    where = torch.cuda.get_device_name() if args.device == "cuda" else cpu_info()
    print(
        f"# torch {torch.__version__}, transformers {transformers.__version__}, {where}, "
        f"{os.cpu_count()} CPUs, threads={torch.get_num_threads()}; {args.dtype}, "
        f"T={batch}x{seq}, {COMMON['num_hidden_layers']} layers, D={COMMON['hidden_size']}, "
        f"median of {args.rounds} interleaved rounds "
        f"({'wall' if args.device == 'cuda' else 'process CPU'} time)\n",
        flush=True,
    )
    header = (
        "| model (F, E, K) | implementation | step ms | x torch_moe | tokens/s | experts saved MiB "
        "| x best other | step peak MiB |"
    )
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    for family in args.models.split(","):
        model = build(family, dtype, args.device)
        cfg = model.config
        fh = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        e_num = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        label = f"{family} ({fh}, {e_num}, {cfg.num_experts_per_tok})"
        ids = torch.randint(
            0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)
        )
        ids = ids.to(args.device)
        status = available(impls, model, ids, args)
        runs = [i for i in impls if not status[i]]
        calls = {}
        if args.convert:
            converted = copy.deepcopy(model)
            converted.set_experts_implementation("eager")  # blocks it cannot convert
            tmt.to_torch_moe(converted)
            calls[CONVERTED] = converted
        times, ratio = time_steps(model, ids, runs + list(calls), args.rounds, args.device, calls)
        saved, peak = {}, {}
        layers = len(experts_of(model))
        for impl in runs:
            model.set_experts_implementation(impl)
            saved[impl] = experts_saved_bytes(model, ids, args.device) * layers
            peak[impl] = step_peak_bytes(model, ids, args.device)
        others = [saved[i] for i in runs if i != "torch_moe"]
        best_other = min(others) if others else math.nan
        if args.convert:
            t = times[CONVERTED]
            conv_peak = step_peak_bytes(calls[CONVERTED], ids, args.device)
            lines.append(
                f"| {label} | {CONVERTED} | {t * 1e3:.0f} | {ratio[CONVERTED]:.2f} | "
                f"{ids.numel() / t:.0f} | | | {conv_peak / 2**20:.0f} |"
            )
        for impl in impls:
            if status[impl]:
                lines.append(f"| {label} | {impl} | {status[impl]} | | | | | |")
                continue
            t = times[impl]
            lines.append(
                f"| {label} | {impl} | {t * 1e3:.0f} | {ratio[impl]:.2f} | "
                f"{ids.numel() / t:.0f} | {saved[impl] / 2**20:.1f} | "
                f"{saved[impl] / best_other:.2f} | {peak[impl] / 2**20:.0f} |"
            )
        if args.compile:
            lines += compiled_rows(model, ids, label, times["torch_moe"], args)
        print("\n".join(lines[-len(impls) - len(calls) :]), file=sys.stderr, flush=True)
        del model
    print("\n".join(lines))
    if args.device == "cpu":  # the CPU kernels' measured decisions (they differ by machine)
        print()
        print_decisions()


if __name__ == "__main__":
    main()
