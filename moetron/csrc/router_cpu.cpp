// The softmax top-k router's selection and its backward, and the sigmoid (group-limited, biased) router's,
// for CPU tensors (moetron.kernels.fused_router, train.fusion "cpp"). Built with the other csrc files into
// one library by moetron/kernels/cpp_build.py and registered as torch.ops.moetron_router.*. Why: the eager
// router is ~25 small ops forward and ~15 backward per MoE layer (softmax twice, top-k, gather,
// normalisation, two expert counts, the Switch loss; DeepSeek-V3's: sigmoid, bias, the group scores' two
// top-k, a mask, the top-k, gather, normalisation, scaling, counts); in a small model each costs more
// than its arithmetic.
//
//   forward:  p = softmax(logits);  idx[t] = the k largest p[t, :], descending
//             (NaN first, ties to the lower expert);  w[t, j] = p[t, idx[t, j]], / (sum_j w[t, j] + 1e-20)
//             when normalised, * scale;  counts[e] = #(t, j) with idx[t, j] = e;  psum[e] = sum_t p[t, e]
//   backward: gw = grad_w * scale;  normalised: S = sum_j p[t, idx_j] + 1e-20,
//             dp[idx_j] = gw_j / S - (sum_i gw_i p[t, idx_i]) / S^2;  dp[t, e] += aux_e (the balancing
//             loss's gradient, the same for every token);  dlogits = p * (dp - sum_e p * dp)
//
// p is ATen's softmax (the eager router's bits) from 16 experts on; below 16 ATen's CPU kernel leaves its
// vectorised path ([1024, 8]: ~150 us, [1024, 16]: ~24 us on a 2-core EPYC), so the kernel computes it:
// the row's max, exp(x - max) with simd_math.h's exp_poly (within 2 ulp of expf), their sum in order, times
// 1 / sum, as ATen's vectorised path does; within a few ulp of ATen's.
// Rows run in order within a thread; psum adds fixed blocks of rows, then the blocks in order: the same
// bits on any thread count. The eager reference sums in other orders, so weights and gradients differ
// from it by a few ulp (the bound is tested in tests/test_fused_router.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "simd_math.h"  // exp_poly

namespace {

using at::Tensor;

constexpr int64_t kSumBlockRows = 64;  // psum / counts: rows per partial sum (fixed: results do not depend on threads)

bool before(float a, int64_t ia, float b, int64_t ib) {  // a ranks before b: NaN first, then larger, then lower id
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na != nb) return na;
  if (!na && a != b) return a > b;
  return ia < ib;
}

void check_logits(const Tensor& logits, int64_t k, const char* where) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous(),
              "moetron router (cpp) ", where, ": logits must be a contiguous float32 CPU tensor [T, E], got ",
              logits.scalar_type(), " ", logits.sizes(), " on ", logits.device());
  TORCH_CHECK(k >= 1 && k <= logits.size(1), "moetron router (cpp) ", where, ": top_k=", k, " must be in [1, E=",
              logits.size(1), "]");
}

constexpr int64_t kAtenSoftmaxFrom = 16;  // experts from which ATen's softmax runs vectorised

// softmax over the rows of contiguous [T, E] logits, E < kAtenSoftmaxFrom (see the top of the file).
Tensor small_softmax(const Tensor& logits) {
  const int64_t T = logits.size(0), E = logits.size(1);
  Tensor probs = at::empty({T, E}, logits.options());
  const float* x = logits.const_data_ptr<float>();
  float* p = probs.data_ptr<float>();
  at::parallel_for(0, T, 1024, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xt = x + t * E;
      float* pt = p + t * E;
      float m = xt[0];
      bool nan = false;
      for (int64_t e = 0; e < E; ++e) {
        m = xt[e] > m ? xt[e] : m;
        nan |= xt[e] != xt[e];
      }
      if (nan) {  // ATen's row: all NaN
        for (int64_t e = 0; e < E; ++e) pt[e] = NAN;
        continue;
      }
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        const float d = xt[e] - m;  // NaN for an infinite max: the row is NaN, as ATen's
        pt[e] = d < -87.0f ? std::exp(d) : moetron::exp_poly(d);  // expf below exp_poly's clamp: 0 at -inf
        sum += pt[e];
      }
      const float inv = 1.0f / sum;
      for (int64_t e = 0; e < E; ++e) pt[e] = pt[e] * inv;
    }
  });
  return probs;
}

