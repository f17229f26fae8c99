"""Sharded inner training inside node groups, lowcomm across them, on 4 real gloo ranks.

Two node groups of two ranks ({0, 1}, {2, 3}); lowcomm averages over the cross groups of ranks
with the same place in their node ({0, 2}, {1, 3}). Inside each node the model trains with

* ``DistributedDataParallel`` over the node group (the reference),
* ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer`` (AdamW state sharded in the node),
* FSDP2 ``fully_shard`` on a node mesh (parameters, gradients and AdamW state sharded): the
  parameters are DTensors and lowcomm works on each rank's local shard — the two ranks of a
  cross group hold matching shards, so averaging shards averages the model.

All three end bit-identical (CPU, gloo, torch 2.13), for DiLoCo and CO2, with the outer state
sharded as well, and every rank agrees on the model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import lowcomm
from lowcomm.testing import run_workers

STEPS = 8


def _train(rank: int, node: Any, cross: Any, inner_kind: str, algo: str, shard: bool) -> Any:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    # uneven sizes: 7 and 3 rows do not split evenly over 2 ranks
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    net: torch.nn.Module
    if inner_kind == "fsdp2":
        fully_shard(model, mesh=DeviceMesh.from_group(node, "cpu"))
        net = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=node)
    inner: torch.optim.Optimizer
    if inner_kind == "zero":
        inner = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, process_group=node, lr=0.01
        )
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    outer = getattr(lowcomm, algo)(
        model, inner, sync_every=2, process_group=cross, shard_outer_state=shard
    )
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + step)  # every rank its own batch
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        torch.nn.functional.mse_loss(net(x), y).backward()
        inner.step()
        inner.zero_grad()
        outer.step()
    outer.finish()
    full = [getattr(p, "full_tensor", lambda p=p: p)() for p in model.parameters()]
    return [t.detach().clone() for t in full]


CASES = [(algo, shard) for algo in ("DiLoCo", "CO2") for shard in (False, True)]


def _job(rank: int, world_size: int) -> dict[Any, Any]:
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    crosses = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    node, cross = nodes[rank // 2], crosses[rank % 2]
    torch.manual_seed(0)
    start = [
        p.detach().clone()
        for p in torch.nn.Sequential(
            torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)
        ).parameters()
    ]
    out: dict[Any, Any] = {"start": start}
    for algo, shard in CASES:
        for kind in ("ddp", "zero", "fsdp2"):
            out[(algo, shard, kind)] = _train(rank, node, cross, kind, algo, shard)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[Any, Any]]:
    return run_workers(_job, 4, timeout_s=300)


@pytest.mark.parametrize("kind", ["zero", "fsdp2"])
@pytest.mark.parametrize("algo,shard", CASES)
def test_sharded_inner_training_equals_ddp(
    results: list[dict[Any, Any]], algo: str, shard: bool, kind: str
) -> None:
    for r in results:
        reference, sharded = r[(algo, shard, "ddp")], r[(algo, shard, kind)]
        assert all(torch.equal(a, b) for a, b in zip(reference, sharded))
        assert not all(torch.equal(a, b) for a, b in zip(reference, r["start"]))  # it trained
    # and every rank of every node ends on the same model
    for r in results[1:]:
        assert all(
            torch.equal(a, b)
            for a, b in zip(r[(algo, shard, kind)], results[0][(algo, shard, kind)])
        )
