// Fused token cross-entropy for fp32 CPU logits (moetron.kernels.cross_entropy_cpu, train.fusion=cpp).
//
// Compiled through fma_kernels.cpp into the library of permute_cpu.cpp (moetron/kernels/cpp_build.py) and
// registered as torch.ops.moetron_ce.*.
//
//   forward:  m = max_v x[n, v];  lse[n] = m + log(sum_v exp(x[n, v] - m));  loss[n] = lse[n] - x[n, y[n]]
//   backward: dx[n, v] = g * (exp(x[n, v] - lse[n]) - (v == y[n]))
//   rows whose label is ignore_index: loss 0, gradient 0.
//
// Why: torch's cross_entropy is log_softmax then nll_loss; it keeps the [N, V] log-probabilities for the
// backward, which writes their gradient and then the logits' (the default recipe's [1024, 256] logits:
// ~1.8 ms a step each way together on one thread). Here the forward reads each row twice in cache and
// keeps one float a row; the backward is one pass. exp is simd_math.h's (within 2 ulp of expf), so the
// loss and gradient differ from torch's in the last bits (bounds: tests/test_cross_entropy_cpu.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "simd_math.h"

namespace {

using at::Tensor;

void check_ce_args(const Tensor& logits, const Tensor& labels, const char* where) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "moetron cross_entropy (cpp) ", where, ": logits must be a float32 CPU tensor [N, V], got ",
              logits.scalar_type(), " ", logits.sizes(), " on ", logits.device());
  TORCH_CHECK(labels.device().is_cpu() && labels.dim() == 1 && labels.size(0) == logits.size(0) &&
                  labels.scalar_type() == at::kLong,
              "moetron cross_entropy (cpp) ", where, ": labels must be an int64 CPU tensor [N=", logits.size(0),
              "], got ", labels.scalar_type(), " ", labels.sizes());
}

int64_t ce_grain_rows(int64_t V) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(V, 1)); }

// One row's max and then its sum of exp(x - max), eight lanes at a time (the tail one by one).
__attribute__((always_inline)) inline float row_lse(const float* x, int64_t V) {
  using moetron::vec8;
  const int64_t V8 = V / 8 * 8;
  float m = -INFINITY;
  if (V8) {
    vec8 mv = moetron::load8(x);
    for (int64_t v = 8; v < V8; v += 8) {
      const vec8 xv = moetron::load8(x + v);
      mv = xv > mv ? xv : mv;
    }
    for (int i = 0; i < 8; ++i) m = std::max(m, mv[i]);
  }
  for (int64_t v = V8; v < V; ++v) m = std::max(m, x[v]);
  if (std::isinf(m)) return m;  // every logit -inf (lse -inf) or one +inf (lse +inf): as torch's, no NaN from inf - inf
  vec8 sv = {};
  for (int64_t v = 0; v < V8; v += 8) sv += moetron::exp8(moetron::load8(x + v) - m);
  float s = moetron::lane_sum(sv);
  for (int64_t v = V8; v < V; ++v) s += moetron::exp_poly(x[v] - m);
  return m + std::log(s);
}

__attribute__((always_inline)) inline void ce_forward_rows_vec(const float* x, const int64_t* y, float* lse, float* loss,
                                                            int64_t begin, int64_t end, int64_t V, int64_t ignore) {
  for (int64_t n = begin; n < end; ++n) {
    const float* row = x + n * V;
    lse[n] = row_lse(row, V);
    loss[n] = y[n] == ignore ? 0.0f : lse[n] - row[y[n]];
  }
}

__attribute__((always_inline)) inline void ce_backward_rows_vec(const float* x, const int64_t* y, const float* lse,
                                                             float g, float* dx, int64_t begin, int64_t end,
                                                             int64_t V, int64_t ignore) {
  const int64_t V8 = V / 8 * 8;
  for (int64_t n = begin; n < end; ++n) {
    const float* row = x + n * V;
    float* d = dx + n * V;
    if (y[n] == ignore) {
      std::fill(d, d + V, 0.0f);
      continue;
    }
    const float l = lse[n];
    for (int64_t v = 0; v < V8; v += 8) moetron::store8(d + v, moetron::exp8(moetron::load8(row + v) - l) * g);
    for (int64_t v = V8; v < V; ++v) d[v] = moetron::exp_poly(row[v] - l) * g;
    d[y[n]] -= g;
  }
}

