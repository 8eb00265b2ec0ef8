"""How fast are torch_moe's core ops next to their floors and plain-torch peers?

Times routing, permute, unpermute, grouped_mm and grouped_swiglu (forward + backward)
in one process, interleaved round by round (median of ``--reps`` rounds), and prints:

* the floor of each op, measured in the same run: bytes moved over the measured copy
  bandwidth for data movement, FLOPs over the measured large-GEMM rate for GEMMs. Two
  GEMM floors are printed: the rate of a large ``torch.mm`` in the benchmark dtype (the
  definition of docs/design.md §8), and the fp32 rate (the hardware limit of a CPU without
  native bf16, where torch_moe upcasts, see torch_moe/_ops/grouped_mm.py);
* a plain-torch peer: ``torch._grouped_mm`` with autograd, ``index_select`` /
  ``index_add_`` dispatch and combine, softmax + topk routing;
* peak memory of grouped_swiglu forward + backward above the inputs and weights (from
  the process's peak RSS, reset through /proc/self/clear_refs), next to the budget of
  gradients + output + the saved pre-activation, and next to the peer.

    python benchmarks/bench_ops.py                      # the issue's shapes, bf16
    python benchmarks/bench_ops.py --m 1024 --reps 3    # quicker
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

import torch_moe  # noqa: F401
from torch_moe import ops
from torch_moe.nn.functional import grouped_swiglu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def interleaved(
    fns: dict[str, Callable[[], object]], reps: int, warmup: bool = True
) -> dict[str, float]:
    """Median seconds per call, running each candidate once per round."""
    for fn in fns.values() if warmup else ():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def gemm_rate(dtype: torch.dtype, n: int, reps: int) -> float:
    """FLOP/s of a large square mm, the fastest operand layout (A @ B^T)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype).t()
    sec = interleaved({"mm": lambda: torch.mm(a, b)}, reps)["mm"]
    return 2 * n**3 / sec


