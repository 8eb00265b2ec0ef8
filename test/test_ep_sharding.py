# Owner(s): ["module: moe"]
"""DTensor sharding rules of the torch_moe ops (torch_moe.distributed.sharding).

Each op runs on DTensors (gloo, 2 ranks) under every strategy its rule lists: the
values equal the op on the full tensors, the output placements are the ones the rule
promises, the communication is counted with CommDebugMode, and gradients flow back
through the DTensors where the op has autograd. Everything in float64, so the DTensor
results match the single-tensor op to the default tolerances.
"""

import torch
from dist_utils import GlooContinuousTest
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_utils import run_tests

import torch_moe.distributed  # noqa: F401  (registers the sharding rules)
from torch_moe.distributed.sharding import SHARDED_OPS

ops = torch.ops.torch_moe
c10d = torch.ops.c10d_functional
R, P = Replicate(), Partial()

# T tokens (odd: uneven Shard(0)), E experts, K top-k, D model dim, F expert hidden dim
T, E, K, D, F = 7, 4, 2, 6, 4


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64)


def _offs(num_rows, num_groups, seed):
    """Random non-decreasing group ends with an empty group and a zero tail."""
    cuts = torch.randint(0, num_rows - 1, (num_groups - 1,), generator=_gen(seed))
    ends = torch.cat([torch.sort(cuts).values, torch.tensor([num_rows - 1])])
    ends[1] = ends[0]  # group 1 is empty
    return ends.to(torch.int32)


