"""torch_moe._inductor: the graph passes, the weight-quantization cache, the FX graph cache
key, and the generated code.

Most tests run the passes on AOTAutograd's joint graph through a small backend (the passes,
then the default partitioner, then the graphs run as they are): cheap, and the compiled
results must equal eager bit for bit, since every fused op's CPU kernel is a composition of
the ops it replaces. The saved tensors (the forward graph's extra outputs) show what the
fusions keep out of memory. Two tests compile with Inductor itself and FileCheck the code.
"""

from __future__ import annotations

import copy
import operator
import os
import tempfile
from contextlib import nullcontext
from unittest import mock

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.utils import fresh_cache, run_and_get_code
from torch.testing import FileCheck
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe._inductor as TI
from torch_moe import ops
from torch_moe._inductor import ep_chunk
from torch_moe._inductor import passes as P
from torch_moe._ops import _cpu_probe
from torch_moe.distributed.dispatch import chunk_bounds, chunk_offsets
from torch_moe.nn import MoE
from torch_moe.nn.functional import grouped_swiglu
from torch_moe.quantization import RECIPES, GemmQuant, OperandQuant, Recipe
from torch_moe.quantization.fused import clear_weight_cache, weight_cache_stats

D = F = 32
E, K = 4, 2
EXACT = dict(atol=0, rtol=0)


def _backend(record: dict):
    """aot_autograd backend: torch_moe's passes on the joint graph, the default partitioner,
    graphs run as traced; records the pass counts and the forward's saved tensors."""

    def partition(joint, inputs, **kw):
        record["counts"] = P.run_passes(joint.graph)
        record["ops"] = [n.target for n in joint.graph.nodes if n.op == "call_function"]
        joint.recompile()
        return min_cut_rematerialization_partition(joint, inputs, **kw)

    def fw(gm, example_inputs):
        outputs = gm.graph.output_node().args[0]
        record["saved"] = [
            o.meta["val"] for o in outputs if isinstance(o, torch.fx.Node) and "val" in o.meta
        ]
        return make_boxed_func(gm)

    return aot_autograd(
        fw_compiler=fw, bw_compiler=lambda gm, _: make_boxed_func(gm), partition_fn=partition
    )


def _layer(precision, dim=D, device=None, dtype=None):
    torch.manual_seed(0)
    moe = MoE(dim, dim, E, K, precision=precision, shared_hidden_dim=16, device=device, dtype=dtype)
    return moe.train()


def _run(module, x, grad_out):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = module(x)
    out.backward(grad_out)
    params = getattr(module, "_orig_mod", module).named_parameters()
    return out.detach(), x.grad, {n: p.grad for n, p in params}


def _assert_same(test, got, ref, **tol):
    test.assertEqual(got[0], ref[0], **tol, msg="output")
    test.assertEqual(got[1], ref[1], **tol, msg="input grad")
    for name in ref[2]:
        test.assertEqual(got[2][name], ref[2][name], **tol, msg=name)


