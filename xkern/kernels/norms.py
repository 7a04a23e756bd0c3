"""LayerNorm and RMSNorm, optionally fused with a residual add: forward and backward Triton kernels,
launchers, custom_vjp, batching, and the public `layer_norm` / `rms_norm`.

The custom_vjp saves only h (the input, or x + residual). The backward recomputes each row's mean
and rstd from the row it must load anyway (register reductions, no extra memory traffic), so
nothing per row is stored, and a program that only needs gradients never runs the forward kernel.
Its row sums share cross-thread rounds (_input_grad), and one program per SM loops over the rows:
on the H200 (16384x8192 bf16, kernel alone) the layer norm backward went from 3.18 to 3.66 TB/s
(2 rounds instead of 3), RMS norm's from 3.72 to 3.88 (1 instead of 2).

The math the kernels must match (float32 inside), per row of n values, h = x (+ residual):

    layer norm  mean = sum(h)/n   rstd = rsqrt(sum((h-mean)^2)/n + eps)   y = (h-mean)*rstd*scale + bias
    rms norm    mean = 0          rstd = rsqrt(sum(h^2)/n + eps)          y = h*rstd*scale
    backward    hhat = (h-mean)*rstd, g = dy*scale
                dh = rstd * (g - hhat*mean(g*hhat) - [layer norm] mean(g)) + d(h output)
                dscale = sum_rows(dy*hhat), dbias = sum_rows(dy)   (per-program partial sums, then XLA)
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from xkern.kernels import launch as L  # first: it fixes Triton's mode before the kernels below exist
from xkern.kernels.launch import number_error, static_number

import triton
import triton.language as tl

from xkern.tuning.configs import one_block_rows

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_COLS = 16384  # widest row the one-block kernels keep in registers; wider rows use XLA
# Widest row the backward kernel takes, by op; wider rows (the forward kernel still runs) get XLA's
# backward. Past 8192 columns the RMS backward's row tiles and sums no longer fit in registers: on an
# H200, value and gradient of 8192x16384 bf16 took 2.90 ms through the kernel against 0.33 through
# XLA; layer norm's kernel still beat XLA there (1.01 against 1.10 ms), so it keeps it
# (benchmarks/results, twentieth session).
BWD_MAX_COLS = {False: MAX_COLS, True: 8192}  # rms -> columns
HALVES_FROM = 8192  # rows at least this wide (padded to a power of two) go through the forward in halves
STREAM_HINTS = True  # the forward's cache hints (see _input_tile); a switch for probes (read when traced)


def reference(x, scale, bias, eps, residual, rms: bool, out_dtype=None):
    """The definition the kernels are checked against (and the `xla` backend)."""
    h = x if residual is None else x + residual
    hf = h.astype(jnp.float32)
    if rms:
        y = hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + eps)
    else:
        mean = jnp.mean(hf, -1, keepdims=True)
        y = (hf - mean) * jax.lax.rsqrt(jnp.mean((hf - mean) ** 2, -1, keepdims=True) + eps)
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = y.astype(out_dtype or x.dtype)
    return y if residual is None else (y, h)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------

@triton.jit
def _normalize(h, mask, EPS: tl.constexpr, N_COLS: tl.constexpr, RMS: tl.constexpr):
    """(h - mean) and rstd of each row of the float32 tile h (the forward's; the backward's
    _input_grad reduces in fewer rounds, to float32 rounding of the same values)."""
    if RMS:
        centered = h
    else:
        centered = tl.where(mask, h - tl.sum(h, axis=1)[:, None] / N_COLS, 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1)[:, None] / N_COLS + EPS)
    return centered, rstd


@triton.jit
def _normalize_halves(h_a, h_b, mask_a, mask_b, EPS: tl.constexpr, N_COLS: tl.constexpr, RMS: tl.constexpr):
    """_normalize of a row held as two tiles: (h_a - mean), (h_b - mean) and rstd."""
    if RMS:
        centered_a, centered_b = h_a, h_b
    else:
        mean = (tl.sum(h_a, axis=1) + tl.sum(h_b, axis=1))[:, None] / N_COLS
        centered_a = tl.where(mask_a, h_a - mean, 0.0)
        centered_b = tl.where(mask_b, h_b - mean, 0.0)
    squares = tl.sum(centered_a * centered_a, axis=1) + tl.sum(centered_b * centered_b, axis=1)
    return centered_a, centered_b, tl.rsqrt(squares[:, None] / N_COLS + EPS)


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


# Triton's interpreter runs a reduce of a tuple element by element in Python (2.4-3.8 s per norm
# forward+backward at 64x300, against its vectorized tl.sum), so there the sums are taken one by one:
# the same math.
_INTERPRETED = tl.constexpr(L.INTERPRET)


@triton.jit
def _row_sums2(a, b):
    if _INTERPRETED:
        return tl.sum(a, axis=1), tl.sum(b, axis=1)
    return tl.reduce((a, b), 1, _add2)


@triton.jit
def _row_sums3(a, b, c):
    if _INTERPRETED:
        return tl.sum(a, axis=1), tl.sum(b, axis=1), tl.sum(c, axis=1)
    return tl.reduce((a, b, c), 1, _add3)


@triton.jit
def _input_grad(h, g, mask, EPS: tl.constexpr, N_COLS: tl.constexpr, RMS: tl.constexpr):
    """(hhat, dh / d(h) of the norm) for rows h with g = dy * scale, in as few cross-thread
    reduction rounds as exactness allows: mean(g * hhat) = rstd * (mean(g * h) - mean * mean(g)), so
    the sums of g * h and g ride with the statistics' first sum. Layer norm: sum(h), sum(g), sum(g * h)
    in one round, then the variance around the mean (two passes: E[h^2] - mean^2 would cancel when
    |mean| >> std); RMS norm: sum(h^2) and sum(g * h) in one round. mean * sum(g) only costs
    float32 rounding relative to g's scale, times |mean| / std."""
    if RMS:
        sum_sq, sum_gh = _row_sums2(h * h, g * h)
        rstd = tl.rsqrt(sum_sq[:, None] / N_COLS + EPS)
        hhat = h * rstd
        dh = (g - hhat * (rstd * sum_gh[:, None] / N_COLS)) * rstd
    else:
        sum_h, sum_g, sum_gh = _row_sums3(h, g, g * h)
        mean = sum_h[:, None] / N_COLS
        centered = tl.where(mask, h - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(centered * centered, axis=1)[:, None] / N_COLS + EPS)
        hhat = centered * rstd
        mean_g_hhat = rstd * (sum_gh[:, None] - mean * sum_g[:, None]) / N_COLS
        dh = (g - hhat * mean_g_hhat - sum_g[:, None] / N_COLS) * rstd
    return hhat, dh


