"""transformer_engine/pytorch/module/{linear,grouped_linear}.py (fake): `Linear` and `GroupedLinear`
with TE's constructor signatures, parameter names (`weight`, `bias`; `weight{i}`, `bias{i}`), forward
signatures and FP8 host checks (`assert_dim_for_fp8_exec` for Linear; per-GEMM rows a multiple of
`get_align_size_for_quantization` for GroupedLinear, which TE leaves to the caller's padding).
Outside an FP8 autocast they are plain linears (fp32 accumulation, one rounding).

`Linear` is tensor parallel as TE's (`parallel_mode` "column" / "row", `tp_group`, `sequence_parallel`
along dim 0, rows of the flattened input): the TP exchanges are torch collectives over `tp_group`,
or, with the `ub_*` switches, the Userbuffers communicators of module/base.py (`{ub_name}_fprop`,
`_dgrad`, `_wgrad`), as TE enables them: only for column (AG, RS-dgrad, bulk dgrad/wgrad) or row (RS,
AG-dgrad) parallel with sequence parallel, silently off otherwise. The fake quantizes the gathered
input (TE quantizes the shard, then gathers FP8: the same values for per-tensor scales reduced over
TP, TE's rule for column-parallel SP inputs) and keeps the gathered input for wgrad (TE re-gathers it
through `{ub_name}_dgrad` with ub_bulk_dgrad: the fake checks that communicator, exchanging nothing)."""

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from transformer_engine.pytorch import quantization as q
from transformer_engine.pytorch.module import base
from transformer_engine.pytorch.module.base import UserBufferQuantizationMode, destroy_ub, initialize_ub
from transformer_engine.pytorch.utils import assert_dim_for_fp8_exec, divide

GemmParallelModes = ("row", "column", None)
__all__ = ["Linear", "GroupedLinear", "initialize_ub", "destroy_ub", "UserBufferQuantizationMode"]


class _FP8Linear(torch.autograd.Function):
    """The three GEMMs of a linear layer on dequantized FP8 operands (fp32 accumulation)."""

    @staticmethod
    def forward(ctx, x2, weight, bias, recipe, meta, gemm, out_dtype):
        scale = (lambda role: meta.scale[meta.slot(gemm, role)]) if meta is not None else (lambda role: None)
        if meta is not None:  # record this call's amaxes (slot 0 of the history)
            meta.history[0, meta.slot(gemm, 0)] = x2.detach().abs().float().amax() if x2.numel() else 0.0
            meta.history[0, meta.slot(gemm, 1)] = weight.detach().abs().float().amax()
        xr = q.operand(x2, "input", "rowwise", recipe, scale(0))
        wr = q.operand(weight, "weight", "rowwise", recipe, scale(1))
        y = xr @ wr.t()
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(q.operand(x2, "input", "columnwise", recipe, scale(0)),
                              q.operand(weight, "weight", "columnwise", recipe, scale(1)))
        ctx.recipe, ctx.meta, ctx.gemm, ctx.has_bias = recipe, meta, gemm, bias is not None
        ctx.dtypes = (x2.dtype, weight.dtype)
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, dy):
        xc, wc = ctx.saved_tensors
        recipe, meta, gemm = ctx.recipe, ctx.meta, ctx.gemm
        g_scale = None
        if meta is not None:  # grad_output: scale from the last update, then record, reduce, update
            slot = meta.slot(gemm, 2)
            g_scale = meta.scale[slot].clone()
            amax = dy.detach().abs().float().amax().reshape(1) if dy.numel() else torch.zeros(1)
            q.reduce_amax(amax, recipe, meta.group)
            q.update_delayed(meta, amax, slice(slot, slot + 1), False)
        dyr = q.operand(dy, "grad_output", "rowwise", recipe, g_scale)
        dyc = q.operand(dy, "grad_output", "columnwise", recipe, g_scale)
        dx = (dyr @ wc).to(ctx.dtypes[0])
        dw = (dyc.t() @ xc).to(ctx.dtypes[1])
        db = dy.float().sum(0).to(dy.dtype) if ctx.has_bias else None
        return dx, dw, db, None, None, None, None


def _fp8_meta(module, recipe, gemms: int):
    if not isinstance(recipe, q.DelayedScaling):
        return None
    meta = module.__dict__.get("_fp8_meta")
    if meta is None or meta.recipe.amax_history_len != recipe.amax_history_len:
        meta = q.DelayedMeta(recipe, gemms)
        module.__dict__["_fp8_meta"] = meta
    meta.recipe, meta.group = recipe, q.FP8GlobalStateManager.get_fp8_group()
    q.FP8GlobalStateManager.region_metas.append(meta)
    return meta


