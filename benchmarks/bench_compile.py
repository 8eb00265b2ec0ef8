"""Does torch.compile pay for the MoE layer, and what do torch_moe's compiler passes save?

For each layer shape and precision, forward + backward of one MoE layer three ways, in one
run: eager, ``torch.compile`` (Inductor, every torch_moe op an extern call), and
``torch.compile`` with ``torch_moe._inductor``'s passes. Reported per way: the median time
over the GEMM floor (routed-expert FLOPs 18*T*K*D*F, 12*T*K*D*F for ungated experts, over
the best large-GEMM rate measured in the same run for the parameter dtype, as
bench_moe_layer.py), and the peak of the CPU
memory allocated during the step (from the profiler's allocation events; the parameters,
inputs and the gradients' previous values are outside it). The permuted activation is
T*K*D elements: the passes should take at least that off the peak.

    python benchmarks/bench_compile.py                          # 3 shapes x bf16, fp8_rowwise
    python benchmarks/bench_compile.py --tokens 512 --reps 3    # quicker
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import platform
import subprocess
import sys

import torch
from bench_ops import DTYPES, gemm_rate, interleaved
from check_perf_gpu import profile_step
from torch.profiler import ProfilerActivity, profile

import torch_moe._inductor as TI
from torch_moe.nn import MoE

SHAPES = [(1792, 8, 2), (384, 32, 6), (256, 64, 8)]  # (F, E, K), as bench_moe_layer.py
EXPERTS: dict[str, dict] = {  # --experts: MoE's expert arguments
    "swiglu": {},
    "gpt_oss": dict(
        activation="swigluoai", swiglu_limit=7.0, experts_bias=True, gate_up_interleaved=True
    ),
    "relu2": dict(activation="relu2", experts_bias=True),
}
# DeepSeek-V3-like (bench_quant.py): D=7168, F=2048, 32 local experts, top-8; --shapes dsv3
DSV3 = (2048, 32, 8)


def cpu_isa() -> str:
    """AVX2 / AVX512-BF16 / AMX, from the CPU flags."""
    try:
        flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    isa = [name for flag, name in [("avx2", "AVX2"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16")] if flag in flags]  # fmt: skip
    return " ".join(isa) or "no AVX2"


DEVICE = "cpu"


def step(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    module.zero_grad(set_to_none=True)
    module(x).backward(grad)


def median_seconds(fns, reps: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Interleaved medians (bench_ops.interleaved) on CPU; triton.testing.do_bench on CUDA."""
    if DEVICE != "cuda":
        return interleaved(fns, reps)
    import triton

    return {name: triton.testing.do_bench(fn, rep=200 * reps) / 1e3 for name, fn in fns.items()}


