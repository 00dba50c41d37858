// Causal attention for small heads on the CPU (moetron.kernels.attention_cpu), fp32.
//
// Compiled through fma_kernels.cpp into the library of permute_cpu.cpp (moetron/kernels/cpp_build.py) and
// registered as torch.ops.moetron_attention.*.
//
//   forward:  s[i, j] = scale * q_i . k_j  (j <= i);  lse_i = log sum_j exp(s[i, j]);
//             out_i = sum_j exp(s[i, j] - lse_i) v_j
//   backward: p = exp(s - lse);  D_i = dout_i . out_i;  ds = scale * p * (dout_i . v_j - D_i)
//             dq_i = sum_j ds[i, j] k_j;  dk_j = sum_i ds[i, j] q_i;  dv_j = sum_i p[i, j] dout_i
//
// torch's CPU flash kernel tiles for long sequences: GEMM calls per block of 32 queries and 512 keys, a
// scores buffer and a softmax pass over it; at a small model's shapes those calls cost more than the
// arithmetic. Here one task is a (sequence, kv head): its query heads (GQA) run in turn over stripes of
// kStripe query rows against the keys up to the stripe's last row, and each product above is a small
// GEMM through one register tile (6 rows x 16 columns: twelve accumulators fed by two vector loads and
// six broadcasts a step; 6 x 8 for a head dim's last 8 columns) that reads q, k, v, dout and writes out,
// dq, dk, dv in place. q and k have one head dim, v another (MLA: 24 and 16 in the DeepSeek-V3 proxy). The heads that
// share a kv head add into its dk and dv in turn, so no two tasks write one row. Sums run in a different
// order from torch's kernel: results agree to a few ulp (tests/test_causal_attention.py), not bit for bit.
// A whole stripe's keys are read per stripe: past ~2k keys torch's kernel catches up (docs/performance.md).

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

#include "helper_tasks.h"  // run_tasks: tasks to whichever thread is free
#include "simd_math.h"     // after the pragma: its loops take the same options

