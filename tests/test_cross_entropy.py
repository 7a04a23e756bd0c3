"""xkern.ops.cross_entropy against a float32 jax.numpy reference: losses and logits gradients for
every reduction and option, edge values, vmap, and errors; through the interpreter."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xkern
from benchmarks.bench_cross_entropy import cross_entropy_with_logits, maxtext_train_loss
from xkern.fusion.lowering import xla_selects_bool_product
from xkern.jaxpr_passes.canonicalize import canonicalize
from xkern.kernels import cross_entropy as ce
from xkern.kernels import launch as L
from xkern.kernels.launch import kernel_names

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 3e-3}
OPTIONS = {"plain": {}, "ignore": {"ignore_index": -100},
           "all": {"ignore_index": 0, "label_smoothing": 0.1, "z_loss": 1e-3}}


def make(shape, dtype, seed=0, ignore=None):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.standard_normal(shape) * 3, dtype)
    labels = rng.integers(0, shape[-1], shape[:-1])
    if ignore is not None and labels.size:
        labels.reshape(-1)[:: 3] = ignore  # every third row ignored
    return logits, jnp.asarray(labels, jnp.int32)


def dx_scales(closed_jaxpr, size):
    """The multiplications of arrays of `size` elements by anything but the literal 1 (jax.grad's
    cotangent, which XLA folds away): a scale applied to a forward's dx after it, one more pass."""
    from jax.extend.core import Literal
    return [eqn for eqn in closed_jaxpr.jaxpr.eqns if eqn.primitive.name == "mul"
            and any(v.aval.size == size for v in eqn.outvars)
            and not any(isinstance(v, Literal) and float(v.val) == 1.0 for v in eqn.invars)]


def close(got, want, dtype, scale=None):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * (scale or max(np.abs(want).max(), 1.0)))


@pytest.mark.parametrize("reduction", ce.REDUCTIONS)
@pytest.mark.parametrize("options", list(OPTIONS), ids=str)
@pytest.mark.parametrize("shape", [(3, 1), (7,), (4, 1000), (2, 3, 1025)], ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_loss_and_gradient(reduction, options, shape, dtype):
    kw = OPTIONS[options]
    logits, labels = make(shape, dtype, ignore=kw.get("ignore_index"))
    weights = jnp.asarray(np.random.default_rng(1).uniform(0.5, 2, labels.shape), jnp.float32)

    def loss(f, x):
        out = f(x, labels, reduction=reduction, **kw)
        return jnp.sum(out * weights) if reduction == "none" else out * 1.5

    got = xkern.ops.cross_entropy(logits, labels, reduction=reduction, **kw)
    want = ce.reference(logits.astype(jnp.float32), labels, reduction=reduction, **kw)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    close(got, want, jnp.float32 if dtype == jnp.float32 else jnp.float16)  # float32 math inside
    g = jax.grad(lambda x: loss(xkern.ops.cross_entropy, x))(logits)
    w = jax.grad(lambda x: loss(ce.reference, x))(logits.astype(jnp.float32))
    assert g.dtype == logits.dtype
    close(g, w, dtype)


@pytest.mark.parametrize("reduction", ce.REDUCTIONS)
@pytest.mark.parametrize("options", list(OPTIONS), ids=str)
def test_row_weights(reduction, options):
    """weights (a padding mask, or any float per row): "none" weights * loss, "sum" their sum,
    "mean" that over the weights' sum (ignored rows weigh 0); values and the gradients of logits
    and of the weights against the float32 reference, and the forward alone writes dx."""
    kw = OPTIONS[options]
    logits, labels = make((2, 3, 45), jnp.bfloat16, seed=11, ignore=kw.get("ignore_index"))
    weights = jnp.asarray(np.random.default_rng(2).uniform(0, 2, labels.shape), jnp.float32).at[0, 1].set(0.0)

    def want(x, w):
        rows = ce.reference(x.astype(jnp.float32), labels, reduction="none", **kw)
        if reduction == "none":
            return rows * w
        valid = labels != kw["ignore_index"] if "ignore_index" in kw else jnp.ones(labels.shape, bool)
        total = jnp.sum(rows * w)
        return total / jnp.sum(w * valid) if reduction == "mean" else total

    got = lambda x, w: xkern.ops.cross_entropy(x, labels, reduction=reduction, weights=w, **kw)
    close(got(logits, weights), want(logits, weights), jnp.float16)
    f = lambda impl: jax.grad(lambda x, w: jnp.sum(impl(x, w)) * 1.5, (0, 1))
    for g, r in zip(f(got)(logits, weights), f(want)(logits, weights)):
        close(g, r, jnp.bfloat16)
    grad_kernels = kernel_names(jax.make_jaxpr(f(got))(logits, weights))
    assert ("cross_entropy_bwd" in grad_kernels) == (reduction == "none")
    zero = xkern.ops.cross_entropy(logits, labels, reduction="mean", weights=jnp.zeros(labels.shape), **kw)
    assert zero == 0.0  # weights summing to 0: a mean of 0, not NaN
    with pytest.raises(ValueError, match="weights must be None or a float array of labels' shape"):
        xkern.ops.cross_entropy(logits, labels, weights=jnp.ones(labels.shape, jnp.int32))


def test_long_rows_stream_in_chunks(monkeypatch):
    """Rows longer than a chunk: the online logsumexp and the dx pass loop over 5 chunks; two
    programs share the three rows (each loops over every other row)."""
    monkeypatch.setattr(ce, "default_config", lambda n, backend: L.Config.of(BLOCK_N=64))
    monkeypatch.setattr(ce, "programs", lambda n_rows, backend: min(n_rows, 2))
    logits, labels = make((3, 300), jnp.float32, seed=2)
    logits = logits.at[0, 299].set(40.0).at[1, 0].set(-1e30)  # the max in the last, partial chunk
    for reduction in ("mean", "none"):
        kw = {"reduction": reduction, "label_smoothing": 0.2}
        close(xkern.ops.cross_entropy(logits, labels, **kw), ce.reference(logits, labels, **kw), jnp.float32)
        f = lambda impl: (lambda x: jnp.sum(impl(x, labels, **kw) ** 2))
        close(jax.grad(f(xkern.ops.cross_entropy))(logits), jax.grad(f(ce.reference))(logits), jnp.float32)


def test_edge_values_as_xla():
    x = jnp.array([[0.0, -jnp.inf, 1.0, 2.0],     # a -inf logit: fine
                   [-jnp.inf] * 4,                 # every logit -inf: lse -inf, loss nan
                   [1.0, jnp.inf, 0.0, 0.0],       # +inf: lse +inf
                   [1.0, jnp.nan, 0.0, 0.0],       # NaN anywhere: NaN
                   [1e30, -1e30, 3.0, 0.0]], jnp.float32)
    labels = jnp.array([2, 0, 0, 2, 0], jnp.int32)
    got = xkern.ops.cross_entropy(x, labels, reduction="none")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ce.reference(x, labels, reduction="none")))
    np.testing.assert_allclose(got, ce.reference(x, labels, reduction="none"), rtol=1e-6)


