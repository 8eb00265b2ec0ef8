// FP8 e4m3fn conversions and quantizers for the CPU FP8 emulation
// (torch_moe/quantization/quantize.py, scaled_grouped_mm.py):
//
//   fp8_from_float(x fp32, out e4m3fn) -> bool
//       out = x.clamp(-448, 448).to(float8_e4m3fn)   (the saturating cast; x not changed)
//   fp8_to_float(q e4m3fn, out fp32 / bf16) -> bool
//       out = q.to(out.dtype)   (exact: e4m3fn's values are bf16 values)
//   fp8_block_scaled_mm(a, b, row_scale, col_scale, offs, block_k, out) -> bool
//       the grouped GEMM of codes as bf16 with per-block scales (blockwise recipes; the
//       scales constant along K, rowwise and tensorwise, repeated per block); a and b the
//       e4m3 codes themselves (each piece converted as the GEMM takes it) or bf16
//   fp8_block_scaled_mm_wgrad(a, b, row_scale, col_scale, offs, block, out) -> bool
//       its weight gradient over jagged blocks of rows
//   fp8_mx_mm(a, b, row_scale, col_scale, offs, block_k, out) -> bool
//   fp8_mx_mm_wgrad(a, b, row_scale, col_scale, offs, block, out) -> bool
//       MX's grouped GEMM and weight gradient: each piece of the codes times its blocks'
//       scales into bf16 as the GEMM takes it, then the unscaled native bf16 GEMM
//   fp8_mx_few_rows_mm(x, b, scale, offs, out) -> bool
//       MX's forward at a few rows per group: the few-rows kernel's bits on the
//       dequantized weight, each code times its scale in registers
//   fp8_dequantize_scaled(q [R, C] e4m3fn, scale fp32, index?, block_rows, block, out fp32 / bf16)
//       out = q.float() * scale[r / block_rows (or index[r]), c / block]   (dequantizers)
//   fp8_quantize_rows(x [R, C] fp32 / bf16 / fp16, block_rows, block, q [R, C] e4m3fn,
//                     scale [ceil(R / block_rows), ceil(C / block)], rule)
//       per block of block_rows x block elements (the last ones shorter), rule 0 (FP8,
//       fp32 scale): scale = max|x| / 448 (1 where that is not > 0: zeros, NaN); rule 1 /
//       2 (MX, uint8 scale): the E8M0 power of two of the "floor" / "rceil" rule; then
//       q = cast(x / scale). quantize_fp8's and quantize_mx's CPU kernels, in two
//       passes over each block row: its columns' maxima, then its codes (the rows still
//       in cache for blocks of a few rows).
//   fp8_quantize_jagged(x, offs, block, q, scale, rule) -> bool
//       quantize_jagged's: every segment's blocks of rows, each column its own scale
//
// ATen converts fp32 to e4m3fn one element at a time (c10's fp8e4m3fn_from_fp32_value),
// 0.5-0.7 ns per element on the CPUs measured, and e4m3fn to fp32 at ~4 ns per element:
// the FP8 emulation's quantizers and dequantizers spent most of their time there
// (benchmarks/results/cpu_floor_cpu_202612.md). These kernels take a vector of lanes a step
// with the same bits: the cast (cast8 / cast16: 8 lanes with AVX2, 16 with AVX-512, masked
// loads and stores for a row's tail there) clamps, then rounds to nearest even by one fp32
// addition and reads the code from the sum's bits (NaN to 0x7F with x's sign; the clamp
// keeps NaN, as ATen's clamp does; equal to ATen on all 2^32 fp32 values, with and without
// flush-to-zero); the other way ATen's values from a 128-entry table by permutes, 32 codes
// a step with AVX-512 (Bf16Codes), else c10's by shifts (values8; tails from a table of
// ATen's own 256 values). Each op returns false without touching its
// outputs where it does not apply (another layout or dtype, a build without AVX2
// vectors): the caller runs ATen.

#include "gemm_bf16_cpu.h"
#include "sgemm_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr float kMax = 448.0f;  // e4m3fn's largest finite value

// Whether a and b have one shape and a contiguous last dim (the kernels walk rows).
bool rows_apply(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.dim() == 0) return false;
  return (a.stride(-1) == 1 || a.size(-1) <= 1) && (b.stride(-1) == 1 || b.size(-1) <= 1);
}

// Pointers to row r's first element of a tensor with a contiguous last dim (its leading
// dims in any strides).
struct Rows {
  char* base;
  std::vector<int64_t> sizes, strides;  // leading dims, in elements
  int64_t item;
  Rows(const at::Tensor& t)
      : base(static_cast<char*>(const_cast<void*>(t.const_data_ptr()))),
        sizes(t.sizes().begin(), t.sizes().end() - 1),
        strides(t.strides().begin(), t.strides().end() - 1),
        item(t.element_size()) {}
  template <class T>
  T* row(int64_t r) const {
    int64_t off = 0;
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
      off += (r % sizes[d]) * strides[d];
      r /= sizes[d];
    }
    return reinterpret_cast<T*>(base + off * item);
  }
};

// Rows of `cols` elements in tasks of at least ~64K elements.
template <class F>
void for_rows(int64_t rows, int64_t cols, const F& f) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, cols));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

// ATen's fp32 value of each code (NaN codes included, bit for bit).
const std::array<float, 256>& fp8_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) {
      t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    }
    return t;
  }();
  return table;
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)

// 8 floats clamped and cast, one code in the low byte of each 32-bit lane (c10's bits):
// the magnitude clamped to 448 (NaN kept: min_ps returns its second operand where either is
// NaN), then rounded to e4m3's step in its binade 2^e, 2^(e-3) (2^-9 under 2^-6, e = -6
// there), by one fp32 addition of 2^(e+20) (round to nearest even: the sum's last bit is
// the code's), whose mantissa field is then the magnitude in steps, k in [0, 16]: the code
// is (e + 6) * 8 + k (k = 16 carries into the next binade's code). NaN's sum is NaN and its
// "code" past 0x7F unsigned: capped to 0x7F. Then the sign. Nothing here makes an fp32
// denormal (a denormal result costs a microcode assist on some cores: reading subnormal
// codes from x * 2^-120 ran 2x slower on a Zen 4 where most codes were subnormal).
inline __m256i cast8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i mag_bits = _mm256_and_si256(bits, _mm256_set1_epi32(INT32_MAX));
  const __m256i sign = _mm256_xor_si256(bits, mag_bits);
  const __m256 mag = _mm256_min_ps(_mm256_set1_ps(kMax), _mm256_castsi256_ps(mag_bits));
  const __m256i binade = _mm256_max_epi32(  // 2^e's bits
      _mm256_and_si256(_mm256_castps_si256(mag), _mm256_set1_epi32(0x7F800000)),
      _mm256_set1_epi32(121 << 23));
  const __m256i magic = _mm256_add_epi32(binade, _mm256_set1_epi32(20 << 23));  // 2^(e+20)
  const __m256i steps = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(mag, _mm256_castsi256_ps(magic))), magic);
  const __m256i code = _mm256_add_epi32(
      steps, _mm256_sub_epi32(_mm256_srli_epi32(binade, 20), _mm256_set1_epi32(121 * 8)));
  return _mm256_or_si256(_mm256_min_epu32(code, _mm256_set1_epi32(0x7F)),
                         _mm256_srli_epi32(sign, 24));
}

// The low bytes of 8 lanes stored as 8 bytes.
inline void store8(uint8_t* o, __m256i codes) {
  const __m256i shuf = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_shuffle_epi8(codes, shuf);  // bytes 0-3 of each 128-bit lane
  const __m256i two = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(two));
}

#if defined(CPU_CAPABILITY_AVX512)
// cast8's steps in 16 lanes.
inline __m512i cast16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i mag_bits = _mm512_and_si512(bits, _mm512_set1_epi32(INT32_MAX));
  const __m512i sign = _mm512_xor_si512(bits, mag_bits);
  const __m512 mag = _mm512_min_ps(_mm512_set1_ps(kMax), _mm512_castsi512_ps(mag_bits));
  const __m512i binade = _mm512_max_epi32(
      _mm512_and_si512(_mm512_castps_si512(mag), _mm512_set1_epi32(0x7F800000)),
      _mm512_set1_epi32(121 << 23));
  const __m512i magic = _mm512_add_epi32(binade, _mm512_set1_epi32(20 << 23));
  const __m512i steps = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(mag, _mm512_castsi512_ps(magic))), magic);
  const __m512i code = _mm512_add_epi32(
      steps, _mm512_sub_epi32(_mm512_srli_epi32(binade, 20), _mm512_set1_epi32(121 * 8)));
  return _mm512_or_si512(_mm512_min_epu32(code, _mm512_set1_epi32(0x7F)),
                         _mm512_srli_epi32(sign, 24));
}
#endif

// The quantizers' vectors: fp32 lanes of a row (kWidth of them: 16 with AVX-512, else 8),
// loaded from fp32 / bf16 / fp16 (the first n, zeros past them where n < kWidth); a block's
// largest magnitude as integer bits (a magnitude's bits order as its value, and NaN's lie
// above +inf's 0x7F800000: the maximum of the bits is the largest magnitude or a NaN);
// codes cast and stored (the first n where n < kWidth).
#if defined(CPU_CAPABILITY_AVX512)
struct Lanes {
  using F = __m512;
  using I = __m512i;
  static constexpr int64_t kWidth = 16;
  static __mmask16 first(int64_t n) {
    return n >= kWidth ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  }
  template <class T>
  static F load(const T* p, int64_t n) {
    if constexpr (std::is_same_v<T, float>) {
      return n >= kWidth ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(first(n), p);
    } else {
      const __m256i h = n >= kWidth ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                    : _mm256_maskz_loadu_epi16(first(n), p);
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      } else {
        return _mm512_cvtph_ps(h);
      }
    }
  }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static I mag_bits(F v) {
    return _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MAX));
  }
  static I max(I a, I b) { return _mm512_max_epi32(a, b); }
  static I zero() { return _mm512_setzero_si512(); }
  static I loadi(const int32_t* p) { return _mm512_loadu_si512(p); }
  static void storei(int32_t* p, I v) { _mm512_storeu_si512(p, v); }
  static int32_t reduce_max(I v) { return _mm512_reduce_max_epi32(v); }
  static void store_codes(uint8_t* o, F v, int64_t n) {
    const __m128i codes = _mm512_cvtepi32_epi8(cast16(v));  // vpmovdb
    if (n >= kWidth) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), codes);
    } else {
      _mm_mask_storeu_epi8(o, first(n), codes);
    }
  }
};
#else
struct Lanes {
  using F = __m256;
  using I = __m256i;
  static constexpr int64_t kWidth = 8;
  template <class T>
  static F load(const T* p, int64_t n) {
    if (n >= kWidth) {
      if constexpr (std::is_same_v<T, float>) {
        return _mm256_loadu_ps(p);
      } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      } else {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      }
    }
    alignas(32) float v[kWidth] = {};
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(p[i]);
    return _mm256_load_ps(v);
  }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static I mag_bits(F v) {
    return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(INT32_MAX));
  }
  static I max(I a, I b) { return _mm256_max_epi32(a, b); }
  static I zero() { return _mm256_setzero_si256(); }
  static I loadi(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void storei(int32_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static int32_t reduce_max(I v) {
    alignas(32) int32_t lanes[kWidth];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
    return *std::max_element(lanes, lanes + kWidth);
  }
  static void store_codes(uint8_t* o, F v, int64_t n) {
    if (n >= kWidth) {
      store8(o, cast8(v));
      return;
    }
    alignas(8) uint8_t codes[kWidth];
    store8(codes, cast8(v));
    std::memcpy(o, codes, n);
  }
};
#endif

// ATen's fp32 values of 8 codes, bit for bit (fp8_values'; c10's fp8e4m3fn_to_fp32_value
// lane by lane): a normal code's exponent and mantissa shifted into place and rebiased
// (+120), a subnormal one (exponent 0: m * 2^-9, zero included) by an exact int-to-float
// conversion, NaN (0x7F, 0xFF) as c10's 0x7FF00000, then the sign. (A gather from the
// table ran at 2.0-2.6 G codes/s on one Zen 4 core, this at 5.4-6.5.)
inline __m256 values8(const uint8_t* codes) {
  int64_t eight;
  std::memcpy(&eight, codes, 8);
  const __m256i x = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(eight));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  const __m256i em = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
  const __m256i normal =
      _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / 512));
  __m256i r = _mm256_blendv_epi8(normal, _mm256_castps_si256(sub),
                                 _mm256_cmpgt_epi32(_mm256_set1_epi32(8), em));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FF00000),
                         _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F)));
  return _mm256_castsi256_ps(_mm256_or_si256(r, sign));
}

// f(source row, destination row, cols) over every row of src and dst (of dtypes `in` and
// `out`, one shape, contiguous last dims), in parallel; false where they do not apply.
template <class In, class Out, class F>
bool convert_rows(const at::Tensor& src, at::Tensor& dst, at::ScalarType in, at::ScalarType out,
                  const F& f) {
  if (src.scalar_type() != in || dst.scalar_type() != out || !rows_apply(src, dst)) return false;
  if (src.numel() == 0) return true;
  const int64_t cols = src.size(-1), rows = src.numel() / cols;
  const Rows from(src), to(dst);
  for_rows(rows, cols, [&](int64_t r) { f(from.row<const In>(r), to.row<Out>(r), cols); });
  return true;
}

bool fp8_from_float(const at::Tensor& x, at::Tensor& out) {
  return convert_rows<float, uint8_t>(
      x, out, at::kFloat, at::kFloat8_e4m3fn, [](const float* s, uint8_t* o, int64_t cols) {
        for (int64_t j = 0; j < cols; j += Lanes::kWidth) {
          Lanes::store_codes(o + j, Lanes::load(s + j, cols - j), cols - j);
        }
      });
}

#if defined(CPU_CAPABILITY_AVX512)
// ATen's values of 32 codes at a time as bf16 bits (e4m3fn's values are bf16 values: the
// high halves of fp8_values', NaN's 0x7FF0): each magnitude's bits looked up in a table of
// 128 16-bit entries by two two-register permutes (vpermt2w, 64 entries each; the index's
// bits above 5 are ignored), the one for the magnitude's bit 6 kept, then the sign. (values8
// takes ~12 operations for 8 codes, this ~8 for 32.) n < 32: the first n codes, zeros past.
class Bf16Codes {
 public:
  Bf16Codes() {
    alignas(64) uint16_t t[128];
    for (int m = 0; m < 128; ++m) {
      uint32_t bits;
      std::memcpy(&bits, &fp8_values()[m], sizeof(bits));
      t[m] = static_cast<uint16_t>(bits >> 16);
    }
    for (int i = 0; i < 4; ++i) table_[i] = _mm512_load_si512(t + 32 * i);
  }
  __m512i operator()(const uint8_t* codes, int64_t n) const {
    return of(n >= 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes))
                      : _mm256_maskz_loadu_epi8(first(n), codes));
  }
  // the 32 codes `bytes` (in order)
  __m512i of(__m256i bytes) const {
    const __m512i x = _mm512_cvtepu8_epi16(bytes);
    const __m512i lo = _mm512_permutex2var_epi16(table_[0], x, table_[1]);
    const __m512i hi = _mm512_permutex2var_epi16(table_[2], x, table_[3]);
    const __m512i mag =
        _mm512_mask_blend_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40)), lo, hi);
    return _mm512_or_si512(mag, _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8));
  }
  static __mmask32 first(int64_t n) {
    return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint32_t{1} << n) - 1);
  }

 private:
  __m512i table_[4];
};

// The 32 bf16 values' fp32 bits, 16 at a time (exact: the high halves above zeros).
inline __m512 bf16_lo16(__m512i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
}
inline __m512 bf16_hi16(__m512i v) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
}
#endif

// 8 lanes' low 16 bits stored as 8 16-bit values.
inline void store8_u16(uint16_t* o, __m256i lanes) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o),
                   _mm_packus_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1)));
}

#if defined(CPU_CAPABILITY_AVX512)
// 32 16-bit lanes v stored at o, the first n of them where n < 32.
inline void store32_u16(uint16_t* o, __m512i v, int64_t n) {
  if (n >= 32) {
    _mm512_storeu_si512(o, v);
  } else {
    _mm512_mask_storeu_epi16(o, Bf16Codes::first(n), v);
  }
}

// rows x cols codes (row stride ld) as bf16 values into o (row stride ldo), exactly.
void codes_to_bf16(const uint8_t* s, int64_t ld, int64_t rows, int64_t cols, uint16_t* o,
                   int64_t ldo) {
  static const Bf16Codes bf16_codes;
  for (int64_t r = 0; r < rows; ++r, s += ld, o += ldo) {
    for (int64_t j = 0; j < cols; j += 32) {
      store32_u16(o + j, bf16_codes(s + j, cols - j), cols - j);
    }
  }
}
#endif

