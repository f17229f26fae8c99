"""DelayedNesterov (Liu et al. 2024, arXiv 2401.09135, c = 0) against torch's Nesterov SGD in
its degenerate form and against the paper's recursion written out here."""

from __future__ import annotations

import io

import pytest
import torch

import lowcomm
from lowcomm.optim import DelayedNesterov


def _grads(step: int, shapes: list[torch.Size]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in shapes]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range) -> None:
    for step in steps:
        for p, g in zip(params, _grads(step, [p.shape for p in params])):
            p.grad = g
        if step == 4:
            for group in opt.param_groups:
                group["lr"] *= 0.5  # a schedule, as the outer lr may follow the inner one
        opt.step()


def test_delay_1_is_torch_nesterov_sgd_bit_for_bit() -> None:
    a = [torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(5)]
    b = [t.clone() for t in a]
    _run(DelayedNesterov(a, lr=0.7, momentum=0.9, delay=1), a, range(1, 8))
    _run(torch.optim.SGD(b, lr=0.7, momentum=0.9, nesterov=True), b, range(1, 8))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("delay", [2, 3])
def test_delay_n_follows_the_papers_recursion(delay: int) -> None:
    p = torch.randn(6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    mine = [p.clone()]
    opt = DelayedNesterov(mine, lr=0.3, momentum=0.8, delay=delay)
    # the paper's algorithm with c = 0, step by step
    want, m, total, lr = p.clone(), torch.zeros_like(p), torch.zeros_like(p), 0.3
    for t in range(1, 9):
        (g,) = _grads(t, [p.shape])
        g = g.double()
        mine[0].grad = g.clone()
        if t == 4:
            opt.param_groups[0]["lr"] *= 0.5
            lr *= 0.5
        opt.step()
        total = total + g
        if t % delay == 0:
            m = 0.8 * m + total / delay
            want = want - lr * 0.8 * m - lr * g / delay
            total = torch.zeros_like(p)
        else:
            want = want - lr * g / delay
        torch.testing.assert_close(mine[0], want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(mine[0], p)


def test_state_dict_resumes_inside_a_buffer() -> None:
    a = [torch.randn(4, 3, generator=torch.Generator().manual_seed(3))]
    opt = DelayedNesterov(a, lr=0.5, momentum=0.9, delay=3)
    _run(opt, a, range(1, 3))  # two of three pseudo-gradients buffered
    buf = io.BytesIO()
    torch.save({"p": [t.clone() for t in a], "o": opt.state_dict()}, buf)
    _run(opt, a, range(3, 8))
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b = saved["p"]
    again = DelayedNesterov(b, lr=0.5, momentum=0.9, delay=3)
    again.load_state_dict(saved["o"])
    _run(again, b, range(3, 8))
    assert torch.equal(a[0], b[0])


def test_diloco_takes_it_as_nesterov_every_and_refuses_what_it_cannot_do() -> None:
    outer = lowcomm.DiLoCo.Config(sync_every=2, nesterov_every=4).outer_factory()([torch.zeros(2)])
    assert isinstance(outer, DelayedNesterov)
    assert outer.param_groups[0]["delay"] == 4
    with pytest.raises(ValueError, match="nesterov_every=4 delays Nesterov momentum"):
        lowcomm.DiLoCo.validate(sync_every=2, nesterov_every=4, nesterov=False)
    with pytest.raises(ValueError, match="build lowcomm.optim.DelayedNesterov in it"):
        lowcomm.DiLoCo.validate(
            sync_every=2, nesterov_every=2, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1)
        )
    with pytest.raises(ValueError, match="delay must be an integer >= 1"):
        DelayedNesterov([torch.zeros(2)], lr=0.1, delay=0)
