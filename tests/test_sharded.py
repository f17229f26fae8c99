"""``shard_outer_state=True`` on real 2- and 4-rank gloo groups.

Against the unsharded algorithm from the same start on the same batches: the parameters agree to
1e-6 (relative to their scale) after every round — Δ̄ is formed as A − mean(θ) instead of
mean(A − θ), so rounding differs, nothing else — and every rank holds the bit-identical full
anchor. The persistent state each rank keeps is 1/N of the unsharded state (plus padding
of < N elements per bucket); exact resume from a state_dict taken with a sync in flight; the
numeric guard still skips alike; settings that cannot be sharded are refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lowcomm
from lowcomm.guard import NonFiniteError
from lowcomm.testing import inner_step, make_inner, run_workers
from lowcomm.testing.jobs import TrainJob, tiny_job_args

H = 4
STEPS = 18  # 4 rounds and a half: finish() also drains a sync in flight mid-round
TOL = 1e-6

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "diloco": ("DiLoCo", {}),
    "slowmo": ("SlowMo", {}),
    "diloco-adam": ("DiLoCo", {"outer_optimizer": "adam"}),
    "co2": ("CO2", {}),
    "co2-nesterov-none": ("CO2", {"nesterov": True, "gap_penalty": "none", "clip": None}),
    "co2-h1": ("CO2", {"sync_every": 1}),
    "streaming": ("StreamingDiLoCo", {"overlap": 1}),
    "streaming-mix-tau3": ("StreamingDiLoCo", {"overlap": 3, "mix": 0.3}),
    # a warm start of one round: the chunks and A_ref must follow θ
    "co2-warm": ("CO2", {"sync_warmup": H}),
    "co2-overlap": ("CO2", {"overlap": 2}),
}


def _model() -> torch.nn.Module:
    # odd sizes, so that buckets need padding to a multiple of N
    g = torch.Generator().manual_seed(11)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _adam(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.05)


def _build(name: str, model: torch.nn.Module, shard: bool, **extra: Any) -> Any:
    cls_name, kwargs = CASES[name]
    kwargs = {"sync_every": H, **kwargs, **extra}
    if kwargs.get("outer_optimizer") == "adam":
        kwargs["outer_optimizer"] = _adam
    if cls_name == "StreamingDiLoCo":
        kwargs["fragments"] = [model[0], [*model[2].parameters(), *model[3].parameters()]]
    inner = make_inner("adamw", model.parameters())
    # bucket_cap_mb tiny: several buckets, each padded on its own
    return getattr(lowcomm, cls_name)(
        model, inner, shard_outer_state=shard, bucket_cap_mb=1e-4, **kwargs
    )


def _run(rank: int, name: str, shard: bool) -> dict[str, Any]:
    model = _model()
    algo = _build(name, model, shard)
    trace = []
    for step in range(1, STEPS + 1):
        inner_step(model, algo.inner, rank, step, 0)
        algo.step()
        trace.append([p.detach().clone() for p in model.parameters()])
    memory = algo.memory_report()
    algo.finish()
    return {
        "trace": trace,
        "final": [p.detach().clone() for p in model.parameters()],
        "memory": memory,
    }


def _resume_run(rank: int, name: str, cut: int) -> list[torch.Tensor]:
    """Stop after ``cut`` steps, save everything, build afresh, load, go on to STEPS."""
    model = _model()
    algo = _build(name, model, True)
    for step in range(1, cut + 1):
        inner_step(model, algo.inner, rank, step, 0)
        algo.step()
    saved = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "inner": algo.inner.state_dict(),
        "algo": algo.state_dict(),
    }
    model = _model()
    algo = _build(name, model, True)
    model.load_state_dict(saved["model"])
    algo.inner.load_state_dict(saved["inner"])
    algo.load_state_dict(saved["algo"])
    for step in range(cut + 1, STEPS + 1):
        inner_step(model, algo.inner, rank, step, 0)
        algo.step()
    algo.finish()
    return [p.detach().clone() for p in model.parameters()]


def _poisoned(rank: int, policy: str) -> Any:
    model = _model()
    algo = _build("co2", model, True, nan_policy=policy)
    try:
        for step in range(1, STEPS + 1):
            inner_step(model, algo.inner, rank, step, 0)
            algo.step()
            if rank == 1 and step == 5:
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] = float("nan")
        algo.finish()
    except NonFiniteError:
        return ("raised", algo.local_step)
    return (algo.skipped_updates, [p.detach().clone() for p in model.parameters()])


def _job(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        out[name] = {"plain": _run(rank, name, False), "sharded": _run(rank, name, True)}
    if world_size == 2:
        out["resume"] = {
            (name, cut): _resume_run(rank, name, cut)
            for name, cut in (("co2", 6), ("co2", 9), ("streaming", 7), ("diloco", 9))
        }
        out["nan"] = {policy: _poisoned(rank, policy) for policy in ("skip", "raise")}
    return out


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_workers(_job, 2, list(CASES), timeout_s=300)


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_workers(_job, 4, ["diloco", "co2", "streaming"], timeout_s=300)


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest difference, relative to the parameters' scale."""
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x, y in zip(a, b))


