"""`fuel train --lora`: QLoRA fine-tuning of a frozen quantized chat model (SmolLM2-135M-Instruct by default)
on an instruction set (the bundled `fuel.lora.instructions`, or a JSON Lines file), saving a PEFT adapter.

    fuel train --lora --out adapter/ --steps 60        # then: fuel generate --lora adapter/ "Why is the sky blue?"

Each step's loss, tokens/s and the time go to stdout as one line; at the end the adapter is saved in PEFT's
format (`fuel.lora.adapter`) and a `train_log.json` beside it records the options and every step's loss.
`fuel.cli` dispatches `fuel train ... --lora ...` here with the words after `train`. Errors are one line,
`fuel: error: ...`, on stderr with exit status 2 (argparse's own: `fuel train --lora: error: ...`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import NoReturn, TextIO

from fuel.arg_types import number
from fuel.errors import FuelError
from fuel.lora.adapter import LoraAdapter, LoraConfig, target_names
from fuel.lora.instructions import INSTRUCTIONS
from fuel.lora.model import QUANTS, load_model
from fuel.lora.train import LoraTrainer, batches, encode_examples, read_examples


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fuel train --lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--lora", action="store_true", required=True, help="fine-tune LoRA adapters (this command)")
    p.add_argument("--model", default="smollm2", help="smollm2 (bundled) or a .gguf path of a Llama-family model")
    p.add_argument("--quant", choices=QUANTS, default="gguf",
                   help="the frozen projections as the file stores them (gguf, QMatMul) or re-quantised to nf4")
    p.add_argument("--data", default=None, help="a JSON Lines file of {prompt, response} objects "
                                                "(default: the bundled instruction set)")
    p.add_argument("--out", default="adapter", help="the adapter's directory (default ./adapter)")
    p.add_argument("--steps", type=number(int, 1, what="an integer >= 1"), default=60)
    p.add_argument("--batch", type=number(int, 1, what="an integer >= 1"), default=4)
    p.add_argument("--seq-len", type=number(int, 2, what="an integer >= 2"), default=96,
                   help="tokens per example, cut or padded to it (default 96)")
    p.add_argument("--lr", type=number(float, 0.0, low_open=True, what="a number > 0"), default=1e-3)
    p.add_argument("--weight-decay", type=number(float, 0.0, what="a number >= 0"), default=0.0)
    p.add_argument("--max-grad-norm", type=number(float, 0.0, low_open=True, what="a number > 0"), default=None)
    p.add_argument("--r", type=number(int, 1, what="an integer >= 1"), default=8, help="the adapters' rank")
    p.add_argument("--alpha", type=number(float, 0.0, low_open=True, what="a number > 0"), default=16.0,
                   help="lora_alpha: the term is scaled by alpha / r")
    p.add_argument("--dropout", type=number(float, 0.0, 1.0, what="a number in [0, 1)"),
                   default=0.0, help="lora_dropout on the adapters' inputs (default 0)")
    p.add_argument("--targets", default="all",
                   help="comma-separated projections: q,k,v,o,gate,up,down or all (default)")
    p.add_argument("--seed", type=number(int, 0, what="an integer >= 0"), default=0)
    return p


def main(argv: list[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """The command on `argv` (the words after `fuel train`); 0, or 2 after a one-line error."""
    from fuel.cli import error_line

    out, err = out or sys.stdout, err or sys.stderr
    args = parser().parse_args(sys.argv[2:] if argv is None else argv)
    try:
        return run(args, out, err)
    except FuelError as e:
        err.write(error_line(e))
        return 2


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    examples = INSTRUCTIONS if args.data is None else read_examples(args.data)
    config = LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=args.dropout,
                        target_modules=target_names(t.strip() for t in args.targets.split(",")),
                        base_model_name_or_path=args.model)
    model, tok = load_model(args.model, args.seq_len, quant=args.quant)
    ids, targets = encode_examples(tok, examples, args.seq_len, tok.eos_id)
    adapter = LoraAdapter.create(model.cfg, config, seed=args.seed)
    adapter.attach(model)
    trainer = LoraTrainer(model, adapter, args.batch, args.lr, args.weight_decay, args.max_grad_norm)
    err.write(f"QLoRA: {len(examples)} examples, {len(adapter.parameters())} adapter tensors "
              f"({sum(a.size for ab in adapter.arrays.values() for a in ab):,} parameters), base {args.quant}\n")
    log = []
    order = batches(len(ids), args.batch, args.seed)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        rows = next(order)
        t0 = time.perf_counter()
        loss = trainer.step(ids[rows], targets[rows])
        dt = time.perf_counter() - t0
        log.append({"step": step, "loss": loss, "seconds": dt})
        out.write(f"step {step}/{args.steps}  loss {loss:.4f}  {ids[rows].size / dt:.0f} tokens/s  "
                  f"{time.perf_counter() - start:.1f} s\n")
        out.flush()
    d = adapter.save(args.out)
    summary = {k: v for k, v in vars(args).items() if k != "lora"}
    (Path(d) / "train_log.json").write_text(json.dumps({"args": summary, "steps": log}, indent=2) + "\n",
                                            encoding="utf-8")
    out.write(f"saved the adapter to {d}\n")
    return 0
