"""Block-scaled FP8 (E4M3) weights, as DeepSeek-V3 releases them.

A weight `w [O,I]` is stored as `q = fp8(w / s)` with one fp32 scale per 128×128
block, saved as `weight_scale_inv = s` so that `w ≈ q * s` (edge blocks partial).
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0


def _expand_blocks(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = shape
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def expected_scale_shape(shape, block=(128, 128)) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q * scale_inv` per block, in `dtype`."""
    if q.dim() != 2 or tuple(scale_inv.shape) != expected_scale_shape(q.shape, block):
        raise ValueError(f"scale shape {tuple(scale_inv.shape)} does not fit weight {tuple(q.shape)} "
                         f"in {block[0]}x{block[1]} blocks (expected {expected_scale_shape(q.shape, block)})")
    return (q.float() * _expand_blocks(scale_inv.float(), q.shape, block)).to(dtype)


def quantize_blockwise(w: torch.Tensor, block=(128, 128), power_of_two: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to E4M3 with one scale per block. Returns `(q, scale_inv)`."""
    rows, cols = w.shape
    br, bc = expected_scale_shape(w.shape, block)
    padded = w.float().new_zeros(br * block[0], bc * block[1])
    padded[:rows, :cols] = w.float()
    amax = padded.view(br, block[0], bc, block[1]).abs().amax(dim=(1, 3))
    scale = (amax / FP8_E4M3_MAX).clamp_min(1e-12)
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (w.float() / _expand_blocks(scale, w.shape, block)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale
