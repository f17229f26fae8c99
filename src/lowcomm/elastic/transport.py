"""How a healing replica receives its donor's state: torchft's checkpoint transport interface,
carried over the replicas' own process group, loaded with ``torch.load(weights_only=True)``.

torchft's own transports unpickle what a peer sends (``PGTransport`` its metadata, with
``pickle.loads``) or listen on every network interface (``HTTPTransport``). This one sends the
bytes ``torch.save`` writes — one length, then one byte tensor — and the receiver loads them as
every other file lowcomm loads: tensors, numbers, strings and plain containers only
(:func:`lowcomm.runfiles.load_checkpoint`'s rule). It opens no listener and is synchronous:
the donor has sent everything when its ``start_quorum`` returns, so it may change its state
straight after.

Over an emulated link (``link``), a transfer of b bytes to each of k joiners takes what the
link takes, ``latency + 8·k·b / bandwidth`` from its start, on both ends: the donor returns and
the joiner loads no earlier. The link's model is the one the replica's syncs book on
(:meth:`lowcomm.link.EmulatedLink.shared_model`).

**In the background.** A part of the state wrapped in :class:`Background` does not travel in
the quorum: the donor writes it once (a snapshot of that instant), sends in its place where to
fetch it, and serves it from a thread on a socket bound to its own host (``host``), to the
joiners of that quorum only (each proves it was sent the address with a random token) and for
a bounded time. The joiner's quorum returns with a :class:`PendingState` there, which a thread
fills: the donor and the joiner go on with their syncs meanwhile, and over an emulated link the
state goes out in chunks of :data:`CHUNK_BYTES` that queue with the syncs' transfers on both
ends, as two flows share one link.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from lowcomm.link import wait_until

if TYPE_CHECKING:
    from lowcomm.link import LinkModel

__all__ = ["BYTES_TAG", "LENGTH_TAG", "Background", "PendingState", "TensorTransport"]

logger = logging.getLogger(__name__)

try:  # torchft is the optional extra lowcomm[ft]
    from torchft.checkpointing import CheckpointTransport
except ImportError:  # pragma: no cover - lowcomm.elastic refuses to start without it
    CheckpointTransport = object

LENGTH_TAG = 1
"""The tag of the message that announces a heal's size."""
BYTES_TAG = 2
"""The tag of the message that carries a heal's state."""
CHUNK_BYTES = 1 << 18
"""A background state's transfer goes out (and is paced on an emulated link) in chunks of this
many bytes: a sync's transfer waits behind at most one."""
BACKGROUND_KEY = "lowcomm_background"
"""In the state a donor sends in the quorum, the key of the dict that stands for a
:class:`Background` part (its token, host, port and size)."""


class Background:
    """A part of a heal's state that the donor sends after the quorum, in the background (see
    the module docstring): ``state`` is written when the donor's quorum sends the rest."""

    def __init__(self, state: Any) -> None:
        self.state = state


