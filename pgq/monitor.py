"""What a group is doing: the functions behind `pgq status`, `members`, `breaker`, `dead`,
`check`, `show` and `audit`.

Plain typed functions a script can call as well as the CLI. Each returns plain
dicts and lists in exactly the shape the CLI prints with `--json` (DESIGN §7):
the public contract (`pgq.status(engine, g)["breaker"]["prober"]`). `read_status`,
`read_status_all` and `read_members` return the same reads as the frozen models
of `pgq.read_models`, whose `to_json()` those dicts are; the CLI's human output
and the dashboard use them.
timestamps are UTC ISO 8601 strings with `+00:00`, absent values are `None`.
Every function reads one consistent snapshot (one REPEATABLE READ transaction).

Member liveness needs the `breaker.member_ttl` setting; the library does not
read configuration, so the caller passes it (the CLI passes the loaded value)
and the default is the documented default.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, Engine

from pgq.breaker import pending_scope
from pgq.errors import UsageError
from pgq.read_models import (
    Counts,
    FrontierHolder,
    GroupBreaker,
    GroupStatus,
    MemberStatus,
    StatusAll,
    Totals,
    iso,
)
from pgq.records import BreakerState, LocalBreakerState, RowState
from pgq.settings import DEFAULTS
from pgq.store import admin, inspect

__all__ = [
    "CHECK_EXIT_CODES",
    "DEFAULT_AUDIT_LIMIT",
    "DEFAULT_HISTORY_LIMIT",
    "DEFAULT_MAX_AGE",
    "DEFAULT_MAX_REFUNDS",
    "DEFAULT_MEMBER_TTL",
    "DEFAULT_PROBE_LIMIT",
    "RECENTLY_DEPARTED",
    "audit",
    "breaker_info",
    "check",
    "check_and_split",
    "check_verdict",
    "dead",
    "dead_split",
    "frontier_held_by",
    "group_numbers",
    "iso",
    "live_members",
    "members",
    "message",
    "pending_scope",
    "read_members",
    "read_status",
    "read_status_all",
    "span",
    "status",
    "status_all",
]

DEFAULT_MEMBER_TTL: float = float(DEFAULTS["breaker_member_ttl"])
"""Seconds since its last heartbeat during which a member counts as live."""

RECENTLY_DEPARTED = 900.0
"""Seconds after it left or died during which `members` and `status` still list a
member by default (15 minutes); `departed_within=None` lists every one."""

DEFAULT_HISTORY_LIMIT = 20
"""Breaker transitions `breaker_info` returns by default."""

DEFAULT_PROBE_LIMIT = 20
"""Group probes `breaker_info` returns by default."""

DEFAULT_AUDIT_LIMIT = 20
"""Audit rows `audit` returns by default."""

DEFAULT_MAX_REFUNDS: int = int(DEFAULTS["breaker_max_refunds"])
"""Refunds after which a systemic row stays dead (`breaker.max_refunds`)."""

CHECK_EXIT_CODES: Mapping[str, int] = {"OK": 0, "WARNING": 1, "CRITICAL": 2, "UNKNOWN": 3}
"""`pgq check`'s Nagios exit code for each state word."""

DEFAULT_MAX_AGE: tuple[float, float | None] = (900.0, 3600.0)
"""`pgq check --max-age`: seconds the oldest row ready now may have been claimable
before the check is WARNING, and CRITICAL (15 min, 1 h)."""


def _member(row: Any) -> MemberStatus:
    return MemberStatus(
        name=row.name,
        live=bool(row.live),
        local_breaker=LocalBreakerState(row.local_breaker),
        last_seen=row.last_seen,
        host=row.host,
        pid=row.pid,
        started_at=row.started_at,
        left_at=row.left_at,
    )


def _breaker(row: Any, prober: str | None) -> GroupBreaker:
    state = BreakerState(row.breaker_state)
    is_open = state is BreakerState.OPEN
    return GroupBreaker(
        state=state,
        since=row.breaker_since,
        # only an open group has a prober; a name left behind after a close is stale
        prober=prober if is_open else None,
        epoch=int(row.breaker_epoch),
        next_probe_at=row.breaker_next_probe_at if is_open else None,
        # a close's refunds still owed: its dead rows are not all dead letters yet
        reconciling=row.breaker_reconcile_epoch is not None,
    )


