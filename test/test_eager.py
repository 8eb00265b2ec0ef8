# Owner(s): ["module: moe"]
"""The ops' direct eager calls (``torch_moe/_ops/_eager.py``).

On plain CPU tensors in eager mode every wrapped op runs its CPU kernel and autograd
formula without the op's Python layers: the outputs, the gradients of every input and the
tensors saved for the backward must be the op's, bit for bit (both ways on the same
inputs, edge cases and a hypothesis fuzz of grouped_swiglu included), and the op must not
be called at all. Everything the layers exist for takes the op: torch.compile, FakeTensor
and other dispatch modes, torch function modes, functorch transforms, TorchScript tracing,
tensor subclasses, other devices, ``ENABLED = False``. A profiler still sees each op's
name; keyword and defaulted arguments bind as the op binds them."""

import contextlib
import copy
import importlib
import os
import subprocess
import sys
import unittest
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cpu_probe import intra_op_threads
from torch._dynamo.testing import EagerAndRecordGraphs
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)
from torch.utils._python_dispatch import TorchDispatchMode

from torch_moe import ops
from torch_moe._ops import _cpu_probe, _eager, _native, routing
from torch_moe._ops import glu as glu_mod
from torch_moe._ops import grouped_mm as gmm
from torch_moe._ops import grouped_swiglu as gs
from torch_moe._ops import permute as perm
from torch_moe.nn import MoE
from torch_moe.quantization import ops as qops

BF16, F32 = torch.bfloat16, torch.float32
# (the module: the package's name of the same spelling is its public function)
sgm = importlib.import_module("torch_moe.quantization.scaled_grouped_mm")
# the FP8 / MX ops' direct wrappers: every one an FP8 / MX layer step calls
FP8_DIRECT = (
    sgm.quantized_grouped_mm,
    sgm.quantized_grouped_mm_dgrad,
    sgm.quantized_grouped_mm_wgrad,
    sgm._scaled_grouped_mm,
    sgm._scaled_grouped_mm_wgrad,
    qops._quantize_fp8,
    qops._quantize_mx,
    qops._quantize_jagged,
)


@contextlib.contextmanager
def op_path() -> Iterator[None]:
    """Every call through the op (the dispatcher and its Python layers)."""
    with mock.patch.object(_eager, "ENABLED", False):
        yield


@contextlib.contextmanager
def op_never_called(*wrapped: _eager.DirectOp) -> Iterator[None]:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the op was called on the direct path")

    with contextlib.ExitStack() as stack:
        for w in wrapped:
            stack.enter_context(mock.patch.object(w, "op", refuse))
        yield


def _routing(tokens: int, experts: int, top_k: int, seed: int, skew: bool = False) -> Any:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    if skew:  # most tokens on expert 0, some experts empty
        logits[:, 0] += 4.0
    ids = logits.topk(top_k, dim=-1).indices
    return ops.permute_indices(ids, experts), ids


def _case(name: str, seed: int, tokens: int = 13, skew: bool = False) -> tuple[Callable, list]:
    """(call, inputs): ``call(*inputs)`` runs one wrapped op; the float inputs that
    require grad are the ones whose gradients are compared."""
    g = torch.Generator().manual_seed(seed)
    experts, top_k, dim, hidden = 5, 2, 24, 20
    p, ids = _routing(tokens, experts, top_k, seed, skew)
    rows = tokens * top_k

    def rand(*shape: int, dtype: torch.dtype = BF16, grad: bool = True) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.5).to(dtype).requires_grad_(grad)

    w_tk = torch.rand(tokens, top_k, generator=g).requires_grad_()
    rw = torch.rand(rows, generator=g).requires_grad_()
    if name == "permute_indices":
        return (lambda i: perm.permute_indices(i, experts, 1, None)), [ids]
    if name == "permute":
        return (lambda x, w: perm.permute(x, p.row_to_slot, p.slot_to_row, w)), [
            rand(tokens, dim, dtype=F32),
            w_tk,
        ]
    if name == "unpermute":
        return (lambda y, w: perm.unpermute(y, p.slot_to_row, p.row_to_slot, w)), [
            rand(rows, dim),
            w_tk,
        ]
    if name == "unpermute_unweighted":
        return (lambda y: perm.unpermute(y, p.slot_to_row, p.row_to_slot)), [rand(rows, dim)]
    if name == "weighted_row_dot":
        return (lambda y, x: perm.weighted_row_dot(y, x, p.slot_to_row)), [
            rand(rows, dim, grad=False),
            rand(tokens, dim, grad=False),
        ]
    if name == "grouped_swiglu":
        return (
            lambda x, w13, w2, r: gs.grouped_swiglu(
                x, w13, w2, p.offs, r, None, p.row_to_slot, p.slot_to_row
            )
        ), [rand(tokens, dim), rand(experts, 2 * hidden, dim), rand(experts, dim, hidden), rw]
    if name == "grouped_swiglu_permuted":
        return (lambda x, w13, w2: gs.grouped_swiglu(x, w13, w2, p.offs)), [
            rand(rows, dim),
            rand(experts, 2 * hidden, dim),
            rand(experts, dim, hidden),
        ]
    if name == "swiglu":
        return (lambda h, r: gs.swiglu(h, r)), [rand(rows, 2 * hidden), rw]
    if name == "grouped_mm":
        return (lambda x, w: gmm.grouped_mm(x, w, p.offs)), [
            rand(rows, dim),
            rand(experts, hidden, dim).transpose(-2, -1).detach().requires_grad_(),
        ]
    if name == "grouped_mm_wgrad":
        return (lambda x, dy: gmm.grouped_mm_wgrad(x, dy, p.offs)), [
            rand(rows, dim, grad=False),
            rand(rows, hidden, grad=False),
        ]
    if name == "gather_grouped_mm":
        return (lambda x, w: gmm.gather_grouped_mm(x, w, p.offs, p.row_to_slot, p.slot_to_row)), [
            rand(tokens, dim),
            rand(experts, dim, 2 * hidden),
        ]
    if name == "gather_grouped_mm_parameter":  # an HF module's transposed weight, as it is
        return (lambda x, w: gmm.gather_grouped_mm(x, w, p.offs, p.row_to_slot, p.slot_to_row)), [
            rand(tokens, dim),
            torch.nn.Parameter(rand(experts, dim, 2 * hidden, grad=False)),
        ]
    if name == "topk_route":  # softmax, normalized and scaled weights
        return (lambda lg: routing.topk_route(lg, top_k, "softmax", None, None, None, True, 2.5)), [
            rand(tokens, experts, dtype=F32)
        ]
    if name == "topk_route_grouped":  # bf16 logits, sigmoid, selection bias, limited groups
        bias = torch.randn(experts, generator=g)
        return (
            lambda lg: routing.topk_route(lg, top_k, "sigmoid", bias, experts, 3, True, 1.0, "max")
        ), [rand(tokens, experts)]
    if name == "glu":
        return (lambda h, r: glu_mod.glu(h, r, "swigluoai", 1.702, 7.0, True)), [
            rand(rows, 2 * hidden),
            rw,
        ]
    if name.startswith("quantized_grouped_mm_"):  # a recipe's GEMMs: forward, dgrad, wgrad
        recipe = name.removeprefix("quantized_grouped_mm_")
        d, h = (32, 64) if recipe == "mxfp8" else (dim, hidden)  # (MX: multiples of 32)
        return (lambda x, w: sgm.scaled_grouped_mm(x, w, p.offs, recipe)), [
            rand(rows, d),
            rand(experts, d, h),
        ]
    if name == "quantize_fp8":
        return (lambda x: tuple(qops.quantize_fp8(x, (1, 8)))), [rand(rows, dim, grad=False)]
    if name == "quantize_mx":
        return (lambda x: tuple(qops.quantize_mx(x, dim=-1, block=32))), [
            rand(rows, 64, grad=False)
        ]
    if name == "quantize_jagged":
        return (lambda x: tuple(qops.quantize_jagged(x, p.offs, block=4))), [
            rand(rows, dim, grad=False)
        ]
    raise AssertionError(name)


CASES = [
    "permute_indices",
    "permute",
    "unpermute",
    "unpermute_unweighted",
    "weighted_row_dot",
    "grouped_swiglu",
    "grouped_swiglu_permuted",
    "swiglu",
    "grouped_mm",
    "grouped_mm_wgrad",
    "gather_grouped_mm",
    "gather_grouped_mm_parameter",
    "glu",
    "topk_route",
    "topk_route_grouped",
    "quantized_grouped_mm_fp8_tensorwise",
    "quantized_grouped_mm_fp8_rowwise",
    "quantized_grouped_mm_fp8_blockwise",
    "quantized_grouped_mm_mxfp8",
    "quantize_fp8",
    "quantize_mx",
    "quantize_jagged",
]


