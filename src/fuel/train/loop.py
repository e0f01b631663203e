"""The training run of `fuel train`: a `fuel.nn.Llama`, AdamW with a warmup + cosine schedule and gradient
clipping, one captured step per batch (`opt.compile(model.loss)`: forward, backward and update in one
`fl.jit` replay), periodic evaluation, checkpoints, the log and plot, and the GGUF exports.

Layout of a run folder `OUT`:
    OUT/log.json  OUT/loss.png              the run's records (`fuel.train.report`)
    OUT/checkpoints/step-NNNNNN/            every `checkpoint_interval` steps and at the end
    OUT/model-f32.gguf  OUT/model-q8_0.gguf the exports (`fuel generate --model OUT/model-f32.gguf`)

**Evaluation** is nanoGPT's estimate_loss with fixed batches: `eval_iters` batches of the held-out split and as
many of the training split, drawn once from their own seeds, so every evaluation of a run (and of a resumed
run) reads the same tokens and the curve compares like with like. Its loss is an `fl.jit` of `model.loss`,
the forward alone, with no update.

**Resume** (`train(..., resume=CHECKPOINT)`) loads the model, the optimizer (its moments and step count, so the
schedule's position) and the data sampler's state, and continues: the steps after it are those the
uninterrupted run would have taken, bit for bit.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from fuel.errors import ParamError
from fuel.train import checkpoint as ckpt
from fuel.train.config import TrainConfig
from fuel.train.data import Batches, load_tokens, split, tokenizer
from fuel.train.report import RunLog

# What a resumed run may change: how long it runs and what it writes, never the model, data or optimizer.
RESUMABLE = ("steps", "eval_interval", "eval_iters", "checkpoint_interval", "export")


@dataclass
class Result:
    out: Path
    step: int
    train_loss: float | None = None
    val_loss: float | None = None
    seconds: float = 0.0
    exports: list[Path] = field(default_factory=list)


def model_hparams(cfg: TrainConfig, vocab: int) -> dict[str, Any]:
    return {"dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.kv_heads,
            "hidden_dim": cfg.hidden_dim, "vocab_size": vocab, "context_length": cfg.context_length,
            "rope_theta": cfg.rope_theta, "norm_eps": cfg.norm_eps}


def build_model(cfg: TrainConfig, vocab: int) -> Any:
    from fuel.nn.llama import Llama, LlamaConfig

    lc = LlamaConfig(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads,
                     vocab_size=vocab, hidden_dim=cfg.hidden_dim, max_seq_len=cfg.block_size,
                     rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps)
    return Llama(lc, seed=cfg.seed)


def build_optimizer(cfg: TrainConfig, model: Any) -> Any:
    from fuel.nn.state import get_parameters
    from fuel.optim import AdamW
    from fuel.optim.schedule import cosine

    sched = cosine(cfg.lr, cfg.steps, warmup_steps=cfg.warmup, min_lr=cfg.min_lr)
    return AdamW(get_parameters(model), lr=sched, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                 weight_decay=cfg.weight_decay, max_grad_norm=cfg.grad_clip or None)


def resumed_config(saved: dict[str, Any], changes: dict[str, Any]) -> TrainConfig:
    """The config of a resumed run: the checkpoint's, with only the `RESUMABLE` keys changed."""
    from fuel.train.config import from_mapping

    base = from_mapping(saved, "the checkpoint's config")
    fixed = [k for k, v in changes.items() if k not in RESUMABLE and v != base.to_dict()[k]]
    if fixed:
        raise ParamError(f"train: --resume keeps the checkpoint's model, data and optimizer settings; "
                         f"{', '.join(fixed)} cannot change (only {', '.join(RESUMABLE)} can)")
    return base.replace(**changes)


