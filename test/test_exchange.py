# Owner(s): ["module: moe"]
"""Tests for the segment all-to-all (torch_moe.distributed.exchange).

TestAllToAllSegmentsSimulated runs the exchanges for every rank in one process, with
torch.distributed's point-to-point layer replaced by a recorder that matches each send to
its receive by (source, destination, tag) and moves the rows: fast, and in-process (so the
mutation tests see it). On gloo, :func:`check_gloo` runs inside
test_expert_parallel.TestExpertParallel4 (its 4 ranks are up already: no process-group
spin-up of its own). Either way every rank builds the whole seeded exchange (every rank's inputs and segment tables) and checks what it
received against the rows the senders named, for several tensors at once, zero-length
segments, async and in-flight exchanges with disjoint tags, a subgroup whose group ranks
differ from the global ranks, and the bad-input errors (raised before any message).
"""

import collections
import contextlib
from unittest import mock

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import TestCase, run_tests

from torch_moe.distributed.exchange import all_to_all_segments


def make_exchange(size, seed, rows=12, max_segments=4):
    """Every rank's input rows and segment tables, the same on every rank (seeded).

    ins[s][d]: segments of rank s's input sent to d (random starts, may overlap);
    outs[d][s]: where they land in rank d's output (disjoint, shuffled, with gaps)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [
        [
            torch.randint(
                0, 4, (int(torch.randint(0, max_segments + 1, (), generator=g)),), generator=g
            ).tolist()
            for _ in range(size)
        ]
        for _ in range(size)
    ]  # lengths[s][d]: the segment lengths s sends d (zeros included)
    ins = [
        [
            [(int(torch.randint(0, rows - n + 1, (), generator=g)), n) for n in lengths[s][d]]
            for d in range(size)
        ]
        for s in range(size)
    ]
    outs, out_rows = [], []
    for d in range(size):
        pieces = [(s, i, n) for s in range(size) for i, n in enumerate(lengths[s][d])]
        order = torch.randperm(len(pieces), generator=g).tolist()
        placed, row = {}, 0
        for k in order:
            s, i, n = pieces[k]
            row += int(torch.randint(0, 2, (), generator=g))  # a gap left untouched
            placed[s, i] = (row, n)
            row += n
        outs.append([[placed[s, i] for i in range(len(lengths[s][d]))] for s in range(size)])
        out_rows.append(row + 1)
    return ins, outs, out_rows


def rank_input(s, seed, rows=12):
    g = torch.Generator().manual_seed(1000 * seed + s)
    return torch.randn(rows, 3, generator=g), torch.randint(0, 100, (rows,), generator=g)


class _Recorder:
    """torch.distributed's p2p layer for ranks simulated one after another in one process:
    ``batch_isend_irecv`` records the ops of the current rank; :meth:`deliver` then matches
    every send to exactly one receive (same source, destination and tag, same shape) and
    copies the rows."""

    P2POp = collections.namedtuple("P2POp", "op tensor group tag group_peer")

    def __init__(self, size):
        self.size, self.rank, self.posted = size, 0, []

    def patches(self):
        def p2p_op(op, tensor, group=None, tag=0, group_peer=None):
            return self.P2POp(op, tensor, group, tag, group_peer)

        return [
            mock.patch.object(dist, "get_world_size", lambda group=None: self.size),
            mock.patch.object(dist, "get_rank", lambda group=None: self.rank),
            mock.patch.object(dist, "P2POp", p2p_op),
            mock.patch.object(dist, "batch_isend_irecv", self.post),
        ]

    def post(self, ops):
        self.posted += [(self.rank, op) for op in ops]
        return [mock.Mock() for _ in ops]

    def deliver(self, test):
        sends, recvs = {}, {}
        for rank, op in self.posted:
            if op.op is dist.isend:
                key, table = (rank, op.group_peer, op.tag), sends
            else:
                key, table = (op.group_peer, rank, op.tag), recvs
            test.assertNotIn(key, table, f"(source, destination, tag) {key} used twice")
            table[key] = op.tensor
        test.assertEqual(sorted(sends), sorted(recvs), "unmatched sends or receives")
        for key, src in sends.items():
            test.assertEqual(recvs[key].shape, src.shape)
            recvs[key].copy_(src)
        self.posted = []


class TestAllToAllSegmentsSimulated(TestCase):
    SIZE = 3

    def _exchange(self, rec, seed, async_op=False, tag=0, group=None):
        """Every rank's call, then the delivery; returns (got, expected) per rank."""
        size = rec.size
        ins, outs, out_rows = make_exchange(size, seed)
        results = []
        for me in range(size):
            rec.rank = me
            x, idx = rank_input(me, seed)
            y = torch.full((out_rows[me], 3), -1.0)
            j = torch.full((out_rows[me],), -1)
            work = all_to_all_segments(
                [y, j], [x, idx], outs[me], ins[me], group, tag=tag, async_op=async_op
            )
            self.assertEqual(work is None, not async_op)
            expected_y, expected_j = y.clone(), j.clone()
            for s in range(size):
                xs, idxs = rank_input(s, seed)
                for (src, n), (dst, m) in zip(ins[s][me], outs[me][s], strict=True):
                    self.assertEqual(n, m)
                    expected_y[dst : dst + n] = xs[src : src + n]
                    expected_j[dst : dst + n] = idxs[src : src + n]
            results.append(((y, j), (expected_y, expected_j), work))
        return results

    def test_segments(self):
        for size in (1, 2, 3):
            rec = _Recorder(size)
            with contextlib.ExitStack() as stack:
                for p in rec.patches():
                    stack.enter_context(p)
                for seed in range(3):
                    results = self._exchange(rec, seed, tag=7 * seed)
                    rec.deliver(self)
                    for got, expected, _ in results:
                        self.assertEqual(got, expected)  # rows never named keep their -1
                # async: nothing is delivered before the wait's caller reads
                results = self._exchange(rec, 10, async_op=True, tag=100)
                rec.deliver(self)
                for got, expected, work in results:
                    work.wait()
                    self.assertEqual(got, expected)

    def test_tags(self):
        """Segment i of tensor j of one call carries tag + i * len(inputs) + j."""
        rec = _Recorder(2)
        x = torch.arange(8.0).reshape(4, 2)
        ids = torch.arange(4)
        with contextlib.ExitStack() as stack:
            for p in rec.patches():
                stack.enter_context(p)
            rec.rank = 0
            segs = [[], [(0, 1), (0, 0), (2, 2)]]
            all_to_all_segments(
                [x.clone(), ids.clone()], [x, ids], [[], []], segs, tag=40, async_op=True
            )
        tags = [(op.tag, op.group_peer, op.tensor.shape[0]) for _, op in rec.posted]
        # the zero-length segment 1 is skipped but keeps its index in the tag
        self.assertEqual(tags, [(40, 1, 1), (41, 1, 1), (44, 1, 2), (45, 1, 2)])

    def test_bad_input(self):
        rec = _Recorder(3)
        with contextlib.ExitStack() as stack:
            for p in rec.patches():
                stack.enter_context(p)
            for rank in range(3):
                rec.rank = rank
                check_bad_input(self, 3, rank)
        self.assertEqual(rec.posted, [])  # nothing was sent