@triton.jit
def _load_tile(ptr, offs, mask, MASKED: tl.constexpr, EVICT: tl.constexpr = ""):
    if MASKED:
        return tl.load(ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT)
    return tl.load(ptr + offs, eviction_policy=EVICT)


@triton.jit
def _store_tile(ptr, offs, value, mask, MASKED: tl.constexpr, CACHE: tl.constexpr = ""):
    if MASKED:
        tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=mask, cache_modifier=CACHE)
    else:
        tl.store(ptr + offs, value.to(ptr.dtype.element_ty), cache_modifier=CACHE)


# The forward's cache hints (STREAM): rows read and written once go through L2 marked to leave
# first (loads evict_first, stores .cs), so that scale and bias, which every row reads again
# (evict_last), stay there. H200, layer norm bf16 with float32 scale and bias, through xkern.ops:
# 3.89 TB/s against 3.78 without at 16384x8192, 3.47 against 3.36 at 8192x16384 (benchmarks/results,
# nineteenth session; no shape measured there lost).
@triton.jit
def _input_tile(x_ptr, r_ptr, h_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr, MASKED: tl.constexpr,
                STREAM: tl.constexpr):
    """h = x (+ r), float32. With a residual, h is rounded to its stored dtype first and stored: the
    statistics must be those of the h the backward pass reads back (and of x + r as the program
    computes it)."""
    once: tl.constexpr = "evict_first" if STREAM else ""
    h = _load_tile(x_ptr, offs, mask, MASKED, once).to(tl.float32)
    if HAS_RESIDUAL:
        h = (h + _load_tile(r_ptr, offs, mask, MASKED, once).to(tl.float32)).to(h_ptr.dtype.element_ty)
        _store_tile(h_ptr, offs, h, mask, MASKED, ".cs" if STREAM else "")
        h = h.to(tl.float32)
    return h


@triton.jit
def _output_tile(y_ptr, scale_ptr, bias_ptr, centered, rstd, offs, cols, mask, MASKED: tl.constexpr,
                 N_COLS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, STREAM: tl.constexpr):
    """y = centered * rstd (* scale) (+ bias), scale and bias loaded here, after the statistics, so
    that they are not live while the row is reduced."""
    again: tl.constexpr = "evict_last" if STREAM else ""
    y = centered * rstd
    if HAS_SCALE:
        y *= _load_tile(scale_ptr, cols, cols < N_COLS, MASKED, again).to(tl.float32)
    if HAS_BIAS:
        y += _load_tile(bias_ptr, cols, cols < N_COLS, MASKED, again).to(tl.float32)
    _store_tile(y_ptr, offs, y, mask, MASKED, ".cs" if STREAM else "")


