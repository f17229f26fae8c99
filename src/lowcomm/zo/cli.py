"""``lowcomm finetune``: the command line of :mod:`lowcomm.zo.finetune`.

lowcomm train --out runs/pre                                         # pretrain (CO2)
lowcomm finetune --init runs/pre --method zo --mode pertp --workers 2
lowcomm finetune --init runs/pre --method adamw --mode ddp --workers 2   # first order
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Any

__all__ = ["add_subcommand", "format_summary"]


def add_subcommand(subparsers: Any) -> None:
    from lowcomm.flags import add_flags, fields_of
    from lowcomm.zo.finetune import FinetuneConfig

    p = subparsers.add_parser(
        "finetune",
        help="fine-tune a pretrained model with zeroth-order MeZO (or AdamW for comparison)",
        description=(
            "Fine-tune a lowcomm train checkpoint on Python standard-library code with MeZO "
            "(single, pertp, ddp or 2d over the workers: a few floats per step between them) "
            "or with first-order AdamW under DDP, and write metrics and a summary."
        ),
        argument_default=argparse.SUPPRESS,
    )
    add_flags(p, fields_of(FinetuneConfig, negatable=True))
    p.set_defaults(_run=_run)


def _run(args: argparse.Namespace, prog: str) -> int:
    from lowcomm.runfiles import check_writable_folder
    from lowcomm.train.launcher import launch
    from lowcomm.zo.finetune import FinetuneConfig, check_init, finetune

    values = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    # a bad setting or --init raises ValueError: one line, exit 2 (lowcomm.cli.main)
    cfg = FinetuneConfig(**values).with_paths()
    check_init(cfg)
    assert cfg.out is not None
    check_writable_folder(cfg.out)  # OSError naming it: one line, exit 4
    if os.path.exists(os.path.join(cfg.out, "summary.json")):
        if not cfg.overwrite:
            raise ValueError(
                f"{cfg.out} holds a previous run; pass --overwrite to replace it or --out for "
                "another folder"
            )
        shutil.rmtree(cfg.out)
    summary = launch(cfg, job=finetune)  # type: ignore[arg-type]
    if summary is not None:
        print(format_summary(summary))
    return 0


def _count(workers: int) -> str:
    return "1 worker" if workers == 1 else f"{workers} workers"


def format_summary(summary: dict[str, Any]) -> str:
    """The table the CLI prints at the end of a run."""
    peak = max(summary["peak_rss_bytes_per_worker"]) / 2**20
    rows = [
        ("method", f"{summary['method']} ({summary['mode']}, {_count(summary['workers'])})"),
        ("steps", f"{summary['steps']} ({summary['tokens']:,} tokens, lr {summary['lr']:g})"),
        ("held-out loss", f"{summary['val_loss_initial']:.4f} -> {summary['val_loss_final']:.4f}"),
        ("tokens/s", f"{summary['tokens_per_s']:,.0f}"),
        ("bytes / worker / step", f"{summary['bytes_sent_per_worker_per_step']:,.1f}"),
        ("peak memory / worker", f"{peak:,.0f} MiB resident"),
    ]
    device_peaks = [b for b in summary.get("peak_device_bytes_per_worker", []) if b is not None]
    if device_peaks:
        rows.append(("peak device memory", f"{max(device_peaks) / 2**20:,.0f} MiB allocated"))
    offload = summary.get("offload")
    if offload:
        rows.append(
            (
                "offloaded",
                f"{offload['offloaded_stages']} blocks through {offload['buffers']} buffers "
                f"of {offload['buffer_bytes'] / 2**20:,.2f} MiB",
            )
        )
    rows += [
        ("output", str(summary.get("out"))),
    ]
    width = max(len(k) for k, _ in rows)
    return "lowcomm finetune finished\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
