"""The MoE layer inside a tensor-parallel model: the router sees the TP group's whole sequence,
the routed experts only this rank's tokens, and shared experts are a tensor-parallel MLP.
Built by `moetron.model.parallelize.tensor_parallelize`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetron.dispatch.routing import Routing
from moetron.moe.layer import MoELayer
from moetron.parallel import comm
from moetron.parallel.state import Group, ParallelState
from moetron.parallel.tensor_parallel import keep_own_slice_grad, parallelize_mlp, sum_grad_over_group

__all__ = ["TensorParallelMoELayer", "TensorParallelMoEState"]


@dataclass
class TensorParallelMoEState:
    """What TensorParallelMoELayer.tp_output needs from tp_route."""

    shape: torch.Size  # of the layer input
    x_BSH: torch.Tensor  # the layer input as [B, S or S/tp, H]
    x_full: torch.Tensor  # the TP group's tokens [B, S, H] (gathered under sequence parallel)


class TensorParallelMoELayer(MoELayer):
    """MoELayer inside a tensor-parallel model.

    Input and output are in the residual stream's layout: this rank's sequence shard under sequence
    parallel, the replicated tokens otherwise. The router runs on every token of the TP group
    (replicated computation, so routing, capacity drops and balancing losses equal one process);
    the routed experts (sharded over ETP x EP by MoELayer) receive only this rank's tokens; shared
    experts are a tensor-parallel MLP. Build it with `from_moe_layer` (or tensor_parallelize).

    Stages for a schedule that runs them apart (forward chains them): `tp_route(x)` ->
    `dispatch` -> `compute_experts` -> `combine` (MoELayer's, on this rank's tokens) ->
    `tp_output(out, state)`; `tp_shared(state)` computes the shared experts on their own.
    MoELayer's `route` alone would route only this rank's tokens.
    """

    tp_group: Group
    sequence_parallel: bool

    @classmethod
    @torch.no_grad()
    def from_moe_layer(cls, layer: MoELayer, parallel_state: ParallelState, dispatcher: str | None = None, *,
                       overlap_chunks: int = 1, flex_backend: str = "torch") -> TensorParallelMoELayer:
        """The same layer (router, expert bias, shared experts reused) with experts resharded for
        `parallel_state`'s expert grid. Collective when `layer`'s experts are themselves sharded."""
        gate_up, down = layer.experts.full_expert_weights()
        pad_multiple = getattr(layer.dispatcher, "pad_multiple", 1)
        with torch.device(gate_up.device):
            new = cls(layer.config, dispatcher, parallel_state=parallel_state, pad_multiple=pad_multiple,
                      flex_backend=flex_backend)
        new.experts.to(gate_up.dtype)
        new.experts.load_full_experts(gate_up, down)
        tp, sp = parallel_state.tp, parallel_state.sequence_parallel
        new.tp_group, new.sequence_parallel = tp, sp
        new.router = layer.router
        new.pending_counts.copy_(layer.pending_counts)
        new.shared_experts = layer.shared_experts
        if new.shared_experts is not None:
            parallelize_mlp(new.shared_experts, tp, sp, overlap_chunks)
        new.shared_expert_gate = layer.shared_expert_gate
        if new.shared_expert_gate is not None and sp:
            sum_grad_over_group(new.shared_expert_gate.weight, tp)  # applied to this rank's tokens
        new.train(layer.training)
        return new

    def _local_routing(self, routing: Routing, B: int, S: int) -> Routing:
        """This rank's tokens of a routing of the group's tokens ([B,S] order), as a Routing.
        The weights go through comm.split, so every rank's router gets the full gradient."""
        tp, k = self.tp_group, routing.top_k
        if self.sequence_parallel:
            idx = routing.topk_idx.view(B, S, k).chunk(tp.size, dim=1)[tp.rank].reshape(-1, k)
            weights = comm.split(routing.topk_weights.view(B, S, k), tp, 1).reshape(-1, k)
        else:
            idx = routing.topk_idx.chunk(tp.size, dim=0)[tp.rank]
            weights = comm.split(routing.topk_weights, tp, 0)
        return Routing.from_topk(idx, weights, routing.num_experts, routing.capacity, routing.dropless)

    def _shared_output(self, x_BSH: torch.Tensor, x_full: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # x_full is already gathered: straight to the GEMMs
            out = self.shared_experts(x_full, input_entered=True)
        else:
            out = self.shared_experts(x_full)
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(x_BSH)) * out
        return out

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """Shared-expert output for the layer input `x`, in the same layout."""
        x_full = comm.all_gather(x, self.tp_group, -2) if self.sequence_parallel else x
        return self._shared_output(x, x_full)

    # --- stages: tp_route -> dispatch -> compute_experts -> combine -> tp_output ------------
    def tp_route(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing, TensorParallelMoEState]:
        """Route the TP group's tokens; return this rank's tokens `[T_local,H]` to dispatch, their
        Routing, and the state `tp_output` needs. `x` is the layer input (residual layout)."""
        shape, H = x.shape, self.config.hidden_size
        if shape[-1] != H:
            raise ValueError(f"MoELayer expects x[..., {H}], got shape {tuple(shape)}")
        x_BSH = x.reshape(-1, shape[-2], H) if x.dim() >= 3 else x.reshape(1, -1, H)
        tp = self.tp_group
        if self.sequence_parallel:
            x_full = comm.all_gather(x_BSH, tp, 1)  # one gather for the router and shared experts
            router_in = keep_own_slice_grad(x_full, tp, 1)  # replicated router: count each slice once
            x_local_TH = x_BSH.reshape(-1, H)
        else:
            x_full = router_in = x_BSH
            T = x_BSH.shape[0] * x_BSH.shape[1]
            if T % tp.size:
                raise ValueError(f"tensor parallel MoE without sequence parallel splits the {T} tokens over "
                                 f"tp={tp.size} ranks for the routed experts; use a batch*sequence divisible "
                                 f"by tp, or sequence parallel")
            x_local_TH = comm.split(x_BSH.reshape(-1, H), tp, 0)
        B, S = x_full.shape[:2]
        routing = self._local_routing(self.route(router_in.reshape(-1, H), S), B, S)
        return x_local_TH, routing, TensorParallelMoEState(shape, x_BSH, x_full)

    def tp_shared(self, state: TensorParallelMoEState) -> torch.Tensor | None:
        """The shared experts' output for the routed tokens (None without shared experts)."""
        return None if self.shared_experts is None else self._shared_output(state.x_BSH, state.x_full)

    def tp_output(self, out_TH: torch.Tensor, state: TensorParallelMoEState,
                  shared: torch.Tensor | None = None) -> torch.Tensor:
        """Combined routed output of this rank's tokens (+ shared, computed here when not given)
        back in the layer input's layout and shape."""
        x_BSH = state.x_BSH
        if self.sequence_parallel:
            out = out_TH.view(x_BSH.shape)
        else:  # every rank's consumer of the gathered output is identical
            out = comm.all_gather(out_TH, self.tp_group, 0, reduce_grad=False).view(x_BSH.shape)
        if self.shared_experts is not None:
            out = out + (self.tp_shared(state) if shared is None else shared)
        return out.view(state.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TH, routing, state = self.tp_route(x)
        shared = None
        if self.shared_experts is not None and hasattr(self.dispatcher, "dispatch_start"):
            pending = self.dispatcher.dispatch_start(x_TH, routing)  # shared experts overlap it
            shared = self.tp_shared(state)
            x_NH, rows_per_expert, handle = self.dispatcher.dispatch_finish(pending)
        else:
            x_NH, rows_per_expert, handle = self.dispatch(x_TH, routing)
        probs_N, handle = self.probs_for_experts(handle)  # the routing weights inside the experts
        out_TH = self.combine(self.compute_experts(x_NH, rows_per_expert, probs_N), handle)
        return self.tp_output(out_TH, state, shared)
