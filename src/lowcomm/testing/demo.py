"""DeMo's single-process reference (N simulated workers) and its real multi-rank counterpart, on
the toy problem of :mod:`lowcomm.testing.reference`.

The reference keeps each worker's residual m per tensor, takes the same per-tensor math as the
optimizer (:func:`~lowcomm.optim.demo.demo_compress`, :func:`~lowcomm.optim.demo.demo_decode`,
pinned on their own against the DCT's definition) and exchanges nothing: the "all-gather" is the
list of every worker's indices and values in worker order. What it checks in the real optimizer
is everything around that math: flat buckets of every parameter, int32 indices, one pair of
all-gathers, slicing the gathered buffers back per parameter and rank, the one-step-late
``overlap`` and the state kept between steps. A scenario::

    {"workers": 2, "steps": 6, "lr": 0.01, "topk": 2, "chunk": 4, "decay": 0.9,
     "weight_decay": 0.1, "overlap": False, "seed": 0}
"""

from __future__ import annotations

from typing import Any

import torch

from lowcomm.optim.dct import ChunkPlan
from lowcomm.optim.demo import DeMo, demo_compress, demo_decode
from lowcomm.testing.reference import toy_batch, toy_model

__all__ = ["demo_distributed_run", "demo_reference_run"]


def _backward(model: torch.nn.Module, worker: int, step: int, seed: int) -> None:
    """The toy problem's gradients (the reference's inner step, without the optimizer)."""
    x, y = toy_batch(worker, step, seed)
    torch.nn.functional.mse_loss(model(x), y).backward()


DEFAULTS: dict[str, Any] = {
    "steps": 6,
    "lr": 0.01,
    "topk": 2,
    "chunk": 4,
    "decay": 0.9,
    "weight_decay": 0.1,
    "overlap": False,
    "seed": 0,
    "cut": None,
}


def _sc(scenario: dict[str, Any]) -> dict[str, Any]:
    return {**DEFAULTS, **scenario}


def demo_reference_run(scenario: dict[str, Any]) -> list[list[list[torch.Tensor]]]:
    """Every worker's parameters after every step: ``out[step][worker][param]``."""
    sc = _sc(scenario)
    n, lr = sc["workers"], sc["lr"]
    models = [toy_model(sc["seed"]) for _ in range(n)]
    params = [list(m.parameters()) for m in models]
    plans = [ChunkPlan.for_shape(p.shape, sc["chunk"]) for p in params[0]]
    residual = [[torch.zeros_like(p) for p in ps] for ps in params]
    pending: list[torch.Tensor] | None = None  # overlap: the decoded Q of the last step
    out = []
    with torch.no_grad():
        for step in range(1, sc["steps"] + 1):
            for w in range(n):
                with torch.enable_grad():
                    _backward(models[w], w, step, sc["seed"])
            if pending is not None:
                for ps in params:
                    for p, late in zip(ps, pending):
                        p.add_(torch.sign(late), alpha=-lr)
                pending = None
            sent: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
            for w in range(n):
                mine = []
                for p, m, plan in zip(params[w], residual[w], plans):
                    p.mul_(1.0 - lr * sc["weight_decay"])
                    assert p.grad is not None
                    m.mul_(sc["decay"]).add_(p.grad, alpha=lr)
                    idx, val, transmitted = demo_compress(m, plan, sc["topk"])
                    m.sub_(transmitted)
                    mine.append((idx.to(torch.int32), val))
                    p.grad = None
                sent.append(mine)
            decoded = [
                demo_decode(
                    [sent[w][j][0] for w in range(n)], [sent[w][j][1] for w in range(n)], plan
                )
                for j, plan in enumerate(plans)
            ]
            if sc["overlap"]:
                pending = decoded
            else:
                for ps in params:
                    for p, qj in zip(ps, decoded):
                        p.add_(torch.sign(qj), alpha=-lr)
            out.append([[p.detach().clone() for p in ps] for ps in params])
        if pending is not None:  # finish()
            for ps in params:
                for p, late in zip(ps, pending):
                    p.add_(torch.sign(late), alpha=-lr)
            out.append([[p.detach().clone() for p in ps] for ps in params])
    return out


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad.detach().clone()


def _build(sc: dict[str, Any]) -> tuple[torch.nn.Module, DeMo]:
    model = toy_model(sc["seed"])
    opt = DeMo(
        model.parameters(),
        lr=sc["lr"],
        compression_decay=sc["decay"],
        compression_topk=sc["topk"],
        compression_chunk=sc["chunk"],
        weight_decay=sc["weight_decay"],
        overlap=sc["overlap"],
    )
    return model, opt


def demo_distributed_run(rank: int, world_size: int, scenarios: list[dict[str, Any]]) -> list[dict]:
    """Worker function for :func:`lowcomm.testing.run_workers`: each scenario with the real
    :class:`~lowcomm.optim.DeMo` on this rank; per scenario the parameters after every step
    (and after ``finish()`` with ``overlap``), the gradients of every step and the counters.
    With ``cut`` the optimizer and model are saved after that step and restored into fresh
    objects."""
    import io

    results = []
    for scenario in scenarios:
        sc = _sc(scenario)
        assert sc["workers"] == world_size
        model, opt = _build(sc)
        steps, grads = [], []
        for step in range(1, sc["steps"] + 1):
            _backward(model, rank, step, sc["seed"])
            grads.append([_grad(p) for p in model.parameters()])
            opt.step()
            opt.zero_grad()
            steps.append([p.detach().clone() for p in model.parameters()])
            if step == sc["cut"]:
                buf = io.BytesIO()
                torch.save({"m": model.state_dict(), "o": opt.state_dict()}, buf)
                buf.seek(0)
                saved = torch.load(buf, weights_only=True)
                model, opt = _build(sc)
                model.load_state_dict(saved["m"])
                opt.load_state_dict(saved["o"])
        if sc["overlap"]:
            opt.finish()
            steps.append([p.detach().clone() for p in model.parameters()])
        results.append(
            {
                "steps": steps,
                "grads": grads,
                "stats": opt.stats.as_dict(),
                "bytes_per_step": opt.bytes_per_step(),
            }
        )
    return results
