// Fused weighted SwiGLU for CPU tensors (moetron.kernels.fused_swiglu, impl "cpp").
//
// Compiled through fma_kernels.cpp into the library of permute_cpu.cpp (moetron/kernels/cpp_build.py) and
// registered as torch.ops.moetron_swiglu.*.
//
//   forward:  out[n, f] = silu(g) * u * w[n]          g = gate_up[n, f], u = gate_up[n, F + f]
//   backward: da = dout * w[n];  s = sigmoid(g)
//             d_gate_up[n, f]     = da * u * s * (1 + g * (1 - s))
//             d_gate_up[n, F + f] = da * silu(g)
//             d_w[n]              = sum_f dout[n, f] * silu(g) * u   (a SIMD sum in fp32)
//
// One pass over the rows each way: no split/cat, no [N, F] temporaries. Arithmetic in fp32
// (fp64 for fp64 inputs), rounded once to the output dtype. exp is a Cephes-style polynomial
// written so that the compiler vectorises the row loop (glibc's vector expf needs -ffast-math);
// it is within 2 ulp of expf, so results differ from torch's eager ops by a few ulp (the bound is
// stated and tested in tests/test_fused_swiglu.py), not bit for bit. exp_poly is in simd_math.h.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

// Without trapping math the compiler may if-convert the clamp and the float->int rounding in exp_poly
// and vectorise the row loops; no result changes (moetron never enables FP traps). fp-contract lets it
// fuse multiply-adds: exp_poly's polynomial is a chain of them, whose latency bounds the loops.
#pragma GCC optimize("no-trapping-math", "fp-contract=fast")

#include "simd_math.h"  // after the pragma: its loops take the same options

namespace {

using at::Tensor;


using moetron::exp_poly;
inline double exp_poly(double x) { return std::exp(x); }

template <typename scalar_t>
using acc_of = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

void check_args(const Tensor& gate_up, const Tensor& probs, const char* where) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "moetron swiglu (cpp) ", where, ": gate_up must be a CPU tensor [N, 2F], got ", gate_up.sizes(),
              " on ", gate_up.device());
  if (probs.defined()) {
    TORCH_CHECK(probs.device().is_cpu() && probs.dim() == 1 && probs.size(0) == gate_up.size(0) &&
                    probs.scalar_type() == at::kFloat,
                "moetron swiglu (cpp) ", where, ": probs must be a float32 CPU tensor [N=", gate_up.size(0),
                "], got ", probs.scalar_type(), " ", probs.sizes());
  }
}

int64_t grain_rows(int64_t F) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(F, 1)); }

// The row loops for bf16, fp16 and fp64, templated on the element type. fp32 (the CPU training dtype)
// takes the vector loops below, compiled for AVX2 with FMA too and picked at run time (simd_math.h),
// since the default x86-64 target vectorises only 4 lanes wide and without fused multiply-adds.
template <typename scalar_t>
__attribute__((always_inline)) inline void forward_rows(const scalar_t* in, const float* w, scalar_t* o, int64_t begin, int64_t end, int64_t F) {
  using acc_t = acc_of<scalar_t>;
  for (int64_t n = begin; n < end; ++n) {
    const scalar_t* __restrict g = in + n * 2 * F;
    const scalar_t* __restrict u = g + F;
    scalar_t* __restrict on = o + n * F;
    const acc_t wn = w ? static_cast<acc_t>(w[n]) : acc_t(1);
    for (int64_t f = 0; f < F; ++f) {
      const acc_t gv = static_cast<acc_t>(g[f]);
      const acc_t silu = gv / (acc_t(1) + exp_poly(-gv));
      on[f] = static_cast<scalar_t>(silu * static_cast<acc_t>(u[f]) * wn);
    }
  }
}

