"""``lowcomm bench``: the matrix bookkeeping (pure), a tiny real run end to end, the CLI's
errors. Speeds are never asserted: only that they are measured and combined correctly."""

from __future__ import annotations

import json
import os

import pytest

from lowcomm.bench import BenchSpec, Cell, interpolate_time_to_target, run_bench
from lowcomm.bench.report import format_markdown
from lowcomm.bench.results import assemble_results as _assemble
from lowcomm.cli import main

TINY = {"n_layer": 1, "n_embd": 32, "n_head": 2, "batch_size": 4, "block_size": 16}


def test_time_to_target_interpolates_between_evaluations():
    curve = [(0, 0.0, 5.0), (10, 2.0, 4.0), (20, 4.0, 3.0), (30, 6.0, 2.5)]
    assert interpolate_time_to_target(curve, 3.5) == pytest.approx(3.0)
    assert interpolate_time_to_target(curve, 3.0) == pytest.approx(4.0)  # reached exactly
    assert interpolate_time_to_target(curve, 6.0) == 0.0  # already there at the start
    assert interpolate_time_to_target(curve, 2.0) is None  # never reached
    assert interpolate_time_to_target([(0, 0.0, 5.0), (1, 1.0, 5.0)], 5.0) == 0.0


def test_cells_cover_the_matrix_in_order():
    spec = BenchSpec(algos=["ddp", "co2"], links=["1gbit", "100mbit"], workers=[2, 4])
    cells = spec.cells()
    assert len(cells) == 2 * 2 * 2 and {c.role for c in cells} == {"matrix"}
    assert cells[0] == Cell("ddp", 2, "1gbit") and cells[-1] == Cell("co2", 4, "100mbit")
    assert len({c.id for c in cells}) == len(cells)
    cfg = spec.train_config(cells[0], "out")
    assert cfg.ceiling_steps == spec.ceiling_steps and cfg.link == "1gbit" and cfg.quiet
    # an algorithm with settings of its own sits beside the plain one
    spec = BenchSpec(algos=["co2", "co2+int8/overlap=12/sync_warmup=0"], links=["100mbit"])
    spec.validate()
    plain, variant = (spec.train_config(c, "out") for c in spec.cells())
    assert (variant.algo, variant.value("overlap"), variant.value("sync_warmup")) == ("co2", 12, 0)
    assert variant.value("compression") == "int8" and plain.value("overlap") is None
    assert variant.out != plain.out


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"algos": ["co3"]}, "algos: unknown algorithm 'co3'"),
        ({"algos": ["none"]}, "algos: unknown algorithm 'none'"),
        ({"links": ["fast"]}, "fast"),
        ({"workers": [0]}, "workers: need worker counts >= 1"),
        ({"steps": 25}, "steps (25) must be a multiple of sync_every (12)"),
        ({"overhead_algos": ["ddp"]}, "overhead_algos: 'ddp' has no lowcomm hook"),
        ({"overhead_algos": ["co2/overlap=2"]}, "takes no /KEY=VALUE settings"),
        ({"algos": ["co2/overlap"]}, "that is not KEY=VALUE"),
        ({"algos": ["co2/overlap=0"]}, "overlap"),
        ({"target_loss": -1.0}, "target_loss: must be > 0"),
        ({"ceiling_steps": 1}, "ceiling_steps: must be >= 2"),
        ({"train_overrides": {"n_head": 3}}, "n_head"),
    ],
)
def test_bad_settings_are_refused_before_anything_runs(tmp_path, changes, message):
    spec = BenchSpec(out=str(tmp_path / "b"), **changes)
    with pytest.raises(ValueError) as info:
        run_bench(spec)
    assert message in str(info.value)
    assert not os.path.exists(tmp_path / "b" / "cells")


