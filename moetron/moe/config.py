"""MoEConfig: every option of one MoE layer, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field

SCORE_FUNCS = ("softmax", "sigmoid")
AUX_LOSS_TYPES = ("none", "aux_loss", "seq_aux_loss", "global_aux_loss")
DROP_POLICIES = ("probs", "position")
AUX_LOSS_COUNTS = ("selected", "paper")
BIAS_UPDATE_COUNTS = ("selected", "kept")
EXPERT_BACKENDS = ("auto", "torch_grouped_mm", "cpp", "loop", "grouped_gemm")


def _fail(field_name: str, value, rule: str) -> None:
    raise ValueError(f"MoEConfig.{field_name}={value!r}: {rule}")


@dataclass
class MoEConfig:
    """One MoE layer: router, balancing, capacity, experts and shared experts.

    Defaults give a dropless softmax top-k router with no auxiliary loss, which is
    what most users want to start from; DeepSeek-V3 and Qwen3-MoE set the rest.
    """

    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    top_k: int

    # Router (all router math runs in fp32).
    score_func: str = "softmax"
    softmax_before_topk: bool = True  # False: top-k on logits, then softmax over the k chosen
    norm_topk_prob: bool = False  # renormalise the k weights to sum to one
    num_groups: int | None = None  # group-limited top-k (DeepSeek): experts split in groups
    topk_groups: int | None = None  # ... of which each token may use this many
    scaling_factor: float = 1.0  # multiplies the final top-k weights (routed_scaling_factor)
    expert_bias: bool = False  # aux-loss-free balancing: bias added for selection only
    bias_update_rate: float = 1e-3
    z_loss_coeff: float = 0.0

    # Load balancing through an auxiliary loss, injected as a gradient only.
    aux_loss_type: str = "none"
    aux_loss_coeff: float = 0.0
    # Which experts the balancing losses count (docs/router_conventions.md): "selected" the chosen ones
    # (after expert bias and group limit); "paper" the top-k of the unbiased scores (DeepSeek-V3, Megatron).
    aux_loss_counts: str = "selected"
    # What update_expert_bias() counts: "selected" slots before capacity drops, or "kept" after (Megatron).
    bias_update_counts: str = "selected"

    # Capacity: None means dropless.
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    pad_to_capacity: bool = False

    # Shared experts run on every token beside the routed ones.
    shared_expert_ffn_size: int = 0
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x @ w) scales the shared output

    expert_backend: str = "auto"
    init_std: float = 0.02
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                _fail(name, value, "must be a positive integer")
        if self.top_k > self.num_experts:
            _fail("top_k", self.top_k, f"cannot exceed num_experts={self.num_experts}")
        if self.score_func not in SCORE_FUNCS:
            _fail("score_func", self.score_func, f"choose one of {SCORE_FUNCS}")
        if self.score_func == "sigmoid" and not self.softmax_before_topk:
            _fail("softmax_before_topk", False, "only applies to score_func='softmax'")
        if (self.num_groups is None) != (self.topk_groups is None):
            _fail("num_groups", self.num_groups, "set num_groups and topk_groups together")
        if self.num_groups is not None:
            for name in ("num_groups", "topk_groups"):
                value = getattr(self, name)
                if not isinstance(value, int) or value < 1:
                    _fail(name, value, "must be a positive integer")
            if self.num_experts % self.num_groups:
                _fail("num_groups", self.num_groups, f"must divide num_experts={self.num_experts}")
            if not 1 <= self.topk_groups <= self.num_groups:
                _fail("topk_groups", self.topk_groups, f"must be in 1..num_groups={self.num_groups}")
            per_group = self.num_experts // self.num_groups
            if self.top_k > self.topk_groups * per_group:
                _fail("top_k", self.top_k,
                      f"exceeds the {self.topk_groups * per_group} experts in {self.topk_groups} groups")
        if self.aux_loss_type not in AUX_LOSS_TYPES:
            _fail("aux_loss_type", self.aux_loss_type, f"choose one of {AUX_LOSS_TYPES}")
        if self.aux_loss_counts not in AUX_LOSS_COUNTS:
            _fail("aux_loss_counts", self.aux_loss_counts, f"choose one of {AUX_LOSS_COUNTS}")
        if self.bias_update_counts not in BIAS_UPDATE_COUNTS:
            _fail("bias_update_counts", self.bias_update_counts, f"choose one of {BIAS_UPDATE_COUNTS}")
        if self.bias_update_counts == "kept" and not self.expert_bias:
            _fail("bias_update_counts", "kept",
                  "has no effect without expert_bias=True (the deepseek_v3 family sets it)")
        if self.bias_update_rate != type(self).__dataclass_fields__["bias_update_rate"].default and not self.expert_bias:
            _fail("bias_update_rate", self.bias_update_rate,
                  "has no effect without expert_bias=True (the deepseek_v3 family sets it)")
        for name in ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
            if getattr(self, name) < 0:
                _fail(name, getattr(self, name), "must be >= 0")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            _fail("capacity_factor", self.capacity_factor, "must be > 0, or None for dropless")
        if self.drop_policy not in DROP_POLICIES:
            _fail("drop_policy", self.drop_policy, f"choose one of {DROP_POLICIES}")
        if self.pad_to_capacity and self.capacity_factor is None:
            _fail("pad_to_capacity", True, "needs a capacity_factor")
        if self.shared_expert_ffn_size < 0:
            _fail("shared_expert_ffn_size", self.shared_expert_ffn_size, "must be >= 0")
        if self.shared_expert_gate and not self.shared_expert_ffn_size:
            _fail("shared_expert_gate", True, "needs shared_expert_ffn_size > 0")
        if self.expert_backend not in EXPERT_BACKENDS:
            _fail("expert_backend", self.expert_backend, f"choose one of {EXPERT_BACKENDS}")