@triton.jit
def _fwd(x_ptr, r_ptr, scale_ptr, bias_ptr,  # inputs: x, residual [n_rows, N_COLS]; scale, bias [N_COLS]
         n_rows,
         y_ptr, h_ptr,  # outputs: y, h = x + r (if HAS_RESIDUAL)
         EPS: tl.constexpr,  # a constexpr: a Python float argument would be float64 math
         N_COLS: tl.constexpr, RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
         HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, MASKED: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALVES: tl.constexpr, STREAM: tl.constexpr):
    """MASKED: False when every tile is whole (the launcher knows), so no element carries a
    predicate. HALVES: the row as two [BLOCK_M, BLOCK_N / 2] tiles whose outputs are written one
    after the other, each with its half of scale and bias loaded just then: fewer values live at
    once (H200, 16384x8192 bf16 with float32 scale and bias, layer norm 3.83 TB/s against 3.67-3.69
    with one tile, masked, and scale and bias live throughout; 3.75 with one tile, unmasked)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    row_base = rows.to(tl.int64) * N_COLS
    if HALVES:
        cols_a = tl.arange(0, BLOCK_N // 2)[None, :]
        cols_b = cols_a + BLOCK_N // 2
        mask_a, mask_b = (rows < n_rows) & (cols_a < N_COLS), (rows < n_rows) & (cols_b < N_COLS)
        h_a = _input_tile(x_ptr, r_ptr, h_ptr, row_base + cols_a, mask_a, HAS_RESIDUAL, MASKED, STREAM)
        h_b = _input_tile(x_ptr, r_ptr, h_ptr, row_base + cols_b, mask_b, HAS_RESIDUAL, MASKED, STREAM)
        centered_a, centered_b, rstd = _normalize_halves(h_a, h_b, mask_a, mask_b, EPS, N_COLS, RMS)
        _output_tile(y_ptr, scale_ptr, bias_ptr, centered_a, rstd, row_base + cols_a, cols_a, mask_a, MASKED,
                     N_COLS, HAS_SCALE, HAS_BIAS, STREAM)
        _output_tile(y_ptr, scale_ptr, bias_ptr, centered_b, rstd, row_base + cols_b, cols_b, mask_b, MASKED,
                     N_COLS, HAS_SCALE, HAS_BIAS, STREAM)
    else:
        cols = tl.arange(0, BLOCK_N)[None, :]
        mask = (rows < n_rows) & (cols < N_COLS)
        h = _input_tile(x_ptr, r_ptr, h_ptr, row_base + cols, mask, HAS_RESIDUAL, MASKED, STREAM)
        centered, rstd = _normalize(h, mask, EPS, N_COLS, RMS)
        _output_tile(y_ptr, scale_ptr, bias_ptr, centered, rstd, row_base + cols, cols, mask, MASKED, N_COLS,
                     HAS_SCALE, HAS_BIAS, STREAM)


@triton.jit
def _bwd(h_ptr, dy_ptr, dh_out_ptr, scale_ptr,  # inputs
         rows_per_seg,  # rows of one segment (one vmapped example; the whole input unbatched)
         dh_ptr, dscale_ptr, dbias_ptr,  # outputs: dh [n_rows, N_COLS]; partial sums [segs*programs, N_COLS]
         EPS: tl.constexpr, N_COLS: tl.constexpr, RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
         HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # A fixed number of programs per segment, each looping over every programs-th block of rows and
    # keeping its dscale/dbias sums in registers: one partial row per program, not per row block.
    pid, seg, programs = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    col_ok = cols < N_COLS
    dscale_acc = tl.zeros((BLOCK_N,), tl.float32)
    dbias_acc = tl.zeros((BLOCK_N,), tl.float32)
    seg_base = seg.to(tl.int64) * rows_per_seg
    # Pipelined by hand: the next block's h and dy are loaded before this block's math, so each
    # program keeps loads in flight while it reduces (without it the loop is latency-bound).
    local = pid * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    next_mask = (local < rows_per_seg) & col_ok
    next_offs = (seg_base + local) * N_COLS + cols
    h_next = tl.load(h_ptr + next_offs, mask=next_mask, other=0.0)
    dy_next = tl.load(dy_ptr + next_offs, mask=next_mask, other=0.0)
    for block in range(pid, tl.cdiv(rows_per_seg, BLOCK_M), programs):
        h, dy = h_next.to(tl.float32), dy_next.to(tl.float32)
        mask, offs = next_mask, next_offs
        local = (block + programs) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
        next_mask = (local < rows_per_seg) & col_ok
        next_offs = (seg_base + local) * N_COLS + cols
        h_next = tl.load(h_ptr + next_offs, mask=next_mask, other=0.0)
        dy_next = tl.load(dy_ptr + next_offs, mask=next_mask, other=0.0)
        g = dy
        if HAS_SCALE:  # re-read per block (from cache): fewer registers held across the loop
            g = dy * tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        hhat, dh = _input_grad(h, g, mask, EPS, N_COLS, RMS)
        if HAS_RESIDUAL:
            dh += tl.load(dh_out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dh_ptr + offs, dh.to(dh_ptr.dtype.element_ty), mask=mask)
        if EPS == 0.0:  # the zero rows past the end have hhat 0 * inf = NaN (with eps, 0)
            dscale_acc += tl.sum(tl.where(mask, dy * hhat, 0.0), axis=0)
        else:
            dscale_acc += tl.sum(dy * hhat, axis=0)
        dbias_acc += tl.sum(dy, axis=0)
    sums = (seg * programs + pid) * N_COLS + tl.arange(0, BLOCK_N)
    tl.store(dscale_ptr + sums, dscale_acc, mask=tl.arange(0, BLOCK_N) < N_COLS)
    tl.store(dbias_ptr + sums, dbias_acc, mask=tl.arange(0, BLOCK_N) < N_COLS)


# --------------------------------------------------------------------------------------------------
# Configs and launchers
# --------------------------------------------------------------------------------------------------

def default_config(n_rows: int, n_cols: int, backend: str, kernel: str = "fwd") -> L.Config:
    """Forward: the one-block row config of the generated kernels. Backward: the same rows, with
    warps enough that a thread holds at most 16 values of each [BLOCK_M, BLOCK_N] tile, since its
    programs also keep two [BLOCK_N] float32 sums live across their loop (4 warps on 8192-wide
    rows spill registers and run 20x slower)."""
    config = one_block_rows(n_rows, n_cols, backend)
    if kernel == "fwd" or backend == "interpret":
        return config
    per_warp = 32 * 16
    warps = min(16, max(4, L.next_pow2(config["BLOCK_M"] * config["BLOCK_N"] // per_warp)))  # 16: ROCm max
    return L.Config.of(num_warps=warps, **dict(config.meta))


def _flags(rms, has_residual, has_scale, has_bias=None) -> dict:
    flags = {"RMS": rms, "HAS_RESIDUAL": has_residual, "HAS_SCALE": has_scale}
    return flags if has_bias is None else {**flags, "HAS_BIAS": has_bias}


def _rows(x) -> int:
    """Rows of an array normalized over its last dim (the kernels read it as [rows, cols])."""
    return math.prod(x.shape[:-1])


def _launch_fwd(x2, r2, scale, bias, eps, *, rms, backend, config, out_dtype):
    n_rows, n_cols = _rows(x2), x2.shape[-1]
    dummy = jnp.zeros((1,), jnp.float32)  # stands for an absent operand (the flag keeps it unread)
    outs = [jax.ShapeDtypeStruct(x2.shape, out_dtype),
            jax.ShapeDtypeStruct(x2.shape if r2 is not None else (1,), x2.dtype)]
    whole = n_cols == config["BLOCK_N"] and n_rows % config["BLOCK_M"] == 0  # every tile: no masks
    # Halves: measured on 8192-wide rows; the interpreter takes them from 1024 on, so tests cover both.
    halves = config["BLOCK_N"] >= (1024 if backend == "interpret" else HALVES_FROM)
    consts = {"N_COLS": n_cols, "EPS": float(eps), "MASKED": not whole, "HALVES": halves, "STREAM": STREAM_HINTS,
              **_flags(rms, r2 is not None, scale is not None, bias is not None)}
    return L.launch(_fwd, x2, dummy if r2 is None else r2, dummy if scale is None else scale,
                    dummy if bias is None else bias, n_rows,
                    kernel="rms_norm_fwd" if rms else "layer_norm_fwd", out_shapes=outs,
                    grid=(L.cdiv(n_rows, config["BLOCK_M"]),), config=config, backend=backend,
                    constexprs=consts)


def bwd_programs(rows: int, block_m: int, backend: str) -> int:
    """Backward programs per segment: one per SM (each keeps its scale/bias sums in registers and
    writes one partial row), never more than there are row blocks. On the H200 at 16384x8192 bf16:
    layer norm 0.220 ms with one per SM, 0.225 with two, 0.231 with three (RMS: 0.207 / 0.214 / 0.217)."""
    if backend == "interpret":
        target = 4  # the interpreter runs programs one after another: fewer is as fast
    else:
        target = getattr(jax.devices()[0], "core_count", 132)
    return max(1, min(L.cdiv(rows, block_m), target))


def _launch_bwd(h2, dy2, dh_out2, scale, eps, *, rms, backend, config, segments=1):
    n_rows, n_cols = _rows(h2), h2.shape[-1]
    rows_per_seg = n_rows // segments
    programs = bwd_programs(rows_per_seg, config["BLOCK_M"], backend)
    dummy = jnp.zeros((1,), jnp.float32)
    outs = [jax.ShapeDtypeStruct(h2.shape, h2.dtype),
            jax.ShapeDtypeStruct((segments * programs, n_cols), jnp.float32),
            jax.ShapeDtypeStruct((segments * programs, n_cols), jnp.float32)]
    consts = {"N_COLS": n_cols, "EPS": float(eps), **_flags(rms, dh_out2 is not None, scale is not None)}
    return L.launch(_bwd, h2, dy2, dummy if dh_out2 is None else dh_out2,
                    dummy if scale is None else scale, rows_per_seg,
                    kernel="rms_norm_bwd" if rms else "layer_norm_bwd", out_shapes=outs,
                    grid=(programs, segments), config=config, backend=backend, constexprs=consts)


# --------------------------------------------------------------------------------------------------
# Differentiation: residuals are h, mean and rstd (per row), never the normalized values
# --------------------------------------------------------------------------------------------------

@L.varying_alike
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _norm_rows(x2, r2, scale, bias, eps, rms, backend, fwd_config, bwd_config, out_dtype):
    return _norm_rows_fwd(x2, r2, scale, bias, eps, rms, backend, fwd_config, bwd_config, out_dtype)[0]


def _norm_rows_fwd(x2, r2, scale, bias, eps, rms, backend, fwd_config, bwd_config, out_dtype):
    y, h = _launch_fwd(x2, r2, scale, bias, eps, rms=rms, backend=backend, config=fwd_config,
                       out_dtype=out_dtype)
    h = x2 if r2 is None else h
    out = (y, h) if r2 is not None else (y,)
    # Only h is saved: the backward recomputes each row's statistics from the row it loads anyway,
    # so when y itself is unused (a gradient-only program) the forward kernel is dead code.
    return out, (h, scale, bias, r2 is not None)


def _norm_rows_bwd(eps, rms, backend, fwd_config, bwd_config, out_dtype, residuals, cotangents):
    h, scale, bias, has_residual = residuals
    dy, dh_out = cotangents[0], (cotangents[1] if has_residual else None)
    if h.shape[-1] > BWD_MAX_COLS[rms]:
        dh, d_scale, d_bias = _xla_bwd(h, scale, bias, dy, eps, rms, out_dtype)
        dh = dh if dh_out is None else (dh.astype(jnp.float32) + dh_out.astype(jnp.float32)).astype(h.dtype)
        return dh, (dh if has_residual else None), d_scale, d_bias
    dh, dscale, dbias = _launch_bwd(h, dy, dh_out, scale, eps, rms=rms,
                                    backend=backend, config=bwd_config)
    d_scale = None if scale is None else jnp.sum(dscale, 0).astype(scale.dtype)
    d_bias = None if bias is None else jnp.sum(dbias, 0).astype(bias.dtype)
    return dh, (dh if has_residual else None), d_scale, d_bias


def _xla_bwd(h, scale, bias, dy, eps, rms, out_dtype):
    """XLA's derivative of the reference at h (rows wider than BWD_MAX_COLS[rms]): (dh, dscale, dbias)."""
    norm = lambda h, scale, bias: reference(h, scale, bias, eps, None, rms, out_dtype)
    dh, d_scale, d_bias = jax.vjp(norm, h, scale, bias)[1](dy.astype(out_dtype))
    return dh, d_scale, d_bias


