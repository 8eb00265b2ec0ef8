"""Patch 0001: the _grouped_mm meta accepts fp32/fp16 and its strides match eager.

Fails on stock torch 2.13.0 (meta is BF16-only; CPU eager pads the output's
leading stride to 16 bytes, the meta of a CPU-only build does not), passes with
the patch. Runs on CPU with any torch that has torch._grouped_mm.
"""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _problems(dtype):
    offs = torch.tensor([10, 32], dtype=torch.int32)
    # 2d x 3d (MoE forward), N=5 so the padded and the dense strides differ
    yield torch.randn(32, 16, dtype=dtype), torch.randn(2, 5, 16, dtype=dtype).mT, offs
    # 2d x 2d (MoE weight gradient), groups along K=32
    yield (
        torch.randn(32, 16, dtype=dtype).t(),
        torch.randn(5, 32, dtype=dtype).t(),
        offs,
    )


class TestGroupedMMMeta(TestCase):
    @parametrize("dtype", DTYPES)
    def test_fake_matches_eager(self, dtype):
        for a, b, offs in _problems(dtype):
            eager = torch._grouped_mm(a, b, offs=offs)
            with FakeTensorMode() as mode:
                fa, fb, fo = (mode.from_tensor(t) for t in (a, b, offs))
                fake = torch._grouped_mm(fa, fb, offs=fo)
            self.assertEqual(fake.shape, eager.shape)
            self.assertEqual(fake.dtype, eager.dtype)
            self.assertEqual(fake.stride(), eager.stride())

    @parametrize("dtype", [torch.float32, torch.float16])
    def test_compile_aot_eager(self, dtype):
        # K and N multiples of 16 bytes: the eager backward needs them
        a = torch.randn(32, 16, dtype=dtype, requires_grad=True)
        b = torch.randn(2, 16, 16, dtype=dtype).mT.requires_grad_(True)
        offs = torch.tensor([10, 32], dtype=torch.int32)

        def f(a, b, offs):
            return torch._grouped_mm(a, b, offs=offs).float().square().sum()

        torch._dynamo.reset()
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(a, b, offs)
        self.assertEqual(out, f(a, b, offs))

    def test_mismatched_dtypes_rejected(self):
        with FakeTensorMode():
            a = torch.empty(32, 16, dtype=torch.float32)
            b = torch.empty(2, 16, 16, dtype=torch.bfloat16)
            offs = torch.empty(2, dtype=torch.int32)
            with self.assertRaisesRegex(RuntimeError, "dtype"):
                torch._grouped_mm(a, b, offs=offs)


instantiate_parametrized_tests(TestGroupedMMMeta)

if __name__ == "__main__":
    run_tests()
