"""Shared timing helpers for the benchmark scripts: interleaved repeats, median and min.

Candidates are timed round-robin (one call of each per round, the starting
candidate rotating every round) so that slow drift of the machine — frequency,
other load, allocator state — hits every candidate equally instead of whichever
ran last.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class Timing:
    name: str
    samples: list[float]  # wall seconds, one per repeat
    cpu_samples: list[float]  # process CPU seconds (all threads), one per repeat

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu_samples)


def time_interleaved(candidates: dict[str, Callable[[], object]], *, warmup: int = 2,
                     repeats: int = 10) -> dict[str, Timing]:
    """Call every candidate `warmup` times, then `repeats` times round-robin; return the times.

    Besides wall time each sample records the process's CPU time (all threads). Time spent
    descheduled by other processes does not count there, but threads spin-waiting for a
    descheduled partner do, so on a busy machine it grows too, only less than wall time.
    """
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside one sample would charge it to that candidate
    try:
        for r in range(repeats):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                cpu0, start = time.process_time(), time.perf_counter()
                candidates[name]()
                samples[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - cpu0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: Timing(name, samples[name], cpu[name]) for name in names}


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])
