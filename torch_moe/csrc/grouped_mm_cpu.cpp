// A grouped GEMM of a few rows per group (torch_moe's CPU grouped_mm kernels, where the
// CPU probe's few_gemm decision measured it faster): an MoE step of a few tokens gives
// each expert a few rows, and a GEMM of 1-32 rows against a [K, N] expert weight does
// little more than read that weight. torch._grouped_mm (or torch_moe's loop) runs one
// oneDNN GEMM per group, each with its own set-up and a packing of its half-precision
// weight into oneDNN's blocked layout. This kernel is one call for all groups that reads
// each weight element once, converts it in registers and applies it to every row of its
// group (measured against those in benchmarks/results/hf_train_step_cpu_202612.md):
//
//   few_rows_mm:  out[rows of g] = x[rows of g] @ w[g]      x [M, K], w [E, K, N]
//
// with w[g] row-major (rows of N contiguous: register blocks of 4 rows x 4 vectors of
// columns, k in panels of ~32 KB of weight rows, which stay in L2 while every column
// block passes over them) or column-major (columns contiguous over K: dot products of 4
// rows x 4 columns, the 4 columns drawn from 4 runs of columns so that each weight load
// walks one run front to back, the lines ahead prefetched in software, reduced at the
// end). On CPUs with AVX512-BF16, bf16 in both layouts by vdpbf16ps, which adds the
// products of pairs of bf16 (exact in fp32) to fp32 sums: the column-major form's dot
// products pair neighbouring k, the row-major form interleaves weight rows k and k + 1
// (below). Math in fp32, one rounding into the output dtype (float, bfloat16, half). The
// sums run in a fixed order for any thread count and group size (each output element
// belongs to one task, a group's column block, and is one sequence of operations), so
// results are deterministic; they are not ATen's bits (its blocking orders the sums
// otherwise), which is why the probe's choice, not a constant, says where this runs.
// Rows at or past the last group's end are zero; x must be contiguous.
//
// amx_rows > 0 (bf16, a column-major weight, where the native GEMM's AMX micro-kernel is
// on: torch_moe_cpu::bf16_gemm_use_amx): the column blocks of each group of at least
// amx_rows rows by AMX tiles instead, the weight's rows read in place as the tiles' first
// operand, the group's rows packed as the second (amx_gemm_rows_bt). Past a few rows the
// vdpbf16ps forms above are bound by the core's dot-product rate, not by the weight's
// reads (on the AMX Xeon measured: a cold expert's weight read at 10.7 GB/s at 8 rows,
// 5.9 at 16, 3.2 at 32, against 13.7-14.0 by tiles:
// benchmarks/results/cpu_floor_cpu_202612.md). Its sums are the AMX kernel's
// (32-k tile steps), not the vdpbf16ps forms': a row's bits then depend on whether its
// group has amx_rows rows, and the probe's few_gemm choices say from how many rows the
// tiles run. Elsewhere amx_rows changes nothing.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "gemm_bf16_cpu.h"
#include "ops_cpu.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kV = fVec::size();
constexpr int kRows = 4;           // rows per register block
constexpr int kCols = 4;           // fp32 vectors of output columns per register block (NN)
constexpr int64_t kPanel = 32 << 10;  // bytes of weight rows per k-panel (row-major form;
                                      // 16-256 KB measured, 32 the steadiest)

// kCols fp32 vectors from kCols * kV consecutive elements of T
template <typename T>
inline void load_cols(const T* p, fVec* out) {
  for (int j = 0; j < kCols; ++j) {
    out[j] = fVec::loadu(p + j * kV);
  }
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
template <>
inline void load_cols<c10::BFloat16>(const c10::BFloat16* p, fVec* out) {
  using hVec = Vectorized<c10::BFloat16>;  // 2 * kV elements
  for (int j = 0; j < kCols; j += 2) {
    auto [lo, hi] = at::vec::convert_bfloat16_float(hVec::loadu(p + j * kV));
    out[j] = lo;
    out[j + 1] = hi;
  }
}

template <>
inline void load_cols<c10::Half>(const c10::Half* p, fVec* out) {
  using hVec = Vectorized<c10::Half>;
  for (int j = 0; j < kCols; j += 2) {
    auto [lo, hi] = at::vec::convert_half_float(hVec::loadu(p + j * kV));
    out[j] = lo;
    out[j + 1] = hi;
  }
}
#else
template <>
inline void load_cols<c10::BFloat16>(const c10::BFloat16* p, fVec* out) {
  float buf[kCols * kV];
  for (int64_t i = 0; i < kCols * kV; ++i) buf[i] = static_cast<float>(p[i]);
  for (int j = 0; j < kCols; ++j) out[j] = fVec::loadu(buf + j * kV);
}

template <>
inline void load_cols<c10::Half>(const c10::Half* p, fVec* out) {
  float buf[kCols * kV];
  for (int64_t i = 0; i < kCols * kV; ++i) buf[i] = static_cast<float>(p[i]);
  for (int j = 0; j < kCols; ++j) out[j] = fVec::loadu(buf + j * kV);
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// One fp32 vector of kV consecutive elements of T, for the AVX2 tiles below that convert
// one weight vector at a time (load_cols converts kCols): F16C converts half, and bf16 is
// the high half of an fp32 (exact, as load_cols).
template <typename T>
inline fVec load_vec(const T* p) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return fVec(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return fVec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else {
    return fVec::loadu(p);
  }
}
#endif

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  at::vec::convert(src, dst, n);
}

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  at::vec::convert(src, dst, n);  // round to nearest even, as a tensor copy
}

