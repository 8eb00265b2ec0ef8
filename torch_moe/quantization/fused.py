"""Quantization fused into its producer: the ops ``torch_moe._inductor``'s passes rewrite
``quantize(permute(x))`` and ``quantize(swiglu(h))`` into.

Legend: T tokens, K top-k, D / C columns, M expert-sorted rows, E experts.

* ``torch_moe::permute_quantize(x, row_to_slot, slot_to_row, fmt, block, scale_rule)``
  equals ``quantize(permute(x, row_to_slot, slot_to_row))`` with blocks along the rows
  (FP8 ``(1, block)``, MX ``1 x block``; ``block=-1``: the whole row), bit for bit. A
  row-local quantization commutes with the row gather, so the T token rows are quantized
  once and their e4m3 bytes and scales gathered: K times less quantize work than
  quantizing the M = T*K permuted rows, and the high-precision [M, D] permuted input is
  never materialized (padding rows get zeros and the all-zero block's scale).
* ``torch_moe::permute_quantize_jagged(x, row_to_slot, slot_to_row, offs, block, fmt,
  scale_rule)`` equals ``quantize_jagged(permute(x, ...), offs, ...)`` (the wgrad operand:
  blocks along M inside each expert); the permuted rows are a temporary of the kernel,
  so the graph saves the e4m3 result, not the high-precision rows.
* ``torch_moe::swiglu_quantize(h, row_weights, fmt, block, scale_rule)`` and
  ``torch_moe::swiglu_quantize_jagged(h, row_weights, offs, block, fmt, scale_rule)``
  equal ``quantize(swiglu(h, row_weights))`` for the second expert GEMM's forward (rows)
  and wgrad (jagged) operands: the [M, F] activation is a temporary of the kernel.
* ``torch_moe::quantize_fp8_cached(source, x, block)`` and ``quantize_mx_cached(source, x,
  dim, block, scale_rule)`` equal ``quantize_fp8(x, block)`` / ``quantize_mx(x, ...)`` for an
  ``x`` computed from ``source`` (an expert weight, through views and casts): the result
  is cached per ``source`` tensor and recomputed only when ``source``'s version counter
  moves (an optimizer step, a ``load_state_dict``, any in-place write), so with gradient
  accumulation a weight is quantized once per step, not once per micro-batch and GEMM,
  or when ``source`` holds another storage (``p.data = ...``, ``module.to(dtype)``:
  the parameter's version counter stays where it was). A write through ``p.data``
  (``p.data.copy_(...)``) bypasses the version counter, as it does autograd's checks:
  call ``clear_weight_cache()`` after one. The cache holds weak references to the
  sources and their storages (an entry dies with its weight, holds no old storage) and
  ``clear_weight_cache()`` empties it.

The kernels here are compositions of the quantize ops (the same results by construction);
a GPU version fuses the gather / activation into the quantize kernel's loads.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from torch_moe._ops import permute as _perm
from torch_moe._ops._dtypes import FP8
from torch_moe._ops.grouped_swiglu import _check_act, swiglu
from torch_moe._ops.permute import _check_maps, gather_rows
from torch_moe.quantization import quantize as Q
from torch_moe.quantization.ops import quantize_fp8, quantize_jagged, quantize_mx

__all__ = [
    "clear_weight_cache",
    "permute_quantize",
    "permute_quantize_jagged",
    "quantize_rows",
    "swiglu_quantize",
    "swiglu_quantize_jagged",
    "weight_cache_stats",
]


def _row_blocks(name: str, cols: int, fmt: str, block: int, scale_rule: str) -> int:
    """Checks of a row-local quantization; returns the scale blocks per row."""
    if fmt not in ("fp8", "mx"):
        raise ValueError(f"{name}: fmt must be 'fp8' or 'mx', got {fmt!r}")
    if fmt == "mx":
        if block < 1 or cols % block:
            raise ValueError(
                f"{name}: MX needs rows of a multiple of the block ({block}), got {cols} columns"
            )
        if scale_rule not in ("floor", "rceil"):
            raise ValueError(f"{name}: scale_rule must be 'floor' or 'rceil', got {scale_rule!r}")
        return cols // block
    if block < 1 and block != -1:
        raise ValueError(f"{name}: block must be a positive int or -1 (whole row), got {block}")
    return 1 if block == -1 else -(-cols // block)


def _scale_dtype(fmt: str) -> torch.dtype:
    return torch.float32 if fmt == "fp8" else torch.uint8


def quantize_rows(x: Tensor, fmt: str, block: int, scale_rule: str) -> tuple[Tensor, Tensor]:
    """Quantize x [R, C] along its rows: FP8 ``(1, block)`` blocks or MX ``1 x block``."""
    if fmt == "mx":
        return quantize_mx(x, dim=-1, block=block, scale_rule=scale_rule)
    return quantize_fp8(x, (1, block))


# --------------------------------------------------------------------------------------
# permute + quantize


def _check_permute(
    name: str, x: Tensor, row_to_slot: Tensor, slot_to_row: Tensor, fmt: str, block: int, rule: str
) -> int:
    _check_maps(name, row_to_slot, slot_to_row, None)
    if x.dim() != 2 or not x.is_floating_point() or x.shape[0] != slot_to_row.shape[0]:
        raise ValueError(
            f"{name}: expected x [T={slot_to_row.shape[0]}, D] floating point, got "
            f"{list(x.shape)} {x.dtype}"
        )
    return _row_blocks(name, x.shape[1], fmt, block, rule)


@torch.library.custom_op("torch_moe::permute_quantize", mutates_args=())
def permute_quantize(
    x: Tensor, row_to_slot: Tensor, slot_to_row: Tensor, fmt: str, block: int, scale_rule: str
) -> tuple[Tensor, Tensor]:
    nb = _check_permute("permute_quantize", x, row_to_slot, slot_to_row, fmt, block, scale_rule)
    M, D = row_to_slot.shape[0], x.shape[1]
    if x.shape[0] == 0:  # no tokens: every row is padding (zeros, the zero block's scale)
        fill = 1.0 if fmt == "fp8" else 0
        return x.new_zeros((M, D), dtype=FP8), x.new_full((M, nb), fill, dtype=_scale_dtype(fmt))
    q_t, s_t = quantize_rows(x, fmt, block, scale_rule)
    tokens = torch.div(row_to_slot, slot_to_row.shape[1], rounding_mode="floor")  # -1 stays
    q, s = gather_rows(q_t, tokens), gather_rows(s_t, tokens)
    if fmt == "fp8":  # an all-zero (padding) row has scale 1.0; MX's is uint8 0 = 2^-127
        s = s.masked_fill_((tokens < 0).unsqueeze(1), 1.0)
    return q, s


@permute_quantize.register_fake
def _(
    x: Tensor, row_to_slot: Tensor, slot_to_row: Tensor, fmt: str, block: int, scale_rule: str
) -> tuple[Tensor, Tensor]:
    nb = _check_permute("permute_quantize", x, row_to_slot, slot_to_row, fmt, block, scale_rule)
    M = row_to_slot.shape[0]
    return x.new_empty((M, x.shape[1]), dtype=FP8), x.new_empty((M, nb), dtype=_scale_dtype(fmt))


def _check_jagged_args(name: str, rows: int, offs: Tensor, block: int, fmt: str) -> int:
    if fmt not in ("fp8", "mx"):
        raise ValueError(f"{name}: fmt must be 'fp8' or 'mx', got {fmt!r}")
    if offs.dim() != 1 or offs.dtype != torch.int32:
        raise ValueError(f"{name}: expected offs to be 1D int32, got {offs.dim()}D {offs.dtype}")
    if block < 1 and block != -1:
        raise ValueError(f"{name}: block must be a positive int or -1 (per group), got {block}")
    return Q.jagged_num_blocks(rows, offs.shape[0], block)


@torch.library.custom_op("torch_moe::permute_quantize_jagged", mutates_args=())
def permute_quantize_jagged(
    x: Tensor,
    row_to_slot: Tensor,
    slot_to_row: Tensor,
    offs: Tensor,
    block: int,
    fmt: str,
    scale_rule: str,
) -> tuple[Tensor, Tensor]:
    _check_maps("permute_quantize_jagged", row_to_slot, slot_to_row, None)
    x_perm = _perm.permute(x, row_to_slot, slot_to_row)
    return quantize_jagged(x_perm, offs, block=block, fmt=fmt, scale_rule=scale_rule)


@permute_quantize_jagged.register_fake
def _(
    x: Tensor,
    row_to_slot: Tensor,
    slot_to_row: Tensor,
    offs: Tensor,
    block: int,
    fmt: str,
    scale_rule: str,
) -> tuple[Tensor, Tensor]:
    name = "permute_quantize_jagged"
    _check_maps(name, row_to_slot, slot_to_row, None)
    M = row_to_slot.shape[0]
    nb = _check_jagged_args(name, M, offs, block, fmt)
    return x.new_empty((M, x.shape[1]), dtype=FP8), x.new_empty(
        (nb, x.shape[1]), dtype=_scale_dtype(fmt)
    )


# --------------------------------------------------------------------------------------
# swiglu + quantize


@torch.library.custom_op("torch_moe::swiglu_quantize", mutates_args=())
def swiglu_quantize(
    h: Tensor, row_weights: Tensor | None, fmt: str, block: int, scale_rule: str
) -> tuple[Tensor, Tensor]:
    _check_act(h, row_weights)
    _row_blocks("swiglu_quantize", h.shape[1] // 2, fmt, block, scale_rule)
    return quantize_rows(swiglu(h, row_weights), fmt, block, scale_rule)


@swiglu_quantize.register_fake
def _(
    h: Tensor, row_weights: Tensor | None, fmt: str, block: int, scale_rule: str
) -> tuple[Tensor, Tensor]:
    _check_act(h, row_weights)
    nb = _row_blocks("swiglu_quantize", h.shape[1] // 2, fmt, block, scale_rule)
    M, F = h.shape[0], h.shape[1] // 2
    return h.new_empty((M, F), dtype=FP8), h.new_empty((M, nb), dtype=_scale_dtype(fmt))


@torch.library.custom_op("torch_moe::swiglu_quantize_jagged", mutates_args=())
def swiglu_quantize_jagged(
    h: Tensor, row_weights: Tensor | None, offs: Tensor, block: int, fmt: str, scale_rule: str
) -> tuple[Tensor, Tensor]:
    _check_act(h, row_weights)
    a = swiglu(h, row_weights)
    return quantize_jagged(a, offs, block=block, fmt=fmt, scale_rule=scale_rule)


@swiglu_quantize_jagged.register_fake
def _(
    h: Tensor, row_weights: Tensor | None, offs: Tensor, block: int, fmt: str, scale_rule: str
) -> tuple[Tensor, Tensor]:
    _check_act(h, row_weights)
    M, F = h.shape[0], h.shape[1] // 2
    nb = _check_jagged_args("swiglu_quantize_jagged", M, offs, block, fmt)
    return h.new_empty((M, F), dtype=FP8), h.new_empty((nb, F), dtype=_scale_dtype(fmt))


# --------------------------------------------------------------------------------------
# the weights' quantization, cached per version of the weight

# id(source) -> (weak reference to source, weak reference to its storage, {(how x derives
# from it, the quantization): (source version, q, scale)}); tensors compare elementwise,
# so they are not dict keys. The storage's weak reference keeps its StorageImpl allocated
# (not its memory), so no later storage can take its address while the entry lives: the
# same address and not expired is the same storage.
_Entries = dict[Any, tuple[int, Tensor, Tensor]]
_WEIGHT_CACHE: dict[int, tuple[weakref.ref[Tensor], StorageWeakRef, _Entries]] = {}
_STATS = {"hits": 0, "misses": 0}


def _forget(key: int, _ref: object) -> None:
    _WEIGHT_CACHE.pop(key, None)


def _entries(source: Tensor) -> _Entries:
    key = id(source)
    held = _WEIGHT_CACHE.get(key)
    storage = source.untyped_storage()
    if (
        held is None
        or held[0]() is not source  # new, or an id reused after a free
        or held[1].cdata != storage._cdata  # another storage (.data =, module.to(dtype))
        or held[1].expired()
    ):
        ref = weakref.ref(source, functools.partial(_forget, key))
        held = (ref, StorageWeakRef(storage), {})
        _WEIGHT_CACHE[key] = held
    return held[2]


def clear_weight_cache() -> None:
    """Drop every cached weight quantization (and reset :func:`weight_cache_stats`)."""
    _WEIGHT_CACHE.clear()
    _STATS.update(hits=0, misses=0)


def weight_cache_stats() -> dict[str, int]:
    """Hits and misses of the cached weight quantizations since the last clear."""
    return dict(_STATS)


def _cached(
    source: Tensor, x: Tensor, key: tuple[Any, ...], quantize: Any
) -> tuple[Tensor, Tensor]:
    if source.is_inference():  # no version counter: nothing to key on
        return quantize()
    full_key = (*key, tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype)
    entries = _entries(source)
    hit = entries.get(full_key)
    version = source._version
    if hit is not None and hit[0] == version:
        _STATS["hits"] += 1
        return hit[1], hit[2]
    _STATS["misses"] += 1
    q, scale = quantize()
    entries[full_key] = (version, q, scale)
    return q, scale


@torch.library.custom_op("torch_moe::quantize_fp8_cached", mutates_args=())
def quantize_fp8_cached(source: Tensor, x: Tensor, block: list[int]) -> tuple[Tensor, Tensor]:
    return _cached(source, x, ("fp8", tuple(block)), lambda: quantize_fp8(x, block))


@quantize_fp8_cached.register_fake
def _(source: Tensor, x: Tensor, block: list[int]) -> tuple[Tensor, Tensor]:
    scale_shape = Q.check_quantize_fp8(x, block)
    return x.new_empty(x.shape, dtype=FP8), x.new_empty(scale_shape, dtype=torch.float32)


@torch.library.custom_op("torch_moe::quantize_mx_cached", mutates_args=())
def quantize_mx_cached(
    source: Tensor, x: Tensor, dim: int, block: int, scale_rule: str
) -> tuple[Tensor, Tensor]:
    return _cached(
        source,
        x,
        ("mx", dim, block, scale_rule),
        lambda: quantize_mx(x, dim=dim, block=block, scale_rule=scale_rule),
    )


@quantize_mx_cached.register_fake
def _(source: Tensor, x: Tensor, dim: int, block: int, scale_rule: str) -> tuple[Tensor, Tensor]:
    _, scale_shape = Q.check_quantize_mx(x, dim, block, scale_rule)
    return x.new_empty(x.shape, dtype=FP8), x.new_empty(scale_shape, dtype=torch.uint8)
