"""Memory report: bytes each rank holds for an outer algorithm, sharded and unsharded.

For every algorithm and group size N, N real processes on a gloo group (127.0.0.1) build the
default GPT of ``lowcomm train``, wrap it in the algorithm (the job's defaults, without the warm
start, whose steps are DDP's) with ``shard_outer_state`` off and on, train two rounds (so that
lazily created outer state, such as SGD's momentum buffer, exists) and read
:meth:`~lowcomm.outer.engine.OuterAlgorithm.memory_report`: bytes of the distinct tensor
storages behind

* **state**, what persists between syncs (anchor, outer optimizer or momentum, statistics); and
* **buffers**, the communication buffers (pseudo-gradients in flight, snapshots, gathered
  anchors), full size in both modes.

Each row also gives the model's own fp32 parameter bytes, for the ratios; the largest value
over the ranks is reported (ranks differ only by padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MEMORY_ALGOS", "measure_memory"]

MEMORY_ALGOS = ("co2", "diloco", "streaming")
"""The algorithms measured by default: one of each kind of outer state ``shard_outer_state``
shards (CO2's, DiLoCo's outer optimizer, Streaming DiLoCo's per fragment); SlowMo's is DiLoCo's,
and co2-eager, cocodc and localsgd do not shard."""


def _job(
    rank: int, world_size: int, algos: list[str], overrides: dict[str, Any]
) -> list[dict[str, Any]]:
    from lowcomm.data import get_batch, load_corpus, make_generator
    from lowcomm.train.config import config_from_dict
    from lowcomm.train.model import build_gpt, inner_optimizer

    rows = []
    for algo in algos:
        # no warm start: its steps are DDP's, and the two rounds must be the algorithm's own
        values = {"sync_warmup": 0, **overrides, "algo": algo, "sync_every": 4}
        cfg = config_from_dict(values, source="bench")
        corpus = load_corpus(cfg.data)
        for sharded in (False, True):
            torch.manual_seed(cfg.seed)
            model = build_gpt(cfg, corpus.vocab_size)
            inner = inner_optimizer(model, cfg)
            kwargs: dict[str, Any] = {**cfg.algorithm_kwargs(), "shard_outer_state": sharded}
            outer = cfg.algorithm_class()(model, inner, **kwargs)
            gen = make_generator(cfg.seed, rank)
            for _ in range(2 * cfg.sync_every):
                x, y = get_batch(corpus.train, cfg.batch_size, cfg.block_size, gen)
                model(x, y)[1].backward()
                inner.step()
                inner.zero_grad(set_to_none=True)
                outer.step()
            report = outer.memory_report()
            outer.finish()
            model_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
            rows.append(
                {
                    "algo": algo,
                    "sharded": sharded,
                    "workers": world_size,
                    "model_bytes": model_bytes,
                    "state_bytes": report["state"],
                    "buffer_bytes": report["buffers"],
                }
            )
    return rows


def measure_memory(
    workers: Sequence[int],
    *,
    algos: Sequence[str] = MEMORY_ALGOS,
    train_overrides: dict[str, Any] | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Measure every algorithm, sharded and not, on groups of each size in ``workers``.

    Returns ``{"rows": [...]}``, one row per (algorithm, N, sharded) with ``state_bytes``,
    ``buffer_bytes``, ``model_bytes``, the ratios to the model and, for sharded rows,
    ``state_vs_unsharded`` (sharded state ÷ unsharded state, ideally 1/N).
    """
    from lowcomm.procs.workers import run_workers

    rows: list[dict[str, Any]] = []
    for n in workers:
        per_rank = run_workers(
            _job, n, list(algos), dict(train_overrides or {}), timeout_s=timeout_s
        )
        for i, row in enumerate(per_rank[0]):
            worst = dict(row)
            for key in ("state_bytes", "buffer_bytes"):
                worst[key] = max(r[i][key] for r in per_rank)
            rows.append(worst)
    unsharded = {(r["algo"], r["workers"]): r["state_bytes"] for r in rows if not r["sharded"]}
    for r in rows:
        r["state_over_model"] = r["state_bytes"] / r["model_bytes"]
        r["buffers_over_model"] = r["buffer_bytes"] / r["model_bytes"]
        if r["sharded"]:
            r["state_vs_unsharded"] = r["state_bytes"] / unsharded[(r["algo"], r["workers"])]
    return {"rows": rows}
