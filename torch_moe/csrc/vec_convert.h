// Half-precision vectors to fp32 for torch_moe's native CPU kernels: one Vectorized of
// bfloat16 or half becomes two Vectorized<float>, by ATen's conversions (exact). Only in
// the builds with ATen's vector types of a CPU capability (AVX512 / AVX2).

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

}  // namespace torch_moe_cpu
#endif
