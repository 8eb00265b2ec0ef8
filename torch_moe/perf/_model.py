"""``predict()``: time, breakdown and memory of one MoE layer step on the busiest rank.

Legend: T tokens of the rank, D dim, F hidden dim, Fs shared hidden dim, E experts,
K top-k, R EP ranks, El local experts, M permuted rows of the rank (T*K dropless), N rows
its local experts receive (the busiest rank's), b bytes per element of the layer dtype,
m_g rows of expert group g.

Design. The step is a list of operations, each with FLOPs, bytes and seconds, that follows
what the library runs (``torch_moe.nn.MoE`` and ``ExpertParallel``):

    router:    x -> fp32, logits = x W_r^T (fp32 GEMM [T, D] x [D, E]), top-k route
    permute:   sort the T*K assignments by expert, gather M rows (+ alignment padding)
    [EP]       counts all-to-all, dispatch N rows (p2p: R*El segments per direction;
               all_to_all: one collective and two row reorders; hierarchical: two stages)
    experts:   per group g: h = x_g W13_g^T, a = silu(h_gate) * h_up * w_row,
               y_g = a W2_g^T (bf16: ``grouped_swiglu``; recipes: quantize both operands of
               every GEMM, then the scaled GEMM; on a CPU the exact emulation: quantize ->
               dequantize -> fp32 GEMM -> cast, or its native pieces: ``e4m3`` tables)
    [EP]       combine N rows back
    unpermute: the fp32 weighted sum of K rows per token; + shared expert (dense SwiGLU)
    backward:  the same in reverse, each GEMM twice (dgrad, wgrad): 3x the forward FLOPs

Costs (each op's seconds):

* GEMMs: a CPU runs one ``mm`` per expert group: the sum over groups of the measured
  (m_g, k, n) table of :class:`~torch_moe.perf.Hardware` (an expert that gets no row
  runs nothing: with ``lam_g`` expected rows, it runs with probability ``1 - exp(-lam_g)``
  on ``lam_g / (1 - exp(-lam_g))`` rows); a GPU runs one grouped kernel: its rows
  padded to the tile per group, at the measured or datasheet rate, or its operand bytes
  over the memory bandwidth, whichever is slower (roofline). The bf16 experts of a
  training step on a CPU use the measured grouped-SwiGLU op table instead (the same sum
  over groups), split over the GEMM and activation components in the proportions of the
  per-GEMM model above.
* Elementwise ops (casts, routing, sort, permute, unpermute, activation, quantize): the
  measured kernel tables of the CPU per call, or bytes over bandwidth on a GPU.
* Overheads: the measured fixed and per-group host cost (CPU), kernel launches (GPU).
* Communication: alpha-beta per link, ``messages * alpha + bytes / beta``, the busiest
  receiver's bytes; intra- and inter-node links run concurrently.
* EP host work (CPU process groups): the measured ``Link.exchange_overhead``, the seconds
  an EP layer step spends beyond alpha-beta in the exchange ops' Python, dispatcher,
  autograd and DTensor work and in the ranks' wait at every exchange, linear in the local
  experts and in the chunks (``ep_host``; not overlapped).
* Overlap: with ``num_chunks = C > 1`` the forward exchange overlaps the experts:
  ``(dispatch + combine) / C + max(experts, comm') + f * min(experts, comm')`` with
  ``comm'`` the remaining (C - 1) / C of the exchanges and ``f`` the hardware's
  ``comm_compute_share`` (1 on a CPU with gloo: no gain; ExpertParallel's backward
  exchanges are synchronous, so the backward never overlaps).
* Load imbalance: the busiest rank's rows (``MoEWorkload.rank_rows``) set the experts'
  time; the ``imbalance`` entry is its excess over a rank with the mean rows.
* Oversubscribed CPU hosts (more ranks x threads than cores): times scale by the ratio.

Memory (bytes per rank, :mod:`torch_moe.perf._memory`): weights, gradients, Adam states,
the activations saved for the backward (the layer's documented formula), communication
buffers, and the peak of one forward + backward. With EP the peak is the largest of the
busiest, the mean and a light rank's (each rank's CPU kernels decide on its own rows, and
the lighter ranks can take a path with larger buffers: ``_peak_over_ranks``); the other
entries are the busiest rank's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from torch_moe.perf._hardware import Hardware, Link
from torch_moe.perf._workload import MoEWorkload, recipe_operands

__all__ = ["Prediction", "predict"]

_ACT_CHUNK = 2**17  # elements per chunk of the CPU SwiGLU backward (grouped_swiglu.py)


@dataclass
class Op:
    component: str
    seconds: float
    flops: float = 0.0
    bytes: float = 0.0
    phase: str = "fwd"


@dataclass
class Prediction:
    """What :func:`predict` returns.

    Attributes:
        time: seconds of one step (forward, + backward when the workload has it) on the
            busiest rank.
        breakdown: seconds per component (they sum to ``time``; ``overlap`` is negative,
            the time the chunked exchange hides).
        flops, bytes: per component (bytes: memory traffic; for ``dispatch`` / ``combine``
            the bytes a rank sends over links).
        memory: bytes per rank: ``weights``, ``grads``, ``optimizer``, ``activations``
            (saved for the backward), ``comm_buffers``, ``weight_cache`` (inference with a
            recipe: the expert weights' codes and scales, quantized once per version),
            ``peak`` (one forward + backward, or the forward alone: weights, gradients and
            that cache included, optimizer states excluded) and ``peak_step`` (+ optimizer
            states).
        details: routing and sizing figures (rows per rank, imbalance, distinct
            ranks / nodes per token, padding rows, ...).
        workload, hardware: the inputs.
    """

    time: float
    breakdown: dict[str, float]
    flops: dict[str, float]
    bytes: dict[str, float]
    memory: dict[str, float]
    details: dict[str, float]
    workload: MoEWorkload
    hardware: Hardware
    ops: list[Op] = field(default_factory=list, repr=False)

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    def table(self) -> str:
        """The breakdown as a markdown table (seconds, share, FLOPs, bytes)."""
        rows = ["| component | ms | share | GFLOP | MB |", "|---|---|---|---|---|"]
        for name, sec in self.breakdown.items():
            rows.append(
                f"| {name} | {sec * 1e3:.3f} | {sec / self.time:.1%} | "
                f"{self.flops.get(name, 0.0) / 1e9:.3g} | {self.bytes.get(name, 0.0) / 1e6:.4g} |"
            )
        rows.append(
            f"| **total** | **{self.time * 1e3:.3f}** | 100% | "
            f"{self.total_flops / 1e9:.3g} | {sum(self.bytes.values()) / 1e6:.4g} |"
        )
        return "\n".join(rows)

    def memory_table(self) -> str:
        rows = ["| memory | MiB |", "|---|---|"]
        for name, v in self.memory.items():
            rows.append(f"| {name} | {v / 2**20:.1f} |")
        return "\n".join(rows)


# --------------------------------------------------------------------------------------
# the cost context


# bytes per element of each elementwise kernel (b: the layer dtype's size); the passes the
# library's implementation makes (used for the byte counts, and for the time on a GPU)
def _kernel_bytes(name: str, b: int) -> float:
    table = {
        "cast.bf16_fp32": 2 + 4,
        "cast.fp32_bf16": 4 + 2,
        "add": 3 * b,
        "copy": 1,
        "route.fwd": 4 * 6,
        "route.bwd": 4 * 4,
        "sort": 8 * 8,
        "permute.fwd": 2 * b,
        "permute.bwd": 3 * b + 16,
        "unpermute.fwd": 3 * b + 16,
        "unpermute.bwd": 2 * b,
        "act.fwd": 3 * b + 40,
        "act.bwd": 2 * b + 4 * b + 144,
        "dense_act.fwd": 3 * b + 8,
        "dense_act.bwd": 5 * b + 16,
    }
    if name in table:
        return float(table[name])
    if name.startswith(("q.", "qj.")):
        return b + 1.0  # high-precision in, e4m3 out (+ a scale per block: ignored)
    raise KeyError(name)


class _Ctx:
    def __init__(self, w: MoEWorkload, hw: Hardware, ranks_on_host: int | None = None) -> None:
        self.w, self.hw = w, hw
        self.cpu = hw.kind == "cpu"
        host = ranks_on_host if ranks_on_host is not None else w.ranks_per_node
        self.host = host
        self.intra = hw.link(False, host)
        self.inter = hw.link(True)
        ranks_on_host = host if self.cpu else 1
        self.threads = hw.threads_for(ranks_on_host) if self.cpu else 1
        self.slow = hw.oversubscription(ranks_on_host) if self.cpu else 1.0
        self.ops: list[Op] = []
        self.b = w.element_size
        self.key = "fp32" if w.dtype == torch.float32 else "bf16"

    def add(self, component: str, seconds: float, flops: float, nbytes: float, phase: str) -> None:
        self.ops.append(Op(component, seconds * self.slow, flops, nbytes, phase))

    # ----------------------------------------------------------------------------------

    def gemm(
        self,
        component: str,
        key: str,
        layout: str,
        groups: list[float],
        k: int,
        n: int,
        phase: str,
        *,
        weight_bytes: float = 0.0,
    ) -> None:
        """One grouped GEMM: group g has groups[g] expected rows (m for NT / NN, the
        reduction dim for TN); output [rows, n] (NT, NN) or [k, n] per group (TN)."""
        rows = sum(groups)
        flops = 2.0 * rows * k * n
        nbytes = rows * (k + n) * self.b + weight_bytes  # activation operands + weights
        if self.cpu:
            table = self.hw.gemm_table(self.threads, key, layout)
            if table is None:
                raise ValueError(
                    f"predict: hardware {self.hw.name!r} has no GEMM table for {self.threads} "
                    f"thread(s), {key}, {layout}; calibrate with threads including {self.threads}"
                )
            sec = 0.0
            for lam in groups:
                p = 1.0 - math.exp(-lam) if lam < 30 else 1.0
                if p <= 0:
                    continue
                m = lam / p
                sec += p * (
                    table.increment(k, m, n) if layout == "TN" else table.increment(m, k, n)
                )
        else:
            tile = self.hw.tile_m
            padded = sum(math.ceil(g / tile) * tile for g in groups if g > 0)
            rate = self.hw.rate(key)
            sec = max(2.0 * padded * k * n / rate, nbytes / self.hw.mem_bandwidth)
            sec += self.hw.launch_overhead
        self.add(component, sec, flops, nbytes, phase)

    def kernel(
        self, component: str, name: str, elements: float, phase: str, calls: float = 1.0
    ) -> None:
        """``calls`` calls of an elementwise kernel on ``elements / calls`` elements each."""
        if elements <= 0 or calls <= 0:
            return
        nbytes = elements * _kernel_bytes(name, self.b)
        if self.cpu:
            table = self.hw.kernel_table(self.threads, name)
            if table is None:
                raise ValueError(
                    f"predict: hardware {self.hw.name!r} has no kernel table {name!r} for "
                    f"{self.threads} thread(s)"
                )
            sec = calls * table.increment(elements / calls)
        else:
            rate = self.hw.kernel_rates.get(name, self.hw.mem_bandwidth)
            sec = nbytes / rate + self.hw.launch_overhead * calls
        self.add(component, sec, 0.0, nbytes, phase)

    def per_group_kernel(
        self, component: str, name: str, groups: list[float], width: int, phase: str, chunk: int
    ) -> None:
        """An elementwise kernel run per expert group (and per row chunk of a group)."""
        if not self.cpu:
            self.kernel(component, name, sum(groups) * width, phase)
            return
        table = self.hw.kernel_table(self.threads, name)
        if table is None:
            raise ValueError(f"predict: hardware {self.hw.name!r} has no kernel table {name!r}")
        rows_per_chunk = max(1, chunk // max(1, width)) if chunk else 0
        sec = 0.0
        for lam in groups:
            p = 1.0 - math.exp(-lam) if lam < 30 else 1.0
            if p <= 0:
                continue
            m = lam / p
            if rows_per_chunk and m > rows_per_chunk:
                full = int(m // rows_per_chunk)
                rest = m - full * rows_per_chunk
                sec += p * (
                    full * table.increment(rows_per_chunk * width) + table.increment(rest * width)
                )
                sec += p * full * table.seconds[0]  # each extra call's own fixed cost
            else:
                sec += p * table.increment(m * width)
        nbytes = sum(groups) * width * _kernel_bytes(name, self.b)
        self.add(component, sec, 0.0, nbytes, phase)

    def comm(
        self,
        component: str,
        link: Link,
        nbytes: float,
        messages: float,
        collectives: float,
        phase: str,
    ) -> float:
        sec = link.time(nbytes, messages) + collectives * link.collective_latency
        self.ops.append(Op(component, sec, 0.0, nbytes, phase))
        return sec


# --------------------------------------------------------------------------------------
# the layer's parts


def _router(c: _Ctx, phase_bwd: bool) -> None:
    w = c.w
    T, D, E = w.tokens, w.dim, w.num_experts
    if w.dtype != torch.float32:
        c.kernel("router", "cast.bf16_fp32", T * D + E * D, "fwd", calls=2)
    c.gemm("router", "fp32", "NT", [T], D, E, "fwd", weight_bytes=E * D * 4)
    c.kernel("router", "route.fwd", T * E, "fwd")
    if not phase_bwd:
        return
    c.kernel("router", "route.bwd", T * E, "bwd")
    if w.dtype != torch.float32:
        c.kernel("router", "cast.bf16_fp32", T * D + E * D, "bwd", calls=2)
        c.kernel("router", "cast.fp32_bf16", T * D + E * D, "bwd", calls=2)
    c.gemm("router", "fp32", "NN", [T], E, D, "bwd", weight_bytes=E * D * 4)
    c.gemm("router", "fp32", "TN", [T], E, D, "bwd")  # dW_r = grad^T x: (E, T, D)


def _permute(c: _Ctx, rows: float, phase_bwd: bool) -> None:
    w = c.w
    T, K, D = w.tokens, w.top_k, w.dim
    c.kernel("permute", "sort", T * K, "fwd")
    c.kernel("permute", "permute.fwd", rows * D, "fwd")
    c.kernel("unpermute", "unpermute.fwd", T * K * D, "fwd")
    if phase_bwd:
        c.kernel("permute", "permute.bwd", T * K * D, "bwd")
        c.kernel("unpermute", "unpermute.bwd", rows * D, "bwd")


def _experts_bf16(c: _Ctx, comp: str, groups: list[float], phase_bwd: bool) -> None:
    """bf16 experts. On a CPU with the measured grouped-SwiGLU table: the op's measured
    seconds per group, split over the components in the proportions the per-GEMM model
    gives them (the total is the measurement); otherwise the per-GEMM model itself."""
    table = None
    if c.cpu and c.key == "bf16":
        mode = "fwdbwd" if phase_bwd else "fwd"
        table = c.hw.gemm_table(c.threads, "bf16", f"swiglu.{mode}")
    if table is None:
        _experts_bf16_parts(c, comp, groups, phase_bwd)
        return
    parts = _Ctx(c.w, c.hw, c.host)
    _experts_bf16_parts(parts, comp, groups, phase_bwd)
    w = c.w
    sec = 0.0
    for lam in groups:
        p = 1.0 - math.exp(-lam) if lam < 30 else 1.0
        if p > 0:
            sec += p * table.increment(lam / p, w.dim, w.hidden_dim)
    total = sum(o.seconds for o in parts.ops) or 1.0
    for o in parts.ops:
        c.ops.append(Op(o.component, sec * c.slow * o.seconds / total, o.flops, o.bytes, o.phase))


def _experts_bf16_parts(c: _Ctx, comp: str, groups: list[float], phase_bwd: bool) -> None:
    w = c.w
    D, F = w.dim, w.hidden_dim
    El = len(groups)
    b = c.b
    key = c.key
    w13, w2 = El * 2 * F * D * b, El * D * F * b
    c.gemm(f"{comp}.fwd", key, "NT", groups, D, 2 * F, "fwd", weight_bytes=w13)
    c.per_group_kernel(f"{comp}.act", "act.fwd", groups, F, "fwd", 0)
    c.gemm(f"{comp}.fwd", key, "NT", groups, F, D, "fwd", weight_bytes=w2)
    if not phase_bwd:
        return
    c.gemm(f"{comp}.dgrad", key, "NN", groups, D, F, "bwd", weight_bytes=w2)
    c.per_group_kernel(f"{comp}.act", "act.bwd", groups, F, "bwd", _ACT_CHUNK if c.cpu else 0)
    c.gemm(f"{comp}.wgrad", key, "TN", groups, D, F, "bwd")
    if c.cpu:  # the gate and up halves of dX and dW13 separately, dX summed and copied
        c.gemm(f"{comp}.dgrad", key, "NN", groups, F, D, "bwd", weight_bytes=w13 / 2)
        c.gemm(f"{comp}.dgrad", key, "NN", groups, F, D, "bwd", weight_bytes=w13 / 2)
        c.per_group_kernel(f"{comp}.act", "add", groups, D, "bwd", 0)
        c.gemm(f"{comp}.wgrad", key, "TN", groups, F, D, "bwd")
        c.gemm(f"{comp}.wgrad", key, "TN", groups, F, D, "bwd")
    else:
        c.gemm(f"{comp}.dgrad", key, "NN", groups, 2 * F, D, "bwd", weight_bytes=w13)
        c.gemm(f"{comp}.wgrad", key, "TN", groups, 2 * F, D, "bwd")


def _experts_recipe(c: _Ctx, comp: str, groups: list[float], phase_bwd: bool) -> None:
    """A recipe: quantize both operands of each GEMM, then the scaled GEMM (GPU), or the
    emulation quantize -> dequantize -> fp32 GEMM -> cast (CPU); MX operands of a bf16
    layer on a CPU with native bf16 GEMMs: dequantize -> cast -> bf16 GEMM
    (``scaled_grouped_mm._mx_in_bf16``; each piece dequantized in the GEMM's kernel where
    ``_mx_pieces`` holds); FP8 recipes there: the bf16 GEMM on the codes
    (each piece converted to bf16 in cache as it is multiplied, a share of the GEMM's
    time) scaling each k block's sums (``scaled_grouped_mm._blocks_in_bf16``, and
    ``_codes_in_bf16`` with the scales repeated per block). Inference takes the expert
    weights' codes from the layer's cache (quantized once per version of the weights, an
    expert-parallel layer's chunks too): its GEMMs quantize only A."""
    w = c.w
    D, F = w.dim, w.hidden_dim
    El = len(groups)
    M = sum(groups)
    kinds = recipe_operands(w.precision)
    gkey = "fp32" if c.cpu else None
    from torch_moe.perf._memory import (
        _codes_bf16_here,
        _dequantizes_pieces,
        _mx_in_bf16_here,
        _mx_pieces_here,
    )

    mx_bf16 = c.cpu and c.key == "bf16" and w.precision.startswith("mx") and _mx_in_bf16_here()
    codes = c.cpu and c.key == "bf16" and _codes_bf16_here(w.precision, c.b)
    # the fp32 form by the native kernels' pieces: priced by their own tables (each piece
    # dequantized, multiplied and rounded on its thread: no cast of the output)
    pieces = (
        c.cpu
        and not (mx_bf16 or codes)
        and c.hw.gemm_table(c.threads, "e4m3", "NT") is not None
        and _dequantizes_pieces(w, groups, c.threads)
    )

    def quantizer(kind: str) -> str:
        """The CPU's quantize table: quantize + dequantize (the emulation's fp32 form
        dequantizes the codes apart), or, where the scaled GEMM's pieces dequantize them
        and the quantizer was measured alone, that."""
        if pieces and c.hw.kernel_table(c.threads, f"{kind}:alone") is not None:
            return f"{kind}:alone"
        return kind

    def gemm(
        gemm_name: str,
        layout: str,
        k: int,
        n: int,
        lhs_elems: float,
        rhs_elems: float,
        out_elems: float,
        phase: str,
    ) -> None:
        lq, rq = (quantizer(q) for q in kinds[gemm_name])
        c.kernel(f"{comp}.quantize", lq, lhs_elems, phase)
        if phase_bwd:  # (inference: the layer quantizes each weight once per version)
            c.kernel(f"{comp}.quantize", rq, rhs_elems, phase)
        key = "bf16" if mx_bf16 or codes else gkey or f"{w.precision}:{gemm_name}"
        if pieces:
            key = "e4m3"
            layout = "NT" if gemm_name == "forward" else layout  # its weight's codes K-major
        c.gemm(
            f"{comp}.{'fwd' if gemm_name == 'forward' else gemm_name}",
            key,
            layout,
            groups,
            k,
            n,
            phase,
            weight_bytes=0.0 if gemm_name == "wgrad" else rhs_elems,
        )
        if mx_bf16:  # the output bf16 already; the dequantized operands cast, unless each
            # piece is dequantized in the GEMM's kernel
            if not _mx_pieces_here(El, M, k, n, gemm_name == "wgrad"):
                c.kernel(f"{comp}.quantize", "cast.fp32_bf16", lhs_elems + rhs_elems, phase)
        elif c.cpu and not codes and not pieces:  # (codes, pieces: in the GEMM's kernel)
            c.kernel(f"{comp}.quantize", "cast.fp32_bf16", out_elems, phase)

    fwd_layout = "NN" if c.cpu else "NT"  # the emulation's chunks dequantize W^T contiguous
    gemm("forward", fwd_layout, D, 2 * F, M * D, El * D * 2 * F, M * 2 * F, "fwd")
    c.kernel(f"{comp}.act", "act.fwd", M * F, "fwd")
    gemm("forward", fwd_layout, F, D, M * F, El * F * D, M * D, "fwd")
    if not phase_bwd:
        return
    gemm("dgrad", "NN", D, F, M * D, El * D * F, M * F, "bwd")
    c.kernel(f"{comp}.act", "act.bwd", M * F, "bwd")
    gemm("wgrad", "TN", F, D, M * F, M * D, El * F * D, "bwd")
    gemm("dgrad", "NN", 2 * F, D, M * 2 * F, El * 2 * F * D, M * D, "bwd")
    gemm("wgrad", "TN", D, 2 * F, M * D, M * 2 * F, El * D * 2 * F, "bwd")


def _shared(c: _Ctx, phase_bwd: bool) -> None:
    w = c.w
    T, D, Fs = w.tokens, w.dim, w.shared_hidden_dim
    if Fs == 0:
        return
    key, b = c.key, c.b
    c.gemm("shared", key, "NT", [T], D, 2 * Fs, "fwd", weight_bytes=2 * Fs * D * b)
    c.kernel("shared", "dense_act.fwd", T * Fs, "fwd")
    c.gemm("shared", key, "NT", [T], Fs, D, "fwd", weight_bytes=Fs * D * b)
    c.kernel("shared", "add", T * D, "fwd")
    if not phase_bwd:
        return
    c.gemm("shared", key, "NN", [T], D, Fs, "bwd", weight_bytes=Fs * D * b)
    c.gemm("shared", key, "TN", [T], D, Fs, "bwd")
    c.kernel("shared", "dense_act.bwd", T * Fs, "bwd")
    c.gemm("shared", key, "NN", [T], 2 * Fs, D, "bwd", weight_bytes=2 * Fs * D * b)
    c.gemm("shared", key, "TN", [T], 2 * Fs, D, "bwd")
    c.kernel("shared", "add", 2 * T * D, "bwd")  # the input gradient's three branches


def _overheads(c: _Ctx, groups: list[float], phase_bwd: bool) -> None:
    w = c.w
    mode = "fwdbwd" if phase_bwd else "fwd"
    nonempty = sum(1.0 - math.exp(-g) if g < 30 else 1.0 for g in groups)
    if c.cpu:
        from torch_moe.perf._memory import _dequantizes_pieces

        path = w.precision
        # a recipe whose scaled GEMMs run the native pieces: the probes at their rows
        measured = f"{c.threads}/{path}:pieces.{mode}"
        if (
            path != "bf16"
            and measured in c.hw.overheads
            and _dequantizes_pieces(w, groups, c.threads)
        ):
            path += ":pieces"
        fixed, per_group = c.hw.overhead(c.threads, f"{path}.{mode}")
        sec = fixed + per_group * nonempty
        if w.shared_hidden_dim:
            sec += c.hw.overhead(c.threads, f"shared.{mode}")[0]
        if w.capacity_factor is not None:
            cf, cg = c.hw.overhead(c.threads, f"capacity.{mode}")
            sec += cf + cg * nonempty
    else:
        launches = 14 if w.precision == "bf16" else 22
        launches *= 3 if phase_bwd else 1
        sec = launches * c.hw.launch_overhead
    c.add("overhead", sec, 0.0, 0.0, "fwd")


# --------------------------------------------------------------------------------------
# expert parallelism


def _row_bytes(w: MoEWorkload, fp8: bool) -> float:
    if fp8:
        return w.dim + 4 * math.ceil(w.dim / 128)
    return w.dim * w.element_size


def _exchange(
    c: _Ctx,
    name: str,
    rows_send: float,
    rows_recv: float,
    row_bytes: float,
    phase: str,
    with_weights: bool,
) -> float:
    """One direction of the dispatch (or combine): the busiest rank's seconds."""
    w = c.w
    R, El, N = w.ep, w.local_experts, w.nodes
    L = w.ranks_per_node
    remote = (R - 1) / R  # rows that leave the rank (uniform over ranks)
    nbytes = max(rows_send, rows_recv) * remote * row_bytes
    weights = max(rows_send, rows_recv) * remote * 4 if with_weights else 0.0
    inter_frac = (N - 1) / N * R / max(R - 1, 1) if N > 1 else 0.0  # of the remote rows
    intra, inter = c.intra, c.inter
    if w.exchange == "p2p":
        msgs_intra = (L - 1) * El * (2 if with_weights else 1)
        msgs_inter = (R - L) * El * (2 if with_weights else 1)
        t_intra = intra.time((nbytes + weights) * (1 - inter_frac), msgs_intra)
        t_inter = inter.time((nbytes + weights) * inter_frac, msgs_inter) if N > 1 else 0.0
        sec = max(t_intra, t_inter)
        c.ops.append(Op(name, sec, 0.0, nbytes + weights, phase))
        return sec
    collectives = 2 if with_weights else 1
    if w.hierarchical and N > 1:
        # stage 1 inside the node, stage 2 across nodes (L times larger messages),
        # plus an all_gather of the split matrix and two reorders per direction
        t = intra.time((nbytes + weights) * (L - 1) / max(L, 1), 0) + intra.collective_latency
        t += inter.time((nbytes + weights) * inter_frac, 0) + inter.collective_latency
        t += inter.collective_latency * collectives  # split-matrix all_gather
        c.ops.append(Op(name, t, 0.0, nbytes + weights, phase))
        c.kernel(name, "permute.fwd", 2 * rows_recv * w.dim, phase, calls=2)
        return t
    if N > 1:
        t_intra = intra.time((nbytes + weights) * (1 - inter_frac), 0)
        t_inter = inter.time((nbytes + weights) * inter_frac, 0)
        t = max(t_intra, t_inter) + collectives * inter.collective_latency
    else:
        t = intra.time(nbytes + weights, 0) + collectives * intra.collective_latency
    c.ops.append(Op(name, t, 0.0, nbytes + weights, phase))
    # the rows gathered into destination-major order before the collective, and reordered
    # (or scattered back) on arrival: two passes over the rows that p2p does not make
    c.kernel(name, "permute.fwd", rows_send * w.dim, phase)
    c.kernel(name, "permute.fwd", rows_recv * w.dim, phase)
    return t


def _expert_parallel(
    c: _Ctx, rows_send: float, rows_recv: float, phase_bwd: bool
) -> dict[str, float]:
    """Counts exchange, dispatch and combine (forward, and backward when trained)."""
    w = c.w
    fp8 = w.dispatch_dtype is not None
    link = c.inter if w.nodes > 1 else c.intra
    counts = link.collective_latency
    c.ops.append(Op("dispatch", counts, 0.0, w.num_experts * 8.0, "fwd"))
    if fp8:
        c.kernel("dispatch", "q.fp8_1x128", rows_send * w.dim, "fwd")
    if w.dedup and w.nodes > 1:
        out = {
            "dispatch": _dedup_exchange(c, "dispatch", "fwd"),
            "combine": _dedup_exchange(c, "combine", "fwd"),
        }
    else:
        out = {
            "dispatch": _exchange(
                c, "dispatch", rows_send, rows_recv, _row_bytes(w, fp8), "fwd", True
            ),
            "combine": _exchange(
                c, "combine", rows_recv, rows_send, _row_bytes(w, False), "fwd", False
            ),
        }
    out["dispatch"] += counts
    if w.num_chunks > 1 and w.exchange == "all_to_all":
        # C collectives per direction instead of one (each chunk gathers and reorders
        # only its own rows: the row passes of ``_exchange`` cover all chunks)
        extra = (w.num_chunks - 1) * 2 * link.collective_latency
        c.ops.append(Op("dispatch", extra, 0.0, 0.0, "fwd"))
        out["dispatch"] += extra
    # the host work of the exchange ops that alpha-beta misses (measured on CPU groups)
    kind = "hierarchical" if w.hierarchical and w.nodes > 1 else w.exchange
    host = link.host_time(kind, phase_bwd, w.local_experts, w.num_chunks)
    if host > 0:
        c.ops.append(Op("ep_host", host, 0.0, 0.0, "fwd"))
    if phase_bwd:
        row = _row_bytes(w, False)
        if w.dedup and w.nodes > 1:
            _dedup_exchange(c, "dispatch", "bwd")
            _dedup_exchange(c, "combine", "bwd")
        else:
            _exchange(c, "combine", rows_send, rows_recv, row, "bwd", False)  # combine backward
            _exchange(c, "dispatch", rows_recv, rows_send, row, "bwd", True)  # dispatch backward
    return out


def _dedup_exchange(c: _Ctx, name: str, phase: str) -> float:
    """A dispatch that sends each token once per destination node over the inter-node
    link and fans it out inside the node (DeepEP's normal mode; not torch_moe's)."""
    w = c.w
    T, K = w.tokens, w.top_k
    fp8 = w.dispatch_dtype is not None and name == "dispatch" and phase == "fwd"
    row = _row_bytes(w, fp8)
    nodes = w.distinct_nodes()
    remote_nodes = nodes * (w.nodes - 1) / w.nodes
    inter_bytes = T * remote_nodes * row
    intra_bytes = T * K * row * (w.ranks_per_node - 1) / w.ep
    t = max(c.inter.time(inter_bytes, 0), c.intra.time(intra_bytes, 0))
    c.ops.append(Op(name, t, 0.0, inter_bytes + intra_bytes, phase))
    return t


# --------------------------------------------------------------------------------------
# predict


def _groups(w: MoEWorkload, rows: torch.Tensor) -> list[float]:
    return [float(r) for r in rows.tolist()]


def _sum(ops: list[Op], phase: str | None = None, prefix: str | None = None) -> float:
    return sum(
        o.seconds
        for o in ops
        if (phase is None or o.phase == phase)
        and (prefix is None or o.component.startswith(prefix))
    )


def _peak_over_ranks(
    w: MoEWorkload,
    hw: Hardware,
    busiest: dict[str, float],
    local_rows: float,
    rows: tuple[float, float],
    groups_max: list[float],
    threads: int,
) -> dict[str, float]:
    """The layer's peak: the largest over the ranks, not always the busiest rank's.

    Each rank's CPU kernels decide on its own received rows (``grouped_swiglu``'s path by
    rows per expert, rounded to a power of two), so a rank with fewer rows than the
    busiest can take the path with the larger buffers: at a bucket edge (EP=4, E=16,
    256 rows per expert on average) the busiest rank's and a lighter rank's paths can
    differ, and their peaks by megabytes (measured: the lighter ranks' whole-tensor path
    2-3 MiB above the busiest rank's per-group loop). Besides the busiest rank this evaluates
    the mean rank and its mirror image below the mean (as far under as the busiest is
    over), and keeps the largest peak; the other entries stay the busiest rank's.
    """
    from torch_moe.perf._memory import memory

    mean_rows, max_rows = rows
    best = busiest
    for n in (mean_rows, max(0.0, 2 * mean_rows - max_rows)):
        scale = n / max_rows
        m = memory(w, hw, local_rows, n, [g * scale for g in groups_max], threads)
        if m["peak"] > best["peak"]:
            best = m
    if best is busiest:
        return busiest
    return {**busiest, "peak": best["peak"], "peak_step": best["peak_step"]}


def predict(
    workload: MoEWorkload, hardware: Hardware, *, ranks_on_host: int | None = None
) -> Prediction:
    """Predict one step of ``workload`` on ``hardware`` (see the module docstring).

    ``ranks_on_host``: EP ranks sharing one CPU host's cores and transport (default: the
    ranks per node, ``ep // nodes``); e.g. a two-"node" hierarchical run on one host.
    """
    from torch_moe.perf._memory import memory

    if not isinstance(workload, MoEWorkload):
        raise TypeError(f"predict: workload must be a MoEWorkload, got {type(workload).__name__}")
    if not isinstance(hardware, Hardware):
        raise TypeError(f"predict: hardware must be a Hardware, got {type(hardware).__name__}")
    w, hw = workload, hardware
    c = _Ctx(w, hw, ranks_on_host)
    bwd = w.backward
    T, K, E = w.tokens, w.top_k, w.num_experts
    mean_rows, max_rows, busiest = w.rank_rows()
    groups_max = _groups(w, busiest)
    scale = mean_rows / max_rows if max_rows > 0 else 1.0
    groups_mean = [g * scale for g in groups_max]
    align = 16 if hw.kind == "gpu" and w.precision != "bf16" else 1
    align_rows = float(E * (align - 1)) if w.ep == 1 else 0.0  # zero rows up to the bound
    local_rows = (
        T * K
        if w.capacity is None
        else min(T * K, sum(min(x, w.capacity) for x in w.expected_loads().tolist()))
    )
    dropped = T * K - local_rows

    _router(c, bwd)
    _permute(c, local_rows + align_rows, bwd)
    experts = _experts_bf16 if w.precision == "bf16" else _experts_recipe
    experts(c, "experts", groups_mean, bwd)
    excess = excess_fwd = 0.0
    if w.ep > 1 and max_rows > mean_rows:
        # the busiest rank's experts run on more rows than the mean rank's
        busy, mean = _Ctx(w, hw, ranks_on_host), _Ctx(w, hw, ranks_on_host)
        experts(busy, "experts", groups_max, bwd)
        experts(mean, "experts", groups_mean, bwd)
        excess = _sum(busy.ops) - _sum(mean.ops)
        excess_fwd = _sum(busy.ops, "fwd") - _sum(mean.ops, "fwd")
        c.ops.append(Op("imbalance", max(0.0, excess), 0.0, 0.0, "fwd"))
    _shared(c, bwd)
    _overheads(c, groups_max, bwd)

    comm: dict[str, float] = {}
    if w.ep > 1:
        comm = _expert_parallel(c, local_rows, max_rows, bwd)

    # overlap of the forward exchange with the experts (chunked EP)
    overlap = 0.0
    overlap_parts = (0.0, 0.0)
    if w.ep > 1 and w.num_chunks > 1:
        C = w.num_chunks
        exch = comm["dispatch"] + comm["combine"]
        experts_fwd = _sum(c.ops, "fwd", "experts") + max(0.0, excess_fwd)
        if w.shared_hidden_dim:
            experts_fwd += _sum(c.ops, "fwd", "shared")
        hidden = exch * (C - 1) / C
        f = hw.comm_compute_share
        overlapped = max(experts_fwd, hidden) + f * min(experts_fwd, hidden)
        overlap = overlapped - (experts_fwd + hidden)  # <= 0
        chunk_cost = (C - 1) * hw.overhead(c.threads, f"{w.precision}.fwd")[1] * c.slow
        c.ops.append(Op("overlap", overlap + chunk_cost, 0.0, 0.0, "fwd"))
        overlap_parts = (experts_fwd, hidden)

    breakdown: dict[str, float] = {}
    flops: dict[str, float] = {}
    nbytes: dict[str, float] = {}
    for o in c.ops:
        breakdown[o.component] = breakdown.get(o.component, 0.0) + o.seconds
        flops[o.component] = flops.get(o.component, 0.0) + o.flops
        nbytes[o.component] = nbytes.get(o.component, 0.0) + o.bytes
    total = sum(breakdown.values())
    details = {
        "rows_mean": mean_rows,
        "rows_max": max_rows,
        "imbalance": max_rows / mean_rows if mean_rows else 1.0,
        "tokens_per_expert": T * K / E,
        "dropped_rows": dropped,
        "padding_rows": align_rows,
        "distinct_ranks_per_token": w.distinct_ranks(),
        "distinct_nodes_per_token": w.distinct_nodes(),
        "threads": float(c.threads),
        "oversubscription": c.slow,
        "routed_flops": 2.0 * 3 * local_rows * w.dim * w.hidden_dim * (3 if bwd else 1),
        "overlap_compute": overlap_parts[0],
        "overlap_comm": overlap_parts[1],
    }
    mem = memory(w, hw, local_rows, max_rows, groups_max, c.threads)
    if w.ep > 1 and max_rows > mean_rows:
        mem = _peak_over_ranks(w, hw, mem, local_rows, (mean_rows, max_rows), groups_max, c.threads)
    return Prediction(total, breakdown, flops, nbytes, mem, details, w, hw, c.ops)
