"""`fuel train`: training a small Llama end to end (data, config, the captured step, evaluation, checkpoints and
resume, the log and plot, GGUF export). `fuel.train.loop` describes a run; `fuel.train.cli` the command."""

from fuel.train.config import TrainConfig

__all__ = ["TrainConfig"]
