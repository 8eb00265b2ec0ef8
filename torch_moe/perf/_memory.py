"""Memory of one MoE layer step on one rank: weights, gradients, optimizer states, saved
activations, communication buffers, and the peak of a forward + backward.

Legend: T tokens of the rank, D dim, F hidden dim, Fs shared hidden dim, E experts,
El local experts, K top-k, M permuted rows (T*K dropless, the static bound with a
capacity or an alignment), N rows the local experts receive (EP), b bytes per element
of the layer dtype, c of the CPU GEMM compute dtype (b, or 4 where bf16 is upcast), m the
rows of the largest expert group, r the rows of one SwiGLU-backward chunk
(``min(m, 2**17 / F)`` on a CPU).

Saved for the backward (``torch_moe.nn.MoE``'s documented formula, extended):

* dropless, no alignment: ``T * (D*b + E*4) + T*K*(8 + 4 + 16 + (D + 2F)*b) + E*4``;
* with a capacity or an alignment (static M rows): ``T * (D*b + E*4 + K*16) + M * (D*b +
  2F*b + 8 + 8 + 1 + 4) + 8 + E*4`` (the row map, its clamped copy, the padding mask and
  the per-row weight over M rows);
* a recipe also saves the activation ``a`` [M, F] (``M*F*b``);
* a shared expert saves ``T * 4*Fs*b`` (its gate/up output, silu(gate) and the product);
  its backward runs before the routed experts' (so those are freed by then, and its
  weight gradients ``3*Fs*D*b`` are live);
* EP: the experts' tensors are over the N received rows, plus the received routing
  weights (``N*4``).

Peak of forward + backward (the largest live set, weights, input and output gradient
included): the layer's backward visits unpermute, the experts, permute, the router; the
experts' backward holds the most:

* bf16 on a CPU (``grouped_swiglu_backward``, group by group): the saved tensors, the
  output [T, D], the permuted gradient and dX [M, D] each, the expert weight gradients,
  the largest group's ``grad_a``, ``a`` [m, F] and ``dH`` [m, 2F] in c, and one chunk's
  fp32 temporaries (``r*2F*4 + 6*r*F*4``);
* recipes on a CPU and every path on a GPU (whole-tensor ops): the largest of the phases
  dgrad / wgrad of the second GEMM, the SwiGLU backward (``M*2F*4 + 6*M*F*4`` of fp32
  temporaries), dgrad / wgrad of the first GEMM; with the emulation each GEMM's operands
  dequantized to fp32 (weights included: ``El*2F*D*4``) and its fp32 output.

The expected largest group is ``lam_max + sqrt(lam_max) * z_E`` rows (``z_E`` the expected
maximum of E standard normals: the multinomial noise of the routing).

Optimizer: Adam, two fp32 moments per parameter, plus an fp32 master copy when the
parameters are not fp32 (12 or 8 bytes per parameter).
"""

from __future__ import annotations

import functools
import math

import torch

from torch_moe.perf._hardware import Hardware
from torch_moe.perf._workload import MoEWorkload

__all__ = ["memory", "saved_bytes"]

_CHUNK = 2**17


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


def saved_bytes(w: MoEWorkload, hw: Hardware, rows_recv: float | None = None) -> float:
    """Bytes saved for the backward by one forward (see the module docstring)."""
    if not w.backward:
        return 0.0
    T, D, F, E, K = w.tokens, w.dim, w.hidden_dim, w.num_experts, w.top_k
    b = w.element_size
    align = _align(w, hw)
    recipe = w.precision != "bf16"
    per_row = (D + 2 * F + (F if recipe else 0)) * b
    total = float(T * (D * b + E * 4) + E * 4)
    if w.ep > 1:
        n = rows_recv if rows_recv is not None else T * K
        total += T * K * (8 + 4 + 16) + n * (per_row + 4)
    elif w.capacity is None and align == 1:
        total += T * K * (8 + 4 + 16 + per_row)
    else:
        m = _static_rows(w, align)
        total += T * K * 16 + m * (per_row + 8 + 8 + 1 + 4) + 8
    total += T * 4 * w.shared_hidden_dim * b
    return float(total)


