"""What a user sees when something goes wrong: every failure is one line naming the cause and
the fix, with a documented exit code (``lowcomm.cli``: 1 a worker failed, 2 a bad setting or
input, 3 diverged, 4 an output that cannot be written), and nothing lowcomm loads can run code.

Real files, real processes and, where the machine lets us mount one, a real full filesystem
(tmpfs)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import lowcomm
from lowcomm.cli import main
from lowcomm.procs.workers import run_workers
from lowcomm.runfiles import (
    CheckpointError,
    atomic_write,
    describe_os_error,
    load_checkpoint,
    save_checkpoint,
    smoothed,
)
from lowcomm.testing.jobs import TINY_JOB_ARGS, read_summary, tiny_job_args
from lowcomm.train import checkpoint as ckpt
from lowcomm.train.launcher import resource_warnings

# The documented exit codes (lowcomm --help, docs/train.md "When something goes wrong"), as
# numbers: a test that imported them from the code under test would pass whatever they became.
EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_OUTPUT = 4


class _Plant:
    """Unpickled unsafely, it makes the folder ``marker`` (os.mkdir): code that ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (self.marker,))


def _plant(path: Path, marker: Path) -> None:
    torch.save({"model": {"w": torch.zeros(2)}, "config": _Plant(str(marker))}, path)


def _one_line(capsys: Any) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "nothing on stderr"
    return err[-1]


# --- nothing we load runs code -------------------------------------------------------------------


def test_load_checkpoint_refuses_code_and_names_every_bad_file(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    planted = tmp_path / "planted.pt"
    _plant(planted, marker)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(planted), hint="use another file")
    message = str(info.value)
    assert not marker.exists()
    assert "holds Python objects other than tensors, numbers and strings (posix.mkdir)" in message
    assert message.endswith("; use another file")
    assert "weights_only" not in message  # never the advice to load it unsafely
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    zeros = tmp_path / "zeros.pt"
    zeros.write_bytes(b"\0" * 4096)
    good = tmp_path / "good.pt"
    save_checkpoint(str(good), {"w": torch.ones(3)})
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:200])
    for path in (text, zeros, cut):
        with pytest.raises(CheckpointError, match="torch cannot read it") as info:
            load_checkpoint(str(path))
        assert "weights_only" not in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_checkpoint(str(tmp_path / "missing.pt"))
    assert torch.equal(load_checkpoint(str(good))["w"], torch.ones(3))


