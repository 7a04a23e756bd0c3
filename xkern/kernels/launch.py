"""The one place that launches a Triton kernel from JAX.

Every launch is one equation of the primitive `xkern_kernel`, on every backend, with the kernel's name
in its `kernel` param, so `jax.make_jaxpr` shows (and tests count) each kernel a program launches.

Backends:
  triton     CUDA or ROCm: `jax_triton.triton_call`, imported lazily and only here (it cannot be
             imported with a CPU-only jaxlib).
  interpret  the same kernel source through Triton's interpreter, inside a host callback, on numpy
             buffers (no torch). Slow and exact: it is what makes every kernel testable without a GPU.
  xla        no kernels at all: each op falls back to its jax.numpy definition (ops handle it).

Triton decides between compiling and interpreting when a kernel is *defined* (`TRITON_INTERPRET` is
read by `@triton.jit`), so the mode is fixed when this module is imported, before any kernel module:
interpret when `XKERN_BACKEND=interpret` or when jax has no GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import os
import threading
from typing import Any, Sequence

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from xkern import _compat

BACKENDS = ("triton", "interpret", "xla")
ENV_VAR = "XKERN_BACKEND"


# --------------------------------------------------------------------------------------------------
# Backend selection
# --------------------------------------------------------------------------------------------------

def _backend_from_env() -> str | None:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value and value not in BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(BACKENDS)}; got {value!r}")
    return value or None


def platform_backend() -> str:
    """The backend jax's default platform calls for: kernels on a GPU, the interpreter on CPU."""
    return "interpret" if jax.default_backend() == "cpu" else "triton"


def _init_triton_mode() -> bool:
    """Choose, before any kernel is defined, whether Triton compiles or interprets kernels."""
    interpret = (_backend_from_env() or platform_backend()) == "interpret"
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    return interpret


INTERPRET = _init_triton_mode()


def _interpreter_indexes_numpy_scalars() -> None:
    """Triton before 3.9 turns a scalar tensor into a Python int (a loop bound, an index) with
    `int(array)`, which NumPy >= 2.4 refuses for the interpreter's one-element scalars; 3.9
    squeezes first. Give the older interpreter 3.9's conversion, so both run every kernel."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "squeezes_index", False):
        return

    def patch_tensor_squeezing_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_tensor_squeezing_index.squeezes_index = True
    interpreter._patch_lang_tensor = patch_tensor_squeezing_index


@functools.lru_cache(maxsize=None)
def _language_modules(fn) -> frozenset[int]:
    """The triton.language modules a kernel's globals name (those the interpreter patches). Asked
    at every helper call of an interpreted kernel, so kept per function (its module's globals name
    the same modules for its life)."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def _interpreter_patches_the_language_once_per_launch() -> None:
    """Triton's interpreter (3.6-3.9) patches triton.language (every builtin, found through
    `inspect.getmembers`) when a launch starts, and again at every call of a `@triton.jit` helper
    inside the kernel: a tenth of an interpreted attention launch. The launch's patches stay in
    place until it ends (launches are serialized by _INTERPRETER_LOCK), so a helper whose modules
    the launch already patched runs with them."""
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or getattr(patch_lang, "once_per_launch", False):
        return
    launch_patched = []  # the modules the running launch patched; empty between launches

    class NothingToRestore:
        def restore(self):
            pass

    def patch_lang_once(fn):
        modules = _language_modules(fn)
        if launch_patched and modules <= launch_patched[0]:
            return NothingToRestore()  # a helper called inside the launch
        scope = patch_lang(fn)
        if launch_patched:  # a helper naming other modules: patched as Triton does (not restored)
            return scope
        launch_patched.append(modules)
        restore = scope.restore

        def restore_and_end_the_launch():
            launch_patched.clear()
            restore()

        scope.restore = restore_and_end_the_launch
        return scope

    patch_lang_once.once_per_launch = True
    interpreter._patch_lang = patch_lang_once


if INTERPRET:
    _interpreter_indexes_numpy_scalars()
    _interpreter_patches_the_language_once_per_launch()


def resolve_backend(backend: str | None = None) -> str:
    """The backend an op runs on: the `backend` argument, else `XKERN_BACKEND`, else the platform's."""
    chosen = backend or _backend_from_env() or platform_backend()
    if chosen not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or None; got {backend!r}")
    if chosen == "interpret" and not INTERPRET:
        raise ValueError(
            "backend='interpret' needs Triton's interpreter, which is chosen when xkern is imported: "
            f"set {ENV_VAR}=interpret before importing xkern")
    if chosen == "triton" and INTERPRET:
        raise ValueError(
            "backend='triton' needs a CUDA or ROCm GPU, but this process runs Triton's interpreter "
            f"(jax found no GPU when xkern was imported, or {ENV_VAR}=interpret); "
            "use backend='interpret' or 'xla'")
    return chosen