// The k best of n candidates (value v(i), id i), in rank order, into out[0..k).
template <typename Value>
inline void top_k_of(int64_t n, int64_t k, const Value& v, int64_t* out) {
  int64_t m = 0;
  for (int64_t e = 0; e < n; ++e) {
    if (m == k && !before(v(e), e, v(out[k - 1]), out[k - 1])) continue;
    int64_t j = m < k ? m++ : k - 1;
    while (j > 0 && before(v(e), e, v(out[j - 1]), out[j - 1])) {
      out[j] = out[j - 1];
      --j;
    }
    out[j] = e;
  }
}

// w[j] = p[idx[j]], / (their sum in order + 1e-20) when normalised, * scale; counts[idx[j]] += 1.
inline void write_weights(const float* p, const int64_t* it, int64_t k, bool normalize, float scale, float* wt,
                          int64_t* counts) {
  float total = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    wt[j] = p[it[j]];
    total += wt[j];
    ++counts[it[j]];
  }
  for (int64_t j = 0; j < k; ++j) {
    if (normalize) wt[j] = wt[j] / (total + 1e-20f);
    if (scale != 1.0f) wt[j] = wt[j] * scale;
  }
}

// write_weights' backward: d[idx_j] += d w_j / d p[idx_j] applied to g (gw = g * scale; normalised, with
// S = sum_j p[idx_j] + 1e-20: gw_j / S - (sum_i gw_i p[idx_i]) / S^2).
inline void add_weights_grad(const float* p, const int64_t* it, const float* g, int64_t k, bool normalize,
                             float scale, float* d) {
  if (!normalize) {
    for (int64_t j = 0; j < k; ++j) d[it[j]] += g[j] * scale;
    return;
  }
  float total = 0.0f, dot = 0.0f;
  for (int64_t j = 0; j < k; ++j) total += p[it[j]];
  total += 1e-20f;
  for (int64_t j = 0; j < k; ++j) dot += (g[j] * scale) * p[it[j]];
  const float common = -dot / (total * total);
  for (int64_t j = 0; j < k; ++j) d[it[j]] += (g[j] * scale) / total + common;
}

// logits [T, E] -> probs [T, E], idx [T, k] int64, weights [T, k], counts [E] int64, prob_sums [E].
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> topk_softmax_forward(const Tensor& logits, int64_t k,
                                                                         bool normalize, double scale) {
  check_logits(logits, k, "forward");
  const int64_t T = logits.size(0), E = logits.size(1);
  const Tensor probs = logits.size(1) < kAtenSoftmaxFrom ? small_softmax(logits) : at::_softmax(logits, 1, false);
  Tensor idx = at::empty({T, k}, logits.options().dtype(at::kLong));
  Tensor weights = at::empty({T, k}, logits.options());
  const int64_t blocks = std::max<int64_t>(1, (T + kSumBlockRows - 1) / kSumBlockRows);
  Tensor part_sums = at::zeros({blocks, E}, logits.options());
  Tensor part_counts = at::zeros({blocks, E}, logits.options().dtype(at::kLong));
  const float* pp = probs.const_data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  float* sp = part_sums.data_ptr<float>();
  int64_t* cp = part_counts.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      float* sums = sp + blk * E;
      int64_t* counts = cp + blk * E;
      for (int64_t t = blk * kSumBlockRows; t < std::min(T, (blk + 1) * kSumBlockRows); ++t) {
        const float* p = pp + t * E;
        int64_t* it = ip + t * k;
        float* wt = wp + t * k;
        for (int64_t e = 0; e < E; ++e) sums[e] += p[e];
        top_k_of(E, k, [&](int64_t e) { return p[e]; }, it);
        write_weights(p, it, k, normalize, fscale, wt, counts);
      }
    }
  });
  Tensor prob_sums = at::empty({E}, logits.options());
  Tensor counts = at::empty({E}, logits.options().dtype(at::kLong));
  float* ps = prob_sums.data_ptr<float>();
  int64_t* cs = counts.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e) {
    ps[e] = sp[e];
    cs[e] = cp[e];
  }
  for (int64_t blk = 1; blk < blocks; ++blk)
    for (int64_t e = 0; e < E; ++e) {
      ps[e] += sp[blk * E + e];
      cs[e] += cp[blk * E + e];
    }
  return {probs, idx, weights, counts, prob_sums};
}

