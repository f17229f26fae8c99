"""Real link shaping on Linux, to check the emulated link against a real shaped network:
:class:`ShapedNetwork` builds one (network namespaces, a bridge, ``tc`` qdiscs; see
:mod:`lowcomm.bench.netshape.network`), :func:`launch_shaped` runs a ``lowcomm train`` job on it
(:mod:`lowcomm.bench.netshape.job`).

Example::

    cfg = TrainConfig(algo="co2", workers=2, backend="gloo").with_paths()
    with ShapedNetwork(2, 100e6) as net:
        summary = launch_shaped(cfg, net)
    print(summary["tokens_per_s"], summary["network"]["description"])
"""

from lowcomm.bench.netshape.job import launch_shaped
from lowcomm.bench.netshape.network import (
    NETEM_UNAVAILABLE,
    NetshapeError,
    ShapedNetwork,
    netem_available,
    tbf_parameters,
    unavailable_reason,
)

__all__ = [
    "NETEM_UNAVAILABLE",
    "NetshapeError",
    "ShapedNetwork",
    "launch_shaped",
    "netem_available",
    "tbf_parameters",
    "unavailable_reason",
]
