"""Distributed scenarios for :mod:`lowcomm.balance` the tests run on real gloo processes.

:func:`balance_scenarios` runs, in one process group: ring attention against full causal
attention (fp64, outputs and gradients, attention alone and through a GPT), the averaged
gradient of one unit of documents under every assignment (random, token-balanced,
cost-balanced, cost-balanced with split documents) against the single-process gradient of the
mean token loss, whether every rank computed the same plan, and a :class:`DocumentStream`
restored from its state against one that ran on.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lowcomm.balance import (
    CostModel,
    DocumentCorpus,
    DocumentStream,
    RingAttention,
    SplitPolicy,
    zigzag_positions,
    zigzag_sizes,
    zigzag_take,
)
from lowcomm.models.gpt import GPT, GPTConfig, Packed

__all__ = ["balance_scenarios", "synthetic_corpus", "tiny_doc_model"]

CAP = 96
"""Longest document piece of the scenarios."""


def synthetic_corpus(n: int = 40, seed: int = 0) -> DocumentCorpus:
    """Random-token documents of 20 to 300 tokens (long-tailed: most short, a few long)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (20 + 280 * torch.rand(n, generator=gen) ** 3).long().tolist()
    docs = [torch.randint(256, (s,), generator=gen) for s in lengths]
    return DocumentCorpus(train=docs, val=docs[:4], vocab_size=256, source="synthetic")


def tiny_doc_model(dtype: torch.dtype = torch.float64) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=CAP, n_layer=2, n_head=2, n_embd=16)
    return GPT(cfg).to(dtype)


def _ring_attention(rank: int, world: int, length: int) -> list[float]:
    """Max |difference| of outputs and q/k/v gradients: ring against full attention."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, g = (torch.randn(1, 2, length, 8, generator=gen, dtype=torch.float64) for _ in "qkvg")
    for t in (q, k, v):
        t.requires_grad_()
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    full.backward(g)
    sizes = zigzag_sizes(length, world)
    pos = zigzag_positions(sizes, rank)
    ql, kl, vl = (t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    ring = RingAttention(None, ranks=range(world), index=rank, sizes=sizes)
    out = ring(ql, kl, vl)
    out.backward(g[:, :, pos])
    diffs = [out.detach() - full.detach()[:, :, pos]]
    diffs += [a.grad - b.grad[:, :, pos] for a, b in ((ql, q), (kl, k), (vl, v))]  # type: ignore[index,operator]
    return [float(d.abs().max()) for d in diffs]


def _flat_grad(model: GPT) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            for p in model.parameters()
        ]
    )


def _model_split(rank: int, world: int, ring_group: Any) -> float:
    """A GPT's loss gradient over one document split over every rank against the whole."""
    model = tiny_doc_model()
    doc = synthetic_corpus().train[3][: CAP + 1]
    x, y = doc[:-1], doc[1:]
    _, loss = model(x[None], y[None], reduction="sum")
    loss.backward()
    full = _flat_grad(model)
    model.zero_grad()
    sizes = zigzag_sizes(len(x), world)
    ring = RingAttention(ring_group, ranks=range(world), index=rank, sizes=sizes)
    packed = Packed(
        lengths=[len(zigzag_take(x, sizes, rank))],
        positions=zigzag_positions(sizes, rank),
        split=ring,
    )
    _, part = model(
        zigzag_take(x, sizes, rank)[None],
        zigzag_take(y, sizes, rank)[None],
        packed=packed,
        reduction="sum",
    )
    part.backward()
    grad = _flat_grad(model)
    dist.all_reduce(grad)
    return float((grad - full).abs().max())


def _unit_gradient(stream: DocumentStream, model: GPT) -> tuple[torch.Tensor, list[Any]]:
    """The averaged gradient of one step of ``stream`` (all-reduce mean, as DDP), and the plan."""
    model.zero_grad()
    work = stream.next_step()
    scale = stream.loss_scale()
    for mb in work.micro_batches:
        _, total = model(mb.x, mb.y, packed=mb.packed, reduction="sum")
        (total * scale).backward()
    grad = _flat_grad(model)
    dist.all_reduce(grad)
    grad /= dist.get_world_size()
    return grad, work.plan.assignment


def _reference_gradient(stream: DocumentStream, model: GPT) -> torch.Tensor:
    """The gradient of the mean token loss over the unit's documents, in this process."""
    model.zero_grad()
    total_tokens = sum(n for _, _, n in stream._pieces)
    for doc, start, n in stream._pieces:
        x, y = stream.sampler.piece(doc, start, n)
        _, total = model(x[None], y[None], reduction="sum")
        (total / total_tokens).backward()
    return _flat_grad(model)


def balance_scenarios(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ring_group = dist.new_group(backend="gloo")
    out["ring_attention"] = {
        n: _ring_attention(rank, world, n) for n in (4 * world, 4 * world + 3, 37)
    }
    out["model_split"] = _model_split(rank, world, ring_group)

    corpus = synthetic_corpus()
    quadratic = CostModel(a=1e-6, b=1e-4)  # attention-dominated: the longest documents split
    policy = SplitPolicy(kv_bytes_per_token=2 * 16 * 2 * 8, layers=2)
    settings = {
        "random": dict(strategy="random"),
        "sequential": dict(strategy="sequential"),
        "tokens": dict(strategy="tokens"),
        "cost": dict(strategy="cost", cost=quadratic),
        "cost-kk": dict(strategy="cost", cost=quadratic, method="kk"),
        "cost+split": dict(strategy="cost+split", cost=quadratic, split=policy),
    }
    grads, plans, splits = {}, {}, {}
    model = tiny_doc_model()
    reference = None
    for name, kw in settings.items():
        stream = DocumentStream(
            corpus,
            cap=CAP,
            tokens_per_step=56,
            seed=5,
            ring_group=ring_group,
            **kw,  # type: ignore[arg-type]
        )
        grads[name], plans[name] = _unit_gradient(stream, model)
        splits[name] = [d.k for d in stream._plan.splits] if stream._plan else []
        if reference is None:
            reference = _reference_gradient(stream, model)
    assert reference is not None
    out["grad_vs_reference"] = {k: float((g - reference).abs().max()) for k, g in grads.items()}
    out["grad_scale"] = float(reference.abs().max())
    out["splits"] = splits
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, plans)
    out["plans_agree"] = all(g == plans for g in gathered)
    out["distinct_plans"] = len({repr(p) for p in plans.values()})

    # a stream restored from its state goes on exactly as the one that ran on
    a = DocumentStream(
        corpus, cap=CAP, tokens_per_step=64, steps_per_unit=3, seed=5, strategy="tokens"
    )
    for _ in range(4):
        a.next_step()
    state = copy.deepcopy(a.state_dict())
    b = DocumentStream(
        corpus, cap=CAP, tokens_per_step=64, steps_per_unit=3, seed=5, strategy="tokens"
    )
    b.load_state_dict(state)
    same = True
    for _ in range(5):
        wa, wb = a.next_step(), b.next_step()
        same &= len(wa.micro_batches) == len(wb.micro_batches) and all(
            torch.equal(x.x, y.x) for x, y in zip(wa.micro_batches, wb.micro_batches, strict=True)
        )
    out["resume_same"] = same
    return out
