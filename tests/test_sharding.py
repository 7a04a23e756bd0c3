"""Programs over several devices (conftest gives the CPU four): each launch splits along the batch as
the arrays are sharded (kernels/partition.py), so xkern keeps jax.jit's shardings and collectives.

The interpreter's launches run on the host while XLA's CPU client waits on them: each test takes
every result before the next call (executions with collectives queued behind host-side kernels can
stall XLA's CPU client on a two-core machine)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import xkern
from benchmarks.bench_cross_entropy import cross_entropy_with_logits
from xkern.jaxpr_passes import rope_rules
from xkern.kernels import launch as L
from xkern.kernels import partition
from xkern.kernels.launch import kernel_names

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs four devices (conftest's XLA_FLAGS)")
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:4]), ("data",))


def _normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _layer_norm(x, s, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * s + b


def _rms_of_sum(x, r, s):
    h = x + r
    return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * s + h


def _rope(x):
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * 0.1 ** jnp.arange(x.shape[-1] // 2)
    angles = jnp.concatenate([angles, angles], -1)[:, None]
    return rope_rules.rotate_half_form(x, jnp.cos(angles), jnp.sin(angles))


def _cases(rng):
    """(name, function, arguments, which are sharded on dim 0, kernels it must launch)."""
    x, r = _normal(rng, (8, 6, 32)), _normal(rng, (8, 6, 32))
    scale, bias = _normal(rng, (32,)), _normal(rng, (32,))
    logits = _normal(rng, (16, 37), jnp.bfloat16)
    labels = jnp.asarray(rng.integers(0, 37, 16), jnp.int32)
    q, k = _normal(rng, (4, 16, 4, 16), jnp.bfloat16), _normal(rng, (4, 16, 2, 16), jnp.bfloat16)
    v = _normal(rng, (4, 16, 2, 16), jnp.bfloat16)
    return [
        ("layer_norm", _layer_norm, (x, scale, bias), (True, False, False), {"layer_norm_fwd", "layer_norm_bwd"}),
        ("rms_norm of a sum", _rms_of_sum, (x, r, scale), (True, True, False), {"rms_norm_fwd", "rms_norm_bwd"}),
        ("softmax", lambda x: jax.nn.softmax(x, -1), (x,), (True,), {"softmax_fwd", "softmax_bwd"}),
        # per row: the mean over rows would be a generated kernel reducing across devices, which
        # gathers its (row-count) input
        ("cross_entropy", lambda lg, lb: optax.softmax_cross_entropy_with_integer_labels(lg, lb),
         (logits, labels), (True, True), {"cross_entropy_fwd", "cross_entropy_bwd"}),
        ("swiglu", lambda a, b: jax.nn.silu(a) * b, (x, r), (True, True), {"swiglu_fwd", "swiglu_bwd"}),
        ("rope", _rope, (q,), (True,), {"rope_fwd", "rope_bwd"}),
        ("attention, causal GQA", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
         (q, k, v), (True, True, True), {"attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq"}),
        # (causal: without a mask, a bias's rows it may hide wholly are found by a cond on jnp.any,
        # whose predicate all-reduces over the devices; that check is the bias's, of either kind)
        ("attention, causal, a padding bias of an integer mask (a key bias)",
         lambda q, k, v, m: jax.nn.dot_product_attention(
             q, k, v, bias=((1 - m[:, None, None, :]) * -1e4).astype(q.dtype), is_causal=True),
         (q, k, v, jnp.asarray(np.arange(16)[None, :] < np.array([16, 3, 9, 16])[:, None], jnp.int32)),
         (True, True, True, True), {"attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq"}),
        ("attention, a batch of batches ('...' einsums, as AlphaFold's), split along the outer batch",
         lambda q, k, v: jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(
             jnp.einsum("...qhd,...khd->...hqk", q * 0.25, k)), v),
         tuple(_normal(rng, (4, 2, 16, 2, 16), jnp.bfloat16) for _ in range(3)), (True, True, True),
         {"attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq"}),
        ("generated", lambda x: jnp.tanh(x * 1.5 + 0.5) * x, (x,), (True,), set()),
        ("decode step, key_value_seq_lengths",
         lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n),
         (q[:, :1], _normal(rng, (4, 64, 2, 16), jnp.bfloat16), _normal(rng, (4, 64, 2, 16), jnp.bfloat16),
          jnp.asarray([64, 0, 17, 40], jnp.int32)), (True, True, True, True),
         {"attention_fwd_split_kv", "attention_bwd_dkdv", "attention_bwd_dq"}),
    ]
CASES = len(_cases(np.random.default_rng(0)))


def _value_and_grads(f):
    """The value and the gradient of every argument that is a float, in float32."""
    def run(*args):
        floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
        loss = lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))
        return f(*args), jax.grad(loss, argnums=floats)(*args)
    return run


@pytest.mark.parametrize("case", range(CASES), ids=[c[0] for c in _cases(np.random.default_rng(0))])
def test_each_op_splits_along_the_batch_as_jax_jit_does(case, mesh):
    name, f, args, split, kernels = _cases(np.random.default_rng(case))[case]
    sharded = [jax.device_put(a, NamedSharding(mesh, P("data") if s else P())) for a, s in zip(args, split)]
    ours, theirs = jax.jit(_value_and_grads(xkern.optimize(f))), jax.jit(_value_and_grads(f))
    launched = set(kernel_names(jax.make_jaxpr(ours)(*sharded)))
    assert kernels <= launched and launched, (name, launched)
    got, want = jax.block_until_ready(ours(*sharded)), jax.block_until_ready(theirs(*sharded))
    one_device = jax.block_until_ready(ours(*args))  # the same kernels on the whole arrays
    tol = 3e-2 if any(a.dtype == jnp.bfloat16 for a in args) else 2e-5
    for g, w, o in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(one_device)):
        assert g.sharding.spec == w.sharding.spec, name  # outputs keep jax.jit's shardings
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(o, np.float32), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)
    hlo, xla_hlo = (fn.lower(*sharded).compile().as_text() for fn in (ours, theirs))
    # each device launches on its own rows: no gathering beyond what jax.jit's own program does
    assert [c for c in COLLECTIVES if c in hlo] == [c for c in COLLECTIVES if c in xla_hlo], name


@pytest.mark.parametrize("case", range(CASES), ids=[c[0] for c in _cases(np.random.default_rng(0))])
def test_under_an_explicit_mesh_each_op_differentiates_as_jax_jit_does(case):
    """A mesh of Explicit axes (jax.set_mesh): the arrays' types carry their shardings, the kernels'
    outputs typed as the partitioner splits them (partition.typed_shardings); the patterns re-traced
    at the program's sharded types; values and gradients as jax.jit's, with its shardings."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    name, f, args, split, kernels = _cases(np.random.default_rng(case))[case]
    with jax.set_mesh(mesh):
        sharded = [jax.device_put(a, NamedSharding(mesh, P("data") if s else P())) for a, s in zip(args, split)]
        ours, theirs = jax.jit(_value_and_grads(xkern.optimize(f))), jax.jit(_value_and_grads(f))
        launched = set(kernel_names(jax.make_jaxpr(ours)(*sharded)))
        assert kernels <= launched and launched, (name, launched)
        got, want = jax.block_until_ready(ours(*sharded)), jax.block_until_ready(theirs(*sharded))
        hlo, xla_hlo = (fn.lower(*sharded).compile().as_text() for fn in (ours, theirs))
    tol = 3e-2 if any(a.dtype == jnp.bfloat16 for a in args) else 2e-5
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (name, g.sharding, w.sharding)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)
    # as on Auto axes: no gathering beyond jax.jit's (a replicated helper array beside sharded ones,
    # e.g. the weights of masked rows' mean values, would make XLA gather the sharded one)
    assert [c for c in COLLECTIVES if c in hlo] == [c for c in COLLECTIVES if c in xla_hlo], name


def test_under_an_explicit_mesh_a_generated_kernel_selects_by_a_kernels_output():
    """A generated kernel's select reads the softmax kernel's output (typed without a sharding) and
    the sharded x: its backward evaluates the select on each as the program typed it."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    f = lambda x: jnp.sum(jnp.sin(jnp.tanh(jnp.where(jax.nn.softmax(x) > 0.1, x, -x)) * x))
    with jax.set_mesh(mesh):
        x = jax.device_put(_normal(np.random.default_rng(13), (8, 6, 32)), NamedSharding(mesh, P("data")))
        names = kernel_names(jax.make_jaxpr(xkern.jit(jax.grad(f)))(x))
        assert "softmax_bwd" in names and any(n.startswith("fused_") for n in names), names
        got, want = jax.block_until_ready((xkern.jit(jax.grad(f))(x), jax.jit(jax.grad(f))(x)))
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["softmax", "layer_norm", "cross_entropy", "generated"])
def test_under_an_explicit_mesh_inputs_sharded_along_another_dim(name):
    """Typed as sharded along the second of the rows' dims (sequence parallelism): the norms,
    softmax, cross-entropy and generated kernels split along any dim of their rows, so they are
    taken, gathering nothing (until 2026-12 all but the norms' were left to XLA: their views merged
    the rows into one dim). The program is jax.jit's, values, gradients and shardings."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(5)
    f, args = {"softmax": (lambda x: jax.nn.softmax(x, -1), (_normal(rng, (2, 8, 33)),)),
               "layer_norm": (lambda x: jax.nn.standardize(x, -1), (_normal(rng, (2, 8, 33)),)),
               "cross_entropy": (lambda lg, lb: optax.softmax_cross_entropy_with_integer_labels(lg, lb),
                                 (_normal(rng, (2, 8, 33)), jnp.asarray(rng.integers(0, 33, (2, 8)), jnp.int32))),
               "generated": (lambda x: jnp.sum(jnp.tanh(x * 1.5 + 0.5) * x, -1), (_normal(rng, (2, 8, 33)),))}[name]
    with jax.set_mesh(mesh):
        sharded = [jax.device_put(a, NamedSharding(mesh, P(None, "data"))) for a in args]
        report = xkern.explain(f)(*sharded)
        prefix = {"layer_norm": "layer_norm_fwd", "softmax": "softmax_fwd", "cross_entropy": "cross_entropy_fwd"}
        assert report.kernels and all(k.startswith(prefix.get(name, "fused_")) for k in report.kernels), report
        assert not report.declined, report
        hlo = jax.jit(_value_and_grads(xkern.optimize(f))).lower(*sharded).compile().as_text()
        assert "all-gather" not in hlo
        got, want = jax.block_until_ready((_value_and_grads(xkern.optimize(f))(*sharded), _value_and_grads(f)(*sharded)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def _rope_of_positions(x, pos):
    """Rotate-half RoPE with tables computed from per-example positions [b, s]."""
    inv = 1.0 / (10000.0 ** (jnp.arange(0, x.shape[-1], 2, dtype=jnp.float32) / x.shape[-1]))
    angles = pos.astype(jnp.float32)[..., None] * inv
    angles = jnp.concatenate([angles, angles], -1)[:, :, None, :]
    return rope_rules.rotate_half_form(x, jnp.cos(angles), jnp.sin(angles))


def _mixed_cases(rng):
    """(name, function, arguments, each one's PartitionSpec, a kernel it must launch): operands of
    one launch typed with different shardings."""
    mask = rng.random((4, 2, 4, 32)) < 0.75
    mask[..., 0] = True
    return [
        ("swiglu, b replicated", lambda a, b: jax.nn.silu(a) * b, [_normal(rng, (16, 64))] * 2, [P("data"), P()],
         "swiglu_bwd"),
        ("rms norm, the scale replicated", lambda x, s: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * s,
         [_normal(rng, (16, 64)), _normal(rng, (64,))], [P("data"), P()], "rms_norm_bwd"),
        ("attention, q replicated", lambda q, k, v: jax.nn.dot_product_attention(q, k, v),
         [_normal(rng, (4, 8, 2, 16)), _normal(rng, (4, 8, 2, 16)), _normal(rng, (4, 8, 2, 16))],
         [P(), P("data"), P("data")], "attention_bwd_dq"),
        ("attention, a mask sharded with the batch",
         lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m),
         [_normal(rng, (4, 4, 2, 16)), _normal(rng, (4, 32, 2, 16)), _normal(rng, (4, 32, 2, 16)), jnp.asarray(mask)],
         [P("data")] * 4, "attention_bwd_dq"),
        ("attention, heads sharded, a replicated bias",
         lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, bias=b),
         [_normal(rng, (2, 4, 8, 16)), _normal(rng, (2, 16, 8, 16)), _normal(rng, (2, 16, 8, 16)),
          _normal(rng, (2, 1, 4, 16))], [P(None, None, "data")] * 3 + [P()], "attention_fwd_split_kv"),
        ("rope, x replicated, positions sharded", _rope_of_positions,
         [_normal(rng, (8, 12, 4, 16)), jnp.asarray(rng.integers(0, 64, (8, 12)), jnp.int32)], [P(), P("data")],
         "rope_bwd"),
    ]


