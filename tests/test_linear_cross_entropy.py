"""xkern.ops.linear_cross_entropy against cross-entropy of the materialized float32 logits: losses and
h / w gradients for every reduction and option, chunks that do not divide the rows, edge values,
vmap, errors, and that no rows x vocabulary buffer appears in the gradient program."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xkern
from xkern.kernels import cross_entropy as ce
from xkern.kernels import launch as L
from xkern.kernels.launch import kernel_names
from xkern.kernels.linear_cross_entropy import (CHUNK_BYTES, default_chunk_rows, linear_cross_entropy,
                                                one_hot_linear_cross_entropy, reference)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 3e-3}
OPTIONS = {"plain": {}, "all": {"ignore_index": 2, "label_smoothing": 0.1, "z_loss": 1e-3}}


def make(rows_shape, d, v, dtype, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((*rows_shape, d)), dtype)
    w = jnp.asarray(rng.standard_normal((d, v)) / np.sqrt(d) * 3, dtype)
    labels = jnp.asarray(rng.integers(0, v, rows_shape), jnp.int32)
    return h, w, labels


def close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * max(np.abs(want).max(), 1.0))


def f32(*arrays):
    return [a.astype(jnp.float32) for a in arrays]


@pytest.mark.parametrize("reduction", ce.REDUCTIONS)
@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_loss_and_gradients(reduction, options, dtype):
    kw = {**OPTIONS[options], "reduction": reduction}
    h, w, labels = make((2, 5), 24, 37, dtype)  # 10 rows in chunks of 4: the last chunk is padded
    labels = labels.at[0, 0].set(2)
    ct = jnp.asarray(np.random.default_rng(1).uniform(0.5, 2, labels.shape), jnp.float32)

    def loss(f, h, w):
        out = f(h, w, labels, **kw)
        return jnp.sum(out * ct) if reduction == "none" else out * 1.5

    ours = lambda h, w, labels, **kw: linear_cross_entropy(h, w, labels, chunk_rows=4, **kw)
    got, want = ours(h, w, labels, **kw), reference(*f32(h, w), labels, **kw)
    assert got.dtype == jnp.float32
    close(got, want, dtype)
    grads = jax.grad(lambda h, w: loss(ours, h, w), (0, 1))(h, w)
    wants = jax.grad(lambda h, w: loss(reference, h, w), (0, 1))(*f32(h, w))
    for g, r, a in zip(grads, wants, (h, w)):
        assert g.dtype == a.dtype
        close(g, r, dtype)


def test_default_chunk_jit_and_public_name():
    h, w, labels = make((7,), 16, 1025, jnp.float32, seed=2)
    f = jax.jit(jax.value_and_grad(xkern.ops.linear_cross_entropy, (0, 1)))
    (value, grads), (want, wants) = f(h, w, labels), jax.value_and_grad(reference, (0, 1))(h, w, labels)
    close(value, want, jnp.float32)
    for g, r in zip(grads, wants):
        close(g, r, jnp.float32)


@pytest.mark.parametrize("n_cols,itemsize", [(128256, 2), (256000, 2), (151936, 2), (32000, 2), (128256, 4),
                                              (500000, 2), (10**7, 2)])
@pytest.mark.parametrize("n_rows", [1, 7, 128, 1000, 2048, 2049, 5000, 8192, 10000, 100003])
def test_default_chunks_bound_their_logits_and_pad_little(n_rows, n_cols, itemsize):
    chunk = default_chunk_rows(n_rows, n_cols, itemsize)
    n_chunks = -(-n_rows // chunk)
    assert 1 <= chunk <= n_rows and (chunk == n_rows or chunk % 128 == 0)
    assert chunk <= 128 or chunk * n_cols * itemsize <= 2 * CHUNK_BYTES
    assert n_chunks * chunk - n_rows < 128 * n_chunks  # each chunk pads less than one tile of rows
    power = 1 << (n_rows.bit_length() - 1)  # rows that are a power of two take chunks of one
    power_chunk = default_chunk_rows(power, n_cols, itemsize)
    assert power_chunk & (power_chunk - 1) == 0


@pytest.mark.parametrize("n_cols,rows", [(128256, 2048), (256000, 2048), (151936, 2048), (32000, 8192),
                                         (500000, 1024)])
def test_default_chunks_are_the_measured_sizes(n_cols, rows):
    """8192 bf16 rows: the sizes measured fastest within the memory bound (see CHUNK_BYTES)."""
    assert default_chunk_rows(8192, n_cols, 2) == rows


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_rows_by_vocabulary_buffer_in_the_gradient_program(reduction):
    """The point of the op: only chunk x V logits exist; the program has no [rows, V] value."""
    rows, v = 64, 300
    h, w, labels = make((rows,), 8, v, jnp.bfloat16, seed=3)
    loss = lambda h, w: jnp.sum(linear_cross_entropy(h, w, labels, reduction=reduction, chunk_rows=16))
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(h, w)
    shapes = set()

    def collect(j):
        for eqn in j.eqns:
            shapes.update(tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
            for p in eqn.params.values():
                for sub in (p if isinstance(p, tuple) else (p,)):
                    if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                        collect(getattr(sub, "jaxpr", sub))
    collect(jaxpr.jaxpr)
    assert (16, v) in shapes and not [s for s in shapes if s[-1:] == (v,) and int(np.prod(s[:-1])) > 16]
    assert kernel_names(jaxpr).count("cross_entropy_fwd") == 1


def test_edge_values_vmap_and_empty():
    h, w, labels = make((6,), 8, 11, jnp.float32, seed=4)
    bad = labels.at[1].set(11)  # out of range: NaN, as cross_entropy
    assert np.isnan(np.asarray(linear_cross_entropy(h, w, bad, reduction="none", chunk_rows=4)))[1]
    assert np.isnan(float(linear_cross_entropy(h, w, bad, chunk_rows=4)))
    hs = jnp.stack([h, -h, 2 * h])
    got = jax.vmap(lambda h: linear_cross_entropy(h, w, labels, chunk_rows=4))(hs)
    close(got, jax.vmap(lambda h: reference(h, w, labels))(hs), jnp.float32)
    gots = jax.vmap(jax.grad(lambda h: linear_cross_entropy(h, w, labels, chunk_rows=4)))(hs)
    close(gots, jax.vmap(jax.grad(lambda h: reference(h, w, labels)))(hs), jnp.float32)
    empty = linear_cross_entropy(h[:0], w, labels[:0], reduction="none")
    assert empty.shape == (0,)
    all_ignored = linear_cross_entropy(h, w, jnp.full((6,), -100), ignore_index=-100, chunk_rows=4)
    assert float(all_ignored) == 0.0


@pytest.mark.parametrize("reduction, dtype", [("mean", jnp.float32), ("sum", jnp.bfloat16), ("none", jnp.float32)],
                         ids=["mean-float32", "sum-bfloat16", "none-float32"])
def test_tied_embedding_table_is_read_transposed_in_place(reduction, dtype):
    """transpose_w: w [V, D], used as h @ w.T, gradient [V, D]; the program holds no transpose of it."""
    h, w, labels = make((3, 3), 16, 37, dtype, seed=5)
    table = w.T
    ct = jnp.asarray(np.random.default_rng(2).uniform(0.5, 2, labels.shape), jnp.float32)
    kw = {"reduction": reduction, "label_smoothing": 0.05}

    def loss(f, h, table, **more):
        out = f(h, table, labels, **kw, **more)
        return jnp.sum(out * ct) if reduction == "none" else out

    ours = lambda h, table: loss(linear_cross_entropy, h, table, transpose_w=True, chunk_rows=4)
    want_value, wants = jax.value_and_grad(lambda h, t: loss(reference, h, t, transpose_w=True), (0, 1))(*f32(h, table))
    value, grads = jax.value_and_grad(ours, (0, 1))(h, table)
    close(value, want_value, dtype)
    for g, r, a in zip(grads, wants, (h, table)):
        assert g.dtype == a.dtype and g.shape == a.shape
        close(g, r, dtype)
    jaxpr = jax.make_jaxpr(jax.grad(ours, (0, 1)))(h, table)
    assert "transpose" not in str(jaxpr)


@pytest.mark.parametrize("reduction", ce.REDUCTIONS)
def test_one_hot_linear_cross_entropy_is_the_one_hot_program_out_of_range_labels_included(reduction):
    from xkern.kernels.linear_cross_entropy import one_hot_linear_cross_entropy

    h, w, labels = make((10,), 16, 37, jnp.float32, seed=6)
    labels = labels.at[1].set(37).at[4].set(-1)  # out of range: a row of zeros, loss 0, no gradient

    def program(h, w):
        loss = -jnp.sum(jax.nn.one_hot(labels, 37) * jax.nn.log_softmax(h @ w, -1), -1)
        return loss if reduction == "none" else getattr(jnp, reduction)(loss)

    ours = lambda h, w: one_hot_linear_cross_entropy(h, w, labels, reduction=reduction, chunk_rows=4)
    got = ours(h, w)
    close(got, program(h, w), jnp.float32)
    if reduction == "none":
        assert float(got[1]) == 0.0 and float(got[4]) == 0.0
    total = lambda f: lambda h, w: jnp.sum(f(h, w) * jnp.arange(1.0, 11.0)) if reduction == "none" else f(h, w)
    grads, wants = (jax.grad(total(f), (0, 1))(h, w) for f in (ours, program))
    for g, r in zip(grads, wants):
        close(g, r, jnp.float32)
    assert float(jnp.abs(grads[0][1]).max()) == 0.0
    assert np.isnan(float(one_hot_linear_cross_entropy(h, w.at[0, 5].set(jnp.inf), labels, chunk_rows=4)))
    smoothed = lambda h, w: one_hot_linear_cross_entropy(h, w, labels, label_smoothing=0.2, reduction=reduction,
                                                         chunk_rows=4)
    want = ce.one_hot_cross_entropy(h @ w, labels, label_smoothing=0.2, backend="xla")
    close(smoothed(h, w), want if reduction == "none" else getattr(jnp, reduction)(want), jnp.float32)


@pytest.mark.parametrize("reduction", ce.REDUCTIONS)
def test_row_weights_such_as_a_padding_mask(reduction):
    """weights: none -> weights * loss, sum -> their sum, mean -> that over the weights' sum; with
    ignore_index too, gradients for h, w and the weights themselves; all-zero weights: mean 0."""
    h, w, labels = make((2, 5), 16, 37, jnp.float32, seed=12)
    labels = labels.at[1, 2].set(2)
    weights = jnp.asarray(np.random.default_rng(3).uniform(0, 2, labels.shape), jnp.float32).at[0, 1].set(0.0)

    def program(h, w, weights):
        rows = ce.reference(h @ w, labels, ignore_index=2, reduction="none") * weights
        if reduction == "none":
            return rows
        total = jnp.sum(rows)
        return total if reduction == "sum" else total / jnp.sum(weights * (labels != 2))

    ours = lambda h, w, weights: linear_cross_entropy(h, w, labels, ignore_index=2, reduction=reduction,
                                                      weights=weights, chunk_rows=4)
    close(ours(h, w, weights), program(h, w, weights), jnp.float32)
    scalar = lambda f: (lambda *a: jnp.sum(f(*a) * jnp.arange(1.0, 11.0).reshape(2, 5)))
    grads, wants = (jax.grad(scalar(f), (0, 1, 2))(h, w, weights) for f in (ours, program))
    for g, r in zip(grads, wants):
        close(g, r, jnp.float32)
    if reduction == "mean":
        assert float(ours(h, w, jnp.zeros_like(weights))) == 0.0
    if reduction != "none":  # no rows x vocabulary value is kept for the backward
        assert kernel_names(jax.make_jaxpr(jax.grad(ours))(h, w, weights)) == ["cross_entropy_fwd"]


@pytest.mark.parametrize("reduction", ce.REDUCTIONS)
def test_soft_capped_logits_tied_table_and_one_hot(reduction):
    """soft_cap: the loss of cap * tanh(h @ w / cap) (Gemma 2's final logits, over its tied table),
    capped inside the kernels: values and gradients against the capped reference, and with one-hot
    targets."""
    h, w, labels = make((3, 3), 16, 37, jnp.float32, seed=9)
    table, h = w.T, h * 4  # logits past the cap
    ct = jnp.asarray(np.random.default_rng(4).uniform(0.5, 2, labels.shape), jnp.float32)
    for one_hot, kw in ((False, {"label_smoothing": 0.05, "ignore_index": 2}), (True, {"z_loss": 1e-3})):
        ours = functools.partial(one_hot_linear_cross_entropy if one_hot else linear_cross_entropy, chunk_rows=4)
        want = functools.partial(ours, backend="xla")

        def loss(f, h, table):
            out = f(h, table, labels, reduction=reduction, transpose_w=True, soft_cap=5.0, **kw)
            return jnp.sum(out * ct) if reduction == "none" else out
        (value, grads), (want_value, wants) = (jax.value_and_grad(lambda h, t: loss(f, h, t), (0, 1))(h, table)
                                               for f in (ours, want))
        close(value, want_value, jnp.float32)
        uncapped = loss(lambda *a, soft_cap, **k: want(*a, **k), h, table)
        assert abs(float(uncapped - want_value)) > 0.1 * abs(float(want_value))  # the cap matters here
        for g, r in zip(grads, wants):
            close(g, r, jnp.float32)
        jaxpr = jax.make_jaxpr(jax.grad(lambda h, t: loss(ours, h, t), (0, 1)))(h, table)
        assert "cross_entropy_fwd" in kernel_names(jaxpr) and "tanh" not in str(jaxpr)  # capped in the kernel


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("one_hot", [False, True])
def test_rows_logsumexp_and_losses_beside_the_loss_with_their_gradients(reduction, one_hot):
    """return_lse / return_rows: each row's logsumexp of the (capped) logits and each row's loss
    (over chunks, the last padded), as the reference's; differentiated, their gradients (the logits
    recomputed) added to the loss's; in aux, the same kernels as without them."""
    h, w, labels = make((2, 5), 24, 37, jnp.float32, seed=3)
    labels = labels.at[1, 2].set(40) if one_hot else labels.at[0, 1].set(2)
    op = one_hot_linear_cross_entropy if one_hot else functools.partial(linear_cross_entropy, ignore_index=2)
    ours = lambda h, w, **kw: op(h, w, labels, reduction=reduction, z_loss=1e-3, chunk_rows=4, **kw)
    mix = lambda outs: jnp.sum(outs[0]) + jnp.sum(outs[1] * jnp.arange(10.0).reshape(2, 5)) + jnp.sum(
        outs[2] * jnp.arange(10.0, 0.0, -1.0).reshape(2, 5))
    for cap in (None, 2.5):
        logits = lambda h, w: ce.soft_capped(h @ w, cap)
        got = jax.value_and_grad(lambda h, w: mix(ours(h, w, soft_cap=cap, return_lse=True, return_rows=True)),
                                 (0, 1))(h, w)
        want_of = lambda h, w: (ours(h, w, soft_cap=cap, backend="xla"), jax.nn.logsumexp(logits(h, w), -1),
                                op(h, w, labels, z_loss=1e-3, reduction="none", soft_cap=cap, backend="xla"))
        want = jax.value_and_grad(lambda h, w: mix(want_of(h, w)), (0, 1))(h, w)
        close(got[0], want[0], jnp.float32)
        for g, r in zip(got[1], want[1]):
            close(g, r, jnp.float32)
    aux = lambda h, w: (lambda out: (jnp.sum(out[0]), out[1:]))(ours(h, w, return_lse=True, return_rows=True))
    assert kernel_names(jax.make_jaxpr(jax.grad(aux, (0, 1), has_aux=True))(h, w)) == kernel_names(
        jax.make_jaxpr(jax.grad(lambda h, w: jnp.sum(ours(h, w)), (0, 1)))(h, w))


