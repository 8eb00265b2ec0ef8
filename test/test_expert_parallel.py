# Owner(s): ["module: moe"]
"""Tests for expert parallelism (torch_moe.distributed.ExpertParallel) on gloo.

Every equality test builds the full MoE with one seed on every rank, keeps an
unparallelized copy as the reference, runs all ranks' tokens through the copy in one
process and compares each rank's outputs and gradients with its share.
"""

import contextlib
import copy
import datetime
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import TestCase, run_tests

from torch_moe.distributed import ExpertParallel
from torch_moe.nn import MoE

DIM, HIDDEN = 16, 32
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def make_moe(seed=0, **kwargs):
    torch.manual_seed(seed)
    cfg = dict(dim=DIM, hidden_dim=HIDDEN, num_experts=8, top_k=2)
    cfg.update(kwargs)
    return MoE(**cfg)


class EPTestBase(MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def init_pg(self, timeout=None):
        kwargs = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(self.file_name, self.world_size),
            rank=self.rank,
            world_size=self.world_size,
            **kwargs,
        )
        return init_device_mesh("cpu", (self.world_size,))

    def check_matches_single_process(self, mesh, tokens_per_rank, setup=None, style=None, **cfg):
        """Each rank's output and input gradient, its expert-weight gradient shard and the
        router/shared gradients summed over ranks equal one process on all tokens."""
        R, r = self.world_size, self.rank
        moe = make_moe(**cfg)
        if setup is not None:
            setup(moe)
        ref = copy.deepcopy(moe)
        parallelize_module(moe, mesh, ExpertParallel() if style is None else style)

        gen = torch.Generator().manual_seed(1)
        x_all = torch.randn(sum(tokens_per_rank), DIM, generator=gen)
        g_all = torch.randn(sum(tokens_per_rank), DIM, generator=gen)
        start = sum(tokens_per_rank[:r])
        rows = slice(start, start + tokens_per_rank[r])

        x_ref = x_all.clone().requires_grad_()
        out_ref = ref(x_ref)
        (out_ref * g_all).sum().backward()

        x = x_all[rows].clone().requires_grad_()
        with CommDebugMode() as fwd_comm:
            out = moe(x)
        with CommDebugMode() as bwd_comm:
            (out * g_all[rows]).sum().backward()
        a2a = torch.ops.c10d.alltoall_base_
        if style is None or style.exchange == "p2p":
            # forward: the counts all-to-all; the rows move point-to-point (CommDebugMode
            # does not see send/recv), see test_exchange.py for their messages
            self.assertEqual(fwd_comm.get_comm_counts(), {a2a: 1})
            self.assertEqual(bwd_comm.get_comm_counts(), {})
        elif style.node_size is None:
            # forward: the counts, then per chunk the rows, their routing weights and the
            # combine; backward: the reverse of the last three per chunk; nothing else
            C = style.num_chunks
            self.assertEqual(fwd_comm.get_comm_counts(), {a2a: 1 + 3 * C})
            self.assertEqual(bwd_comm.get_comm_counts(), {a2a: 3 * C})

        self.assertEqual(out, out_ref[rows])
        self.assertEqual(x.grad, x_ref.grad[rows])
        El = moe.num_experts // R
        for name in ("w13", "w2"):
            p = getattr(moe.experts, name)
            self.assertIsInstance(p, DTensor)
            self.assertEqual(p.placements, (Shard(0),))
            self.assertIsInstance(p.grad, DTensor)
            self.assertEqual(p.grad.placements, (Shard(0),))
            shard = slice(r * El, (r + 1) * El)
            self.assertEqual(p.to_local(), getattr(ref.experts, name)[shard])
            self.assertEqual(p.grad.to_local(), getattr(ref.experts, name).grad[shard])
        # replicated parameters: plain tensors; their gradients are per-rank partial sums
        for name, p in moe.named_parameters():
            if name.startswith("experts."):
                continue
            self.assertNotIsInstance(p, DTensor)
            grad = p.grad.clone()
            dist.all_reduce(grad)
            self.assertEqual(grad, ref.get_parameter(name).grad, msg=name)
        # load statistics are local: the all-reduced counts are the global ones
        counts = moe.tokens_per_expert.clone()
        dist.all_reduce(counts)
        self.assertEqual(counts, ref.tokens_per_expert)
        return moe, ref


