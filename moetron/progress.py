"""The one progress bar: `moetron train`, `moetron convert` and `moetron data prepare` all draw it.

`ProgressBar` draws one self-overwriting line on a terminal; off a terminal it draws nothing (or,
with `plain_every`, a plain line that often), which is what a log file or CI wants.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from typing import Callable, TextIO

__all__ = ["ProgressBar", "format_duration", "is_tty"]


def format_duration(seconds: float) -> str:
    """`75 -> '1m15s'`, `4000 -> '1h06m'`: short, for ETAs."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def is_tty(stream) -> bool:
    """Whether `stream` is a terminal that understands control sequences (not TERM=dumb)."""
    try:
        return bool(stream.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class ProgressBar:
    """`[#####.....]  42%  420/1000 steps  3.1 steps/s  ETA 3m05s  loss 2.34` on one line.

    Draws only when `stream` is a TTY (or `enabled=True` forces it); redraws at most every
    `min_interval` seconds except on the final update. `write(line)` prints a line above the
    bar without tearing it.
    """

    def __init__(self, total: float, *, initial: float = 0, unit: str = "steps", stream: TextIO | None = None,
                 enabled: bool | None = None, min_interval: float = 0.1, width: int | None = None,
                 scale: float = 1.0, label: str = "", plain_every: float | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = is_tty(self.stream)
        self.enabled = self.tty if enabled is None else enabled
        self.label = label
        # Off a terminal the bar is not drawn; with `plain_every` a plain line is printed that often
        # instead (a log file of a long conversion still shows progress).
        self.plain_every = plain_every if not self.tty else None
        self.total, self.n, self.unit = total, initial, unit
        self.width, self.min_interval = width, min_interval
        self.scale = scale  # counts are shown divided by it (e.g. bytes as MB with unit="MB", scale=1e6)
        self.postfix = ""
        self._start_n, self._start_t = initial, time.perf_counter()
        self._last_draw = -math.inf
        self._drawn = False

    def update(self, n: float | None = None, *, advance: float | None = None, postfix: str | None = None) -> None:
        """Set the position to `n` (or move it by `advance`) and redraw if due."""
        if n is not None:
            self.n = n
        if advance is not None:
            self.n += advance
        if postfix is not None:
            self.postfix = postfix
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.plain_every is not None:
            if now - self._last_draw >= self.plain_every:
                self._last_draw = now
                self.stream.write(self.render(now, fit=False) + "\n")
                self.stream.flush()
        elif now - self._last_draw >= self.min_interval or self.n >= self.total:
            self._draw(now)

    def render(self, now: float | None = None, fit: bool = True) -> str:
        """The bar's text (no control characters), fitted to the terminal width when `fit`."""
        now = time.perf_counter() if now is None else now
        elapsed = now - self._start_t
        done = self.n - self._start_n
        rate = done / elapsed / self.scale if elapsed > 0 and done > 0 else 0.0
        frac = min(1.0, self.n / self.total) if self.total > 0 else 1.0
        eta = (self.total - self.n) / self.scale / rate if rate > 0 else math.inf
        rate_text = f"{rate:.2f}" if rate < 10 else f"{rate:.0f}"
        stats = (f"{frac * 100:3.0f}%  {self._count(self.n)}/{self._count(self.total)} {self.unit}  "
                 f"{rate_text} {self.unit}/s  "
                 + (f"ETA {format_duration(eta)}" if self.n < self.total else f"in {format_duration(elapsed)}"))
        if self.postfix:
            stats += f"  {self.postfix}"
        columns = self.width or shutil.get_terminal_size((100, 20)).columns
        bar_len = max(10, min(40, columns - len(stats) - 4))
        filled = int(frac * bar_len)
        line = f"[{'#' * filled}{'.' * (bar_len - filled)}] {stats}"
        if self.label:
            line = f"{self.label}: {line}"
        return line[: max(columns - 1, 20)] if fit else line

    def _count(self, x: float) -> str:
        return f"{x:.0f}" if self.scale == 1 else f"{x / self.scale:.1f}"

    def _draw(self, now: float) -> None:
        self.stream.write("\r\x1b[2K" + self.render(now))
        self.stream.flush()
        self._last_draw, self._drawn = now, True

    def clear(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self._drawn = False

    def write(self, line: str, log: Callable[[str], None] | None = None) -> None:
        """Print `line` (through `log`, default: to the bar's stream) above the bar."""
        self.clear()
        if log is None:
            self.stream.write(line + "\n")
            self.stream.flush()
        else:
            log(line)
        if self.enabled:
            self._draw(time.perf_counter())

    def close(self) -> float:
        """Leave the final bar on its own line; returns the seconds since the bar started."""
        now = time.perf_counter()
        if self.enabled and self.plain_every is not None:
            self.stream.write(self.render(now, fit=False) + "\n")
            self.stream.flush()
        elif self.enabled and self._drawn:
            self._draw(now)
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
        return now - self._start_t
