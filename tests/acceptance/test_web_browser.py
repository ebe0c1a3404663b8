"""`pgq web` in a real headless browser (issue 13): an operator watches an outage.

Chromium and ChromeDriver come from the system packages (`/usr/bin/chromium`,
`/usr/bin/chromedriver`); Selenium is pointed at both, so nothing downloads a
browser. Three real `pgq consume` members share a dependency that is down while
a flag file exists (tests/outage_handlers.py). The page is loaded once per
state change the test waits for; a marker set in the page proves no reload
happened. Screenshots of each state are saved in the test's directory (and in
`$PGQ_WEB_SCREENSHOTS` when set; the README's pictures come from
scripts/screenshots.py).
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import reap, wait_until
from members import ConsumeProcesses, consume_processes
from sqlalchemy import Engine, func, insert, select

import pgq
from pgq import monitor
from pgq import schema as t
from pgq.store import group_info
from pgq.store import samples as store_samples
from pgq.web import WebOptions, WebServer, dashboard_server

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")

SETTINGS = {
    "PGQ_WORKERS": 2,
    "PGQ_LEASE": 5,
    "PGQ_POLL_INTERVAL": 0.1,
    "PGQ_MAX_ATTEMPTS": 1,  # every failure before the trips kills its row: refunds to see
    "PGQ_RETRY_BACKOFF": 0.02,
    "PGQ_RETRY_BACKOFF_MAX": 0.05,
    "PGQ_BREAKER_WINDOW": 20,
    "PGQ_BREAKER_MIN_CALLS": 20,
    "PGQ_BREAKER_OPEN_FOR": 0.5,
    "PGQ_BREAKER_OPEN_FOR_MAX": 1,
    "PGQ_BREAKER_HEARTBEAT": 0.2,
    "PGQ_BREAKER_MEMBER_TTL": 1.5,
    # slow enough probing that the OPEN state is on screen for a while
    "PGQ_BREAKER_PROBE_INTERVAL": 0.5,
    "PGQ_BREAKER_PROBE_INTERVAL_MAX": 1,
}


@pytest.fixture
def browser() -> Iterator[object]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        if os.environ.get("CI"):
            pytest.fail("CI needs Debian's chromium and chromium-driver (.ci/run installs them)")
        pytest.skip("no /usr/bin/chromium and /usr/bin/chromedriver (apt install chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1100")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console()
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


class Members(ConsumeProcesses):
    def __init__(self, engine: Engine, env: dict[str, str], out: Path) -> None:
        super().__init__(engine, env, out, "outage_handlers:flaky", SETTINGS)


@pytest.fixture
def members(engine: Engine, pgq_env: dict[str, str], tmp_path: Path) -> Iterator[Members]:
    with consume_processes(Members, engine, pgq_env, tmp_path) as group:
        try:
            yield group
        finally:
            # every member reaped and its pipes closed, also one that had exited by
            # itself (a failed test's): `consume_processes` only reaps those still
            # running, and an open pipe collected later is a ResourceWarning that
            # fails whichever test runs then (the next one here, the admin requeue)
            for proc in group.procs.values():
                reap(proc)


@pytest.fixture
def web(engine: Engine) -> Iterator[WebServer]:
    options = WebOptions(member_ttl=1.5, refresh=0.5, sample_every=1.0)
    server = dashboard_server(engine, port=0, options=options)
    server.start()
    try:
        yield server
    finally:
        server.close()


def text_of(driver, css: str) -> str | None:
    """The element's text, or None while it is not there. A page that navigates
    between finding the element and reading it (a login's redirect, a refresh) is
    not there yet: Chromium says so either as a stale element or as an inspector
    error that the node left the document."""
    from selenium.common.exceptions import (
        NoSuchElementException,
        StaleElementReferenceException,
        WebDriverException,
    )

    try:
        return driver.find_element("css selector", css).text
    except (NoSuchElementException, StaleElementReferenceException):
        return None
    except WebDriverException as exc:
        if "does not belong to the document" in str(exc.msg):
            return None
        raise


def console(driver) -> list[str]:
    """The browser console's warnings and errors since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] in ("WARNING", "SEVERE")]


def shoot(driver, out: Path, name: str) -> Path:
    path = out / f"web-{name}.png"
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000, "an empty screenshot"
    if target := os.environ.get("PGQ_WEB_SCREENSHOTS"):
        shutil.copy(path, Path(target) / path.name)
    return path


def test_an_operator_watches_an_outage_open_probe_close_and_refund(browser, members, web, tmp_path):
    driver, engine = browser, members.engine
    ids = pgq.publish_many(engine, "t", [{"i": i} for i in range(120)])
    assert ids

    driver.get(web.url + "?all=1")
    wait_until(lambda: text_of(driver, 'tr[data-group="g"] .state') == "CLOSED", 10, "overview")
    shoot(driver, tmp_path, "overview")

    driver.get(web.url + "groups/g")
    driver.execute_script("window.pgqNotReloaded = true")
    assert text_of(driver, "#breaker-state") == "CLOSED"

    (members.out / "down").touch()
    for name in ("m1", "m2", "m3"):
        members.spawn(name)

    prober = wait_until(
        lambda: (
            text_of(driver, "#breaker-state") == "OPEN"
            and text_of(driver, "#prober") in ("m1", "m2", "m3")
            and text_of(driver, "#prober")
        ),
        60,
        "the page to show OPEN and a prober",
        describe=lambda: (
            text_of(driver, "#breaker-state"),
            monitor.status(engine, "g")["breaker"],
        ),
    )
    assert text_of(driver, f'#members tr[data-member="{prober}"] .tag') == "prober"
    # the probes fail while the dependency is down, and the timeline lists them
    # probes fail while the dependency is down, all through the one prober, and the
    # timeline lists each as it happens
    failed = '#events tr.event-probe[data-outcome="failed"]'
    wait_until(
        lambda: len(driver.find_elements("css selector", failed)) >= 3,
        30,
        "three failed probes on the timeline",
    )
    # newest first; a prober keeps its turn for `breaker.prober_turns` (3) probes
    first = [e.get_attribute("data-member") for e in driver.find_elements("css selector", failed)]
    assert len(set(first[-3:])) == 1, first
    shoot(driver, tmp_path, "open")
    assert driver.execute_script("return window.pgqNotReloaded === true"), "the page reloaded"

    (members.out / "down").unlink()

    def closed_with_refund() -> str | None:
        if text_of(driver, "#breaker-state") != "CLOSED":
            return None
        history = monitor.breaker_info(engine, "g")["history"]
        close = next(h for h in history if h["state"] == "CLOSED")
        if monitor.status(engine, "g")["lag"] or not close["refunded"]:
            return None  # the reconciliation or the drain still runs
        shown = text_of(driver, f'#events .refunded[data-epoch="{close["epoch"]}"]')
        drained = text_of(driver, "#lag") == "0"
        return shown if drained and shown == str(close["refunded"]) else None

    refunded = wait_until(closed_with_refund, 60, "the page to show CLOSED and the refund")
    assert int(refunded) > 0
    succeeded = '#events tr.event-probe[data-outcome="succeeded"]'
    assert driver.find_elements("css selector", succeeded), "no successful probe listed"
    assert text_of(driver, "#refunded-total") == str(
        monitor.status(engine, "g")["totals"]["refunded"]
    )
    shoot(driver, tmp_path, "closed")
    assert driver.execute_script("return window.pgqNotReloaded === true"), "the page reloaded"
    # the outage is shaded on each of the group's four charts
    shaded = driver.find_elements("css selector", "#charts svg.chart")
    assert len(shaded) == 4
    assert all(svg.find_elements("css selector", "rect.shade.open") for svg in shaded)

    # a refunded message's page tells its story: the outage's failures, the refund
    # at the close, the breaker's epochs it lived through
    a = t.attempt
    with engine.connect() as conn:
        refunded_id = conn.execute(
            select(a.c.message_id).where(a.c.event == "refunded").limit(1)
        ).scalar_one()
    driver.get(f"{web.url}groups/g/messages/{refunded_id}")
    wait_until(lambda: text_of(driver, "#history tr.event-refunded"), 10, "the refund line")
    events = [
        e.get_attribute("class") for e in driver.find_elements("css selector", "#history tbody tr")
    ]
    refund = events.index("event-refunded")
    assert {"event-failed", "event-died", "event-reclaimed"} & set(events[:refund]), events
    states = [e.text for e in driver.find_elements("css selector", "#epochs .state")]
    assert "OPEN" in states and "CLOSED" in states, states
    shoot(driver, tmp_path, "message-history")

    driver.get(web.url + "?all=1")
    wait_until(lambda: text_of(driver, 'tr[data-group="g"] .state') == "CLOSED", 10, "overview")
    # the charts have the outage's samples (the minute's: a line, or a point alone)
    drawn = 'tr[data-group="g"] svg.spark polyline, tr[data-group="g"] svg.spark circle'
    assert driver.find_elements("css selector", drawn)
    shoot(driver, tmp_path, "overview-after")
    # nothing in the console through the whole outage: no CSP violation, script error
    # or failed update (the live updates ran every 0.5 s)
    assert console(driver) == []
    members.stop_all()


def test_an_admin_logs_in_and_requeues_a_dead_row_from_the_browser(browser, engine):
    """The whole admin path in Chromium: the browser's own Origin and Sec-Fetch-Site
    headers, the session cookie and the form's CSRF token must all pass."""
    from helpers import kill

    driver = browser
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = pgq.publish_many(engine, "t", [{"n": 1}, {"n": 2}])
    kill(engine, ids[:1], "message")
    token = "browser-test-6d1f8b3e9a4c7025"
    server = dashboard_server(engine, port=0, token=token, options=WebOptions(refresh=0.5))
    server.start()
    try:
        driver.get(server.url + "groups/g")
        assert not driver.find_elements("css selector", "#requeue-form")  # not logged in
        driver.get(server.url + "login")
        driver.find_element("css selector", 'input[name="token"]').send_keys(token)
        driver.find_element("css selector", "form button").click()
        wait_until(lambda: text_of(driver, "#mode") == "admin", 10, "the admin session")
        assert token not in driver.current_url

        driver.get(server.url + "groups/g")
        form = driver.find_element("css selector", "#requeue-form")
        form.find_element("css selector", 'input[name="ids"]').send_keys(str(ids[0]))
        form.find_element("css selector", 'input[name="reason"]').send_keys("fixed upstream")
        form.find_element("css selector", "button").click()
        result = wait_until(lambda: text_of(driver, "#result"), 10, "the requeue's answer")
        assert result.startswith("requeued 1 (audit ")

        audit = monitor.audit(engine, "g")
        assert [(a["action"], a["count"], a["message_ids"], a["reason"]) for a in audit] == [
            ("requeue", 1, [ids[0]], "fixed upstream")
        ]
        assert audit[0]["actor"].endswith(" (pgq web)")
        assert monitor.status(engine, "g")["counts"]["dead"] == 0
        driver.get(server.url + "groups/g")
        assert text_of(driver, f'#audit tr[data-audit="{audit[0]["id"]}"]') is not None
    finally:
        server.close()


def test_reloading_the_answer_to_a_requeue_changes_nothing(browser, engine):
    """Failed before the change routes answered a browser with 303 (Post/Redirect/Get):
    the result page was the POST's own answer, so a reload posted the requeue again,
    requeuing what had died since under the first reason
    (docs/defects.md)."""
    from helpers import kill

    driver = browser
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = pgq.publish_many(engine, "t", [{"n": i} for i in range(4)])
    kill(engine, ids[:2], "message")
    token = "browser-test-6d1f8b3e9a4c7025"
    server = dashboard_server(engine, port=0, token=token, options=WebOptions(refresh=0.5))
    server.start()
    try:
        driver.get(server.url + "login")
        driver.find_element("css selector", 'input[name="token"]').send_keys(token)
        driver.find_element("css selector", "form button").click()
        wait_until(lambda: text_of(driver, "#mode") == "admin", 10, "the admin session")
        driver.get(server.url + "groups/g")
        form = driver.find_element("css selector", "#requeue-form")
        form.find_element("css selector", 'input[name="all"]').click()
        form.find_element("css selector", 'input[name="reason"]').send_keys("fixed")
        form.find_element("css selector", "button").click()
        result = wait_until(lambda: text_of(driver, "#result"), 10, "the requeue's answer")
        assert result.startswith("requeued 2 (audit "), result
        kill(engine, ids[2:], "message")  # later, other rows die
        driver.refresh()
        wait_until(lambda: text_of(driver, "#breaker-state"), 10, "the page again")
        driver.back()
        driver.forward()
        wait_until(lambda: text_of(driver, "#breaker-state"), 10, "the page again")
        assert [(a["action"], a["count"]) for a in monitor.audit(engine, "g")] == [("requeue", 2)]
        assert monitor.status(engine, "g")["counts"]["dead"] == 2
    finally:
        server.close()


def test_no_page_logs_a_console_error(browser, engine):
    """No CSP violation, script error or failed fetch on any page, live updates
    included (the 404 and 400 pages' own status aside). Failed before the pages named
    an icon: each browser session's first page logged `favicon.ico - Failed to load
    resource: 404` (docs/defects.md)."""
    driver = browser
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    [mid] = pgq.publish_many(engine, "t", [{"n": 1}])
    token = "browser-test-6d1f8b3e9a4c7025"
    server = dashboard_server(engine, port=0, token=token, options=WebOptions(refresh=0.2))
    server.start()
    pages = [
        "",
        "?all=1",
        "groups/g",
        "groups/g?window=1m",
        "groups/g?span=24h",
        f"groups/g/messages/{mid}",
        "login",
        "api/groups",
        "groups/nope",
        "groups/g?class=bogus",
        "groups/g/messages",
        "groups/g/messages?state=dead&order=desc",
        "groups/g/messages?field=n&value=1",
        "topics",
    ]
    try:
        found = {}
        for page in pages:
            url = server.url + page
            driver.get(url)
            if driver.find_elements("css selector", "#live"):
                wait_until(lambda: "live ·" in (text_of(driver, "#live-status") or ""), 10)
            found[page] = [line for line in console(driver) if not line.startswith(url + " ")]
        assert {page: lines for page, lines in found.items() if lines} == {}
    finally:
        server.close()


def chart_points(driver, label: str) -> int | None:
    """How many samples the chart named `label` draws (None while it is not there)."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    try:
        svg = driver.find_element("css selector", f'svg.chart[aria-label="{label}"]')
        return int(svg.get_attribute("data-points"))
    except (NoSuchElementException, StaleElementReferenceException):  # a live update swapped it
        return None


def test_the_charts_have_data_after_the_dashboard_restarts(browser, engine, tmp_path):
    """Issue 23: the charts come from the samples the database keeps, so a dashboard
    started again draws what was sampled before it (the overview's sparklines were
    empty after every start, and the group page had no chart)."""
    driver = browser
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    pgq.publish_many(engine, "t", [{"i": i} for i in range(30)])
    # the minute before, as a member of the group sampled it then (done: 0, lag: 10)
    gid = group_info(engine, "g").id
    with engine.begin() as conn:
        then = conn.scalar(select(func.date_trunc("minute", func.now() - dt.timedelta(minutes=1))))
        conn.execute(insert(t.group_sample).values(group_id=gid, at=then, done=0, lag=10, dead=0))
    options = {"refresh": 0.5, "member_ttl": 1.5}
    first = dashboard_server(engine, port=0, options=WebOptions(sample_every=0.2, **options))
    first.start()
    try:
        driver.get(first.url + "groups/g")
        wait_until(lambda: chart_points(driver, "lag of g") == 2, 10, "this minute's sample")
        driver.get("about:blank")  # no live update of its page fails at the close
    finally:
        first.close()
    console(driver)  # what the first dashboard's page logged is not the second's
    sampled = store_samples.group_samples(engine, "g", 3600)
    assert [s.lag for s in sampled] == [10, 30]

    # no live update while the page is read below (its elements would go stale)
    steady = {**options, "refresh": 3600.0}
    second = dashboard_server(engine, port=0, options=WebOptions(sample_every=3600, **steady))
    second.start()
    try:
        driver.get(second.url + "groups/g")
        labels = ("throughput of g", "lag of g", "oldest ready age of g", "dead rows of g")
        drawn = {label: chart_points(driver, label) for label in labels}
        assert drawn == dict(zip(labels, (1, 2, 2, 2), strict=True)), drawn
        lines = driver.find_elements("css selector", "#charts svg.chart polyline.line")
        assert len(lines) == 3  # throughput is one rate: a point
        assert all(
            svg.size["width"] > 300 for svg in driver.find_elements("css selector", "svg.chart")
        )
        ticks = [
            e.text for e in driver.find_elements("css selector", "#charts svg.chart text.tick")
        ]
        assert "30" in ticks and "0" in ticks  # the lag's value axis reaches its top
        assert not driver.find_elements("css selector", "#no-samples")
        shoot(driver, tmp_path, "charts-after-restart")
        driver.get(second.url + "?all=1")
        wait_until(lambda: text_of(driver, 'tr[data-group="g"] .lag') == "30", 10, "overview")
        assert driver.find_elements("css selector", 'tr[data-group="g"] svg.spark polyline')
        assert console(driver) == []
    finally:
        second.close()


def test_live_updates_keep_the_readers_scroll_and_selection(browser, engine):
    """Failed before live.js kept them: every update replaced the live part, so the
    payload's box jumped back to its top and a selection to copy was dropped, every
    refresh (docs/defects.md)."""
    from helpers import kill, set_rows

    driver = browser
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    [mid] = pgq.publish_many(engine, "t", [{"lines": [f"line {i}" for i in range(2000)]}])
    server = dashboard_server(engine, port=0, options=WebOptions(refresh=0.2))
    server.start()
    try:
        driver.get(f"{server.url}groups/g/messages/{mid}")
        wait_until(lambda: "live ·" in (text_of(driver, "#live-status") or ""), 10, "an update")
        driver.execute_script("document.getElementById('payload').scrollTop = 5000")
        scrolled = driver.execute_script("return document.getElementById('payload').scrollTop")
        assert scrolled > 4000
        kill(engine, [mid], "message")  # the live part changes, so it is swapped in
        wait_until(lambda: text_of(driver, "#message-state") == "dead", 10, "the new state")
        marker = driver.execute_script("return document.getElementById('live-status').textContent")
        wait_until(lambda: text_of(driver, "#live-status") != marker, 10, "one more update")
        assert driver.execute_script("return document.getElementById('payload').scrollTop") == (
            scrolled
        )
        driver.execute_script(
            "var r = document.createRange();"
            " r.selectNodeContents(document.getElementById('message-state'));"
            " var s = window.getSelection(); s.removeAllRanges(); s.addRange(r);"
        )
        set_rows(engine, [mid], state="ready")  # a change while the reader selects
        wait_until(lambda: text_of(driver, "#live-status") == "paused while text is selected", 10)
        assert driver.execute_script("return window.getSelection().toString()") == "dead"
        driver.execute_script("window.getSelection().removeAllRanges()")
        wait_until(lambda: text_of(driver, "#message-state") == "ready", 10, "updates again")
        assert console(driver) == []
    finally:
        server.close()


def test_a_dashboard_that_stops_answering_is_said_on_the_page(browser, engine, pgq_env, tmp_path):
    """Failed before live.js gave up an update after 5 refreshes (at least 10 s): with
    `pgq web` SIGSTOPped the update never ended and the page said `live · <time>` for
    good (docs/defects.md)."""
    import re
    import signal

    from helpers import finish, spawn_pgq

    driver = browser
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    log = tmp_path / "web.log"
    proc = spawn_pgq(pgq_env, "web", "--port", "0", log=log)
    try:
        found = wait_until(
            lambda: re.search(r"pgq web: (http://\S+/) ", log.read_text()), 30, "the URL"
        )
        driver.get(found.group(1) + "groups/g")
        wait_until(lambda: "live ·" in (text_of(driver, "#live-status") or ""), 10, "an update")
        proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(
                lambda: text_of(driver, "#live-status") == "connection lost, retrying",
                25,
                "the page to say the connection is lost",
            )
        finally:
            proc.send_signal(signal.SIGCONT)
        wait_until(lambda: "live ·" in (text_of(driver, "#live-status") or ""), 25, "updates again")
    finally:
        proc.send_signal(signal.SIGINT)
        code, _, _ = finish(proc, 30)
    assert code == 0, log.read_text()


# -- the job browser (issue 23) -------------------------------------------------------


def listed(driver) -> list[int]:
    """The message ids the messages page lists, in order."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('#messages tr[data-message]'))"
        ".map(function (e) { return Number(e.getAttribute('data-message')); })"
    )


