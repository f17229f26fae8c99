"""Settings from the link (``--tune-link``): at start-up a ``lowcomm train`` job learns its link
and its inner step time and lets :func:`lowcomm.tune.choose.choose_sync_settings` pick the outer
sync's codec, overlap and fragments and the warm start's length and codec, among the settings
measured per token for its algorithm (:mod:`lowcomm.tune.evidence`), for every such setting the
user did not give.

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
* **The codecs' work**: one compressed mean of the model in each of :data:`TUNED_CODECS` over a
  group of each rank alone (encoding, error feedback, decoding), the slowest rank's: what a
  sync or a warm step adds to the compute it shares a core with.

Rank 0 chooses and every rank takes its choice. The choice, the figures behind it and the
predicted step time go into ``summary.json`` (``link_tuning``) and the printed summary; a
checkpoint keeps them, and a resumed run restores them instead of measuring again.

**An elastic job** (``--fault-tolerance``) chooses once, before its replicas start: the launcher
runs one process of a replica's shape (``python -m lowcomm.train.tuning_process``) that
times the step and the codecs as above for a sync among ``replicas`` replicas over the emulated
``--link`` (or the ``--tune-link`` profile), with the elastic limits (only algorithms that run
elastic; fewer steps in flight than H / fragments), and every replica — a restarted one too —
takes that record (:data:`TUNED_ENV`), so the quorum's replicas always sync with the same
settings. Replicas started one by one (``--lighthouse``) are not tuned: each would choose from
its own timings.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.device import collective_device, synchronize
from lowcomm.registry import REGISTRY
from lowcomm.train.config import ConfigError, TrainConfig
from lowcomm.train.elastic_config import heal_inner_for, why_blocking
from lowcomm.train.outer_keys import sync_codec
from lowcomm.train.topology import Topology
from lowcomm.tune.choose import EARLY_KEYS, LinkProfile, choose_algorithm, choose_sync_settings
from lowcomm.tune.evidence import FALLBACKS, evidence_for

__all__ = [
    "TUNED_ENV",
    "HEAL_BACKGROUND_SHARE",
    "TUNED_KEYS",
    "choose_heal",
    "heals_from_link",
    "elastic_tuning",
    "measure_link",
    "tune_to_link",
    "why_untuned",
]

logger = logging.getLogger(__name__)

TUNED_KEYS = (
    "compression",
    "overlap",
    "num_fragments",
    "sync_warmup",
    "sync_warmup_compression",
)
"""The job settings a choice may set (only where the user gave none)."""


DECODE_SHARE = 0.3
"""The share of a one-rank compressed mean's work that decodes its one payload (torch.profiler
on the default model, one thread: int8 7.3 of 26.2 ms, int2 9.4 of 31.0 ms)."""

HEAL_BACKGROUND_SHARE = 0.25
"""An elastic job whose ``heal`` is not given heals in the background only where its syncs are
predicted to take at most this share of the link (:func:`choose_heal`). Measured on 10mbit with
a kill every 30 s (docs/fault-tolerance.md): SparseLoCo, whose syncs take 3% of it, kept 89% of
its fault-free goodput healing in the background against 76% blocking; CO2 with int4 syncs
(about 40% of it) kept 34% against 77%, its heal's transfer slowed by the syncs beside it."""

TUNED_ENV = "LOWCOMM_TUNED"
"""In an elastic job's replicas: the file holding ``{"record": ...}``, the settings chosen for
the link once for the whole job (``None``: not tuned), written by the launcher's tuning
process (:mod:`lowcomm.train.tuning_process`)."""

TUNED_CODECS = ("int8", "int4", "int2")
"""The codecs whose CPU time a tuned job measures at start-up (:func:`_codec_seconds`)."""


def why_untuned(cfg: TrainConfig) -> str | None:
    """Why ``cfg`` is not tuned, or ``None`` when it is."""
    entry = REGISTRY[cfg.algo]
    if cfg.tune_link == "off":
        return "off"
    if not entry.is_outer or not entry.schedule.rounds_all_reduce or entry.fixed:
        return f"{cfg.algo} is not tuned"
    if evidence_for(cfg.algo) is None:
        return f"{cfg.algo} is not tuned: its settings were never measured per token"
    if cfg.fault_tolerance:
        why = elastic_tuning(cfg)
        if why is not None:
            return why
    if cfg.value("shard_outer_state"):
        return "sharded outer state is not compressed"
    if cfg.documents:
        return "a documents job's step time follows its documents, not one timed step"
    return None


