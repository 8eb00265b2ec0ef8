// A grouped GEMM whose groups are shared out over the intra-op threads (torch_moe's CPU
// grouped_mm kernels on two or more threads, unless the CPU probe's threads_mm decision
// measured torch._grouped_mm or the per-group loop faster on the caller's threads):
//
//   threaded_grouped_mm:        out[rows of g] = x[rows of g] @ w[g]     x [M, K], w [E, K, N]
//   threaded_grouped_mm_wgrad:  out[g] = a[:, rows of g] @ dy[rows of g] a [K, M], dy [M, N]
//
// torch._grouped_mm and the loop run one GEMM per group, each split by oneDNN over all
// threads. An expert's GEMM of a few hundred rows is small for that: the split leaves a
// thread a few dozen rows or a narrow band of columns, group sizes that are not a
// multiple of the GEMM's row block (a router's counts never are) load the threads
// unevenly, and the end of every group's GEMM is a barrier for all threads, which on a
// shared machine waits for the slowest one (the bf16 layer steps of
// benchmarks/bench_moe_layer.py on two threads: benchmarks/results/cpu_floor_cpu_202612.md).
// This kernel lays the groups' work end to end (rows x K x N), cuts it into one equal
// contiguous range per thread and runs each range's GEMMs on its thread alone: a group
// inside a range is one GEMM, a group on a range's edge is split between two threads, by
// the output's columns in the forward (each thread packs only its columns of the
// expert's weight; split by rows, both would pack all of it) and by the output's rows
// (the K of [K, N]) in the weight gradient, so that no output element is summed by two
// threads. The cuts fall on multiples of 16 columns or rows. With the native GEMM's
// pieces (native_gemm), for large groups (448 rows or more on average, every thread's
// share at least 512 columns, or rows of a weight gradient), every group is cut that way
// instead, into one share per thread at multiples of its 64-column panel: the threads
// then run each expert together, each packing its share of the weight. On the 2-core
// Zen 5 EPYC the 8-expert layer's step (T = 2048: 512 rows per expert, two threads) ran
// 0-5% faster so than by ranges of experts; the 32- and 64-expert shapes (384 and 256
// rows) ran 0-4% slower so, and oneDNN's pieces, each repacking its operands per call,
// ran slower split across every group (benchmarks/results/cpu_floor_cpu_202612.md).
//
// Each piece is one at::mm_out on views of the operands (row- or column-major, as given),
// so the math is ATen's: its dtype, its accumulation, one rounding into out. In a parallel
// region ATen and oneDNN run a GEMM on the calling thread alone. The pool's threads take
// the caller's thread-local state (grad mode, dispatch keys) for their GEMMs. The pieces
// depend only on the group ends and the thread count, so results are deterministic for a
// given thread count. oneDNN's bf16 GEMMs gave every element the same bits for any split
// of its rows or columns and any thread count on the machines measured here, MKL's fp32
// ones of a few rows did not; a GEMM library need not, so the Python side sends half
// dtypes only (fp32 GEMMs only as upcast pieces of half operands, below), and every path
// that must match another bit for bit asks the same decision
// (test_native checks the values against float64 on 1-3 threads, test_eager the eager
// nodes' bits against the ops', which take the same kernels).
// Rows of out at or past the last group's end are zero (forward); a weight gradient's
// empty groups are zero.
//
// Gathered operands (x_index; a_index, dy_index): x's rows, a's columns or dy's rows as
// rows of their source picked by an int64 index (-1: a zero row), checked against the
// source's rows; read through the index by the native GEMM, else each piece's rows
// gathered into its thread's scratch just before ATen's GEMM reads them (the same values
// either way; `gathered` below says why not one copy of all rows). transpose_a takes a
// gathered a too: the piece's rows gathered, then copied row-major.
//
// stream_out (the CPU probe's out_stream decision): the native GEMM writes the output's
// whole 64-byte lines by non-temporal stores where all of out is past this core's L2
// (bf16_gemm_streams): no read for ownership of lines nothing reads before they leave
// the cache. The values do not change.
//
// split_rows (forward; the CPU probe's row_split decision): oneDNN's bf16 / fp16 matmul on
// AVX-512 without AMX (oneDNN 3.x) cuts a GEMM's M rows into equal blocks of 32 to 256
// rows, the largest block with the fewest padded rows. A router's count such as 481 =
// 13 x 37 so gets 13 blocks of 37 rows, each of which streams the packed weight again and
// ends in a one-row tail of the micro-kernel: 15-40% slower than 480 or 482 rows on the
// machines measured (about one count in 14 between 257 and 700 gets blocks under 64
// rows). With split_rows a piece whose rows oneDNN would so block runs as ceil(rows / 256)
// GEMMs of near-equal rows instead, one block each, at the price of packing the weight
// once per GEMM. The bits do not change: a row's sums do not depend on the row blocks.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include "gemm_bf16_cpu.h"
#include "sgemm_cpu.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kAlign = 16;  // pieces cut at multiples of this many columns / rows
constexpr int64_t kMaxBlock = 256, kMinBlock = 32;  // oneDNN's row blocks (header)
constexpr int64_t kSmallBlock = 64;                  // blocks under this split a GEMM
constexpr int64_t kPanel = 64;     // the native GEMM's panel: cuts by extent at multiples
constexpr int64_t kMinShare = 512; // a thread's least share of a group's extent (8 panels)
constexpr int64_t kMinRows = 448;  // and the least rows of a busy group, on average

