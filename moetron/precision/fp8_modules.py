"""FP8 modules and `apply_fp8`: run a model's projections and routed experts in FP8.

    model = MoETransformer(cfg)                    # after any parallelization that rebuilds modules
    apply_fp8(model, "blockwise")                  # or tensorwise / delayed / an FP8Recipe
    out = model(input_ids, labels=labels)          # same parameters, same names, FP8 GEMMs

Design notes: docs/fp8.md (`moetron/precision/fp8_modules.py`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from moetron import backends
from moetron.moe.experts import GroupedExperts
from moetron.moe.layer import MoELayer
from moetron.ops import swiglu
from moetron.precision.fp8 import ROLES, FP8Recipe, Quantized, get_fp8_recipe, quantize_operand, quantize_weight_for_dgrad
from moetron.precision.fp8_backend import choose_fp8_backend, probe_capabilities
from moetron.precision.fp8_matmul import check_backend, fp8_grouped_linear, fp8_linear
from moetron.precision.te_modules import (UB_NAMES, te_experts_forward, te_linear_forward, te_shape_problem,
                                         te_tp_linear_forward, te_ub_name)
from moetron.parallel.state import Group, named_rank_groups
from moetron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

HISTORY = "fp8_amax_history"


def fp8_backend_choice(recipe: FP8Recipe | str) -> tuple[str, str]:
    """`(backend, reason)`: what `apply_fp8` runs `recipe` on here (see fp8_backend.py)."""
    recipe = get_fp8_recipe(recipe)
    check_backend(recipe)
    return choose_fp8_backend(recipe, probe_capabilities())


def _module_backend(name: str, recipe: FP8Recipe, chosen: str, shapes: list[tuple[int, int]]) -> str:
    """The chosen backend, unless TE cannot take this module's shapes: then an error when TE was
    asked for, the GEMM backends ('auto') when TE was only picked by 'auto'."""
    if chosen != "te":
        return chosen
    problem = next((p for p in (te_shape_problem(i, o) for i, o in shapes) if p), None)
    if problem is None:
        return "te"
    if recipe.backend == "te":
        raise ValueError(f"module {name!r}: {problem}. Exclude it (apply_fp8(..., exclude=[{name!r}])), change the "
                         f"model's sizes, or use train.fp8_backend=auto / emulate")
    return "auto"


def _init_fp8(module: nn.Module, recipe: FP8Recipe, groups: int, device: torch.device, backend: str = "auto") -> None:
    module.fp8_recipe = recipe
    module.fp8_backend = backend
    module.fp8_amax_group = None  # TE's amax_reduction_group (apply_fp8's amax_group)
    module.fp8_reducers = module.fp8_eval_reducers = None  # role -> amax reduction (set_fp8_reductions)
    object.__setattr__(module, "_fp8_gathered", {})  # id(param) -> (param, version, Quantized): fp8_param_gather
    object.__setattr__(module, "_fp8_weight_cache", {})  # (id(param), rows) -> Q(W) of the current weights
    module.fp8_cache_weights = False  # inside cache_fp8_weights(): _weight_operands
    length = recipe.amax_history_len if recipe.scaling == "delayed" else 0
    module.register_buffer(HISTORY, torch.zeros(len(ROLES), length, groups, device=device), persistent=False)
    object.__setattr__(module, "_te_module", None)  # built on first use, outside the module tree


def _history(module: nn.Module) -> torch.Tensor | None:
    return getattr(module, HISTORY) if module.fp8_recipe.scaling == "delayed" else None


def _max_over(groups) -> object | None:
    """An in-place MAX all-reduce of an amax tensor over each group (of size > 1) in turn."""
    handles = [g.handle for g in groups if g is not None and g.size > 1]
    if not handles:
        return None

    def reduce_amax(amax: torch.Tensor) -> None:
        for handle in handles:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=handle)

    return reduce_amax


def set_fp8_reductions(module: nn.Module, groups_by_role: dict, training_only=()) -> None:
    """Make `module`'s tensorwise/delayed scales agree over process groups: `groups_by_role` maps
    "input" / "weight" / "grad_output" to the Groups whose ranks hold other parts of that operand
    (their amaxes are MAX-reduced over each in turn). Groups in `training_only` (data parallel: its
    ranks may run different numbers of evaluation forwards) are skipped in calls without autograd.
    Design notes: docs/fp8.md ("Tensor parallel")."""
    def build(skip):
        reducers = {role: _max_over([g for g in groups_by_role.get(role, ()) if g not in skip]) for role in ROLES}
        return {r: f for r, f in reducers.items() if f is not None} or None

    module.fp8_reducers, module.fp8_eval_reducers = build(()), build(tuple(training_only))


def _reducers(module: nn.Module) -> dict | None:
    """The module's amax reductions for this call (decided outside the autograd functions)."""
    return module.fp8_reducers if torch.is_grad_enabled() else module.fp8_eval_reducers


