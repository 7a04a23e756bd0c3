"""Matmul with a generated epilogue (bias + gelu) against jax.jit (cuBLASLt with its own epilogue).

"generated" forces the matmul-epilogue kernel (tiles autotuned on first use, cached on disk), and
in the backward the generated kernel of the epilogue's derivative (or, in the row that says so, XLA's);
"xkern.jit" is what users get, with the cost model deciding. Rates in TFLOP/s: 2*M*N*K forward,
three times that forward+backward (the two gradient matmuls).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import xkern
from benchmarks.bench_generated import forced
from benchmarks.harness import Case


def linear_gelu(x, w, b):
    return jax.nn.gelu(x @ w + b)


def cases(on_gpu: bool) -> list[Case]:
    shapes = [(8192, 8192, 8192), (16384, 4096, 16384)] if on_gpu else [(33, 70, 45)]
    backend = "triton" if on_gpu else "interpret"
    out = []
    for m, k, n in shapes:
        def make(key, m=m, k=k, n=n):
            kx, kw, kb, kd = jax.random.split(key, 4)
            return (jax.random.normal(kx, (m, k), jnp.bfloat16),
                    (jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16),
                    (0.1 * jax.random.normal(kb, (n,), jnp.float32)).astype(jnp.bfloat16),
                    jax.random.normal(kd, (m, n), jnp.bfloat16))
        flops = 2 * m * n * k
        fwd = lambda f: (lambda x, w, b, dy: f(x, w, b))
        grads = lambda f: (lambda x, w, b, dy: jax.vjp(f, x, w, b)[1](dy))
        for label, f in (("generated", forced(linear_gelu, backend)), ("xkern.jit", xkern.optimize(linear_gelu))):
            out.append(Case(f"matmul+bias+gelu {label}", (m, k, n), "bfloat16", "fwd", fwd(f),
                            fwd(linear_gelu), make, 0, 2e-2, flops=flops))
        out.append(Case("matmul+bias+gelu generated", (m, k, n), "bfloat16", "fwd+bwd",
                        grads(forced(linear_gelu, backend)), grads(linear_gelu), make, 0, 3e-2,
                        flops=3 * flops))
        out.append(Case("matmul+bias+gelu generated, XLA's epilogue derivative", (m, k, n), "bfloat16",
                        "fwd+bwd", grads(forced(linear_gelu, backend, derivative_kernels=False)),
                        grads(linear_gelu), make, 0, 3e-2, flops=3 * flops))
    return out
