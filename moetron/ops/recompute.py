"""Selective activation recomputation: what a decoder layer keeps for backward, and how the rest
is rebuilt there.

Two kinds of option (Megatron-Core's names, `ModelConfig.recompute_modules`): *checkpointed*
pieces run under a non-reentrant checkpoint; *output-discarding* pieces keep only their inputs and
their output is freed once its consumer saved it, then rebuilt in backward (held once, not twice).
`recompute_every_n_layers` checkpoints whole layers. Gradients are bit-identical with and without.
The mechanism (saved-tensor hooks, frames, per-graph-task caching) is explained in
docs/recompute.md.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import checkpoint as _torch_checkpoint

from moetron.ops.norm import RMSNorm

try:  # torch's own checkpoint saves its inputs this way (so outer saved-tensor hooks see them)
    from torch._C._autograd import SavedTensor, _make_saved_tensor
except ImportError:  # pragma: no cover - older torch: hold the inputs directly
    SavedTensor, _make_saved_tensor = None, None
try:
    from torch._C._autograd import _top_saved_tensors_default_hooks
except ImportError:  # pragma: no cover
    _top_saved_tensors_default_hooks = None

__all__ = ["CHECKPOINTED", "OUTPUT_DISCARDING", "MODULES", "RecomputePlan", "RecomputableRMSNorm",
           "checkpoint", "discard_output", "saved_outputs", "is_recomputing", "in_region", "replayed",
           "configure_layer", "set_recompute"]

# Pieces run under a checkpoint, and pieces whose output is discarded once its consumer saved it.
CHECKPOINTED = ("core_attn", "mlp", "moe", "shared_experts")
OUTPUT_DISCARDING = ("moe_act", "layernorm", "mla_up_proj")
MODULES = CHECKPOINTED + OUTPUT_DISCARDING


# ------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class RecomputePlan:
    """What one decoder layer recomputes: selective `modules`, or the whole layer (`full`)."""

    modules: frozenset[str] = frozenset()
    full: bool = False

    @classmethod
    def for_layer(cls, modules: Iterable[str], every_n_layers: int, layer_idx: int, method: str | None = None,
                  num_layers: int | None = None) -> RecomputePlan:
        modules = frozenset(modules)
        bad = sorted(modules - set(MODULES))
        if bad:
            raise ValueError(f"recompute module {bad[0]!r} is unknown; choose from {', '.join(MODULES)}")
        full = every_n_layers > 0 and (layer_idx + 1) % every_n_layers == 0
        return cls(modules, full or full_by_method(method, num_layers, layer_idx))

    @property
    def piece_modules(self) -> frozenset[str]:
        """Options for the submodules: in a fully recomputed layer they matter only when a pipeline
        runs the layer as pieces outside the layer checkpoint; then the MoE pieces use moe + layernorm."""
        return self.modules | {"moe", "layernorm"} if self.full else self.modules


def full_by_method(method: str | None, num_layers: int | None, position: int) -> bool:
    """Megatron's `recompute_method` for the layer at `position` in its block (the model's decoder
    layers, or one pipeline stage's): "block" recomputes the first `num_layers` layers of each block;
    "uniform" recomputes every layer (Megatron checkpoints groups of `num_layers` layers at once, moetron
    each layer: the same recomputation, see docs/recompute.md)."""
    if method == "uniform":
        return True
    return method == "block" and position < num_layers


def configure_layer(layer) -> RecomputePlan:
    """Push `layer.recompute` (a RecomputePlan) into the layer's current submodules; returns the plan.

    Called by DecoderLayer at every call, because tensor/expert parallelism (and FP8) may have
    replaced `layer.mlp` or its experts since the layer was built.
    """
    plan = layer.recompute
    mods = plan.piece_modules
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if isinstance(norm, RecomputableRMSNorm):
            norm.discard_output = "layernorm" in mods
    layer.self_attn.recompute_modules = mods
    mlp = layer.mlp
    if hasattr(mlp, "experts"):  # an MoE layer (or a subclass)
        mlp.recompute_modules = mods
        mlp.experts.recompute_act = "moe_act" in mods
        if mlp.shared_experts is not None:
            mlp.shared_experts.checkpointed = "shared_experts" in mods
    else:
        mlp.checkpointed = "mlp" in mods
    return plan


def set_recompute(model: torch.nn.Module, modules: Iterable[str] = (), every_n_layers: int = 0) -> None:
    """Change the recompute options of every decoder layer of a built model (and its config)."""
    modules = list(modules)
    layers = [m for m in model.modules() if hasattr(m, "recompute") and hasattr(m, "layer_idx")]
    for layer in layers:
        layer.recompute = RecomputePlan.for_layer(modules, every_n_layers, layer.layer_idx)
        configure_layer(layer)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "recompute_modules"):
        model.config = cfg.replace(recompute_modules=modules, recompute_every_n_layers=every_n_layers)


# ------------------------------------------------------------------------------ region state


class _State(threading.local):
    def __init__(self):
        self.depth = 0  # > 0 inside a checkpointed / discarding region (forward or recompute)
        self.recomputing = 0  # > 0 inside a recompute
        self.memos: list[dict] = []  # replay memo of each enclosing checkpoint region
        self.outputs: dict[int, tuple] = {}  # storage data_ptr -> discardable output entry


_state = _State()


class _Region:
    """Reusable context marking a region's forward (recomputing=False) or its recompute."""

    def __init__(self, memo: dict | None, recomputing: bool):
        self.memo, self.recomputing = memo, recomputing

    def __enter__(self):
        _state.depth += 1
        _state.recomputing += self.recomputing
        _state.memos.append(self.memo)
        return self

    def __exit__(self, *exc):
        _state.memos.pop()
        _state.recomputing -= self.recomputing
        _state.depth -= 1
        return False


