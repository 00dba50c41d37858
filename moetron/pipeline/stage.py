"""Pipeline stage modules: the part of a MoETransformer that one layout stage runs.

    layout = parse_layout("Et|tt|tm|L", num_layers=5, mtp_layers=1, pp=4)
    schedule = build_schedule("1f1b", pp=4, microbatches=8)
    chunks = build_stage_modules(model, layout, schedule, rank)   # this rank's stages, by chunk

A `PipelineStageModule` holds references to the model's own submodules (no copies), under
the model's attribute names, so `stage.named_parameters()` yields exactly the model's names
(`layers.3.self_attn.q_proj.weight`, ...). Every stage receives the micro-batch (`MicroBatch`:
input ids, pre-shifted labels, positions); the first stage embeds, the others receive hidden
states from the previous stage.

What travels between stages (the "payload", a tuple of `[B, S, hidden]` tensors):
`(h,)` until the first MTP layer; after n of the model's MTP layers
`(h, normed_1, ..., normed_n, h_mtp_n)`, where `normed_k` is MTP depth k's normed output for
the shared head and `h_mtp_n` (the input of depth n+1) is dropped once no MTP layer is left.
The loss stage computes the LM loss and every depth's MTP loss, exactly as
`MoETransformer.forward` does, and returns `(total_loss, lm_loss, mtp_loss)` (the last two
detached, `mtp_loss` only when the model has MTP layers).

As pieces (`pieces`), a stage is a chain of functions from one state tuple to the next, which
the pipeline executor can interleave with another micro-batch's chain; with the all-to-all
dispatcher each MoE layer's two token all-to-alls are communication pieces that the executor
issues asynchronously (moetron/pipeline/overlap.py); each dispatch's count exchange stays a
synchronous host sync inside the dispatch piece.

Context parallel (cp > 1): the model is `context_parallelize`d before its stages are built, and
each micro-batch is this CP rank's `split_batch` (two chunks, global positions), so everything
that travels between stages is `[B, S/cp, hidden]`. Attention exchanges keys/values over CP
inside a stage; the loss stage uses the model's CP-reduced `lm_loss` (the token-weighted mean
over the CP ranks, the same on each) and its `shift_labels` for MTP labels that cross chunk
borders, so a pipeline's losses and summed gradients equal the one-process ones.

Shared parameters: the embedding is used by the E stage, by every stage holding MTP layers
(embedding of the future tokens) and by the loss stage when the head is tied. A stage
that needs it holds the model's `embed_tokens` under its own name; when such stages sit on
different ranks, each rank has its own copy and `moetron.pipeline.runtime` sums their
gradients over the holders after the schedule (Megatron's embedding group). DualPipe holds
every stage on two ranks, so there every parameter is shared that way.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moetron.dispatch.base import is_phased
from moetron.model import recompute
from moetron.model.model import IGNORE_INDEX, MoETransformer, lm_cross_entropy
from moetron.model.mtp import shift_left
from moetron.pipeline.layout import LayoutError, PipelineLayout, PipelineStage
from moetron.pipeline.overlap import CommPiece

Tensors = tuple[torch.Tensor, ...]
Piece = tuple[str, Callable[[Tensors], Tensors]]


@dataclass
class MicroBatch:
    """One micro-batch as every stage sees it. `labels[b, i]` is the target of position i."""

    input_ids: torch.Tensor  # [B, S] int64
    labels: torch.Tensor | None = None  # [B, S], -100 ignored; needed by MTP and loss stages
    position_ids: torch.Tensor | None = None  # [B or 1, S]; default arange(S), or the CP chunks' positions

    @classmethod
    def of(cls, obj: Any) -> MicroBatch:
        """Accept a MicroBatch, an `(input_ids, labels)` pair or a dict with those keys."""
        if isinstance(obj, MicroBatch):
            return obj
        if isinstance(obj, dict):
            return cls(obj["input_ids"], obj.get("labels"), obj.get("position_ids"))
        if isinstance(obj, (tuple, list)) and len(obj) in (2, 3):
            return cls(*obj)
        raise TypeError(f"a micro-batch must be a MicroBatch, (input_ids, labels) or a dict, "
                        f"got {type(obj).__name__}")


def _needs_embedding(stage: PipelineStage, tied: bool) -> bool:
    return stage.has_embedding or bool(stage.mtp_layers) or (stage.has_loss and tied)


def parameter_keys(stage: PipelineStage, tied: bool) -> set[str]:
    """Top-level parameter prefixes a stage uses (`embed_tokens`, `layers.3`, `mtp.0`, ...)."""
    keys = {f"layers.{i}" for i in stage.decoder_layers} | {f"mtp.{j}" for j in stage.mtp_layers}
    if _needs_embedding(stage, tied):
        keys.add("embed_tokens")
    if stage.has_loss:
        keys |= {"norm"} | (set() if tied else {"lm_head"})
    return keys


def parameter_key(name: str) -> str:
    """The prefix of `parameter_keys` that parameter `name` belongs to."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("layers", "mtp") else parts[0]


