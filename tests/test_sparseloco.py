"""SparseLoCo: its codec's wire format and aggregation, and the algorithm on real gloo ranks bit
for bit against the reference written from the paper's equations, a resume mid-run included."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch

import lowcomm
from lowcomm.compress.codecs import parse_compression
from lowcomm.compress.flat import FlatLayout
from lowcomm.compress.formats import pack_bits
from lowcomm.compress.sparse import Sparse, chunk_side, pack_rows, quantise_rows, unpack_rows
from lowcomm.hparams import HyperparameterError
from lowcomm.testing import run_workers
from lowcomm.testing.reference import reference_run
from lowcomm.testing.references.sparseloco import SparseLoCoReference
from lowcomm.testing.toy import inner_step, make_inner, toy_model, trainable_params

# -- the codec ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "tile", "k"),
    [
        ((128, 192), (64, 64), 64),  # a matrix: 64 × 64 tiles, 64 of 4096 kept
        ((97, 64), (1, 64), 1),  # a prime number of rows: tiles of one row
        ((100,), (1, 50), 1),  # a vector: chunks of the largest divisor <= 64
        ((3, 5, 7), (3, 35), 2),  # more dimensions: rows × the rest
        ((), (1, 1), 1),
    ],
)
def test_tiles_are_the_largest_divisors_and_k_scales_with_them(
    shape: tuple[int, ...], tile: tuple[int, int], k: int
) -> None:
    t = Sparse().tiling(torch.Size(shape))
    assert (t.h, t.w, t.k) == (*tile, k)
    assert chunk_side(4096, 64) == 64 and chunk_side(6, 4) == 3 and chunk_side(7, 4) == 1


def test_the_payload_is_the_counted_bytes_and_146_times_smaller_than_fp32() -> None:
    codec = Sparse()
    for shape in [(64, 4096), (97, 64), (100,), (3, 5, 7), (128, 192)]:
        payload = codec.encode(torch.randn(shape))
        assert payload.numel() == codec.encoded_nbytes(shape) == codec.wire_nbytes(shape)
    # 64 of every 4096 elements: a 12-bit index and a 2-bit code each, 20 bytes of codebook
    assert codec.encoded_nbytes((64, 4096)) == 20 + 4096 * 12 // 8 + 4096 * 2 // 8
    assert 4 * 64 * 4096 / codec.encoded_nbytes((64, 4096)) > 145
    assert not codec.compresses(())  # 22 bytes for one value: sent as fp32


def test_bit_streams_round_trip_and_match_pack_bits() -> None:
    g = torch.Generator().manual_seed(0)
    for bits in (2, 5, 12, 13):
        v = torch.randint(0, 2**bits, (3, 37), generator=g)
        packed = pack_rows(v, bits)
        assert packed.shape == (3, math.ceil(37 * bits / 8))
        assert torch.equal(unpack_rows(packed, bits, 37), v)
    codes = torch.randint(0, 4, (1, 37), generator=g)
    assert torch.equal(pack_rows(codes, 2)[0], pack_bits(codes[0].to(torch.uint8), 2))


def test_each_tile_keeps_its_largest_magnitudes() -> None:
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(1))
    codec = Sparse(density=0.25, chunk=4)  # 4 × 4 tiles, 4 kept of each
    got = codec.decode(codec.encode(x), x.shape) != 0
    for y in range(2):
        for c in range(3):
            tile = x[4 * y : 4 * y + 4, 4 * c : 4 * c + 4].reshape(-1)
            want = torch.zeros(16, dtype=torch.bool)
            want[tile.abs().topk(4).indices] = True
            assert torch.equal(got[4 * y : 4 * y + 4, 4 * c : 4 * c + 4].reshape(-1), want)


def test_values_decode_to_the_mean_of_their_bin_plus_the_shift() -> None:
    v = torch.tensor([[-3.0, -1.0, -0.5, 0.0, 0.25, 0.5, 2.0, 5.0]])
    codes, shift, book = quantise_rows(v, 2)
    mu = v.double().mean()
    c = v[0].double() - mu
    step = 6 * c.std() / 4  # 1.5 standard deviations a step, 4 codes around the shift
    want = (c / step + 2).round().clamp(0, 3)
    assert torch.equal(codes[0].long(), want.long())
    assert shift.item() == pytest.approx(mu.item())
    for b in range(4):
        inside = c[want == b]
        expected = inside.mean().item() if inside.numel() else 0.0
        assert book[0, b].item() == pytest.approx(expected, abs=1e-6)


def test_the_mean_is_over_the_ranks_that_sent_each_element() -> None:
    codec = Sparse(density=0.25, chunk=4, bits=32)  # fp32 values: the aggregation alone
    shape = torch.Size([4, 4])
    a = torch.zeros(16)
    a[[0, 1, 2, 3]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    b = torch.zeros(16)
    b[[0, 1, 8, 9]] = torch.tensor([2.0, -1.0, 6.0, 5.0])
    layout = FlatLayout([codec], [shape], "cpu")
    payloads = [layout.encode(t, generator=None)[0] for t in (a, b)]
    out = torch.empty(16)
    layout.decode_mean(torch.cat(payloads), 2, out=out)
    want = torch.zeros(16)
    want[[0, 1, 2, 3, 8, 9]] = torch.tensor([3.0, 1.0, 2.0, 1.0, 6.0, 5.0])
    assert torch.equal(out, want)  # not (a + b) / 2: an element one rank kept keeps its value
    # γ = 1.5: where both sent, their sum over 2^1.5; where one did, its value as it is
    powered = FlatLayout([Sparse(density=0.25, chunk=4, bits=32, power=1.5)], [shape], "cpu")
    powered.decode_mean(torch.cat(payloads), 2, out=out)
    want[[0, 1]] = torch.tensor([6.0, 2.0]) / 2**1.5
    assert torch.equal(out, want)


def test_specs_parse_and_bad_ones_name_the_fix() -> None:
    assert parse_compression("sparse") == Sparse()
    assert parse_compression("sparse:0.03:chunk=32:bits=4") == Sparse(0.03, 32, 4)
    assert Sparse(0.03, 32, 4).spec == "sparse:0.03:chunk=32:bits=4"
    assert parse_compression("sparse:chunk=16:power=1.5") == Sparse(chunk=16, power=1.5)
    assert Sparse(chunk=16, power=1.5).spec == "sparse:0.015625:chunk=16:power=1.5"
    for bad, fix in [
        ("sparse:0", "density must be in (0, 1]"),
        ("sparse:bits=3", "bits must be 2, 4 or 32"),
        ("sparse:chunk=0", "chunk must be an integer >= 1"),
        ("sparse:rank=2", "unknown option(s) rank"),
        ("sparse:power=-1", "power must be a finite number >= 0"),
    ]:
        with pytest.raises(ValueError, match=None) as info:
            parse_compression(bad)
        assert fix in str(info.value)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("overlap", 13, "must be <= sync_every=12"),
        ("bits", 3, "must be"),
        ("density", 0.0, "must be in (0, 1]"),
        ("error_decay", 1.5, "must be in [0, 1]"),
        ("sender_power", -0.5, "must be a number >= 0"),
    ],
)
def test_bad_settings_name_the_key(key: str, value: Any, fragment: str) -> None:
    with pytest.raises(HyperparameterError) as info:
        lowcomm.SparseLoCo.validate(sync_every=12, **{key: value})
    assert info.value.key == key and fragment in str(info.value)


def test_the_ends_of_the_accumulators_range_are_allowed() -> None:
    # β = 1: plain error feedback, nothing unsent decays; β = 0: nothing carried over
    for beta in (0.0, 1.0, 1):
        lowcomm.SparseLoCo.validate(sync_every=12, error_decay=beta)
    # density 1 keeps every element (a dense sync through the same path), as (0, 1] says
    for density in (1.0, 1):
        lowcomm.SparseLoCo.validate(sync_every=12, density=density)
    with pytest.raises(HyperparameterError, match=r"must be in \(0, 1\]"):
        lowcomm.SparseLoCo.validate(sync_every=12, density=1.5)


# -- the algorithm on real ranks, against the reference --------------------------------------

H, STEPS, CUT = 3, 13, 7
SETTINGS: dict[str, dict[str, Any]] = {
    "blocking": {"chunk": 4, "density": 0.25},
    "overlap-full": {"chunk": 4, "density": 0.3, "bits": 4, "overlap": H, "error_decay": 0.8},
    "merge-full": {"chunk": 4, "density": 0.25, "overlap": H, "merge": "delay_corrected"},
    "power": {"chunk": 4, "density": 0.25, "sender_power": 1.5},
    # a sync every step for the first 9 (the resume at step 7 inside them), then every H
    "early": {"chunk": 4, "density": 0.25, "early_every": 1, "early_steps": 9},
    # rounds of 2 for the first 8 steps, then of 4, each sync launched a step before its point
    # and merged: the save at step 7 holds the sync launched there, in flight
    "early-overlap": {
        "sync_every": 4,
        "chunk": 4,
        "density": 0.25,
        "early_every": 2,
        "early_steps": 8,
        "overlap": 1,
        "merge": "delay_corrected",
    },
}


def _split(settings: str) -> tuple[int, dict[str, Any]]:
    """H and the other keywords of ``SETTINGS[settings]``."""
    hyper = dict(SETTINGS[settings])
    return int(hyper.pop("sync_every", H)), hyper


def _scenario(settings: str) -> dict[str, Any]:
    h, hyper = _split(settings)
    return {
        "algo": "sparseloco",
        "workers": 2,
        "sync_every": h,
        "steps": STEPS,
        "inner": "adamw",
        "seed": 2,
        "bucket_cap_mb": 0.0002,
        "hyper": hyper,
    }


def _resumed_worker(rank: int, world_size: int, settings: str) -> dict[str, Any]:
    """The real SparseLoCo on this rank; its state saved after step ``CUT``, loaded into new
    objects, and the run continued: every round's parameters and the final ones."""

    h, hyper = _split(settings)

    def build(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
        inner = make_inner("adamw", model.parameters())
        algo = lowcomm.SparseLoCo(model, inner, sync_every=h, bucket_cap_mb=0.0002, **hyper)
        return inner, algo

    model = toy_model(2)
    inner, algo = build(model)
    rounds = []
    for step in range(1, STEPS + 1):
        inner_step(model, inner, rank, step, 2)
        algo.step()
        if step % h == 0:
            rounds.append([p.detach().clone() for p in trainable_params(model)])
        if step == CUT:
            buf = io.BytesIO()
            torch.save(
                {"m": model.state_dict(), "i": inner.state_dict(), "a": algo.state_dict()}, buf
            )
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            residual_norm = sum(float(c.residuals[0].norm()) for c in algo.compressors())
            model = toy_model(2)
            inner, algo = build(model)
            model.load_state_dict(saved["m"])
            inner.load_state_dict(saved["i"])
            algo.load_state_dict(saved["a"])
    algo.finish()
    final = [p.detach().clone() for p in trainable_params(model)]
    return {"rounds": rounds, "final": final, "residual_norm": residual_norm}


@pytest.fixture(scope="module")
def resumed() -> dict[str, list[dict[str, Any]]]:
    return {s: run_workers(_resumed_worker, 2, s, timeout_s=120) for s in SETTINGS}


def _matches(results: list[dict[str, Any]], ref: Any) -> bool:
    for rank, res in enumerate(results):
        got = res["rounds"] + [res["final"]]
        want = [t[rank] for t in ref.rounds] + [ref.final[rank]]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if not all(torch.equal(a, b) for a, b in zip(g, w)):
                return False
    return True


@pytest.mark.timeout(240)
@pytest.mark.parametrize("settings", list(SETTINGS))
def test_resumed_ranks_match_the_reference_bit_for_bit(resumed: dict, settings: str) -> None:
    results = resumed[settings]
    assert all(r["residual_norm"] > 0 for r in results)  # the accumulator was carried over
    assert _matches(results, reference_run(_scenario(settings)))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "wrong",
    [
        {"error_decay": 0.9},
        {"density": 0.2},
        {"outer_lr": 0.9},
        {"sender_power": 1.5},
        "sum",
        "mean-over-all",
    ],
)
def test_a_wrong_decay_density_lr_or_aggregation_does_not_match(
    resumed: dict, wrong: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    scenario = _scenario("blocking")
    if isinstance(wrong, dict):
        scenario["hyper"].update(wrong)
    else:
        monkeypatch.setattr(SparseLoCoReference, "aggregation", wrong)
    assert not _matches(resumed["blocking"], reference_run(scenario))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "settings, wrong",
    [
        ("early", {"early_steps": 6}),
        ("early", {"early_every": 3}),
        ("early", {"early_steps": 0}),
        ("early-overlap", {"overlap": 0}),
        ("early-overlap", {"early_steps": 0}),
        ("early-overlap", {"merge": "reset"}),
    ],
)
def test_a_wrong_early_schedule_does_not_match(
    resumed: dict, settings: str, wrong: dict[str, Any]
) -> None:
    scenario = _scenario(settings)
    scenario["hyper"].update(wrong)
    assert not _matches(resumed[settings], reference_run(scenario))


