"""torch.compile of the MoE layer end to end: fullgraph for every precision, under autocast,
with activation checkpointing and the aux losses; bounded recompiles; compiled == eager.

The protocol of every test: >= 20 training steps (fewer for the variants) with fresh
inputs (so the routing changes) over four token counts, compiled with
``fullgraph=True`` and the ``aot_eager`` backend (the same kernels as eager, so outputs,
input gradients, parameter gradients and the load statistics must be bitwise equal),
counting compiled frames: one recompile (the first new token count makes the token dim
dynamic; or none where a test marks it dynamic up front) and no graph break. No dynamo config is set.
``TestMoECompileDevice`` repeats the fullgraph test on CUDA (bf16 parameters, dims of 128:
the FP8 kernels' blocks), where the recipes run the Triton kernels; ``.ci/gpu`` runs it.
"""

from __future__ import annotations

import copy

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)
from torch.utils.checkpoint import checkpoint

from torch_moe.nn import MoE
from torch_moe.quantization import RECIPES

TOKENS = (16, 24, 40, 9)  # four token counts, cycled
D = F = 32  # multiples of 32 (MX blocks) in every GEMM
EXACT = dict(atol=0, rtol=0)


def _layer(precision, dim=D, **kw):
    torch.manual_seed(0)
    moe = MoE(
        dim,
        dim,
        4,
        2,
        precision=precision,
        shared_hidden_dim=16,
        aux_loss="switch",
        aux_loss_coeff=0.01,
        z_loss_coeff=1e-3,
        **kw,
    )
    return moe.train()


def _step(fn, module, x, grad_out, autocast, dynamic=False):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    if dynamic:  # one compile instead of two: the variants test the layer, not guards
        torch._dynamo.mark_dynamic(x, 0)
    with torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
        out = fn(x)
    out.backward(grad_out.to(out.dtype))
    grads = {n: p.grad for n, p in module.named_parameters()}
    return out.detach(), x.grad, grads


class _CompileChecks(TestCase):
    def _check(
        self,
        precision,
        *,
        steps=20,
        autocast=False,
        ckpt=False,
        dynamic=False,
        device="cpu",
        dim=D,
        dtype=None,
        **kw,
    ):
        torch._dynamo.reset()
        counters.clear()
        eager = _layer(precision, dim, device=device, dtype=dtype, **kw)
        moe = copy.deepcopy(eager)
        backend = CompileCounterWithBackend("aot_eager")

        def run(m):
            return (lambda x: checkpoint(m, x, use_reentrant=False)) if ckpt else m

        compiled = torch.compile(run(moe), fullgraph=True, backend=backend)
        gen = torch.Generator().manual_seed(1)
        for step in range(steps):
            num_tokens = TOKENS[step % len(TOKENS)]
            x = torch.randn(num_tokens, dim, generator=gen).to(device, dtype)
            grad_out = torch.randn(num_tokens, dim, generator=gen).to(device, dtype)
            ref = _step(run(eager), eager, x, grad_out, autocast)
            got = _step(compiled, moe, x, grad_out, autocast, dynamic)
            self.assertEqual(got[0], ref[0], **EXACT, msg=f"step {step}: output")
            self.assertEqual(got[1], ref[1], **EXACT, msg=f"step {step}: input grad")
            for name in ref[2]:
                self.assertEqual(got[2][name], ref[2][name], **EXACT, msg=f"step {step}: {name}")
        self.assertEqual(moe.tokens_per_expert, eager.tokens_per_expert)
        self.assertEqual(moe.last_losses, eager.last_losses, **EXACT)
        self.assertEqual(dict(counters["graph_break"]), {})
        self.assertLessEqual(backend.frame_count, 1 if dynamic else 2, msg="recompiles")


