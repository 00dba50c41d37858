"""MoELayer: router → dispatch → experts → combine (+ shared experts), usable on its own.

    from moetron import MoELayer, MoEConfig
    layer = MoELayer(MoEConfig(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2))
    y = layer(x)            # x [..., 64] -> y [..., 64]

The four stages are separate methods (DESIGN principle 5) so a pipeline schedule
can run them one at a time; `forward` simply chains them, and applies the routing weights inside
the experts' SwiGLU where the dispatcher keeps them beside the rows (`probs_on_experts`).

Recomputation (moetron/ops/recompute.py): `recompute_modules` is set by the decoder layer. The
whole-layer `moe` checkpoint wraps the layer's call in `DecoderLayer.mlp_block`; when a pipeline
calls the stages one by one instead, `moe` checkpoints the compute stages (route, experts, shared
experts) one at a time and never the dispatch/combine communication. A recomputed `route` takes
no statistics (they were taken in the forward) and replays the router's global-batch counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetron.dispatch.allgather import AllGatherDispatcher, AllGatherHandle
from moetron.dispatch.alltoall import AllToAllDispatcher, AllToAllHandle
from moetron.dispatch.base import LocalDispatcher, TokenDispatcher
from moetron.dispatch.routing import Routing
from moetron.ops import recompute
from moetron.ops.mlp import MLP
from moetron.moe.config import MoEConfig
from moetron.moe.experts import GroupedExperts
from moetron.moe.router import TopKRouter
from moetron.parallel.state import Group, ParallelState
from moetron.dispatch.flex import FlexTokenDispatcher, FlexTokenHandle
from moetron.dispatch.permute import PermuteState, row_weights

DISPATCHERS = ("local", "allgather", "alltoall", "flex")


class MoELayer(nn.Module):
    """One MoE block; expert parallel when given a `ParallelState`.

        MoELayer(config)                                   # one process, all experts
        MoELayer(config, parallel_state=ps)                # EP/ETP from ps, all-to-all dispatch
        MoELayer(config, parallel_state=ps, dispatcher="allgather")
        MoELayer(config, parallel_state=ps, dispatcher=my_dispatcher)   # e.g. a flex dispatcher

    With `parallel_state`, the experts are sharded over `ps.ep` (whole experts) and `ps.etp`
    (the ffn dim) and `dispatcher` names how tokens reach them: "alltoall" (default when
    the expert grid is parallel) over ps.ep and ps.etp, "allgather" over ps.tp_ep, "flex"
    (DeepEP-style, over ps.tp_ep, with `flex_backend` torch | deepep | nvshmem; shared
    experts then run while the dispatch is in flight), or "local" (only when ep = etp = 1). A dispatcher object is used as given. Router and
    shared experts are replicated: their gradients must be summed over the data-parallel
    ranks by the caller, like any replicated parameter; the experts' over ps.edp.
    `pad_multiple` pads each local expert's rows to a multiple (FP8 grouped GEMMs).
    """

    recompute_modules: frozenset[str] = frozenset()  # set by the decoder layer

    def __init__(self, config: MoEConfig, dispatcher: TokenDispatcher | str | None = None, *,
                 parallel_state: ParallelState | None = None, pad_multiple: int = 1,
                 flex_backend: str = "torch"):
        super().__init__()
        self.config = config
        self.parallel_state = parallel_state
        ep_group = parallel_state.ep if parallel_state is not None else None
        etp_group = parallel_state.etp if parallel_state is not None else None
        self.router = TopKRouter(config)
        self.experts = GroupedExperts(config.num_experts, config.hidden_size, config.ffn_hidden_size,
                                      config.expert_backend, config.init_std,
                                      ep_group=ep_group, etp_group=etp_group)
        self.shared_experts = (MLP(config.hidden_size, config.shared_expert_ffn_size, config.init_std)
                               if config.shared_expert_ffn_size else None)
        self.shared_expert_gate = (nn.Linear(config.hidden_size, 1, bias=False)
                                   if config.shared_expert_gate else None)
        self.dispatcher = self._build_dispatcher(dispatcher, pad_multiple, flex_backend)
        self.register_buffer("pending_counts", torch.zeros(config.num_experts, dtype=torch.float32),
                             persistent=False)
        self.last_losses: dict[str, torch.Tensor] = {}
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.last_num_slots = 0
        # Kept slots per expert and routed slots of every forward since reset_load_totals():
        # a training step's load over all its micro-batches (the trainer resets it each step).
        self._load_counts: torch.Tensor | None = None
        self._load_slots = 0

    def _build_dispatcher(self, dispatcher, pad_multiple: int, flex_backend: str) -> TokenDispatcher:
        if dispatcher is not None and not isinstance(dispatcher, str):
            return dispatcher
        cfg, ps = self.config, self.parallel_state
        experts = self.experts
        sharded = (experts.num_local_experts, experts.local_ffn_size) != (cfg.num_experts, cfg.ffn_hidden_size)
        name = dispatcher or ("alltoall" if sharded else "local")
        if name not in DISPATCHERS:
            raise ValueError(f"dispatcher={name!r} is unknown; choose one of {DISPATCHERS} "
                             f"or pass a dispatcher object")
        if name == "local":
            if sharded:
                raise ValueError(f"dispatcher='local' needs every expert in this process, but "
                                 f"ep={ps.ep.size} and etp={ps.etp.size}: use 'alltoall' or 'allgather'")
            return LocalDispatcher(cfg.num_experts, pad_multiple, cfg.pad_to_capacity)
        if ps is None:
            raise ValueError(f"dispatcher={name!r} needs parallel_state= to know its process groups")
        if name == "flex":
            # DeepEP: every layer reserves its row size in the one shared Buffer (bf16 or FP8 rows: 2 bytes).
            options = {"hidden_bytes": cfg.hidden_size * 2} if flex_backend == "deepep" else {}
            return FlexTokenDispatcher(ps.tp_ep, cfg.num_experts, etp=ps.etp.size, backend=flex_backend,
                                       pad_multiple=pad_multiple, pad_to_capacity=cfg.pad_to_capacity,
                                       top_k=cfg.top_k, **options)
        if name == "allgather":
            return AllGatherDispatcher(ps.tp_ep, cfg.num_experts, self.experts.local_experts,
                                       pad_multiple=pad_multiple, pad_to_capacity=cfg.pad_to_capacity)
        return AllToAllDispatcher(ps.ep, cfg.num_experts, ps.etp, pad_multiple=pad_multiple,
                                  pad_to_capacity=cfg.pad_to_capacity)

    @property
    def balance_groups(self) -> tuple[Group, ...]:
        """Groups whose sum spans every rank of this pipeline stage: ETP×EP, then EDP.

        Each rank's router counts only its own tokens, and the ranks of a stage hold
        different tokens (DP, CP and sequence-parallel shards; EP and EDP fold over those
        same ranks). The stage is ETP×EP×EDP in the expert grid, so reducing over tp_ep
        and then edp counts every token of the global batch. Ranks holding copies of the
        same tokens (TP without sequence parallel) scale every count by the same factor,
        which leaves the sign-based bias update unchanged.
        """
        ps = self.parallel_state
        return () if ps is None else (ps.tp_ep, ps.edp)

    # --- the four schedulable stages -------------------------------------------------
    def _checkpoint_stages(self) -> bool:
        """Checkpoint route / experts / shared one by one (a plain call inside the whole-MoE one)."""
        return "moe" in self.recompute_modules

    def _saved_outputs(self):
        """Consumers of the discarded norm output (`layernorm`) when a pipeline calls the stages."""
        return recompute.saved_outputs("layernorm" in self.recompute_modules)

    def route(self, x_TH: torch.Tensor, seq_len: int | None = None) -> Routing:
        with self._saved_outputs():
            if self._checkpoint_stages():
                return recompute.checkpoint(self._route, x_TH, seq_len)
            return self._route(x_TH, seq_len)

    def _route(self, x_TH: torch.Tensor, seq_len: int | None) -> Routing:
        with recompute.replayed(self.router, "global_counts"):  # once per forward, never recomputed
            routing, losses, selected_counts = self.router(x_TH, seq_len)
        if recompute.is_recomputing():  # the statistics were taken when the forward ran
            return routing
        self.last_losses = losses.values
        self.last_tokens_per_expert = routing.tokens_per_expert.detach()
        self.last_num_slots = routing.num_tokens * routing.top_k  # stats() derives the dropped fraction
        counts = self.last_tokens_per_expert
        self._load_counts = counts.clone() if self._load_counts is None else self._load_counts + counts
        self._load_slots += self.last_num_slots
        if self.training:
            self.pending_counts.add_(selected_counts)  # exact: integer counts into fp32
        return routing

    def dispatch(self, x_TH: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, Any]:
        with self._saved_outputs():
            return self.dispatcher.dispatch(x_TH, routing)

    def compute_experts(self, x_NH: torch.Tensor, rows_per_expert: torch.Tensor,
                        probs_N: torch.Tensor | None = None) -> torch.Tensor:
        args = (x_NH, rows_per_expert) if probs_N is None else (x_NH, rows_per_expert, probs_N)
        if self._checkpoint_stages():
            return recompute.checkpoint(self.experts, *args)
        return self.experts(*args)

    def probs_for_experts(self, handle: Any) -> tuple[torch.Tensor | None, Any]:
        """`probs_on_experts(handle)` when the experts apply the routing weights, else `(None, handle)`."""
        return probs_on_experts(handle) if self.experts.takes_probs else (None, handle)

    def combine(self, y_NH: torch.Tensor, handle: Any) -> torch.Tensor:
        return self.dispatcher.combine(y_NH, handle)

    def shared(self, x_TH: torch.Tensor) -> torch.Tensor:
        with self._saved_outputs():
            if self._checkpoint_stages():
                return recompute.checkpoint(self._shared, x_TH)
            return self._shared(x_TH)

    def _shared(self, x_TH: torch.Tensor) -> torch.Tensor:
        out = self.shared_experts(x_TH)
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(x_TH)) * out
        return out

    # ----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if shape[-1] != self.config.hidden_size:
            raise ValueError(f"MoELayer expects x[..., {self.config.hidden_size}], got shape {tuple(shape)}")
        x_TH = x.reshape(-1, shape[-1])
        seq_len = shape[-2] if x.dim() >= 3 else None
        routing = self.route(x_TH, seq_len)
        shared_TH = None
        if self.shared_experts is not None and hasattr(self.dispatcher, "dispatch_start"):
            # Overlap: issue the asynchronous dispatch, run the shared expert, then wait.
            pending = self.dispatcher.dispatch_start(x_TH, routing)
            shared_TH = self.shared(x_TH)
            x_NH, rows_per_expert, handle = self.dispatcher.dispatch_finish(pending)
        else:
            x_NH, rows_per_expert, handle = self.dispatch(x_TH, routing)
        probs_N, handle = self.probs_for_experts(handle)
        out_TH = self.combine(self.compute_experts(x_NH, rows_per_expert, probs_N), handle)
        if self.shared_experts is not None:
            out_TH = out_TH + (self.shared(x_TH) if shared_TH is None else shared_TH)
        return out_TH.view(shape)

    # --- balancing and statistics -----------------------------------------------------
    @property
    def aux_losses(self) -> dict[str, torch.Tensor]:
        """Detached values of this layer's balancing losses from the last forward."""
        return dict(self.last_losses)

    @torch.no_grad()
    def update_expert_bias(self, group=None) -> torch.Tensor | None:
        """Aux-loss-free balancing step, once per global batch: `bias += rate * sign(mean - count)`.

        Counts are the top-k selections of this rank's tokens since the last call, summed
        over `group` (a group or a sequence of groups reduced in turn). By default: the
        layer's `balance_groups` (every rank of the stage) when built with a
        ParallelState, else nothing. Every rank must call it. Returns the counts used.
        """
        counts = self.pending_counts.clone()
        self.pending_counts.zero_()
        self.router.reset_global_counts()
        if self.router.expert_bias is None:
            return counts
        _sum_over(counts, self.balance_groups if group is None else group)
        self.router.expert_bias += self.config.bias_update_rate * torch.sign(counts.mean() - counts)
        return counts

    @torch.no_grad()
    def discard_pending_counts(self) -> None:
        """Forget the routing counts since the last bias update (a skipped step updates no bias)."""
        self.pending_counts.zero_()
        self.router.reset_global_counts()

    def load_totals(self) -> torch.Tensor:
        """`[E + 1]` float64: kept slots per expert, then routed slots, since `reset_load_totals()`.

        This rank's tokens only; sum it over ranks to get a global step's load (`load_summary`).
        """
        if self._load_counts is None:
            return torch.zeros(self.config.num_experts + 1, dtype=torch.float64, device=self.router.weight.device)
        slots = self._load_counts.new_tensor([self._load_slots])
        return torch.cat([self._load_counts, slots]).double()

    def reset_load_totals(self) -> None:
        self._load_counts, self._load_slots = None, 0

    def stats(self, group=None) -> dict[str, float]:
        """Load of the last forward: max and mean tokens per expert, and the dropped fraction.

        Local to this rank unless `group` is given (e.g. `layer.balance_groups`; then
        every rank of it must call, so do not call it from rank 0 alone).
        """
        if self.last_tokens_per_expert is None:
            return {}
        counts = self.last_tokens_per_expert.float()
        if group is not None:
            both = torch.cat([counts, counts.new_tensor([self.last_num_slots])])
            _sum_over(both, group)
            counts, slots = both[:-1], both[-1].item()
            dropped = 1.0 - counts.sum().item() / max(slots, 1.0)
        else:
            dropped = 1.0 - counts.sum().item() / max(self.last_num_slots, 1)
        mean = counts.mean().item()
        return {"max_load": counts.max().item(), "mean_load": mean,
                "max_over_mean": counts.max().item() / mean if mean else 0.0,
                "dropped_fraction": dropped}


