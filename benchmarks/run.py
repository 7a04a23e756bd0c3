"""The main job: a short demo of xkern on whatever backend is present, then the benchmark table.

    python -m benchmarks.run [--only SUITE] [--out results.json]

On a GPU the cases are the shapes of shared/GPU.md; on CPU, kernels run through Triton's
interpreter, so the cases are small and the timings say nothing about GPU speed.
"""
from __future__ import annotations

import argparse
import sys
import types

import jax
import jax.numpy as jnp

import xkern
from benchmarks import (bench_attention, bench_cross_entropy, bench_decode, bench_generated, bench_glu, bench_matmul,
                        bench_norms, bench_passes, bench_programs, bench_rope, bench_sharded, bench_softmax,
                        harness)
from xkern.kernels.launch import kernel_names


def demo() -> None:
    x = jax.random.normal(jax.random.key(0), (4, 1000), jnp.float32)
    y = jax.jit(xkern.ops.softmax)(x)
    err = float(jnp.max(jnp.abs(y - jax.nn.softmax(x))))
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: (xkern.ops.softmax(x) ** 2).sum()))(x)
    kernels = kernel_names(jaxpr)
    print(f"xkern {xkern.__version__} on {harness.device_name()} ({jax.default_backend()}), "
          f"backend {xkern.resolve_backend()}")
    print(f"demo: softmax of a 4x1000 array matches jax.nn.softmax to {err:.2e}; "
          f"its gradient launches {kernels}")


SUITES = {"softmax": bench_softmax, "norms": bench_norms, "cross_entropy": bench_cross_entropy,
          "glu": bench_glu, "rope": bench_rope, "attention": bench_attention, "decode": bench_decode,
          "programs": bench_programs, "generated": bench_generated, "matmul": bench_matmul, "sharded": bench_sharded,
          "window": types.SimpleNamespace(cases=bench_attention.window_cases),
          "training": types.SimpleNamespace(cases=bench_programs.training_cases)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the rows, command and versions as JSON here")
    parser.add_argument("--only", choices=sorted(SUITES), help="run one suite of cases")
    parser.add_argument("--case", help="run only the cases whose name contains this text")
    args = parser.parse_args(argv)
    demo()
    on_gpu = jax.default_backend() != "cpu"
    rows = []
    suites = [SUITES[args.only]] if args.only else list(SUITES.values())
    for case in [c for suite in suites for c in suite.cases(on_gpu) if (args.case or "") in c.op]:
        rows.append(harness.run_case(case))
        row = rows[-1]  # (as it goes: a run cut short still shows what it measured)
        print(f"  {case.op} {case.shape} {case.mode}: {row.xkern_ms:.4f} ms, jax.jit {row.xla_ms:.4f} ms "
              f"({row.speedup:.2f}x)", flush=True)
    print(harness.format_table(rows))
    if not args.only and not args.case:
        bench_passes.main()
    if not on_gpu:
        print("(CPU: kernels ran through Triton's interpreter; these times are not GPU speed)")
    if args.out:
        harness.save(rows, args.out, "python -m benchmarks.run " + " ".join(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
