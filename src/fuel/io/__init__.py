"""Reading model files: GGUF (`fuel.io.gguf`), and Hugging Face directories seen as the GGUF file of the same
model (`fuel.io.hf`: `open_source` takes either)."""

from fuel.io.gguf import (
    GGUFError,
    GGUFFile,
    GGUFNotFound,
    GGUFTensor,
    MissingDependency,
    UnsupportedTensorType,
    bundled_gguf,
    open_gguf,
)
from fuel.io.hf import HFError, HFModelDir, open_source
from fuel.io.source import ModelSource

__all__ = [
    "GGUFError",
    "GGUFFile",
    "GGUFNotFound",
    "GGUFTensor",
    "HFError",
    "HFModelDir",
    "MissingDependency",
    "ModelSource",
    "UnsupportedTensorType",
    "bundled_gguf",
    "open_gguf",
    "open_source",
]
