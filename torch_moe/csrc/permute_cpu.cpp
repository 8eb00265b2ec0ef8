// The permutation's index sort and the combine on CPU, each as one op call.
//
// torch_moe.ops.permute_indices sorts the T*K (token, k) slots by expert: in ATen ops a
// stable argsort, a scatter_add of the counts, a cumsum and one to three scatters (a
// dozen calls and their Python, ~0.1-0.3 ms once the expert GEMMs have evicted the
// interpreter and the dispatcher from the caches). A stable counting sort gives the same
// integers in O(T*K + E).
//
// torch_moe.ops.unpermute sums each token's K rows in the accumulation dtype (fp32, fp64
// for fp64) in k order, each times its weight where weighted, and rounds once: in ATen
// ops per row chunk and k a gather, a conversion, a multiply and an add, then the
// rounding copy. Here one pass per token does the same multiplies and additions in the
// same order (a dropped slot, -1, adds +0 as the ATen kernel's zero-filled row does; a
// product is rounded before its add, never fused with it), so the bits are the same.
//
//   permute_indices(expert_ids [T, K], E, align, capacity?) ->
//       row_to_slot [M], slot_to_row [T, K], offs [E] int32, num_dropped []
//   gather_scaled(x [S, D], index [M], scales [M], out [M, D]!)
//       out[r] = x[index[r]] * scales[r] (zero rows where index[r] < 0): a weighted permute
//   combine(y [M, D], slot_to_row [T, K], out [T, D]!, weights [T, K]?)
//       out[t] = sum_k y[slot_to_row[t, k]] (* weights[t, k], each product rounded to the
//       accumulation dtype before its add, as unpermute's reference computes it)
//   row_dot(rows [M, D], tokens [T, D], slot_to_row [T, K], out [T, K] fp32!)
//       out[t, k] = sum_d rows[slot_to_row[t, k], d] * tokens[t, d] (0 where the slot is
//       -1): weighted_row_dot, the weighted combine's weight gradient. Its reference
//       gathers each k's rows in fp32, multiplies them by the tokens in fp32 and sums each
//       row by ATen's sum; here one pass per token forms the same rounded products in a
//       row buffer and sums it in ATen's order (aten_sum.h): the same bits, without the
//       [T, D] fp32 gathers and products.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include "aten_sum.h"
#include "ops_cpu.h"
#include "vec_convert.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

int64_t num_rows(int64_t tokens, int64_t top_k, int64_t experts, int64_t align, std::optional<int64_t> cap) {
  const int64_t bound = tokens * top_k + experts * (align - 1);
  if (!cap.has_value()) {
    return bound;
  }
  // (a capacity past the bound keeps every row: clamped first, so that nothing below
  // overflows; the bound itself fits the int32 group ends, checked by the caller)
  const int64_t per_expert = (std::min(*cap, bound) + align - 1) / align * align;
  return per_expert > bound / experts ? bound : std::min(experts * per_expert, bound);
}

template <typename I>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> permute_indices_impl(
    const at::Tensor& ids, int64_t experts, int64_t align, std::optional<int64_t> cap) {
  const int64_t tokens = ids.size(0), top_k = ids.size(1), n = tokens * top_k;
  const at::Tensor flat = ids.contiguous();
  const I* e = flat.data_ptr<I>();
  std::vector<int64_t> counts(experts, 0);
  for (int64_t s = 0; s < n; ++s) {
    const int64_t x = static_cast<int64_t>(e[s]);
    TORCH_CHECK(
        x >= 0 && x < experts, "permute_indices: expert_ids must lie in [0, num_experts=",
        experts, "), got ", x);
    ++counts[x];
  }
  const int64_t m = num_rows(tokens, top_k, experts, align, cap);
  const auto i64 = ids.options().dtype(at::kLong);
  at::Tensor offs = at::empty({experts}, ids.options().dtype(at::kInt));
  int32_t* op = offs.data_ptr<int32_t>();
  std::vector<int64_t> next(experts);  // the next row of each expert
  int64_t end = 0, kept_total = 0;
  for (int64_t x = 0; x < experts; ++x) {
    const int64_t kept = cap.has_value() ? std::min(counts[x], *cap) : counts[x];
    next[x] = end;
    end += (kept + align - 1) / align * align;
    kept_total += kept;
    op[x] = static_cast<int32_t>(end);
  }
  at::Tensor row_to_slot = at::full({m}, -1, i64);
  at::Tensor slot_to_row = at::empty({tokens, top_k}, i64);
  int64_t* rp = row_to_slot.data_ptr<int64_t>();
  int64_t* sp = slot_to_row.data_ptr<int64_t>();
  std::vector<int64_t> rank(experts, 0);
  for (int64_t s = 0; s < n; ++s) {  // slots in order: a stable sort by expert
    const int64_t x = static_cast<int64_t>(e[s]);
    if (cap.has_value() && rank[x] >= *cap) {
      sp[s] = -1;  // past the capacity: dropped
    } else {
      const int64_t row = next[x] + rank[x];
      sp[s] = row;
      rp[row] = s;
    }
    ++rank[x];
  }
  at::Tensor dropped = at::scalar_tensor(n - kept_total, i64);
  return {row_to_slot, slot_to_row, offs, dropped};
}

}  // namespace

