"""Elastic replicas of a ``lowcomm train`` job (``--fault-tolerance``; torchft underneath, see
:mod:`lowcomm.elastic`).

Every worker is a replica of its own: a process with a process group of one, whose outer
algorithm's syncs go through torchft (``fault_tolerance=``). The parent (:func:`launch_replicas`)
starts a Lighthouse on 127.0.0.1 and the replicas, restarts a replica that dies on its own (up to
``max_restarts`` times each) while the others keep training, and assembles the job's
``summary.json`` from the replicas' own. Each process writes its own run folder,
``<out>/replicas/<replica id>/`` (``<id>.<n>`` for its n-th restart).

**Data.** A replica's batches are its own stream: the batch of step s comes from a generator
seeded by (seed, replica index, s), so a replica healed to step s draws what it would have drawn
at s — nothing replayed, nothing skipped — with no data state to heal.

**Steps.** A replica healed at a sync takes its donor's step; its loop continues from there
(:meth:`ElasticReplica.follow`), with the learning rate of that step.

This module is the parent; a replica's own side, in its process, is :mod:`lowcomm.train.replica`
and the job's table :func:`lowcomm.train.report.format_elastic_summary` (both importable from
here too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, Protocol

from lowcomm.procs.forkserver import ForkedCommand, start_method
from lowcomm.train.config import TrainConfig
from lowcomm.train.elastic_config import heal_of
from lowcomm.train.replica import ATTEMPT_ENV, ElasticReplica, replica_generator, replica_index
from lowcomm.train.report import format_elastic_summary

__all__ = [
    "ATTEMPT_ENV",
    "ElasticReplica",
    "RunningReplica",
    "format_elastic_summary",
    "job_status",
    "join_timeout",
    "launch_replicas",
    "read_replica_records",
    "replica_generator",
    "replica_index",
]

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 2.0
"""How long a quorum whose members changed waits for a replica that heartbeats but has not asked
yet: replicas on one machine reach a sync within this of each other; one later than this is left
out of that sync and healed at the next. (A quorum of the same members as the last forms at
once.)"""
JOIN_TIMEOUT_MAX_S = 60.0
"""The longest join timeout :func:`join_timeout` gives (torchft's own default)."""
HEAL_WORDS = 5
"""fp32 words a heal past the warm start carries per trainable parameter, at most: the anchor,
CO2's three outer buffers with the gap-aware penalty (momentum, gap statistic, last update; the
momentum alone without it) and the inner AdamW's two moments in bf16 (what
:func:`join_timeout` prices)."""


def join_timeout(cfg: TrainConfig) -> float:
    """The Lighthouse's join timeout for ``cfg``: :data:`JOIN_TIMEOUT_S`, plus, over an
    emulated link with heals that block (``heal`` blocking, replicas of several processes, or
    LocalSGD: :func:`lowcomm.train.elastic_config.heal_of`),
    twice the time a heal takes on it. A donor's link then carries the heal before its next
    collectives, so the donor and its joiner reach the next sync that much after the others; a
    quorum that went on without them would leave them behind, to be healed again — each heal
    delaying its own donor in turn. A heal in the background (``heal`` background) delays no
    one."""
    if cfg.link is None or heal_of(cfg) == "background":
        return JOIN_TIMEOUT_S
    from lowcomm.link import EmulatedLink
    from lowcomm.train.nodes import node_link

    link = node_link(EmulatedLink.parse(cfg.link), cfg)
    parameters = 12 * cfg.n_layer * cfg.n_embd**2 + (256 + cfg.block_size) * cfg.n_embd
    heal_s = link.latency_s + 8.0 * 4 * HEAL_WORDS * parameters / link.bandwidth_bps
    return min(JOIN_TIMEOUT_MAX_S, JOIN_TIMEOUT_S + 2.0 * heal_s)


HEARTBEAT_TIMEOUT_S = 2.0
"""A replica silent for longer is dead: the next quorum leaves it out. Until then the others wait
for it at their next sync, so this is what one fault costs them."""


# --- the parent: a Lighthouse and the replicas --------------------------------------------------


class ReplicaProcess(Protocol):
    """A process of a replica: a :class:`subprocess.Popen` (``LOWCOMM_START_METHOD=spawn``) or
    a :class:`~lowcomm.procs.forkserver.ForkedCommand`, in its own session either way."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


@dataclasses.dataclass
class RunningReplica:
    """One replica :func:`launch_replicas` started: its id, which start of it this is (0, then
    1, 2, … after restarts), its run folder, its processes (one, or a node group's: group rank
    0 first, which writes the folder), its start time and the store its processes share (a node
    group's; ``None`` for one process)."""

    replica_id: str
    attempt: int
    folder: str
    processes: list[ReplicaProcess]
    started: float
    store: Any = None

    @property
    def process(self) -> ReplicaProcess:
        """Group rank 0's process (a fault sent to it brings the whole replica down)."""
        return self.processes[0]

    def poll(self) -> int | None:
        """``None`` while the replica runs; else its exit code: a non-zero one among its
        processes (the replica failed as soon as one of them did) — the first ended by a
        signal if any was (the others of a node group exit on their own once they lose it),
        else the first — or 0 when every one finished."""
        codes = [p.poll() for p in self.processes]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            signalled = [c for c in failed if c < 0]
            return (signalled or failed)[0]
        return None if None in codes else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(
    cfg: TrainConfig,
    lighthouse: str,
    replica_id: str,
    attempt: int,
    scratch: str,
    extra_env: dict[str, str] | None = None,
) -> RunningReplica:
    name = replica_id if attempt == 0 else f"{replica_id}.{attempt}"
    assert cfg.out is not None
    folder = os.path.join(cfg.out, "replicas", name)
    procs = cfg.procs_per_replica
    own = dataclasses.replace(
        cfg,
        lighthouse=lighthouse,
        replica_id=replica_id,
        out=folder,
        name=f"{cfg.name}-{name}",
        # a replica's processes are its WORLD (DDP inside it when several)
        workers=procs,
        nodes=1,
        procs_per_node=None,
        overwrite=True,
    )
    config_path = os.path.join(scratch, f"{name}.json")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(own.to_dict(), f)
    store = None
    if procs > 1:
        # the node group's store, fresh for every start of it (never a dead start's keys);
        # its processes connect to it as torchrun's workers connect to their agent's
        from lowcomm.comm import host_store

        store = host_store("127.0.0.1", 0)
    env = {
        **os.environ,
        "WORLD_SIZE": str(procs),
        # the replicas share this machine's cores
        "LOCAL_WORLD_SIZE": str(cfg.world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port if store is not None else _free_port()),
        "TORCHELASTIC_USE_AGENT_STORE": "True" if store is not None else "False",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
        ATTEMPT_ENV: str(attempt),
        **(extra_env or {}),
    }
    args = [config_path, "--failure-dir", scratch]
    os.makedirs(folder, exist_ok=True)
    forked: Callable[[list[str]], int] | None = None
    if start_method() == "forkserver":
        from lowcomm.train.worker import main as worker_main  # (loads the training stack)

        forked = worker_main
    processes: list[ReplicaProcess] = []
    for j in range(procs):
        log_name = "process.log" if j == 0 else f"process.{j}.log"
        own_env = {**env, "RANK": str(j), "LOCAL_RANK": str(j)}
        log_path = os.path.join(folder, log_name)
        processes.append(_command("lowcomm.train", forked, args, own_env, log_path))
    return RunningReplica(replica_id, attempt, folder, processes, time.time(), store)


TUNING_TIMEOUT_S = 900.0
"""How long the process that chooses an elastic job's settings from its link may take."""


def _tune_replicas(
    cfg: TrainConfig, scratch: str, env: dict[str, str] | None
) -> tuple[dict[str, str], dict[str, Any] | None]:
    """``env`` for the replicas: with the settings chosen for the link once for the whole job
    (:mod:`lowcomm.train.tuning`), by one process of a replica's shape run here first, when the
    job is tuned; and that choice's record (``None``: not tuned). Its log:
    ``<out>/tuning.log``."""
    from lowcomm.train.errors import WorkerFailed
    from lowcomm.train.tuning import TUNED_ENV, heals_from_link, why_untuned

    env = dict(env or {})
    if why_untuned(cfg) is not None and not heals_from_link(cfg):
        return env, None
    assert cfg.out is not None
    config_path = os.path.join(scratch, "tuning.json")
    record_path = os.path.join(scratch, "tuned.json")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(cfg.to_dict(), f)
    own_env = {
        **os.environ,
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        # as one replica's process among the job's on this machine's cores
        "LOCAL_WORLD_SIZE": str(cfg.world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        **env,
    }
    log_path = os.path.join(cfg.out, "tuning.log")
    args = [config_path, record_path]
    forked: Callable[[list[str]], int] | None = None
    if start_method() == "forkserver":
        from lowcomm.train.tuning_process import main as tuning_main

        forked = tuning_main
    process = _command("lowcomm.train.tuning_process", forked, args, own_env, log_path)
    try:
        code = process.wait(timeout=TUNING_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)
        code = None
    if code != 0 or not os.path.exists(record_path):
        raise WorkerFailed(
            0,
            f"choosing the settings for the link failed (exit code {code}; its log: {log_path}); "
            "give them yourself with --tune-link off",
        )
    env[TUNED_ENV] = record_path
    with open(record_path, encoding="utf-8") as f:
        record = json.load(f)["record"]
    if record is not None:
        from lowcomm.train.report import describe_choice

        logger.info("settings from the link %s: %s", record["link"], describe_choice(record))
    return env, record


def _command(
    module: str,
    main: Callable[[list[str]], int] | None,
    args: list[str],
    env: dict[str, str],
    log_path: str,
) -> ReplicaProcess:
    """``python -m MODULE ARGS`` with ``env`` in a session of its own, its output to
    ``log_path`` (emptied first): forked from the server when ``main`` (MODULE's entry point) is
    given, without importing torch again (:mod:`lowcomm.procs.forkserver`), else a fresh
    interpreter."""
    if main is not None:
        open(log_path, "wb").close()
        return ForkedCommand(main, args, env, log_path, module=module)
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(running: list[RunningReplica], sig: int = signal.SIGTERM) -> None:
    """Stop every process of ``running`` (``sig``, then SIGKILL after 10 s)."""
    processes = [p for r in running for p in r.processes]
    for p in processes:
        if p.poll() is None:
            _signal_group(p.pid, sig)
            _signal_group(p.pid, signal.SIGCONT)  # one stopped (SIGSTOP) handles it too
    deadline = time.monotonic() + 10
    for p in processes:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p.pid, signal.SIGKILL)
            p.wait()


def _signal_group(pid: int, sig: int) -> None:
    """``sig`` to the process group of ``pid``; a group already gone (its processes ended
    between the check and the signal, e.g. on the SIGTERM just sent) is stopped already."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


STATUS_EVERY_S = 1.0
"""How often :func:`launch_replicas` reports the job's state to its ``status`` callback."""


def read_replica_records(folder: str) -> list[dict[str, Any]]:
    """The records of a replica's ``metrics.jsonl`` (a line cut by a kill is skipped)."""
    out = []
    try:
        with open(os.path.join(folder, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return out


def job_status(replicas: list[RunningReplica], events: list[dict[str, Any]]) -> dict[str, Any]:
    """The state of an elastic job from what its replicas wrote so far: the furthest step, the
    replicas in the latest sync's quorum, replicas running, faults and heals."""
    step = 0
    last_sync: dict[str, Any] = {}
    heals = 0
    for r in replicas:
        for record in read_replica_records(r.folder):
            kind = record.get("kind")
            if kind == "healed":
                heals += 1
            elif kind in ("step", "sync") and int(record.get("step", 0)) > step:
                step = int(record["step"])
            if kind == "sync" and int(record.get("sync", 0)) >= int(last_sync.get("sync", 0)):
                last_sync = record
    return {
        "step": step,
        "running": sum(r.poll() is None for r in replicas),
        "participants": last_sync.get("participants"),
        "sync": last_sync.get("sync", 0),
        "faults": sum(e["event"] == "fault" for e in events),
        "heals": heals,
    }


def _last_sync(folder: str) -> int:
    """The last sync a replica's ``metrics.jsonl`` records (0: none yet)."""
    syncs = [r for r in read_replica_records(folder) if r.get("kind") == "sync"]
    return int(syncs[-1]["sync"]) if syncs else 0


def _behind(running: list[RunningReplica], first: RunningReplica) -> list[RunningReplica]:
    """The running replicas more than one sync behind ``first``, which finished the job: the
    others are gone from the Lighthouse, so such a replica would form quorums of its own and
    train the rest of the job alone from its stale state."""
    own = (_read_summary(first.folder) or {}).get("elastic") or {}
    final = int(own.get("syncs_committed", 0))
    return [r for r in running if _last_sync(r.folder) < final - 1]


def _event(kind: str, r: RunningReplica, t0: float, code: int | None = None) -> dict[str, Any]:
    """A line of the job's ``events``: what happened to which start of which replica, when."""
    return {
        "event": kind,
        "replica": r.replica_id,
        "attempt": r.attempt,
        "time_s": time.time() - t0,
        "exit_code": code,
    }


class _TermAsExit:
    """While the replicas run, SIGTERM to this process raises ``KeyboardInterrupt``, as Ctrl-C
    does, so that the replicas (each in a session of its own) are stopped with it, not
    orphaned, and the command exits as interrupted (130)."""

    def __init__(self) -> None:
        import threading

        self._old: Any = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._raise)

    @staticmethod
    def _raise(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None


FINISH_GRACE_S = 30.0
"""After the first replica finished the job, how long the others have to finish too; one still
running then (a restarted replica that never caught up) is stopped, and none is restarted."""


def launch_replicas(
    cfg: TrainConfig,
    *,
    poll_s: float = 0.1,
    join_timeout_s: float | None = None,
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    env: dict[str, str] | None = None,
    chaos: Callable[[float, list[RunningReplica], bool], None] | None = None,
    status: Callable[[dict[str, Any]], None] | None = None,
    hold: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """Run ``cfg`` as ``cfg.replicas`` elastic replicas on this machine (module docstring):
    a Lighthouse on 127.0.0.1, one process per replica (``procs_per_node`` with node groups),
    each restarted alone when it dies — a node group as a unit, when any of its processes
    dies — up to ``max_restarts`` times, and not after the job finished. Returns the job's
    summary (also ``<out>/summary.json``).

    ``env`` is added to every replica's environment; ``chaos(seconds since the start, running
    replicas, whether a replica finished the job)`` is called every poll (the chaos benchmark's
    faults: it may signal the replicas' processes). ``status`` receives the job's state about
    once a second (:func:`job_status`): the progress line of ``lowcomm train``.
    ``join_timeout_s``: the Lighthouse's (default :func:`join_timeout`). ``hold(replica
    id)``: while it returns True, a replica that left is not restarted (it is, at the first
    poll where it returns False; the soak's random starts).

    Raises:
        lowcomm.train.errors.WorkerFailed: no replica finished the job.
    """
    from lowcomm.elastic import Lighthouse
    from lowcomm.runfiles import write_json
    from lowcomm.train.errors import WorkerFailed

    assert cfg.out is not None and cfg.name is not None
    out = cfg.out
    os.makedirs(out, exist_ok=True)
    ids = [f"replica_{i}" for i in range(cfg.replicas)]
    events: list[dict[str, Any]] = []
    finished: list[RunningReplica] = []
    t0 = time.time()
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="lowcomm-replicas-"))
        stop_on_term = _TermAsExit()
        env, record = _tune_replicas(cfg, scratch, env)
        heal = ((record or {}).get("settings") or {}).get("heal")
        if cfg.heal is None and heal is not None:  # chosen for the link: the Lighthouse's too
            cfg = cfg.replace(heal=heal)
        lighthouse = stack.enter_context(
            Lighthouse(
                min_replicas=cfg.min_replicas,
                join_timeout_s=join_timeout(cfg) if join_timeout_s is None else join_timeout_s,
                heartbeat_timeout_s=heartbeat_timeout_s,
            )
        )
        running = [_start(cfg, lighthouse.address, rid, 0, scratch, env) for rid in ids]
        started = list(running)
        restarts = dict.fromkeys(ids, 0)
        held: list[RunningReplica] = []  # left, to be restarted once hold() lets them
        done_at: float | None = None
        reported = 0.0

        def restart(r: RunningReplica) -> None:
            restarts[r.replica_id] += 1
            running.append(
                _start(cfg, lighthouse.address, r.replica_id, restarts[r.replica_id], scratch, env)
            )
            started.append(running[-1])
            events.append(_event("restart", running[-1], t0))

        try:
            while running or (held and done_at is None):
                time.sleep(poll_s)
                assert hold is not None or not held
                for r in [r for r in held if done_at is None and hold and not hold(r.replica_id)]:
                    held.remove(r)
                    restart(r)
                if done_at is not None and time.time() - done_at > FINISH_GRACE_S:
                    events += [_event("stopped", r, t0) for r in running]
                    break  # the rest are behind a finished job: stopped below
                if chaos is not None:
                    chaos(time.time() - t0, running, done_at is not None)
                if status is not None and time.time() - reported >= STATUS_EVERY_S:
                    reported = time.time()
                    status(job_status([*running, *finished], events))
                if done_at is not None:
                    for r in _behind(running, finished[0]):
                        # it would train the rest alone from its own state: stopped
                        running.remove(r)
                        _stop([r])
                        events.append(_event("stopped", r, t0))
                        logger.warning(
                            "replica %s stopped: it was behind when the job finished",
                            r.replica_id,
                        )
                for r in list(running):
                    code = r.poll()
                    if code is None:
                        continue
                    running.remove(r)
                    if code != 0:
                        _stop([r], signal.SIGKILL)  # a node group goes down as a unit
                    if code == 0:
                        finished.append(r)
                        done_at = done_at or time.time()
                        continue
                    events.append(_event("fault", r, t0, code))
                    again = restarts[r.replica_id] < cfg.max_restarts
                    kept = again and hold is not None and hold(r.replica_id)
                    logger.warning(
                        "replica %s left the job (exit code %d)%s",
                        r.replica_id,
                        code,
                        "; it stays away until it is started"
                        if kept
                        else ("; restarting it" if again else ""),
                    )
                    if restarts[r.replica_id] < cfg.max_restarts and done_at is None:
                        if hold is not None and hold(r.replica_id):
                            held.append(r)
                        else:
                            restart(r)
        finally:
            _stop(running)
            stop_on_term.restore()
    wall_s = time.time() - t0
    summary = _job_summary(cfg, started, finished, events, wall_s, t0)
    write_json(os.path.join(out, "summary.json"), summary)
    if not finished:
        last = events[-1] if events else {"replica": ids[0], "exit_code": None}
        raise WorkerFailed(
            0,
            f"no replica finished the job (the last to leave: {last['replica']}, exit code "
            f"{last['exit_code']}; logs in {os.path.join(out, 'replicas')})",
        )
    return summary


def _read_summary(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, "summary.json"), encoding="utf-8") as f:
            data: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return None
    return data


def _contribution(folder: str, finished: bool) -> tuple[int, list[float]]:
    """What one replica process added to the job, from its ``metrics.jsonl``: the inner steps
    it trained that reached the model, and the times it was healed at. Its work counts from
    its start, or from the step it was healed to (healed in the background, the sync at which
    its donor's state had arrived and was applied), up to each sync it committed; what it
    trained since its last committed sync is lost where a sync is not committed (the round
    dropped), where it is healed (its state replaced by its donor's: a survivor behind the
    others is healed too, and its work before stays counted) and where it is killed. A
    replica that finished counts to its last step."""
    banked, last_step = 0, 0
    start: int | None = 0  # where the work not yet committed began (None: catching up)
    last: tuple[int, int] = (-1, 0)  # the last sync that counted steps: its step, how many
    heals: list[float] = []
    for record in read_replica_records(folder):
        kind = record.get("kind")
        if kind == "healed":
            heals.append(float(record.get("time", 0.0)))
            if start is not None:  # (healed in the background: counts once caught up)
                start = int(record["step"])
                if last[0] == start:  # healed in that sync's quorum: its step is the donor's
                    banked -= last[1]
                    last = (-1, 0)
        elif kind == "sync":
            step = int(record["step"])
            if record.get("catching_up"):  # healed in the background, not caught up yet: its
                start = None  # steps so far reach no model
            elif record.get("caught_up"):  # the heal completed here
                start = step
                if heals:
                    heals[-1] = float(record.get("time", heals[-1]))
            elif start is not None:
                if record.get("committed", True):
                    last = (step, max(0, step - start))
                    banked += last[1]
                start = step  # (an uncommitted sync dropped the round)
        if kind in ("step", "sync"):
            last_step = max(last_step, int(record.get("step", 0)))
    if start is None and heals:
        heals.pop()  # (it never caught up: not healed)
    if finished and start is not None:
        banked += max(0, last_step - start)
    return banked, heals


def _job_summary(
    cfg: TrainConfig,
    started: list[RunningReplica],
    finished: list[RunningReplica],
    events: list[dict[str, Any]],
    wall_s: float,
    t0: float,
) -> dict[str, Any]:
    """The elastic job's summary: the finished replicas' results, every fault with the time
    until its replica was back and healed, and the tokens trained by every process started
    (:func:`_contribution`)."""
    tokens_per_step = cfg.batch_size * cfg.block_size * cfg.procs_per_replica
    replicas = []
    for r in finished:
        own = _read_summary(r.folder) or {}
        replicas.append({"folder": r.folder, **(own.get("elastic") or {})})
    first = _read_summary(finished[0].folder) if finished else None
    trained = 0
    heal_times: dict[tuple[str, int], list[float]] = {}
    folders: dict[tuple[str, int], str] = {}
    for r in started:
        steps, heals = _contribution(r.folder, r in finished)
        trained += steps
        heal_times[(r.replica_id, r.attempt)] = heals
        folders[(r.replica_id, r.attempt)] = r.folder
    faults = []
    for e in events:
        if e["event"] != "fault":
            continue
        key = (e["replica"], e["attempt"] + 1)
        back = heal_times.get(key, [])
        healed_s = back[0] - t0 if back else None
        # what the returning replica's heal carried and how long its transfer took (over an
        # emulated link: what the link takes), from its own summary once it finished
        own = (_read_summary(folders[key]) or {}).get("elastic") or {} if key in folders else {}
        transfers = own.get("heal_transfer_s") or []
        faults.append(
            {
                "replica": e["replica"],
                "at_s": e["time_s"],
                "exit_code": e["exit_code"],
                "healed_at_s": healed_s,
                "fault_to_healed_s": None if healed_s is None else healed_s - e["time_s"],
                "heal_bytes": own.get("heal_bytes_received"),
                "heal_transfer_s": transfers[0] if transfers else None,
            }
        )
    planned = cfg.replicas * cfg.steps
    survivor = max(replicas, key=lambda r: len(r.get("participants", [])), default={})
    participants = list(survivor.get("participants", []))
    return {
        "status": "finished" if finished else "failed",
        # (the replicas' own: the settings from the link may have switched the default job's)
        "algo": (first or {}).get("algo") or cfg.algo,
        "name": cfg.name,
        "out": cfg.out,
        "replicas": cfg.replicas,
        "procs_per_replica": cfg.procs_per_replica,
        "min_replicas": cfg.min_replicas,
        "steps": cfg.steps,
        "sync_every": cfg.sync_every,
        "early_rounds": None if first is None else first.get("early_rounds"),
        "overlap": 0 if first is None else first.get("overlap") or 0,
        "link": None if cfg.link is None else f"{cfg.link} (emulated)",
        # the settings chosen for the link, once for every replica
        "link_tuning": None if first is None else first.get("link_tuning"),
        "started_at": t0,
        "wall_time_s": wall_s,
        "tokens_trained": trained * tokens_per_step,
        "tokens_per_s": trained * tokens_per_step / wall_s if wall_s > 0 else None,
        "tokens_not_trained": max(0, planned - trained) * tokens_per_step,
        "val_loss_initial": None if first is None else first.get("val_loss_initial"),
        "val_loss_final": None if first is None else first.get("val_loss_final"),
        "replicas_identical": len(
            {
                rank.get("params_checksum")
                for r in finished
                for rank in (_read_summary(r.folder) or {}).get("comm_per_worker") or [{}]
            }
        )
        == 1,
        "participants_per_sync": participants,
        "faults": faults,
        "heals": sum(len(h) for h in heal_times.values()),
        "finished_replicas": [r.folder for r in finished],
        "events": events,
    }
