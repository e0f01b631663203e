"""Text generation on a GGUF file or a Hugging Face model directory, of any architecture `fuel models` lists:
`LLM.generate` yields the text as the tokens come.

    llm = load("smollm2")                                  # weights (kept per process) and tokenizer
    g = llm.generate("What is 2 + 2?", max_tokens=64, chat=True, stop=["\\n\\n"])
    for piece in g:
        print(piece, end="")
    g.finish_reason, g.context_full                        # "stop" or "length"; whether the KV cache filled

**Each generation has its own state.** A generation borrows a sequence (`KVSequence`: a KV cache, its
position, the steps captured over it) from the model's pool when it starts, and gives it back when it
ends: exhausted, closed, or dropped. So generations interleave (`zip(llm.generate(a), llm.generate(b))`)
and run from several threads on one model, each giving exactly what it gives alone; the model runs one
step at a time. The pool lends the idle sequence whose cache shares the longest prefix with the prompt:
a chat's next turn runs only its new tokens. At most the model's `max_sequences` generations run at once;
one more is a `ModelError` when it starts.

**Arguments are checked when `generate` is called**, before anything runs, each error a `ParamError`
(or a `ModelError` for a prompt longer than the KV cache) naming the argument: the prompt is a str, a
list of token ids or a list of chat messages; `max_tokens` an int >= 0; `temperature` a finite real >= 0;
`top_k` an int >= 0; `top_p` a real in (0, 1]; `seed` None or an int >= 0; `stop` a str or a list of them;
`min_p` in [0, 1]; `presence_penalty` and `frequency_penalty` in [-2, 2]; `repetition_penalty` > 0;
`logit_bias` None or {token id: bias in [-100, 100]} (see `fuel.models.sampling`).

**Finish reasons**, as OpenAI's `finish_reason`: "stop" when the model emits an end-of-turn token or the
text reaches a stop sequence; "length" when `max_tokens` tokens were generated or the KV cache is full
(`context_full`: the prompt and the tokens so far fill the model's capacity, and one more token would
need a position past it).

**Stop sequences** (`stop=`): the text ends before the first of them to complete (of two completing at
the same character, the longer), which is not returned; an occurrence may span tokens. "First to
complete" is what a stream can decide as text arrives, so the result never depends on how the text was
cut into tokens. A piece never holds text a stop sequence might still claim:
while the text ends with the start of a stop sequence, that end is held back until the next tokens
settle it (then it is emitted, or the generation stops).

**The last token is never run through the model.** A token is sampled from the logits of the step
before it; running it would only give the logits of a token nobody asks for. A continuation (a chat's
next turn) runs it as part of its prompt.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from fuel.errors import ParamError
from fuel.io.gguf import GGUFError, open_gguf
from fuel.io.hf import QUANTIZE_CHOICES  # what a Hugging Face directory's projections can be quantised to on load
from fuel.models.generate_args import StopText, encode_prompt, stops_of
from fuel.models.kv_sequence import KVSequence
from fuel.models.llama import LlamaModel, ModelError
from fuel.models.llama_weights import LlamaConfig
from fuel.models.sampling import Sampler, is_int
from fuel.models.tokenizer import GGUFTokenizer

MODELS = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma-3-270M"}
KEEP_LOADED = 4  # models `load` keeps per process (by file and context), least recently used dropped first

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


@dataclass
class Stats:
    """The work of an LLM's generations: prompt tokens run (a cached prefix is not run again) and the time
    of their prefill, tokens run through the decode step and the time of those steps."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0
    new_tokens: int = 0
    decode_s: float = 0.0


def model_path(name: str) -> Path:
    """A bundled model's GGUF file by short name (see `MODELS`), a path to a .gguf file, or a Hugging Face
    model directory (one holding `config.json`)."""
    from fuel.io.gguf import bundled_gguf

    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"generate: {path} is a directory without a config.json; give a Hugging Face model "
                             "directory (config.json, *.safetensors, tokenizer.json) or a .gguf file")
        return path
    if path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise ModelError(f"generate: no GGUF file at {path}")
        return path
    try:
        return bundled_gguf(name)
    except GGUFError as e:  # a missing package is a MissingDependency, which says how to install it
        raise ModelError(f"generate: unknown model {name!r}; give one of {', '.join(MODELS)}, the path of a "
                         ".gguf file or a Hugging Face model directory") from e


# ---- generating ---------------------------------------------------------------------------------------


