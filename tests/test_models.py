"""Tests for lowcomm.models.gpt: shapes, init, weight tying, learning, config validation."""

from __future__ import annotations

import math

import pytest
import torch

from lowcomm.models import GPT, GPTConfig


def tiny_config(**overrides: object) -> GPTConfig:
    kwargs: dict = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
    kwargs.update(overrides)
    return GPTConfig(**kwargs)


def make_model(config: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def test_output_shapes_with_and_without_targets() -> None:
    model = make_model(tiny_config())
    idx = torch.randint(0, 256, (3, 10))
    logits, loss = model(idx)
    assert logits.shape == (3, 10, 256)
    assert loss is None
    logits, loss = model(idx, targets=idx)
    assert logits.shape == (3, 10, 256)
    assert loss is not None and loss.shape == ()


def test_initial_loss_is_close_to_uniform() -> None:
    model = make_model(GPTConfig(vocab_size=256))
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (4, 64), generator=gen)
    y = torch.randint(0, 256, (4, 64), generator=gen)
    with torch.no_grad():
        _, loss = model(x, targets=y)
    assert loss is not None and math.isfinite(loss.item())
    assert loss.item() == pytest.approx(math.log(256), abs=0.15)


def test_lm_head_is_tied_to_token_embedding() -> None:
    model = make_model(tiny_config())
    assert model.lm_head.weight is model.wte.weight
    # Counted once: the tied tensor is one Parameter.
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names


def test_blocks_module_list_and_residual_init() -> None:
    config = tiny_config(n_layer=3, n_embd=64)
    model = make_model(config)
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert len(model.blocks) == 3
    expected = 0.02 / math.sqrt(2 * config.n_layer)
    std = torch.cat([b.attn.c_proj.weight.flatten() for b in model.blocks]).std().item()
    assert std == pytest.approx(expected, rel=0.1)
    assert model.blocks[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_init_is_deterministic_given_seed() -> None:
    a = make_model(tiny_config(), seed=3).state_dict()
    b = make_model(tiny_config(), seed=3).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_attention_is_causal() -> None:
    model = make_model(tiny_config()).eval()
    idx = torch.randint(0, 256, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_adamw_overfits_one_batch() -> None:
    model = make_model(tiny_config())
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, 16), generator=gen)
    y = torch.randint(0, 256, (4, 16), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        _, loss = model(x, targets=y)
        assert loss is not None
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.25 * losses[0]


def test_default_config_size() -> None:
    model = make_model(GPTConfig(vocab_size=256))
    n = model.num_parameters()
    assert 1_000_000 <= n <= 3_000_000
    assert n == sum(p.numel() for p in model.parameters())
    assert model.num_parameters(exclude_position_embedding=True) == n - 128 * 128


def test_sequence_longer_than_block_size_is_rejected() -> None:
    model = make_model(tiny_config(block_size=8))
    with pytest.raises(ValueError, match="block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"n_embd": 30, "n_head": 4}, "n_embd=30"),
        ({"vocab_size": 0}, "vocab_size=0"),
        ({"block_size": -1}, "block_size=-1"),
        ({"n_layer": 0}, "n_layer=0"),
        ({"n_head": 0}, "n_head=0"),
        ({"dropout": 1.0}, "dropout=1.0"),
        ({"dropout": -0.1}, "dropout=-0.1"),
    ],
)
def test_config_validation(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


def test_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        GPTConfig(256)  # type: ignore[misc]
