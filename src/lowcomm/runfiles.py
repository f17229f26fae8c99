"""How lowcomm writes and reads the files of a run folder, whatever wrote them: JSON that a
crash cannot leave half-written (:func:`atomic_write`, :func:`write_json`), metrics one record a
line (:class:`MetricsWriter`, :func:`read_metrics`), checkpoints saved whole or not at all and
loaded with a message that names the problem (:func:`save_checkpoint`, :func:`load_checkpoint`),
OS errors described with their fix (:func:`describe_os_error`), and the loss plot
(:func:`plot_losses`). It imports nothing of lowcomm: every command and the job stand on it.
What a ``lowcomm train`` run leaves in its folder is :mod:`lowcomm.train.metrics`."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import pickle
import re
import shutil
import uuid
import warnings
from typing import Any

import torch

__all__ = [
    "atomic_write",
    "check_writable_folder",
    "CheckpointError",
    "describe_os_error",
    "free_bytes",
    "fsync_dir",
    "json_safe",
    "load_checkpoint",
    "MetricsWriter",
    "plot_losses",
    "read_metrics",
    "save_checkpoint",
    "smoothed",
    "write_json",
    "write_text",
]


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (JSON has no NaN or inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class MetricsWriter:
    """Writes one JSON object per line to ``path`` (a new file, or appended to with ``append``,
    as a resumed run does) and flushes it, so a crashed run keeps its metrics up to the crash."""

    def __init__(self, path: str, *, append: bool = False) -> None:
        self.path = path
        mode = "a" if append else "w"
        self._f = open(path, mode, encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(json_safe(record)) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class _CheckedFile:
    """A file for ``torch.save`` that keeps the first ``OSError`` of its writes.

    Given a real file, torch writes through its descriptor and turns a failed write into a
    ``RuntimeError`` ("unexpected pos ...") that no longer says why; through this wrapper the
    write is Python's own, and the ``OSError`` (``ENOSPC``: "No space left on device") is kept
    for :func:`atomic_write` to raise."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self._f.write(data))
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self._f.flush()


def atomic_write(path: str, write: Any) -> None:
    """Write through a temporary file in the same folder, fsync, then ``os.replace``: readers see
    the old file or the new one, never a torn one.

    A failed write removes the temporary file (the space it took is free again) and raises the
    ``OSError`` that caused it with ``filename`` set to ``path``: ``ENOSPC`` for a full disk,
    also where the writer (``torch.save``) reported it as another error."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    checked: _CheckedFile | None = None
    try:
        with open(tmp, "xb") as f:
            checked = _CheckedFile(f)
            write(checked)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        cause = checked.error if checked is not None and checked.error is not None else e
        if isinstance(cause, OSError):
            raise OSError(cause.errno, cause.strerror or str(cause), path) from e
        raise
    fsync_dir(folder)  # make the rename itself durable


def free_bytes(path: str) -> int | None:
    """Free space on the filesystem that holds ``path`` (or its nearest existing parent)."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def describe_os_error(error: OSError, *, option: str | None = None) -> str:
    """One line for an ``OSError`` on ``error.filename`` (an output that cannot be written: a
    read-only, missing or full place): the path, why, and the fix, naming ``option`` (the flag
    that moves the output, ``"--out"``) when the caller has one."""
    path = error.filename
    where = f"{path}: " if path else ""
    reason = error.strerror or str(error)
    elsewhere = f"point {option} elsewhere" if option else "choose another place"
    code = error.errno
    if code == errno.ENOSPC:
        free = free_bytes(path) if path else None
        room = f" ({free / 1e6:,.1f} MB free there)" if free is not None else ""
        target = f"point {option} at another disk" if option else "choose another disk"
        return f"{where}no space left on device{room}; free some space or {target}"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        target = f"point {option} at" if option else "choose"
        return f"{where}{reason}; {target} a folder you can write to"
    if code == errno.ENOENT:
        return f"{where}{reason} (a folder on its way does not exist); create it or {elsewhere}"
    if code in (errno.EEXIST, errno.ENOTDIR):
        return f"{where}a file is in the way where a folder is needed; {elsewhere}"
    if code == errno.EISDIR:
        return f"{where}a folder is in the way where a file is needed; {elsewhere}"
    return f"{where}{reason}; {elsewhere}"