# --------------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Config:
    """One launch configuration (like `triton.Config`): constexpr meta-parameters plus compiler options.

    Frozen and hashable: it is an equation param, and params take part in jit caching.
    """
    meta: tuple[tuple[str, Any], ...] = ()
    num_warps: int = 4
    num_stages: int = 1

    @staticmethod
    def of(*, num_warps: int = 4, num_stages: int = 1, **meta: Any) -> "Config":
        return Config(tuple(sorted(meta.items())), num_warps, num_stages)

    def __post_init__(self):
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two from 1 to 32; got {self.num_warps}")
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"num_stages must be a positive int; got {self.num_stages!r}")

    def __getitem__(self, name: str) -> Any:
        return dict(self.meta)[name]

    def replace(self, **meta: Any) -> "Config":
        return Config(tuple(sorted({**dict(self.meta), **meta}.items())), self.num_warps, self.num_stages)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# --------------------------------------------------------------------------------------------------
# The primitive
# --------------------------------------------------------------------------------------------------

xkern_kernel_p = Primitive("xkern_kernel")
xkern_kernel_p.multiple_results = True


def launch(fn, *args, kernel: str, out_shapes: Sequence[jax.ShapeDtypeStruct], grid: Sequence[int],
           config: Config, backend: str, constexprs: dict[str, Any] | None = None,
           aliases: dict[int, int] | None = None, zeroed: Sequence[int] = (),
           info: Any = None) -> list[jax.Array]:
    """Launch the Triton kernel `fn` once and return its outputs, one array per `out_shapes` entry.

    args: arrays and Python scalars in the kernel's parameter order. The kernel's parameters are
        these inputs, then one pointer per output, then its constexprs (jax_triton's order).
    kernel: the kernel's name, shown in the jaxpr (`kernel="softmax_fwd"`).
    grid: up to three program counts, each >= 1.
    config: meta-parameters and num_warps/num_stages, chosen before lowering (never tuned inside).
    constexprs: further constexpr arguments that are not tuning knobs.
    aliases: {index into args: index into outputs}: that output is written in place over that input.
    zeroed: outputs filled with zeros before the kernel runs (for kernels that accumulate atomically).
    info: opaque, hashable data the op's batching rule needs (never passed to the kernel).
    """
    if backend not in ("triton", "interpret"):
        raise ValueError(f"launch needs backend 'triton' or 'interpret'; got {backend!r}")
    resolve_backend(backend)  # one Triton fixed in the other mode at import: say so now, not in a callback
    grid = tuple(int(g) for g in grid)
    if not 1 <= len(grid) <= 3 or min(grid) < 1:
        raise ValueError(f"{kernel}: grid must be 1 to 3 program counts, each >= 1; got {grid}")
    out_shapes = tuple(jax.ShapeDtypeStruct(tuple(s.shape), np.dtype(s.dtype)) for s in out_shapes)
    arrays, scalars = [], []
    for i, a in enumerate(args):
        if isinstance(a, (bool, int, float)):
            scalars.append((i, a))
        else:
            arrays.append(a)
    array_index = {i: n for n, i in enumerate(i for i, a in enumerate(args)
                                              if not isinstance(a, (bool, int, float)))}
    aliases = tuple(sorted((array_index[i], o) for i, o in (aliases or {}).items()))
    for i, o in aliases:
        a, s = arrays[i], out_shapes[o]
        if (tuple(a.shape), np.dtype(a.dtype)) != (s.shape, s.dtype):
            raise ValueError(f"{kernel}: aliased input {i} {a.dtype}{list(a.shape)} does not match "
                             f"output {o} {s.dtype}{list(s.shape)}")
    return xkern_kernel_p.bind(
        *arrays, kernel=kernel, fn=fn, scalars=tuple(scalars), out_shapes=out_shapes, grid=grid,
        config=config, constexprs=tuple(sorted((constexprs or {}).items())), aliases=aliases,
        zeroed=tuple(zeroed), backend=backend, info=info)


xkern_kernel_p.def_impl(functools.partial(_compat.apply_primitive, xkern_kernel_p))
_compat.require_devices_when_lowering(xkern_kernel_p)  # sharded programs partition launches


