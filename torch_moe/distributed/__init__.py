"""Distributed MoE: expert parallelism (``ExpertParallel``) and expert placement."""

from torch_moe.distributed import sharding  # noqa: F401  (registers the DTensor sharding rules)
from torch_moe.distributed.expert_parallel import ExpertParallel
from torch_moe.distributed.placement import (
    ExpertPlacement,
    balancedness,
    identity_placement,
    plan_placement,
    remap_expert_weights,
    remap_indices,
    route_to_replicas,
)

__all__ = [
    "ExpertParallel",
    "ExpertPlacement",
    "balancedness",
    "identity_placement",
    "plan_placement",
    "remap_expert_weights",
    "remap_indices",
    "route_to_replicas",
]
