"""The stats-usage canary, live: several supervisors on one queue, told apart on the dashboard.

    python -m bench.canary_live [--prefetch 1,8,32,100] [--rate 1500] [--seconds 120]
        [--out bench/results/<name>] [--screenshot docs/dashboard/canary.png]

Starts a private redis-server, one supervisor per prefetch on the same queue (the
stats-usage handler, each with a SQLite store of its own), a steady publisher
(``bench.publisher``: ``--rate`` messages a second for ``--seconds``) and the dashboard;
near the end of the publishing it reads the queue page's "Supervisors side by side" table
(``supervisor.dashboard.compare``: per supervisor its prefetch, coroutines, jobs/s, CPU per
job, messages per reserve and per settle call, queue wait p50/p99 and retries, over the
last minute), optionally takes a picture of it (chromium and chromium-driver), then lets
the queue drain, stops the supervisors and checks the usage accounting: the totals of the
four stores together are exactly those of the messages published. Prints the table as
Markdown (the README's canary section shows one) and exits 1 if the totals are wrong or a
supervisor made no progress.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.common import QUEUE, ROOT, start, stop
from bench.runs import expected_usage, job_file
from broker.redis.keys import QueueKeys
from support.dashboard import Dashboard, table_rows
from support.servers import RedisServer, free_port

HANDLER = "examples.stats_usage:handle"
COLUMNS = ("supervisor", "prefetch", "coroutines", "jobs/s", "CPU per job",
           "msgs per reserve", "msgs per settle", "queue wait p50 / p99", "retries", "over",
           "jobs done")


def figure_rows(body: str) -> list[dict[str, str]]:
    """The queue page's "Supervisors side by side" table, each row's cells by column."""
    return table_rows(body, "figures", COLUMNS) or []


def markdown(rows: list[dict[str, str]]) -> str:
    shown = COLUMNS[1:]  # the host and pid say nothing to a reader of the README
    lines = ["| " + " | ".join(shown) + " |",
             "|" + "|".join("---:" for _ in shown) + "|"]
    lines += ["| " + " | ".join(row[name] for name in shown) + " |" for row in rows]
    return "\n".join(lines)


def screenshot(url: str, path: Path) -> str | None:
    """A picture of the queue page's table; None, or why not."""
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        return "chromium or chromium-driver is not installed"
    from selenium import webdriver
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver_path))
    try:
        driver.get(url)
        time.sleep(3)  # a live update or two: the rates filled in
        table = driver.find_element(By.CSS_SELECTOR, "table.figures")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", table)
        path.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(path))
    finally:
        driver.quit()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.canary_live", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefetch", default="1,8,32,100")
    parser.add_argument("--rate", type=float, default=1500.0)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--screenshot", type=Path)
    args = parser.parse_args(argv)
    prefetches = [int(p) for p in args.prefetch.split(",")]
    messages = int(args.rate * args.seconds)
    with tempfile.TemporaryDirectory(prefix="canary-") as scratch:
        work = Path(scratch)
        server = RedisServer().start()
        supervisors, stores, dashboard, publisher = [], [], None, None
        try:
            configs = []
            for prefetch in prefetches:
                folder = work / f"prefetch-{prefetch}"
                folder.mkdir()
                configs.append(job_file(folder, server.url, HANDLER, prefetch,
                                        metrics_port=free_port()))
                stores.append(str(folder / "usage.sqlite"))
                supervisors.append(start(["-m", "supervisor", str(configs[-1])],
                                         STATS_USAGE_DB=stores[-1]))
            time.sleep(3)  # handler processes and writers up
            dashboard = Dashboard([configs[0]], work)
            began = time.monotonic()
            publisher = start(["-m", "bench.publisher", server.url, "--rate", str(args.rate),
                               "--messages", str(messages)])
            time.sleep(max(5.0, args.seconds - 10))  # a steady minute and more behind us
            body = dashboard.client.get("/live/q/0")[1]
            rows = figure_rows(body)
            read_at = time.monotonic() - began
            why_not = (screenshot(f"{dashboard.url}/q/0", args.screenshot)
                       if args.screenshot else None)
            publisher.wait(args.seconds + 120)
            import redis

            client = redis.Redis.from_url(server.url)
            ready = QueueKeys("utopia-queue", QUEUE)
            deadline = time.monotonic() + 600
            while (client.llen(ready.ready) or client.llen(ready.processing)) \
                    and time.monotonic() < deadline:
                time.sleep(0.5)
            drained = time.monotonic() - began
            load = Path("/proc/loadavg").read_text().split()[:3]
        finally:
            if publisher is not None:
                stop(publisher)
            if dashboard is not None:
                dashboard.stop()
            for supervisor in supervisors:
                stop(supervisor, 60)
            server.close()
        from examples.stats_usage import totals

        summed: dict[tuple[str, str], int] = {}
        for store in stores:
            for key, value in totals(store).items():
                summed[key] = summed.get(key, 0) + value
        exact = summed == expected_usage(messages)
    moving = len(rows) == len(prefetches) and all(
        row["jobs/s"] not in ("—", "0.0") for row in rows)
    table = markdown(rows)
    summary = (f"{len(prefetches)} supervisors (prefetch {args.prefetch}) on one Redis queue, "
               f"stats-usage handler (SQLite), {args.rate:g} messages/s for {args.seconds:g} s "
               f"({messages:,}); table read at {read_at:.0f} s, queue drained at "
               f"{drained:.0f} s; load average {' '.join(load)}; usage totals of the "
               f"{len(stores)} stores together {'exact' if exact else 'WRONG'}")
    print(table)
    print()
    print(summary)
    if why_not:
        print(f"no screenshot: {why_not}", file=sys.stderr)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {"rows": rows, "summary": summary, "exact": exact, "moving": moving,
             "commit": _commit()}, indent=2) + "\n")
        (args.out / "README.md").write_text(
            f"# The stats-usage canary, live\n\n`python -m bench.canary_live "
            f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n\n{table}\n\n{summary}\n")
    return 0 if exact and moving else 1


def _commit() -> str:
    import subprocess

    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True)
    return done.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
