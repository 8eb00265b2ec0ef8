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
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import naive
import torch
import torch.distributed as dist
from dist_utils import (
    GLOO_EXIT_ABORT,
    GlooContinuousTest,
    finish_launch,
    run_launch,
    start_launch,
    worker_context,
)
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing import FileCheck
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.utils._python_dispatch import TorchDispatchMode

import torch_moe._inductor as TI
from torch_moe._inductor import ep_chunk, ep_overlap
from torch_moe._ops import _cpu_probe
from torch_moe.distributed import ExpertParallel, ExpertParallelDispatcher
from torch_moe.distributed import dispatch as dispatch_module
from torch_moe.nn import MoE

DIM, HIDDEN = 16, 32
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


GPT_OSS = naive.GPT_OSS


def make_moe(seed=0, **kwargs):
    torch.manual_seed(seed)
    cfg = dict(dim=DIM, hidden_dim=HIDDEN, num_experts=8, top_k=2)
    cfg.update(kwargs)
    return MoE(**cfg)


class _Checks:
    """Scenario helpers shared by the EP=2 and EP=4 classes (self.rank, self.world_size)."""

    def mesh(self):
        return init_device_mesh("cpu", (self.world_size,))

    def check_matches_single_process(self, tokens_per_rank, setup=None, style=None, **cfg):
        """Each rank's output and input gradient, its expert-weight gradient shard and the
        router/shared gradients summed over ranks equal one process on all tokens."""
        R, r = self.world_size, self.rank
        moe = make_moe(**cfg)
        if setup is not None:
            setup(moe)
        ref = copy.deepcopy(moe)
        style = ExpertParallel() if style is None else style
        parallelize_module(moe, self.mesh(), style)

        gen = torch.Generator().manual_seed(1)
        x_all = torch.randn(sum(tokens_per_rank), DIM, generator=gen)
        g_all = torch.randn(sum(tokens_per_rank), DIM, generator=gen)
        start = sum(tokens_per_rank[:r])
        rows = slice(start, start + tokens_per_rank[r])

        x_ref = x_all.clone().requires_grad_()
        out_ref = ref(x_ref)
        (out_ref * g_all).sum().backward()

        x = x_all[rows].clone().requires_grad_()
        with OpCounter() as fwd_ops:
            out = moe(x)
        with OpCounter() as bwd_ops:
            (out * g_all[rows]).sum().backward()
        # forward: one all-to-all of the counts (a functional collective), then per chunk
        # one dispatch, its group ends (host arithmetic) and one combine op; backward: their reverses, nothing else. The rows
        # move inside those ops (point-to-point or all_to_all_single).
        C = style.num_chunks
        self.assertEqual(
            fwd_ops.counts,
            {"all_to_all_single": 1, "ep_dispatch": C, "ep_chunk_offsets": C, "ep_combine": C},
        )
        self.assertEqual(bwd_ops.counts, {"ep_dispatch_backward": C, "ep_combine_backward": C})

        # the same rows through the same expert GEMMs; the router's and the shared experts'
        # GEMMs see this rank's T rows instead of all ranks' (BLAS may round a row
        # differently for another M): fp32 tolerance, not bitwise
        self.assertEqual(out, out_ref[rows])
        self.assertEqual(x.grad, x_ref.grad[rows])
        El = moe.num_experts // R
        names = ("w13", "w2") if moe.experts.b13 is None else ("w13", "w2", "b13", "b2")
        for name in names:
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

    def check_step_bitwise(self, run, ref_run, modules, x, msg="", tol=None, grad_tol=None):
        """One step (forward, ``pow(2).sum()`` backward) of ``run`` and ``ref_run`` on
        copies of ``x``: the outputs, the input gradients and every parameter gradient of
        ``modules`` (the two layers) bitwise equal (or within ``tol``, the parameters'
        gradients within ``grad_tol``: assertEqual's atol / rtol); the gradients are then
        zeroed. Returns ``run``'s output."""
        tol = tol or dict(atol=0, rtol=0)
        grad_tol = grad_tol or tol
        xs = [x.clone().requires_grad_() for _ in range(2)]
        got, ref = run(xs[0]), ref_run(xs[1])
        self.assertEqual(got, ref, **tol, msg=msg)
        got.pow(2).sum().backward()
        ref.pow(2).sum().backward()
        self.assertEqual(xs[0].grad, xs[1].grad, **tol, msg=msg)
        mod, ref_mod = modules
        for (name, p), q in zip(mod.named_parameters(), ref_mod.parameters(), strict=True):
            self.assertEqual(p.grad, q.grad, **grad_tol, msg=f"{msg}: {name}")
        mod.zero_grad()
        ref_mod.zero_grad()
        return got

    def check_compiled_equals_eager(self, style_kw, steps=10, chunk_pass=1, dynamic=False, **cfg):
        """torch.compile(fullgraph=True) of an EP layer (aot_eager: the same kernels) over
        ``steps`` steps with changing routing and token counts: outputs and every gradient
        bitwise equal to eager EP, at most one recompile, no graph break. With
        ``chunk_pass=C`` the compiled layer is built with one chunk and split into C by the
        chunk pass (before AOTAutograd, as Inductor runs it); eager is built with C.
        ``dynamic=True`` marks the token dim dynamic from the start: one frame and no
        recompile (half the compile time; the default automatic-dynamic path, a static
        frame and then one dynamic recompile, is checked at EP=2 by
        ``test_compile_fullgraph_p2p``); there ``steps=4`` runs that frame once at each of
        the four token counts (each step costs 0.1-0.2 s at EP=2, ~0.9 s at EP=4 on two
        cores)."""
        torch._dynamo.reset()
        counters.clear()
        eager = make_moe(**cfg)
        moe = copy.deepcopy(eager)
        parallelize_module(moe, self.mesh(), ExpertParallel(**style_kw))
        if chunk_pass > 1:
            style_kw = {**style_kw, "num_chunks": chunk_pass}
        parallelize_module(eager, self.mesh(), ExpertParallel(**style_kw))
        split = []

        def split_then_aot_eager(gm, example_inputs):
            split.append(ep_chunk.split_layers(gm.graph, chunk_pass))
            gm.recompile()
            return lookup_backend("aot_eager")(gm, example_inputs)

        backend = CompileCounterWithBackend(split_then_aot_eager)
        compiled = torch.compile(moe, fullgraph=True, backend=backend)
        if dynamic:
            layer = compiled

            def compiled(x):
                torch._dynamo.mark_dynamic(x, 0)
                return layer(x)

        gen = torch.Generator().manual_seed(7 + self.rank)
        for step in range(steps):
            num_tokens = (5, 11, 3, 8)[step % 4] + self.rank
            x = torch.randn(num_tokens, DIM, generator=gen)
            self.check_step_bitwise(compiled, eager, (moe, eager), x, msg=f"step {step}")
        self.assertEqual(dict(counters["graph_break"]), {})
        self.assertLessEqual(backend.frame_count, 1 if dynamic else 2, msg="recompiles")
        self.assertEqual(split, [int(chunk_pass > 1)] * backend.frame_count)


