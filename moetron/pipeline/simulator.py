"""Discrete-event simulation of a pipeline schedule's action lists.

It runs exactly the lists from `schedules.build_schedule` (the ones the runtime executes): each
rank takes its actions in order, and an action starts when its rank is free and its inputs
have arrived (the neighbouring stage's output, plus `comm` when that stage is on another rank).

Costs are per stage and per micro-batch: `F` forward, `B` input-gradient backward, `W` weight
gradient. A full (unsplit) backward costs B + W, a split one B and its W pass W; with W=None
it is 0, so B alone is the full backward. An `FB` pair (forward of one micro-batch overlapped
with the full backward of another) costs `FB` if given, else F + (B+W) - overlap * min(F, B+W):
overlap=0 runs the halves back to back, overlap=1 hides the shorter half entirely (max(F, B+W)),
which is what hiding one micro-batch's all-to-all behind the other's compute aims at.

Run `moetron simulate --schedule 1f1b --pp 4 --microbatches 8 --png timeline.png`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from moetron.pipeline.schedules import (
    SCHEDULES,
    Action,
    PipelineSchedule,
    build_schedule,
    run_in_order,
)
from moetron.pipeline.timeline_png import COLOURS, Block, draw_timeline, fill, text, text_width, write_png


@dataclass(frozen=True)
class TimelineEntry:
    rank: int
    start: float
    end: float
    action: Action


@dataclass
class SimulationResult:
    schedule: PipelineSchedule
    makespan: float
    busy: list[float]
    bubble: list[float]  # idle time per rank until the last rank finishes, in cost units
    peak_activations: list[int]  # max (micro-batch, stage) forwards started but not backwarded
    timeline: list[TimelineEntry]

    @property
    def bubble_fraction(self) -> float:
        """Idle time over useful time, summed over ranks: (PP-1)/m for 1F1B (Megatron's)."""
        return sum(self.bubble) / sum(self.busy)

    def summary(self) -> str:
        s = self.schedule
        return "\n".join([
            f"schedule={s.name} pp={s.pp} microbatches={s.microbatches} stages={s.num_stages}",
            f"makespan={_num(self.makespan)} bubble_fraction={self.bubble_fraction:.4f}",
            "bubble per rank: " + " ".join(_num(b) for b in self.bubble),
            "peak activations per rank: " + " ".join(str(p) for p in self.peak_activations),
        ])

    def to_text(self, chars_per_unit: float | None = None) -> str:
        """One row per rank; each action is a block labelled with its kind and micro-batch."""
        labels = {id(e): _label(e.action, self.schedule) for e in self.timeline}
        if chars_per_unit is None:
            chars_per_unit = max(
                len(labels[id(e)]) / (e.end - e.start) for e in self.timeline if e.end > e.start
            )
        width = int(round(self.makespan * chars_per_unit)) + 1
        rows = [["."] * width for _ in range(self.schedule.pp)]
        for e in self.timeline:
            a, b = int(round(e.start * chars_per_unit)), int(round(e.end * chars_per_unit))
            if b > a:
                text = (labels[id(e)] + "=" * (b - a))[: b - a]
                rows[e.rank][a:b] = list(text)
        lines = [f"rank {r:>2} |{''.join(row).rstrip('.')}" for r, row in enumerate(rows)]
        legend = "F forward, B full backward, b input-grad backward, W weight grad, "
        legend += "F3B5 overlapped pair"
        if self.schedule.chunks_per_rank > 1:
            legend += ", .c = chunk"
        return "\n".join(lines + [f"{'':8}{legend}; . idle; {_num(1 / chars_per_unit)} units/char"])

    def picture(self, path: str, pixels_per_unit: float | None = None, row_height: int = 24) -> tuple[int, int]:
        """The timeline as a PNG to read: rank labels, blocks labelled with their micro-batch, a time
        axis, a legend and the bubble fraction in the title (`--png`). Returns (width, height)."""
        s = self.schedule
        blocks = [Block(e.rank, e.start, e.end, _kind(e.action),
                        e.action.chunk, _label(e.action, s) if e.action.kind == "FB" else str(e.action.microbatch))
                  for e in self.timeline]
        vpp = f" VPP={s.chunks_per_rank}" if s.chunks_per_rank > 1 and s.name == "interleaved" else ""
        title = (f"{s.name} PP={s.pp}{vpp} MICRO-BATCHES={s.microbatches}: BUBBLE "
                 f"{self.bubble_fraction * 100:.1f}% OF BUSY TIME, MAKESPAN {_num(self.makespan)}")
        return draw_timeline(path, blocks, ranks=s.pp, makespan=self.makespan, title=title,
                             chunks=s.chunks_per_rank, pixels_per_unit=pixels_per_unit, row_height=row_height)

    def to_png(self, path: str, pixels_per_unit: int = 24, row_height: int = 20) -> None:
        """The bare timeline strip (colour by kind, shade by chunk, micro-batch digits), one pixel
        row band per rank; `picture` draws the annotated figure."""
        width = int(self.makespan * pixels_per_unit) + 2
        height = self.schedule.pp * row_height + 2
        image = [bytearray(b"\xff\xff\xff" * width) for _ in range(height)]
        for e in self.timeline:
            shade = 1.0 - 0.3 * (e.action.chunk % 2)
            colour = tuple(int(c * shade) for c in COLOURS[_kind(e.action)])
            x0, x1 = int(e.start * pixels_per_unit) + 1, int(e.end * pixels_per_unit) + 1
            y0 = e.rank * row_height + 1
            fill(image, x0, y0, x1 - 1, y0 + row_height - 1, colour)
            label = str(e.action.microbatch)
            if x0 + 2 + text_width(label, 1) <= x1 - 2:
                text(image, label, x0 + 2, y0 + (row_height - 5) // 2)
        write_png(path, width, height, image)


def _kind(action: Action) -> str:
    return "b" if action.kind == "B" and action.split_backward else action.kind


def _num(x: float) -> str:
    return f"{x:g}"


def _label(action: Action, schedule: PipelineSchedule) -> str:
    def one(a: Action) -> str:
        kind = "b" if a.kind == "B" and a.split_backward else a.kind
        chunk = f".{a.chunk}" if schedule.chunks_per_rank > 1 else ""
        return f"{kind}{a.microbatch}{chunk}"

    return "".join(one(p) for p in action.parts())


def simulate(
    schedule: str | PipelineSchedule,
    *,
    pp: int | None = None,
    microbatches: int | None = None,
    F: float = 1.0,
    B: float = 2.0,
    W: float | None = None,
    vpp: int | None = None,
    comm: float = 0.0,
    FB: float | None = None,
    overlap: float = 0.0,
) -> SimulationResult:
    """Simulate `schedule`: a built one, or a name built with pp, microbatches and vpp
    (vpp=None takes the schedule's own default: 2 for interleaved)."""
    if isinstance(schedule, str):
        if pp is None or microbatches is None:
            raise ValueError("simulate(name, ...) needs pp= and microbatches=")
        schedule = build_schedule(schedule, pp=pp, microbatches=microbatches, vpp=vpp)
    w = 0.0 if W is None else W
    if F <= 0 or B <= 0 or w < 0 or comm < 0 or not 0 <= overlap <= 1:
        raise ValueError(
            "need F > 0, B > 0, W >= 0, comm >= 0, 0 <= overlap <= 1; "
            f"got {F=}, {B=}, {W=}, {comm=}, {overlap=}"
        )
    full_backward = B + w
    pair = FB if FB is not None else F + full_backward - overlap * min(F, full_backward)

    def cost(action: Action) -> float:
        if action.kind == "F":
            return F
        if action.kind == "B":
            return B if action.split_backward else full_backward
        return w if action.kind == "W" else pair

    clock = [0.0] * schedule.pp
    finish: dict[tuple[str, int, int], float] = {}
    timeline: list[TimelineEntry] = []

    def visit(rank: int, action: Action, deps) -> None:
        ready = max([clock[rank]] + [finish[k] + (comm if r != rank else 0.0) for r, k in deps])
        end = ready + cost(action)
        for part in action.parts():
            finish[(part.kind, part.microbatch, part.stage)] = end
        timeline.append(TimelineEntry(rank, ready, end, action))
        clock[rank] = end

    run_in_order(schedule, visit)
    timeline.sort(key=lambda e: (e.rank, e.start))
    makespan = max(clock)
    busy = [0.0] * schedule.pp
    for e in timeline:
        busy[e.rank] += e.end - e.start
    return SimulationResult(
        schedule,
        makespan,
        busy,
        bubble=[makespan - b for b in busy],
        peak_activations=_peaks(schedule.pp, timeline),
        timeline=timeline,
    )


def _peaks(pp: int, timeline: list[TimelineEntry]) -> list[int]:
    """Activations are held from a forward's start until its backward's end (counted per stage)."""
    events: list[list[tuple[float, int]]] = [[] for _ in range(pp)]
    for e in timeline:
        for part in e.action.parts():
            if part.kind == "F":
                events[e.rank].append((e.start, +1))
            elif part.kind == "B":
                events[e.rank].append((e.end, -1))
    peaks = []
    for rank_events in events:
        level = peak = 0
        for _, delta in sorted(rank_events):  # at equal times releases (-1) come first
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return peaks


# ---------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="moetron simulate",
        description="Simulate a pipeline schedule, draw its timeline.",
    )
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks (devices)")
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--vpp", type=int, default=None, help="virtual stages per rank")
    parser.add_argument("--F", type=float, default=1.0, help="forward cost per stage")
    parser.add_argument("--B", type=float, default=2.0, help="input-gradient backward cost")
    parser.add_argument("--W", type=float, default=None, help="weight-gradient cost per stage")
    parser.add_argument("--FB", type=float, default=None, help="cost of an overlapped F&B pair")
    parser.add_argument(
        "--overlap", type=float, default=0.0, help="share of the shorter half an F&B pair hides"
    )
    parser.add_argument("--comm", type=float, default=0.0, help="P2P time between ranks")
    parser.add_argument("--chars-per-unit", type=float, default=None)
    parser.add_argument("--png", default=None, help="also write the timeline to this PNG file")
    args = parser.parse_args(argv)
    try:
        result = simulate(
            args.schedule, pp=args.pp, microbatches=args.microbatches, vpp=args.vpp, F=args.F,
            B=args.B, W=args.W, FB=args.FB, overlap=args.overlap, comm=args.comm,
        )
    except ValueError as error:  # ScheduleError included: say the rule, not a traceback
        parser.error(str(error))
    print(result.to_text(args.chars_per_unit))
    print(result.summary())
    if args.png:
        width, height = result.picture(args.png)
        print(f"wrote {args.png} ({width}x{height})")


if __name__ == "__main__":
    main()