def force_onto_last_rank(world_size):
    def setup(moe):
        # every token picks among the experts of the last rank (the bias only selects)
        El = moe.num_experts // world_size
        moe.router.expert_bias[-El:] = 10.0

    return setup


def deepseek_setup(moe):
    torch.manual_seed(5)
    moe.router.expert_bias.copy_(torch.randn(moe.num_experts) * 0.1)


DEEPSEEK = dict(
    score_func="sigmoid",
    num_expert_groups=4,
    num_limited_groups=2,
    route_norm=True,
    route_scale=2.5,
    expert_bias=True,
    shared_hidden_dim=24,
)


class TestExpertParallel2(EPTestBase):
    @property
    def world_size(self):
        return 2

    def test_matches_single_process_and_faults(self):
        # a short timeout: the last check makes one rank skip a collective
        mesh = self.init_pg(timeout=datetime.timedelta(seconds=3))
        # uneven token counts
        self.check_matches_single_process(mesh, [7, 12])
        # a rank with zero tokens
        self.check_matches_single_process(mesh, [0, 9])
        self.check_matches_single_process(mesh, [9, 0], shared_hidden_dim=8, shared_gate=True)
        # all tokens routed to the last rank's experts
        moe, _ = self.check_matches_single_process(
            mesh, [6, 10], setup=force_onto_last_rank(2), expert_bias=True
        )
        self.assertEqual(int(moe.tokens_per_expert[:4].sum()), 0)
        # DeepSeek-V3 style: sigmoid, groups, expert bias, shared expert; update_expert_bias
        # sums the local loads over the ranks, so it equals the single-process update
        moe, ref = self.check_matches_single_process(
            mesh, [5, 11], setup=deepseek_setup, **DEEPSEEK
        )
        moe.update_expert_bias(0.01)
        ref.update_expert_bias(0.01, group=dist.new_group([self.rank]))
        self.assertEqual(moe.router.expert_bias, ref.router.expert_bias)

        # chunked dispatch/combine with the shared experts overlapping the first dispatch,
        # with either exchange
        for exchange in ("p2p", "all_to_all"):
            moe, _ = self.check_matches_single_process(
                mesh,
                [9, 4],
                style=ExpertParallel(num_chunks=2, exchange=exchange),
                shared_hidden_dim=8,
            )
            self.assertEqual(moe.experts.forward.shared.num_overlapped, 1)
            style = ExpertParallel(num_chunks=4, exchange=exchange)
            self.check_matches_single_process(
                mesh, [0, 7], setup=deepseek_setup, style=style, **DEEPSEEK
            )
        self.check_matches_single_process(mesh, [7, 3], style=ExpertParallel(exchange="all_to_all"))

        self.check_fp8_dispatch(mesh)
        self.check_local_losses_and_dtypes(mesh)
        # last: the faults (the timeout leaves the process group unusable)
        self.check_faults(mesh)

    def check_fp8_dispatch(self, mesh):
        """FP8 dispatch (1x128 blocks) against plain EP: close (SQNR), not equal."""
        base = make_moe(shared_hidden_dim=8)
        torch.manual_seed(20 + self.rank)
        x = torch.randn(12, DIM)
        results = []
        fp8 = torch.float8_e4m3fn
        for style in (
            ExpertParallel(),
            ExpertParallel(dispatch_dtype=fp8),
            ExpertParallel(dispatch_dtype=fp8, exchange="all_to_all", num_chunks=2),
        ):
            moe = copy.deepcopy(base)
            parallelize_module(moe, mesh, style)
            xg = x.clone().requires_grad_()
            out = moe(xg)
            (out * x).sum().backward()
            results.append((out, xg.grad, moe.experts.w13.grad.to_local()))
        for plain, fp8, fp8_a2a in zip(*results, strict=True):
            self.assertEqual(fp8_a2a, fp8)  # per-row blocks: the exchange does not matter
            self.assertNotEqual(plain, fp8)
            sqnr = 10 * torch.log10(plain.pow(2).sum() / (plain - fp8).pow(2).sum())
            self.assertGreater(sqnr.item(), 25.0)

    def check_local_losses_and_dtypes(self, mesh):
        # aux and z losses are computed on this rank's tokens (local, as under DP)
        moe = make_moe(aux_loss="switch", aux_loss_coeff=0.01, z_loss_coeff=0.001)
        local = copy.deepcopy(moe)
        parallelize_module(moe, mesh, ExpertParallel())
        torch.manual_seed(10 + self.rank)
        x = torch.randn(2, 5 + self.rank, DIM)  # a [B, S, D] input
        out = moe(x)
        out_local = local(x)  # the unparallelized layer on this rank's tokens only
        self.assertEqual(out, out_local)
        self.assertEqual(moe.last_losses, local.last_losses)
        # bf16 parameters: same result as the unparallelized layer on this rank's tokens
        moe16 = make_moe(dtype=torch.bfloat16)
        local16 = copy.deepcopy(moe16)
        parallelize_module(moe16, mesh, ExpertParallel())
        self.assertEqual(moe16(x.bfloat16()), local16(x.bfloat16()))
        # fp32 parameters under bf16 autocast (rows sent in bf16), chunked: the same too
        moe32 = make_moe(shared_hidden_dim=8)
        local32 = copy.deepcopy(moe32)
        parallelize_module(moe32, mesh, ExpertParallel(num_chunks=2))
        xg, xg_local = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, out_local = moe32(xg), local32(xg_local)
        self.assertEqual(out.dtype, torch.bfloat16)
        self.assertEqual(out, out_local)
        out.float().pow(2).sum().backward()
        out_local.float().pow(2).sum().backward()
        self.assertEqual(xg.grad, xg_local.grad)

    def check_faults(self, mesh):
        # num_experts not divisible by the EP degree: an error before any collective
        with CommDebugMode() as comm:
            with self.assertRaisesRegex(
                ValueError, r"num_experts \(3\) must be divisible by the expert-parallel degree"
            ):
                parallelize_module(make_moe(num_experts=3, top_k=1), mesh, ExpertParallel())
        self.assertEqual(comm.get_total_counts(), 0)
        with self.assertRaisesRegex(NotImplementedError, "capacity_factor=1.5"):
            parallelize_module(make_moe(capacity_factor=1.5), mesh, ExpertParallel())
        with self.assertRaisesRegex(ValueError, "1-D device mesh"):
            mesh2 = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep"))
            parallelize_module(make_moe(), mesh2, ExpertParallel())
        # ranks built with different configs: every rank raises, naming rank 1 and the fields
        bad = make_moe(top_k=2 + self.rank, shared_hidden_dim=8 * self.rank)
        with self.assertRaisesRegex(
            ValueError,
            r"config differs .* rank 1: shared_hidden_dim=8 \(rank 0: 0\), top_k=3 \(rank 0: 2\)",
        ):
            parallelize_module(bad, mesh, ExpertParallel())
        # options: bad values at construction, bad fits at parallelize time (no collective)
        with self.assertRaisesRegex(ValueError, "num_chunks must be a positive int, got 0"):
            ExpertParallel(num_chunks=0)
        with self.assertRaisesRegex(ValueError, "dispatch_dtype must be None or .*float16"):
            ExpertParallel(dispatch_dtype=torch.float16)
        with self.assertRaisesRegex(ValueError, "node_size must be None or a positive int"):
            ExpertParallel(node_size=0)
        with self.assertRaisesRegex(ValueError, "exchange must be None, 'p2p' or 'all_to_all'"):
            ExpertParallel(exchange="nccl")
        with self.assertRaisesRegex(ValueError, "node_size=2 needs exchange='all_to_all'"):
            ExpertParallel(node_size=2, exchange="p2p")
        # ranks built with different styles: they would expect different messages
        style = ExpertParallel(exchange="all_to_all" if self.rank else "p2p")
        with self.assertRaisesRegex(
            ValueError, r"rank 1: ExpertParallel.exchange='all_to_all' \(rank 0: 'p2p'\)"
        ):
            parallelize_module(make_moe(), mesh, style)
        with CommDebugMode() as comm:
            with self.assertRaisesRegex(ValueError, r"num_chunks \(5\) must be at most .* = 4"):
                parallelize_module(make_moe(), mesh, ExpertParallel(num_chunks=5))
            with self.assertRaisesRegex(ValueError, r"node_size \(3\) must divide .* \(2\)"):
                parallelize_module(make_moe(), mesh, ExpertParallel(node_size=3))
        self.assertEqual(comm.get_total_counts(), 0)
        moe = make_moe()
        parallelize_module(moe, mesh, ExpertParallel())
        with self.assertRaisesRegex(ValueError, "already parallelized"):
            parallelize_module(moe, mesh, ExpertParallel())
        # a collective that times out: rank 1 skips the forward. Rank 0 sees the 3 s timeout
        # (torch 2.13 here) or, where the backend waits longer, rank 1 leaving (torch 2.11)
        if self.rank == 0:
            with self.assertRaisesRegex(
                RuntimeError,
                r"ExpertParallel: counts all_to_all_single failed on rank 0 "
                r"\(expert-parallel rank 0 of 2.*(Timed out|Connection closed)",
            ):
                moe(torch.randn(4, DIM))
        else:
            time.sleep(6)


