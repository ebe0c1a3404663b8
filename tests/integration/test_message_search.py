"""Finding a group's messages (`pgq.store.messages`, issue 23) against real PostgreSQL:
every filter, keyset pages both ways, and the bounded window of unindexed filters."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import pytest
from helpers import across_groups, kill
from sqlalchemy import Engine, update

import pgq
from pgq import schema as t
from pgq.errors import UnknownGroup, UsageError
from pgq.records import MessageFilter
from pgq.store.messages import count_matching, find


@pytest.fixture
def rows(engine: Engine) -> list[int]:
    """Group `g` on `t` with 30 messages: ids[10:20] dead (odd ones with a `message`
    error "Timeout talking to billing", even ones `permanent` "bad input"), the
    rest ready; payload `{"n": i, "customer": {"id": "c<i mod 3>"}}`, key `k<i mod 2>`."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = [
        pgq.publish(engine, "t", {"n": i, "customer": {"id": f"c{i % 3}"}}, key=f"k{i % 2}")
        for i in range(30)
    ]
    odd = [m for i, m in enumerate(ids[10:20]) if i % 2]
    even = [m for i, m in enumerate(ids[10:20]) if not i % 2]
    kill(engine, odd, "message", last_error="Timeout talking to billing")
    kill(engine, even, "permanent", last_error="bad input")
    return ids


def ids_of(page) -> list[int]:
    return [r.message_id for r in page.rows]


def test_each_filter_finds_exactly_its_rows(engine, rows):
    every = find(engine, "g", limit=100)
    assert ids_of(every) == rows and not every.more
    dead = MessageFilter(state="dead")
    assert ids_of(find(engine, "g", dead)) == rows[10:20]
    assert ids_of(find(engine, "g", MessageFilter(state="ready"))) == rows[:10] + rows[20:]
    by_class = find(engine, "g", MessageFilter(error_class="permanent"))
    assert ids_of(by_class) == rows[10:20:2]
    by_text = find(engine, "g", MessageFilter(error="TIMEOUT talking"))  # any case
    assert ids_of(by_text) == rows[11:20:2]
    assert by_text.rows[0].error == "Timeout talking to billing"
    by_field = find(engine, "g", MessageFilter(field="customer.id", value="c1"), limit=100)
    assert ids_of(by_field) == [m for i, m in enumerate(rows) if i % 3 == 1]
    by_number = find(engine, "g", MessageFilter(field="n", value="7"))
    assert ids_of(by_number) == [rows[7]]
    assert ids_of(find(engine, "g", MessageFilter(key="k1"), limit=100)) == rows[1::2]
    assert ids_of(find(engine, "g", MessageFilter(message_id=rows[3]))) == [rows[3]]
    both = MessageFilter(state="dead", key="k0", field="customer.id", value="c0")
    expected = [m for i, m in enumerate(rows) if 10 <= i < 20 and i % 6 == 0]
    assert ids_of(find(engine, "g", both)) == expected
    assert count_matching(engine, "g", dead) == (10, rows[19])
    assert count_matching(engine, "g", MessageFilter(key="nope")) == (0, None)


def test_published_time_range(engine, rows):
    base = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
    with across_groups(engine) as conn:  # by message id alone: every topic's shard
        for i, mid in enumerate(rows):
            conn.execute(
                update(t.message)
                .where(t.message.c.id == mid)
                .values(created_at=base + dt.timedelta(hours=i))
            )
    window = MessageFilter(
        published_from=base + dt.timedelta(hours=5), published_to=base + dt.timedelta(hours=8)
    )
    assert ids_of(find(engine, "g", window)) == rows[5:8]


def test_keyset_pages_both_ways_cover_every_row_once(engine, rows):
    seen, after = [], None
    while True:
        page = find(engine, "g", after=after, limit=7)
        seen += ids_of(page)
        if not page.more:
            break
        after = page.last_id
    assert seen == rows
    seen, before = [], None
    while True:
        page = find(engine, "g", before=before, descending=True, limit=7)
        seen += ids_of(page)
        if not page.more:
            break
        before = page.last_id
    assert seen == rows[::-1]


def test_an_unindexed_filter_searches_a_bounded_window_and_says_where_it_stopped(engine, rows):
    wanted = MessageFilter(field="n", value="25")
    first = find(engine, "g", wanted, scan=10)
    assert first.rows == () and first.more and first.searched_to == rows[9]
    second = find(engine, "g", wanted, after=first.last_id, scan=10)
    assert second.rows == () and second.searched_to == rows[19]
    third = find(engine, "g", wanted, after=second.last_id, scan=10)
    assert ids_of(third) == [rows[25]] and not third.more and third.searched_to is None
    # a page that fills up inside its window continues from its last row
    many = find(engine, "g", MessageFilter(key="k0"), scan=10, limit=2)
    assert ids_of(many) == [rows[0], rows[2]] and many.more and many.searched_to is None
    backwards = find(engine, "g", wanted, descending=True, scan=10)
    assert ids_of(backwards) == [rows[25]] and backwards.more
    assert backwards.searched_to == rows[20]


@pytest.mark.parametrize(
    ("f", "words"),
    [
        (MessageFilter(state="gone"), "invalid state"),
        (MessageFilter(error_class="SYSTEMIC"), "invalid error class"),
        (MessageFilter(field="a..b", value="1"), "invalid payload field"),
        (MessageFilter(field="a"), "both a field and a value"),
        (MessageFilter(key="a\x00b"), "no NUL"),
        (MessageFilter(error="\ud800"), "no lone surrogates"),
        (MessageFilter(message_id=0), "invalid message id"),
        (MessageFilter(published_from=dt.datetime(2024, 1, 1)), "time zone"),
    ],
)
def test_bad_filters_are_usage_errors(engine, rows, f, words):
    with pytest.raises(UsageError, match=words):
        find(engine, "g", f)


