"""Decoding: one step of a few queries against a key/value cache, xkern.ops.attention (the split-key
forward) against jax.nn.dot_product_attention's XLA implementation (what jax.jit runs), forward
only (inference). Effective TB/s counts q, the keys and values inside each sequence's length, and
o, read or written once; a ragged batch (lengths drawn at random) passes kv_lengths to xkern and the
same lengths as a key padding mask to jax.nn.
"""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np

import xkern
from benchmarks.harness import Case


def cases(on_gpu: bool) -> list[Case]:
    shapes = [(8, 1, 8192, 32, 8, 128, False), (8, 1, 32768, 32, 8, 128, False), (1, 1, 131072, 32, 8, 128, False),
              (8, 1, 8192, 32, 32, 128, False), (8, 4, 8192, 32, 8, 128, False), (32, 1, 32768, 32, 8, 128, True),
              (8, 1, 16384, 16, 2, 256, False)] if on_gpu else [(2, 1, 64, 4, 2, 32, False), (2, 1, 64, 4, 2, 32, True)]
    out = []
    for b, sq, sk, h, hk, d, ragged in shapes:
        lengths = (np.random.default_rng(0).integers(1, sk + 1, b) if ragged else np.full(b, sk)).astype(np.int32)
        lens = jnp.asarray(lengths)
        mask = (jnp.arange(sk) < lens[:, None])[:, None, None, :] if ragged else None

        def make(key, b=b, sq=sq, sk=sk, h=h, hk=hk, d=d):
            shapes = ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))
            return tuple(jax.random.normal(kk, s, jnp.bfloat16) for kk, s in zip(jax.random.split(key, 3), shapes))

        ours = (lambda q, k, v, lens=lens: xkern.ops.attention(q, k, v, kv_lengths=lens)) if ragged else \
            (lambda q, k, v: xkern.ops.attention(q, k, v))
        ref = lambda q, k, v, mask=mask: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
        nbytes = 2 * (2 * b * sq * h * d + 2 * int(lengths.sum()) * hk * d)
        name = f"decode, {h}/{hk} heads{', ragged lengths' if ragged else ''} vs jax.jit (xla)"
        out.append(Case(name, (b, sq, sk, h, hk, d), "bfloat16", "fwd", ours, ref, make, nbytes, 2e-2))
    flax = _flax_decode_cases(on_gpu) if importlib.util.find_spec("flax") else []  # a test dependency only
    return out + _jit_cases(on_gpu) + flax + _padded_prefill_cases(on_gpu)


def _jit_cases(on_gpu: bool) -> list[Case]:
    """A decode step as jax.nn spells it (key_value_seq_lengths: a padded cache) under xkern.jit, where
    the cost model decides: small caches stay with XLA."""
    shapes = [(8, 2048, 32, 8), (8, 8192, 32, 8), (1, 8192, 32, 8), (8, 1024, 32, 32)] if on_gpu else [(2, 64, 4, 2)]
    d, out = 128 if on_gpu else 32, []
    for b, sk, h, hk in shapes:
        lens = jnp.asarray(np.random.default_rng(1).integers(sk // 2, sk + 1, b), jnp.int32)

        def make(key, b=b, sk=sk, h=h, hk=hk):
            shapes = ((b, 1, h, d), (b, sk, hk, d), (b, sk, hk, d))
            return tuple(jax.random.normal(kk, s, jnp.bfloat16) for kk, s in zip(jax.random.split(key, 3), shapes))

        step = lambda q, k, v, lens=lens: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lens)
        nbytes = 2 * (2 * b * h * d + 2 * int(lens.sum()) * hk * d)
        out.append(Case(f"decode step (jax.nn, key_value_seq_lengths), {h}/{hk} heads: xkern.jit vs jax.jit",
                        (b, 1, sk, h, hk, d), "bfloat16", "fwd", xkern.jit(step), step, make, nbytes, 2e-2))
    return out


def _flax_decode_cases(on_gpu: bool) -> list[Case]:
    """flax.linen.MultiHeadDotProductAttention(decode=True): one token's step against its cache (the
    projections, the cache update and attention with the cache-position mask), returning the output
    and the updated cache, xkern.jit vs jax.jit. The cache is not donated, so both write a new one.
    (A step that dropped the new cache let XLA fuse the update into its attention and never write
    it, where the kernel needs it in memory: 1.30 ms against 0.71 on the H200.)"""
    import flax.linen as nn
    b, cache, heads, d = (8, 8192, 32, 128) if on_gpu else (2, 64, 4, 16)
    module = nn.MultiHeadDotProductAttention(num_heads=heads, qkv_features=heads * d, decode=True,
                                             dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    variables = jax.jit(module.init)(jax.random.key(0), jnp.zeros((b, cache, heads * d), jnp.bfloat16))

    def make(key):
        return (variables["params"], variables["cache"], jax.random.normal(key, (b, 1, heads * d), jnp.bfloat16))

    step = lambda params, cache, token: module.apply({"params": params, "cache": cache}, token, mutable=["cache"])
    return [Case("decode step (flax MultiHeadDotProductAttention, decode=True): xkern.jit vs jax.jit",
                 (b, 1, cache, heads, heads, d), "bfloat16", "fwd", xkern.jit(step), step, make, 0, 2e-2)]


def _padded_prefill_cases(on_gpu: bool) -> list[Case]:
    """A causal prefill of a padded batch as jax.nn spells it (key_value_seq_lengths), xkern.jit vs
    jax.jit, forward (FLOPs counted as if unpadded)."""
    b, s, h, hk, d = (4, 4096, 32, 8, 128) if on_gpu else (2, 40, 4, 2, 16)
    lens = jnp.asarray(np.random.default_rng(2).integers(s // 2, s + 1, b), jnp.int32)

    def make(key):
        kq, kk, kv = jax.random.split(key, 3)
        return (jax.random.normal(kq, (b, s, h, d), jnp.bfloat16), jax.random.normal(kk, (b, s, hk, d), jnp.bfloat16),
                jax.random.normal(kv, (b, s, hk, d), jnp.bfloat16))

    prefill = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lens, is_causal=True)
    return [Case(f"causal prefill (jax.nn, key_value_seq_lengths), {h}/{hk} heads: xkern.jit vs jax.jit",
                 (b, s, s, h, hk, d), "bfloat16", "fwd", xkern.jit(prefill), prefill, make, 0, 2e-2,
                 flops=2 * b * h * s * s * d)]