// grad_weights [T, k] (any strides), probs [T, E], idx [T, k], aux [E] float32 or undefined -> dlogits [T, E].
Tensor topk_softmax_backward(const Tensor& grad_in, const Tensor& probs, const Tensor& idx, bool normalize,
                             double scale, const c10::optional<Tensor>& aux_in) {
  check_logits(probs, idx.size(1), "backward");
  const int64_t T = probs.size(0), E = probs.size(1), k = idx.size(1);
  const Tensor grad = grad_in.contiguous();
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.sizes() == idx.sizes() && idx.scalar_type() == at::kLong &&
                  idx.is_contiguous() && idx.size(0) == T,
              "moetron router (cpp) backward: grad must be float32 ", idx.sizes(), " like idx [T=", T, ", k], got ",
              grad.scalar_type(), " ", grad.sizes());
  const Tensor aux = aux_in.has_value() && aux_in->defined() ? aux_in->contiguous() : Tensor();
  TORCH_CHECK(!aux.defined() || (aux.scalar_type() == at::kFloat && aux.numel() == E),
              "moetron router (cpp) backward: aux must be float32 [E=", E, "]");
  Tensor dlogits = at::empty({T, E}, probs.options());
  const float* gp = grad.const_data_ptr<float>();
  const float* pp = probs.const_data_ptr<float>();
  const int64_t* ip = idx.const_data_ptr<int64_t>();
  const float* ap = aux.defined() ? aux.const_data_ptr<float>() : nullptr;
  float* dp_out = dlogits.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, T, std::max<int64_t>(1, 4096 / std::max<int64_t>(E, 1)), [&](int64_t b, int64_t e_end) {
    std::vector<float> dp(E);
    for (int64_t t = b; t < e_end; ++t) {
      const float* p = pp + t * E;
      const int64_t* it = ip + t * k;
      const float* g = gp + t * k;
      for (int64_t e = 0; e < E; ++e) dp[e] = ap ? ap[e] : 0.0f;
      add_weights_grad(p, it, g, k, normalize, fscale, dp.data());
      float inner = 0.0f;
      for (int64_t e = 0; e < E; ++e) inner += p[e] * dp[e];
      float* out = dp_out + t * E;
      for (int64_t e = 0; e < E; ++e) out[e] = p[e] * (dp[e] - inner);
    }
  });
  return dlogits;
}

// --- the sigmoid router (DeepSeek-V3) -------------------------------------------------------------
//
//   forward:  c = s + bias (s = sigmoid(logits), ATen's, passed in; bias when given); with G > 1 groups of
//             E/G experts, group g scores the sum of its two largest c (the larger first) and only the
//             topk_groups best groups keep their experts (the rest rank as -inf); idx[t] = the k largest
//             kept c[t, :], descending (NaN first, ties to the lower expert or group);
//             w[t, j] = s[t, idx[t, j]], / (sum_j w[t, j] + 1e-20) when normalised, * scale; counts
//   backward: d s, zero but at idx: gw = grad_w * scale; normalised, with S = sum_j s[idx_j] + 1e-20,
//             ds[idx_j] = gw_j / S - (sum_i gw_i s[idx_i]) / S^2 (torch's sigmoid backward then takes it)

