// Half-precision vectors to fp32 for torch_moe's native CPU kernels and back: one
// Vectorized of bfloat16 or half becomes two Vectorized<float>, by ATen's conversions
// (exact), and two are rounded into one. Only in the builds with ATen's vector types of a
// CPU capability (AVX512 / AVX2).

#pragma once

#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
namespace torch_moe_cpu {

inline auto to_float(const at::vec::Vectorized<at::BFloat16>& v) {
  return at::vec::convert_bfloat16_float(v);
}

inline auto to_float(const at::vec::Vectorized<at::Half>& v) {
  return at::vec::convert_half_float(v);
}

// and back: two fp32 vectors rounded (to nearest even) into one of T, as at::vec::convert
// and a tensor copy round them
template <typename T>
at::vec::Vectorized<T> from_float(
    const at::vec::Vectorized<float>& lo, const at::vec::Vectorized<float>& hi);

template <>
inline at::vec::Vectorized<at::BFloat16> from_float<at::BFloat16>(
    const at::vec::Vectorized<float>& lo, const at::vec::Vectorized<float>& hi) {
  return at::vec::convert_float_bfloat16(lo, hi);
}

template <>
inline at::vec::Vectorized<at::Half> from_float<at::Half>(
    const at::vec::Vectorized<float>& lo, const at::vec::Vectorized<float>& hi) {
  return at::vec::convert_float_half(lo, hi);
}

}  // namespace torch_moe_cpu
#endif
