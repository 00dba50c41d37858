"""The configuration of a run, pure and validated when built: ModelConfig (the two model families),
TrainConfig, Recipe (model + train + parallel), and `--set section.field=value` overrides.
MoEConfig and ParallelConfig live beside their owners (moe/, parallel/)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from moetron.moe.config import MoEConfig
from moetron.ops import recompute
from moetron.parallel.config import ParallelConfig

FAMILIES = ("qwen3_moe", "deepseek_v3")
ATTENTION_BACKENDS = ("sdpa", "eager", "flash_attn", "te")


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
    aux_loss_counts: str = "selected"  # "paper": top-k of the unbiased scores (docs/router_conventions.md)
    z_loss_coeff: float = 0.0
    bias_update_rate: float = 1e-3
    bias_update_counts: str = "selected"  # "kept": count after capacity drops (Megatron)
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    pad_to_capacity: bool = False
    expert_backend: str = "auto"
    attention_backend: str = "sdpa"

    # Activation recomputation (no effect on the numerics): selective pieces, and the whole of
    # every n-th decoder layer (0: none). See moetron/ops/recompute.py.
    recompute_modules: list[str] = field(default_factory=list)
    recompute_every_n_layers: int = 0
    # Megatron's full recompute: "uniform" (every layer; Megatron groups recompute_num_layers of them per
    # checkpoint) or "block" (the first recompute_num_layers decoder layers of each pipeline stage).
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

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
        if self.family != "deepseek_v3":  # only DeepSeek-V3's sigmoid router has an expert bias
            for name in ("bias_update_rate", "bias_update_counts"):
                default = type(self).__dataclass_fields__[name].default
                if getattr(self, name) != default:
                    _fail(name, getattr(self, name),
                          f"tunes the expert bias of aux-loss-free balancing, which only the deepseek_v3 family has "
                          f"(a sigmoid router; Megatron refuses --moe-router-enable-expert-bias with softmax): leave "
                          f"it at {default!r} and balance {self.family} with model.aux_loss_coeff")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("yarn", "default"):
                _fail("rope_scaling", self.rope_scaling, "only 'yarn' scaling is supported")
        if self.family == "deepseek_v3" and self.qk_rope_head_dim % 2:
            _fail("qk_rope_head_dim", self.qk_rope_head_dim, "must be even")
        if isinstance(self.recompute_modules, str) or not all(isinstance(m, str) for m in self.recompute_modules):
            _fail("recompute_modules", self.recompute_modules,
                  'must be a list of module names, e.g. ["moe_act", "layernorm"]')
        bad = [m for m in self.recompute_modules if m not in recompute.MODULES]
        if bad:
            _fail("recompute_modules", self.recompute_modules,
                  f"unknown module {bad[0]!r}; valid: {', '.join(recompute.CHECKPOINTED)} (checkpointed), "
                  f"{', '.join(recompute.OUTPUT_DISCARDING)} (output-discarding)")
        if (not isinstance(self.recompute_every_n_layers, int) or isinstance(self.recompute_every_n_layers, bool)
                or self.recompute_every_n_layers < 0):
            _fail("recompute_every_n_layers", self.recompute_every_n_layers,
                  "must be an integer >= 0 (0: no full-layer recompute; n: every n-th layer)")
        self._check_recompute_method()
        self.moe_config()  # validates the MoE fields with their own messages

    def _check_recompute_method(self) -> None:
        method, n = self.recompute_method, self.recompute_num_layers
        if method not in (None, "uniform", "block"):
            _fail("recompute_method", method, "choose uniform or block (or null)")
        if method is None and n is not None:
            _fail("recompute_num_layers", n, "needs model.recompute_method=uniform or block")
        if method is not None:
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                _fail("recompute_num_layers", n, f"model.recompute_method={method} needs an integer >= 1")
            if self.recompute_every_n_layers:
                _fail("recompute_method", method, "and recompute_every_n_layers both choose the fully recomputed "
                      "layers: set one of them")

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
            aux_loss_coeff=self.aux_loss_coeff, aux_loss_counts=self.aux_loss_counts,
            bias_update_counts=self.bias_update_counts, capacity_factor=self.capacity_factor,
            drop_policy=self.drop_policy, pad_to_capacity=self.pad_to_capacity,
            shared_expert_ffn_size=self.moe_intermediate_size * self.n_shared_experts if deepseek else 0,
            expert_backend=self.expert_backend, init_std=self.init_std,
        )

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


@dataclass
class TrainConfig:
    """Optimisation, batch, data and logging settings of a run (pure: files and optional packages
    are checked when the run is set up, in train/setup.py)."""

    steps: int = 100
    seq_len: int = 128
    micro_batch_size: int = 8
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 1
    metrics_file: str | None = None
    data: str = "builtin"  # "builtin" (the Python standard library's sources, byte-tokenized) or a
    # folder made by `moetron data prepare`
    data_mask_boundary: bool = False  # ignore the label after each document separator
    tensorboard_dir: str | None = None  # needs the `tensorboard` package
    peak_tflops: float | None = None  # the device's peak, for the MFU estimate
    save_dir: str | None = None  # checkpoints go to SAVE_DIR/step-NNNNNNNN/
    save_every: int = 0  # steps between checkpoints; 0 saves only at the end (when save_dir is set)
    resume: bool = False  # continue from the newest intact checkpoint in SAVE_DIR when it holds any
    resume_from: str | None = None  # resume this checkpoint of SAVE_DIR (step-N) instead; newer ones are moved aside
    overwrite: bool = False  # SAVE_DIR holds an earlier run: move it aside (SAVE_DIR.old-TIME) and start over
    init_hf: str | None = None  # start from this Hugging Face folder's weights (unless resuming)
    export_hf: str | None = None  # after the last step, write the final checkpoint here as a hub folder
    fp8: str | None = None  # FP8 recipe for linear layers and experts: tensorwise, delayed, blockwise, mxfp8
    fp8_backend: str = "auto"  # auto (by capability, logged), emulate, torch (torch._scaled_mm), te (Transformer Engine)
    fp8_param_gather: bool = False  # Megatron's --fp8-param-gather: ZeRO-1 all-gathers FP8 weights (docs/fp8.md)
    # Megatron's --first-last-layers-bf16 / --num-layers-at-{start,end}-in-bf16: keep that many decoder
    # layers at each end of the model in high precision under train.fp8
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    dtype: str = "fp32"  # parameters: fp32, or bf16 (with fp32 gradients, master weights and moments)
    device: str = "auto"  # auto (this rank's GPU when CUDA is available, else the CPU), cpu, cuda
    # elementwise kernels: auto (cpp on a CPU, triton on a GPU, none under FP8), none (eager reference), cpp (C++
    # RMSNorm, RoPE, the experts' weighted SwiGLU, the softmax top-k router and the causal attention core for fp32
    # head dims a multiple of 16 up to 128 where positions x head dim <= 2^17, CPU tensors), triton (Triton
    # RMSNorm, CUDA tensors), compile (torch.compile'd, same math)
    fusion: str = "auto"
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient norm: "stop" (raise) or "skip" the update
    collective_timeout_s: float = 1800.0  # how long a collective waits for a dead or stuck rank
    global_batch_size: int | None = None  # sequences per step; sets grad_accum = global / (dp x micro_batch_size)
    batch_size_rampup: list | None = None  # [start, increment, ramp_samples], Megatron's --rampup-batch-size
    permute_impl: str | None = None  # MoE permute kernel: auto, torch, cpp, triton; null: $MOETRON_PERMUTE_IMPL,
    # else cpp where train.fusion resolves to cpp (a CPU), else by device (triton on GPU, torch on CPU)
    collective_wait_log_s: float = 60.0  # while waiting that long, log which rank waits where, this often
    max_skipped_steps: int = 10  # on_nonfinite=skip: stop with an error after more steps than this in a row
    eval_every: int = 0  # steps between validation losses on held-out data (0: none)
    eval_batches: int = 4  # micro-batches per validation loss (held out of the training data)
    sample_every: int = 0  # steps between greedy text samples from a fixed prompt (0: none)
    wandb_project: str | None = None  # log to Weights & Biases (needs `wandb`; WANDB_MODE=offline works offline)
    keep_last: int = 0  # keep only the newest N checkpoints in save_dir (0: keep all)
    check_memory: bool = True  # refuse a run whose estimated memory per rank exceeds this machine's
    collapse_threshold: float = 3.0  # flag routing collapse when an expert's load max/mean exceeds this

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "micro_batch_size", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be >= 1")
        if self.lr <= 0:
            raise ValueError(f"TrainConfig.lr={self.lr} must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.save_every < 0:
            raise ValueError(f"TrainConfig.save_every={self.save_every} must be >= 0")
        if self.export_hf and not self.save_dir:
            raise ValueError("TrainConfig.export_hf needs train.save_dir: the export is made from the final "
                             "checkpoint")
        if (self.resume or self.resume_from or self.overwrite) and not self.save_dir:
            raise ValueError("TrainConfig.resume, resume_from and overwrite need train.save_dir")
        if self.overwrite and (self.resume or self.resume_from):
            raise ValueError("TrainConfig.overwrite=true moves SAVE_DIR's earlier run aside, train.resume continues "
                             "it: choose one")
        if self.max_skipped_steps < 0 or not self.collective_wait_log_s > 0:
            raise ValueError(f"TrainConfig.max_skipped_steps={self.max_skipped_steps} must be >= 0 and "
                             f"collective_wait_log_s={self.collective_wait_log_s} > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"TrainConfig.warmup_steps={self.warmup_steps} must be >= 0")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"TrainConfig.dtype={self.dtype!r}: choose fp32 or bf16")
        if self.fusion not in ("auto", "none", "cpp", "triton", "compile"):
            raise ValueError(f"TrainConfig.fusion={self.fusion!r}: choose auto, none, cpp, triton or compile")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"TrainConfig.device={self.device!r}: choose auto, cpu or cuda")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"TrainConfig.on_nonfinite={self.on_nonfinite!r}: choose 'stop' (raise an error "
                             "naming the step and rank) or 'skip' (drop that step's update and go on)")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"TrainConfig.collective_timeout_s={self.collective_timeout_s} must be > 0 (seconds a "
                             "collective waits for the other ranks before failing)")
        for name in ("eval_every", "sample_every", "keep_last"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be >= 0 (0 turns it off)")
        if self.eval_batches < 1:
            raise ValueError(f"TrainConfig.eval_batches={self.eval_batches} must be >= 1")
        if self.keep_last and not self.save_dir:
            raise ValueError("TrainConfig.keep_last needs train.save_dir (it prunes the checkpoints saved there)")
        if self.fp8 is not None and self.fp8 not in ("tensorwise", "delayed", "blockwise", "mxfp8"):
            raise ValueError(f"TrainConfig.fp8={self.fp8!r}: choose tensorwise, delayed, blockwise or mxfp8 (or null)")
        if self.fp8_backend not in ("auto", "emulate", "torch", "te"):
            raise ValueError(f"TrainConfig.fp8_backend={self.fp8_backend!r}: choose auto, emulate, torch or te")
        if self.fp8_param_gather and self.fp8 not in ("tensorwise", "delayed", "blockwise"):
            raise ValueError(f"TrainConfig.fp8_param_gather=true needs train.fp8=tensorwise, delayed or blockwise "
                             f"(got {self.fp8!r}: " + ("without FP8 there are no FP8 weights to gather" if not self.fp8
                             else "mxfp8 weights need a second, columnwise FP8 copy") + "); or set it false")
        self._check_batch_size()
        if self.permute_impl not in (None, "auto", "torch", "cpp", "triton"):
            raise ValueError(f"TrainConfig.permute_impl={self.permute_impl!r}: choose auto, torch, cpp or triton "
                             "(or null for the environment's / the device's default)")
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r} must be an integer >= 0")
        if self.first_last_layers_bf16 and not self.fp8:
            raise ValueError("TrainConfig.first_last_layers_bf16=true needs train.fp8 (a recipe): without FP8 every "
                             "layer is already high precision")

    def _check_batch_size(self) -> None:
        """What can be checked without the layout (train/setup.py:resolve_batch_size does the rest)."""
        g, ramp = self.global_batch_size, self.batch_size_rampup
        if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g < 1):
            raise ValueError(f"TrainConfig.global_batch_size={g!r} must be a positive number of sequences (or null)")
        if ramp is None:
            return
        if (not isinstance(ramp, (list, tuple)) or len(ramp) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in ramp)):
            raise ValueError(f"TrainConfig.batch_size_rampup={ramp!r} must be [start, increment, ramp_samples]: three "
                             "positive integers (Megatron's --rampup-batch-size)")
        if g is None:
            raise ValueError("TrainConfig.batch_size_rampup needs train.global_batch_size (the batch it ramps up to)")
        start, increment, _ = ramp
        if not start < g or (g - start) % increment:
            raise ValueError(f"TrainConfig.batch_size_rampup={list(ramp)}: the start must be below "
                             f"train.global_batch_size={g} and reach it in whole increments ({g} - {start} is not a "
                             f"positive multiple of {increment})")

    def lr_at(self, step: int) -> float:
        """Linear warm-up then cosine decay to `lr * min_lr_ratio` (step counts from 0)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


