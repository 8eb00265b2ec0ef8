// The router's logits and their gradients (torch_moe::router_logits, torch_moe/_ops/
// router.py) for bfloat16 / half tokens and router weight, computed in fp32:
//
//   router_logits(x [T, D], w [E, D], bias [E] fp32?, out [T, E] fp32)
//       out = x @ w^T (+ bias)
//   router_logits_backward(grad [T, E] fp32, x, w, grad_x [T, D]?, grad_w [E, D]?)
//       grad_x = grad @ w        rounded once to x's dtype
//       grad_w = grad^T @ x      rounded once to w's dtype
//
// The reference converts x and w to fp32 and runs ATen's fp32 GEMMs. A router has few
// columns (E = 8 to 256 experts), and the fp32 GEMM library runs such narrow products
// far below its large-GEMM rate: on a 2-core Zen 5 EPYC at T = 2048, D = 1024, one
// thread, 24-53 GFLOP/s at E = 8 and 84-98 at E = 32 / 64, with two fp32 copies of x per
// step besides (benchmarks/results/cpu_floor_cpu_202612.md). These kernels read the
// half-precision operands in place and convert them in registers.
//
// Math: a product of two bfloat16 or half values is exact in fp32, so each output is a
// sum of exact products accumulated in fp32, the reference's math in another order:
//   * logits: dot products along D. Lane i of a vector accumulates the elements i mod L
//     (L = the vector's fp32 lanes) in order, the lanes are then summed by ATen's
//     vec_reduce_all (a fixed tree) and the bias added last. With AVX512-BF16 and bf16
//     operands the products come from vdpbf16ps (two products per lane and instruction,
//     several times the fp32 FMA rate), which reads denormal inputs as zero and flushes
//     denormal sums, as the expert GEMMs' bf16 kernels do.
//   * grad_x: per output element fp32 FMAs over the experts in order, from zero.
//   * grad_w: per output element fp32 FMAs over the tokens in order, from zero.
//   * with `amx` (the CPU probe's router_kernel; bf16 where the expert GEMMs' AMX tiles are
//     on): logits by the tiles (gemm_bf16_cpu's x @ w^T form, fp32 output: the products
//     summed in fp32 in 32-element steps in order of d), grad_x as the GEMM of the fp32
//     gradient's three bf16 parts (g = g1 + g2 + g3 exactly) by w's rows three times
//     over, rounded once; grad_w stays the fp32 FMAs (the split's GEMM over 3T was
//     slower). On the AMX Xeon measured (one thread, T = 2048, D = 1024; its vdpbf16ps
//     ran a bf16 GEMM at about 100 GFLOP/s, its tiles at 900), logits 3.1 -> 0.7 ms and
//     grad_x 2.4 -> 1.2 at E = 64, level at E = 8
//     (benchmarks/results/cpu_floor_cpu_202612.md).
// Threads share tokens (logits, grad_x) or columns (grad_w) out; no output depends on
// the thread count. Each op returns false where it does not apply (another dtype, a
// layout other than row-major, a build without ATen's AVX2 / AVX512 vectors): the caller
// runs the reference.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "gemm_bf16_cpu.h"
#include "vec_convert.h"


#include <algorithm>
#include <atomic>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
using at::vec::Vectorized;
using fVec = Vectorized<float>;
using torch_moe_cpu::from_float;
using torch_moe_cpu::to_float;

// The fp32 vector as the compiler's own type: arrays of ATen's Vectorized<float> class
// in a loop were kept in memory (each FMA read and wrote the stack), these in registers.
#if defined(CPU_CAPABILITY_AVX512)
using vreg = __m512;
inline vreg vfma(vreg a, vreg b, vreg c) { return _mm512_fmadd_ps(a, b, c); }
inline vreg vadd(vreg a, vreg b) { return _mm512_add_ps(a, b); }
inline vreg vzero() { return _mm512_setzero_ps(); }
inline vreg vset1(float a) { return _mm512_set1_ps(a); }
inline vreg vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vreg a) { _mm512_storeu_ps(p, a); }
#else
using vreg = __m256;
inline vreg vfma(vreg a, vreg b, vreg c) { return _mm256_fmadd_ps(a, b, c); }
inline vreg vadd(vreg a, vreg b) { return _mm256_add_ps(a, b); }
inline vreg vzero() { return _mm256_setzero_ps(); }
inline vreg vset1(float a) { return _mm256_set1_ps(a); }
inline vreg vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vreg a) { _mm256_storeu_ps(p, a); }
#endif

