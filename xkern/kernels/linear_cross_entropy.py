"""The final projection and cross-entropy together, `cross_entropy(h @ w, labels)`, chunked over rows
so that the logits of only `chunk_rows` rows ever exist: with gradients for h and w. w is [D, V]
(a Dense kernel) or, with transpose_w, [V, D] (a tied embedding table, `h @ embedding.T`), read in
place either way.

Per chunk c of rows (matmuls by XLA, the loss by xkern.kernels.cross_entropy's kernels):

    logits_c = h_c @ w                                  [chunk, V], a temporary
    mean/sum:  the forward kernel writes the losses and overwrites logits_c in place with
               dlogits_c = dloss/dlogits, each row already scaled by its weight in the reduction;
               dh_c = dlogits_c @ w.T,  dw += h_c.T @ dlogits_c
               all in the forward pass: the backward only scales dh, dw by the loss's cotangent
               (3 matmuls, as XLA's unfused program; nothing of size rows x V is kept)
    none:      each row has its own cotangent, known only in the backward: the forward keeps the
               per-row logsumexp; the backward recomputes logits_c and runs the backward kernel
               (4 matmuls: one more than XLA, the price of never holding the logits)

dw accumulates in w's dtype across chunks (a float32 accumulator the size of w would itself be
more temporary memory than the logits it avoids): one rounding per chunk.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from xkern.kernels import cross_entropy as ce
from xkern.kernels import launch as L
from xkern.kernels import partition

# Rows per chunk, measured on an H100 (bf16 forward+backward, h100-lm-head-session53.json; python -m
# benchmarks.sweep_lm_head_chunks): the time that small chunks lose is in dh = dlogits @ w.T, whose
# [chunk, D] output is too few tiles to fill the SMs over its long (V) contraction (dw's
# accumulation is fused into its gemm, beta 1). At
# 8192x4096x128256: 1024 rows 40.6 ms, 2048 37.5, 4096 37.7 (jax.jit 44.6); Gemma 2's 2304x256000:
# 512 rows 54.8, 1024 46.8, 2048 44.7 (jax.jit 50.9); Qwen's 4096x151936: 1664 rows 48.5 (wave
# quantization: 1.6 waves of dh's tiles), 2048 45.2. So a chunk is a power of two of rows: the most
# whose logits fit CHUNK_BYTES; if that is under MIN_CHUNK_ROWS, up to it within twice those bytes.
CHUNK_BYTES = 1 << 29  # 512 MiB: 2048 rows of a 128256 vocabulary in bf16
MIN_CHUNK_ROWS = 2048


def reference(h, w, labels, transpose_w=False, **options):
    """The definition (and the `xla` backend): the logits, materialized."""
    return ce.reference(jnp.matmul(h, w.T if transpose_w else w), labels, **options)


class Options(NamedTuple):
    """What the chunks' kernels and matmuls need to know, static (hashable) for the custom_vjps."""
    ignore_index: int | None
    smoothing: float
    z_loss: float
    n_cols: int
    one_hot: bool = False  # labels out of range are rows of zeros (see ce.one_hot_cross_entropy)
    transpose_w: bool = False  # w is [V, D]
    soft_cap: float | None = None  # the logits capped first, in the kernels (ce.cross_entropy's soft_cap)
    masked: bool = False  # rows of weight 0 add 0 to the sum even where their loss is NaN (a mask given)


