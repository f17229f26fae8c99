"""The torchft parts a lowcomm replica runs on: a Lighthouse (membership: which replicas are alive
and form the quorum of each sync) and, in every replica, a ``torchft.Manager`` (quorum, commit
vote, healing), set up so that nothing listens beyond the address it is given.

torchft binds several servers to every network interface by default: its Lighthouse as the tests
and command line start it, the Manager's gRPC server (its address is not a parameter:
``[::]:port``), the HTTP checkpoint transport and ``TCPStore(is_master=True)``. Here the
Lighthouse binds the host it is given (127.0.0.1 unless asked otherwise), the replica's store
and the Manager's server bind the replica's host, and healing goes over the replicas' own process
group (:class:`~lowcomm.elastic.transport.TensorTransport`), with no listener of its own.

Example (one machine; every process its own replica)::

    from lowcomm.elastic import Lighthouse, replica_manager

    lighthouse = Lighthouse(min_replicas=1)          # in one process: 127.0.0.1, a free port
    manager = replica_manager(lighthouse.address, replica_id="replica_0")   # in each replica
    algo = lowcomm.DiLoCo(model, inner, sync_every=12, fault_tolerance=manager)
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lowcomm.comm import host_store

if TYPE_CHECKING:
    from lowcomm.link import EmulatedLink

__all__ = ["Lighthouse", "Replica", "replica_manager", "require_torchft"]

logger = logging.getLogger(__name__)

TORCHFT_VERSION = "0.2.0"
"""The torchft release lowcomm's elasticity is tested with (the ``lowcomm[ft]`` extra)."""


TORCHFT_SERIES = "0.2."
"""The torchft releases accepted: those of the tested one's series. Another is refused before
anything runs: 0.3 removed ``ProcessGroup.configure``, which the replicas' process groups are
rebuilt with at every quorum, and by its release notes processes of 0.2 and 0.3 mixed in one
job retry forever."""


def require_torchft(version: str | None = None) -> Any:
    """The ``torchft`` module, or a ``ValueError`` saying how to install it, or naming the
    installed release and the tested one where it is not of the tested series (``version``:
    the installed release, read from the package's metadata by default)."""
    # torchft's Rust side logs every quorum at INFO to stderr unless told otherwise
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError:
        raise ValueError(
            "fault tolerance needs torchft: pip install 'lowcomm[ft]' (torchft "
            f"{TORCHFT_VERSION}, Linux)"
        ) from None
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        try:
            version = installed("torchft")
        except PackageNotFoundError:
            version = str(getattr(torchft, "__version__", "unknown"))
    if not version.startswith(TORCHFT_SERIES):
        raise ValueError(
            f"fault tolerance is tested with torchft {TORCHFT_VERSION}, and torchft {version} "
            f"is installed; pip install 'torchft=={TORCHFT_VERSION}' (or 'lowcomm[ft]')"
        )
    return torchft


def _seconds(value: float, what: str) -> datetime.timedelta:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{what} must be a number of seconds > 0, got {value!r}")
    return datetime.timedelta(seconds=float(value))


