"""The flex dispatcher's NVSHMEM backend: the torch backend with its all-to-all done in torch's
symmetric memory (`torch.ops.symm_mem.all_to_all_vdev`, torch >= 2.11). GPU only."""

from __future__ import annotations

import weakref

import torch

from moetron.dispatch.flex_backends import TorchBackend
from moetron.dispatch.fp8_dispatch import as_wire, from_wire


def _require_nvshmem() -> None:
    def unavailable(reason: str):
        return RuntimeError(f"backend 'nvshmem' was requested but is unavailable: {reason}. "
                            f"Run `moetron env` to see what this machine supports.")
    if not torch.cuda.is_available():
        raise unavailable("no CUDA device (torch symmetric-memory all_to_all_vdev runs on GPU only)")
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        raise unavailable(f"this torch has no symmetric memory module ({e})") from None
    if not symm_mem.is_nvshmem_available():
        raise unavailable("this torch build has no NVSHMEM (libnvshmem_host.so.3 not found)")
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev"):
        raise unavailable("this torch has no torch.ops.symm_mem.all_to_all_vdev")


class SymmetricBuffers:
    """The symmetric buffers of one process group, shared by every nvshmem flex dispatcher on it
    (one set per wire dtype and row shape, grown collectively when a larger dispatch needs it)."""

    def __init__(self, group) -> None:
        self.group_ref, self.size = weakref.ref(group), group.size()
        self.buffers: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def get(self, symm_mem, dtype, row_shape, rows, device):
        key = (dtype, tuple(row_shape), device)
        bufs = self.buffers.get(key)
        if bufs is None or bufs[0].shape[0] < rows:  # collective: every rank reaches it alike
            self.buffers.pop(key, None)  # release the smaller set first
            name = self.group_ref().group_name
            inp = symm_mem.empty((rows, *row_shape), dtype=dtype, device=device)
            out = symm_mem.empty((rows, *row_shape), dtype=dtype, device=device)
            in_splits = symm_mem.empty(self.size, dtype=torch.int64, device=device)
            out_splits_offsets = symm_mem.empty((2, self.size), dtype=torch.int64, device=device)
            for t in (inp, out, in_splits, out_splits_offsets):
                symm_mem.rendezvous(t, name)
            bufs = self.buffers[key] = (inp, out, in_splits, out_splits_offsets)
        return bufs


_SHARED: dict[str, SymmetricBuffers] = {}


def shared_symmetric_buffers(group) -> SymmetricBuffers:
    """This process's SymmetricBuffers for `group` (a new group of a reused name gets new ones)."""
    entry = _SHARED.get(group.group_name)
    if entry is None or entry.group_ref() is not group:
        entry = _SHARED[group.group_name] = SymmetricBuffers(group)
    return entry


class NvshmemBackend(TorchBackend):
    """The torch backend with its all-to-all done by NVSHMEM (`torch.ops.symm_mem.all_to_all_vdev`).

    Symmetric buffers must have the same size on every rank, so they are allocated for
    `max_tokens_per_rank` tokens (each may go to every rank); a larger dispatch raises. Each
    transfer is ordered on the current CUDA stream, so `async_finish` only defers the local
    post-processing. Untested in CI (needs GPUs with NVSHMEM).
    """

    name = "nvshmem"

    def __init__(self, group, num_experts: int, max_tokens_per_rank: int = 8192):
        _require_nvshmem()
        super().__init__(group, num_experts)
        import torch.distributed._symmetric_memory as symm_mem

        if self.size > 1 and self.group is None:
            raise ValueError("backend 'nvshmem' needs a torch.distributed process group")
        symm_mem.set_backend("NVSHMEM")
        self._symm_mem = symm_mem
        self.max_rows = self.size * max_tokens_per_rank
        self._shared = shared_symmetric_buffers(self.group) if self.group is not None else None

    def _buffers_for(self, dtype, row_shape, rows, device):
        return self._shared.get(self._symm_mem, dtype, row_shape, rows, device)

    def exchange(self, send, send_splits, recv_splits, async_op):
        if self.size == 1:
            return send, None
        wire = as_wire(send.contiguous())
        if send_splits is None:  # equal blocks: same shape on every rank, size the buffer to fit
            send_splits = recv_splits = [wire.shape[0] // self.size] * self.size
            capacity = max(self.max_rows, wire.shape[0])
        else:
            capacity = self.max_rows
        if wire.shape[0] > capacity or sum(recv_splits) > capacity:
            raise ValueError(f"nvshmem backend: {max(wire.shape[0], sum(recv_splits))} rows exceed the "
                             f"symmetric buffer ({capacity} rows); raise max_tokens_per_rank")
        inp, out, in_splits, out_splits_offsets = self._buffers_for(wire.dtype, wire.shape[1:], capacity,
                                                                    wire.device)
        inp[: wire.shape[0]].copy_(wire)
        in_splits.copy_(torch.tensor(send_splits, dtype=torch.int64), non_blocking=True)
        torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, out_splits_offsets, self.group.group_name)
        recv = out[: sum(recv_splits)].clone()
        return from_wire(recv, send.dtype), None
