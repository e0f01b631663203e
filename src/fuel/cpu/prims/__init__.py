"""Kernels of the primitive ops: the NumPy table, their replay tasks, and the few Numba passes (erf, logistic, gemv)."""
