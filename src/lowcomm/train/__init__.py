"""The ``lowcomm train`` job: configuration, launcher, worker loop, metrics and report.

The names below are imported when first used: importing a module of the job (its run-folder
layout, :mod:`lowcomm.train.metrics`) loads nothing else."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lowcomm.train.config import ConfigError, TrainConfig, load_toml
    from lowcomm.train.launcher import WorkerFailed, launch

_FACE = {
    "ConfigError": "lowcomm.train.config",
    "TrainConfig": "lowcomm.train.config",
    "load_toml": "lowcomm.train.config",
    "WorkerFailed": "lowcomm.train.launcher",
    "launch": "lowcomm.train.launcher",
}

__all__ = ["ConfigError", "TrainConfig", "WorkerFailed", "launch", "load_toml"]


def __getattr__(name: str) -> Any:
    where = _FACE.get(name)
    if where is None:
        raise AttributeError(f"module 'lowcomm.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_FACE})
