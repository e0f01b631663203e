"""The tokenizer files the tokenizer tests write, shared by the tests and by the recorder of llama.cpp's answers
(`tests/models/llama_cpp_golden.py`): SmolLM2's vocabulary and merges under another pre-tokenizer (Qwen2's,
Llama-3's), and a SentencePiece vocabulary trained in-test laid out as Mistral's and Phi-3's files are."""

from __future__ import annotations

import hashlib
from typing import Any

from fuel.io.gguf import bundled_gguf, open_gguf

TEXTS = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.", "  leading spaces", "trailing spaces   ",
    "a  b   c    d", "tabs\tand\t\ttabs  \t x", "line1\nline2\n\n\nline5\r\nwindows\r\n", "end with spaces \n  ",
    "x  1", "a 1  22   333", "3.14159 + 2 = 5.14159; 1234567890", "12,345.67 ²³ ½", "1 2  3   4\n5\n\n6", "x\n 1",
    "emoji 😀👍🏽🇫🇷 family 👨‍👩‍👧", "中文字符 日本語のテキスト 한국어", "café naïve résumé Ångström straße",
    "Ελληνικά русский עברית العربية", "def f(x):\n    return x**2  # comment\n\n\tpass\n", "    indented\n        more",
    "<|im_start|>user\nhi<|im_end|>\n", "<start_of_turn>model\nok<end_of_turn>", "<bos>text<eos>",
    "rare: 𓀀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u200b\ufeff zero-width \x00\x01 ctrl", "<table><tr><td>x</td></tr></table>",
    "I'm don't WE'LL they've", "https://example.com/a?b=c&d=e", "a\u00a0nbsp", "▁already▁marked",
    "<0x41> <unk> [multimodal]", "", " ", "\n",
    "Tokenizers split text into pieces; a model reads their ids. " * 8,
]


# --- Byte-level pre-tokenizers of the new architectures' files (Qwen2/2.5/3: "qwen2"; Llama-3: "llama-bpe") ----
# SmolLM2's vocabulary and merges written into a GGUF with another `tokenizer.ggml.pre`: a realistic vocabulary split
# by another regex.

def vocab_only_writer(path: Any, arch: str) -> Any:
    """A GGUF writer holding the hyperparameters llama.cpp reads before a vocab_only load (no tensors follow)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-6)
    return w


PRE_CASES = {"qwen2": ("qwen2", "qwen2"), "llama-bpe": ("llama", "llama-bpe")}
PRE_TEXTS = [*TEXTS, "12345678 1,234,567 x2024y", "I'M HE'S 'tis o'clock", "a\r\n\r\n  b\n \n", "  \t\n x  ",
             "ﬁ ẞ ǅ 𝟘𝟙 ١٢٣ ½¼", "what's it? don't!", "foo...bar,,,baz!!!", "\u3000全角\u3000スペース"]


def write_tokenizer_gguf(path: Any, arch: str, pre: str, extra: tuple[str, ...] = (), extra_type: int = 1,
                          eos: int = 2) -> None:

    md = open_gguf(bundled_gguf("smollm2")).metadata
    w = vocab_only_writer(path, arch)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([*md["tokenizer.ggml.tokens"], *extra])
    w.add_token_types([int(t) for t in md["tokenizer.ggml.token_type"]] + [extra_type] * len(extra))
    w.add_token_merges(list(md["tokenizer.ggml.merges"]))
    w.add_bos_token_id(1)
    w.add_eos_token_id(eos)  # no add_bos_token: each pre-tokenizer's default applies
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


PRE_ALPHABET = list("aZé中1234567890 '\n\r\t.,!?-_sStTdDmMlLvVeErR😀\u00a0\u3000")


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eom_id|>", "<|eot_id|>"]

# --- SentencePiece `llama` files without Gemma's quirks: Mistral (arch llama) and Phi-3 -----------------------------
# A SentencePiece BPE vocabulary trained in-test with `tokenizers` and laid out as Mistral's and Phi-3's files are:
# <unk> (type 2), <s>, </s>, the 256 <0xNN> byte tokens (type 6), then the pieces scored by merge order, no
# add_space_prefix key (llama.cpp's default: true).

SPM_CORPUS = [t for t in TEXTS if "<" not in t and "\x00" not in t] + [
    "The history of natural language processing generally started in the 1950s, although work can be found from "
    "earlier periods. In 1950, Alan Turing published an article titled Computing Machinery and Intelligence.",
    "Tokenization is the process of splitting text into tokens; subword tokenizers such as byte pair encoding "
    "merge the most frequent pairs of symbols, one merge at a time, until the vocabulary is full.",
    "def tokenize(text):\n    return [piece for piece in text.split() if piece]\n\nprint(tokenize('a b  c'))\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159; dates 2024-05-01; prices $12.99 and €7,50.",
] * 4


def write_spm_gguf(path: Any, arch: str) -> None:
    from tokenizers import SentencePieceBPETokenizer

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(SPM_CORPUS, vocab_size=1200, min_frequency=2, show_progress=False, limit_alphabet=300)
    vocab = sp.get_vocab()
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types, scores = [2, 3, 3] + [6] * 256, [0.0] * len(tokens)
    for rank, piece in enumerate(sorted(vocab, key=vocab.__getitem__)):
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
            scores.append(-float(rank))
    w = vocab_only_writer(path, arch)
    w.add_rope_dimension_count(16)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


SPM_TEXTS = [*TEXTS, " hi", "  hi", "x<s>y", "a </s> b", "<unk>x", "zzzqqq ÿ ☃ 🤖", "\n\nA"]


SPM_PIECES = ["the", "The", " ", "  ", "\n", "\t", "token", "izer", "19", "7", ".", ",", "'", "<s>", "</s>", "<unk>",
              "<", ">", "😀", "ÿ", "zq", "▁"]


def vocabulary_hash(path: Any) -> str:
    """A digest of a written file's tokenizer metadata: the recorded llama.cpp answers hold for this vocabulary
    only (a change in the writer or in `tokenizers`' training shows as another digest)."""
    md = open_gguf(path).metadata
    keys = sorted(k for k in md if k.startswith("tokenizer.ggml."))
    return hashlib.sha256(repr([(k, md[k] if not hasattr(md[k], "tolist") else md[k].tolist())
                                for k in keys]).encode()).hexdigest()[:16]
