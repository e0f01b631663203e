"""What the model code reads of a model: llama.cpp's GGUF form, whatever the files are.

A GGUF file (`fuel.io.gguf.GGUFFile`) is that form; a Hugging Face directory (`fuel.io.hf.HFModelDir`) is
presented in it. Both are a `ModelSource`: metadata under llama.cpp's keys (`<arch>.block_count`, ...) and
tensors under GGUF names (`blk.0.attn_q.weight`, ...), so one model class reads either.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

from fuel.io.gguf_format import GGUFKeyError

T = TypeVar("T")


class ModelSource(Generic[T]):
    """Metadata and tensors by GGUF names (module doc). A source sets `path`, `metadata` and `tensors`, and
    says its `architecture`."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, T]

    @property
    def architecture(self) -> str:
        """`general.architecture` ("llama", "qwen2", "mamba", ...)."""
        raise NotImplementedError

    def hparam(self, key: str, default: Any = ...) -> Any:
        """An architecture hyper-parameter: `hparam("block_count")` reads `<arch>.block_count`; a missing key
        without a default is a GGUFKeyError naming it and the source."""
        full = f"{self.architecture}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if default is not ...:
            return default
        raise GGUFKeyError(f"{self.path}: metadata has no {full!r}")

    def names(self) -> list[str]:
        """Tensor names in the source's order."""
        return list(self.tensors)

    def __getitem__(self, name: str) -> T:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFKeyError(f"{self.path}: no tensor {name!r} among its {len(self.tensors)} tensors") from None

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[T]:
        return iter(self.tensors.values())

    def __len__(self) -> int:
        return len(self.tensors)
