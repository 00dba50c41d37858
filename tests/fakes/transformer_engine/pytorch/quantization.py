"""transformer_engine/pytorch/quantization.py (fake): support checks, `autocast` / `fp8_autocast`, the
global FP8 state, and the quantize -> dequantize rules of each recipe (written here, in torch).

Delayed scaling as TE does it: a module quantizes with the scale computed at the previous update
(1.0 at first) and records its amax in history slot 0; at the exit of the outermost forward
autocast region the recorded amaxes are all-reduced (MAX) over `amax_reduction_group` (WORLD when
None, as `torch.distributed.all_reduce(group=None)` does), then scale = fmax / amax / 2^margin and
the history rolls. Simplification: the grad_output amaxes are reduced and updated at the end of each
module's backward (TE does it once per backward region), over the group of its forward region.
"""

import warnings
from typing import Optional, Tuple

import torch
import torch.distributed as dist

import transformer_engine
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
                                              MXFP8BlockScaling, Recipe)
from transformer_engine.pytorch.utils import get_device_compute_capability

FP8_DTYPE = {Format.E4M3: (torch.float8_e4m3fn, torch.float8_e4m3fn),
             Format.HYBRID: (torch.float8_e4m3fn, torch.float8_e5m2)}


def _cuda_version() -> float:
    major, minor = transformer_engine.MOETRON_FAKE_DEVICE["cuda"]
    return major + minor / 10


def check_fp8_support() -> Tuple[bool, str]:
    if get_device_compute_capability() >= (9, 0):
        return True, ""
    if get_device_compute_capability() < (8, 9):
        return False, "Device compute capability 8.9 or higher required for FP8 execution."
    if _cuda_version() < 12.1:
        return False, "Cuda version 12.1 or higher required for FP8 execution on Ada."
    return True, ""


def check_mxfp8_support() -> Tuple[bool, str]:
    if get_device_compute_capability() >= (12, 0):
        return False, "MXFP8 (for all gemm layouts) is not supported on 12.0+ architectures yet."
    if get_device_compute_capability() >= (10, 0):
        return True, ""
    return False, "Device compute capability 10.0 or higher required for MXFP8 execution."


def check_fp8_block_scaling_support() -> Tuple[bool, str]:
    if get_device_compute_capability() >= (9, 0) and _cuda_version() >= 12.9:
        return True, ""
    return False, "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."


def check_recipe_support(recipe: Recipe) -> None:
    ok, reason = True, ""
    if isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        ok, reason = check_fp8_support()
    elif isinstance(recipe, Float8BlockScaling):
        ok, reason = check_fp8_block_scaling_support()
    elif isinstance(recipe, MXFP8BlockScaling):
        ok, reason = check_mxfp8_support()
    if not ok:
        raise RuntimeError(reason)


def get_default_fp8_recipe() -> Recipe:
    if check_mxfp8_support()[0]:
        return MXFP8BlockScaling()
    if get_device_compute_capability() >= (12, 0):
        return Float8CurrentScaling()
    return DelayedScaling()


class FP8GlobalStateManager:
    """The autocast state: enabled, recipe, group, depth, and the delayed-scaling metas used in the
    current outermost region (reduced and updated at its exit)."""

    fp8_enabled = False
    fp8_recipe: Optional[Recipe] = None
    fp8_group = None
    autocast_depth = 0
    region_metas: list = []
    autocast_log: list = []  # (recipe class name, group) per outermost region: what tests inspect

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.fp8_enabled

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        return cls.fp8_recipe

    @classmethod
    def get_fp8_group(cls):
        return cls.fp8_group

    @classmethod
    def reset(cls) -> None:
        cls.fp8_enabled, cls.fp8_recipe, cls.fp8_group, cls.autocast_depth = False, None, None, 0
        cls.region_metas, cls.autocast_log = [], []


