"""QLoRA: LoRA adapters trained over a frozen quantized Llama-family model (GGUF blocks through QMatMul, or
NF4 through Nf4Matmul), saved and loaded in PEFT's format; `fuel train --lora` runs `fuel.lora.cli.main`."""

from fuel.lora.adapter import ALL_TARGETS, AdapterError, LoraAdapter, LoraConfig, peft_key
from fuel.lora.model import IGNORE_INDEX, causal_loss, embed_batch, load_model, requantize_nf4

__all__ = ["ALL_TARGETS", "IGNORE_INDEX", "AdapterError", "LoraAdapter", "LoraConfig", "causal_loss", "embed_batch",
           "load_model", "peft_key", "requantize_nf4"]
