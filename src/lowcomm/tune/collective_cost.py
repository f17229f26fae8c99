"""The α-β (Hockney) time of each collective the cost model prices (:mod:`lowcomm.tune.cost`,
whose docstring gives the formulas): ring, emulated, hierarchical and tiered all-reduce,
all-gather, point-to-point and the group exchange."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "TierLevel",
    "allgather_time",
    "emulated_allreduce_time",
    "exchange_time",
    "hierarchical_allreduce_time",
    "p2p_time",
    "ring_allreduce_time",
    "tiered_allreduce_time",
]


def _check_collective(payload_bytes: float, n: int, bandwidth_bps: float, latency_s: float) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"workers must be an integer >= 1, got {n!r}")
    if not payload_bytes >= 0:
        raise ValueError(f"payload_bytes must be >= 0, got {payload_bytes!r}")
    if not bandwidth_bps > 0:
        raise ValueError(f"bandwidth must be > 0 bits/s, got {bandwidth_bps!r}")
    if not (latency_s >= 0 and math.isfinite(latency_s)):
        raise ValueError(f"latency must be a finite number >= 0 s, got {latency_s!r}")


def allgather_time(
    payload_bytes: float, n: int, bandwidth_bps: float, latency_s: float, *, emulated: bool = False
) -> float:
    """Time of a ring all-gather of ``payload_bytes`` per worker over ``n`` workers:
    ``(n − 1)(α + 8 S / β)`` (emulated: latency once, ``α + (n − 1) · 8 S / β``); 0 for n = 1."""
    _check_collective(payload_bytes, n, bandwidth_bps, latency_s)
    if n == 1:
        return 0.0
    wire = (n - 1) * 8.0 * payload_bytes / bandwidth_bps
    return latency_s + wire if emulated else (n - 1) * latency_s + wire


def exchange_time(
    payload_bytes: float, group: int, bandwidth_bps: float, latency_s: float, *, sharing: int = 1
) -> float:
    """Time of a group exchange (NoLoCo): each of ``group`` members sends ``payload_bytes`` to
    every other member at once over its link, shared by ``sharing`` workers (GPUs behind one
    NIC): ``α + sharing · (g − 1) · 8 S / β``; 0 for a group of one. lowcomm's emulated link
    charges the same (``sharing`` 1)."""
    if group <= 1:
        return 0.0
    return latency_s + sharing * (group - 1) * 8.0 * payload_bytes / bandwidth_bps


def ring_allreduce_time(
    payload_bytes: float, n: int, bandwidth_bps: float, latency_s: float
) -> float:
    """Time of a ring all-reduce of ``payload_bytes`` over ``n`` workers (α-β model).

    ``2 (n - 1) α + 2 (n - 1) / n · 8 S / β``: a reduce-scatter and an all-gather of ``n - 1``
    steps each, every step one message of ``S / n`` bytes; 0 for ``n = 1``.

    Args:
        payload_bytes: S, bytes each worker contributes.
        n: workers in the ring.
        bandwidth_bps: β, link bandwidth in bits/s per worker, each direction.
        latency_s: α, latency per message in seconds.
    """
    _check_collective(payload_bytes, n, bandwidth_bps, latency_s)
    if n == 1:
        return 0.0
    return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * 8.0 * payload_bytes / bandwidth_bps


def emulated_allreduce_time(
    payload_bytes: float, n: int, bandwidth_bps: float, latency_s: float
) -> float:
    """What lowcomm's :class:`~lowcomm.link.EmulatedLink` charges: α + 2 (n - 1) / n · 8 S / β.

    The emulation books the ring's wire bytes on one FIFO link and adds the latency once
    (propagation overlaps the next transfer), so a set of buckets launched together costs the
    same as one bucket of their total size. 0 for ``n = 1``.
    """
    _check_collective(payload_bytes, n, bandwidth_bps, latency_s)
    if n == 1:
        return 0.0
    return latency_s + 2 * (n - 1) / n * 8.0 * payload_bytes / bandwidth_bps


def p2p_time(
    payload_bytes: float, bandwidth_bps: float, latency_s: float, *, share: int = 1
) -> float:
    """Time of one point-to-point message of ``payload_bytes``: ``α + 8 S · share / β``, with
    ``share`` senders on the same link at once (pipeline stages sending through one NIC)."""
    _check_collective(payload_bytes, 1, bandwidth_bps, latency_s)
    return latency_s + 8.0 * payload_bytes * share / bandwidth_bps


@dataclass(frozen=True)
class TierLevel:
    """A group's part in one tier of a cluster, for :func:`tiered_allreduce_time`."""

    members: int
    """k_i: units of this tier the group spans inside one unit of the next (devices of a node
    at tier 0, nodes of a region at tier 1, ...)."""
    bandwidth_bps: float
    """β_i: bandwidth of this tier's uplink, bits/s (per device at tier 0, per node at 1, ...)."""
    latency_s: float = 0.0
    """α_i: latency per message on this tier."""
    share: int = 1
    """Devices that send through one uplink of this tier at the same time."""


