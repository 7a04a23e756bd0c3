"""Sweep softmax launch configs on the present GPU: the evidence behind softmax.default_config.

    python -m benchmarks.sweep_softmax [--out sweep.json]

For each shape, times the forward kernel and the backward kernel alone (bf16) at each candidate
config, checks each result against jax, and prints the best config next to the heuristic's choice.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import jax
import jax.numpy as jnp

from benchmarks.harness import best_vs_heuristic, max_error
from benchmarks.bench_softmax import GPU_SHAPES
from xkern.kernels import launch as L
from xkern.kernels import softmax as S
from xkern.tuning.timing import time_pipelined


def candidates(n_rows: int, n_cols: int) -> list[L.Config]:
    block_n = L.next_pow2(n_cols)
    out = []
    if block_n <= 32768:
        for block_m, warps in itertools.product((1, 2, 4, 8, 16, 32, 64), (4, 8, 16)):
            if 512 <= block_m * block_n <= 32768:
                out.append(L.Config.of(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps))
    if block_n >= 16384:
        for block, warps, stages in itertools.product((2048, 4096, 8192), (4, 8, 16), (1, 3)):
            out.append(L.Config.of(BLOCK_M=1, BLOCK_N=block, num_warps=warps, num_stages=stages))
    return out


def sweep_shape(shape, dtype=jnp.bfloat16) -> list[dict]:
    kx, kd = jax.random.split(jax.random.key(0))
    x = 3 * jax.random.normal(kx, shape, dtype)
    dy = jax.random.normal(kd, shape, dtype)
    y_ref = jax.nn.softmax(x.astype(jnp.float32))
    dx_ref = jax.vjp(jax.nn.softmax, x.astype(jnp.float32))[1](dy.astype(jnp.float32))[0]
    y_in = y_ref.astype(dtype)
    nbytes = x.size * x.dtype.itemsize
    results = []
    for config in candidates(*shape):
        consts = S._constexprs(shape[1], log=False)
        out = [jax.ShapeDtypeStruct(shape, dtype)]
        fwd = jax.jit(lambda x, c=config: S._launch_fwd(x, backend="triton", config=c,
                                                         constexprs=consts, out_shapes=out)[0])
        bwd = jax.jit(lambda y, dy, c=config: S._launch_bwd(y, dy, backend="triton", config=c,
                                                             constexprs=consts, out_shapes=out)[0])
        for kernel, fn, args, ref, moved in (("fwd", fwd, (x,), y_ref, 2 * nbytes),
                                             ("bwd", bwd, (y_in, dy), dx_ref, 3 * nbytes)):
            try:
                err = max_error(fn(*args), ref)
                ms = time_pipelined(fn, *args) * 1e3
            except Exception as e:  # a config that does not compile is a result, not a crash
                results.append({"shape": list(shape), "kernel": kernel, "config": repr(config),
                                "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            results.append({"shape": list(shape), "kernel": kernel, "config": repr(config),
                            "ms": round(ms, 4), "tbps": round(moved / ms / 1e9, 3),
                            "max_error": err})
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    everything = []
    for shape in GPU_SHAPES:
        results = sweep_shape(shape)
        everything += results
        chosen = {k: repr(S.default_config(*shape, "triton", k)) for k in ("fwd", "bwd")}
        for kernel in ("fwd", "bwd"):
            print(best_vs_heuristic(f"{shape} {kernel}", [r for r in results if r["kernel"] == kernel],
                                    chosen[kernel]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(everything, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
