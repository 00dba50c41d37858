// Grouped GEMM for CPU tensors (moetron.moe.grouped_gemm, expert_backend "cpp").
//
// Built with permute_cpu.cpp and swiglu_cpu.cpp into one library by moetron/kernels/cpp_build.py and
// registered as torch.ops.moetron_gemm.grouped_mm. Rows arrive expert-major; `offsets [E]` are the
// cumulative row counts (the end row of each expert).
//
//   mode 0 (forward):       out[rows_e] = a[rows_e] @ b[e]^T     a [N,K], b [E,O,K] -> [N,O]
//   mode 1 (input grad):    out[rows_e] = a[rows_e] @ b[e]       a [N,O], b [E,O,K] -> [N,K]
//   mode 2 (weight grad):   out[e]      = a[rows_e]^T @ b[rows_e] a [N,O], b [N,K]  -> [E,O,K]
//
// Why: torch._grouped_mm on the CPU calls the BLAS once per expert with all threads, so every expert
// (a few hundred rows) is a parallel region of its own, whose threads meet at barriers many times a
// call; on a shared or oversubscribed machine a descheduled partner stalls each of them. Here one
// parallel region per call hands out pieces, in order, to whichever thread is free: whole experts
// first, then, for the last few experts' work, pieces of 128 rows (modes 0, 1) or 128 output rows
// (mode 2), so that the threads finish together; each piece is one single-threaded BLAS call (inside
// the parallel region the BLAS runs sequentially). With `helpers` > 0 (a small model that trains on one
// intra-op thread) the pieces go instead to the calling thread and that many tasks on torch's inter-op
// pool, and the caller never waits for a helper that has not started. No reduction is split, so every
// output element is summed as one BLAS call sums it: results equal per-expert matmuls
// (tests/test_moe_layer.py: within 1e-6, equal in practice), the same bits for any thread count.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "helper_tasks.h"  // run_tasks: pieces to whichever thread is free

