"""The router's logits: ``torch_moe::router_logits`` and its backward.

Legend: T tokens, D model dim, E experts.

Semantics: ``logits [T, E] = x [T, D] @ weight [E, D]^T (+ bias [E])`` in fp32 (fp64 for
fp64 x): x, weight and bias are converted to that dtype (exactly, unless a weight or bias
is fp64 and x is not) and the products are summed in it, whatever the inputs' dtypes, so that routing (``topk_route``) sees logits
that a bf16 rounding has not reordered. The backward rounds ``grad @ weight`` to x's
dtype and ``grad^T @ x`` to weight's, ``grad.sum(0)`` to bias's.

The reference (:func:`router_logits_reference`) is that conversion and ATen's GEMMs; it
runs on every device and for fp32 / fp64 inputs, where it is exactly the
``F.linear(x.float(), weight.float())`` of the HF routers that compute in fp32. For
bf16 / fp16 x and weight on the CPU, the native kernels (``csrc/router_cpu.cpp``) do the
same math (exact products, fp32 sums) in another order, reading the half-precision
operands in place: ATen's fp32 GEMMs run a router's few columns far below their
large-GEMM rate and the conversions copy x twice per step (figures in the kernel's
header and ``benchmarks/results/cpu_floor_cpu_202612.md``). Their sums depend on D, T
and E only, never on the thread count. With AVX512-BF16 the forward's products come
from ``vdpbf16ps``, which reads denormal inputs as zero (as the expert GEMMs' bf16
kernels do). Where the CPU has AMX tiles, the CPU probe's ``router_kernel`` (measured per
class of tokens and experts) may send bf16 logits and grad_x to the expert GEMMs' AMX
micro-kernel instead: the logits' fp32 sums as the tiles leave them, grad_x from the
fp32 gradient's three exact bf16 parts (the same math again; figures in the kernel's
header). ``TORCH_MOE_NATIVE=0`` runs the reference.

Gradients: the backward op (``torch_moe::router_logits_backward``) is not itself
differentiable; a double backward (``create_graph=True``) takes the reference formulas
in differentiable ATen ops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torch_moe._ops import _cpu_probe, _native
from torch_moe._ops._dtypes import FLOAT_DTYPES, acc_dtype, no_autocast
from torch_moe._ops._eager import direct_calls

__all__ = ["router_logits", "router_logits_backward", "router_logits_reference"]

_HALF = (torch.bfloat16, torch.float16)


def _check(x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"router_logits: expected x [T, D] in one of {FLOAT_DTYPES}, got "
            f"{list(x.shape)} {x.dtype}"
        )
    if weight.dim() != 2 or weight.dtype not in FLOAT_DTYPES or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"router_logits: expected weight [E, D={x.shape[1]}] in one of {FLOAT_DTYPES}, "
            f"got {list(weight.shape)} {weight.dtype}"
        )
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype not in FLOAT_DTYPES):
        raise ValueError(
            f"router_logits: expected bias [E={weight.shape[0]}] in one of {FLOAT_DTYPES}, "
            f"got {list(bias.shape)} {bias.dtype}"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(
                f"router_logits: {name} is on {t.device}, x on {x.device}: expected one device"
            )


def router_logits_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` on x, weight and bias converted to fp32 (fp64 for fp64 x)."""
    acc = acc_dtype(x.dtype)
    with no_autocast(x.device.type):
        return F.linear(x.to(acc), weight.to(acc), None if bias is None else bias.to(acc))


def _native_kernels(x: Tensor, weight: Tensor) -> Any:
    """The native kernels' ops where they take these operands, else None."""
    if x.dtype not in _HALF or weight.dtype != x.dtype or not x.is_cpu:
        return None
    mod = _native.kernels()
    return mod if mod is not None and hasattr(mod, "router_logits") else None


_ROUTER_PROBE_D = 1024  # the probe's model dim (the ranking is the experts' and tokens')


def _tiles(x: Tensor, weight: Tensor) -> bool:
    """Whether the native kernels take the expert GEMMs' AMX tiles for these bf16 operands
    (the CPU probe's ``router_kernel`` at this many tokens, capped at 256, and experts,
    each rounded up to a power of two), else their dot products / fp32 FMAs. Memoized."""
    if x.dtype != torch.bfloat16:
        return False
    rows = min(_cpu_probe._pow2_at_least(x.shape[0]), 256)
    experts = _cpu_probe._pow2_at_least(weight.shape[0])
    return _cpu_probe.memo(
        ("router_kernel", rows, experts), functools.partial(_decide_tiles, rows, experts)
    )


def _decide_tiles(rows: int, experts: int) -> bool:
    # (the tiles are the grouped GEMM's process-wide micro-kernel, which it turns on)
    from torch_moe._ops.grouped_mm import amx_tiles

    if not amx_tiles(torch.bfloat16):
        return False
    measure = functools.partial(_measure_tiles, rows, experts)
    return _cpu_probe.router_kernel(torch.bfloat16, rows, experts, measure) == "amx"


