"""Parameter counts and training FLOPs of a ModelConfig, computed from the config alone.

Used to list recipe sizes without building them, and for the MFU estimate. A test
checks the counts against real modules.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetron.config import ModelConfig


@dataclass
class ModelSize:
    total: int  # every parameter
    active: int  # parameters one token touches (top-k routed experts only)
    embedding: int  # input embedding (not a matmul)


def _attention_params(c: ModelConfig) -> int:
    h, H = c.num_attention_heads, c.hidden_size
    bias = c.attention_bias
    if c.attention_type == "gqa":
        q, kv = h * c.head_dim, c.num_kv_heads * c.head_dim
        n = H * q + 2 * H * kv + q * H + 2 * c.head_dim
        return n + ((q + 2 * kv + H) if bias else 0)
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    if c.q_lora_rank is None:
        n = H * h * qk
    else:
        n = H * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * qk + (c.q_lora_rank if bias else 0)
    kv_a = c.kv_lora_rank + c.qk_rope_head_dim
    n += H * kv_a + c.kv_lora_rank + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim)
    n += h * c.v_head_dim * H
    return n + ((kv_a + H) if bias else 0)


def layer_params(c: ModelConfig, layer_idx: int) -> tuple[int, int]:
    """(total, active) parameters of decoder layer `layer_idx`."""
    H = c.hidden_size
    base = _attention_params(c) + 2 * H
    if not c.is_moe_layer(layer_idx):
        dense = 3 * H * c.intermediate_size
        return base + dense, base + dense
    expert = 3 * H * c.moe_intermediate_size
    shared = expert * c.n_shared_experts if c.family == "deepseek_v3" else 0
    router = c.num_experts * H
    return base + router + shared + c.num_experts * expert, base + router + shared + c.top_k * expert


def model_size(c: ModelConfig) -> ModelSize:
    H, V = c.hidden_size, c.vocab_size
    total = active = V * H + H  # embedding + final norm
    if not c.tie_word_embeddings:
        total, active = total + V * H, active + V * H
    for i in range(c.num_layers + c.num_mtp_layers):
        t, a = layer_params(c, i)
        total, active = total + t, active + a
    mtp_extra = c.num_mtp_layers * (3 * H + 2 * H * H)  # enorm, hnorm, final norm, eh_proj
    return ModelSize(total + mtp_extra, active + mtp_extra, V * H)


def training_flops_per_token(c: ModelConfig, seq_len: int) -> float:
    """Forward+backward FLOPs per token: 6 × active matmul parameters + causal attention scores."""
    size = model_size(c)
    matmul_params = size.active - size.embedding
    if c.tie_word_embeddings:
        matmul_params += size.embedding  # the tied head is still a matmul
    if c.attention_type == "gqa":
        qk, v = c.head_dim, c.head_dim
    else:
        qk, v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    layers = c.num_layers + c.num_mtp_layers
    attention_fwd = 2 * c.num_attention_heads * (seq_len / 2) * (qk + v) * layers
    return 6 * matmul_params + 3 * attention_fwd
