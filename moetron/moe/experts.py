"""GroupedExperts: the routed experts this rank holds, as 3-D weights run through one grouped GEMM."""

from __future__ import annotations

import torch
from torch import nn

from moetron.dispatch.base import local_expert_range, rank_and_size
from moetron.ops import recompute
from moetron.moe.grouped_gemm import grouped_linear
from moetron.ops.functional import weighted_swiglu
from moetron.parallel import comm


class GroupedExperts(nn.Module):
    """SwiGLU experts stored as `gate_up_proj [E,2F,H]` (gate rows first) and `down_proj [E,H,F]`.

    The layout is transformers 5's fused one, so checkpoints map without reshuffling.
    Input rows arrive expert-major with `rows_per_expert [E]`, as `permute` produces.

    Expert parallel (`ep_group`): this rank holds only experts
    `ep_rank*E/ep ... (ep_rank+1)*E/ep - 1`. Expert-tensor parallel (`etp_group`): each
    of those is split on the ffn dim; ETP rank t keeps gate rows and up rows
    `t*F/etp ... (t+1)*F/etp - 1` (matching slices, so SwiGLU stays local) and the same
    columns of down, so its output is a partial sum that the dispatcher's combine adds
    up over the ETP group. `load_full_experts` / `full_expert_weights` convert between
    this shard and the full tensors (tests, checkpoints).

    `probs_N [N]` (fp32), when given, are the rows' routing weights: they scale the [N,F] SwiGLU
    output before the down projection (Megatron-Core's weighted SwiGLU), so the combine sums
    unweighted rows. `activation_impl` picks the SwiGLU kernel (moetron/kernels/fused_swiglu.py:
    None by device -- C++ on a CPU under `train.fusion=cpp`, the CPU default --, "auto" fused where
    the device has a kernel, "torch", "cpp", "triton").

    `recompute_act` (recompute option `moe_act`, set by the decoder layer) makes the SwiGLU an
    output-discarding region (moetron/ops/recompute.py): its [N,F] output, which the down
    GEMM saves, is recomputed in backward from gate_up, which is kept.
    """

    recompute_act = False
    activation_impl: str | None = None
    takes_probs = True  # forward(x, rows, probs_N) applies the routing weights (a subclass may not)

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int,
                 backend: str = "auto", init_std: float = 0.02, *, ep_group=None, etp_group=None):
        super().__init__()
        self.local_experts = local_expert_range(num_experts, ep_group)
        self.etp_rank, etp = rank_and_size(etp_group)
        if ffn_hidden_size % etp:
            raise ValueError(f"etp={etp} does not divide the expert ffn_hidden_size={ffn_hidden_size}")
        self.ep_group, self.etp_group = ep_group, etp_group
        self.num_experts, self.ffn_hidden_size, self.backend = num_experts, ffn_hidden_size, backend
        self.num_local_experts = len(self.local_experts)
        self.local_ffn_size = ffn_hidden_size // etp
        E, F = self.num_local_experts, self.local_ffn_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(E, hidden_size, F))
        nn.init.normal_(self.gate_up_proj, std=init_std)
        nn.init.normal_(self.down_proj, std=init_std)
        self.mark_expert_parallel()

    def mark_expert_parallel(self) -> None:
        """Tag the expert weights `expert_parallel=True`: data parallel reduces them over the
        expert-data group (parallel/data_parallel.py reads the flag, never this class)."""
        for p in (self.gate_up_proj, self.down_proj):
            p.expert_parallel = True

    def forward(self, x_NH: torch.Tensor, rows_per_expert: torch.Tensor,
                probs_N: torch.Tensor | None = None) -> torch.Tensor:
        gate_up = grouped_linear(x_NH, self.gate_up_proj, rows_per_expert, self.backend)
        if self.recompute_act:
            args = (gate_up,) if probs_N is None else (gate_up, probs_N)
            act = recompute.discard_output(self._activation, *args)
            with recompute.saved_outputs():
                return grouped_linear(act, self.down_proj, rows_per_expert, self.backend)
        return grouped_linear(self._activation(gate_up, probs_N), self.down_proj, rows_per_expert, self.backend)

    def _activation(self, gate_up: torch.Tensor, probs_N: torch.Tensor | None = None) -> torch.Tensor:
        return weighted_swiglu(gate_up, probs_N, self.activation_impl)

    # --- full <-> shard ------------------------------------------------------------------
    def _ffn_slice(self) -> slice:
        start = self.etp_rank * self.local_ffn_size
        return slice(start, start + self.local_ffn_size)

    def shard_of(self, gate_up_full: torch.Tensor, down_full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slices of full `gate_up [E,2F,H]` and `down [E,H,F]` tensors."""
        E, F = self.num_experts, self.ffn_hidden_size
        if gate_up_full.shape[:2] != (E, 2 * F) or down_full.shape[0] != E or down_full.shape[2] != F:
            raise ValueError(f"expected full expert weights gate_up [{E},{2 * F},H] and down [{E},H,{F}], "
                             f"got {tuple(gate_up_full.shape)} and {tuple(down_full.shape)}")
        experts = slice(self.local_experts.start, self.local_experts.stop)
        ffn = self._ffn_slice()
        gate, up = gate_up_full[experts].split(F, dim=1)
        return torch.cat([gate[:, ffn], up[:, ffn]], dim=1), down_full[experts][:, :, ffn]

    @torch.no_grad()
    def load_full_experts(self, gate_up_full: torch.Tensor, down_full: torch.Tensor) -> None:
        """Copy this rank's shard out of the full (unsharded) expert weights."""
        gate_up, down = self.shard_of(gate_up_full, down_full)
        self.gate_up_proj.copy_(gate_up)
        self.down_proj.copy_(down)

    @torch.no_grad()
    def full_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts, unsharded, on every rank: all-gathers over ETP then EP (collective)."""
        F = self.local_ffn_size
        gate, up = self.gate_up_proj.detach().split(F, dim=1)
        if self.etp_group is not None:
            gate, up = comm.all_gather(gate, self.etp_group, dim=1), comm.all_gather(up, self.etp_group, dim=1)
        gate_up = torch.cat([gate, up], dim=1)
        down = self.down_proj.detach()
        if self.etp_group is not None:
            down = comm.all_gather(down, self.etp_group, dim=2)
        if self.ep_group is not None:
            gate_up, down = comm.all_gather(gate_up, self.ep_group), comm.all_gather(down, self.ep_group)
        return gate_up, down