def _run(call: Callable, inputs: list) -> tuple[list, list, int]:
    """Outputs, the gradients of the inputs that require grad (a fixed random cotangent
    per float output), and the bytes autograd saved for the backward."""
    inputs = [
        torch.nn.Parameter(t.detach())
        if isinstance(t, torch.nn.Parameter)
        else t.detach().requires_grad_(t.requires_grad)
        for t in inputs
    ]
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call(*inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    diff = [o for o in outs if o.requires_grad]
    if diff:
        g = torch.Generator().manual_seed(7)
        cot = [torch.randn(o.shape, generator=g).to(o.dtype) for o in diff]
        torch.autograd.backward(diff, cot)
    grads = [t.grad for t in inputs if t.requires_grad]
    return outs, grads, sum(saved)


class TestDirectCalls(TestCase):
    def setUp(self) -> None:
        super().setUp()
        self.enterContext(mock.patch.object(_eager, "ENABLED", True))  # even if the env says 0

    def assert_bitwise(self, a: list, b: list) -> None:
        self.assertEqual(len(a), len(b))
        for x, y in zip(a, b):
            if x is None or y is None:
                self.assertIs(x, y)
                continue
            self.assertEqual(x.dtype, y.dtype)
            self.assertEqual(x.shape, y.shape)
            if x.dtype == torch.float8_e4m3fn:  # (no comparisons of e4m3: its bits)
                x, y = x.view(torch.uint8), y.view(torch.uint8)
            self.assertTrue(torch.equal(x, y), "differs from the op's result")

    def assert_direct_is_the_op(
        self, call: Callable, inputs: list, *wrapped: _eager.DirectOp
    ) -> None:
        """``call(*inputs)``'s outputs, gradients and saved bytes, each wrapped op called
        directly (never the op), bit for bit those of every call through the ops."""
        with op_path():
            ref_out, ref_grads, ref_saved = _run(call, inputs)
        with op_never_called(*wrapped):
            out, grads, saved = _run(call, inputs)
        self.assert_bitwise(out, ref_out)
        self.assert_bitwise(grads, ref_grads)
        self.assertEqual(saved, ref_saved)

    @parametrize("name", CASES)
    @parametrize("tokens,skew", [(13, False), (29, True), (1, False)])
    def test_same_as_the_op(self, name: str, tokens: int, skew: bool) -> None:
        call, inputs = _case(name, seed=tokens, tokens=tokens, skew=skew)
        wrapped = [
            perm.permute_indices,
            perm.permute,
            perm.unpermute,
            perm.weighted_row_dot,
            gs.grouped_swiglu,
            gs.grouped_swiglu_backward,
            gs.swiglu,
            gs.swiglu_backward,
            gmm.grouped_mm,
            gmm.grouped_mm_wgrad,
            gmm.gather_grouped_mm,
            glu_mod.glu,
            glu_mod.glu_backward,
            routing.topk_route,
            routing.topk_route_backward,
            *FP8_DIRECT,
        ]
        self.assert_direct_is_the_op(call, inputs, *wrapped)

    def test_no_tokens(self) -> None:
        p = ops.permute_indices(torch.empty(0, 2, dtype=torch.long), 4)
        x = torch.randn(0, 8, requires_grad=True)
        w13 = torch.randn(4, 6, 8, requires_grad=True)
        w2 = torch.randn(4, 8, 3, requires_grad=True)
        with op_never_called(gs.grouped_swiglu):
            y, _h = gs.grouped_swiglu(x, w13, w2, p.offs, None, None, p.row_to_slot, p.slot_to_row)
            y.sum().backward()
        self.assertEqual(y.shape, (0, 8))
        self.assertEqual(w13.grad, torch.zeros_like(w13))

    @settings(max_examples=25, deadline=None)
    @given(
        tokens=st.integers(0, 40),
        experts=st.integers(1, 7),
        top_k=st.integers(1, 3),
        seed=st.integers(0, 2**16),
        weighted=st.booleans(),
    )
    def test_grouped_swiglu_fuzz(
        self, tokens: int, experts: int, top_k: int, seed: int, weighted: bool
    ) -> None:
        top_k = min(top_k, experts)
        g = torch.Generator().manual_seed(seed)
        ids = torch.rand(tokens, experts, generator=g).pow(3).topk(top_k, dim=-1).indices
        p = ops.permute_indices(ids, experts)
        inputs = [
            torch.randn(tokens, 16, generator=g).to(BF16).requires_grad_(),
            (torch.randn(experts, 2 * 12, 16, generator=g) * 0.3).to(BF16).requires_grad_(),
            (torch.randn(experts, 16, 12, generator=g) * 0.3).to(BF16).requires_grad_(),
            torch.rand(tokens * top_k, generator=g).requires_grad_(weighted),
        ]

        def call(x: Any, w13: Any, w2: Any, rw: Any) -> Any:
            y, _h = gs.grouped_swiglu(
                x, w13, w2, p.offs, rw if weighted else None, None, p.row_to_slot, p.slot_to_row
            )
            return ops.unpermute(y, None, p)

        self.assert_direct_is_the_op(call, inputs, gs.grouped_swiglu, perm.unpermute)

    @settings(max_examples=25, deadline=None)
    @given(
        rows=st.integers(0, 40),
        experts=st.integers(1, 6),
        recipe=st.sampled_from(["fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8"]),
        dims=st.sampled_from([(8, 24), (40, 17), (32, 64), (160, 32)]),
        transposed=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def test_quantized_grouped_mm_fuzz(
        self,
        rows: int,
        experts: int,
        recipe: str,
        dims: tuple[int, int],
        transposed: bool,
        seed: int,
    ) -> None:
        # a recipe's forward, dgrad and wgrad on odd group sizes (empty groups, one row,
        # rows past the last group), odd dims (MX: multiples of 32) and weights stored as
        # x @ w^T's: the direct calls' values, gradients and saved bytes are the ops'
        k, n = dims
        if recipe == "mxfp8" and (k % 32 or n % 32):
            k, n = 32 * -(-k // 32), 32 * -(-n // 32)
        g = torch.Generator().manual_seed(seed)
        ends = torch.randint(0, rows + 1, (experts,), generator=g).sort().values
        offs = ends.to(torch.int32)
        w = torch.randn(experts, n, k, generator=g).transpose(-2, -1) if transposed else None
        inputs = [
            torch.randn(rows, k, generator=g).to(BF16).requires_grad_(),
            (w if w is not None else torch.randn(experts, k, n, generator=g))
            .to(BF16)
            .requires_grad_(),
        ]

        def call(x: Any, w: Any) -> Any:
            return sgm.scaled_grouped_mm(x, w, offs, recipe)

        self.assert_direct_is_the_op(
            call, inputs, sgm.quantized_grouped_mm, sgm.quantized_grouped_mm_dgrad
        )

    def test_keywords_and_defaults_bind_as_the_op(self) -> None:
        _call, (y, _w) = _case("unpermute", seed=3)
        p, _ = _routing(13, 5, 2, 3)
        with op_path():
            ref = perm.unpermute(y, p.slot_to_row, p.row_to_slot, None)
        with op_never_called(perm.unpermute):
            kw = perm.unpermute(y, row_to_slot=p.row_to_slot, slot_to_row=p.slot_to_row)
            short = perm.unpermute(y, p.slot_to_row, p.row_to_slot)
        self.assertTrue(torch.equal(kw, ref) and torch.equal(short, ref))
        short.float().sum().backward()  # the autograd formula saw every (defaulted) input
        self.assertEqual(y.grad.shape, y.shape)
        # keywords after a skipped defaulted argument (row_weights, gather_index)
        x, w13, w2 = torch.randn(13, 8), torch.randn(5, 6, 8), torch.randn(5, 8, 3)
        with op_path():
            ref_y, _ = gs.grouped_swiglu(
                x, w13, w2, p.offs, None, None, p.row_to_slot, p.slot_to_row
            )
        with op_never_called(gs.grouped_swiglu):
            y, _ = gs.grouped_swiglu(
                x, w13, w2, p.offs, row_to_slot=p.row_to_slot, slot_to_row=p.slot_to_row
            )
        self.assertTrue(torch.equal(y, ref_y))

    def test_a_missing_argument_is_refused_by_the_op(self) -> None:
        y = torch.randn(4, 3)
        for enabled in (True, False):
            with mock.patch.object(_eager, "ENABLED", enabled):
                with self.assertRaisesRegex(
                    RuntimeError, "missing value for argument .slot_to_row."
                ):
                    perm.unpermute(y)

    def test_environment_turns_it_off(self) -> None:
        code = "import torch_moe._ops._eager as e; print(e.ENABLED)"
        for value, want in (("0", "False"), ("1", "True")):
            env = {**os.environ, "TORCH_MOE_DIRECT_OPS": value}
            out = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            )
            self.assertEqual(out.stdout.strip(), want)

    def test_an_op_without_autograd_takes_the_op_for_a_gradient(self) -> None:
        rows, tokens = torch.randn(6, 4, requires_grad=True), torch.randn(3, 4)
        s2r = torch.arange(6).view(3, 2)
        calls: list[int] = []
        real = perm.weighted_row_dot.op

        def op(*args: Any) -> Any:
            calls.append(1)
            return real(*args)

        with mock.patch.object(perm.weighted_row_dot, "op", op):
            perm.weighted_row_dot(rows, tokens, s2r)
            self.assertEqual(calls, [1])
            with torch.no_grad():
                perm.weighted_row_dot(rows, tokens, s2r)
            self.assertEqual(calls, [1])

    def test_errors_are_the_kernels(self) -> None:
        x, w, dy = torch.randn(6, 4), torch.randn(2, 4, 3), torch.randn(6, 3)
        bad = torch.tensor([4, 9], dtype=torch.int32)
        for enabled in (True, False):
            with mock.patch.object(_eager, "ENABLED", enabled):
                with self.assertRaisesRegex(ValueError, r"^grouped_mm: offs .* got offs=\[4, 9\]"):
                    gmm.grouped_mm(x, w, bad)
                with self.assertRaisesRegex(ValueError, r"^grouped_mm_wgrad: offs .*M \(6\)"):
                    gmm.grouped_mm_wgrad(x, dy, bad)

    def test_profiler_sees_the_op_name(self) -> None:
        call, inputs = _case("grouped_swiglu", seed=1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with op_never_called(gs.grouped_swiglu):
                _run(call, inputs)
        names = {e.name for e in prof.events()}
        self.assertIn("torch_moe::grouped_swiglu", names)

    def test_attributes_are_the_ops(self) -> None:
        self.assertIs(perm.unpermute.register_fake.__self__, perm.unpermute.op)
        self.assertEqual(perm.unpermute.name, "torch_moe::unpermute")


class TestTakesTheOp(TestCase):
    """Where the op's layers matter, :func:`_eager.direct` says no."""

    def setUp(self) -> None:
        super().setUp()
        self.enterContext(mock.patch.object(_eager, "ENABLED", True))  # even if the env says 0

    def test_plain_cpu_tensors(self) -> None:
        self.assertTrue(_eager.direct((torch.ones(2), 3, None, "x")))

    def test_disabled(self) -> None:
        with op_path():
            self.assertFalse(_eager.direct((torch.ones(2),)))

    def test_other_devices_and_subclasses(self) -> None:
        self.assertFalse(_eager.direct((torch.ones(2), torch.ones(2, device="meta"))))

        class Sub(torch.Tensor):  # a subclass that sees torch functions, as DTensor does
            pass

        self.assertFalse(_eager.direct((torch.ones(2).as_subclass(Sub),)))
        self.assertFalse(_eager.direct((torch.nn.Parameter(torch.ones(2, device="meta")),)))
        # a Parameter overrides no torch function: an HF module's weight passed as it is
        self.assertTrue(_eager.direct((torch.nn.Parameter(torch.ones(2)), torch.ones(2))))

    def test_dispatch_and_function_modes(self) -> None:
        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                return func(*args, **(kwargs or {}))

        with Mode():
            self.assertFalse(_eager.direct((torch.ones(2),)))
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            self.assertFalse(_eager.direct(()))
        with torch.overrides.TorchFunctionMode():
            self.assertFalse(_eager.direct(()))

    def test_functorch_and_jit_tracing(self) -> None:
        seen: list[bool] = []

        def f(t: torch.Tensor) -> torch.Tensor:
            seen.append(_eager.direct((t,)))
            return t * 2

        torch.vmap(f)(torch.ones(3, 2))
        torch.func.grad(lambda t: f(t).sum())(torch.ones(2))
        torch.jit.trace(f, (torch.ones(2),), check_trace=False)
        self.assertEqual(seen, [False, False, False])

    def test_fake_tensors_reach_the_fake_kernel(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            x = torch.empty(7, 4)
            w = torch.empty(3, 4, 5)
            offs = torch.tensor([2, 5, 7], dtype=torch.int32)
            out = gmm.grouped_mm(x, w, offs)
        self.assertEqual(out.shape, (7, 5))

    def test_compiled_graph_keeps_the_ops(self) -> None:
        p, _ = _routing(9, 4, 2, 0)

        def f(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
            y, _h = gs.grouped_swiglu(x, w13, w2, p.offs, None, None, p.row_to_slot, p.slot_to_row)
            return ops.unpermute(y, None, p)

        x, w13, w2 = torch.randn(9, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3)
        _compiled_keeps_the_ops(self, f, x, w13, w2)


def _compiled_keeps_the_ops(test: TestCase, f: Callable, *args: torch.Tensor) -> Callable:
    """``f`` compiled (fullgraph, a backend counting the graph's targets): the same values
    as eager, and grouped_swiglu and unpermute in the graph. Returns the compiled ``f``."""
    counts: dict[str, int] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        for node in gm.graph.nodes:
            counts[str(node.target)] = counts.get(str(node.target), 0) + 1
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    test.assertTrue(torch.equal(compiled(*args), f(*args)))
    test.assertIn("torch_moe.grouped_swiglu.default", counts)
    test.assertIn("torch_moe.unpermute.default", counts)
    return compiled


def _combine_inputs(
    tokens: int, dtype: torch.dtype, seed: int, weighted: bool, **routing: Any
) -> tuple[Any, list]:
    """The permutation and (x, w13, w2, row weights) of ``grouped_swiglu_combine`` at sizes
    ``torch._grouped_mm`` takes (16-byte rows): 6 experts, top-2, D = 32, F = 16."""
    g = torch.Generator().manual_seed(seed)
    experts, top_k, dim, hidden = 6, 2, 32, 16
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 0] += 1.5  # skewed: expert 0 busy, some experts empty
    p = ops.permute_indices(logits.topk(top_k, dim=-1).indices, experts, **routing)
    rows = p.row_to_slot.shape[0]
    inputs = [
        torch.randn(tokens, dim, generator=g).to(dtype),
        (torch.randn(experts, 2 * hidden, dim, generator=g) * 0.3).to(dtype),
        (torch.randn(experts, dim, hidden, generator=g) * 0.3).to(dtype),
        torch.rand(rows, generator=g) if weighted else None,
    ]
    return p, inputs


def two_threads() -> contextlib.AbstractContextManager[None]:
    """At least two intra-op threads: the threaded grouped GEMMs run only there."""
    return intra_op_threads(max(2, torch.get_num_threads()))


def _op_steps(x: Any, w13: Any, w2: Any, offs: Any, rw: Any, r2s: Any, s2r: Any) -> Any:
    """What ``grouped_swiglu_combine`` stands for: the two ops."""
    y, _h = gs.grouped_swiglu(x, w13, w2, offs, rw, None, r2s, s2r)
    return perm.unpermute(y, s2r, r2s)


# the decisions under which every kernel call is the lean path's (any machine), and one
# that is not (the per-group GEMM loop)
LEAN = dict(
    half_gemm="native",
    grouped_mm="torch",
    few_rows="mm",
    swiglu_path="whole",
    act_kernel="native",
    wgrad_a="as_is",
    few_gemm="aten",
    threads_mm="aten",
)
GENERAL = {**LEAN, "grouped_mm": "loop"}
COPIED_WGRAD = {**LEAN, "wgrad_a": "transpose"}  # the weight gradients' operand copied
# (by the threaded kernel, piece by piece, where the native kernels are built)
FEW_GEMM = {**LEAN, "few_gemm": "native"}  # half dtypes: the native few-rows GEMMs
FEW_GEMM_AMX = {**LEAN, "few_gemm": "amx"}  # ... in their AMX form (where the CPU has tiles)
# the threaded grouped GEMMs (on 2+ threads; they multiply operands in their own layouts)
THREADS = {**LEAN, "threads_mm": "native", "layout": "as_is"}
# ... for column-major weights only (every row and group class of bf16 forced by key)
FEW_GEMM_T = {
    **LEAN,
    **{f"few_gemm:bf16:t:r{2**i}:g{g}": "native" for i in range(6) for g in (8, 16, 32)},
}


class TestSwiGLUCombine(TestCase):
    """``grouped_swiglu_combine``: grouped_swiglu then the unweighted combine, in eager on
    plain CPU tensors one autograd node (its lean kernels where every decision is the
    common one): the values, every gradient and the saved tensors are the two ops', bit
    for bit, and neither op is called; everywhere else it is the two ops."""

    def setUp(self) -> None:
        super().setUp()
        self.enterContext(mock.patch.object(_eager, "ENABLED", True))

    def _compare(
        self,
        p: Any,
        inputs: list,
        grads: tuple[bool, ...],
        lean: bool | None,
        decisions: dict[str, str] | None = None,
    ) -> None:
        """Both ways on the same inputs; ``lean``: whether the lean kernels must run (None:
        not checked)."""
        maps = (p.row_to_slot, p.slot_to_row)
        args = [
            None if t is None else t.detach().requires_grad_(need)
            for t, need in zip(inputs, grads, strict=True)
        ]

        def combined(x: Any, w13: Any, w2: Any, rw: Any) -> Any:
            return gs.grouped_swiglu_combine(x, w13, w2, p.offs, rw, *maps)

        def stepwise(x: Any, w13: Any, w2: Any, rw: Any) -> Any:
            return _op_steps(x, w13, w2, p.offs, rw, *maps)

        present = [t for t in args if t is not None]

        def run(call: Callable) -> tuple[list, list, int]:
            return _run(lambda *ts: call(*_fill(args, ts)), present)

        with _cpu_probe.force(**(decisions or {})):
            with op_path():
                ref = run(stepwise)
            spy_f = mock.patch.object(gs, "_lean_forward", wraps=gs._lean_forward)
            spy_b = mock.patch.object(gs, "_lean_backward", wraps=gs._lean_backward)
            spy_mm = mock.patch.object(gs, "_whole_grouped_mm", wraps=gs._whole_grouped_mm)
            with spy_f as fwd, spy_b as bwd, spy_mm as gemms:
                with op_never_called(
                    gs.grouped_swiglu, gs.grouped_swiglu_backward, perm.unpermute, perm.permute
                ):
                    got = run(combined)
        self.assertEqual(len(got[0]), 1)
        _assert_same_as_ops(self, got, ref)
        self.assertLessEqual(got[2], ref[2])  # the maps are saved once, not twice
        if lean is not None:
            self.assertEqual(fwd.called, lean)
            self.assertEqual(bwd.called, lean and any(grads))
            _assert_lean_gemms(self, gemms, lean, decisions, inputs[1].dtype)

    @parametrize("dtype", [BF16, F32])
    @parametrize("weighted", [True, False])
    @parametrize("tokens", [1, 13, 40, 96])
    def test_same_as_the_ops(self, dtype: torch.dtype, weighted: bool, tokens: int) -> None:
        p, inputs = _combine_inputs(tokens, dtype, seed=tokens, weighted=weighted)
        needs = (True, True, True, weighted)
        native = _native.available()
        # a copied weight-gradient operand is copied piece by piece by the threaded kernel
        # (grouped_mm.transposes_wgrad), on the lean path too (fp32 is never copied)
        cases = [(LEAN, native), (GENERAL, False), (COPIED_WGRAD, native), (FEW_GEMM, native)]
        cases += [(FEW_GEMM_AMX, native), (THREADS, native)]
        for decisions, lean in cases:
            with self.subTest(decisions=decisions), two_threads():
                self._compare(p, inputs, needs, lean, decisions)

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_threaded_gemms_run_where_forced(self) -> None:
        # bf16, 32 rows per busy group, threads_mm forced on two threads: the lean node's
        # six GEMMs all by the threaded kernels (four x @ w, both weight gradients), the
        # values the ops' (which take the same kernels)
        p, inputs = _combine_inputs(96, BF16, seed=3, weighted=True)
        real = gmm._threaded_kernels()
        calls: list[str] = []

        class Recording:
            def __getattr__(self, name: str) -> Any:
                def call(*args: Any) -> Any:
                    calls.append(name)
                    return getattr(real, name)(*args)

                return call

        # (oneDNN's GEMMs: the native GEMM's gathered calls, and its probe, counted apart)
        forced = {**THREADS, "gemm_kernel": "aten"}
        with two_threads(), mock.patch.object(gmm, "_threaded_kernels", Recording):
            self._compare(p, inputs, (True,) * 4, True, forced)
        # the ops' run (reference) and the node's: each four forward-type and two wgrads
        self.assertEqual(calls.count("threaded_grouped_mm"), 8, msg=str(calls))
        self.assertEqual(calls.count("threaded_grouped_mm_wgrad"), 4, msg=str(calls))

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_gemms_read_the_gathered_rows(self) -> None:
        # where the threaded kernel runs them, the lean node's GEMMs read the tokens' rows
        # of x (h, dW13) and of the output's gradient (dA, dW2) through the token index,
        # gathering no [M, D] copy: the native bf16 GEMM (forced, where it runs) through
        # the index itself, oneDNN's from each piece's rows gathered into scratch. On one
        # thread torch._grouped_mm's way becomes the threaded kernel's for those four
        # (gather_way: the same GEMMs); on two threads it stays where threads_mm chose
        # it, and so in fp32, which the threaded kernel does not take. The ops' bits always
        cases = [
            (BF16, 2, {**THREADS, "gemm_kernel": "native"}, True),
            (BF16, 2, {**THREADS, "gemm_kernel": "aten"}, True),
            (BF16, 1, {**LEAN, "gemm_kernel": "aten", "row_split": "one"}, True),
            (BF16, 2, {**LEAN, "gemm_kernel": "aten"}, False),
            (torch.float32, 1, LEAN, False),
        ]
        for dtype, threads, decisions, reads in cases:
            p, inputs = _combine_inputs(96, dtype, seed=4, weighted=True)
            spy = mock.patch.object(gs, "gathered_grouped_mm", wraps=gs.gathered_grouped_mm)
            spy_w = mock.patch.object(
                gs, "gathered_grouped_mm_wgrad", wraps=gs.gathered_grouped_mm_wgrad
            )
            with (
                self.subTest(dtype=str(dtype), threads=threads, decisions=decisions),
                intra_op_threads(threads),
                spy as fwd,
                spy_w as wgrad,
            ):
                self._compare(p, inputs, (True,) * 4, True, decisions)
                # the node's h, dA (dW2, dW13) and the ops' h (dW13): the reference's
                # grouped_swiglu reads x's rows too
                self.assertEqual(fwd.call_count, 3 if reads else 0)
                self.assertEqual(wgrad.call_count, 3 if reads else 0)

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_gathered_rows_with_the_copied_weight_gradient_operand(self) -> None:
        # wgrad_a copying the operand (the threaded kernel's "transpose" way) with the
        # gathered rows read through the index: dW2's copied operand is the gathered
        # output gradient itself, dW13's (dH) multiplies gathered rows of x; on one and
        # two threads, with oneDNN's GEMM; the ops' bits
        p, inputs = _combine_inputs(96, BF16, seed=6, weighted=True)
        one = {**COPIED_WGRAD, "gemm_kernel": "aten", "row_split": "one"}
        two = {**one, "threads_mm": "native", "layout": "as_is"}
        for threads, decisions in ((1, one), (2, two)):
            spy_w = mock.patch.object(
                gs, "gathered_grouped_mm_wgrad", wraps=gs.gathered_grouped_mm_wgrad
            )
            with self.subTest(threads=threads), intra_op_threads(threads), spy_w as wgrad:
                self._compare(p, inputs, (True,) * 4, True, decisions)
                ways = [call.args[5] for call in wgrad.call_args_list]
                self.assertEqual(ways, ["transpose"] * 3)  # the ops' dW13, the node's two

    def test_few_rows_gemms_decided_per_gemm(self) -> None:
        # w2 stored column-major (w13 row-major) and the few-rows GEMM forced for
        # column-major weights only: h and dA take it, y and dX do not; the lean node must
        # follow each GEMM's own decision to keep the ops' bits
        p, inputs = _combine_inputs(13, BF16, seed=5, weighted=True)
        inputs[2] = inputs[2].transpose(-2, -1).contiguous().transpose(-2, -1)
        self._compare(p, inputs, (True,) * 4, _native.available(), FEW_GEMM_T)

    @parametrize("grads", [(False, True, True, True), (True, False, False, False), (False,) * 4])
    def test_some_inputs_need_no_gradient(self, grads: tuple[bool, ...]) -> None:
        p, inputs = _combine_inputs(13, BF16, seed=5, weighted=True)
        self._compare(p, inputs, grads, _native.available(), LEAN)

    @parametrize("routing", [dict(align=4), dict(capacity=3), dict(capacity=2, align=4)])
    def test_padding_and_dropped_rows(self, routing: dict[str, int]) -> None:
        # -1 rows inside the groups (align) and past the last one (capacity): zero rows in,
        # no gradient out, a weight gradient of 0 past the last group
        p, inputs = _combine_inputs(17, BF16, seed=3, weighted=True, **routing)
        self.assertTrue(bool((p.row_to_slot < 0).any()))
        self._compare(p, inputs, (True, True, True, True), _native.available(), LEAN)

    def test_default_decisions_and_no_tokens(self) -> None:
        for tokens in (0, 29):
            p, inputs = _combine_inputs(tokens, BF16, seed=9, weighted=True)
            self._compare(p, inputs, (True, True, True, True), None)

    def test_no_grad_and_the_profiler_take_the_kernels(self) -> None:
        p, (x, w13, w2, rw) = _combine_inputs(13, BF16, seed=2, weighted=True)
        with _cpu_probe.force(**LEAN), op_path():  # the same decisions (bf16 GEMMs) both ways
            ref = _op_steps(x, w13, w2, p.offs, rw, p.row_to_slot, p.slot_to_row)
        with _cpu_probe.force(**LEAN), op_never_called(gs.grouped_swiglu, perm.unpermute):
            with torch.no_grad():
                out = gs.grouped_swiglu_combine(
                    x, w13, w2, p.offs, rw, p.row_to_slot, p.slot_to_row
                )
            self.assertTrue(torch.equal(out, ref))
            # profiled: each kernel under its op's name (the lean kernels go unprofiled)
            prof_args = [t.detach().requires_grad_() for t in (x, w13, w2)]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                with mock.patch.object(gs, "_lean_forward", side_effect=AssertionError):
                    out = gs.grouped_swiglu_combine(
                        *prof_args, p.offs, rw, p.row_to_slot, p.slot_to_row
                    )
                    out.float().sum().backward()
        self.assertTrue(torch.equal(out, ref))
        names = {e.name for e in prof.events()}
        for name in ("grouped_swiglu", "unpermute", "permute", "grouped_swiglu_backward"):
            self.assertIn(f"torch_moe::{name}", names)

    def test_double_backward_is_the_ops(self) -> None:
        p, inputs = _combine_inputs(13, F32, seed=4, weighted=False)
        got, ref = [], []
        for out, enabled in ((got, True), (ref, False)):
            x, w13, w2 = (t.detach().requires_grad_() for t in inputs[:3])
            with mock.patch.object(_eager, "ENABLED", enabled):
                y = gs.grouped_swiglu_combine(
                    x, w13, w2, p.offs, None, p.row_to_slot, p.slot_to_row
                )
                out.extend(torch.autograd.grad(y.sum(), (x, w13), create_graph=True))
        for a, b in zip(got, ref, strict=True):
            self.assertTrue(torch.equal(a, b))
            self.assertEqual(a.requires_grad, b.requires_grad)

    def test_errors_are_the_ops(self) -> None:
        p, (x, w13, w2, rw) = _combine_inputs(7, F32, seed=1, weighted=True)
        bad = p.offs[:-1]
        for enabled in (True, False):
            with mock.patch.object(_eager, "ENABLED", enabled):
                with self.assertRaisesRegex(ValueError, r"^grouped_swiglu: expected offs .* E=6"):
                    gs.grouped_swiglu_combine(x, w13, w2, bad, rw, p.row_to_slot, p.slot_to_row)

    def test_compiled_and_subclass_calls_take_the_ops(self) -> None:
        p, (x, w13, w2, _rw) = _combine_inputs(9, F32, seed=6, weighted=False)

        def f(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
            return gs.grouped_swiglu_combine(x, w13, w2, p.offs, None, p.row_to_slot, p.slot_to_row)

        compiled = _compiled_keeps_the_ops(self, f, x, w13, w2)
        with op_path(), mock.patch.object(gs, "_SwiGLUCombine", side_effect=AssertionError):
            self.assertTrue(torch.equal(f(x, w13, w2), compiled(x, w13, w2)))


class TestGLUCombine(TestCase):
    """``grouped_glu_combine``: the composed experts (gather_grouped_mm, an up bias, glu,
    grouped_mm, the unweighted combine), in eager on plain CPU tensors one lean autograd
    node where every decision is the common one: the values and every gradient are the
    ops', bit for bit, in either weight orientation, with or without a bias; everywhere
    else the ops."""

    def setUp(self) -> None:
        super().setUp()
        self.enterContext(mock.patch.object(_eager, "ENABLED", True))

    def _inputs(
        self,
        activation: str,
        transposed: bool,
        bias: bool,
        dtype: torch.dtype,
        tokens: int = 19,
        **routing: Any,
    ) -> tuple[Any, list, tuple]:
        g = torch.Generator().manual_seed(11)
        experts, top_k, dim, hidden = 6, 2, 32, 16
        width = 2 * hidden if activation != "relu2" else hidden
        logits = torch.randn(tokens, experts, generator=g)
        logits[:, 0] += 1.5
        ids = logits.topk(top_k, dim=-1).indices
        p = ops.permute_indices(ids, experts, **routing)
        rows = p.row_to_slot.shape[0]

        def weight(e: int, k: int, n: int) -> torch.Tensor:  # [E, K, N] in either layout
            w = (
                torch.randn(e, n, k, generator=g)
                if transposed
                else torch.randn(e, k, n, generator=g)
            )
            w = (w * 0.3).to(dtype)
            return w.transpose(-2, -1) if transposed else w

        bias_rows = ids.reshape(-1).index_select(0, p.row_to_slot.clamp(min=0)) if bias else None
        inputs = [
            torch.randn(tokens, dim, generator=g).to(dtype),
            weight(experts, dim, width),
            weight(experts, hidden, dim),
            torch.rand(rows, generator=g),
            (torch.randn(experts, width, generator=g) * 0.1).to(dtype) if bias else None,
        ]
        glu_args = {
            "swiglu": ("swiglu", 1.0, None, False),
            "swigluoai": ("swigluoai", 1.702, 0.9, True),
            "relu2": ("relu2", 1.0, None, False),
        }[activation]
        return (p, bias_rows), inputs, glu_args

    def _compare(self, case: tuple, inputs: list, glu_args: tuple, needs: tuple, lean: bool,
                 decisions: dict[str, str]) -> None:  # fmt: skip
        (p, bias_rows) = case
        args = [
            None if t is None else t.detach().requires_grad_(n)
            for t, n in zip(inputs, needs, strict=True)
        ]
        present = [t for t in args if t is not None]

        def call(x: Any, w_up: Any, w_down: Any, rw: Any, bias: Any) -> Any:
            return glu_mod.grouped_glu_combine(
                x, w_up, w_down, p.offs, rw, p.row_to_slot, p.slot_to_row, *glu_args,
                up_bias=bias, bias_rows=bias_rows,
            )  # fmt: skip

        def run() -> tuple[list, list, int]:
            return _run(lambda *ts: call(*_fill(args, ts)), present)

        with _cpu_probe.force(**decisions):
            with op_path():
                ref = run()
            spy = mock.patch.object(
                glu_mod, "_lean_backward_into", wraps=glu_mod._lean_backward_into
            )
            spy_mm = mock.patch.object(
                glu_mod, "_whole_grouped_mm", wraps=glu_mod._whole_grouped_mm
            )
            with spy as lean_bwd, spy_mm as gemms:
                with (
                    op_never_called(
                        gmm.gather_grouped_mm, gmm.grouped_mm, glu_mod.glu, perm.unpermute
                    )
                    if lean
                    else contextlib.nullcontext()
                ):
                    got = run()
        _assert_same_as_ops(self, got, ref)
        self.assertLessEqual(got[2], ref[2])
        self.assertEqual(lean_bwd.called, lean and any(needs))
        _assert_lean_gemms(self, gemms, lean, decisions, inputs[1].dtype)

    @parametrize("activation", ["swiglu", "swigluoai", "relu2"])
    @parametrize("transposed", [False, True])
    @parametrize("bias", [False, True])
    def test_same_as_the_ops(self, activation: str, transposed: bool, bias: bool) -> None:
        case, inputs, glu_args = self._inputs(activation, transposed, bias, BF16)
        needs = (True, True, True, True, bias)
        native = _native.available()
        cases = [(LEAN, native), (GENERAL, False), (COPIED_WGRAD, native), (FEW_GEMM, native)]
        cases += [(FEW_GEMM_AMX, native), (THREADS, native)]
        for decisions, lean in cases:
            with self.subTest(decisions=decisions), two_threads():
                self._compare(case, inputs, glu_args, needs, lean, decisions)

    @unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
    def test_gemms_read_the_gathered_rows(self) -> None:
        # as the SwiGLU node's: where the threaded kernel runs them (two threads, forced),
        # h, dA, dW_down and dW_up read the tokens' rows through the index, in both weight
        # layouts and whichever gradients are asked for, with the native bf16 GEMM (forced,
        # where it runs) and with oneDNN's (each piece's rows gathered into scratch), and
        # on one thread where torch._grouped_mm's way was decided; the ops' bits
        one = {**LEAN, "gemm_kernel": "aten", "row_split": "one"}
        runs = [(2, {**THREADS, "gemm_kernel": k}) for k in ("native", "aten")] + [(1, one)]
        for transposed in (False, True):
            for needs in ((True, True, True, True, False), (False, True, False, False, False)):
                # (more than FEW_ROWS rows per expert: the threaded kernel's)
                case, inputs, glu_args = self._inputs(
                    "swigluoai", transposed, False, BF16, tokens=160
                )
                for threads, decisions in runs:
                    spy = mock.patch.object(
                        glu_mod, "gathered_grouped_mm", wraps=glu_mod.gathered_grouped_mm
                    )
                    spy_w = mock.patch.object(
                        glu_mod,
                        "gathered_grouped_mm_wgrad",
                        wraps=glu_mod.gathered_grouped_mm_wgrad,
                    )
                    with (
                        self.subTest(transposed=transposed, needs=needs, decisions=decisions),
                        intra_op_threads(threads),
                        spy as fwd,
                        spy_w as wgrad,
                    ):
                        self._compare(case, inputs, glu_args, needs, True, decisions)
                        # h, dA (upstream of w_up's gradient); dW_down where asked, dW_up
                        self.assertEqual(fwd.call_count, 2)
                        self.assertEqual(wgrad.call_count, 1 + needs[2])

    def test_few_rows_gemms_decided_per_gemm(self) -> None:
        # the up weight column-major, the down weight row-major, and the few-rows GEMM
        # forced for column-major weights only: h and dA take it, y and dX do not; the
        # lean node must follow each GEMM's own decision to keep the ops' bits
        case, inputs, glu_args = self._inputs("swiglu", True, False, BF16)
        inputs[2] = inputs[2].contiguous()  # [E, F, D] row-major
        needs = (True, True, True, True, False)
        self._compare(case, inputs, glu_args, needs, _native.available(), FEW_GEMM_T)

    @parametrize(
        "needs",
        [
            (False, True, True, False, True),
            (True, False, False, True, False),
            (False, False, True, False, False),
        ],
    )
    def test_some_inputs_need_no_gradient(self, needs: tuple[bool, ...]) -> None:
        case, inputs, glu_args = self._inputs("swigluoai", True, True, F32)
        # the lean node where the up projection's inputs need a gradient (else the ops,
        # which then save less)
        lean = _native.available() and (needs[0] or needs[1] or needs[4])
        self._compare(case, inputs, glu_args, needs, lean, LEAN)

    @parametrize("routing", [dict(align=4), dict(capacity=5)])
    def test_padding_and_dropped_rows(self, routing: dict[str, int]) -> None:
        case, inputs, glu_args = self._inputs("swiglu", False, True, BF16, **routing)
        self.assertTrue(bool((case[0].row_to_slot < 0).any()))
        self._compare(case, inputs, glu_args, (True,) * 5, _native.available(), LEAN)

    def test_double_backward_is_the_ops(self) -> None:
        (p, bias_rows), inputs, glu_args = self._inputs("swigluoai", True, True, F32)
        got, ref = [], []
        with _cpu_probe.force(**LEAN):
            for out, enabled in ((got, True), (ref, False)):
                x, w_up, w_down, rw, bias = (t.detach().requires_grad_() for t in inputs)
                with mock.patch.object(_eager, "ENABLED", enabled):
                    y = glu_mod.grouped_glu_combine(
                        x, w_up, w_down, p.offs, rw, p.row_to_slot, p.slot_to_row, *glu_args,
                        up_bias=bias, bias_rows=bias_rows,
                    )  # fmt: skip
                    grads = torch.autograd.grad(y.sum(), (x, w_up, rw, bias), create_graph=True)
                    out.extend(grads)
                    # second order: as far as the ops go (glu_backward has no formula)
                    with self.assertRaisesRegex(RuntimeError, "glu_backward.default but no"):
                        torch.autograd.grad(grads[0].sum(), w_up)
        for a, b in zip(got, ref, strict=True):
            self.assertTrue(torch.equal(a, b))

    @parametrize("transposed", [False, True])
    def test_weight_gradients_in_the_weights_layout(self, transposed: bool) -> None:
        # as autograd hands them over (AccumulateGrad would copy into the parameter's
        # layout): the ops' own layout, the weight's, so that no copy is made
        (p, _rows), inputs, glu_args = self._inputs("swigluoai", transposed, False, BF16)
        got = []
        with _cpu_probe.force(**LEAN):
            for enabled in (True, False):
                x, w_up, w_down = (t.detach().requires_grad_() for t in inputs[:3])
                with mock.patch.object(_eager, "ENABLED", enabled):
                    y = glu_mod.grouped_glu_combine(
                        x, w_up, w_down, p.offs, inputs[3], p.row_to_slot, p.slot_to_row,
                        *glu_args,
                    )  # fmt: skip
                    got.append(torch.autograd.grad(y.float().sum(), (w_up, w_down)))
        for a, b, w in zip(got[0], got[1], inputs[1:3], strict=True):
            self.assertEqual(a.stride(), b.stride())
            self.assertEqual(a.stride(), w.stride())
            self.assertTrue(torch.equal(a, b))

    def test_bad_input(self) -> None:
        (p, _rows), (x, w_up, w_down, rw, bias), glu_args = self._inputs("swiglu", False, True, F32)
        args = (x, w_up, w_down, p.offs, rw, p.row_to_slot, p.slot_to_row, *glu_args)
        with self.assertRaisesRegex(ValueError, "up_bias and bias_rows go together"):
            glu_mod.grouped_glu_combine(*args, up_bias=bias)
        for enabled in (True, False):
            with mock.patch.object(_eager, "ENABLED", enabled):
                with self.assertRaisesRegex(ValueError, r"^grouped_mm: offs .*got offs="):
                    bad = p.offs.flip(0).contiguous()
                    glu_mod.grouped_glu_combine(
                        x.requires_grad_(), w_up, w_down, bad, rw, p.row_to_slot, p.slot_to_row,
                        *glu_args,
                    )  # fmt: skip


class TestExpertsNodesFuzz(TestCase):
    """Both eager experts nodes against the ops on random routings (empty experts, skew,
    padding, capacity drops, one token, K up to E), dtypes and orientations, under the
    decisions that make them lean (or take the native few-rows GEMMs): bit for bit,
    outputs and every gradient."""

    def setUp(self) -> None:
        super().setUp()
        self.enterContext(mock.patch.object(_eager, "ENABLED", True))

    @settings(max_examples=30, deadline=None)
    @given(
        tokens=st.integers(1, 33),
        experts=st.integers(2, 7),
        top_k=st.integers(1, 3),
        routing=st.sampled_from([{}, {"align": 4}, {"capacity": 3}, {"capacity": 5, "align": 2}]),
        seed=st.integers(0, 2**16),
        dtype=st.sampled_from([BF16, F32]),
        activation=st.sampled_from(["fused", "swiglu", "swigluoai", "relu2"]),
        transposed=st.booleans(),
        bias=st.booleans(),
        decisions=st.sampled_from([LEAN, FEW_GEMM, FEW_GEMM_AMX, THREADS]),
    )
    def test_same_as_the_ops(
        self, tokens: int, experts: int, top_k: int, routing: dict[str, int], seed: int,
        dtype: torch.dtype, activation: str, transposed: bool, bias: bool,
        decisions: dict[str, str],
    ) -> None:  # fmt: skip
        top_k = min(top_k, experts)
        g = torch.Generator().manual_seed(seed)
        dim, hidden = 16, 8
        ids = torch.rand(tokens, experts, generator=g).pow(3).topk(top_k, dim=-1).indices
        p = ops.permute_indices(ids, experts, **routing)
        rows = p.row_to_slot.shape[0]
        maps = (p.row_to_slot, p.slot_to_row)

        def rand(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * 0.3).to(dtype)

        rw = torch.rand(rows, generator=g)
        if activation == "fused":
            inputs = [
                rand(tokens, dim),
                rand(experts, 2 * hidden, dim),
                rand(experts, dim, hidden),
                rw,
            ]

            def call(x: Any, w13: Any, w2: Any, r: Any) -> Any:
                return gs.grouped_swiglu_combine(x, w13, w2, p.offs, r, *maps)

        else:
            width = hidden if activation == "relu2" else 2 * hidden
            up = (
                rand(experts, width, dim).transpose(-2, -1)
                if transposed
                else rand(experts, dim, width)
            )
            down = (
                rand(experts, dim, hidden).transpose(-2, -1)
                if transposed
                else rand(experts, hidden, dim)
            )
            gated = activation != "relu2"
            glu_args = (activation, 1.702, 0.7 if gated else None, transposed and gated)
            bias_rows = ids.reshape(-1).index_select(0, p.row_to_slot.clamp(min=0))
            inputs = [rand(tokens, dim), up, down, rw] + ([rand(experts, width)] if bias else [])

            def call(x: Any, w_up: Any, w_down: Any, r: Any, b: Any = None) -> Any:
                return glu_mod.grouped_glu_combine(
                    x, w_up, w_down, p.offs, r, *maps, *glu_args,
                    up_bias=b, bias_rows=None if b is None else bias_rows,
                )  # fmt: skip

        inputs = [t.requires_grad_() for t in inputs]
        with _cpu_probe.force(**decisions), two_threads():
            with op_path():
                ref = _run(call, inputs)
            got = _run(call, inputs)
        _assert_same_as_ops(self, got, ref)


def _assert_lean_gemms(
    test: TestCase, gemms: Any, lean: bool, decisions: dict[str, str] | None, dtype: torch.dtype
) -> None:
    """The lean kernels' x @ w GEMMs (``_whole_grouped_mm`` calls) took the native
    few-rows kernel exactly where it was forced, for half dtypes, the threaded kernel
    where that was forced and the rows allow it, ``torch._grouped_mm`` elsewhere (none ran
    off the lean path)."""
    if not lean:
        test.assertFalse(gemms.called)
        return
    test.assertTrue(gemms.called)
    ways = {c.args[-1] for c in gemms.call_args_list}
    if any(k.startswith("few_gemm:") for k in decisions or {}):  # forced per layout:
        # each GEMM by the native kernel exactly where its weight is column-major
        for c in gemms.call_args_list:
            test.assertEqual(c.args[-1] == "few", c.args[1].stride(2) != 1)
        test.assertEqual(ways, {"few", "torch"})
        return
    decisions = decisions or {}
    if decisions.get("few_gemm") in ("native", "amx") and dtype in (BF16, torch.float16):
        # the AMX form's way for column-major weights where forced and the CPU has tiles
        tiles = decisions["few_gemm"] == "amx" and gmm.amx_tiles(dtype)
        for c in gemms.call_args_list:
            amx = tiles and c.args[1].stride(2) != 1
            test.assertEqual(c.args[-1], "few_amx" if amx else "few")
    elif decisions.get("threads_mm") == "native" and dtype in (BF16, torch.float16):
        # forward GEMMs of more than FEW_ROWS rows per group are threaded (fewer: torch's;
        # its tests hold two threads)
        test.assertTrue(ways <= {"threads", "torch"}, msg=str(ways))
        for c in gemms.call_args_list:
            rows = gmm.rows_per_busy_group(c.args[2].tolist())[1]
            test.assertEqual(c.args[-1] == "threads", rows > _cpu_probe.FEW_ROWS)
    else:
        test.assertEqual(ways, {"torch"})


class TestMoELayerNode(TestCase):
    """``torch_moe.nn.MoE`` without expert parallelism runs its SwiGLU experts and the
    combine through ``grouped_swiglu_combine`` (in eager on CPU tensors one autograd
    node): the layer's output and every gradient (input, router, experts, shared experts)
    are the ops', bit for bit, and it saves no more for the backward."""

    def setUp(self) -> None:
        super().setUp()
        self.enterContext(mock.patch.object(_eager, "ENABLED", True))  # even if the env says 0

    def _step(self, moe: MoE, x: torch.Tensor, grad: torch.Tensor, autocast: bool) -> tuple:
        moe.zero_grad(set_to_none=True)
        x = x.detach().requires_grad_()
        saved: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        amp = torch.autocast("cpu", dtype=BF16) if autocast else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
            y = moe(x)
        y.backward(grad.to(y.dtype))
        grads = [x.grad] + [p.grad for p in moe.parameters()]
        return [y], grads, sum(saved)

    @parametrize(
        "case", ["bf16", "fp32", "capacity", "shared", "autocast", "aux_losses", "no_tokens"]
    )
    def test_same_as_the_ops(self, case: str) -> None:
        kw: dict[str, Any] = dict(route_norm=True)
        dtype, tokens = BF16, 23
        if case == "fp32":
            dtype = F32
        elif case == "capacity":  # dropped assignments: -1 slots
            kw["capacity_factor"] = 0.75
        elif case == "shared":  # a gated shared expert between the experts and the sum
            kw.update(shared_hidden_dim=24, shared_gate=True)
        elif case == "autocast":
            dtype = F32
        elif case == "aux_losses":
            kw.update(aux_loss="switch", aux_loss_coeff=0.01, z_loss_coeff=0.001)
        elif case == "no_tokens":
            tokens = 0
        torch.manual_seed(len(case))
        moe = MoE(32, 16, 6, 2, dtype=dtype, **kw)
        g = torch.Generator().manual_seed(3)
        x = torch.randn(tokens, 32, generator=g).to(dtype)
        grad = torch.randn(tokens, 32, generator=g)
        with op_path():
            ref = self._step(moe, x, grad, case == "autocast")
        spy = mock.patch.object(gs, "_SwiGLUCombine", wraps=gs._SwiGLUCombine)
        with spy as node, op_never_called(gs.grouped_swiglu, perm.unpermute):
            got = self._step(moe, x, grad, case == "autocast")
        _assert_same_as_ops(self, got, ref)
        self.assertLessEqual(got[2], ref[2])
        self.assertTrue(node.apply.called)

    @parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8"])
    def test_recipes_same_as_the_ops(self, recipe: str) -> None:
        # an FP8 / MX layer step: its GEMMs' and quantizers' direct calls give the ops'
        # output, gradients and saved bytes, bit for bit, and no op runs
        torch.manual_seed(5)
        moe = MoE(64, 32, 6, 2, route_norm=True, dtype=BF16, precision=recipe)
        g = torch.Generator().manual_seed(6)
        x = torch.randn(29, 64, generator=g).to(BF16)
        grad = torch.randn(29, 64, generator=g)
        with op_path():
            ref = self._step(moe, x, grad, False)
        with op_never_called(*FP8_DIRECT):
            got = self._step(moe, x, grad, False)
        _assert_same_as_ops(self, got, ref)
        self.assertEqual(got[2], ref[2])

    @parametrize("kind", ["swiglu", "composed", "recipe"])
    def test_experts_combine_is_the_unpermute_of_their_rows(self, kind: str) -> None:
        # GroupedExperts(combine=True) against its rows summed back by the unpermute op, in
        # the value and in every gradient: SwiGLU experts by the node, experts with biases
        # and a clamped activation, and an FP8 recipe's, by their rows and the op
        kw: dict[str, Any] = {
            "swiglu": {},
            "composed": dict(activation="swigluoai", swiglu_limit=7.0, experts_bias=True),
            "recipe": dict(precision="fp8_rowwise"),
        }[kind]
        torch.manual_seed(1)
        moe = MoE(32, 32, 4, 2, dtype=BF16, **kw)
        g = torch.Generator().manual_seed(4)
        x = torch.randn(19, 32, generator=g).to(BF16)
        ids = torch.randn(19, 4, generator=g).topk(2, dim=-1).indices
        p = ops.permute_indices(ids, 4)
        rw = torch.rand(p.row_to_slot.shape[0], generator=g)
        maps = (p.row_to_slot, p.slot_to_row)
        cot = torch.randn(19, 32, generator=g).to(BF16)

        def run(combine: bool) -> list:
            moe.zero_grad(set_to_none=True)
            xx, rr = x.detach().requires_grad_(), rw.detach().requires_grad_()
            if combine:
                out = moe.experts(xx, p.offs, rr, permutation=maps, combine=True)
            else:
                out = ops.unpermute(moe.experts(xx, p.offs, rr, permutation=maps), None, p)
            out.backward(cot)
            return [out, xx.grad, rr.grad] + [q.grad for q in moe.experts.parameters()]

        ref, got = run(False), run(True)
        for a, b in zip(got, ref, strict=True):
            self.assertTrue(torch.equal(a, b), "differs from the rows' unpermute")

    def test_without_autograd_one_call_too(self) -> None:
        # training mode under no_grad (a reentrant checkpoint's first forward) and eval
        # mode under inference_mode: the node's forward (which frees h before the combine,
        # as the ops do: test_perf's inference peaks) or, at a few tokens once decided,
        # its one native call (TestFewStep: in eval mode with the routing's, moe_few), no
        # op, the training values
        real_call = gs._one_call
        one_call: list[bool] = []

        def call(*args: Any) -> Any:
            out = real_call(*args)
            one_call.append(out is not None)
            return out

        self.enterContext(mock.patch.object(gs, "_one_call", call))
        torch.manual_seed(2)
        moe = MoE(32, 16, 6, 2, route_norm=True, dtype=BF16)
        for tokens in (0, 1, 9, 40):
            x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(2)).to(BF16)
            with torch.enable_grad():
                want = moe.train()(x.requires_grad_()).detach()
            for mode in ("no_grad", "inference"):
                with self.subTest(tokens=tokens, mode=mode):
                    spy = mock.patch.object(
                        gs, "_swiglu_combine_forward", wraps=gs._swiglu_combine_forward
                    )
                    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
                    moe.train(mode == "no_grad")
                    one_call.clear()
                    with ctx, spy as node, op_never_called(gs.grouped_swiglu, perm.unpermute):
                        got = moe(x.detach())
                    self.assertNotEqual(node.called, any(one_call))
                    if node.called:
                        self.assertFalse(node.call_args.kwargs.get("keep_h", True))
                    self.assertTrue(torch.equal(got, want))

    def test_combine_needs_the_permutation(self) -> None:
        experts = MoE(32, 16, 4, 2).experts
        with self.assertRaisesRegex(ValueError, "combine=True needs the permutation"):
            experts(torch.randn(4, 32), torch.tensor([1, 2, 3, 4], dtype=torch.int32), combine=True)


@contextlib.contextmanager
def few_step_calls(step: Any) -> Iterator[list[bool]]:
    """The one-call decode step's native calls on ``step`` (a ``_FewStep``): their answers,
    in order."""
    answers: list[bool] = []
    real = step.mod

    class Recording:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def swiglu_combine_few(self, *args: Any) -> bool:
            answers.append(bool(real.swiglu_combine_few(*args)))
            return answers[-1]

        def moe_few(self, *args: Any) -> bool:
            answers.append(bool(real.moe_few(*args)))
            return answers[-1]

    with mock.patch.object(step, "mod", Recording()):
        yield answers


@unittest.skipUnless(_native.available(), "the native CPU kernels did not build here")
class TestFewStep(TestCase):
    """``grouped_swiglu_combine``'s inference in one native call (``swiglu_combine_few``)
    where the lean plan runs both GEMMs by the few-rows kernel: after the Python path has
    decided a count of busy groups, later calls with it take the one call, the ops' bits;
    anything else (other ways, padding, bad input) the Python path."""

    def setUp(self) -> None:
        super().setUp()
        self.enterContext(mock.patch.object(_eager, "ENABLED", True))

    def _step(self, p: Any, inputs: list) -> Any:
        """The call's one-call state, its plan forgotten."""
        x, w13, w2, rw = inputs
        step = gs._few_step_plan(x, w13, w2, rw, p.row_to_slot.shape[0])
        self.assertIsNotNone(step)
        step.plan.fill_(-1)
        step.refused = 0
        return step

    def _run(self, p: Any, inputs: list) -> torch.Tensor:
        with torch.inference_mode():
            return gs.grouped_swiglu_combine(
                *inputs[:3], p.offs, inputs[3], p.row_to_slot, p.slot_to_row
            )

    @parametrize("dtype", [BF16, torch.float16])
    @parametrize("tokens", [1, 3, 8])
    @parametrize("threads", [1, 2])
    def test_same_as_the_ops(self, dtype: torch.dtype, tokens: int, threads: int) -> None:
        for weighted, decisions in ((True, FEW_GEMM), (False, FEW_GEMM), (True, FEW_GEMM_AMX)):
            p, inputs = _combine_inputs(tokens, dtype, seed=tokens, weighted=weighted)
            with self.subTest(weighted=weighted, decisions=decisions["few_gemm"]):
                with intra_op_threads(threads), _cpu_probe.force(**decisions):
                    with op_path():
                        ref = _op_steps(
                            *inputs[:3], p.offs, inputs[3], p.row_to_slot, p.slot_to_row
                        )
                    step = self._step(p, inputs)
                    spy = mock.patch.object(gs, "_lean_forward", wraps=gs._lean_forward)
                    with few_step_calls(step) as answers, spy as lean:
                        first = self._run(p, inputs)  # refused: the Python path decides
                        self.assertEqual((answers, lean.call_count), ([False], 1))
                        busy = gmm._busy_groups(p.offs.tolist())
                        self.assertTrue(bool((step.plan[busy] >= 0).all()))
                        self.assertEqual(int((step.plan >= 0).all(1).sum()), 1)
                        second = self._run(p, inputs)  # the one call
                        self.assertEqual((answers, lean.call_count), ([False, True], 1))
                for got in (first, second):
                    self.assertEqual(
                        (got.dtype, got.shape, got.stride()), (ref.dtype, ref.shape, ref.stride())
                    )
                    self.assertTrue(torch.equal(got, ref), "differs from the ops' result")

    def test_each_count_of_busy_groups_is_decided_apart(self) -> None:
        # tokens 2, top-2 of 6 experts: 2, 3 or 4 busy groups; each count's first call
        # takes the Python path, its later ones the one call, all with the ops' bits
        _, (x, w13, w2, _rw) = _combine_inputs(2, BF16, seed=0, weighted=False)
        cases = {}
        for ids in ([[0, 1], [0, 1]], [[0, 1], [0, 2]], [[0, 1], [2, 3]], [[4, 5], [2, 3]]):
            p = ops.permute_indices(torch.tensor(ids), 6)
            cases.setdefault(gmm._busy_groups(p.offs.tolist()), []).append(p)
        self.assertEqual(sorted(cases), [2, 3, 4])
        with _cpu_probe.force(**FEW_GEMM):
            step = self._step(cases[4][0], [x, w13, w2, None])
            with few_step_calls(step) as answers:
                for busy in (2, 3, 4):
                    for p in cases[busy] * 2:
                        with op_path():
                            ref = _op_steps(x, w13, w2, p.offs, None, p.row_to_slot, p.slot_to_row)
                        self.assertTrue(torch.equal(self._run(p, [x, w13, w2, None]), ref))
        # 2: two calls, 3: two calls, 4: two routings twice (one refusal per count)
        self.assertEqual(answers, [False, True, False, True, False, True, True, True])

    def test_other_ways_and_padding_take_the_python_path(self) -> None:
        # the ATen GEMMs (few_gemm forced off), only one GEMM by the few-rows kernel (w2
        # stored transposed, the kernel forced for column-major weights only), or rows of
        # padding (align) or dropped past the last group (capacity): refused every time,
        # the Python path's values; a plan refused _FEW_STEP_REFUSALS times in a row stops
        # calling
        for layout, decisions in (
            ({}, LEAN),
            ({"w2": "transposed"}, FEW_GEMM_T),
            ({"align": 4}, FEW_GEMM),
            ({"capacity": 2}, FEW_GEMM),
        ):
            routing = {k: v for k, v in layout.items() if k != "w2"}
            p, inputs = _combine_inputs(5, BF16, seed=2, weighted=True, **routing)
            if "w2" in layout:
                inputs[2] = inputs[2].transpose(-2, -1).contiguous().transpose(-2, -1)
            with self.subTest(layout=layout), _cpu_probe.force(**decisions):
                with op_path():
                    ref = _op_steps(*inputs[:3], p.offs, inputs[3], p.row_to_slot, p.slot_to_row)
                step = self._step(p, inputs)
                with (
                    few_step_calls(step) as answers,
                    mock.patch.object(gs, "_FEW_STEP_REFUSALS", 3),
                ):
                    for _ in range(5):
                        self.assertTrue(torch.equal(self._run(p, inputs), ref))
                self.assertEqual(answers, [False] * 3)
                self.assertFalse(bool((step.plan >= 0).any()))

    def test_bad_input_gets_the_python_paths_errors(self) -> None:
        # a decided plan, then calls the one call must refuse: the Python path's messages
        p, inputs = _combine_inputs(3, BF16, seed=4, weighted=True)
        x, w13, w2, rw = inputs
        with _cpu_probe.force(**FEW_GEMM):
            step = self._step(p, inputs)
            self._run(p, inputs)
            self.assertTrue(bool((step.plan >= 0).any()))
            r2s, s2r = p.row_to_slot, p.slot_to_row
            bad_r2s = r2s.clone()
            bad_r2s[0] = s2r.numel()
            bad_s2r = s2r.clone()
            bad_s2r[0, 0] = r2s.shape[0]
            bad_offs = p.offs.clone()
            bad_offs[0] = bad_offs[-1] + 1
            cases = [
                ((x, w13, w2, bad_offs, rw, r2s, s2r), "offs must be non-decreasing"),
                (
                    (x, w13, w2, p.offs, rw, bad_r2s, s2r),
                    r"row_to_slot must hold values in \[-1, 6\)",
                ),
                (
                    (x, w13, w2, p.offs, rw, r2s, bad_s2r),
                    r"slot_to_row must hold values in \[-1, 6\)",
                ),
                ((x, w13, w2, p.offs[:-1], rw, r2s, s2r), "expected offs to be 1D int32 with E=6"),
                ((x, w13, w2, p.offs, rw[:-1], r2s, s2r), r"expected row_weights .* \[M=6\]"),
                ((x, w13[:, :-1], w2, p.offs, rw, r2s, s2r), "even 2F"),
                ((x.float(), w13, w2, p.offs, rw, r2s, s2r), None),  # x converted by the path
            ]
            with few_step_calls(step) as answers:
                for args, message in cases:
                    with self.subTest(message=message), torch.inference_mode():
                        if message is None:
                            gs.grouped_swiglu_combine(*args)
                            continue
                        with self.assertRaisesRegex(ValueError, message):
                            gs.grouped_swiglu_combine(*args)
            # (the last two have other metadata: another plan's, or none for an fp32 x)
            self.assertEqual(answers, [False] * (len(cases) - 2))

    def test_native_op_refuses_what_it_does_not_take(self) -> None:
        # the op itself: false, nothing written, for every malformed input
        p, inputs = _combine_inputs(3, BF16, seed=4, weighted=True)
        x, w13, w2, rw = inputs
        plan = torch.zeros(7, 2, dtype=torch.int32)
        mod = _native.kernels()

        def call(**changes: Any) -> tuple[bool, torch.Tensor]:
            args = dict(
                x=x,
                w13=w13,
                w2=w2,
                offs=p.offs,
                rw=rw,
                r2s=p.row_to_slot,
                s2r=p.slot_to_row,
                plan=plan,
                out=torch.full((3, 32), 7.0, dtype=BF16),
            )
            args.update(changes)
            ok = mod.swiglu_combine_few(*args.values(), False, False)
            return ok, args["out"]

        ok, out = call()
        self.assertTrue(ok)
        with torch.inference_mode(), _cpu_probe.force(**FEW_GEMM), op_path():
            ref = _op_steps(x, w13, w2, p.offs, rw, p.row_to_slot, p.slot_to_row)
        self.assertTrue(torch.equal(out, ref))
        busy = gmm._busy_groups(p.offs.tolist())
        unplanned, half = plan.clone(), plan.clone()
        unplanned[busy] = -1
        half[busy, 1] = -1
        short = p.offs.clamp(max=5)  # the last group ends before M = 6
        unsorted = p.offs.clone()
        unsorted[0] = 6  # then smaller ends: decreasing
        strided = torch.zeros(6, 32, 64, dtype=BF16)[..., ::2]
        strided.copy_(w13)
        refusals = {
            "the busy count's entry negative": dict(plan=unplanned),
            "the second GEMM's entry negative": dict(plan=half),
            "decreasing offs": dict(offs=unsorted),
            "a plan shorter than the busy count": dict(plan=plan[:2]),
            "offs ending before M": dict(offs=short),
            "fp32 x with bf16 weights": dict(x=x.float()),
            "x not contiguous": dict(x=x.t().contiguous().t()),
            "no tokens": dict(x=x[:0], s2r=p.slot_to_row[:0], out=torch.empty(0, 32, dtype=BF16)),
            "a weight neither row- nor column-major": dict(w13=strided),
            "int64 offs": dict(offs=p.offs.long()),
            "a map value out of range": dict(r2s=p.row_to_slot.clamp(max=0) - 2),
            "out of another dtype": dict(out=torch.full((3, 32), 7.0)),
            "row weights of another length": dict(rw=rw[:-1]),
        }
        for name, change in refusals.items():
            with self.subTest(name):
                ok, out = call(**change)
                self.assertFalse(ok)
                self.assertTrue(bool((out == 7).all()) or out.numel() == 0)
        # a -1 row inside the groups (padding) is a zero row, as the ops gather it
        r2s = p.row_to_slot.clone()
        r2s[1] = -1
        with torch.inference_mode(), _cpu_probe.force(**FEW_GEMM), op_path():
            ref = _op_steps(x, w13, w2, p.offs, rw, r2s, p.slot_to_row)
        for _ in range(2):  # (fresh scratch each time)
            ok, out = call(r2s=r2s)
            self.assertTrue(ok)
            self.assertTrue(torch.equal(out, ref))

    def test_profiler_and_autocast_take_the_python_path(self) -> None:
        p, inputs = _combine_inputs(1, BF16, seed=1, weighted=True)
        with _cpu_probe.force(**FEW_GEMM):
            step = self._step(p, inputs)
            self._run(p, inputs)  # decided
            with few_step_calls(step) as answers:
                with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]
                ) as prof:
                    self._run(p, inputs)
                with torch.autocast("cpu", dtype=BF16):
                    self._run(p, inputs)
                self._run(p, inputs)
        self.assertEqual(answers, [True])
        self.assertIn("torch_moe::grouped_swiglu", {e.name for e in prof.events()})

    @parametrize("tokens", [1, 3])
    @parametrize("shared", [False, True])
    def test_moe_layer_decode(self, tokens: int, shared: bool) -> None:
        # a layer's decode steps (top-2 of 6, a shared expert or not): the permutation,
        # the rows' weights and the experts in one call (moe_few) once the Python path has
        # decided the step's count of busy experts; the values of the layer with the one
        # call turned off, bit for bit
        torch.manual_seed(3)
        moe = MoE(32, 16, 6, 2, dtype=BF16, shared_hidden_dim=24 if shared else 0).eval()
        xs = [
            torch.randn(tokens, 32, generator=torch.Generator().manual_seed(i)).to(BF16)
            for i in range(8)
        ]
        with _cpu_probe.force(**FEW_GEMM), torch.inference_mode():
            with mock.patch.object(gs, "_FEW_STEP_ROWS", 0):
                want = [moe(x) for x in xs]
            row_w = torch.ones(2 * tokens)  # (the layer's routing weights: fp32)
            step = gs._few_step_plan(xs[0], moe.experts.w13, moe.experts.w2, row_w, 2 * tokens)
            self.assertIsNotNone(step)
            step.plan.fill_(-1)
            spy = mock.patch.object(gs, "_few_step", wraps=gs._few_step)
            with few_step_calls(step) as answers, spy as few:
                got = [moe(x) for x in xs]
        for a, b in zip(got, want, strict=True):
            self.assertTrue(torch.equal(a, b))
        # every step asks moe_few first; a refused one takes the Python path, whose node
        # (grouped_swiglu_combine) asks swiglu_combine_few: refused too, then decided
        self.assertEqual(answers.count(False), 2 * few.call_count)
        self.assertEqual(len(answers), len(xs) + few.call_count)
        self.assertGreater(answers.count(True), 0)

    def test_moe_few_refuses_bad_routes(self) -> None:
        # expert ids out of range, weights of another shape, float ids: refused, nothing
        # else asked (the Python path then raises its errors); otherwise the values of
        # permute_indices, the rows' weights and the experts' node
        moe = MoE(32, 16, 6, 2, dtype=BF16).eval()
        x = torch.randn(1, 32).to(BF16)
        w13, w2 = moe.experts.w13.detach(), moe.experts.w2.detach()
        weights = torch.tensor([[0.75, 0.25]])
        good = torch.tensor([[4, 1]])
        p = ops.permute_indices(good, 6)
        rw = weights.reshape(-1).index_select(0, p.row_to_slot)
        args = (x, w13, w2, p.offs, rw, p.row_to_slot, p.slot_to_row)
        with _cpu_probe.force(**FEW_GEMM), torch.inference_mode():
            step = gs._few_step_plan(x, w13, w2, weights, 2)
            step.plan.fill_(-1)
            gs.grouped_swiglu_combine(*args)  # decides the count (2 busy experts)
            bad = [
                (torch.tensor([[0, 6]]), weights),
                (torch.tensor([[-1, 0]]), weights),
                (good, weights[:, :1]),
                (good.float(), weights),
            ]
            with few_step_calls(step) as answers:
                for ids, w in bad:
                    self.assertIsNone(gs.few_moe_step(x, w13, w2, ids, w))
                self.assertIsNone(moe.experts.routed_one_call(x, bad[0][0], weights))
                out = gs.few_moe_step(x, w13, w2, good, weights)
                out_int32 = gs.few_moe_step(x, w13, w2, good.int(), weights)
            with op_path():
                ref = _op_steps(*args)
            # a gradient to record (grad mode, a weight that needs one): not this path's
            w = weights.clone().requires_grad_()
        with _cpu_probe.force(**FEW_GEMM), torch.enable_grad():
            self.assertIsNone(moe.experts.routed_one_call(x, good, w))
            with torch.no_grad():
                self.assertIsNotNone(moe.experts.routed_one_call(x, good, w))
        self.assertEqual(answers, [False] * (len(bad) + 1) + [True, True])
        self.assertTrue(torch.equal(out, ref))
        self.assertTrue(torch.equal(out_int32, ref))


class TestRoutedSwiGLU(TestCase):
    """``torch_moe::routed_swiglu``: a decode step's routed SwiGLU experts as one op of a
    traced graph, whose CPU kernel chooses eager's path when the graph runs (the one
    native call where the plan has it, else the Python path): the reference's values bit
    for bit at every size, its registrations and messages, and a compiled layer taking it
    (and the one call) where eager takes the one call."""

    def setUp(self) -> None:
        super().setUp()
        self.enterContext(mock.patch.object(_eager, "ENABLED", True))

    @staticmethod
    def _inputs(tokens: int, top_k: int, dtype: torch.dtype, seed: int, skew: bool) -> tuple:
        """(x, w13, w2, expert_ids, weights): 6 experts, D = 32, F = 16; ``skew`` sends
        every token to expert 0 (other experts empty)."""
        g = torch.Generator().manual_seed(seed)
        experts, dim, hidden = 6, 32, 16
        logits = torch.randn(tokens, experts, generator=g)
        if skew:
            logits[:, 0] += 8
        return (
            torch.randn(tokens, dim, generator=g).to(dtype),
            (torch.randn(experts, 2 * hidden, dim, generator=g) * 0.3).to(dtype),
            (torch.randn(experts, dim, hidden, generator=g) * 0.3).to(dtype),
            logits.topk(top_k, dim=-1).indices,
            torch.rand(tokens, top_k, generator=g),
        )

    @contextlib.contextmanager
    def _one_calls(self) -> Iterator[list[bool]]:
        """Whether each ``few_moe_step`` the op's kernel asks ran the one native call."""
        answers: list[bool] = []
        real = gs.few_moe_step

        def spy(*args: Any) -> Any:
            out = real(*args)
            answers.append(out is not None)
            return out

        with mock.patch.object(gs, "few_moe_step", spy):
            yield answers

    @parametrize("dtype", [BF16, F32, torch.float16])
    def test_equals_the_reference(self, dtype: torch.dtype) -> None:
        op = torch.ops.torch_moe.routed_swiglu.default
        # (tokens, top-k, skew): no tokens, one, one of top-1, skewed, and 80 rows (more
        # than the one call takes: the Python path every time)
        cases = [(0, 2, False), (1, 2, False), (1, 1, False), (3, 2, True), (8, 2, False)]
        took: list[bool] = []
        for tokens, top_k, skew in [*cases, (40, 2, True)]:
            args = self._inputs(tokens, top_k, dtype, seed=tokens + top_k, skew=skew)
            with self.subTest(tokens=tokens, top_k=top_k), torch.inference_mode():
                with _cpu_probe.force(**FEW_GEMM), op_path():  # each op by the dispatcher
                    ref = gs._routed_swiglu_ops(*args)
                with _cpu_probe.force(**FEW_GEMM), self._one_calls() as answers:
                    # the first call of a count of busy experts decides it (Python path)
                    got = [op(*args) for _ in range(3)]
                for out in got:
                    self.assertEqual(
                        (out.dtype, out.shape, out.stride()), (ref.dtype, ref.shape, ref.stride())
                    )
                    self.assertTrue(torch.equal(out, ref), "differs from the reference")
                self.assertEqual(len(answers), 3)
                if 0 < tokens * top_k <= gs._FEW_STEP_ROWS:
                    took += answers
                else:  # no tokens or too many rows: never asked of the native kernel
                    self.assertNotIn(True, answers)
        if dtype != F32 and _native.available():  # (the few-rows kernels' dtypes)
            self.assertIn(True, took, "the kernel never took the one call")

    def test_opcheck(self) -> None:
        for tokens in (0, 3):
            args = self._inputs(tokens, 2, BF16, seed=1, skew=False)
            torch.library.opcheck(torch.ops.torch_moe.routed_swiglu.default, args)

    def test_messages(self) -> None:
        op = torch.ops.torch_moe.routed_swiglu.default
        x, w13, w2, ids, w = self._inputs(3, 2, BF16, seed=0, skew=False)
        cases = [
            ((x[None], w13, w2, ids, w), r"x must be \[T, D\], w13 \[E, 2F, D\].*\[1, 3, 32\]"),
            ((x, w13, w2.float(), ids, w), r"share a dtype.*torch.bfloat16, torch.float32"),
            ((x[:, :16], w13, w2, ids, w), r"disagree: x \[3, 16\], w13 \[6, 32, 32\]"),
            ((x, w13[:, :30], w2, ids, w), r"disagree: .*w13 \[6, 30, 32\], w2 \[6, 32, 16\]"),
            ((x, w13, w2[:5], ids, w), r"disagree: .*w2 \[5, 32, 16\]"),
            ((x, w13, w2, ids[:2], w), r"expert_ids must be \[T, K\] with T = x.shape\[0\] = 3"),
            ((x, w13, w2, ids, w[:, :1]), r"weights must be floating \[T, K\].*\[3, 1\]"),
            ((x, w13, w2, ids, ids), r"weights must be floating .*torch.int64"),
        ]
        for args, msg in cases:
            with self.subTest(msg=msg):
                with self.assertRaisesRegex(ValueError, msg):
                    op(*args)
                with FakeTensorMode() as mode, self.assertRaisesRegex(ValueError, msg):
                    op(*(mode.from_tensor(a) for a in args))
        bad = ids.clone()
        bad[1, 0] = 6
        with self.assertRaisesRegex(RuntimeError, r"expert_ids must lie in \[0, num_experts=6\)"):
            op(x, w13, w2, bad, w)

    @parametrize("autocast", [False, True])
    def test_compiled_layer_takes_the_op(self, autocast: bool) -> None:
        """A compiled bf16 layer (fp32 under bf16 autocast) in inference calls the op, whose
        kernel takes the one call once the plan has the count, and equals eager bit for
        bit at decode and prefill sizes; with autograd the graph keeps the ops."""
        torch._dynamo.reset()  # (the suite's other compiled layers count as recompiles)
        self.addCleanup(torch._dynamo.reset)
        torch.manual_seed(0)
        moe = MoE(32, 16, 6, 2, dtype=F32 if autocast else BF16, shared_hidden_dim=8).eval()
        backend = EagerAndRecordGraphs()
        compiled = torch.compile(copy.deepcopy(moe), fullgraph=True, backend=backend)
        gen = torch.Generator().manual_seed(1)
        amp = torch.autocast("cpu", BF16, enabled=autocast)
        with _cpu_probe.force(**FEW_GEMM), amp, self._one_calls() as answers:
            for tokens in (1, 1, 3, 40):
                x = torch.randn(tokens, 32, generator=gen).to(moe.experts.w13.dtype)
                with torch.inference_mode():
                    want, got = moe(x), compiled(x)
                self.assertTrue(torch.equal(got, want), f"{tokens} tokens")
        targets = {n.target for gm in backend.graphs for n in gm.graph.nodes}
        self.assertIn(torch.ops.torch_moe.routed_swiglu.default, targets)
        if _native.available() and not autocast:  # (no one call under CPU autocast)
            self.assertIn(True, answers[1:])
        backend.graphs.clear()
        training = torch.compile(copy.deepcopy(moe).train(), fullgraph=True, backend=backend)
        with amp:
            training(torch.randn(3, 32).to(moe.experts.w13.dtype))
        targets = {n.target for n in backend.graphs[-1].graph.nodes}
        self.assertNotIn(torch.ops.torch_moe.routed_swiglu.default, targets)
        self.assertIn(torch.ops.torch_moe.grouped_swiglu.default, targets)


def _assert_same_as_ops(test: TestCase, got: tuple, ref: tuple) -> None:
    """``_run``'s outputs and gradients, bit for bit, with dtypes, shapes and strides."""
    for a, b in zip(got[0] + got[1], ref[0] + ref[1], strict=True):
        test.assertEqual((a.dtype, a.shape, a.stride()), (b.dtype, b.shape, b.stride()))
        test.assertTrue(torch.equal(a, b), "differs from the ops' result")


def _fill(args: list, present: tuple) -> list:
    """``args`` with its non-None entries replaced, in order, by ``present``."""
    it = iter(present)
    return [None if a is None else next(it) for a in args]


instantiate_parametrized_tests(TestDirectCalls)
instantiate_parametrized_tests(TestSwiGLUCombine)
instantiate_parametrized_tests(TestFewStep)
instantiate_parametrized_tests(TestRoutedSwiGLU)
instantiate_parametrized_tests(TestGLUCombine)
instantiate_parametrized_tests(TestExpertsNodesFuzz)
instantiate_parametrized_tests(TestMoELayerNode)

if __name__ == "__main__":
    run_tests()
