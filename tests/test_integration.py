"""A small Flax transformer block, trained one step through xkern: everything xkern rewrites (named
patterns, generated kernels, norm ops) in one program, against jax.jit."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import xkern
from xkern.kernels.launch import kernel_names

nn = pytest.importorskip("flax.linen")


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(h, h)
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(32)(h)
        return x + nn.Dense(16)(nn.gelu(h))


def test_a_flax_training_step_matches_jax_jit():
    model = Block()
    x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    y = jax.random.normal(jax.random.key(1), (2, 8, 16))
    params = model.init(jax.random.key(2), x)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))  # smooth in the grads

    def loss(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2) + jnp.mean(jax.nn.log_softmax(x, -1))

    def step(loss_fn):
        def run(params, state, x, y):
            value, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value
        return run

    state = opt.init(params)
    want = jax.jit(step(loss))(params, state, x, y)
    inside = step(xkern.optimize(loss))  # patterns seen in the forward; backward kernels used
    # xkern.jit of the whole step finds them too: what it differentiates is optimized first
    for program in (inside, xkern.optimize(step(loss))):
        launched = kernel_names(jax.make_jaxpr(program)(params, state, x, y))
        assert {"attention_fwd", "attention_bwd_dq", "layer_norm_fwd", "layer_norm_bwd"} <= set(launched)
    for got in (jax.jit(inside)(params, state, x, y), xkern.jit(step(loss))(params, state, x, y)):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)


class _TiedLM(nn.Module):  # Flax's WMT / lm1b examples' layout: embeddings shared with the logits
    vocab: int = 40

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, 16)
        return embed.attend(Block()(embed(tokens)))


def test_flax_wmt_example_loss_trains_through_the_lm_head_kernels():
    """Flax's WMT example's training loss as it writes it (compute_weighted_cross_entropy: flax's
    onehot targets smoothed, the loss less their entropy, times the padding weights, summed, over the
    weights' sum) on a tied-embedding model: the LM head and the loss become linear_cross_entropy,
    and the step equals jax.jit's."""
    from flax.training import common_utils
    model = _TiedLM()
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 40)
    targets = jnp.roll(tokens, -1, 1).at[:, -2:].set(0)  # 0: padding
    params = model.init(jax.random.key(1), tokens)
    # (smooth in the grads: Adam's first step is about the sign of each, and the attention key bias's are
    # 0 up to rounding, 1e-8, whose signs no two programs share)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))

    def loss(params, tokens, targets, label_smoothing=0.1):
        logits = model.apply(params, tokens)
        vocab_size = logits.shape[-1]
        confidence = 1.0 - label_smoothing
        low_confidence = (1.0 - confidence) / (vocab_size - 1)
        normalizing_constant = -(confidence * jnp.log(confidence) +
                                 (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20))
        soft_targets = common_utils.onehot(targets, vocab_size, on_value=confidence, off_value=low_confidence)
        per_token = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1) - normalizing_constant
        weights = jnp.where(targets > 0, 1.0, 0.0)
        return jnp.sum(per_token * weights) / jnp.sum(weights)

    def step(params, state, tokens, targets):
        value, grads = jax.value_and_grad(loss)(params, tokens, targets)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    state = opt.init(params)
    report = xkern.explain(step)(params, state, tokens, targets)
    assert any(m.pattern.startswith("linear_cross_entropy/sum((flax_onehot") for m in report.matches), report
    got, want = xkern.jit(step)(params, state, tokens, targets), jax.jit(step)(params, state, tokens, targets)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)


class _ScannedBlock(nn.Module):  # the scan carry convention: (carry, x) -> (carry, y)
    @nn.compact
    def __call__(self, h, _):
        return Block()(h), None


