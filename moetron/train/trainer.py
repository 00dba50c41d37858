"""The training loop: AdamW, warm-up + cosine, clipping, accumulation, balancing, metrics.

The same loop runs one process or any layout launched with torchrun: `setup.build_run`
shards the model, and each step either accumulates micro-batches through the model
(data / tensor / expert parallel) or runs the pipeline schedule over them.

Failures: a NaN/inf loss (on any rank) or gradient norm is agreed on by every rank in one
small all-reduce, then `train.on_nonfinite` stops the run on every rank (an error naming the
step and ranks) or skips the step's update. A collective that fails because another rank died
or hangs (after `train.collective_timeout_s`) raises a `CollectiveError` naming the collective,
the step and the phase.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from moetron.bridge.convert import load_hf_weights, moetron_to_hf
from moetron.parallel.context_parallel import split_batch
from moetron.parallel.grad_norm import clip_, sum_of_squares
from moetron.pipeline.runtime import run_schedule
from moetron.precision import cache_fp8_weights
from moetron.model.size import model_size, training_flops_per_token
from moetron.moe import balancing
from moetron.parallel.state import collective_failures, init_process_group_from_env
from moetron.config import Recipe
from moetron.checkpoint.training import latest_checkpoint, load_checkpoint, save_checkpoint
from moetron.checkpoint.save_dir import prepare_metrics_file, resume_point
from moetron.checkpoint.verify import read_meta
from moetron.data.builtin import TokenBatches, stdlib_corpus
from moetron.moe.layer import load_summary
from moetron.ops import fusion_mode, set_fusion
from moetron.kernels.threads import helper_threads, set_wide_threads, wide_threads
from moetron.kernels.weight_grads import weight_grads_beside
from moetron.train.host import keep_freed_memory, small_model_threads
from moetron.train.evaluation import Sampler, build_data, check_supported, validation_loss
from moetron.train.metrics import MetricsLogger, describe_run
from moetron.train.model_source import check_model_matches, checkpoint_source
from moetron.train.preflight import check_layout, check_memory
from moetron.train.stopping import StopSignal, prune_checkpoints, resume_command
from moetron.train.setup import (TrainingRun, build_optimizer, build_run, check_run_inputs, microbatches_at,
                                 resolve_batch_size, resolve_device)

__all__ = ["train", "build_optimizer"]


def train(recipe: Recipe, log: Callable[[str], None] = print) -> list[dict]:
    """Run `recipe` and return the per-step metrics (also written to `train.metrics_file`)."""
    check_run_inputs(recipe)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    recipe = resolve_batch_size(recipe, world)  # train.global_batch_size -> train.grad_accum
    check_layout(recipe, world)  # before any process group or model: the same error on every rank
    check_supported(recipe)
    memory = check_memory(recipe, world)
    source = checkpoint_source(recipe)  # the checkpoint's config is the model
    if source is not None:
        check_model_matches(recipe, source)
    threads, wide, fusion = torch.get_num_threads(), wide_threads(), fusion_mode()
    try:
        run, hint = _start(recipe, log)
        say = log if run.is_main else (lambda s: None)
        small_model_threads(run, recipe, say)
        keep_freed_memory(run.device, say)
        return _train(recipe, run, hint, say, memory, source, log)
    finally:  # the caller's process-wide settings, as they were before the run
        torch.set_num_threads(threads)
        set_wide_threads(wide)
        set_fusion(fusion)


def _train(recipe: Recipe, run: TrainingRun, hint: str, say, memory, source, log) -> list[dict]:
    t = recipe.train
    dp = run.data_rank[1]
    data, held = build_data(recipe, lambda: stdlib_corpus(dtype=torch.uint8), dp)  # batches come out int64
    if t.data != "builtin":
        say(data.describe())
    size = model_size(recipe.model)
    flops_per_token = training_flops_per_token(recipe.model, t.seq_len)
    for line in describe_run(recipe, world_size=run.ps.world_size, dp=dp, total_params=size.total,
                             active_params=size.active, device=run.device.type, memory=memory):
        say(line)
    start, state = 0, {}
    batch = {"global_batch_size": dp * t.grad_accum * t.micro_batch_size,
             "batch": f"dp {dp} x grad_accum {t.grad_accum} x micro_batch_size {t.micro_batch_size}"}
    folder = resume_point(t.save_dir, resume=t.resume or t.resume_from is not None, overwrite=t.overwrite,
                          resume_from=t.resume_from, log=say)
    if folder is not None:
        start = load_checkpoint(folder, run.model, run.optimizer, parallel_state=run.ps, modules=run.stages,
                                verify=False)  # resume_point verified every file just now
        state = read_meta(folder).get("train_state") or {}
        say(f"resumed from {folder} after step {start}")
        if state.get("global_batch_size", batch["global_batch_size"]) != batch["global_batch_size"]:
            say(f"warning: the global batch changes from {state['global_batch_size']} sequences ({state['batch']}) "
                f"in {folder} to {batch['global_batch_size']} ({batch['batch']}); set train.grad_accum or "
                "train.micro_batch_size to keep it")
    elif t.init_hf:
        load_hf_weights(t.init_hf, run.model, run.optimizer, parallel_state=run.ps, modules=run.stages)
        say(f"initialised from the Hugging Face checkpoint {t.init_hf}")
    if run.is_main:
        prepare_metrics_file(t.metrics_file, start, t.overwrite)
    logger = MetricsLogger(t.steps, start_step=start, log_every=t.log_every, metrics_file=t.metrics_file,
                           tensorboard_dir=t.tensorboard_dir, log=log, enabled=run.is_main,
                           wandb_project=t.wandb_project, wandb_config=dataclasses.asdict(recipe),
                           collapse_threshold=t.collapse_threshold)
    sampler = Sampler(t.data) if t.sample_every else None
    extra_meta = source.extra_meta() if source is not None else {}
    stop = StopSignal().__enter__()  # Ctrl-C / SIGTERM: stop after the step, saving first
    history = []
    skipped, in_a_row = state.get("skipped_steps", 0), state.get("skipped_in_a_row", 0)
    try:
        run.model.train()
        for step in range(start, t.steps):
            guard = _guard(run, hint, step)
            metrics = _train_step(run, data, step, flops_per_token, guard, stop)
            stop_agreed = metrics.pop("stop")
            if metrics["skipped"]:
                skipped, in_a_row = skipped + 1, in_a_row + 1
                logger.write(f"warning: step {step + 1}/{t.steps} skipped (train.on_nonfinite=skip): "
                             f"{metrics['nonfinite']}; no update")
            else:
                in_a_row = 0
            metrics["skipped_steps"] = skipped
            history.append(metrics)
            logger.log_step(metrics)
            if in_a_row > t.max_skipped_steps:
                raise FloatingPointError(
                    f"step {step + 1}/{t.steps}: {in_a_row} steps in a row were skipped (train.on_nonfinite=skip, "
                    f"train.max_skipped_steps={t.max_skipped_steps}; {skipped} in all): the run has diverged. "
                    "Resume an earlier checkpoint with a lower train.lr (train.resume_from=step-N), or raise "
                    "train.max_skipped_steps")
            done = step + 1
            if held is not None and (done % t.eval_every == 0 or done == t.steps):
                with guard("in the validation forward"):
                    metrics["val_loss"] = validation_loss(run, held)
                logger.log_eval(step, metrics["val_loss"])
            if sampler is not None and (done % t.sample_every == 0 or done == t.steps):
                logger.write(f"sample {done}/{t.steps}: {sampler(run)!r}")
            # One process: a signal during this step stops after it. Several: the flag was agreed on in the
            # step's loss check, before the update; a signal after that stops after the next step.
            stopping = done < t.steps and (stop_agreed or (run.ps.world_size == 1 and stop.requested is not None))
            if t.save_dir and ((t.save_every and done % t.save_every == 0) or done == t.steps or stopping):
                if run.ddp is not None:  # parallel.overlap_param_gather: the weights are read here
                    run.ddp.finish_param_sync()
                with guard("while saving the checkpoint after the end"):
                    saved = save_checkpoint(t.save_dir, done, run.model, run.optimizer, recipe,
                                            parallel_state=run.ps, modules=run.stages,
                                            extra_meta={"train_state": {"skipped_steps": skipped,
                                                                        "skipped_in_a_row": in_a_row, **batch},
                                                        **extra_meta})
                logger.write(f"saved {saved}")
                if t.keep_last and run.is_main:
                    for old in prune_checkpoints(t.save_dir, t.keep_last):
                        logger.write(f"removed {old} (train.keep_last={t.keep_last})")
            if stopping:
                logger.write(f"stopped by {stop.requested or 'a signal to another rank'} after step {done}/{t.steps}; "
                             + (f"resume with: {resume_command(t.save_dir)}" if t.save_dir else
                                "nothing was saved (train.save_dir is not set)"))
                break
    finally:
        stop.__exit__(None, None, None)
        logger.close()
    if run.ddp is not None:
        run.ddp.finish_param_sync()  # the caller may read the weights
    if t.export_hf and not (history and history[-1]["step"] + 1 < t.steps):  # not after a stop signal
        _export_hf(run, t, say)
    return history


def _start(recipe: Recipe, log) -> tuple[TrainingRun, str]:
    """Process groups that wait at most `train.collective_timeout_s`, then `build_run`.

    torch.distributed is initialised here, with the timeout, so build_run only builds the groups
    (which inherit it); groups of an already-initialised world get it too. Returns the run and
    the hint that failed-collective errors carry.
    """
    seconds = recipe.train.collective_timeout_s
    timeout = timedelta(seconds=seconds)
    device = resolve_device(recipe.train.device)  # NCCL for GPU tensors, gloo for CPU ones
    init_process_group_from_env(recipe.parallel, backend="nccl" if device.type == "cuda" else "gloo",
                                timeout=timeout)
    hint = (f"Collectives wait train.collective_timeout_s={seconds:g} s for the other ranks; a rank that "
            "raised or was killed shows the cause in its own log.")
    rank = dist.get_rank() if dist.is_initialized() else 0
    with collective_failures("while setting up the run", rank=rank, hint=hint):
        run = build_run(recipe, log)
    run.ps.set_timeout(timeout)
    return run, hint


def _guard(run: TrainingRun, hint: str, step: int):
    """`guard(where)`: a context in which a failed collective raises an error naming `where`,
    the step and this rank (`moetron.parallel.state.collective_failures`)."""
    steps = run.recipe.train.steps
    # One process has no collective to wait for: no wait-logging timer thread (4 a step, ~2 ms each).
    wait = run.recipe.train.collective_wait_log_s if run.ps.world_size > 1 else None
    return lambda where: collective_failures(f"{where} of step {step + 1}/{steps}", rank=run.ps.rank, hint=hint,
                                             wait_log_s=wait)


def _export_hf(run: TrainingRun, t, say) -> None:
    """Write the final checkpoint as a Hugging Face folder (rank 0, after every rank has saved)."""
    if run.is_main:
        summary = moetron_to_hf(latest_checkpoint(t.save_dir), t.export_hf, overwrite=True, progress=False)
        changes = summary.get("config_changes")
        say(f"exported {t.export_hf}" + (f"; its config.json differs from the source's in: {'; '.join(changes)}"
                                          if changes else ""))
    if dist.is_initialized():
        dist.barrier()


def _forward_backward(run: TrainingRun, data: TokenBatches, step: int) -> tuple[dict[str, float], int]:
    """Every micro-batch of this rank for `step`; returns mean losses and the token count."""
    t = run.recipe.train
    rank, dp = run.data_rank
    count = microbatches_at(t, dp, step)  # train.grad_accum, or fewer during train.batch_size_rampup
    pin = run.device.type == "cuda"  # from pageable memory a copy to the GPU waits for the queued kernels
    batches = [tuple((x.pin_memory() if pin else x).to(run.device, non_blocking=True)
                     for x in data.batch(step, m * dp + rank)) for m in range(count)]
    if run.schedule is not None:
        tokens = sum(int((y != -100).sum()) for _, y in batches)  # the whole sequences' labels
        if run.ps.cp.size > 1:  # this rank's chunks; the stages' losses are CP-reduced (as the model's)
            batches = [split_batch(run.ps.cp, x, labels=y) for x, y in batches]
        # Each chunk's buckets launch during its last backward (parallel.overlap_grad_reduce).
        result = run_schedule(run.schedule, run.stages, batches, group=run.ps.pp,
                              fb_overlap=run.recipe.parallel.fb_overlap, data_parallel=run.ddp,
                              aux_loss_scale=balancing.aux_loss_scale())  # the step's, set by _train_step
        sums = {"loss": float(result.loss), "lm_loss": float(result.lm_loss)}
        if result.mtp_loss is not None:
            sums["mtp_loss"] = float(result.mtp_loss)
        return sums, tokens

    beside = _grads_beside(run)
    pending = []  # each micro-batch's token count and losses, read once all are queued (a GPU read waits)
    for m, (inputs, labels) in enumerate(batches):
        last = m == len(batches) - 1
        sync = contextlib.nullcontext() if run.ddp is None or last else run.ddp.no_sync()
        with sync, weight_grads_beside(beside):
            if run.ps.cp.size > 1:  # this rank's load-balanced chunks of the sequences
                out = run.model(**split_batch(run.ps.cp, inputs, labels=labels))
            else:
                out = run.model(inputs, labels=labels)
            (out.total_loss / count).backward()
        parts = {"loss": out.total_loss, "lm_loss": out.loss, "mtp_loss": out.mtp_loss, **out.aux_losses}
        pending.append((out.token_count, {name: v.detach() for name, v in parts.items() if v is not None}))
    sums: dict[str, float] = {}
    tokens = 0
    for token_count, parts in pending:
        tokens += int(token_count)
        for name, value in parts.items():
            sums[name] = sums.get(name, 0.0) + float(value) / count
    return sums, tokens


def _grads_beside(run: TrainingRun) -> bool:
    """Weight gradients on the helper thread: one process, no pipeline, and a helper to spare (wide
    threads beyond the intra-op ones: train/host.py gives a small model one intra-op thread and two)."""
    return run.ps.world_size == 1 and run.ddp is None and run.schedule is None and helper_threads() > 0


def _mean_over_replicas(run: TrainingRun, sums: dict[str, float], tokens: int) -> tuple[dict[str, float], int]:
    if run.ps.dp.size == 1:
        return sums, tokens
    names = sorted(sums)
    values = torch.tensor([sums[n] for n in names] + [float(tokens)], dtype=torch.float64, device=_device(run))
    dist.all_reduce(values, group=run.ps.dp.handle)
    values[:-1] /= run.ps.dp.size
    values = values.tolist()
    return dict(zip(names, values[:-1])), int(values[-1])


def _device(run: TrainingRun) -> torch.device:
    """Where this rank's collectives of small host values go (NCCL needs a CUDA tensor)."""
    return run.parameters[0].device


