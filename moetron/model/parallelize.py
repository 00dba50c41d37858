"""tensor_parallelize: shard a built MoETransformer in place over the tensor-parallel group.

    model = MoETransformer(cfg)                       # full weights, identical on every rank
    ps = ParallelState.build(ParallelConfig(tp=2, sp=True))
    tensor_parallelize(model, ps)                     # now this rank's shards; same numerics
    out = model(input_ids, labels=labels)             # out.logits: [B, S, V/tp] (vocab shard)

Design notes: docs/parallel.md (`moetron/model/parallelize.py`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from moetron.model.attention import GroupedQueryAttention, MultiLatentAttention
from moetron.model.layer import DecoderLayer
from moetron.model.model import IGNORE_INDEX, MoETransformer
from moetron.model.mtp import shift_left
from moetron.model.mtp import MTPModule
from moetron.moe.experts import GroupedExperts
from moetron.moe.layer import MoELayer
from moetron.parallel import comm
from moetron.parallel.config import ParallelConfig, validate_for_model
from moetron.parallel.state import Group, ParallelState
from moetron.moe.router import TopKRouter
from moetron.moe.tensor_parallel import TensorParallelMoELayer
from moetron.parallel.context_parallel import CPComm, cp_reduce_loss, gather_from_cp, local_positions, split_for_cp
from moetron.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, all_gather_linear,
                                              column_parallel_forward, parallelize_mlp, sum_grad_over_group)
from moetron.parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["ContextParallelModel", "context_parallelize", "parallelize", "expert_parallelize", "tensor_parallelize",
           "unshard_tensors", "TensorParallelMoETransformer"]


# ---- the modules a sharded model is made of ---------------------------------------------------


class TensorParallelMoETransformer(MoETransformer):
    """MoETransformer with a vocab-parallel head and loss (set by tensor_parallelize)."""

    tp_group: Group
    sequence_parallel: bool
    overlap_chunks: int

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's vocabulary slice `[..., S, V/tp]` (the whole sequence)."""
        w = self.output_weight()
        if self.sequence_parallel:
            return all_gather_linear(h, [w], [None], self.tp_group, -2, self.overlap_chunks)[0]
        return F.linear(comm.copy_to_group(h, self.tp_group), w)

    def lm_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        count = int((labels != IGNORE_INDEX).sum())
        total = vocab_parallel_cross_entropy(logits, labels, self.tp_group, ignore_index=IGNORE_INDEX)
        return total / max(count, 1), count


class TensorParallelGQA(GroupedQueryAttention):
    """GQA holding this rank's heads: q, k and v share one entry into the TP region."""

    def project_qkv(self, x_BSH):
        return tuple(column_parallel_forward(x_BSH, [self.q_proj, self.k_proj, self.v_proj]))


class TensorParallelMLA(MultiLatentAttention):
    """MLA holding this rank's heads. The kv latent and the shared rotary key are computed on this
    rank's tokens and then enter the TP region (gathered along the sequence under SP)."""

    tp_group: Group
    sequence_parallel: bool

    def latent_kv(self, x_BSH):
        latent, k_rot = super().latent_kv(x_BSH)
        if self.sequence_parallel:
            both = comm.all_gather(torch.cat([latent, k_rot], dim=-1), self.tp_group, -2)
            return both.split([latent.shape[-1], k_rot.shape[-1]], dim=-1)
        return comm.copy_to_group(latent, self.tp_group), comm.copy_to_group(k_rot, self.tp_group)


# ---- tensor_parallelize ---------------------------------------------------------------------


def _check_model(model: MoETransformer, ps: ParallelState) -> None:
    cfg, tp = model.config, ps.tp.size
    has_dense = any(not isinstance(m.mlp, MoELayer) for m in model.modules() if isinstance(m, DecoderLayer))
    validate_for_model(
        ParallelConfig(tp=tp, sp=ps.sequence_parallel), num_attention_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_kv_heads if cfg.attention_type == "gqa" else None,
        ffn_hidden_size=cfg.intermediate_size if has_dense else None)
    if cfg.vocab_size % tp:
        raise ValueError(f"tp={tp} does not divide vocab_size={cfg.vocab_size} (the embedding and output "
                         f"head are split on the vocabulary); pad the vocabulary to a multiple of tp")
    shared = cfg.moe_config().shared_expert_ffn_size
    if shared % tp:
        raise ValueError(f"tp={tp} does not divide the shared experts' ffn size {shared} "
                         f"(moe_intermediate_size * n_shared_experts)")


