"""The dashboard in a real browser: Debian's chromium, driven by chromium-driver through
Selenium, against a private Redis with a running supervisor. What an operator sees: the
counts, a plot that moves as the queue drains (without reloading the page), a failed job's
hostile error shown as text and never run, and an action that works after logging in;
with a token, no page before the login (which leads back), a live page that stops when its
session ends, and an action clicked twice that acts once.

Skipped, saying why, only where chromium or chromium-driver is missing; ``.ci/run``
installs both, so CI runs them. Every wait is explicit (WebDriverWait, whole seconds)."""

from __future__ import annotations

import re
import shutil

import pytest

from broker.failure import Failure
from support.dashboard import FailingRedis
from support.envelopes import lpush_batched, of
from support.supervision import keys, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_url_override")]
pytest.importorskip("starlette", reason="the dashboard extra is not installed")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not CHROMIUM or not DRIVER:
    pytest.skip("chromium and chromium-driver are not installed (apt-get install chromium "
                "chromium-driver; .ci/run installs them)", allow_module_level=True)

from selenium.common.exceptions import (  # noqa: E402
    NoSuchElementException,
    StaleElementReferenceException,
)
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

#: Seconds any one wait may take on a loaded CI machine.
WAIT = 60


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(DRIVER))
    driver.set_page_load_timeout(WAIT)
    yield driver
    driver.quit()




def wait(driver, condition, what: str):
    """Poll ``condition(driver)`` every half second; a part swapped in place by the live
    update meanwhile (stale element) is only read again."""
    return WebDriverWait(driver, WAIT, poll_frequency=0.5,
                         ignored_exceptions=(NoSuchElementException,
                                             StaleElementReferenceException)).until(
        lambda d: condition(d), message=f"waiting for {what}")


def text(driver, selector: str) -> str | None:
    """The text of the first element matching ``selector``, read in one script call (the
    live update cannot swap it between finding and reading)."""
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e && e.textContent.trim()",
        selector)


def attribute(driver, selector: str, name: str) -> str | None:
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e && e.getAttribute(arguments[1])",
        selector, name)


def cell(driver, name: str) -> str | None:
    return text(driver, f"#queue-0 td.{name}")


def chart_top(driver, kind: str) -> float:
    """The largest value the chart of ``kind`` (backlog, rate) has drawn."""
    return float(attribute(driver, f"#queue-0 svg.{kind}", "data-peak") or -1)


def test_overview_counts_and_the_plots_move_as_a_running_supervisor_drains_the_queue(
        tmp_path, redis_url, client, dashboards, supervisors, browser):
    k = keys()
    lpush_batched(client, k.ready, of("e2e", ({"n": n} for n in range(300))))
    client.lpush(k.failed, "f1", "f2")
    client.lpush(k.dead, "d1")
    config = write_config(tmp_path, redis_url, handler="examples.noop:handle")
    dashboard = dashboards(config)
    browser.get(dashboard.url)
    wait(browser, lambda d: cell(d, "ready") == "300", "the backlog of 300")
    assert (cell(browser, "failed"), cell(browser, "dead"), cell(browser, "poison")) == (
        "2", "1", "0")
    assert "read-only" in browser.find_element(By.ID, "mode").text
    assert attribute(browser, "#queue-0 svg.backlog", "data-last") == "300.0"
    browser.execute_script("window.notReloaded = true")

    supervisors(config, redis_url)
    wait(browser, lambda d: cell(d, "ready") == "0", "the queue to drain")
    wait(browser, lambda d: attribute(d, "#queue-0 svg.backlog", "data-last") == "0.0",
         "the backlog plot to reach 0")
    wait(browser, lambda d: chart_top(d, "rate") > 0, "the jobs/s plot to rise")
    wait(browser, lambda d: cell(d, "supervisors") == "1", "the running supervisor")
    assert chart_top(browser, "backlog") == 300
    assert browser.execute_script("return window.notReloaded") is True  # updated in place


