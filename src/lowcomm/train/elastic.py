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
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any

import torch

from lowcomm.guard import checksum
from lowcomm.train.config import TrainConfig

__all__ = [
    "ATTEMPT_ENV",
    "ElasticReplica",
    "format_elastic_summary",
    "launch_replicas",
    "replica_generator",
    "replica_index",
]

logger = logging.getLogger(__name__)

ATTEMPT_ENV = "LOWCOMM_REPLICA_ATTEMPT"
"""Which start of its replica a process is (0, then 1, 2, … after restarts); set by
:func:`launch_replicas`."""

JOIN_TIMEOUT_S = 5.0
"""How long a quorum waits for a replica that heartbeats but has not asked yet: replicas on one
machine reach a sync within this of each other; one later than this is left out of that sync and
healed at the next."""
HEARTBEAT_TIMEOUT_S = 5.0
"""A replica silent for longer is dead: the next quorum leaves it out."""


def replica_index(replica_id: str) -> int:
    """The number at the end of ``replica_id`` (``replica_3`` -> 3), else a checksum of it."""
    found = re.search(r"(\d+)$", replica_id)
    return int(found.group(1)) if found else zlib.crc32(replica_id.encode())


def replica_generator(
    seed: int, index: int, step: int, gen: torch.Generator | None = None
) -> torch.Generator:
    """The generator the batch of ``step`` of replica ``index`` is drawn from: a function of
    (seed, replica, step) alone, so a replica healed to any step draws what it would have drawn
    there (``gen``: reseeded in place, else a new one)."""
    mixed = ((seed * 1_000_003 + index) * 1_000_003 + step) % (1 << 63)
    return (gen if gen is not None else torch.Generator()).manual_seed(mixed)


def _host_for(lighthouse: str) -> str:
    """The address this replica listens on and advertises: loopback when the Lighthouse is on
    this machine's loopback, else this machine's name."""
    host = lighthouse.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    return socket.gethostname()


class ElasticReplica:
    """This process as one replica of an elastic job (see the module docstring)."""

    def __init__(self, cfg: TrainConfig) -> None:
        from lowcomm.elastic import replica_manager

        assert cfg.lighthouse is not None and cfg.replica_id is not None
        self.cfg = cfg
        self.replica_id = cfg.replica_id
        self.index = replica_index(cfg.replica_id)
        self.attempt = int(os.environ.get(ATTEMPT_ENV, "0") or 0)
        self.replica = replica_manager(
            cfg.lighthouse,
            replica_id=cfg.replica_id,
            host=_host_for(cfg.lighthouse),
            min_replicas=cfg.min_replicas,
            timeout_s=cfg.collective_timeout,
            quorum_timeout_s=max(600.0, cfg.collective_timeout),
        )
        self.steps_trained = 0
        """Inner steps this process computed (those before a heal included)."""
        self.first_step: int | None = None
        """The step it trained from: 1, or the step it was healed to."""
        self.heal_times: list[float] = []
        self._gen = torch.Generator()
        self._seen_syncs = 0

    def generator(self, step: int) -> torch.Generator:
        """This replica's batch generator for ``step`` (:func:`replica_generator`)."""
        return replica_generator(self.cfg.seed, self.index, step, self._gen)

    def synced(self, algo: Any) -> dict[str, Any] | None:
        """After ``algo.step()``: a record of the sync it applied, if it applied one — the
        syncs committed, the quorum's size and a checksum of the anchor, which every replica
        that committed the sync must hold bit for bit — else ``None``."""
        if algo.sync_points == self._seen_syncs:
            return None
        self._seen_syncs = algo.sync_points
        ft = algo.ft
        return {
            "kind": "sync",
            "step": algo.local_step,
            "sync": ft.step,
            "participants": ft.participants[-1] if ft.participants else None,
            "anchor": checksum(torch.cat([v.reshape(-1) for v in algo.anchor_views])),
            "failed_syncs": ft.failed_syncs,
        }

    def follow(self, local_step: int, step: int) -> int:
        """After ``algo.step()`` of ``step``: the step the loop continues from (the donor's,
        right after this replica was healed)."""
        self.steps_trained += 1
        if local_step != step:  # healed: its counters are its donor's
            self.heal_times.append(time.time())
            logger.info(
                "replica %s healed: continues at step %d (was at %d)",
                self.replica_id,
                local_step,
                step,
            )
            step = local_step
        if self.first_step is None:
            self.first_step = step
        return step

    def report(self, algo: Any) -> dict[str, Any]:
        """This replica's part of the job's ``summary.json``."""
        ft = algo.ft
        return {
            "replica_id": self.replica_id,
            "attempt": self.attempt,
            "steps_trained": self.steps_trained,
            "first_step": self.first_step,
            "syncs_committed": ft.step,
            "failed_syncs": ft.failed_syncs,
            "heals": list(ft.heals),
            "heal_times": list(self.heal_times),
            "participants": list(ft.participants),
        }

    def close(self) -> None:
        self.replica.shutdown()