def _parallelize_gqa(attn: GroupedQueryAttention, tp: Group, sp: bool, chunks: int) -> None:
    kw = dict(sequence_parallel=sp, overlap_chunks=chunks)
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    attn.q_proj = ColumnParallelLinear.from_linear(attn.q_proj, tp, **kw)
    if kv_heads % tp.size == 0:
        attn.k_proj = ColumnParallelLinear.from_linear(attn.k_proj, tp, **kw)
        attn.v_proj = ColumnParallelLinear.from_linear(attn.v_proj, tp, **kw)
    else:  # fewer kv heads than ranks: tp/kv_heads consecutive ranks share kv head j
        j = tp.rank // (tp.size // kv_heads)
        rows = slice(j * d, (j + 1) * d)
        attn.k_proj = ColumnParallelLinear.from_linear(attn.k_proj, tp, replicate_rows=rows, **kw)
        attn.v_proj = ColumnParallelLinear.from_linear(attn.v_proj, tp, replicate_rows=rows, **kw)
    attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, tp, **kw)
    for norm in (attn.q_norm, attn.k_norm):  # one weight for all heads; this rank sees its heads
        sum_grad_over_group(norm.weight, tp)
    attn.num_heads, attn.num_kv_heads = heads // tp.size, max(kv_heads // tp.size, 1)
    attn.__class__ = TensorParallelGQA


def _parallelize_mla(attn: MultiLatentAttention, tp: Group, sp: bool, chunks: int) -> None:
    kw = dict(sequence_parallel=sp, overlap_chunks=chunks)
    replicated = [attn.kv_a_proj_with_mqa, attn.kv_a_layernorm]
    if attn.cfg.q_lora_rank is None:
        attn.q_proj = ColumnParallelLinear.from_linear(attn.q_proj, tp, **kw)
    else:
        attn.q_b_proj = ColumnParallelLinear.from_linear(attn.q_b_proj, tp, **kw)
        replicated += [attn.q_a_proj, attn.q_a_layernorm]
    attn.kv_b_proj = ColumnParallelLinear.from_linear(attn.kv_b_proj, tp, gather_input=False)
    attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, tp, **kw)
    if sp:  # the a-projections and their norms run on this rank's sequence shard
        for module in replicated:
            for p in module.parameters():
                sum_grad_over_group(p, tp)
    attn.num_heads //= tp.size
    attn.tp_group, attn.sequence_parallel = tp, sp
    attn.__class__ = TensorParallelMLA