def test_a_failed_jobs_hostile_error_is_shown_as_text_and_retry_works_after_login(
        tmp_path, redis_url, client, dashboards, browser):
    k = keys()
    hostile = ('<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"> '
               '\u202egnp.exe')
    pid, raw = next(iter(of("e2e", [{"n": 1}])))
    client.set(k.job(pid), raw)
    client.lpush(k.failed, pid)
    client.set(k.error(pid), Failure("ValueError", hostile, attempt=3, outcome="failed").encode())
    client.lpush(k.failed, "pid-<b>1</b>")  # pushed by hand: shown, no link, no action
    config = write_config(tmp_path, redis_url, handler="examples.noop:handle")
    dashboard = dashboards(config, token="browser-token")

    browser.get(f"{dashboard.url}/q/0/list/failed")  # sent to the login first
    log_in(browser, "carol", "browser-token")
    error = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "td.error .summary"),
                 "the failed job's error")
    assert error.text == f"ValueError: {hostile}".replace("\u202e", "\\u202e")
    assert [e.text.split("\n")[0] for e in browser.find_elements(By.CSS_SELECTOR, "td.pid")
            ] == ["pid-<b>1</b>", pid]
    assert browser.execute_script("return window.pwned") is None
    assert len(browser.find_elements(By.CSS_SELECTOR, "button.retry")) == 1  # pid's only
    wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "button.retry"),
         "the retry button").click()
    message = wait(browser, lambda d: d.find_element(By.ID, "message"), "the answer")
    assert "moved from failed back to the ready list" in message.text
    assert (client.llen(k.ready), client.llen(k.failed)) == (1, 1)
    assert "dashboard action by carol" in dashboard.output()


def failed_job(client) -> str:
    k = keys()
    pid, raw = next(iter(of("e2e", [{"n": 1}])))
    client.set(k.job(pid), raw)
    client.lpush(k.failed, pid)
    return pid


def log_in(driver, who: str, token: str) -> None:
    """Log in on the login page the browser was sent to (it leads back)."""
    wait(driver, lambda d: d.find_element(By.ID, "token"), "the login page")
    driver.find_element(By.ID, "who").send_keys(who)
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "login").click()
    wait(driver, lambda d: who in d.find_element(By.ID, "mode").text, "the login")


def form_fields(driver, selector: str) -> dict[str, str]:
    """The fields of the form whose button matches ``selector`` (what a click sends)."""
    return driver.execute_script("""
        const form = document.querySelector(arguments[0]).form;
        return Object.fromEntries(new FormData(form).entries());""", selector)


def post_from_page(driver, fields: dict[str, str], action: str = "/q/0/action") -> None:
    """Submit a form the page did not offer (what a forged or stale page would send)."""
    driver.execute_script("""
        const form = document.createElement("form");
        form.method = "post"; form.action = arguments[1];
        for (const [name, value] of Object.entries(arguments[0])) {
            const input = document.createElement("input");
            input.type = "hidden"; input.name = name; input.value = value;
            form.appendChild(input);
        }
        document.body.appendChild(form); form.submit();""", fields, action)


def test_actions_are_refused_without_the_token_and_without_the_csrf_token(
        tmp_path, redis_url, client, dashboards, browser):
    k = keys()
    pid = failed_job(client)
    config = write_config(tmp_path, redis_url, handler="examples.noop:handle")
    retry = {"action": "retry", "source": "failed", "pid": pid}

    read_only = dashboards(config)
    browser.get(f"{read_only.url}/q/0/list/failed")
    assert "read-only" in browser.find_element(By.ID, "mode").text
    post_from_page(browser, retry | {"csrf": "guessed"})
    message = wait(browser, lambda d: d.find_element(By.ID, "message"), "the refusal")
    assert "started without --token" in message.text
    assert browser.find_element(By.TAG_NAME, "h1").text == "Refused"

    assert "readable by whoever reaches this port" in browser.find_element(
        By.ID, "open-data").text  # every page of a dashboard without a token says so

    guarded = dashboards(config, token="t0ken")
    browser.get(f"{guarded.url}/login")
    browser.find_element(By.ID, "who").send_keys("dave")
    browser.find_element(By.ID, "token").send_keys("wrong")
    browser.find_element(By.ID, "login").click()
    assert wait(browser, lambda d: d.find_element(By.ID, "refused"), "the refusal").text == (
        "wrong token")
    browser.get(f"{guarded.url}/login")
    log_in(browser, "dave", "t0ken")
    browser.get(f"{guarded.url}/q/0/list/failed")
    browser.execute_script(  # the page's own retry form, without its CSRF token
        "document.querySelectorAll('input[name=csrf]').forEach(i => i.remove())")
    browser.find_element(By.CSS_SELECTOR, "button.retry").click()
    message = wait(browser, lambda d: d.find_element(By.ID, "message"), "the refusal")
    assert "CSRF token is missing or wrong" in message.text
    assert client.lrange(k.failed, 0, -1) == [pid.encode()] and client.llen(k.ready) == 0


