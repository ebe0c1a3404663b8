"""Small charts drawn on the server as inline SVG: no script, no network.

A sparkline is a polyline over the points given, scaled to its own maximum,
with the window's start and end fixed so that charts of different groups line
up; a few pixels hold their lowest and highest point only, so its size does
not grow with the samples held. The SVG is numbers the server computed, and a
label made `visible` and escaped.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from markupsafe import Markup

from pgq.cli.render import visible

__all__ = ["sparkline"]


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
    line = (
        f'<polyline points="{" ".join(coords)}" fill="none" stroke="currentColor"'
        ' stroke-width="1.5"/>'
        if len(coords) > 1
        else ""
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
