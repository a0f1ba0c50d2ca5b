"""Alpha-beta models of the collectives a layout runs, on the slowest link its group crosses.

Bandwidth term: NCCL's ring factors (NCCL docs "Performance" / nccl-tests PERFORMANCE.md): all-reduce 2(n−1)/n,
all-gather and reduce-scatter (n−1)/n of the full buffer, over the bus bandwidth (link bandwidth times the
cluster profile's measured collective efficiency); a point-to-point send moves its bytes once.

Latency term, as NCCL's own tuning model prices a ring (src/graph/tuning.cc: base latency + steps x per-hop
latency): one base latency per call plus one hop latency per ring step, (n−1) steps for all-gather and
reduce-scatter and 2(n−1) for all-reduce, so latency grows with the group. A ring over N nodes has N of its n hops
on the network and n−N on NVLink (hierarchical: each node's members are consecutive in the ring), each priced at
its own link's hop latency.

All-to-all (expert dispatch and combine): each of the n ranks sends (n−1)/n of its buffer, 1/n to each peer, all at
once; peers inside the node are reached over NVLink, the others through the rank's own NIC, so the time is the
longer of the two shares over its link (plus one base latency and n−1 hops, as NCCL runs it: grouped send/recv).

Which link: ranks are ordered tp fastest, then cp, then dp, then pp (Megatron-Core's order), so a group of `size`
ranks with `stride` between members covers size·stride consecutive ranks. If those fit in one node, it runs on
NVLink. Otherwise it crosses the network, where every GPU has its own NIC (rail-optimised DGX nodes): NCCL runs one
ring per NIC, so a group with k members per node drives k NICs, and its ring bandwidth is min(NVLink, k · per-GPU
network bandwidth): the bottleneck of a dp group that spans nodes is the NIC bandwidth of its members.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlm.planner.cost.hardware import ClusterProfile


@dataclass(frozen=True)
class Link:
    """Bus bandwidth (bytes/s) and per-call latency (s) of the slowest hop of a group; per-hop ring latencies on
    NVLink and on the network, and the number of nodes the group spans (1: inside one node)."""

    bus_bytes_per_s: float
    latency_s: float
    crosses_nodes: bool
    intra_hop_s: float = 0.0
    inter_hop_s: float = 0.0
    nodes: int = 1
    reduce_scatter_share: float = 1.0  # a reduce-scatter's bus bandwidth over bus_bytes_per_s (the cluster's)

    def ring_pass_s(self, n: int) -> float:
        """Latency of one pass around a ring of n members (n−1 steps; N of the n hops cross the network)."""
        if n <= 1:
            return 0.0
        if self.nodes <= 1:
            return (n - 1) * self.intra_hop_s
        return (n - self.nodes) * self.intra_hop_s + self.nodes * self.inter_hop_s


def _intra(cluster: ClusterProfile) -> Link:
    return Link(
        cluster.intra_node_gbps * 1e9 * cluster.intra_node_collective_efficiency,
        cluster.intra_node_latency_us * 1e-6,
        False,
        cluster.intra_node_step_latency_us * 1e-6,
        cluster.inter_node_step_latency_us * 1e-6,
        1,
        cluster.reduce_scatter_efficiency,
    )


def group_link(cluster: ClusterProfile, size: int, stride: int) -> Link:
    """The link a group of `size` ranks, `stride` apart in rank order, communicates over."""
    intra = _intra(cluster)
    if size * stride <= cluster.gpus_per_node:
        return intra
    per_node = max(1, min(size, cluster.gpus_per_node // max(stride, 1)))
    nodes = max(2, math.ceil(size / per_node))
    network = per_node * cluster.inter_node_gbps * 1e9 * cluster.inter_node_collective_efficiency
    return Link(
        min(intra.bus_bytes_per_s, network),
        cluster.inter_node_latency_us * 1e-6,
        True,
        intra.intra_hop_s,
        intra.inter_hop_s,
        nodes,
        cluster.reduce_scatter_efficiency,
    )


def p2p_link(cluster: ClusterProfile, stride: int) -> Link:
    """Link between neighbouring pipeline ranks `stride` ranks apart (one NIC per GPU when across nodes)."""
    if stride < cluster.gpus_per_node:
        return _intra(cluster)
    return Link(
        cluster.inter_node_gbps * 1e9 * cluster.inter_node_collective_efficiency,
        cluster.inter_node_latency_us * 1e-6,
        True,
        cluster.intra_node_step_latency_us * 1e-6,
        cluster.inter_node_step_latency_us * 1e-6,
        2,
        cluster.reduce_scatter_efficiency,
    )


def all_reduce_s(nbytes: float, n: int, link: Link, calls: int = 1) -> float:
    """Ring all-reduce of `nbytes` in total over `calls` calls among n ranks: 2(n−1)/n · bytes / busbw, plus per
    call the base latency and two ring passes."""
    if n <= 1 or (nbytes <= 0 and calls <= 0):
        return 0.0
    return calls * (link.latency_s + 2.0 * link.ring_pass_s(n)) + 2.0 * (n - 1) / n * nbytes / link.bus_bytes_per_s


def all_gather_s(nbytes: float, n: int, link: Link, calls: int = 1) -> float:
    """Ring all-gather producing `nbytes` (the full buffer) on each rank: (n−1)/n · bytes / busbw, plus per call
    the base latency and one ring pass."""
    if n <= 1:
        return 0.0
    return calls * (link.latency_s + link.ring_pass_s(n)) + (n - 1) / n * nbytes / link.bus_bytes_per_s


def reduce_scatter_s(nbytes: float, n: int, link: Link, calls: int = 1) -> float:
    """Ring reduce-scatter of `nbytes` (the full buffer): an all-gather's traffic reversed, (n−1)/n · bytes, at the
    link's reduce-scatter bus bandwidth (the cluster's reduce_scatter_efficiency of it), plus the same latencies."""
    if n <= 1:
        return 0.0
    busbw = link.bus_bytes_per_s * link.reduce_scatter_share
    return calls * (link.latency_s + link.ring_pass_s(n)) + (n - 1) / n * nbytes / busbw


def p2p_s(nbytes: float, link: Link) -> float:
    """One send/recv of `nbytes` between two ranks."""
    return link.latency_s + nbytes / link.bus_bytes_per_s


def all_to_all_s(nbytes: float, n: int, cluster: ClusterProfile, stride: int) -> float:
    """All-to-all of `nbytes` per rank among n ranks `stride` apart (module doc): the in-node share (per_node−1)/n
    over NVLink and the off-node share (n−per_node)/n over the rank's NIC, concurrently."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    intra = _intra(cluster)
    if n * stride <= cluster.gpus_per_node:
        return intra.latency_s + intra.ring_pass_s(n) + (n - 1) / n * nbytes / intra.bus_bytes_per_s
    link = group_link(cluster, n, stride)
    per_node = max(1, min(n, cluster.gpus_per_node // max(stride, 1)))
    nic = cluster.inter_node_gbps * 1e9 * cluster.inter_node_collective_efficiency
    on = (per_node - 1) / n * nbytes / intra.bus_bytes_per_s
    off = (n - per_node) / n * nbytes / nic
    return link.latency_s + link.ring_pass_s(n) + max(on, off)


def ring_link(cluster: ClusterProfile, size: int, stride: int) -> Link:
    """The slowest hop of a ring of `size` ranks `stride` apart (context parallelism's K/V ring): NVLink inside a
    node, else a NIC (the ring's node-crossing hops)."""
    if size * stride <= cluster.gpus_per_node:
        return _intra(cluster)
    return p2p_link(cluster, cluster.gpus_per_node)
