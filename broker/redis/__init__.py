"""The Redis broker (queue 5's wire protocol): the adapter, its key names, Lua scripts,
recovery, Cluster placement, publishing, and the ACL users it needs.

The adapter is loaded on first use: the key names (``broker.redis.keys``) are read by the
configuration of every job, and a NATS job should not load redis-py for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.redis.broker import RedisBroker, has_hash_tag
    from broker.redis.reservation import Reservation

__all__ = ["RedisBroker", "Reservation", "has_hash_tag"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("broker.redis.broker"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
