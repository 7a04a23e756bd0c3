"""xkern.ops.cross_entropy against the same loss under jax.jit (optax's formula: logsumexp minus
the label's logit, in float32).

Minimum bytes: the forward reads the logits once; forward+backward (value and gradient) reads them
and writes the gradient (2 tensors), as shared/GPU.md counts XLA's.

linear_cross_entropy (projection + loss, value and h / w gradients) is a matmul program: its rate is
TFLOP/s over the three matmuls XLA runs, and its temporary memory is recorded beside jax.jit's.
"""
from __future__ import annotations

import functools
import importlib.util
import math

import jax
import jax.numpy as jnp

import xkern
from benchmarks.harness import Case
from xkern.kernels import linear_cross_entropy as linear
from xkern.kernels.cross_entropy import reference


def _logits_maker(rows: int, vocab: int):
    """A maker of (logits [rows, vocab] bf16, labels, a weight per row)."""
    def make(key):
        kx, kl, kw = jax.random.split(key, 3)
        return (jax.random.normal(kx, (rows, vocab), jnp.bfloat16) * 2,
                jax.random.randint(kl, (rows,), 0, vocab),
                jax.random.uniform(kw, (rows,), jnp.float32))
    return make


def cases(on_gpu: bool) -> list[Case]:
    shapes = [(8192, 128256), (8192, 32000)] if on_gpu else [(64, 1000)]
    out = []
    for rows, vocab in shapes:
        make = _logits_maker(rows, vocab)
        n = rows * vocab * 2
        mean = lambda f: (lambda x, y, w: f(x, y))
        grad = lambda f: (lambda x, y, w: jax.value_and_grad(f)(x, y))
        per_row = lambda f: (lambda x, y, w: jax.value_and_grad(
            lambda x: jnp.sum(f(x, y, reduction="none") * w))(x))
        for name, wrap, nbytes, mode in (("cross_entropy mean", mean, n, "fwd"),
                                         ("cross_entropy mean", grad, 2 * n, "fwd+bwd"),
                                         ("cross_entropy none, weighted", per_row, 2 * n, "fwd+bwd")):
            out.append(Case(name, (rows, vocab), "bfloat16", mode, wrap(xkern.ops.cross_entropy),
                            wrap(reference), make, nbytes, 2e-2))
    # Gemma 2's final logits soft-capped at 30 (the cap in the kernel; XLA's reference caps them first)
    rows, vocab = (8192, 256000) if on_gpu else (64, 1000)
    capped = lambda f: (lambda x, y, w: jax.value_and_grad(lambda x: f(x, y, soft_cap=30.0))(x))
    out.append(Case("cross_entropy mean, soft_cap 30 (Gemma 2's final logits)", (rows, vocab), "bfloat16", "fwd+bwd",
                    capped(xkern.ops.cross_entropy), capped(reference), _logits_maker(rows, vocab),
                    2 * rows * vocab * 2, 2e-2))
    return out + loss_cases(on_gpu) + linear_cases(on_gpu)


