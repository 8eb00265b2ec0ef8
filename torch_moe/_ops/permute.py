"""Local token dispatch and combine: ``torch_moe::permute_indices``, ``permute``,
``unpermute`` and ``weighted_row_dot``.

Legend: T tokens, K top-k, E experts, D model dim, N = T*K assignments ("slots";
slot ``s = t*K + k`` is token t's k-th choice), M rows of the permuted buffer.

Layout of the permuted buffer: the N slots are stably sorted by expert, so expert e's
rows are contiguous and, inside an expert, in token order. With ``align > 1`` every
expert's block is padded with zero rows to a multiple of ``align`` (16 for FP8, 32 for
MXFP8, 128 for blockwise GEMMs). ``offs`` [E] int32 holds the group ENDS that
``grouped_mm`` takes: expert e owns rows ``offs[e-1]:offs[e]`` (``offs[-1]`` is the
first row past the last group). Rows at or past ``offs[-1]`` are zero.

Capacity and drop policy: with ``capacity=C`` each expert keeps at most C assignments,
the first C in token order (earlier tokens win, as in Switch Transformer); the rest
are dropped: they get no row, contribute 0 to the combine, and are counted in
``num_dropped``.

NB (no host sync): M is a static upper bound, never read from the data, so none of
these ops synchronizes with the device and all of them trace under torch.compile with
static shapes:

* dropless, ``align == 1``: M = N exactly (no padding rows);
* dropless, ``align > 1``: M = N + E*(align-1);
* ``capacity=C``: M = min(E*round_up(C, align), N + E*(align-1)).

The maps are two int64 index tensors: ``row_to_slot`` [M] (-1 for padding rows) and
``slot_to_row`` [T, K] (-1 for dropped slots). Every op here is a gather: the backward
of ``permute`` is ``unpermute`` and vice versa, so both directions are deterministic
(no atomics, no index_add) and accumulate the K contributions of a token in fp32 in the
fixed order k = 0..K-1.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from torch_moe._ops import _native
from torch_moe._ops._dtypes import acc_dtype
from torch_moe._ops._eager import direct_calls

__all__ = [
    "gather_rows",
    "permute",
    "permute_indices",
    "permute_indices_reference",
    "permute_rows_reference",
    "token_of_rows",
    "unpermute",
    "unpermute_rows_reference",
    "weighted_row_dot",
    "weighted_row_dot_reference",
]


_UNREAD: Any = object()  # gather_rows: the -1 positions not read yet


def gather_rows(x: Tensor, index: Tensor, empty: Any = _UNREAD) -> Tensor:
    """``x[index]`` with zero rows where ``index == -1`` (any dtype, float8 included): the
    row gather of ``permute`` given each row's token (``row_to_slot // K``, -1 stays -1).
    ``empty``: on the CPU, ``_negative_positions(index)`` where the caller has read it
    already (a gather repeated over one index reads it once)."""
    if x.dtype.itemsize == 1 and x.is_floating_point():  # float8: no masked_fill kernel
        return gather_rows(x.view(torch.uint8), index, empty).view(x.dtype)
    if index.device.type == "cpu" and type(index) is Tensor:  # real CPU values: -1 rows
        # filled by position, not a masked pass over every row (a host read: CPU only)
        if empty is _UNREAD:
            empty = _negative_positions(index)
        if empty is None:
            return x.index_select(0, index)
        return x.index_select(0, index.clamp(min=0)).index_fill_(0, empty, 0)
    out = x.index_select(0, index.clamp(min=0))
    return out.masked_fill_((index < 0).unsqueeze(1), 0)


def token_of_rows(row_to_slot: Tensor, slot_to_row: Tensor) -> Tensor:
    """The token each expert-sorted row reads (-1: a zero row): ``row_to_slot // K`` (an
    assignment t*K + k belongs to token t; floor division keeps -1 at -1)."""
    top_k = slot_to_row.shape[1]
    return row_to_slot if top_k == 1 else torch.div(row_to_slot, top_k, rounding_mode="floor")


_MAX_ROWS = 2**31 - 1  # the group ends (offs) are int32


def _num_rows(
    num_tokens: int, top_k: int, num_experts: int, align: int, capacity: int | None
) -> int:
    bound = num_tokens * top_k + num_experts * (align - 1)
    if capacity is None:
        return bound
    return min(num_experts * (-(-capacity // align) * align), bound)


def _check_index_inputs(
    expert_ids: Tensor, num_experts: int, align: int, capacity: int | None
) -> None:
    if expert_ids.dim() != 2 or expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            "permute_indices: expected expert_ids to be a 2D int32/int64 tensor [T, K], "
            f"got {expert_ids.dim()}D {expert_ids.dtype}"
        )
    if num_experts < 1:
        raise ValueError(f"permute_indices: num_experts must be >= 1, got {num_experts}")
    if align < 1:
        raise ValueError(f"permute_indices: align must be >= 1, got {align}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"permute_indices: capacity must be >= 0 or None, got {capacity}")
    num_tokens, top_k = expert_ids.shape
    rows = _num_rows(num_tokens, top_k, num_experts, align, capacity)
    if isinstance(rows, int) and rows > _MAX_ROWS:  # (symbolic sizes: no guard on them)
        raise ValueError(
            f"permute_indices: {num_tokens} x {top_k} assignments over num_experts="
            f"{num_experts} with align={align} and capacity={capacity} make {rows} "
            f"permuted rows, past the int32 group ends' {_MAX_ROWS}"
        )


def permute_indices_reference(
    expert_ids: Tensor, num_experts: int, align: int = 1, capacity: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Plain-PyTorch sort of the assignments by expert (oracle and kernel)."""
    _check_index_inputs(expert_ids, num_experts, align, capacity)
    num_tokens, top_k = expert_ids.shape
    n = num_tokens * top_k
    dev = expert_ids.device
    flat_N = expert_ids.reshape(-1).long()
    torch._assert_async(
        ((flat_N >= 0) & (flat_N < num_experts)).all(),
        f"permute_indices: expert_ids must lie in [0, num_experts={num_experts})",
    )
    order_N = torch.argsort(flat_N, stable=True)  # slots sorted by expert
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts_E.scatter_add_(0, flat_N, torch.ones_like(flat_N))
    kept_E = counts_E if capacity is None else counts_E.clamp(max=capacity)
    padded_E = kept_E if align == 1 else (kept_E + align - 1) // align * align
    ends_E = padded_E.cumsum(0)
    offs = ends_E.to(torch.int32)
    num_dropped = n - kept_E.sum()
    m = _num_rows(num_tokens, top_k, num_experts, align, capacity)

    if capacity is None and align == 1:
        # Fast path: the sorted order is the row order.
        slot_to_row = torch.empty_like(order_N)
        slot_to_row[order_N] = torch.arange(n, device=dev)
        return order_N, slot_to_row.view(num_tokens, top_k), offs, num_dropped

    sorted_e_N = flat_N[order_N]  # the expert of each sorted slot
    rank_N = torch.arange(n, device=dev) - (counts_E.cumsum(0) - counts_E)[sorted_e_N]
    row_N = (ends_E - padded_E)[sorted_e_N] + rank_N
    if capacity is not None:
        row_N = torch.where(rank_N < capacity, row_N, -1)
    slot_to_row = torch.empty_like(order_N)
    slot_to_row[order_N] = row_N
    # Dropped slots scatter into a dump row m that is sliced off: no boolean indexing.
    row_to_slot = torch.full((m + 1,), -1, dtype=torch.int64, device=dev)
    row_to_slot.scatter_(0, torch.where(row_N >= 0, row_N, m), order_N)
    return row_to_slot[:m], slot_to_row.view(num_tokens, top_k), offs, num_dropped


