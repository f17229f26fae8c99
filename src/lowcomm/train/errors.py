"""Errors and value checks of the ``lowcomm train`` configuration."""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from typing import Any

from lowcomm.hparams import HyperparameterError

__all__ = [
    "ConfigError",
    "TrainingDiverged",
    "WorkerFailed",
    "check_float",
    "check_int",
    "check_string",
    "config_error",
]

# A ValueError from an algorithm class that is not ours may start with the keyword it is
# about ("outer_lr must be ..."); ours raise HyperparameterError, which carries it.
_LEADING_KEYWORD = re.compile(r"([A-Za-z_]\w*)(=\S+)?\s+(.*)", re.DOTALL)


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


def config_error(error: ValueError, keys: Collection[str]) -> ConfigError:
    """An algorithm's ``ValueError`` as a :class:`ConfigError` keyed by the keyword it is about,
    when that is one of ``keys`` (the configuration's): :class:`~lowcomm.hparams.
    HyperparameterError` carries it (``overlap``, problem ``"(12) must be ..."``); any other
    ``ValueError`` is keyed by the keyword its message starts with."""
    if isinstance(error, HyperparameterError):
        key, shown, problem = error.key, error.shown, error.problem
    else:
        match = _LEADING_KEYWORD.match(str(error))
        if match is None or match.group(1) not in keys:
            return ConfigError(None, str(error))
        key, value, problem = match.groups()
        shown = value[1:] if value else None
    if key is None or key not in keys:
        return ConfigError(None, str(error))
    if shown is not None:
        problem = f"({shown}) {problem}"
    if key == "clip":
        problem += "; or 'none' to disable clipping"
    return ConfigError(key, problem)
