"""Softmax and log-softmax, in the ways people write them, replaced by xkern.ops (log_)softmax.

Variants: jax.nn's functions (a softmax written by hand with the max subtracted is spelled as
jax.nn.softmax by canonicalize), and without the max subtracted (the kernel subtracts the max
anyway, so it agrees wherever the original does not overflow); log-softmax written by hand, through
logsumexp; each also on a half-precision input upcast to float32, with or without a cast back (the
kernels compute in float32 and read the half-precision input directly: no float32 copy).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from xkern.jaxpr_passes.patterns import Pattern
from xkern.kernels import softmax as kernels

ALL = (jnp.float32, jnp.bfloat16, jnp.float16)
HALF = (jnp.bfloat16, jnp.float16)


def softmax_jax_nn(x, axis):
    return jax.nn.softmax(x, axis=axis)


def softmax_unshifted(x, axis):
    e = jnp.exp(x)
    return e / jnp.sum(e, axis=axis, keepdims=True)


def log_softmax_jax_nn(x, axis):
    return jax.nn.log_softmax(x, axis=axis)


def log_softmax_shifted(x, axis):
    shifted = x - jnp.max(x, axis=axis, keepdims=True)
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True))


def log_softmax_logsumexp(x, axis):
    return x - jax.nn.logsumexp(x, axis=axis, keepdims=True)


def upcast(fn, cast_back: bool = True):
    """fn computed in float32 on a half-precision input, then (or not) cast back."""
    def pattern(x, axis):
        y = fn(x.astype(jnp.float32), axis)
        return y.astype(x.dtype) if cast_back else y
    pattern.__name__ = f"{fn.__name__}_upcast{'_cast_back' if cast_back else ''}"
    return pattern


def _axis(match) -> dict:
    first_reduce = next(e for e in (match.graph.eqns[i] for i in sorted(match.program_eqns))
                        if e.primitive.name in ("reduce_max", "reduce_sum"))
    return {"axis": tuple(first_reduce.params["axes"])}


def _check_dtype(match, params) -> str | None:
    dtype = match.input_avals[0].dtype
    if dtype not in ALL:
        return f"dtype {dtype}: the softmax kernels take float32, bfloat16 and float16"
    return None


def _split_dims(i: int, ndim: int, params: dict) -> list:
    """Pattern.split_dims: the kernels split any of the rows' dims (kernels/softmax's views keep them:
    launch.with_row_dims), never the softmax axes (a sharded row is left to XLA where constrained or
    typed so)."""
    axes = {a % ndim for a in params["axis"]}
    return {d for d in range(ndim) if d not in axes}


def _pattern(name, op, fn, dtypes, out_dtype=None):
    replace = kernels.log_softmax if op == "log_softmax" else kernels.softmax
    return Pattern(
        name=name, op=op, fn=fn, dtypes=dtypes,
        example=lambda dtype: (jax.ShapeDtypeStruct((4, 8), dtype),),
        example_params={"axis": -1}, params_of=_axis, check=_check_dtype, split_dims=_split_dims,
        replace=lambda x, *, backend, axis: replace(x, axis=axis, out_dtype=out_dtype,
                                                    backend=backend))


PATTERNS = [
    _pattern("softmax/jax.nn.softmax", "softmax", softmax_jax_nn, ALL),
    _pattern("softmax/exp(x)/sum", "softmax", softmax_unshifted, ALL),
    _pattern("softmax/jax.nn.softmax+upcast", "softmax", upcast(softmax_jax_nn), HALF),
    _pattern("softmax/jax.nn.softmax(float32)", "softmax", upcast(softmax_jax_nn, False), HALF,
             jnp.float32),
    _pattern("log_softmax/jax.nn.log_softmax", "log_softmax", log_softmax_jax_nn, ALL),
    _pattern("log_softmax/x-max-log(sum)", "log_softmax", log_softmax_shifted, ALL),
    _pattern("log_softmax/x-logsumexp", "log_softmax", log_softmax_logsumexp, ALL),
    _pattern("log_softmax/jax.nn.log_softmax+upcast", "log_softmax", upcast(log_softmax_jax_nn), HALF),
    _pattern("log_softmax/x-max-log(sum)+upcast", "log_softmax", upcast(log_softmax_shifted), HALF),
    _pattern("log_softmax/jax.nn.log_softmax(float32)", "log_softmax",
             upcast(log_softmax_jax_nn, False), HALF, jnp.float32),
    _pattern("log_softmax/x-max-log(sum)(float32)", "log_softmax",
             upcast(log_softmax_shifted, False), HALF, jnp.float32),
]
