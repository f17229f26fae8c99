"""What each setting the link tuner may choose costs an algorithm per token, as measured: the
evidence :func:`lowcomm.tune.choose.choose_sync_settings` chooses from.

Every figure is the validation loss at equal tokens of the default ``lowcomm train`` job (the
0.83 M-parameter GPT, 2 workers, 960 steps, H = 12), mean of seeds 0, 1, 2, with the setting
against the same algorithm's untuned job (its defaults: fp32 syncs, a warm start of a quarter
of the steps in int8), from one ``lowcomm bench --convergence`` entry per row; the study that
ran it is named with each. Settings measured together in one job (``combined``) are priced by
that job; a combination never measured as a whole by its settings' costs added.

An algorithm without an entry here is not tuned: its settings were never measured per token,
and a codec or a shorter warm start chosen for its speed alone can cost it far more loss than it
saves time (DiLoCo lost 19% per token with a warm start cut to 72 steps where CO2 lost 0.5%).

What the default job weighs when it chooses its algorithm for a slow link
(:func:`lowcomm.tune.choose.choose_algorithm`) is measured otherwise: :data:`DEFAULT_JOB` and
:data:`FALLBACKS` are whole jobs against DDP's at equal tokens, by the number of workers
(:class:`AgainstDDP`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

__all__ = [
    "DEFAULT_JOB",
    "EVIDENCE",
    "FALLBACKS",
    "MAX_COST",
    "NOISE",
    "RESOLUTION",
    "TOKEN_EXCHANGE",
    "AgainstDDP",
    "AlgorithmEvidence",
    "Measured",
    "evidence_for",
]

MAX_COST = 0.02
"""A setting that costs an algorithm more than this share of loss per token in its study is
never chosen for it."""

NOISE = 0.01
"""Differences of loss per token within this share are within the studies' seed-to-seed noise
(three seeds of the default job): a setting measured better than the untuned job is credited
with at most this much when the tuner weighs loss against time."""

RESOLUTION = 0.001
"""Gains per token under this share are not credited at all: the figures' last digit (int8
syncs measured 0.01% better than fp32 on CO2, which is no reason to encode them on a fast
link)."""

TOKEN_EXCHANGE = 0.07
"""How many loss points (as a share) one share more tokens buys on the default job: DDP's
validation loss went from 1.405 at 960 steps to 1.273 at 3,840 (``docs/studies/convergence.md``,
"The 4× job"), ln(1.405 / 1.273) / ln 4 = 0.071. The tuner prices a setting's per-token gain
with it: 1% lower loss is worth about 14% of the tokens."""

_TUNING = "docs/studies/tuning.md"
_SLOW = "docs/studies/slow-links.md"


@dataclasses.dataclass(frozen=True)
class Measured:
    """One setting's measured loss at equal tokens against its algorithm's untuned job."""

    cost: float
    """Relative change of the final validation loss (+0.005: 0.5% higher, worse)."""
    entry: str
    """The ``lowcomm bench --convergence`` entry that measured it."""
    study: str
    """The page that holds the measurement."""

    def describe(self) -> str:
        return f"{self.cost:+.1%} ({self.entry}, {self.study})"


@dataclasses.dataclass(frozen=True)
class AlgorithmEvidence:
    """The measured settings of one algorithm."""

    untuned: str
    """What the untuned job is (what ``cost`` is measured against)."""
    sync: tuple[tuple[Mapping[str, Any], Measured], ...]
    """Sync settings (``compression`` and, for CO2, ``overlap`` and ``num_fragments``; an
    ``overlap`` of 0 stands for H / ``num_fragments``: a fragment in flight until the next sync
    point), each with its cost, in the order the tuner prefers among equals."""
    warm: tuple[tuple[Fraction, str, Measured], ...]
    """Warm starts: the share of the job's steps (whole rounds) and the codec of its gradient
    all-reduce, each with its cost."""
    combined: tuple[tuple[Mapping[str, Any], Fraction, str, Measured], ...] = ()
    """Sync settings and a warm start (share, codec) measured together in one job: the tuner
    takes such a combination's own cost instead of adding its settings' costs (which need not
    add: an int2 warm start moved CO2's three seeds by -5%, +1% and +2%, and a codec's few
    tenths of a percent fall differently on each), and may choose a setting measured only in
    such a combination, with it only."""


def _m(cost: float, entry: str, study: str) -> Measured:
    return Measured(cost, entry, study)


EVIDENCE: dict[str, AlgorithmEvidence] = {
    # the job's CO2 1.429, 1.355, 1.330 (mean 1.372) at 611a02a; every setting at cad2bd6 (no
    # change to training between them); docs/studies/tuning.md, "CO2, setting by setting"
    "co2": AlgorithmEvidence(
        untuned="co2: fp32 syncs one step stale, a warm start of steps/4 in int8",
        sync=(
            (
                {"compression": "int8", "overlap": 1, "num_fragments": 1},
                _m(-0.0001, "co2+int8/tune_link=off", _TUNING),
            ),
            (
                {"compression": "int4", "overlap": 1, "num_fragments": 1},
                _m(0.0018, "co2+int4/tune_link=off", _TUNING),
            ),
            (
                {"compression": "int4", "overlap": 0, "num_fragments": 4},
                _m(0.0092, "co2+int4/num_fragments=4/overlap=3/tune_link=off", _TUNING),
            ),
        ),
        warm=(
            (
                Fraction(1, 4),
                "int4",
                _m(0.0128, "co2/sync_warmup_compression=int4/tune_link=off", _TUNING),
            ),
            (
                Fraction(1, 4),
                "int2",
                _m(-0.0074, "co2/sync_warmup_compression=int2/tune_link=off", _TUNING),
            ),
        ),
        combined=(
            (
                {"compression": "int8", "overlap": 1, "num_fragments": 1},
                Fraction(1, 4),
                "int2",
                _m(-0.0074, "co2+int8/sync_warmup_compression=int2/tune_link=off", _TUNING),
            ),
            (
                {"compression": "int4", "overlap": 1, "num_fragments": 1},
                Fraction(1, 4),
                "int2",
                _m(-0.0075, "co2+int4/sync_warmup_compression=int2/tune_link=off", _TUNING),
            ),
            (
                {"compression": "int4", "overlap": 1, "num_fragments": 1},
                Fraction(1, 8),
                "int2",
                _m(
                    0.0052,
                    "co2+int4/sync_warmup=120/sync_warmup_compression=int2/tune_link=off",
                    _TUNING,
                ),
            ),
            (
                {"compression": "int4", "overlap": 0, "num_fragments": 4},
                Fraction(1, 4),
                "int2",
                _m(
                    0.0004,
                    "co2+int4/num_fragments=4/overlap=3/sync_warmup_compression=int2/tune_link=off",
                    _TUNING,
                ),
            ),
        ),
    ),
    # the job's DiLoCo 1.434, 1.351, 1.321 (mean 1.369) at 9bea18a; docs/studies/tuning.md
    "diloco": AlgorithmEvidence(
        untuned="diloco: fp32 syncs, a warm start of steps/4 in int8",
        sync=(
            ({"compression": "int8"}, _m(0.000, "diloco+int8", _TUNING)),
            ({"compression": "int4"}, _m(0.002, "diloco+int4", _TUNING)),
        ),
        warm=(
            (Fraction(1, 4), "int2", _m(-0.010, "diloco/sync_warmup_compression=int2", _TUNING)),
            (
                Fraction(1, 8),
                "int2",
                _m(0.001, "diloco/sync_warmup=120/sync_warmup_compression=int2", _TUNING),
            ),
        ),
    ),
    # the job's Streaming DiLoCo (2 fragments, each 2 steps in flight) 1.449, 1.348, 1.329
    # (mean 1.376) at 87ac8bc; docs/studies/tuning.md
    "streaming": AlgorithmEvidence(
        untuned="streaming: fp32 syncs of 2 fragments, a warm start of steps/4 in int8",
        sync=(({"compression": "int4"}, _m(-0.0005, "streaming+int4", _TUNING)),),
        warm=(
            (
                Fraction(1, 4),
                "int2",
                _m(-0.0013, "streaming/sync_warmup_compression=int2", _TUNING),
            ),
            (
                Fraction(1, 8),
                "int2",
                _m(0.0011, "streaming/sync_warmup=120/sync_warmup_compression=int2", _TUNING),
            ),
        ),
    ),
}
"""The measured settings of every algorithm the tuner tunes, by ``--algo``."""


def evidence_for(algo: str) -> AlgorithmEvidence | None:
    """The measured settings of ``algo`` (``None``: not measured, not tuned)."""
    return EVIDENCE.get(algo)


@dataclasses.dataclass(frozen=True)
class AgainstDDP:
    """An algorithm's job (``lowcomm train --algo ALGO`` with the job's defaults, on a link
    where it hides its syncs) at equal tokens against DDP's, by number of workers: what the
    default job weighs when it chooses its algorithm for a slow link
    (:func:`lowcomm.tune.choose.choose_algorithm`)."""

    algo: str
    """The ``--algo`` it runs, with that algorithm's job defaults."""
    by_workers: Mapping[int, Measured]
    """Its loss at equal tokens against DDP's (+0.03: 3% higher, worse), by the number of
    workers it was measured with."""
    overlap: int = 0
    """The steps each sync was in flight (``overlap``, with the job's merge; 0: the job's
    default, blocking)."""

    def at(self, workers: int) -> tuple[int, Measured]:
        """The measurement for ``workers``: that of the nearest number of workers measured, the
        larger of two as near (a gap per token that grows with the workers is not flattered)."""
        n = min(self.by_workers, key=lambda k: (abs(k - workers), -k))
        return n, self.by_workers[n]


