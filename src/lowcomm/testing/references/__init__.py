"""One single-process reference per algorithm (written from the formulas, not from the
classes) beside the shared :class:`~lowcomm.testing.references.world.World`; the driver is
:func:`lowcomm.testing.reference.reference_run`. A new algorithm adds its reference here."""

from lowcomm.testing.references.co2 import CO2Reference
from lowcomm.testing.references.diloco import DiLoCoReference, SlowMoReference
from lowcomm.testing.references.localsgd import LocalSGDReference
from lowcomm.testing.references.noloco import NoLoCoReference
from lowcomm.testing.references.sparseloco import SparseLoCoReference
from lowcomm.testing.references.streaming import CoCoDCReference, StreamingReference
from lowcomm.testing.references.world import ALGO_DEFAULTS, Reference, ReferenceRun, World

__all__ = ["ALGO_DEFAULTS", "REFERENCES", "Reference", "ReferenceRun", "World"]

REFERENCES: dict[str, type[Reference]] = {
    "localsgd": LocalSGDReference,
    "diloco": DiLoCoReference,
    "slowmo": SlowMoReference,
    "streaming": StreamingReference,
    "cocodc": CoCoDCReference,
    "co2": CO2Reference,
    "noloco": NoLoCoReference,
    "sparseloco": SparseLoCoReference,
}
"""Each algorithm's reference, by its class's name."""