def test_edge_values_with_gradients_as_xla():
    """The same rows through the forward that also writes dx: loss and gradient."""
    x = jnp.array([[0.0, -jnp.inf, 1.0, 2.0], [-jnp.inf] * 4, [1.0, jnp.inf, 0.0, 0.0],
                   [1.0, jnp.nan, 0.0, 0.0], [1e30, -1e30, 3.0, 0.0], [-1e4, -1e4 - 1, -1e4 + 2, -1e4]],
                  jnp.float32)
    labels = jnp.array([2, 0, 0, 2, 0, 3], jnp.int32)
    for kw in ({}, {"label_smoothing": 0.3, "z_loss": 1e-3}):
        f = lambda impl, rows: jax.value_and_grad(lambda a: impl(a, labels[rows], reduction="sum", **kw))
        for rows in (slice(None), jnp.array([0, 4, 5])):  # all rows (NaN sum), the finite ones
            (got, dgot), (want, dwant) = f(xkern.ops.cross_entropy, rows)(x[rows]), f(ce.reference, rows)(x[rows])
            np.testing.assert_allclose(got, want, rtol=1e-6)
            np.testing.assert_array_equal(np.isnan(dgot), np.isnan(dwant))
            # (lse near -1e4 holds ~1e-3 of rounding in float32: exp(x - lse) carries it)
            np.testing.assert_allclose(dgot, dwant, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("reduction", ce.REDUCTIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_soft_capped_logits_as_the_capped_program(reduction, dtype, monkeypatch):
    """soft_cap: the loss of cap * tanh(logits / cap) (Gemma 2's final logits) in the kernels, values
    and gradients against the float32 reference of the capped logits: rows over chunks with a partial
    last one, every option, logits far past the cap, +-inf (capped to +-cap: finite losses, zero
    gradients there) and NaN; one-hot targets, weights and where-masked sums too."""
    monkeypatch.setattr(ce, "default_config", lambda n, backend: L.Config.of(BLOCK_N=64))
    logits, labels = make((2, 3, 150), dtype, seed=21)
    logits = (logits * 10).at[0, 0, 5].set(jnp.inf).at[0, 1, 7].set(-jnp.inf).at[1, 2, 149].set(400.0)
    logits = logits.at[1, 0, 9].set(jnp.nan)  # that row's loss and gradient NaN, as XLA's
    labels = labels.at[0, 0].set(5).at[0, 1].set(7)  # the labels at +inf and at -inf
    weights = jnp.asarray(np.random.default_rng(3).uniform(0.5, 2, labels.shape), jnp.float32)
    cap, upcast = 7.5, lambda x: x.astype(jnp.float32)
    for kw in ({}, {"ignore_index": 0, "label_smoothing": 0.1, "z_loss": 1e-3}):
        def loss(impl, x):
            out = impl(x, labels, reduction=reduction, soft_cap=cap, **kw)
            return jnp.sum(out * weights) if reduction == "none" else out * 1.5
        (got, g), (want, w) = (jax.value_and_grad(lambda x: loss(impl, x))(x) for impl, x in
                               ((xkern.ops.cross_entropy, logits), (ce.reference, upcast(logits))))
        assert np.isnan(got) == np.isnan(want) and g.dtype == dtype
        np.testing.assert_array_equal(np.isnan(np.asarray(g, np.float32)), np.isnan(w))
        finite = lambda a: np.where(np.isnan(np.asarray(w)), 0.0, np.asarray(a, np.float64))
        close(finite(g), finite(w), dtype, scale=1.0)
        rows = xkern.ops.cross_entropy(logits, labels, reduction="none", soft_cap=cap, **kw)
        want_rows = ce.reference(upcast(logits), labels, reduction="none", soft_cap=cap, **kw)
        np.testing.assert_allclose(rows, want_rows, rtol=2e-5, atol=2e-5)
        assert np.isfinite(rows[0, :2]).all()  # +-inf capped
    mapped = jax.vmap(lambda x, y: xkern.ops.cross_entropy(x, y, reduction="none", soft_cap=cap))(logits, labels)
    np.testing.assert_allclose(mapped, ce.reference(upcast(logits), labels, reduction="none", soft_cap=cap),
                               rtol=2e-5, atol=2e-5)
    one_hot = lambda impl: jax.value_and_grad(lambda x: jnp.sum(impl(x, labels, soft_cap=cap, label_smoothing=0.2)))
    (got, g), (want, w) = one_hot(ce.one_hot_cross_entropy)(logits), one_hot(functools.partial(
        ce.one_hot_cross_entropy, backend="xla"))(upcast(logits))
    assert np.isnan(got) and np.isnan(want)  # (the NaN logit)
    np.testing.assert_array_equal(np.isnan(np.asarray(g, np.float32)), np.isnan(w))
    close(np.nan_to_num(g[0]), np.nan_to_num(w[0]), dtype, scale=1.0)
    kept = labels[0] != labels[0, 1]  # the -inf row masked out; the first row on weights 0.25
    masked = lambda impl, x: jax.value_and_grad(lambda x: impl(x, labels[0], kept, scale=0.25, soft_cap=cap))(x)
    (got, g), (want, w) = (masked(functools.partial(ce.where_masked_sum, backend=b), x) for b, x in
                           ((None, logits[0]), ("xla", upcast(logits[0]))))
    np.testing.assert_allclose(got, want, rtol=2e-5)
    close(g, w, dtype, scale=1.0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradient_at_large_logits(reduction):
    """lse of a row whose max is 1e8 rounds to the max: the softmax must not be taken from it."""
    x = jnp.array([[1e8, 1e8, 0.0], [1e4, 1e4 + 1, 3.0], [-1e8, -1e8 + 1e2, -1e8]], jnp.float32)
    y = jnp.array([2, 0, 1], jnp.int32)
    f = lambda impl: jax.grad(lambda a: jnp.sum(impl(a, y, reduction=reduction) * jnp.array([1.0, 2.0, 3.0])))(x)
    np.testing.assert_allclose(f(xkern.ops.cross_entropy), f(ce.reference), rtol=1e-5, atol=1e-6)


def test_labels_out_of_range_give_nan_and_ignored_rows_give_zero():
    """A label out of range: loss NaN, gradient the softmax's (the gather's gradient drops the label),
    so a row masked after the loss (HF's -100 labels) trains as under jax.jit: gradient 0."""
    logits, _ = make((4, 10), jnp.float32)
    labels = jnp.array([3, 10, -1, -100], jnp.int32)
    loss = xkern.ops.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    assert np.isfinite(loss[0]) and np.isnan(loss[1]) and np.isnan(loss[2]) and loss[3] == 0.0
    dx = jax.grad(lambda x: xkern.ops.cross_entropy(x, labels, ignore_index=-100, reduction="sum"))(logits)
    want = jax.grad(lambda x: ce.reference(x, labels, ignore_index=-100, reduction="sum"))(logits)
    np.testing.assert_allclose(dx, want, atol=1e-6)
    assert np.isfinite(dx).all() and (dx[3] == 0).all()
    masked_after = lambda impl: jax.grad(lambda x: jnp.sum(jnp.where(
        labels == 3, impl(x, labels, reduction="none"), 0.0)))(logits)
    np.testing.assert_allclose(masked_after(xkern.ops.cross_entropy), masked_after(ce.reference), atol=1e-6)
    assert (masked_after(xkern.ops.cross_entropy)[1:] == 0).all()
    everything_ignored = jnp.full((4,), -100, jnp.int32)
    assert xkern.ops.cross_entropy(logits, everything_ignored, ignore_index=-100) == 0.0
    grads = jax.grad(lambda x: xkern.ops.cross_entropy(x, everything_ignored, ignore_index=-100))(logits)
    assert (grads == 0).all()


def _one_hot_program(x, y):
    return -jnp.sum(jax.nn.one_hot(y, x.shape[-1]) * jax.nn.log_softmax(x.astype(jnp.float32), -1), -1)


def test_one_hot_cross_entropy_is_the_one_hot_program_edge_rows_included():
    """The one-hot program's semantics, which its patterns rely on: a label out of range is a row of
    zeros (loss 0, gradient 0, or NaN where the softmax is), a non-finite logit outside the label's
    class makes the loss NaN (0 * inf) but not the gradient; 0 x 1 empty and odd widths too."""
    inf, nan = jnp.inf, jnp.nan
    x = jnp.array([[0.5, 1.0, -2.0, 3.0], [0.0, -inf, 1.0, 2.0], [0.0, 1.0, -inf, 2.0], [-inf] * 4,
                   [1.0, inf, 0.0, 0.0], [1.0, nan, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0], [1.0, -inf, 3.0, 4.0],
                   [1.0, inf, 3.0, 4.0], [1e30, -1e30, 3.0, 0.0]], jnp.float32)
    y = jnp.array([0, 2, 2, 1, 0, 3, 4, -1, 7, 0], jnp.int32)
    w = jnp.arange(1.0, 11.0)  # each row's own cotangent
    f = lambda impl: jax.value_and_grad(lambda a: jnp.sum(jnp.nan_to_num(impl(a, y), nan=7.0) * w))
    (got, dgot), (want, dwant) = f(ce.one_hot_cross_entropy)(x), f(_one_hot_program)(x)
    loss, want_loss = ce.one_hot_cross_entropy(x, y), _one_hot_program(x, y)
    np.testing.assert_array_equal(np.isnan(loss), np.isnan(want_loss))
    assert np.isnan(want_loss[jnp.array([1, 3, 4, 5, 7, 8])]).all() and want_loss[2] == inf and want_loss[6] == 0
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_array_equal(np.isnan(dgot), np.isnan(dwant))
    np.testing.assert_allclose(dgot, dwant, rtol=1e-6, atol=1e-7)
    for shape, dtype in (((2, 3, 1025), jnp.bfloat16), ((5, 1), jnp.float16), ((0, 7), jnp.float32)):
        logits, labels = make(shape, dtype, seed=3)
        labels = labels.at[..., :1].set(-1) if labels.size else labels  # one row out of range each
        g = lambda impl: jax.value_and_grad(lambda a: jnp.sum(impl(a, labels) * 0.5))(logits)
        for got, want in zip(g(ce.one_hot_cross_entropy), g(_one_hot_program)):
            assert got.shape == want.shape
            if want.size:
                close(got, want, dtype)
    assert kernel_names(jax.make_jaxpr(jax.grad(lambda a: ce.one_hot_cross_entropy(a, y).sum()))(x)) == \
        ["cross_entropy_fwd", "cross_entropy_bwd"]


def _smoothed_program(x, y, smoothing):
    """optax.softmax_cross_entropy(x, optax.smooth_labels(jax.nn.one_hot(y, V), smoothing))."""
    target = (1.0 - smoothing) * jax.nn.one_hot(y, x.shape[-1]) + smoothing / x.shape[-1]
    return -jnp.sum(target * jax.nn.log_softmax(x.astype(jnp.float32), -1), -1)


@pytest.mark.parametrize("block", [None, 64])
def test_smoothed_one_hot_cross_entropy_is_the_program_edge_rows_included(block, monkeypatch):
    """Smoothed, every class has weight e / V: a -inf logit makes the loss +inf (not NaN), and a
    label out of range leaves a target of e / V everywhere (loss e * lse - e / V * sum(x)). Rows of
    300 in chunks of 64 as well as whole rows."""
    if block:
        monkeypatch.setattr(ce, "default_config", lambda n, backend: L.Config.of(BLOCK_N=block))
    inf, nan = jnp.inf, jnp.nan
    x, _ = make((10, 300), jnp.float32, seed=10)
    x = x.at[1, 7].set(-inf).at[2, 299].set(-inf).at[3].set(-inf).at[4, 250].set(inf).at[5, 3].set(nan)
    x = x.at[7, 100].set(-inf).at[8, 1].set(inf).at[9, 0].set(1e30).at[9, 1].set(-1e30)
    y = jnp.array([0, 2, 299, 1, 0, 3, 300, -1, 7, 0], jnp.int32)
    w = jnp.arange(1.0, 11.0)
    smooth = lambda x, y: ce.one_hot_cross_entropy(x, y, label_smoothing=0.1)
    program = lambda x, y: _smoothed_program(x, y, 0.1)
    loss, want = smooth(x, y), program(x, y)
    np.testing.assert_array_equal(np.isnan(loss), np.isnan(want))
    assert np.isnan(want[jnp.array([3, 4, 5, 8])]).all() and (want[jnp.array([1, 2, 7])] == inf).all()
    np.testing.assert_allclose(loss, want, rtol=2e-6)
    g = lambda impl: jax.grad(lambda a: jnp.sum(jnp.nan_to_num(impl(a, y), nan=7.0, posinf=7.0) * w))(x)
    got, want = g(smooth), g(program)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    logits, labels = make((3, 37), jnp.bfloat16, seed=11)
    close(smooth(logits, labels), program(logits, labels), jnp.bfloat16)


@pytest.mark.parametrize("smoothing,block", [(0.0, None), (0.1, 64), (0.0, 64)])
def test_one_hot_cross_entropy_with_z_loss_is_the_program_edge_rows_included(smoothing, block, monkeypatch):
    """-sum(target * log_softmax) + z * logsumexp^2 (t5x's written-out loss): the z-loss counts on
    every row, a label out of range too (its target a row of zeros, or of e / V smoothed); values
    and gradients, NaN and inf where the program has them, whole rows and chunks of 64."""
    if block:
        monkeypatch.setattr(ce, "default_config", lambda n, backend: L.Config.of(BLOCK_N=block))
    inf, nan = jnp.inf, jnp.nan
    x, _ = make((9, 300), jnp.float32, seed=12)
    x = x.at[1, 7].set(-inf).at[3].set(-inf).at[4, 250].set(inf).at[5, 3].set(nan).at[8, 0].set(40.0)
    y = jnp.array([0, 2, 299, 1, 0, 3, 300, -1, 7], jnp.int32)
    z, w = 1e-2, jnp.arange(1.0, 10.0)
    program = lambda x, y: _smoothed_program(x, y, smoothing) + z * jnp.square(jax.nn.logsumexp(x, -1))
    kernel = lambda x, y: ce.one_hot_cross_entropy(x, y, label_smoothing=smoothing, z_loss=z)
    loss, want = kernel(x, y), program(x, y)
    np.testing.assert_array_equal(np.isnan(loss), np.isnan(want))
    np.testing.assert_allclose(loss, want, rtol=2e-6)
    assert want[6] > 0 and want[7] > 0  # labels out of range: the z-loss is still there
    g = lambda impl: jax.grad(lambda a: jnp.sum(jnp.nan_to_num(impl(a, y), nan=7.0, posinf=7.0) * w))(x)
    got, want = g(kernel), g(program)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("smoothing,z", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-2)])
def test_one_hot_weighted_sums_are_the_program_edge_rows_included(smoothing, z):
    """one_hot_cross_entropy(weights=w), what a one-hot loss's mean or masked sum becomes: sum(loss
    * w), NaN where the program's is, its gradients (logits, from the forward; weights) the
    program's, rows of weight 0 and labels out of range included."""
    inf, nan = jnp.inf, jnp.nan
    x, _ = make((9, 300), jnp.float32, seed=14)
    y = jnp.array([0, 2, 299, 1, 0, 3, 300, -1, 7], jnp.int32)
    w = jnp.asarray(np.random.default_rng(4).uniform(0, 1, 9), jnp.float32).at[2].set(0.0)
    program = lambda x, y, w: jnp.sum(w * (_smoothed_program(x, y, smoothing) + z * jnp.square(
        jax.nn.logsumexp(x, -1))))
    kernel = lambda x, y, w: ce.one_hot_cross_entropy(x, y, label_smoothing=smoothing, z_loss=z, weights=w)
    close(kernel(x, y, w), program(x, y, w), jnp.float32)
    grads = lambda f, x: jax.grad(f, (0, 2))(x, y, w)
    for got, want in zip(grads(kernel, x), grads(program, x)):
        close(got, want, jnp.float32)
    # edge rows: -inf beside the label (a NaN loss unsmoothed, the gradient finite), -inf at a row of
    # weight 0, +inf and NaN (NaN gradients on their rows)
    x = x.at[1, 7].set(-inf).at[2, 8].set(-inf).at[4, 250].set(inf).at[5, 3].set(nan)
    got, want = kernel(x, y, w), program(x, y, w)
    assert np.isnan(got) and np.isnan(want)
    got, want = grads(kernel, x)[0], grads(program, x)[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert not np.isnan(got[1]).any() and np.isnan(got[4]).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert kernel_names(jax.make_jaxpr(jax.grad(kernel))(x, y, w)) == ["cross_entropy_fwd"]
    with pytest.raises(ValueError, match="weights must be None or a float array of labels' shape"):
        ce.one_hot_cross_entropy(x, y, weights=w[:3])


def test_one_hot_losses_reduced_take_the_weights():
    """HF's Flax examples: softmax_cross_entropy(logits, one_hot) * mask, summed and over the mask's
    sum, or a token count given: one_hot_cross_entropy with the mask over the divisor as its weights,
    the gradient from the forward and final; a label out of range too. Values and gradients as
    jax.jit's."""
    import optax
    logits, labels = make((2, 5, 300), jnp.bfloat16, seed=15)
    labels = labels.at[0, 1].set(-1)
    mask = jnp.asarray(np.random.default_rng(5).integers(0, 2, labels.shape), jnp.float32)
    rows = lambda x, y: optax.softmax_cross_entropy(x, jax.nn.one_hot(y, x.shape[-1]))
    cases = {"masked mean": (lambda x, y, m, n: jnp.sum(rows(x, y) * m) / jnp.sum(m),
                             "sum(one_hot*log_softmax * weights) / d"),
             "over a count": (lambda x, y, m, n: jnp.sum(rows(x, y)) / n, "sum(one_hot*log_softmax) / d"),
             "masked sum": (lambda x, y, m, n: jnp.sum(rows(x, y) * m), "sum(one_hot*log_softmax * weights)")}
    count = jnp.float32(7.0)
    for name, (f, pattern) in cases.items():
        report = xkern.explain(f)(logits, labels, mask, count)
        found = [m.pattern for m in report.matches if m.pattern.startswith("cross")]
        assert found == [f"cross_entropy/{pattern}"], name
        close(xkern.jit(f)(logits, labels, mask, count), jax.jit(f)(logits, labels, mask, count), jnp.bfloat16)
        grads = lambda g: jax.grad(g, (0, 2, 3))(logits, labels, mask, count)
        for got, want in zip(grads(xkern.optimize(f)), grads(f)):
            close(got, want, jnp.bfloat16)
        grad_jaxpr = jax.make_jaxpr(jax.grad(xkern.optimize(f)))(logits, labels, mask, count)
        assert kernel_names(grad_jaxpr) == ["cross_entropy_fwd"] and not dx_scales(grad_jaxpr, logits.size), name


def test_one_hot_cross_entropy_over_chunks_finds_each_non_finite_logit(monkeypatch):
    """Rows of 300 in chunks of 64 (four whole chunks, then 44): -inf in a whole chunk, in the last
    one, only at the label (loss +inf), at the label and elsewhere (NaN), +inf in the last chunk."""
    monkeypatch.setattr(ce, "default_config", lambda n, backend: L.Config.of(BLOCK_N=64))
    monkeypatch.setattr(ce, "programs", lambda n_rows, backend: min(n_rows, 3))
    x, y = make((7, 300), jnp.float32, seed=8)
    inf = jnp.inf
    x = x.at[0, 10].set(-inf).at[1, 290].set(-inf).at[2, 5].set(-inf).at[3, 5].set(-inf).at[3, 299].set(-inf)
    x = x.at[4, 295].set(inf)
    y = y.at[2].set(5).at[3].set(5).at[5].set(300)  # row 5: out of range, 0; row 6 plain
    loss, want = ce.one_hot_cross_entropy(x, y), _one_hot_program(x, y)
    np.testing.assert_array_equal(np.isnan(loss), [True, True, False, True, True, False, False])
    assert loss[2] == want[2] == jnp.inf and loss[5] == want[5] == 0
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    g = lambda impl: jax.grad(lambda a: jnp.sum(jnp.nan_to_num(impl(a, y)) * jnp.arange(1.0, 8.0)))(x)
    got, want = g(ce.one_hot_cross_entropy), g(_one_hot_program)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_kernels_per_reduction_vmap_jit_and_empty():
    logits, labels = make((2, 5, 33), jnp.float32, seed=4)
    mean_grad = jax.make_jaxpr(jax.grad(lambda x: xkern.ops.cross_entropy(x, labels[0])))(logits[0])
    assert kernel_names(mean_grad) == ["cross_entropy_fwd"]  # dx comes out of the forward
    none_grad = jax.make_jaxpr(jax.grad(lambda x: xkern.ops.cross_entropy(x, labels[0], reduction="none").sum()))
    assert sorted(kernel_names(none_grad(logits[0]))) == ["cross_entropy_bwd", "cross_entropy_fwd"]
    for reduction in ("mean", "none"):
        f = lambda impl: jax.jit(jax.vmap(jax.value_and_grad(
            lambda x, y: jnp.sum(impl(x, y, reduction=reduction, ignore_index=1)))))
        (got, dgot), (want, dwant) = f(xkern.ops.cross_entropy)(logits, labels), f(ce.reference)(logits, labels)
        close(got, want, jnp.float32)
        close(dgot, dwant, jnp.float32)
    empty = xkern.ops.cross_entropy(jnp.zeros((0, 8)), jnp.zeros((0,), jnp.int32), reduction="none")
    assert empty.shape == (0,)
    for reduction, shape in (("none", (3, 2)), ("mean", ()), ("sum", ())):  # no classes: every label out of range
        rows = xkern.ops.cross_entropy(jnp.zeros((3, 2, 0)), jnp.zeros((3, 2), jnp.int32), reduction=reduction)
        assert rows.shape == shape and np.isnan(rows).all()
    assert jax.grad(lambda x: xkern.ops.cross_entropy(x, jnp.zeros(3, jnp.int32)))(jnp.zeros((3, 0))).shape == (3, 0)
    np.testing.assert_array_equal(xkern.ops.cross_entropy(logits, labels, backend="xla"),
                                  ce.reference(logits, labels))


@pytest.mark.parametrize("op", ["mean", "none", "weights", "where", "one_hot", "one_hot weights"])
@pytest.mark.parametrize("backend", [None, "xla"])
def test_rows_logsumexp_and_losses_come_out_of_the_same_pass_with_their_gradients(op, backend):
    """return_lse / return_rows: every row's logsumexp of the (capped) logits and every row's loss
    before weights (0 where ignored), masked and non-finite rows too; differentiated, the softmax
    (times the cap's derivative) and the row loss's gradient, added to the loss's."""
    logits, labels = make((3, 37), jnp.float32, seed=7)
    edge = logits.at[1, 4].set(jnp.inf).at[2].set(-jnp.inf)
    weights = jnp.asarray([0.5, 0.0, 2.0], jnp.float32)
    mask = jnp.asarray([True, False, True])
    one_hot_labels, ignored = labels.at[0].set(40), int(labels[2])
    calls = {"mean": lambda x, **kw: ce.cross_entropy(x, labels, ignore_index=ignored, z_loss=1e-3, **kw),
             "none": lambda x, **kw: ce.cross_entropy(x, labels, reduction="none", label_smoothing=0.1, **kw),
             "weights": lambda x, **kw: ce.cross_entropy(x, labels, reduction="sum", weights=weights, **kw),
             "where": lambda x, **kw: ce.where_masked_sum(x, labels, mask, scale=0.5, **kw),
             "one_hot": lambda x, **kw: ce.one_hot_cross_entropy(x, one_hot_labels, **kw),
             "one_hot weights": lambda x, **kw: ce.one_hot_cross_entropy(x, labels, weights=weights, z_loss=1e-3, **kw)}
    rows_of = {"mean": lambda x: ce.reference(x, labels, ignored, z_loss=1e-3, reduction="none"),
               "none": lambda x: ce.reference(x, labels, label_smoothing=0.1, reduction="none"),
               "one_hot": lambda x: ce.one_hot_cross_entropy(x, one_hot_labels, backend="xla"),
               "one_hot weights": lambda x: ce.one_hot_cross_entropy(x, labels, z_loss=1e-3, backend="xla")}
    for cap in (None, 3.0):
        capped = lambda x: ce.soft_capped(x, cap)
        call = lambda x, **kw: calls[op](x, soft_cap=cap, backend=backend, **kw)
        loss, lse, rows = call(edge, return_lse=True, return_rows=True)
        np.testing.assert_allclose(lse, jax.nn.logsumexp(capped(edge), -1), rtol=1e-6)
        want_rows = rows_of.get(op, lambda x: ce.reference(x, labels, reduction="none"))(capped(edge))
        np.testing.assert_allclose(rows, want_rows, rtol=1e-5)
        np.testing.assert_array_equal(loss, call(edge))  # the loss as without them
        # value and gradient of the loss plus weighted sums of the others, against the reference's
        both = lambda outs: jnp.sum(outs[0]) + jnp.sum(outs[1] * jnp.arange(1.0, 4.0)) + jnp.sum(
            outs[2] * jnp.arange(3.0, 0.0, -1.0))
        got = jax.jit(jax.value_and_grad(lambda x: both(call(x, return_lse=True, return_rows=True))))(logits)
        reference = lambda x: (calls[op](x, soft_cap=cap, backend="xla"), jax.nn.logsumexp(capped(x), -1),
                               rows_of.get(op, lambda x: ce.reference(x, labels, reduction="none"))(capped(x)))
        want = jax.value_and_grad(lambda x: both(reference(x)))(logits)
        close(got[0], want[0], jnp.float32)
        close(got[1], want[1], jnp.float32)
    if backend is None:  # undifferentiated, or their cotangents zero: the same kernels as without them
        aux = lambda x: (lambda out: (jnp.sum(out[0]), out[1:]))(calls[op](x, return_lse=True, return_rows=True))
        assert kernel_names(jax.make_jaxpr(jax.grad(aux, has_aux=True))(logits)) == kernel_names(
            jax.make_jaxpr(jax.grad(lambda x: jnp.sum(calls[op](x))))(logits))


def test_bad_input_names_the_argument():
    x, y = jnp.ones((2, 8)), jnp.zeros((2,), jnp.int32)
    cases = [((jnp.ones((2, 8), jnp.int32), y), {}, TypeError, "logits must have dtype"),
             ((x, y.astype(jnp.float32)), {}, TypeError, "labels must be an integer array"),
             ((x, jnp.zeros((3,), jnp.int32)), {}, ValueError, r"labels must have shape \(2,\)"),
             ((x, y), {"reduction": "avg"}, ValueError, "reduction must be one of"),
             ((x, y), {"label_smoothing": 1.5}, ValueError, "label_smoothing must be"),
             ((x, y), {"z_loss": -1.0}, ValueError, "z_loss must be"),
             ((x, y), {"ignore_index": 1.0}, TypeError, "ignore_index must be an int"),
             ((x, y), {"ignore_index": True}, TypeError, "ignore_index must be an int or None; got True"),
             ((x, y), {"ignore_index": 2**40}, ValueError, r"ignore_index must be in int32's range"),
             ((x, y), {"label_smoothing": "0.1"}, ValueError, "label_smoothing must be a number"),
             ((x, y), {"z_loss": True}, ValueError, "z_loss must be a non-negative number"),
             ((x, y), {"soft_cap": 0.0}, ValueError, "soft_cap must be None or a positive finite number"),
             ((x, y), {"soft_cap": float("inf")}, ValueError, "soft_cap must be None or a positive"),
             ((x, y), {"return_lse": 1}, TypeError, "return_lse must be a bool"),
             ((x, y), {"return_rows": "yes"}, TypeError, "return_rows must be a bool"),
             ((jnp.ones(()), y), {}, ValueError, "logits must have a class axis")]
    for args, kw, error, message in cases:
        with pytest.raises(error, match=message):
            xkern.ops.cross_entropy(*args, **kw)
    with pytest.raises(ValueError, match="label_smoothing must be .*known when tracing"):
        jax.jit(lambda e: xkern.ops.cross_entropy(x, y, label_smoothing=e))(0.1)
    # NumPy and 0-d jax scalars are numbers
    want = xkern.ops.cross_entropy(x, y, label_smoothing=0.25, z_loss=0.5)
    assert xkern.ops.cross_entropy(x, y, label_smoothing=np.float32(0.25), z_loss=jnp.float32(0.5)) == want
    # labels beyond int32's range stay out of range (NaN), not wrapped onto class 0 or ignore_index -100
    wide, x3 = np.array([2**32, 2**32 - 100, 1]), jnp.ones((3, 8))
    nan_nan_finite = lambda loss: np.isnan(loss[:2]).all() and np.isfinite(loss[2])
    assert nan_nan_finite(xkern.ops.cross_entropy(x3, wide, ignore_index=-100, reduction="none"))
    high = jnp.array([2**32 - 100, 2**31, 1], jnp.uint32)
    assert nan_nan_finite(xkern.ops.cross_entropy(x3, high, ignore_index=-100, reduction="none"))
    with jax.enable_x64(True):
        assert nan_nan_finite(xkern.ops.cross_entropy(x3, jnp.asarray(wide), ignore_index=-100, reduction="none"))


# --------------------------------------------------------------------------------------------------
# Patterns: the ways people write cross-entropy, found by xkern.jit / xkern.optimize
# --------------------------------------------------------------------------------------------------

def _spellings():
    import optax
    from flax.training.common_utils import onehot

    take = lambda a, y: jnp.take_along_axis(a, y[..., None], axis=-1)
    return {
        # HF's Flax examples: flax's onehot, plain (run_clm_flax) or smoothed with on = 1 - e and
        # off = e / (V - 1) (run_summarization_flax)
        "flax_onehot*log_softmax": lambda x, y: optax.softmax_cross_entropy(x, onehot(y, x.shape[-1])).mean(),
        "flax_onehot*log_softmax+upcast": lambda x, y: jnp.sum(optax.softmax_cross_entropy(
            x.astype(jnp.float32), onehot(y, x.shape[-1], on_value=0.9, off_value=0.1 / (x.shape[-1] - 1)))),
        "optax_integer_labels": lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x, y).mean(),
        "optax_integer_labels+upcast": lambda x, y: jnp.sum(
            optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), y)),
        "logsumexp-take_along_axis": lambda x, y: jnp.mean(jax.nn.logsumexp(x, -1) - take(x, y)[..., 0]),
        "-take_along_axis(log_softmax)+upcast": lambda x, y: jnp.sum(
            -take(jax.nn.log_softmax(x.astype(jnp.float32), -1), y)[..., 0] * 0.5),
        "take_along_axis(log_softmax)+upcast": lambda x, y: -jnp.mean(
            take(jax.nn.log_softmax(x.astype(jnp.float32), axis=-1), y)),
        "one_hot*log_softmax": lambda x, y: optax.softmax_cross_entropy(x, jax.nn.one_hot(y, x.shape[-1])).mean(),
        "one_hot*log_softmax+upcast": lambda x, y: jnp.sum(-jnp.sum(
            jax.nn.one_hot(y, x.shape[-1]) * jax.nn.log_softmax(x.astype(jnp.float32)), axis=-1)),
        "one_hot(dtype=logits')*log_softmax": lambda x, y: optax.softmax_cross_entropy(
            x, jax.nn.one_hot(y, x.shape[-1], dtype=x.dtype)).mean(),
        "sum_classes(one_hot*log_softmax)+upcast": lambda x, y: -jnp.mean(jnp.sum(
            jax.nn.log_softmax(x.astype(jnp.float32)) * jax.nn.one_hot(y, x.shape[-1]), axis=-1)),
        "-take_along_axis(x-logsumexp)+upcast": lambda x, y: jnp.mean(-take(
            (lambda z: z - jax.nn.logsumexp(z, -1, keepdims=True))(x.astype(jnp.float32)), y)[..., 0]),
        "one_hot*(x-logsumexp)": lambda x, y: jnp.sum(-jnp.sum(
            jax.nn.one_hot(y, x.shape[-1]) * (x - jax.scipy.special.logsumexp(x, axis=-1, keepdims=True)), axis=-1)),
        "smooth_labels(one_hot)*log_softmax+upcast": lambda x, y: optax.softmax_cross_entropy(
            x.astype(jnp.float32), optax.smooth_labels(jax.nn.one_hot(y, x.shape[-1]), 0.1)).mean(),
        "smooth_labels(one_hot)*log_softmax": lambda x, y: jnp.sum(-jnp.sum(
            (jax.nn.one_hot(y, x.shape[-1]) * (1 - 0.3) + 0.3 / x.shape[-1]) * jax.nn.log_softmax(x), -1)),
        # PaLM's z-loss beside the loss, z * logsumexp^2 per row
        "logsumexp-take_along_axis+z*logsumexp^2": lambda x, y: jnp.mean(
            (lambda lse: lse - take(x, y)[..., 0] + 0.05 * lse ** 2)(jax.nn.logsumexp(x, -1))),
        "-take_along_axis(log_softmax)+z*logsumexp^2+upcast": lambda x, y: jnp.sum(
            (lambda z: -take(jax.nn.log_softmax(z), y)[..., 0] + jnp.square(jax.nn.logsumexp(z, -1)) * 1e-4)(
                x.astype(jnp.float32))),
        "-take_along_axis(x-logsumexp)+z*logsumexp^2": lambda x, y: jnp.mean(
            (lambda log_z: -take(x - log_z, y)[..., 0] + 0.02 * jnp.square(jnp.squeeze(log_z, -1)))(
                jax.nn.logsumexp(x, -1, keepdims=True))),
        "one_hot*(x-logsumexp)+z*logsumexp^2+upcast": lambda x, y: jnp.mean((lambda z: (lambda log_z: -jnp.sum(
            jax.nn.one_hot(y, x.shape[-1]) * (z - log_z), -1) + 1e-4 * jax.lax.square(jnp.squeeze(log_z, -1)))(
                jax.scipy.special.logsumexp(z, -1, keepdims=True)))(x.astype(jnp.float32))),
        "one_hot*log_softmax+z*logsumexp^2": lambda x, y: jnp.sum(optax.softmax_cross_entropy(
            x, jax.nn.one_hot(y, x.shape[-1])) + 0.03 * jnp.square(jax.nn.logsumexp(x, -1))),
        "optax_integer_labels+z*logsumexp^2+upcast": lambda x, y: jnp.mean(
            (lambda z: optax.softmax_cross_entropy_with_integer_labels(z, y) + 0.1 * jax.nn.logsumexp(z, -1) ** 2)(
                x.astype(jnp.float32))),
    }


