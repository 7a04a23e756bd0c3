"""LayerNorm and RMSNorm over the last axis, in the ways people write them, replaced by
xkern.ops.layer_norm / rms_norm (float32 math, one rounding to the program's output dtype).

A spelling is three choices, combined:
  statistics  layer norm: (h - mean) * rsqrt(mean(square(h - mean)) + eps), or divided by
              sqrt(mean(square(h - mean)) + eps), each also through jnp.var; rms norm: h * rsqrt(mean(square(h)) + eps),
              or divided by sqrt(...). `h ** 2` and `h * h` are `square(h)`, h - mean written
              twice is computed once, and statistics reduced without keepdims and expanded after
              (`rsqrt(var + eps)[..., None]`, as haliax and Equinox write them) are the keepdims
              ones, after canonicalization (canonicalize.py).
  affine      none, * scale, * scale + bias, * (1 + scale) (rms norm, Gemma's form)
  precision   in the input's dtype; half-precision input upcast to float32 and the result cast back
              after the affine, or before it (`scale * normed.astype(dtype)`, Llama's form)
and the library forms: flax.linen.LayerNorm (with and without bias, or neither parameter),
flax.linen.RMSNorm (with and without scale), flax.nnx.LayerNorm / RMSNorm, jax.nn.standardize, Haiku's LayerNorm and RMSNorm, Equinox's LayerNorm
(written here as those libraries compute them: neither is a dependency); Equinox's RMSNorm and
haliax's norms are spellings above once canonical. eps is read off the program (any value; the
exact re-trace checks it).
A norm of h = x + r (a residual connection) also takes the add: the kernel reads x and r and writes
the normalized rows and h, one pass fewer than an add and a norm (xkern/jaxpr_passes/rewrite.py).

Where the program rounds twice (cast back, then multiply by scale) the kernel rounds once: results
agree within one rounding of the output dtype. flax's LayerNorm computes the variance as
E[h^2] - E[h]^2; the kernel's two-pass variance agrees with it wherever that does not cancel.
"""
from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np

from xkern.jaxpr_passes.patterns import Pattern, literal_at
from xkern.kernels import norms as kernels

F32 = jnp.float32
ALL = (jnp.float32, jnp.bfloat16, jnp.float16)
HALF = (jnp.bfloat16, jnp.float16)
EXAMPLE_EPS = 0.0123  # distinctive, so params_of can find the eps literal in the template


# --------------------------------------------------------------------------------------------------
# Spellings: statistics, affine, precision
# --------------------------------------------------------------------------------------------------

def ln_square(h, eps):
    centered = h - jnp.mean(h, -1, keepdims=True)
    return centered * jax.lax.rsqrt(jnp.mean(jnp.square(centered), -1, keepdims=True) + eps)


def ln_square_sqrt(h, eps):
    centered = h - jnp.mean(h, -1, keepdims=True)
    return centered / jnp.sqrt(jnp.mean(jnp.square(centered), -1, keepdims=True) + eps)


def ln_var(h, eps):
    return (h - jnp.mean(h, -1, keepdims=True)) * jax.lax.rsqrt(jnp.var(h, -1, keepdims=True) + eps)


def ln_var_sqrt(h, eps):
    return (h - jnp.mean(h, -1, keepdims=True)) / jnp.sqrt(jnp.var(h, -1, keepdims=True) + eps)


def rms_square(h, eps):
    return h * jax.lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + eps)


def rms_sqrt(h, eps):
    return h / jnp.sqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + eps)


AFFINE = {  # name: (number of parameter inputs, apply(normed, *params))
    "": (0, lambda n: n),
    "*scale": (1, lambda n, scale: n * scale),
    "*scale+bias": (2, lambda n, scale, bias: n * scale + bias),
    "*(1+scale)": (1, lambda n, scale: n * (1 + scale)),
}


def spelling(stats, affine: str, precision: str):
    """The pattern function of one combination; inputs (x, *affine params), param eps."""
    apply = AFFINE[affine][1]

    def fn(x, *params, eps):
        if precision == "plain":
            return apply(stats(x, eps), *params)
        normed = stats(x.astype(F32), eps)
        if precision == "upcast":
            return apply(normed, *params).astype(x.dtype)
        return apply(normed.astype(x.dtype), *params)  # "cast back first"
    fn.__name__ = f"{stats.__name__}{affine}/{precision}"
    return fn


