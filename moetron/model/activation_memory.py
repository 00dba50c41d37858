"""Activation memory: measured exactly (bytes saved for backward) and predicted by formula.

    meter = ActivationMeter(model)
    with meter:
        out = model(input_ids, labels=labels)
    meter.layer_bytes        # {"layers.0": 229152, ..., "mtp.0.layer": ...} bytes per decoder layer
    meter.total_bytes        # everything the forward saved, each storage once

Design notes: docs/activation_memory.md (`moetron/model/activation_memory.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from moetron.config import ModelConfig
from moetron.ops.recompute import RecomputePlan

try:  # chain to an enclosing saved-tensor hook, e.g. activation offloading
    from torch._C._autograd import _top_saved_tensors_default_hooks
except ImportError:  # pragma: no cover
    _top_saved_tensors_default_hooks = None

__all__ = ["ActivationMeter", "SavedEntry", "LayerActivations", "layer_activation_bytes", "attention_path"]


@dataclass
class SavedEntry:
    """One tensor saved for backward (several entries may share a storage)."""

    section: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    storage_bytes: int
    storage: int  # the storage's data pointer (identity while the forward's graph is alive)


class _Outer:
    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


class ActivationMeter(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes saved for backward while active, per decoder layer of `model`.

    `sections` names the modules to charge separately (default: every module with a `layer_idx`,
    i.e. the decoder layers, keyed by their qualified names). Use one meter per forward.
    """

    def __init__(self, model: nn.Module | None = None, sections: Iterable[tuple[str, nn.Module]] | None = None):
        self.entries: list[SavedEntry] = []
        self._excluded: set[int] = set()
        if model is not None:
            for t in list(model.parameters()) + list(model.buffers()):
                self._excluded.add(t.untyped_storage().data_ptr())
            if sections is None:
                sections = [(n, m) for n, m in model.named_modules() if hasattr(m, "layer_idx")]
        self._sections = list(sections or ())
        self._stack = ["other"]
        self._handles: list = []
        self._outer = None

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._excluded:
                self.entries.append(SavedEntry(self._stack[-1], tuple(t.shape), t.dtype, storage.nbytes(), ptr))
            if self._outer is not None:
                return _Outer(self._outer[0](t))
            return t.detach() if t.requires_grad else t  # never hold t.grad_fn (a reference cycle)

        def unpack(obj):
            return self._outer_unpack(obj.packed) if isinstance(obj, _Outer) else obj

        super().__init__(pack, unpack)

    def _outer_unpack(self, packed):
        return self._outer[1](packed)

    def __enter__(self):
        self._outer = _top_saved_tensors_default_hooks(False) if _top_saved_tensors_default_hooks else None
        for name, module in self._sections:
            self._handles.append(module.register_forward_pre_hook(
                lambda mod, args, name=name: self._stack.append(name)))
            self._handles.append(module.register_forward_hook(lambda mod, args, out: self._leave()))
        return super().__enter__()

    def _leave(self) -> None:  # returns None: a forward hook's value would replace the output
        if len(self._stack) > 1:
            self._stack.pop()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles = []
        return result

    # --- results -------------------------------------------------------------------------
    @staticmethod
    def _bytes(entries: Iterable[SavedEntry]) -> int:
        seen: dict[int, int] = {}
        for e in entries:
            seen[e.storage] = max(seen.get(e.storage, 0), e.storage_bytes)
        return sum(seen.values())

    @property
    def layer_bytes(self) -> dict[str, int]:
        """Bytes saved during each section's forward, each storage once within the section."""
        names = dict.fromkeys(e.section for e in self.entries if e.section != "other")
        return {n: self._bytes(e for e in self.entries if e.section == n) for n in names}

    @property
    def other_bytes(self) -> int:
        return self._bytes(e for e in self.entries if e.section == "other")

    @property
    def total_bytes(self) -> int:
        return self._bytes(self.entries)

    def section_entries(self, name: str) -> list[SavedEntry]:
        return [e for e in self.entries if e.section == name]


