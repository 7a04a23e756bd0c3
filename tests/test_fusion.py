"""Generated kernels: fusion groups found in plain JAX code, Triton source generated per group, run
through the interpreter and compared with jax.jit (float32 references), edge values included."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.core import ShapedArray

import xkern
from xkern import pipeline
from xkern.fusion import codegen
from xkern.fusion.lowering import xla_selects_bool_product
from xkern.kernels.launch import kernel_names
from xkern.tuning import cost

EDGE = np.array([0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 1e-30, -1e-30, 80.0, -80.0, 1e30, -1e30,
                 np.inf, -np.inf, np.nan, 3.0], np.float32)


def fused_kernels(f, *args):
    return [n for n in kernel_names(jax.make_jaxpr(xkern.optimize(f))(*args)) if n.startswith("fused_")]


def edge_input(rows=3):
    rng = np.random.default_rng(0)
    return jnp.asarray(np.concatenate([np.tile(EDGE, (rows, 1)), rng.standard_normal((rows, 16)) * 3],
                                      axis=1).astype(np.float32))


def assert_matches_xla(f, *args, rtol=2e-6, atol=1e-6):
    got, want = xkern.jit(f)(*args), jax.jit(f)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        finite = np.isfinite(w)
        np.testing.assert_array_equal(g[~finite], w[~finite])  # inf keeps its sign
        np.testing.assert_allclose(g[finite], w[finite], rtol=rtol, atol=atol)


UNARY = {
    "exp": jnp.exp, "log": jnp.log, "log1p": jnp.log1p, "expm1": jnp.expm1, "sqrt": jnp.sqrt,
    "rsqrt": jax.lax.rsqrt, "tanh": jnp.tanh, "logistic": jax.nn.sigmoid, "erf": jax.scipy.special.erf,
    "erfc": jax.scipy.special.erfc, "sin": jnp.sin, "cos": jnp.cos, "abs": jnp.abs, "neg": jnp.negative,
    "sign": jnp.sign,
    "floor": jnp.floor, "ceil": jnp.ceil, "square": jnp.square, "cube": lambda x: x ** 3,
    "recip": lambda x: 1.0 / x, "gelu": jax.nn.gelu, "gelu exact": lambda x: jax.nn.gelu(x, False),
    "silu": jax.nn.silu, "relu": jax.nn.relu, "is_finite": lambda x: jnp.where(jnp.isfinite(x), x, 7.0),
}


@pytest.mark.parametrize("name", UNARY)
def test_each_unary_primitive_matches_xla_on_edge_values(name):
    op = UNARY[name]
    f = lambda x: op(x * 0.5 + 0.25)  # at least two operations: a group worth a kernel
    x = edge_input()
    assert len(fused_kernels(f, x)) == 1
    tol = {"tanh": 2e-6, "erf": 2e-6, "erfc": 1e-5, "sin": 5e-6, "cos": 5e-6}.get(name, 2e-6)
    assert_matches_xla(f, x, rtol=tol, atol=1e-6)


def test_erfc_keeps_its_tails():
    """erfc (and ndtr, norm.cdf through it) relative to its size out to where it underflows: not
    1 - erf, which is 0 from x ~ 4. Tolerance: erfc's condition number 2x^2 at float32 inputs."""
    x = jnp.asarray(np.linspace(-9.0, 9.0, 181, dtype=np.float32))[None]
    for f in (lambda x: jax.scipy.special.erfc(x * 1.0), lambda x: jax.scipy.stats.norm.cdf(x * 1.0 - 3.0)):
        assert len(fused_kernels(f, x)) == 1
        got, want = np.asarray(xkern.jit(f)(x), np.float64), np.asarray(jax.jit(f)(x), np.float64)
        np.testing.assert_allclose(got, want, rtol=3e-5, atol=1e-37)


def test_float16_results_round_after_each_operation_as_xla():
    """An intermediate past float16's range is inf, as in the program (loss scaling looks for it)."""
    x = jnp.asarray([[10.0, 11.0, 12.0, 13.0, -3.0, 0.5]], jnp.float16)
    for f in (lambda h: jnp.exp(h) * jnp.float16(0.001), lambda h: (h * h * 40.0) / h,
              lambda h: jnp.sum(h * 6000.0, -1)):
        assert len(fused_kernels(f, x)) == 1
        got, want = np.asarray(xkern.jit(f)(x), np.float32), np.asarray(jax.jit(f)(x), np.float32)
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
        np.testing.assert_allclose(got, want, rtol=1e-3)


def test_tiny_arguments_keep_relative_precision_sign_and_edge_powers():
    """tanh near 0 (where its exp formula cancels) relative to its size and with -0's sign; x ** 0
    is 1 at inf and NaN, as XLA."""
    x = jnp.asarray(np.concatenate([EDGE, [1e-4, -3e-3, 0.05, -0.0999, 0.1, 1e-7]]).astype(np.float32))[None]
    for f in (lambda x: jnp.tanh(x * 1.0), lambda x: (x * 1.0) ** 0 + x * 0.0 + 1.0):
        assert len(fused_kernels(f, x)) == 1
        assert_matches_xla(f, x, rtol=1e-6, atol=0)
        np.testing.assert_array_equal(np.signbit(xkern.jit(f)(x)), np.signbit(jax.jit(f)(x)))


