"""Permute / unpermute (`permute`, `unpermute`): implementation selection and the fused autograd
functions over the references of permute_reference.py.

Design notes: docs/dispatch.md (`moetron/dispatch/permute.py`).
"""

from __future__ import annotations

import os
import warnings
from typing import Callable

import torch
from torch.autograd.function import once_differentiable

from moetron.dispatch import permute_reference as ref
from moetron.dispatch.permute_reference import (PermuteState, check_permute_args, permute_reference, routing_plan,
                                                unpermute_reference)
from moetron.kernels import availability, cpp_build

IMPLS = ("auto", "torch", "cpp", "triton")

# None: by device - the Triton kernel for CUDA tensors (when Triton is installed), the torch
# reference elsewhere (the C++ CPU kernel is opt-in: it compiles on first use).
_default_impl: str | None = os.environ.get("MOETRON_PERMUTE_IMPL") or None
_default_deterministic = os.environ.get("MOETRON_PERMUTE_DETERMINISTIC", "0") == "1"
_fallback_noticed = False


def set_permute_impl(impl: str | None = "auto", *, deterministic: bool | None = None) -> None:
    """Process-wide default for `permute`/`unpermute` calls that pass no `impl`.

    It starts at None: triton for CUDA tensors when Triton is installed, torch otherwise.
    """
    global _default_impl, _default_deterministic
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"permute impl {impl!r} is unknown; choose one of {IMPLS}")
    _default_impl = impl
    if deterministic is not None:
        _default_deterministic = bool(deterministic)


def permute_impl() -> tuple[str, bool]:
    """The process-wide default `(impl, deterministic)`; impl "default" is the by-device choice."""
    return _default_impl or "default", _default_deterministic


# ---- availability ----

def _triton_installed() -> bool:
    return availability.triton_installed()


def _triton_status(device: torch.device) -> tuple[bool, str]:
    return availability.triton_status(device, "moetron.kernels.triton_permute", _triton_installed())


_cpp_status = availability.cpp_status


def impl_status(device: torch.device | str = "cpu", build: bool = False) -> list[tuple[str, bool, str]]:
    """`(impl, available, reason)` for tensors on `device`; `build=True` compiles the C++ kernel to know."""
    device = torch.device(device)
    return [("torch", True, "torch reference, any device"),
            ("cpp", *_cpp_status(device, build)),
            ("triton", *_triton_status(device))]


def resolve(impl: str | None, deterministic: bool | None, device: torch.device) -> tuple[str, bool]:
    """The concrete implementation for tensors on `device`: never "auto", never an unavailable one."""
    global _fallback_noticed
    impl = _default_impl if impl is None else impl
    deterministic = _default_deterministic if deterministic is None else bool(deterministic)
    if impl is None:  # the by-device default
        impl = "triton" if device.type == "cuda" and _triton_status(device)[0] else "torch"
    if impl not in IMPLS:
        raise ValueError(f"permute impl {impl!r} is unknown; choose one of {IMPLS}")
    if impl == "torch":
        return impl, deterministic
    if impl == "auto":
        if device.type == "cuda" and _triton_status(device)[0]:
            return "triton", deterministic
        if device.type == "cpu":
            ok, reason = _cpp_status(device, build=True)
            if ok:
                return "cpp", deterministic
            if not _fallback_noticed:
                _fallback_noticed = True
                warnings.warn(f"moetron: fused C++ permute unavailable ({reason}); using the torch reference",
                              RuntimeWarning, stacklevel=3)
        return "torch", deterministic
    ok, reason = _cpp_status(device, build=True) if impl == "cpp" else _triton_status(device)
    if not ok:
        raise RuntimeError(f"permute impl {impl!r} was requested but is unavailable: {reason}")
    return impl, deterministic


# ---- kernel sets ----

class TorchKernels:
    """The deterministic reference, as a kernel set."""

    name = "torch"
    routing_plan = staticmethod(ref.routing_plan)
    gather_rows = staticmethod(ref.gather_rows_reference)
    reduce_slots = staticmethod(ref.reduce_slots_reference)
    unpermute_backward = staticmethod(ref.unpermute_backward_reference)


