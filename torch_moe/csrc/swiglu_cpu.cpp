// The experts' activations of torch_moe's CPU kernels, one pass each: SwiGLU
// (grouped_swiglu's) first, then the glu op's swigluoai (GPT-OSS) and ungated relu2
// (Nemotron-H).
//
// grouped_swiglu's CPU kernels compute the activation (and its backward) in fp32 from
// half-precision h with one rounding into the outputs. In ATen ops that takes five
// passes over [rows, F] forward and twelve backward (conversions, sigmoid, the products,
// silu_backward, the rounding copies), each over fp32 temporaries. These two kernels do
// the same arithmetic row by row (from L1-resident fp32 row buffers, or for the backward
// of half-precision rows converted in registers), with the operations ATen's CPU kernels
// use element by element, so they give the same bits:
//
//   silu(g)      = g / (1 + exp(-g))             (ATen's silu)
//   sigmoid(g)   = 1 / (1 + exp(-g))             (ATen's sigmoid)
//   silu'(dy, g) = dy * s * (1 + g * (1 - s))    (ATen's silu_backward, s = sigmoid(g))
//
// ATen runs these on a row of F elements as vectors in blocks of two vectors and the
// rest with the scalar formula (std::exp), so the kernels below split each row alike.
// Products, conversions and the final rounding are exact or correctly rounded either way.
// The kernels are compiled for the CPU capability ATen dispatches to (torch_moe/_ops/
// _native.py passes it as CPU_CAPABILITY_*), so Vectorized<float> has ATen's width.
//
//   forward:  a = silu(gate) * up  (* w)                         -> out [rows, F]
//   backward: s = sigmoid(gate); silu = gate * s; a = silu * up
//             prod = ga * a                   (only with row weights: d w = sum_f prod,
//                                              summed in ATen's order: aten_order_sum)
//             a *= w; ga *= w
//             out_a = a; dUp = silu * ga; dGate = silu'(ga * up, gate) with this s
//   (the backward is one vector loop over the row: one exp per element, not two)
//
// With half-precision h, silu(gate) and sigmoid(gate) depend on gate's 16 bits alone, so
// the half-precision kernels can read them from tables of all 65536 values, built once per
// dtype by the vector functions below themselves (gate_tables): one gather in place of
// an exp and a division, with the same bits (the probe's act_table decision, measured;
// test_native checks every bit pattern against the computing kernel and ATen).

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE: the grain of ATen's elementwise loops
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "aten_sum.h"
#include "ops_cpu.h"
#include "vec_convert.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kV = fVec::size();

// The SwiGLU kernels read rows one after another from tensors past the caches, and
// compute enough per element (exp, a division) that the hardware's prefetch alone left
// the loads waiting: each loop over a row also prefetches, line for line, the row
// rows_ahead rows further on (about 8 KiB ahead, at least the next row; the combine's
// kAheadBytes in permute_cpu.cpp is the same idea). On the AMX Xeon measured, one
// thread, the backward ran 1.5x faster at the layer's sizes (E8 12.2 -> 8.0 ms, E64
// 7.1 -> 4.7), the forward 1.1x / 1.35x (benchmarks/results/cpu_floor_cpu_202612.md);
// relu2, with no exp, measured level and does not.
inline int64_t rows_ahead(int64_t row_bytes) {
  return std::clamp<int64_t>(8192 / std::max<int64_t>(row_bytes, 1), 1, 8);
}

inline void prefetch(const void* p) {
  __builtin_prefetch(p, 0, 3);
}

// src's n elements as fp32 into dst; `next` (or nullptr): a row to prefetch
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n, const T* next = nullptr) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = static_cast<float>(src[i]);
  }
}