def test_gelu_tanh_becomes_a_sigmoid_and_a_bare_tanh_keeps_the_precise_one():
    """0.5 * (1 + tanh(z)) in gelu's spellings is generated as 1 / (1 + exp(-2z)), tanh, the add, the
    halving and z's constant scaling absorbed; other tanhs added to constants take tanh_absolute
    and a bare tanh the precise one. Values against float64 in the negative tail, where 1 + tanh
    cancels in float32 (XLA's own result there is off by up to ~50%)."""
    x = edge_input()
    programs = {
        "jax.nn.gelu": lambda x: jax.nn.gelu(x * 0.5) * 1.5,
        "0.5x(1+tanh)": lambda x: 0.5 * x * (1 + jnp.tanh(0.7978845608 * (x + 0.044715 * x ** 3))) * 1.5,
        "2+tanh": lambda x: (2.0 + jnp.tanh(x * 0.5)) * 1.5,
        "tanh": lambda x: jnp.tanh(x * 0.5) * 1.5,
    }
    code = lambda source: "\n".join(line.split("#")[0] for line in source.split("def ")[1].splitlines())
    sources = {name: code([m.source for m in xkern.explain(f)(x).matches if m.op == "fused"][0])
               for name, f in programs.items()}
    for name in ("jax.nn.gelu", "0.5x(1+tanh)"):
        assert "reciprocal_one_plus_exp2(" in sources[name] and "tanh" not in sources[name]
        assert_matches_xla(programs[name], x)
    assert "* 0.7978" not in sources["jax.nn.gelu"]  # z's scaling folded into the exponent's
    assert "(2.0 * reciprocal_one_plus_exp2(" in sources["0.5x(1+tanh)"]  # its 0.5 multiplies x
    assert "tanh_absolute(" in sources["2+tanh"] and " tanh(" in sources["tanh"]

    tail = jnp.linspace(-9.0, -1.0, 1001, dtype=jnp.float32)[None]
    got = np.asarray(xkern.jit(lambda x: jax.nn.gelu(x * 1.0))(tail), np.float64)
    t = np.asarray(tail, np.float64)
    want = t / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (t + 0.044715 * t ** 3)))  # = gelu, no cancellation
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=0)


def test_arrays_without_rows():
    for f, shape in ((lambda x: jnp.exp(x * 2.0), (0, 5)), (lambda x: jnp.exp(x * 2.0).sum(-1), (0,))):
        got = xkern.jit(f)(jnp.zeros((0, 5)))
        assert got.shape == shape and got.dtype == jnp.float32


BINARY = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": jnp.divide,
    "max": jnp.maximum, "min": jnp.minimum,
    "lt select": lambda a, b: jnp.where(a < b, a, b * 2), "ge select": lambda a, b: jnp.where(a >= b, a, -b),
    "eq ne": lambda a, b: jnp.where((a == b) | (a != a), 1.0, b),
    "clip": lambda a, b: jnp.clip(a, -1.0, b),
}


@pytest.mark.parametrize("name", BINARY)
def test_each_binary_primitive_matches_xla_on_edge_values(name):
    x = edge_input()
    y = jnp.roll(x, 3, axis=1)
    f = lambda a, b: BINARY[name](a * 1.0 + 0.0, b) * 1.5
    assert len(fused_kernels(f, x, y)) == 1
    assert_matches_xla(f, x, y)


def test_max_and_min_of_zeros_of_either_sign_as_xla():
    """Of +0 and -0, maximum is +0 and minimum -0 in either order, elementwise and along a row, and
    -(+0) is -0 (a later 1 / x tells them apart: inf or -inf). On an H100 (Triton 3.6) min of two
    zeros and the negation of +0 came out +0."""
    a = jnp.asarray([[0.0, -0.0, 0.0, -0.0, 0.0]] * 2, jnp.float32)
    b = jnp.asarray([[-0.0, 0.0, 0.0, -0.0, -0.0]] * 2, jnp.float32)
    f = lambda a, b: (1 / jnp.maximum(a * 1.0, b), 1 / jnp.minimum(a * 1.0, b),
                      1 / jnp.max(a * b, -1), 1 / jnp.min(-(a * b), -1), 1 / -(a * b))
    assert len(fused_kernels(f, a, b)) >= 1
    for got, want in zip(xkern.jit(f)(a, b), jax.jit(f)(a, b)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bound", [-1.0, np.nan, np.inf], ids=["finite", "nan", "inf"])
def test_scalar_arguments_in_comparisons_and_max_min(bound):
    """A clamp by scalar arguments (a truncated-normal initializer's): comparisons on a scalar, then
    broadcast, crashed the interpreter (its result was typed float32)."""
    x = edge_input()
    f = lambda x, lo, hi: (jnp.minimum(hi, jnp.maximum(lo, x * 1.41)) * 3.0,
                           jnp.where(lo < hi, x, -x) * 2.0 + (lo != lo))
    assert len(fused_kernels(f, x, jnp.float32(bound), jnp.float32(2.0))) == 1
    assert_matches_xla(f, x, jnp.float32(bound), jnp.float32(2.0))


def test_integer_and_boolean_arithmetic():
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.integers(-50, 50, (4, 33)), jnp.int32)
    b = jnp.asarray(rng.integers(1, 9, (4, 33)) * rng.choice([-1, 1], (4, 33)), jnp.int32)
    f = lambda a, b: ((a * 3 - b) + jnp.maximum(a, b) - jnp.minimum(a, -b) * 2,
                      ((a > 0) & (b < 0)) | ~(a == b), jnp.sign(a) * jnp.abs(b))
    assert len(fused_kernels(f, a, b)) == 1
    assert_matches_xla(f, a, b, rtol=0, atol=0)


