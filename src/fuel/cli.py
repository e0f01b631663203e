"""The `fuel` command: inventory, verify, bench, generate (and demo, its default run), embed, serve, train.

Exit statuses: 0 done; 1 a check failed (`verify`); 2 a bad request: an argument argparse refuses, or a
FuelError (a bad file, a prompt that does not fit, ...), told in one line `fuel: error: ...` (argparse's
own: `fuel <command>: error: ...`) on stderr; 130 interrupted by Ctrl-C (SIGINT), with no traceback, as a
shell reports a process SIGINT ended; 141 stdout closed early (`fuel generate ... | head -c 100`): the
command stops quietly, as a process SIGPIPE ended would.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

from fuel.arg_types import number

EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE


def error_line(message: object) -> str:
    """The one line an error prints: `fuel: error: <message>` (newlines in it become spaces)."""
    return "fuel: error: " + " ".join(str(message).split("\n")) + "\n"


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: `fuel <command>: error: <what> (see: fuel <command> --help)`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def _inventory(args: argparse.Namespace) -> int:
    from fuel.inventory import inventory, to_json, to_markdown

    records = inventory()
    print(to_json(records) if args.json else to_markdown(records))
    return 0


def _entry_names(names: list[str]) -> list[str] | None:
    """Registry names for `names`, each given as the entry's name or its builder's (snake_case) name."""
    from fuel.graph.registry import default_registry, snake_name

    known = {}
    for e in default_registry():
        known[e.name] = known[snake_name(e.name)] = e.name
    unknown = [n for n in names if n not in known]
    if unknown:
        valid = ", ".join(e.name for e in default_registry())
        print(f"verify: no entry named {', '.join(unknown)}; valid names (or their snake_case builder names): {valid}",
              file=sys.stderr)
        return None
    return [known[n] for n in names]


def _compile(args: argparse.Namespace) -> int:
    from fuel.testing.precompile import precompile

    failures = precompile(args.jobs)
    for line in failures:
        print(f"fuel compile: {line}", file=sys.stderr)
    return 1 if failures else 0


def _verify(args: argparse.Namespace) -> int:
    names = _entry_names(args.names)
    if names is None:
        return 2
    if args.decomposed:
        from fuel.testing.decomposed import verify_decomposed

        results = verify_decomposed(names)
    else:
        from fuel.testing.contract import verify

        results = verify(names)
    print(f"{'impl':52} {'cases':>5} {'worst/bound':>11} {'bit-stable':>10}  result")
    for r in results:
        status = "ok" if r.ok else (r.error or (f"not bit-stable: {r.unstable}" if not r.bit_stable else "")
                                    or f"FAIL: error {r.worst:.2f}x its declared bound")
        print(f"{r.impl:52} {r.cases:5} {r.worst:11.3f} {'yes' if r.bit_stable else 'NO':>10}  {status}")
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _bench(args: argparse.Namespace) -> int:
    # torch's OpenMP pool spins while idle and slows fuel's spinning pool down in one process; passive
    # waiting gives both their fair speed side by side. Set before torch's pool starts (see
    # docs/models.md, "Measurements": "OpenMP's wait policy in fuel bench").
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    root = Path(__file__).resolve().parents[2]
    script = ("bench_attention.py" if args.attention else "bench_latency.py" if args.latency
              else "bench_quant.py" if args.quant else "bench_models.py" if args.models
              else "bench_serve.py" if args.serve else "bench_conv.py" if args.conv
              else "bench_scans.py" if args.scans else "bench_train.py" if args.train else "bench_ops.py")
    if not (root / "benchmarks" / script).exists():
        print("bench: the benchmarks live in the source checkout (benchmarks/); install Fuel editable from it")
        return 2
    sys.path.insert(0, str(root))
    if args.attention:
        from benchmarks import bench_attention

        return bench_attention.main(args.out, args.repeat, not args.no_compile)
    if args.quant:
        from benchmarks import bench_quant

        return bench_quant.main(args.out, args.repeat)
    if args.conv:
        from benchmarks import bench_conv

        return bench_conv.main(args.out, args.repeat)
    if args.scans:
        from benchmarks import bench_scans

        return bench_scans.main(args.out, args.repeat)
    if args.serve:
        from benchmarks import bench_serve

        return bench_serve.main(args.out)
    if args.train:
        from benchmarks import bench_train

        return bench_train.main(args.out)
    if args.models:
        from benchmarks import bench_models

        return bench_models.main(args.out)
    if args.latency:
        from benchmarks import bench_latency

        return bench_latency.main(args.out, args.repeat)
    from benchmarks import bench_ops

    return bench_ops.main(args.names, args.dtype, args.out, args.repeat, not args.no_compile)


def _dtype_list(text: str) -> list[str]:
    """argparse type of --dtype: comma-separated float dtype names, checked before anything is measured."""
    from fuel.dtype import FLOAT_DTYPES

    valid = [d.value for d in FLOAT_DTYPES]
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown dtype {', '.join(bad) or repr(text)}; valid: {', '.join(valid)}")
    return names


_positive_int = number(int, 1, what="a positive integer")


def _generate(args: argparse.Namespace) -> int:
    from fuel.models.generate_cli import run_generate

    return run_generate(args)


def _models(args: argparse.Namespace) -> int:
    from fuel.models.catalog import run_models

    return run_models(args)


def _embed(args: argparse.Namespace) -> int:
    from fuel.models.bert import run_embed

    return run_embed(args)


def _add_embed_arguments(p: argparse.ArgumentParser) -> None:
    from fuel.models.bert import add_embed_arguments

    add_embed_arguments(p)


def _serve(args: argparse.Namespace) -> int:
    from fuel.serve.ray import run_serve_ray
    from fuel.serve.serve_cli import run_serve

    return run_serve_ray(args) if args.ray_replicas else run_serve(args)


def _train(args: argparse.Namespace) -> int:
    from fuel.train.cli import run_train

    return run_train(args)


def _train_lora(argv: list[str]) -> int:
    """`fuel train --lora ...`: every argument after `train` goes to `fuel.lora.cli.main(argv) -> int`."""
    import importlib

    code: int = importlib.import_module("fuel.lora.cli").main(argv)
    return code


def _add_generate_arguments(p: argparse.ArgumentParser) -> None:
    from fuel.models.generate_cli import add_generate_arguments

    add_generate_arguments(p)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="fuel", description="Fuel: fused ops with exact, fast CPU kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inventory", help="the kernel inventory from the live registry")
    p.add_argument("--json", action="store_true", help="JSON instead of markdown")
    p.set_defaults(run=_inventory)
    p = sub.add_parser("verify", help="every impl against the float64 reference and bit-stability")
    p.add_argument("names", nargs="*", help="entry names (default: all)")
    p.add_argument("--decomposed", action="store_true",
                   help="instead: every entry's primitive lowering against each of its kernels, within the "
                        "kernel's declared precision")
    p.set_defaults(run=_verify)
    p = sub.add_parser("compile", help="fill Numba's on-disk cache with every kernel ahead of first use")
    p.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1,
                   help="worker processes compiling at once (default: the CPU count)")
    p.set_defaults(run=_compile)
    p = sub.add_parser("bench", help="kernels against PyTorch eager and torch.compile")
    p.add_argument("names", nargs="*", help="case names (default: all)")
    p.add_argument("--dtype", type=_dtype_list, default=["f32", "bf16"],
                   help="comma-separated dtypes among f32,f64,bf16,f16 (default f32,bf16)")
    p.add_argument("--out", default="bench-results", help="folder for JSON and PNG")
    p.add_argument("--repeat", type=_positive_int, default=10, help="timed runs per measurement (at least 1)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--latency", action="store_true",
                      help="instead of the kernel cases: per-step latency of a SmolLM2-135M-shaped decode and "
                           "prefill (fuel eager, fuel jit, NumPy, torch; names and --dtype do not apply)")
    mode.add_argument("--attention", action="store_true",
                      help="instead of the kernel cases: attention forward, backward, decode, paged decode and "
                           "long-sequence peak memory against torch SDPA (names and --dtype do not apply)")
    mode.add_argument("--quant", action="store_true",
                      help="instead of the kernel cases: quantized matmuls (GGUF Q4_0, Q4_K, Q6_K, Q8_0 and NF4, "
                           "4096x4096, M 1 and 64) against torch dequantise + matmul and bitsandbytes "
                           "(names, --dtype and --no-compile do not apply)")
    mode.add_argument("--conv", action="store_true",
                      help="instead of the kernel cases: conv2d and conv_transpose2d (N8 C64 56x56 3x3) and "
                           "causal_conv1d (B2 C1536 L1024 K4, with and without SiLU) against torch eager "
                           "(names, --dtype and --no-compile do not apply)")
    mode.add_argument("--scans", action="store_true",
                      help="instead of the kernel cases: Mamba-1 selective scan (B2 L1024 dim1536 N16, forward and "
                           "backward), Mamba-2 SSD (B1 L2048 H24 P64 N128) and cross-entropy ([4096, 32000], forward "
                           "and backward) against torch eager (names, --dtype and --no-compile do not apply)")
    mode.add_argument("--models", action="store_true",
                      help="instead of the kernel cases: SmolLM2, Gemma-3 (prefill and decode tokens/s, peak RSS) and "
                           "MiniLM (sentences/s) against transformers, llama.cpp (`make bench-env`) and "
                           "sentence-transformers, and synthetic ~0.5B Qwen2 and Phi-3 files (Q4_K_M recipe) "
                           "against llama.cpp (names, --dtype, --repeat and --no-compile do not apply; more "
                           "options: python -m benchmarks.bench_models --help)")
    mode.add_argument("--serve", action="store_true",
                      help="instead of the kernel cases: `fuel serve` against llama-server and llama-cpp-python's "
                           "server (`make bench-env`) on SmolLM2, concurrency 1, 4, 8: tokens/s, TTFT, inter-token "
                           "latency (names, --dtype, --repeat and --no-compile do not apply; more options: "
                           "python -m benchmarks.bench_serve --help)")
    mode.add_argument("--train", action="store_true",
                      help="instead of the kernel cases: training tokens/s and peak RSS (AdamW, f32) of fuel.nn.Llama "
                           "against transformers' LlamaForCausalLM in torch eager and torch.compile, at the "
                           "stories15M (B4 x T256) and SmolLM2-135M (B1 x T128) shapes, and QLoRA on SmolLM2 "
                           "against peft, 3 interleaved rounds (more options: python -m benchmarks.bench_train --help)")
    p.set_defaults(run=_bench)
    p = sub.add_parser("generate", help="stream text from an LLM: a bundled one (SmolLM2-135M-Instruct by default), "
                                        "a GGUF file or a Hugging Face directory (see fuel models)")
    _add_generate_arguments(p)
    p.set_defaults(run=_generate)
    p = sub.add_parser("demo", help="the main job: `fuel generate` on the embedded default model, same options")
    _add_generate_arguments(p)
    p.set_defaults(run=_generate)
    p = sub.add_parser("models", help="the packaged models and the architectures fuel generate runs")
    p.add_argument("--json", action="store_true", help="JSON instead of text")
    p.set_defaults(run=_models)
    p = sub.add_parser("embed", help="sentence embeddings with all-MiniLM-L6-v2")
    _add_embed_arguments(p)
    p.set_defaults(run=_embed)
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching (the serve extra)")
    from fuel.serve.ray import add_serve_ray_arguments
    from fuel.serve.serve_cli import add_serve_arguments

    add_serve_arguments(p)
    add_serve_ray_arguments(p)
    p.set_defaults(run=_serve)
    p = sub.add_parser("train", help="train a small Llama (nanoGPT's CPU config by default) and export it to GGUF")
    from fuel.train.cli import add_train_arguments

    add_train_arguments(p)
    p.set_defaults(run=_train)
    words = sys.argv[1:] if argv is None else list(argv)
    if words[:1] == ["train"] and "--lora" in words[1:]:  # QLoRA has its own options: fuel.lora.cli parses them
        args = argparse.Namespace(run=lambda _: _train_lora(words[1:]))
    else:
        args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as e:
        from fuel.errors import FuelError

        if not isinstance(e, FuelError):
            raise
        print(error_line(e), end="", file=sys.stderr)
        return 2
    return code


def _quiet_stdout() -> None:
    """Point stdout's descriptor at /dev/null: the interpreter's last flush of what is still buffered
    would hit the closed pipe again and print a warning."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture): nothing to flush to a pipe
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    raise SystemExit(main())
