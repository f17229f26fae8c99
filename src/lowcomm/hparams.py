"""Typed hyperparameters: frozen dataclasses whose fields carry their help text and check.

Each field is declared with :func:`hyper`: its default, the paper's symbol, a one-line help text
and a check. :class:`Hyperparameters` runs the checks in field order after construction, then the
cross-field rules of :meth:`Hyperparameters.check`. The outer algorithms' configurations
(:mod:`lowcomm.outer.hparams`) are built on it; signatures, docstrings, the consistency guard's
settings and ``lowcomm train``'s flags are derived from the fields.

A bad value raises :class:`HyperparameterError`, a ``ValueError`` that carries the offending
``key`` and the ``problem`` without it, so a caller can name its own flag or TOML key instead.

Example::

    @dataclass(frozen=True, kw_only=True)
    class Config(Hyperparameters):
        lr: float = hyper(0.1, doc="learning rate", check=check_positive_float(0.1))

    Config(lr=-1)      # HyperparameterError: lr must be a finite number > 0, got -1; ...
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HyperparameterError",
    "Hyperparameters",
    "check_bool",
    "check_choice",
    "check_momentum",
    "check_number",
    "check_optional",
    "check_positive_float",
    "check_positive_int",
    "describe",
    "field_docstrings",
    "hyper",
    "public_fields",
    "signature",
]

Check = Callable[[str, Any], None]


class HyperparameterError(ValueError):
    """A bad hyperparameter. ``key`` is the keyword (``None`` when several are involved);
    ``problem`` the message without it (``"must be in [0, 1), got 1.0"``); ``shown`` the value
    shown beside the key (``"overlap=4 must be < sync_every=4"``)."""

    def __init__(self, key: str | None, problem: str, *, shown: str | None = None) -> None:
        self.key, self.problem, self.shown = key, problem, shown
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
    out of the CLI's flags (callables, modules); ``job_type`` is the flag's type where it
    differs from the field's (a spec string for a codec object)."""
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


def check_choice(choices: tuple[str, ...]) -> Check:
    """A check that the value is one of ``choices``."""
    allowed = " or ".join(repr(c) for c in choices)

    def check(key: str, value: Any) -> None:
        if value not in choices:
            raise HyperparameterError(key, f"must be {allowed}, got {value!r}")

    return check


def check_optional(check: Check) -> Check:
    """``check`` for values that may also be ``None`` (``clip=None``: no clipping)."""

    def optional(key: str, value: Any) -> None:
        if value is not None:
            check(key, value)

    return optional


@dataclass(frozen=True, kw_only=True)
class Hyperparameters:
    """A frozen set of :func:`hyper` fields, checked on construction."""

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


def public_fields(config: type[Hyperparameters]) -> list[dataclasses.Field[Any]]:
    """The fields a CLI exposes as flags and TOML keys (those not declared ``job=False``)."""
    return [f for f in dataclasses.fields(config) if f.metadata.get("job", True)]


def describe(config: type[Hyperparameters], what: str = "its ``Config``") -> str:
    """The keyword list of a docstring, from the dataclass."""
    lines = ["", f"    Keywords ({what}):"]
    for f in dataclasses.fields(config):
        symbol = f" ({f.metadata['symbol']})" if f.metadata.get("symbol") else ""
        default = "required" if f.default is dataclasses.MISSING else f"default {f.default!r}"
        lines.append(f"        {f.name}{symbol}: {f.metadata['doc']} ({default}).")
    return "\n".join(lines)


def signature(
    config: type[Hyperparameters], positional: tuple[str, ...], trailing: dict[str, Any]
) -> inspect.Signature:
    """A constructor's signature: the ``positional`` parameters, the dataclass's fields as
    keywords, then the ``trailing`` keywords with their defaults."""
    kinds = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter(name, kinds[0]) for name in positional]
    for f in dataclasses.fields(config):
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        params.append(inspect.Parameter(f.name, kinds[1], default=default, annotation=f.type))
    params += [inspect.Parameter(k, kinds[1], default=v) for k, v in trailing.items()]
    return inspect.Signature(params)


def field_docstrings(cls: type) -> dict[str, str]:
    """The string under each field of the dataclass ``cls`` (its attribute docstring), on one
    line: what ``--help`` texts show."""
    return dict(_field_docstrings(cls))


@functools.cache
def _field_docstrings(cls: type) -> dict[str, str]:
    """:func:`field_docstrings`, read from the source once per class (every command line the
    CLI parses builds its parser from them)."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
