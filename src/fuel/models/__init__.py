"""Real models built from fuel.ops: decoder LLMs of every architecture in `architectures` and Mamba-1 LMs, from
GGUF files or Hugging Face directories, a BERT sentence embedder, and Mamba's mixers.

Each model module is imported on first use (`fuel.models.bert`), so importing the package loads none
of them and none of what they need (tokenizers, jinja2, safetensors).
"""

from __future__ import annotations

import importlib
import types
import typing

if typing.TYPE_CHECKING:
    from fuel.models import architectures as architectures
    from fuel.models import bert as bert
    from fuel.models import catalog as catalog
    from fuel.models import chat_template as chat_template
    from fuel.models import decoder_layer as decoder_layer
    from fuel.models import generate as generate
    from fuel.models import generate_args as generate_args
    from fuel.models import generate_cli as generate_cli
    from fuel.models import kv_sequence as kv_sequence
    from fuel.models import llama as llama
    from fuel.models import llama_weights as llama_weights
    from fuel.models import mamba as mamba
    from fuel.models import mamba_lm as mamba_lm
    from fuel.models import sampling as sampling
    from fuel.models import sequence_pool as sequence_pool
    from fuel.models import tokenizer as tokenizer
    from fuel.models import tokenizer_hf as tokenizer_hf

MODULES = ("architectures", "bert", "catalog", "chat_template", "decoder_layer", "generate", "generate_args",
           "generate_cli", "kv_sequence", "llama", "llama_weights", "mamba", "mamba_lm", "sampling", "sequence_pool",
           "tokenizer", "tokenizer_hf")


def __getattr__(name: str) -> types.ModuleType:
    if name in MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *MODULES])
