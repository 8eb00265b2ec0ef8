"""Functional MoE API (mirrors ``torch.nn.functional``).

Legend: M permuted rows, D model dim, F expert hidden dim, E experts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torch_moe._ops import glu as _glu
from torch_moe._ops import grouped_swiglu as _swiglu
from torch_moe._ops import routing as _routing
from torch_moe._ops._dtypes import acc_dtype

__all__ = [
    "ACTIVATIONS",
    "glu_activation",
    "grouped_swiglu",
    "router_z_loss",
    "sequence_aux_loss",
    "switch_aux_loss",
]

ACTIVATIONS = _glu.ACTIVATIONS  # the experts' activations (``MoE(activation=...)``)
check_activation = _glu.check_activation


def grouped_swiglu(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    offs: Tensor,
    row_weights: Tensor | None = None,
    *,
    row_to_slot: Tensor | None = None,
    slot_to_row: Tensor | None = None,
) -> Tensor:
    r"""SwiGLU expert MLP over expert-sorted rows.

    ``y[rows of e] = (silu(x W_gate^T) * (x W_up^T)) W_down^T`` with the weights of expert e.

    Args:
        x: [M, D] permuted tokens (rows of expert e are ``offs[e-1]:offs[e]``), or with
            ``row_to_slot`` and ``slot_to_row`` the tokens [T, D] themselves.
        w13: [E, 2F, D] gate rows first, then up rows (HF ``gate_up_proj``).
        w2: [E, D, F] down projection (HF ``down_proj``).
        offs: [E] int32 group ends; rows at or past ``offs[-1]`` give zero.
        row_weights: optional [M] per-row output scale (the routing weight of each
            permuted row). Folding the combine weights in here means neither this op
            nor :func:`torch_moe.ops.unpermute` has to save the [M, D] expert output:
            their gradient is ``<dY @ W2, a>``, from tensors the backward has anyway.
        row_to_slot, slot_to_row: the permutation of :func:`torch_moe.ops.permute_indices`
            ([M] and [T, K]): the op runs on ``permute(x, row_to_slot, slot_to_row)``
            without materializing it (each group's rows are gathered from x in the
            forward and again in the backward), and x's gradient is that permute's
            backward. The same values, bit for bit, as permuting first; the [M, D]
            permuted input is neither allocated nor saved.

    Gate and up are one GEMM. The backward keeps only ``x`` and the [M, 2F]
    pre-activation and recomputes the activation. Differentiable in x, w13, w2 and
    row_weights.
    """
    y, _h = _swiglu.grouped_swiglu(x, w13, w2, offs, row_weights, None, row_to_slot, slot_to_row)
    return y


def glu_activation(
    h: Tensor,
    row_weights: Tensor | None = None,
    *,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float | None = None,
    interleaved: bool = False,
) -> Tensor:
    r"""The experts' activation of the up projection ``h`` [M, 2F] (gated) -> [M, F].

    ``"swiglu"``: ``silu(gate) * up``. ``"swigluoai"`` (GPT-OSS, MiniMax-M3):
    ``gate * sigmoid(alpha * gate) * (up + 1)``. ``"relu2"`` (Nemotron-H) is ungated:
    ``relu(h) ** 2`` of h [M, F] (no gate, no ``limit``). With ``limit``, ``gate`` is first clamped
    above at ``limit`` and ``up`` to ``[-limit, limit]`` (GPT-OSS: 7; DeepSeek-V4, GLM-5
    and HY-V4 clamp their SwiGLU alike). ``gate`` and ``up`` are h's two halves (gate
    columns first), or with ``interleaved=True`` its even and odd columns (GPT-OSS's
    ``gate_up_proj``). Times ``row_weights`` [M] when given (the routing weight of each
    row, folded in as ``grouped_swiglu`` does). Math in fp32 (fp64 for fp64 h), one
    rounding into h's dtype. The op ``torch_moe::glu``: differentiable in h and
    row_weights, its backward keeps only h (and the weights) and recomputes the rest by
    formula (on CPU in row chunks), so no fp32 temporary outlives it.
    """
    return _glu.glu(h, row_weights, activation, alpha, limit, interleaved)


def _check_loss_inputs(
    name: str, logits: Tensor, top_k: int | None = None, score_func: str | None = None
) -> None:
    """The load-balancing losses' checks: logits [T, E] of a floating dtype, a positive
    integer top_k, a known score_func (each named, with its value, in the message)."""
    _routing.check_logits(name, logits)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"{name}: top_k must be a positive integer, got {top_k!r}")
    if score_func is not None and score_func not in _routing.SCORE_FUNCS:
        raise ValueError(
            f"{name}: unknown score_func {score_func!r}; expected one of {_routing.SCORE_FUNCS}"
        )


def _router_probs(logits: Tensor, score_func: str) -> Tensor:
    """Router probabilities over all E experts (sigmoid scores are normalized per token)."""
    logits = logits.to(acc_dtype(logits.dtype))
    if score_func in _routing.SIGMOID_SCORES:
        scores = torch.sigmoid(logits)
        return scores / scores.sum(-1, keepdim=True)
    return torch.softmax(logits, dim=-1)


def switch_aux_loss(
    logits: Tensor, tokens_per_expert: Tensor, top_k: int, *, score_func: str = "softmax"
) -> Tensor:
    r"""Switch Transformer / GShard load-balancing loss ``E * sum_e f_e * P_e``.

    ``f_e = tokens_per_expert[e] / (T * K)`` is the fraction of routed assignments and
    ``P_e`` the mean router probability of expert e; the loss is 1.0 when both are
    uniform. Differentiable in ``logits`` [T, E] (f is a count). fp32.
    """
    _check_loss_inputs("switch_aux_loss", logits, top_k, score_func)
    num_tokens, num_experts = logits.shape
    if tokens_per_expert.shape != (num_experts,):
        raise ValueError(
            f"switch_aux_loss: expected tokens_per_expert of shape [{num_experts}] (E of the "
            f"logits), got {list(tokens_per_expert.shape)}"
        )
    if num_tokens == 0:
        return logits.new_zeros((), dtype=torch.float32)
    frac = tokens_per_expert.to(torch.float32) / (num_tokens * top_k)
    return num_experts * (frac * _router_probs(logits, score_func).mean(0)).sum()


def sequence_aux_loss(
    logits: Tensor, expert_ids: Tensor, top_k: int, seq_len: int, *, score_func: str = "sigmoid"
) -> Tensor:
    r"""DeepSeek-V3's sequence-wise balance loss (without its alpha), averaged over sequences.

    Tokens are ``[B * seq_len]`` rows of ``logits`` [T, E]; per sequence
    ``f_i = E / (K * S) * #{t : i in topk(t)}``, ``P_i = mean_t s'_{t,i}`` with ``s'`` the
    scores normalized over experts, loss ``sum_i f_i * P_i`` (1.0 when balanced).
    """
    _check_loss_inputs("sequence_aux_loss", logits, top_k, score_func)
    num_tokens, num_experts = logits.shape
    if expert_ids.shape != (num_tokens, top_k):
        raise ValueError(
            f"sequence_aux_loss: expected expert_ids of shape [{num_tokens}, {top_k}] "
            f"([T, top_k]), got {list(expert_ids.shape)}"
        )
    if num_tokens == 0:
        return logits.new_zeros((), dtype=torch.float32)
    if seq_len < 1 or num_tokens % seq_len != 0:
        raise ValueError(
            f"sequence_aux_loss: T ({num_tokens}) must be a multiple of seq_len ({seq_len})"
        )
    batch = num_tokens // seq_len
    probs_BSE = _router_probs(logits, score_func).view(batch, seq_len, num_experts)
    ids = expert_ids.reshape(batch, seq_len * top_k)
    counts_BE = torch.zeros(batch, num_experts, dtype=torch.float32, device=logits.device)
    counts_BE.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    frac_BE = counts_BE * (num_experts / (top_k * seq_len))
    return (frac_BE * probs_BSE.mean(1)).sum(1).mean()


def router_z_loss(logits: Tensor) -> Tensor:
    r"""ST-MoE router z-loss ``mean_t logsumexp(logits_t)^2`` (fp32): keeps logits small."""
    _check_loss_inputs("router_z_loss", logits)
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    lf = logits.to(acc_dtype(logits.dtype))
    return torch.logsumexp(lf, dim=-1).square().mean()
