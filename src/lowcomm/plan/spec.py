"""What the planner is given: a model, a precision, a cluster of tiers, and one layout of it.

:class:`ModelSpec` (a decoder-only transformer: GPT or Llama-style), :class:`Precision` (bytes
per parameter for weights, gradients, master copy and optimizer state, and per activation),
:class:`Cluster` (devices with memory, peak FLOP/s and memory bandwidth, stacked in
:class:`Tier` s from the fastest link to the slowest) and :class:`Layout` (TP, PP, DP, ZeRO stage,
micro-batch, recompute, sequence parallelism, placement order, and the data-parallel layer:
synchronous or one of lowcomm's outer algorithms across the slowest tier).

The standard counts follow Narayanan et al. 2021 (SC21, arXiv 2104.04473), eq. (2)-(3):
parameters ``12 L h² (1 + 13/(12h) + (V + s)/(12 L h))`` for a GPT with tied embeddings and
learned positions, forward FLOPs per layer ``24 B s h² + 4 B s² h`` and ``2 B s h V`` for the
logits; :meth:`ModelSpec.layer_parameters` and :meth:`ModelSpec.layer_forward_flops` generalise
them to grouped-query attention and gated (SwiGLU) MLPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "LAYOUT_KEYS",
    "Cluster",
    "Layout",
    "parse_layout",
    "ModelSpec",
    "Precision",
    "Recompute",
    "Tier",
    "PRECISIONS",
]

Recompute = Literal["none", "selective", "full"]
RECOMPUTE: tuple[Recompute, ...] = ("none", "selective", "full")
ORDERS = ("tp-dp-pp", "tp-pp-dp")


def _positive_int(owner: str, key: str, value: object, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner}.{key} must be an integer >= {low}, got {value!r}")


def _positive(owner: str, key: str, value: object, *, zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (value >= 0 if zero else value > 0):  # type: ignore[operator]
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{owner}.{key} must be a finite number {bound}, got {value!r}")


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """A decoder-only transformer, as the planner counts it."""

    name: str = "custom"
    layers: int
    """L."""
    hidden: int
    """h."""
    heads: int
    """a: attention heads."""
    vocab: int
    """V (padded as the framework pads it)."""
    seq: int
    """s: sequence length."""
    ffn_hidden: int | None = None
    """f: MLP width; None: 4h."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: ``heads``."""
    gated: bool = False
    """SwiGLU MLP (three h × f matrices) instead of GELU (two)."""
    tied_embeddings: bool = True
    """The output layer shares the token embedding (GPT); False: a separate V × h head."""
    learned_positions: bool = True
    """A learned s × h position embedding (GPT); False: rotary (Llama)."""
    bias: bool = True
    """Linear layers and LayerNorms carry biases (GPT); False: RMSNorm, no biases (Llama)."""
    dropout: bool = True
    """Dropout after the embeddings, attention probabilities, attention and MLP outputs
    (Megatron's GPT configurations): its masks (1 byte per element) are activations too."""
    kernels: Literal["fused", "eager"] = "fused"
    """How the elementwise parts run, which sets what they keep for backward: "fused" (Megatron-LM,
    Transformer Engine: a fused SwiGLU keeps its two inputs, a fused RMSNorm its input) or
    "eager" (plain PyTorch autograd, e.g. ``F.silu(w1(x)) * w3(x)`` and ``nn.RMSNorm``: SwiGLU
    also keeps the SiLU and the product, RMSNorm its normalised input). GELU and LayerNorm keep
    the same either way (:func:`~lowcomm.plan.memory.activation_bytes_per_layer`)."""

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "vocab", "seq"):
            _positive_int("model", key, getattr(self, key))
        for key in ("ffn_hidden", "kv_heads"):
            if getattr(self, key) is not None:
                _positive_int("model", key, getattr(self, key))
        if self.kernels not in ("fused", "eager"):
            raise ValueError(f"model.kernels must be 'fused' or 'eager', got {self.kernels!r}")
        if self.hidden % self.heads:
            raise ValueError(
                f"model.hidden ({self.hidden}) must be divisible by model.heads ({self.heads})"
            )
        if self.heads % self.kv:
            raise ValueError(
                f"model.heads ({self.heads}) must be divisible by model.kv_heads ({self.kv})"
            )

    @property
    def ffn(self) -> int:
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: kv_heads × head size."""
        return self.kv * (self.hidden // self.heads)

    def layer_parameters(self) -> int:
        """Parameters of one transformer layer: GPT ``12h² + 13h``."""
        h, f = self.hidden, self.ffn
        attn = h * (h + 2 * self.kv_dim) + h * h
        mlp = (3 if self.gated else 2) * h * f
        weights = attn + mlp
        if not self.bias:
            return weights + 2 * h  # two RMSNorm scales
        biases = (h + 2 * self.kv_dim) + h + (2 if self.gated else 1) * f + h
        return weights + biases + 4 * h  # two LayerNorms: scale and shift

    def embedding_parameters(self) -> int:
        """Token (and position) embeddings, on the first pipeline stage."""
        return self.vocab * self.hidden + (self.seq * self.hidden if self.learned_positions else 0)

    def head_parameters(self) -> int:
        """Final norm and, untied, the output projection, on the last pipeline stage (tied: a
        replica of the token embedding there when the pipeline has more than one stage)."""
        norm = (2 if self.bias else 1) * self.hidden
        return norm + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def parameters(self) -> int:
        """All parameters (a tied output layer counted once)."""
        return (
            self.layers * self.layer_parameters()
            + self.embedding_parameters()
            + self.head_parameters()
        )

    def layer_forward_flops(self, batch: int) -> float:
        """Forward FLOPs of one layer for ``batch`` sequences: 2 × matmul parameters × tokens
        plus the attention scores and their product with V (``4 B s² h``); GPT:
        ``24 B s h² + 4 B s² h``."""
        h, f, s = self.hidden, self.ffn, self.seq
        matmul = h * (h + 2 * self.kv_dim) + h * h + (3 if self.gated else 2) * h * f
        return 2.0 * batch * s * matmul + 4.0 * batch * s * s * h

    def attention_core_flops(self, batch: int) -> float:
        """Forward FLOPs of the attention core (scores and their product with V), the part
        selective recompute runs again: ``4 B s² h``."""
        return 4.0 * batch * self.seq * self.seq * self.hidden

    def logits_forward_flops(self, batch: int) -> float:
        """``2 B s h V``."""
        return 2.0 * batch * self.seq * self.hidden * self.vocab

    def model_flops(self, batch: int) -> float:
        """Training FLOPs of one iteration of ``batch`` sequences without recompute (3 × forward:
        GPT ``72 B s L h² (1 + s/(6h) + V/(12 L h))``); the "model FLOPs" of MFU."""
        return 3.0 * (
            self.layers * self.layer_forward_flops(batch) + self.logits_forward_flops(batch)
        )

    def hardware_flops(self, batch: int, recompute: Recompute) -> float:
        """FLOPs one iteration executes with ``recompute``: full adds a forward of every layer
        (GPT ``96 B s L h² (1 + s/(6h) + V/(16 L h))``, Narayanan et al. eq. 3), selective the
        attention core's."""
        flops = self.model_flops(batch)
        if recompute == "full":
            flops += self.layers * self.layer_forward_flops(batch)
        elif recompute == "selective":
            flops += self.layers * self.attention_core_flops(batch)
        return flops


