# Owner(s): ["module: moe"]
"""Tests for torch_moe::topk_route against a naive per-token float64 loop."""

import math
import re

import naive
import torch
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe  # noqa: F401
from torch_moe._ops import routing as _routing
from torch_moe.ops import topk_route

CONFIGS = {
    "mixtral": dict(score_func="softmax", route_norm=True),
    "qwen3_no_norm": dict(score_func="softmax"),
    "gpt_oss": dict(score_func="softmax_topk"),
    "kolibri": dict(score_func="sigmoid_topk", bias=True, route_norm=True),  # bias on logits
    "sigmoid_scaled": dict(score_func="sigmoid", route_norm=True, route_scale=2.5),
    "deepseek_v3": dict(
        score_func="sigmoid",
        bias=True,
        num_expert_groups=4,
        num_limited_groups=2,
        route_norm=True,
        route_scale=2.5,
    ),
    "softmax_groups_bias": dict(
        score_func="softmax", bias=True, num_expert_groups=8, num_limited_groups=3
    ),
}


def _route_args(cfg, num_experts, seed=0):
    cfg = dict(cfg)
    bias = None
    if cfg.pop("bias", False):
        g = torch.Generator().manual_seed(seed + 1)
        bias = torch.randn(num_experts, generator=g, dtype=torch.float64) * 0.1
    return cfg, bias


