// Fused permute / unpermute for CPU tensors (moetron.dispatch.permute, impl "cpp").
//
// Built on first use by moetron/kernels/cpp_build.py with torch.utils.cpp_extension.load and
// registered as torch.ops.moetron_permute.*; no pybind11, and only the ATen headers it uses,
// so the build stays short.
//
// Numerics are those of the deterministic torch reference in dispatch/permute_reference.py, bit for bit:
//  * permute copies rows (padding rows are zero);
//  * a token's sum over its k slots runs in slot order k = 0..K-1 in the accumulation type
//    (fp32 for fp16/bf16/fp32, fp64 for fp64), starting from +0, skipping dropped slots, and is
//    rounded to the output dtype once;
//  * the gate-weight gradient dot(grad_out[t], y[row]) accumulates LANES interleaved partial
//    sums (element h goes to lane h % LANES, chunks in order), then folds the lanes pairwise
//    (lane j += lane j + width/2) down to one.
// Build with -ffp-contract=off so that a * b + c is never fused into an FMA.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

constexpr int64_t kDotLanes = 256;  // must equal DOT_LANES in kernels/numerics.py and the Triton kernel

template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "moetron permute (cpp): ", name, " must be a CPU tensor, got ", t.device());
}

void check_index(const Tensor& t, const char* name, int64_t numel) {
  check_cpu(t, name);
  TORCH_CHECK(t.scalar_type() == at::kLong, "moetron permute (cpp): ", name, " must be int64, got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && t.numel() == numel, "moetron permute (cpp): ", name,
              " must be contiguous with ", numel, " elements, got ", t.sizes());
}

// Counting sort of the routing: the same integers as the torch reference's stable argsort.
// Returns (token_idx[N], slot_idx[N], rows_per_expert[E], padded_pos[N] (empty when unpadded),
//          row_of_slot[T*K] (-1 dropped), slot_of_row[R] (-1 padding)).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> routing_plan(const Tensor& topk_idx,
                                                                        int64_t num_experts,
                                                                        int64_t pad_multiple,
                                                                        int64_t pad_to) {
  check_cpu(topk_idx, "topk_idx");
  TORCH_CHECK(topk_idx.dim() == 2 && topk_idx.scalar_type() == at::kLong,
              "moetron permute (cpp): topk_idx must be int64 [T, K], got ", topk_idx.scalar_type(), " ",
              topk_idx.sizes());
  TORCH_CHECK(num_experts >= 0 && pad_multiple >= 1, "moetron permute (cpp): bad num_experts/pad_multiple");
  const bool padded = pad_multiple != 1 || pad_to >= 0;
  const Tensor idx_t = topk_idx.contiguous();
  const int64_t K = idx_t.size(1);
  const int64_t S = idx_t.numel();
  const int64_t* idx = idx_t.const_data_ptr<int64_t>();

  std::vector<int64_t> counts(num_experts, 0);
  for (const auto s : c10::irange(S)) {
    const int64_t e = idx[s];
    if (e < 0) continue;
    TORCH_CHECK_INDEX(e < num_experts, "moetron permute: topk_idx holds expert ", e, " at slot ", s,
                      " but num_experts=", num_experts);
    counts[e]++;
  }
  std::vector<int64_t> padded_counts(counts);
  if (pad_to >= 0) {
    for (const auto e : c10::irange(num_experts)) {
      TORCH_CHECK_VALUE(counts[e] <= pad_to, "pad_to=", pad_to, " is smaller than the largest expert load ",
                        *std::max_element(counts.begin(), counts.end()));
      padded_counts[e] = pad_to;
    }
  } else if (pad_multiple != 1) {
    for (auto& n : padded_counts) n = (n + pad_multiple - 1) / pad_multiple * pad_multiple;
  }
  std::vector<int64_t> cursor(num_experts), padded_cursor(num_experts);
  int64_t N = 0, R = 0;
  for (const auto e : c10::irange(num_experts)) {
    cursor[e] = N;
    padded_cursor[e] = R;
    N += counts[e];
    R += padded_counts[e];
  }

  const auto opts = idx_t.options();
  Tensor token_idx = at::empty({N}, opts), slot_idx = at::empty({N}, opts);
  Tensor padded_pos = at::empty({padded ? N : 0}, opts);
  Tensor row_of_slot = at::empty({S}, opts), slot_of_row = at::empty({R}, opts);
  Tensor rows_per_expert = at::empty({num_experts}, opts);
  int64_t* tok = token_idx.data_ptr<int64_t>();
  int64_t* slot = slot_idx.data_ptr<int64_t>();
  int64_t* pos = padded_pos.data_ptr<int64_t>();
  int64_t* ros = row_of_slot.data_ptr<int64_t>();
  int64_t* sor = slot_of_row.data_ptr<int64_t>();
  std::fill(sor, sor + R, int64_t{-1});
  std::copy(padded_counts.begin(), padded_counts.end(), rows_per_expert.data_ptr<int64_t>());
  for (const auto s : c10::irange(S)) {
    const int64_t e = idx[s];
    if (e < 0) {
      ros[s] = -1;
      continue;
    }
    const int64_t n = cursor[e]++;
    const int64_t p = padded_cursor[e]++;
    tok[n] = s / K;
    slot[n] = s;
    if (padded) pos[n] = p;
    ros[s] = p;
    sor[p] = s;
  }
  return {token_idx, slot_idx, rows_per_expert, padded_pos, row_of_slot, slot_of_row};
}