def _holder(row: Any) -> FrontierHolder | None:
    if row is None:
        return None
    return FrontierHolder(
        pid=row.pid,
        age_s=round(max(float(row.age_s or 0.0), 0.0), 3),
        state=row.state,
        datname=row.datname,
        usename=row.usename,
        application_name=row.application_name,
    )


_ZERO_COUNTS: Mapping[str, int] = {
    "ready": 0,
    "leased": 0,
    "done": 0,
    "dead": 0,
    "dead_systemic": 0,
}


def _group(rows: inspect.GroupRows) -> GroupStatus:
    row, counts = rows.row, rows.counts
    c = {k: int(v) for k, v in (counts or _ZERO_COUNTS).items() if k in _ZERO_COUNTS}
    return GroupStatus(
        group=row.name,
        topic=row.topic,
        committed=row.committed_id,
        counts=Counts(
            ready=c["ready"],
            leased=c["leased"],
            done=c["done"] + int(row.done_pruned),
            dead=c["dead"],
            dead_systemic=c["dead_systemic"],
        ),
        totals=Totals(
            reclaimed=int(row.reclaimed_total),
            released=int(row.released_total),
            refunded=int(row.refunded_total),
        ),
        lag=c["ready"] + c["leased"],
        breaker=_breaker(row, rows.prober),
        members=tuple(_member(m) for m in rows.members),
        frontier_held_by=_holder(rows.holder),
        oldest_ready_age_s=_age(rows.oldest_ready_age_s),
    )


def _age(seconds: float | None) -> float | None:
    return None if seconds is None else round(max(seconds, 0.0), 3)


def read_status(
    engine: Engine,
    group: str,
    *,
    member_ttl: float = DEFAULT_MEMBER_TTL,
    departed_within: float | None = RECENTLY_DEPARTED,
) -> GroupStatus:
    """`status` of `group` as a typed `GroupStatus`; raises `UnknownGroup`."""
    return _group(inspect.group_status(engine, group, member_ttl, departed_within))


def status(
    engine: Engine,
    group: str,
    *,
    member_ttl: float = DEFAULT_MEMBER_TTL,
    departed_within: float | None = RECENTLY_DEPARTED,
) -> dict[str, Any]:
    """The `pgq status GROUP --json` object of `group`; raises `UnknownGroup`.

    Keys: group, topic, committed, counts {ready, leased, done, dead,
    dead_systemic}, totals {reclaimed, released, refunded}, lag, breaker
    {state, since, prober, epoch, next_probe_at, reconciling}, members (as
    `members` lists them), frontier_held_by (the backend with the oldest open transaction in the
    cluster, or None) and oldest_ready_age_s (seconds the oldest row ready now has
    been claimable, None when none is). `read_status` is the same as a typed `GroupStatus`.
    """
    return read_status(
        engine, group, member_ttl=member_ttl, departed_within=departed_within
    ).to_json()


def read_status_all(
    engine: Engine,
    *,
    member_ttl: float = DEFAULT_MEMBER_TTL,
    departed_within: float | None = RECENTLY_DEPARTED,
) -> StatusAll:
    """`status_all` as a typed `StatusAll`."""
    groups = inspect.all_group_status(engine, member_ttl, departed_within)
    return StatusAll(tuple(_group(rows) for rows in groups))


def status_all(
    engine: Engine,
    *,
    member_ttl: float = DEFAULT_MEMBER_TTL,
    departed_within: float | None = RECENTLY_DEPARTED,
) -> dict[str, Any]:
    """`{"groups": [...]}`: the `status` object of every group, by name."""
    return read_status_all(engine, member_ttl=member_ttl, departed_within=departed_within).to_json()


def read_members(
    engine: Engine,
    group: str,
    ttl: float = DEFAULT_MEMBER_TTL,
    *,
    departed_within: float | None = RECENTLY_DEPARTED,
) -> tuple[MemberStatus, ...]:
    """`members` as typed `MemberStatus` values; raises `UnknownGroup`."""
    return tuple(_member(m) for m in inspect.member_rows(engine, group, ttl, departed_within))


