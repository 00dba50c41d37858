"""Time of one micro-batch of one pipeline stage on one rank: compute by GEMM shape class, the memory-bound
rest, and the TP / CP / EP communication over the link each group spans.

Efficiency factors (achieved / peak) per GEMM shape class are constants below, calibrated once against
the published H100 runs as a whole (benchmarks/published_runs.toml), never per row; docs/planning.md
documents them and what the model leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from moetron.config import ModelConfig
from moetron.plan.candidate import Candidate
from moetron.plan.gpus import GPU
from moetron.plan.memory import _attention_params, layer_bytes

# achieved fraction of the dense peak for large shapes, per class; a narrow dimension x scales it by
# x / (x + HALF) (a 128-wide GEMM tile row idles when the problem is narrow). First-principles values
# (dense 0.75, grouped 0.65, attention 0.50: cuBLAS / grouped GEMM / flash-attention on H100) predicted the
# published H100/H800 runs +24 % fast at the median; CALIBRATION scales all three once (docs/planning.md).
CALIBRATION = 0.85
EFFICIENCY = {k: v * CALIBRATION for k, v in {"dense": 0.75, "grouped": 0.65, "attention": 0.50}.items()}
HALF = {"dense": 128, "grouped": 256}
FP8_GEMM_SPEEDUP = 1.35  # achieved FP8 / BF16 GEMM speed (quantisation and scaling kernels included)
MEMORY_PASSES = 4.0  # HBM traffic per byte saved for backward (written, re-read, elementwise in/out)
LINK_EFFICIENCY = 0.75  # achieved / nominal link bandwidth for collectives and all-to-all
LATENCY_S = 20e-6  # per collective / all-to-all call


def _s(x: float, half: float) -> float:
    return x / (x + half)


@dataclass
class StageTime:
    """Seconds for one micro-batch of one stage: forward, input-gradient backward, weight gradient, and the
    communication inside them (part of F / B, listed apart so overlap can hide it)."""

    F: float = 0.0
    B: float = 0.0
    W: float = 0.0
    comm: dict[str, float] = field(default_factory=lambda: {"tp": 0.0, "cp": 0.0, "ep": 0.0})
    ep_fwd: float = 0.0  # EP all-to-all inside F (the same again inside B)
    recompute: float = 0.0  # forward work repeated inside B

    def add(self, other: StageTime) -> None:
        self.F += other.F
        self.B += other.B
        self.W += other.W
        self.ep_fwd += other.ep_fwd
        self.recompute += other.recompute
        for k, v in other.comm.items():
            self.comm[k] = self.comm.get(k, 0.0) + v


def group_link(size: int, stride: int, per_node: int, gpu: GPU) -> float:
    """Bytes/s per GPU for a ring collective over `size` ranks `stride` apart: NVLink when the group fits
    in one NVLink domain, the scale-out NIC otherwise."""
    if size * stride <= per_node:
        return gpu.nvlink_gbps * 1e9 * LINK_EFFICIENCY
    return gpu.scaleout_gbps * 1e9 * LINK_EFFICIENCY


def alltoall_time(token_bytes: float, tokens: float, k: int, ep: int, stride: int, per_node: int, gpu: GPU,
                  node_limit: int | None) -> float:
    """One dispatch (or combine) of `tokens` rows of `token_bytes` over an EP group, DeepEP style: one copy
    per destination node over the NIC, fanned out to the node's ranks over NVLink."""
    if ep == 1:
        return 0.0
    ranks = ep
    nodes = max(1, -(-ep * stride // per_node))
    dest_ranks = ranks * (1 - (1 - 1 / ranks) ** k)
    nvlink = tokens * token_bytes * dest_ranks * (ranks - 1) / ranks / (gpu.nvlink_gbps * 1e9 * LINK_EFFICIENCY)
    if nodes == 1:
        return nvlink + LATENCY_S
    dest_nodes = nodes * (1 - (1 - 1 / nodes) ** k)
    if node_limit:
        dest_nodes = min(dest_nodes, node_limit)
    nic = tokens * token_bytes * dest_nodes * (nodes - 1) / nodes / (gpu.scaleout_gbps * 1e9 * LINK_EFFICIENCY)
    return max(nvlink, nic) + LATENCY_S


@dataclass(frozen=True)
class Setting:
    """What the cost of a stage depends on besides the layout."""

    seq: int
    dtype: str
    fp8: bool
    gpu: GPU
    per_node: int
    device: str  # "cuda" or "cpu": which attention path the activation formula follows


def _gemm(flops: float, eff: float, peak: float, fp8: bool) -> float:
    return flops / (peak * eff * (FP8_GEMM_SPEEDUP if fp8 else 1.0))


def layer_time(c: ModelConfig, moe: bool, layer_idx: int, cand: Candidate, s: Setting) -> StageTime:
    """One decoder layer, one micro-batch, this rank. Backward = 2x the GEMMs' forward (half of it the
    weight gradient), 2.5x the attention core's; recompute adds its forward again to B."""
    gpu, tp, cp, T = s.gpu, cand.tp, cand.cp, cand.mbs * s.seq // cand.cp
    peak = gpu.bf16_tflops * 1e12 if s.dtype != "fp32" else gpu.bf16_tflops * 0.5e12
    H, h = c.hidden_size, c.num_attention_heads
    b = 4 if s.dtype == "fp32" else 2
    if c.attention_type == "gqa":
        qk = v = c.head_dim
        narrow = min(H, h * c.head_dim // tp)
    else:
        qk, v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        narrow = min(H, c.kv_lora_rank, h * qk // tp)
    e_dense = EFFICIENCY["dense"] * _s(narrow, HALF["dense"])
    parts = {"attn_proj": _gemm(2 * T * _attention_params(c, tp), e_dense, peak, s.fp8),
             "core": 2 * (h / tp) * T * (s.seq / 2) * (qk + v) / (peak * EFFICIENCY["attention"])}
    ep_time = 0.0
    if moe:
        F = c.moe_intermediate_size // cand.etp
        rows = T * c.top_k / tp
        per_expert = rows * cand.ep * cand.etp / c.num_experts
        e_group = EFFICIENCY["grouped"] * _s(per_expert, HALF["grouped"]) * _s(F, HALF["grouped"])
        parts["experts"] = _gemm(2 * rows * 3 * H * c.moe_intermediate_size, e_group, peak, s.fp8)
        shared = c.moe_config().shared_expert_ffn_size // tp
        if shared:
            parts["shared"] = _gemm(2 * T * 3 * H * shared, EFFICIENCY["dense"] * _s(shared, HALF["dense"]),
                                    peak, s.fp8)
        parts["router"] = 2 * T * H * c.num_experts / (peak * EFFICIENCY["dense"])
        node_limit = c.topk_group if (c.n_group or 1) > 1 else None
        tokens = T / tp
        dispatch = alltoall_time(H * (1 if s.fp8 else b), tokens, c.top_k, cand.ep, cand.etp, s.per_node, gpu,
                                 node_limit)
        combine = alltoall_time(H * b, tokens, c.top_k, cand.ep, cand.etp, s.per_node, gpu, node_limit)
        ep_time = dispatch + combine
    else:
        I = c.intermediate_size // tp
        parts["mlp"] = _gemm(2 * T * 3 * H * I, EFFICIENCY["dense"] * _s(I, HALF["dense"]), peak, s.fp8)
    plain = replace(cand, recompute=(), full_recompute=False)
    saved = layer_bytes(c, layer_idx, plain, s.seq, torch.float32 if s.dtype == "fp32" else torch.bfloat16,
                        s.device)
    memory = MEMORY_PASSES * saved / (gpu.hbm_tbps * 1e12)
    tp_time = 0.0
    if tp > 1:  # all-gather + reduce-scatter around attention and around the MLP / MoE block
        tp_time = 4 * T * H * b * (tp - 1) / tp / group_link(tp, 1, s.per_node, gpu) + 4 * LATENCY_S
    cp_time = 0.0
    if cp > 1:  # K and V gathered around the ring, hidden behind the attention core where it is longer
        kv = (2 * c.num_kv_heads * c.head_dim if c.attention_type == "gqa" else h * (qk + v)) / tp
        ring = T * kv * b * (cp - 1) / group_link(cp, tp, s.per_node, gpu)
        cp_time = max(0.0, ring - parts["core"])
    gemm = sum(t for k, t in parts.items() if k != "core")
    out = StageTime()
    out.F = gemm + parts["core"] + memory / 3 + tp_time + cp_time + ep_time
    out.W = gemm
    out.B = gemm + 2.5 * parts["core"] + 2 * memory / 3 + tp_time + cp_time + ep_time
    out.comm = {"tp": 2 * tp_time, "cp": 2 * cp_time, "ep": 2 * ep_time}
    out.ep_fwd = ep_time
    rec = _recompute_time(cand, parts, memory, tp_time, ep_time, moe)
    out.B += rec
    out.recompute = rec
    return out


def _recompute_time(cand: Candidate, parts: dict, memory: float, tp_time: float, ep_time: float,
                    moe: bool) -> float:
    if cand.full_recompute:
        return sum(parts.values()) + memory / 3 + tp_time + ep_time
    mods, t = set(cand.recompute), 0.0
    if "moe" in mods and moe:
        t += parts.get("experts", 0) + parts.get("shared", 0) + parts.get("router", 0) + ep_time + memory / 9
    else:
        if "moe_act" in mods and moe:
            t += memory / 12
        if "shared_experts" in mods:
            t += parts.get("shared", 0)
    if "mlp" in mods:
        t += parts.get("mlp", 0)
    if "core_attn" in mods:
        t += parts["core"]
    if "mla_up_proj" in mods:
        t += parts["attn_proj"] / 3
    if "layernorm" in mods:
        t += memory / 12
    return t


def head_time(c: ModelConfig, cand: Candidate, s: Setting) -> StageTime:
    """The output head and cross-entropy of one micro-batch (also each MTP module's head)."""
    T = cand.mbs * s.seq // cand.cp
    peak = s.gpu.bf16_tflops * 1e12
    t = _gemm(2 * T * c.hidden_size * c.vocab_size / cand.tp, EFFICIENCY["dense"], peak, False)
    logits = T * c.vocab_size / cand.tp * 4 * MEMORY_PASSES / (s.gpu.hbm_tbps * 1e12)
    return StageTime(F=t + logits / 2, B=t + logits / 2, W=t)
