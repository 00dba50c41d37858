"""MoETransformer: the causal LM of both families, with MTP and MoE losses.

`model(input_ids)` returns logits; `model(input_ids, labels=labels)` also returns
the losses. `labels[b, i]` is the target of position i (already shifted: usually
`input_ids[b, i+1]`), -100 where ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moetron.config import ModelConfig
from moetron.model.layer import DecoderLayer
from moetron.model.mtp import MTPModule, shift_left
from moetron.ops.norm import RMSNorm
from moetron.model.rope import RotaryEmbedding
from moetron.moe.layer import MoELayer
from moetron.ops import cross_entropy
from moetron.ops.linear import linear
from moetron.moe.layer import _sum_over, load_summary

IGNORE_INDEX = -100


@dataclass
class ModelOutput:
    """`loss` is the LM loss; `total_loss` (LM + weighted MTP) is what training differentiates.

    Balancing losses are reported in `aux_losses` (summed over layers, detached):
    their gradients are injected inside the router, never through `total_loss`.
    """

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None
    total_loss: torch.Tensor | None = None
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    token_count: torch.Tensor | int = 0  # the labels the LM loss averages over; a tensor where it was counted

    @property
    def num_tokens(self) -> int:
        """`token_count` as an int: on a GPU reading it waits for the forward (the trainer reads it once the
        backward is queued)."""
        return int(self.token_count)

    @property
    def lm_loss(self) -> torch.Tensor | None:
        return self.loss

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the load-balancing losses (z-loss excluded), or None when none ran."""
        values = [v for k, v in self.aux_losses.items() if k != "z_loss"]
        return torch.stack(values).sum() if values else None


def lm_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean token cross-entropy over the non-ignored labels, and their count as a 0-dim int64 tensor on
    the labels' device: counted as an int, it made the host wait for the whole forward on a GPU before it
    could queue the backward. The mean is the same either way (the count converts to the loss's dtype)."""
    count = (labels != IGNORE_INDEX).sum()
    return cross_entropy(logits, labels, IGNORE_INDEX) / count.clamp(min=1), count


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        nn.init.normal_(self.embed_tokens.weight, std=cfg.init_std)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            nn.init.normal_(self.lm_head.weight, std=cfg.init_std)
        self.mtp = nn.ModuleList(MTPModule(cfg, d + 1) for d in range(cfg.num_mtp_layers))
        self.rotary = RotaryEmbedding(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def head(self, h: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding's gradient reaches the same weight through autograd
            return nn.functional.linear(h, self.output_weight())
        return linear(h, self.lm_head.weight)

    def lm_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | int]:
        """Mean cross-entropy of `head` logits over the non-ignored labels, and their count (an int or a
        0-dim tensor).

        The one place the LM and MTP losses are computed from logits, so a model whose head is
        vocab-parallel (parallel/parallelize.py) swaps in the vocab-parallel cross-entropy here.
        """
        return lm_cross_entropy(logits, labels)

    def moe_layers(self) -> list[MoELayer]:
        """Every MoE layer (decoder layers, then MTP), without a walk over all modules: called every step."""
        return list(self.moe_layers_by_index().values())

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> ModelOutput:
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0)
        h = self.embed_tokens(input_ids)
        rope = self.rotary(position_ids, h.dtype)
        for layer in self.layers:
            h = layer(h, rope)
        logits = self.head(self.norm(h))
        out = ModelOutput(logits=logits)
        if labels is not None:
            out.loss, out.token_count = self.lm_loss(logits, labels)
            out.total_loss = out.loss
            if len(self.mtp):
                out.mtp_loss = self._mtp_loss(h, input_ids, labels, rope)
                out.total_loss = out.loss + self.config.mtp_loss_weight * out.mtp_loss
        out.aux_losses = self._collect_aux_losses()
        return out

    def shift_labels(self, labels: torch.Tensor, k: int) -> torch.Tensor:
        """`labels` moved k positions left along the sequence (context parallel overrides this)."""
        return shift_left(labels, k, IGNORE_INDEX)

    def _mtp_loss(self, h, input_ids, labels, rope) -> torch.Tensor:
        """Mean over depths of each MTP module's cross-entropy on tokens depth+1 ahead."""
        losses = []
        for module in self.mtp:
            k = module.depth
            future_ids = self.shift_labels(labels, k - 1).clamp_min(0)  # token t[i+k]
            h, normed = module(h, self.embed_tokens(future_ids), rope)
            loss, _ = self.lm_loss(self.head(normed), self.shift_labels(labels, k))
            losses.append(loss)
        return torch.stack(losses).mean()

    def _collect_aux_losses(self) -> dict[str, torch.Tensor]:
        totals: dict[str, torch.Tensor] = {}
        for layer in self.moe_layers():
            for name, value in layer.aux_losses.items():
                totals[name] = totals.get(name, 0.0) + value
        return totals

    @torch.no_grad()
    def update_expert_bias(self, group=None) -> None:
        """Aux-loss-free balancing step for every MoE layer; call once per global batch."""
        for layer in self.moe_layers():
            layer.update_expert_bias(group)

    def moe_layers_by_index(self) -> dict[int, MoELayer]:
        """MoE layers by decoder-layer index; MTP depth d's layer is `num_layers + d - 1` (as in HF)."""
        layers = [*self.layers, *(m.layer for m in self.mtp)]
        return {layer.layer_idx: layer.mlp for layer in layers if layer.is_moe}

    def load_stats(self, group=None, *, accumulated: bool = False) -> dict[int, dict[str, float]]:
        """Load statistics per MoE layer, keyed by `moe_layers_by_index`.

        Default: each decoder layer's last forward, local to this rank (`MoELayer.stats`).
        `accumulated=True`: every forward since `reset_load_stats()` (a step's micro-batches),
        `{"max_over_mean", "dropped_fraction"}` per layer, with the counts first summed over
        `group` (collective: every rank of it must call, with the same model structure).
        Summing over the world gives the global step under any layout: a rank adds zeros for
        the layers it does not run (pipeline), and its own tokens for those it does. Layers
        that routed no token are left out.
        """
        if not accumulated:
            return {i: l.mlp.stats() for i, l in enumerate(self.layers) if l.is_moe}
        layers = self.moe_layers_by_index()
        if not layers:
            return {}
        totals = torch.stack([layer.load_totals() for layer in layers.values()])
        _sum_over(totals, group)
        rows = totals.cpu()  # one device sync for every layer
        stats = {i: load_summary(row) for i, row in zip(layers, rows)}
        return {i: s for i, s in stats.items() if s}

    def reset_load_stats(self) -> None:
        """Start a new accumulation for `load_stats(accumulated=True)` (the trainer: every step)."""
        for layer in self.moe_layers_by_index().values():
            layer.reset_load_totals()
