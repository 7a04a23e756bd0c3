"""Gated linear units: `swiglu` and `geglu`, act(gate) * up, from two projections or from one whose
last axis holds both (gate | up halves): forward and backward Triton kernels, launchers, custom_vjp,
batching, and the public functions.

The math the kernels must match (float32 inside, outputs in the input dtype), elementwise, with
act(g) = g * cdf(g):

    silu        cdf = sigmoid(g)                               act' = cdf * (1 + g * (1 - cdf))
    gelu tanh   cdf = (1 + tanh(k * (g + c g^3))) / 2          act' = cdf + g/2 * (1 - tanh^2) * k * (1 + 3c g^2)
                k = sqrt(2/pi), c = 0.044715
    gelu erf    cdf = (1 + erf(g / sqrt 2)) / 2                act' = cdf + g * exp(-g^2/2) / sqrt(2 pi)

    out = act(g) * u          dg = dout * u * act'(g)          du = dout * act(g)

The data is rows x cols (cols = the output width d), tiled in 2-D blocks. For the split form the
input rows are 2d wide and `up` is the same rows at column offset d, so one kernel serves both forms
and the split backward writes its [..., 2d] gradient (dgate | dup) directly, with no concatenate.

The custom_vjp saves only the inputs: the backward reads gate, up and dout and recomputes the
activation (a few flops per element against five tensors of memory traffic), so a program that only
needs gradients never runs the forward kernel.

Gelu's erf form computes erfc(-g / sqrt 2) as XLA does (a polynomial erfc, not 1 + erf), so the
negative tail keeps its tiny values; the backward applies the product rule in jax.grad's order, so
infinite and NaN inputs give NaN exactly where jax.grad of the reference does.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xkern.kernels import launch as L  # first: it fixes Triton's mode before the kernels below exist

import triton
import triton.language as tl

from xkern.fusion.triton_math import tanh_absolute  # gelu adds it to 1: absolute error only

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
ACTIVATIONS = ("silu", "gelu_tanh", "gelu_erf")  # the ACT constexpr
INTERPRET_TILE = 1 << 16  # elements a program takes in the interpreter, which pays per program


def _activation_ref(g, activation: str):
    if activation == "silu":
        return jax.nn.silu(g)
    return jax.nn.gelu(g, approximate=activation == "gelu_tanh")


def reference(a, b=None, activation: str = "silu"):
    """The definition the kernels are checked against (and the `xla` backend)."""
    gate, up = jnp.split(a, 2, axis=-1) if b is None else (a, b)
    out = _activation_ref(gate.astype(jnp.float32), activation) * up.astype(jnp.float32)
    return out.astype(a.dtype)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------

@triton.jit
def _erfc(z):
    """erfc(z) for z >= 0 (Numerical Recipes' erfcc: relative error < 1.2e-7 everywhere), where
    1 - erf(z) would round the far tail to 0; only exp and a polynomial, so it runs the same on
    CUDA, ROCm and in the interpreter."""
    t = 1.0 / (1.0 + 0.5 * z)
    p = -0.82215223 + t * 0.17087277
    p = 1.48851587 + t * p
    p = -1.13520398 + t * p
    p = 0.27886807 + t * p
    p = -0.18628806 + t * p
    p = 0.09678418 + t * p
    p = 0.37409196 + t * p
    p = 1.00002368 + t * p
    return t * tl.exp(-z * z - 1.26551223 + t * p)


@triton.jit
def _cdf(g, ACT: tl.constexpr):
    """cdf(g) of the float32 tile g, act(g) = g * cdf(g), and the sigmoid / tanh that the
    derivative reuses. Both kernels call this, so they agree bit for bit."""
    if ACT == "silu":
        inner = tl.sigmoid(g)
        cdf = inner
    elif ACT == "gelu_tanh":
        inner = tanh_absolute(0.7978845608028654 * (g + 0.044715 * g * g * g))
        cdf = 0.5 + 0.5 * inner
    else:  # erfc(-g / sqrt 2) / 2, as XLA computes it: exact in the negative tail
        inner = 0.5 * _erfc(tl.abs(g) * 0.7071067811865476)
        cdf = tl.where(g < 0, inner, 1.0 - inner)
    return cdf, inner


@triton.jit
def _dgate(g, ct, cdf, inner, ACT: tl.constexpr):
    """ct * d(g * cdf(g))/dg, the product rule in XLA's order (ct * g before the derivative, gelu's
    cubic term apart; for erf's gelu g * pdf(g) first), so infinities give NaN exactly where
    jax.grad's do (inf * 0) and a huge g does not overflow ct * g where the pdf is 0."""
    cg = ct * g
    if ACT == "silu":
        d = cg * (inner * (1.0 - inner))
    elif ACT == "gelu_tanh":
        w = cg * (0.5 * 0.7978845608028654) * (1.0 - inner * inner)
        d = w + w * (3.0 * 0.044715 * g * g)
    else:
        d = ct * (g * (tl.exp(-0.5 * g * g) * 0.3989422804014327))
    return ct * cdf + d


@triton.jit
def _tile(n_rows, N_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] tile of the rows x N_COLS output: int64 rows (offsets of
    big arrays overflow int32), columns, mask. Column blocks vary fastest, so neighbouring programs
    stream neighbouring memory."""
    col_blocks = (N_COLS + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    rows = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return rows.to(tl.int64), cols, (rows < n_rows) & (cols < N_COLS)


@triton.jit
def _load_gate_up(gate_ptr, up_ptr, rows, cols, mask, N_COLS: tl.constexpr, SPLIT: tl.constexpr):
    """The tile's gate and up as float32, and its offsets into gate (and into up, unless SPLIT:
    then up is the same rows of gate, N_COLS further on)."""
    if SPLIT:
        offs = rows * (2 * N_COLS) + cols
        u = tl.load(gate_ptr + offs + N_COLS, mask=mask, other=0.0).to(tl.float32)
    else:
        offs = rows * N_COLS + cols
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return g, u, offs


@triton.jit
def _fwd(gate_ptr, up_ptr,  # inputs: gate [n_rows, N_COLS] or, SPLIT, [n_rows, 2 N_COLS]; up (not SPLIT)
         n_rows,
         out_ptr,  # output [n_rows, N_COLS]
         N_COLS: tl.constexpr, SPLIT: tl.constexpr, ACT: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = _tile(n_rows, N_COLS, BLOCK_M, BLOCK_N)
    g, u, _ = _load_gate_up(gate_ptr, up_ptr, rows, cols, mask, N_COLS, SPLIT)
    cdf, _ = _cdf(g, ACT)
    tl.store(out_ptr + rows * N_COLS + cols, (g * cdf * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd(gate_ptr, up_ptr, dout_ptr,  # inputs: gate, up as the forward's; dout [n_rows, N_COLS]
         n_rows,
         dgate_ptr, dup_ptr,  # outputs: like gate and up (SPLIT: dgate holds both halves, dup unused)
         N_COLS: tl.constexpr, SPLIT: tl.constexpr, ACT: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = _tile(n_rows, N_COLS, BLOCK_M, BLOCK_N)
    g, u, offs = _load_gate_up(gate_ptr, up_ptr, rows, cols, mask, N_COLS, SPLIT)
    dout = tl.load(dout_ptr + rows * N_COLS + cols, mask=mask, other=0.0).to(tl.float32)
    cdf, inner = _cdf(g, ACT)
    dg = _dgate(g, dout * u, cdf, inner, ACT).to(dgate_ptr.dtype.element_ty)
    du = (dout * (g * cdf)).to(dgate_ptr.dtype.element_ty)
    tl.store(dgate_ptr + offs, dg, mask=mask)
    if SPLIT:
        tl.store(dgate_ptr + offs + N_COLS, du, mask=mask)
    else:
        tl.store(dup_ptr + offs, du, mask=mask)


# --------------------------------------------------------------------------------------------------
# Configs and launchers
# --------------------------------------------------------------------------------------------------

def default_config(n_rows: int, n_cols: int, backend: str) -> L.Config:
    """Forward and backward alike (both stream elementwise).

    GPU: programs of 4096 elements, at most 1024 columns wide, 4 warps (32 values of each tensor a
    thread, in 16-byte vectors). From an H200 sweep (16384x8192 bf16, 12 configs from 512 to 8192
    columns, 4 to 16 warps): within 2% of the best config of every case (swiglu / geglu, fwd /
    fwd+bwd, split), where 4 warps on 8192-element programs lost 20-30% fwd+bwd and 16 warps lost
    up to 10% fwd. Narrow blocks also waste little of the last column block at widths that are not
    a power of two (16384x11008: 4.2 TB/s fwd, 4.1 fwd+bwd).
    Interpreter: as many elements as INTERPRET_TILE allows, since it pays per program.
    """
    block_n = L.next_pow2(n_cols)
    if backend == "interpret":
        block_n = min(block_n, INTERPRET_TILE)
        return L.Config.of(BLOCK_M=min(L.next_pow2(n_rows), INTERPRET_TILE // block_n), BLOCK_N=block_n)
    block_n = min(block_n, 1024)
    block_m = max(1, min(L.next_pow2(n_rows), 4096 // block_n))
    return L.Config.of(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)


def _grid(n_rows: int, n_cols: int, config: L.Config) -> tuple[int]:
    return (L.cdiv(n_rows, config["BLOCK_M"]) * L.cdiv(n_cols, config["BLOCK_N"]),)


def _consts(n_cols: int, split: bool, activation: str) -> dict:
    return {"N_COLS": n_cols, "SPLIT": split, "ACT": activation}


def _launch_fwd(gate2, up2, *, op, activation, backend, config):
    """out [rows, d] of gate2 [rows, d] and up2 [rows, d], or of gate2 [rows, 2d] alone (up2 None)."""
    split = up2 is None
    n_rows, n_cols = gate2.shape[0], gate2.shape[1] // (2 if split else 1)
    dummy = jnp.zeros((1,), gate2.dtype)  # stands for up in the split form (SPLIT keeps it unread)
    return L.launch(_fwd, gate2, dummy if split else up2, n_rows, kernel=f"{op}_fwd",
                    out_shapes=[jax.ShapeDtypeStruct((n_rows, n_cols), gate2.dtype)],
                    grid=_grid(n_rows, n_cols, config), config=config, backend=backend,
                    constexprs=_consts(n_cols, split, activation))


def _launch_bwd(gate2, up2, dout2, *, op, activation, backend, config):
    """[dgate, dup] like gate2 and up2; split (up2 None): [d(gate | up) like gate2, a [1] dummy]."""
    split = up2 is None
    n_rows, n_cols = dout2.shape
    dummy = jnp.zeros((1,), gate2.dtype)
    outs = [jax.ShapeDtypeStruct(gate2.shape, gate2.dtype),
            jax.ShapeDtypeStruct((1,) if split else up2.shape, gate2.dtype)]
    return L.launch(_bwd, gate2, dummy if split else up2, dout2, n_rows, kernel=f"{op}_bwd",
                    out_shapes=outs, grid=_grid(n_rows, n_cols, config), config=config,
                    backend=backend, constexprs=_consts(n_cols, split, activation))


def _batch(args, dims, *, kernel, constexprs, backend, config, **params):
    """Everything is elementwise per row, so the vmapped axis folds into the rows (L.batch_rows);
    the split form's [1] up / dup placeholders are not rows: each example gets the [1] back."""
    consts = dict(constexprs)
    split, fwd = consts["SPLIT"], kernel.endswith("_fwd")
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    kw = {"op": kernel.rsplit("_", 1)[0], "activation": consts["ACT"], "backend": backend,
          "config": config}

    def relaunch(*folded, **_):
        if fwd:
            return _launch_fwd(folded[0], None if split else folded[1], **kw)
        dgate, dup = _launch_bwd(folded[0], None if split else folded[1], folded[2], **kw)
        return dgate, jnp.broadcast_to(dup, (size, 1)) if split else dup

    return L.batch_rows(relaunch)(args, dims, kernel=kernel, constexprs=constexprs, backend=backend,
                                  config=config, **params)