def _row(algo, link, tokens_per_s, ceiling, halves, val, curve):
    return {
        "id": f"{algo}-{link}-w2",
        "role": "matrix",
        "algo": algo,
        "workers": 2,
        "link": link,
        "shaping": "emulated",
        "link_bandwidth_bps": 1e8,
        "tokens_per_s": tokens_per_s,
        "ceiling_tokens_per_s": ceiling,
        "ceiling_segments_tokens_per_s": halves,
        "ratio_to_ceiling": tokens_per_s / ceiling,
        "val_loss_final": val,
        "curve": curve,
        "payload_bytes_per_worker_step": 0.0,
        "wire_bytes_per_worker_step": 0.0,
        "hidden_fraction": None,
        "parameters": 10,
    }


def test_assemble_reports_ceilings_noise_target_and_goals(tmp_path):
    spec = BenchSpec(algos=["co2", "ddp"], links=["100mbit"], workers=[2], out=str(tmp_path))
    rows = [
        _row(
            "co2", "100mbit", 950.0, 1050.0, [1000.0, 1100.0, 1050.0, 1050.0], 3.2,
            [(0, 0.0, 5.0), (1, 10.0, 3.2)],
        ),
        _row(
            "ddp", "100mbit", 300.0, 1000.0, [990.0, 1010.0], 3.0,
            [(0, 0.0, 5.0), (1, 20.0, 4.0), (2, 40.0, 3.0)],
        ),
    ]  # fmt: skip
    results = _assemble(spec, rows, None, "not requested", False)
    ceiling = results["ceilings"][0]
    assert ceiling["tokens_per_s"] == pytest.approx(1025.0)  # median of the cells' ceilings
    assert ceiling["drift"] == pytest.approx(50.0 / 1025.0)
    # noise: the standard error of each cell's ceiling over its segments, median over cells
    co2_se = (5000 / 3) ** 0.5 / 4**0.5 / 1050  # stdev of 1000, 1100, 1050, 1050 over sqrt(4)
    ddp_se = 200**0.5 / 2**0.5 / 1000
    assert results["noise"] == pytest.approx((co2_se + ddp_se) / 2)
    assert results["noise_max"] == pytest.approx(co2_se)
    assert results["model"]["parameters"] == 10
    co2, ddp = results["cells"]
    # default target: the highest final loss of the matrix (3.2), which both reach
    assert results["target_loss"] == 3.2
    assert co2["time_to_target_s"] == pytest.approx(10.0)
    assert ddp["time_to_target_s"] == pytest.approx(20.0 + 20.0 * 0.8)
    goals = {g["goal"].split(":")[0]: g for g in results["goals"]}
    co2_goal = goals["CO2 on emulated 100mbit, 2 workers"]
    assert co2_goal["met"] is False and co2_goal["value"] == pytest.approx(950 / 1050)
    assert goals["DDP on emulated 100mbit, 2 workers"]["met"] is True
    # each ratio known to about its ceiling's standard error, shown beside it
    assert co2_goal["noise"] == pytest.approx(950 / 1050 * co2_se)
    text = format_markdown({**results, "elapsed_s": 1.0})
    assert "| 90.5% ± 1.8% | **missed** by 4.5% |" in text  # 95% - 90.5%, beyond the noise
    assert "| 30.0% ± 0.3% | met |" in text
    assert "not measured" in text  # no overhead micro-benchmark in this run
    # a verdict closer to the limit than the noise says so
    rows[0] = _row("co2", "100mbit", 990.0, 1050.0, [1000.0, 1100.0, 1050.0, 1050.0], 3.2,
                   [(0, 0.0, 5.0), (1, 10.0, 3.2)])  # fmt: skip
    close = format_markdown({**_assemble(spec, rows, None, "not requested", False), "elapsed_s": 1})
    assert "| 94.3% ± 1.8% | **missed** by 0.7% (within the ceiling's noise) |" in close


