"""A Hugging Face model directory seen as the llama.cpp GGUF file of the same model.

    src = open_source("path/to/Qwen2.5-0.5B-Instruct")     # config.json, *.safetensors, tokenizer.json
    src.architecture                                        # "qwen2"; src.hparam("block_count") -> 24
    w = src["blk.0.attn_q.weight"]                          # the tensor under llama.cpp's name
    model = LlamaModel(src, capacity=2048)                  # the same decoder as for a .gguf file

`HFModelDir` gives the interface of `fuel.io.gguf.GGUFFile` that the models read (`architecture`, `hparam`,
`metadata`, `path`, `names()`, `name in src`, `src[name]`), holding what llama.cpp's converter would have
written: the names of one table per architecture (`fuel.io.hf_names`), the metadata keys and the rope
tensors synthesised from `config.json` (`fuel.io.hf_config`), Q/K rows permuted for llama files, Gemma
norm weights stored as 1 + w, Mamba's A as -exp(A_log). The tokenizer is `tokenizer.json`, read by
`GGUFTokenizer.from_hf_dir`; the metadata holds no `tokenizer.*` keys.

**Weights.** Safetensors files (`model.safetensors`, or the shards `model.safetensors.index.json` lists,
or every `*.safetensors` of the directory) are read through the `safetensors` library: the headers when the
directory is opened, each tensor's values when the model first reads it. 2-D tensors keep their dtype (F32,
BF16, F16); 1-D ones (norms, biases) and transformed ones are float32, as the converter writes them.
`quantize="q8_0"` quantises each layer's 2-D projections and the output head through `gguf.quants` when
first read (rows whose length is not a multiple of 32 stay float, as the converter leaves them); the token
embedding stays float.

**Checks.** Every checkpoint tensor must fall under a rule of its architecture's table, with the shape
`config.json`'s sizes give it, and every rule's tensor must be present, for every layer the config declares;
otherwise `HFError` names the tensor and the file or directory. A configuration the decoder would not run
as transformers does is refused by `fuel.io.hf_config`, naming the key and the value. Transformers' tied
output head (`tie_word_embeddings`) is left out, and the model ties it to `token_embd.weight` as it does
for a GGUF file.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from fuel.errors import ParamError
from fuel.io.gguf import GGUFFile, GGUFTensor, open_gguf
from fuel.io.gguf_format import need_gguf
from fuel.io.hf_config import Config, HFError, decoder_metadata, mamba_metadata
from fuel.io.hf_names import TABLES, Rule, ignored, match
from fuel.io.source import ModelSource

__all__ = ["QUANTIZE_CHOICES", "HFError", "HFModelDir", "HFTensor", "StoredTensor", "open_source", "read_safetensors"]

QUANTIZE_CHOICES = ("q8_0",)
# safetensors dtype -> (NumPy dtype, ggml type id)
_DTYPES: dict[str, tuple[np.dtype[Any], int]] = {"F32": (np.dtype("<f4"), 0), "F16": (np.dtype("<f2"), 1),
                                                  "BF16": (np.dtype(ml_dtypes.bfloat16), 30)}
_GGML_OF = {dt: t for dt, t in _DTYPES.values()}
_DTYPES_BY_GGML = {t: dt for dt, t in _DTYPES.values()}
Q8_0, Q8_BLOCK, Q8_BYTES = 8, 32, 34


class StoredTensor:
    """One tensor of a safetensors file, read through the `safetensors` library when first asked for: its
    name, file, dtype and shape come from the file's header alone."""

    def __init__(self, handle: Any, name: str, file: Path) -> None:
        stored = handle.get_slice(name)
        dtype = stored.get_dtype()
        if dtype not in _DTYPES:
            raise HFError(f"hf: {file}: tensor {name!r} has dtype {dtype}; read are {', '.join(_DTYPES)}")
        self.name, self.file, self._handle = name, file, handle
        self.dtype = _DTYPES[dtype][0]
        self.shape = tuple(int(d) for d in stored.get_shape())
        self.ndim = len(self.shape)

    def load(self) -> np.ndarray:
        """The tensor's values, read from the file now."""
        arr = np.asarray(self._handle.get_tensor(self.name))
        return arr.view(self.dtype).reshape(self.shape)