bool fp8_to_float(const at::Tensor& q, at::Tensor& out) {
#if defined(CPU_CAPABILITY_AVX512)
  static const Bf16Codes bf16_codes;
  if (out.scalar_type() == at::kBFloat16) {
    return convert_rows<uint8_t, uint16_t>(
        q, out, at::kFloat8_e4m3fn, at::kBFloat16, [](const uint8_t* s, uint16_t* o, int64_t cols) {
          codes_to_bf16(s, 0, 1, cols, o, 0);
        });
  }
  return convert_rows<uint8_t, float>(
      q, out, at::kFloat8_e4m3fn, at::kFloat, [](const uint8_t* s, float* o, int64_t cols) {
        for (int64_t j = 0; j < cols; j += 32) {
          const __m512i v = bf16_codes(s + j, cols - j);
          const int64_t n = cols - j;
          if (n >= 32) {
            _mm512_storeu_ps(o + j, bf16_lo16(v));
            _mm512_storeu_ps(o + j + 16, bf16_hi16(v));
            continue;
          }
          _mm512_mask_storeu_ps(o + j, static_cast<__mmask16>(Bf16Codes::first(n)), bf16_lo16(v));
          if (n > 16) {
            _mm512_mask_storeu_ps(o + j + 16, static_cast<__mmask16>(Bf16Codes::first(n - 16)),
                                  bf16_hi16(v));
          }
        }
      });
#else
  const float* table = fp8_values().data();
  if (out.scalar_type() == at::kBFloat16) {  // e4m3fn's values are bf16 values: high halves
    return convert_rows<uint8_t, uint16_t>(
        q, out, at::kFloat8_e4m3fn, at::kBFloat16,
        [table](const uint8_t* s, uint16_t* o, int64_t cols) {
          int64_t j = 0;
          for (; j + 8 <= cols; j += 8) {
            store8_u16(o + j, _mm256_srli_epi32(_mm256_castps_si256(values8(s + j)), 16));
          }
          for (; j < cols; ++j) {  // the high half, as the vectors take it
            uint32_t bits;
            std::memcpy(&bits, &table[s[j]], 4);
            o[j] = static_cast<uint16_t>(bits >> 16);
          }
        });
  }
  return convert_rows<uint8_t, float>(
      q, out, at::kFloat8_e4m3fn, at::kFloat, [table](const uint8_t* s, float* o, int64_t cols) {
        int64_t j = 0;
        for (; j + 8 <= cols; j += 8) _mm256_storeu_ps(o + j, values8(s + j));
        for (; j < cols; ++j) o[j] = table[s[j]];
      });
#endif
}

// fp32 values rounded to bf16 as ATen's vectorized conversion (a tensor's copy) rounds
// them: to nearest even, NaN to 0xFFFF (c10::BFloat16's scalar rounding, ATen's copy's
// tail, gives 0x7FC0); 8 of them, one in the low 16 bits of each lane, or with AVX-512
// 16 of them packed.
inline __m256i round8_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), nan);
}
#if defined(CPU_CAPABILITY_AVX512)
inline __m256i round16_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0xFFFF)));
}

// The first lanes of k of 16 products into o: fp32, or rounded to bf16.
inline void store16(float* o, __mmask16 k, __m512 v) { _mm512_mask_storeu_ps(o, k, v); }
inline void store16(uint16_t* o, __mmask16 k, __m512 v) {
  _mm256_mask_storeu_epi16(o, k, round16_bf16(v));
}

// Powers of two as scales of bf16 values (MX's E8M0 scales), 32 at a time in 16-bit lanes:
// a scale 2^e with e in [-117, 119] multiplies every e4m3 value (0, NaN, or a magnitude in
// [2^-9, 448]) into bf16's normal range, exactly: the product's bits are the value's with
// e added to the exponent field (e << 7 added to the bits; not to a zero; NaN's product
// ATen's 0xFFFF, as round16_bf16 rounds it). A scale's bits: a power of two in that range
// has a zero low half and a high half of e + 127 above 7 zero bits (a negative one's high
// half, its sign bit set, past kHigh).
struct Pow2Scales {
  static constexpr int16_t kLow = (127 - 117) << 7, kHigh = (127 + 119) << 7;
  // the scale 2^e's steps (e << 7), and whether it is such a scale
  static bool steps(float scale, __m512i& out) {
    uint32_t bits;
    std::memcpy(&bits, &scale, sizeof(bits));
    const uint32_t high = bits >> 16;
    out = _mm512_set1_epi16(static_cast<int16_t>(high - (127 << 7)));
    return (bits & 0x7FFFFFu) == 0 && high >= static_cast<uint32_t>(kLow) &&
           high <= static_cast<uint32_t>(kHigh);
  }
  // 32 scales' steps (the first n; 1.0's past them), and whether each is such a scale
  static bool steps(const float* scale, int64_t n, __m512i& out) {
    const __mmask16 k0 = static_cast<__mmask16>(Bf16Codes::first(n));
    const __mmask16 k1 = static_cast<__mmask16>(n > 16 ? Bf16Codes::first(n - 16) : 0);
    const __m512i one = _mm512_set1_epi32(0x3F800000);
    const __m512i a = _mm512_mask_loadu_epi32(one, k0, scale);
    const __m512i b = _mm512_mask_loadu_epi32(one, k1, scale + 16);
    const __m512i low = _mm512_permutex2var_epi16(a, words(0), b);
    const __m512i high = _mm512_permutex2var_epi16(a, words(1), b);
    const __mmask32 ok =
        _mm512_testn_epi16_mask(low, low) &
        _mm512_testn_epi16_mask(high, _mm512_set1_epi16(0x7F)) &
        _mm512_cmpge_epu16_mask(high, _mm512_set1_epi16(kLow)) &
        _mm512_cmple_epu16_mask(high, _mm512_set1_epi16(kHigh));
    out = _mm512_sub_epi16(high, _mm512_set1_epi16(127 << 7));
    return ok == ~__mmask32{0};
  }
  // 32 codes' bf16 values times their scales (steps)
  static __m512i apply(__m512i v, __m512i steps) {
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7FFF));
    const __m512i r = _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(mag, mag), v, steps);
    return _mm512_mask_mov_epi16(r, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7FF0)),
                                 _mm512_set1_epi16(-1));
  }
  // word `half` (0 low, 1 high) of each of 32 32-bit lanes of two registers, in order
  static __m512i words(int half) {
    alignas(64) static const auto table = [] {
      std::array<std::array<uint16_t, 32>, 2> t{};
      for (int i = 0; i < 32; ++i) {
        t[0][i] = static_cast<uint16_t>(2 * i);
        t[1][i] = static_cast<uint16_t>(2 * i + 1);
      }
      return t;
    }();
    return _mm512_load_si512(table[half].data());
  }
};

// One row of `cols` codes s times their scales into o, fp32 or rounded to bf16 (store16):
// column j's scale srow[j] where bc is 1, else its block's srow[(j / bc) * sstride]
// (blocks of bc columns from column 0). 32 codes a step (Bf16Codes), each product one
// fp32 multiplication (ATen's product's bits); into bf16, by Pow2Scales where the step's
// scales are powers of two it takes (the same bits, ~2.5x fewer operations).
template <class Out>
inline void dequantize_row(const Bf16Codes& codes, const uint8_t* s, int64_t cols,
                           const float* srow, int64_t bc, int64_t sstride, Out* o) {
  constexpr bool kBf16 = std::is_same_v<Out, uint16_t>;
  for (int64_t j0 = 0; j0 < cols; j0 += bc == 1 ? cols : bc) {
    const int64_t j1 = bc == 1 ? cols : std::min(cols, j0 + bc);
    const float block_scale = srow[bc == 1 ? 0 : (j0 / bc) * sstride];
    const __m512 f = _mm512_set1_ps(block_scale);
    __m512i steps = _mm512_setzero_si512();
    const bool block_pow2 = kBf16 && bc != 1 && Pow2Scales::steps(block_scale, steps);
    for (int64_t j = j0; j < j1; j += 32) {
      const __m512i v = codes(s + j, j1 - j);
      if constexpr (kBf16) {
        if (block_pow2 || (bc == 1 && Pow2Scales::steps(srow + j, j1 - j, steps))) {
          store32_u16(o + j, Pow2Scales::apply(v, steps), j1 - j);
          continue;
        }
      }
      for (int64_t h = 0; h < 2 && j + 16 * h < j1; ++h) {  // its two halves of 16
        const int64_t c = j + 16 * h;
        const __mmask16 k = static_cast<__mmask16>(Bf16Codes::first(j1 - c));
        const __m512 sc = bc == 1 ? _mm512_maskz_loadu_ps(k, srow + c) : f;
        store16(o + c, k, _mm512_mul_ps(h == 0 ? bf16_lo16(v) : bf16_hi16(v), sc));
      }
    }
  }
}
// A row of per-column scales shared by the consecutive rows of codes that follow it (a
// weight gradient's jagged block of rows, a row-major expert's k block): its Pow2Scales
// steps formed once (for the row at `scale`, the last asked for), then each row of codes
// times them; rows under any other scale by dequantize_row. For one piece's rows (the
// scales of another call may lie at the same address).
class ScaleRowSteps {
 public:
  // One row of `cols` codes s times the per-column scales at `scale` into o (bf16).
  void dequantize(const Bf16Codes& codes, const uint8_t* s, int64_t cols, const float* scale,
                  uint16_t* o) {
    if (scale != key_ || cols != cols_) {
      key_ = scale;
      cols_ = cols;
      steps_ = torch_moe_cpu::aligned_scratch(buf_, (cols + 31) / 32 * 32);
      pow2_ = true;
      for (int64_t j = 0; j < cols; j += 32) {
        __m512i v;
        pow2_ = Pow2Scales::steps(scale + j, cols - j, v) && pow2_;
        _mm512_store_si512(steps_ + j, v);
      }
    }
    if (!pow2_) {
      dequantize_row(codes, s, cols, scale, 1, 1, o);
      return;
    }
    for (int64_t j = 0; j < cols; j += 32) {
      const __m512i st = _mm512_load_si512(steps_ + j);
      store32_u16(o + j, Pow2Scales::apply(codes(s + j, cols - j), st), cols - j);
    }
  }

 private:
  std::vector<int16_t> buf_;
  int16_t* steps_ = nullptr;  // (in buf_)
  const float* key_ = nullptr;
  int64_t cols_ = -1;
  bool pow2_ = false;
};
#endif

// 8 products into o: fp32, or rounded to bf16; and one.
inline void store8(float* o, __m256 v) { _mm256_storeu_ps(o, v); }
inline void store8(uint16_t* o, __m256 v) { store8_u16(o, round8_bf16(v)); }
inline void store1(float* o, float v) { *o = v; }
inline void store1(uint16_t* o, float v) { *o = std::isnan(v) ? 0xFFFF : c10::BFloat16(v).x; }

// One row of `cols` codes s times their scales into o (fp32, ATen's product's bits; or
// that product rounded to bf16 as ATen's vectorized copy rounds it): column j's scale
// srow[j] where bc is 1, else its block's srow[(j / bc) * ss] (blocks of bc columns from
// column 0): dequantize_row with AVX-512, else 8 codes a step (values8).
template <class Out>
inline void dequantize_codes(const uint8_t* s, int64_t cols, const float* srow, int64_t bc,
                             int64_t ss, Out* o) {
#if defined(CPU_CAPABILITY_AVX512)
  static const Bf16Codes bf16_codes;
  dequantize_row(bf16_codes, s, cols, srow, bc, ss, o);
#else
  const float* table = fp8_values().data();  // (the rows' tails)
  if (bc == 1) {  // a scale per column: 8 of them a step
    int64_t j = 0;
    for (; j + 8 <= cols; j += 8) {
      store8(o + j, _mm256_mul_ps(values8(s + j), _mm256_loadu_ps(srow + j)));
    }
    for (; j < cols; ++j) store1(o + j, table[s[j]] * srow[j]);
    return;
  }
  for (int64_t j0 = 0; j0 < cols; j0 += bc) {
    const int64_t j1 = std::min(cols, j0 + bc);
    const float f = srow[(j0 / bc) * ss];
    const __m256 fv = _mm256_set1_ps(f);
    int64_t j = j0;
    for (; j + 8 <= j1; j += 8) store8(o + j, _mm256_mul_ps(values8(s + j), fv));
    for (; j < j1; ++j) store1(o + j, table[s[j]] * f);
  }
#endif
}

// A row index (int64, 1-D, contiguous, `rows` entries, each in [0, bound)) as a pointer
// into idx (nullptr without one); false where it is not that.
bool read_index(const std::optional<at::Tensor>& index, int64_t rows, int64_t bound,
                const int64_t*& idx) {
  idx = nullptr;
  if (!index.has_value()) return true;
  if (index->scalar_type() != at::kLong || index->dim() != 1 || index->size(0) != rows ||
      !index->is_contiguous()) {
    return false;
  }
  const int64_t* p = index->const_data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    if (p[r] < 0 || p[r] >= bound) return false;
  }
  idx = p;
  return true;
}

// out [R, C] = q.float() * scale[row's scale row, c / bc] (fp32, ATen's product's bits;
// or bf16: that product rounded as ATen's vectorized copy rounds it): row r's scale row is index[r]
// (int64) where given, else r / br; q and out row-major (any row strides), scale [*,
// ceil(C / bc)] contiguous fp32. (MX's bf16 operands: their products are exact, powers of
// two times codes, so the bf16 copy is exact but where it over- or underflows, as ATen's.)
bool fp8_dequantize_scaled(const at::Tensor& q, const at::Tensor& scale,
                           const std::optional<at::Tensor>& index, int64_t br, int64_t bc,
                           at::Tensor& out) {
  const bool bf16_out = out.scalar_type() == at::kBFloat16;
  if (q.scalar_type() != at::kFloat8_e4m3fn || (out.scalar_type() != at::kFloat && !bf16_out) ||
      q.dim() != 2 || out.sizes() != q.sizes() || scale.scalar_type() != at::kFloat ||
      scale.dim() != 2 || !scale.is_contiguous() || br < 1 || bc < 1 || !rows_apply(q, out)) {
    return false;
  }
  const int64_t rows = q.size(0), cols = q.size(1), nc = (cols + bc - 1) / bc;
  if (scale.size(1) != nc) return false;
  const int64_t* idx = nullptr;  // every scale row read is one of scale's
  if (!read_index(index, rows, scale.size(0), idx)) return false;
  if (idx == nullptr && rows > 0 && (rows - 1) / br >= scale.size(0)) return false;
  if (q.numel() == 0) return true;
  const float* sp = scale.const_data_ptr<float>();
  const auto* qp = static_cast<const uint8_t*>(q.const_data_ptr());
  const int64_t ldq = q.stride(0), ldo = out.stride(0);
  auto run = [&](auto* op) {
    for_rows(rows, cols, [&](int64_t r) {
      const float* srow = sp + (idx != nullptr ? idx[r] : r / br) * nc;
      dequantize_codes(qp + r * ldq, cols, srow, bc, 1, op + r * ldo);
    });
  };
  if (bf16_out) {
    run(reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>()));
  } else {
    run(out.mutable_data_ptr<float>());
  }
  return true;
}

// A block's divisor from its largest magnitude (NaN where any element is NaN), stored
// into s at b: FP8 (rule 0) amax / 448 in fp32 (IEEE: ATen's division), 1 where that is
// not > 0 (zeros, NaN), stored as it is; MX (rule 1 "floor", 2 "rceil") the power of two
// 2^e, e = floor(log2 amax) - 8 (+1 under rceil where amax's frexp mantissa is over
// 0.875), from frexp as quantize.py's mx_scale_exponent (frexp(inf) gives exponent 0, as
// ATen's), -127 where amax is not > 0, clamped to [-127, 127], stored as e + 127 (uint8).
inline float block_divisor(float amax, bool any_nan, int rule, void* s, int64_t b) {
  if (rule == 0) {
    const float scale = any_nan ? 1.0f : (amax / kMax > 0.0f ? amax / kMax : 1.0f);
    static_cast<float*>(s)[b] = scale;
    return scale;
  }
  int e = -127;
  if (!any_nan && amax > 0.0f) {
    int exp = 0;
    float mant = amax;  // (frexp(inf): exponent 0)
    uint32_t bits;
    std::memcpy(&bits, &amax, sizeof(bits));
    const uint32_t biased = bits >> 23;
    if (biased >= 1 && biased < 255) {  // normal: frexp from the bits (a libm call otherwise)
      exp = static_cast<int>(biased) - 126;
      const uint32_t half = (bits & 0x807FFFFFu) | (126u << 23);  // in [0.5, 1)
      std::memcpy(&mant, &half, sizeof(mant));
    } else if (!std::isinf(amax)) {
      mant = std::frexp(amax, &exp);
    }
    e = exp - 1 - 8 + (rule == 2 && mant > 0.875f ? 1 : 0);
  }
  e = std::clamp(e, -127, 127);
  static_cast<uint8_t*>(s)[b] = static_cast<uint8_t>(e + 127);
  const uint32_t bits = e >= -126 ? static_cast<uint32_t>(e + 127) << 23 : uint32_t{1} << 22;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return scale;
}

// A block row taller than a task (a tensorwise scale's one block, a per-column scale's
// rows) by torch's threads: ranges of about 64K elements (inline within a parallel region).
inline int64_t tall_grain(int64_t cols) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(cols, 1));
}

// The columns' maxima over rows [0, br) into cmax (`padded` lanes, padded lanes 0):
// maxima(r0, r1, out) writes rows [r0, r1)'s; a block row taller than `grain` rows by
// torch's threads, each range's maxima in its thread's buffer, merged under a mutex.
template <class V, class M>
void column_maxima(int64_t br, int64_t padded, int64_t grain, V* cmax, const M& maxima) {
  if (br <= grain) {
    maxima(0, br, cmax);
    return;
  }
  std::fill(cmax, cmax + padded, V{0});  // (0: the least magnitude's bits)
  std::mutex merge;
  at::parallel_for(0, br, grain, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<V> part_buf;  // (not the caller's buffer: another variable)
    V* const part = torch_moe_cpu::aligned_scratch(part_buf, padded);
    maxima(r0, r1, part);
    const std::lock_guard<std::mutex> lock(merge);
    for (int64_t j = 0; j < padded; ++j) cmax[j] = std::max(cmax[j], part[j]);
  });
}

