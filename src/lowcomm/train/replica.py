"""One replica of an elastic ``lowcomm train`` job, inside its own process (the job and its
parent are :mod:`lowcomm.train.elastic`): its batch stream (a function of seed, replica and
step), the records of the syncs it applies and of its heals, the faults it arms, and its part of
the job's summary."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import time
import zlib
from typing import Any

import torch

from lowcomm.guard import checksum
from lowcomm.link import EmulatedLink
from lowcomm.train.config import TrainConfig
from lowcomm.train.elastic_config import heal_inner_for, heal_of
from lowcomm.train.nodes import node_link

__all__ = ["ATTEMPT_ENV", "ElasticReplica", "replica_generator", "replica_index"]

logger = logging.getLogger(__name__)

ATTEMPT_ENV = "LOWCOMM_REPLICA_ATTEMPT"
"""Which start of its replica a process is (0, then 1, 2, … after restarts); set by
:func:`~lowcomm.train.elastic.launch_replicas`."""


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


def _outer_digest(algo: Any) -> str:
    """A checksum of every fragment's outer state (its optimizer's buffers; beside the anchor,
    what the replicas of a committed sync must hold bit for bit: CO2's unused gap buffers,
    which a heal leaves to the joiner, are left out)."""
    tensors = [
        t.detach().reshape(-1).float()
        for f in algo.fragments
        if f.outer is not None
        for t in getattr(f.outer, "shared_tensors", f.outer.tensors)()
    ]
    return checksum(torch.cat(tensors)) if tensors else "-"


class ElasticReplica:
    """This process as one replica of an elastic job (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, *, group_rank: int = 0, group_size: int = 1) -> None:
        from lowcomm.elastic import replica_manager

        assert cfg.lighthouse is not None and cfg.replica_id is not None
        self.cfg = cfg
        self.replica_id = cfg.replica_id
        self.index = replica_index(cfg.replica_id)
        self.group_rank, self.group_size = group_rank, group_size
        self.stream = self.index * group_size + group_rank
        """This process's batch stream: its replica's number times the replica's processes plus
        its rank in the replica (torchft numbers a replica group's processes the same way)."""
        self.attempt = int(os.environ.get(ATTEMPT_ENV, "0") or 0)
        group: dict[str, Any] = {}
        if (
            group_size > 1
        ):  # a node group: its processes share the store torchrun/the launcher hosts
            group = {
                "group_rank": group_rank,
                "group_size": group_size,
                "store_addr": os.environ["MASTER_ADDR"],
                "store_port": int(os.environ["MASTER_PORT"]),
            }
        self.link: EmulatedLink | None = None
        """The emulated ``--link`` between the replicas, as this process sees it (a replica
        group's M processes each exchange with their counterparts: 1/M of its bandwidth each),
        for its syncs and its heals; ``None``: the real network."""
        if cfg.link is not None:
            self.link = node_link(EmulatedLink.parse(cfg.link), cfg)
        link = self.link
        self.replica = replica_manager(
            cfg.lighthouse,
            replica_id=cfg.replica_id,
            host=_host_for(cfg.lighthouse),
            min_replicas=cfg.min_replicas,
            timeout_s=cfg.collective_timeout,
            quorum_timeout_s=max(600.0, cfg.collective_timeout),
            link=link,
            dropped_residual=cfg.dropped_residual,
            heal=cfg.heal or "blocking",
            heal_inner=heal_inner_for(heal_of(cfg), cfg.heal_inner),
            **group,
        )
        self.steps_trained = 0
        """Inner steps this process computed (those before a heal included)."""
        self.first_step: int | None = None
        """The step it trained from: 1, or the step it was healed to."""
        self.heal_times: list[float] = []
        self.ready_at: float | None = None
        """When it drew its first batch: its start-up was over."""
        self._gen = torch.Generator()
        self._seen_syncs = 0
        self._seen_warm = 0
        self._committed = 0
        self._caught_up = 0

    def generator(self, step: int) -> torch.Generator:
        """This process's batch generator for ``step`` (:func:`replica_generator` of its
        :attr:`stream`)."""
        if self.ready_at is None:
            self.ready_at = time.time()
        return replica_generator(self.cfg.seed, self.stream, step, self._gen)

    def synced(self, algo: Any) -> dict[str, Any] | None:
        """After ``algo.step()``: a record of the sync it applied, if it applied one — whether
        it was committed, the syncs committed so far, the quorum's size and checksums of the
        anchor and the outer state, which every replica that committed the sync must hold bit
        for bit — else
        ``None``. A warm-start step committed: a ``warm_step`` record (its count, the
        quorum's size, the anchor's checksum: θ after the step)."""
        ft = algo.ft
        if ft.warm_steps != self._seen_warm:
            self._seen_warm = ft.warm_steps
            return {
                "kind": "warm_step",
                "time": time.time(),
                "step": algo.local_step,
                "warm_step": ft.warm_steps,
                "participants": ft.quorum_size,
                "anchor": checksum(torch.cat([v.reshape(-1) for v in algo.anchor_views])),
            }
        if algo.sync_points == self._seen_syncs:
            return None
        self._seen_syncs = algo.sync_points
        committed, self._committed = ft.step > self._committed, ft.step
        record = {
            "kind": "sync",
            "committed": committed,
            "time": time.time(),
            "step": algo.local_step,
            "sync": ft.step,
            "participants": ft.participants[-1] if ft.participants else None,
            "anchor": checksum(torch.cat([v.reshape(-1) for v in algo.anchor_views])),
            "outer_state": _outer_digest(algo),
            "failed_syncs": ft.failed_syncs,
        }
        elastic = algo.elastic_syncs
        if elastic.catching_up:
            # healed in the background, its donor's state not here yet: it took part in this
            # sync without contributing, and holds no anchor of its own
            record.update(catching_up=True, anchor=None, outer_state=None)
        elif len(elastic.caught_up_at) > self._caught_up:
            self._caught_up = len(elastic.caught_up_at)
            record["caught_up"] = True  # (the donor's state arrived: healed from here on)
        return record

    def follow(self, local_step: int, step: int) -> int:
        """After ``algo.step()`` of ``step``: the step the loop continues from (the donor's,
        right after this replica was healed)."""
        self.steps_trained += 1
        step = self.healed_to(local_step, step)
        if self.first_step is None:
            self.first_step = step
        return step

    def healed_to(self, step: int, was: int) -> int:
        """The step the loop stands at, ``step`` (the algorithm's count), noting a heal where
        it differs from the loop's (``was``): its counters are its donor's now."""
        if step != was:
            self.heal_times.append(time.time())
            logger.info(
                "replica %s healed: continues at step %d (was at %d)", self.replica_id, step, was
            )
        return step

    def arm(self, algo: Any, step: int, mode: str) -> None:
        """Arm an elastic fault of :data:`lowcomm.train.faults.FAULT_ENV` (tests and the chaos
        benchmark): ``sync`` — SIGKILL this process right after it joined the quorum of the
        first sync (or warm-start step) launched at or after ``step``; ``donor`` — the first
        time it sends its state to a healing replica (the first of the job's replicas to, by a
        token file beside the replicas' folders), send the length and SIGKILL itself before the
        state."""
        from lowcomm.train.faults import die_as_donor

        logger.warning("replica %s arms a fault: %s at step %d", self.replica_id, mode, step)
        if mode == "sync":
            ft = algo.ft
            quorum = ft.quorum

            def quorum_then_die(**kwargs: Any) -> bool:
                healed = quorum(**kwargs)
                if algo.local_step >= step:
                    os.kill(os.getpid(), signal.SIGKILL)
                return healed

            ft.quorum = quorum_then_die
            return
        assert self.cfg.out is not None
        token = os.path.join(os.path.dirname(os.path.abspath(self.cfg.out)), ".donor-fault")
        die_as_donor(self.replica.transport, token)

    def report(self, algo: Any) -> dict[str, Any]:
        """This replica's part of the job's ``summary.json``."""
        ft = algo.ft
        return {
            "replica_id": self.replica_id,
            "attempt": self.attempt,
            "steps_trained": self.steps_trained,
            "first_step": self.first_step,
            "syncs_committed": ft.step,
            "warm_steps_committed": ft.warm_steps,
            "failed_syncs": ft.failed_syncs,
            "heals": list(ft.heals),
            "heal_times": list(self.heal_times),
            "ready_at": self.ready_at,
            "participants": list(ft.participants),
            # how it is healed past the warm start, as given or chosen (heal_inner not given:
            # with the heal, lowcomm.train.elastic_config.heal_inner_for), as it runs
            "heal": heal_of(self.cfg),
            "heal_inner": self.replica.heal_inner,
            # what its heals carried (as a joiner and as a donor) and how long each one it
            # received took, from asking to loading (over the emulated link: what it takes)
            "heal_bytes_received": self.replica.transport.received_bytes,
            "heal_bytes_sent": self.replica.transport.sent_bytes,
            "heal_transfer_s": list(self.replica.transport.transfer_s),
        }

    def close(self) -> None:
        self.replica.shutdown()
