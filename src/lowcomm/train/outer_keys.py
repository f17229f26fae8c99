"""The outer hyperparameters of the ``lowcomm train`` job, derived from the registry and the
algorithms' dataclasses: which keys each ``--algo`` takes, one :class:`~.config.TrainConfig`
field per key (its flag and TOML key), and its ``--help`` text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowcomm.hparams import public_fields
from lowcomm.outer.co2 import CO2
from lowcomm.outer.engine import OuterAlgorithm
from lowcomm.outer.hparams import ShardableConfig
from lowcomm.registry import REGISTRY, AlgorithmEntry

__all__ = [
    "ALL_OUTER_KEYS",
    "JOB_KEYS",
    "JOB_OUTER_DEFAULTS",
    "OUTER_FIELDS",
    "OUTER_KEYS",
    "outer_doc",
    "with_outer_fields",
]

JOB_KEYS = ("sync_every", "bucket_cap_mb")
"""Algorithm keywords that are fields of the job itself (every algorithm gets them)."""

JOB_OUTER_DEFAULTS: dict[type[OuterAlgorithm], dict[str, Any]] = {CO2: {"outer_lr": 0.5}}
"""Where this job's defaults differ from the library's, for the small GPT it trains (for an
algorithm and the names that run it with keywords fixed).

CO2 applies each round's average one round late. When local training moves the model far
within a round (as it does for this small GPT at a useful inner learning rate), the stale
update behaves like e(t+1) = e(t) - alpha * (beta * m + e(t-1)): marginally stable at alpha = 1,
beta = 0 and unstable for any beta > 0, which shows as a validation loss that rises and falls.
alpha = 0.5 is comfortably stable here. The library keeps the paper's alpha = 1.0, meant for
large models whose rounds move them little; the README explains the choice."""


def outer_fields(entry: AlgorithmEntry) -> list[dataclasses.Field[Any]]:
    """The job fields of ``entry``: its class's public hyperparameters but the job's own and
    those a registered name fixes (``eager``: ``--algo co2-eager``), the keywords common to
    every algorithm last."""
    if entry.cls is None:
        return []
    fixed = {k for e in REGISTRY.values() if e.cls is entry.cls for k in e.fixed}
    common = {f.name for f in dataclasses.fields(ShardableConfig)}
    keys = [f for f in public_fields(entry.cls.Config) if f.name not in (*JOB_KEYS, *fixed)]
    return sorted(keys, key=lambda f: f.name in common)


OUTER_KEYS: dict[str, tuple[str, ...]] = {
    name: ("compression",)
    if entry.cls is None and entry.compressible
    else tuple(f.name for f in outer_fields(entry))
    for name, entry in REGISTRY.items()
}
"""The outer-loop keywords each ``--algo`` takes (besides ``sync_every`` and ``bucket_cap_mb``),
from its algorithm's hyperparameter dataclass."""

OUTER_FIELDS: dict[str, dataclasses.Field[Any]] = {}
for _entry in REGISTRY.values():
    for _f in outer_fields(_entry):
        OUTER_FIELDS.setdefault(_f.name, _f)
ALL_OUTER_KEYS = tuple(OUTER_FIELDS)


def job_type(f: dataclasses.Field[Any]) -> str:
    """The annotation of a job field for an algorithm field (all may be None: unset)."""
    declared = f.metadata.get("job_type") or str(f.type)
    return declared if declared.endswith("None") else f"{declared} | None"


def with_outer_fields(cls: type) -> type:
    """Add a field, default ``None``, for every outer hyperparameter of the registered
    algorithms (:data:`OUTER_KEYS`), after ``weight_decay``: their flags and TOML keys."""
    annotations: dict[str, Any] = {}
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():
        annotations[name] = annotation
        if name == "weight_decay":
            for key, f in OUTER_FIELDS.items():
                annotations[key] = job_type(f)
                setattr(cls, key, None)
    cls.__annotations__ = annotations
    return cls


def outer_doc(key: str) -> str:
    """Help for an outer hyperparameter: its symbol and text from the algorithms' dataclasses
    and each algorithm's default (this job's where it differs)."""
    f = OUTER_FIELDS[key]
    symbol = f.metadata.get("symbol")
    text = f"{symbol}: {f.metadata['doc']}" if symbol else str(f.metadata["doc"])
    groups: dict[str, list[str]] = {}
    for name, entry in REGISTRY.items():
        if entry.cls is None or key not in OUTER_KEYS[name]:
            continue
        library = entry.cls.Config.field(key).default
        job = JOB_OUTER_DEFAULTS.get(entry.cls, {}).get(key, library)
        value = f"{job} in this job, library {library}" if job != library else f"{library}"
        groups.setdefault(value, []).append(name)
    defaults = "; ".join(f"{', '.join(algos)} {value}" for value, algos in groups.items())
    return f"{text} (default: {defaults})"