def _split(params) -> L.Split:
    """Rows split across devices, and the columns of two projections; the split form's [1] up / dup
    placeholders are shared."""
    consts, kernel = dict(params["constexprs"]), params["kernel"]
    split, fwd = consts["SPLIT"], kernel.endswith("_fwd")
    up = L.SHARED if split else L.ROWS
    kw = {"op": kernel.rsplit("_", 1)[0], "activation": consts["ACT"], "backend": params["backend"],
          "config": params["config"]}
    # Two projections also split along their columns (tensor parallelism shards the hidden
    # features); the split form's halves would not be a device's columns
    cols = lambda n: {} if split else {"heads_args": (1,) * n, "heads_outs": (1,) * (1 if fwd else 2),
                                       "heads_fits": lambda parts: True}
    if fwd:
        return L.Split((L.ROWS, up), (L.ROWS,),
                       lambda gate, up2, **_: _launch_fwd(gate, None if split else up2, **kw), **cols(2))
    return L.Split((L.ROWS, up, L.ROWS), (L.ROWS, up),
                   lambda gate, up2, dout, **_: _launch_bwd(gate, None if split else up2, dout, **kw), **cols(3))


for _name in ("swiglu_fwd", "swiglu_bwd", "geglu_fwd", "geglu_bwd"):
    L.def_batching(_name, _batch)
    L.def_split(_name, _split)