@pytest.mark.parametrize("case", range(6), ids=[c[0] for c in _mixed_cases(np.random.default_rng(0))])
def test_under_an_explicit_mesh_operands_of_one_launch_sharded_differently(case):
    """Under a mesh of Explicit axes, a kernel's operands typed with different shardings: each
    gradient comes back of its primal's type (launch._typed_vjp), masks split into tiles and k/v
    heads repeated keep their types, per-example rope tables beside a replicated x are mapped over
    alike; values, gradients and shardings as jax.jit's."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    name, f, args, specs, kernel = _mixed_cases(np.random.default_rng(case))[case]
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        ours, theirs = jax.jit(_value_and_grads(xkern.optimize(f))), jax.jit(_value_and_grads(f))
        assert kernel in kernel_names(jax.make_jaxpr(ours)(*args)), name
        got, want = jax.block_until_ready((ours(*args), theirs(*args)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (name, g.sharding, w.sharding)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_under_an_explicit_mesh_a_norm_of_a_scale_sharded_along_the_features_is_left_to_xla():
    """The scale typed as sharded along the features (the normalized dim): jax.jit's result is
    sharded there, the kernels read the scale whole: the norm with its scale is declined, saying so
    (the norm without it may run, XLA multiplying by the scale); values and shardings as jax.jit's."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(7)
    f = lambda x, s: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * s
    with jax.set_mesh(mesh):
        x, s = jax.device_put(_normal(rng, (16, 64)), NamedSharding(mesh, P())), \
            jax.device_put(_normal(rng, (64,)), NamedSharding(mesh, P("data")))
        report = xkern.explain(f)(x, s)
        assert any(d.pattern.startswith("rms_norm/") and "*scale" in d.pattern and "sharded along its dim 0" in d.reason
                   for d in report.declined), report
        got, want = jax.block_until_ready((_value_and_grads(xkern.optimize(f))(x, s), _value_and_grads(f)(x, s)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_explain_under_an_explicit_mesh_of_a_differentiated_loss():
    """xkern.explain of value_and_grad of a loss over arrays typed as sharded: it reports the
    cross-entropy kernel, and xkern.jit's value and gradient are jax.jit's, sharded as jax.jit's."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(6)
    f = jax.value_and_grad(lambda lg, lb: optax.softmax_cross_entropy_with_integer_labels(lg, lb).mean())
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in
                (_normal(rng, (16, 37), jnp.bfloat16), jnp.asarray(rng.integers(0, 37, 16), jnp.int32))]
        report = xkern.explain(f)(*args)
        assert "cross_entropy_fwd" in report.kernels, report
        got, want = jax.block_until_ready((xkern.jit(f)(*args), jax.jit(f)(*args)))
    for g, w in zip(got, want):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-3)


def test_a_process_ends_with_an_interpreted_sharded_result_never_waited_on():
    """A script whose last sharded result (launches interpreted on several CPU devices) is never
    waited on still exits: the launches finish before Python shuts down (they call back into it)."""
    import subprocess
    import sys
    script = "\n".join([
        "import os; os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=4'",
        "os.environ['XKERN_BACKEND'] = 'interpret'",
        "import jax, jax.numpy as jnp, numpy as np, xkern",
        "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P",
        "mesh = Mesh(np.array(jax.devices()[:4]), ('data',))",
        "a = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P('data')))",
        "out = jax.jit(jax.grad(lambda a: jnp.sum(jnp.sin(xkern.optimize(lambda a: jax.nn.silu(a) * a)(a)))))(a)",
        "print('done', flush=True)"])
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "done" in run.stdout, run.stderr[-2000:]


_PLAN_MAXTEXT_ATTENTION = """
import sys, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from xkern import pipeline
from xkern.jaxpr_passes import patterns
sys.path.insert(0, sys.argv[2])
from test_attention import maxtext_attention, _maxtext_mask
traced = []
trace_registry = patterns._trace_registry
patterns._trace_registry = lambda family: traced.extend(family) or trace_registry(family)
f = lambda q, k, v: maxtext_attention(q, k, v, _maxtext_mask(jnp.ones((4, 8), jnp.int32)))
args = [jnp.ones((4, 8, 2, 16), jnp.bfloat16)] * 3
if sys.argv[1] == "explicit":
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in args]
        plan = pipeline.plan(jax.make_jaxpr(f)(*args), "interpret")
else:
    plan = pipeline.plan(jax.make_jaxpr(f)(*args), "interpret")
print(len(traced), sorted(r.match.pattern.name for r in plan.rewrites.values()))
"""


def test_templates_first_traced_under_an_explicit_mesh_serve_a_later_process_without_one(tmp_path):
    """The template cache (template_cache.py) holds templates traced off any mesh: a process that
    first traces a family inside jax.set_mesh (Explicit axes) stores templates that a later process,
    with no mesh, loads (tracing nothing) and still finds its pattern with. Templates typed with
    the first program's mesh matched neither program (MaxText's attention, as here)."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "XKERN_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    tests = os.path.dirname(os.path.abspath(__file__))
    runs = [subprocess.run([sys.executable, "-c", _PLAN_MAXTEXT_ATTENTION, how, tests], env=env, capture_output=True,
                           text=True, timeout=300) for how in ("explicit", "none")]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    (first, found_first), (second, found_second) = (r.stdout.split(" ", 1) for r in runs)
    assert int(first) > 0 and int(second) == 0  # the second process loaded what the first stored
    assert "attention/maxtext dot_product+mask" in found_first and found_second == found_first


def test_an_unsplittable_launch_runs_whole_on_every_device(mesh):
    """Rows sharded on a dim the kernel reduces over: gathered, then the kernel runs on all of them."""
    x = jax.device_put(_normal(np.random.default_rng(1), (4, 64)), NamedSharding(mesh, P(None, "data")))
    got = jax.block_until_ready(jax.jit(xkern.optimize(lambda x: jax.nn.softmax(x, -1)))(x))
    np.testing.assert_allclose(got, jax.nn.softmax(np.asarray(x), -1), rtol=1e-6, atol=1e-7)


def test_the_split_decision(mesh):
    """Split only when the first sharded row operand's axes divide every split dim and the family's
    own condition (`fits`) holds; shared operands and SUMMED outputs are not counted."""
    spec = lambda *s: jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P(*s)))
    out = [jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((3, 4), jnp.float32)]
    split = L.Split((L.ROWS, L.SHARED), (L.ROWS, L.SUMMED), relaunch=None)
    assert partition._split_axes(mesh, split, [spec("data"), spec()], out) == ("data",)
    assert partition._split_axes(mesh, split, [spec(), spec("data")], out) == ()  # shared: not split
    assert partition._split_axes(mesh, split, [spec(None, "data"), spec()], out) == ()
    odd = [jax.ShapeDtypeStruct((6, 4), jnp.float32, sharding=NamedSharding(mesh, P("data")))]
    assert partition._split_axes(mesh, L.Split((L.ROWS,), (L.ROWS,), None), odd, odd) == ()
    never = L.Split((L.ROWS, L.SHARED), (L.ROWS, L.SUMMED), None, fits=lambda parts: False)
    assert partition._split_axes(mesh, never, [spec("data"), spec()], out) == ()


def test_rope_splits_in_whole_tables_and_sequences_of_whole_positions(mesh):
    """x's batch (dim 0 of its [batch, seq, heads, d] view) splits with one shared table whole on
    every device, or with per-example tables only where each device's rows hold whole tables; its
    sequence (the second split, with the tables') where the positions divide evenly."""
    rule = L._SPLIT_RULES["rope_fwd"]
    params = lambda n_rows, seq, per_table: {"scalars": ((3, n_rows), (4, seq), (5, per_table)),
                                             "constexprs": (), "out_shapes": (), "backend": "interpret",
                                             "config": None}
    assert rule(params(32, 8, 32)).args == (L.ROWS, L.SHARED, L.SHARED) and rule(params(32, 8, 32)).fits is None
    assert rule(params(32, 4, 8)).fits(4) and not rule(params(32, 4, 16)).fits(4)  # per-example tables
    sequence = rule(params(32, 8, 32)).heads_else
    assert sequence.heads_args == (1, 1, 1) and sequence.heads_fits(4) and not sequence.heads_fits(3)


