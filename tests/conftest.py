from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist


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


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
