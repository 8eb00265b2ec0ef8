# Owner(s): ["module: moe"]
"""Property-based tests (hypothesis): the whole local MoE pipeline (route -> permute ->
grouped_swiglu -> unpermute) on random problems against the naive float64 loops of
test/naive.py, which choose the experts, drop past the capacity and combine on their own
(nothing of the implementation's routing or dispatch is reused).

The strategy draws every routing option (score function, expert bias, group-limited
routing, renormalization, scale), a capacity (none, zero, tight, loose), ``align`` in
{1, 16, 32, 128}, the dtype (fp64, fp32, bf16: tolerances from test/tolerances.py's error
bounds for that dtype), and shapes with T = 0, E = 1 and K = E reachable (and pinned as
explicit examples). ``TestFP8KernelProperties`` draws the FP8 / MX quantizers' and the
scaled grouped GEMM's operands (empty and odd shapes, dtypes, layouts, blocks, special
values) against their references. The profile (test/conftest.py) sets the number of
random examples:
``dev`` 20, ``ci`` 200 (what .ci/run uses). Shrunk failures found so far are the explicit
``@example`` cases at the end of the list, with what they caught.
"""

import importlib

import naive
import tolerances
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st
from test_cpu_probe import intra_op_threads
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_moe  # noqa: F401
from torch_moe import ops
from torch_moe import quantization as Q
from torch_moe.nn.functional import grouped_swiglu

ops_q = torch.ops.torch_moe

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


def _problem(
    num_experts=4,
    k=2,
    num_tokens=6,
    dim=3,
    hidden=2,
    skew=0.0,
    seed=0,
    align=1,
    capacity=None,
    score_func="softmax",
    bias=False,
    groups=None,
    route_norm=False,
    route_scale=1.0,
    dtype="fp64",
):
    return dict(
        num_experts=num_experts,
        k=k,
        num_tokens=num_tokens,
        dim=dim,
        hidden=hidden,
        skew=skew,
        seed=seed,
        align=align,
        capacity=capacity,
        score_func=score_func,
        bias=bias,
        groups=groups,
        route_norm=route_norm,
        route_scale=route_scale,
        dtype=dtype,
    )


