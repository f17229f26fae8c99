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
nothing to DiLoCo: it is ignored with a warning). Bad values raise :class:`ConfigError`, a
``ValueError`` that names the key, the value and the fix.

Example::

    cfg = TrainConfig(algo="diloco", steps=300, outer_lr=0.7)
    cfg = load_toml("co2.toml", overrides={"steps": 100})
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "ALGORITHM_CHOICES",
    "OUTER_KEYS",
    "ConfigError",
    "TrainConfig",
    "config_from_dict",
    "load_toml",
]

logger = logging.getLogger(__name__)

ALGORITHM_CHOICES = ("co2", "diloco", "localsgd", "slowmo", "ddp")
"""Values of ``--algo``; ``ddp`` is the synchronous DistributedDataParallel baseline."""

OUTER_KEYS: dict[str, tuple[str, ...]] = {
    "co2": ("outer_lr", "outer_momentum", "nesterov", "clip", "clip_mode", "gap_penalty"),
    "diloco": ("outer_lr", "outer_momentum", "nesterov"),
    "slowmo": ("outer_lr", "outer_momentum"),
    "localsgd": (),
    "ddp": (),
}
"""The outer-loop keywords each algorithm takes (besides ``sync_every`` and ``bucket_cap_mb``)."""

JOB_OUTER_DEFAULTS: dict[str, dict[str, Any]] = {"co2": {"outer_lr": 0.5}}
"""Where this job's defaults differ from the library's, for the small GPT it trains.

CO2 applies each round's average one round late. When local training moves the model far
within a round (as it does for this small GPT at a useful inner learning rate), the stale
update behaves like e(t+1) = e(t) - alpha * (beta * m + e(t-1)): marginally stable at alpha = 1,
beta = 0 and unstable for any beta > 0, which shows as a validation loss that rises and falls.
alpha = 0.5 is comfortably stable here. The library keeps the paper's alpha = 1.0, meant for
large models whose rounds move them little; the README explains the choice."""

_ALL_OUTER_KEYS = ("outer_lr", "outer_momentum", "nesterov", "clip", "clip_mode", "gap_penalty")
_BACKENDS = ("auto", "gloo", "nccl")
_LR_SCHEDULES = ("cosine", "constant")
_CLIP_MODES = ("value", "norm")
_GAP_PENALTIES = ("gap_aware", "none")


class ConfigError(ValueError):
    """A bad configuration value. ``key`` is the field name (``None`` when several are involved);
    ``problem`` is the message without the key, so the CLI can name the flag or TOML key instead.
    """

    def __init__(self, key: str | None, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"{key} {problem}" if key else problem)


