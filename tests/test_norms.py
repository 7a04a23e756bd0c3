"""xkern.ops.layer_norm / rms_norm (optionally with a residual add) against a float32 jax.numpy
reference: values and every gradient, through the interpreter."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn

import xkern
from xkern.kernels.launch import kernel_names
from xkern.kernels.norms import reference

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 3e-3}


def make(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape) * 2 + 0.5, dtype)
    r = jnp.asarray(rng.standard_normal(shape), dtype)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, shape[-1]), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(shape[-1]), jnp.float32)
    dy = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return x, r, scale, bias, dy


def close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * max(np.abs(want).max(), 1.0))


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape", [(1, 1), (7,), (3, 1000), (2, 3, 1025), (4, 1024)], ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_values_and_every_gradient(rms, shape, dtype, with_residual):
    """Odd widths (masked tiles), whole tiles ((1, 1), (4, 1024): unmasked), and rows of 1000 and
    more (the forward in halves, in the interpreter)."""
    x, r, scale, bias, dy = make(shape, dtype)
    b = None if rms else bias
    op = (lambda x, s, b, r: xkern.ops.rms_norm(x, s, residual=r)) if rms else \
        (lambda x, s, b, r: xkern.ops.layer_norm(x, s, b, residual=r))
    ref = lambda x, s, b, r: reference(x, s, b, 1e-6, r, rms)
    r_arg = r if with_residual else None

    def loss(f):
        def value(x, s, b, r):
            out = f(x, s, b, r)
            y, h = out if with_residual else (out, None)
            total = jnp.sum(y.astype(jnp.float32) * dy)
            return total + (jnp.sum(h.astype(jnp.float32) ** 2) if with_residual else 0.0)
        return value

    close(op(x, scale, b, r_arg)[0] if with_residual else op(x, scale, b, r_arg),
          ref(x, scale, b, r_arg)[0] if with_residual else ref(x, scale, b, r_arg), dtype)
    argnums = (0, 1) + (() if rms else (2,)) + ((3,) if with_residual else ())
    f32 = lambda a: None if a is None else a.astype(jnp.float32)
    got = jax.grad(loss(op), argnums=argnums)(x, scale, b, r_arg)
    want = jax.grad(loss(ref), argnums=argnums)(f32(x), scale, b, f32(r_arg))
    for g, w in zip(got, want):
        close(g, w, dtype)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_eps_of_zero(rms, dtype):
    """eps 0 (BERT's 1e-12 rounds to it in a float16 program): rows past the last full block of rows
    must not turn the scale's gradient into NaN (their rstd is inf)."""
    x, _, scale, bias, dy = make((7, 16), dtype, seed=5)
    b = None if rms else bias
    op = (lambda x, s, b: xkern.ops.rms_norm(x, s, eps=0.0)) if rms else \
        (lambda x, s, b: xkern.ops.layer_norm(x, s, b, eps=0.0))
    ref = lambda x, s, b: reference(x, s, b, 0.0, None, rms)
    loss = lambda f: lambda x, s, b: jnp.sum(f(x, s, b).astype(jnp.float32) * dy)
    argnums = (0, 1) if rms else (0, 1, 2)
    close(op(x, scale, b), ref(x, scale, b), dtype)
    got = jax.grad(loss(op), argnums)(x, scale, b)
    want = jax.grad(loss(ref), argnums)(x.astype(jnp.float32), scale, b)
    for g, w in zip(got, want):
        assert np.isfinite(np.asarray(g, np.float32)).all()
        close(g, w, dtype)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rows_wider_than_the_backward_kernel_take_xlas_backward(rms, with_residual, monkeypatch):
    """Rows wider than the backward kernel takes (RMS norm past 8192 columns, where it spills: 8.9x
    slower than XLA on an H200; layer norm's kernel takes 16384, so its limit is patched here): the
    forward kernel runs, the backward is XLA's derivative of the reference; every gradient equal."""
    from xkern.kernels import norms
    if not rms:
        monkeypatch.setitem(norms.BWD_MAX_COLS, False, 8192)
    x, r, scale, bias, dy = make((3, 8200), jnp.bfloat16, seed=4)
    b = None if rms else bias
    r_arg = r if with_residual else None
    op = (lambda x, s, b, r: xkern.ops.rms_norm(x, s, residual=r)) if rms else \
        (lambda x, s, b, r: xkern.ops.layer_norm(x, s, b, residual=r))
    ref = lambda x, s, b, r: reference(x, s, b, 1e-6, r, rms)

    def loss(f):
        def value(x, s, b, r):
            out = f(x, s, b, r)
            y, h = out if with_residual else (out, None)
            return jnp.sum(y.astype(jnp.float32) * dy) + (jnp.sum(h.astype(jnp.float32) ** 2) if with_residual else 0.0)
        return value
    argnums = (0, 1) + (() if rms else (2,)) + ((3,) if with_residual else ())
    grads = jax.grad(loss(op), argnums=argnums)
    launched = kernel_names(jax.make_jaxpr(grads)(x, scale, b, r_arg))
    assert launched == [("rms_norm_fwd" if rms else "layer_norm_fwd")]
    f32 = lambda a: None if a is None else a.astype(jnp.float32)
    want = jax.grad(loss(ref), argnums=argnums)(f32(x), scale, b, f32(r_arg))
    for g, w in zip(grads(x, scale, b, r_arg), want):
        close(g, w, jnp.bfloat16)


def test_jit_vmap_and_the_kernels_in_the_jaxpr():
    x, r, scale, bias, _ = make((2, 3, 40), jnp.float32)
    f = lambda x: xkern.ops.layer_norm(x, scale, bias, residual=x * 0.5)[0].sum()
    assert sorted(kernel_names(jax.make_jaxpr(jax.grad(f))(x))) == ["layer_norm_bwd", "layer_norm_fwd"]
    got = jax.jit(jax.vmap(jax.grad(lambda x, s: xkern.ops.rms_norm(x, s).sum() * 2, argnums=(0, 1)),
                           in_axes=(0, None)))(x, scale)
    want = jax.vmap(jax.grad(lambda x, s: reference(x, s, None, 1e-6, None, True).sum() * 2,
                             argnums=(0, 1)), in_axes=(0, None))(x, scale)
    for g, w in zip(got, want):
        close(g, w, jnp.float32)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_per_example_gradients_of_shared_parameters_under_two_vmaps(rms):
    """vmap(vmap(grad)) with scale and bias shared: each example of each vmap gets its own sums
    (the backward's segments, one per example, nested: the outer vmap's of the inner's)."""
    x, r, scale, bias, dy = make((3, 2, 5, 24), jnp.float32, seed=4)
    bias = None if rms else bias

    def loss(op, x, r, scale, bias, dy):  # one example: [5, 24]; the norm of x + r
        y, h = op(x, scale, bias, eps=1e-5, residual=r) if op is not None else \
            reference(x, scale, bias, 1e-5, r, rms)
        return jnp.sum(y * dy) + jnp.sum(h * h) * 0.1
    op = lambda x, scale, bias, **kw: (xkern.ops.rms_norm if rms else xkern.ops.layer_norm)(x, scale, bias=bias, **kw)
    per_example = lambda op: jax.grad(functools.partial(loss, op), argnums=(0, 1, 2, 3))
    nested = lambda g: jax.jit(jax.vmap(jax.vmap(g, in_axes=(0, 0, None, None, 0)), in_axes=(0, 0, None, None, 0)))
    got = nested(per_example(op))(x, r, scale, bias, dy)
    want = nested(per_example(None))(x, r, scale, bias, dy)
    for g, w in zip(got, want):
        if w is not None:
            close(g, w, jnp.float32)


def test_no_scale_wide_rows_empty_and_xla_backend():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 50)), jnp.float32)
    close(xkern.ops.layer_norm(x), reference(x, None, None, 1e-6, None, False), jnp.float32)
    wide = jnp.ones((2, 20000), jnp.float32)  # wider than the kernels take: XLA computes it
    assert kernel_names(jax.make_jaxpr(xkern.ops.rms_norm)(wide)) == []
    assert xkern.ops.layer_norm(jnp.zeros((0, 8))).shape == (0, 8)
    np.testing.assert_array_equal(xkern.ops.rms_norm(x, backend="xla"),
                                  reference(x, None, None, 1e-6, None, True))


