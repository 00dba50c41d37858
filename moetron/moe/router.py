"""TopKRouter: scores, top-k selection, capacity, and balancing losses, all in fp32.

Where moetron's conventions differ from Megatron-Core's and transformers' (which experts the
balancing losses count, the group score, capacity rounding, drop ties, what the bias update
counts), and the option that gives the other one: docs/router_conventions.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from moetron.dispatch.routing import Routing, count_per_expert
from moetron.kernels import availability, fused_router
from moetron.ops import fusion_mode, recompute
from moetron.ops.linear import linear
from moetron.moe import balancing
from moetron.moe.config import MoEConfig
from moetron.parallel.state import Group


@dataclass
class RouterLosses:
    """Detached values of the balancing losses of one forward (their gradients are injected)."""

    values: dict[str, torch.Tensor] = field(default_factory=dict)


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: `ceil(T * k * capacity_factor / E)` (robust to decimal factors like 1.1)."""
    return math.ceil(num_tokens * top_k * capacity_factor / num_experts - 1e-9)


def drop_over_capacity(topk_idx_TK, topk_weights_TK, num_experts: int, cap: int, policy: str):
    """Drop the slots beyond each expert's capacity: lowest weight first (`probs`) or latest token first."""
    T, K = topk_idx_TK.shape
    chosen_TE = torch.zeros(T, num_experts, dtype=torch.bool, device=topk_idx_TK.device)
    chosen_TE.scatter_(1, topk_idx_TK, True)
    if policy == "position":
        keep_TE = chosen_TE & (torch.cumsum(chosen_TE.int(), dim=0) <= cap)
    else:
        weight_TE = torch.full((T, num_experts), -1.0, device=topk_idx_TK.device)
        weight_TE.scatter_(1, topk_idx_TK, topk_weights_TK.detach().float())
        top_rows = torch.topk(weight_TE, min(cap, T), dim=0).indices  # [cap, E]
        keep_TE = torch.zeros_like(chosen_TE).scatter_(0, top_rows, True) & chosen_TE
    keep_TK = keep_TE.gather(1, topk_idx_TK)
    return topk_idx_TK.masked_fill(~keep_TK, -1), topk_weights_TK.masked_fill(~keep_TK, 0.0)


def fused_router_covers(cfg: MoEConfig, balancing: bool = True, cp: int = 1) -> bool:
    """Whether the C++ softmax top-k router (moetron/kernels/fused_router.py) covers `cfg`'s router;
    what it leaves out (an expert bias, groups, capacity, and while balancing: a z-loss, the sequence-wise or
    global loss, context parallelism) runs eagerly. `balancing`: a training forward with gradients."""
    return (cfg.score_func == "softmax" and cfg.softmax_before_topk and not cfg.expert_bias
            and cfg.num_groups is None and cfg.capacity_factor is None
            and not (balancing and (cfg.z_loss_coeff > 0 or cp > 1 or cfg.aux_loss_type not in ("none", "aux_loss"))))


_triton = []  # [moetron.kernels.triton_router] once imported, [None] where triton is not installed


def _triton_router():
    """moetron.kernels.triton_router, imported on first use under train.fusion=triton (None without triton)."""
    if not _triton:
        if availability.triton_installed():
            from moetron.kernels import triton_router
            _triton.append(triton_router)
        else:
            _triton.append(None)
    return _triton[0]


