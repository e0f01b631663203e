"""The fused-op registry: ids, the entry type, and the default registry built from entry modules."""

from __future__ import annotations

import enum
import functools
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType

from fuel.dtype import DType
from fuel.errors import FuelError, ParamError, ShapeError
from fuel.graph.node import Node, Op, Shape

if TYPE_CHECKING:
    from fuel.graph.tensor import Tensor

FusedOpId = NewType("FusedOpId", int)
UNASSIGNED = FusedOpId(0)


class FusedOps:
    """The inventory's ids, exactly."""

    SOFTMAX_LAST_DIM = FusedOpId(1)
    FUSED_LINEAR = FusedOpId(2)
    RMS_NORM_LAST_DIM = FusedOpId(3)
    LAYER_NORM_LAST_DIM = FusedOpId(4)
    ROPE = FusedOpId(5)
    CONV2D = FusedOpId(6)
    SOFTMAX_LAST_DIM_BACKWARD = FusedOpId(7)
    LAYER_NORM_LAST_DIM_BACKWARD = FusedOpId(8)
    RMS_NORM_LAST_DIM_BACKWARD = FusedOpId(9)
    REDUCE_MAX_TO_BACKWARD = FusedOpId(10)
    CONV_TRANSPOSE2D = FusedOpId(11)
    FLASH_ATTN = FusedOpId(12)
    PAGED_ATTN = FusedOpId(13)
    QMATMUL = FusedOpId(14)
    POWI_BACKWARD = FusedOpId(15)
    INPLACE_AFFINE = FusedOpId(16)
    FUSED_SOFTMAX_CROSS_ENTROPY = FusedOpId(17)
    CAUSAL_CONV1D = FusedOpId(18)
    SELECTIVE_SCAN = FusedOpId(19)
    SSD_CHUNK_SCAN = FusedOpId(20)
    NF4_MATMUL = FusedOpId(21)
    FLASH_ATTN_BACKWARD_Q = FusedOpId(22)
    FLASH_ATTN_BACKWARD_K = FusedOpId(23)
    FLASH_ATTN_BACKWARD_V = FusedOpId(24)

    NAMES: Mapping[int, str] = {
        1: "SoftmaxLastDim", 2: "FusedLinear", 3: "RmsNormLastDim", 4: "LayerNormLastDim",
        5: "Rope", 6: "Conv2D", 7: "SoftmaxLastDimBackward", 8: "LayerNormLastDimBackward",
        9: "RmsNormLastDimBackward", 10: "ReduceMaxToBackward", 11: "ConvTranspose2D",
        12: "FlashAttn", 13: "PagedAttn", 14: "QMatMul", 15: "PowIBackward", 16: "InplaceAffine",
        17: "FusedSoftmaxCrossEntropy", 18: "CausalConv1d", 19: "SelectiveScan",
        20: "SsdChunkScan", 21: "Nf4Matmul", 22: "FlashAttnBackwardQ", 23: "FlashAttnBackwardK",
        24: "FlashAttnBackwardV",
    }


class FusedOpFamily(enum.Enum):
    FORWARD = "Forward"
    BACKWARD = "Backward"
    QUANTIZED = "Quantized"
    ATTENTION = "Attention"
    NORM = "Norm"


@dataclass(frozen=True)
class BackwardKind:
    """Inventory metadata: `Fused(id)`, `Decompose` or `NotDifferentiable`."""

    kind: str
    target: FusedOpId | None = None

    @staticmethod
    def fused(target: FusedOpId) -> BackwardKind:
        return BackwardKind("Fused", target)

    def __str__(self) -> str:
        if self.target is not None:
            return f"Fused({FusedOps.NAMES[self.target]})"
        return self.kind


DECOMPOSE = BackwardKind("Decompose")
NOT_DIFFERENTIABLE = BackwardKind("NotDifferentiable")


@dataclass(frozen=True)
class Match:
    """A pattern's answer: the fused node's inputs (in order) and its params."""

    inputs: tuple[Node, ...]
    params: Any


