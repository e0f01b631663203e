"""`fuel generate`: stream text from a GGUF model (SmolLM2-135M-Instruct by default, or Gemma-3-270M).

Loading shows its progress on stderr; the tokens stream to stdout as they come; the end prints the
prefill and decode speeds and the peak RSS. The steps are captured once before the clock starts
(the first call of a jitted step traces and plans it, and Numba loads its kernels), so the speeds are
those of the replayed steps. `--chat` wraps the prompt in the model's chat template; with no prompt
it reads turns from stdin and keeps the conversation in the KV cache.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from fuel.errors import FuelError
from fuel.io.gguf import GGUFError
from fuel.models.llama import LlamaModel, ModelError
from fuel.models.sampling import Sampler
from fuel.models.tokenizer import GGUFTokenizer

MODELS = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma-3-270M"}
DEFAULT_PROMPT = "What is the capital of France, and what is it famous for? Answer in two sentences."


@dataclass
class Stats:
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    new_tokens: int = 0
    decode_s: float = 0.0


def model_path(name: str) -> Path:
    """A bundled model's GGUF file by short name (see `MODELS`), or a path to a .gguf file."""
    from fuel.io.gguf import bundled_gguf

    path = Path(name).expanduser()
    if path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise ModelError(f"generate: no GGUF file at {path}")
        return path
    try:
        return bundled_gguf(name)
    except GGUFError as e:  # a missing package is a MissingDependency, which says how to install it
        raise ModelError(f"generate: unknown model {name!r}; give one of {', '.join(MODELS)} "
                         "or the path of a .gguf file") from e


class LLM:
    """A loaded model with its tokenizer: `generate` yields text pieces as the tokens come.

    The KV cache keeps the last conversation: a prompt that starts with the tokens already cached
    (a chat's next turn) runs only its new tokens. `stats` counts the work of every call."""

    def __init__(self, model: LlamaModel, tokenizer: GGUFTokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.cached: list[int] = []  # the ids whose K/V the cache holds, positions 0 … len - 1
        self.stats = Stats()

    def prompt_ids(self, prompt: str | list[dict[str, str]], chat: bool) -> list[int]:
        """A plain prompt's ids, or (chat) the ids of the rendered chat template for one user message
        or a list of messages."""
        tok = self.tokenizer
        if isinstance(prompt, list):
            return tok.encode_chat(prompt)
        return tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)

    def generate(self, prompt: str | list[dict[str, str]], max_tokens: int = 128, *, chat: bool = False,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None) -> Iterator[str]:
        """Text pieces of the continuation of `prompt` (see `prompt_ids`), greedy unless temperature > 0."""
        return self.stream(self.prompt_ids(prompt, chat), max_tokens, Sampler(temperature, top_k, top_p, seed))

    def stream(self, ids: list[int], max_tokens: int, sampler: Sampler) -> Iterator[str]:
        """Continue from the cache's longest common prefix with `ids`, then generate up to `max_tokens`."""
        if max_tokens < 0:
            raise ModelError(f"generate: max_tokens must be >= 0, got {max_tokens}")
        room = self.model.capacity - len(ids)
        if room < 1:
            raise ModelError(f"generate: the prompt has {len(ids)} tokens, the KV cache holds "
                             f"{self.model.capacity}; load the model with a larger context")
        common = 0
        while common < min(len(ids), len(self.cached)) and ids[common] == self.cached[common]:
            common += 1
        common = min(common, len(ids) - 1)  # at least one token runs, for its logits
        self.model.pos = common
        start = time.perf_counter()
        logits = self.model.prefill(ids[common:])
        self.stats.prompt_tokens += len(ids) - common
        self.stats.prefill_s += time.perf_counter() - start
        self.cached = list(ids)
        pieces = self.tokenizer.stream()
        start = time.perf_counter()
        for _ in range(min(max_tokens, room)):
            t = sampler(logits)
            if t in self.tokenizer.eos_ids:
                break
            piece = pieces.push(t)
            if piece:
                yield piece
            logits = self.model.decode(t)
            self.cached.append(t)
            self.stats.new_tokens += 1
        self.stats.decode_s += time.perf_counter() - start
        rest = pieces.flush()
        if rest:
            yield rest