def elastic_tuning(cfg: TrainConfig) -> str | None:
    """Why the elastic job ``cfg`` is not tuned before its replicas start, or ``None`` when
    it is (module docstring)."""
    if cfg.lighthouse is not None:
        return (
            "replicas started one by one (--lighthouse) are not tuned: each would choose from "
            "its own timings; give every replica the same settings (those lowcomm train "
            "--fault-tolerance --link LINK chooses are in its summary)"
        )
    if cfg.link is None and cfg.tune_link in ("auto", "measure"):
        # the replicas meet only in torchft's quorums: there is no fixed group to time
        return (
            "the link between elastic replicas is not measured (they meet only in torchft's "
            "quorums): give --link or --tune-link PROFILE"
            if cfg.tune_link == "measure"
            else "no emulated link"
        )
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
    # a link so fast that the large all-reduce takes about as long as the small one (loopback,
    # NVLink): its bandwidth is beyond what this payload resolves; say so, with the bound
    floor = max(1e-6, 0.05 * small)
    if large - small < floor:
        return LinkProfile(wire / floor, small, "measured (at least)", False)
    return LinkProfile(wire / (large - small), small, "measured", False)


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


def _codec_seconds(
    gpt: nn.Module, device: torch.device, codecs: list[str], world: int
) -> dict[str, float]:
    """This rank's CPU (or host and device) time for one compressed mean of the model with each
    of ``codecs``, over a group of this rank alone: the encoding, error feedback, the
    all-gather's copies and the decoding (of ``world`` payloads, the others' scaled from its
    own), which a sync adds to the compute it shares a core (or a stream) with. The slowest
    rank's figures; every rank takes part (the one-rank groups are made collectively)."""
    from lowcomm.buckets import FlatBuckets
    from lowcomm.comm import Communicator
    from lowcomm.compress.feedback import Compressor

    rank = dist.get_rank()
    own = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r])
        if r == rank:
            own = group
    comm = Communicator(own)
    params = [p for p in gpt.parameters() if p.requires_grad]
    shapes = [p.shape for p in params]
    buckets = FlatBuckets(shapes, device=device)
    seconds = torch.zeros(len(codecs), dtype=torch.float64)
    with torch.no_grad():
        for i, codec in enumerate(codecs):
            compressor = Compressor(codec, shapes, rank=rank, device=device, stream=99)
            times = []
            for _ in range(3):  # the first untimed
                buckets.copy_from([p.detach() for p in params])
                synchronize(device)
                t0 = time.perf_counter()
                comm.compressed_mean_async(buckets, compressor).wait()
                synchronize(device)
                times.append(time.perf_counter() - t0)
            seconds[i] = min(times[1:])
    # decoding grows with the payloads, the others' on top of this rank's own: decoding one is
    # DECODE_SHARE of a one-rank mean's work
    seconds *= 1.0 + (world - 1) * DECODE_SHARE
    seconds = seconds.to(collective_device())
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return {c: float(v) for c, v in zip(codecs, seconds.cpu())}


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
    if resumed is None and cfg.fault_tolerance and os.environ.get(TUNED_ENV):
        with open(os.environ[TUNED_ENV], encoding="utf-8") as f:
            resumed = {"tuned": json.load(f)["record"]}  # the job's choice, made once
    if resumed is not None:
        saved = resumed.get("tuned")
        return (cfg, None) if saved is None else (_apply(cfg, saved), saved)
    untuned = why_untuned(cfg)
    if untuned is not None:
        if heals_from_link(cfg):
            return _heal_only(cfg, topology, gpt, corpus, device, untuned)
        return cfg, None
    kwargs = cfg.algorithm_kwargs()
    given = {k for k in TUNED_KEYS if cfg.value(k) is not None}
    group = topology.groups.cross if cfg.hierarchical else None
    profile = _profile(cfg, topology, group)
    if profile is None:
        return cfg, None
    step_s = _step_time(cfg, gpt, corpus, topology.rank, device)
    if cfg.fault_tolerance:  # (the tuning process: one process of a replica)
        workers = cfg.replicas
    else:
        workers = cfg.nodes if cfg.hierarchical else topology.world
    fallbacks = _fallbacks(cfg) if cfg.algo_from_link else {}
    codecs = [*TUNED_CODECS, *{c["compression"] for c in fallbacks.values() if c["compression"]}]
    codec_s = _codec_seconds(gpt, device, codecs, workers)
    record: list[Any] = [None]
    if topology.is_main:
        shapes = [tuple(p.shape) for p in gpt.parameters() if p.requires_grad]
        choice = choose_sync_settings(
            cfg.algo,
            link=profile,
            workers=workers,
            step_time_s=step_s,
            shapes=shapes,
            sync_every=cfg.sync_every,
            # a codec given as "none" is fp32, as the ladder names it (None)
            current={k: None if kwargs.get(k) == "none" else kwargs.get(k) for k in TUNED_KEYS},
            given=given,
            warm_steps=cfg.sync_warmup_steps(),
            steps=cfg.steps,
            max_fragments=cfg.n_layer,
            codec_s=codec_s,
            elastic=cfg.fault_tolerance,
        )
        switch = None
        if fallbacks:  # the default job: another algorithm where its own cannot hide its syncs
            switch = choose_algorithm(
                choice,
                cfg.algo,
                link=profile,
                workers=workers,
                shapes=shapes,
                steps=cfg.steps,
                candidates=fallbacks,
                codec_s=codec_s,
            )
        # the codecs' measured work goes with the choice it entered (a reader can redo it)
        if switch is None:
            record[0] = {"link": profile.describe(), **choice.as_dict(), "codec_s": codec_s}
        else:  # what the job's own algorithm would have run with is kept beside it
            record[0] = {
                "link": profile.describe(),
                **switch.as_dict(),
                "codec_s": codec_s,
                "replaced": {"algo": cfg.algo, **choice.as_dict()},
            }
        if cfg.fault_tolerance and cfg.heal is None:  # how a joiner is healed, on this link
            h = (
                cfg.sync_every
                if switch is None
                else fallbacks[switch.settings["algo"]]["sync_every"]
            )
            heal, why = _heal_choice(
                cfg,
                record[0],
                sync_every=int(h),
                parameters=sum(math.prod(s) for s in shapes),
                link=profile,
            )
            record[0]["settings"] = {**record[0]["settings"], **heal}
            record[0]["heal_reason"] = why
    dist.broadcast_object_list(record, src=0)
    tuned = _apply(cfg, record[0])
    if topology.is_main:
        from lowcomm.train.report import describe_choice

        logger.info("settings from the link %s: %s", record[0]["link"], describe_choice(record[0]))
    return tuned, record[0]


