"""A ``lowcomm train`` job on a :class:`~lowcomm.bench.netshape.network.ShapedNetwork`: one
worker process in each of its namespaces, started by the job's own launcher
(:func:`lowcomm.train.launcher.launch_processes`)."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from lowcomm.runfiles import write_json
from lowcomm.train.launcher import (
    WorkerProcess,
    check_environment,
    launch_processes,
    prepare_output,
)

if TYPE_CHECKING:
    from lowcomm.bench.netshape.network import ShapedNetwork
    from lowcomm.train.config import TrainConfig

__all__ = ["launch_shaped"]


def launch_shaped(
    cfg: TrainConfig, net: ShapedNetwork, *, timeout_s: float = 900.0
) -> dict[str, Any]:
    """Run a ``lowcomm train`` job with one worker process in each namespace of ``net``.

    The workers are started by :func:`lowcomm.train.launcher.launch_processes` under
    ``ip netns exec NS`` with the environment of :meth:`ShapedNetwork.worker_env`
    (``LOCAL_RANK`` 0 and ``LOCAL_WORLD_SIZE`` the world size, so they split this machine's
    cores), gloo bound to their shaped veth. Their output is captured; rank 0's summary gets a
    ``network`` entry describing the real link, in the returned dict and in
    ``<out>/summary.json``.

    Args:
        cfg: the configuration, ``name`` and ``out`` resolved (:meth:`TrainConfig.with_paths`),
            ``workers`` equal to ``net.world_size`` and no emulated ``link``; backend gloo
            (``auto`` means gloo here).
        net: an entered :class:`ShapedNetwork`.
        timeout_s: stop the workers and fail after this many seconds.

    Returns:
        Rank 0's run summary.

    Raises:
        ValueError: ``cfg`` does not fit ``net``.
        lowcomm.train.config.ConfigError: the environment checks of ``lowcomm train`` failed.
        lowcomm.train.launcher.WorkerFailed: a worker failed (the root cause is reported) or
            the job did not finish within ``timeout_s``.
    """
    if not net.active:
        raise ValueError(
            "launch_shaped needs an entered network: `with ShapedNetwork(...) as net:`"
        )
    if cfg.out is None or cfg.name is None:
        raise ValueError("cfg needs its paths resolved: pass cfg.with_paths()")
    if cfg.workers != net.world_size:
        raise ValueError(
            f"cfg.workers ({cfg.workers}) must equal the network's world size ({net.world_size})"
        )
    if cfg.link is not None:
        raise ValueError(
            f"cfg.link ({cfg.link!r}) must be unset: the real network is shaped, an emulated "
            "link would add its delays on top"
        )
    if cfg.backend == "nccl":
        raise ValueError("the shaped network carries gloo traffic; use backend gloo (or auto)")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    cfg = dataclasses.replace(cfg, backend="gloo")
    check_environment(cfg)
    prepare_output(cfg)
    workers = [
        WorkerProcess(
            env={
                **net.worker_env(rank),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": str(net.world_size),
            },
            prefix=net.exec_prefix(rank),
        )
        for rank in range(net.world_size)
    ]
    summary = launch_processes(cfg, workers, timeout_s=timeout_s)
    summary["network"] = {
        "shaping": "real",
        "description": net.describe(),
        "bandwidth_bps": net.bandwidth_bps,
        "latency_s": net.latency_s,
        "latency_applied": net.latency_applied,
    }
    assert cfg.out is not None
    write_json(os.path.join(cfg.out, "summary.json"), summary)
    return summary