def _progress(stream: TextIO) -> Callable[[str, int, int], None]:
    live = stream.isatty()  # redraw one line on a terminal; a log gets the finished line only

    def report(what: str, i: int, n: int) -> None:
        if live or i == n:
            stream.write(("\r" if live else "") + f"  {what}: {i}/{n}" + ("\n" if i == n else ""))
            stream.flush()
    return report


def load(name: str = "smollm2", context: int = 2048, err: TextIO | None = None) -> LLM:
    """A bundled model by short name (`smollm2`, `gemma3`) or a .gguf path, with a KV cache of `context`
    tokens; `err` (e.g. sys.stderr) receives loading progress."""
    path = model_path(name)
    if err is not None:
        err.write(f"Loading {MODELS.get(name, path.name)} from {path}\n")
    model = LlamaModel.load(path, capacity=context, progress=None if err is None else _progress(err))
    return LLM(model, GGUFTokenizer.from_metadata(model.file.metadata))


def warm_up(model: LlamaModel, prompt_len: int, err: TextIO) -> None:
    """Capture the decode step and the prefill chunk sizes a prompt of `prompt_len` tokens uses."""
    err.write("  capturing the prefill and decode steps (Numba loads its kernels on first use) ...")
    err.flush()
    start = time.perf_counter()
    model.prefill([0] * max(1, min(prompt_len, model.capacity - 1)))
    model.decode(0)  # prefill's last chunk gives the logits itself: the decode step is captured apart
    model.reset()
    err.write(f" {time.perf_counter() - start:.1f} s\n")


def report(stats: Stats, err: TextIO) -> None:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    pre = stats.prompt_tokens / stats.prefill_s if stats.prefill_s else 0.0
    dec = stats.new_tokens / stats.decode_s if stats.decode_s else 0.0
    err.write(f"\nprefill: {stats.prompt_tokens} tokens in {stats.prefill_s:.2f} s ({pre:.1f} tokens/s); "
              f"decode: {stats.new_tokens} tokens in {stats.decode_s:.2f} s ({dec:.1f} tokens/s); "
              f"peak RSS {rss:.0f} MiB\n")


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None,
                   help="the prompt (default: a short question in chat mode; with --chat and no prompt, "
                        "read turns from stdin)")
    p.add_argument("--model", default="smollm2", help=f"{' or '.join(MODELS)} (bundled), or a .gguf path")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="the most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default) decodes greedily")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set reaching p")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler, for repeatable runs")
    p.add_argument("--context", type=int, default=2048, help="the KV cache's capacity in tokens (default 2048)")


def run_generate(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
                 stdin: TextIO | None = None) -> int:
    out, err, stdin = out or sys.stdout, err or sys.stderr, stdin or sys.stdin
    try:
        sampler = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
        if args.max_tokens < 0:
            raise ModelError(f"generate: --max-tokens must be >= 0, got {args.max_tokens}")
        llm = load(args.model, args.context, err)
        if args.chat and args.prompt is None:
            return _chat_loop(llm, args.max_tokens, sampler, out, err, stdin)
        chat = args.chat or args.prompt is None  # the default prompt is a question for the chat model
        prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
        ids = llm.prompt_ids(prompt, chat)
        warm_up(llm.model, len(ids), err)
        out.write(f"> {prompt}\n" if chat else prompt)
        for _ in _echo(llm.stream(ids, args.max_tokens, sampler), out):
            pass
        out.write("\n")
        report(llm.stats, err)
        return 0
    except FuelError as e:
        err.write(f"\nerror: {e}\n")
        return 2


def _chat_loop(llm: LLM, max_tokens: int, sampler: Sampler, out: TextIO, err: TextIO, stdin: TextIO) -> int:
    messages: list[dict[str, str]] = []
    warm_up(llm.model, 64, err)
    err.write("Chat: one message per line; an empty line or the end of input ends the chat.\n")
    for line in stdin:
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.strip()})
        reply = "".join(_echo(llm.stream(llm.prompt_ids(messages, True), max_tokens, sampler), out))
        out.write("\n")
        messages.append({"role": "assistant", "content": reply})
    report(llm.stats, err)
    return 0


def _echo(pieces: Iterator[str], out: TextIO) -> Iterator[str]:
    for piece in pieces:
        out.write(piece)
        out.flush()
        yield piece