def is_recomputing() -> bool:
    """True while a checkpointed or output-discarding region is being recomputed in backward."""
    return _state.recomputing > 0


def in_region() -> bool:
    """True inside a recompute region (its forward or its recompute), ours or a torch.utils.checkpoint
    someone wrapped around the model: the selective options are then plain calls."""
    if _state.depth:
        return True
    top = _top_hooks()
    return top is not None and "checkpoint" in getattr(top[0], "__module__", "") and \
        ("_checkpoint_hook" in top[0].__qualname__ or "_recomputation_hook" in top[0].__qualname__)


class replayed:
    """`with replayed(obj, "method"):` inside a checkpoint region, record what `obj.method` returns
    in the forward and return the same values, in order, when the region is recomputed.

    For methods with side effects or communication that must happen once per forward (the
    router's running global-batch counts). Outside a checkpoint region it does nothing.
    """

    def __init__(self, obj: Any, name: str):
        self.obj, self.name, self.active = obj, name, False

    def __enter__(self):
        memo = _state.memos[-1] if _state.memos else None
        if memo is None:
            return self
        values = memo.setdefault((id(self.obj), self.name), [])
        original = getattr(self.obj, self.name)
        if is_recomputing():
            position = iter(range(len(values)))

            def method(*args, **kwargs):
                return values[next(position)]
        else:
            def method(*args, **kwargs):
                values.append(original(*args, **kwargs))
                return values[-1]
        self.had_own = self.name in vars(self.obj)
        self.previous = vars(self.obj).get(self.name)
        object.__setattr__(self.obj, self.name, method)
        self.active = True
        return self

    def __exit__(self, *exc):
        if self.active:
            if self.had_own:
                object.__setattr__(self.obj, self.name, self.previous)
            else:
                object.__delattr__(self.obj, self.name)
        return False


# ------------------------------------------------------------------------------ checkpointed


def checkpoint(fn: Callable, *args, early_stop: bool = True, **kwargs):
    """`fn(*args, **kwargs)` under non-reentrant `torch.utils.checkpoint` (a plain call when grad
    is off or inside another recompute region). `early_stop=False` re-runs the whole of `fn` in
    backward: use it when `fn` communicates and ranks may save different tensors (MoE with EP)."""
    if not torch.is_grad_enabled() or in_region():
        return fn(*args, **kwargs)
    memo: dict = {}
    contexts = (_Region(memo, False), _Region(memo, True))
    return _torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: contexts,
                                        early_stop=early_stop, **kwargs)


# ------------------------------------------------------------------------------ output discarding


def _autocast_state() -> tuple:
    state = []
    for device in ("cpu", "cuda"):
        try:
            state.append((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
        except (RuntimeError, TypeError):  # pragma: no cover - a device type this build lacks
            pass
    return tuple(state)


class _Autocast:
    def __init__(self, state: tuple):
        self.contexts = [torch.autocast(device, dtype=dtype, enabled=enabled) for device, enabled, dtype in state]

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)
        return False


def _save(t):
    if isinstance(t, torch.Tensor) and _make_saved_tensor is not None:
        return _make_saved_tensor(t, is_output=False)
    return t


def _load(t):
    return t.unpack() if SavedTensor is not None and isinstance(t, SavedTensor) else t


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


class _Frame:
    """One call of an output-discarding region: its function, its saved inputs, and (in backward)
    what its recompute produced for the current autograd graph task."""

    def __init__(self, fn: Callable, args: tuple):
        self.fn = fn
        self.args = [_save(a) for a in args]
        self.autocast = _autocast_state()
        self.count = 0  # tensors the region's ops saved in the forward
        self.gid: int | None = None
        self.saved: list | None = None
        self.outputs: tuple | None = None

    def recompute(self, force: bool = False) -> None:
        gid = torch._C._current_graph_task_id()
        if not force and self.saved is not None and gid == self.gid and gid != -1:
            return
        collected: list[torch.Tensor] = []

        def pack(t):
            collected.append(t.detach() if t.requires_grad else t)
            return None

        args = [_load(a) for a in self.args]
        self.saved = self.outputs = None  # release the previous task's tensors first
        with _Region(None, True), torch.enable_grad(), _Autocast(self.autocast), \
                torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
            out = _as_tuple(self.fn(*args))
        if len(collected) != self.count:
            raise RuntimeError(f"moetron recompute: the region {getattr(self.fn, '__qualname__', self.fn)} saved "
                               f"{self.count} tensors in the forward but {len(collected)} when recomputed; "
                               f"an output-discarding region must be deterministic")
        self.gid, self.saved = gid, collected
        self.outputs = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in out)

    def saved_tensor(self, index: int) -> torch.Tensor:
        self.recompute()
        t = self.saved[index]
        if t is None:  # unpacked twice in one graph task: rebuild rather than fail
            self.recompute(force=True)
            t = self.saved[index]
        self.saved[index] = None  # each saved tensor is unpacked once per graph task
        return t

    def output(self, index: int, size, stride, offset) -> torch.Tensor:
        self.recompute()
        return self.outputs[index].as_strided(size, stride, offset)


