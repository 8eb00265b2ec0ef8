"""The MoE layer's inference path (eval mode without autograd): the training forward's
values, nothing saved, static shapes and no host reads of device values (so a CUDA graph
can capture it), and the fused inference ops (gather inside the experts, cached weight
quantization)."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import sys
import tempfile
import unittest
from pathlib import Path

import torch
from dist_utils import run_launch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe
from torch_moe.nn import MoE
from torch_moe.quantization import RECIPES
from torch_moe.quantization.fused import clear_weight_cache, weight_cache_stats

_S = sys.modules["torch_moe.quantization.scaled_grouped_mm"]  # (the module, not its op)

D, F, E, K = 32, 32, 8, 2
EXACT = dict(atol=0, rtol=0)
# ops that read a device value on the host (a sync on a GPU) or make a data-dependent shape
_SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::unique")


def _layer(precision="bf16", **kw):
    torch.manual_seed(0)
    return MoE(D, F, E, K, precision=precision, **kw).eval()


def _bf16_recipe_layer(precision):
    """A bf16 layer of ``precision`` (eval mode), inputs of 1, 3 and 40 tokens, and its
    training forward's outputs on them (eval mode with autograd)."""
    torch.manual_seed(0)
    moe = MoE(128, 96, 8, 2, dtype=torch.bfloat16, precision=precision).eval()
    xs = [torch.randn(t, 128).to(torch.bfloat16) for t in (1, 3, 40)]
    with torch.enable_grad():
        refs = [moe(x) for x in xs]
    return moe, xs, refs


def _inference_step(layer):
    """(state, x) -> layer(x) without autograd, the parameters as inputs (for make_fx)."""

    def step(state, x):
        with torch.no_grad():
            return torch.func.functional_call(layer, state, (x,))

    return step


