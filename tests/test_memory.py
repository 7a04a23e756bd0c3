"""Memory planning: generated kernels write over inputs that die at them, and only those; the peak
estimate follows."""
import jax
import jax.numpy as jnp
import numpy as np

import xkern
from xkern.memory.liveness import peak_live_bytes


def kernel_aliases(jaxpr) -> list:
    """The `aliases` param of every xkern_kernel equation, looking inside calls."""
    found = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if eqn.primitive.name == "xkern_kernel":
            found.append(eqn.params["aliases"])
        for value in eqn.params.values():
            if hasattr(value, "eqns") or hasattr(getattr(value, "jaxpr", None), "eqns"):
                found += kernel_aliases(value)
    return found


def dies_in_kernel(a):
    x = jnp.cumsum(a, -1)  # XLA's; x is read only by the generated kernel below
    return jnp.tanh(x) * 2 + 1


def x_is_an_output(a):
    x = jnp.cumsum(a, -1)
    return jnp.tanh(x) * 2 + 1, x


def x_is_read_later(a):
    x = jnp.cumsum(a, -1)
    y = jnp.tanh(x) * 2 + 1
    return jnp.cumsum(y, -1) + jnp.sort(x, -1)


def input_of_the_program(a):
    return jnp.tanh(a) * 2 + 1  # the caller still holds a: never written over


def test_a_kernel_writes_over_an_input_that_dies_there_and_only_then():
    a = jnp.asarray(np.random.default_rng(0).standard_normal((3, 7, 300)), jnp.float32)
    expected = {dies_in_kernel: [((0, 0),)], x_is_an_output: [()], x_is_read_later: [()],
                input_of_the_program: [()]}
    for f, aliases in expected.items():
        assert kernel_aliases(jax.make_jaxpr(xkern.optimize(f))(a)) == aliases, f.__name__
        for got, want in zip(jax.tree.leaves(xkern.jit(f)(a)), jax.tree.leaves(jax.jit(f)(a))):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_in_place_kernels_under_grad_and_vmap():
    a = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 40)), jnp.float32)
    loss = lambda f: (lambda a: jnp.sum(f(a) ** 2))
    # Differentiated, the kernel's input is kept for the backward pass: the forward does not alias.
    np.testing.assert_allclose(jax.grad(loss(xkern.optimize(dies_in_kernel)))(a),
                               jax.grad(loss(dies_in_kernel))(a), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.vmap(xkern.optimize(dies_in_kernel))(a), jax.vmap(dies_in_kernel)(a),
                               rtol=2e-6, atol=2e-6)


def test_peak_estimate_counts_in_place_outputs_once():
    a = jax.ShapeDtypeStruct((8, 300), jnp.float32)
    n = 8 * 300 * 4
    # a, x and tanh(x) (then x * 2, then + 1) live at once in the plain program; rewritten, the
    # kernel's output takes x's memory: a and x.
    assert peak_live_bytes(jax.make_jaxpr(dies_in_kernel)(a)) == 3 * n
    assert peak_live_bytes(jax.make_jaxpr(xkern.optimize(dies_in_kernel))(a)) == 2 * n
    # x must survive as an output: a, x and the kernel's output.
    assert peak_live_bytes(jax.make_jaxpr(xkern.optimize(x_is_an_output))(a)) == 3 * n
    report = xkern.explain(dies_in_kernel)(jnp.ones((8, 300)))
    assert (report.peak_before, report.peak_after, report.in_place) == (3 * n, 2 * n, 1)
    assert "1 kernel(s) writing over an input" in str(report)


def test_peak_estimate_leaves_out_what_xla_drops():
    """An equation whose outputs nothing reads, and a call's input its body does not read, are not
    counted. The latter is what a rewrite that may run as written keeps for that path: T5's padding
    bias added to its position bias, a sum [b, h, q, k] the kernels never read (they take the two),
    was counted live in xkern.explain's peak."""
    a = jax.ShapeDtypeStruct((1024,), jnp.float32)
    unread = lambda x: jax.jit(lambda x, y: x * 2)(x, jnp.outer(x, x))  # (a call ignoring y: 4 MiB)
    dead = lambda x: (jnp.outer(x, x), x * 2)[1]
    for f in (unread, dead):
        assert peak_live_bytes(jax.make_jaxpr(f)(a)) == 2 * 4096  # x and x * 2
    assert peak_live_bytes(jax.make_jaxpr(lambda x: jax.jit(lambda x, y: x * y[0])(x, jnp.outer(x, x)))(a)) > 4 * 2 ** 20

    b, s, h, d = 4, 256, 8, 64
    def t5x(q, k, v, table, padding):
        padding_bias = jnp.where(padding, 0.0, -1e10)[:, None, None, :]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) + (padding_bias + table[None])
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores).astype(q.dtype), v)
    args = (*(jnp.zeros((b, s, h, d), jnp.bfloat16) for _ in range(3)), jnp.zeros((h, s, s)), jnp.ones((b, s), bool))
    report = xkern.explain(t5x)(*args)
    assert [m.params.get("bias_split") for m in report.matches if m.op == "attention"] == [True]
    summed = b * h * s * s * 4
    assert report.peak_after < sum(a.nbytes for a in args) + summed  # (it was 16 MiB: the sum's 8 and more)
