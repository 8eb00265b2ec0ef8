// Evicting a tensor's memory from the CPU caches, for the CPU probe's measurements of
// kernels whose operands come from memory in a real step (torch_moe/_ops/_cpu_probe.py,
// `cycled(..., evict=...)`): a decode step reads every routed expert's weight once from
// DRAM, while the probe's few MiB of weights would stay in a last-level cache of tens to
// hundreds of MiB however many sets it cycles through.
//
//   evict_from_cache(t) -> bool     every cache line of t's bytes written back and
//                                   invalidated (clflush); false where not done (not x86)

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <cstdint>

namespace {

bool evict_from_cache(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "evict_from_cache: a CPU tensor expected, got ", t.device());
#if defined(__x86_64__) || defined(_M_X64)
  if (t.numel() == 0) return true;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) < 0) return false;
  }
  // the bytes the tensor's elements span (its storage offset to its last element)
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto* begin = static_cast<const char*>(t.const_data_ptr());
  const char* end = begin + (last + 1) * static_cast<int64_t>(t.element_size());
  const auto first = reinterpret_cast<std::uintptr_t>(begin) & ~std::uintptr_t(63);
  for (std::uintptr_t line = first; line < reinterpret_cast<std::uintptr_t>(end); line += 64) {
    _mm_clflush(reinterpret_cast<const void*>(line));
  }
  _mm_mfence();
  return true;
#else
  (void)t;
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_moe_cpu, m) {
  m.def("evict_from_cache(Tensor t) -> bool");
}

TORCH_LIBRARY_IMPL(torch_moe_cpu, CPU, m) {
  m.impl("evict_from_cache", &evict_from_cache);
}