ShapeRule = Callable[[tuple[Shape, ...], Any], Shape]
DTypeRule = Callable[[tuple[DType, ...], Any], DType]
# A multi-output entry's decompose returns one Tensor per slot, and its vjp takes them (and one
# cotangent per slot) as tuples.
Decompose = Callable[[list["Tensor"], Any], "Tensor | tuple[Tensor, ...]"]
Pattern = Callable[[Node, Mapping[Node, int]], Match | None]
Vjp = Callable[[list["Tensor"], Any, Any, Any], list["Tensor | None"]]
OutputViews = Callable[[tuple[Shape, ...], tuple[DType, ...], Any], list[tuple[Shape, DType]]]


@dataclass(frozen=True)
class FusedOpEntry:
    """Everything the graph side knows about one fused op. No field has a default but `no_pattern`:
    an entry without a live `pattern` states why in it (the inventory reports it, and a test holds every
    entry to having one or the other)."""

    id: FusedOpId
    name: str
    family: FusedOpFamily
    params: type
    arity: tuple[int, ...]
    shape_rule: ShapeRule
    dtype_rule: DTypeRule
    decompose: Decompose | None
    backward: BackwardKind
    vjp: Vjp | None
    pattern: Pattern | None
    output_views: OutputViews | None
    destructive_input: int | None
    no_pattern: str | None = None


class RegistryError(FuelError):
    """The registry's entries contradict each other or the inventory."""


class FusedOpRegistry:
    """Entries by id and by name, iterated in id order."""

    def __init__(self, entries: Sequence[FusedOpEntry]) -> None:
        self._by_id: dict[int, FusedOpEntry] = {}
        self._by_name: dict[str, FusedOpEntry] = {}
        for e in entries:
            if e.id == UNASSIGNED or e.id not in FusedOps.NAMES:
                raise RegistryError(f"registry: entry {e.name!r} has id {e.id}, which is not an inventory id")
            if FusedOps.NAMES[e.id] != e.name:
                raise RegistryError(f"registry: id {e.id} is {FusedOps.NAMES[e.id]!r}, entry says {e.name!r}")
            if e.id in self._by_id:
                raise RegistryError(f"registry: id {e.id} registered twice")
            if e.name in self._by_name:
                raise RegistryError(f"registry: name {e.name!r} registered twice")
            self._by_id[e.id] = e
            self._by_name[e.name] = e

    def entry(self, op_id: int) -> FusedOpEntry:
        try:
            return self._by_id[op_id]
        except KeyError:
            name = FusedOps.NAMES.get(op_id, "unknown")
            raise RegistryError(f"registry: id {op_id} ({name}) has no entry") from None

    def get(self, op_id: int) -> FusedOpEntry | None:
        return self._by_id.get(op_id)

    def by_name(self, name: str) -> FusedOpEntry:
        try:
            return self._by_name[name]
        except KeyError:
            raise RegistryError(f"registry: no entry named {name!r}") from None

    def __iter__(self) -> Iterator[FusedOpEntry]:
        return iter(sorted(self._by_id.values(), key=lambda e: e.id))

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, op_id: object) -> bool:
        return op_id in self._by_id


# The one hand-kept list of a new fused op: its kernel and reference modules are discovered
# (fuel.dispatch.discovery, fuel.testing.reference), and tests/test_registry.py fails on an entry
# module missing here.
ENTRY_MODULES: tuple[str, ...] = (
    "softmax_last_dim",
    "softmax_last_dim_backward",
    "fused_linear",
    "rope",
    "rms_norm_last_dim",
    "layer_norm_last_dim",
    "layer_norm_last_dim_backward",
    "rms_norm_last_dim_backward",
    "reduce_max_to_backward",
    "powi_backward",
    "inplace_affine",
    "paged_attn",
    "flash_attn",
    "flash_attn_backward_q",
    "flash_attn_backward_k",
    "flash_attn_backward_v",
    "qmatmul",
    "nf4_matmul",
    "conv2d",
    "conv_transpose2d",
    "causal_conv1d",
    "selective_scan",
    "ssd_chunk_scan",
    "fused_softmax_cross_entropy",
)


