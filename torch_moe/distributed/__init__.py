"""Distributed MoE: expert parallelism (``ExpertParallel``), the segment and the
hierarchical all-to-all, DTensor sharding rules for the torch_moe ops, and expert
placement."""

from torch_moe.distributed import sharding  # noqa: F401  (registers the DTensor sharding rules)
from torch_moe.distributed.exchange import SegmentWork, all_to_all_segments
from torch_moe.distributed.expert_parallel import ExpertParallel, ExpertParallelDispatcher
from torch_moe.distributed.hierarchical import hierarchical_all_to_all_single, nodes_per_token
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
    "ExpertParallelDispatcher",
    "ExpertPlacement",
    "SegmentWork",
    "all_to_all_segments",
    "balancedness",
    "hierarchical_all_to_all_single",
    "identity_placement",
    "nodes_per_token",
    "plan_placement",
    "remap_expert_weights",
    "remap_indices",
    "route_to_replicas",
]
