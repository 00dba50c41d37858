"""The recipes moetron ships: full-size DeepSeek-V3 and Qwen3-MoE, and tiny CPU proxies."""

from __future__ import annotations

from typing import Callable

from moetron.config import ModelConfig
from moetron.parallel.config import ParallelConfig
from moetron.recipes.recipe import Recipe
from moetron.train.config import TrainConfig


def deepseek_v3_671b() -> Recipe:
    model = ModelConfig(
        family="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=61, num_attention_heads=128,
        intermediate_size=18432, moe_intermediate_size=2048, num_experts=256, top_k=8,
        first_k_dense_replace=3, n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_mtp_layers=1, rope_theta=10000.0, max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        aux_loss_type="seq_aux_loss", aux_loss_coeff=1e-4, bias_update_rate=1e-3)
    train = TrainConfig(seq_len=4096, micro_batch_size=1, grad_accum=64, lr=2.2e-4, warmup_steps=2000,
                        steps=100000)
    # DeepSeek-V3's own pre-training layout (REFERENCE §6): PP16 x EP64, ZeRO-1 over the rest.
    return Recipe("deepseek-v3-671b", "DeepSeek-V3 671B (37B active), MLA + MTP", model, train,
                  ParallelConfig(pp=16, ep=64))


def _qwen3(name: str, desc: str, hidden: int, layers: int, heads: int, ffn: int, moe_ffn: int,
           parallel: ParallelConfig) -> Recipe:
    model = ModelConfig(
        family="qwen3_moe", vocab_size=151936, hidden_size=hidden, num_layers=layers,
        num_attention_heads=heads, num_kv_heads=4, head_dim=128, intermediate_size=ffn,
        moe_intermediate_size=moe_ffn, num_experts=128, top_k=8, norm_topk_prob=True,
        rope_theta=1_000_000.0, max_position_embeddings=40960, aux_loss_type="global_aux_loss",
        aux_loss_coeff=1e-3)
    train = TrainConfig(seq_len=4096, micro_batch_size=1, grad_accum=32, lr=3e-4, warmup_steps=2000,
                        steps=100000)
    return Recipe(name, desc, model, train, parallel)


def qwen3_moe_30b_a3b() -> Recipe:
    return _qwen3("qwen3-moe-30b-a3b", "Qwen3-30B-A3B", 2048, 48, 32, 6144, 768, ParallelConfig(ep=8))


def qwen3_moe_235b_a22b() -> Recipe:
    return _qwen3("qwen3-moe-235b-a22b", "Qwen3-235B-A22B", 4096, 94, 64, 12288, 1536,
                  ParallelConfig(ep=8, pp=8))


def qwen3_moe_tiny() -> Recipe:
    model = ModelConfig(
        family="qwen3_moe", vocab_size=256, hidden_size=64, num_layers=4, num_attention_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
        top_k=2, norm_topk_prob=True, rope_theta=10000.0, max_position_embeddings=1024,
        aux_loss_type="aux_loss", aux_loss_coeff=1e-2)
    return Recipe("qwen3-moe-tiny", "tiny Qwen3-MoE proxy (GQA + q/k norm, 8 experts top-2); CPU, fp32",
                  model, TrainConfig(steps=150, seq_len=128, micro_batch_size=8, lr=3e-3, warmup_steps=15))


def deepseek_v3_tiny() -> Recipe:
    model = ModelConfig(
        family="deepseek_v3", vocab_size=256, hidden_size=64, num_layers=4, num_attention_heads=4,
        intermediate_size=128, moe_intermediate_size=32, num_experts=8, top_k=2, first_k_dense_replace=1,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_mtp_layers=1,
        max_position_embeddings=1024, aux_loss_type="seq_aux_loss", aux_loss_coeff=1e-4,
        bias_update_rate=1e-3)
    return Recipe("deepseek-v3-tiny", "tiny DeepSeek-V3 proxy (MLA, group routing, dense first layer, 1 MTP); "
                  "CPU, fp32", model, TrainConfig(steps=150, seq_len=128, micro_batch_size=8, lr=3e-3,
                                                 warmup_steps=15))


RECIPES: dict[str, Callable[[], Recipe]] = {
    "qwen3-moe-tiny": qwen3_moe_tiny,
    "deepseek-v3-tiny": deepseek_v3_tiny,
    "qwen3-moe-30b-a3b": qwen3_moe_30b_a3b,
    "qwen3-moe-235b-a22b": qwen3_moe_235b_a22b,
    "deepseek-v3-671b": deepseek_v3_671b,
}
DEFAULT_RECIPE = "qwen3-moe-tiny"


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)} (see `moetron recipes`)")
    return RECIPES[name]()
