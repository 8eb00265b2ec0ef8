"""What does expert-parallel dispatch + combine cost over the raw all-to-all of its bytes,
what does the hierarchical all-to-all cost, and how much does chunked overlap buy?

Spawns 2 and 4 gloo processes on this machine (torch.multiprocessing, one thread each by
default) and, in each, times candidates interleaved round by round (every round starts
after a barrier; a round's time is the slowest rank's; median of ``--reps`` rounds):

(a) dispatch + combine of T tokens per rank, top-K over E experts, D-wide rows, with
    identity experts (no expert compute), next to the raw floor measured in the same
    run: two ``all_to_all_single`` calls moving exactly the same rows there and back,
    splits known in advance. Candidates:

    * ``own``: ``torch_moe.ops.permute`` -> counts ``all_to_all_single`` -> host split
      lists -> rows ``all_to_all_single`` -> expert-major reorder -> (identity) ->
      reorder back -> ``all_to_all_single`` back -> ``torch_moe.ops.unpermute``;
    * ``EP``: the same around ``ExpertParallel``'s experts forward (its counts exchange,
      dispatch of rows and routing weights, reorder, combine), the layer's own local
      experts replaced by the identity (``parallelize_module`` on a ``torch_moe.nn.MoE``;
      only when torch_moe.distributed.expert_parallel exists);
    * ``EP exch.``: ``EP`` without the permute and unpermute, which the unparallelized
      layer runs as well (what expert parallelism adds to a layer's forward);
    * ``EP (a2a)``, ``EP exch. (a2a)``: the same with ``ExpertParallel(exchange=
      "all_to_all")`` (one ``all_to_all_single`` per direction and two row reorders)
      where the default is the segment exchange (``"p2p"``, no reorder);
    * ``own (hier)``, ``EP (hier)``, ``EP exch. (hier)``: the same with
      :func:`hierarchical_all_to_all_single` (world 4 as 2 nodes x 2 ranks; EP's with
      ``ExpertParallel(node_size=2)`` when it has that option).

    Packing overhead = (dispatch + combine) / raw - 1 (the issue's target: <= 15%).
(b) hierarchical vs flat ``all_to_all_single`` of the same splits (world 4, 2 x 2).
(c) overlap (world 2), forward: (i) an own minimal loop, the MoE expert path (permute,
    dispatch, grouped SwiGLU on the local experts, combine, unpermute) sequentially
    versus in C token chunks where the next chunk's dispatch and the previous chunk's
    combine are asynchronous (``async_op=True``) while the current chunk's grouped GEMMs
    run; (ii) when ExpertParallel has ``num_chunks``, the whole parallelized MoE layer
    forward with ``num_chunks=C`` versus ``num_chunks=1``. Speedup = sequential /
    chunked (target >= 1.3x). Printed next to the parts timed alone (the
    grouped SwiGLU, the two exchanges), each candidate's process CPU time, and two bounds:
    perfect overlap, sequential / max(sequential - exchanges, exchanges), and the CPU
    bound, sequential / its CPU time (gloo moves bytes with CPU copies on the cores the
    ranks compute on: with every core busy, hiding the exchange cannot beat the CPU time).
(d) placement balancedness on Zipf(1.2) routing: benchmarks/bench_placement.py.
(e) the transport's cost per message (world 2): 1 and 8 MB each way in 1, 8 or 64
    point-to-point messages; the segment exchange sends R*El messages per direction.

Also prints, for node-limited routing (``topk_route`` with one expert group per node),
the mean nodes per token (``nodes_per_token``) and the rows that cross nodes.

    python benchmarks/bench_ep.py
    python benchmarks/bench_ep.py --reps 5 --tokens 1024      # quicker
    python benchmarks/bench_ep.py --malloc glibc              # glibc's default malloc

NB: with glibc's default malloc every buffer over 32 MB is a fresh mmap, and touching it
page-faults; on the shared VM this was measured to make a 33 MB clone 6x slower (47 vs
7 ms), which swamps what packing costs. ``--malloc no-mmap`` (the default) keeps freed
blocks in the heap, as a caching allocator does on a GPU.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

import torch_moe  # noqa: F401
from torch_moe import ops
from torch_moe.distributed.hierarchical import hierarchical_all_to_all_single, nodes_per_token
from torch_moe.nn.functional import grouped_swiglu

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def timed_rounds(
    fns: dict[str, Callable[[], object]], reps: int, cpu: dict[str, float] | None = None
) -> dict[str, float]:
    """Median over rounds of the slowest rank's seconds, candidates interleaved in an
    order shuffled per round (the same on every rank: the candidates run collectives), so
    that no candidate always follows the same one. With ``cpu``, also fills it with the
    median of the largest per-rank process CPU seconds (all threads: the caller's and the
    backend's)."""
    for fn in fns.values():  # warm-up
        fn()
    times = torch.zeros(2, len(fns), reps, dtype=torch.float64)
    calls = list(enumerate(fns.values()))
    for r in range(reps):
        random.Random(r).shuffle(calls)
        for i, fn in calls:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[0, i, r] = time.perf_counter() - t0
            times[1, i, r] = time.process_time() - c0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if cpu is not None:
        cpu.update({name: statistics.median(times[1, i].tolist()) for i, name in enumerate(fns)})
    return {name: statistics.median(times[0, i].tolist()) for i, name in enumerate(fns)}


def a2a(x: Tensor, out_splits: list[int], in_splits: list[int], **kw: Any) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, **kw)
    return out


