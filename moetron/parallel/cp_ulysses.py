"""Ulysses all-to-all (`parallel.cp_comm_type=a2a`, and the inner level of `a2a+p2p`).

Before attention one all-to-all over the group turns this rank's [B, h, S_local, d] (all heads, its
positions) into [B, h/a, a*S_local, d] (its h/a heads, the positions of all a ranks), put in the
order the caller asks for (`order`, an index into the rank-major concatenation: the whole sequence
in global order for a2a, the outer ring's two-chunk layout for a2a+p2p); after attention the inverse
all-to-all brings the output back. Both are comm.all_to_all, whose backward is the same exchange
reversed. Heads must divide by the group size; kv heads that do not are replicated when they divide
it (kv_heads < a: each kv head goes to the a/kv_heads ranks whose query heads it serves).
Design notes: docs/parallel.md (context parallel).
"""

from __future__ import annotations

import torch

from moetron.parallel import comm
from moetron.parallel.state import Group

__all__ = ["check_heads", "sequence_to_heads", "heads_to_sequence", "replicate_kv_heads"]


def check_heads(heads: int, kv_heads: int | None, a2a: int, what: str = "attention") -> None:
    """The head-count limit of an all-to-all over `a2a` ranks (heads here are per tensor-parallel rank)."""
    if heads % a2a:
        raise ValueError(f"context parallel all-to-all over {a2a} ranks splits the {what} heads, but this rank "
                         f"holds {heads} query heads (num_attention_heads / tp): {a2a} must divide them; use "
                         f"parallel.cp_comm_type=allgather or p2p, or a smaller all-to-all group")
    if kv_heads is not None and kv_heads % a2a and a2a % kv_heads:
        raise ValueError(f"context parallel all-to-all over {a2a} ranks: this rank holds {kv_heads} kv heads "
                         f"(num_kv_heads / tp), which neither divide by {a2a} nor divide it (then they would be "
                         f"replicated); use parallel.cp_comm_type=allgather or p2p")


def replicate_kv_heads(t: torch.Tensor, a2a: int) -> torch.Tensor:
    """kv [B,hk,S,d] with hk < a2a: each head repeated a2a/hk times, so rank r of the all-to-all gets
    the kv head of its query heads (heads r*h/a2a.. all belong to kv head r*hk/a2a)."""
    hk = t.shape[1]
    return t if hk % a2a == 0 else t.repeat_interleave(a2a // hk, dim=1)


def sequence_to_heads(x: torch.Tensor, group: Group, order: torch.Tensor) -> torch.Tensor:
    """[B,h,S_local,d] (this rank's positions) -> [B,h/a,a*S_local,d] (this rank's heads, the
    group's positions permuted by `order`)."""
    B, h, S_local, d = x.shape
    a = group.size
    blocks = x.reshape(B, a, h // a, S_local, d).movedim(1, 0)  # block s: the heads rank s gets
    y = comm.all_to_all(blocks, group)  # block r: rank r's positions
    y = y.movedim(0, 2).reshape(B, h // a, a * S_local, d)
    return y.index_select(2, order)


def heads_to_sequence(y: torch.Tensor, group: Group, inverse: torch.Tensor) -> torch.Tensor:
    """Inverse of sequence_to_heads (`inverse` = argsort(order)): [B,h/a,S,d] -> [B,h,S/a,d]."""
    B, hl, S, d = y.shape
    a = group.size
    blocks = y.index_select(2, inverse).reshape(B, hl, a, S // a, d).movedim(2, 0)  # block s: rank s's positions
    x = comm.all_to_all(blocks, group)  # block r: rank r's heads
    return x.movedim(0, 1).reshape(B, a * hl, S // a, d)
