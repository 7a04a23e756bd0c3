"""xkern.ops.attention against jax.nn.dot_product_attention: XLA's implementation (what jax.jit
runs) and, on an NVIDIA GPU, cuDNN's, timed in the same run.

Rates are TFLOP/s by FlashAttention's count: forward 4 * b * h * q_seq * kv_seq * d (half when
causal), forward+backward 3.5 times that. The forward+backward program computes dq, dk, dv from a
given output cotangent; its temporary memory is recorded (it must grow linearly with the sequence).
At 16384 tokens XLA's implementation would hold 32 x 16384^2 scores: there only cuDNN is compared.
"""
from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np

import xkern
from benchmarks.harness import Case


def _nn(implementation):
    def attend(q, k, v, causal):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)
    return attend


def _ours(q, k, v, causal):
    return xkern.ops.attention(q, k, v, causal=causal)


def cases(on_gpu: bool) -> list[Case]:
    shapes = [((4, 4096, 32, 128), False), ((4, 4096, 32, 128), True), ((1, 16384, 32, 128), True),
              ((1, 8192, 32, 128), True), ((2, 4096, 16, 256), False), ((2, 4096, 16, 256), True),
              ((4, 4096, 32, 64), False), ((4, 4096, 32, 64), True)  # small models' head dim (Llama 3.2 1B)
              ] if on_gpu else [((1, 40, 2, 64), False), ((1, 40, 2, 64), True)]
    cudnn = on_gpu and jax.devices()[0].platform == "gpu" and "NVIDIA" in jax.devices()[0].device_kind.upper()
    out = []
    for (b, s, h, d), causal in shapes:
        def make(key, shape=(b, s, h, d)):
            return tuple(jax.random.normal(k, shape, jnp.bfloat16) for k in jax.random.split(key, 4))
        fwd_flops = 4 * b * h * s * s * d // (2 if causal else 1)
        name = f"attention{' causal' if causal else ''}{', head dim 64' if on_gpu and d == 64 else ''}"
        refs = ([("jax.jit (xla)", _nn("xla"))] if s <= 8192 else []) + ([("cuDNN", _nn("cudnn"))] if cudnn else [])
        for ref_name, ref in refs:
            fwd = lambda f, causal=causal: (lambda q, k, v, do: f(q, k, v, causal))
            bwd = lambda f, causal=causal: (lambda q, k, v, do: jax.vjp(lambda *a: f(*a, causal), q, k, v)[1](do))
            out.append(Case(f"{name} vs {ref_name}", (b, s, h, d), "bfloat16", "fwd", fwd(_ours), fwd(ref),
                            make, 0, 2e-2, fwd_flops))
            out.append(Case(f"{name} vs {ref_name}", (b, s, h, d), "bfloat16", "fwd+bwd", bwd(_ours), bwd(ref),
                            make, 0, 3e-2, int(3.5 * fwd_flops), memory=True))
    return out + _padded_cases(on_gpu) + _document_cases(on_gpu) + _dropout_cases(on_gpu) + _spelling_cases(on_gpu)


