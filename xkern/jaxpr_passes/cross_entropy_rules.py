"""Softmax cross-entropy with integer labels over the last axis, in the ways people write it,
replaced by xkern.ops.cross_entropy(reduction="none") (a float32 loss per row; cast back to the
program's dtype where the program computed in half precision); its mean or sum over every row (or
that of the rows times a weight each, a padding mask), by cross_entropy(reduction="mean" / "sum",
weights=...), and that of where(mask, rows, 0) (HF's -100 labels) by where_masked_sum, or each
example's weighted sum over its own count first, sum(rows * mask, -1) / n (a loss normalized per
sequence: n = sum(mask, -1), maximum(sum(mask, -1), 1), the lengths; jax.vmap of a per-example
masked mean) with the weights mask / n, or that of where(mask, rows, 0) (jnp.mean(rows, axis=-1,
where=mask)) by where_masked_sum with those weights, each sum also
over a scalar (the mask's sum, a token count), one-hot targets' too by one_hot_cross_entropy(weights=
...), each row's loss less a scalar first or not (`(loss - c) * weights`: c's share is subtracted
after the kernel). Their forwards also write the logits' gradient when the program is differentiated (so the
backward never reads the logits: on Hopper they are read once), with every scale of the reduction
in it (a scale left after the kernel would rescale the gradient in one more pass).

With the final projection: the mean or sum of any of these over logits = h @ w (jnp's matmul / dot /
einsum, or lax.dot_general as flax's Dense spells it) or over a tied embedding table's h @ table.T
(flax's Embed.attend, einsum "...d,vd->...v"), the logits used nowhere else, is replaced by
xkern.ops.linear_cross_entropy, which never holds all the logits; so is the sum or mean of the rows'
losses times a weight each (a padding mask), each sum also over a scalar, each also scaled by a
constant or a given scalar (traced where the scaled reduction is found), the rows less a scalar
first (HF's summarization), then over a scalar or a constant, the rows normalized per example, and
the rows masked by `where` (HF's -100 labels): a row it drops is given h = 0 and label 0, so it adds 0 to the loss and the gradients
even where its h is not finite (under jax.jit the gradients are then NaN). The plain and padding-masked
means and sums also over soft-capped logits, tanh(h @ w / c) * c (Gemma 2's final logits, as the gemma
library and MaxText write them): the cap goes into the loss kernels (their soft_cap), so neither the
logits nor the capped logits exist; traced only for programs holding a tanh. Each row loss's 24 plain
LM-head patterns and its reductions (plain, masked, shifted) are traced only for programs where that
row loss is found (`Pattern.extends`), each reduction's scaled forms and LM heads only where that
reduction is found, and the row losses only for programs holding what they all do (`_requires`):
the main job's first plan of its transformer loss traces them in 2.6-2.9 s (CPU), as before the
scaled, shifted and where-masked LM heads.

Spellings: optax.softmax_cross_entropy_with_integer_labels (traced from the installed optax, when
there is one); logsumexp minus the label's logit through take_along_axis; minus the label's entry
of log_softmax (or that entry kept as [..., 1], negated after a mean); each also on half-precision
logits upcast to float32. Like take_along_axis, the
replacement counts negative labels from the end; labels still out of range give NaN, as the
program's gather does. NumPy indexing of [n, V] logits, `log_softmax(logits)[jnp.arange(n), labels]`
(and logsumexp minus `logits[jnp.arange(n), labels]`): negative labels count from the end; one
still out of range is clamped into range, as indexing's forward does. The gradient of such a row
differs from jax.jit's: jax.jit's scatter drops the index, so its gradient there is 0 (while its
loss counts the clamped label); the kernels' is the clamped label's. Masked rows (HF's -100 labels,
masked after the loss) are 0 in both. One-hot targets, -sum(jax.nn.one_hot(labels, V) * log_softmax(logits))
(optax.softmax_cross_entropy's program): there a label out of range is a row of zeros (loss 0), and
a non-finite logit outside the label's class makes the loss NaN (0 * inf), but for a -inf one where
XLA computes one_hot * log_softmax as a select (lowering.xla_selects_bool_product: the CPU in
float32 and float16, the GPU): the kernel does the same (the LM head's keeps 0 * -inf = NaN).
log_softmax may be written out, x - logsumexp(x, keepdims=True) (t5x's and MaxText's
cross_entropy_with_logits), with integer or one-hot targets, the label's log-probability also
negated after the mean. Integer labels of any integer dtype are read as the gather reads them,
converted to int32 (canonicalize casts them before labels[..., None]), and a last batch axis of
size 1 (one row; one token per example) is gathered as the others (canonicalize).
Smoothed one-hot targets, optax.smooth_labels(one_hot, e) = (1 - e) * one_hot + e / V: the kernels'
label smoothing, e read off the program's two literals. PaLM's z-loss, the row loss plus
z * logsumexp(logits)^2 (that of the loss, or one computed beside optax's or log_softmax's; with
integer labels or one-hot targets, t5x's cross_entropy_with_logits written out): the kernels' z_loss,
z read off the program.
"""
from __future__ import annotations

import functools
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np

from xkern.fusion.lowering import xla_selects_bool_product
from xkern.jaxpr_passes.patterns import Pattern, literal_at, logsumexps_in, soft_cap_at
from xkern.kernels import cross_entropy as kernels
from xkern.kernels import linear_cross_entropy as linear_kernels

ALL = (jnp.float32, jnp.bfloat16, jnp.float16)
HALF = (jnp.bfloat16, jnp.float16)


def logsumexp_minus_label(logits, labels):
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def minus_log_softmax_at_label(logits, labels):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None], axis=-1)[..., 0]


def log_softmax_at_label(logits, labels):
    """The log-probability of the label, kept as [..., 1] (the loss is its negated mean)."""
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None], axis=-1)


def _log_probabilities(logits):
    """log_softmax written out, as t5x's and MaxText's cross_entropy_with_logits do."""
    return logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)


def minus_log_probability_at_label(logits, labels):
    return -jnp.take_along_axis(_log_probabilities(logits), labels[..., None], axis=-1)[..., 0]


def log_probability_at_label(logits, labels):
    """The label's log-probability, log_softmax written out (the loss is its negated mean)."""
    return jnp.take_along_axis(_log_probabilities(logits), labels[..., None], axis=-1)[..., 0]


def one_hot_log_probabilities(logits, labels):
    return -jnp.sum(jax.nn.one_hot(labels, logits.shape[-1]) * _log_probabilities(logits), axis=-1)


def optax_integer_labels(logits, labels):
    import optax
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def one_hot_log_softmax(logits, labels):
    """optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, V)) is this same program."""
    one_hot = jax.nn.one_hot(labels, logits.shape[-1])
    return -jnp.sum(one_hot * jax.nn.log_softmax(logits, axis=-1), axis=-1)


def one_hot_in_logits_dtype_log_softmax(logits, labels):
    one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    return -jnp.sum(one_hot * jax.nn.log_softmax(logits, axis=-1), axis=-1)


def smoothed_one_hot_log_softmax(logits, labels, smoothing):
    """optax.softmax_cross_entropy(logits, optax.smooth_labels(jax.nn.one_hot(labels, V), smoothing))."""
    n_cols = logits.shape[-1]
    target = (1.0 - smoothing) * jax.nn.one_hot(labels, n_cols) + smoothing / n_cols
    return -jnp.sum(target * jax.nn.log_softmax(logits, axis=-1), axis=-1)


SMOOTHING_EXAMPLE = 0.0371  # traced with a distinctive smoothing, whose literals are read back