@pytest.mark.parametrize("layout", ["nn.remat", "nn.scan(nn.remat)"])
def test_layers_under_remat_and_scan_train_as_under_jax_jit(layout):
    """Large models scan one layer's parameters stacked along a new axis and rematerialize it (as
    MaxText does): the patterns are found inside the scanned, rematerialized body, forward and
    backward, and a training step under xkern.jit equals jax.jit's."""
    def model(x):
        if layout == "nn.remat":
            return nn.Sequential([nn.remat(Block)(), nn.remat(Block)()])(x)
        scanned = nn.scan(nn.remat(_ScannedBlock, prevent_cse=False), variable_axes={"params": 0},
                          split_rngs={"params": True}, length=2)
        return scanned()(x, None)[0]

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return model(x)

    x, y = (jax.random.normal(jax.random.key(i), (2, 8, 16)) for i in range(2))
    params = Model().init(jax.random.key(2), x)
    opt = optax.sgd(0.1, momentum=0.9)

    def step(params, state):
        value, grads = jax.value_and_grad(lambda p: jnp.mean((Model().apply(p, x) - y) ** 2))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    state = opt.init(params)
    launched = kernel_names(jax.make_jaxpr(xkern.optimize(step))(params, state))
    assert {"attention_fwd", "attention_bwd_dq", "layer_norm_fwd", "layer_norm_bwd"} <= set(launched)
    for g, w in zip(jax.tree.leaves(xkern.jit(step)(params, state)), jax.tree.leaves(jax.jit(step)(params, state))):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)


def _attention_loss(q, k, v):
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return jnp.sum(o.astype(jnp.float32) ** 2), o


def _differentiate(how):
    """A step that differentiates _attention_loss as user code does, returning (value, dq, dk, dv)."""
    loss = lambda q, k, v: _attention_loss(q, k, v)[0]
    if how == "value_and_grad":
        return lambda q, k, v: jax.value_and_grad(loss, (0, 1, 2))(q, k, v)
    if how == "grad with aux":
        return lambda q, k, v: (lambda g, o: (o.sum(), g))(*jax.grad(_attention_loss, (0, 1, 2), has_aux=True)(q, k, v))
    if how == "vjp":
        def step(q, k, v):
            value, pullback = jax.vjp(loss, q, k, v)
            return value, pullback(jnp.ones_like(value))
        return step
    if how == "scan over microbatches":  # gradient accumulation
        def step(q, k, v):
            def body(total, batch):
                value, grads = jax.value_and_grad(loss, (0, 1, 2))(*batch)
                return total + value, grads
            value, grads = jax.lax.scan(body, 0.0, (q[:, None], k[:, None], v[:, None]))
            return value, tuple(g[:, 0] for g in grads)
        return step
    raise ValueError(how)


