"""The memory model: bytes one device holds at its peak, by kind, for one layout.

Per device, for the pipeline stage that needs the most (the first holds the most micro-batches in
flight, the last holds the logits), with Φ its parameters and d the data-parallel size:

* **Model state by ZeRO stage** (w, g, m, o: bytes per parameter of the working weights,
  gradients, a separate master copy and the optimizer state; :class:`~lowcomm.plan.spec.Precision`):

  - 0: ``Φ (w + g + m + o)``;
  - 1: ``Φ (w + g) + Φ (m + o) / d``;
  - 2: ``Φ w + Φ (g + max(m, w) + o) / d`` (the sharded parameters are the master copy; the
    working copy is gathered for the whole forward and backward, as FSDP's ``SHARD_GRAD_OP``);
  - 3: ``Φ (g + max(m, w) + o) / d`` plus the gathered working set at the start of backward:
    the embedding and head and the last layer (prefetched);
  - at the end of backward, 2 and 3 also hold one layer's unsharded gradient waiting for its
    reduce-scatter.

  Gradients are counted resident (a contiguous gradient buffer, DDP's
  ``gradient_as_bucket_view``, or accumulation over micro-batches).
* **Activations per layer and micro-batch** (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", arXiv 2205.05198, §4), with e bytes per activation,
  TP t, s b h the tokens × width: layer-norm inputs ``2 e sbh``, the inputs of the QKV and of the
  MLP ``2 e sbh`` and the dropout masks of the attention and MLP outputs ``2 sbh`` are replicated
  over the TP group (split by sequence parallelism); Q, K, V ``3 e sbh / t`` (fewer with grouped
  KV heads), the output projection's input ``e sbh / t``, the MLP's ``2 e s b f / t`` (GELU's
  input and the second linear's: the same fused or not). A SwiGLU MLP keeps, as autograd runs it
  (``kernels="eager"``), the gate's pre-activation, its SiLU, the up projection and their
  product, ``4 e s b f / t``; a fused SwiGLU (Megatron-LM's ``bias_swiglu``) keeps its two inputs
  and the down projection its product, ``3 e s b f / t``. An eager RMSNorm (PyTorch's
  ``nn.RMSNorm``) also keeps its normalised input for the scale's gradient, ``e sbh`` more per
  norm; a fused one, like LayerNorm, its input and per-token statistics (left out: ``4 s b``
  bytes each). Measured on this machine with a Llama-style model
  (:mod:`lowcomm.models.llama`, ``lowcomm plan --validate memory``). The attention core adds
  the softmax ``e a s² b / t`` (+ its dropout mask and output ``(1 + e) a s² b / t``); with
  flash attention it keeps only its output and log-sum-exp instead, ``e sbh / t + 4 a s b / t``;
  selective recompute drops the core. Megatron's GPT (e = 2, dropout, no flash):
  ``sbh (10 + 24/t + 5 a s / (h t))``; with sequence parallelism and selective recompute
  ``34 sbh / t``. Full recompute keeps each layer's input, ``e sbh`` (/t with
  SP), and rebuilds one layer at a time in backward.
* **In flight** (1F1B): the first stage holds ``min(p, m)`` micro-batches of its ``L / p``
  layers (× ``1 + (p − 1) / (p v)`` with v interleaved stages), the last stage one.
* **Head** (last stage): final norm input and output and the fp32 cross entropy over the
  vocabulary: its saved softmax, the gradient arriving from the loss and the logits' gradient,
  ``3 · 4 s b V / t`` at the start of backward. The peak adds the larger of the head and one
  rebuilt layer (full recompute) to what is stored, since they happen at different times.
* **End of backward**: the activations are gone and the embedding's gradient (``V h / t``)
  arrives. With resident gradients (ZeRO 0/1) it is added in place: one transient copy. With
  ZeRO-2/3 the unsharded gradient is built afresh each backward, so a tied embedding's two
  contributions (from the logits and from the lookup) and their sum exist at once (three
  copies) beside the gathered parameters. The peak is the larger of the two moments
  (``MemoryBreakdown.phase``).
* **Outer algorithm**: its anchor, outer momentum and send buffer in fp32, ``12 Φ``;
  SparseLoCo's anchor and error-feedback accumulator, ``8 Φ``, and the sparse payloads of the
  data-parallel group its all-gather brings (:func:`outer_state_bytes`).

Left out: the optimizer step's temporaries, framework workspaces (cuBLAS, NCCL buffers) and
allocator fragmentation: the planner keeps ``1 − usable`` of the memory for them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace

from lowcomm.plan.spec import Layout, ModelSpec, Precision

__all__ = [
    "MemoryBreakdown",
    "activation_bytes_per_layer",
    "memory",
    "outer_state_bytes",
    "stage_layers",
    "stage_parameters",
]

OUTER_STATE_BYTES = 12
"""fp32 anchor, outer momentum and send buffer per parameter of an outer algorithm."""


def outer_state_bytes(layout: Layout) -> float:
    """Bytes per parameter of ``layout``'s outer algorithm: :data:`OUTER_STATE_BYTES`, or for
    SparseLoCo (no outer momentum, a sparse all-gather) its fp32 anchor and accumulator and the
    DP group's payloads at its default density and bits."""
    if not layout.outer:
        return 0.0
    from lowcomm.registry import REGISTRY
    from lowcomm.schedules import SPARSE_GATHER, sparse_bytes_per_element
    from lowcomm.tune.cost import Algorithm

    if REGISTRY[layout.outer].schedule is SPARSE_GATHER:
        a = Algorithm(name=layout.outer)
        return 8.0 + layout.dp * sparse_bytes_per_element(a.density, a.chunk, a.bits)
    return float(OUTER_STATE_BYTES)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes on one device, by kind."""

    stage: str
    """Which pipeline stage binds: "first", "last" or "only"."""
    parameters: float
    """Parameters the stage holds (Φ, before ZeRO sharding)."""
    weights: float
    gradients: float
    optimizer: float
    """Optimizer state and master copy."""
    working: float
    """Gathered parameters and in-flight unsharded gradients of ZeRO-2/3; at the end of
    backward also the embedding's incoming gradient."""
    outer: float
    activations: float
    """Stored activations of the micro-batches in flight, plus the head or a rebuilt layer."""
    phase: str = "backward start"
    """When the peak happens: "backward start" (activations and the logits held) or "backward
    end" (the embedding's gradient arriving, for ZeRO-2/3 with the gathered parameters)."""

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.working
            + self.outer
            + self.activations
        )

    def as_dict(self) -> dict[str, float | str]:
        out: dict[str, float | str] = dict(asdict(self))
        out["total"] = self.total
        return out


