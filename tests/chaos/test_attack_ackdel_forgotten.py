"""Attack on the ack that deletes what it finishes (schema version 6): a member
forgotten while its session link is down goes on claiming and acking over its
work link, and the rows its acks delete are counted on no member row.

Member `a` runs with `--session-dsn` through a proxy of its own (liveness and
heartbeat) and `--dsn` through another (claims and acks). The session proxy
refuses and cuts: `a`'s session lock is gone and its heartbeat stops. Past
`breaker.member_retention` a new member `b` starts, and its first maintenance
round forgets `a` (departed, no session lock, no lease: the queue was empty).
Then 100 messages come: `a` claims and finishes them all (its summary says
done=110), but `member.done_total` has no row of `a` to count them on, so the
group's done count says 53 (the batches' kept rows). When the session link
returns, `a`'s heartbeat finds its row gone and it stops. Failed on `ackdel`
(7d4495d).
"""

from __future__ import annotations

import time
from pathlib import Path

from sqlalchemy import Engine

import pgq

from .procs import Members
from .proxy import Proxy

SETTINGS = {
    "PGQ_LEASE": "2.0",
    "PGQ_BREAKER_MEMBER_TTL": "1.0",
    "PGQ_BREAKER_MEMBER_RETENTION": "1.0",
}


def drained(engine: Engine, group: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while pgq.status(engine, group)["lag"] and time.monotonic() < deadline:
        time.sleep(0.2)


def test_attack_ackdel_a_member_forgotten_while_its_session_is_down_keeps_its_count(
    engine: Engine, pgq_env: dict[str, str], pg_dsn: str, out: Path
) -> None:
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = pgq.publish_many(engine, "t", [{"n": i} for i in range(10)])
    with Proxy.for_dsn(pg_dsn) as work, Proxy.for_dsn(pg_dsn) as session:
        settings = {**SETTINGS, "PGQ_SESSION_DSN": session.dsn(pg_dsn)}
        with Members(pgq_env, out, dsn=work.dsn(pg_dsn), settings=settings) as members:
            a = members.spawn("a", "g", workers=2)
            drained(engine, "g")
            session.refuse()
            session.cut()
            time.sleep(2.5)  # past member_retention
            with Members(pgq_env, out, settings=SETTINGS) as others:
                b = others.spawn("b", "g", until_empty=True)
                assert b.wait(60) == 0
            assert [m["name"] for m in pgq.status(engine, "g")["members"]] == ["b"]
            ids += pgq.publish_many(engine, "t", [{"n": i} for i in range(100)])
            drained(engine, "g")
            session.allow()
            a.wait(30)  # its heartbeat finds the row gone: it stops
    summary = a.summary()
    assert summary["done"] == str(len(ids))  # `a` finished every message
    assert pgq.status(engine, "g")["counts"]["done"] == len(ids)
