"""ModelConfig: the two model families moetron trains, as one validated dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moetron.moe.config import MoEConfig

FAMILIES = ("qwen3_moe", "deepseek_v3")
ATTENTION_BACKENDS = ("sdpa", "eager", "flash_attn", "te")
# Selective recompute options (moetron/model/recompute.py): pieces run under a checkpoint, and
# pieces whose output is discarded once its consumer saved it and recomputed in backward.
RECOMPUTE_CHECKPOINTED = ("core_attn", "mlp", "moe", "shared_experts")
RECOMPUTE_OUTPUT_DISCARDING = ("moe_act", "layernorm", "mla_up_proj")
RECOMPUTE_MODULES = RECOMPUTE_CHECKPOINTED + RECOMPUTE_OUTPUT_DISCARDING


def _fail(field_name: str, value, rule: str) -> None:
    raise ValueError(f"ModelConfig.{field_name}={value!r}: {rule}")


@dataclass
class ModelConfig:
    """A Qwen3-MoE or DeepSeek-V3 model. Field names follow the Hugging Face configs.

    Qwen3-MoE uses GQA with per-head q/k norms and softmax routing; DeepSeek-V3 uses
    MLA, sigmoid group-limited routing with an expert bias, shared experts and MTP.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    num_kv_heads: int | None = None  # GQA; None = num_attention_heads
    head_dim: int | None = None  # GQA; None = hidden_size // num_attention_heads
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"type": "yarn", "factor": ..., ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    init_std: float = 0.02

    # Qwen3-MoE layer pattern.
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    # DeepSeek-V3.
    first_k_dense_replace: int = 0
    n_shared_experts: int = 0
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    num_mtp_layers: int = 0
    mtp_loss_weight: float = 0.3

    # Training-time MoE options (do not change the forward of a loaded checkpoint).
    aux_loss_type: str = "none"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    bias_update_rate: float = 1e-3
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    pad_to_capacity: bool = False
    expert_backend: str = "auto"
    attention_backend: str = "sdpa"

    # Activation recomputation (no effect on the numerics): selective pieces, and the whole of
    # every n-th decoder layer (0: none). See moetron/model/recompute.py.
    recompute_modules: list[str] = field(default_factory=list)
    recompute_every_n_layers: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            _fail("family", self.family, f"choose one of {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                     "intermediate_size", "moe_intermediate_size", "num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                _fail(name, value, "must be a positive integer")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_kv_heads:
            _fail("num_kv_heads", self.num_kv_heads,
                  f"must divide num_attention_heads={self.num_attention_heads}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            _fail("attention_backend", self.attention_backend, f"choose one of {ATTENTION_BACKENDS}")
        if self.decoder_sparse_step < 1:
            _fail("decoder_sparse_step", self.decoder_sparse_step, "must be >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            _fail("mlp_only_layers", self.mlp_only_layers, f"layers {bad} are outside 0..{self.num_layers - 1}")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            _fail("first_k_dense_replace", self.first_k_dense_replace, f"must be in 0..{self.num_layers}")
        if self.num_mtp_layers and self.family != "deepseek_v3":
            _fail("num_mtp_layers", self.num_mtp_layers, "MTP modules exist for deepseek_v3 only")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("yarn", "default"):
                _fail("rope_scaling", self.rope_scaling, "only 'yarn' scaling is supported")
        if self.family == "deepseek_v3" and self.qk_rope_head_dim % 2:
            _fail("qk_rope_head_dim", self.qk_rope_head_dim, "must be even")
        if isinstance(self.recompute_modules, str) or not all(isinstance(m, str) for m in self.recompute_modules):
            _fail("recompute_modules", self.recompute_modules,
                  'must be a list of module names, e.g. ["moe_act", "layernorm"]')
        bad = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if bad:
            _fail("recompute_modules", self.recompute_modules,
                  f"unknown module {bad[0]!r}; valid: {', '.join(RECOMPUTE_CHECKPOINTED)} (checkpointed), "
                  f"{', '.join(RECOMPUTE_OUTPUT_DISCARDING)} (output-discarding)")
        if (not isinstance(self.recompute_every_n_layers, int) or isinstance(self.recompute_every_n_layers, bool)
                or self.recompute_every_n_layers < 0):
            _fail("recompute_every_n_layers", self.recompute_every_n_layers,
                  "must be an integer >= 0 (0: no full-layer recompute; n: every n-th layer)")
        self.moe_config()  # validates the MoE fields with their own messages

    @property
    def attention_type(self) -> str:
        return "mla" if self.family == "deepseek_v3" else "gqa"

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.family == "deepseek_v3" else self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` (MTP layers count after the main ones) is MoE."""
        if self.family == "deepseek_v3":
            return layer_idx >= self.first_k_dense_replace
        return (layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def moe_config(self) -> MoEConfig:
        deepseek = self.family == "deepseek_v3"
        return MoEConfig(
            hidden_size=self.hidden_size, ffn_hidden_size=self.moe_intermediate_size,
            num_experts=self.num_experts, top_k=self.top_k,
            score_func="sigmoid" if deepseek else "softmax",
            norm_topk_prob=self.norm_topk_prob,
            num_groups=self.n_group if deepseek and (self.n_group or 1) > 1 else None,
            topk_groups=self.topk_group if deepseek and (self.n_group or 1) > 1 else None,
            scaling_factor=self.routed_scaling_factor if deepseek else 1.0,
            expert_bias=deepseek, bias_update_rate=self.bias_update_rate,
            z_loss_coeff=self.z_loss_coeff, aux_loss_type=self.aux_loss_type,
            aux_loss_coeff=self.aux_loss_coeff, capacity_factor=self.capacity_factor,
            drop_policy=self.drop_policy, pad_to_capacity=self.pad_to_capacity,
            shared_expert_ffn_size=self.moe_intermediate_size * self.n_shared_experts if deepseek else 0,
            expert_backend=self.expert_backend, init_std=self.init_std,
        )

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