@pytest.mark.parametrize("how", ["value_and_grad", "grad with aux", "vjp", "scan over microbatches"])
def test_xkern_jit_of_a_step_that_differentiates_takes_the_kernels(how):
    """xkern.jit(step) where step calls jax.grad itself: the function it differentiates is optimized
    before jax differentiates it, so the attention pattern is found in its forward pass and its
    gradient runs through the backward kernels (after differentiation the forward's intermediates
    feed the backward pass, and the pattern could not be taken)."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 24, 4, 16)), jnp.float32) for _ in range(3))
    step = _differentiate(how)
    launched = kernel_names(jax.make_jaxpr(xkern.optimize(step))(q, k, v))
    assert {"attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq"} <= set(launched)
    assert xkern.explain(step)(q, k, v).matches[0].op == "attention"
    for got, want in zip(jax.tree.leaves(xkern.jit(step)(q, k, v)), jax.tree.leaves(jax.jit(step)(q, k, v))):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * float(np.abs(want).max()))


def test_outputs_that_are_not_arrays_pass_through():
    """jax.value_and_grad(has_aux=True) lets aux hold anything (a name, a count); jax.jit of a step
    that keeps it inside works, and so must xkern.jit, where xkern traces the differentiated loss."""
    def loss(x):
        return jnp.sum(jax.nn.softmax(x, axis=-1) ** 2), {"name": "softmax", "count": 3}

    def step(x):
        (value, aux), grad = jax.value_and_grad(loss, has_aux=True)(x)
        assert aux == {"name": "softmax", "count": 3}
        return value, grad
    x = jnp.asarray(np.random.default_rng(6).standard_normal((4, 8)), jnp.float32)
    assert "softmax_bwd" in kernel_names(jax.make_jaxpr(xkern.optimize(step))(x))
    for got, want in zip(xkern.jit(step)(x), jax.jit(step)(x)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert xkern.optimize(loss)(x)[1] == {"name": "softmax", "count": 3}


def test_explain_states_each_decision_once_for_a_differentiated_function(monkeypatch):
    """A candidate the differentiated function's plan declines (here the cost model, told to decline
    norms) is seen again, differentiated, in the whole program, where its intermediates feed the
    backward pass: explain reports it once, with the first reason."""
    from xkern import pipeline
    monkeypatch.setattr(pipeline, "decline_reason",
                        lambda op, *a, **k: "too small (test)" if op == "layer_norm" else None)
    norm = nn.LayerNorm()
    x = jax.random.normal(jax.random.key(0), (4, 16))
    params = norm.init(jax.random.key(1), x)
    step = lambda p, x: jax.grad(lambda p: jnp.sum(norm.apply(p, x) ** 2))(p)
    report = xkern.explain(step)(params, x)
    [declined] = [d for d in report.declined if d.pattern.startswith("layer_norm")]
    assert declined.reason == "too small (test)"


def test_forward_mode_over_reverse_mode_is_left_to_jax():
    """jacfwd over jacrev (jax.hessian) differentiates forwards what jax.grad returns: xkern's ops are
    custom_vjp functions, which jax cannot differentiate forwards, so that inner function is not
    replaced; the program equals jax.jit's."""
    w = jnp.asarray(np.random.default_rng(5).standard_normal((5, 5)), jnp.float32)
    f = lambda x: jnp.sum(jnp.tanh(jax.nn.softmax(x, axis=-1) @ w))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 5)), jnp.float32)
    assert "softmax_bwd" in kernel_names(jax.make_jaxpr(xkern.optimize(jax.grad(f)))(x))  # reverse: replaced
    np.testing.assert_allclose(xkern.jit(jax.hessian(f))(x), jax.jit(jax.hessian(f))(x), rtol=1e-5, atol=1e-6)


def test_forward_mode_through_an_optimized_function_says_what_works():
    """jax.jvp of jax.grad of an xkern.optimize'd function (a Hessian-vector product) reaches a
    kernel, which has no forward-mode rule: the error says so and names what works (xkern.jit of the
    whole computation), which equals jax.jit's."""
    f = lambda x: jnp.sum(jnp.tanh(jax.nn.logsumexp(x, -1)))
    x = jnp.asarray(np.random.default_rng(6).standard_normal((4, 9)), jnp.float32)
    v = jnp.ones_like(x)
    hvp = lambda f: lambda x, v: jax.jvp(jax.grad(f), (x,), (v,))[1]
    with pytest.raises(NotImplementedError, match=r"forward mode.*xkern\.jit\(lambda x, v: jax\.jvp"):
        hvp(xkern.optimize(f))(x, v)
    np.testing.assert_allclose(xkern.jit(hvp(f))(x, v), jax.jit(hvp(f))(x, v), rtol=1e-5, atol=1e-6)


def _ln(x, g, b):
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b


