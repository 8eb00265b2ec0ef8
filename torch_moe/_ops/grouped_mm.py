"""Grouped GEMM: ``torch_moe::grouped_mm`` (x @ w[g] per group),
``torch_moe::grouped_mm_wgrad`` (x[g]^T @ dy[g] per group, the 2D x 2D weight gradient)
and ``torch_moe::gather_grouped_mm`` (``grouped_mm`` of rows it gathers from the tokens
itself, so that the permuted input is not saved for the backward).

Legend: M rows, K reduction dim, N output dim, E groups (experts).

``offs`` [E] int32 holds group ENDS: group g owns rows ``offs[g-1]:offs[g]`` (with
``offs[-1]`` the first row past the last group, so ``offs[-1] <= M``). Empty groups are
allowed. Output rows at or past ``offs[-1]`` are zero, in the forward and in dX.

Why not just ``torch._grouped_mm`` (measured on torch 2.13, docs/design.md §9): its backward
fails on zero-stride gradients (``out.sum().backward()``), it needs K and N to be
multiples of 16 bytes, leaves dX rows past ``offs[-1]`` uninitialized, accepts
non-monotone ``offs``, and its meta kernel only accepts bf16. Dispatch here:

* CPU: a loop of ``mm`` over the groups, or ``torch._grouped_mm`` where it is correct
  and measured faster (NB below). ``offs`` is read on the host (free on CPU).
* CUDA: ``torch._grouped_mm`` for bf16 with 16-byte aligned K and N on sm_90+ (the
  padded rows are zeroed on device); the persistent Triton kernel
  (``torch_moe._triton.grouped_mm``) for the rest; no host sync on either path.
* anything else: the host loop.

NB (CPU speed): the CPU kernels take no layout or dtype rule from one machine; each
choice is measured on the running machine the first time it is needed
(``torch_moe._ops._cpu_probe``, forceable for tests; rates of both machine classes in
benchmarks/results/ops_cpu_202612.md):

* dtype: CPUs without native bf16/fp16 GEMMs (AVX2) emulate them, several times slower
  than fp32 and slowest with both operands row-major; there each group is upcast to
  fp32, multiplied and rounded once into the output (the same function: fp32
  accumulation, one rounding). With AVX512-BF16 / AMX the GEMMs run in half precision,
  with no conversion at all.
* layout: an operand is copied into the other layout before a GEMM only where the probe
  found the copy and the multiply faster than the multiply as is (per dtype, layout pair
  and shape class); never where the CPU has no slow layout.
* few rows (decode: a few tokens per expert): one GEMM as above, or in the storage dtype
  one matrix-vector product per row (the weight read as it lies: no packing, and on an
  upcasting CPU no conversion of a whole weight for one token) or the product
  transposed, as measured.
* weight gradient: ``x[g]^T @ dy[g]`` takes ``x^T`` as a column-major view, or a
  row-major copy of it (one pass over ``x``) where that measured faster at about these
  rows per group and columns of ``dy`` (AMX: the copy buys up to 2x on the GEMM).
* kernel: ``torch._grouped_mm`` (one C++ loop over the groups, bitwise the same ``mm``
  per group) instead of the Python loop where it is faster, and only where it is
  correct: 16-byte aligned K, N and strides, offs validated here first, rows past
  ``offs[-1]`` zeroed here.
* a few rows per group (up to 32, half dtypes): the native kernel
  ``torch_moe_cpu::few_rows_mm`` (``csrc/grouped_mm_cpu.cpp``: one call for all groups,
  each expert's weight read once, converted in registers and applied to all of the
  group's rows, fp32 sums in a fixed order) where the probe's ``few_gemm`` found it
  faster than the better of the two above, which run one oneDNN GEMM per group (its
  set-up and the packing of its weight each time): at 1-8 rows per expert, and most
  with many small experts (benchmarks/results/hf_train_step_cpu_202612.md). Its sums are
  ordered otherwise than oneDNN's (the same fp32 accumulation and one rounding, not the
  same bits), so every path that must match another bit for bit (the eager nodes' lean
  kernels) asks the same decision.
* threads: on two or more intra-op threads, the native kernels
  ``torch_moe_cpu::threaded_grouped_mm`` / ``threaded_grouped_mm_wgrad``
  (``csrc/grouped_mm_threads_cpu.cpp``) unless the probe's ``threads_mm`` found the way
  above faster on the caller's threads: each thread runs its equal share of the groups'
  work end to end as one-thread GEMMs (a group on a share's edge split between two
  threads by output columns, or rows of a weight gradient), instead of every group's
  GEMM split over all threads, each a barrier for all of them (a few hundred rows is
  small for that, a router's uneven counts load the threads unevenly, and on a shared
  machine every barrier waits for the slowest thread: the bf16 layer step on two
  threads 9-20% faster on a loaded machine, -2% / +4% / +5% at E8 / E32 / E64 on a quiet
  one, benchmarks/results/cpu_floor_cpu_202612.md). The same ``mm`` per piece, so the
  same math; where the GEMM library orders a product's sums alike for any split of its
  rows and columns (oneDNN's bf16, as measured here) the same bits. Half dtypes only:
  fp32 GEMMs (MKL) of a few rows sum in another order on one thread than on several.
  Where the CPU upcasts a half dtype (``half_gemm``), the kernel takes it too, on any
  number of threads, each piece's operands converted to fp32 in the thread's scratch and
  its product rounded once (:func:`upcasts_pieces`): the loop's math with each GEMM on
  one thread, where the loop splits every expert's fp32 GEMM over all threads (MKL's
  two-thread split of the 64-expert layer's GEMMs gained 1.0-1.2x on the Zen 3 EPYC
  measured; the layer step on two threads 4-10% / 11-12% / 14-21% faster at E8 / E32 /
  E64) and, on one thread, converts each group's operands into new tensors (the layer
  step 1-2% / 4% / 7% faster by the pieces there), and ``grouped_swiglu`` then takes
  its whole-tensor path (``shares_upcast_groups``).
* the GEMM itself (bf16 on AVX512-BF16 CPUs): the threaded kernels' pieces run the native
  packed GEMM ``csrc/gemm_bf16_cpu.cpp`` instead of oneDNN's where the probe's
  ``gemm_kernel`` found it faster (each operand packed once per call, rows of ``a`` kept
  in L2 while the packed weight passes over them; oneDNN repacks the weight for every
  block of rows: 417-443 against 470-500 GFLOP/s for an MoE layer's expert GEMMs on the
  EPYCs measured). Then the threaded kernel also runs on one thread (``threads_mm``
  measures it there). Its sums are in a fixed order that depends on K only (the same
  bits for any split and thread count; oneDNN's bits for K <= 1024 on the machines
  measured, not beyond), so, as with the few-rows kernel, paths that must match bit for
  bit ask the same decisions.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from torch_moe._ops import _cpu_probe, _native
from torch_moe._ops._dtypes import FLOAT_DTYPES, no_cpu_autocast
from torch_moe._ops._eager import direct_calls
from torch_moe._ops.permute import _check_maps, _check_rows, permute, token_of_rows, unpermute

__all__ = [
    "check_offs",
    "check_offs_values",
    "copies_by_pieces",
    "cpu_compute_dtype",
    "experts_transposed",
    "gather_grouped_mm",
    "grouped_mm",
    "grouped_mm_reference",
    "grouped_mm_wgrad",
    "mm_cpu",
    "mm_into",
    "shares_upcast_groups",
    "transposed_copy",
    "transposes_wgrad",
    "wgrad_copies",
    "wgrad_operand",
    "zero_tail_",
]

_DTYPES = FLOAT_DTYPES
_FULL = (torch.float32, torch.float64)  # always multiplied as they are
# what the threaded kernels take: oneDNN's half GEMMs, the same bits for any split
_THREADED_DTYPES = (torch.bfloat16, torch.float16)
_TORCH_GROUPED_MM_CPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------
# checks shared by the real and the fake kernels


def check_offs(name: str, offs: Tensor, num_groups: int | None, device: torch.device) -> None:
    if offs.dim() != 1 or offs.dtype != torch.int32:
        raise ValueError(f"{name}: expected offs to be 1D int32, got {offs.dim()}D {offs.dtype}")
    if num_groups is not None and offs.shape[0] != num_groups:
        raise ValueError(
            f"{name}: expected offs to have one entry per group ({num_groups}), got {offs.shape[0]}"
        )
    if offs.device != device:
        raise ValueError(f"{name}: offs is on {offs.device} but the operands are on {device}")


def _check_mm_inputs(x: Tensor, w: Tensor, offs: Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"grouped_mm: expected x to be 2D [M, K], got {x.dim()}D")
    if w.dim() != 3:
        raise ValueError(f"grouped_mm: expected w to be 3D [E, K, N], got {w.dim()}D")
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ValueError(
            f"grouped_mm: expected x and w to share a dtype in {_DTYPES}, got {x.dtype} and {w.dtype}"
        )
    if w.shape[1] != x.shape[1]:
        raise ValueError(
            f"grouped_mm: x is [M, K={x.shape[1]}] but w is [E, K={w.shape[1]}, N={w.shape[2]}]"
        )
    if w.device != x.device:
        raise ValueError(f"grouped_mm: w is on {w.device} but x is on {x.device}")
    check_offs("grouped_mm", offs, w.shape[0], x.device)


def _check_wgrad_inputs(x: Tensor, dy: Tensor, offs: Tensor) -> None:
    if x.dim() != 2 or dy.dim() != 2 or x.shape[0] != dy.shape[0]:
        raise ValueError(
            "grouped_mm_wgrad: expected x [M, K] and dy [M, N] with the same M, got "
            f"{list(x.shape)} and {list(dy.shape)}"
        )
    if x.dtype not in _DTYPES or dy.dtype != x.dtype:
        raise ValueError(
            f"grouped_mm_wgrad: expected x and dy to share a dtype in {_DTYPES}, got "
            f"{x.dtype} and {dy.dtype}"
        )
    if dy.device != x.device:
        raise ValueError(f"grouped_mm_wgrad: dy is on {dy.device} but x is on {x.device}")
    check_offs("grouped_mm_wgrad", offs, None, x.device)


def check_offs_values(name: str, offs: Tensor, num_rows: int) -> list[int] | None:
    """Validate offs values: non-decreasing, 0 <= offs[0], offs[-1] <= num_rows.

    On CPU the values are read and returned (the message shows them); on other
    devices the check is a ``torch._assert_async`` (no host sync) and None is returned.
    """
    if offs.device.type != "cpu":
        ok = (offs[1:] >= offs[:-1]).all() & (offs[:1] >= 0).all() & (offs[-1:] <= num_rows).all()
        torch._assert_async(
            ok, f"{name}: offs must be non-decreasing group ends in [0, M={num_rows}]"
        )
        return None
    ends = offs.tolist()
    bad = ends != sorted(ends) or bool(ends and (ends[0] < 0 or ends[-1] > num_rows))
    if bad:
        shown = ends if len(ends) <= 16 else [*ends[:8], "...", *ends[-8:]]
        raise ValueError(
            f"{name}: offs must be non-decreasing group ends with 0 <= offs[0] and "
            f"offs[-1] <= M ({num_rows}), got offs={shown}"
        )
    return ends


# --------------------------------------------------------------------------------------
# reference (the oracle)


def grouped_mm_reference(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """out[rows of g] = x[rows of g] @ w[g]; rows past offs[-1] are zero."""
    _check_mm_inputs(x, w, offs)
    check_offs_values("grouped_mm", offs, x.shape[0])
    out = x.new_zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


# --------------------------------------------------------------------------------------
# CPU kernels


def _cpu_native_half(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` at least as fast as the fp32 upcast (measured)."""
    return _cpu_probe.half_gemm(dtype) == "native"