// One product added as a vector lane adds it (at::vec::fmadd): fused where the build has
// FMA (AVX2, AVX512), a multiply and an add in the DEFAULT build, so that a column in a
// scalar tail gets the bits it gets in a vector.
inline float lane_fma(float a, float b, float c) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// Calls tile(std::integral_constant<int, R>(), i0) for the tiles [i0, i0 + R) of m rows,
// R = kRows but for the last tile. The kernels' tiles take R as a template argument so
// that their R x kRows (R x kCols) accumulators stay in registers: with a run-time row
// count GCC kept some on the stack, a load and a store per step (half the rate at 16
// rows).
// How many tiles for_row_tiles cuts m rows into
inline int64_t row_tiles(int64_t m) { return (m + kRows - 1) / kRows; }

template <typename Tile>
inline void for_row_tiles(int64_t m, Tile&& tile) {
  static_assert(kRows == 4, "one case per tile height");
  for (int64_t i0 = 0; i0 < m; i0 += kRows) {
    switch (std::min<int64_t>(kRows, m - i0)) {
      case 1: tile(std::integral_constant<int, 1>(), i0); break;
      case 2: tile(std::integral_constant<int, 2>(), i0); break;
      case 3: tile(std::integral_constant<int, 3>(), i0); break;
      default: tile(std::integral_constant<int, kRows>(), i0);
    }
  }
}

// One panel's part of nn_block for R rows (see for_row_tiles): acc[a * width + n] +=
// x[a, k] * w[k, n0 + n] over k in [k0, k1), columns in register blocks of kCols vectors,
// the last ones scalar.
template <int R, typename T>
void nn_panel(const float* xf, int64_t K, const T* w, int64_t ldw, int64_t n0, int64_t width,
              int64_t k0, int64_t k1, float* acc) {
  constexpr int64_t kW = kCols * kV;
#if defined(CPU_CAPABILITY_AVX2)
  // in AVX2's 16 vector registers (R x kCols sums + kCols weight vectors + x: 21 at four
  // rows, and GCC kept the rest on the stack): from three rows the block's columns in two
  // passes of kCols / 2 vectors, each weight vector still converted once per tile. The
  // same sums in the same order.
  constexpr int J = R <= 2 ? kCols : kCols / 2;
#else
  constexpr int J = kCols;
#endif
  int64_t n = 0;
  for (; n + kW <= width; n += kW) {
    for (int j0 = 0; j0 < kCols; j0 += J) {
      fVec c[R][J];
      for (int a = 0; a < R; ++a)
        for (int j = 0; j < J; ++j) c[a][j] = fVec::loadu(acc + a * width + n + (j0 + j) * kV);
      for (int64_t k = k0; k < k1; ++k) {
        fVec wv[J];
        if constexpr (J == kCols) {
          load_cols(w + k * ldw + n0 + n, wv);
        } else {  // (AVX2's passes only)
#if defined(CPU_CAPABILITY_AVX2)
          for (int j = 0; j < J; ++j) wv[j] = load_vec(w + k * ldw + n0 + n + (j0 + j) * kV);
#endif
        }
        for (int a = 0; a < R; ++a) {
          const fVec xv(xf[a * K + k]);
          for (int j = 0; j < J; ++j) c[a][j] = at::vec::fmadd(xv, wv[j], c[a][j]);
        }
      }
      for (int a = 0; a < R; ++a)
        for (int j = 0; j < J; ++j) c[a][j].store(acc + a * width + n + (j0 + j) * kV);
    }
  }
  for (; n < width; ++n) {  // the last columns (fewer than a block), one fma per product
    for (int a = 0; a < R; ++a) {  // as in the vector lanes
      float s = acc[a * width + n];
      for (int64_t k = k0; k < k1; ++k)
        s = lane_fma(xf[a * K + k], static_cast<float>(w[k * ldw + n0 + n]), s);
      acc[a * width + n] = s;
    }
  }
}

// out[r, n] for r < m rows of x (fp32 [m, K]) and a row-major weight w [K, N] (row
// stride ldw), columns [n0, n1): k in panels of ~kPanel bytes of weight rows, outermost,
// so that each panel is read from memory once and stays in L2 while every tile of kRows
// rows passes over it; the sums in acc (m x width floats).
template <typename T>
void nn_block(const float* xf, int64_t m, int64_t K, const T* w, int64_t ldw, int64_t n0,
              int64_t n1, T* out, int64_t ldo, float* acc) {
  const int64_t width = n1 - n0;
  const int64_t panel = std::max<int64_t>(4, kPanel / std::max<int64_t>(1, width * sizeof(T)));
  std::fill(acc, acc + m * width, 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += panel) {
    const int64_t k1 = std::min(K, k0 + panel);
    for_row_tiles(m, [&](auto rows, int64_t i0) {
      nn_panel<decltype(rows)::value>(xf + i0 * K, K, w, ldw, n0, width, k0, k1,
                                      acc + i0 * width);
    });
  }
  for (int64_t a = 0; a < m; ++a) from_float(acc + a * width, out + a * ldo + n0, width);
}

