"""Tools the tests and benchmarks share: compile-and-inspect checks of the kernels (ptx)."""
