"""Run the MoE blocks of a loaded Hugging Face transformers model through moetron's `MoELayer`.

    from moetron.integrations.transformers import patch
    model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-30B-A3B", dtype=torch.bfloat16)
    patch(model)                          # one process: same outputs, moetron's MoE path
    patch(model, ep_group=group)          # expert parallel: each rank keeps E/ep experts

Design notes: docs/integrations.md (`moetron/integrations/transformers.py`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moetron.moe.config import MoEConfig
from moetron.moe.layer import MoELayer
from moetron.parallel.state import Group

try:  # the collector behind transformers 5's `output_router_logits` (OutputRecorder hooks)
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - other transformers versions
    _active_collector = None

__all__ = ["ExpertGroups", "HFMoELayer", "SUPPORTED_BLOCKS", "full_state_dict", "patch"]


# --- process groups ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertGroups:
    """The groups `MoELayer` reads from a ParallelState (`ep`, `etp`, `tp_ep`, `edp`).

    Built from an EP group given on its own: no expert-tensor parallel (etp is this rank
    alone, so tp_ep is the EP group) and edp is this rank alone — with several EP groups
    side by side (data parallel over EP groups), expert gradients must be summed over the
    ranks holding the same experts by the caller, and `update_expert_bias` told the groups.
    Pass a full `ParallelState` to `patch` instead to have moetron do both.
    """

    ep: Group
    etp: Group
    tp_ep: Group
    edp: Group

    @classmethod
    def from_ep_group(cls, group: dist.ProcessGroup | Group) -> ExpertGroups:
        if isinstance(group, Group):
            ep = replace(group, name="ep")
        elif isinstance(group, dist.ProcessGroup):
            ep = Group("ep", tuple(dist.get_process_group_ranks(group)), dist.get_rank(group), group)
        else:
            raise TypeError(f"ep_group must be a torch.distributed ProcessGroup, a moetron Group or a "
                            f"ParallelState, got {type(group).__name__}")
        me = ep.ranks[ep.rank]
        return cls(ep=ep, etp=Group("etp", (me,), 0, None), tp_ep=replace(ep, name="tp_ep"),
                   edp=Group("edp", (me,), 0, None))


def _expert_groups(ep_group):
    if ep_group is None:
        return None
    if all(hasattr(ep_group, name) for name in ("ep", "etp", "tp_ep", "edp")):  # a ParallelState
        return ep_group
    return ExpertGroups.from_ep_group(ep_group)


# --- what each transformers block maps to -----------------------------------------------------
@dataclass
class _BlockSpec:
    """A transformers MoE block, read: the moetron config and the HF tensors to reuse."""

    config: dict[str, Any]
    router_weight: nn.Parameter
    gate_up: nn.Parameter
    down: nn.Parameter
    expert_bias: torch.Tensor | None = None
    shared: nn.Module | None = None
    shared_gate: nn.Module | None = None
    key_map: dict[str, str] = field(default_factory=dict)  # moetron key (or "prefix.") -> HF key
    jitter_noise: float = 0.0
    logits_fp32: bool = False  # HF computes the router logits in fp32 (else in the input dtype)


def _fused_experts(block: nn.Module, kind: str) -> tuple[nn.Parameter, nn.Parameter, dict[str, int]]:
    experts = getattr(block, "experts", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3):
        raise TypeError(f"{kind}: expected transformers 5 fused experts (experts.gate_up_proj [E,2F,H], "
                        f"experts.down_proj [E,H,F]); this block stores them as {type(experts).__name__} "
                        f"(transformers 5 is required)")
    if (getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False)
            or not getattr(experts, "is_concatenated", True)):
        raise ValueError(f"{kind}: experts with biases, transposed or interleaved gate/up weights are "
                         f"not supported (moetron experts are gate rows first, no bias)")
    act = getattr(experts, "act_fn", None)
    if type(act).__name__ not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"{kind}: experts use activation {type(act).__name__}; moetron experts are "
                         f"SwiGLU, so hidden_act must be 'silu'")
    E, two_f, H = gate_up.shape
    if tuple(down.shape) != (E, H, two_f // 2):
        raise ValueError(f"{kind}: experts.down_proj has shape {tuple(down.shape)}, expected "
                         f"{(E, H, two_f // 2)} from gate_up_proj {tuple(gate_up.shape)}")
    router = block.gate.weight
    if tuple(router.shape) != (E, H):
        raise ValueError(f"{kind}: gate.weight has shape {tuple(router.shape)}, expected {(E, H)}")
    return gate_up, down, dict(hidden_size=H, ffn_hidden_size=two_f // 2, num_experts=E,
                               top_k=int(block.gate.top_k))


def _ffn_size(mlp: nn.Module) -> int:
    return mlp.gate_proj.out_features


def _qwen3(block: nn.Module) -> _BlockSpec:
    gate_up, down, sizes = _fused_experts(block, "Qwen3MoeSparseMoeBlock")
    return _BlockSpec(dict(sizes, norm_topk_prob=bool(block.gate.norm_topk_prob)), block.gate.weight,
                      gate_up, down, key_map={"router.weight": "gate.weight"})


def _qwen2(block: nn.Module) -> _BlockSpec:
    gate_up, down, sizes = _fused_experts(block, "Qwen2MoeSparseMoeBlock")
    config = dict(sizes, norm_topk_prob=bool(block.gate.norm_topk_prob),
                  shared_expert_ffn_size=_ffn_size(block.shared_expert), shared_expert_gate=True)
    return _BlockSpec(config, block.gate.weight, gate_up, down, shared=block.shared_expert,
                      shared_gate=block.shared_expert_gate,
                      key_map={"router.weight": "gate.weight", "shared_experts.": "shared_expert."})


def _deepseek_v3(block: nn.Module) -> _BlockSpec:
    gate_up, down, sizes = _fused_experts(block, "DeepseekV3MoE")
    gate = block.gate
    config = dict(sizes, score_func="sigmoid", norm_topk_prob=bool(gate.norm_topk_prob),
                  num_groups=int(gate.num_group), topk_groups=int(gate.topk_group),
                  scaling_factor=float(gate.routed_scaling_factor), expert_bias=True,
                  shared_expert_ffn_size=_ffn_size(block.shared_experts))
    return _BlockSpec(config, gate.weight, gate_up, down, expert_bias=gate.e_score_correction_bias,
                      shared=block.shared_experts, logits_fp32=True,
                      key_map={"router.weight": "gate.weight",
                               "router.expert_bias": "gate.e_score_correction_bias"})


def _mixtral(block: nn.Module) -> _BlockSpec:
    # transformers 5: softmax over all experts, top-k, renormalise (= softmax over the k logits).
    gate_up, down, sizes = _fused_experts(block, "MixtralSparseMoeBlock")
    return _BlockSpec(dict(sizes, norm_topk_prob=True), block.gate.weight, gate_up, down,
                      jitter_noise=float(getattr(block, "jitter_noise", 0.0) or 0.0),
                      key_map={"router.weight": "gate.weight"})


SUPPORTED_BLOCKS: dict[str, Callable[[nn.Module], _BlockSpec]] = {
    "Qwen3MoeSparseMoeBlock": _qwen3,
    "Qwen2MoeSparseMoeBlock": _qwen2,
    "DeepseekV3MoE": _deepseek_v3,
    "MixtralSparseMoeBlock": _mixtral,
}


# --- the replacement module -------------------------------------------------------------------
class HFMoELayer(MoELayer):
    """A `MoELayer` standing in for a transformers MoE block: its weights, its outputs, its keys.

    Behaves as the block it replaced (same forward contract: `[B,S,H] -> [B,S,H]`) and as any
    MoELayer (`aux_losses`, `stats()`, `update_expert_bias()`, the four stages).
    """

    hf_block: str  # the transformers class this layer replaced
    jitter_noise: float
    router_logits_fp32: bool

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.training and self.jitter_noise > 0:  # Mixtral's router jitter, as transformers does it
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        recorded = _router_logits_collector()
        if recorded is not None:
            x = hidden_states.reshape(-1, hidden_states.shape[-1])
            weight = self.router.weight
            recorded.append(F.linear(x.float(), weight.float()) if self.router_logits_fp32 else F.linear(x, weight))
        return super().forward(hidden_states)

    def extra_repr(self) -> str:
        experts = self.experts
        return (f"replaces={self.hf_block}, experts={experts.num_local_experts}/{experts.num_experts} local, "
                f"top_k={self.config.top_k}")


def _router_logits_collector() -> list | None:
    """The list transformers collects router logits into during this forward, or None."""
    if _active_collector is None:
        return None
    collected = _active_collector.get()
    if not collected or "router_logits" not in collected:
        return None
    return collected["router_logits"]


def _rename(key: str, prefix: str, mapping: dict[str, str]) -> str:
    local = key[len(prefix):]
    for src, dst in mapping.items():
        if local == src or (src.endswith(".") and local.startswith(src)):
            return prefix + dst + local[len(src):]
    return key


def _rename_all(state_dict, prefix: str, mapping: dict[str, str]) -> None:
    """Rename this module's keys in place, keeping their order."""
    keys = [k for k in state_dict if k.startswith(prefix)]
    values = [state_dict.pop(k) for k in keys]
    for k, v in zip(keys, values):
        state_dict[_rename(k, prefix, mapping)] = v


