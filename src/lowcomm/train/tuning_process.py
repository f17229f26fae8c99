"""The process that chooses an elastic job's settings from its link, once, before the replicas
start (``python -m lowcomm.train.tuning_process CONFIG_JSON OUT_JSON``; the launcher,
:func:`lowcomm.train.elastic.launch_replicas`, runs it with the environment of one process of a
replica): see :mod:`lowcomm.train.tuning`."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from lowcomm.train.config import TrainConfig
from lowcomm.train.topology import Topology
from lowcomm.train.tuning import tune_to_link

__all__ = ["main"]


def _tune_job(out: str) -> Any:
    """The tuning process's job: the choice for the elastic job's replicas, into ``out``."""

    def job(cfg: TrainConfig, *, device: torch.device) -> None:
        from lowcomm.runfiles import write_json
        from lowcomm.train.model import build_gpt
        from lowcomm.train.nodes import NodeGroups
        from lowcomm.train.source import DataSource

        # one process of a replica, on its own: no Manager, no quorum
        topology = Topology(cfg, 0, 1, NodeGroups(node=None, cross=None))
        data = DataSource.load(cfg, topology, device)
        torch.manual_seed(cfg.seed)
        gpt = build_gpt(cfg, data.vocab_size).to(device)
        _, record = tune_to_link(cfg, topology, gpt, data.corpus, device)
        write_json(out, {"record": record})

    return job


def main(argv: list[str] | None = None) -> int:
    """``python -m lowcomm.train.tuning_process CONFIG_JSON OUT_JSON``: the settings an
    elastic job's replicas take from its link, chosen once by this process (started by the
    launcher, with the environment of one process of a replica), written to ``OUT_JSON``."""
    from lowcomm.train.config import config_from_dict
    from lowcomm.train.worker import run_worker

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m lowcomm.train.tuning_process CONFIG_JSON OUT_JSON")
    with open(args[0], encoding="utf-8") as f:
        cfg = config_from_dict(json.load(f), source=args[0])
    run_worker(cfg, False, None, _tune_job(args[1]))
    return 0


if __name__ == "__main__":
    from lowcomm.procs.forkserver import exit_now

    exit_now(main())
