"""Reading a ``lowcomm train`` TOML file: flat keys (:func:`~lowcomm.train.config.config_keys`),
or a torchtitan file's ``[fault_tolerance]`` table where its keys mean what ours do."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

from lowcomm import torchtitan
from lowcomm.train.config import TrainConfig, config_from_dict
from lowcomm.train.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["load_toml", "read_toml"]

logger = logging.getLogger(__name__)


def read_toml(path: str) -> dict[str, Any]:
    """Read a flat TOML config file into a dict; unreadable or malformed files and tables raise
    :class:`ConfigError` (unknown keys are left to :func:`config_from_dict`).

    A torchtitan file (one with a ``[fault_tolerance]`` table) is understood where its keys mean
    what ours do (:mod:`lowcomm.torchtitan`: ``sync_steps``,
    ``fragment_sync_delay``, ``fragment_update_alpha``, ``num_fragments``,
    ``semi_sync_method``); its other tables and keys are ignored, with a warning naming them.
    torchtitan's names are also accepted as flat keys."""
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(None, f"config file {path!r} not found") from None
    except IsADirectoryError:
        raise ConfigError(None, f"config file {path!r} is a folder, not a file") from None
    except OSError as e:
        raise ConfigError(None, f"config file {path!r} cannot be read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(None, f"config file {path!r} is not valid TOML: {e}") from None
    section = values.pop(torchtitan.SECTION, None)
    from_section: dict[str, Any] = {}
    ignored: list[str] = []
    if isinstance(section, dict):
        try:
            from_section, ignored = torchtitan.from_torchtitan(section)
        except ValueError as e:
            raise ConfigError(None, f"{path}: {e}") from None
        ignored += [f"[{k}]" for k, v in values.items() if isinstance(v, dict)]
        values = {k: v for k, v in values.items() if not isinstance(v, dict)}
    elif section is not None:
        values[torchtitan.SECTION] = section  # not a table: refused below
    for key, value in values.items():
        if isinstance(value, (dict, list)):
            raise ConfigError(
                None,
                f"key {key!r} in {path} must be a single value, got {type(value).__name__}; "
                "config files are flat (no tables or arrays), except a torchtitan file's "
                f"[{torchtitan.SECTION}] table",
            )
    try:
        values = torchtitan.resolve_aliases(values, what=path)
        for key, value in from_section.items():
            if key in values and values[key] != value:
                raise ValueError(
                    f"{path} sets {key} = {values[key]!r} and, in [{torchtitan.SECTION}], "
                    f"{value!r}; keep one"
                )
            values[key] = value
    except ValueError as e:
        raise ConfigError(None, str(e)) from None
    if ignored:
        logger.warning(
            "%s: torchtitan settings without a lowcomm counterpart are ignored: %s",
            path,
            ", ".join(ignored),
        )
    return values


def load_toml(path: str, *, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the TOML file at ``path``, then ``overrides`` (e.g. command-line flags)."""
    values = read_toml(path)
    values.update(overrides or {})
    return config_from_dict(values, source=path)
