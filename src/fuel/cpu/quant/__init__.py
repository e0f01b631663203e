"""Quantized weights: QMatMul over the GGUF block types and Nf4Matmul, with the decoders and weight tiles they share."""