class TestAllToAllIndices(TestCase):
    """The all_to_all exchange's row indices (built by segment, not by row), against the
    plan read row by row: the send index walks ``sent`` destination-major, the reorder
    walks the source-major receive buffer expert-major."""

    def test_indices_match_the_plan_row_by_row(self):
        from torch_moe.distributed.dispatch import (
            _expert_major_index,
            _send_index,
            chunk_plan,
        )

        g = torch.Generator().manual_seed(0)
        for trial in range(60):
            world, El = (1, 2, 3, 4)[trial % 4], 1 + trial % 5
            E = El * world
            send = torch.randint(0, 6, (E,), generator=g)
            recv = torch.randint(0, 6, (E,), generator=g)
            if trial % 7 == 0:
                send.zero_()  # nothing to send
            if trial % 5 == 0:
                recv.zero_()  # nothing to receive
            l0 = trial % El
            plan = chunk_plan((send.tolist() + recv.tolist()), E, world, l0, El)
            want_send = [a + i for segs in plan.sent for a, n in segs for i in range(n)]
            src_start, row = {}, 0
            for s in range(world):
                for j, n in enumerate(plan.recv_counts[s]):
                    src_start[s, j] = row
                    row += n
            want_reorder = [
                src_start[s, j] + i
                for j in range(El - l0)
                for s in range(world)
                for i in range(plan.recv_counts[s][j])
            ]
            got_send = _send_index(plan, torch.device("cpu"))
            got_reorder = _expert_major_index(plan, torch.device("cpu"))
            self.assertEqual(got_send.dtype, torch.int64)
            self.assertEqual(got_send.tolist(), want_send)
            self.assertEqual(got_reorder.tolist(), want_reorder)
            self.assertEqual(got_send.numel(), plan.send_rows)
            self.assertEqual(got_reorder.numel(), plan.rows)