class OpCounter(TorchDispatchMode):
    """Counts the torch_moe expert-parallel ops (ep_*) and the functional collectives
    dispatched inside the block (CommDebugMode's module tracking does not follow a
    submodule called once per chunk)."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[1]
        if name.startswith("ep_") or name == "all_to_all_single":
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


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


class _EPClass(_Checks, GlooContinuousTest):
    """One gloo process group for all the tests of a class (one scenario per test)."""


class TestExpertParallel2(_EPClass):
    world_size = 2

    def test_uneven_tokens(self):
        self.check_matches_single_process([7, 12])

    def test_rank_without_tokens(self):
        self.check_matches_single_process([0, 9])
        self.check_matches_single_process([9, 0], shared_hidden_dim=8, shared_gate=True)

    def test_all_tokens_on_the_last_rank(self):
        moe, _ = self.check_matches_single_process(
            [6, 10], setup=force_onto_last_rank(2), expert_bias=True
        )
        self.assertEqual(int(moe.tokens_per_expert[:4].sum()), 0)

    def test_deepseek_v3_and_bias_update(self):
        """Sigmoid, groups, expert bias, a shared expert; update_expert_bias over the group
        of the ranks that route tokens equals the single-process update."""
        moe, ref = self.check_matches_single_process([5, 11], setup=deepseek_setup, **DEEPSEEK)
        moe.update_expert_bias(0.01, group=dist.group.WORLD)
        ref.update_expert_bias(0.01)  # one process: its own load (no collective)
        self.assertEqual(moe.router.expert_bias, ref.router.expert_bias)

    def test_bias_update_without_group_is_local(self):
        """group=None never reduces over the world implicitly (pipeline stages hold other
        layers): each rank moves its bias by its own load."""
        moe = make_moe(expert_bias=True)
        parallelize_module(moe, self.mesh(), ExpertParallel())
        moe(torch.randn(6 + 5 * self.rank, DIM))
        local = moe.tokens_per_expert.clone().float()
        with CommDebugMode() as comm:
            load = moe.update_expert_bias(0.01)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(load, local)
        # a group without this rank: refused (torch's all_reduce only warned, and the bias
        # moved by this rank's own load)
        groups = [dist.new_group([r]) for r in range(self.world_size)]  # (collective)
        not_mine = groups[1 - self.rank]
        moe(torch.randn(4, DIM))
        with self.assertRaisesRegex(
            ValueError, rf"update_expert_bias: this rank \({self.rank}\) is not in group"
        ):
            moe.update_expert_bias(0.01, group=not_mine)

    def test_chunks_p2p(self):
        self.check_matches_single_process(
            [9, 4], style=ExpertParallel(num_chunks=2), shared_hidden_dim=8
        )
        style = ExpertParallel(num_chunks=4)
        self.check_matches_single_process([0, 7], setup=deepseek_setup, style=style, **DEEPSEEK)

    def test_chunks_all_to_all(self):
        style = ExpertParallel(num_chunks=2, exchange="all_to_all")
        self.check_matches_single_process([9, 4], style=style, shared_hidden_dim=8)
        style = ExpertParallel(num_chunks=4, exchange="all_to_all")
        self.check_matches_single_process([0, 7], setup=deepseek_setup, style=style, **DEEPSEEK)

    def test_all_to_all(self):
        self.check_matches_single_process([7, 3], style=ExpertParallel(exchange="all_to_all"))

    def test_composed_experts(self):
        """GPT-OSS-like experts (biases sharded with the weights, interleaved gate / up, the
        clamped activation): one chunk, two chunks (the biases split with the weights) and
        an idle rank; ungated relu2 experts in two chunks."""
        self.check_matches_single_process([9, 4], **GPT_OSS)
        style = ExpertParallel(num_chunks=2)
        self.check_matches_single_process([0, 7], style=style, shared_hidden_dim=8, **GPT_OSS)
        # Nemotron-H-like: ungated relu2 experts ([E, F, D] up projections) with biases,
        # a relu2 shared expert, two chunks
        relu2 = dict(**naive.NEMOTRON_H, shared_activation="relu2")
        self.check_matches_single_process([5, 6], style=style, shared_hidden_dim=8, **relu2)

    def test_low_precision_experts(self):
        self.check_matches_single_process([8, 5], precision="fp8_rowwise")
        style = ExpertParallel(num_chunks=2)
        self.check_matches_single_process([3, 9], style=style, precision="fp8_blockwise")

    def test_fp8_dispatch(self):
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
            parallelize_module(moe, self.mesh(), style)
            xg = x.clone().requires_grad_()
            out = moe(xg)
            (out * x).sum().backward()
            results.append((out, xg.grad, moe.experts.w13.grad.to_local()))
        for plain, fp8_p2p, fp8_a2a in zip(*results, strict=True):
            self.assertEqual(fp8_a2a, fp8_p2p)  # per-row blocks: the exchange does not matter
            self.assertNotEqual(plain, fp8_p2p)
            sqnr = 10 * torch.log10(plain.pow(2).sum() / (plain - fp8_p2p).pow(2).sum())
            self.assertGreater(sqnr.item(), 25.0)

    def test_local_losses_and_dtypes(self):
        # aux and z losses are computed on this rank's tokens (local, as under DP)
        moe = make_moe(aux_loss="switch", aux_loss_coeff=0.01, z_loss_coeff=0.001)
        local = copy.deepcopy(moe)
        parallelize_module(moe, self.mesh(), ExpertParallel())
        torch.manual_seed(10 + self.rank)
        x = torch.randn(2, 5 + self.rank, DIM)  # a [B, S, D] input
        self.assertEqual(moe(x), local(x))  # the unparallelized layer on this rank's tokens
        self.assertEqual(moe.last_losses, local.last_losses)
        # bf16 parameters: same result as the unparallelized layer on this rank's tokens.
        # This rank's experts run fewer groups than the local layer's, whose kernels a CPU
        # that upcasts bf16 picks by separate measured decisions (few_gemm, keyed by the
        # busy groups): forced alike here and below, as the two would otherwise differ by
        # where the activation is rounded to bf16, not by the parallelism under test
        moe16 = make_moe(dtype=torch.bfloat16)
        local16 = copy.deepcopy(moe16)
        parallelize_module(moe16, self.mesh(), ExpertParallel())
        with _cpu_probe.force(few_gemm="aten"):
            self.assertEqual(moe16(x.bfloat16()), local16(x.bfloat16()))
        # fp32 parameters under bf16 autocast (rows sent in bf16), chunked: the same too
        # (the chunks' grouped GEMMs run fewer groups still)
        moe32 = make_moe(shared_hidden_dim=8)
        local32 = copy.deepcopy(moe32)
        parallelize_module(moe32, self.mesh(), ExpertParallel(num_chunks=2))
        xg, xg_local = x.clone().requires_grad_(), x.clone().requires_grad_()
        with _cpu_probe.force(few_gemm="aten"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, out_local = moe32(xg), local32(xg_local)
            self.assertEqual(out.dtype, torch.bfloat16)
            self.assertEqual(out, out_local)
            out.float().pow(2).sum().backward()
            out_local.float().pow(2).sum().backward()
        self.assertEqual(xg.grad, xg_local.grad)

    def test_conventional_style(self):
        """No method replaced on any module, no hook installed; the dispatcher is a
        submodule the layer calls, and the expert weights are Shard(0) DTensors."""
        moe = make_moe(shared_hidden_dim=8)
        parallelize_module(moe, self.mesh(), ExpertParallel(num_chunks=2))
        for name, m in moe.named_modules():
            self.assertNotIn("forward", vars(m), msg=name)
            for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
                self.assertEqual(len(getattr(m, hooks)), 0, msg=f"{name}.{hooks}")
        self.assertIsInstance(moe.dispatcher, ExpertParallelDispatcher)
        self.assertEqual(moe.dispatcher.chunks, [(0, 2), (2, 4)])
        self.assertIn("ExpertParallelDispatcher(world=2, num_experts=8, chunks=2", repr(moe))
        self.assertEqual(moe.experts.w13.placements, (Shard(0),))

    def test_compile_fullgraph_p2p(self):
        self.check_compiled_equals_eager({}, shared_hidden_dim=8)

    def test_compile_fullgraph_all_to_all_chunks(self):
        self.check_compiled_equals_eager(
            {"exchange": "all_to_all", "num_chunks": 2},
            steps=4,
            dynamic=True,
            shared_hidden_dim=8,
            precision="fp8_rowwise",
        )

    def test_compile_chunk_pass_fp8_uneven(self):
        """The chunk pass into 3 uneven chunks of 4 local experts (1 + 1 + 2), FP8 experts,
        FP8 dispatch over all_to_all: bitwise equal to ExpertParallel(num_chunks=3)."""
        self.check_compiled_equals_eager(
            {"exchange": "all_to_all", "dispatch_dtype": torch.float8_e4m3fn},
            steps=2,
            chunk_pass=3,
            dynamic=True,
            shared_hidden_dim=8,
            precision="fp8_rowwise",
        )

    def test_compile_chunk_pass_composed(self):
        """GPT-OSS-like experts: the chunk pass slices the experts' biases [El, N] with
        their weights, bitwise equal to ExpertParallel(num_chunks=2); the same for ungated
        relu2 experts ([El, F, D] up projections)."""
        self.check_compiled_equals_eager({}, steps=4, chunk_pass=2, dynamic=True, **GPT_OSS)
        relu2 = naive.NEMOTRON_H
        self.check_compiled_equals_eager({}, steps=2, chunk_pass=2, dynamic=True, **relu2)

    def test_compile_chunk_pass_inductor(self):
        """Inductor end to end (torch_moe._inductor.options(ep_chunks=2)): the layer built
        with one chunk compiles to the code of the layer built with two, bit for bit,
        forward and backward."""
        torch._dynamo.reset()
        TI.reset_counters()
        base = make_moe(shared_hidden_dim=8)
        one, two = copy.deepcopy(base), copy.deepcopy(base)
        parallelize_module(one, self.mesh(), ExpertParallel())
        parallelize_module(two, self.mesh(), ExpertParallel(num_chunks=2))
        compiled = [
            torch.compile(one, fullgraph=True, options=TI.options(ep_chunks=2)),
            torch.compile(two, fullgraph=True, options=TI.options()),
        ]
        gen = torch.Generator().manual_seed(5 + self.rank)
        x = torch.randn(7, DIM, generator=gen)  # one shape: one compile of each
        # the pre-grad pass runs on a cache miss only: no FX graph / AOTAutograd cache hits
        # (the compiled kernels' own cache stays: a warm machine skips the C++ builds)
        no_graph_cache = inductor_config.patch(fx_graph_cache=False)
        with no_graph_cache, functorch_config.patch(enable_autograd_cache=False):
            got = self.check_step_bitwise(compiled[0], compiled[1], (one, two), x)
        self.assertEqual(TI.counters()["ep_chunks"], 1)
        self.assertEqual(TI.counters()["ep_chunk_skipped"], 0)
        # and eager chunking, to Inductor's rounding of the router and shared experts
        eager = copy.deepcopy(base)
        parallelize_module(eager, self.mesh(), ExpertParallel(num_chunks=2))
        self.assertEqual(got, eager(x), atol=1e-6, rtol=1e-5)

    def test_compile_ranks_with_different_ep_chunks(self):
        """Ranks compiled with different ``ep_chunks`` (rank 0 split into two chunks by the
        pass, rank 1 whole) exchanged rows of different chunks: each waited for the other's
        until the group's timeout. The pass writes the chunks into the plan's mode word, so
        both raise at the first exchange naming each rank's, and the group stays usable."""
        torch._dynamo.reset()
        TI.reset_counters()
        moe = make_moe()
        parallelize_module(moe, self.mesh(), ExpertParallel())
        chunks = 2 if self.rank == 0 else 1
        compiled = torch.compile(moe, fullgraph=True, options=TI.options(ep_chunks=chunks))
        x = torch.randn(6, DIM, generator=torch.Generator().manual_seed(self.rank))
        mode = "float32 rows, autograd recording"
        want = rf"different modes \(rank 0: {mode}, 2 chunks of local experts; rank 1: {mode}\)"
        no_graph_cache = inductor_config.patch(fx_graph_cache=False)  # (the pass runs)
        with no_graph_cache, functorch_config.patch(enable_autograd_cache=False):
            with self.assertRaisesRegex(RuntimeError, want):
                compiled(x)
        self.assertEqual(TI.counters()["ep_chunks"], int(self.rank == 0))
        self.assertEqual(TI.counters()["ep_chunk_word_missing"], 0)
        one = make_moe()
        parallelize_module(one, self.mesh(), ExpertParallel())
        self.assertEqual(moe(x), one(x))

    def test_compile_inductor_rank_without_tokens(self):
        """Inductor end to end with a rank that holds no tokens (the other rank's tokens
        still reach its experts), once with the passes and two chunks and once plain: on
        that rank every output and input gradient is empty, so Inductor read none of the
        backward dispatch's outputs and dropped the exchange, and the peer waited for it
        until the group's timeout. Now each step completes and equals eager EP (to
        Inductor's rounding of the router and the shared expert)."""
        for options, chunks in ((TI.options(ep_chunks=2), 2), (None, 1)):
            torch._dynamo.reset()
            base = make_moe(shared_hidden_dim=8)
            moe, eager = copy.deepcopy(base), copy.deepcopy(base)
            parallelize_module(moe, self.mesh(), ExpertParallel())
            parallelize_module(eager, self.mesh(), ExpertParallel(num_chunks=chunks))
            compiled = torch.compile(moe, fullgraph=True, options=options)
            gen = torch.Generator().manual_seed(11 + self.rank)
            # the FX graph cache could serve code lowered before the fix: compile afresh
            no_graph_cache = inductor_config.patch(fx_graph_cache=False)
            with no_graph_cache, functorch_config.patch(enable_autograd_cache=False):
                for step, tokens in enumerate(((7, 0), (0, 6))):
                    msg = f"options={options is not None} step {step} tokens {tokens}"
                    x = torch.randn(tokens[self.rank], DIM, generator=gen)
                    self.check_step_bitwise(
                        compiled, eager, (moe, eager), x, msg,
                        tol=dict(atol=1e-6, rtol=1e-5), grad_tol=dict(atol=1e-5, rtol=1e-5),
                    )  # fmt: skip

    def test_compile_inductor_fp8_experts(self):
        """FP8 experts under Inductor with the passes (options()): the received rows' count
        is an unbacked SymInt, which the decomposition of the scaled GEMMs met in two
        checks: rowwise's scale-row check asked "== 1" of it first (a data-dependent
        guard: the compile failed), now decomposed; tensorwise's one whole-dim scale row
        (none for no rows) is data-dependent indeed: its GEMMs stay extern calls
        (``data_dependent_skipped``). Values equal eager EP (rank 1 holds no tokens)."""
        for recipe, decomposed in (("fp8_rowwise", True), ("fp8_tensorwise", False)):
            torch._dynamo.reset()
            TI.reset_counters()
            base = make_moe(precision=recipe)
            moe, eager = copy.deepcopy(base), copy.deepcopy(base)
            parallelize_module(moe, self.mesh(), ExpertParallel())
            parallelize_module(eager, self.mesh(), ExpertParallel())
            compiled = torch.compile(moe, fullgraph=True, options=TI.options())
            x = torch.randn((6, 0)[self.rank], DIM, generator=torch.Generator().manual_seed(2))
            no_graph_cache = inductor_config.patch(fx_graph_cache=False)
            with no_graph_cache, functorch_config.patch(enable_autograd_cache=False):
                self.check_step_bitwise(compiled, eager, (moe, eager), x, msg=recipe)
            counts = TI.counters()
            self.assertEqual(counts["decompose_scaled_gemms"] > 0, decomposed, msg=counts)
            self.assertEqual(counts["data_dependent_skipped"] > 0, not decomposed, msg=counts)

    def test_compile_overlap_schedule(self):
        """The EP overlap pass on the post-grad graphs of a layer traced with two chunks."""
        self.check_overlap_schedule(style_chunks=2, pass_chunks=1)

    def test_compile_chunk_pass_schedule(self):
        """The chunk pass splits a layer traced with one chunk into two before autograd
        (Dynamo's graph): the same values and schedule as a layer traced with two."""
        self.check_overlap_schedule(style_chunks=1, pass_chunks=2)

    def check_overlap_schedule(self, style_chunks, pass_chunks):
        """Compiled with ``ExpertParallel(num_chunks=style_chunks)`` (and the chunk pass at
        ``pass_chunks``), against eager with two chunks: chunk 1's dispatch is issued before
        chunk 0's experts run and waited only after them, chunk 0's combine is in flight
        during chunk 1's experts (forward); the combines' backwards are issued up front and
        chunk 1's dispatch backward is in flight during chunk 0's experts' backward
        (backward). Values bitwise equal to eager chunking (the same exchanges and
        kernels)."""
        torch._dynamo.reset()
        eager = make_moe(shared_hidden_dim=8)
        moe = copy.deepcopy(eager)
        parallelize_module(eager, self.mesh(), ExpertParallel(num_chunks=2))
        parallelize_module(moe, self.mesh(), ExpertParallel(num_chunks=style_chunks))
        codes, split = [], []

        def compile_graph(gm, example_inputs):
            exchanges, _ = ep_overlap.run(gm.graph)
            self.assertEqual(exchanges, 4)  # two chunks x (dispatch, combine) or backwards
            gm.recompile()
            codes.append(gm.code)
            return make_boxed_func(gm)

        inner = aot_autograd(fw_compiler=compile_graph, bw_compiler=compile_graph)

        def backend(gm, example_inputs):  # Inductor's order: the pre-grad pass, then AOT
            split.append(ep_chunk.split_layers(gm.graph, pass_chunks))
            gm.recompile()
            return inner(gm, example_inputs)

        compiled = torch.compile(moe, fullgraph=True, backend=backend)
        gen = torch.Generator().manual_seed(3 + self.rank)
        for step in range(3):
            x = torch.randn(9 + 2 * step, DIM, generator=gen)
            self.check_step_bitwise(compiled, eager, (moe, eager), x, msg=f"step {step}")
        # each graph (a recompile once the token count varies) had its layer split once
        self.assertEqual(split, [int(pass_chunks > 1)] * len(split))
        fwd, bwd = codes[0], codes[1]
        start = "torch.ops.torch_moe.ep_start.default("
        wait = "torch.ops.torch_moe.ep_wait.default("
        swiglu, swiglu_bwd = "grouped_swiglu.default(", "grouped_swiglu_backward.default("
        FileCheck().check(start).check("'dispatch', False, -1)").check(start).check(
            "'dispatch', False, -1)"
        ).check(wait).check_not(wait).check(swiglu).check(start).check("'combine'").check(
            wait
        ).check_not(wait).check(swiglu).check(start).check("'combine'").check(wait).check(
            wait
        ).check("unpermute.default(").run(fwd)
        FileCheck().check(start).check("'combine backward'").check(start).check(
            "'combine backward'"
        ).check(wait).check_not(wait).check(swiglu_bwd).check(start).check(
            "'dispatch backward'"
        ).check(wait).check_not(wait).check(swiglu_bwd).check(start).check(
            "'dispatch backward'"
        ).check(wait).check(wait).check("unpermute.default(").run(bwd)

    def test_low_latency_inference(self):
        """mode="low_latency" in inference: fixed-size buffers, one all-to-all of equal
        splits per direction and no counts exchange; the outputs of the training exchange,
        bit for bit (bf16 and FP8 experts, FP8 dispatch, an empty rank); a rank over its
        token budget raises instead of dropping."""
        tokens = [5, 0]
        for precision, dispatch_dtype in (
            ("bf16", None),
            ("fp8_rowwise", None),
            ("bf16", torch.float8_e4m3fn),
        ):
            base = make_moe(shared_hidden_dim=8, precision=precision).eval()
            training, low = copy.deepcopy(base), copy.deepcopy(base)
            style = dict(dispatch_dtype=dispatch_dtype)
            parallelize_module(training, self.mesh(), ExpertParallel(**style))
            parallelize_module(
                low,
                self.mesh(),
                ExpertParallel(mode="low_latency", max_tokens_per_rank=8, **style),
            )
            for num_tokens in (7, tokens[self.rank]):
                x = torch.randn(num_tokens, DIM)
                with torch.inference_mode():
                    ref = training(x)
                    with OpCounter() as ops:
                        got = low(x)
                self.assertEqual(got, ref, atol=0, rtol=0, msg=precision)
                # no ep_* op (no counts exchange, no host plan): the header, the slots' rows
                # with their experts and weights, the results back: equal all-to-alls
                self.assertEqual(ops.counts, {"all_to_all_single": 3})
        with (
            torch.inference_mode(),
            self.assertRaisesRegex(
                ValueError, r"this rank has 9 tokens, more than max_tokens_per_rank=8"
            ),
        ):
            low(torch.randn(9, DIM))
        with self.assertRaisesRegex(ValueError, "needs max_tokens_per_rank"):
            ExpertParallel(mode="low_latency")

    def test_two_microbatch_prefill(self):
        """microbatches=2 (inference): the second micro-batch's dispatch in flight during
        the first's experts, the first's combine during the second's; the one-batch
        outputs (each expert GEMM sees half the rows: fp32 tolerance for the BLAS's
        row-count-dependent rounding), with either exchange and FP8 experts."""
        for precision, exchange in (("bf16", "p2p"), ("fp8_rowwise", "all_to_all")):
            base = make_moe(shared_hidden_dim=8, precision=precision).eval()
            one, two = copy.deepcopy(base), copy.deepcopy(base)
            parallelize_module(one, self.mesh(), ExpertParallel(exchange=exchange))
            parallelize_module(two, self.mesh(), ExpertParallel(exchange=exchange, microbatches=2))
            # (ranks of 0 or 1 tokens beside ranks of more take the same two micro-batches:
            # their peers wait on their exchanges; a per-rank choice hung or aborted gloo)
            for num_tokens in (9 + self.rank, 1, 0, 7 * self.rank, 1 + 6 * self.rank):
                x = torch.randn(num_tokens, DIM)
                with torch.inference_mode():
                    with OpCounter() as ops:
                        got = two(x)
                    self.assertEqual(got, one(x), msg=f"{precision} {exchange} T={num_tokens}")
                # two plans, and each exchange split into issue and wait; an issued p2p
                # exchange is in c10d's work registry until its wait
                self.assertEqual(ops.counts["all_to_all_single"], 2)
                self.assertEqual(ops.counts["ep_start"], 4)
                self.assertEqual(torch._C._distributed_c10d._get_work_registry_size(), 0)
                # a torch without PythonCallbackWork: nothing registered, ep_wait waits
                with mock.patch.object(dispatch_module._c10d, "PythonCallbackWork", None):
                    with torch.inference_mode():
                        self.assertEqual(two(x), got, atol=0, rtol=0)
                self.assertEqual(dispatch_module._INFLIGHT, {})
        with self.assertRaisesRegex(ValueError, "microbatches must be 1 or 2, got 3"):
            ExpertParallel(microbatches=3)

    def test_config_errors(self):
        mesh = self.mesh()
        # num_experts not divisible by the EP degree: the rank's own error, which the
        # fingerprint's collective tells the other ranks
        with self.assertRaisesRegex(
            ValueError, r"num_experts \(3\) must be divisible by the expert-parallel degree"
        ):
            parallelize_module(make_moe(num_experts=3, top_k=1), mesh, ExpertParallel())
        # on one rank only: it raises its error, the other names it (it once waited in the
        # collective until the process group's timeout, then a bare timeout)
        msg = (
            r"num_experts \(3\) must be divisible"
            if self.rank
            else r"the layer was refused on "
            r"other expert-parallel ranks of \[0, 1\]: rank 1: ValueError: ExpertParallel: "
            r"num_experts \(3\) must be divisible"
        )
        with self.assertRaisesRegex(ValueError, msg):
            moe = make_moe(num_experts=3 if self.rank else 4, top_k=1)
            parallelize_module(moe, mesh, ExpertParallel())
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
        # or weights from rank 0 on one rank, their own on the other (parallelize_module
        # sets the style's src_data_rank from its own argument)
        with self.assertRaisesRegex(
            ValueError, r"rank 1: ExpertParallel.src_data_rank='None' \(rank 0: '0'\)"
        ):
            src = None if self.rank else 0
            parallelize_module(make_moe(), mesh, ExpertParallel(), src_data_rank=src)
        with self.assertRaisesRegex(ValueError, r"num_chunks \(5\) must be at most .* = 4"):
            parallelize_module(make_moe(), mesh, ExpertParallel(num_chunks=5))
        with self.assertRaisesRegex(ValueError, r"node_size \(3\) must divide .* \(2\)"):
            parallelize_module(make_moe(), mesh, ExpertParallel(node_size=3))
        moe = make_moe()
        parallelize_module(moe, mesh, ExpertParallel())
        with self.assertRaisesRegex(ValueError, "already parallelized"):
            parallelize_module(moe, mesh, ExpertParallel())

    def test_ranks_in_different_modes(self):
        """Rank 1 under bf16 autocast (its rows travel in bf16: gloo aborted the process on
        the size mismatch) or under no_grad (the peer then waited in a backward exchange
        that never came): every rank raises at the first dispatch, naming each rank's mode,
        and the group stays usable (no row moved)."""
        moe = make_moe()
        parallelize_module(moe, self.mesh(), ExpertParallel())
        x = torch.randn(6, DIM, generator=torch.Generator().manual_seed(self.rank))
        for on_rank_1, want in (
            (torch.autocast("cpu", torch.bfloat16), r"rank 1: bfloat16 rows, autograd recording"),
            (torch.no_grad(), r"rank 1: float32 rows, no autograd"),
        ):
            ctx = on_rank_1 if self.rank == 1 else contextlib.nullcontext()
            with (
                self.assertRaisesRegex(
                    RuntimeError,
                    r"different modes \(rank 0: float32 rows, autograd recording; " + want + r"\)",
                ),
                ctx,
            ):
                moe(x)
        # the same mode on both: a step runs (and its backward's exchanges)
        with torch.autocast("cpu", torch.bfloat16):
            y = moe(x)
        y.float().sum().backward()
        self.assertIsNotNone(moe.experts.w13.grad)

    def test_compile_two_microbatches_ranks_of_other_sizes(self):
        """microbatches=2 compiled by Inductor where the ranks' token counts differ (each
        rank's graph specialized to its own): the scheduler had put the exchanges and the
        plans' all-to-alls in a different order on each rank, and (7, 0) and (5, 6) hung
        until the timeout; the exchanges now keep the graph's order (ordering edges in
        their lowering). The outputs are eager's (Inductor fuses the shared expert's add:
        fp32 rounding). The compiled code keeps the schedule: Inductor's locality reordering
        had moved each start to its wait (issue, wait, issue, wait: no overlap); the handles
        now pass through ``wait_tensor``, which it leaves apart from its producer. With
        ``exchange="all_to_all"`` and (7, 1) tokens gloo aborted the process: one rank
        issued the second plan's all-to-all before the first dispatch, the other after it
        (a plan's all-to-all now also runs after the exchange lowered before it)."""
        start = "torch.ops.torch_moe.ep_start.default("
        wait = "torch.ops.torch_moe.ep_wait.default("
        for exchange, tokens in (
            ("p2p", (7, 0)),
            ("p2p", (5, 6)),
            ("p2p", (0, 3)),
            ("all_to_all", (7, 1)),
            ("all_to_all", (1, 6)),
        ):
            torch._dynamo.reset()  # (a module compiled anew: each rank its own graphs)
            base = make_moe(shared_hidden_dim=8, top_k=1).eval()
            parallelize_module(base, self.mesh(), ExpertParallel(microbatches=2, exchange=exchange))
            compiled = torch.compile(base, fullgraph=True)
            x = torch.randn(tokens[self.rank], DIM)
            with torch.inference_mode():
                got, codes = run_and_get_code(compiled, x)
                self.assertEqual(got, base(x), msg=f"{exchange} {tokens}")
            # both dispatches issued, A's experts, A's combine issued, B's experts, then
            # the combines waited
            FileCheck().check(start).check("'dispatch'").check_not(wait).check(start).check(
                "'dispatch'"
            ).check(wait).check_not(wait).check(start).check("'combine'").check(wait).check(
                start
            ).check("'combine'").check(wait).check(wait).run("\n".join(codes))
            # every exchange waited (a micro-batch of no rows: its combine's wait had been
            # dropped as dead code, the exchange left in flight)
            self.assertEqual(torch._C._distributed_c10d._get_work_registry_size(), 0)
            self.assertEqual(dispatch_module._INFLIGHT, {})

    def test_microbatch_ranks_in_different_modes(self):
        """microbatches=2: rank 1 in eval mode (two micro-batches' plans and exchanges in
        flight), rank 0 in train mode under no_grad (one batch's): rank 0 waited in its
        combine until the timeout; the plans carry the schedule, so both raise at once,
        and the group stays usable."""
        moe, one = make_moe(), make_moe()
        parallelize_module(moe, self.mesh(), ExpertParallel(microbatches=2))
        parallelize_module(one, self.mesh(), ExpertParallel())
        x = torch.randn(6, DIM, generator=torch.Generator().manual_seed(self.rank))
        moe.train(self.rank == 0)
        plain = "float32 rows, no autograd"
        want = rf"different modes \(rank 0: {plain}; rank 1: {plain}, two micro-batches\)"
        with torch.no_grad(), self.assertRaisesRegex(RuntimeError, want):
            moe(x)
        moe.eval()
        one.eval()
        with torch.no_grad():
            self.assertEqual(moe(x), one(x))

    def test_low_latency_ranks_in_different_modes(self):
        """mode="low_latency" (no plan): rank 0 over max_tokens_per_rank (its peer waited in
        the first exchange), rank 1 under bf16 autocast, or rank 1 with autograd, taking
        the training exchange (gloo aborted the process on the buffers' sizes): the header,
        shaped as the training plan, makes every rank raise before a row moves, in eager
        naming each rank's mode, compiled through ``_assert_async`` after the header; the
        group stays usable and the outputs are the training exchange's."""
        base = make_moe().eval()
        low, ref = copy.deepcopy(base), copy.deepcopy(base)
        style = ExpertParallel(mode="low_latency", max_tokens_per_rank=8)
        parallelize_module(low, self.mesh(), style)
        parallelize_module(ref, self.mesh(), ExpertParallel())
        x = torch.randn(5 + self.rank, DIM, generator=torch.Generator().manual_seed(self.rank))
        ll = "float32 rows, no autograd, the low-latency exchange"
        named = {
            "over budget": f"rank 0: {ll}, more tokens than max_tokens_per_rank; rank 1: {ll}",
            "autocast": f"rank 0: {ll}; rank 1: bfloat16 rows, no autograd, the low-latency",
            "training": f"rank 0: {ll}; rank 1: float32 rows, autograd recording",
        }
        over = "this rank has 9 tokens, more than max_tokens_per_rank=8"
        for layer in (low, torch.compile(low, fullgraph=True)):
            eager = layer is low
            with torch.inference_mode():
                self.assertEqual(layer(x), ref(x), atol=0, rtol=0)
            for case, names in named.items():
                run, inputs, ctx = layer, x, contextlib.ExitStack()
                if not (case == "training" and self.rank == 1):
                    ctx.enter_context(torch.inference_mode())
                if case == "autocast" and self.rank == 1:
                    ctx.enter_context(torch.autocast("cpu", torch.bfloat16))
                if case == "training" and self.rank == 1:
                    run = low  # (eager: the training exchange's check names the modes)
                want = (RuntimeError, "different modes" + (r" \(" + names if eager else ";"))
                if case == "training" and self.rank == 1:
                    want = (RuntimeError, r"different modes \(" + names)
                if case == "over budget" and self.rank == 0:
                    inputs, want = (
                        torch.randn(9, DIM),
                        (ValueError if eager else RuntimeError, over),
                    )
                with self.subTest(case=case, eager=eager), self.assertRaisesRegex(*want), ctx:
                    run(inputs)
            with torch.inference_mode():  # (no row moved: the next calls pair up)
                self.assertEqual(layer(x), ref(x), atol=0, rtol=0)


