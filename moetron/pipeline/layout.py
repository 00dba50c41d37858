"""Pipeline layout strings: which embedding, decoder, MTP and loss items each stage holds.

Syntax (Megatron-Core's): `E` embedding, `t` decoder layer, `m` MTP layer, `L` loss head, `|`
separates stages, `x*n` and `(...)*n` repeat (nestable), whitespace is ignored. Stage k runs on
PP rank k % pp as virtual stage k // pp; V-shaped schedules (DualPipeV) place stages
differently, see `PipelineSchedule.stages_of_rank`. Errors point at the character or count at
fault, because layouts for 61-layer models are written by hand and typos are easy.

When no layout is given, `balanced_layout` partitions per-item costs (from
`item_costs` or measured) into contiguous stages minimising the slowest stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from moetron.config import ModelConfig
from moetron.model.size import layer_params

KINDS = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
MAX_REPEAT = 100_000


class LayoutError(ValueError):
    """A pipeline layout string or stage count that cannot describe the model."""


def _point(text: str, pos: int, message: str) -> LayoutError:
    shown = text.replace("\n", " ").replace("\t", " ")
    return LayoutError(f"bad pipeline layout: {message}\n  {shown}\n  {' ' * pos}^")


@dataclass(frozen=True)
class LayoutItem:
    """One schedulable piece of the model; `index` numbers decoder layers and MTP layers."""

    kind: str  # "embedding", "decoder", "mtp" or "loss"
    index: int | None = None

    def __str__(self) -> str:
        letter = {v: k for k, v in KINDS.items()}[self.kind]
        return letter if self.index is None else f"{letter}{self.index}"


@dataclass(frozen=True)
class PipelineStage:
    index: int
    pp_rank: int
    virtual_rank: int
    items: tuple[LayoutItem, ...]

    @property
    def decoder_layers(self) -> list[int]:
        return [i.index for i in self.items if i.kind == "decoder"]

    @property
    def mtp_layers(self) -> list[int]:
        return [i.index for i in self.items if i.kind == "mtp"]

    @property
    def has_embedding(self) -> bool:
        return any(i.kind == "embedding" for i in self.items)

    @property
    def has_loss(self) -> bool:
        return any(i.kind == "loss" for i in self.items)

    def describe(self) -> str:
        parts = []
        if self.has_embedding:
            parts.append("embedding")
        if self.decoder_layers:
            parts.append(_span("layers", self.decoder_layers))
        if self.mtp_layers:
            parts.append(_span("mtp", self.mtp_layers))
        if self.has_loss:
            parts.append("loss")
        return ", ".join(parts) or "(empty)"


def _span(name: str, indices: list[int]) -> str:
    if len(indices) == 1:
        return f"{name} {indices[0]}"
    return f"{name} {indices[0]}-{indices[-1]}"


@dataclass(frozen=True)
class PipelineLayout:
    text: str
    pp: int
    stages: tuple[PipelineStage, ...]
    num_layers: int = field(default=0)
    mtp_layers: int = field(default=0)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_virtual_stages(self) -> int:
        """Virtual stages per PP rank (vpp)."""
        return len(self.stages) // self.pp

    def stages_for_rank(self, pp_rank: int) -> list[PipelineStage]:
        """The stages PP rank `pp_rank` holds, ordered by virtual rank."""
        if not 0 <= pp_rank < self.pp:
            raise ValueError(f"pp_rank={pp_rank} is outside 0..{self.pp - 1}")
        return [s for s in self.stages if s.pp_rank == pp_rank]

    def table(self) -> str:
        lines = [
            f"pipeline layout {self.text!r}: pp={self.pp}, vpp={self.num_virtual_stages}, "
            f"{self.num_stages} stages",
            f"{'rank':>4} {'virtual':>7} {'stage':>5} {'layers':>6}  holds",
        ]
        for rank in range(self.pp):
            for s in self.stages_for_rank(rank):
                lines.append(
                    f"{rank:>4} {s.virtual_rank:>7} {s.index:>5} {len(s.decoder_layers):>6}  "
                    f"{s.describe()}"
                )
        return "\n".join(lines)

    __str__ = table


# ---------------------------------------------------------------------------------- parsing


class _Parser:
    """Recursive descent over `sequence := (atom ('*' count)?)*`, keeping source positions."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def sequence(self, open_pos: int | None) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        while True:
            self.skip_space()
            if self.pos >= len(self.text):
                if open_pos is not None:
                    raise _point(self.text, open_pos, "'(' is never closed")
                return out
            char = self.text[self.pos]
            if char == ")":
                if open_pos is None:
                    raise _point(self.text, self.pos, "')' without a matching '('")
                self.pos += 1
                return out
            if char == "(":
                start = self.pos
                self.pos += 1
                atom = self.sequence(start)
            elif char in KINDS or char == "|":
                atom = [(char, self.pos)]
                self.pos += 1
            elif char == "*":
                raise _point(self.text, self.pos, "'*' must follow an item or a ')'")
            else:
                raise _point(
                    self.text, self.pos, f"unknown character {char!r} (use E, t, m, L, |, (, ), *n)"
                )
            out.extend(atom * self.repeat_count())

    def repeat_count(self) -> int:
        self.skip_space()
        if self.pos >= len(self.text) or self.text[self.pos] != "*":
            return 1
        star = self.pos
        self.pos += 1
        self.skip_space()
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isdigit():
            self.pos += 1
        if start == self.pos:
            raise _point(self.text, star, "'*' must be followed by a repeat count")
        count = int(self.text[start : self.pos])
        if not 1 <= count <= MAX_REPEAT:
            raise _point(self.text, start, f"repeat count {count} must be in 1..{MAX_REPEAT}")
        return count