def set_gathered_weight(module: nn.Module, param: torch.Tensor, q: Quantized) -> None:
    """Use `q` as Q(param) in `module`'s FP8 GEMMs while `param` is unchanged (fp8_param_gather)."""
    module._fp8_gathered[id(param)] = (param, param._version, q)


def gathered_weight(module: nn.Module, param: torch.Tensor, rows: slice | None = None) -> Quantized | None:
    """The FP8 weight set by set_gathered_weight (its `rows` only), None when absent or stale."""
    hit = module._fp8_gathered.get(id(param))
    if hit is None or hit[0] is not param or hit[1] != param._version:
        return None
    q = hit[2]
    if rows is None:
        return q
    return Quantized(q.data[rows], q.scale, None if q.row_map is None else q.row_map[rows], q.col_map)


@contextlib.contextmanager
def cache_fp8_weights(model: nn.Module):
    """Quantize each FP8 weight once for the forwards and backwards run inside (one training step's
    micro-batches, whose weights do not change), as Transformer Engine's `is_first_microbatch`.

    Wrap no optimizer step in it: optimizers write parameters in place (moetron's through views of
    a flat buffer, which torch's version counters do not see), so the cache lives for the block only."""
    # the attribute sits in the instance's __dict__ (_init_fp8): hasattr would go through nn.Module's
    # __getattr__ and raise for every other module, ~0.3 ms a step for a 4-layer model without FP8
    modules = [m for m in model.modules() if "_fp8_weight_cache" in m.__dict__]
    for m in modules:
        m._fp8_weight_cache.clear()
        m.fp8_cache_weights = m.fp8_recipe.scaling != "delayed"  # delayed: its history moves every call
    try:
        yield model
    finally:
        for m in modules:
            m._fp8_weight_cache.clear()
            m.fp8_cache_weights = False


def _weight_operands(module: nn.Module, weight: torch.Tensor, param: torch.Tensor, rows: slice | None,
                     history: torch.Tensor | None) -> tuple[Quantized | None, Quantized | None]:
    """Q(W) and its input-gradient operand, or (None, None) to quantize inside the GEMM.

    Inside cache_fp8_weights, current scaling quantizes the same weights to the same bytes in
    every micro-batch, so the first result is reused: one FP8 copy per step in memory and in
    backward's saved tensors, instead of one per micro-batch in flight."""
    gathered = gathered_weight(module, param, rows)
    if gathered is not None or not module.fp8_cache_weights:
        return gathered, None
    key = (id(param), None if rows is None else (rows.start, rows.stop))
    hit = module._fp8_weight_cache.get(key)
    if hit is not None and hit[0] is param and hit[1] == (param._version, param.data_ptr()):
        return hit[2], hit[3]
    recipe, reducers = module.fp8_recipe, _reducers(module)
    with torch.no_grad():
        w = weight.detach()
        qw = quantize_operand(w, "weight", recipe, history, reduce_amax=None if reducers is None
                              else reducers.get("weight"))
        qd = quantize_weight_for_dgrad(w, qw, recipe)
    module._fp8_weight_cache[key] = (param, (param._version, param.data_ptr()), qw, qd)
    return qw, qd


