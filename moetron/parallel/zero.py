"""ZeRO-2: gradients reduce-scattered after every micro-batch into this rank's shard only.

    ddp = ShardedGradDataParallel(model, ps)        # always with the distributed optimizer
    opt = DistributedOptimizer(ddp, ...)            # reads the shard through GradBuffer.shard_grad

A bucket's gradients collect in a transient bucket-sized buffer; once every parameter of the bucket
has delivered its gradient (buckets launch in one fixed order, the same on every rank), the bucket
is scaled, reduce-scattered and added into the persistent shard, and the transient is freed. So
the gradients of a step take 1/dp of the full buffer plus a few buckets (collecting, or in one of the
MAX_IN_FLIGHT reduce-scatters a rank keeps going); `no_sync()` does
not defer the reduction (that would need the full buffer). Parameters tagged `pipeline_shared`
(summed over pipeline ranks after the schedule) keep ZeRO-1's full buffer. docs/zero.md.
"""

from __future__ import annotations

import torch

from moetron.parallel.data_parallel import Bucket, DataParallel, GradBuffer, ParamSlot, _reduce_scatter

__all__ = ["ShardedGradBuffer", "ShardedGradDataParallel", "MAX_IN_FLIGHT"]

MAX_IN_FLIGHT = 2  # reduce-scatters in flight per rank; launching another waits for the oldest


