"""FP8 training numerics: recipes, quantize/dequantize, and the FP8 GEMMs of a linear layer.

Recipes (REFERENCE §3, §5), each a frozen `FP8Recipe`:

- `tensorwise` (current scaling): one scale per tensor (per expert in grouped GEMMs), from the
  tensor's own amax: `scale = amax / fmt_max`, so the largest value maps to the format maximum.
- `delayed`: the same granularity, but the scale comes from an amax HISTORY of earlier calls
  (`amax_compute_algo` "max": the largest of the last `amax_history_len` amaxes; "most_recent":
  the previous one), divided by `2**margin` headroom. Values beyond the resulting range saturate.
- `blockwise` (DeepSeek-V3): activations and gradients scaled per 1×128 tile along the GEMM's
  contraction dim, weights per 128×128 block; for the weight-gradient GEMM (contraction over
  tokens) activations and gradients are re-quantized per 128×1 tile (128 tokens × 1 channel),
  tiles restarting at every expert's first row. E4M3 everywhere.

`fp8_format`: "hybrid" = E4M3 forward (activations, weights), E5M2 for gradients (TE's default
for tensorwise and delayed); "e4m3" = E4M3 everywhere (blockwise always).

A `Quantized` holds FP8 `data` and an fp32 dequantization `scale` (`x ≈ data * scale`) indexed
per element through optional row/column maps, so every layout (tensor, per-expert rows, 1×128,
128×1, 128×128) is one type and transposes for free. The 128×128 and 1×128 E4M3 quantizers are
those of `moetron.precision.blockwise` (checkpoint weights) and `moetron.dispatch.fp8_dispatch`
(FP8 dispatch), so one rounding rule serves checkpoints, communication and GEMMs.

GEMM backends (`backend`):
- "emulate": exact emulation, works everywhere: dequantize both operands to fp32, multiply in
  fp32 (DeepSeek-V3 promotes accumulation to fp32), cast the result to the activation dtype.
  Identical numerics to a real FP8 GEMM up to fp32 summation order.
- "torch": `torch._scaled_mm` with FP8 operands and fp32 scales (CPU builds and CUDA compute
  capability >= 8.9); tensorwise scales only (tensorwise and delayed recipes). On CUDA every GEMM
  dim (including the token count of the weight-gradient GEMM) must be a multiple of 16.
- "te": Transformer Engine's modules (see fp8_modules), CUDA with transformer_engine installed.
- "auto": "te" when Transformer Engine and a CUDA device are present; else "torch" where the
  recipe and the shapes allow; else "emulate" (a choice by capability, per GEMM).

Error bound (round to nearest, no saturation): with `m` mantissa bits and smallest normal
exponent `emin` (E4M3: m=3, emin=-6; E5M2: m=2, emin=-14) a value `x` with scale `s` comes back
with `|x - deq(x)| <= 2^-(m+1) |x| + 2^(emin-m-1) s` (relative half-ulp for normal values,
half the subnormal spacing below). Current and blockwise scaling never saturate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moetron import backends
from moetron.dispatch.fp8_dispatch import quantize_rows
from moetron.precision.blockwise import quantize_blockwise

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FORMAT_MAX = {E4M3: 448.0, E5M2: 57344.0}
MANTISSA_BITS = {E4M3: 3, E5M2: 2}
MIN_NORMAL_EXP = {E4M3: -6, E5M2: -14}
TILE = 128
MIN_SCALE = 1e-12  # all-zero tensors / tiles: any positive scale maps them to 0
SCALINGS = ("tensorwise", "delayed", "blockwise")
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
        if self.backend == "torch" and self.scaling == "blockwise":
            fail("backend", "the torch backend runs tensorwise scales only; use 'auto', 'emulate' or 'te' "
                            "for blockwise scaling")
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


FP8_RECIPES = {"tensorwise": tensorwise, "delayed": delayed, "blockwise": blockwise}


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


def quantize_row_tiles(x_NK: torch.Tensor, power_of_two: bool = False) -> Quantized:
    """E4M3 with one scale per 1×128 tile along the last dim (a last partial tile its own)."""
    data, scale = quantize_rows(x_NK, power_of_two=power_of_two, block=TILE)
    col_map = torch.arange(x_NK.shape[-1], device=x_NK.device) // TILE
    return Quantized(data, scale, None, col_map)


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
                         power_of_two: bool = False, dtype: torch.dtype = E4M3) -> Quantized:
    """One scale per 128×1 tile: 128 consecutive rows (tokens) of one column, tiles restarting at
    each group's first row (`rows_per_group`; one group when None). For the weight-gradient GEMM,
    whose contraction runs over tokens."""
    N, K = x_NK.shape
    device = x_NK.device
    rows = torch.arange(N, device=device)
    if rows_per_group is None:
        tile_of_row, num_tiles = rows // TILE, -(-N // TILE)
        slot = rows
    else:
        counts = rows_per_group.to(device)
        group = group_of_rows(counts, N)
        local = rows - (torch.cumsum(counts, 0) - counts)[group]
        tiles = -(-counts // TILE)
        tile_of_row = (torch.cumsum(tiles, 0) - tiles)[group] + local // TILE
        num_tiles = N // TILE + counts.numel()  # an upper bound of sum(ceil(count/128)): no host sync
        slot = tile_of_row * TILE + local % TILE
    # rows laid out tile by tile (zero-filled to whole tiles), then one amax per (tile, column)
    tiled = x_NK.new_zeros(max(num_tiles, 1) * TILE, K, dtype=torch.float32)
    tiled.index_copy_(0, slot, x_NK.detach().abs().float())
    amax = tiled.view(-1, TILE, K).amax(dim=1)
    scale = scale_from_amax(amax, dtype, 0, power_of_two)
    return Quantized(cast_with_scale(x_NK, scale.index_select(0, tile_of_row), dtype), scale, tile_of_row, None)


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
                     rows_per_group: torch.Tensor | None = None) -> Quantized:
    """Quantize a GEMM operand of `role` ("input", "weight", "grad_output") as `recipe` says.

    `x` is `[N,K]` for activations and gradients (rows grouped by `rows_per_group` in grouped
    GEMMs: one scale per group under tensorwise/delayed), `[O,K]` or `[E,O,K]` for weights.
    `history` is the module's `[3, L, G]` amax history (delayed only).
    """
    dtype = recipe.grad_dtype if role == "grad_output" else recipe.forward_dtype
    p2 = recipe.power_of_two_scales
    if recipe.scaling == "blockwise":
        return quantize_weight_blocks(x, p2) if role == "weight" else quantize_row_tiles(x, p2)
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
    for tensorwise/delayed, 128×1 token tiles (per group) for blockwise."""
    if recipe.scaling != "blockwise":
        return q_fwd
    dtype = recipe.grad_dtype if role == "grad_output" else recipe.forward_dtype
    return quantize_token_tiles(x, rows_per_group, recipe.power_of_two_scales, dtype)


