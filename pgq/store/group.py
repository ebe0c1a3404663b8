"""`GroupStore`: the consumer's statements for one group and one member.

Each method takes the connection of the role that calls it (the caller owns
the transaction) and returns records from `pgq.records`. Rows are mapped by
name from the same column list the statement's `RETURNING` is built from.

The statements live by concern, one module each:

- `pgq.store.scope`: the group and member they speak for, lease tokens;
- `pgq.store.claims`: claim, extend, release, sweep;
- `pgq.store.outcomes`: the fenced outcomes of attempts;
- `pgq.store.breaker`: the group breaker (open, probe, close, reconcile);
- `pgq.store.housekeeping`: frontier, statistics, VACUUM, retention;
- `pgq.store.membership`: this member's join, heartbeat and leave.
"""

from __future__ import annotations

from pgq.store.breaker import BreakerStore
from pgq.store.housekeeping import Housekeeping
from pgq.store.membership import Membership

__all__ = ["GroupStore"]


class GroupStore(BreakerStore, Housekeeping, Membership):
    """The consumer's statements for one group and member, run on a role's connection."""
