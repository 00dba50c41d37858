"""The mapping between moetron parameter names and Hugging Face hub keys.

moetron keeps Hugging Face's module names where it can (`self_attn.q_proj`, ...),
so most keys only gain the `model.` prefix. The differences, all here:
router `mlp.router.weight` ↔ `mlp.gate.weight`; expert bias
`mlp.router.expert_bias` ↔ `mlp.gate.e_score_correction_bias`; experts as 3-D
`gate_up_proj [E,2F,H]` / `down_proj [E,H,F]` ↔ per-expert `experts.{e}.*_proj`
(or the fused 3-D keys); MTP module k ↔ `model.layers.{num_layers + k}` with its
final norm under `shared_head.norm`, and copies of the embedding and output head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moetron.config import ModelConfig

Tensors = list[torch.Tensor]


@dataclass
class KeyMapping:
    """One moetron tensor and the hub keys it is made of."""

    target: str
    sources: list[str]
    to_moetron: Callable[[Tensors], torch.Tensor]
    to_hf: Callable[[torch.Tensor], Tensors]


def _identity(target: str, source: str) -> KeyMapping:
    return KeyMapping(target, [source], lambda ts: ts[0], lambda t: [t])


def _per_expert_gate_up(target: str, prefix: str, num_experts: int) -> KeyMapping:
    sources = [f"{prefix}.{e}.{p}_proj.weight" for e in range(num_experts) for p in ("gate", "up")]

    def to_moetron(ts: Tensors) -> torch.Tensor:
        return torch.stack([torch.cat(ts[2 * e: 2 * e + 2]) for e in range(num_experts)])

    def to_hf(t: torch.Tensor) -> Tensors:
        return [half for expert in t for half in expert.chunk(2)]

    return KeyMapping(target, sources, to_moetron, to_hf)


def _per_expert_down(target: str, prefix: str, num_experts: int) -> KeyMapping:
    sources = [f"{prefix}.{e}.down_proj.weight" for e in range(num_experts)]
    return KeyMapping(target, sources, torch.stack, lambda t: list(t.unbind(0)))


def _hf_prefix(cfg: ModelConfig, key: str) -> tuple[str, str]:
    """Split a moetron key into (hub prefix, rest)."""
    parts = key.split(".")
    if parts[0] == "layers":
        return f"model.layers.{parts[1]}", ".".join(parts[2:])
    if parts[0] == "mtp":
        hf_layer = f"model.layers.{cfg.num_layers + int(parts[1])}"
        rest = ".".join(parts[2:])
        if rest.startswith("layer."):
            return hf_layer, rest[len("layer."):]
        return hf_layer, {"final_norm.weight": "shared_head.norm.weight"}.get(rest, rest)
    if parts[0] == "lm_head":
        return "", key
    return "model", key


def build_key_map(cfg: ModelConfig, moetron_keys: list[str], fused_experts: bool) -> list[KeyMapping]:
    """Mappings for every moetron state-dict key; `fused_experts` picks the 3-D hub layout."""
    mappings = []
    for key in moetron_keys:
        prefix, rest = _hf_prefix(cfg, key)
        join = (lambda r: f"{prefix}.{r}") if prefix else (lambda r: r)
        if rest == "mlp.router.weight":
            mappings.append(_identity(key, join("mlp.gate.weight")))
        elif rest == "mlp.router.expert_bias":
            mappings.append(_identity(key, join("mlp.gate.e_score_correction_bias")))
        elif rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj") and not fused_experts:
            build = _per_expert_gate_up if rest.endswith("gate_up_proj") else _per_expert_down
            mappings.append(build(key, join("mlp.experts"), cfg.num_experts))
        else:
            mappings.append(_identity(key, join(rest)))
    return mappings


def mtp_shared_copies(cfg: ModelConfig) -> list[tuple[str, str]]:
    """Hub keys of each MTP layer that duplicate a main-model tensor: (hub key, moetron key)."""
    head = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    copies = []
    for k in range(cfg.num_mtp_layers):
        layer = f"model.layers.{cfg.num_layers + k}"
        copies += [(f"{layer}.embed_tokens.weight", "embed_tokens.weight"), (f"{layer}.shared_head.head.weight", head)]
    return copies
