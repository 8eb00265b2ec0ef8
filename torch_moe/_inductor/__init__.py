"""torch_moe for Inductor: graph passes that fuse the MoE layer's ops, and the lowerings of
its grouped GEMMs. Opt-in::

    import torch_moe._inductor
    torch_moe._inductor.enable()                 # process-wide (torch._inductor.config)
    compiled = torch.compile(moe)

    # or for one compile only
    compiled = torch.compile(moe, options=torch_moe._inductor.options())

``torch.compile`` works without it (every op is then an extern call of its eager kernel);
with it the permuted activations and the high-precision copies that the quantizations
read are neither materialized nor saved, and the weights are quantized once per version
(see :mod:`torch_moe._inductor.passes`). Each rewrite has a flag in
:mod:`torch_moe._inductor.config`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch_moe._inductor import config
from torch_moe._inductor.ep_chunk import EPChunkPass
from torch_moe._inductor.ep_overlap import EPOverlapPass
from torch_moe._inductor.passes import (
    MoEGraphPass,
    counters,
    reset_counters,
    run_passes,
)

__all__ = [
    "EPChunkPass",
    "EPOverlapPass",
    "MoEGraphPass",
    "config",
    "counters",
    "disable",
    "enable",
    "enabled",
    "options",
    "reset_counters",
    "run_passes",
]

# the Inductor config entries the passes go into: the EP chunk split before autograd (on
# Dynamo's graph, so the backward follows the chunks); the fusions on the joint graph
# (training, before the partitioner decides what to save) and the forward-only graph
# (inference); the EP schedule after the partitioner, on the forward and backward graphs
_PASSES = {
    "pre_grad_custom_pass": EPChunkPass(),
    "joint_custom_post_pass": MoEGraphPass(),
    "post_grad_custom_pre_pass": MoEGraphPass(),
    "post_grad_custom_post_pass": EPOverlapPass(),
}
_HOOKS = tuple(_PASSES)
_OURS = (EPChunkPass, MoEGraphPass, EPOverlapPass)


def options(*, ep_chunks: int | None = None) -> dict[str, Any]:
    """``torch.compile(..., options=...)`` entries that run the passes in one compile;
    ``ep_chunks=C`` splits this compile's one-chunk expert-parallel layers into C chunks
    (default: ``config.ep_chunks``, read when the graph compiles)."""
    from torch_moe._inductor.lowering import register_lowerings

    register_lowerings()
    out = dict(_PASSES)
    if ep_chunks is not None:
        out["pre_grad_custom_pass"] = EPChunkPass(ep_chunks)
    return out


def _without_ours(value: Any) -> list[Any]:
    items = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    return [p for p in items if not isinstance(p, _OURS)]


def enable() -> None:
    """Run torch_moe's passes in every Inductor compile of this process (next to any
    custom passes already configured)."""
    import torch._inductor.config as inductor_config

    from torch_moe._inductor.lowering import register_lowerings

    register_lowerings()
    for hook in _HOOKS:
        others = _without_ours(getattr(inductor_config, hook))
        ours = _PASSES[hook]
        setattr(inductor_config, hook, [*others, ours] if others else ours)


def disable() -> None:
    """Undo :func:`enable` (other custom passes stay)."""
    import torch._inductor.config as inductor_config

    for hook in _HOOKS:
        others = _without_ours(getattr(inductor_config, hook))
        setattr(
            inductor_config, hook, (others if len(others) > 1 else others[0]) if others else None
        )


@contextmanager
def enabled() -> Iterator[None]:
    """:func:`enable` for the duration of a block."""
    import torch._inductor.config as inductor_config

    saved = {hook: getattr(inductor_config, hook) for hook in _HOOKS}
    enable()
    try:
        yield
    finally:
        for hook, value in saved.items():
            setattr(inductor_config, hook, value)