# The spellings above whose whole loss is the mean or sum of the row losses: taken with their
# reduction, so that the gradient comes out of the forward (the others: a row loss, the rest XLA's).
# -sum(0.5 * rows) keeps the row loss.
REDUCED = {"optax_integer_labels": "mean(optax_integer_labels)",
           "optax_integer_labels+upcast": "sum(optax_integer_labels+upcast)",
           "logsumexp-take_along_axis": "mean(logsumexp-take_along_axis)",
           "take_along_axis(log_softmax)+upcast": "-mean(take_along_axis(log_softmax)+upcast)",
           "-take_along_axis(x-logsumexp)+upcast": "mean(-take_along_axis(x-logsumexp)+upcast)",
           "logsumexp-take_along_axis+z*logsumexp^2": "mean(logsumexp-take_along_axis+z*logsumexp^2)",
           "-take_along_axis(log_softmax)+z*logsumexp^2+upcast":
               "sum(-take_along_axis(log_softmax)+z*logsumexp^2+upcast)",
           "-take_along_axis(x-logsumexp)+z*logsumexp^2": "mean(-take_along_axis(x-logsumexp)+z*logsumexp^2)",
           "optax_integer_labels+z*logsumexp^2+upcast": "mean(optax_integer_labels+z*logsumexp^2+upcast)",
           **{spelling: f"{reduce}({spelling})" for reduce, spellings in {
               "mean": ["one_hot*log_softmax", "one_hot(dtype=logits')*log_softmax",
                        "smooth_labels(one_hot)*log_softmax+upcast", "one_hot*(x-logsumexp)+z*logsumexp^2+upcast"],
               "sum": ["one_hot*log_softmax+upcast", "one_hot*(x-logsumexp)", "smooth_labels(one_hot)*log_softmax",
                       "one_hot*log_softmax+z*logsumexp^2"],
               "-mean": ["sum_classes(one_hot*log_softmax)+upcast"]}.items() for spelling in spellings},
           "flax_onehot*log_softmax": "mean(flax_onehot*log_softmax)",
           "flax_onehot*log_softmax+upcast": "sum(flax_onehot*log_softmax+upcast)"}