def members(
    engine: Engine,
    group: str,
    ttl: float = DEFAULT_MEMBER_TTL,
    *,
    departed_within: float | None = RECENTLY_DEPARTED,
) -> list[dict[str, Any]]:
    """Members of `group` by name; raises `UnknownGroup`.

    Each is `{"name", "live", "local_breaker", "last_seen", ...}`; `live` means a
    heartbeat within `ttl` seconds (database clock), not left, and its session
    still there. The live members and those that departed (left, or last heard
    from) within `departed_within` seconds; every member row when it is None
    (departed members are deleted after `breaker.member_retention`).
    `read_members` gives the same as typed `MemberStatus` values.
    """
    return [m.to_json() for m in read_members(engine, group, ttl, departed_within=departed_within)]


def breaker_info(
    engine: Engine,
    group: str,
    history_limit: int = DEFAULT_HISTORY_LIMIT,
    probe_limit: int = DEFAULT_PROBE_LIMIT,
) -> dict[str, Any]:
    """The breaker object of `group` plus `history` and `probes`; raises `UnknownGroup`.

    `{"state", "since", "prober", "epoch", "history": [{"epoch", "state", "at",
    "refunded"}, ...], "probes": [{"epoch", "at", "member", "message_id",
    "outcome"}, ...]}`, history newest first, at most `history_limit` entries;
    probes newest first, at most `probe_limit`: each group probe's OPEN epoch, when
    its outcome was written, the prober, the message it ran, and `outcome`
    `failed` (systemic), `inconclusive` (message, permanent, a snooze) or
    `succeeded` (plus its `error_class`). Read from one snapshot.
    """
    rows = inspect.breaker_rows(engine, group, history_limit, probe_limit)
    info = _breaker(rows.row, rows.prober).to_json()
    info["history"] = [
        {
            "epoch": h.epoch,
            "state": h.state,
            "at": iso(h.at),
            "refunded": int(h.refunded),
            "by_member": h.by_member,
        }
        for h in rows.history
    ]
    info["probes"] = [
        {
            "epoch": int(p.epoch),
            "at": iso(p.at),
            "member": p.member,
            "message_id": None if p.message_id is None else int(p.message_id),
            "outcome": p.outcome,
            "error_class": p.error_class,
        }
        for p in rows.probes
    ]
    return info


def dead(
    engine: Engine, group: str, limit: int = 100, *, error_class: str | None = None
) -> list[dict[str, Any]]:
    """Up to `limit` dead rows of `group` (only those of `error_class`, one of
    `systemic`, `message`, `permanent`, `lease`, when given), by message id;
    raises `UnknownGroup`, and `UsageError` for another class.

    Each is `{"message_id", "attempts", "reclaims", "refunds", "error_class",
    "error", "updated_at"}`.
    """
    if error_class is not None:
        admin.check_error_class(error_class)
    return [
        {
            "message_id": r.message_id,
            "attempts": r.attempts,
            "reclaims": r.reclaims,
            "refunds": r.refunds,
            "error_class": r.error_class,
            "error": r.error,
            "updated_at": iso(r.updated_at),
        }
        for r in inspect.dead_rows(engine, group, limit, error_class)
    ]


def frontier_held_by(engine: Engine) -> dict[str, Any] | None:
    """The backend with the oldest open transaction id in the cluster, or None.

    `{"pid", "age_s", "state", "datname", ...}`: while it stays open no group's
    frontier (and so no pruning) passes its transaction.
    """
    holder = _holder(inspect.frontier_holder(engine))
    return None if holder is None else holder.to_json()


# --- pgq check ------------------------------------------------------------------


def _dead_parts(dead: Mapping[str, int], pending: int) -> str:
    parts = [
        (dead["message"], "message"),
        (dead["permanent"], "permanent"),
        (dead["lease"], "lease"),
        (dead["systemic"], "systemic, not owed a refund"),
        (dead["capped"], "systemic, refund cap reached"),
    ]
    known = sum(n for n, _ in parts)
    parts.append((dead["dead"] - pending - known, "other"))
    return ", ".join(f"{n} {what}" for n, what in parts if n > 0)


def span(seconds: float) -> str:
    """A duration as `check` writes it: `3.2 s`, `15 min`, `1 min 35 s`, `2 h 1 min`,
    `1 d 1 h` (the two largest units, whole; tenths of a second under a minute)."""
    if seconds < 60:
        return f"{round(seconds, 1):g} s"
    units = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))
    whole = int(seconds)
    first = next(i for i, (_, size) in enumerate(units) if whole >= size)
    parts = []
    for unit, size in units[first : first + 2]:
        n, whole = divmod(whole, size)
        if n:
            parts.append(f"{n} {unit}")
    return " ".join(parts)


