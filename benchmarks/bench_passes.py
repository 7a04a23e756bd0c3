"""Compile-time overhead of xkern's passes: the pipeline over the forward+backward jaxpr of a
12-layer transformer (target: under 1 second on a CPU-only machine).

    python -m benchmarks.bench_passes
"""
from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp

from xkern import pipeline
from xkern.jaxpr_passes import patterns


def transformer_loss(params, tokens, labels, n_heads=8):
    """A plain-JAX pre-norm decoder: attention with a hand-written causal softmax, GELU MLP,
    log_softmax cross-entropy: the spellings xkern's patterns look for, and everything around them."""
    x = params["embed"][tokens]
    seq = tokens.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    for layer in params["layers"]:
        h = _layer_norm(x, layer["ln1"])
        q, k, v = (jnp.einsum("bsd,dhe->bhse", h, layer[n]) for n in ("wq", "wk", "wv"))
        scores = jnp.einsum("bhqe,bhke->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        scores = jnp.where(causal, scores, -1e9)
        e = jnp.exp(scores - scores.max(-1, keepdims=True))
        probs = e / e.sum(-1, keepdims=True)
        x = x + jnp.einsum("bhqk,bhke,hed->bqd", probs, v, layer["wo"])
        h = _layer_norm(x, layer["ln2"])
        x = x + jax.nn.gelu(h @ layer["w1"]) @ layer["w2"]
    logits = _layer_norm(x, params["ln_f"]) @ params["embed"].T
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _layer_norm(x, scale):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale


def init(key, n_layers=12, d=256, n_heads=8, vocab=1024):
    keys = iter(jax.random.split(key, 8 * n_layers + 2))
    normal = lambda *shape: 0.02 * jax.random.normal(next(keys), shape)
    layer = lambda: {"ln1": jnp.ones(d), "ln2": jnp.ones(d), "wq": normal(d, n_heads, d // n_heads),
                     "wk": normal(d, n_heads, d // n_heads), "wv": normal(d, n_heads, d // n_heads),
                     "wo": normal(n_heads, d // n_heads, d), "w1": normal(d, 4 * d),
                     "w2": normal(4 * d, d)}
    return {"embed": normal(vocab, d), "ln_f": jnp.ones(d), "layers": [layer() for _ in range(n_layers)]}


def main() -> int:
    params = init(jax.random.key(0))
    tokens = jnp.zeros((2, 128), jnp.int32)
    closed = jax.make_jaxpr(jax.value_and_grad(transformer_loss))(params, tokens, tokens)
    patterns.registry.cache_clear()
    start = time.perf_counter()
    patterns.registry()
    first = time.perf_counter() - start
    start = time.perf_counter()
    pipeline.plan(closed, "triton")  # traces the gated pattern families this program holds
    first_plan = time.perf_counter() - start
    times = []
    for _ in range(5):
        start = time.perf_counter()
        plan = pipeline.plan(closed, "triton")
        times.append(time.perf_counter() - start)
    rewrites = sum(len(p.rewrites) for p in plan.walk())
    declined = sum(len(p.declined) for p in plan.walk())
    print(f"12-layer transformer, forward+backward jaxpr: {len(closed.jaxpr.eqns)} equations")
    print(f"pattern registry, built once per process: {first * 1e3:.0f} ms, and "
          f"{(first_plan - statistics.median(times)) * 1e3:.0f} ms more on the first plan of a program "
          f"with a loss (its families of patterns, traced on first need)")
    print(f"pass pipeline: median {statistics.median(times) * 1e3:.0f} ms over 5 runs "
          f"(target < 1000 ms); {rewrites} rewrites, {declined} declined")
    return 0


if __name__ == "__main__":
    sys.exit(main())