@functools.cache
def default_registry() -> FusedOpRegistry:
    """The registry of every entry module in ENTRY_MODULES, built once."""
    entries = [importlib.import_module(f"{__name__}.{m}").ENTRY for m in ENTRY_MODULES]
    return FusedOpRegistry(entries)


def fused_node(op_id: FusedOpId, inputs: Sequence[Node], params: Any) -> Node:
    """Build a FUSED node, running the entry's arity, params, shape and dtype checks."""
    entry = default_registry().entry(op_id)
    name = snake_name(entry.name)
    if not isinstance(params, entry.params):
        raise ParamError(f"{name}: params must be {entry.params.__name__}, got {type(params).__name__}")
    if len(inputs) not in entry.arity:
        want = " or ".join(str(a) for a in entry.arity)
        raise ShapeError(f"{name}: takes {want} inputs, got {len(inputs)}")
    shape = entry.shape_rule(tuple(i.shape for i in inputs), params)
    dtype = entry.dtype_rule(tuple(i.dtype for i in inputs), params)
    return Node(Op.FUSED, tuple(inputs), tuple(shape), dtype, (entry.id, params))


def fused_views(op_id: FusedOpId, inputs: Sequence[Node], params: Any) -> tuple[Tensor, ...]:
    """Build a multi-output FUSED node (the entry declares `output_views`) and return one Tensor per
    output slot, each a VIEW of the node: the bundle itself never reaches the user."""
    from fuel.graph.prims import views
    from fuel.graph.tensor import Tensor

    node = fused_node(op_id, inputs, params)
    entry = default_registry().entry(op_id)
    if entry.output_views is None:
        raise RegistryError(f"registry: {entry.name} has a single output; build it with fused_node")
    return tuple(Tensor(v) for v in views(node))


_SNAKE_OVERRIDES = {"QMatMul": "qmatmul", "PowIBackward": "powi_backward"}


@functools.cache
def snake_name(name: str) -> str:
    """'SoftmaxLastDim' -> 'softmax_last_dim' (the builder's name in fuel.ops); cached, as every
    fused node's build names its op in its error messages."""
    if name in _SNAKE_OVERRIDES:
        return _SNAKE_OVERRIDES[name]
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i and (not name[i - 1].isupper() or (i + 1 < len(name) and name[i + 1].islower())):
            out.append("_")
        out.append(ch.lower())
    return "".join(out).replace("2_d", "2d")


def vjp_by_decomposition(decompose: Decompose) -> Vjp:
    """A VJP that differentiates the entry's own primitive decomposition (higher-order gradients).

    The decomposition is built over stand-in leaves so each input is differentiated on its own even
    when one input depends on another; the stand-ins are then replaced by the real inputs.
    """

    def vjp(inputs: list[Tensor], params: Any, out: Tensor, grad_out: Tensor) -> list[Tensor | None]:
        import numpy as np

        from fuel.graph.autograd import grad
        from fuel.graph.tensor import Tensor

        stand_ins = [Tensor(Node(Op.CONST, (), t.shape, t.dtype, None,
                                 np.broadcast_to(np.zeros((), t.dtype.np), t.shape))) for t in inputs]
        lowered = decompose(stand_ins, params)
        assert isinstance(lowered, Tensor), "multi-output entries write their own vjp"
        wrt = [s for s in stand_ins if s.dtype.is_float]
        grads = iter(grad(lowered, wrt, grad_out, fuse=False))
        mapping = {s.node: t.node for s, t in zip(stand_ins, inputs, strict=True)}
        return [Tensor(substitute(next(grads).node, mapping)) if t.dtype.is_float else None for t in inputs]

    return vjp


def substitute(root: Node, mapping: Mapping[Node, Node]) -> Node:
    """`root`'s graph with each node in `mapping` replaced by its image (rebuilt in topological order)."""
    from fuel.graph.node import topo_order

    memo: dict[Node, Node] = {}
    for n in topo_order([root], stop_at_leaves=False):
        if n in mapping:
            memo[n] = mapping[n]
        elif not n.inputs:
            memo[n] = n
        else:
            memo[n] = n.with_inputs(tuple(memo[i] for i in n.inputs))
    return memo[root]