class Lighthouse:
    """torchft's Lighthouse: every replica's Manager heartbeats to it and asks it for the quorum
    of each sync (the replicas alive; a new one each time membership changes).

    Args:
        host: the address to listen on (``127.0.0.1``: this machine only; give a reachable
            address for replicas on several machines).
        port: 0 for a free one.
        min_replicas: a quorum needs at least this many replicas (below it, the replicas wait).
        join_timeout_s: how long a quorum waits for replicas that heartbeat but have not asked.
        heartbeat_timeout_s: a replica silent for longer is dead (the survivors' next quorum
            leaves it out after about this long).

    ``address`` is what replicas pass to :func:`replica_manager`. A context manager; ``close()``
    stops it.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        min_replicas: int = 1,
        join_timeout_s: float = 0.1,
        heartbeat_timeout_s: float = 5.0,
        quorum_tick_s: float = 0.05,
    ) -> None:
        require_torchft()
        from torchft._torchft import LighthouseServer

        if not isinstance(min_replicas, int) or isinstance(min_replicas, bool) or min_replicas < 1:
            raise ValueError(f"min_replicas must be an integer >= 1, got {min_replicas!r}")
        self.host = host
        self.min_replicas = min_replicas
        ms = {
            f"{key}_ms": int(_seconds(value, f"{key}_s").total_seconds() * 1e3)
            for key, value in (
                ("join_timeout", join_timeout_s),
                ("heartbeat_timeout", heartbeat_timeout_s),
                ("quorum_tick", quorum_tick_s),
            )
        }
        try:
            self._server: Any = LighthouseServer(
                bind=f"{host}:{port}", min_replicas=min_replicas, **ms
            )
        except Exception as e:
            raise ValueError(f"cannot start a Lighthouse on {host}:{port}: {e}") from None
        # address() names the machine's host name; the replicas need the address it listens on
        self.port = int(str(self._server.address()).rsplit(":", 1)[1].strip("/"))
        self.address = f"http://{host}:{self.port}"
        logger.debug("lighthouse listening on %s", self.address)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


@contextlib.contextmanager
def _manager_server_on(host: str) -> Iterator[None]:
    """While a ``torchft.Manager`` is built: its gRPC server listens on ``host`` instead of
    every interface (torchft hard-codes ``[::]:port``) and advertises ``host``."""
    import torchft.manager as manager_module

    original = manager_module.ManagerServer

    def bound(**kwargs: Any) -> Any:
        port = str(kwargs.get("bind", ":0")).rsplit(":", 1)[1]
        kwargs["bind"] = f"{host}:{port}"
        kwargs["hostname"] = host
        return original(**kwargs)

    manager_module.ManagerServer = bound
    try:
        yield
    finally:
        manager_module.ManagerServer = original


def _replica_gloo(
    collective_timeout: datetime.timedelta, rendezvous_timeout: datetime.timedelta
) -> Any:
    """torchft's reconfigurable gloo process group whose rendezvous at each new quorum (the
    store waits and the connections) is bounded by ``rendezvous_timeout`` — a member that died
    between the quorum and the rendezvous costs the others that long, not a collective
    timeout — while its collectives are bounded by ``collective_timeout`` (adjustable per sync:
    :meth:`set_collective_timeout`)."""
    import torch
    from torchft import ProcessGroupGloo

    class ReplicaGloo(ProcessGroupGloo):
        def __init__(self) -> None:
            super().__init__(timeout=rendezvous_timeout)
            self.collective_timeout = collective_timeout
            self._backend: Any = None
            self.rendezvous = 0
            """Rendezvous so far: one for every quorum whose members changed."""

        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            pg = super()._create_pg(store, rank, world_size)  # connected within the rendezvous
            self.rendezvous += 1
            self._backend = pg._get_backend(torch.device("cpu"))
            self._backend._set_default_timeout(self.collective_timeout)
            return pg

        def set_collective_timeout(self, timeout: datetime.timedelta) -> None:
            """Bound the collectives launched from now on (until the next rendezvous)."""
            if self._backend is not None:
                self._backend._set_default_timeout(min(timeout, self.collective_timeout))

    return ReplicaGloo()


class Replica:
    """A replica's torchft ``Manager`` with the store it serves (which must live as long as the
    Manager); what :func:`replica_manager` returns and ``fault_tolerance=`` takes."""

    def __init__(
        self,
        manager: Any,
        store: Any,
        replica_id: str,
        min_replicas: int,
        transport: Any = None,
        pg: Any = None,
        dropped_residual: str = "keep",
        heal: str = "blocking",
        group_size: int = 1,
        heal_inner: str = "bf16",
    ) -> None:
        self.manager = manager
        self.group_size = group_size
        """The processes of this replica (a node group: several)."""
        self.pg = pg
        """The replicas' process group (``set_collective_timeout``)."""
        self.transport = transport
        """The :class:`~lowcomm.elastic.transport.TensorTransport` heals travel over."""
        self.store = store
        self.replica_id = replica_id
        self.min_replicas = min_replicas
        self.dropped_residual = check_dropped_residual(dropped_residual)
        """With compressed syncs: what a replica's error-feedback residual keeps when its sync
        is dropped (:data:`DROPPED_RESIDUAL`)."""
        self.heal = check_heal(heal)
        """How this replica receives a heal past the warm start (:data:`HEALS`)."""
        self.heal_inner = check_heal_inner(heal_inner)
        """What of its donor's inner optimizer state a heal past the warm start brings this
        replica (:data:`HEAL_INNER`)."""

    def shutdown(self) -> None:
        """Stop the Manager (its heartbeats end: the others' next quorum leaves this replica
        out) and its store — once the joiners it serves a state to in the background have it."""
        if self.transport is not None and hasattr(self.transport, "wait_served"):
            self.transport.wait_served()
        self.manager.shutdown(wait=False)
        self.store = None


