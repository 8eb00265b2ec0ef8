# Owner(s): ["module: moe"]
"""Expert parallelism composed with FSDP2 and DCP (gloo, 4 ranks).

(a) A 2-D mesh ("dp", "ep") = (2, 2): ``ExpertParallel`` shards the experts over "ep";
FSDP2 shards the expert weights over "dp" (the expert-data-parallel dim: the ranks that
hold the same experts) and the dense weights over all four ranks (every rank is a
data-parallel rank with its own tokens, the EP ranks included). The gradients equal one
process running the global batch.

Loss scaling: every rank holds T tokens and minimizes the mean of its own tokens'
losses; FSDP averages the dense gradients over the 4 ranks, and the expert gradients
(already summed over the 2 EP ranks' tokens by the combine all-to-all) are divided by
4 as well (``set_gradient_divide_factor(4)``: the data-parallel degree, not the size of
their FSDP mesh, which would give 2). So every gradient is the gradient of the mean
loss over the 4T tokens of the global batch, the single-process reference.

(b) DCP: a state dict with DTensor expert weights saved at EP=2 loads bitwise equal at
EP=1 (plain tensors, ``no_dist=True``) and at EP=4, and a forward there gives the
outputs of the original model.
"""

import contextlib
import copy
import json

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import worker_context
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorTestBase,
    with_comms,
)
from torch.testing._internal.distributed.checkpoint_utils import with_temp_dir

from torch_moe.distributed import ExpertParallel
from torch_moe.nn import MoE

# D model dim, F expert hidden dim, E experts, K top-k, T tokens per rank
D, F, E, K, T = 8, 12, 8, 2, 6
EXPERT_KEYS = ("moe.experts.w13", "moe.experts.w2")


