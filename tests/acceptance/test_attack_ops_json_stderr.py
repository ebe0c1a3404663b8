"""Attack (issue 21, decision 0032, DESIGN §7): "With `--log-format json` every line
pgq writes to stderr [...] is one JSON object".

`configure_logging` puts its handler on the `pgq` loggers (and waitress) only;
every other logger of the process falls through to Python's last-resort
handler, and `warnings` print themselves, as bare text on the same stderr:

- psycopg's own warning when the server's `TimeZone` is one Python's zoneinfo
  does not know (a POSIX spelling PostgreSQL accepts, `UTC+3`, set by the
  server's configuration, the role, or `PGTZ`): every command writes it;
- a handler's own log calls (`logging.getLogger("shop").warning(...)`) and
  warnings (`warnings.warn`), inside `pgq consume`.

And one pgq event of a member lacks the member's fields: `serving metrics`.

A log shipper reading `pgq consume --log-format json` then gets lines it cannot
parse, mixed with the JSON ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

from helpers import PGQ, consumer_env

import pgq

HANDLER = """
import logging
import warnings


def handle(msg):
    logging.getLogger("shop").warning("stock low for order %s", msg.id)
    warnings.warn("the handler's own warning", UserWarning, stacklevel=1)
"""


HANDLER_ARGS = ("--handler", "shop_handlers:handle", "--until-empty")


def not_json(stderr: str) -> list[str]:
    bad = []
    for line in stderr.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            bad.append(line)
            continue
        if not isinstance(event, dict):
            bad.append(line)
    return bad


def test_a_server_time_zone_python_does_not_know_keeps_every_line_json(orders, pgq_env):
    env = {**pgq_env, "PGTZ": "UTC+3"}
    for args in (["status", "billing"], ["check", "billing"], ["status", "nosuch"]):
        out = subprocess.run(
            [*PGQ, "--log-format", "json", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert not not_json(out.stderr), (args, out.stderr)


def test_a_handlers_own_log_lines_and_warnings_are_json_lines(orders, pgq_env, tmp_path):
    (tmp_path / "shop_handlers.py").write_text(textwrap.dedent(HANDLER))
    pgq.publish_many(orders, "orders", [{"n": i} for i in range(2)])
    env = consumer_env(pgq_env, tmp_path, PGQ_POLL_INTERVAL=0.1)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    out = subprocess.run(
        [*PGQ, "--log-format", "json", "consume", "billing", *HANDLER_ARGS],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert pgq.status(orders, "billing")["counts"]["done"] == 2
    assert not not_json(out.stderr), out.stderr


def test_the_metrics_endpoint_line_of_a_member_names_its_group_and_member(
    orders, pgq_env, tmp_path
):
    """`serving metrics host=... port=...` is this member's endpoint (its group's
    numbers, its name as a label), logged by `pgq.metrics.serving_metrics` on a
    plain logger before the member binds its fields: the one event of the run
    without `group` and `member`."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pgq.publish_many(orders, "orders", [{"n": 1}])
    env = consumer_env(pgq_env, tmp_path, PGQ_POLL_INTERVAL=0.1)
    member_args = (
        "--handler",
        "handlers:record",
        "--until-empty",
        "--name",
        "m1",
        "--metrics-port",
    )
    out = subprocess.run(
        [*PGQ, "--log-format", "json", "consume", "billing", *member_args, str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stderr.splitlines()]
    assert any(e["message"].startswith("serving metrics") for e in events), out.stderr
    unnamed = [
        e["message"] for e in events if e.get("group") != "billing" or e.get("member") != "m1"
    ]
    assert not unnamed, unnamed