@pytest.mark.parametrize("reduction", ce.REDUCTIONS)
@pytest.mark.parametrize("one_hot", [False, True], ids=["labels", "one-hot"])
def test_a_mask_drops_rows_whatever_their_loss(reduction, one_hot):
    """mask (with weights): rows where it is false add 0, also where their loss is NaN (a label out
    of range; a NaN in h): the value and gradients of the reference over the kept rows alone. (A
    dropped row's NaN h still reaches dw, through 0 * NaN in the matmuls, as in jax.jit's.)"""
    h, w, labels = make((2, 5), 16, 37, jnp.float32, seed=21)
    labels = labels.at[0, 1].set(-100)
    mask = jnp.ones(labels.shape, bool).at[0, 1].set(False).at[1, 2].set(False)
    weights = jnp.asarray(np.random.default_rng(4).uniform(0.5, 2.0, labels.shape), jnp.float32)
    op = one_hot_linear_cross_entropy if one_hot else linear_cross_entropy
    ours = lambda h, w: op(h, w, labels, weights=weights, mask=mask, reduction=reduction, chunk_rows=4)
    # the reference: dropped rows given label 0 (a finite loss) and weight 0
    want_of = lambda h, w: op(h, w, jnp.where(mask, labels, 0), weights=jnp.where(mask, weights, 0.0),
                              reduction=reduction, backend="xla")
    scalar = lambda out: jnp.sum(out * jnp.arange(1.0, 11.0).reshape(2, 5)) if reduction == "none" else out
    got = jax.value_and_grad(lambda h, w: scalar(ours(h, w)), (0, 1))(h, w)
    want = jax.value_and_grad(lambda h, w: scalar(want_of(h, w)), (0, 1))(h, w)
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert np.isfinite(np.asarray(g)).all()
        close(g, r, jnp.float32)
    assert np.asarray(got[1][0])[0, 1].tolist() == [0.0] * 16
    close(op(h, w, labels, weights=weights, mask=mask, reduction=reduction, backend="xla"), want_of(h, w), jnp.float32)
    h_nan = h.at[1, 2, 3].set(jnp.nan)  # in a dropped row
    close(scalar(ours(h_nan, w)), want[0], jnp.float32)