def test_half_precision_inputs_and_casts():
    x = edge_input().astype(jnp.bfloat16)
    h = edge_input().astype(jnp.float16)
    f = lambda x, h: ((x.astype(jnp.float32) * 2 + 1).astype(jnp.bfloat16) * x,
                      jnp.exp(h * 0.1).astype(jnp.float32) + x.astype(jnp.float32))
    assert len(fused_kernels(f, x, h)) == 1
    assert_matches_xla(f, x, h, rtol=2e-2, atol=1e-2)  # two bf16 ulps: rounding points may differ


def test_casts_to_bfloat16_round_to_nearest_even_as_xla():
    """Through the interpreter too (it truncated float32 and took integers as bits; launch.py rounds)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(np.concatenate([rng.standard_normal(500) * 100, [1.00390625, 1.01171875, 3.3895314e38,
                                    np.nan, np.inf, -np.inf]]).astype(np.float32))[None]
    i = jnp.asarray(np.concatenate([rng.integers(-10 ** 6, 10 ** 6, 500), [1, -1, 257, 259]]).astype(np.int32))[None]
    for f, a in ((lambda x: (x * 1.0 + 0.5).astype(jnp.bfloat16), x), (lambda i: (i * 3).astype(jnp.bfloat16), i)):
        assert len(fused_kernels(f, a)) == 1
        got, want = np.asarray(xkern.jit(f)(a), np.float32), np.asarray(jax.jit(f)(a), np.float32)
        np.testing.assert_array_equal(got, want)


def layer_norm(x, scale, bias):
    """Layer-norm-like, by the mean absolute deviation: two dependent row reductions for a generated
    kernel (a real layer norm is the norm patterns' and never reaches the code generator)."""
    mean = x.mean(-1, keepdims=True)
    deviation = jnp.abs(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(deviation + 1e-6) * scale + bias


ROW_PROGRAMS = {
    "layer norm": lambda x, s: layer_norm(x, s, 0.5 * s),
    "rms norm": lambda x, s: x * jax.lax.rsqrt(jnp.mean(x * x + 1.0, -1, keepdims=True)) * s,  # not rms_norm's
    "max-shifted": lambda x, s: jnp.exp(x - x.max(-1, keepdims=True)) * s,
    "min and sum out": lambda x, s: (x.min(-1), (x * s).sum(-1), x * 2 - 1),
}


@pytest.mark.parametrize("name", ROW_PROGRAMS)
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 33), (2, 1025)], ids=str)
def test_row_reductions_broadcast_back_and_row_outputs(name, shape):
    x = jnp.asarray(np.random.default_rng(2).standard_normal(shape) * 3, jnp.float32)
    s = jnp.linspace(0.5, 1.5, shape[-1], dtype=jnp.float32)
    f = ROW_PROGRAMS[name]
    assert len(fused_kernels(f, x, s)) == 1
    assert_matches_xla(f, x, s, rtol=1e-5, atol=1e-5)


def test_nan_inside_a_row_reduction_propagates():
    x = edge_input()
    f = lambda x: (x.max(-1), x.min(-1), (x * 2).sum(-1))
    assert_matches_xla(f, x)


def test_a_product_with_a_converted_bool_is_a_select_as_xla_makes_it():
    """x * mask.astype(float): XLA simplifies it to select(mask, x, 0), so a non-finite x where the
    mask is false gives 0, not NaN (0 * inf); the generated kernel does the same, in the forward and
    in the backward (the cotangent times the mask). Whether XLA does depends on the platform and the
    dtypes (the CPU keeps a bfloat16 product, computed as float32 between converts, and a mask
    converted twice): each case is compared with jax.jit's on this platform, and the probe's answer
    on the CPU differs between the cases, so they tell a select from a product."""
    x = edge_input()
    m = jnp.asarray(np.random.default_rng(5).integers(0, 2, x.shape), bool).at[:, 12:15].set(False)
    cases = {"mask input": lambda x, m: (jnp.exp(x) * m.astype(jnp.float32) * 2.0 + 1.0).sum(-1),
             "mask computed, first operand": lambda x, m: (x < 5).astype(jnp.float32) * jnp.tanh(x) * 3.0 + x,
             "bfloat16 mask (XLA: a float32 product)": lambda x, m: jnp.exp(x).astype(jnp.bfloat16) * m.astype(
                 jnp.bfloat16) + 1,
             "float16 mask": lambda x, m: jnp.exp(x).astype(jnp.float16) * m.astype(jnp.float16) + 1,
             "converted twice": lambda x, m: (jnp.exp(x) * m.astype(jnp.bfloat16).astype(jnp.float32)).sum(-1),
             "through int32": lambda x, m: jnp.tanh(x) * m.astype(jnp.int32).astype(jnp.float32) - x}
    if jax.default_backend() == "cpu":  # both kinds among the cases, as seen on the CPU
        assert xla_selects_bool_product(("float32",)) and not xla_selects_bool_product(("bfloat16",))
    for name, f in cases.items():
        assert fused_kernels(f, x, m), name
        assert_matches_xla(f, x, m, rtol=1e-5)
    grad = jax.grad(lambda x, m: jnp.sum(jnp.tanh(x) * m.astype(jnp.float32) * 3.0 + jnp.sin(x) * 0.1))
    assert_matches_xla(grad, x, m, rtol=1e-5)
    # The mask converted in one kernel, multiplied in another: the max's gradient, a row with a NaN
    # (no element equals the max: 0 of them, 1 / 0 times the converted mask)
    logits = jnp.asarray(np.random.default_rng(6).standard_normal((4, 7)), jnp.float32).at[0, 3].set(jnp.nan)
    loss = lambda lo, y: (jnp.max(lo, -1) - jnp.take_along_axis(lo, y[:, None], -1)[:, 0]).mean()
    assert_matches_xla(jax.grad(loss), logits, jnp.arange(4, dtype=jnp.int32), rtol=1e-5)


