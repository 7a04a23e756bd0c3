"""Softmax benchmark cases: xkern.ops.softmax against jax.nn.softmax under jax.jit."""
from __future__ import annotations

import jax
import jax.numpy as jnp

import xkern
from benchmarks.harness import Case

GPU_SHAPES = [(16384, 8192), (4096, 32768), (512, 131072), (262144, 128), (65536, 1000)]
CPU_SHAPES = [(64, 1000), (8, 4099)]  # the interpreter is slow: the CPU run is a smoke test


def _fwd(softmax):
    return lambda x: softmax(x)


def _fwd_bwd(softmax):
    # The gradient alone, as a training step needs it: reads x and dy, writes dx.
    return lambda x, dy: jax.vjp(softmax, x)[1](dy)[0]


def cases(on_gpu: bool) -> list[Case]:
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    out = _cases(GPU_SHAPES if on_gpu else CPU_SHAPES, dtype, "softmax", xkern.ops.softmax,
                 jax.nn.softmax)
    return out + _cases(GPU_SHAPES[:1] if on_gpu else CPU_SHAPES[:1], dtype, "log_softmax",
                        xkern.ops.log_softmax, jax.nn.log_softmax)


def _cases(shapes, dtype, op, ours, theirs) -> list[Case]:
    out = []
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    for shape in shapes:
        size = shape[0] * shape[1] * jnp.dtype(dtype).itemsize
        out.append(Case(op, shape, jnp.dtype(dtype).name, "fwd", _fwd(ours), _fwd(theirs),
                        lambda key, s=shape: (3 * jax.random.normal(key, s, dtype),),
                        min_bytes=2 * size, tolerance=tolerance))
        out.append(Case(op, shape, jnp.dtype(dtype).name, "fwd+bwd", _fwd_bwd(ours),
                        _fwd_bwd(theirs),
                        lambda key, s=shape: tuple(3 * jax.random.normal(k, s, dtype)
                                                   for k in jax.random.split(key)),
                        min_bytes=3 * size, tolerance=tolerance))
    return out