constexpr int kTokens = 2;    // tokens per logits tile (AVX2 has 16 vector registers)
constexpr int kTokensDp = 4;  // tokens per vdpbf16ps logits tile (32 registers)
constexpr int kExperts = 4;   // experts per logits tile
// tokens per grad_x tile and experts per grad_w tile: 16 sums where there are 32 vector
// registers (AVX-512), 8 where there are 16
constexpr int kWide = sizeof(vreg) == 64 ? 2 : 1;
constexpr int kTokensX = 2 * kWide, kExpertsW = 4 * kWide;
// Steps of a sum taken in one block: each block's sums start from zero and are added to
// the running sums in order (compilers keep a block's accumulators in registers, where a
// loop over a whole sum left them in memory, storing each one at every step).
constexpr int64_t kBlock = 64;

// n (<= 2L) elements of a row as two fp32 vectors, zero past n
template <typename T>
inline auto load2(const T* p, int64_t n) {
  using hVec = Vectorized<T>;
  return to_float(n == hVec::size() ? hVec::loadu(p) : hVec::loadu(p, n));
}

// acc[r][e] += x[r][d, d + n) * w[e][d, d + n), lane-wise (n <= 2L: two vectors)
template <typename T, int RT, int RE>
inline void logits_step(const T* x, int64_t ldx, const T* w, int64_t ldw, int64_t n,
                        vreg (&acc)[RT][RE]) {
  vreg xl[RT], xh[RT];
  for (int r = 0; r < RT; ++r) {
    const auto [lo, hi] = load2(x + r * ldx, n);
    xl[r] = lo;
    xh[r] = hi;
  }
  for (int e = 0; e < RE; ++e) {
    const auto [lo, hi] = load2(w + e * ldw, n);
    const vreg wl = lo, wh = hi;
    for (int r = 0; r < RT; ++r) acc[r][e] = vfma(xh[r], wh, vfma(xl[r], wl, acc[r][e]));
  }
}

