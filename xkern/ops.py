"""The public ops: each runs xkern's Triton kernels (or, with backend="xla", its jax.numpy definition)."""
from xkern.kernels.softmax import softmax

__all__ = ["softmax"]
