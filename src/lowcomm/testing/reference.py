"""Single-process N-worker references of every algorithm: the same math, no communication.

The references are written per tensor, straight from the formulas in the design notes, and
independently of the algorithm classes (which work on flat buckets with ``torch._foreach_*``).
A real multi-process run of an algorithm (:func:`distributed_run`) must match
:func:`reference_run` on the same toy problem: bitwise where the order of floating-point
operations is the same (2 ranks), else to 1e-6.

A scenario is a plain dict::

    {"algo": "co2", "workers": 2, "sync_every": 3, "steps": 12, "inner": "sgd",
     "hyper": {"clip": 0.5, "clip_mode": "norm"}, "bucket_cap_mb": 0.0002, "seed": 0}

``hyper`` may hold ``"compression"`` (a spec string): every worker then compresses its
pseudo-gradient with the same codec and error feedback as the algorithms (:class:`RefCompression`),
and the mean is the mean of the decoded contributions.

The toy problem and the real algorithms' run of it are :mod:`lowcomm.testing.toy`'s, the
compressed means :mod:`lowcomm.testing.ref_compression`'s (both importable from here).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import MISSING, dataclass, field
from typing import Any

import torch

from lowcomm.optim.delayed_nesterov import DelayedNesterov
from lowcomm.outer.functional import GAP_EPS, GAP_STAT_DECAY, GAP_STAT_NEW, noloco_groups
from lowcomm.outer.warm import WARM_STREAM
from lowcomm.registry import ALGORITHMS
from lowcomm.testing.ref_compression import RefCompression, rank_order_mean
from lowcomm.testing.toy import (
    distributed_run,
    inner_step,
    make_inner,
    schedule_lr,
    toy_backward,
    toy_batch,
    toy_model,
    trainable_params,
)

__all__ = [
    "RefCompression",
    "ReferenceRun",
    "distributed_run",
    "inner_step",
    "make_inner",
    "reference_run",
    "toy_batch",
    "toy_model",
]

ALGO_DEFAULTS: dict[str, dict[str, Any]] = {
    name: {f.name: f.default for f in dataclasses.fields(cls.Config) if f.default is not MISSING}
    for name, cls in ALGORITHMS.items()
}
"""Each algorithm's default hyperparameters, from its dataclass (a scenario's ``hyper``
overrides them)."""


def _part(d: torch.Tensor, n: int, weight: float | None) -> torch.Tensor:
    """An eager update's own share of ``d``: d/N, or ``weight``·d."""
    return d / n if weight is None else d * float(weight)


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad.float()


@dataclass
class _CO2State:
    m: list[torch.Tensor]
    c: list[torch.Tensor]
    u: list[torch.Tensor]
    pending: list[torch.Tensor] | None = None
    updates: int = 0


@dataclass
class ReferenceRun:
    """Every worker's parameters after every round (``rounds[t][worker][param]``) and after
    ``finish()`` (``final[worker][param]``)."""

    rounds: list[list[list[torch.Tensor]]] = field(default_factory=list)
    final: list[list[torch.Tensor]] = field(default_factory=list)


