"""An elementwise chain as one task: the steps of a group (`fuel.runtime.fusion`) applied in order to each
tile of elements, so each operand is read and each kept value written once per element.

The elements are seen as `[rows, cols]` (the shape split before one axis, the same for every operand), and
the work items are fixed tiles of `tile_rows` rows by `tile_cols` columns (`TILE_VALUES` values; 32
columns where an operand's columns are strided, so a transposed operand's cache lines serve a tile's rows).
The program is a list of instructions over registers, each a tile of values in scratch of the part's own
(L1-resident):
- LOAD r, k: operand k's values at the tile's elements into r (operand k: an address with a row and a
  column stride in elements, each >= 0: a whole array, a transposed one, a broadcast row, column or value);
- STORE r, k: r into operand k at the tile's elements;
- an op: r <- a op b (ADD, SUB, MUL, DIV) or r <- op a (NEG, ABS, SQR, SQRT, RECIP, RSQRT).
Every op is the one IEEE operation (two for RSQRT: 1 / sqrt) NumPy's kernel of the primitive performs on
the element, in the element's dtype (f32 or f64), with no contraction or reassociation, so the chain
writes the bytes the separate primitives write (`prims.py`; the scalar of ADD_SCALAR and MUL_SCALAR
rounded to the dtype first, as NumPy takes it). The one exception is not a value: where both operands of
an op are NaNs, which one's payload the result carries is unspecified (NumPy's own loops differ there
between their vector body and their tail). A part's tiles are a fixed share of the list, and elements are
independent, so the bytes never depend on the part count or on which part computes an element.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import numpy as np
from numba import carray, njit

from fuel.graph.node import Op, OpSpec
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, Job, job, record_at

LOAD, STORE, ADD, SUB, MUL, DIV, NEG, ABS, SQR, SQRT, RECIP, RSQRT = range(12)
COPY = -1  # an assign: its value is its operand, stored into the target
BINARY = {Op.ADD: ADD, Op.SUB: SUB, Op.MUL: MUL, Op.DIV: DIV}
SCALAR = {Op.ADD_SCALAR: ADD, Op.MUL_SCALAR: MUL}
UNARY = {Op.NEG: NEG, Op.ABS: ABS, Op.SQR: SQR, Op.SQRT: SQRT, Op.RECIP: RECIP, Op.RSQRT: RSQRT}
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
TILE_VALUES = 1024  # values a register holds: a work item's tile of rows by columns, L1-resident
STRIDED_TILE_COLS = 32  # a tile's columns where an operand's columns are strided (a transposed read)
SECONDS_PER_VALUE = 0.4e-9  # one core, an operand's value streamed from memory (loads and stores)
SECONDS_PER_OP = 0.1e-9  # one core, one op on a value in L1

# code: int64 [n_code, 4] (op, register, a, b); operands: int64 [n_operands, 3] (address, row and column
# strides in elements); tiles of tile_rows x tile_cols over [rows, cols]
CHAIN_ARGS = jobs.record(code=ADDRESS, n_code=INT, operands=ADDRESS, n_operands=INT, n_regs=INT, rows=INT,
                         cols=INT, tile_rows=INT, tile_cols=INT, itemsize=INT)


class Form(NamedTuple):
    """A step as a chain sees it: `code` applied to `operands` (the step's input positions, or a scalar
    array of one value), its result written into `dest` (the step's output, or an assign's target)."""

    code: int
    operands: tuple[int | np.ndarray, ...]
    dest: np.ndarray


class Instr(NamedTuple):
    """A chain instruction over values (the index of the instruction that defines one): LOAD `array`, an
    op of values a (and b), or STORE value a into `array`."""

    code: int
    a: int = -1
    b: int = -1
    array: np.ndarray | None = None


def form(spec: OpSpec, arg: Any, xs: list[np.ndarray], out: np.ndarray) -> Form | None:
    """The step as a chain member, or None where a chain does not compute it: another op or dtype, an
    operand not of the output's shape (so a cache write is a whole assign)."""
    op = spec.op
    if op not in BINARY and op not in SCALAR and op not in UNARY and op is not Op.CACHE_WRITE:
        return None
    dt = out.dtype
    if dt not in DTYPES or spec.dtype.np != dt or any(x.dtype != dt or x.shape != spec.shape for x in xs):
        return None
    if op in BINARY:
        return Form(BINARY[op], (0, 1), out)
    if op in SCALAR:
        return Form(SCALAR[op], (0, np.full((1,) * out.ndim, arg, dt)), out)  # kept by the job
    if op in UNARY:
        return Form(UNARY[op], (0,), out)
    if isinstance(arg.offset, int) and arg.offset == 0 and out is xs[0] and xs[0].flags.writeable:
        return Form(COPY, (1,), out)
    return None


