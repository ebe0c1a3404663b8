"""Plumbing for the browser attacks: Debian's Chromium driven by Selenium, with the
browser console kept (`goog:loggingPrefs`), as tests/acceptance/test_web_browser.py
drives it. Nothing downloads a browser."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1100")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def console(driver: Any) -> list[str]:
    """The browser console's warnings and errors since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] in ("WARNING", "SEVERE")]