def test_tiny_bench_end_to_end(tmp_path):
    out = tmp_path / "bench"
    spec = BenchSpec(
        algos=["co2", "ddp"],
        links=["100mbit"],
        workers=[2],
        steps=12,
        sync_every=6,
        eval_every=6,
        eval_batches=1,
        real_links=[],
        overhead_algos=["co2"],
        overhead_rounds=1,
        memory_workers=[2],
        ceiling_steps=4,
        # the bytes below are fp32's: the codec the link would choose is tests/test_tune.py's
        train_overrides={**TINY, "tune_link": "off"},
        out=str(out),
    )
    notes: list[str] = []
    results = run_bench(spec, command="lowcomm bench (test)", progress=notes.append)
    for name in ("results.json", "results.md", "throughput.png", "loss_vs_time.png"):
        assert (out / name).stat().st_size > 0
    with open(out / "results.json") as f:
        saved = json.load(f)
    assert saved["cells"] == json.loads(json.dumps(results["cells"]))
    assert len([n for n in notes if n.startswith("[")]) == 2  # one job per cell
    params = saved["model"]["parameters"]
    cells = {c["algo"]: c for c in saved["cells"]}
    for c in cells.values():
        # each cell against the ceiling timed in its own processes, before and after training
        assert len(c["ceiling_segments_tokens_per_s"]) == 2
        assert c["ratio_to_ceiling"] == pytest.approx(c["tokens_per_s"] / c["ceiling_tokens_per_s"])
        assert c["tokens"] == 12 * 2 * 4 * 16
        assert [p[0] for p in c["curve"]] == [0, 6 * 128, 12 * 128]
        assert c["time_to_target_s"] is not None  # the default target is reached by all
    # bytes per worker per step: DDP all-reduces every gradient every step; CO2 the model once
    # per round of 6 steps (2 workers: the ring's wire bytes equal the payload)
    assert cells["ddp"]["payload_bytes_per_worker_step"] == pytest.approx(4 * params)
    assert cells["co2"]["payload_bytes_per_worker_step"] == pytest.approx(4 * params / 6)
    assert cells["co2"]["wire_bytes_per_worker_step"] == pytest.approx(4 * params / 6)
    overhead = saved["overhead"]["algorithms"][0]
    # the job's CO2 (overlap=1) launches a round's all-reduce 1 step before the round ends and
    # applies it at the end: two steps of outer work per round
    assert overhead["algo"] == "co2" and overhead["outer_calls"] == 2
    assert overhead["inner_hook_calls"] == 4 and overhead["hook_fraction"] > 0
    text = (out / "results.md").read_text()
    assert "| co2 | 2 | 100mbit (emulated) |" in text and "| ddp | 2 | 100mbit (emulated) |" in text
    # memory report: every shardable algorithm, both ways; sharded state is half (+ padding)
    memory = {(r["algo"], r["sharded"]): r for r in saved["memory"]["rows"]}
    assert set(memory) == {(a, s) for a in ("co2", "diloco", "streaming") for s in (False, True)}
    assert memory[("co2", False)]["state_bytes"] == 4 * 4 * params  # anchor, m, c, u
    # measured on the algorithm's own rounds, not a warm start's: DiLoCo's momentum exists
    assert memory[("diloco", False)]["state_bytes"] == 2 * 4 * params  # anchor, momentum
    for algo in ("co2", "diloco", "streaming"):
        assert 0.5 <= memory[(algo, True)]["state_vs_unsharded"] <= 0.5 + 1e-3
    assert "## Memory per rank" in text and "| co2 | sharded | 2 |" in text