// The row block oneDNN's AVX-512 matmul takes for `rows` rows on one thread: the largest
// of kMinBlock..kMaxBlock rows (at most `rows`) with the fewest padded rows.
int64_t onednn_row_block(int64_t rows) {
  int64_t best = std::min(rows, kMaxBlock), least_pad = -1;
  for (int64_t m = best; m >= std::min(rows, kMinBlock); --m) {
    const int64_t pad = (rows + m - 1) / m * m - rows;
    if (least_pad < 0 || pad < least_pad) {
      least_pad = pad;
      best = m;
    }
  }
  return best;
}

// How many GEMMs split_rows runs `rows` rows as: near-equal pieces of at most kMaxBlock
// rows where onednn_row_block leaves blocks under kSmallBlock rows (header), else one.
int64_t row_split_parts(int64_t rows) {
  if (rows <= kMaxBlock || onednn_row_block(rows) >= kSmallBlock) return 1;
  return (rows + kMaxBlock - 1) / kMaxBlock;
}

// out = x @ w on this thread by ATen's GEMM, with split_rows as row_split_parts pieces
// (the native GEMM, which does not block rows as oneDNN does, runs before: its callers).
void mm_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, bool split_rows) {
  const int64_t rows = x.size(0);
  const int64_t parts = split_rows ? row_split_parts(rows) : 1;
  if (parts == 1) {
    at::mm_out(out, x, w);
    return;
  }
  for (int64_t p = 0, r0 = 0; p < parts; ++p) {
    const int64_t r1 = rows * (p + 1) / parts;
    auto o = out.narrow(0, r0, r1 - r0);
    at::mm_out(o, x.narrow(0, r0, r1 - r0), w);
    r0 = r1;
  }
}

// upcast (CPUs that multiply a half dtype slower than its fp32 upcast: the CPU probe's
// half_gemm): each piece's operands are converted to fp32 on its thread, the product is
// ATen's fp32 GEMM on that thread alone, rounded once into out (the math of the per-group
// loop, which converts each group's operands and rounds each product once): where ATen's
// fp32 matmuls are IEEE, BLAS's sgemm_ (the routine ATen's calls) on the thread's
// buffers, without a tensor per operand and product (sgemm_cpu.h; the bf16 layer steps
// of benchmarks/bench_fp8_emulation.py's shapes 1-7% faster so on two threads of the Zen
// 3, the same bits), else at::mm on fp32 tensor copies. The weight
// operand and the product are converted kUpcastCols columns at a time, so a piece's fp32
// copies stay a few MiB (one block of an expert's weight, not all of it) and the weight's
// block is read by the GEMM from the caches it was just written to. The values are
// within the fp32 GEMM's rounding bound of the loop's (what the tests hold them to), not
// always its bits: MKL's AVX2 sgemm orders a product's sums by the columns of the call,
// so a piece narrower than the loop's GEMM (a block's last columns, an edge group's
// share of the columns) can differ from it by an ulp, and so with the thread count
// (a differential fuzz on the Zen 3 EPYC: benchmarks/results/cpu_floor_cpu_202612.md).
constexpr int64_t kUpcastCols = 512;

// What upcast takes: each tensor fp32 or a 16-bit float.
bool upcast_dtypes(std::initializer_list<at::Tensor> ts) {
  for (const auto& t : ts) {
    const auto dt = t.scalar_type();
    if (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf) return false;
  }
  return true;
}

