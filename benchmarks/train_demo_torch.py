"""The `make train-demo` reference: the same run as `fuel train` in torch, to state the corpus's own target.

nanoGPT's val loss 1.88 is for character-level Shakespeare; the demo trains on another corpus (the
pydoc-topics text Python ships, `fuel.train.data`), so its target is what torch reaches on it with the same
everything: transformers' `LlamaForCausalLM` from the same initial weights (fuel.nn.Llama's seeded init,
copied), torch.optim.AdamW with the same betas, eps, weight decay and schedule (LambdaLR over
`fuel.optim.schedule.cosine`'s values), clipping by `clip_grad_norm_`, the same batches from the same sampler,
and the same fixed evaluation batches. It prints the final train and val losses and the wall time, for torch
eager and (with --compile) torch.compile.

    python -m benchmarks.train_demo_torch [--steps 2000] [--compile] [--threads 2] [--out bench-results]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from fuel.train.config import TrainConfig
from fuel.train.loop import Trainer


def run(cfg: TrainConfig, compile_model: bool) -> dict[str, Any]:
    t = Trainer(cfg, Path("/tmp/fuel-train-demo-torch-ref"), progress=False)  # the data, init and eval sets only
    hf = t.model.cfg.to_hf()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf))
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in t.state().items()})
    sched = t.opt.schedule
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                            weight_decay=cfg.weight_decay)
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: sched(e + 1) / cfg.lr)
    fwd = torch.compile(model) if compile_model else model

    def loss_of(x: np.ndarray, y: np.ndarray) -> torch.Tensor:
        logits = fwd(torch.from_numpy(x)).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(y).reshape(-1))

    def evaluate() -> dict[str, float]:
        with torch.no_grad():
            return {n: float(np.mean([loss_of(x, y).item() for x, y in bs])) for n, bs in t.eval_sets.items()}

    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        x, y = t.batches.next()
        loss = loss_of(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        lam.step()
        if step % cfg.eval_interval == 0 or step == cfg.steps:
            print(f"torch{' compile' if compile_model else ''} step {step}: {evaluate()}", flush=True)
    seconds = time.perf_counter() - start
    return {"engine": "torch.compile" if compile_model else "torch eager", "seconds": round(seconds, 1),
            "tokens_per_s": round(cfg.steps * cfg.batch_size * cfg.block_size / seconds, 1), **evaluate()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=TrainConfig().steps)
    ap.add_argument("--compile", action="store_true", help="also run torch.compile")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench-results")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = TrainConfig(steps=a.steps, export=())
    results = [run(cfg, False)] + ([run(cfg, True)] if a.compile else [])
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "train_demo_torch.json").write_text(json.dumps(results, indent=1))
    for r in results:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
