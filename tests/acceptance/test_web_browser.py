"""`pgq web` in a real headless browser (issue 13): an operator watches an outage.

Chromium and ChromeDriver come from the system packages (`/usr/bin/chromium`,
`/usr/bin/chromedriver`); Selenium is pointed at both, so nothing downloads a
browser. Three real `pgq consume` members share a dependency that is down while
a flag file exists (tests/outage_handlers.py). The page is loaded once per
state change the test waits for; a marker set in the page proves no reload
happened. Screenshots of each state are saved in the test's directory (and in
`$PGQ_WEB_SCREENSHOTS` when set: that is how the README's picture is made).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import reap, wait_until
from members import ConsumeProcesses, consume_processes
from sqlalchemy import Engine

import pgq
from pgq import monitor
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

    driver.get(web.url + "?all=1")
    wait_until(lambda: text_of(driver, 'tr[data-group="g"] .state') == "CLOSED", 10, "overview")
    # the charts have the outage's samples (one a second here)
    assert driver.find_elements("css selector", 'tr[data-group="g"] svg.spark polyline')
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
        f"groups/g/messages/{mid}",
        "login",
        "api/groups",
        "groups/nope",
        "groups/g?class=bogus",
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
