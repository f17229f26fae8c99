"""The sync path's host work, seen on the CPU with torch.profiler (a structural check of what the
host asks of the device, not a timing).

On a GPU every host read of a device value (``.item()``, ``bool(tensor)``, ``nonzero``) waits for
the queue the outer algorithm exists to keep full, and every operation dispatched per parameter
tensor is host time a model of many tensors pays on each sync. Here, on a real one-rank gloo
group (the codecs, error feedback and collectives run as in a world of two):

* (a) the ``step()`` calls of a whole round, its launch and apply included, contain no
  ``aten::_local_scalar_dense``, ``aten::item``, ``aten::nonzero`` or ``aten::lift_fresh`` (a
  tensor made from host data, copied to the device and waited for there) event, for every outer
  algorithm of the registry, every codec, the warm start (fp32 and through a codec; at the
  optimizer's step and during backward, as ``lowcomm train`` runs it) and DeMo's step. The
  guards' verdicts are decided on the device and read from host memory
  (:class:`lowcomm.guard.HostFlags`): a copy queued on the device, no ``.item()``;
* (b) the number of aten operations lowcomm dispatches in a round's ``step()`` calls does not
  grow with the number of parameter tensors: a model of 4 tensors against one of 64 with the
  same total size, equal counts, for every outer algorithm's sync, uncompressed and with every
  codec that travels by all-gather (the quantisers with and without stochastic rounding, sign,
  top-k, bf16: :mod:`lowcomm.compress.flat`), and the warm start, fp32 and through a codec.
  The codecs run torch's operations in these checks, as on a GPU (on the CPU top-k selects
  and the quantisers pack their codes with NumPy, which has no device to wait for).
  PowerSGD (a matrix product per tensor) and L-GreCo (its choice depends on the tensors'
  sizes) are not in (b). Operations are counted at the top level: a ``_foreach_`` operation
  over many tensors counts once (on CUDA it launches one kernel per few dozen tensors; on the
  CPU torch runs it as a loop of per-tensor operations, which are its children here).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import lowcomm
from lowcomm import schedules
from lowcomm.registry import REGISTRY

pytestmark = pytest.mark.usefixtures("single_rank_group", "device_selection")


@pytest.fixture
def device_selection(monkeypatch: Any) -> None:
    """The codecs run torch's operations here, as on a GPU: on the CPU lowcomm selects top-k's
    values and packs codes with NumPy (:data:`lowcomm.compress.formats.NUMPY_ON_CPU`), host
    work with no device to wait for, which is not the path these checks are about."""
    from lowcomm.compress import formats

    monkeypatch.setattr(formats, "NUMPY_ON_CPU", False)


H = 4
NUMEL = 8192  # 4 tensors of 2,048 values, or 64 of 128: whole blocks either way
HOST_READS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::lift_fresh")
"""Reads of a device value by the host, and tensors made from host data (``torch.tensor(v,
device=...)``, ``aten::lift_fresh``): on a GPU a copy from pageable host memory, which waits for
the device's queue as a read does."""

OUTER = {name: entry for name, entry in REGISTRY.items() if entry.cls is not None}
FLAT_CODECS = ("int8", "int4", "int2", "int4:sr", "sign", "topk:0.1", "bf16")
CODECS = (*FLAT_CODECS, "powersgd:2", "lgreco:int")


def _model(tensors: int, per: int | None = None) -> torch.nn.ParameterList:
    """``tensors`` parameter tensors of ``NUMEL`` values in all (or of ``per`` values each)."""
    g = torch.Generator().manual_seed(0)
    per = NUMEL // tensors if per is None else per
    return torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(per, generator=g)) for _ in range(tensors)]
    )


def _build(name: str, model: torch.nn.ParameterList, **extra: Any) -> lowcomm.OuterAlgorithm:
    entry = OUTER[name]
    assert entry.cls is not None
    kwargs: dict[str, Any] = {"sync_every": H, **entry.fixed, **extra}
    if entry.schedule is schedules.FRAGMENTS:
        half = len(model) // 2
        kwargs.update(fragments=[list(model)[:half], list(model)[half:]], overlap=1)
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    return entry.cls(model, inner, **kwargs)


def _inner_step(model: torch.nn.ParameterList, algo: lowcomm.OuterAlgorithm, g: Any) -> None:
    for p in model:
        p.grad = torch.randn(p.shape, generator=g) * 0.01
    algo.before_inner_step()
    algo.inner.step()


