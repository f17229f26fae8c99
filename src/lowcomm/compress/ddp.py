"""A DDP communication hook that compresses per-step gradients, with error feedback.

``ddp_hook(codec)`` returns ``(state, hook)`` for
``DistributedDataParallel.register_comm_hook(state, hook)``: every gradient bucket is averaged
with a compressed collective (:mod:`lowcomm.compress.collectives`: all-gather of the compressed
payloads for elementwise codecs, PowerSGD's two all-reduces) and an error-feedback residual per
bucket and tensor, so plain DDP also sends fewer bytes. Counted in ``state.stats``.

PowerSGD needs a second collective that depends on the first. Launching it from a completion
callback could order it differently on different ranks (gloo matches collectives by launch
order), so the hook launches it from the next bucket's hook call, which every rank makes in the
same order: bucket k's Q all-reduce goes out when bucket k + 1 is ready (waiting for bucket k's
P all-reduce then), and the last bucket's right away. Elementwise codecs need no such step: the
all-gather is decoded in its completion callback.

Example::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state, hook = lowcomm.compress.ddp_hook("powersgd:4")
    ddp.register_comm_hook(state, hook)
    loss.backward(); state.backward_done()       # optional: time blocked at the end of backward
    print(state.stats.as_dict())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm import CommStats, Communicator
from lowcomm.compress.codecs import parse_compression
from lowcomm.compress.collectives import CompressedHandle
from lowcomm.compress.feedback import Compressor
from lowcomm.compress.formats import Codec
from lowcomm.compress.lgreco import LGreCo
from lowcomm.counters import BlockedTimer
from lowcomm.device import device_future

__all__ = ["DDPCompressionState", "ddp_hook"]


class DDPCompressionState:
    """The hook's state: a :class:`~lowcomm.compress.feedback.Compressor` per DDP bucket index
    (replaced if DDP rebuilds its buckets with other shapes, as it does once after the first
    iteration), the communicator and its counters."""

    def __init__(
        self, compression: Codec | LGreCo, comm: Communicator, *, error_feedback: bool
    ) -> None:
        self.compression = compression
        self.comm = comm
        self.error_feedback = error_feedback
        self.compressors: dict[int, Compressor] = {}
        self._restore: dict[int, dict[str, Any]] = {}
        self._blocked = BlockedTimer()
        self._deferred: tuple[CompressedHandle, torch.futures.Future, torch.Tensor] | None = None

    @property
    def stats(self) -> CommStats:
        """Bytes (compressed) and collectives of the gradient averaging on this rank."""
        return self.comm.stats

    def compressor(self, index: int, grads: list[torch.Tensor]) -> Compressor:
        shapes = [g.shape for g in grads]
        comp = self.compressors.get(index)
        if comp is None or comp.shapes != shapes:
            comp = Compressor(
                self.compression,
                shapes,
                rank=self.comm.rank,
                device=grads[0].device,
                error_feedback=self.error_feedback,
                stream=index,
            )
            saved = self._restore.pop(index, None)
            if saved is not None and len(saved["residuals"]) == len(shapes):
                comp.load_state_dict(saved)
            self.compressors[index] = comp
        return comp

    def backward_done(self) -> None:
        """Record the time blocked at the end of this step's backward (call right after
        ``backward()`` returns): from the last bucket's launch until then, as
        :class:`~lowcomm.comm.DDPCommMeter` measures it (on a GPU by events read later:
        nothing waits here)."""
        self._blocked.backward_done(self.stats)

    def settle(self) -> None:
        """Count the blocked time still measured on the device (before reading ``stats``)."""
        self._blocked.settle(self.stats)

    def state_dict(self) -> dict[str, Any]:
        """Every bucket's compressor state (residuals, warm starts), by bucket index."""
        return {str(i): c.state_dict() for i, c in self.compressors.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output: each bucket's compressor is restored when DDP
        first hands the hook that bucket (with the same shapes)."""
        self.compressors = {}
        self._restore = {int(i): s for i, s in state.items()}


def _deliver(handle: CompressedHandle, fut: torch.futures.Future, buffer: torch.Tensor) -> None:
    """Complete ``fut`` with the averaged bucket once ``handle``'s last phase is done."""

    def done(_: torch.futures.Future) -> None:
        try:
            handle.finish_completed()
            fut.set_result(buffer)
        except Exception as e:  # surface it to DDP instead of losing it in a callback
            fut.set_exception(e)

    handle.last_phase_future().add_done_callback(done)


# No annotations: DDP's register_comm_hook compares them with the real types.
def _hook(state, bucket):
    grads = bucket.gradients()  # views into bucket.buffer(), in order
    comp = state.compressor(bucket.index(), grads)
    buffer = bucket.buffer()
    flat = [buffer] if buffer.numel() == sum(g.numel() for g in grads) else None
    handle = comp.launch(state.comm, grads, [list(range(len(grads)))], flat=flat)
    # on a GPU the future holds a CUDA bucket: it must be made for its device
    fut = device_future(buffer)
    if state._deferred is not None:
        prev, prev_fut, prev_buffer = state._deferred
        state._deferred = None
        prev.advance()
        _deliver(prev, prev_fut, prev_buffer)
    if handle.needs_advance and not bucket.is_last():
        state._deferred = (handle, fut, buffer)
    else:
        handle.advance()
        _deliver(handle, fut, buffer)
    state._blocked.launched(buffer.device)  # waiting in advance() is already counted
    return fut


def ddp_hook(
    compression: Codec | LGreCo | str,
    process_group: dist.ProcessGroup | Communicator | None = None,
    *,
    error_feedback: bool = True,
) -> tuple[DDPCompressionState, Callable[..., torch.futures.Future]]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``: compressed gradient
    averaging with error feedback.

    Args:
        compression: a codec, an L-GreCo setting or a spec string (``"int8"``, ``"topk:0.01"``,
            ``"powersgd:4"``, ``"lgreco:powersgd"``; L-GreCo re-chooses every K steps).
        process_group: the DDP model's process group (``None``: WORLD), or a
            :class:`~lowcomm.comm.Communicator` such as an emulated link's.
        error_feedback: keep a residual per bucket and tensor (default).
    """
    setting = parse_compression(compression)
    if setting is None:
        raise ValueError(
            "ddp_hook needs a codec, e.g. ddp_hook('int8'); without compression use DDP's "
            "default hook"
        )
    comm = process_group if isinstance(process_group, Communicator) else Communicator(process_group)
    return DDPCompressionState(setting, comm, error_feedback=bool(error_feedback)), _hook
