"""Memory planning: live ranges, in-place kernels, peak estimates (liveness.py)."""