# ---- GEMMs ---------------------------------------------------------------------------------


def _te_available() -> bool:
    return backends._has_module("transformer_engine") and torch.cuda.is_available()


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


def module_backend(recipe: FP8Recipe) -> str:
    """The backend a module uses: 'te' as a whole module, or a GEMM backend ('auto' resolves per
    GEMM between 'torch' and 'emulate')."""
    check_backend(recipe)
    if recipe.backend == "auto":
        return "te" if _te_available() else "auto"
    return recipe.backend


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
    from moetron.moe.grouped_gemm import grouped_linear

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


class _FP8Linear(torch.autograd.Function):
    """y = x W^T (+ b) with the three GEMMs of a linear layer in FP8:
    fprop Q(x)·Q(W)^T, dgrad Q(dy)·Q(W), wgrad Q'(dy)^T·Q'(x) (Q' = 128×1 tiles under blockwise)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, history, backend):
        x2 = x.reshape(-1, x.shape[-1])
        qx = quantize_operand(x2, "input", recipe, history)
        qw = quantize_operand(weight, "weight", recipe, history)
        y = fp8_gemm(qx, qw, x.dtype, backend)
        if bias is not None:
            y = y + bias.to(y.dtype)
        qx_w = quantize_for_wgrad(x2, qx, "input", recipe) if ctx.needs_input_grad[1] else None
        ctx.recipe, ctx.backend, ctx.history = recipe, backend, history
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x.shape, x.dtype, weight.dtype, bias is not None
        ctx.has_qx = qx_w is not None
        ctx.save_for_backward(*qw.tensors(), *(qx_w.tensors() if qx_w is not None else ()))
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        qw = Quantized(*saved[:4])
        dy2 = dy.reshape(-1, dy.shape[-1])
        recipe, backend = ctx.recipe, ctx.backend
        qdy = quantize_operand(dy2, "grad_output", recipe, ctx.history)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = fp8_gemm(qdy, qw.t(), ctx.x_dtype, backend).view(ctx.x_shape)
        if ctx.needs_input_grad[1] and ctx.has_qx:
            qx = Quantized(*saved[4:8])
            qdy_w = quantize_for_wgrad(dy2, qdy, "grad_output", recipe)
            dw = fp8_gemm(qdy_w.t(), qx.t(), ctx.w_dtype, backend)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.float().sum(0).to(dy.dtype)
        return dx, dw, db, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: FP8Recipe,
               history: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with FP8 GEMMs in forward and backward.

    `history` is the `[3, L, 1]` amax history (input, weight, grad_output) that delayed scaling
    reads and updates in place; `backend` overrides `recipe.backend` ('emulate', 'torch', 'auto').
    """
    if recipe.scaling == "delayed" and history is None:
        raise ValueError("delayed FP8 scaling needs the module's amax history (history=...)")
    backend = backend or recipe.backend
    if backend == "te":
        raise ValueError("fp8_linear runs the emulate/torch GEMMs; Transformer Engine runs as a module "
                         "(FP8Linear with backend 'te')")
    return _FP8Linear.apply(x, weight, bias, recipe, history, backend)