@dataclass(kw_only=True)
class TrainConfig:
    """Everything ``lowcomm train`` needs; see the module docstring for how it is filled."""

    # --- job -------------------------------------------------------------------------------
    algo: str = "co2"
    """Outer-loop algorithm: co2, diloco, localsgd, slowmo, or ddp (synchronous baseline)."""
    workers: int = 2
    """Local worker processes to launch (ignored under torchrun, which sets the world size)."""
    steps: int = 960
    """Inner optimizer steps per worker."""
    sync_every: int = 12
    """H: inner steps per communication round (not used by ddp, which syncs every step)."""
    seed: int = 0
    """Seed for the model initialisation (same on every rank) and the data order (per rank)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl when CUDA is available, else gloo), gloo or nccl."""
    bucket_cap_mb: float = 25.0
    """Size of the flat communication buckets, in MiB (one collective per bucket)."""

    # --- data ------------------------------------------------------------------------------
    data: str | None = None
    """UTF-8 text file or folder of text files (byte-level tokens); unset: the embedded corpus."""
    batch_size: int = 16
    """Sequences per worker per inner step."""
    block_size: int = 64
    """Tokens per sequence (the model's context length)."""

    # --- model -----------------------------------------------------------------------------
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability (0 disables it)."""

    # --- inner optimizer (AdamW) -----------------------------------------------------------
    lr: float = 2e-3
    """Inner AdamW learning rate (after warm-up)."""
    warmup: int = 30
    """Inner steps of linear learning-rate warm-up from 0."""
    lr_schedule: str = "cosine"
    """After warm-up: "cosine" (decay to min_lr_ratio * lr at the last step) or "constant"."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to weight matrices and embeddings only."""

    # --- outer optimizer (None = the algorithm's default) ----------------------------------
    outer_lr: float | None = None
    """alpha: outer learning rate (co2 0.5 in this job, library default 1.0; diloco 0.7;
    slowmo 1.0)."""
    outer_momentum: float | None = None
    """beta: outer momentum (co2 0.5, diloco 0.9, slowmo 0.5)."""
    nesterov: bool | None = None
    """Nesterov outer momentum (co2 off, diloco on)."""
    clip: float | str | None = None
    """phi: co2 outer momentum clipping threshold (default 1.0); the string "none" disables it."""
    clip_mode: str | None = None
    """co2 clipping: "value" (elementwise clamp, default) or "norm" (scale to L2 norm <= phi)."""
    gap_penalty: str | float | None = None
    """co2 staleness penalty: "gap_aware" (default), "none", or a constant divisor >= 1."""

    # --- evaluation and output -------------------------------------------------------------
    eval_every: int = 60
    """Inner steps between validation evaluations, rounded up to a multiple of sync_every."""
    eval_batches: int = 8
    """Validation batches per evaluation."""
    out: str | None = None
    """Output folder; unset: runs/<name>/."""
    name: str | None = None
    """Run name; unset: <algo>-<YYYYmmdd-HHMMSS>."""

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHM_CHOICES:
            raise ConfigError(
                "algo", f"must be one of {', '.join(ALGORITHM_CHOICES)}, got {self.algo!r}"
            )
        for key in ("workers", "steps", "sync_every", "batch_size", "block_size"):
            _check_int(key, getattr(self, key), low=1)
        for key in ("n_layer", "n_head", "n_embd", "eval_every", "eval_batches"):
            _check_int(key, getattr(self, key), low=1)
        _check_int("seed", self.seed, low=0)
        _check_int("warmup", self.warmup, low=0)
        if self.n_embd % self.n_head:
            raise ConfigError(
                "n_embd",
                f"({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"try n_embd {self.n_head * max(1, round(self.n_embd / self.n_head))}",
            )
        _check_float("lr", self.lr, low=0.0, low_open=True)
        _check_float("weight_decay", self.weight_decay, low=0.0)
        if self.lr_schedule not in _LR_SCHEDULES:
            raise ConfigError(
                "lr_schedule",
                f"must be one of {', '.join(_LR_SCHEDULES)}, got {self.lr_schedule!r}",
            )
        _check_float("min_lr_ratio", self.min_lr_ratio, low=0.0)
        if self.min_lr_ratio > 1.0:
            raise ConfigError("min_lr_ratio", f"must be <= 1, got {self.min_lr_ratio}")
        _check_float("dropout", self.dropout, low=0.0)
        if self.dropout >= 1.0:
            raise ConfigError("dropout", f"must be < 1, got {self.dropout}")
        _check_float("bucket_cap_mb", self.bucket_cap_mb, low=0.0, low_open=True)
        if self.backend not in _BACKENDS:
            raise ConfigError(
                "backend", f"must be one of {', '.join(_BACKENDS)}, got {self.backend!r}"
            )
        for key in ("data", "out", "name"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(key, f"must be a non-empty string, got {value!r}")
        if self.data is not None and not os.path.exists(os.path.expanduser(self.data)):
            raise ConfigError(
                "data",
                f"path {self.data!r} does not exist: pass a UTF-8 text file or a folder of "
                "text files, or leave it unset for the embedded corpus",
            )
        if self.name is not None and (os.sep in self.name or self.name in (".", "..")):
            raise ConfigError(
                "name", f"must be a plain folder name, got {self.name!r}; use --out for a path"
            )
        self._check_outer()

    # --- outer hyperparameters -------------------------------------------------------------

    def _check_outer(self) -> None:
        if self.outer_lr is not None:
            _check_float("outer_lr", self.outer_lr, low=0.0, low_open=True)
        if self.outer_momentum is not None:
            _check_float("outer_momentum", self.outer_momentum, low=0.0)
            if self.outer_momentum >= 1.0:
                raise ConfigError("outer_momentum", f"must be in [0, 1), got {self.outer_momentum}")
        if self.nesterov is not None and not isinstance(self.nesterov, bool):
            raise ConfigError("nesterov", f"must be true or false, got {self.nesterov!r}")
        if isinstance(self.clip, str):
            if self.clip.lower() != "none":
                raise ConfigError(
                    "clip", f"must be a number > 0 or 'none' (no clipping), got {self.clip!r}"
                )
            self.clip = "none"
        elif self.clip is not None:
            _check_float("clip", self.clip, low=0.0, low_open=True, hint="or 'none' to disable")
        if self.clip_mode is not None and self.clip_mode not in _CLIP_MODES:
            raise ConfigError(
                "clip_mode", f"must be one of {', '.join(_CLIP_MODES)}, got {self.clip_mode!r}"
            )
        gp = self.gap_penalty
        if isinstance(gp, str):
            if gp not in _GAP_PENALTIES:
                raise ConfigError(
                    "gap_penalty",
                    f"must be 'gap_aware', 'none' or a number >= 1, got {gp!r}",
                )
        elif gp is not None:
            _check_float("gap_penalty", gp, low=1.0, hint="or 'gap_aware' / 'none'")
        if self.algo == "ddp":
            return
        kwargs = self.algorithm_kwargs()
        try:
            from lowcomm.outer import ALGORITHMS
        except ImportError as e:  # pragma: no cover - only while the package is incomplete
            raise ConfigError("algo", f"{self.algo!r} is not available: {e}") from e
        if self.algo not in ALGORITHMS:
            raise ConfigError("algo", f"{self.algo!r} is not available in this build")
        try:
            ALGORITHMS[self.algo].validate(**kwargs)
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(None, str(e)) from e

    def outer_keys_set(self) -> list[str]:
        """Outer hyperparameters the user set (not None), in field order."""
        return [k for k in _ALL_OUTER_KEYS if getattr(self, k) is not None]

    def ignored_outer_keys(self) -> list[str]:
        """Outer hyperparameters the user set that do not apply to ``algo``."""
        applies = OUTER_KEYS[self.algo]
        return [k for k in self.outer_keys_set() if k not in applies]

    def algorithm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ALGORITHMS[algo](model, inner, **kwargs)``.

        ``sync_every`` and ``bucket_cap_mb`` always, plus the outer hyperparameters the user set
        that apply to the algorithm (else :data:`JOB_OUTER_DEFAULTS`); ``clip="none"`` becomes
        ``clip=None`` (no clipping).
        """
        if self.algo == "ddp":
            return {}
        kwargs: dict[str, Any] = {
            "sync_every": self.sync_every,
            "bucket_cap_mb": self.bucket_cap_mb,
        }
        job_defaults = JOB_OUTER_DEFAULTS.get(self.algo, {})
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

    # --- derived values --------------------------------------------------------------------

    @property
    def eval_interval(self) -> int:
        """``eval_every`` rounded up to a multiple of ``sync_every`` (ddp: unchanged), so that
        every evaluation sees the consensus model right after a round boundary."""
        if self.algo == "ddp":
            return self.eval_every
        return math.ceil(self.eval_every / self.sync_every) * self.sync_every

    def with_paths(self, now: datetime.datetime | None = None) -> TrainConfig:
        """A copy with ``name`` (default ``<algo>-<YYYYmmdd-HHMMSS>``) and ``out`` (default
        ``runs/<name>``) filled in."""
        name = self.name
        if name is None:
            now = now or datetime.datetime.now()
            name = f"{self.algo}-{now:%Y%m%d-%H%M%S}"
        out = self.out if self.out is not None else os.path.join("runs", name)
        return dataclasses.replace(self, name=name, out=out)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (JSON- and ``torch.load(weights_only=True)``-safe)."""
        return dataclasses.asdict(self)


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def _check_int(key: str, value: Any, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"must be an integer, got {value!r}")
    if value < low:
        raise ConfigError(key, f"must be >= {low}, got {value}")


def _check_float(
    key: str, value: Any, *, low: float, low_open: bool = False, hint: str = ""
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, f"must be a number, got {value!r}")
    bad = not math.isfinite(value) or (value <= low if low_open else value < low)
    if bad:
        op = ">" if low_open else ">="
        extra = f" {hint}" if hint else ""
        raise ConfigError(key, f"must be a finite number {op} {low:g}{extra}, got {value}")


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
    """Read a flat TOML config file into a dict; every problem is a :class:`ConfigError`."""
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(None, f"config file {path!r} not found") from None
    except IsADirectoryError:
        raise ConfigError(None, f"config file {path!r} is a directory") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(None, f"config file {path!r} is not valid TOML: {e}") from None
    names = _field_names()
    for key, value in values.items():
        if key not in names:
            raise ConfigError(
                None, f"unknown key {key!r} in {path}; valid keys: {', '.join(names)}"
            )
        if isinstance(value, (dict, list)):
            raise ConfigError(
                None, f"key {key!r} in {path} must be a single value, got {type(value).__name__}"
            )
    return values


def load_toml(path: str, *, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the TOML file at ``path``, then ``overrides`` (e.g. command-line flags)."""
    values = read_toml(path)
    values.update(overrides or {})
    return config_from_dict(values, source=path)


def field_docs() -> dict[str, str]:
    """The one-line docstring under each :class:`TrainConfig` field (used for ``--help``)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(TrainConfig)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
