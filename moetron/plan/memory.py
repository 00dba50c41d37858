"""Per-GPU memory of a layout: parameters, gradients and ZeRO-1 optimizer state counted the way the trainer
allocates them, and activations from the exact per-layer formula (model/activation_memory.py).

State: `rank_state(...)` sums this rank's parameters from the model's shapes and the sharding rules of
model/parallelize.py (TP column/row splits, kv heads replicated when tp > kv heads, vocab-parallel
embedding and head, experts over EP x ETP), over the stages the schedule places on the PP rank
(pipeline/stage.py `parameter_keys`), then pads each DataParallel buffer the way parallel/data_parallel.py
does. Activations: `stage_activation_bytes(...)` is one micro-batch of one pipeline stage. Design notes and
what is approximate (TP/CP activation sharding): docs/planning.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetron.config import ModelConfig
from moetron.kernels import attention_cpu
from moetron.model.activation_memory import layer_activation_bytes
from moetron.model.model import MoETransformer
from moetron.moe.router import fused_router_covers
from moetron.parallel.data_parallel import PAD_ALIGN, default_bucket_size
from moetron.parallel.zero import MAX_IN_FLIGHT
from moetron.pipeline.layout import PipelineStage
from moetron.pipeline.stage import parameter_keys
from moetron.plan.candidate import Candidate

GiB = 1024 ** 3


# ------------------------------------------------------------------------------ parameters


def _attention_params(c: ModelConfig, tp: int) -> int:
    """One rank's attention parameters (model/parallelize.py `_parallelize_gqa` / `_parallelize_mla`)."""
    h, H, bias = c.num_attention_heads, c.hidden_size, c.attention_bias
    if c.attention_type == "gqa":
        d, g = c.head_dim, c.num_kv_heads
        q = H * h * d // tp + (h * d // tp if bias else 0)
        kv_rows = g * d // tp if g % tp == 0 else g * d  # fewer kv heads than ranks: the whole weight
        kv = 2 * (H * kv_rows + (kv_rows if bias else 0))
        return q + kv + h * d * H // tp + (H if bias else 0) + 2 * d
    dqk = c.qk_nope_head_dim + c.qk_rope_head_dim
    if c.q_lora_rank is None:
        n = H * h * dqk // tp
    else:
        qr = c.q_lora_rank
        n = H * qr + (qr if bias else 0) + qr + qr * h * dqk // tp
    kv_a = c.kv_lora_rank + c.qk_rope_head_dim
    n += H * kv_a + (kv_a if bias else 0) + c.kv_lora_rank
    n += c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim) // tp
    return n + h * c.v_head_dim * H // tp + (H if bias else 0)


_SHARED: dict[int, tuple[ModelConfig, int]] = {}


def shared_ffn(c: ModelConfig) -> int:
    """The shared experts' ffn size (`moe_config()` validates a new MoEConfig on every call: the search
    asks this hundreds of thousands of times), remembered per config object."""
    hit = _SHARED.get(id(c))
    if hit is None or hit[0] is not c:
        hit = _SHARED[id(c)] = (c, c.moe_config().shared_expert_ffn_size)
    return hit[1]


_COUNTS: dict[tuple, tuple[ModelConfig, tuple[int, int]]] = {}


def layer_param_counts(c: ModelConfig, layer_idx: int, tp: int, ep: int, etp: int) -> tuple[int, int]:
    """(dense, expert) parameters of decoder layer `layer_idx` on one rank (the same for every layer of a
    kind, dense or MoE: remembered per config object, like `shared_ffn`)."""
    key = (id(c), c.is_moe_layer(layer_idx), tp, ep, etp)
    hit = _COUNTS.get(key)
    if hit is None or hit[0] is not c:
        hit = _COUNTS[key] = (c, _layer_param_counts(c, layer_idx, tp, ep, etp))
    return hit[1]


