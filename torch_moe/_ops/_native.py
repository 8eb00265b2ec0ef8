"""Native CPU kernels, compiled on first use with ``torch.utils.cpp_extension``.

Design note. ATen has no fused "silu(gate) * up" CPU kernel, and composing it from ATen
ops with fp32 math and one rounding (the project's activation contract) costs five
passes over fp32 temporaries forward and twelve backward; at a few hundred rows per
expert those passes, not the GEMMs, are what an experts block spends beyond HF's bf16
activation. ``csrc/swiglu_cpu.cpp`` computes the same operations row by row, with the
same bits (its header says how), and the composed experts' activations (the glu op's)
in one pass over each chunk cut as ATen's loops cut it. Likewise the permutation's index sort and the
unweighted combine (``csrc/permute_cpu.cpp``): a dozen ATen calls each, whose per-call
cost (the interpreter and the dispatcher run from cold caches after the expert GEMMs)
is most of a small batch's overhead, become one call with the same integers / bits. And
a grouped GEMM of a few rows per group (``csrc/grouped_mm_cpu.cpp``): one call for all
groups that reads each expert's weight once, where the probe's ``few_gemm`` measured it
faster than ``torch._grouped_mm`` (not ATen's bits: fp32 sums in another order), and
on two or more threads a grouped GEMM that gives each thread an equal share of the
groups' work as one-thread ATen GEMMs (``csrc/grouped_mm_threads_cpu.cpp``) instead of
every group's GEMM split over all threads, unless the probe's ``threads_mm`` measured
that slower (on one thread too where it runs a half dtype's fp32 upcast, its operands
converted in the thread's scratch, or the native bf16 GEMM).
They are prototypes of ATen kernels; until those exist they are built here, once per
machine and CPU capability, into torch's extensions directory (``TORCH_EXTENSIONS_DIR``)
as one library of plain ``torch.ops.torch_moe_cpu`` ops, which takes 10-20 s with a C++
compiler and under a second to load afterwards.
Where torch's parallel backend is OpenMP it is compiled with OpenMP too, so that the
kernels' ``at::parallel_for`` loops run on torch's intra-op threads (``_openmp``; before,
they ran on one thread whatever ``torch.get_num_threads()`` was).

``TORCH_MOE_NATIVE=0`` never builds it. A failed build (no compiler, say) warns once and
the ATen ops run instead, with the same results; whether the activation kernel is used
where it built is the CPU probe's ``act_kernel`` decision (measured, forcible); the
permutation kernels (one call against a dozen, a counting sort against a sort) are used
wherever they built.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["ENV", "available", "kernels"]

ENV = "TORCH_MOE_NATIVE"

# A row long enough that a kernel's sum in ATen's order (csrc/aten_sum.h's aten_order_sum)
# ends with every level of its cascade holding a part: 4096 + 256 + 16 + 5 groups of four
# vectors of 8 floats, then 2 vectors and 7 floats more (the kernels' first-use checks
# against ATen's sum run rows of this length).
CASCADE_ROW = 8 * 4 * (4096 + 256 + 16 + 5) + 8 * 2 + 7
_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SOURCES = [
    _CSRC / name
    for name in (
        "swiglu_cpu.cpp",
        "permute_cpu.cpp",
        "grouped_mm_cpu.cpp",
        "grouped_mm_threads_cpu.cpp",
        "gemm_bf16_cpu.cpp",
        "router_cpu.cpp",
        "parallel_cpu.cpp",
        "cache_cpu.cpp",
        "fp8_cpu.cpp",
        "experts_cpu.cpp",
    )
]
_lock = threading.Lock()
_STALE_LOCK_S = 600.0  # a build lock older than this was left by a build that died
_built: dict[str, Any] = {}  # capability -> the ops' namespace, or None

# compiler flags per ATen CPU capability: the kernel's Vectorized<float> must have the
# width of the ATen kernels it reproduces (their vector / scalar split of a row)
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _capability() -> str:
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in _CAPABILITY_FLAGS else "DEFAULT"


def _clear_stale_lock(name: str) -> None:
    """``load`` waits, without a limit, for the build directory's ``lock`` file to go; a
    build process killed mid-build (a test run interrupted, say) leaves it behind, and
    every later build would wait forever. Wait here while another process may still be
    building (a build takes 10-20 s), and remove a lock older than ``_STALE_LOCK_S``."""
    from torch.utils import cpp_extension

    try:
        lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
    except Exception:  # a private helper: without it, load's own wait
        return
    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:  # removed meanwhile: the other build finished
            return
        if age > _STALE_LOCK_S:
            warnings.warn(
                f"torch_moe: removing a stale build lock {lock} ({age:.0f} s old, left by a "
                "build that did not finish); building the native CPU kernels",
                stacklevel=3,
            )
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.5)


def _openmp() -> bool:
    """Whether to compile the kernels with OpenMP: ``at::parallel_for`` is a header
    template whose threads come from an ``omp parallel`` region compiled into the
    caller, so without ``-fopenmp`` every kernel runs on one thread whatever
    ``torch.get_num_threads()`` says. Where torch's own backend is OpenMP (Linux wheels:
    GNU OpenMP, ``libgomp.so.1``), linking ``-fopenmp`` resolves to the runtime torch has
    already loaded, so both share one thread pool."""
    return (
        sys.platform.startswith("linux")
        and "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()
    )


def compile_flags(cap: str) -> tuple[list[str], list[str]]:
    """(compiler flags, linker flags) of the kernels' library for ATen CPU capability
    ``cap`` (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``)."""
    flags = ["-O3", *_CAPABILITY_FLAGS.get(cap, [])]
    if cap != "DEFAULT":
        flags += [f"-DCPU_CAPABILITY_{cap}", f"-DCPU_CAPABILITY={cap}"]
    ldflags = []
    if _openmp():
        flags.append("-fopenmp")
        ldflags.append("-fopenmp")
    return flags, ldflags


def _build(cap: str) -> Any:
    from torch.utils.cpp_extension import load

    flags, ldflags = compile_flags(cap)
    _clear_stale_lock(f"torch_moe_cpu_{cap.lower()}")
    load(
        name=f"torch_moe_cpu_{cap.lower()}",
        sources=[str(src) for src in _SOURCES],
        extra_cflags=flags,
        extra_ldflags=ldflags,
        is_python_module=False,  # registers torch.ops.torch_moe_cpu (no pybind11: builds faster)
        verbose=False,
    )
    return torch.ops.torch_moe_cpu


def kernels() -> Any:
    """The compiled kernels' ops (``torch.ops.torch_moe_cpu``: ``swiglu_forward``,
    ``swiglu_backward``, ``glu_oai_*``, ``glu_swiglu_*``, ``relu2_*``, ``permute_indices``,
    ``combine``, ``few_rows_mm``, ``threaded_grouped_mm``, ``threaded_grouped_mm_wgrad``,
    ``parallel_threads``), or None where disabled or the build failed."""
    if not enabled():
        return None
    cap = _capability()
    if cap in _built:
        return _built[cap]
    with _lock:
        if cap not in _built:
            try:
                _built[cap] = _build(cap)
            except Exception as e:  # no compiler, no headers: the ATen ops run instead
                warnings.warn(
                    f"torch_moe: the native CPU kernels did not build ({type(e).__name__}: "
                    f"{str(e)[:300]}); using ATen ops (same results, slower). Set {ENV}=0 to "
                    "skip the build.",
                    stacklevel=2,
                )
                _built[cap] = None
    return _built[cap]


def available() -> bool:
    return kernels() is not None
