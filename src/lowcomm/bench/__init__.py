"""``lowcomm bench``: throughput, communication and convergence of the algorithms over emulated
(and, where permitted, real tc-shaped) links, against the no-sync ceiling measured in the same run,
plus a micro-benchmark of lowcomm's per-step overhead and the codecs' cost against a clone of the
memory they touch (:mod:`lowcomm.bench.codec`). See :mod:`lowcomm.bench.matrix`."""

from lowcomm.bench.codec import measure_codecs
from lowcomm.bench.matrix import BenchSpec, Cell, run_bench
from lowcomm.bench.overhead import measure_overhead
from lowcomm.bench.results import interpolate_time_to_target

__all__ = [
    "BenchSpec",
    "Cell",
    "interpolate_time_to_target",
    "measure_codecs",
    "measure_overhead",
    "run_bench",
]
