"""Elastic replicas on torchft (``fault_tolerance=``): real replica processes, a real Lighthouse on
127.0.0.1, a replica SIGKILLed while a sync is in flight and started again. The survivors keep
training; every sync's anchor is bit-identical on every replica that committed it; the replica
that comes back is healed from a live one with its donor's state bit for bit and ends with the
others' model."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")

import lowcomm  # noqa: E402
from lowcomm.elastic import Lighthouse, replica_manager  # noqa: E402

SYNCS = 12


def _spawn(
    lighthouse: str, replica: int, algo: str, log: Path, out: Path, *extra: str
) -> subprocess.Popen[bytes]:
    """Replica ``replica`` (``lowcomm.testing.elastic``) of the job(s) ``algo`` (commas: one
    after the other in the process, one Lighthouse address each in ``lighthouse``)."""
    cmd = [sys.executable, "-m", "lowcomm.testing.elastic", "--lighthouse", lighthouse]
    cmd += ["--replica-id", f"replica_{replica}", "--algo", algo, "--syncs", str(SYNCS)]
    cmd += ["--log", str(log), *extra]
    env = {**os.environ, "RUST_LOG": "warn"}
    with open(out, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


KILLED_IN_A_SYNC = ["diloco", "slowmo", "localsgd", "co2", "streaming", "cocodc"]
# compressed syncs through the quorum: int4 all-gathered, PowerSGD's two all-reduces; a dropped
# sync's residuals kept (the default) and reset; SparseLoCo: its own sparse codec, each
# element's mean over the replicas that sent it (the joiner's zeros left out), its accumulator
# as the residual. Paced: a compressed sync's survivors see the failure at once (its first
# collective is an all-gather on the quorum's group) and would finish before the killed
# replica is back
KILLED_IN_A_SYNC += ["diloco+int4+paced", "slowmo+powersgd:2+reset+paced", "sparseloco+paced"]
# the job's SparseLoCo: each sync launched a step early and merged (θ ← A + (θ − θ_s))
KILLED_IN_A_SYNC += ["sparseloco+merge+paced"]
# healed in the background: the joiner applies the outer steps it missed (one fragment, two)
KILLED_IN_A_SYNC += ["co2+bg", "streaming+bg"]


@pytest.fixture(scope="module")
def killed_in_a_sync(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The job of each algorithm of :data:`KILLED_IN_A_SYNC`, run one after the other by one
    set of replica processes (a fresh model, Manager and Lighthouse per job: the start-up of
    the processes is paid once): in every job replica 2 joins the quorum of its 3rd sync, dies
    before its collective (SIGKILL) and is started again, and the restarted process goes on to
    the next job, where it dies the same way. Returns the records, each job's exit code of the
    process killed in it, the processes' final exit codes and their output."""
    tmp = tmp_path_factory.mktemp("killed-in-a-sync")
    log, out, ready = tmp / "events.jsonl", tmp / "replicas.log", tmp / "ready"
    ready.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    killed: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        # a quorum waits up to 2 s for replicas that heartbeat but have not asked yet (processes
        # on 2 shared cores drift apart by more than the default 0.1 s); a dead one is known
        # after 1 s
        addresses = [
            stack.enter_context(
                Lighthouse(min_replicas=1, heartbeat_timeout_s=1.0, join_timeout_s=2.0)
            ).address
            for _ in KILLED_IN_A_SYNC
        ]

        def spawn(replica: int, first: int, *extra: str) -> subprocess.Popen[bytes]:
            """Replica ``replica`` for the jobs from the ``first``-th on; each later job
            starts once the 3 replicas are ready for it, as processes started at once do."""
            jobs = (",".join(addresses[first:]), ",".join(KILLED_IN_A_SYNC[first:]))
            extra += ("--start-together", str(ready), "--replicas", "3")
            return _spawn(jobs[0], replica, jobs[1], log, out, *extra)

        try:
            procs = [spawn(0, 0), spawn(1, 0), spawn(2, 0, "--die-after-quorum", "3")]
            for i, algo in enumerate(KILLED_IN_A_SYNC):
                killed[algo] = procs[2].wait(timeout=90)
                if killed[algo] != -9:
                    break
                # the same replica, restarted: it is healed in this job and dies in the next
                procs[2] = spawn(2, i, "--die-after-quorum", "3", "--die-from", "1")
            codes = [p.wait(timeout=120) for p in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return {"events": events, "killed": killed, "codes": codes, "output": out.read_text()}


@pytest.mark.timeout(900)  # the first one runs every algorithm's job (the fixture)
@pytest.mark.parametrize("algo", KILLED_IN_A_SYNC)
def test_a_replica_killed_in_a_sync_leaves_the_survivors_consistent_and_heals_on_return(
    algo: str, killed_in_a_sync: dict[str, Any]
) -> None:
    run = killed_in_a_sync
    text = run["output"][-3000:]
    # replica 2 died (SIGKILL) in this job's 3rd sync; every process ended with 0, after every
    # replica had finished this job and closed its Manager
    assert run["killed"].get(algo) == -9, text
    assert run["codes"] == [0, 0, 0], text
    events = [e for e in run["events"] if e["algo"] == algo]
    closed = sorted(e["replica"] for e in events if e["event"] == "closed")
    assert closed == ["replica_0", "replica_1", "replica_2"], text
    syncs = [e for e in events if e["event"] == "sync"]
    # every committed sync's anchor is the same on every replica that holds it
    anchors: dict[int, set[str]] = {}
    for e in syncs:
        if e["committed"] and not e.get("catching_up"):
            anchors.setdefault(e["sync"], set()).add(e["anchor"])
    assert sorted(anchors) == list(range(1, SYNCS + 1))
    assert all(len(a) == 1 for a in anchors.values()), anchors
    # the sync in flight when replica 2 died was dropped by the survivors (not committed), and
    # they went on without it
    assert any(e["failed"] >= 1 for e in syncs if e["replica"] in ("replica_0", "replica_1"))
    dropped = [e for e in syncs if not e["committed"]]
    assert dropped
    if algo.split("+")[0] in ("diloco", "slowmo", "co2", "sparseloco"):  # one fragment: θ
        for e in dropped:  # back to the anchor
            assert e["params"] == e["anchor"] and e["anchor"] in anchors.get(e["sync"], set())
    compressed = [t for t in algo.split("+")[1:] if t not in ("bg", "paced", "merge")]
    if algo.startswith("sparseloco") or compressed:  # what a dropped sync left
        # in the survivors' residuals
        if "+reset" in algo:
            assert all(e["residual"] == 0 for e in dropped)
        else:  # kept: what the dropped round's encoding did not send (int4 sends little exactly)
            assert all(e["residual"] > 0 for e in dropped)
        # the returning replica starts with no residual of its own (not its donor's): its
        # first sync, which it joined healed, sent zeros and left it at 0
        healed_at = min(e["t"] for e in events if e["event"] == "healed")
        back = [e for e in syncs if e["replica"] == "replica_2" and e["t"] > healed_at]
        assert back and back[0]["residual"] == 0, back[:1]
        assert any(e["residual"] > 0 for e in back[1:])  # then it sends its own
    assert any(e["participants"] == 2 for e in syncs)
    # the restarted replica was healed with its donor's exact state, then trained with all 3
    heals = [e for e in events if e["event"] == "healed"]
    assert any(e["replica"] == "replica_2" for e in heals)
    assert all(e["donor"] == e["mine"] for e in heals)
    # healed in the background: the quorum brought only the counters (no digest to compare);
    # the joiner's anchors after it caught up are checked with everyone's above
    assert all(e["background"] == algo.endswith("+bg") for e in heals), heals
    done = {e["replica"]: e for e in events if e["event"] == "done"}
    assert set(done) == {"replica_0", "replica_1", "replica_2"}
    assert len({e["params"] for e in done.values()}) == 1
    assert all(e["sync"] == SYNCS for e in done.values())
    assert syncs[-1]["participants"] == 3


@pytest.mark.timeout(180)
@pytest.mark.parametrize("job", ["diloco+warm", "diloco+warm+backward"])
def test_a_warm_step_whose_quorum_loses_a_replica_is_skipped_and_a_later_joiner_heals_past_it(
    tmp_path: Path, job: str
) -> None:
    # the warm start elastic: 12 warm steps (int8 gradient means, a quorum each), then syncs
    # every 4. Replica 2 dies (SIGKILL) right after joining warm step 3's quorum: the
    # survivors' mean fails in flight and both skip that step alike. It comes back only once
    # the others are past the warm start: its first quorum (its own warm step 1) heals it
    # from a donor at a sync's launch, and it takes part in that sync. With +backward each
    # warm step's quorum is joined before its forward and every mean goes out during backward.
    log, out = tmp_path / "events.jsonl", tmp_path / "replicas.log"
    pace = ("--step-sleep", "0.1", "--timeout", "20")
    with Lighthouse(min_replicas=1, heartbeat_timeout_s=1.0, join_timeout_s=2.0) as lighthouse:

        def spawn(replica: int, *extra: str) -> subprocess.Popen[bytes]:
            return _spawn(lighthouse.address, replica, job, log, out, *pace, *extra)

        procs = [spawn(0), spawn(1)]
        dying = spawn(2, "--die-after-quorum", "3")
        assert dying.wait(timeout=90) == -9, out.read_text()[-3000:]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            '"event": "sync"' in line for line in log.read_text().splitlines()
        ):
            time.sleep(0.05)
        procs.append(spawn(2))
        codes = [p.wait(timeout=120) for p in procs]
    text = out.read_text()[-3000:]
    assert codes == [0, 0, 0], text
    events = [json.loads(line) for line in log.read_text().splitlines()]
    warm = [e for e in events if e["event"] == "warm"]
    # warm step 3 was dropped by both survivors (θ unchanged by it), every other warm step
    # committed, with one θ on every replica that took it
    for r in ("replica_0", "replica_1"):
        mine = [e for e in warm if e["replica"] == r]
        assert [e["local_step"] for e in mine] == list(range(1, 13))
        assert [e["committed"] for e in mine] == [True, True, False] + [True] * 9
        assert mine[2]["params"] == mine[1]["params"]
    by_step: dict[int, set[str]] = {}
    for e in warm:
        by_step.setdefault(e["local_step"], set()).add(e["params"])
    assert all(len(v) == 1 for v in by_step.values()), by_step
    launched = {e["in_backward"] for e in warm}
    if job.endswith("+backward"):  # every bucket of every warm step, before the optimizer's
        assert len(launched) == 1 and launched.pop() > 0, launched
    else:
        assert launched == {None}
    # the returning replica: healed once, with its donor's exact state, at a sync's launch
    heals = [e for e in events if e["event"] == "healed"]
    assert len(heals) == 1 and heals[0]["replica"] == "replica_2"
    assert heals[0]["donor"] == heals[0]["mine"]
    back = [e for e in events if e["replica"] == "replica_2" and e["t"] > heals[0]["t"]]
    assert back and back[0]["event"] == "sync" and back[0]["local_step"] > 12
    assert not [e for e in back if e["event"] == "warm"]
    anchors: dict[int, set[str]] = {}
    for e in events:
        if e["event"] == "sync" and e["committed"] and not e.get("catching_up"):
            anchors.setdefault(e["sync"], set()).add(e["anchor"])
    assert sorted(anchors) == list(range(1, SYNCS + 1))
    assert all(len(a) == 1 for a in anchors.values()), anchors
    done = {e["replica"]: e for e in events if e["event"] == "done"}
    assert len({e["params"] for e in done.values()}) == 1 and len(done) == 3