def _padded_cases(on_gpu: bool) -> list[Case]:
    """A padding mask (the last 1/16 of the queries and keys are padding, so those query rows are
    fully masked) with masked_rows="average", which reproduces jax.nn's result for such rows, against
    jax.nn.dot_product_attention's XLA implementation. FLOPs counted as if unmasked."""
    b, s, h, d = (4, 4096, 32, 128) if on_gpu else (1, 40, 2, 64)
    real = s - s // 16
    mask = (jnp.arange(s) < real)[:, None] & (jnp.arange(s) < real)[None, :]
    mask = mask[None, None]

    def make(key):
        return tuple(jax.random.normal(k, (b, s, h, d), jnp.bfloat16) for k in jax.random.split(key, 4))

    ours = lambda q, k, v: xkern.ops.attention(q, k, v, mask=mask, masked_rows="average")
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    flops = 4 * b * h * s * s * d
    fwd = lambda f: (lambda q, k, v, do: f(q, k, v))
    bwd = lambda f: (lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
    name = "attention, padding mask, masked_rows=average vs jax.jit (xla)"
    return [Case(name, (b, s, h, d), "bfloat16", "fwd", fwd(ours), fwd(ref), make, 0, 2e-2, flops),
            Case(name, (b, s, h, d), "bfloat16", "fwd+bwd", bwd(ours), bwd(ref), make, 0, 3e-2, int(3.5 * flops))]


def _document_cases(on_gpu: bool) -> list[Case]:
    """Packed sequences: 4 documents per row, each attending causally within itself (a block-diagonal
    mask and causal=True), against jax.nn.dot_product_attention's XLA implementation with the same
    mask. FLOPs count the visible scores only (1/8 of the square), so the rate says how well the
    kernels skip what the mask hides."""
    b, s, h, d = (4, 4096, 32, 128) if on_gpu else (1, 40, 2, 64)
    docs = 4
    doc = jnp.arange(s) * docs // s
    mask = (doc[:, None] == doc[None, :])[None, None]

    def make(key):
        return tuple(jax.random.normal(k, (b, s, h, d), jnp.bfloat16) for k in jax.random.split(key, 4))

    ours = lambda q, k, v: xkern.ops.attention(q, k, v, causal=True, mask=mask)
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")
    flops = 4 * b * h * s * s * d // (2 * docs)
    fwd = lambda f: (lambda q, k, v, do: f(q, k, v))
    bwd = lambda f: (lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
    name = f"attention, {docs} causal documents (block-diagonal mask) vs jax.jit (xla)"
    return [Case(name, (b, s, h, d), "bfloat16", "fwd", fwd(ours), fwd(ref), make, 0, 2e-2, flops),
            Case(name, (b, s, h, d), "bfloat16", "fwd+bwd", bwd(ours), bwd(ref), make, 0, 3e-2, int(3.5 * flops))]


def _dropout_cases(on_gpu: bool) -> list[Case]:
    """Flax's attention with dropout (dropout_rate 0.1, broadcast over batch and heads, flax's default)
    and a key padding mask (the last 1/8 of the keys), as a BERT-style encoder trains: the program
    under xkern.optimize (the pattern hands the kernels the multiplier XLA draws from the program's
    random bits) against the same program under jax.jit. FLOPs counted as if unmasked. The cost
    model takes both head dims (it declines above ~180). Needs flax (a test dependency): without it, no cases."""
    if importlib.util.find_spec("flax") is None:
        return []
    import flax.linen as nn
    shapes = [(32, 512, 16, 64), (4, 4096, 32, 128)] if on_gpu else [(1, 40, 2, 64)]
    out = []
    for b, s, h, d in shapes:
        mask = jnp.broadcast_to(jnp.arange(s) < s - s // 8, (b, 1, 1, s))

        def attend(q, k, v, rng, mask=mask):
            return nn.dot_product_attention(q, k, v, mask=mask, dropout_rng=rng, dropout_rate=0.1,
                                            deterministic=False)

        def make(key, shape=(b, s, h, d)):
            keys = jax.random.split(key, 5)
            return (*(jax.random.normal(k, shape, jnp.bfloat16) for k in keys[:4]), keys[4])
        fwd = lambda f: (lambda q, k, v, do, rng: f(q, k, v, rng))
        bwd = lambda f: (lambda q, k, v, do, rng: jax.vjp(lambda *a: f(*a, rng), q, k, v)[1](do))
        flops = 4 * b * h * s * s * d
        name = "attention, flax dropout 0.1 + padding mask, xkern.optimize vs jax.jit"
        out += [Case(name, (b, s, h, d), "bfloat16", "fwd", fwd(xkern.optimize(attend)), fwd(attend), make, 0, 2e-2,
                     flops),
                Case(name, (b, s, h, d), "bfloat16", "fwd+bwd", bwd(xkern.optimize(attend)), bwd(attend), make, 0,
                     3e-2, int(3.5 * flops), memory=True)]
    return out

def _hf_flax(b, s, causal, dropout, weights_dtype=None):
    """Attention as HF's Flax ports write it: the padding (and causal) mask made a bias of 0 or
    finfo.min, then flax's dot_product_attention_weights (dropout broadcast over batch and heads) and
    the einsum with v. The last 1/8 of each row's keys are padding. weights_dtype: float32 as EasyLM's
    LLaMA asks (q and k promoted; a float32 result), else q's."""
    import flax.linen as nn
    mask = jnp.broadcast_to(jnp.arange(s) < s - s // 8, (b, 1, 1, s))
    if causal:
        mask = nn.combine_masks(mask, nn.make_causal_mask(jnp.ones((b, s)), dtype=bool))

    def attend(q, k, v, rng):
        bias = jax.lax.select(mask > 0, jnp.zeros(mask.shape, q.dtype), jnp.full(mask.shape, jnp.finfo(q.dtype).min))
        weights = nn.dot_product_attention_weights(q, k, bias=bias, dropout_rng=rng, dropout_rate=dropout,
                                                   broadcast_dropout=True, deterministic=dropout == 0,
                                                   dtype=weights_dtype or q.dtype)
        return jnp.einsum("...hqk,...khd->...qhd", weights, v)
    return attend


def _float32_product(q, k, v, rng):
    """By hand, the scores' product in float32 (preferred_element_type), divided by sqrt(d), softmax
    in float32, probabilities cast back."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / q.shape[-1] ** 0.5
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(q.dtype), v)


def _last_example_padding(b: int, s: int) -> np.ndarray:
    """[b, s] keys seen: all of them, but the last 1/8 of the last example's (a constant of the
    program, as if given)."""
    return np.arange(s)[None, :] < np.asarray([s] * (b - 1) + [s - s // 8])[:, None]


def _np_sqrt_and_bias(q, k, v, rng):
    """By hand, the product divided by np.sqrt(d) (a float32 number: the scores become float32), a
    padding bias in q's dtype added (the last 1/8 of the last example's keys at -1e9), softmax,
    probabilities cast back."""
    b, s = q.shape[:2]
    bias = np.where(_last_example_padding(b, s), 0.0, -1e9)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]) + jnp.asarray(bias, q.dtype)[:, None, None]
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1).astype(q.dtype), v)


def _alphafold(q, k, v, rng, mask_as_data=False):
    """AlphaFold 2's attention (its MSA row attention with the pair bias, in bf16): q scaled first, a
    padding bias 1e9 * (mask - 1) [b, 1, 1, k] in float32 (the last 1/8 of the MSA's rows are padding,
    every key of theirs hidden), then the pair representation's bias per head [h, q, k], float32 (made
    from rng in both programs); the float32 softmax weights v as it is (a float32 result).
    mask_as_data: the same mask as float32 data, as AlphaFold's msa_mask is a batch feature (a constant
    mask's bias is 0 or -1e9, which the kernels take as a mask; a float mask from data may hold any
    number, so its bias is a bias: [b, 1, 1, k], the pair bias's companion)."""
    b, s, h, d = q.shape
    rows = jnp.asarray(np.arange(b) < b - b // 8, jnp.float32)[:, None] * jnp.ones((1, s), jnp.float32)
    if mask_as_data:  # (ones but for a 2^-24 chance, read from rng: the program cannot fold them)
        rows = rows * jnp.ceil(jax.random.uniform(jax.random.fold_in(rng, 1), (b, s)))
    pair = jax.random.normal(rng, (h, s, s), jnp.float32)
    logits = jnp.einsum("bqhc,bkhc->bhqk", q * d ** -0.5, k) + (1e9 * (rows - 1.0))[:, None, None, :]
    logits += jnp.expand_dims(pair, axis=0)
    return jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(logits), v)


def _alphafold3(samples: bool):
    """AlphaFold 3's attention (diffusion_transformer.self_attention, its projections and gate left
    out) of one example [tokens, h, c] (the pairformer's) or of each sample, mapped by jax.vmap (the
    diffusion module's), q and k cast to float32, q scaled, a padding bias 1e9 * (mask - 1) from its
    token mask (float32 data, shared by the samples: the last 1/8 of the tokens padding), then the
    pair logits [h, q, k] (bf16, shared), the float32 softmax cast back to bf16."""
    def attend(q, k, v, rng):
        s, h = q.shape[1:3]
        keep = jnp.ceil(jax.random.uniform(jax.random.fold_in(rng, 1), (s,)))  # (ones, as data)
        mask = keep * jnp.asarray(np.arange(s) < s - s // 8, jnp.float32)
        pair = jax.random.normal(rng, (h, s, s), jnp.bfloat16)

        def one(q, k, v):
            bias = (1e9 * (mask - 1.0))[..., None, None, :]
            logits = jnp.einsum("...qhc,...khc->...hqk", q.astype(jnp.float32) * q.shape[-1] ** -0.5,
                                k.astype(jnp.float32)) + bias
            logits += pair
            weights = jnp.asarray(jax.nn.softmax(logits, axis=-1), dtype=v.dtype)
            return jnp.einsum("...hqk,...khc->...qhc", weights, v)
        return jax.vmap(one)(q, k, v) if samples else one(q[0], k[0], v[0])[None]
    return attend


def _int_mask_bias(q, k, v, rng):
    """By hand, as ports of PyTorch models write it: an integer attention mask [b, k] (data: the last
    1/8 of the last example's keys 0), the bias (1 - mask) * -10000 in q's dtype, scores / sqrt(d),
    softmax in float32. The mask is no boolean, so its bias is a bias ([b, 1, 1, k])."""
    b, s = q.shape[:2]
    data = jnp.ceil(jax.random.uniform(jax.random.fold_in(rng, 1), (b, s))).astype(jnp.int32)  # ones
    mask = data * jnp.asarray(_last_example_padding(b, s), jnp.int32)
    bias = (1.0 - mask[:, None, None, :].astype(q.dtype)) * -10000.0
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype) + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype), v)


