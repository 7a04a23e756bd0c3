"""Compile-time overhead of xkern's passes: the pipeline over the forward+backward jaxpr of a
12-layer transformer (target: under 1 second on a CPU-only machine), and start-up: the pattern
registry traced by a first process and loaded from the disk cache by later ones.

    python -m benchmarks.bench_passes
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
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


def start_up() -> tuple[float, float]:
    """In a process of its own: seconds to build the registry (its rules modules imported), and the
    first plan's more than a later plan's (the families of patterns it traces on first need)."""
    closed = _transformer_jaxpr()
    start = time.perf_counter()
    patterns.registry()
    built = time.perf_counter() - start
    plans = []
    for _ in range(2):
        start = time.perf_counter()
        pipeline.plan(closed, "triton")
        plans.append(time.perf_counter() - start)
    return built, plans[0] - plans[1]


def _start_up_in_new_processes() -> list[tuple[float, float]]:
    """start_up() in a first process (an empty disk cache) and in a later one (what it stored)."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "XKERN_CACHE_DIR": folder, "JAX_PLATFORMS": "cpu"}  # (planning is host work)
        code = "from benchmarks import bench_passes; print(*bench_passes.start_up())"
        return [tuple(map(float, subprocess.run([sys.executable, "-c", code], env=env, check=True, text=True,
                                                capture_output=True).stdout.split()[-2:])) for _ in range(2)]


def _transformer_jaxpr():
    params = init(jax.random.key(0))
    tokens = jnp.zeros((2, 128), jnp.int32)
    return jax.make_jaxpr(jax.value_and_grad(transformer_loss))(params, tokens, tokens)


def main() -> int:
    traced, loaded = _start_up_in_new_processes()
    closed = _transformer_jaxpr()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        plan = pipeline.plan(closed, "triton")
        times.append(time.perf_counter() - start)
    rewrites = sum(len(p.rewrites) for p in plan.walk())
    declined = sum(len(p.declined) for p in plan.walk())
    print(f"12-layer transformer, forward+backward jaxpr: {len(closed.jaxpr.eqns)} equations")
    print(f"start-up, once per process: the pattern registry {traced[0] * 1e3:.0f} ms traced (a first "
          f"process), {loaded[0] * 1e3:.0f} ms loaded from the disk cache (every later one); the first "
          f"plan of a program with a loss {traced[1] * 1e3:.0f} / {loaded[1] * 1e3:.0f} ms more (its "
          f"families of patterns)")
    print(f"pass pipeline: median {statistics.median(times) * 1e3:.0f} ms over 5 runs "
          f"(target < 1000 ms); {rewrites} rewrites, {declined} declined")
    return 0


if __name__ == "__main__":
    sys.exit(main())
