"""swiglu / geglu against a float32 jax.numpy reference: values and both gradients for two
projections and one split projection, edge values, vmap, errors, and the patterns that find the
ways people write them; through the interpreter."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xkern
from xkern.jaxpr_passes.canonicalize import dce
from xkern.kernels import glu
from xkern.kernels import launch as L
from xkern.kernels.launch import kernel_names

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 3e-3}
F32 = jnp.float32
OPS = {  # name: (op, activation of the reference, kernel name)
    "swiglu": (glu.swiglu, "silu", "swiglu"),
    "geglu_tanh": (glu.geglu, "gelu_tanh", "geglu"),
    "geglu_erf": (lambda a, b=None, **kw: glu.geglu(a, b, approximate=False, **kw), "gelu_erf", "geglu"),
}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def make(shape, dtype, n, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape) * 2, dtype) for _ in range(n)]


def close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * max(np.abs(want).max(), 1.0))


def inputs(form, shape, dtype, seed=0):
    """The op's inputs: (a, b) of `shape`, or one a whose last axis is twice shape's (split)."""
    if form == "split":
        return make((*shape[:-1], 2 * shape[-1]), dtype, 1, seed)
    return make(shape, dtype, 2, seed)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("form", ["two", "split"])
@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 1000), (2, 3, 1025)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_values_and_both_gradients(op, form, shape, dtype):
    fn, activation, _ = OPS[op]
    args = inputs(form, shape, dtype)
    (dout,) = make(shape, dtype, 1, seed=1)
    out, vjp = jax.vjp(fn, *args)
    assert out.dtype == dtype and out.shape == shape
    ref = lambda *a: glu.reference(*a, activation=activation)
    want, ref_vjp = jax.vjp(ref, *[a.astype(F32) for a in args])
    close(out, want, dtype)
    grads, want_grads = vjp(dout), ref_vjp(dout.astype(F32))
    for g, w, a in zip(grads, want_grads, args):
        assert g.dtype == dtype and g.shape == a.shape
        close(g, w, dtype)


@pytest.mark.parametrize("op", list(OPS))
def test_edge_values_as_xla(op):
    """Values and gradients at 0, +-inf, NaN, huge and tiny gates, times finite, zero and infinite
    up values: NaN exactly where XLA's program (the float32 reference and its jax.grad) has NaN."""
    fn, activation, _ = OPS[op]
    gates = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e30, -1e30, 1e4, -1e4,
                      100.0, -100.0, 1e-30, 6.0, -6.0, -10.0, -20.0, 3e38, -3e38], np.float32)
    ups = np.array([1.0, -2.0, 0.0, np.inf, np.nan, 4.0], np.float32)  # 4 * 0.5 * 3e38 overflows
    a = jnp.asarray(np.repeat(gates[:, None], len(ups), 1))
    b = jnp.asarray(np.tile(ups, (len(gates), 1)))
    dout = jnp.full(a.shape, 0.5, F32)
    out, vjp = jax.vjp(fn, a, b)
    want, ref_vjp = jax.vjp(lambda a, b: glu.reference(a, b, activation), a, b)
    for got, expected in [(out, want), *zip(vjp(dout), ref_vjp(dout))]:
        # equal_nan: NaN must meet NaN; infinities must be equal; finite values within 1e-5.
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-37)


@pytest.mark.parametrize("form", ["two", "split"])
def test_many_programs_and_partial_blocks(form, monkeypatch):
    """Blocks of 2 x 4 over 5 x 11 outputs: 3 row blocks by 3 column blocks, the last of each
    partial, so each program's tile, the split form's column offset and the masks are exercised."""
    monkeypatch.setattr(glu, "default_config", lambda rows, cols, backend: L.Config.of(BLOCK_M=2, BLOCK_N=4))
    args = inputs(form, (5, 11), F32, seed=2)
    (dout,) = make((5, 11), F32, 1, seed=3)
    for fn, activation, _ in OPS.values():
        out, vjp = jax.vjp(fn, *args)
        want, ref_vjp = jax.vjp(lambda *a: glu.reference(*a, activation=activation), *args)
        close(out, want, F32)
        for g, w in zip(vjp(dout), ref_vjp(dout)):
            close(g, w, F32)


def test_gradient_program_saves_only_the_inputs():
    """The residuals are the inputs (reshaped to rows), and a program that only needs gradients
    launches the backward kernel alone once dead code is removed."""
    a, b = make((3, 4, 8), F32, 2)
    for args in ((a, b), (a,)):
        _, vjp = jax.vjp(glu.swiglu, *args)
        assert [(r.shape, r.dtype) for r in jax.tree_util.tree_leaves(vjp)] == [((12, 8), F32)] * len(args)
        grad = jax.make_jaxpr(jax.grad(lambda *x: glu.swiglu(*x).sum(), argnums=tuple(range(len(args)))))
        assert kernel_names(dce(grad(*args))) == ["swiglu_bwd"]
    grad = jax.grad(lambda x: jnp.sum(glu.geglu(x) * 3.0))
    assert kernel_names(dce(jax.make_jaxpr(grad)(a))) == ["geglu_bwd"]


