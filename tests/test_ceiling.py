"""The no-sync ceiling of ``lowcomm train --ceiling-steps`` (``lowcomm.train.ceiling``): its
segments interleaved with training, placed where no sync is in flight, on a real one-rank gloo
group; the training's random state untouched."""

from __future__ import annotations

import types

import pytest
import torch

from lowcomm.train.ceiling import Ceiling, segment_plan
from lowcomm.train.config import TrainConfig
from lowcomm.train.model import build_gpt

pytestmark = pytest.mark.usefixtures("single_rank_group")


@pytest.mark.parametrize(
    ("ceiling_steps", "steps", "sizes", "due", "start"),
    [
        (0, 96, [], [], 0),
        (1, 96, [1], [], 0),  # one step: before training only
        (2, 96, [1, 1], [], 0),  # before and after, as a short job's ceiling always was
        (5, 6, [2, 2, 1], [3], 0),
        (16, 96, [2] * 8, [14, 27, 41, 55, 69, 82], 0),  # spread evenly over the run
        (3, 2, [2, 1], [], 0),
        (16, 96, [2] * 8, [55, 62, 69, 75, 82, 89], 48),  # resumed after step 48
    ],
)
def test_segments_are_spread_over_the_run(
    ceiling_steps: int, steps: int, sizes: list[int], due: list[int], start: int
) -> None:
    assert segment_plan(ceiling_steps, steps, start) == (sizes, due)
    assert sum(sizes) == ceiling_steps


def test_a_segment_runs_when_due_and_idle_and_leaves_training_alone() -> None:
    cfg = TrainConfig(
        steps=12, ceiling_steps=5, n_layer=1, n_head=2, n_embd=16, block_size=8, batch_size=2,
        dropout=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    gpt = build_gpt(cfg, 32)
    gpt.train()
    before_params = [p.detach().clone() for p in gpt.parameters()]
    corpus = types.SimpleNamespace(train=torch.arange(200) % 32)
    rng = torch.get_rng_state()
    ceiling = Ceiling(gpt, cfg, corpus, 0, torch.device("cpu"))
    ceiling.before()
    assert [n for n, _ in ceiling.segments] == [2]
    # due after step 6 (the middle of 12): not before it, not while a sync is in flight
    assert ceiling.during(5, idle=True) == 0.0
    assert ceiling.during(6, idle=False) == 0.0
    assert ceiling.during(7, idle=False) == 0.0
    seconds = ceiling.during(8, idle=True)
    assert seconds > 0 and [n for n, _ in ceiling.segments] == [2, 2]
    assert seconds >= ceiling.segments[-1][1]  # the segment's steps (no barrier: its own)
    assert ceiling.during(9, idle=True) == 0.0  # the last segment waits for the end
    ceiling.after()
    assert [n for n, _ in ceiling.segments] == [2, 2, 1]
    summary = ceiling.summary(tokens_per_step=16)
    assert summary["steps"] == 5 and len(summary["segments_tokens_per_s"]) == 3
    # the ceiling trained its own copy with dropout, drawing nothing from the global generator
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(before_params, gpt.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(before_params, ceiling.model.parameters()))


def test_a_job_that_is_never_idle_times_its_segments_after_training() -> None:
    cfg = TrainConfig(steps=8, ceiling_steps=6, n_layer=1, n_head=2, n_embd=16, block_size=8)
    torch.manual_seed(0)
    ceiling = Ceiling(
        build_gpt(cfg, 32), cfg, types.SimpleNamespace(train=torch.arange(200) % 32), 0,
        torch.device("cpu"),
    )  # fmt: skip
    ceiling.before()
    assert all(ceiling.during(step, idle=False) == 0.0 for step in range(1, 9))
    ceiling.after()  # the one due after step 4, and the last
    assert [n for n, _ in ceiling.segments] == [2, 2, 2]


def test_the_ceiling_is_the_slowest_ranks() -> None:
    cfg = TrainConfig(steps=8, ceiling_steps=4, n_layer=1, n_head=2, n_embd=16, block_size=8)
    ceiling = Ceiling(
        build_gpt(cfg, 32), cfg, types.SimpleNamespace(train=torch.arange(200) % 32), 0,
        torch.device("cpu"),
    )  # fmt: skip
    ceiling.segments = [(2, 1.0), (2, 1.0)]
    everyone = [[(2, 1.0), (2, 1.0)], [(2, 0.5), (2, 2.0)], [(2, 1.5), (2, 0.25)]]
    summary = ceiling.summary(tokens_per_step=100, everyone=everyone)
    # overall: the rank slowest in all (2.5 s for 4 steps); per segment: its slowest rank
    assert summary["tokens_per_s"] == 4 * 100 / 2.5
    assert summary["segments_tokens_per_s"] == [2 * 100 / 1.5, 2 * 100 / 2.0]
    assert ceiling.summary(tokens_per_step=100)["tokens_per_s"] == 4 * 100 / 2.0  # this rank's
    with pytest.raises(ValueError, match="same ceiling segments"):
        ceiling.summary(tokens_per_step=100, everyone=[[(2, 1.0), (2, 1.0)], [(4, 1.0)]])


def _unaligned_worker(rank: int, world_size: int) -> dict:
    """Two ranks, the second 0.5 s behind when its middle segment is due."""
    import time

    cfg = TrainConfig(steps=4, ceiling_steps=6, n_layer=1, n_head=2, n_embd=16, block_size=8)
    torch.manual_seed(0)
    ceiling = Ceiling(
        build_gpt(cfg, 32), cfg, types.SimpleNamespace(train=torch.arange(200) % 32), rank,
        torch.device("cpu"),
    )  # fmt: skip
    ceiling.before()
    if rank == 1:
        time.sleep(0.5)
    t0 = time.perf_counter()
    excluded = ceiling.during(2, idle=True)
    took = time.perf_counter() - t0
    ceiling.after()
    return {"excluded": excluded, "took": took, "segment": ceiling.segments[1][1]}


@pytest.mark.timeout(120)
def test_middle_segments_do_not_line_the_ranks_up() -> None:
    from lowcomm.procs.workers import run_workers

    ahead, behind = run_workers(_unaligned_worker, 2)
    # the rank ahead runs its segment at once instead of waiting 0.5 s for the other; what
    # its training leaves out is exactly its own segment
    for r in (ahead, behind):
        assert r["took"] < 0.5 and r["excluded"] == pytest.approx(r["took"], abs=0.05)
        assert r["excluded"] >= r["segment"]
