"""FP8 parameter all-gather (Megatron's --fp8-param-gather): after a ZeRO-1 step each rank quantizes its
shard of every FP8 weight as the forward would, and the bucket's all-gather carries FP8 bytes (one byte an
element) plus the other parameters' own bytes; the forward then uses the gathered FP8 weights as they are.

    ddp = DataParallel(model, ps, use_distributed_optimizer=True)
    enable_fp8_param_gather(ddp)       # after apply_fp8; raises where it cannot take effect

Scales: one amax per scaling block (the tensor, an expert, a 128x128 block) from the shards, MAX-reduced over
the bucket's data-parallel group and, for per-tensor scales, the tensor-parallel ranks that share the
weight's scale (a few floats per weight). Design notes: docs/fp8.md ("FP8 parameter all-gather").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetron.parallel import data_parallel as dp_module
from moetron.precision.fp8 import E4M3, ROLES, TILE, Quantized, cast_with_scale, delayed_scale, scale_from_amax
from moetron.precision.fp8_modules import HISTORY, FP8GroupedExperts, fp8_modules, set_gathered_weight

SCALINGS = ("tensorwise", "delayed", "blockwise")


@dataclass
class _Weight:
    """One FP8 weight of a bucket: its module, its blocks' slice of the bucket's amax vector."""

    slot: object  # data_parallel.ParamSlot
    module: torch.nn.Module
    which: int  # FP8GroupedExperts: 0 gate_up, 1 down (halves of the history's G axis)
    block_lo: int
    num_blocks: int

    def blocks(self, a: int, b: int) -> torch.Tensor:
        """Block index (within this weight) of each flat element in [a, b)."""
        shape, device = self.slot.param.shape, self.slot.param.device
        idx = torch.arange(a, b, device=device)
        if self.module.fp8_recipe.scaling != "blockwise":  # one per tensor, one per expert
            return idx // (shape[-2] * shape[-1]) if len(shape) == 3 else torch.zeros_like(idx)
        O, K = shape[-2:]
        nr, nc = -(-O // TILE), -(-K // TILE)
        inner = idx % (O * K)
        block = (inner // K // TILE) * nc + (inner % K) // TILE
        return block + (idx // (O * K)) * (nr * nc) if len(shape) == 3 else block

    def quantized(self, data: torch.Tensor, scale_blocks: torch.Tensor) -> Quantized:
        """The Quantized the forward's quantize_operand(weight) would build from these bytes and scales."""
        shape = self.slot.param.shape
        if self.module.fp8_recipe.scaling != "blockwise":
            return Quantized(data, scale_blocks.reshape(-1, 1, 1) if len(shape) == 3 else scale_blocks.reshape(1, 1))
        O, K = shape[-2:]
        nr, nc = -(-O // TILE), -(-K // TILE)
        rows = torch.arange(O, device=data.device) // TILE
        cols = torch.arange(K, device=data.device) // TILE
        return Quantized(data, scale_blocks.reshape(*shape[:-2], nr, nc), rows, cols)

    def scales(self, amax: torch.Tensor) -> torch.Tensor:
        recipe = self.module.fp8_recipe
        if recipe.scaling != "delayed":
            return scale_from_amax(amax, E4M3, 0, recipe.power_of_two_scales)
        history = getattr(self.module, HISTORY)[ROLES.index("weight")]
        if isinstance(self.module, FP8GroupedExperts):
            n = self.module.num_local_experts
            history = history.narrow(1, self.which * n, n)
        return delayed_scale(history, amax, recipe, E4M3)  # the weight's history update of the next forward


def _num_blocks(shape, recipe) -> int:
    lead = shape[0] if len(shape) == 3 else 1
    if recipe.scaling != "blockwise":
        return lead
    return lead * -(-shape[-2] // TILE) * -(-shape[-1] // TILE)


class _Plan:
    """Per bucket: which elements each rank sends as FP8 and which in the parameters' dtype."""

    def __init__(self, bucket, weights: dict[int, _Weight]):
        self.bucket = bucket
        group = bucket.buffer.group
        self.itemsize = bucket.buffer.param_data.element_size()
        self.pieces = []  # per rank: [(slot, a, b, weight or None, byte offset)]
        sizes = []
        for r in range(group.size):
            lo, hi = bucket.shard_range(r)
            hp, fp8 = [], []
            for slot in bucket.slots:
                a, b = max(lo, slot.start) - slot.start, min(hi, slot.end) - slot.start
                if a < b:
                    (fp8 if id(slot) in weights else hp).append((slot, a, b, weights.get(id(slot))))
            pieces, offset = [], 0
            for slot, a, b, w in hp:  # high-precision pieces first: their views stay aligned
                pieces.append((slot, a, b, None, offset))
                offset += (b - a) * self.itemsize
            for slot, a, b, w in fp8:
                pieces.append((slot, a, b, w, offset))
                offset += b - a
            self.pieces.append(pieces)
            sizes.append(offset)
        self.payload = -(-max(sizes) // 8) * 8
        self.weights = [w for w in weights.values() if w.slot.bucket is bucket]
        self.num_blocks = sum(w.num_blocks for w in self.weights)
        # per-tensor scales span the TP shards (the forward reduces them over TP); block scales are local
        self.whole_tensor_scales = self.weights[0].module.fp8_recipe.scaling != "blockwise" if self.weights else False


class FP8ParamGather:
    """`DataParallel.param_gather_hook`: start one bucket's FP8 all-gather; returns a waitable."""

    def __init__(self, ddp):
        self.ddp = ddp
        ps = ddp.parallel_state
        by_param = {}
        for module in fp8_modules(ddp.module).values():
            names = ("gate_up_proj", "down_proj") if isinstance(module, FP8GroupedExperts) else ("weight",)
            for which, name in enumerate(names):
                by_param[id(getattr(module, name))] = (module, which)
        self.weights: dict[int, _Weight] = {}
        offsets: dict[int, int] = {}
        for slot in ddp.slots:
            hit = by_param.get(id(slot.param))
            if hit is None:
                continue
            module, which = hit
            n = _num_blocks(slot.param.shape, module.fp8_recipe)
            lo = offsets.get(id(slot.bucket), 0)
            offsets[id(slot.bucket)] = lo + n
            self.weights[id(slot)] = _Weight(slot, module, which, lo, n)
        self.plans = {id(b): _Plan(b, self.weights) for b in ddp.buckets
                      if b.buffer.group.size > 1 and any(w.slot.bucket is b for w in self.weights.values())}
        self.scale_groups = {False: ps.tp, True: ps.etp}  # dense / expert buffers
        self.bytes_sent = 0  # this rank's all-gather input bytes so far (benchmarks, tests)

    def __call__(self, bucket):
        plan = self.plans.get(id(bucket))
        if plan is None:  # no FP8 weight in this bucket: the ordinary all-gather
            lo, hi = bucket.shard_range()
            own = bucket.buffer.param_data[lo:hi].clone()
            return dp_module._all_gather(bucket.buffer.param_data[bucket.start:bucket.end], own,
                                         bucket.buffer.group.handle)
        return _Gather(self, plan)


class _Gather:
    """Quantize this rank's shard, launch the all-gather; `wait()` decodes every rank's bytes."""

    def __init__(self, owner: FP8ParamGather, plan: _Plan):
        self.plan = plan
        bucket, data = plan.bucket, plan.bucket.buffer.param_data
        group = bucket.buffer.group
        mine = plan.pieces[group.rank]
        amax = torch.zeros(plan.num_blocks, dtype=torch.float32, device=data.device)
        for slot, a, b, w, _ in mine:
            if w is not None:
                x = data[slot.start + a:slot.start + b].detach().abs().float()
                amax.scatter_reduce_(0, w.block_lo + w.blocks(a, b), x, "amax")
        groups = [group] + ([owner.scale_groups[bucket.buffer.expert]] if plan.whole_tensor_scales else [])
        for g in groups:
            if g.size > 1:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=g.handle)
        self.scales = {id(w): w.scales(amax[w.block_lo:w.block_lo + w.num_blocks]) for w in plan.weights}
        payload = torch.zeros(plan.payload, dtype=torch.uint8, device=data.device)
        for slot, a, b, w, off in mine:
            x = data[slot.start + a:slot.start + b]
            if w is None:
                payload[off:off + (b - a) * plan.itemsize] = x.contiguous().view(torch.uint8)
            else:
                q = cast_with_scale(x, self.scales[id(w)][w.blocks(a, b)], E4M3)
                payload[off:off + b - a] = q.view(torch.uint8)
        self.out = payload.new_empty(group.size * plan.payload)
        owner.bytes_sent += payload.numel()
        self.work = dp_module._all_gather(self.out, payload, group.handle)

    def wait(self) -> None:
        self.work.wait()
        plan = self.plan
        data = plan.bucket.buffer.param_data
        fp8 = {id(w): torch.empty(w.slot.param.numel(), dtype=E4M3, device=data.device) for w in plan.weights}
        with torch.no_grad():
            for r, pieces in enumerate(plan.pieces):
                raw = self.out[r * plan.payload:(r + 1) * plan.payload]
                for slot, a, b, w, off in pieces:
                    dst = data[slot.start + a:slot.start + b]
                    if w is None:
                        dst.copy_(raw[off:off + (b - a) * plan.itemsize].view(data.dtype))
                        continue
                    q = raw[off:off + b - a].view(E4M3)
                    fp8[id(w)][a:b] = q
                    dst.copy_(q.float() * self.scales[id(w)][w.blocks(a, b)])
        for w in plan.weights:  # after every write: the cache is valid for this parameter version
            param = w.slot.param
            set_gathered_weight(w.module, param, w.quantized(fp8[id(w)].view(param.shape), self.scales[id(w)]))


def enable_fp8_param_gather(ddp) -> FP8ParamGather:
    """Make `ddp`'s ZeRO-1 parameter all-gather send FP8 weights; errors name the fix where it cannot."""
    if not ddp.use_distributed_optimizer:
        raise ValueError("train.fp8_param_gather=true needs parallel.distributed_optimizer=true: only the "
                         "distributed optimizer all-gathers parameters")
    modules = fp8_modules(ddp.module)
    if not modules:
        raise ValueError("train.fp8_param_gather=true: the model has no FP8 weights (set train.fp8)")
    for name, m in modules.items():
        if m.fp8_recipe.scaling not in SCALINGS:
            raise ValueError(f"train.fp8_param_gather=true with train.fp8={m.fp8_recipe.scaling}: supported for "
                             f"{', '.join(SCALINGS)}; set train.fp8_param_gather=false")
        if m.fp8_backend == "te":
            raise ValueError(f"train.fp8_param_gather=true: module {name!r} runs on Transformer Engine, which "
                             "quantizes its own weights; set train.fp8_backend=emulate or torch, or "
                             "train.fp8_param_gather=false")
    gather = FP8ParamGather(ddp)
    if not gather.plans:
        raise ValueError("train.fp8_param_gather=true: no FP8 weight is sharded by the distributed optimizer here "
                         "(data-parallel size 1: nothing is all-gathered); use more data-parallel ranks or "
                         "train.fp8_param_gather=false")
    ddp.param_gather_hook = gather
    return gather


__all__ = ["FP8ParamGather", "enable_fp8_param_gather"]
