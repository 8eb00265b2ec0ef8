"""Expert parallelism: the ``ExpertParallel`` style and the all-to-all dispatch/combine.

Legend: T tokens of this rank, D dim, E experts, R expert-parallel ranks, El = E/R local
experts, M permuted rows of this rank (T*K dropless), N rows received by this rank.

``parallelize_module(moe, ep_mesh, ExpertParallel())`` on a 1-D ``DeviceMesh``:

* ``moe.experts.w13`` [E, 2F, D] and ``moe.experts.w2`` [E, D, F] become DTensor
  parameters ``Shard(0)`` over the mesh: EP rank r holds experts ``[r*El, (r+1)*El)``
  (contiguous). Their values come from ``src_data_rank`` (rank 0 by default, like the
  other parallel styles); pass ``src_data_rank=None`` to keep each rank's own slice
  without communication.
* The router, the ``expert_bias`` buffer and the shared experts stay plain (replicated)
  tensors. ``ExpertParallel`` does not synchronize them and does not all-reduce their
  gradients: each rank's gradient is the gradient of its own tokens, so the data-parallel
  wrapper over the same ranks (DDP, ``replicate``, FSDP2 or a manual ``all_reduce``) sums
  or averages them as for any dense parameter. The expert-weight gradients are already
  complete: the combine all-to-all carries every rank's output gradient back to the
  experts' owner.
* ``moe(x)`` takes this rank's tokens (a plain tensor, any number including zero) and
  returns this rank's outputs. The layer's own forward runs unchanged (routing, permute,
  combine, shared experts, aux losses, load statistics); only the grouped expert call
  ``moe.experts(x_perm, offs, row_weights)`` is replaced by:

  1. counts exchange: ``all_to_all_single`` of the [E] per-expert row counts, so each
     rank learns the [R, El] rows it will receive;
  2. one host sync: the segment tables (or split lists) the transport takes on the host
     come from one ``.tolist()`` of the local and received counts (the only sync);
  3. dispatch: the permuted rows are already sorted by global expert, hence by
     destination rank and, within it, by the owner's local expert. With the default
     ``exchange="p2p"`` each (destination rank, expert) block travels as one segment of
     ``all_to_all_segments`` (point-to-point, autograd) straight into the owner's
     expert-major buffer, with the fp32 routing weights alongside; with
     ``exchange="all_to_all"`` one autograd ``all_to_all_single`` moves them and the
     owner reorders them from (source rank, expert) to (expert, source rank) order with
     a gather;
  4. the local experts: the module's own forward (whatever its ``precision``) on the
     local shards ``w13.to_local()`` / ``w2.to_local()``, so the gradients flow back to
     the DTensor parameters as ``Shard(0)`` gradients;
  5. combine: the same segments in reverse (or the inverse gather and the inverse
     all-to-all) bring each row's output home in the layer's permuted order, and the
     layer's ``unpermute`` sums the K rows of each token in fp32 in a fixed order
     (deterministic).

  Within one expert the rows arrive ordered by source rank and then by token, so the
  concatenation of all ranks' tokens through the unparallelized layer sees the same rows
  in the same order.

* Dropless only: a layer with ``capacity_factor`` raises ``NotImplementedError`` (a
  capacity over the global batch needs the global counts before the drop).
* Statistics and losses are local: ``tokens_per_expert`` counts this rank's routed
  assignments (``MoE.update_expert_bias`` all-reduces it, so the bias update is global
  and identical on every rank); the aux and z losses are computed on this rank's tokens,
  as under data parallelism.
* Faults: ``num_experts`` not divisible by the EP degree raises ``ValueError`` before any
  collective; ranks whose ``moe.config`` differ (a hash compared with
  ``all_gather_object``) raise ``ValueError`` on every rank naming the ranks and fields; a
  collective that fails or times out (the process group's ``timeout``) raises
  ``RuntimeError`` naming the rank and the operation, in the forward and the backward
  (the hierarchical path's backward reports the backend's own error).

Options (``ExpertParallel(...)``, all giving the results of the plain path except FP8):

* ``num_chunks=C``: the local experts are split into C contiguous groups and steps 3-5
  run per group; the later groups' dispatches are in flight (``async_op=True``) while
  group c's experts run (p2p: all issued at once; all_to_all: one ahead), each combine is
  issued as soon as its group is done and waited at the end, and the shared experts run
  right after the first dispatch is issued (``_SharedOverlap``). Every expert still sees
  all its rows in the same order, so outputs and gradients are bitwise those of C = 1.
  Each chunk's expert call slices the local weights, whose gradient is then accumulated
  over C slices; the all_to_all exchange also reorders the sender's rows chunk-major (one
  gather). The backward exchanges are synchronous.
* ``exchange``: ``"p2p"`` (the default) or ``"all_to_all"``, see step 3. The segment
  exchange copies no row outside the transport but sends R*El messages per direction
  instead of R; with gloo on 2 CPU cores it removed most of what expert parallelism added
  over a bare all-to-all of the same bytes (benchmarks/results/ep_cpu_202611.md). NB:
  ``CommDebugMode`` does not count point-to-point messages, only the counts all-to-all.
* ``dispatch_dtype=torch.float8_e4m3fn``: the dispatched rows travel as e4m3 with one
  fp32 scale per 1x128 block (``torch_moe.quantization.quantize_fp8``), about half the
  bytes of bf16 and a quarter of fp32; the routing weights, the combine and every
  backward all-to-all stay in the original dtype (the gradient passes the quantization
  straight through).
* ``node_size=L``: dispatch and combine use ``hierarchical_all_to_all_single`` (intra-node,
  then across nodes; the EP ranks taken node-major), bitwise the flat result; this is an
  all_to_all exchange (``exchange="p2p"`` with ``node_size`` raises).

Measured here (2 CPU ranks, gloo, and one H200 with NCCL at EP=1): plain and chunked EP
equal one process bitwise; FP8 dispatch gives 38-47 dB SQNR on the layer output and
28-44 dB on the gradients against plain EP.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from torch_moe.distributed.exchange import SegmentWork, all_to_all_segments
from torch_moe.distributed.hierarchical import hierarchical_all_to_all_single
from torch_moe.quantization import dequantize_fp8, quantize_fp8

__all__ = ["ExpertParallel"]

_T = TypeVar("_T")
_EXPERT_PARAMS = ("w13", "w2")
_FP8_BLOCK = (1, 128)  # dispatch quantization: one scale per 128 values of a row
_DISPATCH_DTYPES = (None, torch.float8_e4m3fn)
_EXCHANGES = (None, "p2p", "all_to_all")


@dataclass
class _EPGroup:
    """The expert-parallel process group of one layer and how to name this rank in errors."""

    group: dist.ProcessGroup
    size: int  # R
    rank: int  # this rank's index in the group
    global_ranks: list[int]

    def call(self, op: str, fn: Callable[[], _T]) -> _T:
        """Run a collective; a failure or a timeout names this rank and the operation."""
        try:
            return fn()
        except RuntimeError as e:
            raise RuntimeError(
                f"ExpertParallel: {op} failed on rank {dist.get_rank()} (expert-parallel rank "
                f"{self.rank} of {self.size}, group ranks {self.global_ranks}): {e}"
            ) from e


class _Pending:
    """An all-to-all in flight: ``wait()`` returns its output (after the collective is done)."""

    def __init__(
        self,
        out: Tensor,
        work: Any = None,
        ep: _EPGroup | None = None,
        op: str = "",
        keep_alive: Tensor | None = None,
    ) -> None:
        self.out, self.work, self.ep, self.op = out, work, ep, op
        self.keep_alive = keep_alive  # the input buffer, until the collective is done

    def wait(self) -> Tensor:
        if self.work is not None:
            work, self.work = self.work, None
            assert self.ep is not None
            self.ep.call(f"{self.op} all_to_all_single (wait)", work.wait)
            self.keep_alive = None
        return self.out


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with autograd; the backward sends the gradients back the same
    way (splits swapped, synchronously). With ``pending`` the forward collective is only
    issued (``async_op=True``) and ``pending.wait()`` completes it; the output must not be
    read before. Both directions report failures through ``_EPGroup.call``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        out_splits: list[int],
        in_splits: list[int],
        ep: _EPGroup,
        op: str,
        pending: list[_Pending] | None,
    ) -> Tensor:
        ctx.splits, ctx.ep, ctx.op = (out_splits, in_splits), ep, op
        if pending is None:
            return _all_to_all(x, out_splits, in_splits, ep, op)
        x = x.contiguous()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = ep.call(
            f"{op} all_to_all_single",
            lambda: dist.all_to_all_single(
                out, x, out_splits, in_splits, group=ep.group, async_op=True
            ),
        )
        pending.append(_Pending(out, work, ep, op, keep_alive=x))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        grad_x = _all_to_all(grad, in_splits, out_splits, ctx.ep, f"{ctx.op} backward")
        return grad_x, None, None, None, None, None


def _all_to_all(
    x: Tensor, out_splits: list[int], in_splits: list[int], ep: _EPGroup, op: str
) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    ep.call(
        f"{op} all_to_all_single",
        lambda: dist.all_to_all_single(out, x, out_splits, in_splits, group=ep.group),
    )
    return out


class _FP8AllToAll(torch.autograd.Function):
    """Dispatch in FP8: rows quantized in 1x128 blocks (e4m3, one fp32 scale per block),
    the fp8 bytes and the scales sent, dequantized to the input dtype on arrival. The
    backward sends the gradient in its own dtype and passes it straight through the
    quantization (as if it were the identity)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], ep: _EPGroup, op: str
    ) -> Tensor:
        ctx.splits, ctx.ep, ctx.op = (out_splits, in_splits), ep, op
        q, scale = quantize_fp8(x, _FP8_BLOCK)
        # gloo has no float8 type: the bytes travel as uint8
        q_recv = _all_to_all(q.view(torch.uint8), out_splits, in_splits, ep, f"{op} (fp8)")
        s_recv = _all_to_all(scale, out_splits, in_splits, ep, f"{op} (fp8 scales)")
        return dequantize_fp8(q_recv.view(q.dtype), s_recv, _FP8_BLOCK, dtype=x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        grad_x = _all_to_all(grad, in_splits, out_splits, ctx.ep, f"{ctx.op} backward")
        return grad_x, None, None, None, None


class _GatherRows(torch.autograd.Function):
    """``x[index]`` for a permutation ``index``; the backward is the gather by its inverse
    (no scatter-add, hence deterministic on every device)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _regroup_index(counts: Tensor, order: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """Rows stored as consecutive blocks of ``counts[b]`` rows, re-laid out with the blocks
    in ``order`` (new position -> old block): the gather index and its inverse, built on
    the device without a sync."""
    start = counts.cumsum(0) - counts
    counts_new, start_new = counts[order], start[order]
    shift = torch.repeat_interleave(
        start_new - (counts_new.cumsum(0) - counts_new), counts_new, output_size=num_rows
    )
    index = torch.arange(num_rows, device=counts.device) + shift
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(num_rows, device=counts.device)
    return index, inverse


def _transpose_order(rows: int, cols: int, device: torch.device) -> Tensor:
    """Block order that turns a row-major [rows, cols] block layout column-major."""
    return torch.arange(rows * cols, device=device).view(rows, cols).t().reshape(-1)


@contextmanager
def _local_expert_params(experts: nn.Module, chunk: slice | None = None) -> Iterator[None]:
    """Present the DTensor expert parameters to the module's forward as their local shards
    (or the experts ``chunk`` of them).

    NB: ``to_local()`` is differentiable (its backward wraps the gradient back into a
    ``Shard(0)`` DTensor), so the gradients land in the DTensor parameters. The entries are
    swapped in ``_parameters`` for the duration of the call only; whatever was there (an
    FSDP2-unsharded parameter, say) is put back.
    """
    saved = {name: experts._parameters[name] for name in _EXPERT_PARAMS}
    try:
        for name, p in saved.items():
            if isinstance(p, DTensor):
                local = p.to_local()
                experts._parameters[name] = local if chunk is None else local[chunk]  # type: ignore[assignment]
        yield
    finally:
        experts._parameters.update(saved)


class _SharedOverlap:
    """Runs the shared experts while the first dispatch is in flight (``num_chunks > 1``).

    A router pre-hook notes the layer input x [T, D]; the expert forward computes the shared
    experts on it right after issuing the first all-to-all and keeps the result; the
    layer's own call of the shared experts, which comes later in the same forward, gets it
    back. NB: the result is handed out only once, only within that forward (a layer
    forward hook drops it) and only for an input of the expected shape and dtype;
    otherwise the shared experts run as usual.
    """

    def __init__(self, moe: Any) -> None:
        self.shared = moe.shared_experts
        self.shared_forward = self.shared.forward
        self.x: Tensor | None = None
        self.result: Tensor | None = None
        self.num_overlapped = 0  # forwards whose shared experts ran during the dispatch
        moe.router.register_forward_pre_hook(self._note_input)
        moe.register_forward_hook(self._clear)
        self.shared.forward = self._forward

    def _note_input(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.x, self.result = args[0], None

    def _clear(self, *args: Any) -> None:
        self.x = self.result = None

    def run(self, dtype: torch.dtype) -> None:
        if self.x is not None:
            self.result = self.shared_forward(self.x.to(dtype))

    def _forward(self, x: Tensor) -> Tensor:
        result, self.result = self.result, None
        if result is not None and x.shape[:-1] == result.shape[:-1] and x.dtype == result.dtype:
            self.num_overlapped += 1
            return result
        return self.shared_forward(x)


class _SegmentPlan:
    """The segment tables of one forward (``exchange="p2p"``), from the one host sync.

    Rows leave this rank in the layer's permuted order (sorted by global expert, so the rows
    for rank d's local expert l are the block of expert ``e = d*El + l``) and arrive
    expert-major: chunk c's receive buffer holds its local experts ``[l0, l1)`` one after
    the other, each expert's rows ordered by source rank, as the unparallelized layer
    orders them. Chunk c sends rank d one segment per expert of the chunk; the combine
    sends the same segments back.
    """

    def __init__(
        self, send_E: list[int], recv_RL: list[list[int]], bounds: list[tuple[int, int]]
    ) -> None:
        R, El = len(recv_RL), len(recv_RL[0])
        start = [0]
        for n in send_E:
            start.append(start[-1] + n)
        self.used = start[-1]  # rows of x sent (the rest is alignment/capacity padding)
        self.num_local = El
        self.sent: list[list[list[tuple[int, int]]]] = []  # [c][d]: segments of x
        self.received: list[list[list[tuple[int, int]]]] = []  # [c][s]: of chunk c's buffer
        self.rows: list[int] = []  # [c]: rows chunk c receives
        for l0, l1 in bounds:
            self.sent.append(
                [[(start[d * El + j], send_E[d * El + j]) for j in range(l0, l1)] for d in range(R)]
            )
            received: list[list[tuple[int, int]]] = [[] for _ in range(R)]
            row = 0
            for j in range(l0, l1):  # local expert j, then by source rank
                for s in range(R):
                    received[s].append((row, recv_RL[s][j]))
                    row += recv_RL[s][j]
            self.received.append(received)
            self.rows.append(row)
        # chunk c's messages use tags [3*l0, 3*l1) (+ a base per direction): one per expert
        # segment and tensor (at most three: rows or fp8 rows and scales, routing weights)
        self.first_tag = [_TAGS_PER_SEGMENT * l0 for l0, _ in bounds]


_TAGS_PER_SEGMENT = 3
_SEGMENT_OPS = ("dispatch", "combine", "dispatch backward", "combine backward")


class _SegmentExchange:
    """One direction of every chunk's segment exchange: ``issue(c, ...)`` starts chunk c
    (asynchronously), ``wait(c)`` completes it. The combine and the backward of the
    dispatch send the received segments back (``reverse``)."""

    def __init__(self, plan: _SegmentPlan, ep: _EPGroup, op: str, reverse: bool) -> None:
        self.plan, self.ep, self.op, self.reverse = plan, ep, op, reverse
        self.first_tag = _SEGMENT_OPS.index(op) * _TAGS_PER_SEGMENT * plan.num_local
        self.inflight: dict[int, tuple[SegmentWork, list[Tensor]]] = {}

    def issue(self, c: int, outputs: list[Tensor], inputs: list[Tensor]) -> None:
        plan, ep = self.plan, self.ep
        sent, received = plan.sent[c], plan.received[c]
        out_segs, in_segs = (sent, received) if self.reverse else (received, sent)
        inputs = [t.contiguous() for t in inputs]
        tag = self.first_tag + plan.first_tag[c]
        work = ep.call(
            f"{self.op} all_to_all_segments",
            lambda: all_to_all_segments(
                outputs, inputs, out_segs, in_segs, ep.group, tag=tag, async_op=True
            ),
        )
        # (async_op=True: a SegmentWork); the inputs stay alive until the sends are done
        self.inflight[c] = (cast(SegmentWork, work), inputs)

    def wait(self, c: int) -> None:
        entry = self.inflight.pop(c, None)
        if entry is not None:
            self.ep.call(f"{self.op} all_to_all_segments (wait)", entry[0].wait)

    def wait_all(self) -> None:
        for c in list(self.inflight):
            self.wait(c)


class _Dispatch:
    """Every chunk's dispatch (rows and routing weights) as segments; see _SegmentDispatch."""

    def __init__(self, plan: _SegmentPlan, ep: _EPGroup, fp8: bool) -> None:
        self.plan, self.ep, self.fp8 = plan, ep, fp8
        self.exchange = _SegmentExchange(plan, ep, "dispatch", reverse=False)
        self.finish: dict[int, Callable[[], object]] = {}

    def issue(self, x: Tensor, w: Tensor | None) -> tuple[Tensor, ...]:
        """Issue every chunk; return chunk c's rows [N_c, D] (then weights [N_c])."""
        rows = self.plan.rows
        # the gradients' shapes and dtypes, without keeping x or w alive
        self.x_like, self.x_shape = x.new_empty(0), x.shape
        self.w_like = None if w is None else w.new_empty(0)
        xs = [x.new_empty((n, *x.shape[1:])) for n in rows]
        ws = [] if w is None else [w.new_empty(n) for n in rows]
        if self.fp8:  # one quantization of all rows, e4m3 bytes (gloo: as uint8) + scales
            q, scale = quantize_fp8(x, _FP8_BLOCK)
            q = q.view(torch.uint8)
        for c, n in enumerate(rows):
            outs, ins = [xs[c]], [x]
            if self.fp8:
                q_c, scale_c = q.new_empty((n, *q.shape[1:])), scale.new_empty(n, scale.shape[1])
                outs, ins = [q_c, scale_c], [q, scale]
                self.finish[c] = functools.partial(self._dequantize, xs[c], q_c, scale_c)
            if w is not None:
                outs, ins = [*outs, ws[c]], [*ins, w]
            self.exchange.issue(c, outs, ins)
        return (*xs, *ws)

    @staticmethod
    def _dequantize(out: Tensor, q: Tensor, scale: Tensor) -> None:
        out.copy_(dequantize_fp8(q.view(torch.float8_e4m3fn), scale, _FP8_BLOCK, dtype=out.dtype))

    def wait(self, c: int) -> None:
        """Complete chunk c's dispatch: its rows and weights are valid afterwards."""
        self.exchange.wait(c)
        finish = self.finish.pop(c, None)
        if finish is not None:
            with torch.no_grad():  # fills the (not yet used) output of _SegmentDispatch
                finish()

    def backward(self, grads: tuple[Tensor | None, ...]) -> tuple[Tensor, Tensor | None]:
        """Send every chunk's gradient segments back (in the gradient's dtype): every row
        of x went to exactly one segment, so the gradient of x is fully written."""
        C, x_shape = len(self.plan.rows), self.x_shape
        back = _SegmentExchange(self.plan, self.ep, "dispatch backward", reverse=True)
        grad_x = self.x_like.new_empty(x_shape)
        grad_w = None if self.w_like is None else self.w_like.new_empty(x_shape[0])
        for c, n in enumerate(self.plan.rows):
            outs = [grad_x] if grad_w is None else [grad_x, grad_w]
            ins = [_or_zeros(grads[c], (n, *x_shape[1:]), grad_x)]
            if grad_w is not None:
                ins.append(_or_zeros(grads[C + c], (n,), grad_w))
            back.issue(c, outs, ins)
        back.wait_all()
        return grad_x, grad_w


def _or_zeros(grad: Tensor | None, shape: tuple[int, ...], like: Tensor) -> Tensor:
    return like.new_zeros(shape) if grad is None else grad


class _SegmentDispatch(torch.autograd.Function):
    """Dispatch as segments (``exchange="p2p"``): returns every chunk's received rows
    [N_c, D] (then its routing weights [N_c]), rows expert-major. The exchanges are only
    issued: ``dispatch.wait(c)`` must come before chunk c's outputs are read. The
    backward sends each gradient segment back to its source (synchronously); FP8
    dispatch passes it straight through the quantization."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, dispatch: _Dispatch, x: Tensor, w: Tensor | None
    ) -> tuple[Tensor, ...]:
        ctx.dispatch = dispatch
        return dispatch.issue(x, w)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_x, grad_w = ctx.dispatch.backward(grads)
        return None, grad_x, grad_w


class _Combine:
    """Every chunk's combine as segments (the dispatch's segments in reverse) into one
    [used, D] output in the layer's permuted row order; see _SegmentCombine."""

    def __init__(self, plan: _SegmentPlan, ep: _EPGroup) -> None:
        self.plan, self.ep = plan, ep
        self.exchange = _SegmentExchange(plan, ep, "combine", reverse=True)
        self.out: Tensor | None = None

    def issue(self, c: int, y: Tensor) -> None:
        if self.out is None:
            self.out = y.new_empty((self.plan.used, *y.shape[1:]))
        self.exchange.issue(c, [self.out], [y.detach()])

    def backward(self, grad: Tensor) -> list[Tensor]:
        back = _SegmentExchange(self.plan, self.ep, "combine backward", reverse=False)
        grads = [grad.new_empty((n, *grad.shape[1:])) for n in self.plan.rows]
        for c, g in enumerate(grads):
            back.issue(c, [g], [grad])
        back.wait_all()
        return grads