def test_without_a_login_no_page_shows_job_data_and_the_login_leads_back_to_it(
        tmp_path, redis_url, client, dashboards, browser):
    k = keys()
    pid, raw = next(iter(of("e2e", [{"to": "maria.lopez@example.org"}])))
    client.set(k.job(pid), raw)
    client.lpush(k.failed, pid)
    config = write_config(tmp_path, redis_url, handler="examples.noop:handle")

    read_only = dashboards(config)  # no token: open, and every page says so
    for path in ("/", f"/q/0/job?pid={pid}"):
        browser.get(read_only.url + path)
        assert "readable by whoever reaches this port" in browser.find_element(
            By.ID, "open-data").text

    guarded = dashboards(config, token="t0ken")
    for path in ("/", "/q/0", "/q/0/list/failed", f"/q/0/job?pid={pid}"):
        browser.get(guarded.url + path)
        wait(browser, lambda d: d.find_element(By.ID, "token"), f"the login instead of {path}")
        assert "maria.lopez" not in browser.page_source, path
    log_in(browser, "erin", "t0ken")
    assert browser.current_url == f"{guarded.url}/q/0/job?pid={pid}"  # back where it asked
    assert "maria.lopez@example.org" in browser.find_element(By.CSS_SELECTOR, "pre.record").text
    browser.get(f"{guarded.url}/q/0/job?pid=x.{pid}")  # another queue's key: refused
    assert "not a job of this queue" in browser.find_element(By.TAG_NAME, "main").text


def test_a_live_page_whose_session_ended_stops_updating_and_says_so(
        tmp_path, redis_url, client, dashboards, browser):
    k = keys()
    config = write_config(tmp_path, redis_url, handler="examples.noop:handle")
    dashboard = dashboards(config, token="t0ken")
    browser.get(f"{dashboard.url}/q/0")
    log_in(browser, "frank", "t0ken")
    wait(browser, lambda d: attribute(d, "#queue-live", "data-refreshed"), "a live update")
    client.lpush(k.ready, "x")
    wait(browser, lambda d: text(d, "dd.ready") == "1", "the live count")
    browser.delete_all_cookies()  # the session is gone (a logout elsewhere, an expiry)
    notice = wait(browser, lambda d: d.find_element(By.ID, "logged-out"), "the notice")
    assert "stopped updating" in notice.text
    link = notice.find_element(By.TAG_NAME, "a").get_attribute("href")
    assert link == f"{dashboard.url}/login?next=%2Fq%2F0"
    refreshed = attribute(browser, "#queue-live", "data-refreshed")
    client.lpush(k.ready, "y")
    import time

    time.sleep(3)  # three refresh intervals: nothing fetched, nothing swapped
    assert attribute(browser, "#queue-live", "data-refreshed") == refreshed
    assert text(browser, "dd.ready") == "1"
    assert len(browser.find_elements(By.ID, "logged-out")) == 1
    notice.find_element(By.TAG_NAME, "a").click()
    log_in(browser, "frank", "t0ken")
    assert browser.current_url == f"{dashboard.url}/q/0"
    wait(browser, lambda d: text(d, "dd.ready") == "2", "the page live again")


