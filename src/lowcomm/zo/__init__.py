"""Zeroth-order fine-tuning with scalar communication: MeZO-SGD and DistZO2's parallel modes
(:mod:`lowcomm.zo.mezo`), and ZO2's offloading of the blocks to host memory
(:mod:`lowcomm.zo.offload`)."""

from lowcomm.zo.mezo import MODES, MeZO, ReplicaDriftError, ZOStep, mezo_decays, zo_seed

__all__ = ["MODES", "MeZO", "ReplicaDriftError", "ZOStep", "mezo_decays", "zo_seed"]