def _measure_tiles(rows: int, experts: int) -> dict[str, float]:
    """Seconds of the native logits and grad_x at ``rows`` x ``_ROUTER_PROBE_D`` tokens and
    ``experts`` experts, by the row kernels and by the tiles, operand sets cycled."""
    mod, dt, d = _native.kernels(), torch.bfloat16, _ROUTER_PROBE_D
    sets = [
        (
            torch.full((rows, d), 0.5, dtype=dt),
            torch.full((experts, d), 0.25, dtype=dt),
            torch.full((rows, experts), 0.125),
            torch.empty(rows, experts),
            torch.empty(rows, d, dtype=dt),
        )
        for _ in range(_cpu_probe._OPERAND_SETS)
    ]

    def run(tiles: bool) -> Callable[[tuple[Tensor, ...]], None]:
        def call(s: tuple[Tensor, ...]) -> None:
            x, w, g, out, gx = s
            mod.router_logits(x, w, None, out, tiles)
            mod.router_logits_backward(g, x, w, gx, None, tiles)

        return call

    return _cpu_probe.time_candidates(
        _cpu_probe.cycled(sets, {"native": run(False), "amx": run(True)})
    )


def _row_major(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


@torch.library.custom_op("torch_moe::router_logits", mutates_args=())
def router_logits(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight^T (+ bias)`` in fp32 (fp64 for fp64 x): [T, E]. See the module
    docstring."""
    _check(x, weight, bias)
    return router_logits_reference(x, weight, bias)


@router_logits.register_kernel("cpu")
def _router_logits_cpu(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    _check(x, weight, bias)
    mod = _native_kernels(x, weight)
    if mod is not None:
        out = x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
        b = None if bias is None else bias.to(torch.float32).contiguous()
        if mod.router_logits(_row_major(x), _row_major(weight), b, out, _tiles(x, weight)):
            return out
    return router_logits_reference(x, weight, bias)


@router_logits.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    _check(x, weight, bias)
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=acc_dtype(x.dtype))


def _backward_reference(
    grad: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_weight: bool
) -> tuple[Tensor, Tensor]:
    acc = acc_dtype(x.dtype)
    g = grad.to(acc)
    with no_autocast(x.device.type):
        grad_x = (g @ weight.to(acc)).to(x.dtype) if need_x else _unneeded(x)
        grad_w = (g.t() @ x.to(acc)).to(weight.dtype) if need_weight else _unneeded(weight)
    return grad_x, grad_w


def _unneeded(t: Tensor) -> Tensor:
    """The gradient not asked for: [0, D] (2-D, so that a DTensor placement of the
    needed one applies to it too)."""
    return t.new_empty((0, t.shape[1]))


def _check_backward(grad: Tensor, x: Tensor, weight: Tensor) -> None:
    _check(x, weight, None)
    if grad.shape != (x.shape[0], weight.shape[0]) or grad.dtype != acc_dtype(x.dtype):
        raise ValueError(
            f"router_logits_backward: expected grad [T={x.shape[0]}, E={weight.shape[0]}] in "
            f"{acc_dtype(x.dtype)}, got {list(grad.shape)} {grad.dtype}"
        )


@torch.library.custom_op("torch_moe::router_logits_backward", mutates_args=())
def router_logits_backward(
    grad: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_weight: bool
) -> tuple[Tensor, Tensor]:
    """(grad_x [T, D] in x's dtype, grad_weight [E, D] in weight's dtype) of
    ``router_logits`` for the logits' gradient ``grad`` [T, E]; an empty [0, D] tensor
    for one not needed."""
    _check_backward(grad, x, weight)
    return _backward_reference(grad, x, weight, need_x, need_weight)


@router_logits_backward.register_kernel("cpu")
def _router_logits_backward_cpu(
    grad: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_weight: bool
) -> tuple[Tensor, Tensor]:
    _check_backward(grad, x, weight)
    mod = _native_kernels(x, weight)
    if mod is not None:
        xr, wr = _row_major(x), _row_major(weight)
        grad_x = x.new_empty(x.shape) if need_x else None  # contiguous, as the reference's
        grad_w = weight.new_empty(weight.shape) if need_weight else None
        tiles = _tiles(x, weight)
        if mod.router_logits_backward(_row_major(grad), xr, wr, grad_x, grad_w, tiles):
            return (
                _unneeded(x) if grad_x is None else grad_x,
                _unneeded(weight) if grad_w is None else grad_w,
            )
    return _backward_reference(grad, x, weight, need_x, need_weight)


@router_logits_backward.register_fake
def _(
    grad: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_weight: bool
) -> tuple[Tensor, Tensor]:
    _check_backward(grad, x, weight)
    return (
        x.new_empty(x.shape) if need_x else _unneeded(x),
        weight.new_empty(weight.shape) if need_weight else _unneeded(weight),
    )


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad):  # type: ignore[no-untyped-def]
    x, weight = ctx.saved_tensors
    # (two entries where the op was called without its bias)
    need_x, need_w, need_b = (*ctx.needs_input_grad, False)[:3]
    grad_x = grad_w = grad_b = None
    if need_x or need_w:
        # a double backward takes the reference's differentiable ATen ops
        backward = _backward_reference if torch.is_grad_enabled() else router_logits_backward
        gx, gw = backward(grad.contiguous(), x, weight, need_x, need_w)
        grad_x = gx if need_x else None
        grad_w = gw if need_w else None
    if need_b:
        grad_b = grad.sum(0).to(ctx.bias_dtype)
    return grad_x, grad_w, grad_b


router_logits.register_autograd(_backward, setup_context=_setup_context)

# eager calls on plain CPU tensors skip the ops' Python layers (torch_moe/_ops/_eager.py):
# one call per layer, but at a few tokens (decode) its layers cost more than its math
router_logits = direct_calls(router_logits, _router_logits_cpu, _setup_context, _backward)
router_logits_backward = direct_calls(router_logits_backward, _router_logits_backward_cpu)