@pytest.mark.parametrize("how", ["a gradient penalty", "MAML's inner step", "grad of grad"])
def test_derivatives_of_derivatives_under_xkern_jit(how):
    """A derivative taken inside a function that is itself differentiated is differentiated twice,
    and xkern's backward kernels have none of their own: only the outer function is replaced, the
    inner derivative's forward still planned with it (its kernels differentiated once)."""
    rng = np.random.default_rng(7)
    x, g, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((6, 24), (24,), (24,)))
    f = lambda x, g, b: jnp.sum(jax.nn.softmax(_ln(x, g, b)) ** 2)
    outer = {"a gradient penalty": lambda g: f(x, g, b) + jnp.sum(jax.grad(f)(x, g, b) ** 2),
             "MAML's inner step": lambda g: f(x, g - 0.1 * jax.grad(lambda g: f(x, g, b))(g), b),
             "grad of grad": lambda g: jnp.sum(jax.grad(f, argnums=1)(x, g, b) * jnp.cos(g))}[how]
    step = jax.grad(outer)
    assert "layer_norm_fwd" in kernel_names(jax.make_jaxpr(xkern.jit(step))(g))
    np.testing.assert_allclose(xkern.jit(step)(g), jax.jit(step)(g), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_vmap_over_a_norms_scale_and_bias(rms):
    """A scale and bias per example (an ensemble's, vmapped): the kernels read one of each for every
    row, so XLA computes those calls from the reference; values and every gradient, a residual too."""
    rng = np.random.default_rng(8)
    x, r = (jnp.asarray(rng.standard_normal((5, 7)), jnp.float32) for _ in range(2))
    g, b = (jnp.asarray(rng.standard_normal(7), jnp.float32) for _ in range(2))
    ours = (lambda x, r, g, b: xkern.ops.rms_norm(x, g, bias=b, residual=r, eps=1e-5)) if rms else (
        lambda x, r, g, b: xkern.ops.layer_norm(x, g, b, eps=1e-5, residual=r))

    def theirs(x, r, g, b):
        h = x + r
        c = h if rms else h - h.mean(-1, keepdims=True)
        return c * jax.lax.rsqrt((c ** 2).mean(-1, keepdims=True) + 1e-5) * g + b, h
    for in_axes in [(None, None, 0, 0), (None, None, 0, None), (0, None, None, 0), (0, 0, 0, 0)]:
        examples = lambda a: a[None] * jnp.arange(1.0, 4.0).reshape(3, *[1] * a.ndim)  # (3 different)
        args = [a if axis is None else examples(a) for a, axis in zip((x, r, g, b), in_axes)]
        loss = lambda norm: lambda *a: sum(jnp.sum(jnp.sin(o) * (k + 1)) for k, o in enumerate(norm(*a)))
        run = lambda norm: jax.vmap(jax.value_and_grad(loss(norm), argnums=(0, 1, 2, 3)), in_axes)(*args)
        for got, want in zip(*(jax.tree.leaves(jax.jit(run, static_argnums=0)(norm)) for norm in (ours, theirs))):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=str(in_axes))


def test_arguments_and_calls_as_jax_jit_takes_them():
    """What jax.jit takes, xkern.jit takes the same way: NumPy scalars as static arguments, a
    function that adds to a dict it is given, xkern.jit(f) made anew for each call (f traced once, as
    by jax.jit: the wrapper is cached per function, holding it weakly, kept alive by the result's
    __wrapped__); eager optimize of a float64 NumPy array; explain with static arguments."""
    x = jnp.asarray(np.random.default_rng(9).standard_normal((4, 6)), jnp.float32)
    soft = lambda x, axis, double: jax.nn.softmax(x, axis=axis) * (2.0 if double else 1.0)
    for axis, double in [(np.int64(-1), np.bool_(True)), (np.int32(0), np.bool_(False))]:
        got = xkern.jit(soft, static_argnums=(1, 2))(x, axis, double)
        np.testing.assert_allclose(got, jax.jit(soft, static_argnums=(1, 2))(x, axis, double), rtol=1e-6)

    def adds(d):
        d["y"] = jax.nn.softmax(d["x"])
        return d
    np.testing.assert_allclose(xkern.jit(adds)({"x": x})["y"], jax.nn.softmax(x), rtol=1e-6)

    traces = []
    def f(x):
        traces.append(1)
        return jax.nn.softmax(x)
    for _ in range(3):
        np.testing.assert_allclose(xkern.jit(f)(x), jax.nn.softmax(x), rtol=1e-6)
    assert len(traces) == 1 and xkern.jit(f).__wrapped__ is f
    f.tag = "attributes of f, as jax.jit(f) has them"
    assert xkern.jit(f).tag == jax.jit(f).tag
    once = xkern.jit(lambda x: jax.nn.log_softmax(x))  # (nothing else holds the lambda)
    import gc
    gc.collect()
    np.testing.assert_allclose(once(x), jax.nn.log_softmax(x), rtol=1e-6)

    wide = np.asarray(x, np.float64)
    got = xkern.optimize(jax.nn.softmax)(wide)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, jax.nn.softmax(wide), rtol=1e-6)

    softmax_at = lambda x, axis: jax.nn.softmax(x, axis=axis)
    for report in [xkern.explain(softmax_at, static_argnums=1)(x, -1),
                   xkern.explain(softmax_at, static_argnames="axis")(x, -1),
                   xkern.explain(xkern.jit(softmax_at, static_argnums=1))(x, -1)]:
        assert report.kernels == ["softmax_fwd"]
    with pytest.raises(TypeError, match="static_argnums must be ints"):
        xkern.explain(softmax_at, static_argnums=["axis"])