class TestEPSharding(GlooContinuousTest):
    """One gloo process group (2 ranks) for both tests."""

    world_size = 2

    # ------------------------------------------------------------------ helpers

    def dt(self, full, placement, *, grad=False):
        """``full`` as a DTensor with one placement; Partial splits it into two random addends."""
        if isinstance(placement, Partial):
            noise = _randn(*full.shape, seed=100)
            local = full - noise if self.rank == 0 else noise
            out = DTensor.from_local(local, self.mesh, [P], run_check=False)
        else:
            out = distribute_tensor(full, self.mesh, [placement])
        if grad:
            out = out.detach().requires_grad_()
        return out

    def run_op(self, fn, *args):
        with CommDebugMode() as comm:
            out = fn(*args)
        return out, comm

    def assert_dt(self, out, placement, expected):
        self.assertIsInstance(out, DTensor)
        self.assertEqual(tuple(out.placements), (placement,))
        self.assertEqual(out.full_tensor(), expected)

    @property
    def mesh(self):
        if not hasattr(self, "_mesh"):
            self._mesh = init_device_mesh("cpu", (self.world_size,))
        return self._mesh

    # ------------------------------------------------------------------ tests
    # (each check below is a group of cases)

    def test_routing_and_permute(self):
        self.check_router_logits()
        self.check_routing()
        self.check_permute_indices()
        self.check_permute_unpermute()
        self.check_weighted_row_dot()
        self.check_layer_pipeline()

    def test_grouped_gemms(self):
        self.check_grouped_mm()
        self.check_grouped_swiglu()
        self.check_bad_inputs()

    # ------------------------------------------------------------------ checks

    def check_router_logits(self):
        x, w, b = _randn(T, D, seed=20), _randn(E, D, seed=21), _randn(E, seed=22)
        grad = _randn(T, E, seed=23)
        ref_x, ref_w, ref_b = (t.clone().requires_grad_() for t in (x, w, b))
        ops.router_logits(ref_x, ref_w, ref_b).backward(grad)
        ref_nb_x, ref_nb_w = (t.clone().requires_grad_() for t in (x, w))
        ops.router_logits(ref_nb_x, ref_nb_w).backward(grad)
        # (x, weight, bias or None) -> logits; then the gradients' placements
        cases = [
            ((R, R, R), R, (R, R, R)),
            ((Shard(0), R, R), Shard(0), (Shard(0), P, P)),
            ((R, Shard(0), Shard(0)), Shard(1), (P, Shard(0), Shard(0))),
            ((Shard(1), Shard(1), None), P, (Shard(1), Shard(1), None)),
            ((P, R, None), P, None),
        ]
        for (p_x, p_w, p_b), p_out, p_grads in cases:
            with_bias = p_b is not None
            d_x, d_w = self.dt(x, p_x, grad=True), self.dt(w, p_w, grad=True)
            d_b = self.dt(b, p_b, grad=True) if with_bias else None
            out, comm = self.run_op(ops.router_logits, d_x, d_w, d_b)
            self.assertEqual(comm.get_total_counts(), 0, msg=f"forward {(p_x, p_w, p_b)}")
            want = ops.router_logits(x, w, b if with_bias else None)
            self.assert_dt(out, p_out, want)
            if p_grads is None:  # Partial x: a gradient of the addends is not asked for
                continue
            # the gradient of a Partial output is a replicated one
            d_grad = distribute_tensor(grad, self.mesh, [R if p_out == P else p_out])
            with CommDebugMode() as comm:
                out.backward(d_grad)
            self.assertEqual(comm.get_total_counts(), 0, msg=f"backward {(p_x, p_w, p_b)}")
            ref = (ref_x, ref_w, ref_b) if with_bias else (ref_nb_x, ref_nb_w)
            for d, p, r in zip((d_x, d_w, d_b), p_grads, ref):
                self.assert_dt(d.grad, p, r.grad)
        # a Partial gradient (linear in it): Partial gradients, no communication
        args = (self.dt(grad, P), self.dt(x, R), self.dt(w, R), True, True)
        (gx, gw), comm = self.run_op(ops.router_logits_backward, *args)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assert_dt(gx, P, ref_x.grad)
        self.assert_dt(gw, P, ref_w.grad)

    def check_routing(self):
        mesh = self.mesh
        propagator = DTensor._op_dispatcher.sharding_propagator
        for op in SHARDED_OPS:
            self.assertIn(op, propagator.op_strategy_funcs, msg=str(op))
        logits = _randn(T, E, seed=0)
        bias = _randn(E, seed=1) * 0.1
        g_TK = _randn(T, K, seed=2)
        # the last case: DeepSeek-V2's groups (scored by their best expert) and LFM2's eps
        for score_func, with_bias, tail in [
            ("softmax", False, (None, None, True, 2.0)),
            ("sigmoid", True, (None, None, True, 2.0)),
            ("softmax", False, (2, 1, True, 16.0, "max", 1e-6)),
        ]:
            args = (K, score_func, bias if with_bias else None, *tail)
            ref_logits = logits.clone().requires_grad_()
            ref_w, ref_ids, ref_counts = ops.topk_route(ref_logits, *args)
            (ref_w * g_TK).sum().backward()
            for placement, (p_w, p_counts) in [(Shard(0), (Shard(0), P)), (R, (R, R))]:
                d_logits = distribute_tensor(logits, mesh, [placement]).requires_grad_()
                d_args = list(args)
                if with_bias:
                    d_args[2] = distribute_tensor(bias, mesh, [R])
                (w, ids, counts), comm = self.run_op(ops.topk_route, d_logits, *d_args)
                self.assertEqual(comm.get_total_counts(), 0)
                self.assert_dt(w, p_w, ref_w)
                self.assert_dt(ids, p_w, ref_ids)
                self.assertEqual(tuple(counts.placements), (p_counts,))
                with CommDebugMode() as comm:
                    full_counts = counts.full_tensor()
                self.assertEqual(full_counts, ref_counts)
                self.assertEqual(comm.get_comm_counts()[c10d.all_reduce], int(p_counts == P))
                # backward: topk_route_backward under the same strategy, no communication
                loss = (w * distribute_tensor(g_TK, mesh, [p_w])).sum()
                with CommDebugMode() as comm:
                    loss.backward()
                self.assertEqual(comm.get_total_counts(), 0)
                self.assert_dt(d_logits.grad, placement, ref_logits.grad)

        # expert-sharded logits are all-gathered first: softmax and top-k span all experts
        d_logits = distribute_tensor(logits, mesh, [Shard(1)])
        for score_func in ("softmax", "sigmoid"):
            ref = ops.topk_route(logits, K, score_func)
            outs, comm = self.run_op(ops.topk_route, d_logits, K, score_func)
            self.assertEqual(comm.get_total_counts(), 1)
            self.assertEqual(comm.get_comm_counts()[c10d.all_gather_into_tensor], 1)
            for out, expected in zip(outs, ref):
                self.assert_dt(out, R, expected)

        # topk_route_backward with a Partial incoming gradient stays Partial
        ids = ops.topk_route(logits, K)[1]
        ref = ops.topk_route_backward(g_TK, logits, ids, "softmax", False, 1.0)
        d_args = (distribute_tensor(logits, mesh, [R]), distribute_tensor(ids, mesh, [R]))
        out, comm = self.run_op(
            ops.topk_route_backward, self.dt(g_TK, P), *d_args, "softmax", False, 1.0
        )
        self.assertEqual(comm.get_total_counts(), 0)
        self.assert_dt(out, P, ref)

    def check_permute_indices(self):
        mesh = self.mesh
        ids = torch.randint(0, E, (T, K), generator=_gen(3))
        for align, capacity in [(1, None), (4, 2)]:
            ref = ops.permute_indices(ids, E, align, capacity)
            for placement, gathers in [(R, 0), (Shard(0), 1)]:
                d_ids = distribute_tensor(ids, mesh, [placement])
                outs, comm = self.run_op(ops.permute_indices, d_ids, E, align, capacity)
                # a token-sharded expert_ids is all-gathered: the layout is global
                self.assertEqual(comm.get_total_counts(), gathers)
                self.assertEqual(comm.get_comm_counts()[c10d.all_gather_into_tensor], gathers)
                for out, expected in zip(outs, ref):
                    self.assert_dt(out, R, expected)

    def check_permute_unpermute(self):
        mesh = self.mesh
        ids = torch.randint(0, E, (T, K), generator=_gen(4))
        row_to_slot, slot_to_row, *_ = ops.permute_indices(ids, E, 2)
        x = _randn(T, D, seed=5)
        w = _randn(T, K, seed=6)
        y = _randn(row_to_slot.shape[0], D, seed=7)
        d_r2s = distribute_tensor(row_to_slot, mesh, [R])
        d_s2r = distribute_tensor(slot_to_row, mesh, [R])
        d_w = distribute_tensor(w, mesh, [R])

        # permute and unpermute: R, feature-sharded, Partial; with and without weights; no
        # communication
        cases = (
            (ops.permute, x, (row_to_slot, slot_to_row), (d_r2s, d_s2r)),
            (ops.unpermute, y, (slot_to_row, row_to_slot), (d_s2r, d_r2s)),
        )
        for op, data, index, d_index in cases:
            for weights in (None, w):
                ref = op(data, *index, weights)
                for placement in (R, Shard(1), P):
                    dw = None if weights is None else d_w
                    out, comm = self.run_op(op, self.dt(data, placement), *d_index, dw)
                    self.assertEqual(comm.get_total_counts(), 0)
                    self.assert_dt(out, placement, ref)

        # unpermute into token-sharded outputs: no communication
        ref = ops.unpermute(y, slot_to_row, row_to_slot, w)
        s2r_0 = distribute_tensor(slot_to_row, mesh, [Shard(0)])
        w_0 = distribute_tensor(w, mesh, [Shard(0)])
        out, comm = self.run_op(ops.unpermute, self.dt(y, R), s2r_0, d_r2s, w_0)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assert_dt(out, Shard(0), ref)

        # backward, feature-sharded: permute -> unpermute round trip with weights
        ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
        g = _randn(T, D, seed=8)
        mid = ops.permute(ref_x, row_to_slot, slot_to_row, ref_w)
        (ops.unpermute(mid, slot_to_row, row_to_slot, ref_w) * g).sum().backward()
        d_x = self.dt(x, Shard(1), grad=True)
        d_wg = self.dt(w, R, grad=True)
        mid = ops.permute(d_x, d_r2s, d_s2r, d_wg)
        self.assertEqual(tuple(mid.placements), (Shard(1),))
        out = ops.unpermute(mid, d_s2r, d_r2s, d_wg)
        self.assertEqual(tuple(out.placements), (Shard(1),))
        (out * distribute_tensor(g, mesh, [Shard(1)])).sum().backward()
        self.assert_dt(d_x.grad, Shard(1), ref_x.grad)
        # the weights' gradient is a dot over the sharded D: a partial sum
        self.assertEqual(d_wg.grad.full_tensor(), ref_w.grad)

        # backward, token-sharded combine: dy needs the whole gradient (all-gathers)
        ref_y, ref_w = y.clone().requires_grad_(), w.clone().requires_grad_()
        (ops.unpermute(ref_y, slot_to_row, row_to_slot, ref_w) * g).sum().backward()
        d_y = self.dt(y, R, grad=True)
        w_0 = self.dt(w, Shard(0), grad=True)
        out = ops.unpermute(d_y, s2r_0, d_r2s, w_0)
        (out * distribute_tensor(g, mesh, [Shard(0)])).sum().backward()
        self.assertEqual(d_y.grad.full_tensor(), ref_y.grad)
        self.assert_dt(w_0.grad, Shard(0), ref_w.grad)

    def check_layer_pipeline(self):
        """A whole MoE layer on token-sharded DTensors, op by op: route -> permute_indices ->
        permute -> grouped_swiglu -> unpermute, forward and backward, equal to the plain ops.
        The rules imply exactly two all-gathers in the forward (the expert ids and the
        tokens, since the permuted layout is global); the combine writes token-sharded
        outputs without communication."""
        x, wr = _randn(T, D, seed=30), _randn(E, D, seed=31)
        w13, w2 = _randn(E, 2 * F, D, seed=32), _randn(E, D, F, seed=33)
        g = _randn(T, D, seed=34)

        def layer(x, wr, w13, w2, gathered):
            weights, ids, _counts = ops.topk_route(x @ wr.T, K)
            r2s, s2r, offs, _ = ops.permute_indices(ids, E)
            if gathered:  # grouped_swiglu's permutation form (the MoE layer's call)
                y, _h = ops.grouped_swiglu(x, w13, w2, offs, None, None, r2s, s2r)
            else:
                y, _h = ops.grouped_swiglu(ops.permute(x, r2s, s2r), w13, w2, offs)
            return ops.unpermute(y, s2r, r2s, weights)

        for gathered in (False, True):
            leaves = [t.clone().requires_grad_() for t in (x, wr, w13, w2)]
            ref = layer(*leaves, gathered)
            (ref * g).sum().backward()
            placements = (Shard(0), R, R, R)
            d = [self.dt(t, p, grad=True) for t, p in zip((x, wr, w13, w2), placements)]
            out, comm = self.run_op(layer, *d, gathered)
            self.assertEqual(comm.get_comm_counts()[c10d.all_gather_into_tensor], 2)
            self.assertEqual(comm.get_total_counts(), 2)
            self.assert_dt(out, Shard(0), ref)
            (out * self.dt(g, Shard(0))).sum().backward()
            self.assert_dt(d[0].grad, Shard(0), leaves[0].grad)
            for leaf, ref_leaf in zip(d[1:], leaves[1:]):
                self.assertEqual(leaf.grad.full_tensor(), ref_leaf.grad)

    def check_weighted_row_dot(self):
        ids = torch.randint(0, E, (T, K), generator=_gen(9))
        row_to_slot, slot_to_row, *_ = ops.permute_indices(ids, E)
        rows = _randn(row_to_slot.shape[0], D, seed=10)
        tokens = _randn(T, D, seed=11)
        ref = ops.weighted_row_dot(rows, tokens, slot_to_row)
        cases = [
            ((R, R, R), R),
            ((Shard(1), Shard(1), R), P),
            ((R, Shard(0), Shard(0)), Shard(0)),
            ((P, R, R), P),
            ((R, P, R), P),
        ]
        for (p_rows, p_tok, p_map), expected in cases:
            args = (self.dt(rows, p_rows), self.dt(tokens, p_tok), self.dt(slot_to_row, p_map))
            out, comm = self.run_op(ops.weighted_row_dot, *args)
            self.assertEqual(comm.get_total_counts(), 0)
            self.assert_dt(out, expected, ref)

    def check_grouped_mm(self):
        mesh = self.mesh
        M, Kd, N = 9, 6, 4
        x = _randn(M, Kd, seed=12)
        w = _randn(E, Kd, N, seed=13)
        offs = _offs(M, E, seed=14)
        g = _randn(M, N, seed=15)
        d_offs = distribute_tensor(offs, mesh, [R])
        ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref = ops.grouped_mm(ref_x, ref_w, offs)
        (ref * g).sum().backward()

        # (x, w) placements -> output placement, collectives to read the full output
        cases = [
            ((R, R), R, 0),
            ((R, Shard(2)), Shard(1), 1),  # column parallel: all_gather to read
            ((Shard(1), Shard(1)), P, 1),  # row parallel: all_reduce to read
            ((P, R), P, 1),
            ((R, P), P, 1),
        ]
        for (p_x, p_w), p_out, read in cases:
            d_x, d_w = self.dt(x, p_x, grad=True), self.dt(w, p_w, grad=True)
            out, comm = self.run_op(ops.grouped_mm, d_x, d_w, d_offs)
            self.assertEqual(comm.get_total_counts(), 0)
            self.assertEqual(tuple(out.placements), (p_out,))
            with CommDebugMode() as comm:
                full = out.full_tensor()
            self.assertEqual(full, ref)
            self.assertEqual(comm.get_total_counts(), read)
            if p_out == P:
                self.assertEqual(comm.get_comm_counts()[c10d.all_reduce], 1)
            if isinstance(p_x, Partial) or isinstance(p_w, Partial):
                continue  # a Partial leaf has no meaningful per-rank gradient
            # backward: dx is a grouped_mm, dw a grouped_mm_wgrad, under matching strategies
            (out * self.dt(g, p_out if p_out != P else R)).sum().backward()
            self.assertEqual(d_x.grad.full_tensor(), ref_x.grad)
            self.assert_dt(d_w.grad, p_w, ref_w.grad)

        # grouped_mm_wgrad on its own: (x, dy) placements -> dw placement, no communication
        ref = ops.grouped_mm_wgrad(x, g, offs)
        cases = [
            ((R, R), R),
            ((R, Shard(1)), Shard(2)),
            ((Shard(1), R), Shard(1)),
            ((P, R), P),
            ((R, P), P),
        ]
        for (p_x, p_dy), p_out in cases:
            out, comm = self.run_op(ops.grouped_mm_wgrad, self.dt(x, p_x), self.dt(g, p_dy), d_offs)
            self.assertEqual(comm.get_total_counts(), 0)
            self.assert_dt(out, p_out, ref)

    def check_grouped_swiglu(self):
        mesh = self.mesh
        M = 9
        x = _randn(M, D, seed=16)
        w13 = _randn(E, 2 * F, D, seed=17)
        w2 = _randn(E, D, F, seed=18)
        rw = _randn(M, seed=19)
        offs = _offs(M, E, seed=20)
        g = _randn(M, D, seed=21)
        d_offs = distribute_tensor(offs, mesh, [R])
        for row_weights in (None, rw):
            leaves = [t.clone().requires_grad_() for t in (x, w13, w2, rw)]
            ref_rw = None if row_weights is None else leaves[3]
            ref_y, ref_h = ops.grouped_swiglu(*leaves[:3], offs, ref_rw)
            (ref_y * g).sum().backward()
            d = [self.dt(t, R, grad=True) for t in (x, w13, w2, rw)]
            d_rw = None if row_weights is None else d[3]
            (y, h), comm = self.run_op(ops.grouped_swiglu, *d[:3], d_offs, d_rw)
            self.assertEqual(comm.get_total_counts(), 0)
            self.assert_dt(y, R, ref_y)
            self.assert_dt(h, R, ref_h)
            loss = (y * self.dt(g, R)).sum()
            with CommDebugMode() as comm:
                loss.backward()
            self.assertEqual(comm.get_total_counts(), 0)
            for leaf, ref_leaf in zip(d[:3], leaves[:3]):
                self.assert_dt(leaf.grad, R, ref_leaf.grad)
            if row_weights is not None:
                self.assert_dt(d[3].grad, R, leaves[3].grad)

        # a token-sharded (row) x is all-gathered: the groups index global rows
        (y, h), comm = self.run_op(
            ops.grouped_swiglu, self.dt(x, Shard(0)), self.dt(w13, R), self.dt(w2, R), d_offs
        )
        self.assertEqual(comm.get_comm_counts()[c10d.all_gather_into_tensor], 1)
        self.assert_dt(y, R, ops.grouped_swiglu(x, w13, w2, offs)[0])

        # the backward op with Partial incoming gradients: every output Partial, no comms
        h = ops.grouped_swiglu(x, w13, w2, offs, rw)[1]
        g_h = _randn(M, 2 * F, seed=22)
        for grad_h in (None, g_h):
            ref = ops.grouped_swiglu_backward(g, grad_h, x, h, w13, w2, offs, rw)
            d_gh = None if grad_h is None else self.dt(grad_h, P)
            rest = [self.dt(t, R) for t in (x, h, w13, w2)]
            outs, comm = self.run_op(
                ops.grouped_swiglu_backward,
                self.dt(g, P),
                d_gh,
                *rest,
                d_offs,
                self.dt(rw, R),
            )
            self.assertEqual(comm.get_total_counts(), 0)
            for out, expected in zip(outs, ref):
                self.assert_dt(out, P, expected)

    def check_bad_inputs(self):
        """Bad DTensor inputs fail in sharding propagation (the op's fake kernel) with the
        op's own message, before any collective."""
        offs = self.dt(torch.tensor([2, 5], dtype=torch.int32), R)
        x, w = self.dt(_randn(5, 3, seed=0), R), self.dt(_randn(2, 4, 6, seed=1), Shard(2))
        logits = self.dt(_randn(T, E, seed=2), Shard(0))
        ids = self.dt(torch.zeros(T, K, dtype=torch.int64), R)
        cases = [
            (ops.grouped_mm, (x, w, offs), r"grouped_mm: x is \[M, K=3\] but w is \[E, K=4, N=6\]"),
            (
                ops.topk_route,
                (logits, E + 1),
                rf"topk_route: k \({E + 1}\) must be in \[1, num_experts={E}\]",
            ),
            (ops.permute_indices, (ids, E, 0), r"permute_indices: align must be >= 1, got 0"),
        ]
        for fn, args, msg in cases:
            with CommDebugMode() as comm, self.assertRaisesRegex(RuntimeError, msg):
                fn(*args)
            self.assertEqual(comm.get_total_counts(), 0)


if __name__ == "__main__":
    run_tests()