def _abstract_eval(*avals, out_shapes, **params):
    """Inside shard_map a launch works on each device's own values: its outputs vary over every
    mesh axis an input varies over. Under a mesh of Explicit axes (values typed with their
    shardings) its outputs are typed as the partitioner will split them (partition.py)."""
    shardings = [None] * len(out_shapes)
    if not any(_compat.varying_axes(a) for a in avals) and _compat.explicit_mesh(avals) is not None:
        from xkern.kernels import partition
        shardings = partition.typed_shardings(avals, dict(params, out_shapes=out_shapes))
    return [_compat.shaped_array_like(s.shape, s.dtype, avals, sharding) for s, sharding in zip(out_shapes, shardings)]


xkern_kernel_p.def_abstract_eval(_abstract_eval)


def varying_alike(op):
    """`op` (a custom_vjp function) with its array arguments made to vary alike inside shard_map:
    each over every mesh axis one of them varies over (jax's pvary; its transpose sums a replicated
    argument's gradient over the devices, as jax does where such an argument meets a per-device one).
    Without it the backward kernels' cotangents, computed from per-device values, would not have
    their replicated primals' type. Outside shard_map nothing changes. Under a mesh of Explicit axes
    each gradient is resharded to its primal's type (`_typed_vjp`)."""
    arrays = (jax.Array, jax.core.Tracer, np.ndarray, np.generic)  # static arguments are neither

    @functools.wraps(op)
    def alike(*args):
        varying = frozenset().union(*(_compat.varying_axes(jax.typeof(a)) for a in args
                                      if isinstance(a, arrays)))
        if varying:
            args = [_compat.vary(jax.numpy.asarray(a), tuple(sorted(varying - _compat.varying_axes(jax.typeof(a)))))
                    if isinstance(a, arrays) else a for a in args]
        return op(*args)

    alike.defvjp = lambda fwd, bwd, **kw: op.defvjp(*_typed_vjp(fwd, bwd, op.nondiff_argnums), **kw)
    return alike


@jax.tree_util.register_pytree_node_class
class _Typed:
    """A custom_vjp's residuals and, as static data, the shardings its differentiated arguments were
    typed with (None: not on a mesh of Explicit axes)."""

    def __init__(self, residuals, shardings):
        self.residuals, self.shardings = residuals, shardings

    def tree_flatten(self):
        return (self.residuals,), self.shardings

    @classmethod
    def tree_unflatten(cls, shardings, children):
        return cls(children[0], shardings)


def _typed_vjp(fwd, bwd, nondiff_argnums):
    """fwd and bwd of a custom_vjp whose bwd returns each gradient with its primal's sharding: under
    a mesh of Explicit axes the kernels' cotangents come typed as the launches split (an operand
    replicated beside a sharded one gets a gradient typed sharded), and jax wants each gradient of
    its primal's type."""
    def typed_fwd(*args):
        out, residuals = fwd(*args)
        diff = [getattr(a, "value", a) for i, a in enumerate(args) if i not in nondiff_argnums]  # (symbolic_zeros:
        # CustomVJPPrimal)
        avals = [jax.typeof(a) if hasattr(a, "shape") else None for a in diff]
        explicit = _compat.explicit_mesh([a for a in avals if a is not None]) is not None
        return out, _Typed(residuals, tuple(a and a.sharding for a in avals) if explicit else None)

    def typed_bwd(*args):
        *static, typed, cotangents = args
        grads = bwd(*static, typed.residuals, cotangents)
        if typed.shardings is None:
            return grads
        return tuple(g if s is None or g is None else _compat.resharded(g, s) for g, s in zip(grads, typed.shardings))
    return typed_fwd, typed_bwd


def _no_jvp(primals, tangents, *, kernel, **_):
    raise NotImplementedError(
        f"xkern kernel {kernel!r} is differentiated by its op's custom_vjp, not by forward mode; "
        "use jax.grad / jax.vjp on the op (forward-mode jax.jvp is not supported). A derivative of a "
        "gradient taken through xkern's kernels (jax.grad of a function that calls "
        "jax.grad(xkern.optimize(f)): a gradient penalty, MAML, a Hessian; or jax.jvp of jax.grad: a "
        "Hessian-vector product) differentiates the kernels themselves: give xkern the whole "
        "computation instead, e.g. xkern.jit(lambda x, v: jax.jvp(jax.grad(f), (x,), (v,))) or "
        "xkern.optimize(lambda x: jax.grad(lambda y: jnp.sum(jax.grad(f)(y) ** 2))(x)): it replaces "
        "what is differentiated backwards and leaves the rest to jax")


ad.primitive_jvps[xkern_kernel_p] = _no_jvp


def _ordered_args(arrays, scalars):
    """Arrays and scalars back in the kernel's parameter order."""
    out, it, by_pos = [], iter(arrays), dict(scalars)
    for i in range(len(arrays) + len(scalars)):
        out.append(by_pos[i] if i in by_pos else next(it))
    return out


