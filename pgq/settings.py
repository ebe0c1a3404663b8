"""Consumer settings: one frozen `Settings` object, loaded in layers.

Layers, lowest first:

1. the defaults declared on `Settings` (also readable as `DEFAULTS`);
2. a TOML config file: the `[consumer]` table holds the plain keys (`workers`,
   `lease`, ...), the `[breaker]` table the breaker keys without their prefix
   (`window`, `quorum`, ...);
3. environment variables `PGQ_<KEY>` (`PGQ_WORKERS`) and `PGQ_BREAKER_<KEY>`
   (`PGQ_BREAKER_QUORUM`), upper case; an empty variable counts as unset, as click
   treats it;
4. overrides in keyword spelling (`workers`, `breaker_window`); a `None` value
   means "not given", so click options can be passed straight through.

Values: integers are ints; rates and quorums are numbers in (0, 1]; durations are
seconds as int or float, or a duration string such as `"90s"`, `"5m"`, `"12h"`,
`"7d"`, `"1h30m"` or `"250ms"`. Every loaded layer may also give numbers as strings
(environment variables always do); `prefetch` also takes `"adaptive"` (the default:
follows the handlers' pace, from 2 × `workers` up to 4 × `batch_size`) and `"auto"`
(2 × `workers`).
`True` is not an integer. Constructing `Settings(...)` directly takes typed values
only; parsing strings is the loaders' job.

Every duration has a lower bound (`minimum` in its field's metadata, listed in
docs/configuration.md): below it a setting defeats its own purpose (a lease of 10 ms
expires before its first extension and a lone member re-runs its own rows; a poll
interval of 1 ms is a busy loop on the database), so it is a configuration error,
not a value to clamp silently.

Every value given is checked on its own, even when a higher layer overrides it, and
the final combination is checked as a whole (`breaker_min_calls <= breaker_window`,
each `*_max` at least its base, `breaker_member_ttl > breaker_heartbeat`,
`breaker_member_retention >= breaker_member_ttl`). A bad value, an unknown key or an
unreadable file raises `ConfigError` with one line that names the key, the value and
where it came from, e.g.
``invalid value for breaker.quorum in /etc/pgq.toml: 1.5 (must be in (0, 1])``.

Typo protection: every `PGQ_*` environment variable must be a setting or one of
`RESERVED_ENV_VARS` (read by other parts of pgq); anything else, such as
`PGQ_WROKERS`, is a `ConfigError` rather than silently ignored.

Who reads the environment: the CLI does (`load_settings(path)` with `os.environ`),
the library does not. `pgq.Consumer(engine, group, handler, **settings)` takes its
settings from keyword arguments and an optional explicit config file only
(`load_settings(config, env={}, overrides=settings)`), so a consumer embedded in an
application or a test behaves the same wherever it runs and is not reconfigured by
variables meant for a `pgq consume` process. Code that wants the CLI's behaviour
calls `load_settings()` itself. `load_settings` does not look at `PGQ_CONFIG`
either: the caller (click's `envvar=`) resolves the path.

Nothing is read at import time.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from pgq.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = [
    "DEFAULTS",
    "ENV_PREFIX",
    "RESERVED_ENV_VARS",
    "Settings",
    "load_settings",
    "minimum_text",
    "parse_duration",
    "settings_from_kwargs",
]

ENV_PREFIX = "PGQ_"
"""Prefix of the environment variables that set settings."""

RESERVED_ENV_VARS: frozenset[str] = frozenset(
    {
        "PGQ_DSN",
        "PGQ_SESSION_DSN",
        "PGQ_HOME",
        "PGQ_SCHEMA",
        "PGQ_CONFIG",
        "PGQ_TEST_DSN",
        "PGQ_CITUS_DSN",
        "PGQ_TEST_DISTRIBUTED",
        "PGQ_LOG_LEVEL",
        "PGQ_LOG_FORMAT",
        "PGQ_WEB_TOKEN",
    }
)
"""`PGQ_*` variables that are not settings; `load_settings` leaves them alone."""

_BREAKER_PREFIX = "breaker_"

# Kinds of value, stored in each field's metadata.
_COUNT = "count"  # int >= 1
_COUNT0 = "count0"  # int >= 0
_DURATION = "duration"  # seconds, float > 0, or a duration string
_FRACTION = "fraction"  # float in (0, 1]
_PREFETCH = "prefetch"  # "adaptive", int >= 1, or "auto" (None) for 2 × workers
ADAPTIVE = "adaptive"
"""The `prefetch` value that lets the pool's bound follow the handlers' pace (the default)."""
AUTO = "auto"
"""The `prefetch` value for a fixed bound of 2 × `workers`."""


def _setting(default: object, kind: str, *, minimum: float | None = None) -> Any:
    return field(default=default, metadata={"kind": kind, "minimum": minimum})


@dataclass(frozen=True, slots=True)
class Settings:
    """How a consumer runs: the validated result of every configuration layer.

    Durations are float seconds. Build one with `load_settings` or
    `settings_from_kwargs` (which parse strings and say where a bad value came from),
    or directly with typed values; `dataclasses.replace` re-validates.
    """

    workers: int = _setting(8, _COUNT)
    """Worker threads running the handler."""
    batch_size: int = _setting(100, _COUNT)
    """Most rows one claim statement takes."""
    lease: float = _setting(30.0, _DURATION, minimum=1.0)
    """Seconds a claimed row stays ours; extended by the heartbeat thread while it runs."""
    max_attempts: int = _setting(5, _COUNT)
    """Finished attempts after which a failing message is dead."""
    max_reclaims: int = _setting(3, _COUNT0)
    """Reclaims after lost leases past which a row is dead."""
    retry_backoff: float = _setting(1.0, _DURATION, minimum=0.01)
    """Backoff before the second attempt; doubles per attempt, with jitter."""
    retry_backoff_max: float = _setting(300.0, _DURATION, minimum=0.01)
    """Cap on the retry backoff."""
    poll_interval: float = _setting(1.0, _DURATION, minimum=0.05)
    """Idle fetchers poll this often when no NOTIFY arrives."""
    shutdown_grace: float = _setting(30.0, _DURATION, minimum=0.1)
    """On shutdown, how long running handlers may take to finish."""
    prefetch: int | str | None = _setting(ADAPTIVE, _PREFETCH)
    """Most unstarted rows held in the buffered-claim pool: "adaptive" (the default)
    follows the handlers' pace (2 × workers up to 4 × batch_size, decision 0019); a
    number is an exact bound; "auto" (or None) means 2 × workers."""
    handler_timeout: float = _setting(300.0, _DURATION, minimum=0.1)
    """A handler running longer fails as systemic (TimeoutError)."""
    retention: float = _setting(604800.0, _DURATION, minimum=60.0)
    """Messages done in every group are deleted after this age (7 days)."""
    breaker_window: int = _setting(20, _COUNT)
    """Local breaker: finished attempts in the sliding window."""
    breaker_min_calls: int = _setting(5, _COUNT)
    """Local breaker: attempts needed in the window before it can trip."""
    breaker_failure_rate: float = _setting(0.5, _FRACTION)
    """Local breaker: systemic share of the window that trips it."""
    breaker_open_for: float = _setting(5.0, _DURATION, minimum=0.1)
    """Local breaker: wait before its own probe; doubles while probes fail."""
    breaker_open_for_max: float = _setting(300.0, _DURATION, minimum=0.1)
    """Local breaker: cap on that wait."""
    breaker_heartbeat: float = _setting(2.0, _DURATION, minimum=0.1)
    """Members heartbeat their local state this often."""
    breaker_member_ttl: float = _setting(10.0, _DURATION, minimum=0.5)
    """A member is live while its last heartbeat is younger than this."""
    breaker_member_retention: float = _setting(86400.0, _DURATION, minimum=0.5)
    """Members that left or died are forgotten (their rows deleted) this long after (1 day)."""
    breaker_quorum: float = _setting(0.5, _FRACTION)
    """Share of live members whose local trips open the group."""
    breaker_min_members: int = _setting(2, _COUNT)
    """Fewest tripped live members that open the group; 1 for a single consumer."""
    breaker_probe_interval: float = _setting(5.0, _DURATION, minimum=0.1)
    """Wait between group probes while the group is open; doubles while they fail."""
    breaker_probe_interval_max: float = _setting(300.0, _DURATION, minimum=0.1)
    """Cap on the wait between group probes."""
    breaker_max_refunds: int = _setting(3, _COUNT0)
    """Refunds after which a row stays dead (refund cap)."""
    breaker_prober_turns: int = _setting(3, _COUNT)
    """Systemic probe failures in a row after which the prober hands over the lock."""

    def __post_init__(self) -> None:
        origins: dict[str, _Origin] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            rank = 0 if value == f.default else 1
            origins[f.name] = _Origin(f.name, "", rank, value)
            object.__setattr__(self, f.name, _check_value(f.name, value, origins[f.name]))
        _check_relations(self.as_dict(), origins)

    @property
    def effective_prefetch(self) -> int:
        """The pool's bound on unstarted rows: `prefetch`, or 2 × `workers` if unset
        (and where an adaptive bound starts)."""
        return self.prefetch if isinstance(self.prefetch, int) else 2 * self.workers

    def as_dict(self) -> dict[str, Any]:
        """Every setting in keyword spelling and field order (`prefetch` may be None).

        `Settings(**s.as_dict()) == s`.
        """
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


_FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(Settings)}

DEFAULTS: Mapping[str, Any] = MappingProxyType({n: f.default for n, f in _FIELDS.items()})
"""Every setting's default in keyword spelling (read-only)."""

