"""ZeRO-1 distributed AdamW: each data-parallel rank owns a shard of the fp32 master weights.

    ddp = DataParallel(model, ps, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)
    opt.zero_grad()
    ... forward / backward (micro-batches with ddp.no_sync()) ...
    for group in opt.param_groups:
        group["lr"] = schedule(step)
    grad_norm = opt.step()          # finish reduce-scatter, clip, AdamW on the shard, all-gather

Design notes: docs/parallel.md (`moetron/optim/distributed.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from moetron.parallel.data_parallel import (
    DataParallel, GradBuffer, ParamSlot, all_reduce_sum, counts_in_norm, sum_of_squares,
)

SLOTS = ("master", "exp_avg", "exp_avg_sq")
HYPER = ("lr", "betas", "eps", "weight_decay", "step")


@dataclass(eq=False)
class _Piece:
    """The part [lo, hi) of a flattened parameter that this rank owns, at flat[flat_lo:...]."""

    slot: ParamSlot
    shard: _Shard
    lo: int
    hi: int
    flat_lo: int
    group: int = -1
    bucket: object = None  # the data_parallel.Bucket whose shard range holds the piece

    @property
    def flat(self) -> slice:
        return slice(self.flat_lo, self.flat_lo + self.hi - self.lo)


class _Shard:
    """This rank's slices of one buffer: buffer ranges, and fp32 master / moments for them."""

    def __init__(self, buffer: GradBuffer):
        self.buffer = buffer
        self.ranges: list[tuple[int, int, int]] = []  # (buffer lo, buffer hi, flat lo)
        self.pieces: list[_Piece] = []
        flat = 0
        for bucket in buffer.buckets:
            lo, hi = bucket.shard_range()
            self.ranges.append((lo, hi, flat))
            for slot in bucket.slots:
                a, b = max(lo, slot.start), min(hi, slot.end)
                if a < b:
                    self.pieces.append(_Piece(slot, self, a - slot.start, b - slot.start,
                                              flat + a - lo, bucket=bucket))
            flat += hi - lo
        self.numel = flat
        self.master = torch.cat([buffer.param_data[lo:hi] for lo, hi, _ in self.ranges]).float()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)

    def gather_grads(self) -> torch.Tensor:
        """This rank's reduced gradient slices as one fp32 tensor: a view of the buffer when they are one
        run of it in fp32 (one data-parallel rank; a copy of the gradients costs a pass over them), else
        a new tensor. The foreach path clips a copy; the fused kernel clips inside and may leave the clipped
        gradients in the buffer (the next zero_grad() and backward replace them)."""
        if (self.buffer.grad_dtype == torch.float32 and not getattr(self.buffer, "sharded", False)
                and all(hi == lo for (_, hi, _), (lo, _, _) in zip(self.ranges, self.ranges[1:]))):
            return self.buffer.shard_grad(self.ranges[0][0], self.ranges[-1][1])
        return torch.cat([self.buffer.shard_grad(lo, hi) for lo, hi, _ in self.ranges]).float()

    def write_params(self, bucket=None) -> None:
        """Copy the master slices (of `bucket` only, when given) into this rank's part of the
        parameter buffer."""
        for b, (lo, hi, flat) in zip(self.buffer.buckets, self.ranges):
            if bucket is None or b is bucket:
                self.buffer.param_data[lo:hi].copy_(self.master[flat:flat + hi - lo])


