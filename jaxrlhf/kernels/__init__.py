"""Hand-written XLA FFI kernels where XLA's own code is measurably slow (CPU decode matmuls)."""
