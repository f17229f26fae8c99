"""``lowcomm train --algo ddp`` against plain torch ``DistributedDataParallel``: the step time of
each, side by side in one run, on the job's default GPT and the same batches, 2 workers over
gloo on 127.0.0.1, no emulated link (:mod:`lowcomm.bench.ddp_parity`: two DDP copies of the
model in the same processes, one step each in turn, the order flipping every pair). The goal
is lowcomm within 3% of torch. Reproduce (2 to 4 minutes on 2 cores, the longer when
other work shares them)::

    python benchmarks/ddp_parity.py

which prints the markdown table and writes ``benchmarks/ddp_parity.md``; ``--steps``,
``--warmup``, ``--workers`` and ``--max-seconds`` change the run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from lowcomm.bench.ddp_parity import measure_ddp_parity, parity_table

HERE = Path(__file__).resolve().parent


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=HERE,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed pairs (default 200)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed pairs (default 10)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--torch-bucket-cap-mb",
        type=float,
        default=None,
        help="plain DDP's bucket_cap_mb (default torch's: a 1 MiB first bucket, then 25 MiB); "
        "25 gives it lowcomm's buckets, to compare the hooks alone",
    )
    parser.add_argument("--out", type=Path, default=HERE / "ddp_parity.md")
    args = parser.parse_args(argv)
    r = measure_ddp_parity(
        steps=args.steps,
        workers=args.workers,
        seed=args.seed,
        warmup=args.warmup,
        max_seconds=args.max_seconds,
        torch_bucket_cap_mb=args.torch_bucket_cap_mb,
    )
    m, cap = r["model"], r["torch_bucket_cap_mb"]
    head = (
        f"`lowcomm train --algo ddp` against plain `torch.nn.parallel.DistributedDataParallel`: "
        f"the default GPT ({m['n_layer']} layers, {m['n_embd']} wide, "
        f"{m['parameters']:,} parameters; batch {m['batch_size']} x {m['block_size']}), "
        f"AdamW, {r['workers']} workers over gloo on 127.0.0.1 ({r['threads']} thread(s) each), "
        f"no emulated link; {r['pairs']} pairs of steps after {r['warmup']} untimed, one step "
        f"of each in turn on the same batch, the order flipping every pair; a step's time is "
        f"the slowest rank's. Commit {_commit()}, `python benchmarks/ddp_parity.py"
        + (f" --steps {args.steps}" if args.steps != 200 else "")
        + (f" --torch-bucket-cap-mb {cap:g}" if cap is not None else "")
        + "`.\n\n"
    )
    buckets = (
        "torch's own (a 1 MiB first bucket, then 25 MiB)"
        if cap is None
        else f"`bucket_cap_mb={cap:g}` (first bucket included)"
    )
    foot = (
        f"\n\nBuckets: torch DDP {buckets}; lowcomm the job's `bucket_cap_mb` "
        f"({m['bucket_cap_mb']:g} MiB, first bucket included). "
        f"Both copies ended with bitwise equal parameters: "
        f"{'yes' if r['params_equal'] else 'no'} (largest difference {r['max_abs_diff']:.3g}). "
        f"lowcomm's meter counted {r['collectives_per_step']:g} all-reduce(s) a step, "
        f"{r['lowcomm_stats']['payload_bytes'] / max(1, r['lowcomm_stats']['collectives']):,.0f}"
        f" bytes each.\n"
    )
    text = head + parity_table(r) + foot
    print(text)
    args.out.write_text(text)
    if r["stopped_early"]:
        print(f"stopped after {r['pairs']} pairs (--max-seconds)", file=sys.stderr)


if __name__ == "__main__":
    main()