// The row-major form for a group of one row: the weight's rows in order, each passing
// over all of the columns and adding its products to fp32 sums in acc (width floats, in
// L1), so that the weight is read front to back as one stream. nn_block's register blocks
// instead walk down a panel's rows 128 bytes at a time, a short stream per row (at two or
// more rows the sums' loads and stores here cost more than that). Per element the
// products are added in k order, one fmadd each, as nn_block does: the same bits (a test
// checks it).
template <typename T>
void nn_row(const float* xf, int64_t K, const T* w, int64_t ldw, int64_t n0, int64_t width,
            T* out, float* acc) {
  constexpr int64_t kW = kCols * kV;
  const int64_t wb = width / kW * kW;
  std::fill(acc, acc + width, 0.0f);
  int64_t k = 0;
#if defined(CPU_CAPABILITY_AVX2)
  // four weight rows a pass over the sums (a quarter of their loads and stores, which
  // bound this loop here: in cache 21 -> 26-28 GB/s of weight on an AVX2-only EPYC, the
  // fifty-seventh session's results); each sum still one fmadd per k, in k order
  for (; k + 4 <= K; k += 4) {
    const fVec x0(xf[k]), x1(xf[k + 1]), x2(xf[k + 2]), x3(xf[k + 3]);
    const T* wk = w + k * ldw + n0;
    for (int64_t n = 0; n < wb; n += kV) {
      fVec c = fVec::loadu(acc + n);
      c = at::vec::fmadd(x0, load_vec(wk + n), c);
      c = at::vec::fmadd(x1, load_vec(wk + ldw + n), c);
      c = at::vec::fmadd(x2, load_vec(wk + 2 * ldw + n), c);
      c = at::vec::fmadd(x3, load_vec(wk + 3 * ldw + n), c);
      c.store(acc + n);
    }
  }
#endif
  for (; k < K; ++k) {
    const fVec xv(xf[k]);
    for (int64_t n = 0; n < wb; n += kW) {
      fVec wv[kCols];
      load_cols(w + k * ldw + n0 + n, wv);
      for (int j = 0; j < kCols; ++j)
        at::vec::fmadd(xv, wv[j], fVec::loadu(acc + n + j * kV)).store(acc + n + j * kV);
    }
  }
  for (int64_t n = wb; n < width; ++n) {  // the last columns (fewer than a block), one fma
    float s = 0.0f;                       // per product as in the vector lanes
    for (int64_t k = 0; k < K; ++k)
      s = lane_fma(xf[k], static_cast<float>(w[k * ldw + n0 + n]), s);
    acc[n] = s;
  }
  from_float(acc, out + n0, width);
}

// The column-major forms' blocks of kRows columns: block j of [n0, n1) takes column j of
// each of kRows equal runs of consecutive columns (then the few left over, together), so
// that each of the block's kRows weight loads walks one run of columns front to back, a
// stream the hardware prefetchers follow across columns. A block of kRows neighbouring
// columns instead starts kRows streams, each a column long, at every block, which the
// prefetchers barely follow where columns are short (benchmarks/results/cpu_floor_cpu_202612.md,
// twenty-sixth session). Which block a column falls in changes no sum: each output
// element is one dot product in k order.
inline int64_t column_runs(int64_t n0, int64_t n1) { return (n1 - n0) / kRows; }  // run length

inline int64_t column_blocks(int64_t n0, int64_t n1) {
  const int64_t run = column_runs(n0, n1);
  return run + (n0 + run * kRows < n1 ? 1 : 0);
}

// Block blk's columns into col[kRows] (a last, partial block repeats its last column);
// returns how many are distinct.
inline int block_columns(int64_t n0, int64_t n1, int64_t blk, int64_t* col) {
  const int64_t run = column_runs(n0, n1);
  if (blk < run) {
    for (int b = 0; b < kRows; ++b) col[b] = n0 + b * run + blk;
    return kRows;
  }
  const int64_t first = n0 + run * kRows;
  const int cols = static_cast<int>(n1 - first);
  for (int b = 0; b < kRows; ++b) col[b] = first + std::min(b, cols - 1);
  return cols;
}

// Software prefetch (for the column-major forms nt_blocks says which tile asks for it;
// the vdpbf16ps forms' panels fetch the next panel instead: PanelFetch): the cache lines
// `ahead` elements past a weight load's address, one per line the load spans. The
// hardware prefetchers run too short a way ahead on the weight's runs of columns, and
// nothing reads memory while a block's later row tiles work from L1
// (groups of 2-16 rows up to 1.8x faster with it: benchmarks/results/cpu_floor_cpu_202612.md,
// twenty-seventh session).
template <typename T, int64_t kElems>
inline void prefetch_ahead(const T* p, int64_t ahead) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  for (int64_t i = 0; i < kElems; i += 64 / static_cast<int64_t>(sizeof(T)))
    _mm_prefetch(reinterpret_cast<const char*>(p + ahead + i), _MM_HINT_T0);
#else
  __builtin_prefetch(p + ahead);
#endif
}

// The end of a column-major tile: each sum c[a][b] of the columns col[0..cols) reduced
// over its lanes, the products of k in [kb, K) added in order, rounded into out.
template <int R, typename T>
inline void nt_tile_store(const float* xf, int64_t K, const T* w, int64_t ldw, const int64_t* col,
                          int cols, int64_t kb, fVec (&c)[R][kRows], T* out, int64_t ldo) {
  for (int a = 0; a < R; ++a) {
    for (int b = 0; b < cols; ++b) {
      float s = at::vec::vec_reduce_all<float>([](fVec& u, fVec& v) { return u + v; }, c[a][b]);
      for (int64_t k = kb; k < K; ++k) s += xf[a * K + k] * static_cast<float>(w[col[b] * ldw + k]);
      out[a * ldo + col[b]] = static_cast<T>(s);  // round to nearest even, as a tensor copy
    }
  }
}

