"""Low-precision recipes: how each of the three GEMMs of a grouped linear layer is done.

A linear layer ``Y = X W`` per expert runs three GEMMs, each written ``C = A B`` with A [m, k],
B [k, n] and k the reduction dim:

- ``forward``: ``Y = X W``          A = X [M, K],   B = W_e [K, N]   (k = K)
- ``dgrad``:   ``dX = dY W^T``      A = dY [M, N],  B = W_e^T [N, K] (k = N)
- ``wgrad``:   ``dW_e = X_e^T dY_e`` A = X^T [K, M], B = dY [M, N]   (k = M, jagged per expert)

An :class:`OperandQuant` gives the block of one operand as ``(outer, inner)``: ``inner`` along
the reduction dim k, ``outer`` along the other dim (m for A, n for B); -1 = the whole dim.
For wgrad the inner blocks restart at every expert's group boundary (jagged, see
:func:`torch_moe.quantization.quantize.quantize_jagged`); a whole-tensor scale (-1, -1) is
uniform, so it never mixes the scales of two experts either. A :class:`GemmQuant` with no
operands (:data:`BF16`) runs that GEMM in bf16.

Recipes cross the op boundary as strings (a custom op's schema takes no Python objects):
the name of a registered recipe (``"fp8_rowwise"``), or for any other recipe its ``spec``,
``"forward=<gemm>;dgrad=<gemm>;wgrad=<gemm>"`` with ``<gemm>`` = ``bf16`` or
``<lhs>*<rhs>`` and an operand written ``fp8:<outer>x<inner>`` or
``mx:<outer>x<inner>:<scale_rule>``, e.g. ``fp8:1x128*fp8:128x128``. :func:`get_recipe`
reads both; :meth:`Recipe.op_arg` writes the shorter.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

__all__ = [
    "BF16",
    "RECIPES",
    "GemmQuant",
    "OperandQuant",
    "Recipe",
    "get_recipe",
]


@dataclass(frozen=True)
class OperandQuant:
    """Quantization of one GEMM operand (elements are always float8_e4m3fn).

    Attributes:
        fmt: ``"fp8"`` (fp32 scale amax/448) or ``"mx"`` (E8M0 power-of-two scale).
        outer: block extent along the non-reduction dim (-1 = whole dim).
        inner: block extent along the reduction dim (-1 = whole dim).
        scale_rule: MX only: ``"floor"`` (OCP spec) or ``"rceil"`` (no clipping).
    """

    fmt: str
    outer: int
    inner: int
    scale_rule: str = "floor"

    def __post_init__(self) -> None:
        if self.fmt not in ("fp8", "mx"):
            raise ValueError(f"OperandQuant: fmt must be 'fp8' or 'mx', got {self.fmt!r}")
        for name in ("outer", "inner"):
            v = getattr(self, name)
            if not isinstance(v, int) or (v < 1 and v != -1):
                raise ValueError(f"OperandQuant: {name} must be a positive int or -1, got {v!r}")
        if self.fmt == "mx" and self.outer != 1:
            raise ValueError(f"OperandQuant: MX blocks are 1 x inner, got outer={self.outer}")
        if self.fmt == "mx" and self.inner == -1:
            raise ValueError("OperandQuant: MX needs a finite inner block (32), got -1")
        if self.scale_rule not in ("floor", "rceil"):
            raise ValueError(
                f"OperandQuant: scale_rule must be 'floor' or 'rceil', got {self.scale_rule!r}"
            )

    @property
    def spec(self) -> str:
        """``fp8:<outer>x<inner>`` or ``mx:<outer>x<inner>:<scale_rule>`` (module doc)."""
        blocks = f"{self.fmt}:{self.outer}x{self.inner}"
        return f"{blocks}:{self.scale_rule}" if self.fmt == "mx" else blocks


@dataclass(frozen=True)
class GemmQuant:
    """How one GEMM runs: both operands quantized, or (``lhs is None``) in bf16."""

    lhs: OperandQuant | None = None
    rhs: OperandQuant | None = None

    def __post_init__(self) -> None:
        if (self.lhs is None) != (self.rhs is None):
            raise ValueError("GemmQuant: quantize both operands or neither (bf16)")

    @property
    def is_bf16(self) -> bool:
        return self.lhs is None

    @property
    def spec(self) -> str:
        """``bf16`` or ``<lhs>*<rhs>`` (module doc)."""
        if self.lhs is None or self.rhs is None:
            return "bf16"
        return f"{self.lhs.spec}*{self.rhs.spec}"


BF16 = GemmQuant()
_GEMMS = ("forward", "dgrad", "wgrad")


@dataclass(frozen=True)
class Recipe:
    """A named low-precision recipe: one :class:`GemmQuant` per GEMM of the layer."""

    name: str
    forward: GemmQuant
    dgrad: GemmQuant
    wgrad: GemmQuant

    def __post_init__(self) -> None:
        for op in (self.wgrad.lhs, self.wgrad.rhs):
            if op is not None and op.outer != 1 and (op.outer, op.inner) != (-1, -1):
                raise ValueError(
                    f"Recipe {self.name!r}: wgrad operands are quantized per column in jagged "
                    f"per-expert blocks (outer=1) or per tensor (-1, -1), got {op}"
                )

    @property
    def spec(self) -> str:
        """The recipe as a string :func:`get_recipe` reads back (module doc)."""
        return ";".join(f"{g}={getattr(self, g).spec}" for g in _GEMMS)

    def op_arg(self) -> str:
        """How the recipe is passed to the ``torch_moe::`` ops: its name when it is a
        registered recipe, else its spec."""
        return self.name if RECIPES.get(self.name) == self else self.spec

    def with_overrides(self, **gemms: GemmQuant | str) -> Recipe:
        """Replace GEMMs by name, e.g. ``recipe.with_overrides(wgrad="bf16")``."""
        changes: dict[str, GemmQuant] = {}
        for gemm, value in gemms.items():
            if gemm not in _GEMMS:
                raise ValueError(
                    f"Recipe.with_overrides: unknown GEMM {gemm!r}, expected one of {_GEMMS}"
                )
            if value == "bf16":
                changes[gemm] = BF16
            elif isinstance(value, GemmQuant):
                changes[gemm] = value
            else:
                raise ValueError(
                    f"Recipe.with_overrides: {gemm} must be 'bf16' or a GemmQuant, got {value!r}"
                )
        suffix = ",".join(f"{g}={'bf16' if v.is_bf16 else 'custom'}" for g, v in changes.items())
        return dataclasses.replace(self, name=f"{self.name}[{suffix}]", **changes)


def _same(op: OperandQuant) -> GemmQuant:
    return GemmQuant(op, op)


def _mx(rule: str) -> Recipe:
    op = OperandQuant("mx", 1, 32, rule)
    name = "mxfp8" if rule == "floor" else f"mxfp8_{rule}"
    return Recipe(name, _same(op), _same(op), _same(op))


_TENSOR = OperandQuant("fp8", -1, -1)
_ROW = OperandQuant("fp8", 1, -1)

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("fp8_tensorwise", _same(_TENSOR), _same(_TENSOR), _same(_TENSOR)),
        # wgrad: per column of X / dY over each expert's rows
        Recipe("fp8_rowwise", _same(_ROW), _same(_ROW), _same(_ROW)),
        # DeepSeek-V3: 1x128 activations / gradients, 128x128 weights; wgrad 128x1 (jagged)
        Recipe(
            "fp8_blockwise",
            GemmQuant(OperandQuant("fp8", 1, 128), OperandQuant("fp8", 128, 128)),
            GemmQuant(OperandQuant("fp8", 1, 128), OperandQuant("fp8", 128, 128)),
            _same(OperandQuant("fp8", 1, 128)),
        ),
        _mx("floor"),
        _mx("rceil"),
    )
}


def get_recipe(name: str | Recipe) -> Recipe:
    """The recipe called ``name``, or written as a spec (module doc); a :class:`Recipe` is
    returned as is."""
    if isinstance(name, Recipe):
        return name
    if isinstance(name, str) and name in RECIPES:
        return RECIPES[name]
    if isinstance(name, str) and "=" in name:
        return _parse_spec(name)
    raise ValueError(f"unknown low-precision recipe {name!r}; supported: {sorted(RECIPES)}")


def _parse_operand(text: str, spec: str) -> OperandQuant:
    parts = text.split(":")
    try:
        outer, inner = (int(v) for v in parts[1].split("x"))
        if parts[0] == "fp8" and len(parts) == 2:
            return OperandQuant("fp8", outer, inner)
        if parts[0] == "mx" and len(parts) == 3:
            return OperandQuant("mx", outer, inner, parts[2])
    except (IndexError, ValueError) as e:
        raise ValueError(f"bad operand {text!r} in the recipe spec {spec!r}: {e}") from e
    raise ValueError(
        f"bad operand {text!r} in the recipe spec {spec!r}: expected fp8:<outer>x<inner> or "
        "mx:<outer>x<inner>:<scale_rule>"
    )


@functools.lru_cache(maxsize=256)
def _parse_spec(spec: str) -> Recipe:
    gemms: dict[str, GemmQuant] = {}
    for item in spec.split(";"):
        gemm, _, text = item.partition("=")
        if gemm not in _GEMMS or gemm in gemms:
            raise ValueError(
                f"bad recipe spec {spec!r}: expected forward=...;dgrad=...;wgrad=..., got {item!r}"
            )
        if text == "bf16":
            gemms[gemm] = BF16
        else:
            lhs, star, rhs = text.partition("*")
            if not star:
                raise ValueError(f"bad recipe spec {spec!r}: {gemm} must be bf16 or <lhs>*<rhs>")
            gemms[gemm] = GemmQuant(_parse_operand(lhs, spec), _parse_operand(rhs, spec))
    if set(gemms) != set(_GEMMS):
        raise ValueError(f"bad recipe spec {spec!r}: needs forward, dgrad and wgrad")
    for recipe in RECIPES.values():  # keep the registered name when the spec is one
        if (recipe.forward, recipe.dgrad, recipe.wgrad) == tuple(gemms[g] for g in _GEMMS):
            return recipe
    return Recipe(spec, **gemms)
