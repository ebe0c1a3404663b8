"""The `application_name` of a member's connections with a long member name
(DESIGN §7, "Connections"; decision 0027; docs/operations.md tells operators to
find each connection by `pgq/<group>/<member>/<role>`).

PostgreSQL keeps 63 bytes of it. Found by attack: the name is cut at the end, so
the role goes first: a member named the default way (`host:pid:xxxx`) on a host
with a cloud provider's host name, `ip-172-31-20-123.eu-central-1.compute.internal`,
shows three backends of the same name, `pgq/billing/ip-172-...internal:4242:ab`,
and nobody can tell the session (locks, LISTEN) from the claims and work
connections, nor find the session to see what blocks it.
"""

from __future__ import annotations

import psycopg
import pytest
from helpers import FAST, wait_until
from sqlalchemy import Engine

import pgq
from pgq.store import conninfo_of

pytestmark = pytest.mark.timeout(60)

HOST = "ip-172-31-20-123.eu-central-1.compute.internal"
ROLES = ("session", "claims", "work")


def test_each_connection_names_its_role_with_a_long_member_name(orders: Engine) -> None:
    engine = orders
    name = f"{HOST}:4242:ab12"  # what `default_member_name()` makes on such a host
    consumer = pgq.Consumer(engine, "billing", lambda msg: None, name=name, workers=2, **FAST)
    consumer.start()
    try:

        def names() -> list[str]:
            with psycopg.connect(conninfo_of(engine), autocommit=True) as conn:
                found = conn.execute(
                    "SELECT application_name FROM pg_stat_activity"
                    " WHERE datname = current_database() AND application_name LIKE %s",
                    (f"pgq/billing/{HOST[:20]}%",),
                ).fetchall()
            return sorted(n for (n,) in found)

        pgq.publish(engine, "orders", {"n": 1})  # all three connections in use
        seen = wait_until(lambda: len(names()) >= 3 and names(), 20, "three member backends")
        assert len(set(seen)) == 3, f"the member's backends cannot be told apart: {seen}"
        for role in ROLES:
            assert [n for n in seen if n.endswith(f"/{role}")], (role, seen)
    finally:
        consumer.stop(timeout=10)
