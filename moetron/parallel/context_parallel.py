"""Context parallel: one long sequence split over the CP ranks, attention exchanging keys/values.

    model = MoETransformer(cfg)                    # full weights, identical on every rank
    ps = ParallelState.build(ParallelConfig(cp=2))
    context_parallelize(model, ps)                 # after tensor_parallelize, when both are used
    batch = split_batch(ps.cp, input_ids, labels)  # this rank's tokens, labels and positions
    out = model(**batch)                           # out.loss, out.total_loss: the whole sequence's

Layout (causal load balance). The sequence is cut into 2*cp equal chunks; CP rank i holds chunks
i and 2*cp-1-i, in that order, so its local sequence is `[chunk i | chunk 2cp-1-i]`. Under a causal
mask chunk c attends to c+1 chunks of keys, so every rank attends to (i+1) + (2cp-i) = 2cp+1 chunks:
the same work everywhere, where a contiguous split would leave the last rank cp times the first's.
Positions (RoPE) are the chunks' global positions (`local_positions`); everything outside attention
(norms, MLP, MoE routing, the LM head) is per token and needs no exchange.

Key/value exchange: all-gather, not a ring. Each attention layer all-gathers this rank's keys and
values over the CP group once (backward: reduce-scatter of their gradients, comm.all_gather), puts
them in global order, and attends each local chunk to the prefix of the sequence that ends with it
(core_attention's bottom-right causal mask), so no rank computes blocks that are entirely masked.
Why:
- Memory. All-gather holds the whole sequence's K/V per layer, a ring only 1/cp of it. For GQA
  that is 2 * kv_heads * head_dim per token (Qwen3-235B: 2*4*128 = 1024 values, against 8192
  per token for the query chunk it serves), small next to the activations a layer keeps anyway.
  For MLA we gather the *compressed* latent and the shared rotary key (kv_lora_rank + rope_dim =
  576 values per token for DeepSeek-V3) and decompress it here with kv_b_proj: 71x fewer bytes on
  the wire than its per-head K/V (128 heads * (192 + 128) = 40960), which is what a ring would
  pass around (or re-decompress on every hop). The price is that each rank decompresses the whole
  sequence (kv_b_proj on S tokens, about 800*cp/S of the attention FLOPs: 5% at S=128K, cp=8) and
  holds the decompressed K/V of the sequence for backward; activation recompute bounds that.
- Load balance. With the chunk layout above, prefix attention is exactly balanced; a ring needs
  the same layout plus half-block bookkeeping per step to be balanced.
- Correct backward for free. The exchange is one autograd all-gather whose adjoint is a
  reduce-scatter; the attention itself is the unchanged core_attention of every backend (sdpa,
  eager, flash-attn and Transformer Engine all support the bottom-right causal mask), so there is
  no online-softmax merge and no log-sum-exp to thread through each kernel's backward.
- Communication. One gather per layer, not cp-1 dependent steps; it is exposed (not overlapped
  with compute as a ring's P2P is), which matters less because the gathered tensor is small
  (GQA kv heads, MLA latent), as in Llama 3's context parallel.

Losses. `context_parallelize` makes the model's `lm_loss` CP-reduced (`cp_reduce_loss`): the token-
weighted mean over every CP rank's labels, identical on every CP rank, whose backward on each rank
is that rank's share (local loss * local count / global count). So `out.loss`, `out.mtp_loss`,
`out.total_loss` and `out.num_tokens` equal the one-process values, and the sum of the CP ranks'
gradients is the one-process gradient. Gradient reduction must therefore SUM over CP (a data-
parallel mean over dp_cp divides by cp too many: average over dp only, or scale the loss by cp).

Pipeline parallel (cp x pp, every schedule): context_parallelize the model before cutting it into
stages and feed `run_schedule` each micro-batch's `split_batch` (as the trainer does). Stages then
pass [B, S/cp, hidden] activations, attention exchanges K/V over CP inside each stage, and the
loss stage uses this model's CP-reduced `lm_loss` and `shift_labels` (moetron/pipeline/stage.py),
so the pipeline's losses and gradients are the one-process ones, as without a pipeline.

Multi-token prediction shifts labels along the sequence, across chunk borders; under CP it needs
`MoETransformer._mtp_loss` to shift through a `shift_labels(labels, k)` method, which the CP model
overrides with a gather-shift-split of the (integer) labels. Without that hook,
`context_parallelize` refuses MTP models with a clear error.

Balancing losses. Routing is per token, so it is exact under CP. The balancing losses are exact
through the router's `cp_group` (set by context_parallelize): the router sums its expert counts over CP (per
sequence for `seq_aux_loss`) and each rank injects its share of the whole sequences'
`aux_loss` / `seq_aux_loss` / `global_aux_loss`. These losses are linear in the probability sums
over tokens, so the shares add up to the loss and each share's gradient is the loss's gradient
w.r.t. that rank's tokens. Set the aux-loss scale to 1/cp (balancing.set_aux_loss_scale, as the
trainer does): that is the right weight for `z_loss`, a per-token mean, and the router injects
cp x share for the others, so the CP sum of the gradients is the one-process one. The reported
values (`aux_losses`) are the whole sequences' on every CP rank (z_loss: the mean of the ranks'
means). Aux-loss-free bias updates are exact with `update_expert_bias(group)` summing over CP.
Not exact under CP: capacity drops (`capacity_factor`), taken over this rank's tokens against
its own capacity.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from moetron.model.attention_core import core_attention
from moetron.parallel import comm
from moetron.parallel.state import Group, ParallelState

__all__ = ["chunk_ids", "local_positions", "split_for_cp", "merge_cp_shards", "gather_from_cp", "split_batch",
           "gqa_attention", "gather_latent", "attend_local_chunks", "cp_reduce_loss", "context_parallelize",
           "ContextParallelModel"]

IGNORE_INDEX = -100  # moetron.model.model.IGNORE_INDEX (not imported: the model imports this module)


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


def _shift_left(t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    return torch.cat((t[:, k:], t.new_full((t.shape[0], k), fill)), dim=1)


class ContextParallelModel:
    """Mixin over the model's class (set by context_parallelize): global positions by default, CP-
    reduced losses, and MTP label shifts across chunk borders. Every CP rank must call forward."""

    cp_group: Group

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs):
        cp = self.cp_group
        S_local = input_ids.shape[1]
        if S_local % 2:
            raise ValueError(f"context parallel: this rank holds {S_local} positions; it must hold two equal "
                             f"chunks (use split_batch on sequences divisible by 2*cp = {2 * cp.size})")
        if position_ids is None:
            position_ids = local_positions(S_local * cp.size, cp.size, cp.rank, input_ids.device).unsqueeze(0)
        return super().forward(input_ids, labels=labels, position_ids=position_ids, **kwargs)

    def lm_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        loss, count = super().lm_loss(logits, labels)
        return cp_reduce_loss(loss, count, self.cp_group)

    def shift_labels(self, labels: torch.Tensor, k: int) -> torch.Tensor:
        """`labels[:, i+k]` of the whole sequence at each local position i (IGNORE past the end)."""
        if k == 0:
            return labels
        cp = self.cp_group
        full = gather_from_cp(labels, cp, dim=1)
        return split_for_cp(_shift_left(full, k, IGNORE_INDEX), cp.size, cp.rank)


_cp_classes: dict[type, type] = {}


def _context_parallel_class(base: type) -> type:
    if base not in _cp_classes:
        name = f"ContextParallel{base.__name__}"
        cls = type(name, (ContextParallelModel, base), {"__module__": __name__, "__doc__": base.__doc__})
        globals()[name] = _cp_classes[base] = cls  # importable by name (pickle)
    return _cp_classes[base]


def context_parallelize(model, parallel_state: ParallelState):
    """Make `model` (a MoETransformer, possibly tensor-parallel already) run on this CP rank's part
    of each sequence, in place; returns it. With cp=1 the model is returned as is.

    Every attention module and router gets `cp_group`; the model's class gains ContextParallelModel. Call it
    after tensor_parallelize (which replaces the model's class). Feed it `split_batch` outputs.
    """
    from moetron.model.attention import GroupedQueryAttention, MultiLatentAttention

    cp = parallel_state.cp
    if cp.size == 1:
        return model
    if isinstance(model, ContextParallelModel):
        raise ValueError("this model is already context-parallel")
    if model.config.num_mtp_layers and not hasattr(type(model), "shift_labels"):
        raise NotImplementedError(
            f"context parallel with multi-token prediction (num_mtp_layers={model.config.num_mtp_layers}) "
            f"needs {type(model).__name__}._mtp_loss to shift labels through a `shift_labels(labels, k)` "
            f"method (MTP labels cross chunk borders); use num_mtp_layers=0 or cp=1 until it does")
    attention = [m for m in model.modules() if isinstance(m, (GroupedQueryAttention, MultiLatentAttention))]
    if not attention:
        raise ValueError(f"context_parallelize: {type(model).__name__} has no attention modules")
    for m in attention:
        m.cp_group = cp
    from moetron.moe.router import TopKRouter

    for router in model.modules():  # balancing losses over the whole sequences (see "Balancing losses")
        if isinstance(router, TopKRouter):
            router.cp_group = cp
    model.__class__ = _context_parallel_class(type(model))
    model.cp_group = cp
    return model
