"""Every `pgq` command, registered on the root group: the only module that knows
them all (and the only one that imports the command modules).

Imported on first use of `pgq.cli.cli` or by `pgq.cli.main`, after the stop
signals are held (`pgq.cli.startup`).
"""

from __future__ import annotations

from pgq.cli import admin, consume, demo, grant, inspect, lifecycle, server, setup, web
from pgq.cli.base import cli

__all__ = ["cli"]

for _command in (
    setup.init,
    setup.topic,
    lifecycle.topics_command,
    setup.subscribe,
    lifecycle.unsubscribe_command,
    setup.publish,
    inspect.status,
    inspect.members,
    inspect.breaker,
    inspect.dead,
    inspect.check,
    admin.show_command,
    admin.requeue_command,
    admin.purge_command,
    admin.audit_command,
    grant.grant_command,
    consume.consume,
    server.server,
    demo.demo,
    web.web,
):
    cli.add_command(_command)
setup.topic.add_command(lifecycle.topic_delete)