class CppKernels:
    name = "cpp"

    def __init__(self):


        self.ops = cpp_build.load_permute_ops()

    def routing_plan(self, topk_idx_TK, num_experts, pad_multiple=1, pad_to=None) -> PermuteState:
        T, K = topk_idx_TK.shape
        token_idx, slot_idx, rows, padded_pos, row_of_slot, slot_of_row = self.ops.routing_plan(
            topk_idx_TK, num_experts, pad_multiple, -1 if pad_to is None else pad_to)
        padded = pad_multiple != 1 or pad_to is not None
        return PermuteState(token_idx, slot_idx, T, rows, padded_pos if padded else None, topk=K,
                            row_of_slot=row_of_slot, slot_of_row=slot_of_row)

    def gather_rows(self, x_TH, slot_of_row, topk):
        return self.ops.gather_rows(x_TH, slot_of_row, topk)

    def reduce_slots(self, y_RH, row_of_slot, weights_TK, num_tokens, topk):
        return self.ops.reduce_slots(y_RH, row_of_slot, weights_TK, num_tokens, topk)

    def unpermute_backward(self, grad_TH, y_RH, slot_of_row, weights_TK, topk, need_grad_y, need_grad_w):
        grad_y, grad_w = self.ops.unpermute_backward(grad_TH, y_RH, slot_of_row, weights_TK, topk,
                                                     need_grad_y, need_grad_w)
        return grad_y if need_grad_y else None, grad_w if need_grad_w else None


class TritonKernels:
    name = "triton"
    routing_plan = staticmethod(ref.routing_plan)  # torch ops on the device: sort, counts, scatter

    def __init__(self):
        from moetron.kernels import triton_permute

        self.gather_rows = triton_permute.gather_rows
        self.reduce_slots = triton_permute.reduce_slots
        self.unpermute_backward = triton_permute.unpermute_backward


_kernel_sets: dict[str, object] = {}
_factories: dict[str, Callable[[], object]] = {"torch": TorchKernels, "cpp": CppKernels, "triton": TritonKernels}


def kernels_for(impl: str):
    """The kernel set of a concrete implementation (resolve "auto" first)."""
    if impl not in _kernel_sets:
        _kernel_sets[impl] = _factories[impl]()
    return _kernel_sets[impl]


# ---- autograd ----

class _FusedPermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, state: PermuteState, kernels):
        ctx.state, ctx.kernels = state, kernels
        return kernels.gather_rows(x_TH.contiguous(), state.slot_of_row, state.topk)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_RH):
        s = ctx.state
        grad_x = ctx.kernels.reduce_slots(grad_RH.contiguous(), s.row_of_slot, None, s.num_tokens, s.topk)
        return grad_x, None, None


class _FusedUnpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RH, weights_TK, state: PermuteState, kernels):
        ctx.state, ctx.kernels = state, kernels
        y_RH = y_RH.contiguous()
        if weights_TK is not None:
            weights_TK = weights_TK.contiguous()
        ctx.save_for_backward(y_RH if weights_TK is not None and ctx.needs_input_grad[1] else None, weights_TK)
        return kernels.reduce_slots(y_RH, state.row_of_slot, weights_TK, state.num_tokens, state.topk)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_TH):
        y_RH, weights_TK = ctx.saved_tensors
        s, kernels = ctx.state, ctx.kernels
        need_y, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_TH = grad_TH.contiguous()
        if weights_TK is None:
            return (kernels.gather_rows(grad_TH, s.slot_of_row, s.topk) if need_y else None), None, None, None
        grad_y, grad_w = kernels.unpermute_backward(grad_TH, y_RH, s.slot_of_row, weights_TK, s.topk,
                                                    need_y, need_w)
        return grad_y, grad_w, None, None


def fused_permute(x_TH: torch.Tensor, state: PermuteState, impl: str) -> torch.Tensor:
    return _FusedPermute.apply(x_TH, state, kernels_for(impl))


def fused_unpermute(y_RH: torch.Tensor, state: PermuteState, weights_TK: torch.Tensor | None,
                    impl: str) -> torch.Tensor:
    if weights_TK is not None:
        weights_TK = weights_TK.reshape(state.num_tokens, state.topk)
    return _FusedUnpermute.apply(y_RH, weights_TK, state, kernels_for(impl))


