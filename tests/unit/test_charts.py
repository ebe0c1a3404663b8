"""The group page's charts, exact: rates from a running count, round value ticks,
whole-minute and whole-hour time ticks, gaps, OPEN spans shaded, escaping
(decision 0045)."""

from __future__ import annotations

import datetime as dt
import re

import pytest

pytest.importorskip("flask")

from pgq.web.charts import GAP, chart, rates, seconds_ticks, time_ticks, value_ticks
from pgq.web.timeline import timeline

NOW = dt.datetime(2026, 12, 1, 12, 0, 30, tzinfo=dt.timezone.utc)
MIN = dt.timedelta(minutes=1)


def minute(n: int) -> dt.datetime:
    """The start of the minute `n` minutes before NOW's."""
    return NOW.replace(second=0) - n * MIN


def test_rates_are_growth_per_second_at_the_later_sample_never_negative():
    done = [(minute(3), 100), (minute(2), 160), (minute(0), 160), (minute(0) + MIN, 40)]
    assert rates(done) == [(minute(2), 1.0), (minute(0), 0.0), (minute(0) + MIN, 0.0)]
    assert rates(done[:1]) == []


@pytest.mark.parametrize(
    "top, ticks",
    [
        (0.0, [0.0, 1.0]),
        (7.0, [0.0, 2.0, 4.0, 6.0, 8.0]),
        (10.0, [0.0, 2.5, 5.0, 7.5, 10.0]),
        (1_000_000.0, [0.0, 250_000.0, 500_000.0, 750_000.0, 1_000_000.0]),
        (0.3, [0.0, 0.1, 0.2, 0.30000000000000004]),
    ],
)
def test_value_ticks_are_round_from_zero_to_at_least_the_top(top, ticks):
    found = value_ticks(top)
    assert found == pytest.approx(ticks)
    assert found[-1] >= top


def test_time_ticks_fall_on_whole_minutes_for_an_hour_and_whole_hours_for_a_day():
    hour = time_ticks(NOW - dt.timedelta(hours=1), NOW)
    assert [t.strftime("%H:%M") for t in hour] == [
        "11:10",
        "11:20",
        "11:30",
        "11:40",
        "11:50",
        "12:00",
    ]
    day = time_ticks(NOW - dt.timedelta(days=1), NOW)
    assert {t.minute for t in day} == {0} and {t.hour % 4 for t in day} == {0}
    assert len(day) <= 7


def points(values: list[float], gap_after: int | None = None) -> list[tuple[dt.datetime, float]]:
    found = []
    for i, v in enumerate(values):
        at = minute(len(values) - i)
        if gap_after is not None and i > gap_after:
            at += MIN  # nothing: the points after the gap move by a minute more
        found.append((at, v))
    return found


def polylines(svg: str) -> list[list[tuple[float, float]]]:
    return [
        [tuple(map(float, p.split(","))) for p in m.group(1).split()]
        for m in re.finditer(r'<polyline class="line" points="([^"]*)"', svg)
    ]


def test_a_chart_has_both_axes_and_its_line_spans_the_plot():
    hour = NOW - dt.timedelta(hours=1)
    svg = chart(points([0, 5, 10]), start=hour, end=NOW, label="lag of g", width=900, height=150)
    assert 'aria-label="lag of g"' in svg and 'data-points="3"' in svg
    ticks = re.findall(r'<text class="tick"[^>]*>([^<]*)</text>', str(svg))
    assert ticks[:5] == ["0", "2.5", "5", "7.5", "10"]  # the value axis
    assert "11:10" in ticks and "12:00" in ticks  # the time axis
    [line] = polylines(str(svg))
    assert line[-1][1] == pytest.approx(8.0)  # 10 is the top of the plot
    assert line[0][1] == pytest.approx(128.0)  # 0 is its bottom


def test_a_gap_in_the_samples_breaks_the_line():
    assert GAP < 3 * 60
    gapped = points([1, 2, 3, 4, 5, 6], gap_after=2)
    gapped[3:] = [(at + 2 * MIN, v) for at, v in gapped[3:]]
    svg = chart(gapped, start=NOW - dt.timedelta(hours=1), end=NOW, label="x")
    assert [len(line) for line in polylines(str(svg))] == [3, 3]


def test_a_lone_sample_is_a_point():
    svg = chart([(minute(1), 3.0)], start=NOW - dt.timedelta(hours=1), end=NOW, label="x")
    assert '<circle class="point"' in svg and not polylines(str(svg))


def test_the_breakers_open_spans_are_shaded_from_the_timelines_spans():
    info = {
        "state": "CLOSED",
        "epoch": 2,
        "history": [
            {"epoch": 1, "state": "OPEN", "at": (NOW - 30 * MIN).isoformat(), "refunded": 0},
            {"epoch": 2, "state": "CLOSED", "at": (NOW - 15 * MIN).isoformat(), "refunded": 3},
        ],
        "probes": [],
    }
    strip = timeline(info, now=NOW, window=3600.0)
    shaded = [(s.start, s.end) for s in strip.spans if s.state == "OPEN"]
    svg = str(
        chart(points([1, 2]), start=strip.start, end=strip.end, shaded=shaded, label="x", width=900)
    )
    [(x, w)] = re.findall(r'<rect class="shade open" x="([\d.]+)" y="8" width="([\d.]+)"', svg)
    plot = 900 - 52 - 10
    assert float(x) == pytest.approx(52 + plot * 30 / 60, abs=0.1)
    assert float(w) == pytest.approx(plot * 15 / 60, abs=0.1)
    assert "breaker OPEN 11:30–11:45" in svg


def test_a_chart_of_a_day_stays_small():
    values = [float(i % 17) for i in range(1440)]
    day = [(NOW - dt.timedelta(minutes=1440 - i), v) for i, v in enumerate(values)]
    svg = chart(day, start=NOW - dt.timedelta(days=1), end=NOW, label="x")
    assert len(str(svg)) < 20_000, len(str(svg))


def test_a_charts_label_is_made_visible_and_escaped():
    svg = str(chart([], start=NOW - MIN, end=NOW, label='lag of <script>\u202e"'))
    assert "<script>" not in svg and "&lt;script&gt;" in svg and "\u202e" not in svg


@pytest.mark.parametrize(
    "top, ticks",
    [
        (0.0, [0.0, 1.0]),
        (3.0, [0.0, 1.0, 2.0, 3.0]),
        (25 * 60.0, [0.0, 600.0, 1200.0, 1800.0]),
        (3 * 3600.0, [0.0, 3600.0, 7200.0, 10800.0]),
    ],
)
def test_an_ages_ticks_are_whole_seconds_minutes_or_hours(top, ticks):
    assert seconds_ticks(top) == ticks
