"""xkern rope against a float32 jax.numpy reference: values and gradients (x, cos, sin) for both
layouts and both table widths, edge values, vmap, errors, and the patterns that find rope in plain
JAX programs; through the interpreter."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xkern
from xkern.jaxpr_passes import rope_rules
from xkern.jaxpr_passes.canonicalize import dce
from xkern.kernels import launch as L
from xkern.kernels import rope as R
from xkern.kernels.launch import kernel_names

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 3e-3}
dtype_id = lambda d: jnp.dtype(d).name


def make(shape, dtype, full_width, seed=0, table_dtype=jnp.float32):
    """x, cos, sin, dy. Full-width tables hold unrelated values in each half (not angles repeated):
    the kernel must use each element's own."""
    rng = np.random.default_rng(seed)
    seq, d = shape[-3], shape[-1]
    width = d if full_width else d // 2
    x = jnp.asarray(rng.standard_normal(shape) * 2, dtype)
    if full_width:
        cos, sin = (rng.standard_normal((seq, width)) for _ in range(2))
    else:
        angles = rng.uniform(-np.pi, np.pi, (seq, width))
        cos, sin = np.cos(angles), np.sin(angles)
    dy = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return x, jnp.asarray(cos, table_dtype), jnp.asarray(sin, table_dtype), dy


def close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * max(np.abs(want).max(initial=0), 1.0))


def vjp_all(f, x, cos, sin, dy):
    y, pullback = jax.vjp(f, x, cos, sin)
    return y, pullback(dy.astype(y.dtype))


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("full_width", [False, True], ids=["half_cos", "full_cos"])
@pytest.mark.parametrize("shape, dtype", [  # head dims 2, 64, 128 and 6 (a padded block); odd seq, heads
    ((1, 1, 2), jnp.float32), ((2, 7, 3, 64), jnp.float32), ((2, 7, 3, 64), jnp.bfloat16),
    ((2, 7, 3, 64), jnp.float16), ((5, 1, 128), jnp.bfloat16), ((2, 1, 3, 5, 6), jnp.float16)],
    ids=lambda v: dtype_id(v) if not isinstance(v, tuple) else str(v))
def test_values_and_every_gradient(interleaved, full_width, shape, dtype):
    x, cos, sin, dy = make(shape, dtype, full_width)
    op = lambda x, c, s: R.rope(x, c, s, interleaved=interleaved)
    ref = lambda x, c, s: R.reference(x, c, s, interleaved)
    y, grads = vjp_all(op, x, cos, sin, dy)
    assert y.dtype == dtype and grads[0].dtype == dtype and grads[1].dtype == jnp.float32
    close(y, ref(x, cos, sin), dtype)
    _, want = vjp_all(ref, x.astype(jnp.float32), cos, sin, dy.astype(dtype))
    for g, w in zip(grads, want):
        close(g, w, dtype)


def test_tables_in_x_dtype_and_a_float32_result():
    x, cos, sin, dy = make((2, 5, 3, 16), jnp.bfloat16, False, seed=1, table_dtype=jnp.bfloat16)
    close(R.rope(x, cos, sin), R.reference(x, cos, sin), jnp.bfloat16)
    op = lambda x, c, s: R.rope(x, c, s, interleaved=True, out_dtype=jnp.float32)
    y, grads = vjp_all(op, x, cos, sin, dy)
    assert y.dtype == jnp.float32 and grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.bfloat16
    ref = lambda x, c, s: R.reference(x, c, s, True, jnp.float32)
    close(y, ref(x, cos, sin), jnp.float32)  # float32 math and result: exact to float32
    _, want = vjp_all(ref, x, cos, sin, dy)
    for g, w in zip(grads, want):
        close(g, w, jnp.bfloat16)


def test_the_x_gradient_needs_neither_x_nor_the_forward():
    """Only cos and sin are saved: a program that wants dx alone runs the backward kernel alone;
    differentiated with respect to the tables alone, it runs no backward kernel."""
    x, cos, sin, dy = make((2, 5, 3, 8), jnp.float32, True, seed=2)
    loss = lambda x, c, s: jnp.sum(R.rope(x, c, s) * dy)
    dx_program = dce(jax.make_jaxpr(jax.grad(loss))(x, cos, sin))
    assert kernel_names(dx_program) == ["rope_bwd"]
    x_var = dx_program.jaxpr.invars[0]
    assert not [e for e in dx_program.jaxpr.eqns if x_var in e.invars]
    assert "rope_bwd" not in kernel_names(jax.make_jaxpr(jax.grad(loss, argnums=(1, 2)))(x, cos, sin))
    ref_loss = lambda x, c, s: jnp.sum(R.reference(x, c, s) * dy)
    for argnums in (1, 2, (1, 2)):  # each table alone keeps x too
        got, want = jax.grad(loss, argnums)(x, cos, sin), jax.grad(ref_loss, argnums)(x, cos, sin)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            close(g, w, jnp.float32)


