"""Whole programs: xkern.jit / xkern.optimize against jax.jit, as users would write them.

Cases where the pattern passes find softmax / log_softmax in ordinary JAX code (no xkern.ops calls)
and replace them; forward alone, and forward+backward with xkern.optimize inside jax.vjp.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import xkern
from benchmarks.harness import Case


def attention(q, k, v):
    """Attention as many codebases still write it: scores in bf16, softmax in float32, cast back."""
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", probs, v)


def lm_loss(logits, labels):
    """Token-level cross-entropy through log_softmax on float32-upcast bf16 logits."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def _vjp(f):
    return lambda *args: jax.vjp(f, *args[:-1])[1](args[-1])


def cases(on_gpu: bool) -> list[Case]:
    b, h, s, d = (4, 16, 2048, 64) if on_gpu else (1, 2, 16, 8)
    tokens, vocab = (8192, 32000) if on_gpu else (16, 50)
    bf16 = jnp.bfloat16

    def qkv(key, with_cotangent=False):
        keys = jax.random.split(key, 4)
        arrays = [jax.random.normal(k, (b, h, s, d), bf16) for k in keys]
        return tuple(arrays if with_cotangent else arrays[:3])

    def logits_labels(key):
        k1, k2 = jax.random.split(key)
        return (3 * jax.random.normal(k1, (tokens, vocab), bf16),
                jax.random.randint(k2, (tokens,), 0, vocab))

    grad_logits = lambda f: (lambda logits, labels: jax.grad(f)(logits, labels))
    shape = (b, h, s, d)
    return [
        Case("attention (jax.nn.softmax)", shape, "bfloat16", "fwd", xkern.jit(attention),
             attention, qkv, 0, 2e-2),
        Case("attention (jax.nn.softmax)", shape, "bfloat16", "fwd+bwd",
             _vjp(xkern.optimize(attention)), _vjp(attention),
             lambda key: qkv(key, with_cotangent=True), 0, 3e-2),
        Case("lm loss (log_softmax)", (tokens, vocab), "bfloat16", "fwd", xkern.jit(lm_loss),
             lm_loss, logits_labels, 0, 1e-4),
        Case("lm loss (log_softmax)", (tokens, vocab), "bfloat16", "fwd+bwd",
             grad_logits(xkern.optimize(lm_loss)), grad_logits(lm_loss), logits_labels, 0, 2e-2),
    ]