# --------------------------------------------------------------------------------------------------
# Differentiation: the residuals are the inputs; the backward recomputes the activation
# --------------------------------------------------------------------------------------------------

@L.varying_alike
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _glu_rows(gate2, up2, op, activation, backend, config):
    return _launch_fwd(gate2, up2, op=op, activation=activation, backend=backend, config=config)[0]


def _glu_rows_fwd(gate2, up2, op, activation, backend, config):
    (out,) = _launch_fwd(gate2, up2, op=op, activation=activation, backend=backend, config=config)
    return out, (gate2, up2)


def _glu_rows_bwd(op, activation, backend, config, residuals, dout):
    gate2, up2 = residuals
    dgate, dup = _launch_bwd(gate2, up2, dout.astype(gate2.dtype), op=op, activation=activation,
                             backend=backend, config=config)
    return dgate, (None if up2 is None else dup)


_glu_rows.defvjp(_glu_rows_fwd, _glu_rows_bwd)


# --------------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------------

def _check(op, a, b):
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"{op}: a must be a jax or numpy array; got {type(a).__name__}")
    if a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: a must have dtype float32, bfloat16 or float16; got {a.dtype}")
    if a.ndim == 0:
        raise ValueError(f"{op}: a must have at least one dimension; got a scalar")
    if b is None:
        if a.shape[-1] % 2:
            raise ValueError(f"{op}: a without b is split into gate and up halves along its last axis, "
                             f"which must be even; got a of shape {tuple(a.shape)}")
        return
    if not hasattr(b, "dtype") or not hasattr(b, "shape"):
        raise TypeError(f"{op}: b must be a jax or numpy array or None; got {type(b).__name__}")
    if (tuple(b.shape), b.dtype) != (tuple(a.shape), a.dtype):
        raise ValueError(f"{op}: b must match a ({a.dtype}{list(a.shape)}); got {b.dtype}{list(b.shape)}")


