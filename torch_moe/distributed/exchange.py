"""Segment all-to-all: every rank sends row segments of its tensors straight into row
segments of the receivers' tensors, with point-to-point sends and receives.

Legend: R ranks in the group; a segment ``(start, length)`` is the rows
``[start, start + length)`` of a tensor (rows = dim 0).

``all_to_all_segments(outputs, inputs, out_segments, in_segments, group)``: rank s sends,
for every rank d, the segments ``in_segments[d]`` of each input (in list order); rank d
writes the i-th segment it receives from s into ``out_segments[s][i]`` of the matching
output. The two sides must agree on the lengths (``in_segments[d][i]`` of rank s has the
length of ``out_segments[s][i]`` of rank d), as the split sizes of an
``all_to_all_single`` must. Segments of length 0 are skipped on both sides; a rank's
segments for itself are one local copy each.

Why not ``all_to_all_single`` + a reorder. An expert-parallel dispatch sends each rank the
rows of its experts: rank s's rows, sorted by expert, hold for destination d the
contiguous block of experts ``[d*El, (d+1)*El)``. ``all_to_all_single`` delivers them
source-major (all of rank 0's rows, then rank 1's, ...), while the grouped GEMM wants
them expert-major, so the receiver gathers every row once after the dispatch and once
more before the combine (and the backward does both again). Sent as one segment per
(destination, expert), the rows land expert-major directly and the combine sends each
expert's output rows straight back into the sender's row order: no row is copied outside
the transport. Both exchanges against a bare ``all_to_all_single`` of the same bytes (gloo,
2 and 4 ranks): benchmarks/results/ep_cpu_202611.md.

The cost is more messages: R*El per direction instead of R. Each is a ``P2POp`` of one
``dist.batch_isend_irecv`` call (one NCCL group, so one kernel launch on GPU; gloo posts
them on its transport threads). NB: messages are matched by ``tag`` (gloo) or by issue
order per peer (NCCL); both sides issue the segments of a peer in list order with
``tag + i*len(inputs) + j`` for segment i of tensor j, so a caller with several exchanges
in flight at once between the same ranks gives each a disjoint tag range.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["SegmentWork", "all_to_all_segments"]

Segments = Sequence[Sequence[tuple[int, int]]]  # per rank of the group: (start, length)


class SegmentWork:
    """The sends and receives of one ``all_to_all_segments`` call in flight."""

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> None:
        """Block until every segment of this rank has been sent and received."""
        works, self._works = self._works, []
        for work in works:
            work.wait()


def _check(
    outputs: Sequence[Tensor],
    inputs: Sequence[Tensor],
    out_segments: Segments,
    in_segments: Segments,
    size: int,
    rank: int,
) -> None:
    if len(outputs) != len(inputs) or not inputs:
        raise ValueError(
            "all_to_all_segments: expected as many outputs as inputs (at least one), got "
            f"{len(outputs)} outputs and {len(inputs)} inputs"
        )
    for name, segs in (("out_segments", out_segments), ("in_segments", in_segments)):
        if len(segs) != size:
            raise ValueError(
                f"all_to_all_segments: {name} must have one list per rank of the group "
                f"({size}), got {len(segs)}"
            )
    for x, y in zip(inputs, outputs, strict=True):
        if x.dtype != y.dtype or x.shape[1:] != y.shape[1:] or x.device != y.device:
            raise ValueError(
                "all_to_all_segments: each output must match its input in dtype, device and "
                f"row shape, got input {x.dtype} {tuple(x.shape)} on {x.device} and output "
                f"{y.dtype} {tuple(y.shape)} on {y.device}"
            )
        if not (x.is_contiguous() and y.is_contiguous()):
            raise ValueError("all_to_all_segments: inputs and outputs must be contiguous")
    for name, segs, tensors in (
        ("in_segments", in_segments, inputs),
        ("out_segments", out_segments, outputs),
    ):
        rows = min(t.shape[0] for t in tensors)
        for r, peer_segs in enumerate(segs):
            for start, length in peer_segs:
                if start < 0 or length < 0 or start + length > rows:
                    raise ValueError(
                        f"all_to_all_segments: {name}[{r}] has the segment (start={start}, "
                        f"length={length}) outside the {rows} rows of its tensors"
                    )
    if len(in_segments[rank]) != len(out_segments[rank]) or any(
        a[1] != b[1] for a, b in zip(in_segments[rank], out_segments[rank], strict=True)
    ):
        raise ValueError(
            f"all_to_all_segments: rank {rank}'s segments for itself differ in lengths: "
            f"in_segments[{rank}]={list(in_segments[rank])}, "
            f"out_segments[{rank}]={list(out_segments[rank])}"
        )


def all_to_all_segments(
    outputs: Sequence[Tensor],
    inputs: Sequence[Tensor],
    out_segments: Segments,
    in_segments: Segments,
    group: ProcessGroup | None = None,
    *,
    tag: int = 0,
    async_op: bool = False,
) -> SegmentWork | None:
    """Send ``in_segments[d]`` of every input to rank d; receive into ``out_segments[s]``.

    Args:
        outputs, inputs: tensors of matching dtype and row shape (each pair moves with the
            same segments, e.g. rows and their per-row weights); contiguous.
        out_segments: per rank s of ``group``, the (start, length) row segments of the
            outputs that rank s's segments for this rank fill, in the order s sends them.
        in_segments: per rank d of ``group``, the (start, length) row segments of the
            inputs sent to rank d, in order.
        group: the process group (default: the world); ranks are group ranks.
        tag: the first tag this call uses (see the module docstring).
        async_op: return a ``SegmentWork`` to ``wait()`` on instead of waiting here. The
            inputs must not be modified and the outputs not read before the wait.

    The outputs' rows that no segment names are left as they are.
    """
    group = group if group is not None else dist.group.WORLD
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    _check(outputs, inputs, out_segments, in_segments, size, rank)
    n = len(inputs)
    for (src, length), (dst, _) in zip(in_segments[rank], out_segments[rank], strict=True):
        if length:
            for x, y in zip(inputs, outputs, strict=True):
                y[dst : dst + length].copy_(x[src : src + length])
    # receives first: a receive posted before its message arrives lets the transport
    # write straight into the output
    ops = [
        dist.P2POp(op, t[start : start + length], group=group, tag=tag + i * n + j, group_peer=peer)
        for op, segments, tensors in (
            (dist.irecv, out_segments, outputs),
            (dist.isend, in_segments, inputs),
        )
        for peer in range(size)
        if peer != rank
        for i, (start, length) in enumerate(segments[peer])
        if length
        for j, t in enumerate(tensors)
    ]
    work = SegmentWork(dist.batch_isend_irecv(ops) if ops else [])
    if async_op:
        return work
    work.wait()
    return None
