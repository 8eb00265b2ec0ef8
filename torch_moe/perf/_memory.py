"""Memory of one MoE layer step on one rank: weights, gradients, optimizer states, saved
activations, communication buffers, and the peak of a forward + backward.

Legend: T tokens of the rank, D dim, F hidden dim, Fs shared hidden dim, E experts,
El local experts, K top-k, M permuted rows (T*K dropless, the static bound with a
capacity or an alignment), N rows the local experts receive (EP), b bytes per element
of the layer dtype, c of the CPU GEMM compute dtype (b, or 4 where bf16 is upcast), m the
rows of the largest expert group, r the rows of one SwiGLU-backward chunk on a CPU (at
most m; the kernels' own measured chunk, see ``_act_chunk_rows``).

Saved for the backward (``torch_moe.nn.MoE``'s documented formula, extended):

* dropless, no alignment: ``T * (D*b + E*4) + T*K*(8 + 4 + 16 + 2F*b) + E*4``;
* with a capacity or an alignment (static M rows): ``T * (D*b + E*4 + K*16) + M * (2F*b
  + 8 + 8 + 1 + 4) + 8 + E*4`` (the row map, its clamped copy, the padding mask and
  the per-row weight over M rows; the 8: the reference sort's dump row, which the native
  CPU sort does not allocate);
* the permuted input [M, D] (``M*D*b``) where the experts do not gather their rows
  from the tokens themselves: a recipe (which also saves the activation ``a`` [M, F],
  ``M*F*b``) and EP (the received rows);
* a shared expert saves ``T * 4*Fs*b`` (its gate/up output, silu(gate) and the product;
  on a CPU that upcasts the half dtype also its two one-group GEMMs' int32 offsets).
  The layer runs it before the routed experts, so autograd runs its backward after
  theirs (of two ready nodes the one created later runs first): its saved tensors are
  live through the routed experts' backward, and its own backward is a phase of its own
  (the routed experts' saved tensors freed, their weight gradients live, with its
  ``2*T*Fs*b`` of gradients and its down projection's weight gradient at its largest;
  where the CPU upcasts, its GEMMs' fp32 copies where they take the loop:
  ``_shared_upcast_bytes``);
* EP: the experts' tensors are over the N received rows, plus the received routing
  weights (``N*4``).

EP peak: the received rows are saved (above) and no send buffer outlives its exchange, so
the dispatch buffers are not live in the experts' backward; with C chunks the experts'
backward runs one chunk at a time, its rows' terms (the output gradient, dX, the
activation buffers) over ``N / C`` rows, while the weight gradients of all local experts
are live by the last chunk (``GroupedExperts.split_weights``), and then the split's backward
concatenates them (a phase of its own: ``El*5*F*D*b``, w13's chunks and their
concatenation with w2's whole, plus the permuted rows' gradient); the exchanges' backward is a
phase of its own: the saved tensors, the output, and the gradients of the local and the
received rows (``comm_buffers``: ``(M_local + N) * (D*b + 4)``; twice that with
all_to_all, whose source-major copy and collective output come on top of each). The
layer's peak is the largest rank's (``predict``: the ranks' kernels decide on their own
rows). Measuring it: gloo sometimes frees an all_to_all buffer on its worker thread, a
free the profiler does not record, so ``benchmarks/bench_perf_model.py`` takes the least
of 5 profiled steps (``benchmarks/results/perf_model_ephost_cpu_202612.md``).

Peak of forward + backward (the largest live set, weights, input and output gradient
included; the saved activations less the input x, which the router saves as the caller's
tensor): the layer's backward visits unpermute, the experts, permute, the router; the
experts' backward holds the most:

* bf16 on a CPU where ``grouped_swiglu`` takes its whole-tensor path (many small groups;
  a measured decision): ``4*M*F*b`` (dA, A, dH) plus one chunk's fp32 temporaries
  (``r*2F*4 + 4*r*F*4``: h, silu, dA, A and their product, as on the loop), or
  later dW2's phase (A and dH, ``3*M*F*b``, with dW2 only: each weight gradient is
  allocated as the kernel computes it), dW13's (A freed: dH and, where the experts
  gather from the tokens, the input rows [M, D] gathered again) or dX's (dH and dX [M,
  D]), each with the weight gradients, whichever is largest, plus the row-major copy of
  that weight gradient's first operand (dY for dW2, dH for dW13) where the kernels
  measured it faster (``grouped_mm.wgrad_copies``);
* bf16 on a CPU (``grouped_swiglu_backward``, group by group): the saved tensors, the
  output [T, D], the permuted gradient and dX [M, D] each, the expert weight gradients,
  the largest group's ``grad_a``, ``a`` [m, F] and ``dH`` [m, 2F] in c, and one chunk's
  fp32 temporaries (``r*2F*4 + 4*r*F*4``: h, silu, dA, A and their product), or in their
  place the copy of dH for its weight gradient where the kernels make one, and where the
  experts gather from the tokens the group's input rows gathered again for its dW13;
* then (CPU, one process) dX [M, D] summed into the tokens' gradient [T, D] with the
  weight gradients live, and ``unpermute``'s fp32 chunk temporaries where the native
  combine does not run (bf16: inside the experts' fused node, their saved tensors and
  the rows' output gradient still live; a recipe's experts are done by then);
* recipes on a CPU and every path on a GPU (whole-tensor ops): the largest of the phases
  dgrad / wgrad of the second GEMM, the SwiGLU backward (on a GPU ``M*2F*4 + 6*M*F*4`` of
  fp32 temporaries, on a CPU one row chunk's, as above), dgrad / wgrad of the first GEMM
  (a recipe's GEMMs are ops of their own: the second's output gradient [M, D] is freed
  before the SwiGLU's backward); with the emulation each GEMM quantizes A, then B (``q``
  bytes per element at the worst, 1 kept: 1-2 from the quantizers' chunked CPU kernels,
  see ``_FQ_TRANSIENT``), then the scaled GEMM's CPU kernel: forward and dgrad dequantize
  A in chunks of whole groups and the chunk's experts of B (4 bytes per element, 8 while
  converting where ATen's table converts instead of the native kernel) with each chunk's
  fp32 product; wgrad dequantizes both operands per chunk into one group's fp32 product;
  MX operands of a bf16 layer, where bf16 GEMMs are native, are dequantized to whole bf16
  copies for the bf16 grouped GEMM instead, or piece by piece inside the native GEMM
  where it runs them (``_gemm_phase``, ``_mx_bf16_phase``, ``_mx_pieces_here``), and the
  FP8 recipes' codes, where torch_moe's native bf16 GEMM runs, are multiplied in bf16
  piece by piece (no whole copies) with the scales applied per k block inside the GEMM
  (``_codes_bf16_here``, ``_blocks_bf16_phase``); where bf16 GEMMs are not native, the
  fp32 form runs piece by piece in the native kernels (each piece's fp32 copies in its
  thread's scratch: ``_dequantizes_pieces``). Weights are
  quantized whole every call, so ``nB = El*2F*D`` for the first GEMM's forward and dgrad.

Inference (``backward=False``; bf16 experts on a CPU without EP, ``_inference_bytes``):
the largest of the router's phase (its fp32 copy of x, the logits), a shared expert's
(``3*T*Fs*b`` and its output), the experts' (whole path: the gathered rows with h, freed
before A and Y, ``M*(3F + D)*b`` at the second GEMM; loop: h and Y with one group's
gathered rows or fp32 chunk, and its activation buffer), the combine's (Y, the output and
one token chunk's gathered and fp32 rows) and the final sum's, plus what the layer's
forward holds throughout (the logits, the routing's ids, weights and row maps, the shared
output): within 3.5% of the allocator's peak on each path (test_perf). A recipe's experts
(``_inference_recipe_experts``) in their phases: the activation's codes (the tokens' then
the rows' gathered from them; per tensor, the permuted rows then their codes), each scaled
GEMM on the cached weights' codes with its output and its kernel's transients (the FP8
codes' scales laid out per k block, ``_codes_scale_bytes``; MX's bf16 copies, B's from one
stacked call where every expert has rows), the SwiGLU and its codes; the weights' codes
and scales, cached per version, are ``weight_cache`` (resident, in ``peak``): within 1% of
the allocator's peak for the FP8 recipes, 2.5% for MX (oneDNN's scratch), with and without
the native kernels (test_perf). Other devices and EP keep the older estimate (the permuted
rows, h and y materialized), not validated against measurements.

Not modelled: the GEMM library's own scratch (oneDNN packs operands into buffers of its
own, 0.1-0.8 MiB a bf16 GEMM at the benchmarks' shapes), held once per GEMM, and once
per thread where the CPU's threaded grouped GEMM runs a GEMM on each thread
(``threads_mm``): well under 1% of a step's peak at realistic sizes, 5-10% of the small
layers of test_perf (which time the GEMMs split over the threads).

The expected largest group is ``lam_max + sqrt(lam_max) * z_E`` rows (``z_E`` the expected
maximum of E standard normals: the multinomial noise of the routing).

Optimizer: Adam, two fp32 moments per parameter, plus an fp32 master copy when the
parameters are not fp32 (12 or 8 bytes per parameter).
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from torch_moe.perf._hardware import Hardware
from torch_moe.perf._workload import MoEWorkload
from torch_moe.quantization.recipes import OperandQuant

__all__ = ["memory", "saved_bytes", "weight_cache_bytes"]


def _act_chunk_rows(w: MoEWorkload, threads: int) -> float:
    """Rows of one chunk of the CPU SwiGLU kernels' elementwise work: the kernels' own
    measured choice (``grouped_swiglu._act_chunk_rows``: elements per thread, a probe
    decision between 2^15 and 2^18, times the rank's threads, over F). Its fp32
    temporaries (:func:`_act_fp32_bytes`) move the peak by megabytes between the
    candidates."""
    from torch_moe._ops import grouped_swiglu as _gs

    return float(_gs._act_chunk_rows(w.dtype, w.hidden_dim, threads))


def _act_fp32_bytes(w: MoEWorkload, rows: float, backward: bool = True) -> float:
    """One chunk's fp32 temporaries of the SwiGLU activation at their largest, on either
    CPU path, as its kernels make them (``grouped_swiglu._act_temporary_bytes``): with the
    ATen ops h [r, 2F] forward, and backward also silu, dA, A and their product [r, F];
    with the native row kernels none (row buffers only: d row_weights is summed row by
    row)."""
    from torch_moe._ops import grouped_swiglu as _gs

    return _gs._act_temporary_bytes(w.dtype, rows, w.hidden_dim, backward)


@functools.lru_cache(maxsize=64)
def expected_max_normal(n: int) -> float:
    """E[max of n iid standard normals] by numerical integration (0 for n = 1)."""
    if n <= 1:
        return 0.0
    xs = torch.linspace(-8, 8, 4001, dtype=torch.float64)
    cdf = 0.5 * (1 + torch.erf(xs / math.sqrt(2)))
    pdf = torch.exp(-0.5 * xs**2) / math.sqrt(2 * math.pi)
    dens = n * pdf * cdf ** (n - 1)
    return float(torch.trapezoid(xs * dens, xs))


def _static_rows(w: MoEWorkload, align: int) -> int:
    """M: the permuted buffer's rows (torch_moe.ops.permute_indices' static bound)."""
    n = w.tokens * w.top_k
    bound = n + w.num_experts * (align - 1)
    if w.capacity is None:
        return bound
    return min(w.num_experts * (-(-w.capacity // align) * align), bound)


def _align(w: MoEWorkload, hw: Hardware) -> int:
    return 16 if hw.kind == "gpu" and w.precision != "bf16" else 1


def _gathered(w: MoEWorkload) -> bool:
    """Whether the experts gather their rows from the tokens (``grouped_swiglu``'s
    permutation form: bf16 without expert parallelism), so no permuted input is saved."""
    return w.ep == 1 and w.precision == "bf16"


def _expert_row_bytes(w: MoEWorkload) -> int:
    """Bytes the experts save per row they run: the input row (unless gathered from the
    tokens) and h [2F] (a recipe also ``a`` [F])."""
    row = 0 if _gathered(w) else w.dim
    return (row + 2 * w.hidden_dim + (w.hidden_dim if w.precision != "bf16" else 0)) * (
        w.element_size
    )


def _dump_row_bytes(hw: Hardware) -> float:
    """The reference ``permute_indices`` scatters dropped slots into a dump row past the M
    rows of its row map (a view of M + 1 int64); the native CPU counting sort allocates
    the M rows alone."""
    from torch_moe._ops import _native

    return 0.0 if hw.kind == "cpu" and _native.kernels() is not None else 8.0


def saved_bytes(w: MoEWorkload, hw: Hardware, rows_recv: float | None = None) -> float:
    """Bytes saved for the backward by one forward (see the module docstring)."""
    if not w.backward:
        return 0.0
    T, D, E, K = w.tokens, w.dim, w.num_experts, w.top_k
    b = w.element_size
    align = _align(w, hw)
    per_row = _expert_row_bytes(w)
    total = float(T * (D * b + E * 4) + E * 4)
    if w.ep > 1:
        n = rows_recv if rows_recv is not None else T * K
        total += T * K * (8 + 4 + 16) + n * (per_row + 4)  # + the received routing weights
    elif w.capacity is None and align == 1:
        total += T * K * (8 + 4 + 16 + per_row)
    else:
        m = _static_rows(w, align)
        total += T * K * 16 + m * (per_row + 8 + 8 + 1 + 4) + _dump_row_bytes(hw)
    total += T * 4 * w.shared_hidden_dim * b
    if w.shared_hidden_dim and hw.kind == "cpu":
        from torch_moe._ops.grouped_mm import cpu_compute_dtype

        if cpu_compute_dtype(w.dtype) != w.dtype:  # its GEMMs' one-group offs (int32)
            total += 2 * 4
    return float(total)


def _params(w: MoEWorkload) -> tuple[float, float]:
    """(parameters of this rank, bytes)."""
    D, F = w.dim, w.hidden_dim
    n = w.num_experts * D + w.local_experts * 3 * F * D + 3 * w.shared_hidden_dim * D
    return float(n), float(n * w.element_size)


# Bytes per element an operand's quantize holds at its worst on a CPU, the 1 byte of e4m3
# it keeps included, by kind; every CPU quantizer converts in chunks of ``_QUANT_CHUNK``
# elements (no fp32 copy of the operand): 1 byte, 2 for a column-major B (the weights,
# ``*_col``), which the ops return contiguous, plus ``_CHUNK_BYTES`` per element of one
# chunk (the fp32 chunk; the jagged (wgrad) blocks' small groups also hold its absolute
# values and its rows' scales). A GPU kernel writes e4m3 (1 byte) directly and reads it in
# the GEMM. test_perf.py checks the layer's peak against the model.
_FQ_TRANSIENT = {
    "fp8": 1.0,
    "fp8_col": 2.0,
    "mx": 1.0,
    "mx_col": 2.0,
    "fp8_jagged": 1.0,
    "mx_jagged": 1.0,
    "gpu": 1.0,
    "bf16": 0.0,  # not quantized: a GEMM reads the operand itself
}
_CHUNK_BYTES = {"fp8": 4, "fp8_col": 4, "mx": 4, "mx_col": 4, "fp8_jagged": 12, "mx_jagged": 12}


def _quantize_bytes(kind: str, n: float) -> float:
    """Peak bytes of quantizing an n-element operand of ``kind`` (``_FQ_TRANSIENT``), one
    chunk's temporaries included (``_CHUNK_BYTES``; none where the native kernels quantize
    block rows in registers: ``quantize_fp8``, ``quantize_mx``, ``quantize_jagged``)."""
    from torch_moe.quantization.quantize import _QUANT_CHUNK

    if kind in _CHUNK_BYTES and _native_fp8():
        return _FQ_TRANSIENT[kind] * n  # the native quantizers: no fp32 chunk
    return _FQ_TRANSIENT[kind] * n + _CHUNK_BYTES.get(kind, 0) * min(n, _QUANT_CHUNK)


def _operand_kinds(precision: str, cpu: bool) -> dict[str, tuple[str, str]]:
    """Per GEMM: the quantizer kinds (``_FQ_TRANSIENT``) of its (lhs, rhs)."""
    from torch_moe.perf._workload import recipe_operands

    def kind(quant: str, weight: bool) -> str:
        if not cpu:
            return "gpu"
        fmt = "mx" if ".mx" in quant else "fp8"
        if quant.startswith("qj.") and quant != "qj.fp8_tensor":
            return fmt + "_jagged"
        return fmt + "_col" if weight else fmt

    return {
        g: (kind(lq, False), kind(rq, g != "wgrad"))
        for g, (lq, rq) in recipe_operands(precision).items()
    }


def _gemm_phase(
    kinds: tuple[str, str],
    n_a: float,
    n_b: float,
    n_out: float,
    b: int,
    cpu: bool,
    *,
    rows: float = 0.0,
    group_rows: float = 0.0,
    wgrad: bool = False,
    codes: bool = False,
    quantized: bool = True,
    busy: float | None = None,
    b_rows: bool = False,
    pieces: bool = False,
) -> float:
    """Peak bytes of one quantized GEMM above what was live before it: quantize A, then B
    (``_FQ_TRANSIENT`` bytes per element of each operand's kind), then the scaled GEMM. A
    GPU kernel reads e4m3 and writes the output. The CPU kernels (``rows`` of A, the
    largest group ``group_rows``): forward / dgrad dequantize A in chunks of whole groups
    (``_CPU_CHUNK_ELEMS`` elements, or one larger group), then those groups' experts of B
    (the fp32 value, and ATen's table's int32 index while converting where the native
    kernel does not: 4 or 8 bytes per element, 4 kept; ``_CPU_CHUNK_ELEMS``
    of them, or one expert), then each chunk's fp32 product, into the output; wgrad
    dequantizes both token-order operands per chunk (the value; by ATen's ops also the
    table's index or the rows' scales gathered) into one group's fp32 product, with the
    jagged operands' scale row per row (int64). ``codes``: the kernels multiply the codes
    in bf16 instead (:func:`_codes_bf16_here`, :func:`_blocks_bf16_phase`).
    ``quantized=False``: both operands are codes already (the inference path's), only the
    scaled GEMM's phase; ``busy``: the experts with rows, None for all (MX's copies of B
    come from one stacked call where all have, else the busy ones': :func:`_mx_bf16_phase`);
    ``b_rows``: B's codes row-major (a dgrad's weight; else column-major, K-major).
    ``pieces``: the fp32 form runs by the native kernels' pieces instead of the chunks
    (:func:`_dequantizes_pieces`): each piece's fp32 operands and product in its thread's
    scratch, outside the allocator (as the GEMM libraries' own), the output written once;
    MX's E8M0 scales converted to fp32 first (``e8m0_to_float``: their int32 codes, then
    the values), and a jagged wgrad's scale row per row."""
    if not cpu:
        qa, qb = _FQ_TRANSIENT[kinds[0]], _FQ_TRANSIENT[kinds[1]]
        return max(qa * n_a, n_a + qb * n_b, n_a + n_b + b * n_out)
    from torch_moe.quantization.scaled_grouped_mm import _CPU_CHUNK_ELEMS

    quantize = max(_quantize_bytes(kinds[0], n_a), n_a + _quantize_bytes(kinds[1], n_b))
    if not quantized:
        quantize = n_a + n_b
    m = max(rows, 1.0)
    k, n = n_a / m, (n_b if wgrad else n_out) / m
    if codes:
        return max(quantize, _blocks_bf16_phase(n_a, n_b, n_out, m))
    if b == 2 and all(kd.startswith("mx") for kd in kinds) and _mx_in_bf16_here():
        mx = _mx_bf16_phase(n_a, n_b, n_out, m, k, n, group_rows, wgrad, busy, b_rows)
        return max(quantize, mx)
    if pieces:  # (B's E8M0 scales to fp32 through their int32 codes: 8 bytes at once)
        scales = (4 * n_a + 8 * n_b) / 32 if kinds[1].startswith("mx") else 0.0
        per_row = 8 * rows if wgrad and kinds[0].endswith("_jagged") else 0.0
        return max(quantize, n_a + n_b + per_row + scales + b * n_out)
    chunk = min(max(_CPU_CHUNK_ELEMS // max(k, n, 1.0), group_rows), m)  # rows per chunk
    if wgrad:  # out [E, K, N]; one group's fp32 product [K, N]
        groups = max(1.0, n_out / max(k * n, 1.0))
        jagged = kinds[0].endswith("_jagged")  # per-block scales: a scale row per row
        per_row = 8 * rows if jagged else 0.0
        # each chunk's fp32 values (the native kernel: times their scales in one pass)
        # with, by ATen's ops, the table's int32 codes or the rows' scales gathered to full
        # size while converting
        conv = 4 if _native_fp8() else 8
        chunks = chunk * max(conv * k, 4 * k + conv * n)  # A's value kept while B converts
        return max(quantize, n_a + n_b + per_row + b * n_out + 4 * n_out / groups + chunks)
    # forward / dgrad: per chunk, A's rows (int32 codes and fp32 values), then the chunk's
    # experts of B the same way (at most _CPU_CHUNK_ELEMS of them, or one expert), then
    # the chunk's fp32 product
    experts = max(1.0, n_b / max(k * n, 1.0))
    cap = max(1.0, _CPU_CHUNK_ELEMS // max(k * n, 1.0))
    in_chunk = min(experts, cap, max(1.0, chunk * experts / m))
    chunk = min(chunk, max(group_rows, in_chunk * m / experts))
    b_chunk = n_b * in_chunk / experts
    conv = 4 if _native_fp8() else 8  # fp32 values (and ATen's table's int32 codes)
    # (each chunk's A rows and product are freed before the next chunk's exist)
    # MX's E8M0 scales of the chunk's experts, converted to fp32 with them
    b_scales = 4 * b_chunk / 32 if kinds[1].startswith("mx") else 0.0
    per_chunk = max(
        conv * chunk * k,  # A's rows converted
        4 * chunk * k + conv * b_chunk + b_scales,  # then the chunk's experts of B
        4 * chunk * (k + n) + 4 * b_chunk,  # then the chunk's product
    )
    return max(quantize, n_a + n_b + b * n_out + per_chunk)


def _native_fp8() -> bool:
    """Whether this CPU's emulation quantizes and dequantizes e4m3 by the native kernels
    (no fp32 chunks; fp32 values only), else by ATen's ops (chunks, the table's int32
    codes, the rows' scales gathered)."""
    from torch_moe.quantization.quantize import native_fp8_conversions

    return native_fp8_conversions()


def _mx_in_bf16_here() -> bool:
    """Whether this CPU's scaled GEMM kernels multiply MX operands with a bf16 output in
    bf16 (``scaled_grouped_mm._mx_in_bf16``: bf16 GEMMs native here)."""
    from torch_moe.quantization.scaled_grouped_mm import bf16_gemms_native

    return bf16_gemms_native()


def _codes_bf16_here(precision: str, b: int) -> bool:
    """Whether this CPU's scaled GEMM kernels multiply an FP8 recipe GEMM's e4m3 codes in
    bf16 (a bf16 layer, torch_moe's native bf16 GEMM here): the scales applied per k block
    in the GEMM's tiles (``scaled_grouped_mm._blocks_in_bf16``, and ``_codes_in_bf16`` /
    ``_wgrad_codes_in_bf16`` for scales constant along the reduction, repeated per block:
    every GEMM of an FP8 recipe); else the fp32 form (or MX's own)."""
    from torch_moe._ops.grouped_mm import native_gemm_ready

    return (
        b == 2
        and precision in ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise")
        and native_gemm_ready(torch.bfloat16)
    )


def _blocks_bf16_phase(n_a: float, n_b: float, n_out: float, m: float) -> float:
    """Peak bytes of a block-scaled GEMM's CPU kernel on the codes in bf16
    (``_codes_bf16_here``) above the e4m3 operands: the bf16 output and the scales laid
    out for the kernel (fp32, one per 128 elements of each operand, the columns' padded to
    whole panels). The kernel converts each piece of the codes to bf16 in its threads'
    scratch as it multiplies it (as the native GEMM packs its operands there): memory
    outside the allocator, left out like the GEMM libraries' own scratch."""
    return n_a + n_b + 2 * n_out + 4 * (n_a + n_b) / 128 + 8 * m


def _mx_pieces_here(experts: float, m: float, k: float, n: float, wgrad: bool) -> bool:
    """Whether an MX GEMM in bf16 runs by the native kernels' pieces
    (``scaled_grouped_mm._mx_pieces``, the kernels' own decision asked of meta stand-ins:
    row-major operands, the ``m`` rows in ``experts`` equal groups)."""
    from torch_moe.quantization.scaled_grouped_mm import _mx_pieces

    rows, groups = round(m), max(1, round(experts))
    if rows <= 0 or k < 1 or n < 1:
        return False
    ends = [rows * (g + 1) // groups for g in range(groups)]
    fp8 = torch.float8_e4m3fn
    a = torch.empty((rows, round(k)), dtype=fp8, device="meta")
    b_shape = (rows, round(n)) if wgrad else (groups, round(k), round(n))
    return _mx_pieces(a, torch.empty(b_shape, dtype=fp8, device="meta"), ends, wgrad)


def _mx_few_rows_here(busy: float, experts: float, m: float, k: float, n: float) -> bool:
    """Whether an MX forward in bf16 takes the few-rows kernel on the codes
    (``scaled_grouped_mm._mx_few_rows``: where ``grouped_mm`` would multiply the dequantized
    operands by the few-rows kernel's plain form), asked of meta stand-ins: the ``m`` rows
    in ``busy`` equal groups of the ``experts``, the weight column-major (the layout of the
    training forward's and of the inference cache's MX weights)."""
    from torch_moe._ops.grouped_mm import native_gemm_ready, whole_way

    rows, E, k_, n_ = round(m), max(1, round(experts)), round(k), round(n)
    if rows <= 0 or k_ < 32 or k_ % 32 or n_ < 1 or not native_gemm_ready(torch.bfloat16):
        return False
    g = max(1, min(round(busy), E))
    ends = [rows * min(i + 1, g) // g for i in range(E)]
    a = torch.empty((rows, k_), dtype=torch.bfloat16, device="meta")
    b = torch.empty((E, n_, k_), dtype=torch.bfloat16, device="meta").transpose(1, 2)
    return whole_way(a, b, ends, False) == "few"


def _mx_bf16_phase(
    n_a: float, n_b: float, n_out: float, m: float, k: float, n: float, group_rows: float,
    wgrad: bool, busy: float | None = None, b_rows: bool = False,
) -> float:  # fmt: skip
    """Peak bytes of an MX scaled GEMM's CPU kernel in bf16 (``_mx_in_bf16``) above the
    e4m3 operands: by the native kernels' pieces (:func:`_mx_pieces_here`) the fp32
    scales and the output (each piece's bf16 values in the threads' scratch, outside the
    allocator); else where the native e4m3 kernels run, both operands' bf16 copies written
    directly (with their blocks' fp32 scales), then the output; else A dequantized to a
    bf16 copy by chunks of fp32 rows (forward / dgrad:
    ``_CPU_CHUNK_ELEMS`` elements; wgrad: that many rows' worth of the wider operand, each
    row times its block's scale, by ATen's ops gathered to full size first), then B the
    same way (forward /
    dgrad: experts of B, at least one), then the bf16 grouped GEMM's output (and, for a
    weight gradient, the row-major copy of A where this CPU's kernels make one whole)."""
    from torch_moe._ops import grouped_mm as _gm
    from torch_moe.quantization.scaled_grouped_mm import _CPU_CHUNK_ELEMS

    base = n_a + n_b
    experts = (n_out if wgrad else n_b) / max(k * n, 1.0)
    if _mx_pieces_here(experts, m, k, n, wgrad):  # no copies: the fp32 scales
        return base + 4 * (n_a + n_b) / 32 + 2 * n_out
    few = not wgrad and not b_rows  # (the kernel takes a column-major B)
    if few and _mx_few_rows_here(experts if busy is None else busy, experts, m, k, n):
        return base + 2 * n_a + 4 * n_a / 32 + 2 * n_out  # A's bf16 copy, its scales; B's none
    copies = 2 * n_a + 2 * n_b + 4 * (n_a + n_b) / 32  # (with the fp32 scales, native)
    some = experts if busy is None else min(busy, experts)
    if not wgrad and some >= experts:
        # every expert dequantized by one stacked call (``_dequantize_stacked``): the
        # stacked rows' scale-row index (int64) and B's scales reshaped to those rows
        copies += 8 * n_b / max(min(k, n), 1.0) + 4 * n_b / 32
    elif not wgrad:  # only the busy experts, their E8M0 scales gathered and converted
        # at once (the gathered bytes, ATen's table's int32 index and the fp32 values)
        copies += (9 * some / max(experts, 1.0) - 4) * n_b / 32
    if wgrad:
        rows = min(max(1.0, _CPU_CHUNK_ELEMS // max(k, n, 1.0)), m)
        per_row = 8 * m  # the jagged blocks' index of each row (int64)
        copy = 0.0
        busy = max(group_rows, 1.0)
        if _gm.wgrad_copies(torch.bfloat16, int(busy), int(k), int(n)) and not (
            _gm.copies_by_pieces(torch.bfloat16)
        ):
            copy = 2 * n_a
        if _native_fp8():
            return base + per_row + max(copies, 2 * n_a + 2 * n_b + 2 * n_out + copy)
        conv = 8  # ATen's ops: the fp32 values and the rows' scales gathered
        return (
            base
            + per_row
            + max(
                2 * n_a + conv * rows * k,
                2 * n_a + 2 * n_b + conv * rows * n,
                2 * n_a + 2 * n_b + 2 * n_out + copy,
            )
        )
    if _native_fp8():
        return base + max(copies, 2 * n_a + 2 * n_b + 2 * n_out + 4 * n_a / 32)  # A's scales live
    rows = min(max(1.0, _CPU_CHUNK_ELEMS // max(k, 1.0)), m)
    b_chunk = min(max(_CPU_CHUNK_ELEMS, k * n), n_b)
    # each chunk's fp32 values, and ATen's table's gathered values while converting
    return base + max(
        2 * n_a + 8 * rows * k,
        2 * n_a + 2 * n_b + 8 * b_chunk,
        2 * n_a + 2 * n_b + 2 * n_out,
    )


def _whole_tensor_phases(
    w: MoEWorkload,
    cpu: bool,
    M: float,
    base: float,
    c: int,
    m: float = 0.0,
    threads: int = 1,
    pieces: bool = False,
) -> float:
    """The backward phases of the experts computed over all M rows at once (recipes on a
    CPU, every path on a GPU): dgrad / wgrad of the second GEMM, the SwiGLU backward,
    dgrad / wgrad of the first GEMM, each on top of what is live then (``pieces``: the
    recipes' fp32 form by the native pieces, :func:`_dequantizes_pieces`)."""
    D, F, El, b = w.dim, w.hidden_dim, w.local_experts, w.element_size
    recipe = w.precision != "bf16"
    w2, w13 = El * D * F, El * 2 * F * D
    codes = False
    if recipe:
        q = _operand_kinds(w.precision, cpu)
        dgrad, wgrad = q["dgrad"], q["wgrad"]
        codes = cpu and _codes_bf16_here(w.precision, b)
    else:  # bf16 on a GPU: grouped GEMMs straight from the operands
        dgrad = wgrad = ("bf16", "bf16")
    emu = cpu and recipe
    if emu:  # the swiglu_backward op's CPU kernel works in row chunks
        r = min(M, _act_chunk_rows(w, threads))
        swiglu_tmp = r * F * b + _act_fp32_bytes(w, r)
    else:
        swiglu_tmp = M * F * b + M * 2 * F * 4 + 6 * M * F * 4
    # AccumulateGrad copies a gradient into the parameter's layout only for a recipe whose
    # wgrad quantizes x and dY differently: the others' backward computes dW^T = dY^T x
    # (the weight's layout), and bf16's grouped_swiglu backward writes [E, 2F, D] and
    # [E, D, F], the parameters' own
    copy = b if recipe and not _symmetric_wgrad(w.precision) else 0
    a_saved = M * F * b if recipe else 0.0
    # a recipe's second GEMM is an op of its own: its output gradient [M, D] (in ``base``)
    # is freed once its backward is done, before the SwiGLU's and the first GEMM's
    dy = M * D * b if recipe else 0.0
    phases = [
        base
        + _gemm_phase(
            dgrad,
            M * D,
            w2,
            M * F,
            b,
            emu,
            rows=M,
            group_rows=m,
            codes=codes,
            b_rows=True,
            pieces=pieces,
        ),
        base
        + M * F * b
        + _gemm_phase(
            wgrad,
            M * F,
            M * D,
            w2,
            b,
            emu,
            rows=M,
            group_rows=m,
            wgrad=True,
            codes=codes,
            pieces=pieces,
        ),
        base - dy + M * F * b + w2 * (b + copy),  # accumulated after its GEMM's backward
        # the SwiGLU backward: dA [M, F] and dH [M, 2F]; its fp32 temporaries over all M
        # rows on a GPU (and A [M, F]), one row chunk's on a CPU (and the chunk's A)
        base - dy - a_saved + w2 * b + M * F * b + M * 2 * F * b + swiglu_tmp,
    ]
    after = base - dy - a_saved - M * 2 * F * b + w2 * b + M * 2 * F * b  # h freed, dH live
    phases += [
        after
        + _gemm_phase(
            dgrad,
            M * 2 * F,
            w13,
            M * D,
            b,
            emu,
            rows=M,
            group_rows=m,
            codes=codes,
            b_rows=True,
            pieces=pieces,
        ),
        after
        + M * D * b
        + _gemm_phase(
            wgrad,
            M * D,
            M * 2 * F,
            w13,
            b,
            emu,
            rows=M,
            group_rows=m,
            wgrad=True,
            codes=codes,
            pieces=pieces,
        ),
        # its weight gradient accumulated once its backward has returned: dH freed
        after - M * 2 * F * b + M * D * b + w13 * (b + copy),
    ]
    _ = c
    return max(phases)


def _symmetric_wgrad(precision: str) -> bool:
    from torch_moe.quantization.scaled_grouped_mm import _symmetric_wgrad as symmetric

    return symmetric(precision)


def _swiglu_whole(w: MoEWorkload, groups: list[float], backward: bool, threads: int) -> bool:
    """Whether this CPU's ``grouped_swiglu`` kernels take their whole-tensor path for the
    workload's forward or backward on ``threads`` threads (the same measured decisions:
    ``swiglu_path`` where the CPU multiplies bf16 natively, ``threads_mm`` or
    ``few_gemm`` where it upcasts)."""
    from torch_moe._ops import grouped_swiglu as _gs

    busy = [g for g in groups if g >= 1]
    rows = -(-round(sum(busy)) // max(1, len(busy)))
    layout = _gs.MOE_BACKWARD if backward else _gs.MOE_FORWARD
    return _gs._whole_path(w.dtype, len(busy), rows, layout, threads)


def _upcast_pieces(w: MoEWorkload, groups: list[float], threads: int) -> bool:
    """Whether this CPU's whole-path grouped GEMMs run as the threaded kernel's upcast
    pieces (``grouped_mm.shares_upcast_groups``, the kernels' own decision at ``threads``)."""
    from torch_moe._ops import grouped_mm as _gm

    return _gm.shares_upcast_groups(w.dtype, _rows_per_busy_group(groups), threads)


def _dequantizes_pieces(w: MoEWorkload, groups: list[float], threads: int) -> bool:
    """Whether a recipe's scaled GEMMs on this CPU run their fp32 form by the native
    kernels' pieces (``scaled_grouped_mm.dequantizes_pieces``, the kernels' own decision
    at ``threads``; they write bf16 or fp32 outputs) where no bf16 route applies."""
    from torch_moe.quantization.scaled_grouped_mm import dequantizes_pieces

    if w.precision == "bf16" or w.dtype not in (torch.bfloat16, torch.float32):
        return False
    return dequantizes_pieces(_rows_per_busy_group(groups), threads)


def _upcast_piece_bytes(c: int, m: float, k: float, n: float, threads: int) -> float:
    """The fp32 copies the threads' upcast pieces of a grouped GEMM hold at once: each
    thread's piece (at most a group of ``m`` rows) converts its [m, k] operand (a weight
    gradient's [k, m]), then one block of the other operand's columns ([k, B] or [m, B],
    B = the kernel's block, ``upcast_cols()`` columns, or fewer) and the block's product
    ([m, B] or [k, B]) before rounding it into the output: c * (m*k + B*(k + m)) per
    thread, fresh tensors of the allocator's, freed with the piece; none of the
    allocator's where the pieces multiply by BLAS's sgemm_ in the threads' scratch
    (``upcast_in_scratch``: ATen's fp32 matmuls IEEE; the scratch, a few MiB a thread,
    stays with the thread, as oneDNN's and MKL's own buffers). Asked where the pieces
    run (the kernels built)."""
    from torch_moe._ops import grouped_mm as _gm

    kernels = _gm._threaded_kernels()
    if kernels.upcast_in_scratch():
        return 0.0
    cols = min(float(kernels.upcast_cols()), n)
    return threads * c * (m * k + cols * (k + m))


def _shared_upcast_bytes(w: MoEWorkload, c: int, threads: int) -> tuple[float, float]:
    """fp32 bytes a shared expert's GEMMs hold at once beside their operands and outputs
    where the CPU upcasts its half dtype (``c`` != the layer's bytes): (its gate / up
    projection's, forward or backward; its down projection's, backward). It runs each
    GEMM as one group of all T rows (``nn.modules.moe._dense``), so by the threaded
    kernel's upcast pieces (:func:`_upcast_piece_bytes`: none of the allocator's in the
    threads' scratch) where the kernels share that group out, else by the loop, whose
    GEMM converts both operands and computes the product in fp32: of [T, D] and [D, N]
    into [T, N] or, backward, the same three sizes in another order, N = 2Fs or Fs. Both
    0 without a shared expert or where the CPU multiplies the dtype as such."""
    from torch_moe._ops import grouped_mm as _gm

    Fs, T, D = float(w.shared_hidden_dim), float(w.tokens), float(w.dim)
    if not Fs or c == w.element_size:
        return 0.0, 0.0
    if _gm.shares_upcast_groups(w.dtype, w.tokens, threads):
        pieces = _upcast_piece_bytes
        return pieces(c, T, D, 2 * Fs, threads), pieces(c, T, Fs, D, threads)
    return c * (T * D + 2 * Fs * (D + T)), c * (T * D + Fs * (D + T))


def _rows_per_busy_group(groups: list[float]) -> int:
    """Rows per expert that has any, as the CPU kernels count them (floor of the mean)."""
    busy = [g for g in groups if g >= 1]
    return round(sum(busy)) // max(1, len(busy))


def _wgrad_copies(w: MoEWorkload, rows: int, k: int, n: int, whole: bool = False) -> bool:
    """Whether this CPU's weight-gradient kernels copy their [M, k] operand row-major
    (the same measured decision, ``torch_moe._ops.grouped_mm.wgrad_copies``); ``whole``:
    the whole-tensor path's, which copies nothing the allocator sees where the native
    threaded kernel copies piece by piece (into its threads' scratch, a group's block
    each: ``grouped_mm.copies_by_pieces``)."""
    from torch_moe._ops import grouped_mm as _gm

    copies = _gm.wgrad_copies(w.dtype, rows, k, n)
    return copies and not (whole and _gm.copies_by_pieces(w.dtype))


def _gemm_copies(
    w: MoEWorkload, c: int, a: tuple[int, int], wgrad_copy: bool | None, b: tuple[int, int]
) -> float:
    """Bytes a loop-path GEMM ``a @ b`` (row-major b) copies: a weight gradient's first
    operand made row-major (``wgrad_copy``; None: not a weight gradient, a row-major a),
    and the operand ``mm_into`` copies into the other layout."""
    from torch_moe._ops import grouped_mm as _gm

    if a[0] <= 0 or a[1] <= 0:
        return 0.0
    dtype = _gm.cpu_compute_dtype(w.dtype)
    a_cols = wgrad_copy is False  # a weight gradient's x^T view, unless copied
    made = a[0] * a[1] if wgrad_copy else 0
    return float(made + _gm.layout_copy_elems(dtype, a, a_cols, b, False)) * c


def _whole_loop_copy(
    w: MoEWorkload,
    c: int,
    groups: list[float],
    m: float,
    kn: tuple[int, int],
    a_cols: bool,
    wgrad: bool,
) -> float:
    """Bytes the whole path's grouped GEMM ``a @ b`` copies for its largest group (``m``
    rows) where the CPU kernel runs it by its per-group loop (``grouped_mm.whole_loops``,
    the kernels' own decisions on stand-ins of the operands' metadata: ``mm_into``'s
    layout copy of one group's operand); ``kn``: (K, N); ``wgrad``: a weight gradient
    (a [K, rows] column-major where ``a_cols``, b [rows, N]), else a [rows, K] x a
    row-major weight [K, N]."""
    from torch_moe._ops import grouped_mm as _gm

    ends = list(itertools.accumulate(max(0, round(g)) for g in groups))
    rows, group = (ends[-1] if ends else 0), round(m)
    if rows <= 0 or group <= 0:
        return 0.0
    k, n = kn
    if wgrad:
        shapes = ((k, rows), a_cols, (rows, n), False)
        group_shapes = ((k, group), a_cols, (group, n), False)
    else:
        shapes = ((rows, k), False, (k, n), False)
        group_shapes = ((group, k), False, (k, n), False)
    if not _gm.whole_loops(w.dtype, *shapes, ends, wgrad):
        return 0.0
    return float(_gm.layout_copy_elems(_gm.cpu_compute_dtype(w.dtype), *group_shapes)) * c


def _inference_bytes(
    w: MoEWorkload, groups: list[float], M: float, m: float, c: int, threads: int
) -> float:
    """The largest live set of ``MoE``'s inference forward on a CPU (no EP), above the
    weights (and a recipe's cached codes of them) and the input: the router's phase (its
    fp32 copy of x and the logits), the experts' (:func:`_inference_bf16_experts`,
    :func:`_inference_recipe_experts`), then the combine's (Y and the output [T, D]); the routing's indices
    and weights live throughout, and a shared expert's output from its own phase (run
    before the routed experts) to the final sum."""
    T, D, E, K = w.tokens, w.dim, w.num_experts, w.top_k
    b = w.element_size
    # the logits, the routing's ids and weights, its row maps, the token index and the
    # rows' weights: held by the layer's forward until it returns
    maps = T * E * 4 + M * (8 + 8 + 4) + T * K * (8 + 8 + 4) + E * 4
    router = T * D * 4 + T * E * 4
    if w.precision != "bf16":
        experts = _inference_recipe_experts(w, groups, M, m, threads)
    else:
        experts = _inference_bf16_experts(w, groups, M, m, c, threads)
    # Y, the output, and the combine's temporaries (unweighted: the routing weights went
    # into the experts)
    from torch_moe._ops.permute import combine_temporary_bytes

    combine = M * D * b + T * D * b + combine_temporary_bytes(T, D, w.dtype)
    shared = total = 0.0
    Fs = w.shared_hidden_dim
    if Fs:  # run before the experts; its output [T, D] lives to the final sum
        shared = T * 3 * Fs * b + T * D * b  # its gate/up output, silu and product, output
        # where the CPU upcasts: the gate / up projection's fp32 transients with its output
        # h (the layer's output counted in ``maps`` is not there yet)
        up = _shared_upcast_bytes(w, c, threads)[0]
        shared = max(shared, T * 2 * Fs * b + up - T * D * b)
        maps += T * D * b
        total = M * D * b + 2 * T * D * b  # Y, the routed output and the sum
    return max(router, shared, experts, combine, total) + maps


def _inference_bf16_experts(
    w: MoEWorkload, groups: list[float], M: float, m: float, c: int, threads: int
) -> float:
    """The bf16 experts' largest live set in :func:`_inference_bytes`: ``grouped_swiglu``
    gathering its rows from the tokens, on the whole path the gathered rows [M, D] with h
    [M, 2F], freed before A [M, F] and Y [M, D]; on the loop path h and Y with one group's
    gathered rows, activation buffer and fp32 chunk."""
    D, F, b = w.dim, w.hidden_dim, w.element_size
    whole = _swiglu_whole(w, groups, backward=False, threads=threads)
    r = min(m if not whole else M, _act_chunk_rows(w, threads))
    fp32 = _act_fp32_bytes(w, r, backward=False)  # one chunk's fp32 copy of h (ATen ops)
    # where the GEMMs upcast (c != b), each group's GEMM on the loop path converts its
    # operands (the rows and the expert's weight) and computes its product in c; the
    # whole path converts in registers where the native few-rows kernel runs the GEMMs,
    # in each thread's piece where the threaded kernel's upcast pieces do
    up1 = m * (D + 2 * F) * c + 2 * F * D * c if c != b and not whole else 0.0
    up2 = m * (F + D) * c + F * D * c if c != b and not whole else 0.0
    if c != b and whole and _upcast_pieces(w, groups, threads):  # the threads' pieces
        up1 = _upcast_piece_bytes(c, m, D, 2 * F, threads)
        up2 = _upcast_piece_bytes(c, m, F, D, threads)
    if whole:
        experts = max(
            M * (D + 2 * F) * b + up1,  # the first GEMM: the gathered rows and h
            M * 3 * F * b + fp32,  # the activation: h, A and one chunk
            M * (3 * F + D) * b + up2,  # the second GEMM: h, A and Y
        )
    else:
        # h and Y, the group-sized activation buffer, and one group's gathered rows (with
        # the first GEMM's upcast operands) or one chunk's fp32 activation, not at once
        experts = M * (2 * F + D) * b + m * F * c + max(m * D * b + up1, fp32, up2)
    return experts


def _scale_bytes(op: OperandQuant, rows: float, cols: float) -> float:
    """Bytes of the scales of a [rows, cols] operand quantized along its columns by
    ``op``: fp32 per (outer x inner) block (-1: the whole extent), MX's one byte per
    ``inner`` elements of a row."""
    if op.fmt == "mx":
        return rows * math.ceil(cols / op.inner)
    br = rows if op.outer == -1 else op.outer
    bc = cols if op.inner == -1 else op.inner
    return 4.0 * math.ceil(rows / max(br, 1)) * math.ceil(cols / max(bc, 1))


def weight_cache_bytes(w: MoEWorkload) -> float:
    """The expert weights' cached quantization in inference (``MoE`` with a recipe quantizes
    each weight once per version, ``quantize_fp8_cached`` / ``quantize_mx_cached``): the
    local experts' e4m3 codes and their scales, held while the weights are (on every
    device; an expert-parallel layer's chunks each cache their views' codes)."""
    if w.precision == "bf16" or w.backward:
        return 0.0
    from torch_moe.quantization import get_recipe

    rhs = get_recipe(w.precision).forward.rhs
    if rhs is None:
        return 0.0
    D, F, El = w.dim, w.hidden_dim, w.local_experts
    # w13 [El, 2F, D] and w2 [El, D, F], each quantized along its last dim
    return El * (3 * F * D + _scale_bytes(rhs, 2 * F, D) + _scale_bytes(rhs, D, F))


def _inference_recipe_experts(
    w: MoEWorkload, groups: list[float], M: float, m: float, threads: int
) -> float:
    """The largest live set of a recipe's experts in inference (``GroupedExperts.
    forward_tokens``; the cached weights' codes apart, :func:`weight_cache_bytes`): the
    activation's codes (``permute_quantize``: the tokens' codes, then the rows' gathered
    from them; with one scale per tensor the permuted rows [M, D], then their codes), the
    first scaled GEMM's phase with h [M, 2F] (the codes freed after it), the SwiGLU's
    (h, its bf16 output and that output's codes), the second GEMM's with Y [M, D]: each
    intermediate freed once consumed."""
    from torch_moe.quantization import get_recipe

    T, D, F, b = w.tokens, w.dim, w.hidden_dim, w.element_size
    g = get_recipe(w.precision).forward
    lhs, rhs = g.lhs, g.rhs
    if lhs is None or rhs is None:  # pragma: no cover (every recipe quantizes both)
        raise ValueError(f"no scaled forward for precision {w.precision!r}")
    kind = "mx" if lhs.fmt == "mx" else "fp8"
    kinds = (kind, kind + "_col")
    codes = _codes_bf16_here(w.precision, b)
    busy = float(sum(1 for n in groups if n > 0)) if groups else None
    s_x, s_a = _scale_bytes(lhs, M, D), _scale_bytes(lhs, M, F)
    if lhs.outer == 1:  # each token's codes once, then gathered into the rows
        quant_x = _quantize_bytes(kind, T * D) + _scale_bytes(lhs, T, D) + M * D + s_x
    else:
        quant_x = M * D * b + _quantize_bytes(kind, M * D) + s_x

    def gemm(K: float, N: float) -> float:  # above A's codes and scales
        if codes:
            return 2 * M * N + _codes_scale_bytes(lhs, rhs, M, w.local_experts, K, N)
        n_a, n_b = M * K, w.local_experts * K * N
        phase = _gemm_phase(
            kinds, n_a, n_b, M * N, b, True, rows=M, group_rows=m, quantized=False,
            busy=busy, pieces=_dequantizes_pieces(w, groups, threads),
        )  # fmt: skip
        return phase - n_a - n_b  # B's codes are the cache's, A's counted by the caller

    r = min(M, _act_chunk_rows(w, threads))
    act = M * 2 * F * b + M * F * b + _act_fp32_bytes(w, r, backward=False)
    act = max(act, M * 2 * F * b + M * F * b + _quantize_bytes(kind, M * F) + s_a)
    return max(
        quant_x,
        M * D + s_x + gemm(D, 2 * F),
        act,
        M * F + s_a + gemm(F, D),
    )


def _codes_scale_bytes(
    lhs: OperandQuant, rhs: OperandQuant, M: float, E: int, K: float, N: float
) -> float:
    """The scales an FP8 GEMM on the codes in bf16 lays out for its kernel
    (``scaled_grouped_mm._scaled_blocks_mm``): A's per row and k block (a copy where they
    are not [M, blocks] already: per tensor, or constant along K in several of the GEMM's
    blocks), B's per column and k block padded to panels of 64 columns, and before that,
    for blocks of several columns, B's repeated per column."""
    from torch_moe.quantization.scaled_grouped_mm import _k_blocks

    constant = (lhs.inner == -1 or K <= lhs.inner) and (rhs.inner == -1 or K <= rhs.inner)
    ks = _k_blocks(round(K))[1] if constant else math.ceil(K / lhs.inner)
    rows = M * ks * 4 if lhs.outer == -1 or (constant and ks > 1) else 0.0
    bn = rhs.outer
    repeated = E * ks * math.ceil(N / bn) * bn * 4 if bn not in (-1, 1) else 0.0
    return rows + repeated + E * ks * math.ceil(N / 64) * 64 * 4


def memory(
    w: MoEWorkload,
    hw: Hardware,
    local_rows: float,
    rows_recv: float,
    groups: list[float],
    threads: int = 1,
) -> dict[str, float]:
    """Bytes per rank (keys: weights, grads, optimizer, activations, comm_buffers, peak,
    peak_step); see the module docstring."""
    T, D, F = w.tokens, w.dim, w.hidden_dim
    El = w.local_experts
    b = w.element_size
    cpu = hw.kind == "cpu"
    if cpu:
        from torch_moe._ops.grouped_mm import cpu_compute_dtype

        c = torch.empty((), dtype=cpu_compute_dtype(w.dtype)).element_size()
    else:
        c = b
    n_params, weights = _params(w)
    grads = weights if w.backward else 0.0
    optimizer = n_params * (8 if w.dtype == torch.float32 else 12) if w.backward else 0.0
    saved = saved_bytes(w, hw, rows_recv)
    align = _align(w, hw)
    M = float(_static_rows(w, align)) if w.ep == 1 else float(rows_recv)
    comm = 0.0
    a2a = w.exchange == "all_to_all"
    if w.ep > 1:  # send and receive buffers of the dispatch (rows + fp32 weights)
        row = D * (1 if w.dispatch_dtype is not None else b) + 4
        comm = (local_rows + rows_recv) * row
    # EP with C chunks: the experts' backward runs chunk by chunk, each over about N / C
    # received rows (its output gradient, dX and the whole path's buffers); the chunks'
    # weight gradients add up to all local experts' by the last one (``split_weights``)
    Mc = M / w.num_chunks if w.ep > 1 else M
    lam_max = max(groups) if groups else 0.0
    m = lam_max + math.sqrt(max(lam_max, 0.0)) * expected_max_normal(max(1, len(groups)))
    m = min(m, Mc)
    y = T * D * b
    resident = weights + T * D * b * (2 if w.backward else 1)  # x (+ its output gradient)
    if not w.backward:
        cache = weight_cache_bytes(w)
        if cpu and w.ep == 1:  # measured phases (comm is 0)
            dyn = _inference_bytes(w, groups, M, m, c, threads)
        else:
            # forward only: the permuted rows, h and y of the experts, and the combine
            act = M * (D + 2 * F + D) * b + m * (2 * F * 4 + F * 4 + F * c)
            if w.precision != "bf16":
                q = _operand_kinds(w.precision, cpu)
                pieces = cpu and _dequantizes_pieces(w, groups, threads)
                fwd1 = _gemm_phase(
                    q["forward"], M * D, El * D * 2 * F, M * 2 * F, b, cpu, rows=M,
                    group_rows=m, codes=cpu and _codes_bf16_here(w.precision, b),
                    pieces=pieces,
                )  # fmt: skip
                fwd2 = _gemm_phase(
                    q["forward"], M * F, El * F * D, M * D, b, cpu, rows=M, group_rows=m,
                    codes=cpu and _codes_bf16_here(w.precision, b), pieces=pieces,
                )  # fmt: skip
                act = M * D * b + max(fwd1, M * 3 * F * b + fwd2)
            dyn = act + T * D * (4 + b) + y + comm
        peak = resident + cache + dyn
        return dict(
            weights=weights,
            grads=0.0,
            optimizer=0.0,
            activations=0.0,
            comm_buffers=comm,
            weight_cache=cache,
            peak=peak,
            peak_step=peak,
        )
    # the router saves the input x itself (``T*D*b`` of ``saved``): the caller's tensor,
    # counted in ``resident``, not a new allocation of the step
    held = saved - T * D * b
    # the routed experts' backward runs before the shared expert's (module docstring): its
    # saved tensors are in ``held``, its weight gradients come later
    base = held + y + Mc * D * b
    experts_saved = rows_recv * (_expert_row_bytes(w) + 4)  # as in saved_bytes
    # the phases outside the routed experts' backward: the shared expert's (the routed
    # experts' saved tensors freed, their weight gradients live), the exchanges'
    expert_grads = float(El * 3 * F * D * b)  # the local experts' weight gradients
    side_phase = held + y
    if w.shared_hidden_dim:
        # its largest set: at the product's backward, its four saved [T, Fs]-rows and two
        # gradients [T, Fs] (of silu(gate) and of up), the down projection's weight
        # gradient (its gate/up's comes once those are freed)
        Fs = w.shared_hidden_dim
        side_phase = held - experts_saved + y + expert_grads + Fs * D * b + 2 * T * Fs * b
        # where the CPU upcasts, its GEMMs' fp32 transients: the down projection's (dA
        # [T, Fs] and dW2 its outputs), then the gate / up projection's (its saved [T,
        # Fs]-rows freed; dH [T, 2Fs], dX [T, D] and dW13 [2Fs, D])
        up13, up2 = _shared_upcast_bytes(w, c, threads)
        if up2 or up13:
            rest = held - experts_saved + y + expert_grads + Fs * D * b
            side_phase = max(
                side_phase,
                rest + T * Fs * b + up2,
                rest - 4 * T * Fs * b + 2 * T * Fs * b + T * D * b + 2 * Fs * D * b + up13,
            )
    if w.ep > 1:
        # the exchanges' backward is a phase of its own: the combine backward holds the
        # local rows' gradient and the received one (the dispatch backward the same pair
        # the other way); all_to_all adds a source-major copy and the collective's output
        # of each (the p2p segments land in place). The received rows the experts use are
        # in ``saved``; no send buffer outlives its exchange.
        side_phase = max(side_phase, held + y + comm * (2 if a2a else 1))
    # with C chunks the backward runs the last chunk first, and in each chunk's backward
    # the chunks run before it have their weight gradients live (the split's backward
    # keeps them for its concatenation), and so has, until the last chunk to run, this
    # rank's permuted rows' gradient [M_local, D] that every chunk's combine backward
    # reads: ``before`` entering a chunk's backward, ``with_own`` once it has its own
    # (both at the worst chunk: the last to run, or the one before it)
    before, with_own = 0.0, expert_grads
    if w.ep > 1 and w.num_chunks > 1:
        C, rows_grad = w.num_chunks, local_rows * D * b
        before = max((C - 2) / C * expert_grads + rows_grad, (C - 1) / C * expert_grads)
        with_own = max((C - 1) / C * expert_grads + rows_grad, expert_grads)
    if w.precision == "bf16" and cpu and _swiglu_whole(w, groups, backward=True, threads=threads):
        # the whole-tensor path: dA, A and dH over all M rows in the layer dtype, the
        # activation's fp32 temporaries one chunk at a time; then dW2, dX, dW13, the
        # weight gradients' first operands (dY [M, D], dH [M, 2F]) copied row-major
        # first where this CPU's kernels do (a measured decision)
        r = min(Mc, _act_chunk_rows(w, threads))
        act = base + before + 4 * Mc * F * b + _act_fp32_bytes(w, r)
        per_group = _rows_per_busy_group(groups)
        copy2 = Mc * D * b if _wgrad_copies(w, per_group, D, F, whole=True) else 0.0
        copy13 = Mc * 2 * F * b if _wgrad_copies(w, per_group, 2 * F, D, whole=True) else 0.0
        # dW2 with A and dH live; then (A freed) dW13 with the input rows [M, D] gathered
        # again where the experts gather from the tokens; then (those freed) dX
        gather = Mc * D * b if _gathered(w) else 0.0
        # where the GEMMs upcast: by the few-rows kernel's whole path, each group's weight
        # gradient converts its two operands and computes its product [K, N] in c; by
        # the threads' upcast pieces, each thread's piece its own (dX's too)
        up2 = (m * (D + F) + D * F) * c if c != b else 0.0
        up13 = (m * (2 * F + D) + 2 * F * D) * c if c != b else 0.0
        up_dx = 0.0
        if c != b and _upcast_pieces(w, groups, threads):  # the threads' upcast pieces
            up2 = _upcast_piece_bytes(c, m, D, F, threads)
            # dW13 (dH^T [2F, m] @ x [m, D]) and dX (dH [m, 2F] @ w13 [2F, D]): alike
            up13 = up_dx = _upcast_piece_bytes(c, m, 2 * F, D, threads)
        # and where a GEMM takes the per-group loop (its measured ways, or forced), the
        # largest group's operand copied into the other layout (``mm_into``)
        chunk = [g * Mc / M for g in groups] if M else groups
        dw2 = 3 * Mc * F * b + copy2 + up2
        dw2 += _whole_loop_copy(w, c, chunk, m, (D, F), not copy2, True)
        dw13 = 2 * Mc * F * b + gather + copy13 + up13
        dw13 += _whole_loop_copy(w, c, chunk, m, (2 * F, D), not copy13, True)
        dx = (
            2 * Mc * F * b
            + Mc * D * b
            + up_dx
            + _whole_loop_copy(w, c, chunk, m, (2 * F, D), False, False)
        )
        # the kernel allocates each weight gradient as it computes it: at dW2, this
        # chunk's dW13 (2/3 of its experts' gradients) is not yet there (measured at T=1024
        # D=128 F=512 E=16: the model with it was 1.5 MiB, 6.7%, over the peak)
        own = expert_grads / w.num_chunks if w.ep > 1 else expert_grads
        gemms = base + max(with_own - 2 * own / 3 + dw2, with_own + max(dw13, dx))
        dyn = max(act, gemms, side_phase)
    elif w.precision == "bf16" and cpu:
        r = min(m, _act_chunk_rows(w, threads))
        phase = base + Mc * D * b + with_own  # dX and the expert weight gradients
        phase += m * F * c * 2 + m * 2 * F * c + _act_fp32_bytes(w, r)
        if _gathered(w):  # the group's input rows, gathered again for its dW13
            phase += m * D * b
        # the largest group's dY [m, D] or dH [m, 2F] copied row-major for a weight
        # gradient, where this CPU's kernels do, and an operand of each GEMM copied into
        # the other layout where they measured that faster (``mm_into``); the
        # activation's temporaries are gone
        rows = round(m)
        copies = [
            _gemm_copies(w, c, (D, rows), _wgrad_copies(w, rows, D, F), (rows, F)),  # dW2
            _gemm_copies(w, c, (rows, 2 * F), None, (2 * F, D)),  # dX
            _gemm_copies(w, c, (2 * F, rows), _wgrad_copies(w, rows, 2 * F, D), (rows, D)),  # dW13
        ]
        dyn = max(phase - _act_fp32_bytes(w, r) + max(copies), phase, side_phase)
    else:
        pieces = cpu and _dequantizes_pieces(w, groups, threads)
        dyn = max(_whole_tensor_phases(w, cpu, Mc, base, c, m, threads, pieces), side_phase)
    if cpu and w.ep == 1:
        # after the routed experts' backward (their weight gradients live), the rows'
        # input gradient dX [M, D] summed into the tokens' [T, D] by ``unpermute``'s kernel
        # (its fp32 chunk temporaries where the native combine does not run: the peak
        # there, 18-20% above the model's other phases at T=1024 D=256 F=128 E=16 K=2,
        # with a shared expert or not). bf16 experts do it in their fused node's
        # backward, their saved tensors and the rows' output gradient still live; a
        # recipe's experts are a node of their own, done by then
        from torch_moe._ops.permute import combine_temporary_bytes

        combine = expert_grads + M * D * b + T * D * b + combine_temporary_bytes(T, D, w.dtype)
        live = base if w.precision == "bf16" else held - experts_saved + y
        dyn = max(dyn, live + combine)
    if w.ep > 1 and w.num_chunks > 1:
        # after the last chunk, each weight's split backward (``split_weights``)
        # concatenates its chunks' gradients: the chunks' and the concatenation are live
        # at once (w13's, the larger, with w2's already whole: 5*F*D*b per local expert),
        # the experts' saved tensors freed, this rank's permuted rows' gradient live
        cat = held - experts_saved + y
        cat += local_rows * D * b + El * 5 * F * D * b
        dyn = max(dyn, cat)
    peak = resident + dyn
    return dict(
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        activations=saved,
        comm_buffers=comm,
        weight_cache=0.0,
        peak=peak,
        peak_step=peak + optimizer,
    )
