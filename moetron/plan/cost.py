"""Time of one micro-batch of one pipeline stage on one rank: compute by GEMM shape class, the memory-bound
rest, and the TP / CP / EP communication over the link each group spans.

Efficiency factors (achieved / peak) per GEMM shape class, the routed-row HBM traffic, the host launch
time and the link efficiencies are constants below, each from a source or a count of the kernels, none
fitted to a published row (benchmarks/published_runs.toml); docs/planning.md documents them and what the
model leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from moetron.config import ModelConfig
from moetron.plan.candidate import Candidate
from moetron.plan.comm import cp_time
from moetron.plan.gpus import GPU
from moetron.plan.memory import _attention_params, layer_bytes

# achieved fraction of the dense peak for large shapes, per class; a narrow dimension x scales it by
# x / (x + HALF) (a 128-wide GEMM tile row idles when the problem is narrow). First-principles values
# (dense 0.75, grouped 0.65, attention 0.50: cuBLAS / grouped GEMM / flash-attention on H100). An earlier
# model without the routed-row traffic scaled them by 0.85; with it, 1.0 (docs/planning.md, Calibration).
CALIBRATION = 1.0
EFFICIENCY = {k: v * CALIBRATION for k, v in {"dense": 0.75, "grouped": 0.65, "attention": 0.50}.items()}
HALF = {"dense": 128, "grouped": 256}
# achieved FP8 / BF16 GEMM speed of the tensor-core work alone: the quantisation of the GEMM inputs is priced
# apart (FP8_QUANT_BYTES, QUANT_KERNELS). An earlier, unsourced value, kept (docs/planning.md, Calibration).
FP8_GEMM_SPEEDUP = 1.35
MEMORY_PASSES = 4.0  # HBM traffic per byte saved for backward (written, re-read, elementwise in/out)
LINK_EFFICIENCY = 0.75  # achieved / nominal link bandwidth for collectives and all-to-all
LATENCY_S = 20e-6  # per collective / all-to-all call
# DeepEP's normal (training) kernels reach 43-46 GB/s of RDMA bandwidth internode on ConnectX-7 400 Gb/s
# (50 GB/s) NICs, H800 (github.com/deepseek-ai/DeepEP README, "Normal kernels with NVLink and RDMA
# forwarding"): the flex dispatcher's NIC leg runs at that share instead of LINK_EFFICIENCY.
DEEPEP_NIC_EFFICIENCY = 43 / 50
# Communication hidden behind compute still occupies SMs: DeepSeek-V3 dedicates 20 of the H800's 132 SMs to
# its all-to-all kernels (technical report, section 3.2.2); Megatron-Core gives DeepEP 20 by default
# (`moe_deepep_num_sms`, megatron/core/transformer/transformer_config.py); NCCL's channels take a like share.
# The compute beside an overlapped all-to-all runs that much slower (plan/staged.py, plan/search.py `step_time`).
OVERLAP_SM_SHARE = 20 / 132
# Memory-bound work the saved-activation proxy (MEMORY_PASSES) does not see: bytes of HBM traffic per routed
# row and hidden element, forward (backward moves twice as much): permute and unpermute (read + write a row
# each), the expert-major regroup after the all-to-all and back before the combine (two more copies, EP > 1),
# the SwiGLU (reads 2F, writes F: per F element 3), and under FP8 each expert GEMM input quantised with its
# amax pass and the transposed copy the weight gradient reads (read in bf16 twice, write two FP8 copies).
# Counted from the kernels of dispatch/permute.py, dispatch/alltoall.py and precision/fp8_matmul.py.
ROW_COPY_PASSES = 2 * 2  # permute + unpermute, read + write
REGROUP_PASSES = 2 * 2
FP8_QUANT_BYTES = 2 * 2 + 2  # per element: two bf16 reads (amax, cast), two 1-byte writes (row-major, transposed)
ROUTER_PASSES = 6  # fp32 logits written, softmax / sigmoid read + written, top-k and the aux-loss statistics read
HBM_EFFICIENCY = 0.8  # achieved / nominal HBM bandwidth of streaming kernels (copy, elementwise) on Hopper
# Host side: an eager framework spends this long on the CPU per kernel it launches (Python module + autograd +
# the CUDA launch; PyTorch and Megatron-Bridge name launch-bound steps of small models as what CUDA graphs
# fix: docs.nvidia.com/nemo/megatron-bridge/latest/training/cuda-graphs.html). A phase takes max(GPU, host).
LAUNCH_S = 8e-6
KERNELS = {"attention": 30, "mlp": 12, "moe": 60, "per_local_expert": 2}  # forward; backward launches twice
SYNC_S = 30e-6  # the dispatcher's host sync on the token counts (dispatch/alltoall.py: one per MoE forward)
# FP8 quantisation launches per GEMM input (forward; backward quantises the gradient outputs, launched with
# the rest of backward's twice): Transformer Engine's current scaling ("tensorwise") runs nvte_compute_amax,
# nvte_compute_scale_from_amax and nvte_quantize_v2 -- three kernels, the scale "cannot be fused with the
# quantize kernel" (transformer_engine/pytorch/csrc/quantizer.cpp, Float8CurrentScalingQuantizer::quantize);
# blockwise / MXFP8 compute their scales inside the one quantize kernel. Grouped (expert) GEMM inputs are
# quantised expert by expert except under delayed scaling, the only recipe with a fused multi-tensor
# cast-transpose (TransformerEngine PR #1525, transpose.cpp review thread; issue #2449: per-tensor grouped
# quantisation not yet implemented).
QUANT_KERNELS = {"tensorwise": 3, "delayed": 1, "blockwise": 1}


def _s(x: float, half: float) -> float:
    return x / (x + half)


@dataclass(frozen=True)
class LayerPieces:
    """One layer of one micro-batch as Megatron-Core's combined 1F1B schedules it
    (megatron/core/models/common/model_chunk_schedule_plan.py `TransformerLayerSchedulePlan`): compute
    nodes attn (attention, norm, router, dispatch preprocess) and mlp (experts, shared experts,
    permutation), communication nodes dispatch and combine. Backward times include the weight
    gradients (mlp_bwd_dw runs inside the mlp backward node) and any recompute."""

    attn_f: float
    mlp_f: float
    attn_b: float
    mlp_b: float
    dispatch: float = 0.0  # one all-to-all, forward (its backward, the reverse all-to-all, is priced the same)
    combine: float = 0.0


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
    # per decoder / MTP layer, in forward order, the pieces an F&B pair interleaves (`LayerPieces`)
    pieces: list[LayerPieces] = field(default_factory=list)

    def add(self, other: StageTime) -> None:
        self.F += other.F
        self.B += other.B
        self.W += other.W
        self.ep_fwd += other.ep_fwd
        self.recompute += other.recompute
        self.pieces.extend(other.pieces)
        for k, v in other.comm.items():
            self.comm[k] = self.comm.get(k, 0.0) + v


def group_link(size: int, stride: int, per_node: int, gpu: GPU) -> float:
    """Bytes/s per GPU for a ring collective over `size` ranks `stride` apart: NVLink when the group fits
    in one NVLink domain, the scale-out NIC otherwise."""
    if size * stride <= per_node:
        return gpu.nvlink_gbps * 1e9 * LINK_EFFICIENCY
    return gpu.scaleout_gbps * 1e9 * LINK_EFFICIENCY


def alltoall_time(token_bytes: float, tokens: float, k: int, ep: int, stride: int, per_node: int, gpu: GPU,
                  node_limit: int | None, dedup: bool = True) -> float:
    """One dispatch (or combine) of `tokens` rows of `token_bytes` over an EP group. dedup (DeepEP, the flex
    dispatcher): one copy per destination rank, one per destination node over the NIC fanned out over
    NVLink. Without (the alltoall dispatcher, dispatch/alltoall.py): every (token, expert) row travels."""
    if ep == 1:
        return 0.0
    ranks = ep
    nodes = max(1, -(-ep * stride // per_node))
    if not dedup:
        sent = tokens * token_bytes * k
        local = min(ranks, max(1, per_node // stride))  # EP ranks in this NVLink domain
        nvl = sent * (local - 1) / ranks / (gpu.nvlink_gbps * 1e9 * LINK_EFFICIENCY)
        nic = sent * (ranks - local) / ranks / (gpu.scaleout_gbps * 1e9 * LINK_EFFICIENCY)
        return max(nvl, nic) + LATENCY_S
    dest_ranks = ranks * (1 - (1 - 1 / ranks) ** k)
    nvlink = tokens * token_bytes * dest_ranks * (ranks - 1) / ranks / (gpu.nvlink_gbps * 1e9 * LINK_EFFICIENCY)
    if nodes == 1:
        return nvlink + LATENCY_S
    dest_nodes = nodes * (1 - (1 - 1 / nodes) ** k)
    if node_limit:
        dest_nodes = min(dest_nodes, node_limit)
    nic = tokens * token_bytes * dest_nodes * (nodes - 1) / nodes / (gpu.scaleout_gbps * 1e9 * DEEPEP_NIC_EFFICIENCY)
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
    dispatcher: str = "alltoall"  # parallel.dispatcher: alltoall (every routed row travels) or flex (DeepEP)
    fp8_recipe: str = ""  # tensorwise, delayed or blockwise when fp8: how many kernels each quantisation takes


def fp8_quant_launches(recipe: str, dense_inputs: int, local_experts: int) -> int:
    """Forward kernel launches that quantise FP8 GEMM inputs: `dense_inputs` plain linears' inputs, and the two
    inputs (fc1, fc2) of each of `local_experts` grouped GEMMs -- one per expert, fused only under delayed."""
    per = QUANT_KERNELS.get(recipe, 1)
    experts = 2 * (1 if recipe == "delayed" else local_experts) if local_experts else 0
    return per * (dense_inputs + experts)


def dense_quant_elements(c: ModelConfig, moe: bool, T: int, tp: int) -> float:
    """Elements of the plain (non-expert) FP8 GEMM inputs of one layer and micro-batch on one rank, quantised
    once each forward: the attention's qkv input (the local [T / tp, H] rows, gathered in FP8) and its output
    projection's input (all T rows, the rank's heads), and the same pair for the dense MLP or shared experts."""
    v = c.head_dim if c.attention_type == "gqa" else c.v_head_dim
    n = T / tp * (c.hidden_size + c.num_attention_heads * v)
    ffn = c.moe_config().shared_expert_ffn_size if moe else c.intermediate_size
    if ffn:
        n += T / tp * (c.hidden_size + ffn)
    return n


def tp_collectives(moe: bool, shared: bool) -> int:
    """Sequence-parallel collectives of [T, H] per layer, forward (backward: as many, each one's transpose).
    Attention: all-gather before the qkv projection, reduce-scatter after the output projection; a dense MLP
    the same pair. A MoE block all-gathers once for the replicated router (and the shared experts' input);
    the routed experts take this rank's own tokens and return them in place, so only shared experts add a
    reduce-scatter (moe/tensor_parallel.py `tp_route`, `tp_output`; model/attention.py)."""
    return 2 + (1 + shared if moe else 2)


def _gemm(flops: float, eff: float, peak: float, fp8: bool) -> float:
    return flops / (peak * eff * (FP8_GEMM_SPEEDUP if fp8 else 1.0))


def layer_time(c: ModelConfig, moe: bool, layer_idx: int, cand: Candidate, s: Setting) -> StageTime:
    """One decoder layer, one micro-batch, this rank. Backward = 2x the GEMMs' forward (half of it the
    weight gradient), 2.5x the attention core's; recompute adds its forward again to B."""
    gpu, tp, T = s.gpu, cand.tp, cand.mbs * s.seq // cand.cp
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
        dedup = s.dispatcher == "flex"
        dispatch = alltoall_time(H * (1 if s.fp8 else b), tokens, c.top_k, cand.ep, cand.etp, s.per_node, gpu,
                                 node_limit, dedup)
        combine = alltoall_time(H * b, tokens, c.top_k, cand.ep, cand.etp, s.per_node, gpu, node_limit, dedup)
        ep_time = dispatch + combine
        hbm = gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY
        per_row = H * b * (ROW_COPY_PASSES + (REGROUP_PASSES if cand.ep > 1 and not dedup else 0)) + 3 * F * b
        if s.fp8:
            per_row += (H + F) * FP8_QUANT_BYTES
        parts["routed memory"] = rows * per_row / hbm + T / tp * c.num_experts * 4 * ROUTER_PASSES / hbm
    else:
        I = c.intermediate_size // tp
        parts["mlp"] = _gemm(2 * T * 3 * H * I, EFFICIENCY["dense"] * _s(I, HALF["dense"]), peak, s.fp8)
    plain = replace(cand, recompute=(), full_recompute=False)
    saved = layer_bytes(c, layer_idx, plain, s.seq, torch.float32 if s.dtype == "fp32" else torch.bfloat16,
                        s.device)
    memory = MEMORY_PASSES * saved / (gpu.hbm_tbps * 1e12)
    tp_time = 0.0
    if tp > 1:
        n = tp_collectives(moe, moe and bool(c.moe_config().shared_expert_ffn_size))
        tp_time = n * T * H * b * (tp - 1) / tp / group_link(tp, 1, s.per_node, gpu) + n * LATENCY_S
    cp_f, cp_b = cp_time(c, cand, T, b, parts["core"], s.per_node,
                         lambda size, stride: group_link(size, stride, s.per_node, gpu))
    streamed = parts.pop("routed memory", 0.0)
    if s.fp8:  # the plain linears' inputs quantised too (the experts' are in the routed-row bytes)
        streamed += dense_quant_elements(c, moe, T, tp) * FP8_QUANT_BYTES / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)
    gemm = sum(t for k, t in parts.items() if k != "core")
    out = StageTime()
    out.F = gemm + parts["core"] + memory / 3 + streamed + tp_time + cp_f + ep_time
    out.W = gemm
    out.B = gemm + 2.5 * parts["core"] + 2 * memory / 3 + 2 * streamed + tp_time + cp_b + ep_time
    local = c.num_experts // cand.ep if moe else 0
    launches = KERNELS["attention"] + (KERNELS["moe"] + KERNELS["per_local_expert"] * local if moe else KERNELS["mlp"])
    if s.fp8:
        dense = 2 + (2 if not moe or c.moe_config().shared_expert_ffn_size else 0)
        launches += fp8_quant_launches(s.fp8_recipe, dense, local)
    host = LAUNCH_S * launches
    sync = SYNC_S if moe and cand.ep > 1 else 0.0
    out.F = max(out.F, host) + sync
    out.B = max(out.B, 2 * host)
    memory += streamed * 3
    out.comm = {"tp": 2 * tp_time, "cp": cp_f + cp_b, "ep": 2 * ep_time}
    out.ep_fwd = ep_time
    rec = _recompute_time(cand, parts, memory, tp_time, ep_time, moe)
    out.B += rec
    out.recompute = rec
    # the pair's pieces: the compute of F and of B + W split between the attn and mlp nodes in the ratio of
    # their own work (attention projections, core, router vs experts, shared experts, dense MLP, routed rows)
    attn_f = parts["attn_proj"] + parts["core"] + parts.get("router", 0.0)
    attn_b = 2 * parts["attn_proj"] + 2.5 * parts["core"] + 2 * parts.get("router", 0.0)
    mlp_f = gemm + parts["core"] + streamed - attn_f
    comp_f, comp_b = out.F - ep_time, out.B + out.W - ep_time
    share_f, share_b = attn_f / (attn_f + mlp_f), attn_b / (attn_b + 2 * mlp_f)
    out.pieces = [LayerPieces(comp_f * share_f, comp_f * (1 - share_f), comp_b * share_b, comp_b * (1 - share_b),
                              dispatch, combine) if moe and cand.ep > 1 else
                  LayerPieces(comp_f * share_f, comp_f * (1 - share_f), comp_b * share_b, comp_b * (1 - share_b))]
    return out


