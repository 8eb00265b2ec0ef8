// A bf16 GEMM for CPUs with AVX512-BF16 (and AMX: its own micro-kernel, below), for the
// threaded grouped GEMM's pieces (grouped_mm_threads_cpu.cpp) where the CPU probe's
// gemm_kernel decision measured it faster than ATen's GEMM (oneDNN's bf16 matmul):
//
//   out [M, N] = a [M, K] @ b [K, N]     bf16, a and b row- or column-major
//
// An MoE layer's expert GEMMs multiply a few hundred rows by a weight of several MB read
// from memory, in both of the weight's orientations (x @ w^T forward, dh @ w backward),
// and the weight gradient a column-major a (the activations' transpose) by row-major
// rows. On the AVX512-BF16 EPYCs measured (benchmarks/results/cpu_floor_cpu_202612.md)
// oneDNN's bf16 matmul ran those at 417-443 GFLOP/s on one thread in a layer step, the
// row-major weight (dh @ w) and the weight gradients lowest, against 460-480 for the same
// GEMMs with the weight in cache: each call packs the weight into its blocked layout
// again for every block of rows. This kernel packs each operand that needs it once per
// call and runs every shape at the rate of its micro-kernel (470-500 GFLOP/s there, the
// weight read from memory or not).
//
// Method (the classic packed GEMM): b is packed into panels of 64 columns, each [K/2, 64]
// 32-bit words holding the bf16 pair (b[2p][n], b[2p + 1][n]), which is what vdpbf16ps
// multiplies: it adds a[2p] * b[2p][n] + a[2p + 1] * b[2p + 1][n] (products of bf16 are
// exact in fp32) to 16 fp32 lanes. A row-major b is packed by interleaving its rows 2p
// and 2p + 1, a column-major b (x @ w^T's w^T) by 16 x 16 transposes of 32-bit words. A
// register tile is 6 rows x 64 columns (24 accumulators); its a operand is the pair
// (a[m][2p], a[m][2p + 1]) broadcast, read in place where a is row-major and from a copy
// packed like a row-major b's panels where a is column-major. Rows of a are taken in
// near-equal blocks of at most half the L2 cache (they stay there while the panels pass
// over them); with a single block each panel is packed just before its tiles use it, so
// it stays in L2 too, else all panels are packed first.
//
// Bits: each output element is one sequence of vdpbf16ps over its k pairs in order, in
// blocks of 512 k each summed from zero and added to the running fp32 sum in order, then
// rounded to bf16 once (to nearest even). That depends on nothing but K: not on M, N, a
// tile's or a thread's share of the rows or columns, so the threaded kernel's results
// are the same on any thread count. On the machines measured this is also oneDNN's
// order for K <= 1024 (the same bits as torch.mm there; beyond, oneDNN's K blocks differ
// by shape and layout, and so do about 1 in 5000 of the bits). vdpbf16ps treats denormal
// inputs as zero and flushes denormal sums, as oneDNN's bf16 kernels on these CPUs do.
//
// Gathered operands: a row-major a's rows, a column-major a's columns (the rows of a^T)
// and a row-major b's rows may be read through an index of the rows of their source (a
// zero row where it is -1): the permutation's gather (x[tokens], grad_out[tokens]) is then
// read by the GEMM, which touches each row once per panel pass anyway, instead of copied
// into an [M, K] tensor first (at 64 experts three 32 MB copies per layer step that
// neither thread count made faster). The bits are those of the gathered copy's.
//
// Scratch: each thread keeps its packing buffers (a weight's panels: 2 bytes per element
// of b) between calls.

