"""``lowcomm.device`` on the CPU (every helper the plain CPU operation, or nothing), and the device
handling of the codecs, DeMo, the guard and the balance exchange that the CPU can check (the
``meta`` device stands in for a GPU where the operations support it). What needs a GPU is in
``test_cuda.py``."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import lowcomm.device as device_mod
from lowcomm.balance.remap import Remap
from lowcomm.comm import Communicator, DDPCommMeter, FlatBuckets
from lowcomm.compress.feedback import Compressor, generator_resumes, worker_generator
from lowcomm.compress.formats import PowerSGD, Quantize, _uniform
from lowcomm.device import (
    CollectiveTimer,
    CommStream,
    HostStaging,
    Launch,
    collective_device,
    device_clock,
    device_future,
    host_wait,
    peak_memory_allocated,
    pinned_like,
    synchronize,
    to_device,
)
from lowcomm.guard import _all_finite_one_read, all_finite
from lowcomm.link import LinkModel
from lowcomm.optim.dct import ChunkPlan, dct_matrix, decode, encode
from lowcomm.optim.demo import demo_decode
from lowcomm.testing import run_workers
from lowcomm.testing.toy import inner_step, make_inner, toy_model
from lowcomm.train.worker import process_group_backend

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
META = torch.device("meta")


# --- where collectives' tensors live --------------------------------------------------------------


def test_collective_device_is_the_cpu_without_a_group_and_on_gloo(single_rank_group: None) -> None:
    class Comm:
        group = None

    assert collective_device() == CPU
    assert collective_device(Comm()) == CPU
    assert collective_device(object()) == CPU  # no `group`: WORLD


def test_collective_device_is_the_current_gpu_on_nccl_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(device_mod.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend, expected in [
        ("nccl", torch.device("cuda", 3)),
        ("cpu:gloo,cuda:nccl", CPU),  # CPU tensors are taken: the control path stays there
        ("gloo", CPU),
    ]:
        monkeypatch.setattr(device_mod.dist, "get_backend", lambda group=None, b=backend: b)
        assert collective_device() == expected, backend


def test_a_gpu_job_runs_cpu_tensors_on_gloo_and_cuda_tensors_on_nccl() -> None:
    assert process_group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("gloo") == "gloo"


# --- clocks, futures, memory ----------------------------------------------------------------------


def test_clocks_synchronise_only_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert device_clock(CPU) is time.perf_counter
    assert device_clock("cpu") is time.perf_counter
    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    clock = device_clock("cuda:1")
    a = clock()
    b = clock()
    assert b >= a and calls == [torch.device("cuda", 1)] * 2
    synchronize(CPU)
    assert len(calls) == 2
    # None: the current device, only once CUDA is in use in this process
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    device_clock()()
    assert len(calls) == 2
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    device_clock()()
    assert calls[-1] is None and len(calls) == 3


def test_futures_and_memory_on_the_cpu() -> None:
    t = torch.ones(3)
    fut = device_future(t)
    fut.set_result(t)
    assert fut.wait() is t
    assert peak_memory_allocated(CPU) is None


# --- copies ---------------------------------------------------------------------------------------


def test_copies_to_the_cpu_are_the_plain_ones() -> None:
    t = torch.arange(6.0).view(2, 3)
    assert to_device(t, CPU) is t
    p = pinned_like(t)
    assert p.shape == t.shape and p.dtype == t.dtype and p.device == CPU
    assert p.is_pinned() == torch.cuda.is_available()
    # no staging on the CPU: the tensor itself goes to the CPU collective and back
    staging = HostStaging(t)
    assert staging.host is None
    assert staging.download(t) is t and staging.ready() is None
    out = torch.zeros(2, 3)
    staging.upload(out, t * 2)
    assert torch.equal(out, t * 2)
    staging.upload(t, t)  # the buffer is the destination: nothing to copy
    staging.writable()


def test_host_wait_and_timer_on_the_cpu_wait_for_each_work() -> None:
    waited: list[int] = []

    class Work:
        def __init__(self, i: int) -> None:
            self.i = i

        def wait(self) -> bool:
            waited.append(self.i)
            return True

    host_wait([Work(0), Work(1)], CPU)
    host_wait([Work(2)], None)
    assert waited == [0, 1, 2]
    timer = CollectiveTimer(CPU)
    timer.launched([Work(3)])
    assert timer.seconds() is None and waited == [0, 1, 2]  # not waited: gloo is timed itself


# --- the side stream ------------------------------------------------------------------------------


def test_comm_stream_on_the_cpu_runs_inline_and_guards_buffers_in_flight() -> None:
    cs = CommStream(CPU)
    assert not cs.active and cs.stream is None
    theta = torch.full((4,), 2.0)
    anchor = torch.full((4,), 5.0)
    sends = [torch.zeros(4), torch.zeros(4)]  # CO2: two slots
    with cs.launch(reads=[theta], writes=[sends[0]]) as first:
        torch.sub(anchor, theta, out=sends[0])
        first.inputs_read()
    assert torch.equal(sends[0], torch.full((4,), 3.0))  # ran inline, at once
    assert cs.in_flight == 1
    with cs.launch(writes=[sends[1]]) as second:  # the other slot, while the first is in flight
        sends[1].copy_(theta)
    assert cs.in_flight == 2
    # a buffer still in flight must not be rewritten
    with pytest.raises(AssertionError, match="still in flight"), cs.launch(writes=[sends[0]]):
        pass
    cs.apply(first, hand_over=[sends[0]])
    cs.apply(first)  # idempotent
    assert cs.in_flight == 1
    with cs.launch(writes=[sends[0]]) as third:  # its sync was applied: free again
        pass
    cs.apply(None)  # a sync restored from a checkpoint
    cs.drain()
    assert cs.in_flight == 0
    cs.apply(second)
    cs.apply(third)
    assert cs.in_flight == 0


def test_a_failed_launch_leaves_no_buffer_in_flight() -> None:
    cs = CommStream("cpu")
    buf = torch.zeros(2)
    with pytest.raises(RuntimeError, match="boom"), cs.launch(writes=[buf]):
        raise RuntimeError("boom")
    assert cs.in_flight == 0
    with cs.launch(writes=[buf]) as launch:
        pass
    assert launch.owner is cs


def test_views_of_one_buffer_at_other_offsets_are_other_buffers() -> None:
    cs = CommStream(CPU)
    flat = torch.zeros(8)
    with cs.launch(writes=[flat[:4]]):
        pass
    with cs.launch(writes=[flat[4:]]):
        pass
    assert cs.in_flight == 2


def test_waiting_for_a_launch_on_the_cpu_leaves_it_in_flight() -> None:
    cs = CommStream(CPU)
    buf = torch.zeros(3)
    with cs.launch(writes=[buf]) as launch:
        buf.fill_(1.0)
    cs.wait_for(launch)  # eager CO2 reads its own fresh contribution before the apply
    cs.wait_for(None)
    assert cs.in_flight == 1 and not launch.applied
    with pytest.raises(AssertionError, match="made on"):
        CommStream(CPU).wait_for(launch)
    cs.apply(launch)
    cs.wait_for(launch)  # applied: nothing to wait for
    assert cs.in_flight == 0


class RecordingStream(CommStream):
    """An inline (CPU) :class:`CommStream` that numbers its launches and records every launch
    and apply in order, and the most launches in flight at once."""

    def __init__(self) -> None:
        super().__init__(CPU)
        self.events: list[tuple[str, int]] = []
        self.numbers: dict[int, int] = {}
        self.peak = 0

    @contextlib.contextmanager
    def launch(
        self, *, reads: Sequence[torch.Tensor] = (), writes: Sequence[torch.Tensor] = ()
    ) -> Iterator[Launch]:
        with super().launch(reads=reads, writes=writes) as token:
            yield token
        self.numbers[id(token)] = n = len(self.events)
        self.events.append(("launch", n))
        self.peak = max(self.peak, self.in_flight)

    def apply(self, token: Launch | None, *, hand_over: Sequence[torch.Tensor] = ()) -> None:
        if token is not None and not token.applied:
            self.events.append(("apply", self.numbers[id(token)]))
        super().apply(token, hand_over=hand_over)


CASES: list[tuple[str, dict[str, Any]]] = [
    ("CO2", {}),
    ("CO2", {"eager": True, "compression": "int8"}),
    ("DiLoCo", {}),
    ("DiLoCo", {"compression": "powersgd:1"}),
    ("LocalSGD", {}),
]
H = 3


def comm_stream_trace(rank: int, world: int) -> list[dict[str, Any]]:
    """Each case twice on the toy problem over 5 rounds: straight through, and going back at
    the end of round 3 (a launch in flight) to its state at the end of round 2, from its own
    state_dict (the inner optimizer and parameters too). The side stream is a
    :class:`RecordingStream`."""
    import lowcomm

    out = []
    for name, hyper in CASES:
        finals = []
        trace: dict[str, Any] = {}
        for reload in (False, True):
            model = toy_model(3)
            inner = make_inner("adamw", model.parameters())
            algo = getattr(lowcomm, name)(model, inner, sync_every=H, **hyper)
            stream = algo.comm_stream = RecordingStream()
            saved: Any = None
            step = 0
            while step < 5 * H:
                step += 1
                inner_step(model, inner, rank, step, 3)
                algo.step()
                if reload and step == 2 * H and saved is None:
                    params = [p.detach().clone() for p in model.parameters()]
                    saved = (algo.state_dict(), params, copy.deepcopy(inner.state_dict()))
                elif reload and step == 3 * H and "reloaded" not in trace:
                    trace["reloaded"] = stream.in_flight
                    # the collective in flight writes into a send buffer that the load refills:
                    # it must have landed first (load_state_dict drops it without waiting)
                    for frag in algo.fragments:
                        for sync in frag.pending:
                            sync.handle.wait()
                    state, params, inner_state = saved
                    algo.load_state_dict(state)
                    trace["after_load"] = stream.in_flight
                    with torch.no_grad():
                        for p, q in zip(model.parameters(), params):
                            p.copy_(q)
                    inner.load_state_dict(inner_state)
                    step = 2 * H
            algo.finish()
            finals.append([p.detach().clone() for p in model.parameters()])
            if not reload:
                trace.update(events=stream.events, peak=stream.peak)
            trace[f"after_finish_{reload}"] = stream.in_flight
        trace["same"] = all(torch.equal(a, b) for a, b in zip(*finals))
        out.append(trace)
    return out


@pytest.mark.timeout(180)
def test_every_launch_on_the_side_stream_is_applied_in_order_and_none_is_left() -> None:
    for rank in run_workers(comm_stream_trace, 2):
        for (name, hyper), trace in zip(CASES, rank):
            case = f"{name} {hyper}"
            launches = [n for kind, n in trace["events"] if kind == "launch"]
            applies = [n for kind, n in trace["events"] if kind == "apply"]
            assert len(launches) == 5, case  # a sync per round
            assert applies == launches, case  # every one applied, in launch order
            assert trace["after_finish_False"] == trace["after_finish_True"] == 0, case
            # a launch is applied after the next one only where a round's sync overlaps the
            # next round (CO2, whose two send buffers are then both in flight), unless its
            # compressor finishes it first (on the compute stream, before the next launch)
            overlapped = name == "CO2"
            both = overlapped and "compression" not in hyper
            expected_peak = 0 if name == "LocalSGD" else 2 if both else 1
            assert trace["peak"] == expected_peak, case
            # load_state_dict drops what was in flight (CO2: the launch at the end of round 3)
            assert trace["reloaded"] == (1 if overlapped else 0), case
            assert trace["after_load"] == 0, case
            # and going back to round 2 (its sync in flight restored, complete) changes nothing
            assert trace["same"], case


def test_a_compressed_handle_hands_over_what_its_launch_made(single_rank_group: None) -> None:
    shapes = [torch.Size([40, 30]), torch.Size([7]), torch.Size([30, 20])]
    comm = Communicator()
    buckets = FlatBuckets(shapes, bucket_cap_mb=1300 * 4 / 2**20)  # two buckets
    assert len(buckets.groups()) == 2
    buckets.copy_from([torch.randn(s) for s in shapes])
    handle = comm.compressed_mean_async(buckets, Compressor("int8", shapes))
    made = handle.launch_tensors()
    assert len(made) == 4
    for g in handle.gather:  # each bucket's payload and the buffer gathered into
        assert any(t is g.payload for t in made) and any(t is g.gathered for t in made)
    handle.wait()
    low = comm.compressed_mean_async(buckets, Compressor("powersgd:2", shapes))
    made = low.launch_tensors()
    for g in low.low_rank:
        for t in [g.flat_p, *g.m.values(), *g.q.values()]:
            assert any(t is u for u in made)
    assert len(made) == sum(1 + 2 * len(g.compressed) for g in low.low_rank)
    low.wait()
    plain = comm.all_reduce_mean_async(buckets.buffers)
    assert plain.launch_tensors() == []  # the buffers are the caller's
    plain.wait()


# --- DDP over an emulated link --------------------------------------------------------------------


class _Bucket:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self.tensor


def test_ddp_over_a_link_completes_a_bucket_off_the_backward_thread(
    single_rank_group: None,
) -> None:
    meter = DDPCommMeter(link=LinkModel(bandwidth_bps=1e9, latency_s=1.0))
    grad = torch.full((1000,), 2.0)
    t0 = time.perf_counter()
    fut = DDPCommMeter._hook(meter, _Bucket(grad))
    # the hook returns at once: backward goes on while the link carries the bucket (a wide
    # margin under the link's second, so a loaded machine cannot make it fail)
    assert time.perf_counter() - t0 < 0.5
    assert fut.wait() is grad and torch.equal(grad, torch.full((1000,), 2.0))
    assert time.perf_counter() - t0 >= 1.0  # not before the link could have carried it
    assert meter.stats.in_flight_s >= 0.3 and meter.stats.collectives == 1
    second = DDPCommMeter._hook(meter, _Bucket(torch.ones(4)))  # the same thread serves it
    assert torch.equal(second.wait(), torch.ones(4))


# --- resuming stochastic rounding on another device type ------------------------------------------


def test_a_generator_state_resumes_only_on_its_own_device_type() -> None:
    cpu = torch.Generator()
    state = cpu.get_state()
    assert generator_resumes("cpu", state, cpu)
    assert not generator_resumes("cuda", torch.zeros(16, dtype=torch.uint8), cpu)
    # checkpoints from before the device was recorded: the state's format (its size) decides
    assert generator_resumes(None, state, cpu)
    assert not generator_resumes(None, torch.zeros(16, dtype=torch.uint8), cpu)


def test_a_gpu_checkpoint_resumed_on_the_cpu_reseeds_stochastic_rounding() -> None:
    shapes = [torch.Size([64])]
    saved = Compressor("int4:sr", shapes, rank=1, stream=2).state_dict()
    assert saved["generator_device"] == "cpu"
    saved["launches"] = 7
    # the same device type: the generator goes on where it stopped
    same = Compressor("int4:sr", shapes, rank=1, stream=2)
    same.generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(saved)
    assert torch.equal(same.generator.get_state(), saved["generator"])
    # a CUDA generator's state (Philox: seed and offset) on the CPU: a fresh seed, the same on
    # every resume, told
    from_gpu = {
        **saved,
        "generator": torch.zeros(16, dtype=torch.uint8),
        "generator_device": "cuda",
    }
    fresh = [Compressor("int4:sr", shapes, rank=1, stream=2) for _ in range(2)]
    for comp in fresh:
        with pytest.warns(
            UserWarning, match=r"another device type \(cuda\) than this run's \(cpu\)"
        ):
            comp.load_state_dict(from_gpu)
    expected = worker_generator(1, 2, "cpu", launches=7).get_state()
    assert all(torch.equal(c.generator.get_state(), expected) for c in fresh)
    assert not torch.equal(expected, worker_generator(1, 2, "cpu").get_state())
    assert fresh[0].launches == 7
    # and an older checkpoint without the key, saved on the CPU, resumes as before
    del saved["generator_device"]
    old = Compressor("int4:sr", shapes, rank=1, stream=2)
    old.load_state_dict(saved)
    assert torch.equal(old.generator.get_state(), saved["generator"])


# --- the codecs' devices --------------------------------------------------------------------------


def test_rounding_noise_is_drawn_on_the_generators_device() -> None:
    like = torch.empty(5, 3)
    expected = torch.rand(5, 3, generator=torch.Generator().manual_seed(7))
    assert torch.equal(_uniform(like, torch.Generator().manual_seed(7)), expected)
    # a CPU generator for a tensor elsewhere: drawn on the CPU, then moved; the generator
    # advances as it does for a CPU tensor
    g = torch.Generator().manual_seed(7)
    on_meta = _uniform(torch.empty(5, 3, device=META), g)
    assert on_meta.device == META and on_meta.shape == (5, 3)
    assert torch.equal(_uniform(like, g), _second_draw(7))
    # no generator: the global one of the tensor's device
    assert _uniform(torch.empty(2, device=META), None).device == META


def _second_draw(seed: int) -> torch.Tensor:
    """The second (5, 3) draw of a CPU generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    torch.rand(5, 3, generator=g)
    return torch.rand(5, 3, generator=g)


