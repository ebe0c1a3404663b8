"""The README's dashboard pictures (issue 23): every page of `pgq web`, light and dark.

Runs the `pgq demo` story (`pgq.demo.run_demo`, its own scratch schema
`pgq_demo_<random>`, dropped at the end) with the dashboard watching it in admin
mode, plus a second group, `shipping`, on the same topic, whose handler refuses
a few orders for good (`PermanentError`), so the messages page has dead rows to
filter. Headless Debian Chromium (`/usr/bin/chromium` through
`/usr/bin/chromedriver` and Selenium: nothing downloads a browser) takes:

- `login`: the admin login page;
- `overview-open`, `group-open`: during the outage (billing OPEN, one prober,
  its failed probes on the timeline; shipping carries on);
- `group-closed`, `overview`: after it (the close, the refund, the drain), with
  the members started again;
- `messages`: shipping's dead rows filtered by error class and text;
- `confirm`: the bulk requeue's confirmation for every row of that filter;
- `message`: one of billing's poison messages;
- `topics`: the topics page.

Each page is taken twice, `docs/img/web-<page>-light.png` and `-dark.png`: the
dark one with the page's `prefers-color-scheme: dark` stylesheet, through
Chromium's `Emulation.setEmulatedMedia` (the same page, no reload: the login
and the confirmation's POST are not done twice; `chromium --headless=new
--force-dark-mode` renders the dark stylesheet too, for a plain GET). The
members use the demo's short settings (`DEMO_SETTINGS`), so the dashboard's
member TTL sees them live. The PNGs
are then squeezed with `pngquant` when it is installed (`apt install pngquant`).

Usage:
    .venv/bin/python scripts/screenshots.py [--dsn DSN] [--out docs/img] [--width 1280]
        [--height 900]

The DSN defaults to `$PGQ_DSN`, else postgresql://postgres@127.0.0.1:5432/postgres.
Needs the `web` extra and Selenium (the test dependencies). Takes about a minute;
the demo's schema is dropped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import Engine  # noqa: E402

import pgq  # noqa: E402
from pgq import monitor  # noqa: E402
from pgq.demo import DEMO_SETTINGS, GROUP, MEMBERS, TOPIC, Pace, run_demo  # noqa: E402
from pgq.records import Message  # noqa: E402
from pgq.web import WebOptions, dashboard_server  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SHIPPING = "shipping"
REFUSED_EVERY = 25
"""Shipping refuses every 25th order (order % 25 == 7) for good."""
PACE = Pace(cut_after=12.0, outage=12.0, deadline=120.0)
"""Healthy traffic long enough for the overview's charts to show the outage."""
ORDERS = 2000
"""Orders the demo publishes (at 100/s): traffic through and after the outage."""
USER = "alice"


def shipping_handler(msg: Message) -> None:
    """The second group's handler: a carrier that rejects a few addresses for good."""
    time.sleep(0.002)
    order = msg.payload.get("order", 0) if isinstance(msg.payload, dict) else 0
    if order % REFUSED_EVERY == 7:
        raise pgq.PermanentError(f"carrier API 422: order {order} has no postcode")