def admin_login(driver, server, token: str) -> None:
    driver.get(server.url + "login")
    driver.find_element("css selector", 'input[name="token"]').send_keys(token)
    driver.find_element("css selector", "form button").click()
    wait_until(lambda: text_of(driver, "#mode") == "admin", 10, "the admin session")


def test_searching_by_payload_field_and_by_error_text(browser, engine, tmp_path):
    """The filters are typed into the form (keyboard only: Enter submits), land in the
    URL, and the link shared opens the same page."""
    from helpers import kill
    from selenium.webdriver.common.keys import Keys

    driver = browser
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = pgq.publish_many(
        engine, "t", [{"order": {"customer": f"c{i % 4}"}, "i": i} for i in range(40)]
    )
    kill(engine, ids[:10], "message", last_error="HTTP 502 from billing-api")
    kill(engine, ids[10:20], "permanent", last_error="schema mismatch in field total")
    server = dashboard_server(engine, port=0, options=WebOptions(refresh=0.5))
    server.start()
    try:
        driver.get(server.url + "groups/g")
        driver.find_element("css selector", "#dead-link").click()
        wait_until(lambda: len(listed(driver)) == 20, 10, "the dead rows")
        driver.get(server.url + "groups/g/messages")
        driver.find_element("css selector", 'input[name="field"]').send_keys("order.customer")
        value = driver.find_element("css selector", 'input[name="value"]')
        value.send_keys("c3", Keys.ENTER)
        wait_until(lambda: "field=order.customer" in driver.current_url, 10, "the search")
        assert listed(driver) == [m for i, m in enumerate(ids) if i % 4 == 3]
        shared = driver.current_url
        shoot(driver, tmp_path, "messages-by-field")

        driver.get(server.url + "groups/g/messages")
        error = driver.find_element("css selector", 'input[name="error"]')
        error.send_keys("502 FROM billing", Keys.ENTER)  # any case
        wait_until(lambda: "error=502" in driver.current_url, 10, "the search")
        assert listed(driver) == ids[:10]
        texts = driver.find_elements("css selector", "#messages td.error-text")
        assert {e.text for e in texts} == {"HTTP 502 from billing-api"}
        # each time shows how long ago, the absolute time on hover
        stamp = driver.find_element("css selector", "#messages time")
        assert stamp.text.endswith("ago") and stamp.get_attribute("title").endswith("+00:00")

        driver.get(shared)  # the link again: the same rows
        assert listed(driver) == [m for i, m in enumerate(ids) if i % 4 == 3]
        assert driver.find_element("css selector", 'input[name="value"]').get_attribute(
            "value"
        ) == ("c3")
        assert console(driver) == []
    finally:
        server.close()