def _smoothing_of(match, n_cols: int, example_cols: int) -> float:
    """The smoothing e of a matched smoothed one-hot target, (1 - e) * one_hot + e / V: read off its
    two float32 literals, as a float that gives both back when the pattern is traced again."""
    keep = literal_at(match, 1.0 - SMOOTHING_EXAMPLE)
    spread = literal_at(match, SMOOTHING_EXAMPLE / example_cols)
    for e in (spread * n_cols, 1.0 - keep):
        if np.float32(1.0 - e) == np.float32(keep) and np.float32(e / n_cols) == np.float32(spread):
            return e
    return 1.0 - keep  # inconsistent literals: the exact trace will not match, and says so


def flax_onehot_log_softmax(logits, labels, smoothing):
    """optax.softmax_cross_entropy(logits, flax.training.common_utils.onehot(labels, V, on, off)): HF's
    Flax examples' loss, where they smooth on = 1 - s and off = s / (V - 1), the kernels' smoothing
    e = off * V (on = 1 - e + e / V); plain, on = 1 and off = 0."""
    from flax.training import common_utils
    n_cols = logits.shape[-1]
    target = common_utils.onehot(labels, n_cols, on_value=1.0 - smoothing + smoothing / n_cols,
                                 off_value=smoothing / n_cols)
    return -jnp.sum(target * jax.nn.log_softmax(logits, axis=-1), axis=-1)


def _on_off_smoothing_of(match, n_cols: int, example_cols: int) -> float:
    """The smoothing e of a matched flax onehot target, read off its on and off values (as
    _smoothing_of: one that gives both back, else one the exact trace will decline)."""
    example_off = SMOOTHING_EXAMPLE / example_cols
    on, off = literal_at(match, 1.0 - SMOOTHING_EXAMPLE + example_off), literal_at(match, example_off)
    for e in (off * n_cols, (1.0 - on) * n_cols / max(n_cols - 1, 1)):
        if np.float32(1.0 - e + e / n_cols) == np.float32(on) and np.float32(e / n_cols) == np.float32(off):
            return e
    return off * n_cols


Z_LOSS_EXAMPLE = 3.71e-4  # likewise for a z-loss's weight


def logsumexp_minus_label_z_loss(logits, labels, z_loss):
    """With PaLM's auxiliary z-loss, z * logsumexp(logits)^2 per row, from the loss's own logsumexp."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return lse - picked + z_loss * jnp.square(lse)


def minus_log_softmax_at_label_z_loss(logits, labels, z_loss):
    return minus_log_softmax_at_label(logits, labels) + z_loss * jnp.square(jax.nn.logsumexp(logits, axis=-1))


def minus_log_probability_at_label_z_loss(logits, labels, z_loss):
    """log_softmax written out beside the z-loss, as t5x's cross_entropy_with_logits computes both
    (there with one-hot targets)."""
    log_z = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    loss = -jnp.take_along_axis(logits - log_z, labels[..., None], axis=-1)[..., 0]
    return loss + z_loss * jnp.square(jnp.squeeze(log_z, axis=-1))


def one_hot_log_probabilities_z_loss(logits, labels, z_loss):
    """t5x's cross_entropy_with_logits written out (without its custom_vjp), one-hot targets."""
    log_z = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    loss = -jnp.sum(jax.nn.one_hot(labels, logits.shape[-1]) * (logits - log_z), axis=-1)
    return loss + z_loss * jnp.square(jnp.squeeze(log_z, axis=-1))


def one_hot_log_softmax_z_loss(logits, labels, z_loss):
    return one_hot_log_softmax(logits, labels) + z_loss * jnp.square(jax.nn.logsumexp(logits, axis=-1))


def optax_integer_labels_z_loss(logits, labels, z_loss):
    return optax_integer_labels(logits, labels) + z_loss * jnp.square(jax.nn.logsumexp(logits, axis=-1))


def _params_of(param: str | None, vocab, example_cols: int):
    """Reads a pattern's param off a match: "smoothing" (a smoothed one-hot target's) or "z_loss"
    (the z-loss's weight); vocab(match) is the matched logits' width."""
    if param == "smoothing":
        return lambda match: {"smoothing": _smoothing_of(match, vocab(match), example_cols)}
    if param == "on_off":  # (the same param, read off flax's onehot)
        return lambda match: {"smoothing": _on_off_smoothing_of(match, vocab(match), example_cols)}
    if param == "z_loss":
        return lambda match: {"z_loss": literal_at(match, Z_LOSS_EXAMPLE)}
    return lambda match: {}


EXAMPLE_PARAMS = {None: {}, "smoothing": {"smoothing": SMOOTHING_EXAMPLE}, "on_off": {"smoothing": SMOOTHING_EXAMPLE},
                  "z_loss": {"z_loss": Z_LOSS_EXAMPLE}}


def one_hot_log_probability(logits, labels):
    """The label's log-probability through the one-hot target (the loss is its negated mean)."""
    return jnp.sum(jax.nn.one_hot(labels, logits.shape[-1]) * jax.nn.log_softmax(logits, axis=-1), axis=-1)


def one_hot_written_log_probability(logits, labels):
    """The same, log_softmax written out."""
    return jnp.sum(jax.nn.one_hot(labels, logits.shape[-1]) * _log_probabilities(logits), axis=-1)


def _rows(logits):
    return jnp.arange(logits.shape[0])


def minus_log_softmax_indexed(logits, labels):
    """-log_softmax(logits)[jnp.arange(n), labels]: NumPy indexing of [n, V] logits."""
    return -jax.nn.log_softmax(logits, axis=-1)[_rows(logits), labels]


def log_softmax_indexed(logits, labels):
    return jax.nn.log_softmax(logits, axis=-1)[_rows(logits), labels]


def logsumexp_minus_indexed(logits, labels):
    return jax.nn.logsumexp(logits, axis=-1) - logits[_rows(logits), labels]


def upcast(fn):
    def pattern(logits, labels, **params):
        return fn(logits.astype(jnp.float32), labels, **params)
    pattern.__name__ = f"{fn.__name__}_upcast"
    return pattern


def _per_row_loss(logits, labels, how: str, backend, smoothing=0.0, z_loss=0.0, provide=False, selected=False):
    """The loss per row, with the labels read as the program reads them: "take_along_axis" and NumPy
    "indexing" count negative labels from the end; one still out of range is NaN, as take_along_axis's
    gather fills, and clamped into range by indexing, as its forward does (HF's -100 labels, masked
    after the loss: finite, as under jax.jit; indexing's gradient drops such a label, the kernels'
    is the clamped label's, the same wherever the row is masked); "one_hot" makes a label out of
    range a row of zeros (selected: see _selected)."""
    if how == "one_hot":
        return kernels.one_hot_cross_entropy(logits, labels, label_smoothing=smoothing, z_loss=z_loss,
                                             return_lse=provide, selected=selected, backend=backend)
    return kernels.cross_entropy(logits, _labels_as_read(labels, how, logits.shape[-1]), z_loss=z_loss,
                                 reduction="none", return_lse=provide, backend=backend)


def _selected(loss_fn, labels_as, param, logits, labels) -> bool:
    """Whether the program's one_hot * log-probabilities is select(one_hot, ..., 0) under XLA here
    (lowering.xla_selects_bool_product, in the product's dtype, the row loss's): then a logit of
    -inf outside the label's class adds 0 to the loss, not 0 * -inf = NaN, and the kernels must
    too (jax.nn.one_hot's targets; smoothed ones or flax's are no converted bool)."""
    if labels_as != ONE_HOT or param not in (None, "z_loss"):
        return False
    rows = jax.eval_shape(functools.partial(loss_fn, **EXAMPLE_PARAMS[param]), logits, labels)
    return xla_selects_bool_product((np.dtype(rows.dtype).name,))