class _FP8GroupedLinear(torch.autograd.Function):
    """`grouped_linear` with FP8 GEMMs: per-expert scales (tensorwise/delayed) or tiles (blockwise)."""

    @staticmethod
    def forward(ctx, x, weight, rows_per_expert, recipe, history, backend, expert_backend):
        qx = quantize_operand(x, "input", recipe, history, rows_per_expert)
        qw = quantize_operand(weight, "weight", recipe, history)
        y = fp8_grouped_gemm(qx, qw, rows_per_expert, x.dtype, backend, expert_backend)
        qx_w = quantize_for_wgrad(x, qx, "input", recipe, rows_per_expert)
        ctx.recipe, ctx.backend, ctx.history, ctx.expert_backend = recipe, backend, history, expert_backend
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.save_for_backward(rows_per_expert, *qw.tensors(), *qx_w.tensors())
        return y

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        rows, qw, qx = saved[0], Quantized(*saved[1:5]), Quantized(*saved[5:9])
        recipe, backend = ctx.recipe, ctx.backend
        dy = dy.contiguous()
        qdy = quantize_operand(dy, "grad_output", recipe, ctx.history, rows)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = fp8_grouped_gemm(qdy, qw.t(), rows, ctx.x_dtype, backend, ctx.expert_backend)
        if ctx.needs_input_grad[1]:
            qdy_w = quantize_for_wgrad(dy, qdy, "grad_output", recipe, rows)
            dw = fp8_grouped_wgrad(qdy_w, qx, rows, ctx.w_dtype, backend)
        return dx, dw, None, None, None, None, None


def fp8_grouped_linear(x_NK: torch.Tensor, w_EOK: torch.Tensor, rows_per_expert: torch.Tensor,
                       recipe: FP8Recipe, history: torch.Tensor | None = None, backend: str | None = None,
                       expert_backend: str = "auto") -> torch.Tensor:
    """`moetron.moe.grouped_gemm.grouped_linear` with FP8 GEMMs (forward and backward).

    `history` is the `[3, L, E]` amax history for delayed scaling (one column per local expert).
    `expert_backend` is the high-precision grouped GEMM the emulation runs on."""
    if recipe.scaling == "delayed" and history is None:
        raise ValueError("delayed FP8 scaling needs the module's amax history (history=...)")
    backend = backend or recipe.backend
    if x_NK.shape[0] == 0:  # keep both in the graph, as grouped_linear does
        return x_NK.new_zeros(0, w_EOK.shape[-2]) + 0 * (w_EOK.sum() + x_NK.sum())
    return _FP8GroupedLinear.apply(x_NK, w_EOK, rows_per_expert, recipe, history, backend, expert_backend)


__all__ = [
    "E4M3", "E5M2", "FORMAT_MAX", "MANTISSA_BITS", "MIN_NORMAL_EXP", "FP8Recipe", "FP8_RECIPES", "Quantized",
    "tensorwise", "delayed", "blockwise", "get_fp8_recipe", "scale_from_amax", "quantize_row_tiles",
    "quantize_weight_blocks", "quantize_token_tiles", "quantize_operand",
    "quantize_for_wgrad", "delayed_scale", "fp8_gemm", "fp8_grouped_gemm", "fp8_grouped_wgrad",
    "fp8_linear", "fp8_grouped_linear", "check_backend", "module_backend",
]
