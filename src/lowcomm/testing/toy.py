"""The toy problem both sides of the equivalence tests train (:mod:`lowcomm.testing.reference`):
a small MLP, every worker's batches, the inner optimizer and the inner step the references and
the real algorithms take alike, and the real algorithms' run of it on a recording communicator
(:func:`distributed_run`)."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch import nn

__all__ = [
    "distributed_run",
    "inner_step",
    "make_inner",
    "schedule_lr",
    "toy_backward",
    "toy_batch",
    "toy_model",
    "trainable_params",
]


def toy_model(seed: int = 0) -> nn.Module:
    """A small MLP with parameters of several shapes (so buckets split them)."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def toy_batch(worker: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s batch at inner step ``step``: different on every worker and step."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 10_007 * worker + step)
    x = torch.randn(4, 6, generator=g)
    y = torch.randn(4, 3, generator=g)
    return x, y


def make_inner(kind: str, params: Any) -> torch.optim.Optimizer:
    """The inner optimizer of the toy problem: ``"sgd"`` (lr 0.1) or ``"adamw"`` (lr 0.01)."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01)
    raise ValueError(f"unknown inner optimizer {kind!r}")


def inner_step(
    model: nn.Module, inner: torch.optim.Optimizer, worker: int, step: int, seed: int
) -> None:
    """One inner step of worker ``worker`` at step ``step`` on the toy problem: MSE loss of
    ``model`` on :func:`toy_batch` ``(worker, step, seed)``, backward, ``inner.step()``, gradients
    zeroed. The references and the real algorithms' test runs take exactly this step, so their
    parameters can be compared bit for bit.

    Example::

        model = toy_model()
        inner = make_inner("sgd", model.parameters())
        for step in range(1, 4):
            inner_step(model, inner, worker=0, step=step, seed=0)
    """
    toy_backward(model, worker, step, seed)
    inner.step()
    inner.zero_grad()


def toy_backward(model: nn.Module, worker: int, step: int, seed: int) -> None:
    """The toy problem's gradients: MSE of ``model`` on worker ``worker``'s batch at ``step``."""
    x, y = toy_batch(worker, step, seed)
    nn.functional.mse_loss(model(x), y).backward()


def schedule_lr(inner: torch.optim.Optimizer, step: int, scenario: dict[str, Any]) -> None:
    """``scenario["lr_decay"]``: the inner lr becomes initial_lr · decay^step (SlowMo and an
    outer lr that follows the inner schedule read it)."""
    decay = scenario.get("lr_decay")
    if decay is None:
        return
    for group in inner.param_groups:
        base = group.setdefault("initial_lr", group["lr"])
        group["lr"] = base * decay**step


def trainable_params(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def distributed_run(rank: int, world_size: int, scenarios: list[dict[str, Any]]) -> list[dict]:
    """Worker function for :func:`lowcomm.testing.run_workers`: run each scenario with the real
    algorithm class on this rank and return, per scenario, the parameters after every round,
    after ``finish()``, the schedule of the recording communicator and the counters."""
    from lowcomm.registry import ALGORITHMS
    from lowcomm.testing.recording import RecordingCommunicator

    results = []
    for sc in scenarios:
        assert sc["workers"] == world_size
        seed = sc.get("seed", 0)
        model = toy_model(seed)
        inner = make_inner(sc.get("inner", "sgd"), model.parameters())
        comm = RecordingCommunicator()
        extra: dict[str, Any] = {}
        if "fragments" in sc:
            params = trainable_params(model)
            extra["fragments"] = [[params[i] for i in idx] for idx in sc["fragments"]]
        algo = ALGORITHMS[sc["algo"]](
            model,
            inner,
            sync_every=sc["sync_every"],
            process_group=comm,
            bucket_cap_mb=sc.get("bucket_cap_mb", 25.0),
            **sc.get("hyper", {}),
            **extra,
        )
        comm.clock = functools.partial(getattr, algo, "local_step")
        rounds = []
        for step in range(1, sc["steps"] + 1):
            schedule_lr(inner, step, sc)
            inner_step(model, inner, rank, step, seed)
            algo.step()
            if step % sc["sync_every"] == 0:
                rounds.append([p.detach().clone() for p in trainable_params(model)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a partial last round is part of some scenarios
            algo.finish()
        results.append(
            {
                "rounds": rounds,
                "final": [p.detach().clone() for p in trainable_params(model)],
                "events": list(comm.events),
                "stats": algo.stats.as_dict(),
                "buckets": sum(len(f.anchor.buffers) for f in algo.fragments),
            }
        )
    return results