def _rope_cases():
    """(name, x's spec, positions' spec or None for one table of positions 0..s-1): x [b, s, h, d]
    sharded along its sequence (sequence or context parallelism), alone or with its batch or
    heads."""
    return [("sequence", P(None, "model"), None), ("batch and sequence", P("data", "model"), None),
            ("sequence and heads", P(None, "data", "model"), None),
            ("per-example positions, sequence", P(None, "model"), P(None, "model"))]


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("case", range(4), ids=[c[0] for c in _rope_cases()])
def test_rope_splits_along_a_sharded_sequence(case, axis_type):
    """Each device rotates its positions with its share of the tables, where every device gathered
    x and computed the whole (Auto axes) or the match was left to XLA (Explicit): values and
    gradients as jax.jit's and as on one device, outputs sharded as jax.jit's, no all-gather."""
    name, spec, positions = _rope_cases()[case]
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
    rng = np.random.default_rng(50 + case)
    x = _normal(rng, (4, 8, 4, 16))
    pos = jnp.asarray(rng.integers(0, 100, (4, 8)), jnp.int32)
    f = _rope if positions is None else (lambda x: _rope_of_positions(x, pos))
    on_one_device = jax.block_until_ready(jax.jit(_value_and_grads(xkern.optimize(f)))(x))
    with jax.set_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, spec))
        if positions is not None:
            pos = jax.device_put(pos, NamedSharding(mesh, positions))
        ours, theirs = jax.jit(_value_and_grads(xkern.optimize(f))), jax.jit(_value_and_grads(f))
        got, want = jax.block_until_ready((ours(x), theirs(x)))
        assert {"rope_fwd", "rope_bwd"} <= set(xkern.explain(ours)(x).kernels), name
        hlo = ours.lower(x).compile().as_text()
    assert "all-gather" not in hlo, name
    for g, w, o in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(on_one_device)):
        np.testing.assert_allclose(g, o, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), name


@pytest.mark.parametrize("case", range(CASES), ids=[c[0] for c in _cases(np.random.default_rng(0))])
def test_inside_shard_map_each_device_launches_on_its_shard(case, mesh):
    """Inside shard_map every value is one device's share, typed as varying over the mesh (jax
    marks literals that meet such values with pvary): the patterns match through those marks, each
    launch's results vary as its operands do, and gradients of replicated arguments are summed
    over the devices as jax sums them."""
    name, f, args, split, kernels = _cases(np.random.default_rng(case))[case]
    sharded = [jax.device_put(a, NamedSharding(mesh, P("data") if s else P())) for a, s in zip(args, split)]
    specs = tuple(P("data") if s else P() for s in split)
    grad_specs = tuple(p for p, a in zip(specs, args) if jnp.issubdtype(a.dtype, jnp.floating))
    per_device = lambda fn: jax.jit(jax.shard_map(_value_and_grads(fn), mesh=mesh, in_specs=specs,
                                                  out_specs=(P("data"), grad_specs)))
    ours, theirs = per_device(xkern.optimize(f)), per_device(f)
    launched = set(kernel_names(jax.make_jaxpr(ours)(*sharded)))
    assert kernels <= launched and launched, (name, launched)
    got, want = jax.block_until_ready(ours(*sharded)), jax.block_until_ready(theirs(*sharded))
    tol = 3e-2 if any(a.dtype == jnp.bfloat16 for a in args) else 2e-5
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_xkern_jit_of_a_program_that_calls_shard_map(axis_type):
    """xkern around shard_map (not inside its body): the body is planned and rebuilt in shard_map's
    context, its mesh axis bound and its values varying over it as jax typed them; a training step's
    values and gradients as jax.jit's, the kernels launched inside the body."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    rng = np.random.default_rng(6)
    x = jax.device_put(_normal(rng, (8, 32)), NamedSharding(mesh, P("data")))
    g, b = _normal(rng, (32,)), _normal(rng, (32,))
    body = lambda x, g, b: jax.nn.softmax(_layer_norm(x, g, b)) * g + 1.0
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=P("data"))
    step = jax.value_and_grad(lambda x, g, b: jnp.sum(jnp.sin(f(x, g, b))), argnums=(0, 1, 2))
    assert {"layer_norm_fwd", "softmax_fwd"} <= set(kernel_names(jax.make_jaxpr(xkern.jit(f))(x, g, b)))
    assert "layer_norm_bwd" in kernel_names(jax.make_jaxpr(xkern.jit(step))(x, g, b))
    got = jax.block_until_ready((xkern.jit(f)(x, g, b), xkern.jit(step)(x, g, b)))
    want = jax.block_until_ready((jax.jit(f)(x, g, b), jax.jit(step)(x, g, b)))
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, w, rtol=2e-5, atol=2e-5)


def test_ops_called_inside_shard_map_sum_replicated_gradients(mesh):
    """xkern.ops called directly on a device's shard, with a replicated scale and a numpy bias: the
    scale's gradient is the sum over devices, as for the same norm written in jax.numpy."""
    x = jax.device_put(_normal(np.random.default_rng(4), (8, 32)), NamedSharding(mesh, P("data")))
    scale, bias = jnp.linspace(0.5, 1.5, 32), np.linspace(-1, 1, 32).astype(np.float32)
    grads = lambda norm: jax.jit(jax.shard_map(
        jax.grad(lambda x, s: jnp.sum(jnp.sin(norm(x, s, bias))), argnums=(0, 1)), mesh=mesh,
        in_specs=(P("data"), P()), out_specs=(P("data"), P())))
    got = jax.block_until_ready(grads(lambda x, s, b: xkern.ops.layer_norm(x, s, b, eps=1e-5))(x, scale))
    want = jax.block_until_ready(grads(_layer_norm)(x, scale))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def _lm_head_losses():
    """(name, loss of h, w, labels): by the patterns (a mean: dw made in the forward's scan) or by
    xkern.ops (each row's loss: dw made in the backward's)."""
    return [("mean, by the patterns", lambda h, w, y: optax.softmax_cross_entropy_with_integer_labels(h @ w, y).mean()),
            ("none, by xkern.ops", lambda h, w, y: jnp.sum(jnp.sin(
                xkern.ops.linear_cross_entropy(h, w, y, reduction="none", chunk_rows=4))))]


@pytest.mark.parametrize("case", range(2), ids=[c[0] for c in _lm_head_losses()])
def test_a_linear_cross_entropy_differentiated_inside_shard_map(case, mesh):
    """An LM head and its loss (linear_cross_entropy) differentiated on each device's rows: the
    chunks' scan accumulates dw in a carry that varies over the mesh as the rows do; values and
    gradients as jax.jit's of the same program in jax.numpy."""
    rng = np.random.default_rng(11)
    h, w = _normal(rng, (8, 4, 32)), _normal(rng, (32, 37)) / 6
    labels = jnp.asarray(rng.integers(0, 37, (8, 4)), jnp.int32)
    name, loss = _lm_head_losses()[case]
    rows = lambda h, w, y: optax.softmax_cross_entropy_with_integer_labels(h @ w, y)
    reference = (lambda h, w, y: rows(h, w, y).mean()) if name.startswith("mean") else \
        (lambda h, w, y: jnp.sum(jnp.sin(rows(h, w, y))))

    def per_device(loss):
        def body(h, w, y):
            value, (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1))(h, w, y)
            return jax.lax.psum(value, "data"), dh, jax.lax.psum(dw, "data")
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=(P(), P("data"), P()))
    ours = xkern.jit(per_device(loss))
    assert "cross_entropy_fwd" in kernel_names(jax.make_jaxpr(ours)(h, w, labels))
    got = jax.block_until_ready(ours(h, w, labels))
    want = jax.block_until_ready(jax.jit(per_device(reference))(h, w, labels))
    for g, x in zip(got, want):
        np.testing.assert_allclose(g, x, rtol=2e-5, atol=2e-5)