_ENV_NAMES: dict[str, str] = {ENV_PREFIX + name.upper(): name for name in _FIELDS}


class _Origin(NamedTuple):
    """Where a value came from, for error messages."""

    key: str  # as the user spelled it: "breaker.quorum", "PGQ_WORKERS", "workers"
    where: str  # "in /etc/pgq.toml", "in the environment", "" (default or constructor)
    rank: int  # 0 default, then higher for each later layer
    raw: object  # the value as given


def _invalid(origin: _Origin, reason: str) -> ConfigError:
    where = f" {origin.where}" if origin.where else ""
    return ConfigError(f"invalid value for {origin.key}{where}: {origin.raw!r} ({reason})")


def _unknown(what: str, where: str, choices: list[str]) -> ConfigError:
    hint = difflib.get_close_matches(what, choices, n=1)
    suggestion = f" (did you mean {hint[0]}?)" if hint else ""
    return ConfigError(f"unknown setting {what} {where}{suggestion}")


# --- durations ----------------------------------------------------------------

_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_UNIT_ORDER = list(_UNITS)
_DURATION_PART = re.compile(r"\s*(\d+(?:\.\d+)?|\.\d+)(ms|d|h|m|s)", re.ASCII)
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
"""A number as ASCII digits (`float()` also takes `'٣'`, `'１'`, `'1_000'` and `'nan'`)."""
_INTEGER = re.compile(r"[+-]?\d+", re.ASCII)