// t (2-D) as fp32 in t's own layout (row-major, or column-major where its rows are
// contiguous), a fresh tensor freed with the piece; t itself where already fp32.
at::Tensor upcast_copy(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat) return t;
  const bool cols = t.stride(0) == 1 && t.size(0) > 1 && t.stride(1) != 1;
  auto f = cols ? at::empty({t.size(1), t.size(0)}, t.options().dtype(at::kFloat)).t()
                : at::empty(t.sizes(), t.options().dtype(at::kFloat));
  f.copy_(t);
  return f;
}

// A 2-D operand as fp32 in its own layout for fp32_gemm: its rows (by_cols false) or, where
// its rows are contiguous instead, the rows of its transpose (by_cols true), ld elements
// apart; an fp32 t read in place, a 16-bit one converted into buf. nullptr where neither
// dim is contiguous.
const float* upcast_operand(const at::Tensor& t, std::vector<float>& buf, bool& by_cols,
                            int64_t& ld) {
  const int64_t r = t.size(0), c = t.size(1);
  by_cols = !(t.stride(1) == 1 || c <= 1);
  if (by_cols && t.stride(0) != 1 && r > 1) return nullptr;
  const int64_t lines = by_cols ? c : r, len = by_cols ? r : c;
  const int64_t step = by_cols ? t.stride(1) : t.stride(0);
  if (t.scalar_type() == at::kFloat) {
    ld = step;
    return t.const_data_ptr<float>();
  }
  float* d = torch_moe_cpu::aligned_scratch(buf, std::max<int64_t>(lines * len, 1));
  ld = len;
  const auto* base = static_cast<const char*>(t.const_data_ptr());
  for (int64_t i = 0; i < lines; ++i) {  // (exact: at::vec::convert, as a tensor copy)
    const void* src = base + i * step * t.element_size();
    if (t.scalar_type() == at::kBFloat16) {
      at::vec::convert(static_cast<const at::BFloat16*>(src), d + i * len, len);
    } else {
      at::vec::convert(static_cast<const at::Half*>(src), d + i * len, len);
    }
  }
  return d;
}

// mm_upcast by fp32_gemm_into (sgemm_cpu.h) on the operands' fp32 copies in the thread's
// buffers, b's and the product's kUpcastCols columns at a time: the tensor form's math
// without its per-piece tensors (an at::empty and a copy per operand, a product tensor
// and its copy). False, out untouched, where an operand has no contiguous dim or out's
// columns are not contiguous.
bool mm_upcast_direct(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  thread_local std::vector<float> a_buf, b_buf;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (out.stride(1) != 1 && n > 1) return false;
  bool a_cols = false, b_cols = false;
  int64_t lda = 0, ldb = 0;
  const float* af = upcast_operand(a, a_buf, a_cols, lda);
  if (af == nullptr) return false;
  for (int64_t c0 = 0; c0 < n; c0 += kUpcastCols) {
    const int64_t cols = std::min(kUpcastCols, n - c0);
    const float* bf = upcast_operand(b.narrow(1, c0, cols), b_buf, b_cols, ldb);
    if (bf == nullptr) return false;  // (b's layout is one for all its columns: at c0 = 0)
    auto* o = static_cast<char*>(out.mutable_data_ptr()) + c0 * out.element_size();
    if (!torch_moe_cpu::fp32_gemm_into(out.scalar_type(), o, out.stride(0), m, cols, k, af, lda,
                                       a_cols, bf, ldb, b_cols)) {
      return false;  // (sizes past int32, at c0 = 0: out untouched)
    }
  }
  return true;
}

// Whether the upcast pieces now take mm_upcast_direct, their fp32 copies in the threads'
// scratch (outside the allocator: the memory model counts them there only otherwise).
bool upcast_in_scratch() { return torch_moe_cpu::fp32_gemm_available(); }

// out = a @ b on this thread by ATen's fp32 GEMM on fp32 copies of half operands (a's
// whole, b's and the product's kUpcastCols columns at a time), rounded once into out; by
// mm_upcast_direct where `direct` (the op's one reading of fp32_gemm_available).
void mm_upcast(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool direct) {
  if (direct && mm_upcast_direct(out, a, b)) return;
  const auto a_f = upcast_copy(a);
  const int64_t n = b.size(1);
  for (int64_t c0 = 0; c0 < n; c0 += kUpcastCols) {
    const int64_t cols = std::min(kUpcastCols, n - c0);
    auto o = out.narrow(1, c0, cols);
    const auto b_f = upcast_copy(b.narrow(1, c0, cols));
    if (o.scalar_type() == at::kFloat) {
      at::mm_out(o, a_f, b_f);
    } else {
      o.copy_(at::mm(a_f, b_f));
    }
  }
}

