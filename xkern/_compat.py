"""Every import of `jax._src` and every version shim, in one place.

jax's public API covers nearly all xkern needs; what it lacks is imported here, so that a jax upgrade
that moves something breaks this file alone.
"""
from jax._src.dispatch import apply_primitive  # noqa: F401  (eager evaluation of a primitive)

__all__ = ["apply_primitive"]