def _losses_as_written() -> dict:
    """The loss as programs write it, each a scalar of (logits, labels): what the patterns take whole."""
    import optax
    rows = optax.softmax_cross_entropy_with_integer_labels
    one_hot_rows = lambda x, y: optax.softmax_cross_entropy(x, jax.nn.one_hot(y, x.shape[-1]))
    padding = lambda y: (y % 8 != 7).astype(jnp.float32)  # (every 8th row padding)
    losses = {
        "optax integer labels, mean": lambda x, y: rows(x, y).mean(),
        "optax integer labels, mean / 4 (gradient accumulation)": lambda x, y: rows(x, y).mean() / 4,
        "integer labels, padding-masked mean": lambda x, y: jnp.sum(rows(x, y) * padding(y)) / jnp.sum(padding(y)),
        "integer labels, where-masked over the count": lambda x, y: jnp.sum(
            jnp.where(y % 8 != 7, rows(x, y), 0.0)) / jnp.sum(y % 8 != 7),
        "integer labels, normalized per sequence (8 sequences' masked means, their mean)": lambda x, y: jnp.mean(
            (lambda r, m: jnp.sum(r * m, -1) / jnp.sum(m, -1))(
                rows(x.reshape(8, -1, x.shape[-1]), y.reshape(8, -1)), padding(y).reshape(8, -1))),
        "one-hot target, mean": lambda x, y: one_hot_rows(x, y).mean(),
        "MaxText's loss (t5x's custom_vjp cross_entropy_with_logits), masked over the count + EPS":
            lambda x, y: jnp.sum(cross_entropy_with_logits()(x, jax.nn.one_hot(y, x.shape[-1]), 0.0)[0] * (
                padding(y) != 0)) / (jnp.sum(padding(y) != 0) + 1e-8),
        "one-hot target, padding-masked mean": lambda x, y: jnp.sum(one_hot_rows(x, y) * padding(y)) / jnp.sum(
            padding(y)),
        "smoothed one-hot target (0.1), mean": lambda x, y: optax.softmax_cross_entropy(
            x, optax.smooth_labels(jax.nn.one_hot(y, x.shape[-1]), 0.1)).mean(),
    }
    if importlib.util.find_spec("flax") is not None:  # HF's Flax examples: flax's onehot
        from flax.training.common_utils import onehot
        losses["flax onehot (HF run_mlm_flax), masked sum"] = lambda x, y: jnp.sum(
            optax.softmax_cross_entropy(x, onehot(y, x.shape[-1])) * jnp.where(y > 0, 1.0, 0.0))
        losses["flax onehot smoothed less its entropy (Flax WMT, HF summarization), masked mean"] = \
            lambda x, y: summarization_loss(x, y, padding(y))
    return losses


def summarization_loss(logits, labels, padding, smoothing=0.1):
    """Flax's WMT example and HF's run_summarization_flax: flax's onehot targets smoothed (on 1 - e,
    off e / (V - 1)), the loss less those targets' entropy, times the padding, over its sum."""
    import optax
    from flax.training.common_utils import onehot
    vocab, confidence = logits.shape[-1], 1.0 - smoothing
    low_confidence = (1.0 - confidence) / (vocab - 1)
    entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low_confidence * jnp.log(low_confidence + 1e-20))
    loss = optax.softmax_cross_entropy(logits, onehot(labels, vocab, on_value=confidence, off_value=low_confidence))
    return jnp.sum((loss - entropy) * padding) / jnp.sum(padding)


def cross_entropy_with_logits(bwd_module: str = "MaxText.max_utils"):
    """cross_entropy_with_logits as t5x.losses and MaxText's max_utils write it: a custom_vjp whose
    backward rule, by hand, is the body's gradient (and the one-hot targets'), from saved exps.
    bwd_module: the module its backward rule says it is from (xkern inlines it for t5x's and
    MaxText's, see canonicalize.ANALYTIC_VJPS). A stand-in: neither library is a dependency."""
    @jax.custom_vjp
    def cross_entropy_with_logits(logits, targets, z_loss):
        logits_sum = jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
        loss = -jnp.sum(targets * (logits - logits_sum), axis=-1)
        total_z_loss = z_loss * jax.lax.square(jnp.squeeze(logits_sum, axis=-1))
        return loss + total_z_loss, total_z_loss

    def forward(logits, targets, z_loss):
        max_logit = logits.max(axis=-1, keepdims=True)
        exp_shifted = jnp.exp(logits - max_logit)
        sum_exp = jnp.sum(exp_shifted, axis=-1, keepdims=True)
        log_softmax = logits - max_logit - jnp.log(sum_exp)
        log_z = jnp.squeeze(jnp.log(sum_exp) + max_logit, axis=-1)
        total_z_loss = z_loss * jax.lax.square(log_z)
        loss = -jnp.sum(targets * log_softmax, axis=-1) + total_z_loss
        return (loss, total_z_loss), (logits, targets, z_loss, exp_shifted, sum_exp, log_softmax, log_z)

    def _cross_entropy_with_logits_bwd(res, g):
        g = g[0]
        logits, targets, z_loss, exp_shifted, sum_exp, log_softmax, log_z = res
        deriv = jnp.expand_dims(1 + 2 * z_loss * log_z, -1) * exp_shifted / sum_exp - targets
        return ((g[..., None] * deriv).astype(logits.dtype), (-g[..., None] * log_softmax).astype(targets.dtype),
                jnp.array(0.0))
    _cross_entropy_with_logits_bwd.__module__ = bwd_module
    cross_entropy_with_logits.defvjp(forward, _cross_entropy_with_logits_bwd)
    return cross_entropy_with_logits