namespace torch_moe_cpu {  // (ops_cpu.h: other native ops call it)

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> permute_indices(
    const at::Tensor& expert_ids, int64_t num_experts, int64_t align, std::optional<int64_t> capacity) {
  TORCH_CHECK(
      expert_ids.dim() == 2 &&
          (expert_ids.scalar_type() == at::kInt || expert_ids.scalar_type() == at::kLong),
      "permute_indices: expected expert_ids to be a 2D int32/int64 tensor [T, K], got ",
      expert_ids.dim(), "D ", expert_ids.scalar_type());
  TORCH_CHECK(num_experts >= 1, "permute_indices: num_experts must be >= 1, got ", num_experts);
  TORCH_CHECK(align >= 1, "permute_indices: align must be >= 1, got ", align);
  TORCH_CHECK(
      !capacity.has_value() || *capacity >= 0,
      "permute_indices: capacity must be >= 0 or None, got ", capacity.value_or(0));
  if (expert_ids.scalar_type() == at::kInt) {
    return permute_indices_impl<int32_t>(expert_ids, num_experts, align, capacity);
  }
  return permute_indices_impl<int64_t>(expert_ids, num_experts, align, capacity);
}

}  // namespace torch_moe_cpu

namespace {

// The combine reads each token's K rows from wherever the permutation put them: K short
// streams per token, each starting on a cold line. Left to the hardware prefetcher, a
// thread waited on every row's first lines (10-12 GB/s from DRAM on a Zen 5 EPYC, a third
// of a contiguous read); so while summing one row the loop prefetches, line for line, the
// row kAheadBytes further on in the token order (into the next token's rows at the end),
// about as far as the memory latency times one core's read bandwidth: 1.7-2.4x there
// from DRAM at 2-14 KB rows, and no slower from the last-level cache.
constexpr int64_t kAheadBytes = 6144;

// A product kept a rounded product: the compiler may not contract it with the add that
// follows into one fused multiply-add (GCC does so across statements by default), which
// would round once where the reference (a multiply, then an add) rounds twice.
template <typename V>
inline V rounded(V v) {
  __asm__("" : "+x"(v));
  return v;
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
inline at::vec::Vectorized<float> rounded(at::vec::Vectorized<float> v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = v;
  __asm__("" : "+v"(r));
#else
  __m256 r = v;
  __asm__("" : "+x"(r));
#endif
  return r;
}
#endif

// a[0:n] = 0 + src[0:n] * w (first) or a[0:n] += src[0:n] * w in Acc, the product rounded
// to Acc before the add (unweighted: no product), while prefetching pre[0:n]: one prefetch
// per vector load (a 64-byte line with AVX512, half of one with AVX2). The first term is
// added to +0, as the reference's sum from zeros: a token whose one term is -0 sums to +0.
template <typename T, typename Acc, bool kWeighted>
inline void add_row(Acc* a, const T* src, const T* pre, int64_t n, bool first, Acc w) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  using fVec = at::vec::Vectorized<float>;
  if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {
    using hVec = at::vec::Vectorized<T>;
    const fVec wv(static_cast<float>(w));
    for (; i + hVec::size() <= n; i += hVec::size()) {
      __builtin_prefetch(pre + i, 0, 3);
      auto [lo, hi] = torch_moe_cpu::to_float(hVec::loadu(src + i));
      if constexpr (kWeighted) {
        lo = rounded(lo * wv);
        hi = rounded(hi * wv);
      }
      const fVec zero(0.0f);
      lo = (first ? zero : fVec::loadu(a + i)) + lo;
      hi = (first ? zero : fVec::loadu(a + i + fVec::size())) + hi;
      lo.store(a + i);
      hi.store(a + i + fVec::size());
    }
  } else if constexpr (std::is_same_v<T, float>) {
    const fVec wv(w);
    for (; i + fVec::size() <= n; i += fVec::size()) {
      __builtin_prefetch(pre + i, 0, 3);
      fVec v = fVec::loadu(src + i);
      if constexpr (kWeighted) v = rounded(v * wv);
      ((first ? fVec(0.0f) : fVec::loadu(a + i)) + v).store(a + i);
    }
  }
#endif
  for (int64_t i0 = i; i0 < n; i0 += 64 / static_cast<int64_t>(sizeof(T))) {
    __builtin_prefetch(pre + i0, 0, 3);
  }
  for (; i < n; ++i) {
    Acc v = static_cast<Acc>(src[i]);
    if constexpr (kWeighted) v = rounded(v * w);
    a[i] = (first ? Acc(0) : a[i]) + v;
  }
}

template <typename T, typename Acc, bool kWeighted>
void combine_impl(const at::Tensor& y, const at::Tensor& slot_to_row, const at::Tensor& out,
                  const Acc* weights) {
  const int64_t tokens = slot_to_row.size(0), top_k = slot_to_row.size(1), d = y.size(1);
  const int64_t ys = y.stride(0), os = out.stride(0);
  const T* yp = y.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const at::Tensor rows_t = slot_to_row.contiguous();
  const int64_t* rows = rows_t.data_ptr<int64_t>();
  const int64_t ahead = std::max<int64_t>(1, kAheadBytes / std::max<int64_t>(1, d * sizeof(T)));
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    std::vector<Acc> acc(d);
    Acc* a = acc.data();
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t slot = t * top_k + k, row = rows[slot];
        // the row `ahead` rows on in this task's order (none: this row's own lines again)
        const int64_t next = slot + ahead < t1 * top_k ? rows[slot + ahead] : -1;
        if (row < 0) {  // a dropped slot adds +0 (-0 + 0 is +0), as the ATen kernel's
          for (int64_t i = 0; i < d; ++i) {  // zero-filled row does
            a[i] = k == 0 ? Acc(0) : a[i] + Acc(0);
          }
          continue;
        }
        const T* src = yp + row * ys;
        const Acc w = kWeighted ? weights[slot] : Acc(1);
        add_row<T, Acc, kWeighted>(a, src, next >= 0 ? yp + next * ys : src, d, k == 0, w);
      }
      if constexpr (std::is_same_v<T, Acc>) {
        std::memcpy(op + t * os, a, d * sizeof(T));
      } else {
        at::vec::convert(a, op + t * os, d);  // round to nearest even, as a tensor copy
      }
    }
  });
}