@dataclass
class _Outcome:
    """What a generation's steps report: the tokens so far and, once it ends, why."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    context_full: bool = False


class Generation(Iterator[str]):
    """One generation's text pieces, as they come (module doc). Once it ends, `finish_reason` is "stop" or
    "length" and `context_full` says whether the KV cache was what ended it; `tokens` are the ids generated
    (an end-of-turn token excluded), `prompt_tokens` the prompt's length.

    The steps run in a generator that holds no reference to this object: dropping an unfinished
    generation closes them at once, which gives its sequence back to the pool."""

    def __init__(self, llm: LLM, ids: list[int], max_tokens: int, sampler: Sampler, stops: tuple[str, ...],
                 sequence: KVSequence | None) -> None:
        self.prompt_tokens = len(ids)
        self._out = _Outcome()
        self._it: Generator[str, None, None] = _run(self._out, llm, ids, max_tokens, sampler, stops, sequence)

    @property
    def tokens(self) -> list[int]:
        return self._out.tokens

    @property
    def finish_reason(self) -> str | None:
        return self._out.finish_reason

    @property
    def context_full(self) -> bool:
        return self._out.context_full

    def __next__(self) -> str:
        return next(self._it)

    def close(self) -> None:
        """End the generation early (its sequence goes back to the pool)."""
        self._it.close()


def _run(out: _Outcome, llm: LLM, ids: list[int], max_tokens: int, sampler: Sampler, stops: tuple[str, ...],
         sequence: KVSequence | None) -> Generator[str, None, None]:
    if max_tokens == 0:
        out.finish_reason = "length"
        return
    model = llm.model
    seq = model.acquire(ids) if sequence is None else sequence
    try:
        if not seq.in_use.acquire(blocking=False):
            raise ModelError("generate: the sequence given is in use by another generation")
        try:
            yield from _steps(out, llm, seq, ids, max_tokens, sampler, StopText(stops))
        finally:
            seq.in_use.release()
    finally:
        if sequence is None:
            model.release(seq)


def _steps(out: _Outcome, llm: LLM, seq: KVSequence, ids: list[int], max_tokens: int, sampler: Sampler,
           stop: StopText) -> Generator[str, None, None]:
    common = min(seq.common_prefix(ids), len(ids) - 1)  # at least one token runs, for its logits
    seq.rewind(common)
    start = time.perf_counter()
    logits = seq.prefill(ids[common:])
    llm.count(prompt_tokens=len(ids) - common, prefill_s=time.perf_counter() - start)
    pieces = llm.tokenizer.stream()
    reason, stopped = "length", False
    history = list(ids)  # the prompt, then each token generated: what the sampler's penalties see
    while True:
        t = sampler(logits, history, prompt_len=len(ids))
        if t in llm.tokenizer.eos_ids:
            reason = "stop"
            break
        out.tokens.append(t)
        history.append(t)
        text, stopped = stop.push(pieces.push(t))
        if text:
            yield text
        if stopped:
            reason = "stop"
            break
        if len(out.tokens) == max_tokens:
            break
        if seq.pos >= seq.capacity:
            out.context_full = True
            break
        start = time.perf_counter()
        logits = seq.decode(t)
        llm.count(new_tokens=1, decode_s=time.perf_counter() - start)
    if not stopped:
        text, stopped = stop.push(pieces.flush())
        rest = text + ("" if stopped else stop.flush())
        if rest:
            yield rest
        reason = "stop" if stopped else reason
    out.finish_reason = reason


class LLM:
    """A loaded model with its tokenizer: `generate` yields text pieces as the tokens come. `stats` counts
    the work of every generation (`Stats`)."""

    def __init__(self, model: LlamaModel, tokenizer: GGUFTokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.stats = Stats()
        self._stats_lock = threading.Lock()

    def count(self, **work: float) -> None:
        with self._stats_lock:
            for k, v in work.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def prompt_ids(self, prompt: Any, chat: Any = False) -> list[int]:
        """`encode_prompt` with this model's tokenizer and vocabulary."""
        return encode_prompt(self.tokenizer, self.model.cfg.vocab, prompt, chat)

    def generate(self, prompt: Prompt, max_tokens: int = 128, *, chat: bool = False, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: str | Sequence[str] | None = None, min_p: float = 0.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                 logit_bias: Mapping[int, float] | None = None) -> Generation:
        """The continuation of `prompt` (see `prompt_ids`) as text pieces, greedy unless temperature > 0,
        ending at an end-of-turn token, a `stop` sequence, `max_tokens` tokens or a full KV cache. The
        sampling arguments are `Sampler`'s (fuel.models.sampling: the order of its steps); the penalties
        see the prompt's ids and the tokens generated so far."""
        sampler = Sampler(temperature, top_k, top_p, seed, min_p, presence_penalty, frequency_penalty,
                          repetition_penalty, logit_bias)
        self.model.check_ids(list(sampler.logit_bias or ()), "generate: logit_bias")  # now, not at the first token
        stops = stops_of(stop)
        return self.stream(self.prompt_ids(prompt, chat), max_tokens, sampler, stops)

    def stream(self, ids: list[int], max_tokens: int, sampler: Sampler, stop: str | Sequence[str] | None = None,
               sequence: KVSequence | None = None) -> Generation:
        """Generate from prompt ids (checked) on a sequence of the pool, or on `sequence` (the caller's: it
        stays the caller's, with the prompt and the tokens run cached)."""
        stops = stops_of(stop)
        if not is_int(max_tokens) or max_tokens < 0:
            raise ParamError(f"generate: max_tokens must be an int >= 0, got {max_tokens!r}")
        if sequence is not None and sequence.model is not self.model:
            raise ParamError("generate: the sequence given belongs to another model")
        ids = self.model.check_ids(ids, "generate: prompt")
        if not ids:
            raise ParamError("generate: the prompt is empty (it has no tokens)")
        if len(ids) > self.model.capacity:
            raise ModelError(f"generate: the prompt has {len(ids)} tokens, the KV cache holds "
                             f"{self.model.capacity}; load the model with a larger context (fuel generate "
                             "--context)")
        return Generation(self, ids, int(max_tokens), sampler, stops, sequence)


