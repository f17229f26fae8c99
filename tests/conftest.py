from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lowcomm.testing.jobs import TrainJob, run_train_job

SERIAL_MODULES = frozenset(
    {
        "test_chaos.py",
        "test_elastic.py",
        "test_examples.py",
        "test_failures.py",
        "test_interrupts.py",
        "test_reliability_script.py",
        "test_supervise.py",
    }
)
"""The modules whose tests run alone (marked ``serial``): their replicas heartbeat within a
second, their processes are killed and timed at chosen moments, or they are the heaviest (the
trainer examples: two torchrun jobs each, 2.6x slower beside another test, which made the suite
longer, not shorter). ``make test`` runs every other test two at a time (``pytest -n 2 -m "not
serial"``, one module to a process, so module fixtures are shared as they are in one process),
then these one after the other (``pytest -m serial``); plain ``pytest`` runs them all one after
the other."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="module")
def single_rank_group() -> Iterator[None]:
    """A real one-rank gloo WORLD group in the test process (127.0.0.1, ephemeral port)."""
    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def train_job(tmp_path: Any) -> TrainJob:
    """Run a small ``lowcomm train`` job in the test process and return its summary dict:
    ``train_job("--algo", "co2", *TINY_JOB_ARGS, out=folder)``
    (:func:`lowcomm.testing.jobs.run_train_job`); without ``out``, in a fresh folder under the
    test's ``tmp_path``. A job that does not exit with 0 fails the test."""
    numbers = itertools.count()

    def run(*argv: str, out: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        return run_train_job(tmp_path / f"job-{next(numbers)}" if out is None else out, *argv)

    return run


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