// out[r, n] = dot(x[r, :], w[n, :]) for R rows of x (fp32) and the columns col[0..cols)
// of a column-major weight (its column n contiguous over K: w[n * ldw + k]), the weight's
// elements converted in registers, kCols vectors of K per step (R: see for_row_tiles);
// `ahead`, where not 0, prefetches each weight load's lines that many elements ahead.
template <int R, typename T>
void nt_tile(const float* xf, int64_t K, const T* w, int64_t ldw, const int64_t* col, int cols,
             T* out, int64_t ldo, int64_t ahead) {
  constexpr int64_t kW = kCols * kV;
  const int64_t kb = K / kW * kW;
  fVec c[R][kRows];
  for (int a = 0; a < R; ++a)
    for (int b = 0; b < kRows; ++b) c[a][b] = fVec(0.0f);
  for (int64_t k = 0; k < kb; k += kW) {
    fVec wv[kRows][kCols];
    for (int b = 0; b < kRows; ++b) {
      if (ahead) prefetch_ahead<T, kW>(w + col[b] * ldw + k, ahead);
      load_cols(w + col[b] * ldw + k, wv[b]);
    }
    for (int a = 0; a < R; ++a) {
      for (int j = 0; j < kCols; ++j) {
        const fVec xv = fVec::loadu(xf + a * K + k + j * kV);
        for (int b = 0; b < kRows; ++b) c[a][b] = at::vec::fmadd(xv, wv[b][j], c[a][b]);
      }
    }
  }
  nt_tile_store<R>(xf, K, w, ldw, col, cols, kb, c, out, ldo);
}

#if defined(CPU_CAPABILITY_AVX2)
// nt_tile in the 16 vector registers of AVX2: nt_tile's R x kRows sums and kRows x kCols
// weight vectors need twice as many, and GCC keeps the rest on the stack. Here the weight
// is converted one vector of each column at a time (2 x 4 sums + 4 weight vectors + 1 of
// x live), and a tile of three or four rows runs as tiles of two, each converting the
// block's weight again from L1: passes of two columns over four rows, which read x's four
// rows twice (from L2 where K is large), ran 36 GFLOP/s at 8 rows in cache on an AVX2-only
// EPYC, tiles of two 52 (benchmarks/results/cpu_floor_cpu_202612.md, fifty-seventh
// session). Every sum adds the same products in the same order as nt_tile's (k in vectors
// of kV, kW a step, the lanes then reduced and the last K % kW products added in order):
// the same bits.
template <int R, typename T>
void nt_tile_ymm(const float* xf, int64_t K, const T* w, int64_t ldw, const int64_t* col, int cols,
                 T* out, int64_t ldo, int64_t ahead) {
  if constexpr (R > 2) {
    nt_tile_ymm<2>(xf, K, w, ldw, col, cols, out, ldo, ahead);
    nt_tile_ymm<R - 2>(xf + 2 * K, K, w, ldw, col, cols, out + 2 * ldo, ldo, 0);
  } else {
    constexpr int64_t kW = kCols * kV;
    const int64_t kb = K / kW * kW;
    const T* wc[kRows];
    for (int b = 0; b < kRows; ++b) wc[b] = w + col[b] * ldw;
    fVec c[R][kRows];
    for (int a = 0; a < R; ++a)
      for (int b = 0; b < kRows; ++b) c[a][b] = fVec(0.0f);
    for (int64_t k = 0; k < kb; k += kW) {
      if (ahead)
        for (int b = 0; b < kRows; ++b) prefetch_ahead<T, kW>(wc[b] + k, ahead);
      for (int j = 0; j < kCols; ++j) {
        fVec wv[kRows];
        for (int b = 0; b < kRows; ++b) wv[b] = load_vec(wc[b] + k + j * kV);
        for (int a = 0; a < R; ++a) {
          const fVec xv = fVec::loadu(xf + a * K + k + j * kV);
          for (int b = 0; b < kRows; ++b) c[a][b] = at::vec::fmadd(xv, wv[b], c[a][b]);
        }
      }
    }
    nt_tile_store<R>(xf, K, w, ldw, col, cols, kb, c, out, ldo);
  }
}
#endif

// The column-major form: columns [n0, n1) in the blocks of block_columns, m rows in
// tiles; tile(R, i0, col, cols, ahead) computes the tile of rows [i0, i0 + R) and those
// columns (nt_tile, or nt_tile_dpbf16), prefetching `ahead` elements ahead of its weight
// loads: the first row tile kPrefetch bytes down the block's runs, the second the next
// block's columns (the next ones of each run, ldw elements on), which the first tile
// then finds in cache while the block's later tiles keep memory busy.
constexpr int64_t kPrefetch = 2 << 10;  // bytes (1-4 KB measured alike)

