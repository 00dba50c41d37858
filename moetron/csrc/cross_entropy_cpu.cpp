// Summed token cross-entropy of fp32 CPU logits (moetron.kernels.cross_entropy_cpu).
//
// Built with permute_cpu.cpp into one library by moetron/kernels/cpp_build.py on first use and
// registered as torch.ops.moetron_loss.*.
//
//   forward:  loss = sum over rows n with labels[n] != ignore of  lse_n - x[n, labels[n]],
//             lse_n = m_n + log sum_v exp(x[n, v] - m_n),  m_n = max_v x[n, v]
//   backward: d x[n, v] = g * (exp(x[n, v] - lse_n) - [v == labels[n]]), zero on ignored rows
//
// torch's log_softmax + nll_loss write and save a [N, V] log-probability tensor and pass over it
// again each way; here each row is read twice forward (max, then the exp sum) and twice backward
// (lse again, then the gradient), and only the logits and labels are kept. Row losses are summed in
// fp64 in row order (the same bits on any thread count); within a few ulp of torch
// (tests/test_cross_entropy_cpp.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// Without trapping math the compiler may if-convert exp_poly's clamp and vectorise the loops; fp-contract
// lets it fuse multiply-adds (this kernel promises a bound against torch, not its bits).
#pragma GCC optimize("no-trapping-math", "fp-contract=fast")

#include "simd_math.h"  // after the pragma: its loops take the same options

namespace {

using at::Tensor;
using moetron::exp_poly;

__attribute__((always_inline)) inline float row_lse(const float* __restrict x, int64_t V) {
  float m = x[0];
#pragma omp simd reduction(max : m)
  for (int64_t v = 1; v < V; ++v) m = x[v] > m ? x[v] : m;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t v = 0; v < V; ++v) sum += exp_poly(x[v] - m);
  return m + std::log(sum);
}

// Row losses of rows [b, e) (0 for ignored rows).
__attribute__((always_inline)) inline void forward_rows(const float* x, const int64_t* y, double* loss, int64_t b,
                                                        int64_t e, int64_t V, int64_t ignore) {
  for (int64_t n = b; n < e; ++n)
    loss[n] = y[n] == ignore ? 0.0 : static_cast<double>(row_lse(x + n * V, V) - x[n * V + y[n]]);
}

__attribute__((always_inline)) inline void backward_rows(const float* x, const int64_t* y, float g, float* dx,
                                                         int64_t b, int64_t e, int64_t V, int64_t ignore) {
  for (int64_t n = b; n < e; ++n) {
    float* __restrict d = dx + n * V;
    if (y[n] == ignore) {
      for (int64_t v = 0; v < V; ++v) d[v] = 0.0f;
      continue;
    }
    const float* __restrict xn = x + n * V;
    const float lse = row_lse(xn, V);
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) d[v] = g * exp_poly(xn[v] - lse);
    d[y[n]] -= g;
  }
}

MOETRON_FMA_TARGET void forward_fma(const float* x, const int64_t* y, double* loss, int64_t b, int64_t e, int64_t V,
                                    int64_t ignore) {
  forward_rows(x, y, loss, b, e, V, ignore);
}
void forward_plain(const float* x, const int64_t* y, double* loss, int64_t b, int64_t e, int64_t V, int64_t ignore) {
  forward_rows(x, y, loss, b, e, V, ignore);
}
MOETRON_FMA_TARGET void backward_fma(const float* x, const int64_t* y, float g, float* dx, int64_t b, int64_t e,
                                     int64_t V, int64_t ignore) {
  backward_rows(x, y, g, dx, b, e, V, ignore);
}
void backward_plain(const float* x, const int64_t* y, float g, float* dx, int64_t b, int64_t e, int64_t V,
                    int64_t ignore) {
  backward_rows(x, y, g, dx, b, e, V, ignore);
}

void check(const Tensor& logits, const Tensor& labels, int64_t ignore, const char* where) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.is_contiguous() && logits.size(1) > 0,
              "moetron cross-entropy (cpp) ", where, ": logits must be a contiguous float32 CPU tensor [N, V], got ",
              logits.scalar_type(), " ", logits.sizes(), " on ", logits.device());
  TORCH_CHECK(labels.device().is_cpu() && labels.scalar_type() == at::kLong && labels.dim() == 1 &&
                  labels.size(0) == logits.size(0) && labels.is_contiguous(),
              "moetron cross-entropy (cpp) ", where, ": labels must be a contiguous int64 CPU tensor [N=",
              logits.size(0), "], got ", labels.scalar_type(), " ", labels.sizes());
  const int64_t* y = labels.const_data_ptr<int64_t>();
  const int64_t V = logits.size(1);
  for (int64_t n = 0; n < labels.size(0); ++n)
    TORCH_CHECK(y[n] == ignore || (y[n] >= 0 && y[n] < V), "moetron cross-entropy (cpp) ", where, ": label ", y[n],
                " at row ", n, " is out of range for ", V, " classes (and is not the ignore index ", ignore, ")");
}

int64_t grain(int64_t V) { return std::max<int64_t>(1, 32768 / V); }

Tensor cross_entropy_forward(const Tensor& logits, const Tensor& labels, int64_t ignore) {
  check(logits, labels, ignore, "forward");
  const int64_t N = logits.size(0), V = logits.size(1);
  std::vector<double> rows(N);
  const float* x = logits.const_data_ptr<float>();
  const int64_t* y = labels.const_data_ptr<int64_t>();
  at::parallel_for(0, N, grain(V), [&](int64_t b, int64_t e) {
    (moetron::has_avx2_fma() ? forward_fma : forward_plain)(x, y, rows.data(), b, e, V, ignore);
  });
  double total = 0.0;
  for (double r : rows) total += r;  // row order: the same bits on any number of threads
  return at::scalar_tensor(static_cast<float>(total), logits.options());
}

Tensor cross_entropy_backward(const Tensor& grad, const Tensor& logits, const Tensor& labels, int64_t ignore) {
  check(logits, labels, ignore, "backward");
  TORCH_CHECK(grad.numel() == 1, "moetron cross-entropy (cpp) backward: grad must be one value, got ", grad.sizes());
  const int64_t N = logits.size(0), V = logits.size(1);
  Tensor dx = at::empty({N, V}, logits.options());
  const float g = grad.item<float>();
  const float* x = logits.const_data_ptr<float>();
  const int64_t* y = labels.const_data_ptr<int64_t>();
  float* d = dx.data_ptr<float>();
  at::parallel_for(0, N, grain(V), [&](int64_t b, int64_t e) {
    (moetron::has_avx2_fma() ? backward_fma : backward_plain)(x, y, g, d, b, e, V, ignore);
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY(moetron_loss, m) {
  m.def("cross_entropy_forward(Tensor logits, Tensor labels, int ignore_index) -> Tensor", &cross_entropy_forward);
  m.def("cross_entropy_backward(Tensor grad, Tensor logits, Tensor labels, int ignore_index) -> Tensor",
        &cross_entropy_backward);
}
