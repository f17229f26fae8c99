"""Compressed communication with error feedback, and L-GreCo layer-wise adaptive compression.

* Codecs (:mod:`~lowcomm.compress.formats`): :class:`BF16`, :class:`Quantize` (blockwise int8 /
  int4 / int2, optional stochastic rounding), :class:`TopK`, :class:`PowerSGD`; each reports its
  exact wire bytes. Spec strings (:mod:`~lowcomm.compress.codecs`): :func:`parse_compression`.
* Collectives (:mod:`~lowcomm.compress.collectives`): all-gather of compressed payloads with
  decoding and averaging in rank order (elementwise codecs), PowerSGD's two all-reduces.
* Error feedback (:class:`Compressor`): a residual per tensor on each rank.
* L-GreCo (:mod:`~lowcomm.compress.lgreco`): :func:`choose`, the dynamic programme, and
  :class:`LGreCo`, the adaptive setting.
* Integration: ``compression=`` on :class:`~lowcomm.DiLoCo`, :class:`~lowcomm.CO2`,
  :class:`~lowcomm.StreamingDiLoCo`, :class:`~lowcomm.CoCoDC` (a codec or a spec string such as
  ``"int4"``, ``"topk:0.01"``, ``"powersgd:4"``, ``"lgreco:powersgd"``), and
  :func:`ddp_hook` for per-step gradients under DDP.

Example::

    algo = lowcomm.CO2(model, inner, sync_every=12, compression="int4")
    state, hook = lowcomm.compress.ddp_hook("powersgd:4"); ddp.register_comm_hook(state, hook)
"""

from lowcomm.compress.codecs import parse_compression
from lowcomm.compress.collectives import CompressedHandle
from lowcomm.compress.ddp import DDPCompressionState, ddp_hook
from lowcomm.compress.feedback import Compressor
from lowcomm.compress.formats import (
    BF16,
    Codec,
    ElementwiseCodec,
    PowerSGD,
    Quantize,
    Raw,
    Sign,
    TopK,
)
from lowcomm.compress.lgreco import LGreCo, choose

__all__ = [
    "BF16",
    "Codec",
    "CompressedHandle",
    "Compressor",
    "DDPCompressionState",
    "ElementwiseCodec",
    "LGreCo",
    "PowerSGD",
    "Quantize",
    "Raw",
    "Sign",
    "TopK",
    "choose",
    "ddp_hook",
    "parse_compression",
]
