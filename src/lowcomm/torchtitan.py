"""torchtitan's and torchft's configuration keys, understood where they mean what ours do.

torchtitan configures Streaming DiLoCo (run by torchft) in the ``[fault_tolerance]`` table of its
TOML files. Four of its keys are lowcomm keywords under another name:

==========================  ================  =================================================
torchtitan / torchft        lowcomm           meaning
==========================  ================  =================================================
``sync_steps``              ``sync_every``    H, inner steps per round
``fragment_sync_delay``     ``overlap``       τ, steps a fragment's all-reduce runs before use
``fragment_update_alpha``   ``mix``           θ ← (1 − α)·A + α·θ at a fragment's sync
``num_fragments``           ``num_fragments`` P, fragments synced in turn
==========================  ================  =================================================

and ``semi_sync_method`` names the algorithm: ``"diloco"`` is torchft's DiLoCo, which is
Streaming DiLoCo (``streaming`` here, or ``diloco`` when it has one fragment and no delay), and
``"local_sgd"`` is ``localsgd``. Everything else in such a file (replica groups, quantization,
the model, optimizer and job tables) has no lowcomm counterpart that means the same and is
reported as ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ALIASES", "METHODS", "SECTION", "from_torchtitan", "resolve_aliases"]

SECTION = "fault_tolerance"
"""The torchtitan table lowcomm reads."""

ALIASES: Mapping[str, str] = {
    "sync_steps": "sync_every",
    "fragment_sync_delay": "overlap",
    "fragment_update_alpha": "mix",
    "num_fragments": "num_fragments",
}
"""torchtitan/torchft key → lowcomm key (same meaning)."""

METHODS: Mapping[str, str] = {"diloco": "streaming", "local_sgd": "localsgd"}
"""``semi_sync_method`` → lowcomm algorithm (``diloco`` with one fragment and no delay: see
:func:`from_torchtitan`)."""


def resolve_aliases(values: Mapping[str, Any], *, what: str = "settings") -> dict[str, Any]:
    """``values`` with every torchtitan key of :data:`ALIASES` renamed to lowcomm's. A key given
    under both names with different values raises ``ValueError`` naming both."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        ours = ALIASES.get(key, key)
        if ours in out and out[ours] != value:
            theirs = next(k for k, v in ALIASES.items() if v == ours)
            raise ValueError(
                f"{what} set {ours} twice, as {ours!r} and as torchtitan's {theirs!r}, to "
                f"different values ({out[ours]!r} and {value!r}); keep one"
            )
        out[ours] = value
    return out


def from_torchtitan(section: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """lowcomm keys from a torchtitan ``[fault_tolerance]`` table: ``(values, ignored)``, the
    keys with a counterpart renamed (and ``algo`` from ``semi_sync_method``), and the names of
    those without one."""
    values: dict[str, Any] = {}
    ignored: list[str] = []
    for key, value in section.items():
        if key in ALIASES:
            values[ALIASES[key]] = value
        elif key == "semi_sync_method":
            if value is None:
                continue
            if value not in METHODS:
                raise ValueError(
                    f"[{SECTION}] semi_sync_method = {value!r} has no lowcomm counterpart; "
                    f"use one of {', '.join(repr(m) for m in METHODS)}, or set algo instead"
                )
            values["algo"] = METHODS[value]
        else:
            ignored.append(f"{SECTION}.{key}")
    if values.get("algo") == "streaming":
        one = values.get("num_fragments", 1) == 1 and values.get("overlap", 0) == 0
        plain = values.get("mix", 0.0) == 0.0
        if one and plain:
            values["algo"] = "diloco"  # torchft's DiLoCo with one fragment, no delay, no mix
            for key in ("num_fragments", "overlap", "mix"):
                values.pop(key, None)
    return values, ignored
