"""``python -m tests.faults TARGET CONF``: the supervisor with one failure injected.

TARGET names the loop or callback that raises (once, after the first deliveries arrived):
``receive``, ``settle``, ``renew``, ``maintain``, ``watch``, ``keepalive``, ``outcomes``,
``forkserver``. The failure is a plain RuntimeError("injected ..."), i.e. a bug, not a
broker error the loops know how to retry.
"""

from __future__ import annotations

import sys

from broker.redis import RedisBroker
from supervisor import cli, outcomes, pool, settlement, systemd

#: What uvloop raises for a write to a transport it has already closed (asyncio's own loop
#: drops such a write): the brokers' write paths must tell it as a lost connection.
UVLOOP_REFUSAL = ("unable to perform operation on <TCPTransport closed=True reading=False "
                  "0x55c7e6341b30>; the handler is closed")


def armed(owner: type | object, name: str, after: int = 1) -> None:
    """Make ``owner.name`` raise on its call number ``after + 1`` (once)."""
    original = getattr(owner, name)
    calls = 0

    def failing(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == after + 1:
            raise RuntimeError(f"injected failure in {name}")
        return original(*args, **kwargs)

    if hasattr(original, "__code__") and original.__code__.co_flags & 0x80:  # a coroutine
        async def failing_async(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == after + 1:
                raise RuntimeError(f"injected failure in {name}")
            return await original(*args, **kwargs)

        setattr(owner, name, failing_async)
    else:
        setattr(owner, name, failing)


TARGETS = {
    "receive": lambda: armed(RedisBroker, "receive", after=2),
    "settle": lambda: armed(settlement.Settler, "settle"),
    "renew": lambda: armed(RedisBroker, "extend"),
    "maintain": lambda: armed(RedisBroker, "maintain"),
    "watch": lambda: armed(pool.HandlerPool, "enforce_limits", after=8),
    "keepalive": lambda: armed(systemd, "status_text", after=1),
    "outcomes": lambda: armed(outcomes.HandlerOutcomes, "handle_records", after=3),
    "forkserver": lambda: armed(pool.HandlerPool, "handle_forkserver_events", after=0),
}


if __name__ == "__main__":
    target, config = sys.argv[1:3]
    TARGETS[target]()
    sys.exit(cli.main([config]))
