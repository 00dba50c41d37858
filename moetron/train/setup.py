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

import os
from dataclasses import dataclass

import torch
from torch import nn

from moetron.model.model import MoETransformer
from moetron.model.parallelize import parallelize
from moetron.ops import set_fusion
from moetron.optim import DistributedOptimizer, ReplicatedAdamW
from moetron.parallel.data_parallel import DataParallel
from moetron.pipeline.runtime import sync_shared_parameters
from moetron.pipeline.stage import parameter_key, pipeline_stages, shared_parameter_ranks
from moetron.precision import apply_fp8, get_fp8_recipe
from moetron.parallel import ParallelState, init_from_env, validate_for_model
from moetron.config import Recipe
from moetron.data.builtin import BYTE_VOCAB
from moetron.data.prepare import is_prepared
from moetron.train.metrics import require_tensorboard


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


def build_optimizer(model: nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    """AdamW; norms, biases and other 1-D parameters get no weight decay. On a GPU, torch's fused
    kernel (one pass instead of several foreach ops); on the CPU torch's default."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    t = recipe.train
    fused = True if next(model.parameters()).is_cuda else None
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=tuple(t.betas),
                             fused=fused)


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


def _apply_fp8(model: MoETransformer, t) -> None:
    c = model.config
    if t.fp8 == "delayed" and (c.recompute_modules or c.recompute_every_n_layers):
        raise ValueError("train.fp8=delayed with recomputation: the recomputed forward would update the amax "
                         "history twice; use train.fp8=tensorwise or blockwise, or turn recomputation off")
    if t.fp8:
        apply_fp8(model, get_fp8_recipe(t.fp8, backend=t.fp8_backend))


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
    if t.fp8 and p.tp > 1:
        raise NotImplementedError("train.fp8 with parallel.tp > 1: tensor-parallel FP8 linear layers are not "
                                  "supported yet")
    dtype = DTYPES[t.dtype]
    if dtype != torch.float32 and not p.distributed_optimizer:
        raise ValueError(f"train.dtype={t.dtype} needs parallel.distributed_optimizer=true: it keeps the fp32 "
                         "master weights that low-precision parameters need")
    device = resolve_device(t.device)
    set_fusion(t.fusion)  # process-wide: RMSNorm, SwiGLU, RoPE, cross-entropy
    ps = init_from_env(p)
    torch.manual_seed(t.seed)
    model = MoETransformer(recipe.model)
    if ps.world_size == 1 and dtype == torch.float32:
        _apply_fp8(model, t)
        _to_device(model, device, dtype)
        return TrainingRun(recipe, ps, model, build_optimizer(model, recipe), device=device)

    if ps.world_size > 1:
        _check_layout(recipe, ps)
        parallelize(model, ps, p)
    _apply_fp8(model, t)
    _to_device(model, device, dtype)  # before the pipeline syncs shared weights over the (NCCL) group
    schedule = stages = None
    trained: nn.Module = model
    if ps.pp.size > 1:
        schedule, stages = _pipeline(recipe, model, ps, log)
        trained = nn.ModuleList(stages)
    # parallel.distributed_optimizer: ZeRO-1 (reduce-scatter, sharded state, all-gather) or a full
    # AdamW replica per rank over all-reduced gradients; the trainer drives both the same way.
    ddp = DataParallel(trained, ps, use_distributed_optimizer=p.distributed_optimizer, grad_dtype=torch.float32)
    kind = DistributedOptimizer if p.distributed_optimizer else ReplicatedAdamW
    optimizer = kind(ddp, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, max_grad_norm=t.grad_clip)
    return TrainingRun(recipe, ps, model, optimizer, ddp, schedule, stages, device=device)