@dataclass
class Recipe:
    """A complete run: model + training + parallel layout (recipes/*.toml hold the shipped ones)."""

    name: str
    description: str
    model: ModelConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        # bf16-only GPU libraries against fp32 activations: refused here, not by the library's assert
        if self.train.dtype == "fp32":
            if self.model.attention_backend == "flash_attn":
                raise ValueError("model.attention_backend=flash_attn runs fp16/bf16 only, but train.dtype=fp32: set "
                                 "train.dtype=bf16, or model.attention_backend=sdpa (or te)")
            if self.model.expert_backend == "grouped_gemm":
                raise ValueError("model.expert_backend=grouped_gemm runs bf16 only, but train.dtype=fp32: set "
                                 "train.dtype=bf16, or model.expert_backend=auto")
        t = self.train
        if t.first_last_layers_bf16 and t.num_layers_at_start_in_bf16 + t.num_layers_at_end_in_bf16 > \
                self.model.num_layers:
            raise ValueError(f"train.num_layers_at_start_in_bf16 + num_layers_at_end_in_bf16 = "
                             f"{t.num_layers_at_start_in_bf16 + t.num_layers_at_end_in_bf16} exceeds model.num_layers="
                             f"{self.model.num_layers}")


def _coerce(text: str, current, path: str):
    """Parse `text` into the type of the field's current value (JSON for lists, dicts, None)."""
    if isinstance(current, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"--set {path}={text}: expected true or false")
    if isinstance(current, str):  # "none" is a valid string value (aux_loss_type=none); null unsets
        return None if text.lower() == "null" else text
    if text.lower() in ("none", "null"):
        return None
    if current is None:  # unset optional field: a JSON value if it parses, else the text itself
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    try:
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
        if isinstance(current, str):
            return text
        return json.loads(text)
    except (ValueError, json.JSONDecodeError):
        kind = type(current).__name__ if current is not None else "JSON"
        raise ValueError(f"--set {path}={text}: expected a value of type {kind}") from None


ALIASES = {"init.hf": "train.init_hf", "export.hf": "train.export_hf"}  # spellings the docs use


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    """Apply `section.field=value` overrides; every section is re-validated afterwards."""
    sections = {"model": recipe.model, "train": recipe.train, "parallel": recipe.parallel}
    changes: dict[str, dict] = {name: {} for name in sections}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected section.field=value, e.g. train.steps=20")
        path, text = item.split("=", 1)
        path = ALIASES.get(path.strip(), path)
        section, _, name = path.strip().partition(".")
        if section not in sections:
            raise ValueError(f"--set {path}: unknown section {section!r}; use one of {sorted(sections)}")
        obj = sections[section]
        known = {f.name for f in dataclasses.fields(obj)}
        if name not in known:
            raise ValueError(f"--set {path}: {type(obj).__name__} has no field {name!r}; "
                             f"fields: {', '.join(sorted(known))}")
        changes[section][name] = _coerce(text.strip(), getattr(obj, name), path)
    return dataclasses.replace(recipe, **{s: dataclasses.replace(sections[s], **c) for s, c in changes.items()})