#include "gemm_bf16_cpu.h"
#include "vec_convert.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#endif

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace torch_moe_cpu {

#if defined(CPU_CAPABILITY_AVX512)
namespace {

#define TORCH_MOE_GEMM_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define TORCH_MOE_GEMM_INLINE TORCH_MOE_GEMM_TARGET inline __attribute__((always_inline))

constexpr int64_t kNr = 64;            // columns per panel and register tile: 4 x 16 lanes
constexpr int kMr = 6;                 // rows per register tile: 6 x 4 accumulators
constexpr int64_t kKBlock = 256;       // k pairs (512 k) per block of the sums

// Bytes of a's rows per pass over the panels: half the L2 cache (the rest holds the panel
// in use and the output rows; 1 MiB where the system does not say), at least 64 KiB.
int64_t a_block_bytes() {
  return std::max<int64_t>(64 << 10, l2_cache_bytes() / 2);
}

// Rows of a per pass over b's panels: near-equal passes of whole units of rows, each at
// most a_block_bytes() of a (row_bytes a row); one pass where the result is >= M.
int64_t pass_rows(int64_t M, int64_t row_bytes, int64_t unit) {
  const int64_t most = std::max<int64_t>(unit, a_block_bytes() / row_bytes / unit * unit);
  const int64_t passes = (M + most - 1) / most;
  return ((M + passes - 1) / passes + unit - 1) / unit * unit;
}

inline uint32_t pair_at(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The rows of a row-major matrix (row stride ld), in order or gathered: row i at base +
// index[i] * ld, a row of zeros (`zero`, as long as any row read) where index[i] < 0.
struct RowSource {
  const uint16_t* base;
  int64_t ld;
  const int64_t* index;  // nullptr: row i at base + i * ld
  const uint16_t* zero;
  const uint16_t* row(int64_t i) const {
    if (index == nullptr) return base + i * ld;
    const int64_t j = index[i];
    return j < 0 ? zero : base + j * ld;
  }
};

// The 32-bit words (x[j], y[j]) of 32 16-bit columns of two rows: columns 0-15 in lo,
// 16-31 in hi. (unpack{lo,hi}_epi16 interleave within 128-bit lanes: of 32 columns, the
// first holds the pairs of columns 0-3, 8-11, 16-19, 24-27 and the second the others;
// the permutes restore order.)
TORCH_MOE_GEMM_INLINE void interleave_rows(__m512i x, __m512i y, __m512i& lo, __m512i& hi) {
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  const __m512i l = _mm512_unpacklo_epi16(x, y), h = _mm512_unpackhi_epi16(x, y);
  lo = _mm512_permutex2var_epi64(l, first, h);
  hi = _mm512_permutex2var_epi64(l, second, h);
}

// 32 bf16 outputs (lo: columns 0-15, hi: 16-31) into o by one 64-byte store: with
// `stream`, where o starts a cache line, a non-temporal one (the line written to memory
// without being read first). An output larger than the caches, read back only after the
// GEMM, otherwise costs a read for ownership of every line and stalls the tile loop on
// it: on the AMX Xeon measured the 64-expert layer's a @ w2^T (K = 256, a 32 MB output)
// ran 1.5x faster so (benchmarks/results/cpu_floor_cpu_202612.md). The caller fences.
// (store_vec's store: the activation kernels' too.)
TORCH_MOE_GEMM_INLINE void store_line(uint16_t* o, __m256i lo, __m256i hi, bool stream) {
  const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  store_vec(at::vec::Vectorized<at::BFloat16>(v), reinterpret_cast<at::BFloat16*>(o), stream);
}

// One panel row: the 32-bit words o[j] = (r0[j], r1[j]) of columns j < cols (cols <= 64;
// r1 nullptr: zeros), zero from cols to 63.
TORCH_MOE_GEMM_INLINE void pair_panel_row(const uint16_t* r0, const uint16_t* r1, int64_t cols,
                                          uint32_t* o) {
  if (cols == kNr) {
    for (int h = 0; h < 2; ++h) {
      const __m512i x = _mm512_loadu_si512(r0 + 32 * h);
      const __m512i y = r1 ? _mm512_loadu_si512(r1 + 32 * h) : _mm512_setzero_si512();
      __m512i lo, hi;
      interleave_rows(x, y, lo, hi);
      _mm512_storeu_si512(o + 32 * h, lo);
      _mm512_storeu_si512(o + 32 * h + 16, hi);
    }
    return;
  }
  for (int64_t j = 0; j < kNr; ++j) {
    const uint32_t hi = r1 && j < cols ? uint32_t(r1[j]) << 16 : 0u;
    o[j] = j < cols ? (uint32_t(r0[j]) | hi) : 0u;
  }
}

// 16 bf16 values (x), the first n of them (1 <= n, all where n >= 16) into o.
TORCH_MOE_GEMM_INLINE void store_16(uint16_t* o, __m256i x, int64_t n) {
  if (n >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), x);
  } else {
    _mm256_mask_storeu_epi16(o, static_cast<__mmask16>((1u << n) - 1), x);
  }
}

// Rows 2p and 2p + 1 of a [K, cols] matrix (`m`'s rows from column col0 on, cols <= 64)
// interleaved into out[p * ldo + j] = (m[2p][j], m[2p + 1][j]), for p < ceil(K / 2): an
// odd K's last row pairs with zero, as do columns cols..63.
TORCH_MOE_GEMM_TARGET void pack_row_pairs(const RowSource& m, int64_t col0, int64_t K,
                                          int64_t cols, uint32_t* out, int64_t ldo,
                                          int64_t p_begin = 0, int64_t p_end = INT64_MAX) {
  for (int64_t p = p_begin; 2 * p < K && p < p_end; ++p) {
    const uint16_t* r1 = 2 * p + 1 < K ? m.row(2 * p + 1) + col0 : nullptr;
    pair_panel_row(m.row(2 * p) + col0, r1, cols, out + p * ldo);
  }
}

// Every panel of a row-major [K, N] matrix at once (panel q at out + q * panel_words, as
// pack_row_pairs would write it, zero pairs from ceil(K / 2) up to `pairs`), kPackPairs
// pairs of rows at a time: each row read once, from its start to its end (8 rows side by
// side), each panel's kPackPairs rows (1 KB) written together. Packing panel by panel
// instead reads a strip of 128 bytes of every row for each panel, a stride the hardware
// prefetchers do not follow (an E8 expert's dH @ w13 on the AMX Xeon measured: 48 -> 40
// ms). One pair at a time wrote 256 bytes into each of the panels in turn, 64 KB apart at
// K = 512 (the same L1 sets): with four the layer's GEMMs with a row-major b take 0.90x
// the time (E64 dH @ w13), 0.92x (dY @ w2), 0.95x (dW13), 0.96-0.98x at E8 (one thread,
// medians of 8-10 alternated rounds; two or eight pairs no better at E8 / E32; the panels
// also padded apart by a line: within 1%): benchmarks/results/cpu_floor_cpu_202612.md.
constexpr int64_t kPackPairs = 4;

TORCH_MOE_GEMM_TARGET void pack_row_pairs_across(const RowSource& m, int64_t K, int64_t N,
                                                 int64_t pairs, uint32_t* out,
                                                 int64_t panel_words) {
  for (int64_t p0 = 0; p0 < pairs; p0 += kPackPairs) {
    const int64_t p1 = std::min(pairs, p0 + kPackPairs);
    for (int64_t n0 = 0; n0 < N; n0 += kNr) {
      uint32_t* const panel = out + (n0 / kNr) * panel_words;
      for (int64_t p = p0; p < p1; ++p) {
        uint32_t* const o = panel + p * kNr;
        if (2 * p >= K) {
          std::memset(o, 0, kNr * 4);
          continue;
        }
        const uint16_t* r1 = 2 * p + 1 < K ? m.row(2 * p + 1) + n0 : nullptr;
        pair_panel_row(m.row(2 * p) + n0, r1, std::min(kNr, N - n0), o);
      }
    }
  }
}

// In place: r[i] becomes the i-th 32-bit word of each of r[0..15].
TORCH_MOE_GEMM_INLINE void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
    r[4 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

// A column-major [K, cols] b (column j's K elements contiguous at src.row(j0 + j), cols <=
// 64; gathered or not) into one panel: out[p * 64 + j] = (b[2p][j], b[2p + 1][j]) for p <
// ceil(K / 2), an odd K's last element paired with zero, columns past cols zero up to
// `width` (columns past it not written: a caller that reads only the first `width`);
// pairs [p_begin, p_end) only (p_begin a multiple of 16). Groups of 16 columns with any of
// b's by 16 x 16 word transposes (the missing columns read from src.zero), the others
// stored as zeros.
TORCH_MOE_GEMM_TARGET void pack_col_pairs(const RowSource& src, int64_t j0, int64_t K,
                                          int64_t cols, uint32_t* out, int64_t p_begin = 0,
                                          int64_t p_end = INT64_MAX, int64_t width = kNr) {
  const int64_t pairs = std::min((K + 1) / 2, p_end);
  const int64_t whole = std::min(K / 2 / 16 * 16, p_end);  // pairs by transposes
  const int64_t filled = std::min(width, (cols + 15) / 16 * 16);  // groups with columns
  const uint16_t* col[kNr];
  for (int64_t j = 0; j < kNr; ++j) col[j] = j < cols ? src.row(j0 + j) : src.zero;
  for (int64_t c0 = 0; c0 < filled && whole > p_begin; c0 += 16) {  // front to back
    for (int64_t p = p_begin; p < whole; p += 16) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(col[c0 + j] + 2 * p);
      transpose_16x16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + (p + i) * kNr + c0, r[i]);
    }
  }
  for (int64_t c0 = filled; c0 < width; c0 += 16) {
    for (int64_t p = p_begin; p < whole; ++p) {
      _mm512_storeu_si512(out + p * kNr + c0, _mm512_setzero_si512());
    }
  }
  for (int64_t p = std::max(whole, p_begin); p < pairs; ++p) {
    for (int64_t j = 0; j < width; ++j) {
      const uint16_t* e = j < cols ? col[j] + 2 * p : nullptr;
      out[p * kNr + j] = e == nullptr ? 0u : (2 * p + 1 < K ? pair_at(e) : uint32_t(e[0]));
    }
  }
}

// out [K, M] = x^T for x [M, K], 16-bit elements copied bit for bit (rows strided, columns
// contiguous on both sides). Blocks of 32 x 32: x's rows 2i and 2i + 1 interleaved into
// 32-bit words (interleave_rows), then two 16 x 16 word transposes, whose rows are
// 32 consecutive elements of an output row; tails element by element. ATen's strided copy
// transposes 16-bit elements at 1-4 GB/s on the Xeons measured (the weight gradients'
// row-major copy of their operand, grouped_mm.transposed_copy).
TORCH_MOE_GEMM_TARGET void transpose16_rows(const uint16_t* x, int64_t ldx, int64_t m0,
                                            int64_t m1, int64_t K, uint16_t* out,
                                            int64_t ldo) {
  const int64_t k_whole = K / 32 * 32;
  int64_t m = m0;
  for (; m + 32 <= m1; m += 32) {
    for (int64_t k = 0; k < k_whole; k += 32) {
      __m512i lo[16], hi[16];  // words of columns k..k+15, k+16..k+31 for row pairs
      for (int i = 0; i < 16; ++i) {
        const __m512i r0 = _mm512_loadu_si512(x + (m + 2 * i) * ldx + k);
        const __m512i r1 = _mm512_loadu_si512(x + (m + 2 * i + 1) * ldx + k);
        interleave_rows(r0, r1, lo[i], hi[i]);
      }
      transpose_16x16(lo);
      transpose_16x16(hi);
      for (int c = 0; c < 16; ++c) {
        _mm512_storeu_si512(out + (k + c) * ldo + m, lo[c]);
        _mm512_storeu_si512(out + (k + 16 + c) * ldo + m, hi[c]);
      }
    }
    for (int64_t k = k_whole; k < K; ++k) {
      for (int64_t r = m; r < m + 32; ++r) out[k * ldo + r] = x[r * ldx + k];
    }
  }
  for (; m < m1; ++m) {
    for (int64_t k = 0; k < K; ++k) out[k * ldo + m] = x[m * ldx + k];
  }
}

// One k pair: acc[r][v] += a's pair of row r (at rows[r] + off; only its first element,
// paired with zero, where kHalf) times the panel's pair row w.
template <int R, bool kHalf>
TORCH_MOE_GEMM_INLINE void step(const uint16_t* const* rows, int64_t off, const uint32_t* w,
                                __m512 (&acc)[R][4]) {
  const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w);
  const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w + 16);
  const __m512bh b2 = (__m512bh)_mm512_loadu_si512(w + 32);
  const __m512bh b3 = (__m512bh)_mm512_loadu_si512(w + 48);
  for (int r = 0; r < R; ++r) {
    const uint32_t v = kHalf ? uint32_t(rows[r][off]) : pair_at(rows[r] + off);
    const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
    acc[r][2] = _mm512_dpbf16_ps(acc[r][2], x, b2);
    acc[r][3] = _mm512_dpbf16_ps(acc[r][3], x, b3);
  }
}