def _check_exchange(test, group, members, seed, async_op=False, tag=0):
    me, size = members.index(dist.get_rank()), len(members)
    ins, outs, out_rows = make_exchange(size, seed)
    x, idx = rank_input(me, seed)
    y = torch.full((out_rows[me], 3), -1.0)
    j = torch.full((out_rows[me],), -1)
    work = all_to_all_segments(
        [y, j], [x, idx], outs[me], ins[me], group, tag=tag, async_op=async_op
    )
    expected_y, expected_j = y.clone(), j.clone()
    for s in range(size):
        xs, idxs = rank_input(s, seed)
        for (src, n), (dst, m) in zip(ins[s][me], outs[me][s], strict=True):
            test.assertEqual(n, m)
            expected_y[dst : dst + n] = xs[src : src + n]
            expected_j[dst : dst + n] = idxs[src : src + n]
    return work, (y, j), (expected_y, expected_j)


def check_gloo(test):
    """The exchange over a real process group (every rank of the world runs this; run by
    test_expert_parallel.TestExpertParallel4, whose 4 gloo ranks are already up): seeded
    exchanges, two in flight at once with disjoint tags, a subgroup whose group ranks differ
    from the global ranks, and the bad-input errors."""
    world = list(range(dist.get_world_size()))
    for seed in range(4):
        work, got, expected = _check_exchange(test, None, world, seed)
        test.assertIsNone(work)
        test.assertEqual(got, expected)  # rows never named keep their -1
    # two exchanges in flight at once between the same ranks: disjoint tag ranges
    first = _check_exchange(test, None, world, 10, async_op=True, tag=0)
    second = _check_exchange(test, None, world, 11, async_op=True, tag=100)
    for work, got, expected in (second, first):
        work.wait()
        test.assertEqual(got, expected)
    # a subgroup of global ranks [0, 2]: group ranks 0 and 1
    sub = dist.new_group([0, 2])
    if dist.get_rank() in (0, 2):
        work, got, expected = _check_exchange(test, sub, [0, 2], 20)
        test.assertEqual(got, expected)
    check_bad_input(test, dist.get_world_size(), dist.get_rank())


def check_bad_input(test, size, rank):
    """The bad-input errors, raised before any message (``test``'s assertRaisesRegex)."""
    x = torch.zeros(4, 2)
    none = [[] for _ in range(size)]
    with test.assertRaisesRegex(ValueError, "as many outputs as inputs .* 2 outputs and 1"):
        all_to_all_segments([x, x], [x], none, none)
    with test.assertRaisesRegex(
        ValueError, rf"in_segments must have one list per rank .*\({size}\), got 2"
    ):
        all_to_all_segments([x], [x], none, none[:2])
    with test.assertRaisesRegex(
        ValueError, rf"out_segments must have one list per rank .*\({size}\), got 1"
    ):
        all_to_all_segments([x], [x], none[:1], none)
    with test.assertRaisesRegex(ValueError, r"match its input in .* row shape.*\(4, 3\)"):
        all_to_all_segments([torch.zeros(4, 3)], [x], none, none)
    with test.assertRaisesRegex(ValueError, "match its input in dtype.*torch.float64"):
        all_to_all_segments([x.double()], [x], none, none)
    with test.assertRaisesRegex(ValueError, "must be contiguous"):
        square = torch.zeros(3, 3)
        all_to_all_segments([square], [square.t()], none, none)
    bad = [[] for _ in range(size)]
    bad[1] = [(3, 2)]
    with test.assertRaisesRegex(
        ValueError, r"in_segments\[1\] .*\(start=3, length=2\) outside the 4 rows"
    ):
        all_to_all_segments([x], [x], none, bad)
    with test.assertRaisesRegex(
        ValueError, r"out_segments\[1\] .*\(start=3, length=2\) outside the 4 rows"
    ):
        all_to_all_segments([x], [x], bad, none)
    mine = [[] for _ in range(size)]
    mine[rank] = [(0, 2)]
    theirs = [[] for _ in range(size)]
    theirs[rank] = [(0, 1)]
    with test.assertRaisesRegex(ValueError, f"rank {rank}'s segments for itself differ"):
        all_to_all_segments([x], [x], theirs, mine)


if __name__ == "__main__":
    run_tests()
