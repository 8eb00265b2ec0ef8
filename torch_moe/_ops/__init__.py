"""torch_moe custom ops (namespace ``torch_moe::``), one op family per file.

Importing this package registers every op with the dispatcher; the data flows one way:
router -> routing -> permute -> grouped_mm / grouped_swiglu / fused_experts -> unpermute.
"""

from torch_moe._ops import (  # noqa: F401
    fused_experts,
    glu,
    grouped_mm,
    grouped_swiglu,
    permute,
    router,
    routing,
)
