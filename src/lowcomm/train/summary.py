"""The files that describe a ``lowcomm train`` run: ``config.json`` (:func:`resolved_config`),
``summary.json`` of a finished run (:func:`run_summary`) and what a failed run had measured
(:func:`failed_summary`)."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.link import EmulatedLink
from lowcomm.registry import REGISTRY
from lowcomm.runfiles import write_json
from lowcomm.train.checkpoint import newest_intact
from lowcomm.train.config import TrainConfig
from lowcomm.train.nodes import describe_layout, node_link
from lowcomm.train.outer_keys import sync_codec

__all__ = ["ENDED", "failed_summary", "record_path", "resolved_config", "run_summary"]


def resolved_config(cfg: TrainConfig, world: int, corpus: Any) -> dict[str, Any]:
    out = cfg.to_dict()
    out["resolved"] = {
        "world_size": world,
        "layout": describe_layout(cfg, world),
        "backend": dist.get_backend(),
        "eval_interval": cfg.eval_interval,
        "algorithm_kwargs": cfg.algorithm_kwargs(),
        "corpus": str(corpus.source),
        "vocab_size": int(corpus.vocab_size),
        "torch": torch.__version__,
    }
    return out


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def run_summary(
    cfg: TrainConfig,
    *,
    world: int,
    tokens: int,
    wall_s: float,
    train_s: float,
    eval_s: float,
    val_start: float,
    val_end: float,
    per_rank: list[dict[str, Any]],
    n_params: int,
    ceiling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    workers = []
    for r in sorted(per_rank, key=lambda d: d["rank"]):
        workers.append(
            {
                **r,
                "payload_bytes_per_step": r["payload_bytes"] / cfg.steps,
                "wire_bytes_per_step": r["wire_bytes"] / cfg.steps,
            }
        )
    keys = (
        "collectives",
        "payload_bytes",
        "wire_bytes",
        "payload_bytes_per_step",
        "wire_bytes_per_step",
        "blocked_s",
        "in_flight_s",
        "hidden_fraction",
        "rounds",
        "quorum_wait_s",
    )
    skipped = max((int(w.get("skipped_updates", 0)) for w in workers), default=0)
    mean = {k: _mean([w.get(k) for w in workers]) for k in keys}
    checksums = {w.get("params_checksum") for w in workers}
    tokens_per_s = tokens / train_s if train_s > 0 else None
    entry = REGISTRY[cfg.algo]
    if ceiling is not None and tokens_per_s is not None:
        ceiling["ratio"] = tokens_per_s / ceiling["tokens_per_s"]
    kwargs = cfg.algorithm_kwargs() if cfg.algo not in ("ddp", "none") else {}
    warm = cfg.sync_warmup_steps()
    return {
        "status": "finished",
        "algo": cfg.algo,
        "name": cfg.name,
        "out": cfg.out,
        "workers": world,
        "steps": cfg.steps,
        "sync_every": entry.schedule.period(cfg.sync_every),
        "sync_warmup": (
            {"steps": warm, "compression": kwargs.get("sync_warmup_compression")} if warm else None
        ),
        "early_rounds": (
            {"steps": kwargs["early_steps"], "sync_every": kwargs["early_every"]}
            if kwargs.get("early_steps")
            else None
        ),
        "overlap": int(kwargs.get("overlap") or 0),
        "link": None if cfg.link is None else f"{cfg.link} (emulated)",
        "compression": _compression_label(cfg, kwargs),
        "parameters": n_params,
        "tokens": tokens,
        "wall_time_s": wall_s,
        "train_time_s": train_s,
        "eval_time_s": eval_s,
        "tokens_per_s": tokens_per_s,
        "ceiling": ceiling,
        "val_loss_initial": val_start,
        "val_loss_final": val_end,
        "skipped_updates": skipped,
        "replicas_identical": len(checksums) == 1,
        "layout": _layout_summary(cfg, world, workers, mean),
        "comm_mean": mean,
        "comm_per_worker": workers,
        "work": _work_summary(cfg, workers, kwargs),
    }


def _work_summary(
    cfg: TrainConfig, workers: list[dict[str, Any]], kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """What each worker did (outer algorithms): its inner steps, tokens, mean steps per round
    (the warm start's included) and time blocked in collectives (a straggler's wait shows on the
    others), the ``speeds`` emulated and whether rounds were dynamic."""
    if not workers or workers[0].get("inner_steps") is None:
        return None
    steps = [int(w["inner_steps"]) for w in workers]
    return {
        "local_steps": kwargs.get("local_steps", "fixed"),
        "speeds": cfg.speeds,
        "inner_steps": steps,
        "tokens": [n * cfg.batch_size * cfg.block_size for n in steps],
        # over the whole job, warm start included (positions: step() calls, H per round)
        "steps_per_round": [
            n * cfg.sync_every / w["positions"] if w.get("positions") else None
            for n, w in zip(steps, workers)
        ],
        "blocked_s": [w.get("blocked_s") for w in workers],
    }


def _compression_label(cfg: TrainConfig, kwargs: dict[str, Any]) -> str | None:
    """What the summary names as the job's compression: the codec spec; DeMo's own top-k of
    DCT coefficients; ``None`` for fp32 (and for the no-sync ceiling, which sends nothing)."""
    if cfg.algo == "demo":
        from lowcomm.optim.demo import DeMoConfig

        defaults = DeMoConfig()
        k = kwargs.get("compression_topk", defaults.compression_topk)
        chunk = kwargs.get("compression_chunk", defaults.compression_chunk)
        return f"DeMo: top {k} DCT coefficients per chunk (chunk side up to {chunk})"
    if cfg.algo == "ddp":
        compression: str | None = cfg.value("compression")
        return compression
    return sync_codec(cfg.algorithm)


def _layout_summary(
    cfg: TrainConfig, world: int, workers: list[dict[str, Any]], mean: dict[str, Any]
) -> dict[str, Any] | None:
    """The node layout for ``summary.json`` (``None`` for the flat layout without ZeRO):
    ``comm_mean`` then counts what crosses nodes, ``intra_node`` DDP inside them."""
    if cfg.nodes == 1 and cfg.node_sharding == "none":
        return None
    per_node = cfg.procs_per_node if cfg.nodes > 1 else world
    assert per_node is not None
    intra = [w["intra_node"] for w in workers if w.get("intra_node") is not None]
    intra_mean = None
    if intra:
        keys = ("collectives", "payload_bytes", "wire_bytes", "blocked_s", "in_flight_s")
        intra_mean = {k: _mean([d[k] for d in intra]) for k in keys}
        for key in ("payload_bytes", "wire_bytes"):
            intra_mean[f"{key}_per_step"] = (intra_mean[key] or 0.0) / cfg.steps
    cross_wire = mean.get("wire_bytes")
    return {
        "nodes": cfg.nodes,
        "procs_per_node": per_node,
        "node_sharding": cfg.node_sharding,
        "across_nodes": cfg.algo,
        "link_per_process": (
            node_link(EmulatedLink.parse(cfg.link), cfg).name if cfg.link is not None else None
        ),
        "cross_node_wire_bytes_per_node": (
            per_node * cross_wire if cfg.hierarchical and cross_wire is not None else None
        ),
        "intra_node": intra_mean,
    }


ENDED = ("finished", "diverged")
"""The statuses of a run's record that a later attempt's failure never replaces."""


def _read_record(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _free_name(out: str, status: str) -> str:
    n = 1
    while os.path.exists(os.path.join(out, f"summary-{status}-{n}.json")):
        n += 1
    return os.path.join(out, f"summary-{status}-{n}.json")


def record_path(out: str, *, ending: bool) -> str:
    """Where this attempt of the run in ``out`` writes its record, such that no earlier
    attempt's record is lost: ``summary.json``, after moving an earlier failed or interrupted
    attempt's record aside to ``summary-<status>-<n>.json``; or, where the run had already
    ended (its record ``finished`` or ``diverged``) and this attempt does not end it again
    (not ``ending``), ``""``: the caller writes beside it."""
    path = os.path.join(out, "summary.json")
    earlier = _read_record(path)
    if earlier is None:
        return path
    status = str(earlier.get("status") or "unknown")
    if status in ENDED:
        return path if ending else ""
    with contextlib.suppress(OSError):
        os.replace(path, _free_name(out, status))
    return path


def failed_summary(
    cfg: TrainConfig, error: str, *, status: str = "failed"
) -> tuple[dict[str, Any] | None, str | None]:
    """What a failed (or ``"interrupted"``) run had measured, from its ``metrics.jsonl``: the
    last step reached, its training and validation losses, tokens/s, and the checkpoint
    ``--resume`` continues from (the newest that verifies). Written as ``summary.json``
    (``"status": "failed"``) where it can be, never over the record of a run that had ended
    (then beside it, ``summary-failed-<n>.json``; :func:`record_path`); returns the summary and
    the path written, or ``None`` where it could not be (a full disk). ``(None, None)`` when the
    run measured nothing (it failed before its first evaluation)."""
    out = cfg.out or "."
    records = []
    try:
        with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                with contextlib.suppress(ValueError):  # a line torn by the failure
                    records.append(json.loads(line))
    except OSError:
        pass
    if not records:
        return None, None
    steps = [r for r in records if r.get("kind") == "step"]
    evals = [r for r in records if r.get("kind") == "eval"]
    last = steps[-1] if steps else None
    trained = [r for r in evals if r.get("step", 0) > 0]
    summary: dict[str, Any] = {
        "status": status,
        "error": error,
        "algo": cfg.algo,
        "name": cfg.name,
        "out": cfg.out,
        "steps": cfg.steps,
        "steps_done": last["step"] if last else 0,
        "train_loss_last": last["loss"] if last else None,
        "tokens": last["tokens"] if last else 0,
        "tokens_per_s": (
            last["tokens"] / last["elapsed_s"] if last and last.get("elapsed_s") else None
        ),
        "val_loss_initial": evals[0]["val_loss"] if evals else None,
        "val_loss_last": trained[-1]["val_loss"] if trained else None,
        "val_step_last": trained[-1]["step"] if trained else None,
        "checkpoint": _last_checkpoint(out),
    }
    try:
        path = record_path(out, ending=False) or _free_name(out, status)
        if os.path.basename(path) != "summary.json":
            summary["beside"] = "summary.json holds the record of the run that had ended"
        write_json(path, summary)
    except OSError:
        return summary, None
    return summary, path


def _last_checkpoint(out: str) -> str | None:
    """The checkpoint ``--resume`` would continue from: the newest that verifies."""
    return newest_intact(out)[0]
