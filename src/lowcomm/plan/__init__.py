"""``lowcomm plan``: which TP/PP/DP/ZeRO/micro-batch layout trains a model fastest on a cluster.

The parallelism planner of the Frontier study (Dash et al. 2023, arXiv 2312.12705), with the
slow link as a first-class tier: where the data-parallel group crosses a slow tier (between
regions, over the internet), lowcomm's outer algorithms replace the synchronous all-reduce.

* the α-β cost model of collectives and the algorithms' overlap rules, shared with
  ``lowcomm simulate`` and the job's link tuning, is :mod:`lowcomm.tune`;
* :mod:`~lowcomm.plan.spec`: :class:`ModelSpec`, :class:`Precision`, :class:`Cluster` of
  :class:`Tier` s, :class:`Layout`;
* :mod:`~lowcomm.plan.memory` and :mod:`~lowcomm.plan.timing`: peak memory and iteration time of
  a layout, by part (the formulas are in their docstrings); :mod:`~lowcomm.plan.gemm`: a GEMM's
  time from its shape;
* :mod:`~lowcomm.plan.search`: the feasibility rules, the search and the ranking (:func:`plan`);
* :mod:`~lowcomm.plan.presets`: models (Megatron-LM 2021 Table 1, Frontier, Megatron-Core's
  H100 table, BLOOM, Llama) and clusters (DGX A100/H100, Frontier, two regions over 10 Gbit/s),
  with each device's calibrated GEMM efficiency;
* :mod:`~lowcomm.plan.validate` and :mod:`~lowcomm.plan.measure`: the checks against published
  tables and against memory measured on this machine.

Example::

    from lowcomm.plan import PRECISIONS, cluster_preset, model_preset, plan
    result = plan(model_preset("gpt-145b"), PRECISIONS["bf16"], cluster_preset("dgx-a100", 192),
                  global_batch=2304)
    best = result.candidates[0]   # .layout, .memory (bytes by kind), .time (seconds by part)
"""

from lowcomm.plan.memory import MemoryBreakdown, activation_bytes_per_layer, memory
from lowcomm.plan.presets import CLUSTERS, MODELS, cluster_preset, model_preset
from lowcomm.plan.search import Candidate, PlanResult, check_layout, evaluate, plan, rank_of
from lowcomm.plan.spec import PRECISIONS, Cluster, Layout, ModelSpec, Precision, Tier
from lowcomm.plan.timing import TimeBreakdown, iteration_time

__all__ = [
    "CLUSTERS",
    "MODELS",
    "PRECISIONS",
    "Candidate",
    "Cluster",
    "Layout",
    "MemoryBreakdown",
    "ModelSpec",
    "PlanResult",
    "Precision",
    "Tier",
    "TimeBreakdown",
    "activation_bytes_per_layer",
    "check_layout",
    "cluster_preset",
    "evaluate",
    "iteration_time",
    "memory",
    "model_preset",
    "plan",
    "rank_of",
]
