"""The documentation's Architecture page: its worked example is the real definition, and the engine
derives what it says it derives from an algorithm's dataclass."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import lowcomm
from lowcomm.hparams import HyperparameterError
from lowcomm.registry import REGISTRY
from lowcomm.train.config import OUTER_KEYS, TrainConfig, field_docs

ROOT = Path(__file__).resolve().parents[1]


def _architecture_blocks() -> list[str]:
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("## Adding an algorithm", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def test_the_worked_example_is_dilocos_definition() -> None:
    definition, registration = _architecture_blocks()
    assert definition in (ROOT / "src/lowcomm/outer/diloco.py").read_text()
    assert registration.strip() in (ROOT / "src/lowcomm/registry.py").read_text()


@pytest.mark.parametrize("cls", sorted(lowcomm.ALGORITHMS.values(), key=lambda c: c.name))
def test_constructor_flags_and_errors_come_from_the_dataclass(cls: type) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls.Config)}
    signature = inspect.signature(cls)
    keywords = [p for p in signature.parameters if p not in ("model_or_params", "inner_optimizer")]
    assert keywords == [*fields, "process_group", "fault_tolerance"]
    for name, f in fields.items():
        assert f"        {name}" in (cls.__doc__ or ""), name
        if f.default is not dataclasses.MISSING:
            assert signature.parameters[name].default == f.default
    # every job key of every name that runs this class is a TrainConfig field with help text
    docs = field_docs()
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for entry in REGISTRY.values():
        if entry.cls is cls:
            for key in OUTER_KEYS[entry.name]:
                assert key in fields and key in train_fields and docs[key]
    with pytest.raises(HyperparameterError) as info:
        cls.validate(sync_every=0)
    assert info.value.key == "sync_every" and isinstance(info.value, ValueError)
