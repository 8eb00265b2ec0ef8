// The SwiGLU activation of torch_moe's CPU kernels as one pass over each row.
//
// grouped_swiglu's CPU kernels compute the activation (and its backward) in fp32 from
// half-precision h with one rounding into the outputs. In ATen ops that takes five
// passes over [rows, F] forward and twelve backward (conversions, sigmoid, the products,
// silu_backward, the rounding copies), each over fp32 temporaries. These two kernels do
// the same arithmetic row by row from L1-resident fp32 row buffers, with the operations
// ATen's CPU kernels use element by element, so they give the same bits:
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
//             prod = ga * a                   (only with row weights: d w = sum_f prod)
//             a *= w; ga *= w
//             out_a = a; dUp = silu * ga; dGate = silu'(ga * up, gate) with this s
//   (the backward is one vector loop over the row: one exp per element, not two)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kV = fVec::size();

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = static_cast<float>(src[i]);
  }
}

template <>
inline void load_row<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
inline auto to_float(const Vectorized<at::BFloat16>& v) {
  return at::vec::convert_bfloat16_float(v);
}

inline auto to_float(const Vectorized<at::Half>& v) {
  return at::vec::convert_half_float(v);
}

// half-precision rows: a vector of T converts into two fp32 vectors
template <typename T>
inline void load_half_row(const T* src, float* dst, int64_t n) {
  using hVec = Vectorized<T>;
  int64_t i = 0;
  for (; i + hVec::size() <= n; i += hVec::size()) {
    auto [lo, hi] = to_float(hVec::loadu(src + i));
    lo.store(dst + i);
    hi.store(dst + i + kV);
  }
  for (; i < n; ++i) {
    dst[i] = static_cast<float>(src[i]);
  }
}

template <>
inline void load_row<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  load_half_row(src, dst, n);
}

template <>
inline void load_row<at::Half>(const at::Half* src, float* dst, int64_t n) {
  load_half_row(src, dst, n);
}
#endif

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  at::vec::convert(src, dst, n);  // round to nearest even, as a tensor copy
}

template <>
inline void store_row<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// The vector part of a row as ATen's CPU loops cut it: whole blocks of two vectors.
inline int64_t vector_end(int64_t n) {
  return n < 2 * kV ? 0 : n - n % (2 * kV);
}

// g <- silu(g)
inline void silu_row(float* g, int64_t n) {
  const fVec one(1.f);
  const int64_t v = vector_end(n);
  for (int64_t i = 0; i < v; i += kV) {
    fVec x = fVec::loadu(g + i);
    (x / (one + x.neg().exp())).store(g + i);
  }
  for (int64_t i = v; i < n; ++i) {
    g[i] = g[i] / (1.f + std::exp(-g[i]));
  }
}

// The backward of one row, in place: g, u: gate and up; ga: dA, then dGate; s: dUp.
// With row weights w != nullptr, p receives dA * a (unweighted) and a, dA are scaled by w.
// ATen computes sigmoid(g) as (exp(0 - g) + 1).reciprocal() and silu_backward's own
// sigmoid as 1 / (1 + exp(-g)): the same operations on the same values (-g, exp, the sum,
// the division of one), so one sigmoid per element serves both.
inline void backward_row(
    const float* g, const float* u, float* ga, float* a, float* s, float* p, const float* w,
    int64_t n) {
  const fVec one(1.f), zero(0.f);
  const int64_t v = vector_end(n);
  int64_t i = 0;
  for (; i < v; i += kV) {
    const fVec x = fVec::loadu(g + i);
    const fVec up = fVec::loadu(u + i);
    fVec d = fVec::loadu(ga + i);
    const fVec sig = ((zero - x).exp() + one).reciprocal();
    const fVec silu = sig * x;
    fVec act = silu * up;
    if (w != nullptr) {
      const fVec wv(*w);
      (d * act).store(p + i);
      act = act * wv;
      d = d * wv;
    }
    act.store(a + i);
    (silu * d).store(s + i);
    const fVec dy = d * up;
    (dy * sig * (one + x * (one - sig))).store(ga + i);
  }
  for (; i < n; ++i) {
    const float sig = 1.f / (1.f + std::exp(-g[i]));
    const float silu = sig * g[i];
    float act = silu * u[i];
    float d = ga[i];
    if (w != nullptr) {
      p[i] = d * act;
      act *= *w;
      d *= *w;
    }
    a[i] = act;
    s[i] = silu * d;
    const float dy = d * u[i];
    ga[i] = dy * sig * (1.f + g[i] * (1.f - sig));
  }
}

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
void forward_impl(const at::Tensor& h, const float* w, const at::Tensor& out) {
  const int64_t rows = h.size(0), f = out.size(1), hs = h.stride(0), os = out.stride(0);
  const TH* hp = h.data_ptr<TH>();
  TO* op = out.data_ptr<TO>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(2 * f);
    float* g = buf.data();
    float* u = g + f;
    for (int64_t r = r0; r < r1; ++r) {
      load_row(hp + r * hs, g, 2 * f);
      silu_row(g, f);
      mul_row(g, u, f);
      if (w != nullptr) {
        scale_row(g, w[r], f);
      }
      store_row(g, op + r * os, f);
    }
  });
}

