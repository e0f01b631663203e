"""DynScalar bindings at realize (integers of any kind bind, anything else is a ParamError, never truncated),
and which arrays are constants (`frozen`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

import fuel as fl
from fuel.graph.node import frozen
from fuel.io.gguf import open_gguf
from fuel.testing.gguf_files import q8_0_weight, write_gguf


def _written_at(pos: object) -> np.ndarray:
    cache = np.zeros((4, 2), np.float32)
    fl.realize(fl.cache_write(fl.tensor(cache), fl.tensor(np.ones((1, 2), np.float32)), fl.dyn("pos")),
               env={"pos": pos})  # type: ignore[dict-item]
    return cache


@pytest.mark.parametrize("bad", [2.0, 2.7, np.float32(2.0), True, np.array(2.5), "2"], ids=repr)
def test_realize_binds_integers_and_refuses_anything_else(bad: object) -> None:
    want = np.zeros((4, 2), np.float32)
    want[2] = 1.0
    for pos in (2, np.int64(2), np.uint8(2), np.array(2), np.array(2, np.uint32)):
        np.testing.assert_array_equal(_written_at(pos), want)
    message = re.escape(f"realize: dynamic scalar 'pos' must be an integer (a Python or NumPy integer, or a 0-d "
                        f"integer array), got {bad!r} ({type(bad).__name__})")
    with pytest.raises(fl.ParamError, match=message):
        _written_at(bad)


def _cases(tmp_path: Path) -> dict[str, tuple[np.ndarray, Callable[[], None] | None]]:
    """Arrays by name, each with a way to change its contents from outside, or None where none exists."""
    owned = np.arange(6, dtype=np.float32)
    read_only = owned.copy()
    read_only.flags.writeable = False
    view = owned.view()
    view.flags.writeable = False
    buffer = bytearray(8)
    over_bytearray = np.frombuffer(buffer, np.uint8)
    over_bytearray.flags.writeable = False
    path = tmp_path / "m.bin"
    path.write_bytes(bytes(range(16)))
    r_plus, copy_on_write = np.memmap(path, np.uint8, mode="r+"), np.memmap(path, np.uint8, mode="c")
    f = open_gguf(write_gguf(tmp_path / "w.gguf", [("w", np.ones((4, 32), np.float32), None),
                                                   ("q", q8_0_weight(np.random.default_rng(0), 4, 32)[0], GT.Q8_0)]))

    def fill(a: np.ndarray) -> Callable[[], None]:
        return lambda: a.fill(7)

    return {"writable": (owned, fill(owned)), "read-only": (read_only, None),
            "read-only slice": (read_only[1::2], None),
            "read-only view of a writable array": (view, fill(owned)),
            "read-only view of a bytearray": (over_bytearray, lambda: buffer.__setitem__(0, 7)),
            "over bytes": (np.frombuffer(b"abcdefgh", np.uint8), None),
            "memmap r": (np.memmap(path, np.uint8, mode="r"), None), "memmap r+": (r_plus, fill(r_plus)),
            "memmap c": (copy_on_write, fill(copy_on_write)),
            "gguf f32 weight": (f["w"].array(), None), "gguf q8_0 words": (f["q"].words, None)}


@pytest.mark.parametrize("name", ["writable", "read-only", "read-only slice", "read-only view of a writable array",
                                  "read-only view of a bytearray", "over bytes", "memmap r", "memmap r+",
                                  "memmap c", "gguf f32 weight", "gguf q8_0 words"])
def test_frozen_is_true_exactly_when_nothing_can_write_the_array(name: str, tmp_path: Path) -> None:
    """The constants fl.jit may fold: GGUF weights (views of a read-only memory map) are; a read-only view
    of a writable array is not, and its contents do change when the array below is written."""
    a, writer = _cases(tmp_path)[name]
    assert frozen(a) is (writer is None)
    if writer is not None:
        before = a.copy()
        writer()
        assert not np.array_equal(a, before)
    else:
        with pytest.raises(ValueError, match="read-only"):
            a[...] = 7
