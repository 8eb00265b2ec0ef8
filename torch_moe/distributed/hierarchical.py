"""Node-aware (hierarchical) all-to-all and node-limited routing statistics.

Legend: R ranks in the group, L ranks per node (``node_size``), N = R / L nodes; rank
``r = n*L + l`` is local rank l of node n (node-major). ``S[s][d]`` is the number of
rows rank s sends to rank d (the R x R split matrix).

:func:`hierarchical_all_to_all_single` has the contract and the result of a flat
``dist.all_to_all_single(out, x, output_split_sizes, input_split_sizes, group)``
(rows for rank d are ``x``'s d-th chunk; the output holds the chunks received from
ranks 0..R-1 in rank order), but moves the data in two stages, as Tutel's 2D
all-to-all does (DeepEP's normal mode makes the same two hops in the other order,
across nodes to the same local index first, then inside the node, which also lets it
send a token once per destination node; see :func:`nodes_per_token`):

1. Intra-node: rank (n, l) sends to its node peer (n, l') everything it has for the
   ranks with local index l' on *all* nodes (x's chunks reordered from [n'][l'] to
   [l'][n'] first). Afterwards (n, l') holds, from each peer j of its node, the rows
   for (0, l'), (1, l'), ..., (N-1, l').
2. Inter-node: the rows are reordered from [j][n'] to [n'][j] and exchanged among the
   N ranks with the same local index: (n, l) sends one message to (n', l) holding what
   its whole node has for (n', l). What (n', l) receives is ordered [n][j], i.e. by
   source rank n*L + j, which is the flat layout; no reorder after the last stage.

Across nodes that is one message per (node pair, local index), N*(N-1)*L in all,
instead of one per (rank pair), R*(R-L); each message is L times larger on average.
It pays where cross-node messages are latency-bound (many ranks per node, small
per-rank chunks); on a single host it only adds work: two row reorders, a second
exchange and the split gather (measured against the flat exchange on one machine:
benchmarks/results/ep_cpu_202611.md).

NB: split bookkeeping. Stage 1's receive sizes and stage 2's sizes depend on rows that
other ranks of the node send to other ranks, so every rank needs the full R x R split
matrix: one ``all_gather`` of 2R + 1 int64 per rank (each rank's input and output
splits and a validity flag) per call, R*(2R+1)*8 bytes in all, a latency-bound
collective on top of the two exchanges (the flat all-to-all needs none, the caller
already knows its output splits). The gathered output splits let every rank check
that ``output_split_sizes`` agree with what the other ranks send, and the flag lets a
rank with bad splits make *every* rank raise instead of leaving the others waiting in
a collective. The backward reuses the matrix (transposed), so it gathers nothing. A
caller that already has the matrix (an expert-parallel layer that all-gathers its
per-expert counts once, then dispatches rows and weights and combines with the
transpose) passes it as ``split_matrix`` and skips the gather.

Subgroups: the intra-node and the cross-node group of this rank are created on the
first call for a (group, node_size) and cached. When ``group`` spans the world, every
rank creates all N intra-node and all L cross-node groups in the same order
(``dist.new_subgroups_by_enumeration``). A ProcessGroup that is a proper subgroup of
the world (the EP dim of a (dp, ep) mesh) is entered only by its members, so its
subgroups are made with ``dist.new_group(..., use_local_synchronization=True)``,
which synchronizes only the members. NB: that path names a group by hashing its ranks
together with the number of process groups the calling rank holds, so the members of
a subgroup must hold equally many groups at the first call (true when every rank runs
the same program on a symmetric mesh). A DeviceMesh with ("node", "local") dims would
give the same groups, but creating them needs every rank of the world in one call
and a mesh rather than the ProcessGroup this function takes. Every rank creates its
intra-node group first and its cross-node group second, so the creation order is the
same everywhere (no deadlock). A stage over a group of one rank (N == 1 or L == 1)
skips its collective; one that spans the whole group uses ``group`` itself.

:func:`nodes_per_token` counts the distinct nodes each token's experts live on when
experts are placed contiguously by node (expert e on node ``e // experts_per_node``),
the quantity that node-limited routing bounds: ``topk_route(..., num_expert_groups=N,
num_limited_groups=M)`` makes it at most M.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["hierarchical_all_to_all_single", "nodes_per_token"]

_NAME = "hierarchical_all_to_all_single"

# (group name, node_size, global rank) -> (intra-node group, cross-node group); None
# stands for a group of one rank. The global rank is part of the key so that threaded
# process groups (one rank per thread, one module) do not share entries.
_SUBGROUPS: dict[tuple[str, int, int], tuple[ProcessGroup | None, ProcessGroup | None]] = {}


def _alive(pg: ProcessGroup | None) -> bool:
    return pg is None or pg in dist.distributed_c10d._world.pg_map


def _new_subgroup(
    member_lists: list[list[int]], mine: list[int], whole_world: bool, desc: str
) -> ProcessGroup:
    """Create this rank's subgroup ``mine`` out of the partition ``member_lists``."""
    if whole_world:
        # every rank of the world is here: create all subgroups in the same order
        # everywhere (sequentially named, no dependence on other groups a rank holds)
        pg, _ = dist.new_subgroups_by_enumeration(member_lists, group_desc=desc)
        return pg
    # only the members of `group` are here: local synchronization among each subgroup
    return dist.new_group(mine, use_local_synchronization=True, group_desc=desc)


