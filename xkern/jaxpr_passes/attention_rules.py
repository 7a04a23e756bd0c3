"""Scaled dot-product attention, in the ways people write it, replaced by xkern.ops.attention (flash
attention: the scores never exist in memory).

Spellings: jax.nn.dot_product_attention (implementation None or "xla"; causal or not; with an
additive bias, a boolean mask, both or neither, or key_value_seq_lengths; GQA through its k/v head
grouping);
flax.linen.dot_product_attention (with a mask or not); and by
hand, q.k^T by einsum, times a scale (or divided by a number, or by sqrt(head dim) in q's dtype,
or not scaled at all: T5's, whose additive bias holds its learned relative positions),
an optional causal mask from tril / iota applied with a -inf
`where`, or a boolean mask of the scores' shape [b,h,q,k], [b,1,q,k] or [b,1,1,k] (key padding)
applied with `where` and a large negative fill, or an additive bias (float mask) of those shapes,
softmax (jax.nn's, in float32 for half-precision inputs or not), einsum with v, in the
[batch, seq, heads, dim] layout or the [batch, heads, seq, dim] one (whose replacement transposes
in and out), or with the heads folded into the batch, [batch * heads, seq, dim] (diffusers' Flax
attention: each entry a batch of one head). The scale and the fill are read off the program.

jax.nn and flax fill masked scores with a large negative number, so a query whose keys are all
masked averages every value: their replacements ask for that (masked_rows="average"), as do by-hand
masks with a finite fill, and additive biases (a bias of finfo.min hides a key, as HF ports write
padding). With a -inf fill such a query is NaN under XLA, and so here (masked_rows="nan": its NaN
weights reach dv as XLA's do); a -inf bias gives the mean.

With dropout on its probabilities (flax's dropout_rate, nn.Dropout on the weights, a random
multiplier by hand), the multiplier the program draws (from jax's random bits, by XLA as before) is
passed to the kernels, which apply it tile by tile: the same random bits, so jax.jit's result.

Scores soft-capped as Gemma 2 caps them (tanh(scores / c) * c, before the mask) take the kernels'
logits_soft_cap. Float32 probabilities that weight v as they are (flax's force_fp32_for_softmax; by
hand after a float32 scale such as np.sqrt(d)) give a float32 result: the kernels' out_dtype.
gpt-oss's attention sinks (a column of logits joined to the masked scores, the softmax, the column
dropped) are the kernels' sinks; its masks, a constant bias of 0 and -inf, are read as causal or a
sliding window where they are one. Scores times an array with one value for every key (a learned
temperature per head) scale q instead. MaxText's dot-product attention (unscaled 5-D GQA scores, its
additive mask compared with half its fill, exps and sums kept apart, the output divided by the sums)
is attention with a scale of 1. Equinox's MultiheadAttention (written for one example and one head,
mapped over heads and batch by jax.vmap) is found as the vmaps trace it. The by-hand spellings in
[b, s, h, d] and [b, h, s, d] and flax's take any number of batch dims (none: one example; several:
AlphaFold's batch of batches, or a model mapped twice), made one for the kernels. AlphaFold 3's
attention casts q and k to float32 and scales q, then adds a padding bias and the pair logits.
"""
from __future__ import annotations

import functools
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax.extend.core import Literal, Var

from xkern.jaxpr_passes.graph import constant_value, padding_fill
from xkern.jaxpr_passes.patterns import Pattern, literal_at, soft_cap_at
from xkern.kernels import attention as kernels

ALL = (jnp.bfloat16, jnp.float16, jnp.float32)
HALF = (jnp.bfloat16, jnp.float16)
EXAMPLE_SCALE = 0.0777  # distinctive, so params_of can find the scale literal in the template
EXAMPLE_FILL = -98765.0  # likewise for a mask's fill value
EXAMPLE_WINDOW = (777, 555)  # and for a sliding window's (left, right)
EXAMPLE_KEEP = 0.777  # and for a dropout's keep probability
EXAMPLE_CAP = 47.7  # and for a soft cap
EXAMPLE_THRESHOLD = -54321.0  # and for the value a mask is compared with (MaxText's)
# A fill that hides a key exactly: exp(fill - max) is 0 in float32 for any score the kernels see,
# and a query whose keys are all hidden averages every value (masked_rows="average").
MAX_FILL = -1e4


# A mask's broadcast shape changes the program jax.nn traces (its broadcasts), so each common shape
# has its own template: per batch and head, per batch, shared.
MASK_SHAPES = {"[b,h,q,k]": (2, 4, 8, 8), "[b,1,q,k]": (2, 1, 8, 8), "[1,1,q,k]": (1, 1, 8, 8)}


def nn_attention(causal: bool, bias: bool, mask: str | None, grouped: bool = True, lengths: bool = False,
                 window: bool = False, bias_kind: str = "", query_lengths: bool = False):
    """jax.nn's attention, traced with grouped k/v heads (grouped) or as many k/v heads as q heads:
    a mask broadcast over heads traces one broadcast more when k/v heads are grouped, so those masks
    take a template of each kind. lengths: with key_value_seq_lengths (the last input), as a decode
    step against a padded cache passes them. window: with local_window_size=(left, right), params
    (jax.nn builds the window from two position constants: the template's last inputs). bias_kind:
    the bias's shape and dtype, where they are not [b,h,q,k] float32 (they change the trace).
    query_lengths: with query_seq_lengths (an input before any key_value_seq_lengths). Lengths may
    be one number for every batch entry (`jnp.full((b,), n)`, which canonicalize makes a broadcast of
    n): the template is then traced so (_per_entry)."""
    def fn(q, k, v, *extras, scale, left=None, right=None):
        return jax.nn.dot_product_attention(q, k, v, bias=extras[0] if bias else None,
                                            mask=extras[-1] if mask else None, scale=scale, is_causal=causal,
                                            query_seq_lengths=_per_entry(extras[-1 - lengths], q) if query_lengths
                                            else None,
                                            key_value_seq_lengths=_per_entry(extras[-1], q) if lengths else None,
                                            local_window_size=(left, right) if window else None)
    fn.__name__ = (f"jax.nn.dot_product_attention{'(causal)' if causal else ''}{'+bias' + bias_kind if bias else ''}"
                   f"{'+mask' + mask if mask else ''}{'+query_seq_lengths' if query_lengths else ''}"
                   f"{'+key_value_seq_lengths' if lengths else ''}"
                   f"{'+local_window_size' if window else ''}{'' if grouped else ', one k/v head per q head'}")
    fn.grouped, fn.query_lengths = grouped, query_lengths
    return fn


def _per_entry(lengths, q):
    """Lengths [batch]: one number broadcast to every entry of q's batch, else as they are."""
    return jnp.full((q.shape[0],), lengths) if jnp.ndim(lengths) == 0 else lengths


def nn_attention_per_example(causal: bool):
    """jax.nn's attention on one example ([seq, heads, dim]), vmapped over the batch: as a model
    written per example (equinox's style) is batched."""
    def fn(q, k, v, *, scale):
        return jax.vmap(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal))(q, k, v)
    fn.__name__ = f"jax.nn.dot_product_attention{'(causal)' if causal else ''}, vmapped per example"
    fn.grouped = True
    return fn


def _lengths_as_jax_nn(q, k, lengths):
    """(q, kv_lengths) for the kernels that give jax.nn's result: a batch entry whose
    key_value_seq_length is 0 (or less) has every score filled alike there, so it gets the mean of
    every value (padding included), and no gradient reaches its q and k. With its queries zeroed and
    every key visible the kernels compute exactly that, without causal masking."""
    empty = lengths <= 0
    return (jnp.where(empty[:, None, None, None], jnp.zeros((), q.dtype), q),
            jnp.where(empty, k.shape[1], lengths).astype(jnp.int32))


def _padded_queries(query_lengths, sq: int):
    """[batch, sq, 1, 1]: the queries at or past query_seq_lengths."""
    return (jnp.arange(sq)[None, :] >= query_lengths[:, None])[:, :, None, None]


def _padded_queries_as_jax_nn(out, query_lengths):
    """jax.nn's result for the queries at or past query_seq_lengths: zero (it multiplies its output
    by their padding mask), no gradient through them. The kernels compute those rows (their q zeroed:
    whatever padding holds, NaN too, is hidden) as any other; their result is replaced."""
    return jnp.where(_padded_queries(query_lengths, out.shape[1]), jnp.zeros((), out.dtype), out)


def _causal_empty_as_jax_nn(out, v, lengths):
    """The same under causal masking, which the kernels would apply to an empty entry too (each
    query averaging the keys up to it): the mean of every value is put there instead. It reads v once
    more, which a causal problem (prefill: bound by its FLOPs) hardly notices."""
    mean = kernels._mean_values(v, None, out.shape[2])  # masked_rows="average"'s, over every key
    return jnp.where((lengths <= 0)[:, None, None, None], mean.astype(out.dtype), out)


def flax_attention(mask: str | None, bias: str | None = None, force_fp32: bool = False):
    """flax.linen.dot_product_attention with a mask, or with an additive bias (bias: a key of
    SCORE_SHAPES, in q's dtype), as HF's Flax ports pass their padding and causal masks;
    force_fp32: force_fp32_for_softmax (float32 probabilities into the product with v: a float32
    result)."""
    def fn(q, k, v, *extras):
        import flax.linen as nn
        return nn.dot_product_attention(q, k, v, bias=extras[0] if bias else None, mask=extras[0] if mask else None,
                                        force_fp32_for_softmax=force_fp32)
    fn.__name__ = (f"flax.linen.dot_product_attention{'+mask' + mask if mask else ''}{'+bias' + bias if bias else ''}"
                   f"{'+force_fp32_for_softmax' if force_fp32 else ''}")
    fn.float32_out = force_fp32
    fn.any_rank = True  # (flax's batch is any number of dims)
    return fn


def flax_float32_weights(bias: str):
    """flax.linen.dot_product_attention_weights with dtype=float32 (q and k promoted to it), then the
    einsum with v in its own dtype: a float32 result (EasyLM's LLaMA: its weights' dtype
    jnp.promote_types(dtype, float32), with an HF-style bias in q's dtype)."""
    def fn(q, k, v, *extras):
        import flax.linen as nn
        weights = nn.dot_product_attention_weights(q, k, bias=extras[0], dtype=jnp.float32)
        return jnp.einsum("...hqk,...khd->...qhd", weights, v)
    fn.__name__ = f"flax.linen.dot_product_attention_weights(float32)+bias{bias}"
    fn.float32_out = True
    fn.any_rank = True  # (flax's batch is any number of dims)
    return fn