// One row of blocks (rows [0, br) of x, row stride cols): each column's largest magnitude
// over the rows (as bits: NaN's above every number's), a vector of columns a step; each
// block's divisor from its columns' (block_divisor, its stored scale into s at the block's
// index); then each row's codes, every element divided by its block's divisor. Where the
// blocks start on whole vectors (block a multiple of the width, or one block), a block's
// columns are reduced a vector a step and its codes divided by its divisor broadcast;
// otherwise column by column through a row of each column's divisor. (For rowwise blocks,
// one row each, the column-by-column reduction and the zeroed buffers made the quantizer 2x
// slower: 0.77 G elements/s on one Zen 4 core.) A block row taller than a task by torch's
// threads (column_maxima, then the codes' rows in ranges).
template <class T>
void quantize_block_row(const T* x, int64_t br, int64_t cols, int64_t block, uint8_t* o,
                        void* s, int rule) {
  constexpr int64_t W = Lanes::kWidth;
  thread_local std::vector<int32_t> col_max;
  thread_local std::vector<float> col_scale, divisors;
  const int64_t padded = (cols + W - 1) / W * W, nb = (cols + block - 1) / block;
  // (the buffers' own pointers: the vectors' stores may alias any memory, the
  // thread_local vectors' data pointers would be reloaded after each one)
  int32_t* const cmax = torch_moe_cpu::aligned_scratch(col_max, padded);
  float* const cscale = torch_moe_cpu::aligned_scratch(col_scale, padded);
  float* const divisor = torch_moe_cpu::aligned_scratch(divisors, nb);
  const int64_t grain = tall_grain(cols);
  column_maxima(br, padded, grain, cmax, [&](int64_t r0, int64_t r1, int32_t* out) {
    for (int64_t r = r0; r < r1; ++r) {  // (loads zero-fill past cols: padded lanes 0)
      const T* xr = x + r * cols;
      for (int64_t j = 0; j < cols; j += W) {
        const auto m = Lanes::mag_bits(Lanes::load(xr + j, cols - j));
        Lanes::storei(out + j, r > r0 ? Lanes::max(Lanes::loadi(out + j), m) : m);
      }
    }
  });
  const bool whole = block % W == 0 || nb == 1;  // blocks start on whole vectors
  for (int64_t j0 = 0, b = 0; j0 < cols; j0 += block, ++b) {
    const int64_t j1 = std::min(cols, j0 + block);
    int32_t bits = 0;
    if (whole) {
      auto m = Lanes::zero();
      for (int64_t j = j0; j < j1; j += W) m = Lanes::max(m, Lanes::loadi(cmax + j));
      bits = Lanes::reduce_max(m);
    } else {
      for (int64_t j = j0; j < j1; ++j) bits = std::max(bits, cmax[j]);
    }
    float amax;
    std::memcpy(&amax, &bits, sizeof(amax));
    divisor[b] = block_divisor(amax, bits > 0x7F800000, rule, s, b);
  }
  if (!whole) {
    for (int64_t j0 = 0, b = 0; j0 < cols; j0 += block, ++b) {
      std::fill(cscale + j0, cscale + std::min(cols, j0 + block), divisor[b]);
    }
    std::fill(cscale + cols, cscale + padded, 1.0f);  // (lanes not stored: no stale divisor)
  }
  at::parallel_for(0, br, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * cols;
      uint8_t* orow = o + r * cols;
      if (!whole) {
        for (int64_t j = 0; j < cols; j += W) {
          const auto v = Lanes::div(Lanes::load(xr + j, cols - j), Lanes::loadf(cscale + j));
          Lanes::store_codes(orow + j, v, cols - j);
        }
        continue;
      }
      for (int64_t j0 = 0, b = 0; j0 < cols; j0 += block, ++b) {
        const int64_t j1 = std::min(cols, j0 + block);
        const auto d = Lanes::set1(divisor[b]);
        for (int64_t j = j0; j < j1; j += W) {
          Lanes::store_codes(orow + j, Lanes::div(Lanes::load(xr + j, j1 - j), d), j1 - j);
        }
      }
    }
  });
}

#if defined(CPU_CAPABILITY_AVX512)
// The bf16 quantizer's codes, 32 elements a step (AVX-512). The fp32 values come from
// _mm512_unpack{lo,hi}_epi16 with zeros below (one operation per 16 values, where a
// widening load and a shift take two), which leaves, within each 128-bit lane, the lane's
// first four elements in `lo` and the next four in `hi`: element i (of 32) in lane
// 4 * (i / 8) + i % 4 of lo (i % 8 < 4) or of hi. cast16's steps then run on the
// magnitudes (the sign is x's: a divisor is > 0), the sum's two 16-bit halves are brought
// back to the elements' order by two two-register word permutes, and the code is formed in
// 16-bit lanes from them: the sum of 2^(e+20) is 2^(e+20) + k 2^(e-3) with k in [0, 16], so
// its bits are its exponent field E = e + 147 above k, and the code (e + 6) * 8 + k is
// k + (E * 8) - 1128, E * 8 the high half shifted right by 4 (NaN's sum past 0x7F: capped,
// saturating arithmetic whatever its mantissa). 1.3-1.5x the 16-lane form's rate on a Zen 4
// core (cast16 forms its code in 32-bit lanes, one vpmovdb per 16).
class Bf16Quantizer {
 public:
  Bf16Quantizer() {
    alignas(64) uint16_t lo[32], hi[32];
    for (int i = 0; i < 32; ++i) {
      const int lane = unpacked_lane(i);  // of the 32 lanes [lo, hi]
      const int word = 2 * (lane % 16) + (lane >= 16 ? 32 : 0);
      lo[i] = static_cast<uint16_t>(word);
      hi[i] = static_cast<uint16_t>(word + 1);
    }
    low_ = _mm512_load_si512(lo);
    high_ = _mm512_load_si512(hi);
    alignas(64) int32_t first[16], second[16];  // the elements in lo's lanes, in hi's
    for (int i = 0; i < 32; ++i) (i % 8 < 4 ? first : second)[unpacked_lane(i) % 16] = i;
    lanes_lo_ = _mm512_load_si512(first);
    lanes_hi_ = _mm512_load_si512(second);
  }
  static constexpr int64_t kWidth = 32;  // values a step
  using F = __m512;
  // Element i's lane among the 32 of [lo, hi].
  static int unpacked_lane(int i) { return 4 * (i / 8) + i % 4 + (i % 8 >= 4 ? 16 : 0); }
  // 32 bf16 values (the first n, zeros past them where n < 32).
  static __m512i load(const c10::BFloat16* p, int64_t n) {
    return n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(Bf16Codes::first(n), p);
  }
  // m, the magnitudes of a step, into out: with `merge` the larger of m and out's
  static void store_maxima(uint16_t* out, __m512i m, bool merge) {
    _mm512_storeu_si512(out, merge ? _mm512_max_epu16(_mm512_loadu_si512(out), m) : m);
  }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  // 32 floats, one per element, into their unpacked lanes (o: lo's 16, then hi's).
  void unpack_lanes(const float* v, float* o) const {
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    _mm512_storeu_ps(o, _mm512_permutex2var_ps(a, lanes_lo_, b));
    _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(a, lanes_hi_, b));
  }
  static __m512i magnitudes(__m512i x) { return _mm512_and_si512(x, _mm512_set1_epi16(0x7FFF)); }
  // The codes of x / d (kMul: x * d, d the divisor's exact reciprocal), d in the unpacked
  // lanes (d_lo, d_hi), the first n stored at o.
  template <bool kMul>
  void store(uint8_t* o, __m512i x, __m512 d_lo, __m512 d_hi, int64_t n) const {
    const __m512i mag = magnitudes(x);
    __m512 lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), mag));
    __m512 hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), mag));
    if constexpr (kMul) {
      lo = _mm512_mul_ps(lo, d_lo);
      hi = _mm512_mul_ps(hi, d_hi);
    } else {
      lo = _mm512_div_ps(lo, d_lo);
      hi = _mm512_div_ps(hi, d_hi);
    }
    const __m512i s_lo = steps(lo), s_hi = steps(hi);
    const __m512i k = _mm512_permutex2var_epi16(s_lo, low_, s_hi);
    const __m512i e8 = _mm512_srli_epi16(_mm512_permutex2var_epi16(s_lo, high_, s_hi), 4);
    const __m512i code = _mm512_min_epu16(
        _mm512_subs_epu16(_mm512_adds_epu16(k, e8), _mm512_set1_epi16(1128)),
        _mm512_set1_epi16(0x7F));
    const __m512i signed_code =  // code | (x >> 8 & 0x80)
        _mm512_ternarylogic_epi32(code, _mm512_srli_epi16(x, 8), _mm512_set1_epi16(0x80), 0xF8);
    const __m256i bytes = _mm512_cvtepi16_epi8(signed_code);
    if (n >= 32) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), bytes);
    } else {
      _mm256_mask_storeu_epi8(o, Bf16Codes::first(n), bytes);
    }
  }

 private:
  // A magnitude (or NaN) clamped to 448 plus 2^(e+20) (cast16's sum), as bits.
  static __m512i steps(__m512 v) {
    const __m512 mag = _mm512_min_ps(_mm512_set1_ps(kMax), v);
    const __m512i binade = _mm512_max_epi32(
        _mm512_and_si512(_mm512_castps_si512(mag), _mm512_set1_epi32(0x7F800000)),
        _mm512_set1_epi32(121 << 23));
    const __m512i magic = _mm512_add_epi32(binade, _mm512_set1_epi32(20 << 23));
    return _mm512_castps_si512(_mm512_add_ps(mag, _mm512_castsi512_ps(magic)));
  }
  __m512i low_, high_, lanes_lo_, lanes_hi_;
};

// Each block's largest of the columns' maxima (cmax: cols 16-bit magnitudes, zeros past
// cols to a whole vector), blocks of `block` columns that start on whole vectors (a
// multiple of 32, or one block), as fp32 bits into bmax: 16 blocks a step, each block's vectors reduced to one (its words' pairs to the
// larger in both halves of each 32-bit lane: the lanes order as the larger words), then
// the 16 vectors to one by halving the lanes at each of four levels of two-register
// shuffles (94 operations for 16 blocks, where a reduction each took ~200), the block of
// lane i then the one a vpermd puts there.
void block_maxima(const uint16_t* cmax, int64_t cols, int64_t block, uint32_t* bmax) {
  const int64_t nb = (cols + block - 1) / block;
  alignas(64) static constexpr int32_t kOrder[16] = {0, 4, 8, 12, 1, 5, 9, 13,
                                                     2, 6, 10, 14, 3, 7, 11, 15};
  const __m512i order = _mm512_load_si512(kOrder);
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    __m512i w[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t j0 = (b0 + i) * block, j1 = std::min(cols, j0 + block);
      __m512i m = _mm512_setzero_si512();
      for (int64_t j = j0; j < j1; j += 32) m = _mm512_max_epu16(m, _mm512_loadu_si512(cmax + j));
      w[i] = _mm512_max_epu16(m, _mm512_rol_epi32(m, 16));
    }
    __m512i t[8], u[4];
    for (int p = 0; p < 8; ++p) {  // 8 lanes of each of a pair
      t[p] = _mm512_max_epu32(_mm512_shuffle_i32x4(w[2 * p], w[2 * p + 1], 0x44),
                              _mm512_shuffle_i32x4(w[2 * p], w[2 * p + 1], 0xEE));
    }
    for (int p = 0; p < 4; ++p) {  // 4 lanes each: a 128-bit lane a block
      u[p] = _mm512_max_epu32(_mm512_shuffle_i32x4(t[2 * p], t[2 * p + 1], 0x88),
                              _mm512_shuffle_i32x4(t[2 * p], t[2 * p + 1], 0xDD));
    }
    const __m512i x0 = _mm512_max_epu32(_mm512_unpacklo_epi32(u[0], u[1]),
                                        _mm512_unpackhi_epi32(u[0], u[1]));
    const __m512i x1 = _mm512_max_epu32(_mm512_unpacklo_epi32(u[2], u[3]),
                                        _mm512_unpackhi_epi32(u[2], u[3]));
    const __m512i y = _mm512_max_epu32(_mm512_unpacklo_epi64(x0, x1),
                                       _mm512_unpackhi_epi64(x0, x1));  // lane 4L + k: 4k + L
    const __m512i bits = _mm512_and_si512(_mm512_permutexvar_epi32(order, y),
                                          _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
    _mm512_mask_storeu_epi32(bmax + b0, Lanes::first(nb - b0), bits);
  }
}

// MX blocks' scales from their largest magnitudes' bits (block_divisor's rules 1 "floor"
// and 2 "rceil", 16 blocks a step): e = frexp's exponent - 9 = the biased exponent - 135
// (+1 under rceil where frexp's mantissa, in [0.5, 1), is over 0.875: the field over
// 0x600000), -9 (-8) for inf (frexp's exponent 0, its mantissa inf), -127 for NaN, at
// least -127 (zero and denormals, whose exponent frexp would take from their bits, at most
// -134 either way: -127; a number's e is at most 120, so no upper clamp); stored as e + 127
// into s, and the divisor's reciprocal 2^-e (exact) into recip. False where a divisor is 2^-127, an fp32 denormal (zero under
// flush-to-zero: quantize_block_row_bf16's general form then).
bool mx_reciprocals(const uint32_t* bits, int64_t nb, int rule, uint8_t* s, float* recip) {
  __mmask16 denormal_divisor = 0;
  for (int64_t i = 0; i < nb; i += 16) {
    const __mmask16 k = Lanes::first(nb - i);
    const __m512i b = _mm512_maskz_loadu_epi32(k, bits + i);
    __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(b, 23), _mm512_set1_epi32(135));
    if (rule == 2) {
      const __mmask16 up = _mm512_cmpgt_epi32_mask(
          _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFF)), _mm512_set1_epi32(0x600000));
      e = _mm512_mask_add_epi32(e, up, e, _mm512_set1_epi32(1));
    }
    e = _mm512_mask_mov_epi32(e, _mm512_cmpeq_epi32_mask(b, _mm512_set1_epi32(0x7F800000)),
                              _mm512_set1_epi32(rule == 2 ? -8 : -9));
    e = _mm512_mask_mov_epi32(e, _mm512_cmpgt_epu32_mask(b, _mm512_set1_epi32(0x7F800000)),
                              _mm512_set1_epi32(-127));
    e = _mm512_max_epi32(e, _mm512_set1_epi32(-127));  // (at most 120 here)
    const __m512i biased = _mm512_add_epi32(e, _mm512_set1_epi32(127));
    _mm_mask_storeu_epi8(s + i, k, _mm512_cvtepi32_epi8(biased));
    denormal_divisor |= k & _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(-127));
    _mm512_mask_storeu_epi32(recip + i, k,  // 2^-e
                             _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(127), e), 23));
  }
  return denormal_divisor == 0;
}

#else  // AVX2
// The bf16 quantizer's codes with AVX2, 16 elements a step: the AVX-512 form's arithmetic
// in 256-bit vectors. _mm256_unpack{lo,hi}_epi16 with zeros below give, within each
// 128-bit lane, the lane's first four elements (lo: elements 0-3 and 8-11) and its next
// four (hi: 4-7 and 12-15) as fp32; each sum's code is formed in its 32-bit lane as its
// high bits shifted right by 20 (E * 8) plus its low 16 bits (k), and one
// _mm256_packus_epi32 of lo's and hi's brings the 16 back to the elements' order (per
// 128-bit lane: lo's four, then hi's); then the bias, the cap, x's sign and one pack to
// bytes. On one core of the Zen 3 EPYC measured (AVX2 only) the general form (cast8's 8
// lanes a step, each code formed and packed in its 32-bit lane, the maxima in 32-bit
// lanes) quantized a bf16 weight rowwise at 0.8-1.3 G elements/s, per column at 1.1-1.7,
// MX's 32-element blocks at 1.0-1.1; this form at 2.0-2.1, 2.4-2.5 and 1.5-1.7
// (benchmarks/results/cpu_floor_cpu_202612.md).
class Bf16Quantizer {
 public:
  static constexpr int64_t kWidth = 16;
  using F = __m256;
  // 16 bf16 values (the first n, zeros past them where n < 16).
  static __m256i load(const c10::BFloat16* p, int64_t n) {
    if (n >= 16) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    alignas(32) uint16_t v[16] = {};
    std::memcpy(v, p, n * sizeof(uint16_t));
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(v));
  }
  static __m256i magnitudes(__m256i x) { return _mm256_and_si256(x, _mm256_set1_epi16(0x7FFF)); }
  static void store_maxima(uint16_t* out, __m256i m, bool merge) {
    auto* o = reinterpret_cast<__m256i*>(out);
    _mm256_storeu_si256(o, merge ? _mm256_max_epu16(_mm256_loadu_si256(o), m) : m);
  }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  // 16 floats, one per element, into their unpacked lanes (o: lo's 8, then hi's).
  void unpack_lanes(const float* v, float* o) const {
    const __m256 a = _mm256_loadu_ps(v), b = _mm256_loadu_ps(v + 8);
    _mm256_storeu_ps(o, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(a, b, 0x31));
  }
  // The codes of x / d (kMul: x * d, d the divisor's exact reciprocal), d in the unpacked
  // lanes (d_lo, d_hi), the first n stored at o.
  template <bool kMul>
  void store(uint8_t* o, __m256i x, __m256 d_lo, __m256 d_hi, int64_t n) const {
    const __m256i mag = magnitudes(x);
    __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), mag));
    __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), mag));
    if constexpr (kMul) {
      lo = _mm256_mul_ps(lo, d_lo);
      hi = _mm256_mul_ps(hi, d_hi);
    } else {
      lo = _mm256_div_ps(lo, d_lo);
      hi = _mm256_div_ps(hi, d_hi);
    }
    const __m256i code = _mm256_min_epu16(  // (a NaN's sum past 65535: saturated, capped)
        _mm256_subs_epu16(_mm256_packus_epi32(biased(lo), biased(hi)), _mm256_set1_epi16(1128)),
        _mm256_set1_epi16(0x7F));
    const __m256i signed_code = _mm256_or_si256(
        code, _mm256_and_si256(_mm256_srli_epi16(x, 8), _mm256_set1_epi16(0x80)));
    const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(signed_code),
                                           _mm256_extracti128_si256(signed_code, 1));
    if (n >= 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), bytes);
    } else {
      alignas(16) uint8_t b[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(b), bytes);
      std::memcpy(o, b, n);
    }
  }

 private:
  // A magnitude's (or NaN's) code plus 1128: its sum's (cast8's: the magnitude clamped to
  // 448 plus 2^(e+20)) E * 8 + k, as a 32-bit lane.
  static __m256i biased(__m256 v) {
    const __m256 mag = _mm256_min_ps(_mm256_set1_ps(kMax), v);
    const __m256i binade = _mm256_max_epi32(
        _mm256_and_si256(_mm256_castps_si256(mag), _mm256_set1_epi32(0x7F800000)),
        _mm256_set1_epi32(121 << 23));
    const __m256i magic = _mm256_add_epi32(binade, _mm256_set1_epi32(20 << 23));
    const __m256i sum = _mm256_castps_si256(_mm256_add_ps(mag, _mm256_castsi256_ps(magic)));
    return _mm256_add_epi32(_mm256_srli_epi32(sum, 20),
                            _mm256_and_si256(sum, _mm256_set1_epi32(0xFFFF)));
  }
};

