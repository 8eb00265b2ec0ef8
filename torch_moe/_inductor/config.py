"""Configuration of torch_moe's compiler passes (a torch-style config module).

Each flag turns one rewrite of :mod:`torch_moe._inductor.passes` on or off, e.g.
``torch_moe._inductor.config.fuse_gather = False`` or, for one block,
``with torch_moe._inductor.config.patch(cache_weight_quantization=False): ...``. The values
are part of the passes' ``uuid()``, so Inductor's FX graph cache never serves code built
under other settings.
"""

import sys

# Rewrite quantized_grouped_mm (and its dgrad / wgrad) into the quantize ops and
# scaled_grouped_mm(_wgrad) when the recipe's GEMM is expressible so: exposes the
# quantizations to the fusions below.
decompose_scaled_gemms: bool = True

# permute -> grouped_swiglu  ==>  grouped_swiglu(x, ..., gather_index=...): the permuted
# [M, D] activation is neither materialized in the forward nor saved for the backward.
fuse_gather: bool = True

# quantize(permute(x)) ==> permute_quantize(x) (quantize the T tokens, gather e4m3 rows),
# quantize_jagged(permute(x)) ==> permute_quantize_jagged(x), and the same for the
# SwiGLU activation (swiglu_quantize / swiglu_quantize_jagged). Covers the combine's
# backward (dY = permute(grad) quantized for dgrad and wgrad).
fuse_quantize: bool = True

# unpermute(y, ...) without weights on CPU (the combine, the permute's backward) ==> its
# gather-and-sum in aten ops (the CPU kernel's operations, in its order), which Inductor
# fuses into one loop: no per-k gathered rows materialized.
inline_combine: bool = True

# grouped_swiglu (and its backward) on CPU ==> the grouped GEMM ops around the activation
# in aten ops (the CPU kernel's fp32 math, one rounding), which Inductor fuses into one
# loop per direction (compiled layer steps ~3.5% faster and their peaks 9-38% lower on a
# Zen 5 EPYC). The one rewrite here that is not bit for bit the op: Inductor's exp /
# sigmoid and the routing weights' gradient's sum order differ from ATen's kernels in the
# last fp32 bits (outputs within one bf16 rounding step); False keeps the op, e.g. to
# compare compiled and eager bit for bit.
inline_swiglu: bool = True

# glu / glu_backward (the composed experts' activation: GPT-OSS's swigluoai, clamped
# SwiGLU, relu2) on CPU ==> the op's own fp32 formulas in aten ops, fused by Inductor into
# one loop per direction; the backward still keeps only h (and the row weights). Within a
# rounding step or two of the op where the activation has an exp (Inductor's against
# ATen's) or the experts a bias (relu2 with experts_bias in bf16: 1-2 ulps, a fuzz found);
# an fp8_tensorwise recipe after it can turn such an ulp into an FP8 step of a code.
inline_glu: bool = True

# quantize(w) of an expert weight (a 3D graph input, through views and casts) ==> a cached
# quantization, recomputed only when the weight's version counter changes (once per
# optimizer step, not once per micro-batch and GEMM).
cache_weight_quantization: bool = True

# expert parallelism: split every dispatch / combine (and their backwards) into an issue
# and a wait, issue early, wait late (torch_moe._inductor.ep_overlap), so that chunk c+1's
# exchange overlaps chunk c's experts (ExpertParallel(num_chunks=C)).
ep_overlap: bool = True

# expert parallelism: split every layer traced with one chunk (ExpertParallel(), the
# default) into this many chunks of local experts (at most the layer's local experts), the
# graph ExpertParallel(num_chunks=ep_chunks) traces (torch_moe._inductor.ep_chunk), so that
# the overlap pass above has chunks to overlap. 1: leave the layers as traced. Read when a
# graph compiles (a frame Dynamo already compiled in this process is reused as it is);
# options(ep_chunks=C) sets it for one torch.compile call.
ep_chunks: int = 1


from torch.utils._config_module import install_config_module  # noqa: E402

install_config_module(sys.modules[__name__])
