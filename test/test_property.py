# Owner(s): ["module: moe"]
"""Property-based tests (hypothesis): random shapes and routing distributions, the whole
local MoE pipeline (route -> permute -> grouped_swiglu -> unpermute) against naive loops."""

import naive
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_moe  # noqa: F401
from torch_moe import ops
from torch_moe.nn.functional import grouped_swiglu

SETTINGS = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def moe_problems(draw):
    num_experts = draw(st.integers(1, 8))
    k = draw(st.integers(1, num_experts))
    num_tokens = draw(st.integers(0, 24))
    dim = draw(st.integers(1, 9))
    hidden = draw(st.integers(1, 7))
    # routing distribution: logits with an expert-popularity skew (0 uniform .. 8 one expert)
    skew = draw(st.sampled_from([0.0, 1.0, 3.0, 8.0]))
    seed = draw(st.integers(0, 2**16))
    align = draw(st.sampled_from([1, 1, 2, 4]))
    capacity = draw(st.sampled_from([None, None, 0, 1, 3]))
    score_func = draw(st.sampled_from(["softmax", "sigmoid", "softmax_topk"]))
    route_norm = draw(st.booleans())
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
        route_norm=route_norm,
    )


def _make(p):
    g = torch.Generator().manual_seed(p["seed"])
    e, d, f = p["num_experts"], p["dim"], p["hidden"]
    popularity = -p["skew"] * torch.arange(e, dtype=torch.float64)
    logits = torch.randn(p["num_tokens"], e, generator=g, dtype=torch.float64) + popularity
    x = torch.randn(p["num_tokens"], d, generator=g, dtype=torch.float64)
    w13 = torch.randn(e, 2 * f, d, generator=g, dtype=torch.float64) / d**0.5
    w2 = torch.randn(e, d, f, generator=g, dtype=torch.float64) / f**0.5
    return logits, x, w13, w2


class TestMoEPipelineProperties(TestCase):
    @SETTINGS
    @given(moe_problems())
    def test_pipeline_matches_naive(self, p):
        logits, x, w13, w2 = _make(p)
        weights, ids, counts = ops.topk_route(
            logits, p["k"], score_func=p["score_func"], route_norm=p["route_norm"]
        )
        ref_w, ref_ids, ref_counts = naive.route(
            logits, p["k"], score_func=p["score_func"], route_norm=p["route_norm"]
        )
        self.assertEqual(ids, ref_ids)
        self.assertEqual(counts, ref_counts)
        self.assertEqual(weights, ref_w)

        x_perm, perm = ops.permute(
            x, ids, p["num_experts"], align=p["align"], capacity=p["capacity"]
        )
        _, ends, dropped = naive.dispatch(ids, p["num_experts"], p["align"], p["capacity"])
        self.assertEqual(perm.offs.tolist(), ends)
        self.assertEqual(int(perm.num_dropped), dropped)
        out = ops.unpermute(grouped_swiglu(x_perm, w13, w2, perm.offs), weights, perm)
        ref = naive.moe(x, ref_w, ref_ids, w13, w2, capacity=p["capacity"])
        self.assertEqual(out, ref)

    @SETTINGS
    @given(moe_problems())
    def test_pipeline_gradients_match_float64_autograd(self, p):
        logits, x, w13, w2 = _make(p)
        leaves = [t.clone().requires_grad_() for t in (logits, x, w13, w2)]
        lg, xx, a, b = leaves
        weights, ids, _ = ops.topk_route(
            lg, p["k"], score_func=p["score_func"], route_norm=p["route_norm"]
        )
        x_perm, perm = ops.permute(
            xx, ids, p["num_experts"], align=p["align"], capacity=p["capacity"]
        )
        out = ops.unpermute(grouped_swiglu(x_perm, a, b, perm.offs), weights, perm)
        grad = torch.randn(out.shape, dtype=torch.float64)
        got = torch.autograd.grad(out, leaves, grad, allow_unused=True)

        # the same function written with plain autograd ops, one token at a time
        ref_leaves = [t.clone().requires_grad_() for t in (logits, x, w13, w2)]
        lg, xx, a, b = ref_leaves
        if p["score_func"] == "softmax":
            w = torch.softmax(lg, -1).gather(1, ids)
        elif p["score_func"] == "sigmoid":
            w = torch.sigmoid(lg).gather(1, ids)
        else:
            w = torch.softmax(lg.gather(1, ids), -1)
        if p["route_norm"]:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        rows_out = []
        kept = perm.slot_to_row >= 0
        for t in range(x.shape[0]):
            acc = torch.zeros(x.shape[1], dtype=torch.float64)
            for j in range(p["k"]):
                if kept[t, j]:
                    e = int(ids[t, j])
                    h = a[e] @ xx[t]
                    gate, up = h.chunk(2)
                    acc = acc + w[t, j] * (b[e] @ (torch.nn.functional.silu(gate) * up))
            rows_out.append(acc)
        ref_out = (
            torch.stack(rows_out) if rows_out else torch.zeros(0, x.shape[1], dtype=torch.float64)
        )
        self.assertEqual(out, ref_out)
        if ref_out.requires_grad:
            want = torch.autograd.grad(ref_out, ref_leaves, grad, allow_unused=True)
        else:
            want = [None] * 4
        for g_got, g_want, leaf in zip(got, want, ref_leaves):
            zero = torch.zeros_like(leaf)
            self.assertEqual(
                g_got if g_got is not None else zero, g_want if g_want is not None else zero
            )


if __name__ == "__main__":
    run_tests()
