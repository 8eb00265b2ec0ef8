"""Inductor lowerings of torch_moe's grouped GEMM ops.

On CPU (and wherever no template applies) the lowering of ``torch_moe::grouped_mm``,
``grouped_mm_wgrad`` and ``scaled_grouped_mm`` is an extern call of the op's own kernel:
the compiled graph calls exactly what eager calls, so a compiled path is never slower than
eager for these ops. Registering the lowering explicitly (instead of relying on Inductor's
implicit fallback for custom ops) keeps its source in :class:`~torch_moe._inductor.passes.
MoEGraphPass`'s ``uuid()``, so the FX graph cache never serves code lowered by an older
version.

NB (CUDA templates): Triton templates of the persistent grouped GEMM, offered next to
torch's ``tuned_grouped_mm`` and the extern kernel through ``autotune_select_algorithm``,
need a CUDA device to render and benchmark; they are not part of this module yet (see
RFC-0003 for where they plug into ``_tuned_grouped_mm_common``).
"""

from __future__ import annotations

import torch
from torch._inductor import lowering as L

__all__ = ["LOWERED_OPS", "register_lowerings"]

_ops = torch.ops.torch_moe

LOWERED_OPS = (
    _ops.grouped_mm.default,
    _ops.grouped_mm_wgrad.default,
    _ops.scaled_grouped_mm.default,
    _ops.scaled_grouped_mm_wgrad.default,
)

_registered = False


def register_lowerings() -> None:
    """Register the lowerings (idempotent)."""
    global _registered
    if _registered:
        return
    for op in LOWERED_OPS:
        # the op's own kernel as an extern call (Inductor's fallback handler)
        L.register_lowering(op, type_promotion_kind=None)(L.fallback_handler(op))
    _registered = True
