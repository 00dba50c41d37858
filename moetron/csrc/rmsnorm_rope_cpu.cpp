// RMSNorm and halves-layout RoPE for CPU tensors (moetron.ops.functional, train.fusion "cpp").
//
// Built with the other csrc files into one library by moetron/kernels/cpp_build.py and registered as
// torch.ops.moetron_norm.*. Why: in a small model these are 10-20 tiny eager ops each way, and on a
// CPU every op costs more than its arithmetic (a 4-layer, H=64 model spent ~25 % of its step in them).
//
//   rms_forward:   rstd[r] = 1 / sqrt(mean_h x[r,h]^2 + eps);  y = w * (x * rstd)
//   rms_backward:  n = x * rstd;  g = dy * w;  dx = rstd * (g - n * mean_h(g * n));  dw = sum_r dy * n
//   rope:          halves layout, out[i] = x[i] c[i] - x[i+d/2] s[i],  out[i+d/2] = x[i+d/2] c[i+d/2] + x[i] s[i+d/2]
//   rope (backward, transpose=true): dx[i] = g[i] c[i] + g[i+d/2] s[i+d/2],  dx[i+d/2] = g[i+d/2] c[i+d/2] - g[i] s[i]
//   rope (interleaved=true, DeepSeek's): the same with x's pair (x[2i], x[2i+1]) in place of (x[i], x[i+d/2]),
//                  the output in halves layout; its backward writes dx[2i], dx[2i+1]
//
// RoPE equals the torch reference bit for bit (the same two products and one add per element; no FMA:
// cpp_build.py compiles with -ffp-contract=off). RMSNorm sums its squares in 8 fixed lanes, so rstd and
// the results differ from torch's by a few ulp (the bound is tested in tests/test_norm_rope_cpp.py).
// Rows go in logical order whatever the layout (a sequence-first [S, B, H] view under tensor parallel
// gives each row the bits a contiguous [B, S, H] one does); dw sums fixed blocks of rows, then the
// blocks in order: the same bits on any thread count.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

constexpr int64_t kBlockRows = 64;  // dw: rows per partial sum (fixed: results do not depend on threads)

int64_t grain_rows(int64_t H) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)); }

// Logical row r (row-major over the leading dims) of a tensor with unit stride on its last dim -> the
// element offset of its first element. Rows are taken in logical order whatever the memory layout, so a
// [S, B, H]-strided input (tensor parallel) gives each row the same bits as a contiguous [B, S, H] one.
struct Rows {
  std::vector<int64_t> sizes, strides;
  int64_t step = -1;  // rows evenly spaced `step` elements apart (e.g. contiguous x), else -1
  explicit Rows(const Tensor& t) : sizes(t.sizes().begin(), t.sizes().end() - 1),
                                   strides(t.strides().begin(), t.strides().end() - 1) {
    // A row's offset is then r * step: no division per row (a small norm's rows cost more in them
    // than in their arithmetic).
    step = strides.empty() ? 0 : strides.back();
    int64_t expected = step;
    for (int64_t i = static_cast<int64_t>(sizes.size()) - 1; i >= 0; --i) {
      if (sizes[i] > 1 && strides[i] != expected) {
        step = -1;
        break;
      }
      expected *= sizes[i];
    }
  }
  int64_t offset(int64_t r) const {
    if (step >= 0) return r * step;
    int64_t off = 0;
    for (int64_t i = static_cast<int64_t>(sizes.size()) - 1; i >= 0; --i) {
      off += (r % sizes[i]) * strides[i];
      r /= sizes[i];
    }
    return off;
  }
};

void check_norm(const Tensor& x, const Tensor& w, const char* where) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.stride(-1) == 1, "moetron rms_norm (cpp) ", where,
              ": x must be a CPU tensor with unit stride on its last dim, got ", x.sizes(), " strides ", x.strides(),
              " on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, "moetron rms_norm (cpp) ", where,
              ": float32 or float64 only, got ", x.scalar_type());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1) && w.scalar_type() == x.scalar_type() && w.is_contiguous(),
              "moetron rms_norm (cpp) ", where, ": weight must be contiguous [H=", x.size(-1), "] of ", x.scalar_type(),
              ", got ", w.scalar_type(), " ", w.sizes());
}

// Row reductions in 8 fixed lanes (element h goes to lane h % 8), then the lanes in a fixed order: the
// same bits wherever the row sits in memory (a compiler's SIMD reduction may peel a misaligned start).
constexpr int64_t kLanes = 8;

