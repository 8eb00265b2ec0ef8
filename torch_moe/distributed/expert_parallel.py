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
  2. one host sync: the send/receive split lists (gloo and NCCL take host lists) come from
     one ``.tolist()`` of the local and received counts (this is the only sync; the
     permutation indices are built on the device from the counts);
  3. dispatch: the permuted rows are already sorted by global expert, hence by
     destination rank; an autograd ``all_to_all_single`` moves them (and their fp32
     routing weights) to the owners, which reorder them from (source rank, expert) to
     (expert, source rank) order with a gather;
  4. the local experts: the module's own forward (whatever its ``precision``) on the
     local shards ``w13.to_local()`` / ``w2.to_local()``, so the gradients flow back to
     the DTensor parameters as ``Shard(0)`` gradients;
  5. combine: the inverse gather and the inverse all-to-all bring each row's output home,
     and the layer's ``unpermute`` sums the K rows of each token in fp32 in a fixed order
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
  ``RuntimeError`` naming the rank and the operation, in the forward and the backward.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ExpertParallel"]

_T = TypeVar("_T")
_EXPERT_PARAMS = ("w13", "w2")


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


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with autograd; the backward sends the gradients back the same
    way (splits swapped). Both directions report failures through ``_EPGroup.call``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        out_splits: list[int],
        in_splits: list[int],
        ep: _EPGroup,
        op: str,
    ) -> Tensor:
        ctx.splits, ctx.ep, ctx.op = (out_splits, in_splits), ep, op
        return _all_to_all(x, out_splits, in_splits, ep, op)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        grad_x = _all_to_all(grad, in_splits, out_splits, ctx.ep, f"{ctx.op} backward")
        return grad_x, None, None, None, None


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


@contextmanager
def _local_expert_params(experts: nn.Module) -> Iterator[None]:
    """Present the DTensor expert parameters to the module's forward as their local shards.

    NB: ``to_local()`` is differentiable (its backward wraps the gradient back into a
    ``Shard(0)`` DTensor), so the gradients land in the DTensor parameters. The entries are
    swapped in ``_parameters`` for the duration of the call only; whatever was there (an
    FSDP2-unsharded parameter, say) is put back.
    """
    saved = {name: experts._parameters[name] for name in _EXPERT_PARAMS}
    try:
        for name, p in saved.items():
            if isinstance(p, DTensor):
                experts._parameters[name] = p.to_local()  # type: ignore[assignment]
        yield
    finally:
        experts._parameters.update(saved)


class _ExpertParallelForward:
    """Replaces ``moe.experts.forward``: dispatch -> local experts -> combine."""

    def __init__(self, experts: nn.Module, ep: _EPGroup, num_experts: int) -> None:
        self.local_forward = experts.forward  # the module's own (bound) forward
        self.experts = experts
        self.ep = ep
        self.num_experts = num_experts

    def __call__(self, x: Tensor, offs: Tensor, row_weights: Tensor | None = None) -> Tensor:
        ep, E = self.ep, self.num_experts
        R = ep.size
        El = E // R
        M = x.shape[0]
        # 1. counts exchange: send_E[e] rows for expert e, recv_RL[s, l] rows from rank s
        send_E = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
        recv_RL = _all_to_all(send_E, [El] * R, [El] * R, ep, "counts").view(R, El)
        # 2. the one host sync: split lists for the two all-to-alls
        sizes = torch.cat([send_E.view(R, El).sum(1), recv_RL.sum(1)]).tolist()
        send_splits, recv_splits = sizes[:R], sizes[R:]
        used, N = sum(send_splits), sum(recv_splits)  # used < M: alignment/capacity padding
        # 3. dispatch
        x_recv = _AllToAll.apply(x[:used], recv_splits, send_splits, ep, "dispatch")
        w_recv = None
        if row_weights is not None:
            w_recv = _AllToAll.apply(
                row_weights[:used], recv_splits, send_splits, ep, "dispatch (routing weights)"
            )
        offs_local = recv_RL.sum(0).cumsum(0).to(offs.dtype)
        reorder = R > 1 and El > 1  # rows arrive (source rank, expert)-major
        if reorder:
            index, inverse = _expert_major_index(recv_RL, N)
            x_recv = _GatherRows.apply(x_recv, index, inverse)
            if w_recv is not None:
                w_recv = _GatherRows.apply(w_recv, index, inverse)
        # 4. the local experts, the module's own forward on the local shards
        with _local_expert_params(self.experts):
            y = self.local_forward(x_recv, offs_local, w_recv)
        # 5. combine
        if reorder:
            y = _GatherRows.apply(y, inverse, index)
        y = _AllToAll.apply(y, send_splits, recv_splits, ep, "combine")
        if used < M:
            y = torch.cat([y, y.new_zeros((M - used, *y.shape[1:]))])
        return y


def _expert_major_index(recv_RL: Tensor, N: int) -> tuple[Tensor, Tensor]:
    """The gather index from (source rank, expert)-major rows to (expert, source rank)-major
    rows, and its inverse; built on the device from the [R, El] counts."""
    start_RL = (recv_RL.reshape(-1).cumsum(0) - recv_RL.reshape(-1)).view_as(recv_RL)
    counts_LR, start_LR = recv_RL.t().reshape(-1), start_RL.t().reshape(-1)
    # row i of block b (in expert-major order) comes from start_LR[b] + i
    block_start = counts_LR.cumsum(0) - counts_LR
    shift = torch.repeat_interleave(start_LR - block_start, counts_LR, output_size=N)
    index = torch.arange(N, device=recv_RL.device) + shift
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(N, device=recv_RL.device)
    return index, inverse


def _config_fingerprint(moe: Any) -> dict[str, Any]:
    fields = dict(moe.config)
    experts = moe.experts
    fields["precision"] = getattr(experts, "precision", "bf16")
    fields["param_dtype"] = str(experts.w13.dtype)
    return fields


def _check_same_config(moe: Any, ep: _EPGroup) -> None:
    fields = _config_fingerprint(moe)
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
        src_data_rank: the rank whose full expert weights are scattered to the shards
            (default 0); None keeps each rank's own slice (no communication).
    """

    def __init__(self, *, src_data_rank: int | None = 0) -> None:
        super().__init__()
        self.src_data_rank = src_data_rank

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
        _check_same_config(module, ep)
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
        experts.forward = _ExpertParallelForward(experts, ep, num_experts)
        return module
