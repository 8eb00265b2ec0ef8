"""Hardware presets (datasheets, and this repository's H200 measurements) and model presets.

Every number says where it comes from in the preset's ``sources``. Datasheet figures are
dense (no 2:4 sparsity). Achievable fractions that are assumptions, not measurements, are
labelled ``default``: the GEMM rate of an unmeasured GPU is its datasheet peak times the
fraction this repository measured on the H200 (bf16 grouped GEMM 654 of 989 TFLOP/s);
NVLink moves 0.8 of its per-direction datasheet bandwidth in an all-to-all (DeepEP's
legacy README: 153-158 of ~160 GB/s on H800 NVLink; its V2 README: 726-740 GB/s on
SM100 NVLink), InfiniBand 0.9 (ConnectX-7: 43-58 GB/s "logical" of 50 GB/s in DeepEP's
tables, which include local traffic).

H200 measurements (``benchmarks/results/quant_h200_202611.md``, torch 2.11, triton 3.6,
dsv3 / llama4 shapes, medians of ``do_bench``):

* copy 4241 GB/s (read + written);
* bf16 ``torch._grouped_mm`` 619-686 TFLOP/s (median 654), forward and wgrad;
* FP8 grouped GEMM kernels (forward; dgrad assumed equal): rowwise 916-1050 (995),
  tensorwise 918-1040 (982), blockwise 577-667 (634), mxfp8 306-315 (312) TFLOP/s;
* wgrad: only end-to-end rates were measured (blockwise 418-423, mxfp8 215-233, rowwise
  132-146, tensorwise 97-103 TFLOP/s, both operands quantized jagged inside); the kernel
  rate here is that time minus the two jagged quantizes at the measured 1.4 TB/s
  (derived: blockwise 512, mxfp8 245, rowwise 154, tensorwise 102);
* quantize (bytes in + out per second): fp8 1x128 2790, 128x128 2650, rowwise 2200,
  mx 1x32 2970, K-major mx 32x1 1950, jagged (per group or 128 rows) 1400 GB/s;
  tensorwise (amax, then one pass) derived from its end-to-end rows: ~910 GB/s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch_moe.perf._hardware import Hardware, Link

__all__ = ["HARDWARE_PRESETS", "MODEL_PRESETS", "model_preset"]

_G = 1e9
_T = 1e12

# measured / derived on the H200 (see the module docstring)
_H200_BF16 = 654e12
_H200_FP8_FWD = {
    "fp8_rowwise": 995e12,
    "fp8_tensorwise": 982e12,
    "fp8_blockwise": 634e12,
    "mxfp8": 312e12,
    "mxfp8_rceil": 312e12,
}
_H200_FP8_WGRAD = {
    "fp8_rowwise": 154e12,
    "fp8_tensorwise": 102e12,
    "fp8_blockwise": 512e12,
    "mxfp8": 245e12,
    "mxfp8_rceil": 245e12,
}
_H200_QUANT = {  # bytes in + out per second
    "q.fp8_tensor": 910 * _G,
    "q.fp8_row": 2200 * _G,
    "q.fp8_col": 1950 * _G,
    "q.fp8_1x128": 2790 * _G,
    "q.fp8_128x128": 2650 * _G,
    "q.mx_row": 2970 * _G,
    "q.mx_col": 1950 * _G,
    "qj.fp8_tensor": 910 * _G,
    "qj.fp8_group": 1410 * _G,
    "qj.fp8_128": 1400 * _G,
    "qj.mx_32": 1400 * _G,
}
_H200_COPY = 4241 * _G
_H200_FRACTION = _H200_BF16 / (989 * _T)  # 0.66: measured / datasheet bf16


def _gemm_rates(bf16: float, fp8_scale: float, measured: bool) -> dict[str, float]:
    """GEMM rates: bf16, and per recipe forward / dgrad / wgrad (scaled from the H200)."""
    rates = {"bf16": bf16, "fp16": bf16, "fp32": bf16 / 2}
    for recipe, fwd in _H200_FP8_FWD.items():
        s = 1.0 if measured else fp8_scale
        rates[f"{recipe}:forward"] = fwd * s
        rates[f"{recipe}:dgrad"] = fwd * s
        rates[f"{recipe}:wgrad"] = _H200_FP8_WGRAD[recipe] * s
    return rates


def _links(nvlink_per_dir: float, ib: float, source: str) -> tuple[Link, Link]:
    intra = Link(0.8 * nvlink_per_dir, 3e-6, 15e-6, f"default: 0.8 x datasheet NVLink ({source})")
    inter = Link(0.9 * ib, 10e-6, 30e-6, "default: 0.9 x datasheet ConnectX-7 400 Gb/s")
    return intra, inter


def _h100() -> Hardware:
    from torch._inductor.analysis.device_info import lookup_device_info

    info = lookup_device_info("NVIDIA H100")
    if info is None:  # pragma: no cover - torch always ships it
        raise RuntimeError("torch._inductor.analysis.device_info has no NVIDIA H100 entry")
    bf16_peak = info.tops[next(k for k in info.tops if str(k) == "torch.bfloat16")] * _T
    bf16_peak /= info.tops_sparsity_factor
    intra, inter = _links(450 * _G, 50 * _G, "NVLink 4, 900 GB/s bidirectional")
    return Hardware(
        name="h100",
        kind="gpu",
        gemm_rate=_gemm_rates(_H200_FRACTION * bf16_peak, 1.0, measured=False),
        mem_bandwidth=0.88 * info.dram_bw_gbs * _G,
        memory_capacity=info.dram_gb * _G,
        intra_link=intra,
        inter_link=inter,
        launch_overhead=5e-6,
        tile_m=128,
        kernel_rates={k: v * info.dram_bw_gbs / 4800 for k, v in _H200_QUANT.items()},
        gpus_per_node=8,
        comm_compute_share=20 / 132,
        sources={
            "peaks": "datasheet (torch._inductor.analysis.device_info 'NVIDIA H100', dense)",
            "gemm_rate": "default: 0.66 x datasheet bf16 (the H200 measured ratio); FP8 "
            "recipes: the H200 measured rates (same tensor cores)",
            "mem_bandwidth": "default: 0.88 x datasheet 3.35 TB/s (the H200 copy / datasheet)",
            "quantize": "H200 measured rates scaled by the HBM bandwidth ratio",
            "comm_compute_share": "default: 20 of 132 SMs communicate (DeepSeek-V3)",
        },
    )


def _h200() -> Hardware:
    intra, inter = _links(450 * _G, 50 * _G, "NVLink 4, 900 GB/s bidirectional")
    return Hardware(
        name="h200",
        kind="gpu",
        gemm_rate=_gemm_rates(_H200_BF16, 1.0, measured=True),
        mem_bandwidth=_H200_COPY,
        memory_capacity=141 * _G,
        intra_link=intra,
        inter_link=inter,
        launch_overhead=5e-6,
        tile_m=128,
        kernel_rates=dict(_H200_QUANT),
        gpus_per_node=8,
        comm_compute_share=20 / 132,
        sources={
            "peaks": "datasheet: bf16 989, fp8 1979 TFLOP/s dense, 4.8 TB/s, 141 GB",
            "gemm_rate": "measured (quant_h200_202611.md): bf16 654, FP8 forward per recipe; "
            "wgrad derived (end-to-end minus the measured jagged quantize)",
            "mem_bandwidth": "measured: copy 4241 GB/s",
            "quantize": "measured quantize-kernel rates (tensorwise derived)",
            "links": "default fractions of datasheet NVLink 4 / ConnectX-7",
            "comm_compute_share": "default: 20 of 132 SMs communicate (DeepSeek-V3)",
        },
    )


def _b200() -> Hardware:
    scale = 2250 / 989  # datasheet bf16 / fp8 ratio B200 : H100-class
    intra, inter = _links(900 * _G, 50 * _G, "NVLink 5, 1.8 TB/s bidirectional")
    return Hardware(
        name="b200",
        kind="gpu",
        gemm_rate=_gemm_rates(_H200_FRACTION * 2250 * _T, scale, measured=False),
        mem_bandwidth=0.88 * 8000 * _G,
        memory_capacity=180 * _G,
        intra_link=intra,
        inter_link=inter,
        launch_overhead=5e-6,
        tile_m=128,
        kernel_rates={k: v * 8000 / 4800 for k, v in _H200_QUANT.items()},
        gpus_per_node=8,
        comm_compute_share=20 / 148,
        sources={
            "peaks": "datasheet (HGX B200): bf16 2250, fp8 4500 TFLOP/s dense, 8 TB/s, 180 GB",
            "gemm_rate": "default: 0.66 x datasheet bf16; FP8 recipes: H200 measured x "
            "2250/989 (not measured on Blackwell)",
            "mem_bandwidth": "default: 0.88 x datasheet",
            "quantize": "H200 measured rates scaled by the HBM bandwidth ratio",
            "comm_compute_share": "default: 20 of 148 SMs communicate",
        },
    )


HARDWARE_PRESETS: dict[str, Callable[[], Hardware]] = {"h100": _h100, "h200": _h200, "b200": _b200}


# --------------------------------------------------------------------------------------
# model presets (the MoE blocks of torch_moe.nn.PRESETS)


def _model_presets() -> dict[str, dict[str, Any]]:
    from torch_moe.nn.modules.moe import PRESETS

    out = {}
    for name, cfg in PRESETS.items():
        fields: dict[str, Any] = dict(
            dim=cfg["dim"],
            hidden_dim=cfg["hidden_dim"],
            num_experts=cfg["num_experts"],
            top_k=cfg["top_k"],
            shared_hidden_dim=cfg.get("shared_hidden_dim", 0),
        )
        out[name] = fields
    return out


MODEL_PRESETS = _model_presets()


def model_preset(name: str) -> dict[str, Any]:
    """D, F, E, K, Fs of a published MoE block (``torch_moe.nn.MoE.from_preset`` names)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {sorted(MODEL_PRESETS)}")
    return dict(MODEL_PRESETS[name])
