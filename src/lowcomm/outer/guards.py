"""The two guards of every outer algorithm (a base of the engine; checks in :mod:`lowcomm.guard`).

**Consistency at start**: at the first ``step()`` the ranks compare the model as built (names,
shapes, dtypes, a checksum; not the values after ``load_state_dict()``) and the settings, and
fail alike naming the first difference. **Numeric guard**: an average holding NaN or Inf
(bit-identical on every rank, so decided alike) skips that update, counted in
``skipped_updates`` and logged; every rank zeroes the non-finite values of its inner-optimizer
state and residuals and, if diverged, goes back to the anchor (a rank whose own contribution is
not finite at launch does so at once). ``nan_policy="raise"`` raises instead.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lowcomm.compress.feedback import Compressor
from lowcomm.guard import (
    Description,
    NonFiniteError,
    all_finite,
    check_same_across_ranks,
    optimizer_settings,
    optimizer_state_tensors,
    zero_non_finite_,
)
from lowcomm.outer.fragment import AnyFragment, Sync
from lowcomm.outer.hparams import ShardableConfig

if TYPE_CHECKING:
    from lowcomm.comm import Communicator
    from lowcomm.compress.codecs import Codec
    from lowcomm.compress.lgreco import LGreCo
    from lowcomm.outer.hparams import OuterConfig

__all__ = ["Guards", "log_repeated"]

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


class Guards:
    """Consistency at start and the numeric guard, over the engine's state."""

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
    skipped_updates: int
    _own_non_finite: int
    _unread_own: list[Sync]
    _unchecked: Description | None

    # -- guards --------------------------------------------------------------------------------

    def _settings(self) -> dict[str, Any]:
        """The settings every rank must share: the common keywords, the optimizers, then the
        algorithm's own (a different DiLoCo ``outer_lr`` is named as its optimizer's lr)."""
        common = {f.name for f in dataclasses.fields(ShardableConfig)}
        fields = [f.name for f in dataclasses.fields(self.config) if f.name not in _NOT_COMPARED]
        settings: dict[str, Any] = {"algorithm": self.name}
        settings.update({k: self._setting(k) for k in fields if k in common})
        settings.update(optimizer_settings("inner optimizer", self.inner))
        outer = self.fragments[0].outer
        settings.update({} if outer is None else outer.settings())
        settings.update({k: self._setting(k) for k in fields if k not in common})
        settings["fragment sizes"] = [frag.numel for frag in self.fragments]
        settings["overlap"] = self.overlap
        return settings

    def _setting(self, key: str) -> Any:
        if key == "compression":  # a codec object compares by its spec
            return None if self.compression is None else self.compression.spec
        return getattr(self.config, key)

    def _check_consistency(self) -> None:
        model, self._unchecked = self._unchecked, None
        assert model is not None
        settings = [(f"setting {k}", repr(v)) for k, v in self._settings().items()]
        check_same_across_ranks(
            model + settings,
            what=f"{type(self).__name__} inputs",
            hint="every rank must build the same model from the same seed (or load the same "
            "weights) and pass the same settings, before training starts",
            process_group=self.comm.group,
        )

    def _on_non_finite(self, frag: AnyFragment, sync: Sync) -> None:
        """The average of ``sync`` holds NaN or Inf (decided alike on every rank)."""
        self._skip(sync.label)

    def _skip(self, what: str) -> None:
        """Count a skipped update, then raise (``nan_policy="raise"``) or recover this rank
        (:meth:`_recover_local`) and log."""
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
        if self.comm.rank == 0:  # the same event on every rank: told once
            log_repeated(
                self.skipped_updates,
                "%s: update skipped alike on every rank (%d skipped so far)%s",
                message,
                self.skipped_updates,
                f"; zeroed non-finite values in {fixed} local state tensor(s)" if fixed else "",
            )

    def _read_own(self, before: int | None = None, applied: Sync | None = None) -> None:
        """Read this rank's verdicts on its own contributions (decided on the device at launch)
        where reading them does not wait for the device: ``applied``, the sync whose
        collective the host has just waited for (which went out after its verdict), and those
        launched before inner step ``before`` (at a later sync point: its queue ran long ago);
        ``None``: every one (at :meth:`finish`). One that was not finite means this rank
        diverged: log it and recover its local state now, so that it trains correctly from the
        anchor while the poisoned average is on its way (every rank will skip it)."""
        unread: list[Sync] = []
        kept: list[Sync] = []
        for sync in self._unread_own:
            due = before is None or sync.step < before or sync is applied
            (unread if due else kept).append(sync)
        self._unread_own = kept
        for sync in unread:
            if sync.own_ok:
                continue
            fixed = self._recover_local()
            self._own_non_finite += 1
            log_repeated(
                self._own_non_finite,
                "%s: rank %d's own pseudo-gradient holds NaN or Inf at inner step %d; it goes "
                "back to the anchor (zeroed non-finite values in %d local state tensor(s))",
                type(self).__name__,
                self.comm.rank,
                sync.step,
                fixed,
            )

    def _recover_local(self) -> int:
        """Zero the non-finite values of this rank's inner-optimizer state and error-feedback
        residuals (returns how many tensors had any); a rank whose parameters are not finite
        goes back to the anchors."""
        fixed = zero_non_finite_(optimizer_state_tensors(self.inner))
        fixed += sum(c.drop_non_finite() for c in self._compressors())
        if not all_finite(self.params):
            for frag in self.fragments:
                frag.anchor.copy_to(frag.params)
        return fixed

    def _compressors(self) -> list[Compressor]:
        return [f.compressor for f in self.fragments if f.compressor is not None]

    def _drain(self) -> None:
        """Wait for every collective in flight (not applying it): before raising alike."""
        for frag in self.fragments:
            for sync in frag.pending:
                sync.handle.wait()