def _compare_steps(
    test, precision, token_counts=(16, 24, 9), tol=EXACT, inline_swiglu=False, **recipe
):
    """Compiled (passes) vs eager over a few steps; returns the last record. The one pass
    that is not bit for bit, inline_swiglu, is off unless asked for."""
    torch._dynamo.reset()
    eager = _layer(recipe.get("recipe", precision))
    moe = copy.deepcopy(eager)
    record: dict = {}
    compiled = torch.compile(moe, backend=_backend(record), fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    # read when a step compiles; the ATen activation, which inline_swiglu replaces (the
    # pass keeps the op where its native kernels run: test_inline_swiglu_keeps_native_act)
    with TI.config.patch(inline_swiglu=inline_swiglu), _cpu_probe.force(act_kernel="aten"):
        for num_tokens in token_counts:
            x = torch.randn(num_tokens, D, generator=gen)
            grad_out = torch.randn(num_tokens, D, generator=gen)
            _assert_same(test, _run(compiled, x, grad_out), _run(eager, x, grad_out), **tol)
    return record


def _compare_composed(test, **config):
    """permute -> grouped_swiglu -> unpermute called one by one (user code, HF's experts
    backend), compiled with the passes (config patched) against eager, bit for bit in the
    output and every gradient; returns the record."""
    gen = torch.Generator().manual_seed(3)
    T = 20
    perm = ops.permute_indices(torch.rand(T, E, generator=gen).argsort(1)[:, :K], E)
    x = torch.randn(T, D, generator=gen)
    w13 = torch.randn(E, 2 * F, D, generator=gen) * 0.2
    w2 = torch.randn(E, D, F, generator=gen) * 0.2
    grad_out = torch.randn(T, D, generator=gen)

    def step(x, w13, w2):
        x_perm = torch.ops.torch_moe.permute(x, perm.row_to_slot, perm.slot_to_row)
        return ops.unpermute(grouped_swiglu(x_perm, w13, w2, perm.offs), None, perm)

    torch._dynamo.reset()
    record: dict = {}
    results = []
    with TI.config.patch(inline_swiglu=False, **config):
        for fn in (torch.compile(step, backend=_backend(record), fullgraph=True), step):
            leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
            out = fn(*leaves)
            out.backward(grad_out)
            results.append([out.detach(), *(t.grad for t in leaves)])
    for got, want in zip(*results, strict=True):
        test.assertEqual(got, want, **EXACT)
    return record


def _bf16_swiglu_inputs():
    """(offs, [x, w13, w2, row_weights], grad_y) of a bf16 grouped_swiglu call: 32 rows,
    an empty group and 2 rows past the last group."""
    gen = torch.Generator().manual_seed(9)
    offs = torch.tensor([5, 5, 17, 30], dtype=torch.int32)
    args = [
        torch.randn(32, D, generator=gen).bfloat16(),
        (torch.randn(E, 2 * F, D, generator=gen) * 0.3).bfloat16(),
        (torch.randn(E, D, F, generator=gen) * 0.3).bfloat16(),
        torch.rand(32, generator=gen),
    ]
    return offs, args, torch.randn(32, D, generator=gen).bfloat16()


def _swiglu_loss_grads(args, offs, grad_y, **decisions):
    """A loss on grouped_swiglu's output compiled (joint-graph backend) with
    ``inline_swiglu`` on and the CPU probe's ``decisions`` forced, then run eagerly as
    well: (the pass record, [the compiled gradients, the eager gradients])."""

    def loss(x, w13, w2, rw):
        return (torch.ops.torch_moe.grouped_swiglu(x, w13, w2, offs, rw)[0] * grad_y).sum()

    torch._dynamo.reset()
    record: dict = {}
    grads = []
    with TI.config.patch(inline_swiglu=True), _cpu_probe.force(**decisions):
        fn = torch.compile(loss, backend=_backend(record), fullgraph=True)
        for f in (fn, loss):
            leaves = [t.clone().requires_grad_() for t in args]
            f(*leaves).backward()
            grads.append([t.grad for t in leaves])
    return record, grads


def _float_rows(saved, rows):
    """Saved floating-point (not e4m3) tensors with ``rows`` rows: shapes."""
    return [
        tuple(t.shape)
        for t in saved
        if t.dim() == 2 and t.shape[0] == rows and t.is_floating_point() and t.itemsize > 1
    ]


class TestPasses(TestCase):
    def test_layer_gathers_in_eager(self):
        # the layer calls grouped_swiglu in its permutation form already: no permuted x
        # [M, D] in the graph to save; fuse_gather's one rewrite is the backward's (the
        # combine's backward gathers the output gradient, which grouped_swiglu_backward
        # then reads through grad_index: no permute left in the graph)
        record = _compare_steps(self, "bf16", token_counts=(20,))
        self.assertEqual(record["counts"]["fuse_gather"], 1)
        self.assertNotIn(torch.ops.torch_moe.permute.default, record["ops"])
        # the combine and the permute's backward (both unweighted) inlined as aten ops
        self.assertEqual(record["counts"]["inline_combine"], 2)
        # saved with M = 40 rows: only the pre-activation h [M, 2F]
        self.assertEqual(_float_rows(record["saved"], 20 * K), [(20 * K, 2 * F)])

    def test_gather_fused_into_grouped_swiglu(self):
        record = _compare_composed(self)
        self.assertEqual(record["counts"]["fuse_gather"], 2)  # forward and backward
        self.assertNotIn(torch.ops.torch_moe.permute.default, record["ops"])
        self.assertEqual(record["counts"]["inline_combine"], 2)
        # saved with M = 40 rows: only the pre-activation h [M, 2F]; not the permuted x [M, D]
        self.assertEqual(_float_rows(record["saved"], 20 * K), [(20 * K, 2 * F)])

    def test_gather_fusion_off(self):
        record = _compare_composed(self, fuse_gather=False, inline_combine=False)
        self.assertNotIn("fuse_gather", record["counts"])  # the passes did not run
        self.assertNotIn("inline_combine", record["counts"])
        self.assertIn((20 * K, D), _float_rows(record["saved"], 20 * K))

    @parametrize("recipe", list(RECIPES))
    def test_scaled_gemm_fusions(self, recipe):
        record = _compare_steps(self, recipe, token_counts=(20,))
        counts = record["counts"]
        self.assertEqual(counts["decompose_scaled_gemms"], 6)  # 2 x (forward, dgrad, wgrad)
        self.assertEqual(counts["cache_weight_quantization"], 4)  # 2 x (forward, dgrad)
        rows = 20 * K
        if recipe == "fp8_tensorwise":
            # one amax over all rows: not row-local, nothing to fuse (and nothing wrong)
            self.assertEqual(counts["fuse_quantize"], 0)
        else:
            # x and a into the forward GEMMs, x / a / dY (twice) into the wgrads and dgrad
            self.assertEqual(counts["fuse_quantize"], 6)
            # only h [M, 2F] is saved in high precision: not x_perm [M, D], not a [M, F]
            self.assertEqual(_float_rows(record["saved"], rows), [(rows, 2 * F)])

    @parametrize("recipe", list(RECIPES))
    def test_scaled_gemm_passes_without_tokens(self, recipe):
        # a step of no tokens after another, compiled with the passes: eager's output
        # and gradients (zeros), bit for bit; fp8_tensorwise's weight gradients, decomposed
        # into quantize ops and scaled_grouped_mm_wgrad, once failed there (the per-tensor
        # scale of no rows came out [0, 1], the op wants [1, 1])
        record = _compare_steps(self, recipe, token_counts=(20, 0))
        self.assertEqual(record["counts"]["decompose_scaled_gemms"], 6)

    def test_not_decomposable_stays_whole(self):
        """A recipe whose activation blocks span rows (128 x 128) is not expressible as
        scaled_grouped_mm over row scales: the op stays whole, and the result is eager's."""
        op = OperandQuant("fp8", 128, 128)
        square = Recipe(
            "square", GemmQuant(op, op), GemmQuant(op, op), RECIPES["fp8_rowwise"].wgrad
        )
        record = _compare_steps(self, "square", token_counts=(20,), recipe=square)
        self.assertEqual(record["counts"]["decompose_scaled_gemms"], 2)  # the two wgrads only
        # the jagged wgrad operands that come from a permute or the SwiGLU: x, a, dY
        self.assertEqual(record["counts"]["fuse_quantize"], 3)

    def test_swiglu_inlined(self):
        # on by default: grouped_swiglu and its backward become the grouped GEMM ops around
        # the activation's aten ops (fp32 math, one rounding: within fp32 rounding of the
        # op's kernel, not bit for bit: exp, and the routing weights' gradient's sum order)
        self.assertTrue(TI.config.inline_swiglu)
        tol = dict(atol=1e-5, rtol=1e-5)
        record = _compare_steps(self, "bf16", token_counts=(20,), tol=tol, inline_swiglu=True)
        self.assertEqual(record["counts"]["inline_swiglu"], 2)  # forward and backward
        # saved for the backward: h [M, 2F] as with the op; the gathered rows and the
        # activation are tagged for recompute (without the tags one [M, 32] was saved)
        self.assertEqual(_float_rows(record["saved"], 20 * K), [(20 * K, 2 * F)])

    def test_swiglu_inlined_with_grad_h(self):
        # a loss on h itself (grad_h into the backward), with and without routing weights
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(13, D, generator=gen)
        w13 = torch.randn(E, 2 * F, D, generator=gen) * 0.2
        w2 = torch.randn(E, D, F, generator=gen) * 0.2
        offs = torch.tensor([3, 3, 9, 12], dtype=torch.int32)  # an empty group, a padding row
        rw = torch.rand(13, generator=gen)

        def loss(x, w13, w2, rw):
            y, h = torch.ops.torch_moe.grouped_swiglu(x, w13, w2, offs, rw)
            return y.square().sum() + h.sin().sum()

        for weights in (rw, None):
            leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
            rw_ = None if weights is None else weights.clone().requires_grad_()
            torch._dynamo.reset()
            record: dict = {}
            with TI.config.patch(inline_swiglu=True), _cpu_probe.force(act_kernel="aten"):
                fn = torch.compile(loss, backend=_backend(record), fullgraph=True)
                fn(*leaves, rw_).backward()
            self.assertEqual(record["counts"]["inline_swiglu"], 2)
            ref = [t.clone().requires_grad_() for t in (x, w13, w2)]
            rw_ref = None if weights is None else weights.clone().requires_grad_()
            loss(*ref, rw_ref).backward()
            for got, want in zip([*leaves, rw_], [*ref, rw_ref]):
                if want is not None:
                    self.assertEqual(got.grad, want.grad, atol=1e-5, rtol=1e-5)

    @parametrize("experts", ["gpt_oss", "relu2"])
    def test_glu_inlined(self, experts):
        """The composed experts' activation op (GPT-OSS's clamped swigluoai on interleaved
        gate / up; the ungated relu2 with a relu2 shared expert) becomes its formulas in
        aten ops: within fp32 rounding of eager over steps of two sizes, and the forward
        saves less than with the op (h; the activation is recomputed)."""
        self.assertTrue(TI.config.inline_glu)
        kw = dict(
            gpt_oss=dict(
                activation="swigluoai",
                swiglu_limit=0.5,
                experts_bias=True,
                gate_up_interleaved=True,
            ),
            relu2=dict(
                activation="relu2",
                experts_bias=True,
                shared_hidden_dim=16,
                shared_activation="relu2",
            ),
        )[experts]
        torch.manual_seed(0)
        eager = MoE(D, F, E, K, **kw).train()
        gen = torch.Generator().manual_seed(1)
        saved = {}
        # a machine without the native swigluoai kernel (where it built, the op stays:
        # test_glu_kept_where_native)
        no_native = mock.patch.object(P._native, "available", return_value=False)
        for inline in (True, False):
            torch._dynamo.reset()
            record: dict = {}
            compiled = torch.compile(
                copy.deepcopy(eager), backend=_backend(record), fullgraph=True, dynamic=False
            )
            with TI.config.patch(inline_glu=inline), no_native:
                for num_tokens in (20, 9):
                    x = torch.randn(num_tokens, D, generator=gen)
                    grad_out = torch.randn(num_tokens, D, generator=gen)
                    got, want = _run(compiled, x, grad_out), _run(eager, x, grad_out)
                    _assert_same(self, got, want, atol=1e-5, rtol=1e-5)
            # forward and backward of the routed experts' activation (and the shared one's)
            rewrites = (4 if experts == "relu2" else 2) if inline else 0
            self.assertEqual(record["counts"].get("inline_glu", 0), rewrites)
            saved[inline] = sorted(_float_rows(record["saved"], 9 * K))
        # with the op: h and the activation a [M, F] (the down GEMM's weight-gradient
        # operand; the first GEMM gathers its rows from the tokens); inlined, a is
        # recomputed from h in the backward (its nodes are tagged for recompute): one
        # [M, F] fewer per routed row
        M, N = 9 * K, F if experts == "relu2" else 2 * F  # h's width
        self.assertEqual(saved[False], sorted([(M, N), (M, F)]))
        self.assertEqual(saved[True], [(M, N)])

    def test_inlined_glu_code(self):
        """Inductor with ``inline_glu`` (the default): the activation and its backward in
        bf16 are Inductor's own loops (no glu op in the code), within one bf16 rounding step
        of eager; with the flag off the op stays, and so it does for swigluoai where its
        native CPU kernel built (faster than Inductor's loops; eager's bits)."""
        gen = torch.Generator().manual_seed(4)
        h = (2 * torch.randn(64, 48, generator=gen)).bfloat16()
        rw = torch.rand(64, generator=gen)
        grad = torch.randn(64, 24, generator=gen).bfloat16()
        glu = torch.ops.torch_moe.glu

        def step(fn, activation):
            hh, ww = h.clone().requires_grad_(), rw.clone().requires_grad_()
            width = 48 if activation == "relu2" else 24
            limit = None if activation == "relu2" else 1.0
            interleaved = activation == "swigluoai"
            a = fn(hh, ww, activation, 1.702, limit, interleaved)
            a.backward(torch.cat([grad, grad], 1)[:, :width])
            return [a.detach(), hh.grad, ww.grad]

        native = P._native.available()
        no_native = mock.patch.object(P._native, "available", return_value=False)
        for activation in ("swiglu", "swigluoai", "relu2"):
            # (inline_glu, the native kernel as built here): whether the op stays
            for inline, built in ((True, False), (False, False), (True, native)):
                torch._dynamo.reset()
                compiled = torch.compile(glu, fullgraph=True, options=TI.options())
                with TI.config.patch(inline_glu=inline), no_native if not built else nullcontext():
                    got, (fwd, bwd) = run_and_get_code(step, compiled, activation)
                want = step(glu, activation)
                for g, w in zip(got, want):
                    self.assertEqual(g, w, atol=2e-2, rtol=2e-2, msg=activation)
                kept = not inline or (built and activation == "swigluoai")
                if activation == "relu2" or kept:  # no exp, or the op itself: bit for bit
                    self.assertEqual(got[0], want[0], **EXACT)
                for code, op in (
                    (fwd, "torch.ops.torch_moe.glu."),
                    (bwd, "torch_moe.glu_backward"),
                ):
                    check = FileCheck().check if kept else FileCheck().check_not
                    check(op).run(code)

    def test_uuid_tracks_config_and_sources(self):
        p = TI.MoEGraphPass()
        base = p.uuid()
        self.assertEqual(TI.MoEGraphPass().uuid(), base)
        with TI.config.patch(fuse_quantize=False):
            self.assertNotEqual(p.uuid(), base)
        with tempfile.TemporaryDirectory() as d:
            extra = os.path.join(d, "lowering_v2.py")
            with open(extra, "w") as f:
                f.write("# changed\n")
            with mock.patch.object(P, "_SOURCES", (*P._SOURCES, extra)):
                self.assertNotEqual(p.uuid(), base)

    def test_enable_disable_keep_other_passes(self):
        import torch._inductor.config as inductor_config

        other = mock.MagicMock()
        with inductor_config.patch(joint_custom_post_pass=other, post_grad_custom_pre_pass=None):
            TI.enable()
            self.assertEqual(inductor_config.joint_custom_post_pass[0], other)
            self.assertIsInstance(inductor_config.joint_custom_post_pass[1], TI.MoEGraphPass)
            self.assertIsInstance(inductor_config.post_grad_custom_pre_pass, TI.MoEGraphPass)
            TI.enable()  # idempotent
            self.assertEqual(len(inductor_config.joint_custom_post_pass), 2)
            TI.disable()
            self.assertIs(inductor_config.joint_custom_post_pass, other)
            self.assertIsNone(inductor_config.post_grad_custom_pre_pass)
            with TI.enabled():
                self.assertIsInstance(inductor_config.post_grad_custom_pre_pass, TI.MoEGraphPass)
            self.assertIsNone(inductor_config.post_grad_custom_pre_pass)


class TestWeightCache(TestCase):
    def test_once_per_optimizer_step(self):
        """Gradient accumulation over 2 micro-batches, 2 optimizer steps: each expert weight
        is quantized (forward and dgrad layouts) once per step, and every result equals
        eager, which quantizes on every call."""
        torch._dynamo.reset()
        clear_weight_cache()
        eager = _layer("fp8_rowwise")
        moe = copy.deepcopy(eager)
        compiled = torch.compile(moe, backend=_backend({}), fullgraph=True)
        opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, moe)]
        gen = torch.Generator().manual_seed(2)
        for step in range(2):
            for m in (eager, moe):
                m.zero_grad(set_to_none=True)
            for _micro in range(2):
                x = torch.randn(16, D, generator=gen)
                x_ref, x_got = (x.clone().requires_grad_() for _ in range(2))
                ref = eager(x_ref)
                got = compiled(x_got)
                self.assertEqual(got, ref, **EXACT)
                ref.square().sum().backward()
                got.square().sum().backward()
                self.assertEqual(x_got.grad, x_ref.grad, **EXACT)
            for (n, p), q in zip(moe.named_parameters(), eager.parameters()):
                self.assertEqual(p.grad, q.grad, **EXACT, msg=f"step {step}: {n}")
            for opt in opts:
                opt.step()
            stats = weight_cache_stats()
            # 2 weights x 2 layouts: quantized on the first micro-batch, reused on the second
            self.assertEqual(stats, {"misses": 4 * (step + 1), "hits": 4 * (step + 1)})

    def test_cached_op_tracks_versions(self):
        clear_weight_cache()
        w = torch.randn(2, 8, 64)
        ops = torch.ops.torch_moe
        q1, s1 = ops.quantize_fp8_cached(w, w.transpose(-2, -1), [1, 32])
        q2, _ = ops.quantize_fp8_cached(w, w.transpose(-2, -1), [1, 32])
        self.assertIs(q1, q2)
        ref = ops.quantize_fp8(w.transpose(-2, -1), [1, 32])
        self.assertEqual(q1.view(torch.uint8), ref[0].view(torch.uint8), **EXACT)
        with torch.no_grad():
            w.mul_(2)  # in place: the version counter moves
        q3, s3 = ops.quantize_fp8_cached(w, w.transpose(-2, -1), [1, 32])
        self.assertEqual(s3, 2 * s1, **EXACT)
        # another layout of the same source is another entry
        ops.quantize_mx_cached(w, w, -1, 32, "floor")
        self.assertEqual(weight_cache_stats(), {"hits": 1, "misses": 3})
        del w, q1, q2, q3
        self.assertEqual(
            len(__import__("torch_moe.quantization.fused").quantization.fused._WEIGHT_CACHE), 0
        )


