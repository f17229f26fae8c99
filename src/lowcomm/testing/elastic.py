"""One replica of an elastic job, as the fault-tolerance tests run it: ``python -m
lowcomm.testing.elastic --lighthouse ADDR --replica-id ID ...`` trains a small MLP with an outer
algorithm over torchft (``fault_tolerance=``) and writes one JSON line per event to ``--log``:

* ``{"event": "sync", "committed", "sync", "participants", "anchor", "params", "local_step"}``
  after every sync point (``committed``: whether this one was; ``sync``: syncs committed so far;
  ``anchor`` and ``params``: checksums);
* ``{"event": "healed", "donor", "mine", "background"}``: right after this replica was healed,
  the checksum of the state its donor had when it sent it and of the state this replica holds
  now (both ``None`` for a heal in the background: its sync records then say ``catching_up``,
  with no anchor, until the donor's state has arrived);
* ``{"event": "done", ...}`` with the final checksums;
* ``{"event": "closed"}`` once its torchft Manager is shut down.

A job's name is an algorithm, or ``ALGO+CODEC`` (compressed syncs, e.g. ``diloco+int4``) and
optionally ``+reset`` (``dropped_residual="reset"``); its sync records then hold ``residual``,
the sum of squares of the compressor's residuals after the sync (``sparseloco`` compresses
with its own codec: its records hold its accumulator's); ``+bg`` heals in the
background (``heal="background"``). ``ALGO+warm`` adds a warm start
of 3 rounds with int8 gradient means, one quorum per step; each of its steps writes
``{"event": "warm", "committed", "warm_step", "participants", "params", "local_step",
"in_backward"}``; ``+backward`` sends them during backward, each step's quorum joined before
its forward (``warm_start_during_backward()``, ``before_forward()``), and ``in_backward`` counts
the step's buckets launched before the optimizer's step (``None`` without ``+backward``).
``--step-sleep S`` sleeps S seconds after every inner step (a replica that trains at a pace);
``+paced`` in a job's name sleeps 0.15 s more in that job (its survivors of a kill then train for
longer than a restarted replica takes to start). ``+merge`` launches each sync a step before its
sync point and applies it with the delay-corrected merge (``overlap=1``,
``merge="delay_corrected"``).

Every record also names its ``algo``. ``--algo A,B,...`` with ``--lighthouse ADDR_A,ADDR_B,...``
(one Lighthouse each) runs one job after the other in this process, each from a fresh model and
a fresh Manager: the same replicas run several jobs at the cost of one start-up. With
``--start-together DIR --replicas N`` every job after the process's first starts training only
once the N replicas have their Manager for it (files in DIR), as replicas started at once do.

``--die-after-quorum K`` kills the process (SIGKILL) right after it joined the quorum of its K-th
sync, before it contributes to that sync's collective: the others' collective fails while it is in
flight (with ``--die-from I``: only in the I-th job of ``--algo`` and later ones, counted from 0).
``--die-as-donor FILE``: the first replica to send its state to a healing one (the one that
creates FILE) sends the length of its state and is SIGKILLed before the state itself: the joiner's
transfer fails half-way. A job ends once ``--syncs`` syncs are committed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import torch
from torch import nn

from lowcomm.guard import checksum

__all__ = ["main"]


def _digest(tensors: list[torch.Tensor]) -> str:
    return checksum(torch.cat([t.detach().reshape(-1).float() for t in tensors]))


def _state_digest(algo: Any, params: list[torch.Tensor], inner_state: dict[str, Any]) -> str:
    """A checksum of the anchor, ``params`` and an inner optimizer ``state_dict``'s tensors."""
    moments = [
        v for s in inner_state["state"].values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    return _digest([*algo.anchor_views, *params, *[m.reshape(-1) for m in moments]])


def _build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowcomm.testing.elastic")
    parser.add_argument("--lighthouse", required=True, help="one address per --algo, commas")
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--algo", default="diloco", help="one or several, commas")
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--syncs", type=int, default=20)
    parser.add_argument("--log", required=True)
    parser.add_argument("--die-after-quorum", type=int, default=0)
    parser.add_argument("--die-from", type=int, default=0)
    parser.add_argument("--die-as-donor", default=None)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--start-together", default=None)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args(argv)
    algos = args.algo.split(",")
    lighthouses = args.lighthouse.split(",")
    if len(lighthouses) != len(algos):
        parser.error(f"{len(algos)} --algo values need as many --lighthouse addresses")
    if args.start_together and len(set(algos)) != len(algos):
        parser.error("--start-together tells the jobs apart by name: no --algo twice")
    log = open(args.log, "a", encoding="utf-8")  # noqa: SIM115 - closed at the end
    # every job's objects stay alive until the process ends (exit_now): releasing a finished
    # job's gloo process group while this process runs on is not what a replica process does
    kept: list[Any] = []
    for i, (algo_name, lighthouse) in enumerate(zip(algos, lighthouses, strict=True)):
        die = args.die_after_quorum if i >= args.die_from else 0
        together = args.start_together if i > 0 else None
        kept.append(_run(args, algo_name, lighthouse, log, die, together))
    log.close()
    return 0


def _start_together(folder: str, name: str, replica_id: str, replicas: int) -> None:
    """Wait (at most 60 s) until ``replicas`` replicas have said, in ``folder``, that they are
    ready for the job ``name``."""
    with open(os.path.join(folder, f"{name}.{replica_id}"), "w"):
        pass
    deadline = time.monotonic() + 60.0
    while sum(f.startswith(f"{name}.") for f in os.listdir(folder)) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{replica_id}: the other replicas of {name} did not start")
        time.sleep(0.01)


def _run(
    args: argparse.Namespace, name: str, lighthouse: str, log: Any, die: int, together: str | None
) -> Any:
    """One job of ``--algo``: train until ``--syncs`` syncs are committed, writing its records
    to ``log`` (once every replica is ready, with ``together``); returns what must outlive it
    (its Manager, model and algorithm)."""
    import lowcomm
    from lowcomm.elastic import replica_manager

    algo_name, *codec = name.split("+")
    warm = "warm" in codec
    background = "bg" in codec
    in_backward = "backward" in codec
    pace = args.step_sleep + (0.15 if "paced" in codec else 0.0)
    merged = "merge" in codec
    codec = [c for c in codec if c not in ("warm", "bg", "backward", "paced", "merge")]
    reset = codec[-1:] == ["reset"]
    codec = codec[:-1] if reset else codec
    replica = replica_manager(
        lighthouse,
        replica_id=args.replica_id,
        timeout_s=args.timeout,
        quorum_timeout_s=60,
        dropped_residual="reset" if reset else "keep",
        heal="background" if background else "blocking",
    )
    model, inner = _build(args)
    kwargs: dict[str, Any] = {"sync_every": args.sync_every, "sync_warmup": 0}
    if warm:
        kwargs.update(sync_warmup=3 * args.sync_every, sync_warmup_compression="int8")
    if codec:
        kwargs["compression"] = codec[0]
    if algo_name == "co2":
        kwargs["overlap"] = 1
    if merged:  # (the job's SparseLoCo: a step in flight, the delay-corrected merge)
        kwargs.update(overlap=1, merge="delay_corrected")
    if algo_name in ("streaming", "cocodc"):
        kwargs.update(num_fragments=2, overlap=1, fragments=_layers(model))
    cls = {
        "diloco": lowcomm.DiLoCo,
        "slowmo": lowcomm.SlowMo,
        "localsgd": lowcomm.LocalSGD,
        "co2": lowcomm.CO2,
        "streaming": lowcomm.StreamingDiLoCo,
        "cocodc": lowcomm.CoCoDC,
        "sparseloco": lowcomm.SparseLoCo,
    }
    algo = cls[algo_name](model, inner, fault_tolerance=replica, **kwargs)
    ft = algo.ft
    assert ft is not None
    if in_backward:
        algo.warm_start_during_backward()

    def write(**record: Any) -> None:
        record = {"replica": args.replica_id, "algo": name, "t": time.time(), **record}
        log.write(json.dumps(record) + "\n")
        log.flush()

    # the state the donor sends, checked by the joiner against its own after the heal: the
    # anchor, the parameters (past the warm start the joiner's are the anchor) and the inner
    # optimizer's state (past the warm start its moments in bf16)
    # (healed in the background, only the counters come with the quorum: the tensors are
    # checked by the anchors of the syncs after it caught up, which every replica holds alike)
    def donor_state() -> dict[str, Any]:
        sent = algo.elastic_syncs.heal_state()
        if "background" in sent:
            return {"digest": None}
        params = sent.get("params") or algo.anchor_views
        return {"digest": _state_digest(algo, params, sent["inner"])}

    def healed(state: dict[str, Any]) -> None:
        background = state["digest"] is None
        mine = (
            None
            if background
            else _state_digest(algo, list(model.parameters()), inner.state_dict())
        )
        write(event="healed", donor=state["digest"], mine=mine, background=background)

    ft.register("test", donor_state, healed)
    if die:
        quorum = ft.quorum
        launched = [0]

        def quorum_then_die(**kwargs: Any) -> bool:
            result = quorum(**kwargs)
            launched[0] += 1
            if launched[0] == die:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        ft.quorum = quorum_then_die

    if args.die_as_donor:
        from lowcomm.train.faults import die_as_donor

        die_as_donor(replica.transport, args.die_as_donor)

    if together is not None:
        _start_together(together, name, args.replica_id, args.replicas)
    gen = torch.Generator().manual_seed(1000 + int(args.replica_id.rsplit("_", 1)[-1]))
    seen = algo.sync_points
    committed = 0
    warm_seen = (0, 0)  # (local step, warm steps committed) after the last warm step
    guard = 0
    while ft.step < args.syncs and guard < 100 * args.syncs * args.sync_every:
        guard += 1
        x = torch.randn(8, 16, generator=gen)
        if in_backward:
            algo.before_forward()
        loss = ((model(x) - x.flip(1)) ** 2).mean()
        loss.backward()
        sent = sum(b.handle is not None for b in algo.warm.buckets) if in_backward else None
        inner.step()
        inner.zero_grad()
        algo.step()
        if pace:
            time.sleep(pace)
        if warm and algo.local_step <= algo.warmup and algo.local_step != warm_seen[0]:
            write(
                event="warm",
                committed=ft.warm_steps > warm_seen[1],
                warm_step=ft.warm_steps,
                participants=ft.quorum_size,
                params=_digest(list(model.parameters())),
                local_step=algo.local_step,
                in_backward=sent,
            )
            warm_seen = (algo.local_step, ft.warm_steps)
        if algo.sync_points != seen:
            seen = algo.sync_points
            catching_up = algo.elastic_syncs.catching_up
            write(
                event="sync",
                committed=ft.step > committed,
                catching_up=catching_up,
                sync=ft.step,
                participants=ft.participants[-1] if ft.participants else None,
                anchor=None if catching_up else _digest(algo.anchor_views),
                params=_digest(list(model.parameters())),
                local_step=algo.local_step,
                failed=ft.failed_syncs,
                residual=sum(
                    float(r.double().pow(2).sum()) for c in algo.compressors() for r in c.residuals
                ),
            )
            committed = ft.step
    algo.finish()
    write(event="done", sync=ft.step, params=_digest(list(model.parameters())), heals=ft.heals)
    replica.shutdown()
    write(event="closed")
    return replica, model, inner, algo


if __name__ == "__main__":
    from lowcomm.procs.forkserver import exit_now

    exit_now(main())  # as `python -m lowcomm.train`: gloo's threads can abort finalisation
