"""Expert parallelism: the ``ExpertParallel`` style and the dispatcher it gives the layer.

Legend: T tokens of this rank, D dim, E experts, R expert-parallel ranks, El = E/R local
experts, M rows of this rank's permuted buffer, C chunks.

``parallelize_module(moe, ep_mesh, ExpertParallel())`` on a 1-D ``DeviceMesh``:

* ``moe.experts.w13`` [E, 2F, D] and ``moe.experts.w2`` [E, D, F] (and the experts'
  biases ``b13`` [E, 2F] / ``b2`` [E, D] when they have them) become DTensor parameters
  ``Shard(0)`` over the mesh (``distribute_module`` with a partition function): EP rank r
  holds experts ``[r*El, (r+1)*El)``. Their values come from ``src_data_rank`` (rank 0 by
  default, like the other parallel styles); ``src_data_rank=None`` keeps each rank's own
  slice without communication. ``GroupedExperts.forward`` runs on the local shards
  (``to_local()``, differentiable, so the gradients are ``Shard(0)`` DTensors).
* ``moe.dispatcher`` becomes an :class:`ExpertParallelDispatcher`, a submodule the layer's
  forward calls explicitly: a plan (one all-to-all of the per-expert row counts, one copy
  of them to the host), then per chunk of local experts ``dispatch`` -> the experts ->
  ``combine``, each a ``torch_moe::`` custom op (:mod:`torch_moe.distributed.dispatch`).
  Nothing else changes: no method is replaced, no hook is installed, and the module tree
  says what runs (``print(moe)``).
* The router, the ``expert_bias`` buffer and the shared experts stay plain (replicated)
  tensors; their gradients are each rank's own, to be summed by the data-parallel wrapper
  over the same ranks (DDP, FSDP2, or ``all_reduce``). The expert-weight gradients are
  complete: the combine's backward carries every rank's output gradient to the experts'
  owner.
* ``moe(x)`` takes this rank's tokens (any number, zero included) and returns its outputs.
  Dropless only (``capacity_factor`` raises ``NotImplementedError``). Statistics and losses
  are per rank; ``MoE.update_expert_bias(rate, group=...)`` sums the loads over the group it
  is given (the ranks whose tokens the layer routes: data-parallel x expert-parallel).

Options (each gives the plain path's results, except FP8, which quantizes what it sends;
with ``num_chunks`` a chunk's fewer rows can round a row differently, within a few ulp: a
clamped or ``swigluoai`` gate's sigmoid, cut into ATen's vector and scalar parts by the
rows around it; an expert bias's gradient, which ``embedding_bag``'s backward sums in an
order set by all the indices; a GEMM whose kernel the CPU probe picks per shape class):

* ``num_chunks=C``: the local experts are split into C contiguous groups and dispatch ->
  experts -> combine run per group, so that a compiled graph can overlap one group's
  exchange with another's experts (``torch_moe._inductor``'s EP overlap pass schedules it,
  and its chunk pass, ``torch.compile(..., options=torch_moe._inductor.options(ep_chunks=C))``
  or ``config.ep_chunks = C``, makes the same C chunks out of a layer built with one; eager
  runs the groups one after the other). Needs C <= El.
* ``exchange``: ``"p2p"`` (default without ``node_size``): one point-to-point segment per
  (rank, expert), rows land expert-major with no reorder; ``"all_to_all"``: one
  ``all_to_all_single`` per direction and a gather on arrival.
  NB: ``CommDebugMode`` counts the all-to-alls (the counts exchange, and the rows with
  ``"all_to_all"``), not point-to-point sends.
* ``dispatch_dtype=torch.float8_e4m3fn``: dispatched rows travel as e4m3 with 1x128-block
  scales (``quantize_fp8``); the routing weights, the combine and the backward stay in the
  original dtype.
* ``node_size=L``: the hierarchical (intra-node, then inter-node) all-to-all
  (``exchange="all_to_all"`` only).

Faults: ``num_experts`` not divisible by the EP degree raises before any collective; ranks
whose configs differ (a fingerprint compared with ``all_gather_object``) raise on every rank
naming the ranks and fields; ranks that call the layer in different modes (autocast dtype,
grad mode, ``microbatches=2``'s schedule in eval mode: the plan carries each rank's) raise
``RuntimeError`` on every rank at the first exchange, naming each rank's mode (the
low-latency exchange's first all-to-all, a header of the plan's shape, carries the modes
too, and whether a rank is over ``max_tokens_per_rank``); a collective that fails or
times out raises ``RuntimeError`` naming the rank and the operation.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from torch_moe.distributed import dispatch as _dispatch  # noqa: F401  (registers the ops)
from torch_moe.distributed.dispatch import (
    _MODES_DIFFER,
    _check_modes,
    chunk_bounds,
    chunk_offsets,
    mode_word,
)
from torch_moe.quantization import dequantize_fp8, quantize_fp8

__all__ = ["ExpertParallel", "ExpertParallelDispatcher"]

Exchange = Literal["p2p", "all_to_all"]
Mode = Literal["training", "low_latency"]
_EXPERT_PARAMS = ("w13", "w2")
_EXPERT_BIASES = ("b13", "b2")  # GroupedExperts(bias=True): [E, 2F], [E, D], sharded alike
_DISPATCH_DTYPES = (None, torch.float8_e4m3fn)
_FP8_BLOCK = (1, 128)  # FP8 dispatch: one scale per 128 values of a row
_ops = torch.ops.torch_moe


class ExpertParallelDispatcher(nn.Module):
    """Moves a layer's permuted rows to the experts' ranks and back (``MoE.dispatcher``).

    The layer calls, per forward::

        counts = dispatcher.plan(offs, x_perm, records_grad)  # [E + R*El + R] int64, host
        for l0, l1 in dispatcher.chunks:                      # local experts per chunk
            x_c, w_c, offs_c = dispatcher.dispatch(x_perm, row_w, counts, (l0, l1))
            y_c = experts(x_c, offs_c, w_c, expert_range=(l0, l1))
            y = y + dispatcher.combine(y_c, counts, (l0, l1), x_perm.shape[0])
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
        *,
        num_chunks: int = 1,
        exchange: Exchange = "p2p",
        dispatch_dtype: torch.dtype | None = None,
        node_size: int | None = None,
        mode: Mode = "training",
        max_tokens_per_rank: int | None = None,
        microbatches: int = 1,
    ) -> None:
        super().__init__()
        self.mode: Mode = mode
        self.max_tokens_per_rank = max_tokens_per_rank
        self.microbatches = microbatches
        self.group_name = group.group_name
        self.world = dist.get_world_size(group)
        self.num_experts = num_experts
        self.num_local = num_experts // self.world
        self.exchange: Exchange = exchange
        self.fp8 = dispatch_dtype is not None
        self.node_size = node_size or 0
        self.chunks = chunk_bounds(0, self.num_local, num_chunks)

    def plan(
        self, offs: Tensor, x: Tensor, records_grad: bool, microbatches: bool = False
    ) -> Tensor:
        """Rows per global expert on this rank, then rows per (source rank, local expert)
        received, then every rank's call mode (the dtype :meth:`dispatch` sends ``x`` in,
        ``records_grad``: whether autograd records the exchanges, and ``microbatches``:
        whether it is a plan of the two micro-batches' schedule): one all-to-all of E + R
        int64 and one copy to the host (the only sync). The exchanges refuse a plan whose
        modes differ (``dispatch.py``'s module doc)."""
        R, El = self.world, self.num_local
        send_E = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
        chunks = 1 if microbatches else len(self.chunks)  # (the micro-batches: one each)
        mode = mode_word(
            self._send_dtype(x), records_grad, microbatches=microbatches, chunks=chunks
        )
        recv = self._plan_all_to_all(send_E.view(R, El), mode, "counts all_to_all")
        return torch.cat([send_E, recv[:, :El].reshape(-1), recv[:, El]]).cpu()

    def _plan_all_to_all(self, counts_RL: Tensor, mode: int, op: str) -> Tensor:
        """The plan's all-to-all: to each rank d its row ``counts_RL[d]`` (int64 [El]) and
        ``mode``; returns the rows received [R, El + 1]. The low-latency header goes the
        same way, so that a rank on the training exchange meets it as a plan."""
        R, El = self.world, self.num_local
        send = torch.cat([counts_RL, counts_RL.new_full((R, 1), mode)], 1).reshape(-1)
        splits = [El + 1] * R
        return self._collective(
            op,
            lambda: funcol.wait_tensor(
                funcol.all_to_all_single(send, splits, splits, self.group_name)
            ),
        ).view(R, El + 1)

    @staticmethod
    def _send_dtype(x: Tensor) -> torch.dtype:
        """The dtype :meth:`dispatch` sends ``x`` in: under autocast the experts compute in
        the autocast dtype, so that is sent (the backward follows it)."""
        if torch.is_autocast_enabled(x.device.type) and x.is_floating_point():
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype

    def _collective(self, op: str, fn):  # type: ignore[no-untyped-def]
        """``fn()``, a collective of the group; in eager a failure or a timeout names this
        rank and the operation (:func:`_call`: the counts exchange is every forward's first
        collective, where a peer that raised or took another path shows first); a compiled
        graph runs it as traced."""
        if torch.compiler.is_compiling():
            return fn()
        return _call(_resolve_process_group(self.group_name), op, fn)

    def dispatch(
        self, x: Tensor, row_weights: Tensor | None, counts: Tensor, chunk: tuple[int, int]
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """This rank's rows for the chunk's experts of every rank, and the rows received for
        its own: ``(x [N, D], row_weights [N] or None, offs [l1 - l0] int32)``."""
        l0, l1 = chunk
        x = x.to(self._send_dtype(x))
        x_recv, w_recv = _ops.ep_dispatch(
            x, row_weights, counts, self.group_name, self.num_experts, l0, l1,
            self.exchange, self.node_size, self.fp8,
        )  # fmt: skip
        # the counts live on the host (plan's one sync); the experts want offs beside x
        offs = chunk_offsets(counts, self.num_experts, self.world, l0, l1).to(x_recv.device)
        return x_recv, (w_recv if row_weights is not None else None), offs

    def combine(self, y: Tensor, counts: Tensor, chunk: tuple[int, int], num_rows: int) -> Tensor:
        """The chunk's expert outputs back in this rank's permuted rows [num_rows, D]; the
        rows of other chunks (and alignment padding) are zero."""
        l0, l1 = chunk
        return _ops.ep_combine(
            y, counts, self.group_name, self.num_experts, l0, l1, self.exchange,
            self.node_size, num_rows,
        )  # fmt: skip

    # the asynchronous halves (inference: no autograd), for the micro-batch schedule
    def dispatch_start(
        self, x: Tensor, row_weights: Tensor | None, counts: Tensor, chunk: tuple[int, int]
    ) -> Tensor:
        """Issue ``dispatch`` (returns a handle for :meth:`dispatch_wait`)."""
        tensors = [x] if row_weights is None else [x, row_weights]
        return _ops.ep_start(
            tensors, counts, self.group_name, self.num_experts, *chunk, self.exchange,
            self.node_size, "dispatch", self.fp8, -1,
        )  # fmt: skip

    def dispatch_wait(
        self,
        handle: Tensor,
        x: Tensor,
        row_weights: Tensor | None,
        counts: Tensor,
        chunk: tuple[int, int],
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """Complete a :meth:`dispatch_start`: what :meth:`dispatch` returns. The handle goes
        through ``wait_tensor``, which waits for the exchange (registered with c10d's
        work registry by ``ep_start``) and which Inductor does not move a collective next
        to: a compiled graph keeps the start where the schedule issued it."""
        tensors = [x] if row_weights is None else [x, row_weights]
        outs = _ops.ep_wait(funcol.wait_tensor(handle), tensors, "dispatch", -1)
        offs = chunk_offsets(counts, self.num_experts, self.world, *chunk).to(outs[0].device)
        return outs[0], (outs[1] if row_weights is not None else None), offs

    def combine_start(
        self, y: Tensor, counts: Tensor, chunk: tuple[int, int], num_rows: int
    ) -> Tensor:
        """Issue ``combine`` (returns a handle for :meth:`combine_wait`)."""
        return _ops.ep_start(
            [y], counts, self.group_name, self.num_experts, *chunk, self.exchange,
            self.node_size, "combine", False, num_rows,
        )  # fmt: skip

    def combine_wait(self, handle: Tensor, y: Tensor, num_rows: int) -> Tensor:
        """Complete a :meth:`combine_start`: what :meth:`combine` returns."""
        return _ops.ep_wait(funcol.wait_tensor(handle), [y], "combine", num_rows)[0]

    def run_low_latency(
        self, experts: nn.Module, x: Tensor, ids_TK: Tensor, perm: Any, row_weights: Tensor
    ) -> Tensor:
        """Inference exchange with fixed-size buffers: no counts round trip, no host sync,
        shapes from ``max_tokens_per_rank`` only (CUDA-graph capturable).

        Every rank sends every other rank a buffer of B = max_tokens_per_rank * K rows (its
        rows for that rank's experts first, unused slots marked -1) with one all-to-all of
        equal splits, and gets the results back the same way. The owner sorts what it got
        by local expert (stable: by source rank, then the sender's order, as the training
        exchange delivers them), so every expert sees the same rows in the same order as in
        training: the same outputs. Returns this rank's rows [M, D] in its permuted order.

        The first all-to-all is a header of the training plan's shape carrying each rank's
        mode word (:meth:`_exchange_header`): ranks in different autocast modes, a rank that
        took the training exchange, or one over its token budget raise on every rank
        before a row moves (they would exchange buffers of different sizes, which gloo
        aborts the process on, or leave the peers waiting). Then one all-to-all carries
        each slot's row (e4m3 codes and scales with FP8 dispatch), local expert and weight
        as bytes, and one brings the results back: three in all, each reading the one
        before, so no compiler can issue them in another order on another rank.
        """
        T = x.shape[0]
        K = ids_TK.shape[1]
        cap = self.max_tokens_per_rank
        assert cap is not None  # (the style's constructor requires it with this mode)
        R, El, E = self.world, self.num_local, self.num_experts
        dtype = self._send_dtype(x)  # the experts' dtype under autocast, as in training
        word = mode_word(dtype, False, low_latency=True, over_budget=T > cap)
        words = self._exchange_header(word, x.device)
        if T > cap:  # (after the header: the peers raise too, naming this rank)
            msg = (
                f"ExpertParallel(mode='low_latency'): this rank has {T} tokens, more than "
                f"max_tokens_per_rank={cap}; raise max_tokens_per_rank (nothing is dropped)"
            )
            if not torch.compiler.is_compiling():
                raise ValueError(msg)
            # a traced graph raises when it runs (after the header, as its peers do)
            torch._assert_async(torch.zeros((), dtype=torch.bool, device=x.device), msg)
            return x.new_zeros(perm.row_to_slot.shape[0], x.shape[1])
        ok = self._check_words(words, word)
        x = x.to(dtype)
        B = cap * K  # slots per destination rank
        row_to_slot, offs = perm.row_to_slot, perm.offs
        M = row_to_slot.shape[0]
        dev = x.device
        # each permuted row's expert, destination rank and slot there (no host sync)
        rows = torch.arange(M, device=dev)
        expert = torch.searchsorted(offs.to(torch.int64), rows, right=True)  # E: padding/tail
        valid = (row_to_slot >= 0) & (expert < E)
        dest = torch.where(valid, expert // El, 0)
        ends = offs.to(torch.int64).view(R, El)[:, -1]
        dest_start = torch.cat([ends.new_zeros(1), ends[:-1]])
        slot = torch.where(valid, dest * B + rows - dest_start[dest], R * B)  # R*B: dump row
        tokens = torch.where(valid, row_to_slot // K, 0)
        # (the slots read the header's check: the rows' all-to-all cannot be issued before
        # the header's on any rank, whatever order a compiler gives independent collectives)
        local_expert = torch.where(valid & ok, expert % El, -1).to(torch.int32)
        send_e = local_expert.new_full((R * B + 1,), -1).index_copy_(0, slot, local_expert)
        send_w = row_weights.new_zeros(R * B + 1).index_copy_(0, slot, row_weights)
        splits = [B] * R
        # each send slot's token (T: an unused slot, which reads an appended zero row): one
        # gather of the send buffer, no zero-fill and scatter of [R*B, D]
        send_tok = torch.full((R * B + 1,), T, dtype=torch.int64, device=dev)
        send_tok = send_tok.index_copy_(0, slot, torch.where(valid, tokens, T))[: R * B]
        if self.fp8:  # the T tokens quantized once (1x128 blocks); e4m3 rows and scales travel
            q, scale = quantize_fp8(x, _FP8_BLOCK)
            rows_parts = [q.view(torch.uint8), scale]
        else:
            rows_parts = [x]
        # one all-to-all of every slot's bytes: its row (and scales), local expert, weight
        parts = [self._pad_row(p).index_select(0, send_tok) for p in rows_parts]
        parts += [send_e[: R * B, None], send_w[: R * B, None]]
        recv_parts = self._exchange_packed(parts, splits)
        recv_e, recv_w = recv_parts[-2].view(-1), recv_parts[-1].view(-1)
        if self.fp8:
            recv_q = recv_parts[0].view(torch.float8_e4m3fn)
            recv_x = dequantize_fp8(recv_q, recv_parts[1], _FP8_BLOCK, x.dtype)
        else:
            recv_x = recv_parts[0]
        # by local expert (unused slots last: expert El); K = 1 per received row
        key = torch.where(recv_e >= 0, recv_e, El).to(torch.int64)[:, None]
        perm2 = torch.ops.torch_moe.permute_indices(key, El + 1, 1, None)
        r2s, s2r, offs2 = perm2[0], perm2[1], perm2[2]
        w_sorted = recv_w.index_select(0, r2s)
        y_sorted = experts.forward_tokens(recv_x, r2s, s2r, offs2[:El], w_sorted)  # type: ignore[operator]
        y_recv = torch.ops.torch_moe.unpermute(y_sorted, s2r, r2s, None)  # back to recv order
        back = self._all_to_all(y_recv, splits)
        y = back.index_select(0, torch.where(valid, slot, 0))
        return torch.where(valid[:, None], y, 0)

    def _exchange_header(self, word: int, device: torch.device) -> Tensor:
        """The low-latency exchange's first all-to-all: the training plan's
        (:meth:`_plan_all_to_all`, zero counts and this rank's mode word), so that a peer
        that took the training exchange reads it as a plan and raises at its mode check.
        Returns every rank's word [R]."""
        zeros = torch.zeros(self.world, self.num_local, dtype=torch.int64, device=device)
        return self._plan_all_to_all(zeros, word, "low-latency header all_to_all")[:, -1]

    def _check_words(self, words: Tensor, word: int) -> Tensor:
        """Every rank's mode word equals this rank's: in eager on the CPU a mismatch raises
        naming each rank's mode; compiled or on a GPU (no host sync) through
        ``torch._assert_async``. Returns the check (a bool tensor) for the exchange's
        buffers to read."""
        ok = (words == word).all()
        if torch.compiler.is_compiling() or words.device.type != "cpu":
            torch._assert_async(
                ok,
                f"ExpertParallel: the ranks called the layer in different modes; {_MODES_DIFFER}",
            )
        else:
            _check_modes(words.tolist(), _resolve_process_group(self.group_name))
        return ok

    def _exchange_packed(self, parts: list[Tensor], splits: list[int]) -> list[Tensor]:
        """Tensors [N, c_i] of any dtypes, N = sum(splits), sent as one all-to-all of their
        bytes side by side ([N, sum of the rows' bytes] uint8); returns them received, in
        their dtypes."""
        send = torch.cat([p.contiguous().view(torch.uint8) for p in parts], 1)
        recv = self._all_to_all(send, splits)
        out, col = [], 0
        for p in parts:
            width = p.shape[1] * p.element_size()
            out.append(recv[:, col : col + width].contiguous().view(p.dtype))
            col += width
        return out

    @staticmethod
    def _pad_row(t: Tensor) -> Tensor:
        """t [T, ...] with a zero row appended (row T)."""
        return torch.cat([t, t.new_zeros((1, *t.shape[1:]))])

    def _all_to_all(self, t: Tensor, splits: list[int]) -> Tensor:
        """A functional all-to-all of equal splits (static shapes; traced by Dynamo)."""
        wire = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        out = self._collective(
            "low-latency all_to_all",
            lambda: funcol.wait_tensor(
                funcol.all_to_all_single(wire, splits, splits, self.group_name)
            ),
        )
        return out.view(t.dtype)

    def extra_repr(self) -> str:
        opts = f"world={self.world}, num_experts={self.num_experts}, chunks={len(self.chunks)}"
        if self.mode != "training":
            opts += f", mode={self.mode!r}, max_tokens_per_rank={self.max_tokens_per_rank}"
        if self.microbatches > 1:
            opts += f", microbatches={self.microbatches}"
        opts += f", exchange={self.exchange!r}"
        if self.fp8:
            opts += ", dispatch_dtype=torch.float8_e4m3fn"
        if self.node_size:
            opts += f", node_size={self.node_size}"
        return opts


def _call(group: dist.ProcessGroup, op: str, fn):  # type: ignore[no-untyped-def]
    """A collective of the style's setup; a failure names this rank and the operation."""
    try:
        return fn()
    except RuntimeError as e:
        ranks = dist.get_process_group_ranks(group)
        raise RuntimeError(
            f"ExpertParallel: {op} failed on rank {dist.get_rank()} (expert-parallel rank "
            f"{dist.get_rank(group)} of {len(ranks)}, group ranks {ranks}): {e}"
        ) from e


def _config_fingerprint(moe: Any, style: ExpertParallel) -> dict[str, Any]:
    fields = dict(moe.config)
    experts = moe.experts
    fields["precision"] = getattr(experts, "precision", "bf16")
    fields["param_dtype"] = str(experts.w13.dtype)
    # the style decides which messages a rank sends and expects
    for name in (
        "num_chunks",
        "dispatch_dtype",
        "node_size",
        "exchange",
        "mode",
        "max_tokens_per_rank",
        "microbatches",
        "src_data_rank",  # (where the weights come from: one rank's, or each rank's own)
    ):
        fields[f"ExpertParallel.{name}"] = str(getattr(style, name))
    return fields


def _check_same_config(
    moe: Any, group: dist.ProcessGroup, style: ExpertParallel, local: Exception | None = None
) -> None:
    """Every rank's config fingerprint and its own checks' failure (``local``) gathered:
    a rank whose checks failed raises that, the others name it and its message. (A rank
    that raised before the collective left the others waiting in it until the process
    group's timeout, then a bare timeout.)"""
    fields: dict[str, Any] = {}
    if local is None:
        try:
            fields = _config_fingerprint(moe, style)
        except Exception as e:
            local = e
    failure = None if local is None else f"{type(local).__name__}: {local}"
    digest = hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()
    ranks = dist.get_process_group_ranks(group)
    gathered: list[Any] = [None] * len(ranks)
    _call(
        group,
        "config fingerprint all_gather_object",
        lambda: dist.all_gather_object(gathered, (digest, fields, failure), group=group),
    )
    if local is not None:
        raise local
    failed = [f"rank {ranks[i]}: {f}" for i, (_, _, f) in enumerate(gathered) if f is not None]
    if failed:
        raise ValueError(
            "ExpertParallel: the layer was refused on other expert-parallel ranks of "
            f"{ranks}: " + "; ".join(failed)
        )
    ref_digest, ref_fields, _ = gathered[0]
    diffs = []
    for i, (d, f, _) in enumerate(gathered):
        if d == ref_digest:
            continue
        keys = sorted(set(f) | set(ref_fields), key=str)
        fields_txt = ", ".join(
            f"{k}={f.get(k)!r} (rank {ranks[0]}: {ref_fields.get(k)!r})"
            for k in keys
            if f.get(k) != ref_fields.get(k)
        )
        diffs.append(f"rank {ranks[i]}: {fields_txt}")
    if diffs:
        raise ValueError(
            "ExpertParallel: the MoE config differs across the expert-parallel ranks "
            f"{ranks} (every rank must build the same layer): " + "; ".join(diffs)
        )


class ExpertParallel(ParallelStyle):
    """Shard a ``torch_moe.nn.MoE``'s experts over a 1-D mesh and dispatch tokens to them
    (see the module docstring).

    Example::

        mesh = init_device_mesh("cpu", (world_size,))
        moe = MoE(dim, hidden, num_experts, top_k)      # same seed on every rank
        parallelize_module(moe, mesh, ExpertParallel())
        y = moe(x_local)                                 # this rank's tokens

    Args:
        num_chunks: C >= 1 contiguous groups of local experts, dispatched and combined one
            group at a time (compiled graphs overlap them). Needs C <= E / R.
        dispatch_dtype: None or ``torch.float8_e4m3fn`` (FP8 dispatch of the rows).
        node_size: None (a flat exchange) or L, the ranks per node (hierarchical
            all-to-all; must divide the EP degree; ``exchange="all_to_all"``).
        src_data_rank: the rank whose full expert weights are scattered to the shards
            (default 0); None keeps each rank's own slice (no communication).
            ``parallelize_module`` sets it from its own ``src_data_rank=`` argument (0 by
            default), as for torch's styles: pass it there.
        exchange: ``"p2p"`` (the default without ``node_size``) or ``"all_to_all"``.
        mode: ``"training"`` (the exchanges above, everywhere) or ``"low_latency"``: in eval
            mode without autograd the layer exchanges fixed-size buffers of
            ``max_tokens_per_rank * top_k`` rows per rank pair with one all-to-all per
            direction (no counts exchange, no host sync: CUDA-graph capturable), the same
            outputs; with autograd it runs the training exchange. A rank with more than
            ``max_tokens_per_rank`` tokens raises (nothing is dropped).
        max_tokens_per_rank: the static token bound of ``mode="low_latency"``.
        microbatches: 1, or 2 for prefill (inference, ``mode="training"``): the batch runs as
            two micro-batches, the second's dispatch issued before the first's experts and
            the first's combine before the second's experts, so each exchange overlaps the
            other micro-batch's expert compute; the same outputs.
    """

    def __init__(
        self,
        *,
        num_chunks: int = 1,
        dispatch_dtype: torch.dtype | None = None,
        node_size: int | None = None,
        src_data_rank: int | None = 0,
        exchange: Exchange | None = None,
        mode: Mode = "training",
        max_tokens_per_rank: int | None = None,
        microbatches: int = 1,
    ) -> None:
        super().__init__()
        if microbatches not in (1, 2):
            raise ValueError(f"ExpertParallel: microbatches must be 1 or 2, got {microbatches!r}")
        if mode not in ("training", "low_latency"):
            raise ValueError(
                f"ExpertParallel: mode must be 'training' or 'low_latency', got {mode!r}"
            )
        if mode == "low_latency" and (
            isinstance(max_tokens_per_rank, bool)
            or not isinstance(max_tokens_per_rank, int)
            or max_tokens_per_rank < 1
        ):
            raise ValueError(
                "ExpertParallel(mode='low_latency') needs max_tokens_per_rank, a positive int "
                f"(the buffers' static bound), got {max_tokens_per_rank!r}"
            )
        if exchange not in (None, "p2p", "all_to_all"):
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
        self.exchange: Exchange = exchange or ("p2p" if node_size is None else "all_to_all")
        self.mode: Mode = mode
        self.max_tokens_per_rank = max_tokens_per_rank
        self.microbatches = microbatches

    def _check(self, module: nn.Module, device_mesh: DeviceMesh) -> tuple[nn.Module, int]:
        experts = getattr(module, "experts", None)
        if not all(isinstance(getattr(experts, n, None), nn.Parameter) for n in _EXPERT_PARAMS):
            raise TypeError(
                "ExpertParallel: expected a torch_moe.nn.MoE (a module with experts.w13 and "
                f"experts.w2 parameters), got {type(module).__name__}"
            )
        experts = cast(nn.Module, experts)
        if device_mesh.ndim != 1:
            raise ValueError(
                "ExpertParallel: expected a 1-D device mesh (slice the expert-parallel dim, "
                f"e.g. mesh['ep']), got a {device_mesh.ndim}-D mesh {device_mesh}"
            )
        if any(isinstance(getattr(experts, n), DTensor) for n in _EXPERT_PARAMS):
            raise ValueError("ExpertParallel: this MoE's experts are already parallelized")
        num_experts = cast(int, module.num_experts)
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
        return experts, num_experts

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        """distribute_module's partition_fn: the expert weights (and biases, if any) become
        Shard(0) DTensors."""
        group = mesh.get_group()
        for pname in _EXPERT_PARAMS + _EXPERT_BIASES if name == "" else ():
            p: Tensor | None = getattr(module, pname, None)
            if p is None:  # experts without biases
                continue
            local = _call(
                group,
                f"distribute_tensor({pname})",
                functools.partial(
                    distribute_tensor,
                    p.detach(),
                    mesh,
                    [Shard(0)],
                    src_data_rank=self.src_data_rank,
                ),
            )
            module.register_parameter(pname, nn.Parameter(local, requires_grad=p.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        try:
            experts, num_experts = self._check(module, device_mesh)
        except Exception as e:
            # every rank learns of it, then it raises (a mesh of another shape fails alike
            # on every rank, and has no one group)
            if device_mesh.ndim == 1:
                _check_same_config(module, device_mesh.get_group(), self, e)
            raise
        group = device_mesh.get_group()
        _check_same_config(module, group, self)
        distribute_module(experts, device_mesh, partition_fn=self._partition)
        module.dispatcher = ExpertParallelDispatcher(
            group,
            num_experts,
            num_chunks=self.num_chunks,
            exchange=self.exchange,
            dispatch_dtype=self.dispatch_dtype,
            node_size=self.node_size,
            mode=self.mode,
            max_tokens_per_rank=self.max_tokens_per_rank,
            microbatches=self.microbatches,
        )
        return module