def default_chunk_rows(n_rows: int, n_cols: int, itemsize: int) -> int:
    """Rows per chunk (see CHUNK_BYTES), shared evenly among as many chunks as that size needs,
    rounded up to whole matmul tiles of 128 rows, so that the last chunk pads little (5000 rows of a
    128256 vocabulary: 3 chunks of 1792 rows, not 3 of 2048)."""
    most = _rows_within(CHUNK_BYTES, n_cols * itemsize)
    if most < MIN_CHUNK_ROWS:
        most = min(MIN_CHUNK_ROWS, _rows_within(2 * CHUNK_BYTES, n_cols * itemsize))
    if n_rows <= most:
        return max(1, n_rows)
    n_chunks = -(-n_rows // most)
    return _round_up(-(-n_rows // n_chunks), 128)


def _rows_within(n_bytes: int, row_bytes: int) -> int:
    """The most rows, a power of two and at least 128, whose logits fit n_bytes."""
    rows = 128
    while rows * 2 * max(1, row_bytes) <= n_bytes:
        rows *= 2
    return rows


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# --------------------------------------------------------------------------------------------------
# One chunk
# --------------------------------------------------------------------------------------------------

def _logits(h_c, w, options: Options):
    return jax.lax.dot_general(h_c, w, (((1,), (1 if options.transpose_w else 0,)), ((), ())))


def _grads(h_c, w, dlogits, dw, options: Options, vocab=()):
    """dh of the chunk's rows, and dw with the chunk's part added (no transposes materialized).
    vocab: the mesh axes w's vocabulary is split over (_split_rows), dh's partial sums added across."""
    vocab_axis = 0 if options.transpose_w else 1
    dh = jax.lax.dot_general(dlogits, w, (((1,), (vocab_axis,)), ((), ())), preferred_element_type=jnp.float32)
    dh = jax.lax.psum(dh, vocab) if vocab else dh
    if options.transpose_w:
        dw_c = jax.lax.dot_general(dlogits, h_c, (((0,), (0,)), ((), ())))
    else:
        dw_c = jax.lax.dot_general(h_c, dlogits, (((0,), (0,)), ((), ())))
    return dh.astype(h_c.dtype), dw + dw_c.astype(dw.dtype)


def _chunks(a, chunk):
    """a as [n_chunks, chunk, ...], padded with zeros: padded rows get h = 0, label 0, weight 0
    (their losses are dropped and their gradients are zero)."""
    pad = -a.shape[0] % chunk
    return jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape(-1, chunk, *a.shape[1:])


def _unchunk(a, n_rows):
    return a.reshape(-1, *a.shape[2:])[:n_rows]


def _consts(options: Options, write_dx=None) -> dict:
    return ce._consts(options.n_cols, options.ignore_index, options.smoothing, options.z_loss, write_dx,
                      options.one_hot, options.soft_cap)


def _split_rows(fn, args, out_roles, options: Options, consts):
    """fn(*args, vocab) on each device's rows (partition.rows_call: the chunks' scan would gather
    rows that a mesh shards), the rows' dims kept (labels', args[2]: a batch and a sequence), w
    (args[1]) whole, or split along its vocabulary where the kernels split it (tensor parallelism:
    fn then combines across `vocab`, as cross-entropy's own split)."""
    cols = (1, 0 if options.transpose_w else 1) if ce._vocab_splits(consts) else None
    return partition.rows_call(lambda *a, cols_axes: fn(*a, vocab=cols_axes), args,
                               [L.ROWS, L.SHARED] + [L.ROWS] * (len(args) - 2), out_roles, cols, args[2].ndim)


def _flat(a, n_lead: int):
    """a [*rows, ...] as [rows, ...]: the chunks' view."""
    return a.reshape(-1, *a.shape[n_lead:])


def _launch_fwd(logits, y_c, wt_c, backend, config, consts, vocab, in_place=False):
    """The forward kernel on a chunk's logits, on this device's classes where `vocab` split them."""
    launch = functools.partial(ce._vocab_fwd, heads=vocab) if vocab else ce._launch_fwd
    return launch(logits, y_c, wt_c, backend=backend, config=config, constexprs=consts, in_place=in_place)


def _losses(h, w, labels, options, chunk, backend, config):
    """Per-row losses and logsumexps, chunk by chunk (no gradients)."""
    consts = _consts(options, write_dx=False)

    def chunks(h, w, labels, vocab):
        lead, n = labels.shape, labels.ndim
        h, labels = _flat(h, n), _flat(labels, n)

        def step(_, xs):
            h_c, y_c = xs
            loss, lse, _ = _launch_fwd(_logits(h_c, w, options), y_c, jnp.zeros(y_c.shape, jnp.float32),
                                       backend, config, consts, vocab)
            return None, (loss, lse)
        _, (loss, lse) = jax.lax.scan(step, None, (_chunks(h, chunk), _chunks(labels, chunk)))
        return _unchunk(loss, h.shape[0]).reshape(lead), _unchunk(lse, h.shape[0]).reshape(*lead, 2)
    return tuple(_split_rows(chunks, (h, w, labels), [L.ROWS, L.ROWS], options, consts))


# --------------------------------------------------------------------------------------------------
# mean / sum: sum(weights * loss), gradients computed in the forward
# --------------------------------------------------------------------------------------------------

@L.varying_alike
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _weighted_sum(h, w, labels, weights, options, chunk, backend, config):
    """(sum(weights * loss), each row's lse pair and loss: their cotangents are not read, see _given.)"""
    loss, lse = _losses(h, w, labels, options, chunk, backend, config)
    return ce._sum(loss, weights, options.masked), lse, loss


def _weighted_sum_fwd(h, w, labels, weights, options, chunk, backend, config):
    consts = _consts(options, write_dx=True)

    def chunks(h, w, labels, weights, vocab):
        lead, n = labels.shape, labels.ndim
        h, labels, weights = _flat(h, n), _flat(labels, n), _flat(weights, n)

        def step(dw, xs):
            h_c, y_c, wt_c = xs
            loss, lse, dlogits = _launch_fwd(_logits(h_c, w, options), y_c, wt_c, backend, config, consts, vocab,
                                             in_place=True)
            dh_c, dw = _grads(h_c, w, dlogits, dw, options, vocab)
            return dw, (loss, lse, dh_c)

        xs = tuple(_chunks(a, chunk) for a in (h, labels, weights))
        # (zeros_like: inside shard_map the carry varies over the mesh axes w does, as the chunks' dw)
        dw, (loss, lse, dh) = jax.lax.scan(step, jnp.zeros_like(w), xs)
        return (*(_unchunk(a, h.shape[0]).reshape(*lead, *a.shape[2:]) for a in (loss, lse, dh)), dw)

    loss, lse, dh, dw = _split_rows(chunks, (h, w, labels, weights),
                                    [L.ROWS] * 3 + [(L.SUMMED, 0 if options.transpose_w else 1)], options, consts)
    return (ce._sum(loss, weights, options.masked), lse, loss), (dh, dw, loss)


def _weighted_sum_bwd(options, chunk, backend, config, residuals, g):
    dh, dw, loss = residuals
    g = g[0]
    # g is the scalar loss's cotangent: usually jax.grad's constant 1, which XLA folds away.
    return (dh * g.astype(dh.dtype), dw * g.astype(dw.dtype), None, loss * g)


_weighted_sum.defvjp(_weighted_sum_fwd, _weighted_sum_bwd)


# --------------------------------------------------------------------------------------------------
# none: per-row losses, gradients recomputed chunk by chunk in the backward
# --------------------------------------------------------------------------------------------------

@L.varying_alike
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _rows(h, w, labels, options, chunk, backend, config):
    """(Each row's loss, its lse pair: the pair's cotangent is not read, see _given.)"""
    return _losses(h, w, labels, options, chunk, backend, config)


def _rows_fwd(h, w, labels, options, chunk, backend, config):
    loss, lse = _losses(h, w, labels, options, chunk, backend, config)
    return (loss, lse), (h, w, labels, lse)


def _rows_bwd(options, chunk, backend, config, residuals, g):
    h, w, labels, lse = residuals
    return (*_recomputed_grads(h, w, labels, lse, g[0], options, chunk, backend, config), None)


_rows.defvjp(_rows_fwd, _rows_bwd)


def _recomputed_grads(h, w, labels, lse, g, options, chunk, backend, config):
    """(dh, dw) of the rows' losses times their cotangents g: the logits recomputed chunk by chunk,
    the backward kernel over them."""
    consts = _consts(options)

    def chunks(h, w, labels, g, lse, vocab):
        lead, n = labels.shape, labels.ndim
        h, labels, g, lse = _flat(h, n), _flat(labels, n), _flat(g, n), _flat(lse, n)

        def step(dw, xs):
            h_c, y_c, g_c, lse_c = xs
            launch = functools.partial(ce._vocab_bwd, heads=vocab) if vocab else ce._launch_bwd
            (dlogits,) = launch(_logits(h_c, w, options), y_c, lse_c, g_c, backend=backend, config=config,
                                constexprs=consts, in_place=True)
            dh_c, dw = _grads(h_c, w, dlogits, dw, options, vocab)
            return dw, dh_c

        xs = tuple(_chunks(a, chunk) for a in (h, labels, g, lse))
        dw, dh = jax.lax.scan(step, jnp.zeros_like(w), xs)  # (zeros_like: as above)
        return _unchunk(dh, h.shape[0]).reshape(*lead, -1), dw
    dh, dw = _split_rows(chunks, (h, w, labels, g.astype(jnp.float32), lse),
                         [L.ROWS, (L.SUMMED, 0 if options.transpose_w else 1)], options, consts)
    return dh, dw


@L.varying_alike
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _given(h, w, labels, lse, value, options, chunk, backend, config):
    """`value`, each row's loss (as `options` say) or, for the options of none (labels -1: no
    target), each row's logsumexp, from the forward's pass: its gradient, where it has one,
    recomputed as reduction "none"'s."""
    return value


def _given_fwd(h, w, labels, lse, value, options, chunk, backend, config):
    return value, (h, w, labels, lse)


def _given_bwd(options, chunk, backend, config, residuals, g):
    h, w, labels, lse = residuals
    dh, dw = _recomputed_grads(h, w, labels, lse, g, options, chunk, backend, config)
    return dh, dw, None, jnp.zeros_like(lse), jnp.zeros_like(g)


_given.defvjp(_given_fwd, _given_bwd)


def _outputs(out, lse, rows, h, w, labels1, shape, options: Options, statics, return_lse: bool, return_rows: bool):
    """out, or (out, what was asked for beside it): each row's logsumexp of the (capped) logits and
    each row's loss, float32 of the labels' `shape`, each with its gradient (see _given)."""
    lse = jax.lax.stop_gradient(lse)
    extra = []
    if return_lse:
        plain = Options(None, 0.0, 0.0, options.n_cols, False, options.transpose_w, options.soft_cap)
        no_target = jnp.full(labels1.shape, -1, jnp.int32)
        extra.append(_given(h, w, no_target, lse, lse[..., 0] + lse[..., 1], plain, *statics[1:]).reshape(shape))
    if return_rows:
        extra.append(_given(h, w, labels1, lse, jax.lax.stop_gradient(rows), options, *statics[1:]).reshape(shape))
    return (out, *extra) if extra else out


# --------------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------------

def _check(h, w, labels, chunk_rows, transpose_w, op="linear_cross_entropy", weights=None, flags=(False, False),
           mask=None):
    for name, a in (("h", h), ("w", w)):
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            raise TypeError(f"{op}: {name} must be a jax or numpy array; got {type(a).__name__}")
        if a.dtype not in ce.SUPPORTED_DTYPES:
            raise TypeError(f"{op}: {name} must have dtype float32, bfloat16 or float16; got {a.dtype}")
    if h.ndim < 1:
        raise ValueError(f"{op}: h must have a feature axis (last); got a scalar")
    if not isinstance(transpose_w, bool):
        raise TypeError(f"{op}: transpose_w must be a bool; got {transpose_w!r}")
    feature_axis = 1 if transpose_w else 0
    if w.ndim != 2 or w.shape[feature_axis] != h.shape[-1]:
        want = f"(vocabulary, {h.shape[-1]}) (transpose_w: h's last axis second)" if transpose_w else \
            f"({h.shape[-1]}, vocabulary) (h's last axis first)"
        raise ValueError(f"{op}: w must have shape {want}; got {tuple(w.shape)}")
    if w.dtype != h.dtype:
        raise TypeError(f"{op}: w must have h's dtype {h.dtype}; got {w.dtype}")
    if not hasattr(labels, "dtype") or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{op}: labels must be an integer array; got "
                        f"{getattr(labels, 'dtype', type(labels).__name__)}")
    if tuple(labels.shape) != tuple(h.shape[:-1]):
        raise ValueError(f"{op}: labels must have shape {tuple(h.shape[:-1])} (h without its feature "
                         f"axis); got {tuple(labels.shape)}")
    if chunk_rows is not None and not (isinstance(chunk_rows, (int, np.integer)) and not isinstance(chunk_rows, bool)
                                       and chunk_rows >= 1):
        raise ValueError(f"{op}: chunk_rows must be a positive int or None; got {chunk_rows!r}")
    ce.check_weights(op, labels, weights)
    ce.check_mask(op, labels, weights, mask)
    for name, flag in zip(("return_lse", "return_rows"), flags):
        ce.check_bool(op, name, flag)


def linear_cross_entropy(h, w, labels, *, ignore_index: int | None = None,
                         label_smoothing: float = 0.0, z_loss: float = 0.0, reduction: str = "mean",
                         weights=None, mask=None, transpose_w: bool = False, chunk_rows: int | None = None,
                         soft_cap: float | None = None, return_lse: bool = False, return_rows: bool = False,
                         backend: str | None = None):
    """`cross_entropy(h @ w, labels, ...)` without ever holding all the logits: h [..., D],
    w [D, V] (or [V, D] with transpose_w: `h @ w.T`, as a tied embedding table is used), labels
    [...]; options and result as xkern.ops.cross_entropy. chunk_rows: rows whose logits exist at
    once (default: a power of two, 2048 for a 128256 vocabulary in bf16; see CHUNK_BYTES).

    weights: a float per row (labels' shape), such as a padding mask: "none" returns weights * loss,
    "sum" their sum, "mean" that sum over the sum of the weights (0 where they sum to 0). Given here
    rather than applied to reduction="none"'s rows, the gradients are still made in the forward pass
    (reduction "none" must recompute the logits in the backward: one matmul more). mask: with
    weights, a bool per row: rows where it is false add 0 even where their loss is NaN, as
    where(mask, loss * weights, 0) (XLA computes loss * mask.astype(float) so).

    soft_cap: the logits capped first, soft_cap * tanh(h @ w / soft_cap) (Gemma 2's final logits),
    inside the loss kernels: the capped logits never exist either.

    return_lse, return_rows: as cross_entropy's, (loss, lse, rows) as asked; where they are
    differentiated, the logits are recomputed for their gradients (two matmuls more each)."""
    _check(h, w, labels, chunk_rows, transpose_w, weights=weights, flags=(return_lse, return_rows), mask=mask)
    n_cols = w.shape[0 if transpose_w else 1]
    logits_aval = jax.ShapeDtypeStruct((*h.shape[:-1], n_cols), h.dtype)
    smoothing, z_loss = ce._check(logits_aval, labels, ignore_index, label_smoothing, z_loss, reduction,
                                  "linear_cross_entropy")
    options = Options(ignore_index, smoothing, z_loss, n_cols, False, transpose_w,
                      ce.check_soft_cap("linear_cross_entropy", soft_cap), mask is not None)
    return _apply(h, w, labels, options, reduction, chunk_rows, backend, _masked(weights, mask, labels), return_lse,
                  return_rows)


def one_hot_linear_cross_entropy(h, w, labels, *, label_smoothing: float = 0.0, z_loss: float = 0.0,
                                 reduction: str = "mean",
                                 weights=None, mask=None, transpose_w: bool = False, chunk_rows: int | None = None,
                                 soft_cap: float | None = None, return_lse: bool = False, return_rows: bool = False,
                                 backend: str | None = None):
    """`-sum(one_hot(labels, V) * log_softmax(h @ w), -1)`, reduced, as programs write it: a label
    outside [0, V) is a row of zeros, label_smoothing smooths the target as optax.smooth_labels and
    z_loss adds z * logsumexp^2 to every row (see xkern.kernels.cross_entropy.one_hot_cross_entropy);
    weights, mask, soft_cap, return_lse and return_rows as linear_cross_entropy's.
    What the patterns replace such programs with; for new code, `linear_cross_entropy`."""
    op = "one_hot_linear_cross_entropy"
    _check(h, w, labels, chunk_rows, transpose_w, op, weights, (return_lse, return_rows), mask)
    n_cols = w.shape[0 if transpose_w else 1]
    smoothing, z_loss = ce._check(jax.ShapeDtypeStruct((*h.shape[:-1], n_cols), h.dtype), labels, None,
                                  label_smoothing, z_loss, reduction, op)
    options = Options(None, smoothing, z_loss, n_cols, True, transpose_w, ce.check_soft_cap(op, soft_cap),
                      mask is not None)
    return _apply(h, w, labels, options, reduction, chunk_rows, backend, _masked(weights, mask, labels), return_lse,
                  return_rows)


def _masked(weights, mask, labels):
    """The weights, 0 where the mask is false (then Options.masked: those rows add 0 whatever their loss)."""
    if mask is None:
        return weights
    return jnp.where(jnp.asarray(mask).reshape(labels.shape), jnp.asarray(weights).reshape(labels.shape), 0)


def _row_weights(labels, options: Options, reduction, weights):
    """Each row's factor in the reduced loss (see linear_cross_entropy's weights), float32."""
    return ce.row_weights(labels, options.ignore_index, reduction, weights)


def _reference_rows(h, w, labels, options: Options):
    if options.one_hot:
        logits = jnp.matmul(h, w.T if options.transpose_w else w)
        return ce.one_hot_cross_entropy(logits, labels, label_smoothing=options.smoothing, z_loss=options.z_loss,
                                        soft_cap=options.soft_cap, backend="xla")
    return reference(h, w, labels, options.transpose_w, ignore_index=options.ignore_index,
                     label_smoothing=options.smoothing, z_loss=options.z_loss, reduction="none",
                     soft_cap=options.soft_cap)


def _apply(h, w, labels, options: Options, reduction, chunk_rows, backend, weights=None, return_lse=False,
           return_rows=False):
    backend = L.resolve_backend(backend)
    h, w, labels = jnp.asarray(h), jnp.asarray(w), ce.int32_labels(labels, options.ignore_index)
    if backend == "xla" or h.size == 0 or options.n_cols == 0:
        rows = _reference_rows(h, w, labels, options)
        if reduction == "none":
            out = rows if weights is None else ce.weighted_rows(rows, weights, options.masked)
        else:
            out = ce._sum(rows, _row_weights(labels, options, reduction, weights), options.masked)
        logits = jnp.matmul(h, w.T if options.transpose_w else w)
        return ce._reference_outputs(out, rows, logits, options.soft_cap, return_lse, return_rows)
    # The rows' dims kept (a batch and a sequence, which a mesh may shard: _split_rows); one row made of none.
    h, y = (h, labels) if labels.ndim else (h.reshape(1, -1), labels.reshape(1))
    chunk = chunk_rows or default_chunk_rows(y.size, options.n_cols, h.dtype.itemsize)
    statics = (options, int(chunk), backend, ce.default_config(options.n_cols, backend))
    if reduction == "none":
        rows, lse = _rows(h, w, y, *statics)
        out = rows.reshape(labels.shape)
        out = out if weights is None else ce.weighted_rows(out, weights, options.masked)
    else:  # the kernel zeroes ignored rows; the weights' own gradient, if asked for, flows through _row_weights
        out, lse, rows = _weighted_sum(h, w, y, _row_weights(y, options, reduction, weights), *statics)
    return _outputs(out, lse, rows, h, w, y, labels.shape, options, statics, return_lse, return_rows)