_LM_HEAD_SPECS = {  # (h's and labels' spec, w's): data, sequence (context) and tensor parallelism
    "batch": (P("data"), P()), "sequence": (P(None, "model"), P()), "batch and sequence": (P("data", "model"), P()),
    "vocabulary": (P(), P(None, "model")), "batch and vocabulary": (P("data"), P(None, "model")),
}


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("specs", list(_LM_HEAD_SPECS))
def test_an_lm_head_of_many_chunks_splits_along_sharded_rows(specs, reduction, axis_type):
    """linear_cross_entropy over h [b, s, d] whose batch or sequence or both are sharded (data and
    context parallelism), in more chunks than one: each device runs the chunks of its own rows, its
    vocabulary's share where w is split by column, and dw's partial sums are added across devices.
    Until 2026-12 the chunks' scan gathered every row onto every device, each computing every chunk
    (Auto axes), and under Explicit axes tracing failed (a sharded contraction). Values, gradients
    and shardings as the XLA program's, and no all-gather where it has none."""
    rng = np.random.default_rng(48)
    h, w = _normal(rng, (4, 8, 16)), _normal(rng, (16, 40)) / 4
    labels = jnp.asarray(rng.integers(0, 40, (4, 8)), jnp.int32)
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
    rows_spec, w_spec = _LM_HEAD_SPECS[specs]
    rows = {"ours": lambda h, w, y: xkern.ops.linear_cross_entropy(h, w, y, reduction="none", chunk_rows=4),
            "theirs": lambda h, w, y: -jnp.sum(jax.nn.one_hot(y, 40) * jax.nn.log_softmax(h @ w), -1)}
    loss = {"none": lambda f: lambda h, w, y: jnp.sum(jnp.sin(rows[f](h, w, y))),
            "mean": lambda f: (lambda h, w, y: jnp.mean(rows[f](h, w, y))) if f == "theirs" else
            (lambda h, w, y: xkern.ops.linear_cross_entropy(h, w, y, chunk_rows=4))}[reduction]
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in ((h, rows_spec), (w, w_spec),
                                                                             (labels, rows_spec))]
        ours, theirs = (jax.jit(jax.value_and_grad(loss(f), argnums=(0, 1))) for f in ("ours", "theirs"))
        hlo, xla_hlo = (fn.lower(*args).compile().as_text() for fn in (ours, theirs))
        got, want = jax.block_until_ready((ours(*args), theirs(*args)))
    assert ("all-gather" in hlo) == ("all-gather" in xla_hlo), hlo
    for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.is_equivalent_to(x.sharding, g.ndim), (g.sharding, x.sharding)
        np.testing.assert_allclose(np.asarray(g), np.asarray(x), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("spec", [P("data"), P(None, "data")], ids=["batch", "sequence"])
def test_under_an_explicit_mesh_the_lm_head_pattern_of_sharded_rows_is_taken(spec):
    """A training step's LM head and mean loss, h typed sharded along its batch or its sequence:
    the pattern is taken and runs on each device's rows (until 2026-12 its tracing failed, or, along
    the sequence, it was left to XLA)."""
    f = lambda h, w, y: optax.softmax_cross_entropy_with_integer_labels(h @ w, y).mean()
    rng = np.random.default_rng(49)
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        h, y = (jax.device_put(a, NamedSharding(mesh, spec)) for a in
                (_normal(rng, (8, 8, 32)), jnp.asarray(rng.integers(0, 40, (8, 8)), jnp.int32)))
        w = jax.device_put(_normal(rng, (32, 40)) / 6, NamedSharding(mesh, P()))
        report = xkern.explain(f)(h, w, y)
        ours, theirs = (jax.jit(jax.value_and_grad(g, argnums=(0, 1))) for g in (xkern.optimize(f), f))
        got, want = jax.block_until_ready((ours(h, w, y), theirs(h, w, y)))
    assert any(k.startswith("cross_entropy") for k in report.kernels) and not report.declined, report
    for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.is_equivalent_to(x.sharding, g.ndim), (g.sharding, x.sharding)
        np.testing.assert_allclose(np.asarray(g), np.asarray(x), rtol=2e-5, atol=2e-5)


def _capped_attention(q, k, v, bias):
    s = 5.0 * jnp.tanh(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0 / 5.0) + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


@pytest.mark.parametrize("hidden_by", ["a bias of -1e9", "a mask as a bias"])
def test_attention_of_rows_a_bias_hides_differentiated_inside_shard_map(hidden_by, mesh):
    """Soft-capped attention whose row 3 a bias hides wholly, on each device's examples: those rows'
    gradients (XLA's, around the kernels: a scan over query chunks, under a cond) vary over the mesh
    as q and k do; as jax.jit's of the same program in jax.numpy."""
    rng = np.random.default_rng(12)
    q, k, v = (_normal(rng, (4, 8, 2, 16)) for _ in range(3))
    hidden = jnp.asarray(np.arange(8)[:, None] != 3)[None, None]  # [1, 1, q, k]: row 3 sees no key
    if hidden_by == "a bias of -1e9":  # (FAR_BIAS)
        bias = jnp.where(hidden, 0.0, -1e9) * jnp.ones((4, 1, 1, 1))
        ours = lambda q, k, v, b: xkern.ops.attention(q, k, v, bias=b, logits_soft_cap=5.0)
    else:
        bias = jnp.where(hidden, 0.0, jnp.finfo(jnp.float32).min) * jnp.ones((4, 1, 1, 1))
        ours = lambda q, k, v, b: xkern.ops.attention(q, k, v, mask=b == 0, logits_soft_cap=5.0, masked_rows="bias")
    per_device = lambda f: jax.jit(jax.shard_map(
        jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)), mesh=mesh, in_specs=(P("data"),) * 4,
        out_specs=(P("data"),) * 3))
    got = jax.block_until_ready(per_device(ours)(q, k, v, bias))
    want = jax.block_until_ready(per_device(_capped_attention)(q, k, v, bias))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_patterns_match_over_sharded_arguments(mesh):
    """jax writes mesh shardings on broadcasts traced over sharded arrays; a sharding that splits
    nothing does not stop a pattern from matching."""
    logits = jax.device_put(_normal(np.random.default_rng(3), (8, 37), jnp.bfloat16), NamedSharding(mesh, P("data")))
    labels = jax.device_put(jnp.arange(8, dtype=jnp.int32), NamedSharding(mesh, P("data")))
    loss = lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x, y).mean()
    report = xkern.explain(loss)(logits, labels)
    assert [m.pattern for m in report.matches if m.op == "cross_entropy"] == ["cross_entropy/mean(optax_integer_labels)"]
    # the mean over rows split across devices, and its gradient (made in the forward), as jax.jit's
    value_and_grad = lambda f: jax.jit(jax.value_and_grad(f))(logits, labels)
    (got, dgot), (want, dwant) = value_and_grad(xkern.optimize(loss)), value_and_grad(loss)
    np.testing.assert_allclose(got, want, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(dgot, np.float32), np.asarray(dwant, np.float32), atol=2e-3)


def test_a_training_step_with_its_loss_over_a_sharded_projection(mesh):
    """xkern.jit of a whole step (it sees the backward too) whose logits carry a sharding constraint
    (MaxText's logical constraints): the loss kernel is launched, whatever is computed from no
    input is left to XLA (named in explain where a generated group would take it); the step equals
    jax.jit's on every device."""
    rng = np.random.default_rng(4)
    h, w = _normal(rng, (8, 3, 16)), _normal(rng, (16, 37)) / 4
    labels = jnp.asarray(rng.integers(0, 37, (8, 3)), jnp.int32)

    def loss(h, w, labels):
        logits = jax.lax.with_sharding_constraint(h @ w, NamedSharding(mesh, P("data")))
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    args = [jax.device_put(a, NamedSharding(mesh, P("data") if a.ndim == 3 or a.dtype == jnp.int32 else P()))
            for a in (h, w, labels)]
    step = jax.value_and_grad(loss, (0, 1))
    report = xkern.explain(step)(*args)
    assert "cross_entropy_fwd" in report.kernels
    assert all(d.reason.startswith("computed from constants alone") for d in report.declined), report.declined
    (got, grads), (want, want_grads) = jax.block_until_ready((xkern.jit(step)(*args), jax.jit(step)(*args)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        assert g.sharding.spec == w.sharding.spec
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_a_launch_reading_no_array_runs_whole_on_every_device(mesh):
    """A kernel with no array operand (custom_partitioning has nothing to shard it by) in a program
    over several devices: launched whole on each device, as a launch that cannot split."""
    import triton
    import triton.language as tl

    @triton.jit
    def iota_rows(out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, i.to(tl.float32))

    if "test_iota_rows" not in L._SPLIT_RULES:
        L.def_split("test_iota_rows", L.split_rows(None, 0, 1))
    backend = "interpret" if L.INTERPRET else "triton"

    def scaled(x):
        (iota,) = L.launch(iota_rows, kernel="test_iota_rows", out_shapes=[jax.ShapeDtypeStruct((8,), jnp.float32)],
                           grid=(1,), config=L.Config.of(), backend=backend, constexprs={"N": 8})
        return x * iota[:, None]
    x = _normal(np.random.default_rng(5), (8, 4))
    got = jax.block_until_ready(jax.jit(scaled)(jax.device_put(x, NamedSharding(mesh, P("data")))))
    np.testing.assert_allclose(got, x * np.arange(8, dtype=np.float32)[:, None], rtol=1e-6)


@pytest.fixture(scope="module")
def mesh2d():
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))


def _tensor_parallel_cases(rng):
    """(name, attention of (q, k, v, extra), extra, extra's spec, splits): heads sharded over "model"
    as tensor parallelism lays them out, the batch over "data"."""
    bias = _normal(rng, (4, 4, 16, 16))  # per example and head
    mask = jnp.asarray(rng.random((1, 4, 16, 16)) < 0.8).at[..., 0].set(True)  # per head, shared by the batch
    return [
        ("causal GQA", lambda q, k, v, n: xkern.ops.attention(q, k, v, causal=True), None, None, True),
        ("bias per head", lambda q, k, v, b: xkern.ops.attention(q, k, v, bias=b), bias, P("data", "model"), True),
        ("mask per head, kv_lengths", lambda q, k, v, m: xkern.ops.attention(
            q, k, v, mask=m, kv_lengths=jnp.asarray([16, 9, 3, 16], jnp.int32)), mask, P(None, "model"), True),
        ("multi-query: one k/v head", lambda q, k, v, n: xkern.ops.attention(q, k[:, :, :1], v[:, :, :1]),
         None, None, False),
        ("GQA by jnp.repeat, by hand", lambda q, k, v, n: xkern.optimize(_repeated_kv_attention)(q, k, v),
         None, None, True),
    ]


def _repeated_kv_attention(q, k, v):
    """Causal GQA with k and v repeated to q's heads (jnp.repeat), as Llama ports write it: the
    kernels read them unrepeated, split along the heads as the repeat's operands are sharded."""
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype), v)


@pytest.mark.parametrize("case", range(5), ids=[c[0] for c in _tensor_parallel_cases(np.random.default_rng(0))])
def test_attention_splits_its_heads_as_tensor_parallelism_shards_them(case, mesh2d):
    """q, k, v sharded [data, -, model, -]: each device launches on its examples and its heads (q's
    and k/v's alike), so no operand is gathered, and the outputs and gradients keep jax.jit's
    shardings. Where the k/v heads do not divide (one head), the launch runs whole on each device."""
    rng = np.random.default_rng(10 + case)
    name, f, extra, spec, splits = _tensor_parallel_cases(rng)[case]
    q = _normal(rng, (4, 16, 4, 16), jnp.bfloat16)
    k, v = _normal(rng, (4, 16, 2, 16), jnp.bfloat16), _normal(rng, (4, 16, 2, 16), jnp.bfloat16)
    heads = NamedSharding(mesh2d, P("data", None, "model"))
    args = [jax.device_put(a, heads) for a in (q, k, v)] + [
        jax.device_put(extra, NamedSharding(mesh2d, spec)) if extra is not None else None]
    run = lambda fn: jax.jit(_value_and_grads(lambda q, k, v: fn(q, k, v, args[3])))
    ours, reference = run(f), run(lambda q, k, v, e: _reference_attention(name, q, k, v, e))
    got, want = jax.block_until_ready(ours(*args[:3])), jax.block_until_ready(reference(*args[:3]))
    one_device = jax.block_until_ready(run(f)(q, k, v))
    for g, w, o in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(one_device)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(o, np.float32), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=3e-2, atol=3e-2)
        if splits:
            assert g.sharding.spec == w.sharding.spec, name
    hlo = ours.lower(*args[:3]).compile().as_text()
    assert ("all-gather" in hlo) != splits, name


def _reference_attention(name, q, k, v, extra):
    """jax.nn's attention (XLA) for each case of _tensor_parallel_cases."""
    if name in ("causal GQA", "GQA by jnp.repeat, by hand"):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    if name == "bias per head":
        return jax.nn.dot_product_attention(q, k, v, bias=extra.astype(q.dtype))
    if name == "mask per head, kv_lengths":
        return jax.nn.dot_product_attention(q, k, v, mask=extra,
                                            key_value_seq_lengths=jnp.asarray([16, 9, 3, 16], jnp.int32))
    return jax.nn.dot_product_attention(q, k[:, :, :1], v[:, :, :1])


