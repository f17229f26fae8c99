"""lowcomm's DiLoCo against torchft's, bit for bit, on real gloo process groups.

The design promises that DiLoCo with one fragment, no overlap and mix 0 equals torchft's
``torchft.local_sgd.DiLoCo`` bit for bit on the same inputs. Each rank runs the same toy problem
twice from the same initial weights and batches: once under torchft's DiLoCo (one fragment,
``fragment_sync_delay=0``, ``fragment_update_alpha=0.0``), once under ``lowcomm.DiLoCo`` with its
defaults; both use Nesterov SGD (lr 0.7, momentum 0.9) as the outer optimizer.

torchft needs a ``Manager``, which normally talks to a lighthouse and owns a reconfigurable
process group. As in torchft's own unit tests (``local_sgd_test.py``) the manager is a
``create_autospec(Manager)``; here its ``allreduce`` runs torchft's real ``Manager.allreduce``
body on the WORLD gloo group (SUM all-reduce, then ``tensor /= num_participants`` in a future
callback), so the arithmetic compared is torchft's own, not a re-implementation.

Skipped when torchft is not installed (it is in the `dev` extra, not a runtime dependency).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any
from unittest.mock import create_autospec

import pytest
import torch

pytest.importorskip("torchft")

from lowcomm.testing import run_workers, toy_model  # noqa: E402

SYNC_EVERY = 3
STEPS = 12  # a multiple of SYNC_EVERY: no partial round for either implementation
SEED = 0


def _world_manager(world_size: int) -> Any:
    """A torchft ``Manager`` stand-in whose ``allreduce`` is torchft's, on the WORLD group.

    Everything torchft's DiLoCo calls on the manager besides ``allreduce`` (quorum, commit,
    state-dict locking and registration) is an autospec no-op or a fixed return value: one
    healthy quorum of ``world_size`` participants that always commits, each commit advancing
    ``current_step()`` by one as in the real manager.
    """
    import torch.distributed as dist
    from torchft.manager import Manager

    manager = create_autospec(Manager, instance=True)
    manager._use_async_quorum = False  # DiLoCo refuses async quorum
    manager._pg = dist.group.WORLD  # c10d ProcessGroup: .allreduce([tensor], AllreduceOptions)
    manager._timeout = timedelta(seconds=60)
    manager._logger = logging.getLogger("torchft-parity")
    manager.errored.return_value = None
    manager.num_participants.return_value = world_size
    manager.is_participating.return_value = True
    # As the real Manager: current_step() counts the successful should_commit() calls. torchft's
    # Streaming DiLoCo picks the fragment to prepare and to sync by current_step() % P.
    step = [0]

    def should_commit(timeout: Any = None) -> bool:
        step[0] += 1
        return True

    manager.current_step.side_effect = lambda: step[0]
    manager.should_commit.side_effect = should_commit

    def allreduce(tensor: torch.Tensor, should_quantize: bool = False, **kw: Any) -> Any:
        return Manager.allreduce(manager, tensor, should_quantize, **kw)

    def wrap_future(fut: Any, default: Any, timeout: Any = None) -> Any:
        return Manager.wrap_future(manager, fut, default, timeout)

    manager.allreduce.side_effect = allreduce
    manager.wrap_future.side_effect = wrap_future
    return manager


def _snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _parity_worker(
    rank: int, world_size: int, inner_kind: str, bucket_cap_mb: float, torchft_buckets: bool
) -> dict:
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    import lowcomm
    from lowcomm.testing import inner_step, make_inner

    out: dict[str, Any] = {}

    # (a) torchft: context manager, hooks the inner optimizer's step.
    model = toy_model(SEED)
    inner = make_inner(inner_kind, model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = _world_manager(world_size)
    rounds = []
    with TorchftDiLoCo(
        manager,
        [model],
        inner,
        outer,
        sync_every=SYNC_EVERY,
        backup_device=torch.device("cpu"),
        pin_memory=False,
        use_bucketization=torchft_buckets,
        should_quantize=False,
        fragment_sync_delay=0,
        fragment_update_alpha=0.0,
    ):
        for step in range(1, STEPS + 1):
            inner_step(model, inner, rank, step, SEED)
            if step % SYNC_EVERY == 0:
                rounds.append(_snapshot(model))
    out["torchft"] = {
        "rounds": rounds,
        "final": _snapshot(model),
        "allreduce_calls": manager.allreduce.call_count,
        "commits": manager.should_commit.call_count,
    }

    # (b) lowcomm with its defaults (Nesterov SGD, lr 0.7, momentum 0.9), same hook form.
    model = toy_model(SEED)
    inner = make_inner(inner_kind, model.parameters())
    algo = lowcomm.DiLoCo(model, inner, sync_every=SYNC_EVERY, bucket_cap_mb=bucket_cap_mb)
    rounds = []
    with algo:
        for step in range(1, STEPS + 1):
            inner_step(model, inner, rank, step, SEED)
            if step % SYNC_EVERY == 0:
                rounds.append(_snapshot(model))
    out["lowcomm"] = {"rounds": rounds, "final": _snapshot(model), "rounds_done": algo.rounds}
    return out


def _assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}, param {i}"
        if not torch.equal(x, y):
            diff = (x.double() - y.double()).abs()
            raise AssertionError(
                f"{what}, param {i}: not bitwise equal; {int((x != y).sum())} of {x.numel()} "
                f"elements differ, max |diff| {diff.max().item():.3e}"
            )


# With 3 or more ranks gloo's SUM all-reduce adds the ranks' values in an order that depends on
# the length of the buffer and the element's position in it, so per-parameter collectives and
# one flat bucket can differ in the last bit. Bitwise parity therefore needs both sides to reduce
# the same buffers: torchft's per-parameter all-reduce (its default) against lowcomm with one
# bucket per parameter, or torchft's ``use_bucketization=True`` (a single flat buffer, parameters
# packed in order) against lowcomm's default single 25 MB bucket. With 2 ranks a + b = b + a, so
# any bucketing matches. Three ranks (not four) also make 1/N inexact, so dividing by N and
# multiplying by 1/N would not agree either.
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("world_size", "inner_kind", "bucket_cap_mb", "torchft_buckets"),
    [
        (2, "adamw", 25.0, False),  # lowcomm's defaults against torchft's defaults
        (2, "sgd", 0.0002, False),  # several lowcomm buckets, each holding whole parameters
        (3, "adamw", 1e-9, False),  # one lowcomm bucket per parameter: torchft's collectives
        (3, "adamw", 25.0, True),  # one flat buffer with the same layout on both sides
    ],
    ids=[
        "2ranks-adamw-defaults",
        "2ranks-sgd-smallbuckets",
        "3ranks-adamw-perparam",
        "3ranks-adamw-onebucket",
    ],
)
def test_diloco_matches_torchft_bitwise(
    world_size: int, inner_kind: str, bucket_cap_mb: float, torchft_buckets: bool
) -> None:
    results = run_workers(
        _parity_worker, world_size, inner_kind, bucket_cap_mb, torchft_buckets, timeout_s=150
    )
    n_params = len(results[0]["torchft"]["final"])
    calls_per_round = 1 if torchft_buckets else n_params
    for rank, res in enumerate(results):
        ft, lc = res["torchft"], res["lowcomm"]
        # torchft really synchronised every round, and every round committed.
        assert ft["commits"] == STEPS // SYNC_EVERY
        assert ft["allreduce_calls"] == calls_per_round * (STEPS // SYNC_EVERY)
        assert lc["rounds_done"] == STEPS // SYNC_EVERY
        assert len(ft["rounds"]) == len(lc["rounds"]) == STEPS // SYNC_EVERY
        for k, (a, b) in enumerate(zip(ft["rounds"], lc["rounds"])):
            _assert_bitwise(a, b, f"rank {rank}, after round {k + 1}")
        _assert_bitwise(ft["final"], lc["final"], f"rank {rank}, final")
        # After a round every rank holds the same weights, and training moved them.
        _assert_bitwise(lc["final"], results[0]["lowcomm"]["final"], f"rank {rank} vs rank 0")
    initial = [p.detach() for p in toy_model(SEED).parameters()]
    final = results[0]["lowcomm"]["final"]
    assert all(torch.isfinite(p).all() for p in final)
    assert not all(torch.equal(p, q) for p, q in zip(final, initial)), "training did not move"


# -- Streaming DiLoCo ------------------------------------------------------------------------
#
# lowcomm.StreamingDiLoCo(fragments=[model[0], model[2]], sync_every=H, overlap=τ, mix=α)
# against torchft's DiLoCo([model[0], model[2]], sync_every=H, fragment_sync_delay=τ,
# fragment_update_alpha=α) with one Nesterov SGD outer optimizer per fragment (lowcomm builds one
# per fragment too). With H = 4 and P = 2 there is a sync point every 2 inner steps, alternating
# fragments 0, 1, 0, … (torchft: manager.current_step() % P, the stand-in's step advancing on
# every commit); with τ = 1 the fragment's pseudo-gradient is taken and all-reduced one step
# before its sync point.
#
# What is compared, and when: at every sync point (and so after the last step, itself a sync
# point) the live parameters θ of the whole model — the synced fragment's mixed θ and the other
# fragment's locally trained θ — and the global model A of every fragment (torchft's per-fragment
# backup ``original_parameters``, lowcomm's anchors). The live θ are compared BEFORE lowcomm's
# finish(): finish() resets every fragment to its anchor (dropping local progress, and undoing
# the mix of the fragment synced last), while torchft has no finish and leaves local weights. So
# after finish() lowcomm's θ are compared with torchft's A instead, which is what finish()
# promises: every rank holds the global model.
STREAM_SYNC_EVERY = 4
STREAM_FRAGMENTS = 2
STREAM_INTERVAL = STREAM_SYNC_EVERY // STREAM_FRAGMENTS  # inner steps between sync points
STREAM_STEPS = 12  # a multiple of STREAM_SYNC_EVERY: the last step is a sync point
STREAM_SYNC_POINTS = STREAM_STEPS // STREAM_INTERVAL


def _torchft_anchors(diloco: Any, model: torch.nn.Module) -> list[torch.Tensor]:
    """torchft's global model A (each fragment's ``original_parameters``) in model order."""
    by_id: dict[int, torch.Tensor] = {}
    for frag in diloco._fragments:
        for name, p in frag._model_fragment.named_parameters():
            by_id[id(p)] = frag.original_parameters[name].detach().clone()
    return [by_id[id(p)] for p in model.parameters()]


def _streaming_worker(
    rank: int,
    world_size: int,
    inner_kind: str,
    overlap: int,
    mix: float,
    bucket_cap_mb: float,
    torchft_buckets: bool,
) -> dict:
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    import lowcomm
    from lowcomm.testing import inner_step, make_inner

    out: dict[str, Any] = {}

    # (a) torchft: one outer optimizer per fragment module.
    model = toy_model(SEED)
    inner = make_inner(inner_kind, model.parameters())
    fragments = [model[0], model[2]]
    outers = [
        torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments
    ]
    manager = _world_manager(world_size)
    points = []
    with TorchftDiLoCo(
        manager,
        fragments,
        inner,
        outers,
        sync_every=STREAM_SYNC_EVERY,
        backup_device=torch.device("cpu"),
        pin_memory=False,
        use_bucketization=torchft_buckets,
        should_quantize=False,
        fragment_sync_delay=overlap,
        fragment_update_alpha=mix,
    ) as diloco:
        for step in range(1, STREAM_STEPS + 1):
            inner_step(model, inner, rank, step, SEED)
            if step % STREAM_INTERVAL == 0:
                points.append(
                    {"theta": _snapshot(model), "anchor": _torchft_anchors(diloco, model)}
                )
    out["torchft"] = {
        "points": points,
        "allreduce_calls": manager.allreduce.call_count,
        "commits": manager.should_commit.call_count,
        "final_step": manager.current_step(),
    }

    # (b) lowcomm, same fragments, same hook form.
    model = toy_model(SEED)
    inner = make_inner(inner_kind, model.parameters())
    algo = lowcomm.StreamingDiLoCo(
        model,
        inner,
        sync_every=STREAM_SYNC_EVERY,
        fragments=[model[0], model[2]],
        overlap=overlap,
        mix=mix,
        bucket_cap_mb=bucket_cap_mb,
    )
    points = []
    with algo:
        for step in range(1, STREAM_STEPS + 1):
            inner_step(model, inner, rank, step, SEED)
            if step % STREAM_INTERVAL == 0:
                points.append(
                    {
                        "theta": _snapshot(model),
                        "anchor": [v.detach().clone() for v in algo.anchor_views],
                    }
                )
    in_flight_before_finish = len(algo._in_flight)
    algo.finish()
    out["lowcomm"] = {
        "points": points,
        "after_finish": _snapshot(model),
        "sync_points": algo.sync_points,
        "in_flight_before_finish": in_flight_before_finish,
    }
    return out


# The buffer layouts of the DiLoCo test above apply per fragment: with 3 ranks, torchft's
# per-parameter all-reduces against lowcomm with one bucket per parameter, or torchft's
# ``use_bucketization=True`` (one flat buffer per fragment, its parameters packed in order)
# against lowcomm's default 25 MB bucket (one flat bucket per fragment, same packing).
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("world_size", "inner_kind", "overlap", "mix", "bucket_cap_mb", "torchft_buckets"),
    [
        (2, "adamw", 0, 0.0, 25.0, False),
        (2, "adamw", 1, 0.0, 25.0, False),
        (2, "adamw", 0, 0.5, 25.0, False),
        (2, "adamw", 1, 0.5, 25.0, False),
        (3, "adamw", 1, 0.5, 1e-9, False),
        (3, "adamw", 1, 0.5, 25.0, True),
    ],
    ids=[
        "2ranks-delay0-alpha0",
        "2ranks-delay1-alpha0",
        "2ranks-delay0-alpha0.5",
        "2ranks-delay1-alpha0.5",
        "3ranks-delay1-alpha0.5-perparam",
        "3ranks-delay1-alpha0.5-onebucket",
    ],
)
def test_streaming_diloco_matches_torchft_bitwise(
    world_size: int,
    inner_kind: str,
    overlap: int,
    mix: float,
    bucket_cap_mb: float,
    torchft_buckets: bool,
) -> None:
    results = run_workers(
        _streaming_worker,
        world_size,
        inner_kind,
        overlap,
        mix,
        bucket_cap_mb,
        torchft_buckets,
        timeout_s=150,
    )
    model = toy_model(SEED)
    frag_of = [0] * len(list(model[0].parameters())) + [1] * len(list(model[2].parameters()))
    params_per_frag = [frag_of.count(0), frag_of.count(1)]
    initial = [p.detach() for p in model.parameters()]
    for rank, res in enumerate(results):
        ft, lc = res["torchft"], res["lowcomm"]
        # torchft synced at every sync point, alternating fragments, and every sync committed.
        assert ft["commits"] == ft["final_step"] == STREAM_SYNC_POINTS
        calls = [1 if torchft_buckets else n for n in params_per_frag]
        expected_calls = sum(calls[k % STREAM_FRAGMENTS] for k in range(STREAM_SYNC_POINTS))
        assert ft["allreduce_calls"] == expected_calls
        assert lc["sync_points"] == STREAM_SYNC_POINTS
        assert lc["in_flight_before_finish"] == 0  # the last step was a sync point
        assert len(ft["points"]) == len(lc["points"]) == STREAM_SYNC_POINTS
        previous = initial
        for k, (a, b) in enumerate(zip(ft["points"], lc["points"])):
            where = f"rank {rank}, sync point {k + 1} (step {(k + 1) * STREAM_INTERVAL})"
            _assert_bitwise(a["theta"], b["theta"], f"{where}, live parameters")
            _assert_bitwise(a["anchor"], b["anchor"], f"{where}, global model A")
            # Round robin: sync point k + 1 moved fragment k mod P's A and no other.
            synced = k % STREAM_FRAGMENTS
            for i, (now, before) in enumerate(zip(b["anchor"], previous)):
                moved = not torch.equal(now, before)
                assert moved == (frag_of[i] == synced), f"{where}, A of param {i}"
            previous = b["anchor"]
            # Every rank holds the same global model after every sync point.
            _assert_bitwise(
                b["anchor"], results[0]["lowcomm"]["points"][k]["anchor"], f"{where} vs rank 0"
            )
        # finish() resets lowcomm to A, which is torchft's A after the last sync point.
        _assert_bitwise(ft["points"][-1]["anchor"], lc["after_finish"], f"rank {rank}, finish")
    final = results[0]["lowcomm"]["after_finish"]
    assert all(torch.isfinite(p).all() for p in final)
