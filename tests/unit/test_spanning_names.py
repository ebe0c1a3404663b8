"""The statements of pgq allowed to span shards on Citus are these, by name, and each
name is used (`pgq.store.placement.Spanning`); nothing else in pgq turns Citus's
multi-task check off."""

from __future__ import annotations

import re
from pathlib import Path

from pgq.store.placement import Spanning

PGQ = Path(__file__).resolve().parents[2] / "pgq"


def sources() -> dict[Path, str]:
    return {p: p.read_text() for p in PGQ.rglob("*.py")}


def test_the_spanning_statements_are_these():
    assert [s.name for s in Spanning] == [
        "SUBSCRIBE_BACKFILL",
        "GROUPS_OVERVIEW",
        "MEMBERS_OVERVIEW",
        "SAMPLES_OVERVIEW",
        "TOPIC_MESSAGE_COUNTS",
        "AUDIT_BY_NAME",
        "UPGRADE",
    ]


def test_each_name_is_used_and_only_spanning_turns_the_check_off():
    text = "\n".join(sources().values())
    for s in Spanning:
        assert re.search(rf"spanning\(conn, (placement\.)?Spanning\.{s.name}\)", text), s.name
    turning_off = {
        p.relative_to(PGQ).as_posix()
        for p, body in sources().items()
        if "allow_multi_task(" in body or "'citus.multi_task_query_log_level'" in body
    }
    assert turning_off == {"sql/placement.py", "store/placement.py"}
