"""lowcomm on CUDA: codecs and DeMo's DCT against the CPU, the device helpers' orderings
(:mod:`lowcomm.device`), bf16 autocast, ``lowcomm train`` jobs of one worker on NCCL, and of
two workers in the layout this machine gives them (one GPU: both share it over gloo, worker k
on ``cuda:k mod 1``; two or more: one GPU each, on NCCL): identical replicas, transfers hidden
behind compute over an emulated link, CO2's launches on the side stream against inline, and a
job that learns as the same job does on the CPU. The library on a process group of NCCL alone
(CO2 to ``finish()``, collectives timed on the device) needs two GPUs.

What must be identical across devices (docs/gpu.md): the bytes a codec puts on the wire and
everything computed from received bytes are the same on every rank of a job, and every rank
of a job computes on one kind of device. Between the CPU and a GPU, the quantised codecs'
codes are equal and their fp32 block scales may differ in the last place (torch divides by a
Python number on the GPU as a multiplication by its fp32 reciprocal): tested as such.

Every test is skipped on a machine without a CUDA device; ``benchmarks/gpu_check.sh`` runs
this file first."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lowcomm.comm import Communicator, FlatBuckets
from lowcomm.compress import BF16, Compressor, PowerSGD, Quantize, Raw, Sign, TopK
from lowcomm.device import (
    CollectiveTimer,
    CommStream,
    HostStaging,
    collective_device,
    device_clock,
    device_future,
    host_wait,
    peak_memory_allocated,
    same_device,
    to_device,
)
from lowcomm.guard import all_finite
from lowcomm.models.gpt import GPT, GPTConfig
from lowcomm.optim import DeMo
from lowcomm.optim.dct import ChunkPlan, decode, encode
from lowcomm.optim.demo import demo_compress, demo_decode
from lowcomm.testing.jobs import read_summary, tiny_job_args

NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

TWO_GPUS = pytest.mark.skipif(
    GPUS < 2,
    reason=NO_CUDA
    if not GPUS
    else f"needs 2 CUDA devices (one per worker) for a multi-process NCCL job; {GPUS} visible",
)

TWO_WORKER_BACKEND = "nccl" if GPUS >= 2 else "gloo"
"""The backend two workers run on here: NCCL with a GPU each; on one GPU they share it over
gloo (``lowcomm train``'s rule, :func:`lowcomm.train.worker.place_workers`)."""

SHAPES = [(7,), (64,), (130,), (5, 77), (3, 4, 9), (256, 300)]


def _gpu() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _x(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-2, 1, math.prod(shape)).view(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` on the CPU (for bitwise comparison, NaN and -0.0 included)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many fp32 values lie between ``a`` and ``b`` elementwise (finite, same sign: block
    scales are >= 0); 0 where the bits are equal."""
    ia = a.detach().cpu().float().contiguous().view(torch.int32).long()
    ib = b.detach().cpu().float().contiguous().view(torch.int32).long()
    return (ia - ib).abs()


def _assert_same_wire_bytes(on_gpu: torch.Tensor, on_cpu: torch.Tensor, codec: Any, n: int) -> None:
    """``on_gpu`` (a payload encoded on the GPU) against ``on_cpu`` (the same tensor of ``n``
    elements encoded on the CPU): the same bytes, except that a quantised codec's fp32 block
    scales may differ in the last place (the GPU divides ``amax`` by the Python number ``qmax``
    as a multiplication by its fp32 reciprocal, the CPU divides), with its codes equal."""
    on_gpu, on_cpu = on_gpu.detach().cpu(), on_cpu.detach().cpu()
    assert on_gpu.shape == on_cpu.shape and on_gpu.dtype == on_cpu.dtype == torch.uint8
    if not isinstance(codec, Quantize):
        assert torch.equal(on_gpu, on_cpu)
        return
    nb = -(-n // codec.block)
    assert torch.equal(on_gpu[4 * nb :], on_cpu[4 * nb :])  # the codes
    gpu_scales = on_gpu[: 4 * nb].clone().view(torch.float32)
    cpu_scales = on_cpu[: 4 * nb].clone().view(torch.float32)
    assert torch.isfinite(gpu_scales).all() and (gpu_scales >= 0).all()
    assert int(_ulps(gpu_scales, cpu_scales).max()) <= 1


def _cycles_per_ms() -> float:
    """GPU clock cycles ``torch.cuda._sleep`` spins per millisecond (measured: the median of
    three, after a first call that loads the kernel)."""
    torch.cuda._sleep(1_000)
    torch.cuda.synchronize()
    rates = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        rates.append(10_000_000 / start.elapsed_time(end))
    return sorted(rates)[1]


def _spin(ms: float, cycles_per_ms: float) -> None:
    """Occupy the current stream (one thread block) for about ``ms`` milliseconds."""
    torch.cuda._sleep(int(ms * cycles_per_ms))


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A one-rank process group in this process running CUDA tensors on NCCL and CPU tensors
    on gloo, as ``lowcomm train`` sets it up on GPUs."""
    assert not dist.is_initialized()
    dist.init_process_group(
        "cpu:gloo,cuda:nccl",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


# --- codecs: the same bytes on the GPU as on the CPU ----------------------------------------------

DETERMINISTIC = [Raw(), BF16(), Quantize(bits=8), Quantize(bits=4, block=16), Quantize(bits=2)]
DETERMINISTIC += [TopK(density=0.1)]


@pytest.mark.parametrize("codec", DETERMINISTIC, ids=lambda c: c.spec)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_deterministic_codecs_put_the_same_bytes_on_the_wire(codec: Any, shape: Any) -> None:
    x = _x(shape)
    on_cpu = codec.encode(x)
    on_gpu = codec.encode(x.to(_gpu()))
    assert on_gpu.is_cuda and on_gpu.dtype == torch.uint8
    _assert_same_wire_bytes(on_gpu, on_cpu, codec, math.prod(shape))
    # the same bytes decode to the same bits on either device: every rank of a job computes
    # the same mean from the payloads it gathered
    decoded = codec.decode(on_gpu, shape)
    assert decoded.is_cuda and torch.equal(_bits(decoded), _bits(codec.decode(on_gpu.cpu(), shape)))


@pytest.mark.parametrize("qmax", [1, 7, 127])
def test_the_gpu_divides_by_a_python_number_as_a_multiplication_by_its_reciprocal(
    qmax: int,
) -> None:
    # The one step of the quantised codecs' encoding whose bits differ between the CPU and
    # the GPU: scale = amax / qmax. torch's CUDA kernel divides by a CPU scalar (a Python
    # number) as x * fp32(1 / qmax); the CPU divides. By a tensor on the same device the GPU
    # divides too, bit for bit as the CPU: what the proposed change to the codecs uses.
    x = _x((1 << 16,), seed=7).abs()
    g = x.to(_gpu())
    by_reciprocal = x * (1.0 / qmax)
    assert torch.equal(_bits(g / qmax), _bits(by_reciprocal))
    assert torch.equal(_bits(g / torch.full((), float(qmax), device=_gpu())), _bits(x / qmax))
    if qmax == 1:  # exact: int2's scales never differ
        assert torch.equal(_bits(by_reciprocal), _bits(x / qmax))
    else:  # int4's and int8's do, in the last place, for some amax
        assert int(_ulps(by_reciprocal, x / qmax).max()) == 1


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_bucket_encodes_and_decodes_on_the_gpu_as_on_the_cpu(bits: int) -> None:
    # the flat path (lowcomm.compress.flat) on CUDA: the CPU's bytes (its scales divide by a
    # device tensor: the CPU's division), this rank's contribution, and from the same bytes the
    # means the CPU computes, bit for bit
    from lowcomm.compress.flat import FlatLayout

    codec = Quantize(bits=bits)
    codecs = [codec if codec.compresses(s) else Raw() for s in SHAPES]
    flat = torch.cat([_x(s, seed=i).reshape(-1) for i, s in enumerate(SHAPES)])
    on_gpu, on_cpu = FlatLayout(codecs, SHAPES, _gpu()), FlatLayout(codecs, SHAPES, "cpu")
    payload, mine = on_gpu.encode(flat.to(_gpu()), generator=None)
    cpu_payload, cpu_mine = on_cpu.encode(flat, generator=None)
    assert payload.is_cuda and mine.is_cuda
    assert torch.equal(payload.cpu(), cpu_payload)
    assert torch.equal(_bits(mine), _bits(cpu_mine))
    means = torch.empty_like(mine)
    on_gpu.decode_mean(torch.cat([payload, payload]), 2, out=means)
    cpu_means = torch.empty_like(cpu_mine)
    on_cpu.decode_mean(torch.cat([cpu_payload, cpu_payload]), 2, out=cpu_means)
    assert torch.equal(_bits(means), _bits(cpu_means))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sign_codec_matches_the_cpu_up_to_the_scales_rounding(shape: Any) -> None:
    codec = Sign(block=32)
    x = _x(shape, seed=1)
    on_cpu, on_gpu = codec.encode(x), codec.encode(x.to(_gpu())).cpu()
    n = math.prod(shape)
    nb = -(-n // codec.block)
    assert torch.equal(on_gpu[4 * nb :], on_cpu[4 * nb :])  # the sign bits
    # each block's mean magnitude: a sum, whose order differs on the GPU
    gpu_scales = on_gpu[: 4 * nb].clone().view(torch.float32)
    cpu_scales = on_cpu[: 4 * nb].clone().view(torch.float32)
    torch.testing.assert_close(gpu_scales, cpu_scales, rtol=1e-6, atol=0)


def test_stochastic_rounding_on_the_gpu() -> None:
    codec = Quantize(bits=4, block=16, stochastic=True)
    x = _x((4096,), seed=2)
    # a CPU generator: its noise is drawn on the CPU, so the codes are the CPU's (the scales
    # within the last place)
    gen = torch.Generator().manual_seed(5)
    on_cpu = codec.encode(x, generator=gen)
    gen.manual_seed(5)
    _assert_same_wire_bytes(codec.encode(x.to(_gpu()), generator=gen), on_cpu, codec, x.numel())
    # a generator on the GPU (the Compressor's there): unbiased, within one step of x
    cuda_gen = torch.Generator(device=_gpu()).manual_seed(5)
    xg = x.to(_gpu())
    scale = x.view(-1, 16).abs().amax(dim=1, keepdim=True) / codec.qmax
    draws = torch.stack([codec.roundtrip(xg, generator=cuda_gen) for _ in range(200)]).cpu()
    assert ((draws - x).abs().view(200, -1, 16) <= scale * (1 + 1e-6)).all()
    mean_error = (draws.mean(0) - x).view(-1, 16).abs() / scale
    assert float(mean_error.mean()) < 0.05


def test_powersgd_starts_on_the_gpu_from_the_cpus_draw() -> None:
    codec = PowerSGD(rank=3)
    q = codec.start_q((40, 30), 2, None, device=_gpu())
    assert q.is_cuda and torch.equal(q.cpu(), codec.initial_q((40, 30), 2))


@pytest.mark.parametrize("spec", ["int8", "int4:sr", "topk:0.05", "powersgd:2", "lgreco:int"])
def test_compressor_on_the_gpu(world_of_one: None, spec: str) -> None:
    shapes = [torch.Size([12, 10]), torch.Size([10]), torch.Size([3, 4, 5])]
    results = {}
    came_in = [sum(_x(tuple(s), seed=10 * t + i) for t in range(4)) for i, s in enumerate(shapes)]
    for device in ("cpu", "cuda"):
        comm = Communicator()
        buckets = FlatBuckets(shapes, device=torch.device(device))
        comp = Compressor(spec, shapes, device=buckets.device)
        out = []
        for t in range(4):
            buckets.copy_from(
                [_x(tuple(s), seed=10 * t + i).to(device) for i, s in enumerate(shapes)]
            )
            comm.compressed_mean_async(buckets, comp).wait()
            out += [v.detach().cpu().clone() for v in buckets.views]
        # by type and index: the buckets were asked for on "cuda", the residuals report cuda:0
        assert all(same_device(r.device, buckets.device) for r in comp.residuals)
        # error feedback loses nothing on either device (a world of one: the mean is this
        # rank's decoded value): what went out over the rounds plus what is left is what came in
        for i, (total, left) in enumerate(zip(came_in, comp.residuals)):
            went_out = sum(out[3 * t + i] for t in range(4))
            torch.testing.assert_close(went_out + left.cpu(), total, rtol=1e-5, atol=1e-5)
        results[device] = out
    for a, b in zip(results["cpu"], results["cuda"]):
        assert a.shape == b.shape and torch.isfinite(b).all()
        if spec in ("int8", "topk:0.05"):  # deterministic encodings, error feedback in fp32
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        elif spec != "int4:sr":  # other reductions (matmuls): the same values, to a scale
            assert float((a - b).norm()) <= 0.5 * float(a.norm()) + 1e-3
        # (stochastic rounding draws other noise on each device: a value of a round may differ
        # by a whole quantisation step, on a tensor of 10 values by most of its norm (seen on
        # an H200); the conservation above is what holds on both)


# --- DeMo's DCT -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(128, 96), (10,), (3, 6, 10), (127,), (768, 256)], ids=str)
def test_dct_on_the_gpu_matches_the_cpu(shape: Any) -> None:
    plan = ChunkPlan.for_shape(torch.Size(shape), 64)
    x = _x(shape, seed=3)
    coeffs = encode(x, plan)
    on_gpu = encode(x.to(_gpu()), plan)
    assert on_gpu.is_cuda
    torch.testing.assert_close(on_gpu.cpu(), coeffs, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(decode(on_gpu, plan).cpu(), x, rtol=1e-4, atol=1e-5)
    # the basis is built on the CPU in float64 and cached per device: the same values
    torch.testing.assert_close(
        encode(x.double().to(_gpu()), plan).cpu(), encode(x.double(), plan), rtol=1e-12, atol=1e-12
    )


def test_demo_decode_is_the_same_on_every_device_and_every_call() -> None:
    plan = ChunkPlan.for_shape(torch.Size([64, 128]), 32)
    gen = torch.Generator().manual_seed(0)
    k = 8
    indices = [
        torch.stack([torch.randperm(24, generator=gen)[:k] for _ in range(plan.chunks)]).int()
        for _ in range(4)  # four ranks, many coefficients shared: collisions
    ]
    values = [torch.randn(plan.chunks, k, generator=gen) for _ in range(4)]
    on_cpu = demo_decode(indices, values, plan)
    gi = [i.to(_gpu()) for i in indices]
    gv = [v.to(_gpu()) for v in values]
    runs = [demo_decode(gi, gv, plan) for _ in range(5)]
    # the sums of colliding coefficients are taken in rank order: no atomics, the same bits
    # on every call (every rank of a job decodes the same gathered set to the same update)
    assert all(torch.equal(_bits(r), _bits(runs[0])) for r in runs)
    torch.testing.assert_close(runs[0].cpu(), on_cpu, rtol=1e-4, atol=1e-5)
    m = _x((64, 128), seed=4)
    idx, val, sent = demo_compress(m.to(_gpu()), plan, k)
    idx_c, val_c, sent_c = demo_compress(m, plan, k)
    torch.testing.assert_close(sent.cpu(), sent_c, rtol=1e-4, atol=1e-5)
    assert idx.is_cuda and val.is_cuda


def test_demo_steps_on_the_gpu(world_of_one: None) -> None:
    results = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(_x((64, 96), seed=5).to(device))]
        opt = DeMo(params, lr=0.01, compression_topk=8, compression_chunk=32)
        for t in range(3):
            params[0].grad = _x((64, 96), seed=6 + t).to(device)
            opt.step()
        assert opt.state[params[0]]["delta"].device == params[0].device
        results[device] = params[0].detach().cpu()
    changed = (results["cpu"] - results["cuda"]).abs() > 1e-6
    # sign(Q): an element may flip where Q is about 0 and the DCTs round differently
    assert float(changed.float().mean()) < 0.01


# --- the device helpers ---------------------------------------------------------------------------


def test_comm_stream_overlaps_the_launch_with_the_next_step_and_keeps_the_order() -> None:
    device = _gpu()
    cpm = _cycles_per_ms()
    cs = CommStream(device)
    assert cs.active
    theta = torch.zeros(4096, device=device)
    send = torch.zeros(4096, device=device)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    _spin(50, cpm)  # the inner step ...
    theta.fill_(2.0)  # ... that writes θ
    with cs.launch(writes=[send]) as launch:
        send.copy_(theta)  # θ as the step left it: the side stream waited for it
        launch.inputs_read()
        _spin(100, cpm)  # the encoding, beside the next step
        side_done = torch.cuda.Event(enable_timing=True)
        side_done.record()
    theta.fill_(3.0)  # the next step overwrites θ only after the fill read it
    _spin(100, cpm)  # the next step
    step_done = torch.cuda.Event(enable_timing=True)
    step_done.record()
    cs.apply(launch, hand_over=[send])
    applied = torch.cuda.Event(enable_timing=True)
    applied.record()
    torch.cuda.synchronize()
    assert torch.all(send == 2.0) and torch.all(theta == 3.0)
    # one after the other the three would take 250 ms; side by side about 150
    assert start.elapsed_time(step_done) < 210, start.elapsed_time(step_done)
    assert start.elapsed_time(side_done) < 210, start.elapsed_time(side_done)
    # at apply the compute stream waits for the launch's work
    assert start.elapsed_time(applied) >= start.elapsed_time(side_done) - 1.0
    assert cs.in_flight == 0


def test_host_wait_waits_for_the_collectives_alone() -> None:
    device = _gpu()
    cpm = _cycles_per_ms()
    other = torch.cuda.Stream(device)
    with torch.cuda.stream(other):
        _spin(50, cpm)  # the collective, on its own stream
        collective_done = other.record_event()

    class Work:  # waits as an NCCL handle does: the current stream waits for its end
        def wait(self) -> bool:
            torch.cuda.current_stream().wait_event(collective_done)
            return True

    _spin(1000, cpm)  # the compute queued before the wait
    compute_done = torch.cuda.current_stream().record_event()
    host_wait([Work()], device)
    assert collective_done.query()
    assert not compute_done.query()  # the host did not wait for a second of compute
    torch.cuda.synchronize()


def test_collective_timer_and_devices_of_a_gpu_group(world_of_one: None) -> None:
    assert collective_device() == torch.device("cpu")  # a group that takes CPU tensors too
    nccl = dist.new_group(backend="nccl")
    assert collective_device(nccl) == _gpu()
    x = torch.ones(1 << 20, device=_gpu())
    timer = CollectiveTimer(_gpu())
    work = dist.all_reduce(x, group=nccl, async_op=True)
    assert work is not None
    timer.launched([work])
    host_wait([work], _gpu())
    seconds = timer.seconds()
    assert seconds is not None and 0.0 <= seconds < 10.0
    assert torch.all(x == 1.0)


def test_copies_futures_clock_and_memory_on_the_gpu() -> None:
    device = _gpu()
    cpm = _cycles_per_ms()
    x = torch.arange(1000, dtype=torch.float32)
    on_gpu = to_device(x, device)
    x.fill_(-1.0)  # the source may change at once: the transfer reads a pinned copy
    assert torch.equal(on_gpu.cpu(), torch.arange(1000, dtype=torch.float32))
    staging = HostStaging(on_gpu)
    assert staging.host is not None and staging.host.is_pinned()
    host = staging.download(on_gpu * 2)
    assert host is staging.host
    ready = staging.ready()
    assert ready is not None and torch.equal(ready, torch.arange(1000.0) * 2)
    ready.add_(1.0)  # a CPU collective's result, written in place
    back = torch.empty_like(on_gpu)
    staging.upload(back)
    staging.writable()
    assert torch.equal(back.cpu(), torch.arange(1000.0) * 2 + 1)
    fut = device_future(on_gpu)
    fut.set_result(on_gpu)
    assert torch.equal(fut.then(lambda f: f.value() + 1).wait().cpu(), torch.arange(1000.0) + 1)
    clock = device_clock(device)
    t0 = clock()
    _spin(100, cpm)
    assert clock() - t0 >= 0.05  # the reading waited for the kernel (not microseconds)
    peak = peak_memory_allocated(device)
    assert peak is not None and peak >= 4000


def test_finiteness_check_on_the_gpu() -> None:
    tensors = [torch.randn(100, device=_gpu()) for _ in range(5)] + [torch.empty(0, device=_gpu())]
    assert all_finite(tensors)
    tensors[3][17] = float("nan")
    assert not all_finite(tensors)


def test_bf16_autocast_on_the_gpu() -> None:
    device = _gpu()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)).to(device)
    x = torch.randint(64, (4, 16), device=device)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        logits, loss = model(x, x)
    assert logits.dtype == torch.bfloat16 and loss is not None and loss.dtype == torch.float32
    loss.backward()
    assert all(p.dtype == torch.float32 and p.grad is not None for p in model.parameters())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# --- jobs -----------------------------------------------------------------------------------------

ONE_GPU_JOBS = {
    # bf16, stochastic rounding on the GPU's generator, the emulated link and its tuning
    "co2-bf16-int4sr": ["--algo", "co2", "--precision", "bf16", "--compression", "int4:sr"],
    "demo": ["--algo", "demo"],  # the DCT on the GPU
    "ddp-int8": ["--algo", "ddp", "--compression", "int8"],  # the compressed DDP hook's future
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(ONE_GPU_JOBS))
def test_one_gpu_job(train_job: Any, tmp_path: Any, name: str) -> None:
    out = tmp_path / name
    summary = train_job(
        *ONE_GPU_JOBS[name],
        *tiny_job_args(workers=1),
        "--backend",
        "nccl",
        "--link",
        "100mbit",
        out=out,
    )
    assert summary["status"] == "finished"
    assert math.isfinite(summary["val_loss_final"])
    peaks = summary["peak_gpu_memory_bytes"]
    assert isinstance(peaks, list) and len(peaks) == 1 and peaks[0] > 0
    resolved = json.loads((out / "config.json").read_text())["resolved"]
    assert "nccl" in resolved["backend"]


def _two_workers_on_gpus(out: Any, summary: dict[str, Any]) -> None:
    """A two-worker job ran in this machine's layout: both workers on a GPU, over
    :data:`TWO_WORKER_BACKEND` (gloo when they share the one GPU)."""
    assert summary["status"] == "finished" and summary["workers"] == 2
    peaks = summary["peak_gpu_memory_bytes"]
    assert isinstance(peaks, list) and len(peaks) == 2 and all(p and p > 0 for p in peaks)
    backend = json.loads((out / "config.json").read_text())["resolved"]["backend"]
    assert TWO_WORKER_BACKEND in backend and ("nccl" in backend) == (TWO_WORKER_BACKEND == "nccl")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("algo", ["co2", "demo", "ddp"])
def test_two_worker_job_ends_with_identical_replicas(
    train_job: Any, tmp_path: Any, algo: str
) -> None:
    # --backend auto: on one GPU the two workers share it over gloo, on two each has its own
    out = tmp_path / algo
    summary = train_job("--algo", algo, *tiny_job_args(workers=2, steps=24), out=out)
    _two_workers_on_gpus(out, summary)
    assert summary["replicas_identical"]  # DeMo's too: every rank decodes the same bits
    assert math.isfinite(summary["val_loss_final"])


@pytest.mark.timeout(600)
def test_co2_hides_an_emulated_links_transfers_behind_compute(
    train_job: Any, tmp_path: Any
) -> None:
    out = tmp_path / "co2"
    summary = train_job(
        "--algo",
        "co2",
        *tiny_job_args(workers=2, steps=48, sync_every=12, eval_every=12),
        "--link",
        "100mbit",
        out=out,
    )
    _two_workers_on_gpus(out, summary)
    comm = summary["comm_mean"]
    assert comm["in_flight_s"] > 0
    assert comm["hidden_fraction"] is not None and comm["hidden_fraction"] > 0
    assert summary["replicas_identical"]


LEARNS_LIKE_THE_CPU = 0.01
"""How far (nats) the GPU job's validation loss may be from the CPU job's at each evaluation.
Both compute the same fp32 arithmetic on the same data and initial weights (the batches and
the initial weights are drawn on the CPU; no dropout, no TF32), so they differ by rounding
alone: the CPU job with its vectorised kernels turned off (ATEN_CPU_CAPABILITY=default, a
rounding-level change of every reduction's order) moves these losses by at most 4e-5, while
another seed (other data, other initial weights) moves them by up to 0.04 and training lowers
them by 2.4 (5.47 to 3.11). 0.01 is 250 times the rounding and a quarter of another seed's
spread: a GPU job that lost updates (a collective that did not average, a stale merge) is
outside it."""


@pytest.mark.timeout(600)
def test_two_workers_sharing_a_gpu_learn_as_on_the_cpu(train_job: Any, tmp_path: Any) -> None:
    job = ["--algo", "co2", *tiny_job_args(workers=2, steps=48, eval_every=12, dropout=0.0)]
    job += ["--eval-batches", "4"]
    curves = {}
    for device in ("cuda", "cpu"):
        out = tmp_path / device
        summary = train_job(*job, "--backend", "gloo", "--device", device, out=out)
        assert summary["status"] == "finished" and summary["replicas_identical"]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        curves[device] = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
        if device == "cuda":  # both on GPUs (on one GPU, the same one)
            peaks = summary["peak_gpu_memory_bytes"]
            assert len(peaks) == 2 and all(p and p > 0 for p in peaks)
    assert sorted(curves["cuda"]) == sorted(curves["cpu"]) == [0, 12, 24, 36, 48]
    for step, loss in curves["cpu"].items():
        assert abs(curves["cuda"][step] - loss) <= LEARNS_LIKE_THE_CPU, (step, curves)
    gpu = read_summary(tmp_path / "cuda")
    assert gpu["val_loss_final"] < gpu["val_loss_initial"] - 1.0  # it learns


# --- the library on NCCL alone (2 GPUs, one process each) -----------------------------------------


def _mlp(device: torch.device, width: int = 256) -> torch.nn.Module:
    """The same model on every rank (seeded), on ``device``."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.Tanh(), torch.nn.Linear(width, 64)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.to(device)


def _train_step(model: torch.nn.Module, inner: torch.optim.Optimizer, rank: int, step: int) -> None:
    """One inner step on this rank's batch of ``step`` (drawn on the CPU: the same on every
    run of the rank)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(128, 64, generator=g).to(_gpu())
    loss = ((model(x) - x.flip(1)) ** 2).mean()
    loss.backward()
    inner.step()
    inner.zero_grad(set_to_none=True)


def pure_nccl_co2(rank: int, world: int, compression: str) -> dict[str, Any]:
    """CO2 as a library user runs it on ``init_process_group("nccl")`` (no gloo beside it):
    24 steps, ``finish()`` (the step counts compared across the ranks), a barrier."""
    import lowcomm
    from lowcomm.comm import spin_barrier

    model = _mlp(_gpu())
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    algo = lowcomm.CO2(model, inner, sync_every=6, compression=compression)
    for step in range(1, 25):
        _train_step(model, inner, rank, step)
        algo.step()
    algo.finish()
    spin_barrier()
    return {
        "backend": str(dist.get_backend()),
        "control": str(collective_device(algo.comm)),
        "anchor": [v.detach().cpu() for v in algo.anchor_views],
        "params": [p.detach().cpu() for p in model.parameters()],
        "in_flight_s": algo.stats.in_flight_s,
    }


@TWO_GPUS
@pytest.mark.timeout(300)
@pytest.mark.parametrize("compression", ["int8", "lgreco:int"])
def test_a_library_run_on_a_pure_nccl_group(compression: str) -> None:
    from lowcomm.testing import run_workers

    ranks = run_workers(pure_nccl_co2, 2, compression, backend="nccl", timeout_s=240)
    for r, out in enumerate(ranks):
        assert out["backend"] == "nccl" and out["control"] == f"cuda:{r}"
        assert out["in_flight_s"] > 0
        # θ = A after finish(), and A is the same bits on every rank
        assert all(torch.equal(p, a) for p, a in zip(out["params"], out["anchor"]))
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["anchor"], ranks[1]["anchor"]))


SIDE_STREAM_CASES: list[dict[str, Any]] = [{}, {"compression": "int8"}]
SIDE_STREAM_CASES += [{"eager": True, "compression": "int8"}]


def co2_side_stream_and_inline(rank: int, world: int) -> list[dict[str, list[torch.Tensor]]]:
    """Each case of :data:`SIDE_STREAM_CASES` over 3 rounds of CO2, with its launches on the
    side stream (as built) and inline on the compute stream (a CPU ``CommStream`` in its
    place): the parameters and anchors at every round boundary and after ``finish()``. A
    wide model, so that the side stream's work and the next step overlap for real."""
    import lowcomm

    out = []
    for hyper in SIDE_STREAM_CASES:
        runs: dict[str, list[torch.Tensor]] = {}
        for wired in (True, False):
            model = _mlp(_gpu(), width=16384)
            inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
            algo = lowcomm.CO2(model, inner, sync_every=4, **hyper)
            if not wired:
                algo.comm_stream = CommStream("cpu")
            assert algo.comm_stream.active == wired
            seen: list[torch.Tensor] = []
            for step in range(1, 13):
                _train_step(model, inner, rank, step)
                algo.step()
                if step % 4 == 0:
                    seen += [p.detach().cpu() for p in model.parameters()]
                    seen += [v.detach().cpu() for v in algo.anchor_views]
            algo.finish()
            seen += [p.detach().cpu() for p in model.parameters()]
            assert algo.comm_stream.in_flight == 0
            runs["wired" if wired else "inline"] = seen
        out.append(runs)
    return out


@pytest.mark.timeout(300)
def test_co2_on_the_side_stream_matches_launching_inline() -> None:
    from lowcomm.testing import run_workers

    ranks = run_workers(
        co2_side_stream_and_inline, 2, backend=TWO_WORKER_BACKEND, cuda=True, timeout_s=240
    )
    for rank in ranks:
        for hyper, runs in zip(SIDE_STREAM_CASES, rank):
            assert len(runs["wired"]) == len(runs["inline"]), hyper
            for a, b in zip(runs["wired"], runs["inline"]):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=str(hyper))


def nccl_in_flight(rank: int, world: int) -> dict[str, float]:
    """A mean all-reduce and a compressed mean on NCCL, each with a second of compute queued
    on the compute stream after its launch: their time in flight, blocked, and the results."""
    cpm = _cycles_per_ms()
    comm = Communicator()
    x = torch.full((1 << 24,), float(rank + 1), device=_gpu())  # 64 MiB
    dist.barrier()
    torch.cuda.synchronize()
    handle = comm.all_reduce_mean_async([x])
    _spin(1000, cpm)  # the next inner step: not part of the collective
    handle.wait()
    plain = {"in_flight_s": comm.stats.in_flight_s, "blocked_s": comm.stats.blocked_s}
    mean_ok = bool(torch.all(x == 1.5))
    shapes = [torch.Size([1024, 1024]), torch.Size([4096])]
    buckets = FlatBuckets(shapes, bucket_cap_mb=2.0, device=_gpu())  # two buckets
    buckets.copy_from([torch.ones(s, device=_gpu()) for s in shapes])
    comp = Compressor("int8", shapes, rank=rank, device=_gpu())
    dist.barrier()
    torch.cuda.synchronize()
    before = comm.stats.in_flight_s
    compressed = comm.compressed_mean_async(buckets, comp)
    _spin(1000, cpm)
    compressed.wait()
    return {
        **plain,
        "mean_ok": float(mean_ok),
        "compressed_in_flight_s": comm.stats.in_flight_s - before,
        "compressed_ok": float(all(torch.allclose(v, torch.ones_like(v)) for v in buckets.views)),
    }


def gloo_launch_and_wait(rank: int, world: int) -> dict[str, float]:
    """A mean all-reduce of 128 MiB of CUDA tensors on gloo (after two to warm its buffers
    and connections): the seconds its launch took, the seconds to its end, and the result."""
    comm = Communicator()
    x = torch.full((1 << 25,), float(rank + 1), device=_gpu())
    for _ in range(2):
        comm.all_reduce_mean_async([x.clone()]).wait()
    y = x.clone()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    handle = comm.all_reduce_mean_async([y])
    launched = time.perf_counter() - t0
    handle.wait()
    torch.cuda.synchronize()
    return {
        "launch_s": launched,
        "total_s": time.perf_counter() - t0,
        "mean_ok": float(bool(torch.all(y == 1.5))),
        "in_flight_s": comm.stats.in_flight_s,
    }


@pytest.mark.timeout(300)
def test_a_gloo_collective_on_cuda_tensors_is_launched_without_waiting_for_it() -> None:
    # workers sharing a GPU: gloo runs the collective on its own threads, and the launch
    # returns at once (its handle is not waited on a timing stream, which would block the
    # host there, as gloo's wait does)
    from lowcomm.testing import run_workers

    for out in run_workers(gloo_launch_and_wait, 2, backend="gloo", cuda=True, timeout_s=240):
        assert out["mean_ok"]
        assert out["launch_s"] < 0.5 * out["total_s"], out
        assert out["in_flight_s"] > 0


@TWO_GPUS
@pytest.mark.timeout(300)
def test_collectives_are_timed_on_the_device_without_a_link() -> None:
    from lowcomm.testing import run_workers

    for out in run_workers(nccl_in_flight, 2, backend="nccl", timeout_s=240):
        assert out["mean_ok"] and out["compressed_ok"]
        # the device's time from launch to completion (the NCCL future completes when queued)
        assert 0.0 < out["in_flight_s"] < 10.0
        assert 0.0 < out["compressed_in_flight_s"] < 10.0
        # the wait blocked for the collective, not for the second of compute queued before it
        assert out["blocked_s"] < 0.5, out


def test_zo_offload_on_the_gpu_is_the_resident_step_bit_for_bit() -> None:
    """ZO2's offloading on CUDA: the blocks in pinned host memory, uploaded and copied back on
    two copy streams ordered by events, give the same L+, L-, g and parameters as the
    blockwise step with the model resident on the GPU; the GPU holds at most the two buffers'
    blocks (peak memory under the resident run's)."""
    from lowcomm.zo import MeZO

    def run(offload: bool) -> tuple[list[Any], dict[str, torch.Tensor], int]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # the GPU's memory from here: model and step
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=256))
        if not offload:
            model.to(_gpu())
        zo = MeZO(model, lr=1e-4, eps=1e-3, weight_decay=0.1, blockwise=True, offload=offload)
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 256, (4, 64), generator=g).to(_gpu())
        y = torch.randint(0, 256, (4, 64), generator=g).to(_gpu())
        steps = [zo.step(stages=model.zo_stages(x, y)) for _ in range(4)]
        zo.flush()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        if offload:
            assert zo.offloader is not None and zo.offloader.max_resident == 2
            assert all(p.is_pinned() for b in model.blocks for p in b.parameters())
        params = {n: p.detach().cpu() for n, p in model.named_parameters()}
        return [(s.loss_plus, s.loss_minus, s.projected_grads) for s in steps], params, peak

    resident, offloaded = run(False), run(True)
    assert resident[0] == offloaded[0]
    assert resident[1].keys() == offloaded[1].keys()
    assert all(torch.equal(resident[1][k], offloaded[1][k]) for k in resident[1])
    assert offloaded[2] < resident[2]
