"""How the `pgq` command writes to stderr: one event per line, as text or JSON.

pgq's log calls name their fields in the message template (`"member joined
group=%s member=%s"`); the fields bound where the event happened (the group
and the member, `pgq.logcontext`) come as the record's `extra`. The formatters
here keep that one line per event, and no value can forge a field:

- `text` (the default): `time LEVEL logger: message key=value ...`: each
  field's value quoted when it holds a space, `=`, a quote, a backslash or a
  control character (`quote`: `member="m1 group=payments"`), the bound fields
  the template does not name appended, and the control characters of the rest
  escaped (a traceback that follows keeps its lines);
- `json` (`--log-format json`): one JSON object a line with `time`, `level`,
  `logger`, `message` and the event's fields, each `key=%x` of the template
  paired with its argument (numbers stay numbers) and the bound ones, plus
  `exception` when a traceback is attached.

What pgq writes to stderr outside the log — the run summary of `pgq consume`,
`pgq: error: ...`, the `pgq web` banner — goes through `report`: the same
line as always in text, one JSON object (its fields as JSON values) in json.

Neither ever prints a secret: a `password=...` or the password of a URL in a
message (a DSN quoted in an error) is replaced by `***`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

import click

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


def quote(text: str) -> str:
    """`text` as the value of a `key=value` field: as is when it is one plain word;
    else in double quotes with `\\`, `"` and every non-printable character escaped
    (`\\n`, `\\x1b`, `\\u202e`), so that no value can end its field early, start
    another or break the line."""
    if text and text.isprintable() and not any(ch in _QUOTED for ch in text):
        return text
    return '"' + "".join(_ESCAPES.get(ch) or _escaped(ch) for ch in text) + '"'


_QUOTED = frozenset(' ="\\')
_ESCAPES = {"\\": "\\\\", '"': '\\"'}


def _escaped(ch: str) -> str:
    return ch if ch.isprintable() else repr(ch)[1:-1]


def message(record: logging.LogRecord) -> str:
    """The record's message without secrets (`scrub`), each field's value quoted as
    needed (`quote`); a value that is not a field is quoted too when it holds `=`
    or `"` (it could pass for one). Each value is scrubbed before it is quoted: a
    scrub of the quoted whole could take a closing quote with a password."""
    template, args = record.msg, record.args
    if not isinstance(template, str) or not isinstance(args, tuple) or not args:
        return scrub(record.getMessage())
    parts: list[str] = []
    values = iter(args)
    end = 0
    for match in _CONVERSION.finditer(template):
        parts.append(template[end : match.start()])
        end = match.end()
        if match.group() == "%%":
            parts.append("%")
            continue
        value = next(values, _MISSING)
        if value is _MISSING or "*" in match.group():
            return scrub(record.getMessage())  # as logging itself would (or fail to)
        text = scrub(match.group() % (value,))
        if _FIELD.search(template, 0, match.start()) is not None:
            parts.append(quote(text))
        else:
            parts.append(quote(text) if "=" in text or '"' in text else text)
    if next(values, _MISSING) is not _MISSING:
        return scrub(record.getMessage())
    parts.append(template[end:])
    return "".join(parts)


_MISSING = object()


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The event's fields: each `key=%x` of the message template with its argument,
    then the record's `extra` (the bound group and member, `pgq.logcontext`) that
    the template does not name."""
    found = _template_fields(record)
    for key, value in vars(record).items():
        if key not in _RECORD_ATTRIBUTES and key not in _RESERVED and not key.startswith("_"):
            found.setdefault(key, _plain(value))
    return found


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's `extra` fields that its message template does not name."""
    named = _template_fields(record)
    return {k: v for k, v in fields(record).items() if k not in named}


_RECORD_ATTRIBUTES = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys() | {"message", "asctime", "taskName"}
)


