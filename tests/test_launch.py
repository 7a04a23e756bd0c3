"""The kernel-launch layer: argument order, outputs, aliases, zeroed and poisoned outputs, backends,
batching, and the jaxpr it leaves behind. Kernels run as this process runs them: through Triton's
interpreter on a CPU, compiled on a GPU (XKERN_BACKEND=triton)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xkern.kernels import launch as L

import triton  # noqa: E402  (after xkern: launch fixes Triton's mode)
import triton.language as tl

BLOCK = 16
CFG = L.Config.of(BLOCK=BLOCK)
BACKEND = "interpret" if L.INTERPRET else "triton"


@triton.jit
def _axpy(x_ptr, y_ptr, a, n, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, a * x + y, mask=mask)


@triton.jit
def _neg_and_double(x_ptr, n, neg_ptr, double_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(neg_ptr + offs, -x, mask=mask)
    tl.store(double_ptr + offs, 2 * x, mask=mask)


@triton.jit
def _first_half(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n // 2), mask=offs < n // 2)


@triton.jit
def _atomic_total(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(out_ptr, tl.sum(tl.load(x_ptr + offs, mask=offs < n, other=0.0)))


@triton.jit
def _squared(x):
    return x * x


@triton.jit
def _sum_of_squares(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(_squared(x)) + tl.sum(_squared(-x)))


@pytest.mark.skipif(not L.INTERPRET, reason="Triton's interpreter")
def test_interpreted_helpers_run_with_the_launchs_language_patches_and_none_outlive_it(rng):
    """launch.py lets a kernel's @triton.jit helpers use the patches of triton.language that the
    launch made (Triton re-made them at every helper call); after the launch, and after one that
    failed, triton.language is as it was."""
    before = {name: getattr(tl, name) for name in ("load", "store", "sum", "exp", "arange")}
    x = jnp.asarray(rng.standard_normal(40), jnp.float32)
    out = L.launch(_sum_of_squares, x, x.size, kernel="sum_of_squares", out_shapes=[jax.ShapeDtypeStruct((3,), x.dtype)],
                   grid=(3,), config=CFG, backend=BACKEND)[0]
    padded = np.pad(np.asarray(x, np.float64), (0, 8)).reshape(3, BLOCK)
    np.testing.assert_allclose(out, 2 * (padded ** 2).sum(1), rtol=1e-5)
    assert {name: getattr(tl, name) for name in before} == before
    with pytest.raises(Exception):
        L.launch(_sum_of_squares, x, x.size, kernel="sum_of_squares", out_shapes=[jax.ShapeDtypeStruct((3,), x.dtype)],
                 grid=(3,), config=L.Config.of(BLOCK=12), backend=BACKEND)[0].block_until_ready()  # arange of 12
    assert {name: getattr(tl, name) for name in before} == before
    again = L.launch(_sum_of_squares, -x, x.size, kernel="sum_of_squares",
                     out_shapes=[jax.ShapeDtypeStruct((3,), x.dtype)], grid=(3,), config=CFG, backend=BACKEND)[0]
    np.testing.assert_allclose(again, out, rtol=1e-6)


def axpy(x, y, a):
    n = x.size
    return L.launch(_axpy, x, y, a, n, kernel="axpy", out_shapes=[x], grid=(L.cdiv(n, BLOCK),),
                    config=CFG, backend=BACKEND)[0]


def test_scalars_and_arrays_reach_the_kernel_in_call_order(rng):
    x, y = (jnp.asarray(rng.standard_normal(37), jnp.float32) for _ in range(2))
    np.testing.assert_allclose(axpy(x, y, 2.5), 2.5 * x + y, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(axpy, static_argnums=2)(x, y, -1.0), y - x, rtol=1e-6)


def test_each_launch_is_one_named_xkern_equation():
    x = jnp.ones(20)
    jaxpr = jax.make_jaxpr(lambda x: axpy(axpy(x, x, 1.0), x, 2.0))(x)
    eqns = [e for e in jaxpr.jaxpr.eqns if e.primitive.name.startswith("xkern")]
    assert [e.params["kernel"] for e in eqns] == ["axpy", "axpy"]
    assert eqns[0].params["grid"] == (2,) and eqns[0].params["scalars"] == ((2, 1.0), (3, 20))


def test_kernel_names_looks_inside_sub_jaxprs():
    def f(x, p):
        inner = jax.jit(lambda x: axpy(x, x, 3.0))
        return jax.lax.cond(p, inner, lambda x: x, x)
    assert L.kernel_names(jax.make_jaxpr(f)(jnp.ones(4), True)) == ["axpy"]


def test_several_outputs(rng):
    x = jnp.asarray(rng.standard_normal((3, 11)), jnp.float32)
    neg, double = L.launch(_neg_and_double, x, x.size, kernel="neg_and_double", out_shapes=[x, x],
                           grid=(3,), config=CFG, backend=BACKEND)
    np.testing.assert_array_equal(neg, -x)
    np.testing.assert_array_equal(double, 2 * x)


def test_alias_writes_over_the_input_and_keeps_untouched_elements(rng):
    x = jnp.asarray(rng.standard_normal(40), jnp.float32)
    out = jax.jit(lambda x: L.launch(_first_half, x, x.size, kernel="first_half", out_shapes=[x],
                                     grid=(3,), config=CFG, backend=BACKEND,
                                     aliases={0: 0})[0])(x)
    np.testing.assert_array_equal(out, x)  # the second half was never written: it is the input's


@pytest.mark.skipif(not L.INTERPRET, reason="the interpreter's own outputs (a GPU's are uninitialized memory)")
def test_unwritten_outputs_are_poisoned_not_zero(rng):
    x = jnp.asarray(rng.uniform(1, 2, 40), jnp.float32)
    out = L.launch(_first_half, x, x.size, kernel="first_half", out_shapes=[x], grid=(3,),
                   config=CFG, backend=BACKEND)[0]
    np.testing.assert_array_equal(out[:20], x[:20])
    assert np.isnan(np.asarray(out[20:])).all()


def test_zeroed_output_accumulates_from_zero(rng):
    x = jnp.asarray(rng.standard_normal(100), jnp.float32)
    total = L.launch(_atomic_total, x, x.size, kernel="atomic_total",
                     out_shapes=[jax.ShapeDtypeStruct((1,), jnp.float32)], grid=(7,), config=CFG,
                     backend=BACKEND, zeroed=[0])[0]
    np.testing.assert_allclose(total[0], np.sum(np.asarray(x, np.float64)), rtol=1e-5)


def test_bad_launches_raise_naming_the_problem():
    x = jnp.ones(8)
    with pytest.raises(ValueError, match="grid"):
        L.launch(_axpy, x, x, 1.0, 8, kernel="axpy", out_shapes=[x], grid=(0,), config=CFG,
                 backend=BACKEND)
    with pytest.raises(ValueError, match="aliased input"):
        L.launch(_axpy, x, x, 1.0, 8, kernel="axpy", out_shapes=[jnp.ones(9)], grid=(1,),
                 config=CFG, backend=BACKEND, aliases={0: 0})
    with pytest.raises(ValueError, match="backend"):
        L.launch(_axpy, x, x, 1.0, 8, kernel="axpy", out_shapes=[x], grid=(1,), config=CFG,
                 backend="xla")
    with pytest.raises(ValueError, match="num_warps"):
        L.Config.of(num_warps=3)


def test_backend_resolution(monkeypatch):
    monkeypatch.delenv("XKERN_BACKEND", raising=False)
    assert L.resolve_backend() == BACKEND  # the platform's: interpret without a GPU
    assert L.resolve_backend("xla") == "xla"
    with pytest.raises(ValueError, match="backend must be one of"):
        L.resolve_backend("cuda")
    other = "triton" if L.INTERPRET else "interpret"  # the mode Triton was not fixed in
    with pytest.raises(ValueError, match="needs a CUDA or ROCm GPU" if L.INTERPRET else "set XKERN_BACKEND"):
        L.resolve_backend(other)
    with pytest.raises(ValueError, match="needs"):  # an internal launch checks it too
        L.launch(_axpy, jnp.ones(4), jnp.ones(4), 1.0, 4, kernel="axpy", out_shapes=[jnp.ones(4)], grid=(1,),
                 config=CFG, backend=other)
    monkeypatch.setenv("XKERN_BACKEND", "xla")
    assert L.resolve_backend() == "xla" and L.resolve_backend(BACKEND) == BACKEND
    monkeypatch.setenv("XKERN_BACKEND", "fast")
    with pytest.raises(ValueError, match="XKERN_BACKEND"):
        L.resolve_backend()


def test_vmap_needs_a_batching_rule_and_uses_it(rng):
    x = jnp.asarray(rng.standard_normal((3, 10)), jnp.float32)
    neg = lambda x: L.launch(_neg_and_double, x, x.size, kernel="neg_only", out_shapes=[x, x],
                             grid=(1,), config=CFG, backend=BACKEND)[0]
    with pytest.raises(NotImplementedError, match="neg_only"):
        jax.vmap(neg)(x)
    rows = lambda x: L.launch(_neg_and_double, x, x.size, kernel="neg_rows", out_shapes=[x, x],
                              grid=(L.cdiv(x.size, BLOCK),), config=CFG, backend=BACKEND)
    L.def_batching("neg_rows", L.batch_rows(lambda x, **_: rows(x)))
    out = jax.vmap(lambda x: rows(x)[1], in_axes=1, out_axes=1)(x)
    np.testing.assert_array_equal(out, 2 * x)


def test_forward_mode_is_refused_with_a_pointer_to_grad():
    with pytest.raises(NotImplementedError, match="custom_vjp"):
        jax.jvp(lambda x: axpy(x, x, 1.0), (jnp.ones(4),), (jnp.ones(4),))


def test_kernels_are_built_as_triton_compiled_them():
    """jax_triton 0.3.1 builds jaxlib's TritonKernel with the warp count asked and no global scratch:
    a warp-specialized kernel (4 warps asked, 12 compiled) then fails to launch, and one that builds
    TMA descriptors on the device gets a null scratch buffer. xkern's wrapper passes what the last
    compile recorded, once, and only the scratch arguments jaxlib accepts."""
    import threading

    class Lib:
        def TritonKernel(self, *args, **kwargs):  # noqa: N802
            return args, kwargs

        other = "delegated"

    compiled = threading.local()
    lib = L._KernelsAsCompiled(Lib(), compiled, with_scratch=True)
    compiled.metadata = {"num_warps": 12, "global_scratch_size": 384, "global_scratch_align": 128}
    args, kwargs = lib.TritonKernel("k", 4, 1, 1024, "ptx", "ttir", 90)
    assert args == ("k", 12, 1, 1024, "ptx", "ttir", 90)
    assert kwargs == {"global_scratch_size": 384, "global_scratch_align": 128}
    assert lib.TritonKernel("k", 4, 1, 0, "ptx", "ttir", 90) == (("k", 4, 1, 0, "ptx", "ttir", 90), {})
    compiled.metadata = {"num_warps": 8, "global_scratch_size": 0}
    assert lib.TritonKernel("k", 8, 1, 0, "p", "t", 90) == (("k", 8, 1, 0, "p", "t", 90), {})
    old = L._KernelsAsCompiled(Lib(), compiled, with_scratch=False)
    compiled.metadata = {"num_warps": 4, "global_scratch_size": 256, "global_scratch_align": 1}
    assert old.TritonKernel("k", 4, 1, 0, "p", "t", 90) == (("k", 4, 1, 0, "p", "t", 90), {})
    assert lib.other == "delegated"


# Run by the test below in a process of its own that compiles (in the interpreter's, Triton's own
# library functions, which Gluon calls, are interpreted ones).
_GLUON_BUILD = """
import re