// Each block's largest of the columns' maxima (16-bit magnitudes, zeros past cols), blocks
// of `block` columns that start on whole vectors, as fp32 bits into bmax.
void block_maxima(const uint16_t* cmax, int64_t cols, int64_t block, uint32_t* bmax) {
  for (int64_t j0 = 0, b = 0; j0 < cols; j0 += block, ++b) {
    __m256i m = _mm256_setzero_si256();
    for (int64_t j = j0; j < std::min(cols, j0 + block); j += 16) {
      m = _mm256_max_epu16(m, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cmax + j)));
    }
    __m128i h = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epu16(h, _mm_srli_si128(h, 8));
    h = _mm_max_epu16(h, _mm_srli_si128(h, 4));
    h = _mm_max_epu16(h, _mm_srli_si128(h, 2));
    bmax[b] = static_cast<uint32_t>(_mm_extract_epi16(h, 0)) << 16;
  }
}

// MX blocks' scales (block_divisor's rules 1 and 2) into s, and their divisors' exact
// reciprocals into recip; false where a divisor is 2^-127 (no normal reciprocal).
bool mx_reciprocals(const uint32_t* bits, int64_t nb, int rule, uint8_t* s, float* recip) {
  for (int64_t b = 0; b < nb; ++b) {
    float amax;
    std::memcpy(&amax, &bits[b], sizeof(amax));
    const float d = block_divisor(amax, bits[b] > 0x7F800000u, rule, s, b);
    if (d < 0x1p-126f) return false;
    recip[b] = 1.0f / d;  // (a power of two at most 2^120 from bf16: exact, normal)
  }
  return true;
}
#endif

// quantize_block_row for bf16 x by Bf16Quantizer: the columns' maxima in 16-bit lanes (a
// bf16 magnitude's bits order as its value, NaN's above inf's), then each block's divisor
// (block_divisor) and the codes a Bf16Quantizer step at a time (32 with AVX-512, 16 with
// AVX2), by the divisor's reciprocal where that is exact
// (MX: a power of two, at most 2^120 from a bf16 block, whose reciprocal is a normal fp32
// number: the same bits as a division, with or without flush-to-zero). False, its scales
// written but no code, where a divisor is inf (FP8, an inf in the block) or an fp32
// denormal (a block of zeros or denormals: zero under flush-to-zero): there ATen's inf /
// inf or 0 / 0 is the negative default NaN, whose sign is not x's, and the caller's
// general form, which takes the quotient's sign, runs.
bool quantize_block_row_bf16(const c10::BFloat16* x, int64_t br, int64_t cols, int64_t block,
                             uint8_t* o, void* s, int rule) {
  static const Bf16Quantizer quantizer;
  thread_local std::vector<uint16_t> col_max;
  thread_local std::vector<uint32_t> block_max;
  thread_local std::vector<float> col_div, divisors;
  constexpr int64_t W = Bf16Quantizer::kWidth;
  const int64_t padded = (cols + W - 1) / W * W, nb = (cols + block - 1) / block;
  uint16_t* const cmax = torch_moe_cpu::aligned_scratch(col_max, padded);
  uint32_t* const bmax = torch_moe_cpu::aligned_scratch(block_max, padded);
  float* const divisor = torch_moe_cpu::aligned_scratch(divisors, padded);
  const int64_t grain = tall_grain(cols);
  column_maxima(br, padded, grain, cmax, [&](int64_t r0, int64_t r1, uint16_t* out) {
    for (int64_t r = r0; r < r1; ++r) {  // (loads zero-fill past cols: padded lanes 0)
      const c10::BFloat16* xr = x + r * cols;
      for (int64_t j = 0; j < cols; j += W) {
        Bf16Quantizer::store_maxima(
            out + j, Bf16Quantizer::magnitudes(Bf16Quantizer::load(xr + j, cols - j)), r > r0);
      }
    }
  });
  // Each block's largest magnitude as fp32 bits.
  const bool whole = block % W == 0 || nb == 1;  // a step's columns in one block
  if (block == 1) {
    for (int64_t j = 0; j < cols; ++j) bmax[j] = uint32_t{cmax[j]} << 16;
  } else if (whole) {
    block_maxima(cmax, cols, block, bmax);
  } else {
    for (int64_t j0 = 0, b = 0; j0 < cols; j0 += block, ++b) {
      uint32_t bits = 0;
      for (int64_t j = j0; j < std::min(cols, j0 + block); ++j) {
        bits = std::max<uint32_t>(bits, uint32_t{cmax[j]} << 16);
      }
      bmax[b] = bits;
    }
  }
  // Each block's scale stored, and its divisor (FP8) or the divisor's reciprocal (MX).
  const bool exact_reciprocals = rule != 0;
  if (exact_reciprocals) {
    if (!mx_reciprocals(bmax, nb, rule, static_cast<uint8_t*>(s), divisor)) return false;
  } else {
    for (int64_t b = 0; b < nb; ++b) {
      float amax;
      std::memcpy(&amax, &bmax[b], sizeof(amax));
      const float d = block_divisor(amax, bmax[b] > 0x7F800000u, rule, s, b);
      if (std::isinf(d) || d < 0x1p-126f) return false;
      divisor[b] = d;
    }
  }
  // Each column's divisor in its unpacked lane ([lo 16, hi 16] per 32 columns; 1 past
  // cols) where a step's columns span blocks: in the columns' order first (block 1: the
  // blocks'), then permuted.
  float* cdiv = nullptr;
  if (!whole) {
    cdiv = torch_moe_cpu::aligned_scratch(col_div, 2 * padded);
    float* const in_order = block == 1 ? divisor : cdiv + padded;
    if (block != 1) {
      for (int64_t j0 = 0, b = 0; j0 < cols; j0 += block, ++b) {
        std::fill(in_order + j0, in_order + std::min(cols, j0 + block), divisor[b]);
      }
    }
    std::fill(in_order + cols, in_order + padded, 1.0f);
    for (int64_t j = 0; j < cols; j += W) quantizer.unpack_lanes(in_order + j, cdiv + j);
  }
  auto codes = [&](auto mul, int64_t r0, int64_t r1) {
    constexpr bool kMul = decltype(mul)::value;
    for (int64_t r = r0; r < r1; ++r) {
      const c10::BFloat16* xr = x + r * cols;
      uint8_t* orow = o + r * cols;
      if (!whole) {
        for (int64_t j = 0; j < cols; j += W) {
          quantizer.store<kMul>(orow + j, Bf16Quantizer::load(xr + j, cols - j),
                                Bf16Quantizer::loadf(cdiv + j),
                                Bf16Quantizer::loadf(cdiv + j + W / 2), cols - j);
        }
        continue;
      }
      for (int64_t j0 = 0, b = 0; j0 < cols; j0 += block, ++b) {
        const int64_t j1 = std::min(cols, j0 + block);
        const auto d = Bf16Quantizer::set1(divisor[b]);
        for (int64_t j = j0; j < j1; j += W) {
          quantizer.store<kMul>(orow + j, Bf16Quantizer::load(xr + j, j1 - j), d, d, j1 - j);
        }
      }
    }
  };
  at::parallel_for(0, br, grain, [&](int64_t r0, int64_t r1) {
    if (exact_reciprocals) {
      codes(std::true_type{}, r0, r1);
    } else {
      codes(std::false_type{}, r0, r1);
    }
  });
  return true;
}

// Whether x, q and scale are what the quantizers take: x [rows, cols] contiguous fp32 /
// bf16 / fp16, q e4m3fn of x's shape, scale contiguous 2-D fp32 (rule 0) or uint8 (MX).
bool quantizer_operands(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                        int64_t rule) {
  const auto dt = x.scalar_type();
  return (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) && x.dim() == 2 &&
         x.is_contiguous() && q.scalar_type() == at::kFloat8_e4m3fn && q.is_contiguous() &&
         q.sizes() == x.sizes() && rule >= 0 && rule <= 2 &&
         scale.scalar_type() == (rule == 0 ? at::kFloat : at::kByte) && scale.is_contiguous() &&
         scale.dim() == 2;
}

// A block row: rows [r0, r0 + rows) of x, its scales in scale row srow.
struct BlockRow {
  int64_t r0, rows, srow;
};

// quantize_block_row on every block row task(i), i in [0, n) (column blocks of `block`),
// in parallel (tasks of about `task_elems` elements); the operands checked by the caller.
// `flat`: each task's rows are one row of blocks (blocks of one row, a whole number of them
// per row: the same blocks, their scales in order).
template <class F>
void quantize_block_rows(const at::Tensor& x, int64_t block, at::Tensor& q, at::Tensor& scale,
                         int64_t rule, int64_t n, int64_t task_elems, const F& task,
                         bool flat = false) {
  const int64_t width = x.size(1);
  auto* o = reinterpret_cast<uint8_t*>(q.mutable_data_ptr());
  auto* s = static_cast<char*>(scale.mutable_data_ptr());
  const int64_t scale_row = scale.size(1) * scale.element_size();
  const int r = static_cast<int>(rule);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    for_rows(n, task_elems, [&](int64_t i) {
      BlockRow b = task(i);
      const int64_t cols = flat ? b.rows * width : width;
      if (flat) b.rows = 1;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (quantize_block_row_bf16(xp + b.r0 * width, b.rows, cols, block, o + b.r0 * width,
                                    s + b.srow * scale_row, r)) {
          return;
        }
      }
      quantize_block_row(xp + b.r0 * width, b.rows, cols, block, o + b.r0 * width,
                         s + b.srow * scale_row, r);
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(float{});
  } else if (x.scalar_type() == at::kBFloat16) {
    run(c10::BFloat16{});
  } else {
    run(c10::Half{});
  }
}

// fp8_quantize_rows' flat tasks' elements (bf16: 8 KiB, within L1 for the codes' pass).
constexpr int64_t kFlatElems = 4096;

bool fp8_quantize_rows(const at::Tensor& x, int64_t br, int64_t block, at::Tensor& q,
                       at::Tensor& scale, int64_t rule) {
  if (!quantizer_operands(x, q, scale, rule) || block < 1 || br < 1) return false;
  const int64_t rows = x.size(0), cols = x.size(1), nc = (cols + block - 1) / block;
  const int64_t nr = (rows + br - 1) / br;
  if (scale.size(0) != nr || scale.size(1) != std::max<int64_t>(nc, 1)) return false;
  if (x.numel() == 0) return true;
  if (br == 1 && cols % block == 0) {
    // Rows of one-row blocks that tile them (rowwise FP8, MX along rows) in flat tasks of
    // about kFlatElems elements: each task's per-row work (its blocks' maxima reduced and
    // their divisors formed 16 at a time, the buffers) shared by its rows.
    const int64_t per = std::max<int64_t>(1, kFlatElems / cols);
    quantize_block_rows(x, block, q, scale, rule, (rows + per - 1) / per, per * cols,
                        [&](int64_t i) {
                          return BlockRow{i * per, std::min(per, rows - i * per), i * per};
                        },
                        /*flat=*/true);
    return true;
  }
  quantize_block_rows(x, block, q, scale, rule, nr, br * cols, [&](int64_t i) {
    return BlockRow{i * br, std::min(br, rows - i * br), i};
  });
  return true;
}

// offs' group ends (int32, 1-D, contiguous, nondecreasing within [0, rows]), or nullptr.
const int32_t* group_ends(const at::Tensor& offs, int64_t rows) {
  if (offs.scalar_type() != at::kInt || offs.dim() != 1 || !offs.is_contiguous()) return nullptr;
  const int32_t* ends = offs.const_data_ptr<int32_t>();
  for (int64_t g = 0, prev = 0; g < offs.size(0); prev = ends[g], ++g) {
    if (ends[g] < prev || ends[g] > rows) return nullptr;
  }
  return ends;
}

// quantize_jagged's kernel: the segments of x's rows (offs' groups, then the rows past the
// last group), each in blocks of `block` rows from its first (the last one shorter; block
// -1: the segment is one block), every column its own scale; the segments' block rows in
// order in scale's rows (unused rows left as they are). One call for every segment, their
// block rows shared out over the threads. False without touching q or scale where the
// operands are not these.
bool fp8_quantize_jagged(const at::Tensor& x, const at::Tensor& offs, int64_t block,
                         at::Tensor& q, at::Tensor& scale, int64_t rule) {
  if (!quantizer_operands(x, q, scale, rule) || (block < 1 && block != -1)) return false;
  const int64_t rows = x.size(0), cols = x.size(1);
  const int32_t* ends = group_ends(offs, rows);
  if (ends == nullptr || scale.size(1) != std::max<int64_t>(cols, 1)) return false;
  std::vector<BlockRow> tasks;
  const int64_t E = offs.size(0);
  for (int64_t g = 0, start = 0; g <= E; ++g) {  // (g == E: the rows past the last group)
    const int64_t end = g < E ? ends[g] : rows;
    const int64_t extent = block == -1 ? std::max<int64_t>(end - start, 1) : block;
    for (int64_t r0 = start; r0 < end; r0 += extent) {
      tasks.push_back({r0, std::min(extent, end - r0), static_cast<int64_t>(tasks.size())});
    }
    start = end;
  }
  if (static_cast<int64_t>(tasks.size()) > scale.size(0)) return false;
  if (x.numel() == 0) return true;
  const int64_t most = block == -1 ? rows : block;
  quantize_block_rows(x, 1, q, scale, rule, static_cast<int64_t>(tasks.size()), most * cols,
                      [&](int64_t i) { return tasks[i]; });
  return true;
}

// f(piece) for every piece, the pieces shared out over the threads; a piece whose f
// returns false (the native GEMM refused it: the caller checked the operands) fails the op.
template <class P, class F>
void run_pieces(const std::vector<P>& pieces, const char* name, const F& f) {
  std::atomic<bool> ok{true};
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t i = p0; i < p1; ++i) {
      if (!f(pieces[i])) ok = false;
    }
  });
  TORCH_CHECK(ok.load(), name, ": the native GEMM refused a piece");
}

// The block-scaled GEMMs' operands: bf16 tensors read in place, or e4m3 codes (AVX-512
// builds) whose pieces are converted to bf16 (exact: e4m3's values are bf16 values) into
// the calling thread's scratch just before the piece's GEMM reads them. Whole bf16 copies
// of the operands' codes, written to memory by one pass and read back by the GEMM, took
// 5% of an FP8 layer step on the Zen 4 measured; a piece's copy stays in the caches (per
// call with the conversion 6-13% faster there: benchmarks/results/cpu_floor_cpu_202612.md).
bool operands_apply(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type()) return false;
#if defined(CPU_CAPABILITY_AVX512)
  if (a.scalar_type() == at::kFloat8_e4m3fn) return true;
#endif
  return a.scalar_type() == at::kBFloat16;
}

// A thread's copy of one piece of codes (bf16 bits, or fp32 values: T), kept for the next
// piece of the same op call that reads the same rows (key): the pieces of a group's rows by
// columns, which at::parallel_for hands a thread in order.
template <class T = uint16_t>
struct PieceCopy {
  std::vector<T> buf;
  uint64_t call = 0;
  int64_t key = -1;
  // The copy's [rows, cols] (row stride cols) for (call, key), converted by fill(data)
  // unless it holds them already.
  template <class F>
  T* get(uint64_t c, int64_t k, int64_t rows, int64_t cols, const F& fill) {
    const bool held = call == c && key == k;
    T* data = torch_moe_cpu::aligned_scratch(buf, rows * cols);
    if (!held) {
      fill(data);
      call = c;
      key = k;
    }
    return data;
  }
};

uint64_t next_call() {
  static std::atomic<uint64_t> calls{0};
  return ++calls;
}

using torch_moe_cpu::Matrix;