class _SegmentCombine(torch.autograd.Function):
    """The combine's output once every chunk's segments have arrived. NB: each chunk's
    combine was issued as soon as its experts were done (``combine.issue``), before this
    function sees the chunk outputs ``ys`` as its inputs; the forward only waits. The
    backward sends the output gradient's segments to the experts' ranks."""

    @staticmethod
    def forward(ctx: Any, combine: _Combine, *ys: Tensor) -> Tensor:  # type: ignore[override]
        ctx.combine = combine
        combine.exchange.wait_all()
        return cast(Tensor, combine.out)  # set by the first chunk's issue (C >= 1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (None, *ctx.combine.backward(grad.contiguous()))


class _ExpertParallelForward:
    """Replaces ``moe.experts.forward``: dispatch -> local experts -> combine."""

    def __init__(self, moe: Any, ep: _EPGroup, num_experts: int, style: ExpertParallel) -> None:
        experts: nn.Module = moe.experts
        self.local_forward = experts.forward  # the module's own (bound) forward
        self.experts = experts
        self.ep = ep
        self.num_experts = num_experts
        self.num_chunks = style.num_chunks
        self.dispatch_dtype = style.dispatch_dtype
        self.node_size = style.node_size
        self.exchange = style.exchange
        self.shared = (
            _SharedOverlap(moe)
            if style.num_chunks > 1 and getattr(moe, "shared_experts", None) is not None
            else None
        )

    def _exchange(
        self,
        x: Tensor,
        out_splits: list[int],
        in_splits: list[int],
        op: str,
        pending: list[_Pending] | None = None,
        fp8: bool = False,
    ) -> Tensor:
        """One autograd all-to-all of rows (issued only, with ``pending``)."""
        ep = self.ep
        if fp8 and x.is_floating_point():
            out = _FP8AllToAll.apply(x, out_splits, in_splits, ep, op)
        elif self.node_size is not None:
            node_size = self.node_size
            out = ep.call(
                f"{op} hierarchical_all_to_all_single",
                lambda: hierarchical_all_to_all_single(
                    x, out_splits, in_splits, ep.group, node_size
                ),
            )
        else:
            return _AllToAll.apply(x, out_splits, in_splits, ep, op, pending)
        if pending is not None:
            pending.append(_Pending(out))
        return out

    def __call__(self, x: Tensor, offs: Tensor, row_weights: Tensor | None = None) -> Tensor:
        ep, E, C = self.ep, self.num_experts, self.num_chunks
        R = ep.size
        El = E // R
        M = x.shape[0]
        bounds = [(c * El // C, (c + 1) * El // C) for c in range(C)]  # local experts per chunk
        # 1. counts exchange: send_RL[r, l] rows for expert r*El + l, recv_RL[s, l] from rank s
        send_E = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
        recv_RL = _all_to_all(send_E, [El] * R, [El] * R, ep, "counts").view(R, El)
        run = self._segments if self.exchange == "p2p" else self._all_to_all
        y = run(x, offs, row_weights, send_E, recv_RL, bounds)
        used = y.shape[0]
        if used < M:  # alignment/capacity padding rows of the layer: zero outputs
            y = torch.cat([y, y.new_zeros((M - used, *y.shape[1:]))])
        return y

    def _send_dtype(self, x: Tensor) -> Tensor:
        dev_type = x.device.type
        if torch.is_autocast_enabled(dev_type) and x.is_floating_point():
            # the experts compute in the autocast dtype: cast before sending, not after
            # (the same values, and the backward sends gradients in that dtype too)
            x = x.to(torch.get_autocast_dtype(dev_type))
        return x

    def _run_shared(self, x: Tensor) -> None:
        """The shared experts while the first dispatch is in flight (num_chunks > 1)."""
        if self.shared is not None:
            dev_type = x.device.type
            autocast = torch.is_autocast_enabled(dev_type)
            self.shared.run(torch.get_autocast_dtype(dev_type) if autocast else x.dtype)

    def _local_experts(self, x: Tensor, offs: Tensor, w: Tensor | None, l0: int, l1: int) -> Tensor:
        """The module's own forward on the local experts [l0, l1) (all of them when C = 1)."""
        with _local_expert_params(self.experts, None if self.num_chunks == 1 else slice(l0, l1)):
            return self.local_forward(x, offs, w)

    def _segments(
        self,
        x: Tensor,
        offs: Tensor,
        w: Tensor | None,
        send_E: Tensor,
        recv_RL: Tensor,
        bounds: list[tuple[int, int]],
    ) -> Tensor:
        """Steps 2-5 with ``exchange="p2p"``: rows land expert-major (no reorder)."""
        E, (R, El), C = self.num_experts, recv_RL.shape, len(bounds)
        # 2. the one host sync: the segment tables of every chunk
        counts = torch.cat([send_E, recv_RL.reshape(-1)]).tolist()
        recv = [counts[E + s * El : E + (s + 1) * El] for s in range(R)]
        plan = _SegmentPlan(counts[:E], recv, bounds)
        x = self._send_dtype(x[: plan.used])
        w = None if w is None else w[: plan.used]
        # 3. dispatch: every chunk issued at once, chunk c waited before its experts run
        dispatch = _Dispatch(plan, self.ep, fp8=self.dispatch_dtype is not None)
        received = _SegmentDispatch.apply(dispatch, x, w)
        self._run_shared(x)
        combine = _Combine(plan, self.ep)
        ys = []
        for c, (l0, l1) in enumerate(bounds):
            dispatch.wait(c)
            offs_local = recv_RL[:, l0:l1].sum(0).cumsum(0).to(offs.dtype)
            w_c = None if w is None else received[C + c]
            # 4. the local experts; 5. their rows go home as soon as they are done
            y = self._local_experts(received[c], offs_local, w_c, l0, l1)
            combine.issue(c, y)
            ys.append(y)
        return _SegmentCombine.apply(combine, *ys)

    def _all_to_all(
        self,
        x: Tensor,
        offs: Tensor,
        row_weights: Tensor | None,
        send_E: Tensor,
        recv_RL: Tensor,
        bounds: list[tuple[int, int]],
    ) -> Tensor:
        """Steps 2-5 with ``exchange="all_to_all"``: source-major rows, reordered."""
        C = len(bounds)
        R, El = recv_RL.shape
        dev = x.device
        send_RL = send_E.view(R, El)
        # 2. the one host sync: every chunk's split lists
        sizes = torch.stack(
            [send_RL[:, l0:l1].sum(1) for l0, l1 in bounds]
            + [recv_RL[:, l0:l1].sum(1) for l0, l1 in bounds]
        ).tolist()
        send_splits, recv_splits = sizes[:C], sizes[C:]
        used = sum(map(sum, send_splits))
        x = self._send_dtype(x[:used])
        w = None if row_weights is None else row_weights[:used]
        if C > 1:  # rows chunk-major: for each chunk, for each rank, its experts' rows
            first_R1 = torch.arange(R, device=dev)[:, None] * El
            order = torch.cat(
                [(first_R1 + torch.arange(l0, l1, device=dev)).reshape(-1) for l0, l1 in bounds]
            )
            chunk_index, chunk_inverse = _regroup_index(send_E, order, used)
            x = _GatherRows.apply(x, chunk_index, chunk_inverse)
            if w is not None:
                w = _GatherRows.apply(w, chunk_index, chunk_inverse)
        x_chunks = x.split([sum(s) for s in send_splits])
        w_chunks = [None] * C if w is None else w.split([sum(s) for s in send_splits])
        overlap = C > 1  # chunks are issued asynchronously, one ahead

        # 3. dispatch (chunk c+1 is issued before chunk c's experts run when overlapping)
        def dispatch(c: int) -> tuple[_Pending, _Pending | None]:
            pending: list[_Pending] = []
            fp8 = self.dispatch_dtype is not None
            self._exchange(x_chunks[c], recv_splits[c], send_splits[c], "dispatch", pending, fp8)
            wc = w_chunks[c]
            if wc is not None:
                op = "dispatch (routing weights)"
                self._exchange(wc, recv_splits[c], send_splits[c], op, pending)
            return pending[0], pending[1] if len(pending) > 1 else None

        inflight = [dispatch(0)]
        self._run_shared(x)
        combined: list[_Pending] = []
        for c, (l0, l1) in enumerate(bounds):
            if overlap and c + 1 < C:
                inflight.append(dispatch(c + 1))
            x_pending, w_pending = inflight[c]
            x_recv = x_pending.wait()
            w_recv = None if w_pending is None else w_pending.wait()
            counts_RL = recv_RL[:, l0:l1]
            N = sum(recv_splits[c])
            # rows arrive (source rank, expert)-major; the experts want them expert-major
            reorder = R > 1 and l1 - l0 > 1
            if reorder:
                index, inverse = _regroup_index(
                    counts_RL.reshape(-1), _transpose_order(R, l1 - l0, dev), N
                )
                x_recv = _GatherRows.apply(x_recv, index, inverse)
                if w_recv is not None:
                    w_recv = _GatherRows.apply(w_recv, index, inverse)
            offs_local = counts_RL.sum(0).cumsum(0).to(offs.dtype)
            # 4. the local experts: the module's own forward on the local shards
            y = self._local_experts(x_recv, offs_local, w_recv, l0, l1)
            # 5. combine
            if reorder:
                y = _GatherRows.apply(y, inverse, index)
            pending: list[_Pending] | None = [] if overlap else None
            y = self._exchange(y, send_splits[c], recv_splits[c], "combine", pending)
            combined.append(pending[0] if pending else _Pending(y))
        y = torch.cat([p.wait() for p in combined]) if C > 1 else combined[0].wait()
        if C > 1:
            y = _GatherRows.apply(y, chunk_inverse, chunk_index)
        return y


def _config_fingerprint(moe: Any, style: ExpertParallel) -> dict[str, Any]:
    fields = dict(moe.config)
    experts = moe.experts
    fields["precision"] = getattr(experts, "precision", "bf16")
    fields["param_dtype"] = str(experts.w13.dtype)
    # the style decides which messages a rank sends and expects
    for name in ("num_chunks", "dispatch_dtype", "node_size", "exchange"):
        fields[f"ExpertParallel.{name}"] = str(getattr(style, name))
    return fields


def _check_same_config(moe: Any, ep: _EPGroup, style: ExpertParallel) -> None:
    fields = _config_fingerprint(moe, style)
    digest = hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()
    gathered: list[Any] = [None] * ep.size
    ep.call(
        "config fingerprint all_gather_object",
        lambda: dist.all_gather_object(gathered, (digest, fields), group=ep.group),
    )
    ref_digest, ref_fields = gathered[0]
    diffs = []
    for i, (d, f) in enumerate(gathered):
        if d == ref_digest:
            continue
        keys = sorted(set(f) | set(ref_fields), key=str)
        fields_txt = ", ".join(
            f"{k}={f.get(k)!r} (rank {ep.global_ranks[0]}: {ref_fields.get(k)!r})"
            for k in keys
            if f.get(k) != ref_fields.get(k)
        )
        diffs.append(f"rank {ep.global_ranks[i]}: {fields_txt}")
    if diffs:
        raise ValueError(
            "ExpertParallel: the MoE config differs across the expert-parallel ranks "
            f"{ep.global_ranks} (every rank must build the same layer): " + "; ".join(diffs)
        )


class ExpertParallel(ParallelStyle):
    """Shard a ``torch_moe.nn.MoE``'s experts over a 1-D mesh and dispatch tokens with
    all-to-all (see the module docstring).

    Example::

        mesh = init_device_mesh("cpu", (world_size,))
        moe = MoE(dim, hidden, num_experts, top_k)      # same seed on every rank
        parallelize_module(moe, mesh, ExpertParallel())
        y = moe(x_local)                                 # this rank's tokens

    Args:
        num_chunks: C >= 1. With C > 1 the local experts are split into C groups and the
            dispatch -> experts -> combine pipeline runs per group: group c+1's dispatch
            is issued asynchronously before group c's experts run, each combine is issued
            asynchronously and waited at the end, and the shared experts run while the
            first dispatch is in flight. Same results as C = 1 (every expert sees the
            same rows in the same order). Needs C <= E / R.
        dispatch_dtype: None (send rows in their dtype) or ``torch.float8_e4m3fn``: rows
            are quantized in 1x128 blocks (``quantize_fp8``) before the dispatch
            all-to-all, sent as fp8 bytes plus fp32 scales and dequantized after; the
            routing weights, the combine and the whole backward stay in the original dtype.
        node_size: None (one flat all-to-all) or L, the ranks per node: dispatch and
            combine use ``hierarchical_all_to_all_single`` over (node, local) (the EP
            group's ranks taken node-major), same results. Must divide the EP degree.
        src_data_rank: the rank whose full expert weights are scattered to the shards
            (default 0); None keeps each rank's own slice (no communication).
        exchange: how rows move, same results either way. ``"p2p"`` (the default without
            ``node_size``): one point-to-point segment per (rank, expert) with
            ``all_to_all_segments``, so rows arrive expert-major and go back in the
            sender's order without any reorder. ``"all_to_all"`` (the default, and the
            only choice, with ``node_size``): one ``all_to_all_single`` per direction
            (R messages instead of R*El), rows reordered on arrival and before the combine.
            With gloo on CPU p2p was the faster from 2048 tokens per rank and as fast
            below; with NCCL neither is measured yet (many small messages in one NCCL
            group against one all-to-all kernel and two gathers at HBM speed).
    """

    def __init__(
        self,
        *,
        num_chunks: int = 1,
        dispatch_dtype: torch.dtype | None = None,
        node_size: int | None = None,
        src_data_rank: int | None = 0,
        exchange: str | None = None,
    ) -> None:
        super().__init__()
        if exchange not in _EXCHANGES:
            raise ValueError(
                f"ExpertParallel: exchange must be None, 'p2p' or 'all_to_all', got {exchange!r}"
            )
        if exchange == "p2p" and node_size is not None:
            raise ValueError(
                f"ExpertParallel: node_size={node_size} needs exchange='all_to_all' (the "
                "hierarchical all-to-all), got exchange='p2p'"
            )
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
            raise ValueError(
                f"ExpertParallel: num_chunks must be a positive int, got {num_chunks!r}"
            )
        if dispatch_dtype not in _DISPATCH_DTYPES:
            raise ValueError(
                f"ExpertParallel: dispatch_dtype must be None or torch.float8_e4m3fn, "
                f"got {dispatch_dtype!r}"
            )
        if node_size is not None and (
            isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1
        ):
            raise ValueError(
                f"ExpertParallel: node_size must be None or a positive int, got {node_size!r}"
            )
        self.num_chunks = num_chunks
        self.dispatch_dtype = dispatch_dtype
        self.node_size = node_size
        self.src_data_rank = src_data_rank
        self.exchange = exchange or ("p2p" if node_size is None else "all_to_all")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        experts = getattr(module, "experts", None)
        if not all(isinstance(getattr(experts, n, None), nn.Parameter) for n in _EXPERT_PARAMS):
            raise TypeError(
                "ExpertParallel: expected a torch_moe.nn.MoE (a module with experts.w13 and "
                f"experts.w2 parameters), got {type(module).__name__}"
            )
        assert experts is not None  # for mypy; checked above
        if device_mesh.ndim != 1:
            raise ValueError(
                "ExpertParallel: expected a 1-D device mesh (slice the expert-parallel dim, "
                f"e.g. mesh['ep']), got a {device_mesh.ndim}-D mesh {device_mesh}"
            )
        if any(isinstance(getattr(experts, n), DTensor) for n in _EXPERT_PARAMS):
            raise ValueError("ExpertParallel: this MoE's experts are already parallelized")
        num_experts: int = module.num_experts  # type: ignore[assignment]
        R = device_mesh.size()
        if num_experts % R != 0:
            raise ValueError(
                f"ExpertParallel: num_experts ({num_experts}) must be divisible by the "
                f"expert-parallel degree ({R}); change num_experts or the mesh size"
            )
        if self.num_chunks > num_experts // R:
            raise ValueError(
                f"ExpertParallel: num_chunks ({self.num_chunks}) must be at most the number of "
                f"local experts, num_experts // EP degree = {num_experts} // {R} = "
                f"{num_experts // R}"
            )
        if self.node_size is not None and R % self.node_size != 0:
            raise ValueError(
                f"ExpertParallel: node_size ({self.node_size}) must divide the expert-parallel "
                f"degree ({R})"
            )
        if getattr(module, "capacity_factor", None) is not None:
            raise NotImplementedError(
                "ExpertParallel: capacity_factor is not supported with expert parallelism "
                f"(got capacity_factor={module.capacity_factor}); build the MoE dropless "
                "(capacity_factor=None)"
            )
        ep = _EPGroup(
            group=device_mesh.get_group(),
            size=R,
            rank=device_mesh.get_local_rank(),
            global_ranks=device_mesh.mesh.flatten().tolist(),
        )
        _check_same_config(module, ep, self)
        for name in _EXPERT_PARAMS:
            p: Tensor = getattr(experts, name)
            dp = ep.call(
                f"distribute_tensor({name})",
                functools.partial(
                    distribute_tensor,
                    p.detach(),
                    device_mesh,
                    [Shard(0)],
                    src_data_rank=self.src_data_rank,
                ),
            )
            experts.register_parameter(name, nn.Parameter(dp, requires_grad=p.requires_grad))
        experts.forward = _ExpertParallelForward(module, ep, num_experts, self)
        return module