namespace {

using at::Tensor;
using moetron::exp_poly;
using moetron::has_avx2_fma;  // the loops are compiled for AVX2+FMA and for the default target

constexpr int kLanes = 8;                // floats per vector
constexpr int kTileRows = 6;             // register tile: kTileRows x 2 vectors = 12 accumulators
constexpr int kTileCols = 2 * kLanes;    // padded key counts are multiples of it, head dims of kLanes
constexpr int64_t kMaxHeadDim = 128;     // measured against torch's flash kernel up to here
constexpr int64_t kStripe = 24;          // query rows per stripe (a stripe's scores stay in L2)
using moetron::exp8;
using moetron::lane_sum;
using moetron::load8;
using moetron::store8;
using moetron::vec8;

inline int64_t padded(int64_t n) { return (n + kTileCols - 1) / kTileCols * kTileCols; }

// The row stride of the [*, keys] buffers: padded, plus one tile so that it is never a multiple of a large
// power of two. A tile reads 16 floats from each of d consecutive rows; at a stride of 4096 floats those
// rows all map to a few cache sets and evict each other (q k^T at 4096 x 128: 29 -> 41 GFLOP/s).
inline int64_t row_stride(int64_t S) { return padded(S) + kTileCols; }

// A [B, heads, S, d] tensor's element (b, h, i, 0), the last dim contiguous.
struct View {
  float* p;
  int64_t sb, sh, ss;
  float* row(int64_t b, int64_t h, int64_t i) const { return p + b * sb + h * sh + i * ss; }
};

View view_of(const Tensor& t) {
  return {const_cast<float*>(t.const_data_ptr<float>()), t.stride(0), t.stride(1), t.stride(2)};
}

// c[m, 0:8V) = (Add ? c[m, 0:8V) : 0) + sum_{k<K} a(m, k) * b[k * ldb, 0:8V) for m < M, where a(m, k) is
// a[m * lda + k], or a[m + k * lda] when Trans; V = 2 vectors, or 1 for a head dim's last 8 columns.
template <int M, bool Add, bool Trans, int V = 2>
__attribute__((always_inline)) inline void tile(int64_t K, const float* __restrict a, int64_t lda,
                                                const float* __restrict b, int64_t ldb, float* __restrict c,
                                                int64_t ldc) {
  vec8 lo[M], hi[M];
#pragma GCC unroll 8  // the accumulators stay in registers (rolled, GCC keeps them in stack arrays)
  for (int m = 0; m < M; ++m) {
    lo[m] = Add ? load8(c + m * ldc) : vec8{};
    if constexpr (V == 2) hi[m] = Add ? load8(c + m * ldc + kLanes) : vec8{};
  }
  for (int64_t k = 0; k < K; ++k) {
    const vec8 b0 = load8(b + k * ldb), b1 = V == 2 ? load8(b + k * ldb + kLanes) : vec8{};
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const float x = Trans ? a[m + k * lda] : a[m * lda + k];
      lo[m] += x * b0;
      if constexpr (V == 2) hi[m] += x * b1;
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    store8(c + m * ldc, lo[m]);
    if constexpr (V == 2) store8(c + m * ldc + kLanes, hi[m]);
  }
}

// One row tile of `rows` (1 to kTileRows) rows, V vectors wide.
template <bool Add, bool Trans, int V>
__attribute__((always_inline)) inline void row_tile(int64_t rows, int64_t K, const float* a, int64_t lda,
                                                    const float* b, int64_t ldb, float* c, int64_t ldc) {
  switch (rows) {
    case 6: tile<6, Add, Trans, V>(K, a, lda, b, ldb, c, ldc); break;
    case 5: tile<5, Add, Trans, V>(K, a, lda, b, ldb, c, ldc); break;
    case 4: tile<4, Add, Trans, V>(K, a, lda, b, ldb, c, ldc); break;
    case 3: tile<3, Add, Trans, V>(K, a, lda, b, ldb, c, ldc); break;
    case 2: tile<2, Add, Trans, V>(K, a, lda, b, ldb, c, ldc); break;
    default: tile<1, Add, Trans, V>(K, a, lda, b, ldb, c, ldc); break;
  }
}

// Which of a causal product's tiles gemm() skips, with `diag` the stripe's first query row i0: the
// terms past a row tile's last query (keys j > i0 + m0 + rows - 1) are zero or unused, and a key tile's
// first keys j0 = m0 get nothing from the stripe's rows before j0 - i0.
enum class Causal { kNone, kColumns, kInner, kInnerFrom };

// c[M, N] = (Add ? c : 0) + a[M, K] b[K, N], a as in tile(), rows of b and c ldb and ldc apart; N a
// multiple of kLanes. Per row tile, kColumns computes only the columns (keys) up to its last query,
// kInner sums only the keys up to it, kInnerFrom only the stripe rows from its first key on.
template <bool Add, bool Trans = false, Causal Mask = Causal::kNone>
__attribute__((always_inline)) inline void gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda,
                                                const float* b, int64_t ldb, float* c, int64_t ldc,
                                                int64_t diag = 0) {
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
    const int64_t rows = std::min<int64_t>(kTileRows, M - m0);
    int64_t k0 = 0, k1 = K, n1 = N;
    if (Mask == Causal::kColumns) n1 = std::min(N, padded(diag + m0 + rows));
    if (Mask == Causal::kInner) k1 = std::min(K, diag + m0 + rows);
    if (Mask == Causal::kInnerFrom) k0 = std::min(K, std::max<int64_t>(0, m0 - diag));
    const float* at = a + (Trans ? m0 + k0 * lda : m0 * lda + k0);
    const float* bt = b + k0 * ldb;
    float* ct = c + m0 * ldc;
    int64_t n0 = 0;
    for (; n0 + kTileCols <= n1; n0 += kTileCols) row_tile<Add, Trans, 2>(rows, k1 - k0, at, lda, bt + n0, ldb, ct + n0, ldc);
    if (n0 < n1) row_tile<Add, Trans, 1>(rows, k1 - k0, at, lda, bt + n0, ldb, ct + n0, ldc);  // the last 8
  }
}

// One call's tensors and sizes.
struct Args {
  View q, k, v, out, grad, dq, dk, dv;
  float* lse;
  int64_t H, Hk, S, Dk, Dv;  // head dims: q and k Dk, v Dv
  float scale;
};

