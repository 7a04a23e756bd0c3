"""Rotary position embeddings, in the ways people write them in JAX, replaced by xkern's rope kernel
(float32 math, one rounding to the program's result dtype).

Forms (x [..., seq, heads, d]; cos and sin broadcast against x, or against its halves):
  x*cos+rotate_half(x)*sin     HF (Flax Llama / GPT-NeoX): rotate_half = concatenate([-x2, x1]),
                               x1, x2 the halves of d (slices); full-width tables. MaxText's
                               RotaryEmbedding takes them by jnp.split (the same, canonicalized)
  concatenate(halves)          MaxText: x1, x2 = jnp.split(x, 2, -1) (or slices);
                               concatenate([x1*cos - x2*sin, x2*cos + x1*sin]); half-width tables
  interleaved/stack(pairs)     x as [..., d/2, 2] pairs, x1, x2 = pairs[..., 0], pairs[..., 1];
                               stack([x1*cos - x2*sin, x2*cos + x1*sin], -1) back to [..., d]
  interleaved/rotate_every_two HF Flax GPT-J: x*cos + rotate_every_two(x)*sin, rotate_every_two =
                               stack([-x[..., 1::2], x[..., ::2]], -1) back to [..., d]
  interleaved/x*cos+select(shifted)*sin*sign
                               MaxText's LLaMARotaryEmbedding: rotate_every_two(x) * sin as x shifted
                               left or right by a concatenate, picked by an iota parity mask
                               (lax.select), times sin, times a tiled [-1, 1] sign constant
  interleaved/complex multiply Meta's Llama reference, EasyLM: the pairs of float32 x as complex
                               numbers times a complex64 table freqs_cis (cos + i sin, [..., d/2]),
                               stack([real, imag], -1) back to [..., d]
Precisions, each form: plain (x and tables of one dtype; or half-precision x with float32 tables,
which jnp promotes to a float32 result); the promoted result cast back to x's dtype (HF Flax
Llama); x upcast to float32 first, with or without the cast back. Each is what the kernel computes:
negation, slicing and concatenation are exact in any dtype, so every promoted form is float32 math
with one rounding. The plain form in half precision rounds after every operation where the kernel
rounds once (within the dtype's tolerance).

Tables of any broadcasting shape are read off the match: [seq, 1, w] and [1, seq, 1, w] (one table
for every batch entry), [batch, seq, 1, w] (one per batch entry, from per-example position ids: the
kernel runs under vmap), or heads-before-seq layouts ([batch, heads, seq, d] with [seq, w] tables):
the table's innermost axis of more than one row (before the last) is the kernel's seq axis, the
axes of x between it and the last are its heads.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from xkern import _compat
from xkern.jaxpr_passes.patterns import Pattern
from xkern.kernels import rope as kernels

F32, BF16 = jnp.float32, jnp.bfloat16


# --------------------------------------------------------------------------------------------------
# Forms
# --------------------------------------------------------------------------------------------------

def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rotate_every_two(x):
    return jnp.stack([-x[..., 1::2], x[..., ::2]], axis=-1).reshape(x.shape)


def rotate_half_form(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def halves_form(x, cos, sin):
    x1, x2 = jnp.split(x, 2, axis=-1)  # (or x[..., :h], x[..., h:]: canonicalize makes them this split)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def pairs_form(x, cos, sin):
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)


def every_two_form(x, cos, sin):
    return x * cos + rotate_every_two(x) * sin


def shifted_form(x, cos, sin):
    """MaxText's LLaMARotaryEmbedding: rotate_every_two(x) as x shifted left (even elements) or right
    (odd ones, picked by an iota parity mask), times a tiled [-1, 1] sign after sin. Multiplying by
    +-1 is exact, so this is every_two_form's value."""
    d = x.shape[-1]
    left = jnp.concatenate([x[..., 1:], x[..., :1]], axis=-1)
    right = jnp.concatenate([x[..., -1:], x[..., :-1]], axis=-1)
    odd = jnp.tile(jnp.mod(jnp.arange(d, dtype=jnp.int32), 2), x.shape[:-1] + (1,))
    sign = jnp.tile(jnp.array([-1, 1]), d // 2)
    return x * cos + jax.lax.select(odd, right, left) * sin * sign


shifted_form.constants = 1  # the sign's [-1, 1], an array constant (Pattern.constants): matched by value


FORMS = {  # name: (function, interleaved, tables cover the whole head dim)
    "x*cos+rotate_half(x)*sin": (rotate_half_form, False, True),
    "concatenate(halves)": (halves_form, False, False),
    "interleaved/stack(pairs)": (pairs_form, True, False),
    "interleaved/x*cos+rotate_every_two(x)*sin": (every_two_form, True, True),
    "interleaved/x*cos+select(shifted)*sin*sign": (shifted_form, True, True),
}


def precision(fn, kind: str):
    """fn as written: "plain", "cast back" (the promoted result cast to x's dtype), "upcast" (x to
    float32 first, the result cast back) or "float32" (x to float32 first, a float32 result)."""
    if kind == "plain":
        return fn
    if kind == "cast back":
        pattern = lambda x, *tables: fn(x, *tables).astype(x.dtype)
    elif kind == "upcast":
        pattern = lambda x, *tables: fn(x.astype(F32), *tables).astype(x.dtype)
    else:
        pattern = lambda x, *tables: fn(x.astype(F32), *tables)
    pattern.__name__ = f"{fn.__name__}_{kind.replace(' ', '_')}"
    return pattern


# Example (x dtype, table dtype, table rank below x's): the structure is the same for every float
# dtype (the exact re-trace checks the real ones), but promotion adds converts, and tables of lower
# rank than x are broadcast once per use (the halves and pairs forms use each twice).
EXAMPLES = {
    "plain": [(BF16, BF16, 0), (BF16, F32, 0), (BF16, BF16, 1), (BF16, F32, 1)],
    "cast back": [(BF16, F32, 0), (BF16, F32, 1)],
    "upcast": [(BF16, F32, 0), (BF16, BF16, 0), (BF16, F32, 1), (BF16, BF16, 1)],
    "float32": [(BF16, F32, 0), (BF16, BF16, 0), (BF16, F32, 1), (BF16, BF16, 1)],
}
SUFFIX = {"plain": "", "cast back": "+cast back", "upcast": "+upcast", "float32": "(float32)"}


# --------------------------------------------------------------------------------------------------
# Replacement: the tables' broadcast shapes, read off the match
# --------------------------------------------------------------------------------------------------

def _table_layout(x_shape, table_shape):
    """(seq axis of x or None, table shape padded to x's rank): the seq axis is the innermost axis
    before the last where the table has more than one row."""
    padded = (1,) * (len(x_shape) - len(table_shape)) + tuple(table_shape)
    seq_axes = [i for i in range(len(x_shape) - 1) if padded[i] != 1]
    return (seq_axes[-1] if seq_axes else None), padded


def apply_rope(x, cos, sin, *, interleaved, full_width, out_dtype, backend):
    """rope(x, cos, sin) for tables that broadcast against x (or x's halves) as in the program."""
    width = x.shape[-1] if full_width else x.shape[-1] // 2
    shape = jnp.broadcast_shapes(cos.shape, sin.shape)
    tables = [jnp.broadcast_to(t, shape) for t in (cos, sin)]
    tables = [t if t.dtype in (F32, x.dtype) else t.astype(F32) for t in tables]  # exactly
    rope = lambda x, c, s: kernels.rope(x, c, s, interleaved=interleaved, out_dtype=out_dtype,
                                        backend=backend)
    axis, padded = _table_layout(x.shape, shape)
    if axis is None:  # one table row for every position: sequences of one
        x4 = x.reshape(-1, 1, 1, x.shape[-1])
        return rope(x4, *(t.reshape(1, width) for t in tables)).reshape(x.shape)
    lead, seq = x.shape[:axis], x.shape[axis]
    x4 = x.reshape(math.prod(lead), seq, math.prod(x.shape[axis + 1:-1]), x.shape[-1])
    tables = [t.reshape(*padded[:axis], seq, width) for t in tables]  # without the heads axes
    if all(n == 1 for n in padded[:axis]):
        y = rope(x4, *(t.reshape(seq, width) for t in tables))
    else:  # a table per batch entry (per-example positions): the kernel under vmap
        per_entry = [jnp.broadcast_to(t, (*lead, seq, width)).reshape(-1, seq, width) for t in tables]
        y = jax.vmap(rope)(*_compat.first_dims_alike([x4, *per_entry]))
    return y.reshape(x.shape)


def _check(full_width):
    def check(match, params) -> str | None:
        x, cos, sin = match.input_avals[:3]  # (then a form's constants)
        if x.dtype not in kernels.SUPPORTED_DTYPES:
            return f"dtype {x.dtype}: the rope kernel takes float32, bfloat16 and float16"
        if x.ndim < 1 or x.shape[-1] % 2:
            return "no even last axis to rotate"
        width = x.shape[-1] if full_width else x.shape[-1] // 2
        if cos.shape[-1:] != (width,) or sin.shape[-1:] != (width,):
            return f"cos / sin do not have one value per rotated element ({width}) on the last axis"
        if cos.ndim > x.ndim or sin.ndim > x.ndim:
            return "cos / sin have more axes than x"
        if 0 in x.shape:
            return "empty: nothing to rotate"
        axis, _ = _table_layout(x.shape, jnp.broadcast_shapes(cos.shape, sin.shape))
        spec = tuple(getattr(getattr(x, "sharding", None), "spec", None) or ())
        sharded = [d for d, entry in enumerate(spec) if entry is not None and d > 0]
        if x.ndim >= 3 and axis != x.ndim - 3 and sharded:
            # (the kernels' view [batch, seq, heads, d] merges the dims before the positions: a
            # sharded one there cannot be typed, and dims after them are not one dim of heads)
            return (f"x is typed sharded along its dim {sharded[0]}, which is not its heads or the "
                    f"positions before them (the tables' positions run along dim {axis}, heads are the "
                    "dim before the last only after them): the kernels split the batch only there")
        return None
    return check


def _split_dims(i: int, ndim: int, params: dict) -> set:
    """The dims the rope kernels split (kernels/rope._split), any of them at once: the batch's first,
    and x's sequence and heads, the two dims before the last where the positions come before the
    heads (check declines x sharded along the dim before the last otherwise); of a table, its first
    and the dims where its positions may run ([seq, w], [b, seq, w], [b, seq, 1, w])."""
    if i == 0:
        return {0, ndim - 3, ndim - 2} if ndim >= 3 else {0}
    return {d for d in (0, ndim - 3, ndim - 2) if d >= 0}


def _pattern(form: str, kind: str) -> Pattern:
    fn, interleaved, full_width = FORMS[form]
    constants = getattr(fn, "constants", 0)
    fn = precision(fn, kind)

    def example(key):
        x_dtype, table_dtype, fewer = key
        width = 8 if full_width else 4
        table = (4, 1, width) if fewer else (1, 4, 1, width)
        return (jax.ShapeDtypeStruct((2, 4, 3, 8), x_dtype),
                *[jax.ShapeDtypeStruct(table, table_dtype)] * 2)

    def replace(x, cos, sin, *ignored, backend):  # (the form's constants: None)
        out_dtype = jax.eval_shape(fn, x, cos, sin).dtype
        return apply_rope(x, cos, sin, interleaved=interleaved, full_width=full_width,
                          out_dtype=out_dtype, backend=backend)

    return Pattern(name=f"rope/{form}{SUFFIX[kind]}", op="rope", fn=fn, dtypes=tuple(EXAMPLES[kind]),
                   example=example, params_of=lambda match: {}, check=_check(full_width),
                   replace=replace, xla_when=None if interleaved else _forward_alone, constants=constants,
                   ignores=lambda params: set(range(3, 3 + constants)), split_dims=_split_dims)


def _forward_alone(perturbed: list[bool], params: dict) -> str | None:
    """Pattern.xla_when of the half-rotation forms: a call not differentiated runs as written. XLA
    fuses the half rotation into one pass at the kernel's bandwidth, a little ahead of it: 0.98x
    forward on the H200 (h200-rope.json) and on an H100 (h100-rope-session44.json, 2.74 against 2.80
    TB/s); differentiated, the kernel wins (1.16-1.38x), so training keeps it."""
    if any(perturbed):
        return None
    return "a forward alone: XLA fuses the half rotation as fast (the kernel: 0.98x); kept where differentiated"


PATTERNS = [_pattern(form, kind) for form in FORMS for kind in EXAMPLES]


def complex_form(x, freqs_cis):
    """Meta's Llama (and EasyLM's) apply_rotary_emb for one of q, k: x in float32."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    rotated = jax.lax.complex(pairs[..., 0], pairs[..., 1]) * freqs_cis
    return jnp.stack((jnp.real(rotated), jnp.imag(rotated)), axis=-1).reshape(*rotated.shape[:-1], -1)


def _complex_pattern(kind: str) -> Pattern:
    """The complex form: x float32 as written ("plain"), or upcast to it first, the result cast back
    ("upcast") or not ("float32"). The kernel takes the table's real and imaginary parts."""
    fn = precision(complex_form, kind)

    def example(fewer):
        table = (4, 1, 4) if fewer else (1, 4, 1, 4)
        return (jax.ShapeDtypeStruct((2, 4, 3, 8), F32 if kind == "plain" else BF16),
                jax.ShapeDtypeStruct(table, jnp.complex64))

    def check(match, params) -> str | None:
        x, table = match.input_avals
        if table.dtype != jnp.complex64:
            return f"a table of dtype {table.dtype}: the kernel's angles are float32 (complex64)"
        return _check(False)(_Avals(x, table), params)

    def replace(x, freqs_cis, *, backend):
        out_dtype = jax.eval_shape(fn, x, freqs_cis).dtype
        return apply_rope(x, jnp.real(freqs_cis), jnp.imag(freqs_cis), interleaved=True, full_width=False,
                          out_dtype=out_dtype, backend=backend)

    return Pattern(name=f"rope/interleaved/complex multiply{SUFFIX[kind]}", op="rope", fn=fn, dtypes=(False, True),
                   example=example, params_of=lambda match: {}, check=check, replace=replace, split_dims=_split_dims)


class _Avals:
    """What _check reads of a match (its input avals), the complex table standing for cos and sin."""
    def __init__(self, x, table):
        self.input_avals = (x, table, table)


PATTERNS += [_complex_pattern(kind) for kind in ("plain", "upcast", "float32")]
