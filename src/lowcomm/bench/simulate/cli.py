"""``lowcomm simulate``'s command line: flags -> a :class:`~lowcomm.bench.simulate.model.Scenario`
-> :func:`~lowcomm.bench.simulate.report.run_simulate`; the tables go to stdout.

Every flag is optional (``argparse.SUPPRESS``): a preset or a results file gives the scenario and
the flags given change it.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from lowcomm.bench.simulate.calibration import load_results, scenario_from_results
from lowcomm.bench.simulate.model import ALGORITHMS, Algorithm, Network, Scenario, Workload
from lowcomm.bench.simulate.paper import PRESETS, preset
from lowcomm.bench.simulate.report import format_markdown, run_simulate
from lowcomm.registry import REGISTRY
from lowcomm.schedules import EVERY_STEP_GATHER, FRAGMENTS, GOSSIP

__all__ = ["add_subcommand"]

logger = logging.getLogger(__name__)

_FRAGMENTED = "/".join(n for n, e in REGISTRY.items() if e.schedule is FRAGMENTS)
"""The algorithms that take --num-fragments and --overlap, for the help (``streaming/cocodc``)."""


def _parse_link(text: str, flag: str) -> tuple[float, float | None]:
    """``tcp-80g`` (a profile), ``80gbit``, ``80gbit:50us`` or bits/s as a number ->
    (bandwidth, latency or None)."""
    from lowcomm.link import EmulatedLink

    spec = text.strip().lower()
    try:
        bw = float(spec)
    except ValueError:
        pass
    else:
        if not bw > 0 or not math.isfinite(bw):
            raise ValueError(f"{flag} must be > 0 bits/s, got {text!r}; e.g. 80gbit or tcp-80g")
        return bw, None
    try:
        if ":" in spec or spec in _profiles():
            link = EmulatedLink.parse(spec)
            return link.bandwidth_bps, link.latency_s
        return EmulatedLink.parse(f"{spec}:0s").bandwidth_bps, None
    except ValueError:
        raise ValueError(
            f"{flag} {text!r} is not a link profile ({', '.join(_profiles())}), a rate such as "
            "80gbit or 100mbit, or RATE:LATENCY such as 80gbit:50us"
        ) from None


def _profiles() -> tuple[str, ...]:
    from lowcomm.link import PROFILES

    return tuple(PROFILES)


def _parse_time(text: str, flag: str) -> float:
    spec = text.strip().lower()
    try:
        value = float(spec)
    except ValueError:
        from lowcomm.link import EmulatedLink

        try:
            value = EmulatedLink.parse(f"1gbit:{spec}").latency_s
        except ValueError:
            raise ValueError(
                f"{flag} must be seconds (0.00005) or a time such as 50us, 10ms, 1s; got {text!r}"
            ) from None
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{flag} must be >= 0 s, got {text!r}")
    return value


def _parse_positive(text: Any, flag: str, *, integer: bool = False) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{flag} must be a number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)) or (integer and value != int(value)):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{flag} must be {kind} > 0, got {text!r}")
    return value


def _parse_int_list(text: str, flag: str, *, low: int = 1) -> tuple[int, ...]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    out = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise ValueError(
                f"{flag} must be integers >= {low} separated by commas (e.g. 8,16,32), got {item!r}"
            ) from None
        if value < low:
            raise ValueError(f"{flag} must be integers >= {low}, got {value}")
        out.append(value)
    if not out:
        raise ValueError(f"{flag} needs at least one value, e.g. 8,16,32")
    return tuple(out)


def _parse_algos(text: str) -> tuple[str, ...]:
    names = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    for name in names:
        if name not in ALGORITHMS:
            raise ValueError(f"--algos: {name!r} is not one of {', '.join(ALGORITHMS)}")
    if not names:
        raise ValueError(f"--algos needs at least one of {', '.join(ALGORITHMS)}")
    return tuple(dict.fromkeys(names))


def _build_algorithms(
    names: Sequence[str],
    sync_every: Sequence[int],
    num_fragments: int,
    overlap: int,
    group_size: int = 2,
) -> tuple[Algorithm, ...]:
    algos: list[Algorithm] = []
    for name in names:
        if REGISTRY[name].schedule is EVERY_STEP_GATHER:  # demo: --overlap 1 applies late
            algos.append(Algorithm(name=name, overlap=min(overlap, 1)))
            continue
        if not REGISTRY[name].is_outer:
            algos.append(Algorithm(name=name))
            continue
        for h in sync_every:
            if REGISTRY[name].schedule is FRAGMENTS:
                algos.append(
                    Algorithm(name=name, sync_every=h, num_fragments=num_fragments, overlap=overlap)
                )
            elif REGISTRY[name].schedule is GOSSIP:
                algos.append(
                    Algorithm(name=name, sync_every=h, group_size=group_size, overlap=overlap)
                )
            else:
                algos.append(Algorithm(name=name, sync_every=h))
    return tuple(dict.fromkeys(algos))


def _scenario_from_args(
    args: argparse.Namespace,
) -> tuple[Scenario, Mapping[str, Any] | None, str]:
    given = vars(args)
    results = None
    source = "results"
    if "calibrate" in given:
        source = str(args.calibrate)
        results = load_results(source)

    net_kwargs: dict[str, Any] = {}
    for tier in ("", "intra_"):
        if f"{tier}bandwidth" in given:
            flag = f"--{tier.replace('_', '-')}bandwidth"
            bw, lat = _parse_link(getattr(args, f"{tier}bandwidth"), flag)
            net_kwargs[f"{tier}bandwidth_bps"] = bw
            if lat is not None:
                net_kwargs[f"{tier}latency_s"] = lat
        if f"{tier}latency" in given:
            flag = f"--{tier.replace('_', '-')}latency"
            net_kwargs[f"{tier}latency_s"] = _parse_time(getattr(args, f"{tier}latency"), flag)
    if "gpus_per_node" in given:
        net_kwargs["gpus_per_node"] = int(
            _parse_positive(args.gpus_per_node, "--gpus-per-node", integer=True)
        )

    work_kwargs: dict[str, Any] = {}
    for key, flag, integer in (
        ("params", "--params", False),
        ("tokens_per_step", "--tokens-per-step", False),
        ("bytes_per_param", "--bytes-per-param", False),
    ):
        if key in given:
            work_kwargs[key] = _parse_positive(given[key], flag, integer=integer)
    if "step_time" in given:
        work_kwargs["step_time_s"] = _parse_time(args.step_time, "--step-time")
        if not work_kwargs["step_time_s"] > 0:
            raise ValueError(f"--step-time must be > 0 s, got {args.step_time!r}")
    if "backward_fraction" in given:
        try:
            b = float(args.backward_fraction)
        except ValueError:
            b = math.nan
        if not 0 <= b <= 1:
            raise ValueError(f"--backward-fraction must be in [0, 1], got {args.backward_fraction}")
        work_kwargs["backward_fraction"] = b
    if "outer_time" in given:
        work_kwargs["outer_time_s"] = _parse_time(args.outer_time, "--outer-time")

    sync_every = _parse_int_list(args.sync_every, "--sync-every") if "sync_every" in given else None
    preset_name = given.get("preset")
    if preset_name is not None:
        if preset_name not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {preset_name!r}")
        overrides: dict[str, Any] = {}
        if "params" in work_kwargs:
            overrides["parameters"] = work_kwargs.pop("params")
        for key in ("tokens_per_step", "bytes_per_param", "backward_fraction"):
            if key in work_kwargs:
                overrides[key] = work_kwargs.pop(key)
        if sync_every is not None:
            overrides["sync_every"] = sync_every
        if net_kwargs:
            base_net = preset(preset_name).network
            overrides["network"] = replace(base_net, **net_kwargs)
            net_kwargs = {}
        scenario = preset(preset_name, **overrides)
        if "step_time_s" in work_kwargs:
            logger.warning(
                "--step-time replaces the preset's calibrated compute time: the calibration "
                "point no longer holds"
            )
    elif results is not None:
        scenario = scenario_from_results(results, source=source)
    else:
        missing = [f for f, k in (("--params", "params"), ("--step-time", "step_time_s"),
                                  ("--bandwidth", "bandwidth_bps"))
                   if k not in work_kwargs and k not in net_kwargs]  # fmt: skip
        if missing:
            raise ValueError(
                f"give {', '.join(missing)} (or --preset co2-paper, or --calibrate "
                "RESULTS_JSON for this machine)"
            )
        scenario = Scenario(
            name="custom",
            workload=Workload(
                parameters=work_kwargs.pop("params"),
                tokens_per_step=work_kwargs.pop("tokens_per_step", 1.0),
                step_time_s=work_kwargs.pop("step_time_s"),
            ),
            network=Network(**net_kwargs),
            algorithms=_build_algorithms(("ddp", "diloco", "co2"), sync_every or (12,), 1, 0),
            notes=("Projection, not a measurement: an α-β ring model with the overlap rules of "
                   "each algorithm (lowcomm.bench.simulate).",),
        )  # fmt: skip
        net_kwargs = {}

    if "params" in work_kwargs:
        work_kwargs["parameters"] = work_kwargs.pop("params")
    if work_kwargs:
        scenario = replace(scenario, workload=replace(scenario.workload, **work_kwargs))
    if net_kwargs:
        scenario = replace(scenario, network=replace(scenario.network, **net_kwargs))

    if (
        "algos" in given
        or "num_fragments" in given
        or "overlap" in given
        or "group_size" in given
        or (sync_every is not None and preset_name is None)
    ):
        names = (
            _parse_algos(args.algos)
            if "algos" in given
            else tuple(dict.fromkeys(a.name for a in scenario.algorithms))
        )
        outer = [a.sync_every for a in scenario.algorithms if a.entry.is_outer]
        h_list = sync_every or tuple(dict.fromkeys(outer)) or (12,)
        p = int(_parse_positive(given.get("num_fragments", 1), "--num-fragments", integer=True))
        tau = _parse_int_list(str(given.get("overlap", 0)), "--overlap", low=0)[0]
        n = int(_parse_positive(given.get("group_size", 2), "--group-size", integer=True))
        if n < 2:
            raise ValueError(f"--group-size must be an integer >= 2, got {n}")
        algos = _build_algorithms(names, h_list, p, tau, n)
        scenario = replace(scenario, algorithms=algos)
    if "workers" in given:
        scenario = replace(scenario, workers=_parse_int_list(args.workers, "--workers"))
    if "scalability_base" in given:
        base = int(_parse_positive(args.scalability_base, "--scalability-base", integer=True))
        scenario = replace(scenario, scalability_base=base)
    g = scenario.network.gpus_per_node
    for n in scenario.workers:
        if g > 1 and n > g and n % g:
            raise ValueError(
                f"--workers {n} is not a multiple of --gpus-per-node {g}; use multiples of {g}"
            )
    return scenario, results, source


def _run_simulate(args: argparse.Namespace, prog: str) -> int:
    """Run ``lowcomm simulate``: print the tables and the paths written; 0 on success."""
    scenario, results, source = _scenario_from_args(args)
    out = getattr(args, "out", None) or os.path.join("runs", "simulate")
    report = run_simulate(scenario, out=out, results=results, results_source=source)
    print(format_markdown(report))
    print(f"{prog}: wrote {report.paths['json']}, {report.paths['markdown']}, "
          f"{report.paths['plot']} (projection, not a measurement)")  # fmt: skip
    return 0


_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--preset", "{" + ",".join(PRESETS) + "}",
     "a named scenario: co2-paper (TransNormer-LLM 7B on A100 nodes of 8, 80 Gbit/s TCP between "
     "nodes, AdamW against CO2 tau=12 and 48, beside the paper's figures)"),
    ("--calibrate", "RESULTS_JSON",
     "a lowcomm bench results.json: predict each cell and compare with the measurement "
     "(without --preset, also project this machine's setup)"),
    ("--params", "N", "model parameters, e.g. 7e9"),
    ("--tokens-per-step", "N", "tokens per worker per inner step (default 1: throughput in steps)"),
    ("--step-time", "TIME", "compute time of one inner step on one worker, e.g. 0.25 or 250ms"),
    ("--bandwidth", "LINK",
     "slow link: a profile (rdma-800g, tcp-80g, 1gbit, 100mbit, 10mbit; sets the latency too), "
     "a rate such as 80gbit, or RATE:LATENCY; per node when --gpus-per-node > 1"),
    ("--latency", "TIME", "latency per message on the slow link, e.g. 50us (overrides a profile)"),
    ("--gpus-per-node", "G",
     "workers per node, sharing one slow NIC, with a fast link inside (default 1: a flat ring)"),
    ("--intra-bandwidth", "LINK", "fast link inside a node, per GPU, e.g. 2400gbit (default free)"),
    ("--intra-latency", "TIME", "latency per message on the fast link, e.g. 5us"),
    ("--algos", "A,B", f"algorithms: {', '.join(ALGORITHMS)} (default ddp,diloco,co2)"),
    ("--sync-every", "H[,H]",
     "inner steps per round (the CO2 paper's tau); several values give a line each (default 12)"),
    ("--num-fragments", "P", f"{_FRAGMENTED} fragments (default 1)"),
    ("--overlap", "STEPS",
     f"{_FRAGMENTED} inner steps a fragment's all-reduce may run, and noloco's exchange "
     "(default 0)"),
    ("--group-size", "N", "noloco: workers averaged together at each sync (default 2)"),
    ("--bytes-per-param", "B", "bytes per synchronised element: 4 fp32 (default), 2 bf16"),
    ("--backward-fraction", "B",
     "share of a step DDP can hide its all-reduce behind (default 0.667; 0: none)"),
    ("--outer-time", "TIME", "compute time of one outer update (default 0)"),
    ("--workers", "N[,N]", "worker counts (default 8,16,32,64,128,256,512,1024)"),
    ("--scalability-base", "N",
     "worker count the scalability ratio is taken against (co2-paper: 16)"),
    ("--out", "DIR", "output folder (default runs/simulate)"),
)  # fmt: skip


def add_subcommand(subparsers: Any) -> None:
    """Register ``simulate`` on an argparse subparsers object.

    The parsed namespace holds only the flags given (``argparse.SUPPRESS``) and ``_run``: call
    ``args._run(args, prog)``; it raises ``ValueError`` with a one-line message on bad input.
    """
    p = subparsers.add_parser(
        "simulate",
        help="project throughput and scaling efficiency to 8 ... 1024 workers (a model)",
        description=(
            "Project the throughput and scaling efficiency of ddp, diloco, co2, streaming and "
            "the other algorithms to many workers with an alpha-beta ring all-reduce model and "
            "each algorithm's overlap rules, and write simulate.json, simulate.md and "
            "simulate.png. --preset co2-paper puts the projection beside the CO2 paper's "
            "reported figures; --calibrate compares predicted with measured lowcomm bench "
            "cells. Without either, give --params, --step-time and --bandwidth. "
            "Figures are projections, not measurements."
        ),
        argument_default=argparse.SUPPRESS,
    )
    for flag, metavar, text in _FLAGS:
        p.add_argument(flag, dest=flag[2:].replace("-", "_"), metavar=metavar, help=text)
    p.set_defaults(_run=_run_simulate)