// c[r][0..cols) = sum over k of a's rows r < R (row r's pair p at rows[r] + p * ks) times
// the panel (cols <= 64): K's pairs in blocks of kKBlock, each summed from zero and added
// to the running sums in order; an odd K's last pair is (a[r][K - 1], 0), read as its one
// element (a row-major a has no element K). One rounding into a bf16 c; an fp32 c takes
// the sums as they are.
//
// With kScaled (BlockScales, header: the FP8 emulation's blockwise GEMMs), K's pairs are
// taken in the scales' blocks instead, and each block's sums are multiplied by the
// product of its row's and its column's scale and added to the running sums by one fused
// multiply-add (sc's row scales of rows m.., column scales of columns n0..).
template <int R, class Out, bool kScaled>
TORCH_MOE_GEMM_TARGET void tile(const uint16_t* const* rows, int64_t ks, const uint32_t* panel,
                                int64_t K, Out* c, int64_t ldc, int64_t cols, bool stream,
                                const BlockScales* sc, int64_t m, int64_t n0) {
  const int64_t pairs = (K + 1) / 2, whole = K / 2;
  const int64_t kblock = kScaled ? sc->pairs : kKBlock;
  const uint16_t* rp[R];  // the row pointers in registers, not re-read per k pair
  for (int r = 0; r < R; ++r) rp[r] = rows[r];
  __m512 sum[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) sum[r][v] = _mm512_setzero_ps();
  for (int64_t p0 = 0, kb = 0; p0 < pairs; p0 += kblock, ++kb) {
    const int64_t p1 = std::min(pairs, p0 + kblock);
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t p = p0; p < std::min(p1, whole); ++p) step<R, false>(rp, p * ks, panel + p * kNr, acc);
    if (p1 > whole) step<R, true>(rp, whole * ks, panel + whole * kNr, acc);
    if constexpr (kScaled) {
      const float* col = sc->col + kb * sc->col_kb + n0;
      for (int r = 0; r < R; ++r) {
        const __m512 rs = _mm512_set1_ps(sc->row[(m + r) * sc->row_m + kb * sc->row_kb]);
        for (int v = 0; v < 4; ++v) {
          const __m512 scale = _mm512_mul_ps(rs, _mm512_loadu_ps(col + 16 * v));
          sum[r][v] = _mm512_fmadd_ps(acc[r][v], scale, sum[r][v]);
        }
      }
    } else {
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < 4; ++v) sum[r][v] = p0 == 0 ? acc[r][v] : _mm512_add_ps(sum[r][v], acc[r][v]);
    }
  }
  if constexpr (std::is_same_v<Out, float>) {
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 4 && 16 * v < cols; ++v) {
        const int64_t n = cols - 16 * v;
        _mm512_mask_storeu_ps(c + r * ldc + 16 * v,
                              n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1), sum[r][v]);
      }
    }
  } else {
    for (int r = 0; r < R; ++r) {
      int v = 0;
      for (; v < 4 && 16 * v + 32 <= cols; v += 2) {  // whole lines of 32 columns
        store_line(c + r * ldc + 16 * v, (__m256i)_mm512_cvtneps_pbh(sum[r][v]),
                   (__m256i)_mm512_cvtneps_pbh(sum[r][v + 1]), stream);
      }
      for (; v < 4 && 16 * v < cols; ++v) {
        store_16(c + r * ldc + 16 * v, (__m256i)_mm512_cvtneps_pbh(sum[r][v]), cols - 16 * v);
      }
    }
  }
}

template <class Out, bool kScaled>
TORCH_MOE_GEMM_TARGET void tile_rows(int rows, const uint16_t* const* a, int64_t ks,
                                     const uint32_t* panel, int64_t K, Out* c, int64_t ldc,
                                     int64_t cols, bool stream, const BlockScales* sc,
                                     int64_t m, int64_t n0) {
  switch (rows) {
    case 6: tile<6, Out, kScaled>(a, ks, panel, K, c, ldc, cols, stream, sc, m, n0); break;
    case 5: tile<5, Out, kScaled>(a, ks, panel, K, c, ldc, cols, stream, sc, m, n0); break;
    case 4: tile<4, Out, kScaled>(a, ks, panel, K, c, ldc, cols, stream, sc, m, n0); break;
    case 3: tile<3, Out, kScaled>(a, ks, panel, K, c, ldc, cols, stream, sc, m, n0); break;
    case 2: tile<2, Out, kScaled>(a, ks, panel, K, c, ldc, cols, stream, sc, m, n0); break;
    case 1: tile<1, Out, kScaled>(a, ks, panel, K, c, ldc, cols, stream, sc, m, n0); break;
    default: break;
  }
}

// The operand b: its panel of columns [n0, n0 + cols) into out.
struct BOperand {
  RowSource rows;  // row-major b's rows (gathered or not)
  bool col_major;  // else column-major: column j's K elements at rows.base + j * rows.ld
  int64_t K;
  // pairs [p_begin, p_end) of the panel (p_begin a multiple of 16)
  TORCH_MOE_GEMM_TARGET void pack(int64_t n0, int64_t cols, uint32_t* out, int64_t p_begin = 0,
                                  int64_t p_end = INT64_MAX) const {
    if (col_major) {
      pack_col_pairs(rows, n0, K, cols, out, p_begin, p_end);
    } else {
      pack_row_pairs(rows, n0, K, cols, out, kNr, p_begin, p_end);
    }
  }
};

// A thread's packing buffers for gemm, kept between calls and shared by its output types.
struct GemmScratch {
  std::vector<uint32_t> panels, a_packed;
  std::vector<const uint16_t*> row_ptrs;
};

GemmScratch& gemm_scratch() {
  thread_local GemmScratch scratch;
  return scratch;
}

// c [M, N] = a @ b: a's rows from `a` (row-major: a's rows; column-major: the rows of a^T,
// [K, M], packed here), b as BOperand; c bf16, or fp32 (the sums unrounded); sc: the
// block scales (tile's kScaled) or none.
template <class Out>
TORCH_MOE_GEMM_TARGET void gemm(const RowSource& a, bool a_col_major, const BOperand& b, Out* c,
                                int64_t ldc, int64_t M, int64_t N, int64_t K, bool stream,
                                const BlockScales* sc = nullptr) {
  GemmScratch& scratch = gemm_scratch();
  std::vector<uint32_t>&panels = scratch.panels, &a_packed = scratch.a_packed;
  std::vector<const uint16_t*>& row_ptrs = scratch.row_ptrs;
  const int64_t pairs = (K + 1) / 2, panel_words = pairs * kNr, n_panels = (N + kNr - 1) / kNr;
  // a's row m: its pair p at row_ptrs[m] + p * ks
  const uint16_t** const row_p = aligned_scratch(row_ptrs, M);  // (the address: once)
  int64_t ks = 2;
  if (a_col_major) {  // a^T [K, M]: its pairs of rows interleaved, [pairs, lp] words
    const int64_t lp = (M + kNr - 1) / kNr * kNr;
    uint32_t* const a_packed_p = aligned_scratch(a_packed, pairs * lp);
    for (int64_t m0 = 0; m0 < M; m0 += kNr) {
      pack_row_pairs(a, m0, K, std::min(kNr, M - m0), a_packed_p + m0, lp);
    }
    const auto* packed = reinterpret_cast<const uint16_t*>(a_packed_p);
    for (int64_t m = 0; m < M; ++m) row_p[m] = packed + 2 * m;
    ks = 2 * lp;
  } else {
    for (int64_t m = 0; m < M; ++m) row_p[m] = a.row(m);
  }
  // passes of near-equal rows (whole tiles), each at most a_block_bytes() of a
  const int64_t block = pass_rows(M, 2 * K, kMr);
  const bool one_pass = block >= M;  // then each panel is packed just before its tiles
  const int64_t held = one_pass ? 1 : n_panels;
  uint32_t* const panels_p = aligned_scratch(panels, held * panel_words);
  if (!one_pass) {
    for (int64_t q = 0; q < n_panels; ++q) {
      b.pack(q * kNr, std::min(kNr, N - q * kNr), panels_p + q * panel_words);
    }
  }
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    for (int64_t q = 0; q < n_panels; ++q) {
      const int64_t n0 = q * kNr, cols = std::min(kNr, N - n0);
      uint32_t* panel = panels_p + (one_pass ? 0 : q * panel_words);
      if (one_pass) b.pack(n0, cols, panel);
      for (int64_t m = m0; m < m1; m += kMr) {
        const int rows = static_cast<int>(std::min<int64_t>(kMr, m1 - m));
        if (sc != nullptr) {
          tile_rows<Out, true>(rows, row_p + m, ks, panel, K, c + m * ldc + n0, ldc, cols,
                               stream, sc, m, n0);
        } else {
          tile_rows<Out, false>(rows, row_p + m, ks, panel, K, c + m * ldc + n0, ldc, cols,
                                stream, nullptr, m, n0);
        }
      }
    }
  }
}