def _labels_as_read(labels, how: str, classes: int):
    """Integer labels as take_along_axis / indexing read them (see _per_row_loss)."""
    labels = jnp.where(labels < 0, labels + classes, labels)
    return jnp.clip(labels, 0, classes - 1) if how == INDEXING else labels


def _requires(labels_as: str) -> frozenset:
    """What a program with such a loss holds (Pattern.requires): logsumexp or log_softmax's max and
    log, and the labels' gather, or jax.nn.one_hot's iota and eq. The patterns are traced only for
    programs that do (the LM-head ones, also only where their row loss is found)."""
    return frozenset({"reduce_max", "log"} | ({"iota", "eq"} if labels_as == "one_hot" else {"gather"}))


def _split_dims(labels_as: str, vocab_of=None):
    """Pattern.split_dims: the rows' first dim, and (kernels/cross_entropy's split) either the
    vocabulary that tensor parallelism shards, where the kernels split it (kernels.vocab_splits),
    the logits' last dim (input 0; one-hot targets' too), or any of the rows' other dims (the
    kernels' views keep them). The LM head's (vocab_of(i): input i's vocabulary dim, None for an
    input without one; kernels/linear_cross_entropy._split_rows): h's rows' dims (input 0, all but
    the features) and labels' and weights' (all), and w's first dim and its vocabulary."""
    def split_dims(i: int, ndim: int, params: dict) -> list:
        splits = kernels.vocab_splits(labels_as == ONE_HOT, params.get("smoothing", 0.0), params.get("z_loss", 0.0))
        if vocab_of is not None:
            rows = set(range(ndim - 1 if i == 0 else ndim))
            return [{0} | ({vocab_of(i)} - {None} if splits else set())] if vocab_of(i) is not None else [rows]
        has_vocab = i == 0 or i == 1 and labels_as == ONE_HOT
        n_rows_dims = ndim - 1 if has_vocab else ndim
        first = {0} if n_rows_dims else set()
        along = [first | set(range(1, n_rows_dims))] if n_rows_dims > 1 else []
        return ([first | {ndim - 1}] if splits and has_vocab else [first]) + along
    return split_dims


def _check_params(params) -> str | None:
    smoothing, z_loss = params.get("smoothing", 0.0), params.get("z_loss", 0.0)
    if not 0.0 <= smoothing <= 1.0:
        return f"label smoothing {smoothing} is outside [0, 1]"
    if not (0.0 <= z_loss < float("inf")):
        return f"z-loss weight {z_loss}: the kernels take a finite weight >= 0"
    return None


def _check(match, params) -> str | None:
    logits, labels = match.input_avals[:2]
    if logits.dtype not in ALL:
        return f"dtype {logits.dtype}: the cross-entropy kernels take float32, bfloat16 and float16"
    if logits.ndim < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        return "labels are not one per row of logits"
    return _check_params(params)


def _pattern(name, fn, dtypes, cast_to_input: bool, log_probability: bool = False, labels_as="take_along_axis",
             param=None):
    def replace(logits, labels, *, backend, provide=False, **params):
        loss = _per_row_loss(logits, labels, labels_as, backend, provide=provide,
                             selected=_selected(fn, labels_as, param, logits, labels), **params)
        loss, given = (loss[0], {"logsumexp": loss[1]}) if provide else (loss, None)
        if log_probability:
            loss = -loss
        shape = jax.eval_shape(functools.partial(fn, **params), logits, labels).shape
        loss = loss.reshape(shape)  # [..., 1] where the program keeps it
        loss = loss.astype(logits.dtype) if cast_to_input else loss
        return (loss, given) if provide else loss
    return Pattern(
        name=name, op="cross_entropy", fn=fn, dtypes=dtypes,
        example=lambda dtype: (jax.ShapeDtypeStruct((4, 8), dtype), jax.ShapeDtypeStruct((4,), jnp.int32)),
        params_of=_params_of(param, lambda match: match.input_avals[0].shape[-1], 8), check=_check,
        replace=replace, example_params=EXAMPLE_PARAMS[param], requires=_requires(labels_as),
        provides=logsumexps_in, split_dims=_split_dims(labels_as))



TAKE, ONE_HOT, INDEXING = "take_along_axis", "one_hot", "indexing"


def _spelling(name, fn, cast_to_input=True, log_probability=False, labels_as=TAKE, param=None, dtypes=ALL,
              upcast_too=True) -> list[tuple]:
    """A row loss as (name, fn, dtypes, cast to the input dtype, log-probability, labels as, its param:
    None, "smoothing", "on_off" (a smoothing read off a target's on and off values) or "z_loss"), and
    (upcast_too) the same on half-precision logits upcast to float32 first."""
    rows = [(name, fn, dtypes, cast_to_input, log_probability, labels_as, param)]
    if upcast_too:
        rows.append((f"{name}+upcast", upcast(fn), HALF, False, log_probability, labels_as, param))
    return rows


_ROW_LOSSES = [
    *_spelling("logsumexp-take_along_axis", logsumexp_minus_label),
    *_spelling("-take_along_axis(log_softmax)", minus_log_softmax_at_label),
    *_spelling("take_along_axis(log_softmax)", log_softmax_at_label, log_probability=True),
    # one-hot targets: float32 (jax.nn.one_hot's default) or in the logits' half-precision dtype
    *_spelling("one_hot*log_softmax", one_hot_log_softmax, False, labels_as=ONE_HOT),
    *_spelling("one_hot(dtype=logits')*log_softmax", one_hot_in_logits_dtype_log_softmax, labels_as=ONE_HOT,
               dtypes=HALF, upcast_too=False),
    *_spelling("sum_classes(one_hot*log_softmax)", one_hot_log_probability, False, True, ONE_HOT),
    # log_softmax written out, x - logsumexp(x, keepdims=True)
    *_spelling("-take_along_axis(x-logsumexp)", minus_log_probability_at_label),
    *_spelling("one_hot*(x-logsumexp)", one_hot_log_probabilities, False, labels_as=ONE_HOT),
    # their log-probabilities, the loss negated after the mean
    *_spelling("take_along_axis(x-logsumexp)", log_probability_at_label, log_probability=True),
    *_spelling("sum_classes(one_hot*(x-logsumexp))", one_hot_written_log_probability, False, True, ONE_HOT),
    # optax.smooth_labels of a one-hot target: the kernels' label smoothing
    *_spelling("smooth_labels(one_hot)*log_softmax", smoothed_one_hot_log_softmax, False, labels_as=ONE_HOT,
               param="smoothing"),
    # PaLM's z-loss: + z * logsumexp^2 (with one-hot targets, on a label out of range too)
    *_spelling("logsumexp-take_along_axis+z*logsumexp^2", logsumexp_minus_label_z_loss, param="z_loss"),
    *_spelling("-take_along_axis(log_softmax)+z*logsumexp^2", minus_log_softmax_at_label_z_loss, param="z_loss"),
    *_spelling("-take_along_axis(x-logsumexp)+z*logsumexp^2", minus_log_probability_at_label_z_loss,
               param="z_loss"),
    *_spelling("one_hot*(x-logsumexp)+z*logsumexp^2", one_hot_log_probabilities_z_loss, False, labels_as=ONE_HOT,
               param="z_loss"),
    *_spelling("one_hot*log_softmax+z*logsumexp^2", one_hot_log_softmax_z_loss, False, labels_as=ONE_HOT,
               param="z_loss"),
    # NumPy indexing of [n, V] logits
    *_spelling("-log_softmax[rows, labels]", minus_log_softmax_indexed, labels_as=INDEXING),
    *_spelling("log_softmax[rows, labels]", log_softmax_indexed, log_probability=True, labels_as=INDEXING),
    *_spelling("logsumexp-logits[rows, labels]", logsumexp_minus_indexed, labels_as=INDEXING),
]
if importlib.util.find_spec("flax") is not None:  # (as optax: a test dependency)
    _ROW_LOSSES += _spelling("flax_onehot*log_softmax", flax_onehot_log_softmax, False, labels_as=ONE_HOT,
                             param="on_off")