def load_summary(totals) -> dict[str, float]:
    """`{"max_over_mean", "dropped_fraction"}` of `load_totals()` (summed over ranks or not).

    max_over_mean: the busiest expert's kept slots over the mean per expert (1.0 = perfectly
    balanced); dropped_fraction: the routed slots that capacity dropped. Both are ratios, so
    ranks routing copies of the same tokens (tensor parallel without sequence parallel) change
    neither. `{}` when no token was routed. A list or a CPU tensor avoids device syncs.
    """
    values = totals.tolist() if isinstance(totals, torch.Tensor) else list(totals)
    counts, slots = values[:-1], values[-1]
    if slots <= 0:
        return {}
    mean = sum(counts) / len(counts)
    return {"max_over_mean": max(counts) / mean if mean else 0.0,
            "dropped_fraction": 1.0 - sum(counts) / slots}


def probs_on_experts(handle: Any) -> tuple[torch.Tensor | None, Any]:
    """`(probs_N, handle')`: the routing weight of every dispatched row, and a handle whose combine
    sums the rows unweighted; the experts then apply the weights inside the SwiGLU (on [N, F]
    instead of [N, H] rows, and the unpermute's backward is a plain gather).

    Where the rows' weights are on this rank beside a `PermuteState` (local, all-gather and flex
    dispatch), or travelled with the rows (all-to-all dispatch: `handle.probs_N`). Any other
    handle: `(None, handle)`, and its combine weights the rows.
    """
    if isinstance(handle, tuple) and len(handle) == 2 and isinstance(handle[0], PermuteState):
        state, weights = handle
        probs = row_weights(state, weights)
        return (probs, (state, None)) if probs is not None else (None, handle)
    if isinstance(handle, AllGatherHandle) and handle.topk_weights is not None:
        probs = row_weights(handle.state, handle.topk_weights)
        return (probs, dataclasses.replace(handle, topk_weights=None)) if probs is not None else (None, handle)
    if isinstance(handle, FlexTokenHandle) and handle.recv_topk_weights is not None:
        probs = row_weights(handle.state, handle.recv_topk_weights)
        return (probs, dataclasses.replace(handle, recv_topk_weights=None)) if probs is not None else (None, handle)
    if isinstance(handle, AllToAllHandle) and handle.probs_N is not None and handle.topk_weights is not None:
        return handle.probs_N, dataclasses.replace(handle, topk_weights=None, probs_N=None)
    return None, handle


def _sum_over(t: torch.Tensor, groups) -> None:
    """In-place sum of `t` over a group, or over each of a sequence of groups in turn."""
    if groups is None:
        return
    if not isinstance(groups, Sequence):
        groups = (groups,)
    for group in groups:
        if isinstance(group, Group):
            if group.size == 1:
                continue
            group = group.handle
        dist.all_reduce(t, group=group)