def _round_events(algo: lowcomm.OuterAlgorithm, model: torch.nn.ParameterList) -> list[Any]:
    """The profiler's events of the ``step()`` calls of one round (a launch and an apply),
    after the warm start and two rounds."""
    g = torch.Generator().manual_seed(1)
    for _ in range(algo.warmup + 2 * H):
        _inner_step(model, algo, g)
        algo.step()
    events: list[Any] = []
    for _ in range(H):
        _inner_step(model, algo, g)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            algo.step()
        events += list(prof.events())
    algo.finish()
    return events


def _warm_events(model: torch.nn.ParameterList, compression: str | None) -> list[Any]:
    """The events of one warm-start step (the mean before the inner step, and ``step()``)."""
    algo = _build("co2", model, sync_warmup=8, sync_warmup_compression=compression)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        _inner_step(model, algo, g)
        algo.step()
    for p in model:
        p.grad = torch.randn(p.shape, generator=g) * 0.01
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        algo.before_inner_step()
        algo.inner.step()
        algo.step()
    return list(prof.events())


def _warm_backward_events(model: torch.nn.ParameterList, compression: str | None) -> list[Any]:
    """The events of one warm-start step that overlaps backward, as ``lowcomm train`` runs it
    (:meth:`lowcomm.OuterAlgorithm.warm_start_during_backward`): backward, whose gradients'
    hooks launch the means a bucket at a time, the optimizer's step, which waits for them, and
    ``step()``."""
    algo = _build("co2", model, sync_warmup=8, sync_warmup_compression=compression)
    algo.warm_start_during_backward(bucket_cap_mb=0.01, first_bucket_mb=0.004)
    g = torch.Generator().manual_seed(1)
    targets = [torch.randn(p.shape, generator=g) for p in model]

    def backward() -> None:
        sum(((p - t) ** 2).sum() for p, t in zip(model, targets)).backward()

    for _ in range(2):
        backward()
        algo.inner.step()
        algo.inner.zero_grad()
        algo.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        backward()
        launched = [b.handle is not None for b in algo.warm.buckets]
        algo.inner.step()
        algo.step()
    # (every bucket went out during backward: the launches are in these events)
    assert len(launched) > 2 and all(launched), launched
    return list(prof.events())


def host_reads(events: list[Any]) -> dict[str, list[str]]:
    """Each host read among ``events``, with the calls it was made under."""
    out: dict[str, list[str]] = collections.defaultdict(list)
    for e in events:
        if e.name in HOST_READS:
            chain, parent = [], e.cpu_parent
            while parent is not None and len(chain) < 6:
                chain.append(parent.name)
                parent = parent.cpu_parent
            out[e.name].append(" <- ".join(chain))
    return dict(out)


def top_level_ops(events: list[Any], *, skip: Callable[[Any], bool] | None = None) -> int:
    """aten operations not dispatched by another aten operation (see the module docstring);
    ``skip``: events whose operations are not lowcomm's (the inner optimizer's step)."""

    def counted(e: Any) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::") or (skip is not None and skip(parent)):
                return False
            parent = parent.cpu_parent
        return not (skip is not None and skip(e))

    return sum(1 for e in events if e.name.startswith("aten::") and counted(e))


def _cases(
    codecs: tuple[str, ...] = CODECS, coded: tuple[str, ...] = tuple(OUTER)
) -> Iterator[Any]:
    """Every outer algorithm uncompressed; those of ``coded`` with each of ``codecs``."""
    for name, entry in OUTER.items():
        assert entry.cls is not None
        yield pytest.param(name, None, id=f"{name}-none")
        if entry.compressible and name in coded:
            for codec in codecs:
                try:  # (a codec the algorithm refuses: eager CO2 and PowerSGD's two phases)
                    entry.cls.validate(sync_every=H, compression=codec, **entry.fixed)
                except ValueError:
                    continue
                yield pytest.param(name, codec, id=f"{name}-{codec}")


@pytest.mark.parametrize("name,codec", list(_cases()))
def test_a_round_reads_nothing_back_from_the_device(name: str, codec: str | None) -> None:
    model = _model(16)
    extra = {} if codec is None else {"compression": codec}
    reads = host_reads(_round_events(_build(name, model, **extra), model))
    assert not reads, f"{name} with {codec}: host reads in a round: {reads}"


@pytest.mark.parametrize("compression", [None, "int8", "int2"])
def test_the_warm_start_reads_nothing_back_but_its_verdict(compression: str | None) -> None:
    reads = host_reads(_warm_events(_model(16), compression))
    assert not reads, f"warm start ({compression}): host reads: {reads}"


