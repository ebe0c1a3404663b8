"""What every part of `GroupStore` shares: the group and member it speaks for
(`GroupScope`), the member's lease tokens (decision 0004), and how leases and id
lists are passed to statements."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection

from pgq.errors import PgqError
from pgq.records import (
    Lease,
)
from pgq.sql import claim as claim_sql
from pgq.store.connections import run_hot

TOKEN_BITS = 20
"""Claims per drawn block of lease tokens (2^20)."""


def int_array(values: Iterable[int]) -> str:
    """An integer array as PostgreSQL's text literal: one string for the driver to
    send, instead of a list it would adapt element by element."""
    return "{" + ",".join(map(str, values)) + "}"


def lease_params(leases: Iterable[Lease]) -> dict[str, str]:
    """`:ids` and `:seqs` of a statement that names leases (`pgq.sql.claim.fenced`)."""
    leases = list(leases)
    return {
        "ids": int_array(lease.id for lease in leases),
        "seqs": int_array(lease.seq for lease in leases),
    }


def lease_set(rows: Iterable[Any]) -> set[Lease]:
    """The leases of rows that begin (message_id, lease_seq)."""
    return {Lease(int(r[0]), int(r[1])) for r in rows}


def present_holders(params: dict[str, Any]) -> set[tuple[int, str]]:
    """The (group id, member name) pairs of the live members a quorum read saw."""
    return set(zip(params["present_gids"], params["present_names"], strict=True))


class LeaseTokens:
    """The lease tokens of one member process (decision 0004): one value v drawn from
    the `lease_token` sequence, then -(v * 2^TOKEN_BITS + k) for k = 0, 1, …, a new
    v when the block is used up. Unique across every claim of every member: blocks
    never overlap, and members of earlier versions drew positive tokens. Drawn in the
    claim's own transaction (or autocommitted before it), one statement per 2^20
    claims."""

    def __init__(self) -> None:
        self._block = 0
        self._next = 1 << TOKEN_BITS  # no block yet
        self._lock = threading.Lock()

    def next(self, conn: Connection) -> int:
        with self._lock:
            if self._next >= 1 << TOKEN_BITS:
                [(block,)] = run_hot(conn, claim_sql.token_block(), {})
                if not 0 < block < 1 << (63 - TOKEN_BITS):
                    raise PgqError(f"lease_token sequence out of range for token blocks: {block}")
                self._block, self._next = block, 0
            token = -((self._block << TOKEN_BITS) | self._next)
            self._next += 1
            return token


class GroupScope:
    """Who the statements are for: one group, its topic and one member, with the
    member's lease and its lease tokens. The concerns of `GroupStore` build on it."""

    def __init__(
        self,
        gid: int,
        group: str,
        topic: str,
        member: str,
        lease: float,
        max_reclaims: int,
        *,
        topic_id: int | None = None,
        ordered: bool = False,
    ) -> None:
        self.gid = gid
        self.ordered = ordered
        """Claims take only rows whose key is free (an ordered group: DESIGN §7)."""
        self.group = group
        self.topic = topic
        self.topic_id = topic_id
        """The topic's id (looked up at the first claim that needs it, when None)."""
        self.split_claim: bool | None = None
        """Read the claimed messages in a statement of their own: on Citus, where they
        live on the topic's shard (`pgq.sql.claim.lease_picked`). Asked at the first
        claim."""
        self.member = member
        self.lease = dt.timedelta(seconds=lease)
        self.max_reclaims = max_reclaims
        self.started: dt.datetime | None = None
        """When this process joined (its join's token; None before it joined)."""
        self.tokens = LeaseTokens()
