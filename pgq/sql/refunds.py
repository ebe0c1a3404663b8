"""Which rows an outage charged, and so which rows a close owes a refund (DESIGN §5).

A row carries refundable charges when it has attempts that failed as systemic
or reclaims counted while a breaker was open (or while its last failure was
systemic). Each charge moves the row's `error_epoch` to the epoch it happened
under, so a close's window of epochs selects exactly the rows the outage
charged — whatever their last error class: a row that died of reclaims
(`lease`) during the outage is owed its refund like one that died systemic.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, literal_column
from sqlalchemy.sql import ColumnElement

from pgq import schema as t

d = t.delivery


def carries_charges() -> ColumnElement[bool]:
    """The row has refundable attempts or reclaims.

    Written exactly as the partial index `delivery_charged_idx` says it, with
    the 0 inline (a bound parameter would hide from the planner that the index
    covers the rows)."""
    return d.c.refundable_attempts + d.c.refundable_reclaims > literal_column("0")


def charged_within(
    from_epoch: ColumnElement[Any], to_epoch: ColumnElement[Any]
) -> ColumnElement[bool]:
    """The row carries charges, the last one made at an epoch in `[from_epoch, to_epoch)`."""
    return and_(carries_charges(), d.c.error_epoch >= from_epoch, d.c.error_epoch < to_epoch)