template <>
inline void load_row<float>(const float* src, float* dst, int64_t n, const float* next) {
  std::memcpy(dst, src, n * sizeof(float));
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
using torch_moe_cpu::to_float;

// half-precision rows: a vector of T converts into two fp32 vectors
template <typename T>
inline void load_half_row(const T* src, float* dst, int64_t n, const T* next) {
  using hVec = Vectorized<T>;
  int64_t i = 0;
  for (; i + hVec::size() <= n; i += hVec::size()) {
    if (next != nullptr) {
      prefetch(next + i);
    }
    auto [lo, hi] = to_float(hVec::loadu(src + i));
    lo.store(dst + i);
    hi.store(dst + i + kV);
  }
  for (; i < n; ++i) {
    dst[i] = static_cast<float>(src[i]);
  }
}

template <>
inline void load_row<at::BFloat16>(
    const at::BFloat16* src, float* dst, int64_t n, const at::BFloat16* next) {
  load_half_row(src, dst, n, next);
}

template <>
inline void load_row<at::Half>(const at::Half* src, float* dst, int64_t n, const at::Half* next) {
  load_half_row(src, dst, n, next);
}
#endif

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  at::vec::convert(src, dst, n);  // round to nearest even, as a tensor copy
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// store_row into a half-precision row by whole vectors, non-temporal where they start one
// (torch_moe_cpu::store_vec): the same rounding of the same vectors and scalars
template <typename T>
inline void store_row_streamed(const float* src, T* dst, int64_t n) {
  using hVec = Vectorized<T>;
  int64_t i = 0;
  for (; i + hVec::size() <= n; i += hVec::size()) {
    const auto v = torch_moe_cpu::from_float<T>(fVec::loadu(src + i), fVec::loadu(src + i + kV));
    torch_moe_cpu::store_vec(v, dst + i, true);
  }
  for (; i < n; ++i) {
    dst[i] = static_cast<T>(src[i]);
  }
}
#endif

template <>
inline void store_row<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// The vector part of a row as ATen's CPU loops cut it: whole blocks of two vectors.
inline int64_t vector_end(int64_t n) {
  return n < 2 * kV ? 0 : n - n % (2 * kV);
}

using torch_moe_cpu::aten_order_sum;

// ATen's sigmoid and silu, in their vector and scalar forms
inline fVec sigmoid_vec(const fVec& x) {
  return ((fVec(0.f) - x).exp() + fVec(1.f)).reciprocal();
}

inline float sigmoid_scalar(float x) {
  return 1.f / (1.f + std::exp(-x));
}

inline fVec silu_vec(const fVec& x) {
  return x / (fVec(1.f) + x.neg().exp());
}

inline float silu_scalar(float x) {
  return x / (1.f + std::exp(-x));
}

// g <- silu(g)
inline void silu_row(float* g, int64_t n) {
  const int64_t v = vector_end(n);
  for (int64_t i = 0; i < v; i += kV) {
    silu_vec(fVec::loadu(g + i)).store(g + i);
  }
  for (int64_t i = v; i < n; ++i) {
    g[i] = silu_scalar(g[i]);
  }
}

// The backward of one vector / one element: x the gate, up, d = dA; act receives a, s
// dUp, and the result is dGate. With row weights w != nullptr, p receives dA * a
// (unweighted) and a, dA are scaled by w.
// ATen computes sigmoid(g) as (exp(0 - g) + 1).reciprocal() and silu_backward's own
// sigmoid as 1 / (1 + exp(-g)): the same operations on the same values (-g, exp, the sum,
// the division of one), so one sigmoid per element serves both.
// sig: sigmoid_vec(x), computed or looked up (gate_tables).
inline fVec backward_vec(
    const fVec& sig, const fVec& x, const fVec& up, fVec d, float* p, const float* w, fVec& act,
    fVec& s) {
  const fVec one(1.f);
  const fVec silu = sig * x;
  act = silu * up;
  if (w != nullptr) {
    const fVec wv(*w);
    (d * act).store(p);
    act = act * wv;
    d = d * wv;
  }
  s = silu * d;
  const fVec dy = d * up;
  return dy * sig * (one + x * (one - sig));
}

inline float backward_scalar(
    float x, float up, float d, float* p, const float* w, float& act, float& s) {
  const float sig = sigmoid_scalar(x);
  const float silu = sig * x;
  act = silu * up;
  if (w != nullptr) {
    *p = d * act;
    act *= *w;
    d *= *w;
  }
  s = silu * d;
  const float dy = d * up;
  return dy * sig * (1.f + x * (1.f - sig));
}

// The backward of one row from fp32 row buffers, in place: g, u: gate and up; ga: dA,
// then dGate; a: the activation; s: dUp (p, w as backward_vec's).
inline void backward_row(
    const float* g, const float* u, float* ga, float* a, float* s, float* p, const float* w,
    int64_t n) {
  const int64_t v = vector_end(n);
  int64_t i = 0;
  for (; i < v; i += kV) {
    fVec act, su;
    const fVec x = fVec::loadu(g + i);
    const fVec dg = backward_vec(
        sigmoid_vec(x), x, fVec::loadu(u + i), fVec::loadu(ga + i), p == nullptr ? p : p + i, w,
        act, su);
    act.store(a + i);
    su.store(s + i);
    dg.store(ga + i);
  }
  for (; i < n; ++i) {
    ga[i] = backward_scalar(g[i], u[i], ga[i], p == nullptr ? p : p + i, w, a[i], s[i]);
  }
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
using torch_moe_cpu::from_float;

// The gate tables of a half-precision dtype T: silu_vec(g) for every 16-bit pattern g,
// then sigmoid_vec(g) (2 x 65536 floats, 512 KiB; a layer's gates touch a few thousand
// entries, which stay in the L1 / L2). Built by the vector functions the computing kernels
// call, on the exact conversions of the patterns to fp32, so a lookup gives the bits the
// vector part of a row computes (rows' scalar tails, as ATen's, still call std::exp).
constexpr int64_t kGates = int64_t{1} << 16;

template <typename T>
std::vector<float> build_gate_tables() {
  std::vector<float> table(2 * kGates);
  float x[kV];
  for (int64_t base = 0; base < kGates; base += kV) {
    for (int64_t j = 0; j < kV; ++j) {
      x[j] = static_cast<float>(T(static_cast<uint16_t>(base + j), T::from_bits()));
    }
    const fVec xv = fVec::loadu(x);
    silu_vec(xv).store(table.data() + base);
    sigmoid_vec(xv).store(table.data() + kGates + base);
  }
  return table;
}

template <typename T>
const float* gate_tables() {
  static const std::vector<float> table = build_gate_tables<T>();  // thread-safe, once
  return table.data();
}

// the table indices of kV half-precision gates at p (their bit patterns)
#if defined(CPU_CAPABILITY_AVX512)
using iVec = __m512i;
template <typename T>
inline iVec gate_index(const T* p) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline fVec lookup(const float* table, const iVec& idx) {
  return _mm512_i32gather_ps(idx, table, 4);
}
#else
using iVec = __m256i;
template <typename T>
inline iVec gate_index(const T* p) {
  return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline fVec lookup(const float* table, const iVec& idx) {
  return _mm256_i32gather_ps(table, idx, 4);
}
#endif

// the table indices of kV gates of T given as their exact fp32 values x (the glu kernels'
// row buffers): a bf16's bits are the top half of its fp32's; an fp16's, the exact
// conversion back (a signalling NaN comes back quiet, as its fp32 already is: the same
// value either way)
template <typename T>
inline iVec gate_index_of(const fVec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return _mm512_srli_epi32(_mm512_castps_si512(x), 16);
  } else {
    return _mm512_cvtepu16_epi32(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
#else
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return _mm256_srli_epi32(_mm256_castps_si256(x), 16);
  } else {
    return _mm256_cvtepu16_epi32(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
#endif
}

// The backward of one row of a half-precision h straight from and into the
// half-precision rows, converted in registers: no fp32 row buffers and the five passes
// over them. The same operations on the same values, element by element, and the same
// vector / scalar split (blocks of two vectors, then scalars) as the buffered kernel,
// whose conversions (at::vec::convert) round the same vectors and scalars alike: the same
// bits. (The forward likewise, forward_row_half: on the Zen 5 it had gained alone at one
// width of three and nothing measurable inside a layer step; on the AMX Xeon, with the
// rows prefetched, 1.15-1.45x alone and 0.3-1.4% of a layer step.)
// h: gate then up; ga: dA; out_a: a; dh: dGate then dUp (p, w as backward_vec's);
// h_next, ga_next (or nullptr): the rows to prefetch (rows_ahead); sigmoids (or nullptr):
// T's sigmoid table (gate_tables), else computed
template <typename T>
inline void backward_row_half(const T* h, const T* ga, T* out_a, T* dh, float* p, const float* w,
                              int64_t n, bool stream, const T* h_next, const T* ga_next,
                              const float* sigmoids) {
  using hVec = Vectorized<T>;
  const int64_t v = vector_end(n);
  for (int64_t i = 0; i < v; i += 2 * kV) {
    if (h_next != nullptr) {  // a line of each (2 kV half elements: 64 bytes with AVX-512)
      prefetch(h_next + i);
      prefetch(h_next + n + i);
      prefetch(ga_next + i);
    }
    auto [g0, g1] = to_float(hVec::loadu(h + i));
    auto [u0, u1] = to_float(hVec::loadu(h + n + i));
    auto [d0, d1] = to_float(hVec::loadu(ga + i));
    fVec a0, a1, s0, s1;
    const bool look = sigmoids != nullptr;
    const fVec sig0 = look ? lookup(sigmoids, gate_index(h + i)) : sigmoid_vec(g0);
    const fVec sig1 = look ? lookup(sigmoids, gate_index(h + i + kV)) : sigmoid_vec(g1);
    const fVec dg0 = backward_vec(sig0, g0, u0, d0, p == nullptr ? p : p + i, w, a0, s0);
    const fVec dg1 = backward_vec(sig1, g1, u1, d1, p == nullptr ? p : p + i + kV, w, a1, s1);
    torch_moe_cpu::store_vec(from_float<T>(a0, a1), out_a + i, stream);
    torch_moe_cpu::store_vec(from_float<T>(s0, s1), dh + n + i, stream);
    torch_moe_cpu::store_vec(from_float<T>(dg0, dg1), dh + i, stream);
  }
  for (int64_t i = v; i < n; ++i) {
    float act = 0.f, s = 0.f;
    const float dg = backward_scalar(
        static_cast<float>(h[i]), static_cast<float>(h[n + i]), static_cast<float>(ga[i]),
        p == nullptr ? p : p + i, w, act, s);
    out_a[i] = static_cast<T>(act);
    dh[n + i] = static_cast<T>(s);
    dh[i] = static_cast<T>(dg);
  }
}

// The forward of one row of a half-precision h into a half-precision out, converted in
// registers (no fp32 row buffers and their passes): silu by vectors in blocks of two
// and the scalar tail as silu_row cuts a row, then the product, the row weight and the
// rounding as mul_row, scale_row and store_row make them: the same bits. silus (or
// nullptr): T's silu table (gate_tables), else computed.
template <typename T>
inline void forward_row_half(const T* h, T* out, const float* w, int64_t n, bool stream,
                             const T* h_next, const float* silus) {
  using hVec = Vectorized<T>;
  const int64_t v = vector_end(n);
  for (int64_t i = 0; i < v; i += 2 * kV) {
    if (h_next != nullptr) {
      prefetch(h_next + i);
      prefetch(h_next + n + i);
    }
    auto [u0, u1] = to_float(hVec::loadu(h + n + i));
    fVec a0, a1;
    if (silus != nullptr) {
      a0 = lookup(silus, gate_index(h + i)) * u0;
      a1 = lookup(silus, gate_index(h + i + kV)) * u1;
    } else {
      auto [g0, g1] = to_float(hVec::loadu(h + i));
      a0 = silu_vec(g0) * u0;
      a1 = silu_vec(g1) * u1;
    }
    if (w != nullptr) {
      const fVec wv(*w);
      a0 = a0 * wv;
      a1 = a1 * wv;
    }
    torch_moe_cpu::store_vec(from_float<T>(a0, a1), out + i, stream);
  }
  for (int64_t i = v; i < n; ++i) {
    float a = silu_scalar(static_cast<float>(h[i])) * static_cast<float>(h[n + i]);
    if (w != nullptr) {
      a *= *w;
    }
    out[i] = static_cast<T>(a);
  }
}
#endif

inline void mul_row(float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    a[i] *= b[i];
  }
}

inline void scale_row(float* a, float w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    a[i] *= w;
  }
}

void check_rows(const char* name, const at::Tensor& t, int64_t rows, int64_t cols) {
  TORCH_CHECK(
      t.dim() == 2 && t.size(0) == rows && t.size(1) == cols && t.stride(1) == 1,
      "swiglu_cpu: ", name, " must be [", rows, ", ", cols,
      "] with contiguous rows, got ", t.sizes(), " strides ", t.strides());
}

// d row_weights' output: a contiguous fp32 [rows] where there are row weights
float* grad_weights_ptr(
    const char* op, const float* w, const std::optional<at::Tensor>& grad_weights, int64_t rows) {
  if (w == nullptr) {
    return nullptr;
  }
  TORCH_CHECK(
      grad_weights.has_value() && grad_weights->scalar_type() == at::kFloat &&
          grad_weights->dim() == 1 && grad_weights->size(0) == rows &&
          grad_weights->stride(0) == 1,
      op, ": row weights need a contiguous fp32 grad_weights [", rows, "]");
  return grad_weights->data_ptr<float>();
}

const float* weights_ptr(const std::optional<at::Tensor>& w, int64_t rows) {
  if (!w.has_value()) {
    return nullptr;
  }
  TORCH_CHECK(
      w->scalar_type() == at::kFloat && w->dim() == 1 && w->size(0) == rows && w->stride(0) == 1,
      "swiglu_cpu: row_weights must be a contiguous fp32 [", rows, "], got ", w->sizes(),
      " ", w->scalar_type());
  return w->data_ptr<float>();
}

template <typename TH, typename TO>
void forward_impl(
    const at::Tensor& h, const float* w, const at::Tensor& out, bool stream_out,
    [[maybe_unused]] bool table) {
  const int64_t rows = h.size(0), f = out.size(1), hs = h.stride(0), os = out.stride(0);
  const TH* hp = h.data_ptr<TH>();
  TO* op = out.data_ptr<TO>();
  // where asked, an output past the L2 streamed (vec_convert.h): half dtypes, vector builds
  [[maybe_unused]] const bool stream =
      stream_out && !std::is_same_v<TO, float> && torch_moe_cpu::past_l2(out.nbytes());
  const int64_t ahead = rows_ahead(2 * f * static_cast<int64_t>(sizeof(TH)));
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<TH, TO> && !std::is_same_v<TH, float>) {
    const float* silus = table ? gate_tables<TH>() : nullptr;
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        forward_row_half(hp + r * hs, op + r * os, w == nullptr ? nullptr : w + r, f, stream,
                         r + ahead < r1 ? hp + (r + ahead) * hs : nullptr, silus);
      }
      if (stream) _mm_sfence();
    });
    return;
  }