namespace {

using at::Tensor;

std::vector<int64_t> row_ends(const Tensor& offsets, int64_t N) {
  TORCH_CHECK(offsets.dim() == 1, "moetron grouped_mm (cpp): offsets must be 1-D [E], got ", offsets.sizes());
  const Tensor offs = offsets.to(at::kCPU, at::kLong).contiguous();
  std::vector<int64_t> ends(offs.const_data_ptr<int64_t>(), offs.const_data_ptr<int64_t>() + offs.numel());
  int64_t prev = 0;
  for (int64_t end : ends) {
    TORCH_CHECK(end >= prev, "moetron grouped_mm (cpp): offsets must be non-decreasing");
    prev = end;
  }
  TORCH_CHECK(ends.empty() ? N == 0 : ends.back() == N, "moetron grouped_mm (cpp): offsets end at ",
              ends.empty() ? 0 : ends.back(), " but there are ", N, " rows");
  return ends;
}

// A piece of work: rows [r0, r1) of expert e (modes 0, 1) or its output rows [r0, r1) (mode 2).
struct Piece {
  int64_t e, r0, r1;
};

// Runs fn(piece) for every piece, each taken by the next free thread (helper_tasks.h).
template <typename Fn>
void run_pieces(const std::vector<Piece>& pieces, int64_t helpers, Fn fn) {
  moetron::run_tasks(static_cast<int64_t>(pieces.size()), helpers, [&](int64_t i) { fn(pieces[i]); });
}

// A view of contiguous `t`'s memory made without the dispatcher (narrow, select and t each pass through it:
// ~10 calls a piece, more than a small piece's arithmetic is worth); it lives for one BLAS call, within t's.
Tensor view_of(const Tensor& t, int64_t offset, at::IntArrayRef sizes, at::IntArrayRef strides) {
  return at::from_blob(static_cast<char*>(t.data_ptr()) + offset * t.element_size(), sizes, strides, t.options());
}

// Rows [start, end) cut into pieces of at most `step` rows, in equal parts, appended to `pieces`.
void cut(std::vector<Piece>& pieces, int64_t e, int64_t start, int64_t end, int64_t step) {
  const int64_t n = end - start, parts = (n + step - 1) / step;
  for (int64_t p = 0; p < parts; ++p) pieces.push_back({e, start + n * p / parts, start + n * (p + 1) / parts});
}

// Pieces are handed out in order: whole experts (up to kBigRows rows: a BLAS call is most efficient
// on many rows) while much work remains, then small pieces, so the threads finish close together.
constexpr int64_t kBigRows = 1024, kSmallRows = 128;

// The thread count the pieces are cut for: at least 2, so that one thread cuts them as two do. MKL's
// result for a row can depend on how many rows its call has, so a small model's run then gets the same
// bits with its helper and without (wide threads 2 or 1), and with one intra-op thread or two.
int64_t cut_threads(int64_t helpers, int64_t work) {
  return std::max<int64_t>(2, moetron::threads_for(helpers, work));
}

std::vector<int64_t> starts_of(const std::vector<int64_t>& ends) {
  std::vector<int64_t> starts(ends.size());
  for (size_t e = 0; e < ends.size(); ++e) starts[e] = e ? ends[e - 1] : 0;
  return starts;
}

Tensor rows_mm(const Tensor& a, const Tensor& b, const std::vector<int64_t>& ends, bool transpose_b, int64_t helpers) {
  const int64_t N = a.size(0), O = transpose_b ? b.size(1) : b.size(2);
  Tensor out = at::empty({N, O}, a.options());
  const std::vector<int64_t> starts = starts_of(ends);
  const int64_t tail = N - 4 * cut_threads(helpers, N) * kSmallRows;  // rows from here on go in small pieces
  std::vector<Piece> pieces;
  for (size_t e = 0; e < ends.size(); ++e) {
    const int64_t split = std::min(ends[e], std::max(starts[e], tail));
    cut(pieces, static_cast<int64_t>(e), starts[e], split, kBigRows);
    cut(pieces, static_cast<int64_t>(e), split, ends[e], kSmallRows);
  }
  const int64_t Ka = a.size(1), B1 = b.size(1), B2 = b.size(2);
  run_pieces(pieces, helpers, [&](const Piece& p) {
    const int64_t rows = p.r1 - p.r0, w0 = p.e * B1 * B2;
    Tensor o = view_of(out, p.r0 * O, {rows, O}, {O, 1});
    const Tensor w = transpose_b ? view_of(b, w0, {B2, B1}, {1, B2}) : view_of(b, w0, {B1, B2}, {B2, 1});
    at::cpu::mm_out(o, view_of(a, p.r0 * Ka, {rows, Ka}, {Ka, 1}), w);
  });
  return out;
}

Tensor weight_grad_mm(const Tensor& a, const Tensor& b, const std::vector<int64_t>& ends, int64_t helpers) {
  const int64_t E = static_cast<int64_t>(ends.size()), O = a.size(1), K = b.size(1);
  Tensor out = at::empty({E, O, K}, a.options());
  const std::vector<int64_t> starts = starts_of(ends);
  // whole experts while more than ~2 experts' work per thread remains, then pieces of 128 output rows
  const int64_t N = a.size(0), P = cut_threads(helpers, N);
  const int64_t tail = N - std::min<int64_t>(N, 2 * P * (N / std::max<int64_t>(E, 1)));
  std::vector<Piece> pieces;
  for (int64_t e = 0; e < E; ++e) {
    // an expert without rows gets a zero gradient: a piece too, so that the threads share the writes
    cut(pieces, e, 0, O, ends[e] == starts[e] || ends[e] <= tail ? O : kSmallRows);
  }
  run_pieces(pieces, helpers, [&](const Piece& p) {
    const int64_t rows = ends[p.e] - starts[p.e], outs = p.r1 - p.r0;
    Tensor o = view_of(out, (p.e * O + p.r0) * K, {outs, K}, {K, 1});
    if (rows == 0) return static_cast<void>(std::memset(o.data_ptr(), 0, outs * K * out.element_size()));
    at::cpu::mm_out(o, view_of(a, starts[p.e] * O + p.r0, {outs, rows}, {1, O}),
                    view_of(b, starts[p.e] * K, {rows, K}, {K, 1}));
  });
  return out;
}

Tensor grouped_mm(const Tensor& a_in, const Tensor& b_in, const Tensor& offsets, int64_t mode, int64_t helpers) {
  TORCH_CHECK(helpers >= 0, "moetron grouped_mm (cpp): helpers must be >= 0, got ", helpers);
  TORCH_CHECK(a_in.device().is_cpu() && b_in.device().is_cpu(), "moetron grouped_mm (cpp): CPU tensors only");
  TORCH_CHECK(a_in.scalar_type() == b_in.scalar_type(), "moetron grouped_mm (cpp): operands of one dtype, got ",
              a_in.scalar_type(), " and ", b_in.scalar_type());
  TORCH_CHECK(a_in.dim() == 2, "moetron grouped_mm (cpp): a must be 2-D [N, *], got ", a_in.sizes());
  const Tensor a = a_in.contiguous(), b = b_in.contiguous();
  const std::vector<int64_t> ends = row_ends(offsets, a.size(0));
  const int64_t E = static_cast<int64_t>(ends.size());
  if (mode == 0 || mode == 1) {
    const int64_t inner = mode == 0 ? 2 : 1;
    TORCH_CHECK(b.dim() == 3 && b.size(0) == E && b.size(inner) == a.size(1), "moetron grouped_mm (cpp) mode ",
                mode, ": b must be [E=", E, ", ", mode == 0 ? "O, K=" : "O=", a.size(1), mode == 0 ? "]" : ", K]",
                ", got ", b.sizes());
    return rows_mm(a, b, ends, mode == 0, helpers);
  }
  TORCH_CHECK(mode == 2, "moetron grouped_mm (cpp): mode must be 0, 1 or 2, got ", mode);
  TORCH_CHECK(b.dim() == 2 && b.size(0) == a.size(0), "moetron grouped_mm (cpp) mode 2: b must be [N=", a.size(0),
              ", K], got ", b.sizes());
  return weight_grad_mm(a, b, ends, helpers);
}

}  // namespace

TORCH_LIBRARY(moetron_gemm, m) {
  m.def("grouped_mm(Tensor a, Tensor b, Tensor offsets, int mode, int helpers=0) -> Tensor", &grouped_mm);
}
