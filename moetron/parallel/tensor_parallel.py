"""Tensor- and sequence-parallel building blocks: sharded linears, the SwiGLU MLP split over TP,
sequence scatter/gather, and the chunked communication overlap (vocab parallel: vocab_parallel.py).

Design notes: docs/parallel.md (`moetron/parallel/tensor_parallel.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetron.ops.functional import swiglu
from moetron.ops.mlp import MLP
from moetron.parallel import comm
from moetron.parallel.state import Group

_all_gather_single = comm._all_gather_single
_reduce_scatter_single = comm._reduce_scatter_single


# ---- sequence-parallel scatter / gather ------------------------------------------------------


def scatter_to_sequence_parallel(x: torch.Tensor, group: Group, seq_dim: int = -2) -> torch.Tensor:
    """Keep this rank's shard of a replicated tensor along the sequence (backward all-gathers)."""
    return comm.split(x, group, seq_dim)


def gather_from_sequence_parallel(x: torch.Tensor, group: Group, seq_dim: int = -2, *,
                                  reduce_grad: bool = True) -> torch.Tensor:
    """All-gather the sequence shards. Backward reduce-scatters (each rank's consumer differs);
    `reduce_grad=False` when every rank's consumer is identical (backward keeps this rank's slice)."""
    return comm.all_gather(x, group, seq_dim, reduce_grad=reduce_grad)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: Group, seq_dim: int = -2) -> torch.Tensor:
    """Sum the ranks' partial tensors and keep this rank's sequence shard (backward all-gathers)."""
    return comm.reduce_scatter(x, group, seq_dim)


class _KeepOwnSliceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rank, size, dim):
        ctx.rank, ctx.size, ctx.dim = rank, size, dim
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[ctx.dim] // ctx.size
        out = torch.zeros_like(grad)
        out.narrow(ctx.dim, ctx.rank * n, n).copy_(grad.narrow(ctx.dim, ctx.rank * n, n))
        return out, None, None, None


def keep_own_slice_grad(x: torch.Tensor, group: Group, seq_dim: int = -2) -> torch.Tensor:
    """Identity; backward keeps only this rank's sequence slice of the gradient.

    For a replicated computation (identical on every rank, with the full gradient everywhere) that
    reads a tensor gathered with `gather_from_sequence_parallel`: the gather's reduce-scatter then
    adds each slice exactly once instead of `tp` times.
    """
    if group.size == 1:
        return x
    return _KeepOwnSliceGrad.apply(x, group.rank, group.size, seq_dim % x.dim())


def sum_grad_over_group(param: torch.Tensor, group: Group) -> None:
    """Sum `param`'s gradient over `group` as backward produces it (idempotent; no-op for size 1).

    For a parameter replicated over the group whose use on each rank covers only part of the work
    (this rank's sequence shard or heads): afterwards `.grad` is the full gradient on every rank.
    """
    if group.size == 1 or getattr(param, "_tp_grad_sum_group", None) is not None:
        return
    param._tp_grad_sum_group = group
    param.register_hook(lambda grad: comm.all_reduce(grad, group))


def mark_sharded(param: nn.Parameter, dim: int) -> None:
    # Megatron's attribute names, so grad-norm and checkpoint code can tell shards from replicas.
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1


# ---- chunked, overlapped all-gather -> GEMM and GEMM -> reduce-scatter -----------------------


def _chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    chunks = max(1, min(chunks, n))
    bounds, start = [], 0
    for i in range(chunks):
        stop = start + n // chunks + (i < n % chunks)
        bounds.append((start, stop))
        start = stop
    return bounds