def heals_from_link(cfg: TrainConfig) -> bool:
    """Whether the elastic job ``cfg``, whose other settings are not tuned (:func:`why_untuned`),
    still chooses how it heals from its link: ``heal`` not given, the link known before the
    replicas start (:func:`elastic_tuning`), ``--tune-link`` not off, and the step timed as one
    (not a documents job)."""
    return (
        cfg.fault_tolerance
        and cfg.heal is None
        and cfg.tune_link != "off"
        and elastic_tuning(cfg) is None
        and not cfg.documents
        and REGISTRY[cfg.algo].is_outer
    )


def _heal_only(
    cfg: TrainConfig,
    topology: Topology,
    gpt: nn.Module,
    corpus: Any,
    device: torch.device,
    untuned: str,
) -> tuple[TrainConfig, dict[str, Any] | None]:
    """The heal of an elastic job whose other settings are kept as given (``untuned``: why):
    its step timed as a tuned job's is, its round's syncs priced on the link with its own
    settings (:func:`lowcomm.tune.choose.price_as_given`), then :func:`choose_heal`. The
    record holds the heal (``heal``, and ``heal_inner`` where the job did not give it) as its
    only settings and ``as_given``: why the rest is not tuned."""
    from lowcomm.tune.choose import price_as_given

    profile = _profile(cfg, topology, None)
    if profile is None:
        return cfg, None
    step_s = _step_time(cfg, gpt, corpus, topology.rank, device)
    shapes = [tuple(p.shape) for p in gpt.parameters() if p.requires_grad]
    timing = price_as_given(
        cfg.algo,
        _cadence(cfg),
        sync_every=cfg.sync_every,
        codec=sync_codec(cfg.algorithm),
        link=profile,
        workers=cfg.replicas,
        shapes=shapes,
        compute_s=step_s,
    )
    record: dict[str, Any] = {
        "link": profile.describe(),
        "settings": {},
        "step_s": timing.step_s,
        "compute_s": step_s,
        "sync_s": timing.comm_s * cfg.sync_every,
        "as_given": untuned,
    }
    heal, why = _heal_choice(
        cfg,
        record,
        sync_every=cfg.sync_every,
        parameters=sum(math.prod(s) for s in shapes),
        link=profile,
    )
    record["settings"] = heal
    record["heal_reason"] = why
    from lowcomm.train.report import describe_choice

    logger.info("settings from the link %s: %s", record["link"], describe_choice(record))
    return _apply(cfg, record), record