# --------------------------------------------------------------------------------------------------
# Library forms
# --------------------------------------------------------------------------------------------------

def flax_layer_norm(x, scale, bias, *, eps):
    import flax.linen as nn
    return nn.LayerNorm(epsilon=eps).apply({"params": {"scale": scale, "bias": bias}}, x)


def flax_layer_norm_no_bias(x, scale, *, eps):
    import flax.linen as nn
    return nn.LayerNorm(epsilon=eps, use_bias=False).apply({"params": {"scale": scale}}, x)


def flax_rms_norm(x, scale, *, eps):
    import flax.linen as nn
    return nn.RMSNorm(epsilon=eps).apply({"params": {"scale": scale}}, x)


def flax_layer_norm_no_parameters(x, *, eps):  # (OLMo's non-parametric LayerNorm)
    import flax.linen as nn
    return nn.LayerNorm(epsilon=eps, use_scale=False, use_bias=False).apply({}, x)


def flax_rms_norm_no_scale(x, *, eps):
    import flax.linen as nn
    return nn.RMSNorm(epsilon=eps, use_scale=False).apply({}, x)


def flax_nnx_norm(op: str, n_params: int, promote: bool):
    """flax.nnx.LayerNorm / RMSNorm. With dtype=None (promote) the result is in the promoted dtype of
    x and the parameters; with dtype=x.dtype, as mixed-precision models set it, nnx (flax 0.12) first
    rounds the parameters to x's dtype, and so does the replacement where the traced module does and
    XLA would keep the rounding (_pattern's round_params, _rounds_params, _excess_precision)."""
    def fn(x, *params, eps):
        from flax import nnx
        kind = nnx.LayerNorm if op == "layer_norm" else nnx.RMSNorm
        options = {"use_bias": n_params > 1} if op == "layer_norm" else {}
        module = kind(x.shape[-1], epsilon=eps, dtype=None if promote else x.dtype, use_scale=n_params > 0,
                      param_dtype=params[0].dtype if params else F32, rngs=nnx.Rngs(0), **options)
        for name, value in zip(("scale", "bias"), params):
            getattr(module, name)[...] = value
        return module(x)
    fn.__name__ = f"flax.nnx.{'LayerNorm' if op == 'layer_norm' else 'RMSNorm'}"
    return fn


def standardize(x, *, eps):
    return jax.nn.standardize(x, axis=-1, epsilon=eps)


def haiku_layer_norm(n_params: int, fast: bool = False):
    """hk.LayerNorm(-1, create_scale, create_offset, use_fast_variance=fast) as Haiku computes it,
    in x's dtype: the scale folded into the inverse deviation first, `scale * rsqrt(var + eps) *
    (x - mean) + offset` (without a scale or offset, Haiku multiplies by 1 and adds 0 of x's dtype);
    the fast variance is E[x^2] - E[x]^2 (the kernels' two-pass variance agrees where it does not cancel)."""
    def fn(x, *params, eps):
        scale = params[0] if params else np.array(1.0, x.dtype)
        offset = params[1] if len(params) > 1 else np.array(0.0, x.dtype)
        mean = jnp.mean(x, -1, keepdims=True)
        variance = (jnp.mean(jnp.square(x), -1, keepdims=True) - jnp.square(mean) if fast
                    else jnp.var(x, -1, keepdims=True))
        inv = scale * jax.lax.rsqrt(variance + jax.lax.convert_element_type(eps, variance.dtype))
        return inv * (x - mean) + offset
    fn.__name__ = f"haiku.LayerNorm({n_params} params{', fast variance' if fast else ''})"
    return fn


def haiku_rms_norm(x, scale, *, eps):
    """hk.RMSNorm(-1): its scale and mean square broadcast to x's shape, `x * scale * rsqrt(ms + eps)`."""
    mean_squared = jnp.broadcast_to(jnp.mean(jnp.square(x), -1, keepdims=True), x.shape)
    return x * jnp.broadcast_to(scale, x.shape) * jax.lax.rsqrt(mean_squared + eps)


