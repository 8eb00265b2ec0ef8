// The SwiGLU experts of a decode step in one native call.
//
//   swiglu_combine_few(x [T, D], w13 [E, 2F, D], w2 [E, D, F], offs [E] int32,
//                      row_weights [M]?, row_to_slot [M], slot_to_row [T, K], plan [P, 2]
//                      int32, out [T, D], stream_out, table) -> bool
//
// computes, into out, what grouped_swiglu_combine's eager inference path computes where
// both expert GEMMs run by the few-rows kernel (grouped_swiglu.py's lean plan):
//
//   rows  = x[row_to_slot // K] (zero where -1)           the tokens' rows, gathered
//   h     = few_rows_mm(rows, w13^T, offs, amx13)          [M, 2F]
//   a     = swiglu_forward(h, row_weights)                 [M, F]
//   y     = few_rows_mm(a, w2^T, offs, amx2)               [M, D]
//   out   = combine(y, slot_to_row)                        [T, D]
//
// the same kernels on the same operands in the same order, so the same bits; moe_few
// (below) computes the same from the router's expert ids and weights, the index sort and
// the rows' weights included. One call in place of a dozen: at a few tokens a layer's
// experts read their weights from memory and the rest of the step runs from cold caches,
// where each dispatcher call, Python frame and tensor allocation costs several times its
// warm cost (on a Zen 4 EPYC core the Python path's glue took 0.69-0.89 ms of a one-token
// step from cold caches, 0.07-0.27 ms warm: benchmarks/results/cpu_floor_cpu_202612.md).
//
// Which way each GEMM runs is the probe's decision (few_gemm, amx_rows), which depends on
// the groups' shape class, here on how many groups have rows: plan[b] = (amx13, amx2),
// the two GEMMs' amx_rows for b busy groups (>= 0: the few-rows kernel; negative: not
// decided, or another way), filled by the Python caller from the decisions its own path
// took. The op returns false, writing nothing, where the plan does not say "few rows" for
// this call's busy groups, where offs does not end at M (a capacity or padding), and for
// any input the Python path would refuse (shapes, dtypes, layouts, values of offs and of
// the maps): the Python path then runs, and raises its own errors.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops_cpu.h"

#include <cstring>
#include <optional>

namespace {

bool is_few_dtype(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat;
}

// Whether every value of the int64 tensor t (contiguous) lies in [-1, end)
bool values_in(const at::Tensor& t, int64_t end) {
  const int64_t* p = t.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (p[i] < -1 || p[i] >= end) return false;
  }
  return true;
}

// A weight's transposed view [E, K, N] as few_rows_mm takes it: row- or column-major
bool few_layout(const at::Tensor& w_t) {
  return w_t.stride(2) == 1 || w_t.stride(1) == 1;
}

bool swiglu_combine_few(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                        const at::Tensor& offs, const std::optional<at::Tensor>& row_weights,
                        const at::Tensor& row_to_slot, const at::Tensor& slot_to_row,
                        const at::Tensor& plan, const at::Tensor& out, bool stream_out,
                        bool table) {
  // shapes, dtypes and layouts (anything else: the Python path)
  if (x.dim() != 2 || w13.dim() != 3 || w2.dim() != 3 || !x.is_contiguous()) return false;
  const int64_t T = x.size(0), D = x.size(1), E = w13.size(0), F2 = w13.size(1);
  if (T == 0 || F2 % 2 != 0 || w13.size(2) != D) return false;
  const int64_t F = F2 / 2;
  if (w2.size(0) != E || w2.size(1) != D || w2.size(2) != F) return false;
  const auto dt = x.scalar_type();
  if (!is_few_dtype(dt) || w13.scalar_type() != dt || w2.scalar_type() != dt) return false;
  if (offs.dim() != 1 || offs.scalar_type() != at::kInt || offs.size(0) != E ||
      !offs.is_contiguous()) {
    return false;
  }
  if (row_to_slot.dim() != 1 || row_to_slot.scalar_type() != at::kLong ||
      !row_to_slot.is_contiguous() || slot_to_row.dim() != 2 ||
      slot_to_row.scalar_type() != at::kLong || slot_to_row.size(0) != T ||
      slot_to_row.size(1) < 1 || !slot_to_row.is_contiguous()) {
    return false;
  }
  const int64_t M = row_to_slot.size(0), K = slot_to_row.size(1);
  if (row_weights.has_value() &&
      (row_weights->dim() != 1 || row_weights->size(0) != M ||
       !at::isFloatingType(row_weights->scalar_type()))) {
    return false;
  }
  if (plan.dim() != 2 || plan.size(1) != 2 || plan.scalar_type() != at::kInt ||
      !plan.is_contiguous()) {
    return false;
  }
  if (out.dim() != 2 || out.size(0) != T || out.size(1) != D || out.scalar_type() != dt ||
      !out.is_contiguous()) {
    return false;
  }
  const at::Tensor w13_t = w13.transpose(1, 2), w2_t = w2.transpose(1, 2);
  if (!few_layout(w13_t) || !few_layout(w2_t)) return false;
  // values: the groups end at M, non-decreasing; the maps within their ranges
  const int32_t* ends = offs.const_data_ptr<int32_t>();
  int64_t busy = 0;
  for (int64_t g = 0, prev = 0; g < E; prev = ends[g], ++g) {
    if (ends[g] < prev) return false;
    busy += ends[g] > prev;
  }
  if (E == 0 || ends[E - 1] != M || M == 0) return false;
  if (!values_in(row_to_slot, T * K) || !values_in(slot_to_row, M)) return false;
  if (busy >= plan.size(0)) return false;
  const int32_t* choice = plan.const_data_ptr<int32_t>() + 2 * busy;
  if (choice[0] < 0 || choice[1] < 0) return false;

  // the tokens' rows, gathered (x.index_select's values; -1: a zero row)
  const at::Tensor rows = at::empty({M, D}, x.options());
  const int64_t* slot = row_to_slot.const_data_ptr<int64_t>();
  const auto* xp = static_cast<const char*>(x.const_data_ptr());
  auto* rp = static_cast<char*>(rows.mutable_data_ptr());
  const int64_t row_bytes = D * x.element_size();
  for (int64_t r = 0; r < M; ++r) {
    if (slot[r] < 0) {
      std::memset(rp + r * row_bytes, 0, row_bytes);
    } else {
      std::memcpy(rp + r * row_bytes, xp + slot[r] / K * row_bytes, row_bytes);
    }
  }
  at::Tensor h = at::empty({M, F2}, x.options());
  torch_moe_cpu::few_rows_mm(rows, w13_t, offs, h, choice[0]);
  at::Tensor a = at::empty({M, F}, x.options());
  std::optional<at::Tensor> w32;
  if (row_weights.has_value()) w32 = row_weights->to(at::kFloat).contiguous();
  torch_moe_cpu::swiglu_forward(h, w32, a, stream_out, table);
  h.reset();  // freed before the combine, as the Python path frees it
  at::Tensor y = at::empty({M, D}, x.options());
  torch_moe_cpu::few_rows_mm(a, w2_t, offs, y, choice[1]);
  a.reset();
  torch_moe_cpu::combine(y, slot_to_row, out, std::nullopt);
  return true;
}

