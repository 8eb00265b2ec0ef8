"""Low-precision (FP8 / MXFP8) grouped GEMMs: recipes, quantize ops, scaled GEMM ops.

The public quantizers and :func:`scaled_grouped_mm` dispatch to ``torch.ops.torch_moe``
custom ops (Triton kernels on CUDA); the ``*_reference`` functions are the plain-PyTorch
oracles the CPU kernels run. On CPU the scaled GEMMs are an exact emulation (quantize ->
dequantize -> fp32 GEMM) of what the GPU kernels compute; see
:mod:`torch_moe.quantization.quantize` for the numerics.
"""

from torch_moe.quantization import fused as _fused  # noqa: F401  (registers the fused ops)
from torch_moe.quantization.ops import (
    dequantize_fp8,
    dequantize_jagged,
    dequantize_mx,
    quantize_fp8,
    quantize_jagged,
    quantize_mx,
)
from torch_moe.quantization.quantize import (
    E4M3_EMAX,
    E8M0_BIAS,
    FP8_E4M3_MAX,
    MX_BLOCK,
    dequantize_fp8_reference,
    dequantize_jagged_reference,
    dequantize_mx_reference,
    e8m0_to_float,
    jagged_block_index,
    jagged_num_blocks,
    mx_scale_exponent,
    quantize_fp8_reference,
    quantize_jagged_reference,
    quantize_mx_reference,
)
from torch_moe.quantization.recipes import (
    BF16,
    RECIPES,
    GemmQuant,
    OperandQuant,
    Recipe,
    get_recipe,
)
from torch_moe.quantization.scaled_grouped_mm import (
    scaled_grouped_mm,
    scaled_grouped_mm_reference,
    scaled_grouped_mm_wgrad_reference,
)

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
    "dequantize_fp8_reference",
    "dequantize_jagged",
    "dequantize_jagged_reference",
    "dequantize_mx",
    "dequantize_mx_reference",
    "e8m0_to_float",
    "get_recipe",
    "jagged_block_index",
    "jagged_num_blocks",
    "mx_scale_exponent",
    "quantize_fp8",
    "quantize_fp8_reference",
    "quantize_jagged",
    "quantize_jagged_reference",
    "quantize_mx",
    "quantize_mx_reference",
    "scaled_grouped_mm",
    "scaled_grouped_mm_reference",
    "scaled_grouped_mm_wgrad_reference",
]