def read_safetensors(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file by name, each read when first loaded."""
    try:
        handle = safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise HFError(f"hf: {path} is not a safetensors file that can be read: {e}") from None
    return {name: StoredTensor(handle, name, path) for name in handle.keys()}  # noqa: SIM118 (safe_open is not iterable)


class HFTensor(GGUFTensor):
    """A tensor of a Hugging Face directory under its GGUF name: `GGUFTensor`'s interface over an array
    computed when first read (the checkpoint's view, or the converter's transform of it)."""

    def __init__(self, src: HFModelDir, name: str, shape: tuple[int, ...], ggml_type: int,
                 make: Callable[[], np.ndarray]) -> None:
        n_bytes = (math.prod(shape) // Q8_BLOCK * Q8_BYTES if ggml_type == Q8_0
                   else math.prod(shape) * np.dtype(_DTYPES_BY_GGML[ggml_type]).itemsize)
        super().__init__(src, name, tuple(reversed(shape)), ggml_type, 0, n_bytes)  # type: ignore[arg-type]
        self._make = make

    @functools.cached_property
    def _data(self) -> np.ndarray:
        arr = np.ascontiguousarray(self._make())
        arr.flags.writeable = False
        return arr

    def raw(self) -> np.ndarray:
        return self._data.reshape(-1).view(np.uint8)


def _sizes(md: dict[str, Any], a: str) -> dict[str, int]:
    """The dimensions the tables' shapes name (`fuel.io.hf_names.SIZES`), from the metadata."""
    if a == "mamba":
        inner, rank, state = (int(md[f"mamba.ssm.{k}"]) for k in ("inner_size", "time_step_rank", "state_size"))
        return {"hidden": int(md["mamba.embedding_length"]), "vocab": int(md["mamba.vocab_size"]), "inner": inner,
                "2inner": 2 * inner, "conv": int(md["mamba.ssm.conv_kernel"]), "rank": rank, "state": state,
                "xbc": rank + 2 * state}
    hd = int(md[f"{a}.attention.key_length"])
    q, kv = int(md[f"{a}.attention.head_count"]) * hd, int(md[f"{a}.attention.head_count_kv"]) * hd
    ffn = int(md[f"{a}.feed_forward_length"])
    return {"hidden": int(md[f"{a}.embedding_length"]), "vocab": int(md[f"{a}.vocab_size"]), "q": q, "kv": kv,
            "ffn": ffn, "head_dim": hd, "2ffn": 2 * ffn, "qkv": q + 2 * kv}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The converter's Q/K row order for ggml's pair-rotating rope: in each head, row 2j is the first half's
    row j and row 2j + 1 the second half's."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class HFModelDir(ModelSource[HFTensor]):
    """A Hugging Face model directory as a GGUF source (module doc)."""

    def __init__(self, path: str | os.PathLike[str], quantize: str | None = None) -> None:
        if quantize is not None and quantize not in QUANTIZE_CHOICES:
            raise ParamError(f"hf: quantize must be None or one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
        self.path = Path(path)
        self.quantize = quantize
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise HFError(f"hf: {self.path} has no config.json: not a Hugging Face model directory")
        try:
            values = json.loads(cfg_path.read_text())
        except ValueError as e:
            raise HFError(f"hf: {cfg_path} is not JSON ({e})") from None
        if not isinstance(values, dict):
            raise HFError(f"hf: {cfg_path} holds a {type(values).__name__}, expected an object")
        self.config = cfg = Config(cfg_path, values)
        kind = cfg.get("model_type")
        if kind not in TABLES:
            raise HFError(f"hf: {cfg_path}: model_type {kind!r} is not supported; supported: {', '.join(TABLES)}")
        self.table = table = TABLES[kind]
        made: dict[str, np.ndarray] = {}
        if table.arch == "mamba":
            self.metadata = mamba_metadata(cfg, table)
        else:
            self.metadata, made = decoder_metadata(cfg, table)
        self.metadata_types: dict[str, str] = {}
        self.layers = int(self.metadata[f"{table.arch}.block_count"])
        self.sizes = _sizes(self.metadata, table.arch)
        self.tensors: dict[str, HFTensor] = {}
        self._index: dict[str, str] | None = None
        self._map(self._checkpoint())
        for name, arr in made.items():
            self.tensors[name] = HFTensor(self, name, arr.shape, 0, functools.partial(np.asarray, arr))

    def _files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise HFError(f"hf: {index} is not a safetensors index (a JSON object with a weight_map): "
                              f"{type(e).__name__}: {e}") from None
            self._index = {str(k): str(v) for k, v in weight_map.items()}
            shards = sorted(set(self._index.values()))
            for f in shards:
                if not (self.path / f).is_file():
                    raise HFError(f"hf: {index} lists shard {f!r}, which is not in {self.path}")
            return [self.path / f for f in shards]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise HFError(f"hf: {self.path} has no *.safetensors file (nor model.safetensors.index.json)")
        return files

    def _checkpoint(self) -> dict[str, tuple[StoredTensor, Path]]:
        """Every checkpoint tensor by name, with its file."""
        found: dict[str, tuple[StoredTensor, Path]] = {}
        for file in self._files():
            for name, arr in read_safetensors(file).items():
                if name in found:
                    raise HFError(f"hf: tensor {name!r} is in both {found[name][1].name} and {file.name}")
                if self._index is not None and self._index.get(name) != file.name:
                    raise HFError(f"hf: {file} holds tensor {name!r}, which the index puts in "
                                  f"{self._index.get(name)!r}")
                found[name] = (arr, file)
        if self._index is not None:
            for name, file_name in self._index.items():
                if name not in found:
                    raise HFError(f"hf: the index puts tensor {name!r} in {file_name}, which does not hold it")
        return found

    def _map(self, found: dict[str, tuple[StoredTensor, Path]]) -> None:
        table, cfg = self.table, self.config
        tied = bool(cfg.get("tie_word_embeddings", default=table.tie_default))
        seen: set[tuple[str, int | None]] = set()
        for name, (arr, file) in found.items():
            hit = match(table, name)
            if hit is None or (hit[1] is not None and hit[1] >= self.layers):
                if ignored(table, name):
                    continue
                why = "no rule of its architecture's table" if hit is None else f"the config has {self.layers} layers"
                raise HFError(f"hf: unexpected tensor {name!r} in {file} ({table.arch} from model_type "
                              f"{cfg.get('model_type')!r}: {why})")
            rule, layer = hit
            seen.add((rule.hf, layer))
            if rule.tied and tied:
                continue  # transformers ties the head to the embedding and ignores this tensor
            gname = rule.gguf.replace("{i}", str(layer))
            want = tuple(self.sizes[d] for d in rule.shape)
            got = arr.shape[::2] if rule.transform == "squeeze" and arr.ndim == 3 and arr.shape[1] == 1 else arr.shape
            if got != want:
                dims = ", ".join(f"{d} {self.sizes[d]}" for d in rule.shape)
                raise HFError(f"hf: {file}: tensor {name!r} has shape {list(arr.shape)}; config.json gives "
                              f"{list(want)} ({dims})")
            self.tensors[gname] = self._tensor(gname, rule, arr)
        for rule in table.rules:
            for layer in range(self.layers) if rule.layered else [None]:
                if (rule.hf, layer) not in seen and not (rule.tied and tied):
                    hf, gname = (n.replace("{i}", str(layer)) for n in (rule.hf, rule.gguf))
                    raise HFError(f"hf: {self.path} has no tensor {hf!r} (GGUF {gname!r}) in its safetensors files")

    def _tensor(self, gname: str, rule: Rule, stored: StoredTensor) -> HFTensor:
        """The GGUF tensor of checkpoint tensor `stored` under `rule`, read from its file when first used."""
        t, md, a = rule.transform, self.metadata, self.table.arch
        shape = (stored.shape[0], stored.shape[2]) if t == "squeeze" else stored.shape

        def values() -> np.ndarray:
            return stored.load().reshape(shape)
        if t in ("plus_one", "neg_exp") or len(shape) == 1:
            def make() -> np.ndarray:
                x = values().astype(np.float32)
                return x + 1 if t == "plus_one" else -np.exp(x) if t == "neg_exp" else x
            return HFTensor(self, gname, shape, 0, make)
        heads = 0 if not t.startswith("permute") else md[f"{a}.attention.head_count" if t == "permute_q"
                                                          else f"{a}.attention.head_count_kv"]

        def view() -> np.ndarray:
            return _permute(values(), heads) if heads else values()
        if self.quantize == "q8_0" and rule.projection and len(shape) == 2 and shape[1] % Q8_BLOCK == 0:
            def quantized() -> np.ndarray:
                gguf = need_gguf("quantize")
                return np.asarray(gguf.quants.quantize(view().astype(np.float32), gguf.GGMLQuantizationType.Q8_0))
            return HFTensor(self, gname, shape, Q8_0, quantized)
        return HFTensor(self, gname, shape, _GGML_OF[stored.dtype], view)

    # -- the GGUFFile interface --------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"HFModelDir({str(self.path)!r}, arch={self.architecture!r}, {len(self.tensors)} tensors)"

    @property
    def architecture(self) -> str:
        return self.table.arch


def open_source(path: str | os.PathLike[str], quantize: str | None = None) -> GGUFFile | HFModelDir:
    """A model source: a `.gguf` file (`open_gguf`), or a Hugging Face directory with a `config.json`
    (`HFModelDir`, `quantize` None or "q8_0"). Anything else is an HFError naming the path."""
    p = Path(path)
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ParamError(f"hf: quantize must be None or one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise HFError(f"hf: {p} is a directory without config.json; expected a Hugging Face model directory "
                          "(config.json, *.safetensors) or a .gguf file")
        return HFModelDir(p, quantize)
    if p.is_file() and p.suffix == ".gguf":
        if quantize is not None:
            raise ParamError(f"hf: quantize={quantize!r} applies to a Hugging Face directory; {p} is a GGUF file, "
                             "whose tensors keep the types they were written in")
        return open_gguf(p)
    raise HFError(f"hf: {p} is " + ("a file without the .gguf suffix" if p.is_file() else "not there")
                  + "; expected a .gguf file or a Hugging Face model directory (config.json, *.safetensors)")
