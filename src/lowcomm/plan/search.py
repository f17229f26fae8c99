"""The search: every layout of a model on a cluster, the feasibility rules, and the ranking.

Rules (the Frontier study's and Megatron's, :func:`check_layout`): TP × PP × DP uses every device;
attention heads divisible by TP and TP within a node; at most one pipeline stage per layer
(stages uneven where PP does not divide the layers, :func:`~lowcomm.plan.memory.stage_layers`);
with v interleaved (virtual) stages at least v layers on the fullest stage and the
micro-batches a multiple of PP; ZeRO at
most 1 with PP > 1 (stage 2/3 would reshard gradients or parameters every micro-batch); the
global batch divisible by DP × micro-batch; sequence parallelism only with TP > 1; the peak
memory (:func:`~lowcomm.plan.memory.memory`) within ``usable`` of the device's. An outer
algorithm is offered where the data-parallel group crosses a tier marked slow
(:attr:`~lowcomm.plan.spec.Tier.slow`), with the smallest H (a power of two up to
``max_sync_every``) that keeps the iteration within ``outer_tolerance`` of never synchronising
across that tier; ``sync_every`` fixes H.

Candidates are ranked by predicted tokens/s; ties keep the smaller memory.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lowcomm.plan.memory import MemoryBreakdown, memory
from lowcomm.plan.spec import RECOMPUTE, Cluster, Layout, ModelSpec, Precision, Recompute
from lowcomm.plan.timing import TimeBreakdown, iteration_time, outer_split
from lowcomm.registry import REGISTRY
from lowcomm.schedules import SPARSE_GATHER

__all__ = ["Candidate", "PlanResult", "check_layout", "evaluate", "plan", "rank_of"]


@dataclass(frozen=True)
class Candidate:
    """One layout with its prediction."""

    layout: Layout
    memory: MemoryBreakdown
    time: TimeBreakdown
    fits: bool
    reasons: tuple[str, ...] = ()
    """Why it is infeasible (empty when feasible)."""

    @property
    def feasible(self) -> bool:
        return not self.reasons

    def as_dict(self) -> dict[str, object]:
        lay = self.layout
        return {
            "layout": lay.label(),
            "tp": lay.tp,
            "pp": lay.pp,
            "dp": lay.dp,
            "zero": lay.zero,
            "micro_batch": lay.micro_batch,
            "recompute": lay.recompute,
            "sequence_parallel": lay.sequence_parallel,
            "tp_overlap": lay.tp_overlap,
            "dp_overlap": lay.dp_overlap,
            "flash_attention": lay.flash_attention,
            "interleave": lay.interleave,
            "order": lay.order,
            "outer": lay.outer,
            "sync_every": lay.sync_every if lay.outer else None,
            "memory": self.memory.as_dict(),
            "time": self.time.as_dict(),
            "reasons": list(self.reasons),
        }


@dataclass(frozen=True)
class PlanResult:
    """Feasible candidates best first, and how many layouts were rejected and why."""

    model: ModelSpec
    cluster: Cluster
    precision: Precision
    global_batch: int
    candidates: tuple[Candidate, ...]
    rejected: dict[str, int]
    """Count of rejected layouts per first reason."""
    infeasible: tuple[Candidate, ...] = ()
    """With ``fixed`` fields (``lowcomm plan --layout``): the layouts that match them but
    break a rule, with every rule each breaks."""


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def check_layout(
    model: ModelSpec,
    cluster: Cluster,
    layout: Layout,
    global_batch: int,
) -> list[str]:
    """The structural rules a layout breaks (empty: it can run); memory is checked apart."""
    reasons = []
    t, p = layout.tp, layout.pp
    if layout.devices != cluster.devices:
        reasons.append(
            f"TP x PP x DP = {layout.devices} does not use the cluster's {cluster.devices} devices"
        )
    if model.heads % t:
        reasons.append(f"attention heads ({model.heads}) not divisible by TP ({t})")
    if model.kv % t and t % model.kv:
        reasons.append(f"key/value heads ({model.kv}) and TP ({t}) do not divide one another")
    if t > cluster.devices_per_node or cluster.devices_per_node % t:
        reasons.append(f"TP ({t}) does not fit inside a node of {cluster.devices_per_node} devices")
    if p > model.layers:
        reasons.append(f"PP ({p}) exceeds the layers ({model.layers})")
    elif layout.interleave > 1 and -(-model.layers // p) < layout.interleave:
        reasons.append(
            f"interleave ({layout.interleave}) exceeds the layers of the fullest stage "
            f"({-(-model.layers // p)}): every virtual stage needs a layer"
        )
    if p > 1 and layout.zero > 1:
        reasons.append(f"ZeRO-{layout.zero} with PP > 1 (use ZeRO <= 1 with pipelining)")
    if global_batch % (layout.dp * layout.micro_batch):
        reasons.append(
            f"global batch ({global_batch}) not divisible by DP x micro-batch "
            f"({layout.dp} x {layout.micro_batch})"
        )
    if layout.zero and layout.dp == 1:
        reasons.append("ZeRO needs DP > 1")
    micro = global_batch // max(1, layout.dp * layout.micro_batch)
    if layout.interleave > 1 and micro % p:
        reasons.append(
            f"micro-batches per pipeline ({micro}) not a multiple of PP ({p}), which the "
            "interleaved schedule needs"
        )
    if layout.outer and outer_split(cluster, layout)[0] is None:
        reasons.append(f"{layout.outer} needs the data-parallel group to cross a slow tier")
    return reasons


def evaluate(
    model: ModelSpec,
    precision: Precision,
    cluster: Cluster,
    layout: Layout,
    global_batch: int,
    *,
    usable: float = 0.9,
) -> Candidate:
    """Memory, time and feasibility of one layout (:func:`check_layout` and the memory bound)."""
    return _evaluate(model, precision, cluster, layout, global_batch, usable=usable)


def _evaluate(
    model: ModelSpec,
    precision: Precision,
    cluster: Cluster,
    layout: Layout,
    global_batch: int,
    *,
    usable: float,
    mem: MemoryBreakdown | None = None,
) -> Candidate:
    """:func:`evaluate`; ``mem``: the layout's :func:`~lowcomm.plan.memory.memory` where the
    caller has it already (a layout without an outer algorithm, its micro-batches per
    pipeline, ZeRO over all of DP), not computed again."""
    reasons = check_layout(model, cluster, layout, global_batch)
    micro = max(1, global_batch // (layout.dp * layout.micro_batch))
    if mem is None:
        shards = outer_split(cluster, layout)[1] if layout.outer else layout.dp
        mem = memory(model, precision, layout, micro, zero_group=shards)
    fits = mem.total <= usable * cluster.device_memory_bytes
    if not fits:
        reasons.append(
            f"needs {mem.total / 1e9:.1f} GB of {usable * cluster.device_memory_bytes / 1e9:.1f} "
            "GB usable"
        )
    if any("slow tier" in r for r in reasons):
        timing = iteration_time(
            model, precision, cluster, replace(layout, outer=None), global_batch
        )
    else:
        timing = iteration_time(model, precision, cluster, layout, global_batch)
    return Candidate(layout=layout, memory=mem, time=timing, fits=fits, reasons=tuple(reasons))


def _reason_kind(reason: str) -> str:
    """A reason without its numbers, to count rejections by kind."""
    if reason.startswith("needs "):
        return "does not fit in memory"
    return reason.split(" (")[0]


def _micro_batches(per_replica: int, cap: int) -> list[int]:
    return [b for b in _divisors(per_replica) if b <= cap]


def _outer_layout(
    model: ModelSpec,
    precision: Precision,
    cluster: Cluster,
    base: Layout,
    global_batch: int,
    name: str,
    sync_every: int | None,
    max_sync_every: int,
    tolerance: float,
) -> Layout:
    """``base`` with the outer algorithm ``name`` and its H: given, or the smallest power of
    two whose iteration is within ``tolerance`` of an iteration without the slow tier."""
    if sync_every is not None:
        return replace(base, outer=name, sync_every=sync_every)
    h = 1
    free = iteration_time(
        model, precision, cluster, replace(base, outer=name, sync_every=1 << 30), global_batch
    ).iteration_s
    while True:
        layout = replace(base, outer=name, sync_every=h)
        step = iteration_time(model, precision, cluster, layout, global_batch).iteration_s
        if step <= (1 + tolerance) * free or h >= max_sync_every:
            return layout
        h *= 2


def _priced(name: str) -> bool:
    """Whether ``lowcomm plan`` prices outer algorithm ``name``: those whose rounds all-reduce
    over the data-parallel group, and SparseLoCo's sparse all-gather."""
    schedule = REGISTRY[name].schedule
    return schedule.rounds_all_reduce or schedule is SPARSE_GATHER