def test_gradients_and_vmap_through_a_generated_kernel():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((6, 40)), jnp.float32)
    s, b = jnp.linspace(0.5, 1.5, 40), jnp.linspace(-1, 1, 40)
    loss = lambda x, s, b: jnp.sum(layer_norm(x, s, b) ** 2 * jnp.arange(40.0))
    got = jax.grad(xkern.optimize(loss), argnums=(0, 1, 2))(x, s, b)
    want = jax.grad(loss, argnums=(0, 1, 2))(x, s, b)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    xs = x.reshape(2, 3, 40)
    for in_axes, scales in (((0, None, None), s), ((0, 0, None), jnp.stack([s, 2 * s]))):
        got = jax.vmap(xkern.optimize(layer_norm), in_axes=in_axes)(xs, scales, b)
        want = jax.vmap(layer_norm, in_axes=in_axes)(xs, scales, b)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_gradient_of_a_python_number_through_a_generated_kernel():
    """jax.grad of an optimized function with respect to a Python float, eagerly: the number reaches
    the kernel as jax's TypedFloat (no array methods); under jit too. The number's gradient is weakly
    typed, as jax's (it then promotes as the number did)."""
    x = jnp.asarray(np.random.default_rng(8).standard_normal((4, 37)), jnp.float32)
    f = lambda x, s: jnp.sum(jnp.tanh(x * s) * x)
    assert fused_kernels(f, x, 2.0)
    for wrap in (lambda g: g, jax.jit):
        got = wrap(jax.grad(xkern.optimize(f), argnums=(0, 1)))(x, 2.0)
        want = jax.grad(f, argnums=(0, 1))(x, 2.0)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
            assert jax.typeof(g) == jax.typeof(w)
        assert jax.typeof(got[1]).weak_type


def test_a_backward_program_is_one_generated_kernel():
    """A program that takes a gradient itself (seen by xkern.jit after differentiation): tanh's
    derivative (jax 0.11 writes 1 - t * t as one_minus_square) and the sum of a value's two
    cotangents (add_any) stay inside the group, so the whole backward is one kernel."""
    f = jax.grad(lambda x: jnp.sum(jnp.tanh(x * 1.5) * x))  # x is used twice: add_any
    x = edge_input()
    (name,) = fused_kernels(f, x)
    source = next(m.source for m in xkern.explain(f)(x).matches if m.kernels == [name])
    assert "add_any" in source
    assert_matches_xla(f, x, rtol=2e-6, atol=1e-6)


def test_source_is_cached_on_disk_and_shown_by_explain(tmp_path, monkeypatch):
    monkeypatch.setenv("XKERN_CACHE_DIR", str(tmp_path))
    x, s = jnp.ones((4, 9)), jnp.ones(9)
    report = xkern.explain(ROW_PROGRAMS["rms norm"])(x, s)
    (match,) = [m for m in report.matches if m.op == "fused"]
    assert "@triton.jit" in match.source and "tl.sum" in match.source
    name = match.kernels[0]
    monkeypatch.delitem(codegen._LOADED, name, raising=False)  # force a fresh load from disk
    xkern.jit(ROW_PROGRAMS["rms norm"])(x, s)
    path = tmp_path / "generated" / f"{name}.py"
    assert path.read_text() == match.source  # written under XKERN_CACHE_DIR, content-addressed
    assert name in codegen._LOADED
    assert report.bytes_before > report.bytes_after


def test_a_read_only_cache_is_read_and_new_sources_go_to_a_writable_one(tmp_path, monkeypatch):
    """XKERN_CACHE_DIR read-only (shipped with an image): a source it holds is imported from it; one
    it lacks is written to the next folder that takes files (~/.cache/xkern here)."""
    shipped, home = tmp_path / "shipped", tmp_path / "home"
    monkeypatch.setenv("XKERN_CACHE_DIR", str(shipped))
    monkeypatch.setenv("HOME", str(home))
    takes_files = codegen._takes_files
    monkeypatch.setattr(codegen, "_takes_files", lambda folder: not folder.startswith(str(shipped)) and
                        takes_files(folder))
    x, s = jnp.ones((4, 9)), jnp.ones(9)
    program = lambda: lambda x, s: jnp.tanh(x * s).sum(-1)  # a new function each time: traced, not cached
    (match,) = [m for m in xkern.explain(program())(x, s).matches if m.op == "fused"]
    name = match.kernels[0]
    monkeypatch.delitem(codegen._LOADED, name, raising=False)
    assert_matches_xla(program(), x, s)
    assert (home / ".cache" / "xkern" / "generated" / f"{name}.py").read_text() == match.source
    assert not (shipped / "generated" / f"{name}.py").exists()
    (shipped / "generated" / f"{name}.py").write_text(match.source)  # now the image ships it
    (home / ".cache" / "xkern" / "generated" / f"{name}.py").unlink()
    monkeypatch.delitem(codegen._LOADED, name)
    assert_matches_xla(program(), x, s)
    assert not (home / ".cache" / "xkern" / "generated" / f"{name}.py").exists()  # read where it was


