"""FP8 GEMMs (tensorwise `torch._scaled_mm` on capable GPUs, emulated elsewhere) and the FP8 linear
and grouped-linear autograd functions. Quantization and recipes: fp8.py.

Design notes: docs/fp8.md (`moetron/precision/fp8.py`).
"""

from __future__ import annotations

import torch

from moetron import backends
from moetron.moe.grouped_gemm import grouped_linear
from moetron.precision.fp8 import (FP8Recipe, Quantized, quantize_for_wgrad, quantize_operand,
                                   quantize_weight_for_dgrad)


# ---- GEMMs ---------------------------------------------------------------------------------


def _scaled_mm_supported(device: torch.device) -> bool:
    if not hasattr(torch, "_scaled_mm"):
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return False


def check_backend(recipe: FP8Recipe) -> None:
    """Raise a clear error when the recipe names a backend that cannot run here."""
    if recipe.backend == "te":
        backends.require("transformer_engine")
    elif recipe.backend == "torch" and not hasattr(torch, "_scaled_mm"):
        raise RuntimeError("FP8 backend 'torch' was requested but this torch build has no torch._scaled_mm; "
                           "use backend='emulate' or 'auto'")


def _use_scaled_mm(backend: str, device: torch.device, tensorwise_scales: bool, dims: tuple[int, ...],
                   what: str) -> bool:
    """Whether a GEMM runs on torch._scaled_mm ('torch'), or is emulated; a named 'torch' backend
    that cannot run it raises."""
    if backend == "emulate":
        return False
    aligned = device.type != "cuda" or all(d % 16 == 0 for d in dims)
    ok = tensorwise_scales and aligned and _scaled_mm_supported(device)
    if backend == "torch" and not ok:
        why = ("its operands are not tensorwise-scaled" if not tensorwise_scales else
               f"dims {dims} are not multiples of 16" if not aligned else
               f"torch._scaled_mm does not run on {device}")
        raise RuntimeError(f"FP8 backend 'torch' cannot run the {what}: {why}; use backend='auto' or 'emulate'")
    return ok


def _scaled_mm(a_data, b_data, scale_a, scale_b, out_dtype):
    """a [M,K] @ b [N,K]^T with torch._scaled_mm (a row-major, b column-major)."""
    return torch._scaled_mm(a_data.contiguous(), b_data.contiguous().t(), scale_a=scale_a.reshape(()).float(),
                            scale_b=scale_b.reshape(()).float(), out_dtype=out_dtype)


def fp8_gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype, backend: str = "auto") -> torch.Tensor:
    """`deq(a) @ deq(b).T` for `a [M,K]`, `b [N,K]`, accumulated in fp32, returned in `out_dtype`."""
    (M, K), N = a.data.shape, b.data.shape[0]
    if _use_scaled_mm(backend, a.data.device, a.is_tensorwise and b.is_tensorwise, (M, K, N), "FP8 GEMM"):
        return _scaled_mm(a.data, b.data, a.scale, b.scale, out_dtype)
    return (a.dequantize() @ b.dequantize().t()).to(out_dtype)


def _rows_of(q: Quantized, start: int, end: int) -> Quantized:
    row_map = None if q.row_map is None else q.row_map[start:end]
    return Quantized(q.data[start:end], q.scale, row_map, q.col_map)


def _group_scale(q: Quantized, g: int) -> torch.Tensor:
    """The scale of group `g` of a per-group-rows or per-expert quantization."""
    return q.scale.reshape(-1)[g] if q.scale.numel() > 1 else q.scale.reshape(())


def _per_group_rows(q: Quantized) -> bool:
    """One scale per group of rows (or per tensor): tensorwise/delayed activations and gradients."""
    return q.col_map is None and q.scale.dim() == 2 and q.scale.shape[-1] == 1


def _per_expert_weight(q: Quantized) -> bool:
    return q.row_map is None and q.col_map is None and q.scale.shape[-2:] == (1, 1)


def _check_padded(counts: list[int], device: torch.device) -> None:
    if device.type == "cuda" and any(n % 16 for n in counts):
        raise RuntimeError(f"FP8 grouped GEMMs on CUDA need each expert's rows padded to a multiple of 16; "
                           f"got {counts} (set the MoE layer's pad_multiple, as apply_fp8 does)")


