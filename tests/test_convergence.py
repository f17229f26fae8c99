"""``lowcomm bench --convergence``: parsing, the assembly of seeds, targets, times and goals, and
a tiny end-to-end run through real worker processes."""

from __future__ import annotations

import json
import math
import os

import pytest

from lowcomm.bench.convergence import ConvergenceSpec, algo_fields, run_convergence
from lowcomm.bench.convergence_report import assemble, format_markdown, steps_within, wall_time
from lowcomm.cli import main
from lowcomm.testing.jobs import TINY_JOB


def test_algo_fields_parse_codecs_settings_and_literals():
    assert algo_fields("co2") == {"algo": "co2"}
    assert algo_fields("co2+int8:sr/outer_lr=0.3/eager=True/clip=none") == {
        "algo": "co2",
        "compression": "int8:sr",
        "outer_lr": 0.3,
        "eager": True,
        "clip": "none",
    }
    assert algo_fields("diloco/sync-every=24") == {"algo": "diloco", "sync_every": 24}
    # booleans as TOML and the job's config spell them, too
    got = algo_fields("cocodc/adaptive=false/nesterov=true")
    assert got == {"algo": "cocodc", "adaptive": False, "nesterov": True}
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        algo_fields("co2/outer_lr")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"algos": ["ddp", "fast"]}, "unknown algorithm 'fast'"),
        ({"algos": ["co2", "co2"]}, "names an algorithm twice"),
        ({"seeds": []}, "seeds: need integers"),
        ({"lengths": [0]}, "lengths: need integers >= 1"),
        ({"links": ["fast"]}, "fast"),
        ({"timing_steps": 0}, "timing_steps: must be an integer >= 1"),
        ({"algos": ["co2/outer_lr=-1"]}, "outer_lr"),
        ({"algos": ["co2/no_such_key=1"]}, "no_such_key"),
    ],
)
def test_bad_settings_are_refused_before_anything_runs(tmp_path, changes, message):
    spec = ConvergenceSpec(out=str(tmp_path / "c"), **changes)
    with pytest.raises(ValueError, match=message):
        spec.validate()
    assert not (tmp_path / "c").exists()


def _run(algo, base, seed, losses, workers=2, length=1):
    # evaluations at steps 0, 10, 20, 30; 100 tokens per step
    curve = [[100 * s, s, loss] for s, loss in zip((0, 10, 20, 30), losses)]
    return {
        "algo": algo,
        "base": base,
        "workers": workers,
        "seed": seed,
        "length": length,
        "steps": 30,
        "tokens": 3000,
        "curve": curve,
        "val_loss_final": losses[-1],
    }


