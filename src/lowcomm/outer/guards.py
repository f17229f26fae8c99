"""The two guards of every outer algorithm (an object the engine holds, ``engine.guards``;
checks in :mod:`lowcomm.guard`).

**Consistency at start** (and the step counts at ``finish()``): at the first ``step()`` the
ranks compare the model as built (names, shapes, dtypes, a checksum; not the values after
``load_state_dict()``) and the settings, and fail alike naming the first difference.
**Numeric guard**: an average holding NaN or Inf (bit-identical on every rank, so decided
alike) skips that update, counted in ``skipped_updates`` and logged; every rank zeroes the
non-finite values of its inner-optimizer state and residuals and, if diverged, goes back to the
anchor (a rank whose own contribution is not finite at launch does so at once).
``nan_policy="raise"`` raises instead.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from lowcomm.device import collective_device
from lowcomm.guard import (
    Description,
    NonFiniteError,
    all_finite,
    check_same_across_ranks,
    optimizer_settings,
    optimizer_state_tensors,
    zero_non_finite_,
)
from lowcomm.outer.fragment import Sync
from lowcomm.outer.hparams import ShardableConfig

if TYPE_CHECKING:
    from lowcomm.comm import Communicator
    from lowcomm.compress.codecs import Codec
    from lowcomm.compress.feedback import Compressor
    from lowcomm.compress.lgreco import LGreCo
    from lowcomm.outer.fragment import AnyFragment
    from lowcomm.outer.hparams import OuterConfig

__all__ = ["GuardedEngine", "Guards", "log_repeated"]

_NOT_COMPARED = ("check_consistency", "outer_optimizer", "fragments")
"""Keywords the guard does not compare (callables and modules: the settings they make are)."""

logger = logging.getLogger(__name__)

_LOGGED_REPEATS = 3
"""How many times a repeated numeric-guard event is logged as a warning (then at debug level:
``skipped_updates`` keeps counting)."""


def log_repeated(count: int, message: str, *args: Any) -> None:
    """Log the ``count``-th occurrence of an event: a warning the first few times, then one
    note that further ones are only counted, then debug."""
    if count <= _LOGGED_REPEATS:
        logger.warning(message, *args)
        if count == _LOGGED_REPEATS:
            logger.warning(
                "further non-finite updates are not logged; skipped_updates counts them (the "
                "run's summary shows the total)"
            )
    else:
        logger.debug(message, *args)


class GuardedEngine(Protocol):
    """What the guards ask of the engine that owns them
    (:class:`~lowcomm.outer.engine.OuterAlgorithm`)."""

    name: ClassVar[str]
    config: OuterConfig
    comm: Communicator
    inner: torch.optim.Optimizer
    params: list[torch.Tensor]
    fragments: list[AnyFragment]
    compression: Codec | LGreCo | None
    nan_policy: str
    overlap: int
    local_step: int

    def compressors(self) -> list[Compressor]: ...


class Guards:
    """Consistency at start and the numeric guard of one engine (see the module docstring):
    the model as built until the ranks have compared it (``model``: its description, ``None``
    to compare nothing), the counts of skipped updates and of this rank's own non-finite
    contributions, and the syncs whose own verdict the host has not read yet."""

    def __init__(self, engine: GuardedEngine, model: Description | None) -> None:
        self.engine = engine
        self.unchecked = model
        """The model as built, compared across ranks at the first step (then ``None``)."""
        self.skipped = 0
        """Updates skipped because their average held NaN or Inf (``skipped_updates``)."""
        self.own_non_finite = 0
        """Times this rank's own pseudo-gradient was not finite."""
        self.unread: list[Sync] = []
        """Launched syncs whose own verdict is not read yet."""
        self.steps_checked = -1
        """The step count ``finish()`` last compared across the ranks."""

    # -- consistency at start ------------------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        """The settings every rank must share: the common keywords, the optimizers, then the
        algorithm's own (a different DiLoCo ``outer_lr`` is named as its optimizer's lr)."""
        engine = self.engine
        common = {f.name for f in dataclasses.fields(ShardableConfig)}
        fields = [f.name for f in dataclasses.fields(engine.config) if f.name not in _NOT_COMPARED]
        settings: dict[str, Any] = {"algorithm": engine.name}
        settings.update({k: self._setting(k) for k in fields if k in common})
        settings.update(optimizer_settings("inner optimizer", engine.inner))
        outer = engine.fragments[0].outer
        settings.update({} if outer is None else outer.settings())
        settings.update({k: self._setting(k) for k in fields if k not in common})
        settings["fragment sizes"] = [frag.numel for frag in engine.fragments]
        settings["overlap"] = engine.overlap
        return settings

    def _setting(self, key: str) -> Any:
        compression = self.engine.compression
        if key == "compression":  # a codec object compares by its spec
            return None if compression is None else compression.spec
        return getattr(self.engine.config, key)

    def check_consistency(self) -> None:
        """Compare the model as built and the settings across the ranks, once (a no-op after
        the first call, or when there is nothing to compare)."""
        model, self.unchecked = self.unchecked, None
        if model is None:
            return
        settings = [(f"setting {k}", repr(v)) for k, v in self.settings().items()]
        check_same_across_ranks(
            model + settings,
            what=f"{type(self.engine).__name__} inputs",
            hint="every rank must build the same model from the same seed (or load the same "
            "weights) and pass the same settings, before training starts",
            process_group=self.engine.comm.group,
        )

    def check_same_steps(self, *, elastic: bool) -> None:
        """At ``finish()``: every rank took as many inner steps (one small all-gather, once per
        step count). Ranks that call ``step()`` a different number of times would otherwise end
        apart without a word (when their rounds happen to line up) or wait for each other's
        collectives until they time out. Not for an ``elastic`` engine (replicas are kept in
        step by their quorums)."""
        engine, comm = self.engine, self.engine.comm
        if elastic or comm.world_size == 1 or self.steps_checked == engine.local_step:
            return
        self.steps_checked = engine.local_step
        device = collective_device(comm)  # NCCL takes GPU tensors only
        counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(comm.world_size)]
        mine = torch.tensor([engine.local_step], dtype=torch.int64, device=device)
        dist.all_gather(counts, mine, group=comm.group)
        steps = [int(c) for c in counts]
        if len(set(steps)) > 1:
            listed = ", ".join(f"rank {r}: {n}" for r, n in enumerate(steps))
            raise ValueError(
                f"{type(engine).__name__}.finish(): the ranks called step() a different number "
                f"of times ({listed}); every rank must call step() once after every inner step"
            )

    def resumed(self) -> None:
        """State was loaded: ranks resuming mid-round hold different values, so compare the
        rest only."""
        if self.unchecked is not None:
            self.unchecked = [e for e in self.unchecked if not e[0].startswith("values of")]

    # -- the numeric guard ---------------------------------------------------------------------

    def skip(self, what: str) -> None:
        """Count a skipped update, then raise (``nan_policy="raise"``) or recover this rank
        (:meth:`recover_local`) and log."""
        engine = self.engine
        self.skipped += 1
        message = (
            f"{type(engine).__name__}: the averaged pseudo-gradient of {what} holds NaN or Inf "
            f"(inner step {engine.local_step}, rank {engine.comm.rank})"
        )
        if engine.nan_policy == "raise":
            # every rank raises here alike: finish what is in flight so that no rank leaves a
            # collective half done (its peers would wait, and its process abort at exit)
            self.drain()
            raise NonFiniteError(
                f"{message}; a worker diverged (lower the learning rate, check the data), or "
                "use nan_policy='skip' to drop such updates"
            )
        fixed = self.recover_local()
        if engine.comm.rank == 0:  # the same event on every rank: told once
            log_repeated(
                self.skipped,
                "%s: update skipped alike on every rank (%d skipped so far)%s",
                message,
                self.skipped,
                f"; zeroed non-finite values in {fixed} local state tensor(s)" if fixed else "",
            )

    def skip_warm_step(self, compressors: list[Compressor]) -> None:
        """A warm-start mean holds NaN or Inf: skip the step alike on every rank (gradients set
        to None, the warm start's ``compressors`` cleared of non-finite residuals), or raise
        (``nan_policy="raise"``)."""
        engine = self.engine
        self.skipped += 1
        message = (
            f"{type(engine).__name__}: the averaged gradient of warm-start step "
            f"{engine.local_step + 1} holds NaN or Inf (rank {engine.comm.rank})"
        )
        if engine.nan_policy == "raise":
            raise NonFiniteError(
                f"{message}; lower the learning rate, check the data, or use "
                "nan_policy='skip' to drop such steps"
            )
        if engine.comm.rank == 0:  # the same event on every rank: told once
            log_repeated(
                self.skipped,
                "%s: step skipped alike on every rank (%d skipped so far)",
                message,
                self.skipped,
            )
        for p in engine.params:
            p.grad = None
        for comp in compressors:
            comp.drop_non_finite()  # a non-finite residual would poison every mean

    def launched(self, sync: Sync) -> None:
        """``sync`` was launched: its own verdict is read later (:meth:`read_own`)."""
        self.unread.append(sync)

    def read_own(self, before: int | None = None, applied: Sync | None = None) -> None:
        """Read this rank's verdicts on its own contributions (decided on the device at launch)
        where reading them does not wait for the device: ``applied``, the sync whose
        collective the host has just waited for (which went out after its verdict), and those
        launched before inner step ``before`` (at a later sync point: its queue ran long ago);
        ``None``: every one (at ``finish()``). One that was not finite means this rank
        diverged: log it and recover its local state now, so that it trains correctly from the
        anchor while the poisoned average is on its way (every rank will skip it)."""
        if not self.unread:
            return
        unread: list[Sync] = []
        kept: list[Sync] = []
        for sync in self.unread:
            due = before is None or sync.step < before or sync is applied
            (unread if due else kept).append(sync)
        self.unread = kept
        for sync in unread:
            if sync.own_ok:
                continue
            fixed = self.recover_local()
            self.own_non_finite += 1
            log_repeated(
                self.own_non_finite,
                "%s: rank %d's own pseudo-gradient holds NaN or Inf at inner step %d; it goes "
                "back to the anchor (zeroed non-finite values in %d local state tensor(s))",
                type(self.engine).__name__,
                self.engine.comm.rank,
                sync.step,
                fixed,
            )

    def recover_local(self) -> int:
        """Zero the non-finite values of this rank's inner-optimizer state and error-feedback
        residuals (returns how many tensors had any); a rank whose parameters are not finite
        goes back to the anchors."""
        engine = self.engine
        fixed = zero_non_finite_(optimizer_state_tensors(engine.inner))
        fixed += sum(c.drop_non_finite() for c in engine.compressors())
        if not all_finite(engine.params):
            for frag in engine.fragments:
                frag.anchor.copy_to(frag.params)
        return fixed

    def drain(self) -> None:
        """Wait for every collective in flight (not applying it): before raising alike."""
        for frag in self.engine.fragments:
            for sync in frag.pending:
                sync.handle.wait()
