"""Dynamic local steps (``local_steps="dynamic"``, :mod:`lowcomm.outer.pace`): where a rank
steps, the plan from measured times, equal speeds bit for bit today's algorithms, the weighted
average against a single-process reference with unequal H_i, and resume exact mid-round. The
ranks' speeds come from an emulated clock (:mod:`lowcomm.testing.pace`): only the schedule
logic is emulated, the collectives are real gloo ones."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from lowcomm import CO2, DiLoCo, NoLoCo
from lowcomm.hparams import HyperparameterError
from lowcomm.outer.pace import plan_steps, steps_through, trim_plan
from lowcomm.testing import run_workers
from lowcomm.testing.jobs import TINY_JOB, tiny_job_args
from lowcomm.testing.pace import pace_reference_diloco, pace_runs
from lowcomm.testing.reference import make_inner, toy_model
from lowcomm.train.config import ConfigError, TrainConfig, config_from_dict

H = 8
WORLD = 3
SLOW = [1.0, 1.0, 2.0]  # rank 2 at half speed
EQUAL = [1.0, 1.0, 1.0]
ALGOS: dict[str, dict[str, Any]] = {
    "diloco": {"sync_every": H},
    "co2": {"sync_every": H, "overlap": 1},
    "co2-full": {"sync_every": H},  # τ = H, the paper's schedule
    "streaming": {"sync_every": H, "by_layer": True, "overlap": 1},
    "localsgd": {"sync_every": H},
    "diloco-warm": {"sync_every": H, "sync_warmup": 2 * H},  # the warm start: 2 rounds
    "diloco-sharded": {"sync_every": H, "shard_outer_state": True},
    "slowmo": {"sync_every": H},
    "cocodc": {"sync_every": H, "by_layer": True, "overlap": 2},
}


def _scenario(algo: str, local_steps: str, costs: list[float], **extra: Any) -> dict[str, Any]:
    name = algo.split("-")[0]
    return {
        "algo": name,
        "hyper": ALGOS[algo],
        "local_steps": local_steps,
        "costs": costs,
        "positions": 4 * H,
        **extra,
    }


SCENARIOS: dict[str, dict[str, Any]] = {}
for _algo in ALGOS:
    SCENARIOS[f"{_algo}/fixed"] = _scenario(_algo, "fixed", EQUAL)
    SCENARIOS[f"{_algo}/dynamic-equal"] = _scenario(_algo, "dynamic", EQUAL)
SCENARIOS["diloco/slow"] = _scenario("diloco", "dynamic", SLOW)
SCENARIOS["diloco/slow-fixed"] = _scenario("diloco", "fixed", SLOW)
SCENARIOS["diloco-sharded/slow"] = _scenario("diloco-sharded", "dynamic", SLOW)
SCENARIOS["diloco-warm/slow"] = _scenario("diloco-warm", "dynamic", SLOW)
SCENARIOS["diloco-warm/slow-cut"] = _scenario("diloco-warm", "dynamic", SLOW, cut=H + 3)
SCENARIOS["co2/slow"] = _scenario("co2", "dynamic", SLOW)
# cut mid-round; cut with the round's sync (and its measurement) in flight
SCENARIOS["co2/slow-cut-mid"] = _scenario("co2", "dynamic", SLOW, cut=2 * H + 3)
SCENARIOS["co2/slow-cut-in-flight"] = _scenario("co2", "dynamic", SLOW, cut=3 * H)
SCENARIOS["co2-full/slow"] = _scenario("co2-full", "dynamic", SLOW)
SCENARIOS["co2-full/slow-cut"] = _scenario("co2-full", "dynamic", SLOW, cut=3 * H + 5)
SCENARIOS["streaming/slow"] = _scenario("streaming", "dynamic", SLOW)
SCENARIOS["streaming/slow-cut"] = _scenario("streaming", "dynamic", SLOW, cut=2 * H + 3)


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    """Every scenario on 3 gloo ranks, in one set of processes."""
    names = list(SCENARIOS)
    per_rank = run_workers(pace_runs, WORLD, [SCENARIOS[n] for n in names], timeout_s=240)
    return {n: [per_rank[r][i] for r in range(WORLD)] for i, n in enumerate(names)}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# -- the schedule ------------------------------------------------------------------------------


@pytest.mark.parametrize("h", range(1, H + 1))
def test_a_rank_steps_h_times_a_round_spread_over_it(h: int) -> None:
    at = [steps_through(p, h, H) > steps_through(p - 1, h, H) for p in range(1, H + 1)]
    assert sum(at) == h
    assert at[-1]  # the last position always steps: a sync launched before it overlaps one
    gaps = [i for i, s in enumerate(at) if s]
    spacing = [b - a for a, b in zip(gaps, gaps[1:])]
    assert not spacing or max(spacing) - min(spacing) <= 1  # evenly


def test_the_last_round_is_cut_to_the_steps_left_in_proportion() -> None:
    assert trim_plan([12, 12, 6], 100) == [12, 12, 6]  # fits: unchanged
    assert trim_plan([12, 12, 6], 10) == [4, 4, 2]
    assert trim_plan([12, 12, 6], 11) == [5, 4, 2]  # a leftover step to the first of equals
    assert sum(trim_plan([7, 5, 3, 1], 9)) == 9
    assert trim_plan([4, 4], 0) == [0, 0]


def test_the_plan_gives_the_fastest_rank_h_and_the_others_steps_by_speed() -> None:
    assert plan_steps([1.0, 1.0, 2.0, 4.0], 12) == [12, 12, 6, 3]
    assert plan_steps([0.5, 0.6], 12) == [12, 10]
    assert plan_steps([1.0, 100.0], 12) == [12, 1]  # at least one step
    assert plan_steps([0.0, 0.0], 12) == [12, 12]  # nothing measured yet
    assert plan_steps([0.0, 2.0, 1.0], 8) == [8, 4, 8]  # unmeasured: taken as the fastest


# -- on real ranks -----------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algo", list(ALGOS))
def test_equal_speeds_are_todays_algorithm_bit_for_bit(
    runs: dict[str, list[dict[str, Any]]], algo: str
) -> None:
    fixed, dynamic = runs[f"{algo}/fixed"], runs[f"{algo}/dynamic-equal"]
    for rank in range(WORLD):
        assert dynamic[rank]["taken"] == 4 * H
        assert _same(fixed[rank]["params"], dynamic[rank]["params"]), (algo, rank)
        # the schedule by tokens is the step count itself
        assert dynamic[rank]["steps_done"] == [float(s) for s in range(1, 4 * H + 1)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algo", ["diloco", "diloco-warm", "diloco-sharded"])
def test_weighted_average_matches_the_single_process_reference(
    runs: dict[str, list[dict[str, Any]]], algo: str
) -> None:
    """DiLoCo with a half-speed rank, without and with a warm start of two rounds (where the
    rank that passes a position contributes nothing to that step's mean gradient), and with
    its outer state sharded (the weighted mean of θ reduce-scattered)."""
    slow = runs[f"{algo}/slow"]
    ref = pace_reference_diloco(SCENARIOS[f"{algo}/slow"], WORLD)
    # round 1 takes H everywhere; then the half-speed rank takes H/2
    assert [r["taken"] for r in slow] == ref["taken"] == [4 * H, 4 * H, H + 3 * H // 2]
    assert slow[0]["report"]["steps_per_round"] == [H, H, H // 2]
    times = slow[0]["report"]["step_s"]
    assert times == [t * times[0] for t in SLOW]  # (the emulated clock: in proportion)
    for rank in range(WORLD):
        for got, want in zip(slow[rank]["params"], ref["params"]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # the weights matter: the unweighted mean of the same steps lands elsewhere
    unweighted = dict(SCENARIOS[f"{algo}/slow"], unweighted=True)
    other = pace_reference_diloco(unweighted, WORLD)["params"]
    assert max(float((a - b).abs().max()) for a, b in zip(other, ref["params"])) > 1e-4
    # and the fixed-H job (the slow rank waited) took other steps
    assert not _same(runs["diloco/slow-fixed"][0]["params"], slow[0]["params"])
    # the LR schedule follows the steps all ranks took: 2.5 ranks' worth a position after round 1
    done = slow[0]["steps_done"]
    assert done[H - 1] == H and done[2 * H - 1] == pytest.approx(H + H * 2.5 / 3)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("whole", "cut"),
    [
        ("diloco-warm/slow", "diloco-warm/slow-cut"),
        ("co2/slow", "co2/slow-cut-mid"),
        ("co2/slow", "co2/slow-cut-in-flight"),
        ("co2-full/slow", "co2-full/slow-cut"),
        ("streaming/slow", "streaming/slow-cut"),
    ],
)
def test_resume_mid_round_with_unequal_steps_is_exact(
    runs: dict[str, list[dict[str, Any]]], whole: str, cut: str
) -> None:
    for rank in range(WORLD):
        a, b = runs[whole][rank], runs[cut][rank]
        assert a["taken"] == b["taken"]
        if rank == 2:
            assert a["taken"] < 4 * H  # the half-speed rank passed some positions
        assert _same(a["params"], b["params"]), (cut, rank)
        assert a["steps_done"] == b["steps_done"]


# -- what is refused ---------------------------------------------------------------------------


def test_dynamic_steps_refused_where_they_have_no_meaning() -> None:
    with pytest.raises(HyperparameterError, match="NoLoCo"):
        NoLoCo.validate(sync_every=4, local_steps="dynamic")
    with pytest.raises(HyperparameterError, match="eager"):
        CO2.validate(sync_every=4, eager=True, local_steps="dynamic")
    with pytest.raises(HyperparameterError, match="'fixed' or 'dynamic'"):
        DiLoCo.validate(sync_every=4, local_steps="adaptive")


@pytest.mark.usefixtures("single_rank_group")
def test_dynamic_steps_refuse_the_hook_form() -> None:
    model = toy_model()
    inner = make_inner("sgd", model.parameters())
    algo = DiLoCo(model, inner, sync_every=4, local_steps="dynamic", check_consistency=False)
    with pytest.raises(ValueError, match="takes_step"), algo:
        pass


# -- the job -----------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_job_with_a_half_speed_worker_and_dynamic_local_steps(
    train_job: Any, tmp_path: Any
) -> None:
    """``--speeds 1,0.5`` stretches worker 1's steps; with ``--local-steps dynamic`` it takes
    fewer of them, the job runs until the workers together took the tokens of ``--steps``, and
    the records count the tokens taken (not positions × workers)."""
    out = tmp_path / "dynamic"
    args = tiny_job_args(steps=16)
    summary = train_job(
        "--algo", "diloco", *args, "--speeds", "1,0.5", "--local-steps", "dynamic", out=out
    )
    work = summary["work"]
    assert work["local_steps"] == "dynamic" and work["speeds"] == "1,0.5"
    fast, slow = work["inner_steps"]
    assert slow < fast  # the half-speed worker took fewer steps: the rounds ended together
    batch = TINY_JOB["batch_size"] * TINY_JOB["block_size"]
    assert work["tokens"] == [fast * batch, slow * batch]
    # the last round was cut to what the job had left: exactly the equal-speed job's tokens
    assert summary["tokens"] == (fast + slow) * batch == 16 * 2 * batch
    assert summary["steps_run"] > 16 and summary["steps_run"] % TINY_JOB["sync_every"] == 0
    assert summary["replicas_identical"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert steps[-1]["step"] == summary["steps_run"] and steps[-1]["tokens"] == summary["tokens"]
    # the learning rate follows the tokens: at step 16 the workers together have not taken 16
    # steps each, so it is above the cosine floor it reaches at the end
    lr = {r["step"]: r["lr"] for r in steps}
    floor = 2e-3 * 0.1  # the job's lr x min_lr_ratio
    assert lr[16] > floor * 1.01 and lr[summary["steps_run"]] == pytest.approx(floor)
    after_warmup = [lr[s] for s in sorted(lr) if s > TINY_JOB["warmup"]]
    assert after_warmup == sorted(after_warmup, reverse=True)


def test_speeds_are_checked() -> None:
    with pytest.raises(ConfigError, match="one per worker"):
        TrainConfig(workers=2, speeds="1,1,0.5")
    with pytest.raises(ConfigError, match="> 0"):
        TrainConfig(workers=2, speeds=[1, 0])
    with pytest.raises(ConfigError, match="numbers"):
        TrainConfig(workers=2, speeds="fast,slow")
    cfg = TrainConfig(workers=4, speeds=[1, 1, 1, 0.5])  # a TOML list
    assert cfg.speeds == "1,1,1,0.5"
    assert [cfg.stretch(r, 4) for r in range(4)] == [1.0, 1.0, 1.0, 2.0]
    assert TrainConfig(workers=2).stretch(1, 2) == 1.0
    with pytest.raises(ConfigError, match="documents"):
        config_from_dict(dict(algo="diloco", workers=2, local_steps="dynamic", documents=True))


def test_bench_entries_take_speeds_in_brackets() -> None:
    """``lowcomm bench --algos 'co2/speeds=[1,1,1,0.5]/local_steps=dynamic,co2'``: the commas
    inside brackets do not split the list, and the entry's speeds reach the job."""
    from lowcomm.bench.argtypes import csv_list as _csv
    from lowcomm.bench.variants import algo_fields

    first, second = _csv("co2/speeds=[1,1,1,0.5]/local_steps=dynamic,co2")
    assert second == "co2"
    fields = algo_fields(first)
    assert fields == {"algo": "co2", "speeds": [1, 1, 1, 0.5], "local_steps": "dynamic"}
    assert config_from_dict(dict(workers=4, **fields)).speeds == "1,1,1,0.5"


@pytest.mark.timeout(300)
def test_job_with_dynamic_steps_resumes_from_a_checkpoint(train_job: Any, tmp_path: Any) -> None:
    """A dynamic job's checkpoint carries the plans and the steps every worker took: a run
    resumed from it ends at the same tokens (the step times, hence later plans, are measured
    again, so the numbers are not compared bit for bit: that is the engine's test above)."""
    # worker 1 four times as slow: the resumed run measures the step times again, and beside
    # other tests on 2 cores a gap of two was once measured the other way round
    args = [*tiny_job_args(steps=16), "--algo", "co2", "--speeds", "1,0.25"]
    args += ["--local-steps", "dynamic", "--checkpoint-every", "8"]
    first = train_job(*args, out=tmp_path / "first")
    checkpoint = tmp_path / "first" / "checkpoints" / "step-000008"
    assert checkpoint.is_dir()
    resumed = train_job(*args, "--resume", str(checkpoint), out=tmp_path / "second")
    batch = TINY_JOB["batch_size"] * TINY_JOB["block_size"]
    assert first["tokens"] == resumed["tokens"] == 16 * 2 * batch
    assert resumed["resumed_at"] == [8]
    assert resumed["work"]["inner_steps"][1] < resumed["work"]["inner_steps"][0]
