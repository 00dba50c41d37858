"""torchtitan's MoE and Megatron-Core's MoELayer as rows of benchmarks/moe_layer.py, on moetron's weights.

Neither is a moetron dependency (`pip install torchtitan megatron-core`; with `--no-deps`, torchtitan 0.3.0
also needs `spmd_types` and `tyro`); a peer that does not import or build here is a table row saying why,
not an error. Each runs as its own code, with the small
shims below, which the table names:

- torchtitan (models/common/moe.py, `MoE` with `LocalTokenDispatcher`): its `GroupedExperts.forward`
  casts tokens and weights to bf16 for `torch._grouped_mm`; the shim runs the same three grouped GEMMs
  and SwiGLU in the input's dtype, so an fp32 run compares fp32 with fp32. Its router runs as written.
- Megatron-Core (`MoELayer` from `get_moe_module_spec(use_te=False)`): on a CPU its experts are
  `SequentialMLP` (`moe_grouped_gemm` needs Transformer Engine or the grouped_gemm package, GPU only)
  and the dispatcher `allgather` (the all-to-all one makes a CUDA stream). Shims: its router moves
  the gate to `torch.cuda.current_device()`, which answers the CPU during its calls; and without
  Transformer Engine `moe_utils.te_general_gemm` is undefined (a NameError in 0.16), so it is set to
  None, its own fallback. One process group of one rank (gloo, in memory) backs its parallel state.

Both get copies of moetron's router and expert weights (Qwen3's routing: softmax, top-k, renormalised;
no balancing loss), and `check_peers` requires the same outputs and gradients as moetron before timing.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

PEERS = ("torchtitan", "megatron-core")


@dataclass
class Peer:
    """A peer's forward (x [1, T, H] -> [1, T, H]), its parameters, and its gradients in moetron's layout."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    params: list[torch.Tensor]
    grads: Callable[[], dict[str, torch.Tensor]]  # router [E, H], gate_up [E, 2F, H], down [E, H, F]
    runs: str  # what runs, and the shims


def _torchtitan(layer) -> Peer:
    from torchtitan.models.common import moe as tm
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    cfg = layer.config
    E, H, F_, K = cfg.num_experts, cfg.hidden_size, cfg.ffn_hidden_size, cfg.top_k

    class SameDtypeExperts(tm.GroupedExperts):
        """The shim: torchtitan's three grouped GEMMs and SwiGLU without its casts to bf16."""

        def forward(self, x_RD, num_tokens_per_expert_E):
            offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            h = F.silu(torch._grouped_mm(x_RD, self.w1_EFD.transpose(-2, -1), offs=offs))
            h = h * torch._grouped_mm(x_RD, self.w3_EFD.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(h, self.w2_EDF.transpose(-2, -1), offs=offs)

    config = tm.MoE.Config(
        num_experts=E, load_balance_coeff=None,
        routed_experts=tm.RoutedExperts.Config(
            inner_experts=tm.GroupedExperts.Config(dim=H, hidden_dim=F_, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K)),
        router=tm.TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=H, out_features=E),
                                               top_k=K, score_func="softmax", route_norm=cfg.norm_topk_prob))
    device = layer.router.weight.device
    with torch.device("meta"):
        moe = config.build()
    experts = moe.routed_experts.inner_experts
    experts.__class__ = SameDtypeExperts
    gate_up, down = layer.experts.gate_up_proj.detach(), layer.experts.down_proj.detach()
    moe.router.gate.weight = torch.nn.Parameter(layer.router.weight.detach().clone())
    experts.w1_EFD = torch.nn.Parameter(gate_up[:, :F_].clone())
    experts.w3_EFD = torch.nn.Parameter(gate_up[:, F_:].clone())
    experts.w2_EDF = torch.nn.Parameter(down.clone())
    moe.tokens_per_expert_E = torch.zeros(E, device=device)
    moe.train()

    def forward(x):
        with warnings.catch_warnings():  # its router's fp32 autocast region, which CPU autocast ignores
            warnings.simplefilter("ignore", UserWarning)
            return moe(x)

    return Peer(forward, [moe.router.gate.weight, experts.w1_EFD, experts.w3_EFD, experts.w2_EDF],
                lambda: {"router": moe.router.gate.weight.grad,
                         "gate_up": torch.cat([experts.w1_EFD.grad, experts.w3_EFD.grad], dim=1),
                         "down": experts.w2_EDF.grad},
                "MoE + LocalTokenDispatcher + torch._grouped_mm experts; shim: experts in the input's dtype "
                "(torchtitan casts them to bf16)")


@contextlib.contextmanager
def _cuda_device_is_cpu():
    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = real