# --- the parent: a Lighthouse and the replicas --------------------------------------------------


@dataclasses.dataclass
class _Running:
    replica_id: str
    attempt: int
    folder: str
    process: subprocess.Popen[bytes]
    started: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(
    cfg: TrainConfig, lighthouse: str, replica_id: str, attempt: int, scratch: str
) -> _Running:
    name = replica_id if attempt == 0 else f"{replica_id}.{attempt}"
    assert cfg.out is not None
    folder = os.path.join(cfg.out, "replicas", name)
    own = dataclasses.replace(
        cfg,
        lighthouse=lighthouse,
        replica_id=replica_id,
        out=folder,
        name=f"{cfg.name}-{name}",
        workers=1,
        overwrite=True,
    )
    config_path = os.path.join(scratch, f"{name}.json")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(own.to_dict(), f)
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        # the replicas share this machine's cores
        "LOCAL_WORLD_SIZE": str(cfg.world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
        ATTEMPT_ENV: str(attempt),
    }
    command = [sys.executable, "-m", "lowcomm.train", config_path, "--failure-dir", scratch]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "process.log"), "wb") as log:
        process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return _Running(replica_id, attempt, folder, process, time.time())


def _stop(running: list[_Running]) -> None:
    for r in running:
        if r.process.poll() is None:
            os.killpg(r.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for r in running:
        try:
            r.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(r.process.pid, signal.SIGKILL)
            r.process.wait()


FINISH_GRACE_S = 30.0
"""After the first replica finished the job, how long the others have to finish too; one still
running then (a restarted replica that never caught up) is stopped, and none is restarted."""


def launch_replicas(
    cfg: TrainConfig,
    *,
    poll_s: float = 0.1,
    join_timeout_s: float = JOIN_TIMEOUT_S,
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
) -> dict[str, Any]:
    """Run ``cfg`` as ``cfg.world_size`` elastic replicas on this machine (module docstring):
    a Lighthouse on 127.0.0.1, one process per replica, each restarted alone when it dies (up to
    ``max_restarts`` times, and not after the job finished). Returns the job's summary (also
    ``<out>/summary.json``).

    Raises:
        lowcomm.train.errors.WorkerFailed: no replica finished the job.
    """
    from lowcomm.elastic import Lighthouse
    from lowcomm.train.errors import WorkerFailed
    from lowcomm.train.metrics import write_json

    assert cfg.out is not None and cfg.name is not None
    os.makedirs(cfg.out, exist_ok=True)
    ids = [f"replica_{i}" for i in range(cfg.world_size)]
    events: list[dict[str, Any]] = []
    finished: list[_Running] = []
    t0 = time.time()
    with (
        Lighthouse(
            min_replicas=cfg.min_replicas,
            join_timeout_s=join_timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
        ) as lighthouse,
        tempfile.TemporaryDirectory(prefix="lowcomm-replicas-") as scratch,
    ):
        running = [_start(cfg, lighthouse.address, rid, 0, scratch) for rid in ids]
        restarts = dict.fromkeys(ids, 0)
        done_at: float | None = None
        try:
            while running:
                time.sleep(poll_s)
                if done_at is not None and time.time() - done_at > FINISH_GRACE_S:
                    for r in running:
                        events.append(
                            {
                                "event": "stopped",
                                "replica": r.replica_id,
                                "attempt": r.attempt,
                                "time_s": time.time() - t0,
                                "exit_code": None,
                            }
                        )
                    break  # the rest are behind a finished job: stopped below
                for r in list(running):
                    code = r.process.poll()
                    if code is None:
                        continue
                    running.remove(r)
                    if code == 0:
                        finished.append(r)
                        done_at = done_at or time.time()
                        continue
                    now = time.time()
                    events.append(
                        {
                            "event": "fault",
                            "replica": r.replica_id,
                            "attempt": r.attempt,
                            "time_s": now - t0,
                            "exit_code": code,
                        }
                    )
                    logger.warning(
                        "replica %s left the job (exit code %d)%s",
                        r.replica_id,
                        code,
                        "; restarting it" if restarts[r.replica_id] < cfg.max_restarts else "",
                    )
                    if restarts[r.replica_id] < cfg.max_restarts and done_at is None:
                        restarts[r.replica_id] += 1
                        running.append(
                            _start(
                                cfg,
                                lighthouse.address,
                                r.replica_id,
                                restarts[r.replica_id],
                                scratch,
                            )
                        )
                        events.append(
                            {
                                "event": "restart",
                                "replica": r.replica_id,
                                "attempt": restarts[r.replica_id],
                                "time_s": time.time() - t0,
                            }
                        )
        finally:
            _stop(running)
    wall_s = time.time() - t0
    summary = _job_summary(cfg, finished, events, wall_s, t0)
    write_json(os.path.join(cfg.out, "summary.json"), summary)
    if not finished:
        last = events[-1] if events else {"replica": ids[0], "exit_code": None}
        raise WorkerFailed(
            0,
            f"no replica finished the job (the last to leave: {last['replica']}, exit code "
            f"{last['exit_code']}; logs in {os.path.join(cfg.out, 'replicas')})",
        )
    return summary


def _read_summary(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, "summary.json"), encoding="utf-8") as f:
            data: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return None
    return data