#endif
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(2 * f);
    float* g = buf.data();
    float* u = g + f;
    for (int64_t r = r0; r < r1; ++r) {
      load_row(hp + r * hs, g, 2 * f, r + ahead < r1 ? hp + (r + ahead) * hs : nullptr);
      silu_row(g, f);
      mul_row(g, u, f);
      if (w != nullptr) {
        scale_row(g, w[r], f);
      }
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
      if constexpr (!std::is_same_v<TO, float>) {
        if (stream) {
          store_row_streamed(g, op + r * os, f);
          continue;
        }
      }
#endif
      store_row(g, op + r * os, f);
    }
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if (stream) _mm_sfence();
#endif
  });
}

template <typename TH, typename TO>
void backward_impl(
    const at::Tensor& h, const at::Tensor& grad_a, const float* w, const at::Tensor& out_a,
    const at::Tensor& out_dh, float* grad_w, bool stream_out, [[maybe_unused]] bool table) {
  const int64_t rows = h.size(0), f = grad_a.size(1);
  const int64_t hs = h.stride(0), gs = grad_a.stride(0), as = out_a.stride(0), ds = out_dh.stride(0);
  const TH* hp = h.data_ptr<TH>();
  const TO* gp = grad_a.data_ptr<TO>();
  TO* ap = out_a.data_ptr<TO>();
  TO* dp = out_dh.data_ptr<TO>();
  // with row weights, each row's products dA * a in an L1-resident row buffer, summed
  // into d w by ATen's order as soon as the row is done
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<TH, TO> && !std::is_same_v<TH, float>) {
    // where asked, outputs past the L2 streamed (vec_convert.h)
    const bool stream =
        stream_out && torch_moe_cpu::past_l2(out_dh.nbytes() + out_a.nbytes());
    const int64_t ahead = rows_ahead(3 * f * static_cast<int64_t>(sizeof(TH)));
    const float* sigmoids = table ? gate_tables<TH>() + kGates : nullptr;
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      std::vector<float> prod(w != nullptr ? f : 0);
      for (int64_t r = r0; r < r1; ++r) {
        const bool weighted = w != nullptr;
        const bool next = r + ahead < r1;
        backward_row_half(
            hp + r * hs, gp + r * gs, ap + r * as, dp + r * ds, weighted ? prod.data() : nullptr,
            weighted ? w + r : nullptr, f, stream, next ? hp + (r + ahead) * hs : nullptr,
            next ? gp + (r + ahead) * gs : nullptr, sigmoids);
        if (weighted) {
          grad_w[r] = aten_order_sum(prod.data(), f);
        }
      }
      if (stream) _mm_sfence();
    });
    return;
  }