def test_bad_input_names_the_argument():
    h, w, labels = make((4,), 8, 11, jnp.float32)
    cases = [((h.astype(jnp.int32), w, labels), {}, TypeError, "h must have dtype"),
             ((h, w[:7], labels), {}, ValueError, r"w must have shape \(8, vocabulary\)"),
             ((h, w.astype(jnp.bfloat16), labels), {}, TypeError, "w must have h's dtype"),
             ((h, w, labels.astype(jnp.float32)), {}, TypeError, "labels must be an integer array"),
             ((h, w, labels[:3]), {}, ValueError, r"labels must have shape \(4,\)"),
             ((h, w, labels), {"transpose_w": True}, ValueError, r"w must have shape \(vocabulary, 8\)"),
             ((h, w, labels), {"transpose_w": 1}, TypeError, "transpose_w must be a bool"),
             ((h, w, labels), {"chunk_rows": 0}, ValueError, "chunk_rows must be a positive int"),
             ((h, w, labels), {"chunk_rows": True}, ValueError, "chunk_rows must be a positive int or None; got True"),
             ((h, w, labels), {"weights": labels}, ValueError, r"weights must be None or a float array of labels' shape \(4,\)"),
             ((h, w, labels), {"weights": h[:, 0][:3]}, ValueError, "weights must be None or a float array"),
             ((h, w, labels), {"mask": labels > 2}, ValueError, "mask is given with weights"),
             ((h, w, labels), {"weights": h[:, 0], "mask": labels}, ValueError,
              r"mask must be None or a bool array of labels' shape \(4,\)"),
             ((h, w, labels), {"reduction": "avg"}, ValueError, "reduction must be one of"),
             ((h, w, labels), {"label_smoothing": 2.0}, ValueError, "^linear_cross_entropy: label_smoothing must be"),
             ((h, w, labels), {"z_loss": "0"}, ValueError, "^linear_cross_entropy: z_loss must be"),
             ((h, w, labels), {"ignore_index": -2**40}, ValueError, "^linear_cross_entropy: ignore_index must be in"),
             ((h, w, labels), {"soft_cap": -30.0}, ValueError, "^linear_cross_entropy: soft_cap must be None or a posi"),
             ((h, w, labels), {"return_rows": None}, TypeError, "^linear_cross_entropy: return_rows must be a bool")]
    for args, kw, error, message in cases:
        with pytest.raises(error, match=message):
            linear_cross_entropy(*args, **kw)
    # NumPy scalars are numbers; int64 labels beyond int32's range are out of range (NaN), not wrapped
    want = linear_cross_entropy(h, w, labels, label_smoothing=0.25, z_loss=0.5, reduction="none")
    got = linear_cross_entropy(h, w, labels, label_smoothing=np.float32(0.25), z_loss=np.float64(0.5), reduction="none")
    np.testing.assert_array_equal(got, want)
    with jax.enable_x64(True):
        wide = jnp.asarray(labels, jnp.int64).at[0].add(2**32)
        got = linear_cross_entropy(h, w, wide, label_smoothing=np.float32(0.25), z_loss=0.5, reduction="none")
    assert np.isnan(got[0]) and np.array_equal(got[1:], want[1:])