def _tiny(x, w, offs):
    return torch.ops.torch_moe.grouped_mm(x, w, offs)


def _combines(y, slot_to_row, row_to_slot, y2, weights):
    unweighted = torch.ops.torch_moe.unpermute(y, slot_to_row, row_to_slot, None)
    return unweighted, torch.ops.torch_moe.unpermute(y2, slot_to_row, row_to_slot, weights)


class TestInductor(TestCase):
    def test_inlined_combine_code(self):
        """Inductor with the passes: the unweighted combine is Inductor's own loop (no op
        call), bit for bit the op's CPU kernel (bf16 into fp32, fp32 rows whose sums round
        by the order of their terms, dropped slots); a weighted one stays the op."""
        torch._dynamo.reset()
        TI.reset_counters()
        fn = torch.compile(_combines, options=TI.options(), fullgraph=True, dynamic=False)
        gen = torch.Generator().manual_seed(3)
        cases = [(3, torch.bfloat16, False), (3, torch.bfloat16, True), (3, torch.float32, True)]
        with fresh_cache():  # the passes run (no FX graph cache hit)
            for top_k, dtype, drop in cases:
                ids = torch.stack([torch.randperm(6, generator=gen)[:top_k] for _ in range(11)])
                r2s, s2r, _, _ = torch.ops.torch_moe.permute_indices(ids, 6)
                if drop:  # dropped slots read no row
                    s2r = s2r.clone()
                    s2r[::2, 0] = -1
                # rows over 2^+-20: fp32 sums whose rounding depends on the order of the terms
                scale = torch.randint(-20, 21, (r2s.shape[0], 1), generator=gen).exp2()
                y = (torch.randn(r2s.shape[0], 40, generator=gen) * scale).to(dtype)
                w = torch.rand(11, top_k, generator=gen)
                args = (y, s2r, r2s, y.float(), w)
                got, codes = run_and_get_code(fn, *args)
                want = _combines(*args)
                self.assertEqual(got[0], want[0], **EXACT)
                self.assertEqual(got[1], want[1], **EXACT)
                if codes:  # a compile (not a call of the same shapes again)
                    FileCheck().check_count(
                        "torch.ops.torch_moe.unpermute.default(", 1, exactly=True
                    ).run(codes[0])
        self.assertEqual(TI.counters()["inline_combine"], 2)  # one per dtype compiled

    def test_fx_graph_cache_key(self):
        """With the passes the FX graph cache hits on a repeat compile and misses after a
        pass or lowering source changes; a plain callable pass makes it bypass."""
        x, w = torch.randn(10, 16), torch.randn(2, 16, 8)
        offs = torch.tensor([4, 10], dtype=torch.int32)
        with fresh_cache(), mock.patch.dict(os.environ, {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}):
            import torch._inductor.config as inductor_config

            def compile_once(opts):
                torch._dynamo.reset()
                counters.clear()
                fn = torch.compile(_tiny, options=opts)
                out, (code,) = run_and_get_code(fn, x, w, offs)
                self.assertEqual(out, _tiny(x, w, offs))
                return dict(counters["inductor"]), code

            with inductor_config.patch(fx_graph_cache=True):
                first, code = compile_once(TI.options())
                FileCheck().check("torch.ops.torch_moe.grouped_mm.default(").run(code)
                second, _ = compile_once(TI.options())
                self.assertEqual(first.get("fxgraph_cache_miss"), 1)
                self.assertEqual(second.get("fxgraph_cache_hit"), 1)
                with tempfile.TemporaryDirectory() as d:
                    changed = os.path.join(d, "passes_v2.py")
                    with open(changed, "w") as f:
                        f.write("# a changed pass\n")
                    with mock.patch.object(P, "_SOURCES", (*P._SOURCES, changed)):
                        third, _ = compile_once(TI.options())
                self.assertEqual(third.get("fxgraph_cache_miss"), 1)
                plain = {"post_grad_custom_pre_pass": lambda graph: None}
                fourth, _ = compile_once(plain)
                self.assertEqual(fourth.get("fxgraph_cache_bypass"), 1)

    def test_inlined_swiglu_code(self):
        """Inductor with ``inline_swiglu`` (the default): grouped_swiglu's forward and
        backward in bf16 run the grouped GEMM ops around Inductor's own activation loops
        (no grouped_swiglu op), and equal eager within bf16 rounding (the same fp32 math,
        rounded once)."""
        torch._dynamo.reset()
        offs, args, grad_y = _bf16_swiglu_inputs()

        def step(fn):
            leaves = [t.clone().requires_grad_() for t in args]
            y = fn(leaves[0], leaves[1], leaves[2], offs, leaves[3])[0]
            y.backward(grad_y)
            return [y.detach()] + [t.grad for t in leaves]

        compiled = torch.compile(
            torch.ops.torch_moe.grouped_swiglu, fullgraph=True, options=TI.options()
        )
        # native bf16 GEMMs and the ATen activation (where the CPU upcasts or the native
        # activation runs, the pass keeps the op: the next tests)
        with (
            TI.config.patch(inline_swiglu=True),
            _cpu_probe.force(half_gemm="native", act_kernel="aten"),
        ):
            got, (fwd, bwd) = run_and_get_code(lambda: step(compiled))
            want = step(torch.ops.torch_moe.grouped_swiglu)
        for g, w in zip(got, want):
            self.assertEqual(g, w, atol=2e-2, rtol=2e-2)
        # most outputs bit for bit; the rest one bf16 rounding step apart
        self.assertGreater((got[0] == want[0]).float().mean().item(), 0.9)
        ops = "torch.ops.torch_moe."
        for code in (fwd, bwd):
            FileCheck().check_not(f"{ops}grouped_swiglu").run(code)
        FileCheck().check_count(f"{ops}grouped_mm.default(", 2, exactly=True).run(fwd)
        FileCheck().check_count(f"{ops}grouped_mm_wgrad.default(", 2, exactly=True).run(bwd)

    def test_inline_swiglu_keeps_the_op_where_gemms_upcast(self):
        """Where this CPU multiplies bf16 in fp32, the op keeps the activation in fp32
        between its GEMMs; an inlined graph would round it to bf16 (more than one bf16
        step off eager), so the pass leaves the op: compiled equals eager bit for bit."""
        offs, args, grad_y = _bf16_swiglu_inputs()
        for half_gemm, inlined in (("fp32", 0), ("native", 2)):
            record, grads = _swiglu_loss_grads(
                args, offs, grad_y, half_gemm=half_gemm, act_kernel="aten"
            )
            self.assertEqual(record["counts"]["inline_swiglu"], inlined, msg=half_gemm)
            if not inlined:
                for got, want in zip(*grads, strict=True):
                    self.assertEqual(got, want, **EXACT)
        self.assertNotEqual(P.MoEGraphPass().uuid(), b"")
        with _cpu_probe.force(half_gemm="fp32"):
            upcast = P.MoEGraphPass().uuid()
        with _cpu_probe.force(half_gemm="native"):  # the FX graph cache tells them apart
            self.assertNotEqual(P.MoEGraphPass().uuid(), upcast)

    def test_inline_swiglu_keeps_native_act(self):
        """Where the op runs its activation by the native row kernels (the probe's
        act_kernel), the pass leaves the op, forward and backward: compiled equals eager
        bit for bit; with the ATen activation it inlines. The FX graph cache key tells the
        two apart."""
        if not P._native.available():
            self.skipTest("the native CPU kernels did not build here")
        offs, args, grad_y = _bf16_swiglu_inputs()
        uuids = []
        for act, inlined in (("native", 0), ("aten", 2)):
            decisions = dict(half_gemm="native", act_kernel=act)
            record, grads = _swiglu_loss_grads(args, offs, grad_y, **decisions)
            with _cpu_probe.force(**decisions):
                uuids.append(P.MoEGraphPass().uuid())
            self.assertEqual(record["counts"]["inline_swiglu"], inlined, msg=act)
            if not inlined:
                for got, want in zip(*grads, strict=True):
                    self.assertEqual(got, want, **EXACT)
        self.assertNotEqual(*uuids)

    def test_generated_code_fp8(self):
        """Inductor with the passes: the forward quantizes the tokens once (permute_quantize)
        and the activation with the SwiGLU, reads cached weights; the backward quantizes dY
        straight from the combine's gradient. ~15 s on 2 cores."""
        torch._dynamo.reset()
        clear_weight_cache()
        eager = _layer("fp8_rowwise")
        moe = copy.deepcopy(eager)
        compiled = torch.compile(moe, fullgraph=True, options=TI.options())
        x = torch.randn(16, D)
        grad_out = torch.randn(16, D)
        got, (fwd, bwd) = run_and_get_code(lambda: _run(compiled, x, grad_out))
        _assert_same(self, got, _run(eager, x, grad_out), atol=1e-5, rtol=1e-5)
        ops = "torch.ops.torch_moe."
        FileCheck().check(f"{ops}permute_quantize.default(").check(
            f"{ops}quantize_fp8_cached.default("
        ).check(f"{ops}scaled_grouped_mm.default(").check(f"{ops}swiglu_quantize.default(").run(fwd)
        # the combine inlined into Inductor's code (inline_combine)
        for op in ("permute", "swiglu", "unpermute"):
            FileCheck().check_not(f"{ops}{op}.default(").run(fwd)
        FileCheck().check(f"{ops}permute_quantize.default(tangents").run(bwd)
        for op in ("permute_quantize_jagged", "swiglu_quantize_jagged", "scaled_grouped_mm_wgrad"):
            FileCheck().check(f"{ops}{op}.default(").run(bwd)