def test_assemble_merges_seeds_and_times_the_target_on_each_link():
    spec = ConvergenceSpec(algos=["ddp", "co2", "diloco"], workers=[2], seeds=[0, 1])
    runs = [
        _run("ddp", "ddp", 0, [5.0, 3.0, 2.2, 2.0]),
        _run("ddp", "ddp", 1, [5.0, 3.2, 2.4, 2.2]),  # target: mean final 2.1
        _run("co2", "co2", 0, [5.0, 2.5, 2.0, 2.0]),
        _run("co2", "co2", 1, [5.0, 2.7, 2.2, 2.1]),  # mean curve reaches 2.1 at step 20
        _run("diloco", "diloco", 0, [5.0, 4.0, 3.0, 2.5]),
        _run("diloco", "diloco", 1, [5.0, 4.0, 3.0, 2.7]),  # never reaches 2.1
    ]
    timings = [
        {"algo": "ddp", "workers": 2, "link": "100mbit", "step_time_s": 1.0},
        {"algo": "co2", "workers": 2, "link": "100mbit", "step_time_s": 0.2},
        {"algo": "diloco", "workers": 2, "link": "100mbit", "step_time_s": 0.5},
    ]
    # bytes on the wire: a worker's whole job (1,500 tokens a worker): DDP 100 a token, CO2 1
    # and 3 on its seeds (2 a token), DiLoCo's not recorded
    runs[0]["wire_bytes"] = runs[1]["wire_bytes"] = 150_000
    runs[2]["wire_bytes"], runs[3]["wire_bytes"] = 1_500, 4_500
    results = assemble(spec, runs, timings)
    cells = {c["algo"]: c for c in results["cells"]}
    ddp, co2, diloco = cells["ddp"], cells["co2"], cells["diloco"]
    assert ddp["wire_bytes_per_token"] == pytest.approx(100.0)
    assert co2["wire_bytes_per_token"] == pytest.approx(2.0)
    assert co2["fewer_bytes_than_ddp"] == pytest.approx(50.0)
    assert diloco["wire_bytes_per_token"] is None and diloco["fewer_bytes_than_ddp"] is None
    assert ddp["val_loss_mean"] == pytest.approx(2.1)
    assert ddp["val_loss_std"] == pytest.approx(math.sqrt(0.02))
    assert [p[2] for p in ddp["curve"]] == pytest.approx([5.0, 3.1, 2.3, 2.1])
    assert ddp["target"] == pytest.approx(2.1) and ddp["gap"] == pytest.approx(0.0)
    assert ddp["steps_to_target"] == pytest.approx(30)
    assert co2["gap"] == pytest.approx(2.05 / 2.1 - 1)
    assert co2["steps_to_target"] == pytest.approx(20)
    assert co2["tokens_to_target"] == pytest.approx(2000)
    assert co2["time_to_target_s"] == {"100mbit": pytest.approx(4.0)}
    assert ddp["time_to_target_s"] == {"100mbit": pytest.approx(30.0)}
    assert diloco["steps_to_target"] is None and diloco["time_to_target_s"] == {"100mbit": None}
    goals = {g["goal"]: g for g in results["goals"]}
    assert goals["co2, 2 workers: within 3% of DDP's loss, equal tokens"]["met"] is True
    assert goals["diloco, 2 workers: within 2% of DDP's loss, equal tokens"]["met"] is False
    assert goals["streaming, 2 workers: within 2% of DDP's loss, equal tokens"]["met"] is None
    faster = goals["co2, 2 workers, 100mbit: DDP's final loss >= 3x sooner than DDP"]
    assert faster["value"] == pytest.approx(7.5) and faster["met"] is True
    # the only blocking algorithm never reaches the target: CO2 is sooner
    assert goals["co2, 2 workers, 100mbit: sooner than every blocking algorithm"]["met"] is True
    assert goals["co2, 2 workers, 1gbit: not slower than DDP to DDP's final loss"]["met"] is None
    # equal time: CO2's whole job took 6 s, the fastest; by then DDP had trained 6 steps and
    # DiLoCo 12, each read off its mean curve between the evaluations at steps 0 and 10, 10 and 20
    assert co2["equal_time"]["100mbit"] == {"seconds": 6.0, "steps": 30.0, "val_loss": 2.05}
    assert ddp["equal_time"]["100mbit"]["steps"] == pytest.approx(6.0)
    assert ddp["equal_time"]["100mbit"]["val_loss"] == pytest.approx(5.0 + 0.6 * (3.1 - 5.0))
    assert diloco["equal_time"]["100mbit"]["val_loss"] == pytest.approx(4.0 + 0.2 * (3.0 - 4.0))
    text = format_markdown(results)
    assert "not reached" in text and "2.050 ± 0.071" in text
    assert "val loss at 6 s, 100mbit (steps)" in text and "3.860 (6)" in text
    assert "2.0, 50×" in text


