"""tensor_parallelize: shard a built MoETransformer in place over the tensor-parallel group.

    model = MoETransformer(cfg)                       # full weights, identical on every rank
    ps = ParallelState.build(ParallelConfig(tp=2, sp=True))
    tensor_parallelize(model, ps)                     # now this rank's shards; same numerics
    out = model(input_ids, labels=labels)             # out.logits: [B, S, V/tp] (vocab shard)

What each piece becomes (T = tokens, tp = ps.tp.size):
- attention split by heads. GQA: q/k/v column-parallel, o row-parallel; when tp exceeds the kv
  heads, each kv head is replicated on the tp/kv ranks that need it (the whole k/v weight stays on
  every rank, each rank uses its head's rows, gradients are summed over TP). MLA: q_proj or
  q_b_proj and kv_b_proj column-parallel, o_proj row-parallel; the low-rank a-projections and their
  norms replicated and run before the TP region, so only the compressed latents cross ranks.
- dense MLP and shared experts split on the intermediate dim (gate/up column, down row).
- embedding and output head vocab-parallel; the LM and MTP losses use the vocab-parallel
  cross-entropy, so full-vocabulary logits never exist on one rank.
- norms replicated. With sequence parallel (ps.sequence_parallel) the residual stream, norms and
  MoE layers hold this rank's S/tp positions; column-parallel layers all-gather the sequence and
  row-parallel ones reduce-scatter it, in place of the all-reduce.
- routed experts use expert-tensor parallelism through MoELayer(parallel_state=ps)
  (TensorParallelMoELayer below): the router runs on the TP group's whole sequence, so capacity,
  drops and balancing losses are exactly those of one process; each rank then dispatches only its
  own S/tp (or, without sequence parallel, T/tp) tokens over the expert grid (ETP x EP).

Replicated parameters that see only part of the work on a rank (norms under sequence parallel,
per-head q/k norms, shared kv heads, MLA a-projections under sequence parallel) sum their
gradients over TP inside backward (tensor_parallel.sum_grad_over_group). After backward every
`.grad` is complete; data-parallel reduction then works on it unchanged. Sharded parameters carry
`tensor_model_parallel=True` and `partition_dim`, like Megatron's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetron.dispatch.routing import Routing
from moetron.model.attention import GroupedQueryAttention, MultiLatentAttention
from moetron.model.layer import DecoderLayer
from moetron.model.mlp import MLP
from moetron.model.model import IGNORE_INDEX, MoETransformer
from moetron.model.mtp import MTPModule
from moetron.moe.experts import GroupedExperts
from moetron.moe.layer import MoELayer
from moetron.ops import swiglu
from moetron.parallel import comm
from moetron.parallel.config import ParallelConfig, validate_for_model
from moetron.parallel.state import Group, ParallelState
from moetron.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                              all_gather_linear, column_parallel_forward, keep_own_slice_grad,
                                              sum_grad_over_group, vocab_parallel_cross_entropy)

__all__ = ["expert_parallelize", "tensor_parallelize", "unshard_tensors", "TensorParallelMoELayer", "TensorParallelMoEState",
           "TensorParallelMoETransformer"]


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


class TensorParallelMLP(MLP):
    """SwiGLU MLP split on the intermediate dim (gate/up column-parallel, down row-parallel)."""

    def forward(self, x: torch.Tensor, *, input_entered: bool = False) -> torch.Tensor:
        gate, up = column_parallel_forward(x, [self.gate_proj, self.up_proj], input_entered=input_entered)
        return self.down_proj(swiglu(gate, up))


def _parallelize_mlp(mlp: MLP, tp: Group, sp: bool, chunks: int) -> MLP:
    kw = dict(sequence_parallel=sp, overlap_chunks=chunks)
    mlp.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, tp, **kw)
    mlp.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, tp, **kw)
    mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, tp, **kw)
    mlp.__class__ = TensorParallelMLP
    return mlp


@dataclass
class TensorParallelMoEState:
    """What TensorParallelMoELayer.tp_output needs from tp_route."""

    shape: torch.Size  # of the layer input
    x_BSH: torch.Tensor  # the layer input as [B, S or S/tp, H]
    x_full: torch.Tensor  # the TP group's tokens [B, S, H] (gathered under sequence parallel)


class TensorParallelMoELayer(MoELayer):
    """MoELayer inside a tensor-parallel model.

    Input and output are in the residual stream's layout: this rank's sequence shard under sequence
    parallel, the replicated tokens otherwise. The router runs on every token of the TP group
    (replicated computation, so routing, capacity drops and balancing losses equal one process);
    the routed experts (sharded over ETP x EP by MoELayer) receive only this rank's tokens; shared
    experts are a tensor-parallel MLP. Build it with `from_moe_layer` (or tensor_parallelize).

    Stages for a schedule that runs them apart (forward chains them): `tp_route(x)` ->
    `dispatch` -> `compute_experts` -> `combine` (MoELayer's, on this rank's tokens) ->
    `tp_output(out, state)`; `tp_shared(state)` computes the shared experts on their own.
    MoELayer's `route` alone would route only this rank's tokens.
    """

    tp_group: Group
    sequence_parallel: bool

    @classmethod
    @torch.no_grad()
    def from_moe_layer(cls, layer: MoELayer, parallel_state: ParallelState, dispatcher: str | None = None, *,
                       overlap_chunks: int = 1, flex_backend: str = "torch") -> TensorParallelMoELayer:
        """The same layer (router, expert bias, shared experts reused) with experts resharded for
        `parallel_state`'s expert grid. Collective when `layer`'s experts are themselves sharded."""
        gate_up, down = layer.experts.full_expert_weights()
        pad_multiple = getattr(layer.dispatcher, "pad_multiple", 1)
        with torch.device(gate_up.device):
            new = cls(layer.config, dispatcher, parallel_state=parallel_state, pad_multiple=pad_multiple,
                      flex_backend=flex_backend)
        new.experts.to(gate_up.dtype)
        new.experts.load_full_experts(gate_up, down)
        tp, sp = parallel_state.tp, parallel_state.sequence_parallel
        new.tp_group, new.sequence_parallel = tp, sp
        new.router = layer.router
        new.pending_counts.copy_(layer.pending_counts)
        new.shared_experts = layer.shared_experts
        if new.shared_experts is not None:
            _parallelize_mlp(new.shared_experts, tp, sp, overlap_chunks)
        new.shared_expert_gate = layer.shared_expert_gate
        if new.shared_expert_gate is not None and sp:
            sum_grad_over_group(new.shared_expert_gate.weight, tp)  # applied to this rank's tokens
        new.train(layer.training)
        return new

    def _local_routing(self, routing: Routing, B: int, S: int) -> Routing:
        """This rank's tokens of a routing of the group's tokens ([B,S] order), as a Routing.
        The weights go through comm.split, so every rank's router gets the full gradient."""
        tp, k = self.tp_group, routing.top_k
        if self.sequence_parallel:
            idx = routing.topk_idx.view(B, S, k).chunk(tp.size, dim=1)[tp.rank].reshape(-1, k)
            weights = comm.split(routing.topk_weights.view(B, S, k), tp, 1).reshape(-1, k)
        else:
            idx = routing.topk_idx.chunk(tp.size, dim=0)[tp.rank]
            weights = comm.split(routing.topk_weights, tp, 0)
        return Routing.from_topk(idx, weights, routing.num_experts, routing.capacity, routing.dropless)

    def _shared_output(self, x_BSH: torch.Tensor, x_full: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # x_full is already gathered: straight to the GEMMs
            out = self.shared_experts(x_full, input_entered=True)
        else:
            out = self.shared_experts(x_full)
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(x_BSH)) * out
        return out

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """Shared-expert output for the layer input `x`, in the same layout."""
        x_full = comm.all_gather(x, self.tp_group, -2) if self.sequence_parallel else x
        return self._shared_output(x, x_full)

    # --- stages: tp_route -> dispatch -> compute_experts -> combine -> tp_output ------------
    def tp_route(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing, TensorParallelMoEState]:
        """Route the TP group's tokens; return this rank's tokens `[T_local,H]` to dispatch, their
        Routing, and the state `tp_output` needs. `x` is the layer input (residual layout)."""
        shape, H = x.shape, self.config.hidden_size
        if shape[-1] != H:
            raise ValueError(f"MoELayer expects x[..., {H}], got shape {tuple(shape)}")
        x_BSH = x.reshape(-1, shape[-2], H) if x.dim() >= 3 else x.reshape(1, -1, H)
        tp = self.tp_group
        if self.sequence_parallel:
            x_full = comm.all_gather(x_BSH, tp, 1)  # one gather for the router and shared experts
            router_in = keep_own_slice_grad(x_full, tp, 1)  # replicated router: count each slice once
            x_local_TH = x_BSH.reshape(-1, H)
        else:
            x_full = router_in = x_BSH
            T = x_BSH.shape[0] * x_BSH.shape[1]
            if T % tp.size:
                raise ValueError(f"tensor parallel MoE without sequence parallel splits the {T} tokens over "
                                 f"tp={tp.size} ranks for the routed experts; use a batch*sequence divisible "
                                 f"by tp, or sequence parallel")
            x_local_TH = comm.split(x_BSH.reshape(-1, H), tp, 0)
        B, S = x_full.shape[:2]
        routing = self._local_routing(self.route(router_in.reshape(-1, H), S), B, S)
        return x_local_TH, routing, TensorParallelMoEState(shape, x_BSH, x_full)

    def tp_shared(self, state: TensorParallelMoEState) -> torch.Tensor | None:
        """The shared experts' output for the routed tokens (None without shared experts)."""
        return None if self.shared_experts is None else self._shared_output(state.x_BSH, state.x_full)

    def tp_output(self, out_TH: torch.Tensor, state: TensorParallelMoEState,
                  shared: torch.Tensor | None = None) -> torch.Tensor:
        """Combined routed output of this rank's tokens (+ shared, computed here when not given)
        back in the layer input's layout and shape."""
        x_BSH = state.x_BSH
        if self.sequence_parallel:
            out = out_TH.view(x_BSH.shape)
        else:  # every rank's consumer of the gathered output is identical
            out = comm.all_gather(out_TH, self.tp_group, 0, reduce_grad=False).view(x_BSH.shape)
        if self.shared_experts is not None:
            out = out + (self.tp_shared(state) if shared is None else shared)
        return out.view(state.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TH, routing, state = self.tp_route(x)
        shared = None
        if self.shared_experts is not None and hasattr(self.dispatcher, "dispatch_start"):
            pending = self.dispatcher.dispatch_start(x_TH, routing)  # shared experts overlap it
            shared = self.tp_shared(state)
            x_NH, rows_per_expert, handle = self.dispatcher.dispatch_finish(pending)
        else:
            x_NH, rows_per_expert, handle = self.dispatch(x_TH, routing)
        out_TH = self.combine(self.compute_experts(x_NH, rows_per_expert), handle)
        return self.tp_output(out_TH, state, shared)


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
            _parallelize_mlp(layer.mlp, tp, sp, overlap_chunks)
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