@pytest.mark.parametrize("compression", [None, "int8", "int2"])
def test_the_warm_start_during_backward_reads_nothing_back_but_its_verdict(
    compression: str | None,
) -> None:
    reads = host_reads(_warm_backward_events(_model(16), compression))
    assert not reads, f"warm start during backward ({compression}): host reads: {reads}"


def test_demo_steps_without_host_reads() -> None:
    model = _model(16)
    opt = lowcomm.DeMo(model.parameters(), lr=1e-3, compression_topk=4, compression_chunk=8)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in model:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    opt.finish()
    assert not host_reads(list(prof.events()))


# (the codecs run the same path in every algorithm: its schedules are enough here)
@pytest.mark.parametrize(
    "name,codec", list(_cases(FLAT_CODECS, ("co2", "co2-eager", "diloco", "streaming")))
)
def test_a_round_dispatches_as_many_operations_for_64_tensors_as_for_4(
    name: str, codec: str | None
) -> None:
    extra = {} if codec is None else {"compression": codec}
    counts = {}
    for tensors in (4, 64):
        model = _model(tensors)
        counts[tensors] = top_level_ops(_round_events(_build(name, model, **extra), model))
    assert counts[4] == counts[64], f"{name} with {codec}: {counts}"


@pytest.mark.parametrize("codec", FLAT_CODECS)
def test_tensors_that_pad_their_blocks_dispatch_alike(codec: str) -> None:
    # sizes that fill no whole block (nor whole bytes of int2 codes): the padded path, its
    # operations as many for 64 tensors as for 4
    counts = {}
    for tensors in (4, 64):
        model = _model(tensors, per=203)
        algo = _build("diloco", model, compression=codec)
        counts[tensors] = top_level_ops(_round_events(algo, model))
    assert counts[4] == counts[64], f"{codec}: {counts}"


@pytest.mark.parametrize("compression", [None, "int8", "int2"])
def test_the_warm_start_dispatches_as_many_operations_for_64_tensors_as_for_4(
    compression: str | None,
) -> None:
    def inner_step(e: Any) -> bool:  # the inner optimizer's own step is not lowcomm's
        return str(e.name).startswith("Optimizer.step#")

    counts = {
        n: top_level_ops(_warm_events(_model(n), compression), skip=inner_step) for n in (4, 64)
    }
    assert counts[4] == counts[64], counts


def test_the_checks_see_a_read_put_back_on_the_launch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checks above would fail on a launch that reads a value (``.item()``), makes a tensor
    from host data or loops over the tensors: each put back into the launch of DiLoCo, each
    seen."""
    import lowcomm.outer.fragment as fragment

    norm = fragment.flat_norm

    def reading(buffers: list[torch.Tensor]) -> torch.Tensor:
        out = norm(buffers)
        out.item()
        return out

    def copying(buffers: list[torch.Tensor]) -> torch.Tensor:
        return norm(buffers) * torch.tensor(1.0, device=buffers[0].device)

    for put_back, seen in ((reading, "aten::_local_scalar_dense"), (copying, "aten::lift_fresh")):
        monkeypatch.setattr(fragment, "flat_norm", put_back)
        model = _model(16)
        assert seen in host_reads(_round_events(_build("diloco", model), model))
        monkeypatch.undo()

    def per_tensor(out: Any, anchor: Any, params: Any) -> None:
        for o, a, p in zip(out, anchor, params):
            o.copy_(a - p)

    monkeypatch.setattr(fragment, "pseudo_gradient_", per_tensor)
    counts = []
    for tensors in (4, 64):
        model = _model(tensors)
        counts.append(top_level_ops(_round_events(_build("diloco", model), model)))
    assert counts[1] > counts[0]


def test_the_check_sees_a_read_in_a_launch_during_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read put back into the bucket launch that a gradient's hook makes during backward is
    seen, though autograd runs it."""
    from lowcomm.outer.warm import WarmStart

    launch = WarmStart._launch

    def reading(self: WarmStart, bucket: Any) -> None:
        launch(self, bucket)
        bucket.buf.buffers[0].abs().max().item()

    monkeypatch.setattr(WarmStart, "_launch", reading)
    reads = host_reads(_warm_backward_events(_model(16), "int8"))
    # (one a bucket, each inside the hook of the gradient that completed it)
    chains = reads.get("aten::_local_scalar_dense", [])
    assert chains and all("AccumulateGrad" in chain for chain in chains), reads
