"""Per-GPU memory of a layout: parameters, gradients and ZeRO-1 optimizer state counted the way the trainer
allocates them, and activations from the exact per-layer formula (model/activation_memory.py).

State: `rank_state(...)` sums this rank's parameters from the model's shapes and the sharding rules of
model/parallelize.py (TP column/row splits, kv heads replicated when tp > kv heads, vocab-parallel
embedding and head, experts over EP x ETP), over the stages the schedule places on the PP rank
(pipeline/stage.py `parameter_keys`), then pads each DataParallel buffer the way parallel/data_parallel.py
does. Activations: `stage_activation_bytes(...)` is one micro-batch of one pipeline stage. Design notes and
what is approximate (TP/CP activation sharding): docs/planning.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetron.config import ModelConfig
from moetron.model.activation_memory import layer_activation_bytes
from moetron.parallel.data_parallel import PAD_ALIGN, default_bucket_size
from moetron.pipeline.layout import PipelineStage
from moetron.pipeline.stage import parameter_keys
from moetron.plan.candidate import Candidate

GiB = 1024 ** 3


# ------------------------------------------------------------------------------ parameters


def _attention_params(c: ModelConfig, tp: int) -> int:
    """One rank's attention parameters (model/parallelize.py `_parallelize_gqa` / `_parallelize_mla`)."""
    h, H, bias = c.num_attention_heads, c.hidden_size, c.attention_bias
    if c.attention_type == "gqa":
        d, g = c.head_dim, c.num_kv_heads
        q = H * h * d // tp + (h * d // tp if bias else 0)
        kv_rows = g * d // tp if g % tp == 0 else g * d  # fewer kv heads than ranks: the whole weight
        kv = 2 * (H * kv_rows + (kv_rows if bias else 0))
        return q + kv + h * d * H // tp + (H if bias else 0) + 2 * d
    dqk = c.qk_nope_head_dim + c.qk_rope_head_dim
    if c.q_lora_rank is None:
        n = H * h * dqk // tp
    else:
        qr = c.q_lora_rank
        n = H * qr + (qr if bias else 0) + qr + qr * h * dqk // tp
    kv_a = c.kv_lora_rank + c.qk_rope_head_dim
    n += H * kv_a + (kv_a if bias else 0) + c.kv_lora_rank
    n += c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim) // tp
    return n + h * c.v_head_dim * H // tp + (H if bias else 0)


