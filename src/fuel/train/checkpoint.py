"""Checkpoints of a `fuel train` run: a folder of two safetensors files.

- `model.safetensors`: the model's state dict under transformers' `LlamaForCausalLM` names, so the file
  loads in transformers as well as in `fuel.nn` (`fuel.nn.state.safe_load`);
- `optimizer.safetensors`: the optimizer's `state_dict()` (its step count and moment arrays); its metadata
  holds the rest of the run's state as JSON strings: the step, the data sampler's generator state and the
  run's config.

Loading all of it back into a model, an optimizer and a sampler built from the same config continues the
run bit for bit: the parameters, the moments, the step count (so the learning rate and bias corrections)
and the next batch are exactly those the uninterrupted run would have had. A checkpoint is written into a
temporary folder renamed into place, so an interrupted write never leaves a half checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fuel.errors import FuelError

FORMAT = "fuel-train/1"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"


class CheckpointError(FuelError, ValueError):
    """A checkpoint folder that is missing, incomplete or not written by `fuel train`."""


@dataclass
class Checkpoint:
    model: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    step: int
    data_rng: dict[str, Any]
    config: dict[str, Any]


def save(path: str | os.PathLike[str], model_state: dict[str, Any], optim_state: dict[str, Any], step: int,
         data_rng: dict[str, Any], config: dict[str, Any]) -> Path:
    """Write a checkpoint folder at `path` (replacing one there) and return its path."""
    from fuel.nn.state import safe_save

    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    safe_save(model_state, tmp / MODEL_FILE, metadata={"format": FORMAT})
    # safetensors reads a 0-d array back as [1]: the names of the 0-d ones (the step count) are kept to undo it
    scalars = [k for k, v in optim_state.items() if np.ndim(v) == 0]
    meta = {"format": FORMAT, "step": str(step), "data_rng": json.dumps(data_rng), "config": json.dumps(config),
            "scalars": json.dumps(scalars)}
    safe_save({k: np.ascontiguousarray(v) for k, v in optim_state.items()}, tmp / OPTIM_FILE, metadata=meta)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def load(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint folder written by `save`."""
    from safetensors import SafetensorError, safe_open

    from fuel.nn.state import safe_load

    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"train: --resume {p}: no such checkpoint folder")
    for name in (MODEL_FILE, OPTIM_FILE):
        if not (p / name).is_file():
            raise CheckpointError(f"train: --resume {p}: the checkpoint has no {name}")
    try:
        with safe_open(str(p / OPTIM_FILE), "np") as fh:
            meta = fh.metadata() or {}
        model, optim = safe_load(p / MODEL_FILE), safe_load(p / OPTIM_FILE)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"train: --resume {p}: unreadable safetensors ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"train: --resume {p}: not a fuel train checkpoint (format {meta.get('format')!r}, "
                              f"expected {FORMAT!r})")
    try:
        step, rng, config = int(meta["step"]), json.loads(meta["data_rng"]), json.loads(meta["config"])
        for k in json.loads(meta["scalars"]):
            optim[k] = optim[k].reshape(())
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"train: --resume {p}: its metadata is incomplete ({e})") from None
    return Checkpoint(model, optim, step, rng, config)


def latest(run_dir: str | os.PathLike[str]) -> Path | None:
    """The checkpoint of the highest step in a run folder (`checkpoints/step-NNNNNN`), or None."""
    folder = Path(run_dir) / "checkpoints"
    found = sorted(folder.glob("step-*[0-9]")) if folder.is_dir() else []
    return found[-1] if found else None
