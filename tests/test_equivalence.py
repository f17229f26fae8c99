"""Real multi-process gloo runs of every algorithm against the single-process reference."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from lowcomm.registry import outer_names
from lowcomm.testing import run_workers
from lowcomm.testing.reference import distributed_run, make_inner, reference_run, toy_model

SMALL_BUCKETS = 0.0002  # ~52 floats: the toy model spans several buckets

SCENARIOS: dict[str, dict[str, Any]] = {
    "localsgd": {"algo": "localsgd"},
    "diloco": {"algo": "diloco", "inner": "adamw"},
    "diloco-avg-h1": {
        "algo": "diloco",
        "sync_every": 1,
        "steps": 5,
        "hyper": {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False},
    },
    "localsgd-h1": {"algo": "localsgd", "sync_every": 1, "steps": 5},
    "slowmo": {"algo": "slowmo"},
    "slowmo-decaying-lr": {"algo": "slowmo", "inner": "adamw", "lr_decay": 0.8},
    "co2-gap-value": {"algo": "co2", "hyper": {"clip": 0.05, "clip_mode": "value"}},
    "co2-gap-norm": {"algo": "co2", "hyper": {"clip": 0.1, "clip_mode": "norm"}},
    "co2-none-noclip": {"algo": "co2", "hyper": {"gap_penalty": "none", "clip": None}},
    "co2-const-nesterov": {
        "algo": "co2",
        "hyper": {"gap_penalty": 2.0, "nesterov": True, "clip": 0.05},
    },
    "co2-adamw": {"algo": "co2", "inner": "adamw", "hyper": {"outer_momentum": 0.9}},
    "co2-eager": {"algo": "co2", "hyper": {"eager": True, "clip": 0.05}},
    "co2-eager-nesterov-adamw": {
        "algo": "co2",
        "inner": "adamw",
        "hyper": {"eager": True, "nesterov": True, "gap_penalty": "none", "clip_mode": "norm"},
    },
    "streaming": {"algo": "streaming", "sync_every": 4, "fragments": [[0, 1], [2, 3]]},
    "streaming-overlap-mix": {
        "algo": "streaming",
        "sync_every": 4,
        "inner": "adamw",
        "fragments": [[0, 3], [1, 2]],
        "hyper": {"overlap": 1, "mix": 0.5},
    },
    "cocodc": {
        "algo": "cocodc",
        "sync_every": 4,
        "inner": "adamw",
        "fragments": [[0, 1], [2, 3]],
        "hyper": {"overlap": 1},
    },
    "cocodc-degenerate": {
        "algo": "cocodc",
        "sync_every": 4,
        "fragments": [[0, 1], [2, 3]],
        "hyper": {"overlap": 1, "lambda0": 0.0, "adaptive": False},
    },
    "cocodc-starving": {
        "algo": "cocodc",
        "sync_every": 6,
        "fragments": [[0], [1, 2], [3]],
        "hyper": {"overlap": 3, "max_wait": 1, "lambda0": 1.0},
    },
    # full overlap (τ = H): each fragment's sync lands as the same fragment launches again
    "cocodc-full-overlap": {
        "algo": "cocodc",
        "sync_every": 4,
        "inner": "adamw",
        "fragments": [[0, 1], [2, 3]],
        "hyper": {"overlap": 4},
    },
    "cocodc-full-overlap-int8-warm": {
        "algo": "cocodc",
        "sync_every": 6,
        "steps": 25,  # 6 warm, then three rounds and a step: full-overlap syncs applied
        "fragments": [[0], [1, 2], [3]],
        "hyper": {
            "overlap": 6,
            "lambda0": 0.0,
            "adaptive": False,
            "compression": "int8",
            "sync_warmup": 6,
            "sync_warmup_compression": "int4",
        },
    },
    "co2-delayed-averaging": {
        "algo": "co2",
        "inner": "adamw",
        "hyper": {"eager": True, "own_weight": 1.0, "outer_momentum": 0.0, "outer_lr": 1.0},
    },
    # SparseLoCo: tiles of 4 × 3 (4 × 4 where they fit), a quarter kept; the (3,) bias is sent
    # as it is (too small to gain), the rest sparse with 2- or 4-bit values
    "sparseloco": {"algo": "sparseloco", "inner": "adamw", "hyper": {"chunk": 4, "density": 0.25}},
    "sparseloco-4bit-overlap1": {
        "algo": "sparseloco",
        "hyper": {
            "chunk": 4,
            "density": 0.3,
            "bits": 4,
            "overlap": 1,
            "error_decay": 0.9,
            "outer_lr": 0.8,
        },
    },
    "sparseloco-merge-overlap2": {
        "algo": "sparseloco",
        "inner": "adamw",
        "hyper": {"chunk": 4, "density": 0.25, "overlap": 2, "merge": "delay_corrected"},
    },
    "sparseloco-full-overlap-fp32-values": {
        "algo": "sparseloco",
        "inner": "adamw",
        "hyper": {"chunk": 3, "density": 0.5, "bits": 32, "overlap": 3},
    },
    # CO2 with a staleness of τ < H steps (the launch τ steps before the round ends)
    "co2-overlap1": {"algo": "co2", "inner": "adamw", "hyper": {"overlap": 1}},
    "co2-overlap2-warm": {
        "algo": "co2",
        "sync_every": 4,
        "hyper": {"overlap": 2, "sync_warmup": 4, "outer_momentum": 0.9, "nesterov": True},
    },
    # CO2 with staggered fragments: each fragment τ = H/P steps stale, or a whole round
    "co2-fragments": {
        "algo": "co2",
        "sync_every": 4,
        "inner": "adamw",
        "fragments": [[0, 3], [1, 2]],
        "hyper": {
            "overlap": 2,
            "clip": 0.05,
            "sync_warmup": 4,
            "sync_warmup_compression": "sign:block=8",
        },
    },
    "co2-fragments-full-overlap-warm-int8": {
        "algo": "co2",
        "sync_every": 6,
        "fragments": [[0], [1, 2], [3]],
        "hyper": {
            "compression": "int8",
            "clip_mode": "norm",
            "clip": 0.1,
            "sync_warmup": 6,
            "sync_warmup_compression": "int4",
        },
    },
    # and its degenerate form: no penalty, no clip, Nesterov momentum is Streaming DiLoCo
    "co2-fragments-as-streaming": {
        "algo": "co2",
        "sync_every": 4,
        "inner": "adamw",
        "fragments": [[0, 3], [1, 2]],
        "hyper": {
            "overlap": 1,
            "gap_penalty": "none",
            "clip": None,
            "nesterov": True,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
        },
    },
    # CO2 with the delay-corrected merge (θ ← A + (θ − θ_s)): one fragment below and at full
    # overlap, fragments with compression and a warm start, and fragments at full overlap
    "co2-merge-overlap2": {
        "algo": "co2",
        "sync_every": 4,
        "inner": "adamw",
        "hyper": {"overlap": 2, "merge": "delay_corrected", "outer_momentum": 0.9},
    },
    "co2-merge-full-overlap": {"algo": "co2", "hyper": {"merge": "delay_corrected", "clip": 0.05}},
    "co2-fragments-merge-int4-warm": {
        "algo": "co2",
        "sync_every": 4,
        "inner": "adamw",
        "fragments": [[0, 3], [1, 2]],
        "hyper": {
            "overlap": 2,
            "merge": "delay_corrected",
            "compression": "int4",
            "sync_warmup": 4,
            "sync_warmup_compression": "int2",
        },
    },
    "co2-fragments-merge-full-overlap": {
        "algo": "co2",
        "sync_every": 4,
        "inner": "adamw",
        "fragments": [[0, 1], [2, 3]],
        "hyper": {
            "merge": "delay_corrected",
            "gap_penalty": "none",
            "clip": None,
            "nesterov": True,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
        },
    },
    # ... whose degenerate form (no penalty or clip, Nesterov) is CoCoDC's merge with λ₀ 0
    "cocodc-full-overlap-degenerate": {
        "algo": "cocodc",
        "sync_every": 4,
        "inner": "adamw",
        "fragments": [[0, 1], [2, 3]],
        "hyper": {"overlap": 4, "lambda0": 0.0, "adaptive": False},
    },
    # delayed Nesterov (Liu et al. 2024): the momentum moves every 2nd outer step of a fragment
    "streaming-delayed-nesterov": {
        "algo": "streaming",
        "sync_every": 4,
        "steps": 21,
        "inner": "adamw",
        "fragments": [[0, 3], [1, 2]],
        "hyper": {"overlap": 1, "nesterov_every": 2, "outer_lr": 1.4},
    },
    "streaming-overlap1": {
        "algo": "streaming",
        "sync_every": 4,
        "inner": "adamw",
        "fragments": [[0, 3], [1, 2]],
        "hyper": {"overlap": 1},
    },
    # the outer lr follows a decaying inner lr
    "diloco-lr-follows": {
        "algo": "diloco",
        "inner": "adamw",
        "lr_decay": 0.8,
        "hyper": {"outer_lr_schedule": "inner"},
    },
    "co2-lr-follows": {"algo": "co2", "lr_decay": 0.8, "hyper": {"outer_lr_schedule": "inner"}},
    # synchronous warm start: the schedule (and CO2's first reset) begins after K steps
    "co2-eager-warm": {"algo": "co2", "inner": "adamw", "hyper": {"eager": True, "sync_warmup": 3}},
    "localsgd-warm": {"algo": "localsgd", "hyper": {"sync_warmup": 6}},
    "streaming-warm": {
        "algo": "streaming",
        "sync_every": 4,
        "inner": "adamw",
        "fragments": [[0, 3], [1, 2]],
        "hyper": {"overlap": 1, "sync_warmup": 4},
    },
    # the warm start's all-reduce compressed, with error feedback (per fragment)
    "diloco-warm-int8": {
        "algo": "diloco",
        "inner": "adamw",
        "hyper": {"sync_warmup": 6, "sync_warmup_compression": "int8"},
    },
    "streaming-warm-int8sr": {
        "algo": "streaming",
        "sync_every": 4,
        "fragments": [[0, 3], [1, 2]],
        "hyper": {"overlap": 1, "sync_warmup": 8, "sync_warmup_compression": "int8:sr"},
    },
    "streaming-two-in-flight": {
        "algo": "streaming",
        "sync_every": 6,
        "fragments": [[0], [1, 2], [3]],
        "hyper": {"overlap": 3},
    },
    # NoLoCo: groups of 2 (2 ranks: one group; 4 ranks: two random groups every round)
    "noloco": {"algo": "noloco", "inner": "adamw"},
    "noloco-overlap": {"algo": "noloco", "hyper": {"overlap": 1, "outer_momentum": 0.9}},
    # 4 ranks in groups of 3: the remainder joins the last group (one group of 4)
    "noloco-group3": {"algo": "noloco", "hyper": {"group_size": 3, "group_seed": 5}},
    "noloco-warm": {"algo": "noloco", "hyper": {"sync_warmup": 6}},
    # the degenerate cases, with one group of every rank
    "noloco-whole": {"algo": "noloco", "hyper": {"group_size": 4}},
    "noloco-gossip-whole": {
        "algo": "noloco",
        "steps": 12,  # whole rounds: LocalSGD's finish() averages a partial round, NoLoCo drops it
        "hyper": {"group_size": 4, "outer_lr": 1.0, "outer_momentum": 0.0},
    },
    "noloco-gossip": {"algo": "noloco", "hyper": {"outer_lr": 1.0, "outer_momentum": 0.0}},
}


def _scenario(name: str, workers: int) -> dict[str, Any]:
    sc = {"sync_every": 3, "steps": 13, "bucket_cap_mb": SMALL_BUCKETS, "seed": 1}
    sc.update(copy.deepcopy(SCENARIOS[name]))
    sc["workers"] = workers
    return sc


def _run_all(workers: int) -> dict[str, list[dict]]:
    names = list(SCENARIOS)
    per_rank = run_workers(
        distributed_run, workers, [_scenario(n, workers) for n in names], timeout_s=240
    )
    return {n: [per_rank[r][i] for r in range(workers)] for i, n in enumerate(names)}


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list[dict]]:
    return _run_all(2)


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, list[dict]]:
    return _run_all(4)


def _ranks_agree_every_round(name: str) -> bool:
    """Streaming DiLoCo's unsynced fragments, eager CO2's anchors, NoLoCo's and θ after a
    delay-corrected merge are per rank."""
    sc = SCENARIOS[name]
    per_rank = sc["algo"] in ("streaming", "cocodc", "noloco") or len(sc.get("fragments", [])) > 1
    hyper = sc.get("hyper", {})
    # (the delay-corrected merge keeps each rank's own progress since the launch)
    return not per_rank and not hyper.get("eager") and hyper.get("merge") != "delay_corrected"


def _assert_ranks_identical(results: list[dict], *, every_round: bool) -> None:
    """Ranks agree after finish(); and after every round, except Streaming DiLoCo, whose
    fragments other than the one just synced carry each rank's own local progress."""
    for r in results[1:]:
        assert len(r["rounds"]) == len(results[0]["rounds"]) > 0
        pairs = [(r["final"], results[0]["final"])]
        if every_round:
            pairs += list(zip(r["rounds"], results[0]["rounds"]))
        for mine, theirs in pairs:
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