def test_a_run_of_longer_jobs_alone_is_reported_and_plotted(tmp_path):
    """``--lengths 4``: no 1x jobs; the tables, the goals (unmeasured) and both plots."""
    from lowcomm.bench.convergence_report import write_report

    spec = ConvergenceSpec(algos=["ddp", "co2"], workers=[2], seeds=[0], lengths=[4])
    runs = [
        _run("ddp", "ddp", 0, [5.0, 3.0, 2.2, 2.0], length=4),
        _run("co2", "co2", 0, [5.0, 2.5, 2.0, 1.9], length=4),
    ]
    timings = [
        {"algo": a, "workers": 2, "link": "100mbit", "step_time_s": t}
        for a, t in (("ddp", 1.0), ("co2", 0.2))
    ]
    results = assemble(spec, runs, timings)
    assert {c["length"] for c in results["cells"]} == {4}
    assert all(g["met"] is None for g in results["goals"])  # the goals are for 1x jobs
    paths = write_report(results, str(tmp_path))
    assert all(os.path.getsize(p) > 0 for p in paths)
    assert "(4x)" in (tmp_path / "convergence.md").read_text()


def test_a_warm_start_is_timed_at_its_own_step_time():
    spec = ConvergenceSpec(algos=["ddp", "co2"], workers=[2], seeds=[0])
    runs = [
        _run("ddp", "ddp", 0, [5.0, 3.0, 2.2, 2.0]),
        {**_run("co2", "co2", 0, [5.0, 3.0, 2.5, 2.0]), "warm_steps": 10},  # 2.0 at step 30
    ]
    timings = [
        {"algo": "ddp", "workers": 2, "link": "100mbit", "step_time_s": 1.0},
        {"algo": "co2", "workers": 2, "link": "100mbit", "step_time_s": 0.2},
    ]
    timings[1]["warm_step_time_s"] = 1.5
    co2 = {c["algo"]: c for c in assemble(spec, runs, timings)["cells"]}["co2"]
    # 10 warm steps at 1.5 s, 20 more at 0.2 s
    assert co2["time_to_target_s"] == {"100mbit": pytest.approx(19.0)}
    assert wall_time(co2, "100mbit", 5) == pytest.approx(7.5)
    # and back: the steps trained in a time, in the warm start or after it, at most the job's
    assert steps_within(co2, "100mbit", 7.5) == pytest.approx(5)
    assert steps_within(co2, "100mbit", 17.0) == pytest.approx(20)
    assert steps_within(co2, "100mbit", 60.0) == pytest.approx(30)


