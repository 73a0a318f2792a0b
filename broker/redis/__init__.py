"""The Redis broker (queue 5's wire protocol): the adapter, its key names, Lua scripts,
recovery, Cluster placement, publishing, and the ACL users it needs."""

from broker.redis.broker import RedisBroker, Reservation, has_hash_tag

__all__ = ["RedisBroker", "Reservation", "has_hash_tag"]
