"""The GGUF block types as one table, and the generator of their tasks (`gguf_kernels`, checked in).

`TYPES` is the table (as ggml's `type_traits_cpu`): per `QuantType`, its block decoder (`gguf_dequant`), its
decode unit and super-block scale unpacker (`gguf_units`), what its units share (the `gguf_gemv` kind bits)
and the two-row dot its one-row task pairs W rows with; `VARIANTS` adds the one-row kernels some types have
besides (table lookups, 32-bit words). The block geometry is the `QuantType`'s own.

Every task of a type differs from another type's only in those names and numbers, so each is one call of a
template (`gguf_dequant.dequant_rows` and `dequant_tiles`, `gguf_gemv.one_row`, `one_row_permuted` and
`many_rows`, `gguf_words.one_row_words`) written out under its own name: a named module-level function is
what Numba's cache finds again (a factory's closures it does not). Adding a type: its decoders, a row here,
then `python -m fuel.cpu.quant.gguf_types` (a test checks the checked-in module is what this writes).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fuel.quant import QuantType
from fuel.runtime.pool import Task


class TypeRow(NamedTuple):
    """A type's decoders by name, the kind bits of its units and the two-row dot of its one-row task."""

    unit: str
    prep: str
    kind: str
    pair: str


_BLOCKS = "SHARED"  # one scale a 32-element block
# ... and an offset: each unit's values formed once by FMA (code·s + b), then two FMAs a row, fewer operations
# than factoring the scale and offset out from two rows on and no more at one (docs/performance/quant.md,
# "affine values")
_OFFSETS = "SHARED | BIAS | AFFINE"

TYPES: dict[QuantType, TypeRow] = {
    QuantType.Q4_0: TypeRow("unit_q4_0", "prep_none", _BLOCKS, "bpair"),
    QuantType.Q4_1: TypeRow("unit_q4_1", "prep_none", _OFFSETS, "bpair"),
    QuantType.Q5_0: TypeRow("unit_q5_0", "prep_none", _BLOCKS, "bpair"),
    QuantType.Q5_1: TypeRow("unit_q5_1", "prep_none", _OFFSETS, "bpair"),
    QuantType.Q8_0: TypeRow("unit_q8_0", "prep_none", _BLOCKS, "bpair"),
    QuantType.Q8_1: TypeRow("unit_q8_1", "prep_none", _BLOCKS, "bpair"),
    QuantType.Q2K: TypeRow("unit_q2k", "prep_q2k", "SUPER | BIAS", "kpair"),
    QuantType.Q3K: TypeRow("unit_q3k", "prep_q3k", "SUPER", "kpair"),
    QuantType.Q4K: TypeRow("unit_q4k", "prep_q45k", "SUPER | SHARED | BIAS | FACTOR_BIAS", "kpair"),
    QuantType.Q5K: TypeRow("unit_q5k", "prep_q45k", "SUPER | SHARED | BIAS | FACTOR_BIAS", "kpair"),
    QuantType.Q6K: TypeRow("unit_q6k", "prep_q6k", "SUPER", "kpair"),
}


class GGUFKernels(NamedTuple):
    """A type's block decoder `block(bytes, out)` and its tasks: `rows` (weight rows into a buffer), `one`
    (one activation row), `many` (2-16 rows, each as `one` computes it), `tiles` (dequantised tiles of W
    rows, multiplied); `table` (a one-row task by table lookup on this host, its many-row form, and the
    lane order they read the activations in) and `words` (a one-row task by 32-bit words and its many-row
    form), where the type has them."""

    block: Any
    rows: Task
    one: Task
    many: Task
    tiles: Task
    table: tuple[Task, Task, np.ndarray] | None
    words: tuple[Task, Task] | None


class Variant(NamedTuple):
    """A one-row kernel besides the portable one: by table (`host`: the flag of `nibble_tables` it needs;
    `order`: the lane order the activations are permuted to, `gguf_units`) or by words (`layout`)."""

    qt: QuantType
    name: str
    unit: str
    pair: str
    host: str = ""
    order: str = ""
    layout: str = ""
    kind: str = ""  # where not the type's own (`TYPES`)

    def tasks(self) -> tuple[str, str]:
        """The names of its one-row task and its many-row form in `gguf_kernels`."""
        t = self.qt.name.lower()
        return f"_{t}_one_{self.name}", f"_{t}_many_{self.name}"


