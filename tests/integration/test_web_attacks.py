"""`pgq web` and `pgq demo --web` attacked a second time (docs/defects.md).

Each test failed before the fix its docstring names; real processes, real
PostgreSQL, raw HTTP (`http.client`) so any method, header or body can be sent.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import re
import signal
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path

import psycopg
import pytest
from helpers import PGQ, finish, spawn_pgq, wait_until

import pgq

pytest.importorskip("flask")


def status_of(url: str, method: str = "GET", path: str = "/", timeout: float = 30) -> int:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def url_of(log: Path, proc: subprocess.Popen[str]) -> str:
    def printed() -> str:
        assert proc.poll() is None, log.read_text()
        found = re.search(r"^pgq web: (http://\S+/) ", log.read_text(), re.MULTILINE)
        return found.group(1) if found else ""

    return wait_until(printed, 60, "pgq web to print its URL", interval=0.1)


def unserved(port: int) -> int:
    """Nonzero while connections to the local TCP `port` wait for its server: in the
    listening socket's accept queue, or with request bytes it has not read (a count
    of such queues, from Linux's /proc/net/tcp and tcp6)."""
    waiting = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, queues = fields[1], fields[3], fields[4]
                if int(local.rsplit(":", 1)[1], 16) != port:
                    continue
                rx = int(queues.split(":")[1], 16)
                if state == "0A":  # LISTEN: rx is the accept queue's length
                    waiting += rx
                elif state == "01" and rx:  # ESTABLISHED, bytes the server has not read
                    waiting += 1
    return waiting


def demo_schemas(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'pgq\\_demo\\_%'"
        ).fetchall()
    return {r[0] for r in rows}


