"""The background part of a heal (lowcomm.elastic.transport): what a donor serves after its
quorum and the joiner fetches while both go on syncing, over real loopback sockets."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from lowcomm.elastic.transport import BACKGROUND_KEY, Background, PendingState, TensorTransport
from lowcomm.link import LinkModel

pytest.importorskip("torchft")


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"anchor": [torch.randn(300, 200)], "inner": {"step": 3, "m": torch.randn(1000)}}


def _serve(donor: TensorTransport, state: Any, joiners: int = 1) -> dict[str, Any]:
    """What the donor puts in its quorum's message in place of ``state`` (served from now)."""
    header, nbytes = donor._serve_background(
        {"lowcomm": {"background": Background(state)}}, joiners, timedelta(seconds=20)
    )
    where: dict[str, Any] = header["lowcomm"]["background"]
    assert where[BACKGROUND_KEY] and where["bytes"] == nbytes > 0
    return header


def _fetch(joiner: TensorTransport, header: dict[str, Any]) -> PendingState:
    pending: list[PendingState] = []
    state = joiner._fetch_background(header, time.monotonic(), pending)
    assert state["lowcomm"]["background"] is pending[0]
    return pending[0]


def test_the_joiner_fetches_the_donors_snapshot_bit_for_bit() -> None:
    donor, joiner = (
        TensorTransport(None, timedelta(seconds=20)),
        TensorTransport(None, timedelta(seconds=20)),
    )
    state = _state()
    header = _serve(donor, state)
    # the donor's state changes right after its quorum: what is served is the quorum's instant
    state["anchor"][0].add_(1.0)
    got = _fetch(joiner, header).result()
    torch.manual_seed(0)
    assert torch.equal(got["anchor"][0], torch.randn(300, 200))
    assert got["inner"]["step"] == 3 and got["inner"]["m"].shape == (1000,)
    assert joiner.received_bytes == header["lowcomm"]["background"]["bytes"]
    assert len(joiner.transfer_s) == 1
    donor.wait_served()  # served its one joiner: returns at once


def test_over_an_emulated_link_the_transfer_takes_what_the_link_takes_on_both_ends() -> None:
    bandwidth = 20e6  # 240 KB at 20 Mbit/s: about 0.1 s on each end, pipelined chunk by chunk
    donor_link, joiner_link = LinkModel(bandwidth, 0.0), LinkModel(bandwidth, 0.0)
    donor = TensorTransport(None, timedelta(seconds=20), donor_link)
    joiner = TensorTransport(None, timedelta(seconds=20), joiner_link)
    header = _serve(donor, _state())
    nbytes = header["lowcomm"]["background"]["bytes"]
    t0 = time.monotonic()
    _fetch(joiner, header).result()
    took = time.monotonic() - t0
    assert took >= 8 * nbytes / bandwidth
    # both links are busy with it, each for its bytes: a sync booked now on either queues after
    assert donor_link.free_at >= t0 + 8 * nbytes / bandwidth - 0.05
    assert joiner_link.free_at >= t0 + 8 * nbytes / bandwidth - 0.05


def test_a_joiner_without_the_token_gets_nothing() -> None:
    donor, joiner = (
        TensorTransport(None, timedelta(seconds=20)),
        TensorTransport(None, timedelta(seconds=2)),
    )
    header = _serve(donor, _state())
    header["lowcomm"]["background"][BACKGROUND_KEY] = "0" * 32  # not the donor's
    pending = _fetch(joiner, header)
    with pytest.raises(RuntimeError, match="did not arrive"):
        pending.result()
    assert joiner.received_bytes == 0 and not joiner.transfer_s


def test_a_donor_that_is_gone_leaves_the_joiner_an_error_that_says_so() -> None:
    donor, joiner = (
        TensorTransport(None, timedelta(seconds=20)),
        TensorTransport(None, timedelta(seconds=2)),
    )
    header = _serve(donor, _state())
    assert donor._serving is not None
    donor._serving.sock.close()  # (the donor's process is gone: nothing accepts)
    donor._serving.thread.join(5)
    with pytest.raises(RuntimeError, match="did not arrive"):
        _fetch(joiner, header).result()
