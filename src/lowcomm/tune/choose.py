"""Sync settings chosen from the link: the codec, overlap τ, fragments and warm start that reach
the untuned job's loss soonest on the link a job runs over, among the settings measured per token
for its algorithm (``lowcomm train --tune-link``; :func:`choose_sync_settings` for your own loop).

Two measurements decide, one of time and one of loss:

* **time**, from the cost model of :mod:`lowcomm.tune.cost`: a sync of S bytes over bandwidth β
  takes about 8·S·c/β plus latency (c the codec's ratio); a round takes H·t (t the inner
  step's compute); overlap hides τ·t of it and the rest is waited; a warm-start step waits for
  its gradient all-reduce beyond what backward hides. The job's predicted time is its warm
  steps and its other steps at those rates;
* **loss at equal tokens**, from :mod:`lowcomm.tune.evidence`: what each setting cost the
  algorithm in its study, against its untuned job. A setting never measured for an algorithm is
  never chosen for it, nor one that cost it more than :data:`~lowcomm.tune.evidence.MAX_COST`;
  and the combination chosen (its own cost where it was measured as a whole, else its
  settings' costs added) is never expected to end above the untuned job's loss: the tuner
  trades no loss per token for speed, so the job tuned for its link reaches the untuned job's
  final loss, sooner.

Among those, it takes the combination with the least predicted time to that loss: the job's
predicted time, less what a per-token gain saves at
:data:`~lowcomm.tune.evidence.TOKEN_EXCHANGE` (credited up to
:data:`~lowcomm.tune.evidence.NOISE`, the studies' seed noise, and not at all under
:data:`~lowcomm.tune.evidence.RESOLUTION`); ties go to the larger credited gain, then to the
untuned settings. A setting the user gave is never changed.

Compressed syncs travel by all-gather (every rank decodes every payload), fp32 ones by ring
all-reduce: the times are those of :class:`~lowcomm.tune.cost.Network` for each.

Example::

    link = LinkProfile.parse("10mbit")
    choice = choose_sync_settings("co2", link=link, workers=2, step_time_s=0.075,
                                  shapes=[p.shape for p in model.parameters()], sync_every=12,
                                  warm_steps=240, steps=960, max_fragments=4)
    choice.settings   # {'compression': 'int4', 'sync_warmup_compression': 'int2'}
    choice.cost       # expected loss per token against the untuned job: -0.0075
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

from lowcomm.registry import REGISTRY
from lowcomm.schedules import ONE_ROUND_STALE, SPARSE_GATHER
from lowcomm.tune.cost import Algorithm, Network, StepTime, Workload, step_time
from lowcomm.tune.evidence import (
    DEFAULT_JOB,
    FALLBACKS,
    MAX_COST,
    NOISE,
    RESOLUTION,
    TOKEN_EXCHANGE,
    Measured,
    evidence_for,
)

__all__ = [
    "EARLY_KEYS",
    "FALLBACK_MARGIN",
    "SLACK",
    "LinkProfile",
    "SyncChoice",
    "choose_algorithm",
    "choose_sync_settings",
    "early_syncs",
    "encoded_ratio",
    "price_as_given",
    "sync_seconds",
    "tokens_to",
    "warm_length",
]

FALLBACK_MARGIN = 0.9
"""The default job changes its algorithm (:func:`choose_algorithm`) only where the other is
predicted to reach DDP's loss in at most this share of its own predicted time: a tenth, the
step times' noise on a loaded machine, and room for what the default job's per-token gain is
not credited beyond :data:`~lowcomm.tune.evidence.NOISE` (it goes on to a lower loss). On the
default job on 2 workers with 100 ms of compute a step that is 1 Mbit/s (0.14 of CO2's time)
and 10 Mbit/s (0.74), not 100 Mbit/s, where CO2 hides its syncs."""

SLACK = 0.1
"""The syncs count as hidden (:attr:`SyncChoice.hidden`) where the predicted step is at most
this much above the compute."""

_UNTUNED = Measured(0.0, "the untuned job", "")
_PART = Measured(math.inf, "measured only together with another setting", "")


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """The link the outer syncs cross: bandwidth (bits/s per worker, each way), latency, and
    where the figures come from (``emulated`` links are charged as lowcomm's emulation charges
    them; a measured or named real link as a ring)."""

    bandwidth_bps: float
    latency_s: float
    source: str
    emulated: bool = False

    @classmethod
    def parse(cls, spec: str, *, emulated: bool = False) -> LinkProfile:
        """A link profile (``10mbit``) or ``RATE:LATENCY`` value, as ``--link`` takes it."""
        from lowcomm.link import EmulatedLink

        link = EmulatedLink.parse(spec)
        return cls(link.bandwidth_bps, link.latency_s, spec, emulated)

    def network(self) -> Network:
        return Network(
            bandwidth_bps=self.bandwidth_bps,
            latency_s=self.latency_s,
            cost="emulated" if self.emulated else "ring",
        )

    def describe(self) -> str:
        rate = self.bandwidth_bps
        unit = "Gbit/s" if rate >= 1e9 else "Mbit/s"
        value = rate / (1e9 if rate >= 1e9 else 1e6)
        shown = (
            f"{value:.0f}" if value >= 1000 else f"{value:.3g}"
        )  # no exponent: 33600, not 3.36e+04
        return f"{self.source} ({shown} {unit}, {self.latency_s * 1e3:.3g} ms)"


@dataclasses.dataclass(frozen=True)
class SyncChoice:
    """What :func:`choose_sync_settings` chose, and why."""

    settings: dict[str, Any]
    """The job settings to apply (``compression``, ``overlap``, ``num_fragments``,
    ``sync_warmup``, ``sync_warmup_compression``): those that change; empty when none does."""
    step_s: float
    """Predicted time of an inner step after the warm start (compute plus what is waited)."""
    compute_s: float
    """The inner step's compute, t."""
    sync_s: float
    """Predicted time of one round's syncs on the link."""
    warm_step_s: float | None
    """Predicted time of a warm-start step (None: no warm start)."""
    hidden: bool
    """Whether the syncs hide behind compute within :data:`SLACK`."""
    reason: str
    warm_steps: int = 0
    """The warm start's steps chosen (0: none)."""
    job_s: float | None = None
    """Predicted time of the job's steps (``steps`` known), warm start included."""
    cost: float = 0.0
    """Expected loss at equal tokens against the untuned job (the chosen settings' measured
    costs added; -0.011: 1.1% lower)."""
    evidence: tuple[str, ...] = ()
    """Each chosen setting's measured cost, with the entry and the study that measured it."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def encoded_ratio(codec: str | None, shapes: Sequence[Sequence[int]]) -> float:
    """Wire bytes of ``codec`` over fp32 bytes for tensors of ``shapes`` (1 for fp32)."""
    if codec is None:
        return 1.0
    from lowcomm.compress.codecs import parse_codec

    c = parse_codec(codec)
    raw = sum(4 * math.prod(s) for s in shapes)
    return sum(c.wire_nbytes(tuple(s)) for s in shapes) / raw if raw else 1.0


def sync_seconds(
    codec: str | None, payload_bytes: float, workers: int, link: LinkProfile, ratio: float
) -> float:
    """One sync of ``payload_bytes`` (fp32) over ``workers``: a ring all-reduce in fp32, an
    all-gather of the encoded bytes (``ratio`` of them) with a codec."""
    net = link.network()
    if codec is None:
        return net.allreduce_time(payload_bytes, workers)
    return net.allgather_time(payload_bytes * ratio, workers)


class _CodecNetwork:
    """A :class:`~lowcomm.tune.cost.Network` whose all-reduces carry a codec's payload by
    all-gather (what a compressed sync does), for :func:`~lowcomm.tune.cost.step_time`."""

    def __init__(self, link: LinkProfile, codec: str | None, ratio: float) -> None:
        self.link, self.codec, self.ratio = link, codec, ratio
        self.net = link.network()

    def allreduce_time(self, payload_bytes: float, n: int) -> float:
        return sync_seconds(self.codec, payload_bytes, n, self.link, self.ratio)

    def allgather_time(self, payload_bytes: float, n: int) -> float:
        return self.net.allgather_time(payload_bytes, n)

    def exchange_time(self, payload_bytes: float, group: int) -> float:
        return self.net.exchange_time(payload_bytes, group)


def price_as_given(
    algo: str,
    cadence: Mapping[str, Any],
    *,
    sync_every: int,
    codec: str | None,
    link: LinkProfile,
    workers: int,
    shapes: Iterable[Sequence[int]],
    compute_s: float,
) -> StepTime:
    """The cost model's inner step of ``algo`` with its settings as they are (``cadence``: its
    schedule's keywords, ``codec`` the spec of its syncs' codec, ``None`` for fp32) on ``link``
    among ``workers``, for a model of ``shapes`` whose inner step computes for ``compute_s``: a
    compressed sync all-gathers the codec's bytes; SparseLoCo's schedule counts its own."""
    shapes = [tuple(s) for s in shapes]
    params = max(1.0, float(sum(math.prod(s) for s in shapes)))
    work = Workload(parameters=params, tokens_per_step=1.0, step_time_s=compute_s)
    algorithm = Algorithm(**{**cadence, "name": algo, "sync_every": sync_every})
    network: Any = link.network()
    if codec is not None and REGISTRY[algo].schedule is not SPARSE_GATHER:
        network = _CodecNetwork(link, codec, encoded_ratio(codec, shapes))
    return step_time(algorithm, work, network, workers)


EARLY_KEYS = ("early_every", "early_steps")
"""An algorithm's early rounds (SparseLoCo's): a sync every H₀ steps for the first W."""


def early_syncs(settings: Mapping[str, Any], sync_every: int) -> int:
    """The syncs early rounds add to a job of H = ``sync_every``: W / H₀ − W / H (0 without)."""
    w = int(settings.get("early_steps") or 0)
    return w // int(settings["early_every"]) - w // sync_every if w else 0


def _resolved(settings: Mapping[str, Any], sync_every: int) -> dict[str, Any]:
    """``settings`` with an ``overlap`` of 0 made H / ``num_fragments`` (a fragment in flight
    until the next sync point)."""
    out = dict(settings)
    p = int(out.get("num_fragments") or 1)
    if "overlap" in out and not out["overlap"]:
        out["overlap"] = sync_every // p
    return out


def _fits(
    settings: Mapping[str, Any], sync_every: int, max_fragments: int, elastic: bool = False
) -> bool:
    """Whether a measured setting applies to a job of H = ``sync_every`` on a model of
    ``max_fragments`` blocks: P fragments of more than one step each, fewer than H steps in
    flight (``elastic``: fewer than H / P, one sync in flight across a quorum)."""
    p = int(settings.get("num_fragments") or 1)
    if p > 1 and (p > max_fragments or sync_every % p or sync_every // p <= 1):
        return False
    return int(settings.get("overlap") or 0) < (sync_every // p if elastic else sync_every)


def warm_length(share: Fraction, steps: int, sync_every: int) -> int:
    """The warm start's steps for ``share`` of a job of ``steps``: whole rounds, at least one."""
    return max(sync_every, int(share * steps) // sync_every * sync_every)


def _algorithm(algo: str, sync_every: int, settings: dict[str, Any]) -> Algorithm:
    schedule = REGISTRY[algo].schedule
    kwargs: dict[str, Any] = {"name": algo, "sync_every": sync_every}
    if "num_fragments" in schedule.keywords:
        kwargs["overlap"] = int(settings.get("overlap") or 0)
        kwargs["num_fragments"] = int(settings.get("num_fragments") or 1)
    return Algorithm(**kwargs)


@dataclasses.dataclass(frozen=True)
class _Option:
    """One candidate: sync settings and a warm start, with their costs and times."""

    sync: dict[str, Any]
    sync_cost: Measured
    warm_steps: int
    warm_codec: str | None
    warm_cost: Measured
    order: int
    together: Measured | None = None
    """The combination's own measurement, where it was measured as a whole."""

    @property
    def cost(self) -> float:
        if self.together is not None:
            return self.together.cost
        return self.sync_cost.cost + self.warm_cost.cost

    def measurements(self) -> tuple[tuple[str, Measured], ...]:
        """What the expected cost rests on, each with what it measured."""
        if self.together is not None:
            return (("syncs and warm start together", self.together),)
        return tuple(
            (what, measured)
            for what, measured in (("syncs", self.sync_cost), ("warm start", self.warm_cost))
            if measured is not _UNTUNED
        )


def choose_sync_settings(
    algo: str,
    *,
    link: LinkProfile,
    workers: int,
    step_time_s: float,
    shapes: Iterable[Sequence[int]],
    sync_every: int,
    current: dict[str, Any] | None = None,
    given: Iterable[str] = (),
    warm_steps: int = 0,
    steps: int | None = None,
    max_fragments: int = 1,
    codec_s: Mapping[str, float] | None = None,
    elastic: bool = False,
) -> SyncChoice:
    """The sync settings of ``algo`` for ``link`` (module docstring).

    Args:
        algo: the ``--algo`` name.
        link: the link the outer syncs cross.
        workers: N, the ranks in a sync.
        step_time_s: t, one inner step's compute (measured).
        shapes: the synchronised parameters' shapes.
        sync_every: H.
        current: the job's settings before the choice (its defaults: ``overlap``,
            ``num_fragments``, ``compression``, ``sync_warmup_compression``): the untuned job.
        given: settings the user gave (never changed).
        warm_steps: K, the untuned job's warm-start steps (0: none).
        steps: the job's steps (default: four times ``warm_steps``, the job's own ratio); the
            warm start's measured lengths are shares of them.
        max_fragments: the most fragments the model splits into (its transformer blocks): CO2's
            staggered settings (4 fragments) need at least 4.
        codec_s: the time one compressed mean of the model takes a worker's compute with each
            codec (encoding, error feedback, decoding; measured by the job at start-up): a
            sync adds it once a round, a warm step every step. Left out: the link alone.
        elastic: the job runs under fault tolerance, one sync in flight across a quorum: only
            settings with fewer than H / ``num_fragments`` steps in flight.
    """
    if not (step_time_s > 0 and math.isfinite(step_time_s)):
        raise ValueError(f"step_time_s must be a finite number > 0, got {step_time_s!r}")
    current = dict(current or {})
    entry = REGISTRY[algo]
    if entry.schedule is ONE_ROUND_STALE and current.get("num_fragments") is None:
        current["num_fragments"] = 1  # CO2's default: one fragment
    evidence = evidence_for(algo) if not entry.fixed else None
    if evidence is None:
        why = f"{algo}: not tuned (no per-token study of its settings)"
        return SyncChoice({}, step_time_s, step_time_s, 0.0, None, True, why)
    given = set(given)
    shapes = [tuple(s) for s in shapes]
    payload = 4.0 * sum(math.prod(s) for s in shapes)
    work = Workload(parameters=max(1.0, payload / 4), tokens_per_step=1.0, step_time_s=step_time_s)
    n_steps = steps if steps is not None else 4 * warm_steps

    def changes_given(settings: Mapping[str, Any]) -> bool:
        return any(k in given and current.get(k) != v for k, v in settings.items())

    def keeps_given_warm(k: int, codec: str | None) -> bool:
        return ("sync_warmup" not in given or k == warm_steps) and (
            "sync_warmup_compression" not in given
            or codec == current.get("sync_warmup_compression")
        )

    # the untuned job's own settings first (cost 0 by definition), then every measured one that
    # fits this job and leaves what the user gave as it is
    keys = {k for settings, _ in evidence.sync for k in settings}
    untuned_sync = {k: current.get(k) for k in sorted(keys)}
    syncs: list[tuple[dict[str, Any], Measured]] = [(untuned_sync, _UNTUNED)]
    for settings, measured in evidence.sync:
        resolved = _resolved(settings, sync_every)
        if resolved == untuned_sync or measured.cost > MAX_COST:
            continue
        if _fits(resolved, sync_every, max_fragments, elastic) and not changes_given(resolved):
            syncs.append((resolved, measured))
    warms: list[tuple[int, str | None, Measured]] = [
        (warm_steps, current.get("sync_warmup_compression"), _UNTUNED)
    ]
    if warm_steps > 0 and n_steps > 0:
        for share, codec, measured in evidence.warm:
            k = warm_length(share, n_steps, sync_every)
            if not keeps_given_warm(k, codec):
                continue
            if measured.cost > MAX_COST or (k, codec) == warms[0][:2]:
                continue
            warms.append((k, codec, measured))

    # the settings of combinations measured only as a whole are candidates too, each part
    # priced at its combination only
    for settings, share, codec, _ in evidence.combined:
        resolved = _resolved(settings, sync_every)
        known = any({**untuned_sync, **s} == {**untuned_sync, **resolved} for s, _ in syncs)
        fits = _fits(resolved, sync_every, max_fragments, elastic)
        if not known and fits and not changes_given(resolved):
            syncs.append((resolved, _PART))
        if warm_steps > 0 and n_steps > 0:
            k = warm_length(share, n_steps, sync_every)
            if all((k, codec) != w[:2] for w in warms) and keeps_given_warm(k, codec):
                warms.append((k, codec, _PART))

    def combination(sync: Mapping[str, Any], k: int, codec: str | None) -> Measured | None:
        whole = {**untuned_sync, **sync}
        for settings, share, warm_codec, measured in evidence.combined:
            if (
                n_steps > 0
                and {**untuned_sync, **_resolved(settings, sync_every)} == whole
                and (warm_length(share, n_steps, sync_every), warm_codec) == (k, codec)
            ):
                return measured
        return None

    timed: dict[int, Any] = {}

    def local(i: int) -> Any:  # the cost model's step after the warm start, per sync setting
        if i not in timed:
            settings = {**current, **syncs[i][0]}
            codec = settings.get("compression")
            ratio = encoded_ratio(codec, shapes)
            timed[i] = step_time(
                _algorithm(algo, sync_every, settings),
                work,
                _CodecNetwork(link, codec, ratio),
                workers,
            )
        return timed[i]

    codec_work = dict(codec_s or {})

    def warm_step(codec: str | None) -> float:
        link_s = _warm_step_s(codec, payload, shapes, workers, link, step_time_s)
        return link_s + codec_work.get(codec or "", 0.0)

    best: tuple[tuple[float, float, int], _Option, float, float | None] | None = None
    order = 0
    for i, (sync, sync_cost) in enumerate(syncs):
        for k, warm_codec, warm_cost in warms:
            together = combination(sync, k, warm_codec)
            option = _Option(sync, sync_cost, k, warm_codec, warm_cost, order, together)
            order += 1
            if option.cost > 1e-12:
                continue  # never expected to end above the untuned job's loss
            step_s = (
                local(i).step_s + codec_work.get(sync.get("compression") or "", 0.0) / sync_every
            )
            warm_s = warm_step(warm_codec) if k > 0 else None
            job_s = (k * (warm_s or 0.0) + max(0, n_steps - k) * step_s) if n_steps else step_s
            credit = max(option.cost, -NOISE) if option.cost <= -RESOLUTION else 0.0
            score = job_s * tokens_to(option.cost)
            key = (round(score, 9), round(credit, 9), option.order)
            if best is None or key < best[0]:
                best = (key, option, job_s, warm_s)
    assert best is not None  # the untuned settings are always a candidate
    _, chosen, job_s, warm_s = best
    timing = local(next(i for i, (s, _) in enumerate(syncs) if s == chosen.sync))
    step_s = timing.step_s + codec_work.get(chosen.sync.get("compression") or "", 0.0) / sync_every
    settings = {k: v for k, v in chosen.sync.items() if current.get(k) != v}
    if chosen.warm_steps != warm_steps:
        settings["sync_warmup"] = chosen.warm_steps
    if warm_steps > 0 and chosen.warm_codec != current.get("sync_warmup_compression"):
        settings["sync_warmup_compression"] = chosen.warm_codec
    hidden = step_s <= (1 + SLACK) * step_time_s
    round_sync = timing.comm_s * sync_every
    evidence_lines = tuple(f"{what}: {m.describe()}" for what, m in chosen.measurements())
    what = ", ".join(f"{k} {'none' if v is None else v}" for k, v in settings.items())
    reason = (
        f"{what or 'the untuned settings'}: a round's syncs {round_sync:.3g} s against "
        f"{sync_every} x {step_time_s * 1e3:.3g} ms of compute, "
        + ("hidden" if hidden else "not hidden")
        + f"; expected loss per token {chosen.cost:+.1%} against the untuned job"
    )
    return SyncChoice(
        settings,
        step_s,
        step_time_s,
        round_sync,
        warm_s if chosen.warm_steps > 0 else None,
        hidden,
        reason,
        warm_steps=chosen.warm_steps,
        job_s=job_s if n_steps else None,
        cost=chosen.cost,
        evidence=evidence_lines,
    )


def tokens_to(cost: float) -> float:
    """The share of a job's tokens it takes to reach a loss ``cost`` (a share) below the loss it
    ends at, as the tuner prices it: 1 + c / :data:`~lowcomm.tune.evidence.TOKEN_EXCHANGE`, a
    gain (c < 0) credited up to :data:`~lowcomm.tune.evidence.NOISE` and not at all under
    :data:`~lowcomm.tune.evidence.RESOLUTION`, a loss (c > 0) counted whole."""
    if cost < 0:
        cost = max(cost, -NOISE) if cost <= -RESOLUTION else 0.0
    return 1.0 + cost / TOKEN_EXCHANGE


def choose_algorithm(
    own: SyncChoice,
    algo: str,
    *,
    link: LinkProfile,
    workers: int,
    shapes: Iterable[Sequence[int]],
    steps: int,
    candidates: Mapping[str, Mapping[str, Any]],
    codec_s: Mapping[str, float] | None = None,
) -> SyncChoice | None:
    """Another algorithm for the default job (``algo``, :data:`~lowcomm.tune.evidence.
    DEFAULT_JOB`'s, with its chosen settings ``own`` from :func:`choose_sync_settings`), or
    ``None`` to keep it.

    Only where ``own`` does not hide its syncs. Each job is priced by its predicted time to
    DDP's loss at the job's tokens (the target of lowcomm's time to target): its predicted job
    time times :func:`tokens_to` of its measured loss per token against DDP's on the nearest
    number of workers measured (:class:`~lowcomm.tune.evidence.AgainstDDP`; ``own``'s the
    default job's, its settings' cost added). Each of
    :data:`~lowcomm.tune.evidence.FALLBACKS` in ``candidates`` (by name: its settings in the
    job, ``sync_every`` and its schedule's keywords, ``compression`` the codec spec of its
    syncs, ``sync_warmup`` its warm-start steps, :data:`EARLY_KEYS` its early rounds) is timed by
    the cost model on ``link``, its codec's work ``codec_s`` once a round, each sync its early
    rounds add exposing what one of its rounds' does; an entry measured with steps in flight
    (``overlap`` τ) is priced with them where the job's syncs block and τ is below its shortest
    round. One with a warm start is not a candidate: its every warm step crosses the link. The
    one predicted to reach DDP's loss first (the first of equals) replaces ``algo`` if it does
    so in at most :data:`FALLBACK_MARGIN` of the time ``own`` takes. The result's ``settings``
    hold ``{"algo": name}`` and its τ (``"overlap"``) where it has one; its ``cost`` is its
    loss per token against DDP's."""
    if own.hidden or algo != DEFAULT_JOB.algo:
        return None
    shapes = [tuple(s) for s in shapes]
    measured_with, default = DEFAULT_JOB.at(workers)
    own_cost = (1.0 + default.cost) * (1.0 + (own.cost or 0.0)) - 1.0
    own_job_s = own.job_s if own.job_s is not None else own.step_s * steps
    own_s = own_job_s * tokens_to(own_cost)
    best: tuple[float, SyncChoice] | None = None
    for fallback in FALLBACKS:
        settings = candidates.get(fallback.algo)
        if settings is None or int(settings.get("sync_warmup") or 0):
            continue
        tau = fallback.overlap
        if tau:  # its measured steps in flight, where the job's syncs block and they fit
            early = int(settings.get("early_steps") or 0)
            shortest = int(settings["early_every"] if early else settings["sync_every"])
            if int(settings.get("overlap") or 0) or tau >= shortest:
                continue
            settings = {**settings, "overlap": tau}
        schedule = REGISTRY[fallback.algo].schedule
        h = int(settings["sync_every"])
        codec = settings.get("compression")
        timing = price_as_given(
            fallback.algo,
            {k: settings[k] for k in schedule.keywords if k in settings},
            sync_every=h,
            codec=codec,
            link=link,
            workers=workers,
            shapes=shapes,
            compute_s=own.compute_s,
        )
        step_s = timing.step_s + dict(codec_s or {}).get(codec or "", 0.0) / h
        # early rounds: each sync more than a round's exposes what a round's does (same τ)
        job_s = step_s * steps + early_syncs(settings, h) * (step_s - own.compute_s) * h
        n, measured = fallback.at(workers)
        to_loss_s = job_s * tokens_to(measured.cost)
        if to_loss_s > FALLBACK_MARGIN * own_s or (best is not None and to_loss_s >= best[0]):
            continue
        round_sync = timing.comm_s * h
        hidden = step_s <= (1 + SLACK) * own.compute_s
        reason = (
            f"{algo}'s syncs, {own.sync_s:.3g} s a round against {h} x "
            f"{own.compute_s * 1e3:.3g} ms of compute with its best measured settings, are not "
            f"hidden; {fallback.algo} ({codec or 'fp32'}"
            + (f", each sync {tau} steps in flight" if tau else "")
            + f"): {round_sync:.3g} s a round, "
            f"predicted to reach DDP's loss in {to_loss_s:.3g} s (its {measured.cost:+.1%} per "
            f"token against DDP's on {n} workers) against {own_s:.3g} s ({algo}'s "
            f"{own_cost:+.1%} with its settings, on {measured_with} workers)"
        )
        choice = SyncChoice(
            {"algo": fallback.algo, **({"overlap": tau} if tau else {})},
            step_s,
            own.compute_s,
            round_sync,
            None,
            hidden,
            reason,
            job_s=job_s,
            cost=measured.cost,
            evidence=(
                f"{fallback.algo} on {n} workers: {measured.describe()}",
                f"{algo} on {measured_with} workers: {default.describe()}",
            ),
        )
        best = (to_loss_s, choice)
    return None if best is None else best[1]


def _warm_step_s(
    codec: str | None,
    payload: float,
    shapes: Sequence[Sequence[int]],
    workers: int,
    link: LinkProfile,
    step_time_s: float,
) -> float:
    """A warm step's predicted time with ``codec``: the compute and what backward does not hide
    of its gradient all-reduce, launched bucket by bucket as backward produces them (the first
    of :data:`~lowcomm.outer.warm.WARM_BUCKET_MB`, the later ones larger): nothing leaves
    before the first bucket is full, so backward hides the all-reduce only for the share of it
    that comes after (a later bucket fills while the link still carries the ones before it)."""
    from lowcomm.outer.warm import WARM_BUCKET_MB

    ratio = encoded_ratio(codec, shapes)
    comm = sync_seconds(codec, payload, workers, link, ratio)
    backward = Workload(parameters=1.0, tokens_per_step=1.0, step_time_s=step_time_s)
    after_first = max(0.0, 1.0 - WARM_BUCKET_MB * 1024 * 1024 / payload) if payload else 0.0
    return step_time_s + max(0.0, comm - backward.backward_fraction * after_first * step_time_s)
