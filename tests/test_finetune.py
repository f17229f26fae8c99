"""``lowcomm finetune``: a tiny lowcomm train checkpoint fine-tuned with MeZO (single and PertP:
the same numbers) and with AdamW under DDP, through the CLI and real worker processes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from lowcomm.cli import main
from lowcomm.testing.jobs import tiny_job_args

FINETUNE = ["--steps", "4", "--eval-every", "2", "--eval-batches", "2", "--batch-size", "4"]
FINETUNE += ["--block-size", "16", "--quiet"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: Any) -> str:
    from lowcomm.testing.jobs import run_train_job

    out = tmp_path_factory.mktemp("pretrained")
    run_train_job(out, "--algo", "co2", *tiny_job_args(steps=6, sync_every=3))
    return str(out)


def _finetune(
    pretrained: str, out: Path, *flags: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    assert main(["finetune", "--init", pretrained, *FINETUNE, "--out", str(out), *flags]) == 0
    with open(out / "summary.json") as f:
        summary = json.load(f)
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    return summary, records


@pytest.mark.timeout(300)
def test_zo_single_and_blockwise_pertp_agree_and_send_a_few_bytes(
    pretrained: str, tmp_path: Path, capsys: Any
) -> None:
    single, single_records = _finetune(pretrained, tmp_path / "single", "--method", "zo")
    pertp, pertp_records = _finetune(
        pretrained,
        tmp_path / "pertp",
        *("--method", "zo", "--mode", "pertp", "--workers", "2", "--offload"),
    )

    # PertP (here with ZO2's fused blockwise pass and its offloading, the blocks streamed through
    # two buffers) is single-process MeZO bit for bit: every loss it records is the same
    def losses(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in records]

    assert losses(pertp_records) == losses(single_records)
    evals = [r["val_loss"] for r in single_records if r["kind"] == "eval"]
    assert len(evals) == 3 and evals == [
        r["val_loss"] for r in pertp_records if r["kind"] == "eval"
    ]
    assert single["val_loss_final"] == pertp["val_loss_final"] != single["val_loss_initial"]
    # one all-gather of 3 float64 per step (24 bytes) and the 8-byte replica check at the end;
    # one process sends nothing
    assert single["bytes_sent_per_worker_per_step"] == 0
    assert pertp["bytes_sent_per_worker_per_step"] == (4 * 24 + 8) / 4
    assert all(b > 0 for b in pertp["peak_rss_bytes_per_worker"])
    offload = pertp["offload"]
    assert offload["offloaded_stages"] == 2  # the tiny model's two blocks
    assert offload["buffers"] == offload["max_resident"] == 2 and single["offload"] is None
    assert "held-out loss" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_adamw_ddp_for_comparison_sends_the_gradients(pretrained: str, tmp_path: Path) -> None:
    summary, records = _finetune(
        pretrained, tmp_path / "adamw", "--method", "adamw", "--mode", "ddp", "--workers", "2"
    )
    # DDP all-reduces every gradient every step: 2 (N - 1) / N x 4 bytes x parameters
    assert summary["bytes_sent_per_worker_per_step"] == pytest.approx(
        4 * summary["parameters"], rel=0.01
    )
    assert summary["val_loss_final"] < summary["val_loss_initial"]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 2, 4]


@pytest.mark.parametrize(
    "flags,message",
    [
        ([], "--init names the model to fine-tune"),
        (
            ["--init", "X", "--mode", "pertp", "--workers", "3"],
            "--workers must be 2 for --mode pertp",
        ),
        (["--init", "X", "--mode", "2d", "--workers", "3"], "--workers must be even"),
        (["--init", "X", "--method", "adamw", "--mode", "pertp"], "adamw runs DDP"),
        (["--init", "X", "--mode", "ddp", "--workers", "3"], "--batch-size must divide into 3"),
        (["--init", "X", "--method", "sgd"], "--method must be one of zo, adamw"),
        (["--init", "X", "--threads", "0"], "--threads must be an integer >= 1"),
        (
            ["--init", "X", "--blockwise", "--method", "adamw", "--mode", "ddp"],
            "--blockwise is for",
        ),
        (["--init", "X", "--offload", "--n-directions", "2"], "--offload is for"),
    ],
)
def test_bad_settings_are_one_line_exit_2(flags: list[str], message: str, capsys: Any) -> None:
    assert main(["finetune", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_init_that_is_no_checkpoint_is_named_before_any_worker_starts(
    tmp_path: Path, capsys: Any
) -> None:
    os.makedirs(tmp_path / "empty")
    code = main(
        ["finetune", "--init", str(tmp_path / "empty"), *FINETUNE, "--out", str(tmp_path / "o")]
    )
    assert code == 2
    assert "no lowcomm train checkpoint there" in capsys.readouterr().err