def test_an_unknown_group_and_bad_pages(engine, rows):
    with pytest.raises(UnknownGroup):
        find(engine, "nope")
    for limit in (0, 501, True):
        with pytest.raises(UsageError, match="page size"):
            find(engine, "g", limit=limit)
    with pytest.raises(UsageError, match="invalid message id"):
        find(engine, "g", after=-1)


def test_requeue_and_purge_of_what_a_filter_matches_are_audited_as_ever(engine, rows):
    """Only dead rows that match (whatever the filter's state says), up to `up_to`;
    one audit row each, written by the requeue and purge behind the CLI."""
    from pgq import monitor
    from pgq.store import admin

    timeouts = MessageFilter(error="timeout", state="ready")  # the state is ignored
    n, up_to = count_matching(engine, "g", replace(timeouts, state="dead"))
    assert (n, up_to) == (5, rows[19])
    capped = replace(timeouts, up_to=rows[15])
    done = admin.requeue(
        engine, "g", all_dead=True, matching=capped, reason="billing is back", actor="ann (web)"
    )
    assert done.count == 3  # rows[11], [13], [15]
    assert ids_of(find(engine, "g", MessageFilter(state="dead", error="timeout"))) == [
        rows[17],
        rows[19],
    ]
    gone = admin.purge(engine, "g", ids=[rows[10], rows[12], rows[0]], reason="junk", actor="bo")
    assert gone.count == 2  # rows[0] is not dead: left out
    field = admin.purge(
        engine, "g", matching=MessageFilter(field="customer.id", value="c2"), reason="c2 gone"
    )
    assert field.count == len([i for i in (14, 16, 17, 18, 19) if i % 3 == 2])
    # filter values are never SET by the update (parameters named like columns would be)
    one = admin.requeue(
        engine, "g", all_dead=True, matching=MessageFilter(message_id=rows[19]), reason="one"
    )
    assert one.count == 1
    [row] = find(engine, "g", MessageFilter(message_id=rows[19])).rows
    assert (row.state, row.key) == ("ready", "k1")
    assert len(find(engine, "g", limit=100).rows) == 30 - 2 - field.count
    trail = [(a["action"], a["count"], a["reason"], a["actor"]) for a in monitor.audit(engine, "g")]
    assert trail[2:] == [
        ("purge", 2, "junk", "bo"),
        ("requeue", 3, "billing is back", "ann (web)"),
    ]
    with pytest.raises(UsageError, match="use it with all_dead"):
        admin.requeue(engine, "g", [rows[17]], matching=timeouts, reason="x")
    with pytest.raises(UsageError, match="give the message ids"):
        admin.purge(engine, "g", ids=[], reason="x")


def test_a_dedupe_key_finds_its_one_message_exactly_and_without_a_window(engine, rows):
    """The dedupe key matches exactly (no pattern, no case folding), only in the
    group's topic, and through its index: no search window, whatever the scan."""
    from pgq.store import admin

    pgq.create_topic(engine, "other")
    pgq.subscribe(engine, "h", "other")
    twin = pgq.publish(engine, "other", {"n": -1}, dedupe_key="order-42")
    mine = pgq.publish(engine, "t", {"n": 30}, key="k0", dedupe_key="order-42")
    near = pgq.publish(engine, "t", {"n": 31}, dedupe_key="order-4_")
    assert twin != mine
    found = find(engine, "g", MessageFilter(dedupe_key="order-42"), scan=1)
    assert ids_of(found) == [mine] and not found.more and found.searched_to is None
    assert ids_of(find(engine, "g", MessageFilter(dedupe_key="order-4_"), scan=1)) == [near]
    for missing in ("order-4%", "ORDER-42", "order-4", "order-42 "):
        assert ids_of(find(engine, "g", MessageFilter(dedupe_key=missing))) == []
    # beside a filter that has no index, still one exact answer
    keyed = MessageFilter(dedupe_key="order-42", key="k0", field="n", value="30")
    assert ids_of(find(engine, "g", keyed, scan=1)) == [mine]
    assert ids_of(find(engine, "g", replace(keyed, key="k1"), scan=1)) == []
    assert ids_of(find(engine, "h", MessageFilter(dedupe_key="order-42"))) == [twin]
    # a bulk requeue and purge of a dedupe-key filter touch that row only
    kill(engine, [mine, near], "message")
    dead = MessageFilter(dedupe_key="order-42", state="dead")
    assert count_matching(engine, "g", dead) == (1, mine)
    done = admin.requeue(engine, "g", all_dead=True, matching=dead, reason="re")
    assert done.count == 1
    [row] = find(engine, "g", MessageFilter(dedupe_key="order-42")).rows
    assert row.state == "ready"
    kill(engine, [mine], "message")
    gone = admin.purge(engine, "g", matching=MessageFilter(dedupe_key="order-4_"), reason="x")
    assert gone.count == 1
    assert ids_of(find(engine, "g", MessageFilter(state="dead"), limit=100)) == [
        *rows[10:20],
        mine,
    ]
    with pytest.raises(UsageError, match="dedupe_key filter"):
        find(engine, "g", MessageFilter(dedupe_key="a\x00b"))
