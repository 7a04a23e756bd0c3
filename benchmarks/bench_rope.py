"""xkern rope against the same math under jax.jit, both layouts, half-width float32 tables; and
Meta's Llama spelling (pairs as complex numbers times freqs_cis) and HF Flax Llama's (rotate_half)
under xkern.optimize vs jax.jit.

Minimum bytes: the forward reads x and writes y (2 tensors); forward+backward returns y and dx, so
it also reads dy and writes dx (4 tensors). The tables (cos and sin, [seq, head_dim / 2] float32)
are counted once per kernel: 1.6% of the forward's bytes at Llama's shape.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import xkern
from benchmarks.harness import Case
from xkern.jaxpr_passes.rope_rules import complex_form, precision, rotate_half_form
from xkern.kernels.rope import reference, rope


def cases(on_gpu: bool) -> list[Case]:
    batch, seq, heads, head_dim = (4, 4096, 32, 128) if on_gpu else (2, 64, 4, 64)
    shape = (batch, seq, heads, head_dim)
    n = batch * seq * heads * head_dim * 2  # one bf16 tensor
    tables = 2 * seq * (head_dim // 2) * 4

    def make(key):
        kx, ka, kd = jax.random.split(key, 3)
        angles = jax.random.uniform(ka, (seq, head_dim // 2), jnp.float32, -3.14, 3.14)
        return (jax.random.normal(kx, shape, jnp.bfloat16), jnp.cos(angles), jnp.sin(angles),
                jax.random.normal(kd, shape, jnp.bfloat16))

    def metas(x, c, s):  # q upcast, times cos + i sin as complex pairs, cast back
        return precision(complex_form, "upcast")(x, jax.lax.complex(c, s)[None, :, None, :])

    def hf(x, c, s):  # HF Flax Llama's: full-width tables, x * cos + rotate_half(x) * sin, cast back
        full = lambda t: jnp.concatenate([t, t], -1)[None, :, None, :]
        return precision(rotate_half_form, "cast back")(x, full(c), full(s))

    out = []
    for name, interleaved, ours, ref in (
            ("rope", False, lambda x, c, s: rope(x, c, s), lambda x, c, s: reference(x, c, s, False)),
            ("rope interleaved", True, lambda x, c, s: rope(x, c, s, interleaved=True),
             lambda x, c, s: reference(x, c, s, True)),
            ("rope, Meta's Llama complex form, xkern.optimize vs jax.jit", True, xkern.optimize(metas), metas),
            # (its forward alone runs as written: XLA fuses the half rotation as fast)
            ("rope, HF Flax Llama's half rotation, xkern.optimize vs jax.jit", False, xkern.optimize(hf), hf)):
        fwd = lambda f: (lambda x, c, s, dy: f(x, c, s))

        def both(f):  # value and x-gradient, as in a training step
            def run(x, c, s, dy):
                y, pullback = jax.vjp(lambda x: f(x, c, s), x)
                return y, pullback(dy)[0]
            return run

        out.append(Case(name, shape, "bfloat16", "fwd", fwd(ours), fwd(ref), make, 2 * n + tables, 2e-2))
        out.append(Case(name, shape, "bfloat16", "fwd+bwd", both(ours), both(ref), make,
                        4 * n + 2 * tables, 2e-2))
    return out
