"""Test harnesses: real gloo process groups in new processes, a recording communicator,
and single-process N-worker references of every algorithm. Used by lowcomm's own tests and
benchmarks, and usable by anyone checking an integration.

Two submodules are imported on their own, as they load the ``lowcomm train`` job:
:mod:`lowcomm.testing.jobs` (the tiny job's flags, per algorithm, and running a job in this
process) and :mod:`lowcomm.testing.runs` (comparing two run folders bit for bit)."""

from lowcomm.procs.workers import run_workers
from lowcomm.testing.recording import RecordingCommunicator
from lowcomm.testing.reference import (
    ReferenceRun,
    inner_step,
    make_inner,
    reference_run,
    toy_batch,
    toy_model,
)

__all__ = [
    "RecordingCommunicator",
    "ReferenceRun",
    "inner_step",
    "make_inner",
    "reference_run",
    "run_workers",
    "toy_batch",
    "toy_model",
]