@pytest.mark.parametrize("spec, targets, taken", [
    (P("data", None, "model"), "labels", True), (P("data"), "labels", True),
    (P("data", None, "model"), "one-hot", True), (P("data", None, "model"), "smoothed one-hot", False)])
def test_a_loss_over_a_vocabulary_the_program_shards(spec, targets, taken, mesh2d):
    """Logits constrained to be sharded along the vocabulary (MaxText's logical axes under tensor
    parallelism): the cross-entropy kernels split it, each device launching on its classes, with
    all-reduces of a few floats per row and no gather, as jax.jit's. Smoothed targets (whose terms
    read every class and the whole row's length) do not split that way, so that match is left to
    XLA, the reason in explain."""
    rng = np.random.default_rng(7)
    logits = jax.device_put(_normal(rng, (4, 6, 32)), NamedSharding(mesh2d, P("data")))
    labels = jax.device_put(jnp.asarray(rng.integers(0, 32, (4, 6)), jnp.int32), NamedSharding(mesh2d, P("data")))

    def loss(x, y):
        x = jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh2d, spec))
        if targets == "labels":
            return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()
        one_hot = jax.nn.one_hot(y, 32)
        return optax.softmax_cross_entropy(x, optax.smooth_labels(one_hot, 0.1) if "smoothed" in targets
                                           else one_hot).mean()
    report = xkern.explain(jax.value_and_grad(loss))(logits, labels)
    assert ("cross_entropy_fwd" in report.kernels) == taken
    if not taken:
        assert any(d.pattern.startswith("cross_entropy/") and "sharded along its dim 2 over mesh axes ('model',)"
                   in d.reason for d in report.declined)
    ours, theirs = xkern.jit(jax.value_and_grad(loss)), jax.jit(jax.value_and_grad(loss))
    (got, dgot), (want, dwant) = jax.block_until_ready((ours(logits, labels), theirs(logits, labels)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(dgot, dwant, rtol=1e-4, atol=1e-6)
    assert dgot.sharding.is_equivalent_to(dwant.sharding, 3)
    assert "all-gather" not in ours.lower(logits, labels).compile().as_text()


def test_under_an_explicit_mesh_a_loss_over_logits_typed_sharded_along_the_vocabulary():
    """Logits typed sharded along the vocabulary (one-hot targets: jax's take_along_axis cannot be
    typed over such logits): the kernels split it, with jax.jit's values, gradients' types and no
    gather."""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rng = np.random.default_rng(11)
    loss = lambda x, y: optax.softmax_cross_entropy(x, jax.nn.one_hot(y, 32)).mean()
    with jax.set_mesh(mesh):
        x = jax.device_put(_normal(rng, (4, 6, 32)), NamedSharding(mesh, P("data", None, "model")))
        y = jax.device_put(jnp.asarray(rng.integers(0, 32, (4, 6)), jnp.int32), NamedSharding(mesh, P("data")))
        ours, theirs = xkern.jit(jax.value_and_grad(loss)), jax.jit(jax.value_and_grad(loss))
        assert "cross_entropy_fwd" in kernel_names(jax.make_jaxpr(ours)(x, y))
        (got, dgot), (want, dwant) = jax.block_until_ready((ours(x, y), theirs(x, y)))
        hlo = ours.lower(x, y).compile().as_text()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(dgot, dwant, rtol=1e-4, atol=1e-6)
    assert dgot.sharding.is_equivalent_to(dwant.sharding, 3), (dgot.sharding, dwant.sharding)
    assert "all-gather" not in hlo


def _vocab_parallel_losses():
    """(name, loss of (h, w, labels, ce)) over logits h @ w, w sharded by column (tensor parallelism):
    XLA's propagation alone shards the logits along the vocabulary (no constraint). ce: for the
    losses that call it, xkern.ops.cross_entropy or its definition (XLA's, the reference)."""
    take = lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x, y)
    return [
        ("optax, mean", lambda h, w, y, ce: take(h @ w, y).mean()),
        ("a z-loss (PaLM's)", lambda h, w, y, ce: _z_loss(h @ w, y)),
        # (a generated logsumexp, x - max(x) inside it, on XLA per share: generated._on_shares)
        ("a z-loss written out beside optax's loss", lambda h, w, y, ce: jnp.mean(
            take(h @ w, y) + 1e-2 * jax.nn.logsumexp((h @ w).at[0, 1, :].set(-jnp.inf), -1) ** 2)),
        ("soft-capped logits", lambda h, w, y, ce: take(jnp.tanh((h @ w) / 3.0) * 3.0, y).mean()),
        ("each row weighted (the backward kernel)", lambda h, w, y, ce: jnp.sum(take(h @ w, y) * jnp.arange(6.0))),
        ("bfloat16 logits", lambda h, w, y, ce: take((h @ w).astype(jnp.bfloat16), y).astype(jnp.float32).mean()),
        ("logits of -inf, a row's whole share, the rest far below 0", lambda h, w, y, ce: take(
            (h @ w).at[1, 3, 20].set(-jnp.inf).at[2, 0, :16].set(-jnp.inf).at[2, 0, 16:].add(-1e3), y).mean()),
        ("xkern.ops, ignore_index -100", lambda h, w, y, ce: ce(h @ w, y, ignore_index=-100)),
        ("xkern.ops, ignore_index 3, a class", lambda h, w, y, ce: ce(h @ w, y, ignore_index=3, z_loss=1e-3)),
        ("xkern.ops, per-row losses", lambda h, w, y, ce: jnp.sum(ce(h @ w, y, reduction="none") ** 2)),
        ("one-hot targets, a label out of range, -inf logits", lambda h, w, y, ce: optax.softmax_cross_entropy(
            (h @ w).at[1, 3, 20].set(-jnp.inf), jax.nn.one_hot(y.at[3, 0].set(40), 32)).mean()),
        ("bfloat16 one-hot targets, -inf logits (XLA multiplies: NaN)", lambda h, w, y, ce: optax.softmax_cross_entropy(
            (h @ w).astype(jnp.bfloat16).at[1, 3, 20].set(-jnp.inf).at[2, 0, 20].set(-jnp.inf),
            jax.nn.one_hot(y, 32, dtype=jnp.bfloat16)).astype(jnp.float32).mean()),
        ("MaxText's cross_entropy_with_logits, no z-loss", lambda h, w, y, ce: jnp.mean(
            cross_entropy_with_logits("MaxText.max_utils")(h @ w, jax.nn.one_hot(y, 32), 0.0)[0])),
        # (the softmax kernels give way to XLA on each device's share: kernels/softmax._split)
        ("softmax at a temperature", lambda h, w, y, ce: jnp.sum(
            jax.nn.softmax((h @ w).at[1, 2, 3].set(-jnp.inf) / 0.7) ** 2 * jnp.arange(32.0))),
        ("log_softmax", lambda h, w, y, ce: jnp.sum(jnp.sin(jax.nn.log_softmax(h @ w)))),
    ]


def _z_loss(logits, labels):
    lse = jax.nn.logsumexp(logits, -1)
    return jnp.mean(lse - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0] + 1e-2 * lse ** 2)


@pytest.mark.parametrize("case", range(15), ids=[c[0] for c in _vocab_parallel_losses()])
def test_a_loss_over_logits_xla_shards_along_the_vocabulary(case, mesh2d):
    """Without a constraint, XLA's propagation gives the loss kernels logits sharded along the
    vocabulary (h @ w, w sharded by column). Each device launches on its classes: the rows'
    logsumexps are combined across devices (logsumexp of logsumexps), the label's logit taken from
    the device holding it, so nothing is gathered (before, every device gathered the whole logits),
    with jax.jit's values and gradients; labels held by either device, at the shards' edges (15, 16,
    31), ignored (-100), and an ignore_index that is a class, which does not split (a device's own
    label index could equal it) and still computes jax.jit's values."""
    from xkern.kernels.cross_entropy import reference
    name, loss = _vocab_parallel_losses()[case]
    rng = np.random.default_rng(40 + case)
    h = jax.device_put(_normal(rng, (4, 6, 16)), NamedSharding(mesh2d, P("data")))
    w = jax.device_put(_normal(rng, (16, 32)), NamedSharding(mesh2d, P(None, "model")))
    y = jnp.asarray(rng.integers(0, 32, (4, 6)), jnp.int32).at[2, :4].set(jnp.asarray([20, 15, 16, 31]))
    if name.startswith("xkern.ops"):  # (xkern.ops launches its kernels under jax.jit)
        y = y.at[0, 0].set(-100).at[1, 2].set(3)
        ours = jax.jit(jax.value_and_grad(lambda h, w, y: loss(h, w, y, xkern.ops.cross_entropy), argnums=(0, 1)))
    else:
        ours = xkern.jit(jax.value_and_grad(lambda h, w, y: loss(h, w, y, None), argnums=(0, 1)))
    theirs = jax.jit(jax.value_and_grad(lambda h, w, y: loss(h, w, y, reference), argnums=(0, 1)))
    assert kernel_names(jax.make_jaxpr(ours)(h, w, y)), name
    y = jax.device_put(y, NamedSharding(mesh2d, P("data")))
    got, want = jax.block_until_ready(ours(h, w, y)), jax.block_until_ready(theirs(h, w, y))
    tol = 2e-2 if "bfloat16" in name else 2e-5
    for g, wv in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(wv), rtol=tol, atol=tol)
    gathered = re.findall(r"= f32\[(?:12|2,6),32\]\S* all-gather", ours.lower(h, w, y).compile().as_text())
    # (a device's rows of the whole logits. Logits written by scatters (.at[].set) before the loss:
    # Shardy may shard the sequence factor the kernels also split (launch.with_row_dims) rather than
    # the vocabulary, and the launch gathers the vocabulary)
    assert bool(gathered) == ("a class" in name or "far below" in name), (name, gathered)


def _heads_first_attention(q, k, v):
    """Attention on [b, h, s, d] arrays, by hand (the einsum templates' second layout)."""
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


@pytest.mark.parametrize("layout, causal, spec, taken", [
    ("bshd", True, P(None, "model"), False), ("bshd", True, P("data", None, "model"), True),
    ("bshd", False, P(None, "model"), True), ("bhsd", False, P(None, None, "model"), True),
    ("bhsd", False, P("data", "model"), True)])