class DistributedOptimizer:
    """AdamW with ZeRO-1 sharding over the DP groups of a `DataParallel(use_distributed_optimizer=True)`.

    param_groups: like torch's, a list of dicts with "params" and optional "lr", "betas", "eps",
    "weight_decay"; every parameter of `ddp` must be in exactly one. Default: two groups, the
    >= 2-D parameters with `weight_decay` and (with no_decay_1d) the 1-D ones (norms, biases)
    without. `self.param_groups[i]["lr"]` may be changed between steps.
    max_grad_norm: clip by the global norm (None: only report it).
    overlap_param_gather_with_optimizer_step: update bucket by bucket, in forward order, and
        launch each bucket's all-gather as soon as its shard is updated, so the gathers overlap
        the rest of the step (needs `ddp.overlap_param_gather`; the same numbers).
    """

    def __init__(self, ddp: DataParallel, param_groups: Sequence[Mapping] | None = None, *,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, no_decay_1d: bool = True,
                 max_grad_norm: float | None = None, overlap_param_gather_with_optimizer_step: bool = False):
        if not isinstance(ddp, DataParallel) or not ddp.use_distributed_optimizer:
            raise ValueError("DistributedOptimizer needs DataParallel(..., use_distributed_optimizer=True): "
                             "the parameters must live in its contiguous buffers")
        if overlap_param_gather_with_optimizer_step and not ddp.overlap_param_gather:
            raise ValueError("overlap_param_gather_with_optimizer_step=True needs "
                             "DataParallel(..., overlap_param_gather=True)")
        self.overlap_with_step = overlap_param_gather_with_optimizer_step
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r} must be > 0 (or None for no clipping)")
        self.ddp, self.max_grad_norm = ddp, max_grad_norm
        self.names = {id(p): n for n, p in ddp.named_parameters()}
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        if param_groups is None:
            params = [p for _, p in ddp.named_parameters()]
            if no_decay_1d:
                param_groups = [{"params": [p for p in params if p.dim() >= 2]},
                                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
            else:
                param_groups = [{"params": params}]
        self.param_groups = [self._make_group(g, defaults) for g in param_groups]
        group_of = self._check_groups()
        self.shards = [_Shard(buf) for buf in ddp.buffers]
        for shard in self.shards:
            for piece in shard.pieces:
                piece.group = group_of[id(piece.slot.param)]
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False

    def _make_group(self, group: Mapping, defaults: dict) -> dict:
        unknown = set(group) - {"params", *defaults}
        if unknown:
            raise ValueError(f"param group keys {sorted(unknown)} are not supported; "
                             f"use params, {', '.join(defaults)}")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        out = {**defaults, **{k: v for k, v in group.items() if k != "params"}, "params": params, "step": 0}
        out["betas"] = tuple(out["betas"])
        return out

    def _check_groups(self) -> dict[int, int]:
        group_of: dict[int, int] = {}
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                if id(p) not in self.names:
                    raise ValueError(f"param group {i} holds a parameter (shape {tuple(p.shape)}) that "
                                     "DataParallel does not manage (not in the module, or no grad)")
                if id(p) in group_of:
                    raise ValueError(f"parameter {self.names[id(p)]!r} is in param groups "
                                     f"{group_of[id(p)]} and {i}; put it in one")
                group_of[id(p)] = i
        missing = [n for pid, n in self.names.items() if pid not in group_of]
        if missing:
            raise ValueError(f"parameters {missing[:5]}{'...' if len(missing) > 5 else ''} are in no "
                             "param group; every parameter of the DataParallel needs one")
        return group_of

    # --- the step -----------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradient buffers (set_to_none is accepted for torch compatibility, ignored)."""
        self.ddp.zero_grad()

    @torch.no_grad()
    def step(self) -> float:
        """Finish the gradient reduce-scatter, clip, update this rank's shard, all-gather.

        Returns the global gradient norm (before clipping). Collective over the world.
        """
        self.ddp.finish_param_sync()
        self.ddp.finish_grad_sync()
        grads = [shard.gather_grads() for shard in self.shards]
        norm = self._global_norm(grads)
        self.last_grad_norm = float(norm)
        self.last_step_skipped = not math.isfinite(self.last_grad_norm)
        if self.last_step_skipped:
            return self.last_grad_norm
        fused = _fused_adamw_runs(self.shards[0].master)
        unscale = None  # the fused kernel divides the gradients by it: clipping without a pass of its own
        if self.max_grad_norm is not None:
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)  # as torch's clip_grad_norm_
            if fused:
                unscale = (1.0 / coef).float().reshape(())
            else:  # out of place: `grads` may be views of the gradient buffer
                grads = [g * coef for g in grads]
        for group in self.param_groups:
            group["step"] += 1
        if self.overlap_with_step:  # forward order, each bucket's gather right after its update
            self.ddp.finish_param_sync()
            for bucket in reversed(self.ddp.buckets):
                self._update(grads, fused, unscale, bucket)
                for shard in self.shards:
                    if shard.buffer is bucket.buffer:
                        shard.write_params(bucket)
                self.ddp.start_bucket_param_sync(bucket)
            return self.last_grad_norm
        self._update(grads, fused, unscale)
        for shard in self.shards:
            shard.write_params()
        self.ddp.start_param_sync()
        return self.last_grad_norm

    def _update(self, grads, fused: bool, unscale, bucket=None) -> None:
        """AdamW on every piece (of `bucket` only, when given), one call per param group."""
        for i, group in enumerate(self.param_groups):
            pieces = [(piece, g) for shard, g in zip(self.shards, grads) for piece in shard.pieces
                      if piece.group == i and (bucket is None or piece.bucket is bucket)]
            if pieces:
                self._adamw(group, pieces, fused, unscale)

    def _global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        ps = self.ddp.parallel_state
        counted = [g[piece.flat] for shard, g in zip(self.shards, grads) for piece in shard.pieces
                   if counts_in_norm(piece.slot.param, ps, piece.slot.expert)]
        sq = sum_of_squares(counted, self.shards[0].master.device)
        all_reduce_sum(sq, ps.world)
        return sq.sqrt()

    @staticmethod
    def _adamw(group: dict, pieces: list[tuple[_Piece, torch.Tensor]], fused: bool = False,
               unscale: torch.Tensor | None = None) -> None:
        """torch.optim.AdamW's update on lists of shard views: one fused kernel per list on a GPU
        (torch's own `fused=True` kernel), the foreach ops of torch's default path elsewhere."""
        lr, (beta1, beta2), eps, wd, step = (group[k] for k in HYPER)
        params = [p.shard.master[p.flat] for p, _ in pieces]
        grads = [g[p.flat] for p, g in pieces]
        exp_avgs = [p.shard.exp_avg[p.flat] for p, _ in pieces]
        exp_avg_sqs = [p.shard.exp_avg_sq[p.flat] for p, _ in pieces]
        if fused:  # seven foreach passes over the fp32 shard were a third of a step on an H100
            # a fill on the device: torch.tensor(..., device=cuda) copies from the host and waits for the stream
            steps = [torch.full((), float(step), device=params[0].device)] * len(params)
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=wd, eps=eps, amsgrad=False, maximize=False, grad_scale=unscale)
            return
        if wd != 0:
            torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)

    # --- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard: hyper-parameters and, per parameter name, its piece (tensors cloned)."""
        self.ddp.finish_param_sync()
        groups = [{**{k: g[k] for k in HYPER}, "betas": list(g["betas"]),
                   "params": [self.names[id(p)] for p in g["params"]]} for g in self.param_groups]
        pieces = {}
        for shard in self.shards:
            for piece in shard.pieces:
                p = piece.slot.param
                pieces[piece.slot.name] = {
                    "shape": list(p.shape), "offset": piece.lo, "numel": piece.hi - piece.lo,
                    **{k: getattr(shard, k)[piece.flat].clone() for k in SLOTS}}
        return {"param_groups": groups, "pieces": pieces}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping | Iterable[Mapping]) -> None:
        """Restore from one state dict or several (e.g. every rank's, from another DP size).

        Also copies the master weights into the model parameters (all-gather: collective).
        """
        states = [state] if isinstance(state, Mapping) else list(state)
        if not states:
            raise ValueError("load_state_dict: no state dict given")
        for st in states:
            if not isinstance(st, Mapping) or not {"param_groups", "pieces"} <= set(st):
                raise ValueError("load_state_dict expects DistributedOptimizer.state_dict() output: a "
                                 "dict with 'param_groups' and 'pieces' (or a list of them)")
        saved_groups = states[0]["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(saved_groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}")
        for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            mine = sorted(self.names[id(p)] for p in group["params"])
            if sorted(saved["params"]) != mine:
                diff = sorted(set(mine) ^ set(saved["params"]))
                raise ValueError(f"param group {i} of the state dict holds other parameters than this "
                                 f"optimizer's (they differ in {diff[:5]})")
        by_name: dict[str, list[dict]] = {}
        for st in states:
            for name, piece in st["pieces"].items():
                if name not in self.names.values():
                    raise ValueError(f"state dict piece {name!r} names no parameter of this model")
                by_name.setdefault(name, []).append(piece)
        new = {id(shard): {k: getattr(shard, k).clone() for k in SLOTS} for shard in self.shards}
        for shard in self.shards:
            for piece in shard.pieces:
                self._fill(piece, by_name.get(piece.slot.name, []), new[id(shard)])
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: saved[k] for k in HYPER})
            group["betas"] = tuple(group["betas"])
        self.ddp.finish_param_sync()
        for shard in self.shards:
            for k in SLOTS:
                getattr(shard, k).copy_(new[id(shard)][k])
            shard.write_params()
        self.ddp.start_param_sync()
        self.ddp.finish_param_sync()

    @staticmethod
    def _fill(piece: _Piece, saved: list[dict], out: dict[str, torch.Tensor]) -> None:
        name, shape = piece.slot.name, list(piece.slot.param.shape)
        covered = torch.zeros(piece.hi - piece.lo, dtype=torch.bool)
        for s in saved:
            if list(s["shape"]) != shape:
                raise ValueError(f"state dict piece of {name!r} is for shape {list(s['shape'])}, the "
                                 f"parameter here has shape {shape} (another TP/EP layout?)")
            lo, n = int(s["offset"]), int(s["numel"])
            a, b = max(lo, piece.lo), min(lo + n, piece.hi)
            if a >= b:
                continue
            for k in SLOTS:
                if s[k].numel() != n:
                    raise ValueError(f"state dict piece {name!r}[{lo}:{lo + n}] has a {k} of "
                                     f"{s[k].numel()} elements")
                out[k][piece.flat][a - piece.lo:b - piece.lo] = s[k][a - lo:b - lo]
            covered[a - piece.lo:b - piece.lo] = True
        if not covered.all():
            gap = int((~covered).nonzero()[0]) + piece.lo
            raise ValueError(f"state dict lacks {name!r} element {gap} (this rank owns "
                             f"[{piece.lo}:{piece.hi}] of it); pass the state dicts of every rank")


def _fused_adamw_runs(master: torch.Tensor) -> bool:
    """torch's fused AdamW kernel for shards on a GPU; the foreach reference elsewhere (the CPU
    path stays bit-identical to torch.optim.AdamW's default)."""
    return master.is_cuda and hasattr(torch, "_fused_adamw_")