def _state_dict_to_hf(module: HFMoELayer, state_dict, prefix, local_metadata) -> None:
    _rename_all(state_dict, prefix, module._hf_key_map)


def _load_from_hf(module: HFMoELayer, state_dict, prefix, local_metadata, strict, missing_keys,
                  unexpected_keys, error_msgs) -> None:
    _rename_all(state_dict, prefix, {hf: ours for ours, hf in module._hf_key_map.items()})
    experts = module.experts
    gate_up_key, down_key = prefix + "experts.gate_up_proj", prefix + "experts.down_proj"
    if gate_up_key in state_dict and down_key in state_dict:
        gate_up, down = state_dict[gate_up_key], state_dict[down_key]
        full = (experts.num_experts, 2 * experts.ffn_hidden_size)
        if tuple(gate_up.shape[:2]) == full and tuple(gate_up.shape) != tuple(experts.gate_up_proj.shape):
            state_dict[gate_up_key], state_dict[down_key] = experts.shard_of(gate_up, down)


def _build_layer(block: nn.Module, spec: _BlockSpec, groups, dispatcher, config_overrides: dict,
                 pad_multiple: int, flex_backend: str) -> HFMoELayer:
    name = type(block).__name__
    try:
        config = MoEConfig(**{**spec.config, **config_overrides})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name}: cannot express this block as a moetron MoEConfig: {err}") from err
    device = spec.router_weight.device
    # Build on the meta device (no memory, no init) and then hand it the block's own tensors.
    # The dispatcher is built afterwards, outside the meta context, as some allocate buffers.
    with torch.device("meta"):
        layer = HFMoELayer(config, dispatcher=_Placeholder(), parallel_state=groups)
    layer.dispatcher = layer._build_dispatcher(dispatcher, pad_multiple, flex_backend)
    layer.hf_block, layer.jitter_noise, layer.router_logits_fp32 = name, spec.jitter_noise, spec.logits_fp32
    layer._hf_key_map = spec.key_map

    layer.router.weight = spec.router_weight
    if spec.expert_bias is not None:
        layer.router.expert_bias = spec.expert_bias
    experts = layer.experts
    if experts.num_local_experts == experts.num_experts and experts.local_ffn_size == experts.ffn_hidden_size:
        experts.gate_up_proj, experts.down_proj = spec.gate_up, spec.down
    else:  # expert parallel: keep only this rank's slice, in storage of its own
        gate_up, down = experts.shard_of(spec.gate_up.detach(), spec.down.detach())
        experts.gate_up_proj = nn.Parameter(gate_up.clone(memory_format=torch.contiguous_format),
                                            requires_grad=spec.gate_up.requires_grad)
        experts.down_proj = nn.Parameter(down.clone(memory_format=torch.contiguous_format),
                                         requires_grad=spec.down.requires_grad)
    experts.mark_expert_parallel()
    if spec.shared is not None:
        layer.shared_experts = spec.shared
    if spec.shared_gate is not None:
        layer.shared_expert_gate = spec.shared_gate
    layer.pending_counts = torch.zeros(config.num_experts, dtype=torch.float32, device=device)

    left = [n for n, t in [*layer.named_parameters(), *layer.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{name}: patch left {left} unassigned; moetron's MoELayer gained a tensor "
                           f"that moetron.integrations.transformers does not know how to fill")
    layer.register_state_dict_post_hook(_state_dict_to_hf)
    layer.register_load_state_dict_pre_hook(_load_from_hf)
    layer.train(block.training)
    return layer


class _Placeholder:
    """Stands in for the dispatcher while the layer is built on the meta device."""


# --- public entry points ----------------------------------------------------------------------
def patch(model: nn.Module, ep_group=None, dispatcher="alltoall", *, config_overrides: dict | None = None,
          pad_multiple: int = 1, flex_backend: str = "torch") -> nn.Module:
    """Replace every supported MoE block of `model` with an `HFMoELayer` sharing its weights.

    model: a loaded transformers model (any head) containing Qwen3-MoE, Qwen2-MoE, DeepSeek-V3
        or Mixtral MoE blocks.
    ep_group: None (every expert in this process), a torch.distributed ProcessGroup or moetron
        `Group` to shard the experts over (rank r of the group keeps experts
        `r*E/ep ... (r+1)*E/ep - 1`), or a full moetron `ParallelState` (EP and ETP sharding,
        EDP-aware balancing). Every rank of the group must call `patch` on the same model and
        then run forward/backward together; each rank feeds its own tokens.
    dispatcher: with `ep_group`, how tokens reach the ranks holding their experts: "alltoall",
        "allgather", "flex", or a dispatcher object (shared by every patched layer). Without
        `ep_group` all experts are local and tokens are only permuted in-process.
    config_overrides: MoEConfig fields to set on top of the ones read from the model, e.g.
        `{"expert_backend": "loop"}` or moetron's balancing losses (`aux_loss_type`,
        `aux_loss_coeff`); overriding routing fields changes the model's outputs.
    pad_multiple, flex_backend: as for `MoELayer`.

    Returns `model`, patched in place. Raises before changing anything if a block cannot be
    expressed (unsupported activation, experts not divisible by the EP size, ...).
    """
    groups = _expert_groups(ep_group)
    if groups is None and isinstance(dispatcher, str):
        dispatcher = None  # one process: MoELayer's local dispatcher
    overrides = dict(config_overrides or {})
    found = [(parent, child_name, child)
             for parent in model.modules() for child_name, child in parent.named_children()
             if type(child).__name__ in SUPPORTED_BLOCKS]
    if not found:
        if any(isinstance(m, HFMoELayer) for m in model.modules()):
            raise ValueError(f"{type(model).__name__} is already patched")
        raise ValueError(f"{type(model).__name__} has no MoE block moetron can patch; supported blocks: "
                         f"{', '.join(SUPPORTED_BLOCKS)}")
    layers = [_build_layer(block, SUPPORTED_BLOCKS[type(block).__name__](block), groups, dispatcher,
                           overrides, pad_multiple, flex_backend)
              for _, _, block in found]
    for (parent, child_name, _), layer in zip(found, layers):
        setattr(parent, child_name, layer)
    if _active_collector is None:
        warnings.warn("this transformers version has no output collector moetron knows; patched layers "
                      "will not report router logits (output_router_logits)", stacklevel=2)
    return model


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every patched layer's experts gathered to full size.

    Collective over each patched layer's EP (and ETP) group when the experts are sharded: every
    rank must call it. Keys and shapes are those of the unpatched transformers model, so the
    result can go to `save_pretrained(path, state_dict=...)` (on one rank) or to the
    unpatched model's `load_state_dict`.
    """
    state = model.state_dict()
    for name, module in model.named_modules():
        if not isinstance(module, HFMoELayer):
            continue
        experts = module.experts
        if (experts.num_local_experts, experts.local_ffn_size) == (experts.num_experts, experts.ffn_hidden_size):
            continue
        prefix = f"{name}." if name else ""
        state[prefix + "experts.gate_up_proj"], state[prefix + "experts.down_proj"] = experts.full_expert_weights()
    return state