def maxtext_train_loss(x, y, segmentation, z=1e-4):
    """MaxText's loss_fn as its train step runs it (train.py): the z-loss output masked, summed and
    over the count + EPS, returned in aux for its metrics beside the sum of the losses and the count."""
    xent, z_loss = cross_entropy_with_logits("MaxText.max_utils")(x, jax.nn.one_hot(y, x.shape[-1]), z)
    xent, z_loss = xent * (segmentation != 0), z_loss * (segmentation != 0)
    xent_sum, total_z_loss = jnp.sum(xent), jnp.sum(z_loss)
    total_weights = jnp.sum(segmentation != 0)
    loss = xent_sum / (total_weights + 1e-8)
    return loss, {"xent_sum": xent_sum, "z_loss": total_z_loss / (total_weights + 1e-8), "total_weights": total_weights}


def maxtext_logits_in_aux_loss(x, y, segmentation):
    """MaxText's loss_fn as its train step runs it since 2025 (train.py): no z-loss, the summed loss over
    the count + EPS; its aux keeps the logits (intermediate_outputs, for its eval step's metrics) beside
    the summed loss and the count. Its train step reads the count, not the logits (maxtext_step)."""
    xent, _ = cross_entropy_with_logits("MaxText.max_utils")(x, jax.nn.one_hot(y, x.shape[-1]), 0.0)
    xent = xent * (segmentation != 0)
    total_loss, total_weights = jnp.sum(xent), jnp.sum(segmentation != 0)
    return total_loss / (total_weights + 1e-8), {"intermediate_outputs": {"logits": x}, "total_loss": total_loss,
                                                 "total_weights": total_weights}


def maxtext_step(loss_fn, argnums=0):
    """What MaxText's train step keeps of value_and_grad(loss_fn, has_aux=True): the loss, the gradients
    and the count (its metrics)."""
    def step(*args):
        (loss, aux), grads = jax.value_and_grad(loss_fn, argnums, has_aux=True)(*args)
        return loss, grads, aux["total_weights"]
    return step


def loss_cases(on_gpu: bool) -> list[Case]:
    """Value and gradient of the logits of each loss as written, xkern.jit against jax.jit."""
    if importlib.util.find_spec("optax") is None:  # (a test dependency only)
        return []
    rows, vocab = (8192, 128256) if on_gpu else (64, 1000)

    def make(key):
        kx, kl = jax.random.split(key)
        return jax.random.normal(kx, (rows, vocab), jnp.bfloat16) * 2, jax.random.randint(kl, (rows,), 0, vocab)
    cases = [Case(f"loss as written: {name}", (rows, vocab), "bfloat16", "fwd+bwd",
                  xkern.jit(jax.value_and_grad(loss)), jax.jit(jax.value_and_grad(loss)), make, 2 * rows * vocab * 2,
                  2e-2)
             for name, loss in _losses_as_written().items()]
    # its train step's loss_fn: the z-loss and the losses' sum also returned, for its metrics
    train = lambda x, y: maxtext_train_loss(x, y, (y % 8 != 7).astype(jnp.int32))
    step = lambda jit: jit(jax.value_and_grad(train, has_aux=True))
    return cases + [Case("loss as written: MaxText's train step loss_fn (z-loss 1e-4 and the sum in aux)", (rows, vocab),
                         "bfloat16", "fwd+bwd", step(xkern.jit), step(jax.jit), make, 2 * rows * vocab * 2, 2e-2)]


