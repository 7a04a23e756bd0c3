"""Softmax and log-softmax over one or more axes: forward and backward Triton kernels, launchers,
configs, custom_vjp, batching, and the public `softmax` and `log_softmax`.

The math the kernels must match (fp32 inside, whatever the input dtype), per row:

    softmax      y = exp(x - max(x)) / sum(exp(x - max(x)))   dx = y * (dy - sum(y * dy))
    log_softmax  y = x - max(x) - log(sum(exp(x - max(x))))   dx = dy - exp(y) * sum(dy)

softmax's backward reads the saved output y; log_softmax's reads the saved input x and recomputes
exp(y) = softmax(x), as XLA does: when only the gradient is used, XLA drops the forward kernel and
a training step moves three tensors (x, dy, dx), not five (y written, then read back). The LOG
constexpr picks the variant.

Rows that fit in registers take the one-block kernels (BLOCK_M rows of BLOCK_N >= n columns per
program: one read, one write). Longer rows take the online kernels: a pass that keeps a running max
and sum per lane, then a pass that writes y (forward); a pass for sum(y * dy), then one for dx
(backward). The config's BLOCK_N < n selects the online kernels.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from xkern.kernels import launch as L  # first: it fixes Triton's mode before the kernels below exist

import triton
import triton.language as tl

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def reference(x, axis=-1, log=False):
    """The definition the kernels are checked against (and the `xla` backend)."""
    return jax.nn.log_softmax(x, axis=axis) if log else jax.nn.softmax(x, axis=axis)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------

@triton.jit
def _fwd_rows(x_ptr,  # input: [n_rows, N_COLS] row-major
              n_rows,  # size; the row length is the constexpr N_COLS
              y_ptr,  # output: like x
              N_COLS: tl.constexpr, LOG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < n_rows) & (cols < N_COLS)
    offs = rows.to(tl.int64) * N_COLS + cols
    x = tl.load(x_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
    # Masked lanes are excluded with where(), not by their -inf: a row of -inf must give NaN, as in jax.
    shifted = x - tl.max(x, axis=1)[:, None]
    e = tl.where(mask, tl.exp(shifted), 0.0)
    if LOG:
        y = shifted - tl.log(tl.sum(e, axis=1))[:, None]
    else:
        y = e * (1.0 / tl.sum(e, axis=1))[:, None]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_max_and_sum(x_row, N_COLS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(max, sum of exp(x - max)) of one row, streamed: per-lane running max and sum,
    combined once at the end (no cross-lane reduction per block)."""
    cols = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_N], -float("inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, N_COLS, BLOCK_N):
        x = tl.load(x_row + start + cols, mask=start + cols < N_COLS, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # While a lane has seen only -inf, rescale against 0 instead (-inf - -inf would be NaN).
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    m_row = tl.max(m, axis=0)
    m_row_safe = tl.where(m_row == -float("inf"), 0.0, m_row)
    return m_row, tl.sum(s * tl.exp(m - m_row_safe), axis=0)


@triton.jit
def _fwd_online(x_ptr,  # input: [n_rows, N_COLS] row-major
                n_rows,  # size; the row length is the constexpr N_COLS
                y_ptr,  # output: like x
                N_COLS: tl.constexpr, LOG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = x_ptr + row * N_COLS, y_ptr + row * N_COLS
    cols = tl.arange(0, BLOCK_N)
    m_row, total = _row_max_and_sum(x_row, N_COLS, BLOCK_N)
    inv, log_total = 1.0 / total, tl.log(total)
    for start in range(0, N_COLS, BLOCK_N):
        mask = start + cols < N_COLS
        x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        if LOG:
            y = (x - m_row) - log_total
        else:
            y = tl.exp(x - m_row) * inv
        tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_rows(saved_ptr, dy_ptr,  # inputs: [n_rows, N_COLS] row-major; saved: y (softmax) or x (LOG)
              n_rows,  # size; the row length is the constexpr N_COLS
              dx_ptr,  # output: like x
              N_COLS: tl.constexpr, LOG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < n_rows) & (cols < N_COLS)
    offs = rows.to(tl.int64) * N_COLS + cols
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if LOG:  # softmax(x) as the forward computes it (NaN rows where its y is NaN)
        x = tl.load(saved_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
        e = tl.where(mask, tl.exp(x - tl.max(x, axis=1)[:, None]), 0.0)
        p = e * (1.0 / tl.sum(e, axis=1))[:, None]
        dx = dy - p * tl.sum(dy, axis=1)[:, None]
    else:
        y = tl.load(saved_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dx = y * (dy - tl.sum(y * dy, axis=1)[:, None])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_online(saved_ptr, dy_ptr,  # inputs: [n_rows, N_COLS] row-major; saved: y (softmax) or x (LOG)
                n_rows,  # size; the row length is the constexpr N_COLS
                dx_ptr,  # output: like x
                N_COLS: tl.constexpr, LOG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    saved_row, dy_row, dx_row = saved_ptr + row * N_COLS, dy_ptr + row * N_COLS, dx_ptr + row * N_COLS
    cols = tl.arange(0, BLOCK_N)
    if LOG:
        m_row, total = _row_max_and_sum(saved_row, N_COLS, BLOCK_N)
        log_total = tl.log(total)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, N_COLS, BLOCK_N):
        mask = start + cols < N_COLS
        dy = tl.load(dy_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            acc += dy
        else:
            acc += tl.load(saved_row + start + cols, mask=mask, other=0.0).to(tl.float32) * dy
    dot = tl.sum(acc, axis=0)
    for start in range(0, N_COLS, BLOCK_N):
        mask = start + cols < N_COLS
        dy = tl.load(dy_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            x = tl.load(saved_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
            dx = dy - tl.exp((x - m_row) - log_total) * dot
        else:
            y = tl.load(saved_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            dx = y * (dy - dot)
        tl.store(dx_row + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------

MAX_ROW_BLOCK = 32768  # widest row kept whole in registers; longer rows take the online kernels
INTERPRET_TILE = 1 << 16  # the interpreter pays per program, so its programs take many rows at once


def default_config(n_rows: int, n_cols: int, backend: str, kernel: str = "fwd") -> L.Config:
    """The launch config of the `kernel` ("fwd" or "bwd") of an [n_rows, n_cols] softmax.

    From a sweep on an H200 (benchmarks/sweep_softmax.py; results in benchmarks/results/): whole rows
    up to 32768 beat the online kernels (4096x32768 fwd 0.168 vs 0.190 ms); programs of ~4096
    elements want 4 warps, wider ones 16; long rows stream 8192-wide blocks forward and 2048-wide
    blocks backward, 16 warps each.
    """
    block_n = L.next_pow2(n_cols)
    if backend == "interpret":
        if block_n > INTERPRET_TILE:
            return L.Config.of(BLOCK_M=1, BLOCK_N=INTERPRET_TILE)
        return L.Config.of(BLOCK_M=min(L.next_pow2(n_rows), INTERPRET_TILE // block_n), BLOCK_N=block_n)
    if block_n > MAX_ROW_BLOCK:
        return L.Config.of(BLOCK_M=1, BLOCK_N=8192 if kernel == "fwd" else 2048, num_warps=16)
    # At least 4096 elements a program, so short rows do not leave each program a sliver of work.
    block_m = max(1, min(L.next_pow2(n_rows), 4096 // block_n))
    return L.Config.of(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4 if block_m * block_n <= 4096 else 16)


def _grid(n_rows: int, n_cols: int, config: L.Config) -> tuple[int]:
    if config["BLOCK_N"] < n_cols:  # online kernels: one row a program
        return (n_rows,)
    return (L.cdiv(n_rows, config["BLOCK_M"]),)


def _check_config(config: L.Config, n_cols: int) -> L.Config:
    if not isinstance(config, L.Config):
        raise TypeError(f"config must be an xkern.kernels.launch.Config; got {type(config).__name__}")
    for name in ("BLOCK_M", "BLOCK_N"):
        value = dict(config.meta).get(name)
        if not (isinstance(value, int) and value >= 1 and value & (value - 1) == 0):
            raise ValueError(f"config.{name} must be a power of two; got {value!r}")
    if config["BLOCK_N"] < n_cols and config["BLOCK_M"] != 1:
        raise ValueError("config: the online kernels (BLOCK_N < row length) take BLOCK_M=1")
    return config


# --------------------------------------------------------------------------------------------------
# Launchers (on [n_rows, n_cols] arrays) and their batching rules
# --------------------------------------------------------------------------------------------------

def _launch_fwd(x2, *, backend, config, constexprs, out_shapes, **_):
    """y = softmax(x) rows, in out_shapes[0]'s dtype (the batching rule passes the equation's own)."""
    n_rows, n_cols = L.n_rows(x2), x2.shape[-1]
    fn = _fwd_online if config["BLOCK_N"] < n_cols else _fwd_rows
    name = "log_softmax_fwd" if dict(constexprs)["LOG"] else "softmax_fwd"
    out = jax.ShapeDtypeStruct(x2.shape, out_shapes[0].dtype)
    return L.launch(fn, x2, n_rows, kernel=name, out_shapes=[out], grid=_grid(n_rows, n_cols, config),
                    config=config, backend=backend, constexprs=dict(constexprs))


def _launch_bwd(saved2, dy2, *, backend, config, constexprs, out_shapes, **_):
    """dx rows from dy and the saved y (softmax) or x (log_softmax), in out_shapes[0]'s dtype (x's)."""
    n_rows, n_cols = L.n_rows(saved2), saved2.shape[-1]
    fn = _bwd_online if config["BLOCK_N"] < n_cols else _bwd_rows
    name = "log_softmax_bwd" if dict(constexprs)["LOG"] else "softmax_bwd"
    out = jax.ShapeDtypeStruct(saved2.shape, out_shapes[0].dtype)
    return L.launch(fn, saved2, dy2, n_rows, kernel=name, out_shapes=[out],
                    grid=_grid(n_rows, n_cols, config), config=config, backend=backend,
                    constexprs=dict(constexprs))


def _split(params) -> L.Split:
    """Rows split across devices, along any of their dims (the views keep them: L.with_row_dims).
    So does a row sharded across them (logits sharded along the vocabulary, as tensor parallelism
    leaves them, sampled from): there the kernels, which read whole rows, give way to XLA on each
    device's share, the row's max and sum all-reduced, as jax.jit computes it, where running them
    would gather every row onto every device first."""
    fwd, last = params["kernel"].endswith("_fwd"), len(params["out_shapes"][0].shape) - 1
    n = 1 if fwd else 2
    return L.with_row_dims(L.Split((L.ROWS,) * n, (L.ROWS,), _launch_fwd if fwd else _launch_bwd,
                                   heads_args=(last,) * n, heads_outs=(last,), heads_fits=lambda parts: True,
                                   heads_relaunch=_shares_fwd if fwd else _shares_bwd), last)


def _shares_fwd(x2, *, heads, constexprs, out_shapes, **_):
    """jax.nn's softmax or log_softmax of rows split across devices `heads`, on this one's share."""
    x = x2.astype(jnp.float32)
    shifted = x - jax.lax.pmax(jnp.max(x, -1, keepdims=True), heads)
    total = jax.lax.psum(jnp.sum(jnp.exp(shifted), -1, keepdims=True), heads)
    y = shifted - jnp.log(total) if dict(constexprs)["LOG"] else jnp.exp(shifted) / total
    return [y.astype(out_shapes[0].dtype)]


def _shares_bwd(saved2, dy2, *, heads, constexprs, out_shapes, **_):
    """jax.nn's gradients, on this device's share: softmax's y * (dy - sum(dy * y)), log_softmax's
    dy - softmax(x) * sum(dy), the row sums all-reduced."""
    dy, row_sum = dy2.astype(jnp.float32), lambda v: jax.lax.psum(jnp.sum(v, -1, keepdims=True), heads)
    if dict(constexprs)["LOG"]:
        y = jnp.exp(_shares_fwd(saved2, heads=heads, constexprs=(("LOG", True),),
                                out_shapes=[jax.ShapeDtypeStruct(saved2.shape, jnp.float32)])[0])
        dx = dy - y * row_sum(dy)
    else:
        y = saved2.astype(jnp.float32)
        dx = y * (dy - row_sum(dy * y))
    return [dx.astype(out_shapes[0].dtype)]


for _prefix in ("softmax", "log_softmax"):
    L.def_batching(f"{_prefix}_fwd", L.batch_rows(_launch_fwd))
    L.def_batching(f"{_prefix}_bwd", L.batch_rows(_launch_bwd))
    L.def_split(f"{_prefix}_fwd", _split)
    L.def_split(f"{_prefix}_bwd", _split)


# --------------------------------------------------------------------------------------------------
# Differentiation: one residual, the output (softmax) or the input (log_softmax)
# --------------------------------------------------------------------------------------------------

def _constexprs(n_cols: int, log: bool) -> tuple:
    return (("LOG", log), ("N_COLS", n_cols))


@L.varying_alike
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _softmax_rows(x2, log, out_dtype, backend, fwd_config, bwd_config):
    return _softmax_rows_fwd(x2, log, out_dtype, backend, fwd_config, bwd_config)[0]


def _softmax_rows_fwd(x2, log, out_dtype, backend, fwd_config, bwd_config):
    y2 = _launch_fwd(x2, backend=backend, config=fwd_config, constexprs=_constexprs(x2.shape[-1], log),
                     out_shapes=[jax.ShapeDtypeStruct(x2.shape, out_dtype)])[0]
    # log_softmax saves x (its backward recomputes softmax(x)), softmax its output
    return y2, (x2 if log else y2, jnp.zeros((0,), x2.dtype))  # the empty array carries x's dtype


def _softmax_rows_bwd(log, out_dtype, backend, fwd_config, bwd_config, residuals, dy2):
    saved, x_dtype = residuals[0], residuals[1].dtype
    return (_launch_bwd(saved, dy2.astype(out_dtype), backend=backend, config=bwd_config,
                        constexprs=_constexprs(saved.shape[-1], log),
                        out_shapes=[jax.ShapeDtypeStruct(saved.shape, x_dtype)])[0],)


_softmax_rows.defvjp(_softmax_rows_fwd, _softmax_rows_bwd)


# --------------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------------

def _normalize_axes(op: str, axis, ndim: int) -> tuple[int, ...]:
    try:
        axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    except TypeError:  # not an int nor iterable (a float, None): the error below, naming axis
        axes = None
    if not axes or not all(isinstance(a, (int, np.integer)) for a in axes):
        raise TypeError(f"{op}: axis must be an int or a non-empty tuple of ints; got {axis!r}")
    if any(not -ndim <= a < ndim for a in axes):
        raise ValueError(f"{op}: axis {axis!r} is out of range for an array of {ndim} dims")
    axes = tuple(sorted(int(a) % ndim for a in axes))
    if len(set(axes)) != len(axes):
        raise ValueError(f"{op}: axis {axis!r} repeats an axis")
    return axes


def softmax(x, axis: int | Sequence[int] = -1, *, out_dtype=None, backend: str | None = None,
            config: L.Config | None = None):
    """Softmax of `x` along `axis` (an int or a tuple of ints), as jax.nn.softmax computes it.

    float32, bfloat16 and float16 inputs, with float32 math inside; any leading shape; differentiable
    (the backward kernel uses the saved output only) and batchable with jax.vmap.
    out_dtype: the result's dtype (default x's): float32 gives jax.nn.softmax(x.astype(float32))
        without a float32 copy of x.
    backend: "triton", "interpret" or "xla" (default: XKERN_BACKEND, else from the platform).
    config: a launch config to use in place of the heuristic one (for tuning and tests).
    """
    return _softmax_any(x, axis, out_dtype, backend, config, log=False)


def log_softmax(x, axis: int | Sequence[int] = -1, *, out_dtype=None, backend: str | None = None,
                config: L.Config | None = None):
    """Log-softmax of `x` along `axis`, as jax.nn.log_softmax computes it; otherwise as `softmax`."""
    return _softmax_any(x, axis, out_dtype, backend, config, log=True)


def _softmax_any(x, axis, out_dtype, backend, config, log: bool):
    op = "log_softmax" if log else "softmax"
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{op}: x must be a jax or numpy array; got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: x must have dtype float32, bfloat16 or float16; got {x.dtype}")
    if out_dtype is not None and L.dtype_or_none(out_dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: out_dtype must be float32, bfloat16, float16 or None; got {out_dtype!r}")
    if x.ndim == 0:
        raise ValueError(f"{op}: x must have at least one dimension; got a scalar")
    axes = _normalize_axes(op, axis, x.ndim)
    backend = L.resolve_backend(backend)
    x = jnp.asarray(x)
    if backend == "xla" or x.size == 0:
        if out_dtype is None:
            return reference(x, axis=axes, log=log)
        return reference(x.astype(jnp.float32), axis=axes, log=log).astype(out_dtype)
    # Bring the softmax axes to the end and make them one: the kernels see rows [*rows, cols].
    order = [a for a in range(x.ndim) if a not in axes] + list(axes)
    moved = x if order == sorted(order) else jnp.transpose(x, order)
    x2 = L.rows_view(moved, len(axes))
    n_cols = x2.shape[-1]
    if config is None:
        fwd_config = default_config(L.n_rows(x2), n_cols, backend, "fwd")
        bwd_config = default_config(L.n_rows(x2), n_cols, backend, "bwd")
    else:
        fwd_config = bwd_config = _check_config(config, n_cols)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    y = _softmax_rows(x2, log, out_dtype, backend, fwd_config, bwd_config).reshape(moved.shape)
    return y if moved is x else jnp.transpose(y, np.argsort(order))


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile cases (every kernel, representative configs)
# --------------------------------------------------------------------------------------------------

def aot_cases():
    """(name, kernel, signature, config) for every kernel here, per dtype and row kind."""
    sizes = {"n_rows": "i32"}
    for dtype, out, log in (("fp32", "fp32", False), ("bf16", "bf16", False), ("fp16", "fp16", False),
                            ("bf16", "bf16", True), ("bf16", "fp32", True)):
        for n_cols in (100, 8192, 32768, 131072):
            fwd_config, bwd_config = (default_config(16384, n_cols, "triton", k).replace(
                N_COLS=n_cols, LOG=log) for k in ("fwd", "bwd"))
            online = n_cols > MAX_ROW_BLOCK
            fwd, bwd = (_fwd_online, _bwd_online) if online else (_fwd_rows, _bwd_rows)
            tag = f"{'online' if online else 'rows'}/{dtype}->{out}/n{n_cols}"
            prefix = "log_softmax" if log else "softmax"
            yield (f"{prefix}_fwd/{tag}", fwd,
                   {"x_ptr": f"*{dtype}", **sizes, "y_ptr": f"*{out}"}, fwd_config)
            yield (f"{prefix}_bwd/{tag}", bwd,
                   {"saved_ptr": f"*{dtype if log else out}", "dy_ptr": f"*{out}", **sizes, "dx_ptr": f"*{dtype}"},
                   bwd_config)