// A kv head's rows transposed to [D, Sp], zero past S: the b operand of q k^T and dout v^T.
__attribute__((always_inline)) inline void transpose(const View& x, int64_t b, int64_t hk, int64_t S, int64_t D,
                                                     int64_t Sp, float* __restrict xt) {
  for (int64_t j = 0; j < S; ++j) {
    const float* xj = x.row(b, hk, j);
    for (int64_t d = 0; d < D; ++d) xt[d * Sp + j] = xj[d];
  }
  for (int64_t d = 0; d < D; ++d) std::fill(xt + d * Sp + S, xt + (d + 1) * Sp, 0.0f);
}

// A kv head's rows copied to [S, D + 16]: the b operand of p v and ds k, read a 16-float column panel at a
// time down all the keys; the model's layout puts them Hk * D floats apart (1 KiB at the mid-size proxy),
// where the panel's lines share a few cache sets.
__attribute__((always_inline)) inline void pack_rows(const View& x, int64_t b, int64_t hk, int64_t S, int64_t D,
                                                     float* __restrict xc) {
  for (int64_t j = 0; j < S; ++j) std::memcpy(xc + j * (D + kTileCols), x.row(b, hk, j), D * sizeof(float));
}

// Scaled scores of n rows (row r's key limit i0 + r), then each row's probabilities and log-sum-exp; zeros
// from the diagonal to J = i0 + n, which the products after read.
__attribute__((always_inline)) inline void softmax_rows(float* __restrict s, int64_t Sp, int64_t i0, int64_t n,
                                                        float scale, float* __restrict lse, float* __restrict inv) {
  const int64_t J = i0 + n;
  for (int64_t r = 0; r < n; ++r) {
    float* __restrict sr = s + r * Sp;
    const int64_t last = i0 + r;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j <= last; ++j) {
      sr[j] *= scale;
      m = sr[j] > m ? sr[j] : m;
    }
    const int64_t L8 = (last + 1) / 8 * 8;
    vec8 sum8 = {};
    for (int64_t j = 0; j < L8; j += 8) {
      const vec8 p = exp8(load8(sr + j) - m);
      store8(sr + j, p);
      sum8 += p;
    }
    float sum = lane_sum(sum8);
    for (int64_t j = L8; j <= last; ++j) {
      sr[j] = exp_poly(sr[j] - m);
      sum += sr[j];
    }
    std::fill(sr + last + 1, sr + J, 0.0f);
    inv[r] = 1.0f / sum;
    lse[r] = m + std::log(sum);
  }
}

__attribute__((always_inline)) inline void forward_range(const Args& x, int64_t begin, int64_t end) {
  const int64_t S = x.S, Dk = x.Dk, Dv = x.Dv, Sp = row_stride(S), group = x.H / x.Hk;
  std::vector<float> kt(static_cast<size_t>(Dk * Sp)), s(static_cast<size_t>(kStripe * Sp));
  std::vector<float> vc(static_cast<size_t>(S * (Dv + kTileCols)));
  float inv[kStripe];
  for (int64_t t = begin; t < end; ++t) {
    const int64_t b = t / x.Hk, hk = t % x.Hk;
    transpose(x.k, b, hk, S, Dk, Sp, kt.data());
    pack_rows(x.v, b, hk, S, Dv, vc.data());
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      for (int64_t i0 = 0; i0 < S; i0 += kStripe) {
        const int64_t n = std::min(kStripe, S - i0), J = i0 + n;
        gemm<false, false, Causal::kColumns>(n, padded(J), Dk, x.q.row(b, h, i0), x.q.ss, kt.data(), Sp, s.data(),
                                             Sp, i0);
        softmax_rows(s.data(), Sp, i0, n, x.scale, x.lse + (b * x.H + h) * S + i0, inv);
        gemm<false, false, Causal::kInner>(n, Dv, J, s.data(), Sp, vc.data(), Dv + kTileCols, x.out.row(b, h, i0),
                                            x.out.ss, i0);
        for (int64_t r = 0; r < n; ++r) {
          float* o = x.out.row(b, h, i0 + r);
          for (int64_t d = 0; d < Dv; ++d) o[d] *= inv[r];
        }
      }
    }
  }
}