// The accumulation dtype of rows of dtype t: fp64 for fp64, else fp32 (the scales' and
// weights' dtype, and the sums').
at::ScalarType acc_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// f(T{}, Acc{}) for the rows' element type T of dtype t and its accumulation type: the four
// dtypes the combine and the weighted gather take (`name`'s error for any other).
template <typename F>
void by_dtype(at::ScalarType t, const char* name, F&& f) {
  switch (t) {
    case at::kBFloat16:
      return f(at::BFloat16{}, float{});
    case at::kHalf:
      return f(at::Half{}, float{});
    case at::kFloat:
      return f(float{}, float{});
    case at::kDouble:
      return f(double{}, double{});
    default:
      TORCH_CHECK(false, name, ": unsupported dtype ", t);
  }
}

}  // namespace

namespace torch_moe_cpu {  // (ops_cpu.h: other native ops call it)

void combine(const at::Tensor& y, const at::Tensor& slot_to_row, const at::Tensor& out,
             const std::optional<at::Tensor>& weights) {
  const auto acc = acc_type(y.scalar_type());
  TORCH_CHECK(!weights.has_value() ||
                  (weights->scalar_type() == acc && weights->sizes() == slot_to_row.sizes()),
              "combine_cpu: expected weights of slot_to_row's shape ", slot_to_row.sizes(),
              " in ", acc, " (y's accumulation dtype), got ",
              weights.has_value() ? weights->sizes() : at::IntArrayRef{}, " ",
              weights.has_value() ? weights->scalar_type() : acc);
  TORCH_CHECK(
      y.dim() == 2 && y.stride(1) == 1 && slot_to_row.dim() == 2 &&
          slot_to_row.scalar_type() == at::kLong && slot_to_row.size(1) >= 1 &&
          out.dim() == 2 && out.size(0) == slot_to_row.size(0) && out.size(1) == y.size(1) &&
          out.stride(1) == 1 && out.scalar_type() == y.scalar_type(),
      "combine_cpu: expected y [M, D] and out [T, D] of one dtype with contiguous rows and "
      "int64 slot_to_row [T, K >= 1], got ", y.sizes(), " ", y.scalar_type(), ", ",
      slot_to_row.sizes(), " ", slot_to_row.scalar_type(), ", ", out.sizes(), " ",
      out.scalar_type());
  const at::Tensor rows_c = slot_to_row.contiguous();
  const int64_t* rp = rows_c.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < rows_c.numel(); ++i) {
    TORCH_CHECK(rp[i] >= -1 && rp[i] < y.size(0), "combine_cpu: slot_to_row must hold rows of "
                "y in [-1, ", y.size(0), "), got ", rp[i], " at ", i);
  }
  by_dtype(y.scalar_type(), "combine_cpu", [&](auto t, auto a) {
    using T = decltype(t);
    using Acc = decltype(a);
    if (!weights.has_value()) return combine_impl<T, Acc, false>(y, slot_to_row, out, nullptr);
    const at::Tensor w = weights->contiguous();
    combine_impl<T, Acc, true>(y, slot_to_row, out, w.data_ptr<Acc>());
  });
}

}  // namespace torch_moe_cpu

