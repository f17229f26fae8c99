"""Property-based checks of bad input: whatever a user passes to an algorithm's constructor or as
a ``lowcomm train`` setting, the answer is either success or a ``ValueError`` that names the
setting — never another exception type, never a silent acceptance of a value the contract
rejects."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lowcomm
from lowcomm.testing import make_inner, toy_model
from lowcomm.train.config import OUTER_KEYS, ConfigError, config_from_dict, config_keys, key_type

# Values of every kind a config file or a typo can produce.
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**6), max_value=10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(), max_size=3),
)

FIELDS = config_keys()


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(FIELDS), value=ANY_VALUE)
def test_any_config_value_is_accepted_or_named(key: str, value: Any) -> None:
    # outer keys are checked only for an algorithm they apply to (elsewhere: ignored, warned)
    algo = next((a for a, keys in OUTER_KEYS.items() if key in keys), "co2")
    values = {key: value} if key == "algo" else {"algo": algo, key: value}
    try:
        cfg = config_from_dict(values, source="test")
    except ConfigError as e:
        # the message is about this key (or, for cross-field checks, names it)
        assert e.key == key or key in str(e), (key, value, str(e))
        assert "\n" not in str(e)
        return
    # accepted: the value is what the field holds, with the type its annotation promises
    held = cfg.value(key)
    annotation = key_type(key)
    if held is None:
        assert "None" in annotation, (key, annotation)
    elif annotation.startswith("int"):
        assert isinstance(held, int) and not isinstance(held, bool)
    elif annotation.startswith("bool"):
        assert isinstance(held, bool)
    elif annotation.startswith("float"):
        assert isinstance(held, (int, float)) and math.isfinite(held)


@settings(max_examples=60, deadline=None)
@given(
    key=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=14),
    value=ANY_VALUE,
)
def test_unknown_config_keys_are_refused(key: str, value: Any) -> None:
    if key in FIELDS:
        return
    with pytest.raises(ConfigError) as info:
        config_from_dict({key: value}, source="test.toml")
    assert key in str(info.value)


NUMBERS = st.one_of(
    st.integers(min_value=-5, max_value=40),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
)
CONSTRUCTORS: dict[str, dict[str, Any]] = {
    "CO2": {
        "sync_every": NUMBERS,
        "outer_lr": NUMBERS,
        "outer_momentum": NUMBERS,
        "clip": st.one_of(NUMBERS, st.none()),
        "gap_penalty": st.one_of(NUMBERS, st.sampled_from(["gap_aware", "none", "other"])),
        "clip_mode": st.sampled_from(["value", "norm", "max"]),
    },
    "DiLoCo": {"sync_every": NUMBERS, "outer_lr": NUMBERS, "outer_momentum": NUMBERS},
    "LocalSGD": {"sync_every": NUMBERS},
    "StreamingDiLoCo": {
        "sync_every": NUMBERS,
        "num_fragments": NUMBERS,
        "overlap": NUMBERS,
        "mix": NUMBERS,
    },
    "CoCoDC": {
        "sync_every": NUMBERS,
        "num_fragments": NUMBERS,
        "overlap": NUMBERS,
        "lambda0": NUMBERS,
        "max_wait": NUMBERS,
    },
}


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("name", sorted(CONSTRUCTORS))
def test_constructor_arguments_are_accepted_or_named(name: str) -> None:
    cls = getattr(lowcomm, name)
    strategies = CONSTRUCTORS[name]

    @settings(
        max_examples=80,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(kwargs=st.fixed_dictionaries({}, optional=strategies))
    def check(kwargs: dict[str, Any]) -> None:
        kwargs.setdefault("sync_every", 4)
        torch.manual_seed(0)
        model = toy_model()
        inner = make_inner("sgd", model.parameters())
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                algo = cls(model, inner, **kwargs)
        except ValueError as e:
            message = str(e)
            assert any(k in message for k in kwargs), (kwargs, message)
            return
        # accepted: the model still trains and syncs without error
        for _ in range(int(kwargs["sync_every"])):
            algo.step()
        algo.finish()
        assert all(torch.isfinite(p).all() for p in model.parameters())

    check()