template <typename T>
inline T combine_lanes(const T* acc) {
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

template <typename T>
inline T row_sum_sq(const T* __restrict x, int64_t H) {
  T acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t h = 0;
  for (; h + kLanes <= H; h += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += x[h + j] * x[h + j];
  for (int64_t j = 0; h + j < H; ++j) acc[j] += x[h + j] * x[h + j];
  return combine_lanes(acc);
}

template <typename T>
inline T row_dot_scaled(const T* __restrict g, const T* __restrict w, const T* __restrict x, T rstd, int64_t H) {
  T acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t h = 0;
  for (; h + kLanes <= H; h += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += (g[h + j] * w[h + j]) * (x[h + j] * rstd);
  for (int64_t j = 0; h + j < H; ++j) acc[j] += (g[h + j] * w[h + j]) * (x[h + j] * rstd);
  return combine_lanes(acc);
}

// One row each (the loops over rows below call them); the fp32 versions are also compiled for AVX2 and picked at load time (GCC's
// target_clones), since the default x86-64 target vectorises only 4 lanes wide.
template <typename T>
inline T rms_forward_row(const T* __restrict x, const T* __restrict w, T* __restrict y, int64_t H, double eps) {
  const T s = T(1) / std::sqrt(row_sum_sq(x, H) / static_cast<T>(H) + static_cast<T>(eps));
#pragma omp simd
  for (int64_t h = 0; h < H; ++h) y[h] = w[h] * (x[h] * s);
  return s;
}

template <typename T>
inline void rms_backward_row(const T* __restrict g, const T* __restrict x, const T* __restrict w, T s,
                             T* __restrict dx, int64_t H) {
  const T mean = row_dot_scaled(g, w, x, s, H) / static_cast<T>(H);
#pragma omp simd
  for (int64_t h = 0; h < H; ++h) dx[h] = s * (g[h] * w[h] - (x[h] * s) * mean);
}

template <typename T>
inline void rms_wgrad_row(const T* __restrict g, const T* __restrict x, T s, T* __restrict part, int64_t H) {
#pragma omp simd
  for (int64_t h = 0; h < H; ++h) part[h] += g[h] * (x[h] * s);
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MOETRON_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MOETRON_CLONES
#endif

// Loops over rows [b, e): one call per chunk, so each row's loops are inlined into the AVX2 clone.
template <typename T>
inline void rms_forward_rows(const T* x, const Rows& xr, const T* w, T* y, const Rows& yr, T* rstd, int64_t b,
                             int64_t e, int64_t H, double eps) {
  for (int64_t r = b; r < e; ++r) rstd[r] = rms_forward_row<T>(x + xr.offset(r), w, y + yr.offset(r), H, eps);
}

template <typename T>
inline void rms_backward_rows(const T* g, const Rows& gr, const T* x, const Rows& xr, const T* w, const T* rstd,
                              T* dx, const Rows& dr, int64_t b, int64_t e, int64_t H) {
  for (int64_t r = b; r < e; ++r) rms_backward_row<T>(g + gr.offset(r), x + xr.offset(r), w, rstd[r], dx + dr.offset(r), H);
}

template <typename T>
inline void rms_wgrad_rows(const T* g, const Rows& gr, const T* x, const Rows& xr, const T* rstd, T* part,
                           int64_t b, int64_t e, int64_t H) {
  for (int64_t r = b; r < e; ++r) rms_wgrad_row<T>(g + gr.offset(r), x + xr.offset(r), rstd[r], part, H);
}

MOETRON_CLONES void rms_forward_rows_f32(const float* x, const Rows& xr, const float* w, float* y, const Rows& yr,
                                         float* rstd, int64_t b, int64_t e, int64_t H, double eps) {
  rms_forward_rows<float>(x, xr, w, y, yr, rstd, b, e, H, eps);
}
MOETRON_CLONES void rms_backward_rows_f32(const float* g, const Rows& gr, const float* x, const Rows& xr,
                                          const float* w, const float* rstd, float* dx, const Rows& dr, int64_t b,
                                          int64_t e, int64_t H) {
  rms_backward_rows<float>(g, gr, x, xr, w, rstd, dx, dr, b, e, H);
}
MOETRON_CLONES void rms_wgrad_rows_f32(const float* g, const Rows& gr, const float* x, const Rows& xr,
                                       const float* rstd, float* part, int64_t b, int64_t e, int64_t H) {
  rms_wgrad_rows<float>(g, gr, x, xr, rstd, part, b, e, H);
}
void rms_forward_any(const double* x, const Rows& xr, const double* w, double* y, const Rows& yr, double* rstd,
                     int64_t b, int64_t e, int64_t H, double eps) {
  rms_forward_rows<double>(x, xr, w, y, yr, rstd, b, e, H, eps);
}
void rms_forward_any(const float* x, const Rows& xr, const float* w, float* y, const Rows& yr, float* rstd,
                     int64_t b, int64_t e, int64_t H, double eps) {
  rms_forward_rows_f32(x, xr, w, y, yr, rstd, b, e, H, eps);
}
void rms_backward_any(const double* g, const Rows& gr, const double* x, const Rows& xr, const double* w,
                      const double* rstd, double* dx, const Rows& dr, int64_t b, int64_t e, int64_t H) {
  rms_backward_rows<double>(g, gr, x, xr, w, rstd, dx, dr, b, e, H);
}
void rms_backward_any(const float* g, const Rows& gr, const float* x, const Rows& xr, const float* w,
                      const float* rstd, float* dx, const Rows& dr, int64_t b, int64_t e, int64_t H) {
  rms_backward_rows_f32(g, gr, x, xr, w, rstd, dx, dr, b, e, H);
}
void rms_wgrad_any(const double* g, const Rows& gr, const double* x, const Rows& xr, const double* rstd,
                   double* part, int64_t b, int64_t e, int64_t H) {
  rms_wgrad_rows<double>(g, gr, x, xr, rstd, part, b, e, H);
}
void rms_wgrad_any(const float* g, const Rows& gr, const float* x, const Rows& xr, const float* rstd, float* part,
                   int64_t b, int64_t e, int64_t H) {
  rms_wgrad_rows_f32(g, gr, x, xr, rstd, part, b, e, H);
}

// x [..., H]: y laid out like x, rstd [rows] in logical row order.
std::tuple<Tensor, Tensor> rms_forward(const Tensor& x, const Tensor& w, double eps) {
  check_norm(x, w, "forward");
  const int64_t H = x.size(-1), R = H ? x.numel() / H : 0;
  Tensor y = at::empty_like(x), rstd = at::empty({R}, x.options());
  TORCH_CHECK(y.stride(-1) == 1, "moetron rms_norm (cpp): x must be dense");
  const Rows xr(x), yr(y);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_forward", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    scalar_t* sp = rstd.data_ptr<scalar_t>();
    at::parallel_for(0, R, grain_rows(H), [&](int64_t b, int64_t e) {
      rms_forward_any(xp, xr, wp, yp, yr, sp, b, e, H, eps);
    });
  });
  return {y, rstd};
}

// dx laid out like x; dw sums fixed blocks of logical rows, then the blocks in order.
std::tuple<Tensor, Tensor> rms_backward(const Tensor& dy_in, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                        bool need_weight_grad) {
  check_norm(x, w, "backward");
  const Tensor dy = dy_in.stride(-1) == 1 ? dy_in : dy_in.contiguous();
  const int64_t H = x.size(-1), R = H ? x.numel() / H : 0;
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type() && rstd.numel() == R &&
                  rstd.scalar_type() == x.scalar_type() && rstd.is_contiguous(),
              "moetron rms_norm (cpp) backward: grad must be ", x.sizes(), " and rstd [", R, "] of ", x.scalar_type());
  Tensor dx = at::empty_like(x), dw;
  TORCH_CHECK(dx.stride(-1) == 1, "moetron rms_norm (cpp): x must be dense");
  const Rows xr(x), gr(dy), dr(dx);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_backward", [&] {
    const scalar_t* gp = dy.const_data_ptr<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    const scalar_t* sp = rstd.const_data_ptr<scalar_t>();
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    at::parallel_for(0, R, grain_rows(H), [&](int64_t b, int64_t e) {
      rms_backward_any(gp, gr, xp, xr, wp, sp, dxp, dr, b, e, H);
    });
    if (need_weight_grad) {
      const int64_t blocks = (R + kBlockRows - 1) / kBlockRows;
      Tensor parts = at::zeros({std::max<int64_t>(blocks, 1), H}, x.options());
      scalar_t* pp = parts.data_ptr<scalar_t>();
      at::parallel_for(0, blocks, std::max<int64_t>(1, grain_rows(H) / kBlockRows), [&](int64_t b, int64_t e) {
        for (int64_t k = b; k < e; ++k)
          rms_wgrad_any(gp, gr, xp, xr, sp, pp + k * H, k * kBlockRows, std::min(R, (k + 1) * kBlockRows), H);
      });
      dw = at::empty({H}, x.options());
      scalar_t* dwp = dw.data_ptr<scalar_t>();
      for (int64_t h = 0; h < H; ++h) dwp[h] = pp[h];
      for (int64_t k = 1; k < blocks; ++k)
        for (int64_t h = 0; h < H; ++h) dwp[h] += pp[k * H + h];
    }
  });
  return {dx, dw};
}