# --------------------------------------------------------------------------------------------------
# Lowering: CUDA / ROCm through jax_triton
# --------------------------------------------------------------------------------------------------

class _RecordingBackend:
    """Triton's CUDA backend, keeping the metadata dict that compiling fills in."""

    def __init__(self, backend):
        self._backend, self.metadata = backend, {}

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def make_ttir(self, src, metadata, *args):
        self.metadata = metadata
        if _is_gluon_module(src):  # already TTGIR: Gluon's front end lays out every value itself
            return src
        return self._backend.make_ttir(src, metadata, *args)

    def make_ttgir(self, src, metadata, options, capability):
        if _is_gluon_module(src):
            return self._backend.gluon_to_ttgir(src, metadata, options, capability)
        return self._backend.make_ttgir(src, metadata, options, capability)


# Gluon (triton.experimental.gluon, Triton >= 3.5) kernels are written at Triton's layout level:
# explicit warp partitions, mbarriers and asynchronous wgmma. jax_triton 0.3.1 knows only Triton's
# front end, so its two steps that see the language are redirected here: building the IR (Gluon's
# module carries its target, warp count and register cap as attributes) and the passes that make it
# TTGIR (Gluon's own, in place of the TTIR ones).
def is_gluon(fn) -> bool:
    """Whether kernel `fn` is written in Gluon (a GluonJITFunction)."""
    return getattr(fn, "is_gluon", lambda: False)()


def _is_gluon_module(module) -> bool:
    """Whether `module`, on its way to TTGIR, came from Gluon: Triton's TTIR has no warp count yet."""
    return module.get_int_attr("ttg.num-warps") is not None


class _GluonAwareCodeGen:
    """jax_triton's `code_gen` module, building a Gluon kernel's IR with Gluon's front end. A Gluon
    kernel may set `xkern_maxnreg` (registers per thread at launch): a warp-specialized one must,
    so that all its warps' registers fit the SM before its partitions rebalance them."""

    def __init__(self, code_gen, capability):
        self._code_gen, self._capability = code_gen, capability

    def __getattr__(self, name):
        return getattr(self._code_gen, name)

    def ast_to_ttir(self, fn, src, *, options, codegen_fns, context, module_map):
        if not is_gluon(fn):
            return self._code_gen.ast_to_ttir(fn, src, options=options, codegen_fns=codegen_fns, context=context,
                                              module_map=module_map)
        return gluon_module(fn, src, options, codegen_fns, context, module_map, self._capability())


def gluon_module(fn, src, options, codegen_fns, context, module_map, capability: int):
    """The TTGIR module of Gluon kernel `fn` for an NVIDIA GPU of compute `capability` (e.g. 90),
    from jax_triton's ASTSource `src` (its signature, constants and attributes)."""
    from triton._C.libtriton import ir
    from triton.compiler.code_generator import ast_to_ttir
    from triton.experimental.gluon._runtime import GluonASTSource

    gluon_src = GluonASTSource(fn, src.signature, src.constants, src.attrs)
    builder = ir.builder(context)
    module = builder.create_module()
    module.set_attr("ttg.target", builder.get_string_attr(f"cuda:{capability}"))
    module.set_attr("ttg.num-warps", builder.get_int32_attr(options.num_warps))
    module.set_attr("ttg.num-ctas", builder.get_int32_attr(options.num_ctas))
    module.set_attr("ttg.threads-per-warp", builder.get_int32_attr(32))
    maxnreg = getattr(fn, "xkern_maxnreg", None)
    if maxnreg:
        module.set_attr("ttg.maxnreg", builder.get_int32_attr(maxnreg))
    return ast_to_ttir(fn, gluon_src, context=context, options=options, codegen_fns=codegen_fns,
                       module_map=module_map, module=module)


class _KernelsAsCompiled:
    """jaxlib's Triton module, whose TritonKernel gets what the last compile decided rather than
    what was asked: the warp count (Hopper warp specialization turns 4 warps asked into 12: launched
    with 4, the kernel fails) and the global scratch size."""

    def __init__(self, lib, compiled, with_scratch: bool):
        self._lib, self._compiled, self.with_scratch = lib, compiled, with_scratch

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def TritonKernel(self, name, num_warps, *args, **kwargs):  # noqa: N802 (jaxlib's name)
        metadata, self._compiled.metadata = getattr(self._compiled, "metadata", {}), {}
        scratch = metadata.get("global_scratch_size") or 0
        if scratch and self.with_scratch:
            kwargs.update(global_scratch_size=scratch,
                          global_scratch_align=metadata.get("global_scratch_align") or 1)
        return self._lib.TritonKernel(name, metadata.get("num_warps") or num_warps, *args, **kwargs)


