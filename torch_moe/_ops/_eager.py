"""Eager calls of torch_moe's custom ops on plain CPU tensors, without the op's Python layers.

Design note. Every compute path in torch_moe is a ``torch.library.custom_op`` so that the
dispatcher, autograd, FakeTensor, DTensor, ``torch.compile`` and ``opcheck`` all see it.
In eager mode an op call with autograd passes through about ten Python frames besides
its kernel: ``CustomOpDef.__call__``, the dispatcher into the Python autograd kernel, an
``autograd.Function`` whose forward re-dispatches below autograd into the Python backend
kernel, its dynamo-disable wrapper, argument defaults filled in and an output aliasing
check, and the same again for the ops its backward calls. On a 2-core EPYC (Zen 5) that
is ~60 us for ``grouped_swiglu`` forward with grad, and an HF experts block of a few
tokens per expert makes ~10 such calls: taking the layers away took such a block (16-64
tokens, Mixtral / Qwen3-MoE sizes, forward + backward) from 0.5-0.85 ms behind
transformers' ``grouped_mm`` to 0.1-0.4 ms, because they run cold after each expert GEMM.

For plain CPU tensors in eager mode those layers change nothing: no mode, subclass,
tracer or transform is there to see the op. So :class:`DirectOp` wraps an op with the
same CPU kernel and the same autograd formula (its ``setup_context`` and ``backward``, in
an ``autograd.Function``) and calls them itself where :func:`direct` holds, and the op
otherwise: under ``torch.compile`` / export / ``make_fx`` / FakeTensor (modes), DTensor or
any tensor subclass, functorch transforms, TorchScript tracing, other devices. The
values, the saved tensors and the gradients are the op's (the same functions run; tests
compare both ways bit for bit); a profiler still sees a record per op (its name).
``ENABLED = False`` (or ``TORCH_MOE_DIRECT_OPS=0``) always takes the op.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.profiler as _profiler
from torch import Tensor

__all__ = ["ENABLED", "DirectOp", "direct", "direct_calls"]

ENABLED = os.environ.get("TORCH_MOE_DIRECT_OPS", "1") != "0"
# tensor types an op call may hold and still skip its layers: a Parameter passed as it is
# (an HF module's transposed expert weight, say) is a plain tensor to every kernel
_PLAIN = (Tensor, torch.nn.Parameter)


def direct(args: tuple[Any, ...]) -> bool:
    """Whether an op call on ``args`` may skip the op's layers (module docstring): eager,
    no torch function / dispatch mode, functorch transform or TorchScript tracer active,
    and every tensor argument a plain ``torch.Tensor`` or ``nn.Parameter`` (which
    overrides no torch function) on the CPU (lists are not looked into: an op taking a
    list of tensors is not wrapped)."""
    if torch.compiler.is_compiling() or not ENABLED:
        return False
    if (
        torch._C._is_torch_function_mode_enabled()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._are_functorch_transforms_active()
        or torch._C._get_tracing_state() is not None
    ):
        return False
    for a in args:
        if isinstance(a, Tensor) and (type(a) not in _PLAIN or not a.is_cpu):
            return False
    return True


class DirectOp:
    """``op`` (a ``torch.library.custom_op``), called directly where :func:`direct` holds:
    ``cpu_kernel(*args)``, and with autograd where grad mode is on and a tensor argument
    requires grad, an ``autograd.Function`` running ``cpu_kernel``, ``setup_context`` and
    ``backward`` (the functions given to ``op.register_autograd``); an op without them
    called so takes the op (whatever it does about a gradient, the caller sees).
    Attributes other than the call are the op's."""

    def __init__(
        self,
        op: Any,
        cpu_kernel: Callable[..., Any],
        setup_context: Callable[..., None] | None = None,
        backward: Callable[..., Any] | None = None,
    ) -> None:
        self.op = op
        self.name: str = op._qualname  # "torch_moe::name"
        self._kernel = cpu_kernel
        self._signature = inspect.signature(cpu_kernel)
        params = list(self._signature.parameters.values())
        self._defaults = tuple(p.default for p in params)
        # fewer positional arguments than this is a call the op itself refuses
        self._required = sum(p.default is inspect.Parameter.empty for p in params)
        self._function: type[torch.autograd.Function] | None = None
        if backward is not None:
            assert setup_context is not None, "an op with a backward has a setup_context"

            # forward(ctx, *args) runs the op's setup_context itself: a Function with a
            # separate setup_context binds its arguments by inspect.signature per call
            def forward(ctx: Any, *args: Any) -> Any:
                output = cpu_kernel(*args)
                setup_context(ctx, args, output)
                return output

            self._function = type(
                f"{self.name.replace('::', '_')}_direct",
                (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)},
            )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.op, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            bound = self._signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = bound.args
        if len(args) < self._required or not direct(args):
            return self.op(*args)
        grad = torch.is_grad_enabled() and any(
            isinstance(a, Tensor) and a.requires_grad for a in args
        )
        if grad and self._function is None:  # the op's own answer: no autograd formula
            return self.op(*args)
        if len(args) < len(self._defaults):  # the autograd formula unpacks every input
            args = args + self._defaults[len(args) :]
        run = self._function.apply if grad else self._kernel  # type: ignore[union-attr]
        if _profiler._is_profiler_enabled:
            with torch.profiler.record_function(self.name):
                return run(*args)
        return run(*args)


def direct_calls(
    op: Any,
    cpu_kernel: Callable[..., Any],
    setup_context: Callable[..., None] | None = None,
    backward: Callable[..., Any] | None = None,
) -> Any:
    """``DirectOp(op, ...)``, typed as what it stands in for: ``name = direct_calls(name,
    ...)`` rebinds an op's module-level name, and callers keep the op's type."""
    return DirectOp(op, cpu_kernel, setup_context, backward)