// scores [T, E] -> weights [T, k], idx [T, k] int64, counts [E] int64.
std::tuple<Tensor, Tensor, Tensor> topk_sigmoid_forward(const Tensor& scores, const c10::optional<Tensor>& bias_in,
                                                         int64_t k, int64_t groups, int64_t topk_groups,
                                                         bool normalize, double scale) {
  check_logits(scores, k, "sigmoid forward");
  const int64_t T = scores.size(0), E = scores.size(1);
  TORCH_CHECK(groups >= 1 && E % groups == 0 && topk_groups >= 1 && topk_groups <= groups &&
                  k <= topk_groups * (E / groups),
              "moetron router (cpp) sigmoid forward: ", groups, " groups of E=", E, " experts, top ", topk_groups,
              " of them and top_k=", k, " do not fit (E a multiple of the groups, top_k <= the kept experts)");
  const Tensor bias = bias_in.has_value() && bias_in->defined() ? bias_in->contiguous() : Tensor();
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.numel() == E && bias.device().is_cpu()),
              "moetron router (cpp) sigmoid forward: the expert bias must be a float32 CPU tensor [E=", E, "]");
  Tensor idx = at::empty({T, k}, scores.options().dtype(at::kLong));
  Tensor weights = at::empty({T, k}, scores.options());
  const int64_t blocks = std::max<int64_t>(1, (T + kSumBlockRows - 1) / kSumBlockRows);
  Tensor part_counts = at::zeros({blocks, E}, scores.options().dtype(at::kLong));
  const float* sp = scores.const_data_ptr<float>();
  const float* bp = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  int64_t* ip = idx.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  int64_t* cp = part_counts.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  const int64_t per_group = E / groups, top2 = std::min<int64_t>(2, per_group);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> c(E), group_score(groups);
    std::vector<int64_t> best(std::max<int64_t>(topk_groups, top2));
    std::vector<char> kept(groups);
    for (int64_t blk = b0; blk < b1; ++blk) {
      int64_t* counts = cp + blk * E;
      for (int64_t t = blk * kSumBlockRows; t < std::min(T, (blk + 1) * kSumBlockRows); ++t) {
        const float* st = sp + t * E;
        for (int64_t e = 0; e < E; ++e) c[e] = bp ? st[e] + bp[e] : st[e];
        if (groups > 1) {
          for (int64_t g = 0; g < groups; ++g) {
            const float* cg = c.data() + g * per_group;
            top_k_of(per_group, top2, [&](int64_t i) { return cg[i]; }, best.data());
            group_score[g] = top2 == 2 ? cg[best[0]] + cg[best[1]] : cg[best[0]];
          }
          top_k_of(groups, topk_groups, [&](int64_t g) { return group_score[g]; }, best.data());
          std::fill(kept.begin(), kept.end(), 0);
          for (int64_t j = 0; j < topk_groups; ++j) kept[best[j]] = 1;
          for (int64_t g = 0; g < groups; ++g)
            if (!kept[g]) std::fill(c.begin() + g * per_group, c.begin() + (g + 1) * per_group, -INFINITY);
        }
        int64_t* it = ip + t * k;
        top_k_of(E, k, [&](int64_t e) { return c[e]; }, it);
        write_weights(st, it, k, normalize, fscale, wp + t * k, counts);
      }
    }
  });
  Tensor counts = part_counts.sum(0);
  return {weights, idx, counts};
}

// grad_weights [T, k] (any strides), scores [T, E], idx [T, k] -> d scores [T, E].
Tensor topk_sigmoid_backward(const Tensor& grad_in, const Tensor& scores, const Tensor& idx, bool normalize,
                             double scale) {
  check_logits(scores, idx.size(1), "sigmoid backward");
  const int64_t T = scores.size(0), E = scores.size(1), k = idx.size(1);
  const Tensor grad = grad_in.contiguous();
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.sizes() == idx.sizes() && idx.scalar_type() == at::kLong &&
                  idx.is_contiguous() && idx.size(0) == T,
              "moetron router (cpp) sigmoid backward: grad must be float32 ", idx.sizes(), " like idx [T=", T,
              ", k], got ", grad.scalar_type(), " ", grad.sizes());
  Tensor dscores = at::zeros({T, E}, scores.options());
  const float* gp = grad.const_data_ptr<float>();
  const float* sp = scores.const_data_ptr<float>();
  const int64_t* ip = idx.const_data_ptr<int64_t>();
  float* dp = dscores.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, T, std::max<int64_t>(1, 4096 / std::max<int64_t>(E, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* s = sp + t * E;
      const int64_t* it = ip + t * k;
      const float* g = gp + t * k;
      float* out = dp + t * E;
      add_weights_grad(s, it, g, k, normalize, fscale, out);
    }
  });
  return dscores;
}

}  // namespace

TORCH_LIBRARY(moetron_router, m) {
  m.def("topk_softmax_forward(Tensor logits, int k, bool normalize, float scale) -> (Tensor, Tensor, Tensor, Tensor, "
        "Tensor)",
        &topk_softmax_forward);
  m.def("topk_softmax_backward(Tensor grad, Tensor probs, Tensor idx, bool normalize, float scale, Tensor? aux) -> "
        "Tensor",
        &topk_softmax_backward);
  m.def("topk_sigmoid_forward(Tensor scores, Tensor? bias, int k, int groups, int topk_groups, bool normalize, "
        "float scale) -> (Tensor, Tensor, Tensor)",
        &topk_sigmoid_forward);
  m.def("topk_sigmoid_backward(Tensor grad, Tensor scores, Tensor idx, bool normalize, float scale) -> Tensor",
        &topk_sigmoid_backward);
}