def billing_handler(msg: Message) -> None:
    """Billing after the outage: the dependency is back, every call succeeds."""
    time.sleep(0.002)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    """`check()` once it is truthy; RuntimeError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


class Camera:
    """One headless Chromium tab that saves each page light and dark."""

    def __init__(self, out: Path, width: int, height: int) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
            options.add_argument(arg)
        options.add_argument("--hide-scrollbars")
        options.add_argument(f"--window-size={width},{height}")
        self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        self.driver.set_page_load_timeout(30)
        # the window size includes the (headless) browser's frame: fix the viewport itself
        self.driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        self.out = out
        self.saved: list[Path] = []

    def find(self, css: str) -> list[Any]:
        return self.driver.find_elements("css selector", css)

    def text(self, css: str) -> str | None:
        found = self.find(css)
        try:
            return found[0].text if found else None
        except Exception:  # the live part was swapped in between
            return None

    def scheme(self, value: str) -> None:
        self.driver.execute_cdp_cmd(
            "Emulation.setEmulatedMedia",
            {"features": [{"name": "prefers-color-scheme", "value": value}]},
        )

    def shoot(self, name: str) -> None:
        """The page as it is now, light then dark (the live part paused meanwhile)."""
        background = "return getComputedStyle(document.body).backgroundColor"
        colours = []
        for scheme in ("light", "dark"):
            self.scheme(scheme)
            colours.append(self.driver.execute_script(background))
            path = self.out / f"web-{name}-{scheme}.png"
            self.driver.save_screenshot(str(path))
            self.saved.append(path)
        self.scheme("light")
        if colours[0] == colours[1]:
            raise RuntimeError(f"{name}: the dark scheme did not change the page ({colours})")
        print(f"  shot {name} (light {colours[0]}, dark {colours[1]})")

    def close(self) -> None:
        self.driver.quit()


class Shoot:
    """`run_demo`'s `watch`: the dashboard, the shipping group and the camera, while
    the story runs (in a thread, so the demo's own loop goes on) and after it."""

    def __init__(self, out: Path, width: int, height: int) -> None:
        self.out, self.width, self.height = out, width, height
        self.error: BaseException | None = None
        self.saved: list[Path] = []

    @contextlib.contextmanager
    def __call__(self, engine: Engine) -> Iterator[None]:
        token = secrets.token_urlsafe(24)
        options = WebOptions(
            member_ttl=DEMO_SETTINGS["breaker_member_ttl"], refresh=1.0, sample_every=1.0
        )
        with contextlib.ExitStack() as stack:
            server = dashboard_server(engine, port=0, users={USER: token}, options=options)
            server.start()
            stack.callback(server.close)
            pgq.subscribe(engine, SHIPPING, TOPIC)
            shipping = pgq.Consumer(
                engine, SHIPPING, shipping_handler, workers=2, name="ship-1", **DEMO_SETTINGS
            )
            shipping.start()
            stack.callback(shipping.stop, timeout=5)
            camera = Camera(self.out, self.width, self.height)
            stack.callback(camera.close)
            camera.saved = self.saved
            during = threading.Thread(
                target=self._guard(self.during, camera, server.url, token),
                name="screenshots",
                daemon=True,
            )
            during.start()
            try:
                yield
            finally:
                during.join(120)
            if self.error is None:
                self._guard(self.after, engine, camera, server.url)()

    def _guard(self, fn: Callable[..., None], *args: Any) -> Callable[[], None]:
        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:
                self.error = exc

        return run

    def during(self, camera: Camera, url: str, token: str) -> None:
        """Login, then the outage: the overview and the group page while OPEN."""
        d = camera.driver
        d.get(url + "login")
        camera.shoot("login")
        d.find_element("css selector", 'input[name="token"]').send_keys(token)
        d.find_element("css selector", "form button").click()
        wait_for("the admin session", lambda: camera.text("#mode") == "admin", 10)
        d.get(url + f"groups/{GROUP}")
        failed = '#events tr.event-probe[data-outcome="failed"]'
        wait_for(
            "OPEN, a prober and seven failed probes",
            lambda: (
                camera.text("#breaker-state") == "OPEN"
                and (camera.text("#prober") or "").startswith("demo-")
                and len(camera.find(failed)) >= 7
            ),
        )
        d.execute_script("window.scrollTo(0, 0)")
        camera.shoot("group-open")
        d.get(url + "?all=1")
        wait_for("billing OPEN on the overview", lambda: camera.find(f'tr[data-group="{GROUP}"]'))
        camera.shoot("overview-open")

    def after(self, engine: Engine, camera: Camera, url: str) -> None:
        """The demo's members have stopped: start them again (the dependency is up),
        then the pages after the outage."""
        members = [
            pgq.Consumer(
                engine, GROUP, billing_handler, workers=2, name=f"demo-{i}", **DEMO_SETTINGS
            )
            for i in range(1, MEMBERS + 1)
        ]
        for member in members:
            member.start()
        try:
            self._after(engine, camera, url)
        finally:
            for member in members:
                member.stop(timeout=5)

    def _after(self, engine: Engine, camera: Camera, url: str) -> None:
        d = camera.driver
        ttl = DEMO_SETTINGS["breaker_member_ttl"]
        wait_for(
            "billing's members live again and shipping drained",
            lambda: (
                len(monitor.status(engine, GROUP, member_ttl=ttl)["members"]) >= MEMBERS
                and monitor.status(engine, SHIPPING, member_ttl=ttl)["lag"] == 0
            ),
        )
        d.get(url + f"groups/{GROUP}")
        wait_for("the refund on the timeline", lambda: camera.find("#events .refunded"))
        camera.shoot("group-closed")
        d.get(url + "?all=1")
        # a minute's sample is a point; two minutes of them a line
        wait_for("the charts", lambda: camera.find("svg.spark polyline, svg.spark circle"))
        camera.shoot("overview")

        d.get(url + f"groups/{SHIPPING}/messages?state=dead&class=permanent&error=postcode")
        wait_for("shipping's dead rows", lambda: camera.find("#messages tr[data-message]"))
        camera.shoot("messages")
        d.find_element("css selector", "#scope-filter").click()
        d.find_element("css selector", "#bulk-requeue").click()
        wait_for("the confirmation", lambda: camera.text("#count"), 10)
        camera.shoot("confirm")

        poison = monitor.dead(engine, GROUP, limit=1)
        if not poison:
            raise RuntimeError("billing has no dead row (the demo's poison)")
        d.get(url + f"groups/{GROUP}/messages/{poison[0]['message_id']}")
        wait_for("the message", lambda: camera.text("#message-state"), 10)
        camera.shoot("message")
        d.get(url + "topics")
        camera.shoot("topics")


def squeeze(paths: list[Path]) -> None:
    """Quantize the PNGs in place with pngquant (a flat UI loses nothing visible)."""
    tool = shutil.which("pngquant")
    if tool is None:
        print("pngquant not installed: the PNGs are left as Chromium saved them")
        return
    for path in paths:
        before = path.stat().st_size
        subprocess.run(
            [
                tool,
                "--force",
                "--skip-if-larger",
                "--strip",
                "--quality=70-95",
                "--ext=.png",
                str(path),
            ],
            check=False,  # 99: not smaller or under the quality floor: kept as it was
        )
        print(f"  {path.name}: {before // 1024} KB -> {path.stat().st_size // 1024} KB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_dsn = os.environ.get("PGQ_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--dsn", default=default_dsn)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=900)
    args = parser.parse_args()
    # the members' warnings (every failed probe) would drown the demo's own story
    logging.basicConfig(level=logging.ERROR, format="%(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)

    shoot = Shoot(args.out, args.width, args.height)

    def watch(engine: Engine) -> contextlib.AbstractContextManager[None]:
        return shoot(engine)

    result = run_demo(args.dsn, print, messages=ORDERS, pace=PACE, watch=watch)
    if shoot.error is not None:
        raise shoot.error
    if not result.ok:
        print(f"the demo's story did not happen: {result.problem}", file=sys.stderr)
        return 1
    squeeze(shoot.saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