// The group ends of offs, checked: non-decreasing, within [0, rows].
std::vector<int64_t> read_ends(const at::Tensor& offs, int64_t groups, int64_t rows,
                               const char* name) {
  TORCH_CHECK(offs.dim() == 1 && offs.scalar_type() == at::kInt && offs.size(0) == groups &&
                  offs.is_contiguous(),
              name, ": offs must be a contiguous int32 tensor of ", groups, " group ends");
  const int32_t* p = offs.const_data_ptr<int32_t>();
  std::vector<int64_t> ends(p, p + groups);
  for (int64_t g = 0, prev = 0; g < groups; prev = ends[g], ++g) {
    TORCH_CHECK(ends[g] >= prev && ends[g] <= rows, name, ": offs must be non-decreasing and "
                "at most the ", rows, " rows, got ", ends[g], " at group ", g);
  }
  return ends;
}

// Where a thread's range starts inside group g: the group's share of the range's start
// point, as a cut of its `extent` (the output's columns, or its rows), rounded to kAlign.
// Both threads that share a group compute the cut from the same boundary.
int64_t cut(int64_t boundary, int64_t start, int64_t rows, int64_t extent) {
  if (boundary <= start) return 0;
  if (boundary >= start + rows) return extent;
  const double share = static_cast<double>(boundary - start) / static_cast<double>(rows);
  const int64_t at = static_cast<int64_t>(share * static_cast<double>(extent) / kAlign + 0.5);
  return std::min(extent, at * kAlign);
}

// Runs piece(g, start, rows, lo, hi) for every group g with rows and its part [lo, hi)
// of `extent(g, rows)`: each range of the groups' end-to-end rows on one thread, or, with
// `by_extent` (the native GEMM's pieces) where every thread's share of every busy group's
// extent is at least kMinShare and the busy groups hold kMinRows rows on average, every
// group cut by its extent into one share per thread (multiples of kPanel).
template <typename Extent, typename Piece>
void split_groups(const std::vector<int64_t>& ends, Extent extent, Piece piece,
                  bool by_extent = false) {
  const int64_t groups = static_cast<int64_t>(ends.size());
  const int64_t total = groups ? ends.back() : 0;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total));
  int64_t busy = 0;
  for (int64_t g = 0, start = 0; by_extent && g < groups; start = ends[g], ++g) {
    const int64_t rows = ends[g] - start;
    busy += rows > 0;
    if (rows > 0 && extent(g, rows) < threads * kMinShare) by_extent = false;
  }
  by_extent = by_extent && threads > 1 && total >= busy * kMinRows;
  auto run = [&](int64_t t) {
    const int64_t b0 = total * t / threads, b1 = total * (t + 1) / threads;
    for (int64_t g = 0, start = 0; g < groups; start = ends[g], ++g) {
      const int64_t rows = ends[g] - start;
      if (rows <= 0) continue;
      const int64_t n = extent(g, rows);
      if (by_extent) {
        const int64_t lo = n * t / threads / kPanel * kPanel;
        const int64_t hi = t + 1 == threads ? n : n * (t + 1) / threads / kPanel * kPanel;
        if (hi > lo) piece(g, start, rows, lo, hi);
        continue;
      }
      if (start >= b1 || start + rows <= b0) continue;
      const int64_t lo = cut(b0, start, rows, n), hi = cut(b1, start, rows, n);
      if (hi > lo) piece(g, start, rows, lo, hi);
    }
  };
  if (threads == 1 || at::in_parallel_region()) {
    for (int64_t t = 0; t < threads; ++t) run(t);
    return;
  }
  // the pieces' GEMMs dispatch from the pool's threads, which do not inherit the caller's
  // thread-local state (grad mode, the dispatch keys excluded below autograd): take it
  const at::ThreadLocalState state;
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    const at::ThreadLocalStateGuard guard(state);
    for (int64_t t = t0; t < t1; ++t) run(t);
  });
}

