"""Alpha-beta models of the collectives a layout runs, on the slowest link its group crosses.

Time of one collective = latency + bus_factor · bytes / bus_bandwidth, with NCCL's ring factors (NCCL docs,
"Performance" / nccl-tests PERFORMANCE.md): all-reduce 2(n−1)/n, all-gather and reduce-scatter (n−1)/n of the full
buffer; a point-to-point send moves its bytes once. Bus bandwidth is the link bandwidth times the cluster profile's
measured collective efficiency.

Which link: ranks are ordered tp fastest, then dp, then pp, so a group of `size` ranks with `stride` between
members covers size·stride consecutive ranks. If those fit in one node, it runs on NVLink. Otherwise it crosses
the network, where every GPU has its own NIC (rail-optimised DGX nodes): NCCL runs one ring per NIC, so a group
with k members per node drives k NICs, and its ring bandwidth is min(NVLink, k · per-GPU network bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlm.planner.cost.hardware import ClusterProfile


@dataclass(frozen=True)
class Link:
    """Bus bandwidth (bytes/s) and per-call latency (s) of the slowest hop of a group."""

    bus_bytes_per_s: float
    latency_s: float
    crosses_nodes: bool


def group_link(cluster: ClusterProfile, size: int, stride: int) -> Link:
    """The link a group of `size` ranks, `stride` apart in rank order, communicates over."""
    intra = Link(
        cluster.intra_node_gbps * 1e9 * cluster.intra_node_collective_efficiency,
        cluster.intra_node_latency_us * 1e-6,
        False,
    )
    if size * stride <= cluster.gpus_per_node:
        return intra
    per_node = max(1, min(size, cluster.gpus_per_node // max(stride, 1)))
    network = per_node * cluster.inter_node_gbps * 1e9 * cluster.inter_node_collective_efficiency
    return Link(min(intra.bus_bytes_per_s, network), cluster.inter_node_latency_us * 1e-6, True)


def p2p_link(cluster: ClusterProfile, stride: int) -> Link:
    """Link between neighbouring pipeline ranks `stride` ranks apart (one NIC per GPU when across nodes)."""
    if stride < cluster.gpus_per_node:
        return Link(
            cluster.intra_node_gbps * 1e9 * cluster.intra_node_collective_efficiency,
            cluster.intra_node_latency_us * 1e-6,
            False,
        )
    return Link(
        cluster.inter_node_gbps * 1e9 * cluster.inter_node_collective_efficiency,
        cluster.inter_node_latency_us * 1e-6,
        True,
    )


def all_reduce_s(nbytes: float, n: int, link: Link, calls: int = 1) -> float:
    """Ring all-reduce of `nbytes` in total over `calls` calls among n ranks: 2(n−1)/n · bytes / busbw."""
    if n <= 1 or (nbytes <= 0 and calls <= 0):
        return 0.0
    return calls * link.latency_s + 2.0 * (n - 1) / n * nbytes / link.bus_bytes_per_s


def all_gather_s(nbytes: float, n: int, link: Link, calls: int = 1) -> float:
    """Ring all-gather producing `nbytes` (the full buffer) on each rank: (n−1)/n · bytes / busbw."""
    if n <= 1:
        return 0.0
    return calls * link.latency_s + (n - 1) / n * nbytes / link.bus_bytes_per_s


reduce_scatter_s = all_gather_s  # same ring traffic, reversed: (n−1)/n of the full buffer


def p2p_s(nbytes: float, link: Link) -> float:
    """One send/recv of `nbytes` between two ranks."""
    return link.latency_s + nbytes / link.bus_bytes_per_s
