"""The supervisors side by side in a real browser (issue 41 item 9): the queue page's
table of each supervisor's prefetch and rates renders, within the window, and fills in as
the live update brings the second reading. Skipped where chromium is missing, as
tests/test_dashboard_browser.py is (whose fixtures these are)."""

from __future__ import annotations

import pytest

from support.supervision import write_config
from tests.test_dashboard_browser import browser, dashboards, wait  # noqa: F401 - fixtures
from tests.test_dashboard_canary import steady  # noqa: F401 - a fixture

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_url_override")]

from selenium.webdriver.common.by import By  # noqa: E402


def test_the_supervisors_side_by_side_render_and_fill_in_live(
        tmp_path, redis_url, dashboards, supervisors, browser, steady):  # noqa: F811
    config = write_config(tmp_path, redis_url, handler="examples.noop:handle",
                          job={"prefetch": 8})
    supervisor = supervisors(config, redis_url)
    dashboard = dashboards(config)
    browser.get(f"{dashboard.url}/q/0")
    browser.execute_script("window.notReloaded = true")

    def cells(driver) -> list[str]:
        rows = driver.find_elements(By.CSS_SELECTOR, "table.figures tbody tr")
        return [cell.text for cell in rows[0].find_elements(By.TAG_NAME, "td")] if rows else []

    def moving(driver) -> list[str] | None:
        found = cells(driver)
        return found if len(found) == 11 and found[3] not in ("—", "0.0") else None

    row = wait(browser, moving, "the supervisor's row with its jobs/s")
    assert row[0].endswith(f" {supervisor.pid}") and row[1] == "8" and row[2] == "1"
    assert float(row[3].replace(",", "")) > 0 and row[4].endswith(" µs")
    headers = [cell.text for cell in browser.find_elements(By.CSS_SELECTOR,
                                                            "table.figures thead th")]
    assert headers[:4] == ["supervisor (host and pid)", "prefetch", "coroutines", "jobs/s"]
    table = browser.find_element(By.CSS_SELECTOR, "table.figures")
    assert table.is_displayed()
    width = browser.execute_script("return document.documentElement.clientWidth")
    assert table.rect["x"] + table.rect["width"] <= width  # within the window
    assert browser.execute_script("return window.notReloaded") is True  # updated in place
