// A bf16 GEMM for CPUs with AVX512-BF16 and no AMX, for the threaded grouped GEMM's pieces
// (grouped_mm_threads_cpu.cpp) where the CPU probe's gemm_kernel decision measured it
// faster than ATen's GEMM (oneDNN's bf16 matmul):
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

#include <ATen/ATen.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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
// in use and the output rows), 1 MiB where the system does not say.
int64_t a_block_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? std::max<int64_t>(64 << 10, l2 / 2) : int64_t(1) << 20;
  }();
  return bytes;
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

// Rows 2p and 2p + 1 of a [K, cols] matrix (`m`'s rows from column col0 on, cols <= 64)
// interleaved into out[p * ldo + j] = (m[2p][j], m[2p + 1][j]), for p < ceil(K / 2): an
// odd K's last row pairs with zero, as do columns cols..63.
TORCH_MOE_GEMM_TARGET void pack_row_pairs(const RowSource& m, int64_t col0, int64_t K,
                                          int64_t cols, uint32_t* out, int64_t ldo) {
  // unpack{lo,hi}_epi16 interleave within 128-bit lanes: of 32 columns, lo holds the
  // pairs of columns 0-3, 8-11, 16-19, 24-27 and hi the others; the permutes restore order
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (int64_t p = 0; 2 * p < K; ++p) {
    const uint16_t* r0 = m.row(2 * p) + col0;
    const uint16_t* r1 = 2 * p + 1 < K ? m.row(2 * p + 1) + col0 : nullptr;
    uint32_t* o = out + p * ldo;
    if (cols == kNr) {
      for (int h = 0; h < 2; ++h) {
        const __m512i x = _mm512_loadu_si512(r0 + 32 * h);
        const __m512i y = r1 ? _mm512_loadu_si512(r1 + 32 * h) : _mm512_setzero_si512();
        const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
        _mm512_storeu_si512(o + 32 * h, _mm512_permutex2var_epi64(lo, first, hi));
        _mm512_storeu_si512(o + 32 * h + 16, _mm512_permutex2var_epi64(lo, second, hi));
      }
    } else {
      for (int64_t j = 0; j < kNr; ++j) {
        const uint32_t hi = r1 && j < cols ? uint32_t(r1[j]) << 16 : 0u;
        o[j] = j < cols ? (uint32_t(r0[j]) | hi) : 0u;
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

// A column-major [K, cols] b (column j's K elements contiguous at b + j * ld; cols <= 64)
// into one panel: out[p * 64 + j] = (b[2p][j], b[2p + 1][j]) for p < ceil(K / 2), an odd
// K's last element paired with zero, columns past cols zero.
TORCH_MOE_GEMM_TARGET void pack_col_pairs(const uint16_t* b, int64_t ld, int64_t K,
                                          int64_t cols, uint32_t* out) {
  const int64_t pairs = (K + 1) / 2;
  const int64_t whole = cols == kNr ? K / 2 / 16 * 16 : 0;  // pairs by 16 x 16 transposes
  for (int64_t j0 = 0; j0 < kNr && whole > 0; j0 += 16) {  // 16 columns read front to back
    for (int64_t p = 0; p < whole; p += 16) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(b + (j0 + j) * ld + 2 * p);
      transpose_16x16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + (p + i) * kNr + j0, r[i]);
    }
  }
  for (int64_t p = whole; p < pairs; ++p) {
    for (int64_t j = 0; j < kNr; ++j) {
      const uint16_t* e = b + j * ld + 2 * p;
      out[p * kNr + j] = j >= cols ? 0u : (2 * p + 1 < K ? pair_at(e) : uint32_t(e[0]));
    }
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
// element (a row-major a has no element K). One rounding into c.
template <int R>
TORCH_MOE_GEMM_TARGET void tile(const uint16_t* const* rows, int64_t ks, const uint32_t* panel,
                                int64_t K, uint16_t* c, int64_t ldc, int64_t cols) {
  const int64_t pairs = (K + 1) / 2, whole = K / 2;
  const uint16_t* rp[R];  // the row pointers in registers, not re-read per k pair
  for (int r = 0; r < R; ++r) rp[r] = rows[r];
  __m512 sum[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) sum[r][v] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < pairs; p0 += kKBlock) {
    const int64_t p1 = std::min(pairs, p0 + kKBlock);
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t p = p0; p < std::min(p1, whole); ++p) step<R, false>(rp, p * ks, panel + p * kNr, acc);
    if (p1 > whole) step<R, true>(rp, whole * ks, panel + whole * kNr, acc);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) sum[r][v] = p0 == 0 ? acc[r][v] : _mm512_add_ps(sum[r][v], acc[r][v]);
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4 && 16 * v < cols; ++v) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(sum[r][v]);
      uint16_t* o = c + r * ldc + 16 * v;
      if (cols - 16 * v >= 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), h);
      } else {
        _mm256_mask_storeu_epi16(o, static_cast<__mmask16>((1u << (cols - 16 * v)) - 1), h);
      }
    }
  }
}

