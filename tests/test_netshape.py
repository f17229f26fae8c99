"""Real link shaping (lowcomm.netshape): namespaces, tbf qdiscs, gloo across the bridge, a real
``lowcomm train`` job, failures and cleanup. Tests that build networks need root and iproute2;
elsewhere they are skipped with the reason. Timing is never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import lowcomm.bench.netshape.network as netshape
from lowcomm.bench.netshape import (
    NETEM_UNAVAILABLE,
    NetshapeError,
    ShapedNetwork,
    launch_shaped,
    netem_available,
    tbf_parameters,
    unavailable_reason,
)
from lowcomm.train.config import TrainConfig, config_from_dict
from lowcomm.train.faults import FAULT_ENV
from lowcomm.train.launcher import WorkerFailed

_REASON = unavailable_reason()
requires_shaping = pytest.mark.skipif(
    _REASON is not None, reason=f"real link shaping unavailable: {_REASON}"
)


def _namespaces() -> set[str]:
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _json(cmd: list[str]) -> list[dict]:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=10).stdout
    return json.loads(out or "[]")


def _qdiscs(ns: str, dev: str) -> list[dict]:
    return _json(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev])


def _tiny_config(out: Path) -> TrainConfig:
    return TrainConfig(
        algo="co2",
        workers=2,
        backend="gloo",
        steps=12,
        sync_every=6,
        eval_every=6,
        eval_batches=1,
        n_layer=1,
        n_embd=32,
        n_head=2,
        batch_size=4,
        block_size=16,
        out=str(out),
    ).with_paths()


def _pids_in(ns: str) -> list[str]:
    out = subprocess.run(
        ["ip", "netns", "pids", ns], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    return out.split()


# --- no root needed ------------------------------------------------------------------------


def test_unavailable_reason_is_none_or_one_line() -> None:
    reason = unavailable_reason()
    assert reason is None or (isinstance(reason, str) and reason.strip())
    if reason is not None:
        assert "\n" not in reason
        assert isinstance(netem_available(), bool) and not netem_available()


def test_reason_without_root_is_one_line_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the root check comes after the Linux check")
    netshape._probe.cache_clear()
    monkeypatch.setattr(netshape.os, "geteuid", lambda: 1000)
    try:
        reason = unavailable_reason()
        assert reason is not None and "\n" not in reason
        assert "root" in reason and "--link" in reason
        assert not netem_available()
    finally:
        monkeypatch.undo()
        netshape._probe.cache_clear()


def test_tbf_parameters() -> None:
    for bps in (1e6, 10e6, 100e6, 1e9, 10e9):
        burst, limit = tbf_parameters(bps)
        assert burst >= 16 * 1024 and burst >= bps / 8 * 1e-3
        assert limit >= 256 * 1024 and limit >= bps / 8 * 0.1 and limit >= 2 * burst
    assert tbf_parameters(100e6) == (16384, 1_250_000)


@pytest.mark.parametrize(
    "args",
    [(0, 100e6), (251, 100e6), (2.0, 100e6), (2, 0.0), (2, float("inf")), (2, 100e6, -1.0)],
)
def test_shaped_network_rejects_bad_arguments(args: tuple) -> None:
    with pytest.raises(ValueError):
        ShapedNetwork(*args)


def test_not_entered_network_is_refused(tmp_path: Path) -> None:
    net = ShapedNetwork(2, 100e6)
    assert not net.active
    with pytest.raises(RuntimeError, match="with ShapedNetwork"):
        net.worker_env(0)
    with pytest.raises(ValueError, match="entered"):
        launch_shaped(_tiny_config(tmp_path), net)


def _fake_commands(monkeypatch: pytest.MonkeyPatch, *, netem: bool) -> list[list[str]]:
    """Record the ip/tc commands instead of running them, as on a host with shaping."""
    calls: list[list[str]] = []

    def run(cmd: list[str], **kwargs: object) -> str:
        calls.append(cmd)
        return ""

    monkeypatch.setattr(netshape, "_run", run)
    monkeypatch.setattr(netshape, "unavailable_reason", lambda: None)
    monkeypatch.setattr(netshape, "netem_available", lambda: netem)
    return calls


def test_latency_goes_through_netem_half_each_way(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_commands(monkeypatch, netem=True)
    with ShapedNetwork(2, 100e6, 0.02) as net:
        assert net.latency_applied
        assert net.describe() == "real tc tbf 100 Mbit/s per direction, netem 20 ms one-way latency"
    roots = [c for c in calls if c[0] == "tc" and "root" in c]
    children = [c for c in calls if c[0] == "tc" and "parent" in c]
    # Each worker: its upload (worker veth) and its download (bridge veth), 2 hops of latency / 2.
    assert len(roots) == len(children) == 4
    for root in roots:
        assert root[root.index("root") + 3 :][:3] == ["netem", "delay", "10000us"]
    for child in children:
        assert child[child.index("parent") + 1] == "1:1" and "tbf" in child
        assert child[child.index("rate") + 1] == "100000000bit"
    assert {c[2] for c in roots} == {*net.namespaces, net.switch_namespace}


def test_latency_without_netem_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_commands(monkeypatch, netem=False)
    net = ShapedNetwork(2, 100e6, 0.01)
    expected = "real tc tbf 100 Mbit/s per direction, no added latency (netem unavailable)"
    assert net.describe() == expected
    with net:
        assert not net.latency_applied and net.describe() == expected
    assert not [c for c in calls if "netem" in c]
    assert (
        ShapedNetwork(2, 1e9).describe() == "real tc tbf 1 Gbit/s per direction, no added latency"
    )
    assert "netem" in NETEM_UNAVAILABLE and "bandwidth only" in NETEM_UNAVAILABLE


# --- real networks (root) ------------------------------------------------------------------


@requires_shaping
@pytest.mark.timeout(60)
def test_network_is_built_shaped_and_torn_down() -> None:
    with ShapedNetwork(3, 100e6) as net:
        assert net.active and len(net.namespaces) == 3
        created = [*net.namespaces, net.switch_namespace]
        assert set(created) <= _namespaces()
        assert all(len(name) <= 15 for name in net.interfaces)
        assert len(set(net.addresses)) == 3
        for rank, (ns, dev, address) in enumerate(
            zip(net.namespaces, net.interfaces, net.addresses)
        ):
            links = _json(["ip", "-n", ns, "-4", "-j", "addr", "show", "dev", dev])
            assert [a["local"] for a in links[0]["addr_info"]] == [address]
            assert address.startswith("10.") and address.endswith(f".{rank + 1}")
            lo = _json(["ip", "-n", ns, "-j", "link", "show", "dev", "lo"])
            assert "UP" in lo[0]["flags"]
            (upload,) = [q for q in _qdiscs(ns, dev) if q["kind"] == "tbf"]
            assert upload["options"]["rate"] == 100e6 / 8  # bytes/s
            env = net.worker_env(rank)
            assert env["GLOO_SOCKET_IFNAME"] == dev and env["MASTER_ADDR"] == net.addresses[0]
            assert net.exec_prefix(rank) == ["ip", "netns", "exec", ns]
        assert net.switch_namespace is not None
        bridge_side = _json(["tc", "-n", net.switch_namespace, "-j", "qdisc", "show"])
        downloads = [q for q in bridge_side if q["kind"] == "tbf"]
        assert len(downloads) == 3
        assert all(q["options"]["rate"] == 100e6 / 8 for q in downloads)
        assert not net.latency_applied
    assert not net.active
    assert not set(created) & _namespaces()


@requires_shaping
@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", [ZeroDivisionError, KeyboardInterrupt])
def test_network_is_torn_down_when_the_body_raises(error: type[BaseException]) -> None:
    with pytest.raises(error), ShapedNetwork(2, 10e6) as net:
        created = [*net.namespaces, net.switch_namespace]
        assert set(created) <= _namespaces()
        raise error
    assert not set(created) & _namespaces()


@requires_shaping
@pytest.mark.timeout(60)
def test_latency_without_netem_is_reported() -> None:
    if netem_available():
        pytest.skip("netem is available here: the latency is applied")
    with ShapedNetwork(2, 100e6, 0.01) as net:
        assert not net.latency_applied
        assert "no added latency (netem unavailable)" in net.describe()


_ALL_REDUCE = textwrap.dedent(
    """
    import datetime, torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    x = torch.full((1000,), float(dist.get_rank() + 1))
    dist.all_reduce(x)
    print(x.sum().item() / x.numel(), flush=True)
    dist.destroy_process_group()
    """
)


@requires_shaping
@pytest.mark.timeout(60)
def test_gloo_all_reduce_across_the_bridge() -> None:
    with ShapedNetwork(2, 100e6) as net:
        procs = [
            subprocess.Popen(
                [*net.exec_prefix(rank), sys.executable, "-c", _ALL_REDUCE],
                env={**os.environ, **net.worker_env(rank)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        try:
            outputs = [p.communicate(timeout=45) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
        for p, (out, err) in zip(procs, outputs):
            assert p.returncode == 0, err[-2000:]
            assert float(out.split()[-1]) == 3.0  # 1 + 2
        # The traffic went through the shaped veths.
        for ns, dev in zip(net.namespaces, net.interfaces):
            stats = _json(["tc", "-s", "-n", ns, "-j", "qdisc", "show", "dev", dev])
            assert sum(q.get("bytes", 0) for q in stats if q["kind"] == "tbf") > 0


@requires_shaping
@pytest.mark.timeout(90)
def test_launch_shaped_runs_a_real_training_job(tmp_path: Path) -> None:
    cfg = _tiny_config(tmp_path / "run")
    with ShapedNetwork(2, 100e6) as net:
        summary = launch_shaped(cfg, net, timeout_s=80)
        assert all(not _pids_in(ns) for ns in net.namespaces)
    assert summary["workers"] == 2 and summary["steps"] == 12
    assert summary["tokens_per_s"] > 0
    assert summary["comm_mean"]["payload_bytes"] > 0
    assert summary["link"] is None
    assert summary["network"]["shaping"] == "real"
    assert summary["network"]["description"] == net.describe()
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["network"] == summary["network"]


@requires_shaping
@pytest.mark.timeout(60)
def test_launch_shaped_checks_the_config(tmp_path: Path) -> None:
    with ShapedNetwork(2, 100e6) as net:
        cfg = _tiny_config(tmp_path)
        with pytest.raises(ValueError, match="workers"):
            launch_shaped(config_from_dict(dict(**{**cfg.to_dict(), "workers": 3})), net)
        with pytest.raises(ValueError, match="link"):
            launch_shaped(config_from_dict(dict(**{**cfg.to_dict(), "link": "100mbit"})), net)
        with pytest.raises(ValueError, match="paths"):
            launch_shaped(TrainConfig(workers=2), net)


@requires_shaping
@pytest.mark.timeout(60)
def test_failed_worker_is_reported_with_its_rank(tmp_path: Path, monkeypatch: Any) -> None:
    # Rank 0 raises after its first step (the test-only fault hook, in every worker's
    # environment); rank 1 loses its peer.
    monkeypatch.setenv(FAULT_ENV, "0:1:raise")
    cfg = _tiny_config(tmp_path / "run")
    with ShapedNetwork(2, 100e6) as net:
        with pytest.raises(WorkerFailed) as info:
            launch_shaped(cfg, net, timeout_s=50)
        assert all(not _pids_in(ns) for ns in net.namespaces)
    assert info.value.rank == 0
    assert f"fault injected by {FAULT_ENV} at step 1" in info.value.error


@requires_shaping
@pytest.mark.timeout(60)
def test_timeout_stops_the_workers(tmp_path: Path) -> None:
    cfg = _tiny_config(tmp_path / "run")
    with ShapedNetwork(2, 100e6) as net:
        with pytest.raises(WorkerFailed, match="did not finish within 0.5 s"):
            launch_shaped(cfg, net, timeout_s=0.5)
        assert all(not _pids_in(ns) for ns in net.namespaces)


@requires_shaping
@pytest.mark.timeout(60)
def test_networks_do_not_collide() -> None:
    with ShapedNetwork(1, 10e6) as a, ShapedNetwork(1, 10e6) as b:
        assert not set(a.namespaces) & set(b.namespaces)
        assert a.subnet is not None and b.subnet is not None
        assert not a.subnet.overlaps(b.subnet)


def test_entering_without_shaping_names_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netshape, "unavailable_reason", lambda: "no shaping here; use --link")
    with pytest.raises(NetshapeError, match="no shaping here"), ShapedNetwork(2, 100e6):
        pass
