"""Overhead micro-benchmark: what lowcomm's hook costs a training step.

One process, the default GPT of ``lowcomm train``, a single-rank gloo group (so no time goes to
waiting for peers and every collective completes at once: what is left is lowcomm's own work).
Two copies of the model and inner optimizer train side by side, one step each in turn (which one
goes first flips every pair) so that drift in the machine's speed hits both alike:

* **bare**: forward, backward, ``optimizer.step()``, ``zero_grad()``;
* **hooked**: the same, then ``algo.step()``.

Reported per algorithm, all medians over the timed steps:

* ``bare_step_s``: a bare step;
* ``hook_s``: the ``algo.step()`` call on an inner step (no outer work), timed around the call,
  and ``hook_fraction = hook_s / bare_step_s``: the hook's overhead per inner step;
* ``hooked_step_s``, and ``ab_overhead``: the median over step pairs of hooked / bare time,
  less 1: the same overhead seen as whole steps (noisier: it compares two noisy numbers);
* ``outer_step_s``: the ``algo.step()`` calls that did outer work (launched a collective or
  applied an outer update), and ``outer_over_inner = outer_step_s / bare_step_s``.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["measure_overhead", "one_rank_group"]

logger = logging.getLogger(__name__)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


@contextlib.contextmanager
def one_rank_group(threads: int | None) -> Iterator[int]:
    """A single-rank gloo group for a measurement (made here when none is initialised, and
    destroyed afterwards; the existing default group otherwise), with torch's intra-op
    threads set to ``threads`` (``None``: as they are) and restored; yields the threads."""
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        created = True
    try:
        yield torch.get_num_threads()
    finally:
        if created:
            dist.destroy_process_group()
        torch.set_num_threads(saved)


def measure_overhead(
    algos: Sequence[str],
    *,
    rounds: int = 8,
    sync_every: int = 12,
    seed: int = 0,
    train_overrides: dict[str, Any] | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Time bare against hooked steps for each of ``algos`` (``lowcomm train --algo`` values).

    Initialises (and afterwards destroys) a single-rank gloo process group when none is
    initialised; uses the existing default group otherwise.

    Args:
        threads: torch intra-op threads while measuring (restored afterwards); default the
            current setting. Give a worker's share of the cores (``lowcomm train`` gives each
            of N local workers cpu_count // N) to time the step a worker runs.

    Returns:
        ``{"threads", "steps_per_algorithm", "algorithms": [per-algorithm dict]}``; see the
        module docstring for the keys.
    """
    with one_rank_group(threads) as used_threads:
        rows = [
            _measure_one(algo, rounds, sync_every, seed, dict(train_overrides or {}))
            for algo in algos
        ]
    return {
        "threads": used_threads,
        "steps_per_algorithm": rounds * sync_every,
        "world_size": 1,
        "algorithms": rows,
    }


def _measure_one(
    algo_name: str, rounds: int, sync_every: int, seed: int, overrides: dict[str, Any]
) -> dict[str, Any]:
    from lowcomm.data import get_batch, load_corpus, make_generator
    from lowcomm.train.config import config_from_dict
    from lowcomm.train.model import build_gpt, inner_optimizer

    base, _, codec = algo_name.partition("+")
    fields: dict[str, Any] = {"algo": base, "compression": codec} if codec else {"algo": base}
    values = {**overrides, **fields, "sync_every": sync_every, "seed": seed}
    # the algorithm's own steps are timed, not a warm start's (unless one is asked for)
    values.setdefault("sync_warmup", 0)
    cfg = config_from_dict(values, source="bench")
    corpus = load_corpus(cfg.data)

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = build_gpt(cfg, corpus.vocab_size)
        return model, inner_optimizer(model, cfg)

    bare_model, bare_opt = build()
    hooked_model, hooked_opt = build()
    algo = cfg.algorithm_class()(hooked_model, hooked_opt, **cfg.algorithm_kwargs())
    gen = make_generator(seed, 0)

    def inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        x, y = get_batch(corpus.train, cfg.batch_size, cfg.block_size, gen)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    bare: list[float] = []
    hooked: list[float] = []
    paired: list[float] = []  # hooked / bare of the two steps of one pair (inner steps only)
    hook: list[float] = []
    outer: list[float] = []

    def bare_step() -> float:
        t0 = time.perf_counter()
        inner_step(bare_model, bare_opt)
        return time.perf_counter() - t0

    def hooked_step() -> tuple[float, float, bool]:
        t0 = time.perf_counter()
        inner_step(hooked_model, hooked_opt)
        before = (algo.stats.collectives, algo.rounds)
        t1 = time.perf_counter()
        algo.step()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1, (algo.stats.collectives, algo.rounds) != before

    for _ in range(sync_every):  # warm-up: allocator, caches, the first outer round
        bare_step()
        hooked_step()
    # Steps alternate, the order flipping every step, so both see the same machine.
    for i in range(rounds * sync_every):
        if i % 2 == 0:
            b = bare_step()
            h, call, did_outer = hooked_step()
        else:
            h, call, did_outer = hooked_step()
            b = bare_step()
        bare.append(b)
        if did_outer:
            outer.append(call)
        else:
            hook.append(call)
            hooked.append(h)
            paired.append(h / b)
    algo.finish()

    bare_s = _median(bare)
    hook_s = _median(hook)
    hooked_s = _median(hooked)
    outer_s = _median(outer)
    assert bare_s is not None
    row: dict[str, Any] = {
        "algo": algo_name,
        "bare_step_s": bare_s,
        "hooked_step_s": hooked_s,
        "hook_s": hook_s,
        "outer_step_s": outer_s,
        "hook_fraction": None if hook_s is None else hook_s / bare_s,
        "ab_overhead": None if not paired else statistics.median(paired) - 1.0,
        "outer_over_inner": None if outer_s is None else outer_s / bare_s,
        "bare_steps": len(bare),
        "inner_hook_calls": len(hook),
        "outer_calls": len(outer),
        "bare_step_spread": _spread(bare),
    }
    logger.info(
        "overhead %s: bare step %.2f ms, hook %.1f us (%.3f%%), outer step %.2f ms",
        algo_name,
        bare_s * 1e3,
        (hook_s or 0.0) * 1e6,
        100 * (hook_s or 0.0) / bare_s,
        (outer_s or 0.0) * 1e3,
    )
    return row


def _spread(values: Sequence[float]) -> float | None:
    """Interquartile range relative to the median: how noisy the step times were."""
    if len(values) < 4:
        return None
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / statistics.median(values)