def test_stochastic_rounding_with_a_cpu_generator_is_the_same_codes() -> None:
    codec = Quantize(bits=4, block=8, stochastic=True)
    x = torch.randn(37)
    a = codec.encode(x, generator=torch.Generator().manual_seed(3))
    b = codec.encode(x, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_powersgd_starts_on_the_device_asked_for() -> None:
    codec = PowerSGD(rank=2)
    shape = (6, 5)
    cpu = codec.initial_q(shape, 1)
    assert cpu.device == CPU
    assert codec.initial_q(shape, 1, device=META).device == META
    assert codec.start_q(shape, 1, None, device=META).device == META
    previous = torch.empty(5, 1, device=META)  # the rank grew from 1 to 2: extended
    assert codec.start_q(shape, 1, previous).device == META
    assert codec.start_q(shape, 1, previous).shape == (5, 2)
    assert torch.equal(codec.start_q(shape, 1, cpu.clone()), cpu)


# --- DeMo -----------------------------------------------------------------------------------------


def test_dct_matrices_are_cached_per_size_dtype_and_device() -> None:
    a = dct_matrix(8, torch.float32)
    assert dct_matrix(8, torch.float32, "cpu") is a
    assert torch.equal(a, dct_matrix(8, torch.float64).float())
    assert dct_matrix(8, torch.float64) is not a
    m = dct_matrix(8, torch.float32, META)
    assert m.device == META and dct_matrix(8, torch.float32, "meta") is m
    plan = ChunkPlan.for_shape(torch.Size([16, 8]), 4)
    x = torch.empty(16, 8, device=META)
    assert decode(encode(x, plan), plan).device == META


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
def test_demo_decode_sums_in_rank_order_as_scatter_reduce_mean(ranks: int) -> None:
    gen = torch.Generator().manual_seed(ranks)
    plan = ChunkPlan.for_shape(torch.Size([12, 40]), 8)  # 3 x 5 blocks of 4 x 8
    k = 6
    indices, values = [], []
    for _ in range(ranks):
        # few distinct coefficients: many collide across ranks, none within a rank's chunk
        idx = torch.stack([torch.randperm(10, generator=gen)[:k] for _ in range(plan.chunks)]).to(
            torch.int32
        )
        val = torch.randn(plan.chunks, k, generator=gen) * torch.exp(
            4 * torch.randn(plan.chunks, k, generator=gen)
        )
        val[0, 0] = -0.0
        indices.append(idx)
        values.append(val)
    dense = torch.zeros(plan.chunks, plan.per_chunk)
    dense.scatter_reduce_(
        -1,
        torch.cat([i.long() for i in indices], -1),
        torch.cat(values, -1),
        "mean",
        include_self=False,
    )
    ours = demo_decode(indices, values, plan)
    assert torch.equal(ours.view(torch.int32), decode(dense, plan).view(torch.int32))


# --- the guard ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", [None, float("nan"), float("inf"), float("-inf")], ids=["finite", "nan", "inf", "-inf"]
)
def test_one_read_finiteness_check_agrees_with_the_per_tensor_one(bad: float | None) -> None:
    tensors = [
        torch.randn(5),
        torch.empty(0),
        torch.randn(3, 4),
        torch.tensor([1e300, -1e300], dtype=torch.float64),
    ]
    if bad is not None:
        tensors[2][1, 2] = bad
    assert _all_finite_one_read(tensors) == all_finite(tensors) == (bad is None)
    assert _all_finite_one_read([torch.empty(0)]) is True


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_finiteness_check_of_a_flat_buckets_views_checks_exactly_their_values(bad: float) -> None:
    from lowcomm.buckets import FlatBuckets
    from lowcomm.guard import _regions

    shapes = [(3, 4), (5,), (2, 2, 2), (7,)]
    flat = FlatBuckets(shapes, bucket_cap_mb=80 / 2**20)  # 20 floats: two buffers
    flat.copy_from([torch.randn(s) for s in shapes])
    # one slice per run of views that tile a buffer in order, not one per view
    assert len(_regions(flat.views)) == len(flat.buffers) < len(shapes)
    assert all_finite(flat.views)
    for view in flat.views:  # every value of every view is checked
        for i in range(view.numel()):
            saved = view.view(-1)[i].item()
            view.view(-1)[i] = bad
            assert not all_finite(flat.views)
            view.view(-1)[i] = saved
    # only the views' values: a gap between views, views out of order, a strided view
    base = torch.zeros(10)
    base[3] = bad
    assert all_finite([base[0:3], base[4:10]])
    assert not all_finite([base[4:10], base[0:4]])
    assert all_finite([base[4:10], base[0:3]])
    grid = torch.zeros(4, 4)
    grid[1, 2] = bad
    assert not all_finite([grid.t()]) and all_finite([grid[2:].t()])


