"""Debian's Chromium driven by Playwright, headless, for tests that look at what a person sees."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.harness.tiers import note_started

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# The machine's network is closed: Chromium's background services would only fail to connect.
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def chromium_missing_reason() -> str | None:
    if not Path(CHROMIUM).exists():
        return "Debian's chromium is not installed (bash .ci/dev setup installs it)"
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed"
    return None


@contextmanager
def open_browser_page(tmp_path: Path) -> Iterator[Any]:
    """A page of a fresh headless Chromium, closed on exit (tests use the `page` fixture)."""
    from playwright.sync_api import sync_playwright

    note_started("browser")

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            yield context.new_page()
        finally:
            browser.close()


def log_in_as_admin(page: Any, hub: Any) -> None:
    """The login form, as a person fills it in, with the hub's initial admin; on to the spawn page."""
    page.goto(f"{hub.url}/hub/login")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", hub.admin_password())
    page.click("input[type=submit], button[type=submit]")
    page.wait_for_url("**/hub/spawn**")


def press_until_visible(page: Any, key: str, locator: Any, timeout_ms: int, attempts: int) -> None:
    """Press `key` until `locator` shows, as a person presses a shortcut again when nothing
    happened: a press that lands while the page still moves focus is dropped by the browser."""
    for _ in range(attempts):
        page.keyboard.press(key)
        try:
            locator.wait_for(state="visible", timeout=timeout_ms)
            return
        except Exception:  # playwright's TimeoutError: press again
            continue
    locator.wait_for(state="visible", timeout=timeout_ms)  # fails, naming the selector


def run_from_palette(page: Any, command: str, attempts: int = 6) -> None:
    """Open JupyterLab's command palette as a person does (Ctrl+Shift+C), type `command` and
    pick it. The shortcut is pressed again while the palette has not shown: a press that lands
    while the lab is still moving focus (a dialog or form just closed, a document just opened)
    is dropped by the browser, and a person would simply press it again."""
    palette = page.locator(".lm-CommandPalette-input")
    press_until_visible(page, "Control+Shift+C", palette, 5_000, attempts)
    palette.fill(command)
    page.locator(".lm-CommandPalette-item", has_text=command).first.click()
