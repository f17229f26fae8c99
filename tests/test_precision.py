"""``lowcomm train --precision bf16``: autocast for the forward and backward, fp32 everywhere the
optimizers and the outer algorithms keep state."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lowcomm.testing.jobs import TINY_JOB_ARGS
from lowcomm.train.config import ConfigError, TrainConfig, config_from_dict


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


@pytest.mark.timeout(240)
def test_bf16_trains_in_bf16_and_keeps_fp32_state(train_job: Any, tmp_path: Any) -> None:
    runs = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        runs[precision] = train_job(
            "--algo", "co2", *TINY_JOB_ARGS, "--precision", precision, out=out
        )
        state = torch.load(out / "checkpoint.pt", weights_only=False)
        floats = [t for t in _tensors(state["model"]) if t.is_floating_point()]
        floats += [t for t in _tensors(state["algorithm"]) if t.is_floating_point()]
        floats += [t for t in _tensors(state["optimizer"]) if t.is_floating_point()]
        # weights, AdamW's moments, the anchor, the outer momentum, the pending delta: fp32
        assert floats and {t.dtype for t in floats} == {torch.float32}
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert bf16["val_loss_final"] < bf16["val_loss_initial"]  # it learns
    # autocast did run (bfloat16 rounding changes the trajectory) and it learns about as well
    assert bf16["val_loss_final"] != fp32["val_loss_final"]
    assert bf16["val_loss_final"] == pytest.approx(fp32["val_loss_final"], rel=0.05)


def _train_recording_dtypes(rank: int, world: int, values: dict[str, Any]) -> list[str]:
    """Run the job's own loop in this worker with a hook on every module's forward: the dtypes
    the linear layers computed in during the training's forwards."""
    from lowcomm.train.loop import train

    seen: set[str] = set()

    def record(module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        # the training's forwards (evaluations run without gradients, in fp32)
        training = torch.is_grad_enabled()
        if training and isinstance(module, torch.nn.Linear) and isinstance(output, torch.Tensor):
            seen.add(str(output.dtype))

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        train(config_from_dict(dict(**values)).with_paths(), device=torch.device("cpu"))
    finally:
        handle.remove()
    return sorted(seen)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("precision", "dtypes"), [("bf16", ["torch.bfloat16"]), ("fp32", ["torch.float32"])]
)
def test_the_loop_computes_in_the_precision_asked_for(
    precision: str, dtypes: list[str], tmp_path: Any
) -> None:
    from lowcomm.procs.workers import run_workers
    from lowcomm.testing.jobs import TINY_JOB

    values = {**TINY_JOB, "workers": 2, "algo": "co2", "precision": precision}
    values.update(steps=4, out=str(tmp_path / precision), tune_link="off")
    results = run_workers(_train_recording_dtypes, 2, values, timeout_s=90)
    assert results == [dtypes, dtypes]


def test_precision_is_checked() -> None:
    with pytest.raises(ConfigError, match="precision"):
        TrainConfig(precision="fp16")