def test_sync_to_round_reads_the_rounds_after_the_warm_start(tmp_path):
    from types import SimpleNamespace

    from lowcomm.bench.convergence import sync_to_round

    # 24 warm steps, then 24 local steps (2 rounds of 12) that took 3.0 s of training, 1.2 s of
    # it blocked: 75 ms of compute a step, 0.9 s a round; the 2 syncs were in flight 5.4 s in
    # all, 2.7 s each: 3x a round (the warm start's counters are left out)
    records = [
        {
            "kind": "eval",
            "val_loss": 1.0,
            "step": 0,
            "train_s": 0.0,
            "rounds": 0,
            "in_flight_s": 0.0,
        },
        {
            "kind": "eval",
            "val_loss": 1.0,
            "step": 24,
            "train_s": 8.0,
            "rounds": 0,
            "in_flight_s": 7.0,
            "blocked_s": 6.0,
        },
        {
            "kind": "eval",
            "val_loss": 1.0,
            "step": 48,
            "train_s": 11.0,
            "rounds": 2,
            "in_flight_s": 12.4,
            "blocked_s": 7.2,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = SimpleNamespace(out=str(tmp_path), steps=48, algo="co2", sync_warmup_steps=lambda: 24)
    assert sync_to_round(cfg) == pytest.approx(3.0)
    # ddp: every step is a round of one step
    ddp = SimpleNamespace(out=str(tmp_path), steps=48, algo="ddp", sync_warmup_steps=lambda: 24)
    assert sync_to_round(ddp) == pytest.approx((12.4 / 48) / ((11.0 - 7.2) / 48))


def test_a_slower_co2_misses_its_time_goals():
    spec = ConvergenceSpec(algos=["ddp", "co2", "localsgd"], workers=[2], seeds=[0])
    runs = [
        _run("ddp", "ddp", 0, [5.0, 3.0, 2.2, 2.0]),
        _run("co2", "co2", 0, [5.0, 3.0, 2.5, 2.0]),  # reaches 2.0 at step 30
        _run("localsgd", "localsgd", 0, [5.0, 2.0, 2.0, 2.0]),  # at step 10
    ]
    timings = [
        {"algo": a, "workers": 2, "link": link, "step_time_s": t}
        for a, t in (("ddp", 1.0), ("co2", 0.5), ("localsgd", 1.0))
        for link in ("100mbit", "1gbit")
    ]
    goals = {g["goal"]: g["met"] for g in assemble(spec, runs, timings)["goals"]}
    assert goals["co2, 2 workers, 100mbit: DDP's final loss >= 3x sooner than DDP"] is False
    assert goals["co2, 2 workers, 100mbit: sooner than every blocking algorithm"] is False
    assert goals["co2, 2 workers, 1gbit: not slower than DDP to DDP's final loss"] is True


def _tiny_overrides() -> dict:
    return {k: v for k, v in TINY_JOB.items() if k not in ("steps", "workers", "quiet")}


def _slug(cell: str) -> str:
    """A cell's name in its jobs' folder names."""
    return cell.replace("/", "-").replace("@", "-")


def test_tiny_convergence_run_end_to_end(tmp_path):
    out = tmp_path / "conv"
    co2 = "co2/outer_lr=0.5/sync_warmup=4"
    spec = ConvergenceSpec(
        algos=["ddp", f"{co2}/tune_link=off", co2],
        workers=[2],
        seeds=[0, 1],
        steps=8,
        links=["1gbit"],
        timing_steps=4,
        train_overrides=_tiny_overrides(),
        out=str(out),
    )
    notes: list[str] = []
    results = run_convergence(spec, command="test", progress=notes.append)
    assert len(notes) == 3 * 2 + 3  # loss jobs (3 cells x 2 seeds), then timing jobs
    for name in ("results.json", "convergence.md", "loss_vs_tokens.png", "loss_vs_time.png"):
        assert (out / name).stat().st_size > 0
    cells = {c["algo"]: c for c in results["cells"]}
    off, tuned = f"{co2}/tune_link=off", f"{co2}@1gbit"
    # the entry without tune_link is the job as it runs on each link: one cell per link
    assert set(cells) == {"ddp", off, tuned}
    for algo, c in cells.items():
        finals = []
        for seed in (0, 1):
            job = out / "jobs" / f"loss-{_slug(algo)}-w2-x1-s{seed}"
            summary = json.loads((job / "summary.json").read_text())
            assert summary["steps"] == 8 and summary["workers"] == 2
            finals.append(summary["val_loss_final"])
        assert c["val_loss_final"] == finals
        assert finals[0] != finals[1]  # the seeds are different runs
        assert c["step_time_s"]["1gbit"] > 0
        assert [p[1] for p in c["curve"]] == [0, 4, 8]
    assert cells["ddp"]["gap"] == 0.0 and cells["ddp"]["steps_to_target"] == pytest.approx(8)
    # the warm start's steps are timed apart: the timing job warms up for 4 steps, then 4 more
    assert cells[off]["warm_steps"] == 4 and cells[off]["warm_step_time_s"]["1gbit"] > 0
    timing = json.loads(
        (out / "jobs" / f"time-{off.replace('/', '-')}-w2-1gbit" / "config.json").read_text()
    )
    assert (timing["steps"], timing["sync_warmup"]) == (8, 4)
    assert "warm" in (out / "convergence.md").read_text()
    # a round's syncs against a round's compute, after the warm start, from the timing job's
    # counters at steps 4 and 8 (its size is a timing, so it is checked against the records, not
    # against a bound: a loaded machine stretches in-flight time as much as compute)
    records = [
        r
        for r in map(
            json.loads,
            (out / "jobs" / f"time-{off.replace('/', '-')}-w2-1gbit" / "metrics.jsonl")
            .read_text()
            .splitlines(),
        )
        if r.get("kind") == "eval" and r.get("val_loss") is not None
    ]
    start, end = (next(r for r in records if r["step"] == s) for s in (4, 8))
    rounds = end["rounds"] - start["rounds"]
    assert rounds > 0
    compute = (end["train_s"] - start["train_s"] - (end["blocked_s"] - start["blocked_s"])) / 4
    expected = (end["in_flight_s"] - start["in_flight_s"]) / rounds / (4 / rounds * compute)
    assert cells[off]["sync_to_round"]["1gbit"] == pytest.approx(expected)
    assert cells[off]["sync_to_round"]["1gbit"] > 0
    assert "sync / round, 1gbit" in (out / "convergence.md").read_text()
    written = json.loads((out / "results.json").read_text())
    assert written["cells"][0]["val_loss_final"] == results["cells"][0]["val_loss_final"]

    # the tuned cell: its first loss job chose for the link; the other and its timing job ran
    # with that choice as given, on that link alone
    def config(name: str) -> dict:
        return json.loads((out / "jobs" / name / "config.json").read_text())

    slug = _slug(tuned)
    first, second = config(f"loss-{slug}-w2-x1-s0"), config(f"loss-{slug}-w2-x1-s1")
    assert first["tune_link"] == "1gbit" and second["tune_link"] == "off"
    chosen = cells[tuned]["chosen"]
    first_summary = json.loads(
        (out / "jobs" / f"loss-{slug}-w2-x1-s0" / "summary.json").read_text()
    )
    assert chosen == first_summary["link_tuning"]["settings"]
    for key, value in chosen.items():
        assert second[key] == value and config(f"time-{slug}-w2-1gbit")[key] == value
    assert set(cells[tuned]["step_time_s"]) == {"1gbit"}
    (row,) = results["tuned"]
    assert row["cell"] == tuned and row["untuned"] == off
    assert row["gap"] == pytest.approx(
        cells[tuned]["val_loss_mean"] / cells[off]["val_loss_mean"] - 1
    )
    assert row["step_s"]["measured"] == cells[tuned]["step_time_s"]["1gbit"]
    # the timing job predicted its own steps: the tuner ran at its start-up on its link with
    # every tuned setting given, so it kept them all and timed its own compute
    timed = config(f"time-{slug}-w2-1gbit")
    assert timed["tune_link"] == "auto" and timed["link"] == "1gbit"
    for key in ("compression", "overlap", "num_fragments", "sync_warmup"):
        assert timed[key] is not None, key
    timed_summary = json.loads(
        (out / "jobs" / f"time-{slug}-w2-1gbit" / "summary.json").read_text()
    )
    own = timed_summary["link_tuning"]
    assert own["settings"] == {}
    assert row["step_s"]["predicted"] == own["step_s"]
    assert row["warm_step_s"]["predicted"] == own["warm_step_s"]
    assert row["expected_cost"] == first_summary["link_tuning"]["cost"]
    assert "Tuned for the link against untuned" in (out / "convergence.md").read_text()

    # --reuse keeps the finished jobs: the same numbers, no job runs again
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "jobs").glob("*/summary.json")}
    again = run_convergence(
        ConvergenceSpec(**{**spec.__dict__, "reuse": True}), progress=notes.append
    )
    assert all(n.endswith("(reused)") for n in notes[9:])
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    assert [c["val_loss_final"] for c in again["cells"]] == [
        c["val_loss_final"] for c in results["cells"]
    ]


