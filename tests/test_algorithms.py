"""Algorithm classes on a real one-rank gloo group: arguments, hook form, finish, state."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

import lowcomm
from lowcomm.testing import inner_step, make_inner, toy_model

pytestmark = pytest.mark.usefixtures("single_rank_group")

ALL = [lowcomm.CO2, lowcomm.DiLoCo, lowcomm.LocalSGD, lowcomm.SlowMo]


def _build(cls: type, **kw: Any) -> tuple:
    model = toy_model(2)
    inner = make_inner("adamw", model.parameters())
    kw.setdefault("sync_every", 3)
    return model, inner, cls(model, inner, **kw)


@pytest.mark.parametrize(
    "cls,kwargs,match",
    [
        (lowcomm.CO2, {"sync_every": 0}, "sync_every must be a positive integer, got 0"),
        (lowcomm.DiLoCo, {"sync_every": 2.5}, "sync_every"),
        (lowcomm.LocalSGD, {"sync_every": True}, "sync_every"),
        (lowcomm.CO2, {"outer_lr": -0.1}, "outer_lr must be a finite number > 0, got -0.1"),
        (lowcomm.DiLoCo, {"outer_lr": float("nan")}, "outer_lr"),
        (lowcomm.CO2, {"clip": 0.0}, "clip must be a finite number > 0"),
        (lowcomm.CO2, {"clip": -1.0}, "clip"),
        (lowcomm.CO2, {"clip_mode": "l2"}, "clip_mode must be 'value' or 'norm'"),
        (lowcomm.CO2, {"gap_penalty": 0.5}, "gap_penalty"),
        (lowcomm.CO2, {"gap_penalty": "stale"}, "gap_penalty"),
        (lowcomm.CO2, {"outer_momentum": 1.0}, r"outer_momentum must be in \[0, 1\)"),
        (lowcomm.DiLoCo, {"outer_momentum": 0.0}, "nesterov=True needs outer_momentum > 0"),
        (lowcomm.DiLoCo, {"outer_optimizer": "sgd"}, "outer_optimizer must be a callable"),
        (lowcomm.SlowMo, {"outer_momentum": -0.5}, "outer_momentum"),
        (lowcomm.CO2, {"bucket_cap_mb": 0}, "bucket_cap_mb"),
        (lowcomm.CO2, {"eager": 1}, "eager must be True or False"),
        (lowcomm.StreamingDiLoCo, {"sync_every": 6, "num_fragments": 4}, "multiple of"),
        (lowcomm.CO2, {"sync_every": 6, "num_fragments": 4}, "e.g. sync_every=8"),
        (lowcomm.CO2, {"eager": True, "num_fragments": 2}, "combined with num_fragments > 1"),
        (lowcomm.StreamingDiLoCo, {"overlap": 4}, "overlap=4 must be < sync_every=4"),
        (lowcomm.StreamingDiLoCo, {"overlap": 4}, "cocodc takes overlap=sync_every"),
        (lowcomm.CoCoDC, {"overlap": 5}, r"overlap=5 must be <= sync_every=4 \(tau = sync_"),
        (lowcomm.StreamingDiLoCo, {"overlap": -1}, "overlap must be an integer >= 0"),
        (lowcomm.StreamingDiLoCo, {"mix": 1.5}, r"mix must be in \[0, 1\]"),
        (lowcomm.CoCoDC, {"lambda0": -0.1}, "lambda0 must be a finite number >= 0"),
        (lowcomm.CoCoDC, {"max_wait": 0}, "max_wait must be a positive integer"),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(cls: type, kwargs: dict, match: str) -> None:
    kwargs = {"sync_every": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        _build(cls, **kwargs)
    with pytest.raises(ValueError, match=match):
        cls.validate(**kwargs)


def test_bad_model_and_optimizer() -> None:
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="torch.optim.Optimizer"):
        lowcomm.CO2(model, "adam", sync_every=2)  # type: ignore[arg-type]
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        lowcomm.CO2(model, inner, sync_every=2)
    with pytest.raises(ValueError, match="single tensor"):
        lowcomm.CO2(torch.zeros(3, requires_grad=True), inner, sync_every=2)


@pytest.mark.parametrize("cls", ALL)
def test_context_manager_form_equals_explicit_steps(cls: type) -> None:
    model, inner, algo = _build(cls)
    for step in range(1, 10):
        inner_step(model, inner, 0, step, 2)
        algo.step()
    algo.finish()
    explicit = [p.detach().clone() for p in model.parameters()]

    model, inner, algo = _build(cls)
    with algo:
        for step in range(1, 10):
            inner_step(model, inner, 0, step, 2)  # no algo.step(): the hook calls it
    assert algo.local_step == 9 and algo.rounds == 3
    assert not inner._optimizer_step_post_hooks  # hook removed on exit
    assert all(torch.equal(a, b) for a, b in zip(explicit, model.parameters()))


def test_co2_finish_applies_the_last_round_and_is_idempotent() -> None:
    model, inner, algo = _build(lowcomm.CO2)
    for step in range(1, 7):
        inner_step(model, inner, 0, step, 2)
        algo.step()
    assert algo.in_flight and algo.outer_updates == 1
    algo.finish()
    assert not algo.in_flight and algo.outer_updates == 2
    after = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(p, a) for p, a in zip(after, algo.anchor.views))
    algo.finish()
    assert algo.outer_updates == 2
    assert all(torch.equal(a, b) for a, b in zip(after, model.parameters()))


def test_finish_warns_about_a_partial_round() -> None:
    model, inner, algo = _build(lowcomm.DiLoCo)
    for step in range(1, 5):
        inner_step(model, inner, 0, step, 2)
        algo.step()
    with pytest.warns(UserWarning, match="discards 1 inner step"):
        algo.finish()
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), algo.anchor.views))


def test_localsgd_finish_keeps_a_partial_round() -> None:
    model, inner, algo = _build(lowcomm.LocalSGD)
    for step in range(1, 5):
        inner_step(model, inner, 0, step, 2)
        algo.step()
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        algo.finish()
    assert algo.stats.collectives > 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_one_rank_co2_is_stale_by_exactly_one_round() -> None:
    """With one worker Δ̄ = A − θ: after round 1 θ returns to A₀; after round 2 θ = A₀ − α·m."""
    model, inner, algo = _build(lowcomm.CO2, gap_penalty="none", clip=None, outer_momentum=0.0)
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(1, 4):
        inner_step(model, inner, 0, step, 2)
        local_round1 = [p.detach().clone() for p in model.parameters()]  # θ at the round's end
        algo.step()
    assert all(torch.equal(a, b) for a, b in zip(start, model.parameters()))
    for step in range(4, 7):
        inner_step(model, inner, 0, step, 2)
        algo.step()
    for p, want in zip(model.parameters(), local_round1):
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)


def test_finish_warns_once_and_localsgd_finish_twice_communicates_once() -> None:
    model, inner, algo = _build(lowcomm.CO2)
    for step in range(1, 5):
        inner_step(model, inner, 0, step, 2)
        algo.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        algo.finish()
        algo.finish()
    assert len(caught) == 1
    model, inner, algo = _build(lowcomm.LocalSGD)
    for step in range(1, 5):
        inner_step(model, inner, 0, step, 2)
        algo.step()
    algo.finish()
    done = algo.stats.collectives
    algo.finish()
    assert algo.stats.collectives == done


def test_exception_inside_the_context_removes_the_hook_without_finishing() -> None:
    model, inner, algo = _build(lowcomm.CO2)
    with pytest.raises(RuntimeError, match="boom"), algo:
        for step in range(1, 7):
            inner_step(model, inner, 0, step, 2)
        raise RuntimeError("boom")
    assert not inner._optimizer_step_post_hooks
    assert algo.in_flight  # finish() was not called: other ranks may be gone


@pytest.mark.parametrize(
    "cls", [lowcomm.DiLoCo, lowcomm.SlowMo, lowcomm.CO2, lowcomm.StreamingDiLoCo, lowcomm.CoCoDC]
)
def test_state_dict_is_a_snapshot(cls: type) -> None:
    model, inner, algo = _build(cls)
    for step in range(1, 7):
        inner_step(model, inner, 0, step, 2)
        algo.step()
    saved = algo.state_dict()
    frozen = copy.deepcopy(saved)
    for step in range(7, 13):
        inner_step(model, inner, 0, step, 2)
        algo.step()

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    assert same(saved, frozen)


def test_state_dict_refuses_other_configurations() -> None:
    _, _, co2 = _build(lowcomm.CO2)
    _, _, diloco = _build(lowcomm.DiLoCo)
    with pytest.raises(ValueError, match="algorithm='co2' but this DiLoCo has algorithm='diloco'"):
        diloco.load_state_dict(co2.state_dict())
    _, _, co2_h4 = _build(lowcomm.CO2, sync_every=4)
    with pytest.raises(ValueError, match="sync_every=3"):
        co2_h4.load_state_dict(co2.state_dict())
    other = torch.nn.Linear(6, 2)
    algo = lowcomm.CO2(other, torch.optim.SGD(other.parameters(), lr=0.1), sync_every=3)
    with pytest.raises(ValueError, match="trainable parameters|shape"):
        algo.load_state_dict(co2.state_dict())


def test_state_dict_is_weights_only_loadable(tmp_path: Any) -> None:
    model, inner, algo = _build(lowcomm.CO2)
    for step in range(1, 7):
        inner_step(model, inner, 0, step, 2)
        algo.step()
    torch.save(algo.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    assert state["algorithm"] == "co2" and state["pending_avg_delta"] is not None


def test_automatic_fragments_stride_blocks_and_balance_the_rest() -> None:
    from lowcomm.models.gpt import GPT, GPTConfig
    from lowcomm.outer.streaming import split_by_blocks

    gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16))
    groups = split_by_blocks(gpt, 2)
    ids = [{id(p) for p in g} for g in groups]
    for j, block in enumerate(gpt.blocks):
        assert all(id(p) in ids[j % 2] for p in block.parameters())
    assert sorted(id(p) for g in groups for p in g) == sorted(id(p) for p in gpt.parameters())
    sizes = [sum(p.numel() for p in g) for g in groups]
    assert abs(sizes[0] - sizes[1]) <= max(p.numel() for p in gpt.parameters())
    inner = torch.optim.SGD(gpt.parameters(), lr=0.1)
    algo = lowcomm.StreamingDiLoCo(gpt, inner, sync_every=4, num_fragments=2)
    assert [len(f.params) for f in algo.fragments] == [len(g) for g in groups]
    with pytest.raises(ValueError, match="at least num_fragments=8 transformer blocks"):
        split_by_blocks(gpt, 8)


def test_fragments_must_cover_every_parameter_once() -> None:
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    ps = list(model.parameters())
    with pytest.raises(ValueError, match="in no fragment"):
        lowcomm.StreamingDiLoCo(model, inner, sync_every=4, fragments=[ps[:2], ps[2:3]])
    with pytest.raises(ValueError, match="two fragments"):
        lowcomm.StreamingDiLoCo(model, inner, sync_every=4, fragments=[ps[:3], ps[2:]])
    with pytest.raises(ValueError, match="need the model as an nn.Module"):
        lowcomm.StreamingDiLoCo(ps, inner, sync_every=4, num_fragments=2)