// A gather index of an operand's rows: int64, contiguous, `rows` entries in [-1, stored).
const int64_t* check_index(const std::optional<at::Tensor>& index, int64_t rows, int64_t stored,
                           const char* name, const char* what) {
  if (!index.has_value()) return nullptr;
  const at::Tensor& t = *index;
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong && t.is_contiguous() &&
                  t.size(0) == rows,
              name, ": ", what, " must be a contiguous int64 tensor of ", rows, " rows, got ",
              t.sizes(), " ", t.scalar_type());
  const int64_t* p = t.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(p[i] >= -1 && p[i] < stored, name, ": ", what, " must hold rows in [-1, ",
                stored, "), got ", p[i], " at ", i);
  }
  return p;
}

// Rows `index` (zero where -1) of src [S, N] (unit column stride) as a [rows, N] tensor in
// this thread's scratch slot `slot` (valid until that slot's next use on the thread): a
// piece's gathered operand for ATen's GEMM, copied just before the GEMM reads it back from
// the caches. One gather of all of an operand's rows into a fresh [M, N] tensor (the ops'
// path: index_select) writes and then reads M rows through memory (32 MB at the 64-expert
// layer of benchmarks/bench_moe_layer.py, 5 ms each way on one thread of the AMX Xeon
// measured), and a fresh tensor per piece is as slow (its pages and the fill of -1 rows).
at::Tensor gathered(const at::Tensor& src, const int64_t* index, int64_t rows, int slot) {
  const int64_t n = src.size(1), bytes = n * src.element_size(), ld = src.stride(0);
  if (src.stride(1) != 1 && n > 1) {  // (no caller sends this: kept correct all the same)
    const auto idx = at::from_blob(const_cast<int64_t*>(index), {rows}, at::kLong);
    return src.index_select(0, idx.clamp_min(0)).masked_fill_(idx.lt(0).unsqueeze(1), 0);
  }
  thread_local std::vector<char> scratch[2];
  char* const buf = torch_moe_cpu::aligned_scratch(scratch[slot], rows * bytes);
  const char* base = static_cast<const char*>(src.const_data_ptr());
  const int64_t row_step = ld * src.element_size();
  for (int64_t i = 0; i < rows; ++i) {
    char* o = buf + i * bytes;
    if (index[i] < 0) {
      std::memset(o, 0, bytes);
    } else {
      std::memcpy(o, base + index[i] * row_step, bytes);
    }
  }
  return at::from_blob(buf, {rows, n}, src.options());
}

// A piece's column-major a [K, rows] as a row-major copy in this thread's scratch (valid
// until its next call): the weight gradient's transposed operand one piece at a time,
// while the piece's GEMM is about to read it from the caches, where one copy of all of
// a^T ([K, M], rows of M elements) strides each group's block by the M of all groups (a
// page per row at M = 16384 bf16 on the AMX Xeon measured; oneDNN read it 20-30% slower
// than the same block packed: benchmarks/results/cpu_floor_cpu_202612.md). The leading
// dim is padded to a 64-byte multiple that is not one of 1 KiB (rows an L1 set apart
// each), the padding zeroed (oneDNN's AMX GEMM reads an element past an odd count).
at::Tensor row_major_copy(const at::Tensor& a) {
  const int64_t k = a.size(0), rows = a.size(1);
  int64_t ld = (rows + 31) / 32 * 32;
  if (ld % 512 == 0) ld += 32;
  thread_local std::vector<uint16_t> scratch;
  uint16_t* const buf = torch_moe_cpu::aligned_scratch(scratch, k * ld);
  auto out = at::from_blob(buf, {k, rows}, {ld, 1}, a.options());
  for (int64_t i = 0; i < k && ld > rows; ++i) {
    std::fill(buf + i * ld + rows, buf + (i + 1) * ld, 0);
  }
  const auto* src = static_cast<const uint16_t*>(a.const_data_ptr());
  if (k > 0 && rows > 0 &&
      !torch_moe_cpu::transpose16_into(src, a.stride(1), rows, k, buf, ld)) {
    out.copy_(a);
  }
  return out;
}

