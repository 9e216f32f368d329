"""Float64 NumPy references of shared/SPEC_LOSSES.md, written independently of the JAX code."""
