"""Sweep launch configs of generated kernels on the present GPU: the evidence behind
xkern.kernels.generated.default_config.

    python -m benchmarks.sweep_generated [--out sweep.json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import jax
import numpy as np

from benchmarks import bench_generated
from benchmarks.harness import best_vs_heuristic, max_error
from xkern import pipeline
from xkern.kernels import generated
from xkern.kernels import launch as L
from xkern.jaxpr_passes.rewrite import evaluate
from xkern.tuning.timing import time_pipelined

PROGRAMS = {"gelu(x*a+b)*c": (bench_generated.gelu_chain, 0),  # name: (program, column vectors)
            "layer norm": (bench_generated.layer_norm, 2),
            "rms norm": (bench_generated.rms_norm, 1)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--backend", default="triton")
    args = parser.parse_args(argv)
    rows, cols = args.rows, args.cols
    default_config = generated.default_config
    results = []
    for name, (f, n_vectors) in PROGRAMS.items():
        key = jax.random.key(0)
        vectors = [()] * 3 if n_vectors == 0 else [(cols,)] * n_vectors
        inputs = (jax.random.normal(key, (rows, cols), jax.numpy.bfloat16),
                  *(1 + 0.1 * jax.random.normal(key, s, np.float32) for s in vectors))
        want = jax.jit(f)(*inputs)
        plan = pipeline.plan(jax.make_jaxpr(f)(*inputs), "interpret")  # every group, no costing
        (fusion,) = plan.fusions.values()
        chosen = generated.default_config(rows, cols, args.backend, fusion.fused)
        for block_m, warps in itertools.product((1, 2, 4), (4, 8, 16)):
            config = L.Config.of(BLOCK_M=block_m, BLOCK_N=L.next_pow2(cols), num_warps=warps)
            # The whole program, its group's kernel launched at `config` (a sweep-only override).
            generated.default_config = lambda *_, c=config: c
            run = jax.jit(lambda *xs, c=config: evaluate(plan, xs, args.backend)[0])
            try:
                err = max_error(run(*inputs), want)
                ms = time_pipelined(run, *inputs) * 1e3
            except Exception as e:  # a config that does not compile is a result, not a crash
                results.append({"program": name, "config": repr(config), "error": str(e)[:200]})
                continue
            finally:
                generated.default_config = default_config
            results.append({"program": name, "config": repr(config), "ms": round(ms, 4),
                            "tbps": round(2 * rows * cols * 2 / ms / 1e9, 3), "max_error": err})
        print(best_vs_heuristic(name, [r for r in results if r["program"] == name], repr(chosen)),
              flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