def test_a_double_clicked_or_resent_action_acts_once(
        tmp_path, redis_url, client, dashboards, browser):
    """The issue's case in a browser: five poison entries, the page read, five more pushed,
    the delete button double-clicked, then the same form sent again (a resent POST)."""
    k = keys()
    client.lpush(k.poison, *[f"old-{n}" for n in range(5)])
    pid = failed_job(client)
    config = write_config(tmp_path, redis_url, handler="examples.noop:handle")
    dashboard = dashboards(config, token="t0ken")
    browser.get(f"{dashboard.url}/q/0/list/poison")
    log_in(browser, "gina", "t0ken")
    button = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "button.delete"),
                  "the delete button")
    assert button.text == "delete the 5 oldest poison entries"
    button.click()  # it asks first
    button = wait(browser, lambda d: d.find_element(By.ID, "confirm"), "the confirmation")
    assert "delete the 5 oldest poison entries" in browser.find_element(By.TAG_NAME, "h1").text
    sent = form_fields(browser, "#confirm")
    client.lpush(k.poison, *[f"new-{n}" for n in range(5)])
    ActionChains(browser).double_click(button).perform()
    wait(browser, lambda d: d.find_element(By.ID, "message"), "the answer")
    assert client.lrange(k.poison, 0, -1) == [f"new-{n}".encode() for n in reversed(range(5))]
    post_from_page(browser, sent)  # the same form once more
    message = wait(browser, lambda d: d.find_element(By.ID, "message"), "the refusal")
    assert "sent already" in message.text
    assert client.llen(k.poison) == 5

    browser.get(f"{dashboard.url}/q/0/job?pid={pid}")  # a job: retry, then the same again
    sent = form_fields(browser, "button.retry")
    browser.find_element(By.CSS_SELECTOR, "button.retry").click()
    message = wait(browser, lambda d: d.find_element(By.ID, "message"), "the answer")
    assert "moved from failed back to the ready list" in message.text
    client.lpush(k.failed, pid)  # it ran and failed again, under the same pid
    client.set(k.job(pid), client.lindex(k.ready, 0))
    post_from_page(browser, sent)
    message = wait(browser, lambda d: "sent already" in d.find_element(By.ID, "message").text,
                   "the refusal")
    assert client.lrange(k.failed, 0, -1) == [pid.encode()] and client.llen(k.ready) == 1


# -- search, bulk actions, confirmations (issue 41.4, 41.5) -------------------------------------


def test_a_search_leads_to_a_confirmed_bulk_retry_whose_replay_is_refused(
        tmp_path, redis_url, client, dashboards, browser):
    """Search by error class, see the count, confirm (count and pids), see the result, go
    back to the list; the confirmed form sent again is refused, and a job that came to match
    after the confirmation stays where it is."""
    k = keys()
    matching = []
    for n, (pid, raw) in enumerate(of("e2e", [{"n": n} for n in range(4)])):
        client.set(k.job(pid), raw)
        client.lpush(k.failed, pid)
        error = Failure("ValueError" if n < 3 else "TimeoutError", "boom")
        client.set(k.error(pid), error.encode())
        matching += [pid] if n < 3 else []
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"),
                           token="t0ken")
    browser.get(f"{dashboard.url}/q/0/list/failed")
    log_in(browser, "hana", "t0ken")
    browser.find_element(By.NAME, "error").send_keys("ValueError")
    browser.find_element(By.ID, "search-text").click()
    found = wait(browser, lambda d: d.find_element(By.ID, "search-note"), "the search")
    assert found.text.endswith("searched the newest 4 entries of 4 (at most 10,000; the first "
                               "4,096 bytes of each record); 3 match"), found.text
    assert "the newest 10,000 entries at most" in browser.find_element(
        By.CSS_SELECTOR, "small.bound").text
    browser.find_element(By.ID, "bulk-retry").click()
    count = wait(browser, lambda d: d.find_element(By.ID, "confirm-count"), "the confirmation")
    assert count.text == "Retry 3 jobs:"
    assert sorted(texts(browser, "#confirm-pids a")) == sorted(matching)
    sent = form_fields(browser, "#confirm")
    late, raw = next(iter(of("e2e", [{"n": 9}])))  # matches too, after the confirmation
    client.set(k.job(late), raw)
    client.lpush(k.failed, late)
    client.set(k.error(late), Failure("ValueError", "boom").encode())
    browser.find_element(By.ID, "confirm").click()
    message = wait(browser, lambda d: d.find_element(By.ID, "message"), "the result")
    assert message.text == ("3 of the 3 confirmed jobs of e2e moved from failed back to the "
                            "ready list")
    browser.find_element(By.ID, "back").click()
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "h1").text.startswith("Failed jobs"),
         "the list")
    assert len(browser.find_elements(By.CSS_SELECTOR, "td.pid")) == 2  # the late one, timeout
    post_from_page(browser, sent, "/q/0/bulk/failed")  # the confirmed form once more
    message = wait(browser, lambda d: d.find_element(By.ID, "message"), "the refusal")
    assert "sent already" in message.text
    assert browser.find_element(By.TAG_NAME, "h1").text == "Refused"
    assert client.llen(k.ready) == 3 and client.lrange(k.failed, 0, 0) == [late.encode()]