def _ep_layer_graph(chunks=((0, 4),), escape=False, mutate=False, whole_weights=False):
    """The pre-grad shape of an expert-parallel layer (8 experts, 2 ranks, 4 local):
    dispatch -> chunk offsets -> expert_range slice of the weights -> a grouped GEMM ->
    combine, once per chunk, the combines added; symbolically traced (no process group:
    the pass only rewrites the graph). ``escape``: the received rows are also used after the
    combine; ``mutate``: an in-place op on the experts' output; ``whole_weights``: the
    experts read the weights without an ``expert_range`` slice."""
    ops = torch.ops.torch_moe

    def layer(x, row_w, counts, w):
        out = None
        for l0, l1 in chunks:
            recv = ops.ep_dispatch(x, row_w, counts, "0", 8, l0, l1, "p2p", 0, False)
            offs = ops.ep_chunk_offsets(counts, 8, 2, l0, l1)
            y = ops.grouped_mm(recv[0], w if whole_weights else w[l0:l1], offs)
            if mutate:
                y.mul_(2)
            part = ops.ep_combine(y, counts, "0", 8, l0, l1, "p2p", 0, 10)
            out = part if out is None else out + part
        return out + recv[0].sum() if escape else out

    gm = torch.fx.symbolic_trace(layer)
    for n in gm.graph.nodes:
        if n.name == "w":
            n.meta["example_value"] = torch.empty(4, 6, 6)  # [El, K, N]
    return gm.graph


