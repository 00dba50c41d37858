"""Load-balancing losses and the trick that trains them without touching the loss value.

Aux losses are never added to the reported loss. `inject_aux_loss(x, loss)` returns
`x` unchanged, and in backward hands `loss` a gradient of `aux_loss_scale()`, so the
balancing gradient reaches the router through the routed activations (Megatron's
MoEAuxLossAutoScaler). The trainer sets the scale, e.g. 1/num_microbatches.

Context parallelism splits each sequence over the CP ranks. The Switch and sequence-wise losses
are linear in the probability sums over tokens, so `switch_aux_from_sums` / `seq_aux_from_sums`
with expert counts summed over CP and a rank's own probability sums give that rank's share: the
shares add up to the whole sequence's loss, and each share's gradient is exactly the loss's
gradient w.r.t. that rank's tokens (TopKRouter does this when it has a `cp_group`).
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


def switch_aux_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int,
                    num_tokens: int | torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer loss `E/k * sum_e f_e * P_e` (f_e: tokens routed to e / T; P_e: mean prob).

    `counts_E` may come from more tokens than `probs_TE` (the global batch); then pass
    their number as `num_tokens` (an int or a 0-dim fp32 tensor: the same bits for counts below 2^24).
    """
    T, E = probs_TE.shape
    tokens = T if num_tokens is None else num_tokens
    f_E = counts_E.float() / tokens
    p_E = probs_TE.mean(0)
    return (f_E * p_E).sum() * (E / top_k)


def seq_counts(topk_idx_TK: torch.Tensor, num_experts: int, seq_len: int) -> torch.Tensor:
    """Slots routed to each expert in each sequence, `[B, E]` fp32 (tokens are B sequences of `seq_len`)."""
    T, K = topk_idx_TK.shape
    if T % seq_len:
        raise ValueError(f"seq_aux_loss: {T} tokens are not a whole number of sequences of {seq_len}")
    B, device = T // seq_len, topk_idx_TK.device
    seq_of_slot = torch.arange(B, device=device).repeat_interleave(seq_len * K)
    return torch.zeros(B * num_experts, device=device).index_add_(
        0, seq_of_slot * num_experts + topk_idx_TK.reshape(-1), torch.ones(T * K, device=device)).view(B, num_experts)


def seq_aux_loss(probs_TE: torch.Tensor, topk_idx_TK: torch.Tensor, seq_len: int) -> torch.Tensor:
    """DeepSeek's sequence-wise loss: the Switch loss of each sequence, averaged over sequences."""
    T, E = probs_TE.shape
    counts_BE = seq_counts(topk_idx_TK, E, seq_len)
    B, K = counts_BE.shape[0], topk_idx_TK.shape[1]
    probs_BSE = probs_TE.view(B, seq_len, E)
    per_seq = ((counts_BE / seq_len) * probs_BSE.mean(1)).sum(-1) * (E / K)
    return per_seq.mean()


def switch_aux_from_sums(prob_sums_E: torch.Tensor, counts_E: torch.Tensor, top_k: int, num_tokens: int,
                         count_tokens: int | float | torch.Tensor | None = None) -> torch.Tensor:
    """The Switch loss from sums over tokens: `E/k * sum_e (counts_e / count_tokens) * (prob_sums_e / num_tokens)`.

    `num_tokens`: the tokens of the micro-batch whose probabilities are summed (on every rank);
    `count_tokens`: those counted in `counts_E` (default `num_tokens`; more for a global batch).
    Linear in `prob_sums_E`: a context-parallel rank passes the sums over its own tokens and gets
    its share of the loss (see the module docstring).
    """
    tokens = num_tokens if count_tokens is None else count_tokens
    E = prob_sums_E.shape[-1]
    return ((counts_E.to(prob_sums_E.dtype) / tokens) * (prob_sums_E / num_tokens)).sum() * (E / top_k)


def seq_aux_from_sums(prob_sums_BE: torch.Tensor, counts_BE: torch.Tensor, top_k: int, seq_len: int) -> torch.Tensor:
    """`seq_aux_loss` from per-sequence sums `[B, E]` over `seq_len` tokens (the whole sequence's
    length); linear in `prob_sums_BE`, like `switch_aux_from_sums`."""
    E = prob_sums_BE.shape[-1]
    return (((counts_BE.to(prob_sums_BE.dtype) / seq_len) * (prob_sums_BE / seq_len)).sum(-1) * (E / top_k)).mean()


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss: mean squared log-partition, keeps router logits small."""
    return torch.logsumexp(logits_TE, dim=-1).pow(2).mean()
