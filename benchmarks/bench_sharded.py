"""Data parallelism: the decoder blocks' training step with the batch sharded over every device;
tensor parallelism: causal GQA attention with its heads sharded over every device, and the LM
head's loss with its vocabulary sharded over every device (h @ w, w sharded by column); context
parallelism: attention with its sequence sharded over every device.

Each xkern launch in such a program runs on its device's share of the batch (kernels/partition.py),
and attention's on its share of the heads, as XLA's own fusions do; without that, every launch would
gather the whole batch (or every head) onto every device.
Runs only where jax sees more than one device of the default backend.
"""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import xkern
from benchmarks.bench_programs import decoder_blocks
from benchmarks.harness import Case


def cases(on_gpu: bool) -> list[Case]:
    devices = jax.devices()
    if len(devices) < 2:
        return []
    mesh = Mesh(np.array(devices), ("data",))
    batched, shared = NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())
    out = []
    for key, (name, block, x, heads) in enumerate(decoder_blocks(on_gpu)):
        shape = (x.shape[0] * len(devices), *x.shape[1:])  # each device: the single-GPU rows' batch
        params = block.init(jax.random.key(key), jnp.zeros((1, *x.shape[1:]), x.dtype))
        params = jax.device_put(jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), shared)
        loss = lambda p, x, block=block: jnp.mean(block.apply(p, x).astype(jnp.float32) ** 2)
        args = lambda key, params=params, shape=shape, dtype=x.dtype: (
            params, jax.device_put(jax.random.normal(key, shape, dtype), batched))
        out.append(Case(f"{name}, batch over {len(devices)} devices", (*shape, heads), "bfloat16", "fwd+bwd",
                        jax.grad(xkern.optimize(loss)), jax.grad(loss), args, 0, 3e-2))
    out.append(_heads_case(mesh, on_gpu))
    out.append(_sequence_case(mesh, on_gpu))
    return out + _vocab_cases(mesh, on_gpu)


def _heads_case(mesh, on_gpu: bool) -> Case:
    """jax.nn's causal GQA attention, forward and backward, q/k/v sharded on their heads (the
    issue's b4 s4096 d128 at 32 query and 8 key heads on a GPU)."""
    dims = (4, 4096, 32, 8, 128) if on_gpu else (2, 64, 8, 4, 32)
    heads = NamedSharding(Mesh(mesh.devices, ("model",)), PartitionSpec(None, None, "model"))
    return _attention_case(f"attention causal GQA, heads over {len(mesh.devices.flat)} devices", dims, heads, True)


def _sequence_case(mesh, on_gpu: bool) -> Case:
    """jax.nn's attention (no mask: an encoder's, a diffusion transformer's), forward and backward,
    q/k/v sharded along their sequence (context parallelism): each device's queries against the
    gathered keys (kernels/attention._queries_split), as jax.jit computes it."""
    dims = (1, 16384, 32, 8, 128) if on_gpu else (2, 64, 8, 4, 32)
    sequence = NamedSharding(Mesh(mesh.devices, ("seq",)), PartitionSpec(None, "seq"))
    return _attention_case(f"attention GQA, sequence over {len(mesh.devices.flat)} devices", dims, sequence, False)


def _attention_case(name: str, dims: tuple, sharding, causal: bool) -> Case:
    """jax.nn's attention of q [b, s, h, d] and k, v [b, s, kv, d] (dims: b, s, h, kv, d), all three
    with `sharding`, forward and backward."""
    b, s, h, kv, d = dims
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    loss = lambda q, k, v, f: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)
    grads = lambda f: jax.grad(lambda q, k, v: loss(q, k, v, f), (0, 1, 2))

    def args(key):
        kq, kk, kv_ = jax.random.split(key, 3)
        return tuple(jax.device_put(jax.random.normal(k_, shape, jnp.bfloat16), sharding)
                     for k_, shape in ((kq, (b, s, h, d)), (kk, (b, s, kv, d)), (kv_, (b, s, kv, d))))
    # (causal: half the scores; backward 2.5x forward)
    flops = int(4 * b * h * s * s * d * (0.5 if causal else 1.0) * 3.5)
    return Case(name, (b, s, h, d), "bfloat16", "fwd+bwd", grads(xkern.optimize(attend)), grads(attend), args,
                0, 3e-2, flops=flops)


def _vocab_cases(mesh, on_gpu: bool) -> list[Case]:
    """optax's cross-entropy of h @ w, value and gradients, w sharded by column (Llama 3's 8192
    tokens, d4096, vocabulary 128256 on a GPU): XLA's propagation shards the logits along the
    vocabulary, and each device's loss kernels take its classes (kernels/cross_entropy._vocab_fwd)."""
    if importlib.util.find_spec("optax") is None:  # (a test dependency only)
        return []
    import optax
    rows, d, vocab = (8192, 4096, 128256) if on_gpu else (64, 32, 1000)
    tp = Mesh(mesh.devices, ("model",))
    loss = lambda h, w, y: optax.softmax_cross_entropy_with_integer_labels(
        (h @ w).astype(jnp.float32), y).mean()
    grads = lambda f: jax.value_and_grad(f, (0, 1))

    def args(key):
        kh, kw, ky = jax.random.split(key, 3)
        put = lambda a, *spec: jax.device_put(a, NamedSharding(tp, PartitionSpec(*spec)))
        return (put(jax.random.normal(kh, (rows, d), jnp.bfloat16)),
                put(jax.random.normal(kw, (d, vocab), jnp.bfloat16) * d ** -0.5, None, "model"),
                put(jax.random.randint(ky, (rows,), 0, vocab)))
    return [Case(f"LM head loss, vocabulary over {len(mesh.devices.flat)} devices", (rows, d, vocab), "bfloat16",
                 "fwd+bwd", grads(xkern.optimize(loss)), grads(loss), args, 0, 3e-2, flops=6 * rows * d * vocab)]