__attribute__((always_inline)) inline void backward_range(const Args& x, int64_t begin, int64_t end) {
  const int64_t S = x.S, Dk = x.Dk, Dv = x.Dv, Sp = row_stride(S), group = x.H / x.Hk;
  std::vector<float> kt(static_cast<size_t>(Dk * Sp)), vt(static_cast<size_t>(Dv * Sp));
  std::vector<float> s(static_cast<size_t>(kStripe * Sp)), ds(static_cast<size_t>(kStripe * Sp));
  std::vector<float> kc(static_cast<size_t>(S * (Dk + kTileCols)));
  for (int64_t t = begin; t < end; ++t) {
    const int64_t b = t / x.Hk, hk = t % x.Hk;
    transpose(x.k, b, hk, S, Dk, Sp, kt.data());
    transpose(x.v, b, hk, S, Dv, Sp, vt.data());
    pack_rows(x.k, b, hk, S, Dk, kc.data());
    for (int64_t j = 0; j < S; ++j) {
      std::fill(x.dk.row(b, hk, j), x.dk.row(b, hk, j) + Dk, 0.0f);
      std::fill(x.dv.row(b, hk, j), x.dv.row(b, hk, j) + Dv, 0.0f);
    }
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      for (int64_t i0 = 0; i0 < S; i0 += kStripe) {
        const int64_t n = std::min(kStripe, S - i0), J = i0 + n;
        gemm<false, false, Causal::kColumns>(n, padded(J), Dk, x.q.row(b, h, i0), x.q.ss, kt.data(), Sp, s.data(),
                                             Sp, i0);
        gemm<false, false, Causal::kColumns>(n, padded(J), Dv, x.grad.row(b, h, i0), x.grad.ss, vt.data(), Sp,
                                             ds.data(), Sp, i0);
        const float* lse = x.lse + (b * x.H + h) * S + i0;
        for (int64_t r = 0; r < n; ++r) {  // s -> p, dout . v -> ds
          float* __restrict pr = s.data() + r * Sp;
          float* __restrict dr = ds.data() + r * Sp;
          const float* gi = x.grad.row(b, h, i0 + r);
          const float* oi = x.out.row(b, h, i0 + r);
          float Di = 0.0f;
          for (int64_t d = 0; d < Dv; ++d) Di += gi[d] * oi[d];
          const float l = lse[r], sc = x.scale;
          const int64_t last = i0 + r;
          const int64_t L8 = (last + 1) / 8 * 8;
          for (int64_t j = 0; j < L8; j += 8) {
            const vec8 p = exp8(load8(pr + j) * sc - l);
            store8(pr + j, p);
            store8(dr + j, sc * p * (load8(dr + j) - Di));
          }
          for (int64_t j = L8; j <= last; ++j) {
            pr[j] = exp_poly(pr[j] * sc - l);
            dr[j] = sc * pr[j] * (dr[j] - Di);
          }
          std::fill(pr + last + 1, pr + J, 0.0f);
          std::fill(dr + last + 1, dr + J, 0.0f);
        }
        gemm<false, false, Causal::kInner>(n, Dk, J, ds.data(), Sp, kc.data(), Dk + kTileCols, x.dq.row(b, h, i0),
                                            x.dq.ss, i0);
        gemm<true, true, Causal::kInnerFrom>(J, Dk, n, ds.data(), Sp, x.q.row(b, h, i0), x.q.ss, x.dk.row(b, hk, 0),
                                              x.dk.ss, i0);
        gemm<true, true, Causal::kInnerFrom>(J, Dv, n, s.data(), Sp, x.grad.row(b, h, i0), x.grad.ss,
                                              x.dv.row(b, hk, 0), x.dv.ss, i0);
      }
    }
  }
}

MOETRON_FMA_TARGET void forward_fma(const Args& x, int64_t begin, int64_t end) { forward_range(x, begin, end); }
void forward_plain(const Args& x, int64_t begin, int64_t end) { forward_range(x, begin, end); }
MOETRON_FMA_TARGET void backward_fma(const Args& x, int64_t begin, int64_t end) { backward_range(x, begin, end); }
void backward_plain(const Args& x, int64_t begin, int64_t end) { backward_range(x, begin, end); }

void check(const Tensor& t, const char* name, int64_t B, int64_t heads, int64_t S, int64_t D) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 4,
              "moetron causal attention (cpp): ", name, " must be a float32 CPU tensor [B, heads, S, d], got ",
              t.scalar_type(), " ", t.sizes(), " on ", t.device());
  TORCH_CHECK(t.size(0) == B && t.size(1) == heads && t.size(2) == S && t.size(3) == D && t.stride(3) == 1,
              "moetron causal attention (cpp): ", name, " must be [", B, ", ", heads, ", ", S, ", ", D,
              "] with a contiguous last dim, got ", t.sizes(), " strides ", t.strides());
}