def live_members(live: int, tripped: int) -> str:
    """`live` members, `tripped` of them with their local breaker open, in words:
    `no live member`, `2 live members`, `1 live member, its local breaker open`,
    `3 live members, every local breaker open`, `3 live members, 1 with its local
    breaker open`."""
    if live == 0:
        return "no live member"
    text = f"{live} live member{'' if live == 1 else 's'}"
    if tripped >= live:
        return text + (", its local breaker open" if live == 1 else ", every local breaker open")
    if tripped:
        return text + f", {tripped} with its local breaker open"
    return text


def _stall(age: float | None, max_age: tuple[float, float | None]) -> tuple[str, float] | None:
    """The state word a wait of `age` seconds earns and the limit it passed, or None."""
    warn, crit = max_age
    if age is None:
        return None
    if crit is not None and age > crit:
        return "CRITICAL", crit
    if age > warn:
        return "WARNING", warn
    return None


def check_verdict(
    *,
    state: str,
    epoch: int,
    reconciling: bool,
    dead: Mapping[str, int],
    lag: int,
    committed: int | None,
    oldest_ready_age_s: float | None,
    live: int,
    tripped: int,
    max_age: tuple[float, float | None] = DEFAULT_MAX_AGE,
) -> tuple[str, str]:
    """The `pgq check` state word and line for a group's numbers (pure; see `check`).

    `dead` has the keys of `pgq.sql.admin.check_dead` (`dead`, `message`,
    `permanent`, `lease`, `systemic`, `capped`, `pending`, `pending_ready`);
    `reconciling` is true while a reconciliation is owed; `oldest_ready_age_s`
    the seconds the oldest row ready now has been claimable (None: none is);
    `live` the live members and `tripped` how many of them have their local
    breaker open; `max_age` the WARNING and CRITICAL limits of that wait (a
    CRITICAL of None: a stall is never worse than WARNING).
    """
    pending = dead["pending"]  # zero unless a reconciliation is coming or owed
    real = dead["dead"] - pending
    members = live_members(live, tripped)
    found: list[tuple[str, str]] = []  # (state word, what), the worst word wins
    if real > 0:
        found.append(("CRITICAL", f"{real} dead rows ({_dead_parts(dead, pending)})"))
    stall = _stall(oldest_ready_age_s, max_age)
    if stall is not None and oldest_ready_age_s is not None:
        waited, limit = span(oldest_ready_age_s), span(stall[1])
        what = f"oldest ready row claimable for {waited} (over {limit}), {members}"
        found.append((stall[0], what))
    if state == BreakerState.OPEN:
        found.append(("WARNING", f"breaker open, {pending} dead rows pending reconciliation"))
    elif reconciling:
        owed = pending + dead["pending_ready"]
        found.append(("WARNING", f"reconciliation in progress, {owed} rows to refund"))
    if found:
        word = max((w for w, _ in found), key=CHECK_EXIT_CODES.__getitem__)
        return word, f"{word}: " + "; ".join(what for _, what in found)
    return "OK", (
        f"OK: breaker {state} (epoch {epoch}), lag {lag},"
        f" committed {committed if committed is not None else 'none'}, no dead rows, {members}"
    )


def dead_split(
    engine: Engine, group: str, max_refunds: int = DEFAULT_MAX_REFUNDS
) -> dict[str, int]:
    """`{"dead", "pending", "real"}`: the dead rows of `group`, those a coming or owed
    reconciliation will refund (`pending`, as `check` counts them) and the rest
    (`real` dead letters). Raises like `check`."""
    return _split(inspect.check_rows(engine, group, max_refunds, DEFAULT_MEMBER_TTL).dead)


def _split(dead_row: Any) -> dict[str, int]:
    dead, pending = int(dead_row.dead), int(dead_row.pending)
    return {"dead": dead, "pending": pending, "real": dead - pending}


def check_and_split(
    engine: Engine,
    group: str,
    max_refunds: int = DEFAULT_MAX_REFUNDS,
    *,
    max_age: tuple[float, float | None] = DEFAULT_MAX_AGE,
    member_ttl: float = DEFAULT_MEMBER_TTL,
) -> tuple[str, str, dict[str, int]]:
    """`check` and `dead_split` of `group` from one read (the dashboard's group page)."""
    rows = inspect.check_rows(engine, group, max_refunds, member_ttl)
    return (*_verdict(rows, max_age), _split(rows.dead))