# ---- loading ------------------------------------------------------------------------------------------

_lock = threading.Lock()
_headers: OrderedDict[tuple[Any, ...], tuple[Any, GGUFTokenizer, Any]] = OrderedDict()
_models: OrderedDict[tuple[Any, ...], Any] = OrderedDict()


def _key(path: Path, quantize: str | None = None) -> tuple[Any, ...]:
    st = (path / "config.json" if path.is_dir() else path).stat()
    return (str(path.resolve()), st.st_mtime_ns, st.st_size, quantize)


# The model class of each architecture that is not a Llama-family decoder: (module, model class, config class).
# Every other supported architecture runs on `LlamaModel` (fuel.models.architectures lists them).
MODEL_CLASSES: dict[str, tuple[str, str, str]] = {"mamba": ("fuel.models.mamba_lm", "MambaModel", "MambaConfig")}


def _model_class(arch: str, which: int) -> Any:
    if arch not in MODEL_CLASSES:
        return (LlamaModel, LlamaConfig)[which - 1]
    import importlib

    module, *names = MODEL_CLASSES[arch]
    return getattr(importlib.import_module(module), names[which - 1])


def describe(path: Path, quantize: str | None = None) -> tuple[Any, GGUFTokenizer, Any]:
    """A model's source (a GGUFFile, or a Hugging Face directory seen as one: `fuel.io.hf`), tokenizer and
    hyper-parameters (no weights read): enough to check a request before loading. Kept per process, like
    `load`'s models. `quantize` ("q8_0") quantises a directory's projection weights when they are read."""
    key = _key(path, quantize)
    with _lock:
        if key in _headers:
            _headers.move_to_end(key)
            return _headers[key]
    if path.is_dir():
        from fuel.io.hf import open_source

        src: Any = open_source(path, quantize=quantize)
        tokenizer = GGUFTokenizer.from_hf_dir(path)
    else:
        if quantize is not None:
            raise ModelError(f"generate: --quantize {quantize} applies to a Hugging Face directory; {path.name} "
                             "is a GGUF file, whose weights keep the types they were written in")
        src = open_gguf(path)
        tokenizer = GGUFTokenizer.from_metadata(src.metadata)
    found = (src, tokenizer, _model_class(src.architecture, 2).from_gguf(src))
    with _lock:
        _headers[key] = found
        while len(_headers) > KEEP_LOADED:
            _headers.popitem(last=False)
    return found


def load(name: str = "smollm2", context: int = 2048, err: TextIO | None = None, quantize: str | None = None) -> LLM:
    """A bundled model by short name (`smollm2`, `gemma3`), a .gguf path or a Hugging Face model directory,
    with KV caches of `context` tokens; `err` (e.g. sys.stderr) receives loading progress; `quantize` ("q8_0")
    quantises a directory's projection weights on load. The weights are loaded once per process and (file,
    context, quantize) (the `KEEP_LOADED` most recently used are kept): a model is safe to share, each
    generation having its own sequence. Each call gives a new LLM (its own `stats`)."""
    path = model_path(name)
    src, tokenizer, _ = describe(path, quantize)
    key = (*_key(path, quantize), context)
    with _lock:
        model = _models.get(key)
        if model is not None:
            _models.move_to_end(key)
    if model is None:
        if err is not None:
            err.write(f"Loading {MODELS.get(name, path.name)} from {path}\n")
        model = _model_class(src.architecture, 1)(src, context, progress=None if err is None else _progress(err))
        with _lock:
            model = _models.setdefault(key, model)
            while len(_models) > KEEP_LOADED:
                _models.popitem(last=False)
    return LLM(model, tokenizer)


def _progress(stream: TextIO) -> Any:
    live = stream.isatty()  # redraw one line on a terminal; a log gets the finished line only

    def report(what: str, i: int, n: int) -> None:
        if live or i == n:
            stream.write(("\r" if live else "") + f"  {what}: {i}/{n}" + ("\n" if i == n else ""))
            stream.flush()
    return report


__all__ = ["LLM", "MODELS", "QUANTIZE_CHOICES", "Generation", "Stats", "describe", "load", "model_path", "stops_of"]