# ------------------------------------------------------------------------------ the formula


def attention_path(cfg: ModelConfig, device: str | torch.device = "cpu", cpp_attention: bool = False) -> str:
    """Which kernel the attention core uses, as far as what it saves is concerned:

    `fused`: q, k, v (after the GQA head expansion), the output and the fp32 log-sum-exp
      (sdpa's flash / memory-efficient / cuDNN kernels; flash-attn; TE; moetron's C++ kernel,
      `cpp_attention`: it takes MLA's v head size too);
    `math`: sdpa's composite fallback, taken on CPU when the value head size differs from the
      query/key one (MLA) and the C++ kernel does not run: scaled copies of q and k^T, the
      probabilities, a copy of v;
    `eager`: moetron's explicit reference: q and k^T as views, the causal mask, the probabilities
      (fp32), a copy of v.
    """
    if cfg.attention_backend == "eager":
        return "eager"
    if cfg.attention_backend in ("flash_attn", "te"):
        return "fused"
    if cfg.attention_type == "mla" and cfg.v_head_dim != cfg.qk_nope_head_dim + cfg.qk_rope_head_dim \
            and torch.device(device).type == "cpu" and not cpp_attention:
        return "math"
    return "fused"


@dataclass
class LayerActivations:
    """Bytes one decoder layer saves for backward, by term (see docs/activation_memory.md)."""

    terms: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def add(self, name: str, nbytes: int) -> None:
        if nbytes:
            self.terms[name] = self.terms.get(name, 0) + int(nbytes)


def layer_activation_bytes(cfg: ModelConfig, layer_idx: int, batch: int, seq: int, rows: int | None = None,
                           *, modules: Iterable[str] | None = None, every_n_layers: int | None = None,
                           dtype: torch.dtype = torch.float32, device: str = "cpu", rope_batch: int = 1,
                           grouped_mm: bool = True, fused_swiglu: bool = False, fused_router: bool = False,
                           fused_permute: bool = False, cpp_attention: bool = False,
                           cpp_sigmoid_router: bool = False) -> LayerActivations:
    """The formula: bytes decoder layer `layer_idx` of `cfg` saves for backward in training (one
    process, the torch permute, no capacity padding), term by term.

    `rows`: rows the routed experts receive (top_k * tokens when nothing is dropped). `modules` /
    `every_n_layers` default to the config's recompute options. `dtype`: the activations' dtype
    (the router, norms' statistics and balancing losses are fp32 whatever it is). `rope_batch`:
    batch size of the position ids (1 for the default positions). `grouped_mm`: the experts run
    through torch._grouped_mm (which saves its int32 offsets) rather than the per-expert loop.
    `fused_swiglu`: the experts' weighted SwiGLU is one kernel (C++ on a CPU under `train.fusion=cpp`,
    Triton on CUDA) that saves only its input and the weights, not silu(gate) and silu*up.
    `fused_router`: the C++ softmax top-k router (train.fusion=cpp, where `fused_router_covers` the
    config) saves its probabilities, top-k index and counts only. `fused_permute`: the C++ (or Triton)
    permute, whose index maps ride on the autograd context rather than being saved (2 x rows x 8 bytes the
    meter does not see), and whose unweighted combine saves nothing. `cpp_attention`: moetron's C++
    attention (fp32 CPU under train.fusion=cpp, one process's whole sequence, the shapes of
    `attention_cpu.shape_runs`), which saves what a fused kernel saves for MLA too. `cpp_sigmoid_router`:
    DeepSeek-V3's sigmoid router selects in C++ (train.fusion=cpp): it saves the scores and the top-k
    index, nothing for the weights' normalisation.
    docs/activation_memory.md derives every term.
    """
    modules = cfg.recompute_modules if modules is None else list(modules)
    every = cfg.recompute_every_n_layers if every_n_layers is None else every_n_layers
    plan = RecomputePlan.for_layer(modules, every, layer_idx)
    b = torch.finfo(dtype).bits // 8
    T, H = batch * seq, cfg.hidden_size
    out = LayerActivations()
    rope = 2 * rope_batch * seq * cfg.rope_dim * b  # cos and sin, shared by every rope call of the layer
    if plan.full:  # one checkpoint around the layer: its inputs h, cos, sin
        out.add("layer input", T * H * b)
        out.add("rope tables", rope)
        return out
    mods = plan.modules
    discard_norm = "layernorm" in mods

    # --- attention block -------------------------------------------------------------------------
    _norm(out, "attn norm", T, H, b, discard_norm)
    if not discard_norm:  # the norm output, saved by the first projections (q/k/v or q_a/kv_a)
        out.add("attn norm output", T * H * b)
    out.add("rope tables", rope)
    path = attention_path(cfg, device, cpp_attention)
    if cfg.attention_type == "gqa":
        _gqa(out, cfg, batch, seq, b, mods, path, device)
    else:
        _mla(out, cfg, batch, seq, b, mods, path)

    # --- MLP block ---------------------------------------------------------------------------------
    _norm(out, "mlp norm", T, H, b, discard_norm)
    if cfg.is_moe_layer(layer_idx):
        _moe(out, cfg, T, batch, b, mods, T * cfg.top_k if rows is None else rows, grouped_mm, fused_swiglu,
             fused_router, fused_permute, cpp_sigmoid_router)
    else:
        if not discard_norm:  # saved by gate/up (or held as the checkpoint's input)
            out.add("mlp norm output", T * H * b)
        if "mlp" not in mods:
            _swiglu_mlp(out, "mlp", T, cfg.intermediate_size, b)
    return out


