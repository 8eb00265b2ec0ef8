# Owner(s): ["module: moe"]
"""Tests for the hierarchical (intra-node, then inter-node) all-to-all and node-limited
routing (torch_moe.distributed.hierarchical).

The all-to-all tests run 4 gloo processes (2 nodes x 2 local ranks) and compare against
the flat ``all_to_all_single`` bitwise, forward and backward; the same processes also
cover 2-rank subgroups (a world-2 exchange) with node_size 1 and 2. The class keeps one
process group for all its tests (MultiProcContinuousTest): one spin-up, not one per test.
"""

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from dist_utils import GlooContinuousTest
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from torch_moe import ops
from torch_moe.distributed.hierarchical import hierarchical_all_to_all_single, nodes_per_token


def random_splits(size, seed, max_rows=5, zero_frac=0.3):
    """An R x R split matrix S[s][d], the same on every rank (seeded), with zeros."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, max_rows + 1, (size, size), generator=g)
    s[torch.rand(size, size, generator=g) < zero_frac] = 0
    return s.tolist()


def flat_a2a(x, out_splits, in_splits, group):
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    return dist_fn.all_to_all_single(out, x, out_splits, in_splits, group=group)


class TestHierarchicalAllToAll(GlooContinuousTest):
    """One gloo process group (4 ranks) for all the tests of the class."""

    world_size = 4

    def check_matches_flat(self, splits, group, node_size, row_shape, dtype, seed):
        me = dist.get_rank(group)
        size = dist.get_world_size(group)
        in_splits = list(splits[me])
        out_splits = [splits[s][me] for s in range(size)]
        g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
        x = torch.randn(sum(in_splits), *row_shape, generator=g).to(dtype)
        grad = torch.randn(sum(out_splits), *row_shape, generator=g).to(dtype)

        x_flat = x.clone().requires_grad_()
        out_flat = flat_a2a(x_flat, out_splits, in_splits, group)
        out_flat.backward(grad)

        x_hier = x.clone().requires_grad_()
        out_hier = hierarchical_all_to_all_single(x_hier, out_splits, in_splits, group, node_size)
        out_hier.backward(grad)

        msg = f"splits={splits} node_size={node_size} shape={row_shape} {dtype}"
        self.assertEqual(out_hier.shape, (sum(out_splits), *row_shape), msg=msg)
        self.assertEqual(out_hier, out_flat, atol=0, rtol=0, msg=msg)
        self.assertEqual(x_hier.grad, x_flat.grad, atol=0, rtol=0, msg=msg)
        # the split matrix handed in (no all_gather): the same exchange
        x_mat = x.clone().requires_grad_()
        out_mat = hierarchical_all_to_all_single(
            x_mat, out_splits, in_splits, group, node_size, split_matrix=splits
        )
        out_mat.backward(grad)
        self.assertEqual(out_mat, out_flat, atol=0, rtol=0, msg=msg)
        self.assertEqual(x_mat.grad, x_flat.grad, atol=0, rtol=0, msg=msg)
        # rows really come from where the split matrix says: row i of the chunk from rank s
        # is rank s's row (offset of rank me in s's input + i); checked on ids, not values
        ids = torch.arange(sum(in_splits), dtype=torch.float64) + 1000 * dist.get_rank()
        got = hierarchical_all_to_all_single(ids, out_splits, in_splits, group, node_size)
        ranks = dist.get_process_group_ranks(group)
        want = torch.cat(
            [
                torch.arange(sum(splits[s][:me]), sum(splits[s][: me + 1]), dtype=torch.float64)
                + 1000 * ranks[s]
                for s in range(size)
            ]
        )
        self.assertEqual(got, want, atol=0, rtol=0, msg=msg)

    def test_matches_flat(self):
        world = dist.group.WORLD
        cases = [
            (random_splits(4, seed=1), (8,), torch.float32),
            (random_splits(4, seed=2, zero_frac=0.6), (3, 5), torch.float32),
            (random_splits(4, seed=3, max_rows=40), (1024,), torch.bfloat16),  # wide rows
            ([[0] * 4 for _ in range(4)], (8,), torch.float32),  # nothing moves
            ([[0, 0, 0, 0], [3, 0, 2, 0], [1, 1, 1, 1], [0, 0, 0, 7]], (4,), torch.float64),
            ([[0, 0, 5, 0]] * 4, (4,), torch.float32),  # everything to one rank
        ]
        for seed, (splits, row_shape, dtype) in enumerate(cases):
            for node_size in (2, 1, 4):
                self.check_matches_flat(splits, world, node_size, row_shape, dtype, seed)
        # a world-2 exchange: 2-rank subgroups {0, 1} and {2, 3}, node_size 1 and 2
        pair, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
        for seed, splits in enumerate([random_splits(2, seed=7), [[0, 4], [0, 0]]]):
            for node_size in (1, 2):
                self.check_matches_flat(splits, pair, node_size, (6,), torch.float32, seed)

    def test_bad_input(self):
        x = torch.randn(4, 3)
        splits = [1, 1, 1, 1]
        # config errors: raised before any collective, on every rank
        with self.assertRaisesRegex(
            ValueError, r"node_size \(3\) must divide the group size \(4\)"
        ):
            hierarchical_all_to_all_single(x, splits, splits, node_size=3)
        with self.assertRaisesRegex(ValueError, r"node_size must be a positive int, got 0"):
            hierarchical_all_to_all_single(x, splits, splits, node_size=0)
        # bad splits on one rank: that rank names the problem, the others name the rank
        in_splits = [1, 1, 1, 2] if self.rank == 1 else splits
        pattern = (
            r"input_split_sizes \[1, 1, 1, 2\] sum to 5, but x has 4 rows"
            if self.rank == 1
            else r"rank\(s\) \[1\] of the group passed invalid split sizes"
        )
        with self.assertRaisesRegex(ValueError, pattern):
            hierarchical_all_to_all_single(x, splits, in_splits, node_size=2)
        # output splits that disagree with what the senders send: every rank raises
        out_splits = [1, 1, 2, 0] if self.rank == 3 else splits
        with self.assertRaisesRegex(
            ValueError,
            r"rank 3 expects 2 rows from rank 2 \(output_split_sizes\), but rank 2 sends 1",
        ):
            hierarchical_all_to_all_single(x, out_splits, splits, node_size=2)
        with self.assertRaisesRegex(ValueError, r"one entry per rank of the group \(4\)"):
            hierarchical_all_to_all_single(x, [4], [4], node_size=2)
        # a split matrix that does not fit (the same on every rank, so every rank raises)
        with self.assertRaisesRegex(ValueError, r"split_matrix must be 4 x 4 \(the group size\)"):
            hierarchical_all_to_all_single(x, splits, splits, node_size=2, split_matrix=[[1] * 4])
        with self.assertRaisesRegex(
            ValueError,
            r"split_matrix row \d \[2, 2, 2, 2\] and column \d \[2, 2, 2, 2\] must equal",
        ):
            hierarchical_all_to_all_single(
                x, splits, splits, node_size=2, split_matrix=[[2] * 4] * 4
            )
        # a group whose ranks are not in global-rank order (stages index peers by position)
        reversed_group = dist.new_group([3, 2, 1, 0], sort_ranks=False)
        with self.assertRaisesRegex(NotImplementedError, r"increasing global-rank order"):
            hierarchical_all_to_all_single(x, splits, splits, reversed_group, node_size=2)
        # the group still works after the errors
        out = hierarchical_all_to_all_single(x, splits, splits, node_size=2)
        self.assertEqual(out, flat_a2a(x, splits, splits, dist.group.WORLD), atol=0, rtol=0)


class TestNodeLimitedRouting(TestCase):
    @parametrize(
        "num_experts,num_nodes,limit,k,score_func",
        [
            (16, 4, 1, 2, "sigmoid"),
            (16, 4, 2, 4, "sigmoid"),
            (32, 8, 3, 8, "softmax"),
            (64, 8, 4, 8, "sigmoid"),  # DeepSeek-V3's shape: 8 groups, 4 kept, top-8
            (12, 3, 2, 3, "softmax_topk"),
        ],
    )
    def test_bounds_nodes_per_token(self, num_experts, num_nodes, limit, k, score_func):
        g = torch.Generator().manual_seed(num_experts * 10 + limit)
        logits = torch.randn(512, num_experts, generator=g)
        per_node = num_experts // num_nodes
        _, ids, _ = ops.topk_route(
            logits, k, score_func=score_func, num_expert_groups=num_nodes, num_limited_groups=limit
        )
        nodes = nodes_per_token(ids, per_node)
        # the naive count
        want = torch.tensor([len({e // per_node for e in row}) for row in ids.tolist()])
        self.assertEqual(nodes, want)
        self.assertLessEqual(int(nodes.max()), limit)
        self.assertGreaterEqual(int(nodes.min()), 1)
        # without the limit, tokens do reach more nodes (so the bound above is not vacuous)
        if limit < min(k, num_nodes):
            _, free_ids, _ = ops.topk_route(logits, k, score_func=score_func)
            self.assertGreater(int(nodes_per_token(free_ids, per_node).max()), limit)

    def test_nodes_per_token_edges(self):
        ids = torch.tensor([[0, 1, 2, 3], [3, 3, 3, 3], [7, 0, 4, 1]], dtype=torch.int32)
        self.assertEqual(nodes_per_token(ids, 2), torch.tensor([2, 1, 3]))
        self.assertEqual(nodes_per_token(ids, 8), torch.tensor([1, 1, 1]))
        self.assertEqual(nodes_per_token(torch.empty(0, 4, dtype=torch.int64), 2).shape, (0,))
        self.assertEqual(
            nodes_per_token(torch.empty(3, 0, dtype=torch.int64), 2),
            torch.zeros(3, dtype=torch.int64),
        )
        with self.assertRaisesRegex(ValueError, r"experts_per_node must be a positive int, got 0"):
            nodes_per_token(ids, 0)
        with self.assertRaisesRegex(ValueError, r"expected expert_ids to be a 2D integer tensor"):
            nodes_per_token(ids.float(), 2)
        with self.assertRaisesRegex(ValueError, r"2D integer tensor \[T, K\], got 1D"):
            nodes_per_token(ids[0], 2)


instantiate_parametrized_tests(TestNodeLimitedRouting)

if __name__ == "__main__":
    run_tests()