_norm_rows.defvjp(_norm_rows_fwd, _norm_rows_bwd)


def _batch(args, dims, *, kernel, constexprs, scalars, backend, config, out_shapes, grid, **_):
    """Fold the vmapped axis into the rows when scale/bias are shared; the backward runs one segment
    of programs per example (grid axis 1), so each example gets its own partial sums: under a
    second vmap, one per example of each (the launch's own segments, each in turn per example)."""
    flags = dict(constexprs)
    rms, fwd = flags["RMS"], kernel.endswith("_fwd")
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    move = lambda a, d: jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
    if fwd:
        x, r, scale, bias = (move(a, d) if i < 2 else a for i, (a, d) in enumerate(zip(args, dims)))
        if dims[2] is not None or dims[3] is not None:
            return _batched_params_fwd(x, r, args[2:], dims[2:], flags, out_shapes)
        shape, n_cols = x.shape, x.shape[-1]
        rows = _rows(x) // size
        folded_r = r.reshape(size * rows, n_cols) if flags["HAS_RESIDUAL"] else None
        outs = _launch_fwd(x.reshape(size * rows, n_cols), folded_r,
                           scale if flags["HAS_SCALE"] else None, bias if flags["HAS_BIAS"] else None,
                           flags["EPS"], rms=rms, backend=backend, config=config,
                           out_dtype=out_shapes[0].dtype)
        y, h = outs
        h = h.reshape(shape) if flags["HAS_RESIDUAL"] else jnp.broadcast_to(h, (size, 1))
        return [y.reshape(shape), h], [0, 0]
    h, dy, dh_out, scale = args
    h, dy = move(h, dims[0]), move(dy, dims[1])
    if dims[3] is not None:
        dh_out = move(dh_out, dims[2]) if flags["HAS_RESIDUAL"] else None
        return _batched_params_bwd(h, dy, dh_out, jnp.moveaxis(scale, dims[3], 0), flags, out_shapes)
    shape, n_cols = h.shape, h.shape[-1]
    rows = _rows(h) // size
    folded_dh = move(dh_out, dims[2]).reshape(size * rows, n_cols) if flags["HAS_RESIDUAL"] else None
    dh, dscale, dbias = _launch_bwd(h.reshape(size * rows, n_cols), dy.reshape(size * rows, n_cols),
                                    folded_dh, scale if flags["HAS_SCALE"] else None,
                                    flags["EPS"], rms=rms, backend=backend, config=config,
                                    segments=size * grid[1])  # one segment per example
    return [dh.reshape(shape), dscale.reshape(size, -1, n_cols),
            dbias.reshape(size, -1, n_cols)], [0] * 3