class TestExpertParallel4(_EPClass):
    world_size = 4

    def test_segment_exchange_gloo(self):
        """torch_moe.distributed.exchange on gloo (test_exchange.check_gloo; test_exchange.py
        also simulates it in one process), in this class's process group."""
        import test_exchange

        test_exchange.check_gloo(self)

    def test_uneven_and_empty(self):
        self.check_matches_single_process([3, 0, 8, 5])

    def test_all_tokens_on_the_last_rank(self):
        self.check_matches_single_process(
            [4, 7, 0, 2], setup=force_onto_last_rank(4), expert_bias=True
        )

    def test_deepseek_v3(self):
        self.check_matches_single_process([6, 1, 3, 0], setup=deepseek_setup, **DEEPSEEK)

    def test_hierarchical(self):
        """The hierarchical all-to-all over 2 nodes of 2 ranks, plain and chunked."""
        self.check_matches_single_process([5, 2, 0, 9], style=ExpertParallel(node_size=2))
        style = ExpertParallel(num_chunks=2, node_size=2)
        self.check_matches_single_process([3, 8, 4, 1], style=style, shared_hidden_dim=8)

    def test_low_latency_inference(self):
        base = make_moe(**DEEPSEEK).eval()
        deepseek_setup(base)
        training, low = copy.deepcopy(base), copy.deepcopy(base)
        parallelize_module(training, self.mesh(), ExpertParallel())
        parallelize_module(
            low, self.mesh(), ExpertParallel(mode="low_latency", max_tokens_per_rank=6)
        )
        x = torch.randn((6, 2, 0, 5)[self.rank], DIM)
        with torch.inference_mode():
            self.assertEqual(low(x), training(x), atol=0, rtol=0)

    def test_compile_fullgraph_chunk_pass(self):
        """EP=4, built with one chunk, split into two by the chunk pass: bitwise equal to
        eager ExpertParallel(num_chunks=2)."""
        self.check_compiled_equals_eager(
            {}, steps=4, chunk_pass=2, dynamic=True, shared_hidden_dim=8
        )


