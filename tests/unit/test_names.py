"""Names pgq accepts (DESIGN §7): whole-string patterns, no control characters."""

from __future__ import annotations

import pytest

import pgq
from pgq.names import check_member_name, check_name
from pgq.store import resolve_schema


@pytest.mark.parametrize("name", ["orders", "a", "Orders.v2-x_1", "9" * 63])
def test_good_topic_and_group_names(name):
    assert check_name("topic", name) == name


@pytest.mark.parametrize(
    "name", ["", "orders\n", "orders\r", "\norders", "-x", ".x", "a b", "é", "9" * 64, None]
)
def test_bad_topic_and_group_names(name):
    with pytest.raises(pgq.UsageError, match="invalid topic name"):
        check_name("topic", name)


@pytest.mark.parametrize("name", ["host:123:ab12", "worker 1", "ünïcode-name", "x" * 200])
def test_good_member_names(name):
    assert check_member_name(name) == name


@pytest.mark.parametrize("name", ["", "x" * 201, "a\nb", "a\x1b[2Jb", "a\u2028b", "a\tb"])
def test_bad_member_names(name):
    with pytest.raises(pgq.UsageError, match="invalid member name"):
        check_member_name(name)


@pytest.mark.parametrize("name", ["pgq", "app_queue", "_x"])
def test_good_schema_names(name):
    assert resolve_schema(name) == name


@pytest.mark.parametrize("name", ["pgq\n", "pg_catalog", "pg_x", "information_schema", "A", "1x"])
def test_bad_schema_names(name):
    with pytest.raises(pgq.ConfigError, match="invalid schema name"):
        resolve_schema(name)
