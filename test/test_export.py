"""torch.export (non-strict; strict for one layer) and AOTInductor of the MoE layer: the
exported program of every expert kind and precision equals the eager layer bit for bit at token counts it was not traced at
(its token dim a ``Dim``), in training (the load statistics counted the same), in eval
with autograd, and under ``no_grad`` (the inference path); it saves and loads
(``torch.export.save`` / ``load``), keeps the ``torch_moe::`` ops whole through
``run_decompositions`` (the buffer updates become the program's buffer mutations), and
compiles ahead of time (``aoti_compile_and_package``) with torch_moe's Inductor passes.

Exact comparisons: an exported program runs the same op kernels as eager; AOTInductor's
code differs from eager only where the passes inline the combine (a recipe's graph; without
one the routed experts are one op, ``routed_swiglu``), which keeps the CPU kernel's sum
order (``torch_moe/_inductor/passes.py``), and the tests check that the SwiGLU, the one
rewrite that is not bit for bit, was not inlined in those graphs.
"""

from __future__ import annotations

import copy
import io
import shutil
import tempfile
from contextlib import nullcontext
from pathlib import Path

import naive
import torch
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe._inductor as TI
from torch_moe.nn import MoE

EXACT = dict(atol=0, rtol=0)
D = 64  # the layers without a recipe (the recipes' take 128: the FP8 blockwise blocks)
TRACED_T, CHECKED_T = 24, (1, 7, 33)  # the token counts run are not the traced one

# name -> layer factory; each exercises a different router / experts / precision path
CONFIGS = {
    "mixtral": lambda: MoE.from_preset("mixtral", dim=D, hidden_dim=96, num_experts=8),
    # sigmoid scores, group-limited routing, a selection bias, a shared expert
    "deepseek-v3": lambda: MoE.from_preset(
        "deepseek-v3", dim=D, hidden_dim=32, num_experts=16, expert_bias=True
    ),
    # GPT-OSS's block: swigluoai, interleaved gate / up rows, expert and router biases
    "gpt-oss": lambda: MoE(D, 32, 8, 2, **naive.GPT_OSS),
    # Nemotron-H's: ungated squared ReLU with biases
    "relu2": lambda: MoE(D, 32, 8, 2, **naive.NEMOTRON_H),
    "capacity": lambda: MoE(D, 32, 8, 2, capacity_factor=1.0),
    "losses": lambda: MoE(D, 32, 8, 2, aux_loss="sequence", aux_loss_coeff=0.01, z_loss_coeff=1e-3),
    "fp8_rowwise": lambda: MoE(128, 128, 8, 2, precision="fp8_rowwise"),
    "fp8_blockwise": lambda: MoE(128, 128, 8, 2, precision="fp8_blockwise"),
    "mxfp8": lambda: MoE(128, 128, 8, 2, precision="mxfp8"),
}
MODES = ("train", "eval", "no_grad")


def _layer(name: str, mode: str) -> MoE:
    torch.manual_seed(0)
    moe = CONFIGS[name]()
    return moe.train(mode == "train")


def _grad_mode(mode: str):
    return torch.no_grad() if mode == "no_grad" else nullcontext()


def _export(
    moe: MoE, mode: str, tokens_dim: int = 1, strict: bool = False
) -> torch.export.ExportedProgram:
    shape = [2, TRACED_T, moe.dim] if tokens_dim == 1 else [TRACED_T, moe.dim]
    x = torch.randn(shape)
    tokens = torch.export.Dim("tokens", min=1, max=1 << 16)
    with _grad_mode(mode):
        return torch.export.export(moe, (x,), dynamic_shapes=({tokens_dim: tokens},), strict=strict)


def _inputs(dim: int, seed: int, tokens_dim: int = 1):
    gen = torch.Generator().manual_seed(seed)
    for t in CHECKED_T:
        yield torch.randn([2, t, dim] if tokens_dim == 1 else [t, dim], generator=gen)


def torch_moe_ops(gm: torch.fx.GraphModule) -> set[str]:
    """The torch_moe ops called anywhere in ``gm`` (submodules of higher-order ops too; a
    mutating op by the ``auto_functionalized`` node that functionalization wraps it in)."""
    found = set()
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.target
            if isinstance(target, torch._ops.HigherOrderOperator) and node.args:
                target = node.args[0]
            if str(target).startswith("torch_moe."):
                found.add(str(target))
    return found