# --------------------------------------------------------------------------------------------------
# Patterns: a projection whose only consumer is a cross-entropy, reduced by mean or sum
# --------------------------------------------------------------------------------------------------

def _spellings():
    import flax.linen as nn
    import optax

    dense = lambda h, w: nn.Dense(w.shape[1], use_bias=False).apply({"params": {"kernel": w}}, h)
    take = lambda a, y: jnp.take_along_axis(a, y[..., None], axis=-1)[..., 0]
    return {
        "mean(optax_integer_labels(jnp_matmul))":
            lambda h, w, y: optax.softmax_cross_entropy_with_integer_labels(h @ w, y).mean(),
        "sum(optax_integer_labels_upcast(lax_dot_general))":
            lambda h, w, y: optax.softmax_cross_entropy_with_integer_labels(dense(h, w).astype(jnp.float32), y).sum(),
        "mean(logsumexp_minus_label_upcast(jnp_matmul))": lambda h, w, y: jnp.mean(
            (lambda z: jax.nn.logsumexp(z, -1) - take(z, y))(jnp.einsum("btd,dv->btv", h, w).astype(jnp.float32))),
        "sum(minus_log_softmax_at_label(jnp_matmul))":
            lambda h, w, y: jnp.sum(-take(jax.nn.log_softmax(jnp.dot(h, w), -1), y)),
        # the log-probability, negated after the mean
        "-mean(log_softmax_at_label_upcast(jnp_matmul))": lambda h, w, y: -jnp.mean(jnp.take_along_axis(
            jax.nn.log_softmax((h @ w).astype(jnp.float32)), y[..., None], axis=-1)),
        # one-hot targets: optax.softmax_cross_entropy (a label out of range is a row of zeros)
        "mean(one_hot_log_softmax_upcast(lax_dot_general))": lambda h, w, y: optax.softmax_cross_entropy(
            dense(h, w).astype(jnp.float32), jax.nn.one_hot(y, w.shape[1])).mean(),
        "mean(smoothed_one_hot_log_softmax_upcast(matmul_transposed))": lambda h, t, y: optax.softmax_cross_entropy(
            (h @ t.T).astype(jnp.float32), optax.smooth_labels(jax.nn.one_hot(y, t.shape[0]), 0.1)).mean(),
        # log_softmax written out (t5x's and MaxText's cross_entropy_with_logits, z-loss aside)
        "sum(one_hot_log_probabilities_upcast(jnp_matmul))": lambda h, w, y: jnp.sum(-jnp.sum(jax.nn.one_hot(
            y, w.shape[1]) * (lambda z: z - jax.nn.logsumexp(z, -1, keepdims=True))((h @ w).astype(jnp.float32)), -1)),
        # NumPy indexing of the flattened rows
        "mean(minus_log_softmax_indexed(jnp_matmul))": lambda h, w, y: jnp.mean(-jax.nn.log_softmax(
            h.reshape(-1, h.shape[-1]) @ w)[jnp.arange(y.size), y.reshape(-1)]),
        # tied embeddings: the table t [V, D] (flax's Embed.attend, h @ t.T, einsum)
        "mean(optax_integer_labels_upcast(matmul_transposed))": lambda h, t, y: optax.softmax_cross_entropy_with_integer_labels(
            nn.Embed(*t.shape).apply({"params": {"embedding": t}}, h, method="attend").astype(jnp.float32), y).mean(),
        "sum(one_hot_in_logits_dtype_log_softmax(matmul_transposed))": lambda h, t, y: jnp.sum(-jnp.sum(
            jax.nn.one_hot(y, t.shape[0], dtype=h.dtype) * jax.nn.log_softmax(h @ t.T), -1)),
        # a padding mask: the masked mean, its division folded into the weights
        "sum(optax_integer_labels_upcast(jnp_matmul) * weights) / d": lambda h, w, y: jnp.sum(
            optax.softmax_cross_entropy_with_integer_labels((h @ w).astype(jnp.float32), y) * (y != 3)) / jnp.sum(y != 3),
        "-sum(log_softmax_at_label(lax_dot_general) * weights)": lambda h, w, y: -jnp.sum(jnp.take_along_axis(
            jax.nn.log_softmax(dense(h, w)), y[..., None], -1) * (y != 3)[..., None].astype(h.dtype)),
        "mean(smoothed_one_hot_log_softmax_upcast(matmul_transposed) * weights)": lambda h, t, y: jnp.mean(
            optax.softmax_cross_entropy((h @ t.T).astype(jnp.float32),
                                        optax.smooth_labels(jax.nn.one_hot(y, t.shape[0]), 0.1)) * jnp.linspace(0, 1, y.size).reshape(y.shape)),
        # PaLM's z-loss beside the loss (the weight read off the program)
        "mean(logsumexp_minus_label_z_loss_upcast(jnp_matmul))": lambda h, w, y: jnp.mean(
            (lambda z: (lambda lse: lse - take(z, y) + 0.05 * lse ** 2)(jax.nn.logsumexp(z, -1)))(
                (h @ w).astype(jnp.float32))),
        "sum(optax_integer_labels_z_loss(matmul_transposed) * weights)": lambda h, t, y: jnp.sum((lambda z: (
            optax.softmax_cross_entropy_with_integer_labels(z, y) + 0.01 * jnp.square(jax.nn.logsumexp(z, -1))))(
                h @ t.T) * (y != 3)),
        "mean(one_hot_log_probabilities_z_loss_upcast(lax_dot_general))": lambda h, w, y: jnp.mean(
            (lambda z: (lambda log_z: -jnp.sum(jax.nn.one_hot(y, w.shape[1]) * (z - log_z), -1) + 1e-4 * jax.lax.square(
                jnp.squeeze(log_z, -1)))(jax.nn.logsumexp(z, -1, keepdims=True)))(dense(h, w).astype(jnp.float32))),
        "mean(logsumexp_minus_label_upcast(einsum_transposed))": lambda h, t, y: jnp.mean(
            (lambda z: jax.nn.logsumexp(z, -1) - take(z, y))(jnp.einsum("btd,vd->btv", h, t).astype(jnp.float32))),
        # Gemma 2's final logits soft-capped (the gemma library's spelling: /=, tanh, * cap), tied or not
        "mean(optax_integer_labels_upcast(soft_cap(matmul_transposed)))": lambda h, t, y: (lambda z: (
            optax.softmax_cross_entropy_with_integer_labels((jnp.tanh(z / 2.0) * 2.0).astype(jnp.float32), y).mean()))(
                jnp.dot(h, t.T)),
        "sum(minus_log_softmax_at_label(soft_cap(lax_dot_general)) * weights) / d": lambda h, w, y: jnp.sum(
            -take(jax.nn.log_softmax(jnp.tanh(dense(h, w) / 5.0) * 5.0), y) * (y != 3)) / jnp.sum(y != 3),
        # scaled: by a constant (gradient accumulation's steps), by a scalar (a dynamic loss scale)
        "mean(optax_integer_labels(jnp_matmul)) / c":
            lambda h, w, y: optax.softmax_cross_entropy_with_integer_labels(h @ w, y).mean() / 4,
        "sum(minus_log_softmax_at_label_upcast(lax_dot_general) * weights) * d": lambda h, w, y: jnp.sum(
            -take(jax.nn.log_softmax(dense(h, w).astype(jnp.float32)), y) * (y != 3)) * jnp.sum(y > 10).astype(jnp.float32),
        # a per-example loss mapped by jax.vmap (Equinox's idiom): each example's mean, then the batch's
        "mean_of_means(optax_integer_labels(jnp_matmul))": lambda h, w, y: jnp.mean(jax.vmap(
            lambda h, y: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h @ w, y)))(h, y)),
        # a loss normalized per example (per sequence): each example's masked mean, then the batch's
        "mean(sum(optax_integer_labels(jnp_matmul) * weights, -1) / n)": lambda h, w, y: jnp.mean(
            (lambda rows, m: jnp.sum(rows * m, -1) / jnp.sum(m, -1))(
                optax.softmax_cross_entropy_with_integer_labels(h @ w, y), y != 3)),
        "sum(sum(one_hot_log_softmax_upcast(einsum_transposed) * weights, -1) / n)": lambda h, t, y: jnp.sum(
            jax.vmap(lambda z, y, m: jnp.sum(optax.softmax_cross_entropy(z, jax.nn.one_hot(y, t.shape[0])) * m) / jnp.sum(m))(
                jnp.einsum("btd,vd->btv", h, t).astype(jnp.float32), y, (y != 3).astype(jnp.float32))),
        "mean(sum(where(mask, optax_integer_labels_upcast(lax_dot_general), 0), -1) / n)": lambda h, w, y: jnp.mean(
            jnp.mean(optax.softmax_cross_entropy_with_integer_labels(dense(h, w).astype(jnp.float32), y), axis=-1,
                     where=y != 3)),
        # rows less a scalar: HF's Flax summarization (flax's onehot, smoothed, less its entropy), Flax's WMT
        "sum((flax_onehot_log_softmax(matmul_transposed) - c) * weights) / d": lambda h, t, y: _summarization(h @ t.T, y),
        "sum((smoothed_one_hot_log_softmax_upcast(jnp_matmul) - c)) / c": lambda h, w, y: jnp.sum(optax.softmax_cross_entropy(
            (h @ w).astype(jnp.float32), optax.smooth_labels(jax.nn.one_hot(y, w.shape[1]), 0.1))
            - -(0.9 * jnp.log(0.9) + 0.1 * jnp.log(0.1 / w.shape[1]))) / 4,
    }


