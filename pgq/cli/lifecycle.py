"""A group's and a topic's whole life: `pgq topics`, `pgq topic delete`, `pgq unsubscribe`.

`pgq topics` lists every topic with the messages it retains and its groups;
`pgq topic delete NAME --reason TEXT` removes a topic without groups and its
messages; `pgq unsubscribe GROUP --reason TEXT [--force]` removes a group and
its rows, so that it no longer holds back retention. Both removals are audited
(`pgq audit --topic NAME`, `pgq audit GROUP`). `pgq.topics()`,
`pgq.delete_topic()` and `pgq.unsubscribe()` are the plain functions behind them.
"""

from __future__ import annotations

import click

from pgq.cli.base import State, emit, json_option, pass_state
from pgq.cli.render import table
from pgq.errors import UsageError
from pgq.read_models import Topics
from pgq.store.lifecycle import delete_topic, topics, unsubscribe

__all__ = ["topic_delete", "topics_command", "topics_lines", "unsubscribe_command"]


def _reason_given(reason: str | None) -> str:
    if not (reason or "").strip():
        raise UsageError("--reason is required and must not be empty")
    return reason or ""


def topics_lines(data: Topics) -> list[str]:
    """`pgq topics`: one row per topic, its groups comma-separated."""
    if not data.topics:
        return ["no topics"]
    return table(
        ("TOPIC", "MESSAGES", "GROUPS"),
        ((tp.name, tp.messages, ",".join(map(str, tp.groups)) or None) for tp in data.topics),
    )


@click.command("topics")
@json_option('a JSON object: {"topics": [...]}')
@pass_state
def topics_command(state: State, as_json: bool) -> None:
    """Every topic: the messages it retains and its groups."""
    emit(topics(state.engine), as_json, topics_lines)


@click.command("delete")
@click.argument("name")
@click.option("--reason", help="why (required; stored in the audit row)")
@pass_state
def topic_delete(state: State, name: str, reason: str | None) -> None:
    """Delete topic NAME and its messages (audited, with `--reason`).

    Refused (exit 2) while a group is subscribed to it: `pgq unsubscribe` them
    first. Prints `deleted topic NAME (N messages)`.
    """
    result = delete_topic(state.engine, name, reason=_reason_given(reason))
    click.echo(f"deleted topic {name} ({result.count} messages)")


@click.command("unsubscribe")
@click.argument("group")
@click.option("--reason", help="why (required; stored in the audit row)")
@click.option(
    "--force", is_flag=True, help="also while members are live (they find the group gone and stop)"
)
@pass_state
def unsubscribe_command(state: State, group: str, reason: str | None, force: bool) -> None:
    """Remove GROUP and its rows (audited, with `--reason`), so that it no longer holds
    back retention.

    Refused (exit 2) while a member is live unless `--force`. Prints
    `removed group GROUP (N rows)`.
    """
    result = unsubscribe(
        state.engine,
        group,
        reason=_reason_given(reason),
        force=force,
        member_ttl=state.settings.breaker_member_ttl,
    )
    forced = f", {len(result.forced)} live member(s) removed" if result.forced else ""
    click.echo(f"removed group {group} ({result.count} rows{forced})")