def _norm(out: LayerActivations, name: str, T: int, H: int, b: int, discarded: bool) -> None:
    """RMSNorm as written in ops: x32 = x.float(); x32 * rsqrt(mean(x32^2) + eps); weight * (.).to(b)."""
    if discarded:  # the region keeps only its input
        out.add(f"{name} input", T * H * b)
        return
    out.add(f"{name} input fp32", T * H * 4)  # pow and mul save x32 (x itself when fp32)
    out.add(f"{name} rstd", T * 4)
    if b != 4:  # fp32 runs ops/functional.py's Function, which saves x and rstd only
        out.add(f"{name} normalised", T * H * b)  # weight * xn saves xn


def _swiglu_mlp(out: LayerActivations, name: str, T: int, F: int, b: int) -> None:
    """down(silu(gate(x)) * up(x)) past its input: gate and up outputs, silu(gate), the product."""
    out.add(f"{name} gate", T * F * b)
    out.add(f"{name} up", T * F * b)
    out.add(f"{name} silu(gate)", T * F * b)
    out.add(f"{name} act", T * F * b)


def _gqa(out: LayerActivations, cfg: ModelConfig, B: int, S: int, b: int, mods, path: str, device: str) -> None:
    T, h, g, d = B * S, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    for which, heads in (("q", h), ("k", g)):  # per-head RMSNorm of q and k
        out.add(f"{which}_norm input fp32", T * heads * d * 4)
        out.add(f"{which}_norm rstd", T * heads * 4)
        if b != 4:  # the fp32 Function saves no normalised copy
            out.add(f"{which}_norm normalised", T * heads * d * b)
    if path != "fused":
        raise NotImplementedError(f"the formula covers GQA with a fused attention kernel, not {path!r}")
    if "core_attn" in mods:  # checkpoint inputs: q (rotated), k (rotated), v (view of v_proj's output)
        out.add("core input q", T * h * d * b)
        out.add("core input k, v", 2 * T * g * d * b)
    elif device == "cpu":  # q, k, v (SDPA reads each kv head for its group: enable_gqa), log-sum-exp
        out.add("core q, k, v", (h + 2 * g) * T * d * b)
        out.add("core logsumexp", T * h * 4)
    else:  # q, k and v expanded to h heads (k, v themselves when g == h), log-sum-exp
        out.add("core q, k, v", 3 * T * h * d * b)
        out.add("core logsumexp", T * h * 4)
    out.add("core output", T * h * d * b)  # also o_proj's input (the kernel writes it [B,S,h,d])


