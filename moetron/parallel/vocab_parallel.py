"""Vocabulary-parallel embedding and cross-entropy: each TP rank holds V/tp rows of the
embedding/head, and the loss never builds full-vocabulary logits on one rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moetron.parallel import comm
from moetron.parallel.state import Group
from moetron.parallel.tensor_parallel import mark_sharded

__all__ = ["VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split over the group: rank r holds ids
    `r*V/tp ... (r+1)*V/tp - 1`. Each rank looks up its ids (zeros elsewhere) and the partial
    results are summed: all-reduce, or reduce-scatter along `seq_dim` with sequence parallel."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group, *,
                 sequence_parallel: bool = False, seq_dim: int = -2, init_std: float = 0.02):
        super().__init__()
        self._configure(num_embeddings, embedding_dim, group, sequence_parallel, seq_dim)
        self.weight = nn.Parameter(torch.empty(num_embeddings // group.size, embedding_dim))
        nn.init.normal_(self.weight, std=init_std)
        mark_sharded(self.weight, 0)

    def _configure(self, num_embeddings, embedding_dim, group, sequence_parallel, seq_dim) -> None:
        if num_embeddings % group.size:
            raise ValueError(f"tp={group.size} does not divide vocab_size={num_embeddings}: pad the "
                             f"vocabulary to a multiple of tp")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.sequence_parallel, self.seq_dim = group, sequence_parallel and group.size > 1, seq_dim
        self.vocab_start = group.rank * (num_embeddings // group.size)

    @classmethod
    @torch.no_grad()
    def from_embedding(cls, embedding: nn.Embedding, group: Group, *, sequence_parallel: bool = False,
                       seq_dim: int = -2) -> VocabParallelEmbedding:
        """This rank's rows of a full `nn.Embedding` (or a tied output weight's owner)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._configure(embedding.num_embeddings, embedding.embedding_dim, group, sequence_parallel, seq_dim)
        n = self.num_embeddings // group.size
        self.weight = nn.Parameter(embedding.weight[self.vocab_start:self.vocab_start + n].clone())
        mark_sharded(self.weight, 0)
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.weight.shape[0])
        emb = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), self.weight)
        emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)
        if not self.sequence_parallel:
            return comm.all_reduce(emb, self.group)
        dim = self.seq_dim % emb.dim()
        if emb.shape[dim] % self.group.size:
            raise ValueError(f"sequence parallel splits the sequence over tp={self.group.size} ranks, but "
                             f"input_ids of shape {tuple(ids.shape)} have {emb.shape[dim]} positions; "
                             f"use a sequence length divisible by tp")
        return comm.reduce_scatter(emb, self.group, dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (local rows {self.vocab_start}.."
                f"{self.vocab_start + self.weight.shape[0] - 1}), tp={self.group.size}, sp={self.sequence_parallel}")


# ---- vocab-parallel cross-entropy ------------------------------------------------------------


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from logits split on the vocabulary; only [N] vectors cross ranks."""

    @staticmethod
    def forward(ctx, logits_NV, labels_N, handle, vocab_start, ignore_index):
        x = logits_NV.float()
        n_local = x.shape[-1]
        max_N = x.max(dim=-1).values
        dist.all_reduce(max_N, op=dist.ReduceOp.MAX, group=handle)
        x = x - max_N.unsqueeze(-1)  # a fresh buffer: reused below for exp and softmax
        mine = (labels_N >= vocab_start) & (labels_N < vocab_start + n_local)
        local_N = (labels_N - vocab_start).masked_fill(~mine, 0)
        target_N = x.gather(1, local_N.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        x.exp_()
        stats = torch.stack([x.sum(dim=-1), target_N])  # one all-reduce for both
        dist.all_reduce(stats, group=handle)
        sum_exp_N, target_N = stats[0], stats[1]
        valid = labels_N != ignore_index
        loss_N = (torch.log(sum_exp_N) - target_N).masked_fill(~valid, 0.0)
        x.div_(sum_exp_N.unsqueeze(-1))  # softmax of this rank's vocabulary slice
        ctx.save_for_backward(x, local_N, mine & valid, valid)
        ctx.logits_dtype = logits_NV.dtype
        return loss_N

    @staticmethod
    def backward(ctx, grad_N):
        softmax, local_N, target_here, valid = ctx.saved_tensors
        g = grad_N.float().masked_fill(~valid, 0.0)
        grad = softmax * g.unsqueeze(-1)
        grad.scatter_add_(1, local_N.unsqueeze(1), -(g * target_here).unsqueeze(1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group: Group, *,
                                 vocab_start: int | None = None, ignore_index: int = -100,
                                 reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy of logits split on the vocabulary over `group`, in fp32, without gathering them.

    logits `[..., V/tp]` hold vocabulary ids `vocab_start ...` (default `rank * V/tp`); labels `[...]`
    hold full-vocabulary ids, `ignore_index` where ignored. Equals `F.cross_entropy` of the full
    logits; `reduction` is "sum" (as moetron.ops.cross_entropy), "mean" (over non-ignored labels)
    or "none". Backward needs no communication: each rank gets the gradient of its slice.
    """
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction={reduction!r}: choose 'sum', 'mean' or 'none'")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on the "
                         f"token dims")
    if vocab_start is None:
        vocab_start = group.rank * logits.shape[-1]
    logits_NV, labels_N = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if group.size == 1:
        loss_N = F.cross_entropy(logits_NV.float(), labels_N, ignore_index=ignore_index, reduction="none")
    else:
        loss_N = _VocabParallelCrossEntropy.apply(logits_NV, labels_N, group.handle, vocab_start, ignore_index)
    if reduction == "none":
        return loss_N.view(labels.shape)
    total = loss_N.sum()
    if reduction == "sum":
        return total
    return total / (labels_N != ignore_index).sum()