# ---- the public entry points ----------------------------------------------------------------


def permute(
    x_TH: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    num_experts: int,
    *,
    pad_multiple: int = 1,
    pad_to: int | None = None,
    impl: str | None = None,
    deterministic: bool | None = None,
    dropless: bool | None = None,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PermuteState]:
    """Gather rows of `x_TH` by routing. Returns `(x_NH, state)`.

    `pad_multiple` pads each expert's rows with zeros to a multiple (FP8 grouped
    GEMMs need 16); `pad_to` pads every expert to exactly that many rows (capacity
    padding). `dropless=True` promises no -1 slots, which spares the torch / Triton plan its
    one host sync (the check for dropped slots).
    `impl` picks the implementation (see `permute_kernels`); `deterministic` makes the
    backward (a sum over each token's k slots) run in a fixed order. `counts`: the router's slots per
    expert (`Routing.tokens_per_expert`), reused by a dropless torch / Triton plan.
    """
    check_permute_args(x_TH, topk_idx_TK, num_experts, pad_multiple, pad_to)
    topk_idx_TK = topk_idx_TK.long()
    impl, deterministic = resolve(impl, deterministic, x_TH.device)
    if impl in ("torch", "triton"):  # torch ops (on the GPU for Triton)
        state = routing_plan(topk_idx_TK, num_experts, pad_multiple, pad_to, dropless, counts)
    else:
        state = kernels_for(impl).routing_plan(topk_idx_TK, num_experts, pad_multiple, pad_to)
    state.impl, state.deterministic = impl, deterministic
    if impl == "torch" and not deterministic:
        return permute_reference(x_TH, state), state
    return fused_permute(x_TH, state, impl), state


def unpermute(
    y_NH: torch.Tensor,
    state: PermuteState,
    topk_weights_TK: torch.Tensor | None = None,
    *,
    impl: str | None = None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """Scatter-add expert outputs back to tokens, multiplied by their gate weights.

    `impl` and `deterministic` default to what `permute` used (kept in `state`).
    """
    if y_NH.dim() != 2 or y_NH.shape[0] != state.num_rows:
        raise ValueError(f"unpermute: y must be [rows={state.num_rows}, hidden], got {tuple(y_NH.shape)}")
    if topk_weights_TK is not None and state.topk is not None and (
            topk_weights_TK.numel() != state.num_tokens * state.topk):
        raise ValueError(f"unpermute: topk_weights must be [tokens={state.num_tokens}, k={state.topk}], "
                         f"got {tuple(topk_weights_TK.shape)}")
    impl = state.impl if impl is None else impl
    deterministic = state.deterministic if deterministic is None else deterministic
    impl, deterministic = resolve(impl, deterministic, y_NH.device)
    if impl == "torch" and not deterministic:
        return unpermute_reference(y_NH, state, topk_weights_TK)
    if state.row_of_slot is None or state.slot_of_row is None or state.topk is None:
        raise ValueError(f"unpermute: impl={impl!r} (deterministic={deterministic}) needs the slot maps that "
                         "permute() and routing_plan() fill in PermuteState; this state has none")
    return fused_unpermute(y_NH, state, topk_weights_TK, impl)


def row_weights(state: PermuteState, weights: torch.Tensor | None) -> torch.Tensor | None:
    """`probs_N[r] = weights.flat[slot_of_row[r]]` (fp32), 0 on padding rows; differentiable: the
    routing weight of every permuted row, for experts that apply it (moe/layer.py: probs_on_experts)."""
    if weights is None or state.slot_of_row is None:
        return None
    slot = state.slot_of_row
    flat = weights.reshape(-1).float()
    if flat.numel() == 0:  # no token: keep the weights in the graph (their gradient is zeros)
        return flat.new_zeros(slot.numel()) + 0 * flat.sum()
    if state.padded_pos is None:  # no padding row: no -1 in slot_of_row
        return flat.index_select(0, slot)
    return torch.where(slot >= 0, flat.index_select(0, slot.clamp_min(0)), 0.0)
