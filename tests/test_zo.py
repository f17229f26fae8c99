"""lowcomm.zo: MeZO pinned bit for bit against MeZO's own arithmetic (transcribed in
lowcomm.testing.zo), and DistZO2's modes on real gloo ranks against it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lowcomm.procs.workers import run_workers
from lowcomm.testing.zo import (
    mezo_reference,
    sharded_reference,
    tiny_batches,
    tiny_loss,
    tiny_model,
    zo_scenarios,
)
from lowcomm.zo import MeZO, ZOStep, mezo_decays, zo_seed

STEPS = 6
SETTINGS = {"lr": 1e-3, "eps": 1e-3, "weight_decay": 0.1, "seed": 3}


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _single(
    steps: int = STEPS, n_layer: int = 1, **settings: Any
) -> tuple[dict[str, torch.Tensor], list[Any]]:
    model = tiny_model(n_layer=n_layer)
    zo = MeZO(model, **{**SETTINGS, **settings})
    results = [zo.step(lambda x=x, y=y: tiny_loss(model, x, y)) for x, y in tiny_batches(steps)]
    return _params(model), results


@pytest.mark.parametrize("n_directions,weight_decay", [(1, 0.0), (1, 0.1), (3, 0.1)])
def test_single_process_is_mezo_bit_for_bit(n_directions: int, weight_decay: float) -> None:
    params, results = _single(n_directions=n_directions, weight_decay=weight_decay)
    model = tiny_model()
    batches = tiny_batches(STEPS)
    seeds = [[zo_seed(3, i + 1, k) for k in range(n_directions)] for i in range(STEPS)]
    reference = mezo_reference(
        model,
        [lambda x=x, y=y: tiny_loss(model, x, y) for x, y in batches],
        seeds=seeds,
        lr=1e-3,
        eps=1e-3,
        weight_decay=weight_decay,
    )
    assert _same(params, _params(model))
    for mine, ref in zip(results, reference):
        assert mine.loss_plus == ref["plus"] and mine.loss_minus == ref["minus"]
        assert mine.projected_grads == ref["g"]
    assert params["wte.weight"].ne(tiny_model().wte.weight).any()  # it moved


def test_blockwise_fused_dual_forward_changes_no_bit() -> None:
    """ZO2's pass: each stage's two forwards back to back, the previous update applied lazily
    (and the tied embedding/head weight used in the first and last stage)."""
    params, results = _single()
    model = tiny_model()
    zo = MeZO(model, blockwise=True, **SETTINGS)
    batches = tiny_batches(STEPS)
    lazy = []
    for i, (x, y) in enumerate(batches):
        lazy.append(zo.step(stages=model.zo_stages(x, y)))
        if i == 2:  # a checkpoint with an update pending, resumed into a fresh MeZO
            state, saved = zo.state_dict(), _params(model)
            assert state["pending"] is not None
            model = tiny_model(seed=1)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(saved[name])
            zo = MeZO(model, blockwise=True, **SETTINGS)
            zo.load_state_dict(state)
    assert not _same(_params(model), params)  # the last update is still pending
    zo.flush()
    assert _same(_params(model), params)
    for mine, ref in zip(lazy, results):
        assert mine.loss_plus == ref.loss_plus and mine.projected_grads == ref.projected_grads
    with pytest.raises(ValueError, match="one direction"):
        MeZO(model, blockwise=True, n_directions=2)
    with pytest.raises(ValueError, match="stages=... with blockwise=True"):
        zo.step(lambda: torch.zeros(()))
    x, y = batches[0]
    with pytest.raises(ValueError, match="named_parameters\\(\\) order"):
        zo.step(stages=list(reversed(model.zo_stages(x, y))))


def _offloaded_run(
    steps: int, buffers: int = 2, resume_at: int | None = None, watch: bool = False
) -> tuple[dict[str, torch.Tensor], list[Any], MeZO, list[int]]:
    """ZO2's offloading on the CPU (host and compute device the same): a 4-block model, each
    block through ``buffers`` device buffers; optionally resumed into a fresh MeZO after step
    ``resume_at`` (an update pending), and with every stage's run watched: how many offloaded
    stages have their parameters in the buffers while it computes."""
    model = tiny_model(n_layer=4)
    zo = MeZO(model, offload=True, offload_buffers=buffers, **SETTINGS)
    zo.offloader.record = True  # type: ignore[union-attr]
    in_buffers: list[int] = []

    def watched(stages: list[Any]) -> list[Any]:
        if not watch:
            return stages
        off = zo.offloader
        assert off is not None

        def wrap(run: Any) -> Any:
            def inner(state: Any) -> Any:
                assert off.pool is not None
                low = off.pool.data_ptr()
                high = low + off.pool.numel()
                bound = [
                    s.stage
                    for s in off.stages
                    if all(low <= t.data_ptr() < high for t in s.tensors)
                ]
                in_buffers.append(len(bound))
                return run(state)

            return inner

        return [(modules, wrap(run)) for modules, run in stages]

    results = []
    for i, (x, y) in enumerate(tiny_batches(steps)):
        results.append(zo.step(stages=watched(model.zo_stages(x, y))))
        if resume_at is not None and i + 1 == resume_at:
            state, saved = zo.state_dict(), _params(model)
            assert state["pending"] is not None
            model = tiny_model(seed=1, n_layer=4)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(saved[name])
            zo = MeZO(model, offload=True, offload_buffers=buffers, **SETTINGS)
            zo.load_state_dict(state)
    zo.flush()
    return _params(model), results, zo, in_buffers


@pytest.mark.parametrize("buffers,resume_at", [(2, None), (3, 2)])
def test_offload_is_blockwise_bit_for_bit(buffers: int, resume_at: int | None) -> None:
    """ZO2's offloading changes no bit: every step's L+, L- and g and the parameters equal the
    resident blockwise pass (itself MeZO bit for bit), also resumed with an update pending."""
    params, results = _single(n_layer=4)
    got, steps, zo, _ = _offloaded_run(STEPS, buffers, resume_at)
    assert _same(got, params)
    for mine, ref in zip(steps, results):
        assert mine.loss_plus == ref.loss_plus and mine.loss_minus == ref.loss_minus
        assert mine.projected_grads == ref.projected_grads
    off = zo.offloader
    assert off is not None and off.summary()["offloaded_stages"] == 4  # the blocks
    assert off.resident_stages == [0, 5]  # the embeddings and the tied head stay on the device
    assert off.pool is not None and off.pool.shape[0] == buffers


def test_offload_keeps_at_most_its_buffers_resident_and_orders_the_copies() -> None:
    _, _, zo, in_buffers = _offloaded_run(3, buffers=2, watch=True)
    off = zo.offloader
    assert off is not None
    # while a stage computes (twice a step: L+ and L-), only it is bound to the buffers (the
    # next one is uploading); the embeddings and the head compute with none
    assert in_buffers == ([0, 0] + [1, 1] * 4 + [0, 0]) * 3
    # the timeline: each block uploaded into its buffer, computed there, copied back, and the
    # buffer not refilled before that; never more than the two buffers' stages held
    held: dict[int, int] = {}  # buffer -> stage
    computed = set()
    most = 0
    for action, stage, buffer in off.timeline:
        if action == "upload":
            assert buffer not in held, f"buffer {buffer} refilled before stage {held} left it"
            held[buffer] = stage
        elif action == "compute":
            assert held.get(buffer) == stage
            computed.add(stage)
        else:
            assert action == "copy back" and held.pop(buffer) == stage and stage in computed
        most = max(most, len(held))
    assert most == off.max_resident == 2 and not held
    assert [a for a, s, _ in off.timeline if s == 1] == ["upload", "compute", "copy back"] * 4
    with pytest.raises(ValueError, match="offload_buffers must be an integer >= 2"):
        MeZO(tiny_model(), offload=True, offload_buffers=1)


def test_offload_evaluates_and_flushes_as_the_model_does() -> None:
    model = tiny_model(n_layer=3)
    zo = MeZO(model, offload=True, **SETTINGS)
    batches = tiny_batches(3)
    with pytest.raises(ValueError, match="has not seen the model's stages"):
        zo._pending = (1, 0.5, 1e-3)
        zo.flush()
    zo._pending = None
    for x, y in batches[:2]:
        zo.step(stages=model.zo_stages(x, y))
    x, y = batches[2]
    streamed = zo.evaluate(model.zo_stages(x, y))  # applies the pending update first
    assert zo.state_dict()["pending"] is None
    with torch.inference_mode():
        model.eval()
        assert torch.equal(streamed, tiny_loss(model, x, y))  # host and device both the CPU
    stages = model.zo_stages(x, y)
    (first,), run_first = stages[1]
    (second,), run_second = stages[2]
    merged = ((first, second), lambda h: run_second(run_first(h)))
    with pytest.raises(ValueError, match="the same stages"):
        zo.step(stages=[stages[0], merged, *stages[3:]])
    with pytest.raises(ValueError, match="offload=True takes one direction"):
        MeZO(model, offload=True, n_directions=2)


def test_mezo_weight_decay_rule_and_seeds() -> None:
    assert mezo_decays("blocks.0.attn.c_attn.weight") and mezo_decays("ln_f.weight")
    assert not mezo_decays("blocks.0.ln_1.bias")
    assert not mezo_decays("model.layers.0.input_layernorm.weight")
    assert not mezo_decays("encoder.layer_norm.weight")
    # the same on every call, distinct per step and direction, in MeZO's range
    seeds = {zo_seed(0, s, k) for s in range(1, 50) for k in range(3)}
    assert len(seeds) == 147 and all(0 <= s < 1_000_000_000 for s in seeds)
    assert zo_seed(5, 7, 1) == zo_seed(5, 7, 1) != zo_seed(6, 7, 1)


def test_resume_is_exact() -> None:
    straight, results = _single()
    model = tiny_model()
    batches = tiny_batches(STEPS)
    zo = MeZO(model, **SETTINGS)
    for x, y in batches[:3]:
        zo.step(lambda x=x, y=y: tiny_loss(model, x, y))
    state, saved = zo.state_dict(), _params(model)
    model = tiny_model(seed=1)  # another start: everything comes from the checkpoint
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(saved[name])
    zo = MeZO(model, **SETTINGS)
    zo.load_state_dict(state)
    rest = [zo.step(lambda x=x, y=y: tiny_loss(model, x, y)) for x, y in batches[3:]]
    assert _same(straight, _params(model))
    assert [r.projected_grads for r in rest] == [r.projected_grads for r in results[3:]]
    with pytest.raises(ValueError, match="saved with eps=0.001"):
        MeZO(model, **{**SETTINGS, "eps": 1e-2}).load_state_dict(state)


def test_bad_input_is_refused() -> None:
    model = tiny_model()
    for kwargs, match in [
        ({"mode": "fsdp"}, "mode must be one of"),
        ({"eps": 0}, "eps must be a finite number > 0"),
        ({"lr": -1.0}, "lr must be a finite number >= 0"),
        ({"n_directions": 0}, "n_directions must be an integer >= 1"),
        ({"weight_decay": float("nan")}, "weight_decay must be a number >= 0"),
        ({"mode": "pertp"}, "torch.distributed is not initialised"),
    ]:
        with pytest.raises(ValueError, match=match):
            MeZO(model, **kwargs)
    zo = MeZO(model)
    with pytest.raises(ValueError, match="one-element tensor"):
        zo.step(lambda: torch.zeros(3))


@pytest.fixture(scope="module")
def modes() -> list[dict[str, Any]]:
    results = run_workers(zo_scenarios, 4, STEPS, SETTINGS, timeout_s=240)
    for per_rank in results:  # each step came back as a plain dict
        for run in per_rank.values():
            if isinstance(run, dict) and "steps" in run:
                run["steps"] = [ZOStep(**d) for d in run["steps"]]
    return results


@pytest.mark.timeout(300)
def test_pertp_is_single_process_mezo_bit_for_bit(modes: list[dict[str, Any]]) -> None:
    params, single = _single()
    for rank, key in ((0, "pertp"), (1, "pertp"), (0, "pertp-blockwise"), (1, "pertp-blockwise")):
        run = modes[rank][key]
        assert _same(run["params"], params)
        for mine, ref in zip(run["steps"], single):
            assert mine.loss_plus == ref.loss_plus and mine.loss_minus == ref.loss_minus
            assert mine.projected_grads == ref.projected_grads


@pytest.mark.timeout(300)
def test_offload_in_every_mode_is_bit_for_bit(modes: list[dict[str, Any]]) -> None:
    """PertP, DDP and 2D with ZO2's offloading (3 blocks through 2 buffers, each run resumed
    halfway into a fresh MeZO with an update pending): PertP is
    single-process MeZO, DDP the sharded reference, 2D on 4 ranks DDP on 2, bit for bit."""
    params, single = _single(n_layer=3)
    for rank in (0, 1):
        run = modes[rank]["pertp-offload"]
        assert _same(run["params"], params)
        assert [r.projected_grads for r in run["steps"]] == [r.projected_grads for r in single]
    model = tiny_model(n_layer=3)
    batches = tiny_batches(STEPS)
    closures = [sharded_reference(model, [(x[:4], y[:4]), (x[4:], y[4:])]) for x, y in batches]
    seeds = [[zo_seed(3, i + 1)] for i in range(STEPS)]
    reference = mezo_reference(model, closures, seeds=seeds, lr=1e-3, eps=1e-3, weight_decay=0.1)
    for rank in (0, 1):
        assert _same(modes[rank]["ddp-offload"]["params"], _params(model))
        got = [r.projected_grads for r in modes[rank]["ddp-offload"]["steps"]]
        assert got == [r["g"] for r in reference]
    for rank in range(4):
        assert _same(modes[rank]["2d-offload"]["params"], modes[0]["ddp-offload"]["params"])


@pytest.mark.timeout(300)
def test_naive_pertp_drifts_and_the_check_names_it(modes: list[dict[str, Any]]) -> None:
    assert not _same(modes[0]["naive"], modes[1]["naive"])
    for rank in (0, 1):
        assert "rank(s) [1] differ from rank 0's" in modes[rank]["caught"]


@pytest.mark.timeout(300)
def test_ddp_is_the_sharded_reference_bit_for_bit(modes: list[dict[str, Any]]) -> None:
    model = tiny_model()
    batches = tiny_batches(STEPS)
    closures = [sharded_reference(model, [(x[:4], y[:4]), (x[4:], y[4:])]) for x, y in batches]
    seeds = [[zo_seed(3, i + 1)] for i in range(STEPS)]
    reference = mezo_reference(model, closures, seeds=seeds, lr=1e-3, eps=1e-3, weight_decay=0.1)
    for rank in (0, 1):
        run = modes[rank]["ddp"]
        assert _same(run["params"], _params(model))
        assert [r.projected_grads for r in run["steps"]] == [r["g"] for r in reference]
    # and single-process MeZO on the whole batch up to the rounding of the weighted sum
    single, _ = _single()
    for name, p in single.items():
        torch.testing.assert_close(modes[0]["ddp"]["params"][name], p, rtol=0, atol=1e-5)


@pytest.mark.timeout(300)
def test_2d_on_four_ranks_is_ddp_on_two(modes: list[dict[str, Any]]) -> None:
    for rank in range(4):
        assert _same(modes[rank]["2d"]["params"], modes[0]["ddp"]["params"])
        got = [r.projected_grads for r in modes[rank]["2d"]["steps"]]
        assert got == [r.projected_grads for r in modes[0]["ddp"]["steps"]]


@pytest.mark.timeout(300)
def test_bytes_per_step_are_a_few_floats(modes: list[dict[str, Any]]) -> None:
    # one all-gather of (weight, L+, L-) in float64 per step, and an 8-byte digest every 2 steps
    for mode, world in (("pertp", 2), ("ddp", 2), ("2d", 4)):
        per_step = modes[0][mode]["bytes"] / STEPS
        assert per_step == (world - 1) * (24 + 8 / 2), mode


def test_offload_benchmark_runs_on_the_cpu(capsys: Any) -> None:
    """``benchmarks/zo_offload.py`` (the GPU check's offload row) on the CPU: resident against
    offloaded, bit-identical, and the largest model under its bound built and run."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "zo_offload.py"
    spec = importlib.util.spec_from_file_location("zo_offload", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--device", "cpu", "--layers", "3", "--embd", "32", "--heads", "2", "--seq", "16"]
    argv += ["--batch", "2", "--steps", "1", "--width-step", "32", "--max-params", "1.2e5"]
    assert module.main([*argv, "--largest-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "offloaded bit-identical to resident: True" in out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["run"] for r in rows] == ["resident", "offloaded", "largest"]
    assert rows[1]["offload"]["offloaded_stages"] == 3 and rows[0]["offload"] is None
    # 3 x 64 has 164k parameters, over the bound: the largest is 3 x 32
    assert rows[2]["embd"] == 32 and rows[2]["bound"] == "--max-params"
