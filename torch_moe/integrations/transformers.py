"""torch_moe inside HF transformers: an ``ExpertsInterface`` backend and MoE-block converters.

Legend: T tokens, D model dim, F expert hidden dim, E experts, K top-k.

Importing this module (transformers stays an optional dependency of torch_moe) registers
the experts implementation ``"torch_moe"`` and one ``"torch_moe_<recipe>"`` per
low-precision recipe of :data:`torch_moe.quantization.RECIPES`::

    import torch_moe.integrations.transformers as tmt

    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="torch_moe")
    model.set_experts_implementation("torch_moe")        # or switch an existing model
    tmt.set_precision(model, "fp8_rowwise")              # FP8 / MX experts (any Recipe)

Every experts module of the model then runs through :func:`experts_forward`: the model's
own routing, ``torch_moe.ops.permute``, the grouped SwiGLU op (or, for other layouts,
grouped GEMMs around the module's own activation), and the fp32 combine; see
``_transformers_experts`` for the two paths and what each saves for the backward.

``to_torch_moe(model)`` replaces the supported sparse-MoE blocks by
``torch_moe.nn.MoE`` (expert parallelism with
``parallelize_module(block.moe, mesh, ExpertParallel())``, ``load_stats()``,
aux-loss-free balancing); ``from_torch_moe(model)`` goes back bitwise. See
``_transformers_convert``.

Tested with transformers ``TESTED_TRANSFORMERS`` (min inclusive, max exclusive); another
version warns once on import.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

try:
    import transformers
    from transformers.integrations.moe import ExpertsInterface
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "torch_moe.integrations.transformers needs HF transformers 5.x: pip install transformers"
    ) from e

from torch_moe.integrations._transformers_convert import (
    SUPPORTED_BLOCKS,
    TorchMoEBlock,
    from_torch_moe,
    to_torch_moe,
    torch_moe_blocks,
)
from torch_moe.integrations._transformers_experts import (
    RECIPE_ATTR,
    REQUIRED_FLAGS,
    ExpertsLayout,
    experts_forward,
    experts_layout,
)
from torch_moe.quantization import RECIPES, Recipe, get_recipe

__all__ = [
    "IMPLEMENTATION",
    "SUPPORTED_BLOCKS",
    "TESTED_TRANSFORMERS",
    "ExpertsLayout",
    "TorchMoEBlock",
    "check_transformers_version",
    "experts_forward",
    "experts_layout",
    "experts_modules",
    "from_torch_moe",
    "implementation_name",
    "set_precision",
    "to_torch_moe",
    "torch_moe_blocks",
]

IMPLEMENTATION = "torch_moe"
TESTED_TRANSFORMERS = ("5.23.0", "5.24.0")  # [min, max)
_warned_versions: set[str] = set()


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_transformers_version(version: str | None = None) -> bool:
    """True if ``version`` (default: the installed one) is in ``TESTED_TRANSFORMERS``;
    otherwise warns (once per version) with the tested range and returns False."""
    v = transformers.__version__ if version is None else version
    lo, hi = TESTED_TRANSFORMERS
    if _version_tuple(lo) <= _version_tuple(v) < _version_tuple(hi):
        return True
    if v not in _warned_versions:
        _warned_versions.add(v)
        warnings.warn(
            f"torch_moe.integrations.transformers is tested with transformers >={lo},<{hi}; "
            f"found {v}. The experts layout flags or block classes may differ.",
            stacklevel=2,
        )
    return False


def implementation_name(precision: str | Recipe = "bf16") -> str:
    """The experts implementation registered for ``precision``: ``"torch_moe"`` for
    ``"bf16"``, ``"torch_moe_<name>"`` for a recipe of ``RECIPES``."""
    if isinstance(precision, str) and precision == "bf16":
        return IMPLEMENTATION
    recipe = get_recipe(precision)
    if RECIPES.get(recipe.name) != recipe:
        raise ValueError(
            f"implementation_name: recipe {recipe.name!r} is not a registered one; use "
            "set_precision(model, recipe) for custom recipes"
        )
    return f"{IMPLEMENTATION}_{recipe.name}"


def _recipe_forward(recipe: Recipe) -> Any:
    def forward(self: nn.Module, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        return experts_forward(self, hidden_states, top_k_index, top_k_weights, recipe=recipe)

    forward.__name__ = f"torch_moe_{recipe.name}_experts_forward"
    return forward


def _register() -> None:
    ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    for name, recipe in RECIPES.items():
        ExpertsInterface.register(f"{IMPLEMENTATION}_{name}", _recipe_forward(recipe))


def experts_modules(model: nn.Module) -> list[tuple[str, Any]]:
    """(name, module) of every transformers experts module (``@use_experts_implementation``)."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if all(hasattr(m, f) for f in REQUIRED_FLAGS) and hasattr(m, "down_proj")
    ]


def set_precision(model: nn.Module, precision: str | Recipe = "bf16") -> int:
    """Run ``model``'s experts in ``precision`` with torch_moe; returns how many were set.

    ``precision``: ``"bf16"`` (the compute dtype: parameters' or autocast's), a recipe name
    of :data:`torch_moe.quantization.RECIPES` (``"fp8_rowwise"``, ...) or a
    :class:`~torch_moe.quantization.Recipe` (e.g. with per-GEMM overrides). HF experts
    modules get the recipe and the model's experts implementation becomes ``"torch_moe"``
    (``set_experts_implementation``); converted blocks (:func:`to_torch_moe`) get it as
    their ``MoE.experts`` recipe. Raises ``ValueError`` for an unknown recipe name or a
    model without experts.
    """
    recipe = None if isinstance(precision, str) and precision == "bf16" else get_recipe(precision)
    hf = experts_modules(model)
    blocks = torch_moe_blocks(model)
    if not hf and not blocks:
        raise ValueError(
            f"set_precision: {type(model).__name__} has no transformers experts module and no "
            "TorchMoEBlock"
        )
    for _, m in hf:
        setattr(m, RECIPE_ATTR, recipe)
    for _, b in blocks:
        b.moe.experts.recipe = recipe
    if hf:
        setter = getattr(model, "set_experts_implementation", None)
        if setter is not None:
            setter(IMPLEMENTATION)
        else:  # a bare module: its experts read config._experts_implementation
            for _, m in hf:
                m.config._experts_implementation = IMPLEMENTATION
    return len(hf) + len(blocks)


check_transformers_version()
_register()
