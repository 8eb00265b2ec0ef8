"""How close is one torch_moe MoE layer (forward + backward) to its GEMM floor, and what
does it keep for the backward, next to HF transformers' experts?

For each shape: tokens/s, the time over the GEMM floor (routed-expert FLOPs
18*T*K*D*F over the large-GEMM rate, docs/design.md §8: the native half-precision mm
rate where this CPU multiplies bf16 natively, the fp32 mm rate where torch_moe upcasts;
the floor mm runs in the same rounds as the layer; both rates are printed), split into
what the layer's own expert GEMMs cost alone at its group sizes (timed in the same
rounds) and what the rest of the layer adds, and saved-activation bytes per token
(distinct tensors saved for backward, parameters excluded). The peers are HF transformers' own Qwen3-MoE sparse block
(``Qwen3MoeSparseMoeBlock``, same router math) with torch_moe's weights, run with its
``eager`` experts (a per-expert Python loop) and its ``grouped_mm`` experts
(``torch._grouped_mm``). Where this CPU only emulates bf16 they are timed apart, once,
without warm-up (their backward takes oneDNN's emulated row-major x row-major path);
otherwise in the same rounds as torch_moe. ``--baseline REV`` times the layer with the
``grouped_swiglu`` of git revision REV in the same rounds too (before / after).

``--decode`` times the layer's decode steps instead: ``MoE`` forward under
``torch.inference_mode()`` for T = 1 ... 256 tokens at Qwen3-30B-A3B-like experts (D=2048,
F=768, E=128, K=8; 1.1 GiB of bf16 experts, past any cache), fresh tokens every step,
against the weight-read floor: the bytes of the distinct experts the step routes to (and
the router's) over the read bandwidth of a large GEMV (``torch.mv`` over a matrix well
past the last-level cache) measured in the same run, and against the same bytes over
the streaming read bandwidth (``sum`` over that matrix), the lower floor where one
thread's bf16 GEMV is compute-bound. (benchmarks/bench_decode.py times the experts alone
against the GEMV floor, next to peers.)

    python benchmarks/bench_moe_layer.py                  # the issue's three shapes, bf16
    python benchmarks/bench_moe_layer.py --tokens 512     # quicker
    python benchmarks/bench_moe_layer.py --baseline HEAD~3 --threads 1 --clock cpu
    python benchmarks/bench_moe_layer.py --decode --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import types
from collections.abc import Callable, Iterator
from typing import Any

import bench_ops
import torch
from bench_ops import (
    DTYPES,
    add_timing_args,
    apply_timing_args,
    floor_dtype,
    floor_line,
    floor_size,
    gemm_rate,
    interleaved,
    load_baseline,
    machine_line,
    native_mm_rate,
    page_faults,
    print_decisions,
    square_mm,
)
from torch import Tensor, nn

import torch_moe  # noqa: F401
import torch_moe.nn.modules.moe as moe_module
from torch_moe._ops.permute import unpermute as unpermute_rows
from torch_moe.nn import MoE

SHAPES = [(1792, 8, 2), (384, 32, 6), (256, 64, 8)]  # (F, E, K)
TARGETS = {8: 1.15, 32: 1.3, 64: 1.4}  # x floor, by E (the targets)


def hf_block(moe: MoE, impl: str) -> nn.Module | None:
    """HF transformers' Qwen3-MoE sparse block sharing ``moe``'s weights (None without
    transformers 5)."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError:
        return None
    e, two_f, d = moe.experts.w13.shape
    config = Qwen3MoeConfig(
        hidden_size=d,
        moe_intermediate_size=two_f // 2,
        num_experts=e,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=True,
    )
    config._experts_implementation = impl
    block = Qwen3MoeSparseMoeBlock(config).to(moe.experts.w13.dtype)
    block.gate.weight = moe.router.weight
    block.experts.gate_up_proj = moe.experts.w13
    block.experts.down_proj = moe.experts.w2
    return block