MOETRON_FMA_TARGET void ce_forward_fma(const float* x, const int64_t* y, float* lse, float* loss, int64_t begin,
                                       int64_t end, int64_t V, int64_t ignore) {
  ce_forward_rows_vec(x, y, lse, loss, begin, end, V, ignore);
}
void ce_forward_rows(const float* x, const int64_t* y, float* lse, float* loss, int64_t begin, int64_t end,
                     int64_t V, int64_t ignore) {
  if (moetron::has_avx2_fma()) return ce_forward_fma(x, y, lse, loss, begin, end, V, ignore);
  ce_forward_rows_vec(x, y, lse, loss, begin, end, V, ignore);
}

MOETRON_FMA_TARGET void ce_backward_fma(const float* x, const int64_t* y, const float* lse, float g, float* dx,
                                        int64_t begin, int64_t end, int64_t V, int64_t ignore) {
  ce_backward_rows_vec(x, y, lse, g, dx, begin, end, V, ignore);
}
void ce_backward_rows(const float* x, const int64_t* y, const float* lse, float g, float* dx, int64_t begin,
                      int64_t end, int64_t V, int64_t ignore) {
  if (moetron::has_avx2_fma()) return ce_backward_fma(x, y, lse, g, dx, begin, end, V, ignore);
  ce_backward_rows_vec(x, y, lse, g, dx, begin, end, V, ignore);
}

// The labels' range, checked before any row is computed (torch's nll_loss raises the same way).
void ce_check_labels(const int64_t* y, int64_t N, int64_t V, int64_t ignore) {
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(y[n] == ignore || (y[n] >= 0 && y[n] < V), "moetron cross_entropy (cpp): label ", y[n], " of row ",
                n, " is out of range for ", V, " classes (and is not ignore_index ", ignore, ")");
  }
}

// (per-row losses [N], lse [N]); the caller sums the losses (torch.sum: one order for any thread count).
std::tuple<Tensor, Tensor> ce_forward(const Tensor& logits_in, const Tensor& labels_in, int64_t ignore_index) {
  check_ce_args(logits_in, labels_in, "forward");
  const Tensor logits = logits_in.contiguous(), labels = labels_in.contiguous();
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 || N == 0, "moetron cross_entropy (cpp): logits have no classes (V = 0)");
  const int64_t* y = labels.const_data_ptr<int64_t>();
  ce_check_labels(y, N, V, ignore_index);
  Tensor lse = at::empty({N}, logits.options()), loss = at::empty({N}, logits.options());
  const float* x = logits.const_data_ptr<float>();
  float *l = lse.data_ptr<float>(), *ls = loss.data_ptr<float>();
  at::parallel_for(0, N, ce_grain_rows(V), [&](int64_t begin, int64_t end) {
    ce_forward_rows(x, y, l, ls, begin, end, V, ignore_index);
  });
  return {loss, lse};
}

Tensor ce_backward(const Tensor& grad, const Tensor& logits_in, const Tensor& labels_in, const Tensor& lse_in,
                   int64_t ignore_index) {
  check_ce_args(logits_in, labels_in, "backward");
  TORCH_CHECK(grad.numel() == 1, "moetron cross_entropy (cpp) backward: grad must be the summed loss's, one value, "
              "got ", grad.sizes());
  const Tensor logits = logits_in.contiguous(), labels = labels_in.contiguous(), lse = lse_in.contiguous();
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.numel() == N, "moetron cross_entropy (cpp) backward: lse must "
              "be float32 [", N, "], got ", lse.scalar_type(), " ", lse.sizes());
  Tensor dx = at::empty({N, V}, logits.options());
  const float g = grad.item<float>();
  const float* x = logits.const_data_ptr<float>();
  const int64_t* y = labels.const_data_ptr<int64_t>();
  const float* l = lse.const_data_ptr<float>();
  float* d = dx.data_ptr<float>();
  at::parallel_for(0, N, ce_grain_rows(V), [&](int64_t begin, int64_t end) {
    ce_backward_rows(x, y, l, g, d, begin, end, V, ignore_index);
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY(moetron_ce, m) {
  m.def("forward(Tensor logits, Tensor labels, int ignore_index) -> (Tensor, Tensor)", &ce_forward);
  m.def("backward(Tensor grad, Tensor logits, Tensor labels, Tensor lse, int ignore_index) -> Tensor", &ce_backward);
}