// ---- The AMX micro-kernel (CPUs with AMX-BF16: Sapphire Rapids and later) ----
//
// Where bf16_gemm_use_amx turned it on (grouped_mm._decide_native_gemm: the ISA is AMX).
// A tile register holds 16 rows of 64 bytes; tdpbf16ps adds to a 16 x 16 fp32 tile c the
// products of a 16 x 32 bf16 tile of a (rows, k) and a tile of b in the pair layout of
// the panels above ([16 pairs, 16 columns] of 32-bit words): a panel of 64 columns holds
// four such tiles side by side at every 16 pairs, read in place (stride 256 bytes). The
// output is taken in blocks of 32 rows x 32 columns: four c tiles, two a tiles and two b
// tiles (the eight tile registers), each c tile summing its K from zero in 32-k steps in
// order of k (one tdpbf16ps each; the hardware adds a step's 32 products together before
// adding them to the running fp32 sum), then rounded to bf16 once.
//
// amx_gemm: a row-major a that is not gathered is read in place (whole 32-k steps; a last
// partial block of 32 rows and every other a is packed into tiles of 16 rows x 32 k, zero
// past M and K: gathered rows copied, a column-major a by 16 x 16 transposes of the pairs
// of a^T's rows, 32 columns per row load). b's panels are packed as above: a row-major b's
// all at once, four pairs of rows at a time (pack_row_pairs_across: each row read once,
// in order); a column-major b's panel q + 1 in slices between panel q's output blocks in
// the first pass over the rows (the pack's loads then overlap the tile products), later
// passes reusing them. (Packing a row-major b's panels so, strips of 128 bytes of every
// row, left the weight's rows to memory latency; chunks of a row-major b's panels packed
// while the previous chunk's products run, or the next expert's weight prefetched during
// this one's, measured no faster on the AMX Xeon: benchmarks/results/cpu_floor_cpu_202612.md.)
//
// Both forms store each 32 x 32 output block (rounded from the fp32 tiles) while the next
// block's tile products run (amx_gemm: two sum buffers in turn; amx_gemm_bt: its group's),
// so that the rounding and the stores overlap the products instead of following them.
//
// amx_gemm_bt, for x @ w^T (b column-major, a row-major): computed as c^T = w @ a^T, the
// weight's rows read in place as the first operand (the weight, the largest operand, is
// never copied), a's rows packed into panels as the second, each c tile transposed on its
// way out; K in chunks of 256 over groups of blocks (tile_group, below), the running sums
// kept in fp32 between chunks: the same products in the same order, so the same bits as
// amx_gemm's.
//
// Bits depend on K only (not on M, N, the layouts, the formulation or a thread's share)
// and are not the AVX512-BF16 micro-kernel's (which sums blocks of 512 k apart); on the
// Xeon measured they are also oneDNN's AMX GEMM's for K <= 1024.
//
// Speed (one thread, benchmarks/results/cpu_floor_cpu_202612.md, thirty-seventh to
// fortieth sessions): at or above oneDNN's for x @ w^T, the weight gradients and the
// 32- and 64-expert layers' dh @ w, about 0.85x of it for a large row-major weight (dh @
// w at an E8 expert, K = 3584: its 7 MB pack per call is not hidden), so the probe
// decides per GEMM kind and size class (gemm_kernel:bf16:<kind>:r<rows>:k<K>:n<N>).

#define TORCH_MOE_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

// tile loads and stores declared as reading / writing memory (GCC's own macros declare
// no memory operand, so a packing store could move past the load that reads it)
#define TORCH_MOE_TILE_LOAD(t, base, stride)                               \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void*)(base)), \
                   "r"((long)(stride))                                      \
                   : "memory")
#define TORCH_MOE_TILE_STORE(t, base, stride)                              \
  __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void*)(base)), \
                   "r"((long)(stride))                                      \
                   : "memory")

constexpr int64_t kTm = 16;  // rows per tile
constexpr int64_t kTk = 32;  // k per a tile (16 pairs)

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 as 16 rows of 64 bytes, for this thread. (GCC's _tile_loadconfig declares
// only the config's first 8 bytes as read, so the compiler may drop the stores of the
// rest: the asm here reads the whole 64-byte object.)
inline void load_tile_config() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = kTm;
      c.colsb[t] = 64;
    }
    return c;
  }();
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

#define TORCH_MOE_AMX_INLINE TORCH_MOE_AMX_TARGET inline __attribute__((always_inline))

// Lines of memory fetched into L2 (prefetcht1) a few at a time: `rows` rows of `bytes`
// bytes, `ld` bytes apart, from base, in order, an equal share per call of step() over
// `steps` calls (one per 32-k step of tile products: the fetches go out among the tile
// loads, not in bursts that would fill the line fill buffers the tile loads wait on).
// None where the share would pass kMaxLinesPerStep lines (a few rows' GEMM, whose steps
// are too few to spread the lines over: its weight streams at the memory's rate anyway).
class Prefetcher {
 public:
  static constexpr int64_t kMaxLinesPerStep = 8;
  Prefetcher() = default;
  Prefetcher(const void* base, int64_t rows, int64_t bytes, int64_t ld, int64_t steps) {
    if (base == nullptr || rows <= 0 || bytes <= 0 || steps <= 0) return;
    const auto start = reinterpret_cast<uintptr_t>(base);
    row_lines_ = static_cast<int64_t>((start & 63) + bytes + 63) / 64;
    per_step_ = (rows * row_lines_ + steps - 1) / steps;
    if (per_step_ > kMaxLinesPerStep) return;
    line_ = reinterpret_cast<const char*>(start & ~uintptr_t{63});
    rows_ = rows;
    ld_ = ld;
  }
  inline __attribute__((always_inline)) void step() {
    for (int64_t i = 0; i < per_step_ && rows_ > 0; ++i) {
      _mm_prefetch(line_ + 64 * at_, _MM_HINT_T1);
      if (++at_ == row_lines_) {
        at_ = 0;
        line_ += ld_;
        --rows_;
      }
    }
  }

 private:
  const char* line_ = nullptr;  // the current row's first line
  int64_t row_lines_ = 0, per_step_ = 0, rows_ = 0, ld_ = 0, at_ = 0;
};

// The output block of 32 rows x 32 columns in four c tiles, summed over kt 32-k steps onto
// acc (rows of c, fp32: the sums of the steps before; zero where !accumulate): a's two row
// tiles at a0 and a1 (a_stride bytes between their rows, a_step elements per step), b's
// two column tiles at b and b + 16 words (b_stride bytes between pair rows, b_step words
// per step). `between` runs once the products are issued (they go on while it runs); then
// the tiles are stored into acc; `ahead` (if any) fetches its share of lines per step.
// With kB = 1 only b's first column tile: the block's first 16 columns (acc's others not
// read or written), each the same sums as with two.
// The fp32 sums stored and loaded again between calls are exact: a block summed in
// several calls has the bits of one call over all its steps.
template <int kB = 2, class Between>
TORCH_MOE_AMX_INLINE void tile_block(const uint16_t* a0, const uint16_t* a1, int64_t a_stride,
                                     int64_t a_step, const uint32_t* b, int64_t b_stride,
                                     int64_t b_step, int64_t kt, bool accumulate,
                                     float (&acc)[2 * kTm][32], Prefetcher* ahead,
                                     Between&& between) {
  static_assert(kB == 1 || kB == 2, "one or two column tiles");
  if (accumulate) {
    TORCH_MOE_TILE_LOAD(0, &acc[0][0], 128);
    TORCH_MOE_TILE_LOAD(2, &acc[kTm][0], 128);
    if constexpr (kB == 2) {
      TORCH_MOE_TILE_LOAD(1, &acc[0][16], 128);
      TORCH_MOE_TILE_LOAD(3, &acc[kTm][16], 128);
    }
  } else {
    _tile_zero(0);
    _tile_zero(2);
    if constexpr (kB == 2) {
      _tile_zero(1);
      _tile_zero(3);
    }
  }
  for (int64_t kb = 0; kb < kt; ++kb) {
    TORCH_MOE_TILE_LOAD(4, a0 + kb * a_step, a_stride);
    TORCH_MOE_TILE_LOAD(6, b + kb * b_step, b_stride);
    if constexpr (kB == 2) TORCH_MOE_TILE_LOAD(7, b + kb * b_step + 16, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kB == 2) _tile_dpbf16ps(1, 4, 7);
    TORCH_MOE_TILE_LOAD(5, a1 + kb * a_step, a_stride);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (kB == 2) _tile_dpbf16ps(3, 5, 7);
    if (ahead != nullptr) ahead->step();
  }
  between();
  TORCH_MOE_TILE_STORE(0, &acc[0][0], 128);
  TORCH_MOE_TILE_STORE(2, &acc[kTm][0], 128);
  if constexpr (kB == 2) {
    TORCH_MOE_TILE_STORE(1, &acc[0][16], 128);
    TORCH_MOE_TILE_STORE(3, &acc[kTm][16], 128);
  }
}

