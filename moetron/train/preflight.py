"""Checks a run passes before any process group or model exists, identical on every rank, so that
a misconfiguration is one error (printed once, by rank 0) instead of one per rank after minutes:

1. the model splits evenly over the layout (`parallel.ep=3` does not divide 8 experts), whatever
   the process count; a pipeline layout string needs `parallel.pp > 1`;
2. the layout fits the process count (`WORLD_SIZE`), and the pipeline schedule fits
   `train.grad_accum` (its micro-batches);
3. the run fits in memory: parameters, gradients, optimizer state and activations per rank
   (model/size.py, model/activation_memory.py) against this machine's memory; a run that cannot
   fit is refused with the figure (`train.check_memory=false` skips this).
Messages name the user's fields (`train.grad_accum`, `parallel.ep`, `model.num_experts`).
"""

from __future__ import annotations

import os
import re

import torch

from moetron.config import Recipe
from moetron.model.activation_memory import layer_activation_bytes
from moetron.model.size import model_size
from moetron.parallel.config import validate_for_model
from moetron.pipeline.layout import parse_layout
from moetron.pipeline.schedules import build_schedule

__all__ = ["check_layout", "check_memory", "estimate_memory", "user_names"]

_PARALLEL = r"(tp|cp|ep|etp|pp|vpp|dp)="
_MODEL = r"(num_attention_heads|num_kv_heads|num_experts|moe_ffn_hidden_size|ffn_hidden_size|num_layers)="
_MODEL_FIELDS = {"moe_ffn_hidden_size": "moe_intermediate_size", "ffn_hidden_size": "intermediate_size"}


def user_names(message: str) -> str:
    """A layout message with the user's field names: `ep=3` -> `parallel.ep=3`, `microbatches=1` ->
    `train.grad_accum=1`, `num_experts=8` -> `model.num_experts=8`."""
    message = re.sub(r"(?<![.\w])" + _PARALLEL, r"parallel.\1=", message)
    message = re.sub(r"(?<![.\w])" + _MODEL, lambda m: f"model.{_MODEL_FIELDS.get(m[1], m[1])}=", message)
    message = re.sub(r"\bmicrobatches=", "train.grad_accum=", message)
    return message.replace("micro-batches >=", "train.grad_accum >=")