def _transposed(t: Tensor) -> bool:
    return _cpu_probe.transposed(t)


def _layout_choice(dtype: torch.dtype, a: Tensor, b: Tensor) -> str:
    """``"as_is"``, ``"copy_a"`` or ``"copy_b"`` for ``a @ b`` computed in ``dtype``
    (measured per layout pair and shape class; fp64, the gradcheck dtype, is never copied)."""
    return "as_is" if dtype == torch.float64 else _cpu_probe.layout(dtype, a, b)


def layout_copy_elems(
    dtype: torch.dtype,
    a_shape: tuple[int, int],
    a_cols: bool,
    b_shape: tuple[int, int],
    b_cols: bool,
) -> int:
    """Elements ``mm_into`` copies into the other layout for ``a @ b`` computed in
    ``dtype`` (a, b column-major where ``*_cols``): a's, b's or none, by the measured
    layout decision (the memory model's term for these copies)."""

    a, b = _meta_operand(a_shape, a_cols), _meta_operand(b_shape, b_cols)
    choice = _layout_choice(dtype, a, b)
    return {"copy_a": a_shape[0] * a_shape[1], "copy_b": b_shape[0] * b_shape[1]}.get(choice, 0)


def _meta_operand(shape: tuple[int, ...], cols: bool, dtype: torch.dtype = torch.float32) -> Tensor:
    """A meta stand-in of an operand of ``shape``, its last two dims column-major where
    ``cols`` (the memory model's questions to the kernels' decisions, which read only
    metadata)."""
    if not cols:
        return torch.empty(shape, dtype=dtype, device="meta")
    t = torch.empty((*shape[:-2], shape[-1], shape[-2]), dtype=dtype, device="meta")
    return t.transpose(-2, -1)


def _operand(t: Tensor, dtype: torch.dtype, other_layout: bool) -> Tensor:
    """``t`` in ``dtype``, in the other memory layout if asked: one pass either way."""
    if not other_layout:
        return t.to(dtype)
    if _transposed(t):
        return torch.empty(t.shape, dtype=dtype).copy_(t)
    return torch.empty((t.shape[1], t.shape[0]), dtype=dtype).t().copy_(t)


def cpu_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype CPU GEMMs run in: fp32 for half types this CPU only emulates (module NB)."""
    if dtype in (torch.float16, torch.bfloat16) and not _cpu_native_half(dtype):
        return torch.float32
    return dtype


def mm_cpu(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` in ``cpu_compute_dtype``; the product stays in that dtype."""
    cdt = cpu_compute_dtype(a.dtype)
    choice = _layout_choice(cdt, a, b)
    return torch.mm(_operand(a, cdt, choice == "copy_a"), _operand(b, cdt, choice == "copy_b"))


def mm_into(a: Tensor, b: Tensor, out: Tensor) -> None:
    """``out = a @ b`` with fp32 accumulation and one rounding into ``out``'s dtype."""
    dtype = out.dtype
    if a.dtype == b.dtype == dtype and 0 < a.shape[0] <= _cpu_probe.FEW_ROWS:  # decode
        how = "mm" if dtype == torch.float64 else _cpu_probe.few_rows(dtype, a, b, _mm_into)
        if how != "mm":
            _cpu_probe.few_rows_mm(a, b, out, how)
            return
    _mm_into(a, b, out)


def _mm_into(a: Tensor, b: Tensor, out: Tensor) -> None:
    """mm_into with one GEMM in ``cpu_compute_dtype``, operand layouts as measured."""
    dtype = out.dtype
    if a.dtype == b.dtype == dtype and (dtype in _FULL or _cpu_native_half(dtype)):
        choice = _layout_choice(dtype, a, b)
        if choice == "copy_a":
            a = _operand(a, dtype, True)
        elif choice == "copy_b":
            b = _operand(b, dtype, True)
        torch.mm(a, b, out=out)
    else:
        out.copy_(mm_cpu(a, b))


def _aligned(t: Tensor) -> bool:
    """What ``torch._grouped_mm`` takes: row- or column-major in the last two dims, rows
    (columns) apart by at least their length (not broadcast: a stride of 0 is refused),
    every other stride and the data pointer 16-byte aligned."""
    row_stride, col_stride = t.stride()[-2:]
    rows, cols = t.shape[-2:]
    if col_stride == 1:
        lead = row_stride
        if lead < max(cols, 1):
            return False
    elif row_stride == 1:
        lead = col_stride
        if lead < max(rows, 1):
            return False
    else:
        return False
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in (lead, *t.stride()[:-2]))


def _torch_grouped_mm_cpu_ok(a: Tensor, b: Tensor, ends: list[int], k: int, n: int) -> bool:
    """Where ``torch._grouped_mm`` computes what the loop does (module NB): a dtype it takes
    and that this CPU multiplies natively, at least one row, K and N (the reduction and
    output columns) and every non-unit stride 16-byte aligned. Whether it is faster is
    measured."""
    if not hasattr(torch, "_grouped_mm") or a.dtype not in _TORCH_GROUPED_MM_CPU_DTYPES:
        return False
    if not ends or ends[-1] == 0 or a.dtype != cpu_compute_dtype(a.dtype):
        return False
    if k * a.element_size() % 16 or n * a.element_size() % 16:
        return False
    return _aligned(a) and _aligned(b)


def _busy_groups(ends: list[int]) -> int:
    """How many groups have rows: ends are non-decreasing (validated), so each busy group
    adds one distinct value to {0, *ends}."""
    return len({0, *ends}) - 1


def group_sizes(ends: list[int]) -> list[int]:
    """Each group's rows, from its (validated) ends."""
    return [end - start for start, end in zip([0, *ends[:-1]], ends)]