// RT x RE logits: rows x[r] . w[e] over D, as the header says, in blocks of kBlock steps
// of 2L elements.
template <typename T, int RT, int RE>
void logits_tile(const T* x, int64_t ldx, const T* w, int64_t ldw, int64_t D, float* out,
                 int64_t ldo, const float* bias) {
  constexpr int64_t H = Vectorized<T>::size();
  const int64_t steps = (D + H - 1) / H;
  vreg sum[RT][RE];
  for (int64_t b0 = 0; b0 < steps || b0 == 0; b0 += kBlock) {
    vreg acc[RT][RE];
    for (int r = 0; r < RT; ++r)
      for (int e = 0; e < RE; ++e) acc[r][e] = vzero();
    for (int64_t i = b0; i < std::min(steps, b0 + kBlock); ++i) {
      logits_step<T, RT, RE>(x + i * H, ldx, w + i * H, ldw, std::min(H, D - i * H), acc);
    }
    for (int r = 0; r < RT; ++r)
      for (int e = 0; e < RE; ++e) sum[r][e] = b0 == 0 ? acc[r][e] : vadd(sum[r][e], acc[r][e]);
  }
  for (int r = 0; r < RT; ++r) {
    for (int e = 0; e < RE; ++e) {
      const float s =
          at::vec::vec_reduce_all<float>([](fVec a, fVec b) { return a + b; }, fVec(sum[r][e]));
      out[r * ldo + e] = bias != nullptr ? s + bias[e] : s;
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
#define TORCH_MOE_ROUTER_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define TORCH_MOE_ROUTER_BF16_INLINE TORCH_MOE_ROUTER_BF16 inline __attribute__((always_inline))

// The 16 lanes' sum: halves added, then quarters, ... (a fixed tree).
TORCH_MOE_ROUTER_BF16_INLINE float lane_sum(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// acc[r][e] += pairs of x[r] and w[e] in the 32 elements under m, by vdpbf16ps
template <int RT, int RE>
TORCH_MOE_ROUTER_BF16_INLINE void logits_step_dp(const uint16_t* x, int64_t ldx,
                                                 const uint16_t* w, int64_t ldw, __mmask32 m,
                                                 __m512 (&acc)[RT][RE]) {
  for (int r = 0; r < RT; ++r) {
    const __m512bh xr = (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * ldx);
    for (int e = 0; e < RE; ++e) {
      const __m512bh we = (__m512bh)_mm512_maskz_loadu_epi16(m, w + e * ldw);
      acc[r][e] = _mm512_dpbf16_ps(acc[r][e], xr, we);
    }
  }
}

// logits_tile for bf16 by vdpbf16ps: lane i accumulates the pairs (2i, 2i + 1) of each
// 32 elements in order (zero past D), in blocks of kBlock steps.
template <int RT, int RE>
TORCH_MOE_ROUTER_BF16 void logits_tile_dp(const uint16_t* x, int64_t ldx, const uint16_t* w,
                                          int64_t ldw, int64_t D, float* out, int64_t ldo,
                                          const float* bias) {
  const int64_t steps = (D + 31) / 32;
  __m512 sum[RT][RE];
  for (int64_t b0 = 0; b0 < steps || b0 == 0; b0 += kBlock) {
    __m512 acc[RT][RE];
    for (int r = 0; r < RT; ++r)
      for (int e = 0; e < RE; ++e) acc[r][e] = _mm512_setzero_ps();
    const int64_t b1 = std::min(steps, b0 + kBlock), whole = std::min(b1, D / 32);
    for (int64_t i = b0; i < whole; ++i) {
      logits_step_dp<RT, RE>(x + 32 * i, ldx, w + 32 * i, ldw, ~__mmask32(0), acc);
    }
    if (whole < b1) {  // the last 1-31 elements
      const __mmask32 m = __mmask32((uint32_t(1) << (D - 32 * whole)) - 1);
      logits_step_dp<RT, RE>(x + 32 * whole, ldx, w + 32 * whole, ldw, m, acc);
    }
    for (int r = 0; r < RT; ++r)
      for (int e = 0; e < RE; ++e) sum[r][e] = b0 == 0 ? acc[r][e] : _mm512_add_ps(sum[r][e], acc[r][e]);
  }
  for (int r = 0; r < RT; ++r) {
    for (int e = 0; e < RE; ++e) {
      const float s = lane_sum(sum[r][e]);
      out[r * ldo + e] = bias != nullptr ? s + bias[e] : s;
    }
  }
}
#endif

// One tile of `rt` tokens x `re` experts, by the dot-product kernel `Tile<RT, RE>`.
template <template <int, int> class Tile, typename... Args>
void tile_any(int rt, int re, Args... args) {
  auto by_e = [&](auto rt_c) {
    constexpr int RT = decltype(rt_c)::value;
    switch (re) {
      case 4: Tile<RT, 4>::run(args...); break;
      case 3: Tile<RT, 3>::run(args...); break;
      case 2: Tile<RT, 2>::run(args...); break;
      default: Tile<RT, 1>::run(args...); break;
    }
  };
  if (rt == 4) {
    by_e(std::integral_constant<int, 4>{});
  } else if (rt == 3) {
    by_e(std::integral_constant<int, 3>{});
  } else if (rt == 2) {
    by_e(std::integral_constant<int, 2>{});
  } else {
    by_e(std::integral_constant<int, 1>{});
  }
}

template <typename T>
struct FmaTile {
  template <int RT, int RE>
  struct Of {
    static void run(const T* x, int64_t ldx, const T* w, int64_t ldw, int64_t D, float* out,
                    int64_t ldo, const float* bias) {
      logits_tile<T, RT, RE>(x, ldx, w, ldw, D, out, ldo, bias);
    }
  };
};

#if defined(CPU_CAPABILITY_AVX512)
template <int RT, int RE>
struct DpTile {
  static void run(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t D,
                  float* out, int64_t ldo, const float* bias) {
    logits_tile_dp<RT, RE>(x, ldx, w, ldw, D, out, ldo, bias);
  }
};
#endif

template <typename T>
void logits_impl(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& out) {
  const int64_t T_ = x.size(0), D = x.size(1), E = w.size(0);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t ldx = x.stride(0), ldw = w.stride(0), ldo = out.stride(0);
  bool dp = false;
#if defined(CPU_CAPABILITY_AVX512)
  dp = std::is_same_v<T, at::BFloat16> && torch_moe_cpu::bf16_gemm_available();
#endif
  const int64_t tb = dp ? kTokensDp : kTokens;  // tokens per tile
  const int64_t blocks = (T_ + tb - 1) / tb;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, D * E));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t = b * tb;
      const int rt = static_cast<int>(std::min<int64_t>(tb, T_ - t));
      for (int64_t e = 0; e < E; e += kExperts) {
        const int re = static_cast<int>(std::min<int64_t>(kExperts, E - e));
        float* o = op + t * ldo + e;
        const float* be = bias != nullptr ? bias + e : nullptr;
#if defined(CPU_CAPABILITY_AVX512)
        if (dp) {
          tile_any<DpTile>(rt, re, reinterpret_cast<const uint16_t*>(xp + t * ldx), ldx,
                           reinterpret_cast<const uint16_t*>(wp + e * ldw), ldw, D, o, ldo, be);
          continue;
        }
#endif
        tile_any<FmaTile<T>::template Of>(rt, re, xp + t * ldx, ldx, wp + e * ldw, ldw, D, o,
                                          ldo, be);
      }
    }
  });
}