def _summarization(logits, labels, smoothing=0.1):
    """HF's run_summarization_flax loss: flax's onehot targets, smoothed, less their entropy, masked
    (here labels 3 are padding), over the mask's sum."""
    import optax
    from flax.training.common_utils import onehot
    vocab, confidence = logits.shape[-1], 1.0 - smoothing
    low_confidence = (1.0 - confidence) / (vocab - 1)
    constant = -(confidence * jnp.log(confidence) + (vocab - 1) * low_confidence * jnp.log(low_confidence + 1e-20))
    padding = (labels != 3).astype(jnp.float32)
    loss = optax.softmax_cross_entropy(logits, onehot(labels, vocab, on_value=confidence, off_value=low_confidence))
    return jnp.sum((loss - constant) * padding) / jnp.sum(padding)


@pytest.mark.parametrize("spelling", list(_spellings()))
def test_linear_patterns_match_and_equal_jax_jit(spelling):
    f = _spellings()[spelling]
    h, w, labels = make((2, 5), 16, 37, jnp.bfloat16, seed=7)
    w = w.T if "transposed" in spelling else w  # a tied embedding table, [V, D]
    labels = labels.at[0, 0].set(-3)  # negative labels count from the end, as take_along_axis does
    report = xkern.explain(f)(h, w, labels)
    assert [m.pattern for m in report.matches if "cross_entropy" in m.pattern] == [f"linear_cross_entropy/{spelling}"]
    close(xkern.jit(f)(h, w, labels), jax.jit(f)(h, w, labels), jnp.bfloat16)
    got = jax.jit(jax.grad(xkern.optimize(f), (0, 1)))(h, w, labels)
    want = jax.jit(jax.grad(f, (0, 1)))(h, w, labels)
    for g, r in zip(got, want):
        close(g, r, jnp.bfloat16)