def _check_equivalent(results: list[dict[str, Any]], name: str) -> None:
    for r in results:
        plain, sharded = r[name]["plain"], r[name]["sharded"]
        for step, (x, y) in enumerate(zip(sharded["trace"], plain["trace"]), start=1):
            assert _close(x, y) <= TOL, f"{name}: step {step} differs by {_close(x, y):.2e}"
        assert _close(sharded["final"], plain["final"]) <= TOL
    # every rank ends on the bit-identical anchor
    first = results[0][name]["sharded"]["final"]
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, r[name]["sharded"]["final"]))


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_sharded_equals_unsharded(two: list[dict[str, Any]], name: str) -> None:
    _check_equivalent(two, name)


@pytest.mark.parametrize("name", ["diloco", "co2", "streaming"])
def test_four_ranks_sharded_equals_unsharded(four: list[dict[str, Any]], name: str) -> None:
    _check_equivalent(four, name)


def _params_numel() -> int:
    return sum(p.numel() for p in _model().parameters())


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["diloco", "co2", "streaming"])
def test_state_per_rank_is_one_nth(
    two: list[dict[str, Any]], four: list[dict[str, Any]], world: int, name: str
) -> None:
    results = two if world == 2 else four
    for r in results:
        plain = r[name]["plain"]["memory"]["state"]
        sharded = r[name]["sharded"]["memory"]["state"]
        # each of the unsharded state's fp32 copies becomes a chunk: at most N - 1 padding
        # elements per bucket per copy (buckets: one per parameter at this cap)
        copies = plain // (4 * _params_numel())
        padding = copies * len(list(_model().parameters())) * (world - 1) * 4
        assert plain / world <= sharded <= plain / world + padding, (plain, sharded)


@pytest.mark.parametrize(
    "name,cut",
    [("co2", 6), ("co2", 9), ("streaming", 7), ("diloco", 9)],
)
def test_resume_with_a_sync_in_flight_is_exact(
    two: list[dict[str, Any]], name: str, cut: int
) -> None:
    for r in two:
        resumed = r["resume"][(name, cut)]
        assert all(torch.equal(a, b) for a, b in zip(resumed, r[name]["sharded"]["final"]))


def test_numeric_guard_skips_alike_when_sharded(two: list[dict[str, Any]]) -> None:
    skipped = [r["nan"]["skip"] for r in two]
    assert skipped[0][0] == skipped[1][0] == 1
    assert all(bool(torch.isfinite(p).all()) for p in skipped[0][1])
    assert all(torch.equal(a, b) for a, b in zip(skipped[0][1], skipped[1][1]))
    # raise: both ranks at the same step (round 2's average, advanced mid-round 3: step 10)
    assert [r["nan"]["raise"] for r in two] == [("raised", 10), ("raised", 10)]


@pytest.mark.parametrize(
    "cls,kwargs,match",
    [
        (lowcomm.CO2, {"compression": "int8"}, "cannot be combined with compression"),
        (lowcomm.DiLoCo, {"compression": "powersgd:2"}, "cannot be combined with compression"),
        (lowcomm.CO2, {"eager": True}, "eager"),
        (lowcomm.CO2, {"clip_mode": "norm"}, "clip_mode='norm'"),
        (lowcomm.DiLoCo, {"shard_outer_state": 1}, "shard_outer_state must be True or False"),
    ],
)
def test_unshardable_settings_are_refused(cls: type, kwargs: dict[str, Any], match: str) -> None:
    kwargs = {"shard_outer_state": True, **kwargs}
    with pytest.raises(ValueError, match=match):
        cls.validate(sync_every=4, **kwargs)


# 16 steps, rounds of 4, the CLI's warmup, log interval and dropout
TINY_JOB = tiny_job_args(steps=16, eval_every=8, warmup=None, log_every=None, dropout=None)


@pytest.mark.timeout(240)
def test_lowcomm_train_shard_outer_state(train_job: TrainJob, tmp_path: Any, capsys: Any) -> None:
    import json

    from lowcomm.cli import main

    losses = {}
    for name, extra in (("plain", []), ("sharded", ["--shard-outer-state"])):
        out = tmp_path / name
        summary = train_job("--algo", "diloco", *TINY_JOB, *extra, out=out)
        losses[name] = summary["val_loss_final"]
        with open(out / "config.json") as f:
            assert json.load(f)["shard_outer_state"] == (name == "sharded" or None)
    assert losses["sharded"] == pytest.approx(losses["plain"], rel=1e-5)
    argv = ["train", "--algo", "co2", "--shard-outer-state", "--compression", "int8"]
    assert main([*argv, "--out", str(tmp_path / "bad")]) == 2
    assert "cannot be combined with compression" in capsys.readouterr().err
