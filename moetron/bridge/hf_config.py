"""Translate Hugging Face `config.json` dicts to `ModelConfig` and back."""

from __future__ import annotations

from moetron.config import ModelConfig

SUPPORTED = ("qwen3_moe", "deepseek_v3")


def _get(hf: dict, *names, default=None):
    for name in names:
        if name in hf and hf[name] is not None:
            return hf[name]
    return default


def _rope(hf: dict) -> tuple[float, dict | None]:
    """`(rope_theta, yarn scaling or None)` from v5 `rope_parameters` or v4 `rope_theta`/`rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind != "yarn":
        raise ValueError(f"config.json: rope type {kind!r} is not supported (only default and yarn)")
    keep = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
            "mscale_all_dim", "attention_factor", "truncate")
    return theta, {"type": "yarn", **{k: params[k] for k in keep if params.get(k) is not None}}


class _RequiredFields(dict):
    """A config dict whose missing required field is an error naming the file and the field."""

    def __init__(self, data: dict, source: str):
        super().__init__(data)
        self.source = source

    def __missing__(self, key):
        raise ValueError(f"{self.source}: required field {key!r} is missing")


def config_from_hf(hf: dict, source: str = "config.json", **overrides) -> ModelConfig:
    """Build a ModelConfig from a transformers config dict; unknown model types are an error."""
    hf = _RequiredFields(hf, source)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"{source}: model_type={model_type!r} is not supported; moetron reads {SUPPORTED}")
    theta, scaling = _rope(hf)
    common = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=hf["moe_intermediate_size"], top_k=hf["num_experts_per_tok"],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)), init_std=hf.get("initializer_range", 0.02),
    )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r} is not supported (only silu)")
    if model_type == "qwen3_moe":
        cfg = dict(common, family="qwen3_moe", num_experts=_get(hf, "num_experts", "num_local_experts"),
                   num_kv_heads=hf.get("num_key_value_heads"), head_dim=hf.get("head_dim"),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                   decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                   mlp_only_layers=list(hf.get("mlp_only_layers") or []))
        coef = hf.get("router_aux_loss_coef", 0.0)
        if coef:
            cfg.update(aux_loss_type="aux_loss", aux_loss_coeff=coef)
    else:
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"{source}: scoring_func={hf['scoring_func']!r}: deepseek_v3 needs 'sigmoid'")
        cfg = dict(common, family="deepseek_v3", num_experts=_get(hf, "n_routed_experts", "num_local_experts"),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                   first_k_dense_replace=hf.get("first_k_dense_replace", 0),
                   n_shared_experts=hf.get("n_shared_experts") or 0, n_group=hf.get("n_group"),
                   topk_group=hf.get("topk_group"), routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
                   q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                   qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                   v_head_dim=hf["v_head_dim"], rope_interleave=bool(hf.get("rope_interleave", True)),
                   num_mtp_layers=_get(hf, "num_nextn_predict_layers", "num_mtp_layers", default=0))
    cfg.update(overrides)
    return ModelConfig(**cfg)


def config_to_hf(cfg: ModelConfig) -> dict:
    """A transformers-loadable config dict for `cfg`."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**{k: v for k, v in cfg.rope_scaling.items() if k != "type"}, "rope_type": "yarn",
                "rope_theta": cfg.rope_theta}
    hf = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_experts_per_tok=cfg.top_k,
        norm_topk_prob=cfg.norm_topk_prob, rms_norm_eps=cfg.rms_norm_eps, rope_parameters=rope,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias, hidden_act="silu", initializer_range=cfg.init_std,
        torch_dtype="float32", model_type=cfg.family,
    )
    if cfg.family == "qwen3_moe":
        hf.update(architectures=["Qwen3MoeForCausalLM"], num_experts=cfg.num_experts,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
                  router_aux_loss_coef=cfg.aux_loss_coeff if cfg.aux_loss_type != "none" else 0.0)
    else:
        hf.update(architectures=["DeepseekV3ForCausalLM"], n_routed_experts=cfg.num_experts,
                  num_key_value_heads=cfg.num_attention_heads,
                  first_k_dense_replace=cfg.first_k_dense_replace, n_shared_experts=cfg.n_shared_experts,
                  n_group=cfg.n_group or 1, topk_group=cfg.topk_group or 1,
                  routed_scaling_factor=cfg.routed_scaling_factor, scoring_func="sigmoid",
                  topk_method="noaux_tc", q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                  qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                  v_head_dim=cfg.v_head_dim, rope_interleave=cfg.rope_interleave,
                  num_nextn_predict_layers=cfg.num_mtp_layers)
    return hf


# config.json keys that training may change on purpose without changing what the weights mean.
TRAINING_KEYS = frozenset({"router_aux_loss_coef", "initializer_range", "torch_dtype", "dtype"})
# ModelConfig fields a `--set model.*` may change on a loaded checkpoint (training-time options).
TRAINING_FIELDS = frozenset({
    "aux_loss_type", "aux_loss_coeff", "z_loss_coeff", "bias_update_rate", "capacity_factor", "drop_policy",
    "pad_to_capacity", "expert_backend", "attention_backend", "recompute_modules", "recompute_every_n_layers",
    "mtp_loss_weight", "init_std", "aux_loss_counts", "bias_update_counts"})


def meaning_differences(new: ModelConfig, base: ModelConfig) -> list[tuple[str, object, object]]:
    """`(config.json key, base value, new value)` wherever `new` gives the weights of `base` another
    meaning (a shape, the routing, RoPE...); training-time keys are not compared. Fields a family
    does not use (e.g. q_lora_rank of Qwen) never differ, because config_to_hf does not write them."""
    a, b = config_to_hf(new), config_to_hf(base)
    return [(k, b.get(k), a.get(k)) for k in sorted(set(a) | set(b))
            if k not in TRAINING_KEYS and a.get(k) != b.get(k)]


def export_config(source: dict, loaded: ModelConfig, trained: ModelConfig) -> tuple[dict, list[str]]:
    """The source checkpoint's config.json with only the keys that training changed updated (e.g.
    `router_aux_loss_coef` after `--set model.aux_loss_coeff=...`), and those changes as
    `"key: old -> new"` lines. `loaded` is the ModelConfig as read from `source`."""
    old, new = config_to_hf(loaded), config_to_hf(trained)
    out, changes = dict(source), []
    for key, value in new.items():
        if key in ("torch_dtype", "initializer_range") or value == old.get(key):
            continue
        changes.append(f"{key}: {source.get(key)!r} -> {value!r}")
        out[key] = value
    return out, changes


def set_dtype(config: dict, dtype_name: str, changes: list[str]) -> None:
    """Record the stored dtype under the key the source uses (`dtype` in transformers 5,
    `torch_dtype` before), listing it in `changes` when it differs."""
    key = "dtype" if "dtype" in config else "torch_dtype"
    if config.get(key) != dtype_name:
        if key in config:
            changes.append(f"{key}: {config[key]!r} -> {dtype_name!r}")
        config[key] = dtype_name
