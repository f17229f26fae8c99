"""The trainer integrations with the real libraries: a real Hugging Face ``Trainer`` and a real
``lightning.Trainer`` on 2 gloo processes (one pair of processes runs every scenario:
lowcomm.testing.trainers), the loggers, and torchtitan's configuration keys."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from lowcomm.comm import CommStats
from lowcomm.loggers import EveryStep, MetricsLogger
from lowcomm.procs.workers import run_workers
from lowcomm.registry import outer_names
from lowcomm.torchtitan import from_torchtitan, resolve_aliases
from lowcomm.train.config_file import load_toml
from lowcomm.train.errors import ConfigError

pytest.importorskip("transformers")
pytest.importorskip("lightning")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> tuple[dict[str, Any], dict[str, Any], str]:
    from lowcomm.testing.trainers import trainer_scenarios

    out = str(tmp_path_factory.mktemp("trainers"))
    r0, r1 = run_workers(trainer_scenarios, 2, out, timeout_s=280)
    return r0, r1, out


@pytest.fixture
def hf(runs: Any) -> tuple[dict[str, Any], dict[str, Any], str]:
    r0, r1, out = runs
    return r0["hf"], r1["hf"], out


@pytest.fixture
def lightning(runs: Any) -> tuple[dict[str, Any], dict[str, Any], str]:
    r0, r1, out = runs
    return r0["lightning"], r1["lightning"], out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_replicas_differ_inside_a_round_and_agree_after_each_sync(
    trainer: str, request: Any
) -> None:
    from lowcomm.testing.trainers import HF_STEPS, HF_SYNC_EVERY

    r0, r1, _ = request.getfixturevalue(trainer)
    digests = list(zip(r0["co2"]["digests"], r1["co2"]["digests"]))
    assert len(digests) == HF_STEPS
    for step, (a, b) in enumerate(digests, start=1):
        assert (a == b) == (step % HF_SYNC_EVERY == 0), step
    assert _same(r0["co2"]["params"], r1["co2"]["params"])
    # DDP's gradient all-reduce was off; the algorithm took every global step
    assert r0["co2"]["ddp_grad_sync"] is False
    assert r0["co2"]["local_step"] == r1["co2"]["local_step"] == HF_STEPS
    assert r0["co2"]["sync_points"] == r1["co2"]["sync_points"] > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_trainer_equals_lowcomms_own_loop_bitwise(trainer: str, request: Any) -> None:
    r0, r1, _ = request.getfixturevalue(trainer)
    assert _same(r0["co2"]["params"], r0["own_loop"])
    assert _same(r1["co2"]["params"], r1["own_loop"])


@pytest.mark.timeout(300)
def test_resume_from_a_trainer_checkpoint_inside_a_round_is_exact(hf: Any) -> None:
    r0, r1, out = hf
    # saving changes nothing, and saves every 4 steps with sync_every=3 are warned about
    assert _same(r0["saving"]["params"], r0["co2"]["params"])
    assert any("not a multiple of sync_every=3" in w for w in r0["saving"]["warnings"])
    # every rank wrote its own state into the Trainer's checkpoint
    for rank in (0, 1):
        assert os.path.isfile(
            os.path.join(out, "saving", "checkpoint-4", "lowcomm", f"rank{rank}.pt")
        )
    # resumed at step 4 (a CO2 sync in flight, ranks apart): the same steps after, bit for bit
    for r in (r0, r1):
        assert _same(r["resumed"]["params"], r["co2"]["params"])
        assert r["resumed"]["digests"] == r["co2"]["digests"][4:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_a_planted_pickle_in_a_trainer_checkpoint_is_refused_without_running(
    trainer: str, request: Any
) -> None:
    # each rank's lowcomm state of a real checkpoint replaced by a pickle that calls os.mkdir
    for r in request.getfixturevalue(trainer)[:2]:
        planted = r["planted"]
        assert planted["code_ran"] is False
        assert planted["error"] is not None
        assert "holds Python objects other than tensors" in planted["error"]
        assert "posix.mkdir" in planted["error"]
        assert "weights_only" not in planted["error"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_a_gradscaler_skip_on_one_rank_does_not_desynchronise(trainer: str, request: Any) -> None:
    r0, r1, _ = request.getfixturevalue(trainer)
    # rank 1's scaler skipped one optimizer step (and halved its scale); the algorithm still
    # took every global step on both ranks, and they end with one model
    assert r0["skip"]["inner_steps"] == 12 and r1["skip"]["inner_steps"] == 11
    assert r1["skip"]["scale"] == r0["skip"]["scale"] / 2
    assert r0["skip"]["local_step"] == r1["skip"]["local_step"] == 12
    assert _same(r0["skip"]["params"], r1["skip"]["params"])
    assert all(torch.isfinite(p).all() for p in r0["skip"]["params"].values())


@pytest.mark.timeout(300)
def test_lightning_resumes_exactly_from_checkpoints_inside_rounds(lightning: Any) -> None:
    r0, r1, out = lightning
    assert _same(r0["saving"]["params"], r0["co2"]["params"])
    assert any("not a multiple of sync_every=3" in w for w in r0["saving"]["warnings"])
    # each checkpoint file has every rank's state beside it
    files = r0["saving"]["files"]
    for name in ("epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"):
        assert name in files and f"{name}.lowcomm" in files
        for rank in (0, 1):
            assert os.path.isfile(
                os.path.join(out, "lightning-ckpt", f"{name}.lowcomm", f"rank{rank}.pt")
            )
    for r in (r0, r1):
        assert _same(r["resumed"]["params"], r["co2"]["params"])
        # the digests of steps 4 (at the first batch, before any step), 5, …, 12
        assert r["resumed"]["digests"] == r["co2"]["digests"][3:]


@pytest.mark.timeout(300)
def test_lightning_logs_lowcomms_metrics(lightning: Any) -> None:
    r0, _, _ = lightning
    logged = r0["co2"]["logged"]
    assert logged["lowcomm/inner_step"] == 12.0 and logged["lowcomm/outer_step"] > 0
    for key in ("pseudo_grad_norm", "bytes_sent", "bytes_received", "blocked_s", "hidden_fraction"):
        assert f"lowcomm/{key}" in logged, key


@pytest.mark.timeout(300)
def test_every_algorithm_compression_and_sharding_in_the_trainer(hf: Any) -> None:
    r0, r1, _ = hf
    expected = {*outer_names(), "co2+compression", "diloco+shard_outer_state", "demo"}
    assert set(r0["algorithms"]) == expected
    for name, run in r0["algorithms"].items():
        other = r1["algorithms"][name]
        assert run["digest"] == other["digest"], f"{name}: ranks disagree after finish()"
        assert run["outer_step"] > 0 and run["bytes_sent"] > 0, name
    algos = r0["algorithms"]
    assert algos["co2+compression"]["bytes_sent"] < algos["co2"]["bytes_sent"] / 3  # int8


@pytest.mark.timeout(300)
def test_metrics_are_merged_into_the_trainer_logs_and_tensorboard(hf: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r0, _, out = hf
    logged = [h for h in r0["co2"]["log_history"] if "loss" in h]
    assert len(logged) == 4  # logging_steps = 3 over 12 steps
    for h in logged:
        for key in ("outer_step", "inner_step", "bytes_sent", "bytes_received", "blocked_s"):
            assert f"lowcomm/{key}" in h, key
        assert h["lowcomm/inner_step"] == h["step"]
    outer = [h["lowcomm/outer_step"] for h in logged]
    assert outer == sorted(outer) and outer[-1] > 0
    events = EventAccumulator(os.path.join(out, "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in ("loss", "pseudo_grad_norm", "bytes_sent", "bytes_received", "hidden_fraction"):
        assert f"lowcomm/{name}" in tags, name
    steps = [e.step for e in events.Scalars("lowcomm/bytes_sent")]
    assert steps == sorted(set(steps)) and steps[-1] == r0["co2"]["sync_points"]
    losses = [e.value for e in events.Scalars("lowcomm/loss")]
    assert all(3.0 < v < 5.0 for v in losses)  # ln 64 = 4.16: this rank's step losses


def test_attach_refuses_what_it_cannot_run(tmp_path: Any) -> None:
    from transformers import Trainer

    from lowcomm.integrations.hf import attach
    from lowcomm.testing.trainers import Sequences, tiny_llama, trainer_args

    args = trainer_args(str(tmp_path), ddp_backend=None)  # one process: built, not trained
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Sequences())
    with pytest.raises(ValueError, match="runs DDP itself"):
        attach(trainer, "ddp")
    with pytest.raises(ValueError, match="unknown algorithm 'co3'"):
        attach(trainer, "co3", sync_every=4)
    with pytest.raises(ValueError, match="sync_every"):
        attach(trainer, "co2", sync_every=0)
    with pytest.raises(ValueError, match="twice"):
        attach(trainer, "streaming", sync_every=4, sync_steps=6)
    with pytest.raises(ValueError, match="lowcomm.DeMo optimizer"):
        attach(trainer, "demo", sync_every=4)
    attach(trainer, "diloco", sync_steps=4)  # torchtitan's name for sync_every
    assert trainer.args.average_tokens_across_devices is False
    with pytest.raises(ValueError, match="already attached"):
        attach(trainer, "co2", sync_every=4)


# --- loggers ---------------------------------------------------------------------------------


def test_metrics_logger_writes_once_per_outer_step(tmp_path: Any) -> None:
    stats = CommStats()
    source = EveryStep(stats)
    path = str(tmp_path / "m.jsonl")
    log = MetricsLogger(source, jsonl=path, every=2)
    for step in range(1, 6):
        stats.wire_bytes += 100
        source.step()
        wrote = log.step(torch.tensor(float(step)))
        assert wrote == (step % 2 == 0)
    log.eval(1.5)
    log.close()
    with open(path) as f:
        records = [json.loads(line) for line in f]
    assert [r["outer_step"] for r in records] == [2, 4, 5]  # the evaluation: at the current one
    assert records[0]["loss"] == 1.5 and records[1]["loss"] == 3.5  # means since the last write
    assert records[1]["bytes_sent"] == records[1]["bytes_received"] == 400
    assert records[2] == {"outer_step": 5, "val_loss": 1.5}
    with pytest.raises(ValueError, match="somewhere to write"):
        MetricsLogger(source)


# --- torchtitan's keys -----------------------------------------------------------------------

TORCHTITAN = """
[job]
dump_folder = "./outputs"
[training]
steps = 100
[fault_tolerance]
enable = true
semi_sync_method = "diloco"
sync_steps = 12
num_fragments = 2
fragment_sync_delay = 1
fragment_update_alpha = 0.25
group_size = 2
"""


def test_a_torchtitan_file_is_understood(tmp_path: Any, caplog: Any) -> None:
    path = tmp_path / "titan.toml"
    path.write_text(TORCHTITAN)
    cfg = load_toml(str(path), overrides={"steps": 48})
    assert (
        cfg.algo,
        cfg.sync_every,
        cfg.value("num_fragments"),
        cfg.value("overlap"),
        cfg.value("mix"),
    ) == (
        "streaming",
        12,
        2,
        1,
        0.25,
    )
    ignored = caplog.text
    for name in ("fault_tolerance.enable", "fault_tolerance.group_size", "[job]", "[training]"):
        assert name in ignored
    # one fragment, no delay, no mix: torchft's DiLoCo is DiLoCo
    values, _ = from_torchtitan({"semi_sync_method": "diloco", "sync_steps": 50})
    assert values == {"algo": "diloco", "sync_every": 50}
    assert from_torchtitan({"semi_sync_method": "local_sgd"})[0] == {"algo": "localsgd"}
    # flat keys too, and a key set twice is refused
    assert resolve_aliases({"sync_steps": 6, "outer_lr": 0.5}) == {"sync_every": 6, "outer_lr": 0.5}
    flat = tmp_path / "flat.toml"
    flat.write_text('algo = "co2"\nsync_steps = 6\nsync_every = 8\n')
    with pytest.raises(ConfigError, match="twice"):
        load_toml(str(flat))
    clash = tmp_path / "clash.toml"
    clash.write_text("sync_every = 8\n[fault_tolerance]\nsync_steps = 6\n")
    with pytest.raises(ConfigError, match="keep one"):
        load_toml(str(clash))
    bad = tmp_path / "bad.toml"
    bad.write_text('[fault_tolerance]\nsemi_sync_method = "hsdp"\n')
    with pytest.raises(ConfigError, match="no lowcomm counterpart"):
        load_toml(str(bad))