def _node_groups(
    group: ProcessGroup, node_size: int
) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """This rank's intra-node and cross-node groups (None for a group of one rank)."""
    key = (group.group_name, node_size, dist.get_rank())
    cached = _SUBGROUPS.get(key)
    if cached is not None and _alive(cached[0]) and _alive(cached[1]):
        return cached
    ranks = dist.get_process_group_ranks(group)
    if ranks != sorted(ranks):
        # new_group orders a subgroup's ranks by global rank; the stages index peers by
        # their position in the group, so the two orders must agree
        raise NotImplementedError(
            f"{_NAME}: the group's ranks must be in increasing global-rank order, got {ranks}"
        )
    whole_world = len(ranks) == dist.get_world_size()
    num_nodes = len(ranks) // node_size
    node, local = divmod(dist.get_rank(group), node_size)
    by_node = [[ranks[m * node_size + j] for j in range(node_size)] for m in range(num_nodes)]
    by_local = [[ranks[m * node_size + i] for m in range(num_nodes)] for i in range(node_size)]
    intra: ProcessGroup | None = None
    inter: ProcessGroup | None = None
    # a subgroup of one rank is None (no collective); one that is the whole group is group
    if node_size > 1:  # intra-node first, cross-node second, on every rank
        intra = (
            group
            if node_size == len(ranks)
            else _new_subgroup(by_node, by_node[node], whole_world, "moe_a2a_intra_node")
        )
    if num_nodes > 1:
        inter = (
            group
            if num_nodes == len(ranks)
            else _new_subgroup(by_local, by_local[local], whole_world, "moe_a2a_inter_node")
        )
    _SUBGROUPS[key] = (intra, inter)
    return intra, inter


@dataclass(frozen=True)
class _Plan:
    """Everything one rank needs to run the two stages: the split matrix and groups."""

    splits: tuple[tuple[int, ...], ...]  # S[s][d], R x R
    rank: int
    node_size: int
    intra: ProcessGroup | None
    inter: ProcessGroup | None

    def transposed(self) -> _Plan:
        """The reverse exchange (the backward): rank d sends S[s][d] rows back to s."""
        return _Plan(
            tuple(zip(*self.splits, strict=True)), self.rank, self.node_size, self.intra, self.inter
        )


def _transpose_chunks(buf: Tensor, sizes: list[list[int]]) -> Tensor:
    """``buf`` holds chunks in [a][b] order with ``sizes[a][b]`` rows; return [b][a] order."""
    if len(sizes) == 1 or len(sizes[0]) == 1:
        return buf
    chunks = list(buf.split([n for row in sizes for n in row]))
    num_b = len(sizes[0])
    return torch.cat([chunks[a * num_b + b] for b in range(num_b) for a in range(len(sizes))])


def _all_to_all(
    x: Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup | None
) -> Tensor:
    if group is None:  # a group of one rank: the exchange is the identity
        return x
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _exchange(x: Tensor, plan: _Plan) -> Tensor:
    """The two-stage exchange of x (rows in destination-rank order) under ``plan``."""
    split = plan.splits
    num_local = plan.node_size
    num_nodes = len(split) // num_local
    node, local = divmod(plan.rank, num_local)
    # S[n*L + j][m*L + i] as a function of (source local j, destination node m, dest local i)
    mine = split[plan.rank]

    # Stage 1 (intra-node): x's chunks [m][i] -> [i][m]; peer i gets what goes to (*, i).
    send1 = _transpose_chunks(
        x, [[mine[m * num_local + i] for i in range(num_local)] for m in range(num_nodes)]
    )
    in1 = [sum(mine[m * num_local + i] for m in range(num_nodes)) for i in range(num_local)]
    # from peer j: its rows for (m, local) for every node m, in node order
    recv1_sizes = [
        [split[node * num_local + j][m * num_local + local] for m in range(num_nodes)]
        for j in range(num_local)
    ]
    buf = _all_to_all(send1, [sum(row) for row in recv1_sizes], in1, plan.intra)

    # Stage 2 (inter-node): [j][m] -> [m][j]; node m's rank with our local index gets
    # everything this node has for it, in source-rank order.
    send2 = _transpose_chunks(buf, recv1_sizes)
    in2 = [sum(recv1_sizes[j][m] for j in range(num_local)) for m in range(num_nodes)]
    out2 = [
        sum(split[m * num_local + j][plan.rank] for j in range(num_local)) for m in range(num_nodes)
    ]
    out = _all_to_all(send2, out2, in2, plan.inter)
    # a one-rank group moves nothing: return a fresh tensor, as the flat collective does
    return x.clone() if out is x else out