VARIANTS = (
    Variant(QuantType.Q4_0, "table", "table_unit_q4_0", "bpair", "LUT16", "UNIT_ORDER_Q4_0"),
    Variant(QuantType.Q4_0, "bytes", "bytes_unit_q4_0", "bpair", "BYTE_LUT", "BYTE_ORDER_Q4_0"),
    # each unit's 16 values formed once (one FMA) and looked up: Q4_1's affine values at fewer operations
    Variant(QuantType.Q4_1, "table", "table_unit_q4_1", "bpair", "LUT16", "UNIT_ORDER_Q4_0", kind="VALUES"),
    Variant(QuantType.Q4K, "table", "unit_q4k", "kpair_q4k_table", "LUT16", "UNIT_ORDER_Q4K"),
    Variant(QuantType.Q4K, "words", "unit_q4k", "kpair_q4k", layout="Q4K_LAYOUT"),
    Variant(QuantType.Q6K, "words", "unit_q6k", "kpair_q6k", layout="Q6K_LAYOUT"),
)

# Each one-row pair's many-row form (`gguf_many`): its four-row function, super-block form and ending.
MANY = {
    "bpair": ("bquad", "super4", "WITH_OFFSETS"),
    "kpair": ("kquad", "super4", "WITH_OFFSETS"),
    "kpair_q4k_table": ("kquad", "super4_q4k_table", "WITH_OFFSETS"),
    "kpair_q4k": ("kquad", "super4_q4k_words", "SCALED_OFFSETS"),
    "kpair_q6k": ("kquad", "super4_q6k_words", "SCALED_SUM"),
}

TARGET = Path(__file__).with_name("gguf_kernels.py")

_HEAD = '''"""GENERATED by `python -m fuel.cpu.quant.gguf_types` from its table: do not edit.

Each GGUF type's tasks, each one call of its template with the type's decoders and numbers, and `GGUF`,
the table of them by `QuantType`.
"""

from __future__ import annotations

{imports}'''

_TASKS = '''

@task()
def _{t}_rows(part: int, parts: int, argv: int) -> None:
    dequant_rows(gguf_dequant.dequant_{t}, {blk}, {bpb}, part, parts, argv)


@task()
def _{t}_one(part: int, parts: int, argv: int) -> None:
    one_row({unit}, {prep}, {bpb}, {kind}, {pair}, part, parts, argv)


@task()
def _{t}_many(part: int, parts: int, argv: int) -> None:
    many_rows({unit}, {prep}, {bpb}, {kind}, {pair}, {quad}, {sup}, {how}, part, parts, argv)


@task()
def _{t}_tiles(part: int, parts: int, argv: int) -> None:
    dequant_tiles(gguf_dequant.dequant_{t}, {blk}, {bpb}, part, parts, argv)
'''

_TABLE_TASK = '''

@task()
def _{t}_one_{name}(part: int, parts: int, argv: int) -> None:
    one_row_permuted({unit}, {prep}, {bpb}, {kind}, {pair}, part, parts, argv)


@task()
def _{t}_many_{name}(part: int, parts: int, argv: int) -> None:
    many_rows_permuted({unit}, {prep}, {bpb}, {kind}, {pair}, {quad}, {sup}, {how}, {order}, part, parts, argv)
'''

_WORDS_TASK = '''

@task()
def _{t}_one_{name}(part: int, parts: int, argv: int) -> None:
    one_row_words({unit}, {prep}, {bpb}, {kind}, {pair}, {layout}, part, parts, argv)


@task()
def _{t}_many_{name}(part: int, parts: int, argv: int) -> None:
    many_rows_words({unit}, {prep}, {bpb}, {kind}, {pair}, {quad}, {sup}, {how}, {layout}, part, parts, argv)
'''


def _lower(qt: QuantType) -> str:
    return qt.name.lower()


def _import_order(name: str) -> tuple[int, list[tuple[int, str]]]:
    """isort's order (ruff's): constants, then classes, then the rest, numbers compared as numbers."""
    kind = 0 if name.isupper() else 1 if name[0].isupper() else 2
    return kind, [(int(p), "") if p.isdigit() else (-1, p.lower()) for p in re.split(r"(\d+)", name)]