def _glu(op, a, b, activation, backend):
    _check(op, a, b)
    backend = L.resolve_backend(backend)
    a = jnp.asarray(a)
    b = None if b is None else jnp.asarray(b)
    if backend == "xla" or a.size == 0:
        return reference(a, b, activation)
    width = a.shape[-1]
    n_cols = width // 2 if b is None else width
    a2 = a.reshape(-1, width)
    b2 = None if b is None else b.reshape(-1, width)
    config = default_config(a2.shape[0], n_cols, backend)
    out = _glu_rows(a2, b2, op, activation, backend, config)
    return out.reshape(*a.shape[:-1], n_cols)


def swiglu(a, b=None, *, backend: str | None = None):
    """silu(a) * b, float32 math, in a's dtype. Without b, `a` is one projection [..., 2d] split in
    halves along its last axis: silu(a[..., :d]) * a[..., d:] (jnp.split(a, 2, -1)'s order)."""
    return _glu("swiglu", a, b, "silu", backend)


def geglu(a, b=None, *, approximate: bool = True, backend: str | None = None):
    """gelu(a) * b, float32 math, in a's dtype; approximate=True is the tanh gelu (jax.nn.gelu's
    default), False the erf one. Without b, `a` is split in halves as in `swiglu`."""
    if not isinstance(approximate, bool):
        raise TypeError(f"geglu: approximate must be a bool; got {approximate!r}")
    return _glu("geglu", a, b, "gelu_tanh" if approximate else "gelu_erf", backend)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile cases
# --------------------------------------------------------------------------------------------------

def aot_cases():
    """(name, kernel, signature, config) for both kernels, every activation, split and two-input
    forms, in bf16 at the benchmark's width (8192); float32 and an odd width (1000) for silu."""
    for dtype, activations, widths in (("bf16", ACTIVATIONS, (8192,)), ("fp32", ("silu",), (1000,))):
        for activation in activations:
            for split in (False, True):
                for n_cols in widths:
                    config = default_config(16384, n_cols, "triton").replace(
                        **_consts(n_cols, split, activation))
                    tag = f"glu/{activation}/{dtype}/{'split' if split else 'two'}/n{n_cols}"
                    ptr = f"*{dtype}"
                    yield (f"{tag}/fwd", _fwd,
                           {"gate_ptr": ptr, "up_ptr": ptr, "n_rows": "i32", "out_ptr": ptr}, config)
                    yield (f"{tag}/bwd", _bwd,
                           {"gate_ptr": ptr, "up_ptr": ptr, "dout_ptr": ptr, "n_rows": "i32",
                            "dgate_ptr": ptr, "dup_ptr": ptr}, config)