// Rows [r0, r0 + rows) and columns [c0, c0 + cols) of a row-major matrix of codes at base
// (row stride ld) as a bf16 copy [rows, cols] into o (row stride ldo, cols where 0).
void copy_codes(const void* base, int64_t ld, int64_t r0, int64_t rows, int64_t c0,
                int64_t cols, uint16_t* o, int64_t ldo = 0) {
#if defined(CPU_CAPABILITY_AVX512)
  codes_to_bf16(static_cast<const uint8_t*>(base) + r0 * ld + c0, ld, rows, cols, o,
                ldo ? ldo : cols);
#else
  (void)base, (void)ld, (void)r0, (void)rows, (void)c0, (void)cols, (void)o, (void)ldo;
#endif
}

// Bytes of a's bf16 rows per piece where a holds codes: a large group's rows are taken in
// pieces of about this size (B converted again for each: at K = 4096, 512 rows, ~1% of
// the piece's GEMM), so its copy stays within a few MB.
constexpr int64_t kCodeRowsBytes = int64_t{4} << 20;

// Whether the native GEMM writes a bf16 out by non-temporal stores: asked (the CPU probe's
// out_stream, as the threaded grouped GEMM's) and all of out past this core's L2.
bool out_streams(const at::Tensor& out, bool stream_out) {
  return stream_out && out.scalar_type() == at::kBFloat16 &&
         torch_moe_cpu::bf16_gemm_streams(out.nbytes());
}

// The rows of a's pieces where a holds codes of K columns (kCodeRowsBytes converted to
// elements of `bytes` each: bf16, or the fp32 form's dequantized values).
int64_t code_rows(int64_t K, int64_t bytes = 2) {
  return std::max<int64_t>(64, kCodeRowsBytes / (bytes * std::max<int64_t>(K, 1)));
}

// A forward / dgrad piece: rows [start, start + rows) of group g, output columns [c0, c1).
struct RowPiece {
  int64_t g, start, rows, c0, c1;
};

// The output columns of a forward piece (row_pieces).
constexpr int64_t kPieceCols = 256;

// Each group's rows (ends) in pieces of at most `most` rows by kPieceCols output columns.
std::vector<RowPiece> row_pieces(const int32_t* ends, int64_t E, int64_t most, int64_t N) {
  std::vector<RowPiece> pieces;
  for (int64_t g = 0, start = 0; g < E; start = ends[g], ++g) {
    for (int64_t r0 = start; r0 < ends[g]; r0 += most) {
      const int64_t rows = std::min<int64_t>(most, ends[g] - r0);
      for (int64_t c0 = 0; c0 < N; c0 += kPieceCols) {
        pieces.push_back({g, r0, rows, c0, std::min(N, c0 + kPieceCols)});
      }
    }
  }
  return pieces;
}

// The forward kernels' operands: a [M, K] row-major, b [E, K, N] with each expert row- or
// column-major, out [M, N], row_scale [M, KS] and col_scale [E, KS, cols] (at least cols
// where not `exact`) contiguous fp32, offs [E] (its dtype, layout and values: group_ends).
bool forward_operands(const at::Tensor& a, const at::Tensor& b, const at::Tensor& row_scale,
                      const at::Tensor& col_scale, const at::Tensor& offs, const at::Tensor& out,
                      int64_t KS, int64_t cols, bool exact) {
  const int64_t M = a.size(0), K = a.size(1), E = b.size(0), N = b.size(2);
  return b.size(1) == K && out.size(0) == M && out.size(1) == N &&
         (a.stride(1) == 1 || K <= 1) && (b.stride(2) == 1 || b.stride(1) == 1) &&
         row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous() &&
         row_scale.dim() == 2 && row_scale.size(0) == M && row_scale.size(1) == KS &&
         col_scale.scalar_type() == at::kFloat && col_scale.is_contiguous() &&
         col_scale.dim() == 3 && col_scale.size(0) == E && col_scale.size(1) == KS &&
         (exact ? col_scale.size(2) == cols : col_scale.size(2) >= cols) && offs.dim() == 1 &&
         offs.size(0) == E;
}

// Rows of a forward kernel's out at or past the last group's end zeroed.
void zero_past_groups(at::Tensor& out, const int32_t* ends, int64_t E) {
  const int64_t end = E ? ends[E - 1] : 0, M = out.size(0);
  if (end < M) out.narrow(0, end, M - end).zero_();
}

// The weight-gradient kernels' operands: a [M, K] and b [M, N] row-major, out [E, K, N],
// row_scale [NB, K] and col_scale [NB, cols] (at least cols where not `exact`) contiguous
// fp32.
bool wgrad_operands(const at::Tensor& a, const at::Tensor& b, const at::Tensor& row_scale,
                    const at::Tensor& col_scale, const at::Tensor& out, int64_t E, int64_t cols,
                    bool exact) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  return b.size(0) == M && out.size(0) == E && out.size(1) == K && out.size(2) == N &&
         (a.stride(1) == 1 || K <= 1) && (b.stride(1) == 1 || N <= 1) &&
         row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous() &&
         row_scale.dim() == 2 && row_scale.size(1) == K &&
         col_scale.scalar_type() == at::kFloat && col_scale.is_contiguous() &&
         col_scale.dim() == 2 && (exact ? col_scale.size(1) == cols : col_scale.size(1) >= cols) &&
         col_scale.size(0) == row_scale.size(0);
}

// Each group's first row of jagged block scales (quantize_jagged's layout: ceil(rows /
// block) block rows a group, in order) into first; false where they pass `rows` rows.
bool first_block_rows(const int32_t* ends, int64_t E, int64_t block, int64_t rows,
                      std::vector<int64_t>& first) {
  first.assign(E, 0);
  for (int64_t g = 0, prev = 0, blocks = 0; g < E; prev = ends[g], ++g) {
    first[g] = blocks;
    blocks += (ends[g] - prev + block - 1) / block;
    if (blocks > rows) return false;
  }
  return true;
}

// A weight gradient's piece: group g's rows [start, start + rows), output rows [k0, k1).
struct KPiece {
  int64_t g, start, rows, k0, k1;
};

// Each non-empty group's output [K, N] in pieces of output rows, out[g] of an empty group
// zeroed: the whole K where a's converted [rows, K] fits kCodeRowsBytes (each piece's GEMM
// packs the group's b again: pieces of 256 rows made the E8 layer's weight gradients
// 9-13% slower than one GEMM per group), else at most that in multiples of 64 rows, and
// cut further (multiples of 64) while the pieces are fewer than the threads.
std::vector<KPiece> k_pieces(const int32_t* ends, int64_t E, int64_t K, at::Tensor& out) {
  static constexpr int64_t kPanel = 64;
  const auto round64 = [](int64_t v) { return std::max(kPanel, v / kPanel * kPanel); };
  int64_t busy = 0;
  for (int64_t g = 0, start = 0; g < E; start = ends[g], ++g) busy += ends[g] > start;
  const int64_t threads = at::get_num_threads();
  const int64_t cuts = busy > 0 && busy < threads ? (threads + busy - 1) / busy : 1;
  std::vector<KPiece> pieces;
  for (int64_t g = 0, start = 0; g < E; start = ends[g], ++g) {
    const int64_t rows = ends[g] - start;
    if (rows == 0) {
      out[g].zero_();
      continue;
    }
    int64_t kw = 2 * rows * K > kCodeRowsBytes ? round64(kCodeRowsBytes / (2 * rows)) : K;
    if (cuts > 1) kw = std::min(kw, round64((K + cuts - 1) / cuts + kPanel - 1));
    for (int64_t k0 = 0; k0 < K; k0 += kw) {
      pieces.push_back({g, start, rows, k0, std::min(K, k0 + kw)});
    }
  }
  return pieces;
}

// The row stride of a's bf16 rows that few_rows_codes reads, and the pieces' copy of them
// on every capability: room for a zero past K, even (every k pair one 32-bit load, an odd
// K's last (a[K - 1], 0)).
constexpr int64_t padded_k(int64_t K) { return K + 2 - K % 2; }

#if defined(CPU_CAPABILITY_AVX512)
// ---- Groups of a few rows: the codes straight into the products ----
//
// Decode gives each busy expert a row or a few. The pieces above then convert a piece's
// 256 columns of b[g] into bf16 scratch (2 bytes written per code), which the GEMM packs
// again into its pair panels (read, and for a column-major b transposed, then written)
// before its tiles read them: three passes over the weight, for a few products per
// element. few_rows_codes takes b[g] a strip of 64V columns at a time and, per chunk of
// pairs of k (for a group of one tile of rows kChunkPairs: the panel in L1, the tile's
// sums kept in L1 between chunks; for more rows a whole k block: the panel in L2, each
// tile's sums in registers across it), converts the codes once into a panel of
// bf16 pairs (the GEMM's layout: one 32-bit lane (b[2p][n], b[2p + 1][n])), which every
// tile of up to kFewRows rows then takes by vdpbf16ps, each row's pair broadcast. Every output element is the same sequence of operations as in the
// GEMM's tile (gemm_bf16_cpu.cpp's `tile` with BlockScales): per k block, vdpbf16ps over
// the block's pairs in order from zero, then one multiply of the row's and the column's
// scale and one fused multiply-add into the running sum; an odd K's last pair (a[K - 1],
// 0) against (b[K - 1], 0); one rounding into a bf16 out. So a row's bits do not depend on
// its group's size or on which path ran (test_fp8_kernels checks them against the pieces).
//
// A column-major b[g] (K codes per column: the GPU's K-major layout, the training
// forward's weight): 16 columns' next 32 codes transposed as 16-bit words (one word, a
// column's pair of codes), each pair's 16 words converted by Bf16Codes. A row-major b[g]
// (rows of N codes: the CPU weight cache's layout at inference): rows 2p and 2p + 1
// converted byte by byte (CodeBytes) and interleaved by two rounds of unpacks, no
// transpose; of 64 columns, vector d (of 4) then holds in its 128-bit lane L the columns
// 16L + 4d .. 16L + 4d + 3, an order the sums keep until they are stored (a 4 x 4
// transpose of 128-bit lanes, the column scales taken into it likewise), which changes
// none of a column's operations. Both forms are bound by their shuffles on the Zen 4
// measured (the transposes, Bf16Codes' two-register permutes), the row-major one much
// less: see few_code_rows in scaled_grouped_mm.py for when each runs.

#define TORCH_MOE_FEW_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int kFewRows = 4;           // rows per register tile
constexpr int64_t kChunkPairs = 16;   // k pairs per chunk of the panel
constexpr int64_t kFewAhead = 16;     // weight rows the row-major form prefetches ahead

// r[c] (c < 16): the 16 16-bit words of column c; afterwards r[p] holds word p of the 16
// columns, in column order (four rounds of unpacks within and across 128-bit lanes).
TORCH_MOE_FEW_TARGET inline void transpose_words_16x16(__m256i r[16]) {
  __m256i l[8], h[8];  // words {0-3} (lane 0) / {8-11} (lane 1), and {4-7} / {12-15}, of
  for (int j = 0; j < 8; ++j) {  // columns 2j and 2j + 1 interleaved
    l[j] = _mm256_unpacklo_epi16(r[2 * j], r[2 * j + 1]);
    h[j] = _mm256_unpackhi_epi16(r[2 * j], r[2 * j + 1]);
  }
  __m256i q[4][4];  // q[s][i]: words {2s, 2s + 1} (lane 0), {8 + 2s, 9 + 2s} (lane 1) of
  for (int i = 0; i < 4; ++i) {  // columns 4i .. 4i + 3
    q[0][i] = _mm256_unpacklo_epi32(l[2 * i], l[2 * i + 1]);
    q[1][i] = _mm256_unpackhi_epi32(l[2 * i], l[2 * i + 1]);
    q[2][i] = _mm256_unpacklo_epi32(h[2 * i], h[2 * i + 1]);
    q[3][i] = _mm256_unpackhi_epi32(h[2 * i], h[2 * i + 1]);
  }
  for (int s = 0; s < 4; ++s) {
    __m256i e[2][2];  // e[t][u]: word 2s + t (lane 0) / 2s + t + 8 (lane 1), columns 8u..
    for (int u = 0; u < 2; ++u) {
      e[0][u] = _mm256_unpacklo_epi64(q[s][2 * u], q[s][2 * u + 1]);
      e[1][u] = _mm256_unpackhi_epi64(q[s][2 * u], q[s][2 * u + 1]);
    }
    for (int t = 0; t < 2; ++t) {
      r[2 * s + t] = _mm256_permute2x128_si256(e[t][0], e[t][1], 0x20);
      r[2 * s + t + 8] = _mm256_permute2x128_si256(e[t][0], e[t][1], 0x31);
    }
  }
}

// 64 codes' bf16 bits as two vectors of bytes: a normal code's (em = e << 3 | m; e + 120
// and m in bf16's fields) by shifts, a mask and an add, the subnormal ones' (e = 0) from a
// table of 8 by vpshufb, NaN's high byte set (0x7FF0: ATen's, as Bf16Codes), then the
// sign. (Bf16Codes widens first and looks up 16-bit entries: 3 shuffles per 32 codes;
// this takes 2 per 64, the interleaving unpacks 4 more per two rows.)
class CodeBytes {
 public:
  CodeBytes() {
    alignas(64) uint8_t lo[64], hi[64];
    for (int i = 0; i < 64; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &fp8_values()[i % 16 < 8 ? i % 16 : 0], sizeof(bits));
      lo[i] = static_cast<uint8_t>(bits >> 16);
      hi[i] = static_cast<uint8_t>(bits >> 24);
    }
    sub_lo_ = _mm512_load_si512(lo);
    sub_hi_ = _mm512_load_si512(hi);
  }
  // the low bytes of the 64 codes x's bf16 bits into lo, the high bytes into hi
  TORCH_MOE_FEW_TARGET void split(__m512i x, __m512i& lo, __m512i& hi) const {
    const __m512i em = _mm512_and_si512(x, _mm512_set1_epi8(0x7F));
    hi = _mm512_add_epi8(_mm512_and_si512(_mm512_srli_epi16(x, 4), _mm512_set1_epi8(0x07)),
                         _mm512_set1_epi8(60));
    lo = _mm512_and_si512(_mm512_slli_epi16(x, 4), _mm512_set1_epi8(static_cast<char>(0xF0)));
    const __mmask64 sub = _mm512_cmplt_epu8_mask(em, _mm512_set1_epi8(8));
    hi = _mm512_mask_shuffle_epi8(hi, sub, sub_hi_, em);
    lo = _mm512_mask_shuffle_epi8(lo, sub, sub_lo_, em);
    hi = _mm512_mask_mov_epi8(hi, _mm512_cmpeq_epi8_mask(em, _mm512_set1_epi8(0x7F)),
                              _mm512_set1_epi8(0x7F));
    hi = _mm512_or_si512(hi, _mm512_and_si512(x, _mm512_set1_epi8(static_cast<char>(0x80))));
  }

 private:
  __m512i sub_lo_, sub_hi_;  // the subnormal codes' bytes (m < 8), in each 128-bit lane
};

// Rows r0 and r1 (nullptr: zeros) of 64 columns (those in mask; the rest zero) as bf16
// pairs in d[4], in the order described above.
TORCH_MOE_FEW_TARGET inline void row_pair_vectors(const CodeBytes& cb, const uint8_t* r0,
                                                  const uint8_t* r1, __mmask64 mask,
                                                  __m512i d[4]) {
  const bool full = mask == ~__mmask64{0};
  __m512i lo0, hi0, lo1 = _mm512_setzero_si512(), hi1 = _mm512_setzero_si512();
  cb.split(full ? _mm512_loadu_si512(r0) : _mm512_maskz_loadu_epi8(mask, r0), lo0, hi0);
  if (r1 != nullptr) {
    cb.split(full ? _mm512_loadu_si512(r1) : _mm512_maskz_loadu_epi8(mask, r1), lo1, hi1);
  }
  const __m512i w0 = _mm512_unpacklo_epi8(lo0, hi0), w0h = _mm512_unpackhi_epi8(lo0, hi0);
  const __m512i w1 = _mm512_unpacklo_epi8(lo1, hi1), w1h = _mm512_unpackhi_epi8(lo1, hi1);
  d[0] = _mm512_unpacklo_epi16(w0, w1);
  d[1] = _mm512_unpackhi_epi16(w0, w1);
  d[2] = _mm512_unpacklo_epi16(w0h, w1h);
  d[3] = _mm512_unpackhi_epi16(w0h, w1h);
}