def route(num_tokens: int, num_experts: int, k: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    weights, ids, _ = ops.topk_route(logits, k)
    return weights, ids


class OwnDispatch:
    """Dispatch / combine from torch_moe.ops.permute + all_to_all_single (forward only)."""

    def __init__(self, num_experts: int, node_size: int = 0) -> None:
        self.world = dist.get_world_size()
        self.num_experts = num_experts
        self.node_size = node_size  # 0: flat all-to-all

    def exchange(self, x: Tensor, out_splits: list[int], in_splits: list[int]) -> Tensor:
        if self.node_size:
            return hierarchical_all_to_all_single(
                x, out_splits, in_splits, dist.group.WORLD, self.node_size
            )
        return a2a(x, out_splits, in_splits)

    def dispatch(self, x: Tensor, ids: Tensor) -> tuple[Tensor, Tensor, Any]:
        R, El = self.world, self.num_experts // self.world
        x_perm, perm = ops.permute(x, ids, self.num_experts)
        send_E = torch.diff(perm.offs.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64))
        recv_RL = a2a(send_E, [El] * R, [El] * R).view(R, El)
        sizes = torch.cat([send_E.view(R, El).sum(1), recv_RL.sum(1)]).tolist()
        send, recv = sizes[:R], sizes[R:]
        x_recv = self.exchange(x_perm, recv, send)
        # rows arrive (source rank, expert)-major: make them expert-major
        expert_of_row = torch.arange(El).repeat(R).repeat_interleave(recv_RL.flatten())
        order = torch.argsort(expert_of_row, stable=True)
        offs = recv_RL.sum(0).cumsum(0).to(torch.int32)
        return x_recv.index_select(0, order), offs, (perm, order, send, recv)

    def combine(self, y: Tensor, weights: Tensor, state: Any) -> Tensor:
        perm, order, send, recv = state
        y_back = torch.empty_like(y).index_copy_(0, order, y)
        return ops.unpermute(self.exchange(y_back, send, recv), weights, perm)


def ep_style_args() -> set[str] | None:
    """The keyword arguments ExpertParallel takes, or None when it is not there."""
    try:
        from torch_moe.distributed.expert_parallel import ExpertParallel
    except ImportError:
        return None
    return set(inspect.signature(ExpertParallel).parameters)


