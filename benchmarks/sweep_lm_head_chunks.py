"""The LM head's chunk size on the present GPU: the evidence for linear_cross_entropy.CHUNK_BYTES and
MIN_CHUNK_ROWS (benchmarks/results/README.md, fifty-third session).

    python -m benchmarks.sweep_lm_head_chunks [--shapes 8192x4096x128256 8192x2304x256000t]
                                              [--chunks 1024 2048 4096] [--parts]

For each LM head (rows x d x vocabulary, "t": a tied table [V, D]) it times the value and the
gradients of h and w in bf16, jax.jit's materialized logits first and then linear_cross_entropy at
each chunk size, with the temporary memory XLA reports. --parts times the chunk loop in pieces
(the logits matmul alone, then with the loss kernel, then with dh, then with dw: the forward pass
that makes every gradient) at the first shape, to see where a chunk size loses.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.bench_cross_entropy import _head_inputs
from benchmarks.harness import temp_gib
from xkern.kernels import cross_entropy as ce
from xkern.kernels import launch as L
from xkern.kernels import linear_cross_entropy as linear
from xkern.tuning.timing import time_pipelined

SHAPES = ("8192x4096x128256", "8192x2304x256000t", "8192x4096x151936", "8192x8192x128256", "16384x4096x128256",
          "8192x2048x32000")


def _inputs(shape: str):
    rows, dim, vocab = (int(n) for n in shape.rstrip("t").split("x"))
    h, w, labels, _ = _head_inputs(rows, dim, vocab)(jax.random.key(0))
    return (h, w.T.copy() if shape.endswith("t") else w, labels), rows * dim * vocab


def sweep(shape: str, chunks: list[int]) -> str:
    (h, w, labels), size = _inputs(shape)
    tied = shape.endswith("t")
    grad = lambda f: jax.jit(lambda h, w, y: jax.value_and_grad(lambda h, w: f(h, w, y, transpose_w=tied), (0, 1))(h, w))
    cells = []
    for name, f in [("jax.jit", linear.reference)] + [
            (f"{c} rows", functools.partial(linear.linear_cross_entropy, chunk_rows=c)) for c in chunks]:
        fn = grad(f)
        t = time_pipelined(fn, h, w, labels)
        cells.append(f"{name} {t * 1e3:.2f} ms ({6 * size / t / 1e12:.0f} TFLOP/s, {temp_gib(fn, h, w, labels)} GiB)")
        jax.clear_caches()
    return f"{shape}: " + " | ".join(cells)


def parts(shape: str, chunks: list[int]) -> list[str]:
    """The forward pass's chunk loop cut after each stage (ms for all the chunks)."""
    (h, w, labels), _ = _inputs(shape)
    options = linear.Options(None, 0.0, 0.0, w.shape[0] if shape.endswith("t") else w.shape[1],
                             transpose_w=shape.endswith("t"))
    backend = L.resolve_backend(None)
    consts, config = linear._consts(options, write_dx=True), ce.default_config(options.n_cols, backend)

    def loop(chunk, stage):
        def step(dw, xs):
            h_c, y_c = xs
            z = linear._logits(h_c, w, options)
            if stage == "matmul":
                return dw, z[:, :1].astype(jnp.float32).sum()
            loss, _, dz = ce._launch_fwd(z, y_c, jnp.ones(y_c.shape, jnp.float32), backend=backend, config=config,
                                         constexprs=consts, in_place=True)
            if stage == "loss":
                return dw, loss.sum() + dz[:, :1].astype(jnp.float32).sum()
            dh, dw_next = linear._grads(h_c, w, dz, dw, options)
            return (dw, loss.sum() + dh[:, 0].astype(jnp.float32).sum()) if stage == "dh" else (
                dw_next, loss.sum() + dh[:, 0].astype(jnp.float32).sum())

        xs = (linear._chunks(h, chunk), linear._chunks(labels, chunk))
        return jax.jit(lambda: jax.lax.scan(step, jnp.zeros(w.shape, w.dtype), xs))

    lines = []
    for chunk in chunks:
        times = [time_pipelined(loop(chunk, stage)) * 1e3 for stage in ("matmul", "loss", "dh", "all")]
        lines.append(f"{chunk} rows: logits matmul {times[0]:.2f}, + loss kernel {times[1]:.2f}, + dh {times[2]:.2f}, "
                     f"+ dw {times[3]:.2f} ms")
        jax.clear_caches()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--chunks", nargs="+", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--parts", action="store_true")
    args = parser.parse_args()
    if jax.default_backend() == "cpu":
        raise SystemExit("sweep_lm_head_chunks times LM heads of billions of FLOPs: run it on a GPU")
    if args.parts:
        print("\n".join(parts(args.shapes[0], args.chunks)), flush=True)
    for shape in args.shapes:
        print(sweep(shape, args.chunks), flush=True)


if __name__ == "__main__":
    main()
