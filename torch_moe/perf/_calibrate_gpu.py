"""``calibrate(device="cuda")``: measure an accelerator's rates for the performance model.

The model's accelerator terms (``Hardware(kind="gpu")``, see :mod:`torch_moe.perf._model`)
are few: a GEMM rate per compute key (``"bf16"``, ``"fp32"``, and per low-precision recipe
``"<recipe>:forward"`` / ``":dgrad"`` / ``":wgrad"``), a rate per elementwise kernel in
bytes per second (``kernel_rates``), the copy bandwidth, and a cost per kernel launch. This
module measures each of them with the library's own calls on the device, and keeps what it
cannot measure (tile rows, links, the share of SMs that communication takes) from the
datasheet preset of the same GPU (:func:`Hardware.preset`; the H200's where the GPU has
none), saying which is which in ``Hardware.sources``:

* GEMMs: ``torch_moe.ops.grouped_mm`` forward and ``torch_moe::grouped_mm_wgrad`` on
  balanced groups (8 groups of 2048 rows, K = N = 4096; the rate of ``"bf16"`` is the
  median of the two, as the preset's), ``"fp32"`` a dense fp32 ``mm`` of as many rows (the
  router's GEMM; without TF32, as torch's default); each recipe's three GEMMs as
  ``torch_moe::scaled_grouped_mm`` / ``scaled_grouped_mm_wgrad`` on operands quantized
  ahead (the kernel alone: the model adds the quantize kernels itself), where the recipe's
  GEMM decomposes into quantize ops and that op
  (:func:`torch_moe.quantization.scaled_grouped_mm.decomposable`). A GEMM or kernel that
  is not decomposable or fails on the device keeps the preset's rate, named in
  ``sources``.
* Elementwise kernels: the calibration's kernel set (routing, sort, permute, unpermute,
  activation, casts, adds, copies, every quantize kind) at 2^24 elements, each rate the
  bytes the model counts for it (``_model._kernel_bytes``) over the median time.
* Copy bandwidth: a 256 MiB device-to-device copy, bytes read + written.
* Launch cost: the wall time per call of a chain of one-element adds issued from Python
  (the host cost of a launch; the model charges it once per kernel).
* Links: inside a process group of two or more ranks (``calibrate(device=..., group=...)``,
  collective), the group's alpha-beta measured on device tensors as the CPU calibration
  measures gloo's (:func:`torch_moe.perf._calibrate._measure_link`); otherwise the preset's.

Timing: CUDA events around a batch of calls after two warm-up calls, the median of five
batches (``torch.cuda.synchronize`` before and after); on a CPU device, for tests, the wall
clock. ``quick`` shrinks every size and times three batches of ~2 ms (a smoke run, under a
second on a CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from torch_moe.perf._hardware import Hardware

__all__ = ["calibrate_device"]

_BATCH_SECONDS = 0.02  # one timed batch: long enough for event resolution and launch gaps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(
    fn: Callable[[], object], device: torch.device, samples: int = 5, batch: float = _BATCH_SECONDS
) -> float:
    """Median seconds per call of ``fn`` over ``samples`` batches of ~``batch`` seconds."""
    for _ in range(2):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    reps = max(1, min(1000, int(batch / max(time.perf_counter() - t0, 1e-7))))
    times = []
    for _ in range(samples):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3 / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def _timing(quick: bool) -> dict[str, Any]:
    """``_seconds``' batches: three of ~2 ms for a quick (smoke) calibration."""
    return {"samples": 3, "batch": _BATCH_SECONDS / 10} if quick else {}