def _mla(out: LayerActivations, cfg: ModelConfig, B: int, S: int, b: int, mods, path: str) -> None:
    T, h = B * S, cfg.num_attention_heads
    r, dr, dn, dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    dqk = dn + dr
    if cfg.q_lora_rank is not None:
        qr = cfg.q_lora_rank
        out.add("q_a_layernorm input fp32", T * qr * 4)
        out.add("q_a_layernorm rstd", T * 4)
        if b != 4:  # the fp32 Function saves no normalised copy
            out.add("q_a_layernorm normalised", T * qr * b)
        out.add("q latent", T * qr * b)  # saved by q_b_proj (the mla_up_proj region's input)
    # kv_a_layernorm normalises a view of kv_a_proj's output [T, r+dr]: in fp32 it saves that view
    # (the whole output stays alive), otherwise its fp32 copy of the latent part
    out.add("kv_a_layernorm input fp32", T * (r + dr) * 4 if b == 4 else T * r * 4)
    out.add("kv_a_layernorm rstd", T * 4)
    if b != 4:
        out.add("kv_a_layernorm normalised", T * r * b)
    out.add("kv latent", T * r * b)  # saved by kv_b_proj
    up_discarded = "mla_up_proj" in mods
    if up_discarded:  # the region's inputs beyond the two latents: the rotated shared key
        out.add("rotated shared key", T * dr * b)
    q = k = T * h * dqk * b  # the cat outputs
    kv = T * h * (dn + dv) * b  # kv_b_proj's output; v is a view of it
    if "core_attn" in mods:  # checkpoint inputs q, k, v (nothing when they are discarded outputs)
        if not up_discarded:
            out.add("core inputs q, k, kv", q + k + kv)
    elif path == "fused":  # q, k, v (a view of kv), output, log-sum-exp
        if not up_discarded:
            out.add("core q, k, kv", q + k + kv)
        out.add("core logsumexp", T * h * 4)
    else:
        # v [B,h,S,dv] is a strided view of kv; the batched product folds it to [B*h,S,dv], which is
        # still a view only for B == 1 (and, on the math path, only without the fp32 upcast copy)
        v_is_view = B == 1 and (path == "eager" or b == 4)
        if path == "math":  # scaled copies of q and k^T, the probabilities, v; on CPU, in fp32
            m = 4  # the math path computes in fp32 for bf16/fp16 inputs
            out.add("core scaled q, k^T", 2 * T * h * dqk * m)
            out.add("core probabilities", B * h * S * S * m)
        else:  # eager: q and k^T as views, causal mask, fp32 probabilities (and their cast), v
            m = b
            if not up_discarded:
                out.add("core q, k", q + k)
            out.add("core causal mask", S * S)
            out.add("core probabilities", B * h * S * S * 4)
            if b != 4:  # softmax runs in fp32; the product uses them cast back
                out.add("core probabilities cast", B * h * S * S * b)
        if not v_is_view:
            out.add("core v copy", T * h * dv * m)
        elif not up_discarded:
            out.add("core v (view of kv)", kv)
    # o_proj's input: the fused kernel writes its output [B,S,h,dv] (a view), the others [B,h,S,dv]
    out.add("o_proj input", T * h * dv * b)