@pytest.mark.parametrize("spelling", list(_spellings()))
def test_patterns_match_and_equal_jax_jit(spelling):
    f = _spellings()[spelling]
    logits, labels = make((3, 5, 37), jnp.bfloat16, seed=5)
    labels = labels.at[0, 0].set(-2)  # negative labels count from the end, as take_along_axis does
    report = xkern.explain(f)(logits, labels)
    assert [m.pattern for m in report.matches if m.pattern.startswith("cross_entropy")] == \
        [f"cross_entropy/{REDUCED.get(spelling, spelling)}"]
    assert "cross_entropy_fwd" in kernel_names(jax.make_jaxpr(xkern.optimize(f))(logits, labels))
    # reduced: the gradient comes out of the forward, no backward kernel reads the logits again
    grad_kernels = kernel_names(jax.make_jaxpr(jax.grad(xkern.optimize(f)))(logits, labels))
    assert ("cross_entropy_bwd" in grad_kernels) == (spelling not in REDUCED)
    close(xkern.jit(f)(logits, labels), jax.jit(f)(logits, labels), jnp.bfloat16)
    close(jax.jit(jax.grad(xkern.optimize(f)))(logits, labels), jax.jit(jax.grad(f))(logits, labels),
          jnp.bfloat16)


def test_hf_flax_example_losses_are_found():
    """HF's Flax examples' losses, flax's onehot targets: run_mlm_flax's sum of the rows times the
    mask of labels > 0; run_summarization_flax's smoothed target (on = 1 - e, off = e / (V - 1))
    less its normalizing constant, times the padding mask, summed: each reduced, its gradient from
    the forward. Values and gradients (logits and mask) as jax.jit's, a label out of range
    (onehot's row of zeros) included."""
    import optax
    from flax.training.common_utils import onehot
    logits, labels = make((2, 6, 41), jnp.bfloat16, seed=16)
    labels = labels.at[0, 0].set(0).at[1, 2].set(41)
    mask = jnp.asarray(np.random.default_rng(8).integers(0, 2, labels.shape), jnp.float32)

    def mlm(x, y, padding):
        label_mask = jnp.where(y > 0, 1.0, 0.0)
        return jnp.sum(optax.softmax_cross_entropy(x, onehot(y, x.shape[-1])) * label_mask)

    def summarization(x, y, padding, smoothing=0.1):
        vocab, confidence = x.shape[-1], 1.0 - smoothing
        low_confidence = (1.0 - confidence) / (vocab - 1)
        constant = -(confidence * jnp.log(confidence) + (vocab - 1) * low_confidence * jnp.log(low_confidence + 1e-20))
        soft_labels = onehot(y, vocab, on_value=confidence, off_value=low_confidence)
        return jnp.sum((optax.softmax_cross_entropy(x, soft_labels) - constant) * padding)

    for f, pattern in ((mlm, "sum(flax_onehot*log_softmax * weights)"),
                       (summarization, "sum((flax_onehot*log_softmax - c) * weights)")):
        report = xkern.explain(f)(logits, labels, mask)
        assert [m.pattern for m in report.matches if m.pattern.startswith("cross")] == [f"cross_entropy/{pattern}"]
        close(xkern.jit(f)(logits, labels, mask), jax.jit(f)(logits, labels, mask), jnp.bfloat16)
        # (against the program on float32 logits: jax.jit's bf16 softmax gradient is 2% off near 1)
        grads = lambda g, x: jax.jit(jax.grad(g, (0, 2)))(x, labels, mask)
        for got, want in zip(grads(xkern.optimize(f), logits), grads(f, logits.astype(jnp.float32))):
            close(got, want, jnp.bfloat16)
        grad_jaxpr = jax.make_jaxpr(jax.grad(xkern.optimize(f)))(logits, labels, mask)
        assert [k for k in kernel_names(grad_jaxpr) if k.startswith("cross")] == ["cross_entropy_fwd"]
        assert not dx_scales(grad_jaxpr, logits.size)


@pytest.mark.parametrize("spelling", ["-log_softmax[rows, labels]", "log_softmax[rows, labels]+upcast",
                                      "logsumexp-logits[rows, labels]"])
def test_numpy_indexing_spellings_are_found_and_count_labels_from_the_end(spelling):
    """logits[jnp.arange(n), labels] on [n, V] logits: negative labels count from the end; one still
    out of range is clamped into range, as indexing's forward does (HF's -100 labels, masked after
    the loss: the loss and its gradients as jax.jit's)."""
    lsm = jax.nn.log_softmax
    up = (lambda x: x.astype(jnp.float32)) if spelling.endswith("+upcast") else (lambda x: x)
    rows = lambda x: jnp.arange(x.shape[0])
    f = {"-log_softmax[rows, labels]": lambda x, y: jnp.mean(-lsm(x)[rows(x), y]),
         "log_softmax[rows, labels]+upcast": lambda x, y: -jnp.sum(lsm(up(x))[rows(x), y]),
         "logsumexp-logits[rows, labels]": lambda x, y: jnp.mean(jax.nn.logsumexp(x, -1) - x[rows(x), y]),
         }[spelling]
    logits, labels = make((7, 37), jnp.bfloat16, seed=9)
    labels = labels.at[0].set(-2).at[1].set(-37)
    report = xkern.explain(f)(logits, labels)
    reduced = {"-log_softmax[rows, labels]": "mean", "log_softmax[rows, labels]+upcast": "-sum",
               "logsumexp-logits[rows, labels]": "mean"}[spelling]  # (the whole loss: mean / sum of the rows)
    assert [m.pattern for m in report.matches if m.pattern.startswith("cross_entropy")] == \
        [f"cross_entropy/{reduced}({spelling})"]
    close(xkern.jit(f)(logits, labels), jax.jit(f)(logits, labels), jnp.bfloat16)
    close(jax.jit(jax.grad(xkern.optimize(f)))(logits, labels), jax.jit(jax.grad(f))(logits, labels),
          jnp.bfloat16)
    padded = labels.at[2].set(-100).at[3].set(37)
    keep = jnp.ones(7).at[2:4].set(0.0)
    masked = {"-log_softmax[rows, labels]": lambda x, y: jnp.sum(-lsm(x)[rows(x), y] * keep),
              "log_softmax[rows, labels]+upcast": lambda x, y: -jnp.sum(lsm(up(x))[rows(x), y] * keep),
              "logsumexp-logits[rows, labels]": lambda x, y: jnp.sum((jax.nn.logsumexp(x, -1) - x[rows(x), y]) * keep),
              }[spelling]
    close(xkern.jit(f)(logits, padded), jax.jit(f)(logits, padded), jnp.bfloat16)  # clamped, as XLA's forward
    close(xkern.jit(masked)(logits, padded), jax.jit(masked)(logits, padded), jnp.bfloat16)
    close(jax.jit(jax.grad(xkern.optimize(masked)))(logits, padded), jax.jit(jax.grad(masked))(logits, padded),
          jnp.bfloat16)


def test_mean_or_sum_over_every_row_takes_the_reduction_and_over_some_axes_the_row_loss():
    """The loss reduced over every row (3-D logits: two axes) is cross_entropy(reduction=...), its
    gradient from the forward; reduced over one axis, or scaled before the sum, the row loss, the
    rest XLA's. Values and gradients as jax.jit's in every case."""
    import optax
    logits, labels = make((2, 5, 300), jnp.float32, seed=10)
    rows = optax.softmax_cross_entropy_with_integer_labels
    cases = {"mean": (lambda x, y: rows(x, y).mean(), "mean(optax_integer_labels)"),
             "sum": (lambda x, y: jnp.sum(rows(x, y)), "sum(optax_integer_labels)"),
             "sum / 7": (lambda x, y: rows(x, y).sum() / 7.0, "sum(optax_integer_labels) / c"),
             "mean over axis 0": (lambda x, y: rows(x, y).mean(axis=0), "optax_integer_labels"),
             "sum over axis 1": (lambda x, y: jnp.sum(rows(x, y), axis=1), "optax_integer_labels"),
             "sum of 0.5 * rows": (lambda x, y: jnp.sum(0.5 * rows(x, y)), "optax_integer_labels")}
    for name, (f, pattern) in cases.items():
        report = xkern.explain(f)(logits, labels)
        assert [m.pattern for m in report.matches] == [f"cross_entropy/{pattern}"], name
        close(xkern.jit(f)(logits, labels), jax.jit(f)(logits, labels), jnp.float32)
        loss = lambda g: (lambda x: jnp.sum(g(x, labels) * jnp.arange(1.0, 1.0 + g(x, labels).size).reshape(
            g(x, labels).shape)))
        close(jax.grad(loss(xkern.optimize(f)))(logits), jax.grad(loss(f))(logits), jnp.float32)


def test_padding_masked_sums_take_the_weights():
    """sum(rows * mask) / sum(mask) and mean(rows * mask): cross_entropy with the mask as its
    weights, the division folded into them, the gradient from the forward and final (not scaled
    again); a mask in the logits' half precision too. Values and gradients (logits and mask) as
    jax.jit's."""
    import optax
    logits, labels = make((2, 5, 300), jnp.bfloat16, seed=12)
    mask = jnp.asarray(np.random.default_rng(3).integers(0, 2, labels.shape), jnp.float32)
    up = lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), y)
    cases = {"masked mean": (lambda x, y, m: jnp.sum(up(x, y) * m) / jnp.sum(m),
                             "sum(optax_integer_labels+upcast * weights) / d"),
             "mean of masked": (lambda x, y, m: jnp.mean(up(x, y) * m), "mean(optax_integer_labels+upcast * weights)"),
             "over a scalar": (lambda x, y, m: jnp.sum(up(x, y)) / (1.0 + jnp.sum(m)),
                               "sum(optax_integer_labels+upcast) / d"),
             "bf16 mask": (lambda x, y, m: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x, y)
                                                   * m.astype(jnp.bfloat16)), "sum(optax_integer_labels * weights)")}
    for name, (f, pattern) in cases.items():
        report = xkern.explain(f)(logits, labels, mask)
        assert [m.pattern for m in report.matches if m.pattern.startswith("cross")] == [f"cross_entropy/{pattern}"], name
        # (the bf16 mask's sum is bf16, rounded once here, after float32 math: 1 ulp from jax.jit's)
        close(xkern.jit(f)(logits, labels, mask), jax.jit(f)(logits, labels, mask), jnp.bfloat16)
        grads = lambda g: jax.grad(g, (0, 2))(logits, labels, mask)
        for got, want in zip(grads(xkern.optimize(f)), grads(f)):
            close(got, want, jnp.bfloat16)
        grad_jaxpr = jax.make_jaxpr(jax.grad(xkern.optimize(f)))(logits, labels, mask)
        assert "cross_entropy_bwd" not in kernel_names(grad_jaxpr), name
        assert not dx_scales(grad_jaxpr, logits.size), name


