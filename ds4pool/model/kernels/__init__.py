"""Device kernels behind the attention backends.

Nothing here is imported by the rest of ds4pool at module level: `triton_attention` imports
triton, which only CUDA machines (or the Triton interpreter in tests) have.
"""