def equinox_layer_norm(n_params: int):
    """eqx.nn.LayerNorm (one example, mapped by jax.vmap): in float32 (x cast up, the result cast
    back), the variance clamped at 0, then `weight * out + bias`. (Its RMSNorm, `rsqrt(mean(x**2) +
    eps) * x` of one example, mapped, then `weight * out + bias`, is rms_square*scale+bias/upcast
    once canonical.)"""
    def fn(x, *params, eps):
        h = x.astype(jnp.result_type(x.dtype, F32))
        variance = jnp.maximum(0.0, jnp.var(h, -1, keepdims=True))
        out = (h - jnp.mean(h, -1, keepdims=True)) * jax.lax.rsqrt(variance + eps)
        if params:
            out = params[0].astype(h.dtype) * out
        if len(params) > 1:
            out = out + params[1].astype(h.dtype)
        return out.astype(x.dtype)
    fn.__name__ = f"equinox.nn.LayerNorm({n_params} params)"
    return fn


# --------------------------------------------------------------------------------------------------
# Matching and replacing
# --------------------------------------------------------------------------------------------------

def _eps(match) -> dict:
    return {"eps": literal_at(match, EXAMPLE_EPS)}


def _check(match, params) -> str | None:
    x, *affine = match.input_avals
    if x.dtype not in ALL:
        return f"dtype {x.dtype}: the norm kernels take float32, bfloat16 and float16"
    if x.ndim < 1 or x.shape[-1] == 0:
        return "no axis to normalize"
    if any(tuple(p.shape) != (x.shape[-1],) for p in affine):
        return f"scale / bias are not one value per column ({x.shape[-1]},)"
    if x.shape[-1] > kernels.MAX_COLS:
        return f"rows of {x.shape[-1]} > {kernels.MAX_COLS}: wider than the kernels keep in registers"
    return None


def _pattern(name, op, fn, n_params, dtypes, affine="", round_params=False):
    def example(dtypes):
        x_dtype, param_dtype = dtypes
        return (jax.ShapeDtypeStruct((4, 8), x_dtype),
                *[jax.ShapeDtypeStruct((8,), param_dtype)] * n_params)

    def replace(x, *params, backend, eps, residual=None, residual_sum=False):
        out_dtype = jax.eval_shape(lambda *a: fn(*a, eps=eps), x, *params).dtype
        if round_params and _rounds_params(fn, x, params, eps) and not (backend == "triton" and _excess_precision()):
            params = [p.astype(x.dtype) for p in params]
        scale = params[0] if params else None
        if affine == "*(1+scale)":
            scale = 1 + scale  # as the program computes it, in scale's dtype
        bias = params[1] if len(params) > 1 else None
        if op == "rms_norm":
            return kernels.rms_norm(x, scale, eps, bias=bias, residual=residual, out_dtype=out_dtype,
                                    backend=backend)
        return kernels.layer_norm(x, scale, bias, eps, residual=residual, out_dtype=out_dtype,
                                  backend=backend)

    return Pattern(name=name, op=op, fn=fn, dtypes=dtypes, example=example,
                   example_params={"eps": EXAMPLE_EPS}, params_of=_eps, check=_check, replace=replace,
                   facts_of=_residual_sum, folds_residual_add=True, split_dims=_split_dims)


def _split_dims(i: int, ndim: int, params: dict) -> list | set:
    """The dims the norm kernels split (kernels/norms._split): any but the normalized dim (a batch,
    a sequence, per-head norms' heads: the launch's view keeps them) of x and of a residual; of a
    vector (a scale, a bias: read whole by every program), none."""
    return set(range(ndim - 1))


def _rounds_params(fn, x, params, eps) -> bool:
    """Whether the pattern (the installed flax's nnx module) casts its parameters to x's dtype before
    use: flax versions differ, so the program says, not an assumption."""
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, *params)]
    jaxpr = jax.make_jaxpr(lambda *a: fn(*a, eps=eps))(*avals).jaxpr
    inputs = set(jaxpr.invars[1:])
    return any(e.primitive.name == "convert_element_type" and e.invars[0] in inputs
               and e.params["new_dtype"] == x.dtype for e in jaxpr.eqns)


