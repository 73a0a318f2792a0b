"""An async handler for end-to-end tests: e2e_record.py's files, from coroutines.

Files in E2E_DIR: "started" ("<pid> <attempts> <process> <in flight>"), "handled" (pids),
"succeeded" ("<pid> confirmed|early", checked in Redis by on_success), "flushed" (pids).
Environment: E2E_REDIS, E2E_NAMESPACE (the on_success check), E2E_FLUSH_GATE (flush()
waits, yielding, until this file exists; without it there is no waiting), E2E_HANG_ALWAYS.
Payload flags: {"sleep": s} (awaited), {"gate": name} (wait, yielding, for E2E_DIR/name),
{"crash_once": s} (SIGKILL the process s seconds in, on the first attempt only),
{"wait_then_block": [s, t]} (await s seconds, then block the loop for t seconds),
{"hang": true} (await forever), {"fail": true}.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from support.waiting import until
from tests.handlers.e2e_record import _append

DIR = os.environ.get("E2E_DIR", ".")
_in_flight = 0
_buffered: list[str] = []


async def _wait_for(path: str) -> None:
    await until(lambda: os.path.exists(path), None, f"the gate {path}", every=0.01)


async def handle(message) -> None:
    global _in_flight
    payload = message.payload
    _in_flight += 1
    try:
        _append("started", f"{message.pid} {message.attempts} {os.getpid()} {_in_flight}")
        if os.environ.get("E2E_HANG_ALWAYS") or payload.get("hang"):
            await asyncio.sleep(3600)
        if payload.get("gate"):
            await _wait_for(os.path.join(DIR, payload["gate"]))
        if payload.get("crash_once") is not None and message.attempts == 0:
            await asyncio.sleep(payload["crash_once"])
            os.kill(os.getpid(), signal.SIGKILL)
        if payload.get("wait_then_block"):
            wait, block = payload["wait_then_block"]
            await asyncio.sleep(wait)
            time.sleep(block)  # noqa: ASYNC251 - blocks its loop on purpose (the flag's point)
        if payload.get("sleep"):
            await asyncio.sleep(payload["sleep"])
        if payload.get("fail"):
            raise RuntimeError(f"asked to fail ({message.pid})")
    finally:
        _in_flight -= 1
    _buffered.append(message.pid)
    _append("handled", message.pid)


async def flush() -> None:
    pids = _buffered.copy()
    _buffered.clear()
    gate = os.environ.get("E2E_FLUSH_GATE")
    if gate:
        await _wait_for(gate)
    for pid in pids:
        _append("flushed", pid)


async def on_success(message) -> None:
    """Checks in Redis, with an asyncio client, that the commit happened before this ran."""
    url = os.environ.get("E2E_REDIS")
    state = "unchecked"
    if url:
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(url)
        ns = os.environ.get("E2E_NAMESPACE", "utopia-queue")
        exists = await client.exists(f"{ns}.owners.{message.queue}.{message.pid}")
        state = "early" if exists else "confirmed"
        await client.aclose()
    _append("succeeded", f"{message.pid} {state}")