def test_a_single_delete_asks_first_and_cancel_changes_nothing(
        tmp_path, redis_url, client, dashboards, browser):
    k = keys()
    pid = failed_job(client)
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"),
                           token="t0ken")
    browser.get(f"{dashboard.url}/q/0/list/failed")
    log_in(browser, "ivan", "t0ken")
    browser.find_element(By.CSS_SELECTOR, "td.actions button.delete").click()
    count = wait(browser, lambda d: d.find_element(By.ID, "confirm-count"), "the confirmation")
    assert count.text == "Delete 1 job:" and texts(browser, "#confirm-pids a") == [pid]
    browser.find_element(By.ID, "cancel").click()
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "td.actions"), "the list")
    assert client.lrange(k.failed, 0, -1) == [pid.encode()]
    browser.find_element(By.CSS_SELECTOR, "td.actions button.delete").click()
    wait(browser, lambda d: d.find_element(By.ID, "confirm"), "the confirmation").click()
    message = wait(browser, lambda d: d.find_element(By.ID, "message"), "the result")
    assert message.text == f"job {pid} of e2e deleted from failed with its job and failure records"
    assert client.llen(k.failed) == 0 and not client.exists(k.job(pid))


# -- plots, stale figures, long errors (issue 41.8) --------------------------------------------


def texts(driver, selector: str) -> list[str]:
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent.trim())",
        selector)


def point_at(driver, selector: str) -> None:
    """The mouse over the middle of the first element matching ``selector`` (found again
    if a live update swapped it between finding and moving)."""
    def moved(d) -> bool:
        ActionChains(d).move_to_element(d.find_element(By.CSS_SELECTOR, selector)).perform()
        return True

    wait(driver, moved, f"the pointer on {selector}")