// out[r] = x[slot_of_row[r] / K], or zeros where slot_of_row[r] < 0. A byte copy: any dtype.
Tensor gather_rows(const Tensor& x, const Tensor& slot_of_row, int64_t topk) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2, "moetron permute (cpp): x must be [T, H], got ", x.sizes());
  const Tensor xc = x.contiguous();
  const int64_t T = xc.size(0), H = xc.size(1), R = slot_of_row.numel();
  check_index(slot_of_row, "slot_of_row", R);
  Tensor out = at::empty({R, H}, xc.options());
  const int64_t row_bytes = H * static_cast<int64_t>(xc.element_size());
  const char* src = static_cast<const char*>(xc.const_data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t* sor = slot_of_row.const_data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    for (const auto r : c10::irange(begin, end)) {
      const int64_t s = sor[r];
      char* d = dst + r * row_bytes;
      if (s < 0) {
        std::memset(d, 0, row_bytes);
      } else {
        const int64_t t = s / topk;
        TORCH_CHECK_INDEX(t < T, "moetron permute (cpp): slot ", s, " is out of range for ", T, " tokens");
        std::memcpy(d, src + t * row_bytes, row_bytes);
      }
    }
  });
  return out;
}

// out[t] = sum_k w[t,k] * y[row_of_slot[t*K+k]] in slot order (weights optional), see above.
Tensor reduce_slots(const Tensor& y, const Tensor& row_of_slot, const std::optional<Tensor>& weights,
                    int64_t num_tokens, int64_t topk) {
  check_cpu(y, "y");
  TORCH_CHECK(y.dim() == 2, "moetron unpermute (cpp): y must be [R, H], got ", y.sizes());
  const Tensor yc = y.contiguous();
  const int64_t R = yc.size(0), H = yc.size(1), K = topk;
  check_index(row_of_slot, "row_of_slot", num_tokens * K);
  Tensor w;
  if (weights.has_value()) {
    check_cpu(*weights, "topk_weights");
    TORCH_CHECK(weights->numel() == num_tokens * K, "moetron unpermute (cpp): topk_weights must have ",
                num_tokens * K, " elements, got ", weights->sizes());
    w = weights->contiguous();
  }
  Tensor out = at::empty({num_tokens, H}, yc.options());
  const int64_t* ros = row_of_slot.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, yc.scalar_type(), "moetron_reduce_slots", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    const scalar_t* ys = yc.const_data_ptr<scalar_t>();
    scalar_t* os = out.data_ptr<scalar_t>();
    // the weights in the accumulation type, read once
    std::vector<acc_t> wv;
    if (w.defined()) {
      const Tensor wa = w.to(c10::CppTypeToScalarType<acc_t>::value);
      const acc_t* wp = wa.const_data_ptr<acc_t>();
      wv.assign(wp, wp + wa.numel());
    }
    const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(H * std::max<int64_t>(K, 1), 1));
    at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(H);
      for (const auto t : c10::irange(begin, end)) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (const auto k : c10::irange(K)) {
          const int64_t r = ros[t * K + k];
          if (r < 0) continue;
          TORCH_CHECK_INDEX(r < R, "moetron unpermute (cpp): row ", r, " is out of range for ", R, " rows");
          const scalar_t* yr = ys + r * H;
          if (w.defined()) {
            const acc_t wk = wv[t * K + k];
            for (const auto h : c10::irange(H)) acc[h] += static_cast<acc_t>(yr[h]) * wk;
          } else {
            for (const auto h : c10::irange(H)) acc[h] += static_cast<acc_t>(yr[h]);
          }
        }
        scalar_t* o = os + t * H;
        for (const auto h : c10::irange(H)) o[h] = static_cast<scalar_t>(acc[h]);
      }
    });
  });
  return out;
}

