"""Where ``lowcomm train``'s workers compute and over which backend
(:func:`lowcomm.train.worker.place_workers`), checked as scheduling logic on the CPU: the number
of visible GPUs is a parameter, or ``torch.cuda.is_available`` / ``device_count`` are replaced
(for the placement alone: nothing here runs on a GPU). Also what the CPU can check of the
shared-GPU layout's helpers: devices compared by type and index, the control tensors' device of
a gloo group, a gloo launch that is not timed on the device, and the test harness's rules.
``test_cuda.py`` runs the layout itself where a GPU is visible."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lowcomm.device as device_mod
import lowcomm.train.worker as worker_mod
from lowcomm.device import (
    CollectiveTimer,
    canonical_device,
    collective_device,
    completes_on_device,
    same_device,
)
from lowcomm.testing import run_workers
from lowcomm.train.config import ConfigError, TrainConfig
from lowcomm.train.preflight import check_environment, local_placement, resource_warnings
from lowcomm.train.worker import Placement, place_workers, usable_cores

CPU = torch.device("cpu")


def cuda(i: int) -> torch.device:
    return torch.device("cuda", i)


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``set(n)``: make this process see ``n`` CUDA devices (0: no CUDA), for the placement's
    own queries; nothing may run on them."""

    def set_gpus(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_gpus


# --- the rule -------------------------------------------------------------------------------------

PLACEMENTS = [
    # (backend, device, workers, GPUs) -> (backend, devices of local ranks 0..workers-1)
    (("auto", "auto", 2, 0), ("gloo", [CPU, CPU])),
    (("gloo", "auto", 2, 0), ("gloo", [CPU, CPU])),
    (("auto", "auto", 1, 1), ("nccl", [cuda(0)])),
    (("auto", "auto", 2, 2), ("nccl", [cuda(0), cuda(1)])),
    (("auto", "auto", 2, 8), ("nccl", [cuda(0), cuda(1)])),
    # fewer GPUs than workers: gloo, worker k on GPU k mod G
    (("auto", "auto", 2, 1), ("gloo", [cuda(0), cuda(0)])),
    (("auto", "auto", 5, 2), ("gloo", [cuda(0), cuda(1), cuda(0), cuda(1), cuda(0)])),
    (("auto", "cuda", 3, 1), ("gloo", [cuda(0)] * 3)),
    # gloo asked for with CUDA present: the GPUs are used, k mod G
    (("gloo", "auto", 2, 2), ("gloo", [cuda(0), cuda(1)])),
    (("gloo", "cuda", 3, 2), ("gloo", [cuda(0), cuda(1), cuda(0)])),
    (("nccl", "auto", 2, 2), ("nccl", [cuda(0), cuda(1)])),
    (("nccl", "cuda", 1, 4), ("nccl", [cuda(0)])),
    # the CPU asked for on a machine with GPUs
    (("auto", "cpu", 2, 4), ("gloo", [CPU, CPU])),
    (("gloo", "cpu", 3, 1), ("gloo", [CPU] * 3)),
]


@pytest.mark.parametrize(("given", "expected"), PLACEMENTS, ids=str)
def test_workers_are_placed_by_the_rule(given: Any, expected: Any) -> None:
    backend, device, workers, gpus = given
    placement = place_workers(backend, workers, device=device, gpus=gpus)
    assert placement.backend == expected[0]
    assert [placement.device(k) for k in range(workers)] == expected[1]
    assert placement.on_gpu == (expected[1][0].type == "cuda")
    assert placement.shares_gpus == (len(set(expected[1])) < workers and placement.on_gpu)


REFUSED = [
    # (backend, device, workers, GPUs) -> (key, fragments of the message)
    (
        ("nccl", "auto", 3, 2),
        ("workers", ["(3) exceeds the 2 CUDA device(s)", "use --backend gloo", "at most 2"]),
    ),
    (("nccl", "auto", 2, 1), ("workers", ["refuses two on one device", "cuda:k mod 1"])),
    (("nccl", "auto", 1, 0), ("backend", ["needs CUDA GPUs and none is available"])),
    (("nccl", "cpu", 1, 4), ("backend", ["device is 'cpu'", "use gloo or auto"])),
    (("auto", "cuda", 2, 0), ("device", ["'cuda' needs a CUDA device", "use cpu or auto"])),
    (("auto", "tpu", 2, 0), ("device", ["must be one of auto, cpu, cuda"])),
]


@pytest.mark.parametrize(("given", "expected"), REFUSED, ids=str)
def test_a_placement_that_cannot_be_is_refused_naming_the_fix(given: Any, expected: Any) -> None:
    backend, device, workers, gpus = given
    with pytest.raises(ConfigError) as info:
        place_workers(backend, workers, device=device, gpus=gpus)
    key, fragments = expected
    assert info.value.key == key
    for fragment in fragments:
        assert fragment in info.value.problem, (fragment, info.value.problem)


def test_the_visible_gpus_are_counted_when_not_given(gpus: Any) -> None:
    gpus(1)
    assert place_workers("auto", 2) == Placement("gloo", 1, 2)
    assert place_workers("auto", 1) == Placement("nccl", 1, 1)
    gpus(0)
    assert place_workers("auto", 2) == Placement("gloo", 0, 2)
    with pytest.raises(ConfigError):
        place_workers("nccl", 1)


def test_the_cores_are_shared_among_the_workers_of_a_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the cores this process may run on (a container's share), not the machine's
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert usable_cores() == 6
    assert Placement("gloo", 1, 2).threads() == 3  # two workers sharing a GPU: half each
    assert Placement("nccl", 8, 4).threads(cores=16) == 4
    assert Placement("gloo", 0, 5).threads(cores=16) == 3
    assert Placement("gloo", 0, 9).threads(cores=4) == 1  # never 0


def test_placements_describe_themselves() -> None:
    assert Placement("gloo", 1, 2).describe() == (
        "2 workers share 1 GPU over gloo (worker k on cuda:k mod 1, up to 2 a GPU)"
    )
    assert Placement("nccl", 2, 2).describe() == (
        "2 workers, one GPU each (worker k on cuda:k), over nccl"
    )
    assert Placement("gloo", 0, 1).describe() == "1 worker on the CPU over gloo"


# --- the job's checks before the workers start -------------------------------------------------


def test_preflight_places_the_workers_of_a_local_launch_and_under_torchrun(
    gpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus(1)
    cfg = TrainConfig(workers=2)
    assert local_placement(cfg) == Placement("gloo", 1, 2)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun's processes on this machine
    assert local_placement(cfg) == Placement("nccl", 1, 1)


def test_preflight_refuses_nccl_on_more_workers_than_gpus(gpus: Any, tmp_path: Any) -> None:
    gpus(1)
    cfg = TrainConfig(workers=2, backend="nccl", out=str(tmp_path / "run"))
    with pytest.raises(ConfigError) as info:
        check_environment(cfg)
    assert info.value.key == "workers" and "use --backend gloo" in info.value.problem
    # auto on the same machine: the workers share the GPU, nothing to refuse
    check_environment(TrainConfig(workers=2, out=str(tmp_path / "auto")))


def test_noloco_is_refused_where_gloo_would_carry_its_cuda_tensors(
    gpus: Any, tmp_path: Any
) -> None:
    gpus(1)
    cfg = TrainConfig(algo="noloco", workers=2, out=str(tmp_path / "run"))
    with pytest.raises(ConfigError) as info:
        check_environment(cfg)
    assert info.value.key == "algo" and "--device cpu" in info.value.problem
    # on the CPU, or with a GPU for each worker, it runs
    check_environment(TrainConfig(algo="noloco", workers=2, device="cpu", out=str(tmp_path / "c")))
    gpus(2)
    check_environment(TrainConfig(algo="noloco", workers=2, out=str(tmp_path / "g")))


def test_the_cli_names_the_fix_for_nccl_on_a_shared_gpu(
    gpus: Any, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from lowcomm.cli import main

    gpus(1)
    code = main(["train", "--backend", "nccl", "--workers", "2", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2
    assert "--workers (2) exceeds the 1 CUDA device(s)" in err and "use --backend gloo" in err


def test_device_is_a_setting_checked_with_the_backend() -> None:
    assert TrainConfig().device == "auto"
    with pytest.raises(ConfigError) as info:
        TrainConfig(device="gpu")
    assert info.value.key == "device" and "must be one of auto, cpu, cuda" in str(info.value)
    with pytest.raises(ConfigError) as info:
        TrainConfig(device="cpu", backend="nccl")
    assert info.value.key == "backend"


def test_workers_on_gpus_are_not_warned_about_cores() -> None:
    cores = usable_cores()
    assert resource_warnings(cores + 1, parameters=1000, cpu_workers=True)
    assert not resource_warnings(cores + 1, parameters=1000, cpu_workers=False)


# --- a worker places itself ---------------------------------------------------------------------


@pytest.fixture
def restored_process_state() -> Iterator[None]:
    """The worker sets up the lowcomm loggers and torch's threads: put both back."""
    root = logging.getLogger("lowcomm")
    saved = (root.level, list(root.handlers), root.propagate, torch.get_num_threads())
    try:
        yield
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        root.propagate = saved[2]
        torch.set_num_threads(saved[3])


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("restored_process_state")
def test_a_worker_takes_the_gpu_of_its_local_rank_mod_the_gpus(
    gpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # local rank 3 of 4 on a machine with 2 GPUs: cuda:1, over gloo (a world of one here, on
    # the CPU: nothing is put on the device)
    gpus(2)
    chosen: list[torch.device] = []
    monkeypatch.setattr(worker_mod.torch.cuda, "set_device", chosen.append)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}
    # env:// joins this test's store (as torchrun's workers join their agent's)
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    env |= {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    seen: dict[str, Any] = {}

    def job(cfg: Any, *, device: torch.device) -> dict[str, Any]:
        seen["device"] = device
        seen["backend"] = dist.get_backend()
        return {}

    worker_mod.run_worker(TrainConfig(workers=4, quiet=True), False, None, job)
    assert chosen == [cuda(1)] and seen == {"device": cuda(1), "backend": "gloo"}


# --- the device helpers of the layout -----------------------------------------------------------


def test_devices_compare_by_type_and_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert canonical_device("cuda") == cuda(0)
    assert same_device(torch.device("cuda"), "cuda:0")
    assert torch.device("cuda") != cuda(0)  # what the objects alone say
    assert same_device("cpu", CPU) and not same_device("cpu", "cuda:0")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert not same_device("cuda", "cuda:0") and same_device("cuda", cuda(1))


@pytest.mark.parametrize(
    ("backend", "control", "on_device"),
    [
        ("gloo", CPU, False),  # workers sharing a GPU: CUDA tensors go through the host
        ("cpu:gloo,cuda:nccl", CPU, True),
        ("nccl", cuda(2), True),
    ],
)
def test_what_a_group_does_with_cuda_tensors(
    monkeypatch: pytest.MonkeyPatch, backend: str, control: torch.device, on_device: bool
) -> None:
    monkeypatch.setattr(device_mod.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(device_mod.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert collective_device() == control
    assert completes_on_device() is on_device


def test_no_group_completes_nothing_on_the_device() -> None:
    assert not dist.is_initialized()
    assert completes_on_device() is False


@pytest.mark.usefixtures("single_rank_group")
def test_a_gloo_collective_is_not_timed_on_the_device() -> None:
    # gloo's wait() blocks the host until the collective is done: timing it on a CUDA stream
    # at its launch would make every launch blocking. The timer leaves it to the handle's
    # future (and touches no CUDA API, which would fail here)
    work = dist.all_reduce(torch.ones(4), async_op=True)
    assert work is not None
    timer = CollectiveTimer("cuda:0")
    timer.launched([work])
    work.wait()
    assert timer.seconds() is None


# --- the test harness ---------------------------------------------------------------------------


def _device_of(rank: int, world: int) -> str:
    return str(torch.device("cuda", torch.cuda.current_device()))


def test_the_harness_refuses_a_layout_it_cannot_give(gpus: Any) -> None:
    gpus(0)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        run_workers(_device_of, 2, backend="gloo", cuda=True)
    gpus(1)
    with pytest.raises(ValueError, match="use backend='gloo', cuda=True"):
        run_workers(_device_of, 2, backend="nccl")
