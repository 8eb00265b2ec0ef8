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
    test.assertEqual(got.shape, exact.shape, msg=msg)
    if exact.numel() == 0:
        return
    err = (got.detach().double() - exact).abs()
    ratio = err / bound
    worst = int(ratio.argmax()) if ratio.numel() else 0
    test.assertTrue(
        bool((err <= bound).all()),
        msg=f"{msg}: error {float(err.flatten()[worst]):.3g} > bound "
        f"{float(bound.flatten()[worst]):.3g} at flat index {worst} "
        f"(max error/bound {float(ratio.max()):.3g})",
    )


# --------------------------------------------------------------------------------------
# composite ops: first-order propagation of the same bounds through SwiGLU and the combine

# NB (constants): |silu'(z)| = |s(z)(1 + z(1 - s(z)))| <= 1.0999 for every real z (its
# maximum, at z ~ 2.4), so a perturbation d of the gate moves silu by at most 1.1 d;
# exp, sigmoid and the products of the activation are each within a few ulps of the
# accumulation dtype (libm's exp is faithfully rounded: < 1 ulp), counted below as
# (|gate| + 6) * u_acc relative (the |gate| term: exp(-g) amplifies the rounding of g).
SILU_LIPSCHITZ = 1.1


def storage_dtype_bound(value: Tensor, err: Tensor, dtype: torch.dtype) -> Tensor:
    """``err`` plus one rounding of ``value + err`` into ``dtype`` (nothing for float64)."""
    if dtype == torch.float64:
        return err
    return err + UNIT_ROUNDOFF[dtype] * (value.abs() + err)


