"""Data parallel: gradients in contiguous buffers, reduced bucket by bucket during backward.

    ddp = DataParallel(model, ps)                  # all-reduce; any optimizer, e.g. torch AdamW
    ddp.zero_grad()
    for i, (x, y) in enumerate(micro_batches):     # accumulation: communicate on the last only
        with ddp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (model(x, labels=y).total_loss / len(micro_batches)).backward()
    ddp.finish_grad_sync()                         # p.grad: mean over the DP ranks
    optimizer.step()

Design notes: docs/parallel.md (`moetron/parallel/data_parallel.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from moetron.parallel.gather_waits import GatherWaits
from moetron.parallel.grad_norm import all_reduce_sum, counts_in_norm, sum_of_squares
from moetron.parallel.state import Group, ParallelState

__all__ = ["DataParallel", "GradBuffer", "Bucket", "ParamSlot", "all_reduce_sum", "counts_in_norm",
           "sum_of_squares", "default_bucket_size", "is_expert_param", "PAD_ALIGN"]

PAD_ALIGN = 64  # elements; distributed-optimizer shards start on multiples of this


def default_bucket_size(dp_size: int) -> int:
    """Elements per bucket: large enough to use the bandwidth, scaled with DP (Megatron's rule)."""
    return max(40_000_000, dp_size * 1_000_000)


def is_expert_param(module: nn.Module, param: nn.Parameter) -> bool:
    """Whether `param` reduces over the expert-data group: experts tag their weights
    `expert_parallel=True` (GroupedExperts.mark_expert_parallel)."""
    return bool(getattr(param, "expert_parallel", False))


# The collectives, looked up at call time (torch 2.13 renamed the single-tensor ones).
def _all_reduce(t: torch.Tensor, handle) -> dist.Work:
    return dist.all_reduce(t, group=handle, async_op=True)


def _reduce_scatter(out: torch.Tensor, t: torch.Tensor, handle) -> dist.Work:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, t, group=handle, async_op=True)


def _all_gather(out: torch.Tensor, t: torch.Tensor, handle) -> dist.Work:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, t, group=handle, async_op=True)


@dataclass(eq=False)
class ParamSlot:
    """Where one parameter's gradient (and, with ZeRO, its value) lives: buffer[start:end]."""

    name: str
    param: nn.Parameter
    order: int  # position in registration order
    start: int
    end: int
    expert: bool
    bucket: Bucket | None = None
    grad_view: torch.Tensor | None = None  # shaped like the parameter
    main_grad_only: bool = False  # grad dtype != param dtype: .grad is added into main_grad
    late: bool = False  # pipeline_shared: final only after the PP sum, launched by finish_grad_sync


@dataclass(eq=False)
class Bucket:
    """A contiguous range [start, end) of one buffer, reduced by one collective."""

    buffer: GradBuffer
    slots: list[ParamSlot]
    start: int
    end: int  # padded
    ready: set = field(default_factory=set)
    launched: bool = False
    work: dist.Work | None = None
    reduced_shard: torch.Tensor | None = None
    gather_work: dist.Work | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, rank: int | None = None) -> tuple[int, int]:
        """Buffer range owned by group rank `rank` (this rank by default) under ZeRO."""
        group = self.buffer.group
        rank = group.rank if rank is None else rank
        size = self.numel // group.size
        return self.start + rank * size, self.start + (rank + 1) * size

    @property
    def grad(self) -> torch.Tensor:
        return self.buffer.grad_data[self.start:self.end]


