"""Guards against runs that go wrong silently: ranks that start out different, and non-finite
averages.

* :func:`check_same_across_ranks` compares a description of something every rank should hold
  identically (a model, an algorithm's settings, a training job's settings) and fails on every
  rank with a message naming the first difference. One small all-gather of a digest when all
  ranks agree; the full descriptions are gathered only to name a difference.
* :func:`describe_tensors` is such a description of named tensors: names, shapes, dtypes and a
  SHA-256 checksum of each tensor's bytes.
* :func:`all_finite` and :func:`zero_non_finite_` back the numeric guard of the outer
  algorithms (``nan_policy``).
* :func:`out_of_step` turns a collective that never completed (gloo's "Timed out waiting
  15000ms for recv", a closed connection) into a :class:`CollectiveError` that names the likely
  causes: ranks that call ``step()`` a different number of times, or a peer that died.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.hparams import HyperparameterError

__all__ = [
    "CollectiveError",
    "HostFlags",
    "NAN_POLICIES",
    "NonFiniteError",
    "all_finite",
    "check_nan_policy",
    "optimizer_settings",
    "optimizer_state_tensors",
    "check_same_across_ranks",
    "describe_tensors",
    "explain_lost_collectives",
    "finite_flag",
    "first_line",
    "is_peer_loss",
    "mentions_peer_loss",
    "out_of_step",
    "zero_non_finite_",
]

NAN_POLICIES = ("skip", "raise")
"""What an outer algorithm does with a NaN or Inf in its averaged pseudo-gradient."""

Description = list[tuple[str, str]]
"""An ordered list of ``(what, value)`` pairs every rank should hold identically."""


def check_nan_policy(key: str, value: Any) -> None:
    if value not in NAN_POLICIES:
        raise HyperparameterError(
            key,
            f"must be 'skip' or 'raise', got {value!r}; 'skip' drops an outer update whose "
            "average holds NaN/Inf, 'raise' stops the run",
        )


class NonFiniteError(FloatingPointError):
    """The averaged pseudo-gradient held NaN or Inf and ``nan_policy`` is ``"raise"``."""


def checksum(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (its values bit for bit), as 16 hex digits."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(data.data).hexdigest()[:16]


def describe_tensors(
    named: Iterable[tuple[str, torch.Tensor]], *, values: bool = True
) -> Description:
    """Names, shapes, dtypes and (with ``values``) checksums of ``named`` tensors, in order."""
    out: Description = []
    items = list(named)
    out.append(("number of parameters", str(len(items))))
    for i, (name, t) in enumerate(items):
        out.append((f"name of parameter {i}", name))
        out.append((f"shape of {name}", str(tuple(t.shape))))
        out.append((f"dtype of {name}", str(t.dtype).removeprefix("torch.")))
        if values:
            out.append((f"values of {name} (checksum)", checksum(t)))
    return out


def _digest(description: Description) -> str:
    return hashlib.sha256(pickle.dumps(description, protocol=4)).hexdigest()


def check_same_across_ranks(
    description: Description,
    *,
    what: str,
    hint: str,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Raise ``ValueError`` on every rank of ``process_group`` unless all hold the same
    ``description``; the message names the first difference from the group's rank 0.

    Args:
        description: ``(what, value)`` pairs, e.g. from :func:`describe_tensors`.
        what: what is compared, for the message ("the model", "the CO2 settings").
        hint: the fix, appended to the message.
        process_group: the ranks that must agree (``None``: WORLD).
    """
    world = dist.get_world_size(process_group)
    if world == 1:
        return
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, _digest(description), group=process_group)
    if all(d == digests[0] for d in digests):
        return
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, description, group=process_group)
    raise ValueError(_first_difference(everyone, what=what, hint=hint))


