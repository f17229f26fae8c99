"""``lowcomm bench``: the command-line front of :func:`lowcomm.bench.run_bench`.

lowcomm bench --quick                          # < 5 minutes on 2 cores
lowcomm bench                                  # the full matrix
lowcomm bench --algos co2,ddp --links 1gbit,100mbit --workers 2,4 --steps 120
lowcomm bench --convergence                    # loss and time to DDP's loss, 3 seeds
lowcomm bench --balance                        # length-aware balancing of documents, 4 workers
lowcomm bench --cost-model                     # fit and check the cost model on this device
lowcomm bench --codec-only --codec-sizes 1,10,85  # each codec's time against a clone of its buckets
lowcomm bench --ddp-parity-only                # --algo ddp against plain torch DDP, 2 workers
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any

from lowcomm.flags import add_flags, fields_of, flag

__all__ = ["add_subcommand"]


from lowcomm.bench.argtypes import csv_list, float_csv, int_csv
from lowcomm.bench.sections import (
    CODEC_KEYS,
    DDP_PARITY_KEYS,
    codec_settings,
    ddp_parity_settings,
    note,
    run_codec_only,
    run_ddp_parity_only,
    worker_threads,
)


@dataclass(kw_only=True)
class BenchFlags:
    """The flags of ``lowcomm bench``: each field one flag (a switch's default is always in the
    namespace; any other flag only when given)."""

    quick: bool = flag(False, keep_default=True)
    """the small matrix: ddp, co2, diloco on 1gbit and 100mbit; 2 workers; 96 steps"""
    convergence: bool = flag(False, keep_default=True)
    """the convergence harness instead of the matrix: every algorithm and DDP over --seeds, loss at
    equal tokens, and steps, tokens and wall time on each of --links to DDP's final loss (writes
    convergence.md, results.json and plots; default out runs/convergence)"""
    chaos: bool = flag(False, keep_default=True)
    """the chaos benchmark instead of the matrix: elastic jobs (--fault-tolerance) of --algos
    (default co2,diloco,streaming; job: the default job, no --algo, its algorithm and settings
    chosen from the link) with --workers replicas (default 4), fault-free and with a
    replica SIGKILLed every --mtbf seconds (default 30) over --steps (default 960), then
    targeted --faults over --targeted-steps (default 240); with --links, goodput over each link
    instead (fault-free, MTBF and checkpoint-restart runs of the job chosen for the link,
    against the no-sync ceiling); writes chaos.md and results.json (default out runs/chaos)"""
    mtbf: float | None = flag(None, metavar="S")
    """--chaos: seconds between two kills (default 30)"""
    faults: list[str] | None = flag(None, metavar="K,L", parse=csv_list)
    """--chaos: targeted faults among sync,donor,stall,below-min,never-returns (default all; 'none'
    for none)"""
    targeted_steps: int | None = flag(None, metavar="N")
    """--chaos: inner steps of the jobs with one targeted fault (default 240)"""
    lost_state: str | None = flag(None, metavar="link|local")
    """--chaos --links: where the checkpoint-restart run gets a killed worker's state back: link
    (default: the kill loses its machine, and its replacement reads its checkpoint across the
    link, as a killed elastic replica heals over it) or local (its own disk)"""
    soak: float | None = flag(None, metavar="MINUTES")
    """--chaos: a soak instead: the first of --algos over the first of --links (default
    100mbit) for MINUTES while replicas die and are started at random (kill 0.4, start 0.6 per
    event); fails on a digest mismatch, a stall over 60 s or a replica left unhealed"""
    balance: bool = flag(False, keep_default=True)
    """the balancing benchmark instead of the matrix: lowcomm train --documents under every
    assignment of documents to ranks, with DDP and CO2, and splitting long documents on fast and
    slow links (writes balance.md and results.json; default out runs/balance)"""
    cost_model: bool = flag(False, keep_default=True)
    """fit the cost model c(s) = d + a s + b s^2 of a GPT on this device and report its error on
    held-out packed micro-batches"""
    assignments: list[str] | None = flag(None, metavar="A,B", parse=csv_list)
    """--balance: rows of the assignment section (default: all)"""
    block_size: int | None = flag(None, metavar="N")
    """--balance, --cost-model: longest document (default 4096)"""
    batch_size: int | None = flag(None, metavar="N")
    """--balance: sequences of block-size tokens per worker per step (default 4)"""
    split_block_size: int | None = flag(None, metavar="N")
    """--balance: longest document of the splitting section (default 8192)"""
    cycles: int | None = flag(None, metavar="N")
    """--balance: plan units per assignment in every job, the first left out as start-up (default 6
    DDP steps, 4 CO2 rounds, 8 steps in the splitting section)"""
    splitting: bool | None = flag(None, negatable=True)
    """--balance: run the splitting section (default on)"""
    corpus: str | None = flag(None, choices=("stdlib", "lognormal"))
    """--balance: the assignment section's documents without --data: the standard library's source
    (default) or 2,000 generated ones of log-normal length (median 300 bytes, sigma 1.2, up to
    8,192; lowcomm.balance.lognormal_texts)"""
    busy_wait: bool | None = flag(None, negatable=True)
    """--balance: poll collectives (default: when workers outnumber CPU cores)"""
    n_layer: int | None = flag(None, metavar="N")
    """--balance, --cost-model: default 2"""
    n_embd: int | None = flag(None, metavar="N")
    """--balance, --cost-model: default 64"""
    n_head: int | None = flag(None, metavar="N")
    """--balance, --cost-model: default 2"""
    seeds: list[int] | None = flag(None, metavar="S,T", parse=int_csv)
    """--convergence: default 0,1,2"""
    long: bool = flag(False, keep_default=True)
    """--convergence: also run every job 4x longer (--lengths 1,4)"""
    lengths: list[int] | None = flag(None, metavar="L,M", parse=int_csv)
    """--convergence: multiples of the job's steps to run (default 1; e.g. 4 for the longer jobs
    alone)"""
    timing_steps: int | None = flag(None, metavar="N")
    """--convergence: steps of each job timed on a link (default 48)"""
    reuse: bool = flag(False, keep_default=True)
    """--convergence: keep finished jobs of an earlier run in --out"""
    algos: list[str] | None = flag(None, metavar="A,B", parse=csv_list)
    """algorithms (lowcomm train --algo), each optionally +CODEC; with --convergence also
    /KEY=VALUE job settings (co2/outer_lr=0.3/outer_momentum=0)"""
    links: list[str] | None = flag(None, metavar="L,M", parse=csv_list)
    """link profiles or RATE:LATENCY values"""
    workers: list[int] | None = flag(None, metavar="N,M", parse=int_csv)
    """worker counts"""
    steps: int | None = flag(None, metavar="N")
    """inner steps per worker per cell"""
    sync_every: int | None = flag(None, metavar="H")
    """round length"""
    seed: int | None = flag(None, metavar="N")
    """seed for every cell"""
    eval_every: int | None = flag(None, metavar="N")
    eval_batches: int | None = flag(None, metavar="N")
    ceiling_steps: int | None = flag(None, metavar="N")
    """no-sync steps each cell times in its own processes, in segments of 2 steps interleaved with
    training (default 24; --quick 16)"""
    target_loss: float | None = flag(None, metavar="X")
    """validation loss for the time-to-target column (default: the highest final loss of the
    matrix, which every cell reaches)"""
    real_links: list[str] | None = flag(None, metavar="L,M|none", parse=csv_list)
    """links to also run on real tc-shaped network namespaces (default 100mbit; needs root and
    iproute2, skipped with a message otherwise)"""
    real_algos: list[str] | None = flag(None, metavar="A,B", parse=csv_list)
    """default ddp,co2"""
    overhead: bool | None = flag(None, negatable=True)
    """run the hook-overhead micro-benchmark (default on)"""
    overhead_algos: list[str] | None = flag(None, metavar="A,B", parse=csv_list)
    memory: bool | None = flag(None, negatable=True)
    """run the memory report: outer state and buffers per rank, sharded and not (default on)"""
    memory_workers: list[int] | None = flag(None, metavar="N,M", parse=int_csv)
    """group sizes of the memory report (default 2,4)"""
    codec: bool | None = flag(None, negatable=True)
    """run the codec row: encode + decode + error feedback of each of --codecs on --codec-sizes
    parameters (lowcomm's Compressor, one-rank gloo group) against a clone() of the same buckets
    timed in turn with it (default on; off with --quick)"""
    codecs: list[str] | None = flag(None, metavar="C,D", parse=csv_list)
    """the codec row's --compression values (default all:
    int8,int4,int2,topk:0.01,bf16,sign,powersgd:4)"""
    codec_sizes: list[float] | None = flag(None, metavar="M,N", parse=float_csv)
    """the codec row's sizes, millions of parameters (default 1,10; 85: GPT-2 small)"""
    codec_repeats: int | None = flag(None, metavar="N")
    """the codec row's timed repeats per entry, at most (default 5; 30 s an entry)"""
    codec_only: bool = flag(False, keep_default=True)
    """the codec row alone, without the matrix, with a worker's share of the cores (--workers N,
    default 2); writes codec.md and results.json (default out runs/codec)"""
    ddp_parity: bool | None = flag(None, negatable=True)
    """run DDP parity: lowcomm train --algo ddp against plain torch DDP on the same model and
    batches, 2 workers over gloo, steps in turn (default off: minutes)"""
    ddp_parity_steps: int | None = flag(None, metavar="N")
    """DDP parity's timed pairs of steps (default 200; at most 600 s)"""
    ddp_parity_only: bool = flag(False, keep_default=True)
    """DDP parity alone, without the matrix (--workers N, default 2); writes ddp_parity.md and
    results.json (default out runs/ddp-parity)"""
    data: str | None = flag(None, metavar="PATH")
    """text file or folder (default: embedded)"""
    out: str | None = flag(None, metavar="DIR")
    """output folder (default runs/bench)"""
    overwrite: bool = flag(False, keep_default=True)
    """replace the results of a previous bench run in --out"""