def _load(data: bytes, what: str) -> Any:
    """``torch.load(weights_only=True)`` of a heal's bytes, or a ``ValueError`` naming why not."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, KeyError) as e:
        raise ValueError(
            f"healing: {what} is not tensors, numbers and strings only, or is damaged "
            f"({type(e).__name__}); refused without loading it"
        ) from None


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = conn.recv(min(n - got, CHUNK_BYTES))
        if not part:
            raise ConnectionError(f"the donor closed the connection after {got} of {n} bytes")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


class _Server:
    """The donor's side of a background part: a listening socket on ``host`` that sends
    ``data`` to each of ``joiners`` connections proving ``token``, paced on ``link``; closed
    when all were served or at ``deadline``."""

    def __init__(
        self,
        host: str,
        data: bytes,
        token: str,
        joiners: int,
        link: LinkModel | None,
        deadline: float,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
    ) -> None:
        self.data, self.token, self.joiners = data, token, joiners
        self.link, self.deadline, self._clock, self._sleep = link, deadline, clock, sleep
        self.sock = socket.create_server((host, 0), backlog=max(1, joiners))
        self.port = int(self.sock.getsockname()[1])
        self.thread = threading.Thread(target=self._serve, daemon=True, name="lowcomm-heal-serve")
        self.thread.start()

    def _serve(self) -> None:
        served: list[threading.Thread] = []
        try:
            while len(served) < self.joiners:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    self.sock.settimeout(left)
                    conn, _ = self.sock.accept()
                except OSError:
                    break
                thread = threading.Thread(target=self._send, args=(conn,), daemon=True)
                thread.start()
                served.append(thread)
            for thread in served:
                thread.join(max(0.0, self.deadline - time.monotonic()))
        finally:
            self.sock.close()

    def _send(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(max(1.0, self.deadline - time.monotonic()))
            if _recv_exact(conn, len(self.token)).decode() != self.token:
                return
            for i in range(0, len(self.data), CHUNK_BYTES):
                chunk = self.data[i : i + CHUNK_BYTES]
                if self.link is not None:
                    wait_until(
                        self.link.schedule(self._clock(), len(chunk)), self._clock, self._sleep
                    )
                conn.sendall(chunk)


class PendingState:
    """The joiner's side of a :class:`Background` part: a thread fetches it from the donor
    (paced on the joiner's ``link`` too) and loads it with ``weights_only=True``. :meth:`done`
    says whether it has arrived (or failed); :meth:`result` waits for it and returns it, or
    raises why it could not be had."""

    def __init__(
        self, where: dict[str, Any], transport: TensorTransport, timeout: float, start: float
    ) -> None:
        self.nbytes = int(where["bytes"])
        self._where = where
        self._transport = transport
        self._timeout = timeout
        self._start = start
        self._state: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._fetch, daemon=True, name="lowcomm-heal-fetch").start()

    def _fetch(self) -> None:
        transport = self._transport
        clock, sleep = transport._clock, transport._sleep
        try:
            address = (str(self._where["host"]), int(self._where["port"]))
            with socket.create_connection(address, timeout=self._timeout) as conn:
                conn.settimeout(self._timeout)
                conn.sendall(str(self._where["token"]).encode())
                parts = []
                for i in range(0, self.nbytes, CHUNK_BYTES):
                    chunk = _recv_exact(conn, min(CHUNK_BYTES, self.nbytes - i))
                    if transport.link is not None:
                        done_at = transport.link.schedule(clock(), len(chunk))
                        wait_until(done_at, clock, sleep)
                    parts.append(chunk)
            self._state = _load(b"".join(parts), "the donor's background state")
            transport.received_bytes += self.nbytes
            transport.transfer_s.append(clock() - self._start)
        except (OSError, ValueError) as e:
            self._error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def failed(self) -> bool:
        """Whether it is over without the state (the donor died, or the time ran out)."""
        return self._done.is_set() and self._error is not None

    def error_to(self, manager: Any) -> None:
        """Report why it failed to a torchft Manager (its next vote is then no)."""
        logger.warning(
            "healing in the background failed (%s): healed again at the next quorum", self._error
        )
        manager.report_error(RuntimeError(f"the donor's state did not arrive: {self._error}"))

    def result(self) -> Any:
        """The state, once it has arrived (waits for it); raises ``RuntimeError`` if the
        transfer failed (the donor died, or it took longer than the timeout)."""
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(
                f"healing: the state sent in the background did not arrive: {self._error}"
            )
        return self._state


class TensorTransport(CheckpointTransport):
    """A ``torchft`` checkpoint transport over ``pg`` (the Manager's process group): the donor
    ``send``s its state as one ``torch.save`` byte tensor, the joiner ``recv``s and loads it
    with ``weights_only=True``.

    Args:
        pg: the torchft process group the Manager reconfigures at each quorum (healing runs
            on it after the reconfiguration, with the quorum's replica ranks).
        timeout: bound on one transfer.
        link: the emulated link the transfers go through (``None``: the real network).
        host: the address a donor serves :class:`Background` parts on (its replica's host).
    """

    def __init__(
        self,
        pg: Any,
        timeout: timedelta,
        link: LinkModel | None = None,
        *,
        host: str = "127.0.0.1",
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.pg = pg
        self._timeout = timeout
        self.link = link
        self.host = host
        self._clock = clock
        self._sleep = sleep
        self.receives = 0
        """Transfers this replica started to receive (a heal tried), whether or not they
        completed."""
        self.sent_bytes = 0
        """State bytes this replica sent as a donor (every joiner's copy counted)."""
        self.received_bytes = 0
        """State bytes this replica received and loaded as a joiner."""
        self._serving: _Server | None = None
        self.transfer_s: list[float] = []
        """How long each heal this replica received took, from asking to loading."""

    def _through_link(self, start: float, nbytes: int) -> None:
        """Wait until the emulated link could have carried ``nbytes`` started at ``start``."""
        if self.link is not None:
            wait_until(self.link.schedule(start, nbytes), self._clock, self._sleep)

    def metadata(self) -> str:
        return "lowcomm-tensor-transport"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        start = self._clock()
        state_dict, background = self._serve_background(state_dict, len(dst_ranks), timeout)
        data = torch.frombuffer(
            bytearray(_saved({"step": step, "state": state_dict})), dtype=torch.uint8
        )
        length = torch.tensor([data.numel()], dtype=torch.int64)
        works = []
        for dst in dst_ranks:
            works.append(self.pg.send([length], dst, tag=LENGTH_TAG))
            works.append(self.pg.send([data], dst, tag=BYTES_TAG))
        for work in works:
            work.wait(timeout)
        self.sent_bytes += len(dst_ranks) * (data.numel() + 8 + background)
        self._through_link(start, len(dst_ranks) * (data.numel() + 8))

    def _serve_background(self, state: Any, joiners: int, timeout: timedelta) -> tuple[Any, int]:
        """``state`` with each :class:`Background` part replaced by where to fetch it (each
        served from now on, :class:`_Server`); and their bytes."""
        total = 0

        def walk(value: Any) -> Any:
            nonlocal total
            if isinstance(value, Background):
                data = _saved(value.state)
                token = secrets.token_hex(16)
                bound = timeout.total_seconds()
                if self.link is not None:  # the link shared with the syncs: several times its
                    bound += 4 * joiners * 8 * len(data) / self.link.bandwidth_bps  # bare time
                server = self._serving = _Server(
                    self.host,
                    data,
                    token,
                    joiners,
                    self.link,
                    time.monotonic() + bound,
                    self._clock,
                    self._sleep,
                )
                total += len(data)
                return {
                    BACKGROUND_KEY: token,
                    "host": self.host,
                    "port": server.port,
                    "bytes": len(data),
                    "timeout_s": bound,
                }
            if isinstance(value, dict):
                return {k: walk(v) for k, v in value.items()}
            return value

        return walk(state), total

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        self.receives += 1
        start = self._clock()
        length = torch.zeros(1, dtype=torch.int64)
        self.pg.recv([length], src_rank, tag=LENGTH_TAG).wait(timeout)
        size = int(length.item())
        if not 0 < size < 1 << 40:
            raise ValueError(f"healing: the donor announced {size} bytes of state; refused")
        data = torch.empty(size, dtype=torch.uint8)
        self.pg.recv([data], src_rank, tag=BYTES_TAG).wait(timeout)
        self._through_link(start, size + 8)
        received = _load(data.numpy().tobytes(), "the donor's state")
        if not isinstance(received, dict) or received.get("step") != step:
            got = received.get("step") if isinstance(received, dict) else None
            raise ValueError(f"healing: the donor sent the state of step {got}, not of {step}")
        self.received_bytes += size + 8
        pending: list[PendingState] = []
        state = self._fetch_background(received["state"], start, pending)
        if not pending:  # (else the heal's time is counted when its last part has arrived)
            self.transfer_s.append(self._clock() - start)
        return state

    def _fetch_background(self, state: Any, start: float, pending: list[PendingState]) -> Any:
        """``state`` with each part the donor serves in the background replaced by a
        :class:`PendingState` fetching it (listed in ``pending``)."""
        if isinstance(state, dict) and BACKGROUND_KEY in state:
            where = {**state, "token": state[BACKGROUND_KEY]}
            pending.append(PendingState(where, self, float(state.get("timeout_s", 60.0)), start))
            return pending[-1]
        if isinstance(state, dict):
            return {k: self._fetch_background(v, start, pending) for k, v in state.items()}
        return state

    def disallow_checkpoint(self) -> None:
        pass  # what is served in the background is a snapshot: the donor may change its state

    def wait_served(self) -> None:
        """Until the joiners of this replica's last heal as a donor have fetched what it serves
        in the background (or its deadline passed): a donor that leaves the job first would
        leave them without a state."""
        if self._serving is not None:
            self._serving.thread.join(max(0.0, self._serving.deadline - time.monotonic()))

    def shutdown(self, wait: bool = True) -> None:
        pass
