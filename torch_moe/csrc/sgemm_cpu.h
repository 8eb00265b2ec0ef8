// fp32 GEMMs of raw buffers on the calling thread, by the BLAS routine ATen's own fp32
// GEMM calls (at::native::cpublas::gemm: sgemm_, MKL's in the x86 wheels), for the native
// kernels' pieces.
//
// The kernels that cut a grouped GEMM into per-thread pieces (fp8_cpu.cpp's dequantized
// pieces, grouped_mm_threads_cpu.cpp's upcast pieces) ran each piece as at::mm_out on
// from_blob / narrow views of the thread's fp32 scratch, and a bf16 output as a copy_ of
// an fp32 product: per piece a few TensorImpls, two dispatches and a TensorIterator, where
// a piece of an expert's GEMM is tens of microseconds (32 x 256 x 256 on one AVX2 core:
// ~70 us). fp32_gemm calls sgemm_ with the operands' own pointers instead: the same
// routine at::mm reaches for fp32 tensors, so the same math (the same bits on the machine
// measured); on the Zen 3 EPYC measured the FP8 emulation's dequantized forward (M = 2048,
// K = N = 256, 64 experts) ran 5-12% faster so and its weight gradient 12-19%
// (benchmarks/results/cpu_floor_cpu_202612.md).
//
// It applies where the process has sgemm_ (a weak reference: a torch build without an
// external BLAS leaves it null) and where ATen would call it: its CPU fp32 matmuls in IEEE
// precision, as ATen resolves torch.backends.mkldnn.matmul.fp32_precision (its own
// setting, else torch.backends.mkldnn's, else torch.backends'; the legacy
// torch.set_float32_matmul_precision sets it too: "high" as tf32, "medium" as bf16). Where
// it is tf32 or bf16 ATen may take oneDNN's reduced-precision forms, and the callers run
// at::mm. (The legacy getter is not asked: it raises where the two APIs were mixed.) BLAS
// runs a call inside an OpenMP parallel region on the calling thread, as at::mm there.

#pragma once

#include "gemm_bf16_cpu.h"

#include <ATen/Context.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

// BLAS's fp32 GEMM (column-major, Fortran calling convention, 32-bit integers: ATen's own
// declaration of it in BlasKernel.cpp).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));

namespace torch_moe_cpu {

// Whether fp32_gemm runs here now: sgemm_ linked, ATen's CPU fp32 matmuls in IEEE
// precision (neither tf32 nor bf16).
inline bool fp32_gemm_available() {
  if (sgemm_ == nullptr) return false;
  const auto p = at::globalContext().float32Precision(at::Float32Backend::MKLDNN,
                                                      at::Float32Op::MATMUL);
  return p != at::Float32Precision::TF32 && p != at::Float32Precision::BF16;
}

// c [m, n] (row-major, row stride ldc) = a @ b for a [m, k] and b [k, n], fp32: a row-major
// (row stride lda) or, with a_cols, column-major (column stride lda: a^T stored row-major);
// b likewise (ldb, b_cols). The row-major product is the column-major c^T = b^T a^T: b's
// rows are b^T's columns. The caller asks fp32_gemm_available() once per op call, so that
// every piece of the call takes one route. False without touching c where sgemm_ is not
// linked or a size or stride is past BLAS's 32-bit integers.
inline bool fp32_gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, bool a_cols,
                      const float* b, int64_t ldb, bool b_cols, float* c, int64_t ldc) {
  for (const int64_t v : {m, n, k, lda, ldb, ldc}) {
    if (v < 0 || v > INT_MAX) return false;
  }
  if (sgemm_ == nullptr) return false;
  if (m == 0 || n == 0) return true;
  // BLAS asks a leading dimension of at least max(1, the column-major view's rows), which
  // a stride of a single stored row or column need not be
  const auto ld = [](int64_t v, int64_t rows) { return static_cast<int>(std::max({v, rows, int64_t{1}})); };
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int ldb_ = ld(ldb, b_cols ? k : n), lda_ = ld(lda, a_cols ? m : k), ldc_ = ld(ldc, n);
  const float one = 1.0f, zero = 0.0f;
  const char tb = b_cols ? 'T' : 'N', ta = a_cols ? 'T' : 'N';
  sgemm_(&tb, &ta, &M, &N, &K, &one, b, &ldb_, a, &lda_, &zero, c, &ldc_);
  return true;
}

// fp32_gemm into c of `dtype` (row stride ldc in its elements): an fp32 c written by the
// GEMM, a bf16 / fp16 one through this thread's fp32 scratch, each row rounded once by
// at::vec::convert (to nearest even, as a tensor copy rounds). False without touching c
// where fp32_gemm is, or for another dtype.
inline bool fp32_gemm_into(at::ScalarType dtype, void* c, int64_t ldc, int64_t m, int64_t n,
                           int64_t k, const float* a, int64_t lda, bool a_cols, const float* b,
                           int64_t ldb, bool b_cols) {
  if (dtype == at::kFloat) {
    return fp32_gemm(m, n, k, a, lda, a_cols, b, ldb, b_cols, static_cast<float*>(c), ldc);
  }
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return false;
  thread_local std::vector<float> prod;
  float* p = aligned_scratch(prod, std::max<int64_t>(m * n, 1));
  if (!fp32_gemm(m, n, k, a, lda, a_cols, b, ldb, b_cols, p, n)) return false;
  for (int64_t i = 0; i < m; ++i) {
    if (dtype == at::kBFloat16) {
      at::vec::convert(p + i * n, static_cast<at::BFloat16*>(c) + i * ldc, n);
    } else {
      at::vec::convert(p + i * n, static_cast<at::Half*>(c) + i * ldc, n);
    }
  }
  return true;
}

}  // namespace torch_moe_cpu