def layer_param_counts(c: ModelConfig, layer_idx: int, tp: int, ep: int, etp: int) -> tuple[int, int]:
    """(dense, expert) parameters of decoder layer `layer_idx` on one rank."""
    H = c.hidden_size
    dense = _attention_params(c, tp) + 2 * H
    if not c.is_moe_layer(layer_idx):
        return dense + 3 * H * c.intermediate_size // tp, 0
    shared = c.moe_config().shared_expert_ffn_size
    dense += c.num_experts * H + 3 * H * shared // tp
    return dense, (c.num_experts // ep) * 3 * H * c.moe_intermediate_size // etp


def item_param_counts(c: ModelConfig, key: str, tp: int, ep: int, etp: int) -> tuple[int, int]:
    """(dense, expert) parameters of one `parameter_keys` prefix on one rank."""
    H, V = c.hidden_size, c.vocab_size
    if key in ("embed_tokens", "lm_head"):
        return V * H // tp, 0
    if key == "norm":
        return H, 0
    kind, index = key.split(".")
    if kind == "layers":
        return layer_param_counts(c, int(index), tp, ep, etp)
    dense, expert = layer_param_counts(c, c.num_layers + int(index), tp, ep, etp)
    return dense + 3 * H + 2 * H * H, expert  # enorm, hnorm, final_norm, eh_proj (replicated under TP)


def rank_param_counts(c: ModelConfig, cand: Candidate, stages: list[PipelineStage]) -> tuple[int, int]:
    """(dense, expert) parameters one rank holds: every parameter key of the stages it runs, once."""
    keys: set[str] = set()
    for stage in stages:
        keys |= parameter_keys(stage, c.tie_word_embeddings)
    if not stages:
        keys = {"embed_tokens", "norm"} | ({"lm_head"} if not c.tie_word_embeddings else set())
        keys |= {f"layers.{i}" for i in range(c.num_layers)} | {f"mtp.{j}" for j in range(c.num_mtp_layers)}
    dense = expert = 0
    for key in keys:
        d, e = item_param_counts(c, key, cand.tp, cand.ep, cand.etp)
        dense, expert = dense + d, expert + e
    return dense, expert


def buffer_numel(n: int, group_size: int, bucket_size: int) -> int:
    """Elements of one DataParallel buffer under ZeRO-1: each bucket padded to group_size * PAD_ALIGN.
    Exact for a buffer of one bucket (n < bucket_size); with several, every bucket is assumed full."""
    if n == 0:
        return 0
    pad = group_size * PAD_ALIGN
    full, rest = divmod(n, bucket_size) if n > bucket_size else (0, n)
    return full * (-(-bucket_size // pad) * pad) + -(-rest // pad) * pad


@dataclass(frozen=True)
class StateBytes:
    """What the trainer allocates on one rank for the parameters, their gradients and the optimizer."""

    params: int
    grads: int
    optimizer: int
    dense_numel: int
    expert_numel: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def rank_state(c: ModelConfig, cand: Candidate, stages: list[PipelineStage], gpus: int, dtype: str,
               zero: bool = True) -> StateBytes:
    """train/setup.py `build_run`: one process in fp32 uses torch AdamW (params, grads, two moments);
    otherwise DataParallel buffers (fp32 gradients; parameters too under ZeRO-1) padded per bucket, and
    DistributedOptimizer's fp32 master + two moments on this rank's shard of each buffer."""
    dense, expert = rank_param_counts(c, cand, stages)
    pbytes = 4 if dtype == "fp32" else 2
    n = dense + expert
    if gpus == 1 and dtype == "fp32":
        return StateBytes(4 * n, 4 * n, 8 * n, dense, expert)
    dp_cp, edp = cand.dp(gpus) * cand.cp, cand.edp(gpus)
    bucket = default_bucket_size(dp_cp)
    if not zero:
        return StateBytes(pbytes * n, 4 * n, (8 if dtype == "fp32" else 12) * n, dense, expert)
    bd, be = buffer_numel(dense, dp_cp, bucket), buffer_numel(expert, edp, bucket)
    shard = bd // dp_cp + be // edp
    return StateBytes(pbytes * (bd + be), 4 * (bd + be), 12 * shard, dense, expert)


# ------------------------------------------------------------------------------ activations

_TP_SHARDED = ("q_norm", "k_norm", "core", "o_proj input", "mlp gate", "mlp up", "mlp silu", "mlp act",
               "shared experts")
_SEQ_SHARDED = ("attn norm", "mlp norm", "layer input", "q_a_layernorm", "q latent", "kv_a_layernorm")


def _scale(name: str, nbytes: int, tp: int, sp: bool) -> float:
    """Under TP a term is split over heads / ffn columns, or (sequence parallel) over the sequence; the
    router, rotary tables, kv latent and routed-expert terms (given their own rows) are not."""
    if tp == 1:
        return nbytes
    if name.startswith(_TP_SHARDED):
        return nbytes / tp
    if sp and name.startswith(_SEQ_SHARDED):
        return nbytes / tp
    return nbytes


def layer_bytes(c: ModelConfig, layer_idx: int, cand: Candidate, seq: int, dtype: torch.dtype,
                device: str) -> int:
    """One micro-batch of decoder layer `layer_idx` on one rank (balanced routing), with the rotary tables."""
    tp, sp = cand.tp, cand.sp and cand.tp > 1
    S = seq // cand.cp
    rows = cand.mbs * S * c.top_k // tp  # the routed experts see this rank's tokens
    modules = () if cand.full_recompute else cand.recompute
    terms = layer_activation_bytes(c, layer_idx, cand.mbs, S, rows, modules=modules,
                                   every_n_layers=1 if cand.full_recompute else 0, dtype=dtype, device=device).terms
    total = int(sum(_scale(n, v, tp, sp) for n, v in terms.items()))
    if cand.ep > 1 and c.is_moe_layer(layer_idx) and not cand.full_recompute and "moe" not in modules:
        # the all-to-all path regroups the received rows expert-major (dispatch/alltoall.py): the received
        # rows and the regroup's two indices are held too (measured: tests/test_plan.py)
        total += rows * (c.hidden_size * torch.finfo(dtype).bits // 8 + 16)
        if "moe_act" in modules:  # measured, cause not traced yet: one more row of H on this path
            total += rows * c.hidden_size * torch.finfo(dtype).bits // 8
    return total


def _head_bytes(c: ModelConfig, T: int, b: int, tp: int, sp_div: int) -> int:
    """Final norm (fp32 input, rstd, normalised), the head's input, fp32 logits, the loss, the labels."""
    H = c.hidden_size
    return (T * H * 4 + T * 4 + 2 * T * H * b) // sp_div + T * (c.vocab_size // tp) * 4 + 4 + T * 8


def stage_activation_bytes(c: ModelConfig, stage: PipelineStage | None, cand: Candidate, seq: int, dtype: str,
                           device: str = "cuda") -> int:
    """Bytes one micro-batch of `stage` (the whole model when None) keeps for backward on one rank: its
    layers (rotary tables once), the embedding's indices, the loss head and the MTP modules' extras."""
    tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    b = 4 if dtype == "fp32" else 2
    T = cand.mbs * seq // cand.cp
    sp_div = cand.tp if cand.sp and cand.tp > 1 else 1
    if stage is None:
        layers, mtp = list(range(c.num_layers)), list(range(c.num_mtp_layers))
        embedding, loss = True, True
    else:
        layers, mtp, embedding, loss = stage.decoder_layers, stage.mtp_layers, stage.has_embedding, stage.has_loss
    total = sum(layer_bytes(c, i, cand, seq, tdtype, device) for i in layers)
    total += sum(layer_bytes(c, c.num_layers + j, cand, seq, tdtype, device) for j in mtp)
    n_rope = len(layers) + len(mtp)
    if n_rope > 1:  # cos and sin are one storage shared by every layer of the stage
        total -= (n_rope - 1) * 2 * seq // cand.cp * c.rope_dim * b
    if embedding:
        total += T * 8
    if loss:
        total += _head_bytes(c, T, b, cand.tp, sp_div)
    H = c.hidden_size
    norm = (T * H * 4 + T * 4 + T * H * b) // sp_div
    for _ in mtp:  # future ids, enorm, hnorm, eh_proj's input, the final norm (pipeline/stage.py `_mtp_piece`)
        total += T * 8 + 3 * norm + T * 2 * H * b // sp_div
    if loss:  # the loss stage runs every MTP module's head and loss on its normed output, shifted labels
        total += c.num_mtp_layers * (T * H * b // sp_div + T * (c.vocab_size // cand.tp) * 4 + 4 + T * 8)
    if mtp and loss and b == 4:  # in fp32 the first hnorm's input is the final norm's input itself
        total -= T * H * 4 // sp_div
    return int(total)


def comm_buffer_bytes(c: ModelConfig, cand: Candidate, seq: int, dtype: str, fp8: bool) -> int:
    """Dispatcher and communication buffers on one rank: the permuted rows and their all-to-all receive
    buffer, twice (dispatch and combine), plus the TP all-gather of one layer's input under SP."""
    b = 4 if dtype == "fp32" else 2
    T = cand.mbs * seq // cand.cp
    rows = T * c.top_k // cand.tp
    dispatch = rows * c.hidden_size * (1 if fp8 else b) * (2 if cand.ep > 1 else 0)
    combine = rows * c.hidden_size * b * (2 if cand.ep > 1 else 1)
    gather = T * c.hidden_size * b if cand.tp > 1 else 0
    return dispatch + combine + gather


def imbalance_headroom(c: ModelConfig, cand: Candidate, seq: int, dtype: str, in_flight: int,
                       moe_layers: int, factor: float) -> int:
    """Extra routed rows when the busiest rank receives `factor` x its share: the per-row activations of
    the expert block (input, gate_up, activation, output) over the rank's in-flight MoE layers."""
    b = 4 if dtype == "fp32" else 2
    T = cand.mbs * seq // cand.cp
    rows = T * c.top_k // cand.tp
    F = c.moe_intermediate_size // cand.etp
    acts = 0 if "moe_act" in cand.recompute else 2 * F
    per_row = c.hidden_size * b * 3 + (2 * F + acts) * b + 16 + b
    if cand.full_recompute or "moe" in cand.recompute:
        per_row = 0
    return int(math.ceil((factor - 1.0) * rows * per_row * moe_layers * in_flight))
