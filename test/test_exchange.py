# Owner(s): ["module: moe"]
"""Tests for the segment all-to-all (torch_moe.distributed.exchange) on gloo.

One test method, 3 processes (one process-group spin-up, ~10 s here): every rank builds
the whole seeded exchange (every rank's inputs and segment tables) and checks what it
received against the rows the senders named, for several tensors at once, zero-length
segments, async and in-flight exchanges with disjoint tags, a subgroup whose group ranks
differ from the global ranks, and the bad-input errors (raised before any message).
"""

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import run_tests

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


class TestAllToAllSegments(MultiProcessTestCase):
    @property
    def world_size(self):
        return 3

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def check(self, group, members, seed, async_op=False, tag=0):
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
                self.assertEqual(n, m)
                expected_y[dst : dst + n] = xs[src : src + n]
                expected_j[dst : dst + n] = idxs[src : src + n]
        return work, (y, j), (expected_y, expected_j)

    def test_segments(self):
        dist.init_process_group(
            "gloo",
            rank=self.rank,
            world_size=self.world_size,
            init_method=f"file://{self.file_name}",
        )
        world = list(range(self.world_size))
        for seed in range(4):
            work, got, expected = self.check(None, world, seed)
            self.assertIsNone(work)
            self.assertEqual(got, expected)  # rows never named keep their -1
        # two exchanges in flight at once between the same ranks: disjoint tag ranges
        first = self.check(None, world, 10, async_op=True, tag=0)
        second = self.check(None, world, 11, async_op=True, tag=100)
        for work, got, expected in (second, first):
            work.wait()
            self.assertEqual(got, expected)
        # a subgroup of global ranks [0, 2]: group ranks 0 and 1
        sub = dist.new_group([0, 2])
        if self.rank != 1:
            work, got, expected = self.check(sub, [0, 2], 20)
            self.assertEqual(got, expected)
        self.check_bad_input()
        dist.destroy_process_group()

    def check_bad_input(self):
        x = torch.zeros(4, 2)
        none = [[] for _ in range(self.world_size)]
        with self.assertRaisesRegex(ValueError, "as many outputs as inputs .* 2 outputs and 1"):
            all_to_all_segments([x, x], [x], none, none)
        with self.assertRaisesRegex(
            ValueError, r"in_segments must have one list per rank .*\(3\), got 2"
        ):
            all_to_all_segments([x], [x], none, none[:2])
        with self.assertRaisesRegex(ValueError, "match its input in dtype.*torch.float64"):
            all_to_all_segments([x.double()], [x], none, none)
        with self.assertRaisesRegex(ValueError, "must be contiguous"):
            square = torch.zeros(3, 3)
            all_to_all_segments([square], [square.t()], none, none)
        bad = [[], [(3, 2)], []]
        with self.assertRaisesRegex(
            ValueError, r"in_segments\[1\] .*\(start=3, length=2\) outside the 4 rows"
        ):
            all_to_all_segments([x], [x], none, bad)
        mine = [[] for _ in range(self.world_size)]
        mine[self.rank] = [(0, 2)]
        theirs = [[] for _ in range(self.world_size)]
        theirs[self.rank] = [(0, 1)]
        with self.assertRaisesRegex(ValueError, f"rank {self.rank}'s segments for itself differ"):
            all_to_all_segments([x], [x], theirs, mine)


if __name__ == "__main__":
    run_tests()
