"""FP8 modules on Transformer Engine: `te.Linear` / `te.GroupedLinear` sharing moetron's parameters,
each call in its own `te.autocast` whose amaxes reduce over the module's `fp8_amax_group` (the
stage's data/context-parallel ranks, never WORLD: pipeline stages run different modules).

TE's FP8 GEMM shape rule (rows % 8, in_features % 16, out_features % 8): rows are zero-padded
(numerically neutral: zeros change no amax), features are checked when the module is converted.
With `parallel.tp_comm_overlap` the sequence-parallel linears are TE's own tensor-parallel `te.Linear`s
on Userbuffers (`te_tp_linear_forward`; one communicator per projection kind, `init_te_userbuffers`).
Design notes: docs/fp8.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moetron.ops import swiglu
from moetron.parallel.state import rank_groups
from moetron.precision.fp8 import FP8Recipe

TE_ROWS, TE_IN, TE_OUT = 8, 16, 8


def te_shape_problem(in_features: int, out_features: int) -> str | None:
    """Why TE cannot run an FP8 GEMM with this weight (None: it can)."""
    if in_features % TE_IN or out_features % TE_OUT:
        return (f"Transformer Engine's FP8 GEMMs need in_features % {TE_IN} == 0 and out_features % {TE_OUT} == 0; "
                f"this weight is [{out_features}, {in_features}]")
    return None


def te_recipe(recipe: FP8Recipe):
    """The Transformer Engine recipe object for `recipe`."""
    from transformer_engine.common import recipe as te_r

    fmt = te_r.Format.HYBRID if recipe.fp8_format == "hybrid" else te_r.Format.E4M3
    if recipe.scaling == "delayed":
        return te_r.DelayedScaling(margin=recipe.margin, fp8_format=fmt, amax_history_len=recipe.amax_history_len,
                                   amax_compute_algo=recipe.amax_compute_algo)
    if recipe.scaling == "tensorwise":
        return te_r.Float8CurrentScaling(fp8_format=fmt)
    if recipe.scaling == "mxfp8":
        return te_r.MXFP8BlockScaling(fp8_format=fmt)
    return te_r.Float8BlockScaling(fp8_format=fmt)


def te_autocast(recipe: FP8Recipe, group):
    """One TE autocast region; amaxes reduce over `group` (a ProcessGroup; None in one process)."""
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):  # TE >= 2.8
        return te.autocast(enabled=True, recipe=te_recipe(recipe), amax_reduction_group=group)
    return te.fp8_autocast(enabled=True, fp8_recipe=te_recipe(recipe), fp8_group=group)


def te_linear_forward(module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on a `te.Linear` sharing `weight` / `bias` (a module's parameters,
    or this tensor-parallel rank's rows of one: TP communication stays moetron's)."""
    import transformer_engine.pytorch as te

    out_features, in_features = weight.shape
    if module._te_module is None:
        tl = te.Linear(in_features, out_features, bias=bias is not None, params_dtype=weight.dtype,
                       device=weight.device)
        object.__setattr__(module, "_te_module", tl)
    tl = module._te_module
    tl.train(module.training)
    for name, t in (("weight", weight), ("bias", bias)):  # share ours (same objects, our names)
        if isinstance(t, torch.nn.Parameter):
            tl._parameters[name] = t
        elif t is not None:  # a view of a parameter (replicated kv rows)
            tl._parameters.pop(name, None)
            object.__setattr__(tl, name, t)
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    pad = -rows % TE_ROWS
    with te_autocast(module.fp8_recipe, module.fp8_amax_group):
        y = tl(F.pad(x2, (0, 0, 0, pad)) if pad else x2)
    return (y[:rows] if pad else y).view(*x.shape[:-1], out_features)