// v[u]'s 128-bit lane L into v[L]'s lane u (its own inverse): between 64 columns' natural
// vectors and row_pair_vectors' order
TORCH_MOE_FEW_TARGET inline void transpose_lanes_4x4(__m512 v[4]) {
  const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44);
  const __m512 t1 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);
  const __m512 t2 = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
  const __m512 t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
  v[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
  v[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
  v[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
  v[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
}

// The panels: pairs [p, p + n) of columns [n0, n0 + nc) (nc <= 64V) of b[g] into
// panel[i * 64V + j] (the pair i of the strip's column j: column order for a
// column-major b, row_pair_vectors' order per 64 for a row-major one). Columns past nc are
// not written (their sums are never stored).
struct Codes {
  const uint8_t* b;
  int64_t ld, K;
};

struct ColumnCodes : Codes {  // column-major: column n's K codes at b + n * ld
  static constexpr bool kPermuted = false;
  template <int V>
  TORCH_MOE_FEW_TARGET void panel(int64_t n0, int64_t nc, int64_t p, int64_t n,
                                  uint32_t* out) const {
    static const Bf16Codes codes;
    for (int64_t c0 = 0; c0 < nc; c0 += 16) {
      for (int64_t q = 0; q < n; q += 16) {  // 16 pairs a transpose
        const int64_t avail = K - 2 * (p + q);  // codes of each column from pair p + q on
        const __mmask32 mask = Bf16Codes::first(avail);
        __m256i w[16];
        for (int j = 0; j < 16; ++j) {
          const uint8_t* src = b + (n0 + std::min<int64_t>(c0 + j, nc - 1)) * ld + 2 * (p + q);
          w[j] = avail >= 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                             : _mm256_maskz_loadu_epi8(mask, src);
        }
        transpose_words_16x16(w);
        for (int64_t i = 0; i < std::min<int64_t>(16, n - q); ++i) {
          _mm512_store_si512(out + (q + i) * 64 * V + c0, codes.of(w[i]));
        }
      }
    }
  }
};

struct RowCodes : Codes {  // row-major: row k's N codes at b + k * ld
  static constexpr bool kPermuted = true;
  template <int V>
  TORCH_MOE_FEW_TARGET void panel(int64_t n0, int64_t nc, int64_t p, int64_t n,
                                  uint32_t* out) const {
    static const CodeBytes cb;
    __mmask64 mask[V];
    for (int v = 0; v < V; ++v) {
      const int64_t left = std::clamp<int64_t>(nc - 64 * v, 0, 64);
      mask[v] = left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t k = 2 * (p + i);
      const uint8_t* r0 = b + k * ld + n0;
      const uint8_t* r1 = k + 1 < K ? r0 + ld : nullptr;
      for (int v = 0; v < V && 64 * v < nc; ++v) {
        if (k + kFewAhead + 1 < K) {  // the hardware prefetchers follow a stride late
          _mm_prefetch(reinterpret_cast<const char*>(r0 + kFewAhead * ld + 64 * v), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(r0 + (kFewAhead + 1) * ld + 64 * v),
                       _MM_HINT_T0);
        }
        __m512i d[4];
        row_pair_vectors(cb, r0 + 64 * v, r1 ? r1 + 64 * v : nullptr, mask[v], d);
        for (int j = 0; j < 4; ++j) _mm512_store_si512(out + i * 64 * V + 64 * v + 16 * j, d[j]);
      }
    }
  }
};

// acc[r * 64V + ..] (R rows of fp32 sums; zero first where `fresh`) += the rows' pairs
// [p, p + n) of a (bf16, row stride lda) times the panel's pairs, in order
template <int R, int V>
TORCH_MOE_FEW_TARGET void chunk_rows(const uint32_t* panel, int64_t n, const uint16_t* a,
                                     int64_t lda, int64_t p, float* acc, bool fresh) {
  for (int v = 0; v < V; ++v) {
    __m512 c[R][4];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) {
        c[r][j] = fresh ? _mm512_setzero_ps() : _mm512_load_ps(acc + r * 64 * V + 64 * v + 16 * j);
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      __m512bh bv[4];
      for (int j = 0; j < 4; ++j) {
        bv[j] = (__m512bh)_mm512_load_si512(panel + i * 64 * V + 64 * v + 16 * j);
      }
      for (int r = 0; r < R; ++r) {
        uint32_t x;
        std::memcpy(&x, a + r * lda + 2 * (p + i), sizeof(x));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x));
        for (int j = 0; j < 4; ++j) c[r][j] = _mm512_dpbf16_ps(c[r][j], xv, bv[j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) _mm512_store_ps(acc + r * 64 * V + 64 * v + 16 * j, c[r][j]);
    }
  }
}

// out rows [0, rows) x columns [0, cols) (row stride ldo) of the block-scaled product of
// the padded rows ap (bf16, row stride lda >= K + 1, zero from column K on: every pair one
// 32-bit load, an odd K's last (a[K - 1], 0)) and B (ColumnCodes or RowCodes) with scales
// sc, in strips of 64V columns
template <int V, class B, class Out>
TORCH_MOE_FEW_TARGET void codes_strips(const B& bm, const uint16_t* ap, int64_t lda,
                                       int64_t rows, int64_t K, int64_t cols,
                                       const torch_moe_cpu::BlockScales& sc, Out* out,
                                       int64_t ldo) {
  constexpr int64_t W = 64 * V;
  thread_local std::vector<float> sums_buf;
  thread_local std::vector<uint32_t> panel_buf;
  float* acc = torch_moe_cpu::aligned_scratch(sums_buf, 2 * rows * W);  // the block's sums,
  float* sum = acc + rows * W;                                         // the running ones
  const int64_t pairs = (K + 1) / 2;
  // pairs per chunk: kChunkPairs (the panel in L1) for one tile of rows, else a whole k
  // block (the panel in L2, each tile's sums in registers across it)
  const int64_t chunk = rows <= kFewRows ? kChunkPairs : std::min(sc.pairs, pairs);
  uint32_t* panel = torch_moe_cpu::aligned_scratch(panel_buf, chunk * W);
  const auto in_order = [](__m512* v) {
    if constexpr (B::kPermuted) transpose_lanes_4x4(v);
  };
  for (int64_t n0 = 0; n0 < cols; n0 += W) {
    const int64_t nc = std::min(W, cols - n0);
    std::fill(sum, sum + rows * W, 0.0f);
    for (int64_t p0 = 0, kb = 0; p0 < pairs; p0 += sc.pairs, ++kb) {
      const int64_t p1 = std::min(pairs, p0 + sc.pairs);
      for (int64_t p = p0; p < p1; p += chunk) {
        const int64_t n = std::min(chunk, p1 - p);
        bm.template panel<V>(n0, nc, p, n, panel);
        for (int64_t r0 = 0; r0 < rows; r0 += kFewRows) {
          const uint16_t* ar = ap + r0 * lda;
          float* ac = acc + r0 * W;
          switch (std::min<int64_t>(kFewRows, rows - r0)) {
            case 4: chunk_rows<4, V>(panel, n, ar, lda, p, ac, p == p0); break;
            case 3: chunk_rows<3, V>(panel, n, ar, lda, p, ac, p == p0); break;
            case 2: chunk_rows<2, V>(panel, n, ar, lda, p, ac, p == p0); break;
            default: chunk_rows<1, V>(panel, n, ar, lda, p, ac, p == p0); break;
          }
        }
      }
      for (int v = 0; v < V; ++v) {  // the block's sums scaled into the running sums
        __m512 cs[4];
        for (int u = 0; u < 4; ++u) {
          cs[u] = _mm512_loadu_ps(sc.col + kb * sc.col_kb + n0 + 64 * v + 16 * u);
        }
        in_order(cs);
        for (int64_t r = 0; r < rows; ++r) {
          const __m512 rs = _mm512_set1_ps(sc.row[r * sc.row_m + kb * sc.row_kb]);
          for (int j = 0; j < 4; ++j) {
            const int64_t at = r * W + 64 * v + 16 * j;
            _mm512_store_ps(sum + at, _mm512_fmadd_ps(_mm512_load_ps(acc + at),
                                                      _mm512_mul_ps(rs, cs[j]),
                                                      _mm512_load_ps(sum + at)));
          }
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {  // in column order, stored
      for (int v = 0; v < V && 64 * v < nc; ++v) {
        __m512 s4[4];
        for (int j = 0; j < 4; ++j) s4[j] = _mm512_load_ps(sum + r * W + 64 * v + 16 * j);
        in_order(s4);
        for (int u = 0; u < 4 && 64 * v + 16 * u < nc; ++u) {
          const int64_t left = nc - 64 * v - 16 * u;
          const __mmask16 keep =
              left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
          Out* o = out + r * ldo + n0 + 64 * v + 16 * u;
          if constexpr (std::is_same_v<Out, float>) {
            _mm512_mask_storeu_ps(o, keep, s4[u]);
          } else {
            _mm256_mask_storeu_epi16(o, keep, (__m256i)_mm512_cvtneps_pbh(s4[u]));
          }
        }
      }
    }
  }
}

// few_rows_codes: out rows [0, rows) x columns [0, cols) (row stride ldo) of the
// block-scaled product of a (bf16 [rows, K], row stride padded_k(K), zero from column K
// on) and b[g]'s columns from bg (b_rows: row-major, row k at bg + k * ld; else
// column-major, column n at bg + n * ld) with scales sc. Strips of 256 columns for a group
// of one register tile of rows (a longer stretch of each weight row read at a time), else
// of 64 (the sums held in L1).
template <class Out>
void few_rows_codes(const uint16_t* ap, int64_t rows, int64_t K, const uint8_t* bg, int64_t ld,
                    bool b_rows, int64_t cols, const torch_moe_cpu::BlockScales& sc, Out* out,
                    int64_t ldo) {
  const int64_t lda = padded_k(K);
  const auto run = [&](const auto& bm) {
    if (rows <= kFewRows) {
      codes_strips<4>(bm, ap, lda, rows, K, cols, sc, out, ldo);
    } else {
      codes_strips<1>(bm, ap, lda, rows, K, cols, sc, out, ldo);
    }
  };
  if (b_rows) {
    run(RowCodes{{bg, ld, K}});
  } else {
    run(ColumnCodes{{bg, ld, K}});
  }
}

#endif

// out [M, N] (bf16 or fp32) = the block-scaled grouped GEMM of the codes as bf16 values: the
// rows of group g (offs' ends) times b[g] [K, N], each k block of block_k's fp32 sums
// times row_scale[m, kb] * col_scale[g, kb, n] (torch_moe_cpu::BlockScales), the blocks
// added in order; rows past the last group zero. a [M, K] row-major and b [E, K, N] with
// each expert row- or column-major, both bf16 or both e4m3fn codes (operands_apply),
// row_scale [M, KS] and col_scale [E, KS, Np] (Np: N rounded up to 64 columns or more)
// contiguous fp32, KS = ceil(K / block_k), block_k even. Pieces of a group's rows (codes:
// by kCodeRowsBytes) by 256 columns shared out over the threads; a bf16 out by
// non-temporal stores where out_streams. False without touching out where the native
// GEMM does not run here or the operands are not these. few_rows: the codes of a group
// of at most that many rows against a column-major b[g] by few_rows_codes (the same bits).
bool fp8_block_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& row_scale,
                         const at::Tensor& col_scale, const at::Tensor& offs, int64_t block_k,
                         at::Tensor& out, bool stream_out, int64_t few_rows) {
  if (!torch_moe_cpu::bf16_gemm_available() || !operands_apply(a, b) || a.dim() != 2 ||
      b.dim() != 3 || out.dim() != 2 ||
      (out.scalar_type() != at::kBFloat16 && out.scalar_type() != at::kFloat) ||
      !out.is_contiguous() || block_k < 2 || block_k % 2 != 0) {
    return false;
  }
  const int64_t M = a.size(0), K = a.size(1), E = b.size(0), N = b.size(2);
  const int64_t KS = (K + block_k - 1) / block_k, Np = (N + 63) / 64 * 64;
  if (!forward_operands(a, b, row_scale, col_scale, offs, out, KS, Np, false)) return false;
  const int32_t* ends = group_ends(offs, M);
  if (ends == nullptr) return false;
  const bool codes = a.scalar_type() == at::kFloat8_e4m3fn;
  const auto pieces = row_pieces(ends, E, codes ? code_rows(K) : std::max<int64_t>(M, 1), N);
  const float* rs = row_scale.const_data_ptr<float>();
  const float* cs = col_scale.const_data_ptr<float>();
  const int64_t cs_rows = col_scale.size(2);
  const uint64_t call = next_call();
  const bool stream = out_streams(out, stream_out);
  const bool b_rows = b.stride(2) == 1;  // each expert row-major (else column-major)
  const Matrix a_m = Matrix::of(a), out_m = Matrix::of(out);
  run_pieces(pieces, "fp8_block_scaled_mm", [&](const RowPiece& p) {
    const Matrix o = out_m.block(p.start, p.rows, p.c0, p.c1 - p.c0);
    const torch_moe_cpu::BlockScales sc{rs + p.start * KS, KS, 1,
                                        cs + (p.g * KS) * cs_rows + p.c0, cs_rows, block_k / 2};
    const int64_t cols = p.c1 - p.c0;
    const Matrix bg = Matrix::of(b, p.g);
    if (!codes) {
      return torch_moe_cpu::bf16_gemm_scaled(o, a_m.row_range(p.start, p.rows),
                                             bg.col_range(p.c0, cols), &sc, {}, {}, stream);
    }
    thread_local PieceCopy<> a_copy;
    thread_local std::vector<uint16_t> b_buf;  // each piece its own columns of b[g]
    // a's rows in bf16, zero past K (the few-rows form reads whole pairs; the GEMM K)
    const int64_t lda = padded_k(K);
    uint16_t* ah = a_copy.get(call, p.start, p.rows, lda, [&](uint16_t* d) {
      copy_codes(a_m.data, a_m.row_stride, p.start, p.rows, 0, K, d, lda);
      for (int64_t r = 0; r < p.rows; ++r) std::fill(d + r * lda + K, d + (r + 1) * lda, 0);
    });
#if defined(CPU_CAPABILITY_AVX512)
    if (p.rows <= few_rows) {  // the codes straight into the products
      const auto* bc = static_cast<const uint8_t*>(bg.data) + p.c0 * bg.col_stride;
      const int64_t ld = b_rows ? bg.row_stride : bg.col_stride;
      if (o.dtype == at::kFloat) {
        few_rows_codes(ah, p.rows, K, bc, ld, b_rows, cols, sc, static_cast<float*>(o.data),
                       o.row_stride);
      } else {
        few_rows_codes(ah, p.rows, K, bc, ld, b_rows, cols, sc, static_cast<uint16_t*>(o.data),
                       o.row_stride);
      }
      return true;
    }
#endif
    uint16_t* bh = torch_moe_cpu::aligned_scratch(b_buf, K * cols);
    if (b_rows) {  // b[g]'s rows k, columns [c0, c1)
      copy_codes(bg.data, bg.row_stride, 0, K, p.c0, cols, bh);
    } else {  // b[g]'s columns n in [c0, c1), K codes each (the rows of b[g]^T)
      copy_codes(bg.data, bg.col_stride, p.c0, cols, 0, K, bh);
    }
    return torch_moe_cpu::bf16_gemm_scaled(o, Matrix::bf16(ah, p.rows, K, lda),
                                           Matrix::bf16(bh, K, cols, b_rows ? cols : K, !b_rows),
                                           &sc, {}, {}, stream);
  });
  zero_past_groups(out, ends, E);
  return true;
}

// out [E, K, N] (bf16 or fp32): the weight gradients of the codes as bf16 values, out[g] =
// a[rows of g]^T @ b[rows of g], each jagged block of `block` rows (from the group's first
// row on; the last one shorter) summed in fp32, times row_scale[its block row, k] *
// col_scale[its block row, n], the blocks added in order (BlockScales); empty groups zero.
// a [M, K] and b [M, N] row-major (token order), both bf16 or both e4m3fn codes
// (operands_apply: a group's rows of b, then each piece's of a, converted into the
// thread's scratch), row_scale [NB, K] and col_scale [NB, Np] (Np: N rounded up to 64 or
// more) contiguous fp32, the groups' block rows in order (quantize_jagged's layout:
// ceil(rows / block) each, NB at least their sum), block even. Pieces of a group's output
// rows (k_pieces) shared out over the threads; a bf16 out by non-temporal stores where
// out_streams. False without touching out where the native GEMM does not run here or the
// operands are not these.
bool fp8_block_scaled_mm_wgrad(const at::Tensor& a, const at::Tensor& b,
                               const at::Tensor& row_scale, const at::Tensor& col_scale,
                               const at::Tensor& offs, int64_t block, at::Tensor& out,
                               bool stream_out) {
  if (!torch_moe_cpu::bf16_gemm_available() || !operands_apply(a, b) || a.dim() != 2 ||
      b.dim() != 2 || out.dim() != 3 ||
      (out.scalar_type() != at::kBFloat16 && out.scalar_type() != at::kFloat) ||
      !out.is_contiguous() || block < 2 || block % 2 != 0) {
    return false;
  }
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1), E = offs.dim() == 1 ? offs.size(0) : -1;
  const int64_t Np = (N + 63) / 64 * 64;
  if (!wgrad_operands(a, b, row_scale, col_scale, out, E, Np, false)) return false;
  const int32_t* ends = group_ends(offs, M);
  if (ends == nullptr) return false;
  std::vector<int64_t> first;
  if (!first_block_rows(ends, E, block, row_scale.size(0), first)) return false;
  const bool codes = a.scalar_type() == at::kFloat8_e4m3fn;
  const auto pieces = k_pieces(ends, E, K, out);
  const float* rs = row_scale.const_data_ptr<float>();
  const float* cs = col_scale.const_data_ptr<float>();
  const int64_t cs_rows = col_scale.size(1);
  const uint64_t call = next_call();
  const bool stream = out_streams(out, stream_out);
  const Matrix a_m = Matrix::of(a), b_m = Matrix::of(b);
  run_pieces(pieces, "fp8_block_scaled_mm_wgrad", [&](const KPiece& p) {
    const Matrix o = Matrix::of(out, p.g).row_range(p.k0, p.k1 - p.k0);
    // row k of this piece, block kb: row_scale[first + kb, k0 + k]
    const torch_moe_cpu::BlockScales sc{rs + first[p.g] * K + p.k0, 1, K,
                                        cs + first[p.g] * cs_rows, cs_rows, block / 2};
    const int64_t kw = p.k1 - p.k0;
    if (!codes) {
      const Matrix a_t = a_m.block(p.start, p.rows, p.k0, kw).t();
      return torch_moe_cpu::bf16_gemm_scaled(o, a_t, b_m.row_range(p.start, p.rows), &sc, {}, {},
                                             stream);
    }
    thread_local PieceCopy<> b_copy;
    thread_local std::vector<uint16_t> a_buf;  // each piece its own columns of a
    uint16_t* bh = b_copy.get(call, p.start, p.rows, N, [&](uint16_t* d) {
      copy_codes(b_m.data, b_m.row_stride, p.start, p.rows, 0, N, d);
    });
    uint16_t* ah = torch_moe_cpu::aligned_scratch(a_buf, p.rows * kw);
    copy_codes(a_m.data, a_m.row_stride, p.start, p.rows, p.k0, kw, ah);
    return torch_moe_cpu::bf16_gemm_scaled(o, Matrix::bf16(ah, p.rows, kw, kw).t(),
                                           Matrix::bf16(bh, p.rows, N, N), &sc, {}, {}, stream);
  });
  return true;
}

// MX operands in the native GEMM: the e4m3 codes of each piece times their blocks' fp32
// scales (MX's E8M0 powers of two; dequantize_row's products, rounded to bf16 as
// fp8_dequantize_scaled's bf16 copy rounds them: exact but where they over- or
// underflow) into the calling thread's scratch just before the piece's GEMM reads them,
// then the unscaled bf16 GEMM (bf16_gemm: the grouped GEMM's own native kernel, AMX tiles
// where they are on) into a bf16 output (by non-temporal stores where out_streams). The
// same products as dequantizing both operands to bf16 copies and multiplying them by the
// threaded grouped GEMM's native pieces (its pieces cut groups by output columns or
// weight-gradient rows, never the reduction, and a sum's bits do not depend on the
// pieces), without the copies: each operand written in full and read back by the GEMM,
// 6-7% of an mxfp8 layer step on the Zen 4 measured.

// out [M, N] bf16: the rows of group g (offs' ends) times b[g] [K, N], a's element (m, k)
// times row_scale[m, k / block_k] and b[g]'s (k, n) times col_scale[g, k / block_k, n];
// rows past the last group zero. a [M, K] row-major and b [E, K, N] (each expert row- or
// column-major) e4m3fn codes, row_scale [M, KS] and col_scale [E, KS, N] contiguous fp32,
// KS = ceil(K / block_k). row_pieces' pieces (a's rows by code_rows) shared out over the
// threads. False without touching out where the native GEMM does not run here (or the
// build lacks AVX-512) or the operands are not these.
bool fp8_mx_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& row_scale,
               const at::Tensor& col_scale, const at::Tensor& offs, int64_t block_k,
               at::Tensor& out, bool stream_out) {
#if defined(CPU_CAPABILITY_AVX512)
  if (!torch_moe_cpu::bf16_gemm_available() || a.scalar_type() != at::kFloat8_e4m3fn ||
      b.scalar_type() != at::kFloat8_e4m3fn || a.dim() != 2 || b.dim() != 3 || out.dim() != 2 ||
      out.scalar_type() != at::kBFloat16 || !out.is_contiguous() || block_k < 1) {
    return false;
  }
  const int64_t M = a.size(0), K = a.size(1), E = b.size(0), N = b.size(2);
  const int64_t KS = (K + block_k - 1) / block_k;
  if (!forward_operands(a, b, row_scale, col_scale, offs, out, KS, N, true)) return false;
  const int32_t* ends = group_ends(offs, M);
  if (ends == nullptr) return false;
  static const Bf16Codes bf16_codes;
  const auto pieces = row_pieces(ends, E, code_rows(K), N);
  const float* rs = row_scale.const_data_ptr<float>();
  const float* cs = col_scale.const_data_ptr<float>();
  const auto* ap = static_cast<const uint8_t*>(a.const_data_ptr());
  const uint64_t call = next_call();
  const bool stream = out_streams(out, stream_out);
  const bool b_rows = b.stride(2) == 1;  // each expert row-major (else column-major)
  const Matrix out_m = Matrix::of(out);
  run_pieces(pieces, "fp8_mx_mm", [&](const RowPiece& p) {
    thread_local PieceCopy<> a_copy;
    thread_local std::vector<uint16_t> b_buf;  // each piece its own columns of b[g]
    uint16_t* ah = a_copy.get(call, p.start, p.rows, K, [&](uint16_t* d) {
      for (int64_t r = 0; r < p.rows; ++r) {
        const int64_t m = p.start + r;
        dequantize_row(bf16_codes, ap + m * a.stride(0), K, rs + m * KS, block_k, 1, d + r * K);
      }
    });
    const int64_t cols = p.c1 - p.c0;
    uint16_t* bh = torch_moe_cpu::aligned_scratch(b_buf, K * cols);
    const auto* bp = static_cast<const uint8_t*>(Matrix::of(b, p.g).data);
    const float* sg = cs + p.g * KS * N;  // b[g]'s scales [KS, N]
    if (b_rows) {  // b[g]'s rows k, columns [c0, c1): a scale per column
      ScaleRowSteps steps;  // (a scale row per k block)
      for (int64_t k = 0; k < K; ++k) {
        steps.dequantize(bf16_codes, bp + k * b.stride(1) + p.c0, cols,
                         sg + (k / block_k) * N + p.c0, bh + k * cols);
      }
    } else {  // b[g]'s columns n in [c0, c1), K codes each: a scale per k block
      for (int64_t n = 0; n < cols; ++n) {
        dequantize_row(bf16_codes, bp + (p.c0 + n) * b.stride(2), K, sg + p.c0 + n, block_k, N,
                       bh + n * K);
      }
    }
    return torch_moe_cpu::bf16_gemm(out_m.block(p.start, p.rows, p.c0, cols),
                                    Matrix::bf16(ah, p.rows, K, K),
                                    Matrix::bf16(bh, K, cols, b_rows ? cols : K, !b_rows), {}, {},
                                    stream);
  });
  zero_past_groups(out, ends, E);
  return true;
#else
  (void)a, (void)b, (void)row_scale, (void)col_scale, (void)offs, (void)block_k, (void)out;
  (void)stream_out;
  return false;
#endif
}

// out [E, K, N] bf16: the weight gradients of MX operands, out[g] = a[rows of g]^T @ b[rows
// of g], each row's elements times its jagged block's scales (blocks of `block` rows from
// the group's first row, the last one shorter: a's (m, k) times row_scale[its block row,
// k], b's (m, n) times col_scale[its block row, n]); empty groups zero. a [M, K] and b [M,
// N] row-major e4m3fn codes, row_scale [NB, K] and col_scale [NB, N] contiguous fp32, the
// groups' block rows in order (quantize_jagged's layout: ceil(rows / block) each, NB at
// least their sum). k_pieces' pieces shared out over the threads. False without touching
// out where the native GEMM does not run here (or the build lacks AVX-512) or the
// operands are not these.
#if defined(CPU_CAPABILITY_AVX512)
// 4 columns of b[g] (column n's K codes at bg + n * ldb, its 32-k block c's E8M0 scale at
// sg + c * s1 + n * s2) dequantized into w4 [4][K] (bf16 bits): each block's 32 codes in
// bf16 times the block's scale (Pow2Scales::apply, the dequantizer's bits), once for all
// of the group's rows
TORCH_MOE_FEW_TARGET void mx_four_columns(const Bf16Codes& codes, int64_t K, const uint8_t* bg,
                                          int64_t ldb, const uint8_t* sg, int64_t s1,
                                          int64_t s2, const int64_t* col, uint16_t* w4) {
  for (int j = 0; j < 4; ++j) {
    for (int64_t k = 0, c = 0; k < K; k += 32, ++c) {
      const int step = (static_cast<int>(sg[c * s1 + col[j] * s2]) - 127) << 7;
      _mm512_store_si512(w4 + j * K + k,
                         Pow2Scales::apply(codes(bg + col[j] * ldb + k, 32),
                                           _mm512_set1_epi16(static_cast<int16_t>(step))));
    }
  }
}

// R rows of x (bf16, row stride K) times the 4 dequantized columns w4 [4][K], the first
// `cols` stored into o at columns col[j] (row stride ldo): vdpbf16ps over 32 k at a time,
// the lanes summed by _mm512_reduce_add_ps, one rounding (few_rows_mm's nt_tile_dpbf16,
// K a multiple of 32)
template <int R>
TORCH_MOE_FEW_TARGET void mx_few_tile(const uint16_t* x, int64_t K, const uint16_t* w4,
                                      const int64_t* col, int cols, uint16_t* o, int64_t ldo) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh w[4];
    for (int j = 0; j < 4; ++j) w[j] = (__m512bh)_mm512_load_si512(w4 + j * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, w[j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < cols; ++j) {
      o[r * ldo + col[j]] = c10::BFloat16(_mm512_reduce_add_ps(acc[r][j])).x;
    }
  }
}
#undef TORCH_MOE_FEW_TARGET
#endif

// out [M, N] bf16 = x [M, K] bf16 (the rows of an MX GEMM's A, dequantized) @ b[g] per
// group of rows (offs' ends; rows past the last group zero), b [E, K, N] the e4m3 codes
// of each expert column-major and scale [E, K / 32, N] their E8M0 exponents (uint8, any
// strides): the few-rows kernel's column-major vdpbf16ps form (grouped_mm_cpu.cpp's
// few_rows_mm) on the weight's dequantized bf16 values, bit for bit, each code times its
// scale in registers (Pow2Scales: the dequantizer's bits) instead of the busy experts'
// bf16 copy written by the dequantizer and read back (an MX decode step's weights read
// once instead of three times). Columns in blocks of 4, each block's K dequantized once
// into the thread's scratch in L1 (then read by every tile of up to 4 rows: converting the
// codes again per tile made groups of 16 rows 12% slower than the copies); tasks of 64
// columns of a busy group shared out over the threads. K a multiple of 32 (no
// scalar tail) and every busy expert's scale in Pow2Scales' range; false without touching
// out otherwise, or where the kernel does not run here.
bool fp8_mx_few_rows_mm(const at::Tensor& x, const at::Tensor& b, const at::Tensor& scale,
                        const at::Tensor& offs, at::Tensor& out) {
#if defined(CPU_CAPABILITY_AVX512)
  if (!torch_moe_cpu::bf16_gemm_available() || x.scalar_type() != at::kBFloat16 ||
      b.scalar_type() != at::kFloat8_e4m3fn || scale.scalar_type() != at::kByte ||
      out.scalar_type() != at::kBFloat16 || x.dim() != 2 || b.dim() != 3 || scale.dim() != 3 ||
      out.dim() != 2 || !x.is_contiguous() || !out.is_contiguous() || offs.dim() != 1) {
    return false;
  }
  const int64_t M = x.size(0), K = x.size(1), E = b.size(0), N = b.size(2);
  if (b.size(1) != K || K % 32 != 0 || (K > 1 && b.stride(1) != 1) || scale.size(0) != E ||
      scale.size(1) != K / 32 || scale.size(2) != N || out.size(0) != M || out.size(1) != N ||
      offs.size(0) != E) {
    return false;
  }
  const int32_t* ends = group_ends(offs, M);
  if (ends == nullptr) return false;
  const auto* sp = scale.const_data_ptr<uint8_t>();
  const int64_t s0 = scale.stride(0), s1 = scale.stride(1), s2 = scale.stride(2);
  std::vector<std::array<int64_t, 2>> tasks;  // (group, first column)
  for (int64_t g = 0, start = 0; g < E; start = ends[g], ++g) {
    if (ends[g] == start) continue;
    for (int64_t c = 0; c < K / 32; ++c) {  // a busy expert's scales: powers of two in range
      for (int64_t n = 0; n < N; ++n) {
        const int e = sp[g * s0 + c * s1 + n * s2];
        if ((e << 7) < Pow2Scales::kLow || (e << 7) > Pow2Scales::kHigh) return false;
      }
    }
    for (int64_t n0 = 0; n0 < N; n0 += 64) tasks.push_back({g, n0});
  }
  static const Bf16Codes codes;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const auto* bp = static_cast<const uint8_t*>(b.const_data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.mutable_data_ptr());
  const int64_t ldb = b.stride(2);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<uint16_t> w4_buf;
    uint16_t* w4 = torch_moe_cpu::aligned_scratch(w4_buf, 4 * K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = tasks[t][0], n0 = tasks[t][1], n1 = std::min(N, n0 + 64);
      const int64_t r0 = g ? ends[g - 1] : 0, m = ends[g] - r0;
      for (int64_t n = n0; n < n1; n += 4) {
        const int cols = static_cast<int>(std::min<int64_t>(4, n1 - n));
        int64_t col[4];
        for (int j = 0; j < 4; ++j) col[j] = n + std::min(j, cols - 1);
        mx_four_columns(codes, K, bp + g * b.stride(0), ldb, sp + g * s0, s1, s2, col, w4);
        for (int64_t i = 0; i < m; i += 4) {
          const uint16_t* xr = xp + (r0 + i) * K;
          uint16_t* o = op + (r0 + i) * N;
          switch (std::min<int64_t>(4, m - i)) {
            case 4: mx_few_tile<4>(xr, K, w4, col, cols, o, N); break;
            case 3: mx_few_tile<3>(xr, K, w4, col, cols, o, N); break;
            case 2: mx_few_tile<2>(xr, K, w4, col, cols, o, N); break;
            default: mx_few_tile<1>(xr, K, w4, col, cols, o, N); break;
          }
        }
      }
    }
  });
  const int64_t end = E ? ends[E - 1] : 0;
  if (end < M) out.narrow(0, end, M - end).zero_();
  return true;