if importlib.util.find_spec("optax") is not None:  # optax is optional: a test dependency
    _ROW_LOSSES += _spelling("optax_integer_labels", optax_integer_labels)
    _ROW_LOSSES += _spelling("optax_integer_labels+z*logsumexp^2", optax_integer_labels_z_loss, param="z_loss")
PATTERNS = [_pattern(f"cross_entropy/{name}", *rest) for name, *rest in _ROW_LOSSES]


# --------------------------------------------------------------------------------------------------
# The projection and the loss together: linear_cross_entropy
# --------------------------------------------------------------------------------------------------

def jnp_matmul(h, w):
    return jnp.matmul(h, w)


def lax_dot_general(h, w):
    """flax.linen.Dense's projection (no preferred element type)."""
    return jax.lax.dot_general(h, w, (((h.ndim - 1,), (0,)), ((), ())))


def matmul_transposed(h, table):
    """Tied embeddings, table [V, D]: h @ table.T (flax's Embed.attend is jnp.dot(h, table.T))."""
    return jnp.matmul(h, table.T)


def einsum_transposed(h, table):
    return jnp.einsum("...d,vd->...v", h, table)


TRANSPOSED = (matmul_transposed, einsum_transposed)


# How a reduced loss may be scaled after its reduction: over or times a scalar input (the mask's sum,
# a token count; a dynamic loss scale), or times or over a literal (a gradient accumulation's step
# count, a loss's weight), traced with a distinctive value and read back
DIVIDED, TIMES_D, TIMES_C, OVER_C = "/ d", "* d", "* c", "/ c"
SCALE_EXAMPLE = 0.713
CAP_EXAMPLE = 29.7  # a soft cap of the logits, likewise (Gemma 2's is 30)
# How a reduced loss masks its rows: times a weight, or where(mask, rows, 0); or each example's
# weighted sum over a count of its own first, sum(rows * mask, -1) / n (a loss normalized per
# sequence, n = sum(mask, -1), its maximum with 1, the lengths given; or a per-example masked mean
# mapped by jax.vmap), n the pattern's input after the mask; or that of where(mask, rows, 0)
# (jnp.mean(rows, axis=-1, where=mask))
WEIGHTS, WHERE, NORMALIZED, NORMALIZED_WHERE = "weights", "where", "normalized", "normalized where"
PER_EXAMPLE, KEEPS = (NORMALIZED, NORMALIZED_WHERE), (WHERE, NORMALIZED_WHERE)


def _rows_name(loss: str, masked, shifted: bool) -> str:
    loss = f"({loss} - c)" if shifted else loss
    return {None: loss, WEIGHTS: f"{loss} * weights", WHERE: f"where(mask, {loss}, 0)",
            NORMALIZED: f"sum({loss} * weights, -1) / n",
            NORMALIZED_WHERE: f"sum(where(mask, {loss}, 0), -1) / n"}[masked]


def _reduce_rows(rows, rest, scale, reduce, log_probability, masked, post, shifted, bool_mask=False):
    """The row losses shifted, masked, reduced and scaled as a reduced pattern says (see _reduced;
    rest: the pattern's inputs after the labels); bool_mask: the weights are a converted bool, and
    rows of weight 0 add 0 whatever their loss (see _bool_mask)."""
    if shifted:
        rows = rows - rest[1 if masked else 0]
    if bool_mask:
        rows = jnp.where(rest[0] != 0, rows, 0.0)
    if masked in PER_EXAMPLE:
        kept = rows * rest[0] if masked == NORMALIZED else jnp.where(rest[0], rows, 0.0)
        rows = jnp.sum(kept, -1) / rest[1]
    elif masked:
        rows = rows * rest[0] if masked == WEIGHTS else jnp.where(rest[0], rows, 0.0)
    out = reduce(rows)
    return _post(-out if log_probability else out, post, rest, scale)


def _bool_mask(match, index: int) -> bool:
    """Whether the pattern's input `index` (a mask of weights) is a bool converted to a float in the
    program, in a product that XLA simplifies to select(mask, x, 0) (on this platform, in this dtype:
    see lowering.xla_selects_bool_product). Then under jax.jit a row of weight 0 adds 0 even where
    its loss is NaN (a label of -100, out of range, gathered as NaN); the replacement must keep
    that, not compute NaN * 0."""
    var = match.inputs[index]
    if var.aval.dtype == jnp.bool_:  # (normalized per example: the template converts it to the rows' dtype)
        return xla_selects_bool_product((np.dtype(match.graph.eqns[match.anchor].outvars[0].aval.dtype).name,))
    if var not in match.graph.producer:
        return False
    eqn = match.graph.eqns[match.graph.producer[var][0]]
    return eqn.primitive.name == "convert_element_type" and eqn.invars[0].aval.dtype == jnp.bool_ and \
        xla_selects_bool_product((np.dtype(var.aval.dtype).name,))


def _with_bool_mask(masked, index: int, params_of):
    """params_of, with bool_mask=True where a multiplied mask (WEIGHTS, NORMALIZED) is a converted bool."""
    if masked not in (WEIGHTS, NORMALIZED):
        return params_of
    return lambda match: {**params_of(match), **({"bool_mask": True} if _bool_mask(match, index) else {})}


def _empty_examples(loss, labels, masked, rest, bool_mask):
    """Normalized per example by a converted bool mask (bool_mask: its rows dropped by a select, as
    XLA's): an example with no kept row and a count of 0 is 0 / 0 = NaN in the program, where its
    dropped rows' weights give 0."""
    if not (bool_mask and masked == NORMALIZED):
        return loss
    kept = jnp.any(rest[0].reshape(labels.shape) != 0, -1)
    empty = jnp.any((rest[1].reshape(labels.shape[:-1]) == 0) & ~kept)
    return loss + jax.lax.stop_gradient(jnp.where(empty, jnp.nan, 0.0))


def _divided_by_zero(loss, post, rest):
    """A sum over a scalar d (DIVIDED), d folded into the rows' weights: where d is 0 and the rows
    add nothing (every row masked), the program's 0 / 0 is NaN, where the folded weights
    (where(mask, 1 / 0, 0)) give 0."""
    if post != DIVIDED:
        return loss
    # (added, not selected: the loss's cotangent stays jax.grad's constant 1, which XLA folds away)
    return loss + jax.lax.stop_gradient(jnp.where((rest[-1] == 0) & (loss == 0), jnp.nan, 0.0))


def _post(out, post, rest, scale=None):
    """out scaled as `post` says (None: as it is), by the pattern's last input or the literal scale."""
    if post in (DIVIDED, OVER_C):
        return out / (rest[-1] if post == DIVIDED else scale)
    return out * (rest[-1] if post == TIMES_D else scale) if post else out


