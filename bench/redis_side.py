"""Redis server figures: CPU, requests, bytes and script time, as deltas between snapshots.

``INFO commandstats`` also counts the commands that Lua scripts run inside the server, so
"broker requests" counts only commands a client can have sent: every command name that no
script of this run calls (ours in ``lua/``, the bench's own, Dramatiq's), minus the
harness's own polls and INFO calls. The top-level commands that share a name with a script
command (the supervisor's maintenance GET/SET/MGET, a few per 5 s) are left out with them.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench.common import QUEUE, ROOT, stats_usage_payload
from broker import envelope

_CALL = re.compile(r"""redis\.p?call\(\s*['"]([A-Za-z]+)['"]""")
#: Commands of the harness itself (its probes), never counted as broker requests.
HARNESS = {"info", "config|resetstat", "config|set", "config|get", "slowlog|reset",
           "slowlog|get", "slowlog|len", "flushdb", "rename", "multi", "exec", "dbsize"}


def _sources() -> list[Path]:
    return [*(ROOT / "lua").glob("*.lua"), *(ROOT / "bench" / "lua").glob("*.lua")]


def script_names() -> dict[str, str]:
    """SHA1 -> script name of our scripts and the bench's own (to read the slow log)."""
    return {hashlib.sha1(path.read_bytes()).hexdigest(): path.stem for path in _sources()}


def script_commands() -> set[str]:
    """Lower-case names of every command some Lua script of this run may call."""
    sources = _sources()
    try:
        import dramatiq.brokers.redis as dramatiq_redis

        sources += Path(dramatiq_redis.__file__).parent.joinpath("redis").glob("*.lua")
    except ImportError:
        pass
    names: set[str] = set()
    for source in sources:
        names |= {name.lower() for name in _CALL.findall(source.read_text())}
    return names


@dataclass
class Snapshot:
    cpu: float
    calls: dict[str, int]
    usec: dict[str, int]
    net_in: int
    net_out: int


def snapshot(client: redis.Redis) -> Snapshot:
    info = client.info("all")
    calls, usec = {}, {}
    for key, value in info.items():
        if key.startswith("cmdstat_"):
            calls[key[8:]] = int(value["calls"])
            usec[key[8:]] = int(value["usec"])
    return Snapshot(
        cpu=float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
        calls=calls, usec=usec,
        net_in=int(info["total_net_input_bytes"]), net_out=int(info["total_net_output_bytes"]),
    )


@dataclass
class Probe:
    """The harness's own commands during a measured run, to subtract from the counts."""

    client: redis.Redis
    sent: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.client.ping()  # connected (and its HELLO sent) before the counts are read

    def get_int(self, key: str) -> int:
        self.sent["get"] += 1
        return int(self.client.get(key) or 0)

    def hlen(self, key: str) -> int:
        self.sent["hlen"] += 1
        return int(self.client.hlen(key))

    def llen_sum(self, *keys: str) -> int:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.llen(key)
            self.sent["llen"] += 1
        return sum(pipe.execute())


def delta(before: Snapshot, after: Snapshot, internal: set[str], probe: Probe) -> dict[str, Any]:
    """Server CPU, requests by command, bytes and per-script figures between two snapshots."""
    calls = {name: after.calls.get(name, 0) - before.calls.get(name, 0) for name in after.calls}
    usec = {name: after.usec.get(name, 0) - before.usec.get(name, 0) for name in after.usec}
    requests = {
        name: count - probe.sent.get(name, 0) for name, count in calls.items()
        if name not in internal and name not in HARNESS and count - probe.sent.get(name, 0) > 0
    }
    scripts = calls.get("evalsha", 0) + calls.get("eval", 0)
    script_usec = usec.get("evalsha", 0) + usec.get("eval", 0)
    return {
        "server_cpu_s": after.cpu - before.cpu,
        "requests": sum(requests.values()),
        "requests_by_command": requests,
        "script_calls": scripts,
        "script_usec_per_call": script_usec / scripts if scripts else None,
        # RPOP runs only in reserve.lua, MSET only in claim.lua (with messages), DECRBY in
        # settle.lua (and in recoveries, which a clean run has none of).
        "reserve_calls": calls.get("rpop", 0),
        "claim_calls": calls.get("mset", 0),
        "settle_calls": calls.get("decrby", 0),
        "bytes_in": after.net_in - before.net_in,
        "bytes_out": after.net_out - before.net_out,
    }


def reset(client: redis.Redis, slowlog_usec: int = 5000) -> None:
    """Fresh command statistics and an empty slow log that keeps every call above 5 ms."""
    client.config_set("slowlog-log-slower-than", slowlog_usec)
    client.config_set("slowlog-max-len", 10000)
    client.slowlog_reset()
    client.config_resetstat()


def slow_calls(client: redis.Redis) -> dict[str, Any]:
    """Calls above the slow-log threshold: how many, the longest, and by command (a script
    by its name; commands that scripts ran inside count on their own as well)."""
    names = script_names()
    entries = client.slowlog_get(10000)
    durations = [int(entry["duration"]) for entry in entries]
    commands: Counter = Counter()
    for entry in entries:
        words = entry["command"]
        words = (words.decode(errors="replace") if isinstance(words, bytes) else str(words))
        words = words.split()
        name = words[0].lower() if words else "?"
        if name == "evalsha" and len(words) > 1:
            name = f"evalsha {names.get(words[1], words[1][:8])}"
        commands[name] += 1
    return {"count": len(entries), "max_usec": max(durations, default=0),
            "commands": dict(commands)}


def fill(client: redis.Redis, key: str, messages: int, start: int = 0) -> None:
    """LPUSH ``messages`` stats-usage envelopes onto ``key`` (oldest consumed first)."""
    published = None
    for first in range(start, start + messages, 1000):
        raws = [envelope.build(QUEUE, stats_usage_payload(n, published))[1]
                for n in range(first, min(first + 1000, start + messages))]
        client.lpush(key, *raws)


def server_version(client: redis.Redis) -> str:
    info = client.info("server")
    return f"redis {info['redis_version']}"