def test_cli_keeps_convergence_and_matrix_flags_apart(tmp_path, capsys):
    assert main(["bench", "--convergence", "--quick"]) == 2
    assert "pick one" in capsys.readouterr().err
    assert main(["bench", "--convergence", "--real-links", "none"]) == 2
    assert "--real-links is a flag of the bench matrix" in capsys.readouterr().err
    assert main(["bench", "--seeds", "1,2", "--out", str(tmp_path / "m")]) == 2
    assert "--seeds is a flag of --convergence" in capsys.readouterr().err
    assert main(["bench", "--lengths", "4", "--out", str(tmp_path / "m")]) == 2
    assert "--lengths is a flag of --convergence" in capsys.readouterr().err
    assert main(["bench", "--convergence", "--long", "--lengths", "4"]) == 2
    assert "--long is --lengths 1,4" in capsys.readouterr().err
    # --lengths reaches the harness's spec (refused there, before any job runs)
    assert main(["bench", "--convergence", "--lengths", "0", "--out", str(tmp_path)]) == 2
    assert "lengths: need integers >= 1" in capsys.readouterr().err
    assert main(["bench", "--convergence", "--algos", "ddp,nope", "--out", str(tmp_path)]) == 2
    assert "unknown algorithm 'nope'" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "results.json")