class PipelineStageModule(nn.Module):
    """Stage `index` of `layout`, built from (and sharing parameters with) `model`."""

    def __init__(self, model: MoETransformer, layout: PipelineLayout, index: int):
        super().__init__()
        if not 0 <= index < layout.num_stages:
            raise LayoutError(f"stage {index} is outside the layout's 0..{layout.num_stages - 1}")
        cfg = model.config
        if (layout.num_layers, layout.mtp_layers) != (cfg.num_layers, cfg.num_mtp_layers):
            raise LayoutError(
                f"layout {layout.text!r} describes {layout.num_layers} layers and "
                f"{layout.mtp_layers} MTP layers, the model has num_layers={cfg.num_layers} and "
                f"num_mtp_layers={cfg.num_mtp_layers}")
        self.config = cfg
        self.layout = layout
        self.index = index
        self.stage = layout.stages[index]
        self.tied = model.lm_head is None
        self.embed_tokens = model.embed_tokens if _needs_embedding(self.stage, self.tied) else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in self.stage.decoder_layers})
        self.mtp = nn.ModuleDict({str(j): model.mtp[j] for j in self.stage.mtp_layers})
        self.norm = model.norm if self.stage.has_loss else None
        self.lm_head = model.lm_head if self.stage.has_loss else None
        self.rotary = model.rotary
        # The model's own head and loss, so a model whose head was made vocab-parallel
        # (it swaps these) computes its loss the same way here.
        self._head = model.head
        self._lm_loss = getattr(model, "lm_loss", lm_cross_entropy)
        # Context parallel (built after context_parallelize): the CP-reduced loss above, MTP label
        # shifts across chunk borders, and global positions of this rank's chunks by default.
        self._shift_labels = getattr(model, "shift_labels", lambda t, k: shift_left(t, k, IGNORE_INDEX))
        self.cp_group = getattr(model, "cp_group", None)
        # Tensor parallel with sequence parallel (tensor_parallelize sets these): stages pass S/tp rows.
        sp = getattr(model, "sequence_parallel", False)
        self.sequence_shards = model.tp_group.size if sp else 1
        self._mtp_done_before = sum(len(s.mtp_layers) for s in layout.stages[:index])
        weight = model.embed_tokens.weight
        self.hidden_size, self.dtype, self.device = cfg.hidden_size, weight.dtype, weight.device

    # --- what crosses stage boundaries ------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.layout.num_stages - 1

    def _payload_count(self, mtp_done: int) -> int:
        if mtp_done == 0:
            return 1
        return 1 + mtp_done + (1 if mtp_done < self.layout.mtp_layers else 0)

    def _spec(self, batch: MicroBatch, count: int) -> list[tuple[torch.Size, torch.dtype]]:
        b, s = batch.input_ids.shape
        # under sequence parallel the residual stream between layers is this TP rank's S/tp shard
        return [(torch.Size((b, s // self.sequence_shards, self.hidden_size)), self.dtype)] * count

    def input_spec(self, batch: MicroBatch) -> list[tuple[torch.Size, torch.dtype]]:
        """Shapes and dtypes of the tensors this stage receives (none for the first)."""
        return [] if self.is_first else self._spec(batch, self._payload_count(self._mtp_done_before))

    def output_spec(self, batch: MicroBatch) -> list[tuple[torch.Size, torch.dtype]]:
        """Shapes and dtypes of the tensors this stage sends on (none for the last)."""
        done = self._mtp_done_before + len(self.stage.mtp_layers)
        return [] if self.is_last else self._spec(batch, self._payload_count(done))

    # --- compute ----------------------------------------------------------------------
    def forward(self, inputs: Sequence[torch.Tensor], batch: MicroBatch) -> Tensors:
        state = tuple(inputs)
        for _, fn in self.pieces(batch, split=None):
            state = fn(state)
        return state

    def pieces(self, batch: MicroBatch, split: str | None = "moe") -> list[Piece]:
        """The stage as a chain of `(name, fn)`; each fn maps a tuple of tensors to the next.

        `split=None`: one piece per decoder layer (the layer's own `forward`); "layer": an
        attention piece and an MLP piece per layer; "moe": MoE MLPs further split into
        dispatch, experts and combine pieces (DESIGN principle 5), so a schedule can run them
        between the backward pieces of another micro-batch. With a phased dispatcher
        (all-to-all) the two EP all-to-alls are pieces of their own, `CommPiece`s, which the
        pipeline executor runs asynchronously (pipeline/overlap.py); called directly they are
        ordinary synchronous all-to-alls. Non-tensor state (routing handles, split sizes)
        travels in the closures; tensors that need gradients travel in the tuple.
        """
        if split not in (None, "layer", "moe"):
            raise ValueError(f"split={split!r}: choose None, 'layer' or 'moe'")
        batch = MicroBatch.of(batch)
        out: list[Piece] = []
        positions = batch.position_ids
        if positions is None:
            positions = self._default_positions(batch.input_ids)
        rope = self.rotary(positions, self.dtype) if (self.layers or self.mtp) else None
        if self.stage.has_embedding:
            out.append(("embedding", lambda state: (self.embed_tokens(batch.input_ids),)))
        for i in self.stage.decoder_layers:
            layer = self.layers[str(i)]
            if split is None:
                out.append((f"layer{i}", lambda state, layer=layer: (layer(state[0], rope),)))
                continue
            out.append((f"attention{i}", lambda state, layer=layer: (layer.attention_block(state[0], rope),)))
            if split == "moe" and layer.is_moe:
                out.extend(_moe_pieces(layer, i))
            else:
                out.append((f"mlp{i}", lambda state, layer=layer: (layer.mlp_block(state[0]),)))
        mtp_done = self._mtp_done_before
        for j in self.stage.mtp_layers:
            out.append((f"mtp{j}", lambda state, j=j, done=mtp_done:
                        self._mtp_piece(state, j, done, batch, rope)))
            mtp_done += 1
        if self.stage.has_loss:
            out.append(("loss", lambda state: self._loss(state, batch)))
        elif self.stage.mtp_layers and mtp_done == self.layout.mtp_layers:
            out.append(("drop_mtp_hidden", lambda state: tuple(t.view_as(t) for t in state[:-1])))
        if not out:  # an empty stage passes its inputs on
            out.append(("identity", lambda state: tuple(t.view_as(t) for t in state)))
        return out

    def _default_positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """0..S-1, or under context parallel the global positions of this rank's two chunks."""
        s, device = input_ids.shape[1], input_ids.device
        cp = self.cp_group
        if cp is None or cp.size == 1:
            return torch.arange(s, device=device)[None]
        from moetron.parallel.context_parallel import local_positions

        return local_positions(s * cp.size, cp.size, cp.rank, device)[None]

    def _mtp_piece(self, state: Tensors, j: int, done: int, batch: MicroBatch, rope) -> Tensors:
        module = self.mtp[str(j)]
        if batch.labels is None:
            raise ValueError(f"stage {self.index} runs MTP layer {j} and needs the micro-batch labels")
        h_prev = state[-1] if done else state[0]
        future_ids = self._shift_labels(batch.labels, module.depth - 1).clamp_min(0)
        h, normed = module(h_prev, self.embed_tokens(future_ids), rope)
        kept = state[:-1] if done else state  # (h_main, normed_1..normed_done)
        return tuple(t.view_as(t) for t in kept) + (normed, h)

    def _loss(self, state: Tensors, batch: MicroBatch) -> Tensors:
        if batch.labels is None:
            raise ValueError(f"stage {self.index} computes the loss and needs the micro-batch labels")
        lm_loss, _ = self._lm_loss(self._head(self.norm(state[0])), batch.labels)
        n = self.layout.mtp_layers
        if not n:
            return (lm_loss, lm_loss.detach())
        losses = []
        for k in range(1, n + 1):
            labels = self._shift_labels(batch.labels, k)
            losses.append(self._lm_loss(self._head(state[k]), labels)[0])
        mtp_loss = torch.stack(losses).mean()
        total = lm_loss + self.config.mtp_loss_weight * mtp_loss
        return (total, lm_loss.detach(), mtp_loss.detach())


# ------------------------------------------------------------------------------ MoE pieces


def _moe_pieces(layer, index: int) -> list[Piece]:
    """dispatch | experts (+ shared experts) | combine (+ residual) for one MoE decoder layer;
    with a phased dispatcher (all-to-all) also the two all-to-alls as communication pieces.

    Tensors of the dispatcher's handle that carry gradients (gate weights, or dispatched
    weights on flex) cross piece boundaries as tuple entries and are put back into the
    handle, so each piece's backward stays inside its own piece.
    """
    moe = layer.mlp
    if is_phased(moe.dispatcher):
        return _phased_moe_pieces(layer, index)
    ctx: dict[str, Any] = {}

    def dispatch(state: Tensors) -> Tensors:
        h = state[0]
        x = layer.post_attention_layernorm(h)
        x_TH = x.reshape(-1, x.shape[-1])
        routing = moe.route(x_TH, x.shape[-2])
        x_NH, rows, handle = moe.dispatch(x_TH, routing)
        ctx["rows"], ctx["handle"] = rows, handle
        ctx["slots"] = slots = _grad_tensors(handle)
        shared_in = (x_TH,) if moe.shared_experts is not None else ()
        return (h.view_as(h), x_NH, *slots, *shared_in)

    def experts(state: Tensors) -> Tensors:
        n = len(ctx["slots"])
        h, x_NH, slots, shared_in = state[0], state[1], state[2:2 + n], state[2 + n:]
        y_NH = moe.compute_experts(x_NH, ctx["rows"])
        extra = (moe.shared(shared_in[0]),) if shared_in else ()
        return (h.view_as(h), y_NH, *(t.view_as(t) for t in slots), *extra)

    return [(f"dispatch{index}", dispatch), (f"experts{index}", experts),
            (f"combine{index}", _combine_piece(ctx, moe.combine))]


def _combine_piece(ctx: dict[str, Any], combine_rows: Callable) -> Callable[[Tensors], Tensors]:
    """The last MoE piece: put the gate-weight slots back into the handle, combine the rows
    (`combine_rows(rows, handle)`), add the shared-expert output and the residual."""
    def combine(state: Tensors) -> Tensors:
        n = len(ctx["slots"])
        h, y, slots, extra = state[0], state[1], state[2:2 + n], state[2 + n:]
        handle = _replace_tensors(ctx["handle"], dict(zip(map(id, ctx["slots"]), slots)))
        out = combine_rows(y, handle)
        if extra:
            out = out + extra[0]
        ctx.clear()
        return (h + out.view(h.shape),)

    return combine


def _phased_moe_pieces(layer, index: int) -> list[Piece]:
    """dispatch | dispatch_a2a | experts | combine_a2a | combine, the all-to-alls as CommPieces
    on state entry 1 (rows), which the executor runs asynchronously (pipeline/overlap.py).

    The state is `(h, rows, *gate-weight slots, *shared-expert input or output)`; the plan and
    handle (host splits, permutation indices) travel in the closures.
    """
    moe = layer.mlp
    dispatcher = moe.dispatcher
    ctx: dict[str, Any] = {}

    def dispatch(state: Tensors) -> Tensors:  # norm, route, permute, count exchange
        h = state[0]
        x = layer.post_attention_layernorm(h)
        x_TH = x.reshape(-1, x.shape[-1])
        routing = moe.route(x_TH, x.shape[-2])
        with recompute.saved_outputs("layernorm" in moe.recompute_modules):  # as MoELayer.dispatch
            x_send, ctx["dispatch_a2a"], ctx["plan"] = dispatcher.dispatch_preprocess(x_TH, routing)
        ctx["slots"] = slots = _grad_tensors(ctx["plan"])
        shared_in = (x_TH,) if moe.shared_experts is not None else ()
        return (h.view_as(h), x_send, *slots, *shared_in)

    def experts(state: Tensors) -> Tensors:  # postprocess, experts, shared, combine-preprocess
        n = len(ctx["slots"])
        h, x_recv, slots, shared_in = state[0], state[1], state[2:2 + n], state[2 + n:]
        x_NH, rows, ctx["handle"] = dispatcher.dispatch_postprocess(x_recv, ctx.pop("plan"))
        y_NH = moe.compute_experts(x_NH, rows)
        y_send, ctx["combine_a2a"] = dispatcher.combine_preprocess(y_NH, ctx["handle"])
        extra = (moe.shared(shared_in[0]),) if shared_in else ()
        return (h.view_as(h), y_send, *(t.view_as(t) for t in slots), *extra)

    return [(f"dispatch{index}", dispatch),
            (f"dispatch_a2a{index}", CommPiece(1, lambda: ctx.pop("dispatch_a2a"))),
            (f"experts{index}", experts),
            (f"combine_a2a{index}", CommPiece(1, lambda: ctx.pop("combine_a2a"))),
            (f"combine{index}", _combine_piece(ctx, dispatcher.combine_postprocess))]


def _children(obj: Any):
    if isinstance(obj, (tuple, list)):
        return list(enumerate(obj))
    if isinstance(obj, dict):
        return list(obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return []


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors that require grad inside tuples, lists, dicts and dataclasses of `obj`."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    found: list[torch.Tensor] = []
    for _, child in _children(obj):
        for t in _grad_tensors(child):
            if all(t is not u for u in found):
                found.append(t)
    return found


def _replace_tensors(obj: Any, new: dict[int, torch.Tensor]) -> Any:
    """A copy of `obj` with tensors replaced by `new[id(tensor)]` (containers rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return new.get(id(obj), obj)
    if isinstance(obj, tuple):
        return type(obj)(*(_replace_tensors(c, new) for c in obj)) if hasattr(obj, "_fields") \
            else tuple(_replace_tensors(c, new) for c in obj)
    if isinstance(obj, list):
        return [_replace_tensors(c, new) for c in obj]
    if isinstance(obj, dict):
        return {k: _replace_tensors(v, new) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        clone = copy.copy(obj)
        for name, child in _children(obj):
            object.__setattr__(clone, name, _replace_tensors(child, new))
        return clone
    return obj


# ------------------------------------------------------------------------------ building


def build_stage_modules(model: MoETransformer, layout: PipelineLayout, schedule, rank: int
                        ) -> list[PipelineStageModule]:
    """The stage modules of PP rank `rank`, indexed by the schedule's chunk.

    Placement comes from the schedule (`schedule.stages_of_rank`), not from the layout's
    `k % pp`, because V-shaped and bidirectional schedules place stages differently.
    """
    check_layout_fits(layout, schedule)
    return [PipelineStageModule(model, layout, s) for s in schedule.stages_of_rank(rank)]


def check_layout_fits(layout: PipelineLayout, schedule) -> None:
    if layout.num_stages != schedule.num_stages:
        per_rank = {"dualpipev": "2 per rank, placed as a V", "dualpipe": "1 per rank, held twice",
                    "interleaved": f"{schedule.chunks_per_rank} per rank"}.get(schedule.name, "1 per rank")
        raise LayoutError(
            f"layout {layout.text!r} has {layout.num_stages} stages but schedule {schedule.name!r} "
            f"with pp={schedule.pp} runs {schedule.num_stages} ({per_rank}); write the layout with "
            f"{schedule.num_stages} '|'-separated stages")


def even_layout(num_layers: int, num_stages: int, mtp_layers: int = 0) -> str:
    """A layout string spreading decoder layers evenly; E first, MTP and L in the last stage."""
    if num_stages < 1:
        raise LayoutError(f"num_stages={num_stages} must be >= 1")
    base, extra = divmod(num_layers, num_stages)
    stages = ["t" * (base + (k >= num_stages - extra)) for k in range(num_stages)]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * mtp_layers + "L"
    return "|".join(stages)


def shared_parameter_ranks(layout: PipelineLayout, schedule, tied: bool) -> dict[str, tuple[int, ...]]:
    """Parameter prefix -> the PP ranks holding it, for prefixes held by more than one rank."""
    holders: dict[str, set[int]] = {}
    for rank in range(schedule.pp):
        for s in schedule.stages_of_rank(rank):
            for key in parameter_keys(layout.stages[s], tied):
                holders.setdefault(key, set()).add(rank)
    return {k: tuple(sorted(v)) for k, v in holders.items() if len(v) > 1}