def _kernels_as_compiled():
    """Patch jax_triton (0.3.1, CUDA) to build each kernel as Triton compiled it (_KernelsAsCompiled)."""
    from jax_triton import triton_lib as jt

    if isinstance(jt.triton_kernel_call_lib, _KernelsAsCompiled):
        return jt.triton_kernel_call_lib
    lib, compile_ptx, compiled = jt.triton_kernel_call_lib, jt.compile_ttir_to_ptx_inplace, threading.local()

    def compile_recording(ttir, backend, options, capability):
        recording = _RecordingBackend(backend)
        result = compile_ptx(ttir, recording, options, capability)
        compiled.metadata = recording.metadata
        return result

    jt.compile_ttir_to_ptx_inplace = compile_recording
    jt.code_gen = _GluonAwareCodeGen(jt.code_gen, lambda: int(lib.get_compute_capability(0)))
    jt.triton_kernel_call_lib = _KernelsAsCompiled(
        lib, compiled, "global_scratch_size" in (lib.TritonKernel.__init__.__doc__ or ""))
    return jt.triton_kernel_call_lib


@functools.cache
def global_scratch_supported() -> bool:
    """Whether kernels that build TMA descriptors on the device can run: they need a global scratch
    buffer (128 bytes per descriptor and program), which Triton's own launcher allocates. jaxlib
    allocates it since jax 0.11 (TritonKernel's `global_scratch_size`), but jax_triton 0.3.1 does
    not pass the size (jaxlib then passes a null buffer and the kernel faults): xkern passes it."""
    return _kernels_as_compiled().with_scratch


def tma_supported() -> bool:
    """TMA descriptor loads (built on the device) in kernels: an NVIDIA GPU of compute capability
    9.0 or newer, and a jaxlib that allocates their scratch (global_scratch_supported)."""
    if INTERPRET or vendor() != "cuda":
        return False
    major = int(str(getattr(jax.devices()[0], "compute_capability", "0")).split(".")[0])
    return major >= 9 and global_scratch_supported()


def hopper(gpu: str | None = None) -> bool:
    """Whether kernels written for Hopper (its wgmma, in Gluon) run: on this process's device (gpu
    None), an NVIDIA GPU of compute capability 9.x with TMA (tma_supported); ahead of time, for
    `gpu` "cuda" (an H200, as attention's configs name it)."""
    if gpu is not None:
        return gpu == "cuda"
    if not tma_supported():
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "0")).split(".")[0] == "9"


def vendor() -> str:
    """The GPU vendor of jax's first device: "rocm" or "cuda" (jax names both platforms "gpu")."""
    device = jax.devices()[0]
    version = str(getattr(device.client, "platform_version", "")).lower()
    return "rocm" if device.platform == "rocm" or "rocm" in version else "cuda"


def _triton_call(*arrays, kernel, fn, scalars, out_shapes, grid, config, constexprs, aliases, zeroed,
                 backend, info):
    import jax_triton  # lazily: it cannot be imported with a CPU-only jaxlib

    _kernels_as_compiled()  # before the first compile
    return jax_triton.triton_call(
        *_ordered_args(arrays, scalars), kernel=fn, out_shape=list(out_shapes), grid=grid,
        name=kernel, num_warps=config.num_warps, num_stages=config.num_stages,
        input_output_aliases=dict(aliases), zeroed_outputs=zeroed,
        **dict(config.meta), **dict(constexprs))


def _lower(ctx, *arrays, platform, **params):
    if getattr(ctx.module_context.lowering_parameters, "for_export", False):
        raise ValueError(
            f"jax.export of a program that launches xkern's kernel {params['kernel']!r}: xkern's kernels "
            "are Triton kernels built for the tracing machine (custom calls jax cannot serialize, host "
            "callbacks on CPU), so they cannot be exported. Export the program as XLA computes it: "
            "xkern.jit(f, backend='xla') or jax.jit(f)")
    rule = _SPLIT_RULES.get(params["kernel"])
    # (custom_partitioning needs an operand to shard by: a launch of none runs whole on every device)
    if rule is not None and arrays and _compat.partitioned_lowering(ctx):
        from xkern.kernels import partition  # each device launches on its own share (partition.py)
        return partition.lower(ctx, arrays, params, rule)
    if params["backend"] == "interpret" and platform == "cpu" and _compat.manual_lowering(ctx):
        from xkern.kernels import partition  # a host callback cannot run in a device's share
        return partition.lower_interpreted(ctx, arrays, params)
    if params["backend"] == "interpret":
        return mlir.lower_fun(functools.partial(_interpret_call, **params), multiple_results=True)(
            ctx, *arrays)
    if platform == "cpu":
        raise ValueError(f"xkern kernel {params['kernel']!r} was launched with backend='triton' on "
                         "CPU arrays; Triton kernels need a CUDA or ROCm device")
    return mlir.lower_fun(functools.partial(_triton_call, **params), multiple_results=True)(
        ctx, *arrays)


