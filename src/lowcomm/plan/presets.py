"""Model and cluster presets of ``lowcomm plan``, with their sources.

Models: the GPT rows of Narayanan et al. 2021, Table 1 (sequence 2048, vocabulary 51,200), the
Frontier study's 22B/175B/1T (Dash et al. 2023, arXiv 2312.12705; dimensions from the authors'
launch scripts, GPT-2 vocabulary padded to 50,304), and Llama 2/3 sizes from their published
configurations. Clusters: DGX A100 and DGX H100 nodes, Frontier's MI250X nodes, and two regions
of DGX H100 nodes joined by 10 Gbit/s. Hardware figures are the vendors' (peak dense 16-bit
FLOP/s, memory and its bandwidth, NVLink/NVSwitch and NIC bandwidth per direction).

GEMM efficiency: the speed of each GEMM follows its shape (:mod:`lowcomm.plan.gemm`, fitted
to H100 microbenchmarks); what a device sustains *in training* is less than what a GEMM alone
reaches (clocks under sustained power, kernels sharing the device with communication), and no
microbenchmark says how much. So each device type's ``gemm_efficiency`` (the large-GEMM
limit) is calibrated once, on one published table: the value at which the table's predicted
throughputs are, on geometric mean, the published ones (the shape model then sets how the
rows differ). It is checked on the other published runs of that device
(:mod:`lowcomm.plan.validate`):

* A100: 0.890 by microbenchmark (H100's 0.823 × A100's 271.2/312 over H100's 794.5/989
  maximal achievable matmul FLOP/s); calibrated on Megatron-LM 2021 Table 1: **0.669** (0.75
  of the microbenchmark). Held out: BLOOM-176B.
* H100: 0.823 by microbenchmark; calibrated on Megatron-Core's H100 table: **0.523** (0.64).
  Held out: Llama 3 405B on 8,192 and 16,384 GPUs.
* MI250X: 0.787 by microbenchmark (147.0/191.5 per GCD); calibrated on the Frontier study's
  three runs: **0.458** (0.58). Nothing held out.
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


def _mcore(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=131072,
        seq=4096,
        tied_embeddings=False,
    )


MEGATRON_CORE_H100 = {
    "mcore-1.7b": _mcore("mcore-1.7b", 24, 2048, 16),
    "mcore-7.1b": _mcore("mcore-7.1b", 30, 4096, 32),
    "mcore-16b": _mcore("mcore-16b", 32, 6144, 48),
    "mcore-32b": _mcore("mcore-32b", 48, 7168, 56),
    "mcore-70b": _mcore("mcore-70b", 84, 8192, 64),
    "mcore-119b": _mcore("mcore-119b", 92, 10240, 80),
    "mcore-177b": _mcore("mcore-177b", 96, 12288, 96),
    "mcore-314b": _mcore("mcore-314b", 96, 16384, 128),
    "mcore-462b": _mcore("mcore-462b", 112, 18432, 144),
}
"""The GPT models of Megatron-LM's H100 scaling table (NVIDIA/Megatron-LM README,
``images/model_table.png``, commit f2e5db402c of 2024-07-15): heads, hidden, layers as
published; vocabulary 131,072, sequence 4,096, untied output layer (the parameter counts
match it: 1.7B … 462B)."""

BLOOM_176B = ModelSpec(
    name="bloom-176b",
    layers=70,
    hidden=14336,
    heads=112,
    vocab=250880,
    seq=2048,
    learned_positions=False,
    dropout=False,
)
"""BLOOM (BigScience, bigscience-workshop/bigscience ``train/tr11-176B-ml``): 70 layers,
h 14,336, 112 heads, sequence 2,048, vocabulary padded to 250,880, tied embeddings, ALiBi (no
position embedding), no dropout."""

MODELS: dict[str, ModelSpec] = {
    **MEGATRON_TABLE1,
    **FRONTIER_MODELS,
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 11008),
    "llama2-13b": _llama("llama2-13b", 40, 5120, 40, 13824),
    "llama2-70b": _llama("llama2-70b", 80, 8192, 64, 28672, kv=8),
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 14336, kv=8, vocab=128256, seq=8192),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 28672, kv=8, vocab=128256, seq=8192),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 53248, kv=8, vocab=128256, seq=8192),
    **MEGATRON_CORE_H100,
    "bloom-176b": BLOOM_176B,
}


def _dgx_a100(nodes: int) -> Cluster:
    return Cluster(
        name=f"dgx-a100 x{nodes}",
        device_memory_bytes=80 * GB,
        peak_flops=312e12,
        gemm_efficiency=0.669,
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
        gemm_efficiency=0.523,
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
        gemm_efficiency=0.458,
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
