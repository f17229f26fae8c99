"""Resumable checkpoints of a ``lowcomm train`` job: every rank's state at a step boundary.

Layout (``--checkpoint-every N``)::

    <out>/checkpoints/
        step-000120/
            rank-0.pt ... rank-<N-1>.pt   one per rank, written by that rank
            meta.json                     the manifest, written last, by rank 0
        step-000180/
        .step-000240.partial/             being written (or left by a killed run)

Writing the checkpoint of step s (after that step's ``algo.step()``, evaluation and records):
every rank writes ``rank-<r>.pt`` into ``.step-<s>.partial/`` (each file atomically: temporary
file, fsync, rename); after a barrier rank 0 writes ``meta.json`` there, renames the folder to
``step-<s>`` and deletes all but the newest ``keep_checkpoints`` complete checkpoints. A
checkpoint is **complete** when ``step-<s>/meta.json`` exists; only complete ones are resumed
from, so a run killed while writing one leaves the previous one in charge.

A rank file holds plain dicts, tensors, numbers and strings (``torch.load(weights_only=True)``
reads it): ``step``, ``rank``, ``world_size``, the model, the inner optimizer (with
``node_sharding="zero"``, this rank's shard: the ``state_dict()`` of its
``ZeroRedundancyOptimizer``'s local AdamW, whose partition of the parameters is the same on
every run of the same layout), the algorithm's
``state_dict()`` (``None`` for ddp and none), the RNG states (``torch``: the global CPU
generator, which dropout draws from; ``data``: this rank's batch generator, i.e. the data
position; ``cuda`` on GPU), this rank's communication counters (with node groups also those of
DDP inside the node, ``intra_node_stats``), and on rank 0 the progress of the
metrics (the running loss sum since the last record, times, the initial validation loss). Python's
and NumPy's generators are not used by the job and not saved. The learning rate is a function of
the step and needs no state.

In-flight communication is saved, not drained: an algorithm's ``state_dict()`` waits for the
all-reduces still in flight (CO2's previous round, Streaming DiLoCo's and CoCoDC's launched
fragments) and stores their averaged result *without applying it*; after loading, the result is
applied at the step where the uninterrupted run would have applied it. A resumed run therefore
ends with bit-identical parameters (on the same hardware, backend and thread count).

Resuming (``--resume [PATH]``): ``PATH`` is a ``step-<s>`` folder, a ``checkpoints`` folder or a run
folder (the newest complete checkpoint in it that verifies); ``--resume`` alone means the newest
under ``--out``. The settings that determine the numbers must equal the checkpoint's (every
:class:`~lowcomm.train.config.TrainConfig` field but :data:`RESUME_FREE_KEYS`), and so must the
world size; the first difference is named. The resumed run continues in ``--out`` (by default
the run folder of ``PATH``): its ``metrics.jsonl`` is cut back to the records up to step s (in
another folder, it starts with those of the checkpoint's run), and complete checkpoints after s
(left by the run that was stopped) are deleted, since they belong to the abandoned continuation.
A worker group restarted by the elastic agent (``--max-restarts``, or torchrun's) resumes the
same way from the run's latest complete checkpoint, or starts over if there is none yet.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping
from typing import Any

import torch

from lowcomm.runfiles import atomic_write, fsync_dir, load_checkpoint, save_checkpoint, write_json
from lowcomm.train.config import ConfigError, TrainConfig, key_default
from lowcomm.train.paths import CHECKPOINTS, LATEST, STEP_FOLDER, run_folder_of, step_folder_name

__all__ = [
    "CHECKPOINTS",
    "LATEST",
    "MANIFEST",
    "RESUME_FREE_KEYS",
    "check_compatible",
    "complete_checkpoints",
    "config_difference",
    "damage",
    "discard_after",
    "find_checkpoint",
    "newest_intact",
    "load_rank_state",
    "publish",
    "rank_file",
    "read_manifest",
    "run_folder_of",
    "truncate_metrics",
    "write_rank_state",
]

logger = logging.getLogger(__name__)

FORMAT = 1
"""Version of the checkpoint layout, stored in every manifest and rank file."""

MANIFEST = "meta.json"
"""Written last, by rank 0: its presence makes a checkpoint complete."""

RESUME_FREE_KEYS = frozenset(
    {
        "workers",  # the world size is compared instead (torchrun sets it, not --workers)
        "out",
        "name",
        "overwrite",
        "quiet",
        "tensorboard",
        "eval_every",
        "eval_batches",
        "log_every",
        "ceiling_steps",
        "link",
        "tune_link",  # the settings it chose are restored from the checkpoint
        "algo_from_link",  # (and so is the algorithm it chose)
        "backend",
        "device",  # (a CPU checkpoint resumes on GPUs and the other way round)
        "checkpoint_every",
        "keep_checkpoints",
        "resume",
        "busy_wait",
        "max_restarts",
        "collective_timeout",
        "heal",  # (how a later heal moves the state, not the state: a resumed job may heal
        "heal_inner",  # otherwise; checkpoints written before these were chosen hold values)
    }
)
"""Settings that may differ between a checkpoint and the run resuming from it: they change what
is measured, reported or kept, not the training itself."""

_PARTIAL_DIR = re.compile(r"\.step-(\d+)\.partial")


def complete_checkpoints(out: str) -> list[tuple[int, str]]:
    """``(step, folder)`` of every complete checkpoint of the run in ``out``, oldest first."""
    root = os.path.join(out, CHECKPOINTS)
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        match = STEP_FOLDER.fullmatch(name)
        folder = os.path.join(root, name)
        if match and os.path.isfile(os.path.join(folder, MANIFEST)):
            found.append((int(match.group(1)), folder))
    return sorted(found)


def find_checkpoint(
    spec: str, out: str | None, *, skipped: list[tuple[str, str]] | None = None
) -> str:
    """The checkpoint folder ``resume`` names: ``spec`` is :data:`LATEST` (the newest complete
    checkpoint under ``out`` that verifies), a ``step-<s>`` folder, a ``checkpoints`` folder or
    a run folder (the newest in it that verifies).

    Args:
        skipped: where given, the damaged checkpoints passed over on the way, newest first, are
            appended to it as ``(folder, why)``, for the caller to report.

    Raises:
        ConfigError: keyed ``resume``, when there is no complete checkpoint there, when the
            ``step-<s>`` folder given is damaged, or when every one is.
    """
    if spec == LATEST:
        if out is None:
            raise ConfigError("resume", "without a path needs out (--out)")
        where = out
    elif os.path.isfile(os.path.join(spec, MANIFEST)):
        return spec
    elif STEP_FOLDER.fullmatch(os.path.basename(os.path.normpath(spec))):
        raise ConfigError(
            "resume",
            f"{spec!r} is not a complete checkpoint (no {MANIFEST}: it was not finished or does "
            "not exist); pass a complete one, or the run folder for its latest",
        )
    elif os.path.isfile(spec):
        run = os.path.dirname(os.path.abspath(spec))
        what = (
            "the final model of its run, not a point to resume from"
            if os.path.basename(spec) == "checkpoint.pt"
            else "a file"
        )
        raise ConfigError(
            "resume",
            f"{spec!r} is {what}; pass the run folder ({run!r}: its newest checkpoint under "
            f"{CHECKPOINTS}/) or one of its {CHECKPOINTS}/step-N folders",
        )
    else:
        where = run_folder_of(spec)
        if not os.path.exists(where):
            raise ConfigError("resume", f"path {spec!r} does not exist")
    found = complete_checkpoints(where)
    if not found:
        raise ConfigError(
            "resume",
            f"found no complete checkpoint in {os.path.join(where, CHECKPOINTS)!r}; runs write "
            "them with checkpoint_every (--checkpoint-every N)",
        )
    folder, passed = newest_intact(where)
    if skipped is not None:
        skipped.extend(passed)
    if folder is None:
        newest, why = passed[0]
        raise ConfigError(
            "resume",
            f"every complete checkpoint in {os.path.join(where, CHECKPOINTS)!r} is damaged "
            f"(the newest, {os.path.basename(newest)}: {why}); start a new run",
        )
    return folder


def newest_intact(out: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest complete checkpoint of the run in ``out`` that :func:`damage` finds intact
    (``None``: none is), and the damaged ones newer than it, newest first, each with why."""
    passed: list[tuple[str, str]] = []
    for _, folder in reversed(complete_checkpoints(out)):
        why = damage(folder)
        if why is None:
            return folder, passed
        passed.append((folder, why))
    return None, passed


