"""``lowcomm train``: its flags (one per key of :func:`~lowcomm.train.config.config_keys`) and
what the command does with them: the configuration resolved (defaults < ``--config`` file <
flags), checked, launched, and the summary printed. Registered on the ``lowcomm`` command line
by :mod:`lowcomm.cli`, which maps the errors to exit codes; :func:`run_command` runs it alone
(the test harness's way: errors propagate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from lowcomm.flags import Flag, add_flags, flag_name

__all__ = ["add_subcommand", "flag", "run_command"]

logger = logging.getLogger("lowcomm.train.cli")


def _clip_value(text: str) -> float | str:
    if text.strip().lower() == "none":
        return "none"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number > 0 or 'none' (no clipping), got {text!r}"
        ) from None


def _gap_penalty_value(text: str) -> float | str:
    if text in ("gap_aware", "none"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be 'gap_aware', 'none' or a number >= 1, got {text!r}"
        ) from None


_SPECIAL_TYPES: dict[str, Callable[[str], Any]] = {
    "clip": _clip_value,
    "gap_penalty": _gap_penalty_value,
}
_METAVARS = {
    "backend": "{auto,gloo,nccl}",
    "device": "{auto,cpu,cuda}",
    "clip_mode": "{value,norm}",
    "lr_schedule": "{cosine,constant}",
    "optimizer": "{adamw,muon}",
    "merge": "{reset,delay_corrected}",
    "local_steps": "{fixed,dynamic}",
    "speeds": "S1,S2,...",
    "clip": "PHI|none",
    "gap_penalty": "{gap_aware,none,LAMBDA}",
    "nan_policy": "{skip,raise}",
    "node_sharding": "{none,zero}",
    "data": "PATH",
    "out": "DIR",
    "resume": "PATH",
}
_OPTIONAL_VALUE = {"resume": "latest"}
"""Flags that may be given without a value, and the value they then take."""


def flag(key: str) -> str:
    """The flag of a configuration key (``sync_every``: ``--sync-every``)."""
    return flag_name(key)


def add_subcommand(subparsers: Any) -> None:
    """Register ``train`` on an argparse subparsers object (flags given only, ``SUPPRESS``)."""
    from lowcomm.registry import algorithm_help, algorithm_titles
    from lowcomm.train.config import (
        ALGORITHM_CHOICES,
        config_keys,
        field_docs,
        key_default,
        key_type,
    )

    p = subparsers.add_parser(
        "train",
        help="train a small GPT with a communication-efficient algorithm",
        description=(
            "Train a small GPT on local worker processes (or under torchrun) with "
            f"{algorithm_titles()}, synchronous DDP, or no synchronisation at all (the "
            "throughput ceiling), and write metrics, a checkpoint, a loss plot and a summary to "
            "the output folder. Flags of an algorithm that do not apply to --algo are ignored "
            "with a warning. Precedence: defaults < --config file < flags."
        ),
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument(
        "--config",
        metavar="FILE.toml",
        help="TOML file with any of the keys below (flat, underscores: sync_every = 12)",
    )
    docs = field_docs()
    flags = []
    for key in config_keys():
        default = key_default(key)
        text = docs.get(key, "")
        if key == "algo":
            text = algorithm_help()
        flags.append(
            Flag(
                key,
                key_type(key),
                None if default is dataclasses.MISSING else default,
                text,
                metavar=(
                    "{" + ",".join(ALGORITHM_CHOICES) + "}" if key == "algo" else _METAVARS.get(key)
                ),
                parse=_SPECIAL_TYPES.get(key),
                negatable=True,
                const=_OPTIONAL_VALUE.get(key),
                show_default=key != "algo_from_link",  # (its text says when it is on)
            )
        )
    add_flags(p, flags)
    p.set_defaults(_run=_run_train)


def _describe_key(key: str, sources: dict[str, str]) -> str:
    source = sources.get(key)
    if source is not None and source != "cli":
        return f"{key} in {source}"
    return flag(key)


class _ElasticBar:
    """The progress line of ``lowcomm train --fault-tolerance``: the furthest replica's step,
    the replicas in the latest sync, faults and heals."""

    def __init__(self, steps: int, *, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=steps, unit="step", desc="replicas", disable=not enabled)

    def update(self, status: dict[str, Any]) -> None:
        self.bar.n = status["step"]
        quorum = "-" if status["participants"] is None else status["participants"]
        self.bar.set_postfix_str(
            f"sync {status['sync']}: {quorum} in quorum, {status['running']} running, "
            f"{status['faults']} faults, {status['heals']} heals"
        )

    def __enter__(self) -> _ElasticBar:
        return self

    def __exit__(self, *_: object) -> None:
        self.bar.close()


def _run_train(args: argparse.Namespace, prog: str) -> int:
    from lowcomm.train.config import NO_OUTER_ALGORITHM, ConfigError, config_from_dict
    from lowcomm.train.config_file import read_toml
    from lowcomm.train.errors import TrainingDiverged, WorkerFailed
    from lowcomm.train.launcher import (
        check_environment,
        check_link_time,
        launch,
        prepare_output,
        resource_warnings,
        under_torchrun,
    )
    from lowcomm.train.preflight import local_placement
    from lowcomm.train.report import (
        divergence_text,
        failed_summary,
        format_failed,
        format_summary,
    )

    explicit = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "config"}
    sources: dict[str, str] = {}
    values: dict[str, Any] = {}
    try:
        if getattr(args, "config", None):
            file_values = read_toml(args.config)
            values.update(file_values)
            sources.update(dict.fromkeys(file_values, args.config))
        values.update(explicit)
        sources.update(dict.fromkeys(explicit, "cli"))
        cfg = config_from_dict(values, source=getattr(args, "config", None) or "config")
        cfg = cfg.with_paths()
        check_environment(cfg)
        approx_parameters = 12 * cfg.n_layer * cfg.n_embd**2 + (256 + cfg.block_size) * cfg.n_embd
        link_note = check_link_time(cfg, approx_parameters)
        prepare_output(cfg)
    except ConfigError as e:
        if e.key is not None:
            raise ValueError(f"{_describe_key(e.key, sources)} {e.problem}") from None
        raise

    if link_note is not None:
        logger.warning("%s", link_note)
    if not under_torchrun():
        for warning in resource_warnings(
            cfg.world_size,
            parameters=approx_parameters,
            cpu_workers=not local_placement(cfg).on_gpu,
            flag=_describe_key("workers", sources) if "workers" in sources else "--workers",
        ):
            logger.warning("%s", warning)
    for key in cfg.ignored_outer_keys():
        logger.warning(
            "%s does not apply to --algo %s and is ignored", _describe_key(key, sources), cfg.algo
        )
    if cfg.max_restarts and not cfg.checkpoint_every and not cfg.fault_tolerance:
        logger.warning(
            "--max-restarts without --checkpoint-every: a restarted worker group starts over "
            "from %s",
            "the --resume checkpoint" if cfg.resume is not None else "step 0",
        )
    if cfg.algo not in NO_OUTER_ALGORITHM and cfg.steps % cfg.sync_every:
        logger.warning(
            "--steps %d is not a multiple of --sync-every %d: the last %d step(s) are not "
            "synchronised and are discarded at the end",
            cfg.steps,
            cfg.sync_every,
            cfg.steps % cfg.sync_every,
        )

    t0 = time.perf_counter()
    if cfg.fault_tolerance and cfg.lighthouse is None:
        from lowcomm.train.elastic import format_elastic_summary, launch_replicas

        with _ElasticBar(cfg.steps, enabled=not cfg.quiet) as bar:
            elastic = launch_replicas(cfg, status=bar.update)
        print(format_elastic_summary(elastic, command_s=time.perf_counter() - t0))
        return 0
    try:
        summary = launch(cfg)
    except WorkerFailed as e:
        if not under_torchrun() or int(os.environ.get("RANK", "0")) == 0:
            measured, path = failed_summary(cfg, f"worker rank {e.rank} failed: {e.error}")
            if measured is not None:
                print(format_failed(measured, path))
        raise
    except KeyboardInterrupt:
        if not under_torchrun() or int(os.environ.get("RANK", "0")) == 0:
            measured, path = failed_summary(cfg, "interrupted", status="interrupted")
            if measured is not None:
                print(format_failed(measured, path))
        raise
    total_s = time.perf_counter() - t0
    if summary is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    summary_path = os.path.join(cfg.out or ".", "summary.json")
    with open(summary_path, encoding="utf-8") as fh:
        summary = json.load(fh)
    command_s = None if under_torchrun() else total_s
    print(format_summary(summary, command_s=command_s))
    if summary.get("status") == "diverged":
        where = divergence_text(summary.get("nonfinite") or {})
        raise TrainingDiverged(f"training diverged: {where}; lower --lr")
    return 0


class _Parser(argparse.ArgumentParser):
    """Its errors raise ``ValueError`` (one line) instead of exiting the process."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def run_command(argv: Sequence[str]) -> int:
    """``lowcomm train ARGV`` in this process, without the ``lowcomm`` command line around it:
    its exit code when it finishes (0; a rank other than 0 under torchrun too), its error
    otherwise (``ValueError`` for a bad flag or setting, :class:`~lowcomm.train.errors.
    WorkerFailed`, :class:`~lowcomm.train.errors.TrainingDiverged`)."""
    parser = _Parser(prog="lowcomm")
    add_subcommand(parser.add_subparsers(dest="_command"))
    args = parser.parse_args(["train", *argv])
    return int(args._run(args, "lowcomm train"))
