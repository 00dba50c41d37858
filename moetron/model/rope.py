"""Rotary position embeddings, plain or YaRN-scaled.

YaRN blends interpolated and extrapolated frequencies with a linear ramp between
the dimensions that turn `beta_fast` and `beta_slow` times over the original
context, and scales cos/sin by an attention factor. The MLA softmax scale gets
`mscale(factor, mscale_all_dim)**2` separately (see `yarn_softmax_scale`).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dim: int, base: float, scaling: dict, max_position_embeddings: int):
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep_extrapolated = 1 - ramp
    inv_freq = interpolation * (1 - keep_extrapolated) + extrapolation * keep_extrapolated

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def yarn_softmax_scale(head_dim: int, scaling: dict | None) -> float:
    """MLA softmax scale: `head_dim**-0.5`, times `mscale**2` under YaRN with `mscale_all_dim`."""
    scale = head_dim ** -0.5
    if scaling and scaling.get("mscale_all_dim"):
        m = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale *= m * m
    return scale


class RotaryEmbedding(nn.Module):
    """Produces `(cos, sin)` of shape [B,S,dim] for the given positions."""

    def __init__(self, dim: int, base: float, scaling: dict | None = None, max_position_embeddings: int = 4096):
        super().__init__()
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(dim, base, scaling, max_position_embeddings)
        else:
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self.attention_factor = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