def test_early_rounds_are_whole_rounds_of_divisors_with_less_in_flight() -> None:
    lowcomm.SparseLoCo.validate(sync_every=12, early_every=4, early_steps=120)
    lowcomm.SparseLoCo.validate(sync_every=12, early_every=5, overlap=12)  # (W = 0: unused)
    lowcomm.SparseLoCo.validate(sync_every=12, early_every=4, early_steps=120, overlap=3)
    for bad, key, fragment in [
        ({"early_steps": 100}, "early_steps", "multiple of sync_every=12"),
        ({"early_steps": 120, "early_every": 5}, "early_every", "one of 1, 2, 3, 4, 6"),
        ({"early_steps": 120, "overlap": 12}, "overlap", "set overlap to at most 3"),
        ({"early_steps": 120, "early_every": 6, "overlap": 6}, "overlap", "at most 5"),
        ({"early_steps": 120, "local_steps": "dynamic"}, "early_steps", "local_steps='fixed'"),
        ({"early_every": 0}, "early_every", "must be a positive integer"),
    ]:
        with pytest.raises(HyperparameterError) as info:
            lowcomm.SparseLoCo.validate(sync_every=12, **bad)
        assert info.value.key == key and fragment in str(info.value)


@pytest.mark.usefixtures("single_rank_group")
def test_a_state_saved_with_other_early_rounds_is_refused() -> None:
    model = toy_model(2)

    def algo(**kw: int) -> Any:
        inner = make_inner("adamw", model.parameters())
        return lowcomm.SparseLoCo(model, inner, sync_every=H, check_consistency=False, **kw)

    saved = algo(early_every=1, early_steps=6).state_dict()
    with pytest.raises(ValueError, match=r"early_rounds=\[1, 6\].*early_rounds=None"):
        algo().load_state_dict(saved)
    with pytest.raises(ValueError, match=r"early_rounds=None.*early_rounds=\[1, 3\]"):
        algo(early_every=1, early_steps=3).load_state_dict(algo().state_dict())


