"""torch_moe.nn modules."""

from torch_moe.nn.modules.moe import (
    PRESETS,
    GroupedExperts,
    MoE,
    SharedExperts,
    TopKRouter,
    hf_state_dict_to_moe,
)

__all__ = [
    "PRESETS",
    "GroupedExperts",
    "MoE",
    "SharedExperts",
    "TopKRouter",
    "hf_state_dict_to_moe",
]