// A block of c: rows [row, row + rows) and columns [col, col + cols), at most 32 x 32.
struct OutBlock {
  int64_t row, col, rows, cols;
};

// amx_gemm_bt's blocks of c^T: kGroup blocks of 32 columns (of b: 32 of x's rows each)
// share each chunk of kChunkSteps 32-k steps of the first operand's 32 rows (256 k: 16
// KB of the weight's rows), their fp32 sums kept in L1 between chunks (kGroup x 4 KB).
// The weight's tiles are then read from memory or L2 by a group's first block only, from
// L1 by the others. (A block summed over all of K at once reads a 32 x K strip of the
// weight, 64 KB at K = 1024, more than L1 holds: every block's tiles of both operands
// came from L2, 4 KB per four tile products. On the AMX Xeon measured, one thread: the
// tile loop alone 2.0 TFLOP/s with both operands in L1; x @ w13^T of an 8-expert layer's
// expert 6-7% faster so, a @ w2^T 1-10%. The same chunks in amx_gemm measured 2-10%
// slower there, which keeps whole-K blocks: benchmarks/results/cpu_floor_cpu_202612.md.)
constexpr int kGroup = 3;
constexpr int64_t kChunkSteps = 8;

// A finished block's sums (its c block), stored by the next tile_block's `between`.
struct Pending {
  const float (*acc)[2 * kTm][32] = nullptr;
  OutBlock out{};
};

// The blocks out[0..n) of c (n <= kGroup) of one block of 32 rows of a (a0, a1, a_stride,
// a_step as tile_block's), block j's b tiles at b[j] (its first 16 columns only where
// narrow[j]), b_stride and b_step as tile_block's: K in chunks of kChunkSteps steps, each
// chunk over all n blocks (their sums in sums[j]). Each finished block is stored by
// store(acc, out) while the next block's products run (`pending`: the caller's, carried
// from group to group; it calls store on the last one); `ahead` as tile_block's.
template <class Store>
TORCH_MOE_AMX_INLINE void tile_group(const uint16_t* a0, const uint16_t* a1, int64_t a_stride,
                                     int64_t a_step, int n, const uint32_t* const* b,
                                     const bool* narrow, int64_t b_stride, int64_t b_step,
                                     int64_t kt, float (*sums)[2 * kTm][32],
                                     const OutBlock* out, Pending& pending, Prefetcher& ahead,
                                     Store&& store) {
  auto between = [&] {
    if (pending.acc != nullptr) store(*pending.acc, pending.out);
    pending.acc = nullptr;
  };
  const int64_t chunk = n > 1 ? kChunkSteps : kt;  // (one block: nothing to share)
  for (int64_t k0 = 0; k0 < kt; k0 += chunk) {
    const int64_t steps = std::min(chunk, kt - k0);
    const uint16_t* ak0 = a0 + k0 * a_step;
    const uint16_t* ak1 = a1 + k0 * a_step;
    for (int j = 0; j < n; ++j) {
      const uint32_t* bk = b[j] + k0 * b_step;
      if (narrow[j]) {
        tile_block<1>(ak0, ak1, a_stride, a_step, bk, b_stride, b_step, steps, k0 > 0, sums[j],
                      &ahead, between);
      } else {
        tile_block(ak0, ak1, a_stride, a_step, bk, b_stride, b_step, steps, k0 > 0, sums[j],
                   &ahead, between);
      }
      if (k0 + steps == kt) pending = {&sums[j], out[j]};
    }
  }
}

// a's tiles: tile (mb, kb) at out + (mb * kt + kb) * kTm * kTk, rows of 32 bf16.
TORCH_MOE_GEMM_TARGET void pack_a_tiles_rows(const RowSource& a, int64_t M, int64_t K,
                                             int64_t mt, int64_t kt, uint16_t* out) {
  for (int64_t m = 0; m < mt * kTm; ++m) {
    const uint16_t* r = m < M ? a.row(m) : nullptr;
    uint16_t* o = out + (m / kTm) * kt * kTm * kTk + (m % kTm) * kTk;
    for (int64_t kb = 0; kb < kt; ++kb, o += kTm * kTk) {
      const int64_t left = r ? std::min<int64_t>(kTk, K - kb * kTk) : 0;
      const __m512i v = left == kTk ? _mm512_loadu_si512(r + kb * kTk)
                                    : _mm512_maskz_loadu_epi16(
                                          static_cast<__mmask32>((uint64_t(1) << left) - 1),
                                          left > 0 ? r + kb * kTk : r);
      _mm512_storeu_si512(o, v);
    }
  }
}

// Tiles mb and mb + 1 (32 columns of a^T's rows) at k block kb (pack_a_tiles_cols).
TORCH_MOE_GEMM_TARGET void pack_two_tiles(const RowSource& at, int64_t K, int64_t kt, int64_t mb,
                                        int64_t kb, uint16_t* out) {
  const int64_t m0 = mb * kTm;
  __m512i lo[16], hi[16];  // pairs of columns m0.. and m0 + 16..
  for (int i = 0; i < 16; ++i) {
    const int64_t k = kb * kTk + 2 * i;
    const __m512i x = k < K ? _mm512_loadu_si512(at.row(k) + m0) : _mm512_setzero_si512();
    const __m512i y =
        k + 1 < K ? _mm512_loadu_si512(at.row(k + 1) + m0) : _mm512_setzero_si512();
    interleave_rows(x, y, lo[i], hi[i]);
  }
  transpose_16x16(lo);
  transpose_16x16(hi);
  uint16_t* o = out + (mb * kt + kb) * kTm * kTk;
  for (int j = 0; j < 16; ++j) {
    _mm512_storeu_si512(o + j * kTk, lo[j]);
    _mm512_storeu_si512(o + kt * kTm * kTk + j * kTk, hi[j]);
  }
}

// A column-major a: a^T's rows (k) from `at`, [K, M]; 16 pairs of rows x 32 columns at a
// time (one 64-byte load per row: two tiles' columns), interleaved into words and
// transposed into 16 rows of each of two tiles, k block by k block (each of a^T's rows
// read from its start to its end, 32 rows at a time); a last odd tile or one past M, 16
// columns (masked). (16 columns per load made the weight gradients' pack of their
// gathered a^T rows a third slower: the 64-expert layer's dW2 17.4 -> 14.6 ms on one
// thread of the AMX Xeon; tile by tile, each a strip of 64 bytes of every row, the
// 8-expert layer's dW13 48 -> 43 ms: benchmarks/results/cpu_floor_cpu_202612.md.)
TORCH_MOE_GEMM_TARGET void pack_a_tiles_cols(const RowSource& at, int64_t M, int64_t K,
                                             int64_t mt, int64_t kt, uint16_t* out) {
  const int64_t pairs_end = M / (2 * kTm) * 2;  // tiles packed two at a time
  for (int64_t kb = 0; kb < kt; ++kb) {  // 32 rows of a^T at a time, read from end to end
    for (int64_t mb = 0; mb < pairs_end; mb += 2) pack_two_tiles(at, K, kt, mb, kb, out);
  }
  for (int64_t mb = pairs_end; mb < mt; ++mb) {
    const int64_t m0 = mb * kTm, cols = std::clamp<int64_t>(M - m0, 0, kTm);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    for (int64_t kb = 0; kb < kt; ++kb) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t k = kb * kTk + 2 * i;
        const __m256i x = k < K && cols > 0 ? _mm256_maskz_loadu_epi16(mask, at.row(k) + m0)
                                            : _mm256_setzero_si256();
        const __m256i y = k + 1 < K && cols > 0
                              ? _mm256_maskz_loadu_epi16(mask, at.row(k + 1) + m0)
                              : _mm256_setzero_si256();
        r[i] = _mm512_or_si512(_mm512_cvtepu16_epi32(x),
                               _mm512_slli_epi32(_mm512_cvtepu16_epi32(y), 16));
      }
      transpose_16x16(r);
      uint16_t* o = out + (mb * kt + kb) * kTm * kTk;
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(o + j * kTk, r[j]);
    }
  }
}

