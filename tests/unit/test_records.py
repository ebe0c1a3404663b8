"""`Message` is built on the hot path by its own `__init__` (slots set directly):
what a handler sees of it stays a frozen dataclass's behaviour."""

from __future__ import annotations

import dataclasses
import datetime as dt
import pickle

import pytest

from pgq.records import Message

NOW = dt.datetime(2026, 12, 6, tzinfo=dt.timezone.utc)


def message(**changes: object) -> Message:
    fields = dict(
        id=7, topic="t", group="g", key="k", payload={"a": [1]}, headers={"h": 1}, attempt=2
    )
    return Message(**{**fields, "created_at": NOW, **changes})  # type: ignore[arg-type]


def test_every_field_is_set_and_named_as_before():
    msg = message()
    assert [f.name for f in dataclasses.fields(Message)] == [
        *("id", "topic", "group", "key", "payload", "headers", "attempt", "created_at")
    ]
    assert (msg.id, msg.topic, msg.group, msg.key, msg.attempt) == (7, "t", "g", "k", 2)
    assert (msg.payload, msg.headers, msg.created_at) == ({"a": [1]}, {"h": 1}, NOW)
    assert Message(7, "t", "g", "k", {"a": [1]}, {"h": 1}, 2, NOW) == msg
    assert repr(msg).startswith("Message(id=7, topic='t', group='g', key='k', payload={")


def test_it_stays_frozen_slotted_comparable_and_picklable():
    msg = message()
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.id = 8  # type: ignore[misc]
    assert not hasattr(msg, "__dict__")
    assert message(payload=1) != message(payload=2)
    assert hash(message(payload=1, headers=None)) == hash(message(payload=1, headers=None))
    assert dataclasses.replace(msg, attempt=3) == message(attempt=3)
    assert pickle.loads(pickle.dumps(msg)) == msg
    with pytest.raises(TypeError):
        Message(7, "t", "g", "k", {}, None, 2)  # type: ignore[call-arg]
