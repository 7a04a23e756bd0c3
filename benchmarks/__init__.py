"""The benchmark suite: xkern against jax.jit, by the timing method of shared/GPU.md."""
