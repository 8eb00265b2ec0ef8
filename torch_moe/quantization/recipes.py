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
"""

from __future__ import annotations

import dataclasses
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
    """The recipe called ``name`` (a :class:`Recipe` is returned as is)."""
    if isinstance(name, Recipe):
        return name
    if name not in RECIPES:
        raise ValueError(f"unknown low-precision recipe {name!r}; supported: {sorted(RECIPES)}")
    return RECIPES[name]