def test_linear_near_misses_keep_the_logits():
    import optax

    h, w, labels = make((6,), 16, 37, jnp.float32, seed=8)
    ce_rows = optax.softmax_cross_entropy_with_integer_labels
    near_misses = {
        # the logits are also returned: they must exist, so only the cross-entropy is fused
        "logits escape": lambda h, w, y: (lambda z: (ce_rows(z, y).mean(), z))(h @ w),
        # per-row losses squared: not a (weighted) sum of the rows
        "squared": lambda h, w, y: jnp.sum(ce_rows(h @ w, y) ** 2),
        # weighted by the losses themselves
        "self-weighted": lambda h, w, y: (lambda rows: jnp.sum(rows * rows))(ce_rows(h @ w, y)),
        # the log-probability's mean, not negated: the rows' log-probabilities are fused, not the mean
        "log-probability": lambda h, w, y: jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h @ w), y[:, None], -1)),
        # tanh(z / a) * b with a != b: not a soft cap (the kernels take one number)
        "two caps": lambda h, w, y: ce_rows(jnp.tanh((h @ w) / 30.0) * 20.0, y).mean(),
    }
    # where only the cross-entropy is fused, explain says why not the LM head too
    reasons = {"logits escape": "is also an output of the program"}
    for name, f in near_misses.items():
        args = (h, w, labels)
        report = xkern.explain(f)(*args)
        assert not [m for m in report.matches if m.pattern.startswith("linear_cross_entropy")], name
        assert [m.pattern for m in report.matches if m.pattern.startswith("cross_entropy")], name
        if name in reasons:
            assert any(d.pattern.startswith("linear_cross_entropy/") and reasons[name] in d.reason
                       for d in report.declined), (name, report)
        jax.tree.map(lambda a, b: close(a, b, jnp.float32), xkern.jit(f)(*args), jax.jit(f)(*args))


