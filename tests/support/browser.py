"""A real browser for the console's tests: Debian's Chromium, headless, driven through Selenium with Debian's
chromedriver (`make install` installs both; nothing is downloaded). Where they are missing, the tests are skipped
on a developer's machine and fail in CI (CI=true), so that a CI run never passes without them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException, TimeoutException
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# `TRAINYARD_CONSOLE_SCREENSHOTS=docs/console make test`: the run keeps its screenshots there (docs/console.md).
SCREENSHOTS_VARIABLE = "TRAINYARD_CONSOLE_SCREENSHOTS"
T = TypeVar("T")


def browser_or_skip() -> None:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    if not missing:
        return
    message = f"{' and '.join(missing)} missing: `make install` installs Debian's chromium and chromium-driver"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def chromium(language: str = "en-US") -> WebDriver:
    browser_or_skip()
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not fetch a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1440,960",
                     f"--lang={language}", "--disable-gpu", "--no-first-run"):
        options.add_argument(argument)
    options.add_experimental_option("prefs", {"intl.accept_languages": language})
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))


def driven(language: str = "en-US") -> Iterator[WebDriver]:
    driver = chromium(language)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: WebDriver, condition: Callable[[WebDriver], T], seconds: float = 30, what: str = "") -> T:
    """`condition`, once it holds; looked at again when what it read was gone from the page meanwhile (a job's page
    is built anew whenever its status changes, so an element found a moment before may be stale)."""
    try:
        waiting = WebDriverWait(driver, seconds, poll_frequency=0.2,
                                ignored_exceptions=(NoSuchElementException, StaleElementReferenceException))
        return waiting.until(condition)
    except TimeoutException:
        raise AssertionError(f"waited {seconds}s for {what or condition}; the page at {driver.current_url}:\n"
                             f"{driver.find_element('tag name', 'body').text[:3000]}") from None


def screenshot(driver: WebDriver, name: str, fallback: Path) -> Path:
    """A screenshot of the page as it is, kept where SCREENSHOTS_VARIABLE says (else in `fallback`)."""
    folder = Path(os.environ.get(SCREENSHOTS_VARIABLE) or fallback)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    assert driver.save_screenshot(str(path)), f"no screenshot of {driver.current_url}"
    return path