template <typename T, typename Tile>
void nt_blocks(int64_t m, int64_t n0, int64_t n1, int64_t ldw, Tile&& tile) {
  const int64_t ahead = kPrefetch / static_cast<int64_t>(sizeof(T));
  for (int64_t blk = 0, blocks = column_blocks(n0, n1); blk < blocks; ++blk) {
    int64_t col[kRows];
    const int cols = block_columns(n0, n1, blk, col);
    for_row_tiles(m, [&](auto rows, int64_t i0) {
      tile(rows, i0, col, cols, i0 == 0 ? ahead : (i0 == kRows ? ldw : 0));
    });
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The column-major form for bf16 on CPUs with AVX512-BF16: vdpbf16ps adds the products
// of bf16 pairs (exact in fp32) to fp32 lanes, 32 multiply-adds per instruction, as
// oneDNN's bf16 kernels do on such CPUs (it treats denormal bf16 inputs as zero). Where
// the CPU has them: torch_moe_cpu::bf16_gemm_available() (the packed GEMM's own check).

#define TORCH_MOE_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define TORCH_MOE_BF16_INLINE TORCH_MOE_BF16_TARGET inline __attribute__((always_inline))

// The next panel's cache lines, fetched in address order a few per k pair while the
// current panel is multiplied: rows `rows` from `row` (row stride ld bytes), `bytes` of
// each from its start. The current panel's blocks of columns walk down its rows 64-256
// bytes at a time, a stride the hardware prefetchers follow too late from memory; this
// reads the weight as whole rows, in order, a panel ahead.
struct PanelFetch {
  const char* row = nullptr;
  int64_t ld = 0, bytes = 0, rows = 0, off = 0;
  int64_t per_step = 0;  // lines a k step: the panel's lines over its k steps, all tiles'

  // the next panel: `rows` rows from `first`, its lines shared over `steps` k steps
  void start(const void* first, int64_t rows_, int64_t steps) {
    row = static_cast<const char*>(first);
    rows = rows_;
    off = 0;
    per_step = steps ? (rows * ((bytes + 63) / 64) + steps - 1) / steps : 0;
  }

  TORCH_MOE_BF16_INLINE void lines() {
    for (int64_t i = 0; i < per_step && rows > 0; ++i) {
      _mm_prefetch(row + off, _MM_HINT_T1);  // (into L2: T0 and NTA measured slower)
      off += 64;
      if (off >= bytes) {
        off = 0;
        row += ld;
        --rows;
      }
    }
  }
};

// nt_tile for bf16 by vdpbf16ps (x in bf16 here); `fetch`, where not null, fetches its
// share of the next panel (nt_panels_dpbf16) a k step
template <int R>
TORCH_MOE_BF16_TARGET void nt_tile_dpbf16(
    const c10::BFloat16* x, int64_t K, const c10::BFloat16* w, int64_t ldw, const int64_t* col,
    int cols, c10::BFloat16* out, int64_t ldo, int64_t ahead, PanelFetch* fetch) {
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w);
  const int64_t kb = K / 32 * 32;
  __m512 c[R][kRows];
  for (int a = 0; a < R; ++a)
    for (int b = 0; b < kRows; ++b) c[a][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kb; k += 32) {
    __m512bh wv[kRows];
    if (fetch) fetch->lines();
    for (int b = 0; b < kRows; ++b) {
      if (ahead) prefetch_ahead<uint16_t, 32>(wp + col[b] * ldw + k, ahead);
      wv[b] = (__m512bh)_mm512_loadu_si512(wp + col[b] * ldw + k);
    }
    for (int a = 0; a < R; ++a) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xp + a * K + k);
      for (int b = 0; b < kRows; ++b) c[a][b] = _mm512_dpbf16_ps(c[a][b], xv, wv[b]);
    }
  }
  for (int a = 0; a < R; ++a) {
    for (int b = 0; b < cols; ++b) {
      float s = _mm512_reduce_add_ps(c[a][b]);
      for (int64_t k = kb; k < K; ++k)
        s += static_cast<float>(x[a * K + k]) * static_cast<float>(w[col[b] * ldw + k]);
      out[a * ldo + col[b]] = c10::BFloat16(s);
    }
  }
}

// The column-major form for bf16 by panels of whole columns (kNtPanelBytes of them, in
// blocks of kRows adjacent columns, m rows in tiles), every tile fetching its share of the
// next panel's lines in address order, over all of the panel's k steps (as the row-major
// form's panels: each panel read from L2, memory kept busy while later tiles compute);
// the last panel fetches the first of `next_cols` columns at next_w (the next task's, or
// none). Each output element is one dot product in k order whatever its block.
constexpr int64_t kNtPanelBytes = 192 << 10;
// groups of fewer rows take the runs of columns of nt_blocks (a decode step's one or two
// rows per expert: 0.86-0.91x the read floor there, the panels 0.95-0.99x; from 4 rows
// per expert the panels 1.03-1.06x, the runs 1.25-1.29x: cpu_floor_cpu_202612.md,
// fifty-sixth session)
constexpr int64_t kNtPanelRows = 3;

TORCH_MOE_BF16_TARGET void nt_panels_dpbf16(const c10::BFloat16* x, int64_t m, int64_t K,
                                            const c10::BFloat16* w, int64_t ldw, int64_t n0,
                                            int64_t n1, c10::BFloat16* out, int64_t ldo,
                                            const c10::BFloat16* next_w, int64_t next_cols) {
  const int64_t col_bytes = K * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t width =
      std::max<int64_t>(kRows, kNtPanelBytes / std::max<int64_t>(col_bytes, 1) / kRows * kRows);
  const int64_t tiles = row_tiles(m);
  PanelFetch fetch;
  fetch.ld = ldw * static_cast<int64_t>(sizeof(uint16_t));
  fetch.bytes = col_bytes;
  for (int64_t c0 = n0; c0 < n1; c0 += width) {
    const int64_t c1 = std::min(n1, c0 + width);
    const int64_t steps = (c1 - c0 + kRows - 1) / kRows * tiles * (K / 32);
    if (c1 < n1) {
      fetch.start(w + c1 * ldw, std::min(n1, c1 + width) - c1, steps);
    } else {
      fetch.start(next_w, next_w == nullptr ? 0 : std::min(width, next_cols), steps);
    }
    for (int64_t c = c0; c < c1; c += kRows) {
      int64_t col[kRows];
      const int cols = static_cast<int>(std::min<int64_t>(kRows, c1 - c));
      for (int b = 0; b < kRows; ++b) col[b] = c + std::min(b, cols - 1);
      for_row_tiles(m, [&](auto rows, int64_t i0) {
        nt_tile_dpbf16<decltype(rows)::value>(x + i0 * K, K, w, ldw, col, cols, out + i0 * ldo,
                                              ldo, 0, &fetch);
      });
    }
  }
}

