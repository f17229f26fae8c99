"""Elastic replicas on torchft (``fault_tolerance=``): real replica processes, a real Lighthouse on
127.0.0.1, a replica SIGKILLed while a sync is in flight and started again. The survivors keep
training; every sync's anchor is bit-identical on every replica that committed it; the replica
that comes back is healed from a live one with its donor's state bit for bit and ends with the
others' model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")

from lowcomm.elastic import Lighthouse, replica_manager  # noqa: E402

SYNCS = 24


def _spawn(
    lighthouse: str, replica: int, algo: str, log: Path, out: Path, *extra: str
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "lowcomm.testing.elastic", "--lighthouse", lighthouse]
    cmd += ["--replica-id", f"replica_{replica}", "--algo", algo, "--syncs", str(SYNCS)]
    cmd += ["--log", str(log), *extra]
    env = {**os.environ, "RUST_LOG": "warn"}
    with open(out, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("algo", ["diloco", "co2", "streaming"])
def test_a_replica_killed_in_a_sync_leaves_the_survivors_consistent_and_heals_on_return(
    algo: str, tmp_path: Path
) -> None:
    log, out = tmp_path / "events.jsonl", tmp_path / "replicas.log"
    # a quorum waits up to 2 s for replicas that heartbeat but have not asked yet (processes on
    # 2 shared cores drift apart by more than the default 0.1 s); a dead one is known after 1 s
    with Lighthouse(min_replicas=1, heartbeat_timeout_s=1.0, join_timeout_s=2.0) as lighthouse:
        procs = [_spawn(lighthouse.address, r, algo, log, out) for r in (0, 1)]
        # replica 2 joins the quorum of its 3rd sync, then dies before its collective
        procs.append(_spawn(lighthouse.address, 2, algo, log, out, "--die-after-quorum", "3"))
        assert procs[2].wait(timeout=90) == -9
        procs[2] = _spawn(lighthouse.address, 2, algo, log, out)  # the same replica, restarted
        codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0, 0, 0], out.read_text()[-3000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    syncs = [e for e in events if e["event"] == "sync"]
    # every committed sync's anchor is the same on every replica that holds it
    anchors: dict[int, set[str]] = {}
    for e in syncs:
        anchors.setdefault(e["sync"], set()).add(e["anchor"])
    assert sorted(anchors) == list(range(1, SYNCS + 1))
    assert all(len(a) == 1 for a in anchors.values()), anchors
    # the sync in flight when replica 2 died was dropped by the survivors (not committed), and
    # they went on without it
    assert any(e["failed"] >= 1 for e in syncs if e["replica"] in ("replica_0", "replica_1"))
    assert any(e["participants"] == 2 for e in syncs)
    # the restarted replica was healed with its donor's exact state, then trained with all 3
    heals = [e for e in events if e["event"] == "healed"]
    assert any(e["replica"] == "replica_2" for e in heals)
    assert all(e["donor"] == e["mine"] for e in heals)
    done = {e["replica"]: e for e in events if e["event"] == "done"}
    assert set(done) == {"replica_0", "replica_1", "replica_2"}
    assert len({e["params"] for e in done.values()}) == 1
    assert all(e["sync"] == SYNCS for e in done.values())
    assert syncs[-1]["participants"] == 3


def test_a_lighthouse_that_cannot_be_reached_is_named_within_its_timeout() -> None:
    with Lighthouse() as lighthouse:
        port = lighthouse.port
    address = f"http://127.0.0.1:{port}"  # closed now
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        replica_manager(address, replica_id="replica_0", connect_timeout_s=2)
    assert time.monotonic() - t0 < 30
    assert f"cannot reach the Lighthouse at {address} within 2 s" in str(info.value)


def _listening() -> dict[str, str]:
    """Every socket this process listens on: its inode -> its local address (hex, as in
    /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found[fields[9]] = fields[1].split(":")[0]
    return found


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, as v4 and v6-mapped


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc/net/tcp")
def test_what_elastic_syncs_do_not_support_is_refused_with_the_reason() -> None:
    import lowcomm

    before = _listening()
    with Lighthouse() as lighthouse:
        replica = replica_manager(lighthouse.address, replica_id="replica_0", timeout_s=5)
        try:
            # the Lighthouse, the replica's store and its Manager's server: loopback only
            opened = [a for inode, a in _listening().items() if inode not in before]
            assert len(opened) >= 3 and set(opened) <= LOOPBACK, opened
            model = torch.nn.Linear(4, 4)
            inner = torch.optim.SGD(model.parameters(), lr=0.1)
            cases: list[tuple[Any, dict[str, Any], str]] = [
                (lowcomm.CO2, {"sync_every": 4}, "overlap 4 >= sync_every / num_fragments = 4"),
                (lowcomm.DiLoCo, {"sync_every": 4, "sync_warmup": 4}, "sync_warmup > 0"),
                (lowcomm.DiLoCo, {"sync_every": 4, "compression": "int8"}, "compression"),
                (
                    lowcomm.DiLoCo,
                    {"sync_every": 4, "shard_outer_state": True},
                    "shard_outer_state",
                ),
                (lowcomm.NoLoCo, {"sync_every": 4}, "gossip groups"),
            ]
            for cls, kwargs, why in cases:
                with pytest.raises(ValueError, match="with fault_tolerance") as info:
                    cls(model, inner, fault_tolerance=replica, **kwargs)
                assert why in str(info.value), str(info.value)
            with pytest.raises(ValueError, match="not both"):
                lowcomm.DiLoCo(
                    model, inner, sync_every=4, fault_tolerance=replica, process_group=object()
                )
            with pytest.raises(ValueError, match="must be a torchft Manager"):
                lowcomm.DiLoCo(model, inner, sync_every=4, fault_tolerance=object())
        finally:
            replica.shutdown()
