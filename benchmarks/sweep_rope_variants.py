"""Rope forward, kernel variants against the shipped kernel and XLA, at 4x4096x32x128 bf16:

    python -m benchmarks.sweep_rope_variants

The evidence that the rope kernel's structure is not what stands between it and issue 5's 3.9 TB/s:
whole-row loads of the half form (one 256-byte load, split in registers, instead of two halves),
evict-first loads, a 2-D grid over (rows, heads) blocks, and tile / warp choices. Prints each
variant's time and TB/s (x read and y written), then the best four per form. On an H100
(benchmarks/results/h100-rope-variants-session61.log) all 55 land within 0.4% of the shipped kernel
or below it, and XLA's half rotation within 0.4% above it: the forward is a plain stream there.
Off a GPU it checks the variants through the interpreter at a small shape.
"""
import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

import xkern
from xkern.kernels import launch as L
from xkern.kernels import rope as R
from xkern.tuning.timing import time_pipelined


@triton.jit
def _rope_v(x_ptr, cos_ptr, sin_ptr, n_rows, seq, y_ptr,
            HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
            WHOLE: tl.constexpr, EVICT: tl.constexpr, TWO_D: tl.constexpr,
            BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = rows < n_rows
    table_rows = (rows % seq).to(tl.int64)
    pairs = tl.arange(0, BLOCK_P)
    c = tl.load(cos_ptr + table_rows[:, None] * (HEAD_DIM // 2) + pairs[None, :], mask=row_ok[:, None]).to(tl.float32)[:, None, :]
    s = tl.load(sin_ptr + table_rows[:, None] * (HEAD_DIM // 2) + pairs[None, :], mask=row_ok[:, None]).to(tl.float32)[:, None, :]
    row_base = rows.to(tl.int64)[:, None, None] * (HEADS * HEAD_DIM)
    start = tl.program_id(1) * BLOCK_H if TWO_D else 0
    stop = start + BLOCK_H if TWO_D else HEADS
    for h0 in range(start, stop, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        base = row_base + heads[None, :, None] * HEAD_DIM
        ok = row_ok[:, None, None] & (heads < HEADS)[None, :, None]
        if WHOLE or INTERLEAVED:
            cols = tl.arange(0, 2 * BLOCK_P)[None, None, :]
            if EVICT:
                x = tl.load(x_ptr + base + cols, mask=ok, eviction_policy="evict_first").to(tl.float32)
            else:
                x = tl.load(x_ptr + base + cols, mask=ok).to(tl.float32)
            if INTERLEAVED:
                xa, xb = tl.split(tl.reshape(x, (BLOCK_S, BLOCK_H, BLOCK_P, 2)))
            else:
                xa, xb = tl.split(tl.permute(tl.reshape(x, (BLOCK_S, BLOCK_H, 2, BLOCK_P)), (0, 1, 3, 2)))
            ya, yb = xa * c - xb * s, xb * c + xa * s
            if INTERLEAVED:
                y = tl.reshape(tl.join(ya, yb), (BLOCK_S, BLOCK_H, 2 * BLOCK_P))
            else:
                y = tl.reshape(tl.permute(tl.join(ya, yb), (0, 1, 3, 2)), (BLOCK_S, BLOCK_H, 2 * BLOCK_P))
            tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=ok)
        else:
            cols = pairs[None, None, :]
            if EVICT:
                xa = tl.load(x_ptr + base + cols, mask=ok, eviction_policy="evict_first").to(tl.float32)
                xb = tl.load(x_ptr + base + HEAD_DIM // 2 + cols, mask=ok, eviction_policy="evict_first").to(tl.float32)
            else:
                xa = tl.load(x_ptr + base + cols, mask=ok).to(tl.float32)
                xb = tl.load(x_ptr + base + HEAD_DIM // 2 + cols, mask=ok).to(tl.float32)
            tl.store(y_ptr + base + cols, (xa * c - xb * s).to(y_ptr.dtype.element_ty), mask=ok)
            tl.store(y_ptr + base + HEAD_DIM // 2 + cols, (xb * c + xa * s).to(y_ptr.dtype.element_ty), mask=ok)


def variant(x3, cos, sin, seq, *, interleaved, whole, evict, two_d, bs, bh, warps, backend):
    n_rows, heads, d = x3.shape
    consts = dict(HEADS=heads, HEAD_DIM=d, INTERLEAVED=interleaved, WHOLE=whole, EVICT=evict, TWO_D=two_d)
    grid = (L.cdiv(n_rows, bs), heads // bh) if two_d else (L.cdiv(n_rows, bs),)
    return L.launch(_rope_v, x3, cos, sin, n_rows, seq, kernel="rope_sweep", out_shapes=[jax.ShapeDtypeStruct(x3.shape, x3.dtype)],
                    grid=grid, config=L.Config.of(num_warps=warps, BLOCK_S=bs, BLOCK_H=bh, BLOCK_P=d // 2),
                    backend=backend, constexprs=consts)[0]


def main() -> None:
    backend = "triton" if jax.default_backend() == "gpu" else "interpret"
    b, s, h, d = (4, 4096, 32, 128) if backend == "triton" else (1, 16, 32, 128)
    kx, ka = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (b, s, h, d), jnp.bfloat16)
    angles = jax.random.uniform(ka, (s, d // 2), jnp.float32) * 6
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    nbytes = 2 * x.size * 2
    results = []
    for interleaved in (False, True):
        want = jax.jit(functools.partial(R.reference, interleaved=interleaved))(x, cos, sin)
        rows = [("xla", jax.jit(functools.partial(R.reference, interleaved=interleaved))),
                ("xkern.ops.rope", jax.jit(functools.partial(xkern.ops.rope, interleaved=interleaved)))]
        for whole in ((False, True) if not interleaved else (True,)):
            for evict in (False, True):
                for two_d, bs, bh, warps in ((False, 2, 32, 8), (False, 1, 32, 4), (False, 2, 32, 4), (False, 4, 32, 8),
                                             (True, 4, 8, 4), (True, 8, 8, 8), (True, 2, 16, 4), (True, 4, 16, 8), (True, 16, 4, 8)):
                    name = f"whole={int(whole)} evict={int(evict)} 2d={int(two_d)} {bs}x{bh} w{warps}"
                    f = jax.jit(lambda x, c, s_, kw=dict(interleaved=interleaved, whole=whole, evict=evict, two_d=two_d, bs=bs, bh=bh, warps=warps):
                                variant(x.reshape(b * s, h, d), c, s_, s, backend=backend, **kw).reshape(x.shape))
                    rows.append((name, f))
        for name, f in rows:
            try:
                got = f(x, cos, sin)
                err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
                t = time_pipelined(f, x, cos, sin, repeats=5, min_seconds=0.1) if backend == "triton" else 1.0
                results.append((("interleaved " if interleaved else "half ") + name, t * 1e3, nbytes / t / 1e12, err))
                print(f"{results[-1][0]:55s} {t*1e3:.4f} ms {nbytes/t/1e12:.3f} TB/s err {err:.3g}", flush=True)
            except Exception as e:
                print(name, "FAILED", type(e).__name__, str(e)[:200], flush=True)
    print("\nbest per form:")
    for form in ("half", "interleaved"):
        best = sorted([r for r in results if r[0].startswith(form + " ")], key=lambda r: r[1])[:4]
        for r in best:
            print(f"  {r[0]:55s} {r[1]:.4f} ms {r[2]:.3f} TB/s")


if __name__ == "__main__":
    main()
