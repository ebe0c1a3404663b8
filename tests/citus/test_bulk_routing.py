"""The messages page and its bulk actions on Citus (decisions 0041, 0023): a page,
its count and a requeue or purge of a filter each touch one group's delivery rows
and one topic's messages, so each statement is one task: on the topic's shard of
`message`, or on the group's shard of `delivery` (the two are not co-located: a
join of them is a repartition join, refused outright).

Every statement runs on an engine whose connections set
`citus.multi_task_query_log_level = error` (libpq `options`): a statement Citus
would split into several tasks fails instead of running.

Needs `PGQ_CITUS_DSN` (see test_placement.py); skipped without it.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import replace

import psycopg
import pytest
from helpers import CITUS_DSN, STRICT_CITUS_DSN, citus_marks, kill, rows
from psycopg import sql
from sqlalchemy import Engine, text

import pgq
from pgq import monitor
from pgq.records import MessageFilter
from pgq.store import admin
from pgq.store.messages import find, fix_matching

pytestmark = citus_marks()

N = 60


@contextlib.contextmanager
def cluster() -> Iterator[tuple[Engine, Engine, list[int]]]:
    """A distributed schema with topic `t`, groups `g` and `h` (so `g`'s rows are
    not the only ones) and `N` messages, key `k<i mod 3>`, payload `{"i": i}`,
    dedupe key `d<i>`; the rows dead but for every fifth (in both groups). Yields an engine, a
    strict one on the same schema, and the ids."""
    schema = f"pgq_bulk_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    engine = pgq.connect(CITUS_DSN, schema=schema, pool_size=2)
    strict = pgq.connect(STRICT_CITUS_DSN, schema=schema, pool_size=2)
    try:
        pgq.migrate(engine, distributed=True)
        pgq.create_topic(engine, "t")
        pgq.subscribe(engine, "g", "t")
        pgq.subscribe(engine, "h", "t")
        ids = [
            pgq.publish(engine, "t", {"i": i}, key=f"k{i % 3}", dedupe_key=f"d{i}")
            for i in range(N)
        ]
        kill(engine, [m for i, m in enumerate(ids) if i % 5], "message", last_error="boom")
        with strict.connect() as conn:
            assert conn.scalar(text("SHOW citus.multi_task_query_log_level")) == "error"
        yield engine, strict, ids
    finally:
        strict.dispose()
        engine.dispose()
        with psycopg.connect(CITUS_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def dead_of(ids: list[int], key: int) -> list[int]:
    return [m for i, m in enumerate(ids) if i % 5 and i % 3 == key]


@pytest.mark.parametrize(
    "f",
    [
        pytest.param(MessageFilter(key="k1"), id="key"),
        pytest.param(MessageFilter(key="k1", error="BOOM"), id="key and error text"),
        pytest.param(MessageFilter(field="i", value="7"), id="payload field"),
        pytest.param(MessageFilter(dedupe_key="d7"), id="dedupe key"),
        pytest.param(MessageFilter(error_class="message"), id="delivery side only"),
    ],
)
def test_a_page_and_its_count_are_single_task_statements(f):
    with cluster() as (_, strict, ids):
        expected = {
            "key": dead_of(ids, 1),
            "field": [ids[7]],
            "dedupe_key": [ids[7]],
        }
        want = next((v for k, v in expected.items() if getattr(f, k) is not None), None)
        if want is None:
            want = [m for i, m in enumerate(ids) if i % 5]
        page = find(strict, "g", replace(f, state="dead"), limit=100)
        assert [r.message_id for r in page.rows] == want
        assert all(r.key is not None and r.payload.startswith("{") for r in page.rows)
        # pages of 2 through search windows of 5 rows: the same rows, once each
        seen: list[int] = []
        after = None
        for _ in range(N):
            small = find(strict, "g", replace(f, state="dead"), after=after, limit=2, scan=5)
            seen += [r.message_id for r in small.rows]
            if not small.more:
                break
            after = small.searched_to or small.rows[-1].message_id
        assert seen == want
        n, fixed = fix_matching(strict, "g", replace(f, state="dead"))
        assert n == len(want) and fixed is not None and fixed.up_to == want[-1]


def test_a_bulk_requeue_and_purge_of_a_filter_are_single_task_statements():
    with cluster() as (engine, strict, ids):
        k1 = MessageFilter(key="k1", state="dead")
        n, fixed = fix_matching(strict, "g", k1)
        assert fixed is not None and n == len(dead_of(ids, 1))
        done = admin.requeue(strict, "g", all_dead=True, matching=fixed, reason="back")
        assert done.count == n
        k2 = MessageFilter(key="k2", field="i", value="8")
        gone = admin.purge(strict, "g", matching=k2, reason="junk")
        assert gone.count == 1
        one = admin.requeue(
            strict, "g", all_dead=True, matching=MessageFilter(dedupe_key="d2"), reason="one"
        )
        assert one.count == 1
        picked = admin.purge(strict, "g", ids=[ids[11], ids[14], ids[15]], reason="picked")
        assert picked.count == 2  # ids[15] is not dead
        now = {m: r.state for m, r in rows(engine, "g").items()}
        assert all(now[m] == "ready" for m in dead_of(ids, 1))
        assert ids[8] not in now and ids[11] not in now and ids[14] not in now
        assert now[ids[2]] == "ready"
        untouched = {m: "dead" if i % 5 else "ready" for i, m in enumerate(ids)}
        assert {m: r.state for m, r in rows(engine, "h").items()} == untouched
        trail = [(a["action"], a["count"]) for a in monitor.audit(strict, "g")]
        assert trail == [("purge", 2), ("requeue", 1), ("purge", 1), ("requeue", n)]