def _padding_minus_inf(q, k, v, rng):
    """By hand: a boolean padding mask given as data ([b, k]: the last 1/8 of the last example's keys
    hidden), applied with where(mask, scores, -inf), softmax in float32 (a row it hid entirely would
    be NaN, as under XLA: masked_rows="nan")."""
    b, s = q.shape[:2]
    data = jax.random.uniform(jax.random.fold_in(rng, 1), (b, s)) >= 0  # all True, but data
    mask = (data & jnp.asarray(_last_example_padding(b, s)))[:, None, None, :]
    scores = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]), -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype), v)


def _repeated_kv(q, k, v, rng):
    """GQA as Llama ports write it by hand: k and v repeated to q's heads (jnp.repeat), [b, h, s, d]
    matmuls, causal by a where with finfo.min, softmax in float32. (The kernels read k, v unrepeated.)"""
    k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    s = q @ k.swapaxes(-2, -1) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, jnp.finfo(s.dtype).min)
    return (jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype) @ v).transpose(0, 2, 1, 3)


def _temperature_per_head(q, k, v, rng):
    """By hand, causal, the scores times a learned temperature per head ([h, 1, 1], in q's dtype)."""
    t = (1 + jnp.arange(q.shape[2], dtype=jnp.float32) / q.shape[2]).astype(q.dtype).reshape(-1, 1, 1) / 16
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * t
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _flax_fp32_softmax(q, k, v, rng):
    """flax.linen.dot_product_attention(force_fp32_for_softmax=True): float32 probabilities into the
    product with v, a float32 result."""
    import flax.linen as nn
    return nn.dot_product_attention(q, k, v, force_fp32_for_softmax=True)


