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
//
// RoPE equals the torch reference bit for bit (the same two products and one add per element; no FMA:
// cpp_build.py compiles with -ffp-contract=off). RMSNorm sums its squares in SIMD order, so rstd and
// the results differ from torch's by a few ulp (the bound is tested in tests/test_norm_rope_cpp.py);
// dw sums fixed blocks of rows, then the blocks in order: the same bits on any thread count.

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

namespace {

using at::Tensor;

constexpr int64_t kBlockRows = 64;  // dw: rows per partial sum (fixed: results do not depend on threads)

int64_t grain_rows(int64_t H) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)); }

void check_norm(const Tensor& x, const Tensor& w, const char* where) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "moetron rms_norm (cpp) ", where,
              ": x must be a contiguous CPU tensor [rows, H], got ", x.sizes(), " on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, "moetron rms_norm (cpp) ", where,
              ": float32 or float64 only, got ", x.scalar_type());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type() && w.is_contiguous(),
              "moetron rms_norm (cpp) ", where, ": weight must be contiguous [H=", x.size(1), "] of ", x.scalar_type(),
              ", got ", w.scalar_type(), " ", w.sizes());
}

template <typename T>
inline T row_sum_sq(const T* __restrict x, int64_t H) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t h = 0; h < H; ++h) acc += x[h] * x[h];
  return acc;
}

template <typename T>
inline T row_dot_scaled(const T* __restrict g, const T* __restrict w, const T* __restrict x, T rstd, int64_t H) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t h = 0; h < H; ++h) acc += (g[h] * w[h]) * (x[h] * rstd);
  return acc;
}

template <typename T>
void rms_forward_rows(const T* x, const T* w, T* y, T* rstd, int64_t begin, int64_t end, int64_t H, double eps) {
  for (int64_t r = begin; r < end; ++r) {
    const T* __restrict xr = x + r * H;
    T* __restrict yr = y + r * H;
    const T s = T(1) / std::sqrt(row_sum_sq(xr, H) / static_cast<T>(H) + static_cast<T>(eps));
    rstd[r] = s;
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) yr[h] = w[h] * (xr[h] * s);
  }
}

template <typename T>
void rms_backward_rows(const T* dy, const T* x, const T* w, const T* rstd, T* dx, int64_t begin, int64_t end,
                       int64_t H) {
  for (int64_t r = begin; r < end; ++r) {
    const T* __restrict gr = dy + r * H;
    const T* __restrict xr = x + r * H;
    T* __restrict dxr = dx + r * H;
    const T s = rstd[r];
    const T mean = row_dot_scaled(gr, w, xr, s, H) / static_cast<T>(H);
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) dxr[h] = s * (gr[h] * w[h] - (xr[h] * s) * mean);
  }
}

template <typename T>
void rms_weight_grad_block(const T* dy, const T* x, const T* rstd, T* part, int64_t begin, int64_t end, int64_t H) {
  for (int64_t h = 0; h < H; ++h) part[h] = 0;
  for (int64_t r = begin; r < end; ++r) {
    const T* __restrict gr = dy + r * H;
    const T* __restrict xr = x + r * H;
    const T s = rstd[r];
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) part[h] += gr[h] * (xr[h] * s);
  }
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MOETRON_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MOETRON_CLONES
#endif

// fp32 row loops compiled for AVX2 too (picked at load time); fp64 (gradcheck) takes the templates.
MOETRON_CLONES void rms_forward_f32(const float* x, const float* w, float* y, float* rstd, int64_t b, int64_t e,
                                    int64_t H, double eps) {
  rms_forward_rows<float>(x, w, y, rstd, b, e, H, eps);
}
MOETRON_CLONES void rms_backward_f32(const float* dy, const float* x, const float* w, const float* rstd, float* dx,
                                     int64_t b, int64_t e, int64_t H) {
  rms_backward_rows<float>(dy, x, w, rstd, dx, b, e, H);
}
MOETRON_CLONES void rms_wgrad_f32(const float* dy, const float* x, const float* rstd, float* part, int64_t b,
                                  int64_t e, int64_t H) {
  rms_weight_grad_block<float>(dy, x, rstd, part, b, e, H);
}
template <typename T>
void rms_forward_any(const T* x, const T* w, T* y, T* rstd, int64_t b, int64_t e, int64_t H, double eps) {
  rms_forward_rows<T>(x, w, y, rstd, b, e, H, eps);
}
void rms_forward_any(const float* x, const float* w, float* y, float* rstd, int64_t b, int64_t e, int64_t H,
                     double eps) {
  rms_forward_f32(x, w, y, rstd, b, e, H, eps);
}
template <typename T>
void rms_backward_any(const T* dy, const T* x, const T* w, const T* rstd, T* dx, int64_t b, int64_t e, int64_t H) {
  rms_backward_rows<T>(dy, x, w, rstd, dx, b, e, H);
}
void rms_backward_any(const float* dy, const float* x, const float* w, const float* rstd, float* dx, int64_t b,
                      int64_t e, int64_t H) {
  rms_backward_f32(dy, x, w, rstd, dx, b, e, H);
}
template <typename T>
void rms_wgrad_any(const T* dy, const T* x, const T* rstd, T* part, int64_t b, int64_t e, int64_t H) {
  rms_weight_grad_block<T>(dy, x, rstd, part, b, e, H);
}
void rms_wgrad_any(const float* dy, const float* x, const float* rstd, float* part, int64_t b, int64_t e, int64_t H) {
  rms_wgrad_f32(dy, x, rstd, part, b, e, H);
}

