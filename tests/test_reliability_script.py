"""The reliability table's script (``benchmarks/reliability.py``) on a small subset of its cases,
over real ``lowcomm train`` processes: one kill point, resumed bit-identically, and two bad
inputs, refused in one line, rendered into the report's tables and totals."""

from __future__ import annotations

import importlib.util
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "reliability.py"


def _load(monkeypatch: Any) -> ModuleType:
    spec = importlib.util.spec_from_file_location("reliability", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "reliability", module)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(240)
def test_one_kill_point_and_two_bad_inputs(tmp_path: Any, monkeypatch: Any) -> None:
    rel = _load(monkeypatch)
    lab = rel.Lab(tmp_path / "runs")

    labels = ["--steps -5", "config: unknown key (sync_evry = 4)"]
    # the independent runs at once: co2's reference run (which the kill point is compared with
    # once it is resumed) and the bad inputs while the kill point's runs go
    with ThreadPoolExecutor(2) as pool:
        reference = pool.submit(lab.reference, "co2")
        refused = pool.submit(
            rel.bad_input_rows, lab, [c for c in rel.BAD_INPUTS if c.label in labels]
        )
        kills = rel.kill_resume_rows(lab, rel.KILL_POINTS_QUICK)
        assert reference.result() == lab.reference("co2")
        bad = refused.result()
    assert len(kills) == 1
    row = kills[0]
    assert row["algorithm"] == "co2"
    assert row["faulted run exit"] == "1"
    assert row["resumed from step"] == str(rel.KILL_POINTS_QUICK[0].resume_step)
    assert row["identical"] == "yes", row
    assert row["differing tensors"].startswith("0 of "), row
    assert row["other differences"] == "0"

    assert [r["input"] for r in bad] == labels
    for r in bad:
        assert (r["exit code"], r["traceback"], r["workers started"]) == ("2", "no", "no"), r
    assert "--steps must be >= 1, got -5" in bad[0]["message"]
    assert "unknown key 'sync_evry'" in bad[1]["message"]

    results = [(rel.section("kill-resume"), kills), (rel.section("bad-inputs"), bad)]
    text = rel.render(results, command="python benchmarks/reliability.py", runtime_s=12.0)
    assert text.startswith("# Reliability of `lowcomm train`\n")
    assert "Command: `python benchmarks/reliability.py`" in text
    assert "## 1. Kill points tried and mismatches found" in text
    assert "## 2. Bad inputs tried and how each was reported" in text
    assert "| co2 | round all-reduce just launched | rank 1, step 8, kill | 4 | 1 | 4 | yes |" in (
        text
    )
    assert "| 1 | --steps -5 | 2 | no | no | --steps must be >= 1, got -5" in text
    assert "- 1. Kill points tried and mismatches found: 1 kill points over 1 algorithms, " in text
    assert "0 mismatches" in text
    assert "2 bad inputs: 2 with exit code 2; 0 with a traceback" in text
