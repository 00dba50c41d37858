"""Every collective the model uses, as an autograd function with its matching backward.

Each backward assumes the usual model-parallel contract: the training objective is the sum of
every rank's loss, and a tensor that is replicated across a group contributes once. With that, a
collective's backward is its adjoint: all-gather <-> reduce-scatter, all-reduce (sum) <-> copy,
all-to-all <-> all-to-all with the splits swapped. On a group of size 1 every function returns its
input unchanged and never touches torch.distributed.

One exception to "autograd function": `start_all_to_all` is a plain asynchronous all-to-all for
the pipeline's communication pieces, whose executor sends the gradient back itself (the same
all-to-all with the splits swapped, also asynchronous).

torch 2.13's gloo backend implements every op used here (all_gather_single, reduce_scatter_single,
all_to_all_single with uneven splits, async work), so no fallbacks are needed; older names are
used only when the new ones are missing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from moetron.parallel.state import Group

# torch 2.13 renamed the single-tensor collectives; keep working on older torch (and nccl there).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

GroupLike = Group | dist.ProcessGroup


def _handle_and_size(group: GroupLike) -> tuple[dist.ProcessGroup | None, int]:
    if isinstance(group, Group):
        return group.handle, group.size
    if isinstance(group, dist.ProcessGroup):
        return group, dist.get_world_size(group)
    raise TypeError(
        "expected a moetron Group (from ParallelState) or a ProcessGroup, "
        f"got {type(group).__name__}"
    )


# ---- plain (non-autograd) building blocks, shared by forward and backward ----------------------


def _all_reduce(x: torch.Tensor, handle) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)  # never write into an autograd input
    dist.all_reduce(out, group=handle)
    return out


def _all_gather(x: torch.Tensor, handle, size: int, dim: int) -> torch.Tensor:
    x_front = x.movedim(dim, 0).contiguous()
    out = x_front.new_empty((size * x_front.shape[0], *x_front.shape[1:]))
    _all_gather_single(out, x_front, group=handle)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, handle, size: int, dim: int) -> torch.Tensor:
    if x.shape[dim] % size:
        raise ValueError(
            f"reduce_scatter: dim {dim} of shape {tuple(x.shape)} is not divisible by the group "
            f"size {size}"
        )
    x_front = x.movedim(dim, 0).contiguous()
    out = x_front.new_empty((x_front.shape[0] // size, *x_front.shape[1:]))
    _reduce_scatter_single(out, x_front, group=handle)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
    if x.shape[dim] % size:
        raise ValueError(
            f"split: dim {dim} of shape {tuple(x.shape)} is not divisible by the group size {size}"
        )
    return x.chunk(size, dim)[rank].contiguous()


# ---- autograd functions ------------------------------------------------------------------------


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle):
        return _all_reduce(x, handle)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle):
        ctx.handle = handle
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.handle), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle, size, dim, reduce_grad):
        ctx.handle, ctx.size, ctx.dim, ctx.reduce_grad = handle, size, dim, reduce_grad
        return _all_gather(x, handle, size, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            grad = _reduce_scatter(grad, ctx.handle, ctx.size, ctx.dim)
        else:
            grad = _split(grad, dist.get_rank(ctx.handle), ctx.size, ctx.dim)
        return grad, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle, size, dim):
        ctx.handle, ctx.size, ctx.dim = handle, size, dim
        return _reduce_scatter(x, handle, size, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.handle, ctx.size, ctx.dim), None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle, size, dim):
        ctx.handle, ctx.size, ctx.dim = handle, size, dim
        return _split(x, dist.get_rank(handle), size, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.handle, ctx.size, ctx.dim), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle, output_splits, input_splits, pending):
        ctx.handle, ctx.output_splits, ctx.input_splits = handle, output_splits, input_splits
        x = x.contiguous()
        rows = x.shape[0] if output_splits is None else sum(output_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        work = dist.all_to_all_single(
            out, x, output_splits, input_splits, group=handle, async_op=pending is not None
        )
        if pending is not None:
            pending._work = work
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        rows = grad.shape[0] if ctx.input_splits is None else sum(ctx.input_splits)
        out = grad.new_empty((rows, *grad.shape[1:]))
        dist.all_to_all_single(out, grad, ctx.input_splits, ctx.output_splits, group=ctx.handle)
        return out, None, None, None, None


# ---- public API --------------------------------------------------------------------------------


def all_reduce(x: torch.Tensor, group: GroupLike) -> torch.Tensor:
    """Sum over the group; backward passes the gradient through (consumers are replicated)."""
    handle, size = _handle_and_size(group)
    return x if size == 1 else _AllReduce.apply(x, handle)


def copy_to_group(x: torch.Tensor, group: GroupLike) -> torch.Tensor:
    """Identity on a replicated tensor; backward sums the gradients of each rank's consumer."""
    handle, size = _handle_and_size(group)
    return x if size == 1 else _CopyToGroup.apply(x, handle)


