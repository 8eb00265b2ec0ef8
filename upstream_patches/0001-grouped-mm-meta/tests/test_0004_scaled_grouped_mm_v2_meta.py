"""Patch 0004: a meta kernel for aten._scaled_grouped_mm_v2 (F.scaled_grouped_mm).

On stock torch 2.13.0 the op has no Meta kernel (nor a CPU one), so FakeTensor
tracing of F.scaled_grouped_mm raises NotImplementedError; the v1 op
(_scaled_grouped_mm) has one. Fails there, passes with the patch. CPU only:
everything here runs under FakeTensorMode or make_fx(tracing_mode="fake").
"""

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_utils import TestCase, run_tests

FP8 = torch.float8_e4m3fn
M, K, N, G = 64, 32, 48, 4


def _rowwise_inputs():
    a = torch.empty(M, K, dtype=FP8)  # row-major
    b = torch.empty(G, N, K, dtype=FP8).mT  # column-major [G, K, N]
    scale_a = torch.empty(M, dtype=torch.float32)
    scale_b = torch.empty(G, N, dtype=torch.float32)
    offs = torch.empty(G, dtype=torch.int32)
    return a, b, scale_a, scale_b, offs


class TestScaledGroupedMMV2Meta(TestCase):
    def test_fake_rowwise_matches_v1(self):
        with FakeTensorMode():
            a, b, sa, sb, offs = _rowwise_inputs()
            v2 = F.scaled_grouped_mm(
                a, b, sa, F.ScalingType.RowWise, sb, F.ScalingType.RowWise, offs=offs
            )
            v1 = torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
        self.assertEqual(v2.shape, (M, N))
        self.assertEqual(v2.dtype, torch.bfloat16)
        self.assertEqual(v2.stride(), v1.stride())

    def test_fake_mxfp8_2d_2d(self):
        # weight-gradient layout: groups along K, E8M0 block scales, fp32 output
        with FakeTensorMode():
            a = torch.empty(N, M, dtype=FP8)
            b = torch.empty(K, M, dtype=FP8).t()
            sa = torch.empty(N, M // 32, dtype=torch.float8_e8m0fnu)
            sb = torch.empty(K, M // 32, dtype=torch.float8_e8m0fnu)
            offs = torch.empty(G, dtype=torch.int32)
            out = torch._scaled_grouped_mm_v2(
                a, b, [sa], [3], [], [sb], [3], [], offs, None, torch.float32, [], False
            )
        self.assertEqual(out.shape, (G, N, K))
        self.assertEqual(out.dtype, torch.float32)

    def test_make_fx_traces(self):
        def f(a, b, sa, sb, offs):
            return F.scaled_grouped_mm(
                a, b, sa, F.ScalingType.RowWise, sb, F.ScalingType.RowWise, offs=offs
            )

        with FakeTensorMode():
            inputs = _rowwise_inputs()
        a, b, sa, sb, offs = (
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in inputs
        )
        gm = make_fx(f, tracing_mode="fake")(a, b, sa, sb, offs)
        self.assertIn("_scaled_grouped_mm_v2", gm.code)

    def test_bad_inputs_raise(self):
        with FakeTensorMode():
            a, b, sa, sb, offs = _rowwise_inputs()
            with self.assertRaisesRegex(RuntimeError, "one recipe per scale_a"):
                torch._scaled_grouped_mm_v2(a, b, [sa], [1, 1], [], [sb], [1], [], offs)
            with self.assertRaisesRegex(RuntimeError, "FP8 or FP4"):
                torch._scaled_grouped_mm_v2(
                    a.to(torch.bfloat16), b, [sa], [1], [], [sb], [1], [], offs
                )


if __name__ == "__main__":
    run_tests()
