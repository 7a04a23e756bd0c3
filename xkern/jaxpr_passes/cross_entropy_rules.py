"""Softmax cross-entropy with integer labels over the last axis, in the ways people write it,
replaced by xkern.ops.cross_entropy(reduction="none") (a float32 loss per row; cast back to the
program's dtype where the program computed in half precision).

Spellings: optax.softmax_cross_entropy_with_integer_labels (traced from the installed optax, when
there is one); logsumexp minus the label's logit through take_along_axis; minus the label's entry
of log_softmax (or that entry kept as [..., 1], negated after a mean); each also on half-precision
logits upcast to float32. Like take_along_axis, the
replacement counts negative labels from the end; labels still out of range give NaN, as the
program's gather does.
"""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from xkern.jaxpr_passes.patterns import Pattern
from xkern.kernels import cross_entropy as kernels

ALL = (jnp.float32, jnp.bfloat16, jnp.float16)
HALF = (jnp.bfloat16, jnp.float16)


def logsumexp_minus_label(logits, labels):
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def minus_log_softmax_at_label(logits, labels):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None], axis=-1)[..., 0]


def log_softmax_at_label(logits, labels):
    """The log-probability of the label, kept as [..., 1] (the loss is its negated mean)."""
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None], axis=-1)


def optax_integer_labels(logits, labels):
    import optax
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def upcast(fn):
    def pattern(logits, labels):
        return fn(logits.astype(jnp.float32), labels)
    pattern.__name__ = f"{fn.__name__}_upcast"
    return pattern


def _replace(logits, labels, *, backend):
    n_cols = logits.shape[-1]
    labels = jnp.where(labels < 0, labels + n_cols, labels)  # take_along_axis's negative indices
    return kernels.cross_entropy(logits, labels, reduction="none", backend=backend)


def _check(match, params) -> str | None:
    logits, labels = match.input_avals
    if logits.dtype not in ALL:
        return f"dtype {logits.dtype}: the cross-entropy kernels take float32, bfloat16 and float16"
    if logits.ndim < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        return "labels are not one per row of logits"
    return None


def _pattern(name, fn, dtypes, cast_to_input: bool, log_probability: bool = False):
    def replace(logits, labels, *, backend):
        loss = _replace(logits, labels, backend=backend)
        if log_probability:
            loss = -loss[..., None]
        return loss.astype(logits.dtype) if cast_to_input else loss
    return Pattern(
        name=name, op="cross_entropy", fn=fn, dtypes=dtypes,
        example=lambda dtype: (jax.ShapeDtypeStruct((4, 8), dtype), jax.ShapeDtypeStruct((4,), jnp.int32)),
        params_of=lambda match: {}, check=_check, replace=replace)


PATTERNS = [
    _pattern("cross_entropy/logsumexp-take_along_axis", logsumexp_minus_label, ALL, True),
    _pattern("cross_entropy/-take_along_axis(log_softmax)", minus_log_softmax_at_label, ALL, True),
    _pattern("cross_entropy/logsumexp-take_along_axis+upcast", upcast(logsumexp_minus_label), HALF, False),
    _pattern("cross_entropy/-take_along_axis(log_softmax)+upcast", upcast(minus_log_softmax_at_label),
             HALF, False),
    _pattern("cross_entropy/take_along_axis(log_softmax)", log_softmax_at_label, ALL, True, True),
    _pattern("cross_entropy/take_along_axis(log_softmax)+upcast", upcast(log_softmax_at_label), HALF,
             False, True),
]
if importlib.util.find_spec("optax") is not None:  # optax is optional: a test dependency
    PATTERNS += [
        _pattern("cross_entropy/optax_integer_labels", optax_integer_labels, ALL, True),
        _pattern("cross_entropy/optax_integer_labels+upcast", upcast(optax_integer_labels), HALF, False),
    ]
