"""`lowcomm train --nodes K --procs-per-node M`: node groups on one machine, with real processes.

K emulated nodes of M processes (ranks node-major): DDP inside each node, the algorithm across
nodes over the ranks with the same local index; optionally ZeRO inside the node. Pinned here:

* the layout: the two processes of a node hold the same model at every step (DDP), the nodes
  differ within a round and agree after it, and every rank ends with the same parameters;
* the numerics: with one process per node the job is the flat job bit for bit (DDP over one
  process changes nothing, the cross-node group is every rank); ``--node-sharding zero`` gives
  the same bits as plain AdamW, and its per-rank checkpoints resume exactly after a real kill;
  ``--algo ddp`` with nodes is DDP over every process, bit for bit;
* the refusals: one line, exit code 2, before any worker starts.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lowcomm.cli import main
from lowcomm.testing.jobs import read_summary, run_train_job, tiny_job_args
from lowcomm.testing.runs import assert_identical, final_state, metric_numbers, rank_state
from lowcomm.train import checkpoint as ckpt
from lowcomm.train.config import ConfigError, TrainConfig, config_from_dict
from lowcomm.train.launcher import check_torchrun_layout
from lowcomm.train.loop import FAULT_ENV

# The tiny job without its worker count (the runs give their layout): 12 steps, rounds of 4, so
# the checkpoint of step 6 is mid-round, that of step 12 right after a round; dropout so that
# the RNG state matters on resume.
BASE = tiny_job_args(workers=None)
NODES_2X2 = ["--nodes", "2", "--procs-per-node", "2"]
RUNS: dict[str, list[str]] = {
    "co2": ["--algo", "co2", *NODES_2X2, "--checkpoint-every", "6"],
    "co2-zero": ["--algo", "co2", *NODES_2X2, "--node-sharding", "zero", "--checkpoint-every", "6"],
    "diloco-2x1": ["--algo", "diloco", "--nodes", "2", "--procs-per-node", "1"],
    "diloco-flat": ["--algo", "diloco", "--workers", "2"],
    "ddp-2x2-zero": ["--algo", "ddp", *NODES_2X2, "--node-sharding", "zero"],
    "ddp-4": ["--algo", "ddp", "--workers", "4"],
}


def _argv(name: str, out: str) -> list[str]:
    return ["train", *BASE, *RUNS[name], "--out", out]


@pytest.fixture(scope="module")
def run(tmp_path_factory: Any) -> Callable[[str], tuple[str, str]]:
    """A run of :data:`RUNS` (made once per module): its folder and what it printed."""
    runs: dict[str, tuple[str, str]] = {}

    def get(name: str) -> tuple[str, str]:
        if name not in runs:
            out = str(tmp_path_factory.mktemp("runs") / name)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                run_train_job(out, *BASE, *RUNS[name])
            runs[name] = (out, printed.getvalue())
        return runs[name]

    return get


@pytest.mark.timeout(180)
def test_2x2_run_from_the_cli_reports_its_layout(run: Callable[[str], tuple[str, str]]) -> None:
    out, printed = run("co2")
    workers = [line.split() for line in printed.splitlines() if line.strip().startswith("workers")]
    assert workers == [["workers", "4", "(2", "nodes", "x", "2)"]], printed
    assert "DDP inside each node, co2 across nodes" in printed
    assert "cross-node wire / worker" in printed and "intra-node wire / worker" in printed
    summary = read_summary(out)
    assert summary["workers"] == 4 and summary["replicas_identical"] is True
    layout = summary["layout"]
    assert (layout["nodes"], layout["procs_per_node"], layout["node_sharding"]) == (2, 2, "none")
    assert layout["across_nodes"] == "co2"
    # the algorithm's counters are its cross-node group's: a ring of 2 sends 2 (2-1)/2 = 1x the
    # payload; 3 rounds of the whole model
    mean = summary["comm_mean"]
    assert mean["rounds"] == 3
    assert mean["wire_bytes"] == mean["payload_bytes"] == 3 * 4 * summary["parameters"]
    assert layout["cross_node_wire_bytes_per_node"] == 2 * mean["wire_bytes"]
    # DDP inside the node: every gradient every step, a ring of 2
    intra = layout["intra_node"]
    assert intra["payload_bytes"] == intra["wire_bytes"] == 12 * 4 * summary["parameters"]
    assert summary["val_loss_final"] < summary["val_loss_initial"]


@pytest.mark.timeout(180)
def test_a_node_holds_one_replica_and_every_rank_ends_with_the_same(
    run: Callable[[str], tuple[str, str]],
) -> None:
    out, _ = run("co2")
    # step 6, mid-round: the processes of a node agree (DDP), the nodes do not (own data)
    mid = [rank_state(out, 6, r) for r in range(4)]
    for a, b in ((0, 1), (2, 3)):
        assert_identical(mid[a]["model"], mid[b]["model"], f"step 6 ranks {a}, {b}")
        assert_identical(mid[a]["optimizer"], mid[b]["optimizer"], f"AdamW ranks {a}, {b}")
    assert not torch.equal(mid[0]["model"]["wte.weight"], mid[2]["model"]["wte.weight"])
    # step 12, right after a round: all four hold the anchor, and the same algorithm state
    # (the round's average in flight included), from which finish() ends alike everywhere
    end = [rank_state(out, 12, r) for r in range(4)]
    for r in range(1, 4):
        assert_identical(end[0]["model"], end[r]["model"], f"step 12 rank {r}")
        assert_identical(end[0]["algorithm"], end[r]["algorithm"], f"algorithm rank {r}")
    # after finish(): the parameters of every rank, by checksum
    workers = read_summary(out)["comm_per_worker"]
    assert len({w["params_checksum"] for w in workers}) == 1


@pytest.mark.timeout(180)
def test_one_process_per_node_is_the_flat_job_bit_for_bit(
    run: Callable[[str], tuple[str, str]],
) -> None:
    # DiLoCo on 2 nodes of 1 process (DDP over a single process, DiLoCo over the cross-node
    # group {0, 1}) against DiLoCo on 2 workers: same seeds, same data per rank.
    hier, _ = run("diloco-2x1")
    flat, _ = run("diloco-flat")
    assert_identical(final_state(flat)["model"], final_state(hier)["model"], "final model")
    assert_identical(
        final_state(flat)["algorithm"], final_state(hier)["algorithm"], "final algorithm"
    )
    assert_identical(final_state(flat)["optimizer"], final_state(hier)["optimizer"], "final AdamW")
    assert metric_numbers(hier) == metric_numbers(flat)
    assert read_summary(hier)["layout"]["procs_per_node"] == 1
    assert read_summary(flat)["layout"] is None


@pytest.mark.timeout(180)
def test_zero_inside_the_node_gives_the_same_bits(
    run: Callable[[str], tuple[str, str]],
) -> None:
    plain, _ = run("co2")
    zero, _ = run("co2-zero")
    # AdamW is elementwise per parameter: sharding it changes no bit
    assert_identical(final_state(plain)["model"], final_state(zero)["model"], "final model")
    assert_identical(
        final_state(plain)["algorithm"], final_state(zero)["algorithm"], "final algorithm"
    )
    # checkpoint.pt holds the whole AdamW state, gathered from the shards of node 0
    assert_identical(
        final_state(plain)["optimizer"]["state"], final_state(zero)["optimizer"]["state"]
    )
    for g_plain, g_zero in zip(
        final_state(plain)["optimizer"]["param_groups"],
        final_state(zero)["optimizer"]["param_groups"],
    ):
        for key in ("params", "lr", "weight_decay", "betas", "eps"):
            assert g_plain[key] == g_zero[key], key
    for r in range(4):
        assert_identical(rank_state(plain, 6, r)["model"], rank_state(zero, 6, r)["model"])
    assert metric_numbers(zero) == metric_numbers(plain)
    # a rank's checkpoint holds its shard: the two processes of a node split the parameters
    shards = [rank_state(zero, 6, r)["optimizer"]["state"] for r in range(2)]
    n_params = len(final_state(plain)["optimizer"]["state"])
    assert len(shards[0]) + len(shards[1]) == n_params and shards[0] and shards[1]
    summary = read_summary(zero)
    assert summary["layout"]["node_sharding"] == "zero" and summary["replicas_identical"]


@pytest.mark.timeout(180)
def test_ddp_with_nodes_is_ddp_over_every_process_zero_sharded_in_the_node(
    run: Callable[[str], tuple[str, str]],
) -> None:
    nodes, printed = run("ddp-2x2-zero")
    flat, _ = run("ddp-4")
    for key in ("model", "optimizer"):
        assert_identical(final_state(flat)[key], final_state(nodes)[key], f"final {key}")
    assert metric_numbers(nodes) == metric_numbers(flat)
    layout = read_summary(nodes)["layout"]
    assert (layout["across_nodes"], layout["intra_node"]) == ("ddp", None)
    assert "zero (AdamW state across the 2 processes of a node)" in printed
    assert "DDP inside each node" not in printed


@pytest.mark.timeout(240)
def test_zero_run_killed_and_resumed_is_bit_identical(
    run: Callable[[str], tuple[str, str]], tmp_path: Any, monkeypatch: Any, capsys: Any
) -> None:
    ref, _ = run("co2-zero")
    out = str(tmp_path / "run")
    argv = _argv("co2-zero", out)
    capsys.readouterr()
    monkeypatch.setenv(FAULT_ENV, "3:8")  # node 1's second process, mid-round
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "lowcomm train: error: worker rank 3 failed: killed by signal 9 (SIGKILL)"
    assert [s for s, _ in ckpt.complete_checkpoints(out)] == [6]
    monkeypatch.delenv(FAULT_ENV)
    assert main([*argv, "--resume"]) == 0
    for r in range(4):  # model, AdamW shard, CO2 state, RNG states of every rank
        assert_identical(rank_state(ref, 12, r), rank_state(out, 12, r), f"rank {r}")
    for key in ("model", "optimizer", "algorithm"):
        assert_identical(final_state(ref)[key], final_state(out)[key], f"final {key}")
    assert metric_numbers(out) == metric_numbers(ref)
    assert read_summary(out)["resumed_at"] == [6]


@pytest.mark.timeout(120)
def test_a_checkpoint_resumes_only_into_the_same_layout(
    run: Callable[[str], tuple[str, str]], capsys: Any
) -> None:
    out, _ = run("co2")
    step6 = os.path.join(out, ckpt.CHECKPOINTS, "step-000006")
    capsys.readouterr()
    argv = ["train", *BASE, "--algo", "co2", "--workers", "4", "--out", out, "--resume", step6]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert "was written with nodes=2 but this run has nodes=1" in line, line


# --- configuration: resolution and refusals (no worker starts) --------------------------------


def test_layout_resolution() -> None:
    flat = TrainConfig()
    assert (flat.workers, flat.nodes, flat.procs_per_node, flat.hierarchical) == (2, 1, None, False)
    # one node is the flat layout: --procs-per-node alone is --workers
    assert TrainConfig(procs_per_node=3).workers == 3
    assert TrainConfig(procs_per_node=3).procs_per_node is None
    cfg = TrainConfig(nodes=2, procs_per_node=3)
    assert (cfg.workers, cfg.world_size, cfg.node_size, cfg.hierarchical) == (6, 6, 3, True)
    assert TrainConfig(nodes=2, workers=6).procs_per_node == 3
    assert TrainConfig(nodes=2, procs_per_node=3, workers=6).workers == 6
    # ddp: every process, sharded inside a node (or, on one node, across all)
    assert TrainConfig(algo="ddp", nodes=2, procs_per_node=2).hierarchical is False
    assert TrainConfig(algo="ddp", nodes=2, procs_per_node=2, node_sharding="zero").node_size == 2
    assert TrainConfig(algo="ddp", workers=3, node_sharding="zero").node_size == 3
    # the resolved config builds the same config again (config.json, checkpoints)
    again = config_from_dict(dict(**{**cfg.to_dict(), "name": None, "out": None}))
    assert (again.workers, again.nodes, again.procs_per_node) == (6, 2, 3)


def _one_error_line(capsys: Any) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--nodes", "0"], "--nodes must be >= 1, got 0"),
        (["--nodes", "2", "--procs-per-node", "0"], "--procs-per-node must be >= 1, got 0"),
        (
            [*NODES_2X2, "--workers", "3"],
            "--workers (3) conflicts with nodes (2) x procs_per_node (2) = 4 processes; "
            "drop workers or set it to 4",
        ),
        (["--nodes", "2", "--workers", "3"], "--workers (3) is not a multiple of nodes (2)"),
        (["--nodes", "3"], "--nodes (3) needs procs_per_node (--procs-per-node M"),
        (
            ["--procs-per-node", "2", "--workers", "3"],
            "--workers (3) conflicts with procs_per_node (2) on one node",
        ),
        (
            [*NODES_2X2, "--algo", "none"],
            "--nodes (2) does not apply to algo none, which trains every process alone; use "
            "workers (--workers 4)",
        ),
        (["--node-sharding", "half"], "--node-sharding must be one of none, zero, got 'half'"),
        (
            ["--node-sharding", "zero"],
            "--node-sharding 'zero' shards AdamW across the processes of a node, which train "
            "one replica with DDP; with algo co2 that needs nodes >= 2",
        ),
        (
            ["--nodes", "2", "--procs-per-node", "1", "--node-sharding", "zero"],
            "--node-sharding 'zero' needs at least 2 processes per node",
        ),
        (
            ["--algo", "none", "--node-sharding", "zero"],
            "--node-sharding 'zero' shards AdamW across processes that train one replica",
        ),
    ],
)
def test_bad_layouts_are_one_line_errors(argv: list[str], expected: str, capsys: Any) -> None:
    assert main(["train", *argv]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"lowcomm train: error: {expected}"), line


def test_torchrun_must_start_the_layout_the_flags_ask_for(monkeypatch: Any, capsys: Any) -> None:
    cfg = TrainConfig(algo="co2", nodes=2, procs_per_node=2)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "pytest")

    def env(rank: int, local_rank: int, world: int, local_world: int) -> None:
        for key, value in (
            ("RANK", rank),
            ("LOCAL_RANK", local_rank),
            ("WORLD_SIZE", world),
            ("LOCAL_WORLD_SIZE", local_world),
        ):
            monkeypatch.setenv(key, str(value))

    env(3, 1, 4, 2)  # torchrun --nnodes 2 --nproc-per-node 2: node 1, local rank 1
    check_torchrun_layout(cfg)
    env(1, 1, 2, 2)  # --nnodes 1
    with pytest.raises(ConfigError, match=r"but torchrun started 2 \(WORLD_SIZE\); start it"):
        check_torchrun_layout(cfg)
    env(3, 3, 4, 4)  # --nnodes 1 --nproc-per-node 4
    with pytest.raises(ConfigError, match=r"differs from the 4 processes torchrun started"):
        check_torchrun_layout(cfg)
    env(3, 0, 4, 2)
    with pytest.raises(ConfigError, match="not node-major: rank 3 is local rank 0"):
        check_torchrun_layout(cfg)
    # one line from the CLI, before anything starts
    env(1, 1, 2, 2)
    assert main(["train", *NODES_2X2]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(
        "lowcomm train: error: --nodes (2) x procs_per_node (2) = 4 processes, but torchrun "
        "started 2 (WORLD_SIZE); start it with torchrun --nnodes 2 --nproc-per-node 2"
    ), line
