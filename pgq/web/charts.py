"""Charts drawn on the server as inline SVG: no script, no inline style, no network.

A sparkline (the overview) is a polyline over the points given, scaled to its
own maximum, with the window's start and end fixed so that charts of different
groups line up. A chart (the group page) is the same with axes: time ticks on
whole minutes or hours, value ticks on round numbers from zero, and the
breaker's OPEN spans shaded behind the line; a gap in the samples (nobody
sampled: no member ran and no dashboard watched) breaks the line rather than
drawing a slope across it. Either way a few pixels hold their lowest and
highest point only, so the size does not grow with the samples held. The SVG
is numbers the server computed, and labels made `visible` and escaped.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
from collections.abc import Callable, Sequence

from markupsafe import Markup

from pgq.cli.render import visible

__all__ = ["chart", "rates", "seconds_ticks", "sparkline", "time_ticks", "value_ticks"]


def sparkline(
    points: Sequence[tuple[float, float]],
    *,
    start: float,
    end: float,
    width: int = 160,
    height: int = 32,
    label: str,
) -> Markup:
    """`points` (at, value) between `start` and `end` as an SVG polyline.

    `label` is the accessible name; it may hold a group's name, so it is made
    `visible` (control and format characters escaped) and escaped.
    """
    label = visible(label)
    span = max(end - start, 1e-9)
    top = max((v for _, v in points), default=0.0) or 1.0
    pad = 2
    xy = []
    for at, value in points:
        x = pad + (min(max(at, start), end) - start) / span * (width - 2 * pad)
        xy.append((x, height - pad - value / top * (height - 2 * pad)))
    coords = [f"{x:.1f},{y:.1f}" for x, y in _columns(xy)]
    if len(coords) > 1:
        line = (
            f'<polyline points="{" ".join(coords)}" fill="none" stroke="currentColor"'
            ' stroke-width="1.5"/>'
        )
    else:  # one sample (a minute's): a point, not nothing
        line = "".join(
            f'<circle cx="{c.split(",")[0]}" cy="{c.split(",")[1]}" r="1.5"/>' for c in coords
        )
    return Markup(
        '<svg class="spark" role="img" width="{w}" height="{h}" viewBox="0 0 {w} {h}"'
        ' aria-label="{label}"><title>{label}</title>'
        '<line x1="0" y1="{base}" x2="{w}" y2="{base}" class="axis"/>{line}</svg>'
    ).format(w=width, h=height, base=height - pad, label=label, line=Markup(line))


COLUMN = 4
"""Pixels a sparkline spends on its lowest and highest point (an hour of samples is
720 points on 160 pixels: the overview of 500 groups was 7.8 MB a refresh;
docs/defects.md)."""


def _columns(xy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """`xy` (in time order) with at most two points per `COLUMN` pixels: the lowest
    and the highest, in their order, so that dips and peaks both stay drawn."""
    kept: list[tuple[float, float]] = []
    for _, column in itertools.groupby(xy, key=lambda p: int(p[0] // COLUMN)):
        run = list(column)
        low = min(run, key=lambda p: p[1])
        high = max(run, key=lambda p: p[1])
        kept.extend(sorted({low, high}, key=run.index))
    return kept


GAP = 150.0
"""Seconds between two samples past which the line breaks (samples come once a
minute: two missing minutes and a half is nobody sampling)."""

STEPS = (60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 14400, 21600, 43200, 86400)
"""Seconds a time tick may be apart: whole minutes and hours."""


def rates(points: Sequence[tuple[dt.datetime, int]]) -> list[tuple[dt.datetime, float]]:
    """(at, per second) of a running count `points` (time order) between
    consecutive samples, at the later one; a count that went down (never, for
    `done`) counts as no growth."""
    found = []
    for (a, x), (b, y) in itertools.pairwise(points):
        seconds = (b - a).total_seconds()
        if seconds > 0:
            found.append((b, max(y - x, 0) / seconds))
    return found


def value_ticks(top: float, count: int = 4) -> list[float]:
    """Round values from 0 to at least `top`, about `count` steps (1, 2, 2.5 or 5 times
    a power of ten each): the last is the axis' top."""
    if top <= 0 or not math.isfinite(top):
        return [0.0, 1.0]
    raw = top / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    n = math.ceil(top / step - 1e-9)
    return [i * step for i in range(n + 1)]


SECOND_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 43200)
"""Seconds a value tick of a duration may be apart: whole seconds, minutes, hours."""


def seconds_ticks(top: float, count: int = 4) -> list[float]:
    """`value_ticks` for durations in seconds: steps of `SECOND_STEPS` (a 25-minute
    age is 0, 10, 20, 30 min, not 0, 6.25, 12.5, ...)."""
    if top <= 0 or not math.isfinite(top):
        return [0.0, 1.0]
    step = next((s for s in SECOND_STEPS if top / s <= count), None)
    if step is None:
        return [t * 86400 for t in value_ticks(top / 86400, count)]
    return [float(i * step) for i in range(math.ceil(top / step - 1e-9) + 1)]