class TestExpertParallel4(EPTestBase):
    @property
    def world_size(self):
        return 4

    def test_matches_single_process(self):
        mesh = self.init_pg()
        self.check_matches_single_process(mesh, [3, 0, 8, 5])
        self.check_matches_single_process(
            mesh, [4, 7, 0, 2], setup=force_onto_last_rank(4), expert_bias=True
        )
        self.check_matches_single_process(mesh, [6, 1, 3, 0], setup=deepseek_setup, **DEEPSEEK)
        # hierarchical all-to-all over 2 nodes of 2 ranks, plain and chunked
        self.check_matches_single_process(mesh, [5, 2, 0, 9], style=ExpertParallel(node_size=2))
        moe, _ = self.check_matches_single_process(
            mesh,
            [3, 8, 4, 1],
            style=ExpertParallel(num_chunks=2, node_size=2),
            shared_hidden_dim=8,
        )
        self.assertEqual(moe.experts.forward.shared.num_overlapped, 1)
        dist.destroy_process_group()


@unittest.skipIf(not torch.cuda.is_available(), "needs CUDA")
class TestExpertParallelCUDA(TestCase):
    def test_nccl_ep1_matches_layer_cuda(self):
        """One GPU, NCCL, EP=1: every exchange runs its CUDA code path (the segments are
        local copies, the counts go through NCCL) and equals the unparallelized layer."""
        with tempfile.TemporaryDirectory() as tmp:
            store = dist.FileStore(os.path.join(tmp, "store"), 1)
            dist.init_process_group("nccl", store=store, rank=0, world_size=1)
            try:
                mesh = init_device_mesh("cuda", (1,))
                fp8 = torch.float8_e4m3fn
                styles = [
                    ExpertParallel(),
                    ExpertParallel(num_chunks=2),
                    ExpertParallel(exchange="all_to_all", num_chunks=2),
                    ExpertParallel(dispatch_dtype=fp8),
                ]
                for style in styles:
                    moe = make_moe(shared_hidden_dim=8).cuda()
                    ref = copy.deepcopy(moe)
                    parallelize_module(moe, mesh, style)
                    x = torch.randn(37, DIM, device="cuda")
                    xs = [x.clone().requires_grad_() for _ in range(2)]
                    out, out_ref = moe(xs[0]), ref(xs[1])
                    (out * x).sum().backward()
                    (out_ref * x).sum().backward()
                    pairs = [
                        (out, out_ref),
                        (xs[0].grad, xs[1].grad),
                        (moe.experts.w13.grad.to_local(), ref.experts.w13.grad),
                    ]
                    for got, want in pairs:
                        if style.dispatch_dtype is None:  # GPU kernels: not bitwise
                            self.assertEqual(got, want, atol=1e-5, rtol=1e-4)
                        else:  # FP8 dispatch: close, as on gloo
                            err = (got - want).double().pow(2).sum()
                            sqnr = 10 * torch.log10(want.double().pow(2).sum() / err)
                            self.assertGreater(sqnr.item(), 25.0)
            finally:
                dist.destroy_process_group()