def test_jax_export_of_kernels_says_they_cannot_be_exported_and_what_can():
    """jax.export of a program with xkern's kernels (for this platform or another) names the kernel
    and the remedy; the same function with backend="xla" exports, and the export runs as jax.jit."""
    from jax import export
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 16)), jnp.float32)
    f = lambda x: jax.nn.softmax(x * 2.0) + 1.0
    for platforms in (None, ["cuda"]):
        with pytest.raises(ValueError, match="cannot be exported.*backend='xla'"):
            export.export(xkern.jit(f), platforms=platforms)(x)
    exported = export.export(xkern.jit(f, backend="xla"))(x)
    np.testing.assert_allclose(exported.call(x), jax.jit(f)(x), rtol=1e-6)


def test_the_garbage_collector_is_paused_while_planning_and_restored_after():
    """Planning allocates millions of objects, and each full collection walks them all: the
    collector is paused while xkern traces and plans (the function below runs inside that), then
    restored as it was, after an error too, and left off where the user turned it off."""
    import gc
    seen = []

    def f(x):
        seen.append(gc.isenabled())
        return jnp.tanh(x) * 2

    def fails(x):
        raise ValueError("the user's error")

    x = jnp.linspace(-1, 1, 5)
    assert gc.isenabled()
    np.testing.assert_allclose(xkern.jit(f)(x), jnp.tanh(x) * 2, rtol=1e-6)
    xkern.explain(f)(x)
    assert seen == [False, False] and gc.isenabled()
    with pytest.raises(ValueError, match="the user's error"):
        xkern.optimize(fails)(x)
    assert gc.isenabled()
    gc.disable()
    try:
        xkern.optimize(f)(x)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_debug_callbacks_in_the_program_run_as_under_jax_jit():
    """jax.debug.print / jax.debug.callback of a reduction (an equation with no result reading it)
    inside a step: the callback sees jax.jit's value, and the rest is still rewritten."""
    x = jax.random.normal(jax.random.key(3), (4, 37))
    seen = []

    def f(x):
        jax.debug.callback(lambda s: seen.append(float(s)), jnp.sum(x * 2))
        jax.debug.print("sum={s}", s=x.sum())
        return jax.nn.softmax(x, axis=-1)

    np.testing.assert_allclose(xkern.jit(f)(x), jax.jit(f)(x), rtol=1e-6)
    jax.effects_barrier()
    assert len(seen) == 2 and seen[0] == pytest.approx(seen[1], rel=1e-6)
    assert [m.pattern for m in xkern.explain(f)(x).matches if m.op == "softmax"]


def test_errors_while_tracing_name_the_users_function_as_jax_jit_does():
    """jax's errors while tracing name the function, its line and the argument: under xkern.jit the
    user's (as jax.jit's say it), not xkern's wrapper's."""
    def branches(x):
        if x.sum() > 0:
            return jax.nn.softmax(x)
        return x

    def labelled(x):
        return jax.nn.softmax(x), "label"

    x = jnp.ones((4, 37))
    for f, error in ((branches, jax.errors.TracerBoolConversionError), (labelled, TypeError)):
        messages = []
        for jit in (jax.jit, xkern.jit):
            with pytest.raises(error) as raised:
                jit(f)(x)
            messages.append([line for line in str(raised.value).splitlines() if f.__name__ in line])
        assert messages[0] and messages[1] == messages[0], messages


