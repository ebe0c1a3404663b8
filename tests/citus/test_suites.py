"""pgq's own integration and acceptance tests, run on a real Citus cluster.

Each test here runs one selection of existing tests in a child pytest, with
`PGQ_TEST_DSN` set to the coordinator of `$PGQ_CITUS_DSN` and
`PGQ_TEST_DISTRIBUTED=1`: the database fixtures then give every test a schema of
its own in the coordinator's database, migrated with
`pgq.migrate(engine, distributed=True)` (tests/fixtures/database.py), and every
connection of the child, of the members and of the `pgq` commands it starts refuses
a statement of several tasks (`citus.multi_task_query_log_level = error`, added to
the DSN there): a statement of pgq that is not one task fails its test, unless it is
one of the named `pgq.store.placement.Spanning`. So the README's one `pytest` (what
`.ci/run` runs) covers the cluster too. A selection
fails with the tail of the child's output; skipped without `PGQ_CITUS_DSN`.

The selection is of tests about behaviour a user relies on (publish and subscribe,
draining exactly once, out-of-order commits, a `kill -9` and its reclaim, an outage
of three members, reconciliation, retention, removing a group or a topic and the
audit trail, the dashboard's messages page and its bulk actions, the history
checker), not about single-server internals (plans,
`pg_stat_*`, the embedded server, roles). Left out on purpose: the `test_races.py`
tests that wait for a backend's `Lock` wait in `pg_stat_activity` (on Citus today
the topic row lock is taken on a worker's shard of the reference table, so the
coordinator's backend never shows it: they time out, not fail; 0023 §3.4). Run one
by hand, e.g.

    PGQ_TEST_DSN=postgresql://postgres@127.0.0.1:9701/postgres PGQ_TEST_DISTRIBUTED=1 \\
        pytest tests/acceptance/test_consume_cli.py::test_until_empty_drains_five_thousand_messages
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

CITUS_DSN = os.environ.get("PGQ_CITUS_DSN", "")
ROOT = Path(__file__).resolve().parents[2]
HISTORY_SECONDS = 30
"""How long the history run (tests/chaos/test_topics.py) lasts here; longer runs:
`scripts/citus_history.py --seconds 300`."""

TEST_TIMEOUT = 40
"""Seconds a child test without a timeout of its own may take (pytest-timeout)."""

pytestmark = [
    pytest.mark.citus,
    pytest.mark.slow,
    pytest.mark.skipif(
        not CITUS_DSN,
        reason="PGQ_CITUS_DSN is not set: no Citus coordinator to run the suites on"
        " (../shared/citus/cluster.sh start, then PGQ_CITUS_DSN=postgresql://postgres@127.0.0.1:9701/postgres)",
    ),
]

INT, ACC = "tests/integration", "tests/acceptance"
FIND, WEB = f"{INT}/test_message_search.py", f"{INT}/test_attack_web_messages.py"

SUITES: dict[str, tuple[float, list[str]]] = {
    # name: (seconds the child may take, node ids); one server runs all of them in ~110 s
    "publish_subscribe": (
        60,
        [
            f"{INT}/test_publish.py",
            f"{INT}/test_races.py::test_a_transaction_begun_before_a_subscribe_publishes_to_the_new_group",
            f"{INT}/test_races.py::test_publishing_on_a_connection_joins_its_transaction_begun_or_not",
            f"{INT}/test_races.py::test_publishers_racing_subscribes_leave_no_group_without_a_message",
        ],
    ),
    "ordered_groups": (90, [f"{INT}/test_ordered.py"]),
    "message_history": (150, [f"{INT}/test_history.py"]),
    "idempotent_publish": (
        60,
        [
            f"{INT}/test_dedupe.py::test_a_key_published_again_returns_the_first_id_and_inserts_nothing",
            f"{INT}/test_dedupe.py::test_publish_many_folds_repeated_keys_and_answers_every_position",
            f"{INT}/test_dedupe.py::test_a_key_published_twice_in_one_transaction_is_one_message",
            f"{INT}/test_dedupe.py::test_threads_publishing_the_same_keys_at_once_end_with_one_message_per_key",
            f"{INT}/test_dedupe.py::test_processes_publishing_the_same_keys_at_once_end_with_one_message_per_key",
            f"{INT}/test_dedupe.py::test_a_finished_message_still_retained_holds_its_key_and_retention_frees_it",
        ],
    ),
    "drain_exactly_once": (
        45,
        [
            f"{ACC}/test_consume_cli.py::test_until_empty_drains_five_thousand_messages",
            f"{INT}/test_consumer.py::test_consumer_as_a_context_manager_handles_what_is_published_meanwhile",
        ],
    ),
    "out_of_order_commits": (
        40,
        [
            f"{INT}/test_consumer.py::test_a_later_commit_is_delivered_at_once_but_the_frontier_waits_for_the_open_one",
        ],
    ),
    "frontier_under_load": (
        60,
        [f"{INT}/test_races.py::test_the_frontier_never_passes_an_unresolved_message_under_load"],
    ),
    "kill9_reclaim": (
        45,
        [
            f"{ACC}/test_consume_cli.py::test_rows_of_a_killed_consumer_are_reclaimed_by_another",
            f"{ACC}/test_member_liveness.py::test_a_killed_member_stops_counting_at_once",
        ],
    ),
    "outage_three_members": (
        60,
        [f"{ACC}/test_breaker.py::test_outage_opens_group_probes_once_and_refunds_on_close"],
    ),
    "reconciliation": (
        45,
        [
            f"{INT}/test_claim_during_reconciliation.py",
            f"{INT}/test_outage_charges.py::test_a_row_that_died_of_reclaims_during_the_outage_is_refunded_at_the_close",
        ],
    ),
    "retention": (
        30,
        [
            f"{INT}/test_races.py::test_retention_deletes_what_every_group_finished_despite_dead_and_ready_rows",
            f"{INT}/test_races.py::test_subscribes_racing_retention_never_leave_a_row_without_its_message",
        ],
    ),
    "group_lifecycle": (
        120,
        [
            f"{INT}/test_lifecycle.py",
            f"{INT}/test_audit_trail.py::test_a_requeue_or_purge_that_matched_nothing_writes_no_audit_row",
            f"{INT}/test_audit_trail.py::test_audit_never_crashes_on_what_the_table_holds",
        ],
    ),
    "messages_page": (
        150,
        [
            f"{FIND}::test_each_filter_finds_exactly_its_rows",
            f"{FIND}::test_published_time_range",
            f"{FIND}::test_keyset_pages_both_ways_cover_every_row_once",
            f"{FIND}::test_an_unindexed_filter_searches_a_bounded_window_and_says_where_it_stopped",
            f"{FIND}::test_requeue_and_purge_of_what_a_filter_matches_are_audited_as_ever",
            f"{FIND}::test_a_dedupe_key_finds_its_one_message_exactly_and_without_a_window",
            f"{INT}/test_web_browse.py::test_a_bulk_requeue_of_a_filter_is_confirmed_with_its_count_and_audited_by_name",
            f"{INT}/test_web_browse.py::test_a_bulk_purge_of_the_rows_ticked",
            f"{WEB}::test_the_previous_page_of_an_empty_search_window_shows_the_row_before_it",
            f"{WEB}::test_a_row_that_dies_after_the_confirmation_is_left_alone",
            f"{WEB}::test_a_selection_changes_only_its_own_groups_dead_rows_once",
            f"{WEB}::test_a_bulk_requeue_while_a_consumer_drains_the_group_loses_and_doubles_nothing",
            f"{WEB}::test_hostile_text_on_the_confirmation_and_in_the_filter_round_trip",
            f"{WEB}::test_a_hostile_dedupe_key_is_shown_visible_carried_exactly_and_requeued",
        ],
    ),
    "chart_samples": (
        60,
        [
            f"{INT}/test_samples.py::test_the_first_sample_of_a_minute_wins_and_holds_the_groups_numbers",
            f"{INT}/test_samples.py::test_a_running_member_writes_its_groups_sample_and_retention_drops_old_ones",
            f"{INT}/test_samples.py::test_unsubscribe_removes_the_groups_samples",
            f"{INT}/test_samples.py::test_samples_are_read_by_span",
            f"{INT}/test_web_charts.py::test_a_restarted_dashboard_draws_what_was_sampled_before_it",
        ],
    ),
    "history": (HISTORY_SECONDS + 90, ["tests/chaos/test_topics.py"]),
}


def child_env(**extra: str) -> dict[str, str]:
    """This environment, pointed at the cluster in distributed mode (wide, so that
    pytest's short summary keeps each failure's first error line)."""
    env = {k: v for k, v in os.environ.items() if k != "PGQ_CITUS_DSN"}
    env.update(PGQ_TEST_DSN=CITUS_DSN, PGQ_TEST_DISTRIBUTED="1", COLUMNS="240", **extra)
    return env


def run_suite(ids: list[str], limit: float, **extra: str) -> tuple[int | None, str]:
    """`pytest -q ids` in a child on the cluster; (exit code or None past `limit`, output)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids]
    # a test that hangs on the cluster fails after TEST_TIMEOUT, with its stack
    cmd.append(f"--timeout={TEST_TIMEOUT}")
    # a test about to be interrupted (below) shows its threads' stacks first
    cmd += ["-o", f"faulthandler_timeout={max(5, int(limit) - 8)}"]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=child_env(**extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its members too go when it is killed
    )
    try:
        out, _ = proc.communicate(timeout=limit)
        drop_schemas_of(proc.pid)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        # SIGINT first: pytest then prints where each test was and its summary
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its members, should any be left
        drop_schemas_of(proc.pid)
        return None, out