void threaded_grouped_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                         at::Tensor& out, bool split_rows, bool native_gemm,
                         const std::optional<at::Tensor>& x_index, bool stream_out,
                         bool upcast) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(1), "threaded_grouped_mm: "
              "x [M, K] and w [E, K, N] expected, got ", x.sizes(), " and ", w.sizes());
  const int64_t m = x_index.has_value() ? x_index->size(0) : x.size(0);
  TORCH_CHECK(upcast ? upcast_dtypes({x, w, out}) && !native_gemm
                     : w.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "threaded_grouped_mm: x, w and out must share a dtype (upcast: each fp32 or a "
              "16-bit float, no native_gemm), got ", x.scalar_type(), ", ", w.scalar_type(),
              " and ", out.scalar_type());
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == m &&
                  out.size(1) == w.size(2),
              "threaded_grouped_mm: out must be a contiguous [M, N] tensor");
  const int64_t* index = check_index(x_index, m, x.size(0), "threaded_grouped_mm", "x_index");
  const auto ends = read_ends(offs, w.size(0), m, "threaded_grouped_mm");
  const int64_t n = w.size(2);
  // the native GEMM streams its output where asked (the CPU probe's out_stream) and all of
  // it is past the L2
  const bool stream = stream_out && native_gemm && torch_moe_cpu::bf16_gemm_streams(out.nbytes());
  const bool direct = upcast && torch_moe_cpu::fp32_gemm_available();
  using torch_moe_cpu::Matrix;
  const Matrix out_m = Matrix::of(out), x_m = Matrix::of(x);
  split_groups(
      ends, [n](int64_t, int64_t) { return n; },
      [&](int64_t g, int64_t start, int64_t rows, int64_t lo, int64_t hi) {
        if (native_gemm) {  // (the pieces as Matrix views: no at::Tensor per piece)
          const Matrix o = out_m.block(start, rows, lo, hi - lo);
          const Matrix w_g = Matrix::of(w, g).col_range(lo, hi - lo);
          if (index == nullptr
                  ? torch_moe_cpu::bf16_gemm(o, x_m.row_range(start, rows), w_g, {}, {}, stream)
                  : torch_moe_cpu::bf16_gemm(o, x_m, w_g, {index + start, rows}, {}, stream)) {
            return;
          }
        }
        auto o = out.narrow(0, start, rows).narrow(1, lo, hi - lo);
        const auto w_g = w[g].narrow(1, lo, hi - lo);
        if (upcast) {
          mm_upcast(o, index ? gathered(x, index + start, rows, 0) : x.narrow(0, start, rows),
                    w_g, direct);
        } else if (index == nullptr) {  // (ATen's GEMM in one piece where the native one was asked)
          mm_rows(o, x.narrow(0, start, rows), w_g, split_rows && !native_gemm);
        } else {
          mm_rows(o, gathered(x, index + start, rows, 0), w_g, split_rows);
        }
      },
      native_gemm);
  const int64_t end = ends.empty() ? 0 : ends.back();
  if (end < out.size(0)) out.narrow(0, end, out.size(0) - end).zero_();
}

