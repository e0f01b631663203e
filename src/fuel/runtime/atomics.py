"""Atomic int64 operations, a spin-wait hint, a cycle counter and calls through function addresses, for
jitted code (the spinning pool in `fuel.runtime.pool` and its tasks).

Each operation is one LLVM instruction with an explicit memory ordering: loads acquire, stores and
read-modify-writes are sequentially consistent, so a store followed by a load of another word (the
pool's "going to sleep" handshake) is never reordered. Arrays are addressed by element, unchecked.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import binding, ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_I64 = ir.IntType(64)
_X86 = binding.get_process_triple().startswith(("x86_64", "i686", "i386"))
TASK_ARGS = (types.int64, types.int64, types.int64)  # a task's (part, parts, argv address)


def _slot(context: Any, builder: Any, aryty: Any, ary: Any, i: Any) -> Any:
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.gep(data, [i])


@intrinsic
def _load_acquire(typingctx: Any, a: Any, i: Any) -> Any:
    """a[i] (int64 a), an acquire load: later reads see what the storer wrote before its store."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.load_atomic(_slot(context, builder, signature.args[0], args[0], args[1]), "acquire", 8)

    return types.int64(a, i), codegen


@intrinsic
def _store(typingctx: Any, a: Any, i: Any, v: Any) -> Any:
    """a[i] <- v (int64 a), sequentially consistent."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(value, _slot(context, builder, signature.args[0], args[0], args[1]), "seq_cst", 8)
        return context.get_dummy_value()

    return types.void(a, i, v), codegen


@intrinsic
def _fetch_add(typingctx: Any, a: Any, i: Any, v: Any) -> Any:
    """a[i] += v atomically (int64 a); returns the old value."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", _slot(context, builder, signature.args[0], args[0], args[1]), value,
                                  "seq_cst")

    return types.int64(a, i, v), codegen


@intrinsic
def _compare_exchange(typingctx: Any, a: Any, i: Any, old: Any, new: Any) -> Any:
    """a[i] <- new if a[i] == old, atomically (int64 a); whether it was swapped."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = _slot(context, builder, signature.args[0], args[0], args[1])
        old_v = context.cast(builder, args[2], signature.args[2], types.int64)
        new_v = context.cast(builder, args[3], signature.args[3], types.int64)
        pair = builder.cmpxchg(ptr, old_v, new_v, "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)

    return types.boolean(a, i, old, new), codegen


@intrinsic
def _pause(typingctx: Any) -> Any:
    """A spin-wait hint (x86 `pause`: yields the core's pipeline to its sibling, saves power)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _cycles(typingctx: Any) -> Any:
    """The processor's cycle counter (the TSC on x86: constant rate)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I64, []), "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@intrinsic
def _call_task(typingctx: Any, address: Any, part: Any, parts: Any, argv: Any) -> Any:
    """Call the task compiled at `address` (a `void(int64, int64, int64)` C function) with its arguments."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fnty = ir.FunctionType(ir.VoidType(), [_I64, _I64, _I64])
        values = [context.cast(builder, v, t, types.int64) for v, t in zip(args, signature.args, strict=True)]
        builder.call(builder.inttoptr(values[0], fnty.as_pointer()), values[1:])
        return context.get_dummy_value()

    return types.void(address, part, parts, argv), codegen


@intrinsic
def _pointer(typingctx: Any, address: Any, dtype: Any) -> Any:
    """The address as a typed pointer (`dtype`: a Numba number type, e.g. `float32`, or a record dtype)
    for `carray`."""
    ty = dtype.dtype if isinstance(dtype, types.DType) else getattr(dtype, "instance_type", None)
    if ty is None:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        value = context.cast(builder, args[0], signature.args[0], types.int64)
        return builder.inttoptr(value, context.get_data_type(ty).as_pointer())

    return types.CPointer(ty)(address, dtype), codegen


# Typed as Any: Numba fills in the typing context when jitted code calls an intrinsic.
load_acquire: Any = _load_acquire
store: Any = _store
fetch_add: Any = _fetch_add
compare_exchange: Any = _compare_exchange
pause: Any = _pause
cycles: Any = _cycles
call_task: Any = _call_task
pointer: Any = _pointer


@njit(inline="always", cache=True)
def claim_slot(claims: int, slots: int) -> int:
    """A slot of an int64 [slots] claim array (by address) that no one holds, now held: a part's scratch
    slot, when at most `slots` parts run at once (it spins until one is free)."""
    words = carray(pointer(claims, np.int64), (slots,))
    while True:
        for s in range(slots):
            if compare_exchange(words, s, 0, 1):
                return s


@njit(inline="always", cache=True)
def release_slot(claims: int, slots: int, slot: int) -> None:
    store(carray(pointer(claims, np.int64), (slots,)), slot, 0)