def read_manifest(folder: str) -> dict[str, Any]:
    """The manifest of a complete checkpoint; :class:`ConfigError` (``resume``) if unreadable."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError("resume", f"cannot read {path!r}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(
            "resume", f"{path!r} is not a lowcomm checkpoint manifest of format {FORMAT}"
        )
    return manifest


def config_difference(saved: Mapping[str, Any], cfg: TrainConfig) -> tuple[str, Any, Any] | None:
    """The first setting (field order) outside :data:`RESUME_FREE_KEYS` whose value in
    ``saved`` (a ``to_dict()``; a missing key counts as the field's default) differs from
    ``cfg``'s: ``(key, saved value, cfg value)``, or ``None``."""
    for key, now in cfg.to_dict().items():
        if key in RESUME_FREE_KEYS:
            continue
        default = key_default(key)
        before = saved.get(key, None if default is dataclasses.MISSING else default)
        if before != now or isinstance(before, bool) != isinstance(now, bool):
            return key, before, now
    return None


def check_compatible(folder: str, cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """Refuse to resume ``cfg`` with ``world_size`` ranks from the checkpoint in ``folder``
    unless its world size and settings match; returns its manifest.

    Raises:
        ConfigError: keyed ``resume``, naming the first difference.
    """
    manifest = read_manifest(folder)
    saved_world = manifest.get("world_size")
    if saved_world != world_size:
        raise ConfigError(
            "resume",
            f"checkpoint {folder!r} was written by {saved_world} workers but this run has "
            f"{world_size}; resume with the same number of workers",
        )
    _check_files(folder)
    diff = config_difference(manifest.get("config", {}), cfg)
    if diff is not None:
        key, before, now = diff
        raise ConfigError(
            "resume",
            f"checkpoint {folder!r} was written with {key}={before!r} but this run has "
            f"{key}={now!r}; resume with the same settings or start a new run",
        )
    return manifest


def _earlier(folder: str) -> str:
    """A hint naming the newest intact checkpoint before ``folder``, if its run has one."""
    run = run_folder_of(folder)
    here = os.path.normpath(folder)
    for _, f in reversed(complete_checkpoints(run)):
        if os.path.normpath(f) < here and damage(f) is None:
            return f"resume from an earlier one: --resume {f}"
    return "no earlier intact checkpoint is left: start a new run"


def _digest(path: str) -> str:
    """The SHA-256 of the file at ``path``, in hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def damage(folder: str) -> str | None:
    """Why the complete checkpoint in ``folder`` cannot be resumed from as it was written, or
    ``None`` when it verifies: its manifest unreadable, a rank file missing, of another size
    than was written, or (manifests that record digests) with other contents."""
    try:
        manifest = read_manifest(folder)
    except ConfigError as e:
        return e.problem
    world = manifest.get("world_size")
    if not isinstance(world, int) or world < 1:
        return f"its {MANIFEST} names no world size"
    sizes, digests = manifest.get("sizes"), manifest.get("digests")
    for rank in range(world):
        path = rank_file(folder, rank)
        name = os.path.basename(path)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if isinstance(sizes, list) and rank < len(sizes) and os.path.getsize(path) != sizes[rank]:
            return f"{name} has {os.path.getsize(path)} bytes but {sizes[rank]} were written"
        if isinstance(digests, list) and rank < len(digests):
            try:
                same = _digest(path) == digests[rank]
            except OSError as e:
                return f"{name} cannot be read ({e.strerror or e})"
            if not same:
                return f"{name} holds other bytes than were written (its SHA-256 differs)"
    return None


def _check_files(folder: str) -> None:
    """Every rank's file is there as it was written (:func:`damage`); raises
    :class:`ConfigError` (``resume``) naming the damaged file and an earlier checkpoint."""
    why = damage(folder)
    if why is not None:
        raise ConfigError("resume", f"checkpoint {folder!r} is damaged: {why}; {_earlier(folder)}")


def rank_file(folder: str, rank: int) -> str:
    """The file of ``rank``'s state in the checkpoint ``folder``."""
    return os.path.join(folder, f"rank-{rank}.pt")


def _partial_folder(out: str, step: int) -> str:
    return os.path.join(out, CHECKPOINTS, f".{step_folder_name(step)}.partial")


def write_rank_state(out: str, step: int, rank: int, state: dict[str, Any]) -> None:
    """Write this rank's part of the checkpoint of ``step`` (atomically) into its partial folder.
    Every rank calls it, then a barrier, then rank 0 calls :func:`publish`."""
    folder = _partial_folder(out, step)
    os.makedirs(folder, exist_ok=True)
    save_checkpoint(rank_file(folder, rank), {"format": FORMAT, **state})


def publish(out: str, step: int, manifest: dict[str, Any], *, keep: int) -> str:
    """Rank 0, after every rank wrote its part: write the manifest, move the folder into place
    and keep the newest ``keep`` complete checkpoints. Returns the checkpoint's folder."""
    partial = _partial_folder(out, step)
    world = int(manifest["world_size"])
    missing = [r for r in range(world) if not os.path.isfile(rank_file(partial, r))]
    if missing:
        raise RuntimeError(
            f"checkpoint of step {step}: the files of ranks {missing} are not in {partial!r}; "
            "workers on several machines need --out on a filesystem they all share"
        )
    write_json(
        os.path.join(partial, MANIFEST),
        {
            "format": FORMAT,
            "step": step,
            "files": [os.path.basename(rank_file(partial, r)) for r in range(world)],
            # checked before a resume starts any worker: a damaged file is refused up front
            "sizes": [os.path.getsize(rank_file(partial, r)) for r in range(world)],
            "digests": [_digest(rank_file(partial, r)) for r in range(world)],
            "written": time.time(),
            "torch": torch.__version__,
            **manifest,
        },
    )
    final = os.path.join(out, CHECKPOINTS, step_folder_name(step))
    if os.path.exists(final):  # the same step from a run that was stopped later than this one
        shutil.rmtree(final)
    os.replace(partial, final)
    fsync_dir(os.path.dirname(final))
    complete = complete_checkpoints(out)
    for _, folder in complete[: max(0, len(complete) - keep)]:
        shutil.rmtree(folder, ignore_errors=True)
    _remove_partials(out, below=step)
    return final


def _remove_partials(out: str, *, below: int | None = None) -> None:
    root = os.path.join(out, CHECKPOINTS)
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in names:
        match = _PARTIAL_DIR.fullmatch(name)
        if match and (below is None or int(match.group(1)) < below):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def discard_after(out: str, step: int) -> None:
    """Rank 0, before a (re)started run writes anything: delete the complete checkpoints after
    ``step`` and every partial one (left by the run that was stopped)."""
    for s, folder in complete_checkpoints(out):
        if s > step:
            shutil.rmtree(folder, ignore_errors=True)
    _remove_partials(out)


def load_rank_state(folder: str, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's part of the checkpoint in ``folder`` (``torch.load(weights_only=True)``)."""
    path = rank_file(folder, rank)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {folder!r} has no file for rank {rank}")
    hint = _earlier(folder)
    state = load_checkpoint(path, what="a lowcomm checkpoint file", hint=hint)
    if not isinstance(state, dict):
        raise ValueError(f"{path!r} is not a lowcomm checkpoint file; {hint}")
    if state.get("rank") != rank or state.get("world_size") != world_size:
        raise ValueError(
            f"{path!r} holds rank {state.get('rank')} of {state.get('world_size')}, "
            f"not rank {rank} of {world_size}"
        )
    return state


def truncate_metrics(path: str, step: int, *, source: str | None = None) -> None:
    """Cut ``metrics.jsonl`` at ``path`` back to its records up to ``step`` (the checkpoint the
    run resumes from); a torn last line (a run killed while writing it) is dropped too. Where
    there is no such file (resuming into another folder), start it from ``source``'s records."""
    lines: list[str] = []
    for candidate in (path, source):
        if candidate is None:
            continue
        try:
            with open(candidate, encoding="utf-8") as f:
                lines = f.read().splitlines()
            break
        except FileNotFoundError:
            continue
    else:
        return
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and int(record.get("step", 0)) <= step:
            kept.append(line)
    data = "".join(line + "\n" for line in kept).encode()
    atomic_write(path, lambda f: f.write(data))