def fp8_grouped_gemm(qx: Quantized, qw: Quantized, rows_per_expert: torch.Tensor, out_dtype: torch.dtype,
                     backend: str = "auto", expert_backend: str = "auto") -> torch.Tensor:
    """`y[rows of e] = deq(x[rows of e]) @ deq(w[e]).T` for `x [N,K]`, `w [E,O,K]`.

    Emulated through the expert GEMM seam (`grouped_linear`, in fp32); the torch backend runs one
    `torch._scaled_mm` per expert (one host sync for the row counts)."""
    E, O, K = qw.data.shape
    device = qx.data.device
    if _use_scaled_mm(backend, device, _per_group_rows(qx) and _per_expert_weight(qw), (K, O),
                      "FP8 grouped GEMM"):
        counts = rows_per_expert.tolist()
        _check_padded(counts, device)
        outs, start = [], 0
        for e, n in enumerate(counts):
            xe = _rows_of(qx, start, start + n)
            outs.append(_scaled_mm(xe.data, qw.data[e], _group_scale(qx, e), _group_scale(qw, e), out_dtype)
                        if n else qx.data.new_zeros(0, O, dtype=out_dtype))
            start += n
        return torch.cat(outs)
    return grouped_linear(qx.dequantize(), qw.dequantize(), rows_per_expert, expert_backend).to(out_dtype)


def fp8_grouped_wgrad(qdy: Quantized, qx: Quantized, rows_per_expert: torch.Tensor, out_dtype: torch.dtype,
                      backend: str = "auto") -> torch.Tensor:
    """`dw[e] = deq(dy[rows of e]).T @ deq(x[rows of e])` -> `[E,O,K]` (contraction over tokens)."""
    (N, O), K = qdy.data.shape, qx.data.shape[1]
    device = qx.data.device
    if _use_scaled_mm(backend, device, _per_group_rows(qdy) and _per_group_rows(qx), (O, K),
                      "FP8 weight-gradient grouped GEMM"):
        counts = rows_per_expert.tolist()
        _check_padded(counts, device)
        outs, start = [], 0
        for e, n in enumerate(counts):
            dy_e, x_e = _rows_of(qdy, start, start + n), _rows_of(qx, start, start + n)
            outs.append(_scaled_mm(dy_e.data.t(), x_e.data.t(), _group_scale(qdy, e), _group_scale(qx, e),
                                   out_dtype) if n else qx.data.new_zeros(O, K, dtype=out_dtype))
            start += n
        return torch.stack(outs)
    dy, x = qdy.dequantize(), qx.dequantize()
    if device.type == "cpu" and hasattr(torch, "_grouped_mm") and N % 4 == 0 and O % 4 == 0 and K % 4 == 0:
        offsets = torch.cumsum(rows_per_expert, 0).to(torch.int32)
        return torch._grouped_mm(dy.t().contiguous(), x, offs=offsets).to(out_dtype)
    counts = rows_per_expert.tolist()
    return torch.stack([d.t() @ xe for d, xe in zip(dy.split(counts), x.split(counts))]).to(out_dtype)


# ---- the FP8 linear functions (autograd) -------------------------------------------------------


def _reducer(reducers, role: str):
    return None if reducers is None else reducers.get(role)


class _FP8Linear(torch.autograd.Function):
    """y = x W^T (+ b) with the three GEMMs of a linear layer in FP8:
    fprop Q(x)·Q(W)^T, dgrad Q(dy)·Q(W), wgrad Q'(dy)^T·Q'(x) (Q' = 128×1 tiles under blockwise).
    `reducers` (role -> amax reduction) and `qweight` (Q(W) given, e.g. gathered in FP8): fp8_linear."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, history, backend, reducers=None, qweight=None, qweight_dgrad=None):
        x2 = x.reshape(-1, x.shape[-1])
        qx = quantize_operand(x2, "input", recipe, history, reduce_amax=_reducer(reducers, "input"))
        qw = qweight if qweight is not None else quantize_operand(weight, "weight", recipe, history,
                                                                  reduce_amax=_reducer(reducers, "weight"))
        y = fp8_gemm(qx, qw, x.dtype, backend)
        if bias is not None:
            y = y + bias.to(y.dtype)
        qx_w = quantize_for_wgrad(x2, qx, "input", recipe) if ctx.needs_input_grad[1] else None
        qw_d = qweight_dgrad if qweight_dgrad is not None else quantize_weight_for_dgrad(weight, qw, recipe)
        ctx.recipe, ctx.backend, ctx.history, ctx.reducers = recipe, backend, history, reducers
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x.shape, x.dtype, weight.dtype, bias is not None
        ctx.has_qx = qx_w is not None
        ctx.save_for_backward(*qw_d.tensors(), *(qx_w.tensors() if qx_w is not None else ()))
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        qw = Quantized(*saved[:4])
        dy2 = dy.reshape(-1, dy.shape[-1])
        recipe, backend = ctx.recipe, ctx.backend
        qdy = quantize_operand(dy2, "grad_output", recipe, ctx.history,
                               reduce_amax=_reducer(ctx.reducers, "grad_output"))
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = fp8_gemm(qdy, qw.t(), ctx.x_dtype, backend).view(ctx.x_shape)
        if ctx.needs_input_grad[1] and ctx.has_qx:
            qx = Quantized(*saved[4:8])
            qdy_w = quantize_for_wgrad(dy2, qdy, "grad_output", recipe)
            dw = fp8_gemm(qdy_w.t(), qx.t(), ctx.w_dtype, backend)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.float().sum(0).to(dy.dtype)
        return dx, dw, db, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: FP8Recipe,
               history: torch.Tensor | None = None, backend: str | None = None, *,
               reducers: dict | None = None, qweight: Quantized | None = None,
               qweight_dgrad: Quantized | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with FP8 GEMMs in forward and backward.

    `history` is the `[3, L, 1]` amax history (input, weight, grad_output) that delayed scaling
    reads and updates in place; `backend` overrides `recipe.backend` ('emulate', 'torch', 'auto').
    `reducers`: role -> `reduce_amax` callable (fp8.quantize_operand; tensor parallel). `qweight`:
    the weight already quantized as the recipe would (FP8 parameter all-gather, the per-step weight
    cache); used as Q(W). `qweight_dgrad`: its input-gradient operand (quantize_weight_for_dgrad).
    """
    if recipe.scaling == "delayed" and history is None:
        raise ValueError("delayed FP8 scaling needs the module's amax history (history=...)")
    backend = backend or recipe.backend
    if backend == "te":
        raise ValueError("fp8_linear runs the emulate/torch GEMMs; Transformer Engine runs as a module "
                         "(FP8Linear with backend 'te')")
    return _FP8Linear.apply(x, weight, bias, recipe, history, backend, reducers, qweight, qweight_dgrad)