def test_reduced_losses_scaled_fold_the_scale():
    """A reduced loss times or over a constant (a gradient accumulation's step count, a loss's
    weight), or times a scalar (a dynamic loss scale): it goes into the rows' weights with the
    reduction's, so the forward's
    gradient is final (left to XLA, it would scale dx in one more pass); masked, by where, one-hot
    targets and negated log-probabilities too. Values and gradients as jax.jit's; a scale of inf is
    declined, saying why."""
    import optax
    logits, labels = make((2, 5, 300), jnp.bfloat16, seed=17)
    mask = jnp.asarray(np.random.default_rng(9).integers(0, 2, labels.shape), jnp.float32)
    up = lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), y)
    lsm = lambda x, y: jnp.take_along_axis(jax.nn.log_softmax(x.astype(jnp.float32)), y[..., None], -1)
    one_hot = lambda x, y: optax.softmax_cross_entropy(x, jax.nn.one_hot(y, x.shape[-1]))
    cases = {"mean / 4": (lambda x, y, m: up(x, y).mean() / 4, "mean(optax_integer_labels+upcast) / c"),
             "0.5 * sum": (lambda x, y, m: 0.5 * jnp.sum(up(x, y)), "sum(optax_integer_labels+upcast) * c"),
             "masked sum / 8": (lambda x, y, m: jnp.sum(up(x, y) * m) / 8.0,
                                "sum(optax_integer_labels+upcast * weights) / c"),
             "where, mean * 3": (lambda x, y, m: jnp.mean(jnp.where(m > 0, up(x, y), 0.0)) * 3.0,
                                 "mean(where(mask, optax_integer_labels+upcast, 0)) * c"),
             "-mean(log p) * 2": (lambda x, y, m: -jnp.mean(lsm(x, y)) * 2.0,
                                  "-mean(take_along_axis(log_softmax)+upcast) * c"),
             "one-hot mean * 0.25": (lambda x, y, m: one_hot(x, y).mean() * 0.25, "mean(one_hot*log_softmax) * c"),
             # a dynamic loss scale (jmp's, for float16 training): a scalar the program is given
             "mean * scale": (lambda x, y, m: up(x, y).mean() * jnp.sum(m), "mean(optax_integer_labels+upcast) * d")}
    for name, (f, pattern) in cases.items():
        report = xkern.explain(f)(logits, labels, mask)
        found = [m.pattern for m in report.matches if m.pattern.startswith("cross")]
        assert found == [f"cross_entropy/{pattern}"], (name, found)
        close(xkern.jit(f)(logits, labels, mask), jax.jit(f)(logits, labels, mask), jnp.bfloat16)
        close(jax.jit(jax.grad(xkern.optimize(f)))(logits, labels, mask),
              jax.jit(jax.grad(f))(logits.astype(jnp.float32), labels, mask), jnp.bfloat16)
        grad_jaxpr = jax.make_jaxpr(jax.grad(xkern.optimize(f)))(logits, labels, mask)
        assert kernel_names(grad_jaxpr) == ["cross_entropy_fwd"] and not dx_scales(grad_jaxpr, logits.size), name
    f = lambda x, y: up(x, y).mean() * jnp.inf
    report = xkern.explain(f)(logits, labels)
    assert "scaled by inf" in str(report), report
    close(xkern.jit(f)(logits, labels), jax.jit(f)(logits, labels), jnp.float32)


def test_a_per_example_loss_mapped_by_vmap_finds_the_row_loss():
    """Equinox's idiom: the loss of one example, mapped over the batch by jax.vmap (which broadcasts
    the row maxima's zeros twice: canonicalization folds that): each example's masked mean, then the
    batch's, is the loss normalized per example, reduced with the weights mask / sum(mask, -1); each
    example's plain mean, then the batch's, is the mean over every row, reduced. Values and
    gradients as jax.jit's, the logits' from the forward alone."""
    import optax
    logits, labels = make((3, 7, 300), jnp.bfloat16, seed=22)
    mask = jnp.asarray(np.random.default_rng(12).integers(0, 2, labels.shape), jnp.float32).at[:, 0].set(1.0)

    def per_example(x, y, m):
        rows = optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), y)
        return jnp.sum(rows * m) / jnp.sum(m)
    f = lambda x, y, m: jnp.mean(jax.vmap(per_example)(x, y, m))
    report = xkern.explain(f)(logits, labels, mask)
    assert [m.pattern for m in report.matches if m.pattern.startswith("cross")] == [
        "cross_entropy/mean(sum(optax_integer_labels+upcast * weights, -1) / n)"]
    close(xkern.jit(f)(logits, labels, mask), jax.jit(f)(logits, labels, mask), jnp.float32)
    grads = lambda g: jax.jit(jax.grad(g, (0, 2)))(logits, labels, mask)
    for got, want in zip(grads(xkern.optimize(f)), grads(f)):
        close(got, want, jnp.bfloat16)
    grad_jaxpr = jax.make_jaxpr(jax.grad(xkern.optimize(f)))(logits, labels, mask)
    assert kernel_names(grad_jaxpr) == ["cross_entropy_fwd"] and not dx_scales(grad_jaxpr, logits.size)
    # unmasked, each example's mean (or sum) then the batch's is the mean (sum) over every row: reduced
    up = lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), y)
    cases = {"mean_of_means(optax_integer_labels+upcast)": lambda x, y: jnp.mean(jax.vmap(
                 lambda x, y: jnp.mean(up(x, y)))(x, y)),
             "sum_of_sums(optax_integer_labels) * c": lambda x, y: 0.5 * jnp.sum(jax.vmap(
                 lambda x, y: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x, y)))(x, y))}
    for pattern, f in cases.items():
        report = xkern.explain(f)(logits, labels)
        found = [m.pattern for m in report.matches if m.pattern.startswith("cross")]
        assert found == [f"cross_entropy/{pattern}"], found
        close(xkern.jit(f)(logits, labels), jax.jit(f)(logits, labels), jnp.bfloat16)
        close(jax.jit(jax.grad(xkern.optimize(f)))(logits, labels),
              jax.jit(jax.grad(f))(logits.astype(jnp.float32), labels), jnp.bfloat16)
        grad_jaxpr = jax.make_jaxpr(jax.grad(xkern.optimize(f)))(logits, labels)
        assert [k for k in kernel_names(grad_jaxpr) if k.startswith("cross")] == ["cross_entropy_fwd"], pattern
        assert not dx_scales(grad_jaxpr, logits.size), pattern


def test_losses_normalized_per_example_are_reduced():
    """Each example's weighted mean, then the batch's mean or sum, sum(rows * mask, -1) / sum(mask,
    -1) (a loss normalized per sequence): one kernel, the weights mask / sum(mask, -1) in it, for
    float, bool and int32 masks (HF's attention_mask), integer labels or smoothed one-hot targets,
    scaled after or not. An example whose mask is all zeros makes the loss NaN, as under jax.jit.
    Values and gradients (logits, and a float mask) as jax.jit's; the logits' from the forward
    alone, unscaled after it."""
    import optax
    logits, labels = make((3, 7, 300), jnp.bfloat16, seed=23)
    keep = np.random.default_rng(13).integers(0, 2, labels.shape).astype(bool)
    keep[:, 0] = True
    up = lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), y)
    smoothed = lambda x, y: optax.softmax_cross_entropy(x, optax.smooth_labels(jax.nn.one_hot(y, x.shape[-1]), 0.2))
    per_example = lambda rows, m: jnp.sum(rows * m, -1) / jnp.sum(m, -1)
    cases = {  # name: (loss, mask, the pattern)
        "float mask, mean": (lambda x, y, m: jnp.mean(per_example(up(x, y), m)), keep.astype(np.float32),
                             "mean(sum(optax_integer_labels+upcast * weights, -1) / n)"),
        "bool mask, sum, times a constant": (lambda x, y, m: 0.5 * jnp.sum(per_example(up(x, y), m)), keep,
                                             "sum(sum(optax_integer_labels+upcast * weights, -1) / n) * c"),
        "int32 mask, smoothed one-hot, mean": (lambda x, y, m: jnp.mean(per_example(smoothed(x, y), m)),
                                               keep.astype(np.int32),
                                               "mean(sum(smooth_labels(one_hot)*log_softmax * weights, -1) / n)"),
    }
    for name, (f, mask, pattern) in cases.items():
        mask = jnp.asarray(mask)
        report = xkern.explain(f)(logits, labels, mask)
        assert [m.pattern for m in report.matches if m.pattern.startswith("cross")] == [f"cross_entropy/{pattern}"], name
        # (optax's one-hot loss takes log_softmax in the logits' bfloat16: the kernel's is float32)
        close(xkern.jit(f)(logits, labels, mask), jax.jit(f)(logits, labels, mask),
              jnp.bfloat16 if "one-hot" in name else jnp.float32)
        wrt = (0, 2) if mask.dtype == jnp.float32 else (0,)
        grads = lambda g: jax.jit(jax.grad(g, wrt))(logits, labels, mask)
        for got, want in zip(grads(xkern.optimize(f)), grads(f)):
            close(got, want, jnp.bfloat16)
        grad_jaxpr = jax.make_jaxpr(jax.grad(xkern.optimize(f)))(logits, labels, mask)
        # (the counts, sums of the mask, are XLA's or a generated kernel's, as is the rest of the program)
        assert [k for k in kernel_names(grad_jaxpr) if k.startswith("cross")] == ["cross_entropy_fwd"], name
        assert not dx_scales(grad_jaxpr, logits.size), name
    # an example with nothing to count: 0 / 0, the loss NaN in both; its rows' gradients too
    f, mask, _ = cases["float mask, mean"]
    mask = jnp.asarray(mask).at[1].set(0.0)
    got, want = xkern.jit(jax.value_and_grad(f))(logits, labels, mask), jax.jit(jax.value_and_grad(f))(logits, labels, mask)
    assert np.isnan(float(got[0])) and np.isnan(float(want[0]))
    assert np.array_equal(np.isnan(got[1]), np.isnan(want[1])) and np.isnan(got[1][1]).all()
    # the count guarded, maximum(sum(mask, -1), 1): a sequence with nothing to count adds 0, in both;
    # or the lengths given (int32), the mask a prefix of each row
    guarded = lambda x, y, m: jnp.mean(jnp.sum(up(x, y) * m, -1) / jnp.maximum(jnp.sum(m, -1), 1))
    lengths = jnp.asarray([3, 7, 1], jnp.int32)
    given = lambda x, y, n: jnp.mean(jnp.sum(up(x, y) * (jnp.arange(y.shape[-1]) < n[:, None]), -1) / n)
    for f, third in ((guarded, jnp.asarray(keep).at[1].set(False)), (given, lengths)):
        report = xkern.explain(f)(logits, labels, third)
        assert [m.pattern for m in report.matches if m.pattern.startswith("cross")] == [
            "cross_entropy/mean(sum(optax_integer_labels+upcast * weights, -1) / n)"], report
        got, want = xkern.jit(jax.value_and_grad(f))(logits, labels, third), jax.jit(jax.value_and_grad(f))(
            logits, labels, third)
        assert np.isfinite(float(got[0]))
        close(got[0], want[0], jnp.float32)
        close(got[1], want[1], jnp.bfloat16)
    # kept by `where`: jnp.mean(rows, axis=-1, where=keep), or padding labelled out of range, whose
    # rows' losses are NaN (take_along_axis's fill) and dropped: where_masked_sum, finite as in jax.jit
    ignored = labels.at[0, 3].set(-1000).at[2, 1].set(-1000)
    kept_cases = {"mean(sum(where(mask, optax_integer_labels+upcast, 0), -1) / n)": (
                 lambda x, y, m: jnp.mean(jnp.mean(up(x, y), axis=-1, where=m)), labels, jnp.asarray(keep)),
             "sum(sum(where(mask, optax_integer_labels+upcast, 0), -1) / n) * c": (
                 lambda x, y, m: 0.25 * jnp.sum(jnp.sum(jnp.where(y != -1000, up(x, y), 0.0), -1)
                                                / jnp.maximum(jnp.sum(y != -1000, -1), 1)), ignored, None)}
    for pattern, (f, y, m) in kept_cases.items():
        report = xkern.explain(f)(logits, y, m)
        assert [m.pattern for m in report.matches if m.pattern.startswith("cross")] == [f"cross_entropy/{pattern}"], report
        got, want = xkern.jit(jax.value_and_grad(f))(logits, y, m), jax.jit(jax.value_and_grad(f))(logits, y, m)
        assert np.isfinite(float(got[0])) and np.isfinite(np.asarray(got[1])).all()
        close(got[0], want[0], jnp.float32)
        close(got[1], want[1], jnp.bfloat16)
        grad_jaxpr = jax.make_jaxpr(jax.grad(xkern.optimize(f)))(logits, y, m)
        assert [k for k in kernel_names(grad_jaxpr) if k.startswith("cross")] == ["cross_entropy_fwd"], pattern
    # near misses: the mask's sum over every row (a masked mean per token, its own pattern), a sum
    # over another axis, a mask of another shape: not this pattern
    mask = jnp.asarray(keep, jnp.float32)
    misses = {"over the batch's rows": lambda x, y, m: jnp.mean(jnp.sum(up(x, y) * m, -1) / jnp.sum(m)),
              "over the other axis": lambda x, y, m: jnp.mean(jnp.sum(up(x, y) * m, 0) / jnp.sum(m, 0)),
              "a mask per position": lambda x, y, m: jnp.mean(per_example(up(x, y), m[0]))}
    for name, f in misses.items():
        report = xkern.explain(f)(logits, labels, mask)
        assert not any("-1) / n)" in m.pattern for m in report.matches), (name, report)
        close(xkern.jit(f)(logits, labels, mask), jax.jit(f)(logits, labels, mask), jnp.float32)
    # nothing to reduce: left to XLA, and a mean of nothing is NaN in both
    f = cases["float mask, mean"][0]
    for shape in ((0, 7, 300), (3, 0, 300)):
        x, y, m = jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape[:-1], jnp.int32), jnp.ones(shape[:-1])
        report = xkern.explain(f)(x, y, m)
        assert not any("-1) / n)" in m.pattern for m in report.matches), report
        assert np.isnan(float(xkern.jit(f)(x, y, m))) and np.isnan(float(jax.jit(f)(x, y, m)))