def test_explain_says_which_planned_kernels_do_not_run():
    """Under jax.grad the group computing only the loss's value is planned but never launched (the
    gradient does not need it), and so are groups of empty arrays: explain says so beside them."""
    f = lambda x: jnp.sum(jnp.tanh(x * 2.0 + 1.0), -1).sum()
    x = jnp.ones((4, 9))
    for program, args, idle in ((jax.grad(f), (x,), 1), (jax.value_and_grad(f), (x,), 0), (f, (x[:0],), 1)):
        report = xkern.explain(program)(*args)
        lines = [line for line in str(report).splitlines() if line.startswith("  fused")]
        assert len(lines) == len(report.matches) >= 1
        for m, line in zip(report.matches, lines):
            assert ("not launched" in line) == (m.kernels[0] not in report.kernels), line
        assert sum("not launched" in line for line in lines) == idle


def test_what_cannot_be_fused_stays_with_xla():
    x = jnp.ones((4, 8))
    assert fused_kernels(lambda x: jnp.sort(x * 2) + 1, x) == []  # sort splits the chain
    assert fused_kernels(lambda x: (x * 2).sum(0) + 1, x) == []  # leading-axis reduction
    assert fused_kernels(lambda x: x * 2, x) == []  # one operation: nothing to fuse
    assert fused_kernels(lambda a: jax.lax.div(a, a + 1) * 2, jnp.ones((4, 8), jnp.int32)) == []
    to_int = xkern.explain(lambda x: (x * 2 + 1).astype(jnp.int32))(x)  # the add and mul fuse ...
    assert to_int.matches and all(".to(tl.int32)" not in m.source for m in to_int.matches)  # ... not the cast
    with jax.enable_x64(True):
        x64 = jnp.ones((4, 8), jnp.float64)
        assert fused_kernels(lambda x: jnp.exp(x) * 2 + 1, x64) == []
    # Computed from constants alone (iotas, a broadcast 1.0: a mask, scaled, into a product): XLA
    # folds it, or fuses it into its users
    made = lambda x: x @ (1e6 * jnp.triu(jnp.ones((8, 8)), 1) + 2.0) + jnp.tanh(x) * 2
    report = xkern.explain(made)(x)
    assert report.matches and len(report.declined) == 1, report
    assert report.declined[0].reason.startswith("computed from constants alone")
    table = jnp.linspace(0.0, 1.0, 8)  # a closed-over array: a constant of the program too
    made = lambda x: x @ (jnp.exp(table)[:, None] * 3 + 1) + jnp.tanh(x) * 2
    assert [d.reason[:29] for d in xkern.explain(made)(x).declined] == ["computed from constants alone"]
    np.testing.assert_allclose(xkern.jit(made)(x), jax.jit(made)(x), rtol=1e-6)
    np.testing.assert_allclose(xkern.jit(made)(x), jax.jit(made)(x), rtol=1e-6)


@pytest.mark.cost_model
def test_cost_model_follows_the_h200_measurements():
    # Measured: x*a+b*c 1.20x, gelu chain 1.60x, layer norm 1.17x, rms norm 1.13x; tiny groups lose
    # to the custom call's fixed cost.
    assert cost.decline_reason("fused", [], {"bytes": 1 << 30, "n_cols": 8192}, "triton") is None
    assert "too small" in cost.decline_reason("fused", [], {"bytes": 1 << 20, "n_cols": 8192}, "triton")
    assert cost.decline_reason("fused", [], {"bytes": 1 << 10, "n_cols": 8}, "interpret") is None
    # Attention with dropout: the kernels at 223 / 304 TFLOP/s forward at head dims 64 / 128, XLA at a
    # score's traffic whatever the head dim: taken at both, declined at 256 and when tiny.
    bshd = lambda b, s, h, d: jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    assert cost.decline_reason("attention_dropout", [bshd(32, 512, 16, 64)] * 3, {}, "triton") is None
    assert cost.decline_reason("attention_dropout", [bshd(4, 4096, 32, 128)] * 3, {}, "triton") is None
    assert "head dim 256" in cost.decline_reason("attention_dropout", [bshd(2, 4096, 16, 256)] * 3, {}, "triton")
    assert "too small" in cost.decline_reason("attention_dropout", [bshd(1, 16, 2, 64)] * 3, {}, "triton")
    closed = jax.make_jaxpr(lambda x, s: layer_norm(x, s, s))(jnp.ones((16384, 4096)), jnp.ones(4096))
    assert pipeline.plan(closed, "triton").fusions  # planning launches nothing: no GPU needed
    # Bordered by an operation XLA would fuse into it (a column sum, a transpose): left to XLA.
    for f in (lambda x, s: layer_norm(x, s, s).sum(0), lambda x, s: layer_norm(x.T, s, s)):
        x = jnp.ones((4096, 4096))
        plan = pipeline.plan(jax.make_jaxpr(f)(x, jnp.ones(4096)), "triton")
        assert not plan.fusions and "XLA would fuse" in plan.declined[0].reason
    # An elementwise epilogue of a (batched) matmul: XLA folds it into the matmul's output.
    bmm = lambda q, k: jnp.where(q > 0, jnp.einsum("bij,bkj->bik", q, k) * 0.125, -1e9)
    q = jnp.ones((16, 1024, 1024))
    plan = pipeline.plan(jax.make_jaxpr(bmm)(q, q), "triton")
    assert not plan.fusions and "matmul's product" in plan.declined[0].reason