def test_edge_values_propagate_as_in_xla():
    x = jnp.array([[[1.0, jnp.inf, 2.0, -1.0]], [[jnp.nan, 0.0, 1.0, 2.0]], [[-jnp.inf, 3.0, jnp.inf, 1.0]]])
    cos = jnp.array([[0.0, 1.0], [0.5, jnp.inf], [1.0, 0.0]])
    sin = jnp.array([[1.0, 0.0], [0.5, 0.0], [jnp.nan, 1.0]])
    for interleaved in (False, True):
        got = R.rope(x, cos, sin, interleaved=interleaved)
        want = R.reference(x, cos, sin, interleaved)
        assert np.isnan(want).any() and np.isinf(want).any()
        np.testing.assert_array_equal(got, want)  # NaN where XLA has NaN, inf where it has inf
        dx = jax.vjp(lambda x: R.rope(x, cos, sin, interleaved=interleaved), x)[1](x)[0]
        np.testing.assert_array_equal(
            dx, jax.vjp(lambda x: R.reference(x, cos, sin, interleaved), x)[1](x)[0])


def test_empty_arrays_and_the_xla_backend():
    for shape in [(0, 4, 2, 8), (3, 0, 2, 8), (4, 0, 8)]:
        x, cos, sin, _ = make(shape, jnp.float32, False)
        assert R.rope(x, cos, sin).shape == shape
        assert jax.grad(lambda x: R.rope(x, cos, sin).sum())(x).shape == shape
    # a program's rotation of an empty sequence with tables per example: left to XLA (it raised)
    x, cos, sin = jnp.ones((2, 0, 2, 8)), jnp.ones((2, 0, 1, 8)), jnp.zeros((2, 0, 1, 8))
    loss = lambda x, c, s: jnp.sum(x * c + jnp.concatenate([-x[..., 4:], x[..., :4]], -1) * s)
    for got, want in zip(xkern.jit(jax.grad(loss, (0, 1, 2)))(x, cos, sin), jax.grad(loss, (0, 1, 2))(x, cos, sin)):
        assert got.shape == want.shape
    assert "empty" in xkern.explain(jax.grad(loss))(x, cos, sin).declined[0].reason
    x, cos, sin, _ = make((2, 5, 3, 8), jnp.bfloat16, True)
    np.testing.assert_array_equal(R.rope(x, cos, sin, backend="xla"), R.reference(x, cos, sin))
    assert kernel_names(jax.make_jaxpr(lambda x: R.rope(x, cos, sin, backend="xla"))(x)) == []