@torch.library.custom_op("torch_moe::permute_indices", mutates_args=())
def permute_indices(
    expert_ids: Tensor, num_experts: int, align: int = 1, capacity: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return permute_indices_reference(expert_ids, num_experts, align, capacity)


@permute_indices.register_kernel("cuda")
def _permute_indices_cuda(
    expert_ids: Tensor, num_experts: int, align: int = 1, capacity: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Decode-sized dropless batches in one Triton program (the ATen reference is some twenty
    kernels: torch_moe._triton.permute); the rest by the reference."""
    from torch_moe._triton import permute as TP

    if TP.plan_takes(expert_ids.numel(), capacity):
        _check_index_inputs(expert_ids, num_experts, align, capacity)
        return TP.permute_plan(expert_ids, num_experts, align)
    return permute_indices_reference(expert_ids, num_experts, align, capacity)  # (checks)


@permute_indices.register_kernel("cpu")
def _permute_indices_cpu(
    expert_ids: Tensor, num_experts: int, align: int = 1, capacity: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The reference's integers by a stable counting sort in one native call where the
    native CPU kernels built (``_native.py``), else the reference."""
    kernels = _native.kernels()
    if kernels is None or type(expert_ids) is not Tensor:
        return permute_indices_reference(expert_ids, num_experts, align, capacity)
    _check_index_inputs(expert_ids, num_experts, align, capacity)
    return kernels.permute_indices(expert_ids, num_experts, align, capacity)


@permute_indices.register_fake
def _(
    expert_ids: Tensor, num_experts: int, align: int = 1, capacity: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_index_inputs(expert_ids, num_experts, align, capacity)
    num_tokens, top_k = expert_ids.shape
    m = _num_rows(num_tokens, top_k, num_experts, align, capacity)
    return (
        expert_ids.new_empty((m,), dtype=torch.int64),
        expert_ids.new_empty((num_tokens, top_k), dtype=torch.int64),
        expert_ids.new_empty((num_experts,), dtype=torch.int32),
        expert_ids.new_empty((), dtype=torch.int64),
    )


# --------------------------------------------------------------------------------------
# permute / unpermute: a pair of gathers, each the other's adjoint.


def _check_maps(
    name: str, row_to_slot: Tensor, slot_to_row: Tensor, weights: Tensor | None
) -> None:
    if row_to_slot.dim() != 1 or row_to_slot.dtype != torch.int64:
        raise ValueError(
            f"{name}: expected row_to_slot to be a 1D int64 tensor, got "
            f"{row_to_slot.dim()}D {row_to_slot.dtype}"
        )
    if slot_to_row.dim() != 2 or slot_to_row.dtype != torch.int64:
        raise ValueError(
            f"{name}: expected slot_to_row to be a 2D int64 tensor [T, K], got "
            f"{slot_to_row.dim()}D {slot_to_row.dtype}"
        )
    if weights is not None and (
        weights.shape != slot_to_row.shape or not weights.is_floating_point()
    ):
        raise ValueError(
            f"{name}: expected weights to be a floating-point tensor of shape "
            f"{list(slot_to_row.shape)}, got {list(weights.shape)} {weights.dtype}"
        )


def check_map_values(name: str, arg: str, t: Tensor, end: int) -> None:
    """A map's values in [-1, end), where it is a plain CPU tensor (a device's are not read
    back, a traced one's not known): the rows or slots a gather reads through it. A gather
    past them reads outside its source: an IndexError that names neither, or, in a native
    kernel, memory past it."""
    if type(t) is not Tensor or t.device.type != "cpu" or t.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(t))
    if low < -1 or high >= end:
        raise ValueError(
            f"{name}: {arg} must hold values in [-1, {end}), got {low if low < -1 else high}"
        )


def _check_rows(name: str, arg: str, t: Tensor, rows: int | None) -> None:
    if t.dim() != 2 or not t.is_floating_point():
        raise ValueError(
            f"{name}: expected {arg} to be a 2D floating-point tensor, got {t.dim()}D {t.dtype}"
        )
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name}: expected {arg} to have {rows} rows, got {t.shape[0]}")


def permute_rows_reference(
    x: Tensor, row_to_slot: Tensor, slot_to_row: Tensor, weights: Tensor | None = None
) -> Tensor:
    """out[r] = w[s] * x[s // K] for s = row_to_slot[r]; 0 where s == -1."""
    _check_maps("permute", row_to_slot, slot_to_row, weights)
    _check_rows("permute", "x", x, slot_to_row.shape[0])
    top_k = slot_to_row.shape[1]
    if x.shape[0] == 0:  # T == 0: only padding rows
        return x.new_zeros((row_to_slot.shape[0], x.shape[1]))
    valid_M = row_to_slot >= 0
    slot_M = row_to_slot.clamp(min=0)
    out = x.index_select(0, torch.div(slot_M, top_k, rounding_mode="floor"))
    if weights is not None:
        w_M = weights.reshape(-1).to(acc_dtype(x.dtype)).index_select(0, slot_M)
        out = (out.to(w_M.dtype) * w_M.unsqueeze(1)).to(x.dtype)
    return out.masked_fill_(~valid_M.unsqueeze(1), 0)


def unpermute_rows_reference(
    y: Tensor, slot_to_row: Tensor, row_to_slot: Tensor, weights: Tensor | None = None
) -> Tensor:
    """out[t] = sum_k w[t, k] * y[slot_to_row[t, k]] in fp32, k = 0..K-1 in order."""
    _check_maps("unpermute", row_to_slot, slot_to_row, weights)
    _check_rows("unpermute", "y", y, row_to_slot.shape[0])
    num_tokens, top_k = slot_to_row.shape
    acc = torch.zeros((num_tokens, y.shape[1]), dtype=acc_dtype(y.dtype), device=y.device)
    if y.shape[0] == 0:  # no rows (capacity 0): every slot was dropped
        return acc.to(y.dtype)
    valid_TK = slot_to_row >= 0
    rows_TK = slot_to_row.clamp(min=0)
    for k in range(top_k):
        y_k = y.index_select(0, rows_TK[:, k]).to(acc.dtype)
        if weights is not None:
            y_k = y_k * weights[:, k : k + 1].to(acc.dtype)
        acc += torch.where(valid_TK[:, k : k + 1], y_k, 0)
    return acc.to(y.dtype)


@torch.library.custom_op("torch_moe::permute", mutates_args=())
def permute(
    x: Tensor, row_to_slot: Tensor, slot_to_row: Tensor, weights: Tensor | None = None
) -> Tensor:
    return permute_rows_reference(x, row_to_slot, slot_to_row, weights)


def _rows_cuda(
    name: str, t: Tensor, row_to_slot: Tensor, slot_to_row: Tensor, weights: Tensor | None
) -> Tensor:
    """``permute`` (name "permute", t = x) or ``unpermute`` (t = y) on CUDA: one Triton
    kernel (torch_moe._triton.permute) where it takes t, the reference else."""
    from torch_moe._triton import permute as TP

    forward = name == "permute"
    if not TP.rows_take(t, weights):
        if forward:
            return permute_rows_reference(t, row_to_slot, slot_to_row, weights)
        return unpermute_rows_reference(t, slot_to_row, row_to_slot, weights)
    _check_maps(name, row_to_slot, slot_to_row, weights)
    if forward:
        _check_rows(name, "x", t, slot_to_row.shape[0])
        return TP.permute_rows(t, row_to_slot, slot_to_row, weights)
    _check_rows(name, "y", t, row_to_slot.shape[0])
    return TP.unpermute_rows(t, slot_to_row, row_to_slot, weights)


@permute.register_kernel("cuda")
def _permute_cuda(
    x: Tensor, row_to_slot: Tensor, slot_to_row: Tensor, weights: Tensor | None = None
) -> Tensor:
    return _rows_cuda("permute", x, row_to_slot, slot_to_row, weights)


@permute.register_fake
def _(x: Tensor, row_to_slot: Tensor, slot_to_row: Tensor, weights: Tensor | None = None) -> Tensor:
    _check_maps("permute", row_to_slot, slot_to_row, weights)
    _check_rows("permute", "x", x, slot_to_row.shape[0])
    return x.new_empty((row_to_slot.shape[0], x.shape[1]))


@torch.library.custom_op("torch_moe::unpermute", mutates_args=())
def unpermute(
    y: Tensor, slot_to_row: Tensor, row_to_slot: Tensor, weights: Tensor | None = None
) -> Tensor:
    return unpermute_rows_reference(y, slot_to_row, row_to_slot, weights)


@unpermute.register_kernel("cuda")
def _unpermute_cuda(
    y: Tensor, slot_to_row: Tensor, row_to_slot: Tensor, weights: Tensor | None = None
) -> Tensor:
    return _rows_cuda("unpermute", y, row_to_slot, slot_to_row, weights)


@unpermute.register_fake
def _(y: Tensor, slot_to_row: Tensor, row_to_slot: Tensor, weights: Tensor | None = None) -> Tensor:
    _check_maps("unpermute", row_to_slot, slot_to_row, weights)
    _check_rows("unpermute", "y", y, row_to_slot.shape[0])
    return y.new_empty((slot_to_row.shape[0], y.shape[1]))


# NB (CPU kernels): the references above are the oracle and the kernel elsewhere. On CPU,
# where reading an index tensor costs no device sync, these skip the clamp/mask passes
# when no index is -1 (dropless, unpadded) and otherwise zero the -1 rows by position
# (a capacity's dropped slots, padding rows: no masked pass over every row), scale in
# place (one rounding, as the reference), and accumulate the K rows in place: ~3x fewer
# passes over [*, D]. They work in row chunks of about _CHUNK_ELEMS elements per
# thread, converting each chunk once:
# every op has operands of one dtype (a mixed-dtype CPU op such as bf16.mul_(fp32)
# converts inside its loop, ~2x slower than one conversion pass) and the fp32 temporaries
# stay in cache. The chunk size changes no result: every output element is computed by
# the same operations in the same order.

# 2^16-2^18 per thread measured alike on a 2-vCPU EPYC (bf16 and fp32, 1 and 2 threads);
# the fp64 accumulation of fp32 inputs wants the larger end (fewer Python-level chunks)
_CHUNK_ELEMS = 2**17


# the dtypes of the native combine (torch_moe/csrc/permute_cpu.cpp)
_COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _chunk_rows(width: int) -> int:
    return max(1, _CHUNK_ELEMS * torch.get_num_threads() // max(1, width))


def _native_combine(dtype: torch.dtype) -> Any:
    """The native CPU kernels' ops where their combine (weighted or not) and weighted
    permute take rows of ``dtype`` (a dtype they have, built), else None: the one rule for
    the kernels and the memory model."""
    if dtype not in _COMBINE_DTYPES:
        return None
    return _native.kernels()


def combine_temporary_bytes(tokens: float, dim: int, dtype: torch.dtype) -> float:
    """Bytes of ``unpermute``'s CPU temporaries at their largest: none where the native
    combine runs; otherwise one token chunk's fp32 sum and its rows of one k as gathered
    and converted to fp32 (the memory model's term)."""
    if _native_combine(dtype) is not None:
        return 0.0
    return min(tokens, _chunk_rows(dim)) * dim * (4 + dtype.itemsize + 4)


def _no_negative(index: Tensor) -> bool:
    return index.numel() == 0 or int(index.min()) >= 0


def _negative_positions(index: Tensor) -> Tensor | None:
    """The positions of the -1 entries of a 1D index (None when there are none): the rows
    that a gather must leave zero, filled by position instead of a masked pass over
    every row."""
    if _no_negative(index):
        return None
    return (index < 0).nonzero().squeeze(1)


def _scale_rows_(out: Tensor, scale: Tensor) -> None:
    """``out *= scale`` ([rows, 1], the accumulation dtype), computed in ``scale``'s dtype
    and rounded once into ``out``."""
    if out.dtype == scale.dtype:
        out.mul_(scale)
        return
    step = _chunk_rows(out.shape[1])
    for o, s in zip(out.split(step), scale.split(step), strict=True):
        o.copy_(o.to(s.dtype).mul_(s))


@permute.register_kernel("cpu")
def _permute_cpu(
    x: Tensor, row_to_slot: Tensor, slot_to_row: Tensor, weights: Tensor | None = None
) -> Tensor:
    if x.shape[0] == 0:
        return permute_rows_reference(x, row_to_slot, slot_to_row, weights)
    _check_maps("permute", row_to_slot, slot_to_row, weights)
    _check_rows("permute", "x", x, slot_to_row.shape[0])
    check_map_values("permute", "row_to_slot", row_to_slot, x.shape[0] * slot_to_row.shape[1])
    return _permute_rows(x, row_to_slot, slot_to_row, weights)


def _permute_rows(
    x: Tensor, row_to_slot: Tensor, slot_to_row: Tensor, weights: Tensor | None = None
) -> Tensor:
    """The CPU kernel of ``permute`` past its checks (callers that hold validated maps and
    x with T >= 1 rows: ``grouped_swiglu_combine``)."""
    top_k = slot_to_row.shape[1]
    if weights is not None and x.stride(-1) == 1 and type(x) is Tensor:
        kernels = _native_combine(x.dtype)
        if kernels is not None:  # gathered and scaled in one pass, the same bits
            tokens = torch.div(row_to_slot, top_k, rounding_mode="floor")  # -1 stays -1
            scales = weights.reshape(-1).to(acc_dtype(x.dtype))[row_to_slot.clamp(min=0)]
            out = x.new_empty((row_to_slot.shape[0], x.shape[1]))
            kernels.gather_scaled(x, tokens, scales.contiguous(), out)
            return out
    empty = _negative_positions(row_to_slot)  # padding rows, or the rows a capacity left
    slots = row_to_slot if empty is None else row_to_slot.clamp(min=0)
    tokens = slots if top_k == 1 else torch.div(slots, top_k, rounding_mode="floor")
    out = x.index_select(0, tokens)
    if weights is not None:  # computed in fp32 (fp64), rounded once into x's dtype
        w_M = weights.reshape(-1).to(acc_dtype(x.dtype)).index_select(0, slots)
        _scale_rows_(out, w_M.unsqueeze(1))
    if empty is not None:
        out.index_fill_(0, empty, 0)
    return out


@unpermute.register_kernel("cpu")
def _unpermute_cpu(
    y: Tensor, slot_to_row: Tensor, row_to_slot: Tensor, weights: Tensor | None = None
) -> Tensor:
    if y.shape[0] == 0 or slot_to_row.shape[1] == 0:
        return unpermute_rows_reference(y, slot_to_row, row_to_slot, weights)
    _check_maps("unpermute", row_to_slot, slot_to_row, weights)
    _check_rows("unpermute", "y", y, row_to_slot.shape[0])
    check_map_values("unpermute", "slot_to_row", slot_to_row, y.shape[0])
    return _unpermute_rows(y, slot_to_row, row_to_slot, weights)


def _unpermute_rows(
    y: Tensor, slot_to_row: Tensor, row_to_slot: Tensor, weights: Tensor | None = None
) -> Tensor:
    """The CPU kernel of ``unpermute`` past its checks (callers that hold validated maps,
    y with M >= 1 rows and K >= 1: ``grouped_swiglu_combine``)."""
    out = y.new_empty((slot_to_row.shape[0], y.shape[1]))
    rows_ok = y.stride(-1) == 1 and type(y) is Tensor
    kernels = _native_combine(y.dtype) if rows_ok else None
    acc_dt = acc_dtype(y.dtype)
    w = None if weights is None else weights.to(acc_dt)
    if kernels is not None:  # the same multiplies and additions, in one pass
        kernels.combine(y, slot_to_row, out, w)
        return out
    dropped = not _no_negative(slot_to_row)
    step = _chunk_rows(y.shape[1])

    def gathered(t: slice, row_k: Tensor, k: int) -> Tensor:
        """The k-th rows of tokens t, in the accumulation dtype, weighted; a dropped
        slot's row is exactly 0, as the reference's ``where``."""
        gone = _negative_positions(row_k) if dropped else None
        y_k = y.index_select(0, row_k if gone is None else row_k.clamp(min=0)).to(acc_dt)
        if w is not None:
            y_k.mul_(w[t, k : k + 1])
        if gone is not None:
            y_k.index_fill_(0, gone, 0)
        return y_k

    for t0 in range(0, out.shape[0], step):
        t = slice(t0, t0 + step)
        rows = slot_to_row[t]
        acc = gathered(t, rows[:, 0], 0).add_(0.0)  # from +0, as the reference's zeros
        for k in range(1, rows.shape[1]):
            acc.add_(gathered(t, rows[:, k], k))
        out[t].copy_(acc)
    return out


@torch.library.custom_op("torch_moe::weighted_row_dot", mutates_args=())
def weighted_row_dot(rows: Tensor, tokens: Tensor, slot_to_row: Tensor) -> Tensor:
    """out[t, k] = <rows[slot_to_row[t, k]], tokens[t]> in fp32 (0 for dropped slots).

    The gradient of the combine/dispatch weights.
    """
    return weighted_row_dot_reference(rows, tokens, slot_to_row)


@weighted_row_dot.register_kernel("cpu")
def _weighted_row_dot_cpu(rows: Tensor, tokens: Tensor, slot_to_row: Tensor) -> Tensor:
    kernels = _native_row_dot(rows, tokens)
    if kernels is not None and slot_to_row.numel() > 0 and rows.shape[0] > 0:
        _check_row_dot(rows, tokens, slot_to_row)
        out = torch.empty(slot_to_row.shape, dtype=torch.float32)
        kernels.row_dot(rows, tokens, slot_to_row.to(torch.int64), out)
        return out
    # per row chunk of tokens: each chunk converted once, its fp32 temporaries in cache
    return _weighted_row_dot(rows, tokens, slot_to_row, _chunk_rows(rows.shape[1]))


# the dtypes of the native row_dot: those whose products and sums are fp32
_ROW_DOT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ROW_DOT_CHECKED: dict[tuple[Any, torch.dtype], bool] = {}


def _native_row_dot(rows: Tensor, tokens: Tensor) -> Any:
    """The native kernels' ops where their ``row_dot`` takes these operands (plain CPU
    tensors of one fp32-accumulated dtype, rows contiguous) and gave ATen's bits on this
    build (:func:`_row_dot_matches_aten`, once per process and dtype), else None."""
    dt = rows.dtype
    if dt not in _ROW_DOT_DTYPES or tokens.dtype != dt or rows.dim() != 2 or tokens.dim() != 2:
        return None
    if type(rows) is not Tensor or type(tokens) is not Tensor:
        return None
    if rows.stride(-1) != 1 or tokens.stride(-1) != 1:
        return None
    mod = _native.kernels()
    if mod is None:
        return None
    if (mod, dt) not in _ROW_DOT_CHECKED:
        _ROW_DOT_CHECKED[(mod, dt)] = _row_dot_matches_aten(mod, dt)
    return mod if _ROW_DOT_CHECKED[(mod, dt)] else None


def _row_dot_matches_aten(mod: Any, dtype: torch.dtype) -> bool:
    """The native ``row_dot`` equals the reference bit for bit: it sums each product row in
    the order of ATen's sum (aten_sum.h's aten_order_sum), checked on rows shorter than a
    vector, around a vector block and long enough for every level of that order's
    cascade; a compiler or a torch that adds in another order fails here, with a warning
    (the reference then runs)."""
    g = torch.Generator().manual_seed(2)
    for d in (5, 8, 47, 100, 4100, _native.CASCADE_ROW):
        rows = torch.randn(6, d, generator=g).to(dtype)
        tokens = torch.randn(3, d, generator=g).to(dtype)
        slots = torch.tensor([[0, 5], [-1, 2], [3, 3]])
        got = torch.empty(3, 2)
        mod.row_dot(rows, tokens, slots, got)
        if not torch.equal(got, _weighted_row_dot(rows, tokens, slots, 3)):
            warnings.warn(
                "torch_moe: the native CPU row_dot kernel built but its results differ from "
                f"the ATen ops' ({dtype}, D={d}); using the ATen ops",
                stacklevel=2,
            )
            return False
    return True


def _weighted_row_dot(rows: Tensor, tokens: Tensor, slot_to_row: Tensor, step: int) -> Tensor:
    """``weighted_row_dot`` over chunks of ``step`` tokens (one chunk: the whole [T, D]).
    Per chunk and k: the gathered rows in fp32, times the tokens in place, summed over D
    (2x faster on CPU than a bmm of T [1, D] x [D, 1] products)."""
    acc = acc_dtype(rows.dtype)
    out = torch.zeros(slot_to_row.shape, dtype=acc, device=rows.device)
    if rows.shape[0] == 0:
        return out
    valid_TK = slot_to_row >= 0
    rows_TK = slot_to_row.clamp(min=0)
    for t0 in range(0, slot_to_row.shape[0], step):
        t = slice(t0, t0 + step)
        tok = tokens[t].to(acc)
        for k in range(slot_to_row.shape[1]):
            out[t, k] = rows.index_select(0, rows_TK[t, k]).to(acc).mul_(tok).sum(1)
    return out.masked_fill_(~valid_TK, 0)


def _check_row_dot(rows: Tensor, tokens: Tensor, slot_to_row: Tensor) -> None:
    if rows.shape[1] != tokens.shape[1] or tokens.shape[0] != slot_to_row.shape[0]:
        raise ValueError(
            "weighted_row_dot: rows, tokens and slot_to_row disagree: "
            f"{list(rows.shape)}, {list(tokens.shape)}, {list(slot_to_row.shape)}"
        )


def weighted_row_dot_reference(rows: Tensor, tokens: Tensor, slot_to_row: Tensor) -> Tensor:
    """``weighted_row_dot`` over the whole [T, D] at once (the op's default and the CUDA
    kernel's fallback; the CPU kernel runs the same in row chunks)."""
    _check_row_dot(rows, tokens, slot_to_row)
    return _weighted_row_dot(rows, tokens, slot_to_row, max(1, slot_to_row.shape[0]))


@weighted_row_dot.register_kernel("cuda")
def _weighted_row_dot_cuda(rows: Tensor, tokens: Tensor, slot_to_row: Tensor) -> Tensor:
    """One Triton kernel where it takes rows and tokens (the reference launches ~5 kernels
    per k); the reference else."""
    from torch_moe._triton import permute as TP

    if not (TP.rows_take(rows, None) and TP.rows_take(tokens, None)):
        return weighted_row_dot_reference(rows, tokens, slot_to_row)  # (checks)
    _check_row_dot(rows, tokens, slot_to_row)
    return TP.row_dot(rows, tokens, slot_to_row)


@weighted_row_dot.register_fake
def _(rows: Tensor, tokens: Tensor, slot_to_row: Tensor) -> Tensor:
    _check_row_dot(rows, tokens, slot_to_row)
    return rows.new_empty(slot_to_row.shape, dtype=acc_dtype(rows.dtype))


def _setup_permute(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, row_to_slot, slot_to_row, weights = inputs
    ctx.save_for_backward(x if weights is not None else None, row_to_slot, slot_to_row, weights)


def _permute_backward(ctx, grad):  # type: ignore[no-untyped-def]
    x, row_to_slot, slot_to_row, weights = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = unpermute(grad, slot_to_row, row_to_slot, weights)
    if weights is not None and ctx.needs_input_grad[3]:
        grad_w = weighted_row_dot(grad, x, slot_to_row).to(weights.dtype)
    return grad_x, None, None, grad_w


def _setup_unpermute(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    y, slot_to_row, row_to_slot, weights = inputs
    ctx.save_for_backward(y if weights is not None else None, slot_to_row, row_to_slot, weights)


def _unpermute_backward(ctx, grad):  # type: ignore[no-untyped-def]
    y, slot_to_row, row_to_slot, weights = ctx.saved_tensors
    grad_y = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_y = permute(grad, row_to_slot, slot_to_row, weights)
    if weights is not None and ctx.needs_input_grad[3]:
        grad_w = weighted_row_dot(y, grad, slot_to_row).to(weights.dtype)
    return grad_y, None, None, grad_w


permute.register_autograd(_permute_backward, setup_context=_setup_permute)
unpermute.register_autograd(_unpermute_backward, setup_context=_setup_unpermute)

# Eager calls on plain CPU tensors run the kernels and autograd formulas above without the
# ops' Python layers (``_eager.py``); everything else, and every attribute, is the op's.
permute_indices = direct_calls(permute_indices, _permute_indices_cpu)
permute = direct_calls(permute, _permute_cpu, _setup_permute, _permute_backward)
unpermute = direct_calls(unpermute, _unpermute_cpu, _setup_unpermute, _unpermute_backward)
weighted_row_dot = direct_calls(weighted_row_dot, _weighted_row_dot_cpu)