// A block of c's tiles (acc[m][n], rows x cols, at most 32 x 32) rounded into c (its first
// element at c).
TORCH_MOE_GEMM_TARGET void store_acc(const float (&acc)[2 * kTm][32], uint16_t* c, int64_t ldc,
                                     int64_t rows, int64_t cols, bool stream) {
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* o = c + r * ldc;
    if (cols == 32) {
      store_line(o, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(&acc[r][0])),
                 (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(&acc[r][16])), stream);
      continue;
    }
    for (int64_t v = 0; v < cols; v += 16) {
      store_16(o + v, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(&acc[r][v])), cols - v);
    }
  }
}

// c [M, N] = a @ b by AMX tiles (see above).
TORCH_MOE_AMX_TARGET void amx_gemm(const RowSource& a, bool a_col_major, const BOperand& b,
                                   uint16_t* c, int64_t ldc, int64_t M, int64_t N, int64_t K,
                                   bool stream) {
  thread_local std::vector<uint32_t> panels;
  thread_local std::vector<uint16_t> a_tiles;
  const int64_t kt = (K + kTk - 1) / kTk, pairs = kt * (kTk / 2);
  const int64_t panel_words = pairs * kNr, n_panels = (N + kNr - 1) / kNr;
  // passes over the rows: multiples of 32 rows, each at most a_block_bytes() of a
  const int64_t block = pass_rows(M, 2 * kt * kTk, 2 * kTm);
  // b's panels: a row-major b's all packed first, four pairs of rows at a time; a
  // column-major b's in two buffers in turn where the rows take one pass, else all kept
  const bool rows_first = !b.col_major;
  const bool one_pass = block >= M && !rows_first;
  const int64_t held = one_pass ? 2 : n_panels;
  uint32_t* const panels_p = aligned_scratch(panels, held * panel_words);  // (once)
  // a row-major a, not gathered, whole 32-k steps: its tiles read in place, all but a
  // last partial block of 32 rows (packed, with zero rows); else all of a packed
  const bool in_place = !a_col_major && a.index == nullptr && K % kTk == 0;
  const int64_t m_place = in_place ? M / (2 * kTm) * (2 * kTm) : 0;
  const int64_t mt = (M - m_place + 2 * kTm - 1) / (2 * kTm) * 2;  // packed row tiles
  uint16_t* const a_tiles_p = aligned_scratch(a_tiles, mt * kt * kTm * kTk);
  if (a_col_major) {
    pack_a_tiles_cols(a, M, K, mt, kt, a_tiles_p);
  } else if (mt > 0) {
    const RowSource rest{a.index ? a.base : a.base + m_place * a.ld, a.ld,
                         a.index ? a.index + m_place : nullptr, a.zero};
    pack_a_tiles_rows(rest, M - m_place, K, mt, kt, a_tiles_p);
  }
  // pairs [p0, p1) of panel q (past K's pairs: zeros)
  auto pack_panel = [&](int64_t q, int64_t p0, int64_t p1) {
    uint32_t* out = panels_p + (one_pass ? q & 1 : q) * panel_words;
    const int64_t packed = (K + 1) / 2;
    if (p0 < std::min(p1, packed)) {
      b.pack(q * kNr, std::min(kNr, N - q * kNr), out, p0, std::min(p1, packed));
    }
    const int64_t z0 = std::max(p0, packed);
    if (p1 > z0) std::memset(out + z0 * kNr, 0, (p1 - z0) * kNr * 4);
  };
  if (rows_first) {
    pack_row_pairs_across(b.rows, K, N, pairs, panels_p, panel_words);
  } else {
    pack_panel(0, 0, pairs);
  }
  // a column-major b: in the first pass, panel q + 1 is packed in slices (multiples of 16
  // pairs) while the products of panel q run, one slice per output block
  const int64_t first_blocks = (std::min(M, block) + 2 * kTm - 1) / (2 * kTm) * 2;
  const int64_t slice = ((kt + first_blocks - 1) / first_blocks) * 16;
  load_tile_config();
  // each block of c stored while the next block's products run (two sum buffers in turn)
  alignas(64) float accs[2][2 * kTm][32];
  OutBlock done{0, 0, 0, 0};  // in accs[cur ^ 1], not stored yet (none while rows is 0)
  int cur = 0;
  auto store_done = [&] {
    store_acc(accs[cur ^ 1], c + done.row * ldc + done.col, ldc, done.rows, done.cols, stream);
  };
  const int64_t tile_elems = kTm * kTk;
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    for (int64_t q = 0; q < n_panels; ++q) {
      const int64_t n0 = q * kNr;
      const uint32_t* panel = panels_p + (one_pass ? q & 1 : q) * panel_words;
      int64_t next_p = (one_pass || m0 == 0) && q + 1 < n_panels && !rows_first ? 0 : pairs;
      for (int64_t m = m0; m < m1; m += 2 * kTm) {
        const uint16_t *a0, *a1;
        int64_t a_stride, a_step;  // bytes between a tile's rows, elements per k step
        if (m < m_place) {
          a0 = a.base + m * a.ld;
          a1 = a0 + kTm * a.ld;
          a_stride = a.ld * 2;
          a_step = kTk;
        } else {
          a0 = a_tiles_p + ((m - m_place) / kTm) * kt * tile_elems;
          a1 = a0 + kt * tile_elems;
          a_stride = kTk * 2;
          a_step = tile_elems;
        }
        for (int64_t h = 0; h < kNr && n0 + h < N; h += 32) {
          const uint32_t* bh = panel + h;
          tile_block(a0, a1, a_stride, a_step, bh, kNr * 4, 16 * kNr, kt, false, accs[cur],
                     nullptr, [&] {
            if (next_p < pairs) {  // (while the tile products run)
              pack_panel(q + 1, next_p, std::min(pairs, next_p + slice));
              next_p += slice;
            }
            if (done.rows > 0) store_done();
          });
          done = {m, n0 + h, std::min<int64_t>(2 * kTm, m1 - m), std::min<int64_t>(32, N - n0 - h)};
          cur ^= 1;
        }
      }
      if (next_p < pairs) pack_panel(q + 1, next_p, pairs);
    }
  }
  if (done.rows > 0) store_done();
  _tile_release();
}


// A block of c^T's tiles (acc[n][m]: c's columns n < cols by its rows m < rows, at most
// 32 x 32) transposed into c (its block's first element at c): rounded to bf16 (Out
// uint16_t; whole lines streamed where `stream`) or the fp32 sums as they are (Out float).
template <class Out>
TORCH_MOE_GEMM_TARGET void store_acc_t(const float (&acc)[2 * kTm][32], Out* c, int64_t ldc,
                                       int64_t mrows, int64_t ncols, bool stream) {
  for (int64_t mb = 0; mb < mrows && ncols == 32; mb += 16) {  // whole rows of the block
    __m512i lo[16], hi[16];  // columns 0-15 and 16-31 of rows mb..mb+15
    for (int i = 0; i < 16; ++i) {
      lo[i] = _mm512_load_si512(&acc[i][mb]);
      hi[i] = _mm512_load_si512(&acc[16 + i][mb]);
    }
    transpose_16x16(lo);
    transpose_16x16(hi);
    for (int64_t j = 0; j < std::min<int64_t>(16, mrows - mb); ++j) {
      Out* o = c + (mb + j) * ldc;
      if constexpr (std::is_same_v<Out, float>) {
        _mm512_storeu_si512(o, lo[j]);
        _mm512_storeu_si512(o + 16, hi[j]);
      } else {
        store_line(o, (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(lo[j])),
                   (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(hi[j])), stream);
      }
    }
  }
  for (int64_t mb = 0; mb < mrows && ncols < 32; mb += 16) {
    for (int64_t nb = 0; nb < ncols; nb += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(&acc[nb + i][mb]);
      transpose_16x16(r);
      const int64_t left = ncols - nb;
      const auto mask = static_cast<__mmask16>(left >= 16 ? 0xffffu : (1u << left) - 1);
      for (int64_t j = 0; j < std::min<int64_t>(16, mrows - mb); ++j) {
        Out* o = c + (mb + j) * ldc + nb;
        if constexpr (std::is_same_v<Out, float>) {
          _mm512_mask_storeu_ps(o, mask, _mm512_castsi512_ps(r[j]));
        } else {
          _mm256_mask_storeu_epi16(o, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[j])));
        }
      }
    }
  }
}