TORCH_MOE_GEMM_TARGET void tile_rows(int rows, const uint16_t* const* a, int64_t ks,
                                     const uint32_t* panel, int64_t K, uint16_t* c,
                                     int64_t ldc, int64_t cols) {
  switch (rows) {
    case 6: tile<6>(a, ks, panel, K, c, ldc, cols); break;
    case 5: tile<5>(a, ks, panel, K, c, ldc, cols); break;
    case 4: tile<4>(a, ks, panel, K, c, ldc, cols); break;
    case 3: tile<3>(a, ks, panel, K, c, ldc, cols); break;
    case 2: tile<2>(a, ks, panel, K, c, ldc, cols); break;
    case 1: tile<1>(a, ks, panel, K, c, ldc, cols); break;
    default: break;
  }
}

// The operand b: its panel of columns [n0, n0 + cols) into out.
struct BOperand {
  RowSource rows;  // row-major b's rows (gathered or not)
  bool col_major;  // else column-major: column j's K elements at rows.base + j * rows.ld
  int64_t K;
  TORCH_MOE_GEMM_TARGET void pack(int64_t n0, int64_t cols, uint32_t* out) const {
    if (col_major) {
      pack_col_pairs(rows.base + n0 * rows.ld, rows.ld, K, cols, out);
    } else {
      pack_row_pairs(rows, n0, K, cols, out, kNr);
    }
  }
};

// c [M, N] = a @ b: a's rows from `a` (row-major: a's rows; column-major: the rows of a^T,
// [K, M], packed here), b as BOperand.
TORCH_MOE_GEMM_TARGET void gemm(const RowSource& a, bool a_col_major, const BOperand& b,
                                uint16_t* c, int64_t ldc, int64_t M, int64_t N, int64_t K) {
  thread_local std::vector<uint32_t> panels, a_packed;
  thread_local std::vector<const uint16_t*> row_ptrs;
  const int64_t pairs = (K + 1) / 2, panel_words = pairs * kNr, n_panels = (N + kNr - 1) / kNr;
  // a's row m: its pair p at row_ptrs[m] + p * ks
  if (static_cast<int64_t>(row_ptrs.size()) < M) row_ptrs.resize(M);
  int64_t ks = 2;
  if (a_col_major) {  // a^T [K, M]: its pairs of rows interleaved, [pairs, lp] words
    const int64_t lp = (M + kNr - 1) / kNr * kNr;
    if (static_cast<int64_t>(a_packed.size()) < pairs * lp) a_packed.resize(pairs * lp);
    for (int64_t m0 = 0; m0 < M; m0 += kNr) {
      pack_row_pairs(a, m0, K, std::min(kNr, M - m0), a_packed.data() + m0, lp);
    }
    const auto* packed = reinterpret_cast<const uint16_t*>(a_packed.data());
    for (int64_t m = 0; m < M; ++m) row_ptrs[m] = packed + 2 * m;
    ks = 2 * lp;
  } else {
    for (int64_t m = 0; m < M; ++m) row_ptrs[m] = a.row(m);
  }
  // passes of near-equal rows (whole tiles), each at most a_block_bytes() of a
  const int64_t most = std::max<int64_t>(kMr, a_block_bytes() / (2 * K) / kMr * kMr);
  const int64_t passes = (M + most - 1) / most;
  const int64_t block = ((M + passes - 1) / passes + kMr - 1) / kMr * kMr;
  const bool one_pass = passes == 1;  // then each panel is packed just before its tiles
  const int64_t held = one_pass ? 1 : n_panels;
  if (static_cast<int64_t>(panels.size()) < held * panel_words) panels.resize(held * panel_words);
  if (!one_pass) {
    for (int64_t q = 0; q < n_panels; ++q) {
      b.pack(q * kNr, std::min(kNr, N - q * kNr), panels.data() + q * panel_words);
    }
  }
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    for (int64_t q = 0; q < n_panels; ++q) {
      const int64_t n0 = q * kNr, cols = std::min(kNr, N - n0);
      uint32_t* panel = panels.data() + (one_pass ? 0 : q * panel_words);
      if (one_pass) b.pack(n0, cols, panel);
      for (int64_t m = m0; m < m1; m += kMr) {
        const int rows = static_cast<int>(std::min<int64_t>(kMr, m1 - m));
        tile_rows(rows, row_ptrs.data() + m, ks, panel, K, c + m * ldc + n0, ldc, cols);
      }
    }
  }
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

