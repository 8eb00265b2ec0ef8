"""The fused small-batch expert kernels (torch_moe._triton.moe_decode) against the layer's
inference path (``permute_indices`` + ``torch_moe::grouped_swiglu`` with the gather fused)
and against the plain peer, ``torch._grouped_mm`` with the gather and the scatter as
separate ATen ops (``index_select``, SwiGLU, ``index_add_``), on a CUDA GPU: time per call
(routing result -> expert outputs, each including ``permute_indices``; the peer's output
is the tokens'), the weight bytes of the experts the batch touches divided by that time
(decode is bound by reading them) and its share of the copy bandwidth measured in the same
run (issue target: >= 80% at T = 1-64 for bf16 weights), and the fused/unfused and
fused/peer ratios. bf16 weights and FP8 e4m3 rowwise weights (weight-only, dequantized in
registers).

    python benchmarks/bench_moe_decode.py                     # Qwen3-30B-A3B-like experts
    python benchmarks/bench_moe_decode.py --tokens 1,4,16,64 --dim 7168 --hidden 2048 --experts 256

Device time: each path captured --reps times in one CUDA graph and replayed (how decode is
served; a path that cannot be captured shows nan and says why); the last column times the
same calls launched from Python, which at decode sizes measures the host (the first H200
run, eager only, read 0.9-1.8 ms per call for every path). Medians of interleaved rounds,
CUDA events. Needs a GPU (exits with a message without).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import torch_moe  # noqa: F401  (registers the ops)
from torch_moe import ops
from torch_moe.perf import _calibrate_gpu  # its copy bandwidth: the calibration's own


def _time(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3  # us


def graphed(fn, calls: int):  # type: ignore[no-untyped-def]
    """``fn`` captured ``calls`` times back to back in one CUDA graph (how a decode step is
    served: no host launch cost), or None (and why) when ``fn`` cannot be captured. The
    graph reads the tensors ``fn`` uses: keep them alive while it replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture (allocator, compiles)
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as e:  # a host sync inside fn: report it, time it eager only
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    return graph, ""


def timed_medians(cands: dict, reps: int, rounds: int, label: str) -> dict[str, float]:
    """Median us per call of each candidate over interleaved rounds: launched from Python
    (key ``k``, ``reps`` calls a round) and replayed from a CUDA graph of ``reps`` calls (key
    ``"g:" + k``; absent, and said, where ``fn`` cannot be captured)."""
    runs = dict(cands)
    for k, fn in cands.items():
        graph, why = graphed(fn, reps)
        if graph is None:
            print(f"# {label} {k}: not capturable ({why})")
        else:
            runs["g:" + k] = graph.replay  # (the bound method keeps the graph alive)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, fn in runs.items():
            replay = k.startswith("g:")
            times[k].append(_time(fn, 1 if replay else reps) / (reps if replay else 1))
    return {k: statistics.median(v) for k, v in times.items()}


def grouped_mm_peer(x, w13, w2, ids, weights, num_experts):  # type: ignore[no-untyped-def]
    """The experts by ``torch._grouped_mm`` with the gather and the scatter as separate ops:
    x [T, D], w13 [E, 2F, D], w2 [E, D, F], ids / weights [T, K] -> [T, D]."""
    K = ids.shape[1]
    F = w2.shape[2]
    perm = ops.permute_indices(ids, num_experts)
    tok = torch.div(perm.row_to_slot, K, rounding_mode="floor")
    rows = x.index_select(0, tok)
    h = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=perm.offs)
    rw = weights.reshape(-1).index_select(0, perm.row_to_slot).to(h.dtype)
    a = torch.nn.functional.silu(h[:, :F]) * h[:, F:] * rw[:, None]
    y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=perm.offs)
    return torch.zeros_like(x).index_add_(0, tok, y)


def _bench(T, E, K, bf16, fp8, args, gen, copy_bps) -> str | None:
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
    peer = grouped_mm_peer(x, w13, w2, ids, weights, E).float()
    err = ((peer - ref).norm() / ref.norm()).item()
    if err > 1e-2:
        print(f"bench_moe_decode: the grouped_mm peer differs at T={T}: rel err {err:.3g}")
        return None
    cands = {
        "unfused": unfused,
        "peer": lambda: grouped_mm_peer(x, w13, w2, ids, weights, E),
        "bf16": lambda: fused(False),
        "fp8": lambda: fused(True),
    }
    for fn in cands.values():
        fn()
    # device time: each candidate replayed from a CUDA graph of args.reps calls; eager
    # (host launches, Python) as well, which at these sizes measures the host
    med = timed_medians(cands, args.reps, args.rounds, f"T={T}")
    dev = {k: med.get("g:" + k, float("nan")) for k in cands}
    wbytes = hit * 3 * F * D
    bf16_bps = 2 * wbytes / (dev["bf16"] / 1e6)
    return (
        f"| {T} | {hit} | {dev['unfused']:.1f} | {dev['peer']:.1f} | {dev['bf16']:.1f} | "
        f"{dev['fp8']:.1f} | {dev['bf16'] / dev['unfused']:.2f} | "
        f"{dev['bf16'] / dev['peer']:.2f} | {bf16_bps / 1e9:.0f} | "
        f"{bf16_bps / copy_bps:.0%} | {wbytes / dev['fp8'] / 1e3:.0f} | "
        f"{med['unfused']:.0f} / {med['peer']:.0f} / {med['bf16']:.0f} / {med['fp8']:.0f} |"
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
    copy_bps = _calibrate_gpu._copy_bandwidth(torch.device(dev), quick=False)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; E={E} D={D} F={F} K={K}")
    print(f"# copy bandwidth (256 MiB, read + written): {copy_bps / 1e9:.0f} GB/s")
    print(
        "| T | experts hit | unfused us | grouped_mm peer us | fused bf16 us | fused fp8 us | "
        "fused/unfused | fused/peer | bf16 GB/s | bf16 / copy | fp8 GB/s | "
        "eager us: unfused / peer / bf16 / fp8 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for T in (int(t) for t in args.tokens.split(",")):
        row = _bench(T, E, K, (w13, w2), (q13, s13, q2, s2), args, gen, copy_bps)
        if row is None:
            return 1
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
