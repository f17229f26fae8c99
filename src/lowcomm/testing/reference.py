"""Single-process N-worker references of every algorithm: the same math, no communication.

The references are written per tensor, straight from the formulas in the design notes, and
independently of the algorithm classes (which work on flat buckets with ``torch._foreach_*``):
one per algorithm in :mod:`lowcomm.testing.references`, beside the state they share (the
workers, the anchor, the pseudo-gradient mean, the warm start). :func:`reference_run` drives
them. A real multi-process run of an algorithm (:func:`distributed_run`) must match
:func:`reference_run` on the same toy problem: bitwise where the order of floating-point
operations is the same (2 ranks), else to 1e-6.

A scenario is a plain dict::

    {"algo": "co2", "workers": 2, "sync_every": 3, "steps": 12, "inner": "sgd",
     "hyper": {"clip": 0.5, "clip_mode": "norm"}, "bucket_cap_mb": 0.0002, "seed": 0}

``hyper`` may hold ``"compression"`` (a spec string): every worker then compresses its
pseudo-gradient with the same codec and error feedback as the algorithms (:class:`RefCompression`),
and the mean is the mean of the decoded contributions.

The toy problem and the real algorithms' run of it are :mod:`lowcomm.testing.toy`'s, the
compressed means :mod:`lowcomm.testing.ref_compression`'s (both importable from here).
"""

from __future__ import annotations

from typing import Any

import torch

from lowcomm.testing.ref_compression import RefCompression
from lowcomm.testing.references import REFERENCES, ReferenceRun, World
from lowcomm.testing.toy import (
    distributed_run,
    inner_step,
    make_inner,
    schedule_lr,
    toy_batch,
    toy_model,
)

__all__ = [
    "RefCompression",
    "ReferenceRun",
    "distributed_run",
    "inner_step",
    "make_inner",
    "reference_run",
    "toy_batch",
    "toy_model",
]


def reference_run(scenario: dict[str, Any]) -> ReferenceRun:
    """Simulate ``scenario["workers"]`` workers in one process with no communication."""
    if scenario["algo"] not in REFERENCES:
        raise ValueError(f"no reference for {scenario['algo']!r}")
    world = World(scenario)
    reference = REFERENCES[world.algo](world)
    for step in range(1, world.steps + 1):
        for w in range(world.n):
            schedule_lr(world.inners[w], step, scenario)
            if step > world.warmup:
                inner_step(world.models[w], world.inners[w], w, step, world.seed)
        if step <= world.warmup:
            world.warm_step(step, reference.warm_anchors())
            continue
        with torch.no_grad():
            reference.step(step - world.warmup)  # the schedule starts after the warm start
    with torch.no_grad():
        reference.finish()
    world.out.final = [[p.detach().clone() for p in th] for th in world.thetas]
    return world.out
