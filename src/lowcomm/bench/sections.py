"""``lowcomm bench``'s micro-benchmark sections with flags of their own: the codec row (each
codec's encode + decode + error feedback against a clone of the same buckets,
:mod:`lowcomm.bench.codec`) and DDP parity (``--algo ddp`` against plain torch DDP,
:mod:`lowcomm.bench.ddp_parity`), each in the matrix's run or alone (``--codec-only``,
``--ddp-parity-only``)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

__all__ = [
    "CODEC_KEYS",
    "DDP_PARITY_KEYS",
    "codec_settings",
    "ddp_parity_settings",
    "note",
    "run_codec_only",
    "run_ddp_parity_only",
    "worker_threads",
]


CODEC_KEYS = ("codec", "codecs", "codec_sizes", "codec_repeats")
CODEC_ONLY_KEYS = {*CODEC_KEYS, "workers", "out", "codec_only", "overwrite"}


def codec_settings(given: dict[str, Any], threads: int) -> dict[str, Any]:
    """:func:`lowcomm.bench.codec.measure_codecs`'s settings from the flags given, checked
    (a bad codec or size fails here, before anything runs)."""
    from lowcomm.bench.codec import DEFAULT_CODECS, DEFAULT_SIZES_M, check_codec_settings

    codecs = given.get("codecs", list(DEFAULT_CODECS))
    sizes, repeats = given.get("codec_sizes", list(DEFAULT_SIZES_M)), given.get("codec_repeats", 5)
    check_codec_settings(codecs, sizes, repeats=repeats)
    return {"codecs": codecs, "sizes_m": sizes, "repeats": repeats, "threads": threads}


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def worker_threads(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)  # as lowcomm train gives a local worker


def run_codec_only(args: argparse.Namespace, given: dict[str, Any]) -> int:
    from lowcomm.bench.codec import run_codec
    from lowcomm.bench.report import format_codec_report

    wrong = sorted(k for k in given if k not in CODEC_ONLY_KEYS)
    if wrong:
        raise ValueError(f"--{wrong[0].replace('_', '-')} is not a flag of --codec-only")
    if given.get("codec") is False:
        raise ValueError("--codec-only runs the codec row: drop --no-codec")
    workers = given.get("workers", [2])
    if len(workers) != 1 or workers[0] < 1:
        raise ValueError("--codec-only measures with one worker's share of the cores: --workers N")
    settings = codec_settings(given, worker_threads(workers[0]))
    out = given.get("out", os.path.join("runs", "codec"))
    if os.path.exists(os.path.join(out, "results.json")) and not args.overwrite:
        raise ValueError(
            f"--out {out!r} already holds results; choose another folder or pass --overwrite"
        )
    command = "lowcomm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results = run_codec(out=out, command=command, progress=note, **settings)
    print(format_codec_report(results))
    print(f"results: {os.path.join(out, 'results.json')} (+ codec.md)")
    return 0


DDP_PARITY_KEYS = ("ddp_parity", "ddp_parity_steps")
_DDP_PARITY_ONLY_KEYS = {*DDP_PARITY_KEYS, "workers", "out", "ddp_parity_only", "overwrite"}
_DDP_PARITY_ONLY_KEYS |= {"seed"}


def ddp_parity_settings(given: dict[str, Any]) -> dict[str, Any]:
    """:func:`lowcomm.bench.ddp_parity.measure_ddp_parity`'s settings from the flags given."""
    workers = given.get("workers", [2])[0]
    steps = given.get("ddp_parity_steps", 200)
    if steps < 1 or workers < 2:
        raise ValueError(
            f"DDP parity needs --ddp-parity-steps >= 1 and --workers >= 2, got {steps} and "
            f"{workers}; e.g. --ddp-parity-steps 200 --workers 2"
        )
    return {"steps": steps, "workers": workers, "seed": given.get("seed", 0), "max_seconds": 600.0}


def run_ddp_parity_only(args: argparse.Namespace, given: dict[str, Any]) -> int:
    import json

    from lowcomm.bench.ddp_parity import measure_ddp_parity, parity_table
    from lowcomm.runfiles import json_safe, write_text

    wrong = sorted(k for k in given if k not in _DDP_PARITY_ONLY_KEYS)
    if wrong:
        raise ValueError(f"--{wrong[0].replace('_', '-')} is not a flag of --ddp-parity-only")
    settings = ddp_parity_settings(given)
    out = given.get("out", os.path.join("runs", "ddp-parity"))
    if os.path.exists(os.path.join(out, "results.json")) and not args.overwrite:
        raise ValueError(
            f"--out {out!r} already holds results; choose another folder or pass --overwrite"
        )
    note(f"DDP parity: {settings['workers']} workers, {settings['steps']} pairs of steps")
    result = measure_ddp_parity(**settings)
    command = "lowcomm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    os.makedirs(out, exist_ok=True)
    results = {"command": command, "ddp_parity": result}
    write_text(os.path.join(out, "results.json"), json.dumps(json_safe(results), indent=1) + "\n")
    table = parity_table(result)
    write_text(os.path.join(out, "ddp_parity.md"), table + "\n")
    print(table)
    print(f"results: {os.path.join(out, 'results.json')} (+ ddp_parity.md)")
    return 0