class TestMoECompile(_CompileChecks):
    @parametrize("precision", ["bf16", *RECIPES])
    def test_fullgraph(self, precision):
        # bf16 takes Dynamo's default path (a static frame, then one dynamic recompile at the
        # first new token count); the recipes mark the token dim dynamic up front (one frame,
        # no recompile: the same check of no size specialization at half the compile time)
        self._check(precision, expert_bias=True, dynamic=precision != "bf16")

    @parametrize("precision", ["bf16", "fp8_rowwise"])
    def test_fullgraph_autocast(self, precision):
        self._check(precision, steps=8, autocast=True, dynamic=True)

    @parametrize("half_gemm", ["fp32", "native"])
    def test_fullgraph_autocast_both_cpu_gemm_dtypes(self, half_gemm):
        # bf16 GEMMs upcast to fp32 (CPUs without native bf16) or native: the CPU kernels
        # must not be recast by autocast in eager, where compiled code runs them outside it
        from torch_moe._ops import _cpu_probe

        with _cpu_probe.force(half_gemm=half_gemm):
            self._check("bf16", steps=2, autocast=True, dynamic=True)

    @parametrize("half_gemm", ["fp32", "native"])
    def test_fullgraph_bf16_parameters_both_cpu_gemm_dtypes(self, half_gemm):
        # bf16 parameters: the shared expert's GEMMs by the grouped GEMM op where the CPU
        # upcasts (a decision the compiler takes as a constant), F.linear where it does not
        from torch_moe._ops import _cpu_probe

        with _cpu_probe.force(half_gemm=half_gemm):
            self._check("bf16", steps=2, dynamic=True, dtype=torch.bfloat16)

    @parametrize("precision", ["bf16", "mxfp8"])
    def test_fullgraph_activation_checkpointing(self, precision):
        self._check(precision, steps=8, ckpt=True, dynamic=True)

    def test_checkpoint_of_a_compiled_layer_counts_once(self):
        # checkpointing outside the compiled layer reruns the compiled graph to recompute
        # (the other way round, inside, the graph has the recomputation): the load counts
        # must not be added again there, as in eager, where the layer's counting op asks
        # the autograd engine at run time
        torch._dynamo.reset()
        eager = _layer("bf16", capacity_factor=0.5)
        moe = copy.deepcopy(eager)
        compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
        gen = torch.Generator().manual_seed(4)
        for _ in range(2):
            x = torch.randn(10, D, generator=gen)
            ref = checkpoint(eager, x.detach().clone().requires_grad_(), use_reentrant=False)
            got = checkpoint(compiled, x.detach().clone().requires_grad_(), use_reentrant=False)
            ref.sum().backward()
            got.sum().backward()
            self.assertEqual(got, ref, **EXACT)
        self.assertEqual(int(eager.tokens_per_expert.sum()), 2 * 10 * 2)
        self.assertEqual(moe.tokens_per_expert, eager.tokens_per_expert)
        self.assertGreater(int(eager.dropped_assignments), 0)
        self.assertEqual(moe.dropped_assignments, eager.dropped_assignments)

    def test_fullgraph_capacity_and_group_limited_routing(self):
        self._check(
            "fp8_blockwise",
            steps=8,
            dynamic=True,
            capacity_factor=0.75,
            score_func="sigmoid",
            num_expert_groups=2,
            num_limited_groups=1,
            route_norm=True,
        )


class TestMoECompileDevice(_CompileChecks):
    """Device-generic (instantiate_device_type_tests): .ci/gpu runs it on cuda; on the CPU
    ``TestMoECompile`` covers the same and more."""

    @onlyCUDA
    @parametrize("precision", ["bf16", *RECIPES])
    def test_fullgraph(self, device, precision):
        self._check(
            precision, steps=8, dynamic=True, device=device, dim=128, dtype=torch.bfloat16,
            expert_bias=True,
        )  # fmt: skip


instantiate_parametrized_tests(TestMoECompile)
instantiate_device_type_tests(TestMoECompileDevice, globals())

if __name__ == "__main__":
    run_tests()