#if defined(CPU_CAPABILITY_AVX512)
// Rows of tokens per parallel task of the AMX forms below (whole 32-row tile blocks).
constexpr int64_t kAmxRows = 128;

// logits by the expert GEMMs' AMX micro-kernel (bf16 x and w, AMX on): x @ w^T with w's
// rows read in place (amx_gemm_rows_bt's fp32 form), the bias added last. Each logit is
// its D's products summed in fp32 by the tiles, in 32-element steps in order of d.
bool logits_amx(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& out) {
  const int64_t T_ = x.size(0), D = x.size(1), E = w.size(0), ldo = out.stride(0);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.const_data_ptr<at::BFloat16>());
  float* op = out.mutable_data_ptr<float>();
  std::atomic<bool> ran{true};
  at::parallel_for(0, (T_ + kAmxRows - 1) / kAmxRows, 1, [&](int64_t b0, int64_t b1) {
    const int64_t t0 = b0 * kAmxRows, t1 = std::min(T_, b1 * kAmxRows);
    if (!torch_moe_cpu::amx_gemm_rows_bt(xp + t0 * x.stride(0), x.stride(0), wp, w.stride(0),
                                         op + t0 * ldo, ldo, t1 - t0, E, D)) {
      ran = false;
      return;
    }
    for (int64_t t = t0; bias != nullptr && t < t1; ++t) {
      for (int64_t e = 0; e < E; ++e) op[t * ldo + e] += bias[e];
    }
  });
  return ran;
}

