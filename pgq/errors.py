"""One exception tree for pgq.

`PgqError` subclasses carry their default message as their docstring. The
user-facing ones (`UsageError` and below) are what the CLI turns into one line
on stderr and exit code 2. `SystemicError`, `PermanentError` and `RetryLater`
are raised by handlers to tell the consumer what a failure means.
`install_extra` words the install hint of an error about a missing extra.
"""

from __future__ import annotations

from collections.abc import Mapping


class PgqError(Exception):
    """pgq failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class UsageError(PgqError):
    """Bad input: the command or call cannot be carried out as given."""


class ConfigError(UsageError):
    """The configuration is invalid."""


class InvalidName(UsageError):
    """Invalid topic or group name."""


class UnknownTopic(UsageError):
    """No such topic."""


class UnknownGroup(UsageError):
    """No such consumer group."""


class InvalidPayload(UsageError):
    """The message payload is not valid JSON."""


class HandlerImportError(UsageError):
    """The handler cannot be imported."""


class DuplicateMember(UsageError):
    """A live member with this name is already running in the group."""


class DatabaseUnavailable(PgqError):
    """Cannot reach the database."""


class BadDsn(UsageError):
    """The database address is invalid or the server refuses it (a wrong password,
    no such role or database): configuration, never retried as an outage."""


class SchemaMissing(UsageError):
    """The pgq schema is not installed: run `pgq init`."""


class PermissionDenied(UsageError):
    """The database role lacks a privilege pgq needs (see `pgq grant`)."""


class InvalidData(UsageError):
    """The database refused a value (a NUL byte, a number out of range, ...)."""


class DatabaseError(PgqError):
    """The database refused a statement for a reason pgq does not classify."""


class TransactionConflict(DatabaseError):
    """The transaction lost a conflict (serialization failure, deadlock): retry it."""


class LockNotAvailable(TransactionConflict):
    """A lock was not granted within the lock timeout (or at once, NOWAIT): try
    again later."""


class StatementTimeout(DatabaseError):
    """A statement ran past its time limit or was cancelled."""


class EmbeddedServerError(PgqError):
    """The embedded PostgreSQL server could not be started."""


# --- raised by handlers -------------------------------------------------------


class SystemicError(Exception):
    """A dependency is failing: not this message's fault.

    Systemic failures count toward the circuit breaker and are refunded when the
    group's breaker closes after an outage.
    """


class PermanentError(Exception):
    """This message can never succeed: dead-letter it at once."""


class RetryLater(Exception):
    """Put the message back and try it again after `delay` seconds, without
    charging an attempt (a snooze)."""

    def __init__(self, delay: float = 0.0, message: str | None = None) -> None:
        if delay < 0:
            raise ValueError("RetryLater delay must be >= 0")
        self.delay = float(delay)
        super().__init__(message or f"retry later in {self.delay:g}s")


class HandlerEndedTransaction(PgqError):
    """A transactional handler asked to commit, roll back or close pgq's transaction."""


class PartialFailure(Exception):
    """Raised by a transactional batch handler (`batch_handler=`): the messages named
    by id failed, each with its exception. The batch's writes all roll back; the named
    messages' failures are recorded as any handler's (retry, snooze, dead, the
    breaker), and the others go back to ready without an attempt charged, to run
    again with their effects written anew."""

    def __init__(self, failures: Mapping[int, BaseException]) -> None:
        self.failures = dict(failures)
        super().__init__(f"{len(self.failures)} message(s) of the batch failed")


def install_extra(extra: str) -> str:
    """How to install pgq's extra `extra`, as an error's one line says it: from a
    checkout of pgq (the distribution `pgq-breaker` is not on PyPI yet), or by name
    where a package index has it."""
    return (
        f"pip install -e '.[{extra}]' in a checkout of pgq"
        f" (pip install 'pgq-breaker[{extra}]' where a package index has it)"
    )