def _first_difference(everyone: Sequence[Description], *, what: str, hint: str) -> str:
    ref = everyone[0]
    for rank, desc in enumerate(everyone[1:], start=1):
        for i in range(max(len(ref), len(desc))):
            mine = desc[i] if i < len(desc) else ("(nothing)", "(nothing)")
            theirs = ref[i] if i < len(ref) else ("(nothing)", "(nothing)")
            if mine == theirs:
                continue
            if mine[0] != theirs[0]:
                return (
                    f"ranks hold different {what}: rank 0 has {theirs[0]} = {theirs[1]} where "
                    f"rank {rank} has {mine[0]} = {mine[1]}; {hint}"
                )
            return (
                f"ranks hold different {what}: {mine[0]} is {theirs[1]} on rank 0 but "
                f"{mine[1]} on rank {rank}; {hint}"
            )
    raise AssertionError("descriptions differ by digest but not by content")


def _finite(t: torch.Tensor) -> bool:
    if t.numel() == 0:
        return True
    # one pass, no temporary (torch.isfinite allocates and is ~20x slower on CPU); a NaN makes
    # both the minimum and the maximum NaN, an Inf one of them
    low, high = torch.aminmax(t.detach())
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every value of every tensor is finite (no NaN, no ±Inf).

    On a GPU the per-tensor answers are combined on the device and read once: reading each
    tensor's would wait for the device once per tensor (a fragment's views are one per
    parameter)."""
    tensors = list(tensors)
    if not tensors or not all(t.is_cuda for t in tensors):
        return all(_finite(t) for t in _regions(tensors))
    return _all_finite_one_read(tensors)


def finite_flag(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether every value of ``tensors`` is finite, as a 0-dim bool tensor on their device,
    without reading it: one ``aminmax`` per tensor (pass a bucket's flat buffers, not its
    views, for a fixed number of operations per bucket), then one reduction. A NaN makes both
    the minimum and the maximum NaN, an Inf one of them. Read it with :class:`HostFlags`."""
    pairs = [torch.stack(torch.aminmax(t.detach().reshape(-1))) for t in tensors if t.numel()]
    if not pairs:
        device = tensors[0].device if tensors else torch.device("cpu")
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.isfinite(torch.cat(pairs) if len(pairs) > 1 else pairs[0]).all()


class HostFlags:
    """Boolean verdicts computed on the device (:func:`finite_flag`), brought to host memory
    without waiting: on CUDA a copy into pinned memory queued on the current stream, and an
    event; :meth:`read` waits for that event only, at the point where the caller already waits
    (a sync's apply, after its collective, which went out after the copy) or long after the
    copy was queued (the next sync point), never draining the queue. On the CPU the values are
    already there. No ``.item()``: the host reads host memory.

    Example::

        verdict = HostFlags(finite_flag(send.buffers))   # at launch, nothing waits
        ...
        (own_ok,) = verdict.read()                        # later: one read, cached
    """

    def __init__(self, *flags: torch.Tensor) -> None:
        values = torch.stack([f.reshape(()) for f in flags])
        self._event: torch.cuda.Event | None = None
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(values.device))
            values = host
        self._host = values
        self._read: list[bool] | None = None

    @staticmethod
    def known(*values: bool) -> HostFlags:
        """Verdicts already known on the host (a restored sync's)."""
        return HostFlags(*(torch.tensor(bool(v)) for v in values))

    def read(self) -> list[bool]:
        """The verdicts, in order (the first call waits for the copy; later calls are free)."""
        if self._read is None:
            if self._event is not None:
                self._event.synchronize()
            self._read = [bool(v) for v in self._host.numpy()]
        return self._read