def all_gather(
    x: torch.Tensor, group: GroupLike, dim: int = 0, *, reduce_grad: bool = True
) -> torch.Tensor:
    """Concatenate every rank's x (same shape on all ranks) along dim.

    Backward reduce-scatters, because each rank's consumer of the gathered tensor is different.
    Pass reduce_grad=False when every rank's consumer is identical (e.g. gathering logits for a
    replicated loss): the backward then only takes this rank's slice.
    """
    handle, size = _handle_and_size(group)
    if size == 1:
        return x
    return _AllGather.apply(x, handle, size, dim % x.dim(), reduce_grad)


def reduce_scatter(x: torch.Tensor, group: GroupLike, dim: int = 0) -> torch.Tensor:
    """Sum over the group and keep this rank's equal slice along dim; backward all-gathers."""
    handle, size = _handle_and_size(group)
    if size == 1:
        return x
    return _ReduceScatter.apply(x, handle, size, dim % x.dim())


def split(x: torch.Tensor, group: GroupLike, dim: int = 0) -> torch.Tensor:
    """Keep this rank's equal slice of a replicated tensor along dim; backward all-gathers."""
    handle, size = _handle_and_size(group)
    if size == 1:
        return x
    return _Split.apply(x, handle, size, dim % x.dim())


def _check_splits(x, size, output_split_sizes, input_split_sizes):
    if (output_split_sizes is None) != (input_split_sizes is None):
        raise ValueError(
            "all_to_all: pass both output_split_sizes and input_split_sizes, or neither"
        )
    if input_split_sizes is None:
        if x.shape[0] % size:
            raise ValueError(
                f"all_to_all: even splits need x.shape[0]={x.shape[0]} divisible by the group "
                f"size {size}; pass input_split_sizes and output_split_sizes"
            )
        return
    for name, splits in (("output", output_split_sizes), ("input", input_split_sizes)):
        if len(splits) != size:
            raise ValueError(
                f"all_to_all: {name}_split_sizes has {len(splits)} entries for a group of {size}"
            )
    if sum(input_split_sizes) != x.shape[0]:
        raise ValueError(
            f"all_to_all: input_split_sizes sum to {sum(input_split_sizes)} but x has "
            f"{x.shape[0]} rows"
        )
    if size == 1 and list(output_split_sizes) != list(input_split_sizes):
        raise ValueError(
            f"all_to_all: a group of 1 receives what it sends, but output_split_sizes="
            f"{list(output_split_sizes)} != input_split_sizes={list(input_split_sizes)}"
        )


def all_to_all(
    x: torch.Tensor,
    group: GroupLike,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Exchange row blocks along dim 0: rank r sends input rows block s to rank s.

    Split sizes are host lists (one entry per group rank); None means equal blocks. Backward is
    the all-to-all with the two split lists swapped.
    """
    handle, size = _handle_and_size(group)
    _check_splits(x, size, output_split_sizes, input_split_sizes)
    if size == 1:
        return x
    splits = _as_list(output_split_sizes), _as_list(input_split_sizes)
    return _AllToAll.apply(x, handle, *splits, None)


class PendingAllToAll:
    """An all-to-all in flight: compute other work, then call wait() to get its output."""

    def __init__(self) -> None:
        self._work = None
        self._out: torch.Tensor | None = None
        self._input: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._input = None
        return self._out


def all_to_all_async(
    x: torch.Tensor,
    group: GroupLike,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> PendingAllToAll:
    """Start all_to_all and return at once, so compute can overlap the exchange.

    The output is only reachable through wait(), so it cannot be read early. The backward runs
    synchronously (overlap there belongs to the schedule that orders backward nodes).
    """
    handle, size = _handle_and_size(group)
    _check_splits(x, size, output_split_sizes, input_split_sizes)
    pending = PendingAllToAll()
    if size == 1:
        pending._out = x
    else:
        splits = _as_list(output_split_sizes), _as_list(input_split_sizes)
        pending._out = _AllToAll.apply(x, handle, *splits, pending)
    return pending


def start_all_to_all(
    x: torch.Tensor,
    group: GroupLike,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> PendingAllToAll:
    """Issue all_to_all asynchronously and outside autograd; wait() gives the received rows.

    For a caller that owns the gradient path itself: the pipeline's communication pieces
    (moetron/pipeline/overlap.py) send a gradient back with the reversed splits, also
    asynchronously, so the exchange hides behind another micro-batch's compute in both
    directions. `x` must stay unmodified until wait().
    """
    handle, size = _handle_and_size(group)
    _check_splits(x, size, output_split_sizes, input_split_sizes)
    pending = PendingAllToAll()
    x = x.detach()
    if size == 1:
        pending._out = x
        return pending
    x = x.contiguous()
    splits = _as_list(output_split_sizes), _as_list(input_split_sizes)
    rows = x.shape[0] if splits[0] is None else sum(splits[0])
    pending._out = x.new_empty((rows, *x.shape[1:]))
    pending._input = x  # alive until the transfer completes
    pending._work = dist.all_to_all_single(pending._out, x, *splits, group=handle, async_op=True)
    return pending


def _as_list(splits: Sequence[int] | None) -> list[int] | None:
    return None if splits is None else [int(s) for s in splits]