def replica_manager(
    lighthouse: str,
    *,
    replica_id: str,
    host: str = "127.0.0.1",
    min_replicas: int = 1,
    timeout_s: float = 60.0,
    quorum_timeout_s: float = 600.0,
    connect_timeout_s: float = 30.0,
    rendezvous_timeout_s: float = 10.0,
    group_rank: int = 0,
    group_size: int = 1,
    store_addr: str | None = None,
    store_port: int | None = None,
    link: EmulatedLink | None = None,
    dropped_residual: str = "keep",
    heal: str = "blocking",
    heal_inner: str = "bf16",
) -> Replica:
    """A ``torchft.Manager`` for this process as (part of) one replica, as lowcomm's outer
    algorithms drive it (``fault_tolerance=``): a blocking quorum at each sync, the commit vote
    at its apply, healing over the replicas' process group.

    A replica is one process (the default), or a replica group of ``group_size`` processes
    that train it together (DDP among themselves): each calls this with its ``group_rank`` and
    the address of a store they share (``store_addr``/``store_port``: torchrun's, under
    ``torchrun``), group rank 0 talks to the Lighthouse for all of them, and group rank j
    exchanges pseudo-gradients and heals with group rank j of the other replicas.

    Args:
        lighthouse: the Lighthouse's address (:attr:`Lighthouse.address`).
        replica_id: this replica's name, the same when it is restarted (``replica_3``).
        host: the address this replica's servers listen on and advertise.
        min_replicas: a sync commits only with at least this many replicas in it.
        timeout_s: bound on a collective and on a heal's transfer.
        quorum_timeout_s: bound on waiting for a quorum (covers a round of compute and a
            joiner's wait for the next sync).
        connect_timeout_s: bound on reaching the Lighthouse.
        rendezvous_timeout_s: bound on the replicas' rendezvous after each new quorum (a
            replica that died since it asked for the quorum costs the others this long).
        group_rank: this process's rank in its replica group.
        group_size: the processes of the replica group (1: a replica of its own, which hosts
            its own store on ``host``).
        store_addr: with ``group_size`` > 1, the host of the group's shared store.
        store_port: …and its port.
        link: an emulated link between the replicas: a heal's transfer takes what it would
            take there (:class:`~lowcomm.elastic.transport.TensorTransport`). The syncs go
            through it when the outer algorithm is given it too (``process_group=link``).
        dropped_residual: with compressed syncs, what this replica's error-feedback residual
            keeps when a sync is dropped: ``keep`` (what the encoding of the dropped round left
            over stays) or ``reset`` (0); see :data:`DROPPED_RESIDUAL`.
        heal: how a heal past the warm start reaches this replica: ``blocking`` (the default:
            everything inside the quorum, which waits for it) or ``background`` (the quorum
            carries the counters, the tensors follow while the replicas sync on; the joiner
            catches up with the syncs it took part in meanwhile); see :data:`HEALS`.
        heal_inner: what of the donor's inner optimizer state a heal past the warm start
            brings: ``bf16`` (its moments in bf16, the default) or ``none`` (the joiner's inner
            optimizer starts afresh; a smaller heal); see :data:`HEAL_INNER`.

    Returns the :class:`Replica` (``.manager``; ``.shutdown()`` stops it).
    """
    require_torchft()
    from torchft import Manager

    check_dropped_residual(dropped_residual)
    check_heal(heal)
    check_heal_inner(heal_inner)

    from lowcomm.elastic.transport import TensorTransport

    if not replica_id or not isinstance(replica_id, str):
        raise ValueError(f"replica_id must be a non-empty string, got {replica_id!r}")
    timeout = _seconds(timeout_s, "timeout_s")
    quorum_timeout = _seconds(quorum_timeout_s, "quorum_timeout_s")
    connect_timeout = _seconds(connect_timeout_s, "connect_timeout_s")
    # gloo's own sockets: the loopback interface when the replica stays on this machine
    if host.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if not isinstance(group_size, int) or group_size < 1 or not 0 <= group_rank < group_size:
        raise ValueError(
            f"group_rank {group_rank!r} must be in [0, group_size {group_size!r}), group_size >= 1"
        )
    store: Any = None
    if group_size == 1:
        store = host_store(host, 0, timeout=connect_timeout)
        store_addr, store_port = host, int(store.port)
    elif store_addr is None or store_port is None:
        raise ValueError(
            "a replica group of several processes needs the address of the store they share "
            "(store_addr, store_port; torchrun's MASTER_ADDR and MASTER_PORT)"
        )
    pg = _replica_gloo(timeout, _seconds(rendezvous_timeout_s, "rendezvous_timeout_s"))
    transport = TensorTransport(
        pg, timeout, link.shared_model() if link is not None else None, host=host
    )
    try:
        with _manager_server_on(host):
            manager = Manager(
                pg=pg,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=min_replicas,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=quorum_timeout,
                connect_timeout=connect_timeout,
                rank=group_rank,
                world_size=group_size,
                store_addr=store_addr,
                store_port=int(store_port),
                lighthouse_addr=lighthouse,
                replica_id=replica_id,
                hostname=host,
                checkpoint_transport=transport,
                init_sync=False,
            )
    except Exception as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(
            f"replica {replica_id}: cannot reach the Lighthouse at {lighthouse} within "
            f"{connect_timeout_s:g} s ({why}); start it first or check the address"
        ) from None
    return Replica(
        manager,
        store,
        replica_id,
        min_replicas,
        transport,
        pg,
        dropped_residual=dropped_residual,
        heal=heal,
        group_size=group_size,
        heal_inner=heal_inner,
    )