def _nonfinite_ranks(run: TrainingRun, sums: dict[str, float], stop: StopSignal | None = None,
                     ) -> tuple[list[int], bool]:
    """Ranks whose step losses include a NaN/inf, the same list on every rank (a world all-reduce),
    so that every rank stops or skips together and none is left waiting in a collective; and whether
    any rank was asked to stop (`stop`: its flag rides in the same all-reduce, which comes before the
    update: an all-reduce of its own after it made a GPU step's host wait for the update)."""
    local = not all(math.isfinite(v) for v in sums.values())
    requested = stop is not None and stop.requested is not None
    if run.ps.world_size == 1:
        return ([0] if local else []), requested
    flags = torch.zeros(run.ps.world_size + 1, dtype=torch.float32, device=_device(run))
    flags[run.ps.rank] = float(local)
    flags[-1] = float(requested)
    dist.all_reduce(flags, group=run.ps.world.handle)
    values = flags.tolist()
    return [r for r, flag in enumerate(values[:-1]) if flag], bool(values[-1])


def _optimizer_step(run: TrainingRun) -> float:
    """Clip and update; returns the global gradient norm (no update when it is not finite)."""
    if run.ddp is not None:
        return float(run.optimizer.step())  # moetron's optimizers skip a non-finite norm themselves
    grads = [p.grad for p in run.parameters if p.grad is not None]
    norm = sum_of_squares(grads, _device(run)).sqrt()
    value = float(norm)  # read once, before the update: on a GPU a read after it waits for it
    if math.isfinite(value):
        clip_(grads, norm, run.recipe.train.grad_clip)
        run.optimizer.step()
    return value


