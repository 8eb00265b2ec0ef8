"""The permute family's CUDA kernels (torch_moe._triton.permute) against the ATen
references they replaced, on a GPU: ``permute_indices`` (one program up to 1024
assignments), ``permute`` (the row gather, weighted), ``unpermute`` (the fp32 combine,
weighted) and ``weighted_row_dot`` (the combine weights' gradient), each at a few batch
sizes. Two times per call: eager (launched from Python: what an eager step pays, host
included) and replayed from a CUDA graph of --reps calls (device only); the ratio is
reference / kernel (above 1: the kernel is faster). The references run through the same
op schemas' Python references, so both sides do the same work.

    python benchmarks/bench_permute_gpu.py                      # E=128 K=8 D=2048
    python benchmarks/bench_permute_gpu.py --dim 7168 --experts 256

Medians of interleaved rounds, CUDA events. Needs a GPU (exits with a message without).
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_moe_decode import timed_medians  # graph and eager us per call

import torch_moe
from torch_moe._ops import permute as P
from torch_moe._triton import permute as TP


def _pairs(T: int, E: int, K: int, D: int, align: int, gen: torch.Generator) -> dict:
    """op name -> (kernel call, reference call) at T tokens."""
    dev = "cuda"
    ids = torch.rand(T, E, device=dev, generator=gen).argsort(1)[:, :K].contiguous()
    perm = torch_moe.ops.permute_indices(ids, E, align=align)
    r2s, s2r = perm.row_to_slot, perm.slot_to_row
    x = torch.randn(T, D, device=dev, generator=gen).bfloat16()
    y = torch.randn(r2s.shape[0], D, device=dev, generator=gen).bfloat16()
    w = torch.rand(T, K, device=dev, generator=gen)
    pairs = {
        "permute": (
            lambda: TP.permute_rows(x, r2s, s2r, w),
            lambda: P.permute_rows_reference(x, r2s, s2r, w),
        ),
        "unpermute": (
            lambda: TP.unpermute_rows(y, s2r, r2s, w),
            lambda: P.unpermute_rows_reference(y, s2r, r2s, w),
        ),
        "weighted_row_dot": (
            lambda: TP.row_dot(y, x, s2r),
            lambda: P.weighted_row_dot_reference(y, x, s2r),
        ),
    }
    if TP.plan_takes(T * K, None):
        pairs["permute_indices"] = (
            lambda: TP.permute_plan(ids, E, align),
            lambda: P.permute_indices_reference(ids, E, align),
        )
    return pairs


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", default="1,16,128,1024,8192")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--align", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_permute_gpu: needs a CUDA GPU (the kernels' CPU tests run the interpreter)")
        return 0
    E, K, D = args.experts, args.top_k, args.dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; E={E} K={K} D={D} align={args.align}"
    )
    print(
        "| T | op | kernel us (graph) | reference us (graph) | ratio | kernel us (eager) | reference us (eager) | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for T in (int(t) for t in args.tokens.split(",")):
        for name, (kernel, reference) in _pairs(T, E, K, D, args.align, gen).items():
            cands = {"k": kernel, "r": reference}
            med = timed_medians(cands, args.reps, args.rounds, f"T={T} {name}")
            g_k, g_r = med.get("g:k", float("nan")), med.get("g:r", float("nan"))
            print(
                f"| {T} | {name} | {g_k:.1f} | {g_r:.1f} | {g_r / g_k:.2f} | {med['k']:.1f} | "
                f"{med['r']:.1f} | {med['r'] / med['k']:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