class _HierarchicalAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, plan: _Plan) -> Tensor:  # type: ignore[override]
        ctx.plan = plan
        return _exchange(x, plan)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _exchange(grad.contiguous(), ctx.plan.transposed()), None


def _split_error(
    x: Tensor, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int], size: int
) -> str | None:
    """What is wrong with this rank's splits (None if nothing): checked without talking."""
    if x.dim() < 1:
        return "x must have at least one dim (rows), got a 0-D tensor"
    for name, splits in (
        ("input_split_sizes", input_split_sizes),
        ("output_split_sizes", output_split_sizes),
    ):
        if len(splits) != size:
            return f"{name} must have one entry per rank of the group ({size}), got {list(splits)}"
        if any(int(n) < 0 for n in splits):
            return f"{name} must be non-negative, got {list(splits)}"
    if sum(input_split_sizes) != x.shape[0]:
        return (
            f"input_split_sizes {list(input_split_sizes)} sum to {sum(input_split_sizes)}, "
            f"but x has {x.shape[0]} rows"
        )
    return None


def _checked_matrix(
    split_matrix: Sequence[Sequence[int]],
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    rank: int,
    error: str | None,
) -> tuple[tuple[int, ...], ...]:
    """``split_matrix`` as a tuple of tuples, checked against this rank's splits."""
    if error is not None:
        raise ValueError(f"{_NAME}: {error}")
    size = len(input_split_sizes)
    splits = tuple(tuple(int(n) for n in row) for row in split_matrix)
    if len(splits) != size or any(len(row) != size for row in splits):
        raise ValueError(
            f"{_NAME}: split_matrix must be {size} x {size} (the group size), "
            f"got {[len(row) for row in splits]} entries per row"
        )
    if any(n < 0 for row in splits for n in row):
        raise ValueError(f"{_NAME}: split_matrix must be non-negative, got {splits}")
    column = [splits[s][rank] for s in range(size)]
    if list(splits[rank]) != [int(n) for n in input_split_sizes] or column != [
        int(n) for n in output_split_sizes
    ]:
        raise ValueError(
            f"{_NAME}: split_matrix row {rank} {list(splits[rank])} and column {rank} "
            f"{column} must equal input_split_sizes {list(input_split_sizes)} and "
            f"output_split_sizes {list(output_split_sizes)}"
        )
    return splits