def plane(x: np.ndarray, shape: tuple[int, ...], t: int) -> tuple[int, int] | None:
    """x broadcast to `shape`, read as [rows, cols] split before axis t: its (row, column) strides in
    elements where each side steps with one stride >= 0, else None."""
    st = np.broadcast_to(x, shape).strides
    out = []
    for dims in (range(t), range(t, len(shape))):
        live = [d for d in dims if shape[d] != 1]
        step = st[live[-1]] if live else 0
        for d, inner in itertools.pairwise(live):
            if st[d] != st[inner] * shape[inner]:
                return None
        if step < 0 or step % x.itemsize:
            return None
        out.append(step // x.itemsize)
    return out[0], out[1]


def splits(x: np.ndarray, shape: tuple[int, ...]) -> frozenset[int]:
    """The axes t before which x (broadcast to `shape`) splits as [rows, cols] (`plane`)."""
    return frozenset(t for t in range(len(shape) + 1) if plane(x, shape, t) is not None)


def chain_job(shape: tuple[int, ...], program: list[Instr]) -> Job | None:
    """The job running `program` over every element of `shape`, or None where no split of the shape reads
    every operand as [rows, cols] with non-negative strides (or the shape is empty)."""
    arrays = [i.array for i in program if i.array is not None]
    if not arrays or math.prod(shape) == 0:
        return None
    dt = arrays[0].dtype
    common = frozenset.intersection(*(splits(a, shape) for a in arrays))
    if not common:
        return None
    t = min(common)
    planes = [plane(a, shape, t) or (0, 0) for a in arrays]
    rows, cols = math.prod(shape[:t]), math.prod(shape[t:])
    strided = any(p[1] not in (0, 1) for p in planes)  # a transposed read: narrow tiles keep its lines in L1
    tile_cols = min(cols, STRIDED_TILE_COLS if strided else TILE_VALUES)
    tile_rows = min(rows, max(1, TILE_VALUES // tile_cols))
    items = -(-rows // tile_rows) * -(-cols // tile_cols)
    code, n_regs = _allocate(program)
    operands = np.array([(a.ctypes.data, *p) for a, p in zip(arrays, planes, strict=True)], np.int64)
    argv = jobs.argv_of(CHAIN_ARGS)
    argv[0] = (code.ctypes.data, len(code), operands.ctypes.data, len(operands), n_regs, rows, cols, tile_rows,
               tile_cols, dt.itemsize)
    ops = sum(i.code not in (LOAD, STORE) for i in program)
    seconds = rows * cols * (len(arrays) * SECONDS_PER_VALUE + ops * SECONDS_PER_OP)
    scalars = tuple(a for a in arrays if a.size == 1)  # one-value operands a chain may own
    return job(_TASKS[dt], argv, seconds, items, keep=(code, operands, *scalars))


def _allocate(program: list[Instr]) -> tuple[np.ndarray, int]:
    """The program encoded over registers: (int64 [n, 4] code, register count). A value's register is
    taken when it is defined (never one its own operands hold, so an op's loops never alias) and given
    back after its last use."""
    last = {}
    for k, ins in enumerate(program):
        for v in (ins.a, ins.b):
            if v >= 0:
                last[v] = k
    reg: dict[int, int] = {}
    free: list[int] = []
    n_regs = 0
    code = np.zeros((len(program), 4), np.int64)
    operand = 0
    for k, ins in enumerate(program):
        src = [reg[v] if v >= 0 else 0 for v in (ins.a, ins.b)]
        if ins.code == STORE:
            code[k] = STORE, src[0], operand, 0
            operand += 1
        else:
            if not free:
                free.append(n_regs)
                n_regs += 1
            reg[k] = r = free.pop()
            code[k] = (LOAD, r, operand, 0) if ins.code == LOAD else (ins.code, r, src[0], src[1])
            operand += ins.code == LOAD
            if k not in last:
                free.append(r)
        for v in {ins.a, ins.b} - {-1}:
            if last[v] == k:
                free.append(reg[v])
    return code, n_regs


@njit(inline="always", cache=True)
def _load(dst: Any, address: int, rs: int, cs: int, nr: int, nc: int, dt: Any) -> None:
    for i in range(nr):
        at = address + i * rs
        row = dst[i * nc:(i + 1) * nc]
        if cs == 1:
            src = carray(pointer(at, dt), (nc,))
            for c in range(nc):
                row[c] = src[c]
        elif cs == 0:
            x = carray(pointer(at, dt), (1,))[0]
            for c in range(nc):
                row[c] = x
        else:
            src = carray(pointer(at, dt), ((nc - 1) * cs + 1,))
            for c in range(nc):
                row[c] = src[c * cs]


@njit(inline="always", cache=True)
def _store(src: Any, address: int, rs: int, cs: int, nr: int, nc: int, dt: Any) -> None:
    for i in range(nr):
        at = address + i * rs
        row = src[i * nc:(i + 1) * nc]
        if cs == 1:
            dst = carray(pointer(at, dt), (nc,))
            for c in range(nc):
                dst[c] = row[c]
        else:
            dst = carray(pointer(at, dt), ((nc - 1) * cs + 1,))
            for c in range(nc):
                dst[c * cs] = row[c]


@njit(inline="always", cache=True)
def _apply(op: int, d: Any, a: Any, b: Any, n: int, one: Any) -> None:
    if op == ADD:
        for i in range(n):
            d[i] = a[i] + b[i]
    elif op == SUB:
        for i in range(n):
            d[i] = a[i] - b[i]
    elif op == MUL:
        for i in range(n):
            d[i] = a[i] * b[i]
    elif op == DIV:
        for i in range(n):
            d[i] = a[i] / b[i]
    elif op == NEG:
        for i in range(n):
            d[i] = -a[i]
    elif op == ABS:
        for i in range(n):
            d[i] = abs(a[i])
    elif op == SQR:
        for i in range(n):
            d[i] = a[i] * a[i]
    elif op == SQRT:
        for i in range(n):
            d[i] = np.sqrt(a[i])
    elif op == RECIP:
        for i in range(n):
            d[i] = one / a[i]
    else:
        for i in range(n):
            d[i] = one / np.sqrt(a[i])


@njit(inline="always", cache=True)
def _chain_part(part: int, parts: int, argv: int, dt: Any) -> None:
    v = record_at(argv, CHAIN_ARGS)
    code = carray(pointer(v.code, np.int64), (v.n_code, 4))
    opnd = carray(pointer(v.operands, np.int64), (v.n_operands, 3))
    rows, cols, tr, tc, size = v.rows, v.cols, v.tile_rows, v.tile_cols, v.itemsize
    regs = np.empty((v.n_regs, tr * tc), dt)
    one = dt(1.0)
    blocks = (cols + tc - 1) // tc
    items = (rows + tr - 1) // tr * blocks
    for it in range(part * items // parts, (part + 1) * items // parts):
        r0 = it // blocks * tr
        c0 = (it % blocks) * tc
        nr, nc = min(tr, rows - r0), min(tc, cols - c0)
        for k in range(v.n_code):
            op, d, a, b = code[k, 0], code[k, 1], code[k, 2], code[k, 3]
            if op in (LOAD, STORE):
                rs, cs = opnd[a, 1], opnd[a, 2]
                at = opnd[a, 0] + size * (r0 * rs + c0 * cs)
                if op == LOAD:
                    _load(regs[d], at, size * rs, cs, nr, nc, dt)
                else:
                    _store(regs[d], at, size * rs, cs, nr, nc, dt)
            else:
                _apply(op, regs[d], regs[a], regs[b], nr * nc, one)


@pool.task(error_model="numpy")
def _chain_f32(part: int, parts: int, argv: int) -> None:
    _chain_part(part, parts, argv, np.float32)


@pool.task(error_model="numpy")
def _chain_f64(part: int, parts: int, argv: int) -> None:
    _chain_part(part, parts, argv, np.float64)


_TASKS = {DTYPES[0]: _chain_f32, DTYPES[1]: _chain_f64}