def flax_attention_dropout(mask: str | None, bias: str | None = None):
    """flax.linen.dot_product_attention with dropout (dropout_rate > 0, not deterministic): the
    probabilities times a multiplier made from random bits (the last input: how it is made, broadcast
    over batch and heads or not, is outside the pattern). HF's Flax ports call
    dot_product_attention_weights so, with a bias, then the einsum with v."""
    def fn(q, k, v, *extras):
        import flax.linen as nn
        weights = nn.dot_product_attention_weights(q, k, bias=extras[0] if bias else None,
                                                   mask=extras[0] if mask else None)
        return jnp.einsum("...hqk,...khd->...qhd", weights * extras[-1], v)
    fn.__name__ = (f"flax.linen.dot_product_attention{'+mask' + mask if mask else ''}"
                   f"{'+bias' + bias if bias else ''}+dropout")
    fn.any_rank = True  # (flax's batch is any number of dims)
    return fn


# Masks and biases of the scores [b, h, q, k] in a by-hand spelling: of the scores' own shape, or
# broadcast to it (a key padding mask [b,1,1,k], a mask per batch [b,1,q,k], ...: the program is the
# same broadcast whatever the size-1 axes, and the exact re-trace checks the shape).
# The broadcast form first: the same-shape template would also match it, taking the broadcast
# (a full [b, h, q, k] array) as its input.
SCORE_SHAPES = {"(broadcast)": lambda b, h, q, k: (b, 1, 1, k), "[b,h,q,k]": lambda b, h, q, k: (b, h, q, k)}


# The same masks where the scores are [b, q, h, k] ("bqhd,bkhd->bqhk", as Levanter's haliax and many
# hand-written models order them): the kernels take them transposed to [b, h, q, k].
BQHK_SHAPES = {"(broadcast)": lambda b, h, q, k: (b, 1, 1, k), "[b,q,h,k]": lambda b, h, q, k: (b, q, h, k),
               "[1,q,1,k]": lambda b, h, q, k: (1, q, 1, k)}


def _causal(scores, layout="bshd"):
    if layout == "bqhk":  # queries on axis 1, keys last
        visible = jnp.tril(jnp.ones((scores.shape[1], scores.shape[3]), bool))[None, :, None, :]
        return jnp.where(visible, scores, -jnp.inf)
    sq, sk = scores.shape[-2:]
    return jnp.where(jnp.tril(jnp.ones((sq, sk), bool)), scores, -jnp.inf)


# Where a by-hand spelling scales and upcasts its scores (by_hand's `scores`): the product of q and k
# scaled ("product"); q scaled before the product ("scaled q", as flax and Gemma write it); the
# product computed in float32 (preferred_element_type) and then scaled ("float32 product"); the
# product cast to float32, then scaled ("upcast product"); q and k cast to float32 before the product
# ("float32 q, k", t5x's float32_logits); q and k cast to float32 and q scaled then ("float32 q, k,
# scaled q", AlphaFold 3's). All but the first two softmax in float32 and cast the probabilities
# back to q's dtype.
SCORES = ("product", "scaled q", "float32 product", "upcast product", "float32 q, k", "float32 q, k, scaled q")
# Multi-query attention with k and v of no heads dim ([b, k, d]; PaLM's einsum "bhid,bjd->bhij"),
# q [b, h, q, d]: the kernels take one k/v head.
MQA = "bhsd,mqa"
# Heads folded into the batch: q, k, v [batch * heads, seq, d] (diffusers' Flax attention, Stable
# Diffusion's UNet: "b i d, b j d -> b i j"; `q @ k.transpose(0, 2, 1)` after a head_to_batch_dim):
# the kernels take each entry as a batch of one head.
FOLDED = "bsd"
# The layouts whose spellings take any number of batch dims (none: one example, [s, h, d]; two or
# more: AlphaFold's batch of batches, a model mapped by jax.vmap twice): the kernels take them
# flattened into one (_flat_batch).
ANY_RANK = ("bshd", "bhsd")


