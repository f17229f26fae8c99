"""MuonAdamW: torch's Muon on the hidden weight matrices and torch's AdamW on the rest, behind one
optimizer, pinned against the two torch optimizers stepped side by side."""

from __future__ import annotations

import io
import os
from typing import Any

import pytest
import torch
from torch import nn

from lowcomm.models.gpt import GPT, GPTConfig
from lowcomm.optim import MuonAdamW, muon_parameters


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.0))


def _backward(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 40, (3, 16), generator=g)
    _, loss = model(idx, idx.roll(-1, dims=1))
    loss.backward()


def _side_by_side(model: GPT, lr: float, wd: float) -> list[torch.optim.Optimizer]:
    muon = muon_parameters(model)
    taken = {id(p) for p in muon}
    rest = [p for p in model.parameters() if id(p) not in taken]
    return [
        torch.optim.Muon(muon, lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(
            [
                {"params": [p for p in rest if p.dim() >= 2], "weight_decay": wd},
                {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=lr,
            betas=(0.9, 0.95),
        ),
    ]


def test_muon_takes_the_blocks_linear_weights_not_the_tied_embedding() -> None:
    model = _gpt()
    names = {id(p): n for n, p in model.named_parameters()}
    chosen = sorted(names[id(p)] for p in muon_parameters(model))
    assert chosen == sorted(
        f"blocks.{b}.{m}.weight"
        for b in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )


def test_a_step_is_muons_then_adamws_and_the_schedule_reaches_both() -> None:
    mine, theirs = _gpt(), _gpt()
    opt = MuonAdamW.for_model(mine, lr=3e-3, weight_decay=0.1)
    pair = _side_by_side(theirs, 3e-3, 0.1)
    for step in range(1, 7):
        lr = 3e-3 * step / 6  # a schedule set through this optimizer's param_groups
        for group in opt.param_groups:
            group["lr"] = lr
        for o in pair:
            for group in o.param_groups:
                group["lr"] = lr
        for model in (mine, theirs):
            _backward(model, step)
        opt.step()
        opt.zero_grad()
        for o in pair:
            o.step()
            o.zero_grad()
        for a, b in zip(mine.parameters(), theirs.parameters()):
            assert torch.equal(a, b), step
    assert all(p.grad is None for p in mine.parameters())
    first = _gpt()
    moved = [not torch.equal(a, b) for a, b in zip(mine.parameters(), first.parameters())]
    assert all(moved)
    assert len(opt.state) == len(list(mine.parameters()))  # both optimizers' state


def test_state_dict_resumes_exactly_and_keeps_the_groups_linked() -> None:
    model = _gpt()
    opt = MuonAdamW.for_model(model, lr=2e-3)
    for step in range(1, 4):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save({"m": model.state_dict(), "o": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = _gpt(5)  # other initial values: everything comes from the checkpoint
    resumed.load_state_dict(saved["m"])
    ropt = MuonAdamW.for_model(resumed, lr=2e-3)
    ropt.load_state_dict(saved["o"])
    for o in (opt, ropt):
        for group in o.param_groups:
            group["lr"] = 1e-3  # after loading, the schedule still reaches both optimizers
    for step in range(4, 7):
        for m, o in ((model, opt), (resumed, ropt)):
            _backward(m, step)
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert all(g["lr"] == 1e-3 for o in ropt._optimizers() for g in o.param_groups)


def test_step_hooks_fire_as_on_any_torch_optimizer() -> None:
    model = _gpt()
    opt = MuonAdamW.for_model(model, lr=2e-3)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    _backward(model, 1)
    opt.step()
    assert calls == ["pre", "post"]


def test_bad_input_names_the_problem() -> None:
    model = _gpt()
    with pytest.raises(ValueError, match=r"2-D weight matrices, got a parameter of shape \(16,\)"):
        MuonAdamW([{"params": [model.ln_f.weight]}], [], lr=1e-3)
    with pytest.raises(ValueError, match="no parameters for Muon"):
        MuonAdamW([{"params": []}], [{"params": list(model.parameters())}], lr=1e-3)
    opt = MuonAdamW.for_model(model, lr=1e-3)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="not a MuonAdamW state_dict"):
        opt.load_state_dict(adamw.state_dict())


@pytest.mark.timeout(300)
def test_job_with_muon_at_full_overlap_is_killed_and_resumes_bit_identical(
    tmp_path: Any, monkeypatch: Any, capsys: Any
) -> None:
    """``lowcomm train --optimizer muon`` with CoCoDC's fragments each in flight a whole round
    (τ = H): a worker killed after the fragments launched resumes from its last checkpoint and
    ends bit-identical to the run that was not killed (model, Muon's and AdamW's state, the
    anchors, snapshots and in-flight results)."""
    from lowcomm.cli import main
    from lowcomm.testing.jobs import TINY_JOB_ARGS, run_train_job
    from lowcomm.testing.runs import assert_same_run
    from lowcomm.train.loop import FAULT_ENV

    flags = [
        "--algo", "cocodc", *TINY_JOB_ARGS, "--num-fragments", "2", "--optimizer", "muon",
        "--overlap", "4", "--lambda0", "0", "--checkpoint-every", "3",
    ]  # fmt: skip
    ref = str(tmp_path / "reference")
    summary = run_train_job(ref, *flags)
    assert summary["val_loss_final"] < summary["val_loss_initial"]
    saved = torch.load(os.path.join(ref, "checkpoint.pt"), weights_only=True)
    assert set(saved["optimizer"]) == {"muon", "adamw"}
    out = str(tmp_path / "run")
    argv = ["train", *flags, "--out", out]
    monkeypatch.setenv(FAULT_ENV, "1:8")
    assert main(argv) == 1
    monkeypatch.delenv(FAULT_ENV)
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    assert_same_run(ref, out, resumed_at=[6])


def test_job_refuses_muon_where_it_cannot_run() -> None:
    from lowcomm.train.config import ConfigError, config_from_dict

    cases = [
        ({"optimizer": "sgd"}, "must be one of adamw, muon, got 'sgd'"),
        ({"optimizer": "muon", "algo": "demo"}, "DeMo is the optimizer"),
        (
            {"optimizer": "muon", "algo": "co2", "nodes": 2, "procs_per_node": 2,
             "workers": 4, "node_sharding": "zero"},
            "node_sharding zero",
        ),
    ]  # fmt: skip
    for values, match in cases:
        with pytest.raises(ConfigError, match=match):
            config_from_dict(values, source="test")
