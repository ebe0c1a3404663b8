"""The fields a log event takes from where it happened: which group, which member.

pgq's log calls name their own fields in the message template (`"reclaimed
expired leases count=%d"`, `pgq.cli.logs`). What no call site should have to
repeat — the group and the member it is about — comes from the context
instead: a member's threads run inside `log_fields(group=..., member=...)`
(`Role.run`), so do `Consumer`'s public calls, and every pgq logger that logs
for a member is a `FieldLogger`, which adds the bound fields to each record as
`extra` (record attributes `group` and `member`, which the CLI's formatters
write and an application's own handler can read). So no call site can forget
them. A plain thread pgq starts for a member carries them with `carrying`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, MutableMapping
from contextvars import ContextVar, copy_context
from typing import Any, TypeVar

__all__ = ["FieldLogger", "bound_fields", "carrying", "get_logger", "log_fields"]

T = TypeVar("T")

_FIELDS: ContextVar[tuple[tuple[str, object], ...]] = ContextVar("pgq_log_fields", default=())
"""The fields bound where the code runs now (a tuple: a context variable's default
must not be mutable)."""


def bound_fields() -> dict[str, object]:
    """The fields bound here (empty outside any `log_fields`)."""
    return dict(_FIELDS.get())


@contextlib.contextmanager
def log_fields(**fields: object) -> Iterator[None]:
    """Within the block, every `FieldLogger` record carries `fields` (over the ones
    bound around it)."""
    token = _FIELDS.set(tuple({**bound_fields(), **fields}.items()))
    try:
        yield
    finally:
        _FIELDS.reset(token)


class FieldLogger(logging.LoggerAdapter[logging.Logger]):
    """A logger whose records carry the bound fields as `extra` (a call's own
    `extra` wins)."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        bound = _FIELDS.get()
        if bound:
            kwargs["extra"] = {**dict(bound), **(kwargs.get("extra") or {})}
        return msg, kwargs


def get_logger(name: str) -> FieldLogger:
    """`logging.getLogger(name)` as a `FieldLogger`."""
    return FieldLogger(logging.getLogger(name), {})


def carrying(target: Callable[[], T]) -> Callable[[], T]:
    """`target`, to run in another thread with the fields bound here now."""
    context = copy_context()
    return lambda: context.run(target)