# A scale or bias per example (vmap over a model ensemble's or per-example parameters): the kernels
# read one row of them for every row, so XLA computes these from the reference, example by example.

def _per_example(a, d, ndim: int):
    """scale / bias (absent: None) shaped to broadcast against [size, ..., cols] rows."""
    if a is None or d is None:
        return a
    a = jnp.moveaxis(a, d, 0)
    return a.reshape(a.shape[0], *[1] * (ndim - 2), a.shape[-1])


def _batched_params_fwd(x, r, params, dims, flags, out_shapes):
    h = x + r if flags["HAS_RESIDUAL"] else x
    scale, bias = (_per_example(a, d, h.ndim) if flags[flag] else None
                   for a, d, flag in zip(params, dims, ("HAS_SCALE", "HAS_BIAS")))
    y = reference(h, scale, bias, flags["EPS"], None, flags["RMS"], out_shapes[0].dtype)
    h = h if flags["HAS_RESIDUAL"] else jnp.zeros((x.shape[0], 1), out_shapes[1].dtype)
    return [y, h], [0, 0]


def _batched_params_bwd(h, dy, dh_out, scale, flags, out_shapes):
    """(dh, dscale, dbias) of each example; each example's sums in its first partial row."""
    def one(h, dy, scale):
        return _xla_bwd(h, scale, jnp.zeros_like(scale), dy, flags["EPS"], flags["RMS"], dy.dtype)
    dh, dscale, dbias = jax.vmap(one)(h, dy, scale)
    if dh_out is not None:
        dh = (dh.astype(jnp.float32) + dh_out.astype(jnp.float32)).astype(h.dtype)
    partials = lambda sums: jnp.zeros((h.shape[0], *out_shapes[1].shape), jnp.float32).at[:, 0].set(sums)
    return [dh.astype(out_shapes[0].dtype), partials(dscale), partials(dbias)], [0] * 3