def stage_layers(model: ModelSpec, layout: Layout, stage: str) -> float:
    """Transformer layers on one device of ``stage``: "first", "last", "only", or "most"
    (the fullest stage). L / p when p divides L; otherwise (uneven stages) q = ⌊L / p⌋ and
    r = L mod p: r stages take q + 1 layers
    and the lighter ones sit at the ends, the last stage first (it also computes the logits),
    then the first (it also embeds): the last q, the first q when at least two stages are
    light, every other stage q + 1 — Megatron's uneven split of, e.g., 126 layers on 16
    stages (7, 8 × 14, 7). With v interleaved (virtual) stages a device's layers are split
    into v chunks of as equal size as they allow; on a light end stage the spare chunk holds
    the embedding or the head alone (Llama 3 405B: 126 layers, 16 stages, the first and last
    chunks the embedding and the output layer)."""
    p = layout.pp
    if stage == "only" or p == 1:
        return float(model.layers)
    q, r = divmod(model.layers, p)
    if r == 0:
        return model.layers / p
    if stage == "last":
        return float(q)
    if stage == "first":
        return float(q if p - r >= 2 else q + 1)
    return float(q + 1)


def stage_parameters(model: ModelSpec, layout: Layout, stage: str) -> float:
    """Parameters one device of ``stage`` ("first", "last" or "only") holds under TP."""
    return _stage_parameters(model, layout.tp, layout.pp, stage)