@pytest.mark.parametrize("form", ["two", "split"])
def test_vmap_and_jit(form):
    fn, activation, _ = OPS["geglu_tanh"]
    args = inputs(form, (4, 3, 9), F32, seed=4)
    ref = lambda *a: glu.reference(*a, activation=activation)
    loss = lambda f: jax.value_and_grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=tuple(range(len(args))))
    in_axes = (1, None) if form == "two" else (1,)  # b shared by every example in the two-input form
    vmapped = [args[0]] + ([args[1][:, 0]] if form == "two" else [])
    got = jax.jit(jax.vmap(loss(fn), in_axes=in_axes))(*vmapped)
    want = jax.vmap(loss(ref), in_axes=in_axes)(*vmapped)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        close(g, w, F32)
    names = kernel_names(jax.make_jaxpr(jax.vmap(loss(fn), in_axes=in_axes))(*vmapped))
    assert sorted(names) == ["geglu_bwd", "geglu_fwd"]  # the kernels, batched, not a fallback


def test_empty_arrays_and_the_xla_backend():
    for shape in [(0, 8), (3, 0), (2, 0, 4)]:
        a, b = jnp.zeros(shape, jnp.bfloat16), jnp.ones(shape, jnp.bfloat16)
        assert glu.swiglu(a, b).shape == shape and glu.swiglu(a, b).dtype == jnp.bfloat16
        assert glu.geglu(a).shape == (*shape[:-1], shape[-1] // 2)
        assert kernel_names(jax.make_jaxpr(glu.swiglu)(a, b)) == []
        assert jax.grad(lambda a: glu.swiglu(a, b).astype(F32).sum())(a).shape == shape
    a, b = make((3, 10), F32, 2, seed=5)
    for op, (fn, activation, _) in OPS.items():
        np.testing.assert_array_equal(fn(a, b, backend="xla"), glu.reference(a, b, activation))
        np.testing.assert_array_equal(fn(a, backend="xla"), glu.reference(a, None, activation))
        assert kernel_names(jax.make_jaxpr(lambda a: fn(a, backend="xla"))(a)) == []


def test_bad_input_names_the_argument():
    a = jnp.ones((2, 8))
    cases = [((jnp.ones((2, 8), jnp.int32),), {}, TypeError, "a must have dtype float32, bfloat16 or float16"),
             (([[1.0, 2.0]],), {}, TypeError, "a must be a jax or numpy array"),
             ((jnp.ones(()),), {}, ValueError, "a must have at least one dimension"),
             ((jnp.ones((2, 7)),), {}, ValueError, r"a without b .* must be even; got a of shape \(2, 7\)"),
             ((a, jnp.ones((2, 4))), {}, ValueError, r"b must match a \(float32\[2, 8\]\)"),
             ((a, jnp.ones((2, 8), jnp.bfloat16)), {}, ValueError, "b must match a"),
             ((a, 2.0), {}, TypeError, "b must be a jax or numpy array or None"),
             ((a,), {"backend": "cuda"}, ValueError, "backend must be one of")]
    for fn in (glu.swiglu, glu.geglu):
        for args, kw, error, message in cases:
            with pytest.raises(error, match=message):
                fn(*args, **kw)
    with pytest.raises(TypeError, match="approximate must be a bool"):
        glu.geglu(a, approximate="tanh")


# --------------------------------------------------------------------------------------------------
# Patterns: the ways people write gated linear units, found by xkern.jit / xkern.optimize
# --------------------------------------------------------------------------------------------------

def _halves(fn):
    return lambda x: fn(*jnp.split(x, 2, axis=-1))


def _upcast(fn):
    return lambda a, b: fn(a.astype(F32), b.astype(F32)).astype(a.dtype)


SILU = lambda a, b: jax.nn.silu(a) * b
GELU_TANH = lambda a, b: jax.nn.gelu(a, approximate=True) * b
GELU_ERF = lambda a, b: jax.nn.gelu(a, approximate=False) * b
SPELLINGS = {  # name: (function, number of inputs, pattern expected to match)
    "silu(a)*b": (SILU, 2, "swiglu/silu(a)*b"),
    "a*sigmoid(a)*b": (lambda a, b: a * jax.nn.sigmoid(a) * b, 2, "swiglu/silu(a)*b"),
    "gelu(a)*b": (lambda a, b: jax.nn.gelu(a) * b, 2, "geglu/gelu_tanh(a)*b"),
    "gelu_erf(a)*b": (GELU_ERF, 2, "geglu/gelu_erf(a)*b"),
    "silu(a)*b+upcast": (_upcast(SILU), 2, "swiglu/silu(a)*b+upcast"),
    "gelu_tanh(a)*b+upcast": (_upcast(GELU_TANH), 2, "geglu/gelu_tanh(a)*b+upcast"),
    "gelu_erf(a)*b+upcast": (_upcast(GELU_ERF), 2, "geglu/gelu_erf(a)*b+upcast"),
    "split:silu": (_halves(SILU), 1, "swiglu/split:silu(a)*b"),
    "split:gelu_tanh": (_halves(GELU_TANH), 1, "geglu/split:gelu_tanh(a)*b"),
    "split:gelu_erf+upcast": (_halves(_upcast(GELU_ERF)), 1, "geglu/split:gelu_erf(a)*b+upcast"),
    # the halves as slices: one split once canonicalized, the kernel reading the projection itself
    "slices:silu": (lambda x: SILU(x[..., :8], x[..., 8:]), 1, "swiglu/split:silu(a)*b"),
}


def _glu_matches(report):
    return [m.pattern for m in report.matches if m.pattern.split("/")[0] in ("swiglu", "geglu")]


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_patterns_match_and_equal_jax_jit(spelling):
    f, n, expected = SPELLINGS[spelling]
    args = make((3, 5, 16), jnp.bfloat16, n, seed=6)
    assert _glu_matches(xkern.explain(f)(*args)) == [expected]
    kernel = expected.split("/")[0]
    assert f"{kernel}_fwd" in kernel_names(jax.make_jaxpr(xkern.optimize(f))(*args))
    close(xkern.jit(f)(*args), jax.jit(f)(*args), jnp.bfloat16)
    loss = lambda g: (lambda *a: jnp.sum(g(*a).astype(F32) ** 2))
    argnums = tuple(range(n))
    got = jax.jit(jax.grad(loss(xkern.optimize(f)), argnums=argnums))(*args)
    want = jax.jit(jax.grad(loss(f), argnums=argnums))(*args)
    for g, w in zip(got, want):
        close(g, w, jnp.bfloat16)


def test_float32_programs_match_the_plain_patterns():
    a, b = make((4, 24), F32, 2, seed=7)
    assert _glu_matches(xkern.explain(SILU)(a, b)) == ["swiglu/silu(a)*b"]
    assert _glu_matches(xkern.explain(_halves(GELU_ERF))(a)) == ["geglu/split:gelu_erf(a)*b"]
    close(xkern.jit(_halves(GELU_TANH))(a), jax.jit(_halves(GELU_TANH))(a), F32)


def test_near_misses_are_not_rewritten():
    """Not a gated linear unit, or not the split form (a split along rows, into three): the
    split pattern declines; where the halves still meet as silu(g) * u, the two-input pattern may
    take them, and the program must still equal jax.jit's."""
    a, b = make((4, 12), F32, 2, seed=8)
    half = (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
    near_misses = {  # name: (function, inputs, patterns it must not match)
        "sigmoid(a)*b (not silu)": (lambda a, b: jax.nn.sigmoid(a) * b, (a, b), ("swiglu", "geglu")),
        "silu(a)+b": (lambda a, b: jax.nn.silu(a) + b, (a, b), ("swiglu", "geglu")),
        "gelu(a)*scalar": (lambda a, b: jax.nn.gelu(a) * 2.0, (a, b), ("swiglu", "geglu")),
        "other tanh-gelu constant": (
            lambda a, b: 0.5 * a * (1 + jnp.tanh(0.8 * (a + 0.044715 * a ** 3))) * b, (a, b), ("geglu",)),
        "float32 result kept": (lambda a, b: jax.nn.silu(a.astype(F32)) * b.astype(F32), half, ("swiglu",)),
        # up broadcast from a vector: XLA never writes the broadcast, the kernel would read it whole
        "gelu(x*s+t)*column scale": (lambda a, b: jax.nn.gelu(a * b[0] + b[1]) * b[2], (a, b), ("geglu",)),
        "split along rows": (_halves_along(0), (a,), ("swiglu/split",)),
        "split in three": (lambda x: (lambda g, u, _: jax.nn.silu(g) * u)(*jnp.split(x, 3, axis=-1)),
                           (a,), ("swiglu/split",)),
    }
    for name, (f, args, forbidden) in near_misses.items():
        report = xkern.explain(f)(*args)
        assert not [m for m in report.matches if m.pattern.startswith(forbidden)], name
        close(xkern.jit(f)(*args), jax.jit(f)(*args), F32)


def _halves_along(axis):
    return lambda x: (lambda g, u: jax.nn.silu(g) * u)(*jnp.split(x, 2, axis=axis))