# -- signals ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_pgq_web_stops_on_sigterm_and_sighup_as_on_ctrl_c(engine, pgq_env, tmp_path, sig):
    """Failed before `stopping_on_signals` (pgq/cli/web.py): the default action killed
    the process (exit -15, -1) and every request in flight was cut off
    (docs/defects.md)."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    log = tmp_path / "web.log"
    proc = spawn_pgq(pgq_env, "web", "--port", "0", log=log)
    url = url_of(log, proc)
    port = urllib.parse.urlsplit(url).port
    answers: list[object] = []
    sent = threading.Semaphore(0)

    def browse() -> None:
        parts = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        try:
            conn.request("GET", "/groups/g")
            sent.release()
            resp = conn.getresponse()
            resp.read()
            answers.append(resp.status)
        except OSError as exc:
            answers.append(type(exc).__name__)
        finally:
            conn.close()

    threads = [threading.Thread(target=browse) for _ in range(8)]
    for th in threads:
        th.start()
    # the requests are in flight: all sent, and taken in by the server (accepted, read)
    for _ in threads:
        assert sent.acquire(timeout=30), answers
    wait_until(
        lambda: unserved(port) == 0,
        30,
        "the server to take the requests in",
        describe=lambda: unserved(port),
    )
    proc.send_signal(sig)
    code, out, _ = finish(proc, 30)
    for th in threads:
        th.join(30)
    assert code == 0, log.read_text()
    assert out == ""
    assert answers == [200] * 8
    assert "Traceback" not in log.read_text()
    with subprocess.Popen([*PGQ, "web", "--port", str(port)], env=pgq_env, stderr=subprocess.PIPE,
                          text=True) as again:  # fmt: skip
        assert again.stderr is not None
        assert "pgq web: http://" in again.stderr.readline()  # the port is free again
        again.send_signal(signal.SIGINT)
        assert again.wait(30) == 0


@pytest.mark.slow
def test_pgq_demo_web_drops_its_schema_on_sigterm(pg_dsn):
    """Failed before `stopping_on_signals`: SIGTERM during the story killed the demo
    (exit -15) and its scratch schema `pgq_demo_*` stayed in the database
    (docs/defects.md)."""
    before = demo_schemas(pg_dsn)
    proc = subprocess.Popen(
        [*PGQ, "demo", "--web", "--port", "0", "--dsn", pg_dsn],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("dashboard:"):
                break
        wait_until(lambda: demo_schemas(pg_dsn) - before, 30, "the demo's schema")
        proc.send_signal(signal.SIGTERM)
        code, _, err = finish(proc, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert demo_schemas(pg_dsn) - before == set()
    assert code == 1, err  # as Ctrl-C during the story: the story did not happen
    assert "Traceback" not in err


# -- closing ---------------------------------------------------------------------------


def test_closing_while_the_sampler_reads_logs_nothing(engine, caplog):
    """Failed before `run_sampler` stopped logging reads that `close()` itself ended:
    most closes logged `web sample failed error='cannot reach the database: ...
    server closed the connection unexpectedly'` (docs/defects.md)."""
    from pgq.store.samples import group_samples
    from pgq.web import WebOptions, dashboard_server

    pgq.create_topic(engine, "t")
    for i in range(20):
        pgq.subscribe(engine, f"g{i}", "t")
    caplog.set_level(logging.WARNING, logger="pgq")
    for _ in range(10):
        server = dashboard_server(engine, port=0, options=WebOptions(sample_every=0.0))
        server.start()
        try:
            # the sampler's first beat writes the minute's samples; later ones read
            wait_until(lambda: group_samples(engine, "g0", 3600), 10, "a sample")
        finally:
            server.close()
    assert [r.getMessage() for r in caplog.records] == []


def test_a_read_waiting_for_a_reader_when_the_reads_close_is_unavailable(engine):
    """Failed before: a read still queued for a reader thread when `close()` dropped
    it raised `CancelledError` out of `ReadDeadline.run` (an exception in the
    `pgq-web-sampler` thread, seen once in a loaded CI run of the test above); one
    asked after the close, `RuntimeError`. Both are now `DatabaseUnavailable`,
    which the dashboard takes as no news while it closes."""
    from pgq.errors import DatabaseUnavailable
    from pgq.store.deadline import ReadDeadline

    reads = ReadDeadline(engine, 1, "test-read")
    busy, release = threading.Event(), threading.Event()

    def hold(_engine):
        busy.set()
        release.wait(10)
        return "held"

    raised: list[BaseException] = []

    def queued() -> None:
        try:
            reads.run(10.0, lambda _engine: "late")
        except BaseException as exc:  # what the caller sees
            raised.append(exc)

    first = threading.Thread(target=lambda: reads.run(10.0, hold))
    first.start()
    assert busy.wait(10)
    second = threading.Thread(target=queued)
    second.start()
    queue = reads._readers._work_queue  # the executor's: reads no reader has taken yet
    wait_until(lambda: queue.qsize() == 1, 10, "the second read queued behind the busy one")
    closer = threading.Thread(target=reads.close)
    closer.start()
    # the close ends the queued read at once, while the busy reader still holds on
    second.join(10)
    assert not second.is_alive(), "the queued read waited for the busy reader"
    assert first.is_alive() and closer.is_alive()
    release.set()
    for thread in (first, second, closer):
        thread.join(10)
    assert [type(exc) for exc in raised] == [DatabaseUnavailable]
    with pytest.raises(DatabaseUnavailable):
        reads.run(1.0, lambda _engine: "after")


# -- changes from the dashboard ------------------------------------------------------


def test_a_purge_while_open_keeps_the_pending_rows_and_a_reload_changes_nothing(engine):
    """The form purge keeps the rows an OPEN breaker owes a refund, as `pgq purge`
    does, and says so on the page it redirects to. Failed before the change routes
    answered a browser with 303: the answer was the POST's own page (a reload posted
    it again, docs/defects.md)."""
    from helpers import kill, states
    from sqlalchemy import update

    from pgq import schema as t
    from pgq.web import WebOptions, dashboard_server

    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = pgq.publish_many(engine, "t", [{"n": i} for i in range(4)])
    with engine.begin() as conn:
        conn.execute(update(t.breaker).values(state="OPEN", epoch=1))
    kill(engine, ids[:2], "systemic", error_epoch=0, refunds=0)  # the outage's: pending
    kill(engine, ids[2:], "message")
    token = "attack-test-9e2c7a4f1b8d3065"
    server = dashboard_server(engine, port=0, token=token, options=WebOptions())
    server.start()
    try:
        parts = urllib.parse.urlsplit(server.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        conn.request(
            "POST",
            "/login",
            body=f"token={token}",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        resp = conn.getresponse()
        resp.read()
        cookie = resp.getheader("Set-Cookie", "").split(";", 1)[0]
        conn.request("GET", "/groups/g", headers={"Cookie": cookie})
        page = conn.getresponse().read().decode()
        found = re.search(r'name="csrf" value="([^"]+)"', page)
        assert found, page
        body = urllib.parse.urlencode({"reason": "clean up", "csrf": found.group(1)})
        headers = {
            "Cookie": cookie,
            "Origin": server.url.rstrip("/"),
            "Content-Type": "application/x-www-form-urlencoded",
        }
        conn.request("POST", "/groups/g/purge", body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 303
        location = resp.getheader("Location", "")
        assert re.fullmatch(r"/groups/g\?done=\d+&kept=2", location), location
        for _ in range(2):  # reloading the page it lands on changes nothing
            conn.request("GET", location, headers={"Cookie": cookie})
            page = conn.getresponse().read().decode()
            assert re.search(r'id="result">purged 2, kept 2 pending reconciliation \(audit', page)
        conn.close()
    finally:
        server.close()
    assert states(engine, "g") == {"dead": 2}
    assert {mid for mid, r in _rows(engine).items() if r == "dead"} == set(ids[:2])
    audit = pgq.monitor.audit(engine, "g")
    assert [(a["action"], a["count"]) for a in audit] == [("purge", 2)]


def _rows(engine) -> dict[int, str]:
    from helpers import rows

    return {mid: r.state for mid, r in rows(engine, "g").items()}


@pytest.mark.slow
def test_pgq_demo_web_with_its_port_taken_fails_before_the_story(pg_dsn):
    """Failed before `_port_free` (pgq/cli/demo.py): the demo created its schema and
    printed its first narration line, then failed to listen (exit 2 with a half-told
    story; docs/defects.md)."""
    import socket

    before = demo_schemas(pg_dsn)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [*PGQ, "demo", "--web", "--port", str(port), "--dsn", pg_dsn],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert proc.stderr.splitlines() == [
        f"pgq: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
    assert demo_schemas(pg_dsn) == before


# -- scale -------------------------------------------------------------------------------


def test_a_flapping_breakers_timeline_draws_no_state_it_did_not_read(engine, schema):
    """2,000 transitions ten seconds apart and 5,000 probes: the group page reads the
    newest 50 and 200 and says so. Failed before `truncated`: the 24 h timeline drew
    one CLOSED span over 99 % of the day (docs/defects.md)."""
    from sqlalchemy import text

    from pgq.web import WebOptions, dashboard_server

    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    [mid] = pgq.publish_many(engine, "t", [{"n": 1}])
    with engine.begin() as conn:
        conn.execute(
            text(
                f'INSERT INTO "{schema}".breaker_history (group_id, epoch, state, at, refunded)'
                " SELECT g.id, n, CASE WHEN n % 2 = 1 THEN 'OPEN' ELSE 'CLOSED' END,"
                " now() - make_interval(secs => (2001 - n) * 10), 0"
                f' FROM "{schema}".consumer_group g, generate_series(1, 2000) n'
            )
        )
        conn.execute(
            text(
                f'INSERT INTO "{schema}".probe (group_id, epoch, at, member, message_id, outcome)'
                " SELECT g.id, 1 + n % 2000, now() - make_interval(secs => (5001 - n) * 4),"
                " 'm' || n % 3, :mid, (ARRAY['failed', 'succeeded', 'inconclusive'])[1 + n % 3]"
                f' FROM "{schema}".consumer_group g, generate_series(1, 5000) n'
            ),
            {"mid": mid},
        )
        conn.execute(text(f'UPDATE "{schema}".breaker SET epoch = 2000'))
    server = dashboard_server(engine, port=0, options=WebOptions())
    server.start()
    try:
        started = time.monotonic()
        parts = urllib.parse.urlsplit(server.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        conn.request("GET", "/groups/g?window=24h")
        resp = conn.getresponse()
        page = resp.read().decode()
        took = time.monotonic() - started
        conn.close()
    finally:
        server.close()
    assert resp.status == 200
    assert took < 5, took  # measured 0.1-0.2 s
    svg = re.search(r'<svg class="timeline".*?</svg>', page, re.S)
    assert svg and len(svg.group(0)) < 100_000, len(svg.group(0)) if svg else page
    spans = re.findall(r'<rect class="span (\w+)" x="[\d.]+" y="4" width="([\d.]+)"', svg.group(0))
    assert spans[0][0] == "unread" and float(spans[0][1]) > 890, spans[:3]
    assert {cls for cls, _ in spans[1:]} == {"open", "closed"}
    assert "earlier transitions, not read" in page
    assert 'id="probes-cut"' in page and "only the last 200 probes" in page


def test_an_outage_is_logged_once_not_once_a_request(engine, serve_down, caplog):
    """Failed before the dashboard logged a streak of unavailable reads once: each
    request of each open page logged `web request failed ... cannot reach the
    database`, 41 lines for 40 requests here (docs/defects.md)."""
    caplog.set_level(logging.INFO, logger="pgq")
    server = serve_down
    paths = ["/groups/g?live=1", "/api/groups", "/healthz", "/"] * 10
    assert {status_of(server.url, path=p) for p in paths} == {503}
    # the sampler's first read may start the streak while the fixture starts the server
    records = caplog.get_records("setup") + caplog.records
    lines = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert lines[0].startswith("web database unavailable error=")


@pytest.fixture
def serve_down():
    """A dashboard over a database that refuses connections."""
    import socket

    from pgq.web import WebOptions, dashboard_server

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    gone = pgq.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", schema="nowhere")
    server = dashboard_server(gone, port=0, options=WebOptions(sample_every=3600))
    server.start()
    try:
        yield server
    finally:
        server.close()
        gone.dispose()


# -- where it listens ------------------------------------------------------------------


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("host", ["127.0.0.2", "[::1]"])
def test_a_loopback_host_in_any_form_listens_quietly_at_a_working_url(
    engine, pgq_env, tmp_path, host
):
    """Failed before `_loopback` and the bracket strip (pgq/cli/web.py): both warned
    `web listening beyond this machine`, and `[::1]` printed `http://[[::1]]:PORT/`
    (docs/defects.md)."""
    if ":" in host and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    log = tmp_path / "web.log"
    proc = spawn_pgq(pgq_env, "web", "--host", host, "--port", "0", log=log)
    try:
        url = url_of(log, proc)
        assert status_of(url, path="/healthz") == 200
    finally:
        proc.send_signal(signal.SIGINT)
        code, _, _ = finish(proc, 30)
    assert code == 0
    assert "beyond this machine" not in log.read_text()


# -- hostile input ------------------------------------------------------------------------


def test_live_on_a_page_without_a_live_part_answers_the_page(engine, caplog):
    """Failed before `LIVE_PAGES`: `/login?live=1` and a requeue or purge posted to
    `...?live=1` were a 500 with a traceback (TemplateNotFound), the changes after
    they were committed (docs/defects.md); `HEAD /login` was
    a 403 (docs/defects.md)."""
    from helpers import kill, states

    from pgq.web import WebOptions, dashboard_server

    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = pgq.publish_many(engine, "t", [{"n": 1}, {"n": 2}])
    kill(engine, ids, "message")
    caplog.set_level(logging.DEBUG)
    token = "attack-test-9e2c7a4f1b8d3065"
    server = dashboard_server(engine, port=0, token=token, options=WebOptions())
    server.start()
    parts = urllib.parse.urlsplit(server.url)
    answers = {}
    try:
        for method, path, body in (
            ("GET", "/login?live=1", None),
            ("HEAD", "/login?live=1", None),  # a 403 (a login without a token) before
            ("POST", "/groups/g/requeue?live=1", f"ids={ids[0]}&reason=x"),
            ("POST", "/groups/g/purge?live=1", "reason=x"),
        ):
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
            headers = {"Authorization": f"Bearer {token}"}
            if body:
                headers["Content-Type"] = "application/x-www-form-urlencoded"
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            page = resp.read().decode()
            answers[f"{method} {path}"] = resp.status
            if method == "POST":
                assert 'id="result"' in page, page
            conn.close()
    finally:
        server.close()
    assert answers == dict.fromkeys(answers, 200)
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    assert states(engine, "g") == {"ready": 1}