def make_ep_moe(
    dim: int, hidden: int, num_experts: int, k: int, dtype: torch.dtype, **style: Any
) -> Any:
    """A ``torch_moe.nn.MoE`` (seed 0, the same on every rank) under ``ExpertParallel``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from torch_moe.distributed.expert_parallel import ExpertParallel
    from torch_moe.nn import MoE

    torch.manual_seed(0)
    moe = MoE(dim, hidden, num_experts, k, dtype=dtype)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_module(moe, mesh, ExpertParallel(**style))


def ep_dispatch_combine(
    dim: int, num_experts: int, k: int, dtype: torch.dtype, **style: Any
) -> Any:
    """ExpertParallel's counts exchange, dispatch and combine (``moe.dispatcher``, the
    schedule ``MoE.forward`` runs) with no expert compute in between."""
    dispatcher = make_ep_moe(dim, 16, num_experts, k, dtype, **style).dispatcher

    def fwd(x: Tensor, offs: Tensor, row_weights: Tensor | None = None) -> Tensor:
        grads = x.requires_grad or (row_weights is not None and row_weights.requires_grad)
        counts = dispatcher.plan(offs, x, torch.is_grad_enabled() and grads)
        y = None
        for chunk in dispatcher.chunks:
            x_c, _w_c, _offs_c = dispatcher.dispatch(x, row_weights, counts, chunk)
            part = dispatcher.combine(x_c, counts, chunk, x.shape[0])
            y = part if y is None else y + part
        return y

    return fwd


def bench_dispatch(args: argparse.Namespace, dtype: torch.dtype, out: dict[str, Any]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    E = args.experts
    style_args = ep_style_args()
    eps = {}
    if style_args is not None:
        eps["EP"] = ep_dispatch_combine(args.dim, E, args.k, dtype)
        if "exchange" in style_args:  # the default is "p2p"; the all-to-all + reorder peer
            eps["EP (a2a)"] = ep_dispatch_combine(args.dim, E, args.k, dtype, exchange="all_to_all")
        if world == 4 and "node_size" in style_args:
            eps["EP (hier)"] = ep_dispatch_combine(args.dim, E, args.k, dtype, node_size=2)
    own = OwnDispatch(E)
    hier = OwnDispatch(E, node_size=2) if world == 4 else None
    for tokens in args.tokens:
        weights, ids = route(tokens, E, args.k, seed=rank)
        x = torch.randn(tokens, args.dim).to(dtype)
        # the splits of the raw floor: the rows of each destination rank
        send = torch.bincount(ids.flatten() // (E // world), minlength=world)
        recv = a2a(send, [1] * world, [1] * world)
        send_l, recv_l = send.tolist(), recv.tolist()
        rows = x.new_empty(sum(send_l), args.dim).normal_()

        def raw(rows: Tensor = rows, send: list[int] = send_l, recv: list[int] = recv_l) -> None:
            a2a(a2a(rows, recv, send), send, recv)

        def own_fn(
            d: OwnDispatch = own, x: Tensor = x, ids: Tensor = ids, weights: Tensor = weights
        ) -> None:
            x_recv, _, state = d.dispatch(x, ids)
            d.combine(x_recv, weights, state)

        fns: dict[str, Callable[[], object]] = {"raw": raw, "own": own_fn}
        x_perm, perm = ops.permute(x, ids, E)
        row_w = weights.reshape(-1).index_select(0, perm.row_to_slot)
        for name, ep_fwd in eps.items():

            def ep_fn(
                x: Tensor = x, ids: Tensor = ids, weights: Tensor = weights, ep_fwd: Any = ep_fwd
            ) -> None:
                x_perm, perm = ops.permute(x, ids, E)
                row_w = weights.reshape(-1).index_select(0, perm.row_to_slot)
                ops.unpermute(ep_fwd(x_perm, perm.offs, row_w), None, perm)

            fns[name] = ep_fn
            # the exchange alone: what EP adds to the local layer's permute and unpermute
            fns[name.replace("EP", "EP exch.")] = functools.partial(
                ep_fwd, x_perm, perm.offs, row_w
            )
        if hier is not None:
            fns["own (hier)"] = functools.partial(own_fn, hier)
        with torch.no_grad():
            t = timed_rounds(fns, args.reps)
        nbytes = 2 * tokens * args.k * args.dim * x.element_size()  # there and back
        out.setdefault("dispatch", []).append((world, tokens, nbytes, t))


def bench_messages(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """The transport's cost per message: the same bytes to the other rank (world 2) in 1,
    8 and 64 point-to-point messages (``batch_isend_irecv``), each rank sending and
    receiving; the segment exchange sends one message per (rank, expert)."""
    if dist.get_world_size() != 2:
        return
    peer = 1 - dist.get_rank()
    for nbytes in (1 << 20, 8 << 20):
        x = torch.randn(nbytes // 4)
        y = torch.empty_like(x)

        def send(n: int, x: Tensor = x, y: Tensor = y) -> None:
            k = x.numel() // n
            ops = [dist.P2POp(dist.irecv, y[i * k : (i + 1) * k], peer, tag=i) for i in range(n)]
            ops += [dist.P2POp(dist.isend, x[i * k : (i + 1) * k], peer, tag=i) for i in range(n)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        fns = {n: functools.partial(send, n) for n in (1, 8, 64)}
        t = timed_rounds({str(n): fn for n, fn in fns.items()}, args.reps)
        out.setdefault("messages", []).append((nbytes, t))


def bench_hierarchical(args: argparse.Namespace, dtype: torch.dtype, out: dict[str, Any]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        return
    for rows_per_pair in args.a2a_rows:
        g = torch.Generator().manual_seed(rank)
        send_l = torch.randint(
            rows_per_pair // 2, rows_per_pair * 3 // 2 + 1, (world,), generator=g
        )
        recv_l = a2a(send_l, [1] * world, [1] * world).tolist()
        send_l = send_l.tolist()
        x = torch.randn(sum(send_l), args.dim).to(dtype)
        fns = {
            "flat": functools.partial(a2a, x, recv_l, send_l),
            "hierarchical": functools.partial(
                hierarchical_all_to_all_single, x, recv_l, send_l, dist.group.WORLD, 2
            ),
        }
        with torch.no_grad():
            t = timed_rounds(fns, args.reps)
        out.setdefault("hier", []).append(
            (rows_per_pair, sum(send_l) * args.dim * x.element_size(), t)
        )


def bench_overlap(args: argparse.Namespace, dtype: torch.dtype, out: dict[str, Any]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        return
    E, D, F, T, K = args.experts, args.dim, args.overlap_hidden, args.overlap_tokens, args.k
    R, El = world, E // world
    g = torch.Generator().manual_seed(100 + rank)
    w13 = (torch.randn(El, 2 * F, D, generator=g) * D**-0.5).to(dtype)
    w2 = (torch.randn(El, D, F, generator=g) * F**-0.5).to(dtype)
    weights, ids = route(T, E, K, seed=rank)
    x = torch.randn(T, D, generator=g).to(dtype)

    def run(num_chunks: int) -> Tensor:
        # routing, permute and the counts of every chunk first: one counts exchange and
        # one host sync for all chunks
        bounds = [T * c // num_chunks for c in range(num_chunks + 1)]
        chunks = []
        for c in range(num_chunks):
            sl = slice(bounds[c], bounds[c + 1])
            x_perm, perm = ops.permute(x[sl], ids[sl], E)
            cnt = torch.diff(perm.offs.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64))
            chunks.append((x_perm, perm, cnt, sl))
        send_CE = torch.stack([c[2] for c in chunks])  # [C, E]
        recv = a2a(send_CE.view(num_chunks, R, El).transpose(0, 1).contiguous(), [1] * R, [1] * R)
        recv_RCL = recv.view(R, num_chunks, El)
        splits = torch.cat(
            [send_CE.view(num_chunks, R, El).sum(-1), recv_RCL.sum(-1).t()], dim=1
        ).tolist()
        send = [s[:R] for s in splits]
        rcv = [s[R:] for s in splits]

        def start_dispatch(c: int) -> tuple[Tensor, Any]:
            buf = chunks[c][0].new_empty(sum(rcv[c]), D)
            return buf, dist.all_to_all_single(buf, chunks[c][0], rcv[c], send[c], async_op=True)

        pending = start_dispatch(0)
        combines = []
        for c in range(num_chunks):
            buf, work = pending
            if c + 1 < num_chunks:
                pending = start_dispatch(c + 1)  # in flight while chunk c computes
            work.wait()
            counts_RL = recv_RCL[:, c]
            expert_of_row = torch.arange(El).repeat(R).repeat_interleave(counts_RL.flatten())
            order = torch.argsort(expert_of_row, stable=True)
            offs = counts_RL.sum(0).cumsum(0).to(torch.int32)
            y = grouped_swiglu(buf.index_select(0, order), w13, w2, offs)
            y_back = torch.empty_like(y).index_copy_(0, order, y)
            home = y_back.new_empty(sum(send[c]), D)
            combines.append(
                (home, dist.all_to_all_single(home, y_back, send[c], rcv[c], async_op=True))
            )
        outs = []
        for (home, work), (_, perm, _, sl) in zip(combines, chunks, strict=True):
            work.wait()
            outs.append(ops.unpermute(home, weights[sl], perm))
        return torch.cat(outs)

    with torch.no_grad():
        ref = run(1)
        for c in args.chunks:
            torch.testing.assert_close(run(c), ref)  # the same result for any C
        # the parts on their own: compute only and exchange only (the sequential terms)
        counts = torch.bincount(ids.flatten() // El, minlength=R)
        send_l = counts.tolist()
        recv_l = a2a(counts, [1] * R, [1] * R).tolist()
        rows = x.new_empty(sum(send_l), D).normal_()
        xr = x.new_empty(sum(recv_l), D).normal_()
        offs = torch.linspace(0, sum(recv_l), El + 1)[1:].round().to(torch.int32)
        fns: dict[str, Callable[[], object]] = {
            "sequential": lambda: run(1),
            **{f"chunked C={c}": (lambda c=c: run(c)) for c in args.chunks},
            "compute only": lambda: grouped_swiglu(xr, w13, w2, offs),
            "a2a only": lambda: a2a(a2a(rows, recv_l, send_l), send_l, recv_l),
        }
        # ExpertParallel's own chunking (num_chunks: the local experts in C groups), the
        # whole layer forward, when it has the option
        style_args = ep_style_args()
        if style_args is not None and "num_chunks" in style_args:
            layers = {c: make_ep_moe(D, F, E, K, dtype, num_chunks=c) for c in [1, *args.chunks]}
            ref = layers[1](x)
            for c, moe in layers.items():
                torch.testing.assert_close(moe(x), ref)
                fns[f"EP C={c}"] = functools.partial(moe, x)
            # the same layers under torch.compile (Inductor) with torch_moe's passes: the EP
            # overlap pass issues every chunk's dispatch up front and waits late
            if args.compiled:
                import torch_moe._inductor as TI

                for c, moe in layers.items():
                    compiled = torch.compile(moe, fullgraph=True, options=TI.options())
                    torch.testing.assert_close(compiled(x), ref, rtol=1e-4, atol=1e-5)
                    fns[f"EP C={c} compiled"] = functools.partial(compiled, x)
                # a layer built with one chunk that the compiler splits into C (the chunk
                # pass) and then overlaps; per-compile options, so that Dynamo compiles
                # it again instead of reusing the C=1 frame above
                for c in args.chunks:
                    before = TI.counters()["ep_chunks"]
                    moe = make_ep_moe(D, F, E, K, dtype, num_chunks=1)
                    options = TI.options(ep_chunks=c)
                    compiled = torch.compile(moe, fullgraph=True, options=options)
                    torch.testing.assert_close(compiled(x), ref, rtol=1e-4, atol=1e-5)
                    if TI.counters()["ep_chunks"] == before:
                        raise RuntimeError(f"bench_ep: the chunk pass did not split C=1 into {c}")
                    fns[f"EP C=1 split into {c} compiled"] = functools.partial(compiled, x)
        cpu: dict[str, float] = {}
        t = timed_rounds(fns, args.reps, cpu)
    out["overlap"] = (T, D, F, t, cpu)


def print_table_head(title: str, columns: list[str]) -> None:
    print()
    print(title)
    print()
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")


def routing_stats(args: argparse.Namespace) -> list[tuple[int, int, str, float, float, float]]:
    """Nodes per token and cross-node rows per token with and without node-limited routing."""
    rows = []
    E, K, T = 64, 8, 4096
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(0))
    for num_nodes in (4, 8):
        per_node = E // num_nodes
        for limit in (None, 2, 4):
            if limit is not None and limit * per_node < K:
                continue
            _, ids, _ = ops.topk_route(
                logits,
                K,
                score_func="sigmoid",
                num_expert_groups=num_nodes if limit else None,
                num_limited_groups=limit,
            )
            nodes = nodes_per_token(ids, per_node).double()
            # a token of node 0 (its own experts are local): the rows that leave the node
            remote_rows = (ids // per_node != 0).sum(-1).double()
            remote_nodes = nodes - (ids // per_node == 0).any(-1).double()
            rows.append(
                (
                    num_nodes,
                    K,
                    "-" if limit is None else str(limit),
                    nodes.mean().item(),
                    remote_rows.mean().item(),
                    remote_nodes.mean().item(),
                )
            )
    return rows


def worker(rank: int, world: int, init_file: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{init_file}")
    try:
        dtype = DTYPES[args.dtype]
        out: dict[str, Any] = {}
        if not args.only_overlap:
            bench_messages(args, out)
            bench_dispatch(args, dtype, out)
            bench_hierarchical(args, dtype, out)
        if not args.skip_overlap:
            bench_overlap(args, dtype, out)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "init"), args, queue), nprocs=world)
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--a2a-rows", type=int, nargs="+", default=[16, 256, 4096])
    parser.add_argument("--overlap-tokens", type=int, default=1024)
    parser.add_argument("--overlap-hidden", type=int, default=64)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--skip-overlap", action="store_true")
    parser.add_argument("--only-overlap", action="store_true", help="(c) alone")
    parser.add_argument(
        "--compiled",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="(c): also the ExpertParallel layers under torch.compile with torch_moe's passes",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument(
        "--malloc",
        choices=["no-mmap", "glibc"],
        default="no-mmap",
        help="no-mmap: the workers' glibc malloc keeps large blocks instead of mapping and "
        "unmapping them per tensor (MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_), so a "
        "fresh [T*K, D] buffer does not page-fault on every call; glibc: its defaults",
    )
    args = parser.parse_args()
    if args.malloc == "no-mmap":  # read by each spawned worker at its start
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**32))
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(2**36))

    results = {world: run_world(world, args) for world in args.worlds}

    print(
        f"# torch {torch.__version__}, {platform.machine()}, python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, gloo, {args.threads} thread(s) per process, {args.dtype}, "
        f"median of {args.reps} interleaved rounds (slowest rank per round), "
        f"malloc {args.malloc}"
    )
    print()
    print("Node-limited routing (E=64, K=8, sigmoid, T=4096; experts contiguous by node;")
    print("'leave node 0': rows / distinct nodes a token of node 0 sends to other nodes)")
    print()
    print("| nodes | K | node limit | nodes per token | rows leave node 0 | nodes besides 0 |")
    print("|---|---|---|---|---|---|")
    for n, k, lim, npt, rr, rn in routing_stats(args):
        print(f"| {n} | {k} | {lim} | {npt:.2f} | {rr:.2f} | {rn:.2f} |")

    for world in args.worlds:
        if "messages" not in results[world]:
            continue
        print_table_head(
            f"(e) per-message cost, world {world}: the same bytes each way in 1, 8 or 64 "
            "point-to-point messages (batch_isend_irecv)",
            ["MB each way", *(f"{n} message(s) ms" for n in (1, 8, 64)), "ms per extra message"],
        )
        for nbytes, t in results[world]["messages"]:
            per = (t["64"] - t["1"]) / 63
            print(
                f"| {nbytes / 2**20:.0f} | {t['1'] * 1e3:.2f} | {t['8'] * 1e3:.2f} "
                f"| {t['64'] * 1e3:.2f} | {per * 1e3:.3f} |"
            )

    for world in args.worlds:
        if "hier" not in results[world]:
            continue
        print_table_head(
            f"(b) hierarchical (2 nodes x 2) vs flat all_to_all_single, world {world}, D={args.dim}",
            ["rows per rank pair", "MB sent per rank", "flat ms", "hierarchical ms", "hier / flat"],
        )
        for rows, nbytes, t in results[world]["hier"]:
            print(
                f"| {rows} | {nbytes / 1e6:.2f} | {t['flat'] * 1e3:.2f} "
                f"| {t['hierarchical'] * 1e3:.2f} | {t['hierarchical'] / t['flat']:.2f} |"
            )

    for world in args.worlds:
        if "overlap" not in results[world]:
            continue
        T, D, F, t, cpu = results[world]["overlap"]
        print_table_head(
            f"(c) overlap, world {world}: T={T} tokens per rank, D={D}, F={F}, "
            f"E={args.experts}, K={args.k}; own chunked loop (token chunks, async_op=True; "
            "peer: sequential) and ExpertParallel(num_chunks=C) layer forward (peer: C=1). "
            "CPU: process CPU time of the busiest rank (all its threads); with every core "
            "taken by a rank, no overlap finishes a rank before its CPU time, so "
            "peer ms / peer CPU ms bounds the speedup any overlap can reach",
            ["candidate", "ms", "CPU ms", "CPU / ms", "speedup (peer / candidate)"],
        )
        for name, sec in t.items():
            peer = "EP C=1" if name.startswith("EP") else "sequential"
            print(
                f"| {name} | {sec * 1e3:.2f} | {cpu[name] * 1e3:.2f} | {cpu[name] / sec:.2f} "
                f"| {t[peer] / sec:.2f} |"
            )
        exchanges = t["a2a only"]
        perfect = t["sequential"] / max(t["sequential"] - exchanges, exchanges)
        print()
        print(
            f"Bounds on the speedup: perfect overlap of the exchanges, sequential / "
            f"max(sequential - a2a only, a2a only) = {perfect:.2f}; CPU-bound, sequential / "
            f"its CPU = {t['sequential'] / cpu['sequential']:.2f}, EP C=1 / its CPU = "
            f"{t['EP C=1'] / cpu['EP C=1']:.2f}"
            if "EP C=1" in t
            else f"Bound of perfect overlap: {perfect:.2f}"
        )
    if args.only_overlap:
        return
    print()
    print(
        f"(a) dispatch + combine (forward, identity experts) vs the raw all_to_all_single of "
        f"the same rows, D={args.dim}, E={args.experts}, K={args.k}; overhead = t / raw - 1"
    )
    print("Cells: ms (overhead = ms / raw - 1).")
    print()
    names = ["own", "EP", "EP exch.", "EP (a2a)", "EP exch. (a2a)"]
    names += ["own (hier)", "EP (hier)", "EP exch. (hier)"]
    names = [
        n for n in names if any(n in t for w in args.worlds for *_, t in results[w]["dispatch"])
    ]
    print(
        "| world | T per rank | MB moved per rank | raw ms | raw GB/s | " + " | ".join(names) + " |"
    )
    print("|---" * (5 + len(names)) + "|")
    for world in args.worlds:
        for w, tokens, nbytes, t in results[world]["dispatch"]:
            cells = [
                f"{t[n] * 1e3:.1f} ({t[n] / t['raw'] - 1:+.0%})" if n in t else "-" for n in names
            ]
            print(
                f"| {w} | {tokens} | {nbytes / 1e6:.1f} | {t['raw'] * 1e3:.1f} "
                f"| {nbytes / t['raw'] / 1e9:.2f} | " + " | ".join(cells) + " |"
            )


if __name__ == "__main__":
    main()