// The row-major form for bf16 on CPUs with AVX512-BF16. vdpbf16ps multiplies pairs of
// bf16 along k, so weight rows k and k + 1 are interleaved (vpunpck{l,h}wd: of 32
// columns, the low half takes columns 0-3, 8-11, 16-19 and 24-27, each with its pair,
// the high half the others) and each x row's (x[k], x[k + 1]) is broadcast as one 32-bit
// pair; the sums are put back in column order once, at the end. An odd K's last weight
// row pairs with zero. Every output element is the same sequence of vdpbf16ps, k pairs
// in order from zero, whatever its tile, block or group size: a row's bits do not depend
// on its group (as in the fp32 forms). The fp32 forms' register blocks convert 4 vectors
// of weight per fma step; here an instruction takes 32 products.
constexpr int64_t kNnPanel = 64;  // weight rows per panel (even: a k pair never straddles
                                  // two); a panel of a 1536-2048-column weight is 192-256 KiB,
                                  // two of them (the one read, the one fetched) fit in L2
constexpr int kNnHalves = 2;        // 32-column halves per block: 16 accumulators for 4 rows
constexpr int kNnHalvesOneRow = 8;  // for a one-row group (nn_blocks_dpbf16 says why)

// The mask of the first `cols` of 32 columns
inline __mmask32 first_columns(int64_t cols) {
  return cols >= 32 ? ~__mmask32(0) : (cols <= 0 ? 0 : (__mmask32(1) << cols) - 1);
}

// Columns [0, 32) of weight rows k (at p) and k + 1 (zero where !kSecond), those in
// `mask` (the rest zero, not read), interleaved into lo / hi as above.
template <bool kSecond>
TORCH_MOE_BF16_INLINE void load_row_pair(const uint16_t* p, int64_t ldw, __mmask32 mask,
                                         __m512i& lo, __m512i& hi) {
  const bool full = mask == ~__mmask32(0);  // masked loads only in a block's tail
  const __m512i a0 = full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(mask, p);
  __m512i a1 = _mm512_setzero_si512();
  if (kSecond) a1 = full ? _mm512_loadu_si512(p + ldw) : _mm512_maskz_loadu_epi16(mask, p + ldw);
  lo = _mm512_unpacklo_epi16(a0, a1);
  hi = _mm512_unpackhi_epi16(a0, a1);
}

// (x[k], x[k + 1]) (x[k + 1] zero where !kSecond) broadcast to every 32-bit lane
template <bool kSecond>
TORCH_MOE_BF16_INLINE __m512bh x_pair(const uint16_t* x) {
  uint32_t v = x[0];
  if (kSecond) std::memcpy(&v, x, sizeof(v));
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
}

// 32 sums in lo / hi order back into column order, as floats at out[0, 32)
TORCH_MOE_BF16_TARGET inline void store_in_order(__m512 lo, __m512 hi, float* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28,
                                           29, 30, 31);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(lo, second, hi));
}

// acc[a * 32 * H + n] += x[a, k] * w[k, n] over the k pairs of [k0, k1) (and, where k1 is
// K and K odd, its last k), for R rows of x (bf16, row stride K) and the `cols` (<= 32 * H)
// columns of a row-major weight from w (row stride ldw), in registers: the accumulators
// start at zero for k0 == 0, else from acc (where the previous panel left them, in
// register order), and go back to acc in register order, or in column order where
// `last`. `fetch` fetches its share of the next panel's lines a k pair.
// (nn_step_dpbf16: one k pair of it, c the accumulators: 2 per 32 columns.)
template <int R, int H, bool kSecond>
TORCH_MOE_BF16_INLINE void nn_step_dpbf16(const uint16_t* x, int64_t K, const uint16_t* w,
                                          int64_t ldw, const __mmask32* mask, int64_t k,
                                          __m512 (&c)[R][2 * H]) {
  __m512i lo[H], hi[H];
  // (unrolled here: GCC otherwise keeps c in memory, storing every accumulator once a k
  // pair, which halved the multiply rate; tools: compile with -S and look for stores to
  // (%rsp) between the vdpbf16ps)
  _Pragma("GCC unroll 16") for (int h = 0; h < H; ++h)
    load_row_pair<kSecond>(w + k * ldw + 32 * h, ldw, mask[h], lo[h], hi[h]);
  _Pragma("GCC unroll 16") for (int a = 0; a < R; ++a) {
    const __m512bh xv = x_pair<kSecond>(x + a * K + k);
    _Pragma("GCC unroll 16") for (int h = 0; h < H; ++h) {
      c[a][2 * h] = _mm512_dpbf16_ps(c[a][2 * h], xv, (__m512bh)lo[h]);
      c[a][2 * h + 1] = _mm512_dpbf16_ps(c[a][2 * h + 1], xv, (__m512bh)hi[h]);
    }
  }
}