def expert_gemms(moe: MoE, x: Tensor) -> Callable[[], None]:
    """The layer's six expert GEMMs alone: forward (x W13^T, a W2^T), backward (dA = dY W2,
    dW2, dX = dH W13, dW13), at the group sizes its router gives ``x``, through the grouped
    GEMM ops whose CPU kernels (and measured decisions) ``grouped_swiglu`` uses, on fresh
    operands of the step's shapes. Its time over the floor is what the GEMMs' shapes cost;
    the layer's time over it, everything else (routing, permute, activation, combine)."""
    ops = torch.ops.torch_moe
    with torch.no_grad():
        counts = moe.router(x.detach())[2]
    offs = counts.cumsum(0).to(torch.int32)
    w13, w2 = moe.experts.w13.detach(), moe.experts.w2.detach()
    rows, dim, hidden = int(offs[-1]), w13.shape[2], w2.shape[2]
    g = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> Tensor:
        return torch.randn(shape, generator=g).to(x.dtype)

    xs, a, gy, dh = rand(rows, dim), rand(rows, hidden), rand(rows, dim), rand(rows, 2 * hidden)

    def run() -> None:
        ops.grouped_mm(xs, w13.transpose(-2, -1), offs)
        ops.grouped_mm(a, w2.transpose(-2, -1), offs)
        ops.grouped_mm(gy, w2, offs)
        ops.grouped_mm_wgrad(gy, a, offs)
        ops.grouped_mm(dh, w13, offs)
        ops.grouped_mm_wgrad(dh, xs, offs)

    return run


def fwd_bwd(module: nn.Module, x: Tensor, grad: Tensor) -> None:
    module.zero_grad(set_to_none=True)
    x.grad = None
    module(x).backward(grad)


@contextlib.contextmanager
def swapped_swiglu(fn: Callable[..., Tensor]) -> Iterator[None]:
    """MoE layers call ``fn`` as their ``grouped_swiglu`` inside the block, and where they
    combine in the experts (``grouped_swiglu_combine``), ``fn`` then today's unpermute."""

    def combine(*args: Any) -> Tensor:
        x, w13, w2, offs, row_weights, row_to_slot, slot_to_row = args
        y = fn(x, w13, w2, offs, row_weights, row_to_slot=row_to_slot, slot_to_row=slot_to_row)
        return unpermute_rows(y, slot_to_row, row_to_slot)

    current = moe_module.grouped_swiglu, moe_module.grouped_swiglu_combine
    moe_module.grouped_swiglu, moe_module.grouped_swiglu_combine = fn, combine
    try:
        yield
    finally:
        moe_module.grouped_swiglu, moe_module.grouped_swiglu_combine = current