#endif
  const int64_t ahead = rows_ahead(2 * f * static_cast<int64_t>(sizeof(TH) + sizeof(TO)));
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf((w != nullptr ? 6 : 5) * f);
    float* g = buf.data();
    float* u = g + f;
    float* s = u + f;  // dUp
    float* ga = s + f;  // dA, then dGate
    float* a = ga + f;
    float* prod = a + f;
    for (int64_t r = r0; r < r1; ++r) {
      const bool next = r + ahead < r1;
      load_row(hp + r * hs, g, 2 * f, next ? hp + (r + ahead) * hs : nullptr);
      load_row(gp + r * gs, ga, f, next ? gp + (r + ahead) * gs : nullptr);
      const bool weighted = w != nullptr;
      backward_row(g, u, ga, a, s, weighted ? prod : nullptr, weighted ? w + r : nullptr, f);
      if (weighted) {
        grad_w[r] = aten_order_sum(prod, f);
      }
      store_row(a, ap + r * as, f);
      store_row(s, dp + r * ds + f, f);
      store_row(ga, dp + r * ds, f);
    }
  });
}

// --------------------------------------------------------------------------------------
// The glu op's gated activations, GPT-OSS's clamped SwiGLU ("swigluoai") and SwiGLU
// ("swiglu", clamped or not): the same operations as the glu op's ATen chunks
// (torch_moe/_ops/glu.py), element by element, in fp32 from h's gate and up columns
// (halves, or even / odd columns when interleaved), L the limit:
//
//   g = min(gate, L); u = clamp(up, -L, L)            (no clamp without a limit)
//   swigluoai: s = sigmoid(g * alpha)
//     forward:  a = g * s * (u + 1) (* w)
//     backward: act = g * s; up1 = u + 1; slope = s * (1 + (alpha * g) * (1 - s))
//   swiglu: s = sigmoid(g), act = silu(g) = g / (1 + exp(-g))
//     forward:  a = act * u (* w)
//     backward: up1 = u; slope = s * (1 + g * (1 - s))
//   backward, both: prod = dA * act * up1 (d w = sum_f prod); dA *= w
//             dGate = dA * up1 * slope (0 where gate > L); dUp = dA * act (0 where up is
//             outside [-L, L])
//
// Each is a separate ATen op there, so nothing is contracted: the one product that feeds
// a sum here ((alpha * g) * (1 - s), then + 1) goes through an opaque copy that keeps the
// compiler from fusing them. Sigmoid and silu are the only operations whose vector and
// scalar forms differ; ATen applies them to a [rows, F] chunk (contiguous, or a view of
// h) cut by at::parallel_for at ATen's grain into one piece per thread, each piece (or
// each row's part of it, for a view) vectors in blocks of two and a scalar tail, or all
// scalar for a view without unit stride (Cut). These kernels cut each chunk of
// ``chunk_rows`` rows (the caller's, the same as the ATen path's) alike.

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
inline fVec opaque(fVec v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = v;
#else
  __m256 r = v;
#endif
  asm("" : "+v"(r));
  return fVec(r);
}
inline float opaque(float v) {
  asm("" : "+v"(v));
  return v;
}
#else
// no FMA instructions in the default build: nothing to contract
inline fVec opaque(fVec v) {
  return v;
}
inline float opaque(float v) {
  return v;
}
#endif

// How ATen's loops cut a [rows, F] chunk for an op with distinct vector and scalar forms:
// one flat range (a contiguous input: the clamped gate, swigluoai's gate * alpha), row by
// row (the unclamped gate as a view of h's halves: rows of unit stride apart), or all
// scalar (the unclamped gate as a view of h's even columns: no unit stride)
enum class Cut { kFlat, kRow, kScalar };

struct GluArgs {
  float alpha;
  bool clamp;
  float limit;
  bool interleaved;
  Cut cut;
  const float* silus = nullptr;  // swiglu unclamped, half h: gate_tables (else computed)
  const float* sigmoids = nullptr;
};

