"""`fuel train`: train a small Llama on a text file, a tokenized corpus or the built-in corpus.

    fuel train                                   # nanoGPT's CPU config in Llama form on the built-in corpus
    fuel train --data book.txt --steps 500 --out run1
    fuel train --config run.toml --lr 3e-4       # a TOML/JSON table of the same keys; flags override it
    fuel train --resume run1/checkpoints/step-000500 --steps 1000
    fuel train --lora ...                        # QLoRA fine-tuning (`fuel.lora.cli`)

Every key of `fuel.train.config.TrainConfig` is a flag (`n_layers` is `--n-layers`). The progress bar (loss,
tokens/s, ETA) goes to stderr; each evaluation's losses and the final summary to stdout. A bad value is one
line `fuel: error: train: ...` with exit status 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fuel.train.config import FIELDS, TrainConfig, from_mapping, load_file, parse_flag

_HELP = {
    "data": "the built-in corpus 'pydoc-topics' (default), a UTF-8 text file, or a .npy array of token ids",
    "tokenizer": "byte (UTF-8 bytes: character models; default) or smollm2 (the bundled SmolLM2's BPE)",
    "val_fraction": "the held-out tail of the corpus (default 0.1)",
    "n_kv_heads": "key/value heads (default 0: as many as --n-heads)",
    "warmup_steps": "linear warmup steps before the cosine decay (default -1: 5%% of --steps)",
    "context_length": "the context the exported GGUF declares (default 2048; positions past --block-size are "
                      "untrained)",
    "grad_clip": "clip the global gradient norm to this (0: no clipping; default 1.0)",
    "eval_interval": "evaluate every this many steps, and at the end (default 250)",
    "checkpoint_interval": "write a checkpoint every this many steps, and at the end (default 500)",
    "export": "GGUF exports at the end, comma-separated among f32,q8_0 ('' for none; default f32,q8_0)",
}


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="a .toml or .json file of config keys (flags override it)")
    p.add_argument("--out", default=None, help="the run folder (default: train-out, or the resumed run's)")
    p.add_argument("--resume", default=None, metavar="CHECKPOINT",
                   help="continue from a checkpoint folder (OUT/checkpoints/step-NNNNNN) or a run folder (its "
                        "latest checkpoint)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--lora", action="store_true",
                   help="QLoRA fine-tuning of the bundled SmolLM2: every argument after `train` goes to "
                        "fuel.lora.cli.main (see: fuel train --lora --help)")
    defaults = TrainConfig()
    for name in FIELDS:
        value = getattr(defaults, name)
        shown = ",".join(value) if isinstance(value, tuple) else value
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, metavar=name.upper(),
                       help=_HELP.get(name, f"default {shown}"))


def config_of(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(values from the config file, values from flags given on the command line)."""
    file_values = load_file(args.config) if args.config else {}
    flags = {name: parse_flag(name, getattr(args, name)) for name in FIELDS if getattr(args, name) is not None}
    return file_values, flags


def run_train(args: argparse.Namespace) -> int:
    from fuel.train import checkpoint as ckpt
    from fuel.train.loop import Trainer, resumed_config

    file_values, flags = config_of(args)
    resume = None
    if args.resume:
        where = Path(args.resume)
        found = ckpt.latest(where) if (where / "checkpoints").is_dir() else where
        if found is None:
            raise ckpt.CheckpointError(f"train: --resume {where}: the run folder has no checkpoint")
        resume = ckpt.load(found)
        cfg = resumed_config(resume.config, {**file_values, **flags})
        default_out = found.parent.parent if found.parent.name == "checkpoints" else Path("train-out")
    else:
        cfg = from_mapping({**file_values, **flags}, "the config")
        default_out = Path("train-out")
    out = Path(args.out) if args.out else default_out
    trainer = Trainer(cfg, out, resume=resume, progress=not args.quiet)
    params = sum(int(p.size) for p in trainer.state().values())
    print(f"fuel train: {params:,} parameters, {cfg.n_layers} layers, dim {cfg.dim}, vocab {trainer.vocab}; "
          f"data {cfg.data} ({cfg.tokenizer} tokens: {len(trainer.batches.data):,} train); "
          f"steps {trainer.step} -> {cfg.steps}", flush=True)
    r = trainer.run()
    summary = f"fuel train: step {r.step} in {r.seconds:.1f} s"
    if r.val_loss is not None:
        summary += f"; train loss {r.train_loss:.4f}, val loss {r.val_loss:.4f}"
    print(summary + f"; log {out / 'log.json'}, plot {out / 'loss.png'}", flush=True)
    for path in r.exports:
        print(f"fuel train: exported {path} (run it: fuel generate --model {path})", flush=True)
    return 0