def test_errors_name_an_argument_in_a_pytree_or_passed_by_keyword_as_jax_jit_does():
    """Arguments in a pytree, or passed by keyword, are named as jax.jit names them (mode, flag,
    tree['x']), not as the flat leaves xkern traces (dyn[3])."""
    def in_tree(tree, c, mode):
        y = jax.nn.softmax(tree["x"] * c)
        return y if mode == 0 else jnp.tanh(y)

    def by_keyword(x, scale, flag):
        return jax.nn.softmax(x * scale) if flag else x
    tree, x = {"x": jnp.ones((4, 16)), "s": jnp.ones(16)}, jnp.ones((4, 16))
    for call, name in ((lambda jit: jit(in_tree)(tree, 2.0, 0), "argument mode"),
                       (lambda jit: jit(by_keyword)(x, scale=2.0, flag=True), "argument flag")):
        for jit in (jax.jit, xkern.jit):
            with pytest.raises(jax.errors.TracerBoolConversionError, match=name):
                call(jit)


def test_only_the_users_derivatives_are_replaced():
    """The derivatives xkern's own code asks for (a kernel's backward rule, the planner's epilogue
    derivative) are left as they are: the first caller outside jax decides."""
    import os
    from xkern import _compat
    seen = []
    wrap = lambda fun, has_aux: seen.append(fun) or fun
    f = lambda x: jnp.sin(x).sum()
    inside_xkern = compile("jax.vjp(f, x)", os.path.join(os.path.dirname(xkern.__file__), "probe.py"), "exec")
    with _compat.wrapping_differentiated(wrap):
        jax.grad(f)(1.0)
        assert len(seen) == 1
        exec(inside_xkern, {"jax": jax, "f": f, "x": 1.0})
        jax.jvp(f, (1.0,), (1.0,))  # forward mode: never replaced
        jax.linearize(f, 1.0)
    jax.grad(f)(1.0)  # outside the context
    assert len(seen) == 1


