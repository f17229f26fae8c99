"""Settings from the link (``--tune-link``): at start-up a ``lowcomm train`` job learns its link
and its inner step time and lets :func:`lowcomm.plan.tune.choose_sync_settings` pick the outer
sync's codec and overlap, and the warm start's codec, for every such setting the user did not
give.

* **The link**: the emulated ``--link`` (its own bandwidth and latency; with node groups each
  process's share), a profile named by ``--tune-link`` (chosen as if on it, without emulating
  it: the convergence harness's loss jobs), or the real network timed (``measure``; ``auto``
  when the job's processes are on several machines): a small and a large all-reduce over the
  group the outer algorithm syncs over, the small one's time the latency, the difference the
  bandwidth. On one machine without ``--link`` (``auto``) there is no slow link and nothing
  changes.
* **The step time**: three inner steps on a copy of the model and the inner optimizer, after an
  untimed one, every rank at once (the slowest rank's time counts); torch's global generator is
  restored afterwards, so the training draws what it would have drawn.

Rank 0 chooses and every rank takes its choice. The choice, the figures behind it and the
predicted step time go into ``summary.json`` (``link_tuning``) and the printed summary; a
checkpoint keeps them, and a resumed run restores them instead of measuring again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.device import collective_device, synchronize
from lowcomm.plan.tune import LinkProfile, choose_sync_settings
from lowcomm.registry import REGISTRY
from lowcomm.train.config import ConfigError, TrainConfig
from lowcomm.train.topology import Topology

__all__ = ["TUNED_KEYS", "measure_link", "tune_to_link"]

logger = logging.getLogger(__name__)

TUNED_KEYS = (
    "compression",
    "overlap",
    "num_fragments",
    "sync_warmup",
    "sync_warmup_compression",
)
"""The job settings a choice may set (only where the user gave none)."""

_TUNABLE_SCHEDULES = ("one-round-stale", "blocking", "fragments")


def _tunable(cfg: TrainConfig) -> str | None:
    """Why ``cfg`` is not tuned, or ``None`` when it is."""
    entry = REGISTRY[cfg.algo]
    if cfg.tune_link == "off":
        return "off"
    if not entry.is_outer or entry.schedule not in _TUNABLE_SCHEDULES or entry.fixed:
        return f"{cfg.algo} is not tuned"
    if cfg.fault_tolerance:
        return "elastic syncs are not compressed"
    if cfg.shard_outer_state:
        return "sharded outer state is not compressed"
    if cfg.documents:
        return "a documents job's step time follows its documents, not one timed step"
    return None


def _profile(cfg: TrainConfig, topology: Topology, group: Any) -> LinkProfile | None:
    if cfg.tune_link not in ("auto", "measure"):
        return LinkProfile.parse(cfg.tune_link, emulated=True)
    own = topology.emulated_link()
    if own is not None and cfg.tune_link == "auto":
        return LinkProfile(own.bandwidth_bps, own.latency_s, f"{cfg.link} (emulated)", True)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", topology.world) or topology.world)
    if cfg.tune_link == "auto" and local >= topology.world:
        return None  # every process on this machine, no emulated link: nothing slow to hide
    return measure_link(group, payload_bytes=4 << 20)


def measure_link(group: Any, *, payload_bytes: int, repeats: int = 3) -> LinkProfile:
    """Time all-reduces of 1 KiB and of ``payload_bytes`` over ``group`` (the best of
    ``repeats`` each, after one untimed): the small one's time is the latency, the rest of the
    large one's is its ring's bytes over the bandwidth. Every rank of ``group`` takes part.
    On NCCL the tensors are on the GPU, and each time waits for the device: an NCCL
    all-reduce returns once it is queued."""
    n = dist.get_world_size(group)
    device = collective_device(group)

    def best(numel: int) -> float:
        x = torch.zeros(numel, device=device)
        dist.all_reduce(x, group=group)
        synchronize(device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            synchronize(device)
            times.append(time.perf_counter() - t0)
        return min(times)

    small = best(256)
    large = best(max(256, payload_bytes // 4))
    wire = 2 * (n - 1) / max(n, 1) * 8.0 * payload_bytes
    bandwidth = wire / max(large - small, 1e-6)
    return LinkProfile(bandwidth, small, "measured", False)


def _step_time(
    cfg: TrainConfig, gpt: nn.Module, corpus: Any, rank: int, device: torch.device
) -> float:
    """Seconds of one inner step on a copy of the model (the slowest rank's)."""
    from lowcomm.train.ceiling import Ceiling

    rng = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        timer = Ceiling(gpt, cfg, corpus, rank, device)
        timer.run(3)
        steps, seconds = timer.segments[-1]
    finally:
        torch.set_rng_state(rng)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
    slowest = torch.tensor([seconds / steps], dtype=torch.float64, device=collective_device())
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def tune_to_link(
    cfg: TrainConfig,
    topology: Topology,
    gpt: nn.Module,
    corpus: Any,
    device: torch.device,
    resumed: dict[str, Any] | None = None,
) -> tuple[TrainConfig, dict[str, Any] | None]:
    """``cfg`` with the settings chosen for its link (module docstring), and the record of the
    choice (``None``: not tuned). ``resumed``: the state of the checkpoint a resumed run
    continues from, whose record (or its absence: not tuned) is applied as it is."""
    if resumed is not None:
        saved = resumed.get("tuned")
        return (cfg, None) if saved is None else (_apply(cfg, saved), saved)
    if _tunable(cfg) is not None:
        return cfg, None
    kwargs = cfg.algorithm_kwargs()
    given = {k for k in TUNED_KEYS if getattr(cfg, k, None) is not None}
    group = topology.groups.cross if cfg.hierarchical else None
    profile = _profile(cfg, topology, group)
    if profile is None:
        return cfg, None
    step_s = _step_time(cfg, gpt, corpus, topology.rank, device)
    record: list[Any] = [None]
    if topology.is_main:
        workers = cfg.nodes if cfg.hierarchical else topology.world
        choice = choose_sync_settings(
            cfg.algo,
            link=profile,
            workers=workers,
            step_time_s=step_s,
            shapes=[tuple(p.shape) for p in gpt.parameters() if p.requires_grad],
            sync_every=cfg.sync_every,
            # a codec given as "none" is fp32, as the ladder names it (None)
            current={k: None if kwargs.get(k) == "none" else kwargs.get(k) for k in TUNED_KEYS},
            given=given,
            warm_steps=cfg.sync_warmup_steps(),
            steps=cfg.steps,
            max_fragments=cfg.n_layer,
        )
        record[0] = {"link": profile.describe(), **choice.as_dict()}
    dist.broadcast_object_list(record, src=0)
    tuned = _apply(cfg, record[0])
    if topology.is_main:
        logger.info(
            "settings from the link %s: %s (predicted %.0f ms a step against %.0f ms of compute)",
            record[0]["link"],
            _describe(record[0]["settings"]) or "the defaults",
            record[0]["step_s"] * 1e3,
            record[0]["compute_s"] * 1e3,
        )
    return tuned, record[0]


def _describe(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k} {'none' if v is None else v}" for k, v in settings.items())


def _apply(cfg: TrainConfig, record: dict[str, Any]) -> TrainConfig:
    settings = {k: v for k, v in record.get("settings", {}).items() if k in TUNED_KEYS}
    try:
        return dataclasses.replace(cfg, **settings)
    except ConfigError as e:
        logger.warning("the settings chosen from the link do not apply (%s); kept the job's", e)
        return cfg