# (sin's argument clamped: after v * v twice it reached 1376, where float32's rounding of the argument
# alone, 1.2e-4, moved sin by more than the tolerance, in XLA as in the kernel)
OPS = [lambda v: jnp.exp(-jnp.abs(v)), jnp.tanh, jax.nn.sigmoid, jnp.abs, lambda v: v * 1.5, lambda v: v + 0.25,
       lambda v: jnp.maximum(v, 0.1), lambda v: jnp.sin(jnp.minimum(jnp.maximum(v, -10.0), 10.0)), lambda v: v * v]


@settings(max_examples=15, deadline=None)
@given(ops=st.lists(st.integers(0, len(OPS) - 1), min_size=2, max_size=6),
       combine=st.lists(st.sampled_from(["x", "row", "col"]), min_size=1, max_size=3),
       reduce=st.booleans(), cols=st.integers(1, 70))
def test_random_elementwise_and_reduction_programs(ops, combine, reduce, cols):
    rng = np.random.default_rng(cols)
    x = jnp.asarray(rng.standard_normal((3, cols)), jnp.float32)
    row = jnp.asarray(rng.standard_normal((3, 1)), jnp.float32)
    col = jnp.asarray(rng.standard_normal((cols,)), jnp.float32)

    def f(x, row, col):
        v = x
        for k, i in enumerate(ops):
            v = OPS[i](v)
            other = {"x": x, "row": row, "col": col}[combine[k % len(combine)]]
            v = v + other * 0.5
        return (v, v.sum(-1, keepdims=True) * v) if reduce else v
    assert_matches_xla(f, x, row, col, rtol=5e-5, atol=5e-5)


@pytest.mark.parametrize("shape", [(7, 7), (2, 5, 5), (4, 6)], ids=str)
def test_a_reduction_broadcast_along_the_last_axis_is_not_read_per_row(shape):
    """x.sum(-1)[None, :] is one value per column of a square group (r[j], not r[i]): the group
    shape alone cannot tell it from a row value, the kind of the reduction's output can. Pairwise
    squared distances of n points in n dimensions are written so."""
    x = jnp.asarray(np.random.default_rng(sum(shape)).standard_normal(shape), jnp.float32)
    per_column = lambda x: (x + x.sum(-1)[..., None, :] * 0.5) * 2 if x.shape[-1] == x.shape[-2] else \
        (x + x.sum(-1, keepdims=True)) * 2
    assert_matches_xla(per_column, x, rtol=1e-5, atol=1e-5)
    if len(shape) == 2:
        square = jnp.asarray(np.random.default_rng(3).standard_normal((shape[0], shape[0])), jnp.float32)
        pdist = lambda x: jnp.sum(x * x, -1)[:, None] + jnp.sum(x * x, -1)[None, :] - 2.0 * jnp.tanh(x)
        assert_matches_xla(pdist, square, rtol=1e-5, atol=1e-5)


def test_vmap_fallback_tells_apart_groups_that_share_a_kernel():
    # Two layer norms of different row shapes compile to the same kernel source; with the scale
    # batched too, vmap falls back to each group's own equations, which must be the right group's.
    def f(a, b, s):
        return layer_norm(a, s, s).sum() + layer_norm(b, s, s).sum()
    a = jnp.asarray(np.random.default_rng(4).standard_normal((2, 3, 40)), jnp.float32)
    b = jnp.asarray(np.random.default_rng(5).standard_normal((2, 5, 7, 40)), jnp.float32)
    s = jnp.stack([jnp.linspace(0.5, 1.5, 40), jnp.linspace(1.0, 2.0, 40)])
    names = fused_kernels(f, a[0], b[0], s[0])
    assert len(names) == 2 and names[0] == names[1]
    np.testing.assert_allclose(jax.vmap(xkern.optimize(f))(a, b, s), jax.vmap(f)(a, b, s), rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_matmul_with_generated_epilogue(dtype):
    # Odd sizes: M, K, N not multiples of any tile.
    rng = np.random.default_rng(6)
    x, r = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((3, 37, 45), (3, 37, 29)))
    w = jnp.asarray(rng.standard_normal((45, 29)) * 0.2, dtype)
    b = jnp.asarray(np.linspace(-1, 1, 29), dtype)
    f = lambda x, w, b, r: jax.nn.gelu(x @ w + b) * 0.5 + r
    (name,) = fused_kernels(f, x, w, b, r)
    report = xkern.explain(f)(x, w, b, r)
    assert "tl.dot" in report.matches[0].source and report.matches[0].pattern.startswith("generated/")
    tol = {jnp.float32: 1e-5, jnp.float16: 5e-3, jnp.bfloat16: 2e-2}[dtype]
    assert_matches_xla(f, x, w, b, r, rtol=tol, atol=tol * 4)
    grad = jax.grad(lambda *a: xkern.optimize(f)(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))
    # The epilogue's derivative is a generated kernel too (the bias gradient's row sum is XLA's).
    assert not [m for m in report.matches if "epilogue derivative" in m.pattern]  # never run forward only
    explained = xkern.explain(grad)(x, w, b, r)
    derivative = [m for m in explained.matches if "epilogue derivative" in m.pattern]
    assert len(derivative) == 1 and "tl.dot" not in derivative[0].source
    # each match names the kernel that runs (differentiated: the variant also writing the product)
    assert {k for m in explained.matches for k in m.kernels} == set(explained.kernels)
    launched = kernel_names(jax.make_jaxpr(grad)(x, w, b, r))  # forward (also writing the product)
    assert len(launched) == 2 and launched[1] == derivative[0].kernels[0]
    got = grad(x, w, b, r)
    want = jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))(x, w, b, r)
    for g, v in zip(got, want):  # the backward starts from the kernel's own (rounded) product
        v = np.asarray(v, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), v, rtol=tol, atol=2 * tol * np.abs(v).max())


