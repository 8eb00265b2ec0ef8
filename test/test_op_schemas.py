# Owner(s): ["module: moe"]
"""One ``assertExpectedInline`` schema test per ``torch.ops.torch_moe`` op: a change to an op's
signature (an argument renamed, retyped, reordered or given a default) shows up here as a
diff to review, as PyTorch's schema tests do for ``native_functions.yaml``. A new op needs
a test here (``test_every_op_has_a_schema_test``). Update with ``EXPECTTEST_ACCEPT=1``.
"""

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_moe
import torch_moe._inductor
import torch_moe.distributed
import torch_moe.quantization.fused  # noqa: F401

ops = torch.ops.torch_moe


def schema(name: str) -> str:
    return str(getattr(ops, name).default._schema)


def registered_ops() -> set[str]:
    return {
        n
        for n in dir(ops)
        if not n.startswith("_") and isinstance(getattr(ops, n), torch._ops.OpOverloadPacket)
    }


class TestOpSchemas(TestCase):
    def test_every_op_has_a_schema_test(self):
        tested = {n[len("test_schema_") :] for n in dir(self) if n.startswith("test_schema_")}
        missing = sorted(registered_ops() - tested)
        self.assertEqual(missing, [], msg=f"ops without a schema test in {__file__}: {missing}")
        for name in registered_ops():
            self.assertEqual(getattr(ops, name).overloads(), ["default"], msg=name)

    def test_schema_add_load_counts(self):
        self.assertExpectedInline(
            schema("add_load_counts"),
            """torch_moe::add_load_counts(Tensor(a0!) tokens_per_expert, Tensor(a1!) dropped, Tensor counts, Tensor num_dropped) -> ()""",
        )

    def test_schema_dequantize_fp8(self):
        self.assertExpectedInline(
            schema("dequantize_fp8"),
            """torch_moe::dequantize_fp8(Tensor q, Tensor scale, SymInt[] block, ScalarType dtype) -> Tensor""",
        )

    def test_schema_dequantize_jagged(self):
        self.assertExpectedInline(
            schema("dequantize_jagged"),
            """torch_moe::dequantize_jagged(Tensor q, Tensor scale, Tensor offs, SymInt block, ScalarType dtype) -> Tensor""",
        )

    def test_schema_dequantize_mx(self):
        self.assertExpectedInline(
            schema("dequantize_mx"),
            """torch_moe::dequantize_mx(Tensor q, Tensor scale, SymInt dim, SymInt block, ScalarType dtype) -> Tensor""",
        )

    def test_schema_ep_combine(self):
        self.assertExpectedInline(
            schema("ep_combine"),
            """torch_moe::ep_combine(Tensor y, Tensor counts, str group_name, SymInt num_experts, SymInt chunk_start, SymInt chunk_end, str exchange, SymInt node_size, SymInt num_rows) -> Tensor""",
        )

    def test_schema_ep_chunk_offsets(self):
        self.assertExpectedInline(
            schema("ep_chunk_offsets"),
            """torch_moe::ep_chunk_offsets(Tensor counts, SymInt num_experts, SymInt world, SymInt l0, SymInt l1) -> Tensor""",
        )

    def test_schema_ep_combine_backward(self):
        self.assertExpectedInline(
            schema("ep_combine_backward"),
            """torch_moe::ep_combine_backward(Tensor grad, Tensor counts, str group_name, SymInt num_experts, SymInt chunk_start, SymInt chunk_end, str exchange, SymInt node_size, SymInt num_recv) -> Tensor""",
        )

    def test_schema_ep_dispatch(self):
        self.assertExpectedInline(
            schema("ep_dispatch"),
            """torch_moe::ep_dispatch(Tensor x, Tensor? row_weights, Tensor counts, str group_name, SymInt num_experts, SymInt chunk_start, SymInt chunk_end, str exchange, SymInt node_size, bool fp8) -> (Tensor, Tensor)""",
        )

    def test_schema_ep_dispatch_backward(self):
        self.assertExpectedInline(
            schema("ep_dispatch_backward"),
            """torch_moe::ep_dispatch_backward(Tensor grad_x, Tensor? grad_w, Tensor counts, str group_name, SymInt num_experts, SymInt chunk_start, SymInt chunk_end, str exchange, SymInt node_size, SymInt num_rows) -> (Tensor, Tensor)""",
        )

    def test_schema_ep_start(self):
        self.assertExpectedInline(
            schema("ep_start"),
            """torch_moe::ep_start(Tensor[] tensors, Tensor counts, str group_name, SymInt num_experts, SymInt chunk_start, SymInt chunk_end, str exchange, SymInt node_size, str direction, bool fp8, SymInt num_rows) -> Tensor""",
        )

    def test_schema_ep_wait(self):
        self.assertExpectedInline(
            schema("ep_wait"),
            """torch_moe::ep_wait(Tensor handle, Tensor[] like, str direction, SymInt num_rows) -> Tensor[]""",
        )

    def test_schema_fused_experts(self):
        self.assertExpectedInline(
            schema("fused_experts"),
            """torch_moe::fused_experts(Tensor x, Tensor w13, Tensor w2, Tensor row_to_slot, Tensor offs, Tensor row_weights, SymInt top_k, SymInt block_m) -> Tensor""",
        )

    def test_schema_grouped_mm(self):
        self.assertExpectedInline(
            schema("grouped_mm"),
            """torch_moe::grouped_mm(Tensor x, Tensor w, Tensor offs) -> Tensor""",
        )

    def test_schema_grouped_mm_wgrad(self):
        self.assertExpectedInline(
            schema("grouped_mm_wgrad"),
            """torch_moe::grouped_mm_wgrad(Tensor x, Tensor dy, Tensor offs) -> Tensor""",
        )

    def test_schema_grouped_swiglu(self):
        self.assertExpectedInline(
            schema("grouped_swiglu"),
            """torch_moe::grouped_swiglu(Tensor x, Tensor w13, Tensor w2, Tensor offs, Tensor? row_weights=None, Tensor? gather_index=None, Tensor? row_to_slot=None, Tensor? slot_to_row=None) -> (Tensor, Tensor)""",
        )

    def test_schema_grouped_swiglu_backward(self):
        self.assertExpectedInline(
            schema("grouped_swiglu_backward"),
            """torch_moe::grouped_swiglu_backward(Tensor grad_y, Tensor? grad_h, Tensor x, Tensor h, Tensor w13, Tensor w2, Tensor offs, Tensor? row_weights=None, Tensor? gather_index=None, Tensor? grad_index=None) -> (Tensor, Tensor, Tensor, Tensor)""",
        )

    def test_schema_permute(self):
        self.assertExpectedInline(
            schema("permute"),
            """torch_moe::permute(Tensor x, Tensor row_to_slot, Tensor slot_to_row, Tensor? weights=None) -> Tensor""",
        )

    def test_schema_permute_indices(self):
        self.assertExpectedInline(
            schema("permute_indices"),
            """torch_moe::permute_indices(Tensor expert_ids, SymInt num_experts, SymInt align=1, SymInt? capacity=None) -> (Tensor, Tensor, Tensor, Tensor)""",
        )

    def test_schema_permute_quantize(self):
        self.assertExpectedInline(
            schema("permute_quantize"),
            """torch_moe::permute_quantize(Tensor x, Tensor row_to_slot, Tensor slot_to_row, str fmt, SymInt block, str scale_rule) -> (Tensor, Tensor)""",
        )

    def test_schema_permute_quantize_jagged(self):
        self.assertExpectedInline(
            schema("permute_quantize_jagged"),
            """torch_moe::permute_quantize_jagged(Tensor x, Tensor row_to_slot, Tensor slot_to_row, Tensor offs, SymInt block, str fmt, str scale_rule) -> (Tensor, Tensor)""",
        )

    def test_schema_quantize_fp8(self):
        self.assertExpectedInline(
            schema("quantize_fp8"),
            """torch_moe::quantize_fp8(Tensor x, SymInt[] block) -> (Tensor, Tensor)""",
        )

    def test_schema_quantize_fp8_cached(self):
        self.assertExpectedInline(
            schema("quantize_fp8_cached"),
            """torch_moe::quantize_fp8_cached(Tensor source, Tensor x, SymInt[] block) -> (Tensor, Tensor)""",
        )

    def test_schema_quantize_jagged(self):
        self.assertExpectedInline(
            schema("quantize_jagged"),
            """torch_moe::quantize_jagged(Tensor x, Tensor offs, SymInt block, str fmt, str scale_rule) -> (Tensor, Tensor)""",
        )

    def test_schema_quantize_mx(self):
        self.assertExpectedInline(
            schema("quantize_mx"),
            """torch_moe::quantize_mx(Tensor x, SymInt dim, SymInt block, str scale_rule) -> (Tensor, Tensor)""",
        )

    def test_schema_quantize_mx_cached(self):
        self.assertExpectedInline(
            schema("quantize_mx_cached"),
            """torch_moe::quantize_mx_cached(Tensor source, Tensor x, SymInt dim, SymInt block, str scale_rule) -> (Tensor, Tensor)""",
        )

    def test_schema_quantized_grouped_mm(self):
        self.assertExpectedInline(
            schema("quantized_grouped_mm"),
            """torch_moe::quantized_grouped_mm(Tensor x, Tensor w, Tensor offs, str recipe) -> Tensor""",
        )

    def test_schema_quantized_grouped_mm_dgrad(self):
        self.assertExpectedInline(
            schema("quantized_grouped_mm_dgrad"),
            """torch_moe::quantized_grouped_mm_dgrad(Tensor dy, Tensor w, Tensor offs, str recipe) -> Tensor""",
        )

    def test_schema_quantized_grouped_mm_wgrad(self):
        self.assertExpectedInline(
            schema("quantized_grouped_mm_wgrad"),
            """torch_moe::quantized_grouped_mm_wgrad(Tensor x, Tensor dy, Tensor offs, str recipe) -> Tensor""",
        )

    def test_schema_router_logits(self):
        self.assertExpectedInline(
            schema("router_logits"),
            """torch_moe::router_logits(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor""",
        )

    def test_schema_router_logits_backward(self):
        self.assertExpectedInline(
            schema("router_logits_backward"),
            """torch_moe::router_logits_backward(Tensor grad, Tensor x, Tensor weight, bool need_x, bool need_weight) -> (Tensor, Tensor)""",
        )

    def test_schema_routed_swiglu(self):
        self.assertExpectedInline(
            schema("routed_swiglu"),
            """torch_moe::routed_swiglu(Tensor x, Tensor w13, Tensor w2, Tensor expert_ids, Tensor weights) -> Tensor""",
        )

    def test_schema_scaled_grouped_mm(self):
        self.assertExpectedInline(
            schema("scaled_grouped_mm"),
            """torch_moe::scaled_grouped_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor offs, SymInt block_k, SymInt block_n, ScalarType out_dtype) -> Tensor""",
        )

    def test_schema_scaled_grouped_mm_wgrad(self):
        self.assertExpectedInline(
            schema("scaled_grouped_mm_wgrad"),
            """torch_moe::scaled_grouped_mm_wgrad(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor offs, SymInt block, ScalarType out_dtype) -> Tensor""",
        )

    def test_schema_glu(self):
        self.assertExpectedInline(
            schema("glu"),
            """torch_moe::glu(Tensor h, Tensor? row_weights, str activation, float alpha, float? limit, bool interleaved) -> Tensor""",
        )

    def test_schema_gather_grouped_mm(self):
        self.assertExpectedInline(
            schema("gather_grouped_mm"),
            """torch_moe::gather_grouped_mm(Tensor x, Tensor w, Tensor offs, Tensor row_to_slot, Tensor slot_to_row) -> Tensor""",
        )

    def test_schema_glu_backward(self):
        self.assertExpectedInline(
            schema("glu_backward"),
            """torch_moe::glu_backward(Tensor grad_a, Tensor h, Tensor? row_weights, str activation, float alpha, float? limit, bool interleaved) -> (Tensor, Tensor)""",
        )

    def test_schema_swiglu(self):
        self.assertExpectedInline(
            schema("swiglu"),
            """torch_moe::swiglu(Tensor h, Tensor? row_weights=None) -> Tensor""",
        )

    def test_schema_swiglu_backward(self):
        self.assertExpectedInline(
            schema("swiglu_backward"),
            """torch_moe::swiglu_backward(Tensor grad_a, Tensor h, Tensor? row_weights=None) -> (Tensor, Tensor)""",
        )

    def test_schema_swiglu_quantize(self):
        self.assertExpectedInline(
            schema("swiglu_quantize"),
            """torch_moe::swiglu_quantize(Tensor h, Tensor? row_weights, str fmt, SymInt block, str scale_rule) -> (Tensor, Tensor)""",
        )

    def test_schema_swiglu_quantize_jagged(self):
        self.assertExpectedInline(
            schema("swiglu_quantize_jagged"),
            """torch_moe::swiglu_quantize_jagged(Tensor h, Tensor? row_weights, Tensor offs, SymInt block, str fmt, str scale_rule) -> (Tensor, Tensor)""",
        )

    def test_schema_topk_route(self):
        self.assertExpectedInline(
            schema("topk_route"),
            """torch_moe::topk_route(Tensor logits, SymInt k, str score_func="softmax", Tensor? expert_bias=None, SymInt? num_expert_groups=None, SymInt? num_limited_groups=None, bool route_norm=False, float route_scale=1., str group_score="top2_sum", float route_norm_eps=9.9999999999999995e-21) -> (Tensor, Tensor, Tensor)""",
        )

    def test_schema_topk_route_backward(self):
        self.assertExpectedInline(
            schema("topk_route_backward"),
            """torch_moe::topk_route_backward(Tensor grad_weights, Tensor logits, Tensor expert_ids, str score_func, bool route_norm, float route_scale, float route_norm_eps=9.9999999999999995e-21) -> Tensor""",
        )

    def test_schema_unpermute(self):
        self.assertExpectedInline(
            schema("unpermute"),
            """torch_moe::unpermute(Tensor y, Tensor slot_to_row, Tensor row_to_slot, Tensor? weights=None) -> Tensor""",
        )

    def test_schema_weighted_row_dot(self):
        self.assertExpectedInline(
            schema("weighted_row_dot"),
            """torch_moe::weighted_row_dot(Tensor rows, Tensor tokens, Tensor slot_to_row) -> Tensor""",
        )


if __name__ == "__main__":
    run_tests()