def _front(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """View of a full-sequence tensor as [size, S_local, ...rest] (rank-major), no copy."""
    front = t.movedim(dim, 0)
    return front.unflatten(0, (size, front.shape[0] // size))


class _AllGatherLinear(torch.autograd.Function):
    """outs[j] = linear(all_gather(x, dim), weights[j], biases[j]), gathered chunk by chunk."""

    @staticmethod
    def forward(ctx, x, handle, size, dim, chunks, *params):
        weights, biases = params[0::2], params[1::2]
        x_front = x.movedim(dim, 0)
        s_local = x_front.shape[0]
        bounds = _chunk_bounds(s_local, chunks)
        full_shape = list(x.shape)
        full_shape[dim] = size * s_local
        x_full = x.new_empty(full_shape)
        outs = [x.new_empty(full_shape[:-1] + [w.shape[0]]) for w in weights]
        xf_front, out_fronts = _front(x_full, dim, size), [_front(o, dim, size) for o in outs]
        pending = []  # every chunk's gather is in flight before the first GEMM starts
        for a, b in bounds:  # (inputs stay referenced until their collective is waited for)
            piece = x_front[a:b].contiguous()
            buf = piece.new_empty((size * (b - a), *piece.shape[1:]))
            pending.append((buf, _all_gather_single(buf, piece, group=handle, async_op=True), piece))
        for (a, b), (buf, work, _) in zip(bounds, pending):
            work.wait()
            chunk = buf.unflatten(0, (size, b - a))
            xf_front[:, a:b].copy_(chunk)
            for w, bias, of in zip(weights, biases, out_fronts):
                of[:, a:b].copy_(F.linear(chunk, w, bias))
        ctx.save_for_backward(x_full, *weights)
        ctx.handle, ctx.size, ctx.dim, ctx.bounds = handle, size, dim, bounds
        ctx.has_bias = [b is not None for b in biases]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x_full, *weights = ctx.saved_tensors
        size, dim, handle = ctx.size, ctx.dim, ctx.handle
        g_fronts = [_front(g, dim, size) for g in grads]
        local_shape = list(x_full.shape)
        local_shape[dim] //= size
        grad_x = x_full.new_empty(local_shape)
        gx_front = grad_x.movedim(dim, 0)
        pending = []  # reduce-scatter chunk i while chunk i+1's input gradient is computed
        for a, b in ctx.bounds:
            acc = None
            for g_front, w in zip(g_fronts, weights):
                part = g_front[:, a:b].matmul(w)
                acc = part if acc is None else acc.add_(part)
            acc = acc.contiguous().flatten(0, 1)
            buf = acc.new_empty((acc.shape[0] // size, *acc.shape[1:]))
            pending.append((buf, _reduce_scatter_single(buf, acc, group=handle, async_op=True), acc))
        x2 = x_full.reshape(-1, x_full.shape[-1])
        param_grads = []
        for j, (g, has_bias) in enumerate(zip(grads, ctx.has_bias)):  # overlaps the last reduce-scatters
            g2 = g.reshape(-1, g.shape[-1])
            needs_w, needs_b = ctx.needs_input_grad[5 + 2 * j], ctx.needs_input_grad[6 + 2 * j]
            param_grads += [g2.t().mm(x2) if needs_w else None, g2.sum(0) if has_bias and needs_b else None]
        for (a, b), (buf, work, _) in zip(ctx.bounds, pending):
            work.wait()
            gx_front[a:b].copy_(buf)
        return (grad_x, None, None, None, None, *param_grads)


class _LinearReduceScatter(torch.autograd.Function):
    """reduce_scatter(linear(x, weight), dim), computed and reduced chunk by chunk."""

    @staticmethod
    def forward(ctx, x, weight, handle, size, dim, chunks):
        x_front = _front(x, dim, size)
        s_local = x_front.shape[1]
        bounds = _chunk_bounds(s_local, chunks)
        local_shape = list(x.shape)
        local_shape[dim] = s_local
        local_shape[-1] = weight.shape[0]
        y = x.new_empty(local_shape)
        y_front = y.movedim(dim, 0)
        pending = []  # chunk i is reduced while chunk i+1 is computed
        for a, b in bounds:
            part = F.linear(x_front[:, a:b], weight).contiguous().flatten(0, 1)
            buf = part.new_empty((part.shape[0] // size, *part.shape[1:]))
            pending.append((buf, _reduce_scatter_single(buf, part, group=handle, async_op=True), part))
        for (a, b), (buf, work, _) in zip(bounds, pending):
            work.wait()
            y_front[a:b].copy_(buf)
        ctx.save_for_backward(x, weight)
        ctx.handle, ctx.size, ctx.dim, ctx.bounds = handle, size, dim, bounds
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        size, dim, handle = ctx.size, ctx.dim, ctx.handle
        g_front = grad.movedim(dim, 0)
        full_shape = list(grad.shape)
        full_shape[dim] *= size
        g_full = grad.new_empty(full_shape)
        gf_front = _front(g_full, dim, size)
        grad_x = x.new_empty(x.shape)
        gx_front = _front(grad_x, dim, size)
        pending = []
        for a, b in ctx.bounds:
            piece = g_front[a:b].contiguous()
            buf = piece.new_empty((size * (b - a), *piece.shape[1:]))
            pending.append((buf, _all_gather_single(buf, piece, group=handle, async_op=True), piece))
        for (a, b), (buf, work, _) in zip(ctx.bounds, pending):
            work.wait()
            chunk = buf.unflatten(0, (size, b - a))
            gf_front[:, a:b].copy_(chunk)
            gx_front[:, a:b].copy_(chunk.matmul(weight))
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = g_full.reshape(-1, g_full.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        return grad_x, grad_w, None, None, None, None


def all_gather_linear(x: torch.Tensor, weights, biases, group: Group, seq_dim: int = -2,
                      overlap_chunks: int = 1) -> list[torch.Tensor]:
    """`[linear(gather(x), w, b) for w, b]` for sequence-sharded x: one gather shared by every GEMM,
    in `overlap_chunks` overlapped pieces when > 1."""
    if group.size == 1:
        return [F.linear(x, w, b) for w, b in zip(weights, biases)]
    dim = seq_dim % x.dim()
    if dim == x.dim() - 1:
        raise ValueError("seq_dim must not be the feature (last) dimension")
    if overlap_chunks <= 1:
        x_full = comm.all_gather(x, group, dim)
        return [F.linear(x_full, w, b) for w, b in zip(weights, biases)]
    params = [t for wb in zip(weights, biases) for t in wb]
    return list(_AllGatherLinear.apply(x, group.handle, group.size, dim, overlap_chunks, *params))


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: Group, seq_dim: int = -2,
                          overlap_chunks: int = 1) -> torch.Tensor:
    """`reduce_scatter(linear(x, weight), seq_dim)`, in `overlap_chunks` overlapped pieces when > 1."""
    if group.size == 1:
        return F.linear(x, weight)
    dim = seq_dim % x.dim()
    if x.shape[dim] % group.size:
        raise ValueError(f"sequence parallel: the sequence dim {dim} of shape {tuple(x.shape)} is not "
                         f"divisible by tp={group.size}")
    if overlap_chunks <= 1:
        return comm.reduce_scatter(F.linear(x, weight), group, dim)
    return _LinearReduceScatter.apply(x, weight, group.handle, group.size, dim, overlap_chunks)


# ---- sharded layers --------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """`y[..., rank's out slice] = x @ W[rank rows]^T (+ b)`; the output stays split on features.

    `gather_input=False` when the input is already inside the TP region (replicated with summed
    gradients, or already gathered). `used_rows` (from `from_linear(..., replicate_rows=...)`) keeps
    the whole weight replicated and uses only those rows, summing its gradient over the group: how a
    kv head shared by several TP ranks is held. `tp_comm_in_gemm` (FP8 subclasses on TE userbuffers):
    `gather_linear` gathers the sequence-parallel input inside the GEMM.
    """

    tp_comm_in_gemm = False

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = False,
                 sequence_parallel: bool = False, gather_input: bool = True, seq_dim: int = -2,
                 overlap_chunks: int = 1, init_std: float = 0.02):
        super().__init__()
        self._configure(in_features, out_features, group, sequence_parallel, gather_input, seq_dim,
                        overlap_chunks)
        local = out_features // group.size
        self.weight = nn.Parameter(torch.empty(local, in_features))
        nn.init.normal_(self.weight, std=init_std)
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None
        self._mark()

    def _configure(self, in_features, out_features, group, sequence_parallel, gather_input, seq_dim,
                   overlap_chunks, split: bool = True) -> None:
        if split and out_features % group.size:
            raise ValueError(f"tp={group.size} does not divide out_features={out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel = group, sequence_parallel and group.size > 1
        self.gather_input, self.seq_dim, self.overlap_chunks = gather_input, seq_dim, overlap_chunks
        self.used_rows: slice | None = None

    def _mark(self) -> None:
        if self.used_rows is not None:
            for p in (self.weight, self.bias):
                if p is not None:
                    sum_grad_over_group(p, self.group)
            return
        mark_sharded(self.weight, 0)
        if self.bias is not None:
            mark_sharded(self.bias, 0)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, group: Group, *, replicate_rows: slice | None = None,
                    sequence_parallel: bool = False, gather_input: bool = True, seq_dim: int = -2,
                    overlap_chunks: int = 1) -> ColumnParallelLinear:
        """This rank's rows of a full `nn.Linear` (or all of it, using `replicate_rows`)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        out_features = linear.out_features
        self._configure(linear.in_features, out_features, group, sequence_parallel, gather_input, seq_dim,
                        overlap_chunks, split=replicate_rows is None)
        if replicate_rows is None:
            n = out_features // group.size
            rows = slice(group.rank * n, (group.rank + 1) * n)
            self.weight = nn.Parameter(linear.weight[rows].clone())
            self.bias = None if linear.bias is None else nn.Parameter(linear.bias[rows].clone())
        else:
            if not 0 <= replicate_rows.start < replicate_rows.stop <= out_features:
                raise ValueError(f"replicate_rows={replicate_rows} is outside the {out_features} rows")
            self.used_rows = replicate_rows
            self.weight = linear.weight
            self.bias = linear.bias
        self._mark()
        return self

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """This rank's GEMM on `local_weight()`: F.linear; FP8 subclasses (precision/) override it."""
        return F.linear(x, weight, bias)

    def local_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.used_rows is None:
            return self.weight, self.bias
        return self.weight[self.used_rows], None if self.bias is None else self.bias[self.used_rows]

    def forward(self, x: torch.Tensor, *, input_entered: bool = False) -> torch.Tensor:
        return column_parallel_forward(x, [self], input_entered=input_entered)[0]

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {tuple(self.weight.shape)}), "
                f"tp={self.group.size}, sp={self.sequence_parallel}, gather_input={self.gather_input}")


def column_parallel_forward(x: torch.Tensor, layers, *, input_entered: bool = False) -> list[torch.Tensor]:
    """Run column-parallel layers that share one input, entering the TP region once for all."""
    first = layers[0]
    group, sp = first.group, first.sequence_parallel
    setting = (group, sp, first.gather_input, first.seq_dim, first.overlap_chunks)
    if any((l.group, l.sequence_parallel, l.gather_input, l.seq_dim, l.overlap_chunks, l.tp_comm_in_gemm) !=
           (*setting, first.tp_comm_in_gemm) for l in layers):
        raise ValueError("column_parallel_forward: the layers must share group, sequence_parallel, gather_input, "
                         "seq_dim, overlap_chunks and how they communicate")
    params = [layer.local_weight() for layer in layers]
    weights, biases = [w for w, _ in params], [b for _, b in params]
    if first.gather_input and not input_entered and group.size > 1:
        if sp and first.tp_comm_in_gemm:  # each GEMM gathers its input itself (TE userbuffers)
            return [layer.gather_linear(x, w, b) for layer, (w, b) in zip(layers, params)]
        if sp and first.overlap_chunks > 1:  # chunked overlap: high-precision GEMMs inside
            return all_gather_linear(x, weights, biases, group, first.seq_dim, first.overlap_chunks)
        # under sequence parallel the GEMMs (FP8 ones too) see the whole gathered sequence
        x = comm.all_gather(x, group, first.seq_dim % x.dim()) if sp else comm.copy_to_group(x, group)
    return [layer.linear(x, w, b) for layer, (w, b) in zip(layers, params)]


class RowParallelLinear(nn.Module):
    """`y = sum over ranks of x[..., rank's in slice] @ W[:, rank cols]^T (+ b)`.

    The sum is an all-reduce (output replicated) or, with sequence parallel, a reduce-scatter along
    `seq_dim` (output sharded on the sequence). The bias is added once, after the sum.
    `tp_comm_in_gemm`: `linear_reduce_scatter` reduce-scatters inside the GEMM (TE userbuffers).
    """

    tp_comm_in_gemm = False

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = False,
                 sequence_parallel: bool = False, seq_dim: int = -2, overlap_chunks: int = 1,
                 init_std: float = 0.02):
        super().__init__()
        self._configure(in_features, out_features, group, sequence_parallel, seq_dim, overlap_chunks)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // group.size))
        nn.init.normal_(self.weight, std=init_std)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._mark()

    def _configure(self, in_features, out_features, group, sequence_parallel, seq_dim, overlap_chunks) -> None:
        if in_features % group.size:
            raise ValueError(f"tp={group.size} does not divide in_features={in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel = group, sequence_parallel and group.size > 1
        self.seq_dim, self.overlap_chunks = seq_dim, overlap_chunks

    def _mark(self) -> None:
        mark_sharded(self.weight, 1)
        if self.bias is not None and self.sequence_parallel:
            sum_grad_over_group(self.bias, self.group)  # added to this rank's sequence shard only

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, group: Group, *, sequence_parallel: bool = False,
                    seq_dim: int = -2, overlap_chunks: int = 1) -> RowParallelLinear:
        """This rank's columns of a full `nn.Linear`; the bias (if any) stays whole."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._configure(linear.in_features, linear.out_features, group, sequence_parallel, seq_dim, overlap_chunks)
        n = linear.in_features // group.size
        self.weight = nn.Parameter(linear.weight[:, group.rank * n:(group.rank + 1) * n].clone())
        self.bias = linear.bias
        self._mark()
        return self

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """This rank's partial GEMM: F.linear; FP8 subclasses (precision/) override it."""
        return F.linear(x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self.linear(x, self.weight, self.bias)
        if self.sequence_parallel and self.tp_comm_in_gemm:  # the GEMM reduce-scatters (TE userbuffers)
            y = self.linear_reduce_scatter(x, self.weight)
        elif self.sequence_parallel and self.overlap_chunks > 1:  # high-precision GEMMs inside
            y = linear_reduce_scatter(x, self.weight, self.group, self.seq_dim, self.overlap_chunks)
        elif self.sequence_parallel:
            dim = self.seq_dim % x.dim()
            if x.shape[dim] % self.group.size:
                raise ValueError(f"sequence parallel: the sequence dim {dim} of shape {tuple(x.shape)} is not "
                                 f"divisible by tp={self.group.size}")
            y = comm.reduce_scatter(self.linear(x, self.weight, None), self.group, dim)
        else:
            y = comm.all_reduce(self.linear(x, self.weight, None), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, "
                f"tp={self.group.size}, sp={self.sequence_parallel}")

# ---- the SwiGLU MLP -----------------------------------------------------------------------


class TensorParallelMLP(MLP):
    """SwiGLU MLP split on the intermediate dim (gate/up column-parallel, down row-parallel)."""

    def forward(self, x: torch.Tensor, *, input_entered: bool = False) -> torch.Tensor:
        gate, up = column_parallel_forward(x, [self.gate_proj, self.up_proj], input_entered=input_entered)
        return self.down_proj(swiglu(gate, up))


def parallelize_mlp(mlp: MLP, tp: Group, sp: bool, chunks: int) -> MLP:
    kw = dict(sequence_parallel=sp, overlap_chunks=chunks)
    mlp.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, tp, **kw)
    mlp.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, tp, **kw)
    mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, tp, **kw)
    mlp.__class__ = TensorParallelMLP
    return mlp
