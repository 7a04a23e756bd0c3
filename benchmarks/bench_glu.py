"""swiglu / geglu against the same math under jax.jit: two projections, and swiglu of one split
projection ([rows, 2 cols] in, the same bytes).

Forward: reads gate and up, writes out (3 tensors). Forward+backward is the input gradients'
program (reads gate, up and dout, writes dgate and dup: 5 tensors; the forward kernel is dead code
there, since the custom_vjp saves only the inputs).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.harness import Case
from xkern.kernels import glu


def cases(on_gpu: bool) -> list[Case]:
    rows, cols = (16384, 8192) if on_gpu else (64, 300)
    n = rows * cols * 2  # bytes of one bf16 operand

    def make(key):
        kg, ku, kd = jax.random.split(key, 3)
        return tuple(jax.random.normal(k, (rows, cols), jnp.bfloat16) for k in (kg, ku, kd))

    out = []
    for name, ours, activation in (("swiglu", glu.swiglu, "silu"), ("geglu", glu.geglu, "gelu_tanh")):
        ref = lambda a, b, activation=activation: glu.reference(a, b, activation)
        fwd = lambda f: (lambda a, b, dout: f(a, b))
        grads = lambda f: (lambda a, b, dout: jax.vjp(f, a, b)[1](dout))
        out.append(Case(name, (rows, cols), "bfloat16", "fwd", fwd(ours), fwd(ref), make, 3 * n, 2e-2))
        out.append(Case(name, (rows, cols), "bfloat16", "fwd+bwd", grads(ours), grads(ref), make, 5 * n, 3e-2))
    joined = lambda a, b, dout: (jnp.concatenate([a, b], -1), dout)  # outside the timed function
    make_split = lambda key: joined(*make(key))
    split_ref = lambda x: glu.reference(x, None, "silu")
    out.append(Case("swiglu (split)", (rows, 2 * cols), "bfloat16", "fwd", lambda x, dout: glu.swiglu(x),
                    lambda x, dout: split_ref(x), make_split, 3 * n, 2e-2))
    split_grad = lambda f: (lambda x, dout: jax.vjp(f, x)[1](dout))
    out.append(Case("swiglu (split)", (rows, 2 * cols), "bfloat16", "fwd+bwd", split_grad(glu.swiglu),
                    split_grad(split_ref), make_split, 5 * n, 3e-2))
    return out