def by_hand(layout: str, causal: bool, upcast: bool, scaling: str = "*scale", mask: str | None = None,
            bias: str | None = None, float32_bias: bool = False, dropout: str | None = None,
            scores: str = "product", softcap: bool = False, float32_out: bool = False, sinks: bool = False,
            hidden: bool = False, subtracted: bool = False, upcast_first: bool = False,
            second_bias: str | None = None, second_float32: bool | None = None):
    """einsum -> scaling -> (+ bias) -> (where(mask, scores, fill)) -> (causal -inf where) ->
    softmax (float32 or not) -> einsum. scaling: "*scale", "/divisor" (a number; the param `scale`
    holds it), "/sqrt(d)" (in q's dtype), "*array" / "/array" (a 0-d float32 array, the last input,
    cast to the scores' dtype: a Python number passed to the jitted function, `1 / jnp.sqrt(d)`),
    UNSCALED (none: T5 folds 1/sqrt(d) into q's initialization), ROW_SCALING (times an array in the scores' dtype that broadcasts to them with one value for every
    key, the last input: a temperature per head, [1, h, 1, 1] here).
    mask / bias: a key of SCORE_SHAPES, their inputs in that order after v. dropout, on the
    probabilities before the einsum: "multiplier" (times the last input) or "select" (flax's
    nn.Dropout: select(keep, probs / keep_prob, 0), keep the last input).
    scores: one of SCORES (the float32 ones imply `upcast`). softcap: the scaled scores capped as
    Gemma 2 caps them, tanh(scores / cap) * cap (the param `cap`), before the bias and mask.
    float32_out (with `upcast`): the float32 probabilities weight v as they are (not cast back to
    q's dtype): the einsum promotes, and the result is float32. sinks: gpt-oss's attention sinks, a
    column of logits (the last input, [b, h, q, 1] in the softmax's dtype) joined to the masked
    scores for the softmax and dropped from its result. hidden: the mask marks the keys hidden, not
    those seen (nanoGPT's where(tril == 0, -inf, scores)). subtracted: the bias is subtracted
    (`scores - 1e6 * triu(ones, 1)`, a mask as some courses write it; ALiBi's `- slope * distance`).
    upcast_first (with `upcast`): the scores are cast to float32 before the mask and the causal where,
    not after them (the fill is then a float32 literal). second_bias (with `bias`): a key of
    SCORE_SHAPES, a second bias added after the first (AlphaFold's: a padding bias, then the pair
    representation's bias per head), its input after the first's; second_float32: whether it is
    float32 (None: as the first)."""
    # (with "..." for the batch: at 4-D the same program as "b"; at other ranks the batch of batches
    # or none, as AlphaFold and flax write it)
    qk, pv = {"bshd": ("...qhd,...khd->...hqk", "...hqk,...khd->...qhd"),
              "bhsd": ("...hqd,...hkd->...hqk", "...hqk,...hkd->...hqd"),
              "bhsd,mqa": ("bhqd,bkd->bhqk", "bhqk,bkd->bhqd"), FOLDED: ("bqd,bkd->bqk", "bqk,bkd->bqd"),
              "bqhk": ("bqhd,bkhd->bqhk", "bqhk,bkhd->bqhd"), "bqhk,gqa": (None, None)}[layout]

    def qk_einsum(q, k, **kw):  # Gemma's GQA: q's heads grouped by k/v head, scores [b, q, heads, k]
        if layout != "bqhk,gqa":
            return jnp.einsum(qk, q, k, **kw)
        b, t, n, d = q.shape
        s = jnp.einsum("btkgd,bskd->btkgs", q.reshape(b, t, k.shape[2], n // k.shape[2], d), k, **kw)
        return s.reshape(b, t, n, s.shape[-1])

    def pv_einsum(p, v):
        if layout != "bqhk,gqa":
            return jnp.einsum(pv, p, v)
        b, t, n, s = p.shape
        o = jnp.einsum("btkgs,bskd->btkgd", p.reshape(b, t, v.shape[2], n // v.shape[2], s), v)
        return o.reshape(b, t, n, v.shape[-1])

    def scaled(scores, q, scale):
        if scaling == "*scale":
            return scores * scale
        if scaling == "/divisor":
            return scores / scale
        if scaling in ARRAY_SCALINGS:  # a scalar the program computes or is given, cast to the scores'
            return scores * scale.astype(scores.dtype) if scaling == "*array" else scores / scale.astype(scores.dtype)
        if scaling == ROW_SCALING:  # an array per head (or query, batch entry), one value for every key
            return scores * scale
        if scaling == UNSCALED:
            return scores
        return scores / jnp.sqrt(q.shape[-1]).astype(q.dtype)

    def product(q, k, scale):
        if scores == "scaled q":
            return qk_einsum(scaled(q, q, scale), k)
        if scores == "float32 product":
            return scaled(qk_einsum(q, k, preferred_element_type=jnp.float32), q, scale)
        if scores == "upcast product":
            return scaled(qk_einsum(q, k).astype(jnp.float32), q, scale)
        if scores == "float32 q, k":
            return scaled(qk_einsum(q.astype(jnp.float32), k.astype(jnp.float32)), q, scale)
        if scores == "float32 q, k, scaled q":
            return qk_einsum(scaled(q.astype(jnp.float32), q, scale), k.astype(jnp.float32))
        return scaled(qk_einsum(q, k), q, scale)

    def fn(q, k, v, *extras, **params):
        if sinks:
            extras, sink = extras[:-1], extras[-1]
        if scaling in (*ARRAY_SCALINGS, ROW_SCALING):  # the scale array: the last input
            extras, scale = extras[:-1], extras[-1]
        else:
            scale = params.get("scale")
        scores = product(q, k, scale)
        if softcap:
            scores = jnp.tanh(scores / params["cap"]) * params["cap"]
        if bias:
            scores = scores - extras[0] if subtracted else scores + extras[0]
        if second_bias:
            scores = scores + extras[1]
        if upcast_first:
            scores = scores.astype(jnp.float32)
        if mask == "[b,q,k]":  # Gemma's: [b, q, 1, k] against its [b, q, heads, k] scores
            scores = jnp.where(jnp.expand_dims(extras[-1], -2), scores, params["fill"])
        elif mask and hidden:
            scores = jnp.where(extras[-1], params["fill"], scores)
        elif mask:
            scores = jnp.where(extras[-1], scores, params["fill"])
        if causal:
            scores = _causal(scores, layout)
        scores = scores.astype(jnp.float32) if upcast and not upcast_first else scores
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1) if sinks else scores, axis=-1)
        probs = probs[..., :-1] if sinks else probs
        if upcast and not float32_out:
            probs = probs.astype(q.dtype)
        if dropout == "multiplier":
            probs = probs * extras[-1]
        elif dropout == "select":
            probs = jax.lax.select(extras[-1], probs / params["keep"], jnp.zeros_like(probs))
        return pv_einsum(probs, v)
    fn.grouped = layout == "bqhk,gqa"
    fn.any_rank = layout in ANY_RANK
    # (a float32 bias promotes half-precision scores: their float32 probabilities weight v as they
    # are, a float32 result, unless the softmax is upcast and cast back)
    fn.float32_out = float32_out or bool(bias and float32_bias and not upcast)
    fn.upcast, fn.hidden, fn.subtracted = upcast, hidden, subtracted
    fn.second_bias = second_bias
    second_float32 = float32_bias if second_float32 is None else second_float32
    fn.second_float32 = second_float32
    fn.__name__ = (f"einsum[{layout}]{'' if scaling == '*scale' else '(unscaled)' if scaling == UNSCALED else scaling}"
                   f"{'' if scores == 'product' else '+' + scores}{'+soft cap' if softcap else ''}"
                   f"{'+causal' if causal else ''}"
                   f"{('-' if subtracted else '+') + ('float32 bias' if float32_bias else 'bias') + bias if bias else ''}"
                   f"{'+' + ('float32 bias' if second_float32 else 'bias') + second_bias if second_bias else ''}"
                   f"{('+hidden mask' if hidden else '+mask') + mask if mask else ''}"
                   f"{'+float32 softmax' if upcast and scores in ('product', 'scaled q') else ''}"
                   f"{' cast before masking' if upcast_first else ''}"
                   f"{'+float32 out' if float32_out else ''}"
                   f"{'+dropout(' + dropout + ')' if dropout else ''}{'+sinks' if sinks else ''}")
    return fn


def _params_of(scale: bool, fill: bool, window: bool = False, keep: bool = False, cap: bool = False):
    def params_of(match) -> dict:
        params = {"scale": literal_at(match, EXAMPLE_SCALE)} if scale else {}
        if cap:
            params["cap"] = soft_cap_at(match, EXAMPLE_CAP)
        if window:
            params.update(zip(("left", "right"), (int(literal_at(match, n)) for n in EXAMPLE_WINDOW)))
        if keep:
            params["keep"] = literal_at(match, EXAMPLE_KEEP)
        return {**params, "fill": literal_at(match, EXAMPLE_FILL)} if fill else params
    return params_of


def _differentiable_multiplier(match) -> bool:
    """Whether the dropout multiplier (the last input) is computed from a floating-point program
    input, which could want its gradient (the kernels give it none). Random bits, keys, booleans and
    integers carry no gradient: the walk back stops at them."""
    graph, seen, stack = match.graph, set(), [match.inputs[-1]]
    while stack:
        var = stack.pop()
        if isinstance(var, Literal) or var in seen or var in graph.consts:
            continue
        seen.add(var)
        if not jnp.issubdtype(var.aval.dtype, jnp.floating):
            continue
        if var not in graph.producer:
            return True
        stack.extend(graph.eqns[graph.producer[var][0]].invars)
    return False


def _check(layout, dropout=None, sinks=False, row_scale=False, array_scale=False, any_rank=False):
    def check(match, params) -> str | None:
        if sinks and match.input_avals[-1].shape[-1] != 1:
            return "more than one column joined to the scores: not one sink logit per row"
        scale_shape = match.input_avals[-1 - sinks].shape if row_scale or array_scale else ()
        if array_scale and scale_shape:  # (in float32 the scalar's template has no cast: a row scale's look-alike)
            return f"the scores times an array of shape {scale_shape}: not the scalar this spelling takes"
        if row_scale and (len(scale_shape) > 4 or scale_shape and scale_shape[-1] != 1):
            return (f"the scores times an array of shape {scale_shape}, which varies over the keys: no scale of q "
                    "the kernels could take")
        if dropout and _differentiable_multiplier(match):
            return ("the dropout multiplier is computed from a floating-point input, whose gradient the "
                    "attention kernels do not give: left to XLA")
        if params.get("keep", 1.0) <= 0:
            return f"dropout keep probability {params['keep']}"
        q, k, v = match.input_avals[:3]
        if any(a.dtype not in ALL for a in (q, k, v)):
            return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: the attention kernels take one of bf16/fp16/fp32"
        out = match.graph.eqns[match.anchor].outvars[0].aval.dtype
        if not q.dtype == k.dtype == v.dtype and not (jnp.result_type(q.dtype, k.dtype, v.dtype) == q.dtype == out):
            # (q the widest, as a float32 query against a bfloat16 cache: jnp promotes k and v to q's
            # dtype inside the products, and so does replace; otherwise the program rounds in between)
            return (f"dtypes {q.dtype}, {k.dtype}, {v.dtype} and a {out} result: the kernels take k and v "
                    "promoted to q's dtype where q's is the widest and the result's; cast them to one dtype first")
        rank = {MQA: (4, 3), FOLDED: (3, 3)}.get(layout, (4, 4))
        if layout == "bhsd" and q.ndim == 3:  # (one example [h, s, d]: heads folded into the batch, FOLDED's)
            return "q, k, v [heads, seq, dim] of one example: the spelling of heads folded into the batch takes them"
        if any_rank and (q.ndim < 3 or k.ndim != q.ndim or k.shape != v.shape or q.shape[:-3] != k.shape[:-3]):
            return "q, k and v not of one batch (any number of dims, the same for each) and then 3 dims"
        if not any_rank and ((q.ndim, k.ndim) != rank or k.shape != v.shape):
            return f"not {rank[0]}-D q and {rank[1]}-D k, v"
        heads_dim = q.ndim - (3 if layout.startswith("bhsd") else 2)
        d, heads = q.shape[-1], 1 if layout == FOLDED else q.shape[heads_dim]
        kv_heads = 1 if layout in (MQA, FOLDED) else k.shape[heads_dim]
        if d > kernels.MAX_HEAD_DIM:
            return f"head dim {d} > {kernels.MAX_HEAD_DIM}"
        if kv_heads == 0 or heads % kv_heads:
            return "k/v heads do not divide q's heads"
        if not (params.get("scale", 1.0) > 0 and math.isfinite(params.get("scale", 1.0))):  # (NaN too)
            return f"scale {params['scale']}: the kernels take a positive finite scale"
        if not (params.get("cap", 1.0) > 0 and math.isfinite(params.get("cap", 1.0))):
            return ("tanh(scores / a) * b with a != b, or a cap that is not positive and finite: not the soft cap "
                    "the kernels take")
        if params.get("fill", MAX_FILL) > MAX_FILL:
            return (f"masked scores filled with {params['fill']}: only a fill <= {MAX_FILL:g} hides a "
                    "key exactly, as the kernels do")
        return None
    return check


# Masks the program computes from constants (a causal mask from iota or tril, as flax's
# make_causal_mask builds it, batch axis included; a sliding window's band) are evaluated on the
# device when planning, up to this many elements (b16 s4096), and a causal, banded or all-true one is
# dropped for causal=True, local_window_size or no mask: those take the unmasked kernels (the
# warp-specialized ones on Hopper; a window's visits only its blocks) instead of the tile lists a
# mask needs.
CONSTANT_MASK_ELEMENTS = 1 << 28


def _mask_facts(match, index: int = -1, layout: str = "bshd", hidden: bool = False) -> dict:
    """{"mask_kind": "causal" | "none"} when the matched mask (input `index`: the last but a
    dropout's) is a constant of that kind, {"mask_kind": "window", "left": l, "right": r} for the
    same band of keys i - l ... i + r in every batch entry and head, else {}."""
    mask = constant_value(match.graph, match.inputs[index], CONSTANT_MASK_ELEMENTS)
    if hidden and mask is not None:  # (it marks the keys hidden)
        with jax.ensure_compile_time_eval():
            mask = jnp.logical_not(mask)
    if layout == "bqhk" and mask is not None and mask.ndim == 4:  # [b, q, h, k]: queries, keys last
        with jax.ensure_compile_time_eval():
            mask = jnp.transpose(mask, (0, 2, 1, 3))
    return _mask_kind(mask)


def _mask_kind(mask) -> dict:
    """_mask_facts of a mask's value (None: not a constant)."""
    if mask is None or mask.ndim < 2:
        return {}
    with jax.ensure_compile_time_eval():
        if bool(jnp.all(mask)):
            return {"mask_kind": "none"}
        sq, sk = mask.shape[-2:]
        if sq == 1 or sk == 1:  # broadcast over the queries (or keys): which size it stands for is unknown
            return {}
        offset = jnp.arange(sk)[None, :] - jnp.arange(sq)[:, None]  # key position - query position
        if bool(jnp.all(mask == (offset <= 0))):
            return {"mask_kind": "causal"}
        first = mask.reshape(-1, sq, sk)[0]
        if not bool(jnp.any(first)) or not bool(jnp.all(mask == first)):
            return {}
        left, right = (int(jnp.max(jnp.where(first, sign * offset, -sq - sk))) for sign in (-1, 1))
        if left < 0 or right < 0 or not bool(jnp.all(first == ((offset >= -left) & (offset <= right)))):
            return {}
    return {"mask_kind": "window", "left": left, "right": right}


# What every spelling holds (Pattern.requires): programs without them trace none of the ~230 templates.
SOFTMAX_AND_PRODUCTS = frozenset({"dot_general", "exp", "reduce_max"})


# A bias this negative, added to a score in float32 or bfloat16, leaves nothing of the score: a row
# it hides entirely has equal scores, so XLA's softmax there is uniform. At -1e9 (float32's grid is 64
# there) that holds while the row's own scores spread over less than 32, as the kernels assume for
# such a row when it is a bias too (kernels.FAR_BIAS); a bias of 0 or -1e9 (`jnp.where(mask, 0., -1e9)`,
# `(1. - mask) * -1e9` of a boolean mask, a constant padding bias) therefore runs as a mask, whose
# tile lists skip what it hides.
HUGE_BIAS = -kernels.FAR_BIAS


def _bias_facts(match, index: int = 3) -> dict:
    """{"bias_kind": "mask"} when the matched bias (input `index`) holds only 0 and a finite fill <=
    HUGE_BIAS as a function of one boolean mask (graph.padding_fill: HF's Flax ports' lax.select(mask
    > 0, 0, finfo.min), `(1. - mask) * -1e9` of a boolean mask cast), or a constant holding
    only those: the kernels then take `bias == 0` as a mask, whose tile lists skip what it hides, and
    treat a row it hides entirely as XLA does (masked_rows="bias"). A constant may also fill with
    -inf (gpt-oss's causal and sliding-window masks) where it hides no row entirely (XLA's row is
    NaN there). A constant's mask is also read for its kind (_mask_facts: causal, a window)."""
    graph, var = match.graph, match.inputs[index]
    if isinstance(var, Literal):
        return {}
    bias = constant_value(graph, var, CONSTANT_MASK_ELEMENTS)
    if bias is not None:  # a constant, or computed from constants: its values decide
        if bias.size == 0:
            return {}
        with jax.ensure_compile_time_eval():
            fill, visible = float(jnp.min(bias)), bias == 0
            hides = fill <= HUGE_BIAS and bool(jnp.all(visible | (bias == fill))) and (
                fill > -np.inf or bool(jnp.all(jnp.any(visible, -1))))
        return {"bias_kind": "mask", **_mask_kind(visible)} if hides else {}
    fill = padding_fill(graph, var)
    return {"bias_kind": "mask"} if fill is not None and -np.inf < fill <= HUGE_BIAS else {}


def _mask_bias_facts(match) -> dict:
    """Of two biases (by_hand's second_bias): {"mask_bias": its input index, ...} where one of them
    is a padding bias standing for a mask (_bias_facts; a position bias, then padding, by hand): the
    kernels take the other as the bias and this one as the mask, and the sum [batch, heads, q, k]
    is never made."""
    for index in (4, 3):
        facts = _bias_facts(match, index)
        if facts:
            return {"mask_bias": index, **{k: v for k, v in facts.items() if k != "bias_kind"}}
    return {}


def _padding_split(graph, var):
    """(b, p, dtype) where the bias `var` is b + p (either order), cast to dtype or not (None), and p
    a padding bias (0 or a finite fill <= HUGE_BIAS: graph.padding_fill); else None. t5x adds its padding
    bias to the position bias [1, h, q, k], then the sum to the scores (HF's Flax T5 the other way
    round): the kernels take b as the bias and p as the mask, so the sum is never made."""
    dtype = None
    eqn = graph.eqns[graph.producer[var][0]] if isinstance(var, Var) and var in graph.producer else None
    if eqn is not None and eqn.primitive.name == "convert_element_type":
        dtype, var = eqn.params["new_dtype"], eqn.invars[0]
        eqn = graph.eqns[graph.producer[var][0]] if isinstance(var, Var) and var in graph.producer else None
    if eqn is None or eqn.primitive.name != "add" or var.aval.ndim != 4:
        return None
    for b, p in (eqn.invars, eqn.invars[::-1]):
        if not (isinstance(b, Var) and isinstance(p, Var) and b.aval.ndim == p.aval.ndim == 4):
            continue
        fill = padding_fill(graph, p)
        if fill is not None and -np.inf < fill <= HUGE_BIAS:
            return b, p, dtype
    return None


def _split_bias_facts(match) -> dict:
    """{"bias_split": True} where the one bias (input 3) is a position bias plus a padding bias
    (_padding_split): Pattern.substitutes then reads the two for it."""
    return {"bias_split": True} if _padding_split(match.graph, match.inputs[3]) else {}


ARRAY_SCALINGS = ("*array", "/array")
ROW_SCALING = "*rows"
UNSCALED = "unscaled"
# The scalings taking no array: by a number read off the program, by sqrt(head dim), or none
NUMBER_SCALINGS = ("*scale", "/divisor", "/sqrt(d)", UNSCALED)


def _scale_facts(match, scaling: str) -> dict:
    """{"scale_value": x} when the array scale (the last input) is computed from constants and
    positive (1 / jnp.sqrt(d)): the kernels take it. A traced scale (a Python number passed to the
    jitted function, a learned temperature) or another constant scales q instead."""
    var = match.inputs[-1]
    value = float(var.val) if isinstance(var, Literal) else constant_value(match.graph, var, 1)
    if value is None:
        return {}
    with jax.ensure_compile_time_eval():
        value = float(value)
    return {"scale_value": value} if value > 0 and np.isfinite(value) else {}


def _pattern(fn, dtypes, *, layout="bshd", causal=False, with_bias=False, with_mask=None, params=True,
             scaling="*scale", fill=False, shapes=None, float32_bias=True, with_lengths=False, window=False,
             dropout=None, softcap=False, sinks=False):
    """Inputs q, k, v, then the bias and the mask where the spelling has them, then an array scale
    (scaling "*array" or "/array") (with_bias / with_mask:
    True or a key of `shapes`, MASK_SHAPES by default; a bias alone has jax.nn's [b,h,q,k]); the
    bias is float32, or else in q's dtype. window: jax.nn's local_window_size, whose two position
    constants follow (unread by the replacement). dropout: "multiplier" (the last input multiplies
    the probabilities) or "select" (the last input is the boolean keep; param keep, its probability).
    softcap: the scores are capped (param cap). sinks: a column of sink logits (the last input)."""
    shapes = shapes or MASK_SHAPES
    second_bias = getattr(fn, "second_bias", None)  # (by_hand's: a second bias, after the first)
    any_rank = getattr(fn, "any_rank", False)  # (by_hand's and flax's: q, k, v [..., s, h, d])

    def example(dtype):
        q = jax.ShapeDtypeStruct((8, 8, 16) if layout == FOLDED else (2, 8, 4, 16), dtype)
        kv = jax.ShapeDtypeStruct((2, 8, 2, 16) if getattr(fn, "grouped", False) else (2, 4, 16) if layout == MQA
                                  else q.shape, dtype)
        b, s, h = (2, 4, 8) if layout.startswith("bhsd") else (2, 8, 4)
        shape = lambda key: shapes[key](b, h, s, s) if callable(shapes[key]) else shapes[key]
        f32 = (float32_bias, getattr(fn, "second_float32", float32_bias))
        bias = tuple(jax.ShapeDtypeStruct(shape(key) if isinstance(key, str) else (2, 4, 8, 8),
                                          jnp.float32 if f32[n] else dtype)
                     for n, key in enumerate((with_bias, second_bias)) if key)
        mask = (jax.ShapeDtypeStruct(shape(with_mask), jnp.bool_),) if with_mask else ()
        lengths = (jax.ShapeDtypeStruct((2,), jnp.int32),) * (with_lengths + getattr(fn, "query_lengths", False))
        drop = {None: (), "multiplier": (jax.ShapeDtypeStruct((1, 1, s, s), dtype),),
                "select": (jax.ShapeDtypeStruct((b, h, s, s), jnp.bool_),)}[dropout]
        scale = ((jax.ShapeDtypeStruct((), jnp.float32),) if scaling in ARRAY_SCALINGS else
                 (jax.ShapeDtypeStruct((1, h, 1, 1), dtype),) if scaling == ROW_SCALING else ())
        sink = (jax.ShapeDtypeStruct((b, h, s, 1), jnp.float32 if fn.upcast else dtype),) if sinks else ()
        return (q, kv, kv, *bias, *mask, *lengths, *drop, *scale, *sink)

    def replace(q, k, v, *extras, **params):
        params.pop("batch_dims", None)  # (facts_of's, for the cost model)
        k, v = k.astype(q.dtype), v.astype(q.dtype)  # (a bfloat16 cache under float32 queries: as jnp promotes)
        if not any_rank or q.ndim == 4:
            return replace_batched(q, k, v, *extras, **params)
        batch = q.shape[:-3]  # (none, or several dims: made one for the kernels)
        out = replace_batched(*(_flat_batch(x, batch) for x in (q, k, v, *extras)), **params)
        return out.reshape(batch + out.shape[1:])

    def replace_batched(q, k, v, *extras, backend, scale=None, fill=None, mask_kind=None, left=None, right=None,
                        keep=None, bias_kind=None, scale_value=None, cap=None, mask_bias=None, bias_split=False):
        multiplier, sink = None, None
        if window:  # jax.nn's two position constants (None: ignored)
            extras = extras[:-2]
        if sinks:
            extras, sink = extras[:-1], extras[-1]
        if scaling in ARRAY_SCALINGS:  # a constant scale goes to the kernels; else q is scaled by it
            extras, scale_array = extras[:-1], extras[-1]
            if scale_value is not None:
                scale = scale_value if scaling == "*array" else 1 / scale_value
            else:  # (in float32: the scale's gradient sums over every element of q)
                s, qf = scale_array.astype(q.dtype).astype(jnp.float32), q.astype(jnp.float32)
                q, scale = (qf * s if scaling == "*array" else qf / s).astype(q.dtype), 1.0
        if scaling == ROW_SCALING:  # scores [b, h, q, k] times t, one value for every key: q times t
            extras, t = extras[:-1], extras[-1]
            t = t.reshape((1,) * (4 - t.ndim) + t.shape)
            t = t.transpose(0, 2, 1, 3) if layout == "bshd" else t  # as q: [b, q, h, d] / [b, h, q, d]
            q, scale = (q.astype(jnp.float32) * t.astype(jnp.float32)).astype(q.dtype), 1.0
        if dropout:  # select(keep, probs / keep, 0) as a multiplier in the probabilities' dtype
            extras, multiplier = extras[:-1], extras[-1]
            if dropout == "select":
                multiplier = jnp.where(multiplier, 1 / jnp.asarray(keep, q.dtype), jnp.zeros((), q.dtype))
        bias = extras[0] if with_bias and bias_kind is None else None
        if second_bias:  # both (the kernels add them: a key bias is read per key), or the one not a padding mask
            bias = (extras[0], extras[1]) if mask_bias is None else extras[4 - mask_bias]
        if bias is not None and getattr(fn, "subtracted", False):
            bias = tuple(-b for b in bias) if isinstance(bias, tuple) else -bias
        if bias_split:  # (the bias b + p substituted by the two: _padding_split)
            bias, as_mask = extras[0]
        else:
            as_mask = extras[0] if bias_kind == "mask" else None if mask_bias is None else extras[mask_bias - 3]
        hidden_by_bias = as_mask == 0 if as_mask is not None and mask_kind is None else None
        if scaling in (*ARRAY_SCALINGS, ROW_SCALING):
            pass
        elif scaling == "/sqrt(d)":  # divided by sqrt(head dim), rounded to q's dtype
            scale = 1 / float(np.sqrt(np.float32(q.shape[-1])).astype(q.dtype))
        elif scaling == UNSCALED:
            scale = 1.0
        elif scale is None:  # flax: 1 / sqrt(head dim)
            scale = 1 / math.sqrt(q.shape[-1])
        elif scaling == "/divisor":
            scale = 1 / scale
        if layout == MQA:  # k, v [b, k, d]: one k/v head
            q, k, v = q.transpose(0, 2, 1, 3), k[:, :, None], v[:, :, None]
        elif layout == FOLDED:  # [b * h, s, d]: a batch of one head each
            q, k, v = (a[:, :, None] for a in (q, k, v))
        elif layout == "bhsd":
            q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        mask = extras[-1] if with_mask and mask_kind is None else hidden_by_bias
        if mask is not None and getattr(fn, "hidden", False) and mask_kind is None:
            mask = jnp.logical_not(mask)
        if mask is not None and layout == "bqhk" and with_mask in BQHK_SHAPES:
            mask = mask.transpose(0, 2, 1, 3)
        elif mask is not None and with_mask == "[b,q,k]":
            mask = mask[:, None]
        elif mask is not None and with_mask == "[q,k]":
            mask = mask[None, None]
        lengths = _per_entry(extras[-1], q) if with_lengths else None
        if getattr(fn, "query_lengths", False):
            q = jnp.where(_padded_queries(_per_entry(extras[-1 - with_lengths], q), q.shape[1]), jnp.zeros((), q.dtype), q)
        if with_lengths and not causal:
            q, lengths = _lengths_as_jax_nn(q, k, lengths)
        banded = window or mask_kind == "window"  # a band can hide every key of a query
        # A query whose keys are all hidden averages every value under a finite fill, and under a
        # bias of finfo.min (an HF port's padding: XLA's scores there are all -3.4e38, equal); it
        # is NaN under a fill of -inf (XLA's softmax of -inf scores)
        hiding = mask is not None or banded
        average = hiding and (fill is None or np.isfinite(fill)) or (with_bias and not with_mask)
        out = kernels.attention(q, k, v, causal=causal or mask_kind == "causal",
                                bias=bias, mask=mask, scale=scale, backend=backend, kv_lengths=lengths,
                                masked_rows="bias" if as_mask is not None else "average" if average else
                                "nan" if hiding and fill == -np.inf else "zeros",
                                local_window_size=(left, right) if banded else None,
                                dropout_multiplier=multiplier, logits_soft_cap=cap, sinks=sink,
                                out_dtype=jnp.float32 if getattr(fn, "float32_out", False) else None)
        if with_lengths and causal:
            out = _causal_empty_as_jax_nn(out, v, lengths)
        if getattr(fn, "query_lengths", False):
            out = _padded_queries_as_jax_nn(out, _per_entry(extras[-1 - with_lengths], out))
        return out.transpose(0, 2, 1, 3) if layout.startswith("bhsd") else out[:, :, 0] if layout == FOLDED else out

    example_params = {**({"scale": EXAMPLE_SCALE} if params else {}), **({"fill": EXAMPLE_FILL} if fill else {}),
                      **(dict(zip(("left", "right"), EXAMPLE_WINDOW)) if window else {}),
                      **({"keep": EXAMPLE_KEEP} if dropout == "select" else {}),
                      **({"cap": EXAMPLE_CAP} if softcap else {})}
    arrays = scaling in ARRAY_SCALINGS
    mask_index = -1 - bool(dropout) - (arrays or scaling == ROW_SCALING) - sinks - 2 * window
    # (a bias of scores [b, h, q, k], added, alone: a position bias plus padding is split for the kernels)
    splittable = not (getattr(fn, "subtracted", False) or layout.startswith("bqhk") or layout == FOLDED)

    def facts_of(match) -> dict:
        # (beside a window, a mask goes to the kernels as it is: read from constants, it could be a
        # second window)
        facts = (_mask_facts(match, mask_index, layout, getattr(fn, "hidden", False)) if with_mask and not window
                 else _mask_bias_facts(match) if second_bias
                 else _bias_facts(match) or _split_bias_facts(match) if with_bias and splittable
                 else {})
        if any_rank and match.input_avals[0].ndim != 4:  # (the cost model's: how many batch dims q has)
            facts = {**facts, "batch_dims": match.input_avals[0].ndim - 3}
        return {**facts, **_scale_facts(match, scaling)} if arrays else facts
    return Pattern(name=f"attention/{fn.__name__}", op="attention_dropout" if dropout else "attention", fn=fn,
                   dtypes=dtypes, example=example,
                   example_params=example_params,
                   params_of=_params_of(params, fill, window, dropout == "select", softcap),
                   check=_check(layout, dropout, sinks, scaling == ROW_SCALING, arrays, any_rank), replace=replace,
                   facts_of=facts_of,
                   ignores=lambda params: ({params.get("mask_bias", 3 + bool(with_bias and with_mask))}
                                           if params.get("mask_kind") else
                                           {3 + bool(with_mask), 4 + bool(with_mask)} if window else set()),
                   constants=2 if window else 0,
                   requires=SOFTMAX_AND_PRODUCTS | ({"random_bits"} if dropout else set()),
                   split_dims=_split_dims(layout, causal or bool(with_mask) or window),
                   xla_when=functools.partial(_bias_trained, biases=2 if second_bias else 1) if with_bias else None,
                   substitutes=_substitutes(None if getattr(fn, "grouped", False) or layout == FOLDED
                                            else _unrepeated_kv(layout)))


def _bias_trained(perturbed: list[bool], params: dict, biases: int = 1) -> str | None:
    """Pattern.xla_when: why a call that differentiates the bias (a learned one: T5's relative-position
    table) runs as written, or None. The bias's gradient is the scores' (dS), which the kernels do not
    write, so XLA recomputes the scores for it, and the kernels' work is on top of XLA's. H200, T5's
    b32 s512 h16 d64: 0.83x jax.jit with the table's gradient, against 1.18x for the forward alone
    (h200-attention-t5-session39.json). Such a call runs the program as written (jax.jit's); the
    forward alone, and training where the bias is a constant or a mask, keep the kernels. biases: how
    many inputs from the fourth on are biases (AlphaFold's padding bias and pair bias: two), of which
    params["mask_bias"] (an index) may be a padding bias standing for a mask (_mask_bias_facts)."""
    trained = [p for n, p in enumerate(perturbed[3:3 + biases], 3) if n != params.get("mask_bias")]
    if params.get("bias_kind") is None and any(trained):
        return ("this call differentiates the bias, whose gradient needs the scores the kernels do not write "
                "(XLA would recompute them beside the kernels): run as written")
    return None


def _flat_batch(x, batch: tuple):
    """x of q, k, v [*batch, 3 dims], or broadcasting to the scores [*batch, h, q, k] (a mask, a bias,
    a dropout multiplier): the same with the batch dims made one ([1] where x broadcasts over all of
    them, else broadcast over those it does not vary along); a 0-d array (a scale) as it is."""
    if jnp.ndim(x) == 0:
        return x
    x = jnp.reshape(x, (1,) * (len(batch) + 3 - jnp.ndim(x)) + jnp.shape(x))
    rest = x.shape[len(batch):]
    if all(n == 1 for n in x.shape[:len(batch)]):
        return x.reshape((1, *rest))
    return jnp.broadcast_to(x, (*batch, *rest)).reshape((math.prod(batch), *rest))  # (not -1: rest may hold a 0)


def _producing(graph, var, name: str):
    """The equation of primitive `name` producing `var`, else None."""
    if isinstance(var, Literal) or var not in graph.producer:
        return None
    eqn = graph.eqns[graph.producer[var][0]]
    return eqn if eqn.primitive.name == name else None


def _repeated(graph, var, axis: int):
    """(source, n, perm) where `var` is jnp.repeat(source, n, axis) (or HF's repeat_kv: broadcast to
    [..., g, n, ...] and reshaped), moved by a transpose `perm` or not (None), with n > 1; else None.
    (Repeated so, head j is source head j // n: the kernels' GQA grouping. A tile's is j % g.)"""
    perm, transpose = None, _producing(graph, var, "transpose")
    if transpose is not None:
        perm, var = tuple(transpose.params["permutation"]), transpose.invars[0]
        axis = perm[axis]
    reshape = _producing(graph, var, "reshape")
    if reshape is None or reshape.params.get("dimensions") is not None:
        return None
    shape, wide = tuple(var.aval.shape), reshape.invars[0]
    if len(wide.aval.shape) != len(shape) + 1:
        return None
    g, n = wide.aval.shape[axis:axis + 2]
    if n < 2 or tuple(wide.aval.shape) != (*shape[:axis], g, n, *shape[axis + 1:]):
        return None
    kept = tuple(i for i in range(len(shape) + 1) if i != axis + 1)  # the source's dims in `wide`
    while (eqn := _producing(graph, wide, "broadcast_in_dim")) is not None:
        source, dims = eqn.invars[0], tuple(eqn.params["broadcast_dimensions"])
        if isinstance(source, Literal):
            return None
        if dims == kept and source.aval.dtype == var.aval.dtype:
            return source, n, perm
        if dims != tuple(range(len(shape) + 1)) or source.aval.shape[axis + 1] != 1:
            return None
        wide = source  # (a broadcast of the group axis from 1 to n, after an expand_dims)
    return None


def _substitutes(kv):
    """Pattern.substitutes: k and v unrepeated (kv: _unrepeated_kv's, or None), and a bias that is a
    position bias plus a padding bias read as the two (params' bias_split: _padding_split)."""
    def substitutes(match, params) -> dict:
        found = {} if kv is None else kv(match, params)
        if params.get("bias_split"):
            b, p, dtype = _padding_split(match.graph, match.inputs[3])
            found[3] = ((b, p), (lambda pair: pair) if dtype is None else
                        (lambda pair, dtype=dtype: tuple(x.astype(dtype) for x in pair)))
        return found
    return substitutes


def _unrepeated_kv(layout: str):
    """Pattern.substitutes: k and v repeated n times over the heads (jnp.repeat, HF's repeat_kv) by
    the program, as GQA ports write it: the kernels read them unrepeated, as GQA (k/v heads divide
    q's), so the repeats are not made; their gradients sum over each group, as the repeat's do."""
    def substitutes(match, params) -> dict:
        if layout == MQA or len(match.inputs) < 3:
            return {}
        heads = match.input_avals[1].ndim - (3 if layout.startswith("bhsd") else 2)
        found = [_repeated(match.graph, v, heads) for v in match.inputs[1:3]]
        if None in found or found[0][1:] != found[1][1:]:
            return {}
        adapt = (lambda x: x) if found[0][2] is None else (lambda x, perm=found[0][2]: jnp.transpose(x, perm))
        return {i: (source, adapt) for i, (source, _, _) in zip((1, 2), found)}
    return substitutes

def _split_dims(layout: str, positional: bool):
    """The dims of each input the kernels split across devices: batch and heads (kernels/attention's
    split rule), of q, k, v in the layout's order and of [b, h, q, k] masks and biases ([b, q, h, k]
    where the scores are ordered so). Of a batch of several dims (ANY_RANK), its first; of one
    example, the heads. Of a vector, its one dim (key_value_seq_lengths: one per example; any other
    is small, gathered where the kernels do not split it). Or else, for attention of 4-D q where no
    key's visibility depends on the query's position (not `positional`: no causal mask, window or
    mask, nor a bias read as one), the batch and the sequence of q, k and v (context parallelism:
    kernels/attention._queries_split splits q's queries, and k and v are gathered, as jax.jit
    gathers them)."""
    def split_dims(i: int, ndim: int, params: dict) -> set | list:
        if layout == MQA and i in (1, 2) or layout == FOLDED or ndim == 1:
            dims = {0}
        else:
            heads = ndim - (3 if layout.startswith("bhsd") or i >= 3 and not layout.startswith("bqhk") else 2)
            dims = ({0} if ndim > 3 else set()) | ({heads} if heads >= 0 else set())
        masked = positional or {"mask_kind", "bias_kind", "mask_bias", "bias_split"} & params.keys()
        if masked or i > 2 or layout == FOLDED or (ndim != 4 and not (layout == MQA and i and ndim == 3)):
            return dims
        return [dims, {0, ndim - (2 if layout.startswith("bhsd") else 3)}]  # (MQA's k, v: [b, s, d])
    return split_dims


PATTERNS = [_pattern(nn_attention(causal, bias, mask, grouped), ALL, causal=causal, with_bias=bias, with_mask=mask)
            for causal in (False, True) for bias in (False, True) for mask in (None, *MASK_SHAPES)
            for grouped in ((True, False) if mask and mask != "[b,h,q,k]" else (True,))]
PATTERNS += [_pattern(nn_attention_per_example(causal), ALL, causal=causal) for causal in (False, True)]
# A bias broadcast over heads (or batch) or in q's dtype, as flax.nnx.dot_product_attention passes a
# padding bias on: jax.nn broadcasts and casts it, so each is a template.
PATTERNS += [_pattern(nn_attention(causal, True, None, grouped, bias_kind=f"{shape}{'' if f32 else ' in q dtype'}"),
                      ALL if f32 else HALF, causal=causal, with_bias=shape, float32_bias=f32)
             for causal in (False, True) for shape in MASK_SHAPES for f32 in (True, False)
             if not (f32 and shape == "[b,h,q,k]") for grouped in ((True, False) if shape != "[b,h,q,k]" else (True,))]
PATTERNS += [_pattern(nn_attention(causal, False, None, grouped, lengths=kv, query_lengths=True), ALL, causal=causal,
                      with_lengths=kv) for causal in (False, True) for grouped in (True, False) for kv in (False, True)]
PATTERNS += [_pattern(nn_attention(causal, False, None, grouped, lengths=True), ALL, causal=causal, with_lengths=True)
             for causal in (False, True) for grouped in (True, False)]
PATTERNS += [_pattern(nn_attention(causal, False, None, window=True), ALL, causal=causal, window=True)
             for causal in (False, True)]  # (the same template with one k/v head per q head)
# A window and a mask together (jax.nn joins them): the kernels take both.
PATTERNS += [_pattern(nn_attention(causal, False, mask, grouped, window=True), ALL, causal=causal, with_mask=mask,
                      window=True)
             for causal in (False, True) for mask in MASK_SHAPES
             for grouped in ((True, False) if mask != "[b,h,q,k]" else (True,))]
PATTERNS += [_pattern(by_hand(layout, causal, upcast, scaling), HALF if upcast else ALL, layout=layout,
                      causal=causal, scaling=scaling, params=scaling in ("*scale", "/divisor"))
             for layout in ("bshd", "bhsd", MQA) for causal in (False, True) for upcast in (False, True)
             for scaling in NUMBER_SCALINGS]
# Heads folded into the batch (diffusers' Flax attention), causal or not.
PATTERNS += [_pattern(by_hand(FOLDED, causal, upcast, scaling), HALF if upcast else ALL, layout=FOLDED,
                      causal=causal, scaling=scaling, params=scaling in ("*scale", "/divisor"))
             for causal in (False, True) for upcast in (False, True) for scaling in NUMBER_SCALINGS]
# A mask of the keys hidden, applied as where(hidden, fill, scores) (nanoGPT's `tril == 0`).
PATTERNS += [_pattern(by_hand(layout, False, upcast, scaling, mask=mask, hidden=True), HALF if upcast else ALL,
                      layout=layout, with_mask=mask, fill=True, shapes=SCORE_SHAPES, scaling=scaling,
                      params=scaling in ("*scale", "/divisor"))
             for layout in ("bshd", "bhsd", MQA) for upcast in (False, True) for mask in SCORE_SHAPES
             for scaling in NUMBER_SCALINGS]
# By hand with a boolean mask (a where with a large negative fill: a constant tril is read as causal)
# or an additive bias, scaled by a number (the common spellings; each combination is a template, so
# not every one is listed). A mask, as Llama ports write it, also after dividing by sqrt(head dim).
PATTERNS += [_pattern(by_hand(layout, False, upcast, scaling, mask=mask), HALF if upcast else ALL, layout=layout,
                      with_mask=mask, fill=True, shapes=SCORE_SHAPES, scaling=scaling,
                      params=scaling in ("*scale", "/divisor"))
             for layout in ("bshd", "bhsd", MQA) for upcast in (False, True) for mask in SCORE_SHAPES
             for scaling in NUMBER_SCALINGS]
# The scores cast to float32 after scaling (and a bias), before the mask or the causal where.
MASKINGS = ((True, None, False), *((False, mask, hidden) for mask in SCORE_SHAPES for hidden in (False, True)))
PATTERNS += [_pattern(by_hand(layout, causal, True, scaling, mask=mask, hidden=hidden, upcast_first=True), HALF,
                      layout=layout, causal=causal, with_mask=mask, fill=bool(mask), shapes=SCORE_SHAPES,
                      scaling=scaling, params=scaling in ("*scale", "/divisor"))
             for layout in ("bshd", "bhsd") for scaling in NUMBER_SCALINGS for causal, mask, hidden in MASKINGS]
# A bias added (or subtracted, as ALiBi's `- slope * distance`), then a mask (of the keys seen or
# hidden): in q's dtype, or a float32 bias and softmax, or (added) a bias in q's dtype with a float32
# softmax, the cast before the mask or after it. (A bias broadcast to the scores, as ALiBi's and a
# relative-position table's are; every template costs start-up time, so not every combination.)
# (upcast, upcast_first, float32_bias)
BIAS_FORMS = ((False, False, False), (True, False, True), (True, True, False), (True, False, False))
PATTERNS += [_pattern(by_hand(layout, False, upcast, scaling, mask=mask, hidden=hidden, bias="(broadcast)",
                              float32_bias=f32, upcast_first=first, subtracted=subtracted),
                      HALF if upcast else ALL, layout=layout, with_bias="(broadcast)", with_mask=mask, fill=True,
                      shapes=SCORE_SHAPES, float32_bias=f32, scaling=scaling, params=scaling in ("*scale", "/divisor"))
             for layout in ("bshd", "bhsd") for scaling in NUMBER_SCALINGS for _, mask, hidden in MASKINGS[1:]
             for upcast, first, f32 in BIAS_FORMS for subtracted in (False, True)
             if not (subtracted and upcast and not f32)]
# A bias (T5's relative positions per head, its gradient taken by XLA; ALiBi's), after any scaling,
# then a causal -inf where or not.
PATTERNS += [_pattern(by_hand(layout, causal, upcast, scaling, bias=bias, float32_bias=f32),  # (float32 q: one form)
                      HALF if upcast or not f32 else ALL, layout=layout, causal=causal, with_bias=bias,
                      shapes=SCORE_SHAPES, float32_bias=f32, scaling=scaling, params=scaling in ("*scale", "/divisor"))
             for layout in ("bshd", "bhsd") for upcast in (False, True) for bias in SCORE_SHAPES
             for f32 in (True, False) for scaling in NUMBER_SCALINGS for causal in (False, True)]
# The same bias subtracted: a mask written `scores - 1e6 * triu(ones, 1)` (taken as the bias it is).
PATTERNS += [_pattern(by_hand(layout, causal, upcast, scaling, bias=bias, float32_bias=f32, subtracted=True),
                      HALF if upcast or not f32 else ALL, layout=layout, causal=causal, with_bias=bias,
                      shapes=SCORE_SHAPES, float32_bias=f32, scaling=scaling, params=scaling in ("*scale", "/divisor"))
             for layout in ("bshd", "bhsd") for upcast in (False, True) for bias in SCORE_SHAPES
             for f32 in (True, False) for scaling in NUMBER_SCALINGS for causal in (False, True)]
# Two biases added one after the other (AlphaFold's attention: a padding bias [b,1,1,k], then the pair
# representation's bias per head [1,h,q,k]; a relative-position bias and then a padding bias, by
# hand), after any scaling (AlphaFold scales q first): the kernels take their sum.
PATTERNS += [_pattern(by_hand(layout, False, upcast, scaling, bias=first, float32_bias=f32, second_bias=second),
                      HALF if upcast or not f32 else ALL, layout=layout, with_bias=first, shapes=SCORE_SHAPES,
                      float32_bias=f32, scaling=scaling, params=scaling in ("*scale", "/divisor"))
             for layout in ("bshd", "bhsd") for upcast in (False, True) for first in SCORE_SHAPES
             for second in SCORE_SHAPES for f32 in (True, False) for scaling in NUMBER_SCALINGS]
# AlphaFold 3's (its pairformer's and diffusion transformer's self-attention, of one example,
# [tokens, h, c]; its atom cross-attention, [subsets, q, h, c]; either mapped over samples): q and k
# cast to float32, q scaled, a bias from its mask (a padding bias [..., 1, 1, k] of mask data: a key
# bias), then the pair logits (float32 or not, or none), the float32 softmax cast back to v's dtype.
PATTERNS += [_pattern(by_hand("bshd", False, True, bias=first, float32_bias=True, second_bias=second,
                              second_float32=f32, scores="float32 q, k, scaled q"),
                      HALF, with_bias=first, shapes=SCORE_SHAPES)
             for first in SCORE_SHAPES for second in (None, *SCORE_SHAPES) for f32 in ((True, False) if second else (True,))]
# T5's with t5x's float32_logits (T5.1.1's configs): q and k cast to float32, unscaled, a bias.
PATTERNS += [_pattern(by_hand(layout, False, True, UNSCALED, bias=bias, float32_bias=f32, scores="float32 q, k"),
                      HALF, layout=layout, with_bias=bias, shapes=SCORE_SHAPES, float32_bias=f32, scaling=UNSCALED,
                      params=False)
             for layout in ("bshd", "bhsd") for bias in SCORE_SHAPES for f32 in (True, False)]
FLAX = importlib.util.find_spec("flax") is not None  # flax is optional: a test dependency
FLAX_SPELLING = ("scaled q", "bshd", "/sqrt(d)", False, None, False)  # by_hand's args for flax's
if FLAX:
    PATTERNS += [_pattern(flax_attention(mask), ALL, params=False, with_mask=mask, scaling="/sqrt(d)")
                 for mask in (None, *MASK_SHAPES)]
    PATTERNS += [_pattern(flax_attention(None, bias), ALL, params=False, with_bias=bias, shapes=SCORE_SHAPES,
                          float32_bias=False, scaling="/sqrt(d)") for bias in SCORE_SHAPES]
# (flax.linen.dot_product_attention without a mask is one of them: with flax installed, its name is kept.)
if FLAX:
    PATTERNS += [_pattern(flax_float32_weights(bias), HALF, params=False, with_bias=bias, shapes=SCORE_SHAPES,
                          float32_bias=False) for bias in SCORE_SHAPES]
# Where the scale and the float32 cast come elsewhere: q scaled before the product (with a mask, as
# flax writes it), the product in float32 (preferred_element_type) or cast to it, then scaled.
PATTERNS += [_pattern(by_hand(layout, causal, upcast or scores != "scaled q", scaling, mask=mask, scores=scores),
                      HALF if upcast or scores != "scaled q" else ALL, layout=layout, causal=causal, with_mask=mask,
                      fill=bool(mask), shapes=SCORE_SHAPES, scaling=scaling, params=scaling != "/sqrt(d)")
             for scores in SCORES[1:4] for layout in ("bshd", "bhsd") for scaling in ("*scale", "/divisor", "/sqrt(d)")
             for causal, mask in ((False, None), (True, None), *((False, m) for m in SCORE_SHAPES))
             for upcast in ((False, True) if scores == "scaled q" else (True,))
             if not (FLAX and (scores, layout, scaling, causal, mask, upcast) == FLAX_SPELLING)]
# The same float32 scores (the product cast, as a float32 scale such as np.sqrt(d) promotes it, or
# computed in float32), then a bias (in q's dtype, promoted, or float32), causal or with a mask.
PATTERNS += [_pattern(by_hand(layout, causal, True, scaling, mask=mask, bias=bias, float32_bias=f32, scores=scores),
                      HALF, layout=layout, causal=causal, with_mask=mask, with_bias=bias, fill=bool(mask),
                      shapes=SCORE_SHAPES, float32_bias=f32, scaling=scaling)
             for scores in SCORES[2:4] for layout in ("bshd", "bhsd") for scaling in ("*scale", "/divisor")
             for bias in SCORE_SHAPES for f32 in (False, True)
             for causal, mask in ((False, None), (True, None), (False, "(broadcast)"))]
# Multi-query attention with q scaled first (PaLM's: `q * scale`, then "bhid,bjd->bhij"), causal or
# with a mask of the keys seen or hidden.
PATTERNS += [_pattern(by_hand(MQA, causal, upcast, scaling, mask=mask, scores="scaled q", hidden=hidden),
                      HALF if upcast else ALL, layout=MQA, causal=causal, with_mask=mask, fill=bool(mask),
                      shapes=SCORE_SHAPES, scaling=scaling, params=scaling != "/sqrt(d)")
             for scaling in ("*scale", "/sqrt(d)") for upcast in (False, True)
             for causal, mask, hidden in ((False, None, False), (True, None, False), (False, "(broadcast)", False),
                                          (False, "(broadcast)", True))]

# Gemma's (the gemma library): q scaled by a number, scores [b, q, heads, k] (with grouped k/v heads:
# q reshaped to [b, q, kv heads, group, d]), its [b, q, k] mask applied with a finite fill, softmax
# cast to the values' dtype.
PATTERNS += [_pattern(by_hand(layout, False, upcast, mask=mask, scores="scaled q"), HALF if upcast else ALL,
                      layout=layout, with_mask=mask, fill=bool(mask), shapes={"[b,q,k]": lambda b, h, q, k: (b, q, k)})
             for layout in ("bqhk", "bqhk,gqa") for mask in (None, "[b,q,k]") for upcast in (False, True)]
# Scores ordered [b, q, h, k] ("bqhd,bkhd->bqhk", then "bqhk,bkhd->bqhd"), scaled on the product or
# on q, causal or with a boolean mask (a constant one from iota, [1, q, 1, k], is read as causal).
PATTERNS += [_pattern(by_hand("bqhk", causal, upcast, scaling, mask=mask, scores=scores), HALF if upcast else ALL,
                      layout="bqhk", causal=causal, with_mask=mask, fill=bool(mask), shapes=BQHK_SHAPES,
                      scaling=scaling, params=scaling != "/sqrt(d)")
             for scores in ("product", "scaled q") for scaling in ("*scale", "/divisor", "/sqrt(d)")
             for causal, mask in ((False, None), (True, None), *((False, m) for m in BQHK_SHAPES))
             for upcast in (False, True)
             if not (scores == "scaled q" and scaling == "*scale" and not (causal or mask))]  # (Gemma's, below)
# Scaled by a scalar the program computes (1 / jnp.sqrt(d)) or is given (a Python number passed to
# the jitted function, a learned temperature), cast to the scores' dtype, on the product or on q.
PATTERNS += [_pattern(by_hand(layout, causal, upcast, scaling, mask=mask, scores=scores), HALF if upcast else ALL,
                      layout=layout, causal=causal, with_mask=mask, fill=bool(mask), shapes=SCORE_SHAPES,
                      scaling=scaling, params=False)
             for scores in ("product", "scaled q") for scaling in ARRAY_SCALINGS[:1 if scores == "scaled q" else 2]
             for layout in ("bshd", "bhsd") for causal, mask in ((False, None), (True, None), (False, "(broadcast)"))
             for upcast in (False, True)]

# Attention with dropout on its probabilities: the multiplier the program draws goes to the kernels.
# Traced only for programs drawing random bits.
PATTERNS += [_pattern(by_hand(layout, causal, upcast, scaling, dropout=dropout), HALF if upcast else ALL,
                      layout=layout, causal=causal, scaling=scaling, params=scaling != "/sqrt(d)", dropout=dropout)
             for layout in ("bshd", "bhsd") for causal in (False, True) for upcast in (False, True)
             for scaling in ("*scale", "/sqrt(d)") for dropout in ("multiplier", "select")]
if FLAX:
    PATTERNS += [_pattern(flax_attention_dropout(mask), ALL, with_mask=mask, params=False, dropout="multiplier",
                          scaling="/sqrt(d)") for mask in (None, *MASK_SHAPES)]
    PATTERNS += [_pattern(flax_attention_dropout(None, bias), ALL, with_bias=bias, shapes=SCORE_SHAPES,
                          float32_bias=False, params=False, dropout="multiplier", scaling="/sqrt(d)")
                 for bias in SCORE_SHAPES]

# Soft-capped scores, as Gemma 2 writes them (the gemma library's layouts, q scaled first) and as a
# hand-written program does after scaling the product: tanh(scores / cap) * cap before the mask.
PATTERNS += [_pattern(by_hand(layout, False, upcast, mask=mask, scores="scaled q", softcap=True),
                      HALF if upcast else ALL, layout=layout, with_mask=mask, fill=bool(mask), softcap=True,
                      shapes={"[b,q,k]": lambda b, h, q, k: (b, q, k)})
             for layout in ("bqhk", "bqhk,gqa") for mask in (None, "[b,q,k]") for upcast in (False, True)]
PATTERNS += [_pattern(by_hand(layout, causal, upcast, mask=mask, softcap=True), HALF if upcast else ALL,
                      layout=layout, causal=causal, with_mask=mask, fill=bool(mask), shapes=SCORE_SHAPES, softcap=True)
             for layout in ("bshd", "bhsd") for causal, mask in ((False, None), (True, None), (False, "(broadcast)"))
             for upcast in (False, True)]
# ... and with the scale on q (as the gemma library scales it, in any layout, with a key mask
# broadcast over the queries too), or the scores cast to float32 before the cap (`upcast product`)
# or after it, before the mask (`upcast_first`)
PATTERNS += [_pattern(by_hand(layout, causal, upcast, mask=mask, scores=scores, softcap=True, upcast_first=first),
                      HALF if upcast else ALL, layout=layout, causal=causal, with_mask=mask, fill=bool(mask),
                      shapes=SCORE_SHAPES, softcap=True)
             for layout in ("bshd", "bhsd") for causal, mask in ((False, None), (True, None), (False, "(broadcast)"))
             for scores, upcast, first in (("scaled q", False, False), ("scaled q", True, False),
                                           ("upcast product", True, False), ("product", True, True))
             if not (first and not causal and not mask)]  # (nothing to mask: the cast is the one above)
PATTERNS += [_pattern(by_hand(layout, False, upcast, mask="(broadcast)", scores="scaled q", softcap=True),
                      HALF if upcast else ALL, layout=layout, with_mask="(broadcast)", fill=True, softcap=True,
                      shapes=SCORE_SHAPES)
             for layout in ("bqhk", "bqhk,gqa") for upcast in (False, True)]

# Float32 probabilities into the product with v, a float32 result (flax's force_fp32_for_softmax; by
# hand, a float32 scale such as np.sqrt(d) or lax.rsqrt(d) promotes the scores and nothing casts the
# probabilities back): the kernels store their float32 accumulator as it is (out_dtype). A float32
# scale the program computes (lax.rsqrt(d)) with the probabilities cast back: q's dtype out.
FLOAT32_SPELLINGS = (*(("upcast product", s, True) for s in ("*scale", "/divisor", *ARRAY_SCALINGS)),
                     *(("float32 product", s, True) for s in ("*scale", "/divisor")),
                     *(("upcast product", s, False) for s in ARRAY_SCALINGS))
if FLAX:
    PATTERNS += [_pattern(flax_attention(mask, force_fp32=True), HALF, params=False, with_mask=mask,
                          scaling="/sqrt(d)") for mask in (None, *MASK_SHAPES)]
PATTERNS += [_pattern(by_hand(layout, causal, True, scaling, mask=mask, scores=scores, float32_out=out), HALF,
                      layout=layout, causal=causal, with_mask=mask, fill=bool(mask), shapes=SCORE_SHAPES,
                      scaling=scaling, params=scaling not in ARRAY_SCALINGS)
             for layout in ("bshd", "bhsd") for causal, mask in ((False, None), (True, None), (False, "(broadcast)"))
             for scores, scaling, out in FLOAT32_SPELLINGS]

# Attention sinks, as gpt-oss writes them: a column of per-head logits (broadcast to one per row)
# joined to the scores after the masks, the softmax, the column dropped. Its causal and sliding-window
# masks are a constant -inf bias, read as their kinds (_bias_facts).
PATTERNS += [_pattern(by_hand(layout, causal, upcast, bias=bias, sinks=True), HALF if upcast else ALL, layout=layout,
                      causal=causal, with_bias=bias, shapes=SCORE_SHAPES, float32_bias=False, sinks=True)
             for layout in ("bshd", "bhsd") for causal, bias in ((False, None), (True, None), (False, "(broadcast)"))
             for upcast in (False, True)]

# Scores times an array with one value for every key (a learned temperature per head, [1, h, 1, 1]
# or [h, 1, 1]; per query or batch entry alike): q is scaled by it instead, and the kernels' scale is 1.
PATTERNS += [_pattern(by_hand(layout, causal, upcast, ROW_SCALING), HALF if upcast else ALL, layout=layout,
                      causal=causal, scaling=ROW_SCALING, params=False)
             for layout in ("bshd", "bhsd") for causal in (False, True) for upcast in (False, True)]

# MaxText's dot-product attention (attention="dot_product", and its decode path): q grouped by k/v
# head, scores [b, kv heads, group, q, k] unscaled (MaxText folds 1/sqrt(d) into q's projection), an
# optional soft cap, float32 logits (float32_logits; float32_qk_product casts q and k too) or not, its
# additive mask (0 or a fill of -0.7 times float32's max, [b, 1, 1, q, k]) applied as
# where(mask >= fill / 2, scores, fill) (the threshold read as its own literal: the fill is rounded to
# the scores' dtype); then exp(scores - max), the unnormalized output (the exps times v) divided by
# the row sums, moved to [b, q, heads, 1]. flat: as MaxText writes it since its attention sinks, the
# max, exps and sums over the scores reshaped to [b, heads, q, k], the exps reshaped back for the
# product with v, the sums transposed to [b, q, heads, 1].
def maxtext_attention(mask: bool, softcap: bool, float32_logits: bool, float32_product: bool = False,
                      flat: bool = False):
    def fn(q, k, v, *extras, **params):
        b, t, n, d = q.shape
        kv = k.shape[2]
        if float32_product:  # (its float32_qk_product)
            q, k = q.astype(jnp.float32), k.astype(jnp.float32)
        scores = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, kv, n // kv, d), k)
        if softcap:
            scores = jnp.tanh(scores / params["cap"]) * params["cap"]
        if float32_logits:
            scores = scores.astype(jnp.float32)
        if mask:
            scores = jnp.where(extras[0] >= params["threshold"], scores, params["fill"])
        if flat:
            logits = scores.reshape(b, n, t, scores.shape[-1])
            exps = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
            sums = jnp.transpose(jnp.sum(exps, axis=-1, keepdims=True), (0, 2, 1, 3))
            exps = exps.reshape(scores.shape)
        else:
            exps = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
            sums = jnp.moveaxis(jnp.sum(exps, axis=-1, keepdims=True), -2, 1).reshape(b, t, n, 1)
        out = jnp.einsum("bkgts,bskd->btkgd", exps, v)
        return out.reshape(b, t, n, d) / sums
    fn.__name__ = (f"maxtext dot_product{'+float32 product' if float32_product else ''}{'+soft cap' if softcap else ''}"
                   f"{'+float32 logits' if float32_logits else ''}{'+mask' if mask else ''}"
                   f"{'+[b,h,q,k] softmax' if flat else ''}")
    return fn


def _maxtext_pattern(mask: bool, softcap: bool, float32_logits: bool, float32_product: bool = False,
                     flat: bool = False) -> Pattern:
    fn = maxtext_attention(mask, softcap, float32_logits, float32_product, flat)
    check_common = _check("bshd")

    def example(dtype):
        q, kv = jax.ShapeDtypeStruct((2, 8, 4, 16), dtype), jax.ShapeDtypeStruct((2, 8, 2, 16), dtype)
        return (q, kv, kv) + ((jax.ShapeDtypeStruct((2, 1, 1, 8, 8), jnp.float32),) if mask else ())

    def check(match, params):
        shape = match.input_avals[3].shape if mask else ()
        if mask and (len(shape) != 5 or shape[-1] != match.input_avals[1].shape[1]):
            return f"a mask of shape {shape}: not [batch, kv heads, group, queries, keys] broadcast"
        return check_common(match, params)

    def facts_of(match) -> dict:
        if not mask:
            return {}
        value = constant_value(match.graph, match.inputs[3], CONSTANT_MASK_ELEMENTS)
        if value is None:
            return {}
        with jax.ensure_compile_time_eval():
            return _mask_kind(jnp.asarray(value) >= literal_at(match, EXAMPLE_THRESHOLD))

    def params_of(match) -> dict:
        params = _params_of(False, mask, cap=softcap)(match)
        return {**params, "threshold": literal_at(match, EXAMPLE_THRESHOLD)} if mask else params

    def replace(q, k, v, *extras, backend, fill=None, threshold=None, cap=None, mask_kind=None, left=None,
                right=None):
        visible = None
        if mask and mask_kind is None:  # [b, kv heads, group, q, k] (each 1 or full) as [b, heads, q, k]
            m = extras[0] >= threshold
            b, kv, g = m.shape[0], k.shape[2], q.shape[2] // k.shape[2]
            visible = (m.reshape(b, 1, *m.shape[3:]) if m.shape[1] == m.shape[2] == 1 else
                       jnp.broadcast_to(m, (b, kv, g, *m.shape[3:])).reshape(b, kv * g, *m.shape[3:]))
        banded = mask_kind == "window"  # a constant band (a sliding window): only its key blocks visited
        return kernels.attention(q, k, v, causal=mask_kind == "causal", mask=visible, scale=1.0, backend=backend,
                                 masked_rows="average" if visible is not None or banded else "zeros",
                                 local_window_size=(left, right) if banded else None, logits_soft_cap=cap,
                                 out_dtype=jnp.float32 if float32_logits else None)
    return Pattern(name=f"attention/{fn.__name__}", op="attention", fn=fn, dtypes=HALF if float32_logits else ALL,
                   example=example, example_params={**({"fill": EXAMPLE_FILL, "threshold": EXAMPLE_THRESHOLD}
                                                       if mask else {}),
                                                    **({"cap": EXAMPLE_CAP} if softcap else {})},
                   params_of=params_of, check=check, replace=replace, facts_of=facts_of,
                   ignores=lambda params: {3} if params.get("mask_kind") else set(),
                   requires=SOFTMAX_AND_PRODUCTS)


PATTERNS += [_maxtext_pattern(mask, softcap, logits, product, flat) for mask in (False, True)
             for softcap in (False, True) for logits, product in ((False, False), (True, False), (True, True))
             for flat in (False, True)]


# Equinox's (equinox.nn.MultiheadAttention, dot_product_attention): written for one example and one
# head, q [s, d] divided by sqrt(d), softmax in float32 (the result type of the logits' and float32's),
# its mask (one for every head: [q, k], or per example [b, q, k]) applied with finfo(dtype).min; the
# heads mapped by jax.vmap over axis 1, the batch by the user's jax.vmap. Traced as the vmaps trace it
# (they order the product with v's operands unlike jnp.einsum does).
def equinox_attention(mask: str | None):
    def per_head(q, k, v, visible, divisor):
        logits = jnp.einsum("sd,Sd->sS", q / divisor, k)
        if visible is not None:
            logits = jnp.where(visible, logits, jnp.finfo(logits.dtype).min)
        with jax.numpy_dtype_promotion("standard"):
            dtype = jnp.result_type(logits.dtype, jnp.float32)
        weights = jax.nn.softmax(logits.astype(dtype)).astype(logits.dtype)
        return jnp.einsum("sS,Sd->sd", weights, v)

    def fn(q, k, v, *extras, scale):
        def one_example(q, k, v, visible):
            return jax.vmap(lambda q, k, v: per_head(q, k, v, visible, scale), in_axes=1, out_axes=1)(q, k, v)
        if mask == "[b,q,k]":
            return jax.vmap(one_example)(q, k, v, extras[0])
        return jax.vmap(lambda q, k, v: one_example(q, k, v, extras[0] if mask else None))(q, k, v)
    fn.__name__ = f"equinox MultiheadAttention{'+mask' + mask if mask else ''}"
    return fn


PATTERNS += [_pattern(equinox_attention(mask), ALL, scaling="/divisor", with_mask=mask,
                      shapes={"[q,k]": lambda b, h, q, k: (q, k), "[b,q,k]": lambda b, h, q, k: (b, q, k)})
             for mask in (None, "[q,k]", "[b,q,k]")]
