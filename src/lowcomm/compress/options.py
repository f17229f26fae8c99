"""Options of compression spec strings: ``"NAME:positional:key=value:..."``.

The pieces after the name are split into positional options (lower-cased) and ``key=value``
options (keys lower-cased), and typed with an error message that quotes the whole spec. Used by
:func:`lowcomm.compress.codecs.parse_codec` and :func:`lowcomm.compress.lgreco.parse_lgreco`.
"""

from __future__ import annotations

__all__ = ["flag_option", "float_option", "int_option", "reject_unknown", "split_options"]


def split_options(parts: list[str]) -> tuple[list[str], dict[str, str]]:
    """The positional options and the ``key=value`` options of a spec's ``:``-separated parts
    (the name excluded); empty parts are skipped."""
    positional: list[str] = []
    keyed: dict[str, str] = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if eq:
            keyed[key.strip().lower()] = value.strip()
        elif part.strip():
            positional.append(part.strip().lower())
    return positional, keyed


def int_option(spec: str, key: str, value: str) -> int:
    """``value`` of option ``key`` of ``spec`` as an integer."""
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"compression {spec!r}: {key} must be an integer, got {value!r}") from None


def float_option(spec: str, key: str, value: str) -> float:
    """``value`` of option ``key`` of ``spec`` as a number."""
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"compression {spec!r}: {key} must be a number, got {value!r}") from None


def flag_option(spec: str, key: str, value: str) -> bool:
    """``value`` of option ``key`` of ``spec`` as a flag (1/0, true/false, yes/no, on/off)."""
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"compression {spec!r}: {key} must be 0 or 1, got {value!r}")


def reject_unknown(spec: str, keyed: dict[str, str], allowed: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming the ``key=value`` options of ``spec`` not in ``allowed``."""
    extra = sorted(set(keyed) - set(allowed))
    if extra:
        raise ValueError(
            f"compression {spec!r}: unknown option(s) {', '.join(extra)}; "
            f"allowed: {', '.join(allowed) or 'none'}"
        )