@dataclass(kw_only=True, frozen=True)
class Precision:
    """Bytes per element of each kind of state."""

    name: str
    weight_bytes: int
    """The working copy of the weights (2: bf16/fp16, 4: fp32)."""
    grad_bytes: int
    """Gradients, as accumulated and communicated."""
    master_bytes: int
    """A separate fp32 master copy of the weights (mixed precision: 4; pure fp32: 0)."""
    optimizer_bytes: int = 8
    """Optimizer state per parameter (Adam: 8, its two fp32 moments)."""
    activation_bytes: int = 2
    """Activations (2: bf16/fp16, 4: fp32)."""

    def __post_init__(self) -> None:
        for key in ("weight_bytes", "grad_bytes", "activation_bytes"):
            _positive_int("precision", key, getattr(self, key))
        for key in ("master_bytes", "optimizer_bytes"):
            _positive_int("precision", key, getattr(self, key), low=0)


PRECISIONS = {
    "bf16": Precision(name="bf16", weight_bytes=2, grad_bytes=2, master_bytes=4),
    "fp32": Precision(
        name="fp32", weight_bytes=4, grad_bytes=4, master_bytes=0, activation_bytes=4
    ),
}
"""Mixed precision with Adam (2 + 2 + 12 bytes per parameter, as in the ZeRO paper) and fp32."""