// moe_few: swiglu_combine_few from the routing itself, as a layer's decode step runs it:
// the slots sorted by expert (permute_indices(expert_ids, E): no padding, no capacity) and
// each row's routing weight, weights[row_to_slot[r]] in fp32 (what the Python path
// gathers, then converts), then swiglu_combine_few; false (nothing written) where
// expert_ids or weights are not what the layer's router gives ([T, K] int32 / int64 ids
// in [0, E), floating-point weights of that shape) or swiglu_combine_few refuses.
bool moe_few(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
             const at::Tensor& expert_ids, const at::Tensor& weights, const at::Tensor& plan,
             const at::Tensor& out, bool stream_out, bool table) {
  if (x.dim() != 2 || w13.dim() != 3 || expert_ids.dim() != 2 ||
      expert_ids.size(0) != x.size(0) || expert_ids.size(1) < 1 ||
      (expert_ids.scalar_type() != at::kLong && expert_ids.scalar_type() != at::kInt) ||
      weights.sizes() != expert_ids.sizes() || !at::isFloatingType(weights.scalar_type())) {
    return false;
  }
  const at::Tensor ids = expert_ids.to(at::kLong).contiguous();
  const int64_t E = w13.size(0);
  const int64_t* id = ids.const_data_ptr<int64_t>();
  for (int64_t s = 0; s < ids.numel(); ++s) {
    if (id[s] < 0 || id[s] >= E) return false;
  }
  if (E == 0) return false;
  const auto [row_to_slot, slot_to_row, offs, dropped] =
      torch_moe_cpu::permute_indices(ids, E, 1, std::nullopt);
  const int64_t M = row_to_slot.size(0);
  const at::Tensor rw = at::empty({M}, weights.options().dtype(at::kFloat));
  const at::Tensor w = weights.contiguous();
  const int64_t* slot = row_to_slot.const_data_ptr<int64_t>();
  float* rp = rw.mutable_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "moe_few", [&] {
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    for (int64_t r = 0; r < M; ++r) rp[r] = static_cast<float>(wp[slot[r]]);
  });
  return swiglu_combine_few(x, w13, w2, offs, rw, row_to_slot, slot_to_row, plan, out,
                            stream_out, table);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_moe_cpu, m) {
  m.def(
      "swiglu_combine_few(Tensor x, Tensor w13, Tensor w2, Tensor offs, Tensor? row_weights, "
      "Tensor row_to_slot, Tensor slot_to_row, Tensor plan, Tensor(a!) out, bool stream_out, "
      "bool table) -> bool");
  m.def(
      "moe_few(Tensor x, Tensor w13, Tensor w2, Tensor expert_ids, Tensor weights, Tensor plan, "
      "Tensor(a!) out, bool stream_out, bool table) -> bool");
}

TORCH_LIBRARY_IMPL(torch_moe_cpu, CPU, m) {
  m.impl("swiglu_combine_few", &swiglu_combine_few);
  m.impl("moe_few", &moe_few);
}