def _gather_rows(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def _reduce_scatter_rows(x, group):
    full = x.contiguous().clone()
    dist.all_reduce(full, group=group)
    return full.chunk(dist.get_world_size(group))[dist.get_rank(group)].contiguous()


class _Gather(torch.autograd.Function):
    """Rows all-gathered (`fwd`: a ub communicator, else torch over `group`); backward reduce-scatters
    (`bwd` likewise). `check`: the bulk-dgrad communicator whose AG the fake only checks."""

    @staticmethod
    def forward(ctx, x, group, fwd, bwd, recipe, check):
        ctx.group, ctx.bwd, ctx.fp8 = group, bwd, recipe is not None
        if check is not None:
            base.fill_userbuffers_buffer_for_all_gather(check, x, recipe)
        return fwd.all_gather(x, recipe) if fwd is not None else _gather_rows(x, group)

    @staticmethod
    def backward(ctx, g):
        g = ctx.bwd.reduce_scatter(g, ctx.fp8) if ctx.bwd is not None else _reduce_scatter_rows(g, ctx.group)
        return g, None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Partial rows summed and scattered (`fwd`: a ub communicator, else torch); backward all-gathers."""

    @staticmethod
    def forward(ctx, y, group, fwd, bwd, recipe):
        ctx.group, ctx.bwd, ctx.recipe = group, bwd, recipe
        return fwd.reduce_scatter(y, recipe is not None) if fwd is not None else _reduce_scatter_rows(y, group)

    @staticmethod
    def backward(ctx, g):
        g = ctx.bwd.all_gather(g, ctx.recipe) if ctx.bwd is not None else _gather_rows(g, ctx.group)
        return g, None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, forward_reduce):
        ctx.group, ctx.forward_reduce = group, forward_reduce
        if forward_reduce:
            y = y.clone()
            dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        if not ctx.forward_reduce:
            g = g.clone()
            dist.all_reduce(g, group=ctx.group)
        return g, None, None


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable] = None, bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 parameters_split=None, device: Union[torch.device, str] = "cuda", ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type: Optional[str] = None, save_original_input: bool = False,
                 name: Optional[str] = None) -> None:
        super().__init__()
        if parameters_split is not None:
            raise NotImplementedError("the TE fake implements Linear without parameters_split")
        device = "cpu" if str(device).startswith("cuda") else device  # the fake's one device
        self.in_features, self.out_features, self.return_bias = in_features, out_features, return_bias
        self.tp_group = tp_group
        self.tp_size = tp_size if tp_group is None else dist.get_world_size(tp_group)
        self.parallel_mode = parallel_mode
        assert self.parallel_mode in GemmParallelModes, f"parallel_mode {parallel_mode} not supported"
        if self.parallel_mode == "column":
            self.out_features = divide(self.out_features, self.tp_size)
        elif self.parallel_mode == "row":
            self.in_features = divide(self.in_features, self.tp_size)
        self.sequence_parallel = (self.tp_size > 1) and sequence_parallel
        column_sp = self.parallel_mode == "column" and self.sequence_parallel
        row_sp = self.parallel_mode == "row" and self.sequence_parallel
        self.ub_overlap_ag_fprop = column_sp and ub_overlap_ag
        self.ub_overlap_rs_dgrad = column_sp and ub_overlap_rs_dgrad
        self.ub_bulk_dgrad = column_sp and ub_bulk_dgrad and not self.ub_overlap_rs_dgrad
        self.ub_bulk_wgrad = column_sp and ub_bulk_wgrad and not self.ub_overlap_rs_dgrad
        self.ub_overlap_rs_fprop = row_sp and ub_overlap_rs
        self.ub_overlap_ag_dgrad = row_sp and ub_overlap_ag
        if any([self.ub_overlap_rs_fprop, self.ub_overlap_ag_dgrad, self.ub_overlap_ag_fprop, self.ub_overlap_rs_dgrad,
                self.ub_bulk_dgrad, self.ub_bulk_wgrad]):
            assert base.is_ub_initialized(), "initialize_ub() must be called before layer construction."
            assert ub_name is not None, f"Comm+GEMM overlap layer '{ub_name}' is not initialized."
        self.ub_name = ub_name
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=dtype, device=device))
        (init_method or nn.init.xavier_uniform_)(self.weight)
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device)) if bias else None

    def _ub(self, on: bool, suffix: str, fp8: bool):
        return base.get_ub(self.ub_name + suffix, fp8) if on else None

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, fp8_output: Optional[bool] = False,
                fp8_grad: Optional[bool] = False):
        state = q.FP8GlobalStateManager
        fp8 = state.is_fp8_enabled()
        recipe = state.get_fp8_recipe() if fp8 else None
        assert inp.shape[-1] == self.weight.shape[1], "GEMM not possible"
        if fp8:
            assert_dim_for_fp8_exec(inp, self.weight)
        bias = None if self.return_bias else self.bias
        row_tp = self.parallel_mode == "row" and self.tp_size > 1
        gemm_bias = None if row_tp else bias  # TE adds a row-parallel bias after the reduction
        x2 = inp.reshape(-1, inp.shape[-1])
        if self.parallel_mode == "column" and self.sequence_parallel:
            x2 = _Gather.apply(x2, self.tp_group, self._ub(self.ub_overlap_ag_fprop, "_fprop", fp8),
                               self._ub(self.ub_overlap_rs_dgrad, "_dgrad", fp8) or
                               self._ub(self.ub_bulk_wgrad, "_wgrad", fp8), recipe,
                               self._ub(self.ub_bulk_dgrad, "_dgrad", fp8))
        elif self.parallel_mode == "column" and self.tp_size > 1:
            x2 = _AllReduce.apply(x2, self.tp_group, False)
        if not fp8:
            y = (x2.float() @ self.weight.float().t() + (0 if gemm_bias is None else gemm_bias.float())).to(inp.dtype)
        else:
            meta = _fp8_meta(self, recipe, 1)
            y = _FP8Linear.apply(x2, self.weight, gemm_bias, recipe, meta, 0, inp.dtype)
        if row_tp and self.sequence_parallel:
            y = _ReduceScatter.apply(y, self.tp_group, self._ub(self.ub_overlap_rs_fprop, "_fprop", fp8),
                                     self._ub(self.ub_overlap_ag_dgrad, "_dgrad", fp8), recipe)
        elif row_tp:
            y = _AllReduce.apply(y, self.tp_group, True)
        if row_tp and bias is not None:
            y = y + bias
        y = y.view(-1, *inp.shape[1:-1], self.out_features)
        return (y, self.bias) if self.return_bias else y


class GroupedLinear(nn.Module):
    def __init__(self, num_gemms: int, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable] = None, bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 device: Union[torch.device, str] = "cuda", ub_overlap_rs: bool = False, ub_overlap_ag: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False, save_original_input: bool = False,
                 single_grouped_weight: bool = False, single_grouped_bias: bool = False, name: Optional[str] = None,
                 use_grouped_tensor: Optional[bool] = None) -> None:
        super().__init__()
        if ub_overlap_rs or ub_overlap_ag:
            raise ValueError("GroupedLinear doesn't support Userbuffer overlap.")
        device = "cpu" if str(device).startswith("cuda") else device
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        dtype = params_dtype or torch.get_default_dtype()
        for i in range(num_gemms):
            w = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
            (init_method or nn.init.xavier_uniform_)(w)
            self.register_parameter(f"weight{i}", w)
            self.register_parameter(f"bias{i}", nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
                                    if bias else None)

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: Optional[bool] = None, out=None,
                dgrad_out=None):
        if not isinstance(m_splits, torch.Tensor):
            m_splits = torch.tensor(m_splits, dtype=torch.int64, device="cpu")
        elif m_splits.dtype != torch.int64:
            m_splits = m_splits.to(dtype=torch.int64)
        if m_splits.size() != (self.num_gemms,):
            raise ValueError(f"Shape of splits tensor ({tuple(m_splits.size())}) "
                             f"does not match number of GEMMs ({self.num_gemms}).")
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        if inp.size(-1) != self.in_features:
            raise ValueError(f"Input tensor (shape={tuple(inp.size())}) is not compatible with "
                             f"weight tensor (shape={tuple(weights[0].size())})")
        splits = m_splits.tolist()
        state = q.FP8GlobalStateManager
        pieces = inp.reshape(-1, self.in_features).split(splits)
        if not state.is_fp8_enabled():
            outs = [(x.float() @ w.float().t()).to(inp.dtype) for x, w in zip(pieces, weights)]
        else:
            recipe = state.get_fp8_recipe()
            align = 32 if recipe.mxfp8() else 16
            if any(m % align for m in splits):
                raise ValueError(f"FP8 GroupedLinear needs every m_split padded to a multiple of {align} "
                                 f"(get_align_size_for_quantization); got {splits}")
            assert_dim_for_fp8_exec(weights[0])
            meta = _fp8_meta(self, recipe, self.num_gemms)
            outs = [_FP8Linear.apply(x, w, None, recipe, meta, i, inp.dtype) for i, (x, w) in
                    enumerate(zip(pieces, weights))]
        y = torch.cat(outs) if outs else inp.new_zeros(0, self.out_features)
        if self.use_bias and not self.return_bias:
            y = y + torch.cat([getattr(self, f"bias{i}").expand(m, -1) for i, m in enumerate(splits)])
        return y