def rows_per_busy_group(ends: list[int]) -> tuple[int, int]:
    """(busy groups, their rows each rounded up): the shape class every few-rows decision
    reads (0 rows where no group has any)."""
    busy = _busy_groups(ends)
    return busy, -(-ends[-1] // busy) if busy else 0


def _use_torch_grouped_mm(a: Tensor, b: Tensor, ends: list[int], wgrad: bool) -> bool:
    """``torch._grouped_mm(a, b, offs)`` (a [M, K] x b [E, K, N], or for ``wgrad``
    a [K, M] x b [M, N]) instead of the loop: allowed and measured faster (forward, at up
    to ``FEW_ROWS`` rows per group, at those rows: the loop's GEMMs then take their own
    few-rows ways). Memoized on
    what it reads (the probe's decisions aside): operands' dtypes, shapes, strides and
    alignment, the rows and the busy groups."""
    if not ends or ends[-1] == 0:
        return False
    key = (
        "use_torch_grouped_mm",
        wgrad,
        a.dtype,
        b.dtype,
        *a.shape,
        *a.stride(),
        *b.shape,
        *b.stride(),
        a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0,
        ends[-1],
        len(ends),
        _busy_groups(ends),
    )
    return _cpu_probe.memo(key, lambda: _decide_torch_grouped_mm(a, b, ends, wgrad))


def _decide_torch_grouped_mm(a: Tensor, b: Tensor, ends: list[int], wgrad: bool) -> bool:
    rows = max(1, ends[-1] // len(ends))
    if wgrad:  # out[g] [K, N] = a[:, rows of g] @ b[rows of g]
        m, k, n = a.shape[0], rows, b.shape[1]
        ab = _cpu_probe.layout_of(a, b)
        ok = _torch_grouped_mm_cpu_ok(a, b, ends, m, n)
    else:  # out[rows of g] [rows, N] = a[rows of g] @ b[g]
        m, k, n = rows, a.shape[1], b.shape[2]
        ab = _cpu_probe.layout_of(a, b[0])
        ok = _torch_grouped_mm_cpu_ok(a, b, ends, k, n)
    if not ok:
        return False
    _, few = rows_per_busy_group(ends)
    if not wgrad and few <= _cpu_probe.FEW_ROWS:
        # a few rows per group: the loop applies mm_into's few-rows ways (mv / swap) and
        # torch._grouped_mm runs one GEMM per group; measured at these rows
        cls = f"r{_cpu_probe._pow2_at_least(few)}"
    else:
        cls = _cpu_probe.shape_class(m, k, n)
    dtype = a.dtype
    return (
        _cpu_probe.grouped_mm(dtype, ab, cls, lambda: _measure_grouped_mm(dtype, ab, cls, wgrad))
        == "torch"
    )


def _threaded(a: Tensor, b: Tensor, ends: list[int], wgrad: bool) -> bool:
    """Whether the native threaded kernel runs ``a @ b`` per group (``wgrad``: a [K, M] x b
    [M, N] per group's rows, else a [M, K] x b [E, K, N]): the kernels built, two or more
    threads (or one, where :func:`upcasts_pieces` or :func:`native_gemm_for` holds, or
    forward where :func:`_row_split_on` and :func:`splits_rows` do), and
    :func:`_decide_threaded`.
    Memoized on what it reads (the probe's decisions aside), the threads included."""
    threads = torch.get_num_threads()
    if not ends or ends[-1] == 0 or not _native.enabled():
        return False
    one_thread_gain = (
        upcasts_pieces(a.dtype)
        or native_gemm_for(a, b, ends, wgrad)
        or (not wgrad and splits_rows(a.dtype, ends))
    )
    if threads < 2 and not one_thread_gain:
        return False
    key = (
        "threaded",
        wgrad,
        a.dtype,
        b.dtype,
        *a.shape,
        *a.stride(),
        *b.shape,
        *b.stride(),
        ends[-1],
        len(ends),
        _busy_groups(ends),
        threads,
    )
    # (on one thread the test above read splits_rows, which the key does not hold)
    return _cpu_probe.memo(key, lambda: _decide_threaded(a, b, ends, wgrad, threads))


def _decide_threaded(a: Tensor, b: Tensor, ends: list[int], wgrad: bool, threads: int) -> bool:
    """Where the threaded kernel computes what the loop computes: a half dtype (oneDNN's
    bf16 / fp16 GEMMs where this CPU multiplies it natively, else its fp32 upcast:
    :func:`upcasts_pieces`, on one thread too; fp32 operands themselves stay with
    the loop, whose MKL GEMMs sum a product of a few rows in another order on one thread
    than on two, and whose bits the emulated recipes' chunked fp32 form is held to: their
    native pieces, ``scaled_grouped_mm.dequantizes_pieces``, only to its rounding bound),
    the operands multiplied in their own layouts (the ``layout`` decision, at the dtype
    the GEMMs run in, keeps both) and, forward, more than ``FEW_ROWS`` rows per busy
    group (fewer take the few-rows ways); then the probe's ``threads_mm`` at the dtype,
    layouts, shape class and threads."""
    dtype = a.dtype
    if b.dtype != dtype or not _threaded_takes(dtype):
        return False
    split = _row_split_on(dtype)  # (asked here, not inside threads_mm's measurement)
    gemm = native_gemm_for(a, b, ends, wgrad)
    if threads < 2 and not (split or gemm or upcasts_pieces(dtype)):
        return False
    _, rows = rows_per_busy_group(ends)
    if wgrad:  # out[g] [K, N] = a[:, rows of g] @ b[rows of g]
        a_g, b_g = a[:, :rows], b[:rows]
    else:
        if rows <= _cpu_probe.FEW_ROWS:
            return False
        a_g, b_g = a[:rows], b[0]
    if _layout_choice(cpu_compute_dtype(dtype), a_g, b_g) != "as_is":
        return False
    m, k, n = a_g.shape[0], a_g.shape[1], b_g.shape[1]
    ab = _cpu_probe.layout_of(a_g, b_g)
    cls = _cpu_probe.shape_class(m, k, n)
    measure = functools.partial(_measure_threaded, dtype, ab, cls, wgrad, split, gemm)
    return _cpu_probe.threads_mm(dtype, ab, cls, threads, measure, gemm) == "native"


def _threaded_takes(dtype: torch.dtype) -> bool:
    """Whether the native threaded kernels are built and take ``dtype``."""
    return dtype in _THREADED_DTYPES and _threaded_kernels() is not None


def upcasts_pieces(dtype: torch.dtype) -> bool:
    """Whether the threaded kernels run ``dtype``'s GEMMs on its fp32 upcast, each piece's
    operands converted on its thread (``upcast``): a half dtype this CPU multiplies
    slower than its upcast (``cpu_compute_dtype``), as the per-group loop does, each
    group's GEMM then one fp32 GEMM on one thread (MKL's two-thread split of an expert's
    fp32 GEMM gained 1.0-1.2x at the 64-expert layer's shapes on the Zen 3 EPYC measured:
    benchmarks/results/cpu_floor_cpu_202612.md). The same fp32 products of the same
    converted values, each rounded once, so within the fp32 GEMM's rounding bound of the
    loop; not always its bits: MKL's sgemm orders a product's sums by the columns of the
    call, so a piece narrower than the loop's GEMM (a group's last columns past the
    kernel's blocks of 512, or an edge group's share of the columns on two threads) can
    differ from it by an ulp (a differential fuzz on the Zen 3 EPYC: 107 of 4.1M elements
    at N = 521, one of a 17-column group cut over two threads), and the bits then depend
    on the thread count, as the loop's fp32 GEMMs' do. Where the kernels are built."""
    return cpu_compute_dtype(dtype) != dtype and _threaded_takes(dtype)


def _threaded_kernels() -> Any:
    mod = _native.kernels()
    return mod if mod is not None and hasattr(mod, "threaded_grouped_mm") else None


def shares_upcast_groups(dtype: torch.dtype, rows: int, threads: int | None = None) -> bool:
    """Whether this CPU's grouped GEMMs of ``dtype`` share their groups out over the
    threads as upcast pieces (:func:`upcasts_pieces`) at about ``rows`` rows per busy
    group (on one thread, one piece per group): more than ``FEW_ROWS`` rows, and the probe's
    ``threads_mm`` for an expert's forward GEMM (x row-major, its weight column-major,
    the rows the smallest dim) at their shape class on these threads. ``grouped_swiglu``
    takes its whole-tensor path there, each of its grouped GEMMs asking its own
    decision. ``threads``: the intra-op threads', or others (the memory model's question:
    there the decision as forced or made, else its default, not timed on the caller's
    threads). Not memoized (its callers' decisions are)."""
    current = torch.get_num_threads()
    threads = current if threads is None else threads
    if rows <= _cpu_probe.FEW_ROWS or not upcasts_pieces(dtype):
        return False
    cls = _cpu_probe.shape_class(rows, rows + 1, rows + 1)  # m_small or m_large
    if threads != current:
        return _cpu_probe.known(_cpu_probe.threads_mm_key(dtype, "nt", cls, threads)) != "aten"
    measure = functools.partial(_measure_threaded, dtype, "nt", cls, False, False, False)
    return _cpu_probe.threads_mm(dtype, "nt", cls, threads, measure) == "native"


def splits_rows(dtype: torch.dtype, ends: list[int]) -> bool:
    """Whether the threaded kernel's row split (``row_split``) would cut one of these
    groups' forward GEMMs in ``dtype``: on one thread, where it has no threads to share
    the work out over, that split is its only gain, so there it runs only where this
    holds (memoized decisions of a grouped GEMM's way on one thread must hold it in their
    keys). False without reading the groups for a dtype the kernel does not take."""
    if not _threaded_takes(dtype):
        return False
    return any(_split_parts(r) > 1 for r in group_sizes(ends))


@functools.lru_cache(maxsize=4096)
def _split_parts(rows: int) -> int:
    return _threaded_kernels().row_split_parts(rows)


def _row_split_on(dtype: torch.dtype) -> bool:
    """Whether the threaded kernel's forward splits the GEMMs that oneDNN would cut into
    small row blocks (``_cpu_probe.row_split``; half dtypes the kernel takes, multiplied as
    such: its upcast pieces run MKL's fp32 GEMMs, which block rows otherwise)."""
    if not _threaded_takes(dtype) or cpu_compute_dtype(dtype) != dtype:
        return False
    return _cpu_probe.memo(
        ("row_split", dtype),
        lambda: (
            _cpu_probe.row_split(dtype, functools.partial(_measure_row_split, dtype)) == "split"
        ),
    )


def native_gemm_ready(dtype: torch.dtype) -> bool:
    """Whether the threaded kernel's GEMMs can run by the native packed bf16 GEMM
    (``csrc/gemm_bf16_cpu.cpp``) instead of ATen's: bf16 multiplied natively, the kernels
    built, a CPU with AVX512-BF16 (and no ISA cap below it: ``_cpu_probe.cpu_isa``); the
    GEMM's micro-kernel (AMX tiles where the ISA allows them) set up. Memoized; whether a
    grouped GEMM takes it is :func:`native_gemm_for`'s."""
    if dtype != torch.bfloat16:
        return False
    return _cpu_probe.memo(("native_gemm", dtype), functools.partial(_decide_native_ready, dtype))


def _decide_native_ready(dtype: torch.dtype) -> bool:
    if not _threaded_takes(dtype) or cpu_compute_dtype(dtype) != dtype:
        return False
    mod = _threaded_kernels()
    if not hasattr(mod, "bf16_mm_available") or not mod.bf16_mm_available():
        return False
    if _cpu_probe.cpu_isa() not in ("AVX512-BF16", "AMX"):
        return False
    amx_tiles(dtype)  # the micro-kernel: AMX tiles where the ISA (and its cap) allow them
    return True


def native_gemm_for(a: Tensor, b: Tensor, ends: list[int], wgrad: bool) -> bool:
    """Whether the threaded kernel runs the pieces of this grouped GEMM (``wgrad``: ``a``
    [K, M] x ``b`` [M, N] per group's rows, else ``a`` [M, K] x ``b`` [E, K, N]) by the
    native GEMM: :func:`native_gemm_ready` and the probe's ``gemm_kernel`` at the GEMM's
    kind (``"tn"``, a weight gradient; ``"bt"``, x @ w^T, the weight column-major;
    ``"nn"``, x @ w) and sizes (the rows per busy group, K, N). One decision per kind
    and size, not per process: which GEMM is faster changes with both (``gemm_kernel``).
    Every caller of one grouped GEMM (the ops, the eager nodes' plans) asks it of the
    same metadata, so they take the same kernel, with its bits. Memoized."""
    busy = _busy_groups(ends)
    # (the kernels asked again: a memoized readiness outlives kernels that went away)
    if not busy or not native_gemm_ready(a.dtype) or _threaded_kernels() is None:
        return False
    if wgrad:
        kind, k, n = "tn", a.shape[0], b.shape[1]
    else:
        kind, k, n = ("bt" if _cpu_probe.transposed(b) else "nn"), a.shape[1], b.shape[2]
    measure = functools.partial(_measure_gemm_kernel, a.dtype)
    return _cpu_probe.gemm_kernel(a.dtype, kind, ends[-1] // busy, k, n, measure) == "native"


def streams_outputs(dtype: torch.dtype) -> bool:
    """Whether the native kernels (the threaded kernel's native GEMM, the SwiGLU kernels)
    write their ``dtype`` outputs that are past the L2 cache by non-temporal stores: a
    half dtype, and the probe's ``out_stream``, measured with the native bf16 GEMM where
    it runs (:func:`native_gemm_ready`; elsewhere plain stores). Memoized."""
    if dtype not in _THREADED_DTYPES:
        return False
    return _cpu_probe.memo(("out_stream", dtype), functools.partial(_decide_out_stream, dtype))


def _decide_out_stream(dtype: torch.dtype) -> bool:
    if not native_gemm_ready(torch.bfloat16):
        return False
    return _cpu_probe.out_stream(dtype, _measure_out_stream) == "stream"


def _measure_out_stream() -> dict[str, float]:
    """Seconds of the threaded kernel's native GEMM (x @ w^T, K = 256, N = 1024: a
    64-expert layer's a @ w2^T) over 8 groups of 256 rows, its 4 MiB output written
    plainly and streamed, operand sets (outputs included) cycled."""
    mod, dtype, groups, rows, k, n = _threaded_kernels(), torch.bfloat16, 8, 256, 256, 1024
    offs = torch.tensor([rows * (g + 1) for g in range(groups)], dtype=torch.int32)
    sets = [
        (
            torch.full((groups * rows, k), 0.5, dtype=dtype),
            torch.full((groups, n, k), 0.25, dtype=dtype).transpose(-2, -1),
            torch.empty((groups * rows, n), dtype=dtype),
        )
        for _ in range(_cpu_probe._OPERAND_SETS)
    ]

    def run(stream: bool) -> Callable[[tuple[Tensor, Tensor, Tensor]], None]:
        return lambda s: mod.threaded_grouped_mm(*s[:2], offs, s[2], False, True, None, stream)

    return _cpu_probe.time_candidates(
        _cpu_probe.cycled(sets, {"cache": run(False), "stream": run(True)})
    )


# The gemm_kernel probe's sets: weights (and outputs) of at least _GEMM_WEIGHT_BYTES, in
# calls of at most _GEMM_PROBE_FLOPS (2-16 groups). Sets of 4 MiB (6 groups at the
# 32-expert layer's shapes) ranked its dW13 0.89-1.03x native / oneDNN, within the
# probe's margin, where the layer's own operands run it 0.88x and the step 1.5-2.6%
# faster natively; 16 MiB (11-16 groups) 0.84-0.89x. The FLOP cap keeps a decision well
# under a second at an 8-expert layer's large experts (2 groups there, as before).
_GEMM_WEIGHT_BYTES = 16 << 20
_GEMM_PROBE_FLOPS = 1e10


def _measure_gemm_kernel(
    dtype: torch.dtype, kind: str, rows: int, k: int, n: int
) -> dict[str, float]:
    """Seconds of the threaded kernel's GEMMs of ``kind`` by ATen's GEMM and by the native
    one on groups of about ``rows`` rows (uneven, as a router's counts are) of ``k`` x ``n``
    weights (``"tn"``: weight gradients of that size, ATen's operand as ``wgrad_a`` lays
    it out; the native GEMM reads the transposed view itself), each call the GEMM on
    its own operands and with one operand gathered from a source of a quarter of the
    rows (both of a weight gradient's in turn), as an MoE layer runs such GEMMs: 2-16
    groups, enough that an operand set's weights and outputs pass 16 MiB (at most
    ``_GEMM_PROBE_FLOPS`` a call), sets (outputs
    included) cycled and evicted from the caches before each call, so that operands and
    output lines come from memory as in a layer step (an output that is the last call's,
    still in cache, is written by oneDNN's GEMM at a speed no layer sees, and its
    operands would be read from a last-level cache of hundreds of MiB; the native GEMM
    streams an output past the L2 where ``out_stream`` says so). On the AMX Xeon
    measured this ranks the 64-expert layer's GEMMs as the layer runs them (the eviction
    and the gathered calls turned its weight gradient dW13 from oneDNN's to the native
    GEMM: 28.3 -> 21.5 ms in the layer; benchmarks/results/cpu_floor_cpu_202612.md)."""
    mod = _threaded_kernels()
    per_group = (k if kind == "tn" else min(k, rows)) * n * dtype.itemsize  # weight or output
    by_flops = int(_GEMM_PROBE_FLOPS // (2 * rows * k * n))
    groups = max(2, min(16, -(-_GEMM_WEIGHT_BYTES // per_group), by_flops))
    ends = list(itertools.accumulate(max(1, rows + (g * 37) % 31 - 15) for g in range(groups)))
    offs, m = torch.tensor(ends, dtype=torch.int32), ends[-1]
    copies = kind == "tn" and wgrad_copies(dtype, rows, k, n)
    stream = streams_outputs(dtype)  # as the layer's GEMMs write their outputs

    def operands() -> tuple[Tensor, Tensor, Tensor]:  # and the output, written in place
        x = torch.full((m, k), 0.5, dtype=dtype)
        if kind == "tn":
            return x, torch.full((m, n), 0.25, dtype=dtype), x.new_empty((groups, k, n))
        w = torch.full((groups, n, k) if kind == "bt" else (groups, k, n), 0.25, dtype=dtype)
        return x, w.transpose(-2, -1) if kind == "bt" else w, x.new_empty((m, n))

    # the same GEMMs with an operand gathered from a source of a quarter of the rows, as
    # an MoE layer's are (its tokens' rows, each read by a few experts)
    src = max(1, m // 4)
    index = torch.arange(m, dtype=torch.int64).mul_(7919).remainder_(src)

    def run(native: bool) -> Callable[[tuple[Tensor, Tensor, Tensor]], None]:
        def fn(s: tuple[Tensor, Tensor, Tensor]) -> None:
            x, w, out = s
            if kind == "tn":
                mod.threaded_grouped_mm_wgrad(
                    x.t(), w, offs, out, native, None, None, copies, stream
                )
                mod.threaded_grouped_mm_wgrad(
                    x[:src].t(), w, offs, out, native, index, None, copies, stream
                )
                mod.threaded_grouped_mm_wgrad(
                    x.t(), w[:src], offs, out, native, None, index, copies, stream
                )
            else:
                mod.threaded_grouped_mm(x, w, offs, out, False, native, None, stream)
                mod.threaded_grouped_mm(x[:src], w, offs, out, False, native, index, stream)

        return fn

    def evict(s: tuple[Tensor, Tensor, Tensor]) -> None:
        for t in s:
            mod.evict_from_cache(t)

    sets = [operands() for _ in range(_cpu_probe._OPERAND_SETS)]
    ways = {"aten": run(False), "native": run(True)}
    return _cpu_probe.time_candidates(_cpu_probe.cycled(sets, ways, evict))


def _measure_row_split(dtype: torch.dtype) -> dict[str, float]:
    """Seconds of the threaded kernel's forward on 2 groups of 481 rows (13 x 37: oneDNN 3
    on AVX-512 blocks them by 37) at K = N = 512, with and without its row split, operand
    sets cycled."""
    mod, rows, dim = _threaded_kernels(), 481, 512
    offs = torch.tensor([rows, 2 * rows], dtype=torch.int32)
    sets = [
        (torch.full((2 * rows, dim), 0.5, dtype=dtype), torch.full((2, dim, dim), 0.5, dtype=dtype))
        for _ in range(_cpu_probe._OPERAND_SETS)
    ]

    def run(split: bool) -> Callable[[tuple[Tensor, Tensor]], None]:
        return lambda s: mod.threaded_grouped_mm(*s, offs, s[0].new_empty((2 * rows, dim)), split)

    return _cpu_probe.time_candidates(
        _cpu_probe.cycled(sets, {"one": run(False), "split": run(True)})
    )


def _measure_threaded(
    dtype: torch.dtype, ab: str, cls: str, wgrad: bool, split: bool, gemm: bool
) -> dict[str, float]:
    """Seconds of the threaded kernel (its forward with the row split where ``split``) and
    of the better ATen way (``torch._grouped_mm`` where it is allowed, the loop) on the
    caller's threads: 8 groups of the shape class (``_measure_grouped_mm``'s dims), the
    groups' rows uneven around it as a router's counts are (-15..+15), operands cycled
    through sets (not all in cache)."""
    groups, mod, upcast = 8, _threaded_kernels(), upcasts_pieces(dtype)
    small = 64 if cls.endswith("_small") else 256
    dims = {d: (small if d == cls[0] else 256) for d in "mkn"}
    base = dims["k"] if wgrad else dims["m"]
    ends = list(itertools.accumulate(base + (g * 37) % 31 - 15 for g in range(groups)))
    offs = torch.tensor(ends, dtype=torch.int32)
    total = ends[-1]

    def operand(shape: tuple[int, ...], col_major: bool) -> Tensor:
        if not col_major:
            return torch.full(shape, 0.5, dtype=dtype)
        return torch.full((*shape[:-2], shape[-1], shape[-2]), 0.5, dtype=dtype).transpose(-2, -1)

    ways: dict[str, Callable[[tuple[Tensor, Tensor]], object]]
    if wgrad:  # a [K, M], b = dy [M, N]
        sets = [
            (operand((dims["m"], total), ab[0] == "t"), operand((total, dims["n"]), ab[1] == "t"))
            for _ in range(_cpu_probe._OPERAND_SETS)
        ]
        k, n = dims["m"], dims["n"]

        def native(s: tuple[Tensor, Tensor]) -> None:
            out = s[0].new_empty((groups, k, n))
            mod.threaded_grouped_mm_wgrad(*s, offs, out, gemm, None, None, False, False, upcast)

        ways = {"native": native, "loop": lambda s: _wgrad_loop(*s, ends)}
        ok = _torch_grouped_mm_cpu_ok(*sets[0], ends, k, n)
    else:
        sets = [
            (
                operand((total, dims["k"]), ab[0] == "t"),
                operand((groups, dims["k"], dims["n"]), ab[1] == "t"),
            )
            for _ in range(_cpu_probe._OPERAND_SETS)
        ]
        n = dims["n"]

        def native(s: tuple[Tensor, Tensor]) -> None:
            out = s[0].new_empty((total, n))
            mod.threaded_grouped_mm(*s, offs, out, split, gemm, None, False, upcast)

        ways = {"native": native, "loop": lambda s: _mm_loop(*s, ends)}
        ok = _torch_grouped_mm_cpu_ok(*sets[0], ends, dims["k"], n)
    return _native_against_aten(ways, sets, offs, ok)


def _native_against_aten(
    ways: dict[str, Callable[[tuple[Tensor, Tensor]], object]],
    sets: list[tuple[Tensor, Tensor]],
    offs: Tensor,
    torch_ok: bool,
    cold: bool = False,
    native: tuple[str, ...] = ("native",),
) -> dict[str, float]:
    """Seconds of the ``native`` ways (those of them in ``ways``) and, as ``"aten"``, of
    the fastest other way (``torch._grouped_mm`` on ``offs`` too where ``torch_ok``), each
    cycling through the operand ``sets`` (``cold``: each set evicted from the caches
    before its call, where the native library can)."""
    if torch_ok:
        ways["torch"] = lambda s: torch._grouped_mm(*s, offs=offs)
    mod = _native.kernels()

    def evict(s: tuple[Tensor, Tensor]) -> None:
        for t in s:
            mod.evict_from_cache(t)

    cycle = _cpu_probe.cycled(sets, ways, evict if cold and mod is not None else None)
    times = _cpu_probe.time_candidates(cycle)
    return {
        "aten": min(t for how, t in times.items() if how not in native),
        **{how: t for how, t in times.items() if how in native},
    }


def _threaded_mm(x: Tensor, w: Tensor, ends: list[int], offs: Tensor | None) -> Tensor:
    """The threaded kernel's forward (rows past ``ends[-1]`` zero)."""
    return _whole_grouped_mm(x, w, _offs_tensor(ends, offs), ends[-1], "threads")


def _threaded_wgrad(a: Tensor, dy: Tensor, ends: list[int], offs: Tensor | None) -> Tensor:
    """The threaded kernel's weight gradient (empty groups zero)."""
    return _whole_grouped_mm_wgrad(a, dy, _offs_tensor(ends, offs), "threads")


def _offs_tensor(ends: list[int], offs: Tensor | None) -> Tensor:
    """``offs`` as the native kernels take it (contiguous int32), else made from ``ends``."""
    if offs is None or offs.dtype != torch.int32 or not offs.is_contiguous():
        return torch.tensor(ends, dtype=torch.int32)
    return offs


_T_BLOCK = 64  # rows per copy of transposed_copy (ATen's strided copy is fastest narrow)


def transposed_copy(x: Tensor) -> Tensor:
    """``x^T`` ([K, M] for ``x`` [M, K]) as a row-major copy, its leading dim padded to 64
    bytes (``torch._grouped_mm`` takes 16) and past a multiple of 1 KiB, where rows would
    fall in one L1 set (the copy's 32-row blocks then evict each other: 5.7-14.5 against
    6.8-20 GB/s read and written on one thread of the AMX Xeon, for the three layer
    shapes' dH): by the native transpose for 16-bit elements where it runs (row-major
    x), else in blocks of ``_T_BLOCK`` rows by ATen's copy. The
    padding is zero: oneDNN's AMX GEMM reads a row's element past an odd number of
    columns (its k pairs), which for the last group is the padding; uninitialized, a
    NaN or inf there made that expert's weight gradient NaN (0 * NaN)."""
    m, k = x.shape
    line = 64 // x.element_size()
    ld = -(-m // line) * line
    if (ld * x.element_size()) % 1024 == 0:
        ld += line
    full = x.new_empty((k, ld))
    full[:, m:].zero_()
    out = full[:, :m]
    mod = _native.kernels()
    if x.element_size() == 2 and mod is not None and mod.transpose16(x, out):
        return out  # the native 32 x 32 block transpose (csrc/gemm_bf16_cpu.cpp), same bits
    for r0 in range(0, m, _T_BLOCK):
        out[:, r0 : r0 + _T_BLOCK].copy_(x[r0 : r0 + _T_BLOCK].t())
    return out


def wgrad_copies(dtype: torch.dtype, rows: int, k: int, n: int) -> bool:
    """Whether :func:`wgrad_operand` copies ``x`` [M, k] for groups of about ``rows`` rows
    and ``n`` columns of ``dy``: half dtypes multiplied natively only (an upcast converts,
    and so copies, anyway, and fp32 GEMMs take either layout at one rate), where the probe
    found the copy and the faster GEMMs together over 5% faster (``_cpu_probe.wgrad_a``)."""
    if dtype not in (torch.bfloat16, torch.float16) or rows <= 0 or not _cpu_native_half(dtype):
        return False
    measure = functools.partial(_measure_wgrad_a, dtype)
    return _cpu_probe.wgrad_a(dtype, rows, k, n, measure) == "transpose"


def wgrad_operand(x: Tensor, n: int, ends: list[int]) -> Tensor:
    """``a`` [K, M] of the weight gradient ``out[g] = a[:, rows of g] @ dy[rows of g]`` (dy
    [M, n]): ``x.t()``, the column-major view, or its row-major copy where measured
    faster (:func:`wgrad_copies`, at the rows per busy group)."""
    busy = _busy_groups(ends)
    if busy and x.dim() == 2 and wgrad_copies(x.dtype, ends[-1] // busy, x.shape[1], n):
        return transposed_copy(x)
    return x.t()


def _measure_wgrad_a(dtype: torch.dtype, rows: int, k: int, n: int) -> dict[str, float]:
    """Seconds of one group's weight gradient ([k, rows] x [rows, n]) with ``a`` as the
    column-major view and as its row-major copy (the copy timed too)."""
    x = torch.randn(rows, k).to(dtype)
    dy = torch.randn(rows, n).to(dtype)
    out = torch.empty(k, n, dtype=dtype)

    def run(a: Tensor) -> None:
        torch.mm(a, dy, out=out)

    return _cpu_probe.time_candidates(
        {"as_is": lambda: run(x.t()), "transpose": lambda: run(transposed_copy(x))}
    )


def _measure_grouped_mm(dtype: torch.dtype, ab: str, cls: str, wgrad: bool) -> dict[str, float]:
    """Seconds of ``torch._grouped_mm`` and of the loop on 8 groups of the shape class
    (``r<r>``: r rows per group, K = N = 256)."""
    groups = 8
    if cls.startswith("r"):
        dims = {"m": int(cls[1:]), "k": 256, "n": 256}
    else:
        small = 64 if cls.endswith("_small") else 256
        dims = {d: (small if d == cls[0] else 256) for d in "mkn"}
    rows = dims["k"] if wgrad else dims["m"]
    ends = [rows * (g + 1) for g in range(groups)]
    offs = torch.tensor(ends, dtype=torch.int32)
    total = ends[-1]

    def operand(shape: tuple[int, ...], col_major: bool) -> Tensor:
        if not col_major:
            return torch.randn(shape).to(dtype)
        return torch.randn(*shape[:-2], shape[-1], shape[-2]).to(dtype).transpose(-2, -1)

    if wgrad:  # a [K, M] (x^T or its row-major copy), b = dy [M, N]
        a = operand((total, dims["m"]), ab[0] == "n").t()
        dy = operand((total, dims["n"]), ab[1] == "t")
        return _cpu_probe.time_candidates(
            {
                "loop": lambda: _wgrad_loop(a, dy, ends),
                "torch": lambda: torch._grouped_mm(a, dy, offs=offs),
            }
        )
    x = operand((total, dims["k"]), ab[0] == "t")
    w = operand((groups, dims["k"], dims["n"]), ab[1] == "t")

    def fused() -> Tensor:
        return torch._grouped_mm(x, w, offs=offs)

    return _cpu_probe.time_candidates({"loop": lambda: _mm_loop(x, w, ends), "torch": fused})


def _mm_loop(x: Tensor, w: Tensor, ends: list[int]) -> Tensor:
    out = x.new_empty((x.shape[0], w.shape[2]))
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            mm_into(x[start:end], w[g], out[start:end])
        start = end
    out[start:].zero_()
    return out


def _wgrad_loop(a: Tensor, dy: Tensor, ends: list[int]) -> Tensor:
    """``out[g] = a[:, rows of g] @ dy[rows of g]`` for ``a`` [K, M] (see wgrad_operand)."""
    out = a.new_empty((len(ends), a.shape[0], dy.shape[1]))
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            mm_into(a[:, start:end], dy[start:end], out[g])
        else:
            out[g].zero_()
        start = end
    return out


_FEW_GEMM_ROWS = 32  # rows per busy group up to which few_gemm decides (past them the
# weight's reads are amortized over enough rows for the packed GEMMs)
_FEW_GEMM_DTYPES = (torch.bfloat16, torch.float16)
_FEW_GEMM_GROUPS = (8, 32)  # the probe's groups, clamped: its cost grows with them (up
# to ~0.2 s a key at 32), and past 32 groups per-group costs are amortized alike


def weight_col_major(w: Tensor) -> bool | None:
    """Whether ``w`` [E, K, N] is column-major per group (True), row-major (False) or
    neither (None): the layouts the native few-rows kernel takes."""
    return False if w.stride(2) == 1 else (True if w.stride(1) == 1 else None)


def _few_gemm(x: Tensor, w: Tensor, ends: list[int]) -> str | None:
    """The way ``x @ w[g]`` per group runs by the native few-rows kernel (``"few"``, or
    ``"few_amx"`` where its groups of :func:`amx_rows` rows or more take AMX tiles), or
    None where it does not: CPU tensors of a half dtype, ``x`` contiguous, ``w`` row- or
    column-major per group, and :func:`few_gemm_choice` at the rows per busy group."""
    if not ends or ends[-1] == 0 or x.dtype != w.dtype or x.device.type not in ("cpu", "meta"):
        return None  # (meta: the memory model's stand-ins, whole_loops)
    col_major = weight_col_major(w)
    if not x.is_contiguous() or col_major is None:
        return None
    busy, rows = rows_per_busy_group(ends)
    if few_gemm_choice(w.dtype, col_major, rows, busy) == "aten":
        return None
    return "few_amx" if col_major and amx_rows(w.dtype, busy) > 0 else "few"


def amx_rows(dtype: torch.dtype, busy: int) -> int:
    """The fewest rows from which a group of the few-rows kernel takes its AMX form
    (column-major weights, ``busy`` groups): where the CPU has tiles (:func:`amx_tiles`),
    the smallest rows class ``r`` of a run down from ``_FEW_GEMM_ROWS`` in which every
    class's ``few_gemm`` choice is ``"amx"`` (``r // 2 + 1`` rows: the classes round rows
    up to powers of two), else 0 (none). Per group, not per call: a decode step's groups
    are uneven (at T = 64 on the AMX Xeon, 4 rows per expert on average, the groups of 5
    or more by tiles made the step 5-8% faster). Memoized."""
    if not amx_tiles(dtype):
        return 0
    pow2 = _cpu_probe._pow2_at_least
    groups = min(max(pow2(busy), _FEW_GEMM_GROUPS[0]), _FEW_GEMM_GROUPS[1])

    def decide() -> int:
        least, r = 0, _FEW_GEMM_ROWS
        while r >= 1 and few_gemm_choice(dtype, True, r, groups) == "amx":
            least, r = r // 2 + 1, r // 2
        return least

    return _cpu_probe.memo(("amx_rows", dtype, groups, _native.enabled()), decide)


def few_gemm_class(dtype: torch.dtype, col_major: bool, rows: int, busy: int) -> bool:
    """Whether the few-rows kernel runs ``busy`` groups of about ``rows`` rows (in either
    of its forms: :func:`few_gemm_choice`)."""
    return few_gemm_choice(dtype, col_major, rows, busy) != "aten"


def few_gemm_choice(dtype: torch.dtype, col_major: bool, rows: int, busy: int) -> str:
    """The few-rows kernel's decision for ``busy`` groups of about ``rows`` rows of a half
    dtype and a weight of this layout: ``"native"`` or ``"amx"`` (its AMX form: bf16, a
    column-major weight, where the CPU allows tiles) where the kernel is built, at most
    ``_FEW_GEMM_ROWS`` rows, and the probe's ``few_gemm`` (per dtype, weight layout, rows
    and busy groups: powers of two, the groups clamped to 8-32) measured it faster, else
    ``"aten"``. Either of the first two runs the kernel; which of its groups take tiles
    the ``"amx"`` classes say (:func:`amx_rows`). Memoized on what it reads."""
    if rows > _FEW_GEMM_ROWS or rows < 1 or dtype not in _FEW_GEMM_DTYPES:
        return "aten"
    pow2 = _cpu_probe._pow2_at_least
    rows, groups = pow2(rows), min(max(pow2(busy), _FEW_GEMM_GROUPS[0]), _FEW_GEMM_GROUPS[1])
    key = ("few_gemm", dtype, col_major, rows, groups, _native.enabled())
    return _cpu_probe.memo(key, lambda: _decide_few_gemm(dtype, col_major, rows, groups))


def _decide_few_gemm(dtype: torch.dtype, col_major: bool, rows: int, groups: int) -> str:
    mod = _native.kernels()
    if mod is None:
        return "aten"
    measure = functools.partial(_measure_few_gemm, mod, dtype, col_major, rows, groups)
    return _cpu_probe.few_gemm(dtype, col_major, rows, groups, measure)


def amx_tiles(dtype: torch.dtype) -> bool:
    """Whether the native bf16 GEMMs can multiply by AMX tiles here (the CPU, the OS and
    the ISA cap allow them: ``_cpu_probe.cpu_isa() == "AMX"``), turning them on if so
    (the native GEMM's process-wide micro-kernel choice, which ``gemm_kernel`` makes the
    same way). Memoized."""
    if dtype != torch.bfloat16:
        return False

    def decide() -> bool:
        mod = _native.kernels()
        if mod is None or not hasattr(mod, "bf16_mm_use_amx") or not mod.bf16_mm_available():
            return False
        return bool(mod.bf16_mm_use_amx(_cpu_probe.cpu_isa() == "AMX"))

    return _cpu_probe.memo(("amx_tiles", dtype), decide)


def _few_rows_mm(
    x: Tensor, w: Tensor, ends: list[int], offs: Tensor | None, way: str = "few"
) -> Tensor:
    """The native few-rows kernel (rows past ``ends[-1]`` zero), ``way`` ``"few"`` or
    ``"few_amx"`` (:func:`_few_gemm`)."""
    return _whole_grouped_mm(x, w, _offs_tensor(ends, offs), ends[-1], way)


def _whole_grouped_mm(x: Tensor, w: Tensor, offs: Tensor, end: int, way: str) -> Tensor:
    """One call for all groups, rows at or past ``end`` zero, by ``way``: ``"few"`` /
    ``"few_amx"``, the native few-rows kernel (``"few_amx"``: its groups of ``amx_rows``
    rows or more by AMX tiles; as ``_few_gemm`` says), ``"threads"``, the threaded kernel
    (where ``_threaded`` holds), or ``"torch"``, ``torch._grouped_mm`` (where
    ``_use_torch_grouped_mm`` holds). The eager nodes' lean kernels take their GEMMs
    through this, as their plans decided (:func:`whole_way`)."""
    if way in ("few", "few_amx"):
        out = x.new_empty((x.shape[0], w.shape[2]))
        least = amx_rows(x.dtype, _busy_groups(offs.tolist())) if way == "few_amx" else 0
        _native.kernels().few_rows_mm(x, w, offs, out, least)
        return out
    if way == "threads":
        out = x.new_empty((x.shape[0], w.shape[2]))
        native = native_gemm_for(x, w, offs.tolist(), False)
        split, stream = _row_split_on(x.dtype), streams_outputs(x.dtype)
        upcast = upcasts_pieces(x.dtype)
        _threaded_kernels().threaded_grouped_mm(
            x, w, offs, out, split, native, None, stream, upcast
        )
        return out
    return _torch_grouped_mm(x, w, offs, end)


def reads_gathered(x: Tensor, way: str, dtype: torch.dtype) -> bool:
    """Whether a grouped GEMM that runs by ``way`` (``whole_way``'s, then
    :func:`gather_way`'s) can read the rows of ``x`` that a permutation gathers in place
    of a gathered copy (:func:`gathered_grouped_mm`, :func:`gathered_grouped_mm_wgrad`):
    the threaded kernel (``"threads"``, or a weight gradient's ``"transpose"``), ``x``
    row-major in ``dtype`` itself (the copy would convert nothing). The native GEMM reads
    the rows through the index; ATen's GEMM reads each piece's rows gathered into its
    thread's scratch just before it (the same values, so the same bits)."""
    return way in ("threads", "transpose") and x.dtype == dtype and x.stride(-1) == 1


def gather_way(way: str | None, dtype: torch.dtype) -> str | None:
    """The way a grouped GEMM whose operand is a gather of the tokens' rows runs by, given
    ``whole_way``'s for the gathered copy: on one thread ``"torch"`` becomes
    ``"threads"`` where the threaded kernel takes ``dtype`` (and it is multiplied as
    such), so that the rows are read through the index (:func:`reads_gathered`). On one
    thread both run one ATen GEMM per group on the same operands (``torch._grouped_mm``'s
    CPU kernel is that loop): the same bits, without the [M, K] copy written to memory
    and read back (32 MB at the 64-expert layer of benchmarks/bench_moe_layer.py; on the
    AMX Xeon measured its gather took 5.3 ms and the per-piece gathers left the GEMMs
    5.6 ms faster in all: benchmarks/results/cpu_floor_cpu_202612.md). On more threads
    the two differ in how they share the work out, and ``threads_mm`` chose."""
    if way != "torch" or torch.get_num_threads() > 1 or not _threaded_takes(dtype):
        return way
    return "threads" if cpu_compute_dtype(dtype) == dtype else way


def threads_read_rows(x: Tensor, w: Tensor, num_rows: int, ends: list[int]) -> bool:
    """Whether the CPU grouped GEMM of ``num_rows`` rows gathered from x by ``w``, in
    groups ending at ``ends``, runs the threaded kernel (:func:`gather_way` of its
    ``whole_way``) reading the rows through the token index (:func:`reads_gathered`):
    then :func:`gathered_grouped_mm` gives its bits without the [M, K] copy."""
    if not ends or not reads_gathered(x, "threads", w.dtype):
        return False
    rows = w.new_empty((num_rows, x.shape[1]))  # the gathered rows' metadata
    return gather_way(whole_way(rows, w, ends, False), w.dtype) == "threads"


def gathered_grouped_mm(x: Tensor, index: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``_whole_grouped_mm(gather_rows(x, index), w, offs, ..., "threads")`` (rows of index
    -1 zero, rows past the groups zero), the gathered rows read by the threaded kernel
    (:func:`reads_gathered`): the same bits, no [M, K] copy."""
    out = x.new_empty((index.shape[0], w.shape[2]))
    index = index.to(torch.int64).contiguous()
    split, native = _row_split_on(x.dtype), native_gemm_for(x, w, offs.tolist(), False)
    stream, upcast = streams_outputs(x.dtype), upcasts_pieces(x.dtype)
    _threaded_kernels().threaded_grouped_mm(x, w, offs, out, split, native, index, stream, upcast)
    return out


def gathered_grouped_mm_wgrad(
    a: Tensor,
    dy: Tensor,
    offs: Tensor,
    a_index: Tensor | None,
    dy_index: Tensor | None,
    way: str = "threads",
) -> Tensor:
    """``_whole_grouped_mm_wgrad(a, dy, offs, way)`` with a's columns (``a`` then the
    transposed view of their source) and / or dy's rows read gathered by the threaded
    kernel (:func:`reads_gathered`); ``way`` ``"transpose"``: ATen's GEMM takes the
    piece's ``a`` copied row-major, as there."""
    out = a.new_empty((offs.shape[0], a.shape[0], dy.shape[1]))
    a_index, dy_index = (
        None if i is None else i.to(torch.int64).contiguous() for i in (a_index, dy_index)
    )
    native, transpose = native_gemm_for(a, dy, offs.tolist(), True), way == "transpose"
    stream, upcast = streams_outputs(a.dtype), upcasts_pieces(a.dtype)
    _threaded_kernels().threaded_grouped_mm_wgrad(
        a, dy, offs, out, native, a_index, dy_index, transpose, stream, upcast
    )
    return out


def _whole_grouped_mm_wgrad(a: Tensor, dy: Tensor, offs: Tensor, way: str) -> Tensor:
    """``out[g] = a[:, rows of g] @ dy[rows of g]`` in one call by ``way`` (``"threads"``,
    ``"transpose"`` or ``"torch"``, as :func:`whole_way` decided); empty groups zero.
    ``"transpose"``: the threaded kernel with ``a`` (the column-major view ``x.t()``)
    copied row-major one piece at a time (:func:`transposes_wgrad`)."""
    if way in ("threads", "transpose"):
        out = a.new_empty((offs.shape[0], a.shape[0], dy.shape[1]))
        native = native_gemm_for(a, dy, offs.tolist(), True)
        mod = _threaded_kernels()
        transpose, stream = way == "transpose", streams_outputs(a.dtype)
        upcast = upcasts_pieces(a.dtype)
        mod.threaded_grouped_mm_wgrad(
            a, dy, offs, out, native, None, None, transpose, stream, upcast
        )
        return out
    return torch._grouped_mm(a, dy, offs=offs)


def copies_by_pieces(dtype: torch.dtype) -> bool:
    """Whether the whole-tensor weight gradients of ``dtype`` copy ``x^T`` piece by piece
    (where :func:`wgrad_copies` says copy): the native threaded kernel built, whose
    transpose takes 16-bit elements. The memory model asks it too (no [M, K] copy then)."""
    return dtype.itemsize == 2 and _threaded_kernels() is not None


def transposes_wgrad(x: Tensor, n: int, ends: list[int]) -> bool:
    """Whether the weight gradient ``x[g]^T @ dy[g]`` (``dy`` [M, n]) of these groups runs
    by the threaded kernel with ``x^T`` copied row-major one piece (a group, or a
    thread's part of one) at a time: where :func:`wgrad_copies` measured the copy faster,
    :func:`copies_by_pieces` holds and ``x`` is row-major (its ``x^T`` the column-major
    view the kernel copies from; another ``x`` takes :func:`wgrad_operand`'s copy). One
    copy of all of ``x^T`` would stride each group's block by all groups' rows, which
    oneDNN read 20-30% slower than the piece's compact copy
    (benchmarks/results/cpu_floor_cpu_202612.md)."""
    busy = _busy_groups(ends)
    if not busy or x.dim() != 2 or not copies_by_pieces(x.dtype):
        return False
    if x.stride(1) != 1 and x.shape[1] > 1:  # x^T is then no column-major view
        return False
    return wgrad_copies(x.dtype, ends[-1] // busy, x.shape[1], n)


def wgrad_way(x: Tensor, dy: Tensor, ends: list[int]) -> str | None:
    """How ``grouped_mm_wgrad``'s CPU kernel runs ``x[g]^T @ dy[g]`` when that is one
    call for all groups: ``"transpose"`` (:func:`transposes_wgrad`), else
    :func:`whole_way`'s for the transposed view of x; None where it copies all of x first
    (``wgrad_copies`` without the pieces) or takes the per-group loop."""
    if transposes_wgrad(x, dy.shape[1], ends):
        return "transpose"
    busy = _busy_groups(ends)
    if busy and wgrad_copies(x.dtype, ends[-1] // busy, x.shape[1], dy.shape[1]):
        return None
    return whole_way(x.t(), dy, ends, True)


def whole_way(a: Tensor, b: Tensor, ends: list[int], wgrad: bool) -> str | None:
    """How the CPU kernel runs this grouped GEMM when that is one call for all groups:
    ``"few"``, ``"few_amx"``, ``"threads"`` or ``"torch"`` (:func:`_whole_grouped_mm`'s
    ways; the few-rows kernel's forward only), or None where it takes the per-group loop
    (``wgrad``: ``a`` is the weight gradients' operand, ``wgrad_operand``'s result)."""
    few = None if wgrad else _few_gemm(a, b, ends)
    if few is not None:
        return few
    if _threaded(a, b, ends, wgrad):
        return "threads"
    if _use_torch_grouped_mm(a, b, ends, wgrad):
        return "torch"
    return None


def whole_loops(
    dtype: torch.dtype,
    a_shape: tuple[int, int],
    a_cols: bool,
    b_shape: tuple[int, int],
    b_cols: bool,
    ends: list[int],
    wgrad: bool,
) -> bool:
    """Whether the CPU kernel runs this grouped GEMM by its per-group loop where its
    caller calls it once for all groups (:func:`whole_way` None), asked of meta stand-ins
    with the operands' metadata (the memory model's question: the loop copies a group's
    operand into the other layout where ``mm_into`` measured that faster). ``a``: [M, K]
    (``wgrad``: the weight gradient's [K, M]), ``b``: one group's [K, N] (``wgrad``: [M,
    N]); ``*_cols``: column-major."""
    a = _meta_operand(a_shape, a_cols, dtype)
    b = _meta_operand(b_shape if wgrad else (len(ends), *b_shape), b_cols, dtype)
    return whole_way(a, b, ends, wgrad) is None


def _measure_few_gemm(
    mod: Any, dtype: torch.dtype, col_major: bool, rows: int, groups: int
) -> dict[str, float]:
    """Seconds of the native kernel and of the better ATen way (``torch._grouped_mm``,
    else the loop) on ``groups`` groups of ``rows`` rows, K = N = 512 (groups / 2 MiB of
    weights per operand set, each candidate cycling through the sets, each set evicted
    from the caches before its call: the weights come from memory, as in a decode step,
    whatever the last-level cache's size). Many small groups favour the native kernel
    (one call, no GEMM set up per group), large weights read by few groups much less."""
    k = n = 512
    ends = [rows * (g + 1) for g in range(groups)]
    offs = torch.tensor(ends, dtype=torch.int32)
    sets = []
    for _ in range(_cpu_probe._OPERAND_SETS):  # constant values: the rates do not depend on them
        w = torch.full((groups, n, k) if col_major else (groups, k, n), 0.5, dtype=dtype)
        sets.append(
            (torch.full((ends[-1], k), 0.25, dtype=dtype), w.transpose(-2, -1) if col_major else w)
        )
    ways: dict[str, Callable[[tuple[Tensor, Tensor]], object]] = {
        "native": lambda s: mod.few_rows_mm(*s, offs, s[0].new_empty((s[0].shape[0], n))),
        "loop": lambda s: _mm_loop(*s, ends),
    }
    if col_major and amx_tiles(dtype):  # its AMX form, where the CPU allows tiles
        ways["amx"] = lambda s: mod.few_rows_mm(*s, offs, s[0].new_empty((s[0].shape[0], n)), 1)
    ok = _torch_grouped_mm_cpu_ok(*sets[0], ends, k, n)
    return _native_against_aten(ways, sets, offs, ok, cold=True, native=("native", "amx"))


def _grouped_mm_cpu(x: Tensor, w: Tensor, ends: list[int], offs: Tensor | None = None) -> Tensor:
    """Group ends ``ends`` (validated); ``offs``, their tensor, lets ``torch._grouped_mm``
    (or the native few-rows kernel) run where it is allowed and faster."""
    if x.shape[1] == 0 or w.shape[2] == 0 or not ends:  # no products: zeros (or nothing;
        # torch._grouped_mm refuses an empty operand's zero strides)
        return x.new_zeros((x.shape[0], w.shape[2]))
    few = _few_gemm(x, w, ends)
    if few is not None:
        return _few_rows_mm(x, w, ends, offs, few)
    if _threaded(x, w, ends, wgrad=False):
        return _threaded_mm(x, w, ends, offs)
    if offs is not None and _use_torch_grouped_mm(x, w, ends, wgrad=False):
        return _torch_grouped_mm(x, w, offs, ends[-1])
    return _mm_loop(x, w, ends)


def _torch_grouped_mm(x: Tensor, w: Tensor, offs: Tensor, end: int) -> Tensor:
    """``torch._grouped_mm(x, w, offs)`` with rows at or past ``end`` (``offs[-1]``) zero:
    torch leaves them uninitialized."""
    out = torch._grouped_mm(x, w, offs=offs)
    if end < out.shape[0]:
        out[end:].zero_()
    return out


def _grouped_mm_wgrad_cpu(
    x: Tensor, dy: Tensor, ends: list[int], offs: Tensor | None = None
) -> Tensor:
    if transposes_wgrad(x, dy.shape[1], ends):
        return _whole_grouped_mm_wgrad(x.t(), dy, _offs_tensor(ends, offs), "transpose")
    a = wgrad_operand(x, dy.shape[1], ends)
    if _threaded(a, dy, ends, wgrad=True):
        return _threaded_wgrad(a, dy, ends, offs)
    if offs is not None and _use_torch_grouped_mm(a, dy, ends, wgrad=True):
        return torch._grouped_mm(a, dy, offs=offs)  # empty groups come back zero
    return _wgrad_loop(a, dy, ends)


# --------------------------------------------------------------------------------------
# CUDA kernels


def _torch_grouped_mm_ok(x: Tensor, w: Tensor) -> bool:
    """Where ``torch._grouped_mm`` is correct and fast (see module docstring)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    k, n = w.shape[1], w.shape[2]
    if (k * x.element_size()) % 16 != 0 or (n * x.element_size()) % 16 != 0:
        return False
    # it takes row- or column-major operands only (one unit stride in the last two dims)
    return x.stride(-1) == 1 and (w.stride(-1) == 1 or w.stride(-2) == 1)


def zero_tail_(out: Tensor, offs: Tensor) -> Tensor:
    """Zero rows at or past offs[-1] without a host sync."""
    if offs.numel() == 0:
        return out.zero_()
    tail = torch.arange(out.shape[0], device=out.device) >= offs[-1]
    return out.masked_fill_(tail.unsqueeze(1), 0)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------
# the ops


def _grouped_mm_default(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    _check_mm_inputs(x, w, offs)
    ends = check_offs_values("grouped_mm", offs, x.shape[0])
    # the op computes in its operands' dtype (upcasting bf16 where the CPU has no native
    # bf16 GEMM): a caller's autocast must not recast the GEMMs inside, which compiled
    # code (kernels outside autocast) would not do
    with no_cpu_autocast():
        return _grouped_mm_cpu(x, w, ends if ends is not None else offs.tolist(), offs)


@torch.library.custom_op("torch_moe::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return _grouped_mm_default(x, w, offs)


@grouped_mm.register_kernel("cuda")
def _(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    _check_mm_inputs(x, w, offs)
    check_offs_values("grouped_mm", offs, x.shape[0])
    with torch.autocast("cuda", enabled=False):  # as on CPU: the operands' dtype
        if _torch_grouped_mm_ok(x, w):
            out = torch._grouped_mm(x, w, offs=offs)
            return zero_tail_(out, offs)
        if x.dtype != torch.float64 and _triton_available():
            from torch_moe._triton.grouped_mm import grouped_mm as triton_grouped_mm

            return triton_grouped_mm(x, w, offs)
        return _grouped_mm_cpu(x, w, offs.tolist())


@grouped_mm.register_fake
def _(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    _check_mm_inputs(x, w, offs)
    return x.new_empty((x.shape[0], w.shape[2]))


def _grouped_mm_wgrad_default(x: Tensor, dy: Tensor, offs: Tensor) -> Tensor:
    """out[g] = x[rows of g]^T @ dy[rows of g]: [E, K, N], zero for empty groups."""
    _check_wgrad_inputs(x, dy, offs)
    ends = check_offs_values("grouped_mm_wgrad", offs, x.shape[0])
    with no_cpu_autocast():  # the operands' dtype (see grouped_mm)
        return _grouped_mm_wgrad_cpu(x, dy, ends if ends is not None else offs.tolist(), offs)


@torch.library.custom_op("torch_moe::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(x: Tensor, dy: Tensor, offs: Tensor) -> Tensor:
    return _grouped_mm_wgrad_default(x, dy, offs)


@grouped_mm_wgrad.register_kernel("cuda")
def _(x: Tensor, dy: Tensor, offs: Tensor) -> Tensor:
    _check_wgrad_inputs(x, dy, offs)
    check_offs_values("grouped_mm_wgrad", offs, x.shape[0])
    with torch.autocast("cuda", enabled=False):  # the operands' dtype (see grouped_mm)
        if x.dtype != torch.float64 and _triton_available():
            from torch_moe._triton.grouped_mm import grouped_mm_wgrad as triton_wgrad

            return triton_wgrad(x, dy, offs)
        return _grouped_mm_wgrad_cpu(x, dy, offs.tolist())


@grouped_mm_wgrad.register_fake
def _(x: Tensor, dy: Tensor, offs: Tensor) -> Tensor:
    _check_wgrad_inputs(x, dy, offs)
    return x.new_empty((offs.shape[0], x.shape[1], dy.shape[1]))


def _nonzero_strides(t: Tensor) -> Tensor:
    # NB: ``out.sum().backward()`` hands us an expanded gradient with zero strides.
    return t if all(s != 0 for s in t.stride()) else t.contiguous()


def experts_transposed(w: Tensor) -> bool:
    """Whether ``w`` [E, K, N] is column-major per expert: a transposed view of a row-major
    [E, N, K] weight, as ``x @ w^T`` passes it."""
    return w.shape[0] > 0 and _transposed(w)


def _setup_mm(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _mm_backward(ctx, grad):  # type: ignore[no-untyped-def]
    x, w, offs = ctx.saved_tensors
    grad = _nonzero_strides(grad)
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = grouped_mm(grad, w.transpose(-2, -1), offs)
    if ctx.needs_input_grad[1]:
        if experts_transposed(w):
            # w [E, K, N] viewed from a row-major [E, N, K] (a weight used as x @ w^T):
            # its gradient in that layout too, dW^T = dY^T x per group, so that
            # AccumulateGrad takes it as it is instead of copying every expert transposed
            grad_w = grouped_mm_wgrad(grad, x, offs).transpose(-2, -1)
        else:
            grad_w = grouped_mm_wgrad(x, grad, offs)
    return grad_x, grad_w, None


grouped_mm.register_autograd(_mm_backward, setup_context=_setup_mm)


# --------------------------------------------------------------------------------------
# gather_grouped_mm: the rows gathered from the tokens inside the op


def _check_gather(x: Tensor, row_to_slot: Tensor, slot_to_row: Tensor) -> None:
    """The permutation maps as ``permute`` checks them, and x's T rows against them."""
    _check_maps("gather_grouped_mm", row_to_slot, slot_to_row, None)
    _check_rows("gather_grouped_mm", "x", x, slot_to_row.shape[0])


def _gathered_rows(x: Tensor, row_to_slot: Tensor, slot_to_row: Tensor) -> Tensor:
    return permute(x, row_to_slot, slot_to_row, None)


def _plain_cpu(*tensors: Tensor) -> bool:
    """Real CPU tensors (not a tracer's or a subclass): where the CPU kernels' own calls may
    stand in for the ops' (a traced backward must call ops)."""
    return all(type(t) in (Tensor, torch.nn.Parameter) and t.is_cpu for t in tensors)


def _gather_ends(x: Tensor, w: Tensor, offs: Tensor, row_to_slot: Tensor) -> list[int] | None:
    """The group ends where the CPU grouped GEMM of x's gathered rows runs the threaded
    kernel (:func:`gather_way`), which then reads the rows through the token index (the
    same bits, no [M, K_in] copy: :func:`reads_gathered`); else None."""
    if not _plain_cpu(x, w, offs, row_to_slot) or not _threaded_takes(w.dtype):
        return None
    if not reads_gathered(x, "threads", w.dtype):
        return None
    rows = x.new_empty((row_to_slot.shape[0], x.shape[1]))  # the gathered rows' metadata
    _check_mm_inputs(rows, w, offs)  # (grouped_mm's checks, on the path that skips it)
    del rows  # (threads_read_rows makes its own: not two alive at once)
    ends = check_offs_values("gather_grouped_mm", offs, row_to_slot.shape[0])
    return ends if ends and threads_read_rows(x, w, row_to_slot.shape[0], ends) else None


def _gather_grouped_mm_default(
    x: Tensor, w: Tensor, offs: Tensor, row_to_slot: Tensor, slot_to_row: Tensor
) -> Tensor:
    """``grouped_mm(permute(x, row_to_slot, slot_to_row), w, offs)``: x [T, K_in] holds the
    tokens, row r of the product reads token ``row_to_slot[r] // top_k`` (a zero row where
    row_to_slot[r] == -1). The same values as the two ops; the backward keeps x and the
    maps instead of the [M, K_in] rows (gathered again for the weight gradient, unless the
    threaded kernel reads them through the token index) and sums a token's rows' input
    gradients in fp32, as ``permute``'s backward does."""
    _check_gather(x, row_to_slot, slot_to_row)
    ends = _gather_ends(x, w, offs, row_to_slot)
    if ends is not None:
        tokens = token_of_rows(row_to_slot, slot_to_row)
        return gathered_grouped_mm(x, tokens, w, _offs_tensor(ends, offs))
    return grouped_mm(_gathered_rows(x, row_to_slot, slot_to_row), w, offs)


def _gathered_wgrad(
    x: Tensor, grad: Tensor, offs: Tensor, row_to_slot: Tensor, slot_to_row: Tensor, w: Tensor
) -> Tensor | None:
    """The weight gradient of :func:`gather_grouped_mm` with the gathered rows of x read
    through the token index where ``grouped_mm_wgrad``'s CPU kernel on the gathered rows
    runs the threaded kernel (:func:`gather_way`) and x's operand as the transposed view
    (the same bits); else None."""
    if not _plain_cpu(x, grad, offs, row_to_slot) or not _threaded_takes(x.dtype):
        return None
    if not reads_gathered(x, "threads", x.dtype):
        return None
    ends = check_offs_values("gather_grouped_mm", offs, row_to_slot.shape[0])
    if not ends or grad.dtype != x.dtype:
        return None
    rows = x.new_empty((row_to_slot.shape[0], x.shape[1]))  # the gathered rows' metadata
    tokens = token_of_rows(row_to_slot, slot_to_row)
    offs_i = _offs_tensor(ends, offs)
    if experts_transposed(w):  # grouped_mm_wgrad(grad, rows): the rows are dy
        a = wgrad_operand(grad, rows.shape[1], ends)
        if gather_way(whole_way(a, rows, ends, True), x.dtype) != "threads":
            return None
        return gathered_grouped_mm_wgrad(a, x, offs_i, None, tokens).transpose(-2, -1)
    # grouped_mm_wgrad(rows, grad): a is rows^T, read in place only as the transposed view
    busy = _busy_groups(ends)  # (none: padding rows only, e.g. no tokens aligned)
    if not busy or wgrad_copies(x.dtype, ends[-1] // busy, x.shape[1], grad.shape[1]):
        return None
    if gather_way(whole_way(rows.t(), grad, ends, True), x.dtype) != "threads":
        return None
    return gathered_grouped_mm_wgrad(x.t(), grad, offs_i, tokens, None)


@torch.library.custom_op("torch_moe::gather_grouped_mm", mutates_args=())
def gather_grouped_mm(
    x: Tensor, w: Tensor, offs: Tensor, row_to_slot: Tensor, slot_to_row: Tensor
) -> Tensor:
    return _gather_grouped_mm_default(x, w, offs, row_to_slot, slot_to_row)


@gather_grouped_mm.register_fake
def _(x: Tensor, w: Tensor, offs: Tensor, row_to_slot: Tensor, slot_to_row: Tensor) -> Tensor:
    _check_gather(x, row_to_slot, slot_to_row)
    rows = x.new_empty((row_to_slot.shape[0], x.shape[1]))
    _check_mm_inputs(rows, w, offs)
    return x.new_empty((row_to_slot.shape[0], w.shape[2]))


def _setup_gather_mm(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, w, offs, row_to_slot, slot_to_row = inputs
    ctx.save_for_backward(x, w, offs, row_to_slot, slot_to_row)


def _gather_mm_backward(ctx, grad):  # type: ignore[no-untyped-def]
    x, w, offs, row_to_slot, slot_to_row = ctx.saved_tensors
    grad = _nonzero_strides(grad)
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_rows = grouped_mm(grad, w.transpose(-2, -1), offs)
        grad_x = unpermute(grad_rows, slot_to_row, row_to_slot, None)
    if ctx.needs_input_grad[1]:
        grad_w = _gathered_wgrad(x, grad, offs, row_to_slot, slot_to_row, w)
        if grad_w is None:
            rows = _gathered_rows(x, row_to_slot, slot_to_row)
            if experts_transposed(w):  # as grouped_mm's backward: dW in w's own layout
                grad_w = grouped_mm_wgrad(grad, rows, offs).transpose(-2, -1)
            else:
                grad_w = grouped_mm_wgrad(rows, grad, offs)
    return grad_x, grad_w, None, None, None


gather_grouped_mm.register_autograd(_gather_mm_backward, setup_context=_setup_gather_mm)

# Eager calls on plain CPU tensors skip the ops' Python layers (``_eager.py``).
grouped_mm = direct_calls(grouped_mm, _grouped_mm_default, _setup_mm, _mm_backward)
grouped_mm_wgrad = direct_calls(grouped_mm_wgrad, _grouped_mm_wgrad_default)
gather_grouped_mm = direct_calls(
    gather_grouped_mm, _gather_grouped_mm_default, _setup_gather_mm, _gather_mm_backward
)
