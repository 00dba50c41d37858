"""The training loop: AdamW, warm-up + cosine, clipping, accumulation, balancing, metrics.

The same loop runs one process or any layout launched with torchrun: `setup.build_run`
shards the model, and each step either accumulates micro-batches through the model
(data / tensor / expert parallel) or runs the pipeline schedule over them.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable

import torch
import torch.distributed as dist

from moetron.model.size import model_size, training_flops_per_token
from moetron.moe import balancing
from moetron.recipes.recipe import Recipe
from moetron.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from moetron.train.data import BYTE_VOCAB, TokenBatches, stdlib_corpus
from moetron.train.progress import MetricsLogger
from moetron.train.setup import TrainingRun, build_optimizer, build_run

__all__ = ["train", "build_optimizer"]


def train(recipe: Recipe, log: Callable[[str], None] = print) -> list[dict]:
    """Run `recipe` and return the per-step metrics (also written to `train.metrics_file`)."""
    t = recipe.train
    if recipe.model.vocab_size < BYTE_VOCAB and t.data == "builtin":
        raise ValueError(f"model.vocab_size={recipe.model.vocab_size}: the built-in byte data needs >= {BYTE_VOCAB}")
    run = build_run(recipe, log)
    say = log if run.is_main else (lambda s: None)
    dp = run.data_rank[1]
    if t.data == "builtin":
        data = TokenBatches(stdlib_corpus(), t.seq_len, t.micro_batch_size, t.seed)
    else:
        from moetron.data.packed import PackedBatches

        data = PackedBatches(t.data, t.seq_len, t.micro_batch_size, t.seed, micro_batches_per_step=t.grad_accum * dp,
                             mask_boundary_labels=t.data_mask_boundary, model_vocab_size=recipe.model.vocab_size)
        say(data.describe())
    size = model_size(recipe.model)
    flops_per_token = training_flops_per_token(recipe.model, t.seq_len)
    say(f"recipe {recipe.name}: {size.total / 1e6:.2f}M parameters ({size.active / 1e6:.2f}M active), "
        f"{t.steps} steps of {dp}x{t.grad_accum}x{t.micro_batch_size}x{t.seq_len} tokens "
        f"on {run.ps.world_size} process(es)")
    start = 0
    if t.resume and latest_checkpoint(t.save_dir) is not None:
        folder = latest_checkpoint(t.save_dir)
        start = load_checkpoint(folder, run.model, run.optimizer, parallel_state=run.ps, modules=run.stages)
        say(f"resumed from {folder} after step {start}")
    elif t.init_hf:
        from moetron.bridge.convert import load_hf_weights

        load_hf_weights(t.init_hf, run.model, run.optimizer, parallel_state=run.ps, modules=run.stages)
        say(f"initialised from the Hugging Face checkpoint {t.init_hf}")
    logger = MetricsLogger(t.steps, start_step=start, log_every=t.log_every, metrics_file=t.metrics_file,
                           tensorboard_dir=t.tensorboard_dir, log=log, enabled=run.is_main)
    history = []
    try:
        run.model.train()
        for step in range(start, t.steps):
            history.append(_train_step(run, data, step, flops_per_token))
            logger.log_step(history[-1])
            done = step + 1
            if t.save_dir and ((t.save_every and done % t.save_every == 0) or done == t.steps):
                saved = save_checkpoint(t.save_dir, done, run.model, run.optimizer, recipe,
                                        parallel_state=run.ps, modules=run.stages)
                logger.write(f"saved {saved}")
    finally:
        logger.close()
    if t.export_hf:
        _export_hf(run, t, say)
    return history


def _export_hf(run: TrainingRun, t, say) -> None:
    """Write the final checkpoint as a Hugging Face folder (rank 0, after every rank has saved)."""
    from moetron.bridge.convert import moetron_to_hf

    if run.is_main:
        moetron_to_hf(latest_checkpoint(t.save_dir), t.export_hf, overwrite=True, progress=False)
        say(f"exported {t.export_hf}")
    if dist.is_initialized():
        dist.barrier()


def _forward_backward(run: TrainingRun, data: TokenBatches, step: int) -> tuple[dict[str, float], int]:
    """Every micro-batch of this rank for `step`; returns mean losses and the token count."""
    t = run.recipe.train
    rank, dp = run.data_rank
    batches = [data.batch(step, m * dp + rank) for m in range(t.grad_accum)]
    if run.schedule is not None:
        from moetron.pipeline.runtime import run_schedule

        with run.ddp.no_sync():
            result = run_schedule(run.schedule, run.stages, batches, group=run.ps.pp,
                                  fb_overlap=run.recipe.parallel.fb_overlap)
        sums = {"loss": float(result.loss), "lm_loss": float(result.lm_loss)}
        if result.mtp_loss is not None:
            sums["mtp_loss"] = float(result.mtp_loss)
        return sums, sum(int((y != -100).sum()) for _, y in batches)

    sums: dict[str, float] = {}
    tokens = 0
    for m, (inputs, labels) in enumerate(batches):
        last = m == len(batches) - 1
        sync = contextlib.nullcontext() if run.ddp is None or last else run.ddp.no_sync()
        with sync:
            if run.ps.cp.size > 1:  # this rank's load-balanced chunks of the sequences
                from moetron.parallel.context_parallel import split_batch

                out = run.model(**split_batch(run.ps.cp, inputs, labels=labels))
            else:
                out = run.model(inputs, labels=labels)
            (out.total_loss / t.grad_accum).backward()
        tokens += out.num_tokens
        parts = {"loss": out.total_loss, "lm_loss": out.loss, "mtp_loss": out.mtp_loss, **out.aux_losses}
        for name, value in parts.items():
            if value is not None:
                sums[name] = sums.get(name, 0.0) + float(value.detach()) / t.grad_accum
    return sums, tokens


def _mean_over_replicas(run: TrainingRun, sums: dict[str, float], tokens: int) -> tuple[dict[str, float], int]:
    if run.ps.dp.size == 1:
        return sums, tokens
    names = sorted(sums)
    values = torch.tensor([sums[n] for n in names] + [float(tokens)], dtype=torch.float64)
    dist.all_reduce(values, group=run.ps.dp.handle)
    values[:-1] /= run.ps.dp.size
    return dict(zip(names, values[:-1].tolist())), int(values[-1])


def _train_step(run: TrainingRun, data: TokenBatches, step: int, flops_per_token: float) -> dict:
    t = run.recipe.train
    start = time.perf_counter()
    lr = t.lr_at(step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    # Each context-parallel rank routes its share of the tokens: its aux losses count 1/cp.
    balancing.set_aux_loss_scale(1.0 / (t.grad_accum * run.ps.cp.size))
    if run.ddp is not None:
        run.ddp.zero_grad()
    sums, tokens = _forward_backward(run, data, step)
    if run.ddp is not None:
        run.ddp.finish_grad_sync()
        grad_norm = float(run.optimizer.step())
    else:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(run.model.parameters(), t.grad_clip))
        if math.isfinite(grad_norm):
            run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"step {step}: gradient norm is {grad_norm}; lower train.lr or check the data")
    run.model.update_expert_bias()
    sums, tokens = _mean_over_replicas(run, sums, tokens)
    elapsed = time.perf_counter() - start
    loads = [s["max_over_mean"] for s in run.model.load_stats().values() if s]
    metrics = {"step": step, **sums, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": tokens / elapsed,
               "tflops": flops_per_token * tokens / elapsed / 1e12,
               "max_over_mean_load": max(loads) if loads else None}
    if t.peak_tflops:
        metrics["mfu"] = metrics["tflops"] / (t.peak_tflops * run.ps.world_size)
    return metrics