def _row_weights(masked, rest, labels):
    """Each row's weight from the pattern's mask (its first input after the labels), in float32:
    the mask itself (WEIGHTS; WHERE's as 0 or 1), or over its example's count (NORMALIZED: a count
    of 0 gives NaN or inf weights, as the program's 0 / 0 or x / 0)."""
    if not masked:
        return 1.0
    weights = rest[0].reshape(labels.shape).astype(jnp.float32)
    if masked in PER_EXAMPLE:
        return weights / rest[1].reshape(labels.shape[:-1]).astype(jnp.float32)[..., None]
    return weights


def _reduced_count(masked, labels) -> int:
    """How many values the reduction takes: the rows, or (normalized per example) the examples."""
    return math.prod(labels.shape[:-1]) if masked in PER_EXAMPLE else labels.size


def _reduction_scale(reduce, n_rows, folded, post, rest, params):
    """Each row's factor in a reduction whose scales go into the rows' weights (folded: the mean's
    1 / n too, else the kernels take it): one left after the kernel would be the cotangent of its
    sum, and the backward would scale dx by it, one more pass over the logits' size."""
    scale = 1.0 / n_rows if reduce is mean and folded else 1.0
    if post in (DIVIDED, TIMES_D):
        d = rest[-1].astype(jnp.float32)
        return scale / d if post == DIVIDED else scale * d
    if post in (TIMES_C, OVER_C):
        return scale * params["scale"] if post == TIMES_C else scale / params["scale"]
    return scale


def _scalar_reason(match, post) -> str | None:
    if post in (DIVIDED, TIMES_D) and match.input_avals[-1].shape != ():
        return f"the reduced loss is scaled by a {list(match.input_avals[-1].shape)} array ({post}), not a scalar"
    return None


def _literal_reason(post, params) -> str | None:
    if post in (TIMES_C, OVER_C) and not (np.isfinite(params["scale"]) and (post == TIMES_C or params["scale"] != 0)):
        return f"the reduced loss is scaled by {params['scale']} ({post}): the kernels take a finite factor"
    return None


def _empty_reason(labels) -> str | None:
    """A reduction of no rows is left to XLA: nothing to move, and its folded scales would divide
    by the count of nothing (a mean of nothing is NaN, a sum 0)."""
    return f"no rows to reduce (labels {list(labels.shape)})" if labels.size == 0 else None


def _mask_reason(rest, labels, masked) -> str | None:
    """Why the mask a pattern matched (rest: its inputs after the labels) cannot weight the rows
    (labels: one per row), or None."""
    mask = rest[0]
    if masked in PER_EXAMPLE:
        number = lambda a: jnp.issubdtype(a.dtype, jnp.number) or a.dtype == jnp.bool_
        if tuple(mask.shape) != tuple(labels.shape) or not (number(mask) if masked == NORMALIZED else
                                                            mask.dtype == jnp.bool_):
            return f"the losses are weighted by {mask.dtype}{list(mask.shape)}, not a number per row"
        if tuple(rest[1].shape) != tuple(labels.shape[:-1]) or not number(rest[1]):
            return f"each example's sum is divided by {rest[1].dtype}{list(rest[1].shape)}, not a number per example"
        return None
    kind = jnp.floating if masked == WEIGHTS else jnp.bool_
    if mask.size != labels.size or not jnp.issubdtype(mask.dtype, kind):
        return f"the losses are masked by {mask.dtype}{list(mask.shape)}, not a {masked} per row"
    return None


def _shift_reason(shift) -> str | None:
    if shift.shape != () or not jnp.issubdtype(shift.dtype, jnp.floating):
        return f"the losses are shifted by {shift.dtype}{list(shift.shape)}, not a float scalar"
    return None


def _with_literal_scale(post, params_of, example_params):
    """(params_of, example params) of a pattern whose reduction is scaled as `post` says: a literal
    scale (TIMES_C, OVER_C) is read off the program, traced as SCALE_EXAMPLE."""
    if post not in (TIMES_C, OVER_C):
        return params_of, example_params
    return (lambda match: {**params_of(match), "scale": literal_at(match, SCALE_EXAMPLE)},
            {**example_params, "scale": SCALE_EXAMPLE})


def _with_mask_dtypes(dtypes, masked):
    """A weighted pattern's dtypes as (the logits' or h's, the mask's): the mask in their dtype, or
    float32 (half-precision rows promoted). Normalized per example, (..., the count's) with a mask
    of those or bool (HF's attention_mask, converted for the product): a count of the product's
    dtype, float32, or int32 (a bool mask's sum)."""
    if masked == NORMALIZED_WHERE:
        return tuple((d, jnp.bool_, n) for d in dtypes for n in dict.fromkeys((d, jnp.float32, jnp.int32)))
    if masked not in (WEIGHTS, NORMALIZED):
        return dtypes
    pairs = tuple((d, d) for d in dtypes) + tuple((d, jnp.float32) for d in dtypes if d in HALF)
    if masked == WEIGHTS:
        return pairs
    return pairs + tuple((d, jnp.bool_, n) for d in dtypes for n in dict.fromkeys((d, jnp.float32, jnp.int32)))


def _mask_example(masked, rows, dtypes, kept_dim: bool) -> tuple:
    """The examples of a pattern's mask, one per row of `rows` (rows [..., 1] of a kept dim), and
    of a normalized one's count per example; dtypes: the pattern's (rows', mask's[, count's])."""
    if not masked:
        return ()
    mask = jax.ShapeDtypeStruct((*rows, 1) if kept_dim else rows, dtypes[1])
    if masked not in PER_EXAMPLE:
        return (mask,)
    return mask, jax.ShapeDtypeStruct(rows[:-1], dtypes[2] if len(dtypes) > 2 else dtypes[1])


def _scalar_example(post, unscaled, param, *avals) -> tuple:
    """The example of a scalar input (DIVIDED, TIMES_D): in the reduced loss's dtype, which programs
    scale it by (a count converted to it); else nothing."""
    if post not in (DIVIDED, TIMES_D):
        return ()
    out = jax.eval_shape(functools.partial(unscaled, **EXAMPLE_PARAMS[param]), *avals)
    return (jax.ShapeDtypeStruct((), out.dtype),)


def _linear(loss_fn, project, reduce, log_probability, masked, post=None, shifted=False, capped=False):
    """reduce(loss_fn(project(h, w), labels)), negated for log-probabilities; shifted: each row's
    loss minus a scalar first, the input after the mask; masked: each row's loss times a weight (a
    padding mask: WEIGHTS) or kept where a boolean mask is true (WHERE), the mask the pattern's
    fourth input; post: then scaled as _reduced's; capped: the logits soft-capped first,
    tanh(logits / cap) * cap, as Gemma 2 caps its final logits (param cap)."""
    def pattern(h, w, labels, *rest, scale=None, cap=CAP_EXAMPLE, bool_mask=False, **params):
        logits = project(h, w)
        if capped:
            logits = jnp.tanh(logits / cap) * cap
        return _reduce_rows(loss_fn(logits, labels, **params), rest, scale, reduce, log_probability,
                            masked, post, shifted)
    projected = f"soft_cap({project.__name__})" if capped else project.__name__
    rows = _rows_name(f"{loss_fn.__name__}({projected})", masked, shifted)
    pattern.__name__ = f"{'-' if log_probability else ''}{reduce.__name__}({rows}){f' {post}' if post else ''}"
    return pattern


