// How many threads the native kernels' at::parallel_for regions run on.
//
// at::parallel_for is a header template: with ATen's OpenMP backend its threads come from
// an `omp parallel` region compiled into the caller, so a library built without -fopenmp
// runs every parallel_for on the calling thread alone, whatever torch.get_num_threads()
// says, and nothing fails. torch_moe/_ops/_native.py builds with OpenMP where torch's
// backend is OpenMP; this op lets a test see that the build's regions really fan out.
//
//   parallel_threads(tasks) -> the number of distinct threads that ran
//                              at::parallel_for(0, tasks, 1, ...)

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <mutex>
#include <set>

namespace {

int64_t parallel_threads(int64_t tasks) {
  TORCH_CHECK(tasks >= 1, "parallel_threads: tasks must be >= 1, got ", tasks);
  std::mutex lock;
  std::set<int> seen;
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    const std::lock_guard<std::mutex> guard(lock);
    seen.insert(at::get_thread_num());
  });
  return static_cast<int64_t>(seen.size());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_moe_cpu, m) {
  m.def("parallel_threads(int tasks) -> int", &parallel_threads);  // no tensors: one kernel
}
