"""Compression settings by name: every codec, and the spec strings that build them.

The codec classes and their exact wire formats are defined in :mod:`lowcomm.compress.formats`
and re-exported here; the adaptive setting :class:`~lowcomm.compress.lgreco.LGreCo` is defined
in :mod:`lowcomm.compress.lgreco`. This module sits above both, so that neither imports it.

Spec strings (:func:`parse_compression`): ``"bf16"``; ``"int8"``, ``"int4"``, ``"int2"`` with
options ``block=B`` (or a bare number) and ``sr`` (stochastic rounding), e.g.
``"int4:block=64:sr"``; ``"sign"`` (one bit an element, option ``block=B``); ``"topk:0.01"``;
``"powersgd:4"`` with options ``rank=``, ``warm=0|1``, ``seed=``; ``"fp32"`` (raw, through the
compressed path: for tests); ``"lgreco:FAMILY"`` (see :mod:`lowcomm.compress.lgreco`); ``"none"``
for no compression.
"""

from __future__ import annotations

from typing import Any

from lowcomm.compress.formats import (
    BF16,
    DEFAULT_BLOCK,
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
    flag_option,
    float_option,
    int_option,
    reject_unknown,
    split_options,
)
from lowcomm.hparams import HyperparameterError

__all__ = [
    "BF16",
    "Codec",
    "ElementwiseCodec",
    "PowerSGD",
    "Quantize",
    "Raw",
    "Sign",
    "TopK",
    "check_compression",
    "orthogonalize",
    "parse_codec",
    "parse_compression",
]

_SPEC_HELP = (
    "use 'bf16', 'int8', 'int4', 'int2' (options :block=B, :sr), 'sign', 'topk:DENSITY' (e.g. "
    "'topk:0.01'), 'powersgd:RANK' (e.g. 'powersgd:4'), 'lgreco:powersgd', 'lgreco:topk', "
    "'lgreco:int', or 'none'"
)


def parse_codec(spec: str) -> Codec:
    """A fixed codec from its spec string (not ``lgreco``, not ``none``)."""
    name, *rest = spec.strip().split(":")
    name = name.strip().lower()
    positional, keyed = split_options(rest)
    if name in ("fp32", "bf16"):
        reject_unknown(spec, keyed, ())
        if positional:
            raise ValueError(f"compression {spec!r}: {name} takes no options")
        return Raw() if name == "fp32" else BF16()
    if name in ("int8", "int4", "int2"):
        reject_unknown(spec, keyed, ("block", "sr"))
        block, sr = DEFAULT_BLOCK, False
        for p in positional:
            if p == "sr":
                sr = True
            elif p.isdigit():
                block = int(p)
            else:
                raise ValueError(
                    f"compression {spec!r}: unknown option {p!r}; e.g. 'int4:block=64:sr'"
                )
        if "block" in keyed:
            block = int_option(spec, "block", keyed["block"])
        if "sr" in keyed:
            sr = flag_option(spec, "sr", keyed["sr"])
        if block < 1:
            raise ValueError(f"compression {spec!r}: block must be >= 1; e.g. 'int4:block=128'")
        return Quantize(bits=int(name[3:]), block=block, stochastic=sr)
    if name == "sign":
        reject_unknown(spec, keyed, ("block",))
        if len(positional) > 1 or (positional and not positional[0].isdigit()):
            raise ValueError(f"compression {spec!r}: sign takes one option, e.g. 'sign:block=64'")
        block = int_option(
            spec, "block", keyed.get("block", positional[0] if positional else str(DEFAULT_BLOCK))
        )
        if block < 1:
            raise ValueError(f"compression {spec!r}: block must be >= 1; e.g. 'sign:block=128'")
        return Sign(block=block)
    if name == "topk":
        reject_unknown(spec, keyed, ("density",))
        if len(positional) > 1:
            raise ValueError(f"compression {spec!r}: top-k takes one density, e.g. 'topk:0.01'")
        raw = keyed.get("density", positional[0] if positional else None)
        if raw is None:
            raise ValueError(f"compression {spec!r} needs a density, e.g. 'topk:0.01'")
        return TopK(density=float_option(spec, "density", raw))
    if name == "powersgd":
        reject_unknown(spec, keyed, ("rank", "warm", "seed", "always"))
        if len(positional) > 1:
            raise ValueError(f"compression {spec!r}: PowerSGD takes one rank, e.g. 'powersgd:4'")
        rank = int_option(spec, "rank", keyed.get("rank", positional[0] if positional else "4"))
        return PowerSGD(
            rank=rank,
            warm_start=flag_option(spec, "warm", keyed.get("warm", "1")),
            seed=int_option(spec, "seed", keyed.get("seed", "0")),
            only_if_smaller=not flag_option(spec, "always", keyed.get("always", "0")),
        )
    raise ValueError(f"unknown compression {spec!r}; {_SPEC_HELP}")


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