def test_a_planted_rank_file_is_refused_on_resume(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "checkpoints" / "step-000004"
    folder.mkdir(parents=True)
    marker = tmp_path / "code-ran"
    _plant(folder / "rank-0.pt", marker)
    with pytest.raises(ValueError, match="holds Python objects other than tensors") as info:
        ckpt.load_rank_state(str(folder), 0, 1)
    assert not marker.exists()
    assert "weights_only" not in str(info.value)


def _tiny_checkpoint(path: Path) -> None:
    """A ``checkpoint.pt`` as lowcomm train writes it, of a 1-layer GPT (no training run)."""
    from lowcomm.models.gpt import GPT, GPTConfig

    config = {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16}
    model = GPT(GPTConfig(vocab_size=256, dropout=0.0, **config))
    save_checkpoint(str(path), {"model": model.state_dict(), "config": config, "step": 0})


FINETUNE = ["--steps", "2", "--block-size", "16", "--batch-size", "2", "--quiet"]


def test_finetune_init_that_is_not_a_checkpoint_is_one_line_exit_2(
    tmp_path: Path, capsys: Any
) -> None:
    marker = tmp_path / "code-ran"
    planted = tmp_path / "planted.pt"
    _plant(planted, marker)
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    cases = [(planted, "it holds Python objects other than tensors"), (text, "torch cannot read")]
    for path, why in cases:
        out = tmp_path / f"out-{path.stem}"
        assert main(["finetune", "--init", str(path), *FINETUNE, "--out", str(out)]) == 2
        line = _one_line(capsys)
        assert f"--init {str(path)!r} is not a lowcomm train checkpoint: {why}" in line, line
        assert "weights_only" not in line and "Unpickling" not in line
        assert not out.exists()  # refused before anything was written
    assert not marker.exists()


# --- outputs that cannot be written ------------------------------------------------------------


def _commands(place: Path, init: Path) -> dict[str, tuple[list[str], str]]:
    """Every command with an output, pointed at ``place`` (argv, the flag that names it)."""
    plan = ["plan", "--model", "gpt-1.7b", "--cluster", "dgx-a100", "--nodes", "2"]
    plan += ["--global-batch", "512"]
    return {
        "train": (["train", *TINY_JOB_ARGS, "--out", str(place / "run")], "--out"),
        "finetune": (
            ["finetune", "--init", str(init), *FINETUNE, "--out", str(place / "ft")],
            "--out",
        ),
        "bench": (["bench", "--quick", "--out", str(place / "bench")], "--out"),
        "simulate": (["simulate", "--preset", "co2-paper", "--out", str(place / "sim")], "--out"),
        "plan --json": ([*plan, "--json", str(place / "plan.json")], "--json"),
        "plan --plot": ([*plan, "--plot", str(place / "plan.png")], "--plot"),
    }


COMMANDS = ["train", "finetune", "bench", "simulate", "plan --json", "plan --plot"]


def _mount_tmpfs(folder: Path, size: str, *options: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    opts = ",".join([f"size={size}", *options])
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(folder)],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _unmount(folder: Path) -> None:
    subprocess.run(["umount", str(folder)], capture_output=True, timeout=20)


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A folder this process cannot write into: a read-only tmpfs where we may mount one, else
    a folder without write permission (which binds users other than root)."""
    folder = tmp_path / "read-only"
    if _mount_tmpfs(folder, "1m", "ro"):
        try:
            yield folder
        finally:
            _unmount(folder)
        return
    if os.geteuid() == 0:
        pytest.skip("root writes into any folder and no read-only tmpfs can be mounted here")
    folder.mkdir()
    folder.chmod(0o500)
    try:
        yield folder
    finally:
        folder.chmod(0o700)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_in_place_of_a_file_is_one_line_exit_4(
    command: str, tmp_path: Path, capsys: Any
) -> None:
    init = tmp_path / "init.pt"
    _tiny_checkpoint(init)
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way\n")
    argv, flag = _commands(blocker, init)[command]
    assert main(argv) == EXIT_OUTPUT
    line = _one_line(capsys)
    assert line.startswith(f"lowcomm {command.split()[0]}: error: {blocker}"), line
    assert "a file is in the way where a folder is needed" in line
    assert f"point {flag} elsewhere" in line


@pytest.mark.timeout(240)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_read_only_output_is_one_line_exit_4(
    command: str, read_only: Path, tmp_path: Path, capsys: Any
) -> None:
    init = tmp_path / "init.pt"
    _tiny_checkpoint(init)
    argv, flag = _commands(read_only, init)[command]
    assert main(argv) == EXIT_OUTPUT
    line = _one_line(capsys)
    assert f"error: {read_only}" in line, line
    assert f"point {flag} at a folder you can write to" in line
    assert len(capsys.readouterr().err.strip().splitlines()) <= 1


def test_a_failed_write_keeps_the_old_file_and_names_the_full_disk(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    path.write_text("old\n")

    def full(_f: Any) -> None:  # the device refuses the bytes, as a full disk does
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError) as info:
        atomic_write(str(path), full)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["summary.json"]  # no temporary file left
    line = describe_os_error(info.value, option="--out")
    assert line.startswith(f"{path}: no space left on device (")
    assert line.endswith("free some space or point --out at another disk")


@pytest.mark.timeout(240)
def test_a_full_disk_during_train_is_named_and_keeps_what_was_measured(
    tmp_path: Path, capsys: Any
) -> None:
    disk = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    # the first checkpoint (step 4: about 2 MB for both ranks) fits, the second does not
    if not _mount_tmpfs(disk, "3m"):
        pytest.skip("no tmpfs can be mounted here (the failed write is checked by injection)")
    try:
        out = disk / "run"
        argv = ["train", "--algo", "co2", *TINY_JOB_ARGS, "--checkpoint-every", "4"]
        assert main([*argv, "--out", str(out)]) == EXIT_OUTPUT
        captured = capsys.readouterr()
        line = captured.err.strip().splitlines()[-1]
        assert "failed: " in line and "no space left on device" in line, line
        assert "free some space or point --out at another disk" in line
        assert "enforce fail" not in captured.err and "unexpected pos" not in captured.err
        # what was measured is kept, and the last good checkpoint is intact
        summary = json.loads((out / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["steps_done"] == 8
        assert summary["val_loss_last"] < summary["val_loss_initial"]
        assert summary["checkpoint"].endswith("step-000004")
        assert "measured before" in captured.out and "step 8 of 12 done" in captured.out
        state = ckpt.load_rank_state(summary["checkpoint"], 1, 2)
        assert state["step"] == 4
    finally:
        _unmount(disk)


# --- runs that go wrong ------------------------------------------------------------------------


@pytest.mark.timeout(200)
def test_a_diverged_run_says_so_and_exits_3(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "run"
    argv = ["train", "--algo", "co2", *TINY_JOB_ARGS, "--lr", "1e4", "--out", str(out)]
    assert main(argv) == EXIT_DIVERGED
    captured = capsys.readouterr()
    line = captured.err.strip().splitlines()[-1]
    expected = "error: training diverged: the training loss became NaN or Inf at step 3 (rank "
    assert expected in line, line
    assert "diverged" in captured.out.splitlines()[0]
    summary = read_summary(str(out))
    assert summary["status"] == "diverged" and summary["nonfinite"]["first_step"] == 3


def test_what_counts_as_diverged() -> None:
    from lowcomm.train.report import divergence, divergence_text

    def ranks(*watch: tuple[int, int]) -> list[dict[str, Any]]:
        return [
            {"rank": r, "nonfinite": {"first": f, "last": la}} for r, (f, la) in enumerate(watch)
        ]

    clean = ranks((0, 0), (0, 0))
    assert divergence(clean, steps=96, tail=10, val_start=5.3, val_end=2.1) is None
    # a NaN at step 6 on rank 1, recovered (its update skipped): reported, not diverged
    recovered = divergence(ranks((0, 0), (6, 7)), steps=96, tail=10, val_start=5.3, val_end=2.2)
    assert recovered is not None and not recovered["diverged"]
    assert (recovered["first_step"], recovered["first_rank"]) == (6, 1)
    # still NaN in the last record's steps: diverged
    still = divergence(ranks((26, 95), (30, 96)), steps=96, tail=10, val_start=5.3, val_end=1145)
    assert still is not None and still["diverged"] and still["first_step"] == 26
    text = divergence_text(still)
    assert (
        text == "the training loss became NaN or Inf at step 26 (rank 0) and still was at step 96"
    )
    # finite, but the validation loss exploded (the tiny job at --lr 100: 5.46 -> 45 million)
    exploded = divergence(clean, steps=12, tail=2, val_start=5.46, val_end=4.5e7)
    assert exploded is not None and exploded["diverged"] and exploded["val_loss_exploded"]
    assert "above 2 times its initial value" in divergence_text(exploded)
    nan_val = divergence(clean, steps=12, tail=2, val_start=5.46, val_end=float("nan"))
    assert nan_val is not None and nan_val["diverged"]


def test_steps_no_run_could_reach_are_refused(capsys: Any) -> None:
    assert main(["train", "--steps", str(10**12)]) == EXIT_USAGE
    line = _one_line(capsys)
    assert "--steps (1,000,000,000,000) cannot be reached" in line and "years" in line


def test_more_workers_than_cores_or_memory_are_warned() -> None:
    cores = len(os.sched_getaffinity(0))
    warned = resource_warnings(cores + 1, parameters=1000, cpu_workers=True)
    assert any(f"on {cores} CPU core(s)" in w for w in warned)
    assert not resource_warnings(cores + 1, parameters=1000, cpu_workers=False)
    huge = resource_warnings(1, parameters=10**12, cpu_workers=False)
    assert len(huge) == 1 and "may run out of memory" in huge[0]


def _unequal_steps(rank: int, world: int, algo: str, steps: list[int]) -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = getattr(lowcomm, algo)(model, inner, sync_every=4)
    try:
        for _ in range(steps[rank]):
            model(torch.randn(2, 4)).sum().backward()
            inner.step()
            inner.zero_grad()
            sync.step()
        sync.finish()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "returned"


@pytest.mark.timeout(120)
def test_ranks_stepping_a_different_number_of_times_are_told_why() -> None:
    # rounds line up (2 each): finish() compares the step counts
    results = run_workers(_unequal_steps, 2, "DiLoCo", [9, 8], timeout_s=60)
    for line in results:
        assert line.startswith("ValueError: DiLoCo.finish(): the ranks called step() a "), line
        assert "(rank 0: 9, rank 1: 8)" in line
    # rank 0 launches a round rank 1 never does: both time out, naming the likely cause
    results = run_workers(
        _unequal_steps, 2, "CO2", [8, 7], timeout_s=60, collective_timeout_s=3, barrier=False
    )
    for line in results:
        assert line.startswith("CollectiveError: CO2: a collective did not complete"), line
        assert "Likely cause: the ranks are out of step" in line


# --- what the outputs say ----------------------------------------------------------------------


def test_the_help_lists_every_algorithm_of_the_registry(capsys: Any) -> None:
    from lowcomm.registry import REGISTRY

    assert main(["--help"]) == 0
    top = " ".join(capsys.readouterr().out.split())
    assert "NoLoCo" in top and "DeMo" in top
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for entry in REGISTRY.values():
        assert f"{entry.name} - {' '.join(entry.summary.split())}" in text


def test_the_smoothed_loss_does_not_lag() -> None:
    falling = [10.0 - 0.1 * i for i in range(100)]
    assert smoothed(falling) == pytest.approx(falling)  # a centred window keeps a line
    noisy = [1.0 + (0.5 if i % 2 else -0.5) for i in range(100)]
    assert max(abs(v - 1.0) for v in smoothed(noisy)[1:-1]) < 0.5


@pytest.mark.timeout(200)
def test_the_summary_shows_the_warm_start_and_demos_compression(
    tmp_path: Path, capsys: Any
) -> None:
    args = tiny_job_args(steps=8)
    out = str(tmp_path / "c")
    assert main(["train", "--algo", "co2", *args, "--sync-warmup", "4", "--out", out]) == 0
    table = capsys.readouterr().out
    assert "co2 (sync every 4 steps; 1 step in flight)" in table  # (the job's overlap)
    assert read_summary(out)["overlap"] == 1
    assert "warm start        first 4 steps synchronous (DDP's mean, int8)" in table
    assert read_summary(out)["sync_warmup"] == {"steps": 4, "compression": "int8"}
    # DeMo's own compression, named from its settings (the summary of a DeMo job, as run_summary
    # makes it: no training needed for the label)
    from lowcomm.comm import CommStats
    from lowcomm.train.config import config_from_dict
    from lowcomm.train.report import format_summary, run_summary

    cfg = config_from_dict({"algo": "demo", "compression_topk": 8}, source="test").with_paths()
    per_rank = [{"rank": 0, "rounds": 0, "intra_node": None, **CommStats().as_dict()}]
    summary = run_summary(
        cfg,
        world=1,
        tokens=1,
        wall_s=1.0,
        train_s=1.0,
        eval_s=0.0,
        val_start=5.0,
        val_end=4.0,
        per_rank=per_rank,
        n_params=10,
    )
    table = format_summary(summary)
    assert "compression       DeMo: top 8 DCT coefficients per chunk (chunk side up to 64)" in table
    assert "none (fp32)" not in table and "warm start" not in table


@pytest.mark.parametrize("script", ["train_gpt.py", "hf_trainer.py", "lightning_diloco.py"])
def test_examples_say_where_torchrun_listens(script: str) -> None:
    text = (Path(__file__).resolve().parents[1] / "examples" / script).read_text()
    words = " ".join(text.split())
    assert "torchrun's agent hosts its rendezvous store on every network interface" in words
    assert "whose launcher listens on 127.0.0.1 only" in words
    if script == "train_gpt.py":
        assert "--standalone --nproc" not in text and "--rdzv-endpoint 127.0.0.1:29400" in text


def test_the_finetune_summary_names_its_output() -> None:
    from lowcomm.zo.cli import format_summary

    summary = {
        "out": "runs/ft",
        "method": "zo",
        "mode": "single",
        "workers": 1,
        "steps": 2,
        "tokens": 64,
        "lr": 1e-4,
        "val_loss_initial": 2.0,
        "val_loss_final": 1.9,
        "tokens_per_s": 100.0,
        "bytes_sent_per_worker_per_step": 0.0,
        "peak_rss_bytes_per_worker": [2**30],
    }
    table = format_summary(summary)
    assert "zo (single, 1 worker)" in table and "output                 runs/ft" in table


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


# --- a link too slow for the job ------------------------------------------------------------------


def test_a_link_too_slow_for_the_job_is_told_and_refused_past_a_year(
    tmp_path: Path, capsys: Any
) -> None:
    """The total time of the job's syncs on its emulated link is checked as ``--steps`` is:
    over a year refused (exit 2), over an hour said before the workers start."""
    from lowcomm.train.config import TrainConfig
    from lowcomm.train.preflight import check_link_time, link_seconds
    from lowcomm.tune.cost import Network

    argv = ["train", "--link", "1kbit:1ms", "--steps", "9600000", "--out", str(tmp_path / "r")]
    assert main(argv) == EXIT_USAGE
    line = _one_line(capsys)
    assert "--link (1kbit:1ms) makes the job's syncs alone take at least" in line, line
    assert "years; use a faster link, fewer steps or a longer sync_every" in line
    assert not (tmp_path / "r" / "config.json").exists()
    # the default job on 1 kbit/s: said, with the total, and it runs
    cfg = TrainConfig(link="1kbit:1ms")
    note = check_link_time(cfg, 827_392)
    assert note is not None and note.startswith("--link 1kbit:1ms: the job's syncs alone take")
    hours = float(note.split("at least ")[1].split(" hours")[0].replace(",", ""))
    assert hours > 40
    # DDP: an all-reduce of every parameter every step
    ddp = TrainConfig(algo="ddp", link="10mbit", steps=100)
    net = Network(bandwidth_bps=10e6, latency_s=0.03, cost="emulated")
    assert link_seconds(ddp, 1000) == pytest.approx(100 * net.allreduce_time(4000.0, 2))
    # a fast link, or none: nothing to say
    assert check_link_time(TrainConfig(link="1gbit"), 827_392) is None
    assert link_seconds(TrainConfig(), 827_392) is None
    # SparseLoCo by its exact all-gathered bytes; the default job, which may switch to it, by
    # the cheaper of the two
    from lowcomm.schedules import sparse_bytes_per_element
    from lowcomm.train.config import config_from_dict

    def job(**values: Any) -> TrainConfig:
        return config_from_dict({"link": "1mbit", **values}, source="test")

    sparse = link_seconds(job(algo="sparseloco"), 827_392)
    sent = 827_392 * sparse_bytes_per_element(1 / 64, 8, 2)  # the job's 8 x 8 tiles
    one = Network(bandwidth_bps=1e6, latency_s=0.1, cost="emulated").allgather_time(sent, 2)
    # 960 / 12 rounds and 30 more syncs in its early rounds (every 6 steps for the first 360),
    # no warm start
    assert sparse == pytest.approx((80 + 30) * one)
    assert sparse < link_seconds(job(algo="co2"), 827_392)
    assert link_seconds(job(), 827_392) == pytest.approx(sparse)
    assert link_seconds(job(algo_from_link=False), 827_392) > sparse


# --- the heal transport: the one loader of bytes from another machine ----------------------------


def _heal_transfer(rank: int, world: int, marker: str) -> dict[str, Any]:
    """Rank 0 sends a state over :class:`TensorTransport` three times (a good one, one with a
    planted object, one of the wrong step); rank 1 receives each and reports what it got."""
    from datetime import timedelta

    import torch.distributed as dist

    from lowcomm.elastic.transport import TensorTransport

    pg = dist.distributed_c10d._get_default_group()
    transport = TensorTransport(pg, timedelta(seconds=20))
    timeout = timedelta(seconds=20)
    good = {"model": {"w": torch.arange(4.0)}, "step": 7, "note": "ok"}
    sends = [(7, good), (8, {"model": {"w": torch.zeros(2)}, "x": _Plant(marker)}), (9, good)]
    outcome: dict[str, Any] = {}
    for i, (step, state) in enumerate(sends):
        if rank == 0:
            transport.send_checkpoint([1], step, state, timeout)
        else:
            expect = step if i != 2 else 10  # the last: the joiner expects another step
            try:
                got = transport.recv_checkpoint(0, transport.metadata(), expect, timeout)
                outcome[str(i)] = {"ok": True, "w": got["model"]["w"].tolist()}
            except ValueError as e:
                outcome[str(i)] = {"ok": False, "error": str(e)}
        dist.barrier()
    return outcome


@pytest.mark.timeout(120)
def test_the_heal_transport_refuses_a_planted_state_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    results = run_workers(_heal_transfer, 2, str(marker), timeout_s=60)
    got = results[1]
    assert got["0"] == {"ok": True, "w": [0.0, 1.0, 2.0, 3.0]}
    assert not got["1"]["ok"]
    assert "not tensors, numbers and strings only" in got["1"]["error"]
    assert "refused without loading it" in got["1"]["error"]
    assert not marker.exists(), "the planted object ran on the joiner"
    assert got["2"] == {
        "ok": False,
        "error": "healing: the donor sent the state of step 9, not of 10",
    }
