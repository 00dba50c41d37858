"""The one seam through which every expert GEMM runs.

`grouped_linear(x_NH, w_EOH, rows_per_expert)` is `F.linear` applied per expert to
consecutive row blocks. Backends: `torch._grouped_mm` (CPU and GPUs), moetron's C++ CPU grouped
GEMM ("cpp", moetron/csrc/grouped_gemm_cpu.cpp: the experts split over the threads once per call,
one single-threaded BLAS call per piece; "auto" on CPU, built on first use), the `grouped_gemm`
package (GPU, bf16 only), and a per-expert loop that always works.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moetron import backends
from moetron.kernels import cpp_build
from moetron.kernels.threads import helper_threads
from moetron.kernels.weight_grads import defer_weight_grad


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    torch._grouped_mm's backward rejects expanded (zero-stride) gradients, such as
    the one `y.sum()` produces.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _aligned(t: torch.Tensor, *dims: int) -> bool:
    return all(d * t.element_size() % 16 == 0 for d in dims)


def _grouped_mm(x_NH, w_EOH, rows_per_expert):
    offsets = torch.cumsum(rows_per_expert, 0).to(torch.int32)
    y = torch._grouped_mm(x_NH, w_EOH.transpose(-2, -1), offs=offsets)
    return _ContiguousGrad.apply(y)


def _loop(x_NH, w_EOH, rows_per_expert):
    chunks = torch.split(x_NH, rows_per_expert.tolist())  # one host sync
    return torch.cat([F.linear(chunk, w_EOH[e]) for e, chunk in enumerate(chunks)])


def check_grouped_gemm(x: torch.Tensor, w_EOH: torch.Tensor) -> None:
    """grouped_gemm's kernels take bf16 only (its own assert otherwise)."""
    if x.dtype != torch.bfloat16 or w_EOH.dtype != torch.bfloat16:
        raise ValueError(f"expert_backend=grouped_gemm runs bf16 only, got {x.dtype} tokens and {w_EOH.dtype} "
                         f"weights: set train.dtype=bf16, or expert_backend=auto / torch_grouped_mm / loop")


def _grouped_gemm_pkg(x_NH, w_EOH, rows_per_expert):
    from grouped_gemm import ops  # optional GPU package

    check_grouped_gemm(x_NH, w_EOH)
    # contiguous operands, int64 sizes on the host (its checks); the output's gradient contiguous too
    # (older releases pass it on as it comes, e.g. the expanded gradient of `y.sum()`)
    y = ops.gmm(x_NH.contiguous(), w_EOH.contiguous(), rows_per_expert.to("cpu", torch.int64), trans_b=True)
    return _ContiguousGrad.apply(y)


class _CppGroupedLinear(torch.autograd.Function):
    """`torch.ops.moetron_gemm.grouped_mm` each way: forward (mode 0), input grad (1), weight grad (2)."""

    @staticmethod
    def forward(ctx, x_NH, w_EOH, offsets, ops):
        ctx.ops = ops
        ctx.leaf = w_EOH if w_EOH.is_leaf and w_EOH.requires_grad else None  # weight_grads_beside's target
        x_NH, w_EOH = x_NH.contiguous(), w_EOH.contiguous()
        ctx.save_for_backward(x_NH, w_EOH, offsets)
        return ops.grouped_mm(x_NH, w_EOH, offsets, 0, helper_threads())

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_NO):
        x_NH, w_EOH, offsets = ctx.saved_tensors
        grad_NO = grad_NO.contiguous()
        helpers = helper_threads()
        grad_x = ctx.ops.grouped_mm(grad_NO, w_EOH, offsets, 1, helpers) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1] and not defer_weight_grad(
                ctx.leaf, lambda: ctx.ops.grouped_mm(grad_NO, x_NH, offsets, 2, 0)):
            grad_w = ctx.ops.grouped_mm(grad_NO, x_NH, offsets, 2, helpers)
        return grad_x, grad_w, None, None


