"""CPU kernels: NumPy for primitives and glue, Numba for fused row-wise loops."""