@pytest.mark.parametrize("tma,programs", [(True, 0), (False, 2), (True, 4)], ids=["tma", "persistent", "tma-persistent"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_matmul_template_variants(dtype, tma, programs):
    """The template's Hopper variants at sizes no tile divides (6 tiles), through the interpreter
    (compiled on a GPU; TMA only where the device has it): TMA loads (operand tiles by descriptor;
    reads past the edges are zeros) and persistent programs (2 or 4 programs looping over the 6
    tiles, some taking more than others): XLA's values."""
    from xkern.kernels import generated
    from xkern.kernels import launch as L
    backend = "interpret" if L.INTERPRET else "triton"
    if tma and backend == "triton" and not L.tma_supported():
        pytest.skip("this GPU has no TMA")
    rng = np.random.default_rng(8)
    x, w = jnp.asarray(rng.standard_normal((37, 40)), dtype), jnp.asarray(rng.standard_normal((40, 24)) * 0.2, dtype)
    b = jnp.asarray(np.linspace(-1, 1, 24), dtype)
    f = lambda x, w, b: jnp.tanh(x @ w + b) * 2.0
    plan = pipeline.plan(jax.make_jaxpr(f)(x, w, b), "interpret")  # every group, no costing
    (fused,) = [m.fused for m in plan.fusions.values()]
    views, _ = generated._views(fused, (x, w, b))
    config = generated.matmul_configs(37, 24, 40, "interpret")[0].replace(BLOCK_M=16, BLOCK_N=16, TMA=tma,
                                                                          PROGRAMS=programs)
    (got,) = generated._launch_views(views, fused, backend, config)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(f(x, w, b), np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("m,k,n", [(1000, 392, 264), (1031, 520, 260), (77, 40, 64)])
def test_every_matmul_candidate_gives_xla_values(m, k, n):
    """The tuner keeps whichever candidate is fastest without looking at its result, so each tile it
    may be offered for a problem (TMA, persistent and pointer loads, where they apply: n = 260 rows
    are no multiple of 16 bytes) must give XLA's values, at sizes no tile divides. On CPU the
    interpreter's one tile."""
    from xkern.kernels import generated
    from xkern.kernels import launch as L
    backend = "interpret" if L.INTERPRET else "triton"
    if backend == "interpret":  # one tile there, run program by program: odd sizes, smaller
        m, k, n = min(m, 77), min(k, 40), min(n, 64) - (n % 16 != 0)
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.1, jnp.bfloat16)
    b = jnp.asarray(np.linspace(-1, 1, n), jnp.bfloat16)
    f = lambda x, w, b: jax.nn.gelu(x @ w + b)
    plan = pipeline.plan(jax.make_jaxpr(f)(x, w, b), "interpret")  # every group, no costing
    (fused,) = [match.fused for match in plan.fusions.values()]
    views, _ = generated._views(fused, (x, w, b))
    tma = backend == "triton" and L.tma_supported() and generated.tma_fits(k, n, 2)
    candidates = generated.matmul_configs(m, n, k, backend, L.vendor() if backend == "triton" else "cuda", tma,
                                          getattr(jax.devices()[0], "core_count", 0) if tma else 0)
    want = np.asarray(f(*(a.astype(jnp.float32) for a in (x, w, b))))
    for config in candidates:
        (got,) = generated._launch_views(views, fused, backend, config)
        err = float(np.max(np.abs(np.asarray(got, np.float32) - want)))
        assert err <= 2e-2 * max(np.abs(want).max(), 1.0), (config, err)
    assert backend == "interpret" or len(candidates) > 4


@pytest.mark.skipif(os.environ["XKERN_BACKEND"] != "interpret", reason="runs a kernel through the interpreter")
def test_the_matmul_tuners_measure_checks_results(monkeypatch):
    """The matmul epilogue's measure (run through the interpreter with the timer faked) hands each
    candidate's results to autotune.agrees before timing it: a candidate that disagrees is skipped."""
    from xkern.kernels import generated
    from xkern.tuning import autotune
    x, w, b = jnp.ones((37, 40), jnp.float32), jnp.ones((40, 24), jnp.float32), jnp.ones((24,), jnp.float32)
    plan = pipeline.plan(jax.make_jaxpr(lambda x, w, b: jnp.tanh(x @ w + b))(x, w, b), "interpret")
    (fused,) = [match.fused for match in plan.fusions.values()]
    views, n_rows = generated._views(fused, (x, w, b))
    calls = []

    def tuned(family, key, candidates, measure, backend, version=""):
        wrong = candidates[0].replace(BLOCK_M=candidates[0]["BLOCK_M"])
        calls.append(autotune.best([candidates[0], wrong], measure))
        return candidates[0]
    monkeypatch.setattr(autotune, "tuned", tuned)
    monkeypatch.setattr(generated, "time_pipelined", lambda step, *args, **kw: 2.0)
    firsts = []
    real = autotune.agrees
    monkeypatch.setattr(autotune, "agrees", lambda first, out: (firsts.append(len(first)), real(first, out)))
    generated._config(fused, views, n_rows, "interpret")
    assert calls[0][1] == 2.0 and firsts[0] == 0 and firsts[1:] and all(n == 1 for n in firsts[1:])


def test_matmul_tiles_offer_tma_only_where_descriptors_fit():
    from xkern.kernels import generated
    assert generated.tma_fits(4096, 4096, 2) and not generated.tma_fits(4095, 4096, 2)
    assert not generated.tma_fits(4096, 4100, 1) and generated.tma_fits(4096, 4100, 4)
    tma = generated.matmul_configs(8192, 8192, 8192, "triton", "cuda", tma=True)
    assert tma[0]["TMA"] and tma[0]["BLOCK_N"] == 256 and sum(not c["TMA"] for c in tma) == 2
    assert not any(c["TMA"] for c in generated.matmul_configs(8192, 8192, 8192, "triton", "cuda"))
    assert not any(c["TMA"] for c in generated.matmul_configs(8192, 8192, 8192, "triton", "rocm"))
    persistent = generated.matmul_configs(8192, 8192, 8192, "triton", "cuda", tma=True, programs=132)
    assert [c for c in persistent if not c["PROGRAMS"]] == tma  # added after the one-tile-per-program ones
    assert [(c["PROGRAMS"], c["TMA"]) for c in persistent if c["PROGRAMS"]] == [(132, True)] * 2


def test_matmul_epilogue_backward_reuses_the_product():
    x, w = jnp.ones((8, 16)), jnp.ones((16, 12))
    f = lambda x, w: jnp.tanh(x @ w) * 2.0
    grad = jax.jit(jax.grad(lambda x, w: xkern.optimize(f)(x, w).sum(), argnums=(0, 1)))
    hlo = grad.lower(x, w).compile().as_text()
    assert hlo.count(" dot(") == 2  # the two gradient matmuls; the forward's product is saved
    # A boolean input of the epilogue has no gradient; its derivative kernel still takes it.
    m = jnp.arange(8 * 12).reshape(8, 12) % 3 == 0
    masked = lambda x, w, m: jnp.where(m, jnp.tanh(x @ w), 0.0) * 3.0
    grads = [jax.grad(lambda x, w: g(x, w, m).sum(), argnums=(0, 1))(x * 0.1, w) for g in (xkern.optimize(masked), masked)]
    np.testing.assert_allclose(grads[0][0], grads[1][0], rtol=1e-5)
    np.testing.assert_allclose(grads[0][1], grads[1][1], rtol=1e-5)
    np.testing.assert_allclose(grad(x, w)[1], jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))(x, w)[1],
                               rtol=1e-5)