def test_flax_nnx_step_dropping_its_logits_from_aux_takes_the_lm_head():
    """nnx.value_and_grad(has_aux=True) of a loss whose aux holds the logits, which the step does not
    return: under nnx.jit(xkern.optimize(step)) the LM head takes them (explain lists them as left
    out), and three AdamW steps give nnx.jit's losses and parameters."""
    nnx = pytest.importorskip("flax.nnx")
    import optax

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed, self.norm = nnx.Embed(50, 32, rngs=rngs), nnx.RMSNorm(32, rngs=rngs)
            self.head = nnx.Linear(32, 300, use_bias=False, rngs=rngs)

        def __call__(self, tokens):
            return self.head(self.norm(self.embed(tokens)))

    def loss_fn(model, tokens, labels):
        logits = model(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), {"logits": logits}

    def step(model, optimizer, tokens, labels):
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, tokens, labels)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(5)
    tokens, labels = jnp.asarray(rng.integers(0, 50, (4, 8))), jnp.asarray(rng.integers(0, 300, (4, 8)))
    fresh = lambda: (lambda model: (model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)))(LM(nnx.Rngs(0)))
    report = xkern.explain(step)(*fresh(), tokens, labels)
    assert any(m.pattern.startswith("linear_cross_entropy/") for m in report.matches), report
    assert any(u.endswith("['logits']") for u in report.unread), report
    runs = {}
    for name, wrap in (("nnx.jit", nnx.jit), ("xkern", lambda f: nnx.jit(xkern.optimize(f)))):
        model, optimizer = fresh()
        runs[name] = ([wrap(step)(model, optimizer, tokens, labels) for _ in range(3)], nnx.state(model, nnx.Param))
    np.testing.assert_allclose(runs["xkern"][0], runs["nnx.jit"][0], rtol=1e-5)
    for got, want in zip(jax.tree.leaves(runs["xkern"][1]), jax.tree.leaves(runs["nnx.jit"][1])):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_flax_nnx_training_step_under_nnx_jit_updates_the_model():
    """Flax NNX updates modules in place (optimizer.update). Under nnx.jit(xkern.optimize(step)) the
    values the step sets are carried out of xkern's trace onto nnx.jit's objects, as if the step had
    run there (before, xkern traced copies and the model silently never changed)."""
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.LayerNorm(16, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=rngs)

        def __call__(self, x):
            return x + self.attention(self.norm(x), mask=nnx.make_causal_mask(x[..., 0]))

    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    x = jax.random.normal(jax.random.key(0), (2, 12, 16))
    runs = {}
    for name, wrap in (("nnx.jit", nnx.jit), ("xkern", lambda f: nnx.jit(xkern.optimize(f)))):
        model = Block(nnx.Rngs(0))
        # (sgd: adam would turn the key bias's gradient, 0 up to rounding, into whole steps)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        losses = [wrap(step)(model, optimizer, x) for _ in range(3)]
        runs[name] = (losses, nnx.state(model, nnx.Param), int(optimizer.step[...]))
    (want_losses, want_params, want_steps), (losses, params, steps) = runs["nnx.jit"], runs["xkern"]
    assert steps == want_steps == 3 and float(losses[2]) < float(losses[0])
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    model = Block(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.warns(UserWarning, match="set values on its arguments in place"):  # as jax.jit, nowhere
        xkern.jit(step)(model, optimizer, x)
    assert int(optimizer.step[...]) == 0
    graphdef, state = nnx.split((model, optimizer))
    launched = kernel_names(jax.make_jaxpr(lambda s: xkern.optimize(step)(*nnx.merge(graphdef, s), x))(state))
    assert {"attention_fwd", "attention_bwd_dq"} <= set(launched)

    def functional(state, x):  # merge, update in place, return the new state: nothing to warn about
        model, optimizer = nnx.merge(graphdef, state)
        loss = step(model, optimizer, x)
        return loss, nnx.state((model, optimizer))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, state = xkern.jit(functional)(state, x)
    assert int(nnx.merge(graphdef, state)[1].step[...]) == 1


def test_values_set_in_place_on_arguments_are_carried_out():
    def f(state, x):
        state["count"] = state["count"] + 1
        state["last"][0] = jax.nn.softmax(x)
        return x.sum()
    x = jnp.arange(6.0).reshape(2, 3)
    state = {"count": jnp.zeros(()), "last": [jnp.zeros((2, 3))]}
    total = xkern.optimize(f)(state, x)
    assert float(total) == 15.0 and float(state["count"]) == 1.0
    np.testing.assert_allclose(state["last"][0], jax.nn.softmax(x), rtol=1e-6)

    def grows(state):
        state["new"] = jnp.ones(())
        return jnp.zeros(())
    with pytest.raises(TypeError, match="changed the structure of its arguments"):
        xkern.optimize(grows)({"a": jnp.ones(())})


@pytest.mark.cost_model
@pytest.mark.parametrize("block", ["GPT", "Llama"])
def test_decoder_blocks_at_gpu_sizes_are_planned_as_measured(block):
    """The benchmark suite's Flax decoder blocks at their H200 size (b4 s2048 d2048), planned for a GPU
    (planning launches nothing): attention and the norm of the residual sum become kernels; the
    first norm and RoPE (64 MiB and less a call), SwiGLU and the matmul epilogues stay with XLA, as
    measured (benchmarks/results/README.md, thirteenth session: taking them all made both blocks slower)."""
    from benchmarks.bench_programs import decoder_blocks
    from xkern import pipeline
    name, module, x, _ = next(b for b in decoder_blocks(on_gpu=True) if block in b[0])
    params = jax.eval_shape(module.init, jax.random.key(0), x)
    loss = lambda p, x: jnp.mean(module.apply(p, x).astype(jnp.float32) ** 2)
    plans = list(pipeline.plan(jax.make_jaxpr(loss)(params, x), "triton").walk())
    taken = sorted((r.match.pattern.op, r.residual_add is not None) for p in plans for r in p.rewrites.values())
    norm = "layer_norm" if block == "GPT" else "rms_norm"
    assert taken == sorted([("attention", False), (norm, True)])
    assert not any(p.fusions for p in plans)
    declined = " | ".join(f"{d.pattern}: {d.reason}" for p in plans for d in p.declined)
    assert f"{norm}/flax.linen" in declined and "too small" in declined
    assert "matmul with a generated epilogue" in declined
    if block == "Llama":
        assert "swiglu/" in declined and "rope/" in declined


@pytest.mark.parametrize("logits_in_aux", [False, True], ids=["z-loss and sum in aux", "logits in aux"])
def test_a_training_step_on_maxtexts_loss_fn_takes_the_lm_head_with_its_metrics(logits_in_aux):
    """An LM (flax: embedding, RMSNorm, Dense head; the benchmark suite's row has Llama blocks too)
    trained one AdamW step on MaxText's loss_fn, whose aux returns the z-loss and the summed loss:
    the LM head takes linear_cross_entropy, which gives the rows' logsumexp and the sum; loss, aux
    and parameters as jax.jit's. MaxText's loss_fn since 2025 returns the logits in aux, which its
    step drops: the LM head takes them too (they are never made)."""
    import flax.linen as nn

    from benchmarks.bench_programs import _maxtext_loss_training_case

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            h = nn.RMSNorm(dtype=jnp.bfloat16)(nn.Embed(50, 32, dtype=jnp.bfloat16)(tokens))
            return nn.Dense(50, use_bias=False, dtype=jnp.bfloat16)(h)
    case = _maxtext_loss_training_case(LM(), (2, 16, 32), 1, 50, 0, "decoder block tiny", 0, logits_in_aux)
    args = case.make_args(jax.random.key(4))
    matched = {m.pattern for m in xkern.explain(case.xla_fn)(*args).matches}
    given = "" if logits_in_aux else " + its logsumexp and its sum"
    assert ("linear_cross_entropy/sum(one_hot_log_probabilities_z_loss_upcast(lax_dot_general) * weights) / d"
            + given) in matched, matched
    got, want = case.xkern_fn(*args), case.xla_fn(*args)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-3)  # the loss
    for name in want[3]:
        np.testing.assert_allclose(got[3][name], want[3][name], rtol=2e-3, err_msg=name)
    for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):  # (2 lr: see the Gemma 2 test below)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=0, atol=2.5e-4)


