"""Launch configs per backend, device timing, and (later) the autotuner with its persistent cache."""
