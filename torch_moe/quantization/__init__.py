"""Low-precision (FP8 / MXFP8) grouped GEMMs: recipes, reference quantizers, scaled GEMM.

The CPU path is an exact emulation (quantize -> dequantize -> fp32 GEMM) of what the GPU
kernels compute; see :mod:`torch_moe.quantization.quantize` for the numerics.
"""

from torch_moe.quantization import ops as _ops  # noqa: F401  (registers torch_moe::quantize_*)
from torch_moe.quantization.quantize import (
    E4M3_EMAX,
    E8M0_BIAS,
    FP8_E4M3_MAX,
    MX_BLOCK,
    dequantize_fp8,
    dequantize_jagged,
    dequantize_mx,
    e8m0_to_float,
    jagged_block_index,
    mx_scale_exponent,
    quantize_fp8,
    quantize_jagged,
    quantize_mx,
)
from torch_moe.quantization.recipes import (
    BF16,
    RECIPES,
    GemmQuant,
    OperandQuant,
    Recipe,
    get_recipe,
)
from torch_moe.quantization.scaled_grouped_mm import scaled_grouped_mm

__all__ = [
    "BF16",
    "E4M3_EMAX",
    "E8M0_BIAS",
    "FP8_E4M3_MAX",
    "MX_BLOCK",
    "RECIPES",
    "GemmQuant",
    "OperandQuant",
    "Recipe",
    "dequantize_fp8",
    "dequantize_jagged",
    "dequantize_mx",
    "e8m0_to_float",
    "get_recipe",
    "jagged_block_index",
    "mx_scale_exponent",
    "quantize_fp8",
    "quantize_jagged",
    "quantize_mx",
    "scaled_grouped_mm",
]