def _split(params) -> L.Split:
    """Rows split across devices; scale and bias are shared, and the backward's scale/bias partial
    sums are SUMMED (jnp.sum reads them). A backward in segments (one per vmapped example) runs
    whole: its partials are summed per segment. The launch's view keeps x's leading dims (_norm), so
    it also splits along any one of them (L.with_row_dims: a sequence that sequence parallelism
    shards, under a batch or not; per-head norms' heads); else, where the features are sharded,
    along them (_features_split)."""
    flags, fwd = dict(params["constexprs"]), params["kernel"].endswith("_fwd")
    residual = L.ROWS if flags["HAS_RESIDUAL"] else L.SHARED
    opt = lambda a, flag: a if flags[flag] else None
    if fwd:
        def relaunch(x, r, scale, bias, **_):
            return _launch_fwd(x, opt(r, "HAS_RESIDUAL"), opt(scale, "HAS_SCALE"), opt(bias, "HAS_BIAS"),
                               flags["EPS"], rms=flags["RMS"], backend=params["backend"],
                               config=params["config"], out_dtype=params["out_shapes"][0].dtype)
        split = L.Split((L.ROWS, residual, L.SHARED, L.SHARED), (L.ROWS, residual), relaunch)
    else:
        def relaunch(h, dy, dh_out, scale, **_):
            return _launch_bwd(h, dy, opt(dh_out, "HAS_RESIDUAL"), opt(scale, "HAS_SCALE"), flags["EPS"],
                               rms=flags["RMS"], backend=params["backend"], config=params["config"])
        split = L.Split((L.ROWS, L.ROWS, residual, L.SHARED), (L.ROWS, L.SUMMED, L.SUMMED), relaunch,
                        fits=lambda parts: params["grid"][1] == 1)
    last = len(params["out_shapes"][0].shape) - 1  # (y's / dh's shape is x's view)
    return L.with_row_dims(split, last, then=dataclasses.replace(split, **_features_split(params, flags, fwd)))