def test_attention_over_a_sharded_sequence_is_left_to_xla(layout, causal, spec, taken, mesh2d):
    """q, k, v constrained along their sequence (sequence or context parallelism): causal attention,
    whose kernels do not split it, is left to XLA; attention with no mask is taken (its queries
    split, k and v gathered). Along the heads (tensor parallelism): taken. In either layout ([b, s,
    h, d] or [b, h, s, d]: the heads' dim is the layout's)."""
    rng = np.random.default_rng(8)
    q, k, v = (_normal(rng, (4, 16, 4, 16), jnp.bfloat16) for _ in range(3))
    attention = (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)) if layout == "bshd" \
        else _heads_first_attention

    def attend(q, k, v):
        q, k, v = (jax.lax.with_sharding_constraint(a, NamedSharding(mesh2d, spec)) for a in (q, k, v))
        return attention(q, k, v)
    report = xkern.explain(attend)(q, k, v)
    assert ("attention_fwd" in report.kernels) == taken
    seq = 1 if layout == "bshd" else 2
    assert taken or any(f"sharded along its dim {seq}" in d.reason for d in report.declined
                        if d.pattern.startswith("attention/"))
    np.testing.assert_allclose(np.asarray(jax.block_until_ready(xkern.jit(attend)(q, k, v)), np.float32),
                               np.asarray(attention(q, k, v), np.float32), rtol=3e-2, atol=3e-2)


def _context_parallel_cases(rng):
    """(name, attention of (q, k, v, extra), extra, extra's spec): non-causal attention, q, k and v
    [b, s, h, d] sharded along their sequence over "model" and their batch over "data"."""
    bias = _normal(rng, (4, 4, 16, 16))
    keep = jnp.asarray(rng.random((4, 4, 16, 16)) < 0.8, jnp.float32) / 0.8
    return [
        ("jax.nn, GQA", lambda q, k, v, n: xkern.optimize(jax.nn.dot_product_attention)(q, k, v), None, None),
        ("bias per example and head", lambda q, k, v, b: xkern.ops.attention(q, k, v, bias=b), bias,
         P("data", None, "model")),
        ("dropout multiplier, kv_lengths", lambda q, k, v, m: xkern.ops.attention(
            q, k, v, dropout_multiplier=m, kv_lengths=jnp.asarray([16, 9, 3, 16], jnp.int32)), keep, P("data")),
        ("by hand", lambda q, k, v, n: xkern.optimize(_repeated_kv_by_hand)(q, k, v), None, None),
    ]


def _repeated_kv_by_hand(q, k, v):
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype), v)


def _context_parallel_reference(name, q, k, v, extra):
    if name == "bias per example and head":
        return jax.nn.dot_product_attention(q, k, v, bias=extra.astype(q.dtype))
    if name == "dropout multiplier, kv_lengths":
        lengths = jnp.asarray([16, 9, 3, 16], jnp.int32)
        visible = jnp.arange(16) < lengths[:, None, None, None]
        k, v = (jnp.repeat(x, 2, axis=2).astype(jnp.float32) for x in (k, v))
        s = jnp.where(visible, jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k) / 4.0, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1) * extra, v).astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v)


@pytest.mark.parametrize("case", range(4), ids=[c[0] for c in _context_parallel_cases(np.random.default_rng(0))])
def test_attention_splits_its_queries_along_a_sharded_sequence(case, mesh2d):
    """Context parallelism, Auto axes: each device launches on its queries against every key (k and
    v gathered, as jax.jit gathers them; dk and dv summed across devices), where every device
    gathered q too and computed the whole attention. Values and gradients as on one device and as
    XLA's (float32: dk and dv are sums of each device's share, rounded to their dtype as jax.jit's
    are); outputs sharded as jax.jit's; no more gathers than its."""
    rng = np.random.default_rng(20 + case)
    name, f, extra, spec = _context_parallel_cases(rng)[case]
    q = _normal(rng, (4, 16, 4, 16))
    k, v = _normal(rng, (4, 16, 2, 16)), _normal(rng, (4, 16, 2, 16))
    sequence = NamedSharding(mesh2d, P("data", "model"))
    args = [jax.device_put(a, sequence) for a in (q, k, v)]
    extra = jax.device_put(extra, NamedSharding(mesh2d, spec)) if extra is not None else None
    run = lambda fn: jax.jit(_value_and_grads(lambda q, k, v: fn(q, k, v, extra)))
    ours, reference = run(f), run(lambda q, k, v, e: _context_parallel_reference(name, q, k, v, e))
    got, want = jax.block_until_ready(ours(*args)), jax.block_until_ready(reference(*args))
    one_device = jax.block_until_ready(run(f)(q, k, v))
    for g, w, o in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(one_device)):
        np.testing.assert_allclose(g, o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    assert got[0].sharding.spec == want[0].sharding.spec == P("data", "model"), name
    forward = lambda fn: jax.jit(lambda q, k, v: fn(q, k, v, extra)).lower(*args).compile().as_text()
    gathers = lambda fn: len(re.findall(r"all-gather(?:-start)?\(", forward(fn)))
    assert 0 < gathers(f) <= gathers(lambda q, k, v, e: _context_parallel_reference(name, q, k, v, e)), name
    assert "attention_fwd" in xkern.explain(lambda q, k, v: f(q, k, v, extra))(*args).kernels


def test_under_an_explicit_mesh_attention_of_queries_typed_sharded_along_the_sequence_is_taken():
    """q typed sharded along its sequence, k and v whole (the program jax accepts under Explicit
    axes): the kernels split the queries, and the outputs and gradients are typed as jax.jit's."""
    mesh = jax.make_mesh((2, 2), ("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rng = np.random.default_rng(30)
    q = _normal(rng, (2, 32, 4, 16))
    k, v = _normal(rng, (2, 32, 2, 16)), _normal(rng, (2, 32, 2, 16))
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=0.3)
    with jax.sharding.set_mesh(mesh):
        q = jax.device_put(q, NamedSharding(mesh, P("data", "seq")))
        k, v = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (k, v))
        assert xkern.explain(f)(q, k, v).kernels == ["attention_fwd"]
        got = jax.block_until_ready(jax.jit(_value_and_grads(xkern.optimize(f)))(q, k, v))
        want = jax.block_until_ready(jax.jit(_value_and_grads(f))(q, k, v))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
        assert g.sharding.spec == w.sharding.spec


def _rms_norm(x, s):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * s


@pytest.mark.parametrize("name, shape, spec, taken", [
    ("layer norm, sequence parallel", (4, 8, 32), P("data", "model"), True),
    ("rms norm per head, heads split", (4, 8, 4, 16), P("data", None, "model"), True),
    ("layer norm, features split", (4, 8, 32), P(None, None, "model"), False)])
def test_norms_split_along_the_sequence_or_heads(name, shape, spec, taken, mesh2d):
    """x [b, s, d] sharded along its sequence too (sequence parallelism), a per-head norm's
    [b, s, h, d] along its heads (tensor parallelism: QK-norm): the norm kernels split there as
    well, so no device gathers anything (the scale's gradient: partial sums, then one all-reduce),
    with jax.jit's values, gradients and shardings. Along the normalized dim: left to XLA."""
    rng = np.random.default_rng(9)
    x = jax.device_put(_normal(rng, shape), NamedSharding(mesh2d, spec))
    scale, bias = _normal(rng, shape[-1:]), _normal(rng, shape[-1:])
    norm = (lambda x, s, b: _rms_norm(x, s)) if "rms" in name else _layer_norm

    def f(x, s, b):
        return norm(jax.lax.with_sharding_constraint(x, NamedSharding(mesh2d, spec)), s, b)
    report = xkern.explain(f)(x, scale, bias)
    norms = [k for k in report.kernels if k.startswith(("layer_norm", "rms_norm"))]
    assert bool(norms) == taken, report
    if not taken:  # (the normalizing after XLA's statistics may still be a generated kernel: it
        # splits along the features; its values are checked below)
        assert any(f"sharded along its dim {len(shape) - 1}" in d.reason for d in report.declined)
    ours, theirs = jax.jit(_value_and_grads(xkern.optimize(f))), jax.jit(_value_and_grads(f))
    got, want = jax.block_until_ready(ours(x, scale, bias)), jax.block_until_ready(theirs(x, scale, bias))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.spec == w.sharding.spec, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)
    if not taken:
        return
    hlo = ours.lower(x, scale, bias).compile().as_text()
    assert not any(c in hlo for c in ("all-gather", "all-to-all", "collective-permute")), name


def _features_parallel_cases(rng):
    """(name, function, arguments, their specs, a kernel it must launch): activations whose features
    tensor parallelism shards over "model" (x @ w1, w1 sharded by column), the batch over "data"."""
    x, h = _normal(rng, (4, 6, 32)), _normal(rng, (4, 6, 64))
    w1, w3, b = _normal(rng, (32, 64)) / 6, _normal(rng, (32, 64)) / 6, _normal(rng, (64,))
    q = _normal(rng, (4, 6, 4, 16), jnp.bfloat16)
    features, by_column = P("data", None, "model"), P(None, "model")
    return [
        ("generated, elementwise", lambda h: jnp.tanh(h * 1.5) * h, (h,), (features,), "fused_"),
        ("generated, a bias along the features", lambda h, b: jax.nn.silu(h + b) * 2.0, (h, b),
         (features, P("model")), "fused_"),
        ("matmul with a generated epilogue", lambda x, w, b: jax.nn.gelu(x @ w + b), (x, w1, b),
         (P("data"), by_column, P("model")), "fused_"),
        ("swiglu of two projections", lambda x, w1, w3: jax.nn.silu(x @ w1) * (x @ w3), (x, w1, w3),
         (P("data"), by_column, by_column), "swiglu_"),
        ("rope, heads sharded", _rope, (q,), (features,), "rope_"),
        # (scaled so the sum is near 1, not 36: the loss's sin of a sum lost its float32 digits to the
        # order of the sum's terms, which XLA's compile options change)
        ("generated, a row sum over the features", lambda h: jnp.sum(jnp.exp(h * 0.5) * h * 0.03, -1), (h,),
         (features,), "fused_"),
        ("generated, a row max", lambda h: jnp.max(jnp.tanh(h) * 2.0, -1), (h,), (features,), "fused_"),
        ("generated, a row mean", lambda h: jnp.mean(jnp.tanh(h) * h, -1), (h,), (features,), "fused_"),
        ("generated, a row sum with keepdims", lambda h: jnp.sum(jnp.tanh(h) * h, -1, keepdims=True) * 2.0, (h,),
         (features,), "fused_"),
    ]


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("case", range(9), ids=[c[0] for c in _features_parallel_cases(np.random.default_rng(0))])
def test_kernels_split_along_features_as_tensor_parallelism_shards_them(case, axis_type):
    """Generated kernels, GLUs of two projections and rope split along the features (heads) too:
    each device launches on its examples and its features, so nothing is gathered (the launch ran
    whole on every device: an all-gather of the largest activation jax.jit lacks), with jax.jit's
    values, gradients, shardings and collectives. A generated row sum, max or mean reduces each
    device's features, then one all-reduce combines them, as jax.jit's."""
    rng = np.random.default_rng(30 + case)
    name, f, args, specs, kernel = _features_parallel_cases(rng)[case]
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
    with jax.set_mesh(mesh):
        sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        ours, theirs = jax.jit(_value_and_grads(xkern.optimize(f))), jax.jit(_value_and_grads(f))
        launched = kernel_names(jax.make_jaxpr(ours)(*sharded))
        got, want = jax.block_until_ready(ours(*sharded)), jax.block_until_ready(theirs(*sharded))
        hlo, xla_hlo = (fn.lower(*sharded).compile().as_text() for fn in (ours, theirs))
    assert any(k.startswith(kernel) for k in launched), launched
    tol = 3e-2 if any(a.dtype == jnp.bfloat16 for a in args) else 2e-5
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (name, g.sharding, w.sharding)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)
    assert [c for c in COLLECTIVES if c in hlo] == [c for c in COLLECTIVES if c in xla_hlo], name