def _compare(results: list[dict], ref: Any, *, exact: bool) -> None:
    """Rank r against the reference's worker r, after every round and after finish()."""
    for rank, res in enumerate(results):
        got = res["rounds"] + [res["final"]]
        want = [t[rank] for t in ref.rounds] + [ref.final[rank]]
        assert len(got) == len(want)
        for k, (g, w) in enumerate(zip(got, want)):
            for a, b in zip(g, w):
                if exact:
                    assert torch.equal(a, b), f"rank {rank} round {k}: {(a - b).abs().max()}"
                else:
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_match_reference_bitwise(two_ranks: dict, name: str) -> None:
    results = two_ranks[name]
    _assert_ranks_identical(results, every_round=_ranks_agree_every_round(name))
    _compare(results, reference_run(_scenario(name, 2)), exact=True)
    assert results[0]["buckets"] > 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_four_ranks_match_reference(four_ranks: dict, name: str) -> None:
    results = four_ranks[name]
    _assert_ranks_identical(results, every_round=_ranks_agree_every_round(name))
    _compare(results, reference_run(_scenario(name, 4)), exact=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", ["two_ranks", "four_ranks"])
def test_diloco_with_h1_lr1_no_momentum_is_parameter_averaging(
    request: pytest.FixtureRequest, ranks: str
) -> None:
    """The real DiLoCo (lowcomm.outer, on gloo ranks) with H = 1, outer SGD lr 1 and no momentum
    is parameter averaging: after every round and after finish() each rank holds the mean of
    the workers' parameters, as the reference's LocalSGD computes it from the same batches."""
    results = request.getfixturevalue(ranks)["diloco-avg-h1"]
    averaging = reference_run(_scenario("localsgd-h1", len(results)))
    _compare(results, averaging, exact=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", ["two_ranks", "four_ranks"])
def test_noloco_with_one_group_is_diloco_with_heavy_ball(
    request: pytest.FixtureRequest, ranks: str
) -> None:
    """The real NoLoCo with every rank in one group (n = W) is DiLoCo with heavy-ball outer
    SGD(lr=α, momentum=μ); with μ = 0 and α = 1 it is LocalSGD (parameter averaging)."""
    results = request.getfixturevalue(ranks)
    workers = len(results["noloco-whole"])
    heavy_ball = {"outer_lr": 0.7, "outer_momentum": 0.5, "nesterov": False}
    diloco = reference_run({**_scenario("diloco", workers), "inner": "sgd", "hyper": heavy_ball})
    _compare(results["noloco-whole"], diloco, exact=False)
    averaging = reference_run({**_scenario("localsgd", workers), "steps": 12})
    _compare(results["noloco-gossip-whole"], averaging, exact=False)


@pytest.mark.timeout(300)
def test_noloco_groups_differ_across_ranks_and_rounds(four_ranks: dict) -> None:
    """Gossip averaging (μ = 0, α = 1) in groups of 2 out of 4: after a round the ranks' models
    pair up (each member holds its group's mean), and the pairs change from round to round."""
    results = four_ranks["noloco-gossip"]
    pairings = []
    for k in range(len(results[0]["rounds"])):
        models = [r["rounds"][k] for r in results]
        same = {
            (i, j)
            for i in range(4)
            for j in range(i + 1, 4)
            if all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(models[i], models[j]))
        }
        assert len(same) == 2 and len({x for pair in same for x in pair}) == 4, same
        pairings.append(frozenset(same))
    assert len(set(pairings)) > 1


@pytest.mark.timeout(300)
def test_noloco_exchange_bytes_do_not_grow_with_the_world(
    two_ranks: dict, four_ranks: dict
) -> None:
    """Each sync sends this rank's θ to its one partner: (n − 1) × payload, on 2 ranks and on 4;
    only finish()'s one all-reduce of φ is a ring's."""
    from lowcomm.comm import ring_wire_bytes

    payload = 4 * sum(p.numel() for p in toy_model(1).parameters())
    syncs = 13 // 3
    for results in (two_ranks["noloco"], four_ranks["noloco"]):
        workers = len(results)
        for r in results:
            assert r["stats"]["wire_bytes"] == syncs * payload + ring_wire_bytes(payload, workers)


def test_scenarios_exercise_penalty_and_clipping() -> None:
    """The CO2 scenarios are only meaningful if the penalty and the clip actually bind."""
    base = _scenario("co2-none-noclip", 2)
    plain = reference_run(base).final[0]
    for hyper in ({"clip": 0.05}, {"clip": 0.1, "clip_mode": "norm"}, {"clip": None}):
        sc = copy.deepcopy(base)
        sc["hyper"] = {"gap_penalty": "none", "clip": None}
        sc["hyper"].update(hyper)
        if hyper == {"clip": None}:
            sc["hyper"]["gap_penalty"] = "gap_aware"
        other = reference_run(sc).final[0]
        assert any(not torch.allclose(a, b) for a, b in zip(plain, other)), hyper


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n for n in SCENARIOS if n.startswith("co2")])
def test_co2_never_waits_in_the_round_it_launched(two_ranks: dict, name: str) -> None:
    h = _scenario(name, 2)["sync_every"]
    steps = _scenario(name, 2)["steps"]
    warmup = SCENARIOS[name].get("hyper", {}).get("sync_warmup", 0)
    p = len(SCENARIOS[name].get("fragments", [None]))
    interval = h // p  # a sync point every H/P steps
    for r in two_ranks[name]:
        launched: dict[int, int] = {}
        waited: dict[int, int] = {}
        # the warm start's gradient all-reduces are blocking, before step K's inner update
        # (one per fragment, all launched before any is waited on)
        warm = {hid for event, hid, step in r["events"] if event == "launch" and step < warmup}
        assert len(warm) == warmup * p
        for event, hid, step in r["events"]:
            if hid in warm:
                continue
            if event == "launch":
                launched.setdefault(hid, step)
            else:
                assert hid in launched, "wait on a collective that was never launched"
                waited.setdefault(hid, step)
        if SCENARIOS[name].get("hyper", {}).get("eager"):
            # eager finish() averages the per-rank anchors: one blocking all-reduce at the end
            last = max(launched)
            assert launched[last] == waited[last] == steps
            del launched[last]
        tau = SCENARIOS[name].get("hyper", {}).get("overlap") or h
        assert len(launched) == (steps - warmup + tau) // interval - tau // interval
        for hid, at in launched.items():
            assert (at - warmup + tau) % interval == 0
            # waited τ steps later (a full round by default), never at the step it launched;
            # what is still in flight at the end, by finish()
            assert waited[hid] == at + tau or (at + tau > steps and waited[hid] == steps)
            assert waited[hid] > at or at == steps  # (launched at the last step: by finish())


