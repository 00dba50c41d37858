"""FP8 training numerics: recipes, quantize/dequantize, and the FP8 GEMMs of a linear layer.

Design notes: docs/fp8.md (`moetron/precision/fp8.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moetron.dispatch.fp8_dispatch import quantize_rows
from moetron.precision.blockwise import quantize_blockwise

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FORMAT_MAX = {E4M3: 448.0, E5M2: 57344.0}
MANTISSA_BITS = {E4M3: 3, E5M2: 2}
MIN_NORMAL_EXP = {E4M3: -6, E5M2: -14}
TILE = 128
MX_BLOCK = 32  # MXFP8: 1x32 blocks, one E8M0 (power-of-two) scale each
MIN_SCALE = 1e-12  # all-zero tensors / tiles: any positive scale maps them to 0
SCALINGS = ("tensorwise", "delayed", "blockwise", "mxfp8")
FORMATS = ("hybrid", "e4m3")
GEMM_BACKENDS = ("auto", "emulate", "torch", "te")
ROLES = ("input", "weight", "grad_output")  # rows of a delayed-scaling amax history


# ---- recipes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FP8Recipe:
    """How FP8 GEMMs quantize their operands. Build with `tensorwise()`, `delayed()`,
    `blockwise()` or `get_fp8_recipe(name)`; fields are validated."""

    scaling: str
    fp8_format: str = "hybrid"
    amax_history_len: int = 1024  # delayed only
    amax_compute_algo: str = "max"  # delayed only: "max" | "most_recent"
    margin: int = 0  # delayed only: scale up by 2**margin for headroom
    power_of_two_scales: bool = False  # round every scale up to 2^k
    backend: str = "auto"
    grouped_pad_multiple: int = 16  # rows per expert padded to this (FP8 grouped GEMMs)

    def __post_init__(self) -> None:
        def fail(name, rule):
            raise ValueError(f"FP8Recipe.{name}={getattr(self, name)!r}: {rule}")

        if self.scaling not in SCALINGS:
            fail("scaling", f"choose one of {SCALINGS}")
        if self.fp8_format not in FORMATS:
            fail("fp8_format", f"choose one of {FORMATS}")
        if self.scaling == "blockwise" and self.fp8_format != "e4m3":
            fail("fp8_format", "blockwise scaling is E4M3 everywhere (DeepSeek-V3): use fp8_format='e4m3'")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            fail("amax_history_len", "must be a positive integer")
        if self.amax_compute_algo not in ("max", "most_recent"):
            fail("amax_compute_algo", "choose 'max' or 'most_recent'")
        if not isinstance(self.margin, int) or self.margin < 0:
            fail("margin", "must be an integer >= 0")
        if self.backend not in GEMM_BACKENDS:
            fail("backend", f"choose one of {GEMM_BACKENDS}")
        if self.backend == "torch" and self.scaling in ("blockwise", "mxfp8"):
            fail("backend", f"the torch backend runs tensorwise scales only; use 'auto', 'emulate' or 'te' "
                            f"for {self.scaling} scaling")
        if self.scaling == "mxfp8" and not self.power_of_two_scales:
            fail("power_of_two_scales", "mxfp8 scales are E8M0 (powers of two): leave it True")
        if self.scaling == "mxfp8" and self.grouped_pad_multiple % MX_BLOCK:
            fail("grouped_pad_multiple", f"mxfp8 grouped GEMMs need each expert's rows padded to a multiple of "
                                         f"{MX_BLOCK} (its 32x1 weight-gradient blocks)")
        if not isinstance(self.grouped_pad_multiple, int) or self.grouped_pad_multiple < 1:
            fail("grouped_pad_multiple", "must be a positive integer (16 for FP8 grouped GEMMs)")

    @property
    def forward_dtype(self) -> torch.dtype:
        return E4M3

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.fp8_format == "hybrid" else E4M3


def tensorwise(**overrides) -> FP8Recipe:
    """Current scaling, one scale per tensor (per expert); E4M3 forward, E5M2 gradients."""
    return FP8Recipe("tensorwise", **overrides)


def delayed(**overrides) -> FP8Recipe:
    """Delayed scaling from an amax history (TE's DelayedScaling defaults: 1024 entries, max)."""
    return FP8Recipe("delayed", **overrides)


def blockwise(**overrides) -> FP8Recipe:
    """DeepSeek-V3: 1×128 activation/gradient tiles, 128×128 weight blocks, E4M3 everywhere."""
    return FP8Recipe("blockwise", **{"fp8_format": "e4m3", **overrides})


def mxfp8(**overrides) -> FP8Recipe:
    """OCP MX (TE's MXFP8BlockScaling): 1x32 blocks along each GEMM's contraction dim with E8M0
    power-of-two scales; E4M3 by default; expert rows padded to 32."""
    return FP8Recipe("mxfp8", **{"fp8_format": "e4m3", "power_of_two_scales": True,
                                 "grouped_pad_multiple": MX_BLOCK, **overrides})


FP8_RECIPES = {"tensorwise": tensorwise, "delayed": delayed, "blockwise": blockwise, "mxfp8": mxfp8}


def get_fp8_recipe(name: str | FP8Recipe, **overrides) -> FP8Recipe:
    if isinstance(name, FP8Recipe):
        return replace(name, **overrides) if overrides else name
    if name not in FP8_RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}; choose one of {tuple(FP8_RECIPES)}")
    return FP8_RECIPES[name](**overrides)


