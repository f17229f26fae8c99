"""``lowcomm simulate``: project throughput and scaling of data-parallel training to many workers.

A closed-form model of one training round, per algorithm, evaluated for N = 8 … 1024 workers. It
answers "how fast would this run on N workers over this link?" without running anything, and is
checked against two kinds of measurement: the CO2 paper's reported throughput (``--preset
co2-paper``) and ``lowcomm bench`` cells on this machine (``--calibrate results.json``).

The parts:

* :mod:`~lowcomm.bench.simulate.model`: the α-β cost model: workload, network, the collectives'
  costs and each algorithm's overlap rule (chosen by its schedule in
  :data:`lowcomm.registry.REGISTRY`), projected to N workers; the formulas are there;
* :mod:`~lowcomm.bench.simulate.paper`: the ``co2-paper`` preset, the paper's figures and the
  comparison with them;
* :mod:`~lowcomm.bench.simulate.calibration`: predicted against measured ``lowcomm bench`` cells;
* :mod:`~lowcomm.bench.simulate.report`: tables, JSON and plot (:func:`run_simulate`);
* :mod:`~lowcomm.bench.simulate.cli`: the ``lowcomm simulate`` command line.

What the model leaves out: stragglers and jitter, congestion beyond one NIC per node, compute
slowed by communication kernels, data loading, and any overhead that grows with N other than the
all-reduce. It is a projection, and every report says so.

Paper: Sun et al., "CO2: Efficient Distributed Training with Full Communication-Computation
Overlap", ICLR 2024, https://arxiv.org/abs/2401.16265.

Example::

    net = Network(bandwidth_bps=80e9, latency_s=50e-6, gpus_per_node=8, intra_bandwidth_bps=2.4e12)
    work = Workload(parameters=7_000_000_000, tokens_per_step=4096, step_time_s=1.78,
                    bytes_per_param=2)
    rows = project(work, net, [Algorithm(name="ddp"), Algorithm(name="co2", sync_every=48)])
"""

from lowcomm.bench.simulate.calibration import (
    CalibrationRow,
    calibrate,
    load_results,
    scenario_from_results,
)
from lowcomm.bench.simulate.cli import add_subcommand
from lowcomm.bench.simulate.model import (
    ALGORITHMS,
    DEFAULT_WORKERS,
    Algorithm,
    CostModel,
    Network,
    PaperFigure,
    Projection,
    Scenario,
    StepTime,
    Workload,
    emulated_allreduce_time,
    hierarchical_allreduce_time,
    project,
    ring_allreduce_time,
    solve_compute_time,
    step_time,
)
from lowcomm.bench.simulate.paper import (
    CO2_PAPER_URL,
    PRESETS,
    PaperComparison,
    co2_paper_scenario,
    compare_with_paper,
    paper_implications,
    preset,
)
from lowcomm.bench.simulate.report import (
    SimulateReport,
    format_calibration_table,
    format_markdown,
    format_paper_table,
    format_projection_table,
    run_simulate,
)

__all__ = [
    "ALGORITHMS",
    "CO2_PAPER_URL",
    "DEFAULT_WORKERS",
    "PRESETS",
    "Algorithm",
    "CalibrationRow",
    "CostModel",
    "Network",
    "PaperComparison",
    "PaperFigure",
    "Projection",
    "Scenario",
    "SimulateReport",
    "StepTime",
    "Workload",
    "add_subcommand",
    "calibrate",
    "co2_paper_scenario",
    "compare_with_paper",
    "emulated_allreduce_time",
    "format_calibration_table",
    "format_markdown",
    "format_paper_table",
    "format_projection_table",
    "hierarchical_allreduce_time",
    "load_results",
    "paper_implications",
    "preset",
    "project",
    "ring_allreduce_time",
    "run_simulate",
    "scenario_from_results",
    "solve_compute_time",
    "step_time",
]
