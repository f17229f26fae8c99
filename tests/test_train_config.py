"""TrainConfig: validation messages, TOML loading, outer keyword routing. No processes."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
from typing import Any

import pytest
import torch

from lowcomm.train.config import (
    ALGORITHM_CHOICES,
    OUTER_KEYS,
    ConfigError,
    TrainConfig,
    config_from_dict,
    config_keys,
    field_docs,
)
from lowcomm.train.config_file import load_toml, read_toml


def test_defaults_are_valid_and_json_safe() -> None:
    cfg = TrainConfig()
    assert cfg.algo == "co2" and cfg.workers == 2 and cfg.sync_every == 12
    assert cfg.steps % cfg.sync_every == 0, "default steps should end on a round boundary"
    json.dumps(cfg.to_dict())


def test_every_key_has_a_docstring() -> None:
    docs = field_docs()
    for key in config_keys():
        assert docs.get(key), f"{key} has no docstring"
    for f in dataclasses.fields(TrainConfig):
        assert f.name in config_keys() or f.name in ("outer", "algorithm", "_kwargs"), f.name


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        (
            "algo",
            "adam",
            "must be one of co2, co2-eager, diloco, streaming, cocodc, localsgd, slowmo, noloco, "
            "sparseloco, ddp, demo, none, got 'adam'",
        ),
        ("workers", 0, "must be >= 1, got 0"),
        ("steps", -5, "must be >= 1, got -5"),
        ("sync_every", 0, "must be >= 1, got 0"),
        ("sync_every", 1.5, "must be an integer, got 1.5"),
        ("sync_every", True, "must be an integer, got True"),
        ("batch_size", 0, "must be >= 1"),
        ("block_size", 0, "must be >= 1"),
        ("n_layer", 0, "must be >= 1"),
        ("eval_every", 0, "must be >= 1"),
        ("eval_batches", 0, "must be >= 1"),
        ("log_every", 0, "must be >= 1"),
        ("overwrite", "yes", "must be true or false"),
        ("seed", -1, "must be >= 0"),
        ("warmup", -1, "must be >= 0"),
        ("lr", 0.0, "must be a finite number > 0, got 0.0"),
        ("lr", -3e-4, "must be a finite number > 0"),
        ("lr", float("nan"), "must be a finite number > 0"),
        ("lr", "fast", "must be a number, got 'fast'"),
        ("weight_decay", -0.1, "must be a finite number >= 0"),
        ("dropout", 1.0, "must be < 1"),
        ("bucket_cap_mb", 0, "must be a finite number > 0"),
        ("backend", "mpi", "must be one of auto, gloo, nccl, got 'mpi'"),
        ("lr_schedule", "linear", "must be one of cosine, constant, got 'linear'"),
        ("min_lr_ratio", 1.5, "must be <= 1, got 1.5"),
        # outer keys: the algorithm's own checks (CO2 here), keyed by the keyword
        ("outer_lr", 0.0, "must be a finite number > 0, got 0.0; e.g. outer_lr=1.0"),
        ("outer_momentum", 1.0, "must be in [0, 1), got 1.0"),
        ("outer_momentum", -0.1, "must be in [0, 1), got -0.1"),
        ("nesterov", "yes", "must be True or False, got 'yes'"),
        ("clip", 0.0, "must be a finite number > 0, got 0.0; e.g. clip=1.0; or 'none' to disable"),
        ("clip", -1.0, "must be a finite number > 0"),
        ("clip", "off", "must be a finite number > 0, got 'off'"),
        ("clip_mode", "l1", "must be 'value' or 'norm', got 'l1'"),
        ("gap_penalty", 0.5, "as a constant divisor λ must be a finite number >= 1"),
        ("gap_penalty", "adaptive", "must be 'gap_aware', 'none' or a number >= 1"),
        ("name", "a/b", "must be a plain folder name"),
        ("out", "", "must be a non-empty string"),
        ("checkpoint_every", -1, "must be >= 0, got -1"),
        ("keep_checkpoints", 0, "must be >= 1, got 0"),
        ("max_restarts", -1, "must be >= 0, got -1"),
        ("collective_timeout", 0, "must be a finite number > 0, got 0"),
        ("resume", "", "must be a non-empty string"),
    ],
)
def test_bad_value_names_key_value_and_fix(key: str, value: Any, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(dict(**{key: value}))
    err = info.value
    assert isinstance(err, ValueError)
    assert err.key == key
    assert fragment in err.problem
    assert str(err) == f"{key} {err.problem}"


@pytest.mark.parametrize(
    ("values", "key", "fragment"),
    [
        (
            {"sync_every": 12, "num_fragments": 5},
            "sync_every",
            "(12) must be a multiple of num_fragments=5",
        ),
        ({"num_fragments": 0}, "num_fragments", "must be a positive integer, got 0"),
        ({"num_fragments": 2.0}, "num_fragments", "must be a positive integer, got 2.0"),
        ({"num_fragments": 6, "sync_every": 12}, "num_fragments", "(6) exceeds n_layer (4)"),
        ({"overlap": 12}, "overlap", "(12) must be < sync_every=12"),
        ({"overlap": -1}, "overlap", "must be an integer >= 0, got -1"),
        ({"mix": 1.5}, "mix", "must be in [0, 1], got 1.5"),
        ({"outer_momentum": 0.0}, "nesterov", "(True) needs outer_momentum > 0"),
    ],
)
def test_streaming_keys_are_checked_by_the_algorithm(
    values: dict[str, Any], key: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(dict(algo="streaming", **values))
    assert info.value.key == key
    assert fragment in info.value.problem, info.value.problem
    assert str(info.value) == f"{key} {info.value.problem}"


def test_streaming_and_co2_eager_kwargs() -> None:
    from lowcomm.registry import ALGORITHMS

    cfg = config_from_dict(
        dict(algo="streaming", num_fragments=2, overlap=1, mix=0.25, sync_warmup=0)
    )
    assert cfg.algorithm_class() is ALGORITHMS["streaming"]
    assert cfg.algorithm_kwargs() == {
        "sync_every": 12,
        "bucket_cap_mb": 25.0,
        "num_fragments": 2,
        "overlap": 1,
        "mix": 0.25,
        "sync_warmup": 0,
        "sync_warmup_compression": "int8",
        # the job's tuned outer step, not the paper's 0.7
        "outer_lr": 0.5,
        "outer_momentum": 0.9,
        "nesterov": True,
    }
    # unset: the job's defaults (two fragments overlapped by 2 steps, the warm start)
    assert TrainConfig(algo="streaming").algorithm_kwargs() == {
        "sync_every": 12,
        "bucket_cap_mb": 25.0,
        "num_fragments": 2,
        "overlap": 2,
        "sync_warmup": 240,
        "sync_warmup_compression": "int8",
        "outer_lr": 0.5,
        "outer_momentum": 0.9,
        "nesterov": True,
    }
    eager = config_from_dict(dict(algo="co2-eager", clip="none", mix=0.5, steps=96))
    assert eager.algorithm_class() is ALGORITHMS["co2"]
    assert eager.algorithm_kwargs() == {
        "sync_every": 12,
        "bucket_cap_mb": 25.0,
        "eager": True,
        "outer_momentum": 0.0,
        "clip": None,
        "sync_warmup": 24,
        "sync_warmup_compression": "int8",
    }
    assert eager.ignored_outer_keys() == ["mix"]
    assert config_from_dict(dict(algo="diloco", num_fragments=3)).ignored_outer_keys() == [
        "num_fragments"
    ]
    staggered = config_from_dict(dict(algo="co2", num_fragments=3))  # CO2 staggers fragments too
    assert staggered.ignored_outer_keys() == []
    assert staggered.algorithm_kwargs()["num_fragments"] == 3


def test_inapplicable_outer_keys_are_not_checked() -> None:
    cfg = config_from_dict(
        dict(algo="diloco", clip=-1.0, gap_penalty="adaptive", overlap=-3, mix=7.0)
    )
    assert cfg.ignored_outer_keys() == ["clip", "gap_penalty", "overlap", "mix"]
    assert set(cfg.algorithm_kwargs()) == {
        "sync_every",
        "bucket_cap_mb",
        "sync_warmup",
        "sync_warmup_compression",
        "outer_lr",
        "outer_momentum",
        "nesterov",
    }
    config_from_dict(dict(algo="localsgd", outer_lr=-1.0, num_fragments=0))
    config_from_dict(dict(algo="ddp", outer_momentum=5.0))


@pytest.mark.parametrize(
    ("steps", "sync_every", "expected"),
    [(960, 12, 240), (96, 12, 24), (47, 12, 0), (48, 12, 12), (3840, 12, 960), (1000, 7, 245)],
)
def test_job_warm_start_is_a_quarter_of_the_steps_in_whole_rounds(
    steps: int, sync_every: int, expected: int
) -> None:
    for algo in ("co2", "co2-eager", "diloco", "streaming", "cocodc", "localsgd", "slowmo"):
        cfg = config_from_dict(dict(algo=algo, steps=steps, sync_every=sync_every, num_fragments=1))
        assert cfg.algorithm_kwargs()["sync_warmup"] == expected
        assert cfg.sync_warmup_steps() == expected
    assert config_from_dict(dict(algo="diloco", sync_warmup=24)).sync_warmup_steps() == 24
    assert config_from_dict(dict(algo="diloco", sync_warmup=0)).sync_warmup_steps() == 0
    assert TrainConfig(algo="ddp", steps=steps).sync_warmup_steps() == 0


@pytest.mark.parametrize(
    ("values", "fragments", "overlap"),
    [
        ({}, 2, 2),
        ({"sync_every": 9}, 1, 2),  # H odd: one fragment
        ({"sync_every": 2}, 2, 1),  # the overlap stays below H
        ({"sync_every": 1}, 1, 0),
        ({"n_layer": 1}, 1, 2),  # one block: one fragment
        ({"num_fragments": 4}, 4, 2),  # what the user set wins
        ({"sync_every": 2, "overlap": 0}, 2, 0),
    ],
)
def test_job_defaults_fit_the_job(values: dict[str, Any], fragments: int, overlap: int) -> None:
    for algo in ("streaming", "cocodc"):
        kwargs = config_from_dict(dict(algo=algo, **values)).algorithm_kwargs()
        assert (kwargs["num_fragments"], kwargs["overlap"]) == (fragments, overlap)
    # CO2's default overlap (1 step) fits every H
    assert TrainConfig(algo="co2", sync_every=1).algorithm_kwargs()["overlap"] == 1
    assert "overlap" not in TrainConfig(algo="co2-eager", sync_every=1).algorithm_kwargs()


def test_cocodc_at_full_overlap_takes_the_studys_delay_compensation() -> None:
    full = config_from_dict(dict(algo="cocodc", num_fragments=4, overlap=12)).algorithm_kwargs()
    assert (full["lambda0"], full["adaptive"]) == (0.5, False)
    # below full overlap the library's (the paper's) λ₀ 0.2 and priorities; a given one wins
    below = config_from_dict(dict(algo="cocodc", num_fragments=4, overlap=3)).algorithm_kwargs()
    assert "lambda0" not in below and "adaptive" not in below
    given = config_from_dict(dict(algo="cocodc", overlap=12, lambda0=0.2, adaptive=True))
    assert (given.algorithm_kwargs()["lambda0"], given.algorithm_kwargs()["adaptive"]) == (
        0.2,
        True,
    )
    assert (
        "lambda0"
        not in config_from_dict(dict(algo="cocodc", sync_every=24, overlap=12)).algorithm_kwargs()
    )


def test_slowmo_needs_a_positive_final_learning_rate() -> None:
    with pytest.raises(ConfigError, match="SlowMo divides its update by") as info:
        TrainConfig(algo="slowmo", min_lr_ratio=0.0)
    assert info.value.key == "min_lr_ratio"
    TrainConfig(algo="slowmo", min_lr_ratio=0.0, lr_schedule="constant")
    TrainConfig(algo="diloco", min_lr_ratio=0.0)


def test_head_divisibility_suggests_a_width() -> None:
    with pytest.raises(ConfigError, match=r"n_embd \(130\) must be divisible by n_head \(4\)"):
        TrainConfig(n_embd=130, n_head=4)


def test_missing_data_path(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="does not exist") as info:
        TrainConfig(data=str(tmp_path / "nope.txt"))
    assert info.value.key == "data"
    (tmp_path / "ok.txt").write_text("hello")
    assert TrainConfig(data=str(tmp_path / "ok.txt")).data is not None


def test_clip_none_disables_clipping() -> None:
    cfg = config_from_dict(dict(clip="None"))
    assert cfg.value("clip") == "none"
    assert cfg.algorithm_kwargs()["clip"] is None
    assert config_from_dict(dict(clip=0.5)).algorithm_kwargs()["clip"] == 0.5


def test_algorithm_kwargs_only_what_was_set_and_applies() -> None:
    # co2's job defaults (JOB_OUTER_DEFAULTS, the warm start) are passed; a value set wins
    assert TrainConfig().algorithm_kwargs() == {
        "sync_every": 12,
        "bucket_cap_mb": 25.0,
        "outer_lr": 0.5,
        "outer_momentum": 0.9,
        "nesterov": True,
        "clip": None,
        "gap_penalty": "none",
        "overlap": 1,
        "sync_warmup": 240,
        "sync_warmup_compression": "int8",
    }
    assert config_from_dict(dict(outer_lr=1.0)).algorithm_kwargs()["outer_lr"] == 1.0
    assert (
        config_from_dict(dict(overlap=12)).algorithm_kwargs()["overlap"] == 12
    )  # the paper's schedule
    cfg = config_from_dict(
        dict(algo="diloco", outer_lr=0.7, clip=2.0, gap_penalty="none", nesterov=False, steps=40)
    )
    assert cfg.algorithm_kwargs() == {
        "sync_every": 12,
        "bucket_cap_mb": 25.0,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "nesterov": False,
        "sync_warmup": 0,
        "sync_warmup_compression": "int8",
    }
    assert cfg.ignored_outer_keys() == ["clip", "gap_penalty"]
    assert config_from_dict(dict(algo="ddp", outer_lr=0.5)).algorithm_kwargs() == {}
    assert TrainConfig(algo="localsgd", sync_every=4).algorithm_kwargs() == {
        "sync_every": 4,
        "bucket_cap_mb": 25.0,
        "sync_warmup": 240,
        "sync_warmup_compression": "int8",
    }


def test_outer_keys_table_matches_choices() -> None:
    assert set(OUTER_KEYS) == set(ALGORITHM_CHOICES)


def test_algorithm_resolves_the_applicable_keys(monkeypatch: Any) -> None:
    seen: list[dict[str, Any]] = []

    class Fake:
        @classmethod
        def resolve(cls, **kwargs: Any) -> None:
            seen.append(kwargs)
            if kwargs.get("outer_lr") == 123.0:
                raise ValueError("outer_lr 123 is silly; e.g. outer_lr=0.7")

    monkeypatch.setattr(TrainConfig, "algorithm_class", lambda self: Fake)
    cfg = config_from_dict(dict(algo="slowmo", outer_momentum=0.3, clip=1.0))
    assert seen == [
        {
            "sync_every": 12,
            "bucket_cap_mb": 25.0,
            "outer_momentum": 0.3,
            "sync_warmup": 240,
            "sync_warmup_compression": "int8",
        }
    ]
    cfg.with_paths()  # fills two paths; does not check everything again
    assert len(seen) == 1
    with pytest.raises(ConfigError, match="outer_lr 123 is silly") as info:
        config_from_dict(dict(algo="slowmo", outer_lr=123.0))
    assert (info.value.key, info.value.problem) == ("outer_lr", "123 is silly; e.g. outer_lr=0.7")


def test_algorithm_error_about_no_field_has_no_key(monkeypatch: Any) -> None:
    class Fake:
        @classmethod
        def resolve(cls, **kwargs: Any) -> None:
            raise ValueError("inner_optimizer must be an optimizer")

    monkeypatch.setattr(TrainConfig, "algorithm_class", lambda self: Fake)
    with pytest.raises(ConfigError) as info:
        TrainConfig(algo="diloco")
    assert info.value.key is None
    assert str(info.value) == "inner_optimizer must be an optimizer"


def test_ddp_does_not_consult_the_outer_algorithms(monkeypatch: Any) -> None:
    def refuse(self: TrainConfig) -> None:
        raise AssertionError("ddp asked for an outer algorithm's class")

    monkeypatch.setattr(TrainConfig, "algorithm_class", refuse)
    TrainConfig(algo="ddp")


def test_eval_interval_rounds_up_to_a_round_boundary() -> None:
    assert TrainConfig(eval_every=50, sync_every=12).eval_interval == 60
    assert TrainConfig(eval_every=48, sync_every=12).eval_interval == 48
    assert TrainConfig(eval_every=5, sync_every=12).eval_interval == 12
    assert TrainConfig(algo="ddp", eval_every=50).eval_interval == 50


def test_with_paths_fills_name_and_out() -> None:
    now = datetime.datetime(2026, 1, 2, 3, 4, 5)
    cfg = TrainConfig(algo="diloco").with_paths(now)
    assert cfg.name == "diloco-20260102-030405"
    assert cfg.out == os.path.join("runs", "diloco-20260102-030405")
    cfg = TrainConfig(name="exp1").with_paths(now)
    assert cfg.out == os.path.join("runs", "exp1")
    cfg = TrainConfig(name="exp1", out="/tmp/x").with_paths(now)
    assert (cfg.name, cfg.out) == ("exp1", "/tmp/x")


# --- TOML ------------------------------------------------------------------------------------


def test_toml_fills_config_and_overrides_win(tmp_path: Any) -> None:
    path = tmp_path / "cfg.toml"
    path.write_text(
        'algo = "diloco"\nsteps = 36\nsync_every = 6\nlr = 1\nnesterov = false\nclip = "none"\n'
    )
    cfg = load_toml(str(path))
    assert (cfg.algo, cfg.steps, cfg.sync_every, cfg.value("nesterov"), cfg.value("clip")) == (
        "diloco",
        36,
        6,
        False,
        "none",
    )
    assert cfg.lr == 1
    cfg = load_toml(str(path), overrides={"steps": 12, "algo": "co2"})
    assert (cfg.algo, cfg.steps, cfg.sync_every) == ("co2", 12, 6)


def test_toml_unknown_key_lists_valid_keys(tmp_path: Any) -> None:
    path = tmp_path / "cfg.toml"
    path.write_text("sync_evry = 12\n")
    assert read_toml(str(path)) == {"sync_evry": 12}  # keys are checked in one place
    with pytest.raises(ConfigError) as info:
        load_toml(str(path))
    message = str(info.value)
    assert f"unknown key 'sync_evry' in {path}" in message
    assert "valid keys:" in message and "sync_every" in message and "gap_penalty" in message


def test_toml_malformed(tmp_path: Any) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("steps = = 3\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        read_toml(str(path))


def test_toml_missing_file_and_tables(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="not found"):
        read_toml(str(tmp_path / "missing.toml"))
    path = tmp_path / "nested.toml"
    path.write_text("[model]\nn_layer = 2\n")
    with pytest.raises(ConfigError, match="key 'model' .* must be a single value, got dict"):
        read_toml(str(path))


def test_toml_unreadable_is_one_line(tmp_path: Any, monkeypatch: Any) -> None:
    import lowcomm.train.config_file as config

    with pytest.raises(ConfigError, match="is a folder, not a file") as info:
        read_toml(str(tmp_path))
    assert info.value.key is None

    def denied(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(config, "open", denied, raising=False)
    with pytest.raises(ConfigError) as info:
        read_toml(str(tmp_path / "cfg.toml"))
    assert str(info.value) == f"config file {str(tmp_path / 'cfg.toml')!r} cannot be read: " + (
        "Permission denied"
    )


def test_toml_bad_value_is_a_config_error(tmp_path: Any) -> None:
    path = tmp_path / "cfg.toml"
    path.write_text('steps = "many"\n')
    with pytest.raises(ConfigError, match="must be an integer") as info:
        load_toml(str(path))
    assert info.value.key == "steps"


def test_config_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ConfigError, match="unknown key 'epochs'"):
        config_from_dict({"epochs": 3})


def test_inner_lr_schedule() -> None:
    from lowcomm.train.loop import _lr_at

    cfg = TrainConfig(lr=1e-3, warmup=10, steps=110, min_lr_ratio=0.1)
    assert _lr_at(1, cfg) == pytest.approx(1e-4)
    assert _lr_at(10, cfg) == pytest.approx(1e-3)
    assert _lr_at(60, cfg) == pytest.approx(0.55e-3)  # half-way down the cosine
    assert _lr_at(110, cfg) == pytest.approx(1e-4)
    flat = TrainConfig(lr=1e-3, warmup=0, steps=110, lr_schedule="constant")
    assert {_lr_at(s, flat) for s in (1, 50, 110)} == {1e-3}


def test_evaluate_with_other_values_restores_the_live_parameters() -> None:
    from lowcomm.models.gpt import GPT, GPTConfig
    from lowcomm.train.loop import _evaluate, _evaluate_with

    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16))
    batches = [(torch.randint(0, 16, (2, 8)), torch.randint(0, 16, (2, 8)))]
    params = [p for p in model.parameters() if p.requires_grad]
    anchor = [p.detach() + 0.1 * torch.randn_like(p) for p in params]
    live = [p.detach().clone() for p in params]
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p, a in zip(reference.parameters(), anchor):
            p.copy_(a)
    assert _evaluate_with(model, batches, anchor) == _evaluate(reference, batches)
    assert all(torch.equal(p, q) for p, q in zip(params, live))
    assert _evaluate(model, batches) != _evaluate(reference, batches)


def test_job_warm_start_is_compressed_unless_asked_otherwise() -> None:
    from lowcomm.compress.codecs import parse_compression

    kwargs = TrainConfig(algo="diloco").algorithm_kwargs()
    assert kwargs["sync_warmup_compression"] == "int8"
    off = config_from_dict(dict(algo="diloco", sync_warmup_compression="none")).algorithm_kwargs()
    assert parse_compression(off["sync_warmup_compression"]) is None  # fp32, DDP's exact mean
    with pytest.raises(ConfigError) as info:
        config_from_dict(dict(algo="co2", sync_warmup_compression="int3"))
    assert info.value.key == "sync_warmup_compression"
    assert str(info.value).startswith("sync_warmup_compression is not usable: unknown compression")
