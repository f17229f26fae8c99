"""An algorithm of the benchmarks with job settings of its own: ``co2+int4`` (compression) and
``co2/overlap=12/sync_warmup=0`` (any ``lowcomm train`` setting), so that variants sit side by
side in one run of ``lowcomm bench`` or its convergence harness.

Example::

    algo_fields("co2+int8/outer_lr=0.3")   # {'algo': 'co2', 'compression': 'int8', 'outer_lr': 0.3}
"""

from __future__ import annotations

import ast
from typing import Any

__all__ = ["algo_fields"]


def algo_fields(algo: str) -> dict[str, Any]:
    """``"co2/outer_lr=0.3/eager=True"`` -> ``{"algo": "co2", "outer_lr": 0.3, "eager": True}``
    (values as Python literals where they parse, ``true``/``false`` as TOML spells them, else
    strings); ``+CODEC`` sets compression.

    Raises:
        ValueError: a setting that is not ``KEY=VALUE``.
    """
    name, *settings = algo.split("/")
    base, plus, codec = name.partition("+")
    out: dict[str, Any] = {"algo": base.strip()}
    if plus:
        out["compression"] = codec
    for item in filter(None, (s.strip() for s in settings)):
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(
                f"algos: {algo!r} has a setting {item!r} that is not KEY=VALUE; e.g. "
                "co2/outer_lr=0.3/outer_momentum=0.0"
            )
        text = text.strip()
        value: Any
        if text in ("true", "false"):
            value = text == "true"
        else:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text
        out[key.strip().replace("-", "_")] = value
    return out
