"""xkern.ops.softmax against jax.nn.softmax (float32 / float64 references), through the interpreter."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xkern
from xkern.kernels.launch import Config, kernel_names

TOLERANCES = {jnp.float32: 2e-6, jnp.float16: 2e-3, jnp.bfloat16: 1.6e-2}  # relative to max |ref|
ONLINE = Config.of(BLOCK_M=1, BLOCK_N=128)  # rows longer than 128 take the two-pass online kernels


def reference(x, axis, log=False):
    x = np.asarray(x, np.float64)
    shifted = x - x.max(axis=axis, keepdims=True)
    total = np.exp(shifted).sum(axis=axis, keepdims=True)
    return shifted - np.log(total) if log else np.exp(shifted) / total


def reference_grad(x, dy, axis, log=False):
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    fn = jax.nn.log_softmax if log else jax.nn.softmax
    return jax.vjp(lambda x: fn(x, axis=axis), f32(x))[1](f32(dy))[0]


OPS = {"softmax": (xkern.ops.softmax, False), "log_softmax": (xkern.ops.log_softmax, True)}


def assert_close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    scale = max(np.max(np.abs(want)), 1e-30) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCES[dtype] * scale)


def random(rng, shape, dtype, scale=3.0):
    return jnp.asarray(scale * rng.standard_normal(shape), dtype)


SHAPES = [(1,), (7,), (1000,), (1025,), (3, 5, 7), (2, 3, 1025)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("config", [None, ONLINE], ids=["default", "online"])
@pytest.mark.parametrize("op", OPS)
def test_values_and_gradient(rng, shape, dtype, config, op):
    fn, log = OPS[op]
    x, dy = random(rng, shape, dtype), random(rng, shape, dtype, 1.0)
    y, vjp = jax.vjp(lambda x: fn(x, config=config), x)
    assert y.dtype == dtype
    assert_close(y, reference(x, -1, log), dtype)
    dx = vjp(dy)[0]
    assert dx.dtype == dtype
    # The backward pass reads the saved (rounded) output, so fp32 gradients carry fp32 rounding of
    # y times |dy|: a looser bound than the forward's.
    assert_close(dx, reference_grad(x, dy, -1, log), dtype if dtype != jnp.float32 else jnp.float16)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("config", [None, ONLINE], ids=["default", "online"])
def test_half_input_float32_output(rng, op, config):
    fn, log = OPS[op]
    x, dy = random(rng, (3, 1000), jnp.bfloat16), random(rng, (3, 1000), jnp.float32, 1.0)
    y, vjp = jax.vjp(lambda x: fn(x, out_dtype=jnp.float32, config=config), x)
    assert y.dtype == jnp.float32
    assert_close(y, reference(x, -1, log), jnp.float32)  # only the input was rounded
    dx = vjp(dy)[0]
    assert dx.dtype == jnp.bfloat16
    assert_close(dx, reference_grad(x, dy, -1, log), jnp.bfloat16)
    ref_fn = jax.nn.log_softmax if log else jax.nn.softmax
    np.testing.assert_array_equal(fn(x, out_dtype=jnp.float32, backend="xla"),
                                  ref_fn(x.astype(jnp.float32)))


@pytest.mark.parametrize("axis", [0, 1, -2, (1, 2), (0, 2)], ids=str)
def test_other_axes(rng, axis):
    x, dy = random(rng, (4, 5, 33), jnp.float32), random(rng, (4, 5, 33), jnp.float32)
    y, vjp = jax.vjp(lambda x: xkern.ops.softmax(x, axis=axis), x)
    assert_close(y, reference(x, axis), jnp.float32)
    assert_close(vjp(dy)[0], reference_grad(x, dy, axis), jnp.float16)


def test_under_jit_grad_and_vmap(rng):
    x = random(rng, (3, 4, 130), jnp.float32)
    w = random(rng, (130,), jnp.float32)
    loss = lambda f: (lambda x: jnp.sum(f(x) * w))
    ours, ref = loss(xkern.ops.softmax), loss(jax.nn.softmax)
    assert_close(jax.jit(jax.grad(ours))(x), jax.grad(ref)(x), jnp.float16)
    assert_close(jax.vmap(xkern.ops.softmax, in_axes=1, out_axes=1)(x), reference(x, -1), jnp.float32)
    assert_close(jax.vmap(jax.grad(ours))(x), jax.vmap(jax.grad(ref))(x), jnp.float16)
    assert_close(jax.grad(lambda x: jnp.sum(jax.vmap(ours)(x)))(x),
                 jax.grad(lambda x: jnp.sum(jax.vmap(ref)(x)))(x), jnp.float16)
    # vmap of the online kernels too
    online = lambda x: xkern.ops.softmax(x, config=ONLINE)
    assert_close(jax.jit(jax.vmap(jax.vmap(online)))(x), reference(x, -1), jnp.float32)


def test_jaxpr_has_exactly_the_expected_kernels(rng):
    x = random(rng, (8, 100), jnp.float32)
    assert kernel_names(jax.make_jaxpr(xkern.ops.softmax)(x)) == ["softmax_fwd"]
    grad = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(xkern.ops.softmax(x) ** 2)))(x)
    assert sorted(kernel_names(grad)) == ["softmax_bwd", "softmax_fwd"]
    assert kernel_names(jax.make_jaxpr(lambda x: xkern.ops.softmax(x, backend="xla"))(x)) == []
    grad = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(xkern.ops.log_softmax(x) ** 2)))(x)
    assert sorted(kernel_names(grad)) == ["log_softmax_bwd", "log_softmax_fwd"]


@pytest.mark.parametrize("config", [None, ONLINE], ids=["default", "online"])
@pytest.mark.parametrize("op", OPS)
def test_nan_and_inf_behave_as_in_jax(config, op):
    fn, log = OPS[op]
    inf, nan = np.inf, np.nan
    n = 300
    rows = np.tile(np.linspace(-2, 2, n), (7, 1))
    rows[0, 5] = nan
    rows[1, 7] = inf
    rows[2, :] = -inf
    rows[3, :200] = -inf  # the online kernels see whole -inf blocks before finite ones
    rows[4, 250:] = -inf
    rows[5, 0] = -inf
    rows[6, :] = 1e30
    x = jnp.asarray(rows, jnp.float32)
    want, want_vjp = jax.vjp(jax.nn.log_softmax if log else jax.nn.softmax, x)
    got, got_vjp = jax.vjp(lambda x: fn(x, config=config), x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    dy = jnp.asarray(np.cos(np.arange(7 * n)).reshape(7, n), jnp.float32)
    (dx,), (want_dx,) = got_vjp(dy), want_vjp(dy)
    np.testing.assert_array_equal(np.isnan(dx), np.isnan(want_dx))
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)


def test_log_softmax_gradient_alone_runs_only_the_backward_kernel():
    """log_softmax's backward recomputes softmax from x, so when only the gradient is used the
    compiled program drops the forward kernel (three tensors moved, as XLA's own gradient); softmax's
    reads its saved output."""
    x, w = jnp.ones((8, 100)), jnp.arange(100.0)
    for op, kernels in ((xkern.ops.log_softmax, 1), (xkern.ops.softmax, 2)):
        grad = jax.jit(jax.grad(lambda x: jnp.sum(op(x) * w)))
        assert grad.lower(x).compile().as_text().count("custom_call_target=") == kernels


def test_empty_arrays():
    for shape in [(0, 5), (5, 0), (2, 0, 3)]:
        x = jnp.zeros(shape, jnp.float32)
        assert xkern.ops.softmax(x).shape == shape
        assert jax.grad(lambda x: jnp.sum(xkern.ops.softmax(x)))(x).shape == shape
        assert kernel_names(jax.make_jaxpr(xkern.ops.softmax)(x)) == []


def test_xla_backend_is_jax_nn_softmax(rng):
    x = random(rng, (5, 9), jnp.float32)
    np.testing.assert_array_equal(xkern.ops.softmax(x, backend="xla"), jax.nn.softmax(x))
    np.testing.assert_array_equal(xkern.ops.log_softmax(x, backend="xla"), jax.nn.log_softmax(x))


def test_bad_input_raises_naming_the_argument():
    with pytest.raises(TypeError, match="x must have dtype .* got int32"):
        xkern.ops.softmax(jnp.arange(6).reshape(2, 3))
    with pytest.raises(TypeError, match="log_softmax: x must have dtype .* got bool"):
        xkern.ops.log_softmax(jnp.ones(3, bool))
    with pytest.raises(TypeError, match="x must have dtype .* got float64"):
        xkern.ops.softmax(np.ones((2, 3)))
    with pytest.raises(TypeError, match="x must be"):
        xkern.ops.softmax([1.0, 2.0])
    with pytest.raises(TypeError, match="out_dtype must be"):
        xkern.ops.softmax(jnp.ones((2, 3)), out_dtype=jnp.int32)
    with pytest.raises(TypeError, match="log_softmax: out_dtype must be .* got 'float7'"):
        xkern.ops.log_softmax(jnp.ones((2, 3)), out_dtype="float7")
    with pytest.raises(ValueError, match="axis"):
        xkern.ops.softmax(jnp.ones((2, 3)), axis=2)
    with pytest.raises(TypeError, match="softmax: axis must be an int or a non-empty tuple of ints; got 1.0"):
        xkern.ops.softmax(jnp.ones((2, 3)), axis=1.0)
    with pytest.raises(TypeError, match="log_softmax: axis must be an int .* got '1'"):
        xkern.ops.log_softmax(jnp.ones((2, 3)), axis="1")
    with pytest.raises(ValueError, match="repeats"):
        xkern.ops.softmax(jnp.ones((2, 3)), axis=(1, -1))
    with pytest.raises(ValueError, match="scalar"):
        xkern.ops.softmax(jnp.float32(1.0))
    with pytest.raises(ValueError, match="BLOCK_N"):
        xkern.ops.softmax(jnp.ones((2, 3)), config=Config.of(BLOCK_M=1, BLOCK_N=3))
    with pytest.raises(ValueError, match="online"):
        xkern.ops.softmax(jnp.ones((2, 300)), config=Config.of(BLOCK_M=2, BLOCK_N=128))
    with pytest.raises(ValueError, match="backend"):
        xkern.ops.softmax(jnp.ones((2, 3)), backend="gpu")


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3), data=st.data())
def test_random_shapes_and_axes(shape, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = jnp.asarray(np.random.default_rng(len(shape)).standard_normal(shape) * 4, jnp.float32)
    assert_close(xkern.ops.softmax(x, axis=axis), reference(x, axis), jnp.float32)
