"""The emulated link: its completion-time model on a controllable clock, parsing, real ranks."""

from __future__ import annotations

import pytest
import torch

from lowcomm.comm import ring_wire_bytes
from lowcomm.link import PROFILES, EmulatedLink, LinkedWork, LinkModel
from lowcomm.testing import run_workers


def test_model_serialises_transfers_first_in_first_out() -> None:
    m = LinkModel(bandwidth_bps=100e6, latency_s=0.02)  # 12.5 MB/s
    mb = 1_250_000  # 0.1 s on the wire
    assert m.schedule(0.0, mb) == pytest.approx(0.12)
    # launched while the first is on the wire: starts when the link is free, at 0.1
    assert m.schedule(0.05, mb) == pytest.approx(0.22)
    # latency is propagation: it does not keep the link busy
    assert m.free_at == pytest.approx(0.2)
    # an idle link starts at once
    assert m.schedule(1.0, mb) == pytest.approx(1.12)
    assert m.schedule(1.0, 0) == pytest.approx(1.12)  # queued behind, then latency only


def test_a_linked_work_completes_when_the_link_could_have_carried_it() -> None:
    """The thread-free wrapper of the elastic syncs' collectives (torchft's works are waited
    on the caller's thread): it waits for the real work, then sleeps what is left."""

    class Real:
        waited = 0

        def wait(self, *args: object) -> bool:
            self.waited += 1
            return True

        def is_completed(self) -> bool:
            return True

    now = [10.0]
    slept: list[float] = []
    real = Real()
    work = LinkedWork(real, 10.25, clock=lambda: now[0], sleep=slept.append)
    assert not work.is_completed()  # the real one is done, the link not yet
    assert work.wait() and real.waited == 1 and slept == [pytest.approx(0.25)]
    now[0] = 10.3
    assert work.is_completed() and work.wait() and slept == [pytest.approx(0.25)]


def test_parse_profiles_and_rate_latency() -> None:
    for name, (bw, lat) in PROFILES.items():
        link = EmulatedLink.parse(name)
        assert (link.bandwidth_bps, link.latency_s, link.name) == (bw, lat, name)
    link = EmulatedLink.parse("100mbit:20ms")
    assert link.bandwidth_bps == 100e6 and link.latency_s == pytest.approx(0.02)
    assert EmulatedLink.parse("2.5gbit:500us").latency_s == pytest.approx(5e-4)
    assert "emulated" in repr(link)


@pytest.mark.parametrize("spec", ["fast", "100gbit", "100mbit:20", "0mbit:1ms", "10mb:1ms"])
def test_parse_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError, match="profile|bandwidth"):
        EmulatedLink.parse(spec)


def _link_worker(rank: int, world_size: int) -> dict:
    # A controllable clock that stands still at t = 100; the link's sleeps are recorded as the
    # times it would wake up, so nothing depends on wall time or thread timing.
    woke: list[float] = []
    link = EmulatedLink(8e6, 0.5)  # 1 MB/s, 0.5 s latency
    comm = link.communicator(clock=lambda: 100.0, sleep=lambda dt: woke.append(100.0 + dt))
    a = torch.full((250_000,), float(rank + 1))  # 1 MB payload
    h1 = comm.all_reduce_mean_async([a])
    b = torch.full((250_000,), float(2 * rank))
    h2 = comm.all_reduce_mean_async([b])
    h1.wait()
    h2.wait()
    return {"woke": woke, "a": a[:3].clone(), "b": b[:3].clone()}


@pytest.mark.timeout(120)
def test_collectives_complete_when_the_link_could_have_carried_them() -> None:
    wire = ring_wire_bytes(1_000_000, 2)  # 1 MB per rank with 2 ranks
    for r in run_workers(_link_worker, 2):
        assert torch.equal(r["a"], torch.full((3,), 1.5))
        assert torch.equal(r["b"], torch.full((3,), 1.0))
        # launched at t=100 back to back: 1 s on the wire each, FIFO, plus latency
        assert r["woke"] == pytest.approx([100.0 + wire / 1e6 + 0.5, 100.0 + 2 * wire / 1e6 + 0.5])
