"""Typed hyperparameters of the outer algorithms: one frozen dataclass per algorithm.

Each field is declared with :func:`hyper`: its default, the paper's symbol, a one-line help text
and a check. The dataclass's ``__post_init__`` runs the checks in field order and then the
cross-field rules of the algorithm (:meth:`OuterConfig.check`). Everything else is derived
from the dataclass: the algorithm's constructor signature, the settings the consistency guard
compares, the ``lowcomm train`` flags and TOML keys, and the reference's defaults.

A bad value raises :class:`HyperparameterError`, a ``ValueError`` that carries the offending
``key`` and the ``problem`` without it, so a caller can name its own flag or TOML key instead.

Example::

    CO2Config(sync_every=12, outer_lr=0.5)        # checked
    CO2Config(outer_lr=-1)                        # HyperparameterError: outer_lr must be ...
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lowcomm.comm import DEFAULT_BUCKET_CAP_MB
from lowcomm.compress.codecs import parse_compression
from lowcomm.guard import NAN_POLICIES

__all__ = [
    "HyperparameterError",
    "OuterConfig",
    "check_bool",
    "check_momentum",
    "check_number",
    "check_optional",
    "check_positive_float",
    "check_positive_int",
    "describe",
    "hyper",
    "outer_lr",
    "outer_momentum",
    "signature",
    "public_fields",
]

Check = Callable[[str, Any], None]


class HyperparameterError(ValueError):
    """A bad hyperparameter. ``key`` is the keyword (``None`` when several are involved);
    ``problem`` the message without it (``"must be in [0, 1), got 1.0"``)."""

    def __init__(self, key: str | None, problem: str, *, shown: str | None = None) -> None:
        self.key = key
        self.problem = problem
        # "overlap=4 must be < sync_every=4": the value shown beside the key
        self.shown = shown
        head = key if shown is None or key is None else f"{key}={shown}"
        super().__init__(f"{head} {problem}" if head else problem)


def hyper(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    symbol: str = "",
    check: Check | None = None,
    job: bool = True,
    job_type: str | None = None,
) -> Any:
    """A hyperparameter field: ``doc`` is its help text, ``symbol`` the paper's (H, α, β, φ,
    τ, λ₀), ``check(key, value)`` raises :class:`HyperparameterError`; ``job=False`` keeps it
    out of ``lowcomm train``'s flags (callables, modules); ``job_type`` is the flag's type
    where it differs from the field's (a spec string for a codec object)."""
    meta = {"doc": doc, "symbol": symbol, "check": check, "job": job, "job_type": job_type}
    return dataclasses.field(default=default, metadata=meta)


def check_number(
    message: str,
    low: float,
    high: float = math.inf,
    *,
    integer: bool = False,
    open_low: bool = False,
    open_high: bool = True,
) -> Check:
    """A check that the value is a finite (``integer``) number in the range; ``message`` is
    formatted with ``key`` and ``value``."""

    def check(key: str, value: Any) -> None:
        kind = numbers.Integral if integer else numbers.Real
        ok = not isinstance(value, bool) and isinstance(value, kind)
        if ok:
            # integers compare exactly (however large); other numbers must be finite floats
            x: Any = int(value) if isinstance(value, numbers.Integral) else float(value)
            ok = isinstance(x, int) or math.isfinite(x)
            ok = ok and (low < x if open_low else low <= x)
            ok = ok and (x < high if open_high else x <= high)
        if not ok:
            raise HyperparameterError(key, message.format(key=key, value=value))

    return check


def check_positive_int(example: int) -> Check:
    return check_number(
        f"must be a positive integer, got {{value!r}}; e.g. {{key}}={example}", 1, integer=True
    )


def check_positive_float(example: float) -> Check:
    return check_number(
        f"must be a finite number > 0, got {{value!r}}; e.g. {{key}}={example}", 0, open_low=True
    )


check_momentum = check_number("must be in [0, 1), got {value!r}; e.g. {key}=0.9", 0, 1)


def check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise HyperparameterError(key, f"must be True or False, got {value!r}")


def check_optional(check: Check) -> Check:
    """``check`` for values that may also be ``None`` (``clip=None``: no clipping)."""

    def optional(key: str, value: Any) -> None:
        if value is not None:
            check(key, value)

    return optional


def _check_nan_policy(key: str, value: Any) -> None:
    if value not in NAN_POLICIES:
        raise HyperparameterError(
            key,
            f"must be 'skip' or 'raise', got {value!r}; 'skip' drops an outer update whose "
            "average holds NaN/Inf, 'raise' stops the run",
        )


def _check_compression(key: str, value: Any) -> None:
    if value is not None:
        try:
            parse_compression(value)
        except ValueError as e:
            message = str(e)
            if message.startswith(f"{key} "):
                raise HyperparameterError(key, message.removeprefix(f"{key} ")) from None
            raise HyperparameterError(None, message) from None


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
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
        check=_check_nan_policy,
    )
    check_consistency: bool = hyper(
        True,
        doc="compare the model and settings across ranks at the first step",
        check=check_bool,
        job=False,
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                check(f.name, getattr(self, f.name))
        self.check()

    def check(self) -> None:
        """Cross-field rules (subclasses extend it); single fields are checked before."""

    @classmethod
    def field(cls, name: str) -> dataclasses.Field[Any]:
        return {f.name: f for f in dataclasses.fields(cls)}[name]


@dataclass(frozen=True, kw_only=True)
class CompressionConfig(OuterConfig):
    """An algorithm whose pseudo-gradients may be compressed."""

    compression: Any = hyper(
        None,
        doc="compress what is communicated, with error feedback: a codec or a spec such as "
        "int4, int8:sr, bf16, topk:0.01, powersgd:4 or lgreco:powersgd (unset: fp32)",
        check=_check_compression,
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


def outer_momentum(default: float, doc: str = "outer momentum") -> Any:
    """The ``outer_momentum`` (β) field with ``default``."""
    return hyper(default, doc=doc, symbol="β", check=check_momentum)


def public_fields(config: type[OuterConfig]) -> list[dataclasses.Field[Any]]:
    """The fields ``lowcomm train`` exposes as flags and TOML keys (not callables, modules, or
    the engine's own ``bucket_cap_mb`` and ``check_consistency``)."""
    return [f for f in dataclasses.fields(config) if f.metadata.get("job", True)]


def describe(config: type[OuterConfig]) -> str:
    """The keyword list of an algorithm's docstring, from its dataclass."""
    lines = ["", "    Keywords (its ``Config``; and ``process_group``, ``None`` for WORLD):"]
    for f in dataclasses.fields(config):
        symbol = f" ({f.metadata['symbol']})" if f.metadata.get("symbol") else ""
        default = "required" if f.default is dataclasses.MISSING else f"default {f.default!r}"
        lines.append(f"        {f.name}{symbol}: {f.metadata['doc']} ({default}).")
    return "\n".join(lines)


def signature(config: type[OuterConfig]) -> inspect.Signature:
    """The constructor's signature, from the hyperparameter dataclass."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter("model_or_params", positional),
        inspect.Parameter("inner_optimizer", positional),
    ]
    for f in dataclasses.fields(config):
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        params.append(inspect.Parameter(f.name, keyword, default=default, annotation=f.type))
    params.append(inspect.Parameter("process_group", keyword, default=None))
    return inspect.Signature(params)