_AFTER_A_REDUCTION = {
    "sqrt of a sum": lambda h: jnp.sqrt(jnp.sum(jnp.tanh(h) * h, -1)),
    "a max times a negative number": lambda h: jnp.max(jnp.tanh(h) * 3.0, -1) * -2.0,
    "x less its row max": lambda h: jnp.tanh(h - jnp.max(h, -1, keepdims=True)) * 2.0,
    "the sum of x less its row max": lambda h: jnp.sum(jnp.tanh(h - jnp.max(h, -1, keepdims=True)) * 2.0, -1),
    # (each device's share would be rounded to bfloat16 before their sum: rounded twice)
    "a bfloat16 mean": lambda h: jnp.mean(jnp.tanh(h).astype(jnp.bfloat16) * 2, -1),
    # (edge values, where a softmax written by hand, which the softmax kernels take, runs as XLA on
    # each share: a row's max of +inf, -inf along one device's share of a row, NaN; the shares' min)
    "a softmax by hand of inf, -inf and NaN": lambda h: _softmax_by_hand(_with_edge_values(h) * 2.0),
    "x plus its row min": lambda h: jnp.tanh(h + jnp.min(h * 3.0, -1, keepdims=True))}


def _with_edge_values(h):
    """h [4, 6, 64] with +inf at [0, 0, 3], -inf along [1, 2, :32] (one device's share of the row)
    and NaN at [2, 4, 40]: by where, as a scatter (.at[].set) would add XLA's own gathers."""
    b, s, c = (jnp.arange(n).reshape(shape) for n, shape in ((4, (4, 1, 1)), (6, (1, 6, 1)), (64, (64,))))
    h = jnp.where((b == 0) & (s == 0) & (c == 3), jnp.inf, h)
    h = jnp.where((b == 1) & (s == 2) & (c < 32), -jnp.inf, h)
    return jnp.where((b == 2) & (s == 4) & (c == 40), jnp.nan, h)


def _softmax_by_hand(x):
    e = jnp.exp(x - jnp.max(x, -1, keepdims=True))
    return e / jnp.sum(e, -1, keepdims=True)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("after", list(_AFTER_A_REDUCTION))
def test_a_value_computed_from_a_row_reduction_does_not_split_along_features(after, axis_type):
    """A generated group that computes from a row reduction inside it by more than a cast or a
    scale of a sum (a norm's sqrt; a max scaled by -2 is a min; x less its row max, full or summed):
    each device would reduce only its own columns, so the kernel does not split them. Typed sharded
    along them (Explicit axes), the group is left to XLA, saying so; on Auto axes, where XLA's
    propagation gives the launch such columns, it gives way to XLA on each device's share, every row
    reduction all-reduced (generated._on_shares), as jax.jit computes it: nothing is gathered (the
    kernel launched on the gathered rows until 2026-12). Values as jax.jit's either way."""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
    f = _AFTER_A_REDUCTION[after]
    with jax.set_mesh(mesh):
        h = jax.device_put(_normal(np.random.default_rng(40), (4, 6, 64)), NamedSharding(mesh, P("data", None, "model")))
        report = xkern.explain(f)(h)
        got, want = jax.block_until_ready((xkern.jit(f)(h), jax.jit(f)(h)))
        hlo = xkern.jit(f).lower(h).compile().as_text()
    if axis_type == "Explicit":
        assert report.kernels == [] and any("sharded along its dim 2" in d.reason for d in report.declined), report
    else:
        assert report.kernels, report
    assert "all-gather" not in hlo
    tol = 1e-2 if got.dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def _norms_over_features():
    """(name, loss of (x [4, 6, 64], r, x2 [24, 64], scale, bias), norm = xkern.ops' or its
    definition, or None for a norm by hand that the patterns take)."""
    from xkern.kernels.norms import reference
    ln = lambda x, s, b: _layer_norm(x, s, b)
    return [
        ("an RMS norm by hand", lambda x, r, x2, s, b, norm: jnp.sum(jnp.sin(_rms_norm(x, s)))),
        ("a layer norm by hand", lambda x, r, x2, s, b, norm: jnp.sum(jnp.sin(ln(x, s, b)))),
        ("a layer norm by hand of rows [24, 64]", lambda x, r, x2, s, b, norm: jnp.sum(jnp.sin(ln(x2, s, b)))),
        ("xkern.ops.layer_norm with a residual", lambda x, r, x2, s, b, norm: (
            lambda y, h: jnp.sum(jnp.sin(y)) + jnp.sum(h * h))(*norm(x, s, b, residual=r))),
        ("xkern.ops.rms_norm of bfloat16", lambda x, r, x2, s, b, norm: jnp.sum(
            jnp.sin(norm(x.astype(jnp.bfloat16), s).astype(jnp.float32)))),
    ], {"layer_norm": lambda x, s, b, residual: reference(x, s, b, 1e-6, residual, False),
        "rms_norm": lambda x, s: reference(x, s, None, 1e-6, None, True)}


