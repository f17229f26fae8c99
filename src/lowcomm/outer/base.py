"""Shared machinery of the outer-loop algorithms: parameters, step counting, anchors, hooks, state.

An algorithm is driven by :meth:`OuterAlgorithm.step`, called once after every inner
``optimizer.step()``, which hands the step to the schedule :meth:`_on_step`: by default every
``sync_every`` (H) calls end a round with :meth:`_end_round`, which subclasses implement (the
fragment methods replace the schedule itself). Subclasses also implement :meth:`_finish` (drain
in-flight work) and extend :meth:`_extra_state` / :meth:`_load_extra_state` and
:meth:`_settings`.

Two guards run in every algorithm (:mod:`lowcomm.guard`):

* **Consistency at start.** At the first :meth:`~OuterAlgorithm.step` (or :meth:`finish`) every
  rank compares, across the group, the model as it was when the algorithm was built (parameter
  names, shapes, dtypes, a checksum of the values) and the algorithm's settings; a difference
  fails on every rank with a ``ValueError`` naming the first one. After :meth:`load_state_dict`
  the values are not compared (ranks resuming mid-round legitimately differ), the rest is.
  ``check_consistency=False`` turns it off.
* **Numeric guard.** A NaN or Inf in the averaged pseudo-gradient (identical on every rank, so
  every rank decides alike without another collective) skips that outer update: the anchor and
  the outer optimizer state stay as they were, the skip is counted (``skipped_updates``) and
  logged, and every rank zeroes the non-finite values of its own inner-optimizer state and
  error-feedback residuals and goes back to the anchor, so that the rank that diverged can
  recover. A rank that finds its own pseudo-gradient non-finite when it launches it does the
  same at once. ``nan_policy="raise"`` raises :class:`~lowcomm.guard.NonFiniteError` instead.
"""

from __future__ import annotations

import logging
import math
import numbers
import warnings
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

from lowcomm.comm import DEFAULT_BUCKET_CAP_MB, CommStats, Communicator, FlatBuckets
from lowcomm.compress.codecs import Codec, parse_compression
from lowcomm.compress.feedback import Compressor
from lowcomm.compress.lgreco import LGreCo
from lowcomm.guard import (
    NAN_POLICIES,
    Description,
    NonFiniteError,
    all_finite,
    check_same_across_ranks,
    describe_tensors,
    optimizer_state_tensors,
    zero_non_finite_,
)

Compression = Codec | LGreCo | str | None
"""What ``compression=`` accepts: a codec, an L-GreCo setting, a spec string or ``None``."""

__all__ = ["OuterAlgorithm"]

logger = logging.getLogger(__name__)


def _check_positive_int(name: str, value: Any, example: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}; e.g. {name}={example}")


def _check_positive_float(name: str, value: Any, example: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"{name} must be a finite number > 0, got {value!r}; e.g. {name}={example}"
        )


def _check_momentum(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not 0 <= float(value) < 1
    ):
        raise ValueError(f"{name} must be in [0, 1), got {value!r}; e.g. {name}=0.9")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


class Advancing(Protocol):
    """A collective with a second phase the schedule launches early (PowerSGD's second
    all-reduce, a sharded sync's update and all-gather)."""

    @property
    def needs_advance(self) -> bool: ...

    def advance(self) -> None: ...