template <int R, int H>
TORCH_MOE_BF16_TARGET void nn_tile_dpbf16(const uint16_t* x, int64_t K, const uint16_t* w,
                                          int64_t ldw, int64_t cols, float* acc, int64_t k0,
                                          int64_t k1, bool last, PanelFetch& fetch) {
  __m512 c[R][2 * H];
  __mmask32 mask[H];
  _Pragma("GCC unroll 16") for (int a = 0; a < R; ++a)
    _Pragma("GCC unroll 16") for (int j = 0; j < 2 * H; ++j)
      c[a][j] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (a * 2 * H + j) * 16);
  _Pragma("GCC unroll 16") for (int h = 0; h < H; ++h) mask[h] = first_columns(cols - 32 * h);
  const int64_t kp = std::min(k1, K / 2 * 2);
  for (int64_t k = k0; k < kp; k += 2) {
    fetch.lines();
    nn_step_dpbf16<R, H, true>(x, K, w, ldw, mask, k, c);
  }
  if (kp < k1) nn_step_dpbf16<R, H, false>(x, K, w, ldw, mask, kp, c);
  _Pragma("GCC unroll 16") for (int a = 0; a < R; ++a)
    _Pragma("GCC unroll 16") for (int h = 0; h < H; ++h) {
      float* o = acc + (a * H + h) * 32;
      if (last) {
        store_in_order(c[a][2 * h], c[a][2 * h + 1], o);
      } else {
        _mm512_storeu_ps(o, c[a][2 * h]);
        _mm512_storeu_ps(o + 16, c[a][2 * h + 1]);
      }
    }
}

// nn_blocks_dpbf16's acc: m rows of n columns in blocks of `width`
inline int64_t nn_acc_floats(int64_t m, int64_t n, int64_t width) {
  return m * ((n + width - 1) / width) * width;
}

// The row-major form for m rows: the weight's rows [0, K) in panels of kNnPanel; in each,
// columns [n0, n1) in blocks of 32 * H (H = 8 for one row: a longer stretch of each weight
// row read at a time, 0.8-1.1x the fp32 form's one stream of whole rows, where 2 gave
// 0.7-0.8x; else 2, 16 accumulators for 4 rows) and rows in tiles, which all fetch the
// next panel, in equal shares over the panel's k pairs (the tiles after the first find
// the block's strip of rows in L1 / L2: memory would idle while they run). The
// sums wait in acc (m x (n1 - n0) floats, a block's rows together) between panels: each
// output element is the same vdpbf16ps sequence as in one pass; rounded into out at the end.
// (Qwen3-sized experts from cold caches, one Zen 4 thread: 1.2-1.9x faster than one pass
// with rows prefetched ahead per block: benchmarks/results/cpu_floor_cpu_202612.md,
// fifty-sixth session.)
template <int H>
void nn_blocks_dpbf16(const c10::BFloat16* x, int64_t m, int64_t K, const c10::BFloat16* w,
                      int64_t ldw, int64_t n0, int64_t n1, c10::BFloat16* out, int64_t ldo,
                      float* acc) {
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w);
  const int64_t width = 32 * H;
  const int64_t blocks = (n1 - n0 + width - 1) / width;
  PanelFetch fetch;
  fetch.ld = ldw * static_cast<int64_t>(sizeof(uint16_t));
  fetch.bytes = (n1 - n0) * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t tiles = row_tiles(m);
  for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += kNnPanel) {
    const int64_t k1 = std::min(K, k0 + kNnPanel);
    const bool last = k1 == K;
    fetch.start(wp + k1 * ldw + n0, std::min(K, k1 + kNnPanel) - k1,
                blocks * tiles * ((k1 - k0 + 1) / 2));
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n = n0 + b * width;
      const int64_t cols = std::min(width, n1 - n);
      float* block_acc = acc + b * m * width;
      for_row_tiles(m, [&](auto rows, int64_t i0) {
        if constexpr (decltype(rows)::value == 1 || H == kNnHalves) {
          nn_tile_dpbf16<decltype(rows)::value, H>(xp + i0 * K, K, wp + n, ldw, cols,
                                                   block_acc + i0 * width, k0, k1, last,
                                                   fetch);
        }
      });
      if (last) {
        for (int64_t a = 0; a < m; ++a) from_float(block_acc + a * width, out + a * ldo + n, cols);
      }
    }
    if (last) break;
  }
}

#undef TORCH_MOE_BF16_INLINE
#undef TORCH_MOE_BF16_TARGET
#endif