def _wrapped(text: str) -> str:
    """Lines over 120 characters broken after their call's opening parenthesis, and its arguments after
    the last comma that keeps each line within 120."""
    out = []
    for line in text.split("\n"):
        if len(line) > 120 and "(" in line:
            head, args = line.split("(", 1)
            indent = " " * (len(head) - len(head.lstrip()) + 8)
            out.append(f"{head}(")
            while len(indent + args) > 120:
                cut = (indent + args).rindex(", ", 0, 120) - len(indent) + 1
                out.append(indent + args[:cut])
                args = args[cut + 1:]
            out.append(indent + args)
        else:
            out.append(line)
    return "\n".join(out)


def _table_entry(qt: QuantType) -> str:
    """The host-dependent `table` field: the first variant whose flag the host has, else None."""
    tables = [v for v in VARIANTS if v.qt == qt and v.order]
    return "".join(f"({', '.join(v.tasks())}, {v.order}) if {v.host} else " for v in tables) + "None"


def _imports() -> dict[str, set[str]]:
    """The names the generated module imports, by module."""
    kind_texts = [row.kind for row in TYPES.values()] + [v.kind for v in VARIANTS]
    kinds = {k.strip() for text in kind_texts for k in text.split("|") if k.strip()}
    units = {r.unit for r in TYPES.values()} | {r.prep for r in TYPES.values()} | {v.unit for v in VARIANTS}
    return {
        "fuel.cpu.quant": {"gguf_dequant"},  # its per-type decoders by module: one import line for any number
        "fuel.cpu.quant.gguf_dequant": {"dequant_rows", "dequant_tiles"},
        "fuel.cpu.quant.gguf_gemv": kinds | {"bpair", "kpair", "one_row", "one_row_permuted"},
        "fuel.cpu.quant.gguf_many": {name for many in MANY.values() for name in many}
        | {"many_rows", "many_rows_permuted", "many_rows_words"},
        "fuel.cpu.quant.gguf_types": {"GGUFKernels"},
        "fuel.cpu.quant.gguf_units": units | {v.order for v in VARIANTS if v.order} | {"kpair_q4k_table"},
        "fuel.cpu.quant.gguf_words": {v.layout for v in VARIANTS if v.layout}
        | {v.pair for v in VARIANTS if v.layout} | {"one_row_words"},
        "fuel.cpu.quant.nibble_tables": {v.host for v in VARIANTS if v.host},
        "fuel.quant": {"QuantType"},
        "fuel.runtime.pool": {"task"},
    }


def _import(module: str, names: set[str]) -> str:
    """`from module import names` as ruff formats it: one line where it fits, else one name a line."""
    ordered = sorted(names, key=_import_order)
    line = f"from {module} import {', '.join(ordered)}"
    if len(line) <= 120:
        return line + "\n"
    return f"from {module} import (\n" + "".join(f"    {n},\n" for n in ordered) + ")\n"


def render() -> str:
    """The text of `gguf_kernels`."""
    text = _HEAD.format(imports="".join(_import(module, names) for module, names in _imports().items()))
    for qt, row in TYPES.items():
        quad, sup, how = MANY[row.pair]
        fields = dict(t=_lower(qt), blk=qt.block_elements, bpb=qt.block_bytes, unit=row.unit, prep=row.prep,
                      kind=row.kind, pair=row.pair, quad=quad, sup=sup, how=how)
        text += _TASKS.format(**fields)
        for v in VARIANTS:
            if v.qt == qt:
                template = _TABLE_TASK if v.order else _WORDS_TASK
                quad, sup, how = MANY[v.pair]
                text += template.format(**{**fields, "name": v.name, "unit": v.unit, "pair": v.pair,
                                           "layout": v.layout, "order": v.order, "quad": quad, "sup": sup, "how": how,
                                           "kind": v.kind or row.kind})
    text += "\n\nGGUF: dict[QuantType, GGUFKernels] = {\n"
    for qt in TYPES:
        t = _lower(qt)
        words = next((f"({', '.join(v.tasks())})" for v in VARIANTS if v.qt == qt and v.layout), "None")
        last = f"        {_table_entry(qt)}, {words}),"  # the host-dependent fields, on one line where they fit
        text += (f"    QuantType.{qt.name}: GGUFKernels(gguf_dequant.dequant_{t}, _{t}_rows, _{t}_one, _{t}_many, "
                 f"_{t}_tiles,\n" + (last if len(last) <= 120 else f"        {_table_entry(qt)},\n        {words}),")
                 + "\n")
    return _wrapped(text + "}\n")


def main() -> None:
    TARGET.write_text(render())


if __name__ == "__main__":
    main()