def tiered_allreduce_time(payload_bytes: float, levels: Sequence[TierLevel]) -> float:
    """All-reduce of ``payload_bytes`` per device over a group spread across tiers.

    Reduce-scatter down the tiers, all-reduce at the top, all-gather back up: at tier ``i`` each
    device holds the shard ``S_i = S / (k_0 ⋯ k_{i-1})`` and ``share_i`` devices send through
    the tier's uplink at once, so the tier costs
    ``2 (k_i − 1) α_i + 2 (k_i − 1) / k_i · 8 S_i · share_i / β_i`` (0 when ``k_i = 1``).
    """
    total, held = 0.0, 1
    for level in levels:
        k = level.members
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"tier members must be an integer >= 1, got {k!r}")
        if isinstance(level.share, bool) or not isinstance(level.share, int) or level.share < 1:
            raise ValueError(f"tier share must be an integer >= 1, got {level.share!r}")
        _check_collective(payload_bytes, k, level.bandwidth_bps, level.latency_s)
        if k > 1:
            sent = payload_bytes * (level.share / held)
            total += 2 * (k - 1) * level.latency_s
            total += 2 * (k - 1) / k * 8.0 * sent / level.bandwidth_bps
        held *= k
    return total


def hierarchical_allreduce_time(
    payload_bytes: float,
    n: int,
    *,
    gpus_per_node: int,
    bandwidth_bps: float,
    latency_s: float,
    intra_bandwidth_bps: float | None,
    intra_latency_s: float = 0.0,
) -> float:
    """All-reduce over nodes of ``gpus_per_node`` GPUs: fast link inside, one slow NIC per node.

    Within one node (``n <= G``) this is a ring on the fast link. Across ``m = n / G`` nodes:
    reduce-scatter inside each node (``(G - 1) α_i + (G - 1) / G · 8 S / β_i``), then G concurrent
    inter-node rings on ``S / G`` bytes each, which share the node's NIC: together
    ``T_ring(S, m)`` on (β, α); then all-gather inside the node (as the reduce-scatter). The
    two-tier case of :func:`tiered_allreduce_time`. ``intra_bandwidth_bps=None`` makes the fast
    link free.

    Args:
        payload_bytes: S, bytes per GPU.
        n: GPUs in all; a multiple of ``gpus_per_node`` when above it.
        gpus_per_node: G.
        bandwidth_bps: β, the inter-node bandwidth per node (its NIC), bits/s.
        latency_s: α, inter-node latency per message.
        intra_bandwidth_bps: β_i, bandwidth of the fast link per GPU, bits/s.
        intra_latency_s: α_i, latency per message on the fast link.
    """
    _check_collective(payload_bytes, n, bandwidth_bps, latency_s)
    g = gpus_per_node
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ValueError(f"gpus_per_node must be an integer >= 1, got {g!r}")
    intra_bw = math.inf if intra_bandwidth_bps is None else intra_bandwidth_bps
    if n <= g:
        return ring_allreduce_time(payload_bytes, n, intra_bw, intra_latency_s)
    if n % g:
        raise ValueError(
            f"workers ({n}) must be a multiple of gpus_per_node ({g}) above one node; "
            f"e.g. {g * math.ceil(n / g)}"
        )
    levels = [
        TierLevel(g, intra_bw, intra_latency_s),
        TierLevel(n // g, bandwidth_bps, latency_s, share=g),
    ]
    return tiered_allreduce_time(payload_bytes, levels)
