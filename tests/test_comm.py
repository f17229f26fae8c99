from __future__ import annotations

import pytest
import torch

from lowcomm.comm import CommStats, Communicator, FlatBuckets, ring_wire_bytes
from lowcomm.testing import run_workers


def test_ring_wire_bytes() -> None:
    assert ring_wire_bytes(1000, 1) == 0
    assert ring_wire_bytes(1000, 2) == 1000
    assert ring_wire_bytes(1000, 4) == 1500


def test_buckets_respect_cap_and_alias_views() -> None:
    shapes = [torch.Size([10]), torch.Size([3, 4]), torch.Size([40]), torch.Size([2])]
    # cap of 25 floats: [10, 12] | [40] (alone, larger than the cap) | [2]
    b = FlatBuckets(shapes, bucket_cap_mb=25 * 4 / 2**20)
    assert [buf.numel() for buf in b.buffers] == [22, 40, 2]
    assert [v.shape for v in b.views] == shapes
    b.views[1].fill_(3.0)
    assert b.buffers[0][10:22].eq(3.0).all() and b.buffers[0][:10].eq(0).all()
    assert b.numel == 64 and b.nbytes == 256


def test_buckets_copy_round_trip_casts_to_fp32() -> None:
    params = [torch.randn(5, 3).bfloat16(), torch.randn(7).bfloat16()]
    b = FlatBuckets.for_tensors(params)
    b.copy_from(params)
    assert all(v.dtype == torch.float32 for v in b.views)
    out = [torch.zeros_like(p) for p in params]
    b.copy_to(out)
    assert all(torch.equal(o, p) for o, p in zip(out, params))
    assert b.like().buffers[0].abs().sum() == 0


def test_bucket_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        FlatBuckets([torch.Size([3])], bucket_cap_mb=0)


def test_hidden_fraction() -> None:
    s = CommStats()
    assert s.hidden_fraction is None
    s.in_flight_s, s.blocked_s = 2.0, 0.5
    assert s.hidden_fraction == pytest.approx(0.75)
    assert s.as_dict()["hidden_fraction"] == pytest.approx(0.75)


def test_communicator_needs_an_initialised_group() -> None:
    with pytest.raises(ValueError, match="init_process_group"):
        Communicator()


def _mean_worker(rank: int, world_size: int) -> dict:
    comm = Communicator()
    bufs = [torch.full((5,), float(rank + 1)), torch.arange(3, dtype=torch.float32) * rank]
    handle = comm.all_reduce_mean_async(bufs)
    out = handle.wait()
    again = handle.wait()  # idempotent: no second division
    return {"out": [t.clone() for t in out], "same": again is out, "stats": comm.stats.as_dict()}


@pytest.mark.timeout(120)
def test_mean_all_reduce_on_real_gloo_ranks() -> None:
    results = run_workers(_mean_worker, 4)
    for r in results:
        assert torch.equal(r["out"][0], torch.full((5,), 2.5))
        assert torch.equal(r["out"][1], torch.arange(3, dtype=torch.float32) * 1.5)
        assert r["same"]
        s = r["stats"]
        assert s["collectives"] == 2 and s["payload_bytes"] == 32
        assert s["wire_bytes"] == ring_wire_bytes(32, 4)
        assert s["in_flight_s"] > 0 and s["blocked_s"] > 0  # timed from launch / in wait()
