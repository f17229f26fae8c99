"""Griffe extension for the API reference: the outer algorithms' signatures and keyword lists.

Each outer algorithm's constructor signature and the list of its keywords are generated from its
hyperparameter dataclass when the class is created (``OuterAlgorithm.__init_subclass__``), so a
static reading of the source sees only ``**hyperparameters``. For every class that the engine
gave a generated ``__signature__``, this replaces the documented ``__init__`` parameters by the
runtime signature and turns the runtime keyword list into a Markdown list.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import griffe

_KIND = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}


def _runtime(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _keywords_as_list(doc: str) -> str:
    """``Keywords (...):`` followed by indented ``name (sym): text`` lines -> a Markdown list."""
    head, sep, rest = doc.partition("\nKeywords (")
    if not sep:
        return doc
    title, _, body = rest.partition(":\n")
    items = []
    for line in body.splitlines():
        m = re.match(r"\s+(\w+)( \([^)]*\))?: (.*)", line)
        if m:
            items.append(f"- `{m.group(1)}`{m.group(2) or ''}: {m.group(3)}")
        elif items and line.strip():
            items[-1] += " " + line.strip()
    title = re.sub(r"``([^`]+)``", r"`\1`", title)
    return f"{head}\n\n**Keywords** ({title}:\n\n" + "\n".join(items) + "\n"


class RuntimeOuterDocs(griffe.Extension):
    def on_class(self, *, cls: griffe.Class, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        obj = _runtime(cls.path)
        sig = getattr(obj, "__signature__", None) if obj is not None else None
        if not isinstance(sig, inspect.Signature) or "__init__" not in cls.all_members:
            return
        params = griffe.Parameters(
            *(
                griffe.Parameter(
                    p.name,
                    annotation=None if p.annotation is p.empty else str(p.annotation),
                    kind=_KIND[p.kind],
                    default=None if p.default is p.empty else repr(p.default),
                )
                for p in sig.parameters.values()
            )
        )
        init = griffe.Function("__init__", parameters=params, parent=cls)
        cls.set_member("__init__", init)
        if obj.__doc__ and cls.docstring is not None:
            cls.docstring.value = _keywords_as_list(inspect.cleandoc(obj.__doc__))
