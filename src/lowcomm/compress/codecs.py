"""Compression settings by name: every codec, and the spec strings that build them.

The codec classes and their exact wire formats are defined in :mod:`lowcomm.compress.formats`
and re-exported here; the adaptive setting :class:`~lowcomm.compress.lgreco.LGreCo` is defined
in :mod:`lowcomm.compress.lgreco`. This module sits above both, so that neither imports it.

Spec strings (:func:`parse_compression`): ``"bf16"``; ``"int8"``, ``"int4"``, ``"int2"`` with
options ``block=B`` (or a bare number) and ``sr`` (stochastic rounding), e.g.
``"int4:block=64:sr"``; ``"sign"`` (one bit an element, option ``block=B``); ``"topk:0.01"``;
``"sparse"`` (SparseLoCo's chunk-wise top-k with 2-bit values: ``"sparse:0.02:chunk=64:bits=4"``,
:mod:`lowcomm.compress.sparse`);
``"powersgd:4"`` with options ``rank=``, ``warm=0|1``, ``seed=``; ``"fp32"`` (raw, through the
compressed path: for tests); ``"lgreco:FAMILY"`` (see :mod:`lowcomm.compress.lgreco`); ``"none"``
for no compression.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from lowcomm.compress.formats import (
    BF16,
    Codec,
    ElementwiseCodec,
    PowerSGD,
    Quantize,
    Raw,
    Sign,
    TopK,
    orthogonalize,
)
from lowcomm.compress.lgreco import LGreCo, parse_lgreco
from lowcomm.compress.options import (
    split_options,
)
from lowcomm.compress.sparse import Sparse
from lowcomm.hparams import HyperparameterError

__all__ = [
    "BF16",
    "CODECS",
    "Codec",
    "ElementwiseCodec",
    "PowerSGD",
    "Quantize",
    "Raw",
    "Sign",
    "Sparse",
    "TopK",
    "check_compression",
    "orthogonalize",
    "parse_codec",
    "parse_compression",
]

_SPEC_HELP = (
    "use 'bf16', 'int8', 'int4', 'int2' (options :block=B, :sr), 'sign', 'topk:DENSITY' (e.g. "
    "'topk:0.01'), 'sparse' (options DENSITY, :chunk=S, :bits=2|4|32), 'powersgd:RANK' (e.g. "
    "'powersgd:4'), 'lgreco:powersgd', 'lgreco:topk', 'lgreco:int', or 'none'"
)


CODECS: Mapping[str, type[Codec]] = MappingProxyType(
    {
        "fp32": Raw,
        "bf16": BF16,
        "int8": Quantize,
        "int4": Quantize,
        "int2": Quantize,
        "sign": Sign,
        "topk": TopK,
        "sparse": Sparse,
        "powersgd": PowerSGD,
    }
)
"""Every codec's spec name and its class, which parses the rest of the spec
(:meth:`~lowcomm.compress.formats.Codec.from_spec`): a new codec is its class and a line here."""


def parse_codec(spec: str) -> Codec:
    """A fixed codec from its spec string (not ``lgreco``, not ``none``)."""
    name, *rest = spec.strip().split(":")
    name = name.strip().lower()
    positional, keyed = split_options(rest)
    codec = CODECS.get(name)
    if codec is None:
        raise ValueError(f"unknown compression {spec!r}; {_SPEC_HELP}")
    return codec.from_spec(spec, name, positional, keyed)


def parse_compression(spec: str | Codec | LGreCo | None) -> Codec | LGreCo | None:
    """A codec, an :class:`~lowcomm.compress.lgreco.LGreCo` setting, or ``None`` from a spec
    string (see the module docstring), a codec instance, or ``None``. Raises ``ValueError``
    naming the fix for anything else."""
    if spec is None or isinstance(spec, (Codec, LGreCo)):
        return spec
    if not isinstance(spec, str):
        raise ValueError(
            f"compression must be a spec string, a lowcomm.compress codec or None, got "
            f"{type(spec).__name__}; {_SPEC_HELP}"
        )
    key = spec.strip().lower()
    if key in ("", "none"):
        return None
    if key.split(":")[0].strip() == "lgreco":
        return parse_lgreco(spec)
    return parse_codec(spec)


def check_compression(key: str, value: Any) -> None:
    """The hyperparameter check of a ``compression`` setting (a spec, codec or ``None``)."""
    if value is not None:
        try:
            parse_compression(value)
        except ValueError as e:
            message = str(e)
            if message.startswith(f"{key} "):
                raise HyperparameterError(key, message.removeprefix(f"{key} ")) from None
            raise HyperparameterError(key, f"is not usable: {message}") from None
