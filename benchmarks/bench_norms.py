"""xkern.ops.layer_norm / rms_norm against the same math under jax.jit.

Forward: reads x, writes y (2 tensors). Forward+backward is the input gradient's program (reads x
and dy, writes dx: 3 tensors, as shared/GPU.md counts XLA's); "+ scale/bias grads" also returns
dscale and dbias (same minimum bytes: they are vectors).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import xkern
from benchmarks.harness import Case
from xkern.kernels.norms import reference


def cases(on_gpu: bool) -> list[Case]:
    rows, cols = (16384, 8192) if on_gpu else (64, 300)
    n = rows * cols * 2

    def make(key):
        kx, ks, kb, kd = jax.random.split(key, 4)
        return (jax.random.normal(kx, (rows, cols), jnp.bfloat16),
                1 + 0.1 * jax.random.normal(ks, (cols,), jnp.float32),
                0.1 * jax.random.normal(kb, (cols,), jnp.float32),
                jax.random.normal(kd, (rows, cols), jnp.bfloat16))

    out = []
    for name, rms in (("layer_norm", False), ("rms_norm", True)):
        ours = (lambda x, s, b: xkern.ops.rms_norm(x, s)) if rms else xkern.ops.layer_norm
        ref = lambda x, s, b, rms=rms: reference(x, s, None if rms else b, 1e-6, None, rms)
        fwd = lambda f: (lambda x, s, b, dy: f(x, s, b))
        dx = lambda f: (lambda x, s, b, dy: jax.vjp(lambda x: f(x, s, b), x)[1](dy)[0])
        every = lambda f: (lambda x, s, b, dy: jax.vjp(f, x, s, b)[1](dy)[:2 if rms else 3])
        out.append(Case(name, (rows, cols), "bfloat16", "fwd", fwd(ours), fwd(ref), make, 2 * n, 2e-2))
        out.append(Case(name, (rows, cols), "bfloat16", "fwd+bwd", dx(ours), dx(ref), make, 3 * n, 3e-2))
        out.append(Case(f"{name} + scale/bias grads", (rows, cols), "bfloat16", "fwd+bwd", every(ours),
                        every(ref), make, 3 * n, 3e-2))
        out += _residual_cases(name, rms, rows, cols)
    return out


def _residual_cases(name: str, rms: bool, rows: int, cols: int) -> list[Case]:
    """The norm of h = x + r that also returns h (a pre-norm block's residual stream), against the
    add and the norm under jax.jit (which fuses them). Forward: reads x, r, writes y, h (4 tensors);
    forward+backward: the input gradient from cotangents of y and h (reads x, r, dy, dh, writes dx)."""
    n = rows * cols * 2

    def make(key):
        kx, kr, ks, kb, kd = jax.random.split(key, 5)
        return (jax.random.normal(kx, (rows, cols), jnp.bfloat16), jax.random.normal(kr, (rows, cols), jnp.bfloat16),
                1 + 0.1 * jax.random.normal(ks, (cols,), jnp.float32), 0.1 * jax.random.normal(kb, (cols,), jnp.float32),
                jax.random.normal(kd, (rows, cols), jnp.bfloat16))

    def ours(x, r, s, b):
        if rms:
            return xkern.ops.rms_norm(x, s, residual=r)
        return xkern.ops.layer_norm(x, s, b, residual=r)

    ref = lambda x, r, s, b: reference(x, s, None if rms else b, 1e-6, r, rms)
    fwd = lambda f: (lambda x, r, s, b, dy: f(x, r, s, b))
    dx = lambda f: (lambda x, r, s, b, dy: jax.vjp(lambda x, r: f(x, r, s, b), x, r)[1]((dy, dy))[0])

    def kept(f):  # as in training: the forward's y and h are used (by the next layers) too
        def step(x, r, s, b, dy):
            outs, vjp = jax.vjp(lambda x, r: f(x, r, s, b), x, r)
            return outs, vjp((dy, dy))[0]
        return step
    # Alone, "fwd+bwd" lets XLA skip computing y and writing h (nothing reads them), which no real
    # program does; "outputs kept" returns them (8 tensors: x, r, dy, dh read; y, h, dx written, and
    # h read back or x, r re-read).
    return [Case(f"{name} + residual add", (rows, cols), "bfloat16", "fwd", fwd(ours), fwd(ref), make, 4 * n, 2e-2),
            Case(f"{name} + residual add", (rows, cols), "bfloat16", "fwd+bwd", dx(ours), dx(ref), make, 5 * n, 3e-2),
            Case(f"{name} + residual add, outputs kept", (rows, cols), "bfloat16", "fwd+bwd", kept(ours), kept(ref),
                 make, 7 * n, 3e-2)]
