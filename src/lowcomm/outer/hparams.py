"""The outer algorithms' hyperparameters (typed fields: :mod:`lowcomm.hparams`): what every
algorithm takes (:class:`OuterConfig`), and what those that compress or shard add. Each
algorithm's ``Config`` extends one, e.g. ``CO2Config(outer_lr=-1)`` raises
``HyperparameterError: outer_lr must be a finite number > 0, ...``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lowcomm.comm import DEFAULT_BUCKET_CAP_MB
from lowcomm.compress.codecs import check_compression
from lowcomm.guard import check_nan_policy
from lowcomm.hparams import (
    HyperparameterError,
    Hyperparameters,
    check_bool,
    check_choice,
    check_momentum,
    check_number,
    check_positive_float,
    check_positive_int,
    hyper,
)
from lowcomm.outer.merge import MERGES

__all__ = [
    "LOCAL_STEPS",
    "OUTER_LR_SCHEDULES",
    "CompressionConfig",
    "OuterConfig",
    "ShardableConfig",
    "check_fragments",
    "check_overlap",
    "check_whole_rounds",
    "fragments",
    "merge",
    "num_fragments",
    "outer_lr",
    "outer_lr_schedule",
    "outer_momentum",
    "overlap",
]


LOCAL_STEPS = ("fixed", "dynamic")
"""``local_steps``: H inner steps per round on every rank, or steps by measured speed."""


@dataclass(frozen=True, kw_only=True)
class OuterConfig(Hyperparameters):
    """What every outer algorithm takes besides its own hyperparameters."""

    sync_every: int = hyper(doc="inner steps per round", symbol="H", check=check_positive_int(12))
    bucket_cap_mb: float = hyper(
        DEFAULT_BUCKET_CAP_MB,
        doc="size cap of one flat fp32 bucket, in MiB (one collective each)",
        check=check_positive_float(25.0),
        job=False,
    )
    nan_policy: str = hyper(
        "skip",
        doc="what an outer update whose averaged pseudo-gradient holds NaN or Inf does: skip "
        "(dropped alike on every rank, counted and logged) or raise (stop the run)",
        check=check_nan_policy,
    )
    check_consistency: bool = hyper(
        True,
        doc="compare the model and settings across ranks at the first step",
        check=check_bool,
        job=False,
    )
    sync_warmup: int = hyper(
        0,
        doc="synchronous warm start (post-local SGD): the first K inner steps are DDP's "
        "(gradients averaged before each, uncompressed), then the algorithm's own schedule; "
        "a multiple of sync_every",
        symbol="K",
        check=check_number(
            "must be an integer >= 0, got {value!r}; e.g. {key}=48", 0, integer=True
        ),
    )

    sync_warmup_compression: Any = hyper(
        None,
        doc="compress the warm start's gradient all-reduce, with error feedback: a codec spec "
        "such as int8 or bf16 (unset: fp32, DDP's exact mean)",
        check=check_compression,
        job_type="str | None",
    )

    local_steps: str = hyper(
        "fixed",
        doc="inner steps per round: fixed (H on every rank) or dynamic (each rank takes steps "
        "in proportion to its measured speed, the fastest H, so that rounds end together; "
        "pseudo-gradients weighted by the steps each rank took: lowcomm.outer.pace)",
        check=check_choice(LOCAL_STEPS),
    )

    def check(self) -> None:
        super().check()
        check_whole_rounds("sync_warmup", self.sync_warmup, self.sync_every)


@dataclass(frozen=True, kw_only=True)
class CompressionConfig(OuterConfig):
    """An algorithm whose pseudo-gradients may be compressed."""

    compression: Any = hyper(
        None,
        doc="compress what is communicated, with error feedback: a codec or a spec such as "
        "int4, int8:sr, bf16, topk:0.01, powersgd:4 or lgreco:powersgd (unset: fp32)",
        check=check_compression,
        job_type="str | None",
    )


@dataclass(frozen=True, kw_only=True)
class ShardableConfig(CompressionConfig):
    """An algorithm whose outer state may be sharded across the ranks."""

    def check(self) -> None:
        super().check()
        if self.shard_outer_state and self.compression is not None:
            raise HyperparameterError(
                "shard_outer_state",
                "cannot be combined with compression: a sharded sync reduce-scatters the "
                "parameters, and the codecs' error feedback needs every rank's own "
                "pseudo-gradient; drop one of them",
                shown="True",
            )

    shard_outer_state: bool = hyper(
        False,
        doc="keep 1/N of the outer state (anchor, momentum, outer optimizer) on each rank: "
        "reduce-scatter, update the owned chunk, all-gather",
        check=check_bool,
    )


def outer_lr(default: float, doc: str = "outer learning rate") -> Any:
    """The ``outer_lr`` (α) field with ``default``."""
    return hyper(default, doc=doc, symbol="α", check=check_positive_float(default))


OUTER_LR_SCHEDULES = ("constant", "inner")


def outer_lr_schedule() -> Any:
    """The ``outer_lr_schedule`` field: the outer lr constant, or following the inner one."""
    return hyper(
        "constant",
        doc="constant, or inner: α·γ/γ₀ at each outer step, γ the inner optimizer's current lr "
        "and γ₀ its initial_lr (as torch's LR schedulers set it; else the highest seen), so the "
        "outer step decays with the inner schedule",
        check=check_choice(OUTER_LR_SCHEDULES),
    )


def outer_momentum(default: float, doc: str = "outer momentum") -> Any:
    """The ``outer_momentum`` (β) field with ``default``."""
    return hyper(default, doc=doc, symbol="β", check=check_momentum)


def overlap(doc: str) -> Any:
    """The ``overlap`` (τ) field, default 0: inner steps a sync runs before it is applied."""
    return hyper(
        0,
        doc=doc,
        symbol="τ",
        check=check_number("must be an integer >= 0, got {value!r}", 0, integer=True),
    )


def merge() -> Any:
    """The ``merge`` field, default ``"reset"``: what a sync point does with the steps taken
    while its sync was in flight (:mod:`lowcomm.outer.merge`)."""
    return hyper(
        "reset",
        doc="at a sync point: reset (θ ← A; below full overlap the τ steps since the launch "
        "are dropped) or delay_corrected (θ ← A + (θ − θ_s), θ_s the parameters at the "
        "launch: that progress is kept; one more copy of the parameters)",
        check=check_choice(MERGES),
    )


def check_whole_rounds(key: str, steps: int, sync_every: int) -> None:
    """``steps`` (the value of ``key``) must be whole rounds of H = ``sync_every`` steps."""
    if steps % sync_every:
        example = sync_every * max(1, round(steps / sync_every))
        raise HyperparameterError(
            key,
            f"must be a multiple of sync_every={sync_every} (whole rounds); e.g. {example}",
            shown=str(steps),
        )


def check_overlap(sync_every: int, overlap: int | None, hint: str) -> None:
    """τ must be at most H (``hint``: what τ = H or an absent τ means for the algorithm)."""
    if overlap is not None and overlap > sync_every:
        raise HyperparameterError(
            "overlap", f"must be <= sync_every={sync_every} ({hint})", shown=str(overlap)
        )


def num_fragments() -> Any:
    """The ``num_fragments`` (P) field, default 1."""
    return hyper(
        1,
        doc="fragments, transformer blocks strided across them; sync_every must be a multiple",
        symbol="P",
        check=check_positive_int(4),
    )


def fragments() -> Any:
    """The ``fragments`` field: explicit fragments (library only)."""
    return hyper(
        None,
        doc="explicit fragments: modules or parameter lists holding every parameter once",
        job=False,
    )


def check_fragments(sync_every: int, num_fragments: int) -> None:
    """H must be a multiple of P (a sync point every H/P steps)."""
    h, p = sync_every, num_fragments
    if h % p:
        raise HyperparameterError(
            "sync_every",
            f"must be a multiple of num_fragments={p} (a sync point every H/P steps); e.g. "
            f"sync_every={p * max(1, round(h / p))}",
            shown=str(h),
        )
