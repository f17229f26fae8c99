"""Length-aware balancing of variable-length documents across data-parallel ranks (Zeppelin).

Attention costs ~s**2 and the linear layers ~s, so ranks given equal token counts still finish
at different times, and the slowest sets every step's (or, for an outer algorithm, every
round's) time. This package:

- packs whole documents into micro-batches with block-diagonal causal attention
  (:class:`lowcomm.models.gpt.Packed`), drawn by :class:`DocumentSampler` from a
  :class:`DocumentCorpus` (:func:`load_documents`; the default is the standard library's
  source, a long-tailed corpus that ships with Python);
- fits a cost model ``c(s) = d + a*s + b*s**2`` per document (+ ``c0`` per micro-batch) on this
  device (:func:`measure_cost_model`, :func:`fit_cost_model`);
- plans which rank trains on which document (:func:`plan`: sequential, random, group-by-length,
  token-balanced, or cost-balanced by LPT or Karmarkar–Karp, under a token cap), the same on
  every rank from all-gathered lengths (:class:`DocumentStream`), per step or per round;
- splits a document too costly for one rank over several with the zig-zag layout and ring
  attention (:class:`RingAttention`), when the link between them makes it pay
  (:func:`split_pays`, :func:`min_split_length`).

``lowcomm train --documents --balance cost`` uses all of it; ``lowcomm bench --balance``
measures it.
"""

from lowcomm.balance.cost import (
    CostFit,
    CostModel,
    OnlineRefit,
    analytic_cost_model,
    features,
    fit_cost_model,
    measure_cost_model,
    timing_shapes,
)
from lowcomm.balance.documents import (
    EMBEDDED_DOCUMENTS,
    DocumentCorpus,
    DocumentSampler,
    load_documents,
    lognormal_texts,
)
from lowcomm.balance.planner import (
    METHODS,
    STRATEGIES,
    LinkTier,
    Piece,
    Plan,
    SplitDecision,
    SplitPolicy,
    min_split_length,
    plan,
    split_pays,
    spread_over_steps,
)
from lowcomm.balance.remap import Remap, attention_owners, remapped_loss, token_bounds
from lowcomm.balance.ring import RingAttention, zigzag_positions, zigzag_sizes, zigzag_take
from lowcomm.balance.stream import (
    ASSIGNMENTS,
    DocumentStream,
    MicroBatch,
    StepWork,
    parse_assignments,
)

__all__ = [
    "ASSIGNMENTS",
    "EMBEDDED_DOCUMENTS",
    "METHODS",
    "STRATEGIES",
    "CostFit",
    "OnlineRefit",
    "Remap",
    "attention_owners",
    "remapped_loss",
    "token_bounds",
    "features",
    "CostModel",
    "DocumentCorpus",
    "DocumentSampler",
    "DocumentStream",
    "LinkTier",
    "MicroBatch",
    "Piece",
    "Plan",
    "RingAttention",
    "SplitDecision",
    "SplitPolicy",
    "StepWork",
    "analytic_cost_model",
    "fit_cost_model",
    "load_documents",
    "lognormal_texts",
    "measure_cost_model",
    "min_split_length",
    "parse_assignments",
    "plan",
    "spread_over_steps",
    "split_pays",
    "timing_shapes",
    "zigzag_positions",
    "zigzag_sizes",
    "zigzag_take",
]