// The unclamped swiglu's silu (or, kSigmoid, sigmoid) of a vector of gates of TH (their
// fp32 values x): looked up where the caller set the tables (GluArgs), else computed
template <typename TH, bool kSigmoid = false>
inline fVec glu_gate(const fVec& x, [[maybe_unused]] const GluArgs& o) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (!std::is_same_v<TH, float>) {
    const float* table = kSigmoid ? o.sigmoids : o.silus;
    if (table != nullptr) return lookup(table, gate_index_of<TH>(x));
  }
#endif
  return kSigmoid ? sigmoid_vec(x) : silu_vec(x);
}

// One block of flat positions [p, q) of a chunk that starts at row r0: gate, up (and dA,
// row weights) into fp32 buffers indexed from p.
template <typename T>
void gather_block(
    const T* hp, int64_t hs, int64_t r0, int64_t f, int64_t p, int64_t q, bool interleaved,
    float* g, float* u) {
  for (int64_t i = p; i < q;) {
    const int64_t row = r0 + i / f, col = i % f, n = std::min(q - i, f - col);
    const T* src = hp + row * hs;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t c = col + j;
      g[i - p + j] = static_cast<float>(src[interleaved ? 2 * c : c]);
      u[i - p + j] = static_cast<float>(src[interleaved ? 2 * c + 1 : f + c]);
    }
    i += n;
  }
}

template <typename T>
void gather_flat(
    const T* src, int64_t stride, int64_t r0, int64_t f, int64_t p, int64_t q, float* dst) {
  for (int64_t i = p; i < q;) {
    const int64_t row = r0 + i / f, col = i % f, n = std::min(q - i, f - col);
    load_row(src + row * stride + col, dst + (i - p), n);
    i += n;
  }
}

template <typename T>
void scatter_flat(
    const float* src, T* dst, int64_t stride, int64_t r0, int64_t f, int64_t p, int64_t q) {
  for (int64_t i = p; i < q;) {
    const int64_t row = r0 + i / f, col = i % f, n = std::min(q - i, f - col);
    store_row(src + (i - p), dst + row * stride + col, n);
    i += n;
  }
}

inline void row_weights_block(
    const float* w, int64_t r0, int64_t f, int64_t p, int64_t q, float* dst) {
  for (int64_t i = p; i < q;) {
    const int64_t row = r0 + i / f, n = std::min(q - i, f - i % f);
    std::fill_n(dst + (i - p), n, w[row]);
    i += n;
  }
}

// ATen's scalar clamps (a NaN passes through)
inline float clamp_max_scalar(float x, float hi) {
  return std::min(x, hi);
}

inline float clamp_scalar(float x, float lo, float hi) {
  return std::min(std::max(x, lo), hi);
}

// dGate, dUp of flat positions [p, q) into dH's gate and up columns
template <typename T>
void scatter_dh(
    const float* dg, const float* du, T* dp, int64_t ds, int64_t r0, int64_t f, int64_t p,
    int64_t q, bool interleaved) {
  if (!interleaved) {
    for (int64_t i = p; i < q;) {
      const int64_t row = r0 + i / f, col = i % f, n = std::min(q - i, f - col);
      store_row(dg + (i - p), dp + row * ds + col, n);
      store_row(du + (i - p), dp + row * ds + f + col, n);
      i += n;
    }
    return;
  }
  for (int64_t i = p; i < q;) {
    const int64_t row = r0 + i / f, col = i % f, n = std::min(q - i, f - col);
    T* dst = dp + row * ds + 2 * col;
    for (int64_t j = 0; j < n; ++j) {
      dst[2 * j] = static_cast<T>(dg[i - p + j]);
      dst[2 * j + 1] = static_cast<T>(du[i - p + j]);
    }
    i += n;
  }
}

// positions of a [rows, F] chunk, in ATen's pieces and their vector / scalar parts;
// fn(p, q, vector_end) over blocks of at most kBlock positions
constexpr int64_t kBlock = 1024;  // a multiple of two vectors: blocks keep the pieces' cut

template <typename Fn>
void for_each_cut(int64_t n, int64_t f, Cut cut, const Fn& fn) {
  // TensorIterator::for_each and at::parallel_for: one piece per thread (at most one per
  // grain) where n exceeds the grain, else one; computed here so that the cut does not
  // depend on how this file was built (without OpenMP at::parallel_for runs one piece).
  // Within a piece the vector part starts at the piece (kFlat) or at each row's part of it
  // (kRow: TensorIterator's inner loop runs a row, or the piece's share of one); none with
  // kScalar.
  const int64_t grain = at::internal::GRAIN_SIZE, threads = at::get_num_threads();
  int64_t pieces = 1;
  if (n > grain && threads > 1 && !at::in_parallel_region()) {
    pieces = std::min(threads, (n + grain - 1) / grain);
  }
  const int64_t size = (n + pieces - 1) / pieces;
  at::parallel_for(0, pieces, 1, [&](int64_t first, int64_t last) {
    for (int64_t piece = first; piece < last; ++piece) {
      const int64_t b = piece * size, e = std::min(n, b + size);
      for (int64_t s0 = b; s0 < e;) {
        const int64_t s1 = cut == Cut::kFlat ? e : std::min(e, (s0 / f + 1) * f);
        const int64_t ve = cut == Cut::kScalar ? s0 : s0 + vector_end(s1 - s0);
        for (int64_t p = s0; p < s1; p += kBlock) {
          fn(p, std::min(s1, p + kBlock), ve);
        }
        s0 = s1;
      }
    }
  });
}

template <typename TH, bool OAI>
void glu_forward_impl(
    const at::Tensor& h, const float* w, const at::Tensor& out, const GluArgs& o,
    int64_t chunk_rows) {
  const int64_t rows = h.size(0), f = out.size(1), hs = h.stride(0), os = out.stride(0);
  const TH* hp = h.data_ptr<TH>();
  TH* op = out.data_ptr<TH>();
  const fVec alpha(o.alpha), lim(o.limit), nlim(-o.limit), one(1.f);
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t n = std::min(chunk_rows, rows - r0) * f;
    for_each_cut(n, f, o.cut, [&](int64_t p, int64_t q, int64_t ve) {
      float g[kBlock], u[kBlock], wb[kBlock];
      gather_block(hp, hs, r0, f, p, q, o.interleaved, g, u);
      if (w != nullptr) {
        row_weights_block(w, r0, f, p, q, wb);  // a vector may span two rows
      }
      const int64_t v = std::max(p, std::min(q, ve));
      int64_t i = p;
      for (; i < v; i += kV) {
        const int64_t k = i - p;
        fVec x = fVec::loadu(g + k), y = fVec::loadu(u + k);
        if (o.clamp) {
          x = at::vec::clamp_max(x, lim);
          y = at::vec::clamp(y, nlim, lim);
        }
        fVec a;
        if constexpr (OAI) {
          a = x * sigmoid_vec(opaque(x * alpha)) * (y + one);
        } else {
          a = glu_gate<TH>(x, o) * y;
        }
        if (w != nullptr) {
          a = a * fVec::loadu(wb + k);
        }
        a.store(g + k);
      }
      for (; i < q; ++i) {
        const int64_t k = i - p;
        float x = g[k], y = u[k];
        if (o.clamp) {
          x = clamp_max_scalar(x, o.limit);
          y = clamp_scalar(y, -o.limit, o.limit);
        }
        float a;
        if constexpr (OAI) {
          a = x * sigmoid_scalar(opaque(x * o.alpha)) * (y + 1.f);
        } else {
          a = silu_scalar(x) * y;
        }
        if (w != nullptr) {
          a *= wb[k];
        }
        g[k] = a;
      }
      scatter_flat(g, op, os, r0, f, p, q);
    });
  }
}