def plan(
    model: ModelSpec,
    precision: Precision,
    cluster: Cluster,
    global_batch: int,
    *,
    usable: float = 0.9,
    max_micro_batch: int = 16,
    recompute: Sequence[Recompute] = RECOMPUTE,
    flash_attention: bool = True,
    outer: Iterable[str] = ("diloco", "co2"),
    sync_every: int | None = None,
    max_sync_every: int = 512,
    outer_tolerance: float = 0.05,
    zero_stages: Sequence[int] = (0, 1, 2, 3),
    interleave: Sequence[int] = (1,),
    fixed: Mapping[str, object] | None = None,
) -> PlanResult:
    """Every feasible layout of ``model`` on ``cluster`` for ``global_batch`` sequences per
    iteration, best predicted throughput first. ``interleave``: the virtual pipeline stages
    per device searched (those that divide the layers of a stage). ``fixed``: :class:`Layout`
    fields every layout keeps (:func:`~lowcomm.plan.spec.parse_layout`; ``outer`` None:
    no outer algorithm), searched over the rest; the layouts that match but break a rule are
    kept in :attr:`PlanResult.infeasible` with every rule they break."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global batch must be an integer >= 1, got {global_batch!r}")
    if not 0 < usable <= 1:
        raise ValueError(f"usable must be in (0, 1], got {usable!r}")
    outer = tuple(outer)
    for name in outer:
        if name not in REGISTRY or not _priced(name):
            allowed = [n for n in REGISTRY if _priced(n)]
            raise ValueError(
                f"outer algorithm {name!r} is not one lowcomm plan prices: choose from "
                f"{', '.join(allowed)}"
            )
    n = cluster.devices
    fix = dict(fixed or {})
    if "outer" in fix:
        outer = () if fix["outer"] is None else (str(fix["outer"]),)
        if "sync_every" in fix:
            sync_every = int(fix["sync_every"])  # type: ignore[call-overload]

    def pick(name: str, options: Sequence[object]) -> list[Any]:
        return [fix[name]] if name in fix else list(options)

    out: list[Candidate] = []
    infeasible: list[Candidate] = []
    rejected: dict[str, int] = {}
    default_order: dict[Layout, float] = {}  # iteration time of each tp-dp-pp layout
    tps = pick("tp", _divisors(cluster.devices_per_node))
    # every pipeline degree the devices allow, up to one layer a stage (uneven stages where it
    # does not divide the layers: memory.stage_layers)
    pps = [q for q in _divisors(n) if q <= model.layers]
    for t, p in itertools.product(tps, pick("pp", pps)):
        if "dp" in fix:
            d = int(fix["dp"])  # type: ignore[call-overload]
        elif n % (t * p) and not {"tp", "pp"} <= fix.keys():
            continue
        else:  # (TP and PP given: evaluated even where they do not divide the devices)
            d = max(1, n // (t * p))
        if global_batch % d and "dp" not in fix and not {"tp", "pp"} <= fix.keys():
            key = "global batch not divisible by DP"
            rejected[key] = rejected.get(key, 0) + 1
            continue
        zeros = pick("zero", [z for z in zero_stages if (z == 0 or d > 1) and (p == 1 or z <= 1)])
        orders = pick("order", ["tp-dp-pp", "tp-pp-dp"] if p > 1 and d > 1 else ["tp-dp-pp"])
        sps = pick("sequence_parallel", [False, True] if t > 1 else [False])
        # overlaps are what a framework does, not a choice of layout: kept as given
        tpo = bool(fix.get("tp_overlap", False))
        dpo = bool(fix.get("dp_overlap", False))
        mbs = pick("micro_batch", _micro_batches(max(1, global_batch // d), max_micro_batch))
        stages = [v for v in interleave if v == 1 or (p > 1 and -(-model.layers // p) >= v)]
        for z, b, rc, sp, order, v in itertools.product(
            zeros, mbs, pick("recompute", recompute), sps, orders, pick("interleave", stages)
        ):
            if rc == "selective" and flash_attention and "recompute" not in fix:
                continue  # flash attention already keeps only what selective recompute keeps
            try:
                layout = Layout(
                    tp=t,
                    pp=p,
                    dp=d,
                    zero=z,
                    micro_batch=b,
                    recompute=rc,
                    sequence_parallel=sp,
                    tp_overlap=tpo,
                    dp_overlap=dpo,
                    flash_attention=flash_attention,
                    interleave=v,
                    order=order,
                )
            except ValueError as e:  # a combination no layout has (fixed by the caller)
                key = str(e).removeprefix("layout.")
                rejected[key] = rejected.get(key, 0) + 1
                continue
            variants = [] if "outer" in fix and fix["outer"] is not None else [layout]
            top, inner = outer_split(cluster, layout) if d > 1 else (None, 1)
            offer = bool(outer) and top is not None and (z == 0 or inner > 1)
            if "outer" in fix and fix["outer"] is not None and not offer:
                variants = [replace(layout, outer=outer[0], sync_every=sync_every or 1)]
                offer = False
            # the layout's own memory (no outer algorithm, ZeRO over all of DP): the bound
            # here, and its evaluation below
            base = memory(model, precision, layout, max(1, global_batch // (d * b)))
            need = base.total
            if need > usable * cluster.device_memory_bytes and not fix:
                # an outer algorithm only adds state, so none of the variants fits either
                key = "does not fit in memory"
                rejected[key] = rejected.get(key, 0) + 1 + (len(outer) if offer else 0)
                continue
            if offer:
                variants += [
                    _outer_layout(
                        model,
                        precision,
                        cluster,
                        layout,
                        global_batch,
                        name,
                        sync_every,
                        max_sync_every,
                        outer_tolerance,
                    )
                    for name in outer
                ]
            for lay in variants:
                cand = _evaluate(
                    model,
                    precision,
                    cluster,
                    lay,
                    global_batch,
                    usable=usable,
                    mem=base if lay is layout else None,
                )
                if lay.order == "tp-dp-pp":
                    if cand.feasible:
                        default_order[lay] = cand.time.iteration_s
                else:
                    twin = default_order.get(replace(lay, order="tp-dp-pp"))
                    if twin is not None and math.isclose(
                        twin, cand.time.iteration_s, rel_tol=1e-12
                    ):
                        continue  # placing stages or replicas first changes nothing here
                if cand.feasible:
                    out.append(cand)
                else:
                    key = _reason_kind(cand.reasons[0])
                    rejected[key] = rejected.get(key, 0) + 1
                    if fix:
                        infeasible.append(cand)
    if fix and not out and not infeasible:
        # nothing matching could even be enumerated (a TP or PP that divides no device count):
        # the layout asked for, with the rest at their plainest, names the rules it breaks
        probe = _probe_layout(fix, n, flash_attention, outer, sync_every)
        if probe is not None:
            infeasible.append(
                evaluate(model, precision, cluster, probe, global_batch, usable=usable)
            )
    out.sort(key=lambda c: (-c.time.tokens_per_s, c.memory.total))
    return PlanResult(
        model=model,
        cluster=cluster,
        precision=precision,
        global_batch=global_batch,
        candidates=tuple(out),
        rejected=rejected,
        infeasible=tuple(infeasible),
    )


def _probe_layout(
    fix: Mapping[str, object],
    devices: int,
    flash_attention: bool,
    outer: Sequence[str],
    sync_every: int | None,
) -> Layout | None:
    """The layout of the fields in ``fix`` with every other field at its plainest (DP the
    devices left over, no ZeRO, micro-batch 1): what :func:`plan` evaluates to say why nothing
    keeps ``fix``; ``None`` where the fields themselves make no layout."""
    t = int(fix.get("tp", 1))  # type: ignore[call-overload]
    p = int(fix.get("pp", 1))  # type: ignore[call-overload]
    values: dict[str, Any] = {
        "dp": max(1, devices // (t * p)),
        "flash_attention": flash_attention,
        **{k: v for k, v in fix.items() if k != "outer"},
    }
    if fix.get("outer") is not None:
        values.update(outer=fix["outer"], sync_every=sync_every or 1)
    elif "outer" not in fix and outer:
        values.update(outer=None)
    try:
        return Layout(**values)
    except (TypeError, ValueError):
        return None


def rank_of(result: PlanResult, layout: Layout) -> int | None:
    """1-based rank of the candidate with ``layout``'s TP, PP, DP, ZeRO, micro-batch,
    recompute, sequence parallelism and order (the best of its outer variants); None if
    infeasible or not searched."""
    keys = (
        "tp",
        "pp",
        "dp",
        "zero",
        "micro_batch",
        "recompute",
        "sequence_parallel",
        "tp_overlap",
        "dp_overlap",
        "interleave",
        "order",
    )

    def same(a: Layout) -> bool:
        return all(getattr(a, k) == getattr(layout, k) for k in keys) and a.outer == layout.outer

    for i, cand in enumerate(result.candidates, start=1):
        if same(cand.layout):
            return i
    return None
