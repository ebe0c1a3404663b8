"""Setting up and feeding a queue: `pgq init`, `pgq topic create`, `pgq subscribe`, `pgq publish`.

Each command is one call of the plain function behind it (`pgq.store.migrate`,
`create_topic`, `subscribe`, `publish_many`). `pgq publish` also owns the
parsing of its input: strict JSON, one payload per line from stdin, all of it
in one transaction (one bad line and nothing is published).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any, Literal

import click

from pgq.cli.base import PgqGroup, State, pass_state
from pgq.errors import InvalidPayload, UsageError
from pgq.names import check_name
from pgq.store import create_topic, migrate, publish_many, schema_of
from pgq.store import subscribe as subscribe_group
from pgq.store.topics import check_dedupe_key

__all__ = ["init", "parse_json", "parse_json_lines", "publish", "subscribe", "topic"]


# --- JSON input ---------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(text: str) -> Any:
    """Parse strict JSON (no NaN/Infinity); raises `ValueError` with a one-line reason."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}" if exc.lineno > 1 else f"column {exc.colno}"
        raise ValueError(f"{exc.msg} at {where}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


def parse_json_lines(lines: Iterable[bytes | str]) -> list[Any]:
    """One payload per non-blank line; a bad line raises `InvalidPayload` naming it.

    Bytes are decoded as UTF-8 (undecodable bytes make the line invalid).
    """
    payloads = []
    for number, line in enumerate(lines, start=1):
        try:
            text = line.decode() if isinstance(line, bytes) else line
            if not text.strip():
                continue
            payloads.append(parse_json(text))
        except ValueError as exc:  # UnicodeDecodeError is a ValueError too
            raise InvalidPayload(f"line {number}: invalid JSON: {exc}") from None
    return payloads


# --- the commands -------------------------------------------------------------


@click.command()
@click.option(
    "--distributed",
    is_flag=True,
    help="on a Citus coordinator: also distribute the tables by group (docs/scaling.md)",
)
@pass_state
def init(state: State, distributed: bool) -> None:
    """Create or upgrade the schema (safe to run concurrently)."""
    version = migrate(state.engine, distributed=distributed)
    where = ", distributed" if distributed else ""
    click.echo(f"schema {schema_of(state.engine)} at version {version}{where}")


@click.group(cls=PgqGroup)
def topic() -> None:
    """Manage topics."""


@topic.command("create")
@click.argument("name")
@pass_state
def topic_create(state: State, name: str) -> None:
    """Create topic NAME (idempotent)."""
    create_topic(state.engine, name)
    click.echo(f"topic {name}")


@click.command()
@click.argument("group")
@click.argument("topic")
@click.option(
    "--from",
    "start",
    type=click.Choice(["earliest", "latest"]),
    default="earliest",
    show_default=True,
    help="earliest: also every retained message; latest: only new ones",
)
@click.option(
    "--ordered",
    is_flag=True,
    help="handle the messages of each key one at a time, in publish order",
)
@pass_state
def subscribe(state: State, group: str, topic: str, start: str, ordered: bool) -> None:
    """Create consumer group GROUP on TOPIC (idempotent)."""
    begin: Literal["earliest", "latest"] = "latest" if start == "latest" else "earliest"
    subscribe_group(state.engine, group, topic, start=begin, ordered=ordered)
    click.echo(f"{'ordered group' if ordered else 'group'} {group} on topic {topic}")


@click.command()
@click.argument("topic")
@click.argument("payload", metavar="[JSON]", required=False)
@click.option("--key", help="label carried with every message")
@click.option(
    "--dedupe-key",
    help="publish once: while a message of the topic with this key is retained,"
    " print its id and insert nothing (one message only)",
)
@pass_state
def publish(
    state: State, topic: str, payload: str | None, key: str | None, dedupe_key: str | None
) -> None:
    """Publish one JSON message, or JSON lines from stdin (JSON `-` or absent).

    All of stdin is one transaction: one bad line and nothing is published.
    Prints the new ids, one per line (with `--dedupe-key`, the id of the message
    already there, if one is).
    """
    check_name("topic", topic)
    if dedupe_key is not None:
        check_dedupe_key(dedupe_key)
    if payload is None or payload == "-":
        payloads = parse_json_lines(sys.stdin.buffer)
    else:
        try:
            payloads = [parse_json(payload)]
        except ValueError as exc:
            raise InvalidPayload(f"invalid JSON: {exc}") from None
    keys = None
    if dedupe_key is not None:
        if len(payloads) != 1:
            raise UsageError(
                f"--dedupe-key publishes one message: got {len(payloads)} payloads on stdin"
            )
        keys = [dedupe_key]
    for mid in publish_many(state.engine, topic, payloads, key=key, dedupe_keys=keys):
        click.echo(str(mid))
