"""The DDP parity benchmark (:mod:`lowcomm.bench.ddp_parity`): its result's structure, and that
``lowcomm train --algo ddp``'s hook leaves DDP's numerics alone (2 gloo ranks, a tiny GPT)."""

from __future__ import annotations

import pytest

from lowcomm.bench.ddp_parity import measure_ddp_parity, parity_table

TINY = {"n_layer": 1, "n_embd": 32, "n_head": 2, "batch_size": 4, "block_size": 16}


@pytest.mark.timeout(120)
def test_parity_result_and_same_parameters() -> None:
    r = measure_ddp_parity(steps=6, warmup=2, workers=2, train_overrides=TINY, timeout_s=90)
    assert r["workers"] == 2 and r["pairs"] == 6 and not r["stopped_early"]
    assert len(r["torch_steps_s"]) == len(r["lowcomm_steps_s"]) == 6
    assert r["torch_step_s"] > 0 and r["lowcomm_step_s"] > 0
    assert r["ratio"] == pytest.approx(r["lowcomm_step_s"] / r["torch_step_s"])
    for summary in (r["pair_ratio"], r["cpu_pair_ratio"]):
        lo, hi = summary["ci95"]
        assert 0 < lo <= summary["median"] <= hi
        assert summary["q1"] <= summary["median"] <= summary["q3"]
    assert r["model"]["n_layer"] == 1 and r["model"]["parameters"] > 0
    # the meter counted every step's all-reduces, warm-up included (one bucket: a tiny model)
    stats = r["lowcomm_stats"]
    assert r["collectives_per_step"] == 1
    assert stats["collectives"] == 2 + 6
    assert stats["payload_bytes"] == stats["collectives"] * 4 * r["model"]["parameters"]
    assert stats["in_flight_s"] > 0
    # The meter divides each bucket by N and sums; torch's hook multiplies by 1/N and sums:
    # the same float operation for N = 2, so the two DDP copies end bit for bit equal.
    assert r["params_equal"]
    assert r["max_abs_diff"] == 0.0
    assert "| median step |" in parity_table(r)


def test_rejects_a_link_or_compression() -> None:
    with pytest.raises(ValueError, match="link"):
        measure_ddp_parity(steps=1, train_overrides={"link": "1gbit"})
    with pytest.raises(ValueError, match="compression"):
        measure_ddp_parity(steps=1, train_overrides={"compression": "int8"})
    with pytest.raises(ValueError, match="workers"):
        measure_ddp_parity(steps=1, workers=1)
