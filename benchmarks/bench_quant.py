"""How fast are the FP8 / MXFP8 kernels? Quantize GB/s against copy bandwidth, and scaled
grouped GEMM TFLOP/s against bf16 ``torch._grouped_mm``, in one run.

    python benchmarks/bench_quant.py --device cuda [--out benchmarks/results/quant_h200_202611.md]

Shapes (balanced groups, every group a multiple of 128 rows):
- DeepSeek-V3-like: D=7168, F=2048, 32 local experts (256 / EP 8), top-8; M rows per GPU.
- Llama4-like: D=5120, F=8192, 16 experts, top-1.
For each, the two expert GEMMs (``x @ w13^T``: K=D, N=2F; ``h @ w2^T``: K=F, N=D) forward,
and the wgrad of the first. "kernel" times the scaled GEMM on operands quantized ahead;
"e2e" includes quantizing both operands (what ``scaled_grouped_mm`` does per call). For
rowwise and tensorwise on Hopper, ``torch._scaled_grouped_mm`` on the same operands
("torch._scaled_grouped_mm", and "torch e2e" with the quantization) is the path that
``scaled_grouped_mm`` takes for bf16 inputs; the Triton kernel rows are its peer.

Quantize kernels move bf16 in and FP8 + scales out; GB/s counts those bytes, against a
device-to-device copy of the same bf16 tensor (bytes read + written) measured in the run.

On CPU (no Triton compile) the script times the reference quantizers and the exact
emulation against an fp32 grouped GEMM on small shapes, so that it runs anywhere.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from torch_moe._triton import quantize as TQ
from torch_moe._triton import scaled_grouped_mm as TK
from torch_moe.quantization import RECIPES
from torch_moe.quantization import quantize as Q

S = importlib.import_module("torch_moe.quantization.scaled_grouped_mm")

SHAPES = {
    # name: (M rows, D, F, E)
    "dsv3": (32768, 7168, 2048, 32),
    "llama4": (16384, 5120, 8192, 16),
}
RECIPE_NAMES = ["fp8_blockwise", "mxfp8", "fp8_rowwise", "fp8_tensorwise"]


def bench_ms(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    import torch.utils.benchmark as tb

    return tb.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.5).median * 1e3


def balanced_offs(m: int, e: int, device: str) -> torch.Tensor:
    align = 128 if device == "cuda" else 16
    per = (m // e) // align * align
    return (torch.arange(1, e + 1, device=device) * per).to(torch.int32)


def quant_rows(x: torch.Tensor, offs: torch.Tensor, device: str) -> list[list[str]]:
    rows = []
    bytes_in = x.numel() * x.element_size()
    copy_ms = bench_ms(lambda: x.clone(), device)
    copy_gbs = 2 * bytes_in / copy_ms / 1e6
    rows.append(["copy (bf16 clone)", f"{copy_ms:.3f}", f"{copy_gbs:.0f}", "1.00"])
    m, n = x.shape
    cases: list[tuple[str, Callable[[], object], int]] = []
    if device == "cuda":
        out_t = torch.empty(n, m, dtype=torch.float8_e4m3fn, device=device).t()
        nb = TQ.jagged_block_table(offs, m, 128)[0].shape[0]
        slot = torch.empty(n, nb * 128, dtype=torch.float8_e4m3fn, device=device).t()
        cases = [
            ("fp8 1x128", lambda: TQ.quantize_blocks(x, (1, 128)), m * n // 128 * 4),
            ("fp8 rowwise", lambda: TQ.quantize_blocks(x, (1, -1)), m * 4),
            ("fp8 128x128", lambda: TQ.quantize_blocks(x, (128, 128)), m * n // 16384 * 4),
            ("mx 1x32", lambda: TQ.quantize_blocks(x, (1, 32), fmt="mx", scale_dtype=torch.uint8), m * n // 32),
            ("mx 32x1 (K-major out)", lambda: TQ.quantize_blocks(x, (32, 1), fmt="mx", scale_dtype=torch.uint8, out=out_t), m * n // 32),
            ("jagged fp8 128 (slots)", lambda: TQ.quantize_jagged(x, offs, block=128, out=slot, slots=True), nb * n * 4),
            ("jagged fp8 per group", lambda: TQ.quantize_jagged(x, offs, block=-1, out=out_t), offs.numel() * n * 4),
            ("reference 1x128 (torch ops)", lambda: Q.quantize_fp8_reference(x, (1, 128)), m * n // 128 * 4),
        ]  # fmt: skip
    else:
        cases = [
            (
                "reference fp8 1x128",
                lambda: Q.quantize_fp8_reference(x, (1, 128)),
                m * n // 128 * 4,
            ),
            ("reference mx 1x32", lambda: Q.quantize_mx_reference(x), m * n // 32),
        ]
    for name, fn, scale_bytes in cases:
        ms = bench_ms(fn, device)
        moved = bytes_in + m * n + scale_bytes
        gbs = moved / ms / 1e6
        rows.append([name, f"{ms:.3f}", f"{gbs:.3g}", f"{gbs / copy_gbs:.2f}"])
    return rows


def gemm_rows(shape: str, device: str, recipes: list[str]) -> list[list[str]]:
    m, d, f, e = SHAPES[shape]
    if device != "cuda":
        m, d, f, e = m // 64, d // 16, f // 16, e // 4
    torch.manual_seed(0)
    dt = torch.bfloat16
    offs = balanced_offs(m, e, device)
    rows: list[list[str]] = []

    def add(gemm: str, name: str, ms: float, flops: int, ref_ms: float) -> None:
        """One row: ms, TFLOP/s (flops / ms / 1e9) and the speedup over the peer ref_ms."""
        rows.append([shape, gemm, name, f"{ms:.3f}", f"{flops / ms / 1e9:.3g}",
                     f"{ref_ms / ms:.2f}"])  # fmt: skip

    for gemm, (k, n) in {"w13 fwd": (d, 2 * f), "w2 fwd": (f, d)}.items():
        x = torch.randn(m, k, device=device, dtype=dt)
        w = torch.randn(e, n, k, device=device, dtype=dt).transpose(-2, -1)  # [E, K, N] view
        flops = 2 * int(offs[-1]) * k * n
        if device == "cuda":
            ref_ms = bench_ms(lambda x=x, w=w: torch._grouped_mm(x, w, offs=offs), device)
            ref_name = "bf16 torch._grouped_mm"
        else:
            xf, wf = x.float(), w.float()
            from torch_moe.ops import grouped_mm

            ref_ms = bench_ms(lambda xf=xf, wf=wf: grouped_mm(xf, wf, offs), device)
            ref_name = "fp32 torch_moe grouped_mm"
        add(gemm, ref_name, ref_ms, flops, ref_ms)
        for name in recipes:
            g = RECIPES[name].forward
            if device == "cuda":
                qa = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=device)
                sa = S._quantize_kmajor(x, g.lhs, qa, along_rows=False).float()
                qb = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=device).transpose(1, 2)
                sb = S._quantize_kmajor(w, g.rhs, qb, along_rows=True).float()
                sb = sb.reshape(e, sb.shape[-2], sb.shape[-1])

                def kernel(qa=qa, qb=qb, sa=sa, sb=sb, g=g):
                    return TK.scaled_grouped_mm(
                        qa, qb, sa, sb, offs, block_k=g.lhs.inner, block_n=g.rhs.outer
                    )

                k_ms = bench_ms(kernel, device)
                add(gemm, f"{name} kernel", k_ms, flops, ref_ms)
                e2e = lambda g=g, x=x, w=w: S._kernel_gemm(x, w, offs, g, dt)  # noqa: E731
                if S._select(g, x, w, dt) == "torch":  # rowwise / tensorwise: torch's own op
                    ops = S.torch_scaled_operands(x, w, g)
                    t_ms = bench_ms(
                        lambda ops=ops: torch._scaled_grouped_mm(
                            *ops, offs=offs, out_dtype=torch.bfloat16
                        ),
                        device,
                    )
                    add(gemm, f"{name} torch._scaled_grouped_mm", t_ms, flops, ref_ms)
                    t_e2e = lambda g=g, x=x, w=w: S._torch_gemm(x, w, offs, g)  # noqa: E731
                    t_ms = bench_ms(t_e2e, device)
                    add(gemm, f"{name} torch e2e", t_ms, flops, ref_ms)
            else:
                e2e = lambda g=g, x=x, w=w: S._emulate_gemm(x, w, offs, g, x.dtype)  # noqa: E731
            e_ms = bench_ms(e2e, device)
            add(gemm, f"{name} e2e", e_ms, flops, ref_ms)
    if device == "cuda":  # wgrad of w13: dW [E, D, 2F] = x_g^T dy_g
        x = torch.randn(m, d, device=device, dtype=dt)
        dy = torch.randn(m, 2 * f, device=device, dtype=dt)
        flops = 2 * int(offs[-1]) * d * 2 * f
        ref_ms = bench_ms(lambda: torch._grouped_mm(x.t(), dy, offs=offs), device)
        add("w13 wgrad", "bf16 torch._grouped_mm", ref_ms, flops, ref_ms)
        for name in recipes:
            g = RECIPES[name].wgrad
            qx, qdy, sx, sdy, gfb, block = S.kernel_wgrad_operands(x, dy, offs, g)
            k_ms = bench_ms(
                lambda a=(qx, qdy, sx, sdy, offs, gfb, block): TK.scaled_grouped_mm_wgrad(
                    *a, out_dtype=dt
                ),
                device,
            )
            add("w13 wgrad", f"{name} kernel", k_ms, flops, ref_ms)
            e_ms = bench_ms(lambda g=g: S._kernel_wgrad(x, dy, offs, g, dt), device)
            add("w13 wgrad", f"{name} e2e", e_ms, flops, ref_ms)
    return rows


def tune_rows() -> list[list[str]]:
    """Sweep the launch configs of the FP8 kernels at the DeepSeek-V3-like w13 forward."""
    dev = "cuda"
    m, d, f, e = SHAPES["dsv3"]
    k, n = d, 2 * f
    offs = balanced_offs(m, e, dev)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16).transpose(-2, -1)
    flops = 2 * int(offs[-1]) * k * n
    rows = []
    sweeps = {
        "fp8_blockwise": [(128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 128, 8, 5),
                          (128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (64, 128, 128, 4, 4),
                          (64, 256, 128, 4, 3), (128, 64, 128, 4, 4)],
        "mxfp8": [(128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 128, 64, 8, 4),
                  (128, 256, 64, 8, 3), (64, 128, 64, 4, 3), (64, 256, 64, 8, 3)],
    }  # fmt: skip
    default = TK._fwd_config
    for name, cfgs in sweeps.items():
        g = RECIPES[name].forward
        qa = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=dev)
        sa = S._quantize_kmajor(x, g.lhs, qa, along_rows=False).float()
        qb = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=dev).transpose(1, 2)
        sb = S._quantize_kmajor(w, g.rhs, qb, along_rows=True).float()
        for c in cfgs:
            TK._fwd_config = lambda scale_k, interpret, c=c: TK._Config(*c)  # type: ignore[misc]
            try:
                ms = bench_ms(lambda g=g, sa=sa, sb=sb, qa=qa, qb=qb: TK.scaled_grouped_mm(
                    qa, qb, sa, sb, offs, block_k=g.lhs.inner, block_n=g.rhs.outer), dev)  # fmt: skip
                rows.append([name, str(c), f"{ms:.3f}", f"{flops / ms / 1e9:.0f}"])
            except Exception as exc:  # a config that does not fit (shared memory) is a row too
                rows.append([name, str(c), "failed", type(exc).__name__])
            finally:
                TK._fwd_config = default
    xq = torch.randn(65536, 7168, device=dev, dtype=torch.bfloat16)
    moved = xq.numel() * 3
    for budget, warps in [(2048, 4), (4096, 4), (8192, 4), (8192, 8), (16384, 8)]:
        TQ.BLOCKS_BUDGET, TQ.BLOCKS_WARPS = budget, warps
        ms = bench_ms(lambda: TQ.quantize_blocks(xq, (1, 128)), dev)
        rows.append(["quantize 1x128", f"budget {budget} warps {warps}", f"{ms:.3f}",
                     f"{moved / ms / 1e6:.0f} GB/s"])  # fmt: skip
    TQ.BLOCKS_BUDGET, TQ.BLOCKS_WARPS = 4096, 4
    offs_q = balanced_offs(65536, 32, dev)
    nb = TQ.jagged_block_table(offs_q, 65536, 128)[0].shape[0]
    slot = torch.empty(7168, nb * 128, dtype=torch.float8_e4m3fn, device=dev).t()
    for tile_n, warps in [(32, 4), (64, 4), (64, 8), (128, 8), (256, 8)]:
        TQ.JAGGED_TILE_N, TQ.JAGGED_WARPS = tile_n, warps
        ms = bench_ms(lambda: TQ.quantize_jagged(xq, offs_q, block=128, out=slot, slots=True), dev)
        rows.append(["quantize jagged 128 slots", f"tile_n {tile_n} warps {warps}", f"{ms:.3f}",
                     f"{moved / ms / 1e6:.0f} GB/s"])  # fmt: skip
    TQ.JAGGED_TILE_N, TQ.JAGGED_WARPS = 64, 4
    return rows


def tune_tile_rows() -> list[list[str]]:
    """Sweep the quantize kernel's tile shape and warps on a bf16 [65536, 7168] input."""
    dev = "cuda"
    xq = torch.randn(65536, 7168, device=dev, dtype=torch.bfloat16)
    rows = []
    copy_ms = bench_ms(lambda: xq.clone(), dev)
    rows.append(["copy", "-", f"{copy_ms:.3f}", "1.00"])
    cases = {
        (1, 128): [None, (32, 128), (16, 256), (8, 512), (4, 1024), (2, 2048), (1, 4096)],
        (1, 32): [None, (32, 128), (16, 256), (8, 512), (4, 1024), (1, 4096)],
        (128, 128): [None, (128, 256)],
    }
    for block, tiles in cases.items():
        kw = dict(fmt="mx", scale_dtype=torch.uint8) if block == (1, 32) else {}
        for tile in tiles:
            for warps in (4, 8):
                TQ.BLOCKS_TILES.clear()
                if tile is not None:
                    TQ.BLOCKS_TILES[block] = tile
                TQ.BLOCKS_WARPS = warps
                try:
                    ms = bench_ms(
                        lambda kw=kw, block=block: TQ.quantize_blocks(xq, block, **kw), dev
                    )
                    rows.append([f"{block}", f"tile {tile or 'budget'} warps {warps}",
                                 f"{ms:.3f}", f"{copy_ms * 0.75 / ms:.2f}"])  # fmt: skip
                except Exception as exc:
                    rows.append(
                        [f"{block}", f"tile {tile} warps {warps}", "failed", type(exc).__name__]
                    )
    TQ.BLOCKS_TILES.clear()
    TQ.BLOCKS_WARPS = 4
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--recipes", nargs="+", default=RECIPE_NAMES, choices=RECIPE_NAMES)
    p.add_argument("--quant-rows", type=int, default=65536, help="rows of the quantize input")
    p.add_argument("--out", type=Path, default=None, help="write the tables as markdown here")
    p.add_argument("--tune", action="store_true", help="also sweep kernel configs (cuda)")
    p.add_argument("--tune-tiles", action="store_true", help="only sweep quantize tiles (cuda)")
    args = p.parse_args(argv)
    dev = args.device
    import triton

    if args.tune_tiles:
        out = table(["block", "config", "ms", "x copy (bytes in+out)"], tune_tile_rows())
        print(out)
        if args.out is not None:
            args.out.write_text(out + "\n")
        return out

    env = f"torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}"
    if dev == "cuda":
        env += f", {torch.cuda.get_device_name()}"
    m = args.quant_rows if dev == "cuda" else 2048
    n = 7168 if dev == "cuda" else 1024
    x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    q_rows = quant_rows(x, balanced_offs(m, 32, dev), dev)
    del x
    g_rows = []
    for shape in args.shapes:
        g_rows += gemm_rows(shape, dev, args.recipes)
    out = "\n\n".join([
        f"`python benchmarks/bench_quant.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        env,
        f"Quantize, bf16 [{m}, {n}] in (GB/s = bytes in + out / time; ratio to the copy):",
        table(["kernel", "ms", "GB/s", "x copy"], q_rows),
        "Grouped GEMMs (TFLOP/s over the rows in groups; ratio = reference time / time):",
        table(["shape", "gemm", "impl", "ms", "TFLOP/s", "speedup"], g_rows),
    ])  # fmt: skip
    if args.tune and dev == "cuda":
        out += "\n\nConfig sweep (dsv3 w13 forward; quantize bf16 [65536, 7168]):\n\n"
        out += table(["kernel", "config", "ms", "rate"], tune_rows())
    if args.out is not None:
        args.out.write_text(out + "\n")
    print(out)
    return out


if __name__ == "__main__":
    main()