def test_logits_a_train_step_drops_from_its_loss_fns_aux_are_never_made(monkeypatch):
    """MaxText's loss_fn returns its logits in aux (for its eval step); its train step reads the loss,
    the gradients and the count. xkern plans the loss_fn before jax differentiates it, where the
    logits are an output; the step's trace shows them unread, so the loss_fn is planned again without
    them and the LM head takes them (linear_cross_entropy), with jax.jit's values and gradients. A
    step that reads them keeps them (the cross-entropy alone is fused, and explain says why); so does
    a vjp without aux whose second output is unread but given a cotangent. In a scan of micro-batches
    (gradient accumulation) they are dropped as in the step. Where the second trace would read a value
    it dropped (calls numbered otherwise), the first trace stands."""
    from benchmarks.bench_cross_entropy import maxtext_logits_in_aux_loss, maxtext_step
    from xkern.jaxpr_passes import unread
    from xkern.jaxpr_passes.rewrite import AN_OUTPUT

    h, w, labels = make((2, 5), 16, 300, jnp.float32, seed=21)
    segmentation = jnp.asarray(np.random.default_rng(22).integers(0, 3, labels.shape), jnp.int32).at[:, 0].set(1)
    loss_fn = lambda h, w: maxtext_logits_in_aux_loss(jnp.einsum("btd,dv->btv", h, w), labels, segmentation)

    def reads(h, w):
        (loss, aux), grads = jax.value_and_grad(loss_fn, (0, 1), has_aux=True)(h, w)
        return loss, grads, aux["intermediate_outputs"]["logits"]

    def vjp_step(h, w):
        def loss_and_logits(h, w):
            logits = jnp.einsum("btd,dv->btv", h, w)
            return maxtext_logits_in_aux_loss(logits, labels, segmentation)[0], logits
        (loss, logits), pullback = jax.vjp(loss_and_logits, h, w)
        return loss, pullback((jnp.float32(1.0), jnp.ones_like(logits)))

    def accumulated(h, w):  # as MaxText's gradient accumulation: each micro-batch's aux stacked, then summed
        def micro(carry, batch):
            hb, yb, sb = batch
            (loss, aux), gw = jax.value_and_grad(lambda w: maxtext_logits_in_aux_loss(hb @ w, yb, sb), has_aux=True)(w)
            return (carry[0] + loss, carry[1] + gw), aux
        (loss, gw), aux = jax.lax.scan(micro, (jnp.float32(0.0), jnp.zeros_like(w)), (h, labels, segmentation))
        return loss, gw, jax.tree.map(lambda x: jnp.sum(x, axis=0), aux)["total_weights"]

    head = lambda report: [m.pattern for m in report.matches if m.pattern.startswith("linear_cross_entropy")]
    for name, f, fused in (("drops", maxtext_step(loss_fn, (0, 1)), True), ("reads", reads, False),
                           ("vjp", vjp_step, False), ("accumulated", accumulated, True)):
        report = xkern.explain(f)(h, w)
        assert bool(head(report)) == fused, (name, report)
        assert ("aux['intermediate_outputs']['logits']" in report.unread) == fused, (name, report)
        assert ("left out aux['intermediate_outputs']['logits']" in str(report)) == fused, (name, report)
        assert [m for m in report.matches if m.pattern.startswith("cross_entropy")] or fused, (name, report)
        if name == "reads":
            assert any(d.pattern.startswith("linear_cross_entropy/") and AN_OUTPUT in d.reason
                       for d in report.declined), report
        jax.tree.map(lambda a, b: close(a, b, jnp.float32), xkern.jit(f)(h, w), jax.jit(f)(h, w))

    # dropping every aux leaf, the logits too, where the step reads them: the check keeps the first trace
    monkeypatch.setattr(unread, "unread", lambda closed, calls, worth: {0: {0, 1, 2}} if calls else {})
    assert not head(xkern.explain(reads)(h, w))
    jax.tree.map(lambda a, b: close(a, b, jnp.float32), xkern.jit(reads)(h, w), jax.jit(reads)(h, w))


def test_hf_ignore_labels_masked_after_the_loss_train_as_under_jax_jit():
    """HF's convention: -100 labels, the loss taken on them as they are, then masked by `where`. The
    rows' NaN losses are masked away and their gradients are 0 under jax.jit (the gather's gradient
    drops an index out of range); so under xkern.jit, for the row loss and the LM head alike. The LM
    head's is linear_cross_entropy (no logits held), also for a mean times a constant. A dropped row
    whose h is infinite adds 0 to the loss, as under jax.jit, and nothing to the gradients, where
    jax.jit's are NaN (0 times the row's NaN softmax, through the matmuls into dw): as if
    that row of h were 0."""
    import optax
    rng = np.random.default_rng(11)
    h = jnp.asarray(rng.standard_normal((2, 8, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 50)) * 0.2, jnp.float32)
    labels = jnp.asarray(rng.integers(0, 50, (2, 8)), jnp.int32).at[1, 5:].set(-100)
    lm_head = lambda h, w, labels: masked_mean(optax.softmax_cross_entropy_with_integer_labels(h @ w, labels), labels)

    def masked_mean(per_row, labels):
        kept = labels != -100
        return jnp.where(kept, per_row, 0.0).sum() / kept.sum()

    programs = {
        "row loss": (lambda logits, labels: masked_mean(-jnp.take_along_axis(
            jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0], labels), (h @ w, labels)),
        "LM head": (lm_head, (h, w, labels)),
        "LM head, mean * 0.5": (lambda h, w, labels: 0.5 * jnp.mean(jnp.where(
            labels != -100, optax.softmax_cross_entropy_with_integer_labels(h @ w, labels), 0.0)), (h, w, labels)),
        "LM head, inf in a dropped row": (lm_head, (h.at[1, 6, 3].set(jnp.inf), w, labels)),
    }
    for name, (f, args) in programs.items():
        arrays = tuple(range(len(args) - 1))
        got = xkern.jit(jax.value_and_grad(f, arrays))(*args)
        clean = (h, *args[1:]) if "inf" in name else args  # (the row as 0: see above)
        want = jax.jit(jax.value_and_grad(f, arrays))(*clean)
        if "inf" in name:
            assert np.isnan(np.asarray(jax.jit(jax.grad(f, 1))(*args))).any()  # jax.jit's dw
            assert np.asarray(got[1][0])[1, 6].tolist() == [0.0] * h.shape[-1]
            want = (want[0], (np.asarray(want[1][0]).copy(), want[1][1]))
            want[1][0][1, 6] = 0.0
        for g, x in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert np.isfinite(np.asarray(g)).all(), name
            close(g, x, jnp.float32)
        if name.startswith("LM head"):
            report = xkern.explain(f)(*args)
            assert [m.pattern.split("/")[0] for m in report.matches if "cross_entropy" in m.pattern] == [
                "linear_cross_entropy"], name