def _template_fields(record: logging.LogRecord) -> dict[str, Any]:
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
    """`time LEVEL logger: message key=value...`, on one line, values quoted as
    needed (`quote`), without secrets."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT, _TEXT_DATEFMT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        return visible(super().formatMessage(record))

    def format(self, record: logging.LogRecord) -> str:
        line = message(record)
        bound = extra_fields(record)
        if bound:
            line += "".join(f" {key}={quote(str(value))}" for key, value in bound.items())
        record.message = line
        record.asctime = self.formatTime(record, self.datefmt)
        text = self.formatMessage(record)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text = f"{text}\n{record.exc_text}"
        if record.stack_info:
            text = f"{text}\n{self.formatStack(record.stack_info)}"
        return text

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
            "message": message(record),
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


_chosen = {"format": "text"}
"""The format this invocation writes in (`use_format`)."""


def use_format(log_format: str) -> None:
    """Write `report` lines (and the next `configure_logging`'s) as `log_format`."""
    _chosen["format"] = log_format.lower() if log_format.lower() in FORMATS else "text"


GLOBAL_VALUED = ("--dsn", "--session-dsn", "--config", "--schema", "--log-level", "--log-format")
"""The root command's options that take a value (`format_asked` skips their values)."""


def format_asked(args: Sequence[str], environ: Mapping[str, str]) -> str:
    """The log format a command line asks for, read before click has parsed it (a stop
    during start-up): the last `--log-format F` or `--log-format=F` among the global
    options, else `$PGQ_LOG_FORMAT`, else text."""
    asked = environ.get("PGQ_LOG_FORMAT", "text")
    words = iter(args)
    for arg in words:
        if arg in GLOBAL_VALUED:
            value = next(words, None)
            if arg == "--log-format" and value is not None:
                asked = value
        elif arg.startswith("--log-format="):
            asked = arg.partition("=")[2]
        elif not arg.startswith("-"):
            break  # the command: what follows is its own
    return asked


def report(text: str, message: str, *, level: str = "INFO", **values: Any) -> None:
    """Write a line to stderr that is not a log event (the run summary, an error, a
    banner), whatever the log level: `text` as it is in the text format; in the
    JSON format one object with `time`, `level`, `logger` (`pgq.cli`), `message`
    and `values` as JSON values (text values without secrets)."""
    if _chosen["format"] != "json":
        click.echo(text, err=True)
        return
    event: dict[str, Any] = {
        "time": dt.datetime.now(dt.timezone.utc).isoformat(),
        "level": level,
        "logger": "pgq.cli",
        "message": scrub(message),
        **{key: _plain(value) for key, value in values.items()},
    }
    click.echo(json.dumps(event, default=str), err=True)


LIBRARIES = ("sqlalchemy", "psycopg", "psycopg_pool", "tenacity", "waitress")
"""The libraries pgq's commands run on: they log at WARNING and above (unless a
level was set for them), whatever the level of the other loggers."""


def configure_logging(verbose: int, level: str | None = None, log_format: str = "text") -> None:
    """Send every log line of the process to stderr through pgq's one handler, as
    text or JSON lines (DESIGN §7: with `--log-format json` every line pgq writes
    to stderr is one JSON object), `warnings` included (`logging.captureWarnings`).

    The `pgq` loggers log at INFO by default (`level`), DEBUG with `-v`. Other
    loggers (a handler's own, `logging.getLogger("shop")`) log at INFO too, or
    at `level` when that is higher, unless they set a level of their own;
    `LIBRARIES` (psycopg, SQLAlchemy, ...) at WARNING. Only the CLI calls this:
    the library never configures logging. Calling it again (tests invoke the
    CLI many times in one process) replaces the handler it installed.
    """
    use_format(log_format)
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if _chosen["format"] == "json" else TextFormatter())
    root = logging.getLogger()
    for logger in (root, logging.getLogger("pgq")):
        for old in list(logger.handlers):
            if isinstance(old, _StderrHandler):
                logger.removeHandler(old)
    root.addHandler(handler)
    named = logging.getLevelName((level or "INFO").upper())
    pgq_level = logging.DEBUG if verbose else named if isinstance(named, int) else logging.INFO
    logging.getLogger("pgq").setLevel(pgq_level)
    root.setLevel(max(logging.INFO, pgq_level))
    for name in LIBRARIES:
        library = logging.getLogger(name)
        if library.level == logging.NOTSET:
            library.setLevel(logging.WARNING)
    logging.captureWarnings(True)