def drop_schemas_of(pid: int) -> None:
    """Drop the schemas a child left behind (its fixtures name them `t<pid>_<n>_<hex>`;
    one interrupted mid-test cannot drop its own)."""
    with psycopg.connect(CITUS_DSN, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '10s'")  # a killed child's backend may linger
        names = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname ~ %s",
            [f"^t{pid}_[0-9]+_[0-9a-f]{{6}}$"],
        ).fetchall()
        for (name,) in names:
            with contextlib.suppress(psycopg.errors.LockNotAvailable):
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name))
                )


def tail(text: str, lines: int = 40) -> str:
    """pytest's short summary (which test failed, with its first error line) and the
    last `lines` lines of the output."""
    all_lines = text.splitlines()
    start = next((i for i, ln in enumerate(all_lines) if "short test summary info" in ln), None)
    if start is None or start >= len(all_lines) - lines:
        return "\n".join(all_lines[-lines:])
    return "\n".join([*all_lines[start : start + 40], "...", *all_lines[-lines:]])


@pytest.mark.timeout(max(limit for limit, _ in SUITES.values()) + 60)
@pytest.mark.parametrize(
    ("limit", "ids"),
    [pytest.param(limit, ids, id=name) for name, (limit, ids) in SUITES.items()],
)
def test_suite_passes_on_the_cluster(limit: float, ids: list[str]) -> None:
    code, out = run_suite(ids, limit, CHAOSQ_TOPICS_SECONDS=str(HISTORY_SECONDS))
    if code is None:
        pytest.fail(f"still running after {limit:g}s on {CITUS_DSN}:\n{tail(out, 120)}")
    assert code == 0, f"exit {code} on {CITUS_DSN}:\n{tail(out)}"
