"""Patch 0002: the _grouped_mm meta validates offs values where they are known.

Known values: meta-device operands with a real (CPU) offs. Under FakeTensorMode
offs values are unknown and only its shape/dtype are checked (traces as before).
Fails on stock torch 2.13.0 (bad offs are accepted), passes with the patch.
"""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.common_utils import TestCase, run_tests


def _meta_operands(m=32, k=16, n=16, groups=2):
    a = torch.empty(m, k, device="meta", dtype=torch.bfloat16)
    b = torch.empty(groups, k, n, device="meta", dtype=torch.bfloat16)
    return a, b


def _offs(values):
    return torch.tensor(values, dtype=torch.int32)


class TestGroupedMMMetaOffs(TestCase):
    def test_non_monotone_offs_rejected(self):
        a, b = _meta_operands()
        with self.assertRaisesRegex(RuntimeError, r"non-decreasing group ends.*\[20, 10\]"):
            torch._grouped_mm(a, b, offs=_offs([20, 10]))

    def test_offs_past_sliced_size_rejected(self):
        a, b = _meta_operands()
        with self.assertRaisesRegex(
            RuntimeError, r"offs\[-1\]=40 exceeds mat_a.size\(0\) \(M\)=32"
        ):
            torch._grouped_mm(a, b, offs=_offs([10, 40]))

    def test_offs_past_k_rejected_2d_2d(self):
        a = torch.empty(16, 32, device="meta", dtype=torch.bfloat16)
        b = torch.empty(32, 16, device="meta", dtype=torch.bfloat16)
        with self.assertRaisesRegex(RuntimeError, r"exceeds mat_a.size\(1\) \(K\)=32"):
            torch._grouped_mm(a, b, offs=_offs([10, 33]))

    def test_valid_offs_accepted(self):
        a, b = _meta_operands()
        # offs[-1] may equal the sliced size, or stop short of it; empty groups are fine
        for values in ([10, 32], [0, 0], [5, 20], [32, 32]):
            out = torch._grouped_mm(a, b, offs=_offs(values))
            self.assertEqual(out.shape, (32, 16))

    def test_fake_offs_still_traces(self):
        with FakeTensorMode():
            a = torch.empty(32, 16, dtype=torch.bfloat16)
            b = torch.empty(2, 16, 16, dtype=torch.bfloat16)
            offs = torch.empty(2, dtype=torch.int32)  # values unknown
            self.assertEqual(torch._grouped_mm(a, b, offs=offs).shape, (32, 16))


if __name__ == "__main__":
    run_tests()
