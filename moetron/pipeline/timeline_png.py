"""A pipeline timeline as a PNG picture, with no plotting package: rank labels, blocks coloured by
kind and labelled with their micro-batch, a time axis, a legend and a title (the simulator's
`--png`). Pixels are drawn into byte rows and written as an 8-bit RGB PNG with zlib.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

__all__ = ["Block", "COLOURS", "draw_timeline", "fill", "text", "text_width", "write_png"]

COLOURS = {"F": (70, 130, 220), "B": (60, 170, 90), "b": (120, 200, 180), "W": (240, 170, 60), "FB": (150, 90, 200)}
LEGEND = {"F": "F FORWARD", "B": "B BACKWARD", "b": "B INPUT-GRAD BACKWARD (SPLIT)", "W": "W WEIGHT GRAD",
          "FB": "F&B FORWARD + BACKWARD OVERLAPPED"}
WHITE, BLACK, GREY = (255, 255, 255), (0, 0, 0), (150, 150, 150)

_GLYPHS = {  # 3x5 pixels, row by row
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001010010010",
    "8": "111101111101111", "9": "111101111001111", "A": "010101111101101", "B": "110101110101110",
    "C": "011100100100011", "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111", "J": "001001001101010",
    "K": "101101110101101", "L": "100100100100111", "M": "101111111101101", "N": "110101101101101",
    "O": "010101101101010", "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111", "V": "101101101101010",
    "W": "101101111111101", "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    ".": "000000000000010", "%": "101001010100101", "=": "000111000111000", "&": "010101010101011",
    ":": "000010000010000", "/": "001001010100100", "-": "000000111000000", "(": "001010010010001",
    ")": "100010010010100", ",": "000000000010100", "+": "000010111010000", " ": "000000000000000",
}


@dataclass(frozen=True)
class Block:
    rank: int
    start: float
    end: float
    kind: str  # F, B, b (split backward), W, FB
    chunk: int
    label: str  # the micro-batch number, or e.g. "F3B5" for an overlapped pair


def fill(image, x0: int, y0: int, x1: int, y1: int, colour) -> None:
    for y in range(max(y0, 0), min(y1, len(image))):
        image[y][3 * x0: 3 * x1] = bytes(colour) * max(0, x1 - x0)


def text_width(s: str, scale: int) -> int:
    return max(0, 4 * scale * len(s) - scale)


def text(image, s: str, x: int, y: int, scale: int = 1, colour=BLACK) -> None:
    """`s` (upper-cased) in the 3x5 font, each font pixel a `scale` x `scale` square."""
    for ch in s.upper():
        glyph = _GLYPHS.get(ch, _GLYPHS[" "])
        for i, bit in enumerate(glyph):
            if bit == "1":
                px, py = x + (i % 3) * scale, y + (i // 3) * scale
                fill(image, px, py, px + scale, py + scale, colour)
        x += 4 * scale


def _tick(makespan: float, pixels_per_unit: float) -> float:
    """A round time step whose labels do not overlap (at least 40 pixels apart)."""
    for step in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000):
        if step * pixels_per_unit >= 40:
            return step
    return max(makespan / 5, 1.0)


def draw_timeline(path: str, blocks: list[Block], *, ranks: int, makespan: float, title: str,
                  chunks: int = 1, pixels_per_unit: float | None = None, row_height: int = 24) -> tuple[int, int]:
    """Write the picture to `path`; returns its (width, height)."""
    ppu = pixels_per_unit or max(8.0, min(48.0, 1000.0 / max(makespan, 1e-9)))
    left, top, gap = text_width(f"RANK {ranks - 1}", 2) + 16, 30, 4
    plot_w = int(round(makespan * ppu)) + 1
    kinds = [k for k in COLOURS if any(b.kind == k for b in blocks)]
    legend = [(COLOURS[k], LEGEND[k]) for k in kinds]
    notes = ["NUMBERS: MICRO-BATCH"] + (["DARKER: SECOND CHUNK (VIRTUAL STAGE)"] if chunks > 1 else [])
    width = max(left + plot_w + 16, text_width(title, 2) + 20, 560)
    # legend items flow in lines across the width
    items = [(c, label, 18 + text_width(label, 1) + 16) for c, label in legend] + \
            [(None, n, text_width(n, 1) + 16) for n in notes]
    lines, x = [[]], 10
    for item in items:
        if x + item[2] > width - 10 and lines[-1]:
            lines.append([])
            x = 10
        lines[-1].append(item)
        x += item[2]
    rows_h = ranks * (row_height + gap)
    axis_y = top + rows_h + 2
    height = axis_y + 26 + 18 * len(lines) + 6
    image = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]

    text(image, title, 10, 8, 2)
    for r in range(ranks):
        y0 = top + r * (row_height + gap)
        text(image, f"RANK {r}", 8, y0 + (row_height - 10) // 2, 2)
        fill(image, left, y0 + row_height // 2, left + plot_w, y0 + row_height // 2 + 1, (225, 225, 225))
    for b in blocks:
        shade = 1.0 - 0.3 * (b.chunk % 2)
        colour = tuple(int(c * shade) for c in COLOURS[b.kind])
        x0, x1 = left + int(round(b.start * ppu)), left + int(round(b.end * ppu))
        y0 = top + b.rank * (row_height + gap)
        fill(image, x0, y0, max(x0 + 1, x1 - 1), y0 + row_height, colour)
        for scale in (2, 1):
            w = text_width(b.label, scale)
            if w <= x1 - x0 - 4 and 5 * scale <= row_height - 4:
                text(image, b.label, x0 + (x1 - x0 - w) // 2, y0 + (row_height - 5 * scale) // 2, scale,
                     WHITE if scale == 2 else BLACK)
                break
    fill(image, left, axis_y, left + plot_w, axis_y + 1, BLACK)
    step = _tick(makespan, ppu)
    t = 0.0
    while t <= makespan + 1e-9:
        x = left + int(round(t * ppu))
        fill(image, x, axis_y, x + 1, axis_y + 5, BLACK)
        label = f"{t:g}"
        text(image, label, x - text_width(label, 1) // 2, axis_y + 8, 1)
        t += step
    unit = "TIME (COST UNITS: F=FORWARD OF ONE STAGE)"
    text(image, unit, left + plot_w - text_width(unit, 1), axis_y + 16, 1, GREY)
    y = axis_y + 28
    for line in lines:
        x = 10
        for colour, label, w in line:
            if colour is not None:
                fill(image, x, y, x + 12, y + 12, colour)
                text(image, label, x + 18, y + 3, 1)
            else:
                text(image, label, x, y + 3, 1)
            x += w
        y += 18
    write_png(path, width, height, image)
    return width, height


def write_png(path: str, width: int, height: int, rows) -> None:
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    raw = b"".join(b"\x00" + bytes(row) for row in rows)  # filter type 0 per scanline
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)))
        f.write(chunk(b"IEND", b""))