def _cpp(x_NH, w_EOH, rows_per_expert):
    offsets = torch.cumsum(rows_per_expert, 0).to(torch.int32)  # saved for backward as _grouped_mm's are
    return _CppGroupedLinear.apply(x_NH, w_EOH, offsets, cpp_build.load_grouped_gemm_ops())


_BACKENDS = {"torch_grouped_mm": _grouped_mm, "loop": _loop, "grouped_gemm": _grouped_gemm_pkg, "cpp": _cpp}
_cpp_noticed = False


def _cpp_available() -> bool:
    """Whether the C++ CPU grouped GEMM runs here (building it on first use); a one-time notice if not."""
    global _cpp_noticed
    ok, reason = cpp_build.cpp_status(build=True)
    if not ok and not _cpp_noticed:
        _cpp_noticed = True
        warnings.warn(f"moetron: C++ CPU grouped GEMM unavailable ({reason}); experts use torch._grouped_mm "
                      "or a per-expert loop", RuntimeWarning, stacklevel=4)
    return ok


def resolve_backend(name: str, x: torch.Tensor, w_EOH: torch.Tensor) -> str:
    """Pick the backend for `auto`; check a named one can run."""
    if name == "cpp":
        if x.device.type != "cpu":
            raise ValueError(f"expert_backend=cpp runs CPU tensors only, got tokens on {x.device}: "
                             "use expert_backend='auto'")
        ok, reason = cpp_build.cpp_status(build=True)
        if not ok:
            raise RuntimeError(f"expert_backend=cpp was requested but is unavailable: {reason}")
        return name
    if name != "auto":
        if name != "loop":
            backends.require(name)
        if name == "torch_grouped_mm" and not _aligned(x, w_EOH.shape[-1], w_EOH.shape[-2]):
            raise ValueError(f"torch_grouped_mm needs row sizes that are multiples of 16 bytes; "
                             f"got in={w_EOH.shape[-1]} out={w_EOH.shape[-2]} in {x.dtype}: "
                             f"use expert_backend='loop' or 'auto'")
        if name == "grouped_gemm":
            check_grouped_gemm(x, w_EOH)
        return name
    usable_dtype = x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.is_cuda:
        # torch._grouped_mm runs bf16 on sm90/sm100's own kernel; other dtypes and GPUs take torch's
        # fallback, which loops over the groups and reads the offsets on the host (a sync per call,
        # like the loop backend). Only the native kernel is sync-free.
        major, _ = torch.cuda.get_device_capability(x.device)
        aligned = _aligned(x, w_EOH.shape[-1], w_EOH.shape[-2])
        if hasattr(torch, "_grouped_mm") and major >= 8 and usable_dtype and aligned:
            return "torch_grouped_mm"
        bf16 = x.dtype == torch.bfloat16 and w_EOH.dtype == torch.bfloat16
        return "grouped_gemm" if bf16 and backends._has_module("grouped_gemm") else "loop"
    if x.device.type == "cpu" and _cpp_available():
        return "cpp"
    if hasattr(torch, "_grouped_mm") and usable_dtype and _aligned(x, w_EOH.shape[-1], w_EOH.shape[-2]):
        return "torch_grouped_mm"
    return "loop"


def grouped_linear(x_NH: torch.Tensor, w_EOH: torch.Tensor, rows_per_expert: torch.Tensor,
                   backend: str = "auto") -> torch.Tensor:
    """`y[rows of e] = x[rows of e] @ w[e].T` for consecutive row blocks, one per expert."""
    if x_NH.shape[0] == 0:
        return x_NH.new_zeros(0, w_EOH.shape[-2]) + 0 * (w_EOH.sum() + x_NH.sum())  # keep both in the graph
    return _BACKENDS[resolve_backend(backend, x_NH, w_EOH)](x_NH, w_EOH, rows_per_expert)
