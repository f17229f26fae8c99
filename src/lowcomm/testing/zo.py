"""References for :mod:`lowcomm.zo` and the distributed runs the tests compare with them.

:func:`mezo_reference` is MeZO's ``zo_step`` / ``zo_update`` transcribed (princeton-nlp/MeZO,
``large_models/trainer.py``): the global torch seed set per pass, ``param.data = param.data +
scaling_factor * z * eps``, ``projected_grad = ((loss1 - loss2) / (2 * eps)).item()``,
``param.data = param.data - lr * (projected_grad * z + weight_decay * param.data)`` with MeZO's
name rule, the seeds given (MeZO draws them from numpy; lowcomm derives them from (seed, step)).
For n directions it applies lowcomm's rule (g/n and wd/n per direction, estimates at the same θ).
:func:`sharded_reference` is data parallelism in one process: per-shard L± combined as
Σ wᵣ L±ᵣ in float64 in shard order. :func:`naive_pertp_step` is the PertP that does not replay
every addition (the negative control: its replicas drift).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.data import get_batch, load_corpus, make_generator
from lowcomm.models.gpt import GPT, GPTConfig
from lowcomm.zo import MeZO, ReplicaDriftError, zo_seed

__all__ = [
    "mezo_reference",
    "naive_pertp_step",
    "sharded_reference",
    "tiny_model",
    "tiny_batches",
    "tiny_loss",
    "zo_scenarios",
]

Closure = Callable[[], torch.Tensor]


def tiny_model(seed: int = 0, n_layer: int = 1) -> GPT:
    """A 7.7k-parameter GPT (one block, width 16, biases and LayerNorms: both decay rules;
    ``n_layer`` blocks of 3.2k parameters each)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=n_layer, n_head=2, n_embd=16))