# -- pricing -----------------------------------------------------------------------------


def test_the_cost_model_prices_the_codecs_bytes_by_all_gather() -> None:
    from lowcomm.schedules import sparse_bytes_per_element
    from lowcomm.tune.cost import Algorithm, Network, Workload, step_time

    shape = (4096, 4096)
    codec = Sparse()
    per = sparse_bytes_per_element(codec.density, codec.chunk, codec.bits)
    assert per * math.prod(shape) == codec.encoded_nbytes(shape) - codec.header_nbytes()
    work = Workload(parameters=1e6, tokens_per_step=1024, step_time_s=0.1)
    net = Network(bandwidth_bps=1e6, latency_s=0.1, cost="emulated")
    sent = 1e6 * per
    gather = net.allgather_time(sent, 4)
    blocking = step_time(Algorithm(name="sparseloco", sync_every=12), work, net, 4)
    assert blocking.step_s == pytest.approx(0.1 + gather / 12)
    hidden = step_time(Algorithm(name="sparseloco", sync_every=12, overlap=12), work, net, 4)
    assert gather < 12 * 0.1 and hidden.step_s == pytest.approx(0.1)  # behind a round
    with pytest.raises(ValueError, match="overlap"):
        Algorithm(name="sparseloco", sync_every=12, overlap=13)