def test_an_entry_that_names_its_link_times_what_its_loss_job_chose(tmp_path):
    # co2/tune_link=10mbit: the first loss job chooses for the link; its timing jobs (short,
    # on every link) and other seeds take that choice as given instead of choosing again
    from lowcomm.bench.convergence import _names_link

    assert _names_link("co2/tune_link=10mbit") and not _names_link("co2/tune_link=off")
    assert not _names_link("co2") and not _names_link("co2/tune_link=auto")
    spec = ConvergenceSpec(out=str(tmp_path), algos=["ddp", "co2/tune_link=10mbit"])
    first = spec.train_config("co2/tune_link=10mbit", 2, 0)
    assert first.tune_link == "10mbit"  # the first loss job chooses
    chosen = {"compression": "int4", "sync_warmup_compression": "int2"}
    timing = spec.train_config("co2/tune_link=10mbit", 2, 0, 1, "1mbit", settings=chosen)
    assert timing.tune_link == "off" and timing.link == "1mbit"
    kwargs = timing.algorithm_kwargs()
    assert kwargs["compression"] == "int4" and kwargs["sync_warmup_compression"] == "int2"
    assert timing.sync_warmup_steps() == timing.steps // 2  # its own warm start, timed apart
    other_seed = spec.train_config("co2/tune_link=10mbit", 2, 1, settings=chosen)
    assert other_seed.tune_link == "off" and other_seed.algorithm_kwargs()["compression"] == "int4"


def test_the_harness_gives_an_entrys_first_choice_to_its_other_jobs(tmp_path, monkeypatch):
    # the harness's scheduling alone (its jobs stand in for lowcomm train): the first loss job
    # of co2/tune_link=10mbit chooses int4 for the link; its other seed's loss job and its
    # timing job on each link run int4 as given, choosing nothing again
    import lowcomm.bench.convergence as convergence

    ran = []

    def job(cfg, reuse):
        ran.append(cfg)
        k = cfg.sync_warmup_steps()
        evals = [(0, 0.0), (cfg.steps, 0.1 * cfg.steps)] + ([(k, 0.2 * k)] if k else [])
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "metrics.jsonl"), "w", encoding="utf-8") as f:
            for step, train_s in sorted(evals):
                record = {"kind": "eval", "step": step, "tokens": step, "train_s": train_s}
                f.write(json.dumps({**record, "val_loss": 5.0 - step / cfg.steps}) + "\n")
        choosing = cfg.tune_link not in ("off", "auto")
        summary = {
            "val_loss_final": 4.0,
            "tokens": 100 * cfg.steps,
            "train_time_s": 0.1 * cfg.steps,
        }
        summary["link_tuning"] = {"settings": {"compression": "int4"}} if choosing else None
        return summary, False

    monkeypatch.setattr(convergence, "_job", job)
    spec = ConvergenceSpec(
        out=str(tmp_path),
        algos=["ddp", "co2/tune_link=10mbit"],
        workers=[2],
        seeds=[0, 1],
        links=["1mbit", "100mbit"],
        steps=24,
        timing_steps=12,
    )
    run_convergence(spec)
    co2 = [cfg for cfg in ran if cfg.algo == "co2"]
    assert [(cfg.seed, cfg.link) for cfg in co2] == [
        (0, None),
        (1, None),
        (0, "1mbit"),
        (0, "100mbit"),
    ]
    assert co2[0].tune_link == "10mbit"  # the first chooses
    for cfg in co2[1:]:
        assert cfg.tune_link == "off" and cfg.algorithm_kwargs()["compression"] == "int4"
