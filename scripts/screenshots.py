"""Make the dashboard screenshots of docs/dashboard.md (docs/dashboard/*.png) from a live demo.

    .venv/bin/python scripts/screenshots.py [--out docs/dashboard]

Starts a private redis-server, three queues (one a supervisor drains while messages keep
arriving, one backed up with nothing consuming it, one with failed jobs and their error
records, hostile text included), a fourth on a second redis-server that is stopped before
the pictures (its figures shown stale), a supervisor, and the dashboard with a token; then
drives Debian's chromium (chromium-driver, Selenium) through the main pages, logged in, the
pointer on the queue page's backlog chart. Takes about two minutes: the plots need samples,
and "not draining" a minute of them.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402
import redis  # noqa: E402

from broker.failure import Failure  # noqa: E402
from broker.redis.keys import QueueKeys  # noqa: E402
from support.dashboard import Dashboard  # noqa: E402
from support.envelopes import lpush_batched, of  # noqa: E402
from support.servers import RedisServer, free_port  # noqa: E402
from support.supervision import Supervisor, write_config  # noqa: E402

NAMESPACE = "utopia-queue"
TOKEN = "screenshot-token"
#: Seconds of demo before the pictures (the overview's "not draining" needs 60).
WARM_UP = 75
#: Seconds before the pictures that the fourth queue's broker stops.
STOPPED = 20


def job_file(directory: Path, url: str, queue: str, **supervisor: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_config(directory, url, handler="examples.noop:handle",
                        broker={"namespace": NAMESPACE}, job={"queue": queue},
                        supervisor=dict(supervisor))


def fill(client: redis.Redis) -> None:
    emails = QueueKeys(NAMESPACE, "emails")
    lpush_batched(client, emails.ready, of("emails", ({"to": f"user{n}@example.com"}
                                                      for n in range(1840))))
    hooks = QueueKeys(NAMESPACE, "webhooks")
    errors = [
        ("ConnectionError", "POST https://hooks.example.com/a: connection refused",
         "handlers/webhook.py:41 in handle"),
        ("TimeoutError", "no answer within 10 s", "handlers/webhook.py:44 in handle"),
        ("ValueError", '<script>alert("a payload")</script> \u202egnp.exe',
         "handlers/webhook.py:18 in parse"),
    ]
    for n in range(23):
        error, message, where = errors[n % len(errors)]
        [(pid, raw)] = of("webhooks", [{"url": f"https://hooks.example.com/{n}", "n": n}])
        record = orjson.loads(raw)
        published = int(time.time()) - 3600 + n * 90  # each failed a few minutes after
        record.update(attempts=3, timestamp=published)
        client.set(hooks.job(pid), orjson.dumps(record))
        client.lpush(hooks.failed if n % 5 else hooks.dead, pid)
        traceback = (f'Traceback (most recent call last):\n  File "{where.split(":")[0]}", '
                     f"line {where.split(':')[1].split()[0]}, in handle\n{error}: {message}")
        client.set(hooks.error(pid), Failure(
            error, message, where=where, traceback=traceback, attempt=3, at=published + 200.0,
            outcome="failed" if n % 5 else "dead", consumer="web-1a2b3c").encode())
    client.lpush(hooks.poison, b'{"pid": "truncated', b"\xff\xfe not json")


def publish(client: redis.Redis, stop: threading.Event) -> None:
    """stats-usage: 10 to 40 messages a second, in waves."""
    keys, n = QueueKeys(NAMESPACE, "stats-usage"), 0
    while not stop.is_set():
        count = 10 + 30 * (int(time.time() / 15) % 2)
        lpush_batched(client, keys.ready, of("stats-usage", ({"n": n + i}
                                                             for i in range(count))))
        n += count
        stop.wait(1)


#: Where along a chart (0 left ... 1 right) its largest value is drawn.
PEAK = """const svg = arguments[0], values = svg.dataset.values.split(" ").map(Number);
const age = Number(svg.dataset.ages.split(" ")[values.indexOf(Math.max(...values))]);
return 1 - age / Number(svg.dataset.span);"""


def fit_window(driver: Any) -> None:
    """The window as high as the page (the browser's own bars taken into account)."""
    for _ in range(2):
        height = driver.execute_script("return document.body.scrollHeight")
        inner = driver.execute_script("return window.innerHeight")
        outer = driver.get_window_size()["height"]
        driver.set_window_size(1500, min(max(height + outer - inner, 500), 2400))


def shoot(dashboard: Dashboard, out: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"  # Debian's, not a download
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--window-size=1500,900", "--hide-scrollbars"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(
        shutil.which("chromedriver") or "chromedriver"))
    try:
        driver.get(f"{dashboard.url}/login")
        driver.find_element(By.ID, "who").send_keys("ops")
        driver.find_element(By.ID, "token").send_keys(TOKEN)
        driver.find_element(By.ID, "login").click()
        time.sleep(1)
        pages = {"overview": "/", "queue": "/q/0", "failed": "/q/2/list/failed"}
        for name, path in pages.items():
            driver.get(dashboard.url + path)
            time.sleep(2)
            fit_window(driver)
            if name == "queue":  # the value under the pointer, at the backlog's peak
                chart = driver.find_element(By.CSS_SELECTOR, "svg.backlog")
                ActionChains(driver).move_to_element_with_offset(
                    chart, int(chart.size["width"] * (driver.execute_script(PEAK, chart) - .5)),
                    0).perform()
                time.sleep(0.5)
            driver.save_screenshot(str(out / f"{name}.png"))
            print(f"wrote {out / f'{name}.png'}")
        driver.get(dashboard.url + "/q/2/list/failed")
        driver.find_element(By.CSS_SELECTOR, "td.pid a").click()
        time.sleep(1)
        driver.set_window_size(1500, 1300)
        driver.save_screenshot(str(out / "job.png"))
        print(f"wrote {out / 'job.png'}")
    finally:
        driver.quit()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="qs-screenshots-"))
    server, other = RedisServer().start(), RedisServer().start()
    client = redis.Redis.from_url(server.url)
    stop = threading.Event()
    supervisor = dashboard = None
    try:
        fill(client)
        with redis.Redis.from_url(other.url) as reports:
            lpush_batched(reports, QueueKeys(NAMESPACE, "reports").ready,
                          of("reports", ({"n": n} for n in range(212))))
        configs = [job_file(work / "stats", server.url, "stats-usage",
                            metrics_port=free_port()),
                   job_file(work / "emails", server.url, "emails"),
                   job_file(work / "hooks", server.url, "webhooks"),
                   job_file(work / "reports", other.url, "reports")]
        dashboard = Dashboard(configs, work, token=TOKEN)
        publisher = threading.Thread(target=publish, args=(client, stop), daemon=True)
        publisher.start()
        time.sleep(WARM_UP / 3)  # a backlog builds up before anyone consumes it
        supervisor = Supervisor(configs[0], work, server.url)
        time.sleep(WARM_UP * 2 / 3 - STOPPED)
        other.stop()  # the reports queue's broker: its figures go stale
        time.sleep(STOPPED)
        shoot(dashboard, args.out)
    finally:
        stop.set()
        if supervisor is not None:
            supervisor.stop()
        if dashboard is not None:
            dashboard.stop()
        client.close()
        server.stop()
        other.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
