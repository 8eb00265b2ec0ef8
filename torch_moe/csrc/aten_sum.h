// Sums of fp32 rows in the order of ATen's CPU sum over a last dimension, for the native
// kernels whose outputs must have the bits of an ATen `.sum(-1)`.

#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace torch_moe_cpu {

// The sum of a contiguous fp32 row x[0, n) in the order in which ATen's CPU sum over a
// last dimension adds it (cascade_sum in ATen/native/cpu/SumKernel.cpp), so that a
// native kernel's row sums have the bits of the ATen ops' x.sum(-1) (swiglu_cpu.cpp's d
// row_weights, (ga * a).sum(-1); permute_cpu.cpp's row_dot, weighted_row_dot's
// (rows * tokens).sum(1)). That kernel is registered for the default and AVX2
// builds only (REGISTER_DISPATCH leaves AVX-512 to the AVX2 kernel), where
// Vectorized<float> has 8 lanes: kSumLanes, whatever width this build's kV is. A row of
// n >= 8 is cut into whole vectors of 8 (the units) and a scalar tail; a shorter row's
// units are its elements. Four accumulators take units 4q + k (k = 0..3) of each group q
// of four units; every 2^lp groups (lp = max(4, ceil_log2(groups) / 4)) they cascade
// into a second level, every 2^(2 lp) into a third, every 2^(3 lp) into a fourth, and the
// levels are added back in order at the end; the units past the last group go into
// accumulator 0, accumulators 1, 2, 3 are added to it in turn; for vectors a scalar sum
// then takes the tail elements and the lanes in order; the result is added to the zero
// that ATen fills its output with. Each lane's additions are IEEE fp32 additions in that
// order, however the compiler vectorizes them. (ATen cuts one row between threads only
// when the whole reduction has one output: a single row of 32768+ elements on several
// threads, which a row kernel does not reproduce.) Each user checks these bits against
// ATen's sum once per process on long rows (every cascade level) and short ones before it
// takes its kernels (grouped_swiglu.py's _native_matches_aten, permute.py's
// _row_dot_matches_aten).
constexpr int64_t kSumLanes = 8;

inline int64_t ceil_log2(int64_t x) {
  int64_t r = 1;  // 1 for x <= 2, as ATen's
  while ((int64_t{1} << r) < x) {
    ++r;
  }
  return r;
}

// kSumLanes fp32 lanes added lane by lane: one AVX register in the vector builds (kept
// in registers, where an array of floats went through the stack), else an array
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
struct SumLanes {
  __m256 v = _mm256_setzero_ps();
  static SumLanes load(const float* p) {
    return {_mm256_loadu_ps(p)};
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, v);
  }
  SumLanes operator+(const SumLanes& o) const {
    return {_mm256_add_ps(v, o.v)};
  }
};
#else
struct SumLanes {
  float v[kSumLanes] = {};
  static SumLanes load(const float* p) {
    SumLanes r;
    std::copy_n(p, kSumLanes, r.v);
    return r;
  }
  void store(float* p) const {
    std::copy_n(v, kSumLanes, p);
  }
  SumLanes operator+(const SumLanes& o) const {
    SumLanes r;
    for (int64_t l = 0; l < kSumLanes; ++l) {
      r.v[l] = v[l] + o.v[l];
    }
    return r;
  }
};
#endif

// The sum of `units` units in ATen's order: U = SumLanes (units of kSumLanes floats) or
// float (units are elements).
template <typename U>
inline U cascade_sum_units(const float* x, int64_t units) {
  const auto load = [x](int64_t i) {
    if constexpr (std::is_same_v<U, float>) {
      return x[i];
    } else {
      return U::load(x + i * kSumLanes);
    }
  };
  const int64_t groups = units / 4;
  const int64_t lp = std::max<int64_t>(4, ceil_log2(groups) / 4);
  const int64_t step = int64_t{1} << lp, mask = step - 1;
  U acc[4][4] = {};  // [level][accumulator]
  int64_t q = 0;
  while (q + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++q) {
      for (int k = 0; k < 4; ++k) {
        acc[0][k] = acc[0][k] + load(4 * q + k);
      }
    }
    for (int level = 1; level < 4; ++level) {
      for (int k = 0; k < 4; ++k) {
        acc[level][k] = acc[level][k] + acc[level - 1][k];
        acc[level - 1][k] = U{};
      }
      if ((q & (mask << (level * lp))) != 0) {
        break;
      }
    }
  }
  for (; q < groups; ++q) {
    for (int k = 0; k < 4; ++k) {
      acc[0][k] = acc[0][k] + load(4 * q + k);
    }
  }
  for (int level = 1; level < 4; ++level) {
    for (int k = 0; k < 4; ++k) {
      acc[0][k] = acc[0][k] + acc[level][k];
    }
  }
  U sum = acc[0][0];
  for (int64_t i = 4 * groups; i < units; ++i) {
    sum = sum + load(i);
  }
  for (int k = 1; k < 4; ++k) {
    sum = sum + acc[0][k];
  }
  return sum;
}

inline float aten_order_sum(const float* x, int64_t n) {
  if (n < kSumLanes) {
    return 0.f + cascade_sum_units<float>(x, n);
  }
  const int64_t vectors = n / kSumLanes;
  float lanes[kSumLanes];
  cascade_sum_units<SumLanes>(x, vectors).store(lanes);
  float s = 0.f;
  for (int64_t i = vectors * kSumLanes; i < n; ++i) {
    s += x[i];
  }
  for (const float lane : lanes) {
    s += lane;
  }
  return 0.f + s;
}

}  // namespace torch_moe_cpu
