"""Zeppelin's remapping layer (``lowcomm.balance.remap``): linear layers on the token layout,
attention on the s²-balanced layout, exchanged by all-to-all on real gloo processes; outputs and
gradients against the plain model in fp64."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lowcomm.balance.remap import Remap, attention_owners, exchange_bytes, token_bounds
from lowcomm.procs.workers import run_workers

LENGTHS = [37, 5, 64, 12, 90, 3, 20, 41]


def _remapped_against_plain(rank: int, world: int, lengths: list[int]) -> dict[str, Any]:
    import torch.distributed as dist

    from lowcomm.balance.remap import remapped_loss
    from lowcomm.models.gpt import GPT, GPTConfig, Packed

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, block_size=128, n_layer=2, n_head=2, n_embd=16))
    gpt = gpt.double()
    gen = torch.Generator().manual_seed(1)
    total = sum(lengths)
    tokens = torch.randint(64, (total,), generator=gen)
    targets = torch.randint(64, (total,), generator=gen)
    # the plain model: every document, packed, on this rank alone
    _, ref = gpt(tokens[None], targets[None], packed=Packed(lengths=lengths), reduction="sum")
    assert ref is not None
    ref.backward()
    ref_grads = [p.grad.clone() for p in gpt.parameters()]
    gpt.zero_grad(set_to_none=True)
    # remapped: this rank's run of tokens, attention on the s²-balanced layout
    remap = Remap(tuple(lengths), tuple(attention_owners(lengths, world)), world, rank)
    start, end = token_bounds(total, world)[rank]
    loss = remapped_loss(gpt, tokens[start:end], targets[start:end], remap)
    loss.backward()
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    worst = 0.0
    for p, g in zip(gpt.parameters(), ref_grads, strict=True):
        assert p.grad is not None
        dist.all_reduce(p.grad)
        worst = max(worst, float((p.grad - g).abs().max() / g.abs().max().clamp_min(1e-30)))
    # the exchanges are each other's inverse
    x = torch.arange(end - start, dtype=torch.float64)[:, None] + 1000 * rank
    moved = remap.to_attention(x)
    back = remap.to_tokens(moved)
    wanted = torch.tensor(remap.attention_tokens(rank), dtype=torch.float64)
    return {
        "loss": float(summed),
        "ref": float(ref),
        "worst_grad": worst,
        "roundtrip": bool(torch.equal(back, x)),
        "moved": moved[:, 0].tolist(),
        "wanted": wanted.tolist(),
        "bounds": token_bounds(total, world),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_remapped_model_computes_the_plain_models_loss_and_gradients(world: int) -> None:
    results = run_workers(_remapped_against_plain, world, LENGTHS)
    for r in results:
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-12)
        assert r["worst_grad"] < 1e-10
        assert r["roundtrip"]
    # what arrives is each rank's documents' tokens, whole, in order (token t of the stream was
    # sent by the rank whose run holds it: value t - start + 1000 * that rank)
    bounds = results[0]["bounds"]
    for rank, r in enumerate(results):
        expect = []
        for t in r["wanted"]:
            src = next(i for i, (a, b) in enumerate(bounds) if a <= t < b)
            expect.append(t - bounds[src][0] + 1000 * src)
        assert r["moved"] == expect, rank


def test_layouts_balance_tokens_and_attention_work() -> None:
    assert token_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    owners = attention_owners(LENGTHS, 2)
    work = [sum(n * n for n, o in zip(LENGTHS, owners, strict=True) if o == r) for r in (0, 1)]
    assert max(work) <= 90 * 90 + 64 * 64  # LPT on s²: the two longest apart
    assert owners[LENGTHS.index(90)] != owners[LENGTHS.index(64)]
    assert owners == attention_owners(LENGTHS, 2)  # the same on every rank
    remap = Remap(tuple(LENGTHS), tuple(owners), 2, 0)
    assert sorted(remap.attention_tokens(0) + remap.attention_tokens(1)) == list(range(272))
    # rank 0's run: 136 tokens, documents 37, 5 and 64 whole, then 12 and 18 of the 90
    expect = [*range(37), *range(5), *range(64), *range(12), *range(18)]
    assert remap.positions().tolist() == expect
    assert exchange_bytes(100, 16, 2) == 2 * 4 * 16 * 100 * 2 * 4
    with pytest.raises(ValueError, match="one owner per document"):
        Remap((3, 4), (0,), 2, 0)
    with pytest.raises(ValueError, match="ranks of a world of 2"):
        Remap((3, 4), (0, 2), 2, 0)


def test_remapping_is_taken_only_where_it_beats_the_cost_plan() -> None:
    from lowcomm.balance import CostModel, plan
    from lowcomm.balance.remap import remap_pays, remap_plan

    # the tokens each rank sends or receives, by hand: documents of 6 and 2 tokens on 2 ranks,
    # runs [0, 4) and [4, 8); the 6-token one is rank 0's, so tokens 4 and 5 travel
    small = Remap((6, 2), tuple(attention_owners([6, 2], 2)), 2, 0)
    assert small.owners == (0, 1) and [small.moved_tokens(r) for r in (0, 1)] == [2, 2]
    # one long document among many short ones, on linear-dominated costs: no whole-document
    # plan does better than the long one's linear work on one rank; remapped, its tokens are
    # spread over all four and only its (cheap) attention stays on one
    lengths = [1000] + [10] * 100
    cost = CostModel(a=1e-6, b=1e-10, d=1e-6, c0=1e-5)
    remapped, remap = remap_plan(lengths, 4, 0, cost)
    base = plan(lengths, 4, strategy="cost", cost=cost)
    assert max(remapped.loads) < 0.9 * base.makespan
    assert remap_pays(remapped, base, remap, None)  # not measured: remap
    assert remap_pays(remapped, base, remap, 1e-9)  # a fast exchange
    assert not remap_pays(remapped, base, remap, 1e-5)  # a slow one: the cost plan instead