def _fp8_dense(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               param: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` in FP8 for a dense FP8 module (`weight` is `param[rows]`)."""
    backend = _gemm_backend(module, x)
    if backend == "te":
        return te_linear_forward(module, x, weight, bias)
    history = _history(module)
    qw, qd = _weight_operands(module, weight, param, rows, history)
    return fp8_linear(x, weight, bias, module.fp8_recipe, history, backend, reducers=_reducers(module),
                      qweight=qw, qweight_dgrad=qd)


def _gemm_backend(module: nn.Module, x: torch.Tensor) -> str:
    """'te' (run the Transformer Engine module) for CUDA inputs (or TE's CPU fake) when TE was
    chosen; otherwise the GEMM backend. A CPU input of a module that auto-selected TE uses the
    auto GEMMs."""
    if module.fp8_backend != "te":
        return module.fp8_backend
    if x.is_cuda or backends.cpu_fake("transformer_engine"):
        return "te"
    if module.fp8_recipe.backend == "te":
        raise RuntimeError(f"FP8 backend 'te' (Transformer Engine) runs on CUDA tensors only; got {x.device}")
    return "auto"


class FP8Linear(nn.Linear):
    """`nn.Linear` whose three GEMMs (forward, input grad, weight grad) run in FP8."""

    fp8_recipe: FP8Recipe
    fp8_backend: str

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: FP8Recipe | str, backend: str | None = None,
                    name: str = "linear") -> FP8Linear:
        """Convert `linear` in place (same parameters) and return it."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"FP8Linear.from_linear expects a plain nn.Linear, got {type(linear).__name__}")
        recipe = get_fp8_recipe(recipe)
        backend = _module_backend(name, recipe, backend or fp8_backend_choice(recipe)[0],
                                  [(linear.in_features, linear.out_features)])
        linear.__class__ = cls
        _init_fp8(linear, recipe, 1, linear.weight.device, backend)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fp8_dense(self, x, self.weight, self.bias, self.weight)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_recipe.scaling}/{self.fp8_recipe.fp8_format}"


def _tp_to_fp8(module: nn.Module, cls: type, recipe: FP8Recipe, backend: str, name: str) -> nn.Module:
    """Convert a tensor-parallel linear in place; its local GEMMs (`linear`) become FP8. Under
    parallel.tp_comm_overlap on Transformer Engine, TE's userbuffers overlap its TP communication."""
    out_f, in_f = module.weight.shape
    backend = _module_backend(name, recipe, backend, [(in_f, out_f)])
    overlap = module.sequence_parallel and module.overlap_chunks > 1 and getattr(module, "gather_input", True)
    if overlap and (backend != "te" or te_ub_name(name) is None):
        why = ("moetron's chunked all-gather/reduce-scatter overlap runs its GEMMs in high precision; "
               "train.fp8_backend=te overlaps them with TE's userbuffers" if backend != "te" else
               f"TE's userbuffers overlap only Megatron's qkv / proj / fc1 / fc2 GEMMs ({sorted(UB_NAMES)})")
        raise ValueError(f"module {name!r}: FP8 with parallel.tp_comm_overlap: {why}. Set "
                         f"parallel.tp_comm_overlap=false, or exclude the module from FP8")
    module.__class__ = cls
    _init_fp8(module, recipe, 1, module.weight.device, backend)
    if overlap:
        module.tp_comm_in_gemm, module.te_ub_name = True, te_ub_name(name)
    return module


class FP8ColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear whose local GEMMs run in FP8; the weight shard and the output-gradient
    shard take the whole tensor's scale (amaxes reduced over TP), the input is gathered first."""

    fp8_recipe: FP8Recipe
    fp8_backend: str

    def linear(self, x, weight, bias):
        return _fp8_dense(self, x, weight, bias, self.weight, self.used_rows)

    def gather_linear(self, x, weight, bias):
        """The GEMM on the whole sequence of sequence-shard `x`: TE all-gathers it on userbuffers."""
        return te_tp_linear_forward(self, x, weight, bias, "column")


class FP8RowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose partial GEMM runs in FP8; the input shard and the weight shard take the
    whole tensor's scale (amaxes reduced over TP); the sum over ranks stays in high precision."""

    fp8_recipe: FP8Recipe
    fp8_backend: str

    def linear(self, x, weight, bias):
        return _fp8_dense(self, x, weight, bias, self.weight)

    def linear_reduce_scatter(self, x, weight):
        """The partial GEMM summed over TP, this rank's sequence shard: TE reduce-scatters on userbuffers."""
        return te_tp_linear_forward(self, x, weight, None, "row")


class FP8GroupedExperts(GroupedExperts):
    """GroupedExperts whose grouped GEMMs run in FP8 (per-expert scales or blockwise tiles).

    Still a GroupedExperts, so DataParallel treats its parameters as expert parameters, and
    sharding helpers (`load_full_experts`, `full_expert_weights`) work unchanged."""

    fp8_recipe: FP8Recipe
    fp8_backend: str
    takes_probs = False  # the combine applies the routing weights (moe/layer.py: probs_on_experts)

    @classmethod
    def from_experts(cls, experts: GroupedExperts, recipe: FP8Recipe | str, backend: str | None = None,
                     name: str = "experts") -> FP8GroupedExperts:
        """Convert `experts` in place (same parameters) and return it."""
        if type(experts) is not GroupedExperts:
            raise TypeError(f"FP8GroupedExperts.from_experts expects GroupedExperts, got {type(experts).__name__}")
        recipe = get_fp8_recipe(recipe)
        H, F = experts.gate_up_proj.shape[-1], experts.local_ffn_size
        backend = _module_backend(name, recipe, backend or fp8_backend_choice(recipe)[0], [(H, 2 * F), (F, H)])
        experts.__class__ = cls
        # delayed scaling: columns [0, E) for gate_up, [E, 2E) for down
        _init_fp8(experts, recipe, 2 * experts.num_local_experts, experts.gate_up_proj.device, backend)
        return experts

    def extra_repr(self) -> str:
        return (f"local_experts={self.num_local_experts}, ffn={self.local_ffn_size}, "
                f"fp8={self.fp8_recipe.scaling}/{self.fp8_recipe.fp8_format}")

    def _linear(self, x_NH, weight, rows_per_expert, which: int, backend: str) -> torch.Tensor:
        history = _history(self)
        if history is not None:  # gate_up and down keep separate histories (halves of the G axis)
            history = history.narrow(2, which * self.num_local_experts, self.num_local_experts)
        qw, qd = _weight_operands(self, weight, weight, None, history)
        return fp8_grouped_linear(x_NH, weight, rows_per_expert, self.fp8_recipe, history, backend, self.backend,
                                  reducers=_reducers(self), qweight=qw, qweight_dgrad=qd)

    def forward(self, x_NH: torch.Tensor, rows_per_expert: torch.Tensor) -> torch.Tensor:
        backend = _gemm_backend(self, x_NH)
        if backend == "te":
            return te_experts_forward(self, x_NH, rows_per_expert)
        gate_up = self._linear(x_NH, self.gate_up_proj, rows_per_expert, 0, backend)
        gate, up = gate_up.split(self.local_ffn_size, dim=-1)
        return self._linear(swiglu(gate, up), self.down_proj, rows_per_expert, 1, backend)


# ---- apply_fp8 -------------------------------------------------------------------------------


def _high_precision_linears(model: nn.Module) -> set[int]:
    """ids of the Linear modules that stay high precision by rule: output heads, MoE gates."""
    keep = set()
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in ("lm_head", "output_layer"):
            keep.add(id(module))
        if isinstance(module, MoELayer) and module.shared_expert_gate is not None:
            keep.add(id(module.shared_expert_gate))
    return keep


_TP_FP8 = {ColumnParallelLinear: FP8ColumnParallelLinear, RowParallelLinear: FP8RowParallelLinear}


def _reductions(module: nn.Module, recipe: FP8Recipe, ps, token_group: Group | None) -> dict:
    """role -> the groups whose ranks hold other parts of that operand (docs/fp8.md, "Tensor parallel"):
    TP shards (column: weight rows and output-gradient columns; row: input columns and weight columns;
    experts: ETP ffn slices), tokens of other sequence shards (replicated linears under SP), and for
    delayed scaling Megatron's amax reduction group (TP x DP x CP) for dense modules."""
    roles: dict[str, list] = {r: [] for r in ROLES}
    if isinstance(module, FP8GroupedExperts):  # ffn slices over ETP; the TP group's tokens split over ranks
        groups = [module.etp_group, token_group]
        for r in ROLES:
            roles[r] = [g for g in groups if g is not None]
        return roles
    if isinstance(module, FP8ColumnParallelLinear):
        sharded = ("weight", "grad_output")
    elif isinstance(module, FP8RowParallelLinear):
        sharded = ("input", "weight")
    else:
        sharded = ("input", "grad_output") if ps is not None and ps.sequence_parallel else ()
    tp = getattr(module, "group", None) or (ps.tp if ps is not None else None)
    for r in sharded:
        roles[r].append(tp)
    if recipe.scaling == "delayed" and ps is not None:
        for r in ROLES:
            roles[r] = [tp if tp is not None else ps.tp, ps.dp_cp]
    return roles


_TOKEN_GROUPS: dict = {}


def expert_token_group(ps) -> Group | None:
    """The ranks of this rank's TP group that hold the same experts (same EP coordinate): a tensor-parallel
    MoE layer splits the TP group's tokens over them, so an expert's rows in one process are the union of
    theirs. Collective (every rank creates every such group) the first time for a layout with tp > 1."""
    if ps.tp.size == 1:
        return None
    key = (id(ps.world.handle), ps.sizes)
    if key not in _TOKEN_GROUPS:
        lists = named_rank_groups(ps.sizes)
        ep_coord = {r: i for ranks in lists["ep"] for i, r in enumerate(ranks)}
        subsets = sorted({tuple(r for r in tp if ep_coord[r] == c) for tp in lists["tp"] for c in set(ep_coord.values())})
        handles = {s: dist.new_group(list(s)) for s in subsets if len(s) > 1}  # same order on every rank
        _TOKEN_GROUPS[key] = {s: (Group("tp_same_experts", s, s.index(ps.rank), h) if ps.rank in s else None)
                              for s, h in handles.items()}
    return next((g for g in _TOKEN_GROUPS[key].values() if g is not None), None)


def apply_fp8(model: nn.Module, recipe: FP8Recipe | str, *, exclude: Iterable[str] = (),
              amax_group=None, parallel_state=None) -> nn.Module:
    """Make `model`'s projections and routed experts FP8, in place; returns `model`.

    `recipe`: an FP8Recipe or a name ("tensorwise", "delayed", "blockwise", "mxfp8"). `exclude`:
    fnmatch patterns of module names (as in `named_modules()`) to keep in high precision.
    `amax_group`: the ProcessGroup Transformer Engine reduces amaxes over (the stage's tensor, data
    and context parallel ranks; None in one process). `parallel_state`: the model's layout; its groups
    make scales agree across ranks (`_reductions`). The backend is chosen once: `fp8_backend_choice`.
    Tensor-parallel linears become FP8 (the vocab-parallel head stays in high precision).
    """
    recipe = get_fp8_recipe(recipe)
    chosen, _ = fp8_backend_choice(recipe)  # a named backend that cannot run here fails now
    patterns = list(exclude)
    token_group = expert_token_group(parallel_state) if parallel_state is not None else None  # collective
    keep = _high_precision_linears(model)
    targets = []
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns) or id(module) in keep:
            continue
        if isinstance(module, (FP8Linear, FP8GroupedExperts, *_TP_FP8.values())):
            raise ValueError(f"module {name!r} is already FP8; apply_fp8 runs once per model")
        if type(module) in (nn.Linear, GroupedExperts, *_TP_FP8):
            targets.append((name, module))
    for name, module in targets:
        if isinstance(module, GroupedExperts):
            FP8GroupedExperts.from_experts(module, recipe, chosen, name)
        elif type(module) in _TP_FP8:
            _tp_to_fp8(module, _TP_FP8[type(module)], recipe, chosen, name)
        else:
            FP8Linear.from_linear(module, recipe, chosen, name)
        module.fp8_amax_group = amax_group
        set_fp8_reductions(module, _reductions(module, recipe, parallel_state, token_group),
                           training_only=() if parallel_state is None else (parallel_state.dp_cp,))
    for module in model.modules():  # FP8 grouped GEMMs want each expert's rows padded
        if isinstance(module, MoELayer) and isinstance(module.experts, FP8GroupedExperts):
            dispatcher = module.dispatcher
            if hasattr(dispatcher, "pad_multiple"):
                dispatcher.pad_multiple = math.lcm(dispatcher.pad_multiple, recipe.grouped_pad_multiple)
    return model


def fp8_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The FP8 modules of `model` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (FP8Linear, FP8GroupedExperts, *_TP_FP8.values()))}


def fp8_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Delayed-scaling amax histories by `<module>.fp8_amax_history` (empty for stateless recipes)."""
    return {f"{n}.{HISTORY}": getattr(m, HISTORY).detach().clone() for n, m in fp8_modules(model).items()
            if m.fp8_recipe.scaling == "delayed"}


@torch.no_grad()
def load_fp8_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Restore what `fp8_state_dict` saved; every key must match a history of the same shape."""
    mine = {f"{n}.{HISTORY}": getattr(m, HISTORY) for n, m in fp8_modules(model).items()
            if m.fp8_recipe.scaling == "delayed"}
    if set(state) != set(mine):
        raise ValueError(f"FP8 state keys differ: missing {sorted(set(mine) - set(state))}, "
                         f"unexpected {sorted(set(state) - set(mine))}")
    for key, t in state.items():
        if t.shape != mine[key].shape:
            raise ValueError(f"FP8 state {key}: shape {tuple(t.shape)} != {tuple(mine[key].shape)} "
                             f"(different amax_history_len or number of local experts?)")
        mine[key].copy_(t)


__all__ = ["FP8Linear", "FP8GroupedExperts", "FP8ColumnParallelLinear", "FP8RowParallelLinear", "apply_fp8",
           "gathered_weight", "set_fp8_reductions", "set_gathered_weight", "fp8_backend_choice", "fp8_modules", "fp8_state_dict",
           "load_fp8_state_dict"]