def saved_bytes_per_token(module: nn.Module, x: Tensor) -> float:
    """Bytes of distinct non-parameter tensors saved for backward by one forward, per token."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() != x.data_ptr():
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values()) / (x.numel() // x.shape[-1])


def read_bandwidths(dtype: torch.dtype, dim: int, reps: int) -> tuple[float, float]:
    """Bytes/s of ``torch.mv`` over a [N, dim] matrix of 1 GiB (past the last-level cache
    of the CPUs measured here) and of ``sum`` over the same matrix (the memory system's
    streaming read rate: where one thread's GEMV is compute-bound, as bf16 on a CPU
    without a native bf16 dot product, the GEMV floor sits below it), median of ``reps``
    calls each (bench_ops' clock)."""
    esize = torch.empty((), dtype=dtype).element_size()
    w = torch.randn(2**30 // (dim * esize), dim).to(dtype)
    v = torch.randn(dim).to(dtype)
    sec = interleaved({"mv": lambda: torch.mv(w, v), "sum": lambda: w.sum()}, reps)
    return w.numel() * esize / sec["mv"], w.numel() * esize / sec["sum"]


def decode(args: argparse.Namespace, base: types.SimpleNamespace | None) -> None:
    """MoE decode steps under inference_mode against the weight-read floor."""
    dtype = DTYPES[args.dtype]
    d, f, e, k = 2048, 768, 128, 8
    esize = torch.empty((), dtype=dtype).element_size()
    expert_bytes, router_bytes = 3 * f * d * esize, e * d * esize
    bw, stream = read_bandwidths(dtype, d, 5)
    print(
        f"# read bandwidth over 1 GiB: GEMV (torch.mv) {bw / 1e9:.2f} GB/s, "
        f"streaming (sum) {stream / 1e9:.2f} GB/s"
    )
    print(f"# decode: D={d}, F={f}, E={e}, K={k}, {args.dtype}, {args.reps} steps per T\n")
    torch.manual_seed(0)
    moe = MoE(d, f, e, k, route_norm=True, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(1)
    who = ["ours"] + (["base"] if base is not None else [])
    head = "| T | step ms | experts read | floor ms | x floor | x streaming floor |"
    head += " baseline x floor |" if base is not None else ""
    rows = []
    with torch.inference_mode():
        for t in [1, 2, 4, 8, 16, 32, 64, 128, 256]:
            ratios: dict[str, list[float]] = {name: [] for name in who}
            steps, floors, hits, streams = [], [], [], []
            for i in range(args.reps + 2):  # two warm-up steps
                x = torch.randn(t, d, generator=gen).to(dtype)
                hit = int((moe.router(x)[2] > 0).sum())
                floor = (hit * expert_bytes + router_bytes) / bw
                for name in who:
                    swap: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
                    if name == "base" and base is not None:
                        swap = swapped_swiglu(base.grouped_swiglu)
                    with swap:
                        t0 = bench_ops.CLOCK()
                        moe(x)
                        sec = bench_ops.CLOCK() - t0
                    if i >= 2:
                        ratios[name].append(sec / floor)
                        if name == "ours":
                            steps.append(sec)
                            floors.append(floor)
                            streams.append(sec / (floor * bw / stream))
                            hits.append(hit)
            row = [
                str(t),
                f"{statistics.median(steps) * 1e3:.2f}",
                f"{statistics.median(hits):.0f}",
                f"{statistics.median(floors) * 1e3:.2f}",
                f"{statistics.median(ratios['ours']):.2f}",
                f"{statistics.median(streams):.2f}",
            ]
            if base is not None:
                row.append(f"{statistics.median(ratios['base']):.2f}")
            rows.append(row)
            print(f"# done T={t}", flush=True)
    print()
    print_decisions()
    print(machine_line())
    print()
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(
        "\nx floor: median over steps of step time / ((distinct experts read x 3*D*F + E*D) "
        "* 2 bytes / GEMV read bandwidth); x streaming floor: the same bytes over the "
        "streaming read bandwidth; fresh tokens every step"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-peer", action="store_true", help="skip HF transformers' blocks")
    p.add_argument(
        "--peer-reps",
        type=int,
        default=1,
        help="where this CPU only emulates the dtype: timed calls of the HF blocks, apart, no "
        "warm-up (~100 s a call at the default shapes on such a CPU)",
    )
    p.add_argument("--baseline", metavar="REV", help="also time grouped_swiglu of git REV")
    p.add_argument("--decode", action="store_true", help="time decode steps instead (doc)")
    add_timing_args(p)
    args = p.parse_args()
    timing = apply_timing_args(args)
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    t, d = args.tokens, args.dim
    print(machine_line())
    base = load_baseline(args.baseline) if args.baseline else None
    if args.decode:
        decode(args, base)
        return

    cdt = floor_dtype(dtype)
    native = cdt == dtype
    rate = gemm_rate(dtype, floor_size(dtype), 3)
    rate32 = gemm_rate(torch.float32, floor_size(torch.float32), 3)
    native_rate = native_mm_rate(dtype, floor_size(dtype), 3)
    print(floor_line(args.dtype, dtype, rate, rate32, native_rate))
    print(f"# T={t}, D={d}, {args.dtype}, {timing}")
    if base is not None:
        print(f"# baseline: the layer with grouped_swiglu of {base.rev}")
    floor_mm = square_mm(cdt, floor_size(cdt))
    mm_flops = 2 * floor_size(cdt) ** 3

    header = (
        "| F, E, K | torch_moe tok/s | x floor | target | GEMMs alone x floor | x GEMMs alone | "
        "x bf16 mm | x fp32 mm | x native mm | saved KiB/tok | "
        "HF eager x floor | HF grouped_mm x floor | best peer saved KiB/tok | saved ratio |"
    )
    if base is not None:
        header += " baseline x floor | baseline/ours |"
    rows = []
    for f, e, k in SHAPES:
        moe = MoE(d, f, e, k, route_norm=True, dtype=dtype)
        x = torch.randn(t, d, dtype=dtype, requires_grad=True)
        grad = torch.randn(t, d, dtype=dtype)
        fns: dict[str, Callable[[], object]] = {
            "ours": functools.partial(fwd_bwd, moe, x, grad),
            "floor": floor_mm,
            "gemms": expert_gemms(moe, x),
        }
        if base is not None:

            def run_base(moe: MoE = moe, x: Tensor = x, grad: Tensor = grad) -> None:
                with swapped_swiglu(base.grouped_swiglu):
                    fwd_bwd(moe, x, grad)

            fns["base"] = run_base
        peers: dict[str, nn.Module] = {}
        if not args.skip_peer:
            for impl in ("eager", "grouped_mm"):
                block = hf_block(moe, impl)
                if block is not None:
                    peers[impl] = block
        x3, grad3 = x.view(1, t, d), grad.view(1, t, d)
        peer_fns = {name: functools.partial(fwd_bwd, blk, x3, grad3) for name, blk in peers.items()}
        if native:
            fns.update(peer_fns)
        times = interleaved(fns, args.reps)
        if not native:
            times.update(interleaved(peer_fns, args.peer_reps, warmup=False))
        flops = 18 * t * k * d * f
        floor_s = flops * times["floor"] / mm_flops
        ours = times["ours"]
        saved = saved_bytes_per_token(moe, x) / 1024
        peer_saved = {name: saved_bytes_per_token(blk, x3) / 1024 for name, blk in peers.items()}
        best_saved = min(peer_saved.values()) if peer_saved else None
        x_bf16 = ours / (flops / rate) if not native else ours / floor_s
        x_fp32 = ours / (flops / rate32) if native else ours / floor_s
        row = [
            f"{f}, {e}, {k}",
            f"{t / ours:.0f}",
            f"{ours / floor_s:.2f}",
            f"{TARGETS.get(e, float('nan')):.2f}",
            f"{times['gemms'] / floor_s:.2f}",
            f"{ours / times['gemms']:.2f}",
            f"{x_bf16:.2f}",
            f"{x_fp32:.2f}",
            f"{ours / (flops / native_rate):.2f}" if native_rate else "-",
            f"{saved:.1f}",
        ]
        for name in ("eager", "grouped_mm"):
            row.append(f"{times[name] / floor_s:.2f}" if name in times else "-")
        row.append(f"{best_saved:.1f}" if best_saved else "-")
        row.append(f"{saved / best_saved:.2f}" if best_saved else "-")
        if base is not None:
            row += [f"{times['base'] / floor_s:.2f}", f"{times['base'] / ours:.2f}"]
        rows.append(row)
        faults, sys_s = page_faults(fns["ours"])
        print(
            f"# done F={f} E={e} K={k}: {faults:.0f} minor page faults and {sys_s * 1e3:.1f} ms "
            f"of system time per torch_moe step ({sys_s / ours:.0%} of its median)",
            flush=True,
        )

    print()
    print_decisions()
    print(machine_line())
    print()
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    floor_dt = args.dtype if native else "fp32"
    print(
        f"\nx floor: time / (18*T*K*D*F / the {floor_dt} mm rate of the same rounds), the math "
        "torch_moe does on this CPU; GEMMs alone: the layer's six expert GEMMs at its own "
        "group sizes through the same grouped GEMM kernels, timed in the same rounds (x floor "
        "= GEMMs alone x floor * x GEMMs alone); x native mm: the time over the same FLOPs at "
        "torch_moe's own bf16 GEMM's rate on the floor's mm (where it runs; a higher rate than "
        "torch.mm's makes this the stricter ratio); saved ratio: torch_moe's saved bytes over "
        "the best peer's"
    )


if __name__ == "__main__":
    main()
