# Owner(s): ["module: moe"]
"""Tests for load-aware expert placement (torch_moe.distributed.placement)."""

import itertools

import naive
import torch
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from torch_moe import ops
from torch_moe.distributed import (
    ExpertPlacement,
    balancedness,
    identity_placement,
    plan_placement,
    remap_expert_weights,
    remap_indices,
    route_to_replicas,
)
from torch_moe.nn.functional import grouped_swiglu


def zipf_load(num_experts, alpha=1.2, num_tokens=4096, k=4, seed=0):
    """Tokens per expert when T tokens pick K distinct experts from a Zipf(alpha) popularity."""
    g = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** alpha
    popularity = popularity[torch.randperm(num_experts, generator=g)]
    k = min(k, num_experts)
    ids = torch.multinomial(popularity.expand(num_tokens, -1), k, generator=g)
    return torch.bincount(ids.flatten(), minlength=num_experts)


def random_load(num_experts, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(num_experts, generator=g, dtype=torch.float64) * 100


# (E, R, num_redundant)
CONFIGS = [(4, 2, 0), (8, 4, 4), (16, 4, 0), (16, 4, 8), (64, 8, 8), (64, 8, 16), (6, 3, 3)]


class TestPlacement(TestCase):
    def check_invariants(self, pl: ExpertPlacement, num_experts, num_ranks, num_redundant):
        num_physical = num_experts + num_redundant
        slots = num_physical // num_ranks
        self.assertEqual(pl.num_ranks, num_ranks)
        self.assertEqual(pl.slots_per_rank, slots)
        self.assertEqual(pl.num_physical, num_physical)
        self.assertEqual(pl.num_experts, num_experts)
        p2l, l2p, counts = pl.phys_to_logical, pl.logical_to_phys, pl.replica_count
        self.assertEqual(p2l.dtype, torch.int64)
        self.assertEqual(l2p.dtype, torch.int64)
        self.assertEqual(counts.dtype, torch.int64)
        self.assertEqual(p2l.shape, (num_physical,))
        self.assertTrue(bool((counts >= 1).all()))
        self.assertEqual(int(counts.sum()), num_physical)
        self.assertEqual(torch.bincount(p2l, minlength=num_experts), counts)
        self.assertEqual(l2p.shape, (num_experts, int(counts.max())))
        for e in range(num_experts):
            slots_e = l2p[e, : counts[e]]
            self.assertTrue(bool((l2p[e, counts[e] :] == -1).all()))
            self.assertEqual(slots_e, (p2l == e).nonzero().flatten())
        # each rank has exactly S slots; no expert twice on one rank when avoidable
        per_rank = p2l.view(num_ranks, slots)
        if int(counts.max()) <= num_ranks:
            for r in range(num_ranks):
                self.assertEqual(
                    per_rank[r].unique().numel(), slots, msg=f"rank {r}: {per_rank[r]}"
                )

    @parametrize("config", CONFIGS)
    @parametrize("dist", ["random", "zipf"])
    def test_invariants(self, config, dist):
        num_experts, num_ranks, num_redundant = config
        for seed in range(3):
            load = (
                random_load(num_experts, seed)
                if dist == "random"
                else zipf_load(num_experts, seed=seed)
            )
            pl = plan_placement(load, num_ranks, num_redundant=num_redundant)
            self.check_invariants(pl, num_experts, num_ranks, num_redundant)
            # rank loads conserve the total load
            self.assertEqual(pl.rank_loads(load).sum(), load.double().sum())

    def test_no_duplicates_random_shapes(self):
        """No rank holds two replicas of one expert when replica counts allow it."""
        g = torch.Generator().manual_seed(0)
        for trial in range(120):
            num_ranks = int(torch.randint(1, 9, (), generator=g))
            num_experts = int(torch.randint(1, 25, (), generator=g))
            min_slots = -(-num_experts // num_ranks)
            slots = min_slots + int(torch.randint(0, 4, (), generator=g))
            load = (
                torch.rand(num_experts, generator=g, dtype=torch.float64) ** (1 + trial % 6) * 100
            )
            if trial % 7 == 0:  # many ties
                load = torch.randint(0, 3, (num_experts,), generator=g).double()
            num_redundant = num_ranks * slots - num_experts
            pl = plan_placement(load, num_ranks, num_redundant=num_redundant)
            self.check_invariants(pl, num_experts, num_ranks, num_redundant)
            if slots <= num_experts:  # then every expert gets at most R replicas
                self.assertLessEqual(int(pl.replica_count.max()), num_ranks)

    def test_duplicate_repair(self):
        """The swap pass behind the packing (the greedy rarely needs it) removes duplicates."""
        from torch_moe.distributed.placement import _remove_duplicates

        rank_items = [[(5.0, 0), (5.0, 0), (1.0, 3)], [(4.0, 1), (2.0, 2), (1.0, 4)]]
        _remove_duplicates(rank_items)
        for items in rank_items:
            experts = [e for _, e in items]
            self.assertEqual(len(set(experts)), len(experts), msg=str(rank_items))
        # the closest-load swap: expert 0 (5.0) traded with expert 1 (4.0)
        self.assertEqual(sorted(e for _, e in rank_items[1]), [0, 2, 4])
        # unavoidable duplicates (a single rank) are left alone
        single = [[(1.0, 0), (1.0, 0)]]
        _remove_duplicates(single)
        self.assertEqual(single, [[(1.0, 0), (1.0, 0)]])

    def test_invariants_extreme(self):
        # all-zero load, one expert, more replicas than ranks can hold distinctly
        pl = plan_placement(torch.zeros(8), 4, num_redundant=4)
        self.check_invariants(pl, 8, 4, 4)
        self.assertEqual(balancedness(torch.zeros(8), pl), 1.0)
        pl = plan_placement(torch.tensor([5.0]), 3, num_redundant=2)
        self.check_invariants(pl, 1, 3, 2)
        self.assertEqual(pl.replica_count, torch.tensor([3]))
        pl = plan_placement(torch.tensor([9.0, 1.0]), 2, num_redundant=4)  # S=3 > E
        self.check_invariants(pl, 2, 2, 4)
        self.assertEqual(pl.replica_count, torch.tensor([4, 2]))  # R each first, then by load
        pl = plan_placement(torch.tensor([1, 2, 3, 4], dtype=torch.int32), 1)
        self.check_invariants(pl, 4, 1, 0)

    def test_identity(self):
        pl = identity_placement(8, 4)
        self.check_invariants(pl, 8, 4, 0)
        self.assertEqual(pl.phys_to_logical, torch.arange(8))
        self.assertEqual(
            pl.rank_loads(torch.arange(8.0)), torch.tensor([1.0, 5, 9, 13], dtype=torch.float64)
        )

    @parametrize(
        "config", [(16, 4, 0), (16, 4, 4), (64, 8, 0), (64, 8, 8), (64, 8, 16), (256, 32, 32)]
    )
    def test_better_than_identity(self, config):
        num_experts, num_ranks, num_redundant = config
        ident = identity_placement(num_experts, num_ranks)
        for seed in range(3):
            load = zipf_load(num_experts, seed=seed, num_tokens=2048, k=8)
            b_plan = balancedness(
                load, plan_placement(load, num_ranks, num_redundant=num_redundant)
            )
            b_ident = balancedness(load, ident)
            self.assertGreater(b_plan, b_ident)  # Zipf loads are skewed: strictly better
        # skewed onto the experts of rank 0 of the identity layout
        load = torch.ones(num_experts)
        load[: num_experts // num_ranks] = 50
        b_plan = balancedness(load, plan_placement(load, num_ranks, num_redundant=num_redundant))
        self.assertGreater(b_plan, balancedness(load, ident) + 0.3)

    def test_uniform_load_perfect(self):
        load = torch.full((16,), 7.0)
        self.assertEqual(balancedness(load, plan_placement(load, 4)), 1.0)
        self.assertEqual(balancedness(load, identity_placement(16, 4)), 1.0)

    def test_hot_expert_replicated(self):
        num_experts, num_ranks = 16, 4
        load = torch.ones(num_experts)
        load[5] = 100.0
        pl0 = plan_placement(load, num_ranks)
        pl = plan_placement(load, num_ranks, num_redundant=num_ranks)
        self.assertEqual(int(pl.replica_count[5]), num_ranks)  # one copy per rank
        self.assertEqual(int(pl.replica_count.sum()) - num_experts, num_ranks)
        # the replicas of expert 5 are on distinct ranks
        ranks = pl.logical_to_phys[5] // pl.slots_per_rank
        self.assertEqual(ranks.unique().numel(), num_ranks)
        self.assertGreater(balancedness(load, pl), 0.95)
        self.assertLess(balancedness(load, pl0), 0.35)

    def test_replica_choice(self):
        # extra replicas go to the highest load per replica: 12 -> (6, 6) then 8 next
        load = torch.tensor([12.0, 8.0, 1.0, 1.0])
        pl = plan_placement(load, 2, num_redundant=2)
        self.assertEqual(pl.replica_count, torch.tensor([2, 2, 1, 1]))
        pl = plan_placement(load, 3, num_redundant=5)  # at most R=3 replicas each
        self.assertEqual(pl.replica_count, torch.tensor([3, 3, 2, 1]))

    @parametrize("sizes", [(4, 2, 0), (6, 3, 0), (5, 2, 1), (4, 2, 2), (3, 3, 3)])
    def test_brute_force(self, sizes):
        """Within 4/3 (the LPT bound) of the best packing of the same replicas."""
        num_experts, num_ranks, num_redundant = sizes
        slots = (num_experts + num_redundant) // num_ranks
        g = torch.Generator().manual_seed(0)
        for trial in range(20):
            load = torch.randint(0, 20, (num_experts,), generator=g).double()
            if trial == 0:
                load = torch.tensor([3.0, 3.0, 2.0, 2.0, 2.0, 1.0][:num_experts])
            pl = plan_placement(load, num_ranks, num_redundant=num_redundant)
            w = (load / pl.replica_count).tolist()
            replicas = sorted(int(e) for e in pl.phys_to_logical)
            best = float("inf")
            for perm in set(itertools.permutations(replicas)):
                rank_max = max(
                    sum(w[e] for e in perm[r * slots : (r + 1) * slots]) for r in range(num_ranks)
                )
                best = min(best, rank_max)
            got = float(pl.rank_loads(load).max())
            self.assertLessEqual(got, 4.0 / 3.0 * best + 1e-9, msg=f"load {load.tolist()}")

    def test_multi_layer(self):
        # NB (shared definition): a stacked [L, E] plan is defined as the per-layer plans, so
        # the per-layer call is the oracle here; each layer's plan is checked on its own by
        # check_invariants and by test_brute_force.
        load_LE = torch.stack([zipf_load(16, seed=s) for s in range(3)])
        load_LE[1, 3] = 10**6  # one very hot expert in layer 1: more replicas there
        pl = plan_placement(load_LE, 4, num_redundant=4)
        self.assertEqual(pl.num_layers, 3)
        self.assertEqual(pl.phys_to_logical.shape, (3, 20))
        self.assertEqual(pl.rank_loads(load_LE).shape, (3, 4))
        per_layer = []
        for i in range(3):
            one = plan_placement(load_LE[i], 4, num_redundant=4)
            layer = pl.layer(i)
            self.check_invariants(layer, 16, 4, 4)
            self.assertEqual(layer.phys_to_logical, one.phys_to_logical)
            self.assertEqual(layer.logical_to_phys, one.logical_to_phys)
            per_layer.append(balancedness(load_LE[i], one))
        self.assertEqual(balancedness(load_LE, pl), sum(per_layer) / 3)

    def test_deterministic(self):
        load = zipf_load(64)
        a = plan_placement(load, 8, num_redundant=8)
        b = plan_placement(load.clone(), 8, num_redundant=8)
        self.assertEqual(a.phys_to_logical, b.phys_to_logical)


class TestRouteAndRemap(TestCase):
    @parametrize("num_redundant", [0, 4, 12])
    def test_route_to_replicas(self, num_redundant):
        num_experts, num_ranks, num_tokens, k = 16, 4, 301, 4
        load = zipf_load(num_experts, seed=1)
        pl = plan_placement(load, num_ranks, num_redundant=num_redundant)
        g = torch.Generator().manual_seed(2)
        popularity = load.double() + 1
        ids = torch.multinomial(popularity.expand(num_tokens, -1), k, generator=g)
        for dtype in (torch.int64, torch.int32):
            phys = route_to_replicas(ids.to(dtype), pl)
            self.assertEqual(phys.dtype, torch.int64)
            self.assertEqual(phys.shape, ids.shape)
            self.assertEqual(pl.phys_to_logical[phys], ids)
            # even spread: replica counts of one expert differ by at most 1
            per_slot = torch.bincount(phys.flatten(), minlength=pl.num_physical)
            for e in range(num_experts):
                c = per_slot[pl.logical_to_phys[e, : pl.replica_count[e]]]
                self.assertLessEqual(int(c.max() - c.min()), 1)
            self.assertEqual(route_to_replicas(ids, pl), phys)  # deterministic
        empty = route_to_replicas(torch.empty(0, k, dtype=torch.int64), pl)
        self.assertEqual(empty.shape, (0, k))

    def test_route_bad_inputs(self):
        pl = plan_placement(torch.ones(8), 2)
        with self.assertRaisesRegex(
            ValueError, r"expert_ids must be in \[0, 8\), got values in \[0, 8\]"
        ):
            route_to_replicas(torch.tensor([[0, 8]]), pl)
        with self.assertRaisesRegex(
            ValueError, "expected int32/int64 expert_ids, got torch.float32"
        ):
            route_to_replicas(torch.zeros(2, 2), pl)
        stacked = plan_placement(torch.ones(2, 8), 2)
        with self.assertRaisesRegex(
            ValueError, "expected a single-layer placement, got one stacked over 2"
        ):
            route_to_replicas(torch.zeros(2, 2, dtype=torch.int64), stacked)

    @parametrize("num_redundant", [0, 4, 8])
    def test_end_to_end_replicated_moe(self, num_redundant):
        """Dropless MoE with replicated experts == the unreplicated one (float64)."""
        num_tokens, dim, hidden, num_experts, k, num_ranks = 37, 8, 12, 8, 3, 4
        g = torch.Generator().manual_seed(0)
        x = torch.randn(num_tokens, dim, generator=g, dtype=torch.float64)
        logits = torch.randn(num_tokens, num_experts, generator=g, dtype=torch.float64)
        logits[:, 2] += 3  # a hot expert
        w13 = torch.randn(num_experts, 2 * hidden, dim, generator=g, dtype=torch.float64)
        w2 = torch.randn(num_experts, dim, hidden, generator=g, dtype=torch.float64)
        weights, ids, counts = ops.topk_route(logits, k)

        # the oracle: naive.moe, one token and one chosen (logical) expert at a time
        ref = naive.moe(x, weights, ids, w13, w2)

        pl = plan_placement(counts, num_ranks, num_redundant=num_redundant)
        logical = identity_placement(num_experts, 1)
        w13_P = remap_expert_weights(w13, logical, pl)
        w2_P = remap_expert_weights(w2, logical, pl)
        phys = route_to_replicas(ids, pl)
        x_perm, perm = ops.permute(x, phys, pl.num_physical)
        out = ops.unpermute(grouped_swiglu(x_perm, w13_P, w2_P, perm.offs), weights, perm)
        self.assertEqual(out, ref, atol=1e-12, rtol=1e-12)
        if num_redundant:
            self.assertGreater(int(pl.replica_count[2]), 1)

    def test_remap_round_trip(self):
        num_experts, num_ranks = 16, 4
        w_E = torch.randn(num_experts, 3, 5)
        logical = identity_placement(num_experts, 1)
        old = plan_placement(zipf_load(num_experts, seed=0), num_ranks, num_redundant=4)
        new = plan_placement(zipf_load(num_experts, seed=7), 2, num_redundant=8)
        w_old = remap_expert_weights(w_E, logical, old)
        self.assertEqual(w_old, w_E[old.phys_to_logical], atol=0, rtol=0)
        w_new = remap_expert_weights(w_old, old, new)
        self.assertEqual(w_new, w_E[new.phys_to_logical], atol=0, rtol=0)
        back = remap_expert_weights(w_new, new, old)
        self.assertEqual(back, w_old, atol=0, rtol=0)
        self.assertEqual(remap_expert_weights(back, old, logical), w_E, atol=0, rtol=0)
        # every new slot reads an old slot that holds the same logical expert
        src = remap_indices(old, new)
        self.assertTrue(bool((src >= 0).all()))
        self.assertEqual(old.phys_to_logical[src], new.phys_to_logical)

    def test_remap_bad_inputs(self):
        a = plan_placement(torch.ones(8), 2)
        b = plan_placement(torch.ones(8), 4, num_redundant=4)
        with self.assertRaisesRegex(
            ValueError, r"expected w of shape \[8, \.\.\.\].*got \(12, 3\)"
        ):
            remap_expert_weights(torch.zeros(12, 3), a, b)
        with self.assertRaisesRegex(ValueError, "same number of experts, got 8 and 4"):
            remap_indices(a, identity_placement(4, 2))
        # a hand-made placement that lost an expert cannot be a source
        broken = ExpertPlacement(
            torch.tensor([0, 0, 1, 2]),
            torch.tensor([[0, 1], [2, -1], [3, -1], [-1, -1]]),
            torch.tensor([2, 1, 1, 0]),
            2,
            2,
        )
        with self.assertRaisesRegex(
            ValueError, r"at least one replica, but old has none of expert\(s\) \[3\]"
        ):
            remap_indices(broken, identity_placement(4, 2))
        with self.assertRaisesRegex(ValueError, "no layer dim"):
            a.layer(0)


class TestPlacementErrors(TestCase):
    def test_bad_inputs(self):
        with self.assertRaisesRegex(
            ValueError, "expected load to be 1D \\[E\\] or 2D \\[L, E\\], got 3D"
        ):
            plan_placement(torch.ones(2, 2, 2), 2)
        with self.assertRaisesRegex(ValueError, "expected load to be 1D .* got 0D"):
            plan_placement(torch.tensor(1.0), 1)
        with self.assertRaisesRegex(ValueError, "load must be non-negative, got min -1.0"):
            plan_placement(torch.tensor([1.0, -1.0]), 2)
        with self.assertRaisesRegex(ValueError, "load must be finite, got nan"):
            plan_placement(torch.tensor([1.0, float("nan")]), 2)
        with self.assertRaisesRegex(ValueError, "expected at least one expert"):
            plan_placement(torch.ones(0), 1)
        with self.assertRaisesRegex(ValueError, "num_ranks must be a positive integer, got 0"):
            plan_placement(torch.ones(4), 0)
        with self.assertRaisesRegex(
            ValueError, "num_redundant must be a non-negative integer, got -1"
        ):
            plan_placement(torch.ones(4), 2, num_redundant=-1)
        with self.assertRaisesRegex(
            ValueError,
            r"num_experts \+ num_redundant \(64 \+ 1 = 65\) must be divisible by num_ranks \(8\)",
        ):
            plan_placement(torch.ones(64), 8, num_redundant=1)
        with self.assertRaisesRegex(ValueError, r"must be divisible by num_ranks \(4\)"):
            identity_placement(6, 4)
        with self.assertRaisesRegex(ValueError, "num_experts must be a positive integer, got 0"):
            identity_placement(0, 1)
        pl = plan_placement(torch.ones(4), 2)
        with self.assertRaisesRegex(ValueError, r"expected load of shape \(4,\), got \(5,\)"):
            balancedness(torch.ones(5), pl)


instantiate_parametrized_tests(TestPlacement)
instantiate_parametrized_tests(TestRouteAndRemap)

if __name__ == "__main__":
    run_tests()
