// FP8 e4m3fn conversions for the CPU FP8 emulation (torch_moe/quantization/quantize.py):
//
//   fp8_from_float(x fp32, out e4m3fn) -> bool
//       out = x.clamp(-448, 448).to(float8_e4m3fn)   (the saturating cast; x not changed)
//   fp8_to_float(q e4m3fn, out fp32) -> bool
//       out = q.float()
//
// ATen converts fp32 to e4m3fn one element at a time (c10's fp8e4m3fn_from_fp32_value),
// 0.5-0.7 ns per element on the CPUs measured, and e4m3fn to fp32 at ~4 ns per element:
// the FP8 emulation's quantizers and dequantizers spend most of their time there
// (benchmarks/results/cpu_floor_cpu_202612.md). These kernels take 8 elements per AVX2
// step with the same bits: the cast is c10's integer recipe, lane by lane (round to
// nearest even, e4m3fn's subnormals rounded by an fp32 addition of 2^14, whose ulp is
// e4m3fn's smallest step 2^-9), NaN to 0x7F with x's sign, after the clamp (which keeps
// NaN, as ATen's clamp does); the other way is a table of ATen's own 256 values. Tails
// take c10's conversion and the table. Both need x and out (q and out) of one shape with
// a contiguous last dim; each returns false without touching out where they do not apply
// (another layout or dtype, a build without AVX2 vectors): the caller runs ATen.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <array>
#include <cstdint>
#include <cstring>

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

uint8_t cast_one(float v) {  // the clamp and c10's conversion (v NaN: stays NaN)
  const float c = v > kMax ? kMax : (v < -kMax ? -kMax : v);
  return c10::Float8_e4m3fn(c).x;
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

// 8 floats clamped and cast, one code in the low byte of each 32-bit lane.
inline __m256i cast8(__m256 v) {
  const __m256 c = _mm256_min_ps(_mm256_set1_ps(kMax), _mm256_max_ps(_mm256_set1_ps(-kMax), v));
  const __m256i bits = _mm256_castps_si256(c);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN));
  const __m256i mag = _mm256_xor_si256(bits, sign);
  // normal: the exponent rebiased (7 - 127), rounded to nearest even at bit 20
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(mag, 20), _mm256_set1_epi32(1));
  __m256i normal = _mm256_add_epi32(mag, _mm256_set1_epi32(static_cast<int32_t>(
                                             (uint32_t{7} - 127u) << 23) + 0x7FFFF));
  normal = _mm256_srli_epi32(_mm256_add_epi32(normal, odd), 20);
  // under 2^-6: rounded to a multiple of 2^-9 by adding 2^14 in fp32
  const __m256i denorm_mask = _mm256_set1_epi32(141 << 23);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(mag), _mm256_castsi256_ps(denorm_mask))),
      denorm_mask);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), mag);
  __m256i r = _mm256_blendv_epi8(normal, sub, small);
  // NaN (the clamp keeps it): 0x7F
  const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32((1087 << 20) - 1));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), nan);
  return _mm256_and_si256(_mm256_or_si256(r, _mm256_srli_epi32(sign, 24)), _mm256_set1_epi32(0xFF));
}

// The low bytes of 8 lanes stored as 8 bytes.
inline void store8(uint8_t* o, __m256i codes) {
  const __m256i shuf = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_shuffle_epi8(codes, shuf);  // bytes 0-3 of each 128-bit lane
  const __m256i two = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(two));
}

bool fp8_from_float(const at::Tensor& x, at::Tensor& out) {
  if (x.scalar_type() != at::kFloat || out.scalar_type() != at::kFloat8_e4m3fn ||
      !rows_apply(x, out)) {
    return false;
  }
  if (x.numel() == 0) return true;
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  const Rows src(x), dst(out);
  for_rows(rows, cols, [&](int64_t r) {
    const float* s = src.row<const float>(r);
    uint8_t* o = dst.row<uint8_t>(r);
    int64_t j = 0;
    for (; j + 8 <= cols; j += 8) store8(o + j, cast8(_mm256_loadu_ps(s + j)));
    for (; j < cols; ++j) o[j] = cast_one(s[j]);
  });
  return true;
}

bool fp8_to_float(const at::Tensor& q, at::Tensor& out) {
  if (q.scalar_type() != at::kFloat8_e4m3fn || out.scalar_type() != at::kFloat ||
      !rows_apply(q, out)) {
    return false;
  }
  if (q.numel() == 0) return true;
  const int64_t cols = q.size(-1), rows = q.numel() / cols;
  const Rows src(q), dst(out);
  const float* table = fp8_values().data();
  for_rows(rows, cols, [&](int64_t r) {
    const uint8_t* s = src.row<const uint8_t>(r);
    float* o = dst.row<float>(r);
    int64_t j = 0;
    for (; j + 8 <= cols; j += 8) {
      int64_t eight;
      std::memcpy(&eight, s + j, 8);
      const __m256i idx = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(eight));
      _mm256_storeu_ps(o + j, _mm256_i32gather_ps(table, idx, 4));
    }
    for (; j < cols; ++j) o[j] = table[s[j]];
  });
  return true;
}

#else

bool fp8_from_float(const at::Tensor& x, at::Tensor& out) {
  (void)x;
  (void)out;
  return false;
}

bool fp8_to_float(const at::Tensor& q, at::Tensor& out) {
  (void)q;
  (void)out;
  return false;
}

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_moe_cpu, m) {
  m.def("fp8_from_float(Tensor x, Tensor(a!) out) -> bool");
  m.def("fp8_to_float(Tensor q, Tensor(a!) out) -> bool");
}

TORCH_LIBRARY_IMPL(torch_moe_cpu, CPU, m) {
  m.impl("fp8_from_float", &fp8_from_float);
  m.impl("fp8_to_float", &fp8_to_float);
}