@functools.lru_cache(maxsize=4096, typed=True)
def _stage_parameters(model: ModelSpec, t: int, p: int, stage: str) -> float:
    """:func:`stage_parameters` by the only layout fields it reads, TP and PP (a search asks
    for the same ones for many layouts: computed once each)."""
    layout = Layout(tp=t, pp=p, dp=1)
    layers = stage_layers(model, layout, stage) * model.layer_parameters() / t
    emb = model.embedding_parameters() / t
    head = model.head_parameters() / t
    if stage == "only":
        return layers + emb + head
    if stage == "first":
        return layers + emb
    tied_replica = model.vocab * model.hidden / t if model.tied_embeddings else 0.0
    return layers + head + tied_replica


def activation_bytes_per_layer(
    model: ModelSpec, precision: Precision, layout: Layout, micro_batch: int, *, stored: bool
) -> float:
    """Activation bytes of one layer for one micro-batch; ``stored=False``: everything the
    layer keeps when nothing is recomputed (what full recompute rebuilds in backward)."""
    return _activation_bytes_per_layer(
        model,
        precision.activation_bytes,
        layout.tp,
        layout.sequence_parallel,
        layout.recompute,
        layout.flash_attention,
        micro_batch,
        stored,
    )


@functools.lru_cache(maxsize=4096, typed=True)
def _activation_bytes_per_layer(
    model: ModelSpec,
    e: int,
    t: int,
    sequence_parallel: bool,
    recompute: str,
    flash_attention: bool,
    micro_batch: int,
    stored: bool,
) -> float:
    """:func:`activation_bytes_per_layer` by the only precision and layout fields it reads
    (a search asks for the same ones for many layouts: computed once each)."""
    s, b, h, a = model.seq, micro_batch, model.hidden, model.heads
    sbh = s * b * h
    rep = t if sequence_parallel else 1  # replicated parts split only by SP
    if stored and recompute == "full":
        return e * sbh / rep
    mask = 1.0 if model.dropout else 0.0
    norms = _eager_norms(model)
    # two norm inputs, QKV and MLP inputs (eager RMSNorm: also the normalised inputs), masks
    replicated = ((4 + 2 * norms) * e + 2 * mask) * sbh / rep
    kv = s * b * model.kv_dim
    split = e * (sbh + 2 * kv) + e * sbh  # Q, K, V; output projection input
    split += _mlp_saved(model) * e * s * b * model.ffn
    if flash_attention:
        core = e * sbh + 4.0 * a * s * b
    elif stored and recompute == "selective":
        core = 0.0
    else:
        core = (e + mask * (1 + e)) * a * s * s * b
    return replicated + (split + core) / t


def _mlp_saved(model: ModelSpec) -> int:
    """Tensors of s × b × f elements the MLP keeps for backward (module docstring)."""
    if not model.gated:
        return 2
    return 4 if model.kernels == "eager" else 3


def _eager_norms(model: ModelSpec) -> int:
    """1 when every RMSNorm also keeps its normalised input (plain PyTorch), else 0."""
    return 1 if not model.bias and model.kernels == "eager" else 0


def _head_bytes(model: ModelSpec, precision: Precision, layout: Layout, micro_batch: int) -> float:
    s, b, h = model.seq, micro_batch, model.hidden
    rep = layout.tp if layout.sequence_parallel else 1
    norm = (2 + _eager_norms(model)) * precision.activation_bytes * s * b * h / rep
    return norm + 3 * 4.0 * s * b * model.vocab / layout.tp


def in_flight(layout: Layout, micro_batches: int) -> float:
    """Micro-batches whose activations the first stage holds at once (1F1B)."""
    return held_at(layout, micro_batches, 0)


def held_at(layout: Layout, micro_batches: int, k: int) -> float:
    """Micro-batches whose activations stage ``k`` (0: the first) holds at once under 1F1B:
    min(p − k, m), × (1 + (p − 1)/(p v)) with v interleaved stages."""
    p, v = layout.pp, layout.interleave
    held = float(min(p - k, micro_batches))
    if v > 1:
        held *= 1 + (p - 1) / (p * v)
    return held


def memory(
    model: ModelSpec,
    precision: Precision,
    layout: Layout,
    micro_batches: int,
    *,
    zero_group: int | None = None,
) -> MemoryBreakdown:
    """Peak memory of the stage that needs the most; ``micro_batches`` per iteration per
    pipeline (m = global batch / (dp × micro_batch)); ZeRO shards over ``zero_group`` ranks
    (default: all of DP; with an outer algorithm, the replicas inside one unit of the slow
    tier)."""
    stages = ("only",) if layout.pp == 1 else ("first", "last")
    group = layout.dp if zero_group is None else zero_group
    return max(
        (_stage_memory(model, precision, layout, micro_batches, st, group) for st in stages),
        key=lambda m: m.total,
    )


