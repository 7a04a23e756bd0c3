"""Data parallelism: the decoder blocks' training step with the batch sharded over every device;
tensor parallelism: causal GQA attention with its heads sharded over every device.

Each xkern launch in such a program runs on its device's share of the batch (kernels/partition.py),
and attention's on its share of the heads, as XLA's own fusions do; without that, every launch would
gather the whole batch (or every head) onto every device.
Runs only where jax sees more than one device of the default backend.
"""
from __future__ import annotations

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
    return out


def _heads_case(mesh, on_gpu: bool) -> Case:
    """jax.nn's causal GQA attention, forward and backward, q/k/v sharded on their heads (the
    issue's b4 s4096 d128 at 32 query and 8 key heads on a GPU)."""
    b, s, h, kv, d = (4, 4096, 32, 8, 128) if on_gpu else (2, 64, 8, 4, 32)
    heads = NamedSharding(Mesh(mesh.devices, ("model",)), PartitionSpec(None, None, "model"))
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    loss = lambda q, k, v, f: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)
    grads = lambda f: jax.grad(lambda q, k, v: loss(q, k, v, f), (0, 1, 2))

    def args(key):
        kq, kk, kv_ = jax.random.split(key, 3)
        return tuple(jax.device_put(jax.random.normal(k_, shape, jnp.bfloat16), heads)
                     for k_, shape in ((kq, (b, s, h, d)), (kk, (b, s, kv, d)), (kv_, (b, s, kv, d))))
    flops = int(4 * b * h * s * s * d * 0.5 * 3.5)  # causal: half the scores; backward 2.5x forward
    return Case(f"attention causal GQA, heads over {len(mesh.devices.flat)} devices", (b, s, h, d), "bfloat16",
                "fwd+bwd", grads(xkern.optimize(attend)), grads(attend), args, 0, 3e-2, flops=flops)
