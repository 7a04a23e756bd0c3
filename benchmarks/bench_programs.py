"""Whole programs: xkern.jit / xkern.optimize against jax.jit, as users would write them.

Cases where the pattern passes find softmax / log_softmax, norms and the LM head's loss in ordinary
JAX / Flax / optax code (no xkern.ops calls) and replace them; forward alone, and forward+backward
with xkern.optimize inside jax.vjp / jax.grad. The Flax and optax programs need those packages (test
dependencies); without them they are skipped.
"""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

import xkern
from benchmarks.harness import Case


def attention(q, k, v):
    """Attention as many codebases still write it: scores in bf16, softmax in float32, cast back."""
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", probs, v)


def lm_loss(logits, labels):
    """Token-level cross-entropy through log_softmax on float32-upcast bf16 logits."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def one_hot_lm_loss(logits, labels):
    """The same loss as Flax's examples write it: optax.softmax_cross_entropy's program,
    -sum(one_hot * log_softmax), with a float32 one-hot target (jax.nn.one_hot's default)."""
    one_hot = jax.nn.one_hot(labels, logits.shape[-1])
    return jnp.mean(-jnp.sum(one_hot * jax.nn.log_softmax(logits, axis=-1), axis=-1))


def masked_lm_loss(logits, labels):
    """HF's padding: the -100 labels' rows masked after the loss by where, averaged over the rest
    (here every 8th label is -100)."""
    labels = jnp.where(jnp.arange(labels.size) % 8 == 7, -100, labels)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    rows = -jnp.take_along_axis(logp, jnp.maximum(labels, 0)[:, None], axis=-1)[:, 0]
    keep = labels != -100
    return jnp.sum(jnp.where(keep, rows, 0.0)) / jnp.sum(keep)


def flax_programs(on_gpu: bool) -> list[Case]:
    """A pre-norm MLP block (flax LayerNorm, Dense, gelu, residual) and an LM head with optax's loss."""
    import flax.linen as nn
    import optax

    tokens, dim, vocab = (8192, 4096, 128256) if on_gpu else (16, 32, 50)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4 * dim, dtype=x.dtype)(nn.LayerNorm(dtype=x.dtype)(x))
            return x + nn.Dense(dim, dtype=x.dtype)(nn.gelu(h))

    block = Block()
    x0 = jnp.zeros((tokens, dim), jnp.bfloat16)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), block.init(jax.random.key(0), x0))

    def block_args(key):
        return (jax.random.normal(key, (tokens, dim), jnp.bfloat16),)

    block_loss = lambda x: jnp.mean(block.apply(params, x).astype(jnp.float32) ** 2)

    def lm_head_loss(h, w, labels):
        logits = nn.Dense(vocab, use_bias=False, dtype=h.dtype).apply({"params": {"kernel": w}}, h)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()

    def head_args(key):
        kh, kw, kl = jax.random.split(key, 3)
        return (jax.random.normal(kh, (tokens, dim), jnp.bfloat16),
                (jax.random.normal(kw, (dim, vocab)) / dim ** 0.5).astype(jnp.bfloat16),
                jax.random.randint(kl, (tokens,), 0, vocab))

    head_grads = lambda f: jax.value_and_grad(f, (0, 1))
    # Two blocks: the second LayerNorm normalizes the first block's residual sum, which it then
    # also passes on (xkern folds that add into the norm kernel).
    two = nn.Sequential([Block(), Block()])
    two_params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), two.init(jax.random.key(1), x0))
    two_loss = lambda x: jnp.mean(two.apply(two_params, x).astype(jnp.float32) ** 2)
    return [
        Case("two pre-norm MLP blocks (flax)", (tokens, dim), "bfloat16", "fwd",
             xkern.jit(lambda x: two.apply(two_params, x)), lambda x: two.apply(two_params, x), block_args,
             0, 3e-2),
        Case("two pre-norm MLP blocks (flax)", (tokens, dim), "bfloat16", "fwd+bwd",
             jax.grad(xkern.optimize(two_loss)), jax.grad(two_loss), block_args, 0, 3e-2),
        Case("pre-norm MLP block (flax)", (tokens, dim), "bfloat16", "fwd",
             xkern.jit(lambda x: block.apply(params, x)), lambda x: block.apply(params, x), block_args,
             0, 3e-2),
        Case("pre-norm MLP block (flax)", (tokens, dim), "bfloat16", "fwd+bwd",
             jax.grad(xkern.optimize(block_loss)), jax.grad(block_loss), block_args, 0, 3e-2),
        Case("LM head + loss (flax Dense, optax)", (tokens, dim, vocab), "bfloat16", "fwd+bwd",
             head_grads(xkern.optimize(lm_head_loss)), head_grads(lm_head_loss), head_args, 0, 3e-2,
             memory=True),
    ] + decoder_block_cases(on_gpu)