// bf16 values as fp32 (exact)
TORCH_MOE_ROUTER_BF16_INLINE __m512 widen(__m256bh h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

// Rows of fp32 gradients [rows, E] (row stride ldg) as their three bf16 parts, out
// [rows, 3E]: g1 in columns 0..E, g2 in E..2E, g3 in 2E..3E (grad_x_amx).
TORCH_MOE_ROUTER_BF16 void split3(const float* gp, int64_t ldg, int64_t rows, int64_t E,
                                  uint16_t* out) {
  const int64_t E3 = 3 * E;
  for (int64_t t = 0; t < rows; ++t) {
    const float* gr = gp + t * ldg;
    uint16_t* o = out + t * E3;
    for (int64_t e = 0; e < E; e += 16) {
      const auto m = static_cast<__mmask16>(E - e >= 16 ? 0xffffu : (1u << (E - e)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(m, gr + e);
      const __m256bh h1 = _mm512_cvtneps_pbh(v);
      __m512 rest = _mm512_sub_ps(v, widen(h1));
      // inf - inf, NaN: no rest (g1 carries g)
      rest = _mm512_mask_mov_ps(rest, _mm512_cmp_ps_mask(rest, rest, _CMP_UNORD_Q),
                                _mm512_setzero_ps());
      const __m256bh h2 = _mm512_cvtneps_pbh(rest);
      const __m256bh h3 = _mm512_cvtneps_pbh(_mm512_sub_ps(rest, widen(h2)));
      _mm256_mask_storeu_epi16(o + e, m, (__m256i)h1);
      _mm256_mask_storeu_epi16(o + E + e, m, (__m256i)h2);
      _mm256_mask_storeu_epi16(o + 2 * E + e, m, (__m256i)h3);
    }
  }
}

// grad_x = grad @ w by the AMX micro-kernel (bf16 x and w, AMX on): each fp32 gradient g
// split into three bf16 parts g1 + g2 + g3 = g (g1 = g rounded, g2 the rest rounded, g3
// the rest, exact: 24 bits of significand in three 8-bit parts; a non-finite g keeps g1
// = g and no rest), the [rows, 3E] parts times w's rows three times over (a gather of
// w's rows, not a copy) as one GEMM over k = 3E: every product exact in fp32, summed in
// fp32 in order of k, rounded once to bf16. The same math as grad_x_rows, in another
// order; g's parts under bf16's normal range are read as zero (as the tiles read every
// denormal input).
bool grad_x_amx(const at::Tensor& g, const at::Tensor& w, at::Tensor& gx) {
  const int64_t T_ = g.size(0), E = w.size(0), E3 = 3 * E;
  std::vector<int64_t> rows3(E3);
  for (int64_t k = 0; k < E3; ++k) rows3[k] = k % E;
  const float* gp = g.const_data_ptr<float>();
  std::atomic<bool> ran{true};
  at::parallel_for(0, (T_ + kAmxRows - 1) / kAmxRows, 1, [&](int64_t b0, int64_t b1) {
    const int64_t t0 = b0 * kAmxRows, t1 = std::min(T_, b1 * kAmxRows), rows = t1 - t0;
    thread_local std::vector<uint16_t> scratch;
    uint16_t* const parts = torch_moe_cpu::aligned_scratch(scratch, rows * E3);
    split3(gp + t0 * g.stride(0), g.stride(0), rows, E, parts);
    const auto a = at::from_blob(parts, {rows, E3}, g.options().dtype(at::kBFloat16));
    auto out = gx.narrow(0, t0, rows);
    if (!torch_moe_cpu::bf16_gemm(out, a, w, {}, {rows3.data(), E3})) ran = false;
  });
  return ran;
}
#endif

// grad_x rows [t0, t1): per output vector, FMAs over the experts in order, in blocks of
// kBlock experts, kTokensX tokens by 4L columns at a time; w as fp32
// rows (wf [E, D], converted once per call) in column blocks that stay in L2 over the
// tokens.
template <typename T>
void grad_x_rows(const float* g, int64_t ldg, const float* wf, int64_t E, int64_t D, T* gx,
                 int64_t ldgx, int64_t t0, int64_t t1) {
  constexpr int64_t L = fVec::size(), kW = 4 * L;
  constexpr int64_t kCols = 512;
  for (int64_t c0 = 0; c0 < D; c0 += kCols) {
    const int64_t c1 = std::min(D, c0 + kCols);
    for (int64_t t = t0; t < t1; t += kTokensX) {
      const int rt = static_cast<int>(std::min<int64_t>(kTokensX, t1 - t));
      const float* gr[kTokensX];  // past rt: a repeat of the last token, not stored
      for (int r = 0; r < kTokensX; ++r) gr[r] = g + (t + std::min(r, rt - 1)) * ldg;
      for (int64_t d = c0; d < c1; d += kW) {
        const int64_t n = std::min(kW, c1 - d);
        int64_t cnt[4];
        for (int v = 0; v < 4; ++v) cnt[v] = std::clamp<int64_t>(n - v * L, 0, L);
        vreg sum[kTokensX][4];
        for (int64_t e0 = 0; e0 < E || e0 == 0; e0 += kBlock) {
          vreg acc[kTokensX][4];
          for (int r = 0; r < kTokensX; ++r)
            for (int v = 0; v < 4; ++v) acc[r][v] = vzero();
          for (int64_t e = e0; e < std::min(E, e0 + kBlock); ++e) {
            const float* we = wf + e * D + d;
            vreg wv[4];
            for (int v = 0; v < 4; ++v) {
              wv[v] = cnt[v] == L ? fVec::loadu(we + v * L) : fVec::loadu(we + v * L, cnt[v]);
            }
            for (int r = 0; r < kTokensX; ++r) {
              const vreg ge = vset1(gr[r][e]);
              for (int v = 0; v < 4; ++v) acc[r][v] = vfma(ge, wv[v], acc[r][v]);
            }
          }
          for (int r = 0; r < kTokensX; ++r)
            for (int v = 0; v < 4; ++v) sum[r][v] = e0 == 0 ? acc[r][v] : vadd(sum[r][v], acc[r][v]);
        }
        for (int r = 0; r < rt; ++r) {
          T* out = gx + (t + r) * ldgx + d;
          for (int v = 0; v < 4; v += 2) {
            const int64_t m = cnt[v] + cnt[v + 1];
            if (m == 0) break;
            const auto h = from_float<T>(fVec(sum[r][v]), fVec(sum[r][v + 1]));
            if (m == 2 * L) {
              h.store(out + v * L);
            } else {
              h.store(out + v * L, m);
            }
          }
        }
      }
    }
  }
}

// grad_w columns [d0, d1) (multiples of 2L but the last): per output vector, FMAs over the
// tokens in order, in blocks of kBlock tokens (each block's sums added to the running
// sums, kept in `scratch`: E (+ a tile's) x 2L floats), kExpertsW experts at a time; a
// block's columns of x are converted once into `scratch` too and stay in L1 over the
// experts.
template <typename T>
void grad_w_cols(const float* g, int64_t ldg, const T* x, int64_t ldx, int64_t T_, int64_t E,
                 T* gw, int64_t ldgw, int64_t d0, int64_t d1, std::vector<float>& scratch) {
  std::vector<float>& sums = scratch;
  constexpr int64_t H = Vectorized<T>::size(), L = fVec::size();
  sums.resize((E + kExpertsW) * H + kBlock * H);  // E rows, a tile's scratch rows, x's block
  float* xs = sums.data() + (E + kExpertsW) * H;
  for (int64_t d = d0; d < d1; d += H) {
    const int64_t n = std::min(H, d1 - d);
    for (int64_t b0 = 0; b0 < T_ || b0 == 0; b0 += kBlock) {
      const int64_t b1 = std::min(T_, b0 + kBlock);
      // the block's columns of x as fp32, contiguous: rows of x a power of two apart
      // share a few L1 sets, and each expert tile would read them from L2 again
      for (int64_t t = b0; t < b1; ++t) {
        const auto [lo, hi] = load2(x + t * ldx + d, n);
        lo.store(xs + (t - b0) * H);
        hi.store(xs + (t - b0) * H + L);
      }
      for (int64_t e0 = 0; e0 < E; e0 += kExpertsW) {
        const int re = static_cast<int>(std::min<int64_t>(kExpertsW, E - e0));
        vreg acc[kExpertsW][2];
        for (int j = 0; j < kExpertsW; ++j) acc[j][0] = acc[j][1] = vzero();
        for (int64_t t = b0; t < b1; ++t) {
          const vreg xl = vload(xs + (t - b0) * H), xh = vload(xs + (t - b0) * H + L);
          const float* gt = g + t * ldg + e0;
          for (int j = 0; j < kExpertsW; ++j) {
            const vreg ge = vset1(gt[std::min(j, re - 1)]);  // past re: a repeat, not stored
            acc[j][0] = vfma(ge, xl, acc[j][0]);
            acc[j][1] = vfma(ge, xh, acc[j][1]);
          }
        }
        // every row of the tile, those past E into the scratch rows: loops whose bounds
        // the compiler knows keep acc in registers (a bound of re put it on the stack)
        float* s = sums.data() + e0 * H;
        if (b0 == 0) {
          for (int j = 0; j < kExpertsW; ++j)
            for (int v = 0; v < 2; ++v) vstore(s + j * H + v * L, acc[j][v]);
        } else {
          for (int j = 0; j < kExpertsW; ++j) {
            for (int v = 0; v < 2; ++v) {
              float* sv = s + j * H + v * L;
              vstore(sv, vadd(vload(sv), acc[j][v]));
            }
          }
        }
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      const float* s = sums.data() + e * H;
      const auto h = from_float<T>(fVec::loadu(s), fVec::loadu(s + L));
      T* out = gw + e * ldgw + d;
      if (n == H) {
        h.store(out);
      } else {
        h.store(out, n);
      }
    }
  }
}

template <typename T>
void backward_impl(const at::Tensor& g, const at::Tensor& x, const at::Tensor& w,
                   at::Tensor* gx, at::Tensor* gw) {
  const int64_t T_ = x.size(0), D = x.size(1), E = w.size(0);
  const float* gp = g.const_data_ptr<float>();
  if (gx != nullptr && T_ > 0) {
    const at::Tensor wf = w.to(at::kFloat).contiguous();
    const float* wfp = wf.const_data_ptr<float>();
    T* out = gx->mutable_data_ptr<T>();
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, D * E));
    at::parallel_for(0, T_, grain, [&](int64_t t0, int64_t t1) {
      grad_x_rows<T>(gp, g.stride(0), wfp, E, D, out, gx->stride(0), t0, t1);
    });
  }
  if (gw != nullptr) {
    const T* xp = x.const_data_ptr<T>();
    T* out = gw->mutable_data_ptr<T>();
    constexpr int64_t H = Vectorized<T>::size();
    const int64_t chunks = (D + H - 1) / H;
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      thread_local std::vector<float> sums;
      grad_w_cols<T>(gp, g.stride(0), xp, x.stride(0), T_, E, out, gw->stride(0), c0 * H,
                     std::min(D, c1 * H), sums);
    });
  }
}
#endif  // AVX512 || AVX2