def _params(w: MoEWorkload) -> tuple[float, float]:
    """(parameters of this rank, bytes)."""
    D, F = w.dim, w.hidden_dim
    n = w.num_experts * D + w.local_experts * 3 * F * D + 3 * w.shared_hidden_dim * D
    return float(n), float(n * w.element_size)


def memory(
    w: MoEWorkload, hw: Hardware, local_rows: float, rows_recv: float, groups: list[float]
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
    M_local = float(_static_rows(w, align))
    comm = 0.0
    if w.ep > 1:  # send and receive buffers of the dispatch (rows + fp32 weights)
        row = D * (1 if w.dispatch_dtype is not None else b) + 4
        comm = (local_rows + rows_recv) * row
    lam_max = max(groups) if groups else 0.0
    m = lam_max + math.sqrt(max(lam_max, 0.0)) * expected_max_normal(max(1, len(groups)))
    m = min(m, M)
    y = T * D * b
    resident = weights + T * D * b * (2 if w.backward else 1)  # x (+ its output gradient)
    shared_grads = 3 * w.shared_hidden_dim * D * b if w.backward else 0.0
    expert_w = El * 3 * F * D * b
    if not w.backward:
        # forward only: the permuted rows, h and y of the experts, and the combine
        act = M * (D + 2 * F + D) * b + m * (2 * F * 4 + F * 4 + F * c)
        if w.precision != "bf16" and cpu:
            act = M * (D + 2 * F + F + D) * b + max(
                M * D * 4 + El * 2 * F * D * 5 + M * 2 * F * 4,
                M * F * 4 + El * F * D * 5 + M * D * 4,
            )
        dyn = act + T * D * (4 + b) + y + comm
        peak = resident + dyn
        return dict(
            weights=weights,
            grads=0.0,
            optimizer=0.0,
            activations=0.0,
            comm_buffers=comm,
            peak=peak,
            peak_step=peak,
        )
    # the shared expert's backward runs first (autograd's order): its saved tensors are
    # freed and its weight gradients live when the routed experts' backward starts
    shared_saved = T * 4 * w.shared_hidden_dim * b
    base = saved - shared_saved + y + M * D * b + shared_grads + comm
    shared_phase = saved + y + shared_grads + T * 4 * w.shared_hidden_dim * b + comm
    if w.precision == "bf16" and cpu:
        r = min(m, max(1.0, _CHUNK / F))
        phase = base + M * D * b + El * 3 * F * D * b  # dX and the expert weight gradients
        phase += m * F * c * 2 + m * 2 * F * c + r * 2 * F * 4 + 6 * r * F * 4
        dyn = max(phase, shared_phase)
    else:
        q = 5.0 if cpu and w.precision != "bf16" else 0.0  # fp32 dequantized + e4m3 copy
        recipe = w.precision != "bf16"
        w2, w13 = El * D * F, El * 2 * F * D
        a_saved = M * F * b if recipe else 0.0
        phases = []
        # dgrad of the second GEMM: dY and W2 dequantized, fp32 output, cast
        phases.append(base + q * (M * D + w2) + M * F * (4 + b) * (1 if cpu else 0) + M * F * b)
        # wgrad of the second GEMM: a and dY dequantized, fp32 dW2, cast, accumulate copy
        phases.append(base + M * F * b + q * (M * F + M * D) + w2 * (4 * (q > 0) + 2 * b))
        # the SwiGLU backward over all M rows
        phases.append(base + w2 * b + M * F * b + M * 3 * F * b + M * 2 * F * 4 + 6 * M * F * 4)
        # dgrad and wgrad of the first GEMM (the second GEMM's saved a is freed)
        after = base - a_saved + w2 * b + M * 2 * F * b
        phases.append(after + q * (M * 2 * F + w13) + M * D * (4 * (q > 0) + b))
        phases.append(after + M * D * b + q * (M * D + M * 2 * F) + w13 * (4 * (q > 0) + 2 * b))
        dyn = max(*phases, shared_phase)
        if not cpu:
            dyn = max(dyn, base + M * D * b + expert_w)
    _ = M_local
    peak = resident + dyn
    return dict(
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        activations=saved,
        comm_buffers=comm,
        peak=peak,
        peak_step=peak + optimizer,
    )