DROPPED_RESIDUAL = ("keep", "reset")
"""What a replica's error-feedback residual keeps when its compressed sync is dropped (a replica
left while it was in flight; θ goes back to the anchor): ``keep``, the default — the residual
stays what the dropped round's encoding left, the error of earlier rounds not yet sent
included, so that mass is not lost; ``reset`` — 0, the dropped round and everything not yet
sent forgotten."""


def check_dropped_residual(value: Any) -> str:
    if value not in DROPPED_RESIDUAL:
        raise ValueError(
            f"dropped_residual must be one of {', '.join(DROPPED_RESIDUAL)}, got {value!r}"
        )
    return str(value)


HEALS = ("blocking", "background")
"""How a replica that joins past the warm start is healed
(:meth:`lowcomm.outer.fault_tolerance.ElasticSyncs.heal_state`): ``blocking`` — the default:
everything in the quorum, which every member of the next sync waits for; ``background`` — its
quorum carries the donor's counters only; the anchor, the outer state and the inner
optimizer's moments follow on a connection of their own while every replica, the joiner too,
goes on syncing; the joiner takes part in those syncs without contributing, keeps their
averages, and once the donor's tensors have arrived applies the outer steps it missed to them,
bit for bit as the others did (the survivors never wait for the transfer). Until then the joiner
holds no state while torchft counts it up to date: if every replica that holds the state dies
meanwhile, the job's progress is lost — for faults rarer than a heal's transfer. Inside the
warm start (every replica holds one θ), for a replica of several processes (their transfers
would arrive at different syncs, while DDP inside the replica needs one θ on all of them) and
for LocalSGD (no outer state: its anchor is the average itself) a heal blocks either way."""


def check_heal(value: Any) -> str:
    if value not in HEALS:
        raise ValueError(f"heal must be one of {', '.join(HEALS)}, got {value!r}")
    return str(value)


HEAL_INNER = ("bf16", "none")
"""What of its donor's inner optimizer state a replica healed past the warm start receives
(:meth:`lowcomm.outer.fault_tolerance.ElasticSyncs.heal_state`). Past the warm start a replica's
inner moments are its own (its own gradients made them); the joiner has none. ``bf16`` — the
default: the donor's, in bf16 (a third of the heal of the default job: the anchor and the outer
momentum are the rest, in fp32, as every replica must hold them alike); ``none`` — none: the
joiner's inner optimizer starts afresh, as at the job's start (its state cleared, AdamW's step
count with it, so its first steps are bias-corrected), and the heal carries the anchor and the
outer state alone. Inside the warm start, where every replica holds one θ and one optimizer
state, the joiner takes its donor's exactly either way."""


def check_heal_inner(value: Any) -> str:
    if value not in HEAL_INNER:
        raise ValueError(f"heal_inner must be one of {', '.join(HEAL_INNER)}, got {value!r}")
    return str(value)