def _bounds(graph, op, first):
    """(l0, l1) of each call of ``op`` in graph order (arguments first, first + 1)."""
    return [tuple(n.args[first : first + 2]) for n in graph.nodes if TI._fx.is_op(n, op)]


class TestEPChunkPass(TestCase):
    """The chunk pass on a graph (values: test_expert_parallel.py, on gloo)."""

    def setUp(self):
        TI.reset_counters()

    def test_splits_into_the_dispatchers_chunks(self):
        ops = torch.ops.torch_moe
        for C, expected in ((2, [(0, 2), (2, 4)]), (3, [(0, 1), (1, 2), (2, 4)])):
            graph = _ep_layer_graph()
            self.assertEqual(ep_chunk.split_layers(graph, C), 1)
            self.assertEqual(expected, chunk_bounds(0, 4, C))
            self.assertEqual(_bounds(graph, ops.ep_dispatch, 5), expected)
            self.assertEqual(_bounds(graph, ops.ep_chunk_offsets, 3), expected)
            self.assertEqual(_bounds(graph, ops.ep_combine, 4), expected)
            slices = [
                (n.args[1].start, n.args[1].stop)
                for n in graph.nodes
                if n.target is operator.getitem and isinstance(n.args[1], slice)
            ]
            self.assertEqual(slices, expected)
            # the combines added in chunk order, the sum is the output
            adds = [n for n in graph.nodes if n.target is operator.add]
            self.assertEqual(len(adds), C - 1)
            self.assertEqual(graph.output_node().args[0], adds[-1])
            self.assertEqual(
                adds[0].args, tuple(n for n in graph.nodes if TI._fx.is_op(n, ops.ep_combine))[:2]
            )
        self.assertEqual(TI.counters()["ep_chunks"], 2)

    def test_at_most_one_chunk_per_local_expert(self):
        graph = _ep_layer_graph()
        self.assertEqual(ep_chunk.split_layers(graph, 16), 1)
        got = _bounds(graph, torch.ops.torch_moe.ep_dispatch, 5)
        self.assertEqual(got, [(0, 1), (1, 2), (2, 3), (3, 4)])

    def test_leaves_alone(self):
        """Chunked already, or one chunk asked for: untouched and not counted as skipped;
        a region that leaks a value past the combine or mutates: untouched and counted."""
        for kwargs, C, skipped in (
            (dict(chunks=((0, 2), (2, 4))), 2, 0),
            ({}, 1, 0),
            (dict(escape=True), 2, 1),
            (dict(mutate=True), 2, 1),
            (dict(whole_weights=True), 2, 1),
        ):
            TI.reset_counters()
            graph = _ep_layer_graph(**kwargs)
            before = str(graph)
            self.assertEqual(ep_chunk.split_layers(graph, C), 0, msg=kwargs)
            self.assertEqual(str(graph), before)
            self.assertEqual(TI.counters()["ep_chunk_skipped"], skipped, msg=kwargs)

    def test_chunk_offsets_op(self):
        # E=8, R=2: send_E [8], recv_RL [2, 4], the two ranks' modes (not read here)
        counts = torch.tensor([3, 1, 0, 2, 4, 0, 1, 1, 2, 0, 5, 1, 3, 1, 0, 2, 257, 257])
        recv = counts[8:16].view(2, 4)
        for l0, l1 in ((0, 4), (1, 3), (3, 4)):
            want = recv[:, l0:l1].sum(0).cumsum(0).to(torch.int32)
            self.assertEqual(chunk_offsets(counts, 8, 2, l0, l1), want, **EXACT)
        torch.library.opcheck(torch.ops.torch_moe.ep_chunk_offsets.default, (counts, 8, 2, 1, 3))
        with self.assertRaisesRegex(ValueError, r"bad chunk \[2, 5\) of 4 local experts"):
            chunk_offsets(counts, 8, 2, 2, 5)
        with self.assertRaisesRegex(
            ValueError, r"num_experts \(8\) must be a multiple of world \(3\)"
        ):
            chunk_offsets(counts, 8, 3, 0, 1)
        with self.assertRaisesRegex(
            ValueError, r"expected counts to be 1D int64 \[2 \* num_experts \+ world = 10\]"
        ):
            chunk_offsets(counts, 4, 2, 0, 1)
        with self.assertRaisesRegex(ValueError, r"\[2 \* num_experts \+ world = 18\].*\[16\]"):
            chunk_offsets(counts[:16], 8, 2, 0, 1)

    def test_uuid_and_enable(self):
        import torch._inductor.config as inductor_config

        p = TI.EPChunkPass()
        base = p.uuid()
        with TI.config.patch(ep_chunks=2):
            self.assertNotEqual(p.uuid(), base)
            self.assertEqual(p.uuid(), TI.EPChunkPass(2).uuid())
        self.assertNotEqual(TI.EPChunkPass(3).uuid(), base)
        self.assertIsNone(TI.options()["pre_grad_custom_pass"].num_chunks)  # config's, late
        self.assertEqual(TI.options(ep_chunks=3)["pre_grad_custom_pass"].chunks(), 3)
        for bad in (0, 2.0, True):
            with self.assertRaisesRegex(ValueError, "num_chunks must be a positive int, got"):
                TI.EPChunkPass(bad)
        with TI.enabled():
            self.assertIsInstance(inductor_config.pre_grad_custom_pass, TI.EPChunkPass)


