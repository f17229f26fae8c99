"""Device-side helpers: where collectives' tensors live, side streams, pinned staging, clocks.

Everything here is a no-op (or the plain CPU operation) when the tensors are on the CPU, so the
CPU path stays bit for bit what it was; the CUDA behaviour is what each docstring says.

* :func:`collective_device`: the device a process group's control tensors go on (NCCL takes
  CUDA tensors only; gloo takes CPU tensors, and CUDA ones through pinned host memory);
  :func:`completes_on_device`: whether its collectives on CUDA tensors complete on the device
  (NCCL) or on the host (gloo).
* :func:`canonical_device`, :func:`same_device`: devices compared by type and index (a bare
  ``cuda`` is the current CUDA device, as the tensors made on it report).
* :class:`CommStream`: an outer algorithm's own CUDA stream. A sync's send buffer is filled and
  its collective launched on it, so that the encoding (and whatever the collective waits for)
  overlaps the next inner steps; the compute stream waits for it only where it must.
* :func:`host_wait`: block the host until collectives are complete on the device, without
  waiting for the compute queued on the current stream; :class:`CollectiveTimer`: their time
  in flight on the device (an NCCL handle's future completes when it is queued).
* :func:`to_device`, :func:`pinned_like`, :class:`HostStaging`: host↔device copies that do not
  stall the stream (pinned memory, ``non_blocking=True``), and the rules that keep a buffer in
  flight from being rewritten.
* :func:`device_clock`, :func:`synchronize`: wall times of device work (kernels are
  asynchronous: a host clock alone times their launch, not their run).
* :func:`device_future`: a ``torch.futures.Future`` that may hold CUDA tensors.
* :func:`peak_memory_allocated`: the device memory high-water mark of a process.

Example::

    comm_stream = CommStream(device)
    with comm_stream.launch(writes=send.buffers) as launch:
        pseudo_gradient_(send.views, anchor.views, params)   # on the side stream
        launch.inputs_read()           # the compute stream may overwrite θ from here on
        handle = comm.all_reduce_mean_async(send.buffers)   # launched under the side stream
    ...                                # inner steps on the compute stream
    comm_stream.apply(launch)          # the compute stream waits for what the launch queued
    handle.wait()                      # (before the wait, which may decode on it)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveTimer",
    "CommStream",
    "HostStaging",
    "Launch",
    "canonical_device",
    "collective_device",
    "completes_on_device",
    "device_clock",
    "device_future",
    "host_wait",
    "peak_memory_allocated",
    "pinned_like",
    "same_device",
    "synchronize",
    "to_device",
]

_CPU = torch.device("cpu")


def _is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: a bare ``cuda`` is the current CUDA device
    (``cuda:{torch.cuda.current_device()}``), which is what the tensors made on it report;
    any other device as it is."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether ``a`` and ``b`` are the same device, by type and index (:func:`canonical_device`):
    ``cuda`` and ``cuda:0`` are where the current device is 0, though their objects differ."""
    return canonical_device(a) == canonical_device(b)