# ---- quantized tensors -----------------------------------------------------------------------


@dataclass
class Quantized:
    """`data` (float8, [..., R, C]) with dequantization scales: element (i, j) is
    `data[..., i, j] * scale[..., row_map[i], col_map[j]]`. A map of None means identity when
    the scale has that dim's full size and broadcast when it has size 1."""

    data: torch.Tensor
    scale: torch.Tensor
    row_map: torch.Tensor | None = None
    col_map: torch.Tensor | None = None

    def expanded_scale(self) -> torch.Tensor:
        s = self.scale.float()
        if self.row_map is not None:
            s = s.index_select(-2, self.row_map)
        if self.col_map is not None:
            s = s.index_select(-1, self.col_map)
        return s

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.expanded_scale()).to(dtype)

    def t(self) -> Quantized:
        """The transposed tensor (last two dims), same quantization."""
        return Quantized(self.data.transpose(-2, -1), self.scale.transpose(-2, -1), self.col_map, self.row_map)

    @property
    def is_tensorwise(self) -> bool:
        return self.scale.numel() == 1

    def tensors(self) -> tuple:
        """Flattened for ctx.save_for_backward; rebuild with `Quantized(*tensors)`."""
        return self.data, self.scale, self.row_map, self.col_map


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0,
                    power_of_two: bool = False) -> torch.Tensor:
    """Dequantization scale mapping `amax` to the format maximum (times 2^margin headroom)."""
    scale = (amax.float() * (2.0 ** margin) / FORMAT_MAX[dtype]).clamp_min(MIN_SCALE)
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def cast_with_scale(x: torch.Tensor, expanded_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x / scale` rounded to `dtype`, saturating at the format maximum."""
    fmax = FORMAT_MAX[dtype]
    return (x.float() / expanded_scale).clamp(-fmax, fmax).to(dtype)


def group_of_rows(rows_per_group: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Group index of each of `num_rows` consecutive rows (no host sync)."""
    groups = torch.arange(rows_per_group.numel(), device=rows_per_group.device)
    return torch.repeat_interleave(groups, rows_per_group.to(groups.device), output_size=num_rows)


def group_amax(x_NK: torch.Tensor, group_of_row: torch.Tensor, num_groups: int) -> torch.Tensor:
    """amax of each group's rows `[G]` (0 for an empty group)."""
    out = x_NK.new_zeros(num_groups, dtype=torch.float32)
    if x_NK.numel():
        out.scatter_reduce_(0, group_of_row, x_NK.detach().abs().float().amax(dim=-1), "amax")
    return out


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                        row_map: torch.Tensor | None = None) -> Quantized:
    """Tensorwise (`scale` [1,1]) or per-group rows (`scale` [G,1] with `row_map` [R])."""
    scale = scale.float()
    expanded = scale if row_map is None else scale.index_select(0, row_map)
    return Quantized(cast_with_scale(x, expanded, dtype), scale, row_map, None)


def quantize_row_tiles(x_NK: torch.Tensor, power_of_two: bool = False, tile: int = TILE) -> Quantized:
    """E4M3 with one scale per 1×`tile` tile along the last dim (a last partial tile its own);
    `x` may be `[..., R, K]` (per-expert weights)."""
    data, scale = quantize_rows(x_NK.detach(), power_of_two=power_of_two, block=tile)
    col_map = torch.arange(x_NK.shape[-1], device=x_NK.device) // tile
    return Quantized(data, _e8m0(scale) if tile == MX_BLOCK else scale, None, col_map)


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    """MX scales stored as E8M0 where torch has the dtype (exact: they are powers of two)."""
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    return scale if e8m0 is None else scale.to(e8m0)


def quantize_weight_blocks(w: torch.Tensor, power_of_two: bool = False) -> Quantized:
    """E4M3 with one scale per 128×128 block of each `[O,K]` matrix (of each expert for 3-D)."""
    if w.dim() == 2:
        data, scale = quantize_blockwise(w.detach(), (TILE, TILE), power_of_two)
    else:
        pairs = [quantize_blockwise(w_e.detach(), (TILE, TILE), power_of_two) for w_e in w]
        data, scale = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    rows = torch.arange(w.shape[-2], device=w.device) // TILE
    cols = torch.arange(w.shape[-1], device=w.device) // TILE
    return Quantized(data, scale, rows, cols)


def quantize_token_tiles(x_NK: torch.Tensor, rows_per_group: torch.Tensor | None = None,
                         power_of_two: bool = False, dtype: torch.dtype = E4M3, tile: int = TILE) -> Quantized:
    """One scale per `tile`×1 tile (128×1; 32×1 for MXFP8): consecutive rows (tokens) of one column,
    tiles restarting at each group's first row (`rows_per_group`; one group when None). For the
    weight-gradient GEMM, whose contraction runs over tokens."""
    N, K = x_NK.shape
    device = x_NK.device
    rows = torch.arange(N, device=device)
    if rows_per_group is None:
        tile_of_row, num_tiles = rows // tile, -(-N // tile)
        slot = rows
    else:
        counts = rows_per_group.to(device)
        group = group_of_rows(counts, N)
        local = rows - (torch.cumsum(counts, 0) - counts)[group]
        tiles = -(-counts // tile)
        tile_of_row = (torch.cumsum(tiles, 0) - tiles)[group] + local // tile
        num_tiles = N // tile + counts.numel()  # an upper bound of sum(ceil(count/128)): no host sync
        slot = tile_of_row * tile + local % tile
    # rows laid out tile by tile (zero-filled to whole tiles), then one amax per (tile, column)
    tiled = x_NK.new_zeros(max(num_tiles, 1) * tile, K, dtype=torch.float32)
    tiled.index_copy_(0, slot, x_NK.detach().abs().float())
    amax = tiled.view(-1, tile, K).amax(dim=1)
    scale = scale_from_amax(amax, dtype, 0, power_of_two)
    data = cast_with_scale(x_NK, scale.index_select(0, tile_of_row), dtype)
    return Quantized(data, _e8m0(scale) if tile == MX_BLOCK else scale, tile_of_row, None)


# ---- delayed scaling -------------------------------------------------------------------------


@torch.no_grad()
def delayed_scale(history_LG: torch.Tensor, amax_G: torch.Tensor, recipe: FP8Recipe,
                  dtype: torch.dtype) -> torch.Tensor:
    """The scale `[G]` for this call from `history_LG` (newest first), then record `amax_G`.

    The scale uses the history as it was BEFORE this call: max over its entries ("max") or
    its newest entry ("most_recent"). A group whose history holds no amax yet (all zero: the
    first call, or an expert that never received a token) uses its current amax instead.
    Then the history rolls by one (the oldest entry drops) and `amax_G` becomes entry 0.
    """
    past = history_LG.amax(0) if recipe.amax_compute_algo == "max" else history_LG[0]
    used = torch.where(past > 0, past, amax_G.float())
    scale = scale_from_amax(used, dtype, recipe.margin, recipe.power_of_two_scales)
    history_LG.copy_(torch.roll(history_LG, 1, 0))
    history_LG[0] = amax_G
    return scale


# ---- what each recipe quantizes, and how ---------------------------------------------------


def quantize_operand(x: torch.Tensor, role: str, recipe: FP8Recipe, history: torch.Tensor | None,
                     rows_per_group: torch.Tensor | None = None, reduce_amax=None) -> Quantized:
    """Quantize a GEMM operand of `role` ("input", "weight", "grad_output") as `recipe` says.

    `x` is `[N,K]` for activations and gradients (rows grouped by `rows_per_group` in grouped
    GEMMs: one scale per group under tensorwise/delayed), `[O,K]` or `[E,O,K]` for weights.
    `history` is the module's `[3, L, G]` amax history (delayed only). `reduce_amax(amax)`, when
    given, MAX-reduces the tensorwise/delayed amaxes in place over the ranks holding other parts of
    the same tensor (tensor parallel: docs/fp8.md), so every rank gets the whole tensor's scale.
    """
    dtype = recipe.grad_dtype if role == "grad_output" else recipe.forward_dtype
    p2 = recipe.power_of_two_scales
    if recipe.scaling == "blockwise":
        return quantize_weight_blocks(x, p2) if role == "weight" else quantize_row_tiles(x, p2)
    if recipe.scaling == "mxfp8":  # 1x32 along the contraction dim (K), weights included
        return _mx_rows(x, dtype)
    # tensorwise / delayed: one amax per tensor, per group (expert)
    if role == "weight":
        amax = x.detach().abs().float().amax(dim=(-2, -1)).reshape(-1)
        row_map = None
    elif rows_per_group is not None:
        row_map = group_of_rows(rows_per_group, x.shape[0])
        amax = group_amax(x, row_map, rows_per_group.numel())
    else:  # an empty tensor has amax 0
        amax = x.detach().abs().float().amax().reshape(1) if x.numel() else x.new_zeros(1, dtype=torch.float32)
        row_map = None
    if reduce_amax is not None:
        reduce_amax(amax)
    if recipe.scaling == "delayed":
        scale = delayed_scale(history[ROLES.index(role)], amax, recipe, dtype)
    else:
        scale = scale_from_amax(amax, dtype, 0, p2)
    if role == "weight":
        scale = scale.reshape(-1, 1, 1) if x.dim() == 3 else scale.reshape(1, 1)
        return Quantized(cast_with_scale(x, scale, dtype), scale)
    return quantize_with_scale(x, scale.reshape(-1, 1), dtype, row_map)


def quantize_for_wgrad(x: torch.Tensor, q_fwd: Quantized, role: str, recipe: FP8Recipe,
                       rows_per_group: torch.Tensor | None = None) -> Quantized:
    """The operand of the weight-gradient GEMM (contraction over tokens): the same quantization
    for tensorwise/delayed, 128×1 token tiles (per group) for blockwise, 32×1 for mxfp8."""
    if recipe.scaling not in ("blockwise", "mxfp8"):
        return q_fwd
    dtype = recipe.grad_dtype if role == "grad_output" else recipe.forward_dtype
    tile = MX_BLOCK if recipe.scaling == "mxfp8" else TILE
    return quantize_token_tiles(x, rows_per_group, recipe.power_of_two_scales, dtype, tile)


def quantize_weight_for_dgrad(w: torch.Tensor, q_fwd: Quantized, recipe: FP8Recipe) -> Quantized:
    """The weight operand of the input-gradient GEMM (contraction over output features): the
    forward's quantization, except mxfp8, whose 1-D blocks must run along O (columnwise copy)."""
    if recipe.scaling != "mxfp8":
        return q_fwd
    return _mx_rows(w.transpose(-2, -1), recipe.forward_dtype).t()


def _mx_rows(x: torch.Tensor, dtype: torch.dtype) -> Quantized:
    """1x32 blocks along the last dim with power-of-two (E8M0) scales, in `dtype`."""
    if dtype == E4M3:
        return quantize_row_tiles(x, True, MX_BLOCK)
    xb = x.detach().float()
    K = x.shape[-1]
    col_map = torch.arange(K, device=x.device) // MX_BLOCK
    pad = -K % MX_BLOCK
    blocks = torch.nn.functional.pad(xb.abs(), (0, pad)).unflatten(-1, (-1, MX_BLOCK))
    scale = scale_from_amax(blocks.amax(-1), dtype, 0, True)
    return Quantized(cast_with_scale(xb, scale.index_select(-1, col_map), dtype), _e8m0(scale), None, col_map)


__all__ = [
    "E4M3", "E5M2", "FORMAT_MAX", "MANTISSA_BITS", "MIN_NORMAL_EXP", "FP8Recipe", "FP8_RECIPES", "Quantized",
    "tensorwise", "delayed", "blockwise", "mxfp8", "get_fp8_recipe", "quantize_weight_for_dgrad", "MX_BLOCK", "scale_from_amax", "quantize_row_tiles",
    "quantize_weight_blocks", "quantize_token_tiles", "quantize_operand", "quantize_for_wgrad", "delayed_scale",
]