class OuterAlgorithm:
    """Base class: see the module docstring. Not used directly.

    Every algorithm takes these two keywords besides its own:

    Args:
        nan_policy: ``"skip"`` (default) drops an outer update whose averaged pseudo-gradient
            holds NaN or Inf, alike on every rank, and counts it in ``skipped_updates``;
            ``"raise"`` raises :class:`~lowcomm.guard.NonFiniteError` on every rank instead.
        check_consistency: compare the model and settings across ranks at the first step and
            fail on every rank naming the first difference (default True).
    """

    name: ClassVar[str] = "outer"
    schedule: ClassVar[str] = "blocking"
    """How it communicates (:data:`lowcomm.outer.registry.SCHEDULES`)."""
    compressible: ClassVar[bool] = False
    """Whether it takes ``compression=``."""

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[torch.Tensor],
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        process_group: dist.ProcessGroup | Communicator | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        nan_policy: str = "skip",
        check_consistency: bool = True,
    ) -> None:
        OuterAlgorithm.validate(nan_policy=nan_policy, check_consistency=check_consistency)
        named = self._collect_params(model_or_params)
        self.params = [p for _, p in named]
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"inner_optimizer must be a torch.optim.Optimizer, got "
                f"{type(inner_optimizer).__name__}; pass the optimizer you call .step() on"
            )
        self.inner = inner_optimizer
        self.sync_every = int(sync_every)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.comm = (
            process_group
            if isinstance(process_group, Communicator)
            else Communicator(process_group)
        )
        self.local_step = 0
        """Inner steps taken (calls to :meth:`step`)."""
        self.rounds = 0
        """Rounds completed (every ``sync_every`` inner steps)."""
        self._hook: RemovableHandle | None = None
        self._warned_partial_at = -1
        self._profile_tag = f"lowcomm::{self.name}"
        # two-phase compressed collectives (PowerSGD) and the inner step to advance them at
        self._to_advance: list[tuple[int, Advancing]] = []
        self.nan_policy = nan_policy
        self.skipped_updates = 0
        """Outer updates skipped because their averaged pseudo-gradient held NaN or Inf."""
        # The model as built, compared across ranks at the first step (values hashed now).
        self._unchecked: Description | None = (
            describe_tensors((n, p) for n, p in named) if check_consistency else None
        )

    # -- argument checks ---------------------------------------------------------------------

    @classmethod
    def validate(cls, **kwargs: Any) -> None:
        """Raise ``ValueError`` for bad keyword arguments (the constructor's, less model,
        optimizer and process group). The CLI calls this before launching workers."""
        if "sync_every" in kwargs:
            _check_positive_int("sync_every", kwargs["sync_every"], 12)
        if "bucket_cap_mb" in kwargs:
            _check_positive_float("bucket_cap_mb", kwargs["bucket_cap_mb"], 25.0)
        if kwargs.get("compression") is not None:
            parse_compression(kwargs["compression"])  # raises ValueError naming the fix
        if "nan_policy" in kwargs and kwargs["nan_policy"] not in NAN_POLICIES:
            raise ValueError(
                f"nan_policy must be 'skip' or 'raise', got {kwargs['nan_policy']!r}; 'skip' "
                "drops an outer update whose average holds NaN/Inf, 'raise' stops the run"
            )
        if "check_consistency" in kwargs:
            _check_bool("check_consistency", kwargs["check_consistency"])
        if "shard_outer_state" in kwargs:
            _check_bool("shard_outer_state", kwargs["shard_outer_state"])
            if kwargs["shard_outer_state"] and kwargs.get("compression") is not None:
                raise ValueError(
                    "shard_outer_state=True cannot be combined with compression: a sharded "
                    "sync reduce-scatters the parameters, and the codecs' error feedback needs "
                    "every rank's own pseudo-gradient; drop one of them"
                )

    @staticmethod
    def _collect_params(
        model_or_params: nn.Module | Iterable[torch.Tensor],
    ) -> list[tuple[str, torch.Tensor]]:
        """The trainable parameters with their names (``params[i]`` when not from a module)."""
        named: list[tuple[str, torch.Tensor]]
        if isinstance(model_or_params, nn.Module):
            named = [(n, p) for n, p in model_or_params.named_parameters() if p.requires_grad]
        elif isinstance(model_or_params, torch.Tensor):
            raise ValueError(
                "model_or_params must be an nn.Module or an iterable of parameters, got a single "
                "tensor; wrap it in a list: [param]"
            )
        else:
            try:
                named = [
                    (f"params[{i}]", p) for i, p in enumerate(model_or_params) if p.requires_grad
                ]
            except TypeError as e:
                raise ValueError(
                    f"model_or_params must be an nn.Module or an iterable of parameters, got "
                    f"{type(model_or_params).__name__}"
                ) from e
        if not named:
            raise ValueError(
                "no trainable parameters: model_or_params has no tensor with requires_grad=True"
            )
        # FSDP2 (fully_shard) parameters are DTensors: work on this rank's local shard, which
        # shares their storage (ranks with the same place in their node groups hold matching
        # shards, so averaging those across node groups averages the model)
        named = [(n, _local(p)) for n, p in named]
        params = [p for _, p in named]
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(
                f"all parameters must be on one device, found {sorted(map(str, devices))}; "
                "pass the parameters of one device (one algorithm per device group)"
            )
        if any(not p.is_floating_point() for p in params):
            raise ValueError("all trainable parameters must be floating point")
        return named

    def _new_buckets(self) -> FlatBuckets:
        return FlatBuckets.for_tensors(self.params, bucket_cap_mb=self.bucket_cap_mb)

    # -- driving -----------------------------------------------------------------------------

    @property
    def stats(self) -> CommStats:
        """Communication counters of this worker (bytes, time blocked and in flight)."""
        return self.comm.stats

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def anchor_views(self) -> list[torch.Tensor]:
        """A for every trainable parameter, in model order: the consensus model to evaluate
        (LocalSGD, which keeps no anchor: the parameters themselves)."""
        anchor = getattr(self, "anchor", None)
        return list(anchor.views) if anchor is not None else list(self.params)

    _discards_partial_round = True
    """Whether :meth:`finish` drops the steps taken since the last round boundary (and warns)."""

    def step(self) -> None:
        """Call once after every inner ``optimizer.step()``; ends a round every H calls."""
        if self._unchecked is not None:
            self._check_consistency()
        self.local_step += 1
        with torch.no_grad():
            if self._to_advance:
                self._advance_due(self.local_step)
            self._on_step(self.local_step)
        if self.local_step % self.sync_every == 0:
            self.rounds += 1

    def _on_step(self, step: int) -> None:
        """The schedule: end a round every ``sync_every`` steps (fragment methods override)."""
        if step % self.sync_every == 0:
            with record_function(f"{self._profile_tag}::round"):
                self._end_round()

    def finish(self) -> None:
        """Drain in-flight communication and apply it; afterwards θ equals the anchor on every
        rank. Idempotent. Inner steps taken since the last round boundary are not
        synchronised and are discarded (a warning says how many)."""
        partial = self.local_step % self.sync_every
        if self._discards_partial_round and partial and self._warned_partial_at != self.local_step:
            self._warned_partial_at = self.local_step
            warnings.warn(
                f"{type(self).__name__}.finish() discards {partial} inner step(s) taken since "
                f"the last round boundary; make the number of steps a multiple of "
                f"sync_every={self.sync_every} to keep them",
                stacklevel=2,
            )
        if self._unchecked is not None:
            self._check_consistency()
        with torch.no_grad(), record_function(f"{self._profile_tag}::finish"):
            self._finish()

    # -- guards ------------------------------------------------------------------------------

    def _settings(self) -> dict[str, Any]:
        """The settings every rank must share, compared at start (subclasses extend it)."""
        return {
            "algorithm": self.name,
            "sync_every": self.sync_every,
            "bucket_cap_mb": self.bucket_cap_mb,
            "nan_policy": self.nan_policy,
            **optimizer_settings("inner optimizer", self.inner),
        }

    def _check_consistency(self) -> None:
        """Fail on every rank unless all hold the same model and settings (see the module
        docstring); runs once."""
        model, self._unchecked = self._unchecked, None
        assert model is not None
        settings = [(f"setting {k}", repr(v)) for k, v in self._settings().items()]
        check_same_across_ranks(
            model + settings,
            what=f"{type(self).__name__} inputs",
            hint=(
                "every rank must build the same model from the same seed (or load the same "
                "weights) and pass the same settings, before training starts"
            ),
            process_group=self.comm.group,
        )

    def _guard(self, average: Sequence[torch.Tensor], what: str) -> bool:
        """Whether ``average`` (an all-reduced pseudo-gradient, bit-identical on every rank) is
        finite; if not, :meth:`_skip` and return False: the caller skips its outer update."""
        if all_finite(average):
            return True
        self._skip(what)
        return False

    def _skip(self, what: str) -> None:
        """The average of ``what`` holds NaN or Inf (decided alike on every rank): count it,
        then raise (``nan_policy="raise"``) or recover this rank (:meth:`_recover_local`) and
        log."""
        self.skipped_updates += 1
        message = (
            f"{type(self).__name__}: the averaged pseudo-gradient of {what} holds NaN or Inf "
            f"(inner step {self.local_step}, rank {self.comm.rank})"
        )
        if self.nan_policy == "raise":
            # every rank raises here alike: finish what is in flight so that no rank leaves a
            # collective half done (its peers would wait, and its process abort at exit)
            self._drain()
            raise NonFiniteError(
                f"{message}; a worker diverged (lower the learning rate, check the data), or "
                "use nan_policy='skip' to drop such updates"
            )
        fixed = self._recover_local()
        logger.warning(
            "%s: update skipped alike on every rank (%d skipped so far)%s",
            message,
            self.skipped_updates,
            f"; zeroed non-finite values in {fixed} local state tensor(s)" if fixed else "",
        )

    def _check_own(self, delta: Sequence[torch.Tensor]) -> bool:
        """At launch: whether this rank's own pseudo-gradient is finite. If not, this rank
        diverged: log it and recover its local state now, so that it trains correctly from
        the anchor while the poisoned average is on its way (every rank will skip it)."""
        if all_finite(delta):
            return True
        fixed = self._recover_local()
        logger.warning(
            "%s: rank %d's own pseudo-gradient holds NaN or Inf at inner step %d; it goes "
            "back to the anchor (zeroed non-finite values in %d local state tensor(s))",
            type(self).__name__,
            self.comm.rank,
            self.local_step,
            fixed,
        )
        return False

    def _recover_local(self) -> int:
        """Zero the non-finite values of this rank's inner-optimizer state and error-feedback
        residuals; returns how many tensors had any. Subclasses also reset parameters."""
        fixed = zero_non_finite_(optimizer_state_tensors(self.inner))
        return fixed + sum(c.drop_non_finite() for c in self._compressors())

    def _compressors(self) -> list[Compressor]:
        """This rank's error-feedback compressors (none without compression)."""
        return []

    def _drain(self) -> None:
        """Wait for every collective in flight (not applying it): before raising alike."""

    def _schedule_advance(self, handle: Advancing, window: int) -> None:
        """Advance ``handle``'s second phase (PowerSGD's Q all-reduce) halfway through the
        ``window`` inner steps it has before it is applied: every rank does so at the same
        step, before that step's own launches, so collectives stay in the same order."""
        if handle.needs_advance:
            self._to_advance.append((self.local_step + max(1, window // 2), handle))

    def _advance_due(self, step: int) -> None:
        due = [h for at, h in self._to_advance if at <= step]
        self._to_advance = [(at, h) for at, h in self._to_advance if at > step]
        for handle in due:
            handle.advance()

    def _end_round(self) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    # -- hook form ---------------------------------------------------------------------------

    def __enter__(self) -> OuterAlgorithm:
        """Register an inner-optimizer step post-hook so the loop needs no ``algo.step()``.

        The hook fires only when ``optimizer.step()`` runs. If a rank may skip a step (AMP's
        ``GradScaler`` skips steps with inf/NaN gradients, decided per rank without DDP), the
        ranks' step counts drift apart and their collectives no longer match: call
        :meth:`step` explicitly after every iteration instead.
        """
        if self._hook is not None:
            raise ValueError(f"{type(self).__name__} is already active as a context manager")
        self._hook = self.inner.register_step_post_hook(lambda *_: self.step())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        # On an exception the other ranks may be gone: waiting on a collective could hang.
        if exc_type is None:
            self.finish()

    # -- memory ------------------------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for the algorithm, beyond the model and inner optimizer,
        measured from tensor storage (each storage once): ``"state"`` — what persists between
        syncs (anchor, outer optimizer or momentum, statistics, error feedback) — and
        ``"buffers"`` — communication buffers (pseudo-gradients in flight, snapshots, gathered
        anchors). With ``shard_outer_state=True`` the state is 1/N of the unsharded one."""
        return {
            "state": storage_nbytes(self._state_tensors()),
            "buffers": storage_nbytes(self._buffer_tensors()),
        }

    def _state_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for c in self._compressors():
            out += [*c.residuals, *c.q.values()]
        return out

    def _buffer_tensors(self) -> list[torch.Tensor]:
        return []

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: counters, anchors, outer state, in-flight results.

        In-flight all-reduces are waited for (not applied) so their averaged result can be
        stored; resuming then gives the same numbers as not stopping.
        """
        state: dict[str, Any] = {
            "algorithm": self.name,
            "sync_every": self.sync_every,
            "world_size": self.world_size,
            "local_step": self.local_step,
            "rounds": self.rounds,
            "skipped_updates": self.skipped_updates,
        }
        state.update(self._extra_state())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; refuses state from another configuration."""
        for key, mine in (
            ("algorithm", self.name),
            ("sync_every", self.sync_every),
            ("world_size", self.world_size),
        ):
            if key not in state:
                raise ValueError(f"not a {type(self).__name__} state_dict: missing {key!r}")
            if state[key] != mine:
                raise ValueError(
                    f"state_dict was saved with {key}={state[key]!r} but this "
                    f"{type(self).__name__} has {key}={mine!r}; resume with the same settings"
                )
        self._to_advance = []
        self._load_extra_state(state)
        # counters last: a state_dict refused half-way leaves them as they were
        self.local_step = int(state["local_step"])
        self.rounds = int(state["rounds"])
        self.skipped_updates = int(state.get("skipped_updates", 0))
        if self._unchecked is not None:
            # ranks resuming mid-round hold different values: compare the rest only
            self._unchecked = [e for e in self._unchecked if not e[0].startswith("values of")]

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def _load_tensors(self, state: dict[str, Any], key: str, into: Sequence[torch.Tensor]) -> None:
        if key not in state:
            raise ValueError(f"{type(self).__name__} state_dict is missing {key!r}")
        src = state[key]
        if len(src) != len(into):
            raise ValueError(
                f"state_dict[{key!r}] has {len(src)} tensors but the model has {len(into)} "
                "trainable parameters; load it into the same model"
            )
        for i, (s, d) in enumerate(zip(src, into)):
            if s.shape != d.shape:
                raise ValueError(
                    f"state_dict[{key!r}][{i}] has shape {tuple(s.shape)} but parameter {i} "
                    f"has shape {tuple(d.shape)}; load it into the same model"
                )
        torch._foreach_copy_(list(into), [s.to(d.device) for s, d in zip(src, into)])


def optimizer_settings(what: str, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's type and hyperparameters per group (not its parameters), for
    :meth:`OuterAlgorithm._settings`."""
    settings: dict[str, Any] = {what: type(optimizer).__name__}
    for i, group in enumerate(optimizer.param_groups):
        settings[f"{what} group {i} size"] = len(group["params"])
        for k, v in sorted(group.items()):
            if k != "params":
                settings[f"{what} group {i} {k}"] = v
    return settings


def _local(param: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (same storage); any other tensor as it is."""
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param


def storage_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def outer_optimizer_step(
    optimizer: torch.optim.Optimizer,
    anchor: Sequence[torch.Tensor],
    avg_delta: Sequence[torch.Tensor],
) -> None:
    """One step of an outer optimizer built over ``anchor``, with ``A.grad = Δ̄``."""
    for a, d in zip(anchor, avg_delta):
        a.grad = d
    optimizer.step()
    for a in anchor:
        a.grad = None


def clone_views(buckets: FlatBuckets) -> list[torch.Tensor]:
    """Per-parameter copies of a bucket set, for state dicts that survive a bucket-size change."""
    return [v.detach().clone() for v in buckets.views]
