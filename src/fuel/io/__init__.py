"""Reading model files: GGUF (`fuel.io.gguf`)."""

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

__all__ = [
    "GGUFError",
    "GGUFFile",
    "GGUFNotFound",
    "GGUFTensor",
    "MissingDependency",
    "UnsupportedTensorType",
    "bundled_gguf",
    "open_gguf",
]