def test_each_chart_has_a_scale_a_time_axis_and_shows_the_value_under_the_pointer(
        tmp_path, redis_url, client, dashboards, browser):
    lpush_batched(client, keys().ready, of("e2e", ({"n": n} for n in range(1840))))
    dashboard = dashboards(write_config(tmp_path, redis_url, handler="examples.noop:handle"))
    browser.get(dashboard.url)
    wait(browser, lambda d: cell(d, "ready") == "1,840", "the backlog")
    wait(browser, lambda d: texts(d, "#queue-0 .plot.backlog .y-axis span") == [
        "2k", "1k", "0"], "the backlog's scale")
    assert texts(browser, "#queue-0 .plot.rate .y-axis span")[-1] == "0/s"
    x_axis = texts(browser, "#queue-0 .plot.backlog .x-axis span")
    assert re.fullmatch(r"-\d+ s", x_axis[0]) and x_axis[-1] == "now", x_axis
    point_at(browser, "#queue-0 svg.backlog")
    readout = r"1,840 ready at \d\d:\d\d:\d\d UTC \(\d+ s ago\)"
    wait(browser, lambda d: re.fullmatch(readout, text(d, "#queue-0 .plot.backlog .readout")),
         "the value under the pointer")
    assert browser.find_element(By.CSS_SELECTOR, "#queue-0 .plot.backlog .readout"
                                ).is_displayed()
    assert browser.find_element(By.CSS_SELECTOR, "#queue-0 svg.backlog line.dot"
                                ).value_of_css_property("visibility") == "visible"
    # It stays through the live updates (every second here) while the pointer does.
    refreshed = attribute(browser, "#overview", "data-refreshed")
    wait(browser, lambda d: attribute(d, "#overview", "data-refreshed") != refreshed,
         "a live update")
    assert re.fullmatch(readout, text(browser, "#queue-0 .plot.backlog .readout"))
    point_at(browser, "h1")
    wait(browser, lambda d: text(d, "#queue-0 .plot.backlog .readout") == "",
         "the readout to go with the pointer")

    browser.get(f"{dashboard.url}/q/0")  # the queue page's larger charts: more ticks
    wait(browser, lambda d: texts(d, ".plot.backlog .y-axis span") == [
        "2k", "1.5k", "1k", "500", "0"], "the queue page's scale")
    assert len(texts(browser, ".plot.rate .x-axis span")) == 5
    point_at(browser, "svg.rate")
    wait(browser, lambda d: re.fullmatch(r"0 jobs/s at \d\d:\d\d:\d\d UTC \(\d+ s ago\)",
                                         text(d, ".plot.rate .readout")),
         "the rate under the pointer")


def test_the_figures_of_a_broker_that_stopped_answering_are_marked_stale(
        tmp_path, redis_url, own_redis_server, dashboards, browser):
    import redis

    with redis.Redis.from_url(own_redis_server.url) as down:
        down.lpush(keys().ready, "a", "b", "c")
    (tmp_path / "up").mkdir()
    (tmp_path / "down").mkdir()
    dashboard = dashboards(
        write_config(tmp_path / "up", redis_url, handler="examples.noop:handle"),
        write_config(tmp_path / "down", own_redis_server.url, handler="examples.noop:handle"))
    browser.get(dashboard.url)
    wait(browser, lambda d: text(d, "#queue-1 td.ready") == "3", "the figures")
    assert not browser.find_elements(By.CSS_SELECTOR, ".stale, .stale-note, .stale-tag")
    own_redis_server.stop()
    note = wait(browser, lambda d: text(d, "#queue-1 .stale-note"), "the stale mark")
    assert re.fullmatch(r"figures stale: last good sample \d+ s ago \(.* UTC\)", note), note
    assert "broker unreachable since" in text(browser, "#queue-1 td.state")
    assert attribute(browser, "#queue-1", "class") == "stale"
    assert text(browser, "#queue-1 td.ready") == "3"  # the last good figures stay, marked
    assert browser.find_element(By.CSS_SELECTOR, "#queue-1 td.ready"
                                ).value_of_css_property("font-style") == "italic"
    assert [re.sub(r"\d+", "N", t) for t in texts(browser, "#queue-1 .stale-tag")] == [
        "stale: N s ago"] * 2
    assert ", stale: last good sample" in attribute(browser, "#queue-1 svg.backlog",
                                                     "aria-label")
    assert attribute(browser, "#queue-0", "class") is None  # the other queue is fine
    browser.get(f"{dashboard.url}/q/1")
    assert browser.find_element(By.CSS_SELECTOR, "dl.stale")
    assert "figures stale: last good sample" in text(browser, "p.stale")


