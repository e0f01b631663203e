"""Optimizers whose update runs inside the captured training step: `SGD`, `AdamW`, global-norm clipping,
LR schedules and `opt.compile(loss_fn)`, one `fl.jit` replay per step. Semantics are torch.optim's."""

from fuel.optim import schedule
from fuel.optim.adamw import AdamW
from fuel.optim.clip import clip_grad_norm
from fuel.optim.optimizer import Optimizer, TrainStep
from fuel.optim.schedule import constant, cosine, linear_warmup
from fuel.optim.sgd import SGD

__all__ = ["SGD", "AdamW", "Optimizer", "TrainStep", "clip_grad_norm", "constant", "cosine", "linear_warmup",
           "schedule"]