def _never_unpacked(_):  # the graph built while recomputing is never differentiated
    raise RuntimeError("moetron recompute: a recomputed graph was differentiated")


class _SavedHandle:
    __slots__ = ("frame", "index")

    def __init__(self, frame: _Frame, index: int):
        self.frame, self.index = frame, index


class _OutputHandle:
    __slots__ = ("frame", "index", "size", "stride", "offset")

    def __init__(self, frame: _Frame, index: int, t: torch.Tensor):
        self.frame, self.index = frame, index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _register_outputs(frame: _Frame, outputs: tuple, inputs: tuple) -> None:
    registry = _state.outputs
    for key in [k for k, entry in registry.items() if entry[0].expired() or entry[1]() is None]:
        del registry[key]
    held = {_storage_key(a) for a in inputs if isinstance(a, torch.Tensor)}
    for j, o in enumerate(outputs):
        if not isinstance(o, torch.Tensor) or not o.requires_grad or o.untyped_storage().nbytes() == 0:
            continue
        key = _storage_key(o)
        if key in held:  # a view of an input: nothing to free
            continue
        registry[key] = (StorageWeakRef(o.untyped_storage()), weakref.ref(frame), j, o.dtype, o.device)


def _lookup_output(t: torch.Tensor) -> _OutputHandle | None:
    registry = _state.outputs
    if not registry or t.untyped_storage().nbytes() == 0:
        return None
    entry = registry.get(_storage_key(t))
    if entry is None:
        return None
    storage_ref, frame_ref, j, dtype, device = entry
    frame = frame_ref()
    if frame is None or storage_ref.expired():
        del registry[_storage_key(t)]
        return None
    if t.dtype != dtype or t.device != device:
        return None
    return _OutputHandle(frame, j, t)


def discard_output(fn: Callable, *args):
    """`fn(*args)` as an output-discarding region (see the module docstring): the region keeps only
    `args`; its tensor outputs are freed wherever a consumer running under `saved_outputs()` saved
    them, and recomputed in backward. A plain call when grad is off or inside another region."""
    if not torch.is_grad_enabled() or in_region():
        return fn(*args)
    frame = _Frame(fn, args)

    def pack(t):
        handle = _SavedHandle(frame, frame.count)
        frame.count += 1
        return handle

    with _Region(None, False), torch.autograd.graph.saved_tensors_hooks(pack, _unpack_saved):
        out = fn(*args)
    _register_outputs(frame, _as_tuple(out), args)
    return out


def _unpack_saved(handle: _SavedHandle) -> torch.Tensor:
    return handle.frame.saved_tensor(handle.index)


class _Outer:
    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


class _SavedOutputsHooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, outer):
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t):
            handle = _lookup_output(t)
            if handle is not None:
                return handle
            if outer_pack is not None:
                return _Outer(outer_pack(t))
            return t.detach() if t.requires_grad else t  # no reference cycle through t.grad_fn

        def unpack(obj):
            if isinstance(obj, _OutputHandle):
                return obj.frame.output(obj.index, obj.size, obj.stride, obj.offset)
            if isinstance(obj, _Outer):
                return outer_unpack(obj.packed)
            return obj

        pack._moetron_saved_outputs = True
        super().__init__(pack, unpack)


def _top_hooks():
    if _top_saved_tensors_default_hooks is None:
        return None
    return _top_saved_tensors_default_hooks(False)


def saved_outputs(enabled: bool = True):
    """Context under which consumers of output-discarding regions run: tensors they save that are
    registered outputs are stored as recompute handles (a no-op context when not `enabled`, inside
    a recompute region, or when an enclosing `saved_outputs` is already the innermost hook)."""
    if not enabled or not torch.is_grad_enabled() or in_region():
        return nullcontext()
    outer = _top_hooks()
    if outer is not None and getattr(outer[0], "_moetron_saved_outputs", False):
        return nullcontext()
    return _SavedOutputsHooks(outer)


# ------------------------------------------------------------------------------ modules


class RecomputableRMSNorm(RMSNorm):
    """RMSNorm that is an output-discarding region when `discard_output` is set (option `layernorm`).

    The decoder layer's norms are built as this class (same parameters and state-dict keys), so the
    option also holds when a pipeline piece calls the norm directly."""

    discard_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.discard_output:
            return discard_output(functools.partial(RMSNorm.forward, self), x)
        return super().forward(x)