from triton._C import libtriton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
import triton.compiler.code_generator as code_gen

from xkern.kernels import launch as L
from xkern.kernels import attention_hopper as H

backend = make_backend(GPUTarget("cuda", 90, 32))
options = backend.parse_options({"num_warps": 4, "num_stages": 2, "num_ctas": 1, "optimize_epilogue": False,
                                 "debug": False, "enable_fp_fusion": True})  # as jax_triton passes them
signature = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "sink_ptr": "*fp32", "sq": "i32",
             "sk": "i32", "o_ptr": "*bf16", "lse_ptr": "*fp32"}
constants = {**dict(H.config().meta), "QK_SCALE": 0.127, "HEADS": 8, "KV_HEADS": 2, "D": 128, "CAUSAL": True,
             "HAS_SINK": False}
signature.update({name: "constexpr" for name in constants})
attrs = {(i,): backend.parse_attr("D") for i, t in enumerate(signature.values()) if t.startswith("*")}
context = libtriton.ir.context()
libtriton.ir.load_dialects(context)
backend.load_dialects(context)
module = L._GluonAwareCodeGen(code_gen, lambda: 90).ast_to_ttir(
    H.fwd, ASTSource(H.fwd, constexprs=constants, signature=signature, attrs=attrs), options=options,
    codegen_fns=backend.get_codegen_implementation(options), context=context, module_map=backend.get_module_map())
