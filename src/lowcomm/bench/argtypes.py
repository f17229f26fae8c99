"""Argument types of ``lowcomm bench``'s flags: comma-separated lists (split at the commas
outside brackets), of integers, of numbers."""

from __future__ import annotations

import argparse

__all__ = ["csv_list", "float_csv", "int_csv", "split_top"]


def split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets: ``co2/speeds=[1,0.5],ddp`` is two."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "(": 1, "]": -1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [*items, text[start:]]


def csv_list(text: str) -> list[str]:
    items = [t.strip() for t in split_top(text) if t.strip()]
    if text.strip().lower() == "none":
        return []
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def int_csv(text: str) -> list[int]:
    try:
        return [int(t) for t in csv_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 2,4, got {text!r}"
        ) from None


def float_csv(text: str) -> list[float]:
    try:
        return [float(t) for t in csv_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers such as 1,10,85, got {text!r}"
        ) from None