def choose_heal(
    record: dict[str, Any],
    *,
    sync_every: int,
    parameters: int,
    link: LinkProfile,
    heal_inner: str | None,
) -> tuple[str, str]:
    """How an elastic job that did not give ``heal`` heals a replica that joins past the warm
    start, from the settings chosen for its link (``record``: a ``link_tuning`` record, its
    predicted ``step_s`` and a round's ``sync_s``), and why: ``background`` where a blocking heal
    would hold every replica for more than a round (its transfer, at least the anchor in fp32
    and, unless ``heal_inner`` is none, the inner moments in bf16, as a blocking heal whose
    ``heal_inner`` is not given carries them: 8 bytes a parameter, over ``link``) and the syncs
    take at most :data:`HEAL_BACKGROUND_SHARE` of the link (the transfer then has most of it to
    itself); else ``blocking``, which every replica waits for but which never shares the
    link."""
    round_s = float(record["step_s"]) * sync_every
    share = float(record["sync_s"]) / round_s if round_s > 0 else 1.0
    words = 1 if heal_inner == "none" else 2
    heal_s = link.latency_s + 8.0 * 4 * words * parameters / link.bandwidth_bps
    if heal_s > round_s and share <= HEAL_BACKGROUND_SHARE:
        return "background", (
            f"a blocking heal would hold every replica {heal_s:.3g} s, more than a round "
            f"({round_s:.3g} s), and the syncs take {share:.0%} of the link"
        )
    why = (
        f"the syncs take {share:.0%} of the link (over {HEAL_BACKGROUND_SHARE:.0%}: a heal in "
        "the background would share it)"
        if share > HEAL_BACKGROUND_SHARE
        else f"a heal takes {heal_s:.3g} s, at most a round ({round_s:.3g} s)"
    )
    return "blocking", why


HEAL_KEYS = ("heal", "heal_inner")
"""The elastic settings chosen with the link's where the job does not give them."""


def _heal_choice(
    cfg: TrainConfig, record: dict[str, Any], *, sync_every: int, parameters: int, link: LinkProfile
) -> tuple[dict[str, str], str]:
    """The heal settings of the elastic job ``cfg`` chosen from its link (:func:`choose_heal`;
    blocking where a heal cannot reach its replicas in the background:
    :func:`lowcomm.train.elastic_config.why_blocking`) and why."""
    heal, why = choose_heal(
        record, sync_every=sync_every, parameters=parameters, link=link, heal_inner=cfg.heal_inner
    )
    blocked = why_blocking(cfg) if heal == "background" else None
    if blocked is not None:
        heal, why = "blocking", f"{why}, but {blocked}"
    return _heal_settings(cfg, heal), why


def _heal_settings(cfg: TrainConfig, heal: str) -> dict[str, str]:
    """The settings a heal chosen from the link (``heal``) brings: the heal, and what of the
    donor's inner optimizer state it carries where the job did not say
    (:func:`lowcomm.train.elastic_config.heal_inner_for`)."""
    if cfg.heal_inner is not None:
        return {"heal": heal}
    return {"heal": heal, "heal_inner": heal_inner_for(heal, None)}


def _describe(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k} {'none' if v is None else v}" for k, v in settings.items())


def _cadence(cfg: TrainConfig) -> dict[str, Any]:
    """The job's settings its algorithm's schedule is priced by (the cost model's keywords)."""
    keywords = REGISTRY[cfg.algo].schedule.keywords
    return {k: getattr(cfg.algorithm, k) for k in keywords if hasattr(cfg.algorithm, k)}


def _fallbacks(cfg: TrainConfig) -> dict[str, dict[str, Any]]:
    """The default job's settings with each algorithm of :data:`FALLBACKS` (its job defaults):
    H and its schedule's keywords, the codec of its syncs and its warm-start steps."""
    out: dict[str, dict[str, Any]] = {}
    for fallback in FALLBACKS:
        try:
            alt = cfg.replace(algo=fallback.algo)
        except ConfigError as e:  # (a job whose other settings it does not take)
            logger.info("%s is not an option for this job: %s", fallback.algo, e)
            continue
        early = {k: getattr(alt.algorithm, k) for k in EARLY_KEYS if hasattr(alt.algorithm, k)}
        out[fallback.algo] = {
            **_cadence(alt),
            **early,
            "sync_every": alt.sync_every,
            "compression": sync_codec(alt.algorithm),
            "sync_warmup": alt.sync_warmup_steps(),
        }
    return out


def _apply(cfg: TrainConfig, record: dict[str, Any]) -> TrainConfig:
    chosen = record.get("settings", {})
    settings = {k: v for k, v in chosen.items() if k in TUNED_KEYS or k == "algo"}
    # a heal the job gives is its own (a record saved by an earlier run does not override it)
    settings.update({k: chosen[k] for k in HEAL_KEYS if k in chosen and getattr(cfg, k) is None})
    try:
        return cfg.replace(**settings)
    except ConfigError as e:
        logger.warning("the settings chosen from the link do not apply (%s); kept the job's", e)
        return cfg
