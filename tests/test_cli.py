"""`lowcomm train` from the command line: one-line errors, flag precedence, real 2-worker runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lowcomm.cli import main
from lowcomm.testing.jobs import TrainJob, read_summary, tiny_job_args
from lowcomm.train import launcher
from lowcomm.train.config import TrainConfig
from lowcomm.train.launcher import WorkerFailed
from lowcomm.train.preflight import check_environment

# 6 steps, rounds of 3, 1 layer, no dropout, printing its table
TINY = tiny_job_args(
    steps=6, sync_every=3, eval_every=3, eval_batches=2, n_layer=1, dropout=None, quiet=None
)


def _one_error_line(capsys: Any) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    assert "usage:" not in captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--sync-every", "0"], "lowcomm train: error: --sync-every must be >= 1, got 0"),
        (["--lr", "-0.001"], "lowcomm train: error: --lr must be a finite number > 0, got -0.001"),
        (["--lr=-1e-3"], "lowcomm train: error: --lr must be a finite number > 0, got -0.001"),
        (["--clip", "0"], "lowcomm train: error: --clip must be a finite number > 0"),
        (["--clip", "-2"], "lowcomm train: error: --clip must be a finite number > 0"),
        (["--clip", "big"], "lowcomm train: error: argument --clip: must be a number > 0"),
        (["--algo", "sgd"], "lowcomm train: error: --algo must be one of co2, co2-eager, diloco"),
        (["--data", "/no/such/corpus.txt"], "lowcomm train: error: --data path"),
        (["--steps", "ten"], "lowcomm train: error: argument --steps: invalid int value"),
        (["--gap-penalty", "0.5"], "lowcomm train: error: --gap-penalty as a constant divisor"),
        (["--outer-momentum", "1.5"], "lowcomm train: error: --outer-momentum must be in [0, 1)"),
        (["--block-size", "1000000"], "lowcomm train: error: --block-size (1000000) is too long"),
        (["--no-such-flag"], "lowcomm train: error: unrecognized arguments: --no-such-flag"),
        (
            ["--algo", "streaming", "--sync-every", "12", "--num-fragments", "5"],
            "lowcomm train: error: --sync-every (12) must be a multiple of num_fragments=5",
        ),
        (["--link", "fast"], "lowcomm train: error: --link 'fast' is neither a profile"),
        (
            ["--algo", "cocodc", "--lambda0", "-1"],
            "lowcomm train: error: --lambda0 must be a finite number >= 0, got -1.0",
        ),
        (
            ["--algo", "cocodc", "--max-wait", "0"],
            "lowcomm train: error: --max-wait must be a positive integer, got 0",
        ),
        (
            ["--algo", "streaming", "--overlap", "12"],
            "lowcomm train: error: --overlap (12) must be < sync_every=12",
        ),
        (
            ["--algo", "streaming", "--mix", "1.5"],
            "lowcomm train: error: --mix must be in [0, 1], got 1.5",
        ),
        (
            ["--algo", "streaming", "--num-fragments", "6"],
            "lowcomm train: error: --num-fragments (6) exceeds n_layer (4)",
        ),
        (
            ["--algo", "co2-eager", "--clip", "-1"],
            "lowcomm train: error: --clip must be a finite number > 0",
        ),
        (
            ["--algo", "slowmo", "--min-lr-ratio", "0"],
            "lowcomm train: error: --min-lr-ratio must be > 0 for slowmo with the cosine",
        ),
    ],
)
def test_user_errors_are_one_line_exit_2(argv: list[str], expected: str, capsys: Any) -> None:
    assert main(["train", *argv]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(expected), line
    assert line.endswith("(see lowcomm train --help)")


def test_documents_data_is_checked_before_the_workers_start(tmp_path: Any, capsys: Any) -> None:
    # long enough as text, but a line that is not a document; then too few documents
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x" * 5000}) + '\n{"body": "y"}\n')
    argv = ["train", "--documents", "--data", str(bad), "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"lowcomm train: error: --data cannot be used: {bad}:2 is not a JSON")
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"text": "word " * 1000}) + "\n" for _ in range(3)))
    assert main([*argv[:3], str(few), *argv[4:]]) == 2
    line = _one_error_line(capsys)
    assert "has 3 documents of more than" in line and "needs at least 10" in line
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
    # a folder of .py files is documents (one each), though not text for fixed windows
    code = tmp_path / "code"
    code.mkdir()
    for i in range(12):
        (code / f"m{i}.py").write_text(f"def f{i}():\n    return {'x' * 50 * (i + 1)!r}\n")
    check_environment(TrainConfig(documents=True, data=str(code), out=str(tmp_path / "run")))
    with pytest.raises(ValueError, match="contains no text files"):
        check_environment(TrainConfig(data=str(code), out=str(tmp_path / "run")))


def test_missing_command_and_unknown_command(capsys: Any) -> None:
    assert main([]) == 2
    assert _one_error_line(capsys).startswith("lowcomm: error: choose a command")
    assert main(["fly"]) == 2
    assert _one_error_line(capsys).startswith("lowcomm: error:")


def test_help_exits_0(capsys: Any) -> None:
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--sync-every", "--outer-lr", "--clip", "--gap-penalty", "--no-nesterov"):
        assert flag in out
    for flag in ("co2-eager", "streaming", "--num-fragments", "--overlap", "--mix"):
        assert flag in out
    assert "--log-every" in out and "--overwrite" in out


def test_the_commands_are_each_described_in_one_sentence(capsys: Any) -> None:
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for command, text in (
        ("train", "train a small GPT with a communication-efficient algorithm"),
        ("lighthouse", "run the Lighthouse that the replicas of an elastic job on several "
         "machines join"),
    ):  # fmt: skip
        assert f"{command} {text}" in out, out


def test_malformed_toml(tmp_path: Any, capsys: Any) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("algo = co2\n")  # unquoted string
    assert main(["train", "--config", str(path)]) == 2
    assert "is not valid TOML" in _one_error_line(capsys)


def test_unknown_toml_key(tmp_path: Any, capsys: Any) -> None:
    path = tmp_path / "cfg.toml"
    path.write_text("learning_rate = 0.1\n")
    assert main(["train", "--config", str(path)]) == 2
    line = _one_error_line(capsys)
    assert "unknown key 'learning_rate'" in line and "valid keys: algo, workers" in line


def test_bad_toml_value_names_the_file(tmp_path: Any, capsys: Any) -> None:
    path = tmp_path / "cfg.toml"
    path.write_text("sync_every = 0\n")
    assert main(["train", "--config", str(path)]) == 2
    assert _one_error_line(capsys).startswith(
        f"lowcomm train: error: sync_every in {path} must be >= 1, got 0"
    )


def test_algorithm_error_from_toml_names_the_file(tmp_path: Any, capsys: Any) -> None:
    path = tmp_path / "cfg.toml"
    path.write_text('algo = "streaming"\nmix = 1.5\n')
    assert main(["train", "--config", str(path)]) == 2
    assert _one_error_line(capsys).startswith(
        f"lowcomm train: error: mix in {path} must be in [0, 1], got 1.5"
    )


def test_out_with_a_previous_run_needs_overwrite(
    tmp_path: Any, monkeypatch: Any, capsys: Any
) -> None:
    seen: list[TrainConfig] = []
    monkeypatch.setattr(launcher, "launch", lambda cfg, **_: seen.append(cfg))
    out = tmp_path / "run"
    out.mkdir()
    for name in ("metrics.jsonl", "loss.png", "error-rank1.txt", "notes.txt"):
        (out / name).write_text("old")
    argv = ["train", "--algo", "ddp", "--out", str(out)]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert f"--out {str(out)!r} already holds a run (metrics.jsonl)" in line
    assert "--overwrite" in line and not seen
    assert main([*argv, "--overwrite"]) == 0
    assert len(seen) == 1 and seen[0].overwrite
    # the previous run's files are gone before the new run starts; the user's are kept
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_worker_failure_under_torchrun_is_one_line_exit_1(
    tmp_path: Any, monkeypatch: Any, capsys: Any
) -> None:
    def fail(cfg: TrainConfig, launched_locally: bool) -> None:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "pytest")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(launcher, "run_worker", fail)
    out = tmp_path / "run"
    assert main(["train", "--algo", "ddp", "--out", str(out)]) == 1
    path = out / "error-rank3.txt"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"lowcomm train: error: worker rank 3 failed: RuntimeError: boom (traceback: {path})"
    ]
    text = path.read_text()
    assert "Traceback" in text and "RuntimeError: boom" in text


def test_flags_override_toml(tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    path = tmp_path / "cfg.toml"
    path.write_text('algo = "diloco"\nsteps = 48\nsync_every = 6\nouter_lr = 0.5\n')
    seen: list[TrainConfig] = []

    def fake_launch(cfg: TrainConfig, **_: Any) -> None:
        seen.append(cfg)

    monkeypatch.setattr(launcher, "launch", fake_launch)
    argv = ["train", "--config", str(path), "--steps", "24", "--no-nesterov"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    (cfg,) = seen
    assert (cfg.algo, cfg.steps, cfg.sync_every, cfg.value("outer_lr"), cfg.value("nesterov")) == (
        "diloco",
        24,
        6,
        0.5,
        False,
    )
    assert cfg.name is not None and cfg.name.startswith("diloco-")
    assert cfg.out == str(tmp_path / "run")


def test_inapplicable_outer_flag_is_ignored_with_a_warning(
    monkeypatch: Any, capsys: Any, tmp_path: Any
) -> None:
    monkeypatch.setattr(launcher, "launch", lambda cfg, **_: None)
    assert main(["train", "--algo", "localsgd", "--clip", "0.5", "--out", str(tmp_path)]) == 0
    assert "--clip does not apply to --algo localsgd" in capsys.readouterr().err


def test_worker_failure_is_one_line_exit_1(monkeypatch: Any, capsys: Any, tmp_path: Any) -> None:
    def fail(cfg: TrainConfig, **_: Any) -> None:
        raise WorkerFailed(1, "RuntimeError: boom", None)

    monkeypatch.setattr(launcher, "launch", fail)
    assert main(["train", "--algo", "ddp", "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines == ["lowcomm train: error: worker rank 1 failed: RuntimeError: boom"]


@pytest.mark.timeout(120)
def test_launch_reports_the_failed_rank(tmp_path: Any) -> None:
    # rank 0 cannot create its output folder where a file already is.
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    cfg = TrainConfig(
        algo="ddp",
        steps=2,
        n_layer=1,
        n_head=2,
        n_embd=32,
        block_size=16,
        batch_size=2,
        eval_batches=1,
        out=str(blocker / "run"),
    ).with_paths()
    with pytest.raises(WorkerFailed) as info:
        launcher.launch(cfg)
    assert info.value.rank == 0
    assert info.value.error.startswith(f"{blocker / 'run'}: a file is in the way"), info.value.error
    assert info.value.errno is not None  # the CLI's exit code 4: an output it cannot write


@pytest.mark.timeout(120)
def test_launch_keeps_the_worker_traceback(tmp_path: Any) -> None:
    # Bypass the parent's corpus check: every worker then fails loading a too-short text.
    short = tmp_path / "short.txt"
    short.write_text("too short")
    out = tmp_path / "run"
    cfg = TrainConfig(algo="ddp", steps=2, data=str(short), out=str(out)).with_paths()
    with pytest.raises(WorkerFailed) as info:
        launcher.launch(cfg)
    assert info.value.error.startswith("ValueError: Corpus at")
    assert info.value.traceback_path is not None
    with open(info.value.traceback_path) as f:
        assert "Traceback" in f.read()


# --- real runs -------------------------------------------------------------------------------


def _check_run(
    out: str,
    summary: dict[str, Any],
    algo: str,
    *,
    steps: int = 6,
    evals: tuple[int, ...] = (0, 3, 6),
    workers: int = 2,
    log_every: int = 2,
) -> None:
    """The run folder ``out`` and its ``summary``: every file, the metrics' records, the
    summary's counters and the final checkpoint."""
    for name in ("config.json", "metrics.jsonl", "checkpoint.pt", "loss.png", "summary.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    step_records = [r for r in records if r["kind"] == "step"]
    eval_records = [r for r in records if r["kind"] == "eval"]
    # a record every log_every steps and before every evaluation; each step counted once
    expected = sorted({*range(log_every, steps + 1, log_every), *evals[1:], steps})
    assert [r["step"] for r in step_records] == expected
    assert sum(r["steps"] for r in step_records) == steps
    assert [r["step"] for r in eval_records] == list(evals)
    for r in step_records:
        assert {"loss", "lr", "tokens", "elapsed_s"} <= set(r) and r["loss"] is not None
    for r in eval_records:
        assert {"val_loss", "payload_bytes", "wire_bytes", "blocked_s", "in_flight_s"} <= set(r)
        assert r["val_loss"] is not None
        # training time excludes evaluations: never more than the wall time, never decreasing
        assert 0 <= r["train_s"] <= r["elapsed_s"]
    train_times = [r["train_s"] for r in eval_records]
    assert train_times == sorted(train_times)
    assert summary["algo"] == algo and summary["workers"] == workers
    assert summary["steps"] == steps
    assert summary["val_loss_final"] < summary["val_loss_initial"]
    assert len(summary["comm_per_worker"]) == workers
    mean = summary["comm_mean"]
    for key in ("payload_bytes", "wire_bytes", "payload_bytes_per_step", "blocked_s"):
        assert key in mean
    communicates = algo != "none"
    assert (mean["payload_bytes"] > 0) == communicates
    assert (mean["wire_bytes"] > 0) == (communicates and workers > 1)  # a ring of one: nothing
    assert "hidden_fraction" in mean
    ckpt = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)
    assert ckpt["step"] == steps and ckpt["config"]["algo"] == algo
    assert ckpt["rank"] == 0 and "rank 0" in ckpt["note"]
    assert "wte.weight" in ckpt["model"] and "state" in ckpt["optimizer"]


