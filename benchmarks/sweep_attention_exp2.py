"""Sweep the Gluon attention's exp2 split on the present GPU: the evidence for attention_hopper's
FWD_EXP2 / BWD_EXP2 (how many of every 4 scores' exps go to the FMA units rather than MUFU).

    python -m benchmarks.sweep_attention_exp2 [--variants 0,0 2,0 2,2 2,0,d64] [--out sweep.json]

Each variant ("fwd,bwd", or "fwd,bwd,d64" for the Gluon forward at head dim 64 too, which the
library leaves to the Triton kernels; more tokens NAME=int set attention_hopper's NAME, as
"0,0,FWD_PINGPONG=0") runs in a process of its own, since the kernels read the
split when their configs are built. Each times xkern.ops.attention, forward and forward+backward,
against cuDNN in the same process (bf16, XKERN_AUTOTUNE=0: the library's first candidate), checks
it against cuDNN, and the forward against a float32 reference (first batch). Hopper only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SHAPES = ("4x4096x32x128", "4x4096x32x128c", "4x4096x32x64", "4x4096x32x64c")  # b x s x h x d, c: causal
# (and the other head dims' and lengths' the benchmarks time: 1x16384x32x128c, 2x4096x16x256, ...)


def child(variant: str, shapes: list[str]) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from benchmarks.harness import Case, run_case
    from xkern.kernels import attention_hopper as AH

    fwd_poly, bwd_poly, *rest = variant.split(",")
    AH.FWD_EXP2, AH.BWD_EXP2 = int(fwd_poly), int(bwd_poly)
    if "d64" in rest:
        AH.FWD_BLOCK_N[64] = 128
    for name, value in (token.split("=") for token in rest if "=" in token):
        assert hasattr(AH, name), name
        setattr(AH, name, int(value))
    import xkern

    def cudnn(q, k, v, causal):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

    def ours(q, k, v, causal):
        return xkern.ops.attention(q, k, v, causal=causal)

    rows = []
    for spec in shapes:
        causal = spec.endswith("c")
        b, s, h, d = map(int, spec.rstrip("c").split("x"))

        def make(key, shape=(b, s, h, d)):
            return tuple(jax.random.normal(k, shape, jnp.bfloat16) for k in jax.random.split(key, 4))
        q, k, v, _ = make(jax.random.key(0))
        # (against float32 on the first batch entry's first 4 heads: at s16384 all 32 heads' float32
        # scores would take 32 GiB)
        ref = jax.nn.dot_product_attention(*(x[:1, :, :4].astype(jnp.float32) for x in (q, k, v)), is_causal=causal)
        error32 = {name: float(jnp.max(jnp.abs(jax.jit(fn, static_argnums=3)(q, k, v, causal)[:1, :, :4] - ref)))
                   for name, fn in (("xkern", ours), ("cudnn", cudnn))}
        flops = 4 * b * h * s * s * d // (2 if causal else 1)
        for mode in ("fwd", "fwd+bwd"):
            if mode == "fwd":
                wrap = lambda fn: (lambda q, k, v, do: fn(q, k, v, causal))
            else:
                wrap = lambda fn: (lambda q, k, v, do: jax.vjp(lambda *a: fn(*a, causal), q, k, v)[1](do))
            row = run_case(Case(spec, (b, s, h, d), "bfloat16", mode, wrap(ours), wrap(cudnn), make, 0, 5e-2,
                                flops if mode == "fwd" else int(3.5 * flops)))
            rows.append({"variant": variant, "case": spec, "mode": mode, "xkern_ms": row.xkern_ms,
                         "cudnn_ms": row.xla_ms, "xkern_tflops": row.xkern_tflops, "cudnn_tflops": row.xla_tflops,
                         "error_vs_cudnn": row.max_error, "fwd_error_vs_f32": error32})
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["0,0", "2,0", "2,2", "0,0,d64", "2,0,d64"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--timeout", type=float, default=300, help="seconds a variant's process may take")
    parser.add_argument("--child")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    from xkern.kernels import launch as L
    if not L.hopper():
        print("sweep_attention_exp2: the Gluon kernels need a Hopper GPU", file=sys.stderr)
        return 2
    if args.child:
        print("ROWS " + json.dumps(child(args.child, args.shapes)), flush=True)
        return 0
    rows = []
    for variant in args.variants:
        shapes = args.shapes if "d64" not in variant else [s for s in args.shapes if "x64" in s]
        try:
            done = subprocess.run([sys.executable, "-m", "benchmarks.sweep_attention_exp2", "--child", variant,
                                   "--shapes", *shapes], capture_output=True, text=True, timeout=args.timeout,
                                  env={**os.environ, "XKERN_AUTOTUNE": "0"})
        except subprocess.TimeoutExpired:
            print(f"variant {variant}: no result in {args.timeout} s", flush=True)
            continue
        found = [line[5:] for line in done.stdout.splitlines() if line.startswith("ROWS ")]
        if not found:
            print(f"variant {variant} failed:\n{done.stderr[-2000:]}", flush=True)
            continue
        rows += json.loads(found[0])
        for r in json.loads(found[0]):
            print(f"{r['variant']:16} {r['case']:16} {r['mode']:8} {r['xkern_tflops']:6.0f} TFLOP/s "
                  f"(cuDNN {r['cudnn_tflops']:4.0f})  error vs cuDNN {r['error_vs_cudnn']:.1e}, fwd vs f32 "
                  f"{r['fwd_error_vs_f32']['xkern']:.1e} (cuDNN {r['fwd_error_vs_f32']['cudnn']:.1e})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m benchmarks.sweep_attention_exp2 " + " ".join(argv), "rows": rows}, f,
                      indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