@dataclass(kw_only=True, frozen=True)
class Tier:
    """One level of the cluster's network: units of the level below joined by one kind of link."""

    name: str
    members: int
    """Units of the tier below in one unit of this one (tier 0: devices in a node)."""
    bandwidth_bps: float
    """Bandwidth of one uplink, bits/s each way: per device at tier 0, per node at tier 1, per
    region at tier 2, ..., shared by the devices behind it."""
    latency_s: float = 0.0
    """Latency per message."""
    slow: bool = False
    """A slow link (between regions, over the internet): where the data-parallel group crosses
    it, the planner offers lowcomm's outer algorithms in place of the per-step all-reduce."""

    def __post_init__(self) -> None:
        _positive_int(f"tier {self.name!r}", "members", self.members)
        _positive(f"tier {self.name!r}", "bandwidth_bps", self.bandwidth_bps)
        _positive(f"tier {self.name!r}", "latency_s", self.latency_s, zero=True)


@dataclass(kw_only=True, frozen=True)
class Cluster:
    """Identical devices stacked in tiers, fastest first; devices = product of the members."""

    name: str = "custom"
    device_memory_bytes: float
    peak_flops: float
    """Peak dense FLOP/s of one device at the training precision."""
    gemm_efficiency: float
    """e: fraction of the peak that large matrix multiplications sustain; smaller ones and
    those with a short reduction dimension get less (:mod:`lowcomm.plan.gemm`)."""
    gemm_overhead_s: float = 6.0e-6
    """t₀: fixed cost of one GEMM call (:mod:`lowcomm.plan.gemm`; fitted on H100)."""
    gemm_k_half: float = 102.0
    """k₀: per-tile overhead of a GEMM in elements of its reduction dimension (fitted on H100)."""
    memory_bandwidth_Bps: float
    """Device memory bandwidth, bytes/s: the elementwise work (norms, activations, softmax,
    dropout) is charged at it."""
    tiers: tuple[Tier, ...]
    note: str = ""

    def __post_init__(self) -> None:
        _positive("cluster", "device_memory_bytes", self.device_memory_bytes)
        _positive("cluster", "peak_flops", self.peak_flops)
        _positive("cluster", "memory_bandwidth_Bps", self.memory_bandwidth_Bps)
        _positive("cluster", "gemm_overhead_s", self.gemm_overhead_s, zero=True)
        _positive("cluster", "gemm_k_half", self.gemm_k_half, zero=True)
        if not 0 < self.gemm_efficiency <= 1:
            raise ValueError(
                f"cluster.gemm_efficiency must be in (0, 1], got {self.gemm_efficiency!r}"
            )
        if not self.tiers:
            raise ValueError("cluster.tiers must list at least one tier (the devices of a node)")

    @property
    def devices_per_node(self) -> int:
        return self.tiers[0].members

    @property
    def devices(self) -> int:
        return math.prod(t.members for t in self.tiers)

    def unit_sizes(self) -> list[int]:
        """Devices in one unit of each tier: [per node, per region, ..., all]."""
        sizes, size = [], 1
        for tier in self.tiers:
            size *= tier.members
            sizes.append(size)
        return sizes