def check_layout(recipe: Recipe, world_size: int) -> None:
    """Every layout rule that needs only the recipe and the process count; ValueError naming fields."""
    c, p, t = recipe.model, recipe.parallel, recipe.train
    try:
        validate_for_model(p, num_attention_heads=c.num_attention_heads,
                           num_kv_heads=c.num_kv_heads if c.attention_type == "gqa" else None,
                           num_experts=c.num_experts, moe_ffn_hidden_size=c.moe_intermediate_size,
                           ffn_hidden_size=c.intermediate_size, num_layers=c.num_layers,
                           seq_length=t.seq_len, custom_pipeline_layout=True)
    except ValueError as exc:
        raise ValueError(user_names(str(exc))) from None
    if p.layout is not None and p.pp == 1:
        raise ValueError(f"parallel.layout={p.layout!r} is a pipeline layout string but parallel.pp=1: set "
                         "parallel.pp to the number of pipeline ranks, or drop parallel.layout")
    if world_size == 1 and any(getattr(p, k) != 1 for k in ("tp", "cp", "ep", "etp", "pp")):
        raise ValueError(f"recipe {recipe.name!r} asks for a parallel layout (tp={p.tp} cp={p.cp} ep={p.ep} "
                         f"etp={p.etp} pp={p.pp}) but runs in one process: launch it with "
                         f"`torchrun --nproc-per-node N -m moetron train ...`, or override the layout "
                         f"with --set parallel.ep=1 ...")
    try:
        p.resolve(world_size)
        if p.pp > 1:
            vpp = p.vpp if p.schedule == "interleaved" else None
            schedule = build_schedule(p.schedule, pp=p.pp, microbatches=t.grad_accum, vpp=vpp)
            if p.layout is not None:
                parse_layout(p.layout, num_layers=c.num_layers, mtp_layers=c.num_mtp_layers, pp=p.pp,
                             vpp=schedule.num_stages // p.pp)
    except ValueError as exc:
        raise ValueError(f"parallel layout on {world_size} process(es): {user_names(str(exc))}") from None


def estimate_memory(recipe: Recipe, world_size: int) -> dict[str, float]:
    """Bytes one rank needs, by part: parameters, gradients, optimizer, activations (a first-order
    estimate: experts split over ep*etp, the rest over tp, layers over pp, optimizer state over
    data parallel with ZeRO-1 (gradients too with ZeRO-2, parameters too with ZeRO-3, leaving out
    the transient buckets and gathered layers), `min(grad_accum, pp)` micro-batches in flight)."""
    c, p, t = recipe.model, recipe.parallel, recipe.train
    sizes = p.resolve(world_size) if world_size % (p.tp * p.cp * p.pp) == 0 else None
    dp, edp = (sizes.dp, sizes.edp) if sizes is not None else (1, 1)
    expert = 0
    for i in range(c.num_layers + c.num_mtp_layers):
        if c.is_moe_layer(i):
            expert += c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size
    dense = model_size(c).total - expert
    local_dense = dense / (p.tp * p.pp)
    local_expert = expert / (p.ep * p.etp * p.pp)
    local = local_dense + local_expert
    param_bytes = 2 if t.dtype == "bf16" else 4
    zero = p.distributed_optimizer and world_size > 1 or t.dtype == "bf16"
    state = 8 + (4 if t.dtype == "bf16" else 0)  # Adam moments (+ fp32 master weights)
    sharded = local_dense / dp + local_expert / edp
    optimizer = sharded * state if zero else local * state
    grads = sharded * 4 if p.zero >= 2 and world_size > 1 else local * 4  # ZeRO-2/3: this rank's shard
    params = sharded * 4 if p.zero == 3 and world_size > 1 else local * param_bytes  # FSDP2: fp32 shards
    seq = t.seq_len // p.cp
    per_microbatch = sum(layer_activation_bytes(c, i, t.micro_batch_size, seq,
                                                dtype=torch.bfloat16 if t.dtype == "bf16" else torch.float32).total
                         for i in range(c.num_layers)) / (p.tp * p.pp)
    logits = t.micro_batch_size * seq * c.vocab_size * 4 * 2 / p.tp  # logits and their softmax, fp32
    in_flight = min(t.grad_accum, p.pp) if p.pp > 1 else 1
    return {"parameters": params, "gradients": grads, "optimizer": optimizer,
            "activations": per_microbatch * in_flight + logits}


def _available_bytes(device: str) -> tuple[float, str] | None:
    """Memory one rank may use: its GPU's, or this machine's available RAM over the local ranks."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            return None
        index = int(os.environ.get("LOCAL_RANK", "0"))
        return float(torch.cuda.get_device_properties(index).total_memory), "GPU memory"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        total = info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError, IndexError):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    what = "available RAM" + (f" / {local} local ranks" if local > 1 else "")
    return total / max(local, 1), what


def check_memory(recipe: Recipe, world_size: int) -> dict[str, float]:
    """Refuse a run that cannot fit in this machine's memory; returns the estimate."""
    parts = estimate_memory(recipe, world_size)
    need = sum(parts.values())
    have = _available_bytes(recipe.train.device)
    if recipe.train.check_memory and have is not None and need > have[0]:
        detail = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in parts.items())
        raise ValueError(f"recipe {recipe.name!r} needs ~{need / 1e9:.1f} GB per rank ({detail} GB), this "
                          f"machine has {have[0] / 1e9:.1f} GB ({have[1]}); try `moetron plan`, a smaller recipe "
                          "(or --set model.num_layers=..., train.micro_batch_size=...), or more ranks "
                          "(parallel.ep / parallel.pp); train.check_memory=false skips this check")
    return parts
