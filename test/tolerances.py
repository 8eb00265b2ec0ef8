"""Tolerances derived from error analysis instead of guessed.

A floating-point dot product of length n accumulated in a dtype with unit roundoff u
satisfies ``|fl(a . b) - a . b| <= gamma_n * (|a| . |b|)`` with ``gamma_n = n*u / (1 - n*u)``
(Higham, *Accuracy and Stability of Numerical Algorithms*, eq. 3.5); storing the result in
a dtype with unit roundoff v adds at most ``v * |result|``. :func:`gemm_bound` gives that
bound elementwise for a GEMM, from the float64 products of the operands' magnitudes, so a
test compares ``|got - exact| <= bound`` and a 1% scale error or a shifted row (both far
above the bound for any nonzero data) fails it.
"""

from __future__ import annotations

import torch
from torch import Tensor

# unit roundoff: half the distance from 1.0 to the next representable number
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's gamma_n for an n-term sum accumulated in ``dtype``."""
    nu = n * UNIT_ROUNDOFF[dtype]
    if nu >= 1:
        raise ValueError(f"gamma: n*u = {nu} >= 1, no bound for n={n} in {dtype}")
    return nu / (1 - nu)


def gemm_bound(
    abs_products: Tensor, n: int, exact: Tensor, acc: torch.dtype, out: torch.dtype
) -> Tensor:
    """Elementwise bound on ``|computed - exact|`` for a GEMM whose entries are n-term dot
    products accumulated in ``acc`` and stored in ``out``.

    Args:
        abs_products: ``|A| @ |B|`` in float64 (same shape as the result).
        n: the reduction length.
        exact: the float64 result.
    """
    bound = gamma(n, acc) * abs_products
    if out != torch.float64:
        bound = bound + UNIT_ROUNDOFF[out] * (exact.abs() + bound)
    # subnormal results: one ulp of the smallest normal of the storage dtype
    return bound + torch.finfo(out).tiny


def assert_within(test, got: Tensor, exact: Tensor, bound: Tensor, msg: str = "") -> None:
    """``|got - exact| <= bound`` elementwise, with the worst offender in the message."""
    err = (got.double() - exact).abs()
    ratio = err / bound
    worst = int(ratio.argmax()) if ratio.numel() else 0
    test.assertTrue(
        bool((err <= bound).all()),
        msg=f"{msg}: error {float(err.flatten()[worst]):.3g} > bound "
        f"{float(bound.flatten()[worst]):.3g} at flat index {worst} "
        f"(max error/bound {float(ratio.max()):.3g})",
    )