# --- the balance exchange -------------------------------------------------------------------------


def test_remap_indices_are_copied_to_a_device_once() -> None:
    remap = Remap((3, 2, 4), (1, 0, 1), 2, 0)
    send, place = remap._indices_on(META)
    assert send.device == place.device == META
    assert remap._indices_on(META)[0] is send
    cpu_send, _ = remap._indices_on(CPU)
    assert torch.equal(cpu_send, remap._exchange[0])


# --- the run's table ------------------------------------------------------------------------------


def test_the_summary_table_shows_peak_gpu_memory_only_on_gpus() -> None:
    from lowcomm.comm import CommStats
    from lowcomm.train.config import config_from_dict
    from lowcomm.train.report import format_summary, run_summary

    cfg = config_from_dict({"algo": "co2"}, source="test").with_paths()
    per_rank = [
        {"rank": r, "rounds": 0, "intra_node": None, **CommStats().as_dict()} for r in (0, 1)
    ]
    summary = run_summary(
        cfg,
        world=2,
        tokens=1,
        wall_s=1.0,
        train_s=1.0,
        eval_s=0.0,
        val_start=5.0,
        val_end=4.0,
        per_rank=per_rank,
        n_params=10,
    )
    summary["peak_gpu_memory_bytes"] = None  # the CPU
    assert "peak GPU memory" not in format_summary(summary)
    summary["peak_gpu_memory_bytes"] = [3 * 2**30, 1536 * 2**20]
    rows = [line for line in format_summary(summary).splitlines() if "peak GPU" in line]
    assert (
        len(rows) == 1 and rows[0].split("memory")[1].strip() == "3072 MiB / 1536 MiB (per worker)"
    )