void threaded_grouped_mm_wgrad(const at::Tensor& a, const at::Tensor& dy,
                               const at::Tensor& offs, at::Tensor& out, bool native_gemm,
                               const std::optional<at::Tensor>& a_index,
                               const std::optional<at::Tensor>& dy_index, bool transpose_a,
                               bool stream_out, bool upcast) {
  const int64_t m = a_index.has_value() ? a_index->size(0) : a.dim() == 2 ? a.size(1) : -1;
  const int64_t m_dy = dy_index.has_value() ? dy_index->size(0) : dy.dim() == 2 ? dy.size(0) : -1;
  TORCH_CHECK(a.dim() == 2 && dy.dim() == 2 && m == m_dy,
              "threaded_grouped_mm_wgrad: a [K, M] and dy [M, N] expected, got ", a.sizes(),
              " and ", dy.sizes());
  TORCH_CHECK(upcast ? upcast_dtypes({a, dy, out}) && !native_gemm && !transpose_a
                     : dy.scalar_type() == a.scalar_type() && out.scalar_type() == a.scalar_type(),
              "threaded_grouped_mm_wgrad: a, dy and out must share a dtype (upcast: each fp32 "
              "or a 16-bit float, no native_gemm or transpose_a), got ", a.scalar_type(), ", ",
              dy.scalar_type(), " and ", out.scalar_type());
  TORCH_CHECK(out.dim() == 3 && out.is_contiguous() && out.size(0) == offs.size(0) &&
                  out.size(1) == a.size(0) && out.size(2) == dy.size(1),
              "threaded_grouped_mm_wgrad: out must be a contiguous [E, K, N] tensor");
  // a gathered: a is the transposed view [K, S] of the source of its M columns
  const int64_t* a_idx = check_index(a_index, m, a.size(1), "threaded_grouped_mm_wgrad", "a_index");
  const int64_t* dy_idx =
      check_index(dy_index, m, dy.size(0), "threaded_grouped_mm_wgrad", "dy_index");
  const auto ends = read_ends(offs, out.size(0), m, "threaded_grouped_mm_wgrad");
  for (int64_t g = 0, start = 0; g < out.size(0); start = ends[g], ++g) {
    if (ends[g] == start) out[g].zero_();
  }
  TORCH_CHECK(!transpose_a || (a.element_size() == 2 && (a.stride(0) == 1 || a.size(0) <= 1)),
              "threaded_grouped_mm_wgrad: transpose_a takes a column-major a of a 16-bit "
              "dtype, got strides ", a.strides(), " and ", a.scalar_type());
  const int64_t k = a.size(0);
  const bool stream = stream_out && native_gemm && torch_moe_cpu::bf16_gemm_streams(out.nbytes());
  const bool direct = upcast && torch_moe_cpu::fp32_gemm_available();
  using torch_moe_cpu::Matrix;
  const Matrix a_m = Matrix::of(a), dy_m = Matrix::of(dy);
  split_groups(
      ends, [k](int64_t, int64_t) { return k; },
      [&](int64_t g, int64_t start, int64_t rows, int64_t lo, int64_t hi) {
        if (native_gemm) {  // (the pieces as Matrix views: no at::Tensor per piece)
          const Matrix a_lo = a_m.row_range(lo, hi - lo);
          const torch_moe_cpu::Gather ga{a_idx ? a_idx + start : nullptr, rows, true};
          const torch_moe_cpu::Gather gd{dy_idx ? dy_idx + start : nullptr, rows};
          if (torch_moe_cpu::bf16_gemm(Matrix::of(out, g).row_range(lo, hi - lo),
                                       a_idx ? a_lo : a_lo.col_range(start, rows),
                                       dy_idx ? dy_m : dy_m.row_range(start, rows), ga, gd,
                                       stream)) {
            return;
          }
        }
        auto o = out[g].narrow(0, lo, hi - lo);
        const auto a_lo = a.narrow(0, lo, hi - lo);
        const auto a_g = a_idx ? a_lo : a_lo.narrow(1, start, rows);
        const auto dy_g = dy_idx ? dy : dy.narrow(0, start, rows);
        if (upcast) {
          mm_upcast(o, a_idx ? gathered(a_lo.t(), a_idx + start, rows, 0).t() : a_g,
                    dy_idx ? gathered(dy, dy_idx + start, rows, 1) : dy_g, direct);
        } else if (a_idx == nullptr && dy_idx == nullptr && !transpose_a) {
          at::mm_out(o, a_g, dy_g);
        } else {
          // ATen's GEMM on the piece's gathered rows (and a's row-major copy): scratch
          const auto a_rows = a_idx ? gathered(a_lo.t(), a_idx + start, rows, 0).t() : a_g;
          const auto dy_rows = dy_idx ? gathered(dy, dy_idx + start, rows, 1) : dy_g;
          at::mm_out(o, transpose_a ? row_major_copy(a_rows) : a_rows, dy_rows);
        }
      },
      native_gemm);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_moe_cpu, m) {
  m.def(
      "threaded_grouped_mm(Tensor x, Tensor w, Tensor offs, Tensor(a!) out, bool split_rows=False,"
      " bool native_gemm=False, Tensor? x_index=None, bool stream_out=False,"
      " bool upcast=False) -> ()");
  m.def(
      "threaded_grouped_mm_wgrad(Tensor a, Tensor dy, Tensor offs, Tensor(a!) out,"
      " bool native_gemm=False, Tensor? a_index=None, Tensor? dy_index=None,"
      " bool transpose_a=False, bool stream_out=False, bool upcast=False) -> ()");
  m.def("row_split_parts(int rows) -> int", &row_split_parts);
  m.def("upcast_cols() -> int", []() -> int64_t { return kUpcastCols; });
  m.def("upcast_in_scratch() -> bool", &upcast_in_scratch);
}

TORCH_LIBRARY_IMPL(torch_moe_cpu, CPU, m) {
  m.impl("threaded_grouped_mm", &threaded_grouped_mm);
  m.impl("threaded_grouped_mm_wgrad", &threaded_grouped_mm_wgrad);
}