@pytest.mark.timeout(300)
def test_co2_fragments_without_penalty_or_clip_are_streaming_diloco(two_ranks: dict) -> None:
    # m ← βm + Δ̄; A ← A − α(Δ̄ + βm) is torch's Nesterov SGD on Δ̄, fragment by fragment
    co2, streaming = two_ranks["co2-fragments-as-streaming"], two_ranks["streaming-overlap1"]
    for a, b in zip(co2, streaming):
        for mine, theirs in zip(a["rounds"] + [a["final"]], b["rounds"] + [b["final"]]):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(x, y) for x, y in zip(co2[0]["final"], co2[0]["rounds"][0]))


@pytest.mark.timeout(300)
def test_co2_fragments_with_the_merge_are_cocodc_without_compensation(two_ranks: dict) -> None:
    # the same schedule at full overlap, the same outer step (Nesterov SGD on Δ̄ per fragment)
    # and the same merge θ ← Â + (θ − θ_s): only the code differs
    co2 = two_ranks["co2-fragments-merge-full-overlap"]
    cocodc = two_ranks["cocodc-full-overlap-degenerate"]
    for a, b in zip(co2, cocodc):
        for mine, theirs in zip(a["rounds"] + [a["final"]], b["rounds"] + [b["final"]]):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(x, y) for x, y in zip(co2[0]["final"], co2[0]["rounds"][0]))
    # and the merge changes CO2: the same settings with the reset end elsewhere
    reset = reference_run(
        {
            **_scenario("co2-fragments-merge-full-overlap", 2),
            "hyper": {**SCENARIOS["co2-fragments-merge-full-overlap"]["hyper"], "merge": "reset"},
        }
    )
    assert any(not torch.allclose(x, y) for x, y in zip(co2[0]["final"], reset.final[0]))