template <typename TH, bool OAI>
void glu_backward_impl(
    const at::Tensor& h, const at::Tensor& grad_a, const float* w, const at::Tensor& out_dh,
    float* grad_w, const GluArgs& o, int64_t chunk_rows) {
  const int64_t rows = h.size(0), f = grad_a.size(1);
  const int64_t hs = h.stride(0), gs = grad_a.stride(0), ds = out_dh.stride(0);
  const TH* hp = h.data_ptr<TH>();
  const TH* gp = grad_a.data_ptr<TH>();
  TH* dp = out_dh.data_ptr<TH>();
  const fVec alpha(o.alpha), lim(o.limit), nlim(-o.limit), one(1.f), zero(0.f);
  // with row weights, a chunk's products dA * act * up1 in a buffer of its own (a piece
  // may start mid-row), each of its rows then summed into d w in ATen's order
  std::vector<float> chunk_prod(w != nullptr ? std::min(chunk_rows, rows) * f : 0);
  float* pr = w != nullptr ? chunk_prod.data() : nullptr;  // [chunk rows, F] contiguous
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t n = std::min(chunk_rows, rows - r0) * f;
    for_each_cut(n, f, o.cut, [&](int64_t p, int64_t q, int64_t ve) {
      float g[kBlock], u[kBlock], ga[kBlock], wb[kBlock];
      gather_block(hp, hs, r0, f, p, q, o.interleaved, g, u);
      gather_flat(gp, gs, r0, f, p, q, ga);
      if (w != nullptr) {
        row_weights_block(w, r0, f, p, q, wb);
      }
      const int64_t v = std::max(p, std::min(q, ve));
      int64_t i = p;
      for (; i < v; i += kV) {
        const int64_t k = i - p;
        fVec x = fVec::loadu(g + k), y = fVec::loadu(u + k), d = fVec::loadu(ga + k);
        fVec gate_in, up_in;
        if (o.clamp) {
          gate_in = x <= lim;  // all-ones lanes where kept
          up_in = (y >= nlim) & (y <= lim);
          x = at::vec::clamp_max(x, lim);
          y = at::vec::clamp(y, nlim, lim);
        }
        fVec s, act, up1, slope;
        if constexpr (OAI) {
          s = sigmoid_vec(opaque(x * alpha));
          act = x * s;
          up1 = y + one;
          slope = s * (opaque(opaque(alpha * x) * (one - s)) + one);
        } else {
          if (o.sigmoids != nullptr) {  // the tables: the values computed below
            s = glu_gate<TH, true>(x, o);
            act = glu_gate<TH>(x, o);
          } else {  // sigmoid and silu: one exp(-x) serves both (exp(0 - x) = exp(-x))
            const fVec e = (zero - x).exp();
            s = (e + one).reciprocal();
            act = x / (one + e);
          }
          up1 = y;
          slope = s * (opaque(x * (one - s)) + one);
        }
        if (w != nullptr) {
          (d * (act * up1)).store(pr + i);
          d = d * fVec::loadu(wb + k);
        }
        fVec dg = d * up1 * slope, du = d * act;
        if (o.clamp) {
          dg = fVec::blendv(zero, dg, gate_in);
          du = fVec::blendv(zero, du, up_in);
        }
        dg.store(g + k);
        du.store(u + k);
      }
      for (; i < q; ++i) {
        const int64_t k = i - p;
        float x = g[k], y = u[k], d = ga[k];
        bool gate_in = true, up_in = true;
        if (o.clamp) {
          gate_in = x <= o.limit;
          up_in = y >= -o.limit && y <= o.limit;
          x = clamp_max_scalar(x, o.limit);
          y = clamp_scalar(y, -o.limit, o.limit);
        }
        float s, act, up1, slope;
        if constexpr (OAI) {
          s = sigmoid_scalar(opaque(x * o.alpha));
          act = x * s;
          up1 = y + 1.f;
          slope = s * (opaque(opaque(o.alpha * x) * (1.f - s)) + 1.f);
        } else {
          const float e = std::exp(-x);
          s = 1.f / (1.f + e);
          act = x / (1.f + e);
          up1 = y;
          slope = s * (opaque(x * (1.f - s)) + 1.f);
        }
        if (w != nullptr) {
          pr[i] = d * (act * up1);
          d *= wb[k];
        }
        g[k] = gate_in ? d * up1 * slope : 0.f;
        u[k] = up_in ? d * act : 0.f;
      }
      scatter_dh(g, u, dp, ds, r0, f, p, q, o.interleaved);
    });
    if (w != nullptr) {
      at::parallel_for(0, n / f, 16, [&](int64_t j0, int64_t j1) {
        for (int64_t j = j0; j < j1; ++j) {
          grad_w[r0 + j] = aten_order_sum(pr + j * f, f);
        }
      });
    }
  }
}


// --------------------------------------------------------------------------------------
// Nemotron-H's squared ReLU ("relu2" of torch_moe::glu), ungated: h [rows, F]
//
//   forward:  r = relu(h); a = r * r (* w)
//   backward: prod = dA * (r * r) (d w = sum_f prod); dA *= w; dH = dA * (2 * r)
//
// relu, the squares and products are exact or correctly rounded in either form, so no
// vector / scalar cut matters; a product feeds no sum.

// ATen's relu (clamp_min(x, 0), vector or scalar): -0 and NaN pass through
inline float relu(float x) {
  return x < 0.f ? 0.f : x;
}