def _ascii(text: str, pattern: re.Pattern[str]) -> str:
    """`text` if `pattern` matches all of it, else `ValueError`."""
    if not pattern.fullmatch(text):
        raise ValueError(text)
    return text


def parse_duration(text: str) -> float:
    """Seconds in a duration string: `"90"`, `"1.5"`, `"90s"`, `"5m"`, `"12h"`,
    `"7d"`, `"1h30m"`, `"250ms"`.

    Units are `d`, `h`, `m`, `s` and `ms`, lower case, largest first, each at most
    once. A bare number is seconds. Raises `ValueError` for anything else, including
    values that are not finite; the sign is not checked here.
    """
    s = text.strip()
    if _NUMBER.fullmatch(s):
        seconds = float(s)
        if not math.isfinite(seconds):
            raise ValueError(f"not a finite duration: {text!r}")
        return seconds
    if not s:
        raise ValueError("empty duration")
    total = 0.0
    pos = 0
    smallest = -1  # index in _UNIT_ORDER of the last unit seen
    while pos < len(s):
        m = _DURATION_PART.match(s, pos)
        if m is None:
            raise ValueError(f"not a duration: {text!r}")
        unit = _UNIT_ORDER.index(m.group(2))
        if unit <= smallest:
            raise ValueError(f"not a duration: {text!r} (units largest first, each once)")
        smallest = unit
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    return total


# --- checks -------------------------------------------------------------------

_MAXIMA = {"workers": 1000, "batch_size": 10_000, "prefetch": 100_000, "breaker_window": 100_000}
"""Upper bounds of the counts that size threads and buffers (a typo must not start
a million threads)."""

_MAX_COUNT = 2**31 - 1
"""Every other count is compared with an integer column in SQL."""

MAX_DURATION = 10 * 365 * 86400.0
"""The longest duration a setting takes (ten years): beyond it a timer or a
database interval overflows, and no wait in pgq needs longer."""

_DURATION_HELP = "a number of seconds or a duration such as '90s', '5m', '1h30m'"


