"""Gated linear units, in the ways people write them, replaced by xkern's swiglu / geglu kernels.

Spellings: jax.nn.silu(a) * b (a * jax.nn.sigmoid(a) * b is the same program once silu's jit
wrapper is inlined, so one pattern finds both); jax.nn.gelu(a, approximate=True / False) * b; each
also with gate and up from one projection, jnp.split(x, 2, axis=-1); each also computed in float32
on half-precision inputs and cast back to the input dtype, which is exactly what the kernels do
(float32 math, one rounding at the end). Declined where an input comes straight from a convert or
a broadcast (an upcast whose float32 result is kept, an up of per-column scales): XLA fuses those
without writing them, and the kernel would have to read them written out in full.

The kernels compute in float32 where a half-precision program rounds after each operation (and
with gelu's constants rounded to bfloat16): the replacement is the more accurate of the two, within
the dtype's tolerance of the original.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from xkern.jaxpr_passes.patterns import Pattern
from xkern.kernels import glu as kernels

ALL = (jnp.float32, jnp.bfloat16, jnp.float16)
HALF = (jnp.bfloat16, jnp.float16)


def silu_times(a, b):
    return jax.nn.silu(a) * b


def gelu_tanh_times(a, b):
    return jax.nn.gelu(a, approximate=True) * b


def gelu_erf_times(a, b):
    return jax.nn.gelu(a, approximate=False) * b


def upcast(fn):
    """fn in float32 on half-precision gate and up, cast back to the gate's dtype."""
    def pattern(a, b):
        return fn(a.astype(jnp.float32), b.astype(jnp.float32)).astype(a.dtype)
    pattern.__name__ = f"{fn.__name__}_upcast"
    return pattern


def split(fn):
    """fn of the two halves of one projection's last axis."""
    def pattern(x):
        gate, up = jnp.split(x, 2, axis=-1)
        return fn(gate, up)
    pattern.__name__ = f"split_{fn.__name__}"
    return pattern


REPLACEMENTS = {  # activation -> the op's name and its replacement (a, b or None, backend)
    "silu": ("swiglu", lambda a, b, backend: kernels.swiglu(a, b, backend=backend)),
    "gelu_tanh": ("geglu", lambda a, b, backend: kernels.geglu(a, b, approximate=True, backend=backend)),
    "gelu_erf": ("geglu", lambda a, b, backend: kernels.geglu(a, b, approximate=False, backend=backend)),
}


FUSED_PRODUCERS = frozenset({"convert_element_type", "broadcast_in_dim"})


def _fused_producer(match) -> str | None:
    """The converting or broadcasting equation that produces an input, if any: XLA fuses it into
    its own elementwise fusion and never writes its result, which the kernel would have to read in
    full (an upcast whose float32 result is kept; an up of per-column scales broadcast to rows)."""
    for v in match.inputs:
        producer = match.graph.producer.get(v)
        if producer is not None and match.graph.eqns[producer[0]].primitive.name in FUSED_PRODUCERS:
            return match.graph.eqns[producer[0]].primitive.name
    return None


def _check(match, params) -> str | None:
    avals = match.input_avals
    if avals[0].dtype not in ALL:
        return f"dtype {avals[0].dtype}: the gated-linear-unit kernels take float32, bfloat16 and float16"
    if any((a.shape, a.dtype) != (avals[0].shape, avals[0].dtype) for a in avals[1:]):
        return "gate and up differ in shape or dtype"
    if not avals[0].ndim:
        return "a scalar gate"
    producer = _fused_producer(match)
    if producer:
        return (f"an input comes from {producer}, which XLA fuses without writing it: the kernel "
                "would read a full-size copy")
    return None


def _pattern(name, fn, activation, dtypes, one_projection):
    op, replace = REPLACEMENTS[activation]
    if one_projection:
        example = lambda dtype: (jax.ShapeDtypeStruct((4, 16), dtype),)
        replacement = lambda x, *, backend: replace(x, None, backend)
    else:
        example = lambda dtype: (jax.ShapeDtypeStruct((4, 8), dtype),) * 2
        replacement = lambda a, b, *, backend: replace(a, b, backend)
    # (two projections split along their features too, as tensor parallelism shards them: kernels/glu._split)
    split_dims = None if one_projection else (lambda i, ndim, params: {0, ndim - 1})
    return Pattern(name=name, op=op, fn=fn, example=example, dtypes=dtypes,
                   params_of=lambda match: {}, check=_check, replace=replacement, split_dims=split_dims)


def _patterns():
    spellings = [("swiglu/silu(a)*b", silu_times, "silu"),
                 ("geglu/gelu_tanh(a)*b", gelu_tanh_times, "gelu_tanh"),
                 ("geglu/gelu_erf(a)*b", gelu_erf_times, "gelu_erf")]
    out = []
    for name, fn, activation in spellings:
        op, what = name.split("/")
        out += [_pattern(name, fn, activation, ALL, False),
                _pattern(f"{name}+upcast", upcast(fn), activation, HALF, False),
                _pattern(f"{op}/split:{what}", split(fn), activation, ALL, True),
                _pattern(f"{op}/split:{what}+upcast", split(upcast(fn)), activation, HALF, True)]
    return out


PATTERNS = _patterns()
