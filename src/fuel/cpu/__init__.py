"""The CPU backend's kernels, one package or module per op family.

Each fused entry's kernel module carries the entry's registry name (`flash_attn`, `qmatmul`, `rope`, ...)
and defines `register(registry)`; `fuel.dispatch.discovery` finds it. Families:
- `attention`: FlashAttn, its backward, its decode path and PagedAttn;
- `norms`: RmsNorm, LayerNorm, Softmax over the last axis and their backwards;
- `conv`: Conv2D, ConvTranspose2D and CausalConv1d;
- `scans`: SelectiveScan and SsdChunkScan;
- `quant`: QMatMul (GGUF block types) and Nf4Matmul, with their shared weight tiles;
- `prims`: the primitive ops' kernels;
- `simd`: the low-level helpers every family uses (16-lane vectors, half types, BLAS from jitted code).
Kernels are written as work over a part of their rows; `fuel.runtime` decides how they run.
"""