class TestExpertParallelFaults(MultiProcessTestCase):
    """Faults that leave the process group unusable: a process group per test."""

    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._start_processes(worker_context().Process)

    def init_pg(self, timeout):
        self.store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group(
            "gloo",
            store=self.store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )
        return init_device_mesh("cpu", (self.world_size,))

    def test_timeout_names_rank_and_op(self):
        mesh = self.init_pg(datetime.timedelta(seconds=3))
        moe = make_moe()
        parallelize_module(moe, mesh, ExpertParallel())
        # rank 1 skips the forward: rank 0 times out in the counts all-to-all (3 s), or sees
        # rank 1 leave where the backend waits longer; rank 1 stays until rank 0 has its
        # error (a key in the process group's store, which outlives the group's failure)
        store = self.store
        if self.rank == 0:
            with self.assertRaisesRegex(
                RuntimeError,
                r"ExpertParallel: counts all_to_all failed on rank 0 \(expert-parallel rank 0 of "
                r"2.*(Timed out|Connection closed|timeout)",
            ):
                moe(torch.randn(4, DIM))
            store.set("rank 0 done", "1")
        else:
            store.wait(["rank 0 done"], datetime.timedelta(seconds=60))

    def test_rank_raising_mid_dispatch_errors_everywhere(self):
        """Rank 1 raises inside the dispatch (after the counts exchange, before sending):
        rank 0 gets a RuntimeError naming the dispatch within the timeout, never a hang."""
        mesh = self.init_pg(datetime.timedelta(seconds=3))
        moe = make_moe()
        parallelize_module(moe, mesh, ExpertParallel())
        x = torch.randn(8, DIM)
        if self.rank == 1:
            with (
                mock.patch.object(
                    dispatch_module, "_to_owners", side_effect=RuntimeError("injected fault")
                ),
                self.assertRaisesRegex(RuntimeError, "injected fault"),
            ):
                moe(x)
        else:
            start = time.monotonic()
            with self.assertRaisesRegex(
                RuntimeError,
                r"ExpertParallel: dispatch all_to_all_segments failed on rank 0 \(expert-parallel "
                r"rank 0 of 2",
            ):
                moe(x)
            self.assertLess(time.monotonic() - start, 30)