void check_lse(const Tensor& lse, int64_t B, int64_t H, int64_t S) {
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat && lse.numel() == B * H * S,
              "moetron causal attention (cpp): lse must be a contiguous float32 tensor of ", B * H * S, " elements");
}

void check_head_dim(int64_t D, const char* which) {
  TORCH_CHECK(D > 0 && D % kLanes == 0 && D <= kMaxHeadDim, "moetron causal attention (cpp): ", which, " head dim ", D,
              " is not a multiple of ", kLanes, " up to ", kMaxHeadDim,
              " (moetron.kernels.attention_cpu.applies says which run here)");
}

Args check_all(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), Dk = q.size(3), Hk = k.dim() == 4 ? k.size(1) : 0;
  const int64_t Dv = v.dim() == 4 ? v.size(3) : 0;
  check(q, "q", B, H, S, Dk);
  check(k, "k", B, Hk, S, Dk);
  check(v, "v", B, Hk, S, Dv);
  TORCH_CHECK(Hk > 0 && H % Hk == 0, "moetron causal attention (cpp): q's ", H, " heads are not a multiple of k's ", Hk);
  check_head_dim(Dk, "q/k");
  check_head_dim(Dv, "v");
  Args x{};
  x.q = view_of(q), x.k = view_of(k), x.v = view_of(v);
  x.H = H, x.Hk = Hk, x.S = S, x.Dk = Dk, x.Dv = Dv, x.scale = static_cast<float>(scale);
  return x;
}

// fn(task, task + 1) for every (sequence, kv head) task, each taken by the next free thread: the caller and
// `helpers` inter-op tasks, or torch's intra-op threads (helper_tasks.h).
template <typename Fn>
void run_tasks(int64_t n, int64_t helpers, const Fn& fn) {
  TORCH_CHECK(helpers >= 0, "moetron causal attention (cpp): helpers must be >= 0, got ", helpers);
  moetron::run_tasks(n, helpers, [&](int64_t t) { fn(t, t + 1); });
}

// Writes out (any [B, H, S, d] strides, last dim contiguous) and lse [B, H, S].
void causal_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor out, Tensor lse,
                    int64_t helpers) {
  Args x = check_all(q, k, v, scale);
  const int64_t B = q.size(0);
  check(out, "out", B, x.H, x.S, x.Dv);
  check_lse(lse, B, x.H, x.S);
  x.out = view_of(out), x.lse = lse.data_ptr<float>();
  run_tasks(B * x.Hk, helpers, [&](int64_t b, int64_t e) { (has_avx2_fma() ? forward_fma : forward_plain)(x, b, e); });
}

// Writes dq, dk, dv (any strides, last dim contiguous; dk and dv are overwritten, not added to).
void causal_backward(const Tensor& grad, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                     const Tensor& lse, double scale, Tensor dq, Tensor dk, Tensor dv, int64_t helpers) {
  Args x = check_all(q, k, v, scale);
  const int64_t B = q.size(0);
  check(grad, "grad", B, x.H, x.S, x.Dv);
  check(out, "out", B, x.H, x.S, x.Dv);
  check(dq, "dq", B, x.H, x.S, x.Dk);
  check(dk, "dk", B, x.Hk, x.S, x.Dk);
  check(dv, "dv", B, x.Hk, x.S, x.Dv);
  check_lse(lse, B, x.H, x.S);
  x.grad = view_of(grad), x.out = view_of(out), x.dq = view_of(dq), x.dk = view_of(dk), x.dv = view_of(dv);
  x.lse = const_cast<float*>(lse.const_data_ptr<float>());
  run_tasks(B * x.Hk, helpers,
            [&](int64_t b, int64_t e) { (has_avx2_fma() ? backward_fma : backward_plain)(x, b, e); });
}

}  // namespace

TORCH_LIBRARY(moetron_attention, m) {
  m.def("causal_forward(Tensor q, Tensor k, Tensor v, float scale, Tensor(a!) out, Tensor(b!) lse, int helpers=0) -> ()",
        &causal_forward);
  m.def("causal_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, "
        "Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, int helpers=0) -> ()",
        &causal_backward);
}