namespace {

// out[r] = x[index[r]] * scales[r] (zero where index[r] < 0): the product in the
// accumulation dtype (fp32, fp64 for fp64), rounded once into x's dtype, as a gather then
// a row scaling in ATen ops computes it (one multiply: nothing to fuse).
template <typename T, typename Acc>
void gather_scaled_impl(const at::Tensor& x, const at::Tensor& index, const at::Tensor& scales,
                        const at::Tensor& out) {
  const int64_t rows = index.size(0), d = x.size(1), xs = x.stride(0), os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* ip = index.data_ptr<int64_t>();
  const Acc* sp = scales.data_ptr<Acc>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* o = op + r * os;
      if (ip[r] < 0) {
        std::fill(o, o + d, T(0));
        continue;
      }
      const T* src = xp + ip[r] * xs;
      const Acc s = sp[r];
      int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
      using fVec = at::vec::Vectorized<float>;
      if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {
        using hVec = at::vec::Vectorized<T>;
        const fVec sv(static_cast<float>(s));
        for (; i + hVec::size() <= d; i += hVec::size()) {
          auto [lo, hi] = torch_moe_cpu::to_float(hVec::loadu(src + i));
          torch_moe_cpu::from_float<T>(lo * sv, hi * sv).store(o + i);
        }
      } else if constexpr (std::is_same_v<T, float>) {
        const fVec sv(s);
        for (; i + fVec::size() <= d; i += fVec::size()) (fVec::loadu(src + i) * sv).store(o + i);
      }
#endif
      for (; i < d; ++i) o[i] = static_cast<T>(static_cast<Acc>(src[i]) * s);
    }
  });
}

void gather_scaled(const at::Tensor& x, const at::Tensor& index, const at::Tensor& scales,
                   const at::Tensor& out) {
  const auto acc = acc_type(x.scalar_type());
  TORCH_CHECK(
      x.dim() == 2 && x.stride(1) == 1 && index.dim() == 1 && index.is_contiguous() &&
          index.scalar_type() == at::kLong && scales.dim() == 1 && scales.is_contiguous() &&
          scales.scalar_type() == acc && scales.size(0) == index.size(0) && out.dim() == 2 &&
          out.size(0) == index.size(0) && out.size(1) == x.size(1) && out.stride(1) == 1 &&
          out.scalar_type() == x.scalar_type(),
      "gather_scaled_cpu: expected x [S, D] and out [M, D] of one dtype with contiguous rows, "
      "a contiguous int64 index [M] and scales [M] in ", acc, ", got ", x.sizes(), " ",
      x.scalar_type(), ", ", index.sizes(), " ", index.scalar_type(), ", ", scales.sizes(), " ",
      scales.scalar_type(), ", ", out.sizes(), " ", out.scalar_type());
  const int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < index.size(0); ++r) {
    TORCH_CHECK(ip[r] >= -1 && ip[r] < x.size(0), "gather_scaled_cpu: index must hold rows in "
                "[-1, ", x.size(0), "), got ", ip[r], " at ", r);
  }
  by_dtype(x.scalar_type(), "gather_scaled_cpu", [&](auto t, auto a) {
    gather_scaled_impl<decltype(t), decltype(a)>(x, index, scales, out);
  });
}

