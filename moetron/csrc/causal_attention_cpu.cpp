// Causal attention for small heads on the CPU (moetron.kernels.attention_cpu), fp32.
//
// Compiled through fma_kernels.cpp into the library of permute_cpu.cpp (moetron/kernels/cpp_build.py) and
// registered as torch.ops.moetron_attention.*.
//
//   forward:  s[i, j] = scale * q_i . k_j  (j <= i);  lse_i = log sum_j exp(s[i, j]);
//             out_i = sum_j exp(s[i, j] - lse_i) v_j
//   backward: p = exp(s - lse);  D_i = dout_i . out_i;  ds = p * (dout_i . v_j - D_i)
//             dq_i = scale * sum_j ds[i, j] k_j;  dk_j = scale * sum_i ds[i, j] q_i;  dv_j = sum_i p[i, j] dout_i
//
// torch's CPU flash kernel tiles for large heads: GEMM calls per block of 32 queries, a scores
// buffer and a softmax pass over it. For a small head (d <= 64) those calls cost more than the
// arithmetic, so this kernel keeps one kv head's keys transposed in L1 and works on four query rows
// at a time with the head dimension a compile-time constant: each key load feeds four rows. One
// (sequence, kv head) per task: the heads that share it (GQA) add into its dk and dv in turn, so no
// two tasks write one row. Sums run in a different order from torch's kernel: results agree to a
// few ulp (tests/test_causal_attention.py), not bit for bit.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// Without trapping math the compiler may if-convert exp_poly's clamp and vectorise the loops; fp-contract
// lets it fuse multiply-adds (this kernel promises a bound against the reference, not its bits).
#pragma GCC optimize("no-trapping-math", "fp-contract=fast")

#include "simd_math.h"  // after the pragma: its loops take the same options

namespace {

using at::Tensor;
constexpr int kRows = 4;  // query rows per block: each key row loaded once feeds this many

using moetron::exp_poly;
using moetron::has_avx2_fma;  // the loops are compiled for AVX2+FMA and for the default target

// A [B, heads, S, d] tensor's element (b, h, i, 0), the last dim contiguous.
struct View {
  float* p;
  int64_t sb, sh, ss;
  float* row(int64_t b, int64_t h, int64_t i) const { return p + b * sb + h * sh + i * ss; }
};

View view_of(const Tensor& t) {
  return {const_cast<float*>(t.const_data_ptr<float>()), t.stride(0), t.stride(1), t.stride(2)};
}

constexpr int kLanes = 8;  // floats per vector; key buffers are padded to a multiple of it
typedef float vec __attribute__((vector_size(32)));  // GCC lowers it to two SSE registers without AVX

__attribute__((always_inline)) inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
__attribute__((always_inline)) inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

inline int64_t padded(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// The kRows query rows of a block (rows past the sequence point at zeros).
inline void block_rows(const View& t, int64_t b, int64_t h, int64_t i0, int n, const float* zeros,
                       const float* rows[kRows]) {
  for (int r = 0; r < kRows; ++r) rows[r] = r < n ? t.row(b, h, i0 + r) : zeros;
}

// Scaled scores of a block's rows against keys [0, J8): s[r * Sp + j] = scale * q_r . k_j, eight keys at
// a time in registers; kt is the kv head's keys transposed, [D, Sp], zero past S.
template <int D>
__attribute__((always_inline)) inline void scores(const float* const q[kRows], const float* __restrict kt, int64_t Sp,
                                                  int64_t J8, float scale, float* __restrict s) {
  float qs[kRows][D];
  for (int r = 0; r < kRows; ++r)
    for (int d = 0; d < D; ++d) qs[r][d] = q[r][d] * scale;
  for (int64_t j = 0; j < J8; j += kLanes) {
    vec a[kRows] = {};
    for (int d = 0; d < D; ++d) {
      const vec kd = load(kt + d * Sp + j);
      for (int r = 0; r < kRows; ++r) a[r] += qs[r][d] * kd;
    }
    for (int r = 0; r < kRows; ++r) store(s + r * Sp + j, a[r]);
  }
}

// acc[r] = sum_j p[r, j] x_j over keys [0, J): x_j a [*, D] row; p rows in s (zero past each row's diagonal).
template <int D>
__attribute__((always_inline)) inline void weighted_rows(const float* __restrict s, int64_t Sp, int64_t J,
                                                         const View& x, int64_t b, int64_t hk, vec acc[kRows][D / kLanes]) {
  for (int64_t j = 0; j < J; ++j) {
    const float* xj = x.row(b, hk, j);
    vec xv[D / kLanes];
    for (int c = 0; c < D / kLanes; ++c) xv[c] = load(xj + c * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const float p = s[r * Sp + j];
      for (int c = 0; c < D / kLanes; ++c) acc[r][c] += p * xv[c];
    }
  }
}

template <int D>
__attribute__((always_inline)) inline void transpose_keys(const View& k, int64_t b, int64_t hk, int64_t S, int64_t Sp,
                                                          float* __restrict kt) {
  for (int64_t j = 0; j < S; ++j) {
    const float* kj = k.row(b, hk, j);
    for (int d = 0; d < D; ++d) kt[d * Sp + j] = kj[d];
  }
  for (int d = 0; d < D; ++d) std::fill(kt + d * Sp + S, kt + (d + 1) * Sp, 0.0f);
}

template <int D>
__attribute__((always_inline)) inline void forward_group(const View& q, const View& k, const View& v, const View& out,
                                                         float* lse, int64_t b, int64_t hk, int64_t group, int64_t H,
                                                         int64_t S, float scale, float* kt, float* s,
                                                         const float* zeros) {
  const int64_t Sp = padded(S);
  transpose_keys<D>(k, b, hk, S, Sp, kt);
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    for (int64_t i0 = 0; i0 < S; i0 += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, S - i0));
      const int64_t J = i0 + n, J8 = padded(J);
      const float* qr[kRows];
      block_rows(q, b, h, i0, n, zeros, qr);
      scores<D>(qr, kt, Sp, J8, scale, s);
      float inv[kRows];
      for (int r = 0; r < kRows; ++r) {
        float* __restrict sr = s + r * Sp;
        const int64_t last = std::min<int64_t>(i0 + r, J - 1);  // padded rows: any finite row will do
        float m = sr[0];
#pragma omp simd reduction(max : m)
        for (int64_t j = 1; j <= last; ++j) m = sr[j] > m ? sr[j] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j <= last; ++j) {
          sr[j] = exp_poly(sr[j] - m);
          sum += sr[j];
        }
        for (int64_t j = last + 1; j < J8; ++j) sr[j] = 0.0f;
        inv[r] = 1.0f / sum;
        if (r < n) lse[(b * H + h) * S + i0 + r] = m + std::log(sum);
      }
      vec acc[kRows][D / kLanes] = {};
      weighted_rows<D>(s, Sp, J, v, b, hk, acc);
      for (int r = 0; r < n; ++r)
        for (int c = 0; c < D / kLanes; ++c) store(out.row(b, h, i0 + r) + c * kLanes, acc[r][c] * inv[r]);
    }
  }
}

