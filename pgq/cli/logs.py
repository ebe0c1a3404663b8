"""How the `pgq` command writes its log: one event per line, as text or JSON.

pgq's log calls name their fields in the message template (`"member joined
group=%s member=%s"`); the formatters here keep that one line per event:

- `text` (the default): `time LEVEL logger: message key=value ...`, with control
  characters of the message escaped (a newline in a member name or in a
  handler's error text cannot forge a line; a traceback that follows keeps its
  lines);
- `json` (`--log-format json`): one JSON object a line with `time`, `level`,
  `logger`, `message` and the event's fields, each `key=%x` of the template
  paired with its argument (numbers stay numbers), plus `exception` when a
  traceback is attached.

Neither ever prints a secret: a `password=...` or the password of a URL in a
message (a DSN quoted in an error) is replaced by `***`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sys
from typing import IO, Any

from pgq.cli.render import visible

FORMATS = ("text", "json")

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_TEXT_DATEFMT = "%Y-%m-%dT%H:%M:%S"

_CONVERSION = re.compile(r"%(?:%|(?:\(\w+\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[a-zA-Z])")
_FIELD = re.compile(r"(\w+)=$")
_SECRETS = (
    (re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE), r"\1***"),
    (re.compile(r"(\w+://[^:/@\s]*:)[^@\s]*@"), r"\1***@"),
)
_RESERVED = frozenset({"time", "level", "logger", "message", "exception"})


def scrub(text: str) -> str:
    """`text` with passwords (key=value or in a URL) replaced by `***`."""
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The event's fields: each `key=%x` of the message template with its argument."""
    if not isinstance(record.msg, str) or not isinstance(record.args, tuple):
        return {}
    found: dict[str, Any] = {}
    args = iter(record.args)
    for match in _CONVERSION.finditer(record.msg):
        if match.group() == "%%":
            continue
        try:
            value = next(args)
        except StopIteration:
            break
        key = _FIELD.search(record.msg, 0, match.start())
        if key is not None and key.group(1) not in _RESERVED:
            found[key.group(1)] = _plain(value)
    return found


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return value
    return scrub(str(value))


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message`, the message on one line and without secrets."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT, _TEXT_DATEFMT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        return visible(scrub(super().formatMessage(record)))

    def formatException(self, ei: Any) -> str:
        """The traceback, its lines kept, without secrets or other control characters."""
        lines = scrub(super().formatException(ei)).split("\n")
        return "\n".join(visible(line) for line in lines)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": scrub(record.getMessage()),
            **fields(record),
        }
        if record.exc_info:
            event["exception"] = scrub(self.formatException(record.exc_info))
        return json.dumps(event, default=str)


class _StderrHandler(logging.StreamHandler[IO[str]]):
    """Writes to whatever `sys.stderr` is at the time of each record."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: IO[str]) -> None:
        pass


SERVED_LIBRARIES = ("waitress",)
"""Libraries whose warnings and errors pgq's commands report in pgq's own format
(`pgq web` serves with waitress); they keep their own level (WARNING)."""


def configure_logging(verbose: int, level: str | None = None, log_format: str = "text") -> None:
    """Send the `pgq` loggers to stderr: INFO by default, DEBUG with `-v`, as text or
    JSON lines; `SERVED_LIBRARIES` too, at their own level.

    Other libraries stay at the root logger's WARNING. Calling it again (tests
    invoke the CLI many times in one process) replaces the handler it installed.
    """
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    for name in ("pgq", *SERVED_LIBRARIES):
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            if isinstance(old, _StderrHandler):
                logger.removeHandler(old)
        logger.addHandler(handler)
    logging.getLogger("pgq").setLevel(logging.DEBUG if verbose else (level or "INFO").upper())
