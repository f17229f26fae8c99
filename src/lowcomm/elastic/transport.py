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
the joiner loads no earlier. (The heal has its own link model: it runs inside a quorum, when
the replica's syncs before it are complete.)
"""

from __future__ import annotations

import io
import pickle
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from lowcomm.link import wait_until

if TYPE_CHECKING:
    from lowcomm.link import LinkModel

__all__ = ["BYTES_TAG", "LENGTH_TAG", "TensorTransport"]

try:  # torchft is the optional extra lowcomm[ft]
    from torchft.checkpointing import CheckpointTransport
except ImportError:  # pragma: no cover - lowcomm.elastic refuses to start without it
    CheckpointTransport = object

LENGTH_TAG = 1
"""The tag of the message that announces a heal's size."""
BYTES_TAG = 2
"""The tag of the message that carries a heal's state."""


class TensorTransport(CheckpointTransport):
    """A ``torchft`` checkpoint transport over ``pg`` (the Manager's process group): the donor
    ``send``s its state as one ``torch.save`` byte tensor, the joiner ``recv``s and loads it
    with ``weights_only=True``.

    Args:
        pg: the torchft process group the Manager reconfigures at each quorum (healing runs
            on it after the reconfiguration, with the quorum's replica ranks).
        timeout: bound on one transfer.
        link: the emulated link the transfers go through (``None``: the real network).
    """

    def __init__(
        self,
        pg: Any,
        timeout: timedelta,
        link: LinkModel | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.pg = pg
        self._timeout = timeout
        self.link = link
        self._clock = clock
        self._sleep = sleep
        self.receives = 0
        """Transfers this replica started to receive (a heal tried), whether or not they
        completed."""
        self.sent_bytes = 0
        """State bytes this replica sent as a donor (every joiner's copy counted)."""
        self.received_bytes = 0
        """State bytes this replica received and loaded as a joiner."""
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
        buf = io.BytesIO()
        torch.save({"step": step, "state": state_dict}, buf)
        data = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
        works = []
        for dst in dst_ranks:
            works.append(self.pg.send([length], dst, tag=LENGTH_TAG))
            works.append(self.pg.send([data], dst, tag=BYTES_TAG))
        for work in works:
            work.wait(timeout)
        self.sent_bytes += len(dst_ranks) * (data.numel() + 8)
        self._through_link(start, len(dst_ranks) * (data.numel() + 8))

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
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                received = torch.load(
                    io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=True
                )
        except (pickle.UnpicklingError, RuntimeError, EOFError, KeyError) as e:
            raise ValueError(
                "healing: the donor's state is not tensors, numbers and strings only, or is "
                f"damaged ({type(e).__name__}); refused without loading it"
            ) from None
        if not isinstance(received, dict) or received.get("step") != step:
            got = received.get("step") if isinstance(received, dict) else None
            raise ValueError(f"healing: the donor sent the state of step {got}, not of {step}")
        self.received_bytes += size + 8
        self.transfer_s.append(self._clock() - start)
        return received["state"]

    def disallow_checkpoint(self) -> None:
        pass  # synchronous: nothing is left to serve

    def shutdown(self, wait: bool = True) -> None:
        pass