template <int D>
__attribute__((always_inline)) inline void backward_group(const View& g, const View& q, const View& k, const View& v,
                                                          const View& out, const float* lse, const View& dq,
                                                          const View& dk, const View& dv, int64_t b, int64_t hk,
                                                          int64_t group, int64_t H, int64_t S, float scale, float* kt,
                                                          float* vt, float* s, float* dp, const float* zeros) {
  const int64_t Sp = padded(S);
  transpose_keys<D>(k, b, hk, S, Sp, kt);
  transpose_keys<D>(v, b, hk, S, Sp, vt);
  for (int64_t j = 0; j < S; ++j) {
    std::fill(dk.row(b, hk, j), dk.row(b, hk, j) + D, 0.0f);
    std::fill(dv.row(b, hk, j), dv.row(b, hk, j) + D, 0.0f);
  }
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    for (int64_t i0 = 0; i0 < S; i0 += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, S - i0));
      const int64_t J = i0 + n, J8 = padded(J);
      const float *qr[kRows], *gr[kRows];
      block_rows(q, b, h, i0, n, zeros, qr);
      block_rows(g, b, h, i0, n, zeros, gr);
      scores<D>(qr, kt, Sp, J8, scale, s);   // s: scaled scores
      scores<D>(gr, vt, Sp, J8, 1.0f, dp);   // dp: dout_i . v_j
      for (int r = 0; r < kRows; ++r) {
        float* __restrict sr = s + r * Sp;
        float* __restrict dr = dp + r * Sp;
        if (r >= n) {
          std::fill(sr, sr + J8, 0.0f);
          std::fill(dr, dr + J8, 0.0f);
          continue;
        }
        const float l = lse[(b * H + h) * S + i0 + r];
        const float* oi = out.row(b, h, i0 + r);
        float Di = 0.0f;
        for (int d = 0; d < D; ++d) Di += gr[r][d] * oi[d];
        const int64_t last = i0 + r;
#pragma omp simd
        for (int64_t j = 0; j <= last; ++j) {
          sr[j] = exp_poly(sr[j] - l);
          dr[j] = sr[j] * (dr[j] - Di);
        }
        for (int64_t j = last + 1; j < J8; ++j) sr[j] = dr[j] = 0.0f;
      }
      vec dqa[kRows][D / kLanes] = {};
      weighted_rows<D>(dp, Sp, J, k, b, hk, dqa);
      vec qv[kRows][D / kLanes], gv[kRows][D / kLanes];
      for (int r = 0; r < kRows; ++r)
        for (int c = 0; c < D / kLanes; ++c) {
          qv[r][c] = load(qr[r] + c * kLanes) * scale;
          gv[r][c] = load(gr[r] + c * kLanes);
        }
      for (int64_t j = 0; j < J; ++j) {  // dk_j += sum_r ds[r, j] scale q_r;  dv_j += sum_r p[r, j] dout_r
        float* dkr = dk.row(b, hk, j);
        float* dvr = dv.row(b, hk, j);
        vec dkj[D / kLanes], dvj[D / kLanes];
        for (int c = 0; c < D / kLanes; ++c) {
          dkj[c] = load(dkr + c * kLanes);
          dvj[c] = load(dvr + c * kLanes);
        }
        for (int r = 0; r < kRows; ++r) {
          const float ds = dp[r * Sp + j], p = s[r * Sp + j];
          for (int c = 0; c < D / kLanes; ++c) {
            dkj[c] += ds * qv[r][c];
            dvj[c] += p * gv[r][c];
          }
        }
        for (int c = 0; c < D / kLanes; ++c) {
          store(dkr + c * kLanes, dkj[c]);
          store(dvr + c * kLanes, dvj[c]);
        }
      }
      for (int r = 0; r < n; ++r)
        for (int c = 0; c < D / kLanes; ++c) store(dq.row(b, h, i0 + r) + c * kLanes, dqa[r][c] * scale);
    }
  }
}

