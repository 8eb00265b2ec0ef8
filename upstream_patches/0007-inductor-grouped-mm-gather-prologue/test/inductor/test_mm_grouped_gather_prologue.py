# Owner(s): ["module: inductor"]
"""The grouped-GEMM Triton template cannot take a gather prologue (torch 2.13.0).

An MoE layer feeds the first grouped GEMM with the token rows gathered into
expert order, ``torch._grouped_mm(x[row_index], w, offs=offs)``. Inductor can fuse
a producer into a template's operand loads only through prologue-capable loads:
the template either declares ``prologue_loads_all_inputs`` (the mm template does)
or loads the operand through ``{{load_input(...)}}``. The grouped-mm template
(torch/_inductor/kernel/mm_grouped.py, templates/triton_mm_grouped.py.jinja) does
neither: A is read by a TMA descriptor or by raw pointer loads, so the gathered
[M, K] operand is always materialized by a separate kernel and read back.

test_template_has_prologue_capable_a_loads states the missing capability and runs
on any machine; test_gather_fused_into_grouped_mm is the behavior a fix must give
(sm_90+, Triton template under max-autotune; skipped without such a GPU).
"""

import unittest

import torch
from torch._inductor import config
from torch._inductor.kernel import mm_grouped
from torch._inductor.test_case import run_tests, TestCase
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck


def _has_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


class TestGroupedMMGatherPrologue(TestCase):
    def test_template_has_prologue_capable_a_loads(self):
        template = mm_grouped.triton_grouped_mm_template
        source = mm_grouped.load_kernel_template("triton_mm_grouped")
        self.assertTrue(
            template.prologue_loads_all_inputs or "load_input(" in source,
            "the grouped-mm template has no prologue-capable load of mat_a",
        )

    @unittest.skipIf(not _has_sm90(), "needs an sm_90+ GPU for the Triton grouped-mm template")
    @config.patch(max_autotune=True, max_autotune_gemm_backends="TRITON")
    def test_gather_fused_into_grouped_mm(self):
        T, K, N, G, topk = 256, 128, 256, 4, 2
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        row_index = torch.randperm(T * topk, device="cuda") // topk
        w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16).mT
        offs = torch.arange(1, G + 1, device="cuda", dtype=torch.int32) * (T * topk // G)

        def f(x, row_index, w, offs):
            return torch._grouped_mm(x[row_index], w, offs=offs)

        out, codes = run_and_get_code(torch.compile(f), x, row_index, w, offs)
        self.assertEqual(out, f(x, row_index, w, offs))
        # no pointwise kernel materializes x[row_index]: the template reads x through it
        FileCheck().check_not("triton_poi_fused_index").run("\n".join(codes))


if __name__ == "__main__":
    run_tests()
