// The entry points of native ops that other native ops call in place of a dispatcher
// call each (experts_cpu.cpp's decode step runs them in one op). Each is the
// function its op registers, with that op's checks.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace torch_moe_cpu {

// grouped_mm_cpu.cpp: out[rows of g] = x[rows of g] @ w[g] (x [M, K], w [E, K, N] row- or
// column-major per group, offs int32 group ends), rows past the last end zero
void few_rows_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                 at::Tensor& out, int64_t amx_rows);

// swiglu_cpu.cpp: out = silu(h[:, :F]) * h[:, F:] (* row_weights), h [M, 2F], out [M, F]
void swiglu_forward(const at::Tensor& h, const std::optional<at::Tensor>& row_weights,
                    const at::Tensor& out, bool stream_out, bool table);

// permute_cpu.cpp: the (token, k) slots sorted by expert, stably: (row_to_slot [M],
// slot_to_row [T, K], offs [E] int32 group ends, dropped), permute_indices' values
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> permute_indices(
    const at::Tensor& expert_ids, int64_t num_experts, int64_t align,
    std::optional<int64_t> capacity);

// permute_cpu.cpp: out[t] = sum_k y[slot_to_row[t, k]] (* weights[t, k]); -1 adds zero
void combine(const at::Tensor& y, const at::Tensor& slot_to_row, const at::Tensor& out,
             const std::optional<at::Tensor>& weights);

}  // namespace torch_moe_cpu
