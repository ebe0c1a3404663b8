"""The group page's breaker timeline: OPEN/CLOSED spans, probes and closes over time.

Built from `pgq.monitor.breaker_info` (history newest first, probes newest
first) and drawn as an SVG strip plus a list of events. Pure: the caller
passes the database's `now`, so the strip and its tests are exact.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from markupsafe import Markup

from pgq.cli.render import visible
from pgq.records import BreakerState

__all__ = ["UNREAD", "Event", "Span", "Timeline", "timeline"]

OUTCOME_CLASS = {"failed": "bad", "inconclusive": "meh", "succeeded": "good"}

WINDOWS = (60.0, 300.0, 900.0, 3600.0, 6 * 3600.0, 24 * 3600.0)
"""The spans a timeline may cover; `timeline` picks the smallest that shows the last
outage from its start (a five-second outage drawn over an hour is a dot)."""


UNREAD = "UNREAD"
"""The state of a span before the oldest transition read, when older ones were not read."""


@dataclass(frozen=True, slots=True)
class Span:
    state: str  # OPEN, CLOSED or UNREAD
    start: dt.datetime
    end: dt.datetime
    epoch: int | None


@dataclass(frozen=True, slots=True)
class Event:
    at: dt.datetime
    kind: str  # "open", "close" or "probe"
    epoch: int
    member: str | None
    outcome: str | None = None  # probes: failed, inconclusive, succeeded
    message_id: int | None = None
    refunded: int | None = None  # closes: rows the close's reconciliation refunded


@dataclass(frozen=True, slots=True)
class Timeline:
    start: dt.datetime
    end: dt.datetime
    spans: list[Span]
    events: list[Event]  # newest first, every one known (not only the window's)

    def svg(self, width: int = 900, height: int = 58) -> Markup:
        total = max((self.end - self.start).total_seconds(), 1e-9)

        def x(at: dt.datetime) -> float:
            clipped = min(max(at, self.start), self.end)
            return (clipped - self.start).total_seconds() / total * width

        parts = []
        for s in self.spans:
            x0, x1 = x(s.start), x(s.end)
            if x1 - x0 <= 0:
                continue
            if s.state == UNREAD:
                title = f"earlier transitions not read: {_hms(s.start)}–{_hms(s.end)}"
            else:
                title = f"{s.state} epoch {s.epoch if s.epoch is not None else '?'}: "
                title += f"{_hms(s.start)}–{_hms(s.end)}"
            parts.append(
                Markup(
                    '<rect class="span {cls}" x="{x:.1f}" y="4" width="{w:.1f}" height="22">'
                    "<title>{title}</title></rect>"
                ).format(cls=s.state.lower(), x=x0, w=x1 - x0, title=title)
            )
        for e in reversed(self.events):
            if not self.start <= e.at <= self.end:
                continue
            if e.kind == "probe":
                title = visible(f"probe {e.outcome} at {_hms(e.at)} by {e.member or '?'}")
                parts.append(
                    Markup(
                        '<circle class="probe {cls}" cx="{x:.1f}" cy="15" r="4">'
                        "<title>{title}</title></circle>"
                    ).format(cls=OUTCOME_CLASS.get(e.outcome or "", "meh"), x=x(e.at), title=title)
                )
            elif e.kind == "close":
                title = f"closed at {_hms(e.at)}, refunded {e.refunded}"
                parts.append(
                    Markup(
                        '<g class="close"><line x1="{x:.1f}" y1="2" x2="{x:.1f}" y2="30"/>'
                        '<text x="{x:.1f}" y="41" text-anchor="{a}">+{n}</text>'
                        "<title>{title}</title></g>"
                    ).format(
                        x=x(e.at),
                        a="end" if x(e.at) > width - 40 else "middle",
                        n=e.refunded or 0,
                        title=title,
                    )
                )
        for i in range(5):  # the time axis: five ticks, the last one "now"
            at = self.start + (self.end - self.start) * (i / 4)
            anchor = ("start", "middle", "middle", "middle", "end")[i]
            parts.append(
                Markup(
                    '<text class="tick" x="{x:.1f}" y="{y}" text-anchor="{a}">{t}</text>'
                ).format(x=x(at), y=height - 2, a=anchor, t="now" if i == 4 else _hms(at))
            )
        return Markup(
            '<svg class="timeline" role="img" viewBox="0 0 {w} {h}"'
            ' aria-label="breaker timeline">{body}</svg>'
        ).format(w=width, h=height, body=Markup("").join(parts))

    @property
    def window(self) -> float:
        return (self.end - self.start).total_seconds()


def _hms(at: dt.datetime) -> str:
    return at.astimezone(dt.timezone.utc).strftime("%H:%M:%S")


def _ts(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text)


def auto_window(history: Sequence[Mapping[str, Any]], now: dt.datetime) -> float:
    """The smallest of `WINDOWS` that holds the last OPEN transition with a margin of a
    fifth of the window before it; the largest when it is older (or an hour with no
    outage at all)."""
    opens = [_ts(h["at"]) for h in history if h["state"] == BreakerState.OPEN]
    if not opens:
        return 3600.0
    age = (now - max(opens)).total_seconds()
    return next((w for w in WINDOWS if age <= w * 0.8), WINDOWS[-1])


def timeline(
    info: Mapping[str, Any],
    *,
    now: dt.datetime,
    window: float | None = None,
    truncated: bool = False,
) -> Timeline:
    """The timeline of the last `window` seconds (`auto_window` when None) from a
    `breaker_info` object.

    Before the oldest transition listed the state is the other one (the
    breaker alternates); with no transition at all it is the current state.
    When `truncated` (the history read is only the newest transitions) and
    the oldest one listed is not the first, the time before it is `UNREAD`:
    drawn as the other state it would claim a breaker that flapped for hours
    had been steady (docs/defects.md).
    """
    history: Sequence[Mapping[str, Any]] = sorted(
        info.get("history", ()), key=lambda h: (h["epoch"], h["at"])
    )
    if window is None:
        window = auto_window(history, now)
    start = now - dt.timedelta(seconds=window)
    spans: list[Span] = []
    if history:
        first = history[0]
        opened = first["state"] == BreakerState.OPEN
        before = (BreakerState.CLOSED if opened else BreakerState.OPEN).value
        if truncated and first["epoch"] > 1:
            before = UNREAD
        spans.append(Span(before, start, _ts(first["at"]), first["epoch"] - 1))
    else:
        spans.append(Span(info["state"], start, now, info.get("epoch")))
    for i, h in enumerate(history):
        end = _ts(history[i + 1]["at"]) if i + 1 < len(history) else now
        spans.append(Span(h["state"], _ts(h["at"]), end, h["epoch"]))
    spans = [s for s in spans if s.end > start]
    events = [
        Event(
            at=_ts(h["at"]),
            kind="open" if h["state"] == BreakerState.OPEN else "close",
            epoch=h["epoch"],
            member=h.get("by_member"),
            refunded=int(h["refunded"]) if h["state"] == BreakerState.CLOSED else None,
        )
        for h in history
    ]
    events += [
        Event(
            at=_ts(p["at"]),
            kind="probe",
            epoch=p["epoch"],
            member=p.get("member"),
            outcome=p.get("outcome"),
            message_id=p.get("message_id"),
        )
        for p in info.get("probes", ())
    ]
    events.sort(key=lambda e: (e.at, e.kind != "open"), reverse=True)
    return Timeline(start=start, end=now, spans=spans, events=events)
