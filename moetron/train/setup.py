"""Build what a run needs from a recipe: process groups, the (parallel) model, optimizer, pipeline.

One code path for every layout. The full model is built on every rank from the same seed (on
the CPU), then sharded in place (tensor / expert parallel), moved to the run's device and
dtype, and cut into pipeline stages, so every layout starts from exactly the weights of the
single-process run.

Precision: `train.dtype=fp32` trains fp32 parameters; `bf16` keeps bf16 parameters and
gradients accumulated in fp32, with fp32 master weights and moments in the distributed
optimizer (also in one process) - the usual mixed-precision recipe. Buffers that count or
steer routing (expert bias, token counts) stay fp32 in both.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
from torch import nn

from moetron.backends import backend_status
from moetron.dispatch.permute import impl_status, set_permute_impl
from moetron.model.model import MoETransformer
from moetron.model.parallelize import parallelize
from moetron.ops import resolve_fusion, set_fusion
from moetron.optim import DistributedOptimizer, ReplicatedAdamW
from moetron.optim.adamw import AdamW
from moetron.optim.fsdp import ShardedAdamW
from moetron.parallel.data_parallel import DataParallel
from moetron.parallel.fsdp import FullyShardedDataParallel
from moetron.parallel.zero import ShardedGradDataParallel
from moetron.pipeline.runtime import sync_shared_parameters
from moetron.pipeline.stage import parameter_key, pipeline_stages, shared_parameter_ranks
from moetron.precision import apply_fp8, fp8_backend_choice, get_fp8_recipe
from moetron.precision.fp8_param_gather import enable_fp8_param_gather
from moetron.precision.te_modules import amax_reduction_group, setup_te_userbuffers
from moetron.parallel import ParallelState, init_from_env, validate_for_model
from moetron.config import Recipe
from moetron.data.builtin import BYTE_VOCAB
from moetron.data.prepare import is_prepared
from moetron.train.metrics import require_tensorboard, require_wandb


@dataclass
class TrainingRun:
    recipe: Recipe
    ps: ParallelState
    model: MoETransformer
    optimizer: object  # torch.optim.AdamW (one process), DistributedOptimizer or ReplicatedAdamW
    ddp: object | None = None  # DataParallel when world > 1
    schedule: object | None = None  # PipelineSchedule when pp > 1
    stages: list | None = None  # this rank's PipelineStageModules when pp > 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.ps.rank == 0

    @functools.cached_property
    def parameters(self) -> list[nn.Parameter]:
        """The model's parameters in `model.parameters()` order, listed once: the trainer reads them every
        step, and walking the module tree is ~0.2 ms of the tiny recipe's step."""
        return list(self.model.parameters())

    @property
    def data_rank(self) -> tuple[int, int]:
        """(index, count) of this rank's data-parallel replica: ranks of one replica share data."""
        return self.ps.dp.rank, self.ps.dp.size


def check_run_inputs(recipe: Recipe) -> None:
    """What the pure configs cannot check: the data folder exists and was prepared, and the
    optional packages the recipe asks for are installed."""
    t = recipe.train
    if t.data == "builtin" and recipe.model.vocab_size < BYTE_VOCAB:
        raise ValueError(f"model.vocab_size={recipe.model.vocab_size}: the built-in byte data needs >= {BYTE_VOCAB}")
    if t.data != "builtin" and not is_prepared(t.data):
        raise ValueError(f"train.data={t.data!r}: not 'builtin' nor a folder made by "
                         "`moetron data prepare INPUT... --tokenizer tokenizer.json --output FOLDER`")
    if t.tensorboard_dir:
        try:
            require_tensorboard()
        except ImportError as exc:
            raise ValueError(str(exc)) from None
    if t.wandb_project:
        try:
            require_wandb()
        except ImportError as exc:
            raise ValueError(str(exc)) from None
    _check_backends(recipe)


