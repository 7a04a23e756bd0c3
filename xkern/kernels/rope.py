"""Rotary position embeddings (RoPE) on queries and keys: one Triton kernel for the rotation and its
transpose (the backward), launcher, custom_vjp, batching, and the public `rope`.

x is [..., seq, heads, head_dim]; cos and sin are [seq, head_dim // 2] (one angle per pair) or
[seq, head_dim] (full width, as HF-style code builds them with concatenate([freqs, freqs])). The
head dim splits into pairs (a, b) that rotate together (float32 math, output in x's dtype or
out_dtype):

    half rotation (GPT-NeoX, HF Llama)   a = x[..., :d/2]   b = x[..., d/2:]
    interleaved   (GPT-J, Meta Llama)    a = x[..., 0::2]   b = x[..., 1::2]

    forward    ya = xa * ca - xb * sa        yb = xb * cb + xa * sb
    backward   dxa = dya * ca + dyb * sb     dxb = dyb * cb - dya * sa     (the transpose)

where ca, cb (sa, sb) are cos (sin) at the positions of a and b: the same angle for a half-width
table, each element's own value for a full-width one (so the kernel equals the definition exactly
for any table, not only for one built from repeated angles). In both layouts this is
y = x * cos + rotate(x) * sin, rotate(x) = (-xb, xa) put back in the layout.

Each program takes BLOCK_S (seq) rows of every head, loads their cos/sin once and applies them to
all heads. The custom_vjp saves cos and sin only; x is also kept when cos or sin is differentiated
(their gradients, sum(dy * x) terms, are computed by XLA from the reference definition, only then).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from xkern.kernels import launch as L  # first: it fixes Triton's mode before the kernels below exist

import triton
import triton.language as tl

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], -1)


def _rotate_interleaved(x):
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    return jnp.stack([-pairs[..., 1], pairs[..., 0]], -1).reshape(x.shape)


def reference(x, cos, sin, interleaved=False, out_dtype=None):
    """The definition the kernels are checked against (and the `xla` backend)."""
    xf, c, s = x.astype(jnp.float32), cos.astype(jnp.float32), sin.astype(jnp.float32)
    if c.shape[-1] != x.shape[-1]:  # one angle per pair: both elements of the pair use it
        widen = (lambda t: jnp.repeat(t, 2, -1)) if interleaved else (lambda t: jnp.concatenate([t, t], -1))
        c, s = widen(c), widen(s)
    rotated = _rotate_interleaved(xf) if interleaved else _rotate_half(xf)
    y = xf * c[:, None, :] + rotated * s[:, None, :]  # [seq, 1, d]: the same for every head
    return y.astype(out_dtype or x.dtype)


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------

@triton.jit
def _load_angles(ptr, table_rows, mask, pairs, HEAD_DIM: tl.constexpr, FULL_COS: tl.constexpr,
                 INTERLEAVED: tl.constexpr):
    """The table's values at the a and b elements of each pair: [BLOCK_S, BLOCK_P] each, float32."""
    if FULL_COS:
        row = ptr + table_rows[:, None] * HEAD_DIM
        col_a = 2 * pairs if INTERLEAVED else pairs
        col_b = 2 * pairs + 1 if INTERLEAVED else pairs + HEAD_DIM // 2
        va = tl.load(row + col_a[None, :], mask=mask, other=0.0).to(tl.float32)
        vb = tl.load(row + col_b[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        va = tl.load(ptr + table_rows[:, None] * (HEAD_DIM // 2) + pairs[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        vb = va
    return va[:, None, :], vb[:, None, :]  # broadcast over heads


@triton.jit
def _rotate(xa, xb, ca, cb, sa, sb, BACKWARD: tl.constexpr):
    if BACKWARD:  # the transpose: the rotation by minus the angle when ca == cb and sa == sb
        return xa * ca + xb * sb, xb * cb - xa * sa
    return xa * ca - xb * sa, xb * cb + xa * sb


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr,  # inputs: x [n_rows, HEADS, HEAD_DIM]; cos, sin [tables, seq, width]
          n_rows, seq, rows_per_table,  # x row r uses table row (r // rows_per_table) * seq + r % seq
          y_ptr,  # output: like x
          HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, FULL_COS: tl.constexpr,
          INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
          BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = rows < n_rows
    table_rows = ((rows // rows_per_table) * seq + rows % seq).to(tl.int64)
    pairs = tl.arange(0, BLOCK_P)
    pair_ok = pairs < HEAD_DIM // 2
    angle_mask = row_ok[:, None] & pair_ok[None, :]
    # Loaded once per program, reused by every head below.
    ca, cb = _load_angles(cos_ptr, table_rows, angle_mask, pairs, HEAD_DIM, FULL_COS, INTERLEAVED)
    sa, sb = _load_angles(sin_ptr, table_rows, angle_mask, pairs, HEAD_DIM, FULL_COS, INTERLEAVED)
    row_base = rows.to(tl.int64)[:, None, None] * (HEADS * HEAD_DIM)
    for h0 in range(0, HEADS, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        base = row_base + heads[None, :, None] * HEAD_DIM
        ok = row_ok[:, None, None] & (heads < HEADS)[None, :, None]
        if INTERLEAVED:
            # One contiguous [.., 2 * BLOCK_P] load, split into pairs in registers: the a and b
            # elements alternate in memory, and two stride-2 loads would not vectorize.
            cols = tl.arange(0, 2 * BLOCK_P)[None, None, :]
            mask = ok & (cols < HEAD_DIM)
            x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
            xa, xb = tl.split(tl.reshape(x, (BLOCK_S, BLOCK_H, BLOCK_P, 2)))
            ya, yb = _rotate(xa, xb, ca, cb, sa, sb, BACKWARD)
            y = tl.reshape(tl.join(ya, yb), (BLOCK_S, BLOCK_H, 2 * BLOCK_P))
            tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            cols = pairs[None, None, :]
            mask = ok & pair_ok[None, None, :]
            xa = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
            xb = tl.load(x_ptr + base + HEAD_DIM // 2 + cols, mask=mask, other=0.0).to(tl.float32)
            ya, yb = _rotate(xa, xb, ca, cb, sa, sb, BACKWARD)
            tl.store(y_ptr + base + cols, ya.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(y_ptr + base + HEAD_DIM // 2 + cols, yb.to(y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# Config and launcher
# --------------------------------------------------------------------------------------------------

INTERPRET_TILE = 1 << 16  # the interpreter pays per program, so its programs take many rows at once
TILE = 8192  # elements of x per program and head-loop step on a GPU (16 KiB of bf16 in flight)


def default_config(n_rows: int, heads: int, head_dim: int, backend: str) -> L.Config:
    """Every head of BLOCK_S rows per program where a row fits the tile (heads * head_dim <= TILE),
    else BLOCK_H heads at a time in a loop over the heads.

    H200 sweep, forward at 4x4096x32x128 bf16 (2 rows x 32 heads x 8 warps is this config):
    half rotation 2x32, 8 warps 0.072 ms (3.72 TB/s), 1x32 / 2x32 with 4 warps 3.56-3.59, 4 rows
    3.15-3.50, 8-16 rows 2.1-3.0; interleaved 1x32 / 2x32 3.55-3.69 TB/s, 4-16 rows 3.33-3.50.
    Smaller tiles keep more programs in flight per SM; larger ones gain nothing on a streaming op."""
    block_p = L.next_pow2(head_dim // 2)
    tile = INTERPRET_TILE if backend == "interpret" else TILE
    block_h = min(L.next_pow2(heads), max(1, tile // (2 * block_p)))
    block_s = min(L.next_pow2(n_rows), max(1, tile // (2 * block_p * block_h)))
    meta = {"BLOCK_S": block_s, "BLOCK_H": block_h, "BLOCK_P": block_p}
    if backend == "interpret":
        return L.Config.of(**meta)
    return L.Config.of(num_warps=4 if block_s * block_h * block_p <= 2048 else 8, **meta)


def _launch(x, cos, sin, rows_per_table, *, backward, interleaved, out_dtype, backend, config):
    """One launch over x [batch, seq, heads, head_dim] (its rows: batch x seq); cos and sin
    [tables, seq, width] hold n_rows / rows_per_table tables, one after another."""
    n_rows, (heads, head_dim) = _rows(x), x.shape[-2:]
    consts = {"HEADS": heads, "HEAD_DIM": head_dim, "FULL_COS": cos.shape[-1] == head_dim,
              "INTERLEAVED": interleaved, "BACKWARD": backward}
    return L.launch(_rope, x, cos, sin, n_rows, cos.shape[-2], rows_per_table,
                    kernel="rope_bwd" if backward else "rope_fwd",
                    out_shapes=[jax.ShapeDtypeStruct(x.shape, out_dtype)],
                    grid=(L.cdiv(n_rows, config["BLOCK_S"]),), config=config, backend=backend,
                    constexprs=consts)[0]


def _rows(x) -> int:
    return x.shape[0] * x.shape[1]


def _batch(args, dims, *, constexprs, scalars, out_shapes, backend, config, **_):
    """Fold the vmapped axis into the batch. A shared table stays one table; a vmapped one (or a
    table already folded by an inner vmap) becomes one table per example, each example's rows after
    the previous one's, so row r still finds its angles at (r // rows_per_table) * seq + r % seq."""
    x, cos, sin = args
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    move = lambda a, d: jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
    x = move(x, dims[0])
    n_rows, seq, rows_per_table = (v for _, v in sorted(scalars))
    one_table = rows_per_table == n_rows
    if dims[1] is None and dims[2] is None and one_table:
        rows_per_table = size * n_rows
    else:  # per-example tables: materialize them (they are small next to x)
        cos, sin = (move(t, d).reshape(-1, *t.shape[-2:]) for t, d in ((cos, dims[1]), (sin, dims[2])))
    flags = dict(constexprs)
    y = _launch(x.reshape(size * x.shape[1], *x.shape[2:]), cos, sin, rows_per_table,
                backward=flags["BACKWARD"], interleaved=flags["INTERLEAVED"],
                out_dtype=out_shapes[0].dtype, backend=backend, config=config)
    return [y.reshape(x.shape)], [0]


def _split(params) -> L.Split:
    """x [batch, seq, heads, head_dim] splits across devices along its batch (one shared table
    whole on every device, else whole tables with their examples), its heads (tensor parallelism
    shards q's and k's; the tables are the same for every head) and its sequence (sequence or
    context parallelism; the tables split with it), any of them at once."""
    n_rows, seq, rows_per_table = (v for _, v in sorted(params["scalars"]))
    one_table = rows_per_table == n_rows
    flags = dict(params["constexprs"])

    def relaunch(x, cos, sin, **_):
        per_table = _rows(x) if one_table else rows_per_table * cos.shape[-2] // seq
        return [_launch(x, cos, sin, per_table, backward=flags["BACKWARD"], interleaved=flags["INTERLEAVED"],
                        out_dtype=params["out_shapes"][0].dtype, backend=params["backend"],
                        config=params["config"])]

    heads = {"heads_args": (2, None, None), "heads_outs": (2,), "heads_fits": lambda parts: True,
             "heads_rows": True}
    if one_table:
        split = L.Split((L.ROWS, L.SHARED, L.SHARED), (L.ROWS,), relaunch, **heads)
    else:
        split = L.Split((L.ROWS, L.ROWS, L.ROWS), (L.ROWS,), relaunch,
                        fits=lambda parts: (n_rows // rows_per_table) % parts == 0, **heads)
    sequence = dataclasses.replace(split, heads_args=(1, 1, 1), heads_outs=(1,),
                                   heads_fits=lambda parts: seq % parts == 0)
    return dataclasses.replace(split, heads_else=sequence)


for _name in ("rope_fwd", "rope_bwd"):
    L.def_batching(_name, _batch)
    L.def_split(_name, _split)


# --------------------------------------------------------------------------------------------------
# Differentiation: residuals are cos and sin (and x only when cos or sin is differentiated)
# --------------------------------------------------------------------------------------------------

@L.varying_alike
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _rope_rows(x4, cos, sin, interleaved, dtypes, backend, config):
    return _rope_rows_fwd(x4, cos, sin, interleaved, dtypes, backend, config)[0]


def _rope_rows_fwd(x4, cos, sin, interleaved, dtypes, backend, config):
    """dtypes: (x's, y's). Under differentiation (symbolic_zeros=True), each differentiable argument
    arrives as CustomVJPPrimal(value, perturbed): x is kept only when a table is differentiated
    (tables are usually constants), and dx is computed only when x is."""
    primal = lambda a: getattr(a, "value", a)  # (a plain array when called undifferentiated)
    perturbed = lambda a: getattr(a, "perturbed", False)
    keep_x = perturbed(cos) or perturbed(sin)
    # Whether dx is wanted travels as the residuals' pytree structure (() or None): residual leaves
    # must be arrays.
    want_dx = () if perturbed(x4) else None
    x4, cos, sin = primal(x4), primal(cos), primal(sin)
    y = _launch(x4, cos, sin, _rows(x4), backward=False, interleaved=interleaved, out_dtype=dtypes[1],
                backend=backend, config=config)
    return y, (cos, sin, x4 if keep_x else None, want_dx)


def _rope_rows_bwd(interleaved, dtypes, backend, config, residuals, dy):
    cos, sin, x4, want_dx = residuals
    if isinstance(dy, jax.custom_derivatives.SymbolicZero):
        return None, None, None
    dx = None if want_dx is None else _launch(
        dy, cos, sin, _rows(dy), backward=True, interleaved=interleaved, out_dtype=dtypes[0], backend=backend,
        config=config)
    if x4 is None:
        return dx, None, None
    # XLA differentiates the definition with respect to the tables, x held fixed.
    _, tables_vjp = jax.vjp(lambda c, s: reference(x4, c[0], s[0], interleaved, dtypes[1]), cos, sin)
    dcos, dsin = tables_vjp(dy)
    return dx, dcos, dsin


_rope_rows.defvjp(_rope_rows_fwd, _rope_rows_bwd, symbolic_zeros=True)


# --------------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------------

def _check(x, cos, sin, interleaved, out_dtype) -> None:
    op = "rope"
    for name, v in (("x", x), ("cos", cos), ("sin", sin)):
        if not hasattr(v, "dtype") or not hasattr(v, "shape"):
            raise TypeError(f"{op}: {name} must be a jax or numpy array; got {type(v).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: x must have dtype float32, bfloat16 or float16; got {x.dtype}")
    if x.ndim < 3:
        raise ValueError(f"{op}: x must have shape [..., seq, heads, head_dim]; got {tuple(x.shape)}")
    seq, head_dim = x.shape[-3], x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"{op}: x must have an even head_dim (its last axis); got {head_dim}")
    widths = ((seq, head_dim // 2), (seq, head_dim))
    if tuple(cos.shape) not in widths:
        raise ValueError(f"{op}: cos must have shape {widths[0]} or {widths[1]} ([seq, head_dim // 2] "
                         f"or [seq, head_dim] of x); got {tuple(cos.shape)}")
    if tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"{op}: sin must have cos's shape {tuple(cos.shape)}; got {tuple(sin.shape)}")
    for name, v in (("cos", cos), ("sin", sin)):
        if v.dtype not in (jnp.float32, x.dtype):
            raise TypeError(f"{op}: {name} must have dtype float32 or x's ({x.dtype}); got {v.dtype}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"{op}: interleaved must be a bool; got {interleaved!r}")
    if out_dtype is not None and L.dtype_or_none(out_dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: out_dtype must be float32, bfloat16, float16 or None; got {out_dtype!r}")


def rope(x, cos, sin, *, interleaved: bool = False, out_dtype=None, backend: str | None = None):
    """Rotary position embeddings: x * cos + rotate(x) * sin over x's last axis, float32 math.

    x: [..., seq, heads, head_dim] (jax.nn.dot_product_attention's layout; no batch axis is fine),
        float32, bfloat16 or float16, head_dim even.
    cos, sin: [seq, head_dim // 2] (one angle per pair) or [seq, head_dim] (one value per element),
        float32 or x's dtype; shared by every batch entry and head.
    interleaved: False rotates the halves (x[:d/2], x[d/2:]) (GPT-NeoX, HF Llama); True rotates
        adjacent pairs (x[2i], x[2i+1]) (GPT-J, Meta's Llama).
    out_dtype: the result's dtype (default x's); the math is float32 either way.
    Gradients flow to x through the transposed kernel, and to cos and sin (computed by XLA, only
    when they are differentiated).
    """
    _check(x, cos, sin, interleaved, out_dtype)
    backend = L.resolve_backend(backend)
    x, cos, sin = jnp.asarray(x), jnp.asarray(cos), jnp.asarray(sin)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if backend == "xla" or x.size == 0:
        return reference(x, cos, sin, interleaved, out_dtype)
    heads, head_dim = x.shape[-2:]
    # x as [batch, seq, heads, head_dim], the tables as one of [seq, width]: the launch's view keeps the
    # dims a mesh may shard (_split)
    x4 = x.reshape(-1, *x.shape[-3:])
    config = default_config(_rows(x4), heads, head_dim, backend)
    y = _rope_rows(x4, cos[None], sin[None], interleaved, (x.dtype, out_dtype), backend, config)
    return y.reshape(x.shape)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile cases
# --------------------------------------------------------------------------------------------------

def aot_cases():
    """(name, kernel, signature, config): both layouts, half- and full-width tables, forward and
    backward, in bfloat16 and float32 (half-width tables only for float32 pairs: Meta's complex form),
    at Llama's 32 heads of 128."""
    config = default_config(4 * 4096, 32, 128, "triton")
    for dtype in ("bf16", "fp32"):
        for interleaved in (False, True):
            for full in ((False, True) if dtype == "bf16" or not interleaved else (False,)):
                for backward in (False, True):
                    tag = (f"rope/{dtype}/{'interleaved' if interleaved else 'half'}/"
                           f"{'full' if full else 'half'}_cos/{'bwd' if backward else 'fwd'}")
                    yield (tag, _rope,
                           {"x_ptr": f"*{dtype}", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                            "n_rows": "i32", "seq": "i32", "rows_per_table": "i32",
                            "y_ptr": f"*{dtype}"},
                           config.replace(HEADS=32, HEAD_DIM=128, FULL_COS=full,
                                          INTERLEAVED=interleaved, BACKWARD=backward))