def decoder_blocks(on_gpu: bool) -> list[tuple[str, object, jax.ShapeDtypeStruct, int]]:
    """(name, Flax module, input, heads) of decoder blocks as Flax users write them. GPT: pre-norm causal
    self-attention (Flax's MultiHeadDotProductAttention with make_causal_mask), then a pre-norm gelu
    MLP. Llama: RMSNorm, grouped-query attention (jax.nn.dot_product_attention, is_causal) on q and k
    rotated by HF-style RoPE, a SwiGLU MLP."""
    import flax.linen as nn

    batch, seq, dim, heads, kv_heads = (4, 2048, 2048, 16, 4) if on_gpu else (1, 16, 32, 2, 1)
    head_dim, hidden = dim // heads, (5632 if on_gpu else 48)

    class GPTBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]), dtype=bool)
            h = nn.LayerNorm(dtype=x.dtype)(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=heads, dtype=x.dtype)(h, mask=mask)
            h = nn.Dense(4 * dim, dtype=x.dtype)(nn.LayerNorm(dtype=x.dtype)(x))
            return x + nn.Dense(dim, dtype=x.dtype)(nn.gelu(h))

    def rotate(x, cos, sin):  # HF Llama: full-width tables, the halves rotated
        half = x.shape[-1] // 2
        turned = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
        return (x * cos[:, None, :] + turned * sin[:, None, :]).astype(x.dtype)

    class LlamaBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            freqs = 10000.0 ** -(jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
            angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs
            cos, sin = jnp.cos(jnp.concatenate([angles, angles], -1)), jnp.sin(jnp.concatenate([angles, angles], -1))
            dense = lambda *shape: nn.DenseGeneral(shape, use_bias=False, dtype=x.dtype)
            h = nn.RMSNorm(dtype=x.dtype)(x)
            q, k, v = dense(heads, head_dim)(h), dense(kv_heads, head_dim)(h), dense(kv_heads, head_dim)(h)
            o = jax.nn.dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
            x = x + nn.DenseGeneral(dim, axis=(-2, -1), use_bias=False, dtype=x.dtype)(o)
            h = nn.RMSNorm(dtype=x.dtype)(x)
            return x + dense(dim)(nn.silu(dense(hidden)(h)) * dense(hidden)(h))

    x = jax.ShapeDtypeStruct((batch, seq, dim), jnp.bfloat16)
    return [("decoder block (flax, GPT: causal MHA + gelu MLP)", GPTBlock(), x, heads),
            ("decoder block (flax, Llama: RoPE + causal GQA + SwiGLU)", LlamaBlock(), x, heads)]


def decoder_block_cases(on_gpu: bool) -> list[Case]:
    """The decoder blocks, forward and a training step's gradient with respect to every parameter."""
    out = []
    for key, (name, block, x, heads) in enumerate(decoder_blocks(on_gpu)):
        params = block.init(jax.random.key(key), jnp.zeros(x.shape, x.dtype))
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        apply = lambda p, x, block=block: block.apply(p, x)
        loss = lambda p, x, block=block: jnp.mean(block.apply(p, x).astype(jnp.float32) ** 2)
        args = lambda key, params=params, x=x: (params, jax.random.normal(key, x.shape, x.dtype))
        shape = (*x.shape, heads)
        out += [Case(name, shape, "bfloat16", "fwd", xkern.jit(apply), apply, args, 0, 3e-2),
                Case(name, shape, "bfloat16", "fwd+bwd", jax.grad(xkern.optimize(loss)), jax.grad(loss), args, 0,
                     3e-2)]
    return out


def training_step_cases(on_gpu: bool) -> list[Case]:
    """Whole language models (embedding, decoder blocks, final norm, LM head, optax's cross-entropy)
    trained one AdamW step, as users write the step: jax.value_and_grad inside it, the whole step
    under xkern.jit, against the same step under jax.jit. Parameters in float32, compute in bf16.
    The layers as a Python loop, and as large models hold them: one layer's parameters stacked and
    scanned over, its activations rematerialized in the backward pass (nn.scan of nn.remat)."""
    import flax.linen as nn
    import optax

    layers, vocab = (4, 32000) if on_gpu else (2, 50)

    class Scanned(nn.Module):  # nn.scan's (carry, x) -> (carry, y) convention around a block
        block: type

        @nn.compact
        def __call__(self, h, _):
            return self.block()(h), None

    class LM(nn.Module):
        block: type
        norm: type
        dim: int
        scanned: bool
        tied: bool = False  # the LM head is the embedding table (GPT-2's tied weights)

        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(vocab, self.dim, dtype=jnp.bfloat16)
            h = embed(tokens)
            if self.scanned:
                h = nn.scan(nn.remat(Scanned, prevent_cse=False), variable_axes={"params": 0},
                            split_rngs={"params": True}, length=layers)(self.block)(h, None)[0]
            for _ in range(0 if self.scanned else layers):
                h = self.block()(h)
            h = self.norm(dtype=jnp.bfloat16)(h)
            return embed.attend(h) if self.tied else nn.Dense(vocab, use_bias=False, dtype=jnp.bfloat16)(h)

    out = []
    for key, (name, block, x, heads) in enumerate(decoder_blocks(on_gpu)):
        for scanned in (False, True):
            batch, seq, dim = x.shape
            norm = nn.LayerNorm if "GPT" in name else nn.RMSNorm
            model, tx = LM(type(block), norm, dim, scanned), optax.adamw(1e-4)
            step, args = _adamw_step(model, tx, jnp.zeros((batch, seq + 1), jnp.int32), vocab, key)
            layout = "scan(remat) " if scanned else ""
            out.append(Case(f"LM training step, {layers} layers {layout}AdamW {name[len('decoder block '):]}",
                            (batch, seq, dim, heads, vocab), "bfloat16", "train step", xkern.jit(step),
                            step, args, 0, 3e-2, memory=True))
        if "Llama" in name:  # MaxText's loss_fn: the z-loss and the sum returned in aux, for its metrics
            for logits_in_aux in (False, True):
                out.append(_maxtext_loss_training_case(LM(type(block), nn.RMSNorm, dim, False), x.shape, heads, vocab,
                                                       layers, name, key, logits_in_aux))
        if "GPT" in name:  # GPT-2's tied embeddings, and optax's label smoothing (a smoothed one-hot)
            model = LM(type(block), nn.LayerNorm, dim, False, tied=True)
            step, args = _adamw_step(model, tx, jnp.zeros((batch, seq + 1), jnp.int32), vocab, key, smoothing=0.1)
            out.append(Case(f"LM training step, {layers} layers AdamW {name[len('decoder block '):]}, tied "
                            "embeddings, smooth_labels(0.1)", (batch, seq, dim, heads, vocab), "bfloat16",
                            "train step", xkern.jit(step), step, args, 0, 3e-2, memory=True))
    return out + _nnx_training_cases(on_gpu, layers, vocab) + [_gemma2_training_case(on_gpu, layers)]


def _maxtext_loss_training_case(model, shape, heads, vocab, layers, name, key, logits_in_aux: bool) -> Case:
    """An LM's AdamW step on MaxText's train-step loss_fn (one-hot targets through its custom_vjp
    cross_entropy_with_logits, the loss over the count + EPS), the model's float32 logits. Its
    loss_fn of 2024: z-loss 1e-4, the summed loss and the z-loss in aux, all returned; or since 2025
    (logits_in_aux): no z-loss, the logits in aux, which the step drops as MaxText's does."""
    import optax

    from benchmarks.bench_cross_entropy import maxtext_logits_in_aux_loss, maxtext_train_loss
    batch, seq, dim = shape
    tx, tokens0 = optax.adamw(1e-4), jnp.zeros((batch, seq + 1), jnp.int32)
    params = model.init(jax.random.key(key), tokens0[:, :-1])
    opt_state = tx.init(params)

    def loss_fn(params, tokens):
        logits = model.apply(params, tokens[:, :-1]).astype(jnp.float32)
        loss = maxtext_logits_in_aux_loss if logits_in_aux else maxtext_train_loss
        return loss(logits, tokens[:, 1:], (tokens[:, 1:] != 0).astype(jnp.int32))

    def train_step(params, opt_state, tokens):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = {"total_weights": aux["total_weights"]} if logits_in_aux else aux
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    def args(key):
        return params, opt_state, jax.random.randint(key, tokens0.shape, 0, vocab)
    kind = "the logits in aux, dropped by the step" if logits_in_aux else "z-loss and the summed loss in aux"
    return Case(f"LM training step, {layers} layers AdamW {name[len('decoder block '):]}, MaxText's loss_fn ({kind})",
                (batch, seq, dim, heads, vocab), "bfloat16", "train step", xkern.jit(train_step), train_step, args, 0,
                3e-2, memory=True)


def _gemma2(on_gpu: bool, layers: int):
    """(model, vocab, (batch, seq, dim, heads, vocab)) of Gemma 2 as the gemma library writes it, at
    its 2B's widths (d 2304, 8 heads on 4 k/v heads of 256, MLP 9216, vocabulary 256000) with fewer
    layers: embeddings times sqrt(d); RMSNorm's 1 + scale before and after attention and the MLP;
    RoPE on split halves; q scaled by 256^-0.5, scores soft-capped at 50, masked by a [b, q, k] mask
    made from the positions (causal; a sliding window of 1024 on alternate layers, Gemma 2's local
    ones); a GeGLU MLP (tanh gelu); the final logits over the tied table soft-capped at 30."""
    import flax.linen as nn

    batch, seq, dim, heads, kv_heads, head_dim, hidden, vocab, window = (
        (4, 2048, 2304, 8, 4, 256, 9216, 256000, 1024) if on_gpu else (1, 16, 32, 4, 2, 8, 48, 50, 6))
    final_cap = 30.0 if on_gpu else 0.1  # (the small widths' logits are ~0.1: 0.1 bends them as 30 does Gemma's)
    bf16, init = jnp.bfloat16, nn.initializers.normal(0.02)

    def rms_norm(module, x, name):
        scale = module.param(name, nn.initializers.zeros_init(), (x.shape[-1],))
        normed = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
        return normed * (1 + scale.astype(x.dtype))

    def rope(x, positions, base=10000):
        fraction = 2 * jnp.arange(0, head_dim // 2) / head_dim
        angles = (positions[..., None] / base ** fraction)[..., None, :]
        first, second = jnp.split(x, 2, axis=-1)
        return jnp.concatenate([first * jnp.cos(angles) - second * jnp.sin(angles),
                                second * jnp.cos(angles) + first * jnp.sin(angles)], axis=-1).astype(x.dtype)

    class Block(nn.Module):
        local: bool

        @nn.compact
        def __call__(self, x, positions):
            w = lambda name, *shape: self.param(name, init, shape).astype(bf16)
            h = rms_norm(self, x, "pre_attention_norm")
            q = rope(jnp.einsum("BTD,NDH->BTNH", h, w("q", heads, dim, head_dim)), positions) * head_dim ** -0.5
            k, v = jnp.einsum("BSD,CKDH->CBSKH", h, w("kv", 2, kv_heads, dim, head_dim))
            k = rope(k, positions)
            b, t = q.shape[:2]
            logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(b, t, kv_heads, heads // kv_heads, head_dim), k)
            logits = logits.reshape(b, t, heads, t)
            logits = jnp.tanh(logits / 50.0) * 50.0
            mask = positions[:, :, None] >= positions[:, None, :]
            if self.local:
                mask = mask & (positions[:, :, None] - positions[:, None, :] < window)
            probs = jax.nn.softmax(jnp.where(jnp.expand_dims(mask, -2), logits, -2.3819763e38), axis=-1).astype(bf16)
            encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs.reshape(b, t, kv_heads, heads // kv_heads, t), v)
            attended = jnp.einsum("BTNH,NHD->BTD", encoded.reshape(b, t, heads, head_dim), w("o", heads, head_dim, dim))
            x = x + rms_norm(self, attended, "post_attention_norm")
            h = rms_norm(self, x, "pre_ffw_norm")
            gate, up = w("gating", 2, dim, hidden)
            h = jnp.dot(nn.gelu(jnp.dot(h, gate)) * jnp.dot(h, up), w("linear", hidden, dim))
            return x + rms_norm(self, h, "post_ffw_norm")

    class Gemma2(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            table = self.param("embedding", init, (vocab, dim)).astype(bf16)
            x = table[(tokens,)] * jnp.sqrt(dim).astype(bf16)
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            for layer in range(layers):
                x = Block(local=layer % 2 == 0)(x, positions)
            logits = jnp.dot(rms_norm(self, x, "final_norm"), table.T)
            logits /= final_cap
            return jnp.tanh(logits) * final_cap
    return Gemma2(), vocab, (batch, seq, dim, heads, vocab)


def _gemma2_training_case(on_gpu: bool, layers: int) -> Case:
    """Gemma 2 (see _gemma2) trained one AdamW step on optax's integer-label loss."""
    import optax

    model, vocab, shape = _gemma2(on_gpu, layers)
    step, args = _adamw_step(model, optax.adamw(1e-4), jnp.zeros((shape[0], shape[1] + 1), jnp.int32), vocab, 7)
    return Case(f"LM training step, {layers} layers AdamW (Gemma 2 2B's widths as the gemma library writes it: "
                "soft caps, sliding windows, GeGLU, tied table)", shape, "bfloat16", "train step", xkern.jit(step),
                step, args, 0, 3e-2, memory=True)


def _adamw_step(model, tx, tokens0, vocab, key, smoothing=None):
    """A Flax linen LM's AdamW step on next-token cross-entropy (integer labels, or optax's smoothed
    one-hot targets), and its arguments' maker."""
    import optax

    params = model.init(jax.random.key(key), tokens0[:, :-1])
    opt_state = tx.init(params)

    def loss_fn(params, tokens):
        logits = model.apply(params, tokens[:, :-1]).astype(jnp.float32)
        if smoothing is not None:
            targets = optax.smooth_labels(jax.nn.one_hot(tokens[:, 1:], vocab), smoothing)
            return optax.softmax_cross_entropy(logits, targets).mean()
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def args(key):
        return params, opt_state, jax.random.randint(key, tokens0.shape, 0, vocab)
    return train_step, args


def _nnx_training_cases(on_gpu: bool, layers: int, vocab: int) -> list[Case]:
    """The GPT LM written in Flax NNX, its step updating the model and optimizer in place
    (nnx.value_and_grad, optimizer.update), as users run it under nnx.jit(xkern.optimize(step)).
    Timed in nnx.jit's own functional form (split, merge, step, state out), which leaves out
    nnx.jit's per-call Python work on both sides."""
    from flax import nnx
    import optax

    batch, seq, dim, heads = (4, 2048, 2048, 16) if on_gpu else (1, 16, 32, 2)
    bf16 = {"dtype": jnp.bfloat16}

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm1, self.norm2 = (nnx.LayerNorm(dim, rngs=rngs, **bf16) for _ in range(2))
            self.attention = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False,
                                                    rngs=rngs, **bf16)
            self.up, self.down = nnx.Linear(dim, 4 * dim, rngs=rngs, **bf16), nnx.Linear(4 * dim, dim, rngs=rngs, **bf16)

        def __call__(self, x):
            x = x + self.attention(self.norm1(x), mask=nnx.make_causal_mask(x[..., 0]))
            return x + self.down(nnx.gelu(self.up(self.norm2(x))))

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(vocab, dim, rngs=rngs, **bf16)
            self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
            self.norm = nnx.LayerNorm(dim, rngs=rngs, **bf16)
            self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs, **bf16)

        def __call__(self, tokens):
            h = self.embed(tokens)
            for block in self.blocks:
                h = block(h)
            return self.head(self.norm(h))

    def step(model, optimizer, tokens):
        def loss_fn(model):
            logits = model(tokens[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    model = LM(nnx.Rngs(0))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)))

    def functional(step):  # what nnx.jit runs: the objects rebuilt, the step, their state out
        def run(state, tokens):
            model, optimizer = nnx.merge(graphdef, state)
            loss = step(model, optimizer, tokens)
            return nnx.state((model, optimizer)), loss
        return run

    args = lambda key: (state, jax.random.randint(key, (batch, seq + 1), 0, vocab))
    return [Case(f"LM training step, {layers} layers AdamW (flax NNX, GPT: causal MHA + gelu MLP)",
                 (batch, seq, dim, heads, vocab), "bfloat16", "train step", functional(xkern.optimize(step)),
                 functional(step), args, 0, 3e-2, memory=True)]


def _vjp(f):
    return lambda *args: jax.vjp(f, *args[:-1])[1](args[-1])


def cases(on_gpu: bool) -> list[Case]:
    b, h, s, d = (4, 16, 2048, 64) if on_gpu else (1, 2, 16, 8)
    tokens, vocab = (8192, 32000) if on_gpu else (16, 50)
    bf16 = jnp.bfloat16

    def qkv(key, with_cotangent=False):
        keys = jax.random.split(key, 4)
        arrays = [jax.random.normal(k, (b, h, s, d), bf16) for k in keys]
        return tuple(arrays if with_cotangent else arrays[:3])

    def logits_labels(key):
        k1, k2 = jax.random.split(key)
        return (3 * jax.random.normal(k1, (tokens, vocab), bf16),
                jax.random.randint(k2, (tokens,), 0, vocab))

    grad_logits = lambda f: (lambda logits, labels: jax.grad(f)(logits, labels))
    shape = (b, h, s, d)
    return [
        Case("attention (jax.nn.softmax)", shape, "bfloat16", "fwd", xkern.jit(attention),
             attention, qkv, 0, 2e-2),
        Case("attention (jax.nn.softmax)", shape, "bfloat16", "fwd+bwd",
             _vjp(xkern.optimize(attention)), _vjp(attention),
             lambda key: qkv(key, with_cotangent=True), 0, 3e-2),
        Case("lm loss (log_softmax)", (tokens, vocab), "bfloat16", "fwd", xkern.jit(lm_loss),
             lm_loss, logits_labels, 0, 1e-4),
        Case("lm loss (log_softmax)", (tokens, vocab), "bfloat16", "fwd+bwd",
             grad_logits(xkern.optimize(lm_loss)), grad_logits(lm_loss), logits_labels, 0, 2e-2),
        Case("lm loss (one-hot target)", (tokens, vocab), "bfloat16", "fwd", xkern.jit(one_hot_lm_loss),
             one_hot_lm_loss, logits_labels, 0, 1e-3),
        Case("lm loss (one-hot target)", (tokens, vocab), "bfloat16", "fwd+bwd",
             grad_logits(xkern.optimize(one_hot_lm_loss)), grad_logits(one_hot_lm_loss), logits_labels, 0, 2e-2),
        Case("lm loss (padding masked)", (tokens, vocab), "bfloat16", "fwd+bwd",
             grad_logits(xkern.optimize(masked_lm_loss)), grad_logits(masked_lm_loss), logits_labels, 0, 2e-2),
    ] + (flax_programs(on_gpu) if importlib.util.find_spec("flax") and importlib.util.find_spec("optax")
         else [])


def training_cases(on_gpu: bool) -> list[Case]:
    """The `training` suite: whole models' training steps (they need flax and optax)."""
    return training_step_cases(on_gpu) if importlib.util.find_spec("flax") and importlib.util.find_spec("optax") else []