template <typename scalar_t>
__attribute__((always_inline)) inline void backward_rows(const scalar_t* gr, const scalar_t* in, const float* w, scalar_t* d, float* dw,
                          int64_t begin, int64_t end, int64_t F) {
  using acc_t = acc_of<scalar_t>;
  for (int64_t n = begin; n < end; ++n) {
    const scalar_t* __restrict g = in + n * 2 * F;
    const scalar_t* __restrict u = g + F;
    const scalar_t* __restrict go = gr + n * F;
    scalar_t* __restrict dg = d + n * 2 * F;
    scalar_t* __restrict du = dg + F;
    const acc_t wn = w ? static_cast<acc_t>(w[n]) : acc_t(1);
    acc_t dot = 0;  // d_w[n]: a SIMD reduction, summed in the order of the vector width
#pragma omp simd reduction(+ : dot)
    for (int64_t f = 0; f < F; ++f) {
      const acc_t gv = static_cast<acc_t>(g[f]);
      const acc_t uv = static_cast<acc_t>(u[f]);
      const acc_t gov = static_cast<acc_t>(go[f]);
      const acc_t da = gov * wn;
      const acc_t s = acc_t(1) / (acc_t(1) + exp_poly(-gv));
      const acc_t silu = gv * s;
      dg[f] = static_cast<scalar_t>(da * uv * (s * (acc_t(1) + gv * (acc_t(1) - s))));
      du[f] = static_cast<scalar_t>(da * silu);
      dot += gov * (silu * uv);
    }
    if (dw) dw[n] = static_cast<float>(dot);
  }
}

// The fp32 rows eight lanes at a time (simd_math.h's exp8), each row's last F % 8 one by one.
using moetron::exp8;
using moetron::load8;
using moetron::store8;
using moetron::vec8;

__attribute__((always_inline)) inline void forward_rows_vec(const float* in, const float* w, float* o, int64_t begin,
                                                            int64_t end, int64_t F) {
  const int64_t F8 = F / 8 * 8;
  for (int64_t n = begin; n < end; ++n) {
    const float* g = in + n * 2 * F;
    float* on = o + n * F;
    const float wn = w ? w[n] : 1.0f;
    for (int64_t f = 0; f < F8; f += 8) {
      const vec8 gv = load8(g + f);
      store8(on + f, gv / (1.0f + exp8(-gv)) * load8(g + F + f) * wn);
    }
    for (int64_t f = F8; f < F; ++f) on[f] = g[f] / (1.0f + exp_poly(-g[f])) * g[F + f] * wn;
  }
}

__attribute__((always_inline)) inline void backward_rows_vec(const float* gr, const float* in, const float* w, float* d,
                                                             float* dw, int64_t begin, int64_t end, int64_t F) {
  const int64_t F8 = F / 8 * 8;
  for (int64_t n = begin; n < end; ++n) {
    const float* g = in + n * 2 * F;
    const float* go = gr + n * F;
    float* dg = d + n * 2 * F;
    const float wn = w ? w[n] : 1.0f;
    vec8 dot = {};
    for (int64_t f = 0; f < F8; f += 8) {
      const vec8 gv = load8(g + f), uv = load8(g + F + f), gov = load8(go + f);
      const vec8 da = gov * wn;
      const vec8 s = 1.0f / (1.0f + exp8(-gv));
      const vec8 silu = gv * s;
      store8(dg + f, da * uv * (s * (1.0f + gv * (1.0f - s))));
      store8(dg + F + f, da * silu);
      dot += gov * (silu * uv);
    }
    float tail = 0.0f;
    for (int64_t f = F8; f < F; ++f) {
      const float gv = g[f], uv = g[F + f], gov = go[f], da = gov * wn;
      const float s = 1.0f / (1.0f + exp_poly(-gv));
      dg[f] = da * uv * (s * (1.0f + gv * (1.0f - s)));
      dg[F + f] = da * (gv * s);
      tail += gov * ((gv * s) * uv);
    }
    if (dw) dw[n] = moetron::lane_sum(dot) + tail;
  }
}

MOETRON_FMA_TARGET void forward_rows_fma(const float* in, const float* w, float* o, int64_t begin, int64_t end,
                                         int64_t F) {
  forward_rows_vec(in, w, o, begin, end, F);
}
void forward_rows_f32(const float* in, const float* w, float* o, int64_t begin, int64_t end, int64_t F) {
  if (moetron::has_avx2_fma()) return forward_rows_fma(in, w, o, begin, end, F);
  forward_rows_vec(in, w, o, begin, end, F);
}

MOETRON_FMA_TARGET void backward_rows_fma(const float* gr, const float* in, const float* w, float* d, float* dw,
                                          int64_t begin, int64_t end, int64_t F) {
  backward_rows_vec(gr, in, w, d, dw, begin, end, F);
}
void backward_rows_f32(const float* gr, const float* in, const float* w, float* d, float* dw, int64_t begin,
                       int64_t end, int64_t F) {
  if (moetron::has_avx2_fma()) return backward_rows_fma(gr, in, w, d, dw, begin, end, F);
  backward_rows_vec(gr, in, w, d, dw, begin, end, F);
}