assert L._is_gluon_module(module)
recording, metadata = L._RecordingBackend(backend), {}
ttgir = recording.make_ttgir(recording.make_ttir(module, metadata, options, 90), metadata, options, 90)
ptx = backend.make_ptx(backend.make_llir(ttgir, metadata, options, 90), metadata, options, 90)
assert recording.metadata is metadata and metadata["num_warps"] == 12, metadata["num_warps"]
assert metadata["global_scratch_size"] == 3 * 128  # three TMA descriptors built on the device
assert ".maxnreg 168" in ptx and re.search(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+240;", ptx)
assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
# exactly what Triton's own compile builds for the kernel (its Gluon passes, not the TTIR ones)
import triton
from triton.experimental.gluon._runtime import GluonASTSource

reference = triton.compile(GluonASTSource(H.fwd, signature, constants, attrs), target=backend.target,
                           options={"num_warps": 4, "num_stages": 2, "enable_fp_fusion": True, "maxnreg": 168})
assert ptx == reference.asm["ptx"]
plain = libtriton.ir.builder(context).create_module()  # Triton's TTIR carries no warp count yet
assert not L._is_gluon_module(plain)
print("built")
"""


def test_gluon_kernels_build_through_jax_tritons_compile_steps():
    """jax_triton 0.3.1 knows only Triton's front end. launch.py redirects the two steps of its
    compile that see the language (building the IR, and the passes to TTGIR) for Gluon kernels:
    the attention forward for Hopper (attention_hopper.fwd) goes, by jax_triton's own sequence of
    calls, to sm_90 PTX with its three partitions (4 warps asked, 12 compiled: two consumer
    warpgroups and the loader's warp), its register cap and the rebalancing between partitions."""
    import os
    import subprocess
    import sys
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as cache:  # (a cached build would name the paths it was built from)
        run = subprocess.run([sys.executable, "-c", _GLUON_BUILD], capture_output=True, text=True, timeout=300,
                             env={**env, "XKERN_BACKEND": "triton", "TRITON_CACHE_DIR": cache})
    assert run.returncode == 0 and run.stdout.strip().endswith("built"), run.stderr[-3000:]
