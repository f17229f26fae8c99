"""An outer algorithm's side of elastic syncs (``fault_tolerance=``): every sync is one torchft
Manager step — the quorum when the sync is launched, the commit vote when it is applied — and a
replica that (re)joins is healed from a live one at a quorum, with everything it needs to continue
as if it had never left.

**One sync, one Manager step.** At a sync's launch the replica asks for a quorum
(``start_quorum``: the replicas alive now; a replica behind the others is healed here, before
it returns), then all-reduces its pseudo-gradient over the quorum's members; at the sync's apply
it waits, then votes (``should_commit``). A sync whose collective failed on any member — a
replica died while it was in flight — is not committed by anyone who saw the failure: its round
is dropped (the anchor stays, θ goes back to it), exactly as a non-finite average is skipped. A
replica that committed while another did not is ahead at the next quorum, and the one behind is
healed from it, so every survivor's anchor is bit-identical again after the next quorum. Only
one sync may be in flight across a quorum (torchft's rule: a quorum rebuilds the process group),
so schedules that launch a sync before the last one applied (CO2 on the paper's schedule,
``overlap`` = H) are refused.

**The average** divides by the replicas that trained the round: a replica healed at this sync's
quorum sends zeros and counts 0 (one more 4-byte element all-reduced beside the buckets), so it
neither dilutes the average nor doubles its donor's contribution.

**Healing** sends, from a donor chosen by torchft (spread round-robin over the up-to-date
replicas), everything registered with the Manager: the algorithm's state (anchors, outer
optimizer, counters: ``local_step``, rounds), the inner optimizer's state (a new replica takes
its donor's), inside the warm start the model's parameters, and whatever the caller registers
beside them (:meth:`lowcomm.outer.fault_tolerance.ElasticSyncs.heal_state`). The healed replica
then stands where its donor stood — inside the step that launches the sync — and takes part in
that launch. Healed in the background (the default past the warm start), its quorum brings the
counters only and the tensors follow while every replica syncs on
(:data:`lowcomm.elastic.replica.HEALS`).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions

from lowcomm.buckets import FlatBuckets
from lowcomm.comm import (
    CommStats,
    Communicator,
    CompressedLauncher,
    DoneWork,
    Handle,
    all_gather_wire_bytes,
    ring_wire_bytes,
)
from lowcomm.compress.collectives import CompressedHandle
from lowcomm.link import EmulatedLink, LinkedWork

__all__ = ["FaultTolerance", "ManagedCommunicator"]

logger = logging.getLogger(__name__)


class FaultTolerance:
    """One replica's torchft Manager as the outer engine drives it (see the module docstring).

    Args:
        replica: a :class:`~lowcomm.elastic.replica.Replica` (``replica_manager()``), or a
            ``torchft.Manager`` built with ``use_async_quorum=False`` (a blocking quorum: a
            joiner must be healed before the sync it joins) and ``init_sync=False``.

    Attributes:
        joined: whether this replica took part in a quorum yet.
        contributing: whether this replica's pseudo-gradient counts in the sync being launched
            (False right after it was healed).
        heals: manager steps at which this replica was healed.
        failed_syncs: syncs this replica did not commit.
        participants: the quorum size of every sync this replica launched, in order.
    """

    def __init__(self, replica: Any) -> None:
        manager = getattr(replica, "manager", replica)
        for method in ("start_quorum", "should_commit", "allreduce", "register_state_dict_fn"):
            if not callable(getattr(manager, method, None)):
                raise ValueError(
                    "fault_tolerance must be a torchft Manager or lowcomm.elastic.Replica, got "
                    f"{type(replica).__name__}"
                )
        self.replica = replica
        self.manager = manager
        self.joined = False
        self.contributing = True
        self.heals: list[int] = []
        self.failed_syncs = 0
        self.participants: list[int] = []
        self.quorum_size = 0
        """The size of the last quorum this replica joined (a sync's or a warm step's)."""
        self.quorum_wait_s = 0.0
        """Seconds this replica's loop waited in its quorums (for the others to reach the sync,
        for a returning replica, or for its own heal): not in the communicator's blocked time."""
        self.warm_steps = 0
        """Warm-start steps committed (each a Manager step of its own: not counted in
        :attr:`step`); a healed replica takes its donor's count."""
        self.collective_s: list[float] = []
        """How long the collectives of the last committed syncs took (launch to done), those of
        quorums with new members left out (:meth:`record_collective`)."""
        self.new_members = False
        """Whether the last quorum may hold a replica that (re)joined (more replicas than the
        one before it, or as many but other ones): the collectives of that quorum wait for
        its heal."""
        self._rendezvous: int | None = None
        self._healed_now = False

    def collective_timeout(self) -> float | None:
        """The bound for the collective about to be launched: :data:`TIMEOUT_FACTOR` times the
        slowest of the last syncs' (at least :data:`MIN_TIMEOUT_S`), so that a peer that died
        in the middle of it — whose neighbours fail at once, but whose neighbours' neighbours
        would wait for data that never comes — costs seconds, not the whole collective timeout;
        ``None`` (the full timeout) before any sync completed, and in a quorum with new members
        (its collectives wait for a joiner's heal, which takes what the heal takes)."""
        if not self.collective_s or self.new_members:
            return None
        return max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * max(self.collective_s[-8:]))

    def record_collective(self, seconds: float) -> None:
        """A committed sync's collectives took ``seconds``: remembered for
        :meth:`collective_timeout`, unless its quorum had new members (the time then holds a
        joiner's heal, which would stretch the bound of the syncs after it: a survivor stuck in
        a collective a dead peer left would wait that much longer)."""
        if not self.new_members:
            self.collective_s = [*self.collective_s[-7:], seconds]

    def before_collective(self) -> None:
        """Bound the sync's collective about to be launched (:meth:`collective_timeout`)."""
        pg: Any = getattr(self.replica, "pg", None)
        bound = self.collective_timeout()
        if bound is not None and pg is not None and hasattr(pg, "set_collective_timeout"):
            pg.set_collective_timeout(datetime.timedelta(seconds=bound))

    def register(self, key: str, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """Heal ``key`` too: ``save()`` runs on the donor (in the Manager's quorum thread, while
        its own loop waits in the quorum), ``load(state)`` on the joiner before its quorum
        returns. What ``save`` returns is sent as ``torch.save`` bytes and loaded with
        ``weights_only=True``: tensors, numbers, strings and plain containers."""

        def loaded(state: Any) -> None:
            load(state)
            self._healed_now = True

        self.manager.register_state_dict_fn(key, loaded, save)

    @property
    def step(self) -> int:
        """Syncs committed: the Manager's step, less the one the job's start commits (see
        :meth:`join`; with a warm start, its first step's commit is that one) and the warm
        start's other steps."""
        return max(0, int(self.manager.current_step()) - 1 - max(0, self.warm_steps - 1))

    def quorum(self, *, warm: bool = False) -> bool:
        """Join this sync's quorum (``warm``: a warm-start step's, not listed in
        :attr:`participants`); returns whether this replica was healed in it (then it
        does not contribute to the sync it is launching). While it waits, it says so every
        :data:`WAIT_NOTE_S` seconds; a quorum that does not come within the Manager's quorum
        timeout (fewer replicas alive than a sync needs) raises, naming that. A heal whose
        transfer failed (its donor died half-way) loads nothing and asks for a new quorum,
        which heals it from another up-to-date replica (up to :data:`HEAL_TRIES` times)."""
        for tries in range(1, HEAL_TRIES + 1):
            transport = getattr(self.replica, "transport", None)
            received = getattr(transport, "receives", 0)
            healed = self._quorum_once()
            error = self.manager.errored()
            if error is None:
                break
            if healed:  # loaded, but the quorum failed after: what was loaded is not trusted
                raise RuntimeError(f"healing failed: {error}")
            if transport is None or transport.receives == received:
                break  # not a heal: the sync is voted down, and its round dropped, at commit
            if tries == HEAL_TRIES:
                raise RuntimeError(f"healing failed {tries} times, the last: {error}")
            logger.warning(
                "healing failed (%s): nothing was loaded; asking for a new quorum to heal from "
                "another replica",
                error,
            )
        self.contributing = not healed
        size = int(self.manager.num_participants())
        # the replicas' process group meets again whenever the quorum's members change: as many
        # replicas as before, but not the same ones, may hold a joiner too (one left, one came)
        seen = getattr(getattr(self.replica, "pg", None), "rendezvous", None)
        other = seen is not None and self._rendezvous is not None and seen != self._rendezvous
        self._rendezvous = seen
        self.new_members = self.quorum_size > 0 and (
            size > self.quorum_size or (other and size == self.quorum_size)
        )
        self.quorum_size = size
        if not warm:
            self.participants.append(self.quorum_size)
        if healed:
            self.heals.append(self.step)
            logger.info(
                "replica healed from a live peer at sync %d%s (%d replicas)",
                self.step,
                f" (warm step {self.warm_steps + 1})" if warm else "",
                self.quorum_size,
            )
        return healed

    def _quorum_once(self) -> bool:
        self._healed_now = False
        waiting = _Waiting(self.manager)
        try:
            self.manager.start_quorum()
        except Exception as e:
            raise RuntimeError(
                f"no quorum after {waiting.elapsed():.0f} s: fewer replicas are alive than a "
                f"sync needs (min_replicas {getattr(self.replica, 'min_replicas', '?')}), or "
                f"the Lighthouse is gone ({type(e).__name__}: {e})"
            ) from e
        finally:
            waiting.stop()
            self.quorum_wait_s += waiting.elapsed()
        self.joined = True
        return self._healed_now

    def join(self) -> bool:
        """The first quorum of this replica, at its first step: returns whether it was healed
        (it stands where its donor stood, at a sync's launch). When it was not (the job's start:
        every replica at sync 0), the quorum is committed at once, so that a replica joining
        later is behind and is healed."""
        healed = self.quorum()
        if not healed:
            self.participants.pop()  # not a sync
            self.commit()
        return healed

    def commit(self) -> bool:
        """Vote on the sync in flight (after its collective was waited for): whether every
        member may apply it."""
        ok = bool(self.manager.should_commit())
        if not ok:
            self.failed_syncs += 1
            error = self.manager.errored()
            logger.warning(
                "sync %d not committed (%s): its round is dropped on this replica, the anchor "
                "stays",
                self.step + 1,
                "a collective failed: a replica left while it was in flight"
                if error is not None
                else "too few replicas",
            )
        return ok

    def metrics(self) -> dict[str, Any]:
        return {
            "syncs_committed": self.step,
            "warm_steps_committed": self.warm_steps,
            "failed_syncs": self.failed_syncs,
            "heals": list(self.heals),
            "participants_last": self.participants[-1] if self.participants else None,
            "quorum_wait_s": self.quorum_wait_s,
        }


HEAL_TRIES = 3
"""How many quorums a replica behind the others tries to be healed in before it gives up (each
failed try: its donor died or stalled during the transfer)."""

WAIT_NOTE_S = 10.0
"""While a replica waits for a quorum longer than this, it logs that it is waiting (and again
every this many seconds)."""


class _Waiting:
    """Logs, on a timer thread, that this replica is still waiting for its quorum."""

    def __init__(self, manager: Any) -> None:
        self._t0 = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def _run(self) -> None:
        while not self._done.wait(WAIT_NOTE_S):
            logger.warning(
                "waiting %.0f s for a quorum: fewer replicas than a sync needs are alive, or the "
                "others are still computing their round",
                self.elapsed(),
            )

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


TIMEOUT_FACTOR = 5.0
"""A sync's collective may take this many times the slowest of the last ones before it is
given up (:meth:`FaultTolerance.collective_timeout`): a collective that slow has lost a member
(a heal in the background shares a donor's link with its syncs, which then take up to about
twice their time)."""
MIN_TIMEOUT_S = 10.0
"""…and at least this long."""


class ManagedHandle(Handle):
    """The all-reduce of one sync through the Manager: on :meth:`wait` the buckets are divided
    by the number of replicas that contributed (summed beside them). A failed collective does
    not raise: the Manager records it and the commit vote drops the sync."""

    # the Manager's works handle their errors in wait(): never waited at launch to be timed
    _device_timed = False

    def __init__(
        self,
        works: Sequence[Any],
        buffers: list[torch.Tensor],
        count: torch.Tensor,
        stats: CommStats,
        ft: FaultTolerance | None = None,
    ) -> None:
        super().__init__(works, buffers, 1, stats)
        self.count = count
        self.ft = ft
        self.t0 = time.monotonic()

    def wait(self) -> list[torch.Tensor]:
        if self._done:
            return self.buffers
        super().wait()  # divisor 1: the Manager's works never raise
        if self.ft is not None and self.ft.manager.errored() is None:
            self.ft.record_collective(time.monotonic() - self.t0)
        contributors = float(self.count[0])
        if contributors >= 1:
            torch._foreach_div_(self.buffers, contributors)
        return self.buffers


class QuorumWork:
    """A collective launched on the quorum's process group with torchft's error handling (as
    ``Manager.allreduce`` handles its own): a failure is reported to the Manager, whose commit
    vote then drops the sync, and never raised."""

    def __init__(self, work: Any, manager: Any) -> None:
        self.work = work
        self.manager = manager

    def wait(self, *args: Any) -> bool:
        try:
            self.work.wait(*args)
        except Exception as e:  # a replica left while it was in flight
            logger.debug("a collective of the quorum failed: %s", e)
            self.manager.report_error(e)
            return False
        return True

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


class _CompressedQuorum:
    """A compressed sync's view of its quorum (:class:`~lowcomm.compress.collectives.QuorumMean`):
    whether each replica contributes (1 or 0), all-gathered beside the payloads in their
    order."""

    def __init__(self, ft: FaultTolerance, flags: torch.Tensor, work: Any, world: int) -> None:
        self.ft = ft
        self.flags = flags
        self.work = work
        self.world = world
        self.t0 = time.monotonic()

    def failed(self) -> bool:
        self.work.wait()
        return self.ft.manager.errored() is not None

    def scale(self) -> float:
        self.ft.record_collective(time.monotonic() - self.t0)
        contributors = float(self.flags.sum())
        return self.world / contributors if 1 <= contributors < self.world else 1.0

    def senders(self) -> torch.Tensor:
        return self.flags


class ManagedCommunicator(Communicator):
    """The outer engine's communicator over a torchft Manager: the quorum's replicas instead of
    a fixed process group. The mean all-reduce of flat buckets goes through the Manager;
    compressed means (:meth:`compressed_mean_async`) all-gather their payloads, or all-reduce
    PowerSGD's factors, on the quorum's process group with torchft's error handling
    (:class:`QuorumWork`). The collectives of sharded outer state and gossip are refused before
    this is built.

    With ``link`` (an :class:`~lowcomm.link.EmulatedLink`), every collective of a sync
    completes no earlier than that link could have carried its ring all-reduce among the
    quorum's replicas (the fixed groups' model, :class:`~lowcomm.link.LinkModel`: first in,
    first out, latency per collective); the time counts as the sync's time in flight and,
    when waited for, as time blocked."""

    def __init__(
        self,
        ft: FaultTolerance,
        link: EmulatedLink | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.ft = ft
        self.group = None
        self.stats = CommStats()
        self.link = link
        self.model = link.shared_model() if link is not None else None
        self._clock = clock
        self._sleep = sleep

    @property
    def world_size(self) -> int:  # type: ignore[override]
        """The replicas of the current quorum (2 before the first one: an algorithm is built
        for a group, and a replica is never alone by construction)."""
        return self.ft.quorum_size or 2

    @property
    def rank(self) -> int:  # type: ignore[override]
        rank = self.ft.manager.participating_rank() if self.ft.joined else None
        return int(rank) if rank is not None else 0

    def all_reduce_mean_async(self, buffers: list[torch.Tensor]) -> Handle:
        manager = self.ft.manager
        if not self.ft.contributing:
            for b in buffers:
                b.zero_()
        # beside the buffers: a GPU process group (NCCL) takes no CPU tensor
        device = buffers[0].device if buffers else None
        count = torch.tensor([1.0 if self.ft.contributing else 0.0], device=device)
        payload = sum(b.numel() * b.element_size() for b in buffers)
        n = self.world_size
        self.stats.collectives += len(buffers)
        self.stats.payload_bytes += payload
        self.stats.wire_bytes += ring_wire_bytes(payload, n)
        self.ft.before_collective()
        works = [manager.allreduce(b, reduce_op=dist.ReduceOp.SUM) for b in buffers]
        works.append(manager.allreduce(count, reduce_op=dist.ReduceOp.SUM))
        # each through the emulated link, if there is one, in launch order
        works = [
            self._through_link(w, t.numel() * t.element_size(), True)
            for w, t in zip(works, [*buffers, count])
        ]
        return ManagedHandle(works, buffers, count, self.stats, self.ft)

    def compressed_mean_async(
        self, buckets: FlatBuckets, compressor: CompressedLauncher, *, own: Any = None
    ) -> Handle:
        """The compressed mean through the quorum: the payloads all-gathered (PowerSGD: its
        factors all-reduced) on the quorum's process group, and beside them the count of the
        replicas that contribute. A replica healed at this quorum encodes zeros (its residuals
        are 0 since its heal) and counts 0: the decoded sum over the quorum is rescaled to the
        mean over the contributors, and a sparse mean over the ranks that sent each element
        leaves its zeros out (each replica's flag is all-gathered, in the payloads' order). A
        failed collective decodes nothing; the vote drops the sync."""
        if not self.ft.contributing:
            for b in buckets.buffers:
                b.zero_()
        device = buckets.buffers[0].device if buckets.buffers else None
        flag = torch.tensor([1.0 if self.ft.contributing else 0.0], device=device)
        self.ft.before_collective()
        world = self.world_size
        flags = torch.zeros(world, device=device)
        flags_work = self._launch_all_gather(flags, flag)
        handle = super().compressed_mean_async(buckets, compressor, own=own)
        if isinstance(handle, CompressedHandle):
            handle.quorum = _CompressedQuorum(self.ft, flags, flags_work, world)
        return handle

    def _through_link(self, work: Any, nbytes: int, reduce: bool) -> Any:
        """``work`` delayed by the emulated link (a ring all-reduce or all-gather of ``nbytes``
        a replica among the quorum's), if there is one."""
        if self.model is None:
            return work
        n = self.world_size
        wire = ring_wire_bytes(nbytes, n) if reduce else all_gather_wire_bytes(nbytes, n)
        done_at = self.model.schedule(self._clock(), wire)
        return LinkedWork(work, done_at, clock=self._clock, sleep=self._sleep)

    def _quorum_work(self, launch: Callable[[Any], Any]) -> Any:
        """A collective on the quorum's process group, launched as ``Manager.allreduce``
        launches its own: nothing once the sync has failed, a failure reported, not raised."""
        manager = self.ft.manager
        if manager.errored() is not None:
            return DoneWork()  # voted down at the commit: nothing more goes out
        manager.wait_quorum()
        pg = getattr(self.ft.replica, "pg", None) or manager._pg
        try:
            return QuorumWork(launch(pg), manager)
        except Exception as e:
            manager.report_error(e)
            return DoneWork()

    def _launch(self, tensor: torch.Tensor) -> Any:
        """A SUM all-reduce through the quorum (PowerSGD's phases, L-GreCo's table)."""
        opts = AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        work = self._quorum_work(lambda pg: pg.allreduce([tensor], opts))
        return self._through_link(work, tensor.numel() * tensor.element_size(), True)

    def _launch_all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> Any:
        """An all-gather of a compressed payload through the quorum."""
        chunks = list(out.chunk(out.numel() // tensor.numel()))
        work = self._quorum_work(lambda pg: pg.allgather([chunks], [tensor], AllgatherOptions()))
        return self._through_link(work, tensor.numel() * tensor.element_size(), False)

    def _refused(self, what: str) -> Any:
        raise ValueError(f"fault_tolerance: {what} is not supported with fault tolerance yet")

    def _launch_reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor) -> Any:
        return self._refused("a reduce-scatter (sharded outer state)")

    def _launch_exchange(self, ops: list[Any], wire_bytes: int) -> list[Any]:
        return list(self._refused("a group exchange (gossip)"))
