"""Pipeline stage modules: the part of a MoETransformer that one layout stage runs.

    layout = parse_layout("Et|tt|tm|L", num_layers=5, mtp_layers=1, pp=4)
    schedule = build_schedule("1f1b", pp=4, microbatches=8)
    chunks = build_stage_modules(model, layout, schedule, rank)   # this rank's stages, by chunk

Design notes: docs/pipeline.md (`moetron/pipeline/stage.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moetron.model.model import IGNORE_INDEX, MoETransformer, lm_cross_entropy
from moetron.model.mtp import shift_left
from moetron.pipeline.layout import (LayoutError, PipelineLayout, PipelineStage, balanced_layout, item_costs,
                                     parse_layout)
from moetron.pipeline.schedules import build_schedule
from moetron.moe.pieces import moe_pieces
from moetron.parallel.context_parallel import local_positions

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
        if cfg.recompute_method == "block":  # Megatron: the first N layers of each pipeline stage
            for position, i in enumerate(self.stage.decoder_layers):
                plan = model.layers[i].recompute
                model.layers[i].recompute = dataclasses.replace(plan, full=position < cfg.recompute_num_layers)
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
                out.extend(moe_pieces(layer.post_attention_layernorm, layer.mlp, i))
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


# ------------------------------------------------------------------------------ building


def build_stage_modules(model: MoETransformer, layout: PipelineLayout, schedule, rank: int
                        ) -> list[PipelineStageModule]:
    """The stage modules of PP rank `rank`, indexed by the schedule's chunk.

    Placement comes from the schedule (`schedule.stages_of_rank`), not from the layout's
    `k % pp`, because V-shaped and bidirectional schedules place stages differently.
    Parameters that several PP ranks hold are tagged `pipeline_shared = True`: their gradient
    is final only once summed over the holders (DataParallel reduces them last).
    """
    check_layout_fits(layout, schedule)
    modules = [PipelineStageModule(model, layout, s) for s in schedule.stages_of_rank(rank)]
    shared = shared_parameter_ranks(layout, schedule, modules[0].tied)
    for module in modules:
        for name, param in module.named_parameters():
            if parameter_key(name) in shared:
                param.pipeline_shared = True
    return modules


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


def default_layout(config, seq_len: int, pp: int, vpp: int = 1) -> str:
    """The layout used when none is given: stages balanced by training FLOPs (`item_costs`)."""
    return balanced_layout(item_costs(config, seq_len), pp=pp, vpp=vpp)


def pipeline_stages(model: MoETransformer, parallel_state, parallel, *, microbatches: int, seq_len: int):
    """Cut `model` into this rank's pipeline stages: `(schedule, layout, stages)`. `parallel.layout`,
    or `default_layout`; one code path for the trainer and the converter."""
    p, c = parallel, model.config
    vpp = p.vpp if p.schedule == "interleaved" else None
    schedule = build_schedule(p.schedule, pp=p.pp, microbatches=microbatches, vpp=vpp)
    per_rank = schedule.num_stages // p.pp
    text = p.layout or default_layout(c, seq_len, p.pp, per_rank)
    layout = parse_layout(text, num_layers=c.num_layers, mtp_layers=c.num_mtp_layers, pp=p.pp, vpp=per_rank)
    return schedule, layout, build_stage_modules(model, layout, schedule, parallel_state.pp.rank)
