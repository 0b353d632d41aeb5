"""Line and scatter plots written as PNG with numpy + zlib + struct only (edge-profile's figures; no matplotlib).

    plot_png("mem.png", {"plain": [(256, 300.1), (1024, 301.2)], ...}, title="PEAK RSS VS CONTEXT",
             xlabel="CONTEXT", ylabel="MB")

A 3x5 pixel font (digits, A-Z and a few signs, scaled 2x) labels ticks, axes and the legend; lower-case is drawn as
upper-case. Series starting with "~" are drawn as markers only (scatter)."""
from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import numpy as np

# 3x5 glyphs: five rows of three bits, top row first
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", "A": "010101111101101", "B": "110101110101110",
    "C": "011100100100011", "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111", "J": "001001001101010",
    "K": "101101110101101", "L": "100100100100111", "M": "101111111101101", "N": "110101101101101",
    "O": "010101101101010", "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111", "V": "101101101101010",
    "W": "101101111111101", "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    ".": "000000000000010", "-": "000000111000000", "+": "000010111010000", "/": "001001010100100",
    "%": "101001010100101", "(": "010100100100010", ")": "010001001001010", "=": "000111000111000",
    ":": "000010000010000", ",": "000000000010100", "_": "000000000000111", " ": "000000000000000",
    "~": "000011110000000", "[": "110100100100110", "]": "011001001001011", "<": "001010100010001",
    ">": "100010001010100",
}
PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (23, 190, 207), (188, 189, 34), (127, 127, 127)]
SCALE = 2  # font pixels per glyph pixel


def _png(rgb: np.ndarray) -> bytes:
    """[H, W, 3] uint8 → PNG bytes (8-bit truecolor, filter 0 on every row)."""
    h, w, _ = rgb.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1).tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


class Canvas:
    def __init__(self, w: int, h: int):
        self.img = np.full((h, w, 3), 255, np.uint8)
        self.w, self.h = w, h

    def rect(self, x0, y0, x1, y1, color):
        x0, x1 = sorted((int(round(x0)), int(round(x1))))
        y0, y1 = sorted((int(round(y0)), int(round(y1))))
        self.img[max(y0, 0):max(min(y1 + 1, self.h), 0), max(x0, 0):max(min(x1 + 1, self.w), 0)] = color

    def line(self, x0, y0, x1, y1, color, width: int = 2):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for x, y in zip(np.linspace(x0, x1, n), np.linspace(y0, y1, n)):
            self.rect(x - width // 2, y - width // 2, x + (width - 1) // 2, y + (width - 1) // 2, color)

    def text(self, x, y, s: str, color=(0, 0, 0), vertical: bool = False):
        """Top-left at (x, y); vertical text runs bottom to top."""
        for i, ch in enumerate(s.upper()):
            bits = _FONT.get(ch, _FONT[" "])
            for r in range(5):
                for c in range(3):
                    if bits[r * 3 + c] == "1":
                        if vertical:
                            px, py = x + r * SCALE, y - (i * 4 + c) * SCALE
                        else:
                            px, py = x + (i * 4 + c) * SCALE, y + r * SCALE
                        self.rect(px, py, px + SCALE - 1, py + SCALE - 1, color)

    @staticmethod
    def text_width(s: str) -> int:
        return len(s) * 4 * SCALE


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 10 or v == int(v) else f"{v:.2g}"


def plot_png(path, series: dict[str, list[tuple[float, float]]], *, title: str = "", xlabel: str = "",
             ylabel: str = "", size: tuple[int, int] = (720, 440), logx: bool = False,
             diagonal: bool = False) -> Path:
    """Write a line plot of {name: [(x, y), ...]}; names starting with "~" are scatter series. `diagonal`: draw
    y = x (predicted vs measured)."""
    pts = [(x, y) for s in series.values() for x, y in s]
    if not pts:
        raise ValueError("nothing to plot")
    fx = (lambda v: math.log2(v)) if logx else (lambda v: v)
    xs, ys = [fx(x) for x, _ in pts], [y for _, y in pts]
    xlo, xhi, ylo, yhi = min(xs), max(xs), min(ys), max(ys)
    if diagonal:
        xlo = ylo = min(xlo, ylo)
        xhi = yhi = max(xhi, yhi)
    pad = 0.06 * ((yhi - ylo) or abs(yhi) or 1)
    ylo, yhi = ylo - pad, yhi + pad
    xpad = 0.03 * ((xhi - xlo) or 1)
    xlo, xhi = xlo - xpad, xhi + xpad
    W, H = size
    left, right, top, bottom = 78, 20, 34, 56
    c = Canvas(W, H)
    X = lambda v: left + (fx(v) - xlo) / (xhi - xlo) * (W - left - right)  # noqa: E731
    Y = lambda v: H - bottom - (v - ylo) / (yhi - ylo) * (H - top - bottom)  # noqa: E731
    grey = (200, 200, 200)
    for t in _ticks(ylo, yhi):
        c.line(left, Y(t), W - right, Y(t), (235, 235, 235), 1)
        c.text(left - 6 - c.text_width(_fmt(t)), Y(t) - 5, _fmt(t))
    xt = [2 ** e for e in range(math.floor(xlo), math.ceil(xhi) + 1)] if logx else _ticks(xlo, xhi)
    for t in xt:
        if xlo <= fx(t) <= xhi:
            c.line(X(t), top, X(t), H - bottom, (235, 235, 235), 1)
            c.text(X(t) - c.text_width(_fmt(t)) / 2, H - bottom + 6, _fmt(t))
    c.line(left, top, left, H - bottom, grey, 1)
    c.line(left, H - bottom, W - right, H - bottom, grey, 1)
    if diagonal:
        lo, hi = max(xlo, ylo), min(xhi, yhi)
        c.line(X(lo), Y(lo), X(hi), Y(hi), (150, 150, 150), 1)
    c.text((W - c.text_width(title)) / 2, 8, title)
    c.text((W - c.text_width(xlabel)) / 2, H - 22, xlabel)
    c.text(8, (H + c.text_width(ylabel)) / 2, ylabel, vertical=True)
    ly = top + 6
    for i, (name, s) in enumerate(series.items()):
        col = PALETTE[i % len(PALETTE)]
        s = sorted(s)
        if not name.startswith("~"):
            for (x0, y0), (x1, y1) in zip(s, s[1:]):
                c.line(X(x0), Y(y0), X(x1), Y(y1), col, 2)
        for x, y in s:
            c.rect(X(x) - 3, Y(y) - 3, X(x) + 3, Y(y) + 3, col)
        label = name.lstrip("~")
        c.rect(left + 12, ly + 2, left + 22, ly + 8, col)
        c.text(left + 28, ly, label, col)
        ly += 16
    path = Path(path)
    path.write_bytes(_png(c.img))
    return path