def _features_split(params, flags, fwd) -> dict:
    """The second split along the normalized features, where a program shards them (Auto axes: XLA's
    propagation; a constrained or typed input is left to XLA at the rewrite): the kernels read whole
    rows, so there XLA computes each device's share, the row statistics all-reduced, as jax.jit
    does, where the launch would gather every row first."""
    last = len(params["out_shapes"][0].shape) - 1
    opt = lambda dim, flag: dim if flags[flag] else None
    if fwd:
        return dict(heads_args=(last, opt(last, "HAS_RESIDUAL"), opt(0, "HAS_SCALE"), opt(0, "HAS_BIAS")),
                    heads_outs=(last, opt(last, "HAS_RESIDUAL")), heads_fits=lambda parts: True,
                    heads_relaunch=_features_fwd)
    return dict(heads_args=(last, last, opt(last, "HAS_RESIDUAL"), opt(0, "HAS_SCALE")), heads_outs=(last, 1, 1),
                heads_fits=lambda parts: True, heads_relaunch=_features_bwd)


def _row_mean(v, heads, n_cols: int):
    """The mean of each row whose n_cols columns are split across devices `heads`."""
    return jax.lax.psum(jnp.sum(v, -1, keepdims=True), heads) / n_cols


def _shares_normalized(hf, flags, heads):
    """(normalized h, rstd) of float32 rows whose features are split across devices `heads`."""
    if not flags["RMS"]:
        hf = hf - _row_mean(hf, heads, flags["N_COLS"])
    rstd = jax.lax.rsqrt(_row_mean(hf * hf, heads, flags["N_COLS"]) + flags["EPS"])
    return hf * rstd, rstd


def _features_fwd(x, r, scale, bias, *, heads, constexprs, out_shapes, **_):
    """reference(), on this device's share of the features (see _features_split)."""
    flags = dict(constexprs)
    h = x + r if flags["HAS_RESIDUAL"] else x
    y, _ = _shares_normalized(h.astype(jnp.float32), flags, heads)
    y = y * scale.astype(jnp.float32) if flags["HAS_SCALE"] else y
    y = y + bias.astype(jnp.float32) if flags["HAS_BIAS"] else y
    return [y.astype(out_shapes[0].dtype), h if flags["HAS_RESIDUAL"] else jnp.zeros((1,), out_shapes[1].dtype)]


def _features_bwd(h, dy, dh_out, scale, *, heads, rows, constexprs, out_shapes, **_):
    """The backward kernel's outputs, on this device's share of the features: dh, and the scale's and
    bias's gradients (their first partial row, summed over the rows' devices: launch.SUMMED)."""
    flags = dict(constexprs)
    xhat, rstd = _shares_normalized(h.astype(jnp.float32), flags, heads)
    dy = dy.astype(jnp.float32)
    dxhat = dy * scale.astype(jnp.float32) if flags["HAS_SCALE"] else dy
    row_mean = functools.partial(_row_mean, heads=heads, n_cols=flags["N_COLS"])
    centered = dxhat if flags["RMS"] else dxhat - row_mean(dxhat)
    dh = rstd * (centered - xhat * row_mean(dxhat * xhat))
    dh = dh + dh_out.astype(jnp.float32) if flags["HAS_RESIDUAL"] else dh
    over_rows = lambda v: jnp.sum(v.reshape(-1, v.shape[-1]), 0)
    partials = lambda total: jnp.zeros((out_shapes[1].shape[0], total.shape[0]), jnp.float32).at[0].set(
        jax.lax.psum(total, rows) if rows else total)
    return [dh.astype(out_shapes[0].dtype), partials(over_rows(dy * xhat)), partials(over_rows(dy))]


for _name in ("layer_norm_fwd", "rms_norm_fwd", "layer_norm_bwd", "rms_norm_bwd"):
    L.def_batching(_name, _batch)
    L.def_split(_name, _split)


# --------------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------------

