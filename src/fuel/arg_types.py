"""Argument types for the command line's parsers (`fuel.cli`, `fuel generate`, `fuel embed`)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any


def number(kind: Callable[[str], Any], low: float, high: float = math.inf, low_open: bool = False,
           what: str = "") -> Callable[[str], Any]:
    """An argparse type: `kind(text)` within [low, high] ((low, high] if `low_open`), finite; otherwise
    "expected {what}, got ..."."""

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(v) or v > high or v < low or (low_open and v == low):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return v
    return parse
