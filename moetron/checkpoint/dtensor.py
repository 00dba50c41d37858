"""FSDP2's parameters (DTensors sharded on dim 0) as the checkpoint's local tensors.

A DTensor sharded over a 1-D mesh on dim 0 is, on each rank, a block of rows of the full tensor
(torch.chunk's split: ceil(rows / ranks) per rank, the last ones shorter or empty); its placement
says so, so ZeRO-3 checkpoints use the layout-independent format of every other layout.
"""

from __future__ import annotations

import sys

import torch

from moetron.checkpoint.sharded import LocalTensor, Placement

__all__ = ["as_dtensor_like", "is_dtensor", "local_part", "local_shards"]


def _dtensor_module():
    """torch.distributed.tensor if something (FSDP2) imported it, else None: no tensor can be a
    DTensor before that, and importing it costs ~0.5 s of every start-up that never needs it."""
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(t: torch.Tensor) -> bool:
    module = _dtensor_module()
    return module is not None and isinstance(t, module.DTensor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: its local shard for a DTensor, `t` itself otherwise."""
    return t.to_local() if is_dtensor(t) else t


def as_dtensor_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`value` (this rank's part) laid out like `param` (a DTensor under ZeRO-3), or `value` itself."""
    if not is_dtensor(param):
        return value
    return _dtensor_module().DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                shape=param.shape, stride=param.stride())


def local_shards(local: dict[str, LocalTensor]) -> dict[str, LocalTensor]:
    """`local` with every DTensor replaced by its local rows; the DTensor stays as `.param`."""
    out = {}
    for name, lt in local.items():
        t = lt.tensor
        if not is_dtensor(t):
            out[name] = lt
            continue
        if t.device_mesh.ndim != 1 or tuple(t.placements) != (_dtensor_module().Shard(0),):
            raise ValueError(f"{name}: a DTensor with placements {t.placements} over a {t.device_mesh.ndim}-D mesh; "
                             "checkpoints handle FSDP2's dim-0 shards over one mesh dimension only")
        rows, size, rank = t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank()
        chunk = -(-rows // size)
        start = min(rows, rank * chunk)
        shard = t.to_local().detach()
        if shard.shape[0] != min(chunk, rows - start):
            raise ValueError(f"{name}: local shard of {shard.shape[0]} rows, expected {min(chunk, rows - start)} "
                             f"(rows {rows} over {size} ranks)")
        zero = (0,) * t.dim()
        pieces = ((zero, (start,) + zero[1:], tuple(shard.shape)),) if shard.numel() else ()
        new = LocalTensor(name, shard, Placement(tuple(t.shape), pieces))
        new.param = t
        out[name] = new
    return out