def copy_bandwidth(reps: int) -> float:
    """Bytes/s of a large copy (read + write)."""
    src = torch.empty(64 * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    sec = interleaved({"copy": lambda: dst.copy_(src)}, reps)["copy"]
    return 2 * src.numel() / sec


def _rss(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_extra_bytes(fn: Callable[[], object]) -> int | None:
    """Peak resident bytes above the current RSS while ``fn`` runs (Linux only)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return None
    base = _rss("VmRSS")
    fn()
    peak = _rss("VmHWM")
    return None if base is None or peak is None else peak - base


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--m", type=int, default=4096, help="permuted rows M (= T*K)")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1792)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-peer-swiglu", action="store_true", help="skip the slow bf16 peer")
    p.add_argument(
        "--peer-reps",
        type=int,
        default=1,
        help="timed calls of the torch._grouped_mm peers, no warm-up (in bf16 their backward "
        "takes oneDNN's slow row-major x row-major path on CPUs without native bf16)",
    )
    p.add_argument("--measure-peak", choices=["ours", "peer"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure_peak:
        measure_peak(args)
        return
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    m, d, f, e, k = args.m, args.dim, args.hidden, args.experts, args.top_k
    t = m // k

    rate = gemm_rate(dtype, 2048 if dtype != torch.float32 else 4096, 3)
    rate32 = gemm_rate(torch.float32, 4096, 3)
    bw = copy_bandwidth(args.reps)
    esize = torch.empty((), dtype=dtype).element_size()
    print(
        f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, threads={torch.get_num_threads()}"
    )
    print(
        f"# large mm: {rate / 1e9:.1f} GFLOP/s in {args.dtype}, {rate32 / 1e9:.1f} GFLOP/s in fp32; copy: {bw / 1e9:.2f} GB/s"
    )
    print(f"# M={m} (T={t}, K={k}), D={d}, F={f}, E={e}, {args.dtype}, median of {args.reps}\n")

    rows: list[tuple[str, float, float | None, str, float | None]] = []

    # ---------------- routing (fp32 logits [T, E]) ----------------
    logits = torch.randn(t, e, requires_grad=True)
    g_w = torch.randn(t, k)

    def route_ours():
        w, _, _ = ops.topk_route(logits, k, route_norm=True)
        w.backward(g_w)

    def route_peer():
        probs = torch.softmax(logits, -1)
        w, ids = probs.topk(k, -1)
        w = w / w.sum(-1, keepdim=True)
        torch.bincount(ids.flatten(), minlength=e)
        w.backward(g_w)

    r = interleaved({"ours": route_ours, "peer": route_peer}, args.reps)
    route_bytes = 2 * (t * e * 4 + t * k * (4 + 8))  # fwd + bwd
    rows.append(("topk_route fwd+bwd", r["ours"], route_bytes / bw, "softmax+topk", r["peer"]))

    # ---------------- permute / unpermute ----------------
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    x_tok = torch.randn(t, d, dtype=dtype, requires_grad=True)
    weights = torch.rand(t, k, requires_grad=True)
    perm = ops.permute_indices(ids, e)
    y_perm = torch.randn(m, d, dtype=dtype, requires_grad=True)
    g_perm = torch.randn(m, d, dtype=dtype)
    g_tok = torch.randn(t, d, dtype=dtype)
    tok_of_row = perm.row_to_slot // k
    w_of_row = weights.detach().flatten()[perm.row_to_slot]

    def permute_ours():
        x_perm, _ = ops.permute(x_tok, ids, e)
        x_perm.backward(g_perm)

    def permute_peer():  # index_select forward, index_add backward (autograd)
        order = torch.argsort(ids.flatten(), stable=True)
        x_tok.index_select(0, order // k).backward(g_perm)

    def unpermute_ours():
        ops.unpermute(y_perm, weights, perm).backward(g_tok)

    def unpermute_peer():  # scale rows then index_add into tokens (autograd)
        out = torch.zeros(t, d, dtype=dtype)
        out = out.index_add(0, tok_of_row, y_perm * w_of_row.to(dtype).unsqueeze(1))
        out.backward(g_tok)

    r = interleaved(
        {"p": permute_ours, "pp": permute_peer, "u": unpermute_ours, "up": unpermute_peer},
        args.reps,
    )
    move = 2 * m * d * esize  # read + write the [M, D] buffer once
    rows.append(("permute fwd+bwd", r["p"], 2 * move / bw, "index_select", r["pp"]))
    rows.append(("unpermute fwd+bwd", r["u"], 2 * move / bw, "index_add", r["up"]))
    perm_time = r["p"] + r["u"]

    # ---------------- grouped_mm ----------------
    offs = (torch.arange(1, e + 1) * (m // e)).to(torch.int32)
    x = torch.randn(m, d, dtype=dtype, requires_grad=True)
    w = (torch.randn(e, f, d, dtype=dtype) * 0.02).requires_grad_()
    g_mm = torch.randn(m, f, dtype=dtype)

    def gmm_ours():
        ops.grouped_mm(x, w.transpose(-2, -1), offs).backward(g_mm)

    def gmm_peer():
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs).backward(g_mm)

    r = interleaved({"ours": gmm_ours}, args.reps)
    r.update(interleaved({"peer": gmm_peer}, args.peer_reps, warmup=False))
    gmm_flops = 6 * m * d * f
    rows.append(("grouped_mm fwd+bwd", r["ours"], gmm_flops / rate, "torch._grouped_mm", r["peer"]))
    rows_fp32 = {"grouped_mm fwd+bwd": gmm_flops / rate32}

    # ---------------- grouped_swiglu ----------------
    w13 = (torch.randn(e, 2 * f, d, dtype=dtype) * 0.02).requires_grad_()
    w2 = (torch.randn(e, d, f, dtype=dtype) * 0.02).requires_grad_()
    g_y = torch.randn(m, d, dtype=dtype)

    def swiglu_ours():
        grouped_swiglu(x, w13, w2, offs).backward(g_y)

    def swiglu_peer():  # the composition users write with torch._grouped_mm
        h = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
        torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs).backward(g_y)

    r = interleaved({"ours": swiglu_ours}, args.reps)
    if not args.skip_peer_swiglu:
        r.update(interleaved({"peer": swiglu_peer}, args.peer_reps, warmup=False))
    sw_flops = 18 * m * d * f
    rows.append(
        ("grouped_swiglu fwd+bwd", r["ours"], sw_flops / rate, "_grouped_mm+silu", r.get("peer"))
    )
    rows_fp32["grouped_swiglu fwd+bwd"] = sw_flops / rate32

    # ---------------- table ----------------
    print("| op | torch_moe ms | floor ms | x floor | x fp32 floor | peer | peer ms | peer/ours |")
    print("|---|---|---|---|---|---|---|---|")
    for name, ours, floor, peer_name, peer in rows:
        fp32 = rows_fp32.get(name)
        print(
            f"| {name} | {ours * 1e3:.1f} | {floor * 1e3:.2f} | {ours / floor:.2f} | "
            f"{f'{ours / fp32:.2f}' if fp32 else '-'} | {peer_name} | "
            f"{f'{peer * 1e3:.1f}' if peer else '-'} | {f'{peer / ours:.2f}' if peer else '-'} |"
        )
    print(
        f"\npermute + unpermute (fwd+bwd) / grouped_swiglu (fwd+bwd): {perm_time / rows[-1][1]:.3f}"
    )

    # ---------------- memory (each candidate in a fresh process) ----------------
    mib = 2**20
    grads = (x.numel() + w13.numel() + w2.numel()) * esize
    saved_h = m * 2 * f * esize
    out_y = m * d * esize
    budget = grads + saved_h + out_y
    peaks = {}
    for who in ["ours"] + ([] if args.skip_peer_swiglu else ["peer"]):
        cmd = [sys.executable, __file__, "--measure-peak", who, "--m", str(m), "--dim", str(d)]
        cmd += ["--hidden", str(f), "--experts", str(e), "--dtype", args.dtype]
        # mmap every block >= 64 KiB so that a free returns it and RSS tracks live tensors
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        out = subprocess.run(
            cmd, capture_output=True, text=True, check=True, env=env
        ).stdout.split()
        peaks[who] = f"{int(out[-1]) / mib:.1f} MiB" if out and out[-1] != "None" else "n/a"
    print(
        f"\ngrouped_swiglu fwd+bwd peak RSS above inputs+weights: ours {peaks['ours']}, "
        f"peer {peaks.get('peer', '-')}; budget (gradients {grads / mib:.1f} + saved h "
        f"{saved_h / mib:.1f} + output {out_y / mib:.1f}) = {budget / mib:.1f} MiB"
    )


def measure_peak(args: argparse.Namespace) -> None:
    """Child process: peak RSS of one grouped_swiglu fwd+bwd above its inputs and weights."""
    dtype = DTYPES[args.dtype]
    m, d, f, e = args.m, args.dim, args.hidden, args.experts
    offs = (torch.arange(1, e + 1) * (m // e)).to(torch.int32)
    x = torch.randn(m, d, dtype=dtype, requires_grad=True)
    w13 = (torch.randn(e, 2 * f, d, dtype=dtype) * 0.02).requires_grad_()
    w2 = (torch.randn(e, d, f, dtype=dtype) * 0.02).requires_grad_()
    g_y = torch.randn(m, d, dtype=dtype)

    def run():
        if args.measure_peak == "ours":
            grouped_swiglu(x, w13, w2, offs).backward(g_y)
        else:
            h = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
            gate, up = h.chunk(2, dim=-1)
            a = torch.nn.functional.silu(gate) * up
            torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs).backward(g_y)

    run()  # warm up: library buffers and lazy initialisation are not the op's memory
    for t in (x, w13, w2):
        t.grad = None
    print(peak_extra_bytes(run))


if __name__ == "__main__":
    main()