DEFAULT_JOB = AgainstDDP(
    "co2",
    {
        # 1.429, 1.355, 1.330 (mean 1.372) at 611a02a against DDP's 1.408;
        # docs/studies/tuning.md
        2: _m(-0.026, "co2/tune_link=off", _TUNING),
        # 1.284, 1.288, 1.270 (mean 1.281) at 5eabe63 against DDP's 1.274, 1.272, 1.266 (mean
        # 1.271); docs/studies/slow-links.md, "SparseLoCo: links of 1 Mbit/s"
        4: _m(0.008, "co2", _SLOW),
    },
)
"""The default job's algorithm, untuned, against DDP: CO2 with fp32 syncs one step stale and a
warm start of a quarter of the steps in int8. Its settings chosen for a link are priced on top
by their own cost against this job (:data:`EVIDENCE`)."""

_SPARSELOCO = "sparseloco/sync_warmup=0/outer_lr=2.0/error_decay=0.8/chunk=8"
_SPARSELOCO_IN_FLIGHT = f"{_SPARSELOCO}/merge=delay_corrected/overlap="

FALLBACKS: tuple[AgainstDDP, ...] = (
    # the job's SparseLoCo (no warm start, α 2, β 0.8, 8 × 8 tiles, a sync every 6 steps for
    # the first 360) at the commit that made them the job's: 1.378, 1.369, 1.375 (mean 1.374)
    # against DDP's 1.486, 1.371, 1.365 (mean 1.407) on 2 workers; 1.291, 1.291, 1.285 (mean
    # 1.289) against 1.274, 1.272, 1.266 (mean 1.271) on 4; docs/studies/slow-links.md, "Early
    # rounds for three eighths of the steps"
    AgainstDDP(
        "sparseloco",
        {
            2: _m(-0.024, _SPARSELOCO, _SLOW),
            4: _m(0.014, _SPARSELOCO, _SLOW),
        },
    ),
    # the same, each sync launched a step before its sync point and merged (θ ← A + (θ − θ_s)):
    # 1.391, 1.375, 1.368 (mean 1.378) on 2 workers, 1.290, 1.293, 1.291 (mean 1.291) on 4
    AgainstDDP(
        "sparseloco",
        {
            2: _m(-0.021, f"{_SPARSELOCO_IN_FLIGHT}1", _SLOW),
            4: _m(0.016, f"{_SPARSELOCO_IN_FLIGHT}1", _SLOW),
        },
        overlap=1,
    ),
    # 2 steps before: 1.383, 1.406, 1.407 (mean 1.399) on 2 workers, 1.292, 1.304, 1.274 (mean
    # 1.290) on 4
    AgainstDDP(
        "sparseloco",
        {
            2: _m(-0.006, f"{_SPARSELOCO_IN_FLIGHT}2", _SLOW),
            4: _m(0.015, f"{_SPARSELOCO_IN_FLIGHT}2", _SLOW),
        },
        overlap=2,
    ),
)
"""What the default job may switch to on a slow link, in the order preferred among equals: an
algorithm's entries with steps in flight apply where its job takes them (fewer than its
shortest round)."""
