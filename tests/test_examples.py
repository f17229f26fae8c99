"""The trainer examples run with the commands their docstrings give (shortened by flags the
scripts take), offline, on CPU, under torchrun."""

from __future__ import annotations

import ast
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _commands(script: str) -> list[list[str]]:
    """The ``torchrun ...`` command lines of ``script``'s docstring."""
    doc = ast.get_docstring(ast.parse((EXAMPLES / script).read_text())) or ""
    lines = [line.strip() for line in doc.splitlines() if line.strip().startswith("torchrun ")]
    assert lines, f"{script}: no torchrun command in its docstring"
    return [shlex.split(line) for line in lines]


def _run(argv: list[str], cwd: Path) -> str:
    # torchrun as this interpreter's module: the virtual environment's, wherever it is
    command = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _check(out: str, final: str) -> float:
    assert final in out
    loss = float(out.split(final)[1].split(";")[0])
    assert 0 < loss < 7.3  # an untrained model scores about ln(2048) = 7.6: it learned
    return loss


SHORT = ["--steps", "16", "--sync-every", "4"]


@pytest.mark.timeout(300)
def test_hf_example_runs_and_resumes_with_its_docstring_commands(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    first, resume = _commands("hf_trainer.py")
    assert "--resume" in resume
    short = [*SHORT, "--out", str(tmp_path / "run")]
    loss = _check(_run([*first, *short], ROOT), "final eval loss")
    # the resume command continues from the last checkpoint (step 16: nothing left to train,
    # the same model evaluated again)
    out = _run([*resume, *short], ROOT)
    assert f"final eval loss {loss:.3f}" in out


@pytest.mark.timeout(300)
def test_lightning_example_runs_with_its_docstring_command(tmp_path: Any) -> None:
    # (its resume through the callback is tested in test_integrations.py, bit for bit)
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    first = _commands("lightning_diloco.py")[0]
    _check(_run([*first, *SHORT, "--out", str(tmp_path / "run")], ROOT), "final val loss")