def test_maxtext_custom_vjp_loss_is_reduced():
    """MaxText's loss: t5x's custom_vjp cross_entropy_with_logits of one-hot targets (its z-loss
    output dropped), times the segmentation's padding mask, over the mask's count + EPS. The
    custom_vjp of a known library, whose rule is its body's gradient, is inlined and the whole loss
    reduced in one kernel; values and gradients as jax.jit's (there the library's own rule). The
    same function from another module, or with its z-loss output used (t5x's metrics), keeps its
    rule: no kernel takes it, and the values are jax.jit's."""
    logits, labels = make((2, 5, 300), jnp.float32, seed=24)
    segmentation = jnp.asarray(np.random.default_rng(14).integers(0, 3, labels.shape), jnp.int32).at[:, 0].set(1)

    def maxtext_loss(ce):
        def loss(x, y, segmentation):
            xent, _ = ce(x, jax.nn.one_hot(y, x.shape[-1]), 1e-4)
            xent = xent * (segmentation != 0)
            return jnp.sum(xent) / (jnp.sum(segmentation != 0) + 1e-8)
        return loss
    f = maxtext_loss(cross_entropy_with_logits("MaxText.max_utils"))
    report = xkern.explain(f)(logits, labels, segmentation)
    assert [m.pattern for m in report.matches if m.pattern.startswith("cross")] == [
        "cross_entropy/sum(one_hot*(x-logsumexp)+z*logsumexp^2 * weights) / d"], report
    close(xkern.jit(f)(logits, labels, segmentation), jax.jit(f)(logits, labels, segmentation), jnp.float32)
    close(jax.jit(jax.grad(xkern.optimize(f)))(logits, labels, segmentation),
          jax.jit(jax.grad(f))(logits, labels, segmentation), jnp.float32)
    grad_jaxpr = jax.make_jaxpr(jax.grad(xkern.optimize(f)))(logits, labels, segmentation)
    assert kernel_names(grad_jaxpr) == ["cross_entropy_fwd"] and not dx_scales(grad_jaxpr, logits.size)
    assert "custom_vjp_call" not in str(canonicalize(jax.make_jaxpr(f)(logits, labels, segmentation)))
    # its z-loss output masked and summed but never returned (dead): the same one kernel
    def dead_z(x, y, segmentation):
        xent, z = cross_entropy_with_logits("MaxText.max_utils")(x, jax.nn.one_hot(y, x.shape[-1]), 1e-4)
        jnp.sum(z * (segmentation != 0))
        return jnp.sum(xent * (segmentation != 0)) / (jnp.sum(segmentation != 0) + 1e-8)
    assert kernel_names(jax.make_jaxpr(jax.grad(xkern.optimize(dead_z)))(logits, labels, segmentation)) == [
        "cross_entropy_fwd"]
    close(jax.jit(jax.grad(xkern.optimize(dead_z)))(logits, labels, segmentation),
          jax.jit(jax.grad(dead_z))(logits, labels, segmentation), jnp.float32)

    # with the LM head (MaxText's logits einsum): linear_cross_entropy, as jax.jit's
    h = jnp.asarray(np.random.default_rng(15).standard_normal((2, 5, 16)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(16).standard_normal((16, 300)) / 4, jnp.float32)
    head = lambda h, w, y, segmentation: f(jnp.einsum("btd,dv->btv", h, w), y, segmentation)
    report = xkern.explain(head)(h, w, labels, segmentation)
    assert [m.pattern for m in report.matches if "cross" in m.pattern] == [
        "linear_cross_entropy/sum(one_hot_log_probabilities_z_loss(jnp_matmul) * weights) / d"], report
    grads = lambda g: jax.jit(jax.value_and_grad(g, (0, 1)))(h, w, labels, segmentation)
    (got, got_grads), (want, want_grads) = grads(xkern.optimize(head)), grads(head)
    close(got, want, jnp.float32)
    for g, r in zip(got_grads, want_grads):
        close(g, r, jnp.float32)
    # (t5x's rule takes each target row to sum to 1: for a label out of range, one_hot's row of
    # zeros, its gradient has the row's softmax (times the row's weight) more than the body's,
    # xkern's; the loss is the same)
    out_of_range = labels.at[0, 0].set(300)
    got = jax.grad(xkern.optimize(f))(logits, out_of_range, segmentation)
    want = jax.grad(f)(logits, out_of_range, segmentation)
    weight = 1 / (float(jnp.sum(segmentation != 0)) + 1e-8)
    close(want[0, 0] - got[0, 0], jax.nn.softmax(logits[0, 0]) * weight, jnp.float32)
    close(got[1:], want[1:], jnp.float32)

    # the same function from another module keeps its rule: no kernel takes it
    f, args = maxtext_loss(cross_entropy_with_logits("my_project.losses_v2")), (logits, labels, segmentation)
    assert not any(m.pattern.startswith("cross") for m in xkern.explain(f)(*args).matches)
    assert "custom_vjp_call" in str(canonicalize(jax.make_jaxpr(f)(*args)))  # (its rule kept)
    close(xkern.jit(f)(*args), jax.jit(f)(*args), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_maxtext_and_t5x_z_loss_metrics_come_from_the_kernels_logsumexp(dtype):
    """MaxText's train step returns the z-loss (its custom_vjp's second output, masked and summed) and
    the summed loss in aux; t5x's metrics read the z-loss too. The loss over the count takes the
    kernel, which gives the rows' logsumexp and the loss's sum (Pattern.provides): the z-loss terms
    are computed from it after the kernel, and the count's 1 / n stays in the forward's dx.
    Values, aux and gradients as jax.jit's; where the z-loss output is added to the loss, its
    gradient is none, as the libraries' rules ignore its cotangent (the kernels' logsumexp gradient
    is test_rows_logsumexp_comes_out_of_the_same_pass_with_its_gradient's). Where the loss's weights
    are computed from the z-loss, the kernel would need its own output first: declined, said so."""
    logits, labels = make((2, 5, 300), dtype, seed=31)
    logits = logits.at[0, 1, 7].set(60.0)  # (a row whose logsumexp is far from 0)
    segmentation = jnp.asarray(np.random.default_rng(17).integers(0, 3, labels.shape), jnp.int32).at[:, 0].set(1)
    args = (logits, labels, segmentation)
    report = xkern.explain(maxtext_train_loss)(*args)
    assert [m.pattern for m in report.matches if m.pattern.startswith("cross")] == [
        "cross_entropy/sum(one_hot*(x-logsumexp)+z*logsumexp^2 * weights) / d + its logsumexp and its sum"], report
    step = lambda f: jax.jit(jax.value_and_grad(f, has_aux=True))(*args)
    ((got, got_aux), got_grad), ((want, want_aux), want_grad) = step(xkern.optimize(maxtext_train_loss)), step(
        maxtext_train_loss)
    tol = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
    close(got, want, tol)
    for name in want_aux:
        close(got_aux[name], want_aux[name], tol)
    close(got_grad, want_grad, tol)
    grad_jaxpr = jax.make_jaxpr(jax.grad(xkern.optimize(maxtext_train_loss), has_aux=True))(*args)
    assert kernel_names(grad_jaxpr) == ["cross_entropy_fwd"]  # (the aux's values: no backward pass)
    assert not dx_scales(grad_jaxpr, logits.size)  # (1 / the count is in the forward's dx)

    # with the LM head (MaxText's logits einsum): linear_cross_entropy gives them, as jax.jit's
    h = jnp.asarray(np.random.default_rng(18).standard_normal((2, 5, 16)), dtype)
    w = jnp.asarray(np.random.default_rng(19).standard_normal((16, 300)) / 2, dtype)
    head = lambda h, w, y, segmentation: maxtext_train_loss(jnp.einsum("btd,dv->btv", h, w), y, segmentation)
    report = xkern.explain(head)(h, w, labels, segmentation)
    assert [m.pattern for m in report.matches if "cross" in m.pattern] == [
        "linear_cross_entropy/sum(one_hot_log_probabilities_z_loss(jnp_matmul) * weights) / d + its logsumexp "
        "and its sum"], report
    step = lambda f: jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(h, w, labels, segmentation)
    ((got, got_aux), got_grads), ((want, want_aux), want_grads) = step(xkern.optimize(head)), step(head)
    close(got, want, tol)
    for name in want_aux:
        close(got_aux[name], want_aux[name], tol)
    for g, r in zip(got_grads, want_grads):
        close(g, r, tol)

    def t5x_metrics(x, y):  # the mean loss and z-loss; then the z-loss added to the loss
        loss, z_loss = cross_entropy_with_logits("t5x.losses")(x, jax.nn.one_hot(y, x.shape[-1]), 1e-2)
        return jnp.mean(loss), jnp.mean(z_loss)
    with_z = lambda x, y: (lambda loss, z: loss + 3 * z)(*t5x_metrics(x, y))
    for f in (t5x_metrics, with_z):
        assert any(m.pattern.endswith("+ its logsumexp") for m in xkern.explain(f)(logits, labels).matches)
        for got, want in zip(jax.tree.leaves(xkern.jit(f)(logits, labels)), jax.tree.leaves(jax.jit(f)(logits, labels))):
            close(got, want, tol)
    close(jax.jit(jax.grad(xkern.optimize(with_z)))(logits, labels), jax.jit(jax.grad(with_z))(logits, labels), tol)

    def weighted_by_z(x, y):  # the weights read the z-loss: the kernel cannot give it first
        xent, z_loss = cross_entropy_with_logits("MaxText.max_utils")(x, jax.nn.one_hot(y, x.shape[-1]), 1e-4)
        return jnp.sum(xent * jax.lax.stop_gradient(z_loss))
    report = xkern.explain(weighted_by_z)(logits, labels)
    assert not any(m.pattern.startswith("cross_entropy/sum") for m in report.matches), report
    assert any("computed from its logsumexp, which" in d.reason for d in report.declined), report
    close(xkern.jit(weighted_by_z)(logits, labels), jax.jit(weighted_by_z)(logits, labels), tol)


def test_losses_shifted_by_a_scalar_are_reduced():
    """Every row's loss minus a scalar, then masked and reduced, `(loss - c) * weights` (Flax's WMT
    and lm1b examples: c the smoothed targets' entropy, computed in the program; or a scalar given):
    the reduction with c's share subtracted after, its gradient from the forward, final. Integer
    labels, one-hot targets smoothed by optax, masked or not, a mean, over the weights' sum or a
    count; values and gradients (logits, mask, c) as jax.jit's. A shift per row is not a scalar:
    the row loss only."""
    import optax
    logits, labels = make((2, 5, 300), jnp.bfloat16, seed=21)
    mask = jnp.asarray(np.random.default_rng(11).integers(0, 2, labels.shape), jnp.float32)
    c = jnp.float32(0.37)
    up = lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), y)
    smoothed = lambda x, y: optax.softmax_cross_entropy(x, optax.smooth_labels(jax.nn.one_hot(y, x.shape[-1]), 0.1))
    entropy = lambda v, e=0.1: -((1 - e) * jnp.log(1 - e) + (v - 1) * e / (v - 1) * jnp.log(e / (v - 1)))
    cases = {"wmt, over the weights' sum": (lambda x, y, m, c: jnp.sum((smoothed(x, y) - entropy(x.shape[-1])) * m)
                                            / jnp.sum(m), "sum((smooth_labels(one_hot)*log_softmax - c) * weights) / d"),
             "mean, c given": (lambda x, y, m, c: jnp.mean(up(x, y) - c), "mean((optax_integer_labels+upcast - c))"),
             "masked sum / 8": (lambda x, y, m, c: jnp.sum((up(x, y) - c) * m) / 8.0,
                                "sum((optax_integer_labels+upcast - c) * weights) / c")}
    for name, (f, pattern) in cases.items():
        report = xkern.explain(f)(logits, labels, mask, c)
        found = [m.pattern for m in report.matches if m.pattern.startswith("cross")]
        assert found == [f"cross_entropy/{pattern}"], (name, found)
        close(xkern.jit(f)(logits, labels, mask, c), jax.jit(f)(logits, labels, mask, c), jnp.bfloat16)
        grads = lambda g, x: jax.jit(jax.grad(g, (0, 2, 3)))(x, labels, mask, c)
        for got, want in zip(grads(xkern.optimize(f), logits), grads(f, logits.astype(jnp.float32))):
            close(got, want, jnp.bfloat16)
        grad_jaxpr = jax.make_jaxpr(jax.grad(xkern.optimize(f)))(logits, labels, mask, c)
        assert [k for k in kernel_names(grad_jaxpr) if k.startswith("cross")] == ["cross_entropy_fwd"], name
        assert not dx_scales(grad_jaxpr, logits.size), name
    per_row = lambda x, y, m, c: jnp.sum((up(x, y) - c * m) * m)
    report = xkern.explain(per_row)(logits, labels, mask, c)
    found = [m.pattern for m in report.matches if m.pattern.startswith("cross")]
    assert found == ["cross_entropy/optax_integer_labels+upcast"], found
    close(xkern.jit(per_row)(logits, labels, mask, c), jax.jit(per_row)(logits, labels, mask, c), jnp.float32)