bool row_major(const at::Tensor& t) {
  return t.dim() == 2 && (t.stride(1) == 1 || t.size(1) <= 1) && t.stride(0) >= t.size(1);
}

// The half dtype both operands share, or Undefined where the kernels do not apply.
at::ScalarType half_operands(const at::Tensor& x, const at::Tensor& w) {
  const auto dt = x.scalar_type();
  if ((dt != at::kBFloat16 && dt != at::kHalf) || w.scalar_type() != dt) return at::ScalarType::Undefined;
  if (!row_major(x) || !row_major(w) || x.size(1) != w.size(1)) return at::ScalarType::Undefined;
  return dt;
}

bool router_logits(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                   at::Tensor& out, bool amx) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const auto dt = half_operands(x, w);
  if (dt == at::ScalarType::Undefined || out.scalar_type() != at::kFloat || !row_major(out) ||
      out.size(0) != x.size(0) || out.size(1) != w.size(0)) {
    return false;
  }
  const float* b = nullptr;
  if (bias.has_value()) {
    if (bias->scalar_type() != at::kFloat || bias->dim() != 1 || !bias->is_contiguous() ||
        bias->size(0) != w.size(0)) {
      return false;
    }
    b = bias->const_data_ptr<float>();
  }
  if (dt == at::kBFloat16) {
#if defined(CPU_CAPABILITY_AVX512)
    if (amx && torch_moe_cpu::bf16_gemm_amx() && logits_amx(x, w, b, out)) return true;
#endif
    logits_impl<at::BFloat16>(x, w, b, out);
  } else {
    logits_impl<at::Half>(x, w, b, out);
  }
  return true;
