"""The `fuel serve` command: load a model, build the engine, run the OpenAI-compatible app under uvicorn.

The model is served under the name given to --model (a bundled name such as `smollm2`, or the file's stem for
a .gguf path): clients send it as `model`. Without the `serve` extra the command says how to install it.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from fuel.arg_types import number

EXTRA_MODULES = ("starlette", "uvicorn", "prometheus_client")
INSTALL = "pip install 'fuel[serve]'"

_port = number(int, 0, 65535, what="a port in [0, 65535]")
_positive = number(int, 1, what="a positive integer")
_count = number(int, 0, what="an integer >= 0")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2, gemma3, the path of a .gguf file or of a Hugging "
                                                      "Face model directory (default smollm2); clients send this "
                                                      "name as `model`")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--slots", type=_positive, default=4, help="sequences decoded together in each step (default 4)")
    p.add_argument("--prompt-rows", type=number(int, 32, what="an integer >= 32"), default=None,
                   help="prompt tokens read in one step: more reads prompts faster, fewer keeps the pauses of "
                        "the streams running meanwhile shorter (default: the engine's, 256)")
    p.add_argument("--context", type=_positive, default=2048,
                   help="tokens of one sequence, prompt and output together (default 2048)")
    p.add_argument("--max-queue", type=_count, default=64,
                   help="requests waiting for a slot before new ones are answered 429 (default 64)")
    p.add_argument("--embedding-model", choices=["minilm", "none"], default="none",
                   help="serve /v1/embeddings with all-MiniLM-L6-v2 (minilm), or not (none, the default)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                   help="uvicorn's log level (default info)")


def served_name(model: str) -> str:
    """The name clients send: a bundled model's, a .gguf file's stem, or a model directory's name."""
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.resolve().name if path.is_dir() else model


def missing_extra() -> list[str]:
    return [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]


def run_serve(args: argparse.Namespace) -> int:
    from fuel.io.gguf_format import MissingDependency

    missing = missing_extra()
    if missing:
        raise MissingDependency(f"serve: needs {', '.join(missing)} (the serve extra): {INSTALL}")
    import uvicorn

    from fuel.models.generate import load
    from fuel.models.llama import LlamaModel, ModelError
    from fuel.serve.app import create_app
    from fuel.serve.engine import Engine

    llm = load(args.model, context=args.context, err=sys.stderr)
    if not isinstance(llm.model, LlamaModel):  # continuous batching runs on a paged KV cache
        arch = getattr(llm.model.cfg, "arch", type(llm.model).__name__)
        raise ModelError(f"serve: {arch} models are not served (the batched step runs attention "
                         "over a paged KV cache, and a state-space model has none); run it with `fuel generate`")
    embedder = None
    if args.embedding_model == "minilm":
        from fuel.models import bert

        embedder = bert.load()
    rows = {} if args.prompt_rows is None else {"prompt_rows": args.prompt_rows}
    engine = Engine(llm, slots=args.slots, max_queue=args.max_queue, model_name=served_name(args.model), **rows)
    sys.stderr.write("Capturing the batched steps ...\n")
    sys.stderr.write(f"  {engine.warm()} step shapes ready\n")
    try:
        uvicorn.run(create_app(engine, embedder=embedder), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0