def _moe(out: LayerActivations, cfg: ModelConfig, T: int, B: int, b: int, mods, N: int, grouped_mm: bool,
         fused_swiglu: bool = False, fused_router: bool = False, fused_permute: bool = False,
         cpp_sigmoid_router: bool = False) -> None:
    H, E, k = cfg.hidden_size, cfg.num_experts, cfg.top_k
    moe_cfg = cfg.moe_config()
    discard_norm = "layernorm" in mods
    fp32_router_input = b == 4  # the router's x.float() is x itself
    if not discard_norm and (fp32_router_input or moe_cfg.shared_expert_ffn_size or "moe" in mods):
        out.add("mlp norm output", T * H * b)  # router (fp32) / shared experts / the moe checkpoint
    if "moe" in mods:
        return
    # router (fp32)
    if not fp32_router_input:
        out.add("router input fp32", T * H * 4)
        out.add("router weight fp32", E * H * 4)
    if fused_router:  # the C++ router's probabilities, top-k index and expert counts
        out.add("router scores", T * E * 4)
        out.add("router top-k index", T * k * 8)
        out.add("router expert counts", E * 8)
    else:
        _eager_router(out, moe_cfg, T, B, k, cpp_sigmoid_router and moe_cfg.score_func == "sigmoid")
    # dispatch / combine
    if not fused_permute:  # torch permute
        out.add("permute token index", N * 8)  # index_select; index_add reuses it
    out.add("row weights slot index", N * 8)  # the gate weight of each row (moe/layer.py: probs_on_experts)
    if not fused_permute:
        out.add("expert output", N * H * b)  # index_add's source (the weights are applied in the experts)
    # routed experts
    F = cfg.moe_intermediate_size
    if grouped_mm:
        out.add("grouped GEMM offsets", 2 * E * 4)
    out.add("expert input", N * H * b)
    out.add("expert gate_up", N * 2 * F * b)
    out.add("expert weights", N * 4)  # fp32 gate weight per row (kept by the moe_act region too)
    if "moe_act" not in mods:
        if not fused_swiglu:  # weighted SwiGLU (torch reference): silu(gate), silu*up
            out.add("expert silu(gate)", N * F * b)
            out.add("expert act", N * F * b)
        out.add("expert weighted act", N * F * b)  # the down projection's input
    if moe_cfg.shared_expert_ffn_size and "shared_experts" not in mods:
        _swiglu_mlp(out, "shared experts", T, moe_cfg.shared_expert_ffn_size, b)


def _eager_router(out: LayerActivations, moe_cfg, T: int, B: int, k: int, cpp_selection: bool = False) -> None:
    """What the eager TopKRouter saves (fp32): scores, top-k index, normalisation, balancing losses
    (`cpp_selection`: the sigmoid router's selection in C++, which saves no normalisation)."""
    E = moe_cfg.num_experts
    out.add("router scores", T * E * 4)  # softmax / sigmoid result (also gather's input)
    out.add("router top-k index", T * k * 8)
    if moe_cfg.score_func == "softmax" and not moe_cfg.softmax_before_topk:
        out.add("router top-k softmax", T * k * 4)
    elif moe_cfg.norm_topk_prob and not cpp_selection:
        out.add("router weight normalisation", T * k * 4 + T * 4)  # div: weights and their sum
    if moe_cfg.aux_loss_type != "none" and moe_cfg.aux_loss_coeff > 0:
        if moe_cfg.score_func != "softmax":  # sigmoid scores / their sum
            out.add("aux loss probabilities", T * E * 4 + T * 4)
        elif not moe_cfg.softmax_before_topk:  # softmax of the logits (else: the router scores themselves)
            out.add("aux loss probabilities", T * E * 4)
        if moe_cfg.aux_loss_type == "seq_aux_loss":
            out.add("aux loss counts", B * E * 4)  # per-sequence counts / seq_len
        else:
            out.add("aux loss counts", E * 4)
    if moe_cfg.z_loss_coeff > 0:
        out.add("z-loss logits and logsumexp", T * E * 4 + T * 4)
    if moe_cfg.capacity_factor is not None:
        out.add("capacity drop mask", T * k)
        out.add("routing weights mask", T * k)  # Routing.from_topk masks dropped slots (bool)