def tensor_parallelize(model: MoETransformer, parallel_state: ParallelState, *, overlap_chunks: int = 1,
                       moe_dispatcher: str | None = None, flex_backend: str = "torch") -> MoETransformer:
    """Shard `model` (full, identical weights on every TP rank) in place over `parallel_state.tp`.

    Sequence parallel follows `parallel_state.sequence_parallel`. `overlap_chunks > 1` (sequence
    parallel only) splits each all-gather->GEMM and GEMM->reduce-scatter into that many overlapped
    chunks. `moe_dispatcher` names the MoE dispatcher (MoELayer's default when None). Returns the
    model (whose class becomes TensorParallelMoETransformer). With tp=1 the model is returned as is.
    """
    tp, sp = parallel_state.tp, parallel_state.sequence_parallel
    if tp.size == 1:
        return model
    if isinstance(model, TensorParallelMoETransformer):
        raise ValueError("this model is already tensor-parallel")
    if overlap_chunks < 1:
        raise ValueError(f"overlap_chunks={overlap_chunks} must be >= 1 (1: no chunking)")
    _check_model(model, parallel_state)

    model.embed_tokens = VocabParallelEmbedding.from_embedding(model.embed_tokens, tp, sequence_parallel=sp)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, tp, sequence_parallel=sp,
                                                         overlap_chunks=overlap_chunks)
    sp_replicated: list[nn.Module] = [model.norm]
    for layer in [m for m in model.modules() if isinstance(m, DecoderLayer)]:
        attn = layer.self_attn
        if isinstance(attn, MultiLatentAttention):
            _parallelize_mla(attn, tp, sp, overlap_chunks)
        else:
            _parallelize_gqa(attn, tp, sp, overlap_chunks)
        if isinstance(layer.mlp, MoELayer):
            layer.mlp = TensorParallelMoELayer.from_moe_layer(layer.mlp, parallel_state, moe_dispatcher,
                                                              overlap_chunks=overlap_chunks,
                                                              flex_backend=flex_backend)
        else:
            parallelize_mlp(layer.mlp, tp, sp, overlap_chunks)
        sp_replicated += [layer.input_layernorm, layer.post_attention_layernorm]
    for mtp in model.modules():
        if isinstance(mtp, MTPModule):
            sp_replicated += [mtp.enorm, mtp.hnorm, mtp.eh_proj, mtp.final_norm]
    if sp:  # these run on this rank's sequence shard only
        for module in sp_replicated:
            for p in module.parameters():
                sum_grad_over_group(p, tp)

    model.__class__ = TensorParallelMoETransformer
    model.tp_group, model.sequence_parallel, model.overlap_chunks = tp, sp, overlap_chunks
    return model


# ---- back to full shapes --------------------------------------------------------------------


def _unshard_expert(experts: GroupedExperts, leaf: str, t: torch.Tensor) -> torch.Tensor:
    if leaf == "gate_up_proj":
        gate, up = t.split(experts.local_ffn_size, dim=1)
        if experts.etp_group is not None:
            gate, up = comm.all_gather(gate, experts.etp_group, 1), comm.all_gather(up, experts.etp_group, 1)
        t = torch.cat([gate, up], dim=1)
    elif experts.etp_group is not None:
        t = comm.all_gather(t, experts.etp_group, 2)
    return t if experts.ep_group is None else comm.all_gather(t, experts.ep_group, 0)


