"""`fuel generate` (and `fuel demo`): stream text from a GGUF model (SmolLM2-135M-Instruct by default).

The order of the work is the order of what can go wrong, so that a bad request fails before any slow
step: argparse checks each option's type and domain; then the file's header and tokenizer are read (no
weights) to check `--context` against the model's and the prompt (not empty, valid Unicode, no longer
than `--context` tokens); only then do the weights load and the steps get captured (the warm-up: the
first call of a jitted step traces and plans it, and Numba loads its kernels), so the speeds printed at
the end are those of the replayed steps. The prompt is echoed and the tokens stream to stdout as they
come; loading progress, the speeds and the peak RSS go to stderr.

`--chat` wraps the prompt in the model's chat template; with no prompt it reads one user turn per line
from stdin and keeps the conversation in one sequence's KV cache (each turn runs only its new tokens).

A generation cut short by a full KV cache says so on stderr (the exit status stays 0). An error is one
line, `fuel: error: ...`, on stderr, with exit status 2 (`fuel.cli` adds 130 for Ctrl-C and 141 for a
closed stdout).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from typing import TextIO

from fuel.arg_types import number
from fuel.errors import FuelError, ParamError
from fuel.models.generate import LLM, MODELS, Generation, Stats, describe, load, model_path
from fuel.models.generate_args import encode_prompt, stops_of
from fuel.models.kv_sequence import KVSequence
from fuel.models.llama import ModelError
from fuel.models.sampling import Sampler

DEFAULT_PROMPT = "What is the capital of France, and what is it famous for? Answer in two sentences."
CHAT_WARM_UP = 64  # the prompt length the chat loop's warm-up captures (a first turn's size)


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None,
                   help="the prompt (default: a short question in chat mode; with --chat and no prompt, "
                        "read turns from stdin)")
    p.add_argument("--model", default="smollm2", help=f"{' or '.join(MODELS)} (bundled), or a .gguf path")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=number(int, 0, what="an integer >= 0"), default=128,
                   help="the most tokens to generate (default 128)")
    p.add_argument("--temperature", type=number(float, 0.0, what="a finite number >= 0"), default=0.0,
                   help="0 (the default) decodes greedily")
    p.add_argument("--top-k", type=number(int, 0, what="an integer >= 0"), default=0,
                   help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=number(float, 0.0, 1.0, low_open=True, what="a number in (0, 1]"), default=1.0,
                   help="sample from the smallest set reaching p")
    p.add_argument("--seed", type=number(int, 0, what="an integer >= 0"), default=None,
                   help="seed of the sampler, for repeatable runs")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the text before this stop sequence (repeatable)")
    p.add_argument("--context", type=number(int, 1, what="an integer >= 1"), default=2048,
                   help="the KV cache's capacity in tokens (default 2048)")


def run_generate(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
                 stdin: TextIO | None = None) -> int:
    """The command; 0, or 2 after a one-line `fuel: error: ...` on `err`."""
    from fuel.cli import error_line

    out, err, stdin = out or sys.stdout, err or sys.stderr, stdin or sys.stdin
    try:
        return _run(args, out, err, stdin)
    except FuelError as e:
        err.write(error_line(e))
        return 2


def _run(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: TextIO) -> int:
    sampler = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
    stops = stops_of(args.stop and tuple(args.stop))
    path = model_path(args.model)
    _, tokenizer, cfg = describe(path)
    if args.context > cfg.context_length:
        raise ModelError(f"generate: --context {args.context} is more than the model's context of "
                         f"{cfg.context_length} tokens")
    if args.chat and args.prompt is None:
        llm = load(args.model, args.context, err)
        return _chat_loop(llm, args.max_tokens, sampler, stops, out, err, stdin)
    chat = args.chat or args.prompt is None  # the default prompt is a question for the chat model
    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if not prompt:
        raise ParamError("generate: the prompt is empty; give some text, or none for the default question")
    ids = encode_prompt(tokenizer, cfg.vocab, prompt, chat)
    if len(ids) > args.context:
        raise ModelError(f"generate: the prompt has {len(ids)} tokens, more than --context {args.context}; "
                         "give a larger --context")
    llm = load(args.model, args.context, err)
    seq = llm.model.acquire(ids)
    try:
        warm_up(seq, len(ids), err)
        out.write(f"> {prompt}\n" if chat else prompt)
        _echo(llm.stream(ids, args.max_tokens, sampler, stops, sequence=seq), out, err)
    finally:
        llm.model.release(seq)
    report(llm.stats, err)
    return 0


def _chat_loop(llm: LLM, max_tokens: int, sampler: Sampler, stops: tuple[str, ...], out: TextIO, err: TextIO,
               stdin: TextIO) -> int:
    messages: list[dict[str, str]] = []
    seq = llm.model.acquire()
    try:
        warm_up(seq, CHAT_WARM_UP, err)
        err.write("Chat: one message per line; an empty line or the end of input ends the chat.\n")
        while (line := _read_line(stdin)).strip():
            messages.append({"role": "user", "content": line.strip()})
            reply = _echo(llm.stream(llm.prompt_ids(messages, True), max_tokens, sampler, stops, sequence=seq),
                          out, err)
            messages.append({"role": "assistant", "content": reply})
    finally:
        llm.model.release(seq)
    report(llm.stats, err)
    return 0


def _read_line(stdin: TextIO) -> str:
    """stdin's next line ("" at its end); undecodable input is a ParamError."""
    try:
        return stdin.readline()
    except UnicodeDecodeError as e:
        raise ParamError(f"generate: stdin is not {e.encoding} text ({e.reason} at byte {e.start} of a line)") from None


def _echo(generation: Generation, out: TextIO, err: TextIO) -> str:
    """Write the pieces as they come and end the line; a full KV cache is told on `err`. The text."""
    text = []
    for piece in generation:
        out.write(piece)
        out.flush()
        text.append(piece)
    out.write("\n")
    if generation.context_full:
        n = len(generation.tokens)
        err.write(f"generate: stopped after {n} token{'' if n == 1 else 's'}: the KV cache is full (--context); "
                  "the text may be cut short\n")
    return "".join(text)


def warm_up(seq: KVSequence, prompt_len: int, err: TextIO) -> None:
    """Capture the decode step and the prefill chunk sizes a prompt of `prompt_len` tokens uses on `seq`
    (its cache is left empty)."""
    err.write("  capturing the prefill and decode steps (Numba loads its kernels on first use) ...")
    err.flush()
    start = time.perf_counter()
    seq.reset()
    seq.prefill([0] * max(1, min(prompt_len, seq.capacity)))
    if seq.pos < seq.capacity:  # prefill's last chunk gives the logits itself: the decode step is captured apart
        seq.decode(0)
    seq.reset()
    err.write(f" {time.perf_counter() - start:.1f} s\n")


def report(stats: Stats, err: TextIO) -> None:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    pre = stats.prompt_tokens / stats.prefill_s if stats.prefill_s else 0.0
    dec = stats.new_tokens / stats.decode_s if stats.decode_s else 0.0
    err.write(f"\nprefill: {stats.prompt_tokens} tokens in {stats.prefill_s:.2f} s ({pre:.1f} tokens/s); "
              f"decode: {stats.new_tokens} tokens in {stats.decode_s:.2f} s ({dec:.1f} tokens/s); "
              f"peak RSS {rss:.0f} MiB\n")