class ShardedGradBuffer(GradBuffer):
    """A GradBuffer whose gradients persist only as this rank's shard of every bucket.

    Bucket k's shard [start/size, end/size) of `grad_shard` holds the reduced (summed over the
    micro-batches, scaled) gradients of the buffer range `bucket.shard_range()`.
    """

    def _allocate_grads(self) -> None:
        self.sharded = not self.slots[0].late  # pipeline-shared: summed over PP after the schedule, in full
        if not self.sharded:
            self.transient = {}
            return super()._allocate_grads()
        size = self.group.size
        self.grad_data = None
        self.grad_shard = torch.zeros(self.numel // size, dtype=self.grad_dtype, device=self.device)
        self.transient: dict[int, torch.Tensor] = {}  # id(bucket) -> its full-size gradients, while collecting
        for s in self.slots:
            s.grad_view = None
            s.main_grad_only = True  # autograd's .grad is folded into the transient and dropped
            s.param.main_grad = None
            s.param.grad = None

    def shard_grad(self, lo: int, hi: int) -> torch.Tensor:
        """The reduced gradients of [lo, hi), a range inside this rank's shard of one bucket."""
        if not self.sharded:
            return super().shard_grad(lo, hi)
        for bucket in self.buckets:
            a, b = bucket.shard_range()
            if a <= lo and hi <= b:
                return self.bucket_shard(bucket)[lo - a:hi - a]
        raise ValueError(f"buffer range [{lo}, {hi}) is in no shard of this rank")

    def bucket_shard(self, bucket: Bucket) -> torch.Tensor:
        size = self.group.size
        return self.grad_shard[bucket.start // size:bucket.end // size]

    @property
    def grad_bytes(self) -> int:
        """Bytes of gradients this buffer keeps across micro-batches (the shard; all of a pipeline-shared one)."""
        return _nbytes(self.grad_shard if self.sharded else self.grad_data)


class ShardedGradDataParallel(DataParallel):
    """DataParallel with ZeRO-2 gradient buffers (`use_distributed_optimizer` is implied).

    `grad_bytes`: gradient bytes kept across micro-batches; `peak_transient_bytes`: the most bytes
    of bucket buffers alive at once (collecting or in flight) since construction.
    """

    def __init__(self, module, parallel_state=None, **kwargs):
        if kwargs.pop("use_distributed_optimizer", True) is not True:
            raise ValueError("ShardedGradDataParallel (ZeRO-2) needs the distributed optimizer: each rank keeps "
                             "only its shard of the gradients")
        self.peak_transient_bytes = self._live_bytes = 0
        self._in_flight: list[Bucket] = []  # launched, not yet added into the shard (oldest first)
        super().__init__(module, parallel_state, use_distributed_optimizer=True, **kwargs)
        # the sharded buckets come first in the launch order, the pipeline-shared (full) ones last
        self._cycle_end = sum(b.buffer.sharded for b in self.buckets)

    buffer_class = ShardedGradBuffer

    @property
    def grad_bytes(self) -> int:
        """Gradient bytes kept across micro-batches on this rank (shards, plus full pipeline-shared buffers)."""
        return sum(b.grad_bytes for b in self.buffers)

    def zero_grad(self) -> None:
        self._wait_grad_collectives()
        for buf in self.buffers:
            if buf.sharded:
                buf.grad_shard.zero_()
                self._live_bytes -= sum(_nbytes(t) for t in buf.transient.values())
                buf.transient.clear()
            else:
                buf.grad_data.zero_()
        for s in self.slots:
            s.param.grad = None if s.main_grad_only else s.grad_view
        self._reset()

    def finish_grad_sync(self) -> None:
        """Reduce what is still collecting (the buckets not yet launched in this pass over the launch
        order, then those that collected again since), then the pipeline-shared buckets; wait."""
        if self._synced:
            return
        if not self._sync_enabled:
            raise RuntimeError("finish_grad_sync() inside no_sync(): leave the no_sync() context "
                               "for the last micro-batch, then synchronise")
        while self._next_launch:  # the rest of the current pass (it wraps to 0 at its end)
            self._launch_next()
        for bucket in self.buckets[:self._cycle_end]:
            if id(bucket) in bucket.buffer.transient:
                self._launch(bucket)
        for bucket in self.buckets[self._cycle_end:]:
            self._launch(bucket)
        self._wait_grad_collectives()
        self._synced = True

    # --- internals --------------------------------------------------------------------------
    def _grad_ready(self, slot: ParamSlot) -> None:
        if not slot.bucket.buffer.sharded:
            return super()._grad_ready(slot)  # pipeline-shared: accumulates until finish_grad_sync
        if self._synced:
            raise RuntimeError(f"gradient of {slot.name!r} arrived after finish_grad_sync(); call "
                               "DataParallel.zero_grad() (or DistributedOptimizer.zero_grad()) before the next "
                               "step's backward")
        p, bucket = slot.param, slot.bucket
        if p.grad is None:
            return
        if bucket.work is not None:  # its previous micro-batch is still being reduced: finish that first
            self._wait_bucket(bucket)
        grads = bucket.buffer.transient.get(id(bucket))
        if grads is None:
            grads = bucket.buffer.transient[id(bucket)] = self._new_transient(bucket)
        grads[slot.start - bucket.start:slot.end - bucket.start].view(p.shape).add_(p.grad)
        p.grad = None
        bucket.ready.add(slot)
        # in the fixed launch order (the same on every rank): each bucket once all its gradients are in
        while (self._next_launch < self._cycle_end
               and len(self.buckets[self._next_launch].ready) == len(self.buckets[self._next_launch].slots)):
            self._launch_next()

    def _new_transient(self, bucket: Bucket) -> torch.Tensor:
        t = torch.zeros(bucket.numel, dtype=bucket.buffer.grad_dtype, device=bucket.buffer.device)
        self._live_bytes += _nbytes(t)
        self.peak_transient_bytes = max(self.peak_transient_bytes, self._live_bytes)
        return t

    def _launch_next(self) -> None:
        self._launch(self.buckets[self._next_launch])
        self._next_launch += 1
        if self._next_launch == self._cycle_end:  # the next pass (micro-batch) starts over
            self._next_launch = 0

    def _launch(self, bucket: Bucket) -> None:
        buffer = bucket.buffer
        if not buffer.sharded:
            return super()._launch(bucket)
        if bucket.work is not None:
            self._wait_bucket(bucket)
        grads = buffer.transient.pop(id(bucket), None)
        if grads is None:  # nothing arrived (the same on every rank): reduce zeros, keep the order
            grads = self._new_transient(bucket)
        bucket.ready.clear()
        bucket.launched = True
        if self.grad_scale != 1.0:
            grads.mul_(self.grad_scale)
        group = buffer.group
        if group.size == 1:
            buffer.bucket_shard(bucket).add_(grads)
            self._live_bytes -= _nbytes(grads)
            return
        bucket.reduced_shard = grads.new_empty(bucket.numel // group.size)
        bucket.work = _reduce_scatter(bucket.reduced_shard, grads, group.handle)
        bucket.in_flight = grads  # alive until the collective is done
        self._in_flight.append(bucket)
        while len(self._in_flight) > (MAX_IN_FLIGHT if self.overlap_grad_reduce else 0):
            self._wait_bucket(self._in_flight[0])

    def _wait_bucket(self, bucket: Bucket) -> None:
        self._in_flight.remove(bucket)
        bucket.work.wait()
        bucket.buffer.bucket_shard(bucket).add_(bucket.reduced_shard)
        self._live_bytes -= _nbytes(bucket.in_flight)
        bucket.work = bucket.in_flight = bucket.reduced_shard = None

    def _wait_grad_collectives(self) -> None:
        for bucket in self.buckets:
            if bucket.work is not None and bucket.buffer.sharded:
                self._wait_bucket(bucket)
        super()._wait_grad_collectives()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
