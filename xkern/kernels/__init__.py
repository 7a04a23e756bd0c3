"""Triton kernels, one file per op family; `launch` is the one way any of them runs from JAX."""
from xkern.kernels import launch  # noqa: F401  (first: it fixes Triton's compile/interpret mode)