def tiny_batches(
    steps: int, batch: int = 8, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``batch`` windows of 16 bytes of the embedded corpus."""
    corpus = load_corpus(None)
    gen = make_generator(seed, 0)
    return [get_batch(corpus.train, batch, 16, gen) for _ in range(steps)]


def tiny_loss(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The model's mean cross-entropy on (x, y)."""
    _, loss = model(x, y)
    return loss


def _mezo_perturb(
    named: Sequence[tuple[str, torch.Tensor]], seed: int, scaling: float, eps: float
) -> None:
    torch.manual_seed(seed)
    for _, param in named:
        z = torch.normal(
            mean=0, std=1, size=param.data.size(), device=param.data.device, dtype=param.data.dtype
        )
        param.data = param.data + scaling * z * eps


def mezo_reference(
    model: nn.Module,
    losses: Sequence[Callable[[], tuple[torch.Tensor, torch.Tensor] | torch.Tensor]],
    *,
    seeds: Sequence[Sequence[int]],
    lr: float,
    eps: float,
    weight_decay: float,
    shard_losses: bool = False,
) -> list[dict[str, list[float]]]:
    """Steps of MeZO on ``model``, one per entry of ``losses`` (a closure returning the loss,
    or with ``shard_losses`` the global (L) from :func:`sharded_reference`'s combination),
    with ``seeds[step]`` (one per direction). Returns each step's L₊, L₋ and g per direction."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    records = []
    rng_state = torch.get_rng_state()
    try:
        for closure, step_seeds in zip(losses, seeds):
            n = len(step_seeds)
            model.eval()
            record: dict[str, list[float]] = {"plus": [], "minus": [], "g": []}
            grads = []
            for s in step_seeds:
                _mezo_perturb(named, s, 1, eps)
                with torch.inference_mode():
                    loss1 = closure()
                _mezo_perturb(named, s, -2, eps)
                with torch.inference_mode():
                    loss2 = closure()
                assert isinstance(loss1, torch.Tensor) and isinstance(loss2, torch.Tensor)
                projected_grad = ((loss1 - loss2) / (2 * eps)).item()
                _mezo_perturb(named, s, 1, eps)
                grads.append(projected_grad)
                record["plus"].append(float(loss1))
                record["minus"].append(float(loss2))
                record["g"].append(projected_grad)
            for s, g in zip(step_seeds, grads):
                torch.manual_seed(s)
                g_k = g / n if n > 1 else g
                wd = weight_decay / n if n > 1 else weight_decay
                for name, param in named:
                    z = torch.normal(
                        mean=0,
                        std=1,
                        size=param.data.size(),
                        device=param.data.device,
                        dtype=param.data.dtype,
                    )
                    decays = (
                        "bias" not in name and "layer_norm" not in name and "layernorm" not in name
                    )
                    if decays and weight_decay != 0:
                        param.data = param.data - lr * (g_k * z + wd * param.data)
                    else:
                        param.data = param.data - lr * (g_k * z)
            records.append(record)
    finally:
        torch.set_rng_state(rng_state)
    return records


def sharded_reference(model: GPT, shards: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Closure:
    """The global loss of data parallelism over ``shards`` in one process: each shard's loss,
    Σ wᵣ Lᵣ (wᵣ = examples / all examples) in float64 in shard order, as float32."""

    def closure() -> torch.Tensor:
        sizes = [float(x.shape[0]) for x, _ in shards]
        total = 0.0
        for size in sizes:
            total += size
        acc = 0.0
        for size, (x, y) in zip(sizes, shards):
            acc += size / total * float(tiny_loss(model, x, y))
        return torch.tensor(acc, dtype=torch.float32)

    return closure


def naive_pertp_step(
    model: GPT,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    rank: int,
    seed: int,
    step: int,
    lr: float,
    eps: float,
    group: Any = None,
) -> None:
    """PertP done naively: rank 0 adds εz, evaluates, subtracts εz; rank 1 subtracts, evaluates,
    adds back. θ + εz − εz and θ − εz + εz round differently, so the replicas drift."""
    zo = MeZO(model, lr=lr, eps=eps, seed=seed)
    s = zo_seed(seed, step)
    sign = 1 if rank == 0 else -1
    zo._perturb(s, sign)
    with torch.inference_mode():
        mine = tiny_loss(model, x, y).reshape(1)
    zo._perturb(s, -sign)
    both = [torch.zeros(1), torch.zeros(1)]
    dist.all_gather(both, mine, group=group)
    g = float(((both[0][0] - both[1][0]) / (2 * eps)).item())
    zo._update(s, g, lr)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def zo_scenarios(rank: int, world: int, steps: int, settings: dict[str, Any]) -> dict[str, Any]:
    """The distributed runs on 4 ranks: PertP and DDP on ranks {0, 1} (a subgroup), 2D on all
    four, the naive PertP, and a drifted replica caught by the check."""
    assert world == 4
    batches = tiny_batches(steps)
    pair = dist.new_group([0, 1])
    out: dict[str, Any] = {}

    def run(
        mode: str,
        group: Any,
        data: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        blockwise: bool = False,
        offload: bool = False,
    ) -> dict[str, Any]:
        model = tiny_model(n_layer=3 if offload else 1)
        zo = MeZO(
            model,
            mode=mode,
            process_group=group,
            check_every=2,
            blockwise=blockwise,
            offload=offload,
            **settings,
        )
        results = []
        for i in range(steps):
            x, y = data(i)

            def closure(
                x: torch.Tensor = x, y: torch.Tensor = y, model: GPT = model
            ) -> torch.Tensor:
                return tiny_loss(model, x, y)

            if zo.blockwise:
                result = zo.step(stages=model.zo_stages(x, y), weight=float(x.shape[0]))
            else:
                result = zo.step(closure, weight=float(x.shape[0]))
            results.append(result)
            if offload and i == steps // 2:  # resumed into a fresh MeZO, an update pending
                state, saved = zo.state_dict(), _params(model)
                model = tiny_model(seed=1, n_layer=3)
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        p.copy_(saved[name])
                zo = MeZO(
                    model, mode=mode, process_group=group, check_every=2, offload=True, **settings
                )
                zo.load_state_dict(state)
        zo.flush()
        # plain dicts: the parent loads results with weights_only=True (ZOStep(**d) rebuilds)
        steps_done = [dataclasses.asdict(r) for r in results]
        return {"params": _params(model), "steps": steps_done, "bytes": zo.stats.wire_bytes}

    half = batches[0][0].shape[0] // 2

    def own(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batches[i][0][rank * half : (rank + 1) * half], batches[i][1][
            rank * half : (rank + 1) * half
        ]

    def pairs(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = rank // 2
        return batches[i][0][shard * half : (shard + 1) * half], batches[i][1][
            shard * half : (shard + 1) * half
        ]

    if rank < 2:
        out["pertp"] = run("pertp", pair, lambda i: batches[i])
        out["pertp-blockwise"] = run("pertp", pair, lambda i: batches[i], blockwise=True)
        out["ddp"] = run("ddp", pair, own)
        # ZO2's offloading (3 blocks through 2 buffers, resumed halfway) on a 3-block model
        # (the test computes the references)
        out["pertp-offload"] = run("pertp", pair, lambda i: batches[i], offload=True)
        out["ddp-offload"] = run("ddp", pair, own, offload=True)
    dist.barrier()
    out["2d"] = run("2d", None, pairs)
    out["2d-offload"] = run("2d", None, pairs, offload=True)

    # the negative control, and the check that catches it
    if rank < 2:
        model = tiny_model()
        for i in range(steps):
            naive_pertp_step(
                model,
                *batches[i],
                rank=rank,
                seed=settings.get("seed", 0),
                step=i + 1,
                lr=settings["lr"],
                eps=settings.get("eps", 1e-3),
                group=pair,
            )
        out["naive"] = _params(model)
        zo = MeZO(model, mode="pertp", process_group=pair, **settings)
        try:
            zo.check_replicas()
            out["caught"] = None
        except ReplicaDriftError as e:
            out["caught"] = str(e)
    dist.barrier()
    return out
