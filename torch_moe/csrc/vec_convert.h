// Half-precision vectors to fp32 for torch_moe's native CPU kernels and back: one
// Vectorized of bfloat16 or half becomes two Vectorized<float>, by ATen's conversions
// (exact), and two are rounded into one. Only in the builds with ATen's vector types of a
// CPU capability (AVX512 / AVX2).

#pragma once

#include <ATen/cpu/vec/vec.h>

#include <unistd.h>

#include <cstdint>

namespace torch_moe_cpu {

// This core's L2 cache in bytes: the system's figure, 2 MiB where it gives none.
inline int64_t l2_cache_bytes() {
  static const int64_t l2 = [] {
    const long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return size > 0 ? static_cast<int64_t>(size) : int64_t(2) << 20;
  }();
  return l2;
}

// Whether a kernel's whole output of `bytes` is past this core's L2 cache: its lines then
// leave the cache before anything reads them, and the kernels write them by non-temporal
// stores (no read for ownership of every line first; see store_vec).
inline bool past_l2(int64_t bytes) {
  return bytes > l2_cache_bytes();
}

}  // namespace torch_moe_cpu

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

// v into p: with `stream`, where p starts a vector's width of bytes (a 64-byte line with
// AVX-512), by a non-temporal store, else a plain one. The caller fences (_mm_sfence)
// before the output is handed on.
template <typename T>
inline void store_vec(const at::vec::Vectorized<T>& v, T* p, bool stream) {
  constexpr uintptr_t width = sizeof(at::vec::Vectorized<T>);
  if (stream && (reinterpret_cast<uintptr_t>(p) & (width - 1)) == 0) {
#if defined(CPU_CAPABILITY_AVX512)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), static_cast<__m512i>(v));
#else
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), static_cast<__m256i>(v));
#endif
    return;
  }
  v.store(p);
}

}  // namespace torch_moe_cpu
#endif