def _check_value(name: str, value: object, origin: _Origin) -> Any:
    """Type and range of one typed value; returns it normalized (floats as float)."""
    kind = _FIELDS[name].metadata["kind"]
    if kind == _PREFETCH and value in (None, AUTO, ADAPTIVE):
        return value
    if kind in (_COUNT, _COUNT0, _PREFETCH):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _invalid(origin, "must be an integer")
        minimum = 0 if kind == _COUNT0 else 1
        if value < minimum:
            raise _invalid(origin, f"must be >= {minimum}")
        maximum = _MAXIMA.get(name, _MAX_COUNT)
        if value > maximum:
            raise _invalid(origin, f"must be <= {maximum}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(
            origin, f"must be {_DURATION_HELP}" if kind == _DURATION else "must be a number"
        )
    number = float(value)
    if kind == _FRACTION:
        if not 0.0 < number <= 1.0:
            raise _invalid(origin, "must be in (0, 1]")
    elif not number >= _FIELDS[name].metadata["minimum"]:
        raise _invalid(origin, f"must be at least {minimum_text(name)}")
    elif not number <= MAX_DURATION:  # also NaN and infinity
        raise _invalid(origin, f"must be at most {MAX_DURATION:.0f} seconds (10 years)")
    return number


def minimum_text(name: str) -> str:
    """A duration setting's lower bound in words: `'1 second'`, `'0.05 seconds'`."""
    minimum = _FIELDS[name].metadata["minimum"]
    return "1 second" if minimum == 1 else f"{minimum:g} seconds"


def _parse(name: str, raw: object, origin: _Origin) -> Any:
    """Turn a loaded value (maybe a string) into a checked typed value."""
    kind = _FIELDS[name].metadata["kind"]
    value = raw
    if isinstance(raw, str):
        text = raw.strip()
        try:
            if kind == _PREFETCH and text in (AUTO, ADAPTIVE):
                value = text
            elif kind in (_COUNT, _COUNT0, _PREFETCH):
                value = int(_ascii(text, _INTEGER))
            elif kind == _DURATION:
                value = parse_duration(text)
            else:
                value = float(_ascii(text, _NUMBER))
        except ValueError:
            reason = {
                _COUNT: "must be an integer",
                _COUNT0: "must be an integer",
                _PREFETCH: "must be an integer, 'auto' or 'adaptive'",
                _DURATION: f"must be {_DURATION_HELP}",
                _FRACTION: "must be a number",
            }[kind]
            raise _invalid(origin, reason) from None
    return _check_value(name, value, origin)


# (subject, operator, reference): subject must stand in that relation to reference.
# When both come from the same layer the subject is blamed, else the later one.
_RELATIONS = (
    ("retry_backoff_max", ">=", "retry_backoff"),
    ("breaker_open_for_max", ">=", "breaker_open_for"),
    ("breaker_probe_interval_max", ">=", "breaker_probe_interval"),
    ("breaker_min_calls", "<=", "breaker_window"),
    ("breaker_member_ttl", ">", "breaker_heartbeat"),
    ("breaker_member_retention", ">=", "breaker_member_ttl"),
)
_FLIP = {">=": "<=", "<=": ">=", ">": "<", "<": ">"}
_HOLDS = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
}


def _check_relations(values: Mapping[str, Any], origins: Mapping[str, _Origin]) -> None:
    """Checks across settings; `values` are typed and individually valid."""
    for subject, op, reference in _RELATIONS:
        if _HOLDS[op](values[subject], values[reference]):
            continue
        if origins[reference].rank > origins[subject].rank:
            subject, op, reference = reference, _FLIP[op], subject
        ref = origins[reference]
        ref_where = f" {ref.where}" if ref.where else ""
        by_default = " by default" if ref.rank == 0 else ""
        raise _invalid(
            origins[subject],
            f"must be {op} {ref.key}{ref_where}, which is {ref.raw!r}{by_default}",
        )


# --- loading ------------------------------------------------------------------


MAX_CONFIG_BYTES = 1024 * 1024
"""The largest config file pgq reads (1 MiB; a real one is a few hundred bytes)."""


