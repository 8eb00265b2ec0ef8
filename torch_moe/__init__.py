"""torch_moe: Mixture-of-Experts layers and ops for PyTorch.

Importing ``torch_moe`` registers the ``torch_moe::`` custom ops (``torch.ops.torch_moe``).
Public surface: ``torch_moe.ops`` (routing, permute/unpermute, grouped GEMMs) and
``torch_moe.nn`` (functional API and modules).
"""

from torch_moe import _ops, nn, ops  # noqa: F401  (registers the ops)

__all__ = ["nn", "ops"]
__version__ = "0.1.0"