def group_numbers(
    conn: Connection, group: str, *, member_ttl: float, max_refunds: int
) -> tuple[GroupStatus, str]:
    """`read_status` and `check`'s state word of `group`, read on `conn` in its
    transaction: a running member's own connection (its metrics' group numbers,
    `pgq.consumer.numbers`), with the member's own settings."""
    status = _group(inspect.group_status_on(conn, group, member_ttl, RECENTLY_DEPARTED))
    rows = inspect.check_rows_on(conn, group, max_refunds, member_ttl)
    word, _ = _verdict(rows, DEFAULT_MAX_AGE)
    return status, word


def check(
    engine: Engine,
    group: str,
    max_refunds: int = DEFAULT_MAX_REFUNDS,
    *,
    max_age: tuple[float, float | None] = DEFAULT_MAX_AGE,
    member_ttl: float = DEFAULT_MEMBER_TTL,
) -> tuple[str, str]:
    """`pgq check GROUP`: the state word (`OK`, `WARNING`, `CRITICAL`) and the one line.

    While the group breaker is OPEN its dead systemic rows that the coming
    reconciliation will refund (fewer than `max_refunds` refunds, failed since
    the previous close) are not dead letters: WARNING `breaker open, N dead
    rows pending reconciliation`, also when N is 0. While a reconciliation is
    still owed after a close: WARNING `reconciliation in progress, N rows to
    refund` (those dead rows and the ready ones it owes), also when N is 0.
    Every other dead row is a real dead letter: CRITICAL; rows past the refund
    cap say `refund cap reached`, and systemic rows no reconciliation covers (a
    lone bad node's, an old outage's) count as real too.

    A stall is a state too: when the oldest row ready now (state ready,
    `available_at` passed) has been claimable longer than `max_age[0]` seconds
    it is WARNING, longer than `max_age[1]` CRITICAL (None: never), and the
    line says how many members are live (`member_ttl`) and how many of them
    have their local breaker open: a dead consumer, a cron entry that stopped
    running, a lone member whose local breaker is open. The worst state wins.
    Otherwise OK with lag, frontier, breaker and the live members.
    `CHECK_EXIT_CODES` maps the word to the Nagios exit code.

    Raises `UnknownGroup`, `DatabaseUnavailable`, `SchemaMissing`, ... like
    the other functions here; the CLI turns those into `UNKNOWN` (exit 3).
    """
    return _verdict(inspect.check_rows(engine, group, max_refunds, member_ttl), max_age)


def _verdict(rows: inspect.CheckRows, max_age: tuple[float, float | None]) -> tuple[str, str]:
    row = rows.row
    tripped = sum(1 for m in rows.live if m.local_breaker == LocalBreakerState.OPEN)
    return check_verdict(
        state=row.state,
        epoch=int(row.epoch),
        reconciling=row.reconcile_epoch is not None,
        dead={k: int(v) for k, v in rows.dead._asdict().items()},
        lag=int(row.ready) + int(row.leased),
        committed=row.committed_id,
        oldest_ready_age_s=rows.oldest_ready_age_s,
        live=len(rows.live),
        tripped=tripped,
        max_age=max_age,
    )


# --- pgq show and pgq audit -----------------------------------------------------


def _decoded(text: str | None, what: str = "message") -> tuple[Any, str | None]:
    """JSON text as a value, or (None, why) when Python's decoder cannot take it
    (jsonb nests far deeper than Python's decoder goes)."""
    if text is None:
        return None, None
    try:
        return json.loads(text), None
    except (RecursionError, ValueError) as exc:
        return None, f"the stored {what} cannot be decoded: {type(exc).__name__}"


