"""Patch 0003: F.grouped_mm and F.scaled_grouped_mm document ``offs`` the same way.

``offs`` holds group ENDS and ``offs[-1]`` may equal the sliced length (what the
kernels do, checked eagerly below). Stock torch 2.13.0 says "strictly less than"
in F.grouped_mm and "group start indices" in F.scaled_grouped_mm: fails there,
passes with the patch.
"""

import re

import torch
import torch.nn.functional as F
from torch.testing._internal.common_utils import TestCase, run_tests


def _offs_doc(fn):
    doc = fn.__doc__ or ""
    match = re.search(r"^( +)offs:(.*?)(?=^\1\w+:|\Z)", doc, re.S | re.M)
    if match is None:
        raise AssertionError(f"{fn.__name__}: no 'offs:' entry in the docstring")
    return " ".join(match.group(0).split())


class TestGroupedMMOffsDocs(TestCase):
    def test_same_offs_doc(self):
        self.assertEqual(_offs_doc(F.grouped_mm), _offs_doc(F.scaled_grouped_mm))

    def test_offs_doc_says_group_ends(self):
        for fn in (F.grouped_mm, F.scaled_grouped_mm):
            doc = _offs_doc(fn)
            self.assertIn("end", doc)
            self.assertIn("``offs[-1]`` may equal", doc)
            self.assertNotIn("start indices", doc)
            self.assertNotIn("strictly less", doc)

    def test_documented_semantics_hold_eagerly(self):
        # offs[-1] == M is accepted, and group i is rows offs[i-1]:offs[i]
        x = torch.randn(32, 16)
        w = torch.randn(2, 16, 16)
        out = F.grouped_mm(x, w, offs=torch.tensor([10, 32], dtype=torch.int32))
        self.assertEqual(out[:10], x[:10] @ w[0])
        self.assertEqual(out[10:], x[10:] @ w[1])


if __name__ == "__main__":
    run_tests()