def _megatron(layer) -> Peer:
    import torch.distributed as dist

    with warnings.catch_warnings():  # its import warns that Apex and Transformer Engine are missing
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.transformer_config import TransformerConfig

    if layer.router.weight.device.type != "cpu":
        raise RuntimeError("the CPU shims only: on a GPU run Megatron-Core with Transformer Engine instead")
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # the shim: its own non-TE path
    cfg = layer.config
    E, H, F_, K = cfg.num_experts, cfg.hidden_size, cfg.ffn_hidden_size, cfg.top_k
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=1, hidden_size=H, num_attention_heads=1, ffn_hidden_size=F_, moe_ffn_hidden_size=F_,
            num_moe_experts=E, moe_router_topk=K, moe_router_load_balancing_type="none",
            moe_router_pre_softmax=not cfg.norm_topk_prob,  # softmax over the top-k logits = renormalised top-k
            moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, gated_linear_unit=True,
            activation_func=F.silu, bias_activation_fusion=False, add_bias_linear=False, use_cpu_initialization=True,
            gradient_accumulation_fusion=False, params_dtype=layer.router.weight.dtype)
    with _cuda_device_is_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # and that its default cuda_graph_scope is deprecated
        moe = MoELayer(config, get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False).submodules)
    experts = moe.experts.local_experts
    with torch.no_grad():
        moe.router.weight.copy_(layer.router.weight)
        for e, mlp in enumerate(experts):
            mlp.linear_fc1.weight.copy_(layer.experts.gate_up_proj[e])  # gate rows first, as moetron's
            mlp.linear_fc2.weight.copy_(layer.experts.down_proj[e])
    moe.train()

    def forward(x):  # Megatron's layout is [S, B, H]; it returns (output, bias)
        with _cuda_device_is_cpu():
            return moe(x.transpose(0, 1))[0].transpose(0, 1)

    return Peer(forward, list(moe.parameters()),
                lambda: {"router": moe.router.weight.grad,
                         "gate_up": torch.stack([m.linear_fc1.weight.grad for m in experts]),
                         "down": torch.stack([m.linear_fc2.weight.grad for m in experts])},
                "MoELayer, SequentialMLP experts (a per-expert loop), allgather dispatcher; shims: "
                "torch.cuda.current_device() -> cpu in its calls, moe_utils.te_general_gemm = None")


def build_peers(layer, skip=()) -> tuple[dict[str, Peer], list[list[str]]]:
    """The peers that build here, and a status row for each (what runs, or why it does not)."""
    peers, rows = {}, []
    for name, build in (("torchtitan", _torchtitan), ("megatron-core", _megatron)):
        if name in skip:
            rows.append([name, "skipped (--skip)"])
            continue
        try:
            peers[name] = build(layer)
        except ImportError as exc:
            rows.append([name, f"not installed: {type(exc).__name__}: {exc}"[:150]])
            continue
        except Exception as exc:  # installed, but its block does not build on this machine
            rows.append([name, f"does not build here: {type(exc).__name__}: {exc}"[:150]])
            continue
        rows.append([name, f"timed: {peers[name].runs}"])
    return peers, rows


def check_peers(layer, peers: dict[str, Peer], x: torch.Tensor, dy: torch.Tensor, rel_err) -> list[list[str]]:
    """Each peer's output and gradients against moetron's (same bounds as transformers': 1e-5, 1e-4)."""
    params = {"router": layer.router.weight, "gate_up": layer.experts.gate_up_proj, "down": layer.experts.down_proj}
    for p in params.values():
        p.grad = None
    x.grad = None
    y_ref = layer(x)
    y_ref.backward(dy)
    ref = {"x": x.grad.clone(), **{k: p.grad.clone() for k, p in params.items()}}
    rows = []
    for name, peer in peers.items():
        for p in peer.params:
            p.grad = None
        x.grad = None
        y = peer.forward(x)
        y.backward(dy)
        errs = {"x": rel_err(x.grad, ref["x"]), **{k: rel_err(g, ref[k]) for k, g in peer.grads().items()}}
        out_err = rel_err(y.detach(), y_ref.detach())
        rows.append([f"moetron vs {name}", f"{out_err:.2e}", *(f"{errs[k]:.2e}" for k in ("x", "router", "gate_up",
                                                                                         "down"))])
        bad = {k: v for k, v in errs.items() if not v < 1e-4}
        if not out_err < 1e-5 or bad:
            raise AssertionError(f"moetron and {name} differ: output {out_err:.3e}, gradients {bad}")
    for p in [*params.values(), *(q for peer in peers.values() for q in peer.params)]:
        p.grad = None
    x.grad = None
    return rows