#else
  (void)x, (void)b, (void)scale, (void)offs, (void)out;
  return false;
#endif
}

bool fp8_mx_mm_wgrad(const at::Tensor& a, const at::Tensor& b, const at::Tensor& row_scale,
                     const at::Tensor& col_scale, const at::Tensor& offs, int64_t block,
                     at::Tensor& out, bool stream_out) {
#if defined(CPU_CAPABILITY_AVX512)
  if (!torch_moe_cpu::bf16_gemm_available() || a.scalar_type() != at::kFloat8_e4m3fn ||
      b.scalar_type() != at::kFloat8_e4m3fn || a.dim() != 2 || b.dim() != 2 || out.dim() != 3 ||
      out.scalar_type() != at::kBFloat16 || !out.is_contiguous() || block < 1 || offs.dim() != 1) {
    return false;
  }
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1), E = offs.size(0);
  if (!wgrad_operands(a, b, row_scale, col_scale, out, E, N, true)) return false;
  const int32_t* ends = group_ends(offs, M);
  if (ends == nullptr) return false;
  std::vector<int64_t> first;
  if (!first_block_rows(ends, E, block, row_scale.size(0), first)) return false;
  static const Bf16Codes bf16_codes;
  const auto pieces = k_pieces(ends, E, K, out);
  const float* rs = row_scale.const_data_ptr<float>();
  const float* cs = col_scale.const_data_ptr<float>();
  const auto* ap = static_cast<const uint8_t*>(a.const_data_ptr());
  const auto* bp = static_cast<const uint8_t*>(b.const_data_ptr());
  const uint64_t call = next_call();
  const bool stream = out_streams(out, stream_out);
  run_pieces(pieces, "fp8_mx_mm_wgrad", [&](const KPiece& p) {
    const auto block_row = [&](int64_t r) { return first[p.g] + r / block; };  // r: from start
    thread_local PieceCopy<> b_copy;
    thread_local std::vector<uint16_t> a_buf;  // each piece its own columns of a
    uint16_t* bh = b_copy.get(call, p.start, p.rows, N, [&](uint16_t* d) {
      ScaleRowSteps steps;  // (a scale row per block of rows)
      for (int64_t r = 0; r < p.rows; ++r) {
        steps.dequantize(bf16_codes, bp + (p.start + r) * b.stride(0), N, cs + block_row(r) * N,
                         d + r * N);
      }
    });
    const int64_t kw = p.k1 - p.k0;
    uint16_t* ah = torch_moe_cpu::aligned_scratch(a_buf, p.rows * kw);
    ScaleRowSteps steps;
    for (int64_t r = 0; r < p.rows; ++r) {
      steps.dequantize(bf16_codes, ap + (p.start + r) * a.stride(0) + p.k0, kw,
                       rs + block_row(r) * K + p.k0, ah + r * kw);
    }
    return torch_moe_cpu::bf16_gemm(Matrix::of(out, p.g).row_range(p.k0, kw),
                                    Matrix::bf16(ah, p.rows, kw, kw).t(),
                                    Matrix::bf16(bh, p.rows, N, N), {}, {}, stream);
  });
  return true;
#else
  (void)a, (void)b, (void)row_scale, (void)col_scale, (void)offs, (void)block, (void)out;
  (void)stream_out;
  return false;
#endif
}


// ---- The fp32 form by pieces ----
//
// Where this CPU does not multiply bf16 natively (AVX2 without AVX512-BF16: the CPU probe's
// half_gemm upcasts) the scaled GEMMs multiply the dequantized fp32 values. The Python
// form dequantizes a chunk of whole groups into fp32 tensors (each operand written to
// memory by one pass, read back by the GEMM) and runs each group's GEMM by ATen, which MKL
// splits over all threads: an expert's GEMM of a few dozen rows gains little from that
// split, and the loop's Python costs ~20 us a group (on the Zen 3 EPYC measured the
// 64-expert forward of benchmarks/bench_fp8_emulation.py's prec3 ran its fp32 GEMMs at 38
// GFLOP/s on two threads, 62 one thread per group). These kernels run each piece (a
// group's rows by 256 output columns; the weight gradient's by output rows, k_pieces) on
// one thread: the piece's rows of a and its block of b[g] dequantized into the thread's
// scratch (dequantize_codes: fp8_dequantize_scaled's products, so the same fp32 operands),
// the fp32 GEMM on them on that thread alone (BLAS's sgemm_, which ATen's calls, on the
// buffers themselves: piece_mm), one rounding into out. The math is the
// Python form's but for the GEMM's summation order, which a GEMM library may choose per
// shape and thread count (MKL's for a few rows differs between one thread and two): the
// tests hold the values to the fp32 GEMM's rounding bound; for a given thread count they
// are deterministic. The pool's threads take the caller's thread-local state (inference
// mode, grad mode) for ATen's GEMM.