@pytest.mark.parametrize("case", range(5), ids=[c[0] for c in _norms_over_features()[0]])
def test_norms_over_features_xla_shards_run_as_xla_on_each_share(case, mesh2d):
    """Features sharded by XLA's propagation alone (no constraint): the norm kernels read whole
    rows, so there XLA computes each device's share, mean and variance all-reduced (norms
    ._features_split), as jax.jit does, where the launch gathered every row and the scale first.
    Values and gradients as jax.jit's (x, the residual, the scale, the bias), no all-gather."""
    cases, references = _norms_over_features()
    name, loss = cases[case]
    rng = np.random.default_rng(60 + case)
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh2d, P(*spec)))
    args = (put(_normal(rng, (4, 6, 64)), "data", None, "model"), put(_normal(rng, (4, 6, 64)), "data", None, "model"),
            put(_normal(rng, (24, 64)), "data", "model"), put(1 + 0.1 * _normal(rng, (64,)), "model"),
            put(0.1 * _normal(rng, (64,)), "model"))
    grads = lambda norm: jax.value_and_grad(lambda *a: loss(*a, norm), argnums=range(5))
    if name.startswith("xkern.ops"):
        op = name.split(".")[2].split(" ")[0]
        ours, theirs = jax.jit(grads(getattr(xkern.ops, op))), jax.jit(grads(references[op]))
    else:
        ours, theirs = xkern.jit(grads(None)), jax.jit(grads(None))
    assert any("norm" in k for k in kernel_names(jax.make_jaxpr(ours)(*args))), name
    got, want = jax.block_until_ready(ours(*args)), jax.block_until_ready(theirs(*args))
    tol = 3e-2 if "bfloat16" in name else 2e-5
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)
    assert "all-gather" not in ours.lower(*args).compile().as_text(), name


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "standardize", "layer norm", "rms norm"])
def test_row_ops_over_sharded_features_keep_jax_jits_values(name, axis_type):
    """A softmax or norm over features the program shards (typed so, or constrained to be): the
    patterns decline, and what xkern still takes of the program (a generated kernel of the part
    after XLA's statistics) keeps jax.jit's values and gradients. (A generated group that reduced
    only its own columns for the statistics gave wrong values at 1072a31.)"""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
    spec = P("data", None, "model")
    op = {"softmax": lambda h: jax.nn.softmax(h, -1), "log_softmax": lambda h: jax.nn.log_softmax(h, -1),
          "standardize": lambda h: jax.nn.standardize(h, -1), "layer norm": lambda h: _layer_norm(h, 1.5, 0.5),
          "rms norm": lambda h: _rms_norm(h, 1.5)}[name]
    f = lambda h: op(jax.lax.with_sharding_constraint(h, spec) if axis_type == "Auto" else h)
    with jax.set_mesh(mesh):
        h = jax.device_put(_normal(np.random.default_rng(42), (4, 6, 64)), NamedSharding(mesh, spec))
        ours, theirs = jax.jit(_value_and_grads(xkern.optimize(f))), jax.jit(_value_and_grads(f))
        got, want = jax.block_until_ready((ours(h), theirs(h)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("spec", [P("data", None, "model"), P(None, "model")], ids=["sequence", "heads"])
def test_under_an_explicit_mesh_rope_over_a_sharded_sequence_is_left_to_xla(spec):
    """x [b, h, s, d] (the tables' positions along dim 2) typed sharded along its sequence or its
    heads: the kernels' view [b * h, s, 1, d] merges the heads into the batch (the dim before the
    last is heads only in the [b, s, h, d] layout), so the match is left to XLA, saying so; values,
    gradients and shardings as jax.jit's."""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    angles = jnp.arange(8, dtype=jnp.float32)[:, None] * 0.1 ** jnp.arange(8)
    angles = jnp.concatenate([angles, angles], -1)  # [s, d]: x's positions along its dim 2
    f = jax.grad(lambda x: jnp.sum(jnp.sin(rope_rules.rotate_half_form(x, jnp.cos(angles), jnp.sin(angles)))))
    with jax.set_mesh(mesh):
        x = jax.device_put(_normal(np.random.default_rng(41), (4, 4, 8, 16)), NamedSharding(mesh, spec))
        report = xkern.explain(f)(x)
        got, want = jax.block_until_ready((xkern.jit(f)(x), jax.jit(f)(x)))
    dim = [d for d, entry in enumerate(spec) if entry == "model"][0]
    assert any(f"typed sharded along its dim {dim}, which is not its heads" in d.reason for d in report.declined), \
        report
    # (what is left of the program after the declined rope, XLA's, may be generated kernels: they
    # split along any of the rows' dims, gathering nothing)
    assert all(k.startswith("fused_") for k in report.kernels), report
    with jax.set_mesh(mesh):
        assert "all-gather" not in jax.jit(xkern.optimize(f)).lower(x).compile().as_text()
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_under_an_explicit_mesh_a_matmul_epilogue_splits_along_a_sharded_sequence():
    """x @ w + b, then gelu, with x [b, s, k] typed sharded along its sequence (sequence
    parallelism): the matmul kernel's views keep the rows' dims, so each device launches on its
    share of the sequence (w whole on each), gathering nothing; values, gradients and shardings as
    jax.jit's."""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rng = np.random.default_rng(43)
    f = lambda x, w, b: jax.nn.gelu(x @ w + b)
    with jax.set_mesh(mesh):
        x = jax.device_put(_normal(rng, (4, 6, 32)), NamedSharding(mesh, P(None, "data")))
        w, b = (jax.device_put(a, NamedSharding(mesh, P())) for a in (_normal(rng, (32, 16)) / 6, _normal(rng, (16,))))
        report = xkern.explain(f)(x, w, b)
        ours, theirs = jax.jit(_value_and_grads(xkern.optimize(f))), jax.jit(_value_and_grads(f))
        hlo = ours.lower(x, w, b).compile().as_text()
        got, want = jax.block_until_ready((ours(x, w, b), theirs(x, w, b)))
    assert report.kernels and all(k.startswith("fused_") for k in report.kernels), report
    assert "all-gather" not in hlo
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


_ROWS_DIM_CASES = {  # (function, x's shape, x's spec, its kernels' prefix): a dim of the rows other than the first sharded
    "heads, elementwise": (lambda q: jnp.tanh(q * 1.5) * q, (4, 6, 4, 16), P("data", None, "model"), "fused_"),
    "heads, a row sum": (lambda q: jnp.sum(jnp.exp(q * 0.5) * q, -1), (4, 6, 4, 16), P("data", None, "model"),
                         "fused_"),
    "heads, x less its row max": (lambda q: jnp.tanh(q - jnp.max(q, -1, keepdims=True)) * 2.0, (4, 6, 4, 16),
                                  P("data", None, "model"), "fused_"),
    "sequence under a batch": (lambda h: jnp.mean(jnp.tanh(h) * h, -1, keepdims=True) * h, (4, 6, 32),
                               P("data", "model"), "fused_"),
    "sequence alone, bfloat16": (lambda h: jnp.tanh(h * 2.0) * h + 1.0, (3, 8, 32), P(None, "model"), "fused_"),
    # two of the rows' dims at once (context and tensor parallelism: a sequence and heads)
    "sequence and heads, a row sum": (lambda q: jnp.sum(jnp.tanh(q * 1.5) * q, -1), (4, 6, 4, 16),
                                      P(None, "data", "model"), "fused_"),
    "softmax, heads and queries": (lambda s: jax.nn.softmax(s, -1), (2, 4, 8, 16), P(None, "data", "model"),
                                   "softmax_"),
    # attention's probabilities by hand, [b, h, q, k], the heads sharded; a log_softmax over a sequence
    "softmax, heads": (lambda s: jax.nn.softmax(s * 0.5, -1), (4, 4, 8, 16), P("data", "model"), "softmax_"),
    "softmax, queries alone": (lambda s: jax.nn.softmax(s, -1), (2, 4, 8, 16), P(None, None, "model"), "softmax_"),
    "log_softmax, sequence, bfloat16": (lambda x: jax.nn.log_softmax(x, -1), (4, 8, 32), P("data", "model"),
                                        "log_softmax_"),
}


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("case", list(_ROWS_DIM_CASES))
def test_row_kernels_split_along_any_dim_of_their_rows(case, axis_type):
    """A generated group or a softmax over [batch, seq, heads, head_dim] or [batch, heads, q, k] with
    the heads sharded (tensor parallelism), or over [batch, seq, hidden] with the sequence sharded
    (sequence parallelism), or two such dims at once: its rows are independent, and the kernels'
    views keep their dims, so each device launches on its share. Until 2026-12 the views merged the
    rows into one dim, which could not stay sharded along an inner one: on Auto axes every device
    gathered the whole array; typed (Explicit) the match was left to XLA. (Two inner dims at once:
    one was gathered, or the match left to XLA.) Values, gradients, shardings and collectives as
    jax.jit's."""
    f, shape, spec, prefix = _ROWS_DIM_CASES[case]
    dtype = jnp.bfloat16 if "bfloat16" in case else jnp.float32
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
    with jax.set_mesh(mesh):
        x = jax.device_put(_normal(np.random.default_rng(44), shape, dtype), NamedSharding(mesh, spec))
        ours, theirs = jax.jit(_value_and_grads(xkern.optimize(f))), jax.jit(_value_and_grads(f))
        launched = kernel_names(jax.make_jaxpr(ours)(x))
        got, want = jax.block_until_ready((ours(x), theirs(x)))
        hlo, xla_hlo = (fn.lower(x).compile().as_text() for fn in (ours, theirs))
    assert launched and all(k.startswith(prefix) for k in launched), launched
    assert [c for c in COLLECTIVES if c in hlo] == [c for c in COLLECTIVES if c in xla_hlo], (hlo, xla_hlo)
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)


_NORM_ROWS_DIM_CASES = {  # (function, its arrays' shapes, x's (and r's) spec): norms over [b, s, h, d] or [b, s, d]
    "layer norm, sequence under a batch": (_layer_norm, [(4, 6, 2, 16), (16,), (16,)], P("data", "model")),
    "layer norm, sequence alone": (_layer_norm, [(2, 6, 2, 16), (16,), (16,)], P(None, "model")),
    "rms norm of a sum, heads": (_rms_of_sum, [(2, 3, 4, 16), (2, 3, 4, 16), (16,)], P("data", None, "model")),
    "rms norm of a sum, a sequence of 3-D rows": (_rms_of_sum, [(3, 4, 16), (3, 4, 16), (16,)], P(None, "data")),
    "layer norm, sequence and heads": (_layer_norm, [(2, 4, 6, 16), (16,), (16,)], P(None, "data", "model")),
}


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("case", list(_NORM_ROWS_DIM_CASES))
def test_norms_split_along_any_dim_of_their_rows(case, axis_type):
    """A norm over [b, s, h, d] (per-head norms: qk-norm) or [b, s, d] with the sequence sharded,
    under a batch or alone, or the heads, or both: the launch's view keeps x's leading dims, so each device
    normalizes its rows, the scale's and bias's partial sums added across every device. Until
    2026-12 the view merged b and s into one dim, and a sequence sharded under a batch was gathered
    (Auto) or left to XLA (Explicit). Values, every gradient, shardings and collectives as jax.jit's."""
    f, shapes, spec = _NORM_ROWS_DIM_CASES[case]
    rng = np.random.default_rng(47)
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
    with jax.set_mesh(mesh):
        args = [jax.device_put(_normal(rng, shape), NamedSharding(mesh, spec if len(shape) > 1 else P()))
                for shape in shapes]
        ours, theirs = jax.jit(_value_and_grads(xkern.optimize(f))), jax.jit(_value_and_grads(f))
        launched = kernel_names(jax.make_jaxpr(ours)(*args))
        got, want = jax.block_until_ready((ours(*args), theirs(*args)))
        hlo, xla_hlo = (fn.lower(*args).compile().as_text() for fn in (ours, theirs))
    assert launched and all("_norm_" in k for k in launched), launched
    assert [c for c in COLLECTIVES if c in hlo] == [c for c in COLLECTIVES if c in xla_hlo], (hlo, xla_hlo)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_under_an_explicit_mesh_a_generated_group_sharded_along_rows_and_columns_is_left_to_xla():
    """The kernels split the rows' dims, or the first and the columns, but not another of the rows'
    and the columns at once: typed so (a sequence and the features, the batch whole), the group is
    left to XLA, saying so, where launching it would gather one of them; values as jax.jit's."""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    f = lambda q: jnp.sum(jnp.tanh(q * 1.5) * q, -1)
    with jax.set_mesh(mesh):
        q = jax.device_put(_normal(np.random.default_rng(45), (4, 6, 16)), NamedSharding(mesh, P(None, "data", "model")))
        report = xkern.explain(f)(q)
        got, want = jax.block_until_ready((xkern.jit(f)(q), jax.jit(f)(q)))
    assert report.kernels == [] and any("sharded along its dims [1, 2]" in d.reason and "one at a time" in d.reason
                                        for d in report.declined), report
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


_SEQUENCE_LOSSES = {  # a loss over logits [b, s, V] and labels [b, s], their sequence sharded
    "integer labels, a mean": lambda lg, lb: optax.softmax_cross_entropy_with_integer_labels(lg, lb).mean(),
    "one-hot targets, a sum": lambda lg, lb: optax.softmax_cross_entropy(lg, jax.nn.one_hot(lb, lg.shape[-1])).sum(),
    "each token's loss": lambda lg, lb: optax.softmax_cross_entropy_with_integer_labels(lg, lb) * 2.0,
}


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("spec", [P("data", "model"), P(None, "model")], ids=["batch and sequence", "sequence"])
@pytest.mark.parametrize("case", list(_SEQUENCE_LOSSES))
def test_a_loss_over_a_sharded_sequence_splits_along_it(case, spec, axis_type):
    """Cross-entropy over logits whose sequence is sharded (sequence or context parallelism, the
    batch sharded too or not): the kernels' views keep the rows' dims, so each device launches on
    its tokens. Until 2026-12 every device gathered the whole logits first (Auto axes), or the loss
    was left to XLA (Explicit). Values, gradients, shardings and collectives as jax.jit's."""
    f = _SEQUENCE_LOSSES[case]
    rng = np.random.default_rng(46)
    logits, labels = _normal(rng, (4, 6, 40)), jnp.asarray(rng.integers(0, 40, (4, 6)), jnp.int32)
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
    with jax.set_mesh(mesh):
        lg, lb = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (logits, labels))
        ours, theirs = jax.jit(_value_and_grads(xkern.optimize(f))), jax.jit(_value_and_grads(f))
        launched = kernel_names(jax.make_jaxpr(ours)(lg, lb))
        got, want = jax.block_until_ready((ours(lg, lb), theirs(lg, lb)))
        hlo, xla_hlo = (fn.lower(lg, lb).compile().as_text() for fn in (ours, theirs))
    assert launched and all(k.startswith("cross_entropy_") for k in launched), launched
    assert [c for c in COLLECTIVES if c in hlo] == [c for c in COLLECTIVES if c in xla_hlo], (hlo, xla_hlo)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
        # (a sum's sine: float32 sums over devices in another order, at a total near 90)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