def _stage_memory(
    model: ModelSpec,
    precision: Precision,
    layout: Layout,
    micro_batches: int,
    stage: str,
    zero_group: int | None = None,
) -> MemoryBreakdown:
    phi = stage_parameters(model, layout, stage)
    d = layout.dp if zero_group is None else zero_group
    z = layout.zero if d > 1 else 0
    w, g = precision.weight_bytes, precision.grad_bytes
    master, opt = precision.master_bytes, precision.optimizer_bytes
    working = in_flight_grads = 0.0
    if z == 0:
        weights, grads, optim = phi * w, phi * g, phi * (master + opt)
    elif z == 1:
        weights, grads, optim = phi * w, phi * g, phi * (master + opt) / d
    else:
        weights, grads, optim = 0.0, phi * g / d, phi * (max(master, w) + opt) / d
        t = layout.tp
        # later in backward: a layer's unsharded gradient waits for its reduce-scatter
        in_flight_grads = min(phi, model.layer_parameters() / t) * g
        if z == 2:
            working = phi * w
        else:
            # at the start of backward: the root (embedding, head) and the last layer, prefetched
            gathered = model.layer_parameters() / t + _root_parameters(model, layout, stage)
            working = min(phi, gathered) * w
    outer = phi * outer_state_bytes(layout)
    b = layout.micro_batch
    per_layer = activation_bytes_per_layer(model, precision, layout, b, stored=True)
    rebuilt = 0.0
    if layout.recompute == "full":
        rebuilt = activation_bytes_per_layer(model, precision, layout, b, stored=False)
    held = 1.0 if stage == "last" else in_flight(layout, micro_batches)
    layer_batches = stage_layers(model, layout, stage) * held
    if stage == "first" and layout.pp > 1:
        # with uneven stages a full stage right after a light first one may hold more: the
        # second holds one micro-batch fewer (1F1B) of its layers
        most = stage_layers(model, layout, "most") * held_at(layout, micro_batches, 1)
        layer_batches = max(layer_batches, most)
    act = layer_batches * per_layer
    extra = rebuilt
    if stage in ("last", "only"):
        extra = max(extra, _head_bytes(model, precision, layout, b))
    mask = 1.0 if model.dropout else 0.0
    if stage in ("first", "only") and mask:
        act += (
            held
            * model.seq
            * b
            * model.hidden
            * mask
            / (layout.tp if layout.sequence_parallel else 1)
        )
    assert math.isfinite(act + extra)
    start = MemoryBreakdown(
        stage=stage,
        parameters=phi,
        weights=weights,
        gradients=grads,
        optimizer=optim,
        working=working,
        outer=outer,
        activations=act + extra,
    )
    # the end of backward: activations are gone, the embedding's gradient arrives
    t = layout.tp
    embedding = model.vocab * model.hidden / t
    if stage == "last" and not model.tied_embeddings:
        embedding = 0.0  # the head's own gradient accumulates like any layer's
    if z <= 1:
        # gradients are resident: the incoming gradient is added into them in place
        end_working = embedding * g
    else:
        # the unsharded gradient is built afresh each backward; a tied weight's two
        # contributions (logits and embedding lookup) and their sum exist at once
        both = model.tied_embeddings and stage == "only"
        gathered = phi if z == 2 else min(phi, _root_parameters(model, layout, stage))
        end_working = gathered * w + in_flight_grads + (3 if both else 1) * embedding * g
    if end_working > start.working + start.activations:
        return replace(start, phase="backward end", working=end_working, activations=0.0)
    return start


def _root_parameters(model: ModelSpec, layout: Layout, stage: str) -> float:
    """Parameters outside the transformer layers on ``stage`` (gathered with the root)."""
    t = layout.tp
    out = 0.0
    if stage in ("first", "only"):
        out += model.embedding_parameters() / t
    if stage in ("last", "only"):
        out += model.head_parameters() / t
    if stage == "last" and model.tied_embeddings:
        out += model.vocab * model.hidden / t
    return out
