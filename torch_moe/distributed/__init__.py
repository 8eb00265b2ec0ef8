"""Distributed MoE: expert placement (more to come: expert parallel dispatch/combine)."""

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
    "ExpertPlacement",
    "balancedness",
    "identity_placement",
    "plan_placement",
    "remap_expert_weights",
    "remap_indices",
    "route_to_replicas",
]
