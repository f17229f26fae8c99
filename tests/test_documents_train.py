"""``lowcomm train --documents``: whole documents balanced across ranks, end to end."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from lowcomm.cli import main
from lowcomm.testing.jobs import run_train_job, tiny_job_args
from lowcomm.testing.runs import assert_same_run
from lowcomm.train.config import ConfigError, config_from_dict
from lowcomm.train.loop import FAULT_ENV

DOCS = [
    "--documents",
    *tiny_job_args(block_size=64, batch_size=1, steps=6, sync_every=2, dropout=0.0),
]


@pytest.mark.timeout(240)
def test_ddp_documents_in_turn_record_the_balance_per_assignment(
    train_job: Any, tmp_path: Any
) -> None:
    out = tmp_path / "ddp"
    summary = train_job("--algo", "ddp", *DOCS, "--balance", "random,cost+split", out=out)
    with open(out / "balance.json", encoding="utf-8") as f:
        balance = json.load(f)
    assert balance["unit_steps"] == 1
    units = balance["units"]
    assert [u["unit"] for u in units] == list(range(6))
    assert [u["assignment"] for u in units] == ["random", "cost+split"] * 3
    assert set(balance["assignments"]) == {"random", "cost+split"}
    assert balance["assignments"]["random"]["units"] == 2  # the first of each is start-up
    for u in units:
        assert len(u["compute_s"]) == 2 and all(t > 0 for t in u["compute_s"])
        assert sum(u["tokens"]) >= 2 * 64 - 2  # a split piece's share is counted per rank
        assert min(u["straggler_wait_s"]) == 0.0
        assert 0.0 <= u["idle_fraction"] < 1.0
    fit = balance["cost_model"]
    assert fit["rms_rel_error"] >= 0 and len(fit["samples"]) >= 4
    # refitted online after every unit, the same model and the same plan on both ranks
    assert balance["refits"] == 6
    assert all(u["plans_identical"] and u["cost_models_identical"] for u in units)
    after = [u["cost_model_after"] for u in units]
    assert all(m is not None and m["a"] + m["b"] > 0 for m in after)
    assert all(u["cost_model_rms_error"] >= 0 for u in units)
    assert summary["balance"]["units"] == 4  # the first of each assignment is start-up
    assert summary["balance"]["cost_model_error"] is not None
    assert summary["val_loss_final"] < summary["val_loss_initial"]


def _long_and_short_documents(folder: Any) -> None:
    """One document in five of 300 bytes, the others of 18-22: a step whose ranks hold a
    128-token window of a long one and a handful of short ones is worth splitting."""
    import random

    rng = random.Random(0)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta",
        "iota",
        "kappa",
        "lambda",
        "mu",
    ]
    folder.mkdir()
    for i in range(300):
        n = 300 if i % 5 == 0 else rng.randint(18, 22)
        text = " ".join(rng.choice(words) for _ in range(n))[:n]
        (folder / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")


@pytest.mark.timeout(300)
def test_split_and_remapped_documents_train_what_whole_documents_train(
    train_job: Any, tmp_path: Any
) -> None:
    import torch

    data = tmp_path / "docs"
    _long_and_short_documents(data)
    argv = ["--algo", "ddp", "--documents", "--data", str(data), "--cost-model", "analytic",
            *tiny_job_args(block_size=128, batch_size=1, steps=6, eval_every=3, warmup=0,
                           dropout=0.0)]  # fmt: skip
    weights, units = {}, {}
    for balance in ("cost", "cost+split", "remap"):
        out = tmp_path / balance
        train_job(*argv, "--balance", balance, out=out)
        with open(out / "balance.json", encoding="utf-8") as f:
            units[balance] = json.load(f)["units"]
        assert all(u["assignment"] == balance and u["plans_identical"] for u in units[balance])
        assert all(sum(u["tokens"]) == 256 for u in units[balance])
        state = torch.load(out / "checkpoint.pt", weights_only=False)["model"]
        weights[balance] = {k: v.float() for k, v in state.items()}

    def split(balance: str) -> list[dict[str, Any]]:
        return [u for u in units[balance] if any(d[0] > 1 for d in u["splits"])]

    def worst(balance: str) -> float:
        pairs = ((weights[balance][k], weights["cost"][k]) for k in weights["cost"])
        return max((a - b).abs().max().item() for a, b in pairs)

    # the job did split: a document over both ranks, inside the one node
    assert not split("cost") and len(split("cost+split")) >= 2, units["cost+split"]
    assert all(d[1] == "local" for u in split("cost+split") for d in u["splits"] if d[0] > 1)
    assert all(sorted(u["tokens"]) != [128, 128] for u in split("cost+split"))
    # remapped: the linear layers' tokens split equally, whatever the documents
    assert all(sorted(u["tokens"]) == [128, 128] for u in units["remap"])
    assert all(u["plan_method"] == "remap" for u in units["remap"])
    # the same documents, the same summed gradient: ring attention over the split pieces, and
    # the remapped attention, compute what one rank computes for the whole document (Adam
    # moves every weight by about the learning rate, 1e-3, in the first steps: a wrong
    # gradient shows at that size; the remapping sums fp32 in another order, 3e-5 here)
    assert worst("cost+split") < 2e-5
    assert worst("remap") < 1e-4


@pytest.mark.timeout(240)
def test_documents_resume_mid_round_is_exact(tmp_path: Any, monkeypatch: Any) -> None:
    argv = ["--algo", "co2", *DOCS, "--cost-model", "analytic", "--checkpoint-every", "3"]
    ref = str(tmp_path / "ref")
    run_train_job(ref, *argv)
    out = str(tmp_path / "run")
    monkeypatch.setenv(FAULT_ENV, "1:5")
    assert main(["train", *argv, "--out", out]) == 1
    monkeypatch.delenv(FAULT_ENV)
    assert main(["train", *argv, "--out", out, "--resume"]) == 0
    assert_same_run(ref, out, resumed_at=[3])
    assert os.path.exists(os.path.join(out, "balance.json"))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"balance": "tokens"}, "documents mode only"),
        ({"documents": True, "balance": "tokens,split"}, "'split' is not one of"),
        ({"documents": True, "balance": "remap", "algo": "co2"}, "remap balances every step"),
        (
            {"documents": True, "balance": "remap", "algo": "ddp", "nodes": 2, "workers": 4},
            "inside one node only",
        ),
        (
            {"documents": True, "balance": "remap", "algo": "ddp", "dropout": 0.1},
            "remap needs dropout 0",
        ),
        ({"documents": True, "token_cap": 100}, "raise it to 1088"),
        ({"documents": True, "ceiling_steps": 4}, "not documents"),
        ({"documents": True, "balance": "fastest"}, "is not one of"),
        ({"documents": True, "algo": "co2", "nodes": 2, "workers": 4}, "ddp only"),
    ],
)
def test_documents_settings_are_checked(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict(dict(**settings))