def test_a_long_broker_error_keeps_the_table_within_the_window(
        tmp_path, redis_url, dashboards, browser):
    broker = FailingRedis("y" * 5000)  # no space to break at
    try:
        (tmp_path / "up").mkdir()
        (tmp_path / "failing").mkdir()
        dashboard = dashboards(
            write_config(tmp_path / "up", redis_url, handler="examples.noop:handle"),
            write_config(tmp_path / "failing", broker.url, handler="examples.noop:handle"))
        browser.get(dashboard.url)
        wait(browser, lambda d: "broker unreachable" in (text(d, "#queue-1 td.state") or ""),
             "the error")

        def fits(driver) -> bool:
            return driver.execute_script(
                "const t = document.querySelector('table.overview').getBoundingClientRect();"
                "return t.left >= 0 && t.right <= window.innerWidth && "
                "document.documentElement.scrollWidth <= window.innerWidth")

        assert fits(browser)
        assert browser.find_element(By.CSS_SELECTOR, "#queue-0 svg.backlog").is_displayed()
        browser.find_element(By.CSS_SELECTOR, "#queue-1 details.error-whole summary").click()
        refreshed = attribute(browser, "#overview", "data-refreshed")
        wait(browser, lambda d: attribute(d, "#overview", "data-refreshed") != refreshed,
             "a live update")  # which keeps it open
        whole = text(browser, "#queue-1 details.error-whole[open] pre")
        assert whole and "y" * 5000 in whole
        assert fits(browser)  # opened, it wraps as well

        browser.get(f"{dashboard.url}/q/1")
        wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "div.unreachable"), "the error")
        browser.find_element(By.CSS_SELECTOR, "details.error-whole summary").click()
        assert browser.execute_script(
            "return document.documentElement.scrollWidth <= window.innerWidth")
    finally:
        broker.close()


def test_the_running_table_shows_each_job_and_marks_the_one_past_slow_job_after(
        tmp_path, redis_url, client, dashboards, supervisors, browser):
    """Issue 41.6, as an operator sees it: what runs now, per queue (pid linked to its page,
    attempt, run time, handler process), and a job past ``slow_job_after`` marked."""
    from support.envelopes import publish

    [hung] = publish(client, [{"hang": True, "n": 0}])
    config = write_config(tmp_path, redis_url, handler="tests.handlers.e2e_slow:handle",
                          job={"slow_job_after": 2}, supervisor={"shutdown_deadline": 3})
    supervisors(config, redis_url)
    dashboard = dashboards(config)
    browser.get(f"{dashboard.url}/q/0")
    wait(browser, lambda d: hung in (text(d, "table.running") or ""), "the hung job's row")
    row = browser.find_element(By.CSS_SELECTOR, "table.running tbody tr")
    assert row.find_element(By.CSS_SELECTOR, "td.pid a").get_attribute("href").endswith(
        f"/q/0/job?pid={hung}")
    wait(browser, lambda d: "past slow_job_after" in (text(d, "table.running") or ""),
         "the job marked slow once it ran past slow_job_after (2 s)")
    assert "slow" in browser.find_element(By.CSS_SELECTOR, "table.running tbody tr"
                                          ).get_attribute("class")


def test_a_failed_jobs_page_shows_its_attempts_in_order_and_when_it_was_first_published(
        tmp_path, redis_url, client, dashboards, supervisors, browser):
    """Issue 41.7, as an operator sees it: a job that failed every attempt, its page listing
    them in order with the first publish time (kept from attempt 1's record: queue 5 writes
    a retry's envelope with a new timestamp), and "attempt" the one word for a delivery."""
    from support.envelopes import publish

    [pid] = publish(client, [{"fail": True}])
    config = write_config(tmp_path, redis_url, job={"max_attempts": 3, "retry_backoff": 0})
    supervisors(config, redis_url)
    dashboard = dashboards(config)
    wait(browser, lambda d: client.lrange(keys().failed, 0, -1) == [pid.encode()],
         "the job in the failed list after its third attempt")
    browser.get(f"{dashboard.url}/q/0/job?pid={pid}")
    shown = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "ol.history li.attempt")]
    assert [re.search(r"attempt (\d+) failed", line).group(1) for line in shown] == [
        "1", "2", "3"], shown
    assert all("asked to fail" in line for line in shown)
    assert "first published" in browser.find_element(By.TAG_NAME, "main").text
    assert "run " not in " ".join(shown)  # one word for one delivery: attempt


def test_the_supervisors_side_by_side_render_and_fill_in_live(
        tmp_path, redis_url, dashboards, supervisors, browser, steady):
    """Issue 41.9: the queue page's table of each supervisor's prefetch and rates renders,
    within the window, and fills in as the live update brings the second reading."""
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
