// The packed bf16 GEMM of gemm_bf16_cpu.cpp, for the other native kernels.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace torch_moe_cpu {

// Whether bf16_gemm can run here: a build for ATen's AVX512 capability on a CPU with
// AVX512-BF16.
bool bf16_gemm_available();

// Whether bf16_gemm multiplies by AMX tiles (where the CPU and the OS allow it) or by
// AVX512-BF16 dot products: a process-wide choice, off until asked for; returns whether
// AMX is now on. The two micro-kernels' bits differ (see gemm_bf16_cpu.cpp).
bool bf16_gemm_use_amx(bool enable);
bool bf16_gemm_amx();  // whether it is on

// Rows of an operand gathered from its stored rows: logical row i is stored row index[i]
// (zero where index[i] < 0); size: the number of logical rows. index nullptr: none.
struct Gather {
  const int64_t* index = nullptr;
  int64_t size = 0;
  bool transposed = false;  // (a only) a is the transposed view of the gathered source
};

// A 2-D operand as the GEMM reads it: its first element, sizes and strides (in elements)
// and dtype, without an at::Tensor. The grouped kernels cut every call into pieces per
// expert and thread; an at::Tensor view per piece and operand (narrow, select, from_blob:
// a TensorImpl each) cost thousands of allocations a layer step.
struct Matrix {
  void* data = nullptr;
  int64_t rows = 0, cols = 0;
  int64_t row_stride = 0, col_stride = 1;
  at::ScalarType dtype = at::kBFloat16;

  static Matrix of(const at::Tensor& t);  // t 2-D
  static Matrix of(const at::Tensor& t, int64_t i);  // t[i] of a 3-D t
  // rows [r0, r0 + nr) and columns [c0, c0 + nc)
  Matrix block(int64_t r0, int64_t nr, int64_t c0, int64_t nc) const;
  Matrix row_range(int64_t r0, int64_t nr) const { return block(r0, nr, 0, cols); }
  Matrix col_range(int64_t c0, int64_t nc) const { return block(0, rows, c0, nc); }
  Matrix t() const { return {data, cols, rows, col_stride, row_stride, dtype}; }
  // a bf16 matrix at p: row-major (rows ld elements apart) or, with col_major, column-major
  // (columns ld elements apart)
  static Matrix bf16(const void* p, int64_t rows, int64_t cols, int64_t ld, bool col_major = false);
};

// out = a @ b (a [M, K], b [K, N], out [M, N], all bf16; a and b row- or column-major, out
// row-major with any row stride) on the calling thread, where bf16_gemm_available(). An
// fp32 out takes each element's fp32 sum unrounded, by the AVX512-BF16 micro-kernel also
// where AMX is on (its bits then do not depend on the CPU's AMX; `stream` is not used);
// returns false without touching out where it does not apply (the caller runs its ATen
// GEMM instead). With a_rows, a's stored rows are gathered: a is the source of a's M
// rows ([S, K], row-major), or with a_rows.transposed the transposed view of the source
// of a^T's K rows ([M, S], column-major). With b_rows, b is the source of b's K rows
// ([S, N], row-major). Indices are not checked here (callers check them against S).
// stream: out's whole 64-byte lines written by non-temporal stores (for an output past the
// caches that is read back only later; see store_line in gemm_bf16_cpu.cpp), fenced
// before the return.
bool bf16_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, Gather a_rows = {},
               Gather b_rows = {}, bool stream = false);
bool bf16_gemm(const Matrix& out, const Matrix& a, const Matrix& b, Gather a_rows = {},
               Gather b_rows = {}, bool stream = false);

// The scales of a block-scaled GEMM (the FP8 emulation's blockwise recipes, whose codes
// are bf16 values): out[m][n] = sum over k blocks kb of row[m * row_m + kb * row_kb] *
// col[kb * col_kb + n] * (the block's fp32 sum of a[m][k] * b[k][n]), each block's sum
// scaled by one multiply of the two scales and added by one fused multiply-add, in order
// of kb. A k block holds `pairs` pairs of k (block_k / 2); col holds whole panels of 64
// columns for every kb (it is read in 16-lane vectors, past N up to the panel's end).
struct BlockScales {
  const float* row;
  int64_t row_m, row_kb;
  const float* col;
  int64_t col_kb;
  int64_t pairs;
};

// bf16_gemm with block scales (nullptr: none): by the AVX512-BF16 micro-kernel also where
// AMX is on; out bf16 (one rounding of the scaled sums) or fp32.
bool bf16_gemm_scaled(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                      const BlockScales* scales, Gather a_rows = {}, Gather b_rows = {},
                      bool stream = false);
bool bf16_gemm_scaled(const Matrix& out, const Matrix& a, const Matrix& b,
                      const BlockScales* scales, Gather a_rows = {}, Gather b_rows = {},
                      bool stream = false);

// Whether a GEMM's whole output of out_bytes (all its calls' pieces together) is past
// this core's L2 cache (the system's figure; 2 MiB where it gives none): where its
// lines leave the cache before anything reads them, so bf16_gemm's `stream` pays.
bool bf16_gemm_streams(int64_t out_bytes);

// c [M, N] (row stride ldc) = a [M, K] (row stride lda) @ w^T for w [N, K] (row stride
// ldw), bf16, on the calling thread by bf16_gemm's AMX micro-kernel (its x @ w^T form: w's
// rows read in place, a packed; for a few rows of a, one column tile where 16 suffice);
// false without touching c where AMX is not on (bf16_gemm_use_amx).
bool amx_gemm_rows_bt(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t ldw,
                      uint16_t* c, int64_t ldc, int64_t M, int64_t N, int64_t K);
// The same products with c fp32: each element its K's fp32 sum as the tiles leave it
// (the sums the bf16 form rounds once).
bool amx_gemm_rows_bt(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t ldw, float* c,
                      int64_t ldc, int64_t M, int64_t N, int64_t K);

// out [K, M] = x^T for x [M, K] of 16-bit elements (rows strided by ldx, ldo) on the
// calling thread, bit for bit, by 32 x 32 blocks of AVX-512 words; false without touching
// out where this build or CPU lacks AVX512-BW (the caller copies by ATen instead).
bool transpose16_into(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* out,
                      int64_t ldo);

// A thread's scratch buffer (kept between calls) with at least n elements from a 64-byte
// boundary, the pointer returned. malloc aligns large blocks to 16 bytes only (glibc's
// fall 16 bytes past a line): each 64-byte row of a tile or vector loaded from the
// buffer would then span two cache lines. (In a standalone AMX tile loop, buffers so
// placed ran at 0.62-0.66 TFLOP/s against 0.92-1.15 on lines:
// benchmarks/results/cpu_floor_cpu_202612.md.) What it held does not survive a call that
// grows it.
template <class T>
T* aligned_scratch(std::vector<T>& v, int64_t n) {
  static_assert(64 % sizeof(T) == 0, "elements that tile a cache line");
  constexpr int64_t pad = 64 / sizeof(T);
  if (static_cast<int64_t>(v.size()) < n + pad) v.resize(n + pad);
  const auto p = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<T*>((p + 63) & ~uintptr_t{63});
}

}  // namespace torch_moe_cpu