def _read_file(path: str) -> dict[str, Any]:
    """The TOML tables of a config file: a regular file of at most `MAX_CONFIG_BYTES`.

    Opened without blocking and checked before it is read, so `/dev/zero` (which
    grew pgq to 4 GB in seconds), a FIFO with no writer or a huge file is one
    `ConfigError`, in no time and no memory.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as fp:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(f"cannot read config file {path}: not a regular file")
            data = fp.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        reason = exc.strerror or exc.__class__.__name__
        raise ConfigError(f"cannot read config file {path}: {reason}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"cannot read config file {path}: larger than 1 MiB")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"invalid TOML in {path}: not UTF-8 ({exc.reason})") from None
    except tomllib.TOMLDecodeError as exc:
        message = " ".join(str(exc).split())
        raise ConfigError(f"invalid TOML in {path}: {message}") from None


def _file_layer(path: str) -> dict[str, tuple[Any, _Origin]]:
    """Settings in a config file, keyed by keyword spelling, checked one by one."""
    where = f"in {path}"
    tables: dict[str, dict[str, str]] = {
        "consumer": {n: n for n in _FIELDS if not n.startswith(_BREAKER_PREFIX)},
        "breaker": {
            n.removeprefix(_BREAKER_PREFIX): n for n in _FIELDS if n.startswith(_BREAKER_PREFIX)
        },
    }
    found: dict[str, tuple[Any, _Origin]] = {}
    for table, content in _read_file(path).items():
        if table not in tables:
            what = f"table [{table}]" if isinstance(content, dict) else f"top-level key {table}"
            raise ConfigError(f"unknown {what} {where} (settings go in [consumer] or [breaker])")
        if not isinstance(content, dict):
            raise ConfigError(f"{table} {where} must be a table: [{table}]")
        keys = tables[table]
        for key, raw in content.items():
            dotted = f"{table}.{key}"
            if key not in keys:
                if table == "consumer" and key.startswith(_BREAKER_PREFIX):
                    short = key.removeprefix(_BREAKER_PREFIX)
                    raise ConfigError(
                        f"unknown setting {dotted} {where} (breaker settings go in [breaker]"
                        f" without the prefix: {short})"
                    )
                choices = [f"{table}.{k}" for k in keys]
                raise _unknown(dotted, where, choices)
            name = keys[key]
            origin = _Origin(dotted, where, 1, raw)
            found[name] = (_parse(name, raw, origin), origin)
    return found


def _env_layer(env: Mapping[str, str]) -> dict[str, tuple[Any, _Origin]]:
    where = "in the environment"
    found: dict[str, tuple[Any, _Origin]] = {}
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX) or var in RESERVED_ENV_VARS:
            continue
        if var not in _ENV_NAMES:
            raise _unknown(var, where, [*_ENV_NAMES, *RESERVED_ENV_VARS])
        if raw == "":
            continue
        name = _ENV_NAMES[var]
        origin = _Origin(var, where, 2, raw)
        found[name] = (_parse(name, raw, origin), origin)
    return found


def _override_layer(overrides: Mapping[str, object]) -> dict[str, tuple[Any, _Origin]]:
    where = "in arguments"
    found: dict[str, tuple[Any, _Origin]] = {}
    for name, raw in overrides.items():
        if name not in _FIELDS:
            raise _unknown(name, where, list(_FIELDS))
        if raw is None:
            continue
        origin = _Origin(name, where, 3, raw)
        found[name] = (_parse(name, raw, origin), origin)
    return found


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Settings:
    """Settings from the defaults, a TOML file, `PGQ_*` variables and overrides.

    Each layer overrides the ones before it, in that order. `config_file` None
    means no file (`PGQ_CONFIG` is not consulted here). `env` defaults to
    `os.environ`; pass `{}` to ignore the environment. `overrides` use keyword
    spelling; `None` values are skipped so click options pass straight through.

    Typo protection: an unknown table or key in the file, a breaker key under
    `[consumer]`, an unknown override key, and any `PGQ_*` variable that is
    neither a setting nor in `RESERVED_ENV_VARS` raise `ConfigError`, as do a
    missing or unreadable file, invalid TOML and every invalid value (checked
    even when a later layer overrides it).
    """
    values: dict[str, Any] = dict(DEFAULTS)
    origins: dict[str, _Origin] = {n: _Origin(n, "", 0, v) for n, v in DEFAULTS.items()}
    layers = []
    if config_file is not None:
        layers.append(_file_layer(os.fspath(config_file)))
    layers.append(_env_layer(os.environ if env is None else env))
    layers.append(_override_layer(overrides or {}))
    for layer in layers:
        for name, (value, origin) in layer.items():
            values[name] = value
            origins[name] = origin
    _check_relations(values, origins)
    return Settings(**values)


def settings_from_kwargs(**kwargs: object) -> Settings:
    """Settings from keyword arguments over the defaults; no file, no environment.

    Strings are parsed as by `load_settings` (`lease="5m"`); `None` means "not given".
    """
    return load_settings(None, env={}, overrides=kwargs)