@torch.no_grad()
def unshard_tensors(model: nn.Module, parallel_state: ParallelState,
                    tensors: Mapping[str, torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
    """Full-shape tensors by parameter name: the parameters, or `tensors` laid out like them (their
    `.grad`s, optimizer moments). Sharded ones are all-gathered over TP (experts over ETP and EP);
    replicated ones are returned as they are. Collective: every rank of the model calls it."""
    params = dict(model.named_parameters())
    if tensors is None:
        tensors = {n: p.detach() for n, p in params.items()}
    experts = {prefix: m for prefix, m in model.named_modules() if isinstance(m, GroupedExperts)}
    out = {}
    for name, p in params.items():  # the same order on every rank
        t = tensors.get(name)
        t = torch.zeros_like(p) if t is None else t.detach().contiguous()
        prefix, _, leaf = name.rpartition(".")
        if prefix in experts:
            out[name] = _unshard_expert(experts[prefix], leaf, t)
        elif getattr(p, "tensor_model_parallel", False):
            out[name] = comm.all_gather(t, parallel_state.tp, p.partition_dim)
        else:
            out[name] = t
    return out


# ---- expert parallel without tensor parallel ------------------------------------------------


@torch.no_grad()
def expert_parallelize(model: MoETransformer, parallel_state: ParallelState, dispatcher: str | None = None, *,
                       flex_backend: str = "torch") -> MoETransformer:
    """Give every MoE layer of `model` (full weights, identical on every rank) the expert grid of
    `parallel_state`: experts sharded over EP x ETP and reached through `dispatcher`, balancing
    statistics reduced over the stage's ranks. Router and shared experts are kept as they are
    (routers get the CP group when cp > 1). For tp > 1 use `tensor_parallelize`, which does this too."""
    if parallel_state.tp.size > 1:
        raise ValueError("expert_parallelize is for tp=1; tensor_parallelize shards experts under TP")
    for layer in [m for m in model.modules() if isinstance(m, DecoderLayer)]:
        old = layer.mlp
        if not isinstance(old, MoELayer) or old.parallel_state is not None:
            continue
        gate_up, down = old.experts.gate_up_proj, old.experts.down_proj
        sharded = parallel_state.ep.size * parallel_state.etp.size > 1
        new = MoELayer(old.config, (dispatcher or "alltoall") if sharded else "local",
                       parallel_state=parallel_state, pad_multiple=getattr(old.dispatcher, "pad_multiple", 1),
                       flex_backend=flex_backend)
        new.experts.to(gate_up.dtype)
        new.experts.load_full_experts(gate_up, down)
        new.router, new.shared_experts, new.shared_expert_gate = old.router, old.shared_experts, old.shared_expert_gate
        new.train(old.training)
        layer.mlp = new
    return model


# ---- context parallel ------------------------------------------------------------------------


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
        return cp_reduce_loss(loss, int(count), self.cp_group)

    def shift_labels(self, labels: torch.Tensor, k: int) -> torch.Tensor:
        """`labels[:, i+k]` of the whole sequence at each local position i (IGNORE past the end)."""
        if k == 0:
            return labels
        cp = self.cp_group
        full = gather_from_cp(labels, cp, dim=1)
        return split_for_cp(shift_left(full, k, IGNORE_INDEX), cp.size, cp.rank)


_cp_classes: dict[type, type] = {}


def _context_parallel_class(base: type) -> type:
    if base not in _cp_classes:
        name = f"ContextParallel{base.__name__}"
        cls = type(name, (ContextParallelModel, base), {"__module__": __name__, "__doc__": base.__doc__})
        globals()[name] = _cp_classes[base] = cls  # importable by name (pickle)
    return _cp_classes[base]


def context_parallelize(model, parallel_state: ParallelState, cp_comm_type: str = "allgather"):
    """Make `model` (a MoETransformer, possibly tensor-parallel already) run on this CP rank's part
    of each sequence, in place; returns it. With cp=1 the model is returned as is.

    Every attention module and router gets `cp_group` (attention also `cp_comm`, its exchange:
    `cp_comm_type` allgather, p2p, a2a or a2a+p2p); the model's class gains ContextParallelModel. Call it
    after tensor_parallelize (which replaces the model's class). Feed it `split_batch` outputs.
    """
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
    cp_comm = CPComm.build(cp_comm_type, parallel_state)
    for m in attention:  # limits per TP rank; MLA exchanges per-head K/V, one per query head
        cp_comm.check(m.num_heads, m.num_kv_heads if isinstance(m, GroupedQueryAttention) else m.num_heads,
                      m.cfg.attention_backend)
    for m in attention:
        m.cp_group, m.cp_comm = cp, cp_comm
    for router in model.modules():  # balancing losses over the whole sequences (see "Balancing losses")
        if isinstance(router, TopKRouter):
            router.cp_group = cp
    model.__class__ = _context_parallel_class(type(model))
    model.cp_group = cp
    return model


# ---- the entry point -------------------------------------------------------------------------


def parallelize(model: MoETransformer, parallel_state: ParallelState, parallel: ParallelConfig) -> MoETransformer:
    """Shard a built model in place for this rank: tensor (+ sequence) parallel or expert parallel,
    then context parallel. The trainer and `moetron convert` both shard through here (pipeline
    stages are cut afterwards by `moetron.pipeline.stage.pipeline_stages`)."""
    ps, p = parallel_state, parallel
    if ps.world_size == 1:
        return model
    if ps.tp.size > 1:
        tensor_parallelize(model, ps, moe_dispatcher=p.dispatcher, flex_backend=p.flex_backend,
                           overlap_chunks=p.tp_comm_overlap_chunks if p.tp_comm_overlap else 1)
    else:
        expert_parallelize(model, ps, p.dispatcher, flex_backend=p.flex_backend)
    if ps.cp.size > 1:  # after tensor_parallelize, which replaces the model's class
        context_parallelize(model, ps, p.cp_comm_type)
    return model