class TopKRouter(nn.Module):
    """Scores every expert for every token and picks the top k (DESIGN: one `Routing` out).

    softmax (before or after top-k) or sigmoid scores; an optional expert bias that
    changes which experts are chosen but never the weights (aux-loss-free balancing);
    group-limited selection; a scaling factor on the weights.

    Context parallel (`cp_group`, set by context_parallelize when cp > 1): each CP rank
    routes its part of every sequence. The balancing losses are then those of the whole
    sequences: expert counts are summed over CP, each rank injects its share of the Switch /
    sequence-wise / global loss (balancing.switch_aux_from_sums), and the reported values are the
    global ones on every CP rank (z-loss: the mean of the ranks' means). Capacity drops stay per
    rank (a rank's own tokens against its own capacity).
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=config.init_std)
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        # global_aux_loss: the raw data-parallel ProcessGroup, to balance over the global batch (not the
        # CP ranks, which cp_group sums already).
        self.balance_group = None
        self.cp_group: Group | None = None  # None or size 1: every loss over this rank's tokens
        self._global_running = None

    def _apply(self, fn, recurse=True):
        # Keep the expert bias in fp32 through model.to(bf16): updates of 1e-3 vanish in bf16.
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = bias.to(device=self.expert_bias.device)
        return self

    def _group_limit(self, choice_TE: torch.Tensor) -> torch.Tensor:
        """Keep only each token's best `topk_groups` groups (scored by their top-2 sum)."""
        cfg = self.config
        T = choice_TE.shape[0]
        grouped = choice_TE.view(T, cfg.num_groups, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        best_groups = group_score.topk(cfg.topk_groups, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best_groups, True)
        return grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(T, -1)

    def forward(self, x_TH: torch.Tensor, seq_len: int | None = None) -> tuple[Routing, RouterLosses, torch.Tensor]:
        """Return the routing, the detached loss values, and the counts per expert for the bias update
        (`bias_update_counts`: the top-k selections before capacity drops, or the slots kept after)."""
        cfg = self.config
        logits_TE = linear(x_TH.float(), self.weight.float())
        fused = self._fused(logits_TE)
        if fused is not None:
            return self._fused_forward(logits_TE, fused)
        if cfg.score_func == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
        elif cfg.softmax_before_topk:
            scores_TE = torch.softmax(logits_TE, dim=-1)
        else:
            scores_TE = logits_TE
        sigmoid_kernels = self._kernels(scores_TE) if cfg.score_func == "sigmoid" else None
        if sigmoid_kernels is not None:  # from the sigmoid on, one C++ pass or Triton kernel each way
            weights, topk_idx, selected_counts = fused_router.TopKSigmoid.apply(
                scores_TE, self.expert_bias, cfg.top_k, cfg.num_groups or 1, cfg.topk_groups or 1,
                cfg.norm_topk_prob, cfg.scaling_factor, sigmoid_kernels)
        else:
            weights, topk_idx, selected_counts = self._select(scores_TE)

        # softmax scores are the probabilities the balancing losses measure: one softmax, not two
        probs_TE = scores_TE if cfg.score_func == "softmax" and cfg.softmax_before_topk else None
        weights, losses = self._balancing_losses(logits_TE, topk_idx, weights, selected_counts, seq_len, probs_TE)
        cap = None
        if cfg.capacity_factor is not None:
            cap = capacity(x_TH.shape[0], cfg.num_experts, cfg.top_k, cfg.capacity_factor)
            topk_idx, weights = drop_over_capacity(topk_idx, weights, cfg.num_experts, cap, cfg.drop_policy)
        routing = Routing.from_topk(topk_idx, weights, cfg.num_experts, cap, dropless=cap is None,
                                    counts=selected_counts)
        bias_counts = routing.tokens_per_expert if cfg.bias_update_counts == "kept" else selected_counts
        return routing, losses, bias_counts

    def _select(self, scores_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The eager selection from the scores: (weights [T, k], topk_idx [T, k], counts [E])."""
        cfg = self.config
        choice_TE = scores_TE.detach()
        if self.expert_bias is not None:
            choice_TE = choice_TE + self.expert_bias
        if cfg.num_groups is not None:
            choice_TE = self._group_limit(choice_TE)
        topk_idx = torch.topk(choice_TE, cfg.top_k, dim=-1).indices
        weights = scores_TE.gather(1, topk_idx)
        if cfg.score_func == "softmax" and not cfg.softmax_before_topk:
            weights = torch.softmax(weights, dim=-1)
        elif cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if cfg.scaling_factor != 1.0:
            weights = weights * cfg.scaling_factor
        return weights, topk_idx, count_per_expert(topk_idx, cfg.num_experts)

    @staticmethod
    def _kernels(scores_TE: torch.Tensor):
        """The kernels of a fused router pass over `scores_TE` (or logits): the C++ ones (train.fusion=cpp)
        or the Triton ones (train.fusion=triton), or None (eager)."""
        mode = fusion_mode()
        if mode == "cpp" and fused_router.applies(scores_TE):
            return fused_router
        if mode == "triton" and _triton_router() is not None and _triton_router().applies(scores_TE):
            return _triton_router()
        return None

    def _fused(self, logits_TE: torch.Tensor):
        """The kernels of the fused softmax top-k that takes this forward, or None: the C++ ones
        (train.fusion=cpp) or the Triton ones (train.fusion=triton), for the routers `fused_router_covers`."""
        cp = self.cp_group.size if self.cp_group is not None else 1
        if not fused_router_covers(self.config, self.training and torch.is_grad_enabled(), cp):
            return None
        return self._kernels(logits_TE)

    def _fused_forward(self, logits_TE: torch.Tensor, kernels) -> tuple[Routing, RouterLosses, torch.Tensor]:
        """forward's result from one fused pass (`kernels`: fused_router or triton_router): the Switch
        loss's gradient (`E/k * counts_e / T^2` for every token's probability of e, times the coefficient
        and the aux-loss scale) joins in its backward."""
        cfg = self.config
        T, E, K = logits_TE.shape[0], cfg.num_experts, cfg.top_k
        aux_on = (self.training and torch.is_grad_enabled() and cfg.aux_loss_type == "aux_loss"
                  and cfg.aux_loss_coeff > 0)
        aux_grad = None
        if aux_on:
            per_count = cfg.aux_loss_coeff * E / K / max(T * T, 1)

            def aux_grad(counts):
                return counts.float() * (per_count * balancing.aux_loss_scale())
        weights, topk_idx, counts, prob_sums = fused_router.TopKSoftmax.apply(
            logits_TE, K, cfg.norm_topk_prob, cfg.scaling_factor, aux_grad, kernels)
        losses = RouterLosses()
        if aux_on:
            aux = balancing.switch_aux_from_sums(prob_sums, counts, K, max(T, 1)) * cfg.aux_loss_coeff
            losses.values[cfg.aux_loss_type] = aux
        return Routing(topk_idx, weights, counts, E, None, dropless=True), losses, counts

    def _balancing_losses(self, logits_TE, topk_idx, weights, counts_E, seq_len, probs_TE=None):
        cfg = self.config
        losses = RouterLosses()
        if not (self.training and torch.is_grad_enabled()):
            return weights, losses
        cp = self.cp_group if self.cp_group is not None and self.cp_group.size > 1 else None
        if cfg.aux_loss_type != "none" and cfg.aux_loss_coeff > 0:
            if probs_TE is None:
                probs_TE = balancing.balance_probs(logits_TE, cfg.score_func)
            if cfg.aux_loss_counts == "paper" and (self.expert_bias is not None or cfg.num_groups is not None):
                # DeepSeek-V3's indicator: the top-k of the unbiased scores, no bias, no group limit.
                topk_idx = torch.topk(probs_TE.detach(), cfg.top_k, dim=-1).indices
                counts_E = count_per_expert(topk_idx, cfg.num_experts)
            if cp is not None:
                aux = self._cp_aux_share(probs_TE, topk_idx, counts_E, seq_len, cp) * cfg.aux_loss_coeff
                # The trainer's aux-loss scale is 1/cp (right for the per-token mean z-loss); a share
                # is a term of a sum, so it needs the gradient 1: inject cp * share.
                weights = balancing.inject_aux_loss(weights, aux * cp.size)
            else:
                if cfg.aux_loss_type == "seq_aux_loss":
                    aux = balancing.seq_aux_loss(probs_TE, topk_idx, seq_len or logits_TE.shape[0])
                elif cfg.aux_loss_type == "global_aux_loss":
                    global_counts, global_tokens = self.global_counts(counts_E, logits_TE.shape[0])
                    aux = balancing.switch_aux_loss(probs_TE, global_counts, cfg.top_k, global_tokens)
                else:
                    aux = balancing.switch_aux_loss(probs_TE, counts_E, cfg.top_k)
                aux = aux * cfg.aux_loss_coeff
                weights = balancing.inject_aux_loss(weights, aux)
            losses.values[cfg.aux_loss_type] = aux.detach()
        if cfg.z_loss_coeff > 0:
            zl = balancing.z_loss(logits_TE) * cfg.z_loss_coeff
            weights = balancing.inject_aux_loss(weights, zl)
            losses.values["z_loss"] = zl.detach()
        if cp is not None and losses.values and not recompute.is_recomputing():  # a recompute reports nothing
            self._report_global_values(losses.values, cp)
        return weights, losses

    def _cp_aux_share(self, probs_TE, topk_idx, counts_E, seq_len, cp: Group) -> torch.Tensor:
        """This CP rank's share of the balancing loss of the whole sequences (unscaled).

        Every CP rank holds the same number of tokens (split_batch), so the whole micro-batch has
        cp times this rank's tokens and every sequence cp times its local length."""
        cfg = self.config
        T, E = probs_TE.shape
        if cfg.aux_loss_type == "seq_aux_loss":
            S = seq_len or T
            with recompute.replayed(self, "cp_sum"):
                counts_BE = self.cp_sum(balancing.seq_counts(topk_idx, E, S))
            return balancing.seq_aux_from_sums(probs_TE.view(-1, S, E).sum(1), counts_BE, cfg.top_k, S * cp.size)
        with recompute.replayed(self, "cp_sum"):
            counts = self.cp_sum(counts_E.float())
        count_tokens = None
        if cfg.aux_loss_type == "global_aux_loss":
            counts, count_tokens = self.global_counts(counts, T * cp.size)
        return balancing.switch_aux_from_sums(probs_TE.sum(0), counts, cfg.top_k, T * cp.size, count_tokens)

    def cp_sum(self, counts: torch.Tensor) -> torch.Tensor:
        """`counts` summed over `cp_group` (a new tensor, no gradient). Replayed, not rerun, in a recompute."""
        counts = counts.detach().clone()
        dist.all_reduce(counts, group=self.cp_group.handle)
        return counts

    @torch.no_grad()
    def _report_global_values(self, values: dict[str, torch.Tensor], cp: Group) -> None:
        """Replace the detached values by the whole sequences' ones, in one all-reduce over CP:
        the sum of the balancing-loss shares, the mean of the ranks' z-loss means (equal token counts)."""
        names = sorted(values)
        total = torch.stack([values[n].float() for n in names])
        dist.all_reduce(total, group=cp.handle)
        for name, value in zip(names, total):
            values[name] = value / cp.size if name == "z_loss" else value

    def global_counts(self, counts_E: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Counts of the global batch so far (this micro-batch included), summed over `balance_group`,
        and their number of tokens: a 0-dim tensor beside them, never read on the host (on a GPU that
        read waited for the forward so far, in every MoE layer). Under CP, `counts_E` and `num_tokens`
        are the micro-batch's, already summed over `cp_group`."""
        counts = counts_E.float()
        tokens = torch.tensor(float(num_tokens), device=counts.device)
        if self.balance_group is not None:
            both = torch.cat([counts, tokens.view(1)])
            torch.distributed.all_reduce(both, group=self.balance_group)
            counts, tokens = both[:-1], both[-1]
        prev = self._global_running
        if prev is not None:
            counts, tokens = counts + prev[0], tokens + prev[1]
        self._global_running = (counts, tokens)
        return counts, tokens

    def reset_global_counts(self) -> None:
        """Start a new global batch for `global_aux_loss`."""
        self._global_running = None