def _head_inputs(rows: int, dim: int, vocab: int):
    """A maker of (h [rows, dim], w [dim, vocab], labels, per-row weights), bf16 h and w."""
    def make(key):
        kh, kw, kl, kc = jax.random.split(key, 4)
        return (jax.random.normal(kh, (rows, dim), jnp.bfloat16),
                (jax.random.normal(kw, (dim, vocab), jnp.float32) / dim ** 0.5).astype(jnp.bfloat16),
                jax.random.randint(kl, (rows,), 0, vocab),
                jax.random.uniform(kc, (rows,), jnp.float32))
    return make


def linear_cases(on_gpu: bool) -> list[Case]:
    rows, dim, vocab = (8192, 4096, 128256) if on_gpu else (64, 32, 1000)
    make = _head_inputs(rows, dim, vocab)
    mean = lambda f: (lambda h, w, y, c: jax.value_and_grad(f, (0, 1))(h, w, y))
    per_row = lambda f: (lambda h, w, y, c: jax.value_and_grad(
        lambda h, w: jnp.sum(f(h, w, y, reduction="none") * c), (0, 1))(h, w))
    as_table = lambda make: (lambda key: (lambda h, w, y, c: (h, w.T.copy(), y, c))(*make(key)))
    make_tied = as_table(make)  # a tied embedding table [V, D]
    tied = lambda f: (lambda h, table, y, c: jax.value_and_grad(
        lambda h, table: f(h, table, y, transpose_w=True), (0, 1))(h, table))
    flops = 3 * 2 * rows * dim * vocab
    out = [Case(f"linear_cross_entropy {name}", (rows, dim, vocab), "bfloat16", "fwd+bwd",
                wrap(linear.linear_cross_entropy), wrap(linear.reference), maker, 0, 3e-2, flops,
                memory=True)
           for name, wrap, maker in (("mean", mean, make), ("none, weighted", per_row, make),
                                     ("mean, tied table (transpose_w)", tied, make_tied))]
    if on_gpu:  # the chunks' size beside the default (2048 rows here): see linear_cross_entropy.CHUNK_BYTES
        out += [Case(f"linear_cross_entropy mean, chunk_rows {n}", (rows, dim, vocab), "bfloat16", "fwd+bwd",
                     mean(functools.partial(linear.linear_cross_entropy, chunk_rows=n)), mean(linear.reference), make,
                     0, 3e-2, flops, memory=True) for n in (1024, 4096)]
        out.append(Case("XLA's logits matmul + cross_entropy (the logits kept)", (rows, dim, vocab), "bfloat16",
                        "fwd+bwd", mean(lambda h, w, y: xkern.ops.cross_entropy(h @ w, y)), mean(linear.reference),
                        make, 0, 3e-2, flops, memory=True))
    if on_gpu:  # Gemma 2 2B's head: a 256000 vocabulary over d 2304, its tied table
        gemma = (8192, 2304, 256000)
        out.append(Case("linear_cross_entropy mean, Gemma 2 2B's tied table (transpose_w)", gemma, "bfloat16",
                        "fwd+bwd", tied(linear.linear_cross_entropy), tied(linear.reference),
                        as_table(_head_inputs(*gemma)), 0, 3e-2, 3 * 2 * 8192 * 2304 * 256000, memory=True))

    if importlib.util.find_spec("optax") is None:  # the programs below use optax: a test dependency only
        return out
    import optax

    def one_hot_tied_head(h, table, y, c):  # as programs write it: optax's smoothed one-hot loss, h @ table.T
        def loss(h, table):
            logits = (h @ table.T).astype(jnp.float32)
            return optax.softmax_cross_entropy(logits, optax.smooth_labels(jax.nn.one_hot(y, vocab), 0.1)).mean()
        return jax.value_and_grad(loss, (0, 1))(h, table)
    def masked_head(h, w, y, c):  # a padding mask: optax's integer-label loss, its masked mean
        def loss(h, w):
            mask = (c > 0.1).astype(jnp.float32)
            rows = optax.softmax_cross_entropy_with_integer_labels((h @ w).astype(jnp.float32), y)
            return jnp.sum(rows * mask) / jnp.sum(mask)
        return jax.value_and_grad(loss, (0, 1))(h, w)
    def z_loss_head(h, w, y, c):  # PaLM's z-loss beside the loss, from the same logsumexp
        def loss(h, w):
            logits = (h @ w).astype(jnp.float32)
            lse = jax.nn.logsumexp(logits, -1)
            picked = jnp.take_along_axis(logits, y[:, None], -1)[:, 0]
            return jnp.mean(lse - picked + 1e-4 * lse ** 2)
        return jax.value_and_grad(loss, (0, 1))(h, w)
    def summarization_head(h, table, y, c):  # HF's Flax summarization over a tied table (its loss above)
        return jax.value_and_grad(lambda h, table: summarization_loss(h @ table.T, y, (c > 0.1).astype(jnp.float32)),
                                  (0, 1))(h, table)
    def gemma2_head(h, table, y, c):  # Gemma 2's final logits, soft-capped at 30 as the gemma library writes it
        def loss(h, table):
            logits = jnp.dot(h, table.T)
            logits /= 30.0
            logits = jnp.tanh(logits) * 30.0
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()
        return jax.value_and_grad(loss, (0, 1))(h, table)
    def maxtext_head(h, w, y, c):  # MaxText's train step: its logits einsum, the z-loss and the sum in aux
        train = lambda h, w: maxtext_train_loss(jnp.einsum("td,dv->tv", h, w), y, (c > 0.1).astype(jnp.int32))
        return jax.value_and_grad(train, (0, 1), has_aux=True)(h, w)
    out.append(Case("MaxText's train step LM head: loss over the count + EPS, z-loss 1e-4 and the sum in aux, xkern.jit",
                    (rows, dim, vocab), "bfloat16", "fwd+bwd", xkern.jit(maxtext_head), maxtext_head, make, 0, 3e-2,
                    flops, memory=True))
    newest = lambda h, w, y, c: maxtext_step(lambda h, w: maxtext_logits_in_aux_loss(
        jnp.einsum("td,dv->tv", h, w), y, (c > 0.1).astype(jnp.int32)), (0, 1))(h, w)
    out.append(Case("MaxText's train step LM head, the logits in aux (the step drops them), xkern.jit",
                    (rows, dim, vocab), "bfloat16", "fwd+bwd", xkern.jit(newest), newest, make, 0, 3e-2, flops,
                    memory=True))
    head = (8192, 2304, 256000) if on_gpu else (rows, dim, vocab)  # Gemma 2 2B's on a GPU
    out.append(Case("Gemma 2 2B LM head: soft-capped logits (tanh(z / 30) * 30) + optax loss, tied table, xkern.jit",
                    head, "bfloat16", "fwd+bwd", xkern.jit(gemma2_head), gemma2_head, as_table(_head_inputs(*head)),
                    0, 3e-2, 3 * 2 * math.prod(head), memory=True))
    out.append(Case("LM head + z-loss (PaLM, z * logsumexp^2), xkern.jit", (rows, dim, vocab), "bfloat16", "fwd+bwd",
                    xkern.jit(z_loss_head), z_loss_head, make, 0, 3e-2, flops, memory=True))
    if importlib.util.find_spec("flax") is not None:
        out.append(Case("LM head + smoothed loss less its entropy (HF summarization), tied table, xkern.jit",
                        (rows, dim, vocab), "bfloat16", "fwd+bwd", xkern.jit(summarization_head), summarization_head,
                        make_tied, 0, 3e-2, flops, memory=True))
    return out + [Case("LM head + smoothed one-hot loss, tied table, xkern.jit", (rows, dim, vocab), "bfloat16",
                       "fwd+bwd", xkern.jit(one_hot_tied_head), one_hot_tied_head, make_tied, 0, 3e-2, flops,
                       memory=True),
                  Case("LM head + masked mean loss (padding mask), xkern.jit", (rows, dim, vocab), "bfloat16",
                       "fwd+bwd", xkern.jit(masked_head), masked_head, make, 0, 3e-2, flops, memory=True)]