def parse_layout(
    text: str, *, num_layers: int, mtp_layers: int = 0, pp: int, vpp: int | None = None
) -> PipelineLayout:
    """Parse and validate `text` against the model (`num_layers`, `mtp_layers`) and `pp`.

    With `vpp` given the stage count must be exactly pp * vpp; otherwise any multiple of pp.
    """
    if pp < 1:
        raise LayoutError(f"pp={pp} must be >= 1")
    flat = _Parser(text).sequence(None)
    items = [(c, p) for c, p in flat if c != "|"]
    if not items:
        raise LayoutError(f"bad pipeline layout {text!r}: it holds no items; it needs E and L")

    e_pos = [p for c, p in items if c == "E"]
    l_pos = [p for c, p in items if c == "L"]
    if not e_pos:
        raise LayoutError(f"bad pipeline layout {text!r}: no 'E' (embedding); it must start with E")
    if len(e_pos) > 1:
        raise _point(text, e_pos[1], "a second 'E'; the embedding appears exactly once, first")
    if items[0][0] != "E" or flat[0][0] != "E":
        raise _point(text, e_pos[0], "'E' must be the first item of the first stage")
    if not l_pos:
        raise LayoutError(f"bad pipeline layout {text!r}: no 'L' (loss); it must end with L")
    if len(l_pos) > 1:
        raise _point(text, l_pos[0], "more than one 'L'; the loss head appears exactly once, last")
    if items[-1][0] != "L" or flat[-1][0] != "L":
        raise _point(text, l_pos[0], "'L' must be the last item of the last stage")

    seen_mtp = False
    for c, p in items:
        seen_mtp = seen_mtp or c == "m"
        if seen_mtp and c == "t":
            raise _point(text, p, "decoder layer 't' after an MTP layer 'm'; MTP comes last")
    n_t = sum(c == "t" for c, _ in items)
    n_m = sum(c == "m" for c, _ in items)
    if n_t != num_layers:
        raise LayoutError(
            f"bad pipeline layout {text!r}: it has {n_t} decoder layers 't' but the model has "
            f"num_layers={num_layers}"
        )
    if n_m != mtp_layers:
        raise LayoutError(
            f"bad pipeline layout {text!r}: it has {n_m} MTP layers 'm' but the model has "
            f"mtp_layers={mtp_layers}"
        )

    groups: list[list[str]] = [[]]
    for c, _ in flat:
        if c == "|":
            groups.append([])
        else:
            groups[-1].append(c)
    if vpp is not None and len(groups) != pp * vpp:
        raise LayoutError(
            f"bad pipeline layout {text!r}: it has {len(groups)} stages but pp={pp} x vpp={vpp} "
            f"needs {pp * vpp}"
        )
    if len(groups) % pp:
        raise LayoutError(
            f"bad pipeline layout {text!r}: it has {len(groups)} stages, not a multiple of "
            f"pp={pp}; add or remove '|' (empty stages are allowed)"
        )

    counters = {"t": 0, "m": 0}
    stages = []
    for k, group in enumerate(groups):
        stage_items = []
        for c in group:
            index = None
            if c in counters:
                index = counters[c]
                counters[c] += 1
            stage_items.append(LayoutItem(KINDS[c], index))
        stages.append(PipelineStage(k, k % pp, k // pp, tuple(stage_items)))
    return PipelineLayout(text, pp, tuple(stages), num_layers, mtp_layers)


def format_layout(stages: Sequence[str]) -> str:
    """Join per-stage item strings ("Ettt", "tt", ...) compactly: `t*3`, `(tt|)*n` runs."""

    def compress(stage: str) -> str:
        out, i = [], 0
        while i < len(stage):
            j = i
            while j < len(stage) and stage[j] == stage[i]:
                j += 1
            out.append(stage[i] + (f"*{j - i}" if j - i > 2 else stage[i] * (j - i - 1)))
            i = j
        return "".join(out)

    parts, k = [], 0
    while k < len(stages):
        run = 1
        while k + run < len(stages) - 1 and stages[k + run] == stages[k]:
            run += 1
        body = compress(stages[k])
        if run > 1 and k + run < len(stages) and body:
            parts.append(f"({body}|)*{run}")
        else:
            run = 1
            parts.append(body + ("|" if k + 1 < len(stages) else ""))
        k += run
    return "".join(parts)


# ---------------------------------------------------------------------------------- balancing


@dataclass(frozen=True)
class ItemCosts:
    """Relative cost of each layout item, in one unit (time is what a pipeline balances)."""

    embedding: float
    layers: tuple[float, ...]
    loss: float
    mtp: tuple[float, ...] = ()


def item_costs(c: ModelConfig, seq_len: int, memory_weight: float = 0.0) -> ItemCosts:
    """The one pipeline cost model: each layout item's share of the training FLOPs per token
    (embedding, each decoder layer, the loss head, each MTP layer), plus `memory_weight` x its
    share of the parameters. FLOPs decide a stage's time, so they are the default; `moetron plan`
    and `balanced_layout` both read this."""
    if c.attention_type == "gqa":
        qk, v = c.head_dim, c.head_dim
    else:
        qk, v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    attention = 3 * 2 * c.num_attention_heads * (seq_len / 2) * (qk + v)  # causal QK^T and AV
    H, V = c.hidden_size, c.vocab_size
    head = 6.0 * V * H
    n, m = c.num_layers, c.num_mtp_layers
    flops = [6.0 * H] + [6.0 * layer_params(c, i)[1] + attention for i in range(n)]
    flops += [6.0 * layer_params(c, n + k)[1] + attention + 6.0 * 2 * H * H + head for k in range(m)]
    flops += [head]
    params = [V * H] + [layer_params(c, i)[0] for i in range(n)]
    params += [layer_params(c, n + k)[0] + 2 * H * H for k in range(m)] + [V * H]
    total_f, total_p = sum(flops), sum(params)
    cost = [f / total_f + memory_weight * q / total_p for f, q in zip(flops, params)]
    return ItemCosts(embedding=cost[0], layers=tuple(cost[1:1 + n]), mtp=tuple(cost[1 + n:1 + n + m]),
                     loss=cost[-1])


def balanced_layout(costs: ItemCosts, *, pp: int, vpp: int = 1) -> str:
    """A layout string for pp*vpp contiguous stages that minimises the slowest stage's cost.

    Exact: one dynamic programme finds the smallest possible maximum, a second one, among
    partitions meeting it, minimises the sum of squared stage costs so the other stages are
    even too. E stays in stage 0 and L in the last stage; stages may be empty.
    """
    if pp < 1 or vpp < 1:
        raise LayoutError(f"pp={pp} and vpp={vpp} must be >= 1")
    letters = ["E"] + ["t"] * len(costs.layers) + ["m"] * len(costs.mtp) + ["L"]
    values = [costs.embedding, *costs.layers, *costs.mtp, costs.loss]
    if any(v < 0 for v in values):
        raise LayoutError("item costs must be >= 0")
    n, num_stages = len(values), pp * vpp
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)

    def seg(a: int, b: int) -> float:
        return prefix[b] - prefix[a]

    def solve(score, combine, limit: float | None):
        # best[j][i]: best score of items[0:i] in j stages; stage 0 holds E, the last holds L.
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
        cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
        for i in range(1, n + 1):
            if limit is None or seg(0, i) <= limit:
                best[1][i] = score(seg(0, i))
        for j in range(2, num_stages + 1):
            lo_i = n if j == num_stages else 1
            for i in range(lo_i, n + 1):
                hi_k = min(i, n - 1) if j == num_stages else i
                for k in range(1, hi_k + 1):
                    if best[j - 1][k] == inf or (limit is not None and seg(k, i) > limit):
                        continue
                    value = combine(best[j - 1][k], score(seg(k, i)))
                    if value < best[j][i]:
                        best[j][i], cut[j][i] = value, k
        return best, cut

    if num_stages == 1:
        return format_layout(["".join(letters)])
    best, _ = solve(lambda c: c, max, None)
    slowest = best[num_stages][n]
    _, cut = solve(lambda c: c * c, lambda a, b: a + b, slowest * (1 + 1e-9) + 1e-12)
    bounds, i = [n], n
    for j in range(num_stages, 1, -1):
        i = cut[j][i]
        bounds.append(i)
    bounds.append(0)
    bounds.reverse()
    return format_layout(["".join(letters[bounds[j] : bounds[j + 1]]) for j in range(num_stages)])
