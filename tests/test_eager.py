"""Eager updates (CO2 ``eager=True``; Kale et al. 2025, arXiv 2502.12996) in their degenerate
forms, on real gloo ranks, checked against other algorithms and the paper's formula rather than
against a reference written the same way as the implementation:

* on one worker the others' stale part is empty, so eager CO2 is synchronous DiLoCo;
* on several, with outer lr 1 and no momentum, every worker's anchor moves by exactly
  Δᵢᵗ/N + Δ̄ᵗ⁻¹ − Δᵢᵗ⁻¹/N (its own fresh pseudo-gradient and the others' from a round ago), with
  Δᵢᵗ = Aᵢᵗ − xᵢᵗ measured from the parameters each rank held before and after every sync.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lowcomm.testing import run_workers
from lowcomm.testing.reference import distributed_run, inner_step, make_inner, toy_model

H = 3
ROUNDS = 5


def _scenario(algo: str, hyper: dict[str, Any], workers: int) -> dict[str, Any]:
    return {
        "algo": algo,
        "workers": workers,
        "sync_every": H,
        "steps": H * ROUNDS,
        "seed": 3,
        "inner": "adamw",
        "hyper": hyper,
    }


@pytest.mark.timeout(120)
def test_eager_co2_on_one_worker_is_synchronous_diloco() -> None:
    alpha = 0.7
    eager = _scenario(
        "co2",
        {
            "eager": True,
            "outer_lr": alpha,
            "outer_momentum": 0.0,
            "clip": None,
            "gap_penalty": "none",
        },
        1,
    )
    diloco = _scenario("diloco", {"outer_lr": alpha, "outer_momentum": 0.0, "nesterov": False}, 1)
    (results,) = run_workers(distributed_run, 1, [eager, diloco])
    got, want = results
    # every round: the eager input Δ/1 + (Δ̄ᵗ⁻¹ − Δᵗ⁻¹/1) is exactly this round's Δ, so the outer
    # SGD step is DiLoCo's (A ← A − αΔ) and θ restarts from it, bit for bit
    assert len(got["rounds"]) == len(want["rounds"]) == ROUNDS
    for mine, theirs in zip([*got["rounds"], got["final"]], [*want["rounds"], want["final"]]):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    # and it trained: the parameters moved
    first = toy_model(3)
    assert any(not torch.equal(p, q) for p, q in zip(got["final"], first.parameters()))


def eager_trace(rank: int, world: int) -> dict[str, Any]:
    """Train eager CO2 (α 1, β 0, no clip or penalty) on the toy problem and record, at every
    round boundary, the parameters before ``algo.step()`` (xᵢ, the end of the round's inner
    steps) and after it (the new anchor Aᵢ, which θ restarts from)."""
    import lowcomm

    model = toy_model(3)
    inner = make_inner("adamw", model.parameters())
    algo = lowcomm.CO2(
        model,
        inner,
        sync_every=H,
        eager=True,
        outer_lr=1.0,
        outer_momentum=0.0,
        clip=None,
        gap_penalty="none",
    )
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    before, after = [], []
    for step in range(1, H * ROUNDS + 1):
        inner_step(model, inner, rank, step, 3)
        if step % H == 0:
            before.append([p.detach().clone() for p in params])
        algo.step()
        if step % H == 0:
            after.append([p.detach().clone() for p in params])
    algo.finish()
    return {"start": start, "before": before, "after": after}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [2, 3])
def test_eager_anchor_moves_by_its_own_fresh_delta_and_the_others_stale_ones(
    workers: int,
) -> None:
    traces = run_workers(eager_trace, workers)
    n = workers
    anchors = [[t["start"], *t["after"]] for t in traces]  # Aᵢ⁰, Aᵢ¹, …
    deltas = [
        [[a - x for a, x in zip(anchors[i][t], traces[i]["before"][t])] for t in range(ROUNDS)]
        for i in range(n)
    ]  # Δᵢᵗ = Aᵢᵗ − xᵢᵗ
    for t in range(ROUNDS):
        mean_prev = (
            [sum(deltas[j][t - 1][k] for j in range(n)) / n for k in range(len(deltas[0][0]))]
            if t > 0
            else None
        )
        for i in range(n):
            for k, a in enumerate(anchors[i][t]):
                step = deltas[i][t][k] / n
                if mean_prev is not None:
                    step = step + mean_prev[k] - deltas[i][t - 1][k] / n
                torch.testing.assert_close(anchors[i][t + 1][k], a - step, rtol=1e-5, atol=1e-6)
    # the anchors differ across workers (each took its own fresh delta), and the others' part
    # arrived: the mean anchor is not any one worker's own trajectory
    assert not all(torch.equal(a, b) for a, b in zip(anchors[0][ROUNDS], anchors[1][ROUNDS]))