def _check_linear(match, params, transposed, post, masked, shifted) -> str | None:
    if reason := _scalar_reason(match, post) or _literal_reason(post, params) or _cap_reason(params):
        return reason
    h, w, labels = match.input_avals[:3]
    if reason := _empty_reason(labels):
        return reason
    if shifted and (reason := _shift_reason(match.input_avals[4 if masked else 3])):
        return reason
    if h.dtype not in ALL or w.dtype != h.dtype:
        return f"dtypes {h.dtype} @ {w.dtype}: linear_cross_entropy takes one float dtype for h and w"
    if w.ndim != 2 or h.ndim < 1 or w.shape[1 if transposed else 0] != h.shape[-1] or \
            tuple(labels.shape) != tuple(h.shape[:-1]):
        return "not h [..., D] @ w [D, V] (or w [V, D] transposed) with one label per row"
    if masked and (reason := _mask_reason(match.input_avals[3:], labels, masked)):
        return reason
    return _check_params({n: v for n, v in params.items() if n not in ("scale", "cap")})


def _cap_reason(params) -> str | None:
    if "cap" in params and not (params["cap"] > 0 and math.isfinite(params["cap"])):
        return (f"tanh(logits / a) * b with a != b, or a cap of {params['cap']}: the kernels take a soft cap, "
                f"one positive finite number")
    return None


def _with_cap(capped, params_of, example_params):
    """(params_of, example params) of a pattern whose logits are soft-capped: the cap read off the
    program's two literals (NaN where they differ: not a soft cap, which _cap_reason declines)."""
    if not capped:
        return params_of, example_params
    return (lambda match: {**params_of(match), "cap": soft_cap_at(match, CAP_EXAMPLE)},
            {**example_params, "cap": CAP_EXAMPLE})


def _linear_pattern(loss_fn, project, reduce, dtypes, cast_to_input: bool, log_probability=False,
                    labels_as="take_along_axis", param=None, masked=None, post=None, extends=None,
                    shifted=False, capped=False):
    """Its reduction's scales folded into the rows' weights, and a shift's share subtracted after,
    as _reduced_pattern's. Rows a `where` drops are given weight 0, label 0 and h = 0 (the program's
    loss there may be NaN, from a label out of range or a non-finite h, and counts 0). capped: the
    logits soft-capped first (see _linear), the cap applied in the loss kernels."""
    transposed = project in TRANSPOSED
    fn = _linear(loss_fn, project, reduce, log_probability, masked, post, shifted, capped)
    overall = OVERALL.get(reduce, reduce)

    def replace(h, w, labels, *rest, backend, provide=False, **params):
        out_dtype = jax.eval_shape(functools.partial(fn, **params), h, w, labels, *rest).dtype
        # (mean(loss * weights) divides by the rows, not by the weights' sum: a weighted sum over n)
        folded = masked or post or shifted
        scale = _reduction_scale(overall, _reduced_count(masked, labels), folded, post, rest, params)
        weights = _row_weights(masked, rest, labels)
        bool_mask = params.get("bool_mask", False)
        keep = None  # the rows kept, where a mask drops some (where, or a converted bool's select)
        if masked in KEEPS or bool_mask:
            keep = (rest[0] != 0 if bool_mask else rest[0]).reshape(labels.shape)
        if masked in KEEPS:  # (a dropped row: h = 0 and label 0, a finite loss weighted 0)
            h, labels = jnp.where(keep[..., None], h, 0), jnp.where(keep, labels, 0)
        factors = jnp.broadcast_to(weights * scale, labels.shape)
        if keep is not None:  # (0, not 0 * inf, where every row is dropped and the count is 0)
            factors = jnp.where(keep, factors, 0.0)
        options = dict(reduction="sum" if folded else overall.__name__, transpose_w=transposed, backend=backend,
                       weights=factors if folded else None, mask=keep if bool_mask else None,
                       soft_cap=params.get("cap"), return_lse=provide, return_rows=provide and post == DIVIDED)
        if labels_as == "one_hot":
            loss = linear_kernels.one_hot_linear_cross_entropy(h, w, labels, label_smoothing=params.get("smoothing", 0.0),
                                                               z_loss=params.get("z_loss", 0.0), **options)
        else:  # take_along_axis and indexing count negative labels from the end; indexing clamps
            labels = _labels_as_read(labels, labels_as, w.shape[0 if transposed else 1])
            loss = linear_kernels.linear_cross_entropy(h, w, labels, z_loss=params.get("z_loss", 0.0), **options)
        loss, *given = loss if provide else (loss,)
        if shifted:
            loss = loss - rest[1 if masked else 0].astype(jnp.float32) * jnp.sum(factors)
        loss = _empty_examples(_divided_by_zero(loss, post, rest), labels, masked, rest, bool_mask)
        loss = loss.astype(out_dtype)  # (-reduce of log-probabilities: the loss itself), in the program's dtype
        return (loss, _given(given, rest, masked, shifted, bool_mask)) if provide else loss

    dtypes = _with_mask_dtypes(dtypes, masked)

    def example(dtypes):
        dtypes = dtypes if masked in (WEIGHTS, *PER_EXAMPLE) else (dtypes, jnp.bool_)
        dtype = dtypes[0]
        rows = (2, 4) if reduce in OVERALL or masked in PER_EXAMPLE else (4,)  # (a batch of examples' rows)
        h, labels = jax.ShapeDtypeStruct((*rows, 8), dtype), jax.ShapeDtypeStruct(rows, jnp.int32)
        w = jax.ShapeDtypeStruct((16, 8) if transposed else (8, 16), dtype)
        kept_dim = loss_fn.__name__.startswith("log_softmax_at_label")  # its rows are [..., 1]
        weights = _mask_example(masked, rows, dtypes, kept_dim)
        if shifted:  # (a scalar of the row losses' dtype)
            rows = jax.eval_shape(lambda h, w, y: loss_fn(project(h, w), y, **EXAMPLE_PARAMS[param]), h, w, labels)
            weights += (jax.ShapeDtypeStruct((), rows.dtype),)
        unscaled = _linear(loss_fn, project, reduce, log_probability, masked, shifted=shifted, capped=capped)
        return (h, w, labels) + weights + _scalar_example(post, unscaled, param, h, w, labels, *weights)
    vocab = lambda match: match.input_avals[1].shape[0 if transposed else 1]
    params_of, example_params = _with_cap(capped, *_with_literal_scale(post, _params_of(param, vocab, 16),
                                                                        EXAMPLE_PARAMS[param]))
    params_of = _with_bool_mask(masked, 3, params_of)
    return Pattern(
        name=f"linear_cross_entropy/{fn.__name__}", op="linear_cross_entropy", fn=fn, dtypes=dtypes,
        example=example, params_of=params_of,
        check=lambda match, params: _check_linear(match, params, transposed, post, masked, shifted),
        replace=replace, example_params=example_params, provides=lambda match: _provided(match, post, masked),
        requires=_requires(labels_as) | {"dot_general"} | ({"tanh"} if capped else set()), extends=extends,
        split_dims=_split_dims(labels_as, lambda i: (0 if transposed else 1) if i == 1 else None))


def mean(loss):
    return jnp.mean(loss)


def sum(loss):  # noqa: A001 (the reduction's name)
    return jnp.sum(loss)


def mean_of_means(loss):
    """Each example's mean, then the batch's: the mean over every row (a per-example loss mapped by
    jax.vmap, Equinox's idiom, is written so)."""
    return jnp.mean(jnp.mean(loss, -1))