def test_losses_masked_by_where_as_jax_jit_nan_rows_included():
    """where(labels != -100, rows, 0) summed (HF's padding, over the count) or averaged, and a
    mask of its own: where_masked_sum, the gradient from the forward, the scales folded into it. A masked row holding NaN adds
    0 to the loss, and its gradient is jax.jit's: NaN where the softmax is (0 * NaN), else 0."""
    import optax
    logits, labels = make((2, 5, 300), jnp.bfloat16, seed=13)
    labels = labels.at[0, 1].set(-100).at[1, 3].set(-100)
    logits = logits.at[0, 1, 7].set(jnp.nan)  # in a masked row
    up = lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), y)
    cases = {"HF's -100": (lambda x, y: jnp.sum(jnp.where(y != -100, up(x, y), 0.0)) / jnp.sum(y != -100),
                           "sum(where(mask, optax_integer_labels+upcast, 0)) / d"),
             "mean, an int 0": (lambda x, y: jnp.mean(jnp.where(y != -100, up(x, y), 0)),
                                "mean(where(mask, optax_integer_labels+upcast, 0))"),
             "bf16 rows": (lambda x, y: jnp.sum(jnp.where(
                 y >= 0, optax.softmax_cross_entropy_with_integer_labels(x, y), 0.0)),
                 "sum(where(mask, optax_integer_labels, 0))")}
    for name, (f, pattern) in cases.items():
        report = xkern.explain(f)(logits, labels)
        assert [m.pattern for m in report.matches if m.pattern.startswith("cross")] == [f"cross_entropy/{pattern}"], name
        got, want = xkern.jit(f)(logits, labels), jax.jit(f)(logits, labels)
        assert np.isfinite(np.float32(got)), name
        close(got, want, jnp.bfloat16)
        dgot = np.asarray(jax.grad(xkern.optimize(f))(logits, labels), np.float32)
        dwant = np.asarray(jax.grad(f)(logits, labels), np.float32)
        np.testing.assert_array_equal(np.isnan(dgot), np.isnan(dwant))
        assert np.isnan(dgot[0, 1]).any() and not np.isnan(dgot[1]).any(), name
        np.testing.assert_allclose(np.nan_to_num(dgot), np.nan_to_num(dwant), rtol=1e-2, atol=2e-3)  # (bf16)
        grad_jaxpr = jax.make_jaxpr(jax.grad(xkern.optimize(f)))(logits, labels)
        assert "cross_entropy_bwd" not in kernel_names(grad_jaxpr), name
        assert not dx_scales(grad_jaxpr, logits.size), name


def test_masks_converted_from_bool_and_all_rows_masked_as_jax_jit():
    """loss * mask.astype(float): XLA simplifies it to select(mask, loss, 0), so under jax.jit a row
    of weight 0 adds 0 even where its loss is NaN (HF's -100 label, gathered out of range as NaN;
    -inf logits in a one-hot row, 0 * inf). A float mask given as data keeps NaN * 0 = NaN, as
    jax.jit does. Every row masked, over the mask's sum: 0 / 0 is NaN."""
    import optax
    logits, labels = make((2, 5, 37), jnp.float32, seed=17)
    labels = labels.at[0, 1].set(-100).at[1, 3].set(-100)
    logits = logits.at[1, 3, 4].set(-jnp.inf)  # a masked one-hot row's 0 * inf
    ints = optax.softmax_cross_entropy_with_integer_labels
    one_hot = lambda x, y: optax.softmax_cross_entropy(x, jax.nn.one_hot(y, 37))
    as_float = lambda y: (y != -100).astype(jnp.float32)
    per_sequence = lambda rows, m: jnp.sum(rows * m, -1) / jnp.sum(m, -1)
    cases = {  # (program, labels, pattern, whether jax.jit's value is NaN)
        "ints, bool mask over its sum": (lambda x, y: jnp.sum(ints(x, y) * as_float(y)) / jnp.sum(as_float(y)),
                                         labels, "sum(optax_integer_labels * weights) / d", False),
        "ints, bool mask, mean": (lambda x, y: jnp.mean(ints(x, y) * as_float(y)), labels,
                                  "mean(optax_integer_labels * weights)", False),
        "one-hot, bool mask over its sum": (lambda x, y: jnp.sum(one_hot(x, y) * as_float(y)) / jnp.sum(as_float(y)),
                                            labels, "sum(one_hot*log_softmax * weights) / d", False),
        "ints, a float mask as data": (lambda x, y, m=as_float(labels): jnp.sum(ints(x, y) * m) / jnp.sum(m), labels,
                                       "sum(optax_integer_labels * weights) / d", True),
        "every row masked, mean(where=)": (lambda x, y: jnp.mean(ints(x, y), where=y < 0), labels % 37,
                                           "sum(where(mask, optax_integer_labels, 0)) / d", True),
        "every row masked, bool mask": (lambda x, y: jnp.sum(ints(x, y) * (y < 0).astype(jnp.float32)) / jnp.sum(y < 0),
                                        labels % 37, "sum(optax_integer_labels * weights) / d", True),
        "per sequence, bool mask": (lambda x, y: jnp.mean(per_sequence(ints(x, y), as_float(y))), labels,
                                    "mean(sum(optax_integer_labels * weights, -1) / n)", False),
        "per sequence, one all masked": (lambda x, y: jnp.mean(per_sequence(ints(x, y), as_float(y))),
                                         labels.at[1].set(-100), "mean(sum(optax_integer_labels * weights, -1) / n)",
                                         True),  # (0 / 0; its rows' gradients 0, the select's)
    }
    for name, (f, y, pattern, nan) in cases.items():
        report = xkern.explain(f)(logits, y)
        assert [m.pattern for m in report.matches if m.pattern.startswith("cross")] == [f"cross_entropy/{pattern}"], \
            (name, report)
        got, want = xkern.jit(f)(logits, y), jax.jit(f)(logits, y)
        assert np.isnan(np.float32(want)) == nan, name  # (the case is what it says)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=name)  # (NaN only where jax.jit's is)
        dgot, dwant = jax.jit(jax.grad(xkern.optimize(f)))(logits, y), jax.jit(jax.grad(f))(logits, y)
        np.testing.assert_allclose(dgot, dwant, rtol=1e-5, atol=1e-6, err_msg=name)
    for dtype in (jnp.float16, jnp.bfloat16):  # a 16-bit product: a select where XLA makes one
        f = lambda x, y: jnp.sum(ints(x, y) * (y != -100).astype(dtype)) / jnp.sum(y != -100)
        x16 = logits.astype(dtype)
        report = xkern.explain(f)(x16, labels)
        assert [m.pattern for m in report.matches if m.pattern.startswith("cross")], (dtype, report)
        got, want = np.float32(xkern.jit(f)(x16, labels)), np.float32(jax.jit(f)(x16, labels))
        assert np.isnan(want) != xla_selects_bool_product((np.dtype(dtype).name,)), dtype
        np.testing.assert_allclose(got, want, rtol=1e-2, err_msg=str(dtype))
        dgot = np.float32(jax.jit(jax.grad(xkern.optimize(f)))(x16, labels))
        np.testing.assert_allclose(dgot, np.float32(jax.jit(jax.grad(f))(x16, labels)), rtol=2e-2, atol=1e-3)


def test_near_misses_are_not_rewritten():
    logits, labels = make((4, 9), jnp.float32, seed=6)
    near_misses = {
        # the logsumexp over rows while the label picks within a row
        "other axis": lambda x, y: jax.nn.logsumexp(x, 0)[:4] - jnp.take_along_axis(x, y[:, None], -1)[:, 0],
        # the picked logit from a different array than the normalizer's
        "other array": lambda x, y: jax.nn.logsumexp(x, -1) - jnp.take_along_axis(x * 2, y[:, None], -1)[:, 0],
        # soft labels of mass 1.1: not a smoothed one-hot (that is (1 - e) * one_hot + e / V)
        "soft labels": lambda x, y: -jnp.sum((jax.nn.one_hot(y, 9) * 0.9 + 0.2 / 9) * jax.nn.log_softmax(x), -1),
        # a one-hot of another width than the logits' (broadcast against them)
        "one-hot of one class": lambda x, y: -jnp.sum(jax.nn.one_hot(y, 1) * jax.nn.log_softmax(x), -1),
    }
    for name, f in near_misses.items():
        report = xkern.explain(f)(logits, labels)
        assert not [m for m in report.matches if m.pattern.startswith("cross_entropy")], name
        close(xkern.jit(f)(logits, labels), jax.jit(f)(logits, labels), jnp.float32)
    # A z-loss of another array's logsumexp: the loss alone is fused, the z term left to XLA; of a
    # negative weight: declined, saying why, and the loss without it fused, giving its logsumexp to
    # the z term (Pattern.provides)
    lse = lambda x: jax.nn.logsumexp(x, -1)
    picked = lambda x, y: jnp.take_along_axis(x, y[:, None], -1)[:, 0]
    z_misses = {"other array's z": lambda x, y: lse(x) - picked(x, y) + 0.1 * lse(2 * x) ** 2,
                "negative weight": lambda x, y: (lambda s: s - picked(x, y) + -0.1 * s ** 2)(lse(x))}
    for name, f in z_misses.items():
        report = xkern.explain(f)(logits, labels)
        fused = [m.pattern for m in report.matches if "cross_entropy" in m.pattern]
        if name == "other array's z":
            assert fused == ["cross_entropy/logsumexp-take_along_axis"], report
        else:
            assert fused == ["cross_entropy/logsumexp-take_along_axis + its logsumexp"], report
            assert "z-loss weight -0.1" in str(report), report
        close(xkern.jit(f)(logits, labels), jax.jit(f)(logits, labels), jnp.float32)


def test_shared_memory_kernel_takes_the_rows_where_it_wins():
    """cross_entropy_hopper's kernel (Hopper): 16-bit problems (integer labels or one-hot targets)
    whose dx the forward writes, rows of 3 chunks of 8192 or more (past 16, overflowing through the
    ring), a multiple of 8 wide; nothing else."""
    from xkern.kernels import cross_entropy_hopper as hopper
    consts = ce._consts(128256, None, 0.1, 1e-4, write_dx=True)
    assert hopper.applies(128256, 2, consts) and hopper.applies(32000, 2, consts)
    assert hopper.applies(3 * 8192, 2, consts) and hopper.applies(152920, 2, consts)
    assert not hopper.applies(3 * 8192 - 8, 2, consts) and not hopper.applies(16384, 2, consts)
    assert hopper.applies(256000, 2, consts) and hopper.applies(1 << 20, 2, consts)
    assert not hopper.applies(128257, 2, consts)  # (rows 2 bytes past a multiple of 16: no TMA)
    assert not hopper.applies(128256, 4, consts)  # float32
    assert not hopper.applies(128256, 2, {**consts, "WRITE_DX": False})  # reduction "none"
    assert hopper.applies(128256, 2, {**consts, "ONE_HOT": True})  # one-hot targets, their loss reduced
    assert hopper.config(128256)["N_CHUNKS"] == 14 and hopper.config(50304)["N_CHUNKS"] == 6


def _gluon_launches(monkeypatch):
    """A list that records each launch of cross_entropy_hopper's kernel (at trace time), which here
    also takes rows of 1 and 2 chunks (small problems)."""
    from xkern.kernels import cross_entropy_hopper
    monkeypatch.setattr(cross_entropy_hopper, "MIN_COLS", cross_entropy_hopper.CHUNK.value)
    launches, launch = [], cross_entropy_hopper.launch_fwd
    monkeypatch.setattr(cross_entropy_hopper, "launch_fwd", lambda x2, *a, **k: launches.append(x2.shape)
                        or launch(x2, *a, **k))
    return launches


@pytest.mark.skipif(not L.hopper(), reason="needs a Hopper GPU (TMA); the interpreter cannot run Gluon")
@pytest.mark.parametrize("shape,options,dtype", [((300, 8192), "plain", jnp.bfloat16),
                                                 ((133, 8200), "all", jnp.bfloat16),
                                                 ((2, 70, 50000), "ignore", jnp.float16),
                                                 ((140, 128256), "all", jnp.bfloat16),
                                                 ((40, 139368), "all", jnp.bfloat16),
                                                 ((140, 256000), "all", jnp.bfloat16)],
                         ids=["one chunk, rows past the SMs", "a tail of 8", "3-D, 6 chunks and a tail",
                              "14 chunks and a tail of 2 blocks, two rows a program",
                              "3 chunks overflowing through the ring, a tail of 104",
                              "17 chunks overflowing, a tail of 2048 (Gemma's rows), two rows a program"])