def test_lm_head_masks_converted_from_bool_and_all_rows_masked_as_jax_jit():
    """The LM head of a loss times `(labels != -100).astype(float)` (XLA's select: the -100 rows add 0
    under jax.jit, where NaN * 0 would be NaN) is linear_cross_entropy with those rows dropped, value
    and gradients as jax.jit's; every row masked, over the mask's sum, is NaN (0 / 0) as jax.jit's, its
    gradients 0 (a masked row's factor is 0, not 0 * inf)."""
    import optax
    rng = np.random.default_rng(12)
    h = jnp.asarray(rng.standard_normal((2, 8, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 50)) * 0.2, jnp.float32)
    labels = jnp.asarray(rng.integers(0, 50, (2, 8)), jnp.int32).at[1, 5:].set(-100)
    ints = optax.softmax_cross_entropy_with_integer_labels
    one_hot = lambda x, y: optax.softmax_cross_entropy(x, jax.nn.one_hot(y, 50))

    def masked(loss_fn, keep):
        def f(h, w, y):
            mask = keep(y).astype(jnp.float32)
            return jnp.sum(loss_fn(h @ w, y) * mask) / jnp.sum(mask)
        return f
    programs = {"-100 rows": (masked(ints, lambda y: y != -100), labels, False),
                "-100 rows, one-hot": (masked(one_hot, lambda y: y != -100), labels, False),
                "every row masked": (masked(ints, lambda y: y < -100), labels, True),
                "every row masked by where": (lambda h, w, y: jnp.sum(jnp.where(y < -100, ints(h @ w, y), 0.0))
                                              / jnp.sum(y < -100), labels, True)}
    for name, (f, y, nan) in programs.items():
        report = xkern.explain(f)(h, w, y)
        assert [m.pattern.split("/")[0] for m in report.matches if "cross_entropy" in m.pattern] == [
            "linear_cross_entropy"], (name, report)
        got = xkern.jit(jax.value_and_grad(f, (0, 1)))(h, w, y)
        want = jax.jit(jax.value_and_grad(f, (0, 1)))(h, w, y)
        assert np.isnan(np.float32(want[0])) == nan, name
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg=name)
        for g, x in zip(got[1], want[1]):
            close(g, x, jnp.float32)


@pytest.mark.skipif(not L.hopper(), reason="needs a Hopper GPU (TMA); the interpreter cannot run Gluon")
@pytest.mark.parametrize("options", list(OPTIONS))
def test_shared_memory_kernel_writes_dlogits_in_place_on_hopper(options, monkeypatch):
    """At 16 bits and a vocabulary of 16392 (2 chunks in shared memory and a tail of 8) each chunk's
    loss and dlogits come from cross_entropy_hopper, dlogits over the chunk's logits: value and
    both gradients against the float32 reference."""
    from xkern.kernels import cross_entropy_hopper
    monkeypatch.setattr(cross_entropy_hopper, "MIN_COLS", cross_entropy_hopper.CHUNK.value)  # (a small problem)
    launches, launch = [], cross_entropy_hopper.launch_fwd
    monkeypatch.setattr(cross_entropy_hopper, "launch_fwd", lambda x2, *a, **k: launches.append(x2.shape)
                        or launch(x2, *a, **k))
    kw = {**OPTIONS[options], "reduction": "mean"}
    h, w, labels = make((3, 100), 64, 16392, jnp.bfloat16, seed=3)
    ours = lambda h, w: linear_cross_entropy(h, w, labels, chunk_rows=128, **kw)
    (value, grads) = jax.jit(jax.value_and_grad(ours, (0, 1)))(h, w)
    want, wants = jax.value_and_grad(lambda h, w: reference(h, w, labels, **kw), (0, 1))(*f32(h, w))
    close(value, want, jnp.bfloat16)
    for g, r in zip(grads, wants):
        close(g, r, jnp.bfloat16)
    assert launches and all(shape == (128, 16392) for shape in launches)


@pytest.mark.parametrize("rows", [(1,), (3, 1)], ids=str)
def test_lm_head_over_one_row_or_one_token_per_example_is_found(rows):
    """h [1, D] or [B, 1, D]: jnp.take_along_axis gathers differently where the labels' last batch
    axis has size 1; the LM head is found there too, values and gradients as jax.jit's."""
    import optax
    f = lambda h, w, y: optax.softmax_cross_entropy_with_integer_labels(h @ w, y).mean()
    h, w, labels = make(rows, 16, 37, jnp.float32, seed=8)
    report = xkern.explain(f)(h, w, labels)
    assert [m.pattern for m in report.matches if "cross_entropy" in m.pattern] == \
        ["linear_cross_entropy/mean(optax_integer_labels(jnp_matmul))"]
    close(xkern.jit(f)(h, w, labels), jax.jit(f)(h, w, labels), jnp.float32)
    for g, r in zip(jax.jit(jax.grad(xkern.optimize(f), (0, 1)))(h, w, labels), jax.jit(jax.grad(f, (0, 1)))(h, w, labels)):
        close(g, r, jnp.float32)