def _excess_precision() -> bool:
    """XLA's GPU compiler drops a float32 -> bfloat16 -> float32 round trip unless told not to
    (xla_allow_excess_precision, on by default): there jax.jit uses the parameters unrounded. (On
    the H200, rounding them as the jaxpr says left 26% of elements one bfloat16 step off jax.jit.)"""
    return "--xla_allow_excess_precision=false" not in os.environ.get("XLA_FLAGS", "")


def _residual_sum(match) -> dict:
    """residual_sum: the normalized input is a sum of two arrays of its shape (a residual connection),
    which the kernel will likely take too (rewrite._fold_residual_adds decides, after this): the
    cost model then counts the four tensors it moves, as it does for a generated kernel there."""
    return {"residual_sum": True} if match.graph.residual_sum(match.inputs[0]) is not None else {}


def _param_dtypes(x_dtypes):
    """(x dtype, scale/bias dtype): float32 parameters, or parameters in x's dtype."""
    return tuple(dict.fromkeys((x, p) for x in x_dtypes for p in (F32, x)))


def _spellings():
    out = []
    for op, stats_fns, affines in (("layer_norm", (ln_square, ln_square_sqrt, ln_var, ln_var_sqrt), ("", "*scale", "*scale+bias")),
                                   ("rms_norm", (rms_square, rms_sqrt), ("", "*scale", "*scale+bias", "*(1+scale)"))):
        for stats in stats_fns:
            for affine in affines:
                for precision, x_dtypes in (("plain", ALL), ("upcast", HALF), ("cast back first", HALF)):
                    if precision == "cast back first" and not affine:
                        continue  # the same as "upcast"
                    fn = spelling(stats, affine, precision)
                    out.append(_pattern(f"{op}/{fn.__name__}", op, fn, AFFINE[affine][0],
                                        _param_dtypes(x_dtypes), affine))
    return out


PATTERNS = _spellings() + [
    _pattern("layer_norm/jax.nn.standardize", "layer_norm", standardize, 0, _param_dtypes(ALL)),
    _pattern("rms_norm/haiku.RMSNorm", "rms_norm", haiku_rms_norm, 1, _param_dtypes(ALL), "*scale"),
    *(_pattern(f"layer_norm/{fn.__name__}", "layer_norm", fn, n, _param_dtypes(ALL), ("", "*scale", "*scale+bias")[n])
      for n in (0, 1, 2) for fn in (haiku_layer_norm(n), haiku_layer_norm(n, fast=True), equinox_layer_norm(n))),
]
if importlib.util.find_spec("flax") is not None:  # flax is optional: a test dependency
    PATTERNS += [
        _pattern("layer_norm/flax.linen.LayerNorm", "layer_norm", flax_layer_norm, 2, _param_dtypes(ALL),
                 "*scale+bias"),
        _pattern("layer_norm/flax.linen.LayerNorm(use_bias=False)", "layer_norm", flax_layer_norm_no_bias,
                 1, _param_dtypes(ALL), "*scale"),
        _pattern("rms_norm/flax.linen.RMSNorm", "rms_norm", flax_rms_norm, 1, _param_dtypes(ALL), "*scale"),
        _pattern("layer_norm/flax.linen.LayerNorm(use_scale=False, use_bias=False)", "layer_norm",
                 flax_layer_norm_no_parameters, 0, _param_dtypes(ALL)),
        _pattern("rms_norm/flax.linen.RMSNorm(use_scale=False)", "rms_norm", flax_rms_norm_no_scale, 0,
                 _param_dtypes(ALL)),
    ]
    for op, n_params in (("layer_norm", 2), ("layer_norm", 1), ("layer_norm", 0), ("rms_norm", 1), ("rms_norm", 0)):
        # promoting differs only for half-precision x with float32 parameters
        for promote, dtypes in ((False, _param_dtypes(ALL)), (True, tuple((x, F32) for x in HALF)))[:1 + (n_params > 0)]:
            fn = flax_nnx_norm(op, n_params, promote)
            PATTERNS.append(_pattern(f"{op}/{fn.__name__}({n_params} params{', promoted' if promote else ''})",
                                     op, fn, n_params, dtypes, ("", "*scale", "*scale+bias")[n_params],
                                     round_params=not promote))
