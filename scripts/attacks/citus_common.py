"""Plumbing for the `citus_*` attack scripts: a fresh schema placed on the local Citus
cluster (`pgq.migrate(engine, distributed=True)`), where each group's and topic's shard
lives, and SQL on the workers.

`PGQ_CITUS_DSN` overrides the coordinator (default postgresql://postgres@127.0.0.1:9701/postgres);
the workers are the nodes of `pg_dist_node` other than the coordinator. Every script drops
its schema at the end (keep it with `PGQ_ATTACK_KEEP=1`).
"""

from __future__ import annotations

import os
import secrets

import psycopg

os.environ.setdefault(
    "PGQ_ATTACK_DSN",
    os.environ.get("PGQ_CITUS_DSN", "postgresql://postgres@127.0.0.1:9701/postgres"),
)

import _common
from _common import PGQ, ROOT, TESTS, Schema, states, verdict  # noqa: F401
from sqlalchemy import text

import pgq

DSN = _common.DSN
os.environ.pop(
    "PGQ_ATTACK_DSN", None
)  # pgq refuses unknown PGQ_* settings in a member's environment
os.environ.pop("PGQ_CITUS_DSN", None)


def node_dsn(port: int) -> str:
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"


def node_sql(port: int, stmt: str, params: tuple | dict | None = None) -> list[tuple]:
    """Run `stmt` on the node at `port` (autocommit); its rows (none for a command)."""
    with psycopg.connect(node_dsn(port), autocommit=True) as c:
        cur = c.execute(stmt, params)
        return cur.fetchall() if cur.description else []


class CitusSchema(Schema):
    """A fresh pgq schema `atk_<name>_<random>`, placed on the cluster; dropped on exit."""

    def __init__(self, name: str) -> None:
        self.name = f"atk_{name}_{secrets.token_hex(3)}"
        self.engine = pgq.connect(DSN, schema=self.name)
        pgq.migrate(self.engine, distributed=True)

    def gid(self, group: str) -> int:
        return self.sql(f'SELECT id FROM "{self.name}".consumer_group WHERE name = :g', g=group)[0][
            0
        ]

    def tid(self, topic: str) -> int:
        return self.sql(f'SELECT id FROM "{self.name}".topic WHERE name = :t', t=topic)[0][0]

    def port_of(self, table: str, value: int) -> int:
        """The worker port holding `table`'s shard for distribution value `value`."""
        return self.sql(
            "SELECT p.nodeport FROM pg_dist_shard_placement p WHERE p.shardid ="
            " get_shard_id_for_distribution_column(CAST(:t AS regclass), :v)",
            t=f'"{self.name}".{table}',
            v=value,
        )[0][0]

    def group_port(self, group: str) -> int:
        return self.port_of("delivery", self.gid(group))

    def topic_port(self, topic: str) -> int:
        return self.port_of("message", self.tid(topic))

    def workers(self) -> list[int]:
        return [
            r[0]
            for r in self.sql(
                "SELECT nodeport FROM pg_dist_node WHERE groupid <> 0 AND isactive ORDER BY nodeport"
            )
        ]

    def close(self) -> None:
        self.engine.dispose()
        if os.environ.get("PGQ_ATTACK_KEEP"):
            print(f"kept schema {self.name}")
            return
        admin = pgq.connect(DSN)
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.name}" CASCADE'))
        admin.dispose()


def groups_on_each_worker(
    s: CitusSchema, topic: str, prefix: str, want: int = 1
) -> dict[int, list[str]]:
    """Subscribe groups `<prefix><n>` to `topic` until each worker holds `want` of them;
    {port: [group, ...]}."""
    out: dict[int, list[str]] = {p: [] for p in s.workers()}
    n = 0
    while any(len(v) < want for v in out.values()) and n < 64:
        name = f"{prefix}{n}"
        pgq.subscribe(s.engine, name, topic)
        port = s.group_port(name)
        if len(out[port]) < want:
            out[port].append(name)
        n += 1
    return out