def add_subcommand(subparsers: Any) -> None:
    """Register ``bench`` on the ``lowcomm`` command's subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark the algorithms over emulated (and real) slow links",
        description=(
            "Run a matrix of lowcomm train jobs (algorithms x link profiles x worker counts, "
            "same data, steps and seed) plus the no-sync ceiling measured in the same run, "
            "an emulated-against-real link check (root, tc), a hook-overhead "
            "micro-benchmark, a memory report and the codec row (each codec's time against a "
            "clone of the same buckets); write results.json, results.md, throughput.png and "
            "loss_vs_time.png to --out. Flags given with --quick override its preset."
        ),
        argument_default=argparse.SUPPRESS,
    )
    add_flags(p, fields_of(BenchFlags, show_defaults=False))
    p.set_defaults(_run=_run_bench)


_CONVERGENCE_KEYS = {"algos", "workers", "steps", "links", "eval_every", "eval_batches", "out"}
_CONVERGENCE_KEYS |= {"seeds", "timing_steps"}


def _run_convergence(args: argparse.Namespace) -> int:
    from lowcomm.bench.convergence import ConvergenceSpec, run_convergence
    from lowcomm.bench.convergence_report import format_markdown

    given = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    flags = {"quick", "convergence", "long", "lengths", "reuse", "overwrite", "data", "balance"}
    flags |= {"cost_model", "chaos", "codec_only", "ddp_parity_only"}
    wrong = sorted(k for k in given if k not in _CONVERGENCE_KEYS and k not in flags)
    if wrong:
        raise ValueError(
            f"--{wrong[0].replace('_', '-')} is a flag of the bench matrix, not of --convergence"
        )
    if args.quick:
        raise ValueError("--quick and --convergence are two different runs; pick one")
    values = {k: v for k, v in given.items() if k in _CONVERGENCE_KEYS}
    if getattr(args, "data", None) is not None:
        values["train_overrides"] = {"data": args.data}
    long, lengths = getattr(args, "long", False), getattr(args, "lengths", None)
    if long and lengths is not None:
        raise ValueError("--long is --lengths 1,4; give one of them")
    lengths = lengths or ([1, 4] if long else [1])
    spec = ConvergenceSpec(**values, lengths=lengths, reuse=args.reuse)
    results_path = os.path.join(spec.out, "results.json")
    if os.path.exists(results_path) and not (args.overwrite or args.reuse):
        raise ValueError(
            f"--out {spec.out!r} already holds results; choose another folder, pass --overwrite, "
            "or --reuse to keep its finished jobs"
        )
    command = "lowcomm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results = run_convergence(
        spec, command=command, progress=lambda text: print(text, file=sys.stderr, flush=True)
    )
    print(format_markdown(results))
    print(f"results: {results_path} (+ convergence.md, loss_vs_tokens.png, loss_vs_time.png)")
    return 0


_BALANCE_KEYS = {"algos", "workers", "cycles", "sync_every", "seed", "data", "out", "assignments"}
_BALANCE_KEYS |= {"block_size", "batch_size", "split_block_size", "splitting", "busy_wait"}
_BALANCE_KEYS |= {"n_layer", "n_embd", "n_head", "corpus"}
_SWITCHES: tuple[str, ...] = ("quick", "convergence", "balance", "cost_model", "long", "reuse")
_SWITCHES += ("overwrite", "chaos", "codec_only", "ddp_parity_only")
_CHAOS_KEYS = {"algos", "workers", "steps", "targeted_steps", "mtbf", "faults", "seed", "out"}
_CHAOS_KEYS |= {"data", "links", "soak", "lost_state"}


def _given(args: argparse.Namespace) -> dict[str, Any]:
    return {
        k: v
        for k, v in vars(args).items()
        if not k.startswith("_") and not (k in _SWITCHES and v is False)
    }


def _run_balance(args: argparse.Namespace) -> int:
    from lowcomm.bench.balance import BalanceSpec, format_balance, run_balance

    given = _given(args)
    wrong = sorted(k for k in given if k not in _BALANCE_KEYS and k not in ("balance", "overwrite"))
    if wrong:
        raise ValueError(f"--{wrong[0].replace('_', '-')} is not a flag of --balance")
    values = {k: v for k, v in given.items() if k in _BALANCE_KEYS}
    if "workers" in values:
        if len(values["workers"]) != 1:
            raise ValueError("--balance runs one worker count: give --workers N")
        values["workers"] = values["workers"][0]
    if "cycles" in values:
        n = values["cycles"]
        values.update(cycles=n, round_cycles=n, split_cycles=n)
    spec = BalanceSpec(**values)
    results_path = os.path.join(spec.out, "results.json")
    if os.path.exists(results_path) and not args.overwrite:
        raise ValueError(
            f"--out {spec.out!r} already holds results; choose another folder or pass --overwrite"
        )
    command = "lowcomm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results = run_balance(
        spec, command=command, progress=lambda text: print(text, file=sys.stderr, flush=True)
    )
    print(format_balance(results))
    print(f"results: {results_path} (+ balance.md; every job's balance.json under jobs/)")
    return 0


def _run_chaos(args: argparse.Namespace) -> int:
    from lowcomm.bench.chaos import ChaosSpec, format_chaos, run_chaos

    given = _given(args)
    wrong = sorted(k for k in given if k not in _CHAOS_KEYS and k not in ("chaos", "overwrite"))
    if wrong:
        raise ValueError(f"--{wrong[0].replace('_', '-')} is not a flag of --chaos")
    values = {k: v for k, v in given.items() if k in _CHAOS_KEYS}
    if "workers" in values:
        if len(values["workers"]) != 1:
            raise ValueError("--chaos runs one replica count: give --workers N")
        values["workers"] = values["workers"][0]
    if values.get("faults") == ["none"]:
        values["faults"] = []
    spec = ChaosSpec(**values)
    if "lost_state" in values and spec.links is None:
        raise ValueError("--lost-state is a setting of the checkpoint-restart runs: give --links")
    results_path = os.path.join(spec.out, "results.json")
    if os.path.exists(results_path) and not args.overwrite:
        raise ValueError(
            f"--out {spec.out!r} already holds results; choose another folder or pass --overwrite"
        )
    command = "lowcomm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    progress = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    if spec.soak is not None:
        from lowcomm.bench.soak import format_soak, run_soak

        results = run_soak(spec, command=command, progress=progress)
        print(format_soak(results))
        print(f"results: {results_path} (+ chaos.md; the job's replicas under runs/)")
        return 0 if results["runs"][0]["passed"] else 1
    if spec.links is not None:
        from lowcomm.bench.chaos_links import format_link_chaos, run_link_chaos

        results = run_link_chaos(spec, command=command, progress=progress)
        print(format_link_chaos(results))
        print(f"results: {results_path} (+ chaos.md; every run under runs/)")
        return 0
    results = run_chaos(spec, command=command, progress=progress)
    print(format_chaos(results))
    print(f"results: {results_path} (+ chaos.md; every run's replicas under runs/)")
    return 0


def _run_cost_model(args: argparse.Namespace) -> int:
    from lowcomm.bench.balance import run_cost_model

    given = _given(args)
    shape = ("block_size", "n_layer", "n_head", "n_embd")
    wrong = sorted(k for k in given if k not in shape and k != "cost_model")
    if wrong:
        raise ValueError(f"--{wrong[0].replace('_', '-')} is not a flag of --cost-model")
    values = {"block_size": 4096, "n_layer": 2, "n_head": 2, "n_embd": 64}
    values.update({k: v for k, v in given.items() if k in shape})
    report = run_cost_model(**values)
    fit = report["fit"]
    print(
        f"cost model on this device (GPT {values['n_layer']} layers x {values['n_embd']}, "
        f"documents up to {values['block_size']} tokens):\n"
        f"  c(s) = {fit['d']:.3g} + {fit['a']:.3g} s + {fit['b']:.3g} s^2 seconds per document, "
        f"+ {fit['c0']:.3g} per micro-batch\n"
        f"  attention costs as much as the linear layers at s = {report['crossover_tokens']:.0f}\n"
        f"  fit error: {100 * fit['rms_rel_error']:.1f}% rms over {len(fit['samples'])} shapes "
        f"(largest {100 * fit['max_rel_error']:.1f}%)\n"
        f"  held-out packed micro-batches: mean error {100 * report['held_out_error_mean']:.1f}%"
    )
    return 0


def _run_bench(args: argparse.Namespace, prog: str) -> int:
    """``lowcomm bench``'s run: the codec row alone, the cost model, the balancing benchmark,
    the convergence harness or the matrix."""
    from lowcomm.bench.matrix import BenchSpec, run_bench
    from lowcomm.bench.report import format_markdown, write_report

    t0 = time.perf_counter()
    alone = [
        f
        for f, on in (
            ("--codec-only", args.codec_only),
            ("--ddp-parity-only", args.ddp_parity_only),
        )
        if on
    ]
    others = (args.balance, args.convergence, args.quick, args.cost_model, args.chaos)
    if alone and (any(others) or len(alone) > 1):
        raise ValueError(
            f"{alone[0]} is a run of its own: drop --quick, --convergence, --balance, --chaos, "
            "--cost-model and the other ...-only flag"
        )
    if args.codec_only:
        return run_codec_only(args, _given(args))
    if args.ddp_parity_only:
        return run_ddp_parity_only(args, _given(args))
    if args.balance and (args.convergence or args.quick or args.cost_model):
        raise ValueError("--balance is a run of its own: drop --quick, --convergence, --cost-model")
    if args.chaos:
        if args.balance or args.convergence or args.quick or args.cost_model:
            raise ValueError(
                "--chaos is a run of its own: drop --quick, --convergence, --balance, --cost-model"
            )
        return _run_chaos(args)
    for key in ("mtbf", "faults", "targeted_steps", "soak"):
        if key in vars(args):
            raise ValueError(f"--{key.replace('_', '-')} is a flag of --chaos; add it")
    if args.cost_model:
        return _run_cost_model(args)
    if args.balance:
        return _run_balance(args)
    for key in _BALANCE_KEYS - {"algos", "workers", "sync_every", "seed", "data", "out"}:
        if key in vars(args):
            raise ValueError(f"--{key.replace('_', '-')} is a flag of --balance; add it")
    if args.convergence:
        return _run_convergence(args)
    for key in ("seeds", "timing_steps", "long", "lengths", "reuse"):
        if getattr(args, key, False) not in (False, None):
            raise ValueError(f"--{key.replace('_', '-')} is a flag of --convergence; add it")
    values = {
        k: v
        for k, v in vars(args).items()
        if not k.startswith("_")
        and k not in ("quick", "overwrite", "data", "convergence", "long", "lengths", "reuse")
        and k not in ("balance", "cost_model", "chaos", "codec_only", "ddp_parity_only")
        and k not in (*CODEC_KEYS, *DDP_PARITY_KEYS)
    }
    if getattr(args, "data", None) is not None:
        values["train_overrides"] = {"data": args.data}
    spec = BenchSpec.quick_preset(**values) if args.quick else BenchSpec(**values)
    given = _given(args)
    codec_on = given.get("codec", not args.quick)  # (the row takes a minute: not in --quick)
    for key in [k for k in CODEC_KEYS[1:] if k in given and not codec_on]:
        raise ValueError(f"--{key.replace('_', '-')} is a flag of the codec row; add --codec")
    # as the overhead micro-benchmark: a worker's share of the cores in the first worker count
    codecs = codec_settings(given, worker_threads(spec.workers[0])) if codec_on else {}
    parity = None
    if given.get("ddp_parity", False):
        parity = ddp_parity_settings({**given, "workers": [max(2, spec.workers[0])]})
    elif "ddp_parity_steps" in given:
        raise ValueError("--ddp-parity-steps is a flag of DDP parity; add --ddp-parity")
    results_path = os.path.join(spec.out, "results.json")
    if os.path.exists(results_path) and not args.overwrite:
        raise ValueError(
            f"--out {spec.out!r} already holds bench results; choose another folder or pass "
            "--overwrite"
        )
    command = "lowcomm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results = run_bench(spec, command=command, progress=note)
    if codec_on:
        from lowcomm.bench.codec import measure_codecs
        from lowcomm.bench.results import codec_goal

        note(f"codec row: {', '.join(codecs['codecs'])}")
        results["codec"] = measure_codecs(**codecs, progress=note)
        results["goals"].append(codec_goal(results["codec"]))
    if parity is not None:
        from lowcomm.bench.ddp_parity import measure_ddp_parity

        note(f"DDP parity: {parity['workers']} workers, {parity['steps']} pairs of steps")
        results["ddp_parity"] = measure_ddp_parity(**parity)
    if codec_on or parity is not None:
        results["elapsed_s"] = time.perf_counter() - t0
        write_report(results, spec.out)  # again, with the sections
    print(format_markdown(results))
    print(f"results: {results_path} (+ results.md, throughput.png, loss_vs_time.png)")
    return 0
