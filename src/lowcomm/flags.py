"""Command-line flags from a dataclass: every field is one flag (``sync_every`` ->
``--sync-every``), its docstring or ``doc`` the help text, its annotation the type, so that a
command's flags are declared once, the way ``lowcomm train``'s come from its configuration.

Example::

    @dataclass(kw_only=True)
    class Flags:
        steps: int | None = flag(None, doc="inner steps per worker", metavar="N")
        quick: bool = flag(False, doc="the small matrix")

    add_flags(parser, fields_of(Flags))

Every flag is ``argparse.SUPPRESS``-ed unless given, so the namespace holds only what was
typed; a ``bool`` field is a switch (``--quick``; ``negatable=True``: also ``--no-quick``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from lowcomm.hparams import field_docstrings

__all__ = ["Flag", "add_flags", "flag", "flag_name", "fields_of"]


def flag(
    default: Any = None,
    *,
    doc: str = "",
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    negatable: bool = False,
    repeat: bool = False,
    choices: Iterable[str] | None = None,
    keep_default: bool = False,
) -> Any:
    """A dataclass field that is one flag: ``doc`` its help (else the docstring under the
    field), ``metavar`` its value's name, ``parse`` the function from the text to the value
    (else the annotation's type), ``negatable`` a switch with a ``--no-`` form, ``repeat`` a
    flag given several times (its values collected in a list), ``choices`` the values it
    takes; ``keep_default``: the namespace holds the default when the flag is not given
    (else it holds only the flags given)."""
    meta = {
        "doc": doc,
        "metavar": metavar,
        "parse": parse,
        "negatable": negatable,
        "repeat": repeat,
        "choices": tuple(choices) if choices is not None else None,
        "keep_default": keep_default,
    }
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Flag:
    """One flag: its key (the namespace's attribute), annotation, default and help, and how
    its value is read."""

    key: str
    annotation: str
    default: Any = None
    doc: str = ""
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    negatable: bool = False
    repeat: bool = False
    choices: tuple[str, ...] | None = None
    const: Any = None
    """The value of the flag given without one (``--resume`` alone: ``latest``)."""
    show_default: bool = True
    keep_default: bool = False


def flag_name(key: str) -> str:
    """The flag of a key (``sync_every``: ``--sync-every``)."""
    return "--" + key.replace("_", "-")


def fields_of(
    cls: type,
    *,
    skip: Iterable[str] = (),
    negatable: bool = False,
    show_defaults: bool = True,
) -> list[Flag]:
    """A :class:`Flag` per init field of the dataclass ``cls`` (less ``skip``), in order;
    ``negatable``: switches without a ``flag()`` of their own get a ``--no-`` form;
    ``show_defaults``: the help texts end with the defaults (not ``None``)."""
    docs = field_docstrings(cls)
    skipped = set(skip)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name in skipped:
            continue
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append(
            Flag(
                key=f.name,
                annotation=str(f.type),
                default=default,
                doc=meta.get("doc") or docs.get(f.name, ""),
                metavar=meta.get("metavar"),
                parse=meta.get("parse"),
                negatable=bool(meta.get("negatable", negatable)),
                repeat=bool(meta.get("repeat", False)),
                choices=meta.get("choices"),
                show_default=show_defaults,
                keep_default=bool(meta.get("keep_default", False)),
            )
        )
    return out


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    """Add one argument per flag to ``parser`` (values given only: ``SUPPRESS``)."""
    for f in flags:
        text = f.doc
        if f.show_default and f.default is not None:
            text += f" (default: {f.default})"
        default = f.default if f.keep_default else argparse.SUPPRESS
        kwargs: dict[str, Any] = {"help": text.replace("%", "%%"), "default": default}
        if f.annotation.startswith("bool"):
            negatable = f.negatable
            kwargs["action"] = argparse.BooleanOptionalAction if negatable else "store_true"
        else:
            if f.parse is not None:
                kwargs["type"] = f.parse
            elif f.annotation.startswith("int"):
                kwargs["type"] = int
            elif f.annotation.startswith("float"):
                kwargs["type"] = float
            else:
                kwargs["type"] = str
            if f.metavar is not None or f.choices is None:  # (choices name themselves)
                kwargs["metavar"] = f.metavar or {int: "N", float: "X"}.get(kwargs["type"], "TEXT")
            if f.repeat:
                kwargs["action"] = "append"
            if f.choices is not None:
                kwargs["choices"] = f.choices
            if f.const is not None:
                kwargs["nargs"] = "?"
                kwargs["const"] = f.const
        parser.add_argument(flag_name(f.key), dest=f.key, **kwargs)