def _layer_param_counts(c: ModelConfig, layer_idx: int, tp: int, ep: int, etp: int) -> tuple[int, int]:
    H = c.hidden_size
    dense = _attention_params(c, tp) + 2 * H
    if not c.is_moe_layer(layer_idx):
        return dense + 3 * H * c.intermediate_size // tp, 0
    shared = shared_ffn(c)
    dense += c.num_experts * H + 3 * H * shared // tp
    return dense, (c.num_experts // ep) * 3 * H * c.moe_intermediate_size // etp


def item_param_counts(c: ModelConfig, key: str, tp: int, ep: int, etp: int) -> tuple[int, int]:
    """(dense, expert) parameters of one `parameter_keys` prefix on one rank."""
    H, V = c.hidden_size, c.vocab_size
    if key in ("embed_tokens", "lm_head"):
        return V * H // tp, 0
    if key == "norm":
        return H, 0
    kind, index = key.split(".")
    if kind == "layers":
        return layer_param_counts(c, int(index), tp, ep, etp)
    dense, expert = layer_param_counts(c, c.num_layers + int(index), tp, ep, etp)
    return dense + 3 * H + 2 * H * H, expert  # enorm, hnorm, final_norm, eh_proj (replicated under TP)


def rank_param_counts(c: ModelConfig, cand: Candidate, stages: list[PipelineStage]) -> tuple[int, int]:
    """(dense, expert) parameters one rank holds: every parameter key of the stages it runs, once."""
    keys: set[str] = set()
    for stage in stages:
        keys |= parameter_keys(stage, c.tie_word_embeddings)
    if not stages:
        keys = {"embed_tokens", "norm"} | ({"lm_head"} if not c.tie_word_embeddings else set())
        keys |= {f"layers.{i}" for i in range(c.num_layers)} | {f"mtp.{j}" for j in range(c.num_mtp_layers)}
    dense = expert = 0
    for key in keys:
        d, e = item_param_counts(c, key, cand.tp, cand.ep, cand.etp)
        dense, expert = dense + d, expert + e
    return dense, expert


def buffer_numel(n: int, group_size: int, bucket_size: int) -> int:
    """Elements of one DataParallel buffer under ZeRO-1: each bucket padded to group_size * PAD_ALIGN.
    Exact for a buffer of one bucket (n < bucket_size); with several, every bucket is assumed full."""
    if n == 0:
        return 0
    pad = group_size * PAD_ALIGN
    full, rest = divmod(n, bucket_size) if n > bucket_size else (0, n)
    return full * (-(-bucket_size // pad) * pad) + -(-rest // pad) * pad


@dataclass(frozen=True)
class StateBytes:
    """What the trainer allocates on one rank for the parameters, their gradients and the optimizer."""

    params: int
    grads: int
    optimizer: int
    dense_numel: int
    expert_numel: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def rank_state(c: ModelConfig, cand: Candidate, stages: list[PipelineStage], gpus: int, dtype: str,
               zero: bool = True) -> StateBytes:
    """train/setup.py `build_run`: one process in fp32 uses torch AdamW (params, grads, two moments);
    otherwise DataParallel buffers (fp32 gradients; parameters too under ZeRO-1) padded per bucket, and
    DistributedOptimizer's fp32 master + two moments on this rank's shard of each buffer."""
    dense, expert = rank_param_counts(c, cand, stages)
    pbytes = 4 if dtype == "fp32" else 2
    n = dense + expert
    if gpus == 1 and dtype == "fp32":
        return StateBytes(4 * n, 4 * n, 8 * n, dense, expert)
    dp_cp, edp = cand.dp(gpus) * cand.cp, cand.edp(gpus)
    bucket = default_bucket_size(dp_cp)
    if not zero:
        return StateBytes(pbytes * n, 4 * n, (8 if dtype == "fp32" else 12) * n, dense, expert)
    if cand.zero_stage == 3:  # FSDP2: fp32 parameter shards, fp32 gradient shards, AdamW's two moments
        local = fsdp_shard_numel(c, cand.dp(gpus))[0]
        return StateBytes(4 * local, 4 * local, 8 * local, dense, expert)
    bd, be = buffer_numel(dense, dp_cp, bucket), buffer_numel(expert, edp, bucket)
    shard = bd // dp_cp + be // edp
    grads = 4 * (shard if cand.zero_stage == 2 else bd + be)  # ZeRO-2 keeps this rank's shard of every bucket
    return StateBytes(pbytes * (bd + be), grads, 12 * shard, dense, expert)


_FSDP_CACHE: dict = {}


def fsdp_shard_numel(c: ModelConfig, dp: int) -> tuple[int, int]:
    """ZeRO-3 (parallel/fsdp.py): FSDP2 shards every parameter on dim 0 in `torch.chunk` pieces, so rank 0
    (the fullest) holds ceil(d0 / dp) rows of each. Returns (rank 0's elements, the largest unit's full
    elements: a transformer layer gathered for its forward / backward). Shapes from the model itself,
    built on the meta device (no memory)."""
    key = (repr(c), dp)
    if key not in _FSDP_CACHE:
        with torch.device("meta"):
            model = MoETransformer(c)
        units = list(model.layers) + list(getattr(model, "mtp", None) or [])
        local = sum(-(-p.shape[0] // dp) * (p.numel() // max(1, p.shape[0])) if p.dim() else 1
                    for p in model.parameters() if p.requires_grad)
        largest = max((sum(p.numel() for p in u.parameters()) for u in units), default=0)
        _FSDP_CACHE[key] = (local, largest)
    return _FSDP_CACHE[key]


# ------------------------------------------------------------------------------ activations

_TP_SHARDED = ("q_norm", "k_norm", "core", "o_proj input", "mlp gate", "mlp up", "mlp silu", "mlp act",
               "shared experts")
_SEQ_SHARDED = ("attn norm", "mlp norm", "layer input", "q_a_layernorm", "q latent", "kv_a_layernorm")


def _scale(name: str, nbytes: int, tp: int, sp: bool) -> float:
    """Under TP a term is split over heads / ffn columns, or (sequence parallel) over the sequence; the
    router, rotary tables, kv latent and routed-expert terms (given their own rows) are not."""
    if tp == 1:
        return nbytes
    if name.startswith(_TP_SHARDED):
        return nbytes / tp
    if sp and name.startswith(_SEQ_SHARDED):
        return nbytes / tp
    return nbytes


# Terms whose bytes scale with the routed rows (the imbalance headroom scales these).
_ROW_TERMS = ("expert", "permute token index", "row weights slot index", "received rows", "tp combine")
# moetron's CUDA path: the Triton unpermute keeps no expert output when the gate weights are applied in the
# experts (dispatch/permute.py `_FusedUnpermute`), the Triton weighted SwiGLU keeps gate_up and the weights
# only (kernels/fused_swiglu.py); the CPU formula's torch-reference terms that the GPU path does not save:
_NOT_ON_GPU = ("expert output", "expert silu(gate)", "expert act")
# FP8 linears save their input quantised (precision/fp8_matmul.py `_FP8Linear` / `_FP8GroupedLinear`):
# the inputs that only a linear layer saves then cost one byte (+ one fp32 scale per 128 under blockwise).
_FP8_LINEAR_INPUTS = ("expert input", "q latent", "kv latent", "expert weighted act", "mlp act",
                      "shared experts act")
FP8_BYTES = 1 + 4 / 128


def _cpp_attention_runs(c: ModelConfig, seq: int) -> bool:
    """Whether moetron's C++ attention takes this model's heads over `seq` positions (fp32 CPU aside)."""
    if c.attention_type == "mla":
        return attention_cpu.shape_runs(seq, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim)
    return attention_cpu.shape_runs(seq, c.head_dim, c.head_dim)


def layer_terms(c: ModelConfig, layer_idx: int, cand: Candidate, seq: int, dtype: torch.dtype, device: str,
                fp8: bool = False, fp8_cache: bool = False, profile: str = "moetron") -> dict[str, float]:
    """One micro-batch of decoder layer `layer_idx` on one rank (balanced routing), term by term, with the
    rotary tables. `fp8`: FP8 linear layers (their inputs saved quantised); `fp8_cache`: DeepSeek-V3's
    low-precision storage on top (docs/planning.md): the SwiGLU input and the attention output cached in
    FP8 / E5M6, routed rows received expert-major in FP8 (DeepEP) without a regroup copy. `profile`
    "megatron": what Megatron-Core with Transformer Engine saves instead (`_megatron_storage`)."""
    tp, sp = cand.tp, cand.sp and cand.tp > 1
    S = seq // cand.cp
    b = torch.finfo(dtype).bits // 8
    rows = cand.mbs * S * c.top_k // tp  # the routed experts see this rank's tokens
    modules = () if cand.full_recompute else cand.recompute
    # on a CPU the trainer's default (train.fusion=auto) runs the C++ weighted SwiGLU, permute and router on
    # fp32 without FP8; without a C++ compiler they fall back to the eager ones, which save more
    cpp = device == "cpu" and dtype == torch.float32 and not fp8
    terms = layer_activation_bytes(c, layer_idx, cand.mbs, S, rows, modules=modules,
                                   every_n_layers=1 if cand.full_recompute else 0, dtype=dtype, device=device,
                                   fused_swiglu=cpp, fused_permute=cpp,
                                   fused_router=cpp and fused_router_covers(c.moe_config(), cp=cand.cp),
                                   cpp_attention=cpp and cand.cp == 1 and _cpp_attention_runs(c, S),
                                   cpp_sigmoid_router=cpp).terms
    out = {n: _scale(n, v, tp, sp) for n, v in terms.items()}
    if tp > 1 and not cand.full_recompute:
        _tensor_parallel_terms(out, terms, c, layer_idx, cand, S, b, sp, modules, cpp)
    if device == "cuda":
        for name in _NOT_ON_GPU:
            out.pop(name, None)
    if profile == "megatron" and not cand.full_recompute:
        _megatron_storage(out, c, layer_idx, cand, S, b, sp, modules)
    if fp8:
        for name in _FP8_LINEAR_INPUTS:
            if name in out:
                out[name] = out[name] * FP8_BYTES / b
        if fp8_cache:
            for name, nbytes in (("expert gate_up", FP8_BYTES), ("o_proj input", 1.5)):
                if name in out:
                    out[name] = out[name] * nbytes / b
    if cand.ep > 1 and tp == 1 and c.is_moe_layer(layer_idx) and not cand.full_recompute and "moe" not in modules \
            and not (fp8 and fp8_cache) and profile != "megatron":
        # the all-to-all path regroups the received rows expert-major (dispatch/alltoall.py): the received
        # rows and the regroup's two indices are held too (measured: tests/test_plan.py); under TP the
        # same bytes are the "tp combine" term
        out["received rows"] = rows * (c.hidden_size * b + 16)
    return out


def _tensor_parallel_terms(out: dict, terms: dict, c: ModelConfig, layer_idx: int, cand: Candidate, S: int, b: int,
                           sp: bool, modules, fused_permute: bool = False) -> None:
    """What tensor parallelism saves beyond splitting the one-process terms (measured: tests/test_plan.py).
    Under sequence parallel a column-parallel linear saves the all-gathered input (the whole sequence);
    with a micro-batch of several sequences the gathered [B, S, H] is not contiguous and each linear
    saves its own copy (parallel/tensor_parallel.py `column_parallel_forward`). The MoE layer routes
    the group's tokens and keeps, beyond the one-process terms, one more [rows, H] and two indices per
    row, and the local routing mask (moe/tensor_parallel.py).""" 
    tp, T, H = cand.tp, cand.mbs * S, c.hidden_size
    full = T * H * b
    if sp:
        copies = (lambda n: n) if cand.mbs > 1 else (lambda n: 1)
        up_region = "mla_up_proj" in modules
        if "attn norm output" in out:
            if c.attention_type == "gqa":  # q, k, v on the gathered input
                out["attn norm output"] = full * copies(3)
            elif c.q_lora_rank is None:  # q_proj on the gathered input, kv_a on the shard
                out["attn norm output"] += full
            else:  # q_a and kv_a on the shard, each its own copy
                out["attn norm output"] *= copies(2)
        if "q latent" in out and not up_region:  # q_b_proj gathers the latent (inside the region otherwise)
            out["q latent"] = terms["q latent"]
        if up_region and c.attention_type == "mla":  # the gathered [latent, rope key] and the rope key
            out["rotated shared key"] = out.get("rotated shared key", 0) + T * c.qk_rope_head_dim * b
        moe = c.is_moe_layer(layer_idx)
        if "mlp norm output" in out:
            if not moe:  # gate and up on the gathered input
                out["mlp norm output"] = full * copies(2)
            else:  # shared experts' gate and up on the gathered input; in fp32 the router keeps it too
                out["mlp norm output"] = (full * copies(2) if shared_ffn(c) else 0) + \
                    (full if b == 4 else 0)
    if c.is_moe_layer(layer_idx) and "moe" not in modules:  # measured; the local routing's mask
        rows = T * c.top_k // tp
        out["tp combine"] = rows * (8 if fused_permute else H * b + 16) + T // tp * c.top_k


def _megatron_storage(out: dict, c: ModelConfig, layer_idx: int, cand: Candidate, S: int, b: int, sp: bool,
                      modules) -> None:
    """Megatron-Core with Transformer Engine, where it saves less than moetron (docs/planning.md): TE's
    RMSNorm saves its input in the compute dtype and recomputes the normalised copy from it and 1/rms; a
    column-parallel linear under sequence parallel saves its local input and all-gathers it again in
    backward; flash attention keeps k and v at the kv heads; the router saves the bf16 input of the
    rank's own tokens (inside CheckpointWithoutOutput under layernorm recompute: nothing); the experts'
    first GEMM saves the expert-major rows, the dispatcher's receive buffers are not saved."""
    T, H, tp = cand.mbs * S, c.hidden_size, cand.tp
    local = T * H * b / (tp if sp else 1)
    for name in list(out):
        if name.endswith(" input fp32") and name != "router input fp32":
            out[name] = out[name] * b / 4
        elif name.endswith(" normalised") or name in ("tp combine", "received rows", "router weight fp32"):
            del out[name]
    moe = c.is_moe_layer(layer_idx)
    if "router input fp32" in out:
        out["router input fp32"] = 0 if "layernorm" in modules else local
    if "mlp norm output" in out:
        out["mlp norm output"] = 0 if moe and "moe" not in modules else local
    if "attn norm output" in out and c.attention_type == "gqa":
        out["attn norm output"] = local
    if c.attention_type == "gqa" and "core q, k, v" in out:
        g = c.num_kv_heads
        kv = g // tp if g % tp == 0 else 1
        out["core q, k, v"] = T * c.head_dim * b * (c.num_attention_heads // tp + 2 * kv)


def layer_bytes(c: ModelConfig, layer_idx: int, cand: Candidate, seq: int, dtype: torch.dtype,
                device: str, fp8: bool = False, fp8_cache: bool = False, profile: str = "moetron") -> int:
    """One micro-batch of decoder layer `layer_idx` on one rank: the sum of `layer_terms`."""
    return int(sum(layer_terms(c, layer_idx, cand, seq, dtype, device, fp8, fp8_cache, profile).values()))


def routed_row_bytes(c: ModelConfig, layer_idx: int, cand: Candidate, seq: int, dtype: torch.dtype,
                     device: str, fp8: bool = False, fp8_cache: bool = False, profile: str = "moetron") -> int:
    """The part of `layer_bytes` that grows with the rows the rank's experts receive."""
    terms = layer_terms(c, layer_idx, cand, seq, dtype, device, fp8, fp8_cache, profile)
    return int(sum(v for n, v in terms.items() if n.startswith(_ROW_TERMS)))


def _norm_bytes(T: int, H: int, b: int) -> int:
    """RMSNorm: fp32 input, 1/rms, and (below fp32) the normalised copy the weight's multiply saves; in fp32
    ops/functional.py's Function saves the input and 1/rms only."""
    return T * H * 4 + T * 4 + (T * H * b if b != 4 else 0)


def _head_bytes(c: ModelConfig, T: int, b: int, tp: int, sp_div: int) -> int:
    """Final norm (fp32 input, rstd, normalised), the head's input, fp32 logits, the loss, the labels;
    under TP the head saves its gathered input and the vocab-parallel loss two masks."""
    H = c.hidden_size
    total = _norm_bytes(T, H, b) // sp_div + T * (c.vocab_size // tp) * 4 + 4 + T * 8
    return total + (T * H * b + 2 * T if tp > 1 else T * H * b)


def stage_activation_bytes(c: ModelConfig, stage: PipelineStage | None, cand: Candidate, seq: int, dtype: str,
                           device: str = "cuda", fp8: bool = False, fp8_cache: bool = False,
                           profile: str = "moetron") -> int:
    """Bytes one micro-batch of `stage` (the whole model when None) keeps for backward on one rank: its
    layers (rotary tables once), the embedding's indices, the loss head and the MTP modules' extras."""
    tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    b = 4 if dtype == "fp32" else 2
    T = cand.mbs * seq // cand.cp
    sp_div = cand.tp if cand.sp and cand.tp > 1 else 1
    if stage is None:
        layers, mtp = list(range(c.num_layers)), list(range(c.num_mtp_layers))
        embedding, loss = True, True
    else:
        layers, mtp, embedding, loss = stage.decoder_layers, stage.mtp_layers, stage.has_embedding, stage.has_loss
    total = sum(layer_bytes(c, i, cand, seq, tdtype, device, fp8, fp8_cache, profile) for i in layers)
    total += sum(layer_bytes(c, c.num_layers + j, cand, seq, tdtype, device, fp8, fp8_cache, profile) for j in mtp)
    n_rope = len(layers) + len(mtp)
    if n_rope > 1:  # cos and sin are one storage shared by every layer of the stage
        total -= (n_rope - 1) * 2 * seq // cand.cp * c.rope_dim * b
    if embedding:
        total += T * 8 + (T if cand.tp > 1 else 0)  # ids (and the vocab-parallel embedding's mask)
    if loss:
        total += _head_bytes(c, T, b, cand.tp, sp_div)
    H = c.hidden_size
    norm = _norm_bytes(T, H, b) // sp_div
    for _ in mtp:  # future ids, enorm, hnorm, eh_proj's input, the final norm (pipeline/stage.py `_mtp_piece`)
        total += T * 8 + 3 * norm + T * 2 * H * b // sp_div
    if loss:  # the loss stage runs every MTP module's head and loss on its normed output, shifted labels
        masks = 2 * T if cand.tp > 1 else 0  # the head's input is gathered under SP (as the main head's)
        total += c.num_mtp_layers * (T * H * b + masks + T * (c.vocab_size // cand.tp) * 4 + 4 + T * 8)
    if mtp and loss and b == 4:  # in fp32 the first hnorm's input is the final norm's input itself
        total -= T * H * 4 // sp_div
    return int(total)


def comm_buffer_bytes(c: ModelConfig, cand: Candidate, seq: int, dtype: str, fp8: bool, gpus: int = 1,
                      state_numel: int = 0) -> int:
    """Dispatcher and communication buffers on one rank: the permuted rows and their all-to-all receive
    buffer, twice (dispatch and combine), plus the TP all-gather of one layer's input under SP; ZeRO-2's
    transient full-size buckets (the one collecting and MAX_IN_FLIGHT reduce-scattering, parallel/zero.py);
    ZeRO-3's gathered layers (the one running and the one prefetched, in the compute dtype)."""
    b = 4 if dtype == "fp32" else 2
    T = cand.mbs * seq // cand.cp
    rows = T * c.top_k // cand.tp
    dispatch = rows * c.hidden_size * (1 if fp8 else b) * (2 if cand.ep > 1 else 0)
    combine = rows * c.hidden_size * b * (2 if cand.ep > 1 else 1)
    gather = T * c.hidden_size * b if cand.tp > 1 else 0
    zero = 0
    if cand.zero_stage == 2:
        zero = (MAX_IN_FLIGHT + 1) * 4 * min(default_bucket_size(cand.dp(gpus) * cand.cp), state_numel)
    elif cand.zero_stage == 3:
        zero = 2 * b * fsdp_shard_numel(c, cand.dp(gpus))[1]
    return dispatch + combine + gather + zero


def imbalance_headroom(c: ModelConfig, cand: Candidate, seq: int, dtype: str, in_flight: int,
                       moe_layers: int, factor: float, device: str = "cuda", fp8: bool = False,
                       fp8_cache: bool = False, profile: str = "moetron") -> int:
    """Extra routed rows when the busiest rank receives `factor` x its share: the row-proportional terms of
    one MoE layer (expert input, gate_up, activation, received rows, indices) over the in-flight MoE layers."""
    layer = next((j for j in range(c.num_layers) if c.is_moe_layer(j)), None)
    if layer is None:
        return 0
    per_layer = routed_row_bytes(c, layer, cand, seq, torch.float32 if dtype == "fp32" else torch.bfloat16,
                                 device, fp8, fp8_cache, profile)
    return int(math.ceil((factor - 1.0) * per_layer * moe_layers * in_flight))
