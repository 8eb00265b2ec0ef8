"""MoE experts latency vs batch size at decode and prefill sizes, against the weight-read
floor and against peers.

For a batch of T tokens (1, 2, 4 ... 512) already routed (top-K ids and weights drawn
uniformly: every token's K experts distinct), each candidate computes the experts' combined
output [T, D] in bf16 from the same tokens, weights and routing:

* ``torch_moe``: the layer's inference path, as ``MoE.forward`` takes it: at a few tokens
  one native call (``GroupedExperts.routed_one_call``: the permutation, the row gather,
  both GEMMs, SwiGLU and the combine), else ``permute_indices`` and
  ``GroupedExperts.forward_tokens(..., combine=True)`` (one eager step), under
  ``torch.inference_mode()``;
* ``training fwd``: the training forward (``permute``, ``GroupedExperts.forward``,
  ``unpermute``) with autograd recording, as a model that is not in eval mode runs it;
* ``HF eager`` / ``HF grouped_mm``: transformers' ``Qwen3MoeExperts`` with its ``eager``
  (per-expert loop) and ``grouped_mm`` experts implementations, on the same weights;
* ``vLLM-style``: written here after vLLM's fused-MoE data flow (block-aligned expert-sorted
  rows, gather, one grouped GEMM per projection with SiLU-and-mul and the routing weight
  between them, results written per (token, k) slot then summed over k), on
  ``torch._grouped_mm``.

Floors, measured in the same run: the **weight-read floor** is the time a large GEMV
(``torch.mv``, the faster of a bf16 and an fp32 one) takes to read as many bytes as the
distinct experts' weights the batch touches (3*D*F per expert, bf16): decode is bound by
reading them once. It is timed in every round, between the candidates and as cold as they
are, and each candidate's ratio is the median over the rounds of its time over that
round's floor: on a shared host the memory bandwidth a process gets swings by 2x from one
minute to the next, so a floor timed once, before the candidates, put that swing into the
ratio (on the Zen 4 EPYC measured, T=1: 1.51-1.67x against a floor timed first, 1.1x
against the floor of the same rounds). The **FLOP floor** (large batches) is 6*T*K*D*F over
the best large-GEMM rate of the machine (bf16, or fp32 after an upcast where bf16 GEMMs are
slow: both are printed), timed once. Every candidate's ratio is to the larger of the two.

Before each timed call the caches are emptied by reading a buffer larger than the last
level cache (``--flush-mib``; 0 keeps them): in a model's decode step a layer's experts
come from memory, the other layers' weights having passed through the caches since.

Shapes: ``qwen3`` = Qwen3-30B-A3B-like experts (D=2048, F=768, E=128, K=8), ``dsv3`` =
DeepSeek-V3-like experts (D=7168, F=2048, K=8) with ``--dsv3-experts`` experts (default 32
on CPU: 256 would need 22.5 GB of bf16 weights; with K=8 a batch of <= 4 tokens touches <= 32
experts either way).

Medians over ``--rounds`` rounds, candidates interleaved in each round (after a warm-up).
``--clock cpu`` (the default) times the process's CPU time on one thread: on a shared,
loaded machine wall times swing by several x between identical calls, one thread's CPU time
does not (memory-bandwidth contention from other processes still shows); ``--clock wall``
with ``--threads N`` for an idle machine.

    python benchmarks/bench_decode.py                          # both shapes, T = 1 ... 512
    python benchmarks/bench_decode.py --shapes qwen3 --tokens 1 4 16 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F

import torch_moe  # noqa: F401
from torch_moe import ops
from torch_moe._ops._cpu_probe import cpu_isa
from torch_moe.nn import GroupedExperts

SHAPES = {"qwen3": (2048, 768, 128, 8), "dsv3": (7168, 2048, 32, 8)}


# ----------------------------------------------------------------------------- floors


CLOCK = time.perf_counter  # main() sets time.process_time for --clock cpu


def _median_time(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return statistics.median(times)


def gemv_bandwidth(mib: int = 512) -> float:
    """Bytes/s read by a GEMV over a ``mib`` MiB matrix (read once per call): the faster of
    a bf16 and an fp32 one. ATen's bf16 GEMV is not bound by memory on every CPU (on the
    Zen 4 EPYC measured, one thread: 5.7 GB/s, where the fp32 GEMV and torch_moe's bf16
    few-rows kernel read 20-23 GB/s), which made this floor a third of the machine's."""
    cols = 4096
    rates = []
    for dtype in (torch.bfloat16, torch.float32):
        size = torch.finfo(dtype).bits // 8
        w = torch.randn(mib * 2**20 // (size * cols), cols).to(dtype)
        v = torch.randn(cols).to(dtype)
        rates.append(w.numel() * size / _median_time(lambda w=w, v=v: torch.mv(w, v), 7))
        del w
    return max(rates)


class ReadFloor:
    """The weight-read floor in the rounds: :meth:`time` reads the first ``nbytes`` of a
    bf16 and of an fp32 matrix (``max_bytes`` each, rows of 4096) by ``torch.mv`` and
    returns the faster's time (as :func:`gemv_bandwidth`, over the step's own bytes)."""

    def __init__(self, max_bytes: int, gen: torch.Generator) -> None:
        cols = 4096
        self.mats = {}
        for dtype in (torch.bfloat16, torch.float32):
            size = torch.finfo(dtype).bits // 8
            rows = -(-max_bytes // (size * cols))
            self.mats[dtype] = (
                torch.randn(rows, cols, generator=gen).to(dtype),
                torch.randn(cols, generator=gen).to(dtype),
            )

    def time(self, nbytes: int, flush: Any) -> float:
        best = float("inf")
        for dtype, (w, v) in self.mats.items():
            size = torch.finfo(dtype).bits // 8
            rows = max(1, min(w.shape[0], round(nbytes / (size * w.shape[1]))))
            flush()
            t0 = CLOCK()
            torch.mv(w[:rows], v)
            best = min(best, (CLOCK() - t0) * nbytes / (rows * w.shape[1] * size))
        return best


def cache_flusher(mib: int) -> Any:
    """A function that empties the caches by reading ``mib`` MiB (clean lines: no
    write-backs land in the timed call); a no-op for 0."""
    if mib <= 0:
        return lambda: None
    buf = torch.ones(mib * 2**20 // 4)
    return lambda: buf.sum()


def gemm_rates(n: int = 2048) -> dict[str, float]:
    """FLOP/s of an n^3 GEMM in bf16 and in fp32."""
    rates = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        rates[name] = 2 * n**3 / _median_time(lambda a=a, b=b: torch.mm(a, b), 5)
    return rates


# ----------------------------------------------------------------------------- candidates


def routing(T: int, E: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    weights = torch.rand(T, K, generator=gen)
    return ids, weights / weights.sum(1, keepdim=True)


def torch_moe_inference(experts: GroupedExperts, x, ids, weights):
    with torch.inference_mode():
        out = experts.routed_one_call(x, ids, weights)  # a decode step's one native call
        if out is not None:
            return out
        perm = ops.permute_indices(ids, experts.w13.shape[0])
        row_w = weights.reshape(-1).index_select(0, perm.row_to_slot)
        return experts.forward_tokens(
            x, perm.row_to_slot, perm.slot_to_row, perm.offs, row_w, combine=True
        )


def torch_moe_training(experts: GroupedExperts, x, ids, weights):
    with torch.enable_grad():
        x_perm, perm = ops.permute(x, ids, experts.w13.shape[0])
        row_w = weights.reshape(-1).index_select(0, perm.row_to_slot)
        return ops.unpermute(experts(x_perm, perm.offs, row_w), None, perm)


def hf_experts(w13: torch.Tensor, w2: torch.Tensor, impl: str) -> Any:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeExperts

    E, two_f, D = w13.shape
    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=two_f // 2, num_experts=E)
    cfg._experts_implementation = impl
    module = Qwen3MoeExperts(cfg)
    module.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)  # shared storage
    module.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return module


def hf_forward(module, x, ids, weights):
    with torch.inference_mode():
        return module(x, ids, weights.to(x.dtype))


def vllm_style(w13_t, w2_t, x, ids, weights, block: int = 16):
    """vLLM's fused-MoE data flow on torch._grouped_mm (w*_t: [E, K, N] views)."""
    with torch.inference_mode():
        T, K = ids.shape
        E = w13_t.shape[0]
        # moe_align_block_size: slots sorted by expert, each expert padded to `block` rows
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        padded = (counts + block - 1) // block * block
        ends = padded.cumsum(0)
        starts = ends - padded
        rank = torch.arange(flat.numel()) - (counts.cumsum(0) - counts)[flat[order]]
        row = starts[flat[order]] + rank
        M = int(ends[-1])
        slot_of_row = torch.full((M,), T * K, dtype=torch.int64)
        slot_of_row[row] = order
        x_pad = torch.cat([x, x.new_zeros(1, x.shape[1])])
        tok = torch.where(slot_of_row < T * K, slot_of_row // K, T)
        h = torch._grouped_mm(x_pad[tok], w13_t, ends.to(torch.int32))
        g, u = h.chunk(2, dim=-1)
        w_pad = torch.cat([weights.reshape(-1), weights.new_zeros(1)])
        a = (F.silu(g.float()) * u.float() * w_pad[slot_of_row][:, None]).to(x.dtype)
        y = torch._grouped_mm(a, w2_t, ends.to(torch.int32))
        out = x.new_zeros(T * K + 1, x.shape[1])
        out[slot_of_row] = y  # padding rows land in the dump slot T*K
        return out[: T * K].view(T, K, -1).float().sum(1).to(x.dtype)


# ----------------------------------------------------------------------------- main


def candidates(experts, hf, w_t, x, ids, weights) -> dict[str, Any]:
    return {
        "torch_moe": lambda: torch_moe_inference(experts, x, ids, weights),
        "training fwd": lambda: torch_moe_training(experts, x, ids, weights),
        "HF eager": lambda: hf_forward(hf["eager"], x, ids, weights),
        "HF grouped_mm": lambda: hf_forward(hf["grouped_mm"], x, ids, weights),
        "vLLM-style": lambda: vllm_style(*w_t, x, ids, weights),
    }


def bench_shape(name: str, args: argparse.Namespace, rate: float) -> None:
    D, F_, E, K = SHAPES[name]
    if name == "dsv3":
        E = args.dsv3_experts
    gen = torch.Generator().manual_seed(0)
    experts = GroupedExperts(D, F_, E).to(torch.bfloat16)
    experts.requires_grad_(True)
    w13, w2 = experts.w13.detach(), experts.w2.detach()
    w13_t, w2_t = w13.transpose(-2, -1), w2.transpose(-2, -1)
    hf = {impl: hf_experts(w13, w2, impl) for impl in ("eager", "grouped_mm")}
    expert_bytes = 3 * D * F_ * 2
    floor_mv = ReadFloor(min(E, max(args.tokens) * K) * expert_bytes, gen)
    flush = cache_flusher(args.flush_mib)
    print(
        f"\n## {name}: D={D} F={F_} E={E} K={K}, bf16 weights {E * expert_bytes / 2**30:.2f} GiB\n"
    )
    cols = ["torch_moe", "training fwd", "HF eager", "HF grouped_mm", "vLLM-style"]
    print(
        "| T | experts hit | read floor ms (GB/s) | "
        + " | ".join(f"{c} ms (x floor)" for c in cols)
        + " | best peer / torch_moe |"
    )
    print("|---" * (4 + len(cols)) + "|")
    for T in args.tokens:
        x = torch.randn(T, D, generator=gen).bfloat16()
        ids, weights = routing(T, E, K, gen)
        cands = candidates(experts, hf, (w13_t, w2_t), x, ids, weights)
        ref = cands["torch_moe"]().float()
        for cname, fn in cands.items():  # same values (bf16 rounding apart)
            err = ((fn().float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if err > 2e-2:
                raise SystemExit(
                    f"bench_decode: {cname} differs from torch_moe at T={T}: rel err {err:.3g}"
                )
        hit = int(torch.unique(ids).numel())
        nbytes = hit * expert_bytes
        flop_floor = 6 * T * K * D * F_ / rate
        times: dict[str, list[float]] = {c: [] for c in cands}
        floors: list[float] = []
        for _ in range(args.rounds):
            floors.append(max(floor_mv.time(nbytes, flush), flop_floor))
            for cname, fn in cands.items():
                flush()
                t0 = CLOCK()
                fn()
                times[cname].append(CLOCK() - t0)
        med = {c: statistics.median(v) for c, v in times.items()}
        ratio = {c: statistics.median(t / f for t, f in zip(v, floors)) for c, v in times.items()}
        floor = statistics.median(floors)
        best_peer = min(med[c] for c in cols[2:])
        cells = " | ".join(f"{med[c] * 1e3:.2f} ({ratio[c]:.2f})" for c in cols)
        print(
            f"| {T} | {hit} | {floor * 1e3:.2f} ({nbytes / floor / 1e9:.1f}) | {cells} | "
            f"{best_peer / med['torch_moe']:.2f} |",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--dsv3-experts", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu: the process's CPU time on one thread (robust to other processes' load on a "
        "shared machine; what an idle core's wall time would be); wall: wall time",
    )
    p.add_argument("--threads", type=int, default=0, help="default: 1 with --clock cpu, else all")
    p.add_argument(
        "--flush-mib",
        type=int,
        default=256,
        help="MiB read before each timed call to empty the caches (larger than the last level "
        "cache; 0: warm caches)",
    )
    args = p.parse_args()
    global CLOCK
    if args.clock == "cpu":
        CLOCK = time.process_time
        torch.set_num_threads(args.threads or 1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    rates = gemm_rates()
    rate = max(rates.values())
    print(
        f"# torch {torch.__version__}, {platform.machine()} {cpu_isa()}, {os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} threads, {args.clock} clock; GEMM "
        f"bf16 {rates['bf16'] / 1e9:.0f} / fp32 {rates['fp32'] / 1e9:.0f} GFLOP/s (floor: the "
        f"{'bf16' if rates['bf16'] >= rates['fp32'] else 'fp32'} rate); medians of {args.rounds} rounds, caches "
        + (f"emptied by reading {args.flush_mib} MiB" if args.flush_mib > 0 else "warm")
        + " before each timed call"
    )
    for name in args.shapes:
        bench_shape(name, args, rate)


if __name__ == "__main__":
    main()