def sum_of_sums(loss):
    return jnp.sum(jnp.sum(loss, -1))


OVERALL = {mean_of_means: mean, sum_of_sums: sum}  # a reduction in two steps -> the one it equals


# Each row loss above, its mean or sum over each projection, plain or weighted per row (a padding
# mask), each sum also over a scalar (sum(loss * mask) / sum(mask)), the scales folded into the rows'
# weights, the logits soft-capped or not: traced for a program only when the row loss itself is found
# in it (Pattern.extends), so the ~1900 patterns cost start-up time by the 24 of the loss a program
# holds (48 where it holds a tanh).
PATTERNS += [_linear_pattern(loss, project, reduce, *rest, masked=masked, post=post,
                             extends=f"cross_entropy/{name}", capped=capped)
             for name, loss, *rest in _ROW_LOSSES for masked in (None, WEIGHTS)
             for project in (jnp_matmul, lax_dot_general, *TRANSPOSED) for reduce in (mean, sum)
             for post in ((None, DIVIDED) if reduce is sum else (None,)) for capped in (False, True)]


# --------------------------------------------------------------------------------------------------
# The loss reduced: cross_entropy(reduction="mean" / "sum")
# --------------------------------------------------------------------------------------------------



def _reduced(loss_fn, reduce, log_probability, masked, post=None, shifted=False):
    """reduce(loss_fn(logits, labels)), negated for log-probabilities; shifted: each row's loss minus
    a scalar first, the input after the mask (Flax's WMT example and HF's summarization subtract the
    smoothed targets' entropy, `loss - normalizing_constant`); masked: each row's loss times
    a weight first (a padding mask: WEIGHTS), or kept where a boolean mask is true (WHERE), the mask
    the pattern's third input; post: then over or times a scalar, the pattern's last input
    (DIVIDED: the mask's sum, a token count; TIMES_D: a dynamic loss scale), or times or over a
    constant `scale` (TIMES_C, OVER_C: a gradient accumulation's step count, a loss's weight)."""
    def pattern(logits, labels, *rest, scale=None, bool_mask=False, **params):
        return _reduce_rows(loss_fn(logits, labels, **params), rest, scale, reduce, log_probability, masked, post,
                            shifted)
    rows = _rows_name(loss_fn.__name__, masked, shifted)
    pattern.__name__ = f"{'-' if log_probability else ''}{reduce.__name__}({rows}){f' {post}' if post else ''}"
    return pattern


def _provided(match, post, masked) -> dict:
    """What a reduced loss's replacement can give beside it (Pattern.provides): its rows'
    logsumexp (not where an LM head's `where` drops rows: it gives them h = 0); where the sum is
    divided (DIVIDED), the sum, the division's numerator."""
    given = {} if masked in KEEPS and match.pattern.op == "linear_cross_entropy" else logsumexps_in(match)
    if post == DIVIDED:
        given[match.graph.eqns[match.anchor].invars[0]] = "sum"
    return given


def _given(values: list, rest, masked, shifted, bool_mask=False) -> dict:
    """The kernel's extra outputs (return_lse, then return_rows where asked) as Pattern.provides
    names them: the rows' logsumexp; the losses' sum before it is divided, weighted as the program
    weighs them (rest: the pattern's inputs after the labels, the divisor last)."""
    given = dict(zip(("logsumexp", "sum"), values))
    if "sum" in given:
        given["sum"] = _reduce_rows(given["sum"], rest[:-1], None, sum, False, masked, None, shifted, bool_mask)
    return given


def _check_reduced(match, params, masked, post, shifted) -> str | None:
    if reason := _empty_reason(match.input_avals[1]):
        return reason
    if shifted and (reason := _shift_reason(match.input_avals[3 if masked else 2])):
        return reason
    if masked and (reason := _mask_reason(match.input_avals[2:], match.input_avals[1], masked)):
        return reason
    return (_literal_reason(post, params) or _scalar_reason(match, post)
            or _check(match, {n: v for n, v in params.items() if n != "scale"}))


def _reduced_name(name, reduce, log_probability, masked, shifted, post=None) -> str:
    """The name of _reduced_pattern's pattern for the row loss `name`."""
    rows = _rows_name(name, masked, shifted)
    return f"cross_entropy/{'-' if log_probability else ''}{reduce.__name__}({rows}){f' {post}' if post else ''}"


def _reduced_pattern(name, loss_fn, reduce, dtypes, log_probability=False, labels_as=TAKE, param=None,
                     masked=None, post=None, shifted=False):
    """The mean or sum of a row loss (masked: of each row's loss times a weight, or where a mask is
    true; post: then over a scalar, or times or over a constant), as cross_entropy(reduction=...,
    weights=...), where_masked_sum or one_hot_cross_entropy(weights=...): under differentiation its
    forward also writes the logits' gradient, scaled (on Hopper, cross_entropy_hopper reads the
    logits once). Every scale of the reduction is folded into the rows' weights: one left after the
    kernel would be the cotangent of its sum, and the backward would scale dx by it, one more pass
    over the logits' size (jax.grad's own cotangent, the constant 1, XLA folds away). A shift c of
    every row's loss adds -c times the rows' summed factors, which the gradient of the logits
    does not see."""
    fn = _reduced(loss_fn, reduce, log_probability, masked, post, shifted)

    overall = OVERALL.get(reduce, reduce)

    def replace(logits, labels, *rest, backend, provide=False, **params):
        options = dict(z_loss=params.get("z_loss", 0.0), return_lse=provide, return_rows=provide and post == DIVIDED,
                       backend=backend)
        folded = masked or post or shifted or labels_as == ONE_HOT
        scale = _reduction_scale(overall, _reduced_count(masked, labels), folded, post, rest, params)
        out_dtype = jax.eval_shape(functools.partial(fn, **params), logits, labels, *rest).dtype
        weights = _row_weights(masked, rest, labels)
        factors = jnp.broadcast_to(weights * scale, labels.shape)  # each row's, in the reduced loss
        bool_mask = params.get("bool_mask", False)
        if labels_as == ONE_HOT:  # (a label out of range is a row of zeros, not a NaN)
            loss = kernels.one_hot_cross_entropy(logits, labels, label_smoothing=params.get("smoothing", 0.0),
                                                 weights=factors, mask=rest[0] != 0 if bool_mask else None,
                                                 selected=_selected(loss_fn, labels_as, param, logits, labels),
                                                 **options)
        elif masked in KEEPS or bool_mask:
            loss = kernels.where_masked_sum(logits, _labels_as_read(labels, labels_as, logits.shape[-1]),
                                            rest[0] != 0 if bool_mask else rest[0], scale=factors, **options)
        elif folded:
            loss = kernels.cross_entropy(logits, _labels_as_read(labels, labels_as, logits.shape[-1]),
                                         reduction="sum", weights=factors, **options)
        else:
            loss = kernels.cross_entropy(logits, _labels_as_read(labels, labels_as, logits.shape[-1]),
                                         reduction=overall.__name__, **options)
        loss, *given = loss if provide else (loss,)
        if shifted:
            loss = loss - rest[1 if masked else 0].astype(jnp.float32) * jnp.sum(factors)
        loss = _empty_examples(_divided_by_zero(loss, post, rest), labels, masked, rest, bool_mask)
        loss = loss.astype(out_dtype)  # (-reduce of log-probabilities: the loss itself), in the program's dtype
        return (loss, _given(given, rest, masked, shifted, bool_mask)) if provide else loss

    dtypes = _with_mask_dtypes(dtypes, masked)

    def example(dtypes):
        dtypes = dtypes if masked in (WEIGHTS, *PER_EXAMPLE) else (dtypes, jnp.bool_)
        dtype = dtypes[0]
        rows = (2, 4) if reduce in OVERALL or masked in PER_EXAMPLE else (4,)  # (a batch of examples' rows)
        logits, labels = jax.ShapeDtypeStruct((*rows, 8), dtype), jax.ShapeDtypeStruct(rows, jnp.int32)
        kept_dim = loss_fn.__name__.startswith("log_softmax_at_label")  # its rows are [..., 1]
        mask = _mask_example(masked, rows, dtypes, kept_dim)
        if shifted:  # (a scalar of the row losses' dtype)
            rows = jax.eval_shape(functools.partial(loss_fn, **EXAMPLE_PARAMS[param]), logits, labels)
            mask += (jax.ShapeDtypeStruct((), rows.dtype),)
        unscaled = _reduced(loss_fn, reduce, log_probability, masked, shifted=shifted)
        return (logits, labels) + mask + _scalar_example(post, unscaled, param, logits, labels, *mask)
    params_of, example_params = _with_literal_scale(
        post, _params_of(param, lambda match: match.input_avals[0].shape[-1], 8), EXAMPLE_PARAMS[param])
    params_of = _with_bool_mask(masked, 2, params_of)
    reduced = _reduced_name(name, reduce, log_probability, masked, shifted)
    return Pattern(
        name=_reduced_name(name, reduce, log_probability, masked, shifted, post),
        op="cross_entropy", fn=fn, dtypes=dtypes, example=example,
        params_of=params_of,
        check=lambda match, params: _check_reduced(match, params, masked, post, shifted),
        replace=replace, example_params=example_params, provides=lambda match: _provided(match, post, masked),
        # (a scaled reduction: traced only for programs where the reduction is found)
        requires=_requires(labels_as), extends=reduced if post else f"cross_entropy/{name}",
        split_dims=_split_dims(labels_as))


