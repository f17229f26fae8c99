"""Elastic replicas on torchft: replicas that die and come back while the others keep training
(``fault_tolerance=`` on every outer algorithm; see :mod:`lowcomm.elastic.sync` for what each
sync does, :mod:`lowcomm.elastic.replica` for the Lighthouse and a replica's Manager). torchft is
the optional extra ``lowcomm[ft]``."""

from lowcomm.elastic.replica import Lighthouse, Replica, replica_manager
from lowcomm.elastic.sync import FaultTolerance

__all__ = ["FaultTolerance", "Lighthouse", "Replica", "replica_manager"]