def _gemma(b, s, kv_heads, cap=None):
    """The gemma library's attention (GQA through a 5-D einsum, scores [b, q, heads, k]) with a causal
    mask and the last 1/8 of each row's keys padding, [b, q, k], applied with its K_MASK; `cap`:
    Gemma 2's soft cap of the scores, tanh(logits / cap) * cap."""
    mask = (jnp.arange(s)[:, None] >= jnp.arange(s)[None, :])[None] & (jnp.arange(s) < s - s // 8)[None, None, :]
    mask = jnp.broadcast_to(mask, (b, s, s))

    def attend(q, k, v, rng):
        _, t, n, d = q.shape
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", (q * d ** -0.5).reshape(b, t, kv_heads, n // kv_heads, d), k)
        logits = logits.reshape(b, t, n, s)
        if cap is not None:  # (after the reshape, as gemma writes it)
            logits = jnp.tanh(logits / cap) * cap
        logits = jnp.where(jnp.expand_dims(mask, -2), logits, -2.3819763e38)
        probs = jax.nn.softmax(logits, axis=-1).astype(k.dtype).reshape(b, t, kv_heads, n // kv_heads, s)
        return jnp.einsum("BTKGS,BSKH->BTKGH", probs, v).reshape(b, t, n, d)
    return attend


def _gpt_oss(b, s, h, window=None):
    """gpt-oss's attention as its reference writes it (k/v repeated to every q head here, as HF's
    repeat_kv does): scores scaled, its causal (and sliding-window) mask a constant -inf bias, a
    learned sink logit per head joined to the scores as a column, softmax, the column dropped."""
    qp, kp = np.arange(s)[:, None], np.arange(s)[None, :]
    mask = np.where(kp > qp, -np.inf, 0.0) + (0.0 if window is None else np.where(qp - kp > window, -np.inf, 0.0))
    sinks = jax.random.normal(jax.random.key(7), (h,), jnp.bfloat16)

    def attend(q, k, v, rng):
        group = h // k.shape[2]
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5 + jnp.asarray(mask, q.dtype)[None, None]
        column = jnp.broadcast_to(sinks.reshape(1, h, 1, 1), (b, h, s, 1))
        weights = jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return attend


def _maxtext(b, s, kv_heads, float32_logits=False):
    """MaxText's attention="dot_product" (its attention op's spelling): q scaled first (MaxText folds
    1/sqrt(d) into q's projection), 5-D GQA scores, its causal mask an additive 0 / -0.7 * float32
    max compared with half the fill, exps and sums kept apart, the output divided by the sums."""
    fill = -0.7 * float(jnp.finfo(jnp.float32).max)
    row, col = (jax.lax.broadcasted_iota(jnp.int32, (s, s), axis) for axis in (0, 1))

    def attend(q, k, v, rng):
        _, t, n, d = q.shape
        mask = jnp.where((row >= col)[None, None, None], 0.0, fill)
        w = jnp.einsum("btkgd,bskd->bkgts", (q * d ** -0.5).reshape(b, t, kv_heads, n // kv_heads, d), k)
        w = w.astype(jnp.float32) if float32_logits else w
        w = jnp.where(mask >= fill * 0.5, w, fill)
        exps = jnp.exp(w - jnp.max(w, axis=-1, keepdims=True))
        sums = jnp.moveaxis(jnp.sum(exps, axis=-1, keepdims=True), -2, 1).reshape(b, t, n, 1)
        return jnp.einsum("bkgts,bskd->btkgd", exps, v).reshape(b, t, n, d) / sums
    return attend


def _equinox(s):
    """Equinox's MultiheadAttention core (equinox.nn.dot_product_attention) with a causal mask, written
    for one example and one head as Equinox writes it, the heads and the batch mapped by jax.vmap."""
    def per_head(q, k, v):
        logits = jnp.einsum("sd,Sd->sS", q / np.sqrt(q.shape[-1]).item(), k)
        logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, jnp.finfo(logits.dtype).min)
        weights = jax.nn.softmax(logits.astype(jnp.float32)).astype(logits.dtype)
        return jnp.einsum("sS,Sd->sd", weights, v)

    def attend(q, k, v, rng):
        return jax.vmap(jax.vmap(per_head, in_axes=1, out_axes=1))(q, k, v)
    return attend


def _levanter(s):
    """Scores ordered [b, q, h, k], as Levanter's haliax orders its named axes (and many hand-written
    models): q scaled by 1/sqrt(d), a causal mask from iota filled with -1e9."""
    causal = (jnp.arange(s)[:, None] >= jnp.arange(s)[None, :])[None, :, None, :]

    def attend(q, k, v, rng):
        scores = jnp.einsum("bqhd,bkhd->bqhk", q / jnp.sqrt(q.shape[-1]), k)
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        return jnp.einsum("bqhk,bkhd->bqhd", weights, v)
    return attend


def _folded(q, k, v, rng):
    """diffusers' Flax attention (Stable Diffusion's UNet): the heads folded into the batch
    (head_to_batch_dim), scores "b i d, b j d -> b i j" times dim_head ** -0.5, softmax, @ v, unfolded."""
    b, s, h, d = q.shape
    fold = lambda x: x.transpose(0, 2, 1, 3).reshape(b * h, x.shape[1], d)
    scores = jnp.einsum("b i d, b j d->b i j", fold(q), fold(k)) * d ** -0.5
    out = jnp.einsum("b i j, b j d -> b i d", jax.nn.softmax(scores, axis=-1), fold(v))
    return out.reshape(b, h, s, d).transpose(0, 2, 1, 3)


def _padded_queries_and_keys(q, k, v, rng):
    """jax.nn.dot_product_attention with query_seq_lengths and key_value_seq_lengths (the last 1/8 of
    each sequence padding; the lengths a constant of the program, as if given), causal: padded
    queries are zeros."""
    lengths = np.full((q.shape[0],), q.shape[1] - q.shape[1] // 8, np.int32)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                        key_value_seq_lengths=lengths)


def _window_and_padding(q, k, v, rng):
    """jax.nn.dot_product_attention with a causal sliding window (1024 keys, as Gemma's local layers;
    a quarter of a short sequence) and a padding mask [b, 1, 1, k] (the last 1/8 of the last
    example's keys; a constant of the program, as if given), GQA."""
    b, s = q.shape[:2]
    padding = _last_example_padding(b, s)
    return jax.nn.dot_product_attention(q, k, v, mask=padding[:, None, None, :], is_causal=True,
                                        local_window_size=(min(1024, s // 4), 0))


def _t5(b, s, h, table=None):
    """T5's attention (t5x's layers): unscaled scores in float32 plus a relative-position bias per
    head [1, h, q, k] (from a table of 32 buckets, here clipped offsets) and a padding bias (the
    second half of the last example's keys), softmax, cast back. table: the learned [32, h] table
    (random by default: fixed, no gradient)."""
    buckets = jnp.clip(jnp.arange(s)[None, :] - jnp.arange(s)[:, None], -16, 15) + 16
    padding = jnp.arange(s)[None, :] < jnp.asarray([s] * (b - 1) + [s // 2])[:, None]

    def attend(q, k, v, rng, table=table):
        table = jax.random.normal(jax.random.key(7), (32, h)) if table is None else table
        bias = table[buckets].transpose(2, 0, 1)[None] + jnp.where(padding, 0.0, -1e10)[:, None, None, :]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) + bias
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores).astype(q.dtype), v)
    return attend


def _t5_q(q):
    """q as T5 has it: its initialization folds 1/sqrt(d) into q's projection, so the unscaled scores
    have unit spread. (Unit-normal q gave scores of spread sqrt(d) = 8, which jax.jit rounds to bf16
    before its float32 softmax: on the H200 its output was 0.216 off the float32 result, xkern's
    0.011, and the check against jax.jit failed on jax.jit's rounding; session 39.)"""
    return (q * q.shape[-1] ** -0.5).astype(q.dtype)


def _t5_table_gradient_case(on_gpu: bool) -> Case:
    """T5's attention trained: the gradients of q, k, v and of the relative-position table (whose
    dbias XLA computes from the scores it recomputes: the kernels' bias gradient)."""
    b, s, h, d = (32, 512, 16, 64) if on_gpu else (2, 24, 2, 16)

    def make(key):
        keys = jax.random.split(key, 5)
        q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in keys[:4])
        return _t5_q(q), k, v, do, jax.random.normal(keys[4], (32, h))
    grads = lambda f: (lambda q, k, v, do, table: _vjp_at(lambda q, k, v, t: f(q, k, v, None, t), (q, k, v, table), do))
    attend = _t5(b, s, h)
    name = "attention, T5: relative-position bias, its table's gradient too, xkern.optimize vs jax.jit"
    return Case(name, (b, s, h, d), "bfloat16", "fwd+bwd", grads(xkern.optimize(attend)), grads(attend), make, 0,
                3e-2, int(3.5 * 4 * b * h * s * s * d), memory=True)


def _vjp_at(f, args, do):
    """f's vjp at the cotangent do, cast to f's output dtype (a float32 result takes a float32 one)."""
    out, vjp = jax.vjp(f, *args)
    return vjp(do.astype(out.dtype))


def _spelling_cases(on_gpu: bool) -> list[Case]:
    """Spellings from real models, under xkern.optimize against the same program under jax.jit:
    HF Flax BERT (padding bias, dropout 0.1), HF Flax Llama (causal + padding bias; EasyLM's, float32
    weights), a float32 product
    by hand, GQA by jnp.repeat by hand, flax's force_fp32_for_softmax, Gemma (GQA, causal + padding mask), Gemma 2 (its soft cap
    of 50 as well), gpt-oss, MaxText's dot_product, Equinox, scores
    in Levanter's [b, q, h, k] order, T5's (unscaled, a relative-position bias; also with the bias
    table's gradient), AlphaFold's (a padding bias and a pair bias, head dim 32), AlphaFold 3's (one
    example, no batch dim, or samples mapped by vmap; float32 q and k), diffusers' (heads
    folded into the batch, head dims 40 and 64), jax.nn's with
    padded queries and keys (query_seq_lengths, key_value_seq_lengths), with a sliding window and a
    padding mask. FLOPs counted as if unmasked (the causal ones: half, the windowed ones: the scores
    inside). Needs flax."""
    if importlib.util.find_spec("flax") is None:
        return []
    cases_ = [("HF Flax BERT: padding bias, dropout 0.1", (32, 512, 16, 64), _hf_flax(32, 512, False, 0.1), 1),
              ("HF Flax Llama: causal + padding bias", (4, 4096, 32, 128), _hf_flax(4, 4096, True, 0.0), 2),
              ("HF Flax (EasyLM's LLaMA): float32 weights, causal + padding bias", (4, 4096, 32, 128),
               _hf_flax(4, 4096, True, 0.0, jnp.float32), 2),
              ("by hand: float32 product (preferred_element_type)", (4, 4096, 32, 128), _float32_product, 1),
              ("by hand: / np.sqrt(d) (float32 scores) + padding bias", (4, 4096, 32, 128), _np_sqrt_and_bias, 1),
              ("by hand: (1 - mask) * -10000 of an integer mask as data", (4, 4096, 32, 128), _int_mask_bias, 1),
              ("by hand: a padding mask as data, where(mask, s, -inf)", (4, 4096, 32, 128), _padding_minus_inf, 1),
              ("flax force_fp32_for_softmax (float32 out)", (4, 4096, 32, 128), _flax_fp32_softmax, 1),
              ("by hand: causal, a temperature per head", (4, 4096, 32, 128), _temperature_per_head, 2),
              ("by hand: GQA 32/8 by jnp.repeat, causal", (4, 4096, 32, 128), _repeated_kv, 2),
              ("Gemma: GQA 32/8, causal + padding mask", (4, 4096, 32, 128), _gemma(4, 4096, 8), 2),
              ("Gemma 2: GQA 32/16, soft cap 50, causal + padding mask", (4, 4096, 32, 128),
               _gemma(4, 4096, 16, 50.0), 2),
              ("gpt-oss: sinks, GQA 64/8, causal", (2, 4096, 64, 64), _gpt_oss(2, 4096, 64), 2),
              ("gpt-oss: sinks, GQA 64/8, sliding window 128", (2, 4096, 64, 64), _gpt_oss(2, 4096, 64, 128),
               4096 * 4096 / _window_visible(4096, 128, 0)),
              ("MaxText dot_product: GQA 32/8, causal", (4, 4096, 32, 128), _maxtext(4, 4096, 8), 2),
              ("MaxText dot_product: GQA 32/8, causal, float32 logits", (4, 4096, 32, 128),
               _maxtext(4, 4096, 8, True), 2),
              ("Equinox MultiheadAttention: causal", (4, 4096, 32, 128), _equinox(4096), 2),
              ("scores [b, q, h, k] (Levanter's order): causal", (4, 4096, 32, 128), _levanter(4096), 2),
              ("T5: unscaled, relative-position bias per head + padding", (32, 512, 16, 64), _t5(32, 512, 16), 1),
              ("AlphaFold: MSA row attention, padding bias + pair bias, d 32", (128, 384, 8, 32), _alphafold, 1),
              ("AlphaFold: MSA row attention, the MSA mask as data, d 32", (128, 384, 8, 32),
               functools.partial(_alphafold, mask_as_data=True), 1),
              ("AlphaFold 3: pairformer attention, one example [tokens, h, c], padding + pair logits, d 24",
               (1, 2048, 16, 24), _alphafold3(False), 1),
              ("AlphaFold 3: diffusion transformer, 5 samples by vmap, padding + pair logits, d 48",
               (5, 2048, 16, 48), _alphafold3(True), 1),
              ("jax.nn: query_seq_lengths + key_value_seq_lengths, causal", (4, 4096, 32, 128),
               _padded_queries_and_keys, 2),
              ("jax.nn: GQA 32/8, causal sliding window 1024 + padding mask", (4, 4096, 32, 128),
               _window_and_padding, 4096 * 4096 / _window_visible(4096, 1024, 0)),
              ("diffusers Flax (SD 1.5 UNet): heads folded into the batch, d 40", (2, 4096, 8, 40), _folded, 1),
              ("diffusers Flax (SDXL UNet): heads folded into the batch, d 64", (2, 4096, 10, 64), _folded, 1)]
    kv_heads_of = {"Gemma:": 8, "Gemma 2": 16, "gpt-oss": 8, "MaxText": 8, "by hand: GQA": 8, "jax.nn: GQA": 8}
    if not on_gpu:
        kv_heads_of = {"Gemma:": 1, "Gemma 2": 1, "gpt-oss": 1, "MaxText": 1, "by hand: GQA": 1, "jax.nn: GQA": 1}
        cases_ = [(n, (1, 40, 2, 64), _hf_flax(1, 40, "causal" in n, 0.1 if "dropout" in n else 0.0,
                                               jnp.float32 if "float32 weights" in n else None)
                   if "HF" in n else _gemma(1, 40, 1, 50.0 if "soft cap" in n else None) if "Gemma" in n else
                   _gpt_oss(1, 40, 2, 8 if "window" in n else None) if "gpt-oss" in n else
                   _maxtext(1, 40, 1, "float32" in n) if "MaxText" in n else
                   _equinox(40) if "Equinox" in n else _levanter(40) if "Levanter" in n else
                   _t5(1, 40, 2) if "T5" in n else f, c)
                  for n, _, f, c in cases_]
    out = []
    for name, (b, s, h, d), attend, share in cases_:
        kv_heads = next((n for prefix, n in kv_heads_of.items() if name.startswith(prefix)), h)

        def make(key, shape=(b, s, h, d), kv_shape=(b, s, kv_heads, d), t5=name.startswith("T5")):
            keys = jax.random.split(key, 5)
            q, k, v, do = (jax.random.normal(kk, sh, jnp.bfloat16)
                           for kk, sh in zip(keys[:4], (shape, kv_shape, kv_shape, shape)))
            return _t5_q(q) if t5 else q, k, v, do, keys[4]
        fwd = lambda f: (lambda q, k, v, do, rng: f(q, k, v, rng))
        bwd = lambda f: (lambda q, k, v, do, rng: _vjp_at(lambda *a: f(*a, rng), (q, k, v), do))
        flops = int(4 * b * h * s * s * d / share)
        name = f"attention, {name}, xkern.optimize vs jax.jit"
        out += [Case(name, (b, s, h, d), "bfloat16", "fwd", fwd(xkern.optimize(attend)), fwd(attend), make, 0, 2e-2,
                     flops),
                Case(name, (b, s, h, d), "bfloat16", "fwd+bwd", bwd(xkern.optimize(attend)), bwd(attend), make, 0,
                     3e-2, int(3.5 * flops), memory=True)]
    return out + [_t5_table_gradient_case(on_gpu)]


def _window_visible(s: int, left: int, right: int) -> int:
    """Scores inside a (left, right) window of an s x s problem: FLOPs count only those."""
    offsets = range(-min(left, s - 1), min(right, s - 1) + 1)
    return sum(s - abs(o) for o in offsets)


def window_cases(on_gpu: bool) -> list[Case]:
    """Sliding-window attention (jax.nn's local_window_size): causal windows as Mistral (4096) and
    Gemma's local layers (1024) use them, with GQA, and a two-sided window, against
    jax.nn.dot_product_attention's XLA implementation (it computes every score, then masks) and,
    for causal windows on an NVIDIA GPU, cuDNN's sliding window. FLOPs count the visible scores, so
    the rate says how well the kernels skip what the window hides. Batch 1: XLA's training step at
    b2 s8192 h32 ran out of the H200's memory (its float32 scores). (The "window" suite.)"""
    problems = ([((1, 8192, 32, 8, 128), (1024, 0)), ((1, 16384, 32, 8, 128), (4096, 0)),
                 ((1, 8192, 16, 16, 128), (256, 256))] if on_gpu else [((1, 40, 2, 1, 64), (8, 0)),
                                                                        ((1, 40, 2, 2, 64), (5, 3))])
    cudnn = on_gpu and jax.devices()[0].platform == "gpu" and "NVIDIA" in jax.devices()[0].device_kind.upper()
    out = []
    for (b, s, h, hk, d), window in problems:
        def make(key, b=b, s=s, h=h, hk=hk, d=d):
            keys = jax.random.split(key, 4)
            return (jax.random.normal(keys[0], (b, s, h, d), jnp.bfloat16),
                    *(jax.random.normal(k, (b, s, hk, d), jnp.bfloat16) for k in keys[1:3]),
                    jax.random.normal(keys[3], (b, s, h, d), jnp.bfloat16))
        causal = window[1] == 0
        flops = 4 * b * h * d * _window_visible(s, *window)
        ours = lambda q, k, v, window=window, causal=causal: xkern.ops.attention(q, k, v, causal=causal,
                                                                                 local_window_size=window)
        refs = [("jax.jit (xla)", "xla")] if s <= 8192 else []
        refs += [("cuDNN", "cudnn")] if cudnn and causal else []
        for ref_name, implementation in refs:
            ref = (lambda q, k, v, window=window, causal=causal, implementation=implementation:
                   jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=window,
                                                implementation=implementation))
            fwd = lambda f: (lambda q, k, v, do: f(q, k, v))
            bwd = lambda f: (lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
            name = f"attention, {'causal ' if causal else ''}window {window} vs {ref_name}"
            shape = (b, s, f"{h}/{hk}", d)
            out.append(Case(name, shape, "bfloat16", "fwd", fwd(ours), fwd(ref), make, 0, 2e-2, flops))
            out.append(Case(name, shape, "bfloat16", "fwd+bwd", bwd(ours), bwd(ref), make, 0, 3e-2, int(3.5 * flops),
                            memory=True))
    return out
