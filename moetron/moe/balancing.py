"""Load-balancing losses and the trick that trains them without touching the loss value.

Aux losses are never added to the reported loss. `inject_aux_loss(x, loss)` returns
`x` unchanged, and in backward hands `loss` a gradient of `aux_loss_scale()`, so the
balancing gradient reaches the router through the routed activations (Megatron's
MoEAuxLossAutoScaler). The trainer sets the scale, e.g. 1/num_microbatches.
"""

from __future__ import annotations

import torch

_aux_loss_scale = 1.0


def set_aux_loss_scale(scale: float) -> None:
    """Gradient given to every aux loss in backward (1/num_microbatches under accumulation)."""
    global _aux_loss_scale
    _aux_loss_scale = float(scale)


def aux_loss_scale() -> float:
    return _aux_loss_scale


class _InjectAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.loss_shape, _aux_loss_scale, dtype=ctx.loss_dtype, device=grad.device)


def inject_aux_loss(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """Identity on `x`; backward also differentiates `loss` (scaled by aux_loss_scale())."""
    if not loss.requires_grad:
        return x
    return _InjectAuxLoss.apply(x, loss)


def balance_probs(logits_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Per-token expert probabilities that the balancing losses measure (rows sum to 1)."""
    if score_func == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    scores = torch.sigmoid(logits_TE)
    return scores / (scores.sum(-1, keepdim=True) + 1e-20)


def switch_aux_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int, num_tokens: int | None = None,
                    ) -> torch.Tensor:
    """Switch-Transformer loss `E/k * sum_e f_e * P_e` (f_e: tokens routed to e / T; P_e: mean prob).

    `counts_E` may come from more tokens than `probs_TE` (the global batch); then pass
    their number as `num_tokens`.
    """
    T, E = probs_TE.shape
    tokens = T if num_tokens is None else num_tokens
    f_E = counts_E.float() / tokens
    p_E = probs_TE.mean(0)
    return (f_E * p_E).sum() * (E / top_k)


def seq_aux_loss(probs_TE: torch.Tensor, topk_idx_TK: torch.Tensor, seq_len: int) -> torch.Tensor:
    """DeepSeek's sequence-wise loss: the Switch loss of each sequence, averaged over sequences."""
    T, E = probs_TE.shape
    if T % seq_len:
        raise ValueError(f"seq_aux_loss: {T} tokens are not a whole number of sequences of {seq_len}")
    B, K = T // seq_len, topk_idx_TK.shape[1]
    probs_BSE = probs_TE.view(B, seq_len, E)
    seq_of_slot = torch.arange(B, device=probs_TE.device).repeat_interleave(seq_len * K)
    counts_BE = torch.zeros(B * E, device=probs_TE.device).index_add_(
        0, seq_of_slot * E + topk_idx_TK.reshape(-1), torch.ones(T * K, device=probs_TE.device)).view(B, E)
    per_seq = ((counts_BE / seq_len) * probs_BSE.mean(1)).sum(-1) * (E / K)
    return per_seq.mean()


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss: mean squared log-partition, keeps router logits small."""
    return torch.logsumexp(logits_TE, dim=-1).pow(2).mean()
