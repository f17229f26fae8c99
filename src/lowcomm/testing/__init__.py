"""Test harnesses: real gloo process groups in spawned processes, a recording communicator,
and single-process N-worker references of every algorithm. Used by lowcomm's own tests and
usable by anyone checking an integration."""

from lowcomm.testing.dist import run_workers
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
