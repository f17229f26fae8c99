"""The delay-corrected merge (CoCoDC with ``lambda0=0``, CO2 with ``merge="delay_corrected"``;
LOSCAR-SGD, arXiv 2605.20866) in its degenerate form, on real gloo ranks, checked against the
paper's formula rather than against a reference written the same way as the implementation:
with an outer SGD step of lr 1 and no momentum, at every sync point of fragment p each rank's
parameters move by

    θᵢ ← θᵢ + (ȳ − yᵢ)        (yᵢ: rank i's fragment at the launch, ȳ their mean)

so the mean of the ranks' parameters stays where it was, and each rank keeps the progress it
made since the launch. Checked at full overlap (τ = H: every fragment in flight a whole round),
at τ = H/P and below.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lowcomm.testing import run_workers
from lowcomm.testing.reference import inner_step, make_inner, toy_model

H, P = 4, 2
INTERVAL = H // P
STEPS = 5 * H
FRAGMENTS = [[0, 1], [2, 3]]


def merge_trace(rank: int, world: int, algo_name: str, overlap: int) -> dict[str, Any]:
    """Train CoCoDC (λ₀ 0, round-robin) or CO2 (``merge="delay_corrected"``, no clip or
    penalty), both with an outer step of lr 1 and no momentum, on the toy problem, recording
    the parameters before and after ``algo.step()`` at every sync point."""
    import lowcomm

    model = toy_model(3)
    params = list(model.parameters())
    inner = make_inner("adamw", params)
    common = {
        "sync_every": H,
        "fragments": [[params[j] for j in f] for f in FRAGMENTS],
        "overlap": overlap,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "nesterov": False,
    }
    if algo_name == "cocodc":
        algo = lowcomm.CoCoDC(model, inner, lambda0=0.0, adaptive=False, **common)
    else:
        extra = {"merge": "delay_corrected", "clip": None, "gap_penalty": "none"}
        algo = lowcomm.CO2(model, inner, **extra, **common)
    snaps: dict[int, list[torch.Tensor]] = {}
    before: dict[int, list[torch.Tensor]] = {}
    after: dict[int, list[torch.Tensor]] = {}
    for step in range(1, STEPS + 1):
        inner_step(model, inner, rank, step, 3)
        if step % INTERVAL == 0:
            before[step] = [p.detach().clone() for p in params]
        algo.step()
        if step % INTERVAL == 0 or (step + overlap) % INTERVAL == 0:
            after[step] = [p.detach().clone() for p in params]
        if (step + overlap) % INTERVAL == 0:
            # the launch snapshots its fragment after this step's merge (a different fragment's
            # at τ < H; at τ = H the same one's, applied first): y for the sync at step + τ
            snaps[step + overlap] = after[step]
    algo.finish()
    return {"before": before, "after": after, "snaps": snaps}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "algo,workers,overlap",
    [("cocodc", 2, H), ("cocodc", 3, H), ("cocodc", 2, INTERVAL), ("co2", 2, H), ("co2", 3, 1)],
)
def test_delay_corrected_merge_keeps_the_mean_and_each_ranks_progress(
    algo: str, workers: int, overlap: int
) -> None:
    traces = run_workers(merge_trace, workers, algo, overlap)
    checked = 0
    for step in range(INTERVAL, STEPS + 1, INTERVAL):
        k = step // INTERVAL
        frag = FRAGMENTS[(k - 1) % P]
        launched = step - overlap >= 1
        for i, t in enumerate(traces):
            for j, (b, a) in enumerate(zip(t["before"][step], t["after"][step])):
                if j not in frag or not launched:
                    assert torch.equal(a, b), (step, i, j)  # nothing else moves
                    continue
                ys = [tr["snaps"][step][j] for tr in traces]
                y_bar = sum(ys) / workers
                torch.testing.assert_close(a, b + (y_bar - ys[i]), rtol=1e-5, atol=1e-6)
        if not launched:
            continue
        for j in frag:
            mean_before = sum(t["before"][step][j] for t in traces) / workers
            mean_after = sum(t["after"][step][j] for t in traces) / workers
            torch.testing.assert_close(mean_after, mean_before, rtol=1e-5, atol=1e-6)
            # not vacuous: the ranks' snapshots differ, and each moved since its launch
            ys = [t["snaps"][step][j] for t in traces]
            assert not torch.equal(ys[0], ys[1])
            assert not torch.equal(traces[0]["before"][step][j], ys[0])
        checked += 1
    assert checked >= STEPS // INTERVAL - P
