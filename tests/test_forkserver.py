"""How the local launcher starts its workers (lowcomm.procs.forkserver): forked from a server
that imported torch once, yet with this process's environment and output as they are when the
job starts, as a spawned worker would have them."""

from __future__ import annotations

import json
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from lowcomm.cli import main
from lowcomm.procs.forkserver import START_METHOD_ENV, ForkedCommand, preload, start_method
from lowcomm.testing.jobs import TINY_JOB, TINY_JOB_ARGS
from lowcomm.train.config import TrainConfig, config_from_dict
from lowcomm.train.launcher import launch
from lowcomm.train.worker import main as worker_main

pytestmark = pytest.mark.skipif(
    "forkserver" not in multiprocessing.get_all_start_methods(), reason="no forkserver here"
)

MARK = "LOWCOMM_TEST_WORKER_MARK"
GONE = "LOWCOMM_TEST_GONE_SINCE_THE_SERVER_STARTED"


def _report(cfg: Any, *, device: Any) -> dict[str, Any]:
    """A worker's job: say what it sees, on its standard output and error and in its result."""
    rank = int(os.environ["RANK"])
    print(f"worker {rank} on stdout", flush=True)
    print(f"worker {rank} on stderr", file=sys.stderr, flush=True)
    return {
        "mark": os.environ.get(MARK),
        "gone": os.environ.get(GONE),
        "rank": rank,
        "world": os.environ.get("WORLD_SIZE"),
        "parent": os.getppid(),
    }


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_take_the_launching_processes_environment_and_output(
    method: str, tmp_path: Any, capfd: Any, monkeypatch: Any
) -> None:
    # the server starts while GONE is set and MARK is not; then the job's process changes both
    monkeypatch.setenv(GONE, "stale")
    preload()
    multiprocessing.forkserver.ensure_running()
    monkeypatch.delenv(GONE)
    monkeypatch.setenv(MARK, "fresh")
    monkeypatch.setenv(START_METHOD_ENV, method)
    assert start_method() == method

    cfg = TrainConfig(workers=2, out=str(tmp_path / "run"), quiet=True).with_paths()
    result = launch(cfg, job=_report)

    assert result is not None
    assert result["mark"] == "fresh" and result["gone"] is None
    assert result["rank"] == 0 and result["world"] == "2"  # torch elastic's variables on top
    # forked from the server (not this process), or spawned by torch elastic's agent here
    assert (result["parent"] != os.getpid()) == (method == "forkserver")
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"worker {rank} on stdout" in out
        assert f"worker {rank} on stderr" in err


def test_forked_and_spawned_workers_train_the_same_bits(train_job: Any, monkeypatch: Any) -> None:
    # nothing the server imports changes torch's state for the workers (defaults, generators)
    args = ["--algo", "co2", *TINY_JOB_ARGS, "--compression", "int4"]
    args += ["--sync-warmup", "4", "--sync-warmup-compression", "int2"]
    finals = []
    for method in ("forkserver", "spawn"):
        monkeypatch.setenv(START_METHOD_ENV, method)
        summary = train_job(*args)
        finals.append((summary["val_loss_final"], summary["val_loss_initial"]))
    assert finals[0] == finals[1]


def test_a_bad_start_method_is_named_before_any_worker_starts(
    tmp_path: Any, capsys: Any, monkeypatch: Any
) -> None:
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    assert main(["train", "--steps", "4", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"{START_METHOD_ENV}='fork'" in err and "forkserver, spawn" in err
    assert not (tmp_path / "run").exists()


def _worker_env(port: int) -> dict[str, str]:
    """The environment of a one-process job's worker, and nothing of this process's."""
    return {
        "PATH": os.environ.get("PATH", ""),
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
    }


def test_a_forked_command_runs_as_a_session_leader_with_the_given_environment_and_log(
    tmp_path: Any,
) -> None:
    # what the elastic launcher's replicas are: `python -m lowcomm.train CONFIG` as Popen with
    # start_new_session=True would run it, forked from the server; the job finds its rank and
    # rendezvous only in the environment given (this process and the server have none)
    from lowcomm.train.elastic import _free_port

    cfg = config_from_dict(
        dict(**{**TINY_JOB, "workers": 1, "steps": 8}, out=str(tmp_path / "run"))
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg.with_paths().to_dict()))
    log = tmp_path / "process.log"
    log.write_text("")
    p = ForkedCommand(worker_main, [str(config)], _worker_env(_free_port()), str(log))
    assert os.getsid(p.pid) == p.pid and os.getpgid(p.pid) == p.pid  # killpg reaches it
    assert p.wait(timeout=120) == 0 and p.poll() == 0 and p.returncode == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps_run"] == 8

    # a failure: its exit code, and the error in its log (output and error both go there)
    bad = ForkedCommand(
        worker_main, [str(tmp_path / "missing.json")], _worker_env(_free_port()), str(log)
    )
    assert bad.wait(timeout=60) == 1
    assert "missing.json" in log.read_text()

    # killed as the launcher kills a replica: the whole session, and the signal as the code
    cfg = config_from_dict(
        dict(**{**TINY_JOB, "workers": 1, "steps": 10_000}, out=str(tmp_path / "long"))
    )
    config.write_text(json.dumps(cfg.with_paths().to_dict()))
    p = ForkedCommand(worker_main, [str(config)], _worker_env(_free_port()), str(log))
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.5)
    os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.parametrize(
    "argv,env,started",
    [
        (["train", "--steps", "8"], {}, True),
        (["train", "--help"], {}, False),
        (["train", "--lighthouse", "http://127.0.0.1:1"], {}, False),
        (["train"], {"TORCHELASTIC_RUN_ID": "x"}, False),
        (["bench", "--quick"], {}, False),
    ],
    ids=["train", "help", "one-replica", "under-torchrun", "bench"],
)
def test_lowcomm_train_starts_its_fork_server_before_parsing(
    argv: list[str], env: dict[str, str], started: bool
) -> None:
    """``lowcomm train`` starts the server its workers are forked from before it parses its
    flags (whose parser imports torch), so that the server's imports run beside its own: only
    where workers will be started on this machine."""
    code = (
        "import sys, multiprocessing.forkserver as f, lowcomm.cli as c\n"
        f"c._start_workers_early({argv!r})\n"
        "print(f._forkserver._forkserver_pid is not None)\n"
        "from lowcomm.procs.forkserver import stop_server\n"
        "stop_server()  # (it would hold the output until its imports are done)\n"
        "assert f._forkserver._forkserver_pid is None\n"
    )
    environment = {**os.environ, **env}
    environment.pop(START_METHOD_ENV, None)
    if "TORCHELASTIC_RUN_ID" not in env:
        environment.pop("TORCHELASTIC_RUN_ID", None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(started and start_method() == "forkserver")


def test_a_train_command_refused_on_its_flags_ends_the_server_it_started() -> None:
    """The early server holds the command's output until its imports are done: a command
    refused before any worker starts (exit status 2) ends it at once."""
    code = (
        "import multiprocessing.forkserver as f, lowcomm.cli as c\n"
        "rc = c.main(['train', '--steps', '-3'])\n"
        "print(rc, f._forkserver._forkserver_pid is None)\n"
    )
    environment = {k: v for k, v in os.environ.items() if k != START_METHOD_ENV}
    environment.pop("TORCHELASTIC_RUN_ID", None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "True"]
    assert "--steps must be >= 1" in done.stderr
