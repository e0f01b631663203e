"""RmsNorm, LayerNorm and Softmax over the last axis, and their backwards."""
