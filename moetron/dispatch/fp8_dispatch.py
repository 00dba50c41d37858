"""FP8 (E4M3) rows with one scale per 1×128 block, for sending activations over the wire.

DeepSeek-V3 dispatches activations in FP8 and combines in BF16 (REFERENCE §5): each token
row is cut into blocks of 128 values, each block scaled so its largest magnitude maps to the
E4M3 maximum (448), optionally rounding the scale up to a power of two (then dequantizing is
an exponent shift, exact on any hardware). `quantize_rows` makes `(q, scales)`, `dequantize_rows`
undoes it in the activation dtype. A last partial block (hidden size not a multiple of 128)
gets its own scale.

Error bound (round to nearest): E4M3 keeps 3 mantissa bits, so a value in the normal range is
off by at most 2^-4 of itself; below 2^-6 (subnormal, in scaled units) by at most 2^-10 of the
block scale. Scaling never clips, because every block's amax / scale <= 448.

Collectives: gloo cannot move float8 tensors, so senders use `as_wire` (a free uint8 view) and
receivers `from_wire`; NCCL accepts the same bytes.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
BLOCK = 128
_MIN_SCALE = 1e-12  # all-zero blocks: any positive scale maps them to 0


def num_blocks(hidden: int, block: int = BLOCK) -> int:
    return -(-hidden // block)


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """`[..., H]` -> `[..., nb, block]` in fp32, zero-padding a last partial block."""
    hidden = x.shape[-1]
    nb = num_blocks(hidden, block)
    xf = x.float()
    if nb * block != hidden:
        xf = torch.nn.functional.pad(xf, (0, nb * block - hidden))
    return xf.view(*x.shape[:-1], nb, block)


def quantize_rows(x: torch.Tensor, power_of_two: bool = False, block: int = BLOCK
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast `x [..., H]` to E4M3 with one fp32 scale per 1×`block` tile.

    Returns `(q [..., H] float8_e4m3fn, scales [..., ceil(H/block)] fp32)` with
    `x ≈ q * scales` blockwise. `power_of_two` rounds each scale up to `2^k`.
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize_rows expects a floating-point tensor, got {x.dtype}")
    hidden = x.shape[-1]
    xb = _blocked(x, block)
    scales = (xb.abs().amax(dim=-1) / FP8_E4M3_MAX).clamp_min(_MIN_SCALE)
    if power_of_two:
        scales = torch.exp2(torch.ceil(torch.log2(scales)))
    q = (xb / scales.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.flatten(-2)[..., :hidden].to(FP8_DTYPE)
    return q, scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                    block: int = BLOCK) -> torch.Tensor:
    """`q * scales` blockwise, returned in `dtype` (the activation dtype)."""
    hidden = q.shape[-1]
    nb = num_blocks(hidden, block)
    if scales.shape != (*q.shape[:-1], nb):
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not fit rows {tuple(q.shape)} in "
                         f"1x{block} blocks (expected {(*q.shape[:-1], nb)})")
    qb = _blocked(q, block)  # float() of fp8 is exact
    return (qb * scales.float().unsqueeze(-1)).flatten(-2)[..., :hidden].to(dtype)


def as_wire(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as uint8 bytes (same storage) so any collective backend can move it."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def from_wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undo `as_wire`: reinterpret received bytes as `dtype`."""
    return t.view(dtype) if t.dtype != dtype else t