def te_experts_forward(module, x_NH: torch.Tensor, rows_per_expert: torch.Tensor) -> torch.Tensor:
    """gate_up -> SwiGLU -> down on two `te.GroupedLinear`s (rows per expert padded by the dispatcher)."""
    import transformer_engine.pytorch as te

    E, F_, H = module.num_local_experts, module.local_ffn_size, module.gate_up_proj.shape[-1]
    if module._te_module is None:
        kw = dict(bias=False, params_dtype=module.gate_up_proj.dtype, device=module.gate_up_proj.device)
        object.__setattr__(module, "_te_module", (te.GroupedLinear(E, H, 2 * F_, **kw), te.GroupedLinear(E, F_, H, **kw)))
    splits = rows_per_expert.tolist()
    outs = x_NH
    with te_autocast(module.fp8_recipe, module.fp8_amax_group):
        for tg, weight, act in zip(module._te_module, (module.gate_up_proj, module.down_proj), (True, False)):
            tg.train(module.training)
            for e in range(E):  # our [E,O,I] parameter's slices stand in for TE's weight{e}
                tg._parameters.pop(f"weight{e}", None)
                object.__setattr__(tg, f"weight{e}", weight[e])
            outs = tg(outs, splits)
            if act:
                gate, up = outs.split(F_, dim=-1)
                outs = swiglu(gate, up)
    return outs


# ---- Userbuffers: TE's own TP all-gather->GEMM / GEMM->reduce-scatter overlap ------------------

# Megatron's ub_name per projection: the column-parallel ones read the hidden states (AG), the
# row-parallel ones write them (RS); the communicators hold [seq x batch, hidden]
UB_NAMES = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "q_b_proj": "qkv", "o_proj": "proj",
            "gate_proj": "fc1", "up_proj": "fc1", "down_proj": "fc2"}
UB_MODES = {"qkv": "column", "fc1": "column", "proj": "row", "fc2": "row"}


def te_ub_name(module_name: str) -> str | None:
    """The Userbuffers name of a projection (None: not one of Megatron's overlapped GEMMs)."""
    return UB_NAMES.get(module_name.rpartition(".")[2])


def te_userbuffers_problem(scaling: str, rows: int, tp: int, hidden: int) -> str | None:
    """Why TE's Userbuffers cannot carry `rows` = seq x micro-batch tokens of `hidden` over `tp` ranks
    in FP8 `scaling` (None: they can). TE's own checks, raised here before the first step."""
    if scaling == "blockwise":
        return "TE's Userbuffers carry no FP8 block-scaled tensors (Float8BlockScaling)"
    if rows % tp:
        return f"seq x micro-batch = {rows} tokens do not split over tp={tp}"
    local = rows // tp
    if local % TE_ROWS or hidden % TE_IN:
        return (f"TE's FP8 GEMMs need each rank's {local} tokens % {TE_ROWS} == 0 and hidden {hidden} % {TE_IN} "
                f"== 0")
    if scaling == "mxfp8" and local % 128:
        return f"TE's Userbuffers need MXFP8 row counts divisible by 128; each rank holds {local} tokens"
    return None


def init_te_userbuffers(shape: list[int], tp: int, dtype: torch.dtype) -> None:
    """TE's `initialize_ub` for this run (collective over WORLD): FP8 buffers of `shape`
    [seq x micro-batch, hidden]; a previous run's communicators are destroyed first."""
    from transformer_engine.pytorch.module import base

    if base.is_ub_initialized():
        base.destroy_ub()
    base.initialize_ub(list(shape), tp, quantization_modes=[base.UserBufferQuantizationMode.FP8], dtype=dtype)