def test_paging_through_ten_thousand_dead_rows(browser, engine):
    """Next to the end and back again: every row once, in order, both ways."""
    from helpers import kill

    driver = browser
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = pgq.publish_many(engine, "t", [{"i": i} for i in range(10_000)])
    kill(engine, ids, "message")
    server = dashboard_server(engine, port=0)
    server.start()
    try:
        driver.get(server.url + "groups/g/messages?state=dead&limit=500")
        seen = listed(driver)
        while driver.find_elements("css selector", "#next"):
            before = seen[-1]
            driver.find_element("css selector", "#next").click()
            wait_until(lambda b=before: listed(driver) and listed(driver)[0] > b, 10, "a page")
            seen += listed(driver)
        assert seen == ids
        back: list[int] = []
        page = listed(driver)
        while driver.find_elements("css selector", "#prev"):
            back = page + back
            first = page[0]
            driver.find_element("css selector", "#prev").click()
            wait_until(lambda f=first: listed(driver) and listed(driver)[-1] < f, 10, "a page")
            page = listed(driver)
        assert page + back == ids
        # newest first, from a shared link
        driver.get(server.url + "groups/g/messages?state=dead&order=desc&limit=25")
        assert listed(driver) == ids[::-1][:25]
        assert console(driver) == []
    finally:
        server.close()