class TestTrainExampleEP(TestCase):
    def test_torchrun_ep2_matches_ep1(self):
        """``torchrun --nproc-per-node 2 train_moe_lm.py --ep 2`` gives the loss curve of the
        in-process --ep 1 run on the same global batch; its DCP checkpoint (expert shards)
        loads in one process with the --ep 1 run's weights and resumes at --ep 1."""
        sys.path.insert(0, str(EXAMPLES))
        import train_moe_lm

        tiny = [
            "--dim", "32", "--layers", "2", "--heads", "2", "--hidden-dim", "32",
            "--experts", "4", "--top-k", "2", "--seq-len", "16", "--batch-size", "4",
            "--corpus-bytes", "20000", "--eval-batches", "1", "--sample-bytes", "4",
            "--warmup", "2", "--no-progress", "--threads", "1", "--steps", "4",
            "--ckpt-every", "2", "--balance", "bias", "--bias-rate", "0.01", "--device", "cpu",
        ]  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
            env["OMP_NUM_THREADS"] = "1"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
            cmd += [str(EXAMPLES / "train_moe_lm.py"), *tiny, "--ep", "2", "--out", f"{tmp}/ep2"]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
            self.assertEqual(proc.returncode, 0, msg=proc.stdout[-2000:] + proc.stderr[-3000:])
            with contextlib.redirect_stdout(io.StringIO()):
                r1 = train_moe_lm.main([*tiny, "--ep", "1", "--out", f"{tmp}/ep1"])
            self.assertIn(f"val loss {r1['val_loss']:.3f}", proc.stdout)
            m1, _ = train_moe_lm.load_model(f"{tmp}/ep1")
            m2, run2 = train_moe_lm.load_model(f"{tmp}/ep2")
            self.assertEqual(run2["ep"], 2)
            self.assertEqual(m2.state_dict(), m1.state_dict(), atol=1e-5, rtol=1e-4)
            # the --ep 2 checkpoint (expert shards and their optimizer state) resumes at --ep 1
            for name in ("ep1", "ep2"):
                with contextlib.redirect_stdout(io.StringIO()):
                    resume = ["--steps", "6", "--ep", "1", "--resume", "--out", f"{tmp}/{name}"]
                    train_moe_lm.main([*tiny, *resume])
            curves = {}
            for name in ("ep1", "ep2"):
                with open(f"{tmp}/{name}/metrics.jsonl") as f:
                    curves[name] = [json.loads(line) for line in f]
            self.assertEqual([r["step"] for r in curves["ep2"]], [1, 2, 3, 4, 5, 6])
            for a, b in zip(curves["ep1"], curves["ep2"], strict=True):
                self.assertEqual(a["loss"], b["loss"], atol=1e-5, rtol=1e-5)
                self.assertEqual(a["tokens_per_expert"], b["tokens_per_expert"])


if __name__ == "__main__":
    run_tests()