// out[t, k] for tokens [t0, t1): token t's row in fp32 once (tok), each k's products
// rows[slot] * tok rounded to fp32 into prod, then prod's sum in ATen's order.
template <typename T>
void row_dot_impl(const at::Tensor& rows, const at::Tensor& tokens, const int64_t* slots,
                  float* out, int64_t top_k) {
  const int64_t d = rows.size(1), rs = rows.stride(0), ts = tokens.stride(0);
  const T* rp = rows.data_ptr<T>();
  const T* tp = tokens.data_ptr<T>();
  at::parallel_for(0, tokens.size(0), 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(2 * d);
    float* tok = buf.data();
    float* prod = buf.data() + d;
    for (int64_t t = t0; t < t1; ++t) {
      at::vec::convert(tp + t * ts, tok, d);  // (exact)
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t slot = slots[t * top_k + k];
        if (slot < 0) {  // a dropped slot: 0, as the reference's masked_fill
          out[t * top_k + k] = 0.f;
          continue;
        }
        const T* row = rp + slot * rs;
        int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
        using fVec = at::vec::Vectorized<float>;
        if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {
          using hVec = at::vec::Vectorized<T>;
          for (; i + hVec::size() <= d; i += hVec::size()) {
            const auto [lo, hi] = torch_moe_cpu::to_float(hVec::loadu(row + i));
            (lo * fVec::loadu(tok + i)).store(prod + i);
            (hi * fVec::loadu(tok + i + fVec::size())).store(prod + i + fVec::size());
          }
        } else {
          for (; i + fVec::size() <= d; i += fVec::size()) {
            (fVec::loadu(row + i) * fVec::loadu(tok + i)).store(prod + i);
          }
        }
#endif
        for (; i < d; ++i) prod[i] = static_cast<float>(row[i]) * tok[i];
        out[t * top_k + k] = torch_moe_cpu::aten_order_sum(prod, d);
      }
    }
  });
}

void row_dot(const at::Tensor& rows, const at::Tensor& tokens, const at::Tensor& slot_to_row,
             const at::Tensor& out) {
  const auto dt = rows.scalar_type();
  TORCH_CHECK(
      (dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat) && rows.dim() == 2 &&
          rows.stride(1) == 1 && tokens.dim() == 2 && tokens.stride(1) == 1 &&
          tokens.scalar_type() == dt && tokens.size(1) == rows.size(1) &&
          slot_to_row.dim() == 2 && slot_to_row.scalar_type() == at::kLong &&
          slot_to_row.size(0) == tokens.size(0) && out.scalar_type() == at::kFloat &&
          out.is_contiguous() && out.sizes() == slot_to_row.sizes(),
      "row_dot_cpu: expected rows [M, D] and tokens [T, D] of one dtype (bfloat16, float16 "
      "or float32) with contiguous rows, int64 slot_to_row [T, K] and a contiguous fp32 out "
      "[T, K], got ", rows.sizes(), " ", dt, ", ", tokens.sizes(), " ", tokens.scalar_type(),
      ", ", slot_to_row.sizes(), " ", slot_to_row.scalar_type(), ", ", out.sizes(), " ",
      out.scalar_type());
  const at::Tensor slots_t = slot_to_row.contiguous();
  const int64_t* slots = slots_t.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots_t.numel(); ++i) {
    TORCH_CHECK(slots[i] >= -1 && slots[i] < rows.size(0), "row_dot_cpu: slot_to_row must "
                "hold rows in [-1, ", rows.size(0), "), got ", slots[i], " at ", i);
  }
  float* op = out.data_ptr<float>();
  const int64_t top_k = slot_to_row.size(1);
  if (dt == at::kBFloat16) return row_dot_impl<at::BFloat16>(rows, tokens, slots, op, top_k);
  if (dt == at::kHalf) return row_dot_impl<at::Half>(rows, tokens, slots, op, top_k);
  row_dot_impl<float>(rows, tokens, slots, op, top_k);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_moe_cpu, m) {
  m.def(
      "permute_indices(Tensor expert_ids, int num_experts, int align, int? capacity) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def("combine(Tensor y, Tensor slot_to_row, Tensor(a!) out, Tensor? weights=None) -> ()");
  m.def("gather_scaled(Tensor x, Tensor index, Tensor scales, Tensor(a!) out) -> ()");
  m.def("row_dot(Tensor rows, Tensor tokens, Tensor slot_to_row, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(torch_moe_cpu, CPU, m) {
  m.impl("permute_indices", &torch_moe_cpu::permute_indices);
  m.impl("combine", &torch_moe_cpu::combine);
  m.impl("gather_scaled", &gather_scaled);
  m.impl("row_dot", &row_dot);
}