// c [M, N] = a @ b for a column-major b that is not gathered (b^T = w, [N, K] row-major:
// x @ w^T), computed as c^T = w @ a^T: w's rows are the tiles' first operand, read in
// place (the weight is not copied), a's rows packed into pair panels as the second
// operand (a's pair p of row m is one 32-bit word already: 16 x 16 transposes); each c
// tile is transposed on its way out. The same products summed in the same order as
// amx_gemm's: the same bits. While the products of 32 of w's rows run, its next 32 rows
// are fetched into L2, a few lines per step. Read in place from memory, 32 rows side by
// side 64 bytes at a time, they are 32 short streams the hardware prefetchers barely
// follow, and the tile loads waited on them: on one thread of the AMX Xeon measured, the
// 64-expert layer's x @ w13^T and a @ w2^T ran 20% faster with one weight for all
// experts (in L2) than with their own, and 4-16% faster with the rows fetched ahead
// (benchmarks/results/cpu_floor_cpu_202612.md).
template <class Out>
TORCH_MOE_AMX_TARGET void amx_gemm_bt(const RowSource& a, const RowSource& w, Out* c,
                                      int64_t ldc, int64_t M, int64_t N, int64_t K,
                                      bool stream) {
  thread_local std::vector<uint32_t> a_panels;
  thread_local std::vector<uint16_t> w_block;
  const int64_t kt = (K + kTk - 1) / kTk, pairs = kt * (kTk / 2), panel_words = pairs * kNr;
  const int64_t block = pass_rows(M, 2 * kt * kTk, kNr);
  const int64_t n_pan = block / kNr;
  // (thread_locals' addresses: once)
  uint32_t* const a_panels_p = aligned_scratch(a_panels, n_pan * panel_words);
  uint16_t* const w_block_p = aligned_scratch(w_block, 2 * kTm * kt * kTk);
  const bool direct_k = K % kTk == 0;
  load_tile_config();
  alignas(64) float sums[kGroup][2 * kTm][32];  // c^T's blocks: acc[n][m] -> c[m][n]
  Pending pending;
  auto store = [&](const float (&acc)[2 * kTm][32], const OutBlock& o) {
    store_acc_t(acc, c + o.row * ldc + o.col, ldc, o.rows, o.cols, stream);
  };
  const uint32_t* b_tiles[kGroup];
  bool narrow[kGroup];
  OutBlock outs[kGroup];
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block), used = (m1 - m0 + kNr - 1) / kNr;
    for (int64_t qi = 0; qi < used; ++qi) {
      uint32_t* panel = a_panels_p + qi * panel_words;
      const int64_t packed = (K + 1) / 2;
      // the columns the tile blocks read: 16 or 32 of a last panel's (of a few rows)
      const int64_t cols = std::min(kNr, m1 - m0 - qi * kNr);
      const int64_t width = cols <= 16 ? 16 : cols <= 32 ? 32 : kNr;
      pack_col_pairs(a, m0 + qi * kNr, K, cols, panel, 0, packed, width);
      if (pairs > packed) std::memset(panel + packed * kNr, 0, (pairs - packed) * kNr * 4);
    }
    for (int64_t n0 = 0; n0 < N; n0 += 2 * kTm) {
      const uint16_t* w0;
      int64_t ws;  // w's rows n0.. (32 of them, zero past N and K) and their stride
      if (direct_k && n0 + 2 * kTm <= N) {
        w0 = w.row(n0);
        ws = w.ld;
      } else {
        const int64_t lw = kt * kTk;
        for (int64_t r = 0; r < 2 * kTm; ++r) {
          uint16_t* o = w_block_p + r * lw;
          std::memset(o, 0, lw * 2);
          if (n0 + r < N) std::memcpy(o, w.row(n0 + r), K * 2);
        }
        w0 = w_block_p;
        ws = lw;
      }
      const int64_t ncols = std::min<int64_t>(2 * kTm, N - n0);
      // w's next 32 rows fetched into L2 over this pass's steps of these rows' products
      Prefetcher ahead;
      if (n0 + 2 * kTm < N) {
        ahead = Prefetcher(w.row(n0 + 2 * kTm), std::min(2 * kTm, N - n0 - 2 * kTm), K * 2,
                           w.ld * 2, (m1 - m0 + 31) / 32 * kt);
      }
      for (int64_t g = m0; g < m1; g += 32 * kGroup) {  // blocks of 32 of a's rows
        int n = 0;
        for (int64_t mb = g; mb < std::min(m1, g + 32 * kGroup); mb += 32, ++n) {
          b_tiles[n] = a_panels_p + ((mb - m0) / kNr) * panel_words + (mb - m0) % kNr;
          const int64_t mrows = std::min<int64_t>(32, m1 - mb);
          narrow[n] = mrows <= 16;  // a few rows' last 16: one b tile
          outs[n] = {mb, n0, mrows, ncols};
        }
        tile_group(w0, w0 + kTm * ws, ws * 2, kTk, n, b_tiles, narrow, kNr * 4, 16 * kNr, kt,
                   sums, outs, pending, ahead, store);
      }
    }
  }
  if (pending.acc != nullptr) store(*pending.acc, pending.out);
  _tile_release();
}

std::atomic<bool> amx_on{false};

// AMX-BF16 and AMX-TILE in CPUID and, on Linux, the kernel's permission for this process
// to use the tile data state (asked once; refused on kernels older than 5.16).
bool amx_usable() {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u) || !__builtin_cpu_supports("avx512bf16")) {
      return false;
    }
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return yes;
}
}  // namespace
#endif

bool bf16_gemm_available() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

bool bf16_gemm_streams(int64_t out_bytes) {
  return past_l2(out_bytes);
}

Matrix Matrix::of(const at::Tensor& t) {
  return {const_cast<void*>(t.const_data_ptr()), t.size(0), t.size(1), t.stride(0), t.stride(1),
          t.scalar_type()};
}

Matrix Matrix::of(const at::Tensor& t, int64_t i) {
  auto* p = static_cast<char*>(const_cast<void*>(t.const_data_ptr()));
  return {p + i * t.stride(0) * static_cast<int64_t>(t.element_size()), t.size(1), t.size(2),
          t.stride(1), t.stride(2), t.scalar_type()};
}

Matrix Matrix::block(int64_t r0, int64_t nr, int64_t c0, int64_t nc) const {
  const int64_t offset = (r0 * row_stride + c0 * col_stride) * at::elementSize(dtype);
  return {static_cast<char*>(data) + offset, nr, nc, row_stride, col_stride, dtype};
}

Matrix Matrix::bf16(const void* p, int64_t rows, int64_t cols, int64_t ld, bool col_major) {
  return {const_cast<void*>(p), rows, cols, col_major ? 1 : ld, col_major ? ld : 1,
          at::kBFloat16};
}

bool bf16_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, Gather a_rows,
               Gather b_rows, bool stream) {
  return bf16_gemm_scaled(out, a, b, nullptr, a_rows, b_rows, stream);
}

bool bf16_gemm(const Matrix& out, const Matrix& a, const Matrix& b, Gather a_rows,
               Gather b_rows, bool stream) {
  return bf16_gemm_scaled(out, a, b, nullptr, a_rows, b_rows, stream);
}

bool bf16_gemm_scaled(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                      const BlockScales* scales, Gather a_rows, Gather b_rows, bool stream) {
  if (a.dim() != 2 || b.dim() != 2 || out.dim() != 2) return false;
  return bf16_gemm_scaled(Matrix::of(out), Matrix::of(a), Matrix::of(b), scales, a_rows, b_rows,
                          stream);
}

