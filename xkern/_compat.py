"""Every import of `jax._src` and every version shim, in one place.

jax's public API covers most of what xkern needs; what it lacks is imported here, so that a jax
upgrade that moves something breaks this file alone.
"""
from jax._src import source_info_util as _source_info
from jax._src.dispatch import apply_primitive  # eager evaluation of a primitive
from jax._src.interpreters.partial_eval import dce_jaxpr  # dead-code elimination of a Jaxpr


def user_context(source_info):
    """A context in which new equations get `source_info` (the user's line), not the interpreter's."""
    return _source_info.user_context(source_info.traceback, name_stack=source_info.name_stack)


def summarize_source(source_info) -> str:
    """'file.py:12:4 (fn)' for the user frame an equation came from."""
    return _source_info.summarize(source_info)


__all__ = ["apply_primitive", "dce_jaxpr", "user_context", "summarize_source"]
