"""DDP parity: ``lowcomm train --algo ddp`` against plain ``DistributedDataParallel``.

``--algo ddp`` is the synchronous baseline every other algorithm is compared with, so it must
cost what torch's DDP costs. Here N real processes (gloo over 127.0.0.1, no emulated link) each
hold two copies of the job's GPT, built from the same seed and each with the job's AdamW
(:func:`~lowcomm.train.model.inner_optimizer`):

* **torch**: ``DistributedDataParallel(gpt)`` with torch's defaults and its built-in C++
  all-reduce hook (its buckets: a first one of 1 MiB, then 25 MiB; the job passes its
  ``bucket_cap_mb``, which makes the first as large as the others, one bucket for the default
  GPT: ``torch_bucket_cap_mb`` gives torch the job's buckets, to compare the hooks alone);
* **lowcomm**: the model as ``lowcomm train --algo ddp`` wraps it, built by the job's own
  :meth:`~lowcomm.train.synchronisation.Synchronisation.create` (DDP with the job's
  ``bucket_cap_mb`` and a :class:`~lowcomm.comm.DDPCommMeter` hook), stepped as the job's loop
  steps it: forward and backward, ``sync.backward_done()``, the optimizer's step,
  ``zero_grad(set_to_none=True)``, ``sync.after_step()``.

They train on the same batches (each rank's own stream, as in the job), one step each in turn,
the order flipping every pair, so drift in the machine's speed hits both alike. A step's time is
the slowest rank's (the ranks meet in every all-reduce). Reported: the median step time of each,
``ratio`` (lowcomm's median over torch's) and the per-pair ratios' median, quartiles and a 95%
confidence interval of their median (distribution-free, from order statistics) as its noise.

The loop's bookkeeping shared by every algorithm (the loss records, progress bar, evaluations)
is left out of both: it is not DDP's. Both copies also end with their parameters compared: the
meter divides each bucket by N and sums (as torch's Python ``allreduce_hook`` does); torch's
built-in hook multiplies by 1/N as it copies the gradients into the bucket, then sums. With N a
power of two that is the same float operation and the copies end bit for bit equal (N = 2 and 4
checked); otherwise they differ in the last bits (N = 3: about 5e-6 after 22 steps of a tiny GPT).

Besides wall time, each step's CPU time of the whole process (every thread's, gloo's included)
is compared: the host work each path adds, less sensitive to other work on the machine.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["measure_ddp_parity", "parity_table"]

logger = logging.getLogger(__name__)


def measure_ddp_parity(
    *,
    steps: int = 200,
    workers: int = 2,
    seed: int = 0,
    warmup: int = 10,
    threads: int | None = None,
    max_seconds: float = 300.0,
    train_overrides: dict[str, Any] | None = None,
    torch_bucket_cap_mb: float | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Time plain DDP against ``lowcomm train --algo ddp``, ``steps`` pairs of steps after
    ``warmup`` untimed pairs, on ``workers`` new gloo processes (see the module docstring).

    Args:
        steps: timed pairs (one step of each); fewer if ``max_seconds`` runs out first.
        workers: processes (N).
        seed: the models' initialisation and the batch streams (``lowcomm train --seed``).
        warmup: untimed pairs first (allocator, DDP's first-step bucket rebuild).
        threads: torch intra-op threads per worker; default what ``lowcomm train`` gives each
            of ``workers`` local workers (the usable cores over their number, at least 1).
        max_seconds: the timed pairs stop once this much time has passed (the ranks agree
            after each pair).
        train_overrides: ``lowcomm train`` settings of the job (``n_layer``, ``batch_size``,
            ...; its defaults otherwise). ``algo`` is ddp; ``link`` and ``compression`` are
            not allowed (this compares the uncompressed baseline over the real network).
        torch_bucket_cap_mb: plain DDP's ``bucket_cap_mb``; default torch's own (25 MiB
            buckets after a first one of 1 MiB). The job always passes its ``bucket_cap_mb``
            (25 by default), which makes the first bucket as large as the others: give the
            same value here to compare the hooks alone, on the same buckets.
        timeout_s: the workers are stopped after this long; default ``max_seconds`` plus 5
            minutes (set-up and warm-up).

    Returns:
        ``torch_step_s`` and ``lowcomm_step_s`` (medians), ``ratio`` (lowcomm / torch),
        ``pair_ratio`` (``median``, ``q1``, ``q3``, ``ci95``: of lowcomm / torch per pair),
        ``pairs``, ``params_equal`` (both ended with bitwise equal parameters on every rank),
        ``max_abs_diff``, ``lowcomm_stats`` (the meter's counters, rank 0),
        ``collectives_per_step``, ``torch_steps_s`` and ``lowcomm_steps_s`` (every pair's),
        ``torch_cpu_s`` and ``lowcomm_cpu_s`` (the process's CPU time per step, medians; the
        busier rank's) with ``cpu_pair_ratio`` (as ``pair_ratio``), ``stopped_early``, and the
        settings (``workers``, ``threads``, ``warmup``, ``seed``, ``torch_bucket_cap_mb``,
        ``model``).
    """
    from lowcomm.procs.workers import run_workers
    from lowcomm.train.config import config_from_dict
    from lowcomm.train.worker import usable_cores

    overrides = dict(train_overrides or {})
    for key in ("link", "compression", "algo"):
        if overrides.get(key) is not None:
            raise ValueError(
                f"train_overrides[{key!r}]={overrides[key]!r}: the parity benchmark runs "
                "--algo ddp uncompressed over the real network; leave it out"
            )
    if steps < 1 or warmup < 0 or workers < 2:
        raise ValueError(
            f"steps={steps}, warmup={warmup}, workers={workers}: need steps >= 1, warmup >= 0 "
            "and workers >= 2"
        )
    # a bad setting fails here, before any process starts (ConfigError names the key)
    config_from_dict({**overrides, "algo": "ddp", "seed": seed}, source="ddp parity")
    if threads is None:
        threads = max(1, usable_cores() // workers)
    if timeout_s is None:
        timeout_s = max_seconds + 300.0
    per_rank = run_workers(
        _worker,
        workers,
        steps,
        warmup,
        seed,
        threads,
        max_seconds,
        overrides,
        torch_bucket_cap_mb,
        timeout_s=timeout_s,
    )
    rank0 = per_rank[0]
    torch_s: list[float] = rank0["torch_s"]
    lowcomm_s: list[float] = rank0["lowcomm_s"]
    pair = [b / a for a, b in zip(torch_s, lowcomm_s)]
    torch_med, lowcomm_med = statistics.median(torch_s), statistics.median(lowcomm_s)
    result: dict[str, Any] = {
        "workers": workers,
        "threads": threads,
        "warmup": warmup,
        "seed": seed,
        "torch_bucket_cap_mb": torch_bucket_cap_mb,
        "model": rank0["model"],
        "pairs": len(pair),
        "stopped_early": len(pair) < steps,
        "torch_step_s": torch_med,
        "lowcomm_step_s": lowcomm_med,
        "ratio": lowcomm_med / torch_med,
        "pair_ratio": _summary(pair),
        "torch_cpu_s": statistics.median(rank0["torch_cpu_s"]),
        "lowcomm_cpu_s": statistics.median(rank0["lowcomm_cpu_s"]),
        "cpu_pair_ratio": _summary(
            [b / a for a, b in zip(rank0["torch_cpu_s"], rank0["lowcomm_cpu_s"])]
        ),
        "params_equal": all(r["params_equal"] for r in per_rank),
        "max_abs_diff": max(r["max_abs_diff"] for r in per_rank),
        "lowcomm_stats": rank0["stats"],
        "collectives_per_step": rank0["collectives_per_step"],
        "torch_steps_s": torch_s,
        "lowcomm_steps_s": lowcomm_s,
    }
    logger.info(
        "ddp parity (%d workers, %d pairs): torch %.2f ms, lowcomm %.2f ms, ratio %.4f "
        "(pairs: median %.4f, 95%% CI %.4f-%.4f)",
        workers,
        len(pair),
        torch_med * 1e3,
        lowcomm_med * 1e3,
        result["ratio"],
        result["pair_ratio"]["median"],
        *result["pair_ratio"]["ci95"],
    )
    return result


def parity_table(r: dict[str, Any]) -> str:
    """The markdown table of a :func:`measure_ddp_parity` result: median step times, their
    ratio, the per-pair ratios' quartiles and 95% CI, and the CPU time per step."""
    pr, cr = r["pair_ratio"], r["cpu_pair_ratio"]
    rows = [
        "| | torch DDP | lowcomm `--algo ddp` | lowcomm / torch |",
        "|---|---|---|---|",
        f"| median step | {r['torch_step_s'] * 1e3:.1f} ms | {r['lowcomm_step_s'] * 1e3:.1f} ms "
        f"| {r['ratio']:.3f} |",
        f"| per-pair ratio: median [quartiles] | | | {pr['median']:.3f} "
        f"[{pr['q1']:.3f}, {pr['q3']:.3f}] |",
        f"| per-pair ratio: 95% CI of the median | | | {pr['ci95'][0]:.3f} – {pr['ci95'][1]:.3f} |",
        f"| process CPU time per step (median; pair ratio) | {r['torch_cpu_s'] * 1e3:.1f} ms "
        f"| {r['lowcomm_cpu_s'] * 1e3:.1f} ms | {cr['median']:.3f} "
        f"[{cr['ci95'][0]:.3f} – {cr['ci95'][1]:.3f}] |",
    ]
    return "\n".join(rows)


def _summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, quartiles and a distribution-free 95% confidence interval of the median (the
    order statistics n/2 -+ 0.98 sqrt(n), as for a binomial(n, 1/2) sign test)."""
    xs = sorted(values)
    n = len(xs)
    q1, q3 = (statistics.quantiles(xs, n=4)[0::2]) if n >= 2 else (xs[0], xs[0])
    half = 0.98 * math.sqrt(n)
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half) - 1)
    return {"median": statistics.median(xs), "q1": q1, "q3": q3, "ci95": [xs[lo], xs[hi]]}


def _worker(
    rank: int,
    world: int,
    steps: int,
    warmup: int,
    seed: int,
    threads: int,
    max_seconds: float,
    overrides: dict[str, Any],
    torch_bucket_cap_mb: float | None,
) -> dict[str, Any]:
    from lowcomm.data import get_batch, load_corpus, make_generator
    from lowcomm.train.config import config_from_dict
    from lowcomm.train.model import build_gpt, inner_optimizer
    from lowcomm.train.synchronisation import Synchronisation
    from lowcomm.train.topology import Topology

    torch.set_num_threads(threads)
    device = torch.device("cpu")
    cfg = config_from_dict({**overrides, "algo": "ddp", "seed": seed}, source="ddp parity")
    corpus = load_corpus(cfg.data)

    # as the job builds it (loop._Job.build): seeded model, its optimizer, then the sync
    torch.manual_seed(cfg.seed)
    gpt = build_gpt(cfg, corpus.vocab_size).to(device)
    inner = inner_optimizer(gpt, cfg)
    sync = Synchronisation.create(cfg, Topology.create(cfg), gpt, inner, None, device)

    torch.manual_seed(cfg.seed)
    plain_gpt = build_gpt(cfg, corpus.vocab_size).to(device)
    plain_opt = inner_optimizer(plain_gpt, cfg)
    plain = nn.parallel.DistributedDataParallel(plain_gpt, bucket_cap_mb=torch_bucket_cap_mb)

    def torch_step(x: torch.Tensor, y: torch.Tensor) -> None:
        _, loss = plain(x, y)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    def lowcomm_step(x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        # the body of the job's step for --algo ddp (loop._Job.run), records left out
        _, loss = sync.model(x, y)
        loss.backward()
        sync.backward_done()
        inner.step()
        inner.zero_grad(set_to_none=True)
        sync.after_step(step)

    gen = make_generator(cfg.seed, rank)
    torch_s: list[float] = []
    lowcomm_s: list[float] = []
    torch_cpu: list[float] = []  # the process's CPU time (every thread's, gloo's too)
    lowcomm_cpu: list[float] = []
    stop = torch.zeros(1)
    deadline = None
    collectives_before = 0
    for i in range(warmup + steps):
        if i == warmup:
            deadline = time.monotonic() + max_seconds
            collectives_before = sync.stats.collectives
        x, y = get_batch(corpus.train, cfg.batch_size, cfg.block_size, gen)
        order = ("torch", "lowcomm") if i % 2 == 0 else ("lowcomm", "torch")
        took: dict[str, tuple[float, float]] = {}
        for which in order:
            c0, t0 = time.process_time(), time.perf_counter()
            if which == "torch":
                torch_step(x, y)
            else:
                lowcomm_step(x, y, i + 1)
            took[which] = (time.perf_counter() - t0, time.process_time() - c0)
        if i >= warmup:
            torch_s.append(took["torch"][0])
            lowcomm_s.append(took["lowcomm"][0])
            torch_cpu.append(took["torch"][1])
            lowcomm_cpu.append(took["lowcomm"][1])
            # every rank stops after the same pair
            stop.fill_(float(deadline is not None and time.monotonic() > deadline))
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() > 0:
                break
    sync.finish()
    pairs = len(torch_s)
    collectives_per_step = (sync.stats.collectives - collectives_before) / max(1, pairs)

    # a step's time is the slowest rank's
    times = torch.tensor([torch_s, lowcomm_s, torch_cpu, lowcomm_cpu], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)

    with torch.no_grad():
        a = [p.detach() for p in plain_gpt.parameters()]
        b = [p.detach() for p in gpt.parameters()]
        equal = all(torch.equal(p, q) for p, q in zip(a, b))
        diff = max(float((p - q).abs().max()) for p, q in zip(a, b))
    return {
        "torch_s": times[0].tolist(),
        "lowcomm_s": times[1].tolist(),
        "torch_cpu_s": times[2].tolist(),
        "lowcomm_cpu_s": times[3].tolist(),
        "params_equal": equal,
        "max_abs_diff": diff,
        "stats": sync.stats.as_dict(),
        "collectives_per_step": collectives_per_step,
        "model": {
            "n_layer": cfg.n_layer,
            "n_embd": cfg.n_embd,
            "n_head": cfg.n_head,
            "block_size": cfg.block_size,
            "batch_size": cfg.batch_size,
            "parameters": sum(p.numel() for p in gpt.parameters()),
            "bucket_cap_mb": cfg.bucket_cap_mb,
        },
    }