#else
  (void)x;
  (void)w;
  (void)bias;
  (void)out;
  (void)amx;
  return false;
#endif
}

bool router_logits_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& w,
                            std::optional<at::Tensor> grad_x, std::optional<at::Tensor> grad_w,
                            bool amx) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const auto dt = half_operands(x, w);
  if (dt == at::ScalarType::Undefined || grad.scalar_type() != at::kFloat || !row_major(grad) ||
      grad.size(0) != x.size(0) || grad.size(1) != w.size(0)) {
    return false;
  }
  if (grad_x.has_value() && (grad_x->scalar_type() != dt || !row_major(*grad_x) ||
                             grad_x->sizes() != x.sizes())) {
    return false;
  }
  if (grad_w.has_value() && (grad_w->scalar_type() != dt || !row_major(*grad_w) ||
                             grad_w->sizes() != w.sizes())) {
    return false;
  }
  at::Tensor* gx = grad_x.has_value() ? &*grad_x : nullptr;
  at::Tensor* gw = grad_w.has_value() ? &*grad_w : nullptr;
  if (dt == at::kBFloat16) {
#if defined(CPU_CAPABILITY_AVX512)
    if (amx && gx != nullptr && x.size(0) > 0 && torch_moe_cpu::bf16_gemm_amx() &&
        grad_x_amx(grad, w, *gx)) {
      gx = nullptr;  // (grad_w below by the fp32 kernel: faster than the split's GEMM)
    }
#endif
    backward_impl<at::BFloat16>(grad, x, w, gx, gw);
  } else {
    backward_impl<at::Half>(grad, x, w, gx, gw);
  }
  return true;
#else
  (void)grad;
  (void)x;
  (void)w;
  (void)grad_x;
  (void)grad_w;
  (void)amx;
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_moe_cpu, m) {
  m.def("router_logits(Tensor x, Tensor w, Tensor? bias, Tensor(a!) out, bool amx=False) -> bool");
  m.def(
      "router_logits_backward(Tensor grad, Tensor x, Tensor w, Tensor(a!)? grad_x,"
      " Tensor(b!)? grad_w, bool amx=False) -> bool");
}

TORCH_LIBRARY_IMPL(torch_moe_cpu, CPU, m) {
  m.impl("router_logits", &router_logits);
  m.impl("router_logits_backward", &router_logits_backward);
}
