"""Low-level building blocks for jitted kernels: 16-lane f32 vectors, 64-byte f32/f64 vectors (vec64),
scalar math LLVM vectorises, bf16/f16 plumbing, AMX tiles and BLAS called from jitted code."""