def test_shared_memory_kernel_on_hopper(shape, options, dtype, monkeypatch):
    """cross_entropy_hopper (rows kept in shared memory): loss and gradient against the float32
    reference for both reductions that write dx in the forward."""
    launches = _gluon_launches(monkeypatch)
    kw = OPTIONS[options]
    logits, labels = make(shape, dtype, seed=5, ignore=kw.get("ignore_index"))
    for reduction in ("mean", "sum"):
        f = lambda impl: jax.jit(jax.value_and_grad(lambda x: impl(x, labels, reduction=reduction, **kw) * 1.5))
        (got, dgot), (want, dwant) = f(xkern.ops.cross_entropy)(logits), f(ce.reference)(logits.astype(jnp.float32))
        close(got, want, jnp.float16)
        assert dgot.dtype == dtype
        close(dgot, dwant, dtype)
    # row weights (a padding mask with zeros, and fractions): each row's dx scaled in the kernel
    weights = jnp.asarray(np.random.default_rng(6).choice([0.0, 0.5, 1.0], labels.shape), jnp.float32)
    f = lambda impl: jax.jit(jax.value_and_grad(lambda x: impl(x, weights)))
    ours = lambda x, w: xkern.ops.cross_entropy(x, labels, reduction="sum", weights=w, **kw)
    ref = lambda x, w: jnp.sum(ce.reference(x, labels, reduction="none", **kw) * w)
    (got, dgot), (want, dwant) = f(ours)(logits), f(ref)(logits.astype(jnp.float32))
    close(got, want, jnp.float16)
    close(dgot, dwant, dtype)
    assert len(launches) == 3  # the kernel ran, once per reduction and once weighted


@pytest.mark.skipif(not L.hopper(), reason="needs a Hopper GPU (TMA); the interpreter cannot run Gluon")
def test_shared_memory_kernel_edge_rows_on_hopper(monkeypatch):
    """Rows of 20000 (2 chunks in shared memory and a tail): -inf, +inf, NaN, 1e30 and -1e4 placed in
    the chunks and in the tail, as XLA gives them (NaN where it gives NaN), with every option."""
    launches = _gluon_launches(monkeypatch)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((10, 20000)).astype(np.float32)
    x[1, 5] = x[2, 19000] = -np.inf          # a -inf logit, in a chunk and in the tail
    x[3] = -np.inf                           # every logit -inf
    x[4, 9000] = np.inf                      # +inf in the second chunk
    x[5, 19999] = np.inf                     # +inf, last of the tail
    x[6, 17000] = np.nan                     # NaN in the tail
    x[7, 0], x[7, 18000] = 1e30, -1e30       # far apart
    x[8] += -1e4                             # large, all negative
    x[9, 16384] = 30.0                       # the max, first of the tail
    x = jnp.asarray(x, jnp.bfloat16)
    labels = jnp.asarray([3, 5, 19000, 0, 9000, 7, 17000, 0, 12, 16384], jnp.int32)
    for kw in ({}, {"label_smoothing": 0.3, "z_loss": 1e-3, "ignore_index": 3}):  # (row 0 ignored)
        f = lambda impl: jax.jit(jax.value_and_grad(lambda a, y: impl(a, y, reduction="sum", **kw)))
        for rows in (slice(None), np.array([0, 1, 2, 7, 8, 9])):  # all rows (NaN sum), the finite ones
            (got, dgot) = f(xkern.ops.cross_entropy)(x[rows], labels[rows])
            (want, dwant) = f(ce.reference)(x[rows].astype(jnp.float32), labels[rows])
            np.testing.assert_allclose(got, want, rtol=2e-3)
            dgot, dwant = np.asarray(dgot, np.float32), np.asarray(dwant, np.float32)
            np.testing.assert_array_equal(np.isnan(dgot), np.isnan(dwant))
            np.testing.assert_allclose(dgot, dwant, rtol=1e-2, atol=1e-2)  # (bf16 dx: 2^-8 relative)
        per_row = jax.jit(lambda a: xkern.ops.cross_entropy(a, labels, reduction="none", **kw))(x)
        want_rows = ce.reference(x.astype(jnp.float32), labels, reduction="none", **kw)
        np.testing.assert_array_equal(np.isnan(per_row), np.isnan(want_rows))
    assert len(launches) == 4


@pytest.mark.skipif(not L.hopper(), reason="needs a Hopper GPU (TMA); the interpreter cannot run Gluon")
@pytest.mark.parametrize("smoothing,z", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-3), (0.1, 1e-3)])
def test_shared_memory_kernel_one_hot_edge_rows_on_hopper(smoothing, z, monkeypatch):
    """One-hot targets (one_hot_cross_entropy with weights, what a one-hot loss's mean or masked sum
    becomes), rows of 20000: each row's loss alone, and the gradient of them all, as the program's:
    a -inf logit at the label alone (loss +inf), beside it (NaN unsmoothed), in the tail, labels out
    of range (a row of zeros), +inf and NaN."""
    launches = _gluon_launches(monkeypatch)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((12, 20000)).astype(np.float32)
    x[1, 5] = -np.inf                        # at the label alone
    x[2, 19000] = -np.inf                    # in the tail, beside the label
    x[3] = -np.inf                           # every logit
    x[4, 9000] = np.inf                      # +inf in the second chunk
    x[6, 17000] = np.nan                     # NaN in the tail
    x[7, 0], x[7, 18000] = 1e30, -1e30       # far apart
    x[8] += -1e4                             # large, all negative
    x[9, 100] = -np.inf                      # beside a label out of range
    x[10, 7] = x[10, 15000] = -np.inf        # at the label and in the tail
    x[11, 16384] = 30.0                      # the max, first of the tail
    x = jnp.asarray(x, jnp.bfloat16)
    y = jnp.asarray([3, 5, 10, 0, 9000, 20000, 17000, 0, 12, -1, 7, 16384], jnp.int32)
    w = jnp.asarray(rng.uniform(0.5, 1.0, 12), jnp.float32)
    kernel = lambda a, y, w: ce.one_hot_cross_entropy(a, y, label_smoothing=smoothing, z_loss=z, weights=w)
    z_term = lambda a: z * jnp.square(jax.nn.logsumexp(a.astype(jnp.float32), -1)) if z else 0.0  # (0 * 1e60: NaN)
    program = lambda a, y, w: jnp.sum(w * (_smoothed_program(a, y, smoothing) + z_term(a)))
    one_row = jax.jit(jax.value_and_grad(kernel))  # (differentiated: the forward that writes dx, the kernel's)
    for i in range(12):
        got, want = one_row(x[i:i + 1], y[i:i + 1], w[i:i + 1])[0], program(x[i:i + 1], y[i:i + 1], w[i:i + 1])
        assert np.isnan(got) == np.isnan(want) and (np.isnan(got) or np.isclose(got, want, rtol=2e-3)), (i, got, want)
    dgot = np.asarray(jax.jit(jax.grad(kernel))(x, y, w), np.float32)
    dwant = np.asarray(jax.grad(program)(x.astype(jnp.float32), y, w), np.float32)
    np.testing.assert_array_equal(np.isnan(dgot), np.isnan(dwant))
    np.testing.assert_allclose(dgot, dwant, rtol=1e-2, atol=1e-2)  # (bf16 dx: 2^-8 relative)
    assert len(launches) == 2


def _as_jax_jit(f, args, argnums=0, rtol=1e-5, atol=1e-6):
    """xkern.jit(f)'s value and jax.grad's gradients are jax.jit's (NaN and inf where jax.jit's are)."""
    np.testing.assert_allclose(xkern.jit(f)(*args), jax.jit(f)(*args), rtol=rtol, atol=atol)
    grads = lambda g: jax.jit(jax.grad(g, argnums))(*args)
    for got, want in zip(jax.tree.leaves(grads(xkern.optimize(f))), jax.tree.leaves(grads(f))):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def _fused(f, *args):
    return [m.pattern for m in xkern.explain(f)(*args).matches if "cross_entropy" in m.pattern]


def test_one_hot_losses_with_neg_inf_beside_the_label_as_jax_jit():
    """A -inf logit outside the label's class (a vocabulary masked by -inf): where XLA computes
    one_hot * log_probabilities as a select (lowering.xla_selects_bool_product: on this platform, in
    the product's dtype), jax.jit's loss, and the mask's gradient, are finite; elsewhere 0 * inf is
    NaN. The kernels' are jax.jit's either way; a label out of range is a row of zeros."""
    import optax
    logits, labels = make((2, 3, 37), jnp.float32, seed=21)
    logits, labels = logits.at[..., 5].set(-jnp.inf), jnp.where(labels == 5, 6, labels).at[0, 0].set(40)
    mask = jnp.asarray(np.random.default_rng(3).integers(0, 2, labels.shape), jnp.float32)
    one_hot = lambda y, dtype=jnp.float32: jax.nn.one_hot(y, 37, dtype=dtype)
    cases = {  # (program, its pattern)
        "optax, mean": (lambda x, y, m: optax.softmax_cross_entropy(x, one_hot(y)).mean(), "mean(one_hot*log_softmax)"),
        "gemma, masked sum": (lambda x, y, m: jnp.sum(-jnp.sum(one_hot(y) * jax.nn.log_softmax(x), -1) * m),
                              "sum(one_hot*log_softmax * weights)"),
        "rows": (lambda x, y, m: jnp.sum(jnp.tanh(optax.softmax_cross_entropy(x, one_hot(y)))), "one_hot*log_softmax"),
        "written out, z-loss": (lambda x, y, m: jnp.mean((lambda log_z: -jnp.sum(one_hot(y) * (x - log_z), -1) + 1e-3 * (
            jnp.square(jnp.squeeze(log_z, -1))))(jax.nn.logsumexp(x, -1, keepdims=True))),
                                "mean(one_hot*(x-logsumexp)+z*logsumexp^2)"),
    }
    for name, (f, pattern) in cases.items():
        assert _fused(f, logits, labels, mask) == [f"cross_entropy/{pattern}"], name
        assert np.isfinite(jax.jit(f)(logits, labels, mask)) == xla_selects_bool_product(("float32",)), name
        _as_jax_jit(f, (logits, labels, mask), (0, 2))
    for dtype in (jnp.float16, jnp.bfloat16):  # a 16-bit product: a select where XLA makes one
        f = lambda x, y: optax.softmax_cross_entropy(x, one_hot(y, x.dtype)).mean()
        x16 = logits.astype(dtype)
        assert _fused(f, x16, labels) == ["cross_entropy/mean(one_hot(dtype=logits')*log_softmax)"], dtype
        assert np.isnan(np.float32(jax.jit(f)(x16, labels))) != xla_selects_bool_product((np.dtype(dtype).name,))
        _as_jax_jit(f, (x16, labels), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [(1,), (3, 1), (2, 1, 1)], ids=str)
def test_integer_labels_whose_last_batch_axis_is_one_are_found(rows):
    """jnp.take_along_axis gathers differently where the labels' last batch axis has size 1 (one row;
    one token per example): found as the other shapes are, values and gradients as jax.jit's."""
    import optax
    logits, labels = make((*rows, 33), jnp.float32, seed=22)
    labels = labels.reshape(-1).at[0].set(-2).reshape(rows)  # (counted from the end)
    cases = {"mean(optax_integer_labels)": lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x, y).mean(),
             "logsumexp-take_along_axis": lambda x, y: jnp.sum(jnp.tanh(jax.nn.logsumexp(x, -1) - jnp.take_along_axis(
                 x, y[..., None], -1)[..., 0]))}
    for pattern, f in cases.items():
        assert _fused(f, logits, labels) == [f"cross_entropy/{pattern}"], pattern
        _as_jax_jit(f, (logits, labels))


def test_log_probabilities_written_out_negated_after_the_mean_are_found():
    """-mean of the label's log-probability, log_softmax written out (x - logsumexp(x, keepdims=True)),
    through take_along_axis or a one-hot target: the loss's mean, values and gradients as jax.jit's."""
    logits, labels = make((4, 5, 33), jnp.float32, seed=23)
    log_p = lambda x: x - jax.nn.logsumexp(x, -1, keepdims=True)
    cases = {"-mean(take_along_axis(x-logsumexp))":
             lambda x, y: -jnp.mean(jnp.take_along_axis(log_p(x), y[..., None], -1)[..., 0]),
             "-mean(sum_classes(one_hot*(x-logsumexp)))":
             lambda x, y: -jnp.mean(jnp.sum(jax.nn.one_hot(y, 33) * log_p(x), -1))}
    for pattern, f in cases.items():
        assert _fused(f, logits, labels) == [f"cross_entropy/{pattern}"], pattern
        _as_jax_jit(f, (logits, labels))


@pytest.mark.parametrize("dtype", [jnp.int16, jnp.uint8, jnp.uint32, jnp.int8], ids=lambda d: jnp.dtype(d).name)
def test_integer_labels_of_other_dtypes_are_found_as_jax_jit_reads_them(dtype):
    """Labels stored as int16 / uint8 / uint32 / int8: found, read as jax.jit's gather reads them
    (converted to int32; negative ones counted from the end, those out of range NaN)."""
    import optax
    f = lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x, y).mean()
    g = lambda x, y: jnp.sum(jnp.tanh(jax.nn.logsumexp(x, -1) - jnp.take_along_axis(x, y[..., None], -1)[..., 0]))
    logits, labels = make((2, 3, 33), jnp.float32, seed=24)
    labels = labels.astype(dtype)
    for pattern, h in (("mean(optax_integer_labels)", f), ("logsumexp-take_along_axis", g)):
        assert _fused(h, logits, labels) == [f"cross_entropy/{pattern}"], pattern
        _as_jax_jit(h, (logits, labels))
    info = np.iinfo(dtype)
    edge = labels.at[0, 0].set(info.max).at[1, 2].set(info.min).at[0, 1].set(min(info.max, 40))
    for h in (f, g):  # (out of range, or wrapped by jax.jit's convert to int32 as it is)
        _as_jax_jit(h, (logits, edge))