class Net(nn.Module):
    """Dense in, MoE (router + 8 experts + a shared expert), dense out."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(D, D)
        self.moe = MoE(D, F, E, K, shared_hidden_dim=4)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        return self.out(self.moe(self.inp(x)))


def _batch(num_ranks, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_ranks * T, D, generator=gen), torch.randn(
        num_ranks * T, D, generator=gen
    )


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


class TestEPCompose(DTensorTestBase):
    @property
    def world_size(self):
        return 4

    def _spawn_processes(self):
        self._start_processes(worker_context().Process)

    @with_comms
    @with_temp_dir
    def test_fsdp2_2d_and_dcp_resharding(self):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        self.check_fsdp2_2d(mesh)
        self.check_fsdp2_refuses_what_it_cannot_gather(mesh)
        self.check_dcp_resharding(mesh)

    def check_fsdp2_refuses_what_it_cannot_gather(self, mesh):
        # chunks' weights split before the experts' forward, and the low-latency exchange's
        # forward_tokens: FSDP2 gathers nothing there, and the shard's shapes failed
        # further in ("split_weights: chunks must ... cover the 1 local experts")
        x = _batch(self.world_size)[0][:T]
        for style, what in (
            (ExpertParallel(num_chunks=2), "num_chunks=2"),
            (ExpertParallel(mode="low_latency", max_tokens_per_rank=T), "mode='low_latency'"),
        ):
            net = Net(seed=0)
            parallelize_module(net.moe, mesh["ep"], style)
            fully_shard(net.moe.experts, mesh=mesh["dp"])
            if what != "num_chunks=2":
                net.eval()
            with (
                self.subTest(what),
                torch.inference_mode(what != "num_chunks=2"),
                self.assertRaisesRegex(
                    NotImplementedError,
                    rf"MoE: ExpertParallel\({what}\) with fully_shard on the experts",
                ),
            ):
                net(x)

    def check_fsdp2_2d(self, mesh):
        ref = Net(seed=0)
        net = copy.deepcopy(ref)
        parallelize_module(net.moe, mesh["ep"], ExpertParallel())
        fully_shard(net.moe.experts, mesh=mesh["dp"])
        net.moe.experts.set_gradient_divide_factor(self.world_size)
        fully_shard(net, mesh=mesh._flatten("dp_ep"))
        # gloo has no PREMUL_SUM (the custom divide factor's reduce op): reduce with SUM and
        # divide after (the same averages)
        for module in (net, net.moe.experts):
            module.set_force_sum_reduction_for_comms(True)
        for key in EXPERT_KEYS:
            p = net.get_parameter(key)
            self.assertEqual(p.device_mesh.mesh_dim_names, ("dp", "ep"))
            # FSDP shards the EP shard's dim 0 again: a strided shard of dim 0 over "dp"
            self.assertEqual(p.placements[1], Shard(0))
            self.assertEqual(p.placements[0].dim, 0)

        x_all, g_all = _batch(self.world_size)
        rows = slice(self.rank * T, (self.rank + 1) * T)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(2):  # the second step runs on the updated, resharded weights
            x = x_all[rows].clone().requires_grad_()
            out = net(x)
            ((out * g_all[rows]).sum() / T).backward()
            x_ref = x_all.clone().requires_grad_()
            out_ref = ref(x_ref)
            ((out_ref * g_all).sum() / (self.world_size * T)).backward()

            self.assertEqual(out, out_ref[rows], msg=f"step {step}")
            # the input gradient is this rank's own: 4x its share of the global mean
            self.assertEqual(x.grad, self.world_size * x_ref.grad[rows])
            for name, p in net.named_parameters():
                ref_p = ref.get_parameter(name)
                self.assertIsInstance(p.grad, DTensor, msg=name)
                self.assertEqual(p.grad.placements, p.placements, msg=name)
                self.assertEqual(p.grad.full_tensor(), ref_p.grad, msg=f"{name} step {step}")
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        for name, p in net.named_parameters():
            self.assertEqual(p.full_tensor(), ref.get_parameter(name), msg=name)

    def check_dcp_resharding(self, mesh):
        ref = Net(seed=2)
        x_all, _ = _batch(self.world_size, seed=3)
        with torch.no_grad():
            out_ref = ref(x_all)
        ref_sd = {k: v.clone() for k, v in ref.state_dict().items()}

        # save at EP=2: the expert weights are DTensors Shard(0) over a 2-rank "ep" mesh
        # (replicated over "dp": DCP writes each shard once)
        net2 = copy.deepcopy(ref)
        parallelize_module(net2.moe, mesh["ep"], ExpertParallel())
        sd2 = net2.state_dict()
        for key in EXPERT_KEYS:
            self.assertIsInstance(sd2[key], DTensor)
            self.assertEqual(sd2[key].placements, (Shard(0),))
            self.assertEqual(sd2[key].device_mesh.size(), 2)
        dcp.save(sd2, checkpoint_id=self.temp_dir)
        dist.barrier()

        # load at EP=4 into a differently initialized model: bitwise equal, same outputs
        net4 = Net(seed=4)
        mesh4 = init_device_mesh("cpu", (self.world_size,))
        parallelize_module(net4.moe, mesh4, ExpertParallel(), src_data_rank=None)
        sd4 = net4.state_dict()
        self.assertFalse(torch.equal(sd4["moe.experts.w2"].full_tensor(), ref_sd["moe.experts.w2"]))
        dcp.load(sd4, checkpoint_id=self.temp_dir)
        net4.load_state_dict(sd4)
        for key, expected in ref_sd.items():
            got = net4.state_dict()[key]
            if key in EXPERT_KEYS:
                self.assertEqual(got.placements, (Shard(0),))
                self.assertEqual(got.to_local().shape[0], E // self.world_size)
            self.assertTrue(torch.equal(_full(got), expected), msg=key)
        rows = slice(self.rank * T, (self.rank + 1) * T)
        with torch.no_grad():
            self.assertEqual(net4(x_all[rows]), out_ref[rows])

        # load at EP=1: plain tensors, one process, no collectives
        net1 = Net(seed=5)
        sd1 = net1.state_dict()
        dcp.load(sd1, checkpoint_id=self.temp_dir, no_dist=True)
        # with_temp_dir removes the directory on every rank as it leaves: nobody may leave
        # before all ranks have read it (a rank that did failed another's read in CI)
        dist.barrier()
        net1.load_state_dict(sd1)
        for key, expected in ref_sd.items():
            got = net1.state_dict()[key]
            self.assertNotIsInstance(got, DTensor)
            self.assertTrue(torch.equal(got, expected), msg=key)
        with torch.no_grad():
            self.assertTrue(torch.equal(net1(x_all), out_ref))


class TestCheckpointEP(DTensorTestBase):
    """The training example's checkpoint at EP=2: a failure of rank 0's own writes (after
    every rank's DCP shards) raises on every rank and keeps the previous checkpoint."""

    @property
    def world_size(self):
        return 2

    def _spawn_processes(self):
        self._start_processes(worker_context().Process)

    @with_comms
    @with_temp_dir
    def test_rank0_failure_raises_everywhere(self):
        import sys
        from pathlib import Path
        from unittest import mock

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        import train_moe_lm

        mesh = init_device_mesh("cpu", (self.world_size,))
        torch.manual_seed(0)
        moe = MoE(D, F, E, K)
        parallelize_module(moe, mesh, ExpertParallel())
        opt = torch.optim.SGD(moe.parameters(), lr=0.1)
        out = Path(self.temp_dir)
        first = train_moe_lm.save_checkpoint(out, moe, opt, {"step": 1}, {"run": 1})

        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")

        # (rank 0 alone writes config.json; a rank that returned while it raised went on to
        # the next step's collectives against rank 0's error handling)
        with (
            mock.patch.object(train_moe_lm.json, "dump", full_disk)
            if self.rank == 0
            else (contextlib.nullcontext())
        ):
            with self.assertRaisesRegex(
                OSError if self.rank == 0 else RuntimeError,
                "No space left on device"
                if self.rank == 0
                else r"the save failed on another rank \(rank 0: OSError\(28",
            ):
                train_moe_lm.save_checkpoint(out, moe, opt, {"step": 2}, {"run": 2})
        dist.barrier()
        names = sorted(p.name for p in out.iterdir() if "checkpoint" in p.name)
        self.assertEqual(names, ["checkpoint"])
        self.assertEqual(json.loads((first / "config.json").read_text()), {"run": 1})
        dist.barrier()  # (with_temp_dir removes the directory as each rank leaves)


if __name__ == "__main__":
    run_tests()