class GradBuffer:
    """Gradients (and with ZeRO the parameters) of one (device, dtype, group) set, contiguous."""

    def __init__(self, group: Group, expert: bool, slots: list[ParamSlot], bucket_size: int,
                 pad_multiple: int, grad_dtype: torch.dtype, with_param_data: bool):
        self.group, self.expert = group, expert
        first = slots[0].param
        self.param_dtype, self.grad_dtype, self.device = first.dtype, grad_dtype, first.device
        self.slots = slots  # reverse registration order
        self.buckets: list[Bucket] = []
        offset = bucket_start = 0
        current: list[ParamSlot] = []

        def close() -> None:
            nonlocal offset, bucket_start, current
            offset = -(-offset // pad_multiple) * pad_multiple
            bucket = Bucket(self, current, bucket_start, offset)
            for s in current:
                s.bucket = bucket
            self.buckets.append(bucket)
            bucket_start, current = offset, []

        for slot in slots:
            n = slot.param.numel()
            slot.start, slot.end = offset, offset + n
            offset += n
            current.append(slot)
            if offset - bucket_start >= bucket_size:
                close()
        if current:
            close()
        self.numel = offset
        self.param_data = None
        if with_param_data:
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=self.device)
        with torch.no_grad():
            for s in slots:
                p = s.param
                s.main_grad_only = grad_dtype != p.dtype
                if self.param_data is not None:
                    view = self.param_data[s.start:s.end].view(p.shape)
                    view.copy_(p.data)
                    p.data = view
        self._allocate_grads()

    def _allocate_grads(self) -> None:  # the full buffer, .grad/.main_grad views of it (ZeRO-2: parallel/zero.py)
        self.grad_data = torch.zeros(self.numel, dtype=self.grad_dtype, device=self.device)
        for s in self.slots:
            s.grad_view = self.grad_data[s.start:s.end].view(s.param.shape)
            s.param.main_grad = s.grad_view
            s.param.grad = None if s.main_grad_only else s.grad_view

    def shard_grad(self, lo: int, hi: int) -> torch.Tensor:  # reduced gradients of [lo, hi) in this rank's shard
        return self.grad_data[lo:hi]

    def __repr__(self) -> str:
        kind = "expert" if self.expert else "dense"
        return (f"GradBuffer({kind}, group={self.group.name}[{self.group.size}], {self.param_dtype}/"
                f"{self.grad_dtype}, {self.numel} elements, {len(self.buckets)} buckets)")


