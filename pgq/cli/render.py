"""Human output: the lines `status`, `members`, `breaker`, `dead`, `show` and `server status` print.

Each renderer takes exactly the data the command prints with `--json` (the
typed read models of `pgq.read_models` for `status` and `members`, the
`pgq.monitor` dicts for the others, DESIGN §7) and returns lines; it neither reads the
database nor prints. `pgq.cli.base.emit` chooses between the JSON document and
these lines, so both always come from the same data. Times show relative to
`now`, the database's clock the command passes ("3 s ago", "in 5 s"), with the
absolute time where there is room; an open breaker stands out as `OPEN !`.

Text in that data came from users, handlers and other clients (member names,
error texts, names an older version accepted): every line a renderer returns
shows it through `visible`, so no output can move the cursor, set the
terminal's title or forge a line, whether or not stdout is a terminal. JSON
needs nothing: `json.dumps` escapes every control and non-ASCII character.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ParamSpec

from pgq.monitor import span
from pgq.read_models import FrontierHolder, GroupStatus, MemberStatus, StatusAll, iso
from pgq.records import BreakerState

__all__ = [
    "ago",
    "breaker_lines",
    "breaker_word",
    "dead_lines",
    "members_lines",
    "message_lines",
    "one_line",
    "server_status_lines",
    "status_all_lines",
    "status_lines",
    "table",
    "visible",
]

P = ParamSpec("P")


def visible(text: str) -> str:
    """`text` with every character that is not printable (`str.isprintable`: control,
    format and separator characters other than the space) escaped as Python writes
    it: `\\n`, `\\x1b`, `\\u202e`. Printable text, member names included, is unchanged;
    a backslash is not doubled, so escaping twice changes nothing."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _visible_lines(render: Callable[P, list[str]]) -> Callable[P, list[str]]:
    """Every line `render` returns, through `visible` (see the module docstring)."""

    @functools.wraps(render)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> list[str]:
        return [visible(line) for line in render(*args, **kwargs)]

    return wrapper


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """Left-aligned columns two spaces apart; `None` shows as `-`, booleans as yes/no."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [list(headers), *cells]
    ]


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return visible(str(value))  # escaped before the widths are measured


def ago(ts: dt.datetime | str | None, now: dt.datetime) -> str | None:
    """The time `ts` (a datetime or its ISO 8601 text) relative to `now`: `"3 s ago"`,
    `"5 min ago"`, `"2 h ago"`, `"3 d ago"`, or `"in 4 s"` for a time to come (whole
    units, rounded down)."""
    if ts is None:
        return None
    when = dt.datetime.fromisoformat(ts) if isinstance(ts, str) else ts
    seconds = (now - when).total_seconds()
    span = abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if span >= size:
            text = f"{int(span // size)} {unit}"
            break
    else:
        text = f"{int(span)} s"
    return f"in {text}" if seconds < 0 else f"{text} ago"


def _at(ts: dt.datetime | str | None, now: dt.datetime) -> str:
    """`ts` relative to `now`, then in ISO 8601: `"3 s ago (2026-11-29T20:00:00+00:00)"`."""
    if ts is None:
        return "-"
    return f"{ago(ts, now)} ({ts if isinstance(ts, str) else iso(ts)})"


def breaker_word(state: str) -> str:
    """A breaker state as the human output shows it: an open one (group `OPEN` or
    local `open`) as `OPEN !`, so it stands out without colour; others as they are."""
    return f"{BreakerState.OPEN} !" if state.upper() == BreakerState.OPEN else state


def one_line(text: str | None, width: int = 80) -> str | None:
    """`text` with its whitespace collapsed and the rest made `visible`, cut to
    `width` characters with an ellipsis."""
    if text is None:
        return None
    flat = visible(" ".join(text.split()))
    return flat if len(flat) <= width else flat[: width - 1] + "…"


@_visible_lines
def members_lines(members: Sequence[MemberStatus], *, now: dt.datetime) -> list[str]:
    """`pgq members`: one row per member, its times relative to `now`."""
    if not members:
        return ["no members"]
    return table(
        ("NAME", "LIVE", "LOCAL_BREAKER", "LAST_SEEN", "LEFT"),
        (
            (
                m.name,
                m.live,
                breaker_word(m.local_breaker),
                ago(m.last_seen, now),
                ago(m.left_at, now),
            )
            for m in members
        ),
    )


def _holder_line(holder: FrontierHolder | None) -> list[str]:
    # a publisher's transaction holds the frontier for milliseconds: not worth a line
    if holder is None or holder.age_s < 1:
        return []
    return [
        f"frontier held by pid {holder.pid}: transaction open {holder.age_s:.0f}s,"
        f" {holder.state}, database {holder.datname}"
    ]


def _members_count(s: GroupStatus) -> str:
    """`1 live of 2`: members that left cleanly are not counted, but said (`, 3 left`)."""
    text = f"{s.live} live of {len(s.members) - s.left}"
    return text + (f", {s.left} left" if s.left else "")


@_visible_lines
def status_lines(s: GroupStatus, *, now: dt.datetime) -> list[str]:
    """`pgq status GROUP`: frontier, lag, counts, totals, breaker and members; first,
    when nobody can make progress on the rows ready now, `stalled:` and why."""
    c, tot, b = s.counts, s.totals, s.breaker
    breaker = f"{breaker_word(b.state)} since {_at(b.since, now)}, epoch {b.epoch}"
    if b.prober:
        breaker += f", prober {b.prober}"
    oldest = s.oldest_ready_age_s
    lines = [
        f"group {s.group} on topic {s.topic}",
        *([f"  stalled: {s.stalled}"] if s.stalled else []),
        f"  committed  {_cell(s.committed)}",
        f"  lag        {s.lag}",
        *([f"  oldest     ready row claimable for {span(oldest)}"] if oldest is not None else []),
        f"  counts     ready {c.ready}  leased {c.leased}  done {c.done}"
        f"  dead {c.dead} (systemic {c.dead_systemic})",
        f"  totals     reclaimed {tot.reclaimed}  released {tot.released}  refunded {tot.refunded}",
        f"  breaker    {breaker}",
        f"  members    {_members_count(s)}",
    ]
    if s.members:
        lines += ["    " + line for line in members_lines(s.members, now=now)]
    return lines + ["  " + line for line in _holder_line(s.frontier_held_by)]


@_visible_lines
def status_all_lines(data: StatusAll) -> list[str]:
    """`pgq status`: one row per group, then a line for each stalled group."""
    groups = data.groups
    if not groups:
        return ["no groups"]
    lines = table(
        (
            "GROUP",
            "TOPIC",
            "COMMITTED",
            "LAG",
            "READY",
            "LEASED",
            "DONE",
            "DEAD",
            "BREAKER",
            "LIVE",
        ),
        (
            (
                g.group,
                g.topic,
                g.committed,
                g.lag,
                g.counts.ready,
                g.counts.leased,
                g.counts.done,
                g.counts.dead,
                breaker_word(g.breaker.state),
                g.live,
            )
            for g in groups
        ),
    )
    stalled = [f"{g.group} stalled: {g.stalled}" for g in groups if g.stalled]
    return lines + stalled + _holder_line(groups[0].frontier_held_by)


BREAKER_PROBES_SHOWN = 5
"""The newest probes `pgq breaker GROUP` shows (`--json` has every one it read)."""


@_visible_lines
def breaker_lines(b: dict[str, Any], *, now: dt.datetime) -> list[str]:
    """`pgq breaker GROUP`: state, since, epoch, prober, the history table, then the
    newest probes."""
    lines = [
        f"state   {breaker_word(b['state'])}",
        f"since   {_at(b['since'], now)}",
        f"epoch   {b['epoch']}",
        f"prober  {_cell(b['prober'])}",
    ]
    if b.get("next_probe_at"):
        lines.append(f"next probe  {_at(b['next_probe_at'], now)}")
    if not b["history"]:
        lines.append("history: none")
    else:
        history = table(
            ("EPOCH", "STATE", "AT", "REFUNDED"),
            (
                (h["epoch"], breaker_word(h["state"]), ago(h["at"], now), h["refunded"])
                for h in b["history"]
            ),
        )
        lines += ["history:", *("  " + line for line in history)]
    probes = b.get("probes")
    if probes is None:
        return lines
    if not probes:
        return [*lines, "probes: none"]
    shown = table(
        ("EPOCH", "OUTCOME", "AT", "MEMBER", "MESSAGE_ID", "CLASS"),
        (
            (
                p["epoch"],
                p["outcome"],
                ago(p["at"], now),
                p["member"],
                p["message_id"],
                p.get("error_class"),
            )
            for p in probes[:BREAKER_PROBES_SHOWN]
        ),
    )
    return [*lines, "probes (newest first):", *("  " + line for line in shown)]


@_visible_lines
def dead_lines(rows: list[dict[str, Any]], *, now: dt.datetime) -> list[str]:
    """`pgq dead GROUP`: one row per dead message, its error cut to one line."""
    if not rows:
        return ["no dead rows"]
    return table(
        ("MESSAGE_ID", "CLASS", "ATTEMPTS", "RECLAIMS", "REFUNDS", "UPDATED", "ERROR"),
        (
            (
                r["message_id"],
                r["error_class"],
                r["attempts"],
                r["reclaims"],
                r["refunds"],
                ago(r["updated_at"], now),
                one_line(r["error"]),
            )
            for r in rows
        ),
    )


@_visible_lines
def server_status_lines(d: dict[str, Any]) -> list[str]:
    """`pgq server status`: running (pid, dsn, data directory) or not."""
    if not d["running"]:
        what = f"not ready, pid {d['pid']}" if d["pid"] else "not running"
        return [f"{what} (data in {d['data_dir']})"]
    return [f"running, pid {d['pid']}", f"dsn   {d['dsn']}", f"data  {d['data_dir']}"]


def _json_text(value: Any) -> str:
    return visible(json.dumps(value, ensure_ascii=False))


def message_lines(m: dict[str, Any]) -> list[str]:
    """`pgq show GROUP ID`: one `name  value` line per field."""
    state = m["state"]
    if m["row"] == "pruned" and m["behind_frontier"]:
        state += " (row pruned behind the frontier: its counters are gone)"
    elif m["row"] == "pruned":
        state += " (row deleted by its ack: its counters are gone)"
    elif m["row"] == "purged":
        p = m["purge"]
        state += f" (audit {p['audit_id']}, {p['at']}, by {p['actor']}: {one_line(p['reason'])})"
    lease = "-"
    if m["lease_owner"] is not None:
        lease = f"{m['lease_owner']} until {m['lease_expires_at'] or '-'}"
    fields: list[tuple[str, object]] = [
        ("message", m["message_id"]),
        ("group", f"{m['group']} (topic {m['topic']})"),
        ("state", state),
        ("behind frontier", m["behind_frontier"]),
        ("key", m["key"]),
        ("dedupe_key", m["dedupe_key"]),
        ("created_at", m["created_at"]),
        ("available_at", m["available_at"]),
        ("updated_at", m["updated_at"]),
        ("attempts", m["attempts"]),
        ("reclaims", m["reclaims"]),
        ("refundable", _refundable(m)),
        ("refunds", m["refunds"]),
        ("error_class", m["error_class"]),
        ("error_epoch", m["error_epoch"]),
        ("error", m["error"]),
        ("lease", lease),
        ("headers", None if m["headers"] is None else _json_text(m["headers"])),
        (
            "payload",
            m["unreadable"]
            if m["payload"] is None and m["unreadable"]
            else _json_text(m["payload"]),
        ),
    ]
    width = max(len(name) for name, _ in fields)
    return [f"{name.ljust(width)}  {_value(value)}" for name, value in fields]


def _refundable(m: dict[str, Any]) -> str | None:
    if m["refundable_attempts"] is None:
        return None
    return f"attempts {m['refundable_attempts']}, reclaims {m['refundable_reclaims']}"


def _value(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return visible(str(value))
