"""What a `fuel train` run records: `log.json` (the config, every step's loss and learning rate, every
evaluation) and `loss.png` (the training loss per step and the held-out loss at each evaluation, drawn with
matplotlib's Agg backend, so no display is needed)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunLog:
    config: dict[str, Any]
    train: list[dict[str, float]] = field(default_factory=list)
    eval: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0  # training time over all sessions of the run (evaluations and checkpoints included)

    @classmethod
    def resume(cls, path: Path, config: dict[str, Any], step: int) -> RunLog:
        """The log at `path` up to `step` (the records a resumed run will write again are dropped), or a new
        one if there is none."""
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            return cls(config, [r for r in d["train"] if r["step"] <= step],
                       [r for r in d["eval"] if r["step"] <= step], float(d.get("seconds", 0.0)))
        except (OSError, ValueError, KeyError, TypeError):
            return cls(config)

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"config": self.config, "seconds": round(self.seconds, 3), "train": self.train,
                                   "eval": self.eval}, indent=1), encoding="utf-8")
        os.replace(tmp, path)

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
        if self.train:
            ax.plot([r["step"] for r in self.train], [r["loss"] for r in self.train], lw=0.7, alpha=0.6,
                    label="train (batch)")
        if self.eval:
            steps = [r["step"] for r in self.eval]
            ax.plot(steps, [r["train_loss"] for r in self.eval], "o-", ms=3, label="train (eval)")
            ax.plot(steps, [r["val_loss"] for r in self.eval], "o-", ms=3, label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(f"fuel train: {self.config.get('data')}, {self.config.get('n_layers')} layers, "
                     f"dim {self.config.get('dim')}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
