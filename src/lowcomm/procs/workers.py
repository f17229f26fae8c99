"""Run a function on N real processes joined by a process group on 127.0.0.1 (gloo; NCCL with
one GPU per process; gloo with the processes sharing the GPUs, as ``lowcomm train`` runs more
workers than GPUs)."""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lowcomm.procs.forkserver import preload

__all__ = ["run_workers"]


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out_dir: str,
    timeout_s: float,
    barrier: bool,
    backend: str,
    cuda: bool,
) -> None:
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        if cuda:
            # before the process group binds to a device: rank r on GPU r mod G (one GPU per
            # rank on NCCL, which run_workers checked; shared on gloo)
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            result = fn(rank, world_size, *args)
            if barrier:
                dist.barrier()
        finally:
            dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # report any failure to the parent, which raises it
        torch.save({"ok": False, "error": traceback.format_exc()}, path)


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    collective_timeout_s: float | None = None,
    barrier: bool = True,
    backend: str = "gloo",
    cuda: bool | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes with a gloo
    WORLD group bound to 127.0.0.1 (``backend="nccl"``: an NCCL one, rank r on GPU r, the
    current CUDA device; ``cuda=True`` with gloo: rank r's current CUDA device is GPU r mod G,
    so that ranks share the G visible GPUs; ``cuda`` unset: with NCCL alone); return the
    per-rank results (saved with ``torch.save``:
    tensors, numbers, strings and plain containers, which the parent loads with
    ``weights_only=True``). Collectives time out after ``collective_timeout_s`` (default:
    ``timeout_s``); with ``barrier`` every rank waits for the others after ``fn`` (leave it off
    where ``fn`` ends with its process group broken, as after a timed-out collective).

    ``fn`` must be importable (a module-level function). A failure on any rank raises
    ``RuntimeError`` with that rank's traceback; processes still running after ``timeout_s``
    are terminated (only the ones started here) and ``TimeoutError`` is raised.
    """
    if cuda is None:
        cuda = "nccl" in backend
    if cuda:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise ValueError(
                f"run_workers(backend={backend!r}, cuda=True) needs a CUDA device and none is "
                "available; use backend='gloo' with cuda=False"
            )
        if "nccl" in backend and world_size > gpus:
            raise ValueError(
                f"backend={backend!r} needs a GPU per rank: {world_size} ranks, {gpus} GPU(s); "
                "use backend='gloo', cuda=True (the ranks then share the GPUs) or fewer ranks"
            )
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # workers are forked from a server process that imported torch and lowcomm once and runs
    # nothing else (clean, like spawn's fresh interpreters, without importing torch again per
    # worker: about 2 s per call); the same server as the training jobs' workers
    ctx = mp.get_context("forkserver")
    preload()
    with tempfile.TemporaryDirectory(prefix="lowcomm-test-") as out_dir:
        procs = [
            ctx.Process(
                target=_entry,
                args=(
                    rank,
                    world_size,
                    store.port,
                    fn,
                    args,
                    out_dir,
                    timeout_s if collective_timeout_s is None else collective_timeout_s,
                    barrier,
                    backend,
                    cuda,
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.terminate()
        for p in alive:
            p.join(5)
        results: list[Any] = []
        errors: list[str] = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: no result (exit code {procs[rank].exitcode})")
                continue
            rec = torch.load(path, weights_only=True)  # plain tensors, numbers and strings
            if rec["ok"]:
                results.append(rec["result"])
            else:
                errors.append(f"rank {rank}:\n{rec['error']}")
        if alive:
            raise TimeoutError(
                f"{len(alive)} of {world_size} workers still running after {timeout_s} s; "
                + "\n".join(errors)
            )
        if errors:
            raise RuntimeError("distributed workers failed:\n" + "\n".join(errors))
        return results