# --- the one-command GPU check --------------------------------------------------------------------

SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_check_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CUDA device is present: the script runs the whole check"
)
@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.timeout(120)
def test_gpu_check_stops_at_once_without_a_gpu() -> None:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT / "src")}
    t0 = time.perf_counter()
    done = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=100
    )
    assert done.returncode == 2, done
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], lines
    assert time.perf_counter() - t0 < 60


@pytest.mark.timeout(180)
def test_gpu_profile_runs_on_the_cpu(single_rank_group: None, capsys: Any) -> None:
    """``benchmarks/gpu_profile.py`` (the GPU diagnostic) runs its loop on the CPU too: one line
    of JSON a configuration, with its time a step and its ratio to no algorithm (6 steps timed
    after 3, then 3 profiled, the last of them a sync: H = 12)."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location(
        "gpu_profile", ROOT / "benchmarks" / "gpu_profile.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["none", "co2:compression=int4"], 6)
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        kind, _, text = line.partition(" ")
        if kind in ("none", "co2:compression=int4"):
            rows[kind] = json.loads(text)
    assert set(rows) == {"none", "co2:compression=int4"}
    assert rows["none"]["of_none"] == 1.0
    co2 = rows["co2:compression=int4"]
    assert "error" not in co2 and co2["ms_per_step"] > 0 and co2["of_none"] > 0
    assert co2["host_reads"] == rows["none"]["host_reads"]  # the sync reads nothing back
    assert all(len(row) == 3 for row in co2["top_self_device_ms"])  # (key, count, ms)