def _job_summary(
    cfg: TrainConfig,
    finished: list[_Running],
    events: list[dict[str, Any]],
    wall_s: float,
    t0: float,
) -> dict[str, Any]:
    """The elastic job's summary: the finished replicas' results, every fault with the time
    until its replica was back and healed, and the tokens trained."""
    tokens_per_step = cfg.batch_size * cfg.block_size
    replicas = []
    for r in finished:
        own = _read_summary(r.folder) or {}
        replicas.append({"folder": r.folder, **(own.get("elastic") or {})})
    first = _read_summary(finished[0].folder) if finished else None
    heal_times = {(e["replica_id"], e["attempt"]): e.get("heal_times", []) for e in replicas if e}
    faults = []
    for e in events:
        if e["event"] != "fault":
            continue
        back = heal_times.get((e["replica"], e["attempt"] + 1), [])
        healed_s = back[0] - t0 if back else None
        faults.append(
            {
                "replica": e["replica"],
                "at_s": e["time_s"],
                "exit_code": e["exit_code"],
                "healed_at_s": healed_s,
                "fault_to_healed_s": None if healed_s is None else healed_s - e["time_s"],
            }
        )
    trained = sum(int(r.get("steps_trained", 0)) for r in replicas)
    planned = cfg.world_size * cfg.steps
    survivor = max(replicas, key=lambda r: len(r.get("participants", [])), default={})
    participants = list(survivor.get("participants", []))
    return {
        "status": "finished" if finished else "failed",
        "algo": cfg.algo,
        "name": cfg.name,
        "out": cfg.out,
        "replicas": cfg.world_size,
        "min_replicas": cfg.min_replicas,
        "steps": cfg.steps,
        "sync_every": cfg.sync_every,
        "wall_time_s": wall_s,
        "tokens_trained": trained * tokens_per_step,
        "tokens_per_s": trained * tokens_per_step / wall_s if wall_s > 0 else None,
        "tokens_not_trained": max(0, planned - trained) * tokens_per_step,
        "val_loss_initial": None if first is None else first.get("val_loss_initial"),
        "val_loss_final": None if first is None else first.get("val_loss_final"),
        "replicas_identical": len(
            {
                (_read_summary(r.folder) or {})
                .get("comm_per_worker", [{}])[0]
                .get("params_checksum")
                for r in finished
            }
        )
        == 1,
        "participants_per_sync": participants,
        "faults": faults,
        "heals": sum(len(r.get("heals", [])) for r in replicas),
        "finished_replicas": [r.folder for r in finished],
        "events": events,
    }


def format_elastic_summary(summary: dict[str, Any], *, command_s: float | None = None) -> str:
    """The table ``lowcomm train --fault-tolerance`` prints."""

    def loss(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    faults = summary.get("faults") or []
    healed = [f["fault_to_healed_s"] for f in faults if f.get("fault_to_healed_s") is not None]
    participants = summary.get("participants_per_sync") or []
    rows = [
        ("algorithm", f"{summary['algo']} (sync every {summary['sync_every']} steps, elastic)"),
        ("replicas", f"{summary['replicas']} (at least {summary['min_replicas']} per sync)"),
        ("steps", f"{summary['steps']:,}"),
        (
            "tokens trained",
            f"{summary['tokens_trained']:,} ({summary['tokens_not_trained']:,} "
            "not trained while replicas were away)",
        ),
        (
            "tokens/s",
            "-"
            if summary.get("tokens_per_s") is None
            else f"{summary['tokens_per_s']:,.0f} (every replica, start-up and faults included)",
        ),
        (
            "val loss",
            f"{loss(summary.get('val_loss_initial'))} -> {loss(summary.get('val_loss_final'))}",
        ),
        (
            "faults",
            f"{len(faults)}; healed {len(healed)}"
            + (f", fault to healed {min(healed):.1f}-{max(healed):.1f} s" if healed else ""),
        ),
        (
            "participants",
            "-"
            if not participants
            else f"{min(participants)}-{max(participants)} per sync over {len(participants)} syncs",
        ),
        ("replicas identical", "yes" if summary.get("replicas_identical") else "no"),
        (
            "wall time",
            f"{summary['wall_time_s']:.1f} s"
            + (f", {command_s:.1f} s with start-up" if command_s is not None else ""),
        ),
        ("output", str(summary.get("out"))),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"lowcomm train: {summary.get('name')} {summary.get('status')}"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)