def swiglu_bound(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    dtype: torch.dtype,
    acc: torch.dtype,
    row_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(exact, bound)`` for one expert's SwiGLU ``y = (silu(x W1^T) * (x W3^T)) W2^T``
    over rows x [R, D] (w13 [2F, D], w2 [D, F], values exactly representable in ``dtype``):
    both GEMMs accumulate in ``acc`` and every intermediate (h, a) and the output may be
    rounded to ``dtype`` (a kernel that keeps an intermediate in ``acc`` is within the
    bound too). First-order error propagation of :func:`gemm_bound`'s terms, with the
    nonlinearity bounded through :data:`SILU_LIPSCHITZ`; returned in float64."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    hidden = w13.shape[0] // 2
    h = x @ w13.t()
    dh = storage_dtype_bound(h, gamma(x.shape[1], acc) * (x.abs() @ w13.abs().t()), dtype)
    g, up, dg, dup = h[:, :hidden], h[:, hidden:], dh[:, :hidden], dh[:, hidden:]
    silu = g * torch.sigmoid(g)
    a = silu * up
    u_acc = UNIT_ROUNDOFF[acc]
    # |silu(g~) up~ - silu(g) up| <= |silu| dup + |up| L dg + L dg dup, plus the rounding of
    # the activation math in acc around the perturbed values
    da = silu.abs() * dup + (up.abs() + dup) * SILU_LIPSCHITZ * dg
    a_mag = (silu.abs() + SILU_LIPSCHITZ * dg) * (up.abs() + dup)
    da = da + (g.abs() + dg + 6) * u_acc * a_mag
    if row_weights is not None:
        rw = row_weights.double().abs().unsqueeze(1)
        a, da, a_mag = a * row_weights.double().unsqueeze(1), da * rw, a_mag * rw
        da = da + u_acc * a_mag
    da = storage_dtype_bound(a, da, dtype)
    y = a @ w2.t()
    dy = da @ w2.abs().t() + gamma(max(hidden, 1), acc) * ((a.abs() + da) @ w2.abs().t())
    dy = storage_dtype_bound(y, dy, dtype)
    return y, dy + (torch.finfo(dtype).tiny if dtype != torch.float64 else 0.0)


def combine_bound(
    w: Tensor, dw: Tensor, y: Tensor, dy: Tensor, dtype: torch.dtype, acc: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(exact, bound)`` of ``out = sum_k w[k] * y[k]`` (w [K], y [K, D], exact values and
    their bounds dw, dy) accumulated in ``acc`` and rounded to ``dtype``."""
    w, dw = w.double().unsqueeze(1), dw.double().unsqueeze(1)
    out = (w * y).sum(0)
    mag = ((w.abs() + dw) * (y.abs() + dy)).sum(0)
    err = (w.abs() * dy + y.abs() * dw + dw * dy).sum(0) + gamma(w.shape[0] + 1, acc) * mag
    return out, storage_dtype_bound(out, err, dtype)


# --------------------------------------------------------------------------------------
# norm-wise: a stated multiple of an independent low-precision emulation's own error

# The stated multiple per dtype, with what test_grouped_swiglu measured (20 seeds; ratio of
# the op's error norm to the emulation's): bf16 1.00 (the CPU kernel rounds at exactly the
# emulated points), fp16 <= 2.1 (this CPU upcasts fp16 GEMMs and keeps the temporaries in
# fp32: a different set of roundings), fp32 <= 9.2 (the n-term fp32 sums' own error, which
# the emulation leaves out, dominates one storage rounding). Each multiple stays far below
# what a 1% scale error costs: 3x the rounding level in bf16, 20x in fp16, 1e5x in fp32.
ROUNDING_MULTIPLE = {torch.bfloat16: 2.0, torch.float16: 4.0, torch.float32: 16.0}


def assert_rounding_level(
    test,
    got: Tensor,
    exact: Tensor,
    emulated: Tensor,
    multiple: float | None = None,
    msg: str = "",
) -> None:
    """``||got - exact||_2 <= multiple * ||emulated - exact||_2``: the result is as accurate,
    in the 2-norm, as ``emulated``, a computation written in the test that rounds to the
    low-precision dtype at the points the op's contract allows (naive.py), up to a stated
    ``multiple`` (:data:`ROUNDING_MULTIPLE` for ``got``'s dtype by default). Rounding errors
    add in quadrature, so a systematic error stands out: a 1% scale error or a shifted row
    fails. Where the emulation is exact (nothing to round), the result must be exact too."""
    if multiple is None:
        multiple = ROUNDING_MULTIPLE[got.dtype]
    exact = exact.double()
    level = float((emulated.detach().double() - exact).norm())
    err = float((got.detach().double() - exact).norm())
    if level == 0.0:  # nothing was rounded (e.g. no rows): the result must be exact too
        test.assertEqual(err, 0.0, msg=f"{msg}: error norm {err:.4g} where nothing rounds")
        return
    test.assertLessEqual(
        err,
        multiple * level,
        msg=f"{msg}: error norm {err:.4g} > {multiple} x the emulation's {level:.4g} "
        f"(relative to ||exact|| = {float(exact.norm()):.4g})",
    )


def routing_weight_bound(logits: Tensor, weights: Tensor, acc: torch.dtype) -> Tensor:
    """Elementwise bound on the routing weights [T, K] computed in ``acc`` from ``logits``
    [T, E] (exact values, float64): exp / sigmoid of an argument of magnitude L carries a
    relative error of about L * u (the argument's own rounding, amplified), the softmax sum
    of E terms gamma_E, and each of the max-shift, division, renormalization (K terms) and
    scaling one rounding; (2 L + E + K + 10) * u bounds the sum relative to each weight."""
    num_experts = logits.shape[1]
    k = weights.shape[1]
    finite = torch.where(logits.isfinite(), logits.double().abs(), 0.0)
    mag = finite.amax(1, keepdim=True) if finite.numel() else finite.new_zeros(logits.shape[0], 1)
    rel = (2 * mag + num_experts + k + 10) * UNIT_ROUNDOFF[acc]
    return rel * weights.double().abs() + torch.finfo(acc).tiny