def setup_te_userbuffers(named_modules, ps, hidden: int, tokens: int, dtype: torch.dtype, scaling: str) -> list[str]:
    """Check and initialize TE's userbuffers for the modules marked `tp_comm_in_gemm`, whose
    `tokens` (seq x micro-batch, this CP rank's) of `hidden` cross the TP group. A projection of
    another width (MLA's q_b_proj reads the q latent) runs TE's tensor-parallel GEMM with its plain
    all-gather: returns their names. Collective (every rank of WORLD)."""
    tp = ps.tp.size
    ranks = tuple(ps.tp.ranks)
    if ranks != tuple(range(ranks[0] // tp * tp, ranks[0] // tp * tp + tp)):
        raise ValueError(f"TE's userbuffers (parallel.tp_comm_overlap with Transformer Engine) exchange within "
                         f"blocks of {tp} consecutive ranks, but this TP group is ranks {list(ranks)}: put tp first "
                         f"in parallel.order, or set parallel.tp_comm_overlap=false")
    why = te_userbuffers_problem(scaling, tokens, tp, hidden)
    if why:
        raise ValueError(f"train.fp8={scaling} with parallel.tp_comm_overlap on Transformer Engine: {why}. Change "
                         f"train.seq_len / train.micro_batch_size, or set parallel.tp_comm_overlap=false")
    plain = []
    for name, m in named_modules:
        if getattr(m, "tp_comm_in_gemm", False):
            width = m.in_features if UB_MODES.get(m.te_ub_name) == "column" else m.out_features
            m.te_ub_tokens = tokens
            if width != hidden:
                m.te_ub_name = None
                plain.append(name)
    init_te_userbuffers([tokens, hidden], tp, dtype)
    return plain


def te_tp_linear_forward(module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         mode: str) -> torch.Tensor:
    """A column- ("column": `x` is this rank's sequence shard, the output the whole sequence) or
    row-parallel ("row": the reverse, summed over TP) linear as TE's `te.Linear` on Userbuffers:
    TE's layout is sequence-first, so the sequence dim moves to the front and back."""
    import transformer_engine.pytorch as te

    tp = module.group.size
    out_local, in_local = weight.shape
    rows = x.numel() // x.shape[-1] * (tp if mode == "column" else 1)
    # the buffers hold one training micro-batch; other calls (greedy sampling) take TE's plain TP exchange
    ub_name = module.te_ub_name if rows == getattr(module, "te_ub_tokens", None) else None
    if module._te_module is None:
        object.__setattr__(module, "_te_module", {})
    if ub_name not in module._te_module:
        full = (in_local, out_local * tp) if mode == "column" else (in_local * tp, out_local)
        ub = {} if ub_name is None else dict(ub_overlap_ag=True, ub_bulk_dgrad=True, ub_bulk_wgrad=True) \
            if mode == "column" else dict(ub_overlap_rs=True, ub_overlap_ag=True)
        module._te_module[ub_name] = te.Linear(*full, sequence_parallel=True, tp_group=module.group.handle,
                                               parallel_mode=mode, bias=bias is not None, params_dtype=weight.dtype,
                                               device=weight.device, ub_name=ub_name, **ub)
    tl = module._te_module[ub_name]
    tl.train(module.training)
    for name, t in (("weight", weight), ("bias", bias)):  # share ours, as te_linear_forward
        if isinstance(t, torch.nn.Parameter):
            tl._parameters[name] = t
        elif t is not None:
            tl._parameters.pop(name, None)
            object.__setattr__(tl, name, t)
    dim = module.seq_dim % x.dim()
    with te_autocast(module.fp8_recipe, module.fp8_amax_group):
        y = tl(x.movedim(dim, 0).contiguous())
    return y.movedim(0, dim)


__all__ = ["amax_reduction_group", "init_te_userbuffers", "setup_te_userbuffers", "te_autocast", "te_experts_forward", "te_linear_forward",
           "te_recipe", "te_shape_problem", "te_tp_linear_forward", "te_ub_name", "te_userbuffers_problem"]


_STAGE_GROUPS: dict = {}


def amax_reduction_group(ps):
    """Megatron's amax reduction group for Transformer Engine: this pipeline stage's TP x DP x CP ranks
    (`ps.dp_cp` when tp=1; WORLD's ranks with pp=1). Collective the first time when pp > 1 and tp > 1."""
    if ps.tp.size == 1:
        return ps.dp_cp.handle
    if ps.pp.size == 1:
        return ps.world.handle
    sizes = ps.sizes
    key = (id(ps.world.handle), sizes.world_size, tuple(sizes.order), ps.pp.size)
    if key not in _STAGE_GROUPS:  # every rank creates every stage's group, in one order
        lists = rank_groups(sizes.attention_grid(), sizes.order, ("tp", "cp", "dp"))
        _STAGE_GROUPS[key] = {tuple(r): dist.new_group(list(r)) for r in lists}
    return next(h for ranks, h in _STAGE_GROUPS[key].items() if ps.rank in ranks)