def _scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    """Every ``lowcomm/`` scalar in the TensorBoard event files of ``folder``, read with
    TensorBoard's own reader: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder)
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
        if tag.startswith("lowcomm/")
    }


@pytest.mark.timeout(180)
def test_train_ddp_end_to_end(train_job: TrainJob, tmp_path: Any, capsys: Any) -> None:
    out = str(tmp_path / "ddp")
    tb = str(tmp_path / "tb")
    summary = train_job("--algo", "ddp", *TINY, "--tensorboard", tb, out=out)
    _check_run(out, summary, "ddp")
    # every step is a sync: its scalars every log_every (2) steps, validations at 0, 3 and 6
    scalars = _scalars(tb)
    assert [s for s, _ in scalars["lowcomm/loss"]] == [2, 4, 6]
    assert [s for s, _ in scalars["lowcomm/val_loss"]] == [0, 3, 6]
    sent = [v for _, v in scalars["lowcomm/bytes_sent"]]
    assert (
        sent == sorted(sent)
        and sent[0] > 0
        and sent == [v for _, v in scalars["lowcomm/bytes_received"]]
    )
    # DDP all-reduces every gradient every step.
    per_step = summary["comm_mean"]["payload_bytes_per_step"]
    assert per_step >= 4 * summary["parameters"]
    printed = capsys.readouterr().out
    assert "val loss" in printed and out in printed


@pytest.mark.timeout(180)
@pytest.mark.parametrize("algo", ["co2", "co2-eager"])
def test_train_co2_end_to_end(algo: str, train_job: TrainJob, tmp_path: Any, capsys: Any) -> None:
    out = str(tmp_path / algo)
    tb = str(tmp_path / "tb")
    summary = train_job("--algo", algo, *TINY, "--tensorboard", tb, out=out)
    _check_run(out, summary, algo)
    assert summary["comm_mean"]["rounds"] == 2
    # the scalars of both outer steps (x-axis: the outer step), validations at 0, 1 and 2;
    # eager CO2 applies round 1's sync at step 6, round 2's in finish(), after the last loss
    scalars = _scalars(tb)
    for name in ("pseudo_grad_norm", "bytes_sent", "bytes_received", "blocked_s"):
        assert [s for s, _ in scalars[f"lowcomm/{name}"]] == [1, 2], name
    losses = [s for s, _ in scalars["lowcomm/loss"]]
    assert losses == ([1] if algo == "co2-eager" else [1, 2])
    assert [s for s, _ in scalars["lowcomm/skipped_updates"]] == [1, 2]
    inner_steps = [v for _, v in scalars["lowcomm/inner_step"]]
    assert inner_steps == ([6.0, 6.0] if algo == "co2-eager" else [3.0, 6.0])
    assert "lowcomm/hidden_fraction" in scalars
    evaluated_at = [s for s, _ in scalars["lowcomm/val_loss"]]
    assert evaluated_at == ([0, 0, 2] if algo == "co2-eager" else [0, 1, 2])
    val = [v for _, v in scalars["lowcomm/val_loss"]]
    assert val[-1] == pytest.approx(summary["val_loss_final"], rel=1e-6)
    assert all(v > 0 for _, v in scalars["lowcomm/pseudo_grad_norm"])
    ckpt = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)
    assert ckpt["algorithm"]["rounds"] == 2
    assert ckpt["algorithm"]["eager"] is (algo == "co2-eager")
    with open(os.path.join(out, "config.json")) as f:
        kwargs = json.load(f)["resolved"]["algorithm_kwargs"]
    # the job's defaults: CO2 tuned and one step stale; eager: β 0
    if algo == "co2":
        assert kwargs["outer_lr"] == 0.5 and kwargs["overlap"] == 1
    else:
        assert kwargs["outer_momentum"] == 0.0 and "overlap" not in kwargs
    assert "hidden fraction" in capsys.readouterr().out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(180)
def test_under_torchrun_the_worker_runs_in_process(tmp_path: Any) -> None:
    # Streaming DiLoCo with two fragments (one per block), 2 real ranks: rank 0 evaluates the
    # anchor between sync points while both ranks keep training.
    out = str(tmp_path / "torchrun")
    streaming = ["--algo", "streaming", "--num-fragments", "2", "--n-layer", "2",
                 "--steps", "8", "--sync-every", "4", "--eval-every", "4"]  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
        "--local-addr", "127.0.0.1",
        "-m", "lowcomm", "train", *TINY, *streaming, "--workers", "7", "--out", out,
    ]  # fmt: skip
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(out)
    _check_run(out, summary, "streaming", steps=8, evals=(0, 4, 8))
    assert summary["workers"] == 2  # torchrun's world size, not --workers 7
    assert summary["comm_mean"]["rounds"] == 2
    assert "--workers is ignored" in proc.stderr
    assert proc.stdout.count("val loss") == 1  # only rank 0 prints the table
    ckpt = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)
    assert ckpt["algorithm"]["num_fragments"] == 2


@pytest.mark.timeout(180)
def test_two_torchrun_agents_on_one_machine_share_its_cores(tmp_path: Any) -> None:
    """Two agents (``--nnodes 2``, one process each) on loopback: each agent's
    LOCAL_WORLD_SIZE is 1, but the two processes share this machine's cores, and the tuner
    timed its compute with the threads the training then used; its estimate and the run's
    step time are recorded side by side."""
    out = str(tmp_path / "agents")
    port = _free_port()
    job = ["--algo", "co2", *TINY, "--steps", "24", "--sync-every", "4", "--eval-every", "12"]
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--node-rank", str(node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1",
            "-m", "lowcomm", "train", *job, "--out", out,
        ]  # fmt: skip
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1"}
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env))
    outputs = [p.communicate(timeout=170) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e.decode()[-2000:] for _, e in outputs]
    summary = read_summary(out)
    cores = os.cpu_count() or 1
    assert [w["threads"] for w in summary["comm_per_worker"]] == [max(1, cores // 2)] * 2
    tuning = summary["link_tuning"]  # the processes are not all on this agent: measured
    assert tuning["link"].startswith("measured")
    assert "33554" not in tuning["link"]  # a bandwidth below the timer's resolution is a bound
    assert tuning["compute_s"] > 0 and summary["step_times"]["step_s"] > 0


@pytest.fixture
def torchrun_rank0_of_1(monkeypatch: Any) -> Iterator[None]:
    """This process as the only rank of a torchrun job: the CLI trains in-process."""
    assert not dist.is_initialized()
    env = {
        "TORCHELASTIC_RUN_ID": "pytest",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if "lo" in [name for _, name in socket.if_nameindex()]:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        assert not dist.is_initialized()


@pytest.mark.timeout(120)
def test_train_localsgd_in_process_as_torchrun_rank(
    train_job: TrainJob, tmp_path: Any, torchrun_rank0_of_1: None, capsys: Any
) -> None:
    out = str(tmp_path / "localsgd")
    summary = train_job("--algo", "localsgd", *TINY, out=out)
    _check_run(out, summary, "localsgd", workers=1)
    assert summary["comm_mean"]["rounds"] == 2
    assert capsys.readouterr().out.count("val loss") == 1


@pytest.mark.timeout(180)
def test_train_cocodc_end_to_end(train_job: TrainJob, tmp_path: Any) -> None:
    out = str(tmp_path / "cocodc")
    argv = ["--algo", "cocodc", *TINY, "--n-layer", "2", "--sync-every", "2"]
    summary = train_job(*argv, "--num-fragments", "2", "--overlap", "1", out=out)
    _check_run(out, summary, "cocodc", evals=(0, 4, 6))  # eval every 3 -> every 4 (H=2)
    # one fragment launched per sync point (every step), plus one small priority all-reduce each
    assert summary["comm_mean"]["collectives"] >= 2 * 6 - 2
    ckpt = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)
    assert ckpt["algorithm"]["algorithm"] == "cocodc"
    assert len(ckpt["algorithm"]["snapshots"]) == 2


@pytest.mark.timeout(180)
def test_train_over_an_emulated_link_is_labelled_emulated(train_job: TrainJob, capsys: Any) -> None:
    # 10 kbit/s: each step's gradient all-reduce (~70 KB) takes seconds on the emulated link
    argv = ["--algo", "ddp", *TINY, "--steps", "2", "--eval-every", "2"]
    summary = train_job(*argv, "--link", "1000kbit:1ms")
    assert summary["link"] == "1000kbit:1ms (emulated)"
    wire = summary["comm_mean"]["wire_bytes"]
    # every byte went through the emulated link: the blocked time is at least its transfer time
    assert summary["comm_mean"]["blocked_s"] >= 0.9 * 8 * wire / 1e6
    assert "(emulated)" in capsys.readouterr().out


@pytest.mark.timeout(180)
def test_train_without_synchronisation_is_the_ceiling(train_job: TrainJob, tmp_path: Any) -> None:
    out = str(tmp_path / "none")
    summary = train_job("--algo", "none", *TINY, out=out)
    _check_run(out, summary, "none")
    assert summary["sync_every"] is None
    assert summary["comm_mean"]["payload_bytes"] == 0 and summary["comm_mean"]["collectives"] == 0


@pytest.mark.timeout(240)
def test_ceiling_steps_measure_in_the_same_processes_without_touching_training(
    train_job: TrainJob, tmp_path: Any, capsys: Any
) -> None:
    plain, with_ceiling = str(tmp_path / "plain"), str(tmp_path / "ceiling")
    # with dropout: the ceiling's steps between training's leave the global random state alone
    train_job("--algo", "co2", *TINY, "--dropout", "0.1", out=plain)
    summary = train_job(
        "--algo", "co2", *TINY, "--dropout", "0.1", "--ceiling-steps", "5", out=with_ceiling
    )
    printed = capsys.readouterr().out
    assert "without sync (5 steps in the same processes)" in printed and "of ceiling" in printed
    ceiling = summary["ceiling"]
    # 5 steps in 3 segments: 2 before training, 2 in its middle (where no sync is in flight:
    # the tiny job's time leaves them out), 1 after
    assert ceiling["steps"] == 5 and len(ceiling["segments_tokens_per_s"]) == 3
    assert ceiling["tokens_per_s"] > 0
    assert ceiling["ratio"] == pytest.approx(summary["tokens_per_s"] / ceiling["tokens_per_s"])
    # the ceiling trains a private copy on its own batches: the run itself is unchanged
    a = torch.load(os.path.join(plain, "checkpoint.pt"), weights_only=True)["model"]
    b = torch.load(os.path.join(with_ceiling, "checkpoint.pt"), weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(240)
def test_compression_flag_shrinks_the_bytes_of_co2_and_ddp(
    train_job: TrainJob, tmp_path: Any, capsys: Any
) -> None:
    payload = {}
    for algo, spec in (("co2", None), ("co2", "int4"), ("ddp", None), ("ddp", "powersgd:2")):
        argv = ["--algo", algo, *TINY]
        summary = train_job(*argv, *(["--compression", spec] if spec else []))
        assert summary["compression"] == spec
        payload[algo, spec] = summary["comm_mean"]["payload_bytes"]
    assert "compression       int4" in capsys.readouterr().out
    # int4 of a tiny model: packed codes plus a scale per block; raw 1-D tensors stay fp32
    assert payload["co2", "int4"] < payload["co2", None] / 3
    assert payload["ddp", "powersgd:2"] < payload["ddp", None] / 2
    assert (
        main(
            ["train", "--algo", "ddp", *TINY, "--compression", "int9", "--out", str(tmp_path / "x")]
        )
        == 2
    )
    assert "--compression is not usable: unknown compression 'int9'" in capsys.readouterr().err


def test_every_command_builds_its_flags_from_one_dataclass() -> None:
    """``train``, ``bench``, ``plan`` and ``finetune`` declare each flag once, as a field (the
    job's configuration keys, ``BenchFlags``, ``PlanFlags``, ``FinetuneConfig``), and build their
    parsers from them with :func:`lowcomm.flags.add_flags`: every option is a field and every
    field an option."""
    import dataclasses

    from lowcomm.bench.cli import BenchFlags
    from lowcomm.cli import _build_parser
    from lowcomm.flags import flag_name
    from lowcomm.plan.cli import PlanFlags
    from lowcomm.train.config import config_keys
    from lowcomm.zo.finetune import FinetuneConfig

    commands = _build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    expected = {
        "train": ["--config", *map(flag_name, config_keys())],
        "bench": [flag_name(f.name) for f in dataclasses.fields(BenchFlags)],
        "plan": [flag_name(f.name) for f in dataclasses.fields(PlanFlags)],
        "finetune": [flag_name(f.name) for f in dataclasses.fields(FinetuneConfig) if f.init],
    }
    for name, flags in expected.items():
        options = [a.option_strings[0] for a in commands[name]._actions if a.dest != "help"]
        assert options == flags, name
    # a switch's --no- form where the field says so; choices, repeats and parsers from the field
    bench = {a.dest: a for a in commands["bench"]._actions}
    assert bench["overhead"].option_strings == ["--overhead", "--no-overhead"]
    assert bench["quick"].default is False and bench["corpus"].choices == ("stdlib", "lognormal")
    assert commands["plan"].parse_args(["--tier", "a:2:1", "--tier", "b:2:1"]).tier == [
        "a:2:1",
        "b:2:1",
    ]
    assert commands["bench"].parse_args(["--workers", "2,4"]).workers == [2, 4]
