"""Real models built from fuel.ops: llama-family LLMs from GGUF files and a BERT sentence embedder."""