bool bf16_gemm_scaled(const Matrix& out, const Matrix& a, const Matrix& b,
                      const BlockScales* scales, Gather a_rows, Gather b_rows, bool stream) {
#if defined(CPU_CAPABILITY_AVX512)
  if (!bf16_gemm_available()) return false;
  const bool fp32_out = out.dtype == at::kFloat;
  if (a.dtype != at::kBFloat16 || b.dtype != at::kBFloat16 ||
      (out.dtype != at::kBFloat16 && !fp32_out)) {
    return false;
  }
  const int64_t M = out.rows, N = out.cols;
  // a row-major (its rows read in place) or column-major (a^T's rows packed); b likewise.
  // A gathered operand's layout is the caller's (its sizes may leave it ambiguous).
  const bool a_rows_major =
      a_rows.index != nullptr ? !a_rows.transposed : a.col_stride == 1 || a.cols == 1;
  const bool b_rows_major = b_rows.index != nullptr || b.col_stride == 1 || b.cols == 1;
  const bool a_ok = a_rows_major ? a.col_stride == 1 || a.cols == 1
                                 : a.row_stride == 1 || a.rows == 1;
  const bool b_ok = b_rows_major ? b.col_stride == 1 || b.cols == 1 : b.row_stride == 1;
  if (!a_ok || !b_ok) return false;
  // the logical sizes: a gathered row-major a has M rows of the source's K columns; a
  // gathered column-major a, the source's M rows by K gathered columns
  const int64_t K = a_rows.index != nullptr && !a_rows_major ? a_rows.size : a.cols;
  const int64_t a_m = a_rows.index != nullptr && a_rows_major ? a_rows.size : a.rows;
  const int64_t b_k = b_rows.index != nullptr ? b_rows.size : b.rows;
  if (a_m != M || b_k != K || b.cols != N || (out.col_stride != 1 && N > 1)) return false;
  if (M == 0 || N == 0) return true;
  if (K == 0) {
    const int64_t item = fp32_out ? 4 : 2;
    for (int64_t m = 0; m < M; ++m) {
      std::memset(static_cast<char*>(out.data) + m * out.row_stride * item, 0, N * item);
    }
    return true;
  }
  thread_local std::vector<uint16_t> zero;  // gathered rows of index -1
  const int64_t longest = std::max({M, N, K}) + kNr;
  if (static_cast<int64_t>(zero.size()) < longest) zero.assign(longest, 0);
  const auto* ap = static_cast<const uint16_t*>(a.data);
  const auto* bp = static_cast<const uint16_t*>(b.data);
  const RowSource a_src{ap, a_rows_major ? a.row_stride : a.col_stride, a_rows.index, zero.data()};
  const RowSource b_src{bp, b_rows_major ? b.row_stride : b.col_stride, b_rows.index, zero.data()};
  const BOperand b_op{b_src, !b_rows_major, K};
  if (fp32_out) {  // the AVX512-BF16 micro-kernel's sums on every CPU (header)
    gemm(a_src, !a_rows_major, b_op, static_cast<float*>(out.data), out.row_stride, M, N, K,
         false, scales);
    return true;
  }
  auto* cp = static_cast<uint16_t*>(out.data);
  if (scales != nullptr) {  // (the AVX512-BF16 micro-kernel's, as fp32 outputs)
    gemm(a_src, !a_rows_major, b_op, cp, out.row_stride, M, N, K, stream, scales);
    if (stream) _mm_sfence();
    return true;
  }
  if (amx_on.load(std::memory_order_relaxed)) {
    if (!b_rows_major && a_rows_major) {
      amx_gemm_bt(a_src, b_src, cp, out.row_stride, M, N, K, stream);
    } else {
      amx_gemm(a_src, !a_rows_major, b_op, cp, out.row_stride, M, N, K, stream);
    }
  } else {
    gemm(a_src, !a_rows_major, b_op, cp, out.row_stride, M, N, K, stream);
  }
  if (stream) _mm_sfence();  // the streamed lines ordered before the caller's next stores
  return true;
#else
  (void)out;
  (void)a;
  (void)b;
  (void)scales;
  (void)a_rows;
  (void)b_rows;
  (void)stream;
  return false;
#endif
}

// amx_gemm_rows_bt's two outputs (bf16, fp32).
template <class Out>
static bool rows_bt(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t ldw, Out* c,
                    int64_t ldc, int64_t M, int64_t N, int64_t K) {
#if defined(CPU_CAPABILITY_AVX512)
  if (!amx_on.load(std::memory_order_relaxed)) return false;
  if (M <= 0 || N <= 0) return true;
  if (K <= 0) {
    for (int64_t m = 0; m < M; ++m) std::memset(c + m * ldc, 0, N * sizeof(Out));
    return true;
  }
  thread_local std::vector<uint16_t> zero;  // the packing's missing columns
  if (static_cast<int64_t>(zero.size()) < K + kNr) zero.assign(K + kNr, 0);
  amx_gemm_bt(RowSource{a, lda, nullptr, zero.data()}, RowSource{w, ldw, nullptr, zero.data()},
              c, ldc, M, N, K, false);
  return true;
#else
  (void)a;
  (void)lda;
  (void)w;
  (void)ldw;
  (void)c;
  (void)ldc;
  (void)M;
  (void)N;
  (void)K;
  return false;
#endif
}

bool amx_gemm_rows_bt(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t ldw,
                      uint16_t* c, int64_t ldc, int64_t M, int64_t N, int64_t K) {
  return rows_bt(a, lda, w, ldw, c, ldc, M, N, K);
}

bool amx_gemm_rows_bt(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t ldw, float* c,
                      int64_t ldc, int64_t M, int64_t N, int64_t K) {
  return rows_bt(a, lda, w, ldw, c, ldc, M, N, K);
}

bool transpose16_into(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* out,
                      int64_t ldo) {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool yes = __builtin_cpu_supports("avx512bw");
  if (!yes) return false;
  transpose16_rows(x, ldx, 0, M, K, out, ldo);
  return true;
#else
  (void)x;
  (void)ldx;
  (void)M;
  (void)K;
  (void)out;
  (void)ldo;
  return false;
#endif
}

bool bf16_gemm_use_amx(bool enable) {
#if defined(CPU_CAPABILITY_AVX512)
  const bool on = enable && amx_usable();
  amx_on.store(on);
  return on;
#else
  (void)enable;
  return false;
#endif
}

bool bf16_gemm_amx() {
#if defined(CPU_CAPABILITY_AVX512)
  return amx_on.load();
#else
  return false;
#endif
}

}  // namespace torch_moe_cpu

namespace {

bool bf16_mm(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && out.device().is_cpu(),
              "bf16_mm: CPU tensors expected");
  return torch_moe_cpu::bf16_gemm(out, a, b);
}

bool transpose16(const at::Tensor& x, at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "transpose16: CPU tensors expected");
#if defined(CPU_CAPABILITY_AVX512)
  if (!__builtin_cpu_supports("avx512bw") || x.dim() != 2 || out.dim() != 2 ||
      x.element_size() != 2 || out.scalar_type() != x.scalar_type() ||
      out.size(0) != x.size(1) || out.size(1) != x.size(0)) {
    return false;
  }
  const int64_t M = x.size(0), K = x.size(1);
  if ((x.stride(1) != 1 && K > 1) || (out.stride(1) != 1 && M > 1)) return false;
  if (M == 0 || K == 0) return true;
  const auto* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  auto* op = static_cast<uint16_t*>(out.mutable_data_ptr());
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  // blocks of 32 rows of x, shared out over the threads (each writes its own columns of out)
  const int64_t blocks = (M + 31) / 32;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    torch_moe_cpu::transpose16_rows(xp, ldx, b0 * 32, std::min(M, b1 * 32), K, op, ldo);
  });
  return true;
#else
  (void)x;
  (void)out;
  return false;
#endif
}

bool bf16_mm_available() {
  return torch_moe_cpu::bf16_gemm_available();
}

bool bf16_mm_use_amx(bool enable) {
  return torch_moe_cpu::bf16_gemm_use_amx(enable);
}

bool bf16_mm_amx() {
  return torch_moe_cpu::bf16_gemm_amx();
}

bool bf16_mm_streams(int64_t out_bytes) {
  return torch_moe_cpu::bf16_gemm_streams(out_bytes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_moe_cpu, m) {
  m.def("bf16_mm(Tensor a, Tensor b, Tensor(a!) out) -> bool");
  m.def("bf16_mm_available() -> bool", &bf16_mm_available);
  m.def("transpose16(Tensor x, Tensor(a!) out) -> bool");
  m.def("bf16_mm_use_amx(bool enable) -> bool", &bf16_mm_use_amx);
  m.def("bf16_mm_amx() -> bool", &bf16_mm_amx);
  m.def("bf16_mm_streams(int out_bytes) -> bool", &bf16_mm_streams);
}

TORCH_LIBRARY_IMPL(torch_moe_cpu, CPU, m) {
  m.impl("bf16_mm", &bf16_mm);
  m.impl("transpose16", &transpose16);
}