class TestExpertParallelDevice(TestCase):
    """Device-generic (instantiate_device_type_tests): .ci/gpu runs it on cuda."""

    @onlyCUDA
    def test_nccl_ep1_matches_layer(self, device):
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
                    ExpertParallel(exchange="all_to_all", node_size=1),
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


class TestModeWord(TestCase):
    def test_chunks(self):
        """The plan's mode word carries the chunks of local experts (``with_chunks``
        rewrites only that field, which the chunk pass uses), and names them when ranks
        differ; out-of-range chunk counts are refused by value."""
        base = dispatch_module.mode_word(torch.bfloat16, True, microbatches=True)
        three = dispatch_module.mode_word(torch.bfloat16, True, microbatches=True, chunks=3)
        self.assertNotEqual(base, three)
        self.assertEqual(dispatch_module.with_chunks(three, 1), base)
        self.assertEqual(dispatch_module.with_chunks(base, 3), three)
        self.assertEqual(dispatch_module.with_chunks(three, 3), three)
        big = dispatch_module.with_chunks(base, 2**20)
        self.assertEqual(dispatch_module.with_chunks(big, 1), base)
        self.assertEqual(
            dispatch_module._describe_mode(three),
            "bfloat16 rows, autograd recording, two micro-batches, 3 chunks of local experts",
        )
        self.assertNotIn("chunks", dispatch_module._describe_mode(base))
        for bad in (0, 2**20 + 1, True, 2.0):
            with self.assertRaisesRegex(ValueError, rf"chunks must be an int .*got {bad!r}"):
                dispatch_module.with_chunks(base, bad)


