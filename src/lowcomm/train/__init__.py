"""The ``lowcomm train`` job: configuration, launcher, worker loop, metrics and report.

The names below are imported when first used: importing a module of the job (its run-folder
layout, :mod:`lowcomm.train.metrics`) loads nothing else."""

from typing import TYPE_CHECKING

from lowcomm.lazy import face

if TYPE_CHECKING:
    from lowcomm.train.config import ConfigError, TrainConfig
    from lowcomm.train.config_file import load_toml
    from lowcomm.train.launcher import WorkerFailed, launch

_FACE = {
    "ConfigError": "lowcomm.train.config",
    "TrainConfig": "lowcomm.train.config",
    "load_toml": "lowcomm.train.config_file",
    "WorkerFailed": "lowcomm.train.launcher",
    "launch": "lowcomm.train.launcher",
}

__all__ = ["ConfigError", "TrainConfig", "WorkerFailed", "launch", "load_toml"]


__getattr__, __dir__ = face(__name__, _FACE, globals())