@st.composite
def moe_problems(draw, dtypes=tuple(DTYPES)):
    num_experts = draw(st.integers(1, 8))
    groups = None
    max_k = num_experts
    divisors = [g for g in range(2, num_experts + 1) if num_experts % g == 0]
    if divisors and draw(st.booleans()):
        num_groups = draw(st.sampled_from(divisors))
        limited = draw(st.integers(1, num_groups))
        groups = (num_groups, limited)
        max_k = limited * (num_experts // num_groups)
    k = draw(st.integers(1, max_k))
    num_tokens = draw(st.integers(0, 24))
    capacity = draw(
        st.one_of(
            st.none(),
            st.just(0),
            st.integers(1, max(1, num_tokens * k // num_experts)),  # drops (when T > 0)
            st.integers(num_tokens * k, num_tokens * k + 3),  # never binding
        )
    )
    return _problem(
        num_experts=num_experts,
        k=k,
        num_tokens=num_tokens,
        dim=draw(st.integers(1, 9)),
        hidden=draw(st.integers(1, 7)),
        # routing distribution: an expert-popularity skew (0 uniform .. 8 one expert)
        skew=draw(st.sampled_from([0.0, 1.0, 3.0, 8.0])),
        seed=draw(st.integers(0, 2**16)),
        align=draw(st.sampled_from([1, 16, 32, 128])),
        capacity=capacity,
        score_func=draw(st.sampled_from(["softmax", "sigmoid", "softmax_topk", "sigmoid_topk"])),
        bias=draw(st.booleans()),
        groups=groups,
        route_norm=draw(st.booleans()),
        route_scale=draw(st.sampled_from([1.0, 2.5, 0.25])),
        dtype=draw(st.sampled_from(dtypes)),
    )


def _route_kw(p, bias):
    kw = dict(
        score_func=p["score_func"],
        expert_bias=bias,
        route_norm=p["route_norm"],
        route_scale=p["route_scale"],
    )
    if p["groups"] is not None:
        kw.update(num_expert_groups=p["groups"][0], num_limited_groups=p["groups"][1])
    return kw


def _make(p):
    """logits, x, w13, w2 in the problem's dtype, and the expert bias (fp32, or fp64 for
    fp64 logits: the dtype the routing math runs in). Logits are distinct within a row in
    the working dtype, so that no exact tie decides the choice."""
    dtype = DTYPES[p["dtype"]]
    g = torch.Generator().manual_seed(p["seed"])
    e, d, f = p["num_experts"], p["dim"], p["hidden"]
    popularity = -p["skew"] * torch.arange(e, dtype=torch.float64)
    logits = (torch.randn(p["num_tokens"], e, generator=g, dtype=torch.float64) + popularity).to(
        dtype
    )
    sorted_logits = logits.double().sort(1).values
    assume(bool((sorted_logits[:, 1:] > sorted_logits[:, :-1]).all()))
    x = torch.randn(p["num_tokens"], d, generator=g, dtype=torch.float64).to(dtype)
    w13 = (torch.randn(e, 2 * f, d, generator=g, dtype=torch.float64) / d**0.5).to(dtype)
    w2 = (torch.randn(e, d, f, generator=g, dtype=torch.float64) / f**0.5).to(dtype)
    bias = None
    if p["bias"]:
        bias_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        bias = (torch.randn(e, generator=g, dtype=torch.float64) * 0.1).to(bias_dtype)
    return logits, x, w13, w2, bias


def _naive_out_and_bound(p, logits, x, w13, w2, bias):
    """The float64 oracle (naive.route, naive.dispatch's capacity rule, one SwiGLU per
    kept assignment, the weighted sum) and the elementwise error bound of the op's result
    in the problem's dtype (tolerances.py: routing weights, SwiGLU, combine)."""
    dtype = DTYPES[p["dtype"]]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    w, ids, counts = naive.route(logits.double(), p["k"], **_route_kw(p, bias))
    dw = tolerances.routing_weight_bound(logits, w, acc)
    out = torch.zeros(x.shape, dtype=torch.float64)
    bound = torch.zeros(x.shape, dtype=torch.float64)
    used = [0] * p["num_experts"]
    for t in range(x.shape[0]):
        ys, dys, kept = [], [], []
        for j in range(p["k"]):
            e = int(ids[t, j])
            used[e] += 1
            if p["capacity"] is not None and used[e] > p["capacity"]:
                continue
            y, dy = tolerances.swiglu_bound(x[t : t + 1], w13[e], w2[e], dtype, acc)
            ys.append(y[0])
            dys.append(dy[0])
            kept.append(j)
        if kept:
            out[t], bound[t] = tolerances.combine_bound(
                w[t, kept], dw[t, kept], torch.stack(ys), torch.stack(dys), dtype, acc
            )
    return w, dw, ids, counts, out, bound


def _check_pipeline(test, p):
    logits, x, w13, w2, bias = _make(p)
    dtype = DTYPES[p["dtype"]]
    weights, ids, counts = ops.topk_route(logits, p["k"], **_route_kw(p, bias))
    ref_w, ref_dw, ref_ids, ref_counts, ref_out, bound = _naive_out_and_bound(
        p, logits, x, w13, w2, bias
    )
    test.assertEqual(ids, ref_ids)
    test.assertEqual(counts, ref_counts)
    tolerances.assert_within(test, weights, ref_w, ref_dw, "routing weights")

    x_perm, perm = ops.permute(x, ids, p["num_experts"], align=p["align"], capacity=p["capacity"])
    rows, ends, dropped = naive.dispatch(ref_ids, p["num_experts"], p["align"], p["capacity"])
    test.assertEqual(perm.offs.tolist(), ends)
    test.assertEqual(int(perm.num_dropped), dropped)
    # the permuted rows hold the naive dispatch's tokens, and zeros for padding
    for r, slot in enumerate(rows):
        want = x[slot[0]] if slot is not None else torch.zeros_like(x[0])
        test.assertEqual(x_perm[r], want, atol=0, rtol=0)
    out = ops.unpermute(grouped_swiglu(x_perm, w13, w2, perm.offs), weights, perm)
    test.assertEqual(out.dtype, dtype)
    tolerances.assert_within(test, out, ref_out, bound, f"pipeline {p['dtype']}")


# explicit cases: the corners the strategy can reach, pinned
CORNERS = [
    _problem(num_tokens=0),  # T = 0
    _problem(num_experts=1, k=1, capacity=2, align=16),  # E = 1
    _problem(num_experts=4, k=4, score_func="sigmoid", route_norm=True),  # K = E
    _problem(num_experts=8, k=3, groups=(4, 2), bias=True, score_func="sigmoid", route_scale=2.5),
    _problem(num_tokens=20, capacity=3, align=32, dtype="bf16", skew=1.0),
    _problem(num_tokens=9, k=1, capacity=0, align=128, dtype="fp32"),
]


def _with_examples(fn):
    for p in CORNERS:
        fn = example(p)(fn)
    return fn


class TestMoEPipelineProperties(TestCase):
    @_with_examples
    @given(moe_problems())
    def test_pipeline_matches_naive(self, p):
        _check_pipeline(self, p)

    @_with_examples
    @given(moe_problems(dtypes=("fp64",)))
    def test_pipeline_gradients_match_float64_autograd(self, p):
        p = {**p, "dtype": "fp64"}
        logits, x, w13, w2, bias = _make(p)
        leaves = [t.clone().requires_grad_() for t in (logits, x, w13, w2)]
        lg, xx, a, b = leaves
        weights, ids, _ = ops.topk_route(lg, p["k"], **_route_kw(p, bias))
        x_perm, perm = ops.permute(
            xx, ids, p["num_experts"], align=p["align"], capacity=p["capacity"]
        )
        out = ops.unpermute(grouped_swiglu(x_perm, a, b, perm.offs), weights, perm)
        grad = torch.randn(out.shape, dtype=torch.float64)
        got = torch.autograd.grad(out, leaves, grad, allow_unused=True)

        # naive.pipeline_autograd routes and drops on its own (naive.route, token order)
        ref_leaves = [t.clone().requires_grad_() for t in (logits, x, w13, w2)]
        ref_out = naive.pipeline_autograd(
            *ref_leaves, p["k"], capacity=p["capacity"], **_route_kw(p, bias)
        )
        # float64 throughout: every value is a sum of at most T*K + F + D products of
        # O(1) terms, so the rounding is below 1e3 * 2^-53 * 400 ~ 5e-11
        tight = dict(atol=1e-10, rtol=1e-10)
        self.assertEqual(out, ref_out, **tight)
        if ref_out.requires_grad:
            want = torch.autograd.grad(ref_out, ref_leaves, grad, allow_unused=True)
        else:
            want = [None] * 4
        for g_got, g_want, leaf in zip(got, want, ref_leaves):
            zero = torch.zeros_like(leaf)
            self.assertEqual(
                g_got if g_got is not None else zero,
                g_want if g_want is not None else zero,
                **tight,
            )


# --------------------------------------------------------------------------------------
# the FP8 / MX emulation's kernels against their references (a differential fuzz of the
# forty-ninth session found a crash and four mishandled cases at empty or extreme operands:
# each is now also a fixed test in test_native / test_quantization / test_scaled_grouped_mm)

FP8_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SIZES = st.one_of(st.sampled_from([0, 1, 2, 3, 31, 32, 33, 127, 128, 129]), st.integers(1, 300))


@st.composite
def fp8_operands(draw, rows=SIZES, cols=SIZES):
    """x [rows, cols] in a dtype and layout (contiguous, a transposed copy's view, a column
    slice of a wider tensor), normal values of random magnitudes per row, and (half the
    draws) special values at random places: zeros of both signs, the dtype's denormals and
    largest values, infinities, NaN."""
    r, c = draw(rows), draw(cols)
    dtype = FP8_DTYPES[draw(st.sampled_from(list(FP8_DTYPES)))]
    layout = draw(st.sampled_from(["contig", "t", "slice"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(r, c, generator=g) * torch.rand(r, 1, generator=g).mul(20).sub(10).exp()
    if draw(st.booleans()) and x.numel():
        info = torch.finfo(dtype)
        special = torch.tensor([0.0, -0.0, info.tiny / 4, info.max, -info.max, float("inf"),
                                float("-inf"), float("nan")])  # fmt: skip
        at = torch.randint(0, x.numel(), (max(1, x.numel() // 50),), generator=g)
        x.view(-1)[at] = special[torch.randint(0, len(special), at.shape, generator=g)]
    x = x.to(dtype)
    if layout == "t":
        return x.t().contiguous().t()
    if layout == "slice":
        return torch.cat([x, x[:, :3]], 1)[:, : x.shape[1]]
    return x


def _same_bits(test, got, want, what):
    """Equal tensors bit for bit, NaN where NaN (its payload aside: ATen's casts differ)."""
    test.assertEqual(got.shape, want.shape, msg=what)
    test.assertEqual(got.dtype, want.dtype, msg=what)
    g = got.view(torch.uint8) if got.dtype.itemsize == 1 else got
    w = want.view(torch.uint8) if want.dtype.itemsize == 1 else want
    if got.dtype == torch.float8_e4m3fn:  # NaN codes: 0x7F and 0xFF
        test.assertTrue(torch.equal(g, w), msg=what)
        return
    nan = w.isnan() if w.is_floating_point() else torch.zeros_like(w, dtype=torch.bool)
    test.assertTrue(torch.equal(g.isnan() if g.is_floating_point() else nan, nan), msg=what)
    test.assertTrue(torch.equal(g[~nan], w[~nan]), msg=what)


def _both_thread_counts(fn):
    """fn() on one intra-op thread, then on two."""
    outs = []
    for n in (1, 2):
        with intra_op_threads(n):
            outs.append(fn())
    return outs


class TestFP8KernelProperties(TestCase):
    """The quantizers' fast paths (torch_moe/csrc/fp8_cpu.cpp where it runs, else the ATen
    forms) bit for bit their references, on one and two threads, for random shapes (empty
    and odd included), dtypes, layouts, blocks and special values; the scaled grouped
    GEMM within the rounding bound of the float64 dequantized product."""

    @given(
        fp8_operands(),
        st.sampled_from([(-1, -1), (1, -1), (-1, 1), (1, 128), (128, 128), (1, 32), (7, 100)]),
    )
    def test_quantize_fp8_equals_reference(self, x, block):
        want = Q.quantize_fp8_reference(x, block)
        for got in _both_thread_counts(lambda: Q.quantize_fp8(x, block)):
            for g, w, what in zip(got, want, ("codes", "scales")):
                _same_bits(self, g, w, f"{what} {list(x.shape)} {x.dtype} {block}")

    @given(fp8_operands(rows=st.integers(0, 200), cols=st.integers(0, 8).map(lambda n: 32 * n)),
           st.sampled_from([32, 16, 1]), st.sampled_from(["floor", "rceil"]),
           st.sampled_from([torch.uint8, torch.float32]), st.sampled_from([-1, -2]))  # fmt: skip
    def test_quantize_mx_equals_reference(self, x, block, rule, scale_dtype, dim):
        if dim == -2:
            x = x.t()
        kw = dict(dim=dim, block=block, scale_rule=rule, scale_dtype=scale_dtype)
        want = Q.quantize_mx_reference(x, **kw)
        for got in _both_thread_counts(lambda: Q.quantize_mx(x, **kw)):
            for g, w, what in zip(got, want, ("codes", "scales")):
                _same_bits(self, g, w, f"{what} {list(x.shape)} {x.dtype} {kw}")

    @given(fp8_operands(rows=st.integers(0, 300), cols=st.integers(0, 70)),
           st.lists(st.integers(0, 90), max_size=6), st.sampled_from([128, 32, 1, -1]),
           st.sampled_from(["fp8", "mx"]))  # fmt: skip
    def test_quantize_jagged_equals_reference(self, x, sizes, block, fmt):
        ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
        offs = ends.clamp(max=x.shape[0]).to(torch.int32)  # groups within the rows (a tail)
        block = 32 if fmt == "mx" and block == -1 else block
        kw = dict(block=block, fmt=fmt, scale_dtype=torch.float32)
        want = Q.quantize_jagged_reference(x, offs, **kw)
        for got in _both_thread_counts(lambda: Q.quantize_jagged(x, offs, **kw)):
            for g, w, what in zip(got, want, ("codes", "scales")):
                _same_bits(self, g, w, f"{what} {list(x.shape)} {x.dtype} {sizes} {kw}")

    @given(st.sampled_from(sorted(Q.RECIPES)), st.sampled_from(["forward", "dgrad"]),
           st.lists(st.integers(0, 150), min_size=0, max_size=5), st.integers(0, 4),
           st.integers(0, 5).map(lambda n: 32 * n), st.sampled_from([0, 1, 32, 70, 256]),
           st.integers(0, 2**16), st.sampled_from([torch.bfloat16, torch.float32]))  # fmt: skip
    def test_scaled_grouped_mm_within_bound(self, recipe, gemm, sizes, tail, k, n, seed, out_dtype):
        from test_scaled_grouped_mm import _exact_and_bound, _operands

        g = getattr(Q.RECIPES[recipe], gemm)
        offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
        m = sum(sizes) + tail
        _, _, qa, sa, qb, sb = _operands(g, m, k, n, len(sizes), seed)
        assume(qa.numel() and qb.numel())  # (empty operands: test_scaled_grouped_mm)
        exact, bound = _exact_and_bound(qa, sa, qb, sb, offs, g, out_dtype)
        for got in _both_thread_counts(
            lambda: ops_q.scaled_grouped_mm(
                qa, qb, sa, sb, offs, g.lhs.inner, g.rhs.outer, out_dtype
            )
        ):
            tolerances.assert_within(self, got, exact, bound, f"{recipe} {gemm} {sizes} {k} {n}")

    @given(st.lists(st.integers(0, 150), min_size=1, max_size=5), st.integers(0, 4),
           st.integers(1, 4).map(lambda n: 32 * n), st.sampled_from([1, 40, 300]),
           st.booleans(), st.integers(0, 2**16))  # fmt: skip
    def test_mx_pieces_equal_the_copies(self, sizes, tail, k, n, cols, seed):
        """MX's GEMMs by the native kernels' pieces (the probe forced to the threaded
        kernel's native GEMM) bit for bit the bf16 copies' ``grouped_mm`` and
        ``grouped_mm_wgrad``: random groups (empty ones, rows past the last), K, N (one
        and two column pieces), experts row- or column-major, one and two threads."""
        from unittest import mock

        from test_scaled_grouped_mm import _operands

        from torch_moe._ops import _cpu_probe

        S = importlib.import_module("torch_moe.quantization.scaled_grouped_mm")
        bf = torch.bfloat16
        if not (S.native_gemm_ready(bf) and S.bf16_gemms_native()):
            self.skipTest("no native bf16 GEMM here")
        r = Q.RECIPES["mxfp8"]
        offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
        m = sum(sizes) + tail
        _, _, qa, sa, qb, sb = _operands(r.forward, m, k, n, len(sizes), seed)
        if cols:
            qb = qb.transpose(1, 2).contiguous().transpose(1, 2)
        g = torch.Generator().manual_seed(seed)
        x, dy = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
        qx, sx = S.quantize_wgrad_operand(x, offs, r.wgrad.lhs)
        qdy, sdy = S.quantize_wgrad_operand(dy, offs, r.wgrad.rhs)

        def both():
            fwd = ops_q.scaled_grouped_mm(qa, qb, sa, sb, offs, 32, 1, bf)
            return fwd, ops_q.scaled_grouped_mm_wgrad(qx, qdy, sx, sdy, offs, 32, bf)

        probe = dict(threads_mm="native", gemm_kernel="native", layout="as_is", few_gemm="aten")
        with _cpu_probe.force(probe):
            got = _both_thread_counts(both)
            with mock.patch.object(S, "_mx_pieces", lambda *args: False):
                want = _both_thread_counts(both)
        for t in range(2):
            for i, what in enumerate(("forward", "wgrad")):
                _same_bits(self, got[t][i], want[t][i], f"{what} {sizes} {k} {n} {cols} t{t + 1}")


class TestStrategyReach(TestCase):
    """The strategy reaches what the module docstring claims (so a change to it cannot
    silently stop drawing a corner): checked on a fixed sample of draws."""

    def test_reaches_every_option(self):
        seen = set()
        drops = 0

        @given(moe_problems())
        def collect(p):
            nonlocal drops
            seen.update(
                {
                    ("T=0", p["num_tokens"] == 0),
                    ("E=1", p["num_experts"] == 1),
                    ("K=E", p["k"] == p["num_experts"]),
                    ("groups", p["groups"] is not None),
                    ("bias", p["bias"]),
                    ("score", p["score_func"]),
                    ("norm", p["route_norm"]),
                    ("scale", p["route_scale"]),
                    ("align", p["align"]),
                    ("dtype", p["dtype"]),
                    ("capacity", p["capacity"] is not None),
                }
            )
            if p["capacity"] is not None and p["num_tokens"] * p["k"] > p["num_experts"] * max(
                p["capacity"], 0
            ):
                drops += 1

        from hypothesis import settings

        settings(max_examples=400, derandomize=True, database=None)(collect)()
        for key in [
            ("T=0", True),
            ("E=1", True),
            ("K=E", True),
            ("groups", True),
            ("bias", True),
            *[("score", s) for s in ("softmax", "sigmoid", "softmax_topk", "sigmoid_topk")],
            ("norm", True),
            ("scale", 2.5),
            *[("align", a) for a in (1, 16, 32, 128)],
            *[("dtype", d) for d in DTYPES],
            ("capacity", True),
        ]:
            self.assertIn(key, seen)
        self.assertGreater(drops, 0)


if __name__ == "__main__":
    run_tests()
