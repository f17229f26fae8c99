"""The ``lowcomm train`` configuration: one typed dataclass, filled from defaults, a TOML file and
command-line flags (in that order of precedence, lowest first).

Every field has a flag of the same name with dashes (``sync_every`` -> ``--sync-every``) and the
same key in a TOML file (flat, no tables)::

    # co2.toml
    algo = "co2"
    steps = 600
    sync_every = 12
    outer_momentum = 0.5
    clip = "none"            # disable outer momentum clipping

The outer-loop hyperparameters default to ``None``, meaning "the algorithm's own default"; only the
ones the user set are passed to the algorithm, and only when they apply to it (``--clip`` means
nothing to DiLoCo: it is ignored with a warning, and not checked). Bad values raise
:class:`ConfigError`, a ``ValueError`` that names the key, the value and the fix.

The algorithms check their own keywords (``ALGORITHMS[name].validate``); this module only does what
they cannot: the fields of the job itself, the spelling ``clip = "none"`` (no clipping), routing
each outer key to the algorithms it applies to, checks that need the job's other settings
(automatic fragments need enough transformer blocks; SlowMo needs an inner learning rate > 0),
and the node layout: ``workers``, ``nodes`` (K) and ``procs_per_node`` (M) are resolved from
each other (one node is the flat layout, ``workers`` processes; with K > 1, ``workers`` is
K x M, and a ``workers`` that disagrees is refused).

Example::

    cfg = TrainConfig(algo="diloco", steps=300, outer_lr=0.7)
    cfg = load_toml("co2.toml", overrides={"steps": 100})
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lowcomm import torchtitan
from lowcomm.hparams import HyperparameterError, field_docstrings
from lowcomm.outer.diloco import SlowMo
from lowcomm.outer.engine import OuterAlgorithm
from lowcomm.registry import REGISTRY
from lowcomm.train.checks import ConfigChecks
from lowcomm.train.errors import ConfigError, check_float, check_int, check_string
from lowcomm.train.fields import (
    ALGORITHM_CHOICES,
    DEFAULT_WORKERS,
    DEVICES,
    NO_OUTER_ALGORITHM,
    NODE_SHARDING,
    OPTIMIZERS,
    PRECISIONS,
    TrainFields,
)
from lowcomm.train.outer_keys import (
    ALL_OUTER_KEYS,
    OUTER_KEYS,
    job_outer_defaults,
    outer_doc,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "ALGORITHM_CHOICES",
    "DEFAULT_WORKERS",
    "FASTEST_STEP_S",
    "MAX_STEPS",
    "NO_OUTER_ALGORITHM",
    "OPTIMIZERS",
    "OUTER_KEYS",
    "NODE_SHARDING",
    "PRECISIONS",
    "ConfigError",
    "TrainConfig",
    "config_from_dict",
    "load_toml",
]

logger = logging.getLogger(__name__)

FASTEST_STEP_S = 1e-3
"""A lower bound on one training step's time on any device (PyTorch launches dozens of kernels
per step): what :data:`MAX_STEPS` is derived from."""
MAX_STEPS = 31_557_600_000
"""The most ``steps`` a job accepts: a year of steps at :data:`FASTEST_STEP_S`."""

_BACKENDS = ("auto", "gloo", "nccl")
_LR_SCHEDULES = ("cosine", "constant")
# A ValueError from an algorithm class that is not ours may start with the keyword it is
# about ("outer_lr must be ..."); ours raise HyperparameterError, which carries it.
_LEADING_KEYWORD = re.compile(r"([A-Za-z_]\w*)(=\S+)?\s+(.*)", re.DOTALL)


@dataclass(kw_only=True)
class TrainConfig(ConfigChecks):
    """Everything ``lowcomm train`` needs; see the module docstring for how it is filled. Its
    fields are :class:`~lowcomm.train.fields.TrainFields`'s, its checks
    :class:`~lowcomm.train.checks.ConfigChecks`'."""

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHM_CHOICES:
            raise ConfigError(
                "algo", f"must be one of {', '.join(ALGORITHM_CHOICES)}, got {self.algo!r}"
            )
        self._check_layout()
        if self.link is not None:
            from lowcomm.link import EmulatedLink

            try:
                EmulatedLink.parse(str(self.link))
            except ValueError as e:
                raise ConfigError("link", str(e).removeprefix("link ")) from None
        if self.tune_link not in ("auto", "measure", "off"):
            from lowcomm.link import EmulatedLink

            try:
                EmulatedLink.parse(str(self.tune_link))
            except ValueError as e:
                raise ConfigError(
                    "tune_link",
                    f"must be auto, measure, off or a link profile: {str(e).removeprefix('link ')}",
                ) from None
        for key in ("workers", "steps", "sync_every", "batch_size", "block_size"):
            check_int(key, getattr(self, key), low=1)
        for key in ("n_layer", "n_head", "n_embd", "eval_every", "eval_batches", "log_every"):
            check_int(key, getattr(self, key), low=1)
        if self.steps > MAX_STEPS:
            years = self.steps * FASTEST_STEP_S / (365.25 * 86400)
            raise ConfigError(
                "steps",
                f"({self.steps:,}) cannot be reached: even at {FASTEST_STEP_S * 1e3:g} ms per "
                f"step, faster than any device runs a training step, they take {years:,.1f} "
                f"years; use at most {MAX_STEPS:,}",
            )
        check_int("seed", self.seed, low=0)
        self._check_documents()
        check_int("warmup", self.warmup, low=0)
        check_int("ceiling_steps", self.ceiling_steps, low=0)
        check_int("checkpoint_every", self.checkpoint_every, low=0)
        check_int("keep_checkpoints", self.keep_checkpoints, low=1)
        check_int("max_restarts", self.max_restarts, low=0)
        self._check_fault_tolerance()
        self._check_speeds()
        check_float("collective_timeout", self.collective_timeout, low=0.0, low_open=True)
        if self.n_embd % self.n_head:
            raise ConfigError(
                "n_embd",
                f"({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"try n_embd {self.n_head * max(1, round(self.n_embd / self.n_head))}",
            )
        check_float("lr", self.lr, low=0.0, low_open=True)
        check_float("weight_decay", self.weight_decay, low=0.0)
        self._check_optimizer()
        if self.lr_schedule not in _LR_SCHEDULES:
            raise ConfigError(
                "lr_schedule",
                f"must be one of {', '.join(_LR_SCHEDULES)}, got {self.lr_schedule!r}",
            )
        check_float("min_lr_ratio", self.min_lr_ratio, low=0.0)
        if self.min_lr_ratio > 1.0:
            raise ConfigError("min_lr_ratio", f"must be <= 1, got {self.min_lr_ratio}")
        check_float("dropout", self.dropout, low=0.0)
        if self.dropout >= 1.0:
            raise ConfigError("dropout", f"must be < 1, got {self.dropout}")
        check_float("bucket_cap_mb", self.bucket_cap_mb, low=0.0, low_open=True)
        if self.backend not in _BACKENDS:
            raise ConfigError(
                "backend", f"must be one of {', '.join(_BACKENDS)}, got {self.backend!r}"
            )
        if self.device not in DEVICES:
            raise ConfigError("device", f"must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "cpu" and self.backend == "nccl":
            raise ConfigError(
                "backend",
                "'nccl' needs the workers on GPUs, and device is 'cpu'; use gloo or auto "
                "(or device cuda)",
            )
        for key in ("overwrite", "quiet"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(key, f"must be true or false, got {getattr(self, key)!r}")
        if self.data is not None:
            check_string("data", self.data)
            if not os.path.exists(os.path.expanduser(self.data)):
                raise ConfigError(
                    "data",
                    f"path {self.data!r} does not exist: pass a UTF-8 text file or a folder of "
                    "text files, or leave it unset for the embedded corpus",
                )
        self._check_paths()
        self._check_outer()

    def stretch(self, rank: int, world: int) -> float:
        """How many times its own compute each inner step of ``rank`` takes (``speeds``):
        the fastest worker's speed over this one's; 1.0 without ``speeds``."""
        if self.speeds is None:
            return 1.0
        speeds = [float(v) for v in str(self.speeds).split(",")]
        if len(speeds) != world:
            raise ConfigError(
                "speeds",
                f"gives {len(speeds)} speed(s) but the job has {world} worker processes; give "
                "one per worker",
            )
        return max(speeds) / speeds[rank]

    # --- outer hyperparameters -------------------------------------------------------------

    def _check_outer(self) -> None:
        # Any other string is left for the algorithm to reject.
        clip = getattr(self, "clip", None)
        if isinstance(clip, str) and clip.lower() == "none":
            setattr(self, "clip", "none")  # noqa: B010 (a field added by with_outer_fields)
        if self.algo == "ddp" and self.compression is not None:
            from lowcomm.compress import parse_compression

            try:
                parse_compression(self.compression)
            except ValueError as e:
                raise ConfigError("compression", f"is not usable: {e}") from None
        if self.algo in NO_OUTER_ALGORITHM:
            options = REGISTRY[self.algo].options
            if options is not None:
                try:
                    options(**self.algorithm_kwargs())
                except ValueError as e:
                    raise _config_error(e) from None
            return
        try:
            cls = self.algorithm_class()
        except (ImportError, KeyError) as e:  # pragma: no cover - only while incomplete
            raise ConfigError("algo", f"{self.algo!r} is not available in this build: {e}") from e
        kwargs = self.algorithm_kwargs()
        try:
            cls.validate(**kwargs)
        except ValueError as e:
            raise _config_error(e) from None
        if issubclass(cls, SlowMo) and self.lr_schedule == "cosine" and self.min_lr_ratio == 0:
            raise ConfigError(
                "min_lr_ratio",
                "must be > 0 for slowmo with the cosine schedule: SlowMo divides its update by "
                "the inner learning rate, which would reach 0 at the last step; use e.g. "
                "min_lr_ratio 0.1 or lr_schedule constant",
            )
        if kwargs.get("local_steps") == "dynamic":
            refusals = (
                (
                    self.documents,
                    "documents (their steps hold unequal tokens; --balance "
                    "evens out the work instead)",
                ),
                (self.nodes > 1, "node groups (the processes of a node step together)"),
                (self.fault_tolerance, "fault_tolerance (its plans assume a fixed group)"),
            )
            for refused, why in refusals:
                if refused:
                    raise ConfigError("local_steps", f"'dynamic' cannot be combined with {why}")
        fragments = kwargs.get("num_fragments")
        if fragments is not None and fragments > self.n_layer:
            raise ConfigError(
                "num_fragments",
                f"({fragments}) exceeds n_layer ({self.n_layer}): fragments are made of whole "
                f"transformer blocks; use at most {self.n_layer} fragments or more layers",
            )

    def outer_keys_set(self) -> list[str]:
        """Outer hyperparameters the user set (not None), in field order."""
        return [k for k in ALL_OUTER_KEYS if getattr(self, k) is not None]

    def ignored_outer_keys(self) -> list[str]:
        """Outer hyperparameters the user set that do not apply to ``algo``."""
        applies = OUTER_KEYS[self.algo]
        return [k for k in self.outer_keys_set() if k not in applies]

    def algorithm_class(self) -> type[OuterAlgorithm]:
        """The class that runs ``algo`` (its registry entry's; not for ``ddp``)."""
        entry = REGISTRY[self.algo]
        assert entry.cls is not None, f"{self.algo} runs no outer algorithm"
        return entry.cls

    def algorithm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``algorithm_class()(model, inner, **kwargs)``.

        ``sync_every`` and ``bucket_cap_mb`` always, the keywords the registry entry fixes
        (``co2-eager``: ``eager=True``), plus the outer hyperparameters the user set that apply
        to the algorithm (else the job's defaults, :func:`~.outer_keys.job_outer_defaults`);
        ``clip="none"`` becomes
        ``clip=None`` (no clipping).
        """
        entry = REGISTRY[self.algo]
        if entry.cls is None:
            # demo: its options as set (unset: the library's defaults)
            keys = OUTER_KEYS[self.algo] if entry.options is not None else ()
            return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        kwargs: dict[str, Any] = {
            "sync_every": self.sync_every,
            "bucket_cap_mb": self.bucket_cap_mb,
            **entry.fixed,
        }
        job_defaults = job_outer_defaults(
            self.algo,
            steps=self.steps,
            sync_every=self.sync_every,
            n_layer=self.n_layer,
            fault_tolerance=self.fault_tolerance,
            overlap=self.overlap,
        )
        for key in OUTER_KEYS[self.algo]:
            value = getattr(self, key)
            if value is None:
                if key not in job_defaults:
                    continue
                value = job_defaults[key]
            if key == "clip" and value == "none":
                value = None
            kwargs[key] = value
        return kwargs

    def sync_warmup_steps(self) -> int:
        """K: the steps of this job's synchronous warm start (0: none; ddp: every step is
        synchronous, and 0 here)."""
        if self.algo in NO_OUTER_ALGORITHM:
            return 0
        return int(self.algorithm_kwargs().get("sync_warmup", 0))

    # --- derived values --------------------------------------------------------------------

    @property
    def eval_interval(self) -> int:
        """``eval_every`` rounded up to a multiple of ``sync_every`` (ddp: unchanged), so that
        every evaluation sees the consensus model right after a round boundary."""
        if self.algo in NO_OUTER_ALGORITHM:
            return self.eval_every
        return math.ceil(self.eval_every / self.sync_every) * self.sync_every

    def with_paths(self, now: datetime.datetime | None = None) -> TrainConfig:
        """A copy with ``name`` (default ``<algo>-<YYYYmmdd-HHMMSS>``) and ``out`` (default
        ``runs/<name>``; when resuming from a checkpoint path, the run folder that holds it)
        filled in."""
        out = self.out
        name = self.name
        if out is None and self.resume is not None:
            # Resuming without --out continues the run the checkpoint belongs to.
            from lowcomm.train.paths import LATEST, run_folder_of

            if self.resume == LATEST:
                raise ConfigError(
                    "resume",
                    "without a path needs out (--out), the folder of the run to continue; "
                    "or pass the checkpoint: --resume RUN/checkpoints/step-NNNNNN",
                )
            out = run_folder_of(self.resume)
            if name is None:
                name = os.path.basename(os.path.normpath(out))
        if name is None:
            now = now or datetime.datetime.now()
            name = f"{self.algo}-{now:%Y%m%d-%H%M%S}"
        if out is None:
            out = os.path.join("runs", name)
        # Only the two paths change: check them rather than every field again.
        cfg = copy.copy(self)
        cfg.name, cfg.out = name, out
        cfg._check_paths()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (JSON- and ``torch.load(weights_only=True)``-safe)."""
        return dataclasses.asdict(self)


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def _config_error(error: ValueError) -> ConfigError:
    """An algorithm's ``ValueError`` as a :class:`ConfigError` keyed by the keyword it is about:
    :class:`~lowcomm.outer.hparams.HyperparameterError` carries it (``overlap``, problem
    ``"(12) must be ..."``); any other ``ValueError`` is keyed by the keyword its message
    starts with, when that is a config field."""
    if isinstance(error, HyperparameterError):
        key, shown, problem = error.key, error.shown, error.problem
    else:
        match = _LEADING_KEYWORD.match(str(error))
        if match is None or match.group(1) not in _field_names():
            return ConfigError(None, str(error))
        key, value, problem = match.groups()
        shown = value[1:] if value else None
    if key is None or key not in _field_names():
        return ConfigError(None, str(error))
    if shown is not None:
        problem = f"({shown}) {problem}"
    if key == "clip":
        problem += "; or 'none' to disable clipping"
    return ConfigError(key, problem)


def config_from_dict(values: Mapping[str, Any], *, source: str = "config") -> TrainConfig:
    """Build a :class:`TrainConfig` from a flat mapping; unknown keys raise :class:`ConfigError`."""
    names = _field_names()
    unknown = [k for k in values if k not in names]
    if unknown:
        raise ConfigError(
            None,
            f"unknown key {unknown[0]!r} in {source}; valid keys: {', '.join(names)}",
        )
    return TrainConfig(**dict(values))


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


def field_docs() -> dict[str, str]:
    """The one-line docstring under each :class:`TrainConfig` field (used for ``--help``)."""
    docs = field_docstrings(TrainFields)
    docs.update({key: outer_doc(key) for key in ALL_OUTER_KEYS})
    return docs