// fp32 takes the multi-versioned loops (a non-template overload wins for float), the rest the templates.
template <typename scalar_t>
void run_forward_rows(const scalar_t* in, const float* w, scalar_t* o, int64_t begin, int64_t end, int64_t F) {
  forward_rows<scalar_t>(in, w, o, begin, end, F);
}
void run_forward_rows(const float* in, const float* w, float* o, int64_t begin, int64_t end, int64_t F) {
  forward_rows_f32(in, w, o, begin, end, F);
}
template <typename scalar_t>
void run_backward_rows(const scalar_t* gr, const scalar_t* in, const float* w, scalar_t* d, float* dw,
                       int64_t begin, int64_t end, int64_t F) {
  backward_rows<scalar_t>(gr, in, w, d, dw, begin, end, F);
}
void run_backward_rows(const float* gr, const float* in, const float* w, float* d, float* dw,
                       int64_t begin, int64_t end, int64_t F) {
  backward_rows_f32(gr, in, w, d, dw, begin, end, F);
}

Tensor swiglu_forward(const Tensor& gate_up_in, const std::optional<Tensor>& probs_opt) {
  const Tensor probs = probs_opt.has_value() ? probs_opt->contiguous() : Tensor();
  check_args(gate_up_in, probs, "forward");
  const Tensor gate_up = gate_up_in.contiguous();
  const int64_t N = gate_up.size(0), F = gate_up.size(1) / 2;
  Tensor out = at::empty({N, F}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "swiglu_forward", [&] {
    const scalar_t* in = gate_up.const_data_ptr<scalar_t>();
    const float* w = probs.defined() ? probs.const_data_ptr<float>() : nullptr;
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, grain_rows(F), [&](int64_t begin, int64_t end) {
      run_forward_rows(in, w, o, begin, end, F);
    });
  });
  return out;
}

std::tuple<Tensor, Tensor> swiglu_backward(const Tensor& grad_in, const Tensor& gate_up_in,
                                           const std::optional<Tensor>& probs_opt, bool need_probs_grad) {
  const Tensor probs = probs_opt.has_value() ? probs_opt->contiguous() : Tensor();
  check_args(gate_up_in, probs, "backward");
  const Tensor gate_up = gate_up_in.contiguous();
  const Tensor grad = grad_in.contiguous();
  const int64_t N = gate_up.size(0), F = gate_up.size(1) / 2;
  TORCH_CHECK(grad.sizes() == at::IntArrayRef({N, F}) && grad.scalar_type() == gate_up.scalar_type(),
              "moetron swiglu (cpp) backward: grad must be [", N, ", ", F, "] of ", gate_up.scalar_type(),
              ", got ", grad.scalar_type(), " ", grad.sizes());
  TORCH_CHECK(!need_probs_grad || probs.defined(), "moetron swiglu (cpp) backward: a probs gradient needs probs");
  Tensor d_gate_up = at::empty({N, 2 * F}, gate_up.options());
  Tensor d_probs = need_probs_grad ? at::empty({N}, probs.options()) : Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "swiglu_backward", [&] {
    const scalar_t* in = gate_up.const_data_ptr<scalar_t>();
    const scalar_t* gr = grad.const_data_ptr<scalar_t>();
    const float* w = probs.defined() ? probs.const_data_ptr<float>() : nullptr;
    scalar_t* d = d_gate_up.data_ptr<scalar_t>();
    float* dw = need_probs_grad ? d_probs.data_ptr<float>() : nullptr;
    at::parallel_for(0, N, grain_rows(F), [&](int64_t begin, int64_t end) {
      run_backward_rows(gr, in, w, d, dw, begin, end, F);
    });
  });
  return {d_gate_up, d_probs};
}

}  // namespace

TORCH_LIBRARY(moetron_swiglu, m) {
  m.def("forward(Tensor gate_up, Tensor? probs) -> Tensor", &swiglu_forward);
  m.def("backward(Tensor grad, Tensor gate_up, Tensor? probs, bool need_probs_grad) -> (Tensor, Tensor)",
        &swiglu_backward);
}