class DataParallel(GatherWaits):
    """Gradient buffers, bucketed overlapped reduction and parameter all-gather for `module`.

    Not an nn.Module wrapper: the model is called as before (so state-dict keys and the layer
    stages a pipeline schedule calls are unchanged); `ddp(...)` is a shortcut for `module(...)`.
    Build it after the model is on its device and dtype: parameters become views into buffers
    (grads always, values with `use_distributed_optimizer`), and `.to()` afterwards breaks that.

    bucket_size: elements per bucket (default `default_bucket_size(ps.dp_cp.size)`).
    use_distributed_optimizer: reduce-scatter buckets (each rank keeps its shard, reduced) and
        keep parameters in buffers for `DistributedOptimizer`; otherwise all-reduce.
    grad_dtype: dtype of the gradient buffers (default: each parameter's own dtype).
    average: divide by ps.dp.size (mean over DP replicas; see the module doc) or just sum.
    overlap_grad_reduce: launch buckets during backward (False: all at finish_grad_sync). Under a
        pipeline schedule the executor marks, action by action, which gradients are final
        (`final_gradients`), so each chunk's buckets launch during its last backward; parameters
        tagged `pipeline_shared` (held by several PP ranks, summed over them after the schedule)
        get buckets of their own, launched by finish_grad_sync.
    overlap_param_gather: after an optimizer step the all-gathers are only launched; each module
        waits for the buckets of its own parameters in a forward pre-hook, so a bucket's gather
        overlaps the compute of the layers before it. Parameters must then be read during a
        forward of `module` (the first forward learns which modules run; see
        `_register_gather_waits`); anything else (pipeline stage methods called directly,
        reading weights for a checkpoint) must call `finish_param_sync()` first.
    """

    buffer_class = GradBuffer  # ZeRO-2 (parallel/zero.py): gradients kept as a shard

    def __init__(self, module: nn.Module, parallel_state: ParallelState | None = None, *,
                 bucket_size: int | None = None, use_distributed_optimizer: bool = False,
                 grad_dtype: torch.dtype | None = None, average: bool = True,
                 overlap_grad_reduce: bool = True, overlap_param_gather: bool = False):
        ps = parallel_state or ParallelState.single()
        if bucket_size is None:
            bucket_size = default_bucket_size(ps.dp_cp.size)
        if not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"bucket_size={bucket_size!r} must be a positive number of elements")
        if overlap_param_gather and not use_distributed_optimizer:
            raise ValueError("overlap_param_gather=True needs use_distributed_optimizer=True: "
                             "only the distributed optimizer all-gathers parameters")
        self.module, self.parallel_state = module, ps
        self.bucket_size = bucket_size
        self.use_distributed_optimizer = use_distributed_optimizer
        self.average, self.overlap_grad_reduce, self.overlap_param_gather = average, overlap_grad_reduce, overlap_param_gather
        # Mean over data-parallel replicas. Context-parallel ranks of one replica each hold their
        # token share of the replica's loss (context_parallel.cp_reduce_loss), so they are summed.
        self.grad_scale = 1.0 / ps.dp.size if average else 1.0

        owner = {}
        for sub in module.modules():
            for p in sub.parameters(recurse=False):
                owner.setdefault(id(p), sub)
        groups: dict[tuple, list[ParamSlot]] = {}
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for order, (name, p) in enumerate(trainable):
            expert = is_expert_param(owner[id(p)], p)
            late = bool(getattr(p, "pipeline_shared", False))
            key = (p.device, p.dtype, grad_dtype or p.dtype, "edp" if expert else "dp_cp", late)
            groups.setdefault(key, []).append(ParamSlot(name, p, order, 0, 0, expert, late=late))
        if not groups:
            raise ValueError("DataParallel: the module has no parameter that requires grad")

        self.buffers: list[GradBuffer] = []
        for (_, _, gdtype, group_name, _), slots in groups.items():
            group = ps.group(group_name)
            pad = group.size * PAD_ALIGN if use_distributed_optimizer else 1
            self.buffers.append(self.buffer_class(group, group_name == "edp", slots[::-1], bucket_size,
                                                  pad, gdtype, use_distributed_optimizer))
        self.slots = [s for b in self.buffers for s in b.slots]
        # One launch sequence for every bucket: by the backward position of the bucket's
        # earliest-registered parameter, i.e. when the bucket should become complete; the
        # pipeline-shared buckets last (they are complete only after the schedule).
        self.buckets = sorted((k for b in self.buffers for k in b.buckets),
                              key=lambda k: (k.slots[0].late, -min(s.order for s in k.slots)))
        self._next_launch = 0
        self._sync_enabled = True
        self._final: set[int] | None = None  # ids of the params whose gradients are final now
        self._synced = False
        self._unwritten: set[ParamSlot] = set()  # slots whose view zero_grad() left stale (see there)
        self._handles = [s.param.register_post_accumulate_grad_hook(self._make_hook(s))
                         for s in self.slots]
        if overlap_param_gather:
            self._register_gather_waits()

    # --- user API ------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters handled here (requires_grad), in registration order."""
        for s in sorted(self.slots, key=lambda s: s.order):
            yield s.name, s.param

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication), e.g. for all but the last micro-batch."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    @contextlib.contextmanager
    def final_gradients(self, params):
        """Gradients of `params` arriving inside are their last of the step: they count as
        ready (buckets launch as they fill); any other gradient accumulates as under no_sync().
        A pipeline executor wraps each chunk's last backward (or W) pass in it."""
        previous = self._sync_enabled, self._final
        self._sync_enabled, self._final = True, {id(p) for p in params}
        try:
            yield
        finally:
            self._sync_enabled, self._final = previous

    def zero_grad(self) -> None:
        """Zero every gradient buffer and start a new step (call before the first micro-batch).

        A buffer whose parameters all keep low-precision `.grad`s (bf16 parameters, fp32 buffer) is
        not cleared: each parameter's first gradient of the step is copied in instead of added, and
        finish_grad_sync() zeroes the views of those that got none. On a GPU that saves a memset of
        the whole buffer and a read of it per step (0 + g == g, so the sums are the same)."""
        self._wait_grad_collectives()
        self._unwritten.clear()
        for buf in self.buffers:
            if all(s.main_grad_only and not s.late for s in buf.slots):
                self._unwritten.update(buf.slots)
            else:
                buf.grad_data.zero_()
        for s in self.slots:
            s.param.grad = None if s.main_grad_only else s.grad_view
        self._reset()

    def finish_grad_sync(self) -> None:
        """Launch the buckets not yet launched and wait for all; idempotent until zero_grad().

        After it, every gradient is the DP mean (all-reduce), or (distributed optimizer) each
        rank's own shard of every bucket is, and the rest of the buffer is stale local data.
        """
        if self._synced:
            return
        if not self._sync_enabled:
            raise RuntimeError("finish_grad_sync() inside no_sync(): leave the no_sync() context "
                               "for the last micro-batch, then synchronise")
        for slot in self._unwritten:  # no gradient this step (zero_grad left the buffer as it was)
            slot.grad_view.zero_()
        self._unwritten.clear()
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        self._wait_grad_collectives()
        self._synced = True

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Global gradient norm after finish_grad_sync (all-reduce mode), clipped like torch's.

        Gradients are replicated over DP after the all-reduce, so dense squares are summed over
        ps.mp (tp x pp) and expert squares over ps.tp_ep_pp. A parameter replicated over TP counts
        only on tp rank 0 unless it has `tensor_model_parallel = True` (sharded over TP).
        """
        if self.use_distributed_optimizer:
            raise RuntimeError("with the distributed optimizer each rank holds only a shard of the "
                               "gradients; DistributedOptimizer.step() clips by the global norm")
        self.finish_grad_sync()
        ps = self.parallel_state
        grads = {False: [], True: []}
        for s in self.slots:
            if counts_in_norm(s.param, ps, s.expert):
                grads[s.expert].append(s.grad_view)
        device = self.buffers[0].device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for expert, group in ((False, ps.mp), (True, ps.tp_ep_pp)):
            sq = sum_of_squares(grads[expert], device)
            all_reduce_sum(sq, group)
            total = total + sq
        norm = total.sqrt()
        if max_norm is not None:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for buf in self.buffers:
                buf.grad_data.mul_(coef.to(buf.grad_dtype))
        return norm

    # --- parameter all-gather (distributed optimizer) ---------------------------------------
    def start_param_sync(self) -> None:
        """All-gather every bucket's parameter shards (each rank wrote its own into param_data).

        Buckets go in forward order (the reverse of the reduction order). Without
        overlap_param_gather this waits; with it, forward pre-hooks wait bucket by bucket.
        """
        if not self.use_distributed_optimizer:
            raise RuntimeError("start_param_sync() needs use_distributed_optimizer=True")
        self.finish_param_sync()
        for bucket in reversed(self.buckets):
            self.start_bucket_param_sync(bucket)
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def start_bucket_param_sync(self, bucket: Bucket) -> None:
        """Launch the all-gather of one bucket's parameter shards (waited for like the others)."""
        group = bucket.buffer.group
        if group.size == 1 or bucket.gather_work is not None:
            return
        if getattr(self, "param_gather_hook", None) is not None:  # FP8 bytes: precision/fp8_param_gather.py
            bucket.gather_work = self.param_gather_hook(bucket)
            return
        lo, hi = bucket.shard_range()
        own = bucket.buffer.param_data[lo:hi].clone()  # never alias input and output
        out = bucket.buffer.param_data[bucket.start:bucket.end]
        bucket.gather_work = _all_gather(out, own, group.handle)

    def finish_param_sync(self) -> None:
        """Wait for every pending parameter all-gather."""
        for bucket in self.buckets:
            self._wait_gather(bucket)

    @property
    def pending_param_gathers(self) -> int:
        return sum(b.gather_work is not None for b in self.buckets)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # --- internals --------------------------------------------------------------------------
    def _make_hook(self, slot: ParamSlot):
        def hook(param: torch.Tensor) -> None:
            self._grad_ready(slot)

        return hook

    def _grad_ready(self, slot: ParamSlot) -> None:
        if self._synced:
            raise RuntimeError(
                f"gradient of {slot.name!r} arrived after finish_grad_sync(); call "
                "DataParallel.zero_grad() (or DistributedOptimizer.zero_grad()) before the next "
                "step's backward (torch's optimizer.zero_grad() alone does not reset the buffers)")
        p = slot.param
        if p.grad is not None:
            if slot.main_grad_only:
                if slot in self._unwritten:
                    slot.grad_view.copy_(p.grad)
                    self._unwritten.discard(slot)
                else:
                    slot.grad_view.add_(p.grad)
                p.grad = None
            elif p.grad.data_ptr() != slot.grad_view.data_ptr():
                # autograd made a fresh .grad (it was None or replaced): it holds the whole sum
                slot.grad_view.copy_(p.grad)
                p.grad = slot.grad_view
        bucket = slot.bucket
        final = self._sync_enabled and not slot.late and (self._final is None or id(p) in self._final)
        if bucket.launched or (final and slot in bucket.ready):
            raise RuntimeError(
                f"gradient of {slot.name!r} arrived twice in one synchronised backward; run one "
                "backward per micro-batch and wrap all but the last in DataParallel.no_sync()")
        if not final:
            return
        bucket.ready.add(slot)
        if self.overlap_grad_reduce:
            while (self._next_launch < len(self.buckets)
                   and len(self.buckets[self._next_launch].ready)
                   == len(self.buckets[self._next_launch].slots)):
                self._launch(self.buckets[self._next_launch])
                self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        grad = bucket.grad
        if self.grad_scale != 1.0:
            grad.mul_(self.grad_scale)
        group = bucket.buffer.group
        bucket.launched = True
        if group.size == 1:
            return
        if self.use_distributed_optimizer:
            bucket.reduced_shard = grad.new_empty(bucket.numel // group.size)
            bucket.work = _reduce_scatter(bucket.reduced_shard, grad, group.handle)
        else:
            bucket.work = _all_reduce(grad, group.handle)

    def _wait_grad_collectives(self) -> None:
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
                if bucket.reduced_shard is not None:
                    lo, hi = bucket.shard_range()
                    bucket.buffer.grad_data[lo:hi].copy_(bucket.reduced_shard)
                    bucket.reduced_shard = None

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.launched = False
        self._next_launch = 0
        self._synced = False