for _platform in ("cpu", "cuda", "rocm"):
    mlir.register_lowering(xkern_kernel_p, functools.partial(_lower, platform=_platform),
                           platform=_platform)


# --------------------------------------------------------------------------------------------------
# Lowering: Triton's interpreter in a host callback
# --------------------------------------------------------------------------------------------------

_INTERPRETER_LOCK = threading.Lock()  # the interpreter patches triton.language while it runs


class _HostTensor:
    """The part of a torch tensor that Triton's interpreter touches, over a contiguous numpy array.

    The interpreter copies each argument "to the host" and back; the data already is on the host,
    so those copies are identities and the kernel reads and writes the numpy buffer directly.
    """

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = _triton_dtype(array.dtype)

    def data_ptr(self):
        return self.array.ctypes.data

    def cpu(self):
        return self

    untyped_storage = cpu

    def new_empty(self, *args, **kwargs):
        return self

    def set_(self, *args, **kwargs):
        return self

    def copy_(self, other):
        return self

    def storage_offset(self):
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)


@functools.cache
def _triton_dtype(dtype: np.dtype):
    import triton.language as tl

    name = "bool" if dtype == np.bool_ else np.dtype(dtype).name
    table = {"float32": tl.float32, "float16": tl.float16, "bfloat16": tl.bfloat16,
             "float64": tl.float64, "int8": tl.int8, "int16": tl.int16, "int32": tl.int32,
             "int64": tl.int64, "uint8": tl.uint8, "uint16": tl.uint16, "uint32": tl.uint32,
             "uint64": tl.uint64, "bool": tl.int1}
    if name not in table:
        raise TypeError(f"xkern kernels take no {name} buffers")
    return table[name]


def _poisoned(shape, dtype):
    """A fresh output buffer full of a value no kernel writes by accident, so unwritten elements show."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.inexact) or dtype.name == "bfloat16":
        return np.full(shape, np.nan, dtype)
    if dtype == np.bool_:
        return np.ones(shape, dtype)
    return np.full(shape, np.iinfo(dtype).min // 2 + 7 if np.issubdtype(dtype, np.signedinteger)
                   else np.iinfo(dtype).max - 7, dtype)


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even as GPUs convert (NaN stays NaN)."""
    bits = values.astype(np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), ((bits >> 16) | 0x40).astype(np.uint16), rounded)