@dataclass(kw_only=True, frozen=True)
class Layout:
    """One way to lay a training job over the devices."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    """ZeRO stage 0-3 over the data-parallel group (1: optimizer state sharded, 2: and
    gradients, 3: and parameters)."""
    micro_batch: int = 1
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (norms and dropout split over the TP group)."""
    tp_overlap: bool = False
    """TP communication overlapped with the GEMMs it feeds and drains (Megatron-Core's
    ``--tp-comm-overlap``, Transformer Engine's userbuffers; needs sequence parallelism)."""
    dp_overlap: bool = False
    """With pipelining, the data-parallel gradient reduction overlapped with each stage's last
    backward (Megatron-Core's ``--overlap-grad-reduce``); without pipelining it always is."""
    flash_attention: bool = True
    interleave: int = 1
    """Virtual pipeline stages per device (Megatron's interleaved 1F1B schedule)."""
    order: str = "tp-dp-pp"
    """Placement, innermost first: ``tp-dp-pp`` (Megatron's default: data-parallel replicas
    next to each other) or ``tp-pp-dp`` (pipeline stages next to each other)."""
    outer: str | None = None
    """None: data parallelism all-reduces every iteration. An outer algorithm
    (``diloco``, ``co2``, ...): synchronous (and ZeRO-sharded) inside the units of the slowest
    slow tier the data-parallel group crosses, the outer algorithm across it."""
    sync_every: int = 1
    """H of the outer algorithm (iterations per round)."""
    extra: dict[str, int] = field(default_factory=dict, compare=False, hash=False)
    """Settings of the outer algorithm beyond H (e.g. ``num_fragments``, ``overlap``)."""

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "micro_batch", "interleave", "sync_every"):
            _positive_int("layout", key, getattr(self, key))
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"layout.zero must be a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(
                f"layout.recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}"
            )
        if self.order not in ORDERS:
            raise ValueError(f"layout.order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("layout.sequence_parallel needs tp > 1 (it splits over the TP group)")
        if self.tp_overlap and not self.sequence_parallel:
            raise ValueError(
                "layout.tp_overlap needs sequence_parallel (the overlapped all-gather and "
                "reduce-scatter are sequence parallelism's)"
            )
        if self.interleave > 1 and self.pp == 1:
            raise ValueError("layout.interleave > 1 needs pp > 1 (virtual pipeline stages)")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        """E.g. ``TP4 PP16 DP2 Z1 mb1 full SP`` (+ ``co2 H=32`` across the slow tier)."""
        text = f"TP{self.tp} PP{self.pp} DP{self.dp} Z{self.zero} mb{self.micro_batch}"
        text += f" {self.recompute}"
        if self.sequence_parallel:
            text += " SP"
        if self.tp_overlap:
            text += " TPO"
        if self.dp_overlap:
            text += " DPO"
        if self.interleave > 1:
            text += f" v{self.interleave}"
        if self.order != "tp-dp-pp":
            text += f" {self.order}"
        if self.outer:
            text += f" {self.outer} H={self.sync_every}"
        return text


LAYOUT_KEYS: dict[str, str] = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "vpp": "interleave",
    "interleave": "interleave",
    "zero": "zero",
    "mb": "micro_batch",
    "micro_batch": "micro_batch",
    "recompute": "recompute",
    "sp": "sequence_parallel",
    "sequence_parallel": "sequence_parallel",
    "tpo": "tp_overlap",
    "tp_overlap": "tp_overlap",
    "dpo": "dp_overlap",
    "dp_overlap": "dp_overlap",
    "order": "order",
    "outer": "outer",
    "h": "sync_every",
    "sync_every": "sync_every",
}
"""``--layout`` keys and the :class:`Layout` field each sets (``vpp`` and ``interleave`` are
one, as are ``mb`` and ``micro_batch``, ``sp`` and ``sequence_parallel``, ``tpo`` and
``tp_overlap``, ``dpo`` and ``dp_overlap``, ``h`` and ``sync_every``)."""

_INT_FIELDS = ("tp", "pp", "dp", "interleave", "zero", "micro_batch", "sync_every")


def parse_layout(text: str) -> dict[str, object]:
    """``"tp=8,pp=16,dp=64,vpp=8,zero=1,mb=1,recompute=selective,sp"`` → the :class:`Layout`
    fields it fixes (any subset; ``sp`` alone is ``sp=1``, ``outer=none`` is synchronous data
    parallelism). Raises ``ValueError`` naming the key and what it takes."""
    fixed: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().lower().replace("-", "_")
        if key not in LAYOUT_KEYS:
            raise ValueError(
                f"--layout: unknown key {key!r}; use any of {', '.join(sorted(LAYOUT_KEYS))} "
                "(e.g. tp=8,pp=16,dp=64,vpp=8,zero=1,mb=1,recompute=selective,sp)"
            )
        name = LAYOUT_KEYS[key]
        if name in fixed:
            raise ValueError(f"--layout: {key} is given twice")
        value = value.strip()
        if name in ("sequence_parallel", "tp_overlap", "dp_overlap"):
            if value.lower() not in ("", "1", "true", "yes", "0", "false", "no"):
                raise ValueError(
                    f"--layout: {key} takes no value, 1/true or 0/false, got {value!r}"
                )
            fixed[name] = value.lower() in ("", "1", "true", "yes")
        elif not eq or not value:
            raise ValueError(f"--layout: {key} needs a value ({key}=...)")
        elif name in _INT_FIELDS:
            try:
                number = int(value)
            except ValueError:
                raise ValueError(f"--layout: {key} must be an integer, got {value!r}") from None
            low = 0 if name == "zero" else 1
            if number < low or (name == "zero" and number > 3):
                bound = "0, 1, 2 or 3" if name == "zero" else f"an integer >= {low}"
                raise ValueError(f"--layout: {key} must be {bound}, got {value!r}")
            fixed[name] = number
        elif name == "recompute":
            if value not in RECOMPUTE:
                raise ValueError(
                    f"--layout: recompute must be one of {', '.join(RECOMPUTE)}, got {value!r}"
                )
            fixed[name] = value
        elif name == "order":
            if value not in ORDERS:
                raise ValueError(
                    f"--layout: order must be one of {', '.join(ORDERS)}, got {value!r}"
                )
            fixed[name] = value
        else:  # outer
            fixed[name] = None if value.lower() == "none" else value
    if not fixed:
        raise ValueError("--layout is empty; e.g. --layout tp=8,pp=16,dp=64")
    return fixed