class TestPassesDevice(TestCase):
    """Device-generic (instantiate_device_type_tests): .ci/gpu runs it on cuda, where the
    recipes' fused ops run their Triton kernels (bf16 parameters, dims of 128)."""

    def _steps(self, compiled, eager, device, dim):
        gen = torch.Generator().manual_seed(1)
        results = []
        for num_tokens in (64, 40):
            x = torch.randn(num_tokens, dim, generator=gen).to(device, torch.bfloat16)
            g = torch.randn(num_tokens, dim, generator=gen).to(device, torch.bfloat16)
            results.append((_run(compiled, x, g), _run(eager, x, g)))
        return results

    @onlyCUDA
    @parametrize("precision", ["bf16", *RECIPES])
    def test_passes_bit_for_bit(self, device, precision):
        # the joint-graph passes (the fusions into permute / SwiGLU / the combine's backward,
        # the cached weight quantization) keep eager's values on the device's kernels too
        torch._dynamo.reset()
        clear_weight_cache()
        eager = _layer(precision, 128, device, torch.bfloat16)
        moe = copy.deepcopy(eager)
        record: dict = {}
        compiled = torch.compile(moe, backend=_backend(record), fullgraph=True)
        with TI.config.patch(inline_swiglu=False):
            for got, ref in self._steps(compiled, eager, device, 128):
                _assert_same(self, got, ref, **EXACT)
        if precision != "bf16":
            self.assertGreater(sum(record["counts"].values()), 0, msg=record["counts"])

    @onlyCUDA
    def test_generated_code_fp8(self, device):
        """Inductor with the passes on the device: the fused quantize ops in the code, the
        values within bf16 rounding of eager (Inductor's own kernels run the glue)."""
        torch._dynamo.reset()
        clear_weight_cache()
        eager = _layer("fp8_rowwise", 128, device, torch.bfloat16)
        moe = copy.deepcopy(eager)
        compiled = torch.compile(moe, fullgraph=True, options=TI.options())
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(64, 128, generator=gen).to(device, torch.bfloat16)
        g = torch.randn(64, 128, generator=gen).to(device, torch.bfloat16)
        got, (fwd, bwd) = run_and_get_code(lambda: _run(compiled, x, g))
        ref = _run(eager, x, g)
        # NB (tolerance): bf16 outputs and gradients whose glue Inductor fuses and rounds
        # in another order; a wrong fusion is O(1) off
        _assert_same(self, got, ref, atol=5e-2, rtol=5e-2)
        ops_ = "torch.ops.torch_moe."
        FileCheck().check(f"{ops_}permute_quantize.default(").check(
            f"{ops_}scaled_grouped_mm.default("
        ).check(f"{ops_}swiglu_quantize.default(").run(fwd)
        for op in ("permute_quantize_jagged", "swiglu_quantize_jagged", "scaled_grouped_mm_wgrad"):
            FileCheck().check(f"{ops_}{op}.default(").run(bwd)


instantiate_parametrized_tests(TestPasses)
instantiate_device_type_tests(TestPassesDevice, globals())

if __name__ == "__main__":
    run_tests()