@pytest.mark.timeout(300)
def test_blocking_algorithms_wait_in_the_same_round(two_ranks: dict) -> None:
    for r in two_ranks["diloco"]:
        for event, _hid, step in r["events"]:
            assert step % 3 == 0, event
        waits = {hid: s for e, hid, s in r["events"] if e == "wait"}
        launches = {hid: s for e, hid, s in r["events"] if e == "launch"}
        assert waits == launches


def _resume_worker(
    rank: int, world_size: int, algo_name: str, cut: int, into: str = "fresh"
) -> dict:
    """Run 12 steps uninterrupted, and again with a save/restore at ``cut``: into fresh
    objects, or (``into="used"``) into the same ones after two more steps, with whatever
    they then have in flight."""
    import io

    from lowcomm.registry import ALGORITHMS
    from lowcomm.testing import inner_step, make_inner, toy_model

    def build() -> tuple:
        model = toy_model(3)
        inner = make_inner("adamw", model.parameters())
        if algo_name == "co2-eager":
            return model, inner, ALGORITHMS["co2"](model, inner, sync_every=3, eager=True)
        if algo_name.endswith("-warm"):  # a warm start of two rounds
            name = algo_name.removesuffix("-warm")
            return model, inner, ALGORITHMS[name](model, inner, sync_every=3, sync_warmup=6)
        if algo_name.endswith("-warm-int8sr"):  # compressed: residuals and rounding resume
            name = algo_name.removesuffix("-warm-int8sr")
            kw = {"sync_warmup": 6, "sync_warmup_compression": "int8:sr"}
            return model, inner, ALGORITHMS[name](model, inner, sync_every=3, **kw)
        if algo_name == "noloco-overlap":  # the exchange launched at step 5 is in flight
            algo = ALGORITHMS["noloco"](model, inner, sync_every=3, overlap=1, outer_momentum=0.9)
            return model, inner, algo
        if algo_name == "sparseloco-overlap":  # in flight a whole round; the accumulator
            algo = ALGORITHMS["sparseloco"](model, inner, sync_every=3, overlap=3)
            return model, inner, algo
        if algo_name == "co2-fragments":  # two fragments in flight (τ = H), per-fragment state
            params = list(model.parameters())
            kw = {"fragments": [params[:2], params[2:]]}
            return model, inner, ALGORITHMS["co2"](model, inner, sync_every=4, **kw)
        if algo_name == "co2-fragments-merge":  # full overlap, snapshots of both fragments
            params = list(model.parameters())
            kw = {"fragments": [params[:2], params[2:]], "merge": "delay_corrected"}
            return model, inner, ALGORITHMS["co2"](model, inner, sync_every=4, **kw)
        if algo_name == "cocodc-full-overlap":  # both fragments in flight, a round each
            params = list(model.parameters())
            kw = {"fragments": [params[:2], params[2:]], "overlap": 4}
            return model, inner, ALGORITHMS["cocodc"](model, inner, sync_every=4, **kw)
        if algo_name in ("streaming", "cocodc"):
            params = list(model.parameters())
            kw: dict = {"fragments": [params[:2], params[2:]], "overlap": 1}
            if algo_name == "streaming":
                kw["mix"] = 0.25
            return model, inner, ALGORITHMS[algo_name](model, inner, sync_every=4, **kw)
        return model, inner, ALGORITHMS[algo_name](model, inner, sync_every=3)

    model, inner, algo = build()
    for step in range(1, 13):
        inner_step(model, inner, rank, step, 3)
        algo.step()
    algo.finish()
    straight = [p.detach().clone() for p in model.parameters()]

    model, inner, algo = build()
    for step in range(1, cut + 1):
        inner_step(model, inner, rank, step, 3)
        algo.step()
    was_in_flight = getattr(algo, "in_flight", False)
    buf = io.BytesIO()
    torch.save({"m": model.state_dict(), "i": inner.state_dict(), "a": algo.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    waited: list[bool] = []
    if into == "used":
        for step in (cut + 1, cut + 2):
            inner_step(model, inner, rank, step, 3)
            algo.step()
        handles = [s.handle for f in algo.fragments for s in f.pending]
    else:
        model, inner, algo = build()
        handles = []
    model.load_state_dict(saved["m"])
    inner.load_state_dict(saved["i"])
    algo.load_state_dict(saved["a"])
    waited = [h._done for h in handles]
    for step in range(cut + 1, 13):
        inner_step(model, inner, rank, step, 3)
        algo.step()
    algo.finish()
    resumed = [p.detach().clone() for p in model.parameters()]
    return {
        "straight": straight,
        "resumed": resumed,
        "in_flight": was_in_flight,
        "waited": waited,
    }


# (algorithm, the inner step after which its state is saved and restored)
STATE_DICT_CUTS = [
    ("co2", 6),
    ("co2", 7),
    ("co2-eager", 6),
    ("co2-warm", 5),
    ("co2-warm", 10),
    ("co2-fragments", 5),
    ("diloco", 4),
    ("diloco-warm-int8sr", 4),
    ("slowmo", 6),
    ("localsgd", 5),
    ("streaming", 5),
    ("cocodc", 5),
    ("cocodc-full-overlap", 5),
    ("co2-fragments-merge", 6),
    ("noloco", 4),
    ("noloco-overlap", 5),
    ("sparseloco", 4),
    ("sparseloco-overlap", 7),
]


def test_every_outer_algorithm_resumes_from_its_state_dict() -> None:
    assert {name for name, _ in STATE_DICT_CUTS} >= set(outer_names())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("algo_name,cut", STATE_DICT_CUTS)
def test_resume_from_state_dict_is_exact(algo_name: str, cut: int) -> None:
    for r in run_workers(_resume_worker, 2, algo_name, cut):
        assert all(torch.equal(a, b) for a, b in zip(r["straight"], r["resumed"]))
        if algo_name.startswith("co2") and not (algo_name.endswith("-warm") and cut <= 6):
            assert r["in_flight"]  # the checkpoint held an all-reduce that was in flight


# (algorithm, cut): loaded into the objects in use two steps later, a sync then in flight
USED_CUTS = [("co2", 6), ("co2-fragments-merge", 6), ("noloco-overlap", 6), ("streaming", 5)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("algo_name,cut", USED_CUTS)
def test_load_state_dict_into_an_algorithm_in_use_is_exact(algo_name: str, cut: int) -> None:
    for r in run_workers(_resume_worker, 2, algo_name, cut, "used"):
        assert all(torch.equal(a, b) for a, b in zip(r["straight"], r["resumed"]))
        # something was in flight when it loaded, and it was waited for, not dropped
        assert r["waited"] and all(r["waited"])


def _warm_overlap_worker(rank: int, world_size: int, codec: str | None) -> dict:
    """The warm start at the optimizer's step and the one launched during backward (buckets
    of 30 floats: the toy model's 4 tensors in 3 buckets), side by side."""
    from lowcomm.outer import CO2
    from lowcomm.testing.toy import toy_backward

    out: dict = {}
    for overlap in (False, True):
        model = toy_model(2)
        inner = make_inner("adamw", model.parameters())
        algo = CO2(model, inner, sync_every=3, sync_warmup=6, sync_warmup_compression=codec)
        if overlap:
            algo.warm_start_during_backward(bucket_cap_mb=120 / 2**20)
            out["buckets"] = len(algo.warm.buckets)
        launched_in_backward = []
        for step in range(1, 10):
            before = algo.stats.collectives
            toy_backward(model, rank, step, 2)
            launched_in_backward.append(algo.stats.collectives - before)
            inner.step()
            inner.zero_grad()
            algo.step()
        algo.finish()
        out[overlap] = [p.detach().clone() for p in model.parameters()]
        out[f"launched_{overlap}"] = launched_in_backward
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", [None, "int4"])
def test_warm_start_during_backward_takes_the_same_steps(codec: str | None) -> None:
    for r in run_workers(_warm_overlap_worker, 2, codec):
        assert r["buckets"] == 3
        assert all(torch.equal(a, b) for a, b in zip(r[False], r[True]))
        # launched by backward, every bucket, in each of the 6 warm steps only
        assert r["launched_True"][:6] == [r["launched_True"][0]] * 6
        assert r["launched_True"][0] >= 3 and r["launched_True"][6:] == [0, 0, 0]
        assert r["launched_False"] == [0] * 9


def _subgroup_worker(rank: int, world_size: int) -> dict:
    """Two 'nodes' of two ranks; CO2 runs inside each node's subgroup only."""
    import torch.distributed as dist

    from lowcomm.outer import CO2
    from lowcomm.testing import inner_step, make_inner, toy_model

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    model = toy_model(5)
    inner = make_inner("sgd", model.parameters())
    try:
        CO2(model, inner, sync_every=2, process_group=groups[1 - rank // 2])
    except ValueError as e:
        assert "not a member of process_group" in str(e)
    else:
        raise AssertionError("an algorithm on a group without this rank must be refused")
    algo = CO2(model, inner, sync_every=2, process_group=mine)
    for step in range(1, 9):
        inner_step(model, inner, rank, step, 5)
        algo.step()
    algo.finish()
    return {"params": [p.detach().clone() for p in model.parameters()], "n": algo.world_size}


@pytest.mark.timeout(180)
def test_process_group_scopes_the_algorithm_to_a_subgroup() -> None:
    res = run_workers(_subgroup_worker, 4)
    assert [r["n"] for r in res] == [2, 2, 2, 2]

    def same(a: dict, b: dict) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))

    assert same(res[0], res[1]) and same(res[2], res[3])
    assert not same(res[0], res[2])


def test_cocodc_without_overlap_or_priority_is_streaming_diloco() -> None:
    """τ = 0 makes the snapshot the live parameters (g = 0): CoCoDC's merge is θ ← Â, Streaming
    DiLoCo's with mix 0; round-robin makes the schedules equal."""
    base = {"sync_every": 4, "steps": 13, "fragments": [[0, 1], [2, 3]], "workers": 2, "seed": 4}
    cocodc = reference_run({**base, "algo": "cocodc", "hyper": {"adaptive": False}})
    streaming = reference_run({**base, "algo": "streaming"})
    for a_round, b_round in zip(
        cocodc.rounds + [cocodc.final], streaming.rounds + [streaming.final]
    ):
        for a, b in zip(a_round, b_round):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_cocodc_adaptive_priority_changes_the_schedule() -> None:
    base = {"sync_every": 6, "steps": 24, "fragments": [[0], [1, 2], [3]], "workers": 2}
    adaptive = reference_run({**base, "algo": "cocodc", "hyper": {"overlap": 1}})
    fixed = reference_run({**base, "algo": "cocodc", "hyper": {"overlap": 1, "adaptive": False}})
    assert any(not torch.equal(a, b) for a, b in zip(adaptive.final[0], fixed.final[0]))


def _warm_start_worker(rank: int, world_size: int) -> dict:
    """The first K steps of an algorithm with ``sync_warmup=K`` against torch DDP."""
    from torch.nn.parallel import DistributedDataParallel

    from lowcomm.registry import ALGORITHMS
    from lowcomm.testing import inner_step, make_inner, toy_model

    ddp_model = toy_model(4)
    ddp = DistributedDataParallel(ddp_model)
    ddp_inner = make_inner("adamw", ddp.parameters())
    out: dict[str, list] = {"ddp": [], "warm": [], "anchor": []}
    for step in range(1, 7):
        inner_step(ddp, ddp_inner, rank, step, 4)
        out["ddp"].append([p.detach().clone() for p in ddp_model.parameters()])
    for name in ("co2", "diloco", "localsgd"):
        model = toy_model(4)
        inner = make_inner("adamw", model.parameters())
        algo = ALGORITHMS[name](model, inner, sync_every=3, sync_warmup=6)
        runs = []
        for step in range(1, 7):
            inner_step(model, inner, rank, step, 4)
            algo.step()
            runs.append([p.detach().clone() for p in model.parameters()])
        out["warm"].append(runs)
        out["anchor"].append([v.clone() for v in algo.anchor_views])
        out.setdefault("hooked_after", []).append(algo.warm.hook is not None)
        out.setdefault("payload", []).append(algo.stats.payload_bytes)
    # the same warm start with its all-reduce compressed to int8 (error feedback)
    model = toy_model(4)
    inner = make_inner("adamw", model.parameters())
    kw = {"sync_warmup": 6, "sync_warmup_compression": "int8"}
    algo = ALGORITHMS["diloco"](model, inner, sync_every=3, **kw)
    for step in range(1, 7):
        inner_step(model, inner, rank, step, 4)
        algo.step()
    out["int8"] = [p.detach().clone() for p in model.parameters()]
    out["int8_payload"] = algo.stats.payload_bytes
    return out


@pytest.mark.timeout(180)
def test_warm_start_takes_ddp_steps() -> None:
    """sync_warmup=K: the first K inner steps are DDP's (mean gradient, same inner optimizer
    state on every rank), the anchor follows, and the gradient hook is gone after them."""
    results = run_workers(_warm_start_worker, 2)
    for r in results:
        assert r["hooked_after"] == [False, False, False]
        for runs, anchor in zip(r["warm"], r["anchor"]):
            for got, want in zip(runs, r["ddp"]):
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            assert all(torch.equal(a, p) for a, p in zip(anchor, runs[-1]))
    # compressed: a quarter of the bytes (plus scales), near DDP but not DDP, the same on every
    # rank (every rank applies the same mean)
    a, b = results
    assert 0.2 < a["int8_payload"] / a["payload"][1] < 0.3
    assert any(not torch.equal(x, y) for x, y in zip(a["int8"], a["ddp"][-1]))
    for x, y in zip(a["int8"], a["ddp"][-1]):
        torch.testing.assert_close(x, y, rtol=0, atol=0.05)
    assert all(torch.equal(x, y) for x, y in zip(a["int8"], b["int8"]))


def test_outer_lr_schedule_inner_scales_the_outer_step() -> None:
    """With a decaying inner lr the two schedules give different runs; with a constant one the
    same (γ/γ₀ = 1)."""
    for name in ("diloco-lr-follows", "co2-lr-follows"):
        follows = _scenario(name, 2)
        constant = copy.deepcopy(follows)
        constant["hyper"]["outer_lr_schedule"] = "constant"
        a, b = reference_run(follows).final[0], reference_run(constant).final[0]
        assert any(not torch.equal(x, y) for x, y in zip(a, b))
        del follows["lr_decay"], constant["lr_decay"]
        a, b = reference_run(follows).final[0], reference_run(constant).final[0]
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_warm_buckets_send_the_gradients_backward_produces_last_in_small_buckets() -> None:
    from lowcomm.outer.warm import WARM_TAIL_SPLIT, warm_buckets

    cap = 1000.0
    # sizes in the order backward produces them: 2,500 bytes before the last 1,000
    sizes = [600, 300, 500, 700, 400, 100, 100, 200, 150, 250, 100, 100]
    groups = warm_buckets(sizes, cap)
    assert [i for g in groups for i in g] == list(range(len(sizes)))  # every tensor, in order
    totals = [sum(sizes[i] for i in g) for g in groups]
    assert totals == [900, 500, 700, 400, 400, 400, 200]
    # before the last `cap` bytes: up to the cap; inside them: closed once they hold
    # cap / WARM_TAIL_SPLIT, so the bucket launched last holds less than the cap
    assert all(t <= cap for t in totals[:4])
    assert groups[4:] == [[5, 6, 7], [8, 9], [10, 11]]
    assert totals[-1] <= cap / WARM_TAIL_SPLIT
    # a tensor larger than the cap gets a bucket of its own, wherever it lies
    assert warm_buckets([100, 5000, 100], cap) == [[0], [1], [2]]
    # a model smaller than one bucket: every bucket is a tail bucket
    assert warm_buckets([100, 200, 50, 300], cap) == [[0, 1], [2, 3]]
    # the toy model of the test above keeps its three buckets
    assert warm_buckets([12, 96, 32, 192], 120) == [[0, 1], [2], [3]]
    assert warm_buckets([], cap) == []  # no empty bucket to launch


def test_warm_buckets_are_laid_out_as_ddp_s_small_first_large_after() -> None:
    """A first bucket of ``first`` bytes, the others up to ``cap``, the last ``first`` bytes
    split: on the 12 x 768 GPT (85 M parameters) the warm start launches 18 buckets a step,
    not the 98 that buckets of 1 MB throughout made (each one a collective and an encoding:
    host work a GPU waits on)."""
    from lowcomm.models.gpt import GPT, GPTConfig
    from lowcomm.outer.warm import WARM_BUCKET_MB, WARM_TAIL_SPLIT, warm_buckets

    sizes = [600, 300, 500, 700, 400, 100, 100, 200, 150, 250, 100, 100]
    groups = warm_buckets(sizes, 2000.0, first=1000.0)
    totals = [sum(sizes[i] for i in g) for g in groups]
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    assert totals == [900, 1600, 400, 400, 200]  # 1,000 first, 2,000 after, then the tail
    # the first bucket is never larger than the others
    assert warm_buckets(sizes, 1000.0, first=5000.0) == warm_buckets(sizes, 1000.0)

    with torch.device("meta"):
        gpt = GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=12, n_head=12, n_embd=768))
    nbytes = [4 * p.numel() for p in reversed(list(gpt.parameters()))]
    mb = 1024 * 1024
    ddp = warm_buckets(nbytes, 25 * mb, first=WARM_BUCKET_MB * mb)
    one_mb = warm_buckets(nbytes, WARM_BUCKET_MB * mb)
    sized = [sum(nbytes[i] for i in g) for g in ddp]
    assert sized[0] <= WARM_BUCKET_MB * mb
    assert max(sized) <= 25 * mb or any(len(g) == 1 for g in ddp)
    assert sized[-1] <= WARM_BUCKET_MB * mb  # the bucket the optimizer's step waits for
    assert len(ddp) <= sum(nbytes) / (25 * mb) + 2 + WARM_TAIL_SPLIT < len(one_mb) / 4
