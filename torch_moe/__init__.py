"""torch_moe: Mixture-of-Experts layers and ops for PyTorch.

Importing ``torch_moe`` registers the ``torch_moe::`` custom ops (``torch.ops.torch_moe``).
Public surface: ``torch_moe.ops`` (routing, permute/unpermute, grouped GEMMs) and
``torch_moe.nn`` (functional API and modules).
"""

# NB (exit aborts with gloo): the first call of any torch.library custom op imports
# torch._dynamo (torch/_compile.py), which pulls in torch._inductor.config and parts of
# torch.distributed._shard. When that first import happens after init_process_group, the
# gloo process group outlives destroy_process_group() (its worker threads keep running)
# and the interpreter can abort at exit ("terminate called without an active exception").
# Importing it here, with torch_moe, puts it before init_process_group in the usual order
# (import, init, train, destroy, exit). See upstream_patches/0002-distributed-gloo-exit.
import torch._dynamo  # noqa: F401

from torch_moe import _ops, nn, ops  # noqa: F401  (registers the ops)

__all__ = ["nn", "ops"]
__version__ = "0.1.0"