// --- RoPE --------------------------------------------------------------------------------------

// A row's pair i is x[i], x[i + half] (halves layout), or x[2i], x[2i + 1] (interleaved: Step 2, Second 1,
// which rotates both by cos/sin[i] as the reference's interleaved branch does; the tables hold each
// frequency twice, so cos[i + half] is the same value).
template <typename T, int64_t Step = 1, int64_t Second = 0>
inline void rope_row_pairs(const T* __restrict x, const T* __restrict c, const T* __restrict s, T* __restrict o,
                           int64_t half, bool transpose) {
  const int64_t second = Second ? Second : half;  // where a pair's second element sits, past its first
  const int64_t ch = Second ? 0 : half;           // where the second element's cos/sin sit, past the first's
  if (!transpose) {
    for (int64_t i = 0; i < half; ++i) {
      const T x1 = x[Step * i], x2 = x[Step * i + second];
      o[i] = x1 * c[i] - x2 * s[i];
      o[i + half] = x2 * c[i + ch] + x1 * s[i + ch];
    }
  } else {  // x is the output's gradient (halves layout), o the input's (in x's pairs)
    for (int64_t i = 0; i < half; ++i) {
      o[Step * i] = x[i] * c[i] + x[i + half] * s[i + ch];
      o[Step * i + second] = x[i + half] * c[i + ch] - x[i] * s[i];
    }
  }
}