class TestExport(TestCase):
    def _check_runs(self, run, ref: MoE, mode: str, got_buffers=None, tokens_dim: int = 1):
        """``run`` (an exported module) against the eager layer ``ref`` over CHECKED_T:
        outputs bitwise, and the load statistics the same after each call."""
        for i, x in enumerate(_inputs(ref.dim, seed=1, tokens_dim=tokens_dim)):
            with _grad_mode(mode):
                want = ref(x)
                got = run(x)
            self.assertEqual(got, want, **EXACT, msg=f"call {i}, {list(x.shape)}")
            if got_buffers is not None:
                # the program's buffers: every one of the layer's (a strict export lifts
                # only those its graph reads)
                buffers = got_buffers()
                want_buffers = dict(ref.named_buffers())
                self.assertLessEqual(set(buffers), set(want_buffers))
                for name, b in buffers.items():
                    self.assertEqual(b, want_buffers[name], **EXACT, msg=f"call {i}: {name}")

    @parametrize("mode", MODES)
    @parametrize("name", list(CONFIGS))
    def test_matches_eager(self, name, mode):
        moe = _layer(name, mode)
        ref = copy.deepcopy(moe)
        ep = _export(moe, mode)
        self.assertIn("torch_moe.router_logits.default", torch_moe_ops(ep.graph_module))
        module = ep.module()
        # the exported module updates its own buffers (the layer's, lifted) as eager does
        self.assertEqual(set(dict(module.named_buffers())), set(dict(ref.named_buffers())))
        self._check_runs(module, ref, mode, lambda: dict(module.named_buffers()))
        if mode == "train":
            self.assertGreater(int(ref.tokens_per_expert.sum()), 0)

    @parametrize("mode", ("train", "no_grad"))
    def test_strict(self, mode):
        """``strict=True`` (Dynamo traces the layer, as ``torch.compile`` does) too."""
        moe = _layer("deepseek-v3", mode)
        ref = copy.deepcopy(moe)
        module = _export(moe, mode, strict=True).module()
        self._check_runs(module, ref, mode, lambda: dict(module.named_buffers()))
        if mode == "train":  # the statistics are counted in the program
            self.assertIn("tokens_per_expert", dict(module.named_buffers()))
            self.assertGreater(int(ref.tokens_per_expert.sum()), 0)

    def test_tokens_first_input(self):
        """A [T, D] input with T dynamic, as a decoder layer flattens it."""
        moe = _layer("deepseek-v3", "no_grad")
        ref = copy.deepcopy(moe)
        ep = _export(moe, "no_grad", tokens_dim=0)
        self._check_runs(ep.module(), ref, "no_grad", tokens_dim=0)

    @parametrize("mode", ("train", "no_grad"))
    def test_save_load(self, mode):
        """A saved program loads back and runs as the layer does. In training the aux and
        z losses' logging copies are buffer updates: a ``no_grad`` block there became a
        subgraph of no outputs, which ``torch.export.load`` refused (a missing ``val``)."""
        moe = _layer("losses", mode)
        ref = copy.deepcopy(moe)
        buf = io.BytesIO()
        torch.export.save(_export(moe, mode), buf)
        buf.seek(0)
        loaded = torch.export.load(buf)
        self.assertIn("torch_moe.topk_route.default", torch_moe_ops(loaded.graph_module))
        module = loaded.module()
        self._check_runs(module, ref, mode, lambda: dict(module.named_buffers()))

    def test_run_decompositions(self):
        """Core ATen decompositions leave the torch_moe ops whole (each has its own kernels
        and fake kernel, no decomposition), and the training program's in-place updates
        of the load statistics and the losses' logging copies become buffer mutations."""
        moe = _layer("losses", "train")
        ref = copy.deepcopy(moe)
        ep = _export(moe, "train").run_decompositions()
        ops = torch_moe_ops(ep.graph_module)
        for op in ("router_logits", "topk_route", "permute_indices", "add_load_counts"):
            self.assertIn(f"torch_moe.{op}.default", ops)
        mutated = set(ep.graph_signature.buffers_to_mutate.values())
        self.assertEqual(
            mutated,
            {"tokens_per_expert", "dropped_assignments", "last_aux_loss", "last_z_loss"},
        )
        module = ep.module()
        self._check_runs(module, ref, "train", lambda: dict(module.named_buffers()))


@instantiate_parametrized_tests
class TestAOTInductor(TestCase):
    def setUp(self):
        if shutil.which("c++") is None and shutil.which("g++") is None:
            self.skipTest("AOTInductor needs a C++ compiler")

    @parametrize("precision", ("bf16", "fp8_rowwise"))
    def test_package_matches_eager(self, precision):
        """A bf16 Qwen3-like block under ``no_grad`` compiled ahead of time with the passes,
        loaded from its package, equals the eager layer at other token counts, decode's
        single token included. Without a recipe the routed experts are one op
        (``routed_swiglu``, eager's step at run time); with one, the grouped GEMM ops and
        the combine inlined into Inductor's loop."""
        torch.manual_seed(0)
        moe = MoE.from_preset(
            "qwen3-moe", dim=128, hidden_dim=128, num_experts=16, precision=precision
        )
        moe = moe.to(torch.bfloat16).eval()
        ref = copy.deepcopy(moe)
        x = torch.randn(2, TRACED_T, 128, dtype=torch.bfloat16)
        tokens = torch.export.Dim("tokens", min=1, max=1 << 16)
        with torch.no_grad():
            ep = torch.export.export(moe, (x,), dynamic_shapes=({1: tokens},))
        TI.reset_counters()
        with tempfile.TemporaryDirectory() as tmp, TI.enabled():
            path = torch._inductor.aoti_compile_and_package(
                ep, package_path=str(Path(tmp) / "moe.pt2")
            )
            compiled = torch._inductor.aoti_load_package(path)
        counts = TI.counters()
        one_op = "torch_moe.routed_swiglu.default" in torch_moe_ops(ep.graph_module)
        self.assertEqual(one_op, precision == "bf16")
        self.assertEqual(counts["inline_combine"], 0 if one_op else 1)
        self.assertEqual(counts["inline_swiglu"], 0)
        gen = torch.Generator().manual_seed(1)
        for t in (1, 5, 300):
            x = torch.randn(2, t, 128, generator=gen).to(torch.bfloat16)
            with torch.inference_mode():
                self.assertEqual(compiled(x), ref(x), **EXACT, msg=f"T={t}")


instantiate_parametrized_tests(TestExport)

if __name__ == "__main__":
    run_tests()