class TestExchangeLowering(TestCase):
    def test_fake_kernels_register_exchange_lowerings(self):
        """A plain torch.compile (no torch_moe._inductor.options) gets the exchanges'
        side-effecting lowerings too: their fake kernels register them once Inductor's
        lowering module is loaded, and not before (a fresh process); the FX graph cache's
        key then holds the lowerings' hash (after the user's own tag), so an upgrade never
        serves code an older torch_moe lowered."""
        script = """if True:
            import sys, torch
            torch.compiler.config.cache_key_tag = "mine"
            import torch_moe.distributed.dispatch
            from torch._subclasses.fake_tensor import FakeTensorMode
            ops = torch.ops.torch_moe
            with FakeTensorMode():  # Inductor not loaded: nothing registered
                ops.ep_start([torch.empty(4, 8)], torch.zeros(4, dtype=torch.int64), "0",
                             4, 0, 2, "p2p", 0, "dispatch", False, -1)
            assert "torch_moe._inductor.lowering" not in sys.modules
            import torch._inductor.lowering as L
            from torch_moe._inductor.lowering import EXCHANGE_OPS
            assert not any(op in L.lowerings for op in EXCHANGE_OPS)
            assert torch.compiler.config.cache_key_tag == "mine"
            with FakeTensorMode():
                ops.ep_start([torch.empty(4, 8)], torch.zeros(4, dtype=torch.int64), "0",
                             4, 0, 2, "p2p", 0, "dispatch", False, -1)
            assert all(op in L.lowerings for op in EXCHANGE_OPS), "not registered"
            from torch_moe._inductor.lowering import LOWERING_TAG, register_lowerings
            register_lowerings()  # (again: the tag is not repeated)
            tag = torch.compiler.config.cache_key_tag
            assert tag == "mine;" + LOWERING_TAG, tag
            assert len(LOWERING_TAG) == len("torch_moe.lowering=") + 16, LOWERING_TAG
            print("ok")
        """
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
        )
        self.assertEqual(out.returncode, 0, msg=out.stderr[-3000:])
        self.assertEqual(out.stdout.strip(), "ok")

    def test_exchange_kernel_has_side_effects(self):
        """The exchanges lower to ExchangeKernel, which the scheduler never drops."""
        import torch._inductor.lowering as L

        from torch_moe._inductor.lowering import (
            EXCHANGE_OPS,
            ExchangeKernel,
            register_lowerings,
        )

        register_lowerings()
        self.assertTrue(ExchangeKernel.has_side_effects(object.__new__(ExchangeKernel)))
        for op in EXCHANGE_OPS:
            self.assertIn(op, L.lowerings, msg=str(op))
            self.assertFalse(getattr(L.lowerings[op], "_is_fallback_handler", False), msg=str(op))


