"""The fused small-batch expert kernels (torch_moe._triton.moe_decode) against the layer's
inference path (``permute_indices`` + ``torch_moe::grouped_swiglu`` with the gather fused),
on a CUDA GPU: time per call (routing result -> expert outputs of the padded rows, both
including ``permute_indices``), the weight bytes of the experts the batch touches divided by
that time (decode is bound by reading them), and the fused/unfused ratio. bf16 weights and
FP8 e4m3 rowwise weights (weight-only, dequantized in registers).

    python benchmarks/bench_moe_decode.py                     # Qwen3-30B-A3B-like experts
    python benchmarks/bench_moe_decode.py --tokens 1,4,16,64 --dim 7168 --hidden 2048 --experts 256

Medians of interleaved repetitions, CUDA events. Needs a GPU (exits with a message without).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import torch_moe  # noqa: F401  (registers the ops)
from torch_moe import ops


def _time(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3  # us


def _bench(T, E, K, bf16, fp8, args, gen) -> str | None:
    """One table row for T tokens, or None when the fused output is wrong."""
    from torch_moe._triton import moe_decode as MD

    w13, w2 = bf16
    q13, s13, q2, s2 = fp8
    D, F, dev = w13.shape[2], w2.shape[2], w13.device
    x = torch.randn(T, D, device=dev, generator=gen).bfloat16()
    ids = torch.randint(0, E, (T, K), device=dev, generator=gen)
    weights = torch.rand(T, K, device=dev, generator=gen)
    hit = int(torch.unique(ids).numel())
    block_m = MD.config_for(T * K).block_m

    def rows_weights(perm):
        padded = torch.cat([weights.reshape(-1), weights.new_zeros(1)])
        return padded[perm.row_to_slot]

    def unfused():
        perm = ops.permute_indices(ids, E)
        tok = torch.div(perm.row_to_slot, K, rounding_mode="floor")
        return torch.ops.torch_moe.grouped_swiglu(x, w13, w2, perm.offs, rows_weights(perm), tok)[0]

    def fused(fp8: bool):
        perm = ops.permute_indices(ids, E, align=block_m)
        rw = rows_weights(perm)
        if fp8:
            return MD.moe_decode(
                x, q13, q2, perm.row_to_slot, perm.offs, rw, K,
                w13_scale=s13, w2_scale=s2, scale_mode="rowwise",
            )  # fmt: skip
        return MD.moe_decode(x, w13, w2, perm.row_to_slot, perm.offs, rw, K)

    # same values (bf16 rounding of the intermediate differs in order only)
    perm1 = ops.permute_indices(ids, E)
    perm2 = ops.permute_indices(ids, E, align=block_m)
    ref = ops.unpermute(unfused(), None, perm1).float()
    got = ops.unpermute(fused(False), None, perm2).float()
    err = ((got - ref).norm() / ref.norm()).item()
    if err > 1e-2:
        print(f"bench_moe_decode: fused output differs from unfused at T={T}: rel err {err:.3g}")
        return None
    cands = {"unfused": unfused, "bf16": lambda: fused(False), "fp8": lambda: fused(True)}
    for fn in cands.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in cands}
    for _ in range(args.rounds):  # interleaved
        for k, fn in cands.items():
            times[k].append(_time(fn, args.reps))
    med = {k: statistics.median(v) for k, v in times.items()}
    wbytes = hit * 3 * F * D
    return (
        f"| {T} | {hit} | {med['unfused']:.1f} | {med['bf16']:.1f} | {med['fp8']:.1f} | "
        f"{med['bf16'] / med['unfused']:.2f} | {2 * wbytes / med['bf16'] / 1e3:.0f} | "
        f"{wbytes / med['fp8'] / 1e3:.0f} |"
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", default="1,4,16,64,256")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_moe_decode: needs a CUDA GPU (the CPU path is the interpreter)")
        return 0
    from torch_moe.quantization import quantize_fp8

    E, D, F, K = args.experts, args.dim, args.hidden, args.top_k
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(E, 2 * F, D, device=dev, generator=gen) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, device=dev, generator=gen) / F**0.5).bfloat16()
    q13, s13 = quantize_fp8(w13, [1, -1])
    q2, s2 = quantize_fp8(w2, [1, -1])
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; E={E} D={D} F={F} K={K}")
    print(
        "| T | experts hit | unfused us | fused bf16 us | fused fp8 us | fused/unfused | bf16 GB/s | fp8 GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for T in (int(t) for t in args.tokens.split(",")):
        row = _bench(T, E, K, (w13, w2), (q13, s13, q2, s2), args, gen)
        if row is None:
            return 1
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