def hierarchical_all_to_all_single(
    x: Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: ProcessGroup | None = None,
    node_size: int = 1,
    *,
    split_matrix: Sequence[Sequence[int]] | None = None,
) -> Tensor:
    r"""All-to-all of rows with uneven splits, intra-node first, then across nodes.

    Same contract and bitwise the same result as a flat
    ``dist.all_to_all_single(out, x, output_split_sizes, input_split_sizes, group)``
    (``out`` allocated with ``sum(output_split_sizes)`` rows), differentiable like
    ``torch.distributed.nn.functional.all_to_all_single``: the backward is the
    reverse exchange (splits swapped), also hierarchical.

    Args:
        x: [M, ...] rows to send, in destination-rank order (any trailing shape).
        output_split_sizes: rows this rank receives from each rank of the group
            (host ints, R entries).
        input_split_sizes: rows of ``x`` for each rank of the group (R entries,
            summing to ``x.shape[0]``).
        group: the process group (None: the default group). Its ranks are taken as
            node-major: group rank r is on node ``r // node_size``.
        node_size: L, ranks per node; must divide the group size. ``node_size=1`` or
            the group size degenerate to one real exchange plus bookkeeping.
        split_matrix: optional R x R host ints, ``split_matrix[s][d]`` rows from group
            rank s to group rank d, when the caller already has it (e.g. from one
            ``all_gather`` of per-expert counts, reused for the dispatch and, transposed,
            the combine): skips this call's ``all_gather``. It must be the same on every
            rank; it is checked against this rank's splits only (a mismatch raises on
            this rank alone, so the others may be left waiting in a collective).

    Returns:
        [sum(output_split_sizes), ...] the rows received, in source-rank order.

    Every rank of the group must call this with the same ``node_size``. Without
    ``split_matrix`` it costs one ``all_gather`` of the split sizes (R*(2R+1) int64) on
    top of the two exchanges, see the module notes, and bad splits on any rank raise
    ValueError on every rank.
    """
    if group is None:
        group = dist.group.WORLD
    if group is None:
        raise RuntimeError(f"{_NAME}: torch.distributed is not initialized")
    size = dist.get_world_size(group)
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"{_NAME}: node_size must be a positive int, got {node_size!r}")
    if size % node_size != 0:
        raise ValueError(
            f"{_NAME}: node_size ({node_size}) must divide the group size ({size}); "
            "ranks are grouped node-major into size // node_size nodes"
        )

    error = _split_error(x, output_split_sizes, input_split_sizes, size)
    if split_matrix is not None:
        splits = _checked_matrix(
            split_matrix, output_split_sizes, input_split_sizes, dist.get_rank(group), error
        )
        intra, inter = _node_groups(group, node_size)
        plan = _Plan(splits, dist.get_rank(group), node_size, intra, inter)
        return _HierarchicalAllToAll.apply(x, plan)

    # Gather [ok, input splits, output splits] of every rank: the split matrix for the
    # bookkeeping, and a consistency check that every rank reaches together.
    if error is None:
        row = [1, *(int(n) for n in input_split_sizes), *(int(n) for n in output_split_sizes)]
    else:
        row = [0] * (2 * size + 1)
    mine = torch.tensor(row, dtype=torch.int64, device=x.device)  # NCCL: on the GPU
    rows = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows).tolist()
    if error is not None:
        raise ValueError(f"{_NAME}: {error}")
    bad = [r for r in range(size) if table[r][0] == 0]
    if bad:
        raise ValueError(f"{_NAME}: rank(s) {bad} of the group passed invalid split sizes")
    splits = tuple(tuple(table[s][1 : size + 1]) for s in range(size))
    for d in range(size):
        for s in range(size):
            if table[d][1 + size + s] != splits[s][d]:
                raise ValueError(
                    f"{_NAME}: rank {d} expects {table[d][1 + size + s]} rows from rank {s} "
                    f"(output_split_sizes), but rank {s} sends {splits[s][d]} "
                    "(input_split_sizes)"
                )

    intra, inter = _node_groups(group, node_size)
    plan = _Plan(splits, dist.get_rank(group), node_size, intra, inter)
    return _HierarchicalAllToAll.apply(x, plan)


def nodes_per_token(expert_ids: Tensor, experts_per_node: int) -> Tensor:
    r"""Distinct nodes each token is sent to when expert e lives on node ``e // experts_per_node``.

    Args:
        expert_ids: [T, K] integer expert ids (e.g. from ``topk_route``).
        experts_per_node: E / N, experts per node with a contiguous placement.

    Returns:
        [T] int64, between 1 and min(K, N) (0 when K == 0). Group-limited routing with
        one group per node (``num_expert_groups=N, num_limited_groups=M``) bounds it by M.
        The dispatch moves K rows per token (one per expert); a dispatch that sends a
        token once per destination node would move ``nodes_per_token`` rows.
    """
    if expert_ids.dim() != 2 or expert_ids.is_floating_point() or expert_ids.is_complex():
        raise ValueError(
            "nodes_per_token: expected expert_ids to be a 2D integer tensor [T, K], "
            f"got {expert_ids.dim()}D {expert_ids.dtype}"
        )
    if isinstance(experts_per_node, bool) or not isinstance(experts_per_node, int):
        raise ValueError(
            f"nodes_per_token: experts_per_node must be a positive int, got {experts_per_node!r}"
        )
    if experts_per_node < 1:
        raise ValueError(
            f"nodes_per_token: experts_per_node must be a positive int, got {experts_per_node}"
        )
    num_tokens, k = expert_ids.shape
    if k == 0:
        return torch.zeros(num_tokens, dtype=torch.int64, device=expert_ids.device)
    nodes_TK = (expert_ids.to(torch.int64) // experts_per_node).sort(dim=-1).values
    return 1 + (nodes_TK.diff(dim=-1) != 0).sum(-1)