class TestTopKRoute(TestCase):
    @parametrize("name", list(CONFIGS))
    @parametrize("shape", [(0, 16, 2), (37, 16, 1), (64, 16, 4), (5, 16, 16), (19, 16, 6)])
    def test_matches_naive(self, name, shape):
        num_tokens, num_experts, k = shape
        cfg, bias = _route_args(CONFIGS[name], num_experts)
        if cfg.get("num_limited_groups"):  # k may not exceed the experts left by the group limit
            k = min(k, cfg["num_limited_groups"] * num_experts // cfg["num_expert_groups"])
        logits = torch.randn(num_tokens, num_experts, dtype=torch.float64)
        w, ids, counts = topk_route(logits, k, expert_bias=bias, **cfg)
        ref_w, ref_ids, ref_counts = naive.route(logits, k, expert_bias=bias, **cfg)
        self.assertEqual(ids, ref_ids)
        self.assertEqual(counts, ref_counts)
        self.assertEqual(w, ref_w, atol=1e-12, rtol=1e-12)
        self.assertEqual(w.dtype, torch.float64)

    @parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_low_precision_logits_route_in_fp32(self, dtype):
        # distinct values per row (exact in bf16) so that no tie decides the comparison
        logits = (torch.stack([torch.randperm(8) for _ in range(50)]) / 4 - 1).to(dtype)
        w, ids, _ = topk_route(logits, 2, route_norm=True)
        ref_w, ref_ids, _ = naive.route(logits.double(), 2, route_norm=True)
        self.assertEqual(w.dtype, torch.float32)
        self.assertEqual(ids, ref_ids)
        self.assertEqual(w, ref_w.float(), atol=1e-6, rtol=1e-5)

    @parametrize("impl", ["op", "reference"])
    def test_tiny_weights_and_one_group(self, impl):
        """route_norm's +1e-20 matters when the weights themselves are ~1e-20 (sigmoid of
        logits near -46); one expert group keeps every expert (plain top-k). The op and its
        plain-PyTorch reference (the oracle of faster kernels) against the float64 loop."""
        fn = topk_route if impl == "op" else _routing.topk_route_reference
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(9, 6, generator=g, dtype=torch.float64) - 46.0
        for kw in (
            dict(score_func="sigmoid", route_norm=True),
            dict(score_func="softmax", num_expert_groups=1, num_limited_groups=1),
        ):
            w, ids, counts = fn(logits, 2, **kw)
            ref_w, ref_ids, ref_counts = naive.route(logits, 2, **kw)
            self.assertEqual(ids, ref_ids)
            self.assertEqual(counts, ref_counts)
            self.assertEqual(w, ref_w, atol=0, rtol=1e-12)

    def test_single_expert(self):
        w, ids, counts = topk_route(torch.randn(5, 1), 1)
        self.assertEqual(ids, torch.zeros(5, 1, dtype=torch.int64))
        self.assertEqual(w, torch.ones(5, 1))
        self.assertEqual(counts, torch.tensor([5]))

    def test_bias_changes_choice_not_weights(self):
        logits = torch.randn(32, 8, dtype=torch.float64)
        bias = torch.zeros(8, dtype=torch.float64)
        bias[3] = 100.0
        w, ids, counts = topk_route(logits, 2, score_func="sigmoid", expert_bias=bias)
        self.assertTrue((ids[:, 0] == 3).all())
        self.assertEqual(counts[3], 32)
        self.assertEqual(w[:, 0], torch.sigmoid(logits[:, 3]))

    def test_sigmoid_topk_biases_the_logits(self):
        """Without a bias "sigmoid_topk" is "sigmoid" (sigmoid is monotone); with one it
        selects on logits + bias (a bias of 1 moves a logit far more than a sigmoid
        score near 1), the weights the unbiased sigmoids either way (times the scale)."""
        g = torch.Generator().manual_seed(4)
        logits = 4 * torch.randn(64, 8, generator=g)
        plain = topk_route(logits, 2, score_func="sigmoid", route_norm=True)
        same = topk_route(logits, 2, score_func="sigmoid_topk", route_norm=True)
        for a, b in zip(plain, same):
            self.assertEqual(a, b, atol=0, rtol=0)
        bias = torch.randn(8, generator=g)
        w, ids, _ = topk_route(
            logits, 2, score_func="sigmoid_topk", expert_bias=bias, route_scale=2.0
        )
        self.assertEqual(ids, (logits + bias).topk(2, dim=-1).indices)
        self.assertEqual(w, 2.0 * torch.sigmoid(logits.gather(1, ids)), atol=0, rtol=0)
        on_scores = topk_route(logits, 2, score_func="sigmoid", expert_bias=bias)[1]
        self.assertGreater((ids != on_scores).any(-1).float().mean().item(), 0.2)

    def test_group_limit_restricts_choice(self):
        # Group 0 (experts 0..3) carries huge logits: with one group kept every choice is there.
        logits = torch.randn(20, 16, dtype=torch.float64)
        logits[:, :4] += 50
        _, ids, _ = topk_route(
            logits, 3, score_func="sigmoid", num_expert_groups=4, num_limited_groups=1
        )
        self.assertTrue((ids < 4).all())

    @parametrize("impl", ["op", "reference"])
    def test_group_score_max(self, impl):
        """DeepSeek-V2's group_limited_greedy: a group is scored by its best expert. Groups
        of four with one strong expert against groups of four fair ones: "max" keeps the
        first, "top2_sum" the second; both against the float64 loop."""
        fn = topk_route if impl == "op" else _routing.topk_route_reference
        g = torch.Generator().manual_seed(0)
        logits = 0.02 * torch.randn(40, 16, generator=g, dtype=torch.float64)
        logits[:20, 0] += 2.9  # one strong expert in group 0: e^2.9 ~ 18 (+ ~1 for its second)
        logits[:20, 4:8] += 2.5  # four fair experts in group 1: e^2.5 ~ 12 each, 24 for two
        kw = dict(num_expert_groups=4, num_limited_groups=1, route_scale=16.0)
        for group_score in ("max", "top2_sum"):
            w, ids, counts = fn(logits, 2, **kw, group_score=group_score)
            ref_w, ref_ids, ref_counts = naive.route(logits, 2, **kw, group_score=group_score)
            self.assertEqual(ids, ref_ids, msg=group_score)
            self.assertEqual(counts, ref_counts)
            self.assertEqual(w, ref_w, atol=0, rtol=1e-12)
            group = 0 if group_score == "max" else 1
            self.assertTrue((ids[:20] // 4 == group).all(), msg=group_score)

    def test_minus_inf_excludes_expert(self):
        logits = torch.randn(10, 4)
        logits[:, 0] = -math.inf
        w, ids, _ = topk_route(logits, 3)
        self.assertFalse((ids == 0).any())
        self.assertTrue(torch.isfinite(w).all())

    @parametrize("impl", ["op", "reference"])
    def test_route_norm_eps(self, impl):
        """LFM2 renormalizes by (sum + 1e-6): weights and their gradient follow the eps
        (sigmoid scores of logits near -12 sum to ~1e-5, where 1e-6 is 10%)."""
        fn = topk_route if impl == "op" else _routing.topk_route_reference
        logits = torch.randn(9, 8, dtype=torch.float64) - 12.0
        kw = dict(score_func="sigmoid", route_norm=True)
        w_default = fn(logits, 2, **kw)[0]
        w, ids, _ = fn(logits, 2, **kw, route_norm_eps=1e-6)
        ref_w, ref_ids, _ = naive.route(logits, 2, **kw, route_norm_eps=1e-6)
        self.assertEqual(ids, ref_ids)
        self.assertEqual(w, ref_w, atol=0, rtol=1e-12)
        self.assertTrue(((w_default - w).abs() > 1e-3 * w).all())
        # 0 is allowed: the plain sum (Lfm2 / MiniMax-M2 style without an eps)
        w0 = fn(logits, 2, **kw, route_norm_eps=0.0)[0]
        chosen = torch.sigmoid(logits.gather(1, ids))
        self.assertEqual(w0, chosen / chosen.sum(-1, keepdim=True), atol=0, rtol=1e-15)
        if impl == "op":
            lg = logits.clone().requires_grad_()
            self.assertTrue(
                torch.autograd.gradcheck(
                    lambda x: topk_route(x, 2, **kw, route_norm_eps=1e-6)[0], (lg,)
                )
            )

    @parametrize("score_func", ["softmax", "sigmoid", "softmax_topk", "sigmoid_topk"])
    @parametrize("route_norm", [False, True])
    def test_gradcheck(self, score_func, route_norm):
        logits = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(8, dtype=torch.float64)

        def fn(lg):
            return topk_route(
                lg,
                3,
                score_func=score_func,
                expert_bias=bias,
                route_norm=route_norm,
                route_scale=1.5,
            )[0]

        self.assertTrue(torch.autograd.gradcheck(fn, (logits,)))

    def test_grad_matches_naive_autograd(self):
        logits = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
        w, ids, _ = topk_route(logits, 2, route_norm=True)
        g = torch.randn_like(w)
        (w * g).sum().backward()
        ref = logits.detach().clone().requires_grad_()
        probs = torch.softmax(ref, -1).gather(1, ids)
        ((probs / probs.sum(-1, keepdim=True)) * g).sum().backward()
        self.assertEqual(logits.grad, ref.grad)

    def test_opcheck(self):
        bias = torch.randn(16)
        for args in [
            (torch.randn(11, 16, requires_grad=True), 4, "softmax", None, None, None, True, 1.0),
            (torch.randn(11, 16, requires_grad=True), 4, "sigmoid", bias, 4, 2, True, 2.5),
            (
                torch.randn(3, 16, requires_grad=True),
                2,
                "softmax_topk",
                None,
                None,
                None,
                False,
                1.0,
            ),
            (
                torch.randn(7, 16, requires_grad=True),
                3,
                "sigmoid_topk",
                bias,
                None,
                None,
                True,
                2.0,
            ),
        ]:
            torch.library.opcheck(torch.ops.torch_moe.topk_route.default, args)

    def test_schema(self):
        self.assertExpectedInline(
            str(torch.ops.torch_moe.topk_route.default._schema),
            """torch_moe::topk_route(Tensor logits, SymInt k, str score_func="softmax", Tensor? expert_bias=None, SymInt? num_expert_groups=None, SymInt? num_limited_groups=None, bool route_norm=False, float route_scale=1., str group_score="top2_sum", float route_norm_eps=9.9999999999999995e-21) -> (Tensor, Tensor, Tensor)""",
        )

    def test_bad_inputs(self):
        x = torch.randn(4, 8)
        cases = [
            (dict(k=9), r"k \(9\) must be in \[1, num_experts=8\]"),
            (dict(k=0), r"k \(0\) must be in \[1, num_experts=8\]"),
            (
                dict(k=2, num_expert_groups=3, num_limited_groups=1),
                r"num_experts \(8\) must be divisible by num_expert_groups \(3\)",
            ),
            (
                dict(k=2, num_expert_groups=4, num_limited_groups=5),
                r"num_limited_groups \(5\) must be in \[1, num_expert_groups=4\]",
            ),
            (
                dict(k=5, num_expert_groups=4, num_limited_groups=2),
                r"num_limited_groups \(2\) x experts per group \(2\) leaves 4 experts, "
                r"fewer than k \(5\)",
            ),
            (dict(k=2, num_limited_groups=2), r"num_limited_groups \(2\) needs num_expert_groups"),
            (dict(k=2, score_func="relu"), r"unknown score_func 'relu'"),
            (
                dict(k=2, expert_bias=torch.zeros(7)),
                r"expert_bias to be a floating-point tensor of shape \[8\], got \[7\]",
            ),
            (dict(k=2, route_scale=math.inf), r"route_scale must be finite, got inf"),
            (dict(k=2, route_norm_eps=-1.0), r"route_norm_eps must be finite and >= 0, got -1.0"),
            (
                dict(k=2, num_expert_groups=4, num_limited_groups=2, group_score="mean"),
                r"unknown group_score 'mean'; expected one of \('top2_sum', 'max'\)",
            ),
        ]
        for kwargs, msg in cases:
            k = kwargs.pop("k")
            with self.assertRaisesRegex(ValueError, msg):
                topk_route(x, k, **kwargs)
        with self.assertRaisesRegex(
            ValueError, r"logits to be a 2D floating-point tensor \[T, E\], got 3D torch.float32"
        ):
            topk_route(torch.randn(2, 3, 8), 2)
        with self.assertRaisesRegex(ValueError, r"got 2D torch.int64"):
            topk_route(torch.ones(2, 8, dtype=torch.int64), 2)
        with self.assertRaisesRegex(
            ValueError, r"logits must have at least one expert column, got E=0"
        ):
            topk_route(torch.randn(2, 0), 1)
        with self.assertRaisesRegex(ValueError, r"expert_bias is on meta but logits are on cpu"):
            topk_route(x, 2, expert_bias=torch.zeros(8, device="meta"))

    def test_nan_and_posinf_logits_raise(self):
        for bad in [math.nan, math.inf]:
            x = torch.randn(4, 8)
            x[2, 5] = bad
            with self.assertRaisesRegex(RuntimeError, "logits contain NaN or \\+inf"):
                topk_route(x, 2)
        x = torch.randn(4, 8)
        x[1] = -math.inf
        # the whole message, verbatim: it tells the user what is allowed
        msg = (
            "topk_route: logits contain NaN or +inf, or a row with no finite logit "
            "(-inf is allowed to exclude an expert)"
        )
        with self.assertRaisesRegex(RuntimeError, "^" + re.escape(msg)):
            topk_route(x, 2)

    def test_nonfinite_expert_bias_raises(self):
        # a NaN bias entry would sort its expert into every row's top k (a differential
        # fuzz found it taken silently); inf likewise, -inf would bar it everywhere
        for bad in [math.nan, math.inf, -math.inf]:
            bias = torch.zeros(8)
            bias[3] = bad
            for score_func in ("sigmoid", "softmax"):
                with self.assertRaisesRegex(
                    RuntimeError, "^topk_route: expert_bias must be finite"
                ):
                    topk_route(torch.randn(4, 8), 2, score_func=score_func, expert_bias=bias)

    @parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
    @parametrize("experts", [3, 8, 64, 257])
    def test_value_check_at_every_position(self, dtype, experts):
        # the check is one row reduction: a bad value anywhere in a row (the vector body or
        # the tail of a wide row, a transposed view) is found, an allowed -inf is not refused
        g = torch.Generator().manual_seed(experts)
        for pos in range(experts):
            for bad in [math.nan, math.inf]:
                x = torch.randn(6, experts, generator=g).to(dtype)
                x[4, pos] = bad
                for logits in [x, x.t().contiguous().t()]:
                    with self.assertRaisesRegex(RuntimeError, "logits contain NaN or \\+inf"):
                        _routing._check_values(logits, None)
            x = torch.randn(6, experts, generator=g).to(dtype)
            x[2] = -math.inf
            with self.assertRaisesRegex(RuntimeError, "a row with no finite logit"):
                _routing._check_values(x, None)
            x[2, pos] = -1e4  # one finite logit left: allowed
            x[3, :pos] = -math.inf
            _routing._check_values(x, None)
        _routing._check_values(torch.empty(0, experts, dtype=dtype), None)  # no tokens


class TestAddLoadCounts(TestCase):
    """``torch_moe::add_load_counts``: the layer's load statistics, added in place except
    inside a backward pass (activation checkpointing recomputing a forward)."""

    def test_adds_outside_a_backward_only(self):
        tokens, dropped = torch.zeros(4, dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        counts, num_dropped = torch.tensor([3, 0, 1, 2]), torch.tensor(5)
        for add in (_routing.add_load_counts, torch.ops.torch_moe.add_load_counts):
            add(tokens, dropped, counts, num_dropped)
        self.assertEqual(tokens, 2 * counts)
        self.assertEqual(dropped, torch.tensor(10))

        class InBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, grad):
                for add in (_routing.add_load_counts, torch.ops.torch_moe.add_load_counts):
                    add(tokens, dropped, counts, num_dropped)
                return grad

        InBackward.apply(torch.ones(2, requires_grad=True)).sum().backward()
        self.assertEqual(tokens, 2 * counts)  # not counted in the backward
        self.assertEqual(dropped, torch.tensor(10))

    def test_opcheck(self):
        args = (torch.zeros(4, dtype=torch.int64), torch.zeros((), dtype=torch.int64))
        args += (torch.tensor([3, 0, 1, 2]), torch.tensor(5))
        torch.library.opcheck(torch.ops.torch_moe.add_load_counts.default, args)


instantiate_parametrized_tests(TestTopKRoute)

if __name__ == "__main__":
    run_tests()
