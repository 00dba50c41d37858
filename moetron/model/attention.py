"""Self-attention of the two families: GQA with q/k norms (Qwen3) and MLA (DeepSeek-V3).

Design notes: docs/model.md (`moetron/model/attention.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from moetron.config import ModelConfig
from moetron.ops import recompute
from moetron.ops.attention_core import core_attention
from moetron.ops.norm import RMSNorm
from moetron.model.rope import yarn_softmax_scale
from moetron.ops import apply_rope, rms_norm_rope
from moetron.ops.linear import project, project_many
from moetron.parallel import context_parallel
from moetron.parallel.state import Group


def _linear(cfg: ModelConfig, n_in: int, n_out: int, bias: bool = False) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=bias)
    nn.init.normal_(layer.weight, std=cfg.init_std)
    if bias:
        nn.init.zeros_(layer.bias)
    return layer


class GroupedQueryAttention(nn.Module):
    """GQA with RMSNorm on each head of q and k before RoPE (Qwen3)."""

    cp_group: Group | None = None  # context-parallel group (set by context_parallelize)
    cp_comm: context_parallel.CPComm | None = None  # its exchange (set by context_parallelize; None: all-gather)
    recompute_modules: frozenset[str] = frozenset()  # set by the decoder layer

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = _linear(cfg, cfg.hidden_size, self.num_heads * self.head_dim, cfg.attention_bias)
        self.k_proj = _linear(cfg, cfg.hidden_size, self.num_kv_heads * self.head_dim, cfg.attention_bias)
        self.v_proj = _linear(cfg, cfg.hidden_size, self.num_kv_heads * self.head_dim, cfg.attention_bias)
        self.o_proj = _linear(cfg, self.num_heads * self.head_dim, cfg.hidden_size, cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project_qkv(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [B,S,heads*head_dim] (the seam tensor parallel overrides: one gather for all three)."""
        return project_many([self.q_proj, self.k_proj, self.v_proj], x_BSH)

    @staticmethod
    def _norm_rope(norm: RMSNorm, x_BSNd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The q/k norm then RoPE, [B, heads, S, d]: one op each way under train.fusion=cpp. A norm with
        hooks (or one that is not moetron's RMSNorm) runs as a module call."""
        if type(norm) is RMSNorm and not (norm._forward_hooks or norm._forward_pre_hooks):
            return rms_norm_rope(x_BSNd, norm.weight, norm.eps, cos, sin)
        return apply_rope(norm(x_BSNd).transpose(1, 2), cos, sin)

    def forward(self, x_BSH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # Shapes come from the projections, not x or the config: under tensor/sequence parallel
        # they hold this rank's heads over the whole (gathered) sequence.
        q, k, v = self.project_qkv(x_BSH)
        B, S = q.shape[:2]
        cos, sin = rope
        q = self._norm_rope(self.q_norm, q.view(B, S, -1, self.head_dim), cos, sin)
        k = self._norm_rope(self.k_norm, k.view(B, S, -1, self.head_dim), cos, sin)
        v = v.view(B, S, -1, self.head_dim).transpose(1, 2)
        if self.cp_group is not None and self.cp_group.size > 1:
            fn, extra = context_parallel.gqa_attention, (self.cp_group, self.cp_comm)
        else:
            fn, extra = core_attention, ()
        args = (q, k, v, self.head_dim ** -0.5, self.cfg.attention_backend, *extra)
        out = recompute.checkpoint(fn, *args) if "core_attn" in self.recompute_modules else fn(*args)
        return project(self.o_proj, out.transpose(1, 2).reshape(B, S, -1))


class MultiLatentAttention(nn.Module):
    """MLA: queries (optionally through a low-rank `q_lora_rank` bottleneck) and keys/values
    decompressed from a `kv_lora_rank` latent; one rotary key part shared by all heads."""

    cp_group: Group | None = None  # context-parallel group (set by context_parallelize)
    cp_comm: context_parallel.CPComm | None = None  # its exchange (set by context_parallelize; None: all-gather)
    recompute_modules: frozenset[str] = frozenset()  # set by the decoder layer

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.num_heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        if cfg.q_lora_rank is None:
            self.q_proj = _linear(cfg, cfg.hidden_size, self.num_heads * qk_dim)
        else:
            self.q_a_proj = _linear(cfg, cfg.hidden_size, cfg.q_lora_rank, cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = _linear(cfg, cfg.q_lora_rank, self.num_heads * qk_dim)
        self.kv_a_proj_with_mqa = _linear(cfg, cfg.hidden_size, cfg.kv_lora_rank + self.rope_dim, cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = _linear(cfg, cfg.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim))
        self.o_proj = _linear(cfg, self.num_heads * self.v_dim, cfg.hidden_size, cfg.attention_bias)
        self.softmax_scale = yarn_softmax_scale(qk_dim, cfg.rope_scaling)

    def queries(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self._query_up(self._query_latent(x_BSH))

    def _query_latent(self, x_BSH: torch.Tensor) -> torch.Tensor:
        """What the query up-projection reads: the normed q latent, or x without a q bottleneck."""
        if self.cfg.q_lora_rank is None:
            return x_BSH
        return self.q_a_layernorm(project(self.q_a_proj, x_BSH))

    def _query_up(self, q_latent: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank is None:
            return project(self.q_proj, q_latent)
        return project(self.q_b_proj, q_latent)

    def latent_kv(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed kv latent [B,S,kv_lora_rank] and the shared rotary key [B,S,rope_dim]."""
        latent, k_rot = project(self.kv_a_proj_with_mqa, x_BSH).split([self.cfg.kv_lora_rank, self.rope_dim], dim=-1)
        return self.kv_a_layernorm(latent), k_rot

    def forward(self, x_BSH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # Shapes come from the projections, not x or the config: under tensor/sequence parallel
        # they hold this rank's heads over the whole (gathered) sequence.
        cos, sin = rope
        up_discarded = "mla_up_proj" in self.recompute_modules
        if up_discarded:
            q_in = self._query_latent(x_BSH)
        else:
            q = self._query_heads(self.queries(x_BSH), cos, sin)
        latent, k_rot = self.latent_kv(x_BSH)
        B, S = latent.shape[:2]
        k_rot = apply_rope(k_rot.view(B, 1, S, self.rope_dim), cos, sin, self.cfg.rope_interleave)
        cp = self.cp_group is not None and self.cp_group.size > 1
        gather = cp and (self.cp_comm is None or self.cp_comm.kind == "allgather")
        if gather:  # the whole sequence's latent and rotated rotary key, in global order
            latent, k_rot = context_parallel.gather_latent(latent, k_rot, self.cp_group)
        if up_discarded:
            q, k, v = recompute.discard_output(self._up_project, q_in, latent, k_rot, cos, sin)
        else:
            k, v = self._keys_values(latent, k_rot, q.shape[1])
        with recompute.saved_outputs(up_discarded):  # the core's copies of q, k, v are recomputed
            if gather:
                fn, extra = context_parallel.attend_local_chunks, (self.cp_group.size, self.cp_group.rank)
            elif cp:  # p2p, a2a, a2a+p2p: this rank's per-head K/V (decompressed here) are exchanged
                fn, extra = context_parallel.exchange_attention, (self.cp_comm,)
            else:
                fn, extra = core_attention, ()
            args = (q, k, v, self.softmax_scale, self.cfg.attention_backend, *extra)
            out = recompute.checkpoint(fn, *args) if "core_attn" in self.recompute_modules else fn(*args)
        return project(self.o_proj, out.transpose(1, 2).reshape(B, S, -1))

    # --- pieces of forward ---------------------------------------------------------------
    def _query_heads(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Projected queries [B,S,h*(nope+rope)] -> [B,h,S,nope+rope] with RoPE on the rope part."""
        B, S = q.shape[:2]
        q = q.view(B, S, -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rot = apply_rope(q_rot, cos, sin, self.cfg.rope_interleave)
        return torch.cat((q_nope, q_rot), dim=-1)

    def _keys_values(self, latent: torch.Tensor, k_rot: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decompress the (gathered) latent [B,S_kv,r] into per-head keys (with the shared rotated
        key [B,1,S_kv,rope] appended) and values, [B,h,S_kv,*]."""
        B, S_kv = latent.shape[:2]
        kv = project(self.kv_b_proj, latent).view(B, S_kv, h, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(B, h, S_kv, self.rope_dim)), dim=-1)
        return k, v

    def _up_project(self, q_latent, latent, k_rot, cos, sin):
        """The `mla_up_proj` region: q, k, v from the latents (and the rotated shared key)."""
        q = self._query_heads(self._query_up(q_latent), cos, sin)
        k, v = self._keys_values(latent, k_rot, q.shape[1])
        return q, k, v
