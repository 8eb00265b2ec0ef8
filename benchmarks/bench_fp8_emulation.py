"""How fast is the CPU FP8 / MXFP8 emulation, with and without its native kernels?

For each recipe and shape: one ``MoE`` layer step (forward + backward, bf16 layer,
``precision=<recipe>``) on the CPU, timed three ways in the same process, rounds
alternated: ``aten`` (the e4m3 casts, dequantization and quantize_fp8's block maxima by
ATen's ops, the scaled GEMMs in fp32: the emulation before the native kernels),
``native`` (csrc/fp8_cpu.cpp's conversions and quantizer; where this CPU has no native
bf16 GEMMs, also the fp32 GEMMs by the native kernels' pieces,
``scaled_grouped_mm.dequantizes_pieces``) and ``native + bf16 GEMMs``
(also, where this CPU has native bf16 GEMMs, MX operands multiplied by the bf16 grouped
GEMM, ``scaled_grouped_mm._mx_in_bf16``, and the FP8 codes multiplied in bf16 with the
scales applied per k block inside the GEMM's tiles, ``_blocks_in_bf16``, and with scales
constant along the reduction repeated per block, ``_codes_in_bf16``). The first two give
the same bits but where the pieces run (the same math, each piece's GEMM on one thread:
the fp32 GEMM's summation order may differ); the third the same math in another
rounding order (its largest difference from the fp32 form is printed).
Shapes are ``benchmarks/bench_perf_model.py``'s precision configs (prec1 / prec2 / prec3).
``--vs-bf16``: instead, each recipe's step (every native route on) against the bf16
layer's step of the same shape, in one process, rounds alternated (what the emulation
costs over the bf16 layer it emulates).
``--decode``: instead, a bf16 layer's inference forward (``torch.inference_mode()``, the
weights' quantization cached) at T tokens (D=1024, F=512, E=64, top 4 by default) for
each recipe and for bf16, the recipes also with the FP8 GEMM's few-rows form off (probe
``few_codes`` forced to ``pieces``: the GEMM's pieces, as before that form), in one
process, rounds alternated, each round on the next of 8 inputs; the floor is the bytes of
the distinct experts' weights the batch reads (codes and scales for a recipe, bf16 for
bf16; the scales add under 0.5%) over a large GEMV's read bandwidth.

    python benchmarks/bench_fp8_emulation.py --threads 1 --clock cpu
    python benchmarks/bench_fp8_emulation.py --recipes mxfp8 --shapes prec2 --reps 12
    python benchmarks/bench_fp8_emulation.py --threads 1 --clock cpu --vs-bf16
    python benchmarks/bench_fp8_emulation.py --threads 1 --clock cpu --decode
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import time
from collections.abc import Callable, Iterator

import bench_ops
import torch

import torch_moe  # noqa: F401
from torch_moe.nn import MoE
from torch_moe.quantization import quantize as Q

S = importlib.import_module("torch_moe.quantization.scaled_grouped_mm")

SHAPES = {  # T, D, F, E, K
    "prec1": (2048, 256, 256, 16, 2),
    "prec2": (1024, 512, 512, 8, 2),
    "prec3": (512, 256, 128, 64, 4),
}
RECIPES = ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8")
MODES = ("aten", "native", "native + bf16 GEMMs")


_BF16_ROUTES = ("_mx_in_bf16", "_codes_in_bf16", "_wgrad_codes_in_bf16", "_blocks_in_bf16")


@contextlib.contextmanager
def mode(name: str) -> Iterator[None]:
    """The emulation as ``name`` runs it (module attributes swapped, restored after)."""
    kernels = Q._fp8_kernels
    routes = {r: getattr(S, r) for r in _BF16_ROUTES}
    if name == "aten":
        Q._fp8_kernels = lambda t: None
    if name != MODES[2]:
        for r in _BF16_ROUTES:
            setattr(S, r, lambda *a: False)
    try:
        yield
    finally:
        Q._fp8_kernels = kernels
        for r, f in routes.items():
            setattr(S, r, f)


def layer_step(recipe: str, shape: tuple[int, ...]) -> Callable[[], tuple[torch.Tensor, ...]]:
    """One forward + backward of a bf16 ``MoE`` of ``shape`` in ``recipe`` ("bf16": none)."""
    T, D, F, E, K = shape
    torch.manual_seed(0)
    precision = {} if recipe == "bf16" else {"precision": recipe}
    moe = MoE(D, F, E, K, route_norm=True, dtype=torch.bfloat16, **precision)
    x = torch.randn(T, D, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(T, D, dtype=torch.bfloat16)

    def step() -> tuple[torch.Tensor, ...]:
        moe.zero_grad(set_to_none=True)
        x.grad = None
        y = moe(x)
        y.backward(gy)
        assert x.grad is not None
        return y.detach(), x.grad

    return step


def vs_bf16(recipes: list[str], shapes: list[str], reps: int, clock: Callable[[], float]) -> None:
    """Each recipe's step (all native routes) over the bf16 layer's, one process."""
    print(f"# one layer step over the bf16 layer's, median of {reps} alternated rounds, ms\n")
    print("| T, D, F, E, K | bf16 | " + " | ".join(recipes) + " |")
    print("|---" * (len(recipes) + 2) + "|")
    for shape_name in shapes:
        steps = {r: layer_step(r, SHAPES[shape_name]) for r in ("bf16", *recipes)}
        for step in steps.values():
            step()
        times: dict[str, list[float]] = {r: [] for r in steps}
        for i in range(reps):
            for r in steps if i % 2 == 0 else list(steps)[::-1]:
                t0 = clock()
                steps[r]()
                times[r].append(clock() - t0)
        med = {r: statistics.median(v) * 1e3 for r, v in times.items()}
        cells = [f"{med[r]:.1f} ({med[r] / med['bf16']:.2f}x)" for r in recipes]
        shape = ", ".join(map(str, SHAPES[shape_name]))
        print(f"| {shape} | {med['bf16']:.1f} | {' | '.join(cells)} |", flush=True)


def decode(recipes: list[str], tokens: list[int], reps: int, clock: Callable[[], float]) -> None:
    """The inference forward per recipe (with and without the few-rows form) and in bf16."""
    from bench_decode import gemv_bandwidth

    from torch_moe._ops import _cpu_probe

    D, F, E, K = 1024, 512, 64, 4
    bw = gemv_bandwidth()
    print(f"# D={D} F={F} E={E} top {K}; large GEMV read: {bw / 1e9:.1f} GB/s")
    print(
        f"# inference forward, median of {reps} alternated rounds, ms (x the weight-read floor)\n"
    )
    ways = [("bf16", "bf16", None)]
    for r in recipes:  # (MX's GEMMs are not the codes GEMM's: no few-rows form to turn off)
        ways += [(r, r, None)] + ([(f"{r}, pieces", r, "pieces")] if r != "mxfp8" else [])
    print("| T | experts hit | " + " | ".join(name for name, _, _ in ways) + " |")
    print("|---" * (len(ways) + 2) + "|")
    layers = {}
    for precision in {p for _, p, _ in ways}:
        torch.manual_seed(0)
        kw = {} if precision == "bf16" else {"precision": precision}
        layers[precision] = MoE(D, F, E, K, dtype=torch.bfloat16, **kw).eval()
    for T in tokens:
        gen = torch.Generator().manual_seed(T)
        xs = [torch.randn(T, D, generator=gen).to(torch.bfloat16) for _ in range(8)]
        with torch.no_grad():
            logits = [layers["bf16"].router(x) for x in xs]
        hit = statistics.median(len(r[1].unique()) for r in logits)  # (the router's ids)

        def run(precision: str, force: str | None, x: torch.Tensor) -> None:
            with _cpu_probe.force(**({"few_codes": force} if force else {})):
                layers[precision](x)

        times: dict[str, list[float]] = {name: [] for name, _, _ in ways}
        with torch.inference_mode():
            for _, precision, force in ways:  # warm-up: caches filled, probes decided
                run(precision, force, xs[0])
            for i in range(reps):
                for name, precision, force in ways if i % 2 == 0 else ways[::-1]:
                    t0 = clock()
                    run(precision, force, xs[i % len(xs)])
                    times[name].append(clock() - t0)
        cells = []
        for name, precision, _ in ways:
            per_elem = 2.0 if precision == "bf16" else 1.0  # (the scales: under 0.5% more)
            floor = hit * 3 * D * F * per_elem / bw
            med = statistics.median(times[name])
            cells.append(f"{med * 1e3:.2f} ({med / floor:.2f})")
        print(f"| {T} | {hit:.0f} | {' | '.join(cells)} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--reps", type=int, default=8, help="rounds per mode (medians)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--vs-bf16", action="store_true", help="each recipe over the bf16 step")
    p.add_argument("--decode", action="store_true", help="the inference forward at T tokens")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(bench_ops.machine_line())
    if args.vs_bf16:
        vs_bf16(args.recipes, args.shapes, args.reps, clock)
        return
    if args.decode:
        decode(args.recipes, args.tokens, args.reps, clock)
        return
    print(f"# native e4m3 kernels here: {Q.native_fp8_conversions()}")
    print(f"# bf16 GEMMs native here: {S.cpu_compute_dtype(torch.bfloat16) == torch.bfloat16}")
    print(f"# one layer step, median of {args.reps} alternated rounds, {args.clock} clock, ms\n")
    print("| recipe | T, D, F, E, K | aten | native | native + bf16 GEMMs | max diff (y, dx) |")
    print("|---|---|---|---|---|---|")
    for recipe in args.recipes:
        for shape_name in args.shapes:
            step = layer_step(recipe, SHAPES[shape_name])
            outs = {}
            for m in MODES:
                with mode(m):
                    step()
                    outs[m] = [t.float().clone() for t in step()]
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for r in range(args.reps):
                for m in MODES if r % 2 == 0 else MODES[::-1]:
                    with mode(m):
                        t0 = clock()
                        step()
                        times[m].append(clock() - t0)
            med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
            base = med["aten"]
            same = all(torch.equal(a, b) for a, b in zip(outs["aten"], outs["native"]))
            diff = ", ".join(
                f"{(a - b).abs().max().item():.2g}" for a, b in zip(outs["native"], outs[MODES[2]])
            )
            cells = [f"{med['aten']:.1f}"] + [
                f"{med[m]:.1f} ({med[m] / base:.2f}x)" for m in MODES[1:]
            ]
            shape = ", ".join(map(str, SHAPES[shape_name]))
            print(
                f"| {recipe} | {shape} | {' | '.join(cells)} | {diff}"
                f"{'' if same else ' (native != aten!)'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