def fp8_max(recipe: Recipe, forward: bool) -> float:
    return recipe.fp8_format.value.max_fwd if forward else recipe.fp8_format.value.max_bwd


def reduce_amax(amax: torch.Tensor, recipe: DelayedScaling, group) -> None:
    if recipe.reduce_amax and dist.is_initialized() and dist.get_world_size(group=group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)


def update_delayed(meta: "DelayedMeta", amax: torch.Tensor, slots: slice, forward: bool) -> None:
    """After the reduction: history slot 0 := the reduced amax, then scale and roll (TE's update)."""
    recipe = meta.recipe
    meta.history[0, slots] = amax
    hist = meta.history[:, slots]
    used = hist.max(dim=0).values if recipe.amax_compute_algo == "max" else hist[0].clone()
    sf = (fp8_max(recipe, forward) / used) / (2 ** recipe.margin)
    scale = meta.scale[slots]
    sf = torch.where((used > 0) & torch.isfinite(used), sf, scale)
    meta.scale[slots] = sf
    if meta.history.shape[0] > 1:
        meta.history[:, slots] = torch.roll(hist, -1, 0)
    meta.history[0, slots] = 0.0


class DelayedMeta:
    """A module's delayed-scaling state: history [len, 3 * gemms] and scales [3 * gemms] (TE's fp8_meta),
    roles ordered input, weight, grad_output per GEMM."""

    def __init__(self, recipe: DelayedScaling, gemms: int):
        self.recipe, self.gemms = recipe, gemms
        self.history = torch.zeros(recipe.amax_history_len, 3 * gemms)
        self.scale = torch.ones(3 * gemms)
        self.group = None

    def slot(self, gemm: int, role: int) -> int:
        return 3 * gemm + role

    def fwd_slots(self):
        return [i for i in range(3 * self.gemms) if i % 3 != 2]


def _end_region() -> None:
    metas, FP8GlobalStateManager.region_metas = FP8GlobalStateManager.region_metas, []
    if not metas or not torch.is_grad_enabled():
        return
    recipe, group = metas[0].recipe, FP8GlobalStateManager.fp8_group
    amax = torch.cat([m.history[0, m.fwd_slots()] for m in metas])
    reduce_amax(amax, recipe, group)
    start = 0
    for m in metas:
        n = len(m.fwd_slots())
        for k, i in enumerate(m.fwd_slots()):
            update_delayed(m, amax[start + k], slice(i, i + 1), True)
        start += n


class autocast:
    """TE's `autocast(enabled, calibrating, recipe, amax_reduction_group, _graph)`."""

    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
                 amax_reduction_group=None, _graph: bool = False) -> None:
        self._enabled, self._calibrating, self._recipe = enabled, calibrating, recipe
        self._amax_reduction_group, self._graph, self._fp8_state = amax_reduction_group, _graph, None

    def __enter__(self) -> "autocast":
        if self._fp8_state is not None:
            raise RuntimeError("autocast context manager cannot be entered more than once concurrently")
        recipe = get_default_fp8_recipe() if self._recipe is None else self._recipe
        if self._enabled:
            check_recipe_support(recipe)
        m = FP8GlobalStateManager
        self._fp8_state = (m.fp8_enabled, m.fp8_recipe, m.fp8_group)
        if m.autocast_depth == 0:
            m.autocast_log.append((type(recipe).__name__, self._amax_reduction_group))
        m.fp8_enabled, m.fp8_recipe, m.fp8_group = self._enabled, recipe, self._amax_reduction_group
        m.autocast_depth += 1
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        m = FP8GlobalStateManager
        try:
            m.autocast_depth -= 1
            if self._enabled and m.autocast_depth == 0 and not self._graph and exc_type is None:
                _end_region()
            m.fp8_enabled, m.fp8_recipe, m.fp8_group = self._fp8_state
        finally:
            self._fp8_state = None


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Recipe] = None,
                 fp8_group=None, _graph: bool = False) -> autocast:
    warnings.warn("fp8_autocast is deprecated and will be removed in a future release. Use autocast(enabled=..., "
                  "calibrating=..., recipe=..., group=..., _graph=...) instead.", category=DeprecationWarning,
                  stacklevel=2)
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group,
                    _graph=_graph)


