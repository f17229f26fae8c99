"""The documentation's Architecture page: its worked example is the real definition, and the engine
derives what it says it derives from an algorithm's dataclass."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
from pathlib import Path

import pytest

import lowcomm
from lowcomm.hparams import HyperparameterError
from lowcomm.registry import REGISTRY
from lowcomm.train.config import OUTER_KEYS, config_keys, field_docs

ROOT = Path(__file__).resolve().parents[1]


def _architecture_blocks() -> list[str]:
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("## Adding an algorithm", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def test_the_worked_example_is_dilocos_definition() -> None:
    definition, registration = _architecture_blocks()
    assert definition in (ROOT / "src/lowcomm/outer/diloco.py").read_text()
    assert registration.strip() in (ROOT / "src/lowcomm/registry.py").read_text()


@pytest.mark.parametrize("cls", sorted(lowcomm.ALGORITHMS.values(), key=lambda c: c.name))
def test_constructor_flags_and_errors_come_from_the_dataclass(cls: type) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls.Config)}
    signature = inspect.signature(cls)
    keywords = [p for p in signature.parameters if p not in ("model_or_params", "inner_optimizer")]
    assert keywords == [*fields, "process_group", "fault_tolerance"]
    for name, f in fields.items():
        assert f"        {name}" in (cls.__doc__ or ""), name
        if f.default is not dataclasses.MISSING:
            assert signature.parameters[name].default == f.default
    # every job key of every name that runs this class is a TrainConfig field with help text
    docs = field_docs()
    train_fields = set(config_keys())
    for entry in REGISTRY.values():
        if entry.cls is cls:
            for key in OUTER_KEYS[entry.name]:
                assert key in fields and key in train_fields and docs[key]
    with pytest.raises(HyperparameterError) as info:
        cls.validate(sync_every=0)
    assert info.value.key == "sync_every" and isinstance(info.value, ValueError)


_STEP = re.compile(r"<!-- (new: (?P<new>\S+)|after \"(?P<anchor>.+?)\" in (?P<into>\S+)|end of "
                   r"(?P<end>\S+)) -->\n```python\n(?P<code>.*?)```", re.DOTALL)  # fmt: skip

_TOY_DRIVER = """
import json, sys


def main():
    from lowcomm.testing.jobs import TINY_JOB, TINY_JOB_ARGS, run_train_job

    out, results = sys.argv[1], {}
    toy = ["--algo", "toy", "--toy-rate", "0.8", "--compression", "half"]
    train = run_train_job(f"{out}/train", *TINY_JOB_ARGS, *toy)
    results["train"] = {k: train[k] for k in ("algo", "compression", "status", "val_loss_initial",
                                              "val_loss_final", "replicas_identical")}
    elastic = run_train_job(f"{out}/elastic", *TINY_JOB_ARGS, "--algo", "toy", "--fault-tolerance",
                            "--compression", "half")
    results["elastic"] = {k: elastic[k] for k in ("algo", "status", "val_loss_final",
                                                  "replicas_identical")}

    from lowcomm.bench import measure_codecs
    from lowcomm.bench.overhead import measure_overhead

    row = measure_codecs(["half"], [0.01], repeats=1, threads=1)
    results["codec_row"] = [(r["codec"], r["payload_bytes"], r["parameters"]) for r in row["rows"]]
    tiny = {k: v for k, v in TINY_JOB.items() if k not in ("steps", "sync_every", "workers")}
    overhead = measure_overhead(["toy"], rounds=1, sync_every=4, train_overrides=tiny)
    results["overhead"] = [(r["algo"], r["outer_calls"]) for r in overhead["algorithms"]]

    from lowcomm.tune.cost import Algorithm, Network, Workload, step_time

    toy = step_time(Algorithm(name="toy", sync_every=10), Workload(parameters=1e6,
        tokens_per_step=1, step_time_s=0.1), Network(bandwidth_bps=1e8, latency_s=0.0), 2)
    results["cost"] = [toy.step_s, toy.exposed_s]
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
"""


def _apply_steps(page: str, root: Path) -> list[str]:
    """Apply the toy section's steps of ``page`` to the source tree at ``root``; the files
    touched."""
    section = page.split("## A toy algorithm and a toy codec", 1)[1].split("\n## ", 1)[0]
    touched = []
    for step in _STEP.finditer(section):
        code = step["code"]
        if step["new"]:
            path = root / step["new"]
            assert not path.exists(), path
            path.write_text(code)
        elif step["end"]:
            path = root / step["end"]
            path.write_text(path.read_text() + code)
        else:
            path = root / step["into"]
            lines = path.read_text().splitlines(keepends=True)
            at = next(i for i, line in enumerate(lines) if step["anchor"] in line)
            lines[at + 1 : at + 1] = [code]
            path.write_text("".join(lines))
        touched.append(str(path.relative_to(root)))
    return touched


def test_a_toy_algorithm_and_codec_built_from_the_page_run_everywhere(tmp_path: Path) -> None:
    """The page's steps alone (one module and one registry entry; one codec class and one
    table entry) give an algorithm and a codec that ``lowcomm train`` runs (with the codec and
    the algorithm's own flag), that runs elastic, that the bench measures and the cost model
    prices: no other edit anywhere."""
    import shutil
    import subprocess
    import sys

    root = tmp_path / "copy"
    shutil.copytree(ROOT / "src", root / "src", ignore=shutil.ignore_patterns("__pycache__"))
    page = (ROOT / "docs" / "architecture.md").read_text()
    touched = _apply_steps(page, root)
    assert sorted(set(touched)) == [
        "src/lowcomm/compress/codecs.py",
        "src/lowcomm/compress/formats.py",
        "src/lowcomm/outer/toy.py",
        "src/lowcomm/registry.py",
    ]
    (tmp_path / "driver.py").write_text(_TOY_DRIVER)
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "runs")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    train = results["train"]
    assert (train["algo"], train["compression"], train["status"]) == ("toy", "half", "finished")
    assert train["val_loss_final"] < train["val_loss_initial"] and train["replicas_identical"]
    # elastic, its syncs compressed with the toy codec through the quorum
    assert results["elastic"]["algo"] == "toy" and results["elastic"]["status"] == "finished"
    assert results["elastic"]["replicas_identical"]
    for codec, payload, parameters in results["codec_row"]:
        assert codec == "half" and payload == 2 * parameters  # two bytes an element
    assert results["overhead"] == [["toy", results["overhead"][0][1]]]
    assert results["overhead"][0][1] > 0
    # the blocking schedule: a round of 10 steps waits for one all-reduce of 4 MB at 100 Mbit/s
    step_s, exposed_s = results["cost"]
    assert exposed_s == pytest.approx(2 * 0.5 * 8 * 4e6 / 1e8 / 10)
    assert step_s == pytest.approx(0.1 + exposed_s)