def fsync_dir(folder: str) -> None:
    """fsync a folder, so that renames into it survive a crash (not possible on every
    platform: then a no-op)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_writable_folder(folder: str) -> None:
    """Whether ``folder`` can be created (with its parents) and written: an output place that is
    read-only, full or blocked by a file fails here, before any work, with the ``OSError``
    naming the path. Leaves nothing behind: the folders it had to create are removed again."""
    created = []
    parent = os.path.abspath(folder)
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        created.append(parent)
        parent = os.path.dirname(parent)
    probe = os.path.join(folder, f".lowcomm-write-check-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "xb") as f:
            f.write(b"lowcomm")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), e.filename or folder) from e
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
        for path in created:  # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(path)


def write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) atomically (:func:`atomic_write`)."""
    data = text.encode()
    atomic_write(path, lambda f: f.write(data))


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    data = (json.dumps(json_safe(obj), indent=2) + "\n").encode()
    atomic_write(path, lambda f: f.write(data))


def save_checkpoint(path: str, checkpoint: dict[str, Any]) -> None:
    """``torch.save`` atomically (temporary file in the same folder, fsync, ``os.replace``); a
    full disk raises ``OSError(ENOSPC)`` naming ``path`` (:func:`atomic_write`)."""
    atomic_write(path, lambda f: torch.save(checkpoint, f))


class CheckpointError(ValueError):
    """A file that is not a checkpoint lowcomm can load (damaged, of another kind, or holding
    Python objects that loading would have to run)."""


def load_checkpoint(path: str, *, what: str = "a lowcomm checkpoint", hint: str = "") -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU: tensors, numbers, strings and
    plain containers only. A file holding anything else (a pickle that would call a function
    when loaded: how a planted checkpoint runs code) is refused before any of it runs, and never
    with a suggestion to load it unsafely.

    Every file lowcomm loads that a user or a peer can hand it goes through here.

    Raises:
        CheckpointError: naming ``path`` and why; ``what`` says what it should have been, and
            ``hint`` (appended after a semicolon) how to go on.
    """
    tail = f"; {hint}" if hint else ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols
            return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise CheckpointError(f"{path!r} cannot be read ({reason}){tail}") from None
    except pickle.UnpicklingError as e:
        # torch's message suggests loading the file unsafely: never pass that on
        found = re.search(r"\bGLOBAL ([\w.]+)", str(e))
        if found:
            raise CheckpointError(
                f"{path!r} is not {what}: it holds Python objects other than tensors, numbers "
                f"and strings ({found.group(1)}), which lowcomm never loads: loading them can "
                f"run code{tail}"
            ) from None
        raise CheckpointError(f"{path!r} is not {what}: {_UNREADABLE}{tail}") from None
    except Exception:  # torch.load raises many kinds on a file it did not write
        raise CheckpointError(f"{path!r} is not {what}: {_UNREADABLE}{tail}") from None


_UNREADABLE = "torch cannot read it (the file is damaged, or torch.save did not write it)"


def smoothed(values: list[float], *, fraction: float = 0.04) -> list[float]:
    """A centred moving average of ``values`` over about ``fraction`` of them (at least 3): no
    lag behind the raw curve, unlike a running average. Near the ends the window shrinks
    symmetrically, so it stays centred there too."""
    n = len(values)
    half = max(1, round(n * fraction / 2))
    out = []
    for i in range(n):
        w = min(half, i, n - 1 - i)
        window = values[i - w : i + w + 1]
        out.append(sum(window) / len(window))
    return out


def plot_losses(metrics_path: str, png_path: str, *, title: str | None = None) -> None:
    """Training loss (raw and smoothed) and validation loss against step, to ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    steps = [r["step"] for r in records if r["kind"] == "step" and r["loss"] is not None]
    losses = [r["loss"] for r in records if r["kind"] == "step" and r["loss"] is not None]
    ev = [(r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"]
    smooth = smoothed(losses)

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if steps:
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (rank 0)")
        ax.plot(steps, smooth, color="tab:blue", linewidth=1.5, label="train, smoothed")
    if ev:
        ax.plot(
            [s for s, _ in ev],
            [v for _, v in ev],
            color="tab:orange",
            marker="o",
            markersize=3.5,
            linewidth=1.5,
            label="validation",
        )
    if title:
        ax.set_title(title, fontsize=10)
    ax.set_xlabel("inner step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