def test_jit_vmap_over_x_and_over_the_tables():
    x, cos, sin, dy = make((3, 2, 5, 3, 8), jnp.float32, False, seed=3)
    tables = jnp.stack([cos, cos * 0.5, -cos]), jnp.stack([sin, sin + 1, sin * 2])
    op = lambda x, c, s: R.rope(x, c, s, interleaved=True)
    ref = lambda x, c, s: R.reference(x, c, s, True)
    grad = lambda f: jax.grad(lambda x, c, s: jnp.sum(f(x, c, s) * dy[0]), argnums=(0, 1, 2))
    for in_axes, tabs in (((0, None, None), (cos, sin)), ((0, 0, 0), tables), ((None, 0, 0), tables)):
        xs = x[0] if in_axes[0] is None else x
        close(jax.jit(jax.vmap(op, in_axes))(xs, *tabs), jax.vmap(ref, in_axes)(xs, *tabs), jnp.float32)
        for g, w in zip(jax.jit(jax.vmap(grad(op), in_axes))(xs, *tabs), jax.vmap(grad(ref), in_axes)(xs, *tabs)):
            close(g, w, jnp.float32)
    # vmap over vmap: tables per inner example, then shared by the outer axis (folded twice)
    xx = jnp.stack([x, x * 2])
    nested = lambda f: jax.vmap(jax.vmap(f), (0, None, None))
    close(nested(op)(xx, *tables), nested(ref)(xx, *tables), jnp.float32)
    assert sorted(kernel_names(jax.make_jaxpr(jax.vmap(grad(op), (0, None, None)))(x, cos, sin))) == \
        ["rope_bwd", "rope_fwd"]


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_programs_loop_over_head_blocks_and_share_tables(interleaved, monkeypatch):
    """Blocks of 2 rows by 2 heads over 5 heads and 2 x 7 rows: a loop over head blocks (the last
    partial), row blocks straddling two batch entries (and, vmapped over tables, two tables)."""
    monkeypatch.setattr(R, "default_config", lambda rows, heads, d, backend: L.Config.of(
        BLOCK_S=2, BLOCK_H=2, BLOCK_P=L.next_pow2(d // 2)))
    x, cos, sin, dy = make((2, 7, 5, 12), jnp.float32, True, seed=4)
    op = lambda x, c, s: R.rope(x, c, s, interleaved=interleaved)
    ref = lambda x, c, s: R.reference(x, c, s, interleaved)
    y, grads = vjp_all(op, x, cos, sin, dy)
    want_y, want = vjp_all(ref, x, cos, sin, dy)
    for g, w in zip((y, *grads), (want_y, *want)):
        close(g, w, jnp.float32)
    tables = jnp.stack([cos, -sin]), jnp.stack([sin, cos])
    close(jax.vmap(op)(x, *tables), jax.vmap(ref)(x, *tables), jnp.float32)


def test_bad_input_names_the_argument():
    x, cos, sin, _ = make((2, 4, 3, 8), jnp.float32, False)
    cases = [((x.tolist(), cos, sin), {}, TypeError, "x must be a jax or numpy array"),
             ((x, 0.5, sin), {}, TypeError, "cos must be a jax or numpy array"),
             ((x, cos, None), {}, TypeError, "sin must be a jax or numpy array"),
             ((x.astype(jnp.int32), cos, sin), {}, TypeError, "x must have dtype"),
             ((x[0, 0], cos, sin), {}, ValueError, r"x must have shape \[..., seq, heads, head_dim\]"),
             ((x[..., :7], cos, sin), {}, ValueError, "x must have an even head_dim"),
             ((x, cos[:3], sin[:3]), {}, ValueError, r"cos must have shape \(4, 4\) or \(4, 8\)"),
             ((x, cos, sin[:, :2]), {}, ValueError, r"sin must have cos's shape \(4, 4\)"),
             ((x.astype(jnp.bfloat16), cos.astype(jnp.float16), sin), {}, TypeError,
              r"cos must have dtype float32 or x's \(bfloat16\)"),
             ((x, cos, sin.astype(jnp.bfloat16)), {}, TypeError, "sin must have dtype float32 or x's"),
             ((x, cos, sin), {"interleaved": 1}, TypeError, "interleaved must be a bool"),
             ((x, cos, sin), {"out_dtype": jnp.int32}, TypeError, "out_dtype must be"),
             ((x, cos, sin), {"out_dtype": "float7"}, TypeError, "out_dtype must be"),
             ((x, cos, sin), {"backend": "cuda"}, ValueError, "backend must be one of")]
    for args, kw, error, message in cases:
        with pytest.raises(error, match=message):
            R.rope(*args, **kw)


# --------------------------------------------------------------------------------------------------
# Patterns: the ways people write rope, found by xkern.jit / xkern.optimize
# --------------------------------------------------------------------------------------------------

def _pattern_args(pattern, example, shape=(2, 5, 3, 8), seed=0):
    """x and tables for `pattern`'s example (x dtype, table dtype, table of lower rank than x; for
    the complex form, whether the table is of lower rank: its one table, cos + i sin)."""
    if "complex" in pattern.name:
        x, cos, sin, _ = make(shape, pattern.example(example)[0].dtype, False, seed)
        table = jax.lax.complex(cos, sin)
        return x, table[:, None, :] if example else table[None, :, None, :]
    x_dtype, table_dtype, fewer = example
    form = max((f for f in rope_rules.FORMS if pattern.name[len("rope/"):].startswith(f)), key=len)
    x, cos, sin, _ = make(shape, x_dtype, rope_rules.FORMS[form][2], seed, table_dtype)
    table = lambda t: t[:, None, :] if fewer else t[None, :, None, :]  # [seq, 1, w] or [1, seq, 1, w]
    return x, table(cos), table(sin)


@pytest.mark.parametrize("name", [p.name for p in rope_rules.PATTERNS])
def test_each_spelling_is_found_and_equals_jax_jit(name):
    pattern = next(p for p in rope_rules.PATTERNS if p.name == name)
    example = pattern.dtypes[len(name) % len(pattern.dtypes)]  # a different example per spelling
    args = _pattern_args(pattern, example, seed=len(name))
    report = xkern.explain(pattern.fn)(*args)
    if pattern.xla_when:  # the half rotation's forward alone runs as written (XLA fuses it as fast)
        assert report.matches == [] and [d.pattern for d in report.declined] == [name]
        assert "forward alone" in report.declined[0].reason
    else:
        assert [m.pattern for m in report.matches] == [name]
        assert report.matches[0].kernels == ["rope_fwd"]
    got, want = xkern.jit(pattern.fn)(*args), jax.jit(pattern.fn)(*args)
    assert got.dtype == want.dtype
    close(got, want, args[0].dtype.type)


@pytest.mark.parametrize("name", ["rope/x*cos+rotate_half(x)*sin+cast back", "rope/concatenate(halves)",
                                  "rope/interleaved/stack(pairs)+upcast", "rope/interleaved/complex multiply+upcast"])
def test_spellings_differentiate_through_the_kernels(name):
    pattern = next(p for p in rope_rules.PATTERNS if p.name == name)
    x, *tables = _pattern_args(pattern, pattern.dtypes[-1], seed=7)
    dy = make(x.shape, jnp.float32, False, seed=8)[-1]
    loss = lambda x: jnp.sum(pattern.fn(x, *tables).astype(jnp.float32) * dy)
    assert "rope_bwd" in kernel_names(jax.make_jaxpr(jax.grad(xkern.optimize(loss)))(x))
    close(jax.jit(jax.grad(xkern.optimize(loss)))(x), jax.jit(jax.grad(loss))(x), x.dtype.type)


def test_halves_as_slices_are_jnp_splits_halves():
    """x[..., :h] and x[..., h:], rotated and concatenated (a rope written by hand with slices): the
    split form's kernels, as jnp.split's halves, values and dx equal to jax.jit's."""
    x, cos, sin, dy = make((2, 5, 3, 8), jnp.bfloat16, False, seed=13)
    cos, sin = cos[:, None], sin[:, None]  # [seq, 1, d / 2]

    def by_slices(x):
        x1, x2 = x[..., :4], x[..., 4:]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    y_and_dx = lambda x: (lambda y, pullback: (y, pullback(dy)[0]))(*jax.vjp(by_slices, x))
    report = xkern.explain(y_and_dx)(x)
    assert [m.pattern for m in report.matches if m.op == "rope"] == ["rope/concatenate(halves)"], report
    assert {"rope_fwd", "rope_bwd"} <= set(report.kernels)
    for got, want in zip(xkern.jit(y_and_dx)(x), jax.jit(y_and_dx)(x)):
        close(got, want, jnp.bfloat16)


def maxtext_rotary_embedding(x, position, fprop_dtype):
    """MaxText's RotaryEmbedding (layers/embeddings.py) as it computes: sin and cos of the half angles
    in x's dtype, each repeated to the full width; x's halves by jnp.split (a split equation, not
    slices); the result cast to the fprop dtype."""
    d = x.shape[-1]
    angles = position[:, :, None, None] / 10_000 ** (2 * jnp.arange(d // 2) / d)
    sin, cos = (jnp.concatenate([t, t], -1) for t in (jnp.sin(angles).astype(x.dtype), jnp.cos(angles).astype(x.dtype)))
    x1, x2 = jnp.split(x, 2, axis=-1)
    return (x * cos + jnp.concatenate((-x2, x1), axis=-1) * sin).astype(fprop_dtype)


def maxtext_llama_rotary_embedding(x, position, fprop_dtype, sign=(-1, 1)):
    """MaxText's LLaMARotaryEmbedding (use_scale off) as it computes: float32 tables of each angle
    twice; x shifted left for the even elements and right for the odd ones (lax.select on an iota
    parity mask tiled to x's shape); times sin, times a tiled sign."""
    d = x.shape[-1]
    angles = position[:, :, None, None] / 10_000 ** jnp.repeat(2 * jnp.arange(d // 2) / d, 2)
    left = jnp.concatenate([x[..., 1:], x[..., :1]], axis=-1)
    right = jnp.concatenate([x[..., -1:], x[..., :-1]], axis=-1)
    shifted = jax.lax.select(jnp.tile(jnp.mod(jnp.arange(d, dtype=jnp.int32), 2), x.shape[:-1] + (1,)), right, left)
    signs = jnp.tile(jnp.array(sign), d // 2)
    return (x * jnp.cos(angles) + shifted * jnp.sin(angles) * signs).astype(fprop_dtype)


@pytest.mark.parametrize("llama", [False, True], ids=["RotaryEmbedding", "LLaMARotaryEmbedding"])
@pytest.mark.parametrize("dtype, fprop_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16),
                                                (jnp.float32, jnp.bfloat16)], ids=["float32", "bfloat16", "to_bf16"])
def test_maxtexts_rotary_embeddings_train_through_the_kernels(llama, dtype, fprop_dtype):
    """MaxText's two spellings, differentiated (the half rotation's forward alone runs as written),
    packed positions (tables per example): the rope kernels, values and dx equal to jax.jit's. The
    LLaMA one's sign the other way round is not a rotation xkern takes (constants matched by value)."""
    x, _, _, dy = make((2, 5, 3, 8), dtype, False, seed=12)
    positions = jnp.array([[0, 1, 2, 3, 4], [3, 4, 0, 1, 2]])
    rope = maxtext_llama_rotary_embedding if llama else maxtext_rotary_embedding

    def y_and_dx(x, rope=rope):
        y, pullback = jax.vjp(lambda x: rope(x, positions, fprop_dtype), x)
        return y, pullback(dy.astype(y.dtype))[0]
    report = xkern.explain(y_and_dx)(x)
    name = ("rope/interleaved/x*cos+select(shifted)*sin*sign" + ("+cast back" if dtype == jnp.bfloat16 else "")
            if llama else "rope/x*cos+rotate_half(x)*sin")
    assert [m.pattern for m in report.matches if m.op == "rope"] == [name]
    assert {"rope_fwd", "rope_bwd"} <= set(report.kernels)
    for got, want in zip(xkern.jit(y_and_dx)(x), jax.jit(y_and_dx)(x)):
        assert got.dtype == want.dtype
        close(got, want, got.dtype.type)
    if llama:
        other_way = lambda x: y_and_dx(x, lambda *a: maxtext_llama_rotary_embedding(*a, sign=(1, -1)))
        assert not [m for m in xkern.explain(other_way)(x).matches if m.op == "rope"]
        for got, want in zip(xkern.jit(other_way)(x), jax.jit(other_way)(x)):
            close(got, want, got.dtype.type)


def test_table_layouts_read_off_the_program():
    """Per-example tables (HF's position ids), heads before seq, no batch axis, one shared row."""
    rng = np.random.default_rng(9)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    hf = rope_rules.rotate_half_form
    cases = {
        "per-example tables [b, s, 1, d]": (rope_rules.halves_form, arr(2, 5, 3, 8), arr(2, 5, 1, 4), arr(2, 5, 1, 4)),
        "heads before seq [b, h, s, d]": (hf, arr(2, 3, 5, 8), arr(5, 8), arr(5, 8)),
        "no batch axis [s, h, d]": (hf, arr(5, 3, 8), arr(5, 1, 8), arr(5, 1, 8)),
        "one row for every position": (rope_rules.pairs_form, arr(2, 5, 3, 8), arr(4), arr(4)),
        "cos and sin broadcast differently": (hf, arr(2, 5, 3, 8), arr(5, 1, 8), arr(1, 5, 1, 8)),
    }
    for name, (f, *args) in cases.items():  # (differentiated: the half rotation's forward alone runs as written)
        grad = lambda f: (lambda x, *tables: jax.grad(lambda x: jnp.sum(f(x, *tables) ** 2))(x))
        report = xkern.explain(grad(xkern.optimize(f)))(*args)
        assert [m.op for m in report.matches if m.op != "fused"] == ["rope"] and "rope_bwd" in report.kernels, name
        close(jax.jit(grad(xkern.optimize(f)))(*args), jax.jit(grad(f))(*args), jnp.float32)
        close(xkern.jit(f)(*args), jax.jit(f)(*args), jnp.float32)


def test_complex_rotation_as_metas_llama_writes_it():
    """Meta's Llama reference (and EasyLM): freqs_cis = cos + i sin, taken per example by position
    ids ([b, s, 1, d/2]), q and k upcast, their pairs as complex numbers times it, cast back. Found
    for both, equal to jax.jit's; the parts stacked the other way round (not a rotation) are not."""
    x, cos, sin, dy = make((2, 6, 3, 8), jnp.bfloat16, False, seed=11)
    freqs_cis = jax.lax.complex(cos, sin)  # [s, d/2]
    positions = jnp.array([[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 0, 1]])
    complex_rope = rope_rules.precision(rope_rules.complex_form, "upcast")

    def apply_rotary_emb(xq, xk, positions, rope=complex_rope):
        table = jnp.take(freqs_cis, positions, axis=0)[:, :, None, :]
        return rope(xq, table), rope(xk, table)
    k = x[:, ::-1]
    report = xkern.explain(apply_rotary_emb)(x, k, positions)
    assert [m.pattern for m in report.matches if m.op == "rope"] == ["rope/interleaved/complex multiply+upcast"] * 2
    for got, want in zip(xkern.jit(apply_rotary_emb)(x, k, positions), jax.jit(apply_rotary_emb)(x, k, positions)):
        assert got.dtype == want.dtype == jnp.bfloat16
        close(got, want, jnp.bfloat16)
    loss = lambda x: jnp.sum(apply_rotary_emb(x, k, positions)[0].astype(jnp.float32) * dy)
    close(jax.jit(jax.grad(xkern.optimize(loss)))(x), jax.jit(jax.grad(loss))(x), jnp.bfloat16)
    def swapped(x, table):
        pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
        rotated = jax.lax.complex(pairs[..., 0], pairs[..., 1]) * table
        return jnp.stack((jnp.imag(rotated), jnp.real(rotated)), axis=-1).reshape(x.shape).astype(x.dtype)
    near_miss = lambda x, k, positions: apply_rotary_emb(x, k, positions, swapped)
    assert not [m for m in xkern.explain(near_miss)(x, k, positions).matches if m.op == "rope"]
    close(xkern.jit(near_miss)(x, k, positions)[0], jax.jit(near_miss)(x, k, positions)[0], jnp.bfloat16)


def test_near_misses_are_not_rewritten():
    x, cos, sin, _ = make((2, 5, 3, 8), jnp.float32, True, seed=10)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rh = rope_rules.rotate_half
    half_tables = cos[..., :4], sin[..., :4]
    near_misses = {
        # rotated the other way: the sign of the sin term flipped
        "wrong sign": (lambda x, c, s: x * c - rh(x) * s, cos, sin),
        # the halves swapped and negated the other way round
        "other rotation": (lambda x, c, s: x * c + jnp.concatenate([x[..., 4:], -x[..., :4]], -1) * s, cos, sin),
        # the rotated array is not the one scaled by cos
        "other array": (lambda x, c, s: x * c + rh(x * 2) * s, cos, sin),
        # halves split along the heads axis, not the head dim
        "other axis": (lambda x, c, s: x * c + jnp.concatenate([-x[:, :, 2:], x[:, :, :2]], 2) * s, cos, sin),
        # the second half's sin term subtracted
        "split, wrong sign": (lambda x, c, s: jnp.concatenate(
            [x[..., :4] * c - x[..., 4:] * s, x[..., 4:] * c - x[..., :4] * s], -1), *half_tables),
        # pairs stacked in the wrong order
        "pairs swapped": (lambda x, c, s: jnp.stack(
            [x[..., 1::2] * c + x[..., ::2] * s, x[..., ::2] * c - x[..., 1::2] * s], -1).reshape(x.shape),
            *half_tables),
        # tables constant along the head dim (one value per position): declined by the check
        "table without a head dim": (rope_rules.halves_form, cos[..., :1], sin[..., :1]),
    }
    for name, (f, c, s) in near_misses.items():
        report = xkern.explain(f)(x, c, s)
        assert not [m for m in report.matches if m.op == "rope"], name
        close(xkern.jit(f)(x, c, s), jax.jit(f)(x, c, s), jnp.float32)