# field=value -> (backend probe name, how to get it)
_BACKENDS = {
    ("model.attention_backend", "flash_attn"): ("flash_attn", "pip install flash-attn --no-build-isolation"),
    ("model.attention_backend", "te"): ("transformer_engine", "pip install transformer_engine[pytorch]"),
    ("model.expert_backend", "grouped_gemm"): ("grouped_gemm", "pip install grouped_gemm"),
    ("parallel.flex_backend", "deepep"): ("deep_ep", "build and install DeepEP: https://github.com/deepseek-ai/DeepEP"),
    ("parallel.flex_backend", "nvshmem"): ("nvshmem", "a torch build with NVSHMEM (CUDA wheels from pytorch.org)"),
    ("train.fp8_backend", "te"): ("transformer_engine", "pip install transformer_engine[pytorch]"),
}


def _check_backends(recipe: Recipe) -> None:
    """Every optional backend the recipe names can run here (moetron.backends' probes), before any
    process group exists: one line naming the field and the fix, not a traceback mid-setup."""
    values = {"model.attention_backend": recipe.model.attention_backend,
              "model.expert_backend": recipe.model.expert_backend,
              "parallel.flex_backend": recipe.parallel.flex_backend if recipe.parallel.dispatcher == "flex" else None,
              "train.fp8_backend": recipe.train.fp8_backend if recipe.train.fp8 else None}
    status = {s.name: s for s in backend_status()}
    for (name, value), (probe, fix) in _BACKENDS.items():
        if values[name] == value and not status[probe].available:
            missing = "not installed" in status[probe].reason
            raise ValueError(f"{name}={value}: {status[probe].reason}. "
                             + (f"Install it ({fix})" if missing else "Run on a GPU machine")
                             + " or choose another backend; `moetron env` lists what this machine has")
    impl = recipe.train.permute_impl
    if impl in ("cpp", "triton"):
        device = resolve_device(recipe.train.device)
        ok, reason = next((ok, why) for name, ok, why in impl_status(device, build=impl == "cpp") if name == impl)
        if not ok:
            raise ValueError(f"train.permute_impl={impl}: {reason}; choose train.permute_impl=auto or torch")


def _permute_choice(impl: str | None, fusion: str) -> str | None:
    """The recipe's permute kernel, else $MOETRON_PERMUTE_IMPL, else the C++ one when the CPU fusion is on
    (it lives in the library that fusion has built; the same sums as the deterministic reference), else
    the by-device default (None)."""
    if impl is not None:
        return impl
    env = os.environ.get("MOETRON_PERMUTE_IMPL") or None
    return env or ("cpp" if fusion == "cpp" else None)


def resolve_batch_size(recipe: Recipe, world_size: int) -> Recipe:
    """`train.global_batch_size` -> `train.grad_accum` (global = dp x grad_accum x micro_batch_size),
    an error naming the sizes when it does not divide; the ramp-up's sizes are checked the same way.
    Semantics: docs/megatron_switches.md ("Batch size")."""
    t = recipe.train
    if t.global_batch_size is None:
        return recipe
    dp = recipe.parallel.resolve(world_size).dp
    per = dp * t.micro_batch_size
    sizes = [t.global_batch_size] + list(t.batch_size_rampup or [])[:2]
    bad = [v for v in sizes if v % per]
    if bad:
        raise ValueError(f"train.global_batch_size={t.global_batch_size}"
                         + (f", batch_size_rampup={list(t.batch_size_rampup)}" if t.batch_size_rampup else "")
                         + f": {bad[0]} is not a multiple of dp x train.micro_batch_size = {dp} x {t.micro_batch_size} "
                         f"= {per}; change the batch sizes, train.micro_batch_size or the layout")
    accum = t.global_batch_size // per
    if t.grad_accum not in (1, accum):
        raise ValueError(f"train.grad_accum={t.grad_accum} and train.global_batch_size={t.global_batch_size} "
                         f"(= {accum} micro-batches of {t.micro_batch_size} on each of {dp} replicas) disagree: set one")
    if t.batch_size_rampup and recipe.parallel.pp > 1:
        raise ValueError("train.batch_size_rampup with parallel.pp > 1 is not supported (the pipeline schedule is "
                         "built for one micro-batch count); drop the ramp-up or use parallel.pp=1")
    return dataclasses.replace(recipe, train=dataclasses.replace(t, grad_accum=accum))