template <typename TH>
void relu2_forward_impl(const at::Tensor& h, const float* w, const at::Tensor& out) {
  const int64_t rows = h.size(0), f = h.size(1), hs = h.stride(0), os = out.stride(0);
  const TH* hp = h.data_ptr<TH>();
  TH* op = out.data_ptr<TH>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(f);
    float* a = buf.data();
    for (int64_t r = r0; r < r1; ++r) {
      load_row(hp + r * hs, a, f);
      for (int64_t i = 0; i < f; ++i) {
        const float x = relu(a[i]);
        a[i] = x * x;
      }
      if (w != nullptr) {
        scale_row(a, w[r], f);
      }
      store_row(a, op + r * os, f);
    }
  });
}

template <typename TH>
void relu2_backward_impl(
    const at::Tensor& h, const at::Tensor& grad_a, const float* w, const at::Tensor& out_dh,
    float* grad_w) {
  const int64_t rows = h.size(0), f = h.size(1);
  const int64_t hs = h.stride(0), gs = grad_a.stride(0), ds = out_dh.stride(0);
  const TH* hp = h.data_ptr<TH>();
  const TH* gp = grad_a.data_ptr<TH>();
  TH* dp = out_dh.data_ptr<TH>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf((w != nullptr ? 3 : 2) * f);
    float* x = buf.data();
    float* d = x + f;
    float* prod = d + f;  // with row weights: the row's products, summed into d w
    for (int64_t r = r0; r < r1; ++r) {
      load_row(hp + r * hs, x, f);
      load_row(gp + r * gs, d, f);
      for (int64_t i = 0; i < f; ++i) {
        const float v = relu(x[i]);
        float g = d[i];
        if (w != nullptr) {
          prod[i] = g * (v * v);
          g *= w[r];
        }
        d[i] = g * (2.f * v);
      }
      if (w != nullptr) {
        grad_w[r] = aten_order_sum(prod, f);
      }
      store_row(d, dp + r * ds, f);
    }
  });
}

template <typename F>
void dispatch(const at::Tensor& h, const at::Tensor& other, F&& fn) {
  const auto th = h.scalar_type(), to = other.scalar_type();
  if (th == at::kBFloat16 && to == at::kBFloat16) {
    fn(at::BFloat16{}, at::BFloat16{});
  } else if (th == at::kBFloat16 && to == at::kFloat) {
    fn(at::BFloat16{}, float{});
  } else if (th == at::kHalf && to == at::kHalf) {
    fn(at::Half{}, at::Half{});
  } else if (th == at::kHalf && to == at::kFloat) {
    fn(at::Half{}, float{});
  } else if (th == at::kFloat && to == at::kFloat) {
    fn(float{}, float{});
  } else {
    TORCH_CHECK(false, "swiglu_cpu: unsupported dtypes h ", th, ", outputs ", to);
  }
}

}  // namespace

namespace torch_moe_cpu {  // (ops_cpu.h: other native ops call it)

void swiglu_forward(const at::Tensor& h, const std::optional<at::Tensor>& row_weights,
                    const at::Tensor& out, bool stream_out, bool table) {
  const int64_t rows = h.size(0), f = out.size(1);
  check_rows("h", h, rows, 2 * f);
  check_rows("out", out, rows, f);
  const float* w = weights_ptr(row_weights, rows);
  dispatch(h, out, [&](auto th, auto to) {
    forward_impl<decltype(th), decltype(to)>(h, w, out, stream_out, table);
  });
}

}  // namespace torch_moe_cpu

namespace {

void swiglu_backward(
    const at::Tensor& h, const at::Tensor& grad_a, const std::optional<at::Tensor>& row_weights,
    const at::Tensor& out_a, const at::Tensor& out_dh, const std::optional<at::Tensor>& grad_weights,
    bool stream_out, bool table) {
  const int64_t rows = h.size(0), f = grad_a.size(1);
  check_rows("h", h, rows, 2 * f);
  check_rows("grad_a", grad_a, rows, f);
  check_rows("out_a", out_a, rows, f);
  check_rows("out_dh", out_dh, rows, 2 * f);
  TORCH_CHECK(
      grad_a.scalar_type() == out_a.scalar_type() && out_a.scalar_type() == out_dh.scalar_type(),
      "swiglu_cpu: grad_a, out_a and out_dh must share a dtype");
  const float* w = weights_ptr(row_weights, rows);
  float* gw = grad_weights_ptr("swiglu_cpu", w, grad_weights, rows);
  dispatch(h, grad_a, [&](auto th, auto to) {
    backward_impl<decltype(th), decltype(to)>(
        h, grad_a, w, out_a, out_dh, gw, stream_out, table);
  });
}


template <typename Fn>
void dispatch_glu(const at::Tensor& h, Fn&& fn) {
  switch (h.scalar_type()) {
    case at::kBFloat16:
      return fn(at::BFloat16{});
    case at::kHalf:
      return fn(at::Half{});
    case at::kFloat:
      return fn(float{});
    default:
      TORCH_CHECK(false, "glu_cpu: unsupported dtype of h ", h.scalar_type());
  }
}

// swigluoai's sigmoid always sees a fresh contiguous tensor (gate * alpha); swiglu's
// silu and sigmoid see the gate itself: contiguous once clamped, else a view of h
GluArgs glu_args(
    bool oai, double alpha, std::optional<double> limit, bool interleaved, int64_t chunk_rows) {
  TORCH_CHECK(chunk_rows >= 1, "glu_cpu: chunk_rows must be >= 1, got ", chunk_rows);
  const bool clamp = limit.has_value();
  const Cut cut = oai || clamp ? Cut::kFlat : interleaved ? Cut::kScalar : Cut::kRow;
  return GluArgs{
      static_cast<float>(alpha), clamp, static_cast<float>(limit.value_or(0.0)), interleaved,
      cut};
}

// The glu backward kernels' operands: h [rows, h_cols], grad_a [rows, F], out_dh like h,
// one dtype; with row weights an fp32 grad_weights [rows] for d row_weights. Returns
// (weights, grad_weights) pointers.
std::pair<const float*, float*> check_backward(
    const at::Tensor& h, int64_t h_cols, const at::Tensor& grad_a,
    const std::optional<at::Tensor>& row_weights, const at::Tensor& out_dh,
    const std::optional<at::Tensor>& grad_weights) {
  const int64_t rows = h.size(0), f = grad_a.size(1);
  check_rows("h", h, rows, h_cols);
  check_rows("grad_a", grad_a, rows, f);
  check_rows("out_dh", out_dh, rows, h_cols);
  TORCH_CHECK(
      grad_a.scalar_type() == h.scalar_type() && out_dh.scalar_type() == h.scalar_type(),
      "glu_cpu: grad_a and out_dh must have h's dtype");
  const float* w = weights_ptr(row_weights, rows);
  return {w, grad_weights_ptr("glu_cpu", w, grad_weights, rows)};
}

// the unclamped swiglu's gate tables of h's dtype where asked (`table`), else none
template <typename TH>
void set_gate_tables([[maybe_unused]] GluArgs& o, [[maybe_unused]] bool oai,
                     [[maybe_unused]] bool table) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (!std::is_same_v<TH, float>) {
    if (table && !oai && !o.clamp) {
      o.silus = gate_tables<TH>();
      o.sigmoids = o.silus + kGates;
    }
  }
#endif
}

