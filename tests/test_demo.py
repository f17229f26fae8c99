"""DeMo: the chunked DCT, the per-tensor math, and real gloo ranks against the reference."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from lowcomm.optim import DeMo
from lowcomm.optim.dct import ChunkPlan, chunk_size, dct_matrix, decode, encode
from lowcomm.optim.demo import demo_compress, demo_decode
from lowcomm.testing import run_workers
from lowcomm.testing.demo import demo_distributed_run, demo_reference_run
from lowcomm.testing.reference import toy_batch, toy_model

# --- the transform ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "target", "expected"),
    [(128, 64, 64), (96, 64, 48), (127, 64, 1), (10, 64, 10), (1, 64, 1), (384, 64, 64), (6, 4, 3)],
)
def test_chunk_is_the_largest_divisor_not_above_the_target(
    n: int, target: int, expected: int
) -> None:
    assert chunk_size(n, target) == expected


def test_dct_matrix_is_the_orthonormal_dct_ii() -> None:
    n = 8
    c = dct_matrix(n, torch.float64)
    for k in range(n):
        scale = math.sqrt(1 / n) if k == 0 else math.sqrt(2 / n)
        for j in range(n):
            assert c[k, j].item() == pytest.approx(
                scale * math.cos(math.pi * (2 * j + 1) * k / (2 * n))
            )
    torch.testing.assert_close(c @ c.T, torch.eye(n, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(128, 96), (10,), (), (3, 6, 10), (127,), (2, 3, 8, 12)])
def test_encode_decode_round_trip_any_rank(shape: tuple[int, ...]) -> None:
    plan = ChunkPlan.for_shape(torch.Size(shape), 64)
    x = torch.randn(shape, dtype=torch.float64)
    coeffs = encode(x, plan)
    assert coeffs.shape == (plan.chunks, plan.per_chunk)
    torch.testing.assert_close(decode(coeffs, plan), x)


def test_encode_of_a_2d_block_is_the_2d_dct_of_that_block() -> None:
    x = torch.randn(8, 6, dtype=torch.float64)
    plan = ChunkPlan.for_shape(x.shape, 4)  # blocks of 4 x 3, 2 x 2 of them
    coeffs = encode(x, plan)
    a, b = dct_matrix(4, torch.float64), dct_matrix(3, torch.float64)
    block = x[4:8, 0:3]  # block row 1, block column 0: chunk 2 in row-major order
    torch.testing.assert_close(coeffs[2].view(4, 3), a @ block @ b.T)


# --- the per-tensor math ------------------------------------------------------------------------


def test_compress_keeps_the_k_largest_per_chunk_and_the_rest_stays() -> None:
    m = torch.randn(8, 12)
    plan = ChunkPlan.for_shape(m.shape, 4)
    idx, val, sent = demo_compress(m, plan, 3)
    coeffs = encode(m, plan)
    assert idx.shape == val.shape == (plan.chunks, 3)
    for c in range(plan.chunks):
        kept = set(idx[c].tolist())
        smallest_kept = coeffs[c].abs()[idx[c]].min()
        others = [i for i in range(plan.per_chunk) if i not in kept]
        assert (coeffs[c].abs()[others] <= smallest_kept).all()
        assert torch.equal(val[c], coeffs[c][idx[c]])
    kept_only = torch.zeros_like(coeffs).scatter_(-1, idx, val)
    torch.testing.assert_close(sent, decode(kept_only, plan))


def test_decode_averages_over_the_ranks_that_sent_each_coefficient() -> None:
    plan = ChunkPlan.for_shape(torch.Size([4]), 4)  # one chunk of 4 coefficients
    idx = [torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([[1, 2]], dtype=torch.int32)]
    val = [torch.tensor([[2.0, 4.0]]), torch.tensor([[6.0, 8.0]])]
    q = demo_decode(idx, val, plan)
    # coefficient 0: only rank 0 (2); 1: both (mean 5); 2: only rank 1 (8); 3: nobody (0)
    torch.testing.assert_close(encode(q, plan), torch.tensor([[2.0, 5.0, 8.0, 0.0]]))


def test_bad_hyperparameters_name_the_key(single_rank: Any) -> None:
    params = toy_model().parameters()
    for key, value in [
        ("lr", 0.0),
        ("compression_decay", 1.0),
        ("compression_topk", 0),
        ("compression_chunk", 2.5),
        ("weight_decay", -1.0),
    ]:
        with pytest.raises(ValueError, match=key):
            DeMo(params, **{key: value})


# --- real ranks against the reference ---------------------------------------------------------

SCENARIOS: dict[str, dict[str, Any]] = {
    "demo": {},
    "demo-overlap": {"overlap": True},
    "demo-no-decay": {"decay": 0.0, "weight_decay": 0.0, "topk": 1},
    # every coefficient kept: sign descent on the mean gradient
    "demo-all": {"topk": 10_000, "decay": 0.5},
    "demo-cut": {"cut": 3, "steps": 6},
    "demo-overlap-cut": {"overlap": True, "cut": 3, "steps": 6},
}


def _scenario(name: str, workers: int) -> dict[str, Any]:
    return {**SCENARIOS[name], "workers": workers, "seed": 2}


@pytest.fixture(scope="module")
def demo_runs() -> dict[int, dict[str, list[dict]]]:
    out: dict[int, dict[str, list[dict]]] = {}
    for workers in (2, 4):
        names = list(SCENARIOS)
        per_rank = run_workers(
            demo_distributed_run, workers, [_scenario(n, workers) for n in names], timeout_s=240
        )
        out[workers] = {n: [per_rank[r][i] for r in range(workers)] for i, n in enumerate(names)}
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ranks_match_the_reference_bitwise(demo_runs: dict, name: str, workers: int) -> None:
    results = demo_runs[workers][name]
    ref = demo_reference_run(_scenario(name, workers))
    for rank, res in enumerate(results):
        assert len(res["steps"]) == len(ref)
        for k, (got, want) in enumerate(zip(res["steps"], ref)):
            for a, b in zip(got, want[rank]):
                assert torch.equal(a, b), f"rank {rank} step {k + 1}: {(a - b).abs().max()}"
    # replicas bit-identical after every step
    for res in results[1:]:
        for mine, first in zip(res["steps"], results[0]["steps"]):
            assert all(torch.equal(a, b) for a, b in zip(mine, first))


@pytest.mark.timeout(300)
def test_every_coefficient_kept_is_sign_descent_on_the_mean_gradient(demo_runs: dict) -> None:
    """k = all coefficients: p ← p(1 − ηλ) − η·sign(mean of the ranks' gradients), wherever the
    mean is not within rounding of 0."""
    sc = {**SCENARIOS["demo-all"], "workers": 2}
    lr, wd = 0.01, 0.1
    results = demo_runs[2]["demo-all"]
    before = [p.detach().clone() for p in toy_model(2).parameters()]
    checked = 0
    for k, after in enumerate(results[0]["steps"]):
        mean_g = [(a + b) / 2 for a, b in zip(results[0]["grads"][k], results[1]["grads"][k])]
        for p0, p1, g in zip(before, after, mean_g):
            clear = g.abs() > 1e-4
            want = p0 * (1 - lr * wd) - lr * torch.sign(g)
            torch.testing.assert_close(p1[clear], want[clear], rtol=0, atol=1e-6)
            checked += int(clear.sum())
        before = after
    assert checked > 100 and sc["topk"] > 64


@pytest.mark.timeout(300)
def test_bytes_are_counted_exactly(demo_runs: dict) -> None:
    model = toy_model()
    plans = [ChunkPlan.for_shape(p.shape, 4) for p in model.parameters()]
    per_step = sum(p.chunks * min(2, p.per_chunk) * (4 + 4) for p in plans)
    for workers in (2, 4):
        stats = demo_runs[workers]["demo"][0]["stats"]
        assert demo_runs[workers]["demo"][0]["bytes_per_step"] == per_step
        assert stats["collectives"] == 2 * 6  # one pair of all-gathers per step
        assert stats["payload_bytes"] == 6 * per_step
        assert stats["wire_bytes"] == (workers - 1) * 6 * per_step


@pytest.fixture
def single_rank() -> Any:
    """A one-rank gloo group for the test, destroyed after it."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_demo_sends_far_less_than_ddp_on_the_default_gpt(single_rank: Any) -> None:
    """The job's GPT with DeMo's defaults: bytes per rank per step against DDP's fp32 gradient
    ring all-reduce payload (4 bytes a parameter)."""
    from lowcomm.models.gpt import GPT, GPTConfig
    from lowcomm.train.config import TrainConfig

    job = TrainConfig()
    shape = {k: getattr(job, k) for k in ("block_size", "n_layer", "n_head", "n_embd")}
    model = GPT(GPTConfig(vocab_size=256, **shape))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = DeMo(params, lr=1e-3)
    ddp = 4 * sum(p.numel() for p in params)
    assert opt.bytes_per_step() * 40 <= ddp, ddp / opt.bytes_per_step()


def test_parameters_without_gradient_are_skipped(single_rank: Any) -> None:
    model = toy_model(1)
    frozen = list(model.parameters())[0]
    opt = DeMo(model.parameters(), lr=0.1)
    before = frozen.detach().clone()
    x, y = toy_batch(0, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    frozen.grad = None
    opt.step()
    assert torch.equal(frozen, before) and frozen not in opt.state
    assert all("delta" in opt.state[p] for p in list(model.parameters())[1:])
    state = opt.state_dict()
    assert any("delta" in s for s in state["state"].values())
