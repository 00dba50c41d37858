"""The training loop: AdamW, warm-up + cosine, clipping, accumulation, balancing, metrics.

One process for now; parallel layouts arrive with the parallel runtime and are
refused with a clear message until then.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable

import torch

from moetron.model.model import MoETransformer
from moetron.model.size import model_size, training_flops_per_token
from moetron.moe import balancing
from moetron.recipes.recipe import Recipe
from moetron.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from moetron.train.data import BYTE_VOCAB, TokenBatches, stdlib_corpus


def _check_single_process(recipe: Recipe) -> None:
    p = recipe.parallel
    layout = {k: getattr(p, k) for k in ("tp", "cp", "ep", "etp", "pp", "vpp")}
    if any(v != 1 for v in layout.values()):
        raise NotImplementedError(
            f"recipe {recipe.name!r} asks for parallel layout {layout}; this trainer runs one process so far. "
            f"Override with --set parallel.tp=1 ... or use a tiny recipe.")


def build_optimizer(model: torch.nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    """AdamW; norms, biases and other 1-D parameters get no weight decay."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    t = recipe.train
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=tuple(t.betas))


def train(recipe: Recipe, log: Callable[[str], None] = print) -> list[dict]:
    """Run `recipe` and return the per-step metrics (also written to `train.metrics_file`)."""
    _check_single_process(recipe)
    t = recipe.train
    if recipe.model.vocab_size < BYTE_VOCAB and t.data == "builtin":
        raise ValueError(f"model.vocab_size={recipe.model.vocab_size}: the built-in byte data needs >= {BYTE_VOCAB}")
    torch.manual_seed(t.seed)
    model = MoETransformer(recipe.model)
    optimizer = build_optimizer(model, recipe)
    data = TokenBatches(stdlib_corpus(), t.seq_len, t.micro_batch_size, t.seed)
    size = model_size(recipe.model)
    flops_per_token = training_flops_per_token(recipe.model, t.seq_len)
    log(f"recipe {recipe.name}: {size.total / 1e6:.2f}M parameters ({size.active / 1e6:.2f}M active), "
        f"{t.steps} steps of {t.grad_accum}x{t.micro_batch_size}x{t.seq_len} tokens")
    start = 0
    if t.resume and latest_checkpoint(t.save_dir) is not None:
        folder = latest_checkpoint(t.save_dir)
        start = load_checkpoint(folder, model, optimizer)
        log(f"resumed from {folder} after step {start}")
    metrics_file = open(Path(t.metrics_file), "a" if start else "w") if t.metrics_file else None
    history = []
    try:
        model.train()
        for step in range(start, t.steps):
            history.append(_train_step(model, optimizer, data, recipe, step, flops_per_token))
            m = history[-1]
            if metrics_file:
                metrics_file.write(json.dumps(m) + "\n")
                metrics_file.flush()
            if step % t.log_every == 0 or step == t.steps - 1:
                log(_format(m, t.steps))
            done = step + 1
            if t.save_dir and ((t.save_every and done % t.save_every == 0) or done == t.steps):
                log(f"saved {save_checkpoint(t.save_dir, done, model, optimizer, recipe)}")
    finally:
        if metrics_file:
            metrics_file.close()
    return history


def _train_step(model, optimizer, data, recipe: Recipe, step: int, flops_per_token: float) -> dict:
    t = recipe.train
    start = time.perf_counter()
    lr = t.lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    balancing.set_aux_loss_scale(1.0 / t.grad_accum)
    sums: dict[str, float] = {}
    tokens = 0
    for micro in range(t.grad_accum):
        inputs, labels = data.batch(step, micro)
        out = model(inputs, labels=labels)
        (out.total_loss / t.grad_accum).backward()
        tokens += out.num_tokens
        parts = {"loss": out.total_loss, "lm_loss": out.loss, "mtp_loss": out.mtp_loss, **out.aux_losses}
        for name, value in parts.items():
            if value is not None:
                sums[name] = sums.get(name, 0.0) + float(value.detach()) / t.grad_accum
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip))
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"step {step}: gradient norm is {grad_norm}; lower train.lr or check the data")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.update_expert_bias()
    elapsed = time.perf_counter() - start
    loads = [s["max_over_mean"] for s in model.load_stats().values() if s]
    metrics = {"step": step, **sums, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": tokens / elapsed,
               "tflops": flops_per_token * tokens / elapsed / 1e12,
               "max_over_mean_load": max(loads) if loads else None}
    if t.peak_tflops:
        metrics["mfu"] = metrics["tflops"] / t.peak_tflops
    return metrics


def _format(m: dict, steps: int) -> str:
    parts = [f"step {m['step'] + 1:>4}/{steps}", f"loss {m['loss']:.4f}", f"lm {m['lm_loss']:.4f}"]
    if "mtp_loss" in m:
        parts.append(f"mtp {m['mtp_loss']:.4f}")
    parts += [f"gnorm {m['grad_norm']:.2f}", f"lr {m['lr']:.2e}", f"{m['tokens_per_s']:.0f} tok/s"]
    if m.get("max_over_mean_load"):
        parts.append(f"load max/mean {m['max_over_mean_load']:.2f}")
    return " | ".join(parts)
