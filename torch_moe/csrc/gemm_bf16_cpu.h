// The packed bf16 GEMM of gemm_bf16_cpu.cpp, for the other native kernels.

#pragma once

#include <ATen/core/Tensor.h>

namespace torch_moe_cpu {

// Whether bf16_gemm can run here: a build for ATen's AVX512 capability on a CPU with
// AVX512-BF16.
bool bf16_gemm_available();

// out = a @ b (a [M, K], b [K, N], out [M, N], all bf16; a and b row- or column-major, out
// row-major with any row stride) on the calling thread, where bf16_gemm_available();
// returns false without touching out where it does not apply (the caller runs its ATen
// GEMM instead).
bool bf16_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

}  // namespace torch_moe_cpu