def test_bad_input_names_the_argument():
    x = jnp.ones((2, 8))
    with pytest.raises(TypeError, match="x must have dtype"):
        xkern.ops.layer_norm(jnp.ones((2, 8), jnp.int32))
    with pytest.raises(ValueError, match=r"scale must have shape \(8,\)"):
        xkern.ops.layer_norm(x, jnp.ones(7))
    with pytest.raises(ValueError, match="bias must have shape"):
        xkern.ops.layer_norm(x, jnp.ones(8), jnp.ones((8, 1)))
    with pytest.raises(ValueError, match="residual must match x"):
        xkern.ops.rms_norm(x, residual=jnp.ones((2, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match="eps must be"):
        xkern.ops.rms_norm(x, eps=-1.0)
    with pytest.raises(TypeError, match="out_dtype must be"):
        xkern.ops.rms_norm(x, out_dtype=jnp.int32)
    with pytest.raises(TypeError, match="layer_norm: out_dtype must be .* got 'float7'"):
        xkern.ops.layer_norm(x, out_dtype="float7")
    with pytest.raises(TypeError, match="layer_norm: scale must have a floating-point dtype; got int32"):
        xkern.ops.layer_norm(x, jnp.ones(8, jnp.int32))
    with pytest.raises(TypeError, match="rms_norm: scale must have a floating-point dtype; got bool"):
        xkern.ops.rms_norm(x, jnp.ones(8, bool))
    with pytest.raises(TypeError, match="bias must have a floating-point dtype"):
        xkern.ops.layer_norm(x, None, np.zeros(8, np.int32))
    with pytest.raises(TypeError, match="scale must be an array"):
        xkern.ops.layer_norm(x, "ones")
    with pytest.raises(ValueError, match="eps must be .*known when tracing"):
        jax.jit(lambda e: xkern.ops.rms_norm(x, eps=e))(1e-6)
    with pytest.raises(ValueError, match="eps must be a non-negative number; got 'small'"):
        xkern.ops.rms_norm(x, eps="small")
    # array-likes are taken, as jax.numpy takes them, and NumPy / 0-d jax scalars as numbers
    y, h = xkern.ops.layer_norm(x, [2.0] * 8, [1.0] * 8, eps=np.float32(1e-5), residual=[[1.0] * 8] * 2)
    want = xkern.ops.layer_norm(x, jnp.full(8, 2.0), jnp.ones(8), eps=1e-5, residual=jnp.ones((2, 8)))
    np.testing.assert_array_equal(y, want[0])
    np.testing.assert_array_equal(h, want[1])
    np.testing.assert_array_equal(xkern.ops.rms_norm(x, eps=jnp.float32(1e-5)), xkern.ops.rms_norm(x, eps=1e-5))


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_out_dtype_rounds_once_and_takes_its_cotangent(rms):
    """bf16 x, float32 y (as flax with float32 params): y is the float32 math, not a bf16 rounding."""
    x, _, scale, bias, dy = make((5, 33), jnp.bfloat16, seed=11)
    b = None if rms else bias
    op = (lambda x, s: xkern.ops.rms_norm(x, s, out_dtype=jnp.float32)) if rms else \
        (lambda x, s: xkern.ops.layer_norm(x, s, b, out_dtype=jnp.float32))
    ref = lambda x, s: reference(x.astype(jnp.float32), s, b, 1e-6, None, rms)
    y = op(x, scale)
    assert y.dtype == jnp.float32
    close(y, ref(x, scale), jnp.float32)
    got = jax.grad(lambda x, s: jnp.sum(op(x, s) * dy), (0, 1))(x, scale)
    want = jax.grad(lambda x, s: jnp.sum(ref(x, s) * dy), (0, 1))(x, scale)
    close(got[0], want[0], jnp.bfloat16)
    close(got[1], want[1], jnp.float32)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_backward_programs_loop_over_many_row_blocks(rms, monkeypatch):
    """Two-row blocks over 37 rows: each of the 4 backward programs loops over several blocks (the
    last one partial) and sums scale/bias gradients across them; vmapped, one segment per example."""
    from xkern.kernels import launch as L, norms
    monkeypatch.setattr(norms, "default_config", lambda rows, cols, backend, kernel="fwd": L.Config.of(
        BLOCK_M=2, BLOCK_N=L.next_pow2(cols)))
    x, r, scale, bias, dy = make((3, 37, 24), jnp.float32, seed=3)
    op = (lambda x, s, b: xkern.ops.rms_norm(x, s)) if rms else xkern.ops.layer_norm
    ref = lambda x, s, b: reference(x, s, None if rms else b, 1e-6, None, rms)
    loss = lambda f: (lambda x, s, b: jnp.sum(f(x, s, b) * dy[0]))
    got = jax.grad(loss(op), argnums=(0, 1, 2))(x[0], scale, bias)
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(x[0], scale, bias)
    for g, w in zip(got[:2] if rms else got, want[:2] if rms else want):
        close(g, w, jnp.float32)
    per_example = jax.vmap(jax.grad(loss(op), argnums=(0, 1)), in_axes=(0, None, None))(x, scale, bias)
    expected = jax.vmap(jax.grad(loss(ref), argnums=(0, 1)), in_axes=(0, None, None))(x, scale, bias)
    for g, w in zip(per_example, expected):
        close(g, w, jnp.float32)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_gradient_of_rows_far_from_zero_against_float64(rms):
    """Rows of mean 1000 and standard deviation 1 (float32): the backward folds sum(g * hhat) into
    sum(g * h) - mean * sum(g), whose rounding grows with |mean| / std; against float64 math."""
    rng = np.random.default_rng(7)
    x = (1000 + rng.standard_normal((4, 300))).astype(np.float32)
    scale, dy = rng.uniform(0.5, 1.5, 300), rng.standard_normal((4, 300))
    op = (lambda x, s: xkern.ops.rms_norm(x, s)) if rms else (lambda x, s: xkern.ops.layer_norm(x, s))
    dx, dscale = jax.grad(lambda x, s: jnp.sum(op(x, s) * dy), argnums=(0, 1))(
        jnp.asarray(x), jnp.asarray(scale, jnp.float32))
    h = x.astype(np.float64)
    centered = h if rms else h - h.mean(1, keepdims=True)
    rstd = 1 / np.sqrt((centered ** 2).mean(1, keepdims=True) + 1e-6)
    hhat, g = centered * rstd, dy * scale
    want = rstd * (g - hhat * (g * hhat).mean(1, keepdims=True) - (0 if rms else g.mean(1, keepdims=True)))
    np.testing.assert_allclose(np.asarray(dx, np.float64), want, rtol=0, atol=2e-3 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(dscale, np.float64), (dy * hhat).sum(0), rtol=0,
                               atol=2e-3 * np.abs((dy * hhat).sum(0)).max())


# --------------------------------------------------------------------------------------------------
# Patterns: the ways people write layer / rms norm, found by xkern.jit / xkern.optimize
# --------------------------------------------------------------------------------------------------

from xkern.jaxpr_passes import norm_rules  # noqa: E402

def _pattern_args(pattern, seed):
    """Inputs for `pattern` in its first (x dtype, parameter dtype), at an odd 3-D shape."""
    x_dtype, p_dtype = pattern.dtypes[0]
    n_params = len(pattern.example(pattern.dtypes[0])) - 1
    x, _, scale, bias, _ = make((3, 5, 37), x_dtype, seed)
    return (x, *[scale.astype(p_dtype), bias.astype(p_dtype)][:n_params])


@pytest.mark.parametrize("name", [p.name for p in norm_rules.PATTERNS])
def test_each_norm_spelling_is_found_and_equals_jax_jit(name):
    pattern = next(p for p in norm_rules.PATTERNS if p.name == name)
    args = _pattern_args(pattern, seed=len(name))
    f = lambda *a: pattern.fn(*a, eps=1e-5)
    report = xkern.explain(f)(*args)
    assert [m.pattern for m in report.matches] == [name]
    got, want = xkern.jit(f)(*args), jax.jit(f)(*args)
    assert got.dtype == want.dtype
    close(got, want, args[0].dtype.type)


@pytest.mark.parametrize("name", ["layer_norm/flax.linen.LayerNorm", "layer_norm/ln_var*scale+bias/upcast",
                                  "rms_norm/rms_square*scale/cast back first", "rms_norm/rms_sqrt*(1+scale)/plain"])
def test_norm_spellings_differentiate_through_the_kernels(name):
    pattern = next(p for p in norm_rules.PATTERNS if p.name == name)
    args = _pattern_args(pattern, seed=3)
    dy = make(args[0].shape, jnp.float32, seed=4)[-1]
    loss = lambda *a: jnp.sum(pattern.fn(*a, eps=1e-5).astype(jnp.float32) * dy)
    argnums = tuple(range(len(args)))
    assert any(k.endswith("norm_bwd") for k in
               kernel_names(jax.make_jaxpr(jax.grad(xkern.optimize(loss), argnums))(*args)))
    got = jax.jit(jax.grad(xkern.optimize(loss), argnums))(*args)
    want = jax.jit(jax.grad(loss, argnums))(*args)
    for g, w in zip(got, want):
        close(g, w, args[0].dtype.type)


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm"])
def test_flax_nnx_norms_in_mixed_precision_round_their_parameters_as_nnx_does(module):
    """nnx's norms with dtype=bfloat16 over float32 parameters (as mixed-precision models build
    them) round the parameters to bfloat16 first: found, and equal to jax.jit's, gradients included."""
    nnx = pytest.importorskip("flax.nnx")
    x, _, scale, bias, dy = make((3, 5, 37), jnp.bfloat16, seed=5)
    norm = getattr(nnx, module)(37, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    norm.scale[...] = (scale * 3 + 1).astype(jnp.float32)
    if module == "LayerNorm":
        norm.bias[...] = bias.astype(jnp.float32)
    graphdef, state = nnx.split(norm)

    def loss(x, state):
        y = nnx.merge(graphdef, state)(x)
        return jnp.sum(y.astype(jnp.float32) * dy), y
    grad = lambda f: jax.value_and_grad(f, (0, 1), has_aux=True)
    launched = kernel_names(jax.make_jaxpr(grad(xkern.optimize(loss)))(x, state))
    op = "layer_norm" if module == "LayerNorm" else "rms_norm"
    assert {f"{op}_fwd", f"{op}_bwd"} <= set(launched)
    (_, got), got_grads = jax.jit(grad(xkern.optimize(loss)))(x, state)
    (_, want), want_grads = jax.jit(grad(loss))(x, state)
    assert got.dtype == want.dtype == jnp.bfloat16
    close(got, want, jnp.bfloat16)
    # bit-equal but for rare last-place roundings (with the parameters left unrounded, ~25% differ)
    assert np.mean(np.asarray(got, np.float32) != np.asarray(want, np.float32)) < 0.03
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        close(g, w, jnp.bfloat16)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_a_per_example_norm_mapped_by_vmap_is_found(rms, dtype):
    """Equinox's LayerNorm and RMSNorm normalize one example (every axis of a 1-D x), in float32
    (the layer norm's variance clamped at 0), then `weight * out + bias` (the RMS norm's bias too, the
    kernels' bias), and models map them over the batch with jax.vmap: the mapped program is found
    (equinox.nn's LayerNorm; the RMS norm, a mean without keepdims mapped, is the rms_square spelling
    once canonical) and equals jax.jit's, gradients included."""
    x, _, scale, bias, dy = make((6, 37), dtype, seed=8)
    scale, bias = scale.astype(jnp.float32), bias.astype(jnp.float32)

    def per_example(x, scale, bias):
        h = x.astype(jnp.float32)
        if rms:
            out = jax.lax.rsqrt(jnp.mean(h ** 2) + 1e-5) * h
        else:
            out = (h - jnp.mean(h, keepdims=True)) * jax.lax.rsqrt(jnp.maximum(0.0, jnp.var(h, keepdims=True)) + 1e-5)
        return (scale * out + bias).astype(x.dtype)
    f = jax.vmap(per_example, (0, None, None))
    [match] = xkern.explain(f)(x, scale, bias).matches
    precision = "plain" if dtype == jnp.float32 else "upcast"
    assert match.pattern == (f"rms_norm/rms_square*scale+bias/{precision}" if rms
                             else "layer_norm/equinox.nn.LayerNorm(2 params)")
    loss = lambda f: (lambda *a: jnp.sum(f(*a).astype(jnp.float32) * dy.astype(jnp.float32)))
    f32 = [a.astype(jnp.float32) for a in (x, scale, bias)]
    close(xkern.jit(f)(x, scale, bias), jax.jit(f)(*f32), dtype)
    for g, w in zip(jax.jit(jax.grad(xkern.optimize(loss(f)), (0, 1, 2)))(x, scale, bias),
                    jax.grad(loss(f), (0, 1, 2))(*f32)):
        close(g, w, dtype)


def haliax_layer_norm(x, *params, eps=1e-5):
    """haliax.nn.LayerNorm (Levanter's): in x's dtype, the statistics reduced without keepdims and
    expanded back by `[..., None]`, the result cast to x's dtype, then `weight * out + bias`."""
    mean, var = x.mean(-1), x.var(-1)
    out = ((x - mean[..., None]) * jax.lax.rsqrt(var + eps)[..., None]).astype(x.dtype)
    for i, param in enumerate(params):
        out = param * out if i == 0 else out + param
    return out


def haliax_rms_norm(x, *params, eps=1e-5):
    """haliax.nn.RmsNorm: in float32, the mean square without keepdims, cast back to x's dtype before
    `weight * out + bias`."""
    h = x.astype(jnp.float32)
    out = (h * jax.lax.rsqrt(jnp.mean(jnp.square(h), -1) + eps)[..., None]).astype(x.dtype)
    for i, param in enumerate(params):
        out = param * out if i == 0 else out + param
    return out


@pytest.mark.parametrize("n_params", [0, 1, 2], ids=["no weight", "weight", "weight and bias"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_haliax_norms_reduced_without_keepdims_are_found(rms, dtype, n_params):
    """haliax's norms reduce without keepdims and expand the statistics after the elementwise steps
    (`rsqrt(var + eps)[..., None]`): canonicalization expands them first, as keepdims=True writes
    them, so the kernels take them, weight and bias (float32, as haliax makes them) included; values
    and gradients are jax.jit's. (Neither was found before; the RMS norm with a weight was in float32
    only, as Equinox's RMSNorm, which applies the weight before the cast back.)"""
    x, _, scale, bias, dy = make((2, 3, 7), dtype, seed=16)
    params = (scale, bias)[:n_params]
    f = haliax_rms_norm if rms else haliax_layer_norm
    op = "rms_norm" if rms else "layer_norm"
    [match] = xkern.explain(f)(x, *params).matches
    affine = ("", "*scale", "*scale+bias")[n_params]
    assert match.op == op and match.pattern.split("/")[1].endswith(affine), match.pattern
    got, want = xkern.jit(f)(x, *params), jax.jit(f)(x, *params)
    assert got.dtype == want.dtype
    close(got, want, dtype)
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * dy)
    argnums = tuple(range(1 + n_params))
    grad = lambda loss: jax.grad(loss, argnums)
    assert {f"{op}_fwd", f"{op}_bwd"} <= set(kernel_names(jax.make_jaxpr(grad(xkern.optimize(loss)))(x, *params)))
    for g, w in zip(jax.jit(grad(xkern.optimize(loss)))(x, *params), jax.jit(grad(loss))(x, *params)):
        close(g, w, dtype)


def test_statistics_expanded_by_reshape_or_expand_dims_are_found():
    """`[..., None]` is a broadcast_in_dim; a reshape or jnp.expand_dims gives the unit dim back too."""
    x, _, scale, _, _ = make((5, 7), jnp.float32, seed=17)
    expanded = {"reshape": lambda v: v.reshape(*v.shape, 1), "expand_dims": lambda v: jnp.expand_dims(v, -1)}
    for name, expand in expanded.items():
        rms = lambda x: x * expand(jax.lax.rsqrt(jnp.mean(jnp.square(x), -1) + 1e-6)) * scale
        layer = lambda x: (x - expand(x.mean(-1))) * expand(jax.lax.rsqrt(x.var(-1) + 1e-6))
        for f, want in ((rms, "rms_norm/rms_square*scale/plain"), (layer, "layer_norm/ln_var/plain")):
            assert [m.pattern for m in xkern.explain(f)(x).matches] == [want], name
            close(xkern.jit(f)(x), jax.jit(f)(x), jnp.float32)


def test_squares_and_repeated_subexpressions_are_found():
    """As people write them: h - mean twice and ** 2 (layer norm), h * h (rms norm); canonicalization
    makes them the templates' square of one h - mean."""
    x, _, scale, bias, _ = make((4, 5, 40), jnp.bfloat16, seed=10)
    scale, bias = scale.astype(jnp.float32), bias.astype(jnp.float32)

    def layer_norm(x):
        h = x.astype(jnp.float32)
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        return ((h - mean) * jax.lax.rsqrt(var + 1e-6) * scale + bias).astype(x.dtype)

    def rms_norm(x):
        h = x.astype(jnp.float32)
        return (h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * scale).astype(x.dtype)

    for f, name in ((layer_norm, "layer_norm/ln_square*scale+bias/upcast"),
                    (rms_norm, "rms_norm/rms_square*scale/upcast")):
        assert [m.pattern for m in xkern.explain(f)(x).matches] == [name]
        close(xkern.jit(f)(x), jax.jit(f)(x), jnp.bfloat16)


def test_scale_first_and_any_eps_are_found():
    x, _, scale, _, _ = make((4, 24), jnp.bfloat16, seed=8)
    llama = lambda x: scale.astype(x.dtype) * norm_rules.rms_square(x.astype(jnp.float32), 3e-4).astype(x.dtype)
    report = xkern.explain(llama)(x)
    assert [m.pattern for m in report.matches] == ["rms_norm/rms_square*scale/cast back first"]
    close(xkern.jit(llama)(x), jax.jit(llama)(x), jnp.bfloat16)


def test_norm_near_misses_are_not_rewritten():
    x, _, scale, _, _ = make((6, 24), jnp.float32, seed=9)
    mean = lambda h, axis: jnp.mean(h, axis, keepdims=True)
    near_misses = {
        # statistics over rows, not over each row
        "other axis": lambda x: (x - mean(x, 0)) * jax.lax.rsqrt(jnp.var(x, 0, keepdims=True) + 1e-5),
        # eps added outside the square root
        "eps outside sqrt": lambda x: x / (jnp.sqrt(mean(jnp.square(x), -1)) + 1e-5),
        # centred on a different array's mean
        "other mean": lambda x: (x - mean(x * 2, -1)) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5),
    }
    for name, f in near_misses.items():
        report = xkern.explain(f)(x)
        assert not [m for m in report.matches if "norm" in m.pattern], name
        close(xkern.jit(f)(x), jax.jit(f)(x), jnp.float32)
    # a scale that is not one value per column stays outside (the norm itself is still found)
    f = lambda x: norm_rules.rms_square(x, 1e-5) * scale[:1]
    assert [m.pattern for m in xkern.explain(f)(x).matches] == ["rms_norm/rms_square/plain"]
    close(xkern.jit(f)(x), jax.jit(f)(x), jnp.float32)


@pytest.mark.parametrize("name", ["layer_norm/flax.linen.LayerNorm", "rms_norm/rms_square*scale/cast back first"])
def test_a_norm_after_a_residual_add_takes_the_add(name):
    # A pre-norm transformer block: h = x + a is normalized, then used again by the second residual
    # add. The norm kernel reads x and a and also writes h; no separate add runs.
    pattern = next(p for p in norm_rules.PATTERNS if p.name == name)
    _, *params = _pattern_args(pattern, seed=11)
    x, a = (make((3, 5, 37), jnp.bfloat16, seed)[0] for seed in (11, 12))

    def block(x, a, *params):
        h = x + a
        return h + jnp.tanh(pattern.fn(h, *params, eps=1e-5)).astype(h.dtype)
    report = xkern.explain(block)(x, a, *params)
    assert [m.pattern for m in report.matches if "norm" in m.pattern] == [name + " + residual add"]
    jaxpr = jax.make_jaxpr(xkern.optimize(block))(x, a, *params)
    adds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "add" and e.invars[0].aval.shape == x.shape]
    assert len(adds) <= 1  # only the block's second residual add is left (when no fusion takes it)
    close(xkern.jit(block)(x, a, *params), jax.jit(block)(x, a, *params), jnp.bfloat16)
    dy = make(x.shape, jnp.float32, seed=13)[-1]
    loss = lambda *z: jnp.sum(block(*z).astype(jnp.float32) * dy)
    argnums = tuple(range(2 + len(params)))
    for g, w in zip(jax.grad(xkern.optimize(loss), argnums)(x, a, *params), jax.grad(loss, argnums)(x, a, *params)):
        close(g, w, jnp.bfloat16)


def test_a_residual_add_used_before_the_norm_or_broadcast_is_not_taken():
    x, a, scale, _, _ = make((4, 24), jnp.float32, seed=14)
    norm = lambda h: norm_rules.rms_square(h, 1e-5) * scale

    def used_before(x, a):
        h = x + a
        early = jnp.cumsum(h, -1)  # h is read before the norm runs: the add must run first
        return norm(h) + early

    broadcast = lambda x, a: norm(x + a[0])  # a row broadcast over x: not a residual stream
    for f in (used_before, broadcast):
        names = [m.pattern for m in xkern.explain(f)(x, a).matches if "norm" in m.pattern]
        assert names == ["rms_norm/rms_square*scale/plain"], names
        close(xkern.jit(f)(x, a), jax.jit(f)(x, a), jnp.float32)
    # flax's RMSNorm upcasts a float16 h, and the program reads that same upcast again: the upcast is
    # left in the program for that user, before the norm, so the add must run first (it raised)
    x, a = (z.astype(jnp.float16) for z in (x, a))

    def upcast_shared(x, a, scale):
        h = x + a
        return nn.RMSNorm().apply({"params": {"scale": scale}}, h), h.astype(jnp.float32) * 2
    names = [m.pattern for m in xkern.explain(upcast_shared)(x, a, scale).matches if "norm" in m.pattern]
    assert names and not [n for n in names if "residual" in n], names
    for got, want in zip(xkern.jit(upcast_shared)(x, a, scale), jax.jit(upcast_shared)(x, a, scale)):
        close(got, want, jnp.float16)
    loss = lambda *z: sum(jnp.sum(y.astype(jnp.float32)) for y in upcast_shared(*z))
    for g, w in zip(xkern.jit(jax.grad(loss, (0, 1, 2)))(x, a, scale), jax.grad(loss, (0, 1, 2))(x, a, scale)):
        close(g, w, jnp.float16)


def test_a_bf16_residual_stream_with_a_float32_branch():
    """A Llama in bf16 with float32 Dense parameters: the residual stream x is computed in the program
    (an embedding cast to bf16) and the branch is float32, so h = x + branch upcasts x, the same
    upcast the first norm's float32 math starts from. The norms and the residual add are taken, and
    the bf16 x that the first norm reads stays available (it crashed the rewrite: a generated kernel
    around the upcast gave only the float32 value)."""
    def rms(x, w, eps=1e-5):
        xf = x.astype(jnp.float32)
        return (w * (xf * jax.lax.rsqrt(jnp.mean(xf ** 2, -1, keepdims=True) + eps))).astype(x.dtype)

    def f(table, ids, g, w):
        x = table[ids].astype(jnp.bfloat16)
        h = x + rms(x, g) @ w  # float32
        return rms(h, g)

    rng = np.random.default_rng(12)
    table = jnp.asarray(rng.standard_normal((100, 64)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 100, (2, 8)), jnp.int32)
    g = jnp.asarray(rng.standard_normal(64), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 64)) * 0.1, jnp.float32)
    norms = [m.pattern for m in xkern.explain(f)(table, ids, g, w).matches if m.op == "rms_norm"]
    assert len(norms) == 2, norms
    np.testing.assert_allclose(xkern.jit(f)(table, ids, g, w), jax.jit(f)(table, ids, g, w), rtol=1e-5, atol=1e-5)