def _gemm_rates(device: torch.device, quick: bool) -> tuple[dict[str, float], list[str]]:
    """Measured GEMM rates (FLOP/s) per compute key, and the keys left to the preset."""
    from torch_moe import ops
    from torch_moe.quantization import RECIPES

    # the module (the package's attribute of that name is the function)
    S = importlib.import_module("torch_moe.quantization.scaled_grouped_mm")

    t = _timing(quick)
    groups, rows, k, n = (2, 128, 256, 256) if quick else (8, 2048, 4096, 4096)
    m = groups * rows
    offs = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * rows
    flops = 2.0 * m * k * n
    rates: dict[str, float] = {}
    bf16 = torch.bfloat16

    def operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(groups, n, k, device=device, dtype=dtype).transpose(-2, -1)
        dy = torch.randn(m, n, device=device, dtype=dtype)
        return x, w, dy

    x, w, dy = operands(bf16)
    fwd = flops / _seconds(lambda: ops.grouped_mm(x, w, offs), device, **t)
    wgrad = flops / _seconds(lambda: torch.ops.torch_moe.grouped_mm_wgrad(x, dy, offs), device, **t)
    rates["bf16"] = rates["fp16"] = statistics.median([fwd, wgrad])
    # fp32: a dense mm of the same size (the router's GEMM; fp32 experts are rare here)
    xf, wf = x.float(), w[0].float()
    rates["fp32"] = flops / _seconds(functools.partial(torch.mm, xf, wf), device, **t)
    del xf, wf  # the recipes' operands are quantized from the bf16 ones

    skipped = []
    for name, recipe in RECIPES.items():
        for phase in ("forward", "dgrad", "wgrad"):
            key = f"{name}:{phase}"
            try:
                call = _recipe_call(S, getattr(recipe, phase), phase == "wgrad", x, w, dy, offs)
                if call is None:
                    skipped.append(f"{key} (not decomposable)")
                    continue
                rates[key] = flops / _seconds(call, device, **t)
            except (RuntimeError, NotImplementedError, ValueError) as e:  # a kernel missing here
                skipped.append(f"{key} ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
    return rates, skipped


def _recipe_call(
    S: Any,
    g: Any,
    wgrad: bool,
    x: torch.Tensor,
    w: torch.Tensor,
    dy: torch.Tensor,
    offs: torch.Tensor,
) -> Callable[[], object] | None:
    """One call of recipe GEMM ``g``'s scaled kernel on operands quantized ahead (the
    weight gradient's for ``wgrad``), or None where ``g`` does not decompose into quantize
    ops and that kernel (``S`` is ``torch_moe.quantization.scaled_grouped_mm``)."""
    lhs, rhs, bf16 = g.lhs, g.rhs, torch.bfloat16
    if lhs is None or rhs is None:
        return None
    if wgrad:
        if not S.decomposable_wgrad(g):
            return None
        qx, sx = S.quantize_wgrad_operand(x, offs, lhs)
        qdy, sdy = S.quantize_wgrad_operand(dy, offs, rhs)
        op = torch.ops.torch_moe.scaled_grouped_mm_wgrad
        return lambda: op(qx, qdy, sx, sdy, offs, lhs.inner, bf16)
    if not S.decomposable(g):
        return None
    qa, sa = S.quantize_lhs(x, lhs)
    qb, sb = S.quantize_rhs(w, rhs)
    return lambda: torch.ops.torch_moe.scaled_grouped_mm(
        qa, qb, sa, sb, offs, lhs.inner, rhs.outer, bf16
    )


def _kernel_rates(device: torch.device, quick: bool) -> tuple[dict[str, float], list[str]]:
    """Bytes per second of each elementwise kernel the model charges (at 2^24 elements), and
    the kernels that failed on this device (the preset keeps their rates)."""
    from torch_moe.perf._calibrate import _kernel_factories
    from torch_moe.perf._model import _kernel_bytes

    n = 2**12 if quick else 2**24
    rates, failed = {}, []
    with torch.enable_grad():
        for name, make in _kernel_factories(torch.bfloat16, device).items():
            size = n * 4 if name == "copy" else n  # copy counts bytes, not elements
            try:
                sec = _seconds(make(size), device, **_timing(quick))
            except (RuntimeError, NotImplementedError, ValueError) as e:
                failed.append(f"{name} ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
                continue
            rates[name] = size * _kernel_bytes(name, 2) / sec
    return rates, failed


def _copy_bandwidth(device: torch.device, quick: bool) -> float:
    nbytes = 2**20 if quick else 2**28
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / _seconds(lambda: dst.copy_(src), device, **_timing(quick))


def _launch_cost(device: torch.device) -> float:
    """Wall seconds per one-element add issued from Python, 200 in a chain."""
    a = torch.zeros(1, device=device)

    def chain() -> None:
        for _ in range(200):
            torch.add(a, 1.0, out=a)

    chain()
    times = []
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        chain()
        _sync(device)
        times.append((time.perf_counter() - t0) / 200)
    return statistics.median(times)


def _base_preset(name: str) -> tuple[str, Hardware]:
    """The datasheet preset whose name the device's contains (the H200's otherwise)."""
    lowered = name.lower().replace(" ", "")
    for preset in ("h200", "h100", "b200"):
        if preset in lowered:
            return preset, Hardware.preset(preset)
    return "h200", Hardware.preset("h200")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} (a test of the accelerator calibration)"


def measure(device: torch.device, quick: bool = False) -> Hardware:
    """Measure ``device`` (see the module docstring); no caching."""
    name = _device_name(device)
    base_name, base = _base_preset(name)
    gemm, skipped = _gemm_rates(device, quick)
    kernels, kernels_failed = _kernel_rates(device, quick)
    bandwidth = _copy_bandwidth(device, quick)
    launch = _launch_cost(device)
    capacity = (
        float(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cuda"
        else base.memory_capacity
    )
    size = "quick sizes" if quick else "8 x 2048 rows, K = N = 4096"
    kept = ", ".join(skipped) if skipped else "none"
    kernels_kept = (
        f"; from preset {base_name}: " + ", ".join(kernels_failed) if kernels_failed else ""
    )
    sources = {
        **{k: f"preset {base_name}: {v}" for k, v in base.sources.items()},
        "gemm_rate": f"measured ({size}): bf16 / fp16 the median of grouped_mm forward and "
        "grouped_mm_wgrad, fp32 a dense mm of as many rows, each recipe's GEMMs as "
        f"scaled_grouped_mm on operands quantized ahead; from preset {base_name}: {kept}",
        "quantize": "measured: the quantize kernels alone, 2^24 elements",
        "kernels": "measured: the calibration's elementwise kernels, 2^24 elements "
        f"(the activation as the dense SwiGLU formula){kernels_kept}",
        "mem_bandwidth": "measured: 256 MiB device copy, read + written",
        "launch_overhead": "measured: wall time per one-element add issued from Python",
        "memory_capacity": "measured: device total memory"
        if device.type == "cuda"
        else f"preset {base_name}",
    }
    return dataclasses.replace(
        base,
        name=name,
        gemm_rate={**base.gemm_rate, **gemm},
        mem_bandwidth=bandwidth,
        memory_capacity=capacity,
        launch_overhead=launch,
        kernel_rates={**base.kernel_rates, **kernels},
        sources=sources,
        fingerprint={"device": name, "torch": torch.__version__, "quick": str(quick)},
    )


def calibrate_device(
    device: torch.device, *, quick: bool = False, cache: bool = True, refresh: bool = False
) -> Hardware:
    """The measured :class:`Hardware` of accelerator ``device``, cached per process and on
    disk (as the CPU calibration) by device name, torch version, the library sources and
    ``quick``."""
    from torch_moe.perf._calibrate import _cached, _sources_hash

    spec: Any = (_device_name(device), torch.__version__, _sources_hash(), quick)
    key = "gpu-" + hashlib.sha256(repr(spec).encode()).hexdigest()[:20]
    return _cached(key, lambda: measure(device, quick), cache, refresh)