def test_cli_refuses_previous_results_and_bad_lists(tmp_path, capsys):
    out = tmp_path / "b"
    out.mkdir()
    (out / "results.json").write_text("{}")
    assert main(["bench", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lowcomm bench: error: --out") and "--overwrite" in err
    assert "\n" not in err
    assert main(["bench", "--algos", "co2,fast", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "unknown algorithm 'fast'" in err
    assert main(["bench", "--workers", "two"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


# --- lowcomm bench --balance ------------------------------------------------------------------


def test_balance_jobs_interleave_assignments_and_lay_out_the_splitting_section(tmp_path):
    from lowcomm.balance import load_documents
    from lowcomm.bench.balance import (
        ASSIGNMENTS,
        DOMINANT_CORPUS,
        BalanceSpec,
        write_dominant_corpus,
    )
    from lowcomm.train.config import config_from_dict

    spec = BalanceSpec(cycles=3, round_cycles=2, split_cycles=4, sync_every=4, out=str(tmp_path))
    corpus = os.path.join(spec.out, DOMINANT_CORPUS)
    counts = write_dominant_corpus(corpus, long_tokens=8192, long_every=128)
    assert counts["short"] == 128 * counts["long"] and counts["long"] > 20
    lengths = sorted(len(d) for d in load_documents(corpus).train)
    assert lengths[-1] > 8192 and lengths[len(lengths) // 2] <= 256
    jobs = spec.jobs()
    assert [(j["section"], j["algo"]) for j in jobs] == [
        ("assignment", "ddp"),
        ("assignment", "co2"),
        ("splitting", "ddp"),
        ("splitting", "ddp"),
        ("splitting", "ddp"),
    ]
    ddp, co2 = jobs[0]["cfg"], jobs[1]["cfg"]
    assert ddp["balance"].split(",") == list(ASSIGNMENTS.values())
    assert ddp["steps"] == 3 * 7 and co2["steps"] == 2 * 6 * 4
    assert "remap" not in co2["balance"].split(",")  # it balances steps, not rounds
    layouts = [(j["cfg"].get("nodes", 1), j["cfg"]["link"]) for j in jobs[2:]]
    assert layouts == [(1, None), (2, "100mbit"), (4, "100mbit")]
    assert all(j["cfg"]["data"] == corpus for j in jobs[2:]) and ddp["data"] is None
    for job in jobs:  # every job is a valid lowcomm train configuration
        cfg = config_from_dict(job["cfg"], source="test")
        assert cfg.documents and cfg.world_size == 4
    with pytest.raises(ValueError, match="unknown assignment"):
        BalanceSpec(assignments=["fastest"])
    with pytest.raises(ValueError, match="give one"):
        BalanceSpec(corpus="lognormal", data="mine.jsonl")


def test_lognormal_corpus_follows_its_stated_distribution():
    from lowcomm.balance import lognormal_texts

    texts = lognormal_texts(seed=3)
    lengths = sorted(len(t) for t in texts)
    assert len(texts) == 2000 and lengths[0] >= 18 and lengths[-1] == 8192
    assert 260 <= lengths[1000] <= 345  # the median, 300 (its sampling spread is ~ 4%)
    # sigma 1.2: the quartiles at 300 exp(+-0.674 x 1.2) = 134 and 673
    assert 115 <= lengths[500] <= 155 and 580 <= lengths[1500] <= 780
    assert lognormal_texts(seed=3) == texts and lognormal_texts(seed=4) != texts
    words = " ".join(texts).split()
    top = max(set(words[:20000]), key=words[:20000].count)
    assert words[:20000].count(top) > 0.05 * 20000  # Zipf: the commonest word is frequent


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--balance", "--quick"], "run of its own"),
        (["--balance", "--links", "1gbit"], "--links is not a flag of --balance"),
        (["--balance", "--workers", "2,4"], "one worker count"),
        (["--block-size", "64"], "--block-size is a flag of --balance"),
        (["--cost-model", "--workers", "2"], "not a flag of --cost-model"),
    ],
)
def test_balance_flags_are_checked(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_tiny_balance_bench_end_to_end(tmp_path):
    from lowcomm.bench.balance import BalanceSpec, run_balance

    spec = BalanceSpec(
        workers=2,
        algos=["ddp"],
        assignments=["random", "cost-balanced"],
        cycles=2,
        block_size=64,
        batch_size=1,
        n_layer=1,
        n_embd=16,
        splitting=False,
        corpus="lognormal",
        out=str(tmp_path / "bal"),
    )
    results = run_balance(spec, command="test")
    job = json.loads(
        (tmp_path / "bal" / "jobs" / "assignment-ddp-1-node" / "config.json").read_text()
    )
    assert job["data"] == str(tmp_path / "bal" / "lognormal.jsonl")
    rows = results["rows"]
    assert [r["assignment"] for r in rows] == ["random", "cost-balanced"]
    for r in rows:
        assert r["units"] == 1 and 0.0 <= r["idle_fraction"] < 1.0 and r["tokens_per_s"] > 0
    text = (tmp_path / "bal" / "balance.md").read_text()
    assert "| ddp | 1 node | cost-balanced |" in text and "Command: `test`" in text
    assert json.loads((tmp_path / "bal" / "results.json").read_text())["rows"] == rows


def test_a_real_link_cell_chooses_its_settings_as_its_emulated_twin_does(tmp_path):
    from lowcomm.bench.matrix import _validation_cells

    spec = BenchSpec(algos=["co2"], links=["100mbit"], workers=[2], out=str(tmp_path))
    real, twin = [c for c in _validation_cells(spec, latency_applied=False) if c.algo == "co2"]
    assert (real.shaping, twin.shaping, twin.link) == ("real", "emulated", "100mbit:0ms")
    configs = [spec.train_config(c, spec.out) for c in (real, twin)]
    # the real job runs without --link, so it is told the link its twin emulates
    assert configs[0].link is None and configs[1].link == "100mbit:0ms"
    assert configs[0].tune_link == configs[1].tune_link == "100mbit:0ms"
    # a tune_link the user gives holds for both
    given = BenchSpec(
        algos=["co2"],
        links=["100mbit"],
        workers=[2],
        out=str(tmp_path),
        train_overrides={"tune_link": "off"},
    )
    pair = [given.train_config(c, given.out) for c in _validation_cells(given, True)]
    assert {c.tune_link for c in pair} == {"off"}


# --- the codec row: each codec against a clone of its buckets ----------------------------------


def test_gpt_layout_is_whole_blocks_of_lowcomm_gpt():
    from lowcomm.bench.codec import gpt_shapes, single_shapes
    from lowcomm.models.gpt import Block, GPTConfig

    shapes = gpt_shapes(85_000_000)  # GPT-2 small's 12 blocks of width 768
    block = Block(GPTConfig(vocab_size=1, n_layer=1, n_head=1, n_embd=768))
    assert shapes == [p.shape for p in block.parameters()] * 12
    assert sum(s.numel() for s in shapes) == 85_054_464
    # the widest width (a multiple of 128, no quantiser block padded) within 5% of N
    for n, width, blocks in ((1_000_000, 128, 5), (10_000_000, 640, 2)):
        shapes = gpt_shapes(n)
        assert len(shapes) == 12 * blocks and shapes[-1] == (width,)
        assert abs(sum(s.numel() for s in shapes) - n) < 0.05 * n
        assert all(s.numel() % 128 == 0 for s in shapes)
    assert single_shapes(10_000) == [(10, 1024)]


def test_codec_row_times_each_codec_against_a_clone():
    import math

    import torch
    import torch.distributed as dist

    from lowcomm.bench import measure_codecs

    threads = torch.get_num_threads()
    row = measure_codecs(["int8", "topk:0.01"], [0.01], repeats=2, threads=1)
    assert not dist.is_initialized() and torch.get_num_threads() == threads  # left as found
    assert row["threads"] == 1 and row["max_repeats"] == 2
    rows = {(r["codec"], r["layout"]): r for r in row["rows"]}
    assert list(rows) == [("int8", "gpt"), ("topk:0.01", "gpt"), ("int8", "single"),
                          ("topk:0.01", "single")]  # fmt: skip
    for r in rows.values():
        for key in ("clone_s", "copy_s", "codec_s", "launch_s", "wait_s"):
            assert r[key] > 0 and math.isfinite(r[key]), key
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0 and r["ratio_to_copy"] > 0
        assert r["codec_s"] == pytest.approx(r["launch_s"] + r["wait_s"], rel=0.5)
        assert 1 <= r["repeats"] <= 2 and r["buckets"] == 1
        assert 0 < r["payload_bytes"] < 4 * r["parameters"]  # compressed
    assert (rows["int8", "gpt"]["parameters"], rows["int8", "gpt"]["tensors"]) == (12_704, 12)
    assert (rows["int8", "single"]["parameters"], rows["int8", "single"]["tensors"]) == (10_240, 1)


def test_codec_goal_takes_the_worst_goal_codec_at_10m():
    from lowcomm.bench.report import format_codec
    from lowcomm.bench.results import codec_goal

    def entry(codec, layout, size, ratio):
        return {"codec": codec, "layout": layout, "size_m": size, "ratio": ratio,
                "ratio_to_copy": 2 * ratio, "codec_s": ratio * 1e-3, "clone_s": 1e-3,
                "copy_s": 5e-4}  # fmt: skip

    rows = [
        entry("int8", "gpt", 1.0, 30.0),  # another size: not the goal's
        entry("int8", "gpt", 10.0, 7.0),
        entry("topk:0.01", "gpt", 10.0, 9.5),
        entry("sign", "gpt", 10.0, 40.0),  # not a goal codec
        entry("int4", "single", 10.0, 20.0),  # not the goal's layout
    ]
    row = {"threads": 1, "bucket_cap_mb": 25.0, "max_repeats": 5}
    goal = codec_goal({**row, "rows": rows})
    assert goal["value"] == 9.5 and goal["met"] is False
    assert "(int8, topk:0.01; worst)" in goal["goal"]
    assert codec_goal({**row, "rows": rows[1:2]})["met"] is True
    assert codec_goal(None)["value"] is None  # not measured
    text = "\n".join(format_codec({**row, "rows": rows}))
    assert "| codec | layout | 1 M | 10 M |" in text
    assert "| topk:0.01 | gpt | - | 9.5x / 19.0x (9.50 ms) |" in text
    assert "| *clone (ms)* | gpt | 1.00 | 1.00 |" in text


def test_codec_only_run_writes_the_row_and_its_goal(tmp_path, capsys):
    out = tmp_path / "codec"
    argv = ["bench", "--codec-only", "--codecs", "int8,topk:0.01", "--codec-sizes", "0.01",
            "--codec-repeats", "1", "--workers", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "| int8 | gpt |" in printed.out and "codec topk:0.01, 0.01 M" in printed.err
    saved = json.loads((out / "results.json").read_text())
    assert [r["codec"] for r in saved["codec"]["rows"]] == ["int8", "topk:0.01"] * 2
    assert saved["goals"][0]["met"] is None  # no 10 M entry
    assert "lowcomm bench --codec-only" in (out / "codec.md").read_text()
    assert main(argv) == 2  # results already there
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--codec-only", "--codec-sizes", "0"], "codec_sizes: 0.0 is not a size in millions"),
        (["--codec-only", "--codec-sizes", "ten"], "comma-separated numbers such as 1,10,85"),
        (["--codec-only", "--codecs", "int9"], "codecs: unknown compression 'int9'"),
        (["--codec-only", "--codecs", "none"], "give at least one codec, e.g. --codecs int8"),
        (["--codec-only", "--codec-repeats", "0"], "must be an integer >= 1 (--codec-repeats)"),
        (["--codec-only", "--links", "1gbit"], "--links is not a flag of --codec-only"),
        (["--codec-only", "--workers", "2,4"], "one worker's share of the cores: --workers N"),
        (["--codec-only", "--quick"], "--codec-only is a run of its own"),
        (["--codec-only", "--no-codec"], "drop --no-codec"),
        (["--no-codec", "--codec-sizes", "1"], "--codec-sizes is a flag of the codec row"),
        (["--codecs", "int9"], "codecs: unknown compression 'int9'"),
        (["--balance", "--codecs", "int8"], "--codecs is not a flag of --balance"),
        (["--convergence", "--codec-sizes", "1"], "--codec-sizes is a flag of the bench matrix"),
    ],
)
def test_codec_flags_are_checked_before_anything_runs(tmp_path, argv, message, capsys):
    assert main(["bench", *argv, "--out", str(tmp_path / "b")]) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "b")
