"""torch_moe.nn: MoE building blocks (``torch_moe.nn.functional`` for the functional API)."""

from torch_moe.nn import functional

__all__ = ["functional"]
