"""``torch_moe::fused_experts``: the experts of a decode-sized batch in two fused kernels.

Legend: T tokens, K top-k, E experts, D model dim, F expert hidden dim, M padded rows.

``fused_experts(x [T, D], w13 [E, 2F, D], w2 [E, D, F], row_to_slot [M], offs [E],
row_weights [M], top_k, block_m) -> y [M, D]`` computes, for every row r of the
expert-sorted buffer that ``permute_indices(align=block_m)`` describes,

    y[r] = (silu(x[t] W1[e]^T) * (x[t] W3[e]^T) * row_weights[r]) W2[e]^T,   t = row_to_slot[r] // K

with padding rows (``row_to_slot == -1``) zero: the values of ``grouped_swiglu`` with
``gather_index``. Inference only (no autograd formula).

On CUDA it runs the Triton kernels of :mod:`torch_moe._triton.moe_decode` (the gather in
the first GEMM's loads, SwiGLU and the routing weight in its epilogue, tiles chosen by
T*K; every group must be a multiple of ``block_m`` rows, the tile height those kernels
use for T*K rows: :func:`decode_block_m`). Elsewhere it runs ``grouped_swiglu``, the
reference. ``block_m`` is an argument so that the caller's permutation and the kernel's
tiles provably agree (the CUDA kernel checks it).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["DECODE_MAX_ROWS", "decode_block_m"]

# The largest T*K the layer sends to the fused kernels when asked to
# (GroupedExperts.fused_decode); larger batches use the grouped GEMMs. A bound by
# reasoning (decode and short prefill), to be set from bench_moe_decode.py on a GPU.
DECODE_MAX_ROWS = 1024


def decode_block_m(rows: int, device: torch.device) -> int:
    """Rows per expert group (``permute_indices(align=)``) that the fused kernels need for
    ``rows`` = T*K routed rows on ``device``."""
    if device.type != "cuda":
        return 1
    from torch_moe._triton.moe_decode import config_for

    return config_for(rows).block_m


def _check(x: Tensor, row_to_slot: Tensor, row_weights: Tensor, top_k: int, block_m: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"fused_experts: x must be [T, D], got {tuple(x.shape)}")
    if top_k < 1 or block_m < 1:
        raise ValueError(f"fused_experts: top_k and block_m must be >= 1, got {top_k}, {block_m}")
    if row_weights.shape != row_to_slot.shape:
        raise ValueError(
            f"fused_experts: row_weights {tuple(row_weights.shape)} must match row_to_slot "
            f"{tuple(row_to_slot.shape)}"
        )


@torch.library.custom_op("torch_moe::fused_experts", mutates_args=())
def fused_experts(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    row_to_slot: Tensor,
    offs: Tensor,
    row_weights: Tensor,
    top_k: int,
    block_m: int,
) -> Tensor:
    _check(x, row_to_slot, row_weights, top_k, block_m)
    tokens = torch.div(row_to_slot, top_k, rounding_mode="floor")  # -1 stays -1
    y, _h = torch.ops.torch_moe.grouped_swiglu(x, w13, w2, offs, row_weights, tokens)
    return y


@fused_experts.register_kernel("cuda")
def _(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    row_to_slot: Tensor,
    offs: Tensor,
    row_weights: Tensor,
    top_k: int,
    block_m: int,
) -> Tensor:
    from torch_moe._triton import moe_decode as MD

    _check(x, row_to_slot, row_weights, top_k, block_m)
    cfg = MD.config_for(x.shape[0] * top_k)
    if cfg.block_m != block_m:
        raise ValueError(
            f"fused_experts: block_m={block_m} but the kernels' tiles for T*K="
            f"{x.shape[0] * top_k} rows are {cfg.block_m} high (use decode_block_m)"
        )
    return MD.moe_decode(x, w13, w2, row_to_slot, offs, row_weights, top_k, config=cfg)


@fused_experts.register_fake
def _(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    row_to_slot: Tensor,
    offs: Tensor,
    row_weights: Tensor,
    top_k: int,
    block_m: int,
) -> Tensor:
    _check(x, row_to_slot, row_weights, top_k, block_m)
    return x.new_empty((row_to_slot.shape[0], x.shape[1]))