std::tuple<Tensor, Tensor> rms_forward(const Tensor& x, const Tensor& w, double eps) {
  check_norm(x, w, "forward");
  const int64_t R = x.size(0), H = x.size(1);
  Tensor y = at::empty_like(x), rstd = at::empty({R}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_forward", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    scalar_t* sp = rstd.data_ptr<scalar_t>();
    at::parallel_for(0, R, grain_rows(H), [&](int64_t b, int64_t e) { rms_forward_any(xp, wp, yp, sp, b, e, H, eps); });
  });
  return {y, rstd};
}

std::tuple<Tensor, Tensor> rms_backward(const Tensor& dy_in, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                        bool need_weight_grad) {
  check_norm(x, w, "backward");
  const Tensor dy = dy_in.contiguous();
  const int64_t R = x.size(0), H = x.size(1);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type() && rstd.numel() == R &&
                  rstd.scalar_type() == x.scalar_type() && rstd.is_contiguous(),
              "moetron rms_norm (cpp) backward: grad must be ", x.sizes(), " and rstd [", R, "] of ", x.scalar_type());
  Tensor dx = at::empty_like(x), dw;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_backward", [&] {
    const scalar_t* gp = dy.const_data_ptr<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    const scalar_t* sp = rstd.const_data_ptr<scalar_t>();
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    at::parallel_for(0, R, grain_rows(H), [&](int64_t b, int64_t e) { rms_backward_any(gp, xp, wp, sp, dxp, b, e, H); });
    if (need_weight_grad) {
      const int64_t blocks = (R + kBlockRows - 1) / kBlockRows;
      Tensor parts = at::empty({std::max<int64_t>(blocks, 1), H}, x.options());
      scalar_t* pp = parts.data_ptr<scalar_t>();
      if (blocks == 0) parts.zero_();
      at::parallel_for(0, blocks, std::max<int64_t>(1, grain_rows(H) / kBlockRows), [&](int64_t b, int64_t e) {
        for (int64_t k = b; k < e; ++k)
          rms_wgrad_any(gp, xp, sp, pp + k * H, k * kBlockRows, std::min(R, (k + 1) * kBlockRows), H);
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

template <typename T>
inline void rope_row(const T* __restrict x, const T* __restrict c, const T* __restrict s, T* __restrict o,
                     int64_t half, bool transpose) {
  if (!transpose) {
    for (int64_t i = 0; i < half; ++i) {
      o[i] = x[i] * c[i] - x[i + half] * s[i];
      o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      o[i] = x[i] * c[i] + x[i + half] * s[i + half];
      o[i + half] = x[i + half] * c[i + half] - x[i] * s[i];
    }
  }
}

// x (and the output, laid out like x) [B, heads, S, d] with unit stride on d; cos/sin [Bc, 1, S, d]
// (Bc 1 or B), each frequency twice (halves layout).
Tensor rope(const Tensor& x, const Tensor& cos_in, const Tensor& sin_in, bool transpose) {
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
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / (NH * S), h = (r / S) % NH, t = r % S;
        const int64_t cs = ((per_batch ? b : 0) * S + t) * D;
        rope_row(xp + b * xs0 + h * xs1 + t * xs2, cp + cs, sp + cs, op + b * os0 + h * os1 + t * os2, D / 2,
                 transpose);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(moetron_norm, m) {
  m.def("rms_forward(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)", &rms_forward);
  m.def("rms_backward(Tensor grad, Tensor x, Tensor weight, Tensor rstd, bool need_weight_grad) -> (Tensor, Tensor)",
        &rms_backward);
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool transpose) -> Tensor", &rope);
}
