"""Bytes on the wire per worker: NoLoCo's group exchange and DiLoCo's all-reduce per sync as the
number of workers grows, and DeMo's all-gather against DDP's all-reduce per step.

Every figure is the difference of two ``lowcomm train`` jobs of the default GPT that differ only
in length (one sync, or one step, more), so what a job does once (NoLoCo's closing all-reduce of
φ, the first evaluation) cancels out. Byte counts do not depend on timing, so a busy machine
gives the same table. Reproduce (about 5 minutes on 2 cores)::

    python benchmarks/bytes_per_sync.py

which prints the markdown table and writes ``benchmarks/bytes_per_sync.md``; each job's folder
is kept under ``benchmarks/results/bytes/`` (not committed).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "bytes"
H = 12  # steps per sync of the outer algorithms


def wire_bytes(algo: str, workers: int, steps: int, *extra: str) -> float:
    """Mean wire bytes per worker of one ``lowcomm train`` job."""
    out = OUT / f"{algo}-w{workers}-s{steps}"
    cmd = [sys.executable, "-m", "lowcomm", "train", "--algo", algo, "--workers", str(workers)]
    cmd += ["--steps", str(steps), "--eval-every", str(steps), "--eval-batches", "1"]
    cmd += ["--quiet", "--overwrite", "--out", str(out), *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    return float(summary["comm_mean"]["wire_bytes"])


def per_sync(algo: str, workers: int) -> float:
    args = ("--sync-every", str(H), "--sync-warmup", "0")
    return wire_bytes(algo, workers, 2 * H, *args) - wire_bytes(algo, workers, H, *args)


def per_step(algo: str, workers: int) -> float:
    return wire_bytes(algo, workers, 4) - wire_bytes(algo, workers, 2)


def main() -> None:
    lines = [
        "| workers | NoLoCo (n = 2) per sync | DiLoCo per sync | DeMo per step | DDP per step "
        "| DDP / DeMo |",
        "|---|---|---|---|---|---|",
    ]
    for workers in (2, 4, 8):
        noloco, diloco = per_sync("noloco", workers), per_sync("diloco", workers)
        demo, ddp = per_step("demo", workers) / 2, per_step("ddp", workers) / 2
        lines.append(
            f"| {workers} | {noloco / 1e6:.3f} MB | {diloco / 1e6:.3f} MB | {demo / 1e3:.1f} kB "
            f"| {ddp / 1e6:.3f} MB | {ddp / demo:.1f}× |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    (HERE / "bytes_per_sync.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
