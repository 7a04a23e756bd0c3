"""Generated kernels against XLA's own fusions.

Two rows per program: "generated" forces the fusion group's kernel (planned without the cost model),
so the kernel itself is measured; "xkern.jit" is what users get, with the cost model deciding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import xkern
from benchmarks.harness import Case
from xkern.jaxpr_passes.canonicalize import canonicalize
from xkern.jaxpr_passes.rewrite import empty_plan, evaluate, fuse_groups
from xkern.memory.liveness import plan_in_place


def forced(f, backend: str, derivative_kernels: bool = True):
    """f with every fusion group compiled to a generated kernel, named patterns and the cost model
    bypassed (the layer norm below is also a norm pattern); without `derivative_kernels`, a matmul
    epilogue's backward is XLA's vjp instead of a generated kernel."""
    def run(*args):
        closed = canonicalize(jax.make_jaxpr(f)(*args))
        plan = fuse_groups(empty_plan(closed), "interpret", cost=lambda *_: None)  # launches on `backend`
        plan_in_place(plan)
        if not derivative_kernels:
            for fusion in [f for p in plan.walk() for f in p.fusions.values()]:
                fusion.backward = None
        return evaluate(plan, args, backend)[0]
    return run


def gelu_chain(x, a, b, c):
    return (jax.nn.gelu(x * a + b) * c).astype(x.dtype)


def layer_norm(x, scale, bias):
    h = x.astype(jnp.float32)
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    return ((h - mean) * jax.lax.rsqrt(var + 1e-6) * scale + bias).astype(x.dtype)


def rms_norm(x, scale):
    h = x.astype(jnp.float32)
    return (h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * scale).astype(x.dtype)


def cases(on_gpu: bool) -> list[Case]:
    rows, cols = (16384, 8192) if on_gpu else (16, 300)
    backend = "triton" if on_gpu else "interpret"
    bf16, n = jnp.bfloat16, rows * cols * 2

    def x_and(key, *vectors):
        keys = jax.random.split(key, 1 + len(vectors))
        return (jax.random.normal(keys[0], (rows, cols), bf16),
                *(1 + 0.1 * jax.random.normal(k, shape, jnp.float32) for k, shape in zip(keys[1:], vectors)))

    gelu_args = lambda key: x_and(key, (), (), ())
    out = []
    for name, f, make, nbytes in (
            ("x*a+b (cheap)", lambda x, a, b, c: (x * a + b * c).astype(x.dtype), gelu_args, 2 * n),
            ("gelu(x*a+b)*c", gelu_chain, gelu_args, 2 * n),
            ("layer norm", layer_norm, lambda key: x_and(key, (cols,), (cols,)), 2 * n),
            ("rms norm", rms_norm, lambda key: x_and(key, (cols,)), 2 * n)):
        out.append(Case(f"{name} generated", (rows, cols), "bfloat16", "fwd", forced(f, backend), f,
                        make, nbytes, 2e-2))
        out.append(Case(f"{name} xkern.jit", (rows, cols), "bfloat16", "fwd", xkern.jit(f), f,
                        make, nbytes, 2e-2))
    # Training: the generated kernel's backward is XLA's vjp of the group (recomputing its forward).
    vjp_x = lambda f: (lambda x, s, b, dy: jax.vjp(lambda x: f(x, s, b), x)[1](dy)[0])
    ln_dy = lambda key: (*x_and(key, (cols,), (cols,)), jax.random.normal(key, (rows, cols), bf16))
    out.append(Case("layer norm generated", (rows, cols), "bfloat16", "fwd+bwd",
                    vjp_x(forced(layer_norm, backend)), vjp_x(layer_norm), ln_dy, 3 * n // 2 * 2, 3e-2))
    return out