template <int D>
__attribute__((always_inline)) inline void forward_range(const View& q, const View& k, const View& v, const View& out, float* lse,
                                  int64_t begin, int64_t end, int64_t Hk, int64_t group, int64_t S, float scale) {
  const int64_t Sp = padded(S);
  std::vector<float> kt(static_cast<size_t>(D) * Sp), s(static_cast<size_t>(kRows) * Sp), zeros(D, 0.0f);
  for (int64_t t = begin; t < end; ++t)
    forward_group<D>(q, k, v, out, lse, t / Hk, t % Hk, group, Hk * group, S, scale, kt.data(), s.data(),
                     zeros.data());
}

template <int D>
__attribute__((always_inline)) inline void backward_range(const View& g, const View& q, const View& k, const View& v, const View& out,
                                   const float* lse, const View& dq, const View& dk, const View& dv, int64_t begin,
                                   int64_t end, int64_t Hk, int64_t group, int64_t S, float scale) {
  const int64_t Sp = padded(S);
  std::vector<float> kt(static_cast<size_t>(D) * Sp), vt(static_cast<size_t>(D) * Sp), zeros(D, 0.0f);
  std::vector<float> s(static_cast<size_t>(kRows) * Sp), dp(static_cast<size_t>(kRows) * Sp);
  for (int64_t t = begin; t < end; ++t)
    backward_group<D>(g, q, k, v, out, lse, dq, dk, dv, t / Hk, t % Hk, group, Hk * group, S, scale, kt.data(),
                      vt.data(), s.data(), dp.data(), zeros.data());
}

template <int D>
MOETRON_FMA_TARGET void forward_fma(const View& q, const View& k, const View& v, const View& out, float* lse,
                                    int64_t begin, int64_t end, int64_t Hk, int64_t group, int64_t S, float scale) {
  forward_range<D>(q, k, v, out, lse, begin, end, Hk, group, S, scale);
}
template <int D>
void forward_plain(const View& q, const View& k, const View& v, const View& out, float* lse, int64_t begin,
                   int64_t end, int64_t Hk, int64_t group, int64_t S, float scale) {
  forward_range<D>(q, k, v, out, lse, begin, end, Hk, group, S, scale);
}
template <int D>
MOETRON_FMA_TARGET void backward_fma(const View& g, const View& q, const View& k, const View& v, const View& out,
                                     const float* lse, const View& dq, const View& dk, const View& dv, int64_t begin,
                                     int64_t end, int64_t Hk, int64_t group, int64_t S, float scale) {
  backward_range<D>(g, q, k, v, out, lse, dq, dk, dv, begin, end, Hk, group, S, scale);
}
template <int D>
void backward_plain(const View& g, const View& q, const View& k, const View& v, const View& out, const float* lse,
                    const View& dq, const View& dk, const View& dv, int64_t begin, int64_t end, int64_t Hk,
                    int64_t group, int64_t S, float scale) {
  backward_range<D>(g, q, k, v, out, lse, dq, dk, dv, begin, end, Hk, group, S, scale);
}