template <typename T>
inline void rope_row(const T* __restrict x, const T* __restrict c, const T* __restrict s, T* __restrict o,
                     int64_t half, bool transpose, bool interleaved = false) {
  if (interleaved) {
    rope_row_pairs<T, 2, 1>(x, c, s, o, half, transpose);
  } else {
    rope_row_pairs<T>(x, c, s, o, half, transpose);
  }
}

// x (and the output, laid out like x) [B, heads, S, d] with unit stride on d; cos/sin [Bc, 1, S, d]
// (Bc 1 or B), each frequency twice (halves layout).
Tensor rope(const Tensor& x, const Tensor& cos_in, const Tensor& sin_in, bool transpose, bool interleaved) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0,
              "moetron rope (cpp): x must be a CPU tensor [B, heads, S, d] with unit stride on an even d, got ",
              x.sizes(), " strides ", x.strides());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "moetron rope (cpp): float32 or float64 only, got ", x.scalar_type());
  const int64_t B = x.size(0), NH = x.size(1), S = x.size(2), D = x.size(3);
  for (const Tensor* t : {&cos_in, &sin_in}) {
    TORCH_CHECK(t->dim() == 4 && (t->size(0) == 1 || t->size(0) == B) && t->size(1) == 1 && t->size(2) == S &&
                    t->size(3) == D && t->scalar_type() == x.scalar_type(),
                "moetron rope (cpp): cos and sin must be [1 or B=", B, ", 1, S=", S, ", d=", D, "] of ",
                x.scalar_type(), ", got ", t->scalar_type(), " ", t->sizes());
  }
  const Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const bool per_batch = cos.size(0) == B && B > 1;
  Tensor out = at::empty_like(x);
  TORCH_CHECK(out.stride(3) == 1, "moetron rope (cpp): x must be dense");
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rope", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* cp = cos.const_data_ptr<scalar_t>();
    const scalar_t* sp = sin.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
    const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
    at::parallel_for(0, B * NH * S, grain_rows(D), [&](int64_t begin, int64_t end) {
      // (b, h, t) of row `begin`, then stepped row by row: no division per row
      int64_t b = begin / (NH * S), h = (begin / S) % NH, t = begin % S;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t cs = ((per_batch ? b : 0) * S + t) * D;
        rope_row(xp + b * xs0 + h * xs1 + t * xs2, cp + cs, sp + cs, op + b * os0 + h * os1 + t * os2, D / 2,
                 transpose, interleaved);
        if (++t == S) {
          t = 0;
          if (++h == NH) h = 0, ++b;
        }
      }
    });
  });
  return out;
}