# ---- quantize -> dequantize (fp32 result), one rule per recipe ----------------------------------


def _cast(x: torch.Tensor, mult: torch.Tensor, dtype: torch.dtype, fmax: float) -> torch.Tensor:
    """x * scale, saturated, rounded to `dtype`, times scale_inv = 1 / scale (TE keeps both)."""
    return (x * mult).clamp(-fmax, fmax).to(dtype).float() * (1.0 / mult)


def qdq_tensor(x: torch.Tensor, dtype: torch.dtype, fmax: float, scale: Optional[torch.Tensor] = None,
               power_2: bool = False) -> torch.Tensor:
    """Per-tensor: the given (delayed) scale, or the current one fmax / amax."""
    x = x.float()
    if scale is None:
        amax = x.abs().amax() if x.numel() else x.new_zeros(())
        scale = torch.where(amax > 0, fmax / amax, torch.ones_like(amax))
        if power_2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
    return _cast(x, scale, dtype, fmax)


def qdq_blocks(x: torch.Tensor, dtype: torch.dtype, fmax: float, rows: int, cols: int, mx: bool) -> torch.Tensor:
    """One scale per rows x cols block of a 2-D tensor (partial edge blocks their own): TE's
    power-of-two scale 2^floor(log2(fmax / amax)), or MXFP8's E8M0 2^-ceil(log2(amax / fmax))."""
    x = x.float()
    R, C = x.shape
    pr, pc = -R % rows, -C % cols
    xb = torch.nn.functional.pad(x, (0, pc, 0, pr)).view((R + pr) // rows, rows, (C + pc) // cols, cols)
    amax = xb.abs().amax(dim=(1, 3), keepdim=True)
    if mx:
        scale = torch.exp2(-torch.ceil(torch.log2(amax / fmax)))
        scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    else:
        scale = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(fmax / amax))), torch.ones_like(amax))
    out = (xb * scale).clamp(-fmax, fmax).to(dtype).float() * (1.0 / scale)
    return out.view(R + pr, C + pc)[:R, :C]


def operand(x2: torch.Tensor, role: str, usage: str, recipe: Recipe, meta_scale=None) -> torch.Tensor:
    """The dequantized operand of `role` (input, weight, grad_output) for `usage` "rowwise" (the
    GEMM contracts its last dim) or "columnwise" (contracts its first dim)."""
    fwd_dtype, bwd_dtype = FP8_DTYPE[recipe.fp8_format]
    forward = role != "grad_output"
    dtype, fmax = (fwd_dtype if forward else bwd_dtype), fp8_max(recipe, forward)
    if isinstance(recipe, DelayedScaling):
        return qdq_tensor(x2, dtype, fmax, meta_scale)
    if isinstance(recipe, Float8CurrentScaling):
        return qdq_tensor(x2, dtype, fmax, None, recipe.use_power_2_scales)
    if isinstance(recipe, Float8BlockScaling):
        dim = {"input": recipe.x_block_scaling_dim, "weight": recipe.w_block_scaling_dim,
               "grad_output": recipe.grad_block_scaling_dim}[role]
        if dim == 2:
            return qdq_blocks(x2, dtype, fmax, 128, 128, False)
        return qdq_blocks(x2, dtype, fmax, *((1, 128) if usage == "rowwise" else (128, 1)), False)
    if isinstance(recipe, MXFP8BlockScaling):
        return qdq_blocks(x2, dtype, fmax, *((1, 32) if usage == "rowwise" else (32, 1)), True)
    raise NotImplementedError(f"the TE fake does not implement {type(recipe).__name__}")