class TestLaunchRetry(TestCase):
    """The torchrun tests' one retry (dist_utils.run_launch): only gloo's exit-time abort."""

    def launch(self, tmp, script):
        marker = os.path.join(tmp, "runs")
        code = (
            f"import os, sys; p = {marker!r}; n = os.path.exists(p) and len(open(p).read())\n"
            f"open(p, 'a').write('x')\n{script}"
        )
        retried = []
        proc = run_launch(
            [sys.executable, "-c", code], dict(os.environ), 60, lambda: retried.append(1)
        )
        with open(marker) as f:
            return proc, len(f.read()), retried

    def test_retried_once_after_the_exit_abort_only(self):
        abort = f"sys.stderr.write({GLOO_EXIT_ABORT!r}); sys.stderr.flush(); os.abort()"
        with tempfile.TemporaryDirectory() as tmp:  # aborts once, then exits 0: passes
            proc, runs, retried = self.launch(tmp, f"if not n: {abort}")
            self.assertEqual((proc.returncode, runs, retried), (0, 2, [1]))
        with tempfile.TemporaryDirectory() as tmp:  # aborts every time: the failure stays
            proc, runs, _ = self.launch(tmp, abort)
            self.assertEqual((proc.returncode < 0, runs), (True, 2))
        with tempfile.TemporaryDirectory() as tmp:  # any other failure: not retried
            proc, runs, retried = self.launch(tmp, "sys.exit('a real error')")
            self.assertEqual((proc.returncode, runs, retried), (1, 1, []))


