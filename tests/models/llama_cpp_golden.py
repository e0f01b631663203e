"""llama.cpp's answers for the tokenizer tests, recorded: llama.cpp (llama-cpp-python) is built only by `make
bench-env` (it compiles from source), so the tests read its answers from `data/llama_cpp_tokens.json`, which
this module writes:

    python -m tests.models.llama_cpp_golden        # needs llama-cpp-python (make bench-env)

Each case records the digest of the vocabulary it was made on (`tokenizer_files.vocabulary_hash`); a test first
checks that the file it wrote has that digest, so a recording can never be compared with another vocabulary.
The texts are the fixed ones plus a seeded sample of random ones, recorded with the ids.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from fuel.io.gguf import bundled_gguf, open_gguf
from tests.models.tokenizer_files import (
    LLAMA3_SPECIALS,
    PRE_ALPHABET,
    PRE_CASES,
    PRE_TEXTS,
    SPM_PIECES,
    SPM_TEXTS,
    vocabulary_hash,
    write_spm_gguf,
    write_tokenizer_gguf,
)

GOLDEN = Path(__file__).parent / "data" / "llama_cpp_tokens.json"
RANDOM_TEXTS = 150
WHOLE_WORD_TEXT = "a quuxzz b quuxzzy"


def random_texts(alphabet: list[str], count: int, seed: int, most: int) -> list[str]:
    """`count` texts of 0 … `most` symbols of `alphabet`, drawn with a fixed seed."""
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(alphabet, size=int(rng.integers(0, most + 1)))) for _ in range(count)]


def pre_texts() -> list[str]:
    return [*PRE_TEXTS, *random_texts(PRE_ALPHABET, RANDOM_TEXTS, 45, 40)]


def spm_texts() -> list[str]:
    return [*SPM_TEXTS, *random_texts(SPM_PIECES, RANDOM_TEXTS, 46, 12)]


def eog_file(path: Path) -> Path:
    """A Llama-3-style file (eos <|eot_id|>) over SmolLM2's vocabulary plus Llama-3's special tokens."""
    n = len(open_gguf(bundled_gguf("smollm2")).metadata["tokenizer.ggml.tokens"])
    write_tokenizer_gguf(path, "llama", "llama-bpe", extra=tuple(LLAMA3_SPECIALS), extra_type=3,
                         eos=n + LLAMA3_SPECIALS.index("<|eot_id|>"))
    return path


def load() -> dict[str, Any]:
    """The recorded answers (a missing file is an error that says how to record it)."""
    if not GOLDEN.is_file():
        raise FileNotFoundError(f"{GOLDEN} is missing: record it with `python -m tests.models.llama_cpp_golden`")
    found: dict[str, Any] = json.loads(GOLDEN.read_text())
    return found


def record() -> dict[str, Any]:  # pragma: no cover - run by hand where llama-cpp-python is installed
    import llama_cpp

    def tokenize(cpp: Any, text: str, bos: bool = False) -> list[int]:
        return [int(t) for t in cpp.tokenize(text.encode("utf-8"), add_bos=bos, special=True)]

    out: dict[str, Any] = {"pre": {}, "whole_word": {}, "spm": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for case, (arch, pre) in sorted(PRE_CASES.items()):
            path = root / f"{case}.gguf"
            write_tokenizer_gguf(path, arch, pre)
            cpp = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
            texts = pre_texts()
            out["pre"][case] = {
                "vocabulary": vocabulary_hash(path), "texts": texts, "ids": [tokenize(cpp, t) for t in texts],
                "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(cpp.model))),
                "hi_with_bos": tokenize(cpp, "Hi", bos=True)}
            word = root / f"{case}-word.gguf"
            write_tokenizer_gguf(word, arch, pre, extra=("Ġquuxzz",))
            wcpp = llama_cpp.Llama(str(word), vocab_only=True, verbose=False)
            out["whole_word"][case] = {"vocabulary": vocabulary_hash(word), "ids": tokenize(wcpp, WHOLE_WORD_TEXT)}
        path = eog_file(root / "eog.gguf")
        cpp = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(cpp.model)
        # llama.cpp also stops at fill-in-the-middle separators (SmolLM2's <reponame>, <file_sep>); chat does not
        fim = {f(vocab) for f in (llama_cpp.llama_vocab_fim_pad, llama_cpp.llama_vocab_fim_rep,
                                  llama_cpp.llama_vocab_fim_sep)}
        n = llama_cpp.llama_vocab_n_tokens(vocab)
        out["eog"] = {"vocabulary": vocabulary_hash(path),
                      "ids": sorted(i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i) and i not in fim)}
        for arch in ("llama", "phi3"):
            path = root / f"spm-{arch}.gguf"
            write_spm_gguf(path, arch)
            cpp = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
            texts = spm_texts()
            out["spm"][arch] = {"vocabulary": vocabulary_hash(path), "texts": texts,
                                "ids": [tokenize(cpp, t) for t in texts],
                                "ids_with_bos": [tokenize(cpp, t, bos=True) for t in texts]}
    return out


if __name__ == "__main__":  # pragma: no cover
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(record(), ensure_ascii=False, indent=1) + "\n")
    sys.stdout.write(f"wrote {GOLDEN}\n")
