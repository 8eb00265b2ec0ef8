"""``Hardware``: the rates the performance model needs, measured or from datasheets.

Legend: m rows of a GEMM operand A [m, k], k the reduction dim, n the output columns
(B [k, n]); layouts ``"NT"`` (A @ W^T: forward), ``"NN"`` (dY @ W: dgrad), ``"TN"``
(X^T @ dY: wgrad, k = rows of the group).

What a :class:`Hardware` holds, and where each number comes from (``sources`` labels every
field ``measured``, ``datasheet`` or ``default``):

* GEMMs: ``gemm_tables`` (measured by :func:`torch_moe.perf.calibrate`): seconds of one
  call of the library's CPU GEMM primitive (``torch_moe._ops.grouped_mm.mm_into``) on a
  log-spaced (m, k, n) grid per compute dtype, layout and thread count, interpolated
  trilinearly in log-log space (:class:`GemmTable`; key ``e4m3``, where the CPU measured
  it: the recipes' scaled GEMM kernels on e4m3 codes, whose fp32 form runs by native
  pieces there, the calibration's ``_fp8_pieces_call``); presets instead use a roofline, a
  GEMM rate times the tile efficiency of the rows of each group (``tile_m`` rows per tile)
  or the weight bytes over the memory bandwidth, whichever is slower.
* Elementwise kernels (routing, sort, permute, unpermute, SwiGLU activation, casts, FP8/MX
  quantize + dequantize, adds): ``kernel_tables``, seconds per call as a function of the
  kernel's element count (:class:`RateTable`), measured on the library's own kernels; on
  presets, the kernel's bytes over the memory bandwidth (quantize: the measured H200
  quantize-kernel rates).
* Overheads: ``overheads[path] = (fixed, per_group)``: on a CPU the Python and dispatcher
  cost of one layer step that no rate captures (the host loop over expert groups in the
  grouped GEMMs), measured on the layer itself at negligible sizes (D = F = 32, two rows
  per expert) with 1 and 16 experts; on a GPU, kernel launches.
* Links: ``intra_link`` (inside a node: NVLink, or the host's transport for CPU ranks) and
  ``inter_link`` (across nodes: InfiniBand / RoCE), alpha-beta: ``messages * latency +
  bytes / bandwidth``, ``bandwidth`` per rank and direction while every rank exchanges
  (an all-to-all); ``collective_latency`` is a small collective (the counts exchange).
* ``comm_compute_share``: the fraction of communication time that occupies the compute
  units (1.0 for gloo on the CPU cores that also compute: exchange and compute add up;
  about 20/132 for DeepEP-style kernels on H800/H100-class GPUs, DeepSeek-V3's 20 SMs).

Datasheet numbers (dense, no 2:4 sparsity): H100 SXM from
``torch._inductor.analysis.device_info`` (bf16 989 TFLOP/s, fp8 1979, 3.35 TB/s, 80 GB);
H200 SXM: the H100's compute with 4.8 TB/s HBM3e and 141 GB; B200 (HGX): bf16 2250,
fp8 4500 TFLOP/s, 8 TB/s, 180 GB; NVLink 4 (H100/H200) 450 GB/s per direction, NVLink 5
(B200) 900 GB/s; ConnectX-7 400 Gb/s = 50 GB/s per GPU. The H200 preset replaces the
GEMM and quantize rates and the memory bandwidth with this repository's measurements
(``benchmarks/results/quant_h200_202611.md``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GemmTable", "Hardware", "Link", "RateTable"]

LAYOUTS = ("NT", "NN", "TN")


# --------------------------------------------------------------------------------------
# links


@dataclass(frozen=True)
class Link:
    """Alpha-beta link: ``messages * latency + bytes / bandwidth`` seconds.

    Attributes:
        bandwidth: bytes/s one rank sends (and receives) while all ranks exchange.
        latency: seconds per point-to-point message (alpha).
        collective_latency: seconds of one small collective (e.g. the counts all-to-all).
        source: ``"measured ..."``, ``"datasheet ..."`` or ``"default ..."``.
        exchange_overhead: host seconds of expert parallelism per layer step that
            alpha-beta does not capture, keyed ``"{exchange}.{fwd|fwdbwd}"`` (exchange
            ``p2p``, ``all_to_all`` or ``hierarchical``, the two-stage all_to_all):
            ``(fixed, per local expert, per extra chunk)``. Measured on CPU process
            groups (the EP layer at negligible sizes, less the model's prediction of
            it: the Python, dispatcher, autograd and DTensor work of the exchange ops and
            the ranks' wait at each exchange); empty (zero) for presets.
    """

    bandwidth: float
    latency: float
    collective_latency: float
    source: str = "default"
    exchange_overhead: dict[str, tuple[float, float, float]] = field(
        default_factory=dict, hash=False
    )

    def __post_init__(self) -> None:
        # JSON round trips give lists
        fixed = {k: tuple(float(x) for x in v) for k, v in self.exchange_overhead.items()}
        if any(len(v) != 3 or min(v) < 0 for v in fixed.values()):
            raise ValueError(
                "Link: exchange_overhead values must be (fixed, per_local_expert, per_chunk) "
                f"seconds >= 0, got {self.exchange_overhead}"
            )
        object.__setattr__(self, "exchange_overhead", fixed)
        if not 0 < self.bandwidth < math.inf:
            raise ValueError(
                f"Link: bandwidth must be finite and > 0 bytes/s, got {self.bandwidth}"
            )
        if not (0 <= self.latency < math.inf and 0 <= self.collective_latency < math.inf):
            # (a NaN latency once went through: the prediction 50x too small, no warning)
            raise ValueError(
                f"Link: latencies must be finite and >= 0, got latency={self.latency}, "
                f"collective_latency={self.collective_latency}"
            )

    def time(self, nbytes: float, messages: float = 1.0) -> float:
        return messages * self.latency + nbytes / self.bandwidth

    def host_time(
        self, exchange: str, backward: bool, local_experts: int, num_chunks: int
    ) -> float:
        """The EP layer step's host seconds beyond alpha-beta (``exchange_overhead``);
        ``exchange="hierarchical"`` falls back to the flat all_to_all's terms where the
        two-stage exchange was not probed (a group of fewer than four ranks)."""
        mode = "fwdbwd" if backward else "fwd"
        coef = self.exchange_overhead.get(f"{exchange}.{mode}")
        if coef is None and exchange == "hierarchical":
            coef = self.exchange_overhead.get(f"all_to_all.{mode}")
        fixed, per_expert, per_chunk = coef or (0.0, 0.0, 0.0)
        return fixed + per_expert * local_experts + (num_chunks - 1) * per_chunk


# --------------------------------------------------------------------------------------
# interpolation tables


def _interp1(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear interpolation on sorted xs, clamped to the ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return ys[-1]


def _bracket(grid: list[float], x: float) -> tuple[int, int, float]:
    """Indices i0, i1 and weight t of x in a sorted grid (clamped)."""
    if x <= grid[0]:
        return 0, 0, 0.0
    if x >= grid[-1]:
        n = len(grid) - 1
        return n, n, 0.0
    for i in range(1, len(grid)):
        if x <= grid[i]:
            return i - 1, i, (x - grid[i - 1]) / (grid[i] - grid[i - 1])
    n = len(grid) - 1
    return n, n, 0.0


@dataclass(frozen=True)
class RateTable:
    """Seconds of one kernel call by element count, log-log interpolated.

    Above the largest measured size the time grows linearly with the size (the rate of
    the largest call); below the smallest it is the smallest call's time (overhead-bound).
    """

    sizes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or not self.sizes:
            raise ValueError("RateTable: sizes and seconds must be non-empty and match")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])):
            raise ValueError(f"RateTable: sizes must increase, got {self.sizes}")

    def time(self, size: float) -> float:
        if size <= 0:
            return 0.0
        xs = [math.log(s) for s in self.sizes]
        ys = [math.log(max(t, 1e-12)) for t in self.seconds]
        x = math.log(size)
        if x > xs[-1]:
            return self.seconds[-1] * size / self.sizes[-1]
        return math.exp(_interp1(xs, ys, x))

    def increment(self, size: float) -> float:
        """Seconds above the smallest measured call (whose cost the overheads hold)."""
        if size <= 0:
            return 0.0
        return max(0.0, self.time(size) - self.seconds[0])

    @property
    def rate(self) -> float:
        """Elements per second of the largest measured call."""
        return self.sizes[-1] / self.seconds[-1]


@dataclass(frozen=True)
class GemmTable:
    """Seconds of one GEMM call on a (m, k, n) grid, trilinear in log space.

    A dimension past the grid's largest value scales the time linearly (the rate at the
    edge); one below the smallest is clamped (overhead-bound).
    """

    ms: tuple[float, ...]
    ks: tuple[float, ...]
    ns: tuple[float, ...]
    seconds: tuple[float, ...]  # row-major [len(ms), len(ks), len(ns)]

    def __post_init__(self) -> None:
        if len(self.seconds) != len(self.ms) * len(self.ks) * len(self.ns):
            raise ValueError("GemmTable: seconds must have len(ms) * len(ks) * len(ns) entries")

    def _at(self, i: int, j: int, k: int) -> float:
        return math.log(max(self.seconds[(i * len(self.ks) + j) * len(self.ns) + k], 1e-12))

    def time(self, m: float, k: float, n: float) -> float:
        if m <= 0 or k <= 0 or n <= 0:
            return 0.0
        scale = 1.0
        dims = []
        for x, grid in ((m, self.ms), (k, self.ks), (n, self.ns)):
            if x > grid[-1]:
                scale *= x / grid[-1]
                x = grid[-1]
            dims.append((math.log(x), [math.log(g) for g in grid]))
        (i0, i1, ti), (j0, j1, tj), (k0, k1, tk) = (_bracket(g, x) for x, g in dims)
        acc = 0.0
        for i, wi in ((i0, 1 - ti), (i1, ti)):
            for j, wj in ((j0, 1 - tj), (j1, tj)):
                for kk, wk in ((k0, 1 - tk), (k1, tk)):
                    w = wi * wj * wk
                    if w:
                        acc += w * self._at(i, j, kk)
        return math.exp(acc) * scale

    def increment(self, m: float, k: float, n: float) -> float:
        """Seconds above the smallest grid call (its cost is part of the overheads)."""
        if m <= 0 or k <= 0 or n <= 0:
            return 0.0
        return max(0.0, self.time(m, k, n) - self.seconds[0])

    def rate(self) -> float:
        """FLOP/s of the largest grid call."""
        return 2 * self.ms[-1] * self.ks[-1] * self.ns[-1] / self.seconds[-1]


# --------------------------------------------------------------------------------------
# the hardware


def _gib(x: float) -> float:
    return x * 2**30


@dataclass(frozen=True)
class Hardware:
    """One device (a GPU, or a CPU host whose cores the EP ranks share) and its links.

    Attributes:
        name: e.g. ``"h200"`` or ``"cpu:Intel(R) Xeon(R) ..."``.
        kind: ``"cpu"`` or ``"gpu"``.
        gemm_rate: large-GEMM FLOP/s per compute key (``"bf16"``, ``"fp32"``, ``"fp8"``,
            and per-recipe keys ``"<recipe>:<gemm>"`` where measured).
        mem_bandwidth: bytes/s of a large copy (read + write).
        memory_capacity: bytes of device memory (CPU: host RAM).
        launch_overhead: seconds per kernel launch (GPU).
        tile_m: rows per tile of a grouped GEMM (GPU; each group's rows round up to it).
        gemm_tables: ``"{threads}/{key}/{layout}"`` -> :class:`GemmTable` (CPU, measured).
        kernel_tables: ``"{threads}/{kernel}"`` -> :class:`RateTable` (CPU, measured).
        kernel_rates: ``kernel`` -> bytes/s (GPU; default: ``mem_bandwidth``).
        overheads: ``"{threads}/{path}"`` -> (fixed seconds, seconds per expert group) of
            one layer step (CPU, measured); path e.g. ``"bf16.fwd"``, ``"bf16.fwdbwd"``,
            ``"fp8_rowwise.fwdbwd"``, ``"shared.fwdbwd"`` (extra), ``"capacity.fwdbwd"``.
        intra_link, inter_link: see :class:`Link`.
        host_links: ranks on the host -> the link measured with that many ranks (CPU
            hosts, where the transport shares the cores; overrides ``intra_link``).
        gpus_per_node: ranks per node (NVLink domain) by default.
        host_cores: CPU cores that the ranks on one host share (None for GPUs).
        threads: thread counts the CPU tables were measured with.
        comm_compute_share: fraction of communication time that occupies compute.
        reference_probe: CPU: seconds of the calibration gate's probe (a small MoE layer
            step) in the state every measured figure was scaled to (0: not recorded).
        sources: field -> where its numbers come from.
        fingerprint: the machine / versions the measurements belong to.
    """

    name: str
    kind: str
    gemm_rate: dict[str, float]
    mem_bandwidth: float
    memory_capacity: float
    intra_link: Link
    inter_link: Link
    host_links: dict[int, Link] = field(default_factory=dict)
    launch_overhead: float = 0.0
    tile_m: int = 1
    gemm_tables: dict[str, GemmTable] = field(default_factory=dict)
    kernel_tables: dict[str, RateTable] = field(default_factory=dict)
    kernel_rates: dict[str, float] = field(default_factory=dict)
    overheads: dict[str, tuple[float, float]] = field(default_factory=dict)
    gpus_per_node: int = 8
    host_cores: int | None = None
    threads: tuple[int, ...] = ()
    comm_compute_share: float = 0.0
    reference_probe: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)
    fingerprint: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "gpu"):
            raise ValueError(f"Hardware: kind must be 'cpu' or 'gpu', got {self.kind!r}")
        if not 0 < self.mem_bandwidth < math.inf:
            raise ValueError(
                f"Hardware: mem_bandwidth must be finite and > 0, got {self.mem_bandwidth}"
            )
        # (a memory_capacity of 0: unknown, no limit)
        for name in ("memory_capacity", "launch_overhead", "reference_probe"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"Hardware: {name} must be finite and >= 0, got {value}")
        for name in ("gemm_rate", "kernel_rates"):
            bad = {k: v for k, v in getattr(self, name).items() if not 0 < v < math.inf}
            if bad:
                raise ValueError(f"Hardware: {name} values must be finite and > 0, got {bad}")
        for name in ("tile_m", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Hardware: {name} must be a positive integer, got {value!r}")
        if not 0 <= self.comm_compute_share <= 1:
            raise ValueError(
                f"Hardware: comm_compute_share must be in [0, 1], got {self.comm_compute_share}"
            )

    # ----------------------------------------------------------------------------------
    # construction

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Hardware:
        """``"h100"``, ``"h200"`` or ``"b200"`` (see the module docstring for sources);
        ``overrides`` replace fields, e.g. ``inter_link=Link(25e9, 10e-6, 30e-6)``."""
        from torch_moe.perf._presets import HARDWARE_PRESETS

        if name not in HARDWARE_PRESETS:
            raise ValueError(
                f"Hardware.preset: unknown hardware {name!r}; valid: {sorted(HARDWARE_PRESETS)}"
            )
        hw = HARDWARE_PRESETS[name]()
        return dataclasses.replace(hw, **overrides) if overrides else hw

    @classmethod
    def calibrate(cls, **kwargs: Any) -> Hardware:
        """Measure this machine: see :func:`torch_moe.perf.calibrate`."""
        from torch_moe.perf._calibrate import calibrate

        return calibrate(**kwargs)

    def replace(self, **changes: Any) -> Hardware:
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------------
    # queries used by the model

    def threads_for(self, ranks_on_host: int) -> int:
        """The measured thread count a rank gets when ``ranks_on_host`` ranks share it."""
        if not self.threads:
            return 1
        want = max(1, (self.host_cores or 1) // max(1, ranks_on_host))
        fits = [t for t in self.threads if t <= want]
        return max(fits) if fits else min(self.threads)

    def oversubscription(self, ranks_on_host: int) -> float:
        """Time-slicing factor when the ranks' threads exceed the host's cores (CPU)."""
        if self.host_cores is None:
            return 1.0
        threads = self.threads_for(ranks_on_host)
        return max(1.0, ranks_on_host * threads / self.host_cores)

    def gemm_table(self, threads: int, key: str, layout: str) -> GemmTable | None:
        return self.gemm_tables.get(f"{threads}/{key}/{layout}")

    def kernel_table(self, threads: int, kernel: str) -> RateTable | None:
        return self.kernel_tables.get(f"{threads}/{kernel}")

    def overhead(self, threads: int, path: str) -> tuple[float, float]:
        return self.overheads.get(f"{threads}/{path}", (0.0, 0.0))

    def rate(self, key: str) -> float:
        if key in self.gemm_rate:
            return self.gemm_rate[key]
        base = key.split(":")[0]
        if base in self.gemm_rate:
            return self.gemm_rate[base]
        raise KeyError(f"Hardware {self.name!r} has no GEMM rate for {key!r}")

    def link(self, inter_node: bool, ranks_on_host: int | None = None) -> Link:
        if inter_node:
            return self.inter_link
        if ranks_on_host is not None and ranks_on_host in self.host_links:
            return self.host_links[ranks_on_host]
        return self.intra_link

    # ----------------------------------------------------------------------------------
    # (de)serialization for the on-disk calibration cache

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["threads"] = list(self.threads)
        d["overheads"] = {k: list(v) for k, v in self.overheads.items()}
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Hardware:
        d = json.loads(text)
        d["intra_link"] = Link(**d["intra_link"])
        d["inter_link"] = Link(**d["inter_link"])
        d["host_links"] = {int(k): Link(**v) for k, v in d.get("host_links", {}).items()}
        d["gemm_tables"] = {
            k: GemmTable(**{f: tuple(v) for f, v in t.items()}) for k, t in d["gemm_tables"].items()
        }
        d["kernel_tables"] = {
            k: RateTable(**{f: tuple(v) for f, v in t.items()})
            for k, t in d["kernel_tables"].items()
        }
        d["overheads"] = {k: (float(v[0]), float(v[1])) for k, v in d["overheads"].items()}
        d["threads"] = tuple(d["threads"])
        return cls(**d)

    def summary(self) -> str:
        """A few lines: the main rates and where they come from."""
        lines = [f"{self.name} ({self.kind})"]
        for key, rate in sorted(self.gemm_rate.items()):
            lines.append(f"  GEMM {key}: {rate / 1e12:.3g} TFLOP/s")
        lines.append(f"  memory bandwidth: {self.mem_bandwidth / 1e9:.3g} GB/s")
        for name, link in (("intra-node", self.intra_link), ("inter-node", self.inter_link)):
            lines.append(
                f"  {name} link: {link.bandwidth / 1e9:.3g} GB/s, {link.latency * 1e6:.3g} us "
                f"per message ({link.source})"
            )
            for key, (fixed, per_expert, per_chunk) in sorted(link.exchange_overhead.items()):
                lines.append(
                    f"    EP host work {key}: {fixed * 1e3:.3g} ms + {per_expert * 1e3:.3g} ms "
                    f"per local expert + {per_chunk * 1e3:.3g} ms per extra chunk"
                )
        for key, src in sorted(self.sources.items()):
            lines.append(f"  {key}: {src}")
        return "\n".join(lines)