class Trainer:
    """A run (module doc). `run()` trains to `cfg.steps` and returns the `Result`."""

    def __init__(self, cfg: TrainConfig, out: str | Path, resume: ckpt.Checkpoint | None = None,
                 progress: bool = True, echo: Callable[[str], None] | None = None,
                 stream: TextIO | None = None) -> None:
        from fuel.nn.state import load_state_dict

        self.cfg, self.out, self.progress = cfg, Path(out), progress
        self.stream = stream or sys.stderr
        self.echo = echo or (lambda line: print(line, flush=True))
        self.tok = tokenizer(cfg.tokenizer)
        ids = load_tokens(cfg.data, self.tok)
        train_ids, val_ids = split(ids, cfg.val_fraction, cfg.block_size)
        self.vocab = self.tok.vocab_size
        self.model = build_model(cfg, self.vocab)
        self.opt = build_optimizer(cfg, self.model)
        self.batches = Batches(train_ids, cfg.batch_size, cfg.block_size, cfg.seed)
        self.eval_sets = {name: [b.next() for _ in range(cfg.eval_iters)] for name, b in (
            ("train_loss", Batches(train_ids, cfg.batch_size, cfg.block_size, cfg.seed + 1)),
            ("val_loss", Batches(val_ids, cfg.batch_size, cfg.block_size, cfg.seed + 2)))}
        self.step = 0
        self.bar: Any = None
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = RunLog(cfg.to_dict())
        if resume is not None:
            load_state_dict(self.model, resume.model)
            self.opt.load_state_dict(resume.optimizer)
            self.batches.set_state(resume.data_rng)
            self.step = resume.step
            self.log = RunLog.resume(self.out / "log.json", cfg.to_dict(), resume.step)
        if self.step > cfg.steps:
            raise ParamError(f"train: the checkpoint is at step {self.step}, past steps = {cfg.steps}")
        import fuel as fl

        self.train_step = self.opt.compile(self.model.loss)
        self.eval_loss = fl.jit(self.model.loss)

    def evaluate(self) -> dict[str, float]:
        return {name: float(np.mean([float(self.eval_loss(x, y).numpy()) for x, y in batches]))
                for name, batches in self.eval_sets.items()}

    def state(self) -> dict[str, np.ndarray]:
        from fuel.nn.state import get_state_dict

        return {k: v.numpy() for k, v in get_state_dict(self.model).items()}

    def save_checkpoint(self) -> Path:
        return ckpt.save(self.out / "checkpoints" / f"step-{self.step:06d}", self.state(), self.opt.state_dict(),
                         self.step, self.batches.state(), self.cfg.to_dict())

    def _record_eval(self) -> dict[str, float]:
        losses = self.evaluate()
        self.log.eval.append({"step": self.step, **{k: round(v, 6) for k, v in losses.items()}})
        line = f"step {self.step}: train loss {losses['train_loss']:.4f}, val loss {losses['val_loss']:.4f}"
        if self.bar is not None:  # the line goes above the bar, which is drawn again below it
            self.bar.clear()
        self.echo(line)
        if self.bar is not None:
            self.bar.refresh()
        return losses

    def run(self) -> Result:
        cfg = self.cfg
        started = time.perf_counter()
        before = self.log.seconds
        tokens_per_step = cfg.batch_size * cfg.block_size
        self.bar = bar = self._bar()
        last: dict[str, float] = {}
        if self.step == 0 and not self.log.eval:
            last = self._record_eval()
        window: deque[float] = deque(maxlen=20)  # recent step times, for tokens/s
        while self.step < cfg.steps:
            x, y = self.batches.next()
            t0 = time.perf_counter()
            loss = self.train_step(x, y)
            dt = time.perf_counter() - t0
            self.step += 1
            if self.step > 1 or self.log.train:  # the first call of a process traces and plans: not a speed
                window.append(dt)
            rate = tokens_per_step * len(window) / sum(window) if window else 0.0
            self.log.train.append({"step": self.step, "loss": round(loss, 6), "lr": self.opt.lr,
                                   "tokens_per_s": round(rate, 1)})
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:,.0f}", refresh=False)
                bar.update(1)
            if not np.isfinite(loss):
                raise ParamError(f"train: the loss is {loss} at step {self.step}; lower lr (now {cfg.lr})")
            done = self.step == cfg.steps
            if self.step % cfg.eval_interval == 0 or done:
                last = self._record_eval()
            if self.step % cfg.checkpoint_interval == 0 or done:
                self.save_checkpoint()
                self.log.seconds = before + time.perf_counter() - started
                self.log.save(self.out / "log.json")
        if bar is not None:
            bar.close()
            self.bar = None
        self.log.seconds = before + time.perf_counter() - started
        self.log.save(self.out / "log.json")
        self.log.plot(self.out / "loss.png")
        result = Result(self.out, self.step, last.get("train_loss"), last.get("val_loss"), self.log.seconds)
        result.exports = self.export()
        return result

    def export(self) -> list[Path]:
        from fuel.train.export import export_gguf

        paths = []
        for qtype in self.cfg.export:
            path = self.out / f"model-{qtype}.gguf"
            export_gguf(self.state(), model_hparams(self.cfg, self.vocab), self.cfg.tokenizer, path, qtype)
            paths.append(path)
        return paths

    def _bar(self) -> Any:
        if not self.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.steps, initial=self.step, file=self.stream, unit="step", dynamic_ncols=True,
                    desc="fuel train", smoothing=0.1)
