"""How close is one torch_moe MoE layer (forward + backward) to its GEMM floor, and what
does it keep for the backward, next to the straightforward per-expert loop?

For each shape: tokens/s, the time over the GEMM floor (routed-expert FLOPs
18*T*K*D*F over the large-GEMM rate measured in the same run, docs/design.md §8; printed
against the bf16 mm rate and against the fp32 mm rate, the hardware limit on a CPU
without native bf16 where torch_moe upcasts), and saved-activation bytes per token
(distinct tensors saved for backward, parameters excluded). The peer is the pattern of
HF transformers' eager experts: a Python loop over experts with index/linear/index_add,
written here with the same weights, in the same process right after torch_moe's
layer (one timed call by default: in bf16 its backward takes oneDNN's slow row-major x
row-major path on CPUs without native bf16, ~50x slower than our upcast GEMMs).

    python benchmarks/bench_moe_layer.py                  # the issue's three shapes, bf16
    python benchmarks/bench_moe_layer.py --tokens 512     # quicker
"""

from __future__ import annotations

import argparse
import functools
import os
import platform

import torch
import torch.nn.functional as F
from bench_ops import DTYPES, gemm_rate, interleaved
from torch import Tensor, nn

import torch_moe  # noqa: F401
from torch_moe.nn import MoE

SHAPES = [(1792, 8, 2), (384, 32, 6), (256, 64, 8)]  # (F, E, K)


class PerExpertLoopMoE(nn.Module):
    """The HF transformers eager-experts pattern, sharing ``moe``'s weights."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: Tensor) -> Tensor:
        router, experts = self.moe.router, self.moe.experts
        logits = F.linear(x, router.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.moe.top_k, dim=-1)
        top_w = (top_w / top_w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        with torch.no_grad():
            mask = F.one_hot(top_i, num_classes=self.moe.num_experts).permute(2, 1, 0)
            hit = (mask.sum(dim=(-1, -2)) > 0).nonzero()
        for e in hit.flatten().tolist():
            pos, tok = torch.where(mask[e])
            gate, up = F.linear(x[tok], experts.w13[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, experts.w2[e]) * top_w[tok, pos, None]
            out.index_add_(0, tok, h.to(out.dtype))
        return out


def fwd_bwd(module: nn.Module, x: Tensor, grad: Tensor) -> None:
    module.zero_grad(set_to_none=True)
    module(x).backward(grad)


def saved_bytes_per_token(module: nn.Module, x: Tensor) -> float:
    """Bytes of distinct non-parameter tensors saved for backward by one forward, per token."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values()) / x.shape[0]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-peer", action="store_true", help="skip the (slow) per-expert loop")
    p.add_argument(
        "--peer-reps",
        type=int,
        default=1,
        help="timed calls of the per-expert loop, no warm-up (its bf16 backward runs oneDNN's "
        "slow row-major x row-major path here: ~100 s a call at the default shapes)",
    )
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    t, d = args.tokens, args.dim

    rate = gemm_rate(dtype, 2048 if dtype != torch.float32 else 4096, 3)
    rate32 = gemm_rate(torch.float32, 4096, 3)
    print(
        f"# torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"threads={torch.get_num_threads()}; large mm {rate / 1e9:.1f} GFLOP/s {args.dtype}, "
        f"{rate32 / 1e9:.1f} GFLOP/s fp32; T={t}, D={d}, median of {args.reps}\n"
    )
    header = (
        "| F, E, K | torch_moe tok/s | x floor | x fp32 floor | saved KiB/tok | "
        "loop tok/s | loop x floor | loop saved KiB/tok | saved ratio |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for f, e, k in SHAPES:
        moe = MoE(d, f, e, k, route_norm=True, dtype=dtype)
        loop = PerExpertLoopMoE(moe)
        x = torch.randn(t, d, dtype=dtype, requires_grad=True)
        grad = torch.randn(t, d, dtype=dtype)

        times = interleaved({"ours": functools.partial(fwd_bwd, moe, x, grad)}, args.reps)
        if not args.skip_peer:
            loop_fn = functools.partial(fwd_bwd, loop, x, grad)
            times.update(interleaved({"loop": loop_fn}, args.peer_reps, warmup=False))
        flops = 18 * t * k * d * f
        ours_saved = saved_bytes_per_token(moe, x) / 1024
        row = (
            f"| {f}, {e}, {k} | {t / times['ours']:.0f} | {times['ours'] * rate / flops:.2f} | "
            f"{times['ours'] * rate32 / flops:.2f} | {ours_saved:.1f} | "
        )
        if "loop" in times:
            loop_saved = saved_bytes_per_token(loop, x) / 1024
            row += (
                f"{t / times['loop']:.0f} | {times['loop'] * rate / flops:.2f} | {loop_saved:.1f} | "
                f"{ours_saved / loop_saved:.2f} |"
            )
        else:
            row += "- | - | - | - |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