def _load_metrics(run: TrainingRun) -> dict:
    """Per-MoE-layer load of the whole step (every micro-batch, every rank; a world all-reduce),
    and two summaries over the layers: the worst max/mean load and the worst dropped fraction."""
    layers = run.model.moe_layers_by_index()
    stats, idle = {}, 0
    if layers:
        totals = torch.stack([layer.load_totals() for layer in layers.values()])
        if run.ps.world.size > 1:
            dist.all_reduce(totals, group=run.ps.world.handle)
        for i, row in zip(layers, totals.tolist()):  # one device sync for every layer
            if summary := load_summary(row):  # layers that routed no token are left out
                stats[i] = summary
                idle += row[:-1].count(0)  # experts that got no token: a collapse sign
    num_layers = run.model.config.num_layers
    per_layer = {(f"layer{i}" if i < num_layers else f"mtp{i - num_layers + 1}"): s for i, s in stats.items()}
    return {"max_over_mean_load": max((s["max_over_mean"] for s in stats.values()), default=None),
            "dropped_fraction": max((s["dropped_fraction"] for s in stats.values()), default=None),
            "idle_experts": idle, "moe_load": per_layer}


def _train_step(run: TrainingRun, data: TokenBatches, step: int, flops_per_token: float, guard,
                stop: StopSignal | None = None) -> dict:
    """One optimizer step; `guard(where)` turns a failed collective into an error naming `where`.
    `metrics["stop"]`: whether `stop` was requested on any rank by the step's last all-reduce."""
    t = run.recipe.train
    start = time.perf_counter()
    lr = t.lr_at(step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    # Each context-parallel rank routes its share of the tokens: its aux losses count 1/cp.
    balancing.set_aux_loss_scale(1.0 / (microbatches_at(t, run.data_rank[1], step) * run.ps.cp.size))
    if run.ddp is not None:
        run.ddp.zero_grad()
    run.model.reset_load_stats()
    fp8_cache = cache_fp8_weights(run.model) if t.fp8 else contextlib.nullcontext()  # FP8: Q(W) once per step
    with guard("in the forward/backward pass"), fp8_cache:
        sums, tokens = _forward_backward(run, data, step)
    with guard("in the gradient reduction and loss check"):
        if run.ddp is not None:
            run.ddp.finish_grad_sync()
        bad_ranks, stop_requested = _nonfinite_ranks(run, sums, stop)
    # The step's host reads before the update: read after it, they made a GPU step's host wait for the
    # optimizer, and the next step's first kernels queue behind it instead.
    with guard("in the metrics reductions"):
        sums, tokens = _mean_over_replicas(run, sums, tokens)
        loads = _load_metrics(run)
    problem = None
    grad_norm = math.nan
    if bad_ranks:
        problem = f"the loss is not finite on rank(s) {', '.join(map(str, bad_ranks))}"
    else:
        with guard("in the optimizer step"):
            grad_norm = _optimizer_step(run)
        if not math.isfinite(grad_norm):
            problem = f"the gradient norm is {grad_norm}" + (" (over all ranks)" if run.ps.world_size > 1 else "")
    if run.ddp is None:
        run.optimizer.zero_grad(set_to_none=True)
    if problem is not None and t.on_nonfinite == "stop":
        raise FloatingPointError(f"step {step + 1}/{t.steps} (metrics step {step + 1}), rank {run.ps.rank}: {problem}. "
                                 "Stopping every rank (train.on_nonfinite=stop): lower train.lr, check the data, "
                                 "or set train.on_nonfinite=skip to skip such steps")
    with guard("in the balancing reductions"):
        if problem is None:
            run.model.update_expert_bias()
        else:  # no update of any kind: the expert bias keeps its value too
            for layer in run.model.moe_layers():
                layer.discard_pending_counts()
    elapsed = time.perf_counter() - start
    metrics = {"step": step, **sums, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": tokens / elapsed,
               "tflops": flops_per_token * tokens / elapsed / 1e12, **loads, "skipped": problem is not None,
               "stop": stop_requested}
    if problem is not None:
        metrics["nonfinite"] = problem
    if t.peak_tflops:
        metrics["mfu"] = metrics["tflops"] / (t.peak_tflops * run.ps.world_size)
    return metrics