void check(const Tensor& t, const char* name, int64_t B, int64_t heads, int64_t S, int64_t D) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 4,
              "moetron causal attention (cpp): ", name, " must be a float32 CPU tensor [B, heads, S, d], got ",
              t.scalar_type(), " ", t.sizes(), " on ", t.device());
  TORCH_CHECK(t.size(0) == B && t.size(1) == heads && t.size(2) == S && t.size(3) == D && t.stride(3) == 1,
              "moetron causal attention (cpp): ", name, " must be [", B, ", ", heads, ", ", S, ", ", D,
              "] with a contiguous last dim, got ", t.sizes(), " strides ", t.strides());
}

int64_t check_all(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), Hk = k.dim() == 4 ? k.size(1) : 0;
  check(q, "q", B, H, S, D);
  check(k, "k", B, Hk, S, D);
  check(v, "v", B, Hk, S, D);
  TORCH_CHECK(Hk > 0 && H % Hk == 0, "moetron causal attention (cpp): q's ", H, " heads are not a multiple of k's ", Hk);
  TORCH_CHECK(D == 16 || D == 32 || D == 64, "moetron causal attention (cpp): head dim ", D,
              " is not one of 16, 32, 64 (moetron.kernels.attention_cpu.applies says which run here)");
  return D;
}

#define MOETRON_BY_HEAD_DIM(D, ...)                                                     \
  switch (D) {                                                                          \
    case 16: { constexpr int kD = 16; __VA_ARGS__; break; }                           \
    case 32: { constexpr int kD = 32; __VA_ARGS__; break; }                           \
    default: { constexpr int kD = 64; __VA_ARGS__; break; }                           \
  }

// Writes out (any [B, H, S, d] strides, last dim contiguous) and lse [B, H, S].
void causal_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor out, Tensor lse) {
  const int64_t D = check_all(q, k, v), B = q.size(0), H = q.size(1), S = q.size(2), Hk = k.size(1);
  check(out, "out", B, H, S, D);
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat && lse.numel() == B * H * S,
              "moetron causal attention (cpp): lse must be a contiguous float32 tensor of ", B * H * S, " elements");
  const View qv = view_of(q), kv = view_of(k), vv = view_of(v), ov = view_of(out);
  float* l = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  MOETRON_BY_HEAD_DIM(D, at::parallel_for(0, B * Hk, 1, [&](int64_t b, int64_t e) {
    (has_avx2_fma() ? forward_fma<kD> : forward_plain<kD>)(qv, kv, vv, ov, l, b, e, Hk, H / Hk, S, sc);
  }))
}

// Writes dq, dk, dv (any strides, last dim contiguous; dk and dv are overwritten, not added to).
void causal_backward(const Tensor& grad, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                     const Tensor& lse, double scale, Tensor dq, Tensor dk, Tensor dv) {
  const int64_t D = check_all(q, k, v), B = q.size(0), H = q.size(1), S = q.size(2), Hk = k.size(1);
  check(grad, "grad", B, H, S, D);
  check(out, "out", B, H, S, D);
  check(dq, "dq", B, H, S, D);
  check(dk, "dk", B, Hk, S, D);
  check(dv, "dv", B, Hk, S, D);
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat && lse.numel() == B * H * S,
              "moetron causal attention (cpp): lse must be a contiguous float32 tensor of ", B * H * S, " elements");
  const View gv = view_of(grad), qv = view_of(q), kv = view_of(k), vv = view_of(v), ov = view_of(out);
  const View dqv = view_of(dq), dkv = view_of(dk), dvv = view_of(dv);
  const float* l = lse.const_data_ptr<float>();
  const float sc = static_cast<float>(scale);
  MOETRON_BY_HEAD_DIM(D, at::parallel_for(0, B * Hk, 1, [&](int64_t b, int64_t e) {
    (has_avx2_fma() ? backward_fma<kD> : backward_plain<kD>)(gv, qv, kv, vv, ov, l, dqv, dkv, dvv, b, e, Hk, H / Hk,
                                                              S, sc);
  }))
}

}  // namespace

TORCH_LIBRARY(moetron_attention, m) {
  m.def("causal_forward(Tensor q, Tensor k, Tensor v, float scale, Tensor(a!) out, Tensor(b!) lse) -> ()",
        &causal_forward);
  m.def("causal_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, "
        "Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv) -> ()",
        &causal_backward);
}