def pair_time(f: LayerPieces | None, b: LayerPieces | None) -> tuple[float, float]:
    """(makespan, compute + communication run concurrently) of one layer's forward paired with another
    micro-batch's backward of a layer, in the order of Megatron-Core's `TransformerLayerSchedulePlan.run`:

        comm stream: combine_bwd | dispatch_fwd -> dispatch_bwd        | combine_fwd
        comp stream: attn_fwd    | mlp_bwd (+dw)     -> mlp_fwd        | attn_bwd

    each node waiting for its inputs (mlp_bwd for combine_bwd, mlp_fwd for dispatch_fwd, attn_bwd for
    dispatch_bwd, combine_fwd for mlp_fwd) and for the node before it on its stream. moetron's executor
    interleaves the two chains of an F&B pair in the same order (docs/pipeline.md, "Turns")."""
    af, mf, df, cf = (f.attn_f, f.mlp_f, f.dispatch, f.combine) if f else (0.0, 0.0, 0.0, 0.0)
    ab, mb, db, cb = (b.attn_b, b.mlp_b, b.dispatch, b.combine) if b else (0.0, 0.0, 0.0, 0.0)
    start = max(af, cb)  # attn_fwd beside combine_bwd
    mb_end, df_end = start + mb, start + df
    db_end, mf_end = max(df_end, mb_end) + db, max(mb_end, df_end) + mf
    span = max(max(mf_end, db_end) + cf, max(mf_end, db_end) + ab)
    return span, max(0.0, af + mf + ab + mb + df + cf + db + cb - span)


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
