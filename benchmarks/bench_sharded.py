"""Data parallelism: the decoder blocks' training step with the batch sharded over every device.

Each xkern launch in such a program runs on its device's share of the batch (kernels/partition.py),
as XLA's own fusions do; without that, every launch would gather the whole batch onto every device.
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
    return out