def microbatches_at(t, dp: int, step: int) -> int:
    """Micro-batches per data-parallel rank in `step`: train.grad_accum, or less during the ramp-up."""
    if not t.batch_size_rampup:
        return t.grad_accum
    ramp = _rampup_batches(t.global_batch_size, *t.batch_size_rampup)
    return (ramp[step] if step < len(ramp) else t.global_batch_size) // (dp * t.micro_batch_size)


@functools.lru_cache(maxsize=8)
def _rampup_batches(global_batch: int, start: int, increment: int, ramp_samples: int) -> list[int]:
    """Megatron's RampupBatchsizeNumMicroBatchesCalculator: the global batch of each step until it is
    full; `start + increment * int(consumed / (ramp_samples / increments))` while consumed <= ramp_samples."""
    per_increment = ramp_samples / ((global_batch - start) // increment)
    batches, consumed = [], 0
    while consumed <= ramp_samples:
        batch = min(start + increment * int(consumed / per_increment), global_batch)
        batches.append(batch)
        consumed += batch
    return batches


def build_optimizer(model: nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    """AdamW; norms, biases and other 1-D parameters get no weight decay. On a GPU, torch's fused
    kernel (one pass instead of several foreach ops), on the CPU too (torch's CPU default is a
    Python loop over the tensors: 7x slower on a 54M-parameter model, 4x on the tiny recipe)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    t = recipe.train
    return AdamW([{"params": decay, "weight_decay": t.weight_decay},  # torch's, minus the torch._dynamo import
                  {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=tuple(t.betas), fused=True)


def _check_layout(recipe: Recipe, ps: ParallelState) -> None:
    c, p = recipe.model, recipe.parallel
    validate_for_model(p, num_attention_heads=c.num_attention_heads, num_kv_heads=c.num_kv_heads,
                       num_experts=c.num_experts, moe_ffn_hidden_size=c.moe_intermediate_size,
                       ffn_hidden_size=c.intermediate_size, num_layers=c.num_layers,
                       seq_length=recipe.train.seq_len, custom_pipeline_layout=True)


def _pipeline(recipe: Recipe, model: MoETransformer, ps: ParallelState, log):
    p = recipe.parallel
    schedule, layout, stages = pipeline_stages(model, ps, p, microbatches=recipe.train.grad_accum,
                                               seq_len=recipe.train.seq_len)
    if ps.rank == 0:
        log(f"pipeline {p.schedule} over pp={p.pp}, layout {layout.text!r}:\n{layout.table()}")
    sync_shared_parameters(schedule, stages, group=ps.pp)
    # Parameters held by several PP ranks (the embedding on the E, MTP and tied-head stages)
    # count once in the global gradient norm: on their lowest holder.
    holders = shared_parameter_ranks(layout, schedule, model.lm_head is None)
    for stage in stages:
        for name, param in stage.named_parameters():
            ranks = holders.get(parameter_key(name))
            if ranks is not None and ps.pp.rank != min(ranks):
                param.pipeline_duplicate = True
    return schedule, stages


def fp8_exclusions(t, num_layers: int) -> list[str]:
    """Module-name patterns kept in high precision: Megatron's first/last-layers-in-bf16 switch."""
    if not t.first_last_layers_bf16:
        return []
    start, end = t.num_layers_at_start_in_bf16, t.num_layers_at_end_in_bf16
    kept = sorted(set(range(start)) | set(range(num_layers - end, num_layers)))
    return [f"layers.{i}.*" for i in kept]


def _apply_fp8(model: MoETransformer, t, ps: ParallelState | None = None, log=None) -> None:
    c = model.config
    if t.fp8 == "delayed" and (c.recompute_modules or c.recompute_every_n_layers or c.recompute_method):
        raise ValueError("train.fp8=delayed with recomputation: the recomputed forward would update the amax "
                         "history twice; use train.fp8=tensorwise or blockwise, or turn recomputation off")
    if t.fp8:
        recipe = get_fp8_recipe(t.fp8, backend=t.fp8_backend)
        backend, reason = fp8_backend_choice(recipe)
        if log is not None and (ps is None or ps.rank == 0):
            log(f"fp8 {t.fp8}: backend {backend} ({reason})")
        # TE reduces amaxes over this pipeline stage's TP x DP x CP ranks (Megatron's amax reduction group)
        amax_group = amax_reduction_group(ps) if ps is not None and backend == "te" else None
        apply_fp8(model, recipe, exclude=fp8_exclusions(t, c.num_layers), amax_group=amax_group, parallel_state=ps)
        if backend == "te" and ps is not None and any(getattr(m, "tp_comm_in_gemm", False) for m in model.modules()):
            plain = setup_te_userbuffers(model.named_modules(), ps, c.hidden_size,
                                         t.micro_batch_size * t.seq_len // ps.cp.size, DTYPES[t.dtype], t.fp8)
            if log is not None and ps.rank == 0:
                log("tp_comm_overlap: Transformer Engine userbuffers (qkv, proj, fc1, fc2)" +
                    (f"; TE's plain all-gather for {plain} (not hidden-wide)" if plain else ""))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """`train.device`: "auto" is this rank's GPU (LOCAL_RANK) when CUDA is available, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device=cuda but torch sees no CUDA device (a CPU build of torch, or no "
                             "driver): use train.device=cpu or auto")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    if name != "cpu":
        raise ValueError(f"train.device={name!r}: choose auto, cpu or cuda")
    return torch.device("cpu")


def _to_device(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Parameters to `dtype` on `device`; buffers keep their dtype (fp32 counts and expert bias)."""
    model.to(device)
    if dtype != torch.float32:
        for param in model.parameters():
            if param.is_floating_point():
                param.data = param.data.to(dtype)


def build_run(recipe: Recipe, log=print) -> TrainingRun:
    """Initialise the process groups (from torchrun's environment) and build everything."""
    t, p = recipe.train, recipe.parallel
    one_process = not torch.distributed.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) == 1
    if one_process and any(getattr(p, k) != 1 for k in ("tp", "cp", "ep", "etp", "pp")):
        raise ValueError(f"recipe {recipe.name!r} asks for a parallel layout (tp={p.tp} cp={p.cp} ep={p.ep} "
                         f"etp={p.etp} pp={p.pp}) but runs in one process: launch it with "
                         f"`torchrun --nproc-per-node N -m moetron train ...`, or override the layout "
                         f"with --set parallel.ep=1 ...")
    if (t.fp8 and p.tp > 1 and p.tp_comm_overlap
            and fp8_backend_choice(get_fp8_recipe(t.fp8, backend=t.fp8_backend))[0] != "te"):
        raise ValueError("train.fp8 with parallel.tp_comm_overlap=true: moetron's chunked all-gather/reduce-scatter "
                         "overlap runs its GEMMs in high precision; use train.fp8_backend=te (Transformer Engine "
                         "userbuffers overlap FP8 GEMMs), or set parallel.tp_comm_overlap=false")
    if t.fp8_param_gather and (one_process or not p.distributed_optimizer or getattr(p, "zero", 1) == 3):
        why = ("runs in one process: nothing is all-gathered; launch with data-parallel ranks" if one_process else
               "needs parallel.distributed_optimizer=true (only ZeRO-1/2 all-gather parameters)"
               if not p.distributed_optimizer else "with parallel.zero_stage=3: FSDP2 gathers the parameters itself; "
               "use parallel.zero_stage=1 or 2")
        raise ValueError(f"train.fp8_param_gather=true {why}, or set train.fp8_param_gather=false")
    dtype = DTYPES[t.dtype]
    if dtype != torch.float32 and not p.distributed_optimizer:
        raise ValueError(f"train.dtype={t.dtype} needs parallel.distributed_optimizer=true: it keeps the fp32 "
                         "master weights that low-precision parameters need")
    device = resolve_device(t.device)
    fusion, notice = resolve_fusion(t.fusion, device, fp8=bool(t.fp8), dtype=dtype)
    if notice and log is not None:
        log(notice)
    set_fusion(fusion)  # process-wide: RMSNorm, SwiGLU, RoPE, cross-entropy
    set_permute_impl(_permute_choice(t.permute_impl, fusion))
    ps = init_from_env(p)
    torch.manual_seed(t.seed)
    model = MoETransformer(recipe.model)
    if ps.world_size == 1 and dtype == torch.float32:
        _apply_fp8(model, t, ps, log)
        _to_device(model, device, dtype)
        return TrainingRun(recipe, ps, model, build_optimizer(model, recipe), device=device)

    if ps.world_size > 1:
        _check_layout(recipe, ps)
        parallelize(model, ps, p)
    _apply_fp8(model, t, ps, log)
    if p.tp_comm_overlap and ps.tp.size > 1 and ps.rank == 0 and not any(
            getattr(m, "tp_comm_in_gemm", False) for m in model.modules()):
        log(f"tp_comm_overlap: moetron's chunked all-gather->GEMM / GEMM->reduce-scatter "
            f"({p.tp_comm_overlap_chunks} chunks)")
    if p.zero == 3 and ps.world_size > 1:  # FSDP2 keeps fp32 shards and computes in `dtype`
        return _fully_sharded_run(recipe, ps, model, device, dtype)
    _to_device(model, device, dtype)  # before the pipeline syncs shared weights over the (NCCL) group
    schedule = stages = None
    trained: nn.Module = model
    if ps.pp.size > 1:
        schedule, stages = _pipeline(recipe, model, ps, log)
        trained = nn.ModuleList(stages)
    # parallel.distributed_optimizer: ZeRO-1 (reduce-scatter, sharded state, all-gather) or a full
    # AdamW replica per rank over all-reduced gradients; the trainer drives both the same way.
    # parallel.zero_stage=2: the gradients persist as this rank's shard only (parallel/zero.py)
    ddp = (ShardedGradDataParallel if p.zero == 2 else DataParallel)(
        trained, ps, use_distributed_optimizer=p.distributed_optimizer, grad_dtype=torch.float32,
        bucket_size=p.bucket_size, overlap_grad_reduce=p.overlap_grad_reduce, overlap_param_gather=p.overlap_param_gather)
    kind = DistributedOptimizer if p.distributed_optimizer else ReplicatedAdamW
    extra = ({"overlap_param_gather_with_optimizer_step": p.overlap_param_gather_with_optimizer_step}
             if p.distributed_optimizer else {})
    optimizer = kind(ddp, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, max_grad_norm=t.grad_clip,
                     **extra)
    if t.fp8_param_gather:  # the ZeRO all-gather sends FP8 weights (raises where it cannot take effect)
        enable_fp8_param_gather(ddp)
    return TrainingRun(recipe, ps, model, optimizer, ddp, schedule, stages, device=device)


def _fully_sharded_run(recipe: Recipe, ps: ParallelState, model: MoETransformer, device, dtype) -> TrainingRun:
    """parallel.zero_stage=3: FSDP2 `fully_shard` on every transformer (and MTP) layer, then the root."""
    t = recipe.train
    if t.init_hf:
        raise ValueError("train.init_hf with parallel.zero_stage=3 is not supported: start from the Hugging Face "
                         "weights under parallel.zero_stage=1 or 2, save a checkpoint, and resume it under ZeRO-3")
    _to_device(model, device, torch.float32)
    units = list(model.layers) + list(getattr(model, "mtp", None) or [])
    fsdp = FullyShardedDataParallel(model, ps, units, param_dtype=None if dtype == torch.float32 else dtype)
    optimizer = ShardedAdamW(fsdp, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                             max_grad_norm=t.grad_clip)
    return TrainingRun(recipe, ps, model, optimizer, fsdp, device=device)
