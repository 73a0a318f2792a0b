"""The private Redis Cluster moved to ``support.cluster`` (the failover benchmark uses it too)."""

from support.cluster import ClusterNode, Migration, PrivateCluster, cluster_ports

__all__ = ["ClusterNode", "Migration", "PrivateCluster", "cluster_ports"]