@pytest.mark.timeout(180)
def test_a_donor_killed_mid_heal_leaves_the_joiner_to_heal_from_another(tmp_path: Path) -> None:
    log, out, token = tmp_path / "events.jsonl", tmp_path / "replicas.log", tmp_path / "token"
    with Lighthouse(min_replicas=1, heartbeat_timeout_s=1.0, join_timeout_s=2.0) as lighthouse:
        donors = [
            _spawn(lighthouse.address, r, "diloco", log, out, "--die-as-donor", str(token))
            for r in (0, 1)
        ]
        joiner = _spawn(lighthouse.address, 2, "diloco", log, out, "--die-after-quorum", "3")
        assert joiner.wait(timeout=90) == -9
        joiner = _spawn(lighthouse.address, 2, "diloco", log, out)  # heals when it is back
        codes = sorted(p.wait(timeout=120) for p in [*donors, joiner])
    text = out.read_text()
    # the first donor died half-way through the transfer; the joiner loaded nothing from it,
    # asked for a new quorum and was healed by the other up-to-date replica
    assert token.exists() and codes == [-9, 0, 0], text[-3000:]
    assert "healing failed" in text and "asking for a new quorum" in text, text[-3000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    heals = [e for e in events if e["event"] == "healed" and e["replica"] == "replica_2"]
    assert len(heals) == 1 and heals[0]["donor"] == heals[0]["mine"]
    anchors: dict[int, set[str]] = {}
    for e in events:
        if e["event"] == "sync" and e["committed"] and not e.get("catching_up"):
            anchors.setdefault(e["sync"], set()).add(e["anchor"])
    assert all(len(a) == 1 for a in anchors.values()), anchors
    done = {e["replica"]: e for e in events if e["event"] == "done"}
    assert "replica_2" in done and len(done) == 2
    assert len({e["params"] for e in done.values()}) == 1
    assert all(e["sync"] == SYNCS for e in done.values())


def test_a_lighthouse_that_cannot_be_reached_is_named_within_its_timeout() -> None:
    with Lighthouse() as lighthouse:
        port = lighthouse.port
    address = f"http://127.0.0.1:{port}"  # closed now
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        replica_manager(address, replica_id="replica_0", connect_timeout_s=2)
    assert time.monotonic() - t0 < 30
    assert f"cannot reach the Lighthouse at {address} within 2 s" in str(info.value)


@pytest.mark.timeout(120)
def test_fewer_replicas_than_min_replicas_wait_saying_so_then_fail_naming_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import lowcomm
    from lowcomm.elastic import sync as elastic_sync

    monkeypatch.setattr(elastic_sync, "WAIT_NOTE_S", 0.5)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with Lighthouse(min_replicas=2, join_timeout_s=0.5) as lighthouse:
        replica = replica_manager(
            lighthouse.address, replica_id="replica_0", min_replicas=2, quorum_timeout_s=3
        )
        try:
            algo = lowcomm.DiLoCo(
                model, inner, sync_every=2, sync_warmup=0, fault_tolerance=replica
            )
            t0 = time.monotonic()
            with caplog.at_level("WARNING"), pytest.raises(Exception) as info:
                for _ in range(4):  # the first step joins: no second replica ever comes
                    model(torch.ones(2, 4)).sum().backward()
                    inner.step()
                    inner.zero_grad()
                    algo.step()
            assert time.monotonic() - t0 < 60
        finally:
            replica.shutdown()
    assert "waiting 0 s for a quorum" in caplog.text or "waiting 1 s for a quorum" in caplog.text
    text = f"{info.value} {info.value.__cause__}"
    assert "no quorum after" in text and "fewer replicas are alive than a sync needs" in text
    assert "(min_replicas 2)" in text


@pytest.mark.timeout(120)
def test_a_replica_catching_up_that_is_asked_to_heal_another_does_not_wait_on_its_own_quorum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A replica healed in the background may be torchft's choice of donor before its own
    # donor's tensors have been applied: it catches up inside the quorum (in torchft's quorum
    # thread, while its loop waits in start_quorum), then sends. Asking torchft for its rank
    # there (to restart its compressors) waits for the very quorum that thread computes: a
    # replica and its joiner waited until the quorum timeout (600 s) while the others' syncs
    # with them failed. Now the compressors restart once the quorum has returned.
    import lowcomm

    class Arrived:  # the background part of its own heal, here (what PendingState holds)
        def __init__(self, state: Any) -> None:
            self.state = state

        def done(self) -> bool:
            return True

        def failed(self) -> bool:
            return False

        def result(self) -> Any:
            return self.state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    with Lighthouse(min_replicas=1, join_timeout_s=0.5) as lighthouse:
        replica = replica_manager(
            lighthouse.address, replica_id="replica_0", timeout_s=5, heal="background"
        )
        try:
            algo = lowcomm.DiLoCo(
                model, inner, sync_every=2, compression="int4", fault_tolerance=replica
            )
            for _ in range(4):  # two syncs: past the joining quorum, compressors in use
                model(torch.randn(2, 4)).sum().backward()
                inner.step()
                inner.zero_grad()
                algo.step()
            syncs = algo.elastic_syncs
            assert syncs is not None and syncs.background
            sent = syncs.heal_state()["background"].state  # what a donor serves
            compressor = algo.compressors()[0]
            compressor.residuals[0].fill_(1.0)  # (its own error, to be dropped at the restart)
            syncs._pending, syncs._missed = Arrived(sent), []
            assert syncs.catching_up
            in_quorum = threading.Event()
            ranks = replica.manager.participating_rank

            def rank() -> Any:  # torchft's waits for the quorum: inside it, forever
                assert not in_quorum.is_set(), "asked the quorum for its rank inside it"
                return ranks()

            monkeypatch.setattr(replica.manager, "participating_rank", rank)
            in_quorum.set()  # the donor's side of a quorum: torchft's thread asks for the state
            state = syncs.heal_state()
            in_quorum.clear()
            assert not syncs.catching_up and "background" in state
            assert compressor.residuals[0].abs().sum() > 0  # not restarted inside the quorum
            syncs.quorum()  # the quorum returned: restarted now, with its rank in it
            assert float(compressor.residuals[0].abs().sum()) == 0.0
            assert compressor.rank == 0
        finally:
            replica.shutdown()


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
class _Fixed(lowcomm.DiLoCo):
    """An algorithm whose class says its syncs need a fixed group."""

    elastic = False


def test_the_job_runs_elastic_what_the_registry_says() -> None:
    # one description: an entry is elastic where its class is (NoLoCo's is not) and the entry
    # does not say otherwise (co2-eager); the job and the chaos bench take that list
    from lowcomm.bench import chaos
    from lowcomm.registry import ELASTIC, REGISTRY
    from lowcomm.train.config import ConfigError, config_from_dict

    assert set(ELASTIC) == {
        *("co2", "diloco", "streaming", "cocodc", "localsgd", "slowmo", "sparseloco")
    }
    assert chaos.ELASTIC is ELASTIC and not REGISTRY["noloco"].cls.elastic  # type: ignore[union-attr]
    for name in REGISTRY:
        values = {"fault_tolerance": True, "algo": name, "sync_every": 4, "steps": 8}
        if name in ELASTIC:
            config_from_dict(values, source="test")
        else:
            with pytest.raises(ConfigError, match=f"algo '{name}' does not run with"):
                config_from_dict(values, source="test")


@pytest.mark.parametrize("gap_penalty", ["none", "gap_aware"])
def test_a_healed_co2_replica_holds_the_outer_state_digest_of_its_donor(gap_penalty: str) -> None:
    # a CO2 heal leaves out the gap buffers nothing reads without the gap-aware penalty: the
    # joiner keeps its own there, so the sync records' digest of the outer state (what every
    # replica of a committed sync must hold alike) covers what the heal carries, no more
    from types import SimpleNamespace

    from lowcomm.outer.co2 import CO2Config, CO2State
    from lowcomm.train.replica import _outer_digest

    config = CO2Config(gap_penalty=gap_penalty)
    anchors = [[torch.zeros(6), torch.zeros(3)] for _ in range(2)]
    donor, joiner = (CO2State(config, a, lambda: None) for a in anchors)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        donor.step(anchors[0], [torch.randn(6, generator=gen), torch.randn(3, generator=gen)])
    joiner.step(anchors[1], [torch.randn(6, generator=gen), torch.randn(3, generator=gen)])
    digest = [
        _outer_digest(SimpleNamespace(fragments=[SimpleNamespace(outer=s)]))
        for s in (donor, joiner)
    ]
    assert digest[0] != digest[1]
    free = donor.heal_free()
    assert free == ([] if gap_penalty == "gap_aware" else ["gap_stat", "last_update"])
    sent = {k: v for k, v in donor.state_dict().items() if k not in free}
    joiner.load_state_dict({**joiner.state_dict(), **sent})
    assert _outer_digest(SimpleNamespace(fragments=[SimpleNamespace(outer=joiner)])) == digest[0]
    if free:  # its own gap buffers stayed: the full state differs, the shared one does not
        assert any(not torch.equal(a, b) for a, b in zip(donor.tensors(), joiner.tensors()))


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
                (
                    lowcomm.DiLoCo,
                    {"sync_every": 4, "shard_outer_state": True},
                    "shard_outer_state",
                ),
                (lowcomm.NoLoCo, {"sync_every": 4}, "gossip groups"),
                (_Fixed, {"sync_every": 4}, "its class sets elastic = False"),
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


def _kill_one_and_train(
    tmp_path: Path, monkeypatch: Any, capsys: Any, fault: str, *layout: str
) -> tuple[Path, Any]:
    """``lowcomm train --fault-tolerance`` of the tiny DiLoCo job (32 steps, ``layout``) with
    ``fault`` injected, 2 replicas needed per sync, one restart each; returns the output
    folder and what it printed (the replica killed: replica_1)."""
    from lowcomm.cli import main
    from lowcomm.testing.jobs import tiny_job_args
    from lowcomm.train.faults import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, fault)
    out = tmp_path / "run"
    argv = ["train", "--algo", "diloco", *tiny_job_args(steps=32, workers=None), *layout]
    argv += ["--fault-tolerance", "--min-replicas", "2", "--max-restarts", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "replica replica_1 left the job (exit code -9); restarting it" in printed.err
    return out, printed


def _committed_anchors(out: Path, *folders: str) -> dict[int, set[str]]:
    """Every committed sync's anchor checksums, as each replica folder recorded them."""
    anchors: dict[int, set[str]] = {}
    for folder in folders:
        for line in (out / "replicas" / folder / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == "sync" and record["committed"] and not record.get("catching_up"):
                anchors.setdefault(record["sync"], set()).add(record["anchor"])
    return anchors


@pytest.mark.timeout(240)
@pytest.mark.parametrize("heal_inner", ["bf16", None], ids=["bf16", "not-given"])
def test_lowcomm_train_restarts_a_killed_replica_alone_and_heals_it(
    tmp_path: Path, monkeypatch: Any, capsys: Any, heal_inner: str | None
) -> None:
    # replica 1 is SIGKILLed after step 10 (mid-round: syncs at 4, 8, 12, ...); it is started
    # again alone; with --min-replicas 2 the other waits for it at the next sync, where it is
    # healed and both go on; over an emulated link of 8 Mbit/s, its syncs and its heal take
    # what the link takes. --heal-inner not given: chosen with the heal in the background, none
    inner = () if heal_inner is None else ("--heal-inner", heal_inner)
    link = ("--link", "8mbit:20ms", "--heal", "background", *inner)
    out, printed = _kill_one_and_train(
        tmp_path, monkeypatch, capsys, "1:10:kill", "--workers", "2", *link
    )
    assert "faults              1; healed 1" in printed.out
    assert "(the replicas' start-up included)" in printed.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["replicas_identical"]
    (fault,) = summary["faults"]
    assert fault["replica"] == "replica_1" and fault["fault_to_healed_s"] > 0
    assert sorted(os.listdir(out / "replicas")) == ["replica_0", "replica_1", "replica_1.1"]
    # the restarted replica took its donor's step and went on from there with its own stream
    records = [
        json.loads(line)
        for line in (out / "replicas" / "replica_1.1" / "metrics.jsonl").read_text().splitlines()
    ]
    (healed,) = [r for r in records if r["kind"] == "healed"]
    assert healed["step"] % 4 == 0 and healed["step"] >= 12
    later = [r["step"] for r in records if r["kind"] == "step" and r["step"] > healed["step"]]
    assert later and later[-1] == 32
    # healed in the background: its quorum brought the donor's counters, and it took part in
    # the syncs without contributing (no anchor of its own) until the donor's tensors had come
    # over the link; then it applied every outer step it had missed, and from that sync on its
    # anchor is everyone's (checked below, with the other replica's, sync by sync)
    syncs = [r for r in records if r["kind"] == "sync"]
    caught = [i for i, r in enumerate(syncs) if r.get("caught_up")]
    assert syncs[0].get("catching_up") and len(caught) == 1, syncs
    assert all(r.get("catching_up") for r in syncs[: caught[0]])
    assert not any(r.get("catching_up") for r in syncs[caught[0] :])
    # tokens trained that reached the model (2 x 16 a step): replica 0's 32 steps, replica 1's
    # up to its last sync before it died, and its restart's from the sync it caught up at
    first = [
        json.loads(line)
        for line in (out / "replicas" / "replica_1" / "metrics.jsonl").read_text().splitlines()
    ]
    died_after = max((r["step"] for r in first if r["kind"] == "sync"), default=0)
    steps = 32 + died_after + (32 - syncs[caught[0]]["step"])
    assert summary["tokens_trained"] == 2 * 16 * steps, (summary["tokens_trained"], steps)
    own = json.loads((out / "replicas" / "replica_1.1" / "summary.json").read_text())["elastic"]
    assert own["first_step"] == healed["step"] and own["heals"]
    # (its summary says how it was healed: --heal-inner not given, none with the background)
    assert (own["heal"], own["heal_inner"]) == ("background", heal_inner or "none")
    # every committed sync's anchor, as each process recorded it: one checksum per sync (6
    # syncs after the job's warm start of 8 steps)
    anchors = _committed_anchors(out, "replica_0", "replica_1", "replica_1.1")
    assert sorted(anchors) == list(range(1, 7)) and all(len(a) == 1 for a in anchors.values())
    # the link: the heal's bytes as the donor sent them, received in no less than the link's
    # time for them; each sync's ring all-reduce (2 replicas: its payload) no faster either
    donor = json.loads((out / "replicas" / "replica_0" / "summary.json").read_text())
    assert donor["link"] == "8mbit:20ms (emulated)"
    heal_bytes = own["heal_bytes_received"]
    assert heal_bytes > 0 and donor["elastic"]["heal_bytes_sent"] == heal_bytes
    # past the warm start a heal carries the anchor in fp32 and the inner AdamW's two moments
    # in bf16, 2 words a parameter (none of them with --heal-inner none, as a heal in the
    # background chooses where it is not given: the joiner's AdamW starts afresh), and
    # DiLoCo's outer momentum in fp32 once it has a buffer (not at the first sync after the
    # warm start, step 12), with small tensors' framing; not the parameters themselves, fp32
    # moments or the error-feedback residuals (each one word more)
    params = json.loads((out / "replicas" / "replica_0" / "summary.json").read_text())["parameters"]
    words = (2 if healed["step"] == 12 else 3) - (0 if heal_inner == "bf16" else 1)
    assert words <= heal_bytes / (4 * params) < words + 0.5, heal_bytes / (4 * params)
    (took,) = own["heal_transfer_s"]
    assert took >= 0.02 + 8 * heal_bytes / 8e6
    assert summary["link"] == "8mbit:20ms (emulated)"
    assert "8mbit:20ms (emulated)" in printed.out and ", heal transfer " in printed.out
    assert (fault["heal_bytes"], fault["heal_transfer_s"]) == (heal_bytes, took)
    assert fault["fault_to_healed_s"] > took
    # (the warm start's means, int8, and the syncs' all-reduces alike)
    comm = donor["comm_mean"]
    assert comm["collectives"] == 8 + 6 and comm["wire_bytes"] > 0
    assert comm["in_flight_s"] >= comm["collectives"] * 0.02 + 8 * comm["wire_bytes"] / 8e6


def _records(out: Path, folder: str, kind: str) -> list[dict[str, Any]]:
    lines = (out / "replicas" / folder / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.timeout(240)
def test_a_replica_healed_during_the_warm_start_ends_each_warm_step_as_its_donor(
    tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    # the job's warm start (8 of 32 steps, an int8 gradient mean every step, a quorum each,
    # joined before the step's forward: the means go out during backward); replica 1 is
    # SIGKILLed after warm step 3; its restart joins at its first step, is healed from replica
    # 0 waiting in warm step 4's quorum, computes that step's gradient on the donor's θ and
    # contributes it, and from then on both hold θ bit for bit after every warm step
    out, printed = _kill_one_and_train(tmp_path, monkeypatch, capsys, "1:3:kill")
    assert "faults              1; healed 1" in printed.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["replicas_identical"]
    (healed,) = _records(out, "replica_1.1", "healed")
    assert healed["step"] == 3  # where the donor stood: after warm step 3, before step 4
    donor = {r["warm_step"]: r["anchor"] for r in _records(out, "replica_0", "warm_step")}
    joiner = {r["warm_step"]: r["anchor"] for r in _records(out, "replica_1.1", "warm_step")}
    assert sorted(donor) == list(range(1, 9)) and sorted(joiner) == list(range(4, 9))
    assert all(joiner[k] == donor[k] for k in joiner)
    before = {r["warm_step"]: r["anchor"] for r in _records(out, "replica_1", "warm_step")}
    assert sorted(before) == [1, 2, 3] and all(before[k] == donor[k] for k in before)
    own = json.loads((out / "replicas" / "replica_1.1" / "summary.json").read_text())["elastic"]
    assert own["heals"] == [0] and own["warm_steps_committed"] == 8
    assert own["syncs_committed"] == 6 and own["participants"] == [2] * 6
    anchors = _committed_anchors(out, "replica_0", "replica_1.1")
    assert sorted(anchors) == list(range(1, 7)) and all(len(a) == 1 for a in anchors.values())


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("link", "algo"), [("10mbit", "co2"), ("250kbit:100ms", None), ("10mbit", "sparseloco")]
)
def test_an_elastic_job_on_a_slow_link_takes_one_choice_of_settings_in_every_replica(
    tmp_path: Path, monkeypatch: Any, capsys: Any, link: str, algo: str | None
) -> None:
    # a job over an emulated slow link: the settings are chosen once, before the replicas
    # start, by one process of a replica's shape; both replicas and replica 1's restart take
    # that one record. On 10 Mbit/s, --algo co2: CO2 with settings (and a warm start) from the
    # link. On 250 kbit/s the default job, where none of CO2's hides its syncs: SparseLoCo in
    # its place, elastic too (a replica killed and healed, each element's mean over those that
    # sent it). --algo sparseloco given keeps its settings as given, but the heal is chosen.
    from lowcomm.cli import main
    from lowcomm.testing.jobs import tiny_job_args
    from lowcomm.train.faults import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "1:10:kill")
    out = tmp_path / "run"
    argv = ["train", *tiny_job_args(steps=32, workers=None), "--link", link]
    if algo is not None:
        argv += ["--algo", algo]
    if algo == "sparseloco":  # the kill at step 10 inside its early rounds (every 2 steps)
        argv += ["--early-steps", "12"]
    argv += ["--fault-tolerance", "--min-replicas", "2", "--max-restarts", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "faults              1; healed 1" in printed.out
    summary = json.loads((out / "summary.json").read_text())
    record = summary["link_tuning"]
    assert record is not None and record["link"].startswith(f"{link} (emulated)")
    assert f"tuned to link       {link} (emulated)" in printed.out
    chosen = record["settings"]
    if algo == "sparseloco":  # the heal alone, the rest as given
        assert summary["algo"] == "sparseloco" and set(chosen) == {"heal", "heal_inner"}
        assert record["as_given"] == "sparseloco is not tuned" and "replaced" not in record
        assert "the other settings as given (sparseloco is not tuned)" in printed.out
        assert summary["early_rounds"] == {"steps": 12, "sync_every": 2}
        assert summary["overlap"] == 0  # (as given: blocking)
        assert "(sync every 4 steps; every 2 for the first 12, elastic)" in printed.out
    elif algo == "co2":
        assert summary["algo"] == "co2" and "replaced" not in record
        tuned = {"compression", "sync_warmup", "sync_warmup_compression", "heal", "heal_inner"}
        assert chosen and set(chosen) <= tuned
    else:
        assert summary["algo"] == "sparseloco" and record["replaced"]["algo"] == "co2"
        # (its early rounds: every 2 steps for the first three eighths)
        tau = summary["overlap"]  # (steps in flight, chosen from the step the job timed)
        assert tau == int(chosen.get("overlap", 0))
        flight = f"; {tau} step{'s' if tau > 1 else ''} in flight" if tau else ""
        line = f"sparseloco (sync every 4 steps; every 2 for the first 12{flight}, elastic)"
        assert f"algorithm           {line}" in printed.out
    # the heal, not given, is chosen with them, and the replicas and the Lighthouse take it:
    # blocking on both, the tiny job's syncs (4 ms of compute a step) taking most of the link
    # (with the donor's inner moments: heal_inner not given, chosen with the blocking heal)
    assert chosen["heal"] == "blocking" and chosen["heal_inner"] == "bf16", record
    assert "of the link" in record["heal_reason"] and "heal blocking" in printed.out
    assert "heal_inner bf16" in printed.out
    for folder in ("replica_0", "replica_1.1"):  # (the one killed wrote no summary)
        own = json.loads((out / "replicas" / folder / "summary.json").read_text())
        assert own["link_tuning"] == record, folder
        assert own["algo"] == summary["algo"]
        if "compression" in chosen:
            assert own["compression"] == chosen["compression"]
        if "sync_warmup_compression" in chosen:
            assert own["sync_warmup"]["compression"] == chosen["sync_warmup_compression"]
    assert summary["replicas_identical"] and summary["status"] == "finished"


@pytest.mark.timeout(240)
def test_a_node_group_replica_restarts_as_a_unit_and_heals_every_process(
    tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    # 2 replicas of 2 processes each (DDP inside a replica); process 3 = replica 1's group
    # rank 1 is SIGKILLed after step 10: its replica goes down as a unit, is started again,
    # and both of its processes are healed from replica 0's (group rank j from group rank j)
    layout = ("--nodes", "2", "--procs-per-node", "2")
    out, printed = _kill_one_and_train(tmp_path, monkeypatch, capsys, "3:10:kill", *layout)
    assert "each 2 processes with DDP inside" in printed.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["replicas"] == 2
    assert summary["procs_per_replica"] == 2 and summary["heals"] == 1
    # every process of every finished replica ends with one model, the healed ones included
    assert summary["replicas_identical"]
    assert sorted(os.listdir(out / "replicas")) == ["replica_0", "replica_1", "replica_1.1"]
    for folder in ("replica_0", "replica_1.1"):
        own = json.loads((out / "replicas" / folder / "summary.json").read_text())
        ranks = own["comm_per_worker"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert len({r["params_checksum"] for r in ranks}) == 1
        assert all(r["intra_node"]["payload_bytes"] > 0 for r in ranks)  # DDP inside
    anchors = _committed_anchors(out, "replica_0", "replica_1", "replica_1.1")
    assert sorted(anchors) == list(range(1, 7)) and all(len(a) == 1 for a in anchors.values())
    records = [
        json.loads(line)
        for line in (out / "replicas" / "replica_1.1" / "metrics.jsonl").read_text().splitlines()
    ]
    (healed,) = [r for r in records if r["kind"] == "healed"]
    assert healed["step"] % 4 == 0 and healed["step"] >= 12


def test_the_tokens_a_replica_trained_count_what_reached_the_model(tmp_path: Path) -> None:
    # the goodput's count from a replica's records: its steps up to each sync it committed;
    # a round dropped (a sync not committed), the work since its last committed sync when it
    # is healed or killed, and a background heal's steps until its donor's state arrived are
    # lost; a survivor healed mid-run keeps what it committed before
    from lowcomm.train.elastic import _contribution

    def sync(step: int, committed: bool = True, **flags: bool) -> dict[str, Any]:
        return {"kind": "sync", "step": step, "committed": committed, "time": step, **flags}

    def healed(step: int) -> dict[str, Any]:
        return {"kind": "healed", "step": step, "time": step}

    def steps(*at: int) -> list[dict[str, Any]]:
        return [{"kind": "step", "step": k} for k in at]

    def count(records: list[dict[str, Any]], finished: bool) -> tuple[int, list[float]]:
        folder = tmp_path / f"replica_{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        text = "".join(json.dumps(r) + "\n" for r in records)
        (folder / "metrics.jsonl").write_text(text + '{"kind": "st')  # a line cut by a kill
        return _contribution(str(folder), finished)

    # a survivor whose sync at 36 failed (a peer killed in it), behind at 48, healed there in
    # the background, caught up at 72, finished at 96: 0-24 and 72-96
    survivor = [sync(12), sync(24), sync(36, committed=False), sync(48, catching_up=True)]
    survivor += [healed(48), sync(60, catching_up=True), sync(72, caught_up=True), sync(84)]
    survivor += steps(90, 96)
    assert count(survivor, finished=True) == (48, [72.0])
    # a returning replica healed blocking in the quorum of its first sync (recorded at the
    # donor's step), killed after its step 410: 384-408
    joiner = [sync(384), healed(384), sync(396), sync(408), *steps(410)]
    assert count(joiner, finished=False) == (24, [384.0])
    # killed after a sync that was not committed: up to the last committed one
    assert count([sync(12), sync(24), sync(36, committed=False), *steps(40)], False) == (24, [])
    # healed in the background and never caught up: nothing, and not healed
    assert count([sync(180, catching_up=True), healed(180), *steps(190)], True) == (0, [])
    # a fault-free replica: every step
    assert count([sync(12), sync(24), *steps(30, 32)], True) == (32, [])


def test_a_replicas_batches_are_a_function_of_its_step() -> None:
    from lowcomm.train.elastic import replica_generator

    def draw(index: int, step: int) -> torch.Tensor:
        return torch.randint(0, 1000, (8,), generator=replica_generator(0, index, step))

    # the same replica at the same step draws the same batch whatever came before (a healed
    # replica continues its own stream: nothing replayed, nothing skipped)
    assert torch.equal(draw(1, 12), draw(1, 12))
    assert not torch.equal(draw(1, 12), draw(1, 13))
    assert not torch.equal(draw(1, 12), draw(2, 12))


@pytest.mark.timeout(180)
def test_replicas_on_several_machines_join_a_lowcomm_lighthouse(tmp_path: Path) -> None:
    from lowcomm.testing.jobs import tiny_job_args

    env = {**os.environ, "RUST_LOG": "warn"}
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "lowcomm", "lighthouse", "--port", "0", "--min-replicas", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        assert lighthouse.stdout is not None
        first = lighthouse.stdout.readline().decode()
        assert first.startswith("lowcomm lighthouse: listening on http://127.0.0.1:"), first
        address = first.split("listening on ")[1].strip()
        replicas = []
        for i in (0, 1):
            argv = ["train", "--algo", "co2", *tiny_job_args(steps=16), "--fault-tolerance"]
            argv += ["--lighthouse", address, "--replica-id", f"replica_{i}"]
            argv += ["--out", str(tmp_path / f"replica_{i}")]
            replicas.append(
                subprocess.Popen(
                    [sys.executable, "-m", "lowcomm", *argv],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )
        outputs = [p.communicate(timeout=120)[0].decode() for p in replicas]
        assert [p.returncode for p in replicas] == [0, 0], outputs
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    summaries = [
        json.loads((tmp_path / f"replica_{i}" / "summary.json").read_text()) for i in (0, 1)
    ]
    checksums = {s["comm_per_worker"][0]["params_checksum"] for s in summaries}
    assert len(checksums) == 1  # one model on both machines
    # the job's warm start (4 steps, a quorum each), then 3 syncs
    assert all(s["elastic"]["warm_steps_committed"] == 4 for s in summaries)
    assert all(s["elastic"]["syncs_committed"] == 3 for s in summaries)
    assert all(s["elastic"]["participants"] == [2, 2, 2] for s in summaries)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"algo": "ddp"}, "algo 'ddp' does not run with fault_tolerance"),
        ({"algo": "co2-eager"}, "algo 'co2-eager' does not run with fault_tolerance"),
        ({"min_replicas": 3}, "min_replicas (3) is more than the 2 replicas started"),
        ({"checkpoint_every": 12}, "checkpoint_every is not supported with fault_tolerance"),
        (
            {"shard_outer_state": True},
            "shard_outer_state is not supported with fault_tolerance: each replica would own",
        ),
        (
            {"algo": "co2", "overlap": 12, "sync_every": 12},
            "overlap (12) is not supported with fault_tolerance: a sync would be launched",
        ),
        (
            {"algo": "streaming", "num_fragments": 3, "overlap": 4, "sync_every": 12},
            "use an overlap below sync_every / num_fragments",
        ),
        (
            {"nodes": 2, "workers": 4, "lighthouse": "http://127.0.0.1:1", "replica_id": "r_1"},
            "nodes is not supported with fault_tolerance: with lighthouse this command is one "
            "replica",
        ),
        (
            {"nodes": 2, "workers": 4, "min_replicas": 3},
            "min_replicas (3) is more than the 2 replicas started (--nodes)",
        ),
        (
            {"nodes": 2, "workers": 4, "node_sharding": "zero"},
            "node_sharding is not supported with fault_tolerance",
        ),
        ({"heal_inner": "fp8"}, "heal_inner must be one of bf16, none, got 'fp8'"),
        ({"lighthouse": "http://127.0.0.1:1"}, "replica_id is needed with lighthouse"),
        ({"replica_id": "replica_1"}, "lighthouse is needed with replica_id"),
    ],
)
def test_what_an_elastic_job_cannot_run_is_refused_up_front(
    values: dict[str, Any], message: str
) -> None:
    from lowcomm.train.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError) as info:
        config_from_dict({"fault_tolerance": True, **values}, source="test")
    assert message in str(info.value)
    with pytest.raises(ConfigError, match="needs fault_tolerance"):
        config_from_dict({"lighthouse": "http://127.0.0.1:1"}, source="test")


def test_an_untested_torchft_is_refused_naming_both_releases(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.metadata

    from lowcomm.cli import main
    from lowcomm.elastic.replica import require_torchft

    assert require_torchft("0.2.1") is not None  # the tested series
    with pytest.raises(ValueError, match=r"tested with torchft 0\.2\.0, and torchft 0\.3\.0 is"):
        require_torchft("0.3.0")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.3.0")
    assert main(["train", "--fault-tolerance", "--out", str(tmp_path / "r")]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("lowcomm train: error: --fault-tolerance cannot run here: fault ")
    assert "torchft 0.2.0, and torchft 0.3.0 is installed" in line
    assert "pip install 'torchft==0.2.0'" in line