@functools.cache
def _round_interpreted_casts():
    """Triton's interpreter (3.6-3.9) truncates float32 -> bfloat16 and takes an integer's value as
    bfloat16 bits (1 became 0, -1 NaN), where GPUs round to nearest even: casts to bfloat16 from
    anything but bfloat16 go through float32 rounded here, so interpreted kernels give XLA's values."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "cast_impl"):
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        source = src.dtype.scalar
        if dst_type.scalar != tl.bfloat16 or source == tl.bfloat16:
            return original(self, src, dst_type)
        values = original(self, src, tl.float32).data if source.is_floating() else src.data
        return interpreter.TensorHandle(_bfloat16_bits(np.asarray(values)), tl.bfloat16)

    builder.cast_impl = cast_impl
    _boolean_comparisons(builder)


def _boolean_comparisons(builder):
    """The interpreter's comparisons keep their operands' type in the result's handle, which a scalar
    result's broadcast then converts to (`max(scalar, x)`'s NaN test `a != a` became float32, and `|`
    refused it): comparison results are int1, as compiled Triton types them."""
    import triton.language as tl
    from triton.runtime import interpreter

    for name in dir(builder):
        if name.startswith(("create_icmp", "create_fcmp")):
            def compare(self, lhs, rhs, _original=getattr(builder, name)):
                result = _original(self, lhs, rhs)
                return interpreter.TensorHandle(np.asarray(result.data, np.bool_), tl.int1)
            setattr(builder, name, compare)


def _run_interpreted(*arrays, kernel, fn, scalars, out_shapes, grid, config, constexprs, aliases,
                     zeroed, backend, info):
    _round_interpreted_casts()
    inputs = [np.ascontiguousarray(a) for a in arrays]
    aliased = {o: i for i, o in aliases}
    outs = []
    for o, s in enumerate(out_shapes):
        if o in aliased:
            outs.append(np.array(inputs[aliased[o]], copy=True))
        elif o in zeroed:
            outs.append(np.zeros(s.shape, s.dtype))
        else:
            outs.append(_poisoned(s.shape, s.dtype))
    args = [_HostTensor(a) if isinstance(a, np.ndarray) else a
            for a in _ordered_args(inputs, scalars)] + [_HostTensor(o) for o in outs]
    # Masked-off lanes compute on padding (inf - inf, 0 / 0) that is never stored: numpy's warnings
    # about it are noise.
    with _INTERPRETER_LOCK, np.errstate(all="ignore"):
        fn[grid](*args, **dict(config.meta), **dict(constexprs))
    return outs


def _interpret_call(*arrays, **params):
    return jax.pure_callback(functools.partial(_run_interpreted, **params),
                             list(params["out_shapes"]), *arrays)


# --------------------------------------------------------------------------------------------------
# Batching: each op family registers a rule for its kernels
# --------------------------------------------------------------------------------------------------

_BATCHING_RULES: dict[str, Any] = {}


def def_batching(kernel: str, rule) -> None:
    """Register `rule(args, dims, **params) -> (outs, out_dims)` for the kernel named `kernel`."""
    if kernel in _BATCHING_RULES and _BATCHING_RULES[kernel] is not rule:
        raise ValueError(f"kernel {kernel!r} already has a batching rule")
    _BATCHING_RULES[kernel] = rule


def _batch(args, dims, **params):
    rule = _BATCHING_RULES.get(params["kernel"])
    if rule is None:
        raise NotImplementedError(f"xkern kernel {params['kernel']!r} has no batching rule; "
                                  "register one with xkern.kernels.launch.def_batching")
    return rule(args, dims, **params)


batching.primitive_batchers[xkern_kernel_p] = _batch


def batch_rows(relaunch):
    """A batching rule for row kernels: each array argument and output has rows as its leading dim.

    The vmapped dim is folded into the rows (one launch over batch * rows), then split off again.
    `relaunch(*arrays, **params)` launches the same kernel for the new row count.
    """
    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        folded = []
        for a, d in zip(args, dims):
            a = jax.numpy.broadcast_to(a, (size, *a.shape)) if d is None else jax.numpy.moveaxis(a, d, 0)
            folded.append(a.reshape(size * a.shape[1], *a.shape[2:]))
        outs = relaunch(*folded, **params)
        return [o.reshape(size, -1, *o.shape[1:]) for o in outs], [0] * len(outs)
    return rule


# --------------------------------------------------------------------------------------------------
# Partitioning: each op family says how its kernels split in a sharded program (partition.py)
# --------------------------------------------------------------------------------------------------

ROWS = "rows"  # dim 0 is the split dim: each device holds (operand) or writes (output) its share
SUMMED = "summed"  # an output of partial sums along dim 0, read only through their total
SHARED = None  # the same on every device: a shared operand (a norm's scale), a placeholder output


@dataclasses.dataclass(frozen=True)
class Split:
    """How one launch splits along dim 0: a role (ROWS, SUMMED or SHARED) per array operand and per
    output, and `relaunch(*arrays, **params)`, which launches the same kernel on one device's share
    of the split operands (the shared ones whole) and returns that share of every output (SUMMED
    outputs: any number of rows whose total is the device's part of the sum). `fits(parts)`: whether
    the launch splits into that many equal shares (beyond dim 0 dividing evenly, which is checked).

    A second, independent split (attention's heads, which tensor parallelism shards): `heads_args`
    and `heads_outs` give each operand's and output's dim that splits with it (None: the same on
    every device along it), `heads_fits(parts)` whether it splits that many ways; relaunch then also
    gets each device's heads (and reads how many from the shapes it is given). `heads_reduced`, per
    output: None, or how the devices' shares of an output that reduces along that dim combine
    ("sum", "max", "min": a generated kernel's row sums over its columns), all-reduced across them.
    `heads_relaunch`, where the devices' shares combine by more than an all-reduce of each output
    (cross-entropy over a sharded vocabulary: a logsumexp of logsumexps): called in relaunch's place
    as heads_relaunch(*arrays, heads=<the mesh axes>, rows=<the rows' axes>, **params), it runs the
    collectives itself. `heads_else`: another Split of the same launch whose second split is along
    other dims (norms: a sequence, else the features), tried where this one's dims are not sharded.
    `heads_rows`: this second split is along a dim of independent rows (with_row_dims), so it
    combines with the launch's other such splits: any of the rows' dims may be sharded at once."""
    args: tuple
    outs: tuple
    relaunch: Any
    fits: Any = None
    heads_args: tuple = ()
    heads_outs: tuple = ()
    heads_fits: Any = None
    heads_reduced: tuple = ()
    heads_relaunch: Any = None
    heads_else: Any = None
    heads_rows: bool = False


def with_row_dims(split: Split, n_dims: int, then: Split | None = None) -> Split:
    """`split`, and after its own second splits (Split.heads_else) one along each of dims
    1..n_dims-1 of its ROWS operands and outputs: for kernels that read their rows flat, of views
    that keep the rows' dims (the heads of [b, s, h, d] that tensor parallelism shards, a sequence
    that sequence parallelism shards), or along several of them at once (Split.heads_rows: a
    sequence and heads both sharded). Rows are independent, so each device launches on its share.
    `then`: a split tried after the rows' dims (norms: along the features)."""
    own = [split] if split.heads_args else []
    while own and own[-1].heads_else is not None:
        own.append(own[-1].heads_else)
    along = [dataclasses.replace(split, heads_args=tuple(d if r == ROWS else None for r in split.args),
                                 heads_outs=tuple(d if r == ROWS else None for r in split.outs),
                                 heads_fits=lambda parts: True, heads_reduced=(), heads_relaunch=None,
                                 heads_rows=True)
             for d in range(1, n_dims)]
    chained = None
    for alternative in reversed(own + along + ([then] if then else [])):
        chained = dataclasses.replace(alternative, heads_else=chained)
    return chained or split


def rows_view(x, n_cols_dims: int = 1):
    """x as a row kernel's view [*rows, cols], its last n_cols_dims dims made the row: its leading
    dims kept (with_row_dims), one row where there are none."""
    lead, n_cols = x.shape[:x.ndim - n_cols_dims], int(np.prod(x.shape[x.ndim - n_cols_dims:]))
    return x.reshape((*lead, n_cols) if lead else (1, n_cols))


def n_rows(view) -> int:
    """The rows of a row kernel's view [*rows, cols]."""
    return int(np.prod(view.shape[:-1], dtype=np.int64))


_SPLIT_RULES: dict[str, Any] = {}


def def_split(kernel: str, rule) -> None:
    """Register `rule(params) -> Split` for the kernel named `kernel`."""
    if kernel in _SPLIT_RULES and _SPLIT_RULES[kernel] is not rule:
        raise ValueError(f"kernel {kernel!r} already has a split rule")
    _SPLIT_RULES[kernel] = rule


def split_rows(relaunch, n_args: int, n_outs: int, shared_args=(), shared_outs=()):
    """A split rule for row kernels whose operands and outputs all have rows as dim 0, except the
    operands and outputs at the indices given (shared)."""
    split = Split(tuple(SHARED if i in shared_args else ROWS for i in range(n_args)),
                  tuple(SHARED if i in shared_outs else ROWS for i in range(n_outs)), relaunch)
    return lambda params: split


# --------------------------------------------------------------------------------------------------
# Reading launches back out of a jaxpr
# --------------------------------------------------------------------------------------------------

def launches(jaxpr) -> list:
    """Every xkern launch equation in `jaxpr` (a Jaxpr or ClosedJaxpr), sub-jaxprs included."""
    from jax.extend.core import jaxprs_in_params

    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is xkern_kernel_p:
            found.append(eqn)
        for sub in jaxprs_in_params(eqn.params):
            found.extend(launches(sub))
    return found


def kernel_names(jaxpr) -> list[str]:
    """The `kernel` param of every xkern launch in `jaxpr` (a Jaxpr or ClosedJaxpr), sub-jaxprs included."""
    return [eqn.params["kernel"] for eqn in launches(jaxpr)]


# Numeric options of the ops (a scale, eps, label smoothing): constants of the kernels

def static_number(value) -> float | None:
    """`value` as a Python float when it is a number known while tracing (a Python or NumPy scalar,
    a 0-d concrete array), else None (a string, a bool, an array, a traced value). The ops' numeric
    options become constants of the kernels, so they must be known when the kernel is made."""
    if isinstance(value, (bool, np.bool_, jax.core.Tracer)):
        return None
    if isinstance(value, numbers.Real):  # int, float and NumPy's integer and floating scalars
        return float(value)
    if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0 and (
            jax.numpy.issubdtype(value.dtype, np.integer) or jax.numpy.issubdtype(value.dtype, np.floating)):
        return float(value)
    return None


def dtype_or_none(value):
    """`value` as a NumPy dtype, or None where it names none (so the op's own error can name it)."""
    try:
        return jax.numpy.dtype(value)
    except TypeError:
        return None


def number_error(op: str, name: str, want: str, value) -> ValueError:
    """The error for a numeric option that is not `want` (see static_number)."""
    if isinstance(value, jax.core.Tracer):
        return ValueError(f"{op}: {name} must be {want}, known when tracing (it is a constant of the kernel); "
                          f"got a traced value {value}")
    return ValueError(f"{op}: {name} must be {want}; got {value!r}")
