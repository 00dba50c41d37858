"""Context parallel: one long sequence split over the CP ranks, attention exchanging keys/values.

    model = MoETransformer(cfg)                    # full weights, identical on every rank
    ps = ParallelState.build(ParallelConfig(cp=2))
    context_parallelize(model, ps)                 # after tensor_parallelize, when both are used
    batch = split_batch(ps.cp, input_ids, labels)  # this rank's tokens, labels and positions
    out = model(**batch)                           # out.loss, out.total_loss: the whole sequence's

Design notes: docs/parallel.md (`moetron/parallel/context_parallel.py`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from moetron.ops.attention_core import core_attention
from moetron.parallel import comm
from moetron.parallel.state import Group

__all__ = ["chunk_ids", "local_positions", "split_for_cp", "merge_cp_shards", "gather_from_cp", "split_batch",
           "gqa_attention", "gather_latent", "attend_local_chunks", "cp_reduce_loss"]



# ---- layout ---------------------------------------------------------------------------------------


def _check_cp(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context parallel rank {cp_rank} is not in a group of {cp_size}")


def _chunk_len(seq_len: int, cp_size: int, what: str = "sequence length") -> int:
    if seq_len % (2 * cp_size):
        raise ValueError(f"context parallel: 2*cp = {2 * cp_size} does not divide the {what} {seq_len} (each cp "
                         f"rank holds two equal chunks of the causal load-balanced split); pad the sequence")
    return seq_len // (2 * cp_size)


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2*cp_size) that CP rank `cp_rank` holds, in local order."""
    _check_cp(cp_size, cp_rank)
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions [seq_len // cp_size] of rank `cp_rank`'s tokens of a `seq_len` sequence."""
    L = _chunk_len(seq_len, cp_size)
    return torch.cat([torch.arange(c * L, (c + 1) * L, device=device) for c in chunk_ids(cp_size, cp_rank)])


@functools.lru_cache(maxsize=64)
def _global_order_cpu(seq_len: int, cp_size: int) -> torch.Tensor:
    return torch.argsort(torch.cat([local_positions(seq_len, cp_size, r) for r in range(cp_size)]))


def _global_order(seq_len: int, cp_size: int, device=None) -> torch.Tensor:
    """Index into the rank-major concatenation of all local sequences, for each global position."""
    return _global_order_cpu(seq_len, cp_size).to(device)


def split_for_cp(t: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `cp_rank`'s part of a whole-sequence tensor (sequence along `dim`): a copy, no autograd
    exchange (for data: ids, labels, positions)."""
    if cp_size == 1:
        return t
    return t.index_select(dim, local_positions(t.shape[dim], cp_size, cp_rank, t.device))


def merge_cp_shards(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int = 1) -> torch.Tensor:
    """Inverse of split_for_cp, in one process: shards[r] is rank r's part."""
    cat = torch.cat(list(shards), dim=dim)
    return cat.index_select(dim, _global_order(cat.shape[dim], len(shards), cat.device))


def gather_from_cp(t: torch.Tensor, group: Group, dim: int = 1, *, reduce_grad: bool = True) -> torch.Tensor:
    """The whole sequence in global order, from every CP rank's local part (autograd: backward
    reduce-scatters, or with reduce_grad=False keeps this rank's rows when every rank's consumer is
    the same; see comm.all_gather)."""
    if group.size == 1:
        return t
    dim = dim % t.dim()
    gathered = comm.all_gather(t, group, dim, reduce_grad=reduce_grad)
    return gathered.index_select(dim, _global_order(gathered.shape[dim], group.size, t.device))


def split_batch(group: Group, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    """This CP rank's `model(**batch)` arguments from the whole batch ([B, S] each; `extra` tensors
    [B, S, ...] are split the same way). position_ids default to 0..S-1 (what one process uses)."""
    S = input_ids.shape[1]
    _chunk_len(S, group.size)
    if position_ids is None:
        position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0)
    out = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, **extra}
    for name, t in out.items():
        if t is not None and t.shape[1] != S:
            raise ValueError(f"split_batch: {name} has {t.shape[1]} positions along dim 1, input_ids {S}")
    return {name: None if t is None else split_for_cp(t, group.size, group.rank) for name, t in out.items()}


# ---- attention ------------------------------------------------------------------------------------


def attend_local_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str,
                        cp_size: int, cp_rank: int) -> torch.Tensor:
    """Causal attention of this rank's queries q [B,h,2L,dqk] (its two chunks) to the whole
    sequence's k [B,h_kv,S,dqk], v [B,h_kv,S,dv] in global order: each chunk attends to the prefix
    that ends with it. Returns [B,h,2L,dv]."""
    S_local, S = q.shape[-2], k.shape[-2]
    if S_local * cp_size != S or S_local % 2:
        raise ValueError(f"context parallel attention: {S_local} local queries (two equal chunks) and {S} keys "
                         f"do not fit cp={cp_size}")
    L = S_local // 2
    outs = [core_attention(q[..., j * L:(j + 1) * L, :], k[..., :(c + 1) * L, :], v[..., :(c + 1) * L, :],
                           scale, backend)
            for j, c in enumerate(chunk_ids(cp_size, cp_rank))]
    return torch.cat(outs, dim=-2)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str,
                  group: Group) -> torch.Tensor:
    """GQA under CP: q, k, v are this rank's [B,heads,2L,d] (RoPE applied with global positions);
    k and v of every rank are gathered in one collective."""
    d = k.shape[-1]
    kv = gather_from_cp(torch.cat((k, v), dim=-1), group, dim=2)
    return attend_local_chunks(q, kv[..., :d], kv[..., d:], scale, backend, group.size, group.rank)


def gather_latent(latent: torch.Tensor, k_rot: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA under CP: the whole sequence's normed kv latent [B,S,r] and rotated shared key
    [B,1,S,d_rope], from this rank's [B,2L,r] and [B,1,2L,d_rope], in one collective."""
    B, _, S_local, d = k_rot.shape
    both = gather_from_cp(torch.cat((latent, k_rot.reshape(B, S_local, d)), dim=-1), group, dim=1)
    latent, k_rot = both.split([latent.shape[-1], d], dim=-1)
    return latent, k_rot.unsqueeze(1)


# ---- losses and the model -------------------------------------------------------------------------


def cp_reduce_loss(loss: torch.Tensor, num_tokens: int, group: Group) -> tuple[torch.Tensor, int]:
    """Token-weighted mean over CP of each rank's mean `loss` over its `num_tokens` labels.

    Returns (sum_r loss_r * n_r / N, N) with N = sum_r n_r: the same value on every rank; backward
    gives each rank's loss the gradient n_r / N (its share), so summing the ranks' parameter
    gradients gives the gradient of the global mean. Collective over `group`.
    """
    if group.size == 1:
        return loss, num_tokens
    counts = torch.tensor([int(num_tokens)], dtype=torch.int64, device=loss.device)
    dist.all_reduce(counts, group=group.handle)
    total = int(counts.item())
    share = loss * (num_tokens / max(total, 1))
    return comm.all_reduce(share, group), total