// Backward of the weighted unpermute, one pass over the rows:
//   grad_y[r] = grad_out[t] * w[s]            (zeros for padding rows)
//   grad_w[s] = dot(grad_out[t], y[r])        (zeros for dropped slots), lane order as above.
// Returns (grad_y or an empty tensor, grad_w in the weights' dtype or an empty tensor).
std::tuple<Tensor, Tensor> unpermute_backward(const Tensor& grad_out, const std::optional<Tensor>& y,
                                              const Tensor& slot_of_row, const Tensor& weights,
                                              int64_t topk, bool need_grad_y, bool need_grad_w) {
  check_cpu(grad_out, "grad_out");
  check_cpu(weights, "topk_weights");
  const Tensor g = grad_out.contiguous();
  const int64_t T = g.size(0), H = g.size(1), R = slot_of_row.numel(), K = topk;
  check_index(slot_of_row, "slot_of_row", R);
  TORCH_CHECK(weights.numel() == T * K, "moetron unpermute (cpp): topk_weights must have ", T * K,
              " elements, got ", weights.sizes());
  Tensor yc;
  if (need_grad_w) {
    TORCH_CHECK(y.has_value() && y->sizes() == at::IntArrayRef({R, H}) && y->scalar_type() == g.scalar_type(),
                "moetron unpermute (cpp): y must be [", R, ", ", H, "] of the gradient's dtype");
    yc = y->contiguous();
  }
  Tensor grad_y = need_grad_y ? at::empty({R, H}, g.options()) : at::empty({0}, g.options());
  Tensor grad_w = at::empty({0}, weights.options());
  const int64_t* sor = slot_of_row.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "moetron_unpermute_backward", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    const auto acc_type = c10::CppTypeToScalarType<acc_t>::value;
    const Tensor wa = weights.reshape({-1}).to(acc_type).contiguous();
    const acc_t* wp = wa.const_data_ptr<acc_t>();
    Tensor gw_acc = need_grad_w ? at::zeros({T * K}, weights.options().dtype(acc_type)) : Tensor();
    acc_t* gw = need_grad_w ? gw_acc.data_ptr<acc_t>() : nullptr;
    const scalar_t* gs = g.const_data_ptr<scalar_t>();
    const scalar_t* ys = need_grad_w ? yc.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* gys = need_grad_y ? grad_y.data_ptr<scalar_t>() : nullptr;
    const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(H, 1));
    at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
      acc_t lanes[kDotLanes];
      for (const auto r : c10::irange(begin, end)) {
        const int64_t s = sor[r];
        if (s < 0) {
          if (need_grad_y) std::memset(gys + r * H, 0, H * sizeof(scalar_t));
          continue;
        }
        const int64_t t = s / K;
        TORCH_CHECK_INDEX(t < T, "moetron unpermute (cpp): slot ", s, " is out of range for ", T, " tokens");
        const scalar_t* gt = gs + t * H;
        if (need_grad_y) {
          const acc_t ws = wp[s];
          scalar_t* d = gys + r * H;
          for (const auto h : c10::irange(H)) d[h] = static_cast<scalar_t>(static_cast<acc_t>(gt[h]) * ws);
        }
        if (need_grad_w) {
          const scalar_t* yr = ys + r * H;
          std::fill(lanes, lanes + kDotLanes, acc_t(0));
          for (int64_t c = 0; c < H; c += kDotLanes) {
            const int64_t n = std::min(kDotLanes, H - c);
            for (const auto j : c10::irange(n))
              lanes[j] += static_cast<acc_t>(gt[c + j]) * static_cast<acc_t>(yr[c + j]);
          }
          for (int64_t width = kDotLanes / 2; width >= 1; width /= 2)
            for (const auto j : c10::irange(width)) lanes[j] = lanes[j] + lanes[j + width];
          gw[s] = lanes[0];
        }
      }
    });
    if (need_grad_w) grad_w = gw_acc.to(weights.scalar_type()).reshape(weights.sizes());
  });
  return {grad_y, grad_w};
}

}  // namespace

TORCH_LIBRARY(moetron_permute, m) {
  m.def("routing_plan(Tensor topk_idx, int num_experts, int pad_multiple, int pad_to) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        &routing_plan);
  m.def("gather_rows(Tensor x, Tensor slot_of_row, int topk) -> Tensor", &gather_rows);
  m.def("reduce_slots(Tensor y, Tensor row_of_slot, Tensor? weights, int num_tokens, int topk) -> Tensor",
        &reduce_slots);
  m.def("unpermute_backward(Tensor grad_out, Tensor? y, Tensor slot_of_row, Tensor weights, int topk, "
        "bool need_grad_y, bool need_grad_w) -> (Tensor, Tensor)",
        &unpermute_backward);
}