class TestInference(TestCase):
    @parametrize("precision", ["bf16", *RECIPES])
    def test_equals_training_forward(self, precision):
        """inference_mode (the dedicated path) == the training forward, bit for bit, for
        every precision, with a capacity, alignment-free routing options and shared
        experts."""
        composed = {"activation": "swigluoai", "swiglu_limit": 7.0, "experts_bias": True}
        for kw in (
            {},
            {"capacity_factor": 0.75, "shared_hidden_dim": 16, "expert_bias": True},
            composed,  # the glu experts' GEMMs (a recipe's weights quantized once)
            {"activation": "relu2"},
        ):
            moe = _layer(precision, **kw)
            x = torch.randn(3, 7, D)
            with torch.enable_grad():
                ref = moe(x)  # eval mode with autograd: the training forward
            with torch.inference_mode():
                got = moe(x)
            self.assertEqual(got, ref, **EXACT, msg=str(kw))
            with torch.no_grad():  # no_grad takes the same path
                self.assertEqual(moe(x), ref, **EXACT)

    @parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_equals_training_forward_in_half_dtypes(self, dtype):
        """The same in a bf16 / fp16 layer, whose training forward takes the router's
        logits from its op (the native kernels' sums on a CPU): the inference path once
        took F.linear on fp32 copies instead, 1e-6 off, and routed near-ties (and rounded
        the weights) differently in 9 of 40 fp16 seeds here."""
        for seed in range(12):
            torch.manual_seed(seed)
            moe = MoE(64, 96, 10, 5, dtype=dtype, route_norm=True).eval()
            with torch.no_grad():
                for p in moe.parameters():
                    p.mul_(10.0**0.5)
            x = torch.randn(17, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)
            with torch.enable_grad():
                ref = moe(x)
            with torch.inference_mode():
                self.assertEqual(moe(x), ref, **EXACT, msg=f"seed {seed}")

    @parametrize("precision", ["fp8_rowwise", "fp8_blockwise", "fp8_tensorwise"])
    def test_recipe_decode_reads_the_codes_where_cached(self, precision):
        """A bf16 layer with an FP8 recipe at inference: the weights' codes cached
        row-major where the CPU's GEMMs on the codes run (``codes_rows_major``; the
        training forward quantizes them K-major), and their groups of a few rows taken by
        the GEMM's few-rows form (probe ``few_codes``) or its pieces: the training
        forward's bits either way, at decode (1-2 rows an expert) and prefill sizes, and
        compiled with fullgraph."""
        moe, xs, refs = _bf16_recipe_layer(precision)
        for choice in ("few", "pieces"):
            clear_weight_cache()
            spy = self._spied_inference(moe, xs, refs, few_codes=choice)
            # where the GEMM on the codes ran: the cached weights row-major, the few-rows
            # form asked for or not
            calls = spy.fp8_block_scaled_mm.call_args_list
            self.assertEqual(bool(calls), _S.native_gemm_ready(torch.bfloat16))
            few = [c.args[8] if len(c.args) > 8 else c.kwargs.get("few_rows", 0) for c in calls]
            self.assertTrue(all(f > 0 for f in few) if choice == "few" else not any(few))
            self.assertTrue(all(c.args[1].stride(2) == 1 for c in calls))
        torch._dynamo.reset()  # (the suite's other compiled layers count as recompiles)
        compiled = torch.compile(copy.deepcopy(moe), fullgraph=True, backend="aot_eager")
        with torch.inference_mode():
            for x, ref in zip(xs, refs, strict=True):
                self.assertEqual(compiled(x), ref, **EXACT)

    def test_mx_decode_takes_the_codes(self):
        """A bf16 layer with the MX recipe at inference: where the few-rows kernel's plain
        form multiplies a decode step's groups (probe ``few_gemm``), each weight code
        times its scale in registers (``fp8_mx_few_rows_mm``), else the busy experts'
        bf16 copies: the training forward's bits either way."""
        moe, xs, refs = _bf16_recipe_layer("mxfp8")
        for few_gemm in ("native", "aten"):
            spy = self._spied_inference(moe, xs, refs, few_gemm=few_gemm)
            ran = spy.fp8_mx_few_rows_mm.called
            here = _S.native_gemm_ready(torch.bfloat16)  # (the op's AVX512-BF16 kernel)
            self.assertEqual(ran, few_gemm == "native" and here)

    def _spied_inference(self, moe, xs, refs, **forced):
        """moe's inference forward on each of xs under the forced probe decisions, bit for
        bit refs; the spy on the native kernels that the scaled GEMMs called."""
        from unittest import mock

        from torch_moe._ops import _cpu_probe, _native

        mod = _native.kernels()
        spy = mock.MagicMock(wraps=mod)  # (none called where the kernels did not build)
        spied = mock.patch.object(_S._native, "kernels", return_value=spy)
        with (
            _cpu_probe.force(**forced),
            spied if mod is not None else contextlib.nullcontext(),
            torch.inference_mode(),
        ):
            for x, ref in zip(xs, refs, strict=True):
                self.assertEqual(moe(x), ref, **EXACT, msg=f"{forced}, {x.shape[0]} tokens")
        return spy

    def test_nothing_saved_no_stats(self):
        moe = _layer(shared_hidden_dim=8, aux_loss="switch", aux_loss_coeff=0.1)
        moe.train()
        moe(torch.randn(5, D))  # training: counts
        counts = moe.tokens_per_expert.clone()
        moe.eval()
        with torch.inference_mode():
            out = moe(torch.randn(6, D))
        self.assertFalse(out.requires_grad)
        self.assertEqual(moe.tokens_per_expert, counts)  # inference does not count

    def test_static_graph_without_host_reads(self):
        """Traced symbolically, the inference step holds no op that reads a device value on
        the host or makes a data-dependent shape, and every output size is a function of the
        input sizes only (no unbacked SymInt): capturable in a CUDA graph."""
        for precision in ("bf16", "fp8_rowwise"):
            moe = _layer(precision, shared_hidden_dim=8, capacity_factor=1.5)

            state = {**dict(moe.named_parameters()), **dict(moe.named_buffers())}
            step = _inference_step(moe)
            gm = make_fx(step, tracing_mode="symbolic")(state, torch.randn(2, 5, D))
            ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
            names = {op._schema.name for op in ops if hasattr(op, "_schema")}
            self.assertIn(
                "torch_moe::grouped_swiglu"
                if precision == "bf16"
                else "torch_moe::permute_quantize",
                names,
            )
            for op in _SYNC_OPS:
                self.assertNotIn(op, names, msg=precision)
            out_node = gm.graph.output_node().args[0]
            out_node = out_node[0] if isinstance(out_node, (list, tuple)) else out_node
            free = set()
            for size in out_node.meta["val"].shape:
                if isinstance(size, torch.SymInt):
                    free |= {str(sym) for sym in size.node.expr.free_symbols}
            # sizes of the input only (s*), never an unbacked (data-dependent) u*
            self.assertFalse(any(name.startswith("u") for name in free), msg=f"{precision}: {free}")
            # the gather is fused: no permuted copy of the input
            self.assertNotIn("torch_moe::permute", names)

    @parametrize("precision", list(RECIPES))
    def test_weights_quantized_once_per_version(self, precision):
        # every recipe (per-tensor scales too), plain and composed (glu) experts: both
        # once took the training path, which quantized the weights on every call
        for kw in ({}, {"activation": "swigluoai", "experts_bias": True}):  # + glu experts
            clear_weight_cache()
            moe = _layer(precision, **kw)
            with torch.inference_mode():
                moe(torch.randn(4, D))
                moe(torch.randn(9, D))
            # w13, w2; reused
            self.assertEqual(weight_cache_stats(), {"misses": 2, "hits": 2}, msg=str(kw))
            with torch.no_grad():
                moe.experts.w13.mul_(0.5)  # the weight changes: requantized
            with torch.inference_mode():
                moe(torch.randn(4, D))
            self.assertEqual(weight_cache_stats(), {"misses": 3, "hits": 3}, msg=str(kw))

    @parametrize("precision", ["fp8_rowwise", "mxfp8"])
    def test_weights_requantized_after_a_new_storage(self, precision):
        # a parameter given another storage keeps its version counter (p.data = ...,
        # module.to(dtype), whose round trip here also rounds the weights to bf16): the
        # cache notices the storage, not the version; a write through p.data bypasses
        # both, as documented, and clear_weight_cache() is the way out
        x = torch.randn(3, D, generator=torch.Generator().manual_seed(1))

        def fresh(m):
            with torch.inference_mode():
                return copy.deepcopy(m)(x)  # new parameters: no cache entries

        for change in ("assign", "to_dtype"):
            clear_weight_cache()
            moe = _layer(precision).eval()
            with torch.inference_mode():
                moe(x)
            if change == "assign":
                moe.experts.w13.data = -2 * moe.experts.w13.detach()
            else:
                moe.to(torch.bfloat16).to(torch.float32)
            with torch.inference_mode():
                got = moe(x)
            self.assertEqual(got, fresh(moe), **EXACT, msg=change)
            self.assertEqual(weight_cache_stats()["misses"], 2 + (2 if change == "to_dtype" else 1))
        moe.experts.w13.data.mul_(-2.0)  # not seen
        with torch.inference_mode():
            self.assertNotEqual(moe(x), fresh(moe))
        clear_weight_cache()
        with torch.inference_mode():
            self.assertEqual(moe(x), fresh(moe), **EXACT)

    @parametrize("precision", list(RECIPES))
    def test_experts_forward_caches_weights_in_inference(self, precision):
        # GroupedExperts.forward on permuted rows (what the expert-parallel layer's training
        # exchange calls at inference, per chunk of local experts): in eval mode without
        # autograd a recipe's weights are quantized once per version, the values those of
        # the forward with autograd; in training mode (even without autograd) nothing is
        # cached
        x = torch.randn(24, D)
        offs = torch.tensor([3, 3, 9, 12, 12, 20, 24, 24], dtype=torch.int32)
        rw = torch.rand(24)
        for kw in ({}, {"activation": "swigluoai", "experts_bias": True}):
            experts = _layer(precision, **kw).experts
            ref = experts(x, offs, rw, expert_range=(0, E))
            clear_weight_cache()
            with torch.no_grad():
                experts.train()
                experts(x, offs, rw, expert_range=(0, E))
                self.assertEqual(weight_cache_stats(), {"misses": 0, "hits": 0})
                experts.eval()
                for _ in range(2):
                    self.assertEqual(experts(x, offs, rw, expert_range=(0, E)), ref, **EXACT)
            self.assertEqual(weight_cache_stats(), {"misses": 2, "hits": 2}, msg=str(kw))

    @parametrize("precision", ["fp8_tensorwise", "mxfp8"])
    def test_experts_forward_caches_chunks_of_experts(self, precision):
        # ranges of local experts (an EP layer's chunks: expert_range, or split_weights'
        # views) are cached as views of the parameters, each its own entry; under
        # autocast a range's converted copy is not a view (two equal-sized ranges' copies
        # would look alike to the cache): nothing cached, the values still the forward's
        x = torch.randn(12, D)
        offs = torch.tensor([3, 3, 9, 12], dtype=torch.int32)
        rw = torch.rand(12)
        experts = _layer(precision).experts.to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        halves = experts.split_weights([(0, 4), (4, 8)])
        refs = [experts(xb, offs, rw, expert_range=r) for r in ((0, 4), (4, 8))]
        refs += [experts(xb, offs, rw, weights=w) for w in halves]
        self.assertNotEqual(refs[0], refs[1])
        clear_weight_cache()
        with torch.no_grad():
            for _ in range(2):
                got = [experts(xb, offs, rw, expert_range=r) for r in ((0, 4), (4, 8))]
                got += [experts(xb, offs, rw, weights=w) for w in halves]
                for g, r in zip(got, refs, strict=True):
                    self.assertEqual(g, r, **EXACT)
        # each half's w13 and w2 once (the ranges and the split's views are the same
        # views); then hits
        self.assertEqual(weight_cache_stats(), {"misses": 4, "hits": 12})
        fp32 = _layer(precision).experts
        with torch.autocast("cpu", dtype=torch.bfloat16):
            refs = [fp32(x, offs, rw, expert_range=r) for r in ((0, 4), (4, 8))]
            clear_weight_cache()
            with torch.no_grad():
                got = [fp32(x, offs, rw, expert_range=r) for r in ((0, 4), (4, 8))]
        for g, r in zip(got, refs, strict=True):
            self.assertEqual(g, r, **EXACT)
        self.assertEqual(weight_cache_stats(), {"misses": 0, "hits": 0})
        # a range of experts compiles with fullgraph in inference (the view test is
        # eager's: it once broke the graph), the same values
        torch._dynamo.reset()  # (the suite's other compiled layers count as recompiles)
        compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            for r in ((0, 4), (4, 8)):
                want = experts(xb, offs, rw, expert_range=r)
                self.assertEqual(compiled(xb, offs, rw, expert_range=r), want, **EXACT)

    @parametrize(
        "precision, kw",
        [
            ("fp8_rowwise", {"shared_hidden_dim": 8}),
            ("fp8_tensorwise", {}),  # the permuted rows quantized, the weights cached
            ("mxfp8", {"activation": "swigluoai", "swiglu_limit": 7.0, "experts_bias": True}),
        ],
        name_fn=lambda precision, kw: precision,
    )
    def test_compiles_fullgraph(self, precision, kw):
        moe = _layer(precision, **kw)
        torch._dynamo.reset()  # (the suite's other compiled layers count as recompiles)
        compiled = torch.compile(copy.deepcopy(moe), fullgraph=True, backend="aot_eager")
        for num_tokens in (3, 8, 5):
            x = torch.randn(num_tokens, D)
            with torch.inference_mode():
                self.assertEqual(compiled(x), moe(x), **EXACT)

    def test_fused_decode_path(self):
        """experts.fused_decode routes decode-sized batches through torch_moe::fused_experts
        (static graph, no host reads), bit for bit the default path on CPU (where the op is
        the grouped_swiglu reference); larger batches, a capacity or a recipe keep the
        default path; the op passes opcheck and compiles with fullgraph."""
        from torch_moe._ops.fused_experts import DECODE_MAX_ROWS

        moe = _layer(shared_hidden_dim=8)
        fused = copy.deepcopy(moe)
        fused.experts.fused_decode = True
        x = torch.randn(2, 3, D)
        with torch.inference_mode():
            self.assertEqual(fused(x), moe(x), **EXACT)
        state = {**dict(fused.named_parameters()), **dict(fused.named_buffers())}
        gm = make_fx(_inference_step(fused), tracing_mode="symbolic")(state, x)
        names = {n.target._schema.name for n in gm.graph.nodes if hasattr(n.target, "_schema")}
        self.assertIn("torch_moe::fused_experts", names)
        self.assertFalse(names & set(_SYNC_OPS))
        big = torch.randn(DECODE_MAX_ROWS // K + 1, D)
        gm = make_fx(_inference_step(fused))(state, big)
        names = {n.target._schema.name for n in gm.graph.nodes if hasattr(n.target, "_schema")}
        self.assertNotIn("torch_moe::fused_experts", names)
        self.assertIsNone(
            MoE(D, F, E, K, precision="fp8_rowwise").experts.decode_block_m(4, x.device)
        )
        torch._dynamo.reset()  # (the suite's other compiled layers count as recompiles)
        compiled = torch.compile(copy.deepcopy(fused), fullgraph=True, backend="aot_eager")
        with torch.inference_mode():
            self.assertEqual(compiled(x), moe(x), **EXACT)
        # the op itself: schema, fake and the CPU kernel agree
        perm = torch_moe.ops.permute_indices(torch.randint(0, E, (5, K)), E)
        args = (torch.randn(5, D), moe.experts.w13.detach(), moe.experts.w2.detach(),
                perm.row_to_slot, perm.offs, torch.rand(5 * K), K, 1)  # fmt: skip
        torch.library.opcheck(torch.ops.torch_moe.fused_experts.default, args)
        with self.assertRaisesRegex(
            ValueError, r"row_weights \(9,\) must match row_to_slot \(10,\)"
        ):
            torch.ops.torch_moe.fused_experts(*args[:5], torch.rand(9), K, 1)

    @unittest.skipIf(not torch.cuda.is_available(), "needs CUDA")
    def test_fused_decode_cuda(self):
        """The fused Triton kernels through the layer equal the default inference path
        within bf16 rounding, at decode and short-prefill sizes."""
        moe = _layer().cuda().to(torch.bfloat16)
        fused = copy.deepcopy(moe)
        fused.experts.fused_decode = True
        for tokens in (1, 4, 64, 300):
            x = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16)
            with torch.inference_mode():
                ref, got = moe(x).float(), fused(x).float()
            self.assertLess(((got - ref).norm() / ref.norm()).item(), 1e-2, msg=f"T={tokens}")

    @unittest.skipIf(not torch.cuda.is_available(), "needs CUDA")
    def test_cuda_graph_capture_replay(self):
        moe = _layer(shared_hidden_dim=8).cuda()
        x = torch.randn(16, D, device="cuda")
        with torch.inference_mode():
            ref = moe(x)
            static_x = x.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                moe(static_x)  # warm up (Triton compiles) outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = moe(static_x)
            for _ in range(2):
                new = torch.randn_like(x)
                static_x.copy_(new)
                graph.replay()
                self.assertEqual(static_out, moe(new), atol=1e-5, rtol=1e-5)
            static_x.copy_(x)
            graph.replay()
            self.assertEqual(static_out, ref, atol=1e-5, rtol=1e-5)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class TestGenerateExample(TestCase):
    def test_kv_cache_batched_and_ep2_low_latency(self):
        """examples/generate.py on a (barely trained, so diverse) checkpoint of
        train_moe_lm.py: batched prompts of different lengths with the KV cache give the
        bytes of decoding each prompt alone without a cache; under torchrun --ep 2 (the
        low-latency expert-parallel path) the same bytes, and with the MoE layers compiled."""
        sys.path.insert(0, str(EXAMPLES))
        import generate
        import train_moe_lm

        tiny = [
            "--dim", "32", "--layers", "2", "--heads", "2", "--hidden-dim", "32",
            "--experts", "4", "--top-k", "2", "--seq-len", "64", "--batch-size", "4",
            "--steps", "2", "--warmup", "1", "--corpus-bytes", "20000", "--eval-batches", "1",
            "--sample-bytes", "4", "--no-progress", "--threads", "1",
        ]  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            with contextlib.redirect_stdout(io.StringIO()):
                train_moe_lm.main([*tiny, "--out", tmp])
                one = generate.main(
                    ["--ckpt", tmp, "--max-new-bytes", "10", "--check", "--no-progress"]
                )
            self.assertTrue(one["checked"])
            self.assertGreater(len(set(one["outputs"])), 2)  # the prompts differ in output
            # the MoE layers compiled: the same bytes
            torch._dynamo.reset()
            self.addCleanup(torch._dynamo.reset)
            with contextlib.redirect_stdout(io.StringIO()):
                compiled = generate.main(
                    ["--ckpt", tmp, "--max-new-bytes", "10", "--no-progress", "--compile"]
                )
            self.assertEqual(compiled["outputs"], one["outputs"])
            env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
            env["OMP_NUM_THREADS"] = "1"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
            cmd += [str(EXAMPLES / "generate.py"), "--ckpt", tmp, "--max-new-bytes", "10"]
            cmd += ["--ep", "2", "--no-progress", "--threads", "1"]
            proc = run_launch(cmd, env)  # once more only after gloo's exit-time abort
            self.assertEqual(proc.returncode, 0, msg=proc.stdout[-2000:] + proc.stderr[-3000:])
            for prompt, out in zip(generate.DEFAULT_PROMPTS, one["outputs"], strict=True):
                line = f"{prompt!r} -> {out.decode(errors='replace')!r}"
                self.assertIn(line, proc.stdout)
            # a checkpoint whose config.json builds another model: named, nothing loaded
            ckpt = train_moe_lm.find_checkpoint(Path(tmp))
            run = json.loads((ckpt / "config.json").read_text())
            run["moe"]["hidden_dim"] = 48
            (ckpt / "config.json").write_text(json.dumps(run))
            msg = r"does not match its config.json: model.blocks.0.moe.experts.w13 is saved as \[4, 64, 32\], the config builds \[4, 96, 32\]"
            with self.assertRaisesRegex(RuntimeError, msg):
                generate.main(["--ckpt", tmp, "--max-new-bytes", "2", "--no-progress"])


instantiate_parametrized_tests(TestInference)

if __name__ == "__main__":
    run_tests()
