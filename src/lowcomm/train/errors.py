"""Errors and value checks of the ``lowcomm train`` configuration."""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "ConfigError",
    "TrainingDiverged",
    "WorkerFailed",
    "check_float",
    "check_int",
    "check_string",
]


class ConfigError(ValueError):
    """A bad configuration value. ``key`` is the field name (``None`` when several are involved);
    ``problem`` is the message without the key, so the CLI can name the flag or TOML key instead.
    """

    def __init__(self, key: str | None, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"{key} {problem}" if key else problem)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message names the step and the fix (the command
    line's exit code 3)."""


class WorkerFailed(RuntimeError):
    """A worker process failed.

    Attributes:
        rank: its global rank.
        error: its error, one line (``"ValueError: ..."``).
        traceback_path: a file holding the worker's traceback, when one could be written.
        errno: the ``errno`` of the worker's ``OSError`` (a full disk: ``ENOSPC``), if it was one.
        bad_input: whether the worker refused something it was given (its error was a
            ``ValueError``: a damaged or unsafe checkpoint file, a setting only the worker could
            check), which the command line reports as a bad input (exit code 2), not a crash.
    """

    def __init__(
        self,
        rank: int,
        error: str,
        traceback_path: str | None = None,
        *,
        errno: int | None = None,
        bad_input: bool = False,
    ) -> None:
        self.rank = rank
        self.error = error
        self.traceback_path = traceback_path
        self.errno = errno
        self.bad_input = bad_input
        super().__init__(f"worker rank {rank} failed: {error}")


def check_string(key: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(key, f"must be a non-empty string, got {value!r}")


def check_int(key: str, value: Any, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"must be an integer, got {value!r}")
    if value < low:
        raise ConfigError(key, f"must be >= {low}, got {value}")


def check_float(
    key: str, value: Any, *, low: float, low_open: bool = False, hint: str = ""
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, f"must be a number, got {value!r}")
    bad = not math.isfinite(value) or (value <= low if low_open else value < low)
    if bad:
        op = ">" if low_open else ">="
        extra = f" {hint}" if hint else ""
        raise ConfigError(key, f"must be a finite number {op} {low:g}{extra}, got {value}")
