"""Settings from the link (``lowcomm.plan.tune``, ``lowcomm train --tune-link``): the choice
against the cost model's own figures, what the user gives winning, and the job applying,
recording and restoring the choice."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
import torch

from lowcomm.compress.codecs import parse_codec
from lowcomm.plan.cost import Network
from lowcomm.plan.tune import HEADROOM, SLACK, LinkProfile, choose_sync_settings
from lowcomm.testing.jobs import tiny_job_args

# the default job's GPT (4 layers, width 128, vocabulary 256): 834,304 parameters, 3.3 MB
SHAPES = [(256, 128), (64, 128)] + [(384, 128), (128, 128), (512, 128), (128, 512)] * 4
SHAPES += [(128,)] * 26 + [(384,)] * 4 + [(512,)] * 4
CO2 = {"overlap": 1, "compression": None, "sync_warmup_compression": "int8"}


def _choose(link: str, algo: str = "co2", **kw: Any) -> Any:
    args: dict[str, Any] = {
        "link": LinkProfile.parse(link, emulated=True),
        "workers": 2,
        "step_time_s": 0.075,
        "shapes": SHAPES,
        "sync_every": 12,
        "current": CO2,
    }
    return choose_sync_settings(algo, **{**args, **kw})


def test_a_fast_link_keeps_the_defaults_and_a_slow_one_compresses_and_overlaps() -> None:
    fast = _choose("1gbit")
    assert fast.settings == {} and fast.hidden
    payload = 4 * sum(torch.Size(s).numel() for s in SHAPES)
    # fp32, τ 1 on 1gbit: the ring all-reduce of the emulated link, 1 step of it hidden
    sync = Network(
        bandwidth_bps=1e9, latency_s=LinkProfile.parse("1gbit").latency_s, cost="emulated"
    ).allreduce_time(payload, 2)
    assert fast.sync_s == pytest.approx(sync)
    assert fast.step_s == pytest.approx(0.075 + max(0.0, sync - 0.075) / 12)

    slow = _choose("10mbit")
    # fp32 takes 2.7 s a sync, 3 rounds of compute: the ladder goes down to int2 and 2 steps
    # of overlap, which leave less than 10% of the compute waited
    assert slow.settings == {"compression": "int2", "overlap": 2}
    assert slow.hidden and 0.075 < slow.step_s <= (1 + SLACK) * 0.075
    # int2 (a scale per 128 values) by all-gather, as the emulated link charges it
    int2 = sum(parse_codec("int2").wire_nbytes(s) for s in SHAPES)
    ten = LinkProfile.parse("10mbit")
    net = Network(bandwidth_bps=ten.bandwidth_bps, latency_s=ten.latency_s, cost="emulated")
    assert slow.sync_s == pytest.approx(net.allgather_time(int2, 2))
    assert slow.step_s == pytest.approx(0.075 + (slow.sync_s - 2 * 0.075) / 12)
    assert int2 < 0.08 * payload

    # 100mbit: one step of overlap is enough for int8 within SLACK, but its sync (~79 ms)
    # does not fit in HEADROOM of the 75 ms step it overlaps; int4's (~43 ms) does, and costs
    # nothing more per token
    middle = _choose("100mbit")
    assert middle.settings["compression"] == "int4" and "overlap" not in middle.settings
    assert middle.hidden and middle.step_s == pytest.approx(0.075)
    int8 = sum(parse_codec("int8").wire_nbytes(s) for s in SHAPES)
    int4 = sum(parse_codec("int4").wire_nbytes(s) for s in SHAPES)
    hundred = LinkProfile.parse("100mbit")
    net = Network(bandwidth_bps=hundred.bandwidth_bps, latency_s=hundred.latency_s, cost="emulated")
    assert net.allgather_time(int4, 2) <= HEADROOM * 0.075 < net.allgather_time(int8, 2)


def test_a_model_of_four_blocks_staggers_fragments_where_one_would_wait() -> None:
    # 10mbit: int4 over the whole model takes ~0.38 s, more than 2 steps hide; a quarter of it
    # every 3 steps, in flight until the next sync point, hides (the same bytes a round)
    slow = _choose("10mbit", max_fragments=4)
    assert slow.settings == {"compression": "int4", "overlap": 3, "num_fragments": 4}
    assert slow.hidden and slow.step_s <= (1 + SLACK) * 0.075
    int4 = sum(parse_codec("int4").wire_nbytes(s) for s in SHAPES)
    ten = LinkProfile.parse("10mbit")
    net = Network(bandwidth_bps=ten.bandwidth_bps, latency_s=ten.latency_s, cost="emulated")
    assert net.allgather_time(int4 / 4, 2) < 3 * 0.075 < net.allgather_time(int4, 2)
    assert slow.sync_s == pytest.approx(4 * net.allgather_time(int4 / 4, 2))
    # 2 mbit/s: a quarter in int4 no longer fits in 3 steps; int2 does
    two = _choose("2mbit:30ms", max_fragments=4)
    assert two.settings == {"compression": "int2", "overlap": 3, "num_fragments": 4}
    # faster links never stagger: one fragment one step stale hides there
    assert "num_fragments" not in _choose("100mbit", max_fragments=4).settings
    # fewer blocks than fragments, H not a multiple of 4, or one fragment given: as before
    for kw in ({"max_fragments": 3}, {"sync_every": 10}, {"given": {"num_fragments"}}):
        choice = _choose("10mbit", **{"max_fragments": 4, **kw})
        assert "num_fragments" not in choice.settings, kw


def test_what_the_user_gives_is_never_changed() -> None:
    # compression given as none (fp32): every rung that compresses is skipped, and nothing
    # left hides the 2.7 s syncs
    choice = _choose("10mbit", given={"compression"})
    assert choice.settings == {} and not choice.hidden and choice.step_s > 0.2
    # overlap given: int2 at τ 1 is the fastest rung left
    choice = _choose("10mbit", given={"overlap"})
    assert choice.settings == {"compression": "int2"} and not choice.hidden
    # the warm start's codec given
    choice = _choose("10mbit", given={"sync_warmup_compression"}, warm_steps=240)
    assert "sync_warmup_compression" not in choice.settings
    # not given: a cheaper warm start than int8's 0.7 s a step
    choice = _choose("10mbit", warm_steps=240)
    assert choice.settings["sync_warmup_compression"] == "int2"  # the cheapest: none is enough
    assert choice.warm_step_s is not None and choice.warm_step_s < 0.075 + 0.7


def test_blocking_algorithms_only_shorten_the_wait_and_others_are_left_alone() -> None:
    # blocking: nothing hides a sync, a codec only shortens it — int8 waits under 10% on
    # 100mbit, on 10mbit even int2 waits longer
    diloco = _choose("100mbit", "diloco", current={"compression": None})
    assert diloco.settings == {"compression": "int8"} and diloco.hidden
    diloco = _choose("10mbit", "diloco", current={"compression": None})
    assert diloco.settings == {"compression": "int2"} and not diloco.hidden
    assert _choose("10mbit", "co2-eager").settings == {}
    assert _choose("10mbit", "ddp").settings == {}


def test_a_job_on_an_emulated_slow_link_runs_with_what_was_chosen_and_keeps_it(
    train_job: Any, tmp_path: Any, capsys: Any
) -> None:
    out = str(tmp_path / "tuned")
    argv = tiny_job_args(steps=8, sync_every=4)
    summary = train_job("--algo", "co2", *argv, "--link", "100kbit:1ms", out=out)
    tuning = summary["link_tuning"]
    assert tuning["link"].startswith("100kbit:1ms (emulated)")
    # nothing hides 100 kbit/s: the fastest rung, int2 and the most overlap below H = 4
    assert tuning["settings"] == {"compression": "int2", "overlap": 2} and not tuning["hidden"]
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config["compression"] == tuning["settings"]["compression"]
    assert summary["compression"].startswith(tuning["settings"]["compression"])
    assert "tuned to link" in capsys.readouterr().out
    # the same job with the codec given, and with tuning off: nothing given is changed (on
    # 1 Mbit/s, where the tuner would still take a codec: an fp32 sync of this model takes
    # ~1 s against ~4 steps of compute, and 10 s on 100 kbit/s)
    given = train_job(
        "--algo",
        "co2",
        *argv,
        "--link",
        "1mbit:1ms",
        "--compression",
        "bf16",
        out=str(tmp_path / "given"),
    )
    assert given["compression"].startswith("bf16")
    assert "compression" not in given["link_tuning"]["settings"]
    off = train_job(
        "--algo",
        "co2",
        *argv,
        "--link",
        "1mbit:1ms",
        "--tune-link",
        "off",
        out=str(tmp_path / "off"),
    )
    assert off["link_tuning"] is None and off["compression"] is None


def test_without_a_slow_link_nothing_is_tuned_and_measuring_finds_the_loopback_fast(
    train_job: Any, tmp_path: Any
) -> None:
    argv = tiny_job_args(steps=4, sync_every=4)
    plain = train_job("--algo", "co2", *argv, out=str(tmp_path / "plain"))
    assert plain["link_tuning"] is None
    # the codec given (fp32): on a loaded machine the loopback's latency can be a share of this
    # tiny model's 4 ms step, where a codec would be chosen
    measured = train_job(
        "--algo",
        "co2",
        *argv,
        "--tune-link",
        "measure",
        "--compression",
        "none",
        out=str(tmp_path / "measured"),
    )
    tuning = measured["link_tuning"]
    assert tuning["link"].startswith("measured")
    assert re.search(r"\(([0-9.]+) Gbit/s", tuning["link"]), tuning["link"]  # loopback
    assert tuning["settings"] == {} and "compression none" in tuning["reason"]
    # the measurement leaves the training alone: the same model as without it
    assert measured["val_loss_final"] == plain["val_loss_final"]


def test_a_resumed_run_takes_the_choice_from_its_checkpoint(train_job: Any, tmp_path: Any) -> None:
    argv = ["--algo", "co2", *tiny_job_args(steps=8, sync_every=4), "--link", "100kbit:1ms"]
    ref = str(tmp_path / "ref")
    full = train_job(*argv, "--checkpoint-every", "4", out=ref)
    assert full["link_tuning"]["settings"]
    # resumed from step 4 on another link, which would choose otherwise: the checkpoint's
    # choice is taken as it is, and the run ends where the uninterrupted one did
    step4 = os.path.join(ref, "checkpoints", "step-000004")
    assert os.path.isdir(step4), os.listdir(os.path.join(ref, "checkpoints"))
    resumed = train_job(
        "--algo",
        "co2",
        *tiny_job_args(steps=8, sync_every=4),
        "--link",
        "1gbit",
        "--resume",
        step4,
        out=str(tmp_path / "resumed"),
    )
    assert resumed["link_tuning"] == full["link_tuning"]
    assert resumed["compression"] == full["compression"]
    assert resumed["val_loss_final"] == full["val_loss_final"]


def test_a_warm_start_that_would_cost_more_than_its_budget_is_shortened() -> None:
    warm = {**CO2, "sync_warmup": 240}
    kw: dict[str, Any] = {"current": warm, "warm_steps": 240, "steps": 960}
    # 10mbit: even int2 adds ~0.2 s a step, so the warm start goes down to its floor, a
    # 3/40 of the steps in whole rounds (72 of 960)
    slow = _choose("10mbit", **kw)
    assert slow.settings["sync_warmup"] == 72
    assert slow.settings["sync_warmup_compression"] == "int2"
    # 100mbit: int2 adds ~29 ms a step; 3% of 960 x 75 ms buys 72 steps of it (whole rounds)
    middle = _choose("100mbit", **kw)
    extra = middle.warm_step_s - 0.075
    assert middle.settings["sync_warmup"] == int(0.03 * 960 * 0.075 / extra) // 12 * 12 == 72
    # 1gbit: the job's quarter of the steps costs less than the budget; a given length stays
    assert "sync_warmup" not in _choose("1gbit", **kw).settings
    assert "sync_warmup" not in _choose("10mbit", given={"sync_warmup"}, **kw).settings


def test_a_warm_start_over_its_budget_at_its_shortest_takes_a_cheaper_codec() -> None:
    # a slow machine (174 ms a step) on 100mbit: int8's all-reduce (~77 ms) is within half a
    # step, but even the shortest warm start (one round, 12 of 96 steps) would add 12 x 77 ms, more
    # than 3% of the job's compute (0.5 s): int4 adds 12 x 44 ms, still over; int2 fits
    short = {**CO2, "sync_warmup": 24}
    kw: dict[str, Any] = {"step_time_s": 0.174, "current": short, "warm_steps": 24}
    budget = 0.03 * 96 * 0.174
    chosen = _choose("100mbit", steps=96, **kw)
    assert chosen.settings["sync_warmup"] == 12
    assert chosen.settings["sync_warmup_compression"] == "int2"
    assert 12 * (chosen.warm_step_s - 0.174) <= budget

    def extra(codec: str) -> float:  # what a warm step of ``codec`` adds, given
        current = {**short, "sync_warmup_compression": codec}
        warm = _choose("100mbit", given={"sync_warmup_compression"}, **{**kw, "current": current})
        return warm.warm_step_s - 0.174

    assert extra("int8") <= 0.5 * 0.174 and 12 * extra("int4") > budget >= 12 * extra("int2")
    # without the budget (no steps known) int8 stays: it is within half a step
    assert "sync_warmup_compression" not in _choose("100mbit", **kw).settings
    # its codec given: kept, over budget as it is
    given = _choose("100mbit", steps=96, given={"sync_warmup_compression"}, **kw)
    assert "sync_warmup_compression" not in given.settings and given.settings["sync_warmup"] == 12
    # 960 steps: int8 at its floor (72 steps) would add 5.5 s against 5.0 s; int4 fits at the
    # length the budget buys (whole rounds), longer than the floor
    long = _choose(
        "100mbit", steps=960, **{**kw, "current": {**CO2, "sync_warmup": 240}, "warm_steps": 240}
    )
    assert long.settings["sync_warmup_compression"] == "int4"
    k = long.settings["sync_warmup"]
    assert k == int(0.03 * 960 * 0.174 / (long.warm_step_s - 0.174)) // 12 * 12 > 72
    # the length given: the codec still holds its cost to the budget
    held = _choose("100mbit", steps=96, given={"sync_warmup"}, **kw)
    assert "sync_warmup" not in held.settings
    # (24 steps: none fits; the cheapest)
    assert held.settings["sync_warmup_compression"] == "int2"


def test_what_the_job_does_not_tune_says_why() -> None:
    from lowcomm.train.config import config_from_dict
    from lowcomm.train.tuning import _tunable

    def why(**values: Any) -> str | None:
        return _tunable(config_from_dict({"link": "10mbit", **values}, source="test"))

    assert why(algo="co2") is None
    assert why(algo="co2", tune_link="off") == "off"
    assert why(algo="co2-eager") == "co2-eager is not tuned"
    assert why(algo="ddp") == "ddp is not tuned"
    assert why(algo="co2", documents=True) is not None  # its steps are not one timed step
    assert why(algo="diloco", shard_outer_state=True) is not None