class TestTrainExampleEP(TestCase):
    def test_torchrun_ep2_matches_ep1(self):
        """train_moe_lm.py ``--ep 2`` under ``torchrun --nproc-per-node 2`` gives the loss
        curve of the in-process --ep 1 run on the same global batch, and compiled the same
        curve bit for bit; its DCP checkpoint (expert shards) loads in one process with the
        --ep 1 run's weights and resumes at --ep 1."""
        sys.path.insert(0, str(EXAMPLES))
        import train_moe_lm

        tiny = [
            "--dim", "32", "--layers", "2", "--heads", "2", "--hidden-dim", "32",
            "--experts", "4", "--top-k", "2", "--seq-len", "16", "--batch-size", "4",
            "--corpus-bytes", "20000", "--eval-batches", "1", "--sample-bytes", "4",
            "--warmup", "2", "--no-progress", "--threads", "1", "--steps", "4",
            "--ckpt-every", "2", "--balance", "bias", "--bias-rate", "0.01", "--device", "cpu",
            "--no-plot",  # test_train checks the plot
        ]  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
            env["OMP_NUM_THREADS"] = "1"
            # One launch (--standalone: a free port of its own) runs the example twice in
            # one process group (test/train_runs.py): eager --ep 2, then every MoE layer
            # compiled fullgraph (aot_eager: eager's kernels), which must give the eager
            # loss curve bit for bit. The in-process --ep 1 run goes meanwhile.
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += ["--nproc-per-node", "2", str(Path(__file__).parent / "train_runs.py")]
            cmd += [*tiny, "--ep", "2", "--out", f"{tmp}/ep2", "--then"]
            cmd += [*tiny, "--ep", "2", "--out", f"{tmp}/ep2c"]
            cmd += ["--compile", "aot_eager"]
            launch = start_launch(cmd, env)
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    r1 = train_moe_lm.main([*tiny, "--ep", "1", "--out", f"{tmp}/ep1"])
            except BaseException:
                launch.kill()
                raise

            def clear_outputs():
                for folder in ("ep2", "ep2c"):
                    shutil.rmtree(f"{tmp}/{folder}")

            proc = finish_launch(launch, env, before_retry=clear_outputs)
            out = proc.stdout
            self.assertEqual(proc.returncode, 0, msg=out[-2000:] + proc.stderr[-3000:])
            self.assertEqual(out.count(f"val loss {r1['val_loss']:.3f}"), 2, msg=out[-2000:])
            with (
                open(f"{tmp}/ep2/metrics.jsonl") as f_eager,
                open(f"{tmp}/ep2c/metrics.jsonl") as f_c,
            ):
                eager_curve = [json.loads(line)["loss"] for line in f_eager]
                compiled_curve = [json.loads(line)["loss"] for line in f_c]
            self.assertEqual(compiled_curve, eager_curve, atol=0, rtol=0)
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


instantiate_device_type_tests(TestExpertParallelDevice, globals())

if __name__ == "__main__":
    run_tests()
