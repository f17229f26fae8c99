"""The two guards every algorithm has, on real 2-rank gloo groups.

* Consistency at start: ranks that hold a different model (values, shapes) or different settings
  fail on every rank, with the same message naming the first difference; ranks resuming from
  their own states, or with the check off, do not.
* Numeric guard: one rank's parameters turn NaN mid-round (a diverging worker). The average that
  carries it is skipped alike on every rank, the anchor and outer state stay bit for bit what
  they were, the rank recovers (training goes on and ends finite, ranks agreeing), and with
  ``nan_policy="raise"`` every rank raises at the same step and leaves no collective half done.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import lowcomm
from lowcomm import schedules
from lowcomm.guard import NonFiniteError, _first_difference, describe_tensors
from lowcomm.registry import REGISTRY
from lowcomm.testing import inner_step, make_inner, run_workers, toy_model

H = 3
POISON_STEP = 4  # rank 1's first parameter gets a NaN right after this step (round 2)
STEPS = 15

FRAGMENTS = {"sync_every": 4, "overlap": 1}  # 2 fragments: a sync point every 2 steps

# name -> (class, keywords): every outer algorithm of the registry, and two compressed ones
GUARDED: dict[str, tuple[type[lowcomm.OuterAlgorithm], dict[str, Any]]] = {
    name: (
        entry.cls,
        {**entry.fixed, **(FRAGMENTS if entry.schedule is schedules.FRAGMENTS else {})},
    )
    for name, entry in REGISTRY.items()
    if entry.cls is not None
}
GUARDED["co2-int8"] = (lowcomm.CO2, {"compression": "int8"})
GUARDED["diloco-powersgd"] = (lowcomm.DiLoCo, {"compression": "powersgd:2"})


def _build(name: str, model: torch.nn.Module, **extra: Any) -> lowcomm.OuterAlgorithm:
    cls, kwargs = GUARDED[name]
    kwargs = {"sync_every": H, **kwargs, **extra}
    if cls.schedule is schedules.FRAGMENTS:
        kwargs["fragments"] = [model[0], model[2]]
    inner = make_inner("adamw", model.parameters())
    return cls(model, inner, **kwargs)


def _anchor(algo: lowcomm.OuterAlgorithm) -> list[torch.Tensor]:
    if isinstance(algo, lowcomm.StreamingDiLoCo):
        views = algo.anchor_views
    elif isinstance(algo, lowcomm.LocalSGD):
        views = algo.params
    else:
        views = algo.anchor.views  # type: ignore[attr-defined]
    return [v.detach().clone() for v in views]


def _outer_state(algo: lowcomm.OuterAlgorithm) -> list[torch.Tensor]:
    """The outer state: CO2's momentum, gap statistic and last update, the outer optimizers'
    buffers (DiLoCo, streaming); nothing for LocalSGD."""
    return [
        t.clone()
        for f in algo.fragments
        if f.outer is not None
        for t in f.outer.tensors()
        if t.dim() > 0
    ]


def _poisoned_run(rank: int, name: str, policy: str) -> dict[str, Any]:
    model = toy_model(3)
    algo = _build(name, model, nan_policy=policy)
    anchors, outer, before_avg = [], [], None
    raised_at = None
    for step in range(1, STEPS + 1):
        inner_step(model, algo.inner, rank, step, 0)
        if name == "localsgd" and step == 2 * H:
            before_avg = [p.detach().clone() for p in model.parameters()]
        try:
            algo.step()
        except NonFiniteError as e:
            raised_at = (step, str(e))
            break
        if rank == 1 and step == POISON_STEP:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("nan")
        anchors.append(_anchor(algo))
        outer.append(_outer_state(algo))
    if raised_at is None:
        algo.finish()
    # the group still works: nothing was left half done on any rank
    probe = torch.tensor([float(rank)])
    dist.all_reduce(probe)
    inner_finite = all(
        bool(torch.isfinite(t).all())
        for s in algo.inner.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    return {
        "skipped": algo.skipped_updates,
        "anchors": anchors,
        "outer": outer,
        "final": [p.detach().clone() for p in model.parameters()],
        "inner_finite": inner_finite,
        "raised_at": raised_at,
        "probe": float(probe),
        "before_avg": before_avg,
    }


def _consistency_case(rank: int, case: str) -> str | None:
    seed, width, lr, outer_lr, extra = 3, 8, 0.01, 0.7, {}
    if case == "values" and rank == 1:
        seed = 4
    if case == "shape" and rank == 1:
        width = 9
    if case == "outer_lr" and rank == 1:
        outer_lr = 0.5
    if case == "inner_lr" and rank == 1:
        lr = 0.02
    if case == "off":
        seed, extra = 3 + rank, {"check_consistency": False}
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, 3)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    inner = torch.optim.AdamW(model.parameters(), lr=lr)
    algo = lowcomm.DiLoCo(model, inner, sync_every=H, outer_lr=outer_lr, **extra)
    if case == "resumed":
        # ranks resuming mid-round hold different parameters: their own states are loaded
        with torch.no_grad():
            next(model.parameters()).add_(float(rank))
        algo.load_state_dict(algo.state_dict())
    try:
        algo.step()
    except ValueError as e:
        return str(e)
    return None


CONSISTENCY_CASES = ["same", "values", "shape", "outer_lr", "inner_lr", "resumed", "off"]


def _job_settings_case(rank: int, case: str) -> str | None:
    """`lowcomm train`'s own check: flags parsed on each node must agree (not the ones that only
    change what is reported, such as the output folder)."""
    from lowcomm.data import load_corpus
    from lowcomm.train.config import config_from_dict
    from lowcomm.train.loop import check_same_job

    kwargs: dict[str, Any] = {"algo": "co2", "out": f"runs/node{rank}"}
    if case == "lr" and rank == 1:
        kwargs["lr"] = 1e-3
    corpus = load_corpus(None)
    if case == "data" and rank == 1:
        corpus.val = corpus.val[:-1]
    try:
        check_same_job(config_from_dict(dict(**kwargs)), corpus)
    except ValueError as e:
        return str(e)
    return None


def _job(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"consistency": {}, "skip": {}, "raise": {}}
    for case in CONSISTENCY_CASES:
        out["consistency"][case] = _consistency_case(rank, case)
    out["job"] = {case: _job_settings_case(rank, case) for case in ("same", "lr", "data")}
    for name in GUARDED:
        out["skip"][name] = _poisoned_run(rank, name, "skip")
    for name in ("co2", "diloco", "streaming"):
        out["raise"][name] = _poisoned_run(rank, name, "raise")
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_workers(_job, 2, timeout_s=300)


# -- consistency -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case,expected",
    [
        ("values", "values of 0.weight (checksum) is"),
        ("shape", "shape of 0.weight is (8, 6) on rank 0 but (9, 6) on rank 1"),
        ("outer_lr", "setting outer optimizer group 0 lr is 0.7 on rank 0 but 0.5 on rank 1"),
        ("inner_lr", "setting inner optimizer group 0 lr is 0.01 on rank 0 but 0.02 on rank 1"),
    ],
)
def test_a_difference_fails_on_every_rank_naming_it(
    results: list[dict[str, Any]], case: str, expected: str
) -> None:
    messages = [r["consistency"][case] for r in results]
    assert messages[0] is not None and expected in messages[0]
    assert messages[0] == messages[1]  # every rank fails, with the same message
    assert messages[0].startswith("ranks hold different DiLoCo inputs:")
    assert "same seed" in messages[0]  # the fix


@pytest.mark.parametrize("case", ["same", "resumed", "off"])
def test_agreeing_resumed_or_unchecked_ranks_pass(results: list[dict[str, Any]], case: str) -> None:
    assert [r["consistency"][case] for r in results] == [None, None]


def test_train_jobs_compare_their_settings_and_corpus(results: list[dict[str, Any]]) -> None:
    jobs = [r["job"] for r in results]
    assert [j["same"] for j in jobs] == [None, None]  # --out differs: allowed
    assert jobs[0]["lr"] == jobs[1]["lr"]
    assert jobs[0]["lr"].startswith(
        "ranks hold different lowcomm train settings: setting lr is 0.002 on rank 0 but 0.001 "
        "on rank 1; start every rank with the same flags"
    ), jobs[0]["lr"]
    assert "corpus size is" in jobs[0]["data"] and "on rank 1" in jobs[0]["data"]


def test_first_difference_names_a_missing_entry() -> None:
    a = describe_tensors([("w", torch.zeros(2))])
    b = describe_tensors([("w", torch.zeros(2)), ("v", torch.zeros(1))])
    message = _first_difference([a, b], what="models", hint="fix it")
    assert "number of parameters is 1 on rank 0 but 2 on rank 1; fix it" in message
    c = describe_tensors([("w", torch.zeros(2, dtype=torch.float64))])
    assert "dtype of w is float32 on rank 0 but float64 on rank 1" in _first_difference(
        [a, c], what="models", hint=""
    )


# -- numeric guard ---------------------------------------------------------------------------

# The skipped round and the one applied after it (1-based inner steps at which they end).
SKIPPED_AT = {
    "co2": 3 * H,  # round 2's average (launched at step 6) arrives at step 9
    "co2-eager": 3 * H,
    "co2-int8": 3 * H,
    "diloco": 2 * H,
    "diloco-powersgd": 2 * H,
    "slowmo": 2 * H,
}


@pytest.mark.parametrize("name", list(GUARDED))
def test_a_poisoned_average_is_skipped_alike_and_training_recovers(
    results: list[dict[str, Any]], name: str
) -> None:
    r0, r1 = (r["skip"][name] for r in results)
    assert r0["raised_at"] is None and r1["raised_at"] is None
    assert r0["skipped"] == r1["skipped"] == 1
    for r in (r0, r1):
        assert all(bool(torch.isfinite(p).all()) for p in r["final"])
        assert r["inner_finite"]
    # after finish() the ranks agree bit for bit
    for p, q in zip(r0["final"], r1["final"]):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", list(SKIPPED_AT))
def test_the_skipped_update_leaves_anchor_and_outer_state_untouched(
    results: list[dict[str, Any]], name: str
) -> None:
    at = SKIPPED_AT[name]
    for r in results:
        run = r["skip"][name]
        before, after, later = (run["anchors"][s - 1] for s in (at - 1, at, at + H))
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        assert all(torch.equal(a, b) for a, b in zip(run["outer"][at - 2], run["outer"][at - 1]))
        # and the next round is applied again
        assert not all(torch.equal(a, b) for a, b in zip(after, later))
        assert all(bool(torch.isfinite(a).all()) for a in later)


@pytest.mark.parametrize("name", ["streaming", "cocodc"])
def test_streaming_anchors_stay_finite_and_agree(results: list[dict[str, Any]], name: str) -> None:
    runs = [r["skip"][name] for r in results]
    for step in range(STEPS):
        assert all(bool(torch.isfinite(a).all()) for a in runs[0]["anchors"][step])
        assert all(
            torch.equal(a, b) for a, b in zip(runs[0]["anchors"][step], runs[1]["anchors"][step])
        )


def test_localsgd_averages_the_finite_ranks(results: list[dict[str, Any]]) -> None:
    # round 2: rank 1 diverged, so both ranks take rank 0's parameters
    rank0_before = results[0]["skip"]["localsgd"]["before_avg"]
    for r in results:
        after = r["skip"]["localsgd"]["anchors"][2 * H - 1]
        assert all(torch.equal(a, b) for a, b in zip(after, rank0_before))


@pytest.mark.parametrize("name,step", [("co2", 3 * H), ("diloco", 2 * H), ("streaming", 6)])
def test_raise_policy_stops_every_rank_at_the_same_step(
    results: list[dict[str, Any]], name: str, step: int
) -> None:
    raised = [r["raise"][name]["raised_at"] for r in results]
    assert raised[0] is not None and raised[1] is not None
    assert raised[0][0] == raised[1][0] == step
    assert "holds NaN or Inf" in raised[0][1] and "nan_policy='skip'" in raised[0][1]
    # the group still worked afterwards: a probe all-reduce of the ranks (0 + 1)
    assert [r["raise"][name]["probe"] for r in results] == [1.0, 1.0]


def test_nan_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="nan_policy must be 'skip' or 'raise', got 'ignore'"):
        lowcomm.CO2.validate(nan_policy="ignore")