def _group_backend(group: Any) -> str | None:
    """The backend string of ``group`` (a process group, ``None`` for WORLD, or anything with
    a ``group`` attribute holding one), lower case; ``None`` without a process group."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        group = getattr(group, "group", None)
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):
        return None


def _cuda_backend(backend: str) -> str:
    """The backend that runs a group's collectives on CUDA tensors: ``nccl`` for ``nccl`` and
    ``cpu:gloo,cuda:nccl``, ``gloo`` for ``gloo``."""
    if ":" not in backend:
        return backend
    for part in backend.split(","):
        kind, _, name = part.partition(":")
        if kind.strip() == "cuda":
            return name.strip()
    return ""


def completes_on_device(group: Any = None) -> bool:
    """Whether collectives on CUDA tensors over ``group`` (``None``: WORLD) complete on the
    device, asynchronously to the host: NCCL's, whose handle's ``wait()`` only makes the
    current stream wait. Not gloo's: gloo copies CUDA tensors to pinned host memory, runs the
    collective on its own threads and copies the result back, and its ``wait()`` blocks the
    host until that is done (its future completes when the collective has). ``False`` without
    a process group."""
    backend = _group_backend(group)
    return backend is not None and _cuda_backend(backend) == "nccl"


def collective_device(group: Any = None) -> torch.device:
    """The device for the small control tensors of collectives on ``group`` (counts, step
    times, scores, digests): the current CUDA device when its backend is NCCL alone (NCCL
    refuses CPU tensors), else the CPU.

    ``group`` is a process group (``None``: WORLD) or anything with a ``group`` attribute
    holding one (a :class:`~lowcomm.comm.Communicator`). Without an initialised process group
    the answer is the CPU. On gloo it is the CPU even when the job's tensors live on a GPU
    (workers sharing GPUs over gloo): the host reads every control tensor right after its
    collective, and gloo runs CPU tensors directly, while a CUDA tensor costs it a copy to
    pinned host memory and one back. The buckets, payloads and gradients themselves go to
    gloo on their own device.
    """
    backend = _group_backend(group)
    if backend is None:
        return _CPU
    # a group with a CPU backend too ("cpu:gloo,cuda:nccl") takes CPU tensors as before
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU


def synchronize(device: torch.device | str | None) -> None:
    """Wait until every kernel queued on ``device`` has run (a CUDA device; nothing on the
    CPU). ``None``: the current CUDA device, if CUDA is in use in this process."""
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif _is_cuda(device):
        torch.cuda.synchronize(torch.device(device))


def device_clock(device: torch.device | str | None = None) -> Callable[[], float]:
    """A ``perf_counter`` clock whose readings include the device work queued before them.

    CUDA kernels run asynchronously: a host clock read right after a step times its launch,
    not its run, and the difference shows up in whatever waits next (the collective's wait,
    the next step). Timings that decide something (dynamic local steps, the documents' cost
    model, the emulated slower workers) read this clock instead, which synchronises first.
    On the CPU it is ``time.perf_counter`` itself; ``None``: synchronise the current CUDA
    device if CUDA is in use in this process (checked at every reading), else nothing.
    """
    if device is not None and not _is_cuda(device):
        return time.perf_counter
    target = None if device is None else torch.device(device)

    def clock() -> float:
        synchronize(target)
        return time.perf_counter()

    return clock


def peak_memory_allocated(device: torch.device | str) -> int | None:
    """``torch.cuda.max_memory_allocated`` of ``device`` (bytes, this process's tensors since
    the start or the last reset); ``None`` on the CPU."""
    if not _is_cuda(device):
        return None
    return int(torch.cuda.max_memory_allocated(torch.device(device)))


def device_future(*tensors: torch.Tensor) -> torch.futures.Future:
    """An empty ``torch.futures.Future`` that may be completed with ``tensors``.

    A future created without devices refuses a value holding CUDA tensors ("Expected all data
    ptrs to be on a device of type cpu"); one created with their devices records an event on
    the current stream when it is completed and makes its waiters' streams wait on it, so the
    value is ready wherever it is used. On the CPU this is ``torch.futures.Future()``.
    """
    devices: list[int | str | torch.device] = sorted(
        {t.device for t in tensors if t.is_cuda}, key=str
    )
    if not devices:
        return torch.futures.Future()
    return torch.futures.Future(devices=devices)


# --- host and device copies -------------------------------------------------------------------


def pinned_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised CPU tensor of ``t``'s shape and dtype, in page-locked (pinned) memory
    when CUDA is available: copies between it and the device can then be asynchronous
    (``non_blocking=True``) instead of stalling the stream; ordinary memory otherwise."""
    return torch.empty(t.shape, dtype=t.dtype, device=_CPU, pin_memory=torch.cuda.is_available())


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (a CPU tensor: a batch) on ``device`` without stalling the device's stream.

    A copy from ordinary (pageable) host memory waits for the stream to drain first, which
    ends the host's lead over the device every step; from pinned memory it is queued like a
    kernel. So the tensor is copied into pinned memory and sent with ``non_blocking=True``.
    The pinned copy is never rewritten while the transfer reads it: the caching host
    allocator that owns it records an event on the stream and reuses the block only after
    it. ``t`` itself may be changed right after the call. On the CPU: ``t.to(device)``.
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostStaging:
    """A pinned host buffer through which a device tensor goes to the CPU and back: for a codec
    or a collective (gloo) that runs on the CPU while the tensors live on a GPU.

    The buffer is shared by every round, so two orderings keep it correct: the host reads it
    only after the copy into it has finished (:meth:`ready`), and nothing overwrites it —
    neither the next :meth:`download` nor a CPU collective writing its result into it — before
    the previous :meth:`upload` has read it (:meth:`writable`, which :meth:`download` calls).
    On the CPU there is nothing to stage: :meth:`download` returns the tensor itself and
    :meth:`upload` copies back only when the buffer is not the destination.

    Args:
        like: a tensor of the shape and dtype to stage (its device is the device side).
    """

    def __init__(self, like: torch.Tensor) -> None:
        self.device = like.device
        self.host: torch.Tensor | None = None if like.device.type == "cpu" else pinned_like(like)
        self._copied: torch.cuda.Event | None = None
        self._read: torch.cuda.Event | None = None

    def writable(self) -> None:
        """Block the host until the last :meth:`upload` has read the buffer."""
        if self._read is not None:
            self._read.synchronize()
            self._read = None

    def download(self, src: torch.Tensor) -> torch.Tensor:
        """Queue the copy of ``src`` (on the device) into the buffer and return the buffer; it
        holds ``src``'s values once :meth:`ready` returns. On the CPU: ``src``."""
        if self.host is None:
            return src
        self.writable()
        self.host.copy_(src, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        return self.host

    def ready(self) -> torch.Tensor | None:
        """Block the host until the last :meth:`download` has landed; returns the buffer
        (``None`` on the CPU, where :meth:`download` returned the tensor itself)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self.host

    def upload(self, dst: torch.Tensor, src: torch.Tensor | None = None) -> None:
        """Queue the copy of the buffer (or ``src``, the CPU tensor :meth:`download` returned on
        the CPU) into ``dst``; the buffer must not be written again before :meth:`writable`."""
        if self.host is None:
            if src is not None and src is not dst:
                dst.copy_(src)
            return
        dst.copy_(self.host, non_blocking=True)
        self._read = torch.cuda.Event()
        self._read.record(torch.cuda.current_stream(self.device))


# --- waiting for collectives ------------------------------------------------------------------

_waiters = threading.local()


def _waiter_stream(device: torch.device, purpose: str = "wait") -> torch.cuda.Stream:
    """A stream of this thread's own on ``device`` that carries nothing but waits (one per
    ``purpose``, so that timing events do not queue behind host waits). Made once and kept:
    torch hands out streams round-robin from a pool, and one that only waits delays at worst
    the later work of another user the pool gives it to, never its results."""
    streams = getattr(_waiters, "streams", None)
    if streams is None:
        streams = _waiters.streams = {}
    key = (device, purpose)
    if key not in streams:
        streams[key] = torch.cuda.Stream(device)
    stream: torch.cuda.Stream = streams[key]
    return stream


def host_wait(works: Iterable[Any], device: torch.device | str | None) -> None:
    """Block the host until ``works`` (collectives' handles) are complete on ``device``.

    On NCCL ``work.wait()`` only makes the *current* stream wait for the collective; the host
    goes on at once. Synchronising the current stream after it would also wait for every
    kernel queued on it before (a whole inner step), which an emulated link would count as
    part of the transfer and a blocked-time counter as time blocked. Here the works are waited
    on a stream of this thread that carries nothing else, and that stream is synchronised: the
    host waits for the collectives alone. Once the host has seen them complete, any kernel
    queued afterwards, on any stream, reads their results. On the CPU (or ``None``): each
    ``work.wait()``.
    """
    works = list(works)
    if not _is_cuda(device):
        for w in works:
            w.wait()
        return
    assert device is not None
    waiter = _waiter_stream(torch.device(device))
    with torch.cuda.stream(waiter):
        for w in works:
            w.wait()
    waiter.synchronize()


class CollectiveTimer:
    """The device time from a collective's launch to its completion, by CUDA events.

    An NCCL handle's future is complete as soon as the collective is queued (its value is then
    ready *on the streams that wait for it*), so a completion callback times the launch, not
    the transfer, and the "in flight" time a counter sums from it is about zero. Here an event
    is recorded on the launching stream at the launch (the collective starts when that stream
    reaches it) and another on a stream of its own that waits for the collective's end; their
    distance is the time in flight. On the CPU, and for gloo on CUDA tensors
    (:func:`completes_on_device` of ``group``), :meth:`seconds` is ``None``: the caller keeps
    timing by the handle's future, which gloo completes when the collective has, and a gloo
    handle's ``wait()`` here would block the host at the launch.

    Call :meth:`launched` right after starting the collectives, on the stream that started
    them, and :meth:`seconds` once they are complete (after a wait that blocked the host).
    Called again (the next bucket's collective, a second phase), the time runs from the first
    launch to the end of the last collective.
    """

    def __init__(self, device: torch.device | str, group: Any = None) -> None:
        self.device = torch.device(device)
        self.group = group
        """The process group the collectives run on (``None``: WORLD): whether they complete
        on the device is its backend's (:func:`completes_on_device`)."""
        self._start: torch.cuda.Event | None = None
        self._end: torch.cuda.Event | None = None
        self._untimed = False

    def launched(self, works: Iterable[Any]) -> None:
        """Mark the launch of ``works`` (the process group's own handles on NCCL; anything
        else, such as an emulated link's handle or gloo's, which complete on the host, is not
        timed here, and then :meth:`seconds` is ``None``)."""
        works = list(works)
        if not works:
            return
        if (
            self.device.type != "cuda"
            or not all(isinstance(w, dist.Work) for w in works)
            or not completes_on_device(self.group)
        ):
            self._untimed = True
            return
        if self._start is None:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(self.device))
        # the timing stream waits for each collective in launch order: its event after the
        # last marks the end of every collective launched so far
        timing = _waiter_stream(self.device, "timing")
        with torch.cuda.stream(timing):
            for w in works:
                w.wait()
        self._end = torch.cuda.Event(enable_timing=True)
        self._end.record(timing)

    def seconds(self) -> float | None:
        """Seconds from the first launch to the last completion on the device; ``None`` on the
        CPU, or when some collective was not timed."""
        if self._untimed or self._start is None or self._end is None:
            return None
        self._end.synchronize()
        return float(self._start.elapsed_time(self._end)) / 1e3


# --- the side stream of an outer algorithm ----------------------------------------------------


def _key(t: torch.Tensor) -> tuple[int, int]:
    return (t.untyped_storage().data_ptr(), int(t.storage_offset()))


class Launch:
    """One launch on a :class:`CommStream` (what :meth:`CommStream.launch` yields and
    :meth:`CommStream.apply` takes)."""

    def __init__(self, owner: CommStream, writes: Sequence[torch.Tensor]) -> None:
        self.owner = owner
        self.writes = [_key(t) for t in writes]
        self.compute: torch.cuda.Stream | None = None
        """The stream the launch was made from (the compute stream)."""
        self.read: torch.cuda.Event | None = None
        """Recorded on the side stream once the launch's inputs are read."""
        self.done: torch.cuda.Event | None = None
        """Recorded on the side stream at the end of the launch."""
        self.applied = False

    def inputs_read(self) -> None:
        """Everything the launch reads that the compute stream will write again (θ, A) has been
        read: from here on the compute stream waits only for the work queued so far on the
        side stream (the fill of the send buffer), not for the encoding and the collective
        queued after it. Without this call it waits for the whole launch."""
        stream = self.owner.stream
        if stream is None or self.read is not None:
            return
        assert self.compute is not None, "inputs_read() inside CommStream.launch()"
        self.read = stream.record_event()
        self.compute.wait_event(self.read)


class CommStream:
    """The CUDA stream an outer algorithm's syncs are prepared and launched on, beside the
    compute stream; a no-op on the CPU (the same calls, nothing queued anywhere else).

    Why a side stream: the send buffer's fill (Δ = A − θ), its encoding (a codec) and the
    collective's launch otherwise queue behind the next inner step's kernels on one stream and
    in front of the step after; on their own stream they run beside them. The orderings that
    keep it correct, each enforced here:

    * **before the launch**, the side stream waits for the compute stream
      (``wait_stream``): θ is read after the inner step that wrote it, and the send buffer is
      written after the last apply that read it;
    * **θ and A are not overwritten while the side stream reads them**: the compute stream
      waits for the side stream at :meth:`Launch.inputs_read` (or at the end of the launch);
    * **a buffer in flight is not rewritten**: a launch names the send buffers it ``writes``,
      and launching into one whose sync has not been applied is a bug (``AssertionError``);
      CO2 launches round t + 1 into its second buffer while round t is in flight;
    * **the allocator does not reuse memory the side stream still reads**: a tensor made on
      the compute stream and read by the launch (``reads``: gradients that ``zero_grad``
      frees right after the step) is ``record_stream``-ed on the side stream; a tensor made
      during the launch (codec payloads, gathered buffers) and used at apply time on the
      compute stream is handed over with ``record_stream`` (:meth:`apply`);
    * **at apply time** the compute stream waits for everything the launch queued (an event,
      not a host synchronisation); the collective itself is waited on by its handle.

    Collectives launched inside :meth:`launch` are ordered after the side stream's work up to
    that point (NCCL waits for the current stream, which is the side stream there).

    Args:
        device: where the algorithm's buffers live.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
        self._in_flight: dict[tuple[int, int], Launch] = {}

    @property
    def active(self) -> bool:
        """Whether launches run on a stream of their own (CUDA), not inline (CPU)."""
        return self.stream is not None

    @property
    def in_flight(self) -> int:
        """Launches not yet applied that write a send buffer."""
        return len({id(launch) for launch in self._in_flight.values()})

    @contextlib.contextmanager
    def launch(
        self, *, reads: Sequence[torch.Tensor] = (), writes: Sequence[torch.Tensor] = ()
    ) -> Iterator[Launch]:
        """Run the body on the side stream (see the class docstring): fill the send buffers
        (``writes``), call :meth:`Launch.inputs_read`, start the collective. ``reads``:
        tensors the body reads that the compute stream may free or reuse right after (not
        the parameters or the algorithm's own buffers, which live as long as it does)."""
        token = Launch(self, writes)
        busy = [k for k in token.writes if k in self._in_flight]
        assert not busy, "a send buffer is written while its last sync is still in flight"
        if self.stream is None:
            yield token
            self._register(token)
            return
        compute = torch.cuda.current_stream(self.device)
        token.compute = compute
        self.stream.wait_stream(compute)
        for t in reads:
            if t.is_cuda:
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield token
        token.done = self.stream.record_event()
        if token.read is None:  # the caller did not say when θ was read: after everything
            compute.wait_event(token.done)
            token.read = token.done
        self._register(token)

    def _register(self, token: Launch) -> None:
        for k in token.writes:
            self._in_flight[k] = token

    def apply(self, token: Launch | None, *, hand_over: Sequence[torch.Tensor] = ()) -> None:
        """At the sync's apply, before its handle's ``wait()`` (which may decode on the compute
        stream what the launch encoded) or after it: the current (compute) stream
        waits for everything ``token`` queued on the side stream, and ``hand_over`` (tensors
        made during the launch that the compute stream uses now) are recorded on it, so that
        their memory is not reused before it is done with them. ``token`` ``None``: a sync
        restored from a checkpoint, nothing in flight. Idempotent."""
        if token is None or token.applied:
            return
        assert token.owner is self, "a launch is applied on the stream it was made on"
        token.applied = True
        for k in token.writes:
            if self._in_flight.get(k) is token:
                del self._in_flight[k]
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        assert token.done is not None
        current.wait_event(token.done)
        for t in hand_over:
            if t.is_cuda:
                t.record_stream(current)

    def wait_for(self, token: Launch | None) -> None:
        """The current (compute) stream waits for everything ``token`` queued on the side
        stream, which stays in flight (not applied): for a result the launch made that is
        read before the sync's apply (eager CO2 reads this rank's own fresh contribution at
        its launch step). ``None``, an applied launch or the CPU: nothing to wait for."""
        if token is None or token.applied:
            return
        assert token.owner is self, "a launch is waited for on the stream it was made on"
        if self.stream is None:
            return
        assert token.done is not None, "wait_for() after the launch"
        torch.cuda.current_stream(self.device).wait_event(token.done)

    def drain(self) -> None:
        """Forget every launch in flight (their syncs were dropped or restored): the next
        launch may write any buffer. The compute stream waits for the side stream."""
        self._in_flight.clear()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
