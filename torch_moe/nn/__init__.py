"""torch_moe.nn: MoE building blocks (``torch_moe.nn.functional`` for the functional API)."""

from torch_moe.nn import functional
from torch_moe.nn.modules import (
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
    "functional",
    "hf_state_dict_to_moe",
]