# -- the job -------------------------------------------------------------------------------


def test_the_job_runs_sparseloco_without_a_warm_start_and_names_its_codec(
    train_job: Any, capsys: Any
) -> None:
    from lowcomm.testing.jobs import tiny_job_args

    tiny = tiny_job_args(steps=6, sync_every=3, eval_every=3, eval_batches=2, n_layer=1)
    sparse = train_job("--algo", "sparseloco", *tiny)
    fp32 = train_job("--algo", "diloco", "--sync-warmup", "0", *tiny)
    assert sparse["compression"] == "sparse:0.015625:chunk=8"
    assert sparse["sync_warmup"] is None and "compression       sparse" in capsys.readouterr().out
    # two syncs: indices, codes and codebooks only (the 1-D tensors of the tiny GPT, which
    # gain nothing below fp32, and the codebooks keep it from the 146× of large matrices)
    assert sparse["comm_mean"]["payload_bytes"] < fp32["comm_mean"]["payload_bytes"] / 20
    assert sparse["val_loss_final"] < sparse["val_loss_initial"]


def test_the_jobs_sparseloco_syncs_more_often_in_its_first_three_eighths(
    train_job: Any, capsys: Any
) -> None:
    from lowcomm.testing.jobs import tiny_job_args

    tiny = tiny_job_args(steps=48, sync_every=6, eval_every=24, eval_batches=2, n_layer=1)
    early = train_job("--algo", "sparseloco", *tiny)
    # the first three eighths (18 steps: 3 rounds) sync every 3 (H₀ = 3: the largest divisor
    # of 6 below it): 6 syncs there and 5 in the 30 steps after
    assert early["early_rounds"] == {"steps": 18, "sync_every": 3}
    assert early["comm_mean"]["collectives"] == 6 + 5 and early["comm_mean"]["rounds"] == 8
    assert "every 6 steps; every 3 for the first 18" in capsys.readouterr().out
    plain = train_job("--algo", "sparseloco", "--early-steps", "0", *tiny)
    assert plain["early_rounds"] is None and plain["comm_mean"]["collectives"] == 8
    # a user's overlap below H₀ keeps them (each sync launched τ steps before its point); one
    # of H₀ or more keeps the rounds as they are (one sync in flight at a time)
    short = train_job("--algo", "sparseloco", "--overlap", "2", *tiny)
    assert short["early_rounds"] == {"steps": 18, "sync_every": 3}
    assert short["comm_mean"]["collectives"] == 6 + 5 and short["overlap"] == 2
    assert "every 3 for the first 18; 2 steps in flight" in capsys.readouterr().out
    overlapped = train_job("--algo", "sparseloco", "--overlap", "3", *tiny)
    assert overlapped["early_rounds"] is None