// --- RMSNorm then RoPE (Qwen3's q/k norms) --------------------------------------------------------
//
// x [B, S, N, d] contiguous (a projection's output as heads), weight [d], cos/sin [Bc, S, d] (Bc 1 or B):
// y [B, S, N, d] = rope(rms_norm(x)) row by row through a [d] buffer, the same arithmetic as the two ops
// apart, so the same bits; one pass and one op each way instead of two. The caller views y as [B, N, S, d].

void check_norm_rope(const Tensor& x, const Tensor& w, const Tensor& cos, const Tensor& sin, const char* where) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 4 && x.is_contiguous() && x.size(3) % 2 == 0,
              "moetron rms_norm_rope (cpp) ", where, ": x must be a contiguous CPU tensor [B, S, heads, d], d even, got ",
              x.sizes(), " strides ", x.strides());
  check_norm(x, w, where);
  for (const Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 3 && (t->size(0) == 1 || t->size(0) == x.size(0)) && t->size(1) == x.size(1) &&
                    t->size(2) == x.size(3) && t->scalar_type() == x.scalar_type() && t->is_contiguous(),
                "moetron rms_norm_rope (cpp) ", where, ": cos and sin must be contiguous [1 or B=", x.size(0),
                ", S=", x.size(1), ", d=", x.size(3), "] of ", x.scalar_type(), ", got ", t->scalar_type(), " ",
                t->sizes());
  }
}

std::tuple<Tensor, Tensor> rms_rope_forward(const Tensor& x, const Tensor& w, double eps, const Tensor& cos,
                                            const Tensor& sin) {
  check_norm_rope(x, w, cos, sin, "forward");
  const int64_t B = x.size(0), S = x.size(1), N = x.size(2), D = x.size(3), R = B * S * N;
  const bool per_batch = cos.size(0) == B && B > 1;
  Tensor y = at::empty_like(x), rstd = at::empty({R}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_rope_forward", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    const scalar_t* cp = cos.const_data_ptr<scalar_t>();
    const scalar_t* snp = sin.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    scalar_t* sp = rstd.data_ptr<scalar_t>();
    at::parallel_for(0, R, grain_rows(D), [&](int64_t b0, int64_t e) {
      std::vector<scalar_t> normed(D);
      // (b, t, head) of row `b0`, then stepped row by row: no division per row
      int64_t b = b0 / (S * N), t = (b0 / N) % S, n = b0 % N;
      for (int64_t r = b0; r < e; ++r) {
        sp[r] = rms_forward_row<scalar_t>(xp + r * D, wp, normed.data(), D, eps);
        const int64_t cs = ((per_batch ? b : 0) * S + t) * D;
        rope_row(normed.data(), cp + cs, snp + cs, yp + r * D, D / 2, false);
        if (++n == N) {
          n = 0;
          if (++t == S) t = 0, ++b;
        }
      }
    });
  });
  return {y, rstd};
}

// dy [B, N, S, d] (the output's layout; unit stride on d): RoPE's transpose, then the RMSNorm backward, as the
// two ops apart (each takes any layout of the rows).
std::tuple<Tensor, Tensor> rms_rope_backward(const Tensor& dy_in, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                             const Tensor& cos, const Tensor& sin, bool need_weight_grad) {
  check_norm_rope(x, w, cos, sin, "backward");
  TORCH_CHECK(dy_in.dim() == 4 && dy_in.transpose(1, 2).sizes() == x.sizes(),
              "moetron rms_norm_rope (cpp) backward: grad must be [B, heads, S, d] for x ", x.sizes(), ", got ",
              dy_in.sizes());
  const Tensor dy = dy_in.stride(3) == 1 ? dy_in : dy_in.contiguous();
  const Tensor g = rope(dy, cos.unsqueeze(1), sin.unsqueeze(1), true, false).transpose(1, 2);
  return rms_backward(g, x, w, rstd, need_weight_grad);
}

}  // namespace

TORCH_LIBRARY(moetron_norm, m) {
  m.def("rms_forward(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)", &rms_forward);
  m.def("rms_backward(Tensor grad, Tensor x, Tensor weight, Tensor rstd, bool need_weight_grad) -> (Tensor, Tensor)",
        &rms_backward);
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool transpose, bool interleaved=False) -> Tensor", &rope);
  m.def("rms_rope_forward(Tensor x, Tensor weight, float eps, Tensor cos, Tensor sin) -> (Tensor, Tensor)",
        &rms_rope_forward);
  m.def("rms_rope_backward(Tensor grad, Tensor x, Tensor weight, Tensor rstd, Tensor cos, Tensor sin, "
        "bool need_weight_grad) -> (Tensor, Tensor)",
        &rms_rope_backward);
}
