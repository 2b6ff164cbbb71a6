"""Small charts as PNG files, with nothing but the Python standard library.

The figures of docs/ (scripts/figures.py) and the loss curves of examples/train_packed.py
are drawn with this module: an RGB canvas in a bytearray, a 3x5 pixel font, and three kinds
of chart (lines on linear or log axes, grouped vertical bars, grouped horizontal bars). It
writes a plain 8-bit RGB PNG (zlib), so no plotting library is needed on the machine.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path
from typing import Sequence

Color = tuple  # (r, g, b), 0..255

BLACK = (0, 0, 0)
GRID = (200, 200, 200)
BLUE = (20, 60, 200)
ORANGE = (230, 120, 20)
GREEN = (40, 150, 60)
GREY = (130, 130, 130)
RED = (200, 40, 40)
PURPLE = (130, 60, 170)

# 3x5 glyphs (rows top to bottom, 3 bits each). Lower case is drawn as upper case.
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001001001001", "8": "111101111101111",
    "9": "111101111001111", ".": "000000000000010", " ": "000000000000000",
    "-": "000000111000000", "(": "001010010010001", ")": "100010010010100",
    ",": "000000000010100", ":": "000010000010000", "/": "001001010100100",
    "A": "010101111101101", "B": "110101110101110", "C": "011100100100011",
    "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111",
    "J": "001001001101010", "K": "101101110101101", "L": "100100100100111",
    "M": "101111111101101", "N": "110101101101101", "O": "010101101101010",
    "P": "110101110100100", "Q": "010101101111011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111",
    "V": "101101101101010", "W": "101101111111101", "X": "101101010101101",
    "Y": "101101010010010", "Z": "111001010100111", "%": "101001010100101",
    "+": "000010111010000", "_": "000000000000111", "=": "000111000111000",
    ">": "100010001010100", "<": "001010100010001", "'": "010010000000000",
    "*": "000101010101000", "#": "101111101111101", "[": "110100100100110",
    "]": "011001001001011", "!": "010010010000010", "?": "111001010000010",
}


class Canvas:
    """An RGB image, white unless told otherwise; coordinates are pixels, y downwards."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def fill(self, x0: float, y0: float, x1: float, y1: float, color: Color) -> None:
        """The rectangle [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(int(x0), 0), min(int(x1), self.width)
        y0, y1 = max(int(y0), 0), min(int(y1), self.height)
        if x0 >= x1 or y0 >= y1:
            return
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            offset = (y * self.width + x0) * 3
            self.pixels[offset:offset + len(row)] = row

    def hline(self, x0: float, x1: float, y: float, color: Color) -> None:
        self.fill(x0, int(y), x1, int(y) + 1, color)

    def vline(self, x: float, y0: float, y1: float, color: Color) -> None:
        self.fill(int(x), y0, int(x) + 1, y1, color)

    def line(self, x0: float, y0: float, x1: float, y1: float, color: Color,
             thickness: int = 1) -> None:
        count = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i in range(count + 1):
            t = i / count
            x, y = int(x0 + (x1 - x0) * t), int(y0 + (y1 - y0) * t)
            self.fill(max(x - thickness // 2, 0), max(y - thickness // 2, 0),
                      x + thickness // 2 + 1, y + thickness // 2 + 1, color)

    def text(self, x: float, y: float, text: str, color: Color = BLACK, scale: int = 2) -> None:
        x, y = int(x), int(y)
        for ch in text.upper():
            glyph = _FONT.get(ch, _FONT[" "])
            for i, bit in enumerate(glyph):
                if bit == "1":
                    r, c = divmod(i, 3)
                    self.fill(x + c * scale, y + r * scale, x + (c + 1) * scale,
                              y + (r + 1) * scale, color)
            x += 4 * scale

    @staticmethod
    def text_width(text: str, scale: int = 2) -> int:
        return max(4 * scale * len(text) - scale, 0)

    def save(self, path: Path | str) -> None:
        stride = self.width * 3
        raw = b"".join(b"\x00" + bytes(self.pixels[r * stride:(r + 1) * stride])
                       for r in range(self.height))

        def chunk(kind, data):
            return (struct.pack(">I", len(data)) + kind + data +
                    struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

        png = (b"\x89PNG\r\n\x1a\n" +
               chunk(b"IHDR", struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)) +
               chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
        Path(path).write_bytes(png)


# ---- axes -------------------------------------------------------------------------------


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2, 5 times a power of ten) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(count, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 12))
    return ticks


def format_tick(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e6 or abs(value) < 1e-3:
        return f"{value:.0e}".replace("e+0", "E").replace("e-0", "E-").replace("e", "E")
    if float(value).is_integer():
        return str(int(value))
    return f"{value:g}"


def _legend(c: Canvas, x: int, y: int, series: Sequence[tuple[str, Color]]) -> None:
    for n, (label, color) in enumerate(series):
        ly = y + 18 * n
        c.fill(x, ly + 2, x + 24, ly + 8, color)
        c.text(x + 32, ly, label)


def _frame(c: Canvas, left: int, top: int, right: int, bottom: int, title: str,
           subtitle: str = "") -> None:
    c.text(left, 12, title)
    if subtitle:
        c.text(left, 30, subtitle, GREY)
    c.vline(left, top, bottom + 1, BLACK)
    c.hline(left, right, bottom, BLACK)


# ---- charts -----------------------------------------------------------------------------


def line_chart(path: Path | str, title: str, xlabel: str, ylabel: str,
               series: Sequence[tuple[str, Sequence[float], Sequence[float], Color]],
               xlog: bool = False, ylog: bool = False, xticks: Sequence[float] | None = None,
               xtick_labels: Sequence[str] | None = None, subtitle: str = "",
               width: int = 860, height: int = 520, legend_at: str = "top-left",
               point_labels: Sequence[Sequence[str] | None] | None = None) -> None:
    """Lines through (x, y) points with a square marker at each, one per series;
    point_labels[s][i], when given, is written below point i of series s."""
    left, right, top, bottom = 90, width - 30, 70, height - 60
    fx = (lambda v: math.log10(v)) if xlog else (lambda v: v)
    fy = (lambda v: math.log10(max(v, 1e-30))) if ylog else (lambda v: v)
    xs = [fx(x) for _, sx, _, _ in series for x in sx]
    ys = [fy(y) for _, _, sy, _ in series for y in sy]
    x_lo, x_hi = min(xs), max(xs)
    if xticks is not None:
        x_lo, x_hi = min(x_lo, *map(fx, xticks)), max(x_hi, *map(fx, xticks))
    pad = (x_hi - x_lo) * 0.04 or 1.0
    x_lo, x_hi = x_lo - pad, x_hi + pad
    if ylog:
        y_lo, y_hi = math.floor(min(ys)), math.ceil(max(ys))
        if y_hi == y_lo:
            y_hi += 1
        yticks = [10.0 ** e for e in range(int(y_lo), int(y_hi) + 1)]
    else:
        yticks = nice_ticks(min(0.0, min(ys)), max(ys))
        y_lo, y_hi = yticks[0], yticks[-1]

    def px(x, y):
        return (left + (right - left) * (fx(x) - x_lo) / (x_hi - x_lo),
                bottom - (bottom - top) * (fy(y) - y_lo) / (y_hi - y_lo))

    c = Canvas(width, height)
    for t in yticks:
        _, y = px(10.0 ** x_lo if xlog else x_lo, t)
        c.hline(left, right, y, GRID)
        label = format_tick(t)
        c.text(left - 8 - c.text_width(label), int(y) - 5, label)
    if xticks is not None:
        labels = xtick_labels or [format_tick(t) for t in xticks]
        for t, label in zip(xticks, labels):
            x, _ = px(t, 10.0 ** y_lo if ylog else y_lo)
            c.vline(x, top, bottom, GRID)
            c.text(int(x) - c.text_width(label) // 2, bottom + 8, label)
    _frame(c, left, top, right, bottom, title, subtitle)
    c.text((left + right) // 2 - c.text_width(xlabel) // 2, height - 24, xlabel)
    c.text(8, top - 18, ylabel)
    for n, (label, sx, sy, color) in enumerate(series):
        pts = [px(x, y) for x, y in zip(sx, sy)]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            c.line(x0, y0, x1, y1, color, thickness=3)
        for x, y in pts:
            c.fill(x - 4, y - 4, x + 5, y + 5, color)
        labels = point_labels[n] if point_labels and n < len(point_labels) else None
        for (x, y), label in zip(pts, labels or []):
            c.text(x - c.text_width(label) / 2, y + 10, label, color)
    lx = left + 16 if legend_at == "top-left" else right - 330
    _legend(c, lx, top + 10, [(s[0], s[3]) for s in series])
    c.save(path)


def bar_chart(path: Path | str, title: str, ylabel: str, categories: Sequence[str],
              series: Sequence[tuple[str, Sequence[float], Color]], subtitle: str = "",
              value_format: str = "{:g}", width: int = 860, height: int = 520,
              reference: float | None = None, category_label: str = "") -> None:
    """Grouped vertical bars: one group per category, one bar per series, value on top."""
    left, right, top, bottom = 90, width - 30, 70 + 18 * len(series), height - 60
    values = [v for _, vs, _ in series for v in vs]
    yticks = nice_ticks(0.0, max(values) * 1.08)
    y_hi = yticks[-1]

    def py(v):
        return bottom - (bottom - top) * v / y_hi

    c = Canvas(width, height)
    for t in yticks:
        c.hline(left, right, py(t), GRID)
        label = format_tick(t)
        c.text(left - 8 - c.text_width(label), int(py(t)) - 5, label)
    _frame(c, left, top, right, bottom, title, subtitle)
    c.text(8, top - 18, ylabel)
    if category_label:
        c.text((left + right) // 2 - c.text_width(category_label) // 2, height - 22,
               category_label)
    group_w = (right - left) / len(categories)
    bar_w = min(group_w * 0.8 / len(series), 60)
    for i, cat in enumerate(categories):
        gx = left + group_w * i + (group_w - bar_w * len(series)) / 2
        for s, (_, vs, color) in enumerate(series):
            x0 = gx + bar_w * s
            c.fill(x0 + 1, py(vs[i]), x0 + bar_w - 1, bottom, color)
            label = value_format.format(vs[i])
            scale = 1 if c.text_width(label) > bar_w - 2 else 2
            c.text(x0 + bar_w / 2 - c.text_width(label, scale) / 2,
                   py(vs[i]) - (7 if scale == 1 else 13), label, BLACK, scale)
        for n, part in enumerate(cat.split("\n")):  # a label may take several lines
            c.text(left + group_w * (i + 0.5) - c.text_width(part) / 2, bottom + 8 + 14 * n,
                   part)
    if reference is not None:
        c.hline(left, right, py(reference), RED)
    _legend(c, left + 16, 52, [(s[0], s[2]) for s in series])
    c.save(path)


def hbar_chart(path: Path | str, title: str, xlabel: str, categories: Sequence[str],
               series: Sequence[tuple[str, Sequence[float], Color]], subtitle: str = "",
               value_format: str = "{:g}", reference: float | None = None,
               width: int = 900, bar_height: int = 9) -> None:
    """Grouped horizontal bars: one row group per category (label on the left)."""
    label_w = max(Canvas.text_width(cat) for cat in categories) + 20
    left, right = label_w, width - 70
    top = 62 + 18 * len(series)
    group_h = bar_height * len(series) + 10
    bottom = top + group_h * len(categories)
    height = bottom + 56
    values = [v for _, vs, _ in series for v in vs]
    xticks = nice_ticks(0.0, max(values) * 1.05)
    x_hi = xticks[-1]

    def px(v):
        return left + (right - left) * v / x_hi

    c = Canvas(width, height)
    for t in xticks:
        c.vline(px(t), top, bottom, GRID)
        label = format_tick(t)
        c.text(px(t) - c.text_width(label) // 2, bottom + 8, label)
    _frame(c, left, top, right, bottom, title, subtitle)
    c.text((left + right) // 2 - c.text_width(xlabel) // 2, height - 22, xlabel)
    for i, cat in enumerate(categories):
        gy = top + group_h * i + 5
        c.text(left - 10 - c.text_width(cat), gy + group_h / 2 - 10, cat)
        for s, (_, vs, color) in enumerate(series):
            y0 = gy + bar_height * s
            c.fill(left + 1, y0, px(vs[i]), y0 + bar_height - 1, color)
            c.text(px(vs[i]) + 4, y0 + 1, value_format.format(vs[i]), BLACK, 1)
    if reference is not None:
        c.vline(px(reference), top, bottom, RED)
    _legend(c, left + 16, 46, [(s[0], s[2]) for s in series])
    c.save(path)


def plot_losses(path: Path | str, curves: Sequence[tuple[str, Sequence[float], Color]],
                title: str) -> None:
    """Loss curves (log scale) in one PNG: the first drawn wide, the others thin on top."""
    w, h, left, right, top, bottom = 800, 500, 70, 20, 50, 50
    c = Canvas(w, h)
    values = [v for curve in curves for v in curve[1]]
    lo, hi = math.log10(max(min(values), 1e-6)), math.log10(max(values))
    lo, hi = math.floor(lo), math.ceil(hi)
    steps = max(len(curve[1]) for curve in curves)

    def xy(i, value):
        x = left + (w - left - right) * i / max(steps - 1, 1)
        y = top + (h - top - bottom) * (hi - math.log10(max(value, 1e-6))) / max(hi - lo, 1e-9)
        return x, y

    for e in range(lo, hi + 1):  # decades
        _, y = xy(0, 10.0 ** e)
        c.hline(left, w - right, y, GRID)
        c.text(8, int(y) - 5, f"1E{e}" if e < 0 else f"{10 ** e}")
    for s in range(0, steps, max(steps // 5 // 50 * 50, 50)):
        x, _ = xy(s, 1.0)
        c.vline(x, top, h - bottom, GRID)
        c.text(int(x) - 8, h - bottom + 8, str(s))
    c.vline(left, top, h - bottom, BLACK)
    c.hline(left, w - right, h - bottom, BLACK)
    c.text(w // 2 - 20, h - 22, "STEP")
    c.text(left, 12, title)
    for n, (label, ys, color) in enumerate(curves):
        thickness = 3 if n == 0 else 1  # the reference wide, hsap thin on top of it
        pts = [xy(i, v) for i, v in enumerate(ys)]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            c.line(x0, y0, x1, y1, color, thickness)
        ly = top + 10 + 18 * n
        c.fill(w - 300, ly + 3, w - 270, ly + 6, color)
        c.text(w - 262, ly, label)
    c.save(path)
