"""Training data for `fuel train`: a corpus, a tokenizer, a train/val split and seeded batches.

**The built-in corpus** (`pydoc-topics`) is the text of the Python Language Reference topics that every
CPython installation ships as `pydoc_data/topics.py` (what `help("assert")` prints): real English prose with
code, about 465,000 characters, present wherever Python is, so training needs no download. Its text changes
with Python's minor version, so a target loss is stated for one (docs/performance/train.md).

**Tokenizers.** `byte`: each UTF-8 byte is a token (ids 0-255), `<|endoftext|>` is 256, for character
models; 257 is the product of the one merge a GGUF byte-level vocabulary must hold (of two 0xFF bytes, which
UTF-8 text never has), so it never occurs in data; `smollm2`: the bundled SmolLM2 GGUF's byte-level BPE
(`fuel.models.tokenizer`), vocabulary 49,152.

**Batches** are nanoGPT's `get_batch`: B windows of T + 1 tokens at offsets drawn uniformly from
[0, len - T), inputs the first T, targets the last T. The offsets come from a NumPy PCG64 generator whose
state is saved in checkpoints, so a resumed run draws the batches the uninterrupted run would have.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fuel.errors import FuelError, ParamError

BUILTIN_CORPORA = ("pydoc-topics",)
TOKENIZERS = ("byte", "smollm2")
BYTE_VOCAB = 258
BYTE_EOS = 256


class DataError(FuelError, ValueError):
    """A corpus that cannot be read or is too small for the requested windows."""


def builtin_text(name: str) -> str:
    """The text of a built-in corpus (module doc)."""
    if name != "pydoc-topics":
        raise DataError(f"train: unknown built-in corpus {name!r}; built-in: {', '.join(BUILTIN_CORPORA)}")
    spec = importlib.util.find_spec("pydoc_data.topics")
    if spec is None:
        raise DataError("train: this Python has no pydoc_data.topics (the built-in corpus 'pydoc-topics')")
    from pydoc_data.topics import topics

    # sorted by topic name: the order (and so the split) does not depend on the dict's construction
    return "\n\n".join(topics[k] for k in sorted(topics))


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, `<|endoftext|>` = 256 (the end-of-text id a GGUF file needs), and the
    never-occurring merge product 257 (module doc)."""

    vocab_size = BYTE_VOCAB
    eos_id = BYTE_EOS
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        bad = [int(i) for i in ids if not 0 <= int(i) < BYTE_VOCAB]
        if bad:
            raise DataError(f"byte tokenizer: ids {bad[:5]} are outside the vocabulary of {BYTE_VOCAB} tokens")
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class Smollm2Tokenizer:
    """The bundled SmolLM2 GGUF's tokenizer (`fuel.models.tokenizer.GGUFTokenizer`), without BOS."""

    name = "smollm2"

    def __init__(self) -> None:
        from fuel.io.bundled import bundled_gguf
        from fuel.models.tokenizer import GGUFTokenizer

        self.path = bundled_gguf("smollm2")
        self.tok = GGUFTokenizer.from_gguf(self.path)
        self.vocab_size = self.tok.vocab_size
        self.eos_id = self.tok.eos_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_bos=False)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids)


def tokenizer(name: str) -> ByteTokenizer | Smollm2Tokenizer:
    if name == "byte":
        return ByteTokenizer()
    if name == "smollm2":
        return Smollm2Tokenizer()
    raise ParamError(f"train: unknown tokenizer {name!r}; expected one of {', '.join(TOKENIZERS)}")


def load_tokens(source: str, tok: ByteTokenizer | Smollm2Tokenizer) -> np.ndarray:
    """The corpus `source` as token ids (int64, 1-D): a built-in corpus's name, a text file (UTF-8), or a
    tokenized corpus (`.npy`: a 1-D integer array of ids below the tokenizer's vocabulary)."""
    if source in BUILTIN_CORPORA:
        return tok.encode_array(builtin_text(source))
    path = Path(source)
    if not path.is_file():
        raise DataError(f"train: data {source!r} is neither a built-in corpus ({', '.join(BUILTIN_CORPORA)}) "
                        "nor a file")
    if path.suffix == ".npy":
        try:
            ids = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"train: {source}: not a readable .npy array ({e})") from None
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise DataError(f"train: {source}: a tokenized corpus is a 1-D integer array, got {ids.ndim}-D {ids.dtype}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tok.vocab_size):
            raise DataError(f"train: {source}: ids span [{int(ids.min())}, {int(ids.max())}], outside the "
                            f"{tok.name} tokenizer's vocabulary [0, {tok.vocab_size})")
        return ids.astype(np.int64)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"train: {source}: cannot read it as UTF-8 text ({e})") from None
    return tok.encode_array(text)


def split(ids: np.ndarray, val_fraction: float, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The first (1 - val_fraction) of the ids for training, the rest held out (nanoGPT's split); each part
    must hold more than `block` tokens (one window and its shifted target)."""
    n_val = round(len(ids) * val_fraction)
    train, val = ids[:len(ids) - n_val], ids[len(ids) - n_val:]
    for what, part in (("training", train), ("validation", val)):
        if len(part) <= block:
            raise DataError(f"train: the {what} split has {len(part)} tokens, fewer than block_size + 1 = "
                            f"{block + 1}; use more data, a smaller block_size or another val_fraction")
    return train, val


class Batches:
    """Seeded B x T windows of `data` (module doc); `state()`/`set_state()` for checkpoints."""

    def __init__(self, data: np.ndarray, batch: int, block: int, seed: int) -> None:
        self.data, self.batch, self.block = data, batch, block
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        ix = self.rng.integers(0, len(self.data) - self.block, size=self.batch)
        rows = np.stack([self.data[i:i + self.block + 1] for i in ix])
        return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])

    def state(self) -> dict[str, Any]:
        return dict(self.rng.bit_generator.state)

    def set_state(self, state: dict[str, Any]) -> None:
        try:
            self.rng.bit_generator.state = state
        except (TypeError, ValueError, KeyError) as e:
            raise DataError(f"train: the checkpoint's data-sampler state is not a PCG64 state ({e})") from None