# Each row loss's mean and sum over every row: plain, weighted per row (a padding mask) or masked
# by where (HF's -100 labels: where(labels != -100, loss, 0); integer labels only); each then also
# times or over a constant, or times a scalar (a dynamic loss scale), and each sum over a scalar
# (sum(loss * mask) / sum(mask), a token count), those scales folded into the rows' weights.
# One-hot targets too (HF's Flax examples: softmax_cross_entropy(logits, onehot) * mask, summed).
# Traced only for programs where the row loss is found. A reduction over some axes only, or of the
# losses scaled by a constant first, keeps the row loss.
PATTERNS += [_reduced_pattern(name, loss, reduce, dtypes, log_probability, labels_as, param, masked, post)
             for name, loss, dtypes, _, log_probability, labels_as, param in _ROW_LOSSES
             for masked in ((None, WEIGHTS) if labels_as == ONE_HOT else (None, WEIGHTS, WHERE))
             for reduce in (mean, sum)
             for post in (None, TIMES_C, OVER_C, TIMES_D) + ((DIVIDED,) if reduce is sum else ())]


def _per_example(loss, labels_as) -> bool:
    """Whether a row loss can be reduced per example first: one value a row, over logits of any
    rank (NumPy indexing takes [n, V] logits)."""
    return not loss.__name__.startswith("log_softmax_at_label") and labels_as != INDEXING


# Each example's mean or sum, then the batch's (a per-example loss mapped by jax.vmap), plain or
# times or over a constant.
PATTERNS += [_reduced_pattern(name, loss, reduce, dtypes, log_probability, labels_as, param, None, post)
             for name, loss, dtypes, _, log_probability, labels_as, param in _ROW_LOSSES
             if _per_example(loss, labels_as) for reduce in OVERALL for post in (None, TIMES_C, OVER_C)]
# Each example's weighted sum over its count, sum(rows * mask, -1) / n (or of where(mask, rows, 0),
# integer labels only, as where's above), then the batch's mean or sum
# (a loss normalized per sequence, n = sum(mask, -1) or a guarded one, maximum(..., 1), or the
# lengths given; a per-example masked mean mapped by jax.vmap), each scaled as above: the weights
# mask / n (float, bool or integer masks) go into the kernel.
PATTERNS += [_reduced_pattern(name, loss, reduce, dtypes, log_probability, labels_as, param, masked, post)
             for name, loss, dtypes, _, log_probability, labels_as, param in _ROW_LOSSES
             if _per_example(loss, labels_as) for reduce in (mean, sum)
             for masked in ((NORMALIZED,) if labels_as == ONE_HOT else PER_EXAMPLE)
             for post in (None, TIMES_C, OVER_C, TIMES_D) + ((DIVIDED,) if reduce is sum else ())]
# The same with every row's loss minus a scalar first, `(loss - c) * weights` (Flax's WMT and lm1b
# examples, HF's Flax summarization: c the smoothed targets' entropy, computed in the program), for
# row losses that are losses (a log-probability's sign would come between).
PATTERNS += [_reduced_pattern(name, loss, reduce, dtypes, log_probability, labels_as, param, masked, post, True)
             for name, loss, dtypes, _, log_probability, labels_as, param in _ROW_LOSSES if not log_probability
             for masked in (None, WEIGHTS) for reduce in (mean, sum)
             for post in (None, TIMES_C, OVER_C, TIMES_D) + ((DIVIDED,) if reduce is sum else ())]
# The LM head with those too: its reduction scaled by a constant or a given scalar; its rows
# shifted first (then as HF's summarization and Flax's WMT example divide: over a scalar or a
# constant); its rows masked by `where` (HF's -100 labels; integer labels), plain or scaled. Each
# traced only where the reduced loss it holds is found.
PATTERNS += [_linear_pattern(loss, project, reduce, *rest, masked=masked, post=post, shifted=shifted,
                             extends=_reduced_name(name, reduce, rest[2], masked, shifted, post))
             for name, loss, *rest in _ROW_LOSSES for masked in (None, WEIGHTS, WHERE)
             if masked != WHERE or rest[3] != ONE_HOT
             for project in (jnp_matmul, lax_dot_general, *TRANSPOSED) for reduce in (mean, sum)
             for shifted in ((False, True) if not rest[2] and masked != WHERE else (False,))
             for post in (((None,) + ((DIVIDED, OVER_C) if reduce is sum else ())) if shifted else
                          ((None,) if masked == WHERE else ()) + ((DIVIDED,) if masked == WHERE and reduce is sum
                                                                 else ()) + (TIMES_C, OVER_C, TIMES_D))]
# And the LM head of a per-example loss mapped by jax.vmap: each example's mean or sum, then the batch's.
PATTERNS += [_linear_pattern(loss, project, reduce, *rest, post=post,
                             extends=_reduced_name(name, reduce, rest[2], None, False, post))
             for name, loss, *rest in _ROW_LOSSES if _per_example(loss, rest[3])
             for project in (jnp_matmul, lax_dot_general, *TRANSPOSED) for reduce in OVERALL
             for post in (None, TIMES_C, OVER_C)]
# And of a loss normalized per example (unscaled).
PATTERNS += [_linear_pattern(loss, project, reduce, *rest, masked=masked,
                             extends=_reduced_name(name, reduce, rest[2], masked, False))
             for name, loss, *rest in _ROW_LOSSES if _per_example(loss, rest[3])
             for masked in ((NORMALIZED,) if rest[3] == ONE_HOT else PER_EXAMPLE)
             for project in (jnp_matmul, lax_dot_general, *TRANSPOSED) for reduce in (mean, sum)]