@pytest.mark.parametrize("m,k,n", [(4, 0, 8), (0, 5, 8), (4, 5, 0)], ids=str)
def test_empty_matmuls_and_rows_of_nothing_equal_xla(m, k, n):
    """An empty contraction (the product is zeros, the epilogue still runs on them), an empty product,
    and a row reduction over no columns (max: -inf): values and gradients as jax.jit's (they raised)."""
    rng = np.random.default_rng(m + k + n)
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((m, k), (k, n)))
    b = jnp.asarray(rng.standard_normal(n), jnp.float32)
    mlp = lambda x, w, b: jax.nn.gelu(x @ w + b) * 2.0
    rows = lambda x, w, b: (jax.lax.reduce_max(jnp.exp(x) * 2.0, (1,)), jnp.sum(jnp.tanh(x) + 1.0, -1))
    for f in (mlp, rows):
        for got, want in zip(jax.tree.leaves(xkern.jit(f)(x, w, b)), jax.tree.leaves(jax.jit(f)(x, w, b))):
            np.testing.assert_allclose(got, want, rtol=1e-6)
    loss = lambda x, w, b: jnp.sum(mlp(x, w, b))
    for got, want in zip(xkern.jit(jax.grad(loss, (0, 1, 2)))(x, w, b), jax.grad(loss, (0, 1, 2))(x, w, b)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.cost_model
def test_matmul_epilogue_batching_and_what_it_leaves_alone():
    rng = np.random.default_rng(7)
    x, w = jnp.asarray(rng.standard_normal((2, 9, 20)), jnp.float32), jnp.asarray(rng.standard_normal((20, 17)), jnp.float32)
    f = lambda x, w: jnp.tanh(x @ w) + 1.0
    np.testing.assert_allclose(jax.vmap(xkern.optimize(f), in_axes=(0, None))(x, w),
                               jax.vmap(f, in_axes=(0, None))(x, w), rtol=1e-5, atol=1e-6)
    ws = jnp.stack([w, -w])
    np.testing.assert_allclose(jax.vmap(xkern.optimize(f))(x, ws), jax.vmap(f)(x, ws), rtol=1e-5, atol=1e-6)
    assert fused_kernels(lambda x, w: x @ w, x[0], w) == []  # a bare matmul stays with XLA (cuBLAS)
    def product_escapes(x, w):
        y = x @ w
        return jnp.tanh(y) + 1.0, y  # y must be written anyway: no epilogue fusion
    assert not any("tl.dot" in m.source for m in xkern.explain(product_escapes)(x[0], w).matches)
    big = [ShapedArray((8192, 8192), jnp.bfloat16)] * 2
    assert "training at best ties" in cost.decline_reason("matmul_epilogue", big, {}, "triton")
    # On a GPU the declined epilogue stays with XLA as a whole (cuBLASLt fuses it into the matmul):
    # no generated kernel may take the bias + gelu and read the product back.
    mlp = lambda x, w, b: jax.nn.gelu(x @ w + b)
    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    plan = pipeline.plan(jax.make_jaxpr(mlp)(spec(8192, 4096), spec(4096, 8192), spec(8192)), "triton")
    assert not plan.fusions and "matmul" in plan.declined[0].pattern