template <bool OAI>
void glu_forward(
    const at::Tensor& h, const std::optional<at::Tensor>& row_weights, const at::Tensor& out,
    double alpha, std::optional<double> limit, bool interleaved, int64_t chunk_rows,
    bool table) {
  const int64_t rows = h.size(0), f = out.size(1);
  check_rows("h", h, rows, 2 * f);
  check_rows("out", out, rows, f);
  TORCH_CHECK(out.scalar_type() == h.scalar_type(), "glu_cpu: out must have h's dtype");
  const float* w = weights_ptr(row_weights, rows);
  GluArgs o = glu_args(OAI, alpha, limit, interleaved, chunk_rows);
  dispatch_glu(h, [&](auto t) {
    set_gate_tables<decltype(t)>(o, OAI, table);
    glu_forward_impl<decltype(t), OAI>(h, w, out, o, chunk_rows);
  });
}

template <bool OAI>
void glu_backward(
    const at::Tensor& h, const at::Tensor& grad_a, const std::optional<at::Tensor>& row_weights,
    const at::Tensor& out_dh, const std::optional<at::Tensor>& grad_weights, double alpha,
    std::optional<double> limit, bool interleaved, int64_t chunk_rows, bool table) {
  const auto [w, p] =
      check_backward(h, 2 * grad_a.size(1), grad_a, row_weights, out_dh, grad_weights);
  GluArgs o = glu_args(OAI, alpha, limit, interleaved, chunk_rows);
  dispatch_glu(h, [&](auto t) {
    set_gate_tables<decltype(t)>(o, OAI, table);
    glu_backward_impl<decltype(t), OAI>(h, grad_a, w, out_dh, p, o, chunk_rows);
  });
}

void relu2_forward(
    const at::Tensor& h, const std::optional<at::Tensor>& row_weights, const at::Tensor& out) {
  const int64_t rows = h.size(0), f = h.size(1);
  check_rows("h", h, rows, f);
  check_rows("out", out, rows, f);
  TORCH_CHECK(out.scalar_type() == h.scalar_type(), "glu_cpu: out must have h's dtype");
  const float* w = weights_ptr(row_weights, rows);
  dispatch_glu(h, [&](auto t) { relu2_forward_impl<decltype(t)>(h, w, out); });
}

void relu2_backward(
    const at::Tensor& h, const at::Tensor& grad_a, const std::optional<at::Tensor>& row_weights,
    const at::Tensor& out_dh, const std::optional<at::Tensor>& grad_weights) {
  const auto [w, p] = check_backward(h, grad_a.size(1), grad_a, row_weights, out_dh, grad_weights);
  dispatch_glu(h, [&](auto t) { relu2_backward_impl<decltype(t)>(h, grad_a, w, out_dh, p); });
}

}  // namespace

// torch.ops.torch_moe_cpu.*: plain CPU ops that write into the caller's buffers (the
// torch_moe ops' CPU kernels call them; they are not differentiable on their own)
TORCH_LIBRARY(torch_moe_cpu, m) {
  // `table`: half-precision gates' silu / sigmoid read from gate_tables (swiglu and the
  // unclamped glu swiglu; the swigluoai kernels take it and ignore it: one C++ function)
  m.def(
      "swiglu_forward(Tensor h, Tensor? row_weights, Tensor(a!) out, bool stream_out=False, "
      "bool table=False) -> ()");
  m.def(
      "swiglu_backward(Tensor h, Tensor grad_a, Tensor? row_weights, Tensor(a!) out_a, "
      "Tensor(b!) out_dh, Tensor(c!)? grad_weights, bool stream_out=False, bool table=False) "
      "-> ()");
  m.def(
      "glu_oai_forward(Tensor h, Tensor? row_weights, Tensor(a!) out, float alpha, "
      "float? limit, bool interleaved, int chunk_rows, bool table=False) -> ()");
  m.def(
      "glu_oai_backward(Tensor h, Tensor grad_a, Tensor? row_weights, Tensor(a!) out_dh, "
      "Tensor(b!)? grad_weights, float alpha, float? limit, bool interleaved, int chunk_rows, "
      "bool table=False) -> ()");
  m.def(
      "glu_swiglu_forward(Tensor h, Tensor? row_weights, Tensor(a!) out, float alpha, "
      "float? limit, bool interleaved, int chunk_rows, bool table=False) -> ()");
  m.def(
      "glu_swiglu_backward(Tensor h, Tensor grad_a, Tensor? row_weights, Tensor(a!) out_dh, "
      "Tensor(b!)? grad_weights, float alpha, float? limit, bool interleaved, int chunk_rows, "
      "bool table=False) -> ()");
  m.def("relu2_forward(Tensor h, Tensor? row_weights, Tensor(a!) out) -> ()");
  m.def(
      "relu2_backward(Tensor h, Tensor grad_a, Tensor? row_weights, Tensor(a!) out_dh, "
      "Tensor(b!)? grad_weights) -> ()");
}

TORCH_LIBRARY_IMPL(torch_moe_cpu, CPU, m) {
  m.impl("swiglu_forward", &torch_moe_cpu::swiglu_forward);
  m.impl("swiglu_backward", &swiglu_backward);
  m.impl("glu_oai_forward", &glu_forward<true>);
  m.impl("glu_oai_backward", &glu_backward<true>);
  m.impl("glu_swiglu_forward", &glu_forward<false>);
  m.impl("glu_swiglu_backward", &glu_backward<false>);
  m.impl("relu2_forward", &relu2_forward);
  m.impl("relu2_backward", &relu2_backward);
}