def reference_run(scenario: dict[str, Any]) -> ReferenceRun:
    """Simulate ``scenario["workers"]`` workers in one process with no communication."""
    algo = scenario["algo"]
    n = scenario["workers"]
    h = scenario["sync_every"]
    seed = scenario.get("seed", 0)
    hyper = {**ALGO_DEFAULTS[algo], **scenario.get("hyper", {})}
    models = [toy_model(seed) for _ in range(n)]
    inners = [make_inner(scenario.get("inner", "sgd"), m.parameters()) for m in models]
    thetas = [trainable_params(m) for m in models]
    anchor = [p.detach().clone().float() for p in thetas[0]]
    out = ReferenceRun()

    def outer_lr() -> float:
        """α, times γ/γ₀ when the outer lr follows the inner schedule."""
        if hyper.get("outer_lr_schedule", "constant") == "constant":
            return float(hyper["outer_lr"])
        group = inners[0].param_groups[0]
        return float(hyper["outer_lr"]) * (group["lr"] / group.get("initial_lr", group["lr"]))

    def outer_sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """DiLoCo's outer optimizer: Nesterov SGD, or delayed Nesterov (``nesterov_every``)."""
        kw = {"lr": hyper["outer_lr"], "momentum": hyper["outer_momentum"]}
        if hyper.get("nesterov_every", 1) > 1:
            return DelayedNesterov(params, delay=hyper["nesterov_every"], **kw)
        return torch.optim.SGD(params, nesterov=hyper["nesterov"], **kw)

    outer = outer_sgd(anchor) if algo == "diloco" else None
    slow_m: list[torch.Tensor] | None = None
    frags: list[list[int]] = scenario.get("fragments", [list(range(len(anchor)))])
    interval = h // len(frags)
    stream_outer = [
        outer_sgd([anchor[j] for j in idx]) for idx in frags if algo in ("streaming", "cocodc")
    ]
    stream_pending: dict[int, tuple[int, list[torch.Tensor]]] = {}
    spec = hyper.get("compression")
    compressors: dict[int, RefCompression] = {}

    def pseudo_mean(
        idx: list[int], key: int = 0, anchors: list[list[torch.Tensor]] | None = None
    ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """Mean over workers of Δ = A − θ for parameters ``idx`` (compressed when asked),
        and each worker's contribution to it."""
        per = [
            [(anchors[w] if anchors else anchor)[j] - th[j].float() for j in idx]
            for w, th in enumerate(thetas)
        ]
        if spec is None:
            return [rank_order_mean([p[pos] for p in per]) for pos in range(len(idx))], per
        if key not in compressors:
            shapes = [anchor[j].shape for j in idx]
            compressors[key] = RefCompression(spec, shapes, n, stream=key)
        return compressors[key].mean(per)

    # CoCoDC: per-worker snapshots θ_s of each fragment at launch, and launch bookkeeping
    snapshots: dict[int, list[list[torch.Tensor]]] = {}
    last_launch = [0] * len(frags)

    def cocodc_choose(k: int) -> int:
        busy = {f for f, _ in stream_pending.values()}
        free = [f for f in range(len(frags)) if f not in busy]
        waits = {f: k - last_launch[f] for f in free}
        starving = [f for f in free if waits[f] >= hyper["max_wait"] * len(frags)]
        if starving:
            f = max(starving, key=lambda f: (waits[f], -f))
        elif not hyper["adaptive"]:
            rr = (k - 1) % len(frags)
            f = min(free, key=lambda f: (f - rr) % len(frags))
        else:
            per_worker = []
            for th in thetas:
                sc = torch.zeros(len(frags), dtype=torch.float64)
                for g in free:
                    norms = [torch.linalg.vector_norm(anchor[j] - th[j].float()) for j in frags[g]]
                    rms = torch.linalg.vector_norm(torch.stack(norms))
                    numel = sum(anchor[j].numel() for j in frags[g])
                    sc[g] = float(rms) / math.sqrt(numel) * waits[g]
                per_worker.append(sc)
            scores = rank_order_mean(per_worker)
            f = max(free, key=lambda g: (float(scores[g]), -g))
        last_launch[f] = k
        return f

    def stream_sync(k: int) -> None:
        f, avg = stream_pending.pop(k)
        idx = frags[f]
        for j, d in zip(idx, avg):
            anchor[j].grad = d
        stream_outer[f].param_groups[0]["lr"] = outer_lr()
        stream_outer[f].step()
        for j in idx:
            anchor[j].grad = None
        for w, th in enumerate(thetas):
            for pos, j in enumerate(idx):
                if algo == "cocodc":
                    snap = snapshots[f][w][pos]
                    g = snap - th[j].float()
                    new = anchor[j] - g
                    if hyper["lambda0"] != 0.0:
                        hh = g * g * (anchor[j] - snap)
                        if torch.linalg.vector_norm(hh) > 0:
                            lam = (
                                hyper["lambda0"]
                                * torch.linalg.vector_norm(g)
                                / torch.linalg.vector_norm(hh)
                            )
                            new = new - lam * hh
                    th[j].copy_(new)
                    continue
                local = th[j].detach().clone()
                th[j].copy_(anchor[j])
                th[j].lerp_(local, float(hyper["mix"]))

    co2 = _CO2State(
        m=[torch.zeros_like(a) for a in anchor],
        c=[torch.zeros_like(a) for a in anchor],
        u=[torch.zeros_like(a) for a in anchor],
    )

    # CO2 with fragments: one outer state per fragment, synced in turn as Streaming DiLoCo
    # (and CO2 with the delay-corrected merge, one fragment or more: θ ← A + (θ − θ_s))
    co2_merge = algo == "co2" and hyper.get("merge") == "delay_corrected"
    co2_frags = algo == "co2" and (len(frags) > 1 or co2_merge)
    frag_co2 = [
        _CO2State(
            m=[torch.zeros_like(anchor[j]) for j in idx],
            c=[torch.zeros_like(anchor[j]) for j in idx],
            u=[torch.zeros_like(anchor[j]) for j in idx],
        )
        for idx in frags
    ]

    def co2_sync_point(phase: int) -> None:
        """CO2 with fragments at inner step ``phase``: the sync point's outer step and merge."""
        if phase % interval:
            return
        k = phase // interval
        f = (k - 1) % len(frags)
        if k in stream_pending:
            launched_f, avg = stream_pending.pop(k)
            assert launched_f == f
            co2_apply(avg, [anchor[j] for j in frags[f]], frag_co2[f])
        elif co2_merge:
            return  # nothing launched: nothing to merge, θ stays
        for w, th in enumerate(thetas):
            for pos, j in enumerate(frags[f]):
                if co2_merge:  # θ ← A + (θ − θ_s)
                    th[j].copy_(anchor[j] - (snapshots[f][w][pos] - th[j].float()))
                else:  # θ_f ← A_f (unlaunched sync points: A_f unchanged)
                    th[j].copy_(anchor[j])

    eager_a = [[a.clone() for a in anchor] for _ in range(n)]
    eager_st = [
        _CO2State(
            m=[torch.zeros_like(a) for a in anchor],
            c=[torch.zeros_like(a) for a in anchor],
            u=[torch.zeros_like(a) for a in anchor],
        )
        for _ in range(n)
    ]
    eager_own: list[list[torch.Tensor]] = []

    # NoLoCo: every worker's own φ and δ; the group means launched and not yet applied
    noloco_a = [[a.clone() for a in anchor] for _ in range(n)] if algo == "noloco" else []
    noloco_m = [[torch.zeros_like(a) for a in anchor] for _ in noloco_a]
    noloco_pending: list[list[torch.Tensor]] | None = None
    noloco_applied = 0

    def noloco_launch(step: int) -> list[list[torch.Tensor]]:
        """Each worker's group mean of θ (summed in rank order, then divided)."""
        groups = noloco_groups(n, hyper["group_size"], step, hyper["group_seed"])
        of = {w: g for g in groups for w in g}
        return [
            [rank_order_mean([thetas[j][p].float() for j in of[w]]) for p in range(len(anchor))]
            for w in range(n)
        ]

    def noloco_apply(means: list[list[torch.Tensor]]) -> None:
        """δ ← μ·δ + α·(mean_G θ − φ); φ ← φ + δ; θ ← φ, per worker."""
        for w in range(n):
            for a, m, mean, p in zip(noloco_a[w], noloco_m[w], means[w], thetas[w]):
                m.mul_(hyper["outer_momentum"]).add_(mean - a, alpha=hyper["outer_lr"])
                a.add_(m)
                p.copy_(a)

    def set_all(values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for th in thetas:
                for p, v in zip(th, values):
                    p.copy_(v)

    def co2_apply(
        avg: list[torch.Tensor],
        anchor: list[torch.Tensor] = anchor,
        co2: _CO2State = co2,
    ) -> None:
        first = co2.updates == 0
        beta, gp = hyper["outer_momentum"], hyper["gap_penalty"]
        scaled = []
        for d, m, c, u in zip(avg, co2.m, co2.c, co2.u):
            if gp == "gap_aware":
                if first:
                    c.copy_(d.abs())
                else:
                    c.mul_(GAP_STAT_DECAY).add_(d.abs(), alpha=GAP_STAT_NEW)
                lam = 1.0 / ((d + u).abs() / (c + GAP_EPS)).clamp(min=1.0)
                scaled.append(lam * d)
            elif gp == "none":
                scaled.append(d.clone())
            else:
                scaled.append(d / float(gp))
            m.mul_(beta).add_(scaled[-1])
        clip = hyper["clip"]
        if clip is not None and hyper["clip_mode"] == "value":
            for m in co2.m:
                m.clamp_(-clip, clip)
        elif clip is not None:
            total = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(m) for m in co2.m])
            )
            scale = torch.clamp(clip / (total + 1e-6), max=1.0)
            for m in co2.m:
                m.mul_(scale)
        for a, m, s, u in zip(anchor, co2.m, scaled, co2.u):
            step = torch.add(s, m, alpha=beta) if hyper["nesterov"] else m
            old = a.clone()
            a.add_(step, alpha=-outer_lr())
            u.copy_(a - old)
        co2.updates += 1

    warmup = hyper["sync_warmup"]
    warm_spec = hyper.get("sync_warmup_compression")
    warm_compressors = [
        RefCompression(warm_spec, [anchor[j].shape for j in idx], n, stream=WARM_STREAM + f)
        for f, idx in enumerate(frags)
        if warm_spec is not None
    ]

    def warm_mean(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """The warm start's mean gradient: exact, or per fragment the mean of every worker's
        decoded g + e (``sync_warmup_compression``)."""
        if not warm_compressors:
            return [rank_order_mean([g[j] for g in grads]) for j in range(len(anchor))]
        out: list[torch.Tensor] = [torch.empty(0)] * len(anchor)
        for comp, idx in zip(warm_compressors, frags):
            means, _ = comp.mean([[g[j] for j in idx] for g in grads])
            for j, m in zip(idx, means):
                out[j] = m
        return out

    for step in range(1, scenario["steps"] + 1):
        for w in range(n):
            schedule_lr(inners[w], step, scenario)
            if step > warmup:
                inner_step(models[w], inners[w], w, step, seed)
        if step <= warmup:
            # warm start: DDP's step, every worker with the mean gradient; anchors follow θ
            for w in range(n):
                toy_backward(models[w], w, step, seed)
            with torch.no_grad():
                mean_grads = warm_mean([[_grad(p) for p in th] for th in thetas])
                for w in range(n):
                    for param, mean_g in zip(thetas[w], mean_grads):
                        param.grad = mean_g.clone()
                    inners[w].step()
                    inners[w].zero_grad()
                for anchors in [anchor, *eager_a, *noloco_a]:
                    for dst, src in zip(anchors, thetas[0]):
                        dst.copy_(src)
            if step % h == 0:
                out.rounds.append([[p.detach().clone() for p in th] for th in thetas])
            continue
        phase = step - warmup  # the schedule starts after the warm start
        if algo in ("streaming", "cocodc"):
            with torch.no_grad():
                tau = hyper["overlap"]
                # at τ = H (CoCoDC) the fragment's sync lands before it launches again
                due = phase % interval == 0 and phase - tau >= 1
                if due and tau >= h:
                    stream_sync(phase // interval)
                if (phase + tau) % interval == 0:
                    k = (phase + tau) // interval
                    f = cocodc_choose(k) if algo == "cocodc" else (k - 1) % len(frags)
                    snapshots[f] = [
                        [th[j].detach().float().clone() for j in frags[f]] for th in thetas
                    ]
                    stream_pending[k] = (f, pseudo_mean(frags[f], f)[0])
                if due and tau < h:
                    stream_sync(phase // interval)
        if co2_frags:
            with torch.no_grad():
                tau = h if hyper.get("overlap") is None else hyper["overlap"]
                # with the merge at τ = H, the sync point applies before it launches
                apply_first = co2_merge and tau >= h
                if apply_first:
                    co2_sync_point(phase)
                if (phase + tau) % interval == 0:
                    k = (phase + tau) // interval
                    f = (k - 1) % len(frags)
                    if co2_merge:
                        snapshots[f] = [
                            [th[j].detach().float().clone() for j in frags[f]] for th in thetas
                        ]
                    stream_pending[k] = (f, pseudo_mean(frags[f], f)[0])
                if not apply_first:
                    co2_sync_point(phase)
            if phase % h == 0:
                out.rounds.append([[p.detach().clone() for p in th] for th in thetas])
            continue
        if algo == "noloco":
            with torch.no_grad():
                tau = hyper["overlap"]
                if (phase + tau) % h == 0:
                    noloco_pending = noloco_launch(phase + tau)
                if phase % h == 0 and noloco_pending is not None:
                    noloco_apply(noloco_pending)
                    noloco_pending = None
                    noloco_applied += 1
                    out.rounds.append([[p.detach().clone() for p in th] for th in thetas])
            continue
        co2_tau = h if hyper.get("overlap") is None else hyper["overlap"]
        if algo == "co2" and co2_tau < h and (phase + co2_tau) % h == 0:
            with torch.no_grad():  # launched τ steps before the round ends
                co2.pending = pseudo_mean(list(range(len(anchor))))[0]
        if phase % h:
            continue
        with torch.no_grad():
            if algo == "localsgd":
                mean = [
                    rank_order_mean([th[j].float() for th in thetas]) for j in range(len(anchor))
                ]
                set_all(mean)
            elif algo in ("diloco", "slowmo"):
                avg = pseudo_mean(list(range(len(anchor))))[0]
                if algo == "diloco":
                    assert outer is not None
                    for a, d in zip(anchor, avg):
                        a.grad = d
                    outer.param_groups[0]["lr"] = outer_lr()
                    outer.step()
                    for a in anchor:
                        a.grad = None
                else:
                    gamma = inners[0].param_groups[0]["lr"]
                    g = [d / gamma for d in avg]
                    if slow_m is None:
                        slow_m = [gi.clone() for gi in g]
                    else:
                        for m, gi in zip(slow_m, g):
                            m.mul_(hyper["outer_momentum"]).add_(gi)
                    for a, m in zip(anchor, slow_m):
                        a.add_(m, alpha=-(hyper["outer_lr"] * gamma))
                set_all(anchor)
            elif algo in ("streaming", "cocodc"):
                pass  # synced above, fragment by fragment
            elif algo == "co2" and hyper["eager"]:
                # every worker has its own anchor: Δᵢ/N fresh + (Δ̄ − Δᵢ_prev/N) stale
                launched, own = pseudo_mean(list(range(len(anchor))), anchors=eager_a)
                for w in range(n):
                    e = [_part(d, n, hyper["own_weight"]) for d in own[w]]
                    if co2.pending is not None:
                        e = [
                            x + (p - _part(q, n, hyper["own_weight"]))
                            for x, p, q in zip(e, co2.pending, eager_own[w])
                        ]
                    co2_apply(e, eager_a[w], eager_st[w])
                    for p, a in zip(thetas[w], eager_a[w]):
                        p.copy_(a)
                eager_own[:] = own
                co2.pending = launched
            elif algo == "co2" and co2_tau < h:
                assert co2.pending is not None
                co2_apply(co2.pending)
                co2.pending = None
                set_all(anchor)
            elif algo == "co2":
                launched = pseudo_mean(list(range(len(anchor))))[0]
                if co2.pending is not None:
                    co2_apply(co2.pending)
                co2.pending = launched
                set_all(anchor)
            else:
                raise ValueError(f"no reference for {algo!r}")
        out.rounds.append([[p.detach().clone() for p in th] for th in thetas])

    with torch.no_grad():
        if algo == "co2" and hyper["eager"]:
            if co2.pending is not None:
                for w in range(n):
                    e = [
                        p - _part(q, n, hyper["own_weight"])
                        for p, q in zip(co2.pending, eager_own[w])
                    ]
                    co2_apply(e, eager_a[w], eager_st[w])
                mean = [rank_order_mean([wa[j] for wa in eager_a]) for j in range(len(anchor))]
                for wa in eager_a:
                    for x, v in zip(wa, mean):
                        x.copy_(v)
            anchor = eager_a[0]
        elif algo == "co2" and co2.pending is not None:
            co2_apply(co2.pending)
        for k in sorted(stream_pending):
            if co2_frags:
                launched_f, avg = stream_pending.pop(k)
                co2_apply(avg, [anchor[j] for j in frags[launched_f]], frag_co2[launched_f])
            else:
                stream_sync(k)
        if algo == "noloco":
            if noloco_pending is not None:
                noloco_apply(noloco_pending)
                noloco_applied += 1
            # finish(): the ranks agree on the mean of their φ (once any sync was applied)
            per_worker = noloco_a
            if noloco_applied:
                mean = [rank_order_mean([wa[j] for wa in noloco_a]) for j in range(len(anchor))]
                per_worker = [mean] * n
            for th, values in zip(thetas, per_worker):
                for p, v in zip(th, values):
                    p.copy_(v)
        elif algo != "localsgd":
            set_all(anchor)
        elif scenario["steps"] > warmup and (scenario["steps"] - warmup) % h:
            set_all([rank_order_mean([th[j].float() for th in thetas]) for j in range(len(anchor))])
    out.final = [[p.detach().clone() for p in th] for th in thetas]
    return out
