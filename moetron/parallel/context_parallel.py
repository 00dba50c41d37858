"""Context parallel: one long sequence split over the CP ranks, attention exchanging keys/values.

    model = MoETransformer(cfg)                    # full weights, identical on every rank
    ps = ParallelState.build(ParallelConfig(cp=2))
    context_parallelize(model, ps)                 # after tensor_parallelize, when both are used
    batch = split_batch(ps.cp, input_ids, labels)  # this rank's tokens, labels and positions
    out = model(**batch)                           # out.loss, out.total_loss: the whole sequence's

Attention exchanges K/V by all-gather (default) or, by `parallel.cp_comm_type`, a p2p ring (cp_ring.py),
Ulysses all-to-all (cp_ulysses.py) or both (a2a+p2p): `CPComm`, `exchange_attention`.
Design notes: docs/parallel.md (`moetron/parallel/context_parallel.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetron.ops.attention_core import core_attention
from moetron.parallel import comm
from moetron.parallel.cp_ring import ring_attention
from moetron.parallel.cp_ulysses import check_heads, heads_to_sequence, replicate_kv_heads, sequence_to_heads
from moetron.parallel.state import Group, ParallelState

__all__ = ["chunk_ids", "local_positions", "split_for_cp", "merge_cp_shards", "gather_from_cp", "split_batch",
           "gqa_attention", "gather_latent", "attend_local_chunks", "cp_reduce_loss", "CP_COMM_TYPES", "CPComm",
           "exchange_attention"]


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
                  group: Group, cp_comm: CPComm | None = None) -> torch.Tensor:
    """GQA under CP: q, k, v are this rank's [B,heads,2L,d] (RoPE applied with global positions);
    k and v of every rank are gathered in one collective (or exchanged as `cp_comm` says)."""
    if cp_comm is not None and cp_comm.kind != "allgather":
        return exchange_attention(q, k, v, scale, backend, cp_comm)
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


# ---- p2p, a2a, a2a+p2p ------------------------------------------------------------------------------

CP_COMM_TYPES = ("allgather", "p2p", "a2a", "a2a+p2p")
RING_BACKENDS = ("sdpa", "eager")  # the ring computes its blocks itself (log-sum-exp merge)


@dataclass(frozen=True)
class CPComm:
    """How attention exchanges over the CP group `group`: `kind` (one of CP_COMM_TYPES), the all-to-all
    group `a2a` (a2a: the CP group; a2a+p2p: consecutive CP ranks) and the `ring` (p2p: the CP group;
    a2a+p2p: the CP ranks with the same a2a rank), with group.rank == ring.rank * a2a.size + a2a.rank."""

    kind: str
    group: Group
    a2a: Group | None = None
    ring: Group | None = None

    @classmethod
    def build(cls, kind: str, ps: ParallelState) -> CPComm:
        cp = ps.cp
        if kind not in CP_COMM_TYPES:
            raise ValueError(f"parallel.cp_comm_type={kind!r} is unknown; choose one of {', '.join(CP_COMM_TYPES)}")
        if kind == "a2a+p2p":
            a2a, ring = ps.group("cp_a2a"), ps.group("cp_p2p")
            if cp.rank != ring.rank * a2a.size + a2a.rank or a2a.size * ring.size != cp.size:
                raise ValueError(f"cp_a2a ({a2a.ranks}) and cp_p2p ({ring.ranks}) do not tile the CP group {cp.ranks}")
            return cls(kind, cp, a2a, ring)
        return cls(kind, cp, cp if kind == "a2a" else None, cp if kind == "p2p" else None)

    def a2a_size(self) -> int:
        return self.a2a.size if self.a2a is not None else 1

    def ring_size(self) -> int:
        return self.ring.size if self.ring is not None else 1

    def check(self, heads: int, kv_heads: int | None, backend: str) -> None:
        """This attention's limits (heads and kv heads per TP rank; kv_heads None: per-head K/V, as MLA)."""
        if self.a2a_size() > 1:
            check_heads(heads, kv_heads, self.a2a_size())
        if self.ring_size() > 1 and backend not in RING_BACKENDS:
            raise ValueError(f"parallel.cp_comm_type={self.kind} computes its attention blocks with torch (their "
                             f"log-sum-exp merge), so model.attention_backend={backend} cannot take effect: use "
                             f"model.attention_backend=sdpa or eager, or parallel.cp_comm_type=allgather or a2a")


@functools.lru_cache(maxsize=64)
def _a2a_orders_cpu(S_local: int, cp: int, a2a: int, ring_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse) of the all-to-all's rank-major positions: the group's positions ascending,
    which is the ring's two-chunk layout (consecutive CP ranks hold consecutive chunks)."""
    S = S_local * cp
    pos = torch.cat([local_positions(S, cp, ring_rank * a2a + r) for r in range(a2a)])
    order = torch.argsort(pos)
    return order, torch.argsort(order)


def exchange_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str,
                       cp_comm: CPComm) -> torch.Tensor:
    """Causal attention of this rank's q [B,h,2L,dqk] under p2p, a2a or a2a+p2p, from this rank's
    k [B,hk,2L,dqk] and v [B,hk,2L,dv] (RoPE applied with global positions). Returns [B,h,2L,dv]."""
    a, n = cp_comm.a2a_size(), cp_comm.ring_size()
    cp_comm.check(q.shape[1], k.shape[1], backend)
    if a > 1:
        order, inverse = (t.to(q.device) for t in _a2a_orders_cpu(q.shape[-2], cp_comm.group.size, a,
                                                                   cp_comm.ring.rank if n > 1 else 0))
        q = sequence_to_heads(q, cp_comm.a2a, order)
        kv = replicate_kv_heads(torch.cat((k, v), dim=-1), a)
        kv = sequence_to_heads(kv, cp_comm.a2a, order)
        k, v = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    out = ring_attention(q, k, v, scale, cp_comm.ring) if n > 1 else core_attention(q, k, v, scale, backend)
    return heads_to_sequence(out, cp_comm.a2a, inverse) if a > 1 else out


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

