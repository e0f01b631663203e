"""Graph rewrites run by the executor: CSE, pattern fusion, lowering, destructive ordering."""

from __future__ import annotations

import struct
from dataclasses import fields, is_dataclass
from typing import Any


def arg_key(arg: Any) -> Any:
    """A hashable key of a node argument that tells -0.0 from 0.0 and equates NaNs of one bit pattern."""
    if isinstance(arg, float):
        return ("f", struct.pack("<d", arg))
    if isinstance(arg, (tuple, list)):
        return tuple(arg_key(a) for a in arg)
    if is_dataclass(arg) and not isinstance(arg, type):
        return (type(arg).__name__, tuple(arg_key(getattr(arg, f.name)) for f in fields(arg)))
    return arg