// o = a_f @ b_f by ATen's fp32 GEMM on this thread: into o where it is fp32, else into
// fp32 scratch (outside the allocator, as the direct route's) rounded once into o (ATen's
// copy).
void mm_fp32_into(at::Tensor o, const at::Tensor& a_f, const at::Tensor& b_f) {
  if (o.scalar_type() == at::kFloat) {
    at::mm_out(o, a_f, b_f);
    return;
  }
  thread_local std::vector<float> prod;
  float* p = torch_moe_cpu::aligned_scratch(prod, std::max<int64_t>(o.numel(), 1));
  auto product = at::from_blob(p, {o.size(0), o.size(1)}, at::TensorOptions().dtype(at::kFloat));
  at::mm_out(product, a_f, b_f);
  o.copy_(product);
}

// o [rows, cols] (row stride ldo; fp32, or with bf16 the products rounded once, as ATen's
// copy rounds them) = a @ b for fp32 operands in the thread's buffers (a [rows, k] and b
// [k, cols], each row- or column-major: fp32_gemm's layouts), on this thread: with
// `direct` (the op's one reading of fp32_gemm_available) by fp32_gemm_into (sgemm_cpu.h),
// else by ATen's GEMM on views of the buffers.
void piece_mm(bool direct, void* o, int64_t ldo, bool bf16, int64_t rows, int64_t cols,
              int64_t k, const float* a, int64_t lda, bool a_cols, const float* b, int64_t ldb,
              bool b_cols) {
  if (direct && torch_moe_cpu::fp32_gemm_into(bf16 ? at::kBFloat16 : at::kFloat, o, ldo, rows,
                                              cols, k, a, lda, a_cols, b, ldb, b_cols)) {
    return;
  }
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const auto view = [&](const float* q, int64_t r, int64_t c, int64_t ld, bool by_cols) {
    return at::from_blob(const_cast<float*>(q), {r, c},
                         by_cols ? at::IntArrayRef{1, ld} : at::IntArrayRef{ld, 1}, f32);
  };
  mm_fp32_into(at::from_blob(o, {rows, cols}, {ldo, 1}, f32.dtype(bf16 ? at::kBFloat16 : at::kFloat)),
               view(a, rows, k, lda, a_cols), view(b, k, cols, ldb, b_cols));
}

// Scale-block sizes of a dim of `size` elements with `blocks` scales along it: the dim
// whole where one (block -1, or a block past the dim), else `block`; 0 where the count
// is not ceil(size / block).
int64_t scale_block(int64_t blocks, int64_t block, int64_t size) {
  if (blocks == 1) return std::max<int64_t>(size, 1);
  if (block < 1 || blocks != (size + block - 1) / block) return 0;
  return block;
}

// out [M, N] (fp32 or bf16, contiguous) = for the rows of group g (offs' ends) a's rows
// times b[g], each operand dequantized: a's element (m, k) times row_scale[m (0 where one
// row), k / bka], b[g]'s (k, n) times col_scale[g, k / bkb, n / bn] (bka, bkb, bn: the
// scale blocks, block_k / block_n or the whole dim where one scale spans it); rows past
// the last group zero. a [M, K] row-major, b [E, K, N] e4m3fn (each expert row- or
// column-major), row_scale [1 or M, KSa] and col_scale [E, KSb, NS] contiguous fp32, NS
// one or its blocks whole multiples of the pieces' 256 columns' divisor. False without
// touching out where the operands are not these.
bool fp8_dequantized_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& row_scale,
                        const at::Tensor& col_scale, const at::Tensor& offs, int64_t block_k,
                        int64_t block_n, at::Tensor& out) {
  if (a.scalar_type() != at::kFloat8_e4m3fn || b.scalar_type() != at::kFloat8_e4m3fn ||
      a.dim() != 2 || b.dim() != 3 || out.dim() != 2 || !out.is_contiguous() ||
      (out.scalar_type() != at::kFloat && out.scalar_type() != at::kBFloat16) ||
      row_scale.scalar_type() != at::kFloat || !row_scale.is_contiguous() ||
      row_scale.dim() != 2 || col_scale.scalar_type() != at::kFloat ||
      !col_scale.is_contiguous() || col_scale.dim() != 3) {
    return false;
  }
  const int64_t M = a.size(0), K = a.size(1), E = b.size(0), N = b.size(2);
  if (b.size(1) != K || out.size(0) != M || out.size(1) != N || offs.dim() != 1 ||
      offs.size(0) != E || (a.stride(1) != 1 && K > 1) ||
      (row_scale.size(0) != 1 && row_scale.size(0) != M) || col_scale.size(0) != E) {
    return false;
  }
  // b[g] walked by rows (its columns contiguous) or by columns (its K codes contiguous)
  const bool b_rows = b.stride(2) == 1 || N <= 1;
  if (!b_rows && b.stride(1) != 1 && K > 1) return false;
  const int64_t KSa = row_scale.size(1), KSb = col_scale.size(1), NS = col_scale.size(2);
  const int64_t bka = scale_block(KSa, block_k, K), bkb = scale_block(KSb, block_k, K);
  const int64_t bn = scale_block(NS, block_n, N);
  // every piece's columns start on a scale block; a column's k blocks are strided scales
  if (bka == 0 || bkb == 0 || bn == 0 || (NS > 1 && kPieceCols % bn != 0) ||
      (!b_rows && bkb == 1 && KSb > 1)) {
    return false;
  }
  const int32_t* ends = group_ends(offs, M);
  if (ends == nullptr) return false;
  const auto pieces = row_pieces(ends, E, code_rows(K, sizeof(float)), N);  // fp32 rows
  const bool bf16_out = out.scalar_type() == at::kBFloat16;
  const bool direct = torch_moe_cpu::fp32_gemm_available();
  char* const outp = static_cast<char*>(out.mutable_data_ptr());
  const int64_t item = out.element_size();
  const float* rs = row_scale.const_data_ptr<float>();
  const float* cs = col_scale.const_data_ptr<float>();
  const auto* ap = static_cast<const uint8_t*>(a.const_data_ptr());
  const auto* bp = static_cast<const uint8_t*>(b.const_data_ptr());
  const int64_t lda = a.stride(0), row_scales = row_scale.size(0);
  const uint64_t call = next_call();
  const at::ThreadLocalState state;
  run_pieces(pieces, "fp8_dequantized_mm", [&](const RowPiece& p) {
    const at::ThreadLocalStateGuard guard(state);
    thread_local PieceCopy<float> a_copy;
    thread_local std::vector<float> b_buf;  // each piece its own columns of b[g]
    const float* af = a_copy.get(call, p.start, p.rows, K, [&](float* d) {
      for (int64_t r = 0; r < p.rows; ++r) {
        const int64_t m = p.start + r;
        dequantize_codes(ap + m * lda, K, rs + (row_scales == 1 ? 0 : m) * KSa, bka, 1, d + r * K);
      }
    });
    const int64_t cols = p.c1 - p.c0;
    const uint8_t* bg = bp + p.g * b.stride(0);
    const float* sg = cs + p.g * KSb * NS;  // b[g]'s scales [KSb, NS]
    const int64_t sc0 = NS == 1 ? 0 : p.c0 / bn;
    float* d = torch_moe_cpu::aligned_scratch(b_buf, std::max<int64_t>(K * cols, 1));
    if (b_rows) {  // b[g]'s rows k, columns [c0, c1): their scales along the row
      for (int64_t k = 0; k < K; ++k) {
        dequantize_codes(bg + k * b.stride(1) + p.c0, cols, sg + (k / bkb) * NS + sc0,
                         NS == 1 ? cols : bn, 1, d + k * cols);
      }
    } else {  // b[g]'s columns n in [c0, c1), K codes each: a scale per k block (stride NS)
      for (int64_t n = 0; n < cols; ++n) {
        const int64_t c = p.c0 + n;
        dequantize_codes(bg + c * b.stride(2), K, sg + (NS == 1 ? 0 : c / bn), bkb, NS, d + n * K);
      }
    }
    piece_mm(direct, outp + (p.start * N + p.c0) * item, N, bf16_out, p.rows, cols, K, af, K,
             false, d, b_rows ? cols : K, !b_rows);
    return true;
  });
  zero_past_groups(out, ends, E);
  return true;
}

// out [E, K, N] (fp32 or bf16, contiguous): the weight gradients of dequantized operands,
// out[g] = a[rows of g]^T @ b[rows of g], a's (m, k) times row_scale[s(m), k] and b's (m,
// n) times col_scale[s(m), n] (s(m) = index[m], or 0 without an index; a scale row of one
// element spans the row); empty groups zero. a [M, K] and b [M, N] row-major e4m3fn,
// row_scale [R, K or 1] and col_scale [R, N or 1] contiguous fp32 (one row where no
// index: per tensor), index [M] int64 in [0, R). k_pieces' pieces shared out over the
// threads. False without touching out where the operands are not these.
bool fp8_dequantized_mm_wgrad(const at::Tensor& a, const at::Tensor& b,
                              const at::Tensor& row_scale, const at::Tensor& col_scale,
                              const std::optional<at::Tensor>& index, const at::Tensor& offs,
                              at::Tensor& out) {
  if (a.scalar_type() != at::kFloat8_e4m3fn || b.scalar_type() != at::kFloat8_e4m3fn ||
      a.dim() != 2 || b.dim() != 2 || out.dim() != 3 || !out.is_contiguous() ||
      (out.scalar_type() != at::kFloat && out.scalar_type() != at::kBFloat16) ||
      row_scale.scalar_type() != at::kFloat || !row_scale.is_contiguous() ||
      row_scale.dim() != 2 || col_scale.scalar_type() != at::kFloat ||
      !col_scale.is_contiguous() || col_scale.dim() != 2 || offs.dim() != 1) {
    return false;
  }
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1), E = offs.size(0);
  const int64_t R = row_scale.size(0), KS = row_scale.size(1), NS = col_scale.size(1);
  if (b.size(0) != M || out.size(0) != E || out.size(1) != K || out.size(2) != N ||
      (a.stride(1) != 1 && K > 1) || (b.stride(1) != 1 && N > 1) || col_scale.size(0) != R ||
      (KS != 1 && KS != K) || (NS != 1 && NS != N) || R < 1) {
    return false;
  }
  const int64_t* idx = nullptr;
  if (!read_index(index, M, R, idx) || (idx == nullptr && R != 1)) return false;
  const int32_t* ends = group_ends(offs, M);
  if (ends == nullptr) return false;
  const auto pieces = k_pieces(ends, E, K, out);
  const bool bf16_out = out.scalar_type() == at::kBFloat16;
  const bool direct = torch_moe_cpu::fp32_gemm_available();
  char* const outp = static_cast<char*>(out.mutable_data_ptr());
  const int64_t item = out.element_size();
  const float* rs = row_scale.const_data_ptr<float>();
  const float* cs = col_scale.const_data_ptr<float>();
  const auto* ap = static_cast<const uint8_t*>(a.const_data_ptr());
  const auto* bp = static_cast<const uint8_t*>(b.const_data_ptr());
  const uint64_t call = next_call();
  const at::ThreadLocalState state;
  const auto srow = [&](int64_t m) { return idx != nullptr ? idx[m] : 0; };
  run_pieces(pieces, "fp8_dequantized_mm_wgrad", [&](const KPiece& p) {
    const at::ThreadLocalStateGuard guard(state);
    thread_local PieceCopy<float> b_copy;
    thread_local std::vector<float> a_buf;  // each piece its own columns of a
    const float* bf = b_copy.get(call, p.start, p.rows, N, [&](float* d) {
      for (int64_t r = 0; r < p.rows; ++r) {
        const int64_t m = p.start + r;
        dequantize_codes(bp + m * b.stride(0), N, cs + srow(m) * NS, NS == 1 ? N : 1, 1, d + r * N);
      }
    });
    const int64_t kw = p.k1 - p.k0;
    float* d = torch_moe_cpu::aligned_scratch(a_buf, std::max<int64_t>(p.rows * kw, 1));
    for (int64_t r = 0; r < p.rows; ++r) {
      const int64_t m = p.start + r;
      dequantize_codes(ap + m * a.stride(0) + p.k0, kw, rs + srow(m) * KS + (KS == 1 ? 0 : p.k0),
                       KS == 1 ? kw : 1, 1, d + r * kw);
    }
    // out[g]'s rows [k0, k1) = (a's piece)^T @ b's rows: a^T column-major in the scratch
    piece_mm(direct, outp + (p.g * K + p.k0) * N * item, N, bf16_out, kw, N, p.rows, d, kw,
             true, bf, N, false);
    return true;
  });
  return true;
}

#else  // no AVX2 vectors: every op refuses, the caller runs ATen

bool fp8_dequantize_scaled(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           int64_t, int64_t, at::Tensor&) {
  return false;
}
bool fp8_quantize_rows(const at::Tensor&, int64_t, int64_t, at::Tensor&, at::Tensor&, int64_t) {
  return false;
}
bool fp8_quantize_jagged(const at::Tensor&, const at::Tensor&, int64_t, at::Tensor&, at::Tensor&,
                         int64_t) {
  return false;
}
bool fp8_from_float(const at::Tensor&, at::Tensor&) { return false; }
bool fp8_dequantized_mm(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, int64_t, int64_t, at::Tensor&) {
  return false;
}
bool fp8_dequantized_mm_wgrad(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const std::optional<at::Tensor>&,
                              const at::Tensor&, at::Tensor&) {
  return false;
}
bool fp8_to_float(const at::Tensor&, at::Tensor&) { return false; }
bool fp8_block_scaled_mm(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, int64_t, at::Tensor&, bool,
                         int64_t) {
  return false;
}
bool fp8_block_scaled_mm_wgrad(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, int64_t, at::Tensor&, bool) {
  return false;
}
bool fp8_mx_mm(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
               const at::Tensor&, int64_t, at::Tensor&, bool) {
  return false;
}
bool fp8_mx_few_rows_mm(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, at::Tensor&) {
  return false;
}
bool fp8_mx_mm_wgrad(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, int64_t, at::Tensor&, bool) {
  return false;
}

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_moe_cpu, m) {
  m.def("fp8_from_float(Tensor x, Tensor(a!) out) -> bool");
  m.def("fp8_to_float(Tensor q, Tensor(a!) out) -> bool");
  m.def(
      "fp8_dequantize_scaled(Tensor q, Tensor scale, Tensor? index, int block_rows, int block,"
      " Tensor(a!) out) -> bool");
  m.def(
      "fp8_block_scaled_mm(Tensor a, Tensor b, Tensor row_scale, Tensor col_scale, Tensor offs,"
      " int block_k, Tensor(a!) out, bool stream_out=False, int few_rows=0) -> bool");
  m.def(
      "fp8_block_scaled_mm_wgrad(Tensor a, Tensor b, Tensor row_scale, Tensor col_scale,"
      " Tensor offs, int block, Tensor(a!) out, bool stream_out=False) -> bool");
  m.def(
      "fp8_mx_mm(Tensor a, Tensor b, Tensor row_scale, Tensor col_scale, Tensor offs,"
      " int block_k, Tensor(a!) out, bool stream_out=False) -> bool");
  m.def(
      "fp8_mx_mm_wgrad(Tensor a, Tensor b, Tensor row_scale, Tensor col_scale, Tensor offs,"
      " int block, Tensor(a!) out, bool stream_out=False) -> bool");
  m.def("fp8_mx_few_rows_mm(Tensor x, Tensor b, Tensor scale, Tensor offs, Tensor(a!) out) -> bool");
  m.def(
      "fp8_dequantized_mm(Tensor a, Tensor b, Tensor row_scale, Tensor col_scale, Tensor offs,"
      " int block_k, int block_n, Tensor(a!) out) -> bool");
  m.def(
      "fp8_dequantized_mm_wgrad(Tensor a, Tensor b, Tensor row_scale, Tensor col_scale,"
      " Tensor? index, Tensor offs, Tensor(a!) out) -> bool");
  m.def(
      "fp8_quantize_rows(Tensor x, int block_rows, int block, Tensor(a!) q, Tensor(b!) scale,"
      " int rule=0) -> bool");
  m.def(
      "fp8_quantize_jagged(Tensor x, Tensor offs, int block, Tensor(a!) q, Tensor(b!) scale,"
      " int rule=0) -> bool");
}

TORCH_LIBRARY_IMPL(torch_moe_cpu, CPU, m) {
  m.impl("fp8_from_float", &fp8_from_float);
  m.impl("fp8_to_float", &fp8_to_float);
  m.impl("fp8_block_scaled_mm", &fp8_block_scaled_mm);
  m.impl("fp8_block_scaled_mm_wgrad", &fp8_block_scaled_mm_wgrad);
  m.impl("fp8_mx_mm", &fp8_mx_mm);
  m.impl("fp8_mx_mm_wgrad", &fp8_mx_mm_wgrad);
  m.impl("fp8_mx_few_rows_mm", &fp8_mx_few_rows_mm);
  m.impl("fp8_dequantized_mm", &fp8_dequantized_mm);
  m.impl("fp8_dequantized_mm_wgrad", &fp8_dequantized_mm_wgrad);
  m.impl("fp8_dequantize_scaled", &fp8_dequantize_scaled);
  m.impl("fp8_quantize_rows", &fp8_quantize_rows);
  m.impl("fp8_quantize_jagged", &fp8_quantize_jagged);
}
