"""Inline SVG charts drawn as text: line charts, grouped bars, stacked bars and a calibration plot.

No plotting library and nothing outside the returned string: every chart is one ``<svg>`` element
(no ``xmlns``: inside HTML the parser puts it in the SVG namespace), with its title, axes, ticks,
legend and data, so the page that holds it needs no server, script or network. Text is escaped here;
callers pass plain strings. Numbers are rounded to 0.1 px to keep a 200-step page small.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 560, 260
# Okabe-Ito: told apart by colour-blind readers too; the line charts use these in order.
LINE_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000")
# The stacked budget bars can have 15 parts: tab20's pairs, as `ppo-driver plot` colours them.
PART_COLOURS = (
    "#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896",
    "#9467bd", "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7",
    "#bcbd22", "#dbdb8d", "#17becf", "#9edae5",
)  # fmt: skip
MARKERS_UP_TO = 40  # a series with at most this many points gets a dot (and a tooltip) per point
_LEFT, _RIGHT, _TOP, _BOTTOM = 58, 14, 30, 34
_CHAR_W = 6.2  # the width of a character at 11 px, for laying out the legend


@dataclass(frozen=True)
class Line:
    """One series of a line chart: ``label`` in the legend, points ``(x, y)`` sorted by x."""

    label: str
    xs: Sequence[float]
    ys: Sequence[float]


@dataclass(frozen=True)
class Axis:
    """A y axis: ``lo``/``hi`` bound its range (values beyond are drawn on the edge and counted; the
    range is the data's within them, or all of it with ``whole``), ``log`` draws it in powers of ten,
    ``percent`` labels it in percent, ``ref`` draws a dashed line at that value."""

    label: str = ""
    lo: float | None = None
    hi: float | None = None
    log: bool = False
    percent: bool = False
    ref: float | None = None
    whole: bool = False


def _n(value: float) -> str:
    """A coordinate, 0.1 px."""
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def fmt(value: float) -> str:
    """A number for a tick or a tooltip: 3 significant digits, no exponent for everyday sizes."""
    if value == 0:
        return "0"
    if abs(value) >= 1e5 or abs(value) < 1e-3:
        return f"{value:.2e}"
    return f"{value:.3g}"


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values covering ``lo``..``hi`` (1, 2, 2.5 or 5 times a power of ten)."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9)
    last = math.floor(hi / step + 1e-9)
    return [round(k * step, 12) + 0.0 for k in range(first, last + 1)]


def _frame(title: str, width: int, height: int, body: list[str], label: str) -> str:
    head = (
        f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{escape(title)}">'
        f'<text class="title" x="{_LEFT}" y="16">{escape(title)}</text>'
    )
    if label:
        head += (
            f'<text class="axis-label" transform="translate(13 {_n((_TOP + height - _BOTTOM) / 2)}) '
            f'rotate(-90)" text-anchor="middle">{escape(label)}</text>'
        )
    return head + "".join(body) + "</svg>"


def _legend(labels: Sequence[str], colours: Sequence[str], width: int, top: float) -> tuple[list[str], float]:
    """Legend entries laid out in rows from ``top``; returns the elements and the height they take."""
    out: list[str] = []
    x, y = float(_LEFT), top
    for label, colour in zip(labels, colours, strict=True):
        w = 16 + len(label) * _CHAR_W + 14
        if x + w > width - _RIGHT and x > _LEFT:
            x, y = float(_LEFT), y + 14
        out.append(
            f'<rect x="{_n(x)}" y="{_n(y - 8)}" width="10" height="10" fill="{colour}"/>'
            f'<text class="legend" x="{_n(x + 14)}" y="{_n(y + 1)}">{escape(label)}</text>'
        )
        x += w
    return out, (y - top) + 14 if labels else 0.0


@dataclass(frozen=True)
class _Scale:
    lo: float
    hi: float
    a: float  # pixel of lo
    b: float  # pixel of hi
    log: bool = False

    def __call__(self, value: float) -> float:
        f = math.log10 if self.log else float
        return self.a + (f(value) - f(self.lo)) / (f(self.hi) - f(self.lo)) * (self.b - self.a)


def _y_range(values: Sequence[float], axis: Axis) -> tuple[float, float]:
    """The y axis's range: the data's (and the reference line's), rounded out to ticks, inside the
    axis's ``lo``/``hi`` when it sets them."""
    if axis.log:
        positive = [v for v in values if v > 0] or [1.0]
        lo = axis.lo if axis.lo is not None else 10 ** math.floor(math.log10(min(positive)))
        hi = axis.hi if axis.hi is not None else 10 ** math.ceil(math.log10(max(positive)))
        return lo, hi if hi > lo else lo * 10
    if axis.whole and axis.lo is not None and axis.hi is not None:
        return axis.lo, axis.hi
    data = [*values, *([axis.ref] if axis.ref is not None else [])]
    lo, hi = (min(data), max(data)) if data else (0.0, 1.0)

    def inside(a: float, b: float) -> tuple[float, float]:
        return (a if axis.lo is None else max(a, axis.lo)), (b if axis.hi is None else min(b, axis.hi))

    lo, hi = inside(lo, hi)
    if hi <= lo:  # one value, or every value beyond one bound
        pad = abs(lo) * 0.1 or 0.5
        lo, hi = inside(lo - pad, hi + pad)
        if hi <= lo:
            lo, hi = (axis.lo, axis.hi) if axis.lo is not None and axis.hi is not None else (lo, lo + 1.0)
    ticks = nice_ticks(lo, hi)
    step = ticks[1] - ticks[0] if len(ticks) > 1 else hi - lo
    return inside(math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step)


def _log_ticks(lo: float, hi: float) -> list[float]:
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    many = len(decades) <= 2
    ticks = [m * 10.0**d for d in decades for m in ((1, 2, 5) if many else (1,))]
    return [t for t in ticks if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)]


def _y_axis(scale: _Scale, axis: Axis, width: int) -> list[str]:
    out = []
    ticks = _log_ticks(scale.lo, scale.hi) if axis.log else nice_ticks(scale.lo, scale.hi)
    for t in ticks:
        y = _n(scale(t))
        text = f"{t:.0%}" if axis.percent else fmt(t)
        out.append(
            f'<line class="grid" x1="{_LEFT}" x2="{width - _RIGHT}" y1="{y}" y2="{y}"/>'
            f'<text class="tick" x="{_LEFT - 5}" y="{y}" dy="3.5" text-anchor="end">{text}</text>'
        )
    if axis.ref is not None and scale.lo <= axis.ref <= scale.hi:
        y = _n(scale(axis.ref))
        out.append(f'<line class="ref" x1="{_LEFT}" x2="{width - _RIGHT}" y1="{y}" y2="{y}"/>')
    return out


def _x_axis(scale: _Scale, ticks: Sequence[float], height: int, label: str) -> list[str]:
    base = height - _BOTTOM
    out = [f'<line class="axis" x1="{_LEFT}" x2="{_n(scale.b)}" y1="{base}" y2="{base}"/>']
    for t in ticks:
        x = _n(scale(t))
        out.append(
            f'<line class="axis" x1="{x}" x2="{x}" y1="{base}" y2="{base + 4}"/>'
            f'<text class="tick" x="{x}" y="{base + 15}" text-anchor="middle">{fmt(t)}</text>'
        )
    out.append(
        f'<text class="axis-label" x="{_n((_LEFT + scale.b) / 2)}" y="{height - 4}" '
        f'text-anchor="middle">{escape(label)}</text>'
    )
    return out


def _step_ticks(lo: float, hi: float) -> list[float]:
    return [t for t in nice_ticks(lo, hi, 6) if float(t).is_integer()] or [lo]


def line_chart(
    title: str,
    lines: Sequence[Line],
    axis: Axis = Axis(),
    *,
    x_label: str = "step",
    width: int = WIDTH,
    height: int = HEIGHT,
) -> tuple[str, int]:
    """A line chart of ``lines`` over the steps; returns the SVG and how many points lay outside a
    fixed y range (drawn on its edge as open circles)."""
    lines = [line for line in lines if line.xs]
    legend, legend_h = _legend([ln.label for ln in lines], LINE_COLOURS[: len(lines)], width, _TOP - 4)
    top = _TOP + legend_h
    xs = [x for ln in lines for x in ln.xs]
    x_lo, x_hi = (min(xs), max(xs)) if xs else (0.0, 1.0)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_lo, y_hi = _y_range([y for ln in lines for y in ln.ys], axis)
    sx = _Scale(x_lo, x_hi, _LEFT, width - _RIGHT)
    sy = _Scale(y_lo, y_hi, height - _BOTTOM, top, log=axis.log)
    body = [*legend, *_y_axis(sy, axis, width), *_x_axis(sx, _step_ticks(x_lo, x_hi), height, x_label)]
    clipped = 0
    for colour, line in zip(LINE_COLOURS, lines, strict=False):
        points, outside = [], []
        for x, y in zip(line.xs, line.ys, strict=True):
            v = y
            if axis.log and v <= 0:
                v = y_lo
            if v < y_lo or v > y_hi:
                v = min(max(v, y_lo), y_hi)
                outside.append((x, v, y))
            points.append((x, v, y))
        clipped += len(outside)
        path = " ".join(f"{_n(sx(x))},{_n(sy(v))}" for x, v, _ in points)
        if len(points) > 1:
            body.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.6" points="{path}"/>')
        if len(points) <= MARKERS_UP_TO:
            for x, v, y in points:
                body.append(
                    f'<circle cx="{_n(sx(x))}" cy="{_n(sy(v))}" r="3" fill="{colour}">'
                    f"<title>{escape(line.label)}, step {fmt(x)}: {fmt(y)}</title></circle>"
                )
        for x, v, y in outside:
            body.append(
                f'<circle class="clipped" cx="{_n(sx(x))}" cy="{_n(sy(v))}" r="3.5" stroke="{colour}">'
                f"<title>{escape(line.label)}, step {fmt(x)}: {fmt(y)} (off the axis)</title></circle>"
            )
    return _frame(title, width, height, body, axis.label), clipped


def bar_chart(
    title: str,
    categories: Sequence[str],
    groups: Sequence[tuple[str, Sequence[float | None]]],
    axis: Axis = Axis(),
    *,
    x_label: str = "",
    width: int = WIDTH,
    height: int = HEIGHT,
) -> tuple[str, int]:
    """Grouped bars: per category one bar of each group (``None``: no bar, a dash); returns the SVG and
    how many bars a fixed y range cut (drawn to its edge, hatched)."""
    colours = LINE_COLOURS[: len(groups)]
    legend, legend_h = _legend([g for g, _ in groups], colours, width, _TOP - 4)
    top = _TOP + legend_h
    values = [v for _, vs in groups for v in vs if v is not None]
    y_lo, y_hi = _y_range([*values, 0.0], axis)
    sy = _Scale(y_lo, y_hi, height - _BOTTOM, top)
    body = [*legend, *_y_axis(sy, axis, width)]
    slot = (width - _RIGHT - _LEFT) / max(len(categories), 1)
    bar = slot * 0.8 / max(len(groups), 1)
    zero = sy(min(max(0.0, y_lo), y_hi))
    base = height - _BOTTOM
    body.append(f'<line class="axis" x1="{_LEFT}" x2="{width - _RIGHT}" y1="{base}" y2="{base}"/>')
    clipped = 0
    for i, category in enumerate(categories):
        x0 = _LEFT + i * slot + slot * 0.1
        body.append(
            f'<text class="tick" x="{_n(_LEFT + (i + 0.5) * slot)}" y="{base + 15}" '
            f'text-anchor="middle">{escape(category)}</text>'
        )
        for j, (name, vs) in enumerate(groups):
            x = x0 + j * bar
            value = vs[i]
            if value is None:
                body.append(
                    f'<text class="none" x="{_n(x + bar / 2)}" y="{_n(zero - 3)}" text-anchor="middle">'
                    f"-<title>{escape(name)}, {escape(category)}: no data</title></text>"
                )
                continue
            shown = min(max(value, y_lo), y_hi)
            cut = shown != value
            clipped += cut
            y1, y2 = sorted((zero, sy(shown)))
            mark, note = (' class="cut"', " (off the axis)") if cut else ("", "")
            body.append(
                f'<rect{mark} x="{_n(x)}" y="{_n(y1)}" width="{_n(bar * 0.92)}" '
                f'height="{_n(max(y2 - y1, 0.5))}" fill="{colours[j]}"><title>{escape(name)}, '
                f"{escape(category)}: {fmt(value)}{note}</title></rect>"
            )
    body.append(
        f'<text class="axis-label" x="{_n((_LEFT + width - _RIGHT) / 2)}" y="{height - 4}" '
        f'text-anchor="middle">{escape(x_label)}</text>'
    )
    return _frame(title, width, height, body, axis.label), clipped


def stacked_bars(
    title: str,
    xs: Sequence[float],
    parts: Sequence[tuple[str, Sequence[float]]],
    *,
    y_label: str = "seconds",
    x_label: str = "step",
    width: int = 2 * WIDTH + 24,
    height: int = 320,
) -> str:
    """One bar per x, stacked from ``parts`` (label, a non-negative height per x) in order; each bar's
    tooltip lists its parts."""
    colours = [PART_COLOURS[i % len(PART_COLOURS)] for i in range(len(parts))]
    legend, legend_h = _legend([p for p, _ in parts], colours, width, _TOP - 4)
    top = _TOP + legend_h
    totals = [sum(hs[i] for _, hs in parts) for i in range(len(xs))]
    _, y_hi = _y_range([0.0, max(totals, default=1.0) or 1.0], Axis())
    sy = _Scale(0.0, y_hi, height - _BOTTOM, top)
    x_lo, x_hi = (min(xs) - 0.5, max(xs) + 0.5) if xs else (0.0, 1.0)
    sx = _Scale(x_lo, x_hi, _LEFT, width - _RIGHT)
    bar = (width - _RIGHT - _LEFT) / max(len(xs), 1) * 0.85
    body = [*legend, *_y_axis(sy, Axis(label=y_label), width)]
    body += _x_axis(sx, _step_ticks(min(xs, default=0.0), max(xs, default=1.0)), height, x_label)
    # One path per part (a subpath per bar) and one transparent column per bar for its tooltip: a
    # fifth of the bytes of a rectangle per part and bar.
    paths: list[list[str]] = [[] for _ in parts]
    hover = []
    bottoms = [0.0] * len(xs)
    for j, (_, hs) in enumerate(parts):
        for i, x in enumerate(xs):
            h = hs[i]
            if h <= 0:
                continue
            y_top, y_bottom = sy(bottoms[i] + h), sy(bottoms[i])
            bottoms[i] += h
            if y_bottom - y_top >= 0.2:  # thinner than a screen shows: its seconds are in the tooltip
                paths[j].append(
                    f"M{_n(sx(x) - bar / 2)} {_n(y_top)}h{_n(bar)}v{_n(y_bottom - y_top)}h-{_n(bar)}z"
                )
    for colour, d in zip(colours, paths, strict=True):
        if d:
            body.append(f'<path fill="{colour}" d="{"".join(d)}"/>')
    column = f'y="{_n(top)}" width="{_n(bar)}" height="{_n(height - _BOTTOM - top)}"'
    for i, x in enumerate(xs):
        tip = ", ".join(f"{p} {hs[i]:.3f}" for p, hs in parts if hs[i] >= 0.0005)
        hover.append(
            f'<rect x="{_n(sx(x) - bar / 2)}" {column}><title>step {fmt(x)}: {totals[i]:.3f} s '
            f"({escape(tip)})</title></rect>"
        )
    body.append(f'<g fill="transparent">{"".join(hover)}</g>')
    return _frame(title, width, height, body, y_label)


def calibration_chart(
    title: str,
    groups: Sequence[tuple[str, Sequence[tuple[float, float, str]]]],
    *,
    width: int = WIDTH,
    height: int = HEIGHT,
) -> str:
    """Mean return against mean value, one point per value decile (``(value, return, name)``), joined per
    group, with the diagonal where a calibrated critic's points lie."""
    colours = LINE_COLOURS[: len(groups)]
    labels = [g for g, _ in groups] + ["value = return"]
    legend, legend_h = _legend(labels, [*colours, "#999999"], width, _TOP - 4)
    top = _TOP + legend_h
    every = [c for _, pts in groups for v, r, _ in pts for c in (v, r)]
    lo, hi = _y_range(every, Axis())
    sx = _Scale(lo, hi, _LEFT, width - _RIGHT)
    sy = _Scale(lo, hi, height - _BOTTOM, top)
    body = [*legend, *_y_axis(sy, Axis(), width), *_x_axis(sx, nice_ticks(lo, hi), height, "mean value")]
    body.append(
        f'<line class="ref" x1="{_n(sx(lo))}" y1="{_n(sy(lo))}" x2="{_n(sx(hi))}" y2="{_n(sy(hi))}"/>'
    )
    for colour, (name, pts) in zip(colours, groups, strict=True):
        path = " ".join(f"{_n(sx(v))},{_n(sy(r))}" for v, r, _ in pts)
        if len(pts) > 1:
            body.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.4" points="{path}"/>')
        for v, r, decile in pts:
            body.append(
                f'<circle cx="{_n(sx(v))}" cy="{_n(sy(r))}" r="3.2" fill="{colour}"><title>{escape(name)}, '
                f"{escape(decile)}: value {fmt(v)}, return {fmt(r)}</title></circle>"
            )
    return _frame(title, width, height, body, "mean return")