def test_a_bulk_requeue_of_a_filter_is_audited_with_the_users_name(browser, engine, tmp_path):
    """Log in as alice, filter the dead rows by error text, requeue every match: the
    confirmation says how many, the reason is required, the audit row names alice."""
    from helpers import kill

    driver = browser
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = pgq.publish_many(engine, "t", [{"i": i} for i in range(30)])
    kill(engine, ids[:12], "systemic", last_error="ConnectionError: billing down")
    kill(engine, ids[12:20], "message", last_error="ValueError: bad total")
    token = "alice-browser-3f9d1c7e5b2a8046"
    server = dashboard_server(engine, port=0, users={"alice": token})
    server.start()
    try:
        admin_login(driver, server, token)
        driver.get(server.url + "groups/g/messages?state=dead&error=billing+down&limit=5")
        assert len(listed(driver)) == 5  # one page of the 12: the filter covers them all
        driver.find_element("css selector", "#scope-filter").click()
        driver.find_element("css selector", "#bulk-requeue").click()
        wait_until(lambda: text_of(driver, "#count"), 10, "the confirmation")
        assert text_of(driver, "#count").startswith("12 dead rows match this filter now")
        shoot(driver, tmp_path, "confirm")
        driver.find_element("css selector", "#confirm").click()  # no reason: refused
        assert driver.find_elements("css selector", "#confirm-form")  # still here
        assert monitor.audit(engine, "g") == []
        reason = driver.find_element("css selector", 'input[name="reason"]')
        reason.send_keys("billing is back")
        driver.find_element("css selector", "#confirm").click()
        result = wait_until(lambda: text_of(driver, "#result"), 10, "the requeue's answer")
        assert result.startswith("requeued 12 (audit "), result
        [row] = monitor.audit(engine, "g")
        assert (row["action"], row["count"], row["message_ids"]) == ("requeue", 12, ids[:12])
        assert (row["actor"], row["reason"]) == ("alice (pgq web)", "billing is back")
        assert monitor.status(engine, "g")["counts"]["dead"] == 8
        assert text_of(driver, f'#audit tr[data-audit="{row["id"]}"]') is not None
        assert console(driver) == []
    finally:
        server.close()


