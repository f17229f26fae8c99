"""The ``lowcomm train`` job: configuration, launcher, worker loop, metrics and report."""

from lowcomm.train.config import ConfigError, TrainConfig, load_toml
from lowcomm.train.launcher import WorkerFailed, launch

__all__ = ["ConfigError", "TrainConfig", "WorkerFailed", "launch", "load_toml"]
