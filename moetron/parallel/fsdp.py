"""ZeRO-3: parameters, gradients and optimizer state sharded over data parallel, with PyTorch FSDP2.

    fsdp = FullyShardedDataParallel(model, ps, units=list(model.layers))   # fully_shard each, then the root
    opt = ShardedAdamW(fsdp, lr=3e-4, max_grad_norm=1.0)                   # moetron.optim.fsdp
    fsdp.zero_grad(); ...forward / backward per micro-batch...; opt.step()

`torch.distributed.fsdp.fully_shard` turns every parameter into a DTensor sharded on dim 0 over the
data-parallel group; each unit all-gathers its parameters before its forward (and again for its
backward) and reduce-scatters its gradients during backward, averaged over the group like
`DataParallel`. The trainer drives it through DataParallel's method names. Data parallel only (tp,
cp, ep, pp = 1; ParallelConfig refuses the rest). docs/zero.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from moetron.parallel.state import ParallelState

__all__ = ["FullyShardedDataParallel"]


class FullyShardedDataParallel:
    """FSDP2 over `module`'s `units` (e.g. the transformer layers) and the rest at the root.

    param_dtype: the dtype units compute in (parameters stay fp32 shards, gradients reduce in fp32);
    None: the parameters' own dtype.
    reshard_after_forward: the units' (the root keeps its parameters gathered until its backward).
    """

    use_distributed_optimizer = True

    def __init__(self, module: nn.Module, parallel_state: ParallelState, units: Sequence[nn.Module] = (), *,
                 param_dtype: torch.dtype | None = None, reshard_after_forward: bool = True):
        ps = parallel_state
        others = [f"{g}={getattr(ps, g).size}" for g in ("tp", "cp", "pp", "ep") if getattr(ps, g).size > 1]
        if others:
            raise ValueError(f"ZeRO-3 (FSDP2) runs data parallel only, not with {', '.join(others)}: use "
                             "parallel.zero_stage=2, or a data-parallel-only layout")
        if ps.dp.handle is None:
            raise ValueError("ZeRO-3 (FSDP2) needs torch.distributed initialised (one process needs no sharding)")
        # Imported here: FSDP2 and DTensor cost ~0.5 s of every start-up, and only ZeRO-3 needs them.
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        device = next(module.parameters()).device
        self.mesh = DeviceMesh.from_group(ps.dp.handle, device_type=device.type)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for unit in units:
            fully_shard(unit, mesh=self.mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        # The root's parameters (embedding, final norm, head) stay gathered from forward to backward: the
        # model returns a dataclass, where FSDP2 finds no tensor to hang the root's re-gather on before
        # backward (torch 2.11 then freed the head's weight under the loss's backward; 2.13 keeps it).
        fully_shard(module, mesh=self.mesh, mp_policy=policy, reshard_after_forward=False)
        self.module, self.parallel_state = module, ps

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.module.named_parameters() if p.requires_grad)

    @property
    def grad_bytes(self) -> int:
        """Bytes of this rank's (sharded) gradients."""
        return sum(p.grad.to_local().numel() * p.grad.element_size() for _, p in self.named_parameters()
                   if p.grad is not None)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients are reduce-scattered after every micro-batch (an unsharded accumulation would
        cost the full gradient memory ZeRO-3 avoids), so there is nothing to defer."""
        yield

    def final_gradients(self, params):
        raise NotImplementedError("ZeRO-3 (FSDP2) does not run under a pipeline schedule: use parallel.zero_stage=2")

    def zero_grad(self) -> None:
        for _, p in self.named_parameters():
            p.grad = None

    def finish_grad_sync(self) -> None:
        """Nothing left: FSDP2 waits for its reduce-scatters at the end of each backward."""

    def finish_param_sync(self) -> None:
        """Nothing pending: each unit gathers its parameters for its own forward and backward."""
