"""Dynamic local steps (:mod:`lowcomm.outer.pace`) on real gloo ranks and in a single-process
reference. The ranks' speeds are emulated by the clock their step times are read from: rank
j's inner steps each last ``costs[j]`` (exact binary fractions, so every mean is exact and the
plans are the same on every run); the schedule logic is all that is emulated."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from lowcomm.outer.pace import plan_steps, steps_through
from lowcomm.registry import REGISTRY
from lowcomm.testing.reference import inner_step, make_inner, toy_batch, toy_model

__all__ = ["pace_reference_diloco", "pace_runs"]


def _clock(cost: float) -> Callable[[], float]:
    ticks = itertools.count(0.0, cost)
    return lambda: next(ticks)


def _build(sc: dict[str, Any], rank: int) -> tuple[torch.nn.Module, Any, Any]:
    model = toy_model(sc.get("seed", 0))
    inner = make_inner(sc.get("inner", "sgd"), model.parameters())
    entry = REGISTRY[sc["algo"]]
    assert entry.cls is not None
    kwargs = {**entry.fixed, **sc.get("hyper", {}), "local_steps": sc["local_steps"]}
    if kwargs.pop("by_layer", False):  # one fragment per linear layer of the toy MLP
        layers = list(model.children())
        kwargs["fragments"] = [layers[0], layers[2]]
    algo = entry.cls(model, inner, **kwargs)
    if algo.pace is not None:
        algo.pace.clock = _clock(sc["costs"][rank])
    return model, inner, algo


def _run(rank: int, sc: dict[str, Any]) -> dict[str, Any]:
    model, inner, algo = _build(sc, rank)
    taken = 0
    lrs: list[float] = []
    for position in range(1, sc["positions"] + 1):
        if position == sc.get("cut"):
            # resume: everything rebuilt from the state dicts, as a restarted job does
            states = (model.state_dict(), inner.state_dict(), algo.state_dict())
            model, inner, algo = _build(sc, rank)
            model.load_state_dict(states[0])
            inner.load_state_dict(states[1])
            algo.load_state_dict(states[2])
        lrs.append(algo.steps_done(including_next=True))
        if algo.takes_step():
            taken += 1
            inner_step(model, inner, rank, taken, sc.get("seed", 0))
        algo.step()
    algo.finish()
    report = algo.pace.report(algo.local_step) if algo.pace is not None else None
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "taken": taken,
        "steps_done": lrs,
        "report": report,
    }


def pace_runs(rank: int, world_size: int, scenarios: list[dict[str, Any]]) -> list[dict]:
    """Every scenario on this rank (run by :func:`lowcomm.procs.workers.run_workers`)."""
    return [_run(rank, sc) for sc in scenarios]


def pace_reference_diloco(sc: dict[str, Any], world: int) -> dict[str, Any]:
    """DiLoCo with dynamic local steps, all ranks in one process, written from the definition:
    round 1 takes H steps on every rank, every later round the plan of the measured costs
    (rank j steps at position p iff ⌊p·h/H⌋ > ⌊(p−1)·h/H⌋); in the warm start (``sync_warmup``
    K) every rank takes each step with the mean gradient of the ranks that stepped; after it
    the outer Nesterov step is taken with Σ_j (n_j / Σ n) Δ_j (``sc["unweighted"]``: with
    their plain mean, to show that the weights matter)."""
    hyper = sc.get("hyper", {})
    h, warm = int(hyper["sync_every"]), int(hyper.get("sync_warmup", 0))
    lr, momentum = hyper.get("outer_lr", 0.7), hyper.get("outer_momentum", 0.9)
    seed = sc.get("seed", 0)
    models = [toy_model(seed) for _ in range(world)]
    inners = [make_inner(sc.get("inner", "sgd"), m.parameters()) for m in models]
    taken = [0] * world
    for rnd in range(1, warm // h + 1):
        plan = [h] * world if rnd == 1 else plan_steps(list(sc["costs"]), h)
        for p in range(1, h + 1):
            stepped = [n for n in range(world) if _steps(p, plan[n], h)]
            grads = []
            for n in stepped:
                taken[n] += 1
                x, y = toy_batch(n, taken[n], seed)
                torch.nn.functional.mse_loss(models[n](x), y).backward()
                grads.append([q.grad.clone() for q in models[n].parameters()])  # type: ignore[union-attr]
                models[n].zero_grad()
            mean = [torch.stack(gs).sum(0) / len(stepped) for gs in zip(*grads)]
            for m, inner in zip(models, inners):
                for q, g in zip(m.parameters(), mean):
                    q.grad = g.clone()
                inner.step()
                inner.zero_grad()
    anchor = [p.detach().clone() for p in models[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=True)
    for rnd in range(warm // h + 1, sc["positions"] // h + 1):
        plan = [h] * world if rnd == 1 else plan_steps(list(sc["costs"]), h)
        counts = [0] * world
        for p, n in itertools.product(range(1, h + 1), range(world)):
            if _steps(p, plan[n], h):
                taken[n] += 1
                counts[n] += 1
                inner_step(models[n], inners[n], n, taken[n], seed)
        if sc.get("unweighted"):
            counts = [1] * world
        total = sum(counts)
        with torch.no_grad():
            for i, a in enumerate(anchor):
                deltas = [a - list(m.parameters())[i] for m in models]
                a.grad = torch.stack([d * (c / total) for d, c in zip(deltas, counts)]).sum(0)
        outer.step()
        with torch.no_grad():
            for m in models:
                for q, a in zip(m.parameters(), anchor):
                    q.copy_(a)
    return {"params": anchor, "taken": taken}


def _steps(p: int, n: int, h: int) -> bool:
    return steps_through(p, n, h) > steps_through(p - 1, n, h)