template <typename T>
void few_rows_mm_impl(const at::Tensor& x, const at::Tensor& w, const int32_t* ends,
                      at::Tensor& out, int64_t amx_rows) {
  const int64_t groups = w.size(0), K = w.size(1), N = w.size(2), M = x.size(0);
  if (N == 0) return;  // no output (and no column tasks to divide the columns into)
  const bool row_major = w.stride(2) == 1;  // else column-major: w.stride(1) == 1
  const int64_t ldw = row_major ? w.stride(1) : w.stride(2);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  // tasks: (group, column block); each task owns its output elements
  // column-major: 256 columns per task (runs of 64 in its blocks), fewer where that
  // leaves under four tasks per thread
  int64_t cols_per_task = N;
  if (!row_major) {
    cols_per_task = 256;
    const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
    while (cols_per_task > 64 && groups * ((N + cols_per_task - 1) / cols_per_task) < want)
      cols_per_task /= 2;
  }
  const int64_t col_tasks = (N + cols_per_task - 1) / cols_per_task;
  std::vector<int64_t> starts(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) starts[g + 1] = ends[g];
  bool dpbf16 = false;  // bf16 by vdpbf16ps, x read as it is
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) dpbf16 = torch_moe_cpu::bf16_gemm_available();
#endif
  at::parallel_for(0, groups * col_tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> xf, scratch;
    int64_t converted = -1;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / col_tasks, c = t % col_tasks;
      const int64_t r0 = starts[g], m = starts[g + 1] - r0;
      if (m <= 0) continue;
      if (!dpbf16 && converted != g) {
        xf.resize(m * K);
        to_float(xp + r0 * K, xf.data(), m * K);
        converted = g;
      }
      const int64_t n0 = c * cols_per_task, n1 = std::min(N, n0 + cols_per_task);
      const T* wg = wp + g * w.stride(0);
      T* o = op + r0 * N;
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (dpbf16) {
          const T* xg = xp + r0 * K;
          if (!row_major && amx_rows > 0 && m >= amx_rows &&
              torch_moe_cpu::amx_gemm_rows_bt(reinterpret_cast<const uint16_t*>(xg), K,
                                              reinterpret_cast<const uint16_t*>(wg + n0 * ldw),
                                              ldw, reinterpret_cast<uint16_t*>(o + n0), N, m,
                                              n1 - n0, K)) {
            continue;
          }
          if (!row_major) {
            if (m >= kNtPanelRows) {
              // the next busy task's columns: the last panel fetches their first panel
              const T* next_w = nullptr;
              int64_t next_cols = 0;
              for (int64_t u = t + 1; u < t1 && next_w == nullptr; ++u) {
                const int64_t gu = u / col_tasks, cu = u % col_tasks;
                if (starts[gu + 1] == starts[gu]) continue;
                const int64_t u0 = cu * cols_per_task;
                next_w = wp + gu * w.stride(0) + u0 * ldw;
                next_cols = std::min(N, u0 + cols_per_task) - u0;
              }
              nt_panels_dpbf16(xg, m, K, wg, ldw, n0, n1, o, N, next_w, next_cols);
            } else {
              nt_blocks<T>(m, n0, n1, ldw,
                           [&](auto rows, int64_t i0, const int64_t* col, int cols,
                               int64_t ahead) {
                             nt_tile_dpbf16<decltype(rows)::value>(xg + i0 * K, K, wg, ldw, col,
                                                                   cols, o + i0 * N, N, ahead,
                                                                   nullptr);
                           });
            }
          } else if (m == 1) {
            scratch.resize(nn_acc_floats(1, n1 - n0, 32 * kNnHalvesOneRow));
            nn_blocks_dpbf16<kNnHalvesOneRow>(xg, m, K, wg, ldw, n0, n1, o, N, scratch.data());
          } else {
            scratch.resize(nn_acc_floats(m, n1 - n0, 32 * kNnHalves));
            nn_blocks_dpbf16<kNnHalves>(xg, m, K, wg, ldw, n0, n1, o, N, scratch.data());
          }
          continue;
        }
      }
#endif
      if (row_major) {
        scratch.resize(m * (n1 - n0));
        if (m == 1) {
          nn_row(xf.data(), K, wg, ldw, n0, n1 - n0, o, scratch.data());
        } else {
          nn_block(xf.data(), m, K, wg, ldw, n0, n1, o, N, scratch.data());
        }
      } else {
        nt_blocks<T>(m, n0, n1, ldw,
                     [&](auto rows, int64_t i0, const int64_t* col, int cols, int64_t ahead) {
#if defined(CPU_CAPABILITY_AVX2)
                       nt_tile_ymm<decltype(rows)::value>(xf.data() + i0 * K, K, wg, ldw, col,
                                                          cols, o + i0 * N, N, ahead);
#else
                       nt_tile<decltype(rows)::value>(xf.data() + i0 * K, K, wg, ldw, col, cols,
                                                      o + i0 * N, N, ahead);
#endif
                     });
      }
    }
  });
  const int64_t end = groups ? ends[groups - 1] : 0;
  if (end < M) std::memset(op + end * N, 0, (M - end) * N * sizeof(T));
}

}  // namespace

namespace torch_moe_cpu {  // (ops_cpu.h: other native ops call it)

void few_rows_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                 at::Tensor& out, int64_t amx_rows) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(1), "few_rows_mm: x [M, K] "
              "and w [E, K, N] expected, got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.is_contiguous() && (w.stride(2) == 1 || w.stride(1) == 1),
              "few_rows_mm: x must be contiguous and w row- or column-major per group");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && out.scalar_type() == x.scalar_type() &&
                  out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) == w.size(2),
              "few_rows_mm: out must be a contiguous [M, N] tensor of x's dtype");
  TORCH_CHECK(offs.dim() == 1 && offs.scalar_type() == at::kInt && offs.size(0) == w.size(0) &&
                  offs.is_contiguous(),
              "few_rows_mm: offs must be a contiguous int32 tensor of ", w.size(0), " group ends");
  const int32_t* ends = offs.const_data_ptr<int32_t>();
  for (int64_t g = 0, prev = 0; g < offs.size(0); prev = ends[g], ++g) {
    TORCH_CHECK(ends[g] >= prev && ends[g] <= x.size(0), "few_rows_mm: offs must be "
                "non-decreasing and at most x's ", x.size(0), " rows, got ", ends[g],
                " at group ", g);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "few_rows_mm",
                                  [&] { few_rows_mm_impl<scalar_t>(x, w, ends, out, amx_rows); });
}

}  // namespace torch_moe_cpu

TORCH_LIBRARY_FRAGMENT(torch_moe_cpu, m) {
  m.def("few_rows_mm(Tensor x, Tensor w, Tensor offs, Tensor(a!) out, int amx_rows=0) -> ()");
}

TORCH_LIBRARY_IMPL(torch_moe_cpu, CPU, m) {
  m.impl("few_rows_mm", &torch_moe_cpu::few_rows_mm);
}