def message(engine: Engine, group: str, message_id: int) -> dict[str, Any]:
    """`pgq show GROUP ID --json`: message `message_id` of `group` in full.

    `{"group", "topic", "message_id", "key", "dedupe_key", "payload", "headers", "created_at",
    "state", "attempts", "reclaims", "refundable_attempts",
    "refundable_reclaims", "refunds", "error_class", "error", "error_epoch",
    "lease_owner", "lease_expires_at", "available_at", "updated_at",
    "behind_frontier", "row", "purge", "unreadable"}`.

    `row` says what is left of the group's delivery row: `"present"`;
    `"pruned"` (no row, and behind the frontier or one the group had a row for —
    it started `earliest`, or the message came after it subscribed: a done row its
    ack or the frontier deleted, so `state` is `done` and the row's own fields are
    None); `"purged"` (no row,
    and a `pgq purge` audit row lists the id: `state` is `purged` and `purge`
    names that audit row). `unreadable` says why `payload`/`headers` are None
    when they are stored but too deeply nested to decode. Raises `UsageError`
    when the group never had the message (no such id, another topic's, gone
    to retention, or no row ahead of the frontier) or for an id outside
    `1..2**63-1`, and `UnknownGroup`. A message published before a group
    subscribed with `start="latest"` and behind its frontier cannot be told
    from a pruned one: it shows as done.
    """
    row = admin.message_row(engine, group, message_id)
    finished = row is not None and (row.behind_frontier or bool(row.published_after))
    if row is None or not (row.has_row or row.purge_audit_id is not None or finished):
        raise UsageError(f"group {group!r} has no message {message_id}")
    payload, bad_payload = _decoded(row.payload)
    headers, bad_headers = _decoded(row.headers)
    if row.has_row:
        left, state = "present", row.state
    elif row.purge_audit_id is not None:
        left, state = "purged", "purged"
    else:
        left, state = "pruned", RowState.DONE.value
    purge = None
    if left == "purged":
        purge = {
            "audit_id": row.purge_audit_id,
            "at": iso(row.purged_at),
            "actor": row.purged_by,
            "reason": row.purge_reason,
        }
    return {
        "group": group,
        "topic": row.topic,
        "message_id": row.id,
        "key": row.key,
        "dedupe_key": row.dedupe_key,
        "payload": payload,
        "headers": headers,
        "created_at": iso(row.created_at),
        "state": state,
        "attempts": row.attempts,
        "reclaims": row.reclaims,
        "refundable_attempts": row.refundable_attempts,
        "refundable_reclaims": row.refundable_reclaims,
        "refunds": row.refunds,
        "error_class": row.error_class,
        "error": row.last_error,
        "error_epoch": row.error_epoch,
        "lease_owner": row.lease_owner,
        "lease_expires_at": iso(row.lease_expires_at),
        "available_at": iso(row.available_at),
        "updated_at": iso(row.updated_at),
        "behind_frontier": bool(row.behind_frontier),
        "row": left,
        "purge": purge,
        "unreadable": bad_payload or bad_headers,
    }


def audit(
    engine: Engine,
    group: str | None,
    limit: int = DEFAULT_AUDIT_LIMIT,
    *,
    topic: str | None = None,
) -> list[dict[str, Any]]:
    """`pgq audit GROUP --json`: the newest `limit` audit rows of `group`, newest first
    (`pgq audit --topic T`: with `group` None and `topic`, every row about the topic
    and its groups).

    Each is `{"id", "at", "action", "count", "message_ids", "reason", "actor",
    "role", "group", "topic", "unreadable"}`: `action` is `requeue`, `purge`,
    `unsubscribe` or `delete-topic`, `count` the rows it changed, `message_ids` at
    most 10,000 of them (the smallest), `actor` who ran it as the client said
    (`user@host`), `role` the database role that wrote the row (None in rows
    written before schema version 5). The trail of a group `pgq unsubscribe`
    removed is still read by its name. `message_ids` is whatever JSON the row
    holds (a role that may insert audit rows can write any): None with
    `unreadable` saying why when Python's decoder cannot take it. Raises
    `UnknownGroup` (`UnknownTopic`), and `UsageError` for a limit outside
    `0..2**31-1`.
    """
    trail = []
    for r in admin.audit_rows(engine, group, limit, topic=topic):
        ids, unreadable = _decoded(r.message_ids, "message_ids")
        trail.append(
            {
                "id": r.id,
                "at": iso(r.at),
                "action": r.action,
                "count": int(r._mapping["count"]),  # `r.count` is the tuple method
                "message_ids": ids,
                "reason": r.reason,
                "actor": r.actor,
                "role": r.role,
                "group": r.group_name,
                "topic": r.topic,
                "unreadable": unreadable,
            }
        )
    return trail
