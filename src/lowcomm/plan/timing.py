"""The time model: one training iteration of a layout, by part.

With m = global batch / (d · b) micro-batches per pipeline, on the stage with the most work
(the last: its layers and the logits), per micro-batch:

* **Compute**: every GEMM of the forward and the backward (:func:`layer_gemms`: the
  projections and the MLP with their input and weight gradients, the attention core per head)
  at its own shape's speed (:mod:`lowcomm.plan.gemm`), plus the recomputed forward (all layers
  with full recompute, the attention core with selective).
* **Elementwise**: norms, activation functions, softmax, dropout and residuals are bound by
  memory bandwidth: every activation byte a layer keeps (:func:`~lowcomm.plan.memory.
  activation_bytes_per_layer`) is written and read once per pass (forward, backward twice, the
  recompute pass once more), at the device's memory bandwidth.
* **TP**: four all-reduces of ``e s b h`` bytes per layer (two in forward, two in backward; six
  with full recompute), ring over the TP group inside a node; sequence parallelism replaces
  each by a reduce-scatter and an all-gather of the same bytes. Exposed, unless the layout
  overlaps them with the GEMMs (``tp_overlap``): then only what exceeds the stage's GEMM time.
* **PP**: per micro-batch and virtual stage one activation forward and one gradient backward,
  ``e s b h / t`` bytes each (Megatron's scatter/gather), point-to-point over the slowest link
  between consecutive stages (devices that cross a node boundary share its NIC).

A micro-batch's slot is their sum; the pipeline takes ``(m + (p − 1) / v) · slot``, the
``(p − 1) / v`` slots being the bubble. Then:

* **Data parallel**, priced over the tiers the group spans (:func:`~lowcomm.tune.cost.
  tiered_allreduce_time`): ZeRO 0/1 one all-reduce (or reduce-scatter + all-gather) of the
  gradients per iteration, hidden behind the last micro-batch's backward without pipelining (as
  DDP's buckets do) and exposed after a pipeline flush, unless the layout overlaps it there too
  (``dp_overlap``: Megatron-Core's ``--overlap-grad-reduce``, buckets reduced during the stage's
  last backward); ZeRO-2 a reduce-scatter per micro-batch
  behind its backward and one all-gather; ZeRO-3 two all-gathers and a reduce-scatter per
  micro-batch behind its compute.
* **Outer algorithm** across the slowest tier the data-parallel group crosses: the synchronous
  all-reduce stays inside that tier's units, and the algorithm's own all-reduce of the fp32
  parameters (every H iterations; SparseLoCo: an all-gather of its sparse payloads, their exact
  wire bytes) goes over the whole group, overlapped by its schedule's rule
  (:func:`~lowcomm.tune.cost.step_time`, the rule ``lowcomm simulate`` uses).
* **Optimizer step**: reading and writing the weights, gradients and optimizer state of the
  device's shard at memory bandwidth.

Reported like Narayanan et al. 2021: achieved FLOP/s per device = executed FLOPs (recompute
included, their eq. 3) / (iteration time × devices); MFU counts the model FLOPs only.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

from lowcomm.plan.gemm import Gemm, gemm_time
from lowcomm.plan.memory import activation_bytes_per_layer, stage_layers, stage_parameters
from lowcomm.plan.spec import Cluster, Layout, ModelSpec, Precision, Recompute
from lowcomm.schedules import SPARSE_GATHER, sparse_bytes_per_element
from lowcomm.tune.cost import Algorithm, TierLevel, Workload, p2p_time, step_time
from lowcomm.tune.cost import tiered_allreduce_time as _tiered

__all__ = [
    "TimeBreakdown",
    "dp_stride",
    "group_levels",
    "iteration_time",
    "layer_gemms",
    "outer_split",
    "p2p_link",
]


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds of one iteration, by part (the parts add up to ``iteration_s``)."""

    compute_s: float
    """GEMMs of all micro-batches (recompute included)."""
    elementwise_s: float
    tp_s: float
    pp_s: float
    bubble_s: float
    dp_s: float
    """Exposed data-parallel communication."""
    outer_s: float
    """Exposed communication of the outer algorithm, per iteration."""
    optimizer_s: float
    iteration_s: float
    dp_comm_s: float
    """Data-parallel communication in all, hidden or not."""
    tokens_per_s: float
    tflops_per_device: float
    """Executed FLOP/s per device, in TFLOP/s (Narayanan et al.'s "achieved teraFLOP/s")."""
    percent_of_peak: float
    mfu: float
    """Model FLOPs (no recompute) per second / (devices × peak)."""

    def as_dict(self) -> dict[str, float]:
        return dict(asdict(self))


