"""End-to-end throughput of ``python -m supervisor`` on a private redis-server.

    python -m bench.throughput --prefetch 1,100 --messages 20000

Pre-fills the queue with PHP-compatible stats-usage envelopes, runs the supervisor with the
no-op handler (coroutines 1) until every message is committed, and prints jobs/s plus the
client CPU (supervisor and handler processes) and Redis CPU per job, measured in one run.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import redis

from broker import envelope
from broker.keys import QueueKeys

ROOT = Path(__file__).resolve().parent.parent
QUEUE = "bench"
NAMESPACE = "utopia-queue"


def stats_usage_payload(n: int) -> dict:
    return {
        "project": {"$id": f"project-{n % 50}"},
        "metrics": [{"key": "executions", "value": 1}, {"key": "network.requests", "value": n % 7}],
    }


def prefill(client: redis.Redis, key: str, messages: int) -> None:
    raws = [envelope.build(QUEUE, stats_usage_payload(n))[1] for n in range(messages)]
    for start in range(0, messages, 1000):
        client.lpush(key, *raws[start : start + 1000])


def wait_until_running(process: psutil.Process) -> None:
    """The supervisor shows "running" in its title once its loop is up."""
    deadline = time.monotonic() + 30
    while "running" not in " ".join(process.cmdline()):
        if time.monotonic() > deadline:
            raise SystemExit("the supervisor did not start")
        time.sleep(0.05)
    time.sleep(0.5)  # handler processes ready, receive blocked on the empty queue


def redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def family_cpu(process: psutil.Process) -> float:
    total = 0.0
    for member in [process, *process.children(recursive=True)]:
        try:
            times = member.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def run_one(url: str, client: redis.Redis, prefetch: int, messages: int, handler: str) -> dict:
    client.flushall()
    keys = QueueKeys(NAMESPACE, QUEUE)
    staging = f"{keys.ready}.staging"
    prefill(client, staging, messages)
    with tempfile.TemporaryDirectory() as workdir:
        config = Path(workdir) / "bench.toml"
        config.write_text(
            f'[broker]\nurl = "{url}"\nnamespace = "{NAMESPACE}"\n'
            f'[job]\nqueue = "{QUEUE}"\nhandler = "{handler}"\ncoroutines = 1\n'
            f"prefetch = {prefetch}\n[supervisor]\nlog_level = \"warning\"\n"
        )
        env = dict(os.environ, PYTHONPATH=str(ROOT), STATS_USAGE_DB=str(Path(workdir) / "u.db"))
        env.pop("QUEUE_BROKER_URL", None)
        child = subprocess.Popen([sys.executable, "-m", "supervisor", str(config)], cwd=ROOT,
                                 env=env)
        process = psutil.Process(child.pid)
        wait_until_running(process)
        # Start-up is not part of the figure: measure from the moment the work appears.
        cpu_client_before = family_cpu(process)
        cpu_redis_before = redis_cpu(client)
        began = time.perf_counter()
        client.rename(staging, keys.ready)  # all messages at once (wakes the blocked receive)
        cpu_client = 0.0
        while int(client.get(keys.stat("success")) or 0) < messages:
            cpu_client = max(cpu_client, family_cpu(process))
            if child.poll() is not None:
                raise SystemExit(f"supervisor exited with {child.returncode}")
            time.sleep(0.01)
        elapsed = time.perf_counter() - began
        cpu_client = max(cpu_client, family_cpu(process)) - cpu_client_before
        cpu_redis = redis_cpu(client) - cpu_redis_before
        child.send_signal(signal.SIGTERM)
        child.wait(30)
    return {
        "prefetch": prefetch, "messages": messages, "seconds": elapsed,
        "jobs_per_s": messages / elapsed,
        "client_us_per_job": cpu_client / messages * 1e6,
        "redis_us_per_job": cpu_redis / messages * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--prefetch", default="1,100")
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--handler", default="examples.noop:handle")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.servers import RedisServer

    server = RedisServer().start()
    try:
        client = redis.Redis(port=server.port)
        print("| prefetch | messages | seconds | jobs/s | client µs/job | Redis µs/job |")
        print("|---:|---:|---:|---:|---:|---:|")
        for prefetch in (int(p) for p in args.prefetch.split(",")):
            r = run_one(server.url, client, prefetch, args.messages, args.handler)
            print(f"| {r['prefetch']} | {r['messages']} | {r['seconds']:.2f} | "
                  f"{r['jobs_per_s']:,.0f} | {r['client_us_per_job']:.0f} | "
                  f"{r['redis_us_per_job']:.1f} |", flush=True)
    finally:
        server.close()


if __name__ == "__main__":
    main()