def test_dark_mode_phone_width_and_the_keyboard(browser, engine, tmp_path):
    """The pages follow the system's dark scheme, fit a 380 px screen without the
    page scrolling sideways (wide tables scroll in their box), and the keyboard
    reaches the content first (the skip link) with a visible focus."""
    from helpers import kill
    from selenium.webdriver.common.keys import Keys

    driver = browser
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = pgq.publish_many(engine, "t", [{"i": i, "long": "x" * 300} for i in range(30)])
    kill(engine, ids[:5], "message", last_error="a long error text " * 10)
    server = dashboard_server(engine, port=0)
    server.start()
    pages = ["?all=1", "groups/g", "groups/g/messages", f"groups/g/messages/{ids[0]}", "topics"]
    try:
        background = "return getComputedStyle(document.body).backgroundColor"
        driver.get(server.url + "topics")
        light = driver.execute_script(background)
        driver.execute_cdp_cmd(
            "Emulation.setEmulatedMedia",
            {"features": [{"name": "prefers-color-scheme", "value": "dark"}]},
        )
        driver.get(server.url + "topics")
        dark = driver.execute_script(background)
        assert light != dark, (light, dark)
        shoot(driver, tmp_path, "messages-dark")
        driver.set_window_size(380, 800)
        inner = "return [document.documentElement.scrollWidth, window.innerWidth]"
        for page in pages:
            driver.get(server.url + page)
            width, viewport = driver.execute_script(inner)
            assert width <= viewport, (page, width, viewport)
        driver.get(server.url + "groups/g/messages")
        shoot(driver, tmp_path, "messages-phone")
        body = driver.find_element("css selector", "body")
        body.send_keys(Keys.TAB)
        focused = driver.switch_to.active_element
        assert focused.text == "skip to content" and focused.is_displayed()
        focused.send_keys(Keys.ENTER)
        for _ in range(40):  # tab on to the first filter field
            driver.switch_to.active_element.send_keys(Keys.TAB)
            if driver.switch_to.active_element.get_attribute("name") == "id":
                break
        active = driver.switch_to.active_element
        assert active.get_attribute("name") == "id"
        outline = driver.execute_script(
            "return getComputedStyle(document.activeElement).outlineStyle"
        )
        assert outline != "none"
        assert console(driver) == []
    finally:
        server.close()
