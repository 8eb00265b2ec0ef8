"""Performance model and execution-strategy advisor for MoE layers (``torch_moe.perf``).

Predicts the time, its breakdown (router, permute, each GEMM per precision, quantize,
dispatch / combine, overlap, load imbalance) and the memory of one ``torch_moe.nn.MoE``
step, and ranks execution strategies (EP degree, chunks, exchange, hierarchical, precision,
capacity, redundant experts) by predicted step time within a memory limit::

    from torch_moe.perf import Hardware, MoEWorkload, advise, predict

    hw = Hardware.calibrate()                      # this machine, <= 60 s, cached
    gpu = Hardware.calibrate(device="cuda")        # a GPU's rates, ~10 s, cached
    w = MoEWorkload(4096, 1024, 512, 64, 8, routing_skew=1.0)
    p = predict(w, hw)
    print(p.table(), p.memory_table())
    print(advise(w, Hardware.preset("h200"), world_size=64, gpus_per_node=8))

    python -m torch_moe.perf --preset deepseek-v3 --hardware h200 --gpus 64 \\
        --gpus-per-node 8 --tokens 4096 [--plot out.png]

Legend: T tokens per rank, D dim, F expert hidden dim, E experts, K top-k, R EP ranks.

Design. An analytical, kernel-aware model (:mod:`torch_moe.perf._model`) over a hardware
description (:class:`Hardware`) that is either measured on this machine
(:func:`calibrate`: GEMM table over (rows per group, K, N, dtype, layout), the library's
elementwise and quantize kernels, host overheads, alpha-beta of the process group's
transport and the EP layer's host work beyond it; on a GPU, ``calibrate(device="cuda")``:
its GEMM rate per compute key and recipe, its kernels' rates, copy bandwidth and launch
cost, :mod:`torch_moe.perf._calibrate_gpu`) or built from datasheets and this
repository's H200 measurements (:meth:`Hardware.preset`). Routing statistics (Zipf skew ->
expected loads, distinct ranks / nodes per token, expected maximum rank load) are closed
forms (:mod:`torch_moe.perf._workload`). Validation against measured layer steps on this
CPU: ``benchmarks/bench_perf_model.py`` and ``benchmarks/results/perf_model_*.md``.

What comes from PyTorch: H100 datasheet peaks from
``torch._inductor.analysis.device_info`` (the H200 / B200 entries it lacks are written
out here with their sources); the alpha-beta form of collective cost follows
``torch._inductor.comm_analysis`` (whose NCCL ring / tree model does not cover the
point-to-point segment exchange, so links are measured here); FLOP counts are checked in
the tests against ``torch.utils.flop_counter.FlopCounterMode`` on the layer's reference
math; expert placement with redundant replicas is ``torch_moe.distributed.placement``.
``torch.distributed._tools.RuntimeEstimator`` / ``MemTracker`` are not used: they
estimate or track one run of a real model under a dispatch mode, which needs the model's
tensors and does not see inside the custom ops' CPU kernels; the validation measures
peak memory with the profiler's allocator events (``profile_memory=True``) instead,
which do.
"""

from torch_moe.perf._advisor import Advice, Candidate, Strategy, advise
from torch_moe.perf._calibrate import calibrate, cpu_isa
from torch_moe.perf._hardware import GemmTable, Hardware, Link, RateTable
from torch_moe.perf._model import Prediction, predict
from torch_moe.perf._workload import MoEWorkload, distinct_ranks_per_token, inclusion_probabilities

__all__ = [
    "Advice",
    "Candidate",
    "GemmTable",
    "Hardware",
    "Link",
    "MoEWorkload",
    "Prediction",
    "RateTable",
    "Strategy",
    "advise",
    "calibrate",
    "cpu_isa",
    "distinct_ranks_per_token",
    "inclusion_probabilities",
    "predict",
]