def peak_bytes(fn) -> int:  # type: ignore[no-untyped-def]
    """Peak of the memory allocated while ``fn`` runs: on CPU from the profiler's allocation
    events (allocations minus frees, in order), on CUDA from the caching allocator."""
    if torch.cuda.is_available() and DEVICE == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    sizes = [
        e.nbytes() for e in sorted(events, key=lambda e: e.start_ns()) if e.name() == "[memory]"
    ]
    live = peak = 0
    for nbytes in sizes:  # + an allocation, - a free
        live += nbytes
        peak = max(peak, live)
    return peak


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--precisions", default="bf16,fp8_rowwise")
    p.add_argument("--shapes", default="0,1,2", help="indices into SHAPES, or dsv3")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--experts",
        choices=list(EXPERTS),
        default="swiglu",
        help="the routed experts: SwiGLU (grouped_swiglu), or composed (the glu op between "
        "grouped GEMMs) as GPT-OSS's or Nemotron-H's",
    )
    p.add_argument(
        "--no-inline-glu",
        action="store_true",
        help="keep the composed experts' glu an op (torch_moe._inductor.config.inline_glu = False)",
    )
    p.add_argument(
        "--no-inline-swiglu",
        action="store_true",
        help="keep grouped_swiglu an op (torch_moe._inductor.config.inline_swiglu = False)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the table: the top kernels (own time) of one eager and one +passes step",
    )
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    TI.config.inline_swiglu = not args.no_inline_swiglu
    TI.config.inline_glu = not args.no_inline_glu
    dtype = DTYPES[args.dtype]
    t, d = args.tokens, args.dim
    if DEVICE == "cuda":  # the floor: a large bf16 mm on the device (measured here)
        import triton

        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        rate = rate32 = 2 * 8192**3 / (triton.testing.do_bench(lambda: a @ a.t()) / 1e3)
    else:
        rate = gemm_rate(dtype, 2048 if dtype != torch.float32 else 4096, 3)
        rate32 = gemm_rate(torch.float32, 4096, 3)
    floor_rate = max(rate, rate32)  # the faster math is the machine's floor
    print(
        f"# torch {torch.__version__}, {platform.machine()} {cpu_isa()}, {os.cpu_count()} CPUs, "
        f"threads={torch.get_num_threads()}; large mm {rate / 1e9:.0f} GFLOP/s {args.dtype}, "
        f"{rate32 / 1e9:.0f} GFLOP/s fp32 (floor: {floor_rate / 1e9:.0f}); T={t}, D={d}, "
        f"params {args.dtype}, median of {args.reps}; {' '.join(sys.argv[1:])}\n"
    )
    header = (
        "| F, E, K | precision | eager x floor | compiled x floor | +passes x floor | "
        "eager peak MiB | compiled peak MiB | +passes peak MiB | T*K*D MiB | passes saved MiB |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|", flush=True)
    mib = 2.0**20
    profiles: list[tuple[str, list[tuple[str, float]]]] = []
    for shape in args.shapes.split(","):
        f, e, k = DSV3 if shape == "dsv3" else SHAPES[int(shape)]
        for precision in args.precisions.split(","):
            torch.manual_seed(0)
            torch._dynamo.reset()
            eager = MoE(
                d,
                f,
                e,
                k,
                route_norm=True,
                precision=precision,
                dtype=dtype,
                device=DEVICE,
                **EXPERTS[args.experts],
            )
            plain = torch.compile(copy.deepcopy(eager), fullgraph=True)
            fused = torch.compile(copy.deepcopy(eager), fullgraph=True, options=TI.options())
            x = torch.randn(t, d, dtype=dtype, device=DEVICE, requires_grad=True)
            grad = torch.randn(t, d, dtype=dtype, device=DEVICE)
            fns = {
                name: functools.partial(step, m, x, grad)
                for name, m in (("eager", eager), ("compiled", plain), ("passes", fused))
            }
            for fn in fns.values():  # compile, and warm the weight cache
                fn()
            times = median_seconds(fns, args.reps)
            peaks = {name: peak_bytes(fn) / mib for name, fn in fns.items()}
            # forward + backward: 3x the two GEMMs' 2*T*K*D*(N + F), N = 2F gated, F relu2
            flops = 6 * t * k * d * (eager.experts.w13.shape[1] + f)
            perm = t * k * d * torch.empty((), dtype=dtype).element_size() / mib
            ratios = {name: times[name] * floor_rate / flops for name in fns}
            print(
                f"| {f}, {e}, {k} | {precision} | {ratios['eager']:.2f} | "
                f"{ratios['compiled']:.2f} | {ratios['passes']:.2f} | {peaks['eager']:.0f} | "
                f"{peaks['compiled']:.0f} | {peaks['passes']:.0f} | {perm:.0f} | "
                f"{peaks['compiled'] - peaks['passes']:.0f} |",
                flush=True,
            )
            if args.profile:
                for name in ("eager", "passes"):
                    top = profile_step(fns[name], torch.device(DEVICE))
                    profiles.append(
                        (f"{f}, {e}, {k} {precision} {name}: {times[name] * 1e3:.2f} ms", top)
                    )
    for title, top in profiles:
        print(f"\n{title}, top kernels (own time)\n\n| kernel | ms |\n|---|---|")
        for kernel, sec in top:
            print(f"| {kernel[:90]} | {sec * 1e3:.3f} |")


if __name__ == "__main__":
    main()
