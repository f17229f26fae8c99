"""The tiny ``lowcomm train`` job the fault, resume and reliability checks run."""

from __future__ import annotations

__all__ = ["TINY_JOB_ALGO_ARGS", "TINY_JOB_ARGS", "TINY_JOB_STEPS"]

TINY_JOB_STEPS = 12

TINY_JOB_ARGS: list[str] = [
    "--steps", str(TINY_JOB_STEPS), "--sync-every", "4", "--eval-every", "4",
    "--eval-batches", "1", "--batch-size", "2", "--block-size", "16", "--n-layer", "2",
    "--n-head", "2", "--n-embd", "32", "--warmup", "2", "--workers", "2", "--log-every", "2",
    "--dropout", "0.1", "--quiet",
]  # fmt: skip
"""12 steps, rounds of 4 (boundaries 4, 8, 12), 2 workers; dropout so that the global RNG
state matters to an exact resume."""

TINY_JOB_ALGO_ARGS: dict[str, list[str]] = {
    "co2": [],
    "co2-eager": [],
    "diloco": [],
    "slowmo": [],
    "localsgd": [],
    # 2 fragments: a sync point every 2 steps, its all-reduce launched 1 step early (odd steps)
    "streaming": ["--num-fragments", "2", "--overlap", "1"],
    "cocodc": ["--num-fragments", "2", "--overlap", "1"],
    "ddp": [],
}
"""Per ``--algo``: the flags added to :data:`TINY_JOB_ARGS`."""
