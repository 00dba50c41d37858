"""FP8 modules and `apply_fp8`: run a model's projections and routed experts in FP8.

    model = MoETransformer(cfg)                    # after any parallelization that rebuilds modules
    apply_fp8(model, "blockwise")                  # or tensorwise / delayed / an FP8Recipe
    out = model(input_ids, labels=labels)          # same parameters, same names, FP8 GEMMs

Design notes: docs/fp8.md (`moetron/precision/fp8_modules.py`).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable

import torch
from torch import nn

from moetron import backends
from moetron.moe.experts import GroupedExperts
from moetron.moe.layer import MoELayer
from moetron.ops import swiglu
from moetron.precision.fp8 import ROLES, FP8Recipe, get_fp8_recipe
from moetron.precision.fp8_backend import choose_fp8_backend, probe_capabilities
from moetron.precision.fp8_matmul import check_backend, fp8_grouped_linear, fp8_linear
from moetron.precision.te_modules import te_experts_forward, te_linear_forward, te_shape_problem
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
    length = recipe.amax_history_len if recipe.scaling == "delayed" else 0
    module.register_buffer(HISTORY, torch.zeros(len(ROLES), length, groups, device=device), persistent=False)
    object.__setattr__(module, "_te_module", None)  # built on first use, outside the module tree


def _history(module: nn.Module) -> torch.Tensor | None:
    return getattr(module, HISTORY) if module.fp8_recipe.scaling == "delayed" else None


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
        backend = _gemm_backend(self, x)
        if backend == "te":
            return te_linear_forward(self, x)
        return fp8_linear(x, self.weight, self.bias, self.fp8_recipe, _history(self), backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_recipe.scaling}/{self.fp8_recipe.fp8_format}"


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
        return fp8_grouped_linear(x_NH, weight, rows_per_expert, self.fp8_recipe, history, backend, self.backend)

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


def apply_fp8(model: nn.Module, recipe: FP8Recipe | str, *, exclude: Iterable[str] = (),
              amax_group=None) -> nn.Module:
    """Make `model`'s projections and routed experts FP8, in place; returns `model`.

    `recipe`: an FP8Recipe or a name ("tensorwise", "delayed", "blockwise", "mxfp8"). `exclude`:
    fnmatch patterns of module names (as in `named_modules()`) to keep in high precision.
    `amax_group`: the ProcessGroup Transformer Engine reduces amaxes over (the stage's data/context
    parallel ranks; None in one process). The backend is chosen once: `fp8_backend_choice`.
    """
    recipe = get_fp8_recipe(recipe)
    chosen, _ = fp8_backend_choice(recipe)  # a named backend that cannot run here fails now
    patterns = list(exclude)
    keep = _high_precision_linears(model)
    targets = []
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns) or id(module) in keep:
            continue
        if isinstance(module, (FP8Linear, FP8GroupedExperts)):
            raise ValueError(f"module {name!r} is already FP8; apply_fp8 runs once per model")
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            raise NotImplementedError(f"module {name!r} is a tensor-parallel {type(module).__name__}: FP8 with "
                                      f"tensor parallelism is not supported yet (exclude it to keep it in "
                                      f"high precision)")
        if type(module) is nn.Linear or type(module) is GroupedExperts:
            targets.append((name, module))
    for name, module in targets:
        if isinstance(module, GroupedExperts):
            FP8GroupedExperts.from_experts(module, recipe, chosen, name)
        else:
            FP8Linear.from_linear(module, recipe, chosen, name)
        module.fp8_amax_group = amax_group
    for module in model.modules():  # FP8 grouped GEMMs want each expert's rows padded
        if isinstance(module, MoELayer) and isinstance(module.experts, FP8GroupedExperts):
            dispatcher = module.dispatcher
            if hasattr(dispatcher, "pad_multiple"):
                dispatcher.pad_multiple = math.lcm(dispatcher.pad_multiple, recipe.grouped_pad_multiple)
    return model


def fp8_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The FP8 modules of `model` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (FP8Linear, FP8GroupedExperts))}


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


__all__ = ["FP8Linear", "FP8GroupedExperts", "apply_fp8", "fp8_backend_choice", "fp8_modules", "fp8_state_dict",
           "load_fp8_state_dict"]