class _FP8GroupedLinear(torch.autograd.Function):
    """`grouped_linear` with FP8 GEMMs: per-expert scales (tensorwise/delayed) or tiles (blockwise)."""

    @staticmethod
    def forward(ctx, x, weight, rows_per_expert, recipe, history, backend, expert_backend, reducers=None,
                qweight=None, qweight_dgrad=None):
        qx = quantize_operand(x, "input", recipe, history, rows_per_expert, _reducer(reducers, "input"))
        qw = qweight if qweight is not None else quantize_operand(weight, "weight", recipe, history,
                                                                  reduce_amax=_reducer(reducers, "weight"))
        y = fp8_grouped_gemm(qx, qw, rows_per_expert, x.dtype, backend, expert_backend)
        qx_w = quantize_for_wgrad(x, qx, "input", recipe, rows_per_expert)
        qw_d = qweight_dgrad if qweight_dgrad is not None else quantize_weight_for_dgrad(weight, qw, recipe)
        ctx.recipe, ctx.backend, ctx.history, ctx.expert_backend = recipe, backend, history, expert_backend
        ctx.reducers = reducers
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.save_for_backward(rows_per_expert, *qw_d.tensors(), *qx_w.tensors())
        return y

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        rows, qw, qx = saved[0], Quantized(*saved[1:5]), Quantized(*saved[5:9])
        recipe, backend = ctx.recipe, ctx.backend
        dy = dy.contiguous()
        qdy = quantize_operand(dy, "grad_output", recipe, ctx.history, rows, _reducer(ctx.reducers, "grad_output"))
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = fp8_grouped_gemm(qdy, qw.t(), rows, ctx.x_dtype, backend, ctx.expert_backend)
        if ctx.needs_input_grad[1]:
            qdy_w = quantize_for_wgrad(dy, qdy, "grad_output", recipe, rows)
            dw = fp8_grouped_wgrad(qdy_w, qx, rows, ctx.w_dtype, backend)
        return dx, dw, None, None, None, None, None, None, None, None


def fp8_grouped_linear(x_NK: torch.Tensor, w_EOK: torch.Tensor, rows_per_expert: torch.Tensor,
                       recipe: FP8Recipe, history: torch.Tensor | None = None, backend: str | None = None,
                       expert_backend: str = "auto", *, reducers: dict | None = None,
                       qweight: Quantized | None = None, qweight_dgrad: Quantized | None = None) -> torch.Tensor:
    """`moetron.moe.grouped_gemm.grouped_linear` with FP8 GEMMs (forward and backward).

    `history` is the `[3, L, E]` amax history for delayed scaling (one column per local expert).
    `expert_backend` is the high-precision grouped GEMM the emulation runs on. `reducers`, `qweight`:
    as fp8_linear (expert-tensor-parallel ranks reduce the amaxes of their ffn slices)."""
    if recipe.scaling == "delayed" and history is None:
        raise ValueError("delayed FP8 scaling needs the module's amax history (history=...)")
    backend = backend or recipe.backend
    if x_NK.shape[0] == 0:  # keep both in the graph, as grouped_linear does
        return x_NK.new_zeros(0, w_EOK.shape[-2]) + 0 * (w_EOK.sum() + x_NK.sum())
    return _FP8GroupedLinear.apply(x_NK, w_EOK, rows_per_expert, recipe, history, backend, expert_backend,
                                   reducers, qweight, qweight_dgrad)


__all__ = ["check_backend", "fp8_gemm", "fp8_grouped_gemm", "fp8_grouped_linear", "fp8_grouped_wgrad", "fp8_linear"]
