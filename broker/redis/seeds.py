"""Seed nodes of a Redis Cluster: ``[broker] url`` may list several, comma-separated.

A cluster client needs one reachable node to load the slot map; with one seed, a supervisor
started while that node is down (killed, failing over, replaced) cannot start at all. So, as
NATS clients take several server URLs, the URL may name several nodes:

    redis://10.0.0.11:6379/0,redis://10.0.0.12:6379/0,redis://10.0.0.13:6379/0

Each part is a whole URL; credentials, TLS and database are read from the first (a cluster
has one database and, here, one user for all nodes: ``broker.urls.url_problem`` refuses a
list whose seeds differ in credentials). Once connected the client learns every
node from the slot map, so the list only matters for starting and for a full reload.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url

from broker.redis.connection import use_in_cluster
from broker.urls import split_servers


def settings(url: str) -> dict[str, Any]:
    """redis-py's settings of a URL or a seed list: the first seed's (credentials, database,
    TLS), which are the client's."""
    found: dict[str, Any] = parse_url(split_servers(url)[0])  # type: ignore[no-untyped-call]
    return found


def cluster_client(url: str, **options: Any) -> RedisCluster:
    """A cluster client that may start from any of the seeds in ``url``."""
    parts = split_servers(url)
    if len(parts) == 1:
        cluster = RedisCluster.from_url(url, **options)
        use_in_cluster(cluster)
        return cluster
    client: dict[str, Any] = {**options, **settings(url)}
    client.pop("host", None)
    client.pop("port", None)
    if client.pop("connection_class", None) is not None:  # rediss:// -> SSLConnection
        client["ssl"] = True
    nodes = []
    for part in parts:
        parsed = urlsplit(part)
        nodes.append(ClusterNode(parsed.hostname or "127.0.0.1", parsed.port or 6379))
    cluster = RedisCluster(startup_nodes=nodes, **client)
    use_in_cluster(cluster)
    return cluster