def _as_array(op, name, value):
    """An optional array argument as an array: lists and other array-likes converted, as jax.numpy
    functions take them."""
    if value is None or (hasattr(value, "dtype") and hasattr(value, "shape")):
        return value
    try:
        return jnp.asarray(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{op}: {name} must be an array (or array-like) or None; got {type(value).__name__}") from e


def _norm(op, x, scale, bias, eps, residual, backend, rms, out_dtype):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{op}: x must be a jax or numpy array; got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: x must have dtype float32, bfloat16 or float16; got {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{op}: x must have at least one dimension; got a scalar")
    scale, bias, residual = (_as_array(op, name, v) for name, v in
                             (("scale", scale), ("bias", bias), ("residual", residual)))
    for name, v in (("scale", scale), ("bias", bias)):
        if v is not None and not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"{op}: {name} must have a floating-point dtype; got {v.dtype}")
        if v is not None and tuple(jnp.shape(v)) != (x.shape[-1],):
            raise ValueError(f"{op}: {name} must have shape ({x.shape[-1]},) (x's last axis); "
                             f"got {tuple(jnp.shape(v))}")
    if residual is not None and (residual.shape, residual.dtype) != (x.shape, x.dtype):
        raise ValueError(f"{op}: residual must match x ({x.dtype}{list(x.shape)}); "
                         f"got {residual.dtype}{list(residual.shape)}")
    number = static_number(eps)
    if number is None or not number >= 0:
        raise number_error(op, "eps", "a non-negative number", eps)
    eps = number
    if out_dtype is not None and L.dtype_or_none(out_dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: out_dtype must be float32, bfloat16, float16 or None; got {out_dtype!r}")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    backend = L.resolve_backend(backend)
    n_cols = x.shape[-1]
    if backend == "xla" or x.size == 0 or n_cols > MAX_COLS:
        return reference(x, scale, bias, eps, residual, rms, out_dtype)
    # Launched on a view that keeps x's leading dims, which a mesh may shard along any one of them
    # (_split): merged into one, a sequence sharded under a batch could not stay sharded.
    x2 = L.rows_view(jnp.asarray(x))
    r2 = None if residual is None else L.rows_view(jnp.asarray(residual))
    configs = [default_config(_rows(x2), n_cols, backend, kernel) for kernel in ("fwd", "bwd")]
    outs = _norm_rows(x2, r2, scale, bias, eps, rms, backend, *configs, out_dtype)
    y = outs[0].reshape(x.shape)
    return y if residual is None else (y, outs[1].reshape(x.shape))


def layer_norm(x, scale=None, bias=None, eps: float = 1e-6, *, residual=None, out_dtype=None,
               backend: str | None = None):
    """LayerNorm over the last axis, float32 math, y in `out_dtype` (default: x's); with
    `residual`, normalizes x + residual and returns (y, x + residual). Rows wider than 16384 run
    through XLA."""
    return _norm("layer_norm", x, scale, bias, eps, residual, backend, False, out_dtype)


def rms_norm(x, scale=None, eps: float = 1e-6, *, bias=None, residual=None, out_dtype=None,
             backend: str | None = None):
    """RMSNorm over the last axis, float32 math, then `* scale + bias` (a bias, as Equinox's RMSNorm
    has by default); with `residual`, as `layer_norm`."""
    return _norm("rms_norm", x, scale, bias, eps, residual, backend, True, out_dtype)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile cases
# --------------------------------------------------------------------------------------------------

def aot_cases():
    """(name, kernel, signature, config) for both kernels, both norms, with and without residual, at
    8192 columns (the forward in halves, unmasked); and the forward at 1000 (one tile, masked)."""
    signature = lambda dtype: {"x_ptr": f"*{dtype}", "r_ptr": f"*{dtype}", "scale_ptr": "*fp32", "bias_ptr": "*fp32",
                               "n_rows": "i32", "y_ptr": f"*{dtype}", "h_ptr": f"*{dtype}"}
    yield ("layer_norm/bf16/residual/1000_cols/fwd", _fwd, signature("bf16"), default_config(16384, 1000, "triton").replace(
        N_COLS=1000, EPS=1e-6, RMS=False, HAS_RESIDUAL=True, HAS_SCALE=True, HAS_BIAS=True, MASKED=True,
        HALVES=False, STREAM=True))
    for dtype in ("fp32", "bf16"):
        for rms in (False, True):
            for residual in (False, True):
                config, bwd_config = (default_config(16384, 8192, "triton", k).replace(
                    N_COLS=8192, EPS=1e-6, RMS=rms, HAS_RESIDUAL=residual, HAS_SCALE=True) for k in ("fwd", "bwd"))
                tag = f"{'rms' if rms else 'layer'}_norm/{dtype}{'/residual' if residual else ''}"
                yield f"{tag}/fwd", _fwd, signature(dtype), config.replace(HAS_BIAS=not rms, MASKED=False, HALVES=True,
                                                                           STREAM=True)
                yield (f"{tag}/bwd", _bwd,
                       {"h_ptr": f"*{dtype}", "dy_ptr": f"*{dtype}", "dh_out_ptr": f"*{dtype}",
                        "scale_ptr": "*fp32", "rows_per_seg": "i32",
                        "dh_ptr": f"*{dtype}", "dscale_ptr": "*fp32", "dbias_ptr": "*fp32"}, bwd_config)