bool bf16_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, Gather a_rows,
               Gather b_rows) {
#if defined(CPU_CAPABILITY_AVX512)
  if (!bf16_gemm_available() || a.dim() != 2 || b.dim() != 2 || out.dim() != 2) return false;
  if (a.scalar_type() != at::kBFloat16 || b.scalar_type() != at::kBFloat16 ||
      out.scalar_type() != at::kBFloat16) {
    return false;
  }
  const int64_t M = out.size(0), N = out.size(1);
  // a row-major (its rows read in place) or column-major (a^T's rows packed); b likewise.
  // A gathered operand's layout is the caller's (its sizes may leave it ambiguous).
  const bool a_rows_major =
      a_rows.index != nullptr ? !a_rows.transposed : a.stride(1) == 1 || a.size(1) == 1;
  const bool b_rows_major = b_rows.index != nullptr || b.stride(1) == 1 || b.size(1) == 1;
  const bool a_ok = a_rows_major ? a.stride(1) == 1 || a.size(1) == 1
                                 : a.stride(0) == 1 || a.size(0) == 1;
  const bool b_ok = b_rows_major ? b.stride(1) == 1 || b.size(1) == 1 : b.stride(0) == 1;
  if (!a_ok || !b_ok) return false;
  // the logical sizes: a gathered row-major a has M rows of the source's K columns; a
  // gathered column-major a, the source's M rows by K gathered columns
  const int64_t K = a_rows.index != nullptr && !a_rows_major ? a_rows.size : a.size(1);
  const int64_t a_m = a_rows.index != nullptr && a_rows_major ? a_rows.size : a.size(0);
  const int64_t b_k = b_rows.index != nullptr ? b_rows.size : b.size(0);
  if (a_m != M || b_k != K || b.size(1) != N || (out.stride(1) != 1 && N > 1)) return false;
  if (M == 0 || N == 0) return true;
  if (K == 0) {
    out.zero_();
    return true;
  }
  thread_local std::vector<uint16_t> zero;  // gathered rows of index -1
  const int64_t longest = std::max({M, N, K}) + kNr;
  if (static_cast<int64_t>(zero.size()) < longest) zero.assign(longest, 0);
  const auto* ap = reinterpret_cast<const uint16_t*>(a.const_data_ptr<at::BFloat16>());
  const auto* bp = reinterpret_cast<const uint16_t*>(b.const_data_ptr<at::BFloat16>());
  auto* cp = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>());
  const RowSource a_src{ap, a_rows_major ? a.stride(0) : a.stride(1), a_rows.index, zero.data()};
  const RowSource b_src{bp, b_rows_major ? b.stride(0) : b.stride(1), b_rows.index, zero.data()};
  gemm(a_src, !a_rows_major, BOperand{b_src, !b_rows_major, K}, cp, out.stride(0), M, N, K);
  return true;
#else
  (void)out;
  (void)a;
  (void)b;
  (void)a_rows;
  (void)b_rows;
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

bool bf16_mm_available() {
  return torch_moe_cpu::bf16_gemm_available();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_moe_cpu, m) {
  m.def("bf16_mm(Tensor a, Tensor b, Tensor(a!) out) -> bool");
  m.def("bf16_mm_available() -> bool", &bf16_mm_available);
}

TORCH_LIBRARY_IMPL(torch_moe_cpu, CPU, m) {
  m.impl("bf16_mm", &bf16_mm);
}