def time_ticks(start: dt.datetime, end: dt.datetime, count: int = 6) -> list[dt.datetime]:
    """Times between `start` and `end` on whole steps (`STEPS`) of UTC, at most
    `count` + 1 of them."""
    seconds = (end - start).total_seconds()
    step = next((s for s in STEPS if seconds / s <= count), STEPS[-1])
    epoch = start.timestamp()
    first = math.ceil(epoch / step) * step
    ticks = []
    at = first
    while at <= end.timestamp():
        ticks.append(dt.datetime.fromtimestamp(at, tz=dt.timezone.utc))
        at += step
    return ticks


def compact(value: float) -> str:
    """`1234` -> `1.2k`, `0.25` -> `0.25`, `3000000` -> `3M`."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}"


def seconds_label(value: float) -> str:
    """`90` -> `1.5 min`, `7200` -> `2 h`, `30` -> `30 s`."""
    if value >= 3600:
        return f"{value / 3600:.3g} h"
    if value >= 60:
        return f"{value / 60:.3g} min"
    return f"{value:.3g} s"


def chart(
    points: Sequence[tuple[dt.datetime, float]],
    *,
    start: dt.datetime,
    end: dt.datetime,
    shaded: Sequence[tuple[dt.datetime, dt.datetime]] = (),
    label: str,
    unit: Callable[[float], str] = compact,
    ticks: Callable[[float], list[float]] = value_ticks,
    width: int = 600,
    height: int = 180,
) -> Markup:
    """`points` (at, value; time order) between `start` and `end` as an SVG line chart
    with a time axis (UTC) and a value axis from zero, each span of `shaded`
    (the breaker's OPEN spans) drawn as a band behind the line. `label` names the
    chart (it may hold a group's name: made `visible` and escaped); `unit` writes
    a value axis tick, `ticks` chooses them (`seconds_ticks` for durations)."""
    label = visible(label)
    left, right, top_pad, bottom = 52, 10, 8, 22
    plot_w, plot_h = width - left - right, height - top_pad - bottom
    total = max((end - start).total_seconds(), 1e-9)
    marks = ticks(max((v for _, v in points), default=0.0))
    top = marks[-1]

    def x(at: dt.datetime) -> float:
        clipped = min(max(at, start), end)
        return left + (clipped - start).total_seconds() / total * plot_w

    def y(value: float) -> float:
        return top_pad + plot_h - value / top * plot_h

    parts: list[Markup] = []
    for a, b in shaded:
        x0, x1 = x(a), x(b)
        if x1 - x0 > 0:
            parts.append(
                Markup(
                    '<rect class="shade open" x="{x:.1f}" y="{y}" width="{w:.1f}" height="{h}">'
                    "<title>breaker OPEN {a}–{b}</title></rect>"
                ).format(x=x0, y=top_pad, w=max(x1 - x0, 1.0), h=plot_h, a=_hm(a), b=_hm(b))
            )
    for value in marks:
        parts.append(
            Markup(
                '<line class="grid" x1="{l}" y1="{y:.1f}" x2="{r}" y2="{y:.1f}"/>'
                '<text class="tick" x="{tx}" y="{ty:.1f}" text-anchor="end">{t}</text>'
            ).format(
                l=left, r=width - right, y=y(value), tx=left - 4, ty=y(value) + 3, t=unit(value)
            )
        )
    for at in time_ticks(start, end):
        parts.append(
            Markup(
                '<line class="grid" x1="{x:.1f}" y1="{t}" x2="{x:.1f}" y2="{b}"/>'
                '<text class="tick" x="{x:.1f}" y="{ty}" text-anchor="middle">{label}</text>'
            ).format(x=x(at), t=top_pad, b=top_pad + plot_h, ty=height - 6, label=_hm(at))
        )
    parts.append(
        Markup('<line class="axis" x1="{l}" y1="{b}" x2="{r}" y2="{b}"/>').format(
            l=left, r=width - right, b=top_pad + plot_h
        )
    )
    for run in _runs(points):
        xy = _columns([(x(at), y(v)) for at, v in run])
        if len(xy) == 1:
            parts.append(
                Markup('<circle class="point" cx="{0:.1f}" cy="{1:.1f}" r="2"/>').format(*xy[0])
            )
        else:
            coords = " ".join(f"{px:.1f},{py:.1f}" for px, py in xy)
            parts.append(Markup('<polyline class="line" points="{0}"/>').format(coords))
    return Markup(
        '<svg class="chart" role="img" viewBox="0 0 {w} {h}" aria-label="{label}"'
        ' data-points="{n}"><title>{label}</title>{body}</svg>'
    ).format(w=width, h=height, label=label, n=len(points), body=Markup("").join(parts))


def _runs(
    points: Sequence[tuple[dt.datetime, float]],
) -> list[list[tuple[dt.datetime, float]]]:
    """`points` cut where two are more than `GAP` seconds apart."""
    runs: list[list[tuple[dt.datetime, float]]] = []
    for point in points:
        if runs and (point[0] - runs[-1][-1][0]).total_seconds() <= GAP:
            runs[-1].append(point)
        else:
            runs.append([point])
    return runs


def _hm(at: dt.datetime) -> str:
    return at.astimezone(dt.timezone.utc).strftime("%H:%M")
