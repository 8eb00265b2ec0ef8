"""Expert-parallel token dispatch and combine as custom ops (``torch_moe::ep_dispatch``,
``ep_combine`` and their backward ops), so that Dynamo captures them and Inductor calls them
as extern kernels.

Legend: R expert-parallel ranks, E experts, El = E / R local experts, M rows of this rank's
permuted buffer (sorted by global expert), N rows this rank receives for a chunk of its
local experts, D model dim.

``counts`` (int64 [E + R*El + R], on the host) is the plan of one forward: this rank's rows
per global expert (``send_E``, the group sizes of its permuted buffer), then the rows each
source rank sends for each of this rank's local experts (``recv_RL``), then each rank's
call mode (:func:`mode_word`: the dtype its dispatch sends, whether autograd records the
exchanges, whether it runs the two micro-batches' schedule and in how many chunks of local
experts). The layer gets it from one all-to-all of ``send_E`` and the mode
(``torch.distributed._functional_collectives``, traced like any collective) and one copy
to the host; every op below reads its segment tables from it, so no op synchronizes with
the device again, and refuses a plan whose modes differ: every rank raises, naming each
rank's mode, before any row moves (ranks in different autocast or grad modes would
otherwise exchange rows of different sizes, which gloo aborts the process on, or leave
the peers waiting for a backward that never comes).

* ``ep_dispatch(x [M, D], row_weights [M]?, counts, ..., chunk [l0, l1)) -> (x_recv [N, D],
  w_recv [N])``: the rows of this rank's tokens for the local experts l0..l1-1 of every
  rank go to their owner; the owner's rows arrive expert-major (local expert l0's rows from
  rank 0, rank 1, ..., then expert l0 + 1's, ...), i.e. in the order the unparallelized
  layer holds them for those experts. N is data-dependent: the fake kernel gives it an
  unbacked SymInt, shared by both outputs. With ``fp8`` the rows travel as e4m3 with one
  fp32 scale per 1x128 block (``quantize_fp8``) and are dequantized on arrival.
* ``ep_combine(y [N, D], counts, ..., chunk, num_rows=M) -> [M, D]``: the experts' output
  rows go back to their senders, into the rows they came from; rows of other chunks and
  alignment padding are zero (a layer with C chunks adds the C results).
* ``ep_dispatch_backward`` / ``ep_combine_backward``: the same exchanges in the other
  direction, in the gradient's dtype (FP8 dispatch passes the gradient straight through
  the quantization); registered as the ops' autograd.

How rows move (``exchange``): ``"p2p"`` sends each (rank, expert) block as one segment of
:func:`~torch_moe.distributed.exchange.all_to_all_segments` (point-to-point), straight into
its place: no row is reordered outside the transport. ``"all_to_all"`` uses one
``all_to_all_single`` per direction (``node_size > 0``: the hierarchical one) and reorders
the received rows from source-major to expert-major with one gather. Both give the same
bits.

Faults: a failing or timed-out collective raises ``RuntimeError`` naming the operation, the
rank and the group.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C import _distributed_c10d as _c10d
from torch.distributed.distributed_c10d import _resolve_process_group

from torch_moe.distributed.exchange import all_to_all_segments
from torch_moe.distributed.hierarchical import hierarchical_all_to_all_single
from torch_moe.quantization import dequantize_fp8, quantize_fp8

__all__ = ["EXCHANGES", "ChunkPlan", "chunk_bounds", "chunk_offsets", "chunk_plan"]

EXCHANGES = ("p2p", "all_to_all")
_FP8_BLOCK = (1, 128)  # FP8 dispatch: one scale per 128 values of a row
# p2p tags: one range per direction and chunk, one tag per (expert segment, tensor)
_DIRECTIONS = ("dispatch", "combine", "dispatch backward", "combine backward")
_TENSORS_PER_SEGMENT = 3  # at most: e4m3 rows (or rows), their scales, routing weights


@dataclass(frozen=True)
class ChunkPlan:
    """The segment tables of one chunk of local experts [l0, l1) (host ints).

    ``sent[d]``: (start, length) row segments of this rank's permuted buffer for rank d's
    experts l0..l1-1; ``received[s]``: (start, length) segments of the expert-major receive
    buffer that rank s fills; ``rows``: N, the rows received; ``send_rows``: the rows sent.
    ``send_splits`` / ``recv_splits``: per-rank totals (the all-to-all split sizes).
    """

    sent: list[list[tuple[int, int]]]
    received: list[list[tuple[int, int]]]
    rows: int
    send_rows: int
    send_splits: list[int]
    recv_splits: list[int]
    recv_counts: list[list[int]]  # [s][j]: rows from rank s for local expert l0 + j


# the dtypes a mode word names (0: another)
_MODE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MODE_GRAD = 1 << 8
_MODE_LOW_LATENCY = 1 << 9  # the header of mode="low_latency" (it has no plan)
_MODE_OVER_BUDGET = 1 << 10  # ... from a rank of more than max_tokens_per_rank tokens
_MODE_MICROBATCHES = 1 << 11  # a plan of microbatches=2 (two plans, exchanges in flight)
_MODE_CHUNKS_SHIFT = 12  # bits 12-31: the chunks of local experts the exchanges run in, - 1
_MODE_CHUNKS_MAX = 1 << 20
_MODE_CHUNKS_FIELD = (_MODE_CHUNKS_MAX - 1) << _MODE_CHUNKS_SHIFT


def mode_word(
    dtype: torch.dtype,
    records_grad: bool,
    *,
    low_latency: bool = False,
    over_budget: bool = False,
    microbatches: bool = False,
    chunks: int = 1,
) -> int:
    """A rank's call mode in the plan: the dtype its dispatch sends the rows in, whether
    autograd records the exchanges (so that their backwards will run), whether the batch
    runs as two micro-batches (``microbatches=2`` in inference: another sequence of
    exchanges) and in how many chunks of local experts (``num_chunks``, or the compiler's
    ``ep_chunks``, which rewrites the word: :func:`with_chunks`); for the header of
    ``mode="low_latency"`` (which has the plan's shape, so that a rank taking the training
    exchange meets it), that it is one and whether the rank has more tokens than its
    ``max_tokens_per_rank``."""
    code = _MODE_DTYPES.index(dtype) + 1 if dtype in _MODE_DTYPES else 0
    return with_chunks(
        code
        | (_MODE_GRAD if records_grad else 0)
        | (_MODE_LOW_LATENCY if low_latency else 0)
        | (_MODE_OVER_BUDGET if over_budget else 0)
        | (_MODE_MICROBATCHES if microbatches else 0),
        chunks,
    )


def with_chunks(word: int, chunks: int) -> int:
    """``word`` (a :func:`mode_word`) saying ``chunks`` chunks of local experts."""
    if (
        isinstance(chunks, bool)
        or not isinstance(chunks, int)
        or not 0 < chunks <= _MODE_CHUNKS_MAX
    ):
        raise ValueError(f"mode_word: chunks must be an int in [1, 2**20], got {chunks!r}")
    return (word & ~_MODE_CHUNKS_FIELD) | ((chunks - 1) << _MODE_CHUNKS_SHIFT)


def _describe_mode(word: int) -> str:
    code = word & (_MODE_GRAD - 1)
    dtype = str(_MODE_DTYPES[code - 1]).removeprefix("torch.") if code else "another dtype"
    out = f"{dtype} rows, " + ("autograd recording" if word & _MODE_GRAD else "no autograd")
    if word & _MODE_LOW_LATENCY:
        out += ", the low-latency exchange"
    if word & _MODE_OVER_BUDGET:
        out += ", more tokens than max_tokens_per_rank"
    if word & _MODE_MICROBATCHES:
        out += ", two micro-batches"
    chunks = ((word & _MODE_CHUNKS_FIELD) >> _MODE_CHUNKS_SHIFT) + 1
    if chunks > 1:
        out += f", {chunks} chunks of local experts"
    return out


_MODES_DIFFER = (
    "every rank of the expert-parallel group must call it under the same autocast and grad "
    "mode and, with mode='low_latency' or microbatches=2, in eval mode without autograd on "
    "every rank or on none (low latency: each within max_tokens_per_rank), and compiled "
    "with the same ep_chunks; the rows' sizes and the exchanges follow them"
)


def _check_modes(modes: list[int], group: dist.ProcessGroup) -> None:
    """Every rank of ``group`` called the layer in the same mode (the plan's tail)."""
    if len(set(modes)) == 1:
        return
    ranks = dist.get_process_group_ranks(group)
    each = "; ".join(f"rank {r}: {_describe_mode(m)}" for r, m in zip(ranks, modes, strict=True))
    raise RuntimeError(
        f"ExpertParallel: the ranks called the layer in different modes ({each}); {_MODES_DIFFER}"
    )


def chunk_plan(counts: Sequence[int], num_experts: int, world: int, l0: int, l1: int) -> ChunkPlan:
    """The segment tables of chunk [l0, l1) from the plan ``counts`` (module doc; the modes
    at its end are not read here)."""
    El = num_experts // world
    send_E = list(counts[:num_experts])
    recv = [list(counts[num_experts + s * El : num_experts + (s + 1) * El]) for s in range(world)]
    start = [0]
    for n in send_E:
        start.append(start[-1] + n)
    sent = [[(start[d * El + j], send_E[d * El + j]) for j in range(l0, l1)] for d in range(world)]
    received: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    row = 0
    for j in range(l0, l1):  # expert-major: local expert j, then by source rank
        for s in range(world):
            received[s].append((row, recv[s][j]))
            row += recv[s][j]
    return ChunkPlan(
        sent=sent,
        received=received,
        rows=row,
        send_rows=sum(n for segs in sent for _, n in segs),
        send_splits=[sum(n for _, n in segs) for segs in sent],
        recv_splits=[sum(recv[s][l0:l1]) for s in range(world)],
        recv_counts=[r[l0:l1] for r in recv],
    )


def chunk_bounds(l0: int, l1: int, num_chunks: int) -> list[tuple[int, int]]:
    """``num_chunks`` contiguous chunks [a, b) of the local experts [l0, l1), as even as
    integer division makes them (``ExpertParallel(num_chunks=C)``'s split)."""
    n = l1 - l0
    return [(l0 + c * n // num_chunks, l0 + (c + 1) * n // num_chunks) for c in range(num_chunks)]


def chunk_offsets(counts: Tensor, num_experts: int, world: int, l0: int, l1: int) -> Tensor:
    """int32 group ends [l1 - l0] of the expert-major receive buffer of chunk [l0, l1).

    The ``torch_moe::ep_chunk_offsets`` op: one node per chunk in a traced graph, so the
    compiler's chunk pass (:mod:`torch_moe._inductor.ep_chunk`) finds and re-bounds it."""
    return torch.ops.torch_moe.ep_chunk_offsets(counts, num_experts, world, l0, l1)


def _check_offsets_args(counts: Tensor, num_experts: int, world: int, l0: int, l1: int) -> None:
    if world < 1 or num_experts % world != 0:
        raise ValueError(
            f"ep_chunk_offsets: num_experts ({num_experts}) must be a multiple of world ({world})"
        )
    El = num_experts // world
    if not 0 <= l0 < l1 <= El:
        raise ValueError(
            f"ep_chunk_offsets: bad chunk [{l0}, {l1}) of {El} local experts "
            f"(num_experts={num_experts}, world={world})"
        )
    n = 2 * num_experts + world
    if counts.dim() != 1 or counts.dtype != torch.int64 or counts.shape[0] != n:
        raise ValueError(
            f"ep_chunk_offsets: expected counts to be 1D int64 [2 * num_experts + world = "
            f"{n}] (the plan), got {counts.dim()}D {counts.dtype} {list(counts.shape)}"
        )


@torch.library.custom_op("torch_moe::ep_chunk_offsets", mutates_args=())
def ep_chunk_offsets(counts: Tensor, num_experts: int, world: int, l0: int, l1: int) -> Tensor:
    """:func:`chunk_offsets` (the op)."""
    _check_offsets_args(counts, num_experts, world, l0, l1)
    recv_RL = counts[num_experts : 2 * num_experts].view(world, num_experts // world)
    return recv_RL[:, l0:l1].sum(0).cumsum(0).to(torch.int32)


@ep_chunk_offsets.register_fake
def _(counts: Tensor, num_experts: int, world: int, l0: int, l1: int) -> Tensor:
    _check_offsets_args(counts, num_experts, world, l0, l1)
    return counts.new_empty((l1 - l0,), dtype=torch.int32)


# --------------------------------------------------------------------------------------
# the exchanges (run inside the op kernels)


@dataclass(frozen=True)
class _Setup:
    group: dist.ProcessGroup
    world: int
    rank: int
    plan: ChunkPlan
    l0: int
    exchange: str
    node_size: int

    def call(self, op: str, fn):  # type: ignore[no-untyped-def]
        """Run a collective; a failure or a timeout names this rank and the operation."""
        try:
            return fn()
        except RuntimeError as e:
            ranks = dist.get_process_group_ranks(self.group)
            raise RuntimeError(
                f"ExpertParallel: {op} failed on rank {dist.get_rank()} (expert-parallel rank "
                f"{self.rank} of {self.world}, group ranks {ranks}): {e}"
            ) from e


def _setup(
    counts: Tensor,
    group_name: str,
    num_experts: int,
    l0: int,
    l1: int,
    exchange: str,
    node_size: int,
) -> _Setup:
    group = _resolve_process_group(group_name)  # type: ignore[arg-type]
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    values = counts.tolist()
    if len(values) != 2 * num_experts + world:
        raise ValueError(
            f"ExpertParallel: expected counts of 2 * num_experts + world = "
            f"{2 * num_experts + world} values (the plan), got {len(values)}"
        )
    _check_modes(values[2 * num_experts :], group)
    plan = chunk_plan(values, num_experts, world, l0, l1)
    return _Setup(group, world, rank, plan, l0, exchange, node_size)


def _segments_index(starts: list[int], lengths: list[int], device: torch.device) -> Tensor:
    """The rows of the segments ``[start, start + length)`` in order, concatenated: one
    ``repeat_interleave`` over the segments, no Python work per row."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    total = int(lens.sum())
    if total == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    # row i of segment g is starts[g] + (i - first[g]), first[g] its position in the index
    first = lens.cumsum(0) - lens
    shift = torch.tensor(starts, dtype=torch.int64) - first
    index = torch.repeat_interleave(shift, lens) + torch.arange(total)
    return index.to(device)


def _expert_major_index(plan: ChunkPlan, device: torch.device) -> Tensor:
    """Gather index from source-major (rank s's rows for l0.., then rank s+1's) to
    expert-major order of the received rows."""
    world = len(plan.recv_counts)
    experts = len(plan.recv_counts[0]) if world else 0
    starts_SJ: list[list[int]] = []  # where rank s's block for expert j starts, source-major
    row = 0
    for s in range(world):
        starts_SJ.append([])
        for n in plan.recv_counts[s]:
            starts_SJ[s].append(row)
            row += n
    order = [(s, j) for j in range(experts) for s in range(world)]  # expert-major
    return _segments_index(
        [starts_SJ[s][j] for s, j in order], [plan.recv_counts[s][j] for s, j in order], device
    )


def _send_index(plan: ChunkPlan, device: torch.device) -> Tensor:
    """Rows of the permuted buffer this chunk sends, destination-major."""
    segs = [seg for segs in plan.sent for seg in segs]
    return _segments_index([a for a, _ in segs], [n for _, n in segs], device)


def _to_owners(setup: _Setup, tensors: list[Tensor], op: str, tag: int) -> list[Tensor]:
    """Rows of this rank's permuted buffer (``tensors``, [M, ...]) for the chunk's experts go
    to their owners; returns the received rows [N, ...], expert-major."""
    plan = setup.plan
    if setup.exchange == "p2p":
        outs = [t.new_empty((plan.rows, *t.shape[1:])) for t in tensors]
        ins = [t.contiguous() for t in tensors]
        setup.call(
            f"{op} all_to_all_segments",
            lambda: all_to_all_segments(outs, ins, plan.received, plan.sent, setup.group, tag=tag),
        )
        return outs
    # all_to_all: the collective's output is a fresh source-major buffer, reordered into a
    # new expert-major one (no [N, ...] buffer allocated up front: it would sit unused)
    index = _send_index(plan, tensors[0].device)
    reorder = _expert_major_index(plan, tensors[0].device)
    result = []
    for t in tensors:
        rows = t.index_select(0, index).contiguous()
        got = _all_to_all(setup, rows, plan.recv_splits, plan.send_splits, op)
        result.append(got.index_select(0, reorder))
    return result


def _to_senders(
    setup: _Setup, tensors: list[Tensor], num_rows: int, op: str, tag: int
) -> list[Tensor]:
    """The reverse: expert-major rows [N, ...] go back to the rows they came from; returns
    [num_rows, ...] with the chunk's rows filled and the others zero (no zero fill where
    the chunk's rows are all of them: one chunk, every expert)."""
    plan = setup.plan
    covered = sum(n for segs in plan.sent for _, n in segs) == num_rows
    alloc = Tensor.new_empty if covered else Tensor.new_zeros
    outs = [alloc(t, (num_rows, *t.shape[1:])) for t in tensors]
    if setup.exchange == "p2p":
        ins = [t.contiguous() for t in tensors]
        setup.call(
            f"{op} all_to_all_segments",
            lambda: all_to_all_segments(outs, ins, plan.sent, plan.received, setup.group, tag=tag),
        )
        return outs
    index = _send_index(plan, tensors[0].device)
    reorder = _expert_major_index(plan, tensors[0].device)
    inverse = torch.empty_like(reorder)
    inverse[reorder] = torch.arange(reorder.numel(), device=reorder.device)
    for t, out in zip(tensors, outs, strict=True):
        rows = t.index_select(0, inverse).contiguous()  # back to source-major
        got = _all_to_all(setup, rows, plan.send_splits, plan.recv_splits, op)
        out.index_copy_(0, index, got)
    return outs


def _all_to_all(
    setup: _Setup, x: Tensor, out_splits: list[int], in_splits: list[int], op: str
) -> Tensor:
    if setup.node_size > 0:
        node_size = setup.node_size
        return setup.call(
            f"{op} hierarchical_all_to_all_single",
            lambda: hierarchical_all_to_all_single(
                x, out_splits, in_splits, setup.group, node_size
            ),
        )
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    setup.call(
        f"{op} all_to_all_single",
        lambda: dist.all_to_all_single(out, x, out_splits, in_splits, group=setup.group),
    )
    return out


def _tag(direction: str, setup: _Setup, num_experts: int) -> int:
    El = num_experts // setup.world
    return (_DIRECTIONS.index(direction) * El + setup.l0) * _TENSORS_PER_SEGMENT * El


def _wire(t: Tensor) -> Tensor:
    """Tensors as the transport takes them (gloo has no float8: e4m3 bytes as uint8)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# --------------------------------------------------------------------------------------
# the ops


_LOWERED = [False]


def _lower_as_collective() -> None:
    """Called by the exchanges' fake kernels: in a process where Inductor is loaded (so the
    graph being traced may be lowered by it), lower the exchanges as kernels with side
    effects (:mod:`torch_moe._inductor.lowering`) so that no rank's compiled code drops one
    whose outputs it does not read. Imports with every dispatch mode (fake, proxy)
    disabled."""
    if _LOWERED[0] or "torch._inductor.lowering" not in sys.modules:
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        from torch_moe._inductor.lowering import register_exchange_lowerings

        register_exchange_lowerings()
    _LOWERED[0] = True


def _check(
    name: str,
    x: Tensor,
    counts: Tensor,
    num_experts: int,
    l0: int,
    l1: int,
    exchange: str,
    node_size: int,
) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: expected rows [M, D], got {x.dim()}D {list(x.shape)}")
    if counts.dim() != 1 or counts.dtype != torch.int64 or counts.device.type != "cpu":
        raise ValueError(
            f"{name}: expected counts to be a 1D int64 CPU tensor (the plan), got "
            f"{counts.dim()}D {counts.dtype} on {counts.device}"
        )
    if not 0 <= l0 < l1 or exchange not in EXCHANGES or node_size < 0:
        raise ValueError(
            f"{name}: bad chunk [{l0}, {l1}), exchange {exchange!r} or node_size {node_size}"
        )
    if exchange == "p2p" and node_size > 0:
        raise ValueError(f"{name}: node_size={node_size} needs exchange='all_to_all'")


@torch.library.custom_op("torch_moe::ep_dispatch", mutates_args=())
def ep_dispatch(
    x: Tensor,
    row_weights: Tensor | None,
    counts: Tensor,
    group_name: str,
    num_experts: int,
    chunk_start: int,
    chunk_end: int,
    exchange: str,
    node_size: int,
    fp8: bool,
) -> tuple[Tensor, Tensor]:
    """Returns (x_recv [N, D], w_recv [N] (empty without row_weights)); module doc."""
    _check("ep_dispatch", x, counts, num_experts, chunk_start, chunk_end, exchange, node_size)
    s = _setup(counts, group_name, num_experts, chunk_start, chunk_end, exchange, node_size)
    tag = _tag("dispatch", s, num_experts)
    if fp8 and x.is_floating_point():
        q, scale = quantize_fp8(x, _FP8_BLOCK)
        sends = [_wire(q), scale]
    else:
        sends = [x]
    if row_weights is not None:
        sends.append(row_weights)
    got = _to_owners(s, sends, "dispatch", tag)
    if fp8 and x.is_floating_point():
        q_recv = got[0].view(torch.float8_e4m3fn)
        x_recv = dequantize_fp8(q_recv, got[1], _FP8_BLOCK, x.dtype)
        got = [x_recv, *got[2:]]
    w_recv = got[1] if row_weights is not None else x.new_empty((0,))
    return got[0], w_recv


@ep_dispatch.register_fake
def _(
    x: Tensor,
    row_weights: Tensor | None,
    counts: Tensor,
    group_name: str,
    num_experts: int,
    chunk_start: int,
    chunk_end: int,
    exchange: str,
    node_size: int,
    fp8: bool,
) -> tuple[Tensor, Tensor]:
    _lower_as_collective()
    _check("ep_dispatch", x, counts, num_experts, chunk_start, chunk_end, exchange, node_size)
    rows = torch.library.get_ctx().new_dynamic_size()  # N: known only from the counts
    w = x.new_empty((0,)) if row_weights is None else row_weights.new_empty((rows,))
    return x.new_empty((rows, x.shape[1])), w


@torch.library.custom_op("torch_moe::ep_dispatch_backward", mutates_args=())
def ep_dispatch_backward(
    grad_x: Tensor,
    grad_w: Tensor | None,
    counts: Tensor,
    group_name: str,
    num_experts: int,
    chunk_start: int,
    chunk_end: int,
    exchange: str,
    node_size: int,
    num_rows: int,
) -> tuple[Tensor, Tensor]:
    """The gradients of x [M, D] and the row weights [M] (empty without)."""
    name = "ep_dispatch_backward"
    _check(name, grad_x, counts, num_experts, chunk_start, chunk_end, exchange, node_size)
    s = _setup(counts, group_name, num_experts, chunk_start, chunk_end, exchange, node_size)
    tensors = [grad_x] if grad_w is None else [grad_x, grad_w]
    got = _to_senders(
        s, tensors, num_rows, "dispatch backward", _tag("dispatch backward", s, num_experts)
    )
    return got[0], got[1] if grad_w is not None else grad_x.new_empty((0,))


@ep_dispatch_backward.register_fake
def _(
    grad_x: Tensor,
    grad_w: Tensor | None,
    counts: Tensor,
    group_name: str,
    num_experts: int,
    chunk_start: int,
    chunk_end: int,
    exchange: str,
    node_size: int,
    num_rows: int,
) -> tuple[Tensor, Tensor]:
    _lower_as_collective()
    _check(
        "ep_dispatch_backward",
        grad_x,
        counts,
        num_experts,
        chunk_start,
        chunk_end,
        exchange,
        node_size,
    )
    w = grad_x.new_empty((0,)) if grad_w is None else grad_w.new_empty((num_rows,))
    return grad_x.new_empty((num_rows, grad_x.shape[1])), w


@torch.library.custom_op("torch_moe::ep_combine", mutates_args=())
def ep_combine(
    y: Tensor,
    counts: Tensor,
    group_name: str,
    num_experts: int,
    chunk_start: int,
    chunk_end: int,
    exchange: str,
    node_size: int,
    num_rows: int,
) -> Tensor:
    """The experts' rows back to their senders: [num_rows, D] (module doc)."""
    _check("ep_combine", y, counts, num_experts, chunk_start, chunk_end, exchange, node_size)
    s = _setup(counts, group_name, num_experts, chunk_start, chunk_end, exchange, node_size)
    return _to_senders(s, [y], num_rows, "combine", _tag("combine", s, num_experts))[0]


@ep_combine.register_fake
def _(
    y: Tensor,
    counts: Tensor,
    group_name: str,
    num_experts: int,
    chunk_start: int,
    chunk_end: int,
    exchange: str,
    node_size: int,
    num_rows: int,
) -> Tensor:
    _lower_as_collective()
    _check("ep_combine", y, counts, num_experts, chunk_start, chunk_end, exchange, node_size)
    return y.new_empty((num_rows, y.shape[1]))


@torch.library.custom_op("torch_moe::ep_combine_backward", mutates_args=())
def ep_combine_backward(
    grad: Tensor,
    counts: Tensor,
    group_name: str,
    num_experts: int,
    chunk_start: int,
    chunk_end: int,
    exchange: str,
    node_size: int,
    num_recv: int,
) -> Tensor:
    """The gradient of the experts' rows [N, D]: the combine's exchange reversed."""
    _check(
        "ep_combine_backward",
        grad,
        counts,
        num_experts,
        chunk_start,
        chunk_end,
        exchange,
        node_size,
    )
    s = _setup(counts, group_name, num_experts, chunk_start, chunk_end, exchange, node_size)
    return _to_owners(s, [grad], "combine backward", _tag("combine backward", s, num_experts))[0]


@ep_combine_backward.register_fake
def _(
    grad: Tensor,
    counts: Tensor,
    group_name: str,
    num_experts: int,
    chunk_start: int,
    chunk_end: int,
    exchange: str,
    node_size: int,
    num_recv: int,
) -> Tensor:
    _lower_as_collective()
    _check(
        "ep_combine_backward",
        grad,
        counts,
        num_experts,
        chunk_start,
        chunk_end,
        exchange,
        node_size,
    )
    return grad.new_empty((num_recv, grad.shape[1]))


# --------------------------------------------------------------------------------------
# autograd


def _setup_dispatch(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, row_weights, counts, *config = inputs
    ctx.save_for_backward(counts)
    ctx.config = config
    ctx.num_rows = x.shape[0]
    ctx.has_weights = row_weights is not None
    ctx.set_materialize_grads(False)


def _dispatch_backward(ctx, grad_x, grad_w):  # type: ignore[no-untyped-def]
    (counts,) = ctx.saved_tensors
    group_name, num_experts, l0, l1, exchange, node_size, _fp8 = ctx.config
    if grad_x is None:  # only the weights' gradient flows (or none)
        return None, None, None, None, None, None, None, None, None, None
    if ctx.has_weights and grad_w is None:
        grad_w = grad_x.new_zeros((grad_x.shape[0],), dtype=torch.float32)
    gx, gw = ep_dispatch_backward(
        grad_x.contiguous(),
        grad_w.contiguous() if ctx.has_weights else None,
        counts, group_name, num_experts, l0, l1, exchange, node_size, ctx.num_rows,
    )  # fmt: skip
    return gx, gw if ctx.has_weights else None, None, None, None, None, None, None, None, None


def _setup_combine(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    y, counts, *config = inputs
    ctx.save_for_backward(counts)
    ctx.config = config
    ctx.num_recv = y.shape[0]


def _combine_backward(ctx, grad):  # type: ignore[no-untyped-def]
    (counts,) = ctx.saved_tensors
    group_name, num_experts, l0, l1, exchange, node_size, _num_rows = ctx.config
    gy = ep_combine_backward(
        grad.contiguous(), counts, group_name, num_experts, l0, l1, exchange, node_size,
        ctx.num_recv,
    )  # fmt: skip
    return gy, None, None, None, None, None, None, None, None


ep_dispatch.register_autograd(_dispatch_backward, setup_context=_setup_dispatch)
ep_combine.register_autograd(_combine_backward, setup_context=_setup_combine)


# --------------------------------------------------------------------------------------
# asynchronous halves: ep_start issues an exchange, ep_wait completes it
#
# The compiler's EP overlap pass (torch_moe._inductor.ep_overlap) splits each of the four
# exchanges above into ep_start (returns a handle, an int64 [1] CPU tensor naming the
# exchange in flight) and ep_wait (waits, finishes the exchange and returns its outputs),
# so that a graph can issue chunk c+1's dispatch before chunk c's experts run and wait for
# a combine only where its result is used. They are used in graphs after autograd (no
# autograd of their own). The outputs are allocated by ep_start and first returned by
# ep_wait, so no op output aliases an input.
#
# An exchange in flight is also registered with c10d's work registry under its handle (a
# PythonCallbackWork), the way the functional collectives register theirs: then
# torch.ops._c10d_functional.wait_tensor(handle) waits for it, and a graph that passes the
# handle through wait_tensor before ep_wait keeps the issue where it was written. Inductor's
# locality reordering (inference graphs) moves every producer next to its first consumer,
# except a collective's into its wait_tensor: without that, a schedule written to overlap
# (MoE's two micro-batches: both dispatches issued, then the first one's experts) compiles
# to issue-wait pairs. ep_wait pops the registry itself, so either form waits exactly once.

_DIRECTION_TO_OWNERS = {"dispatch": True, "combine backward": True}
_INFLIGHT: dict[int, tuple[object, list[Tensor], object, list[Tensor]]] = {}
_NEXT_HANDLE = [0]


def _start_to_owners(setup: _Setup, tensors: list[Tensor], op: str, tag: int):  # type: ignore[no-untyped-def]
    """Issue a to-owners exchange; returns (work or None, outputs, finish())."""
    plan = setup.plan
    if setup.exchange == "p2p":
        outs = [t.new_empty((plan.rows, *t.shape[1:])) for t in tensors]
        ins = [t.contiguous() for t in tensors]
        work = setup.call(
            f"{op} all_to_all_segments",
            lambda: all_to_all_segments(
                outs, ins, plan.received, plan.sent, setup.group, tag=tag, async_op=True
            ),
        )
        return work, outs, lambda: outs, ins
    return None, _to_owners(setup, tensors, op, tag), None, []  # a2a: done synchronously


def _start_to_senders(setup: _Setup, tensors: list[Tensor], num_rows: int, op: str, tag: int):  # type: ignore[no-untyped-def]
    plan = setup.plan
    if setup.exchange == "p2p":
        outs = [t.new_zeros((num_rows, *t.shape[1:])) for t in tensors]
        ins = [t.contiguous() for t in tensors]
        work = setup.call(
            f"{op} all_to_all_segments",
            lambda: all_to_all_segments(
                outs, ins, plan.sent, plan.received, setup.group, tag=tag, async_op=True
            ),
        )
        return work, outs, lambda: outs, ins
    return None, _to_senders(setup, tensors, num_rows, op, tag), None, []


@torch.library.custom_op("torch_moe::ep_start", mutates_args=())
def ep_start(
    tensors: list[Tensor],
    counts: Tensor,
    group_name: str,
    num_experts: int,
    chunk_start: int,
    chunk_end: int,
    exchange: str,
    node_size: int,
    direction: str,
    fp8: bool,
    num_rows: int,
) -> Tensor:
    """Issue one of the four exchanges (``direction``) of chunk [chunk_start, chunk_end);
    ``tensors`` are its inputs (rows, then routing weights for a dispatch)."""
    if direction not in _DIRECTIONS:
        raise ValueError(f"ep_start: direction must be one of {_DIRECTIONS}, got {direction!r}")
    _check("ep_start", tensors[0], counts, num_experts, chunk_start, chunk_end, exchange, node_size)
    s = _setup(counts, group_name, num_experts, chunk_start, chunk_end, exchange, node_size)
    tag = _tag(direction, s, num_experts)
    finish = None
    if direction == "dispatch" and fp8 and tensors[0].is_floating_point():
        q, scale = quantize_fp8(tensors[0], _FP8_BLOCK)
        dtype = tensors[0].dtype
        work, outs, _, keep = _start_to_owners(s, [_wire(q), scale, *tensors[1:]], direction, tag)

        def finish():  # type: ignore[no-untyped-def]
            x = dequantize_fp8(outs[0].view(torch.float8_e4m3fn), outs[1], _FP8_BLOCK, dtype)
            return [x, *outs[2:]]

    elif _DIRECTION_TO_OWNERS.get(direction, False):
        work, outs, _, keep = _start_to_owners(s, list(tensors), direction, tag)
    else:
        work, outs, _, keep = _start_to_senders(s, list(tensors), num_rows, direction, tag)
    handle = _NEXT_HANDLE[0]
    _NEXT_HANDLE[0] += 1
    _INFLIGHT[handle] = (work, outs, finish, keep)
    out = torch.tensor([handle], dtype=torch.int64)
    if work is not None:
        _register(out, work, direction)
    return out


def _wait(work: object, direction: str) -> bool:
    """Wait for an exchange's work (a no-op once waited), naming it if it fails."""
    try:
        work.wait()  # type: ignore[attr-defined]
    except RuntimeError as e:
        raise RuntimeError(
            f"ExpertParallel: {direction} all_to_all_segments (wait) failed on rank "
            f"{dist.get_rank()}: {e}"
        ) from e
    return True


def _register(handle: Tensor, work: object, direction: str) -> None:
    """Register ``work`` with c10d's work registry under ``handle`` (see above; a torch
    without ``PythonCallbackWork`` keeps the order all the same, and ``ep_wait`` waits)."""
    callback_work = getattr(_c10d, "PythonCallbackWork", None)
    if callback_work is not None and hasattr(_c10d, "_register_work"):
        _c10d._register_work(handle, callback_work(lambda timeout: _wait(work, direction)))


@ep_start.register_fake
def _(
    tensors: list[Tensor],
    counts: Tensor,
    group_name: str,
    num_experts: int,
    chunk_start: int,
    chunk_end: int,
    exchange: str,
    node_size: int,
    direction: str,
    fp8: bool,
    num_rows: int,
) -> Tensor:
    _lower_as_collective()
    _check("ep_start", tensors[0], counts, num_experts, chunk_start, chunk_end, exchange, node_size)
    return counts.new_empty((1,))


@torch.library.custom_op("torch_moe::ep_wait", mutates_args=())
def ep_wait(handle: Tensor, like: list[Tensor], direction: str, num_rows: int) -> list[Tensor]:
    """Complete the exchange ``handle`` names; its outputs: [N, ...] per input (to the
    owners; N from the plan) or [num_rows, ...] (back to the senders), shaped and typed like
    ``like`` (the exchange's inputs)."""
    entry = _INFLIGHT.pop(int(handle[0]), None)
    if entry is None:
        raise RuntimeError(f"ep_wait: no exchange in flight for handle {int(handle[0])}")
    work, outs, finish, _keep = entry
    if work is not None:  # (an all-to-all exchange completed in ep_start: nothing registered)
        # pops the handle's registration (waits unless a wait_tensor of the handle has; a
        # no-op where nothing was registered), then waits if nothing has
        torch.ops._c10d_functional.wait_tensor(handle)
        _wait(work, direction)
    return list(finish() if finish is not None else outs)  # type: ignore[operator]


# A graph must keep every wait even where its rows are not read (a micro-batch of no rows
# on this rank: its combine's output is empty): FX's dead-code elimination dropped it, and
# the exchange stayed in _INFLIGHT (and its p2p work unwaited) for good. ep_start and
# ep_wait only appear after autograd (inference graphs, or the post-grad overlap pass), so
# marking them does not make the partitioner keep forward exchanges in a backward graph,
# which marking the synchronous exchanges did (torch_moe._inductor.lowering).
torch.fx.node.has_side_effect(torch.ops.torch_moe.ep_start.default)
torch.fx.node.has_side_effect(torch.ops.torch_moe.ep_wait.default)


@ep_wait.register_fake
def _(handle: Tensor, like: list[Tensor], direction: str, num_rows: int) -> list[Tensor]:
    _lower_as_collective()
    if _DIRECTION_TO_OWNERS.get(direction, False):
        rows = torch.library.get_ctx().new_dynamic_size() if num_rows < 0 else num_rows
    else:
        rows = num_rows
    return [t.new_empty((rows, *t.shape[1:])) for t in like]