@functools.lru_cache(maxsize=4096)
def _members(units: tuple[int, ...], size: int, stride: int) -> tuple[int, ...]:
    """Members of a group (``size`` devices ``stride`` apart) per unit of each tier."""
    positions = [j * stride for j in range(size)]
    distinct = [1] * (len(units) + 1)
    distinct[0] = size
    for i, unit in enumerate(units):
        distinct[i + 1] = len({pos // unit for pos in positions})
    return tuple(-(-distinct[i] // distinct[i + 1]) for i in range(len(units)))


def group_levels(cluster: Cluster, size: int, stride: int) -> list[TierLevel]:
    """The tiers a group of ``size`` devices, ``stride`` apart, spans, as
    :class:`~lowcomm.tune.cost.TierLevel` s for a collective every such group runs at once."""
    return list(_group_levels(cluster, size, stride))


@functools.lru_cache(maxsize=4096)
def _group_levels(cluster: Cluster, size: int, stride: int) -> tuple[TierLevel, ...]:
    units = tuple(cluster.unit_sizes())
    members = _members(units, size, stride)
    levels = []
    for i, tier in enumerate(cluster.tiers):
        share = 1 if i == 0 else units[i - 1]
        levels.append(TierLevel(members[i], tier.bandwidth_bps, tier.latency_s, share=share))
    return tuple(levels)


def dp_stride(layout: Layout) -> int:
    """Devices between consecutive members of a data-parallel group."""
    return layout.tp if layout.order == "tp-dp-pp" else layout.tp * layout.pp


def outer_split(cluster: Cluster, layout: Layout) -> tuple[int | None, int]:
    """(index of the slowest slow tier the data-parallel group crosses, or None; its members
    inside one unit below that tier, the group an outer algorithm syncs and shards within)."""
    levels = group_levels(cluster, layout.dp, dp_stride(layout))
    crossed = [i for i, lv in enumerate(levels) if lv.members > 1 and cluster.tiers[i].slow]
    if not crossed:
        return None, layout.dp
    top = crossed[-1]
    inner = 1
    for lv in levels[:top]:
        inner *= lv.members
    return top, inner


@functools.lru_cache(maxsize=4096)
def p2p_link(cluster: Cluster, stages: int, stride: int) -> tuple[int, int]:
    """(tier index, devices sharing its uplink) of the slowest link between consecutive
    pipeline stages ``stride`` devices apart."""
    units = cluster.unit_sizes()
    worst, share = 0, 1
    for j in range(stages - 1):
        a, b = j * stride, (j + 1) * stride
        tier = next(i for i, u in enumerate(units) if a // u == b // u)
        if tier > worst:
            worst, share = tier, min(units[tier - 1], stride)
    return worst, share


class _GroupNetwork:
    """The data-parallel group as :func:`~lowcomm.tune.cost.step_time` sees a network."""

    def __init__(self, levels: list[TierLevel]) -> None:
        self.levels = levels

    def allreduce_time(self, payload_bytes: float, n: int) -> float:
        return _tiered(payload_bytes, self.levels)

    def allgather_time(self, payload_bytes: float, n: int) -> float:
        return 0.5 * _tiered(payload_bytes * n, self.levels)

    def exchange_time(self, payload_bytes: float, group: int) -> float:
        raise ValueError("lowcomm plan prices all-reduce based outer algorithms only")


def _linear(tokens: float, k_in: float, n_out: float) -> tuple[Gemm, list[Gemm]]:
    """A linear layer's forward GEMM and its two backward ones (input and weight gradients)."""
    return Gemm(tokens, n_out, k_in), [Gemm(tokens, k_in, n_out), Gemm(k_in, n_out, tokens)]


def layer_gemms(
    model: ModelSpec, tp: int, micro_batch: int, *, flash: bool
) -> tuple[list[Gemm], list[Gemm], list[Gemm], list[Gemm], list[Gemm]]:
    """The GEMMs of one micro-batch on one TP rank: (a layer's forward, its backward, its
    attention core's forward, the logits' forward, their backward).

    Per layer the QKV projection (k = h, n = (h + 2 · kv width) / t), the output projection
    (k = h / t), the MLP's up projection (gate and up together when gated: n = 2f / t) and down
    projection (k = f / t), each over s · b tokens; backward two GEMMs per linear, the input's
    gradient (k = the output width) and the weight's (k = the tokens). The attention core, per
    head on the rank (b · a / t of them): scores Q Kᵀ (k = head size) and their product with V
    (k = s); backward dP = dO Vᵀ (k = head size), dV, dQ and dK (k = s). Flash attention's
    causal kernel skips the tiles above the diagonal (half the work) and recomputes the scores
    in backward (Dao 2023, FlashAttention-2)."""
    s, h, f = model.seq, model.hidden, model.ffn
    tokens = float(s * micro_batch)
    fwd: list[Gemm] = []
    bwd: list[Gemm] = []
    mlp_up = (2 if model.gated else 1) * f / tp
    for k_in, n_out in ((h, (h + 2 * model.kv_dim) / tp), (h / tp, h), (h, mlp_up), (f / tp, h)):
        forward, backward = _linear(tokens, k_in, n_out)
        fwd.append(forward)
        bwd += backward
    head_size = h / model.heads
    batch = micro_batch * model.heads / tp * (0.5 if flash else 1.0)
    scores = Gemm(s, s, head_size, batch)
    core = [scores, Gemm(s, head_size, s, batch)]
    core_bwd = [Gemm(s, s, head_size, batch)] + [Gemm(s, head_size, s, batch)] * 3
    if flash:
        core_bwd.append(scores)
    head_fwd, head_bwd = _linear(tokens, h, model.vocab / tp)
    return fwd + core, bwd + core_bwd, core, [head_fwd], head_bwd


@functools.lru_cache(maxsize=4096)
def _gemm_times(
    model: ModelSpec,
    tp: int,
    micro_batch: int,
    flash: bool,
    peak_flops: float,
    efficiency: float,
    overhead_s: float,
    k_half: float,
) -> tuple[float, ...]:
    """The seconds of each group of :func:`layer_gemms` (a search prices the same TP and
    micro-batch for many layouts: computed once each)."""
    return tuple(
        sum(gemm_time(g, peak_flops, efficiency, overhead_s=overhead_s, k_half=k_half) for g in gs)
        for gs in layer_gemms(model, tp, micro_batch, flash=flash)
    )


def iteration_time(
    model: ModelSpec,
    precision: Precision,
    cluster: Cluster,
    layout: Layout,
    global_batch: int,
) -> TimeBreakdown:
    """Predicted time of one iteration of ``global_batch`` sequences; see the module docstring."""
    t, p, d, v = layout.tp, layout.pp, layout.dp, layout.interleave
    b = layout.micro_batch
    m = global_batch // (d * b)
    e = precision.activation_bytes

    fwd_l, bwd_l, core_l, fwd_h, bwd_h = _gemm_times(
        model,
        t,
        b,
        layout.flash_attention,
        cluster.peak_flops,
        cluster.gemm_efficiency,
        cluster.gemm_overhead_s,
        cluster.gemm_k_half,
    )

    def stage(layers: float, logits: bool) -> tuple[float, float, float, float]:
        """Backward, compute, elementwise and TP time of one micro-batch on a stage of
        ``layers`` layers (``logits``: and the head)."""
        fwd = layers * fwd_l + (fwd_h if logits else 0.0)
        bwd = layers * bwd_l + (bwd_h if logits else 0.0)
        recompute = 0.0
        if layout.recompute == "full":
            recompute = layers * fwd_l
        elif layout.recompute == "selective" and not layout.flash_attention:
            recompute = layers * core_l
        passes = 3 + (1 if layout.recompute != "none" else 0)
        kept = activation_bytes_per_layer(model, precision, layout, b, stored=False)
        head = 3 * 4.0 * model.seq * b * model.vocab / t if logits else 0.0
        elementwise = passes * 2 * (layers * kept + head) / cluster.memory_bandwidth_Bps
        tp = 0.0
        if t > 1:
            tier = cluster.tiers[0]
            count = 4 + (2 if layout.recompute == "full" else 0)
            one = _tp_allreduce(
                e * model.seq * b * model.hidden, t, tier.bandwidth_bps, tier.latency_s
            )
            tp = layers * count * one
        compute = fwd + bwd + recompute
        if layout.tp_overlap:
            tp = max(0.0, tp - compute)  # hidden behind the GEMMs, as far as they last
        return bwd, compute, elementwise, tp

    # the stage with the most work sets the pace: the last (its layers and the logits), or with
    # uneven stages a full one (stage_layers)
    bwd, compute, elementwise, tp_time = stage(stage_layers(model, layout, "last"), True)
    if p > 1 and model.layers % p:
        most = stage(stage_layers(model, layout, "most"), False)
        if sum(most[1:]) > compute + elementwise + tp_time:
            bwd, compute, elementwise, tp_time = most

    pp_time = 0.0
    pp_stride = t * d if layout.order == "tp-dp-pp" else t
    if p > 1:
        tier_index, share = p2p_link(cluster, p, pp_stride)
        tier = cluster.tiers[tier_index]
        message = e * model.seq * b * model.hidden / t
        pp_time = 2 * v * p2p_time(message, tier.bandwidth_bps, tier.latency_s, share=share)

    slot = compute + elementwise + tp_time + pp_time
    bubble = (p - 1) / v * slot if p > 1 else 0.0

    phi = max(
        stage_parameters(model, layout, s) for s in (("only",) if p == 1 else ("first", "last"))
    )
    levels = group_levels(cluster, d, dp_stride(layout))
    outer_levels = levels
    if layout.outer:
        top, _ = outer_split(cluster, layout)
        if top is None:
            raise ValueError(
                f"{layout.outer} needs the data-parallel group to cross a slow tier "
                f"({layout.label()} on {cluster.name} does not)"
            )
        levels = [
            TierLevel(1, lv.bandwidth_bps, lv.latency_s, lv.share) if i >= top else lv
            for i, lv in enumerate(levels)
        ]
    allreduce = _tiered(phi * precision.grad_bytes, levels)
    backward_last = bwd
    if layout.zero <= 1:
        dp_comm = allreduce
        overlapped = p == 1 or layout.dp_overlap
        dp_exposed = max(0.0, allreduce - backward_last) if overlapped else allreduce
    elif layout.zero == 2:
        scatter = allreduce / 2
        gather = _tiered(phi * precision.weight_bytes, levels) / 2
        dp_comm = m * scatter + gather
        dp_exposed = m * max(0.0, scatter - backward_last) + gather
    else:
        scatter = allreduce / 2
        gather = _tiered(phi * precision.weight_bytes, levels) / 2
        per_micro = 2 * gather + scatter
        dp_comm = m * per_micro
        dp_exposed = m * max(0.0, per_micro - compute)

    shard = (outer_split(cluster, layout)[1] if layout.outer else d) if layout.zero else 1
    state = precision.master_bytes + precision.optimizer_bytes
    optimizer = phi * (2 * precision.weight_bytes + precision.grad_bytes + 2 * state) / shard
    optimizer /= cluster.memory_bandwidth_Bps

    inner = m * slot + bubble + dp_exposed + optimizer
    outer_exposed = 0.0
    if layout.outer:
        settings: dict[str, Any] = dict(layout.extra)
        algo = Algorithm(name=layout.outer, sync_every=layout.sync_every, **settings)
        work = Workload(
            parameters=phi,
            tokens_per_step=float(global_batch * model.seq),
            step_time_s=inner,
            bytes_per_param=4.0,
            backward_fraction=0.0,
        )
        network = _GroupNetwork(outer_levels)
        outer_exposed = step_time(algo, work, network, d).step_s - inner
        if algo.schedule is SPARSE_GATHER:  # its exact wire bytes, all-gathered
            sent = phi * sparse_bytes_per_element(algo.density, algo.chunk, algo.bits)
            dp_comm += network.allgather_time(sent, d) / layout.sync_every
        else:
            dp_comm += _tiered(phi * 4.0, outer_levels) / layout.sync_every

    iteration = inner + outer_exposed
    devices = layout.devices
    executed, model_flops = _flops(model, global_batch, layout.recompute, layout.flash_attention)
    per_device = executed / (iteration * devices)
    return TimeBreakdown(
        compute_s=m * compute,
        elementwise_s=m * elementwise,
        tp_s=m * tp_time,
        pp_s=m * pp_time,
        bubble_s=bubble,
        dp_s=dp_exposed,
        outer_s=outer_exposed,
        optimizer_s=optimizer,
        iteration_s=iteration,
        dp_comm_s=dp_comm,
        tokens_per_s=global_batch * model.seq / iteration,
        tflops_per_device=per_device / 1e12,
        percent_of_peak=100.0 * per_device / cluster.peak_flops,
        mfu=model_flops / (iteration * devices * cluster.peak_flops),
    )


@functools.lru_cache(maxsize=4096, typed=True)
def _tp_allreduce(payload_bytes: int, tp: int, bandwidth_bps: float, latency_s: float) -> float:
    """One TP all-reduce of ``payload_bytes`` inside a node (a search prices the same ones for
    many layouts: computed once each)."""
    return _tiered(payload_bytes, [TierLevel(tp, bandwidth_bps, latency_s)])


@functools.lru_cache(maxsize=4096, typed=True)
def _flops(
    model: ModelSpec, global_batch: int, recompute: Recompute, flash_attention: bool
) -> tuple[float, float]:
    """(FLOPs executed, model FLOPs) of one iteration (a search prices the same ones for many
    layouts: computed once each)."""
    executed = model.hardware_flops(global_batch, recompute)
    if recompute == "selective" and flash_attention:
        executed = model.model_flops(global_batch)
    return executed, model.model_flops(global_batch)
