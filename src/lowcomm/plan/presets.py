"""Model and cluster presets of ``lowcomm plan``, with their sources.

Models: the GPT rows of Narayanan et al. 2021, Table 1 (sequence 2048, vocabulary 51,200), the
Frontier study's 22B/175B/1T (Dash et al. 2023, arXiv 2312.12705; dimensions from the authors'
launch scripts, GPT-2 vocabulary padded to 50,304), and Llama 2/3 sizes from their published
configurations. Clusters: DGX A100 and DGX H100 nodes, Frontier's MI250X nodes, and two regions
of DGX H100 nodes joined by 10 Gbit/s. Hardware figures are the vendors' (peak dense 16-bit
FLOP/s, memory and its bandwidth, NVLink/NVSwitch and NIC bandwidth per direction); the GEMM
efficiency is one stated figure per device type, the same for every configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from lowcomm.plan.spec import Cluster, ModelSpec, Tier

__all__ = ["CLUSTERS", "MODELS", "cluster_preset", "model_preset"]

GB = 1e9
GIB = 2**30


def _gpt(name: str, layers: int, hidden: int, heads: int, *, vocab: int = 51200, seq: int = 2048):
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq)


def _llama(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    ffn: int,
    *,
    kv: int | None = None,
    vocab: int = 32000,
    seq: int = 4096,
) -> ModelSpec:
    return ModelSpec(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        seq=seq,
        ffn_hidden=ffn,
        kv_heads=kv,
        gated=True,
        tied_embeddings=False,
        learned_positions=False,
        bias=False,
        dropout=False,
    )


MEGATRON_TABLE1 = {
    "gpt-1.7b": _gpt("gpt-1.7b", 24, 2304, 24),
    "gpt-3.6b": _gpt("gpt-3.6b", 30, 3072, 32),
    "gpt-7.5b": _gpt("gpt-7.5b", 36, 4096, 32),
    "gpt-18b": _gpt("gpt-18b", 40, 6144, 48),
    "gpt-39b": _gpt("gpt-39b", 48, 8192, 64),
    "gpt-76b": _gpt("gpt-76b", 60, 10240, 80),
    "gpt-145b": _gpt("gpt-145b", 80, 12288, 96),
    "gpt-310b": _gpt("gpt-310b", 96, 16384, 128),
    "gpt-530b": _gpt("gpt-530b", 105, 20480, 128),
    "gpt-1t": _gpt("gpt-1t", 128, 25600, 160),
}
"""Narayanan et al. 2021, Table 1 (arXiv 2104.04473): layers, hidden, heads; s 2048, V 51,200."""

FRONTIER_MODELS = {
    "frontier-22b": _gpt("frontier-22b", 48, 6144, 48, vocab=50304),
    "frontier-175b": _gpt("frontier-175b", 96, 12288, 96, vocab=50304),
    "frontier-1t": _gpt("frontier-1t", 128, 25600, 200, vocab=50304),
}
"""Dash et al. 2023: dimensions as in the authors' launch scripts (sajal-vt/Megatron-DeepSpeed-ORNL,
branch FA2: launch_gpt22b/175b/1T_bf16.slurm), sequence 2048."""

MODELS: dict[str, ModelSpec] = {
    **MEGATRON_TABLE1,
    **FRONTIER_MODELS,
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 11008),
    "llama2-13b": _llama("llama2-13b", 40, 5120, 40, 13824),
    "llama2-70b": _llama("llama2-70b", 80, 8192, 64, 28672, kv=8),
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 14336, kv=8, vocab=128256, seq=8192),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 28672, kv=8, vocab=128256, seq=8192),
}


def _dgx_a100(nodes: int) -> Cluster:
    return Cluster(
        name=f"dgx-a100 x{nodes}",
        device_memory_bytes=80 * GB,
        peak_flops=312e12,
        gemm_efficiency=0.6,
        memory_bandwidth_Bps=2039 * GB,
        tiers=(
            Tier(name="nvswitch", members=8, bandwidth_bps=300 * GB * 8, latency_s=5e-6),
            Tier(name="infiniband", members=nodes, bandwidth_bps=8 * 200e9, latency_s=5e-6),
        ),
        note="A100 80GB SXM: 312 TFLOP/s fp16/bf16, 2039 GB/s HBM; NVSwitch 300 GB/s per GPU "
        "per direction; 8 x 200 Gbit/s HDR InfiniBand per node (Selene, Narayanan et al. 2021)",
    )


def _dgx_h100(nodes: int) -> Cluster:
    return Cluster(
        name=f"dgx-h100 x{nodes}",
        device_memory_bytes=80 * GB,
        peak_flops=989e12,
        gemm_efficiency=0.6,
        memory_bandwidth_Bps=3350 * GB,
        tiers=(
            Tier(name="nvswitch", members=8, bandwidth_bps=450 * GB * 8, latency_s=5e-6),
            Tier(name="infiniband", members=nodes, bandwidth_bps=8 * 400e9, latency_s=5e-6),
        ),
        note="H100 80GB SXM: 989 TFLOP/s dense bf16, 3350 GB/s HBM; NVLink 450 GB/s per GPU per "
        "direction; 8 x 400 Gbit/s NDR InfiniBand per node",
    )


def _frontier(nodes: int) -> Cluster:
    return Cluster(
        name=f"frontier x{nodes}",
        device_memory_bytes=64 * GB,
        peak_flops=191.5e12,
        gemm_efficiency=0.5,
        memory_bandwidth_Bps=1600 * GB,
        tiers=(
            Tier(name="infinity-fabric", members=8, bandwidth_bps=50 * GB * 8, latency_s=5e-6),
            Tier(name="slingshot", members=nodes, bandwidth_bps=4 * 25 * GB * 8, latency_s=5e-6),
        ),
        note="MI250X: 8 GCDs per node, 64 GB HBM2E at 1.6 TB/s and 191.5 TFLOP/s bf16 per GCD; "
        "GCD links 50-200 GB/s (a ring is held to the 50 GB/s ones); 4 x 25 GB/s Slingshot "
        "per node (OLCF Frontier user guide)",
    )


def _two_regions(nodes: int) -> Cluster:
    if nodes % 2:
        raise ValueError(
            f"two-regions splits the nodes over two regions: use an even --nodes, got {nodes}"
        )
    h100 = _dgx_h100(nodes // 2)
    return replace(
        h100,
        name=f"two-regions x{nodes}",
        tiers=(
            *h100.tiers,
            Tier(name="wan", members=2, bandwidth_bps=10e9, latency_s=0.03, slow=True),
        ),
        note="two regions of DGX H100 nodes (as dgx-h100) joined by one 10 Gbit/s link, 30 ms",
    )


CLUSTERS: dict[str, Callable[[int], Cluster]] = {
    "dgx-a100": _dgx_a100,
    "dgx-h100": _dgx_h100,
    "frontier": _frontier,
    "two-regions": _two_regions,
}


def model_preset(name: str) -> ModelSpec:
    """The model preset ``name`` (one of :data:`MODELS`)."""
    if name not in MODELS:
        raise ValueError(f"unknown model preset {name!r}: choose one of {', '.join(MODELS)}")
    return MODELS[name]


def cluster_preset(name: str, nodes: int) -> Cluster:
    """The cluster preset ``name`` (one of :data:`CLUSTERS`) with ``nodes`` nodes."""
    if name not in CLUSTERS:
        raise ValueError(f"unknown cluster preset {name!r}: choose one of {', '.join(CLUSTERS)}")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}")
    return CLUSTERS[name](nodes)
