"""Test helpers shared by the suite, `fuel verify` and the benchmarks (no torch here)."""
