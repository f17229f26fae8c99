"""Checkpoints and exact resume of `lowcomm train`.

A run whose worker is really killed (SIGKILL, through the test-only fault hook) at some step and
that is then resumed from its latest complete checkpoint ends bit-identical to an uninterrupted
run: every rank's full state at the last step (model, inner optimizer, algorithm state with its
anchors and in-flight results, RNG states), rank 0's final model, and the metrics. One
uninterrupted run per algorithm is shared by its cases.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lowcomm.cli import main
from lowcomm.testing.jobs import TINY_JOB_ALGO_ARGS, TINY_JOB_ARGS, run_train_job
from lowcomm.testing.runs import assert_same_run
from lowcomm.train import checkpoint as ckpt
from lowcomm.train.config import ConfigError, TrainConfig, config_from_dict
from lowcomm.train.loop import FAULT_ENV

REFERENCE_EVERY = 3  # the uninterrupted runs checkpoint at 3, 6, 9, 12

# (algo, checkpoint_every, rank killed, step killed at): the run resumes from the last multiple
# of checkpoint_every before the kill.
CASES = [
    # mid-round; the checkpoint of step 9 holds round 2's all-reduce, completed, not applied
    pytest.param("co2", 3, 1, 10, id="co2-mid-round"),
    # right after round 2's all-reduce was launched (in flight; rank 1, step 8, resumes from
    # step 4) is test_reliability_script's kill point, with the same bit-identical comparison
    pytest.param("co2-eager", 3, 1, 7, id="co2-eager"),
    pytest.param("diloco", 3, 0, 10, id="diloco-rank0-dies"),
    pytest.param("slowmo", 3, 1, 11, id="slowmo"),
    pytest.param("localsgd", 3, 1, 5, id="localsgd"),
    # resumes from step 9, where fragment 0's all-reduce (launched at step 9) is in flight
    pytest.param("streaming", 3, 1, 10, id="streaming-overlap-1"),
    pytest.param("cocodc", 3, 1, 5, id="cocodc"),
    pytest.param("noloco", 3, 1, 8, id="noloco"),
    # mid-round: the error-feedback accumulators come back from the step-9 checkpoint
    pytest.param("sparseloco", 3, 1, 10, id="sparseloco"),
    pytest.param("demo", 3, 0, 7, id="demo"),
    pytest.param("ddp", 3, 1, 8, id="ddp"),
]


def _flags(algo: str) -> list[str]:
    return ["--algo", algo, *TINY_JOB_ARGS, *TINY_JOB_ALGO_ARGS[algo]]


def _argv(algo: str, out: str, *extra: str) -> list[str]:
    return ["train", *_flags(algo), "--out", out, *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: Any) -> Callable[[str], str]:
    """The uninterrupted run of an algorithm (made once per module), by algorithm."""
    runs: dict[str, str] = {}

    def get(algo: str) -> str:
        if algo not in runs:
            out = str(tmp_path_factory.mktemp("reference") / algo)
            run_train_job(out, *_flags(algo), "--checkpoint-every", str(REFERENCE_EVERY))
            runs[algo] = out
        return runs[algo]

    return get


def test_every_algorithm_has_a_kill_point() -> None:
    """Every ``--algo`` of the registry that synchronises is killed and resumed above."""
    assert {case.values[0] for case in CASES} == set(TINY_JOB_ALGO_ARGS)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("algo", "every", "rank", "step"), CASES)
def test_killed_and_resumed_run_is_bit_identical(
    algo: str,
    every: int,
    rank: int,
    step: int,
    reference: Callable[[str], str],
    tmp_path: Any,
    monkeypatch: Any,
    capsys: Any,
) -> None:
    ref = reference(algo)
    out = str(tmp_path / "run")
    argv = _argv(algo, out, "--checkpoint-every", str(every))
    capsys.readouterr()
    monkeypatch.setenv(FAULT_ENV, f"{rank}:{step}")
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1] == f"lowcomm train: error: worker rank {rank} failed: killed by signal 9 (SIGKILL)"
    )
    start = (step - 1) // every * every
    assert [s for s, _ in ckpt.complete_checkpoints(out)][-1] == start
    monkeypatch.delenv(FAULT_ENV)
    assert main([*argv, "--resume"]) == 0
    assert_same_run(ref, out, resumed_at=[start])
    # the last keep_checkpoints (3) complete checkpoints are kept, no partial one is left
    names = sorted(os.listdir(os.path.join(out, ckpt.CHECKPOINTS)))
    assert names == [f"step-{s:06d}" for s in range(12 - 2 * every, 13, every)]


# --- refusals: no worker is started -----------------------------------------------------------


def _one_error_line(capsys: Any) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_checkpoint_resumes_whatever_heal_it_was_written_with() -> None:
    # how a later heal moves the state is not the state: a checkpoint written with heal
    # blocking and heal_inner bf16 (values every checkpoint held before the job chose them)
    # resumes a run that gives neither, or gives others
    cfg = TrainConfig()
    saved = {**cfg.to_dict(), "heal": "blocking", "heal_inner": "bf16"}
    assert (cfg.heal, cfg.heal_inner) == (None, None)
    assert ckpt.config_difference(saved, cfg) is None
    other = cfg.replace(heal="background", heal_inner="none")
    assert ckpt.config_difference(saved, other) is None
    # (the training's own settings still count)
    assert ckpt.config_difference({**saved, "seed": 1}, cfg) == ("seed", 1, 0)


@pytest.mark.timeout(240)
def test_resume_refuses_other_settings_naming_the_difference(
    reference: Callable[[str], str], capsys: Any, tmp_path: Any
) -> None:
    ref = reference("co2")
    step9 = os.path.join(ref, ckpt.CHECKPOINTS, "step-000009")
    cases = [
        (["--n-embd", "64"], "was written with n_embd=32 but this run has n_embd=64"),
        (["--algo", "diloco"], "was written with algo='co2' but this run has algo='diloco'"),
        (["--outer-lr", "0.7"], "was written with outer_lr=None but this run has outer_lr=0.7"),
        (["--seed", "1"], "was written with seed=0 but this run has seed=1"),
        (["--workers", "3"], "was written by 2 workers but this run has 3"),
    ]
    for extra, expected in cases:
        assert main([*_argv("co2", ref), *extra, "--resume", step9]) == 2
        line = _one_error_line(capsys)
        assert line.startswith(f"lowcomm train: error: --resume checkpoint {step9!r}"), line
        assert expected in line, line
    # what only changes reporting may differ
    cfg = config_from_dict(
        dict(**{**_config(ref), "eval_every": 8, "log_every": 3, "quiet": False})
    )
    assert ckpt.config_difference(_config(ref), cfg) is None
    # a run folder, its checkpoints folder and a step folder all resolve; the latest is 12
    latest = os.path.join(ref, ckpt.CHECKPOINTS, "step-000012")
    assert ckpt.find_checkpoint(ref, None) == latest
    assert ckpt.find_checkpoint(os.path.join(ref, ckpt.CHECKPOINTS), None) == latest
    assert ckpt.find_checkpoint(ckpt.LATEST, ref) == latest
    assert ckpt.find_checkpoint(step9, None) == step9
    # no checkpoint, or resume with overwrite
    empty = str(tmp_path / "empty")
    assert main([*_argv("co2", empty), "--resume"]) == 2
    assert "--resume found no complete checkpoint in" in _one_error_line(capsys)
    assert main([*_argv("co2", empty), "--resume", "--overwrite"]) == 2
    assert "--resume cannot be combined with overwrite" in _one_error_line(capsys)
    assert main(["train", "--resume"]) == 2
    assert "--resume without a path needs out (--out)" in _one_error_line(capsys)


def _config(run: str) -> dict[str, Any]:
    with open(os.path.join(run, "config.json")) as f:
        values = json.load(f)
    values.pop("resolved")
    return values


def test_resume_path_gives_the_run_folder() -> None:
    cfg = TrainConfig(resume="runs/co2-x/checkpoints/step-000120").with_paths()
    assert (cfg.out, cfg.name) == (os.path.join("runs", "co2-x"), "co2-x")
    assert ckpt.run_folder_of("runs/a/checkpoints") == os.path.join("runs", "a")
    assert ckpt.run_folder_of("runs/a/") == os.path.join("runs", "a")
    assert TrainConfig(resume="latest", out="x").with_paths().out == "x"
    with pytest.raises(ConfigError, match="needs out"):
        TrainConfig(resume="latest").with_paths()


def test_only_complete_checkpoints_count(tmp_path: Any) -> None:
    out = str(tmp_path)
    root = tmp_path / ckpt.CHECKPOINTS
    for step, complete in ((3, True), (6, True), (9, False)):
        folder = root / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / "rank-0.pt").write_bytes(b"")
        if complete:
            (folder / ckpt.MANIFEST).write_text(json.dumps({"format": 1, "world_size": 1}))
    (root / ".step-000012.partial").mkdir()
    assert [s for s, _ in ckpt.complete_checkpoints(out)] == [3, 6]
    assert ckpt.find_checkpoint(ckpt.LATEST, out) == str(root / "step-000006")
    with pytest.raises(ConfigError, match="is not a complete checkpoint"):
        ckpt.find_checkpoint(str(root / "step-000009"), None)
    ckpt.discard_after(out, 3)
    assert sorted(os.listdir(root)) == ["step-000003", "step-000009"]  # incomplete: not a step


def test_metrics_are_cut_back_to_the_checkpoint(tmp_path: Any) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [{"kind": "eval", "step": 0}, {"kind": "step", "step": 2}, {"kind": "step", "step": 4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "st')
    ckpt.truncate_metrics(str(path), 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 2]


@pytest.mark.timeout(240)
def test_a_damaged_checkpoint_is_refused_naming_the_file(
    reference: Callable[[str], str], capsys: Any, tmp_path: Any
) -> None:
    run = str(tmp_path / "run")
    shutil.copytree(reference("co2"), run)
    step12 = os.path.join(run, ckpt.CHECKPOINTS, "step-000012")
    step9 = os.path.join(run, ckpt.CHECKPOINTS, "step-000009")
    rank1 = os.path.join(step12, "rank-1.pt")
    size = os.path.getsize(rank1)
    hint = f"resume from an earlier one: --resume {step9}"
    argv = [*_argv("co2", str(tmp_path / "resumed")), "--resume", step12]
    # cut short or emptied: refused before any worker starts, exit 2
    with open(rank1, "r+b") as f:
        f.truncate(size // 2)
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert f"is damaged: rank-1.pt has {size // 2} bytes but {size} were written; {hint}" in line
    os.remove(rank1)
    assert main(argv) == 2
    assert f"is damaged: rank-1.pt is missing; {hint}" in _one_error_line(capsys)
    # the right size but garbage inside: its digest differs from the manifest's, refused
    # before any worker starts, exit 2
    with open(rank1, "wb") as f:
        f.write(b"\0" * size)
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert (
        f"is damaged: rank-1.pt holds other bytes than were written (its SHA-256 differs); {hint}"
        in line
    )
    # a checkpoint whose manifest records no digests (written before they were): the worker
    # that reads the garbage says so, and it is a bad input too, exit 2
    manifest_path = os.path.join(step12, ckpt.MANIFEST)
    with open(manifest_path, encoding="utf-8") as f:
        manifest = json.load(f)
    del manifest["digests"]
    with open(manifest_path, "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    assert main(argv) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "worker rank 1 failed: CheckpointError:" in line and "the file is damaged" in line, line
    assert hint in line and "--help" not in line
    # a path that is not there
    assert main([*argv[:-1], str(tmp_path / "nowhere")]) == 2
    line = _one_error_line(capsys)
    assert f"--resume path {str(tmp_path / 'nowhere')!r} does not exist" in line, line


@pytest.mark.timeout(240)
def test_a_damaged_newest_checkpoint_resumes_from_the_newest_that_verifies(
    reference: Callable[[str], str], capsys: Any, tmp_path: Any
) -> None:
    """A right-sized but garbled rank file in the newest checkpoint of a run: ``--resume``
    (latest) says which checkpoint is damaged and why and continues from the newest that
    verifies, and the failed-run line and the error name that same checkpoint."""
    run = str(tmp_path / "run")
    shutil.copytree(reference("co2"), run)
    capsys.readouterr()  # (the reference run's own output, when this test made it)
    os.remove(os.path.join(run, "summary.json"))  # a run stopped after its last checkpoint
    step12 = os.path.join(run, ckpt.CHECKPOINTS, "step-000012")
    step9 = os.path.join(run, ckpt.CHECKPOINTS, "step-000009")
    rank1 = os.path.join(step12, "rank-1.pt")
    with open(rank1, "r+b") as f:
        f.seek(os.path.getsize(rank1) // 2)
        f.write(b"garbage")
    assert ckpt.newest_intact(run) == (
        step9,
        [(step12, "rank-1.pt holds other bytes than were written (its SHA-256 differs)")],
    )
    summary = run_train_job(run, *_flags("co2"), "--checkpoint-every", "3", "--resume")
    out, err = capsys.readouterr()
    # the figures agree: the loop's time from step 0 (over both runs) is no less than this
    # run's own, and the command's (with start-up) no less than this run's loop
    wall = [line for line in out.splitlines() if line.strip().startswith("wall time")][-1]
    numbers = [float(x) for x in re.findall(r"([\d.]+) s", wall)]
    assert len(numbers) == 3, wall
    total, this_run, command = numbers
    assert "from step 0 over every run" in wall and total >= this_run and command >= this_run
    assert summary["attempt_wall_time_s"] == pytest.approx(this_run, abs=0.05)
    assert (
        f"checkpoint {step12} is damaged (rank-1.pt holds other bytes than were written (its "
        f"SHA-256 differs)): resuming from {step9}, the newest that verifies" in err
    ), err
    assert summary["status"] == "finished"
    # the resumed run ends where the uninterrupted one did
    assert_same_run(Path(reference("co2")), Path(run), resumed_at=[9])


@pytest.mark.timeout(240)
def test_a_failed_resume_keeps_the_finished_runs_record(
    reference: Callable[[str], str], capsys: Any, tmp_path: Any
) -> None:
    """Resuming a finished run from a checkpoint whose rank file a worker refuses (an unsafe
    pickle, found only by loading it) fails with exit 2, and the finished run's
    ``summary.json`` is kept: the failed attempt's record goes beside it."""
    import torch

    run = str(tmp_path / "run")
    shutil.copytree(reference("co2"), run)
    before = (tmp_path / "run" / "summary.json").read_text()
    step9 = os.path.join(run, ckpt.CHECKPOINTS, "step-000009")
    rank0 = os.path.join(step9, "rank-0.pt")

    class Planted:
        def __reduce__(self) -> Any:
            return (os.system, ("echo planted",))

    torch.save({"model": {"w": torch.zeros(2)}, "planted": Planted()}, rank0)
    # the manifest is rewritten to match (as a peer that planted the file would): only loading
    # the file can refuse it
    manifest_path = os.path.join(step9, ckpt.MANIFEST)
    with open(manifest_path, encoding="utf-8") as f:
        manifest = json.load(f)
    manifest["sizes"][0] = os.path.getsize(rank0)
    manifest["digests"][0] = ckpt._digest(rank0)
    with open(manifest_path, "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    code = main(_argv("co2", run, "--resume", step9))
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "worker rank 0 failed: CheckpointError:" in err and "posix.system" in err, err
    assert "planted" not in out
    assert (tmp_path / "run" / "summary.json").read_text() == before
    beside = json.loads((tmp_path / "run" / "summary-failed-1.json").read_text())
    assert beside["status"] == "failed" and "CheckpointError" in beside["error"]