def test_gemma2_training_step_as_the_gemma_library_writes_it():
    """The benchmark suite's Gemma 2 (soft-capped scores and final logits, sliding-window masks from
    positions, RoPE on split halves, RMSNorm's 1 + scale around both sublayers, GeGLU, a tied table),
    one AdamW step under xkern.jit against jax.jit: its attention, LM head (with the soft cap in the
    loss kernel: the logits never exist), RoPE and norms all taken."""
    from benchmarks.bench_programs import _gemma2_training_case
    case = _gemma2_training_case(on_gpu=False, layers=2)
    args = case.make_args(jax.random.key(3))
    matched = {m.pattern for m in xkern.explain(case.xla_fn)(*args).matches}
    assert {"linear_cross_entropy/mean(optax_integer_labels_upcast(soft_cap(matmul_transposed)))",
            "attention/einsum[bqhk,gqa]+scaled q+soft cap+mask[b,q,k]", "rope/concatenate(halves)+cast back",
            "rms_norm/rms_square*(1+scale)/plain + residual add"} <= matched
    got, want = case.xkern_fn(*args), case.xla_fn(*args)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-3)  # the loss
    # Adam's first step moves each parameter by lr (1e-4) times the sign of its gradient: where a
    # gradient is near 0 its sign may differ in bf16, so the parameters agree to a little over 2 lr;
    # the moments (the gradients scaled, and the square roots of their squares) to 5% of each
    # leaf's largest (bf16 math: the norms' scales sum 16 rows)
    for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=0, atol=2.5e-4)
    moments = lambda state: [np.sqrt(leaf) if "nu" in jax.tree_util.keystr(path) else np.asarray(leaf, np.float32)
                             for path, leaf in jax.tree_util.tree_leaves_with_path(state)]
    for g, w in zip(moments(got[1]), moments(want[1])):
        np.testing.assert_allclose(g, w, rtol=0, atol=5e-2 * float(np.max(np.abs(w))))