template <typename TH, typename TO>
void backward_impl(
    const at::Tensor& h, const at::Tensor& grad_a, const float* w, const at::Tensor& out_a,
    const at::Tensor& out_dh, float* prod, int64_t ps) {
  const int64_t rows = h.size(0), f = grad_a.size(1);
  const int64_t hs = h.stride(0), gs = grad_a.stride(0), as = out_a.stride(0), ds = out_dh.stride(0);
  const TH* hp = h.data_ptr<TH>();
  const TO* gp = grad_a.data_ptr<TO>();
  TO* ap = out_a.data_ptr<TO>();
  TO* dp = out_dh.data_ptr<TO>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(5 * f);
    float* g = buf.data();
    float* u = g + f;
    float* s = u + f;  // dUp
    float* ga = s + f;  // dA, then dGate
    float* a = ga + f;
    for (int64_t r = r0; r < r1; ++r) {
      load_row(hp + r * hs, g, 2 * f);
      load_row(gp + r * gs, ga, f);
      const bool weighted = w != nullptr;
      backward_row(g, u, ga, a, s, weighted ? prod + r * ps : nullptr, weighted ? w + r : nullptr, f);
      store_row(a, ap + r * as, f);
      store_row(s, dp + r * ds + f, f);
      store_row(ga, dp + r * ds, f);
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

void swiglu_forward(
    const at::Tensor& h, const std::optional<at::Tensor>& row_weights, const at::Tensor& out) {
  const int64_t rows = h.size(0), f = out.size(1);
  check_rows("h", h, rows, 2 * f);
  check_rows("out", out, rows, f);
  const float* w = weights_ptr(row_weights, rows);
  dispatch(h, out, [&](auto th, auto to) {
    forward_impl<decltype(th), decltype(to)>(h, w, out);
  });
}

void swiglu_backward(
    const at::Tensor& h, const at::Tensor& grad_a, const std::optional<at::Tensor>& row_weights,
    const at::Tensor& out_a, const at::Tensor& out_dh, const std::optional<at::Tensor>& prod) {
  const int64_t rows = h.size(0), f = grad_a.size(1);
  check_rows("h", h, rows, 2 * f);
  check_rows("grad_a", grad_a, rows, f);
  check_rows("out_a", out_a, rows, f);
  check_rows("out_dh", out_dh, rows, 2 * f);
  TORCH_CHECK(
      grad_a.scalar_type() == out_a.scalar_type() && out_a.scalar_type() == out_dh.scalar_type(),
      "swiglu_cpu: grad_a, out_a and out_dh must share a dtype");
  const float* w = weights_ptr(row_weights, rows);
  float* p = nullptr;
  int64_t ps = 0;
  if (w != nullptr) {
    TORCH_CHECK(prod.has_value() && prod->scalar_type() == at::kFloat, "swiglu_cpu: row weights need an fp32 prod buffer");
    check_rows("prod", *prod, rows, f);
    p = prod->data_ptr<float>();
    ps = prod->stride(0);
  }
  dispatch(h, grad_a, [&](auto th, auto to) {
    backward_impl<decltype(th), decltype(to)>(h, grad_a, w, out_a, out_dh, p, ps);
  });
}

}  // namespace

// torch.ops.torch_moe_cpu.*: plain CPU ops that write into the caller's buffers (the
// torch_moe ops' CPU kernels call them; they are not differentiable on their own)
TORCH_LIBRARY(torch_moe_cpu, m) {
  m.def("swiglu_forward(Tensor h, Tensor? row_weights, Tensor(a!) out) -> ()");
  m.def(
      "swiglu_backward(Tensor h, Tensor grad_a, Tensor? row_weights, Tensor(a!) out_a, "
      "Tensor(b!) out_dh, Tensor(c!)? prod) -> ()");
}

TORCH_LIBRARY_IMPL(torch_moe_cpu, CPU, m) {
  m.impl("swiglu_forward", &swiglu_forward);
  m.impl("swiglu_backward", &swiglu_backward);
}