def _regions(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` as fewer tensors holding exactly their values: consecutive views that tile
    a range of one contiguous 1-D buffer (a flat bucket's views, in order) become one slice of
    it, checked in one pass instead of one call per tensor; the others stay as they are."""
    out: list[torch.Tensor] = []
    run: tuple[torch.Tensor, int, int] | None = None  # (base, start, end) of the current slice
    for t in tensors:
        base = t._base
        span = None
        if (
            base is not None
            and base.dim() == 1
            and base.is_contiguous()
            and t.is_contiguous()
            and t.dtype == base.dtype
        ):
            start = int(t.storage_offset() - base.storage_offset())
            span = (base, start, start + t.numel())
        if span is not None and run is not None and run[0] is span[0] and run[2] == span[1]:
            run = (run[0], run[1], span[2])
            continue
        if run is not None:
            out.append(run[0][run[1] : run[2]])
        run = span
        if span is None:
            out.append(t)
    if run is not None:
        out.append(run[0][run[1] : run[2]])
    return out


def _all_finite_one_read(tensors: list[torch.Tensor]) -> bool:
    """:func:`all_finite` with one read of the device (the tensors on one device)."""
    ok = [
        torch.isfinite(torch.stack(torch.aminmax(t.detach()))).all() for t in tensors if t.numel()
    ]
    return not ok or bool(torch.stack(ok).all())


def zero_non_finite_(tensors: Iterable[torch.Tensor]) -> int:
    """Set the NaN and ±Inf values of floating-point ``tensors`` to 0 in place; returns how many
    tensors had any. Tensors without any are not written."""
    fixed = 0
    for t in tensors:
        if not t.is_floating_point() or _finite(t):
            continue
        torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)
        fixed += 1
    return fixed


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The floating-point tensors of an optimizer's per-parameter state (moments, buffers)."""
    out: list[torch.Tensor] = []
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                out.append(value)
    return out


def optimizer_settings(what: str, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's type and hyperparameters per group (not its parameters), for the
    consistency guard."""
    settings: dict[str, Any] = {what: type(optimizer).__name__}
    for i, group in enumerate(optimizer.param_groups):
        settings[f"{what} group {i} size"] = len(group["params"])
        for k, v in sorted(group.items()):
            if k != "params":
                settings[f"{what} group {i} {k}"] = v
    return settings


# -- collectives that never complete --------------------------------------------------------------

_PEER_LOSS = re.compile(r"connection (closed|reset)|broken pipe|timed out|timeout", re.IGNORECASE)
_SOURCE_LOCATION = re.compile(r"^\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\]\s*")


class CollectiveError(RuntimeError):
    """A collective of an algorithm did not complete: a peer never joined it (it timed out) or
    the connection to a peer was lost."""


def mentions_peer_loss(text: str) -> bool:
    """Whether an error message says a peer was lost (a closed or reset connection, a
    timeout)."""
    return bool(_PEER_LOSS.search(text))


def is_peer_loss(error: BaseException) -> bool:
    """Whether ``error`` is what a rank sees when a peer died, stalled or is out of step (a
    lost connection or a collective timeout): a knock-on effect, not a root cause."""
    if isinstance(error, CollectiveError):
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    return isinstance(error, RuntimeError) and mentions_peer_loss(str(error))


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, without the source location gloo prefixes
    (``"[/path/unbound_buffer.cc:78] Timed out"``); empty if there is none."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return _SOURCE_LOCATION.sub("", lines[0]) if lines else ""


@contextlib.contextmanager
def explain_lost_collectives(who: str, doing: str, step: Callable[[], int]) -> Iterator[None]:
    """Re-raise a collective that never completed inside the block as the
    :class:`CollectiveError` of :func:`out_of_step` (chained to the original).

    Args:
        who: the algorithm (``"CO2"``).
        doing: what it was doing (``"step()"``, ``"finish()"``).
        step: returns its inner step count on this rank.
    """
    try:
        yield
    except Exception as e:
        better = out_of_step(e, who=who, step=step(), doing=doing)
        if better is None:
            raise
        raise better from e


def out_of_step(error: BaseException, *, who: str, step: int, doing: str) -> CollectiveError | None:
    """The error to raise instead of ``error`` (or ``None``: it is no lost collective);
    arguments as :func:`explain_lost_collectives`'s."""
    if isinstance(error, CollectiveError) or not is_peer_loss(error):
        return None
    first = first_line(error) or type(error).__name__
    return CollectiveError(
        f"{who}: a collective did not complete on this rank after inner step {step} ({doing}): "
        f"{first}. Likely cause: the ranks are out of step (every rank must call step() once "
        "after every inner step, the same number of times, and finish() once at the end), or "
        "a peer process died or stalled"
    )
